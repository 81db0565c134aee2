"""Virtual machines as Linux network namespaces: one namespace per VM, a bridge between them.

    ┌ <tag>-br (bridge namespace) ───────────────────────────┐
    │  br0 ── h-coord ── h-redis ── h-node1 ── h-client ...  │   one veth pair per VM,
    └────────┼──────────┼──────────┼──────────┼──────────────┘   its bridge end named h-<vm>
       eth0 10.213.0.2 .3         .4         .5  ...             and its VM end eth0
       <tag>-coord     <tag>-redis <tag>-node1 <tag>-client

Every address lives inside a namespace this module created (10.213.0.0/24 and, on each VM's
loopback, the link-local metadata address 169.254.169.254), so nothing here can reach or be
reached from any other network. `partition` takes a VM's bridge end down (the VM drops off
the network, as a cut cable or a zone outage would) and `heal` brings it back. `cut_off`
drops, inside one VM, every packet it sends to one address (a security group or route that
went wrong: the rest of the network still answers) and `reconnect` lifts it.

Namespaces are named ``<prefix><pid>x<run id>-<vm>``; `sweep_leftovers` removes everything under
the prefix that an earlier, killed run left behind, and `Network.close` removes the run's own
namespaces, the processes in them and their /etc/netns files, also after a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

NAME_PREFIX = "sprh"
SUBNET_PREFIX = "10.213.0"
SUBNET_BITS = 24
METADATA_ADDRESS = "169.254.169.254"
# /etc/hosts inside a namespace: `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over it.
ETC_NETNS = Path("/etc/netns")
NETNS_RUN_DIR = Path("/run/netns")
BRIDGE = "br0"
VM_INTERFACE = "eth0"
_CLONE_NEWNET = 0x40000000
_KILL_WAIT_SECONDS = 5.0
_NOWHERE_MAC = "02:00:5e:00:de:ad"  # locally administered; no VM's interface has it
# Hosts a VM's resolver knows without DNS: the GCP metadata server's name.
_METADATA_HOSTNAMES = ("metadata.google.internal", "metadata")


class NamespacesUnavailable(RuntimeError):
    """Not root, or no `ip netns` on this machine: the rehearsal cannot build its network."""


def unavailable_reason() -> str:
    """Why namespaces cannot be made here; empty when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (the rehearsal runs `ip netns add`)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def list_namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(word) for word in out.split() if word.isdigit()]


def kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process in `namespace` and wait (briefly) until none is left."""
    deadline = time.monotonic() + _KILL_WAIT_SECONDS
    while pids := namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


def delete_namespace(namespace: str) -> None:
    kill_namespace_processes(namespace)
    _ip("netns", "delete", namespace, check=False)  # its veth ends go with it
    shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)


def _owner_alive(name: str, prefix: str) -> bool:
    """Whether the process that made namespace `name` (``<prefix><pid>x...``) still runs."""
    pid = name[len(prefix) :].partition("x")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers(prefix: str = NAME_PREFIX, alive_only: bool = True) -> list[str]:
    """Remove the namespaces named with `prefix` (and their processes) that a run killed
    before its cleanup left; with `alive_only`, spare those whose maker still runs (another
    rehearsal on this machine). The names removed."""
    swept = [
        name
        for name in list_namespaces()
        if name.startswith(prefix) and not (alive_only and _owner_alive(name, prefix))
    ]
    for name in swept:
        delete_namespace(name)
    if ETC_NETNS.exists():
        for leftover in ETC_NETNS.glob(f"{prefix}*"):
            if not (alive_only and _owner_alive(leftover.name, prefix)):
                shutil.rmtree(leftover, ignore_errors=True)
    return swept


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Run this thread inside `namespace` for the block: a socket made here belongs to it
    (and keeps belonging to it afterwards), which is how in-process servers listen in a VM.
    Only this thread moves; the rest of the process stays where it was."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_RUN_DIR / namespace, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


@dataclass
class Host:
    """One VM: its namespace, its address on the bridge, and its bridge-side interface."""

    name: str
    namespace: str
    address: str
    bridge_namespace: str
    bridge_port: str
    hosts_entries: dict[str, str] = field(default_factory=dict)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this VM."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.command(argv), capture_output=True, text=True)
        if check and result.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)}: {result.stderr.strip()}")
        return result

    def entered(self) -> contextlib.AbstractContextManager[None]:
        return entered(self.namespace)

    def add_hosts_entry(self, hostname: str, address: str) -> None:
        """A line of this VM's /etc/hosts (seen by processes started after this call)."""
        self.hosts_entries[hostname] = address
        self.write_hosts()

    def write_hosts(self) -> None:
        # A VM's own hostname resolves to its private address, as on a cloud image; the
        # namespaces share this machine's hostname, so each maps it to its own address.
        lines = ["127.0.0.1 localhost", f"{self.address} {self.name} {socket.gethostname()}"]
        lines += [f"{ip} {name}" for name, ip in self.hosts_entries.items()]
        directory = ETC_NETNS / self.namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")


class Network:
    """``with Network() as net: coord = net.add_host("coord")``: namespaces, bridge, veths.

    Everything it made goes at `close` (processes in its namespaces are SIGKILLed), which
    ``with`` calls also when the block raises.
    """

    def __init__(self, run_id: str | None = None, prefix: str = NAME_PREFIX) -> None:
        # The maker's pid in the name lets a later sweep tell a leftover from a live run.
        self.tag = f"{prefix}{os.getpid()}x{run_id or secrets.token_hex(2)}"
        self.bridge_namespace = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        self._created: list[str] = []
        self._last_octet = 1  # .1 stays free; addresses are never reused within a run
        self._open = False

    def open(self) -> Network:
        reason = unavailable_reason()
        if reason:
            raise NamespacesUnavailable(reason)
        self._add_namespace(self.bridge_namespace)
        br = self.bridge_namespace
        _ip("-n", br, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", br, "link", "set", BRIDGE, "up")
        _ip("-n", br, "link", "set", "lo", "up")
        self._open = True
        return self

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._created.append(namespace)

    def add_host(self, name: str, metadata_address: bool = True) -> Host:
        """A new VM on the bridge, with the next free address; with `metadata_address`, its
        loopback also holds 169.254.169.254 (where its metadata server will listen)."""
        assert self._open, "open() the network first"
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        namespace = f"{self.tag}-{name}"
        self._last_octet += 1
        address = f"{SUBNET_PREFIX}.{self._last_octet}"
        port = f"h-{name}"[:15]  # IFNAMSIZ
        self._add_namespace(namespace)
        br = self.bridge_namespace
        peer = ("peer", "name", VM_INTERFACE, "netns", namespace)
        _ip("-n", br, "link", "add", port, "type", "veth", *peer)
        _ip("-n", br, "link", "set", port, "master", BRIDGE)
        _ip("-n", br, "link", "set", port, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{SUBNET_BITS}", "dev", VM_INTERFACE)
        _ip("-n", namespace, "link", "set", VM_INTERFACE, "up")
        if metadata_address:
            _ip("-n", namespace, "addr", "add", f"{METADATA_ADDRESS}/32", "dev", "lo")
        host = Host(name, namespace, address, br, port)
        if metadata_address:
            for hostname in _METADATA_HOSTNAMES:
                host.hosts_entries[hostname] = METADATA_ADDRESS
        host.write_hosts()
        self.hosts[name] = host
        return host

    def remove_host(self, host: Host) -> None:
        """The VM is gone: its processes, namespace and link (the veth goes with it)."""
        delete_namespace(host.namespace)
        self._created.remove(host.namespace)
        del self.hosts[host.name]

    def partition(self, host: Host) -> None:
        """Cut `host` off the network: its bridge end goes down, packets to and from it are
        dropped (connections time out rather than being refused)."""
        _ip("-n", host.bridge_namespace, "link", "set", host.bridge_port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", host.bridge_namespace, "link", "set", host.bridge_port, "up")

    def cut_off(self, host: Host, address: str) -> None:
        """`host`'s packets to `address` are lost on the way, as behind a security group that
        drops them: connections there time out, everything else still flows. (Its neighbour
        entry for `address` names a link address no VM has, so the bridge delivers those
        frames nowhere; packet filters need kernel modules a test machine may lack.)"""
        _ip("-n", host.namespace, "neigh", "replace", address, "lladdr", _NOWHERE_MAC,
            "dev", VM_INTERFACE, "nud", "permanent")  # fmt: skip

    def reconnect(self, host: Host, address: str) -> None:
        """Lift `cut_off`: the VM resolves `address` again."""
        _ip("-n", host.namespace, "neigh", "del", address, "dev", VM_INTERFACE)

    def close(self) -> None:
        for namespace in reversed(self._created):
            delete_namespace(namespace)
        self._created.clear()
        self.hosts.clear()
        self._open = False

    def __enter__(self) -> Network:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
