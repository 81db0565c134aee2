"""SIGKILL a worker at a point its requests' progress decides, not the test's threads.

Usage: python -m tests.support.freeze_and_kill REDIS_URL PGID OUT.json REQUEST_IDS.json
RUNNING MIN_TOKENS MAX_TOKENS TIMEOUT_SECONDS

Prints a line once it watches (start the load after it). Watches the store from a process of its own (a test process reading dozens of streams can
lose the GIL for seconds, and the tiny model decodes hundreds of tokens a second): once
RUNNING of the requests are live with at least MIN_TOKENS committed, it SIGSTOPs the worker's
process group, so nothing more is generated or written, and reads the store again. If every
live request is still unfinished and has each full KV block of its committed context linked,
it SIGKILLs the group; otherwise (an eager save still in the writer's queue) it lets the
worker go on and tries again. OUT gets, per live request at the kill, its committed tokens
and linked blocks. Exits 1 when a live request ends first or TIMEOUT_SECONDS pass.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import redis

from store import RequestRecord, RequestStatus
from store.keys import request_blocks_key, request_meta_key

POLL_SECONDS = 0.005
# Commands the worker sent just before the stop reach Redis before this read.
SETTLE_SECONDS = 0.05


def _live(client: redis.Redis, request_ids: list[str]) -> dict[str, RequestRecord]:
    """The records of ``request_ids`` that exist, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hgetall(request_meta_key(request_id))
        pipe.hgetall(request_blocks_key(request_id))
    results = pipe.execute()
    return {
        request_id: RequestRecord.from_fields(fields, blocks)
        for request_id, fields, blocks in zip(request_ids, results[::2], results[1::2], strict=True)
        if fields
    }


def _complete_up_to_now(record: RequestRecord, max_tokens: int) -> bool:
    """Unfinished, and every full block of its committed context is linked."""
    context = len(record.prompt_token_ids) + record.committed_length
    full_blocks = max(0, context - 1) // record.kv_block_tokens
    return (
        record.status is RequestStatus.RUNNING
        and record.committed_length < max_tokens
        and len(record.persisted_block_hashes) >= full_blocks
    )


def main() -> int:
    redis_url, pgid_text, out_path, ids_path = sys.argv[1:5]
    running, min_tokens, max_tokens = (int(arg) for arg in sys.argv[5:8])
    timeout = float(sys.argv[8])
    pgid = int(pgid_text)
    with open(ids_path) as f:
        request_ids: list[str] = json.load(f)
    client = redis.Redis.from_url(redis_url)
    client.ping()
    print("watching", flush=True)
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        live = _live(client, request_ids)
        ended = seen - set(live)
        if ended:
            print(f"ended before the kill: {sorted(ended)}", file=sys.stderr)
            return 1
        seen |= set(live)
        ready = len(live) >= running and all(
            r.committed_length >= min_tokens for r in live.values()
        )
        if ready:
            os.killpg(pgid, signal.SIGSTOP)
            time.sleep(SETTLE_SECONDS)
            live = _live(client, request_ids)
            if len(live) >= running and all(
                _complete_up_to_now(r, max_tokens) for r in live.values()
            ):
                os.killpg(pgid, signal.SIGKILL)
                with open(out_path, "w") as f:
                    json.dump(
                        {
                            request_id: {
                                "committed": record.committed_length,
                                "linked_blocks": len(record.persisted_block_hashes),
                            }
                            for request_id, record in live.items()
                        },
                        f,
                    )
                return 0
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(POLL_SECONDS)
    print(f"no point to kill at within {timeout} s; live: {sorted(seen)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
