"""API keys as salted hashes and the per-key limits (unit tests, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.api_keys import KeyRing, append_key, bearer_token, load_keys, new_key
from common.authz import AccessConfig, KeyLimits, TokenBucket
from common.errors import RateLimited


def test_a_key_is_stored_as_a_salted_hash_and_verifies(tmp_path: Path) -> None:
    record, token = new_key("acme")
    path = tmp_path / "keys.jsonl"
    append_key(path, record)
    line = json.loads(path.read_text())
    assert token.split("_")[-1] not in path.read_text()
    assert set(line) == {"id", "tenant", "role", "salt", "hash", "iterations"}
    assert path.stat().st_mode & 0o777 == 0o600
    ring = KeyRing(load_keys(path))
    found = ring.verify(token)
    assert found is not None and found.tenant == "acme"
    assert ring.verify(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert ring.verify("spk_nosuchid_secret") is None
    assert ring.verify("") is None


def test_the_same_secret_hashes_differently_under_two_salts() -> None:
    first, _ = new_key("acme")
    second, _ = new_key("acme")
    assert first.salt != second.salt and first.hash != second.hash


def test_bearer_token() -> None:
    assert bearer_token("Bearer spk_a_b") == "spk_a_b"
    assert bearer_token("bearer  spk_a_b ") == "spk_a_b"
    assert bearer_token("Basic abc") == ""
    assert bearer_token("") == ""


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, capacity=2.0, clock=lambda: now[0])
    assert bucket.take() == 0 and bucket.take() == 0
    assert bucket.take() == 500  # one token takes 0.5 s at 2/s
    now[0] = 0.5
    assert bucket.take() == 0


def test_key_limits_answer_with_a_retry_hint() -> None:
    now = [0.0]
    limits = KeyLimits(AccessConfig(requests_per_second=1.0, max_concurrent=1), lambda: now[0])
    with limits.admitted("k1"):
        with pytest.raises(RateLimited) as concurrent, limits.admitted("k1"):
            pass
        assert concurrent.value.trailing_metadata()[0][0] == "retry-after-ms"
    with pytest.raises(RateLimited) as rate, limits.admitted("k1"):
        pass
    assert ("retry-after-ms", "1000") in rate.value.trailing_metadata()
    assert rate.value.http_headers()["Retry-After"] == "1"
    with limits.admitted("k2"):  # another key has its own bucket
        pass


def test_a_coordinator_off_loopback_without_keys_refuses_to_start(tmp_path: Path) -> None:
    from common.authz import AccessConfig
    from coordinator.config import CoordinatorConfig

    with pytest.raises(ValueError, match="without API keys"):
        CoordinatorConfig(host="0.0.0.0")
    CoordinatorConfig(host="127.0.0.1")
    CoordinatorConfig(host="0.0.0.0", allow_no_keys=True)
    record, _ = new_key("acme")
    keys = tmp_path / "keys.jsonl"
    append_key(keys, record)
    CoordinatorConfig(host="0.0.0.0", api_keys=AccessConfig(file=str(keys)))
