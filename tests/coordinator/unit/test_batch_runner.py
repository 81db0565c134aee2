"""The batch job runner in-process, on the in-memory batch store and a scripted LineRunner:
each line's result is written once, a finished line is never run again after a takeover,
a line whose request cannot be re-attached runs again from scratch, and the output and
error files follow OpenAI's format in input order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from common.errors import InvalidRequest
from coordinator.batch_files import BatchLine, parse_input
from coordinator.batch_jobs import BatchJobs
from coordinator.batch_lines import Busy, LineOutcome, NotAttachable
from coordinator.batch_runner import Attempt, BatchRunner
from coordinator.errors import UnknownBatchObject
from store import MemoryBatchStore

TENANT = "t1"


def _input(count: int, url: str = "/v1/completions") -> bytes:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": url, "body": {"prompt": f"p{i}"}}
        for i in range(count)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


class ScriptedLines:
    """Answers each line with its prompt reversed; ``hold`` keeps chosen lines running
    until released, ``lost`` makes an attach to those request ids fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []  # (custom_id, request id, attach)
        self.hold: set[str] = set()
        self.lost: set[str] = set()
        self.busy_once: set[str] = set()
        self.released = asyncio.Event()
        self.cancelled: list[str] = []

    async def run(self, request_id: str, line: BatchLine, tenant: str, attach: bool) -> LineOutcome:
        self.calls.append((line.custom_id, request_id, attach))
        if attach and request_id in self.lost:
            raise NotAttachable(request_id)
        if line.custom_id in self.busy_once:
            self.busy_once.discard(line.custom_id)
            raise Busy("queue full")
        if line.custom_id in self.hold:
            await self.released.wait()
        text = str(line.body["prompt"])[::-1]
        body: dict[str, Any] = {"choices": [{"index": 0, "text": text}]}
        return LineOutcome(200, body, migrated=int(attach))

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _job(store: MemoryBatchStore, runner: BatchRunner, content: bytes) -> str:
    jobs = BatchJobs(store, runner)
    uploaded = await jobs.upload(TENANT, "in.jsonl", "batch", content)
    body = {
        "input_file_id": uploaded["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    created = await jobs.create(TENANT, body)
    assert created["status"] == "validating"
    return str(created["id"])


def _output(store: MemoryBatchStore, batch_id: str, kind: str = "output") -> list[dict[str, Any]]:
    fields = store.batch(batch_id)
    assert fields is not None
    content = store.file_content(fields[f"{kind}_file_id"]) or b""
    return [json.loads(line) for line in content.decode().splitlines()]


async def test_a_job_writes_each_line_once_in_input_order() -> None:
    store, lines = MemoryBatchStore(), ScriptedLines()
    lines.busy_once.add("c3")  # a full queue: tried again, not failed
    runner = BatchRunner(store, lines, "coord-a", lines_in_flight=4)
    batch_id = await _job(store, runner, _input(10))
    await runner.wait(batch_id)
    fields = store.batch(batch_id)
    assert fields is not None and fields["status"] == "completed"
    assert (fields["total"], fields["completed"], fields["failed"]) == ("10", "10", "0")
    output = _output(store, batch_id)
    assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(10)]
    assert [o["response"]["body"]["choices"][0]["text"] for o in output] == [
        f"{i}p" for i in range(10)
    ]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert len({o["id"] for o in output}) == 10
    assert store.refused_results == 0
    assert [c for c, _, _ in lines.calls].count("c3") == 2
    assert fields.get("error_file_id") is None


async def test_a_takeover_never_reruns_a_finished_line_and_restarts_a_lost_one() -> None:
    clock = Clock()
    store, first = MemoryBatchStore(clock=clock), ScriptedLines()
    first.hold = {"c5", "c6", "c7"}
    runner_a = BatchRunner(store, first, "coord-a", lines_in_flight=8)
    batch_id = await _job(store, runner_a, _input(8))
    while len(store.result_ids(batch_id)) < 5:
        await asyncio.sleep(0.01)
    await runner_a.stop()  # the coordinator dies with three lines running
    finished = store.result_ids(batch_id)
    assert finished == {f"c{i}" for i in range(5)}
    attempts = {c: Attempt.decode(t) for c, t in store.attempts(batch_id).items()}

    second = ScriptedLines()
    second.lost = {attempts["c6"].request_id}  # finished in the gap and gone
    runner_b = BatchRunner(store, second, "coord-b", lines_in_flight=8)
    runner_b.launch(batch_id)
    await runner_b.wait(batch_id)
    fields = store.batch(batch_id)
    assert fields is not None and fields["status"] == "in_progress", "lease still held by a"
    clock.now += 10  # a's lease runs out
    runner_b.launch(batch_id)
    await runner_b.wait(batch_id)

    fields = store.batch(batch_id)
    assert fields is not None and fields["status"] == "completed"
    assert {c for c, _, _ in second.calls} == {"c5", "c6", "c7"}, "finished lines not rerun"
    assert attempts["c5"].request_id and (("c5", attempts["c5"].request_id, True)) in second.calls
    assert ("c6", f"{batch_id}-6-2", False) in second.calls, "run again under a new id"
    assert fields["reattached_lines"] == "2" and fields["restarted_lines"] == "1"
    output = _output(store, batch_id)
    assert sorted(o["custom_id"] for o in output) == [f"c{i}" for i in range(8)]
    assert store.refused_results == 0


async def test_a_cancel_keeps_what_finished_and_names_what_never_ran() -> None:
    store, lines = MemoryBatchStore(), ScriptedLines()
    lines.hold = {"c2"}
    runner = BatchRunner(store, lines, "coord-a", lines_in_flight=1)
    batch_id = await _job(store, runner, _input(5))
    while len(store.result_ids(batch_id)) < 2:
        await asyncio.sleep(0.01)
    cancelled = await BatchJobs(store, runner).cancel(TENANT, batch_id)
    assert cancelled["status"] == "cancelling"
    await runner.wait(batch_id)
    fields = store.batch(batch_id)
    assert fields is not None and fields["status"] == "cancelled"
    assert [o["custom_id"] for o in _output(store, batch_id)] == ["c0", "c1"]
    errors = _output(store, batch_id, "error")
    assert [e["custom_id"] for e in errors] == ["c2", "c3", "c4"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert lines.cancelled == [f"{batch_id}-2-1"], "the running line's request was cancelled"
    assert store.active_batch_ids() == []


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'{"custom_id": "a", "method": "POST"\n', "line 1: not JSON"),
        (_input(2).replace(b'"c1"', b'"c0"'), "line 2: duplicate custom_id"),
        (_input(1, url="/v1/embeddings"), "line 1: url must be one of"),
        (_input(1) + _input(1, url="/v1/chat/completions").replace(b"c0", b"x"), "several"),
        (_input(1).replace(b'"POST"', b'"GET"'), "method must be POST"),
        (b"\n\n", "no request"),
    ],
)
def test_a_malformed_input_file_is_refused_naming_the_line(content: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_input(content)


async def test_jobs_check_their_request_and_belong_to_one_tenant() -> None:
    store = MemoryBatchStore()
    runner = BatchRunner(store, ScriptedLines(), "coord-a", lines_in_flight=2)
    jobs = BatchJobs(store, runner)
    uploaded = await jobs.upload(TENANT, "in.jsonl", "batch", _input(2))
    good = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions"}
    with pytest.raises(InvalidRequest, match="completion_window"):
        await jobs.create(TENANT, {**good, "completion_window": "1h"})
    with pytest.raises(InvalidRequest, match="the file's requests are for /v1/completions"):
        await jobs.create(
            TENANT, {**good, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        )
    with pytest.raises(UnknownBatchObject):
        await jobs.create("other", {**good, "completion_window": "24h"})
    with pytest.raises(InvalidRequest, match="purpose"):
        await jobs.upload(TENANT, "in.jsonl", "fine-tune", _input(1))
    created = await jobs.create(TENANT, {**good, "completion_window": "24h"})
    await runner.wait(created["id"])
    listed = await jobs.page(TENANT, "", 20)
    assert [b["id"] for b in listed["data"]] == [created["id"]]
    assert (await jobs.page("other", "", 20))["data"] == []
    with pytest.raises(UnknownBatchObject):
        await jobs.get("other", created["id"])
