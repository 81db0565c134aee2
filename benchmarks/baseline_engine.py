"""A baseline vLLM process for side-by-side benchmarks, driven over stdin/stdout (JSON lines).

It holds vLLM's offline `LLM` and an in-process `AsyncLLM` on the same model, so a
benchmark can alternate runs against it and against a spotinfer worker without reloading.

Commands (one JSON object per line):
    {"mode": "offline", "prompts": [[ids...], ...], "max_tokens": 128}
    {"mode": "async",   "prompts": [[ids...], ...], "max_tokens": 128}
    {"mode": "quit"}
Each answer is one line `RESULT {json}` (vLLM logs to stdout too): {"seconds": wall time, "tokens": generated tokens, "ttft_ms": [...]} (ttft_ms
only for "async", measured from submission to the first streamed token).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

RESULT_PREFIX = "RESULT "


def _engine_kwargs(raw: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = json.loads(raw)
    kwargs.setdefault("enforce_eager", True)
    return kwargs


async def _run_async(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    ttft_ms: list[float] = []
    counts: list[int] = []
    run_id = time.monotonic_ns()

    async def one(i: int, ids: list[int]) -> None:
        start = time.perf_counter()
        first = True
        n = 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"b{run_id}-{i}"):
            if first and out.outputs[0].token_ids:
                ttft_ms.append((time.perf_counter() - start) * 1000)
                first = False
            n += len(out.outputs[0].token_ids)
        counts.append(n)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {"seconds": time.perf_counter() - start, "tokens": sum(counts), "ttft_ms": ttft_ms}


def _run_offline(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


async def _serve(model: str, kwargs: dict[str, Any]) -> None:
    from vllm import LLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = LLM(model=model, **kwargs)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kwargs))
    print(RESULT_PREFIX + json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        if command["mode"] == "quit":
            break
        if command["mode"] == "offline":
            answer = _run_offline(llm, command["prompts"], command["max_tokens"])
        else:
            answer = await _run_async(engine, command["prompts"], command["max_tokens"])
        print(RESULT_PREFIX + json.dumps(answer), flush=True)
    engine.shutdown()


def main() -> None:
    model, raw_kwargs = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    # Answers keep stdout to themselves: everything else (vLLM's logs, its engine-core
    # child process) writes to stderr, so no log line can split an answer.
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = results
    asyncio.run(_serve(model, _engine_kwargs(raw_kwargs)))


if __name__ == "__main__":
    main()
