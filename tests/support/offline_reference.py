"""Reference outputs from vLLM's offline `LLM.generate`, in a process of its own.

Usage: python tests/support/offline_reference.py MODEL REQUESTS.json OUT.json [engine flags as
JSON]. REQUESTS is a list of {"prompt_token_ids": [...], "max_tokens": n}; greedy decoding.
Run as a separate process so the test process never imports vLLM.
"""

from __future__ import annotations

import json
import sys


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
            max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r.get("ignore_eos", False)
        )
        for r in requests
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = [list(o.outputs[0].token_ids) for o in outputs]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
