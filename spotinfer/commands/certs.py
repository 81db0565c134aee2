"""`spotinfer certs`: a cluster CA and node certificates, for local clusters, tests and small
deployments (a larger one brings its own PKI; the processes only read PEM files).

    spotinfer certs ca   --dir tls/
    spotinfer certs node --dir tls/ --name worker-a --role worker --role daemon --host 10.0.0.5 \
        --node worker-a
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.errors import UserError


def register(subparsers: Any) -> None:
    from common.authz import NODE_ROLES

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "certs", help="make a cluster CA and node certificates (TLS, mutual TLS)"
    )
    actions = parser.add_subparsers(dest="certs_action", metavar="ACTION", required=True)
    ca = actions.add_parser("ca", help="a new cluster CA: DIR/ca.pem and DIR/ca.key")
    ca.add_argument("--dir", type=Path, required=True, help="folder for the CA files")
    ca.add_argument("--days", type=int, default=3650)
    ca.set_defaults(func=run_ca)
    node = actions.add_parser("node", help="a node certificate signed by DIR's CA")
    node.add_argument("--dir", type=Path, required=True, help="folder holding ca.pem/ca.key")
    node.add_argument("--out", type=Path, default=None, help="where to write (default: --dir)")
    node.add_argument("--name", required=True, help="file name and common name")
    node.add_argument(
        "--role",
        action="append",
        required=True,
        choices=NODE_ROLES,
        help="the node's role; repeat for a certificate two processes share (a worker VM: "
        "--role worker --role daemon)",
    )
    node.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP the node is reached at; repeatable (localhost and 127.0.0.1 always)",
    )
    node.add_argument(
        "--node",
        default="",
        help="the node the certificate belongs to: its worker's id (--worker-id); a worker "
        "takes Preempt, Resume and Prefetch from a daemon certificate naming its own id "
        "(without one, only over the unix socket or loopback)",
    )
    node.add_argument("--days", type=int, default=365)
    node.set_defaults(func=run_node)


def run_ca(args: argparse.Namespace) -> int:
    from spotinfer.local.certs import CA_NAME, make_ca

    if (args.dir / f"{CA_NAME}.key").exists():
        raise UserError(f"{args.dir} already holds a CA; remove it first to make a new one")
    paths = make_ca(args.dir, days=args.days)
    print(f"CA certificate {paths.cert}\nCA key         {paths.key} (keep it off the nodes)")
    return 0


def run_node(args: argparse.Namespace) -> int:
    from spotinfer.local.certs import load_ca, make_node_cert

    try:
        ca = load_ca(args.dir)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from exc
    role, *extra = args.role
    try:
        paths = make_node_cert(
            ca,
            args.out or args.dir,
            args.name,
            role,
            tuple(args.host),
            days=args.days,
            extra_roles=tuple(extra),
            node=args.node,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(f"{'+'.join(args.role)} certificate {paths.cert}\nkey {paths.key}")
    return 0
