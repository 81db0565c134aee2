"""What a node's hardware and model cost in time: the step model, prefill, KV size, the store
and peer links, boot and notice lengths. Each number is kept with the source it came from.

A node's decode step (all running sequences advance one token) takes

    step_seconds = step_base_seconds
                 + step_per_seq_seconds × running sequences
                 + step_per_context_token_seconds × context tokens of the running sequences

and prefilling (or recomputing) k tokens holds the node for prefill_per_token_seconds × k.
On disk a calibration is JSON: ``{"name": ..., "values": {field: {"value": v, "source": s}}}``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Calibration:
    name: str
    step_base_seconds: float
    """Decode step of an empty batch: the weight read (GPU) or the fixed work per step (CPU)."""
    step_per_seq_seconds: float
    """Added per running sequence."""
    step_per_context_token_seconds: float
    """Added per context token of the running sequences (the KV read, on a GPU)."""
    prefill_per_token_seconds: float
    """A prompt (or recomputed) token's share of the node's time."""
    max_num_seqs: int
    """Sequences a node runs at once (its slots in admission)."""
    kv_bytes_per_token: int
    block_tokens: int
    """KV block size: what eager persistence stores, so what an abrupt loss keeps."""
    store_write_mb_per_second: float
    """A node's flush into the store (notice → everything persisted)."""
    store_read_mb_per_second: float
    """A node's KV load out of the store (a resume, a recovery)."""
    peer_mb_per_second: float
    """Staging: a target's prefetch of a moving request's blocks while the source decodes."""
    staging_overhead_seconds: float
    """Fixed part of staging one noticed node's requests (calls, allocation)."""
    switch_downtime_seconds: float
    """A staged request's stall at the switch: last token on the source → first on the target."""
    boot_seconds: float
    """A new node: launch → ready to serve (weights loaded)."""
    request_overhead_seconds: float
    """Added to every request's first token (coordinator hop, tokenization, stream set-up)."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"calibration {self.name}: {f.name} must not be negative")
        if self.max_num_seqs < 1 or self.block_tokens < 1:
            raise ValueError(f"calibration {self.name}: max_num_seqs and block_tokens must be ≥ 1")
        for rate in ("store_write_mb_per_second", "store_read_mb_per_second", "peer_mb_per_second"):
            if getattr(self, rate) <= 0:
                raise ValueError(f"calibration {self.name}: {rate} must be positive")

    def step_seconds(self, running_seqs: float, context_tokens: float) -> float:
        return (
            self.step_base_seconds
            + self.step_per_seq_seconds * running_seqs
            + self.step_per_context_token_seconds * context_tokens
        )

    def prefill_seconds(self, tokens: float) -> float:
        return self.prefill_per_token_seconds * tokens

    def kv_megabytes(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / 1e6

    def to_json(self) -> dict[str, Any]:
        values = {
            f.name: {"value": getattr(self, f.name), "source": self.sources.get(f.name, "")}
            for f in dataclasses.fields(self)
            if f.name not in ("name", "sources")
        }
        return {"name": self.name, "values": values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        values = data["values"]
        names = {f.name for f in dataclasses.fields(cls)} - {"name", "sources"}
        missing = names - values.keys()
        if missing:
            raise ValueError(
                f"calibration {data.get('name')}: missing {', '.join(sorted(missing))}"
            )
        kwargs = {name: values[name]["value"] for name in names}
        sources = {name: str(values[name].get("source", "")) for name in names}
        return cls(name=str(data["name"]), sources=sources, **kwargs)


def save(calibration: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")


def load_all(path: Path) -> dict[str, Calibration]:
    """A file holds one calibration (an object) or several (``{"calibrations": [...]}``)."""
    data = json.loads(path.read_text())
    entries = data.get("calibrations", [data])
    return {entry["name"]: Calibration.from_json(entry) for entry in entries}


def builtin_files() -> list[Path]:
    return sorted(DATA_DIR.glob("calibration_*.json"))


def find(name_or_path: str) -> Calibration:
    """A calibration by name (from the packaged files) or ``FILE[:NAME]``."""
    path_text, _, wanted = name_or_path.partition(":")
    path = Path(path_text)
    if path.suffix == ".json" and path.exists():
        found = load_all(path)
        if wanted:
            return found[wanted]
        if len(found) != 1:
            raise KeyError(f"{path} holds {', '.join(found)}: say which with {path}:NAME")
        return next(iter(found.values()))
    known: dict[str, Calibration] = {}
    for file in builtin_files():
        known.update(load_all(file))
    if name_or_path not in known:
        raise KeyError(f"unknown calibration {name_or_path!r}; known: {', '.join(sorted(known))}")
    return known[name_or_path]
