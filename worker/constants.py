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
