"""What a VM runs at boot, rendered and expanded offline: Terraform's ``templatefile`` for the
boot scripts, the env file those scripts write, and systemd's expansion of a unit's
ExecStart. The ExecStart test (tests/infra/test_unit_exec_start.py) and the rehearsal use it.

Templates: the subset of Terraform's template language the boot scripts use:

    ${name}                      a variable (numbers as Terraform prints them)
    ${join(" ", keys(units))}    join / keys over a map (keys in lexical order, as Terraform)
    %{ for k, v in map ~} … %{ endfor ~}   (a map in key order; ``for x in list`` too)
    %{ if name } … %{ else } … %{ endif }  (also ``name == "text"`` / ``!=``)
    ${cond ? a : b}              a conditional, ``cond`` as in ``%{ if }``
    $${ and %%{                  a literal ${ and %{
    ~ inside a directive's braces strips the whitespace on that side (one newline included)

ExecStart, as systemd expands it (systemd.service(5), "Command lines"): the line is split into
words (quotes as a shell would), then in each word ``${VAR}`` becomes the variable's value
(unset: empty) inside that one argument, and a word that is exactly ``$VAR`` becomes the
value split at whitespace (zero or more arguments).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

_TOKEN = re.compile(r"\$\$\{|%%\{|\$\{|%\{")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STRING = re.compile(r'^"((?:[^"\\]|\\.)*)"$')
_CALL = re.compile(r"^([a-z_]+)\((.*)\)$", re.S)
_CONDITIONAL = re.compile(r'^((?:[^"?]|"(?:[^"\\]|\\.)*")+)\?([^?:]+):([^?:]+)$')
_SYSTEMD_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SYSTEMD_WORD = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)$")


class TemplateError(ValueError):
    """The template uses something this renderer does not know, or a variable is missing."""


# ---- Terraform templates -----------------------------------------------------------------


def render_template(text: str, variables: Mapping[str, Any]) -> str:
    """``text`` rendered as Terraform's templatefile(path, variables) would."""
    nodes, rest = _parse(_lex(text), ())
    assert not rest
    return _emit(nodes, dict(variables))


def _lex(text: str) -> list[tuple[str, str]]:
    """("text", s) | ("interp", expr) | ("directive", body), strip markers applied."""
    tokens: list[tuple[str, str]] = []
    position = 0
    while True:
        found = _TOKEN.search(text, position)
        if found is None:
            tokens.append(("text", text[position:]))
            break
        tokens.append(("text", text[position : found.start()]))
        mark = found.group()
        if mark in ("$${", "%%{"):
            tokens.append(("text", mark[1:]))
            position = found.end()
            continue
        close = _closing_brace(text, found.end())
        body = text[found.end() : close]
        position = close + 1
        if body.startswith("~"):
            body = body[1:]
            tokens[-1] = ("text", tokens[-1][1].rstrip())
        if body.endswith("~"):
            body = body[:-1]
            stripped = re.match(r"[ \t]*\r?\n?", text[position:])
            position += stripped.end() if stripped else 0
        tokens.append(("interp" if mark == "${" else "directive", body.strip()))
    return tokens


def _closing_brace(text: str, start: int) -> int:
    depth, index, quoted = 0, start, False
    while index < len(text):
        char = text[index]
        if quoted:
            if char == "\\":
                index += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return index
            depth -= 1
        index += 1
    raise TemplateError(f"unclosed template sequence at offset {start}")


Node = tuple[Any, ...]


def _parse(
    tokens: list[tuple[str, str]], until: tuple[str, ...]
) -> tuple[list[Node], list[tuple[str, str]]]:
    nodes: list[Node] = []
    while tokens:
        kind, value = tokens[0]
        if kind == "directive" and value.split()[0] in until:
            return nodes, tokens
        tokens = tokens[1:]
        if kind != "directive":
            nodes.append((kind, value))
            continue
        word = value.split()[0]
        if word == "for":
            body, tokens = _parse(tokens, ("endfor",))
            nodes.append(("for", value, body))
            tokens = tokens[1:]
        elif word == "if":
            then, tokens = _parse(tokens, ("else", "endif"))
            otherwise: list[Node] = []
            if tokens and tokens[0][1].split()[0] == "else":
                otherwise, tokens = _parse(tokens[1:], ("endif",))
            nodes.append(("if", value[2:].strip(), then, otherwise))
            tokens = tokens[1:]
        else:
            raise TemplateError(f"unknown directive %{{ {value} }}")
    if until:
        raise TemplateError(f"missing %{{ {until[-1]} }}")
    return nodes, tokens


def _emit(nodes: Sequence[Node], scope: dict[str, Any]) -> str:
    out: list[str] = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "interp":
            out.append(_to_text(_evaluate(node[1], scope)))
        elif node[0] == "for":
            out.append(_emit_for(node[1], node[2], scope))
        elif node[0] == "if":
            branch = node[2] if _truthy(_evaluate_condition(node[1], scope)) else node[3]
            out.append(_emit(branch, scope))
    return "".join(out)


def _emit_for(header: str, body: Sequence[Node], scope: dict[str, Any]) -> str:
    matched = re.match(r"^for\s+(\w+)(?:\s*,\s*(\w+))?\s+in\s+(.+)$", header)
    if matched is None:
        raise TemplateError(f"cannot read %{{ {header} }}")
    first, second, collection_expr = matched.groups()
    collection = _evaluate(collection_expr, scope)
    if isinstance(collection, Mapping):
        pairs: list[tuple[Any, Any]] = [(k, collection[k]) for k in sorted(collection)]
    else:
        pairs = list(enumerate(collection))
    out = []
    for key, value in pairs:
        inner = dict(scope)
        if second is None:
            inner[first] = value
        else:
            inner[first], inner[second] = key, value
        out.append(_emit(body, inner))
    return "".join(out)


def _evaluate_condition(expression: str, scope: dict[str, Any]) -> Any:
    for operator in ("==", "!="):
        if operator in expression:
            left, right = (part.strip() for part in expression.split(operator, 1))
            equal = _evaluate(left, scope) == _evaluate(right, scope)
            return equal if operator == "==" else not equal
    if expression.startswith("!"):
        return not _truthy(_evaluate(expression[1:].strip(), scope))
    return _evaluate(expression, scope)


def _evaluate(expression: str, scope: dict[str, Any]) -> Any:
    expression = expression.strip()
    conditional = _CONDITIONAL.match(expression)
    if conditional:
        condition, when_true, when_false = conditional.groups()
        chosen = when_true if _truthy(_evaluate_condition(condition.strip(), scope)) else when_false
        return _evaluate(chosen, scope)
    string = _STRING.match(expression)
    if string:
        return bytes(string.group(1), "utf-8").decode("unicode_escape")
    if expression in ("true", "false"):
        return expression == "true"
    if re.match(r"^-?\d+(\.\d+)?$", expression):
        return float(expression) if "." in expression else int(expression)
    if _IDENT.match(expression):
        if expression not in scope:
            raise TemplateError(f"vars map does not contain key {expression!r}")
        return scope[expression]
    call = _CALL.match(expression)
    if call:
        name, arguments = call.groups()
        values = [_evaluate(a, scope) for a in _split_arguments(arguments)]
        if name == "keys" and len(values) == 1:
            return sorted(values[0])
        if name == "join" and len(values) == 2:
            return str(values[0]).join(_to_text(v) for v in values[1])
    raise TemplateError(f"cannot evaluate ${{{expression}}}")


def _split_arguments(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth, quoted = 0, False
    for char in text:
        if char == '"' and (not current or current[-1] != "\\"):
            quoted = not quoted
        elif not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
        if char == "," and depth == 0 and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in (part.strip() for part in parts) if p]


def _to_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value == "true"
    return bool(value)


# ---- what the boot script writes ---------------------------------------------------------


def heredoc(script: str, path: str) -> str:
    """What ``cat >PATH <<WORD`` … ``WORD`` in ``script`` leaves in PATH (unexpanded), with
    what later ``cat >>PATH`` heredocs append to it."""
    pattern = rf"^cat (>>?){re.escape(path)} <<'?(\w+)'?\n(.*?)^\2$"
    text: str | None = None
    for mode, _, body in re.findall(pattern, script, flags=re.M | re.S):
        if mode == ">":
            text = body
        elif text is not None:
            text += body
    if text is None:
        raise TemplateError(f"the script writes no {path}")
    return text


def expand_shell_variables(text: str, values: Mapping[str, str]) -> str:
    """``$name`` and ``${name}`` in an unquoted heredoc, as bash expands them with ``values``
    (the variables the script set before it); a name not given is an error."""

    def value_of(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise TemplateError(f"the env file uses ${name}, which the test did not set")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$([A-Za-z_]\w*)", value_of, text)


def parse_env_file(text: str) -> dict[str, str]:
    """systemd's EnvironmentFile= format as the boot scripts write it: KEY=VALUE lines,
    ``#`` comments and blank lines skipped; surrounding quotes removed."""
    environ: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise TemplateError(f"not KEY=VALUE in the env file: {line!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        environ[key.strip()] = value
    return environ


# ---- systemd -----------------------------------------------------------------------------


def unit_exec_start(unit_text: str) -> str:
    """The ExecStart= line of a unit (one; continuation lines joined)."""
    joined = re.sub(r"\\\n", " ", unit_text)
    lines = [line for line in joined.splitlines() if line.startswith("ExecStart=")]
    if len(lines) != 1:
        raise TemplateError(f"expected one ExecStart=, found {len(lines)}")
    return lines[0][len("ExecStart=") :].lstrip("-@:+!")


def braced_variables(command: str) -> list[str]:
    """The ``${VAR}`` names a command line uses."""
    return _SYSTEMD_BRACED.findall(command)


def expand_exec_start(command: str, environ: Mapping[str, str]) -> list[str]:
    """The argv systemd runs for ``command`` with ``environ`` (see the module docstring)."""
    argv: list[str] = []
    for word in shlex.split(command):
        whole = _SYSTEMD_WORD.match(word)
        if whole:
            argv.extend(environ.get(whole.group(1), "").split())
            continue
        argv.append(_SYSTEMD_BRACED.sub(lambda m: environ.get(m.group(1), ""), word))
    return argv


# ---- one VM's boot, end to end -----------------------------------------------------------

ENV_FILE_PATH = "/etc/spotinfer/spotinfer.env"
UNIT_DIR = "/etc/systemd/system"


def boot_files(
    script: str, shell_values: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """From a rendered boot script: the env file it writes (``shell_values`` stand for what
    its commands would have found: ``instance_id``, ``private_ip``, ``redis_token``, ...),
    parsed, and each unit file it writes, by name."""
    environ = parse_env_file(expand_shell_variables(heredoc(script, ENV_FILE_PATH), shell_values))
    units = {
        name: body
        for name, body in re.findall(
            rf"^cat >{re.escape(UNIT_DIR)}/([\w.@-]+) <<'UNIT'\n(.*?)^UNIT$",
            script,
            flags=re.M | re.S,
        )
    }
    return environ, units
