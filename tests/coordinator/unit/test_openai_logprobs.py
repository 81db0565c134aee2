"""OpenAI's logprobs objects built from the relay's chunks (openai_logprobs.py, openai_shapes.py)
and the relay keeping each token's logprobs with it across a worker switch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from common.requests import FinishReason, TokenChunk, TokenLogprobs, TopLogprob
from coordinator.openai_logprobs import LOGPROB_FLOOR
from coordinator.openai_shapes import ChatShape, CompletionShape, Shape
from coordinator.relay import Relay
from tests.support.factories import Cluster, make_request, read_all, tokens_of
from tests.support.fake_worker import ScriptedStream, token_ids

# A token reads as a letter: 0 "a", 1 "b", ...; "Ü" is two bytes in UTF-8.
LETTERS = "abcdÜfghij"


def _texts(output_ids: Sequence[int], index: int, candidates: Sequence[int]) -> list[str]:
    assert output_ids[index] == candidates[0], "the first candidate is the sampled token"
    return [LETTERS[c] for c in candidates]


def _logprobs(token_id: int) -> TokenLogprobs:
    """The sampled token at -0.5, its alternatives token_id+1 and token_id+2 lower."""
    return TokenLogprobs(-0.5, (TopLogprob(token_id, -0.5), TopLogprob((token_id + 1) % 10, -1.25)))


def _chunk(index: int, ids: tuple[int, ...], with_logprobs: bool = True) -> TokenChunk:
    return TokenChunk(
        "r",
        index,
        ids,
        text="".join(LETTERS[t] for t in ids),
        logprobs=tuple(_logprobs(t) for t in ids) if with_logprobs else (),
    )


def _fed(kind: type[Shape], chunks: list[TokenChunk]) -> tuple[Shape, list[dict[str, Any]]]:
    shape = kind("id", "tiny", prompt_tokens=3)
    shape.with_logprobs(_texts)
    events = [e for e in (shape.delta(c) for c in chunks) if e is not None]
    return shape, events


CHUNKS = [_chunk(0, (1, 4)), _chunk(2, (2,)), TokenChunk("r", 3, finish_reason=FinishReason.STOP)]


def test_a_completion_has_the_legacy_shape_whole_and_streamed() -> None:
    shape, events = _fed(CompletionShape, CHUNKS)
    whole = shape.choice()["logprobs"]
    assert whole == {
        "tokens": ["b", "Ü", "c"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"b": -0.5, "c": -1.25}, {"Ü": -0.5, "f": -1.25}, {"c": -0.5, "d": -1.25}],
        "text_offset": [0, 1, 2],
    }
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert parts[-1] is None, "the finish carries no token"
    merged: dict[str, list[Any]] = {name: [] for name in whole}
    for part in parts[:-1]:
        for name, values in part.items():
            merged[name].extend(values)
    assert merged == whole


def test_a_chat_completion_has_an_entry_per_token_with_bytes() -> None:
    shape, events = _fed(ChatShape, CHUNKS)
    content = shape.choice()["logprobs"]["content"]
    assert [e["token"] for e in content] == ["b", "Ü", "c"]
    assert content[1] == {
        "token": "Ü",
        "logprob": -0.5,
        "bytes": [0xC3, 0x9C],
        "top_logprobs": [
            {"token": "Ü", "logprob": -0.5, "bytes": [0xC3, 0x9C]},
            {"token": "f", "logprob": -1.25, "bytes": [ord("f")]},
        ],
    }
    streamed = [
        entry
        for event in events
        if event["choices"][0]["logprobs"] is not None
        for entry in event["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content


def test_a_token_with_no_text_yet_still_streams_its_logprobs() -> None:
    chunk = TokenChunk("r", 0, (1,), text="", logprobs=(_logprobs(1),))
    for kind in (CompletionShape, ChatShape):
        _, events = _fed(kind, [chunk])
        assert len(events) == 1 and events[0]["choices"][0]["logprobs"] is not None


def test_without_logprobs_asked_the_answer_has_none() -> None:
    for kind in (CompletionShape, ChatShape):
        shape = kind("id", "tiny", prompt_tokens=3)
        events = [shape.delta(c) for c in CHUNKS]
        assert all(e is None or e["choices"][0]["logprobs"] is None for e in events)
        assert shape.choice()["logprobs"] is None


def test_minus_infinity_is_clamped_and_a_replayed_token_has_a_null_logprob() -> None:
    low = TokenChunk(
        "r", 0, (1,), text="b", logprobs=(TokenLogprobs(-math.inf, (TopLogprob(1, -math.inf),)),)
    )
    replayed = _chunk(1, (2,), with_logprobs=False)  # a resume's tokens from the store
    shape, _ = _fed(CompletionShape, [low, replayed])
    whole = shape.choice()["logprobs"]
    assert whole["token_logprobs"] == [LOGPROB_FLOOR, None]
    assert whole["top_logprobs"] == [{"b": LOGPROB_FLOOR}, None]


def test_without_a_tokenizer_tokens_read_by_id() -> None:
    shape = CompletionShape("id", "tiny", prompt_tokens=3)
    shape.with_logprobs(lambda output, index, candidates: None)
    shape.add(_chunk(0, (1,)))
    assert shape.choice()["logprobs"]["tokens"] == ["token_id:1"]


def _emit(stream: ScriptedStream, start: int, end: int, finish: FinishReason) -> None:
    ids = token_ids(start, end)
    logprobs = tuple(
        TokenLogprobs(-float(i), (TopLogprob(i, -float(i)),)) for i in range(start, end)
    )
    stream.put(TokenChunk("r", start, ids, finish_reason=finish, logprobs=logprobs))


async def test_logprobs_stay_with_their_tokens_across_a_switch_that_repeats_them(
    clusters: Callable[..., Cluster],
) -> None:
    cluster = clusters(workers=2)
    relay: Relay = cluster.submit(make_request("r", max_tokens=10))
    first = await cluster.worker(0).next_stream()
    _emit(first, 0, 5, FinishReason.NONE)
    first.fail()
    second = await cluster.worker(1).next_stream()
    _emit(second, 3, 10, FinishReason.LENGTH)  # repeats indices 3 and 4
    for from_index in (0, 4):  # a reader from the start, one that joins mid-chunk
        chunks = await read_all(relay, from_index)
        assert tokens_of(chunks, from_index=from_index) == list(token_ids(from_index, 10))
        logprobs = [p.logprob for c in chunks for p in c.logprobs]
        assert logprobs == [-float(i) for i in range(from_index, 10)]
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
