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


def test_a_folder_used_before_gives_node_certificates_of_the_new_ca(tmp_path: Path) -> None:
    """A node's certificate is made on first use; one left by an earlier cluster in the same
    log folder was signed by that cluster's CA, and reusing it broke every TLS handshake of
    the node ("certificate signature failure")."""
    from cryptography import x509

    ClusterSecrets.make(tmp_path).node_transport("worker", "node-0")
    secrets = ClusterSecrets.make(tmp_path)
    transport = secrets.node_transport("worker", "node-0")
    ca = x509.load_pem_x509_certificate(Path(transport.ca_file).read_bytes())
    node = x509.load_pem_x509_certificate(Path(transport.cert_file).read_bytes())
    node.verify_directly_issued_by(ca)  # raises unless the new CA signed it
