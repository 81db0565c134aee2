"""A reader that attaches inside a chunk gets the text of exactly the tokens it is given.

The relay keeps the chunks as the worker sent them; one may carry several tokens (a worker
that merges the output of several steps, a replay after a switch). Attach from an index
inside such a chunk must not lose that chunk's text, nor repeat the part before the index.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.requests import TokenChunk
from coordinator.prompt_tokenizer import PromptTokenizer
from coordinator.relay import slice_chunk
from protos.spotinfer.v1 import inference_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS, assemble, greedy

# Accents and CJK: characters of several bytes, which byte-level tokens split.
TEXT = "Grüße aus Zürich, 東京 und São Paulo: naïve café"


@pytest.fixture(scope="module")
def texts(tiny_model: Path) -> PromptTokenizer:
    tokenizer = PromptTokenizer(str(tiny_model))
    tokenizer.load()
    return tokenizer


def _decoded(tiny_model: Path, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return str(tokenizer.decode(token_ids, skip_special_tokens=True))


def test_a_chunk_sliced_inside_keeps_the_text_of_its_tokens(
    texts: PromptTokenizer, tiny_model: Path
) -> None:
    ids = list(texts.encode(TEXT))
    prompt, output = ids[:3], ids[3:]
    assert len(output) > 10
    whole = _decoded(tiny_model, prompt + output)
    chunk_text = whole[len(_decoded(tiny_model, prompt)) :]
    chunk = TokenChunk("r", 0, token_ids=tuple(output), text=chunk_text)
    checked = 0
    for k in range(1, len(output)):
        sliced = slice_chunk(chunk, k, prompt, output, texts)
        assert sliced is not None and sliced.index == k
        assert sliced.token_ids == tuple(output[k:])
        before = _decoded(tiny_model, prompt + output[:k])
        if "\ufffd" in before or not whole.startswith(before):
            continue  # k splits a character: no text is "before" it on its own
        assert sliced.text == whole[len(before) :], f"attached at {k}"
        checked += 1
    assert checked > len(output) // 2


def test_attach_from_every_index_carries_the_rest_of_the_text(
    coordinator: CoordinatorProcess, tiny_model: Path
) -> None:
    prompt = [5, 17, 42, 99]
    generated = list(
        coordinator.inference.Generate(greedy(prompt, 24, "attach-text"), timeout=TIMEOUT_SECONDS)
    )
    output = assemble(generated)
    full_text = "".join(r.text for r in generated)
    assert full_text, "the coordinator runs with --model: its stream carries text"
    for k in range(len(output) + 1):
        attached = list(
            coordinator.inference.Attach(
                inference_pb2.AttachRequest(request_id="attach-text", from_index=k),
                timeout=TIMEOUT_SECONDS,
            )
        )
        assert [t for r in attached for t in r.token_ids] == output[k:]
        before = _decoded(tiny_model, prompt + output[:k])[len(_decoded(tiny_model, prompt)) :]
        if full_text.startswith(before):
            assert "".join(r.text for r in attached) == full_text[len(before) :], k
