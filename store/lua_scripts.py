"""Server-side scripts of the store: each runs atomically on the node that owns the request.

Every script touches only the keys passed in KEYS, all of one request (one hash tag, one
slot), which is what lets them run unchanged on Redis Cluster. They return small status
codes rather than raising, because a Lua error inside a pipeline would hide the results of
the other requests of the same engine step.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from store.constants import FINISH_REASON_FIELD, RELEASED_FIELD, TOKEN_ID_BYTES
from store.request_record import (
    PAUSED_WITHOUT_KV_FIELD,
    TERMINAL_STATUSES,
    RequestStatus,
)


class ScriptCode(enum.IntEnum):
    OK = 0
    GAP = 1
    MISMATCH = 2
    NO_RECORD = 3
    ENDED = 4
    BAD_TRANSITION = 5
    EXISTS = 6


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


_TERMINAL_LUA_SET = ", ".join(f"[{status.value!r}] = true" for status in TERMINAL_STATUSES)

# KEYS: meta, tokens, blocks, tail, tails.  ARGV: start index, packed tokens, ttl seconds, now ms.
# Appends only at the committed length. A retry that overlaps what is stored must match it
# byte for byte (then only the new suffix, if any, is appended); a gap or a different token
# at a stored index is refused and nothing is written. Returns {code, committed length}.
COMMIT_TOKENS = LuaScript(
    "commit_tokens",
    f"""
local terminal = {{{_TERMINAL_LUA_SET}}}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {{{ScriptCode.NO_RECORD}, 0}} end
local width = {TOKEN_ID_BYTES}
local length = math.floor(redis.call('STRLEN', KEYS[2]) / width)
if terminal[status] then return {{{ScriptCode.ENDED}, length}} end
local start = tonumber(ARGV[1])
local data = ARGV[2]
local count = math.floor(#data / width)
if start > length then return {{{ScriptCode.GAP}, length}} end
local overlap = math.min(length, start + count) - start
if overlap > 0 then
  local stored = redis.call('GETRANGE', KEYS[2], start * width, (start + overlap) * width - 1)
  if stored ~= string.sub(data, 1, overlap * width) then
    return {{{ScriptCode.MISMATCH}, length}}
  end
end
if start + count > length then
  redis.call('APPEND', KEYS[2], string.sub(data, overlap * width + 1))
  length = start + count
  redis.call('HSET', KEYS[1], 'committed_length', length, 'updated_unix_ms', ARGV[4])
end
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
return {{{ScriptCode.OK}, length}}
""",
)

# KEYS: meta.  ARGV: ttl seconds, then field/value pairs.  Creates the record only if absent.
CREATE_REQUEST = LuaScript(
    "create_request",
    f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return {ScriptCode.EXISTS} end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {ScriptCode.OK}
""",
)

# KEYS: meta.  ARGV: new status, now ms, set-owner flag ("1"/"0"), owner, allowed previous...
# Running again clears what the last pause said of its KV. Returns {code, status before}.
SET_STATUS = LuaScript(
    "set_status",
    f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {{{ScriptCode.NO_RECORD}, ''}} end
for i = 5, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_unix_ms', ARGV[2])
    if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'owner_worker_id', ARGV[4]) end
    if ARGV[1] == '{RequestStatus.RUNNING.value}' then
      redis.call('HDEL', KEYS[1], '{PAUSED_WITHOUT_KV_FIELD}')
    end
    return {{{ScriptCode.OK}, status}}
  end
end
return {{{ScriptCode.BAD_TRANSITION}, status}}
""",
)

# KEYS: meta, tokens, blocks, tail, tails.  ARGV: final status, now ms, retention seconds, hold
# seconds, finish reason, allowed previous...  The keys are kept for the longer of retention
# and hold, unless a coordinator already released the request (its client got the end): then
# for the retention alone. 0 deletes every key of the request; otherwise the record keeps its
# final status and finish reason and all keys expire then. Returns {code, status before}.
FINISH_REQUEST = LuaScript(
    "finish_request",
    f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {{{ScriptCode.NO_RECORD}, ''}} end
local allowed = false
for i = 6, #ARGV do if ARGV[i] == status then allowed = true end end
if not allowed then return {{{ScriptCode.BAD_TRANSITION}, status}} end
local keep = tonumber(ARGV[3])
if redis.call('HGET', KEYS[1], '{RELEASED_FIELD}') ~= '1' then
  keep = math.max(keep, tonumber(ARGV[4]))
end
if keep == 0 then
  redis.call('DEL', unpack(KEYS))
else
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_unix_ms', ARGV[2],
    '{FINISH_REASON_FIELD}', ARGV[5])
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], keep) end
end
return {{{ScriptCode.OK}, status}}
""",
)

# KEYS: meta, tokens, blocks, tail, tails.  ARGV: retention seconds.  A coordinator's client got the
# request's end: an ended request keeps its keys for the retention only (0 deletes them); a
# live one (its worker's finish is still on the way) is marked, so that its finish does.
# Returns {code, status}.
RELEASE_REQUEST = LuaScript(
    "release_request",
    f"""
local terminal = {{{_TERMINAL_LUA_SET}}}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {{{ScriptCode.NO_RECORD}, ''}} end
if not terminal[status] then
  redis.call('HSET', KEYS[1], '{RELEASED_FIELD}', '1')
elseif tonumber(ARGV[1]) == 0 then
  redis.call('DEL', unpack(KEYS))
else
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
return {{{ScriptCode.OK}, status}}
""",
)

# KEYS: meta, blocks.  ARGV: ttl seconds, then block index / hex block hash pairs.
# Links stored full blocks (any number of one request, so a write batch costs one call per
# request, not per block) to their request, only while the request's record exists, so a
# late write after a delete leaves nothing behind.
ATTACH_BLOCK = LuaScript(
    "attach_block",
    f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {ScriptCode.NO_RECORD} end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[2], ARGV[1])
return {ScriptCode.OK}
""",
)

# KEYS: meta, tail.  ARGV: encoded block, ttl seconds.  Same rule as ATTACH_BLOCK.
PUT_TAIL = LuaScript(
    "put_tail",
    f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {ScriptCode.NO_RECORD} end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return {ScriptCode.OK}
""",
)

# KEYS: meta, tails.  ARGV: shard suffix, encoded block, header bytes, ttl seconds.  The tail
# of a sharded worker's rank beyond the first, as PUT_TAIL, in the request's tails hash: the
# value under the suffix, its header alone under "<suffix>#header".
PUT_SHARD_TAIL = LuaScript(
    "put_shard_tail",
    f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {ScriptCode.NO_RECORD} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2],
           ARGV[1] .. '#header', string.sub(ARGV[2], 1, tonumber(ARGV[3])))
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {ScriptCode.OK}
""",
)

# KEYS: meta.  ARGV: none.  A pause found none of the request's KV computed: says so in its
# record, only while the record exists and is live (a late write after an end changes
# nothing). Returns a ScriptCode.
MARK_PAUSED_WITHOUT_KV = LuaScript(
    "mark_paused_without_kv",
    f"""
local terminal = {{{_TERMINAL_LUA_SET}}}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {ScriptCode.NO_RECORD} end
if terminal[status] then return {ScriptCode.ENDED} end
redis.call('HSET', KEYS[1], '{PAUSED_WITHOUT_KV_FIELD}', '1')
return {ScriptCode.OK}
""",
)

# KEYS: a batch's results, its meta.  ARGV: custom_id, the result line, a counter field.
# The result of a line is written once: a second write of the same line changes nothing
# (and counts nothing). Returns OK when written, EXISTS when the line had a result.
PUT_BATCH_RESULT = LuaScript(
    "put_batch_result",
    f"""
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return {ScriptCode.EXISTS} end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return {ScriptCode.OK}
""",
)

# KEYS: a batch's lease.  ARGV: owner, ttl ms. Taken when free or already the owner's.
TAKE_BATCH_LEASE = LuaScript(
    "take_batch_lease",
    f"""
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {ScriptCode.EXISTS} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {ScriptCode.OK}
""",
)

ALL_SCRIPTS = (
    COMMIT_TOKENS,
    CREATE_REQUEST,
    SET_STATUS,
    FINISH_REQUEST,
    RELEASE_REQUEST,
    ATTACH_BLOCK,
    PUT_TAIL,
    PUT_SHARD_TAIL,
    MARK_PAUSED_WITHOUT_KV,
    PUT_BATCH_RESULT,
    TAKE_BATCH_LEASE,
)
