"""Local HTTP servers that speak the cloud metadata formats, headers and refusals included.

The local cluster gives every node one, so a drill delivers a termination notice exactly as
the cloud would (`announce_termination`), and the tests use them to check the watchers.

Each checks requests the way the real service does (IMDSv2 token or 401, ``Metadata-Flavor:
Google`` or 403, ``Metadata: true`` or 400) and records every request it saw. Each also says
who the VM is (`InstanceIdentity`) in its cloud's paths and formats, which the boot scripts
and the advertised-address lookup (common/advertise.py) read:

    aws    /latest/meta-data/{local-ipv4, instance-id, instance-type,
                              placement/availability-zone, instance-life-cycle,
                              autoscaling/target-lifecycle-state}
    gcp    /computeMetadata/v1/instance/{network-interfaces/0/ip, name, zone, machine-type,
                                         scheduling/preemptible}
    azure  /metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress
           (and /metadata/instance/compute/{name, vmSize, zone}), format=text

``MetadataServer(host=..., port=...)`` binds elsewhere than a free loopback port (a
rehearsal binds 169.254.169.254:80 inside a network namespace).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, TypeVar

ServerT = TypeVar("ServerT", bound="MetadataServer")


@dataclass(frozen=True)
class InstanceIdentity:
    """Who the VM is, as its metadata service says."""

    private_ip: str = "127.0.0.1"
    instance_id: str = "i-0123456789abcdef0"
    instance_type: str = "g5.xlarge"
    zone: str = "us-east-1a"
    spot: bool = True


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    at: float = 0.0  # time.perf_counter() when it arrived (the drills' clock)


class MetadataServer:
    """A ThreadingHTTPServer on a free loopback port; subclasses implement ``handle``."""

    def __init__(
        self, identity: InstanceIdentity | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        owner = self
        self.identity = identity or InstanceIdentity()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _dispatch(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                parsed = urllib.parse.urlsplit(self.path)
                seen = SeenRequest(
                    method=self.command,
                    path=parsed.path,
                    query=dict(urllib.parse.parse_qsl(parsed.query)),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=self.rfile.read(length) if length else b"",
                    at=time.perf_counter(),
                )
                with owner.lock:
                    owner.requests.append(seen)
                status, headers, body = owner.handle(seen)
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the watcher hung up (its daemon stopped): nobody left to answer

            do_GET = do_PUT = do_POST = _dispatch  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.lock = threading.Lock()
        self.requests: list[SeenRequest] = []
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle(self, request: SeenRequest) -> tuple[int, dict[str, str], bytes]:
        raise NotImplementedError

    def seen(self, method: str | None = None, path: str | None = None) -> list[SeenRequest]:
        with self.lock:
            return [
                r
                for r in self.requests
                if (method is None or r.method == method) and (path is None or r.path == path)
            ]

    def __enter__(self: ServerT) -> ServerT:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()


def _json(status: int, document: Any) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(document).encode()


def _text(status: int, text: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "text/plain", **headers}, text.encode()


class AwsImds(MetadataServer):
    """IMDSv2: a token from PUT /latest/api/token is required on every GET."""

    cloud = "aws"

    def __init__(
        self, identity: InstanceIdentity | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        super().__init__(identity, host, port)
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        # The auto scaling group's view of the instance; None: not in a group (404).
        self.lifecycle_state: str | None = "InService"
        self._tokens: set[str] = set()

    def announce_termination(self, grace_seconds: float) -> None:
        when = time.gmtime(time.time() + grace_seconds)
        self.instance_action = {
            "action": "terminate",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
        }

    def announce_scale_in(self) -> None:
        """The group terminates the instance itself (scale-in, instance refresh): no spot
        notice, only the target lifecycle state."""
        self.lifecycle_state = "Terminated"

    def revoke_tokens(self) -> None:
        with self.lock:
            self._tokens.clear()

    def handle(self, request: SeenRequest) -> tuple[int, dict[str, str], bytes]:
        if request.method == "PUT" and request.path == "/latest/api/token":
            ttl = request.headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return _text(400, "Bad Request")
            token = secrets.token_urlsafe(24)
            with self.lock:
                self._tokens.add(token)
            return _text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        if request.method != "GET":
            return _text(405, "Method Not Allowed")
        with self.lock:
            authorized = request.headers.get("x-aws-ec2-metadata-token") in self._tokens
        if not authorized:
            return _text(401, "Unauthorized")
        identity = self._identity_paths().get(request.path)
        if identity is not None:
            return _text(200, identity)
        if request.path == "/latest/meta-data/spot/instance-action":
            document = self.instance_action
        elif request.path == "/latest/meta-data/events/recommendations/rebalance":
            document = self.rebalance
        elif request.path == "/latest/meta-data/autoscaling/target-lifecycle-state":
            state = self.lifecycle_state
            return _text(200, state) if state is not None else _text(404, "Not Found")
        else:
            document = None
        return _json(200, document) if document is not None else _text(404, "Not Found")

    def _identity_paths(self) -> dict[str, str]:
        me = self.identity
        base = "/latest/meta-data/"
        return {
            base + "local-ipv4": me.private_ip,
            base + "instance-id": me.instance_id,
            base + "instance-type": me.instance_type,
            base + "placement/availability-zone": me.zone,
            base + "instance-life-cycle": "spot" if me.spot else "on-demand",
        }


class GcpMetadata(MetadataServer):
    """instance/preempted with wait_for_change, ETag and last_etag, Metadata-Flavor both ways."""

    cloud = "gcp"

    def announce_termination(self, grace_seconds: float) -> None:
        """GCP says only TRUE: the grace period is the daemon's configured notice length."""
        self.set_preempted(True)

    def __init__(
        self,
        send_flavor_header: bool = True,
        identity: InstanceIdentity | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(identity, host, port)
        self.send_flavor_header = send_flavor_header
        self._preempted = False
        self._changed = threading.Condition(self.lock)

    def set_preempted(self, preempted: bool) -> None:
        with self._changed:
            self._preempted = preempted
            self._changed.notify_all()

    def _etag(self) -> str:
        return hashlib.sha1(str(self._preempted).encode()).hexdigest()[:16]

    def handle(self, request: SeenRequest) -> tuple[int, dict[str, str], bytes]:
        flavor = {"Metadata-Flavor": "Google"} if self.send_flavor_header else {}
        if request.headers.get("metadata-flavor") != "Google":
            return 403, {"Content-Type": "text/html", **flavor}, b"Missing Metadata-Flavor"
        me = self.identity
        instance = "/computeMetadata/v1/instance/"
        identity = {
            instance + "network-interfaces/0/ip": me.private_ip,
            instance + "name": me.instance_id,
            instance + "zone": f"projects/123456789012/zones/{me.zone}",
            instance + "machine-type": f"projects/123456789012/machineTypes/{me.instance_type}",
            instance + "scheduling/preemptible": "TRUE" if me.spot else "FALSE",
        }.get(request.path)
        if identity is not None:
            return 200, {"Content-Type": "application/text", **flavor}, identity.encode()
        if request.path != "/computeMetadata/v1/instance/preempted":
            return 404, flavor, b"Not Found"
        with self._changed:
            if request.query.get("wait_for_change") == "true":
                timeout = float(request.query.get("timeout_sec", "300"))
                last_etag = request.query.get("last_etag")
                start_etag = last_etag or self._etag()
                deadline = time.monotonic() + timeout
                while self._etag() == start_etag and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
            value = "TRUE" if self._preempted else "FALSE"
            headers = {"Content-Type": "application/text", "ETag": self._etag(), **flavor}
        return 200, headers, value.encode()


class AzureScheduledEvents(MetadataServer):
    """Scheduled Events: GET the document, POST StartRequests to approve."""

    cloud = "azure"

    def announce_termination(self, grace_seconds: float, vm_name: str = "") -> None:
        """A Preempt event for ``vm_name`` (default: this VM, its compute/name)."""
        not_before = time.strftime(
            "%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + grace_seconds)
        )
        resources = [vm_name or self.identity.instance_id]
        event = azure_preempt_event(f"preempt-{secrets.token_hex(4)}", resources, not_before)
        with self.lock:
            self.events.append(event)
            self.incarnation += 1

    def __init__(
        self, identity: InstanceIdentity | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        super().__init__(identity, host, port)
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.approved: list[str] = []

    def handle(self, request: SeenRequest) -> tuple[int, dict[str, str], bytes]:
        if request.headers.get("metadata") != "true":
            return _json(400, {"error": "Bad request. Required metadata header not specified"})
        if request.path.startswith("/metadata/instance"):
            return self._instance(request)
        if request.path != "/metadata/scheduledevents":
            return _json(404, {"error": "Not found"})
        if request.query.get("api-version") != "2020-07-01":
            return _json(400, {"error": "Bad request. api-version was not specified"})
        if request.method == "GET":
            with self.lock:
                return _json(200, {"DocumentIncarnation": self.incarnation, "Events": self.events})
        if request.method == "POST":
            try:
                starts = json.loads(request.body)["StartRequests"]
                ids = [str(start["EventId"]) for start in starts]
            except (ValueError, KeyError, TypeError):
                return _json(400, {"error": "Bad request"})
            with self.lock:
                known = {event["EventId"] for event in self.events}
                if not set(ids) <= known:
                    return _json(400, {"error": "Unknown EventId"})
                self.approved.extend(ids)
                for event in self.events:
                    if event["EventId"] in ids:
                        event["EventStatus"] = "Started"
                        event["NotBefore"] = ""
                self.incarnation += 1
            return 200, {}, b""
        return _json(405, {"error": "Method not allowed"})

    def _instance(self, request: SeenRequest) -> tuple[int, dict[str, str], bytes]:
        """Instance metadata (any api-version the service knows; format=text for a leaf)."""
        if not request.query.get("api-version"):
            return _json(400, {"error": "Bad request. api-version was not specified"})
        me = self.identity
        leaves = {
            "/metadata/instance/network/interface/0/ipv4/ipAddress/0/privateIpAddress": (
                me.private_ip
            ),
            "/metadata/instance/compute/name": me.instance_id,
            "/metadata/instance/compute/vmSize": me.instance_type,
            "/metadata/instance/compute/zone": me.zone,
        }
        leaf = leaves.get(request.path)
        if leaf is None:
            return _json(404, {"error": "Not found"})
        if request.query.get("format") != "text":
            return _json(200, leaf)
        return _text(200, leaf)


def azure_preempt_event(event_id: str, resources: list[str], not_before: str) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        "Description": "Virtual machine is being evicted from Azure Spot",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def metadata_server_for(cloud: str, identity: InstanceIdentity | None = None) -> MetadataServer:
    """A fresh (not yet started) server speaking `cloud`'s format: aws, gcp or azure."""
    servers: dict[str, type[MetadataServer]] = {
        "aws": AwsImds,
        "gcp": GcpMetadata,
        "azure": AzureScheduledEvents,
    }
    if cloud not in servers:
        raise ValueError(f"unknown cloud {cloud!r}: use one of {sorted(servers)}")
    return servers[cloud](identity=identity)
