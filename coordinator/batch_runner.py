"""The batch job runner: takes each unfinished job in the store and runs its lines, a large
window of them at once in the BATCH class, writing each line's result exactly once.

    store: active jobs ─▶ lease (one coordinator per job) ─▶ lines without a result
        each line: its attempt noted (request id) ─▶ LineRunner.run ─▶ put_result (once)
        all done ─▶ output / error files from the results, in input order ─▶ completed

Surviving a restart: a new coordinator finds the job among the active ones and takes its
lease once the old one's runs out. A line with a result is never run again. A line with an
attempt but no result is re-attached (`Dispatcher.attach`: the request continues where its
worker paused it); one whose request cannot be found or resumed is run again from scratch
under a new request id — it never wrote a result, so it still writes exactly one. Notices need nothing
here: a line is an ordinary request, and its relay migrates it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.batch_files import (
    BatchLine,
    error_line,
    is_success,
    output_files,
    parse_input,
    response_line,
)
from coordinator.batch_jobs import FINAL_STATUSES
from coordinator.batch_lines import Busy, LineOutcome, LineRunner, NotAttachable
from coordinator.constants import (
    BATCH_BUSY_RETRY_SECONDS,
    BATCH_LEASE_RENEW_SECONDS,
    BATCH_LEASE_TTL_SECONDS,
    BATCH_SCAN_SECONDS,
)
from store import BatchStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """A line's latest start: its request id, and how many starts from scratch it had."""

    request_id: str
    number: int

    def encode(self) -> str:
        return json.dumps({"request_id": self.request_id, "number": self.number})

    @classmethod
    def decode(cls, text: str) -> Attempt:
        value = json.loads(text)
        return cls(str(value["request_id"]), int(value["number"]))


class _Job:
    """One job being run here: its lines, what is left, why it stops early."""

    def __init__(self, batch_id: str, fields: dict[str, str], lines: list[BatchLine]) -> None:
        self.batch_id = batch_id
        self.tenant = fields.get("tenant", "")
        self.lines = lines
        self.stop_as = ""  # "cancelled" | "expired" once the job must stop early
        self.expires_at = int(fields.get("expires_at", "0") or 0)
        self.running: dict[str, asyncio.Task[LineOutcome]] = {}  # request id -> its line's task


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        lines: LineRunner,
        owner: str,
        lines_in_flight: int,
        clock: Callable[[], float] = time.time,
        lease_ttl_seconds: float = BATCH_LEASE_TTL_SECONDS,
    ) -> None:
        self._store = store
        self._lines = lines
        self._owner = owner
        self._lines_in_flight = lines_in_flight
        self._clock = clock
        self._lease_ttl_ms = int(lease_ttl_seconds * 1000)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._jobs: dict[str, _Job] = {}
        self._scanner: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Looks for unfinished jobs now and every few seconds (those of a coordinator that
        died, or of a replica that stopped)."""
        self._scanner = asyncio.get_running_loop().create_task(self._scan(), name="batch-scan")

    async def stop(self) -> None:
        tasks = [t for t in (self._scanner, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def launch(self, batch_id: str) -> None:
        """Runs the job here unless it already runs here (the lease decides among replicas)."""
        task = self._tasks.get(batch_id)
        if task is not None and not task.done():
            return
        self._tasks[batch_id] = asyncio.get_running_loop().create_task(
            self._guarded(batch_id), name=f"batch-{batch_id}"
        )

    def cancel(self, batch_id: str) -> None:
        job = self._jobs.get(batch_id)
        if job is not None:
            self._stop_early(job, "cancelled")

    async def wait(self, batch_id: str) -> None:
        """Until the job's task here ends (tests)."""
        task = self._tasks.get(batch_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _scan(self) -> None:
        while True:
            try:
                for batch_id in await asyncio.to_thread(self._store.active_batch_ids):
                    self.launch(batch_id)
            except Exception:  # the store may be down for a while: look again later
                log.exception("looking for unfinished batch jobs failed")
            await asyncio.sleep(BATCH_SCAN_SECONDS)

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self._run_job(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the next scan picks the job up again
            log.exception("batch job %s stopped", batch_id)
        finally:
            self._jobs.pop(batch_id, None)

    # -- one job -------------------------------------------------------------------------

    async def _take_lease(self, batch_id: str) -> bool:
        return await asyncio.to_thread(
            self._store.take_lease, batch_id, self._owner, self._lease_ttl_ms
        )

    async def _run_job(self, batch_id: str) -> None:
        if not await self._take_lease(batch_id):
            return  # another coordinator runs it; a later scan tries again
        fields = await asyncio.to_thread(self._store.batch, batch_id)
        if fields is None or fields["status"] in FINAL_STATUSES:
            await asyncio.to_thread(self._store.update_batch, batch_id, {}, True)
            return
        content = await asyncio.to_thread(self._store.file_content, fields["input_file_id"])
        try:
            lines = parse_input(content or b"")
        except ValueError as exc:
            await self._fail(batch_id, str(exc))
            return
        job = _Job(batch_id, fields, lines)
        self._jobs[batch_id] = job
        if fields["status"] == "validating":
            change = {"status": "in_progress", "in_progress_at": str(int(self._clock()))}
            await asyncio.to_thread(self._store.update_batch, batch_id, change)
        elif fields["status"] == "cancelling":
            job.stop_as = "cancelled"
        keeper = asyncio.get_running_loop().create_task(self._keep_lease(job))
        try:
            if not job.stop_as:
                await self._run_lines(job)
                await self._check_every_line_written(job)
            await self._finalize(job)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)

    async def _check_every_line_written(self, job: _Job) -> None:
        """A line that failed here (the store went away as it wrote) leaves the job
        unfinished: raised, and the next scan runs the rest."""
        if job.stop_as:
            return
        done = await asyncio.to_thread(self._store.result_ids, job.batch_id)
        missing = [line.custom_id for line in job.lines if line.custom_id not in done]
        if missing:
            raise RuntimeError(f"{len(missing)} lines have no result yet (first {missing[0]})")

    async def _keep_lease(self, job: _Job) -> None:
        """Renews the lease; stops the job on a cancel made through another replica, at its
        expiry, or when another coordinator took the job over."""
        while True:
            await asyncio.sleep(BATCH_LEASE_RENEW_SECONDS)
            try:
                if not await self._take_lease(job.batch_id):
                    log.warning("batch %s: lease lost; another coordinator runs it", job.batch_id)
                    self._stop_early(job, "lost")
                    return
                fields = await asyncio.to_thread(self._store.batch, job.batch_id) or {}
            except Exception as exc:  # the store: keep running, renew at the next round
                log.warning("batch %s: lease not renewed: %s", job.batch_id, exc)
                continue
            if fields.get("status") == "cancelling":
                self._stop_early(job, "cancelled")
            elif job.expires_at and self._clock() > job.expires_at:
                self._stop_early(job, "expired")

    def _stop_early(self, job: _Job, why: str) -> None:
        if job.stop_as:
            return
        job.stop_as = why
        for request_id, task in list(job.running.items()):
            task.cancel()
            asyncio.get_running_loop().create_task(self._lines.cancel(request_id))

    async def _run_lines(self, job: _Job) -> None:
        done = await asyncio.to_thread(self._store.result_ids, job.batch_id)
        attempts = {
            custom_id: Attempt.decode(text)
            for custom_id, text in (
                await asyncio.to_thread(self._store.attempts, job.batch_id)
            ).items()
        }
        window = asyncio.Semaphore(self._lines_in_flight)
        tasks: list[asyncio.Task[None]] = []
        for line in job.lines:
            if line.custom_id in done:
                continue  # a finished line is never redone
            await window.acquire()
            if job.stop_as:
                window.release()
                break
            task = asyncio.get_running_loop().create_task(
                self._line(job, line, attempts.get(line.custom_id))
            )
            task.add_done_callback(lambda _: window.release())
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _line(self, job: _Job, line: BatchLine, previous: Attempt | None) -> None:
        outcome: LineOutcome | None = None
        counters: dict[str, int] = {}
        request_id = ""
        if previous is not None:
            request_id = previous.request_id
            try:
                outcome = await self._tracked(job, previous.request_id, line, attach=True)
                counters["reattached_lines"] = 1
            except NotAttachable:
                log.info("batch %s: %s not found; run again", job.batch_id, previous.request_id)
                counters["restarted_lines"] = 1
        if outcome is None:
            number = previous.number + 1 if previous is not None else 1
            attempt = Attempt(f"{job.batch_id}-{line.index}-{number}", number)
            await asyncio.to_thread(
                self._store.note_attempt, job.batch_id, line.custom_id, attempt.encode()
            )
            request_id = attempt.request_id
            outcome = await self._tracked(job, request_id, line, attach=False)
        if job.stop_as:
            return  # cut by a cancel: the line gets "batch_cancelled" at the end
        counters.update(
            migrated_lines=int(outcome.migrated > 0),
            recovered_lines=int(outcome.recovered > 0),
            recomputed_tokens=outcome.recomputed_tokens,
        )
        result = response_line(line.custom_id, outcome.status_code, request_id, outcome.body)
        await self._write(job.batch_id, line.custom_id, result, counters)

    async def _tracked(
        self, job: _Job, request_id: str, line: BatchLine, attach: bool
    ) -> LineOutcome:
        """Runs the line, again after a pause while there is no room for it."""
        while True:
            task = asyncio.get_running_loop().create_task(
                self._lines.run(request_id, line, job.tenant, attach)
            )
            job.running[request_id] = task
            try:
                return await task
            except Busy:
                await asyncio.sleep(BATCH_BUSY_RETRY_SECONDS)
            finally:
                job.running.pop(request_id, None)

    async def _write(
        self, batch_id: str, custom_id: str, result: str, counters: dict[str, int]
    ) -> None:
        counter = "completed" if is_success(result) else "failed"
        written = await asyncio.to_thread(
            self._store.put_result, batch_id, custom_id, result, counter
        )
        if not written:
            log.warning("batch %s: %s already had its result; kept", batch_id, custom_id)
            counters = {"refused_writes": 1}
        counters = {name: value for name, value in counters.items() if value}
        if counters:
            await asyncio.to_thread(self._store.add_to_counters, batch_id, counters)

    async def _finalize(self, job: _Job) -> None:
        if job.stop_as == "lost":
            return
        now = str(int(self._clock()))
        final = job.stop_as or "completed"
        if not job.stop_as:
            await asyncio.to_thread(
                self._store.update_batch,
                job.batch_id,
                {"status": "finalizing", "finalizing_at": now},
            )
        else:  # the lines that never ran get their error entry
            done = await asyncio.to_thread(self._store.result_ids, job.batch_id)
            code = f"batch_{final}"
            for line in job.lines:
                if line.custom_id not in done:
                    message = f"the batch was {final} before this request ran"
                    entry = error_line(line.custom_id, code, message)
                    await self._write(job.batch_id, line.custom_id, entry, {})
        results = await asyncio.to_thread(self._store.results, job.batch_id)
        output, errors = output_files(job.lines, results)
        fields = {"status": final, f"{final}_at": now}
        for kind, content in (("output", output), ("error", errors)):
            if not content:
                continue
            file_id = f"file-{job.batch_id}-{kind}"
            meta = {
                "id": file_id,
                "tenant": job.tenant,
                "filename": f"{job.batch_id}_{kind}.jsonl",
                "purpose": f"batch_{kind}",
                "bytes": str(len(content)),
                "created_at": now,
            }
            await asyncio.to_thread(self._store.put_file, file_id, meta, content)
            fields[f"{kind}_file_id"] = file_id
        await asyncio.to_thread(self._store.update_batch, job.batch_id, fields, True)
        log.info("batch %s %s (%d lines)", job.batch_id, final, len(job.lines))

    async def _fail(self, batch_id: str, message: str) -> None:
        errors = {"object": "list", "data": [{"code": "invalid_file", "message": message}]}
        fields = {
            "status": "failed",
            "failed_at": str(int(self._clock())),
            "errors": json.dumps(errors),
        }
        await asyncio.to_thread(self._store.update_batch, batch_id, fields, True)
