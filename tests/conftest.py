"""Fixtures shared by the whole suite: the tiny model and the test environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny Llama (fixed-seed weights, trained tokenizer), built once."""
    from spotinfer.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
