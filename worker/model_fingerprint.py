"""The model fingerprint: a short name for "these weights, this config, this dtype".

KV blocks in Redis are addressed and verified with it, so KV written by one model (or one
revision, or one dtype) is never loaded into another. Every worker must compute the same
value for the same model folder, whatever its path or the time it was copied: the inputs are
file contents, not paths or mtimes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from worker.constants import FINGERPRINT_WEIGHT_BYTES

_PERSON = b"si-model"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def model_fingerprint(model: str, dtype: str) -> str:
    """Hex blake2b-128 over config.json, dtype, and the size and first MiB of each weights file.

    Reading only the head of the weights keeps a start cheap on multi-GB checkpoints; the
    size and config.json catch what the head would miss in practice (another shape, another
    revision). A model that is not a local folder (a hub id) is named by id and dtype alone.
    """
    hasher = hashlib.blake2b(digest_size=16, person=_PERSON)
    hasher.update(f"dtype={dtype}\n".encode())
    folder = Path(model)
    if not folder.is_dir():
        hasher.update(f"id={model}\n".encode())
        return hasher.hexdigest()
    config = folder / "config.json"
    if config.exists():
        hasher.update(config.read_bytes())
    for path in sorted(folder.iterdir()):
        if path.suffix not in _WEIGHT_SUFFIXES or not path.is_file():
            continue
        hasher.update(f"{path.name}:{path.stat().st_size}\n".encode())
        with path.open("rb") as weights:
            hasher.update(weights.read(FINGERPRINT_WEIGHT_BYTES))
    return hasher.hexdigest()
