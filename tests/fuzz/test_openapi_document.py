"""The OpenAPI document the coordinator ships (coordinator/openapi.json) is the front it
serves: the same routes both ways, served at /openapi.json as shipped."""

from __future__ import annotations

import json
import re
from typing import Any, cast

import requests

from coordinator.dispatcher import Dispatcher
from coordinator.http_front import HttpFront, openapi_document
from coordinator.metrics import CoordinatorMetrics
from tests.fuzz.conftest import FuzzCluster

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def documented() -> set[tuple[str, str]]:
    paths: dict[str, dict[str, Any]] = json.loads(openapi_document())["paths"]
    return {(method.upper(), path) for path, item in paths.items() for method in item}


def test_the_document_is_openapi_3_with_an_operation_id_for_each_route():
    document = json.loads(openapi_document())
    assert document["openapi"].startswith("3.")
    operations = [op for item in document["paths"].values() for op in item.values()]
    assert len({op["operationId"] for op in operations}) == len(operations)


def test_every_route_of_the_front_is_documented_and_no_other():
    # app() only binds the routes; nothing is called, so no dispatcher is needed.
    front = HttpFront(cast(Dispatcher, None), CoordinatorMetrics(), "tiny")
    routed = {
        (route.method, route.resource.canonical)
        for route in front.app().router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    assert routed == documented()


def test_the_live_front_serves_the_document_and_exactly_its_routes(fuzz_cluster: FuzzCluster):
    base = fuzz_cluster.coordinator.http_url
    served = requests.get(base + "/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.headers["Content-Type"].startswith("application/json")
    assert served.content == openapi_document()
    routes = documented()
    for path in {path for _, path in routes}:
        for method in METHODS:
            concrete = re.sub(r"\{[^}]+\}", "unknown-id", path)  # an id no object has
            response = requests.request(method, base + concrete, json={}, timeout=30)
            status = response.status_code
            if (method, path) in routes:
                # A route with an id in its path answers an unknown id with its own 404.
                unknown_object = status == 404 and "{" in path and "error" in response.json()
                assert status != 405 and (status != 404 or unknown_object), f"{method} {path}"
            else:
                assert status == 405, f"{method} {path} is not documented but answers {status}"
    assert requests.get(base + "/v1/undocumented", timeout=10).status_code == 404
