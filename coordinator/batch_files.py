"""The Batch API's files, in OpenAI's JSONL formats.

Input, one request per line::

    {"custom_id": "q-1", "method": "POST", "url": "/v1/completions", "body": {...}}

Output (and error) file, one line per input line, in input order::

    {"id": "batch_req_…", "custom_id": "q-1",
     "response": {"status_code": 200, "request_id": "…", "body": {<the completion>}},
     "error": null}

A request the front refused (a bad body) is a line with its 4xx response in the error
file; a line that never ran (the job was cancelled or expired first) is an error-file line
with `"response": null` and `"error": {"code": "batch_cancelled" | "batch_expired", …}`.

`parse_input` refuses a file whose structure is wrong — not JSON, a missing or repeated
custom_id, another method, an endpoint this front has no batch for, or two endpoints —
naming the lines (OpenAI validates files the same way before a job starts).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequest
from coordinator.constants import (
    BATCH_ENDPOINTS,
    MAX_BATCH_LINES,
    MAX_CUSTOM_ID_CHARS,
    MAX_REPORTED_LINE_ERRORS,
)


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based position among the file's requests (blank lines skipped)
    line_number: int  # 1-based line of the file, for messages
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input(content: bytes) -> list[BatchLine]:
    """The file's requests in order; InvalidRequest naming the first bad lines otherwise."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the file is not UTF-8: {exc}") from exc
    lines: list[BatchLine] = []
    errors: list[str] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = _parse_line(raw, number, len(lines), seen)
        except ValueError as exc:
            errors.append(f"line {number}: {exc}")
            continue
        seen.add(line.custom_id)
        lines.append(line)
    if not errors and not lines:
        errors.append("the file holds no request")
    if len(lines) > MAX_BATCH_LINES:
        errors.append(f"{len(lines)} requests; a batch takes at most {MAX_BATCH_LINES}")
    urls = sorted({line.url for line in lines})
    if len(urls) > 1:
        errors.append(f"the requests name several endpoints ({', '.join(urls)}); one per file")
    if errors:
        shown = "; ".join(errors[:MAX_REPORTED_LINE_ERRORS])
        more = len(errors) - MAX_REPORTED_LINE_ERRORS
        raise InvalidRequest(
            f"invalid batch input file: {shown}" + (f" (and {more} more)" if more > 0 else "")
        )
    return lines


def _parse_line(raw: str, number: int, index: int, seen: set[str]) -> BatchLine:
    try:
        item = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise ValueError(f"custom_id longer than {MAX_CUSTOM_ID_CHARS} characters")
    if custom_id in seen:
        raise ValueError(f"duplicate custom_id {custom_id!r}")
    if item.get("method") != "POST":
        raise ValueError(f"method must be POST, got {item.get('method')!r}")
    url = item.get("url")
    if url not in BATCH_ENDPOINTS:
        raise ValueError(f"url must be one of {', '.join(BATCH_ENDPOINTS)}, got {url!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    return BatchLine(index, number, custom_id, str(url), body)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_line(custom_id: str, status_code: int, request_id: str, body: Any) -> str:
    return json.dumps(
        {
            "id": _line_id(),
            "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def error_line(custom_id: str, code: str, message: str) -> str:
    return json.dumps(
        {
            "id": _line_id(),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def is_success(line: str) -> bool:
    response = json.loads(line).get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def output_files(lines: Sequence[BatchLine], results: dict[str, str]) -> tuple[bytes, bytes]:
    """(output, errors): each line's result, in input order, in the file it belongs to."""
    output: list[str] = []
    errors: list[str] = []
    for line in lines:
        result = results.get(line.custom_id)
        if result is None:
            continue
        (output if is_success(result) else errors).append(result)
    return _jsonl(output), _jsonl(errors)


def _jsonl(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()
