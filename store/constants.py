"""Constants of the store: key schema version, token packing, block format, expiry, Redis client."""

from __future__ import annotations

# --- Redis key schema -------------------------------------------------------------------------
# Bump when the meaning of any key changes; old and new daemons then never read each other's data.
KEY_SCHEMA_VERSION = 1
KEY_PREFIX = f"si:v{KEY_SCHEMA_VERSION}:"

# --- committed tokens -------------------------------------------------------------------------
# Token ids are stored packed, little-endian unsigned 32-bit: every tokenizer vocabulary fits.
TOKEN_ID_BYTES = 4
MAX_TOKEN_ID = 2**32 - 1

# --- KV block format --------------------------------------------------------------------------
# 2: a keyed MAC (key id + HMAC-SHA256) in the header; version-1 blocks are recomputed.
BLOCK_FORMAT_VERSION = 2
BLOCK_MAGIC = b"SIKV"
# blake2b digest size of one link of the block hash chain: 128 bits keeps accidental
# collisions out of reach (birthday bound ~2^64 blocks) while keeping keys short.
BLOCK_HASH_BYTES = 16

# --- authenticity (see mac_keyring.py) ----------------------------------------------------------
MAC_BYTES = 32  # HMAC-SHA256
MAC_KEY_MIN_BYTES = 16
MAX_MAC_KEY_ID = 2**32 - 1
# Meta field holding "<key id>:<hex MAC>" over the record's fields that never change.
RECORD_MAC_FIELD = "mac"

# --- expiry -----------------------------------------------------------------------------------
DEFAULT_REQUEST_TTL_SECONDS = 6 * 3600
DEFAULT_RETENTION_SECONDS = 0
# A request that ended by itself (FINISHED) keeps its keys this long unless a coordinator says
# its client got the end first: a client whose coordinator died meanwhile is replayed from them.
DEFAULT_UNDELIVERED_RETENTION_SECONDS = 300
# Meta field set ("1") by a coordinator whose client got the request's end.
RELEASED_FIELD = "released"
# Meta field: how the request ended (a FinishReason name), set when it ends.
FINISH_REASON_FIELD = "finish_reason"
DEFAULT_BLOCK_TTL_SECONDS = 3600

# --- Redis client -----------------------------------------------------------------------------
# Short socket timeouts: the decode loop must learn quickly that Redis is gone, not hang.
DEFAULT_SOCKET_TIMEOUT_SECONDS = 2.0
DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS = 1.0

# The block writer (block_writer.py), in a worker or in its context daemon:
# Most blocks in one write batch (one pipelined round trip): small enough that the queue's
# order (the flush planner's) decides which paused requests are complete first.
KV_WRITE_BATCH_BLOCKS = 16
# The store refuses writes naming a request whose record the token committer has not created
# yet (it can lag on a busy machine): a flush's refused writes are tried again this often, for
# this long; a refused link of a full block is kept this long for the request's next writes.
FLUSH_RETRY_INTERVAL_SECONDS = 0.05
FLUSH_RETRY_SECONDS = 5.0
UNLINKED_BLOCKS_KEEP_SECONDS = 60.0
