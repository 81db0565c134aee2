"""The adaptive workload-batch controller: each worker's admission cap per SLA class, moved at
run time from the TTFT and TPOT this coordinator measures against the INTERACTIVE class's SLO.

The tuner's sweep (`spotinfer tune --apply`, the coordinator's `--tuning-file`) gives the
starting caps; the controller then moves them, per worker, every `interval_seconds`:

    INTERACTIVE TPOT over its target,         shrink BATCH's cap: shrink_factor x what runs
    BATCH runs there
    INTERACTIVE requests queued past          grow INTERACTIVE by what waits (at least
    queue_fraction x the TTFT target          grow_step), whatever TPOT says, settled or
                                              not: a request queued past its TTFT target is
                                              a certain miss, a longer TPOT a possible one
    INTERACTIVE TPOT over its target,         shrink INTERACTIVE: shrink_factor x what runs
    nothing INTERACTIVE waiting
    INTERACTIVE TPOT over its target,         hold (a smaller batch would only move the miss
    INTERACTIVE waiting, not long yet         from TPOT to TTFT)
    INTERACTIVE TTFT over its target,         grow INTERACTIVE (+grow_step): its requests
    TPOT with headroom, INTERACTIVE waiting   queue here, and the decode has room for more
    INTERACTIVE meets both with headroom,     grow the waiting class (+grow_step), BATCH
    work waiting                              only once INTERACTIVE waits for nothing
    otherwise                                 hold

Additive increase, multiplicative decrease. Hysteresis: it grows only while TPOT is under
`headroom` x the target and shrinks only over the target, so a TPOT inside that band holds;
after a change it holds for `settle_seconds` and forgets its window, so the next decision
sees only what the new cap produced (a long INTERACTIVE queue is the exception: it is
measured now, not over the window, and grows the cap while a change settles).
Bounds: `min_cap` .. the worker's max_num_seqs.

Signals, per worker: TTFT is the larger of the p99 of first tokens in the window and the
wait of the oldest INTERACTIVE request still queued (a queued request already misses what
it waits past); TPOT is the mean time per output token of the INTERACTIVE streams in the
window (every token after a request's first, from the chunks as they arrive), so a batch
that decodes too slowly shows within one interval, not when its requests end.

Not thread-safe: the coordinator's event loop owns it. Time comes from an injected clock.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.requests import SlaClass

if TYPE_CHECKING:
    from coordinator.registry import WorkerEntry


@dataclass(frozen=True)
class BatchControllerConfig:
    enabled: bool = field(default=False, metadata={"flag": "batch-controller"})
    """Move each worker's admission cap per class at run time; off: the static caps."""
    interval_seconds: float = 0.5
    """How often every worker's caps are reconsidered."""
    window_seconds: float = 5.0
    """How far back the measured TTFT and TPOT reach."""
    settle_seconds: float = 1.5
    """After a change, how long a worker's caps hold before the next decision."""
    interactive_ttft_slo_ms: float = 2000.0
    """The INTERACTIVE class's TTFT target (p99), as `spotinfer tune` takes it."""
    interactive_tpot_slo_ms: float = 150.0
    """The INTERACTIVE class's TPOT target (p99), as `spotinfer tune` takes it."""
    grow_step: int = 4
    """Additive increase: sequences a grow adds to a class's cap."""
    shrink_factor: float = 0.75
    """Multiplicative decrease: a shrink multiplies the cap by this."""
    headroom: float = 0.85
    """Grow only while TPOT is under headroom x its target (the hysteresis band)."""
    min_cap: int = 1
    """The smallest cap a class is shrunk to."""
    min_tokens: int = 16
    """Output tokens in the window before its TPOT counts."""
    queue_fraction: float = 0.25
    """INTERACTIVE requests queued longer than this fraction of the TTFT target grow
    INTERACTIVE's cap whatever TPOT says (a queued request is about to miss for certain),
    also while the last change settles."""

    def __post_init__(self) -> None:
        for name in ("interval_seconds", "window_seconds", "interactive_ttft_slo_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"batch_controller {name} must be positive")
        if self.interactive_tpot_slo_ms <= 0:
            raise ValueError("batch_controller interactive_tpot_slo_ms must be positive")
        if self.settle_seconds < 0:
            raise ValueError("batch_controller settle_seconds must not be negative")
        if self.grow_step < 1 or self.min_cap < 1 or self.min_tokens < 1:
            raise ValueError("batch_controller grow_step, min_cap and min_tokens must be >= 1")
        if not 0 < self.shrink_factor < 1:
            raise ValueError("batch_controller shrink_factor must be in (0, 1)")
        if not 0 < self.headroom <= 1:
            raise ValueError("batch_controller headroom must be in (0, 1]")
        if not 0 < self.queue_fraction <= 1:
            raise ValueError("batch_controller queue_fraction must be in (0, 1]")


@dataclass
class ClassCap:
    """One class's cap on one worker and the decision that set it."""

    cap: int
    decision: str = "start"  # start | grow | shrink | hold | static
    reason: str = "the starting cap (the tuning file, else the worker's max_num_seqs)"


@dataclass(frozen=True)
class Signals:
    """What a decision was made from (seconds; None: no sample in the window)."""

    ttft_p99: float | None
    tpot: float | None
    samples: int


@dataclass(frozen=True)
class Decision:
    address: str
    sla_class: SlaClass
    decision: str  # grow | shrink
    old_cap: int
    new_cap: int
    reason: str


@dataclass
class _Window:
    """One worker's measurements and caps."""

    caps: dict[SlaClass, ClassCap] = field(default_factory=dict)  # filled once the entry is known
    first_tokens: collections.deque[tuple[float, float]] = field(
        default_factory=collections.deque
    )  # (when, ttft seconds)
    decode: collections.deque[tuple[float, float, int]] = field(
        default_factory=collections.deque
    )  # (when, seconds, tokens) of INTERACTIVE chunks after a request's first
    settled_at: float = -math.inf
    signals: Signals = Signals(None, None, 0)


class BatchController:
    """``static_caps``: each class's starting cap (0: the worker's max_num_seqs);
    ``on_decision``: told of every change (metrics); ``on_grow``: after a cap grew (admission
    pumps its queues). ``clock``: monotonic seconds."""

    def __init__(
        self,
        config: BatchControllerConfig,
        static_caps: Mapping[SlaClass, int],
        clock: Callable[[], float],
        on_decision: Callable[[Decision], None] = lambda _: None,
        on_grow: Callable[[], None] = lambda: None,
    ) -> None:
        self._config = config
        self._static = dict(static_caps)
        self._clock = clock
        self._on_decision = on_decision
        self._on_grow = on_grow
        self._windows: dict[str, _Window] = {}
        self._last_chunk: dict[str, float] = {}

    # -- what admission asks -------------------------------------------------------------

    def cap(self, entry: WorkerEntry, sla: SlaClass) -> int:
        """The most requests of ``sla`` that may be in flight on ``entry`` now."""
        return self._window(entry).caps[sla].cap

    def caps_of(self, entry: WorkerEntry) -> dict[SlaClass, ClassCap]:
        return dict(self._window(entry).caps)

    def signals_of(self, entry: WorkerEntry) -> Signals:
        return self._window(entry).signals

    # -- what the relays report ------------------------------------------------------------

    def first_token(self, address: str, sla: SlaClass, request_id: str, ttft: float) -> None:
        now = self._clock()
        self._last_chunk[request_id] = now
        if sla == SlaClass.INTERACTIVE:
            self._samples(address).first_tokens.append((now, ttft))

    def tokens(self, address: str, sla: SlaClass, request_id: str, count: int) -> None:
        """``count`` more output tokens of a request whose first token came already."""
        now = self._clock()
        last = self._last_chunk.get(request_id)
        self._last_chunk[request_id] = now
        if last is None or sla != SlaClass.INTERACTIVE or count <= 0:
            return
        self._samples(address).decode.append((now, now - last, count))

    def request_done(self, request_id: str) -> None:
        self._last_chunk.pop(request_id, None)

    # -- the control loop ------------------------------------------------------------------

    def tick(
        self,
        workers: Iterable[WorkerEntry],
        waiting: Mapping[SlaClass, int],
        oldest_wait_seconds: float,
    ) -> list[Decision]:
        """One round over ``workers``; ``waiting``: queued requests per class;
        ``oldest_wait_seconds``: how long the oldest queued INTERACTIVE request has waited."""
        now = self._clock()
        decisions = []
        for entry in workers:
            decision = self._decide(entry, now, waiting, oldest_wait_seconds)
            if decision is not None:
                decisions.append(decision)
                self._on_decision(decision)
        if any(d.new_cap > d.old_cap for d in decisions):
            self._on_grow()
        return decisions

    def _decide(
        self,
        entry: WorkerEntry,
        now: float,
        waiting: Mapping[SlaClass, int],
        oldest_wait: float,
    ) -> Decision | None:
        window = self._window(entry)
        self._trim(window, now)
        signals = window.signals = self._signals(window, oldest_wait)
        ttft_target = self._config.interactive_ttft_slo_ms / 1000
        tpot_target = self._config.interactive_tpot_slo_ms / 1000
        queued = waiting.get(SlaClass.INTERACTIVE, 0)
        long_queue = bool(queued) and oldest_wait > self._config.queue_fraction * ttft_target
        # The queue is measured now, not over the window: a long one is acted on even while
        # the last change settles.
        settled = now - window.settled_at >= self._config.settle_seconds
        if not settled and not long_queue:
            return None
        ttft, tpot = signals.ttft_p99, signals.tpot
        measured = f"TTFT p99 {_ms(ttft)}, TPOT {_ms(tpot)}"
        slow = tpot is not None and tpot > tpot_target
        if slow and settled:
            batch = window.caps[SlaClass.BATCH]
            if entry.in_flight[SlaClass.BATCH] and batch.cap > self._config.min_cap:
                why = f"{measured}: TPOT over {_ms(tpot_target)}"
                return self._shrink(entry, window, SlaClass.BATCH, why, now)
        if long_queue:
            why = (
                f"{measured}: {queued} INTERACTIVE waiting, the oldest {_ms(oldest_wait)} "
                f"(past {self._config.queue_fraction:g} x the TTFT target)"
            )
            step = max(self._config.grow_step, queued)
            grown = self._grow(entry, window, SlaClass.INTERACTIVE, why, now, step)
            if grown is not None:
                return grown
        if not settled:
            return None
        if slow:
            why = f"{measured}: TPOT over {_ms(tpot_target)}"
            if queued:
                # Requests queue already: a smaller INTERACTIVE batch would only queue them
                # past their TTFT (no batch size meets both targets at this load).
                self._hold(window, f"{why} while INTERACTIVE requests wait: overloaded")
                return None
            return self._shrink(entry, window, SlaClass.INTERACTIVE, why, now)
        roomy = tpot is None or tpot < self._config.headroom * tpot_target
        if not roomy:
            self._hold(window, f"{measured}: TPOT inside the hysteresis band")
            return None
        ttft_missed = ttft is not None and ttft > ttft_target
        for sla in (SlaClass.INTERACTIVE, SlaClass.BATCH):
            if not waiting.get(sla, 0):
                continue
            if sla == SlaClass.BATCH and (ttft_missed or waiting.get(SlaClass.INTERACTIVE, 0)):
                break  # BATCH grows only once INTERACTIVE meets its SLO and waits for nothing
            why = f"{measured}: {waiting[sla]} {sla.name} waiting, TPOT with headroom"
            grown = self._grow(entry, window, sla, why, now)
            if grown is not None:
                return grown
        self._hold(window, f"{measured}: meets the SLO, nothing to grow for")
        return None

    def _shrink(
        self, entry: WorkerEntry, window: _Window, sla: SlaClass, reason: str, now: float
    ) -> Decision | None:
        """From what runs there, not from a cap above it: cutting a cap of 64 to 48 while 20
        run would change nothing."""
        state = window.caps[sla]
        running = min(state.cap, entry.in_flight[sla] or state.cap)
        new = max(self._config.min_cap, math.floor(running * self._config.shrink_factor))
        if new >= state.cap:
            self._hold(window, f"{reason}; {sla.name} already at its floor")
            return None
        return self._change(entry.address, window, sla, "shrink", new, reason, now)

    def _grow(
        self,
        entry: WorkerEntry,
        window: _Window,
        sla: SlaClass,
        reason: str,
        now: float,
        step: int = 0,
    ) -> Decision | None:
        state = window.caps[sla]
        ceiling = _max_num_seqs(entry)
        new = min(ceiling, state.cap + (step or self._config.grow_step))
        if new <= state.cap:
            return None
        return self._change(entry.address, window, sla, "grow", new, reason, now)

    def _change(
        self,
        address: str,
        window: _Window,
        sla: SlaClass,
        decision: str,
        new: int,
        reason: str,
        now: float,
    ) -> Decision:
        state = window.caps[sla]
        old, state.cap, state.decision, state.reason = state.cap, new, decision, reason
        for other, other_state in window.caps.items():
            if other != sla:
                other_state.decision = "hold"
        window.settled_at = now
        window.first_tokens.clear()
        window.decode.clear()
        return Decision(address, sla, decision, old, new, reason)

    def _hold(self, window: _Window, reason: str) -> None:
        for state in window.caps.values():
            state.decision, state.reason = "hold", reason
        return None

    # -- internals -------------------------------------------------------------------------

    def _samples(self, address: str) -> _Window:
        window = self._windows.get(address)
        if window is None:
            window = self._windows[address] = _Window()
        return window

    def _window(self, entry: WorkerEntry) -> _Window:
        window = self._samples(entry.address)
        if not window.caps:
            ceiling = _max_num_seqs(entry)
            window.caps = {
                sla: ClassCap(min(self._static.get(sla, 0) or ceiling, ceiling)) for sla in SlaClass
            }
        return window

    def _trim(self, window: _Window, now: float) -> None:
        horizon = now - self._config.window_seconds
        while window.first_tokens and window.first_tokens[0][0] < horizon:
            window.first_tokens.popleft()
        while window.decode and window.decode[0][0] < horizon:
            window.decode.popleft()

    def _signals(self, window: _Window, oldest_wait: float) -> Signals:
        ttfts = sorted(ttft for _, ttft in window.first_tokens)
        ttft: float | None = ttfts[math.ceil(0.99 * len(ttfts)) - 1] if ttfts else None
        if oldest_wait > 0:
            ttft = max(ttft or 0.0, oldest_wait)
        tokens = sum(count for _, _, count in window.decode)
        tpot = None
        if tokens >= self._config.min_tokens:
            tpot = sum(seconds for _, seconds, _ in window.decode) / tokens
        return Signals(ttft, tpot, len(ttfts))


def _max_num_seqs(entry: WorkerEntry) -> int:
    return max(1, entry.capacity.max_num_seqs if entry.capacity else 1)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
