"""What the spot connector's scheduler side hands its worker side for one engine step: the
blocks to save and to load, the token lists to commit, and the cache slots to release."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from store import TokenCommit
from store.block_codec import Buffer


@dataclass(frozen=True)
class BlockSave:
    """Copy cache slots ``block_ids`` (the engine blocks of one chunk, in order) and store
    them as chunk ``block_index`` of the request; ``num_tokens`` > 0 makes it the partial
    tail chunk. ``required``: part of a pause's flush."""

    request_id: str
    block_index: int
    block_ids: tuple[int, ...]
    prefix_hash: bytes
    num_tokens: int = 0
    required: bool = False


@dataclass(frozen=True)
class BlockLoad:
    """Fill cache slots ``block_ids`` with engine blocks ``first_block``.. of a verified stored
    chunk (the ones before it were found in vLLM's prefix cache); ``payloads``: the chunk's
    shard of each tensor-parallel rank, rank order (one for an unsharded worker)."""

    block_ids: tuple[int, ...]
    payloads: tuple[Buffer, ...]
    staged: bool = False  # from the staging memory of a migration, not from Redis
    num_tokens: int = 0  # tokens the payload holds; below the chunk size: a partial tail
    first_block: int = 0
    vllm_id: str = ""  # whose load: reported finished once copied, when it is asynchronous


@dataclass
class SpotConnectorMetadata(KVConnectorMetadata):
    """What the scheduler role hands the worker role for one step."""

    saves: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    receiving: list[str] = field(default_factory=list)
    """vLLM ids whose loads (in ``loads``) are asynchronous: the worker role copies them off
    the step and reports each id through get_finished once its copies are done."""
    commits: list[TokenCommit] = field(default_factory=list)
    cached_blocks: int = 0
    """Blocks resumes found in vLLM's prefix cache since the previous step (counted only)."""
    mac_rejected_blocks: int = 0
    """Stored blocks resumes refused since the previous step because their MAC did not
    verify (planted or altered in Redis): recomputed, never loaded (counted only)."""
    released: list[str] = field(default_factory=list)
    """vLLM ids whose blocks may be freed once this step's saves are copied."""
    without_kv: list[str] = field(default_factory=list)
    """Our ids of paused requests of which no KV was computed: their records say so."""
    final_commits: list[TokenCommit] = field(default_factory=list)
    """Whole token lists of requests that reached their max_tokens (best effort)."""
    paused: list[tuple[str, int, int]] = field(default_factory=list)
    """The requests whose pause this step writes: our id, the full blocks and the tail's
    tokens their KV makes (every rank then says the pause is handed over, so a daemon moving
    it to a peer knows when it holds all of it)."""
