"""The hybrid policy on the connector's scheduler side: blocks go to Redis as they fill, up to
the rate cap (a token bucket on a clock the test moves), each request's in order; what the cap
held back is saved at a pause with the tail, so a notice still leaves nothing to recompute.
In-memory fakes for vLLM's request and scheduler output, as in test_connector_chunks.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.request import RequestStatus

from tests.support.clock import ManualClock
from tests.unit.test_connector_chunks import CHUNK, ENGINE_BLOCK, FORMAT, FakeStore
from worker.constants import KV_PARAM_REQUEST_ID
from worker.persist_rate_cap import PersistRateCap
from worker.persist_stats import DEFERRED_BLOCKS
from worker.spot_connector_scheduler import SpotConnectorScheduler

PAGE_BYTES = 1000  # one engine block of one layer
# One stored chunk, all layers: 2 engine blocks × 2 layers.
CHUNK_BYTES = CHUNK // ENGINE_BLOCK * FORMAT.layer_count * PAGE_BYTES


def _scheduler(policy: str, rate: float = 0.0, clock: ManualClock | None = None) -> Any:
    spec = SimpleNamespace(block_size=ENGINE_BLOCK, page_size_bytes=PAGE_BYTES)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    return SpotConnectorScheduler(
        config,  # type: ignore[arg-type]
        FORMAT,
        policy,
        FakeStore(),  # type: ignore[arg-type]
        None,
        kv_load="sync",
        rate_cap_bytes_per_second=rate,
        clock=clock or ManualClock(),
    )


class Requests:
    """Running requests as the scheduler side sees them, each with enough cache blocks."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.by_id: dict[str, Any] = {}

    def add(self, name: str, tokens: int) -> Any:
        request = SimpleNamespace(
            request_id=name,
            kv_transfer_params={KV_PARAM_REQUEST_ID: f"ours-{name}"},
            all_token_ids=[(7 * n + len(name)) % 500 + 1 for n in range(tokens)],
            num_computed_tokens=0,
            output_token_ids=[1],
            status=RequestStatus.RUNNING,
        )
        self.scheduler.on_new_request(request)
        self.by_id[name] = request
        return request

    def step(self, scheduled: dict[str, int]) -> list[tuple[str, int]]:
        """One engine step computing ``scheduled`` tokens per request: the saves it names,
        as (our id, block index); then the tokens count as computed."""
        state = SimpleNamespace(get_block_ids=lambda vllm_id: (list(range(100)),))
        output = SimpleNamespace(num_scheduled_tokens=scheduled, kv_connector_block_state=state)
        saves = self.scheduler.build_connector_meta(output).saves
        for name, count in scheduled.items():
            self.by_id[name].num_computed_tokens += count
        return [(save.request_id, save.block_index) for save in saves]


def test_eager_saves_every_full_block_at_once_and_defers_none() -> None:
    requests = Requests(_scheduler("eager"))
    requests.add("a", 5 * CHUNK + 10)
    assert requests.step({"a": 5 * CHUNK + 10}) == [("ours-a", i) for i in range(5)]
    assert requests.scheduler.report() is None


def test_hybrid_saves_a_prefix_at_the_cap_and_catches_up_as_the_bucket_refills() -> None:
    clock = ManualClock()
    # Half a chunk per second: the bucket (one second of the rate, at least a chunk) holds one.
    requests = Requests(_scheduler("hybrid", CHUNK_BYTES / 2, clock))
    requests.add("a", 4 * CHUNK + 10)
    assert requests.step({"a": 4 * CHUNK + 10}) == [("ours-a", 0)]
    report = requests.scheduler.report()
    assert report is not None and report.data == {DEFERRED_BLOCKS: 3}
    assert requests.step({}) == [], "nothing scheduled, nothing due"
    clock.advance(1.0)  # half a chunk: not enough
    assert requests.step({"a": 1}) == []
    clock.advance(1.0)
    assert requests.step({"a": 1}) == [("ours-a", 1)], "the held-back blocks go first, in order"
    clock.advance(60.0)  # a long quiet spell refills one burst, not sixty seconds' worth
    assert requests.step({"a": 1}) == [("ours-a", 2)]
    assert requests.step({"a": 1}) == []
    assert requests.scheduler.report() is None, "a held-back block is counted once"


def test_the_budget_goes_to_the_request_with_most_blocks_unsaved() -> None:
    clock = ManualClock()
    # Three chunks a second: a burst of three chunks per step after a second's wait.
    requests = Requests(_scheduler("hybrid", 3 * CHUNK_BYTES, clock))
    requests.add("small", CHUNK + 1)
    requests.add("big", 4 * CHUNK + 1)
    first = requests.step({"small": CHUNK + 1, "big": 4 * CHUNK + 1})
    # big has 4 unsaved, small 1: big, big (3 left vs 1), big (2 vs 1).
    assert first == [("ours-big", 0), ("ours-big", 1), ("ours-big", 2)]
    clock.advance(1.0)
    # big 1 unsaved, small 1: a tie goes to the request scheduled first.
    assert requests.step({"small": 1, "big": 1}) == [("ours-small", 0), ("ours-big", 3)]


def test_a_pause_saves_what_the_cap_held_back_and_the_tail() -> None:
    requests = Requests(_scheduler("hybrid", 1.0))  # one byte a second: one chunk, ever
    request = requests.add("a", 3 * CHUNK + 41)
    assert requests.step({"a": 3 * CHUNK + 40}) == [("ours-a", 0)]
    request.status = RequestStatus.FINISHED_ABORTED
    delay_free, _ = requests.scheduler.request_finished(request, list(range(8)))
    assert delay_free
    saves = requests.scheduler.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={}, kv_connector_block_state=None)
    ).saves
    assert [(save.block_index, save.num_tokens) for save in saves] == [
        (1, 0),
        (2, 0),
        (3, 40),  # the tail: every computed token of the unfinished chunk
    ]
    assert all(save.required for save in saves)


def test_lazy_saves_nothing_before_the_pause() -> None:
    requests = Requests(_scheduler("lazy"))
    requests.add("a", 3 * CHUNK)
    assert requests.step({"a": 3 * CHUNK}) == []


def test_the_bucket_grants_nothing_while_it_holds_less_than_a_block() -> None:
    clock = ManualClock()
    cap = PersistRateCap(100.0, 1000, clock)
    assert cap.grant([5]) == [1], "the bucket starts full: one block"
    clock.advance(9.0)
    assert cap.grant([4]) == [0]
    clock.advance(1.0)
    assert cap.grant([4, 0]) == [1, 0]
