"""Streams from the client VM through the rehearsal's coordinator, and what they must show.

    plan (seeded prompts) ─▶ run_streams (coordinator, Attach on a break) ─▶ traces
                             reference   (one worker, straight, greedy)  ─▶ token ids
                                                                verdict ◀─┘

The verdict is the drills' invariants, without the leak check (a rehearsal keeps Redis
only as long as it runs): every stream completes, no token index twice or missing, the
output equals the uninterrupted greedy run, and after a notice nothing is recomputed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.channels import PLAINTEXT, TransportConfig
from spotinfer.loadgen import LoadSpec, PlannedRequest, RequestTrace, plan_requests, run_load

STREAM_TIMEOUT_SECONDS = 300.0


def plan(
    count: int, prefix: str, vocab_size: int, output_tokens: tuple[int, int] = (48, 64)
) -> list[PlannedRequest]:
    spec = LoadSpec(
        num_requests=count,
        rate_per_second=0.0,
        prompt_tokens=(16, 48),
        output_tokens=output_tokens,
        vocab_high=vocab_size,
        seed=len(prefix),
    )
    return plan_requests(spec, prefix=prefix)


def run_streams(
    target: str,
    planned: Sequence[PlannedRequest],
    on_start: Callable[[RequestTrace], None] | None = None,
    on_done: Callable[[RequestTrace], None] | None = None,
    transport: TransportConfig = PLAINTEXT,
    api_key: str = "",
) -> list[RequestTrace]:
    return asyncio.run(
        run_load(
            target,
            planned,
            service="inference",
            timeout_seconds=STREAM_TIMEOUT_SECONDS,
            on_start=on_start,
            on_done=on_done,
            transport=transport,
            api_key=api_key,
        )
    )


class Streams:
    """Streams running in a thread of their own while a test disturbs the fleet."""

    def __init__(
        self,
        target: str,
        planned: Sequence[PlannedRequest],
        on_done: Callable[[RequestTrace], None] | None = None,
        transport: TransportConfig = PLAINTEXT,
        api_key: str = "",
    ) -> None:
        self.planned = list(planned)
        self._transport = transport
        self._api_key = api_key
        self._on_done = on_done
        self.live: list[RequestTrace] = []
        self.traces: list[RequestTrace] = []
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True)

    def _run(self, target: str) -> None:
        try:
            self.traces = run_streams(
                target,
                self.planned,
                on_start=self.live.append,
                on_done=self._on_done,
                transport=self._transport,
                api_key=self._api_key,
            )
        except BaseException as exc:  # re-raised by join
            self._failure.append(exc)

    def start(self) -> Streams:
        self._thread.start()
        return self

    def tokens_so_far(self) -> int:
        return sum(len(trace.token_ids) for trace in self.live)

    def join(self, timeout_seconds: float = STREAM_TIMEOUT_SECONDS + 30) -> list[RequestTrace]:
        self._thread.join(timeout_seconds)
        if self._thread.is_alive():
            raise TimeoutError(f"streams still running after {timeout_seconds:g}s")
        if self._failure:
            raise self._failure[0]
        return self.traces


def reference(
    worker_target: str,
    planned: Sequence[PlannedRequest],
    transport: TransportConfig = PLAINTEXT,
) -> dict[str, list[int]]:
    """The same requests, greedy, straight on one worker (no coordinator, no disturbance);
    `transport`: a certificate the worker lets call Generate (an operator's)."""
    again = [
        PlannedRequest(
            request_id=f"ref-{p.request_id}",
            send_offset_seconds=0.0,
            prompt_token_ids=p.prompt_token_ids,
            max_tokens=p.max_tokens,
            sla_class=p.sla_class,
        )
        for p in planned
    ]
    traces = asyncio.run(
        run_load(
            worker_target,
            again,
            service="worker",
            timeout_seconds=STREAM_TIMEOUT_SECONDS,
            transport=transport,
        )
    )
    failed = [t.request_id for t in traces if not t.ok]
    if failed:
        raise RuntimeError(f"reference run failed for {failed}")
    return {p.request_id: t.token_ids for p, t in zip(planned, traces, strict=True)}


@dataclass
class Verdict:
    requests: int
    lost: list[str] = field(default_factory=list)
    duplicates: int = 0
    gaps: int = 0
    mismatches: list[str] = field(default_factory=list)
    migrations: int = 0
    recomputed_tokens: int = 0

    @property
    def exactly_once(self) -> bool:
        return not self.lost and not self.duplicates and not self.gaps

    def problems(self, zero_recompute: bool = False) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} stream(s) did not complete: {self.lost}")
        if self.duplicates or self.gaps:
            found.append(f"{self.duplicates} duplicate and {self.gaps} missing token index(es)")
        if self.mismatches:
            found.append(f"{len(self.mismatches)} output(s) differ from greedy: {self.mismatches}")
        if zero_recompute and self.recomputed_tokens:
            found.append(f"{self.recomputed_tokens} token(s) recomputed after a notice")
        return found


def verdict(traces: Sequence[RequestTrace], expected: dict[str, list[int]]) -> Verdict:
    events = [e for t in traces for e in t.events if e.kind in ("migrated", "recovered")]
    return Verdict(
        requests=len(traces),
        lost=[t.request_id for t in traces if not t.ok or not t.finish_reason],
        duplicates=sum(t.duplicates for t in traces),
        gaps=sum(t.gaps for t in traces),
        mismatches=[
            t.request_id for t in traces if t.ok and t.token_ids != expected.get(t.request_id)
        ],
        migrations=sum(1 for e in events if e.kind == "migrated"),
        recomputed_tokens=sum(e.recomputed_tokens for e in events),
    )
