"""The KV persistence settings of a worker and of a local cluster: hybrid needs its rate cap,
a cap goes with hybrid only and must be a positive number; a setting that cannot be honoured
is refused with a clear error, never ignored. The flag, the environment variable and what
the worker reports all carry the same values."""

from __future__ import annotations

import argparse
import math

import pytest

from common.messages import KvPersistence
from spotinfer.local.cluster import ClusterConfig
from store.store_config import StoreConfig
from worker.config import CONFIG_SOURCE, WorkerConfig

STORE = StoreConfig(url="redis://127.0.0.1:6379/0")


def _worker(**settings: object) -> WorkerConfig:
    return WorkerConfig(model="m", store=STORE, **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "rate", "complaint"),
    [
        ("eager", 5.0, "caps the hybrid policy only"),
        ("lazy", 5.0, "caps the hybrid policy only"),
        ("off", 5.0, "caps the hybrid policy only"),
        ("hybrid", None, "hybrid needs kv_persist_rate_mb_s"),
        ("hybrid", 0.0, "must be positive"),
        ("hybrid", -1.0, "must be positive"),
        ("hybrid", math.nan, "must be positive"),
        ("hybrid", math.inf, "must be positive and finite"),
        ("eventually", None, "kv_persist_policy must be one of"),
    ],
)
def test_a_rate_that_cannot_be_honoured_is_refused(
    policy: str, rate: float | None, complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        _worker(kv_persist_policy=policy, kv_persist_rate_mb_s=rate)
    with pytest.raises(ValueError, match=complaint):
        ClusterConfig(model="m", persist_policy=policy, persist_rate_mb_s=rate)


def test_hybrid_reports_its_cap_in_bytes_and_no_store_means_off() -> None:
    config = _worker(kv_persist_policy="hybrid", kv_persist_rate_mb_s=2.5)
    assert config.kv_persistence == KvPersistence("hybrid", 2_500_000.0)
    assert config.kv_persistence.label == "hybrid 2.5 MB/s"
    assert _worker(kv_persist_policy="lazy").kv_persistence == KvPersistence("lazy", 0.0)
    assert WorkerConfig(model="m").kv_persistence == KvPersistence("off")


def test_the_flag_and_the_environment_set_the_cap() -> None:
    parser = argparse.ArgumentParser()
    CONFIG_SOURCE.add_arguments(parser)
    args = parser.parse_args(
        ["--model", "m", "--kv-persist-policy", "hybrid", "--kv-persist-rate-mb-s", "0.5"]
    )
    assert CONFIG_SOURCE.resolve(args, environ={}).config.kv_persist_rate_mb_s == 0.5
    args = parser.parse_args(["--model", "m", "--kv-persist-policy", "hybrid"])
    environ = {"SPOTINFER_KV_PERSIST_RATE_MB_S": "3"}
    assert CONFIG_SOURCE.resolve(args, environ=environ).config.kv_persist_rate_mb_s == 3.0
    args = parser.parse_args(["--model", "m", "--kv-persist-rate-mb-s", "3"])
    with pytest.raises(ValueError, match="caps the hybrid policy only"):
        CONFIG_SOURCE.resolve(args, environ={})


def test_a_cluster_passes_the_policy_and_cap_to_every_worker() -> None:
    config = ClusterConfig(model="m", persist_policy="hybrid", persist_rate_mb_s=0.25)
    assert config.persist_flags == (
        "--kv-persist-policy",
        "hybrid",
        "--kv-persist-rate-mb-s",
        "0.25",
    )
    assert ClusterConfig(model="m").persist_flags == ("--kv-persist-policy", "eager")
