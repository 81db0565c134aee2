"""Logprobs from vLLM's output to the wire and back: the worker's reading of vLLM's
per-position entries, the proto conversion, and the bound every process enforces."""

from __future__ import annotations

import pytest
from vllm.logprobs import Logprob

from common.errors import InvalidRequest
from common.requests import Sampling, TokenChunk, TokenLogprobs, TopLogprob
from common.validation import MAX_LOGPROBS, Limits, check_sampling
from protos.convert import chunk_from_proto, chunk_to_proto, sampling_from_proto, sampling_to_proto
from worker.streams import _token_logprobs

LIMITS = Limits(max_model_len=64, max_tokens_limit=16, vocab_size=100)


def test_the_sampled_token_and_the_k_best_are_read_from_vllms_entries() -> None:
    # vLLM's entries of a position: the sampled token (rank 3 here) and the k best, ranked.
    position = {7: Logprob(-2.0, rank=3), 5: Logprob(-0.1, rank=1), 9: Logprob(-1.0, rank=2)}
    inside = {5: Logprob(-0.1, rank=1), 9: Logprob(-1.0, rank=2)}  # sampled the best
    got = _token_logprobs((7, 5), [position, inside], top_k=2)
    assert got == (
        TokenLogprobs(-2.0, (TopLogprob(5, -0.1), TopLogprob(9, -1.0))),
        TokenLogprobs(-0.1, (TopLogprob(5, -0.1), TopLogprob(9, -1.0))),
    )
    assert _token_logprobs((7,), [position], top_k=0) == (TokenLogprobs(-2.0, ()),)
    assert _token_logprobs((7,), None, top_k=2) == ()


def test_logprobs_cross_the_wire_unchanged() -> None:
    chunk = TokenChunk(
        "r",
        4,
        (7, 5),
        logprobs=(TokenLogprobs(-2.0, (TopLogprob(5, -0.125),)), TokenLogprobs(-0.5)),
    )
    assert chunk_from_proto(chunk_to_proto(chunk)) == chunk
    for logprobs in (None, 0, 3):
        sampling = Sampling(max_tokens=4, logprobs=logprobs)
        assert sampling_from_proto(sampling_to_proto(sampling)) == sampling


@pytest.mark.parametrize("logprobs", [-1, MAX_LOGPROBS + 1])
def test_logprobs_out_of_range_are_refused_by_name(logprobs: int) -> None:
    with pytest.raises(InvalidRequest, match=f"logprobs must be in 0..{MAX_LOGPROBS}"):
        check_sampling(Sampling(max_tokens=4, logprobs=logprobs), 3, LIMITS)
    check_sampling(Sampling(max_tokens=4, logprobs=MAX_LOGPROBS), 3, LIMITS)
