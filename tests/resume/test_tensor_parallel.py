"""KV of a tensor-parallel worker: each rank stores and loads its own shard.

Workers run the tiny model with tensor parallel size 2 on vLLM-CPU (two rank processes, both
bound to core 0: ``VLLM_CPU_OMP_THREADS_BIND="0|0"``, see below) and persist to a real
redis-server:

- a notice: the TP=2 standby first stages both shards of the stored chunk (a migration's
  prefetch), the TP=2 source pauses and flushes every rank's shard; the standby resumes with
  nothing recomputed, and the client's output equals an uninterrupted run;
- an abrupt loss (SIGKILL) after a chunk reached Redis: the TP=2 standby loads what every
  rank stored and recomputes only the rest;
- a TP=1 standby finds rank 0's shard under the plain key, refuses it by its layout string
  (``tp=0/2``) and recomputes, and its event says why: never another degree's bytes.

Each rank's values are distinct keys with distinct bytes (checked in Redis). Worker processes
rather than a whole local cluster: two workers of two ranks each, with a coordinator, daemons
and Redis beside them, saturate a two-core machine: in such drills Redis answered nothing
for seconds, so their outcome measured the machine, not the KV path.

Each rank's process is pinned to its core (VLLM_CPU_OMP_THREADS_BIND) and so were, once, the
threads it starts: a rank's eager save of the request's first chunk then waited behind that
rank's own steps, reaching Redis anywhere from at once to near the request's end. The
connector's threads now leave the rank's core (common/cpu_affinity.py); `_pinned_elsewhere`
checks it on the running ranks.

Both ranks share core 0, and core 1 is left to everything else (Redis, the test, the
connector's threads). With one core per rank ("0|1") on a two-core machine, a TP=2 decode
left nothing else on the machine running for most of the request, on the 6.18 kernel we test
on: redis-server, the test's thread and kernel threads waited 6–15 s on the run queue while
the ranks decoded 1,900 tokens (as SCHED_IDLE or under a CPU quota too; a SCHED_FIFO probe
ran on time, and a TP=1 worker caused no such wait). The workers' Redis reads timed out (2 s),
their eager saves were dropped, and the request ended before the test could act. vLLM keeps
cores beside the ranks' for its other processes for that reason (OMPProcessManager's
reserved CPUs); on two cores, core 1 is that reserve.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestNotFound, block_hashes
from store.keys import block_key, shard_suffixes
from tests.resume.conftest import BLOCK_TOKENS, worker_flags
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vLLM-CPU binds one core per rank: 2 needed"
)

# The first 256-token chunk is full at token 206 and reaches Redis a little later (a few
# tokens with core 1 free for the save); the requests run to 1,000 tokens, ~20 s at the
# ranks' shared core's pace, for the kill or the pause to land well before the end.
MAX_MODEL_LEN_TP = 2048
MAX_TOKENS = 1000
# Both ranks on core 0; core 1 for the rest (see the docstring). SPOTINFER_TP_RANK_CORES
# binds them otherwise (e.g. "0|1", one core each, on a machine whose scheduler allows it).
RANK_CORES = os.environ.get("SPOTINFER_TP_RANK_CORES", "0|0")
PROMPT = list(range(120, 170))
NOTICE_SECONDS = 60.0
PAUSE_BY_TOKENS = MAX_TOKENS // 2  # the notice test pauses by then, staged or not
SOURCE_NICE = 10


def _tp2_flags(redis_url: str, worker_id: str) -> tuple[str, ...]:
    return (
        *worker_flags(redis_url),
        *("--max-model-len", str(MAX_MODEL_LEN_TP)),
        *("--tensor-parallel-size", "2", "--worker-id", worker_id),
    )


@pytest.fixture(scope="module")
def tp2_standby(
    tiny_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A TP=2 worker that resumes what the TP=2 sources leave behind."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", RANK_CORES)
        with WorkerProcess(
            tiny_model,
            *_tp2_flags(redis_server.url, "worker-tp2-standby"),
            log_dir=tmp_path_factory.mktemp("tp2-standby"),
        ) as process:
            yield process


@pytest.fixture(scope="module")
def tp2_reference(tp2_standby: WorkerProcess) -> list[int]:
    """The uninterrupted output of the test's request on a TP=2 worker."""
    return generate(tp2_standby, greedy_request("tp2-reference", PROMPT, MAX_TOKENS))


def _shards_distinct(redis_url: str, block_hash: bytes) -> None:
    """Both ranks' values of one block are stored, under different keys, with different
    layout strings and bytes."""
    client = redis.Redis.from_url(redis_url)
    try:
        values = [client.get(block_key(block_hash, shard)) for shard in shard_suffixes(2)]
    finally:
        client.close()
    first, second = values
    assert isinstance(first, bytes) and isinstance(second, bytes), "a shard is missing"
    assert b"tp=0/2," in first[:400] and b"tp=1/2," in second[:400]
    assert first != second


def _lowered(worker: WorkerProcess) -> None:
    """The source's processes (its process group: the worker, its engine and both ranks) at
    nice 10: on a loaded two-core machine the test's own thread, which watches the store and
    acts, and the standby's stages then get the CPU first, and the source cannot run its
    tokens to the end before the test has acted."""
    assert worker.pid is not None
    os.setpriority(os.PRIO_PGRP, worker.pid, SOURCE_NICE)


def _generate_until_stored(
    worker: WorkerProcess,
    store: RedisStore,
    fingerprint: str,
    request_id: str,
    shards: tuple[str, ...],
) -> StreamReader:
    """Start the test's request on ``worker`` (lowered: `_lowered`) and return once the
    first chunk of its committed context is stored under every one of ``shards``."""
    _lowered(worker)
    reader = StreamReader(
        worker.stub.Generate(
            greedy_request(request_id, PROMPT, MAX_TOKENS), timeout=STREAM_TIMEOUT_SECONDS
        )
    )

    def stored() -> bool:
        hashes = block_hashes(fingerprint, _context(store, request_id), BLOCK_TOKENS)[:1]
        return bool(hashes) and all(all(store.blocks_present(hashes, s)) for s in shards)

    wait_until(lambda: reader.done or stored(), f"the first chunk of {request_id} stored")
    return reader


def test_a_notice_moves_every_rank_shard_to_a_tp2_standby_with_nothing_recomputed(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    tp2_standby: WorkerProcess,
    tp2_reference: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request_id = "tp2-notice"
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", RANK_CORES)
    with WorkerProcess(
        tiny_model, *_tp2_flags(redis_server.url, "worker-tp2-notice"), log_dir=tmp_path
    ) as source:
        # Past a full chunk, stored by both ranks: the standby stages both shards of it (as a
        # live migration's first stage does), the pause stores the rest and a tail.
        reader = _generate_until_stored(source, store, fingerprint, request_id, shard_suffixes(2))
        # A stage counts the committed tokens' KV but the last's: it may run before the
        # token after the chunk is committed, so a migration (and this test) stages again.
        # On a loaded machine the source may store its second chunk before a stage lands: a
        # stage then holds both, and the resume reports what was staged last. Stages on a
        # loaded two-core machine can be slower than the source's decode: they run in a
        # thread, and past half of its tokens the source is paused all the same (as a
        # migration pauses at its deadline), so that the pause, not the end, cuts the request.
        staged = [0]
        stager = _Stager(tp2_standby, request_id, staged)
        stager.start()
        try:
            wait_until(
                lambda: staged[-1] >= 1 or len(reader.tokens()) >= PAUSE_BY_TOKENS or reader.done,
                "both shards of the first chunk staged on the standby",
            )
        finally:
            stager.stop()  # a stage in flight goes on: the pause need not wait for it
        assert not reader.done, "the request ran to its end before the test paused it"
        reports = list(
            source.stub.Preempt(
                worker_pb2.PreemptRequest(deadline_unix=time.time() + NOTICE_SECONDS),
                timeout=NOTICE_SECONDS + 30,
            )
        )
        reader.join()
        stager.join()  # the standby's last stage is the one its resume reports
    received = reader.tokens()
    assert reader.responses[-1].event.kind == common_pb2.EVENT_KIND_NOTICE, "the pause cut it"
    (report,) = reports
    assert report.complete and report.committed_tokens == len(received), report
    context = PROMPT + received
    (first, *_) = block_hashes(fingerprint, context, BLOCK_TOKENS)
    _shards_distinct(redis_server.url, first)

    event, resumed = resume_stream(tp2_standby, request_id, from_index=len(received))

    assert received + resumed == tp2_reference
    assert event.kind == common_pb2.EVENT_KIND_MIGRATED
    assert event.recomputed_tokens == 0, event.detail
    assert event.loaded_tokens == len(context) - 1, event.detail
    if staged[-1]:
        assert f"{staged[-1]} blocks prefetched before the pause" in event.detail, event.detail
    else:  # every rank's shard read from Redis instead
        assert "prefetched" not in event.detail, event.detail


def test_an_abrupt_loss_of_a_tp2_worker_loads_every_rank_shard(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    tp2_standby: WorkerProcess,
    tp2_reference: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request_id = "tp2-abrupt"
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", RANK_CORES)
    with WorkerProcess(
        tiny_model, *_tp2_flags(redis_server.url, "worker-tp2-abrupt"), log_dir=tmp_path
    ) as source:
        reader = _generate_until_stored(source, store, fingerprint, request_id, shard_suffixes(2))
        pinned = _pinned_elsewhere(source)
        source.kill()
        reader.join()
    assert pinned, "no rank found"
    assert not [r for r in reader.responses if r.finish_reason], "the kill must cut it"
    received = reader.tokens()
    committed = store.committed_tokens(request_id)
    first = block_hashes(fingerprint, PROMPT + committed, BLOCK_TOKENS)[0]
    _shards_distinct(redis_server.url, first)

    event, resumed = resume_stream(tp2_standby, request_id, from_index=len(received))

    assert received + resumed == tp2_reference
    assert event.kind == common_pb2.EVENT_KIND_RECOVERED
    context_tokens = len(PROMPT) + len(committed)
    # The stored chunk was loaded, every rank's shard of it (all of it the context needs: vLLM
    # computes the last token itself, so a context of one chunk loads one token less).
    assert event.loaded_tokens >= min(BLOCK_TOKENS, context_tokens - 1), event.detail
    assert event.loaded_tokens + event.recomputed_tokens == context_tokens - 1, event.detail


def _cpus(path: Path) -> set[int]:
    """A task's CPU mask, from its /proc status (``Cpus_allowed_list: 0-1,3``)."""
    line = next(
        row for row in path.read_text().splitlines() if row.startswith("Cpus_allowed_list:")
    )
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _pinned_elsewhere(worker: WorkerProcess) -> dict[int, set[int]]:
    """Each rank process of ``worker``'s group: its main thread's mask, checked to be one core
    (vLLM's binding), and that some of its threads (the connector's writer and landing; the
    rank's own threads keep the pin) may run on every CPU. Rank pid -> main thread's mask."""
    assert worker.pid is not None
    everywhere = os.sched_getaffinity(0)
    ranks: dict[int, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != worker.pid:
                continue
            if not (proc / "comm").read_text().startswith("VLLM::Worker_TP"):
                continue
            main = _cpus(proc / "status")
            threads = [_cpus(task / "status") for task in (proc / "task").iterdir()]
        except (OSError, StopIteration):
            continue  # gone meanwhile
        assert len(main) == 1, f"rank {proc.name} is not bound to one core: {main}"
        assert everywhere in threads, f"rank {proc.name}: every thread is pinned to {main}"
        ranks[int(proc.name)] = main
    return ranks


def _context(store: RedisStore, request_id: str) -> list[int]:
    """The context a resume would have now: the prompt and the committed tokens (they lag
    behind the client's, and a stored chunk counts only once they cover it)."""
    try:
        return PROMPT + store.committed_tokens(request_id)
    except RequestNotFound:
        return PROMPT


def _prefetch(worker: WorkerProcess, request_id: str) -> worker_pb2.PrefetchResponse:
    return worker.stub.Prefetch(worker_pb2.PrefetchRequest(request_id=request_id), timeout=60)


class _Stager(threading.Thread):
    """Asks ``standby`` to stage ``request_id`` again and again (a migration's prefetch),
    appending each answer's staged block count to ``staged``, until one holds a block or
    `stop`. A thread: one stage can take seconds on a loaded machine, and the test watches
    the source's tokens meanwhile, to pause it in time whatever the stages do."""

    def __init__(self, standby: WorkerProcess, request_id: str, staged: list[int]) -> None:
        super().__init__(name="tp2-stager", daemon=True)
        self._standby = standby
        self._request_id = request_id
        self._staged = staged
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.is_set() and self._staged[-1] < 1:
            self._staged.append(_prefetch(self._standby, self._request_id).staged_blocks)

    def stop(self) -> None:
        self._stopped.set()


@pytest.fixture
def tp1_standby(
    tiny_model: Path, redis_server: RedisServer, tmp_path: Path
) -> Iterator[WorkerProcess]:
    """A TP=1 worker with the TP=2 workers' window."""
    with WorkerProcess(
        tiny_model,
        *worker_flags(redis_server.url),
        *("--max-model-len", str(MAX_MODEL_LEN_TP), "--worker-id", "worker-tp1-standby"),
        log_dir=tmp_path / "tp1",
    ) as process:
        yield process


def test_kv_of_a_tp2_worker_is_refused_by_a_tp1_worker_and_recomputed(
    tiny_model: Path,
    redis_server: RedisServer,
    store: RedisStore,
    tp1_standby: WorkerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standby = tp1_standby
    fingerprint = model_fingerprint(str(tiny_model), "float32")
    request_id = "tp2-to-tp1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", RANK_CORES)
    with WorkerProcess(
        tiny_model, *_tp2_flags(redis_server.url, "worker-tp2"), log_dir=tmp_path
    ) as source:
        reader = _generate_until_stored(source, store, fingerprint, request_id, ("",))
        source.kill()
        reader.join()
    assert not [r for r in reader.responses if r.finish_reason], "the kill must cut it"
    received = reader.tokens()
    committed = store.committed_tokens(request_id)
    context_tokens = len(PROMPT) + len(committed)

    event, resumed = resume_stream(standby, request_id, from_index=len(received))
    reference = generate(standby, greedy_request("tp2-to-tp1-reference", PROMPT, MAX_TOKENS))
    assert received + resumed == reference
    assert event.kind == common_pb2.EVENT_KIND_RECOVERED
    assert event.loaded_tokens == 0
    assert event.recomputed_tokens == context_tokens - 1
    assert "written in another KV layout" in event.detail, event.detail
    assert "rejected (layout)" in standby.output
