"""The blocks a resume refused by their MAC, per request, from the connector's scheduler role
to the resume's event: through vLLM's stats aggregation and the worker's stat logger."""

from __future__ import annotations

from worker.constants import MAC_REJECTED_REQUEST_PREFIX
from worker.engine_stats import EngineStats, StepRecord
from worker.persist_stats import MAC_REJECTED_BLOCKS, WRITTEN_BLOCKS, PersistStats


def _step(persisted: dict[str, int]) -> StepRecord:
    return StepRecord(
        batch_size=1,
        running_seqs=1,
        waiting_seqs=0,
        kv_cache_usage=0.1,
        generated_tokens=1,
        preempted_requests=0,
        persisted=persisted,
    )


def test_the_per_request_counts_survive_the_aggregation_with_the_writer_stats() -> None:
    writer = PersistStats(data={WRITTEN_BLOCKS: 3, MAC_REJECTED_BLOCKS: 1})
    scheduler = PersistStats(data={MAC_REJECTED_REQUEST_PREFIX + "r1": 2})
    assert not scheduler.is_empty()
    merged = writer.aggregate(scheduler).aggregate(
        PersistStats(data={MAC_REJECTED_REQUEST_PREFIX + "r1": 1})
    )
    assert merged.data[MAC_REJECTED_REQUEST_PREFIX + "r1"] == 3
    assert merged.data[WRITTEN_BLOCKS] == 3 and merged.data[MAC_REJECTED_BLOCKS] == 1


def test_a_resume_takes_its_own_count_once() -> None:
    stats = EngineStats()
    stats.observe(_step({WRITTEN_BLOCKS: 1, MAC_REJECTED_REQUEST_PREFIX + "r1": 2}))
    stats.observe(_step({MAC_REJECTED_REQUEST_PREFIX + "r1": 1}))
    stats.observe(_step({MAC_REJECTED_REQUEST_PREFIX + "r2": 4}))
    assert stats.take_mac_rejected("r1") == 3
    assert stats.take_mac_rejected("r1") == 0, "taken: a later resume starts from 0"
    assert stats.take_mac_rejected("r2") == 4
    assert stats.take_mac_rejected("never-refused") == 0
