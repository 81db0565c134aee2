"""The tuning file `spotinfer tune --apply` writes and the coordinator and worker read.

{"version": 1, "model": "...",
 "worker":  {"max_num_seqs": 8},
 "classes": {"interactive": {"max_num_seqs": 4}, "batch": {"max_num_seqs": 8}}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TUNING_FILE_VERSION = 1


def load_tuning_file(path: Path) -> dict[str, Any]:
    """Reads and checks a file written by `spotinfer tune --apply`."""
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("version") != TUNING_FILE_VERSION:
        raise ValueError(f"{path}: unsupported tuning file version {data.get('version')!r}")
    for name, entry in data.get("classes", {}).items():
        seqs = entry.get("max_num_seqs")
        if not isinstance(seqs, int) or seqs < 1:
            raise ValueError(f"{path}: class {name!r} needs a positive max_num_seqs")
    return data
