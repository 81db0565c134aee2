"""Runs of a resume's loads that lie end to end in memory, copied into the cache as one.

A resume from Redis lands every chunk the fetcher read in one shared-memory file, one after
another (store/streamed_reads.py), and each chunk is a value of the stored form: its blocks
in order, every layer of a block together (worker/kv_copy.py). Whole chunks side by side in
memory are therefore one value of all their blocks, and one scatter copies them: one copy
per layer for the whole resume instead of one per layer per chunk.

That matters on the engine's process, not for the bytes: a 4k-token context is 16 chunks of
30 layers, and each of those ~500 small copies, with the slicing around it, takes the
interpreter lock the engine thread stepping the other sequences needs between its own
operations. In a traced resume beside 8 decoding streams (benchmarks.kv_load_stall, a 2-core
Xeon), the chunks copied one by one took 55-62 ms and lengthened the step beside them by
~20 ms; as one run, 34-43 ms and 2-8 ms.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.kv_copy import KVCopier
from worker.kv_layout import host_tensor
from worker.spot_connector_metadata import BlockLoad


@dataclass
class LoadRun:
    """Loads whose values follow one another in memory; only the last may end in a
    partial block (``last``: its tokens, 0 for full)."""

    parts: list[torch.Tensor] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    last: int = 0

    def follows(self, part: torch.Tensor) -> bool:
        """``part`` starts where this run's bytes end (and the run ends in a full block)."""
        if not self.parts or self.last:
            return False
        end = self.parts[-1]
        return (
            end.device == part.device
            and end.is_contiguous()
            and part.is_contiguous()
            and end.data_ptr() + end.numel() == part.data_ptr()
        )

    @property
    def nbytes(self) -> int:
        return sum(part.numel() for part in self.parts)

    def add(self, load: BlockLoad, part: torch.Tensor, last: int) -> None:
        self.parts.append(part)
        self.loads.append(load)
        self.block_ids.extend(load.block_ids)
        self.last = last

    def value(self) -> torch.Tensor:
        """The run's bytes as one flat uint8 tensor, without a copy."""
        if len(self.parts) == 1:
            return self.parts[0]
        first, total = self.parts[0].numpy(), self.nbytes
        # The parts lie end to end (`follows` checked each seam) in memory that this run
        # keeps alive: one view spans them, as numpy's strided view of the first allows.
        spanning = np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(1,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read
            return torch.from_numpy(spanning)


def end_to_end(
    copier: KVCopier, rank: int, loads: Sequence[BlockLoad], largest: int | None = None
) -> Iterator[LoadRun]:
    """``loads`` (rank ``rank``'s payloads) grouped into runs, in order; a load that does
    not follow the one before it, or that would take its run past ``largest`` bytes,
    starts a new run."""
    run = LoadRun()
    for load in loads:
        blocks, last = copier.last_block_tokens(load.num_tokens)
        part, last = copier.part(
            host_tensor(load.payloads[rank]), blocks, last, load.first_block, len(load.block_ids)
        )
        too_big = largest is not None and run.nbytes + part.numel() > largest
        if run.parts and (too_big or not run.follows(part)):
            yield run
            run = LoadRun()
        run.add(load, part, last)
    if run.parts:
        yield run
