"""The request and its output as plain dataclasses, shared by every process.

gRPC messages stop at each process's `server.py` (see `protos/convert.py`); inside, code
passes these.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class SlaClass(enum.IntEnum):
    INTERACTIVE = 1
    BATCH = 2


PRIORITY_LEVELS = 100
"""A request's own priority orders it within its class: 0 (first) .. PRIORITY_LEVELS - 1."""
DEFAULT_PRIORITY = PRIORITY_LEVELS // 2
"""The priority of a request that names none: the middle, so a client can go either way."""


def engine_priority(sla_class: SlaClass, priority: int | None = None) -> int:
    """vLLM's priority value (lower is scheduled first, ties by arrival): every INTERACTIVE
    request before every BATCH one, then the request's own priority within its class."""
    own = DEFAULT_PRIORITY if priority is None else priority
    return (int(sla_class) - 1) * PRIORITY_LEVELS + own


class FinishReason(enum.IntEnum):
    NONE = 0  # the stream goes on
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ERROR = 4


class EventKind(enum.IntEnum):
    NONE = 0
    MIGRATED = 1
    RECOVERED = 2
    RESUMED = 3
    QUEUED = 4
    NOTICE = 5


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters (see `common.validation`)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no log probabilities; k: each output token's own and its k most likely
    alternatives' (0: its own only; at most `MAX_LOGPROBS`)."""


@dataclass(frozen=True)
class GenerationRequest:
    """A request whose prompt is already token ids (text prompts are tokenized at the edge)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    sla_class: SlaClass = SlaClass.INTERACTIVE
    tenant: str = ""
    """Whose request it is; the coordinator sets it from the API key ("": the default
    tenant). KV blocks and vLLM's prefix cache are shared within a tenant only."""
    priority: int | None = None
    """Its order within its class on the engine (0 first; None: `DEFAULT_PRIORITY`; see
    `engine_priority`)."""


@dataclass(frozen=True)
class Event:
    kind: EventKind
    from_worker: str = ""
    to_worker: str = ""
    recomputed_tokens: int = 0
    loaded_tokens: int = 0
    detail: str = ""


@dataclass(frozen=True)
class EngineTiming:
    """When the engine queued and first scheduled a request, on the engine core's monotonic
    clock (comparable between requests of one worker only): vLLM's own request stats."""

    queued_at: float
    scheduled_at: float

    @property
    def queue_seconds(self) -> float:
        return max(0.0, self.scheduled_at - self.queued_at)


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at an output position, with its log probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """The log probabilities at one output position, as the engine's sampler gave them
    (before temperature and top-p: vLLM's raw logprobs)."""

    logprob: float  # the sampled token's
    top: tuple[TopLogprob, ...] = ()  # the k most likely tokens, most likely first


@dataclass(frozen=True)
class TokenChunk:
    """New output of one engine step: `token_ids` start at output index `index`."""

    request_id: str
    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason = FinishReason.NONE
    event: Event | None = None
    worker_id: str = ""
    engine_timing: EngineTiming | None = None
    """On the first chunk with tokens from an engine: when that engine scheduled it."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token of `token_ids`, when the request asked for them; empty otherwise (and
    for tokens a resume replays from the store, which keeps no log probabilities). Code that
    cuts `token_ids[n:]` cuts `logprobs[n:]` with it, so both stay aligned."""

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE

    def from_index(self, index: int, text: str) -> TokenChunk:
        """This chunk from output ``index`` on (clamped to its tokens), their logprobs cut
        with them; ``text``: the text of the kept tokens."""
        skip = min(max(0, index - self.index), len(self.token_ids))
        return dataclasses.replace(
            self,
            index=self.index + skip,
            token_ids=self.token_ids[skip:],
            text=text,
            logprobs=self.logprobs[skip:],
        )


@dataclass
class RequestOutput:
    """A whole output as a client assembles it from chunks; checks exactly-once delivery."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.NONE
    events: list[Event] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """``logprobs[i]`` is token i's when the request asked for them; None, or missing at the
    end, where a chunk had none (tokens a resume replayed from the store)."""

    def add(self, chunk: TokenChunk) -> None:
        if chunk.token_ids and chunk.index != len(self.token_ids):
            raise ValueError(
                f"request {self.request_id}: chunk at index {chunk.index}, "
                f"expected {len(self.token_ids)}"
            )
        if chunk.logprobs:
            self.logprobs.extend([None] * (len(self.token_ids) - len(self.logprobs)))
            self.logprobs.extend(chunk.logprobs)
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        if chunk.event is not None:
            self.events.append(chunk.event)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
