"""A small Compute Engine REST server on loopback, answering the calls spotinfer.fleet.gcp makes.

It is a real HTTP server (http.server in a thread); the google-cloud-compute client talks to
it over REST exactly as it would to compute.googleapis.com. It keeps a little state (the
group's instances and size, operations) so the adapter's effects can be checked, and records
every request for assertions on what the client library actually sent.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

API_PREFIX = "/compute/v1/projects/"


@dataclass
class FakeInstance:
    name: str
    zone: str
    status: str = "RUNNING"
    labels: dict[str, str] = field(default_factory=dict)
    provisioning_model: str = "SPOT"
    machine_type: str = "g2-standard-8"
    private_ip: str = "10.50.0.2"

    def resource(self, base_url: str, project: str) -> dict[str, Any]:
        zone_url = f"{base_url}{API_PREFIX}{project}/zones/{self.zone}"
        return {
            "kind": "compute#instance",
            "id": str(abs(hash(self.name)) % 10**12),
            "name": self.name,
            "zone": zone_url,
            "status": self.status,
            "labels": self.labels,
            "machineType": f"{zone_url}/machineTypes/{self.machine_type}",
            "scheduling": {"provisioningModel": self.provisioning_model, "preemptible": True},
            "networkInterfaces": [{"name": "nic0", "networkIP": self.private_ip}],
            "selfLink": f"{zone_url}/instances/{self.name}",
        }


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


def parse_label_filter(filter_text: str) -> dict[str, str]:
    """The one filter shape the adapter sends: ``labels.K = "V" AND labels.K2 = "V2"``.

    Anything else is rejected (400), so a change in the adapter's filter shows up here.
    """
    terms: dict[str, str] = {}
    for term in filter_text.split(" AND "):
        match = re.fullmatch(r'labels\.([a-z0-9_-]+) = "([^"]*)"', term.strip())
        if not match:
            raise ValueError(f"unsupported filter term {term!r}")
        terms[match.group(1)] = match.group(2)
    return terms


class FakeCompute:
    def __init__(self, project: str, region: str, group: str) -> None:
        self.project = project
        self.region = region
        self.group = group
        self.target_size = 0
        # Further groups of the region (the fallback) by name, and their target sizes.
        self.other_groups: dict[str, int] = {}
        self.instances: dict[str, FakeInstance] = {}
        self.recreated: list[str] = []
        self.requests: list[RecordedRequest] = []
        self.operations: dict[tuple[str, str], dict[str, Any]] = {}
        self.url = ""
        self._operation_ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, instance: FakeInstance) -> FakeInstance:
        self.instances[instance.name] = instance
        return instance

    # ---- request handling -------------------------------------------------------------------

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        with self._lock:
            self.requests.append(RecordedRequest(method, path, query, body))
            if not path.startswith(f"{API_PREFIX}{self.project}/"):
                return 404, _error(404, f"unknown project in {path}")
            rest = path[len(f"{API_PREFIX}{self.project}/") :]
            routes: list[tuple[str, str, Callable[..., tuple[int, Any]]]] = [
                ("GET", r"aggregated/instances", self._aggregated_instances),
                ("GET", r"regions/([^/]+)/instanceGroupManagers/([^/]+)", self._get_group),
                ("POST", r"regions/([^/]+)/instanceGroupManagers/([^/]+)/resize", self._resize),
                (
                    "POST",
                    r"regions/([^/]+)/instanceGroupManagers/([^/]+)/recreateInstances",
                    self._recreate,
                ),
                (
                    "POST",
                    r"zones/([^/]+)/instances/([^/]+)/simulateMaintenanceEvent",
                    self._simulate,
                ),
                ("GET", r"zones/([^/]+)/operations/([^/]+)", self._get_operation),
            ]
            for route_method, pattern, handler in routes:
                match = re.fullmatch(pattern, rest)
                if match and method == route_method:
                    return handler(*match.groups(), query=query, body=body)
            return 404, _error(404, f"no route for {method} {path}")

    def _aggregated_instances(self, *, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        try:
            wanted = parse_label_filter(query.get("filter", [""])[0])
        except ValueError as error:
            return 400, _error(400, str(error))
        items: dict[str, Any] = {}
        for instance in self.instances.values():
            if all(instance.labels.get(key) == value for key, value in wanted.items()):
                scope = items.setdefault(f"zones/{instance.zone}", {"instances": []})
                scope["instances"].append(instance.resource(self.url, self.project))
        return 200, {"kind": "compute#instanceAggregatedList", "id": "agg", "items": items}

    def _check_group(self, region: str, group: str) -> tuple[int, Any] | None:
        if region != self.region or (group != self.group and group not in self.other_groups):
            return 404, _error(404, f"instance group {region}/{group} not found")
        return None

    def _get_group(
        self, region: str, group: str, *, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        missing = self._check_group(region, group)
        if missing:
            return missing
        size = self.target_size if group == self.group else self.other_groups[group]
        base = f"{self.url}{API_PREFIX}{self.project}/regions/{region}"
        return 200, {
            "kind": "compute#instanceGroupManager",
            "name": group,
            "targetSize": size,
            "region": base,
            "selfLink": f"{base}/instanceGroupManagers/{group}",
        }

    def _resize(
        self, region: str, group: str, *, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        missing = self._check_group(region, group)
        if missing:
            return missing
        size = int(query["size"][0])
        if group == self.group:
            self.target_size = size
        else:
            self.other_groups[group] = size
        return 200, self._operation("resize", region=region, target=group, status="DONE")

    def _recreate(
        self, region: str, group: str, *, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        missing = self._check_group(region, group)
        if missing:
            return missing
        for url in body.get("instances", []):
            match = re.fullmatch(r"zones/([^/]+)/instances/([^/]+)", url)
            if not match or match.group(2) not in self.instances:
                return 400, _error(400, f"bad instance URL {url!r}")
            instance = self.instances[match.group(2)]
            instance.status = "STAGING"
            self.recreated.append(instance.name)
        return 200, self._operation("recreateInstances", region=region, target=group, status="DONE")

    def _simulate(
        self, zone: str, name: str, *, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        instance = self.instances.get(name)
        if instance is None or instance.zone != zone:
            return 404, _error(404, f"instance {zone}/{name} not found")
        # A Spot VM answers a maintenance event with a preemption.
        instance.status = "STOPPING"
        return 200, self._operation(
            "simulateMaintenanceEvent", zone=zone, target=name, status="RUNNING"
        )

    def _get_operation(
        self, zone: str, name: str, *, query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        operation = self.operations.get((zone, name))
        if operation is None:
            return 404, _error(404, f"operation {zone}/{name} not found")
        # Each read moves a running operation on, as the real one does over time.
        if operation["status"] == "RUNNING":
            operation["status"] = "DONE"
            operation["progress"] = 100
            target = self.instances.get(operation["targetLink"].rsplit("/", 1)[-1])
            if target is not None:
                target.status = "TERMINATED"
        return 200, operation

    def _operation(
        self,
        kind: str,
        *,
        target: str,
        status: str,
        zone: str | None = None,
        region: str | None = None,
    ) -> dict[str, Any]:
        name = f"operation-{next(self._operation_ids)}"
        scope = f"zones/{zone}" if zone else f"regions/{region}"
        collection = "instances" if zone else "instanceGroupManagers"
        base = f"{self.url}{API_PREFIX}{self.project}/{scope}"
        operation: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(next(self._operation_ids)),
            "name": name,
            "operationType": kind,
            "targetLink": f"{base}/{collection}/{target}",
            "status": status,
            "progress": 100 if status == "DONE" else 0,
            "selfLink": f"{base}/operations/{name}",
        }
        operation["zone" if zone else "region"] = f"{self.url}{API_PREFIX}{self.project}/{scope}"
        self.operations[(zone or region or "", name)] = operation
        return operation


def _error(code: int, message: str) -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "reason": "fake"}],
        }
    }


def _handler_for(compute: FakeCompute) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            parsed = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            status, payload = compute.handle(
                self.command, parsed.path, parse_qs(parsed.query), body
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _serve
        do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return  # keep test output quiet

    return Handler


@contextmanager
def serve(compute: FakeCompute) -> Iterator[FakeCompute]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(compute))
    compute.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield compute
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
