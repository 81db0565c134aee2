"""Constants of the context daemon: notice timing, flush planning, timeouts."""

from __future__ import annotations

# --- notices ----------------------------------------------------------------------------------
AWS_POLL_INTERVAL_SECONDS = 2.0
AWS_TOKEN_TTL_SECONDS = 21600
# Refresh the IMDSv2 token this long before it expires, so no request carries a dying token.
AWS_TOKEN_REFRESH_MARGIN_SECONDS = 60.0
AWS_NOTICE_SECONDS = 120.0
# How long an instance its auto scaling group terminates (scale-in, instance refresh, capacity
# rebalancing) stays in Terminating:Wait: the lifecycle hook's heartbeat timeout, as
# infra/terraform/aws sets it (termination_drain_seconds).
AWS_LIFECYCLE_DRAIN_SECONDS = 120.0
GCP_POLL_INTERVAL_SECONDS = 1.0
GCP_DEFAULT_NOTICE_SECONDS = 30.0
GCP_MAX_NOTICE_SECONDS = 120.0
GCP_WAIT_FOR_CHANGE_TIMEOUT_SECONDS = 30.0
AZURE_POLL_INTERVAL_SECONDS = 1.0
AZURE_API_VERSION = "2020-07-01"
AZURE_MIN_NOTICE_SECONDS = 30.0
FILE_POLL_INTERVAL_SECONDS = 0.5
FILE_DEFAULT_GRACE_SECONDS = 30.0
HTTP_TIMEOUT_SECONDS = 2.0

AWS_METADATA_BASE_URL = "http://169.254.169.254"
GCP_METADATA_BASE_URL = "http://metadata.google.internal"
AZURE_METADATA_BASE_URL = "http://169.254.169.254"

# --- the daemon process -----------------------------------------------------------------------
# The port infra's security groups open for the daemon.
DEFAULT_DAEMON_PORT = 50071
DEFAULT_WORKER_ADDRESS = "127.0.0.1:50061"
NOTICE_SOURCES = ("aws", "gcp", "azure", "file")
# Grace before the VM goes away when a notice carries no deadline (and GCP's notice length).
DEFAULT_GRACE_SECONDS = {
    "aws": AWS_NOTICE_SECONDS,
    "gcp": GCP_DEFAULT_NOTICE_SECONDS,
    "azure": AZURE_MIN_NOTICE_SECONDS,
    "file": FILE_DEFAULT_GRACE_SECONDS,
}
# A failing step of the daemon's outer loop is retried after this pause, never given up.
DAEMON_RETRY_SECONDS = 1.0
# A coordinator that moves the requests itself gets at most this share of the time left to
# the deadline before the daemon flushes on its own (the rest is the flush's).
HANDOFF_MAX_SHARE = 0.5
DEFAULT_HANDOFF_SECONDS = 10.0
# Each subscriber of WatchNotices gets a queue this long; a subscriber that falls this far
# behind loses its oldest events rather than holding memory without bound.
SUBSCRIBER_QUEUE_EVENTS = 64
# Calls to the worker other than Preempt (Stats) give up after this long.
WORKER_CALL_TIMEOUT_SECONDS = 5.0
# Preempt may run to the deadline; beyond it the call is cut after this margin.
PREEMPT_MARGIN_SECONDS = 5.0
DAEMON_STOP_GRACE_SECONDS = 2.0

# --- peer migration (daemon → daemon) ---------------------------------------------------------
# What a target daemon holds of pushed KV for its worker, at most, unless configured.
DEFAULT_STAGING_MAX_BYTES = 2 * 1024**3
# A request's staged blocks that nobody fetched or dropped in this long are freed: longer
# than any cloud's notice (AWS 2 min), so a migration in progress never loses them.
DEFAULT_STAGING_TTL_SECONDS = 180.0
# How often the server frees expired requests when no call comes to do it.
STAGING_SWEEP_SECONDS = 5.0
# A pushed or fetched block travels in chunks of at most this many bytes: the servers' 4 MiB
# message limit less room for the rest of the message, so that a block of up to that size
# (SmolLM2-135M's are 2.9 MB) is one message, received without reassembly.
PEER_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
MAX_PEER_CHUNK_BYTES = PEER_CHUNK_BYTES
# A source sends a stream's blocks in PushBlocks calls of about this many bytes each (at least
# one block): a refused block costs the rest of its call, which the target drains unread.
PEER_CALL_BYTES = 64 * 1024 * 1024
# glibc's malloc (malloc_tuning.py): buffers up to this size come from the heap, not from a
# fresh mmap (glibc's most), and freed heap up to this much is kept for the next block.
MALLOC_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
MALLOC_TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
# Parallel PushBlocks streams (one channel, so one TCP flow, each) a source opens by default:
# one flow tops out well below a VM's network (AWS: ~5 Gbps per flow).
DEFAULT_PEER_STREAMS = 4
# The headers a target sends before it reads a PushBlocks call (a refused call has none).
PUSH_ACCEPTED_METADATA = ("push-accepted", "1")
# The trailing metadata of a failed PushBlocks: how many of its blocks were staged first.
STAGED_BLOCKS_METADATA_KEY = "staged-blocks"
# Handed-over KV a daemon keeps to push to a migration's target (block_mirror.py).
DEFAULT_PEER_MIRROR_BYTES = 512 * 1024**2
