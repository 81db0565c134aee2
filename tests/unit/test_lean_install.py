"""A worker or coordinator VM installs the core dependencies only (no `tools` or `dev` extra):
the serving processes and the `spotinfer` entry point their units run must import without
the user tools' packages, a tool run there says which extra it needs, and the installed wheel
does not carry the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

REPO_ROOT = Path(__file__).resolve().parents[2]
# Packages of the `tools` and `dev` extras that the serving processes must do without, and
# the benchmarks, which run from a checkout only. (transformers is core, so the packages it
# imports itself — tokenizers, safetensors — cannot be blocked here.)
NOT_ON_A_SERVING_VM = ("matplotlib", "openai", "gguf", "rich", "benchmarks")
SERVING_MODULES = (
    "coordinator.server",
    "coordinator.main",
    "worker.server",
    "worker.main",
    "context_daemon.server",
    "context_daemon.main",
    "spotinfer.cli",
)
# Runs first in the child: from here on the blocked packages are not installed.
WITHOUT_TOOLS = """
import importlib, importlib.abc, json, sys

blocked = set(json.loads(sys.argv[1]))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
try:
    import matplotlib  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the import block does not work")
"""
IMPORT_THE_PROCESSES = """
for module in json.loads(sys.argv[2]):
    importlib.import_module(module)
importlib.import_module("spotinfer.cli").build_parser()  # every subcommand registers
print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in blocked)))
"""
RUN_THE_CLI = """
from spotinfer.cli import main

sys.exit(main(json.loads(sys.argv[2])))
"""
# A small real model config (Llama-3-8B's shape) for `spotinfer plan`.
LLAMA_3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _without_tools(code: str, argument: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_TOOLS + code,
            json.dumps(NOT_ON_A_SERVING_VM),
            json.dumps(argument),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serving_processes_import_without_the_tools_packages() -> None:
    done = _without_tools(IMPORT_THE_PROCESSES, SERVING_MODULES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_a_tool_without_its_extra_says_which_extra(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B_SHAPE))
    plan = ["plan", "--config", str(config), "--memory-gib", "80", "--context", "8192"]
    as_json = _without_tools(RUN_THE_CLI, [*plan, "--json"])
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    assert json.loads(as_json.stdout)["max_concurrent_seqs"] > 0
    as_table = _without_tools(RUN_THE_CLI, plan)  # the table needs rich
    assert as_table.returncode == 2, as_table.stderr[-3000:]
    assert "spotinfer plan: error: needs rich" in as_table.stderr
    assert "pip install 'spotinfer[tools]'" in as_table.stderr
    assert "Traceback" not in as_table.stderr


def test_the_wheel_holds_the_processes_and_not_the_benchmarks() -> None:
    config = read_configuration(REPO_ROOT / "pyproject.toml")  # the packages it finds
    packages = set(config["tool"]["setuptools"]["packages"])
    assert {"coordinator", "worker", "context_daemon", "protos", "spotinfer"} <= packages
    assert not {p for p in packages if p.partition(".")[0] in ("benchmarks", "tests")}
