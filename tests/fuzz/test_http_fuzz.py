"""Fuzzes the coordinator's HTTP front from its shipped OpenAPI document (schemathesis, on
hypothesis): bodies that fit the schema and bodies that break it, for every operation. No
answer may be a 5xx; every status, content type and body must be one the document declares;
afterwards the coordinator is SERVING with nothing in flight. Then bytes no schema would
make: garbage bodies, wrong content types, oversized headers.

The worker behind the fuzz cluster caps max_tokens at 8 (tests/fuzz/conftest.py), so a
generated request that is valid costs a few decode steps.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from coordinator.http_front import openapi_document
from tests.fuzz.conftest import MAX_TOKENS_LIMIT, FuzzCluster

REQUIRED_CASES = 2_000
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
# Per operation and generation mode (positive, negative).
POST_EXAMPLES = 440
GET_EXAMPLES = 25
RAW_EXAMPLES = 300
CALL_TIMEOUT_SECONDS = 30.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
POST_PATHS = ("/v1/completions", "/v1/chat/completions")
HTTP_FAMILY = "http"

SCHEMA = schemathesis.openapi.from_dict(json.loads(openapi_document()))
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]  # type: ignore[union-attr]
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


def examples_for(operation: schemathesis.APIOperation) -> int:
    """The POST operations carry the input; a GET without parameters runs out at once."""
    return POST_EXAMPLES if operation.method.upper() == "POST" else GET_EXAMPLES


def steer_to_the_served_path(case: schemathesis.Case) -> None:
    """Half the positive cases: no `model` (a random one is a 404) and a max_tokens within
    the worker's limit, so schema-valid bodies also reach the engine and come back 200."""
    if not isinstance(case.body, dict):
        return
    case.body.pop("model", None)
    for name in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(name)
        case.body[name] = 1 + (value if isinstance(value, int) else 0) % MAX_TOKENS_LIMIT
    case.body.pop("max_completion_tokens" if "messages" not in case.body else "max_tokens")


# Negative cases need an input to break: the GET operations take none.
RUNS = [
    pytest.param(operation, mode, id=f"{operation.label} {mode.value}")
    for operation in OPERATIONS
    for mode in MODES
    if mode == GenerationMode.POSITIVE or operation.method.upper() == "POST"
]


@pytest.mark.parametrize(("operation", "mode"), RUNS)
def test_operations_from_the_document(
    fuzz_cluster: FuzzCluster, operation: schemathesis.APIOperation, mode: GenerationMode
):
    base_url = fuzz_cluster.coordinator.http_url
    statuses: dict[int, int] = {}

    @settings(
        max_examples=max(1, int(examples_for(operation) * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(operation.as_strategy(generation_mode=mode), st.booleans())
    def one_case(case: schemathesis.Case, steer: bool) -> None:
        fuzz_cluster.count(f"{HTTP_FAMILY} {operation.label} {mode.value}")
        if steer and mode == GenerationMode.POSITIVE:
            steer_to_the_served_path(case)
        response = case.call_and_validate(
            base_url=base_url, checks=CHECKS, timeout=CALL_TIMEOUT_SECONDS
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    started = time.monotonic()
    one_case()
    seconds = time.monotonic() - started
    print(f"{operation.label} {mode.value}: {sum(statuses.values())} in {seconds:.1f}s {statuses}")
    fuzz_cluster.assert_settled()


_content_types = st.sampled_from(
    (
        "application/json",
        "application/json; charset=latin-1",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        "",
        "\x7f/\x7f",
    )
)
_json_fragments = st.sampled_from(
    (
        b"{",
        b"[]",
        b"null",
        b'"prompt"',
        b'{"prompt": "hi", "max_tokens": 1e400}',
        b'{"prompt": "hi", "max_tokens": NaN}',
        b'{"prompt": [[1, 2], [3]]}',
        b'{"prompt": "hi", "stream": true, "stream_options": "yes"}',
        b'{"messages": [{"role": "user"}]}',
        b'{"messages": [{"role": "user", "content": {"a": 1}}], "max_tokens": 2}',
        b'{"messages": "hi"}',
        b'{"prompt": "hi", "n": "two"}',
        b'{"prompt": "hi", "stop": [1, null]}',
        b'{"prompt": "hi", "seed": -1, "max_tokens": 1}',
        b'{"prompt": "hi", "max_tokens": 1, "request_id": 7}',
        b'{"prompt": "hi", "max_tokens": 1, "logprobs": 21}',
        b'{"prompt": "hi", "max_tokens": 1, "logprobs": true}',
        b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}',
        b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": -1}',
        b"\xff\xfe{}",
    )
)
_bodies = st.one_of(st.binary(max_size=512), _json_fragments)
_headers = st.dictionaries(
    st.from_regex(r"X-[A-Za-z0-9-]{1,20}", fullmatch=True),
    # The client refuses a value with leading whitespace: strip it, the server is the target.
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=4096).map(str.strip),
    max_size=4,
)


def test_bytes_no_schema_would_make(fuzz_cluster: FuzzCluster):
    base = fuzz_cluster.coordinator.http_url
    session = requests.Session()
    statuses: dict[int, int] = {}

    @settings(
        max_examples=max(1, int(RAW_EXAMPLES * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.sampled_from(POST_PATHS), _bodies, _content_types, _headers)
    def one_case(path: str, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        fuzz_cluster.count(f"{HTTP_FAMILY} raw {path}")
        response = session.post(
            base + path,
            data=body,
            headers={**headers, "Content-Type": content_type},
            timeout=CALL_TIMEOUT_SECONDS,
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (
            f"{path} {body!r}: {response.status_code} {response.text}"
        )
        assert response.status_code in (200, 400, 404, 413, 429), response.text

    started = time.monotonic()
    one_case()
    print(
        f"raw HTTP: {sum(statuses.values())} cases in {time.monotonic() - started:.1f}s {statuses}"
    )
    fuzz_cluster.assert_settled()


def test_a_header_past_the_limit_is_refused(fuzz_cluster: FuzzCluster):
    """aiohttp refuses a header line over 8 KiB: a 4xx, and the front serves on."""
    url = fuzz_cluster.coordinator.http_url + "/v1/models"
    response = requests.get(url, headers={"X-Big": "a" * 20_000}, timeout=CALL_TIMEOUT_SECONDS)
    assert 400 <= response.status_code < 500
    assert requests.get(url, timeout=CALL_TIMEOUT_SECONDS).status_code == 200


def test_the_run_reached_its_count(fuzz_cluster: FuzzCluster):
    """The figure the suite promises: runs after the fuzz tests above (file order)."""
    cases = {k: v for k, v in fuzz_cluster.cases.items() if k.startswith(HTTP_FAMILY)}
    total = sum(cases.values())
    print(f"HTTP fuzz cases: {total} {dict(sorted(cases.items()))}")
    assert total >= REQUIRED_CASES * SCALE, f"{total} cases, fewer than {REQUIRED_CASES * SCALE}"
    fuzz_cluster.assert_settled()
