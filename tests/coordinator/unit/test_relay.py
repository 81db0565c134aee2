"""The relay in-process: chunks from one worker after another are deduped by index, so every
reader — from the start, or attached from any index, live or after the finish — gets each
output index once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from common.requests import FinishReason, TokenChunk
from coordinator.errors import IndexOutOfRange
from coordinator.relay import Relay, RelayStatus
from tests.support.factories import Cluster, make_limits, make_request, read_all, tokens_of
from tests.support.fake_worker import ScriptedStream, token_ids
from tests.support.wait import wait_until_async

Make = Callable[..., Cluster]


def _reader(relay: Relay, from_index: int = 0) -> asyncio.Task[list[TokenChunk]]:
    return asyncio.ensure_future(read_all(relay, from_index))


async def _first_stream(cluster: Cluster, max_tokens: int = 10) -> tuple[Relay, ScriptedStream]:
    relay = cluster.submit(make_request("r", max_tokens=max_tokens))
    stream = await cluster.worker(0).next_stream()
    return relay, stream


async def test_a_reader_gets_each_index_once_across_a_switch_that_repeats_tokens(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2)
    relay, first = await _first_stream(cluster)
    readers = [_reader(relay), _reader(relay)]
    first.emit(0, 3)
    first.emit(3, 5)
    first.fail()  # the worker dies after index 4
    second = await cluster.worker(1).next_stream()
    assert (second.call.what, second.call.index) == ("resume", 5)
    second.emit(3, 7)  # a resume that repeats indices 3 and 4
    second.emit(7, 10, FinishReason.LENGTH)
    for reader in readers:
        chunks = await reader
        assert tokens_of(chunks) == list(token_ids(0, 10))
        assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert relay.interruptions == 1 and first.closed


async def test_repeated_and_overlapping_chunks_of_one_worker_are_dropped(clusters: Make) -> None:
    cluster = clusters(workers=1)
    relay, stream = await _first_stream(cluster, max_tokens=6)
    reader = _reader(relay)
    stream.emit(0, 3)
    stream.emit(0, 3)  # the same chunk twice
    stream.emit(2, 5)  # overlaps index 2
    stream.emit(4, 6, FinishReason.LENGTH)
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 6))
    assert [c.index for c in chunks] == [0, 3, 5]


async def test_a_gap_in_the_indices_is_a_broken_stream_and_the_request_goes_on(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2)
    relay, first = await _first_stream(cluster, max_tokens=6)
    reader = _reader(relay)
    first.emit(0, 2)
    first.emit(4, 6)  # indices 2 and 3 never came
    second = await cluster.worker(1).next_stream()
    assert second.call.index == 2, "resumed from the first index no reader has"
    second.emit(2, 6, FinishReason.LENGTH)
    assert tokens_of(await reader) == list(token_ids(0, 6))


async def test_a_reader_attached_from_an_index_gets_the_rest_once(clusters: Make) -> None:
    cluster = clusters(workers=1)
    relay, stream = await _first_stream(cluster, max_tokens=10)
    stream.emit(0, 3)
    stream.emit(3, 7)
    await wait_until_async(lambda: relay.delivered_tokens == 7, timeout=5, message="7 tokens")
    live = _reader(relay, from_index=5)  # joins mid-chunk, while it runs
    stream.emit(7, 10, FinishReason.LENGTH)
    chunks = await live
    assert tokens_of(chunks, from_index=5) == list(token_ids(5, 10))

    # After the finish: from any index up to the end, and the end itself is just the finish.
    assert tokens_of(await read_all(relay, 9), from_index=9) == [token_ids(9, 10)[0]]
    at_end = await read_all(relay, 10)
    assert [(c.index, c.token_ids, c.finish_reason) for c in at_end] == [
        (10, (), FinishReason.LENGTH)
    ]
    with pytest.raises(IndexOutOfRange):
        await read_all(relay, 11)


async def test_an_index_past_what_the_request_may_produce_is_refused_while_it_runs(
    clusters: Make,
) -> None:
    cluster = clusters(workers=1)
    relay, _ = await _first_stream(cluster, max_tokens=10)
    with pytest.raises(IndexOutOfRange):
        await read_all(relay, 11)
    assert relay.status == RelayStatus.RUNNING


async def test_a_cancelled_request_ends_cancelled_for_its_readers(clusters: Make) -> None:
    cluster = clusters(workers=1)
    relay, stream = await _first_stream(cluster)
    reader = _reader(relay)
    stream.emit(0, 2)
    await wait_until_async(lambda: relay.delivered_tokens == 2, timeout=5, message="2 tokens")
    assert await relay.cancel()
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 2))
    assert chunks[-1].finish_reason == FinishReason.CANCELLED
    assert [c.what for c in cluster.fakes.calls] == ["generate", "abort"]
    assert cluster.entry(0).in_flight_total == 0, "its slot is free again"


async def test_a_worker_that_cuts_a_request_the_client_did_not_cancel_is_failed_over(
    clusters: Make,
) -> None:
    cluster = clusters(workers=2)
    relay, first = await _first_stream(cluster, max_tokens=4)
    reader = _reader(relay)
    first.emit(0, 2)
    first.finish(2, FinishReason.CANCELLED)  # a draining worker cut it
    second = await cluster.worker(1).next_stream()
    second.emit(2, 4, FinishReason.LENGTH)
    chunks = await reader
    assert tokens_of(chunks) == list(token_ids(0, 4))
    assert chunks[-1].finish_reason == FinishReason.LENGTH


async def test_a_queued_request_whose_last_reader_leaves_gives_up_its_place(
    clusters: Make,
) -> None:
    cluster = clusters(workers=1, limits=make_limits(max_seqs_per_worker=1))
    running, _ = await _first_stream(cluster)
    queued = cluster.submit(make_request("queued"))
    assert queued.status == RelayStatus.QUEUED
    reader = _reader(queued)
    await asyncio.sleep(0)  # the reader is attached
    reader.cancel()  # the client hangs up
    await asyncio.gather(reader, return_exceptions=True)
    await wait_until_async(lambda: queued.finished, timeout=5, message="the request ended")
    assert queued.finish_reason == FinishReason.CANCELLED
    assert cluster.admission.depth(queued.request.sla_class) == 0
    assert running.status == RelayStatus.RUNNING


class ByteTexts:
    """Token t is the byte t - 1000 (t >= 1000) or the letter chr(t): text as a byte-level
    tokenizer decodes it, U+FFFD for an unfinished character."""

    vocab_size = 2000

    @staticmethod
    def _bytes(ids: list[int]) -> bytes:
        return b"".join(bytes([t - 1000]) if t >= 1000 else chr(t).encode() for t in ids)

    def span(self, prompt_ids: object, output_ids: list[int], start: int, end: int) -> str:
        before = self._bytes(list(output_ids[:start])).decode(errors="replace")
        whole = self._bytes(list(output_ids[:end])).decode(errors="replace")
        return whole[len(before) :] if whole.startswith(before) else whole


async def test_a_resumed_sources_first_text_is_decoded_here(clusters: Make) -> None:
    from common.requests import Event, EventKind

    cluster = clusters(workers=2)
    cluster.dispatcher.tokenizer = ByteTexts()  # type: ignore[assignment]
    relay = cluster.submit(make_request("r", max_tokens=6))
    first = await cluster.worker(0).next_stream()
    reader = _reader(relay)
    first.put(TokenChunk("r", 0, (72, 105), text="Hi"))
    first.fail()
    second = await cluster.worker(1).next_stream()
    # Replayed from the store without text, the first byte of "é" among them; the resume
    # event; the engine's first output with the text of its whole prompt; then its own.
    second.put(TokenChunk("r", 2, (32, 1000 + 0xC3)))
    second.put(TokenChunk("r", 4, event=Event(EventKind.MIGRATED)))
    second.put(TokenChunk("r", 4, (1000 + 0xA9,), text="Hi \ufffd\u00e9"))
    second.put(TokenChunk("r", 5, (33,), text="!", finish_reason=FinishReason.LENGTH))
    chunks = await reader
    assert "".join(c.text for c in chunks) == "Hi \u00e9!"
    assert tokens_of(chunks) == [72, 105, 32, 1000 + 0xC3, 1000 + 0xA9, 33]
