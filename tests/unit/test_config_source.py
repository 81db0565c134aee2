"""Flags, environment and TOML derived from a process's config dataclass: precedence, the one
environment rule, required fields, --print-config, and errors that name the field."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from common.config_source import ConfigError, ConfigSource
from context_daemon.config import CONFIG_SOURCE as DAEMON_SOURCE
from coordinator.config import CONFIG_SOURCE as COORDINATOR_SOURCE
from worker.config import CONFIG_SOURCE as WORKER_SOURCE

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Inner:
    url: str = field(default="", metadata={"flag": "inner-url"})
    """Where the inner thing is."""
    ttl_seconds: int = 10
    """How long it lives."""


@dataclass(frozen=True)
class _Sample:
    name: str = field(metadata={"help": "required: no default"})
    port: int = field(default=1, metadata={"help": "a port"})
    ratio: float = field(default=0.5, metadata={"help": "a fraction"})
    enabled: bool = field(default=True, metadata={"help": "a switch"})
    peers: tuple[str, ...] = field(default=(), metadata={"flag": "peer", "help": "repeatable"})
    limit: int | None = field(default=None, metadata={"help": "optional"})
    mode: str = field(default="a", metadata={"help": "a or b", "choices": ("a", "b")})
    inner: _Inner = field(default_factory=_Inner)

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError(f"port must not be negative, got {self.port}")


SOURCE = ConfigSource(_Sample, section="sample")


def _resolve(
    argv: list[str], env: dict[str, str] | None = None, source: ConfigSource[Any] = SOURCE
) -> tuple[Any, dict[str, str]]:
    parser = argparse.ArgumentParser()
    source.add_arguments(parser)
    resolved = source.resolve(parser.parse_args(argv), environ=env or {})
    return resolved.config, dict(resolved.sources)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return str(path)


def test_flag_beats_env_beats_toml_beats_default(tmp_path: Path) -> None:
    toml = _toml(tmp_path, '[sample]\nname = "t"\nport = 3\nratio = 0.25\n')
    env = {"SPOTINFER_PORT": "2", "SPOTINFER_RATIO": "0.75"}
    config, sources = _resolve(["--config", toml, "--port", "1"], env)
    assert (config.port, sources["port"]) == (1, "flag")
    assert (config.ratio, sources["ratio"]) == (0.75, "env")
    assert (config.name, sources["name"]) == ("t", "toml")
    assert (config.mode, sources["mode"]) == ("a", "default")


def test_every_kind_of_field_from_flags() -> None:
    config, _ = _resolve(
        ["--name", "n", "--no-enabled", "--peer", "x:1", "--peer", "y:2", "--limit", "7"]
        + ["--mode", "b", "--inner-url", "redis://h:1/0", "--inner-ttl-seconds", "5"]
    )
    assert config == _Sample(
        name="n",
        enabled=False,
        peers=("x:1", "y:2"),
        limit=7,
        mode="b",
        inner=_Inner(url="redis://h:1/0", ttl_seconds=5),
    )


def test_environment_names_follow_the_flag_for_every_field() -> None:
    env = {
        "SPOTINFER_NAME": "e",
        "SPOTINFER_ENABLED": "no",
        "SPOTINFER_PEER": "a:1, b:2",
        "SPOTINFER_LIMIT": "",
        "SPOTINFER_INNER_URL": "redis://e:1/0",
        "SPOTINFER_INNER_TTL_SECONDS": "9",
    }
    config, sources = _resolve([], env)
    assert config == _Sample(
        name="e", enabled=False, peers=("a:1", "b:2"), inner=_Inner("redis://e:1/0", 9)
    )
    assert sources["inner.url"] == "env"


def test_the_redis_url_is_read_from_the_environment_by_every_process() -> None:
    env = {"SPOTINFER_REDIS_URL": "redis://10.0.0.9:6379/0"}
    for source, argv in (
        (COORDINATOR_SOURCE, []),
        (WORKER_SOURCE, ["--model", "m"]),
        (DAEMON_SOURCE, []),
    ):
        config, sources = _resolve(argv, env, source)
        assert config.store.url == "redis://10.0.0.9:6379/0", source.section
        assert sources["store.url"] == "env"


def test_a_shared_toml_table_is_overridden_by_the_process_table(tmp_path: Path) -> None:
    toml = _toml(
        tmp_path,
        '[inner]\nurl = "redis://shared:1/0"\nttl_seconds = 4\n'
        '[sample]\nname = "t"\n[sample.inner]\nttl_seconds = 6\n',
    )
    config, sources = _resolve(["--config", toml])
    assert config.inner == _Inner("redis://shared:1/0", 6)
    assert sources["inner.ttl_seconds"] == "toml"


def test_one_toml_file_serves_all_processes(tmp_path: Path) -> None:
    toml = _toml(
        tmp_path,
        '[store]\nurl = "redis://r:6379/0"\n'
        '[coordinator]\nworkers = ["10.0.0.5:50061"]\n'
        '[worker]\nmodel = "/models/m"\nmax_num_seqs = 8\n'
        '[daemon]\nnotice_source = "gcp"\n',
    )
    coordinator, _ = _resolve(["--config", toml], source=COORDINATOR_SOURCE)
    worker, _ = _resolve(["--config", toml], source=WORKER_SOURCE)
    daemon, _ = _resolve(["--config", toml], source=DAEMON_SOURCE)
    assert coordinator.workers == ("10.0.0.5:50061",)
    assert (worker.model, worker.max_num_seqs) == ("/models/m", 8)
    assert daemon.notice_source == "gcp"
    for config in (coordinator, worker, daemon):
        assert config.store.url == "redis://r:6379/0"


def test_an_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    toml = _toml(tmp_path, '[sample]\nname = "t"\nprot = 3\n')
    with pytest.raises(ConfigError, match="unknown setting.*prot"):
        _resolve(["--config", toml])


def test_a_missing_required_field_says_every_way_to_give_it() -> None:
    with pytest.raises(ConfigError) as error:
        _resolve([])
    assert str(error.value) == (
        "name is required: pass --name, set SPOTINFER_NAME, or set name in the [sample] "
        "table of --config"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPOTINFER_PORT": "eighty"}, "SPOTINFER_PORT: port must be an int, got 'eighty'"),
        ({"SPOTINFER_ENABLED": "maybe"}, "SPOTINFER_ENABLED: enabled must be a bool"),
        ({"SPOTINFER_MODE": "c"}, "SPOTINFER_MODE: mode must be one of a, b, got 'c'"),
        ({"SPOTINFER_PORT": "-1"}, "port must not be negative, got -1"),
    ],
)
def test_a_bad_environment_value_names_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _resolve(["--name", "n"], env)


def test_a_bad_toml_value_names_the_file_and_the_field(tmp_path: Path) -> None:
    toml = _toml(tmp_path, '[sample]\nname = "t"\nport = "three"\n')
    with pytest.raises(ConfigError, match=r"settings.toml: port: port must be an int"):
        _resolve(["--config", toml])


def test_a_bad_flag_value_is_an_argparse_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _resolve(["--name", "n", "--mode", "c"])
    assert "argument --mode: mode must be one of a, b, got 'c'" in capsys.readouterr().err


def test_help_comes_from_metadata_or_the_field_docstring() -> None:
    parser = argparse.ArgumentParser()
    SOURCE.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--inner-ttl-seconds INNER_TTL_SECONDS How long it lives. [env" in text
    assert "--name NAME required: no default (required) [env SPOTINFER_NAME]" in text


def _run(module: str, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_print_config_shows_each_value_and_its_source(tmp_path: Path) -> None:
    toml = _toml(tmp_path, '[worker]\nmodel = "/models/m"\nmax_num_seqs = 8\n')
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    env["SPOTINFER_REDIS_URL"] = "redis://r:6379/0"
    result = _run("worker", "--config", toml, "--dtype", "float32", "--print-config", env=env)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    assert rows["dtype"] == ["'float32'", "flag"]
    assert rows["store.url"] == ["'redis://r:6379/0'", "env"]
    assert rows["max_num_seqs"] == ["8", "toml"]
    assert rows["port"] == ["50061", "default"]
    assert set(rows) == {s.name for s in WORKER_SOURCE.settings}


def test_print_config_marks_what_the_tuning_file_set(tmp_path: Path) -> None:
    tuning = tmp_path / "tuning.json"
    tuning.write_text('{"version": 1, "model": "m", "worker": {"max_num_seqs": 12}}')
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    result = _run("worker", "--model", "m", "--tuning-file", str(tuning), "--print-config", env=env)
    assert result.returncode == 0, result.stderr
    assert "max_num_seqs" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("max_num_seqs"))
    assert row.split()[1:] == ["12", "tuning_file"]


def test_print_config_masks_a_password_in_a_url() -> None:
    parser = argparse.ArgumentParser()
    DAEMON_SOURCE.add_arguments(parser)
    args = parser.parse_args(["--redis-url", "rediss://:s3cret@redis.internal:6379/0?x=1"])
    text = DAEMON_SOURCE.resolve(args, environ={}).render()
    assert "s3cret" not in text
    assert "'rediss://:***@redis.internal:6379/0?x=1'  flag" in text
