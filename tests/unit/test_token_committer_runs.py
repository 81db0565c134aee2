"""The token committer on the in-memory store: a request resumed on the same worker while the
round that pauses its old run is still on its way to the store keeps its own persistence
(the round's outcome belongs to the old run), and a finish records how the request ended."""

from __future__ import annotations

import asyncio
import threading

from store import MemoryStore, RequestRecord, RequestStatus
from tests.support.wait import wait_until_async
from worker.token_committer import TokenCommitter

RETRY_SECONDS = 0.05
WAIT_SECONDS = 5.0


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model_fingerprint="fp-test",
        prompt_token_ids=(1, 2, 3),
        sampling_params={"max_tokens": 100},
        kv_block_tokens=16,
        status=RequestStatus.RUNNING,
        owner_worker_id="worker-x",
    )


class _SlowPause(MemoryStore):
    """Holds the PAUSED write on its thread until the test lets it through."""

    def __init__(self) -> None:
        super().__init__()
        self.pausing = threading.Event()
        self.let_through = threading.Event()

    def update_status(
        self, request_id: str, status: RequestStatus, owner_worker_id: str | None = None
    ) -> RequestStatus:
        if status is RequestStatus.PAUSED:
            self.pausing.set()
            self.let_through.wait(WAIT_SECONDS)
        return super().update_status(request_id, status, owner_worker_id)


async def test_a_resume_admitted_while_the_old_run_pauses_keeps_being_persisted() -> None:
    store = _SlowPause()
    committer = TokenCommitter(store, "worker-x", RETRY_SECONDS)
    committer.start()
    committer.admit(_record("again"))
    committer.add("again", [10, 11])
    committer.pause("again")  # the old run's caller went away
    await wait_until_async(store.pausing.is_set, "the pause on its way", WAIT_SECONDS)
    # The resume on this same worker admits the request afresh and decodes on.
    committer.admit(_record("again"), committed=[10, 11])
    committer.add("again", [12, 13])
    settled = asyncio.ensure_future(committer.settled("again", WAIT_SECONDS))
    store.let_through.set()
    await wait_until_async(
        lambda: store.committed_tokens("again") == [10, 11, 12, 13],
        "the resumed run's tokens committed",
        WAIT_SECONDS,
    )
    committer.finish("again", RequestStatus.FINISHED, "LENGTH")
    assert await settled, "settled once the resumed run's finish is in"
    await committer.close(WAIT_SECONDS)
    ended = store.get_request("again")
    assert (ended.status, ended.finish_reason) == (RequestStatus.FINISHED, "LENGTH")
