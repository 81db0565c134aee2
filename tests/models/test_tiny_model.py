"""The tiny Llama: deterministic bytes, a working tokenizer, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotinfer.models.tiny import SPECIAL_TOKENS, build_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _digests(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_two_builds_are_byte_identical(tiny_model: Path, tmp_path: Path) -> None:
    again = build_tiny_llama(tmp_path / "again")
    assert set(_digests(tiny_model)) == EXPECTED_FILES
    assert _digests(again) == _digests(tiny_model)


def test_another_seed_gives_other_weights_and_the_same_tokenizer(
    tiny_model: Path, tmp_path: Path
) -> None:
    other = _digests(build_tiny_llama(tmp_path / "seed1", seed=1))
    same = _digests(tiny_model)
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


def test_config_is_a_gqa_llama_that_vllm_cpu_accepts(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    # vLLM's CPU attention supports head sizes 32, 64, 80, ... (cpu_attn.py).
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert config["max_position_embeddings"] >= 4096
    assert config["torch_dtype"] == "float32"


def test_tokenizer_round_trips_text(tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    bos_id = tokenizer.token_to_id("<s>")
    for text in (
        "The capital of France is Paris.",
        "  leading spaces, tabs\tand\nnewlines  ",
        "numbers 0123456789 and symbols {}[]<>#@!",
        "non-English: café, naïve, 東京, emoji 🚀",
    ):
        ids = tokenizer.encode(text).ids
        assert ids[0] == bos_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Training learned merges: common words take fewer tokens than their bytes.
    assert len(tokenizer.encode("the capital of France").ids) < len("the capital of France")


def test_chat_template_wraps_turns(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "</s>"


def test_transformers_generates_greedily_to_max_tokens(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    input_ids = tokenizer("The morning train left", return_tensors="pt").input_ids

    def generate() -> list[int]:
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=32, do_sample=False)
        return [int(token) for token in output[0, input_ids.shape[1] :]]

    first = generate()
    special_ids = {tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert len(first) == 32
    assert not special_ids & set(first)
    assert len(set(first)) > 1
    assert generate() == first


def test_cli_writes_the_model_and_prints_its_folder(tmp_path: Path) -> None:
    out_dir = tmp_path / "cli-tiny"
    result = subprocess.run(
        [sys.executable, "-m", "spotinfer", "model", "tiny", str(out_dir), "--seed", "3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(out_dir)
    assert _digests(out_dir) == _digests(build_tiny_llama(tmp_path / "direct", seed=3))
