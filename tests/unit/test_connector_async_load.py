"""A resume's stored KV read and copied off the engine's step (``--kv-load async``): the
scheduler side reads the store on its lookup thread and answers None (ask again) until the
count is known, then that the load is asynchronous; the worker side copies on its loader
thread and names the request in get_finished once done; a failed read recomputes and a
failed copy reports its slots, never a stalled or broken engine. In-memory fakes for vLLM's
request, the store and the copier; the resume tests run the whole path on real vLLM."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from store import KVBlock, KVFormat
from store.block_refs import BlockRead
from tests.unit.test_connector_chunks import CHUNK, ENGINE_BLOCK, FORMAT, _request, _scheduler
from worker.spot_connector_metadata import BlockLoad, SpotConnectorMetadata
from worker.spot_connector_worker import SpotConnectorWorker

WAIT_SECONDS = 10.0


class GatedStore:
    """Holds every chunk asked for, once `release` lets the read finish; remembers the
    thread that read."""

    keyring = None

    def __init__(self, error: Exception | None = None) -> None:
        self.gate = threading.Event()
        self.readers: list[str] = []
        self._error = error

    def get_blocks(self, reads: Sequence[BlockRead], kv_format: KVFormat) -> list[KVBlock]:
        self.readers.append(threading.current_thread().name)
        assert self.gate.wait(WAIT_SECONDS)
        if self._error is not None:
            raise self._error
        return [KVBlock(kv_format, read.prefix_hash, read.num_tokens, b"kv") for read in reads]

    def close(self) -> None:
        self.gate.set()


def _answer_once_read(scheduler: Any, request: Any, computed: int) -> tuple[int | None, bool]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        answer = scheduler.get_num_new_matched_tokens(request, computed)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer  # type: ignore[no-any-return]
        time.sleep(0.01)


def _no_step() -> Any:
    return SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)


def test_the_store_is_read_off_the_scheduler_call_and_the_load_is_asynchronous() -> None:
    store = GatedStore()
    scheduler = _scheduler("async", store)
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    # The read waits on the store: the scheduler call does not.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    store.gate.set()
    assert _answer_once_read(scheduler, request, 0) == (599, True)
    assert store.readers and all(name.startswith("spot-kv-lookup") for name in store.readers)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(request, blocks, 599)
    meta = scheduler.build_connector_meta(_no_step())
    assert meta.receiving == ["vllm-1"]
    assert [(load.block_ids, load.vllm_id) for load in meta.loads] == [
        ((10, 11), "vllm-1"),
        ((12, 13), "vllm-1"),
        ((14,), "vllm-1"),
    ]
    assert scheduler.build_connector_meta(_no_step()).receiving == [], "named once"
    scheduler.shutdown()


def test_a_local_hit_that_moves_while_the_store_is_read_is_read_again() -> None:
    store = GatedStore()
    scheduler = _scheduler("async", store)
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    store.gate.set()
    # Asked again with a longer local hit: the first read's plan is not the answer.
    assert scheduler.get_num_new_matched_tokens(request, ENGINE_BLOCK) == (None, False)
    assert _answer_once_read(scheduler, request, ENGINE_BLOCK) == (599 - ENGINE_BLOCK, True)
    assert len(store.readers) == 2
    scheduler.shutdown()


def test_a_read_that_fails_on_the_lookup_thread_recomputes() -> None:
    store = GatedStore(RuntimeError("a broken reply"))
    scheduler = _scheduler("async", store)
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    store.gate.set()
    assert _answer_once_read(scheduler, request, 0) == (0, False)
    scheduler.shutdown()


def test_a_request_aborted_while_its_store_read_runs_is_dropped() -> None:
    from vllm.v1.request import RequestStatus

    store = GatedStore()
    scheduler = _scheduler("async", store)
    request = _request(600, 0, resume=True)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    request.status = RequestStatus.FINISHED_ABORTED
    request.num_computed_tokens = 0
    delay_free, _ = scheduler.request_finished(request, [])
    assert not delay_free
    store.gate.set()
    meta = scheduler.build_connector_meta(_no_step())
    assert meta.loads == [] and meta.receiving == []
    scheduler.shutdown()


class FakeCopier:
    """Records which slots it filled and on which thread. A copy off the main thread waits
    for ``gate``; one of a slot in ``fail_on`` raises."""

    def __init__(self, fail_on: frozenset[int] = frozenset()) -> None:
        self.filled: list[tuple[int, ...]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.fail_on = fail_on

    def last_block_tokens(self, num_tokens: int) -> tuple[int, int]:
        return 1, 0

    def part(self, value: Any, blocks: int, last: int, first: int, count: int) -> Any:
        return value, last

    def scatter(
        self,
        tensors: Any,
        block_ids: Sequence[int],
        value: Any,
        last: int,
        descriptor: str | None = None,
    ) -> None:
        name = threading.current_thread().name
        self.threads.add(name)
        if name != "MainThread":
            assert self.gate.wait(WAIT_SECONDS)
        if self.fail_on & set(block_ids):
            raise RuntimeError("a copy failed")
        self.filled.append(tuple(block_ids))


def _worker(copier: FakeCopier) -> SpotConnectorWorker:
    config = SimpleNamespace(num_blocks=16, kv_cache_groups=[SimpleNamespace(layer_names=["l0"])])
    store = SimpleNamespace(close=lambda: None)
    return SpotConnectorWorker(config, FORMAT, copier, store)  # type: ignore[arg-type]


def _finished(worker: SpotConnectorWorker) -> set[str]:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        _, received = worker.get_finished()
        if received:
            return received
        time.sleep(0.01)
    return set()


@pytest.mark.parametrize("fail", [False, True], ids=["copied", "copy-failed"])
def test_the_worker_copies_asynchronous_loads_on_its_loader_thread(fail: bool) -> None:
    copier = FakeCopier(frozenset({3, 4}) if fail else frozenset())
    worker = _worker(copier)
    meta = SpotConnectorMetadata(
        loads=[
            BlockLoad((3, 4), (b"x" * 8,), num_tokens=CHUNK, vllm_id="vllm-a"),
            BlockLoad((5,), (b"y" * 8,), num_tokens=CHUNK // 2, vllm_id="vllm-b"),
        ],
        receiving=["vllm-a"],
    )
    worker.start_load_kv(meta)
    # vllm-b's load is synchronous: copied before start_load_kv returned, never reported;
    # vllm-a's waits on the loader thread and is not reported before its copy is done.
    assert copier.filled == [(5,)]
    assert worker.get_finished() == (None, None)
    copier.gate.set()
    assert _finished(worker) == {"vllm-a"}, "reported finished, copied or not"
    assert {name for name in copier.threads if name != "MainThread"} and all(
        name.startswith("spot-kv-load") for name in copier.threads - {"MainThread"}
    )
    if fail:
        assert copier.filled == [(5,)]
        assert worker.take_load_errors() == {3, 4}, "vLLM recomputes the slots"
    else:
        assert copier.filled == [(5,), (3, 4)]
    assert worker.take_load_errors() == set()
    assert worker.get_finished() == (None, None)
    worker.shutdown()


class RecordingWriter:
    """The writer's interface, recording what reaches it and in which order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def buffer(self, nbytes: int, required: bool = False) -> Any:
        import torch

        return torch.zeros(nbytes, dtype=torch.uint8)

    def submit(self, block: Any, required: bool = False) -> None:
        self.calls.append(("block", block.block_index))

    def submit_paused(self, request_id: str, full_blocks: int, tail_tokens: int) -> None:
        self.calls.append(("paused", request_id))

    def submit_tokens(self, commit: Any, final: bool = False) -> None:
        self.calls.append(("tokens", final))

    def submit_no_kv(self, request_id: str) -> None:
        self.calls.append(("no-kv", request_id))

    def close(self, timeout: float) -> None:
        pass


class GatedCopies:
    """A CopyStream whose saves finish when the test opens the gate (a GPU copy in flight)."""

    def __init__(self) -> None:
        from worker.kv_transfer import Transfer

        gate = self.gate = threading.Event()

        class Gated(Transfer):
            def done(self) -> bool:
                return gate.is_set()

            def wait(self) -> None:
                assert gate.wait(WAIT_SECONDS)

        self._transfer = Gated

    def save(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer()


class SizedCopier(FakeCopier):
    def value_bytes(self, blocks: int, last: int = 0) -> int:
        return 16 * blocks


def test_saves_in_flight_hold_back_what_follows_them_and_the_slots() -> None:
    """A GPU save still copying: its block, the pause after it and the release of its slots
    wait for it, in that order; the step's commits before it do not."""
    from worker.spot_connector_metadata import BlockSave

    worker = _worker(SizedCopier())
    worker._writer.close(1)
    writer = worker._writer = RecordingWriter()  # type: ignore[assignment]
    copies = worker._copies = GatedCopies()  # type: ignore[assignment]
    meta = SpotConnectorMetadata(
        commits=[SimpleNamespace()],  # type: ignore[list-item]
        saves=[BlockSave("r", 0, (3,), b"h0", CHUNK), BlockSave("r", 1, (4,), b"h1", CHUNK)],
        paused=[("r", 2, 0)],
        released=["vllm-r"],
    )
    worker.wait_for_save(meta)
    assert writer.calls == [("tokens", False)]
    assert worker.get_finished() == (None, None), "slots held while their copies run"
    copies.gate.set()
    deadline = time.monotonic() + WAIT_SECONDS
    released: set[str] | None = None
    while released is None and time.monotonic() < deadline:
        released, _ = worker.get_finished()
        time.sleep(0.01)
    assert released == {"vllm-r"}
    assert writer.calls == [("tokens", False), ("block", 0), ("block", 1), ("paused", "r")]
    worker.shutdown()
