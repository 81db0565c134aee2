"""Flags, environment variables and a TOML file, all derived from one frozen config dataclass.

A process's config dataclass is the single truth; this module reads its fields and nothing
else, so a new field is at once a flag, an environment variable and a TOML key:

    field                   flag                   environment                  TOML key
    max_num_seqs            --max-num-seqs         SPOTINFER_MAX_NUM_SEQS       max_num_seqs
    store.url ("redis-url") --redis-url            SPOTINFER_REDIS_URL          [store] url
    store.cluster           --redis-cluster        SPOTINFER_REDIS_CLUSTER      [store] cluster
    store.block_ttl_seconds --store-block-ttl-...  SPOTINFER_STORE_BLOCK_TTL_...[store] block_ttl_seconds

- Flag: ``--`` and the field name with dashes; a field of a nested config dataclass is
  prefixed with the parent's name (``--store-block-ttl-seconds``). ``metadata={"flag": ...}``
  renames a flag (``--worker`` for the repeatable ``workers``, ``--redis-url`` for ``store.url``).
- Environment: ``SPOTINFER_`` and the flag's name, uppercased, dashes as underscores, for
  every field of every process. A list is comma-separated; a bool is 1/true/yes/on or
  0/false/no/off.
- TOML (``--config FILE.toml``): one table per process, named by the process
  (``[coordinator]``, ``[worker]``, ``[daemon]``), with keys named as the fields; a nested
  config is a sub-table (``[worker.store]``). A top-level table named as a nested config
  (``[store]``) is shared by every process and overridden by the process's own sub-table, so
  one file can serve all the processes of a machine. Unknown keys are errors.

Precedence: flag > environment > TOML > the field's default. ``--print-config`` prints the
effective value of every field and where it came from (default / toml / env / flag).
Required fields (no default) are checked here, after all sources are read.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import os
import textwrap
import types
import typing
import urllib.parse
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "SPOTINFER_"
DEFAULT = "default"
TOML = "toml"
ENV = "env"
FLAG = "flag"
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
# argparse dest of a field: its dotted path with "__" for the dots.
_DEST_SEPARATOR = "__"

ConfigT = TypeVar("ConfigT")


class ConfigError(ValueError):
    """A value that does not fit its field, a missing required field, or a bad TOML file;
    the message names the field and where the value came from."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One leaf field of a (possibly nested) config dataclass."""

    path: tuple[str, ...]  # ("store", "url")
    kind: type  # bool, int, float, str, tuple (of str), or an Enum subclass
    optional: bool  # `X | None`
    required: bool
    flag: str  # "--redis-url"
    help: str
    choices: tuple[str, ...]
    metavar: str

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        return _DEST_SEPARATOR.join(self.path)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").replace("-", "_").upper()

    def parse_text(self, text: str, origin: str) -> Any:
        """A value given as text (a flag or an environment variable)."""
        if self.optional and text == "":
            return None
        if self.kind is bool:
            word = text.strip().lower()
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
            raise ConfigError(f"{origin}: {self.name} must be a bool (true/false), got {text!r}")
        if self.kind is tuple:
            return tuple(part.strip() for part in text.split(",") if part.strip())
        try:
            value = self.kind(text)
        except ValueError:
            raise ConfigError(
                f"{origin}: {self.name} must be {_kind_name(self)}, got {text!r}"
            ) from None
        return self._checked_choice(value, origin)

    def check_toml(self, value: Any, origin: str) -> Any:
        """A value read from TOML, which already carries its type."""
        if self.kind is tuple and isinstance(value, list):
            if all(isinstance(item, str) for item in value):
                return tuple(value)
        elif self.kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        elif self.kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        elif self.kind in (bool, str) and isinstance(value, self.kind):
            return self._checked_choice(value, origin)
        elif issubclass(self.kind, enum.Enum) and isinstance(value, str):
            return self.parse_text(value, origin)
        raise ConfigError(f"{origin}: {self.name} must be {_kind_name(self)}, got {value!r}")

    def _checked_choice(self, value: Any, origin: str) -> Any:
        shown = value.value if isinstance(value, enum.Enum) else value
        if self.choices and str(shown) not in self.choices:
            raise ConfigError(
                f"{origin}: {self.name} must be one of {', '.join(self.choices)}, got {shown!r}"
            )
        return value


@dataclasses.dataclass(frozen=True)
class Resolved(Generic[ConfigT]):
    """A built config and, per setting name, where its value came from."""

    config: ConfigT
    sources: Mapping[str, str]

    def explicit(self, name: str) -> bool:
        """Whether a source other than the default gave the setting."""
        return self.sources.get(name, DEFAULT) != DEFAULT

    def replaced(self, config: ConfigT, reason: str) -> Resolved[ConfigT]:
        """The same, for `config` derived from this one: a changed setting is marked `reason`."""
        sources = dict(self.sources)
        for name in sources:
            if _get(config, name) != _get(self.config, name):
                sources[name] = reason
        return Resolved(config, sources)

    def render(self) -> str:
        """One line per setting: name, effective value (a URL's password masked), source."""
        rows = [
            (name, repr(_masked(_get(self.config, name))), source)
            for name, source in self.sources.items()
        ]
        name_width = max(len(row[0]) for row in rows)
        value_width = max(len(row[1]) for row in rows)
        return "\n".join(
            f"{name:<{name_width}}  {value:<{value_width}}  {source}"
            for name, value, source in rows
        )


class ConfigSource(Generic[ConfigT]):
    """The flags, environment and TOML of one process's config dataclass.

    ``section`` names the process's TOML table (``worker`` reads ``[worker]``).
    """

    def __init__(self, config_type: type[ConfigT], section: str) -> None:
        self.config_type = config_type
        self.section = section
        self.settings = settings_of(config_type)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--config``, ``--print-config`` and one flag per setting."""
        parser.add_argument(
            "--config",
            metavar="FILE.toml",
            default=None,
            help=f"read settings from the [{self.section}] table of this TOML file "
            "(flags and SPOTINFER_* environment variables win)",
        )
        parser.add_argument(
            "--print-config",
            action="store_true",
            help="print every setting's effective value and where it came from, then exit",
        )
        for setting in self.settings:
            _add_flag(parser, setting)

    def resolve(
        self, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> Resolved[ConfigT]:
        """The config from flags > environment > TOML > defaults; raises ConfigError (or the
        dataclass's own ValueError) for a value that does not fit."""
        environ = os.environ if environ is None else environ
        toml_values = self._read_toml(getattr(args, "config", None))
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        missing: list[Setting] = []
        for setting in self.settings:
            given = getattr(args, setting.dest, None)
            if given is not None:
                values[setting.name] = tuple(given) if setting.kind is tuple else given
                sources[setting.name] = FLAG
            elif setting.env in environ:
                text = environ[setting.env]
                values[setting.name] = setting.parse_text(text, setting.env)
                sources[setting.name] = ENV
            elif setting.name in toml_values:
                origin = f"{args.config}: {setting.name}"
                values[setting.name] = setting.check_toml(toml_values[setting.name], origin)
                sources[setting.name] = TOML
            else:
                sources[setting.name] = DEFAULT
                if setting.required:
                    missing.append(setting)
        if missing:
            raise ConfigError(
                "; ".join(
                    f"{s.name} is required: pass {s.flag}, set {s.env}, or set {s.name} in the "
                    f"[{self.section}] table of --config"
                    for s in missing
                )
            )
        return Resolved(_build(self.config_type, values, ()), sources)

    def _read_toml(self, path: str | None) -> dict[str, Any]:
        """Setting name -> value from the file's shared tables and the process's own table."""
        if not path:
            return {}
        try:
            document = tomllib.loads(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"--config {path}: {error.strerror or error}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path}: not valid TOML: {error}") from None
        nested = {s.path[0] for s in self.settings if len(s.path) > 1}
        flat: dict[str, Any] = {}
        for name in sorted(nested):  # shared tables first: the process's own wins
            if isinstance(document.get(name), dict):
                flat.update(_flatten(document[name], (name,)))
        own = document.get(self.section, {})
        if not isinstance(own, dict):
            raise ConfigError(f"--config {path}: [{self.section}] must be a table")
        flat.update(_flatten(own, ()))
        known = {s.name for s in self.settings}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ConfigError(
                f"--config {path}: unknown setting(s) {', '.join(unknown)} for {self.section}"
            )
        return flat


def unique_name(prefix: str) -> str:
    """A default name for a process in the cluster: ``worker-1a2b3c4d``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def settings_of(config_type: type[Any], prefix: tuple[str, ...] = ()) -> list[Setting]:
    """Every leaf field of `config_type`, nested config dataclasses expanded in place."""
    hints = typing.get_type_hints(config_type)
    docs = _attribute_docs(config_type)
    settings: list[Setting] = []
    for f in dataclasses.fields(config_type):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            settings.extend(settings_of(hint, (*prefix, f.name)))
            continue
        kind, optional = _kind_of(hint, f.name)
        flag_name = f.metadata.get("flag") or "-".join((*prefix, f.name)).replace("_", "-")
        choices = f.metadata.get("choices", ())
        if issubclass(kind, enum.Enum):
            choices = tuple(str(member.value) for member in kind)
        settings.append(
            Setting(
                path=(*prefix, f.name),
                kind=kind,
                optional=optional,
                required=f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING,
                flag="--" + flag_name,
                help=f.metadata.get("help") or docs.get(f.name, ""),
                choices=tuple(choices),
                metavar=f.metadata.get("metavar") or flag_name.replace("-", "_").upper(),
            )
        )
    return settings


def _kind_of(hint: Any, name: str) -> tuple[type, bool]:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        if len(members) != 1:
            raise TypeError(f"config field {name}: only `X | None` unions are supported")
        hint = members[0]
    if typing.get_origin(hint) is tuple:
        return tuple, optional
    if hint in (bool, int, float, str) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint, optional
    raise TypeError(f"config field {name}: type {hint!r} has no flag form")


def _add_flag(parser: argparse.ArgumentParser, setting: Setting) -> None:
    help_text = setting.help + (" (required)" if setting.required else "")
    help_text += f" [env {setting.env}]"
    common: dict[str, Any] = {"dest": setting.dest, "default": None, "help": help_text}
    if setting.kind is bool:
        parser.add_argument(setting.flag, action=argparse.BooleanOptionalAction, **common)
    elif setting.kind is tuple:
        parser.add_argument(setting.flag, action="append", metavar=setting.metavar, **common)
    else:
        parser.add_argument(
            setting.flag,
            type=functools.partial(_flag_value, setting),
            metavar="{" + ",".join(setting.choices) + "}" if setting.choices else setting.metavar,
            **common,
        )


def _flag_value(setting: Setting, text: str) -> Any:
    try:
        return setting.parse_text(text, setting.flag)
    except ConfigError as error:
        # argparse reports an ArgumentTypeError as "argument --flag: <message>".
        raise argparse.ArgumentTypeError(str(error).split(": ", 1)[1]) from None


def _build(config_type: type[Any], values: Mapping[str, Any], prefix: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(config_type)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(config_type):
        path = (*prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            nested = {k: v for k, v in values.items() if k.startswith(".".join(path) + ".")}
            if nested:
                kwargs[f.name] = _build(hint, nested, path)
        elif ".".join(path) in values:
            kwargs[f.name] = values[".".join(path)]
    return config_type(**kwargs)


def _flatten(table: Mapping[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[".".join((*prefix, key))] = value
    return flat


def _get(config: Any, name: str) -> Any:
    for part in name.split("."):
        config = getattr(config, part)
    return config


def _masked(value: Any) -> Any:
    """``redis://:secret@host`` -> ``redis://:***@host``: the printout may land in a log."""
    if not isinstance(value, str) or "://" not in value:
        return value
    parts = urllib.parse.urlsplit(value)
    if not parts.password:
        return value
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{name}:***@{host}"))


def _kind_name(setting: Setting) -> str:
    if setting.kind is tuple:
        return "a list of strings"
    if issubclass(setting.kind, enum.Enum):
        return "one of " + ", ".join(setting.choices)
    article = "an" if setting.kind is int else "a"
    return f"{article} {setting.kind.__name__}"


def _attribute_docs(config_type: type[Any]) -> dict[str, str]:
    """Field name -> the docstring written under it (``x: int = 0`` then ``\"\"\"...\"\"\"``)."""
    try:
        source = textwrap.dedent(inspect.getsource(config_type))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    statements = body.body if isinstance(body, ast.ClassDef) else []
    for statement, following in zip(statements, statements[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs
