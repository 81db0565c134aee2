"""The rehearsal network: VMs reach each other and nothing else, partitions cut, Redis speaks
TLS with AUTH, and nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import redis

from spotinfer.local.metadata_servers import AwsImds, InstanceIdentity
from spotinfer.rehearsal.forwarder import Forwarder
from spotinfer.rehearsal.netns import (
    METADATA_ADDRESS,
    Network,
    list_namespaces,
    sweep_leftovers,
)
from spotinfer.rehearsal.tls_redis import TlsRedis
from store.redis_link import connect
from store.store_config import StoreConfig

pytestmark = pytest.mark.usefixtures("namespaces")


def tcp_reaches(client_command: list[str], address: str, port: int) -> bool:
    probe = f"exec 3<>/dev/tcp/{address}/{port}"
    done = subprocess.run([*client_command, "timeout", "2", "bash", "-c", probe])  # noqa: S603
    return done.returncode == 0


def test_vms_reach_each_other_until_partitioned(tmp_path: Path) -> None:
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        with b.entered():
            server = socket.create_server((b.address, 7000))
        with server:
            assert tcp_reaches(a.command([]), b.address, 7000)
            net.partition(b)
            assert not tcp_reaches(a.command([]), b.address, 7000)
            net.heal(b)
            assert tcp_reaches(a.command([]), b.address, 7000)
        # The rehearsal's addresses exist only inside its namespaces.
        assert b.address not in subprocess.run(["ip", "addr"], capture_output=True).stdout.decode()


def test_a_vm_cut_off_from_one_address_still_reaches_the_others() -> None:
    with Network() as net:
        node, redis_vm, coord = net.add_host("node"), net.add_host("redis"), net.add_host("coord")
        servers = []
        for vm, port in ((redis_vm, 7010), (coord, 7011)):
            with vm.entered():
                servers.append(socket.create_server((vm.address, port)))
        try:
            net.cut_off(node, redis_vm.address)
            assert not tcp_reaches(node.command([]), redis_vm.address, 7010)
            assert tcp_reaches(node.command([]), coord.address, 7011)
            assert tcp_reaches(coord.command([]), redis_vm.address, 7010)  # only node's packets
            net.reconnect(node, redis_vm.address)
            assert tcp_reaches(node.command([]), redis_vm.address, 7010)
        finally:
            for server in servers:
                server.close()


def test_each_vm_has_its_own_metadata_service_at_the_real_address() -> None:
    with Network() as net:
        vms = [net.add_host("n1"), net.add_host("n2")]
        servers = []
        for vm in vms:
            with vm.entered():
                server = AwsImds(
                    identity=InstanceIdentity(instance_id=f"i-{vm.name}"),
                    host=METADATA_ADDRESS,
                    port=80,
                )
            servers.append(server.__enter__())
        try:
            for vm in vms:
                token = vm.run(
                    "curl", "-fsS", "-X", "PUT", "http://169.254.169.254/latest/api/token",
                    "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60",
                ).stdout  # fmt: skip
                answer = vm.run(
                    "curl", "-fsS", "-H", f"X-aws-ec2-metadata-token: {token}",
                    "http://169.254.169.254/latest/meta-data/instance-id",
                ).stdout  # fmt: skip
                assert answer == f"i-{vm.name}"
            # GCP's metadata name resolves to it too, through the VM's own /etc/hosts.
            assert (
                "169.254.169.254 metadata.google.internal" in vms[0].run("cat", "/etc/hosts").stdout
            )
        finally:
            for server in servers:
                server.__exit__(None, None, None)
        # Not from here: this process's namespace has no metadata server of ours.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{METADATA_ADDRESS}:80/", timeout=0.5)


def test_redis_takes_only_tls_with_the_token_and_the_ca(tmp_path: Path) -> None:
    with Network() as net:
        redis_vm, client = net.add_host("redis"), net.add_host("client")
        with TlsRedis(redis_vm, tmp_path) as server, client.entered():
            store_client = connect(server.url(), False, StoreConfig(url=server.url()))
            assert store_client.ping()
            wrong_token = server.url().replace(server.password, "wrong")
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(wrong_token).ping()
            unverified = f"rediss://:{server.password}@{redis_vm.address}:{server.port}/0"
            with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                redis.Redis.from_url(unverified).ping()
            with pytest.raises(redis.ConnectionError):
                redis.Redis(host=redis_vm.address, port=server.port).ping()  # plaintext


def test_forwarder_connects_from_the_client_vm(tmp_path: Path) -> None:
    with Network() as net:
        client, target = net.add_host("client"), net.add_host("target")
        with target.entered():
            server = socket.create_server((target.address, 7001))
        forwarder = Forwarder(client, (target.address, 7001), tmp_path / "f.sock")
        with server, forwarder as fw, socket.socket(socket.AF_UNIX) as inbound:
            inbound.connect(str(fw.path))
            inbound.sendall(b"ping")
            accepted, peer = server.accept()
            with accepted:
                assert accepted.recv(4) == b"ping"
                assert peer[0] == client.address


def test_everything_goes_when_the_block_fails_and_leftovers_are_swept() -> None:
    with pytest.raises(RuntimeError, match="boom"), Network() as net:
        vm = net.add_host("x")
        sleeper = subprocess.Popen(vm.command(["sleep", "60"]))  # noqa: S603
        made = {name for name in list_namespaces() if name.startswith(net.tag)}
        raise RuntimeError("boom")
    assert sleeper.wait(5) != 0
    assert not made & set(list_namespaces())
    # A namespace whose maker is gone (no such pid) is swept; a live run's is not.
    subprocess.run(["ip", "netns", "add", "sprh999999999xdead-vm"], check=True)
    with Network() as live:
        live.add_host("y")
        swept = sweep_leftovers()
        assert "sprh999999999xdead-vm" in swept
        assert not set(swept) & set(list_namespaces())
        assert f"{live.tag}-y" in list_namespaces()
