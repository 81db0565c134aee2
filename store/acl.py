"""Redis ACL users, one per role, derived from the key schema: each role gets the commands
its code sends and only the key kinds it touches.

::

    key kind (keys.KeyKind)   worker        daemon   coordinator
    ------------------------  ------------  -------  ------------------------
    meta, tokens, blocks,     read + write  -        read meta and blocks
    tail, blk                                        (adoption's get_request)
    route                     -             -        read + write

The daemon only asks whether Redis answers (its health report), so it holds no key at all.
A worker cannot read the coordinators' route records; no role may run FLUSHALL, CONFIG,
KEYS, DEBUG or any other administrative command: those stay with the operator's user.

``ACCESS`` is the one table; ``acl_rules(role)`` turns it into ``ACL SETUSER`` rules and
``acl_file_line`` into a line of an ``aclfile``. tests/unit/test_acl.py checks that every key
kind is granted to some role, so a new key kind cannot be left out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from store.keys import KeyKind, key_pattern


class Role(enum.Enum):
    WORKER = "worker"
    DAEMON = "daemon"
    COORDINATOR = "coordinator"


class Access(enum.Enum):
    READ = "%R~"
    READ_WRITE = "~"


# What any client sends to connect and to find its way round a Redis Cluster. (redis-py's
# CLIENT SETINFO is left out: it ignores a refusal, and Redis before 7.2 has no such command.)
_CONNECTION_COMMANDS = (
    "ping",
    "hello",
    "auth",
    "select",
    "readonly",
    "command",
    "cluster|slots",
    "cluster|shards",
)
# RedisStore's own commands, and those its Lua scripts call (Redis checks them as well).
_STORE_COMMANDS = (
    "evalsha",
    "script|load",
    "get",
    "getex",
    "getrange",
    "set",
    "append",
    "strlen",
    "exists",
    "del",
    "expire",
    "ttl",
    "hget",
    "hgetall",
    "hset",
    "hdel",
)
_RECORD_READ_COMMANDS = ("hgetall",)
_ROUTE_COMMANDS = ("hgetall", "hset", "pexpire")

_REQUEST_KINDS = (KeyKind.META, KeyKind.TOKENS, KeyKind.BLOCKS, KeyKind.TAIL, KeyKind.BLOCK)

ACCESS: Mapping[Role, Mapping[KeyKind, Access]] = {
    Role.WORKER: dict.fromkeys(_REQUEST_KINDS, Access.READ_WRITE),
    Role.DAEMON: {},
    Role.COORDINATOR: {
        KeyKind.META: Access.READ,
        KeyKind.BLOCKS: Access.READ,
        KeyKind.ROUTE: Access.READ_WRITE,
    },
}

COMMANDS: Mapping[Role, tuple[str, ...]] = {
    Role.WORKER: _STORE_COMMANDS,
    Role.DAEMON: (),
    Role.COORDINATOR: tuple(sorted({*_RECORD_READ_COMMANDS, *_ROUTE_COMMANDS})),
}


def acl_rules(role: Role) -> list[str]:
    """The ``ACL SETUSER <user>`` rules of ``role``, without the user's password: start
    from nothing (``reset``), allow the role's commands, then its key patterns."""
    commands = [f"+{command}" for command in (*_CONNECTION_COMMANDS, *COMMANDS[role])]
    patterns = [access.value + key_pattern(kind) for kind, access in ACCESS[role].items()]
    return ["reset", "-@all", *commands, *patterns]


def acl_file_line(role: Role, password: str) -> str:
    """The role's user as a line of a redis-server ``aclfile``, enabled, with ``password``."""
    return " ".join(["user", role.value, *acl_rules(role), "on", f">{password}"])
