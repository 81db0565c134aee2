"""The ACL users come from the key schema: every key kind is granted, each rule is in reach
of the keys it stands for, and the worker's patterns never reach the coordinators' records."""

from __future__ import annotations

from fnmatch import fnmatchcase

from store import keys
from store.acl import ACCESS, Role, acl_file_line, acl_rules
from store.keys import KeyKind, key_pattern

# One key of every kind, as the schema spells it.
EXAMPLE_KEYS = {
    KeyKind.META: keys.request_meta_key("r-1"),
    KeyKind.TOKENS: keys.request_tokens_key("r-1"),
    KeyKind.BLOCKS: keys.request_blocks_key("r-1"),
    KeyKind.TAIL: keys.request_tail_key("r-1"),
    KeyKind.TAILS: keys.request_tails_key("r-1"),
    KeyKind.ROUTE: keys.request_route_key("r-1"),
    KeyKind.BLOCK: keys.block_key(bytes(range(16))),
    KeyKind.FILE_META: keys.batch_object_key(KeyKind.FILE_META, "file-1"),
    KeyKind.FILE_CONTENT: keys.batch_object_key(KeyKind.FILE_CONTENT, "file-1"),
    KeyKind.BATCH_META: keys.batch_object_key(KeyKind.BATCH_META, "batch_1"),
    KeyKind.BATCH_LINES: keys.batch_object_key(KeyKind.BATCH_LINES, "batch_1"),
    KeyKind.BATCH_RESULTS: keys.batch_object_key(KeyKind.BATCH_RESULTS, "batch_1"),
    KeyKind.BATCH_LEASE: keys.batch_object_key(KeyKind.BATCH_LEASE, "batch_1"),
    KeyKind.BATCH_INDEX: keys.batch_set_key(KeyKind.BATCH_INDEX),
    KeyKind.BATCH_ACTIVE: keys.batch_set_key(KeyKind.BATCH_ACTIVE),
}


def test_every_key_kind_is_granted_to_some_role() -> None:
    assert set(EXAMPLE_KEYS) == set(KeyKind), "a new key kind needs an example here"
    granted = {kind for access in ACCESS.values() for kind in access}
    assert granted == set(KeyKind)


def test_each_pattern_matches_its_own_kind_only() -> None:
    for kind, key in EXAMPLE_KEYS.items():
        matching = {other for other in KeyKind if fnmatchcase(key, key_pattern(other))}
        assert matching == {kind}, (key, matching)


def test_the_worker_cannot_reach_route_records_and_the_daemon_writes_as_its_worker() -> None:
    worker_patterns = [key_pattern(kind) for kind in ACCESS[Role.WORKER]]
    assert not any(fnmatchcase(EXAMPLE_KEYS[KeyKind.ROUTE], p) for p in worker_patterns)
    # The daemon persists what its worker hands over: the worker's keys, never a route.
    assert ACCESS[Role.DAEMON] == ACCESS[Role.WORKER]
    assert KeyKind.BLOCK not in ACCESS[Role.COORDINATOR]  # never a KV block
    # Batch jobs and their files are the coordinator's alone.
    batch_keys = [
        key for kind, key in EXAMPLE_KEYS.items() if kind.value.startswith(("file", "batch"))
    ]
    assert not any(fnmatchcase(k, p) for k in batch_keys for p in worker_patterns)


def test_rules_start_from_nothing_and_grant_no_admin_command() -> None:
    for role in Role:
        rules = acl_rules(role)
        assert rules[:2] == ["reset", "-@all"]
        granted = {rule[1:] for rule in rules if rule.startswith("+")}
        assert not granted & {"flushall", "flushdb", "config", "keys", "debug", "@all", "acl"}
        assert "~*" not in rules
    line = acl_file_line(Role.WORKER, "pw")
    assert line.startswith("user worker reset -@all ") and line.endswith(" on >pw")
