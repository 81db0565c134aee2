"""Constants of the coordinator: defaults for its config, timing, and the wire names it uses."""

from __future__ import annotations

# --- ports and messages -----------------------------------------------------------------------
DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_INTERNAL_PORT = 50052  # mutual TLS only, when TLS is on
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
SERVER_STOP_GRACE_SECONDS = 5.0  # default of --stop-grace-seconds
MAX_STOP_GRACE_SECONDS = 3600.0

# --- registry and heartbeats ------------------------------------------------------------------
# Stats is the heartbeat: one call per worker per interval.
DEFAULT_HEARTBEAT_INTERVAL_SECONDS = 1.0
# A worker that has not answered Stats for this long is LOST: its requests are interrupted.
DEFAULT_LOST_AFTER_SECONDS = 5.0
# A running request whose every client left is cancelled after this long unless one attaches
# again (a client's own retry re-attaches well within it).
DEFAULT_DISCONNECT_GRACE_SECONDS = 5.0
# A worker that registers itself asks for its lease's TTL; none is kept longer than this.
DEFAULT_MAX_LEASE_TTL_SECONDS = 30.0
# One Stats call may not take longer than this; a slow answer counts as no answer.
STATS_TIMEOUT_SECONDS = 2.0
DEFAULT_STANDBY_POOL_SIZE = 0

# --- admission --------------------------------------------------------------------------------
DEFAULT_INTERACTIVE_QUEUE_CAPACITY = 256
DEFAULT_BATCH_QUEUE_CAPACITY = 1024
# The retry hint a rejected client gets grows with the backlog it would have joined.
DEFAULT_RETRY_AFTER_MS = 500
RETRY_AFTER_METADATA_KEY = "retry-after-ms"
# A request that arrives while no worker is ready waits this long for one: a spot VM noticed
# with the rest of the fleet is replaced by one that boots in about 45 s.
DEFAULT_CAPACITY_WAIT_SECONDS = 60.0

# --- relay ------------------------------------------------------------------------------------
# A finished request stays attachable this long (a client that lost its connection at the end).
DEFAULT_RETENTION_SECONDS = 300.0
RETENTION_SWEEP_INTERVAL_SECONDS = 1.0
# Longest wait for the worker's answer to an Abort.
ABORT_TIMEOUT_SECONDS = 5.0
DEFAULT_ROUTING_POLICY = "least-loaded"
DEFAULT_FAILOVER_POLICY = "resume"
# Tokens decoded before a span whose text the relay must rebuild (a reader attaching inside a
# chunk): enough for any tokenizer's merge of leading spaces and split characters.
SPAN_CONTEXT_TOKENS = 8

# --- live migration on a notice -------------------------------------------------------------
# A notice without a deadline (or one whose deadline we never heard) gives the worker this long.
NOTICE_DEFAULT_GRACE_SECONDS = 30.0
# What an AWS rebalance recommendation (elevated interruption risk, no deadline yet) does:
# nothing (a notice may never come), or move the worker's requests before any notice.
REBALANCE_POLICIES = ("ignore", "migrate")
DEFAULT_REBALANCE_POLICY = "ignore"
# The longest grace an operator may give a Drain or an injected notice (a day; clouds give
# minutes at most).
MAX_GRACE_SECONDS = 86_400.0
# Default notice lead times of InjectNotice when a drill gives none (see DESIGN.md).
NOTICE_SECONDS_BY_CLOUD = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
# A paused request waits for its flush report up to the notice deadline plus this.
FLUSH_WAIT_MARGIN_SECONDS = 5.0
# A worker paused by someone the coordinator does not hear from (no daemon registered): how
# long its flush is given to land before the request resumes from whatever the store holds.
FLUSH_WAIT_WITHOUT_DAEMON_SECONDS = 5.0
# A flush report nobody waits for (a duplicate, or the request was not ours) is dropped then.
FLUSH_REPORT_KEEP_SECONDS = 300.0
# A broken WatchNotices subscription is opened again after this pause.
DAEMON_RESUBSCRIBE_SECONDS = 1.0

# Staged migration (the target prefetches while the source decodes): the stages of all of a
# noticed worker's requests may take at most this long, and at most this share of the time
# left (below the daemon's hand-off share, so that the coordinator's Flush comes first).
STAGING_MAX_SECONDS = 8.0
STAGING_MAX_SHARE = 0.25
# With less time than this left, nothing is staged: the flush gets all of it.
STAGING_MIN_LEFT_SECONDS = 10.0
# Stages per request: the first copies every persisted block, each next one what the source
# filled meanwhile; staging stops as soon as no full block is left unstaged (the pause then
# moves only the partial block and the newest tokens).
STAGING_MAX_STAGES = 4
# Requests staged at the same time (each stage is one read of the store on the target).
STAGING_CONCURRENCY = 8
# One Prefetch call may take this long before the target counts as refusing.
PREFETCH_TIMEOUT_SECONDS = 10.0

# --- requests another coordinator started (restart, replicas) ---------------------------------
# How long an adopted request may stay RUNNING in the store before it is resumed anyway (its
# worker pauses it as soon as it sees its old caller's stream gone): on that worker, whose
# Resume pauses the old run first, or elsewhere from the store when that worker is gone.
ADOPT_PAUSE_WAIT_SECONDS = 10.0
ADOPT_POLL_SECONDS = 0.05
# A release that found no record, or no store, is tried again this often for this long: a
# store that restarted empty gets the record back from its worker (token_committer.py) a
# moment later, and that record would otherwise keep its keys the undelivered retention.
RELEASE_RETRY_INTERVAL_SECONDS = 1.0
RELEASE_RETRY_WINDOW_SECONDS = 60.0

# --- request records in Redis -----------------------------------------------------------------
# Delivered lengths are written behind, batched, at most this often.
RECORD_FLUSH_INTERVAL_SECONDS = 0.2
DEFAULT_RECORD_TTL_SECONDS = 6 * 3600
# A finished request's record stays this long (a replica or a late Attach may still look it
# up), then Redis drops it: a drill checks that nothing of a finished request is left.
DEFAULT_RECORD_RETENTION_SECONDS = 60.0

# --- HTTP front -------------------------------------------------------------------------------
DEFAULT_HTTP_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0
MODEL_OWNER = "spotinfer"
# The most prompts one /v1/completions body may list (each becomes its own request).
MAX_PROMPTS_PER_REQUEST = 64

# --- Batch API (batch_jobs.py, batch_runner.py, batch_front.py) --------------------------------
BATCH_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
BATCH_COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only window
MAX_BATCH_LINES = 50_000  # OpenAI's limit per file
MAX_CUSTOM_ID_CHARS = 512
MAX_REPORTED_LINE_ERRORS = 10
MAX_UPLOAD_BYTES = 32 * 1024 * 1024  # the HTTP front's largest body (a file upload)
MAX_BATCH_METADATA_PAIRS = 16  # OpenAI's metadata: up to 16 pairs
DEFAULT_BATCH_LINES_IN_FLIGHT = 64  # a job's lines running at once (a large workload batch)
BATCH_LEASE_TTL_SECONDS = 6.0  # a job whose coordinator died is taken over after this
BATCH_LEASE_RENEW_SECONDS = 2.0
BATCH_SCAN_SECONDS = 3.0  # how often unfinished jobs in the store are looked for
BATCH_BUSY_RETRY_SECONDS = 0.5  # a line whose queue was full (or no worker) waits this
BATCH_LIST_DEFAULT_LIMIT = 20
BATCH_LIST_MAX_LIMIT = 100
# A lost worker's daemon (when it outlived the worker's process) gets this long to write what
# the worker handed over before the requests resume elsewhere.
LOST_WORKER_SETTLE_SECONDS = 5.0
