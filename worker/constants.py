"""Constants of the worker process."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_DRAIN_GRACE_SECONDS = 30.0
# A stopping worker (SIGTERM) with a store waits this share of its grace for its coordinator
# to move its requests (staged, then a Preempt through the daemon) before it pauses and
# persists them itself.
STOP_HANDOFF_SHARE = 0.5
# Registration with the coordinator(s): renewed every interval; the coordinator keeps it for
# the TTL without one (three renewals may be lost before the worker leaves routing).
DEFAULT_LEASE_INTERVAL_SECONDS = 2.0
DEFAULT_LEASE_TTL_SECONDS = 6.0
# One RegisterWorker / DeregisterWorker call waits this long for its answer.
REGISTER_TIMEOUT_SECONDS = 3.0
# gRPC's own default is 4 MiB; a 4k-token prompt as ids is ~20 KiB, so this is generous
# while still refusing a message that could only be an attack or a bug.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Tokens/s is averaged over this window of recent engine steps.
THROUGHPUT_WINDOW_SECONDS = 5.0
# How long a stopping server lets open calls finish after the drain.
SERVER_STOP_GRACE_SECONDS = 2.0

# --- persistence (Redis) ----------------------------------------------------------------------
# eager: every full KV block to Redis as it fills; lazy: none until a notice (then all, at the
# pause); hybrid: as they fill, up to a rate cap, the rest at the pause; off: never (tokens
# are committed under every policy but off's KV).
KV_PERSIST_POLICIES = ("eager", "lazy", "hybrid", "off")
# hybrid's cap is given in megabytes (10^6 bytes) per second of KV payload, every rank's
# shards counted; its token bucket holds this many seconds of the rate (at least one block),
# so a quiet moment lets a short burst of blocks through at once.
BYTES_PER_MB = 1_000_000
PERSIST_RATE_BURST_SECONDS = 1.0
# How a resume's stored KV is read and copied into the cache. async: the store read runs on
# a thread while the engine steps on (the scheduler is told the count once it is known) and
# the copy goes through vLLM's asynchronous load path; sync: both inside the engine's step
# (every other sequence on the worker waits for them).
KV_LOAD_MODES = ("async", "sync")
# vLLM's scheduling policies: priority orders the waiting queue by (priority, arrival) and,
# when KV runs out, preempts the lowest-priority running request; fcfs by arrival alone.
SCHEDULING_POLICIES = ("priority", "fcfs")
# The connector class vLLM loads from `kv_connector_module_path`.
SPOT_CONNECTOR_CLASS = "SpotKVConnector"
SPOT_CONNECTOR_MODULE = "worker.spot_connector"
# Keys of `kv_transfer_params` (SamplingParams.extra_args) that the connector reads.
KV_PARAM_REQUEST_ID = "spotinfer_request_id"
# The request's tenant: its blocks' content addresses start from the tenant's chain root.
KV_PARAM_TENANT = "spotinfer_tenant"
KV_PARAM_RESUME = "resume"
# While Redis is away, the token committer tries again this often.
PERSIST_RETRY_SECONDS = 1.0
# Tokens of KV stored as one Redis value (a chunk: several of vLLM's blocks, 2 on CPU, 16 on
# GPU), so a value is ~MiB rather than one key per 16 tokens; the content-address chain runs
# over chunks. A multiple of vLLM's block size.
DEFAULT_KV_CHUNK_TOKENS = 256
# Chunks waiting for the connector's writer thread; beyond this, new saves are dropped (counted)
# rather than holding KV copies in memory without bound while Redis is slow or gone.
KV_WRITE_QUEUE_BLOCKS = 256
# First output index of the request in the engine (0, or the committed length on a resume):
# the connector commits a paused request's tokens at their true indices.
KV_PARAM_FIRST_INDEX = "spotinfer_first_index"
# SamplingParams.extra_args key: how many sampling draws a resumed seeded request's generator
# skips (worker.seed_continuation), its output index at the resume.
SEED_DRAWS_ARG = "spotinfer_seed_draws"
# Marks a migration target's warm-up request: it loads the staged blocks into vLLM's prefix
# cache (see Engine.prefetch) and must neither save nor commit anything.
KV_PARAM_WARM = "spotinfer_warm"
# vLLM request id of a warm-up: the request's id with this suffix.
WARM_REQUEST_SUFFIX = ".warm"
# A warm-up that has not finished by then is aborted: the resume loads the staged blocks
# itself (what it did before the warm-up existed).
WARM_TIMEOUT_SECONDS = 5.0
# What the connector assumes of the link to Redis when it orders a paused request's writes
# (the order does not depend on the rate; see worker/flush_planner.py).
FLUSH_ASSUMED_BYTES_PER_SECOND = 200e6
FLUSH_ASSUMED_ROUND_TRIP_SECONDS = 0.0005
# A preempt flush polls Redis this often to learn which paused requests are complete (the
# wait adds to a migration's pause, so it is short; each poll is one round trip of headers
# for all of them, and polling only lasts while the paused requests' writes land).
FLUSH_POLL_SECONDS = 0.002
# Migration staging: the default budget, and how long staged blocks wait for their Resume
# before they count as abandoned (a handshake whose coordinator went away).
DEFAULT_STAGING_MIB = 1024
STAGING_STALE_SECONDS = 300.0
# Preempt without a deadline: how long the flush may take.
DEFAULT_PREEMPT_GRACE_SECONDS = 30.0
# How long preempt waits for the paused requests' streams to end after the abort.
STREAM_END_WAIT_SECONDS = 5.0
# A Resume of a request that still runs here (its old caller gone unseen): how long the old
# run may take to pause and get its tokens into the store before the Resume is refused.
TAKE_OVER_WAIT_SECONDS = 10.0
# A paused request's stream ends with a NOTICE event carrying this detail.
PAUSED_DETAIL = "paused for migration"
# Bytes of each weights file that go into the model fingerprint: enough to tell two
# checkpoints apart without reading gigabytes at every start.
FINGERPRINT_WEIGHT_BYTES = 1024 * 1024
# Flush planner: bytes a committed token costs on the wire besides its id (command framing,
# key, script args), amortised: tokens are tiny next to KV, which is why they always go first.
TOKEN_WIRE_BYTES = 16

# A resume's blocks refused by their MAC, or because another layout wrote them (another
# tensor parallel degree, backend, dtype), travel per request in the connector's stats under
# "<prefix><request id>"; the worker keeps the counts of this many requests until their
# MIGRATED / RECOVERED event takes them.
MAC_REJECTED_REQUEST_PREFIX = "mac_rejected_blocks:"
# Reads of a resume's stored KV on the connector's lookup thread (kv_load async) before an
# unavailable Redis makes it recompute: a connect that timed out on a loaded machine (each
# read waits the store's socket timeouts) is not an outage.
LOOKUP_ATTEMPTS = 3
LAYOUT_REJECTED_REQUEST_PREFIX = "layout_rejected_blocks:"
REJECTED_REQUEST_PREFIXES = (MAC_REJECTED_REQUEST_PREFIX, LAYOUT_REJECTED_REQUEST_PREFIX)
MAC_REJECTED_REQUESTS_KEPT = 4096
