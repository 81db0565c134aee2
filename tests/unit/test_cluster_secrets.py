"""A local cluster's certificates are named by absolute paths: its processes (redis-server,
which runs in its own folder, among them) read them from another working directory — the
demo's relative `demo-out/logs` once left redis-server without its CA."""

from __future__ import annotations

import os
from pathlib import Path

from spotinfer.local.cluster_secrets import ClusterSecrets


def test_a_relative_folder_gives_absolute_paths(tmp_path: Path) -> None:
    here = Path.cwd()
    os.chdir(tmp_path)
    try:
        secrets = ClusterSecrets.make(Path("logs"))
    finally:
        os.chdir(here)
    assert secrets.ca.cert.is_absolute() and secrets.ca.cert.exists()
    assert secrets.keys_file.is_absolute()
    assert all(paths.cert.is_absolute() for _, paths in secrets.nodes)
