"""Reference outputs from vLLM's offline `LLM.generate`, in a process of its own.

Usage: python tests/support/offline_reference.py MODEL REQUESTS.json OUT.json [engine flags as
JSON]. REQUESTS is a list of {"prompt_token_ids": [...], "max_tokens": n}; greedy decoding.
OUT holds each request's output token ids; a request that also names "logprobs": k gets
{"token_ids": [...], "logprobs": [[sampled logprob, [[token id, logprob], ...k best]], ...]}
instead (vLLM's own logprobs of that request). Run as a separate process so the test process
never imports vLLM.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    model, requests_path, out_path = sys.argv[1:4]
    engine_kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    from vllm import LLM, SamplingParams

    with open(requests_path) as f:
        requests = json.load(f)
    llm = LLM(model=model, enforce_eager=True, **engine_kwargs)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=0.0,
            ignore_eos=r.get("ignore_eos", False),
            logprobs=r.get("logprobs"),
        )
        for r in requests
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = [
        _with_logprobs(o.outputs[0], r["logprobs"])
        if r.get("logprobs") is not None
        else list(o.outputs[0].token_ids)
        for o, r in zip(outputs, requests, strict=True)
    ]
    with open(out_path, "w") as f:
        json.dump(result, f)


def _with_logprobs(completion: Any, k: int) -> dict[str, Any]:
    positions = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        # vLLM's entries are the sampled token and the k best: the k highest are the best.
        best = sorted(position.items(), key=lambda item: -item[1].logprob)[:k]
        positions.append([position[token_id].logprob, [[t, e.logprob] for t, e in best]])
    return {"token_ids": list(completion.token_ids), "logprobs": positions}


if __name__ == "__main__":
    main()
