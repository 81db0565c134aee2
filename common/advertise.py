"""The address a process tells others to reach it at (``--advertise-address``).

A process binds ``--host`` (127.0.0.1 by default, ``0.0.0.0`` on a VM), which is not an
address anyone can dial when it is a wildcard. Unless ``--advertise-address`` is given, the
advertised address is, in order:

- on a cloud VM (``cloud`` aws / gcp / azure), the VM's private address from the cloud's
  metadata service:

      aws    PUT  /latest/api/token  (IMDSv2), then GET /latest/meta-data/local-ipv4
      gcp    GET  /computeMetadata/v1/instance/network-interfaces/0/ip   Metadata-Flavor: Google
      azure  GET  /metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress
                  ?api-version=2021-02-01&format=text                        Metadata: true

- the bound host, when it is not a wildcard;
- this machine's name resolved (a wildcard bind with no cloud).

A metadata service that does not answer is an error (`AdvertiseError`): a VM that
advertises a wrong address would register a worker nobody can reach.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.error
import urllib.request

AWS_METADATA_BASE_URL = "http://169.254.169.254"
GCP_METADATA_BASE_URL = "http://metadata.google.internal"
AZURE_METADATA_BASE_URL = "http://169.254.169.254"
AZURE_API_VERSION = "2021-02-01"
AWS_TOKEN_TTL_SECONDS = 300
METADATA_TIMEOUT_SECONDS = 2.0
METADATA_CLOUDS = ("aws", "gcp", "azure")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class AdvertiseError(RuntimeError):
    """The metadata service did not say this VM's address."""


def resolve_advertise_address(
    host: str,
    cloud: str = "",
    metadata_url: str = "",
    timeout_seconds: float = METADATA_TIMEOUT_SECONDS,
) -> str:
    """The address to advertise for a process bound to ``host`` (see the module docstring).
    ``metadata_url`` replaces the cloud's own metadata address (tests, rehearsals)."""
    if cloud in METADATA_CLOUDS:
        return metadata_private_address(cloud, metadata_url, timeout_seconds)
    if host not in WILDCARD_HOSTS:
        return host
    return socket.gethostbyname(socket.gethostname())


def metadata_private_address(
    cloud: str, base_url: str = "", timeout_seconds: float = METADATA_TIMEOUT_SECONDS
) -> str:
    """The VM's private IPv4 address as ``cloud``'s metadata service says it."""
    try:
        if cloud == "aws":
            text = _aws_local_ipv4(base_url or AWS_METADATA_BASE_URL, timeout_seconds)
        elif cloud == "gcp":
            text = _get(
                f"{base_url or GCP_METADATA_BASE_URL}/computeMetadata/v1/instance/"
                "network-interfaces/0/ip",
                {"Metadata-Flavor": "Google"},
                timeout_seconds,
            )
        elif cloud == "azure":
            text = _get(
                f"{base_url or AZURE_METADATA_BASE_URL}/metadata/instance/network/interface/0/"
                f"ipv4/ipAddress/0/privateIpAddress?api-version={AZURE_API_VERSION}&format=text",
                {"Metadata": "true"},
                timeout_seconds,
            )
        else:
            raise ValueError(f"no metadata service for cloud {cloud!r}; use {METADATA_CLOUDS}")
    except (OSError, urllib.error.URLError) as exc:
        raise AdvertiseError(
            f"the {cloud} metadata service did not give this VM's address ({exc}); "
            "pass --advertise-address"
        ) from exc
    address = text.strip()
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise AdvertiseError(
            f"the {cloud} metadata service answered {address[:60]!r}, not an IP address"
        ) from None
    return address


def _aws_local_ipv4(base_url: str, timeout_seconds: float) -> str:
    token = _request(
        urllib.request.Request(
            f"{base_url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECONDS)},
        ),
        timeout_seconds,
    )
    return _get(
        f"{base_url}/latest/meta-data/local-ipv4",
        {"X-aws-ec2-metadata-token": token.strip()},
        timeout_seconds,
    )


def _get(url: str, headers: dict[str, str], timeout_seconds: float) -> str:
    return _request(urllib.request.Request(url, headers=headers), timeout_seconds)


def _request(request: urllib.request.Request, timeout_seconds: float) -> str:
    # A proxy from the environment must never see metadata requests.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_seconds) as response:
        return str(response.read().decode())
