"""`spotinfer keys`: API keys of the public API, stored as salted hashes in a keys file.

spotinfer keys add --file keys.jsonl --tenant acme            prints the key, once
spotinfer keys add --file keys.jsonl --role admin
spotinfer keys list --file keys.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.errors import UserError


def register(subparsers: Any) -> None:
    from common.api_keys import KEY_ROLES, TENANT_ROLE

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "keys", help="add or list API keys (the coordinator's --api-keys-file)"
    )
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="a new key; printed once, only its hash is stored")
    add.add_argument("--file", type=Path, required=True, help="the keys file (made 0600)")
    add.add_argument("--tenant", default="", help="the tenant the key's requests belong to")
    add.add_argument("--role", choices=KEY_ROLES, default=TENANT_ROLE)
    add.set_defaults(func=run_add)
    listing = actions.add_parser("list", help="ids, tenants and roles (no secrets)")
    listing.add_argument("--file", type=Path, required=True)
    listing.set_defaults(func=run_list)


def run_add(args: argparse.Namespace) -> int:
    from common.api_keys import append_key, new_key

    record, token = new_key(args.tenant, args.role)
    append_key(args.file, record)
    print(token)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from common.api_keys import load_keys

    try:
        keys = load_keys(args.file)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    for key in keys:
        print(f"{key.id}\t{key.role}\ttenant={key.tenant or '(default)'}")
    return 0
