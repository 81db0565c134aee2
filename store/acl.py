"""Redis ACL users, one per role, derived from the key schema: each role gets the commands
its code sends and only the key kinds it touches.

::

    key kind (keys.KeyKind)   worker        daemon        coordinator
    ------------------------  ------------  ------------  ----------------------------------
    meta, tokens, blocks,     read + write  read + write  read + write (adoption reads a
    tail, tails                                           record and its tokens; a release
                                                          marks or ends a request's keys)
    blk (KV blocks)           read + write  read + write  -
    route                     -             -        read + write
    file-*, batch-* (jobs of  -             -        read + write
    the Batch API)

The daemon writes what its worker hands over (KV blocks, a pause's tokens and marks: the
worker's own writes, context_daemon/persister.py), so it holds the worker's keys and commands.
The coordinator's commands leave out APPEND and STRLEN, so its user cannot commit a token,
and it never touches a KV block. A worker cannot read the coordinators' route records; no
role may run FLUSHALL, CONFIG, KEYS, DEBUG or any other administrative command: those stay
with the operator's user.

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
    "info",  # INFO memory at start: a store that may evict records is refused (eviction.py)
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
# Adoption reads a record and its tokens; RELEASE_REQUEST reads the status, marks or ends.
_RECORD_COMMANDS = (
    *("evalsha", "script|load", "exists", "getrange"),
    *("hget", "hgetall", "hset", "del", "expire"),
)
_ROUTE_COMMANDS = ("hgetall", "hset", "pexpire")
# store/batch_store.py and its scripts (PUT_BATCH_RESULT, TAKE_BATCH_LEASE).
_BATCH_COMMANDS = (
    "evalsha",
    "script|load",
    "get",
    "set",
    "exists",
    "del",
    "hget",
    "hgetall",
    "hset",
    "hsetnx",
    "hincrby",
    "hkeys",
    "hlen",
    "zadd",
    "zrevrange",
    "sadd",
    "srem",
    "smembers",
)
_BATCH_KINDS = (
    KeyKind.FILE_META,
    KeyKind.FILE_CONTENT,
    KeyKind.BATCH_META,
    KeyKind.BATCH_LINES,
    KeyKind.BATCH_RESULTS,
    KeyKind.BATCH_LEASE,
    KeyKind.BATCH_INDEX,
    KeyKind.BATCH_ACTIVE,
)

_REQUEST_KINDS = (
    KeyKind.META,
    KeyKind.TOKENS,
    KeyKind.BLOCKS,
    KeyKind.TAIL,
    KeyKind.TAILS,
    KeyKind.BLOCK,
)

ACCESS: Mapping[Role, Mapping[KeyKind, Access]] = {
    Role.WORKER: dict.fromkeys(_REQUEST_KINDS, Access.READ_WRITE),
    Role.DAEMON: dict.fromkeys(_REQUEST_KINDS, Access.READ_WRITE),
    Role.COORDINATOR: {
        KeyKind.META: Access.READ_WRITE,
        KeyKind.TOKENS: Access.READ_WRITE,
        KeyKind.BLOCKS: Access.READ_WRITE,
        KeyKind.TAIL: Access.READ_WRITE,
        KeyKind.TAILS: Access.READ_WRITE,
        KeyKind.ROUTE: Access.READ_WRITE,
        **dict.fromkeys(_BATCH_KINDS, Access.READ_WRITE),
    },
}

COMMANDS: Mapping[Role, tuple[str, ...]] = {
    Role.WORKER: _STORE_COMMANDS,
    Role.DAEMON: _STORE_COMMANDS,
    Role.COORDINATOR: tuple(sorted({*_RECORD_COMMANDS, *_ROUTE_COMMANDS, *_BATCH_COMMANDS})),
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
