"""A seeded request goes on with the same random sequence after a resume.

vLLM gives a request with a seed its own torch generator, seeded when the request reaches
the model runner, and draws from it once per sampled token. A resumed request is a new
request to vLLM (prompt + the tokens so far), so its generator would start again from the
seed: the continuation would repeat the first draws and differ from the uninterrupted run.

This module is a vLLM worker extension (`worker_extension_cls`): once the engine runs,
`Engine` calls ``spot_continue_seeds`` on every rank (collective_rpc), which wraps the model
runner's state update. A new request whose SamplingParams.extra_args name a draw count
(SEED_DRAWS_ARG, its output index at the resume: worker.streams) has its generator advanced
by that many draws, exactly as the sampler would have drawn them, before its first sample.

    sampler (vLLM)          one draw per sampled token
      CPU Gumbel-max        torch.randint(0, 2**31, (1,), generator)
      PyTorch-native        q[i].exponential_(generator), q of the logits' shape, float32
                            (float64 with fp64 Gumbel noise)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from worker.constants import SEED_DRAWS_ARG

log = logging.getLogger(__name__)

# The extension's qualified name, as vLLM resolves it in every rank's process.
SEED_CONTINUATION_CLASS = "worker.seed_continuation.SeedContinuation"
# The sampler's forward methods whose per-request draws we know; CUDA's and ROCm's fall back
# to the native path whenever a request has its own generator.
_CPU_GUMBEL = "forward_cpu"
_NATIVE = frozenset({"forward_native", "forward_cuda", "forward_hip"})


def draw_kind(runner: Any) -> str:
    """How the runner's sampler draws from a request's generator: "randint", "exponential",
    or "" when it is a path this module does not know (then seeds restart on a resume)."""
    sampler = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
    forward = getattr(getattr(sampler, "forward", None), "__func__", None)
    name = getattr(forward, "__name__", "")
    if name == _CPU_GUMBEL and not getattr(sampler, "use_fp64_gumbel", False):
        return "randint"
    if name in _NATIVE or name == _CPU_GUMBEL:
        return "exponential"
    return ""


def advance(generator: Any, draws: int, kind: str, vocab_size: int, fp64: bool) -> None:
    """Draws from ``generator`` what ``draws`` sampled tokens took."""
    import torch

    if kind == "randint":
        for _ in range(draws):
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    dtype = torch.float64 if fp64 else torch.float32
    noise = torch.empty(vocab_size, dtype=dtype, device=generator.device)
    for _ in range(draws):
        noise.exponential_(generator=generator)


def continue_seeds(runner: Any) -> bool:
    """Wraps ``runner._update_states`` (idempotent). False when the sampler's draws are not
    known: seeded requests then restart their sequence on a resume (logged)."""
    if getattr(runner, "_spot_seeds_continued", False):
        return True
    kind = draw_kind(runner)
    if not kind:
        log.warning("this vLLM sampler's draws are unknown: a resumed seeded request restarts")
        return False
    sampler = runner.sampler.topk_topp_sampler
    fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
    vocab_size = runner.model_config.get_vocab_size()
    update: Callable[[Any], Any] = runner._update_states

    def update_states(scheduler_output: Any) -> Any:
        result = update(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            draws = int((params.extra_args or {}).get(SEED_DRAWS_ARG, 0)) if params else 0
            state = runner.requests.get(new.req_id) if draws else None
            if state is not None and state.generator is not None:
                advance(state.generator, draws, kind, vocab_size, fp64)
        return result

    runner._update_states = update_states
    runner._spot_seeds_continued = True
    return True


class SeedContinuation:
    """Mixed into vLLM's worker class (``worker_extension_cls``)."""

    model_runner: Any

    def spot_continue_seeds(self) -> bool:
        return continue_seeds(self.model_runner)
