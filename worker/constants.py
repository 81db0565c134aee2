"""Constants of the worker process."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_DRAIN_GRACE_SECONDS = 30.0
# gRPC's own default is 4 MiB; a 4k-token prompt as ids is ~20 KiB, so this is generous
# while still refusing a message that could only be an attack or a bug.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Tokens/s is averaged over this window of recent engine steps.
THROUGHPUT_WINDOW_SECONDS = 5.0
# How long a stopping server lets open calls finish after the drain.
SERVER_STOP_GRACE_SECONDS = 2.0

# --- persistence (Redis) ----------------------------------------------------------------------
KV_PERSIST_POLICIES = ("eager", "lazy", "off")
# The connector class vLLM loads from `kv_connector_module_path`.
SPOT_CONNECTOR_CLASS = "SpotKVConnector"
SPOT_CONNECTOR_MODULE = "worker.spot_connector"
# Keys of `kv_transfer_params` (SamplingParams.extra_args) that the connector reads.
KV_PARAM_REQUEST_ID = "spotinfer_request_id"
KV_PARAM_RESUME = "resume"
# While Redis is away, the token committer tries again this often.
PERSIST_RETRY_SECONDS = 1.0
# Blocks waiting for the connector's writer thread; beyond this, new saves are dropped (counted)
# rather than holding KV copies in memory without bound while Redis is slow or gone.
KV_WRITE_QUEUE_BLOCKS = 256
# Bytes of each weights file that go into the model fingerprint: enough to tell two
# checkpoints apart without reading gigabytes at every start.
FINGERPRINT_WEIGHT_BYTES = 1024 * 1024
