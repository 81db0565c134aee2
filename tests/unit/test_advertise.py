"""The advertised address: from each cloud's metadata service in its own format and headers
(local servers that refuse a request without them), the bound host otherwise."""

from __future__ import annotations

import pytest

from common.advertise import AdvertiseError, metadata_private_address, resolve_advertise_address
from spotinfer.local.metadata_servers import (
    AwsImds,
    AzureScheduledEvents,
    GcpMetadata,
    InstanceIdentity,
    MetadataServer,
)

ME = InstanceIdentity(private_ip="10.20.30.40")


@pytest.mark.parametrize("server_type", [AwsImds, GcpMetadata, AzureScheduledEvents])
def test_each_cloud_says_the_private_address(server_type: type[MetadataServer]) -> None:
    with server_type(identity=ME) as server:  # type: ignore[call-arg]
        cloud = server.cloud  # type: ignore[attr-defined]
        assert metadata_private_address(cloud, server.base_url) == "10.20.30.40"
        assert resolve_advertise_address("0.0.0.0", cloud, server.base_url) == "10.20.30.40"


def test_aws_asks_for_an_imdsv2_token_first() -> None:
    with AwsImds(identity=ME) as imds:
        metadata_private_address("aws", imds.base_url)
        put = imds.seen("PUT", "/latest/api/token")
        get = imds.seen("GET", "/latest/meta-data/local-ipv4")
        assert len(put) == 1 and len(get) == 1
        assert get[0].headers["x-aws-ec2-metadata-token"], "a token-less GET is refused"


def test_gcp_and_azure_send_their_headers() -> None:
    with GcpMetadata(identity=ME) as gcp:
        metadata_private_address("gcp", gcp.base_url)
        [seen] = gcp.seen(path="/computeMetadata/v1/instance/network-interfaces/0/ip")
        assert seen.headers["metadata-flavor"] == "Google"
    with AzureScheduledEvents(identity=ME) as azure:
        metadata_private_address("azure", azure.base_url)
        [seen] = azure.seen(
            path="/metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress"
        )
        assert seen.headers["metadata"] == "true"
        assert seen.query["format"] == "text" and seen.query["api-version"]


def test_a_metadata_service_in_another_format_is_an_error() -> None:
    # GCP's server answers 403 to IMDSv2's token PUT.
    with GcpMetadata(identity=ME) as gcp, pytest.raises(AdvertiseError, match="--advertise"):
        metadata_private_address("aws", gcp.base_url)


def test_a_metadata_service_that_is_not_there_is_an_error() -> None:
    with AwsImds() as imds:
        base_url = imds.base_url
    with pytest.raises(AdvertiseError, match="aws metadata service"):
        metadata_private_address("aws", base_url, timeout_seconds=0.5)


def test_without_a_cloud_the_bound_host_is_advertised() -> None:
    assert resolve_advertise_address("10.1.2.3") == "10.1.2.3"
    assert resolve_advertise_address("127.0.0.1", "local") == "127.0.0.1"
    assert resolve_advertise_address("0.0.0.0") not in ("", "0.0.0.0")


def test_the_identity_paths_serve_what_boot_scripts_read() -> None:
    """The labels the boot scripts write into the env file come from these paths."""
    import urllib.request

    identity = InstanceIdentity(instance_type="g2-standard-8", zone="us-central1-a", spot=False)
    with GcpMetadata(identity=identity) as gcp:
        base = f"{gcp.base_url}/computeMetadata/v1/instance/"

        def read(path: str) -> str:
            request = urllib.request.Request(base + path, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=2) as answer:
                return str(answer.read().decode())

        assert read("machine-type").endswith("/machineTypes/g2-standard-8")
        assert read("zone").endswith("/zones/us-central1-a")
        assert read("scheduling/preemptible") == "FALSE"
