"""The tiny Llama: a deterministic, few-megabyte model in Hugging Face layout for tests.

Weights are fixed-seed random numbers (numpy's PCG64, identical on every platform), the
tokenizer a byte-level BPE trained on the built-in corpus below. Same seed, same bytes: two
builds give byte-identical folders, so tests can compare engines token for token.

The shape is small but real: grouped-query attention (4 query heads over 2 KV heads), a
head size vLLM's CPU attention supports (32), and 8k positions for long-context tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODEL_FILE_NAME = "model.safetensors"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: 0..4.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# A chat turn is `<|im_start|>role\ncontent<|im_end|>\n`; the prompt starts with BOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tokenizer's training text. Plain English with digits and punctuation, so that common
# words become single tokens and everything else still round-trips through bytes.
TRAINING_CORPUS = """\
The morning train left the station at seven, carrying farmers, students and a few tired
engineers who had worked through the night. Outside the window the fields were green and
wet, and the river ran fast after three days of rain. Nobody spoke much; most people read,
and some slept with their heads against the glass.

A good kitchen is a quiet place. The cook washes the vegetables, cuts the onions into thin
slices and warms the oil in a heavy pan. When the onions turn golden she adds garlic,
tomatoes, a spoon of salt and a little water, then lets the sauce simmer for twenty minutes
while the bread bakes in the oven. Dinner is ready at six o'clock.

Computers store numbers as bits. A byte holds eight bits, so it can count from 0 to 255.
Memory is measured in bytes: 1024 bytes make a kilobyte, and a modern server may have 64,
128 or even 512 gigabytes. When a program needs more memory than the machine has, it
slows down or stops, which is why operators plan the memory of every service in advance.

The library opens at nine in the morning and closes at eight in the evening. Children come
after school to read stories about dragons, ships and distant planets. Their parents
borrow books on history, gardening and travel. The librarian knows every shelf and can
find any book in less than a minute.

What is the capital of France? The capital of France is Paris. What is the capital of
Italy? The capital of Italy is Rome. Questions and answers like these are easy for people,
and a small model can learn the pattern when it sees enough examples of it.

Clouds rent spare machines at a discount, but they may take them back at short notice.
A careful service saves its work often, moves its state to another machine when a warning
arrives, and continues from where it stopped, so that its users never notice the change.
"""


@dataclass(frozen=True)
class TinyLlamaShape:
    """The tiny model's architecture; every field maps onto a Llama config.json key."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size != self.num_attention_heads * self.head_dim:
            raise ValueError("hidden_size must equal num_attention_heads * head_dim")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size <= 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must leave room for the 256 bytes, specials and merges")


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE over TRAINING_CORPUS, with BOS prepended to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    return tokenizer


def _random_weights(
    shape: TinyLlamaShape, vocab_size: int, seed: int, special_token_ids: Sequence[int]
) -> dict[str, np.ndarray[Any, np.dtype[np.float32]]]:
    """Weights in HF Llama names, [out_features, in_features] as nn.Linear stores them.

    Scales are 1/sqrt(fan_in) (unit-variance activations) and a wide lm_head, so logits are
    spread by several units: greedy decoding then never hinges on a near-tie that float
    rounding could flip between two engines.
    """
    rng = np.random.default_rng(seed)

    def normal(rows: int, cols: int, scale: float) -> np.ndarray[Any, np.dtype[np.float32]]:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    hidden = shape.hidden_size
    q_width = shape.num_attention_heads * shape.head_dim
    kv_width = shape.num_key_value_heads * shape.head_dim
    inner = shape.intermediate_size
    ones = np.ones(hidden, dtype=np.float32)
    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden, 1.0)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.input_layernorm.weight"] = ones.copy()
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_width, hidden, hidden**-0.5)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_width, hidden, hidden**-0.5)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_width, hidden, hidden**-0.5)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_width, q_width**-0.5)
        weights[f"{prefix}.post_attention_layernorm.weight"] = ones.copy()
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(inner, hidden, hidden**-0.5)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(inner, hidden, hidden**-0.5)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inner, inner**-0.5)
    weights["model.norm.weight"] = ones.copy()
    lm_head = normal(vocab_size, hidden, 4.0 * hidden**-0.5)
    # Zero rows give the special tokens a logit of 0 while the best ordinary token scores
    # several units higher: greedy outputs never stop early on EOS and always run to
    # max_tokens, so a test decides an output's length (or ends it with a stop string).
    lm_head[list(special_token_ids)] = 0.0
    weights["lm_head.weight"] = lm_head
    return weights


def _model_config(shape: TinyLlamaShape, vocab_size: int, token_ids: Mapping[str, int]) -> dict:
    fields = asdict(shape)
    fields["vocab_size"] = vocab_size
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": token_ids[EOS_TOKEN],
        "pad_token_id": token_ids[PAD_TOKEN],
        "torch_dtype": "float32",
    }


def _tokenizer_files(token_ids: Mapping[str, int], max_length: int) -> dict[str, dict]:
    added_tokens_decoder = {
        str(token_ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added_tokens_decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    generation_config = {
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": [token_ids[EOS_TOKEN], token_ids[IM_END_TOKEN]],
        "pad_token_id": token_ids[PAD_TOKEN],
        "do_sample": False,
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_tokens_map,
        "generation_config.json": generation_config,
    }


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_llama(out_dir: Path, seed: int = 0, shape: TinyLlamaShape | None = None) -> Path:
    """Writes the tiny Llama into out_dir (created if missing) and returns out_dir.

    Files: config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json. Existing files of those names are
    overwritten; nothing else in the folder is touched.
    """
    from safetensors.numpy import save_file

    shape = shape or TinyLlamaShape()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(shape.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    token_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)

    _write_json(out_dir / "config.json", _model_config(shape, vocab_size, token_ids))
    for name, content in _tokenizer_files(token_ids, shape.max_position_embeddings).items():
        _write_json(out_dir / name, content)
    save_file(
        _random_weights(shape, vocab_size, seed, sorted(token_ids.values())),
        str(out_dir / MODEL_FILE_NAME),
        metadata={"format": "pt"},
    )
    return out_dir
