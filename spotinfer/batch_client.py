"""A small client of the coordinator's Batch API (`/v1/files`, `/v1/batches`), on the
standard library only: what `spotinfer batch` uses. Any OpenAI client works as well
(`client.files.create(..., purpose="batch")`, `client.batches.create(...)`).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

TIMEOUT_SECONDS = 60.0


class BatchApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class BatchClient:
    base_url: str  # the coordinator's HTTP front, e.g. https://10.0.0.2:8000
    api_key: str = ""
    ca_file: str = ""  # the cluster CA for https; empty: the system's

    def _request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> bytes:
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data=body, method=method)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        if content_type:
            request.add_header("Content-Type", content_type)
        context = ssl.create_default_context(cafile=self.ca_file or None)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS, context=context) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                text = json.loads(text)["error"]["message"]
            raise BatchApiError(exc.code, text) from None

    def _json(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        content_type = "application/json" if payload is not None else ""
        return json.loads(self._request(method, path, body, content_type))

    def upload(self, filename: str, content: bytes) -> dict[str, Any]:
        boundary = uuid.uuid4().hex
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{filename}"\r\nContent-Type: application/jsonl\r\n\r\n',
        ]
        body = "".join(parts).encode() + content + f"\r\n--{boundary}--\r\n".encode()
        reply = self._request(
            "POST", "/v1/files", body, f"multipart/form-data; boundary={boundary}"
        )
        return dict(json.loads(reply))

    def create(self, input_file_id: str, endpoint: str) -> dict[str, Any]:
        payload = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
        }
        return dict(self._json("POST", "/v1/batches", payload))

    def get(self, batch_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/v1/batches/{batch_id}"))

    def page(self, limit: int = 20) -> dict[str, Any]:
        return dict(self._json("GET", f"/v1/batches?limit={limit}"))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return dict(self._json("POST", f"/v1/batches/{batch_id}/cancel"))

    def content(self, file_id: str) -> bytes:
        return self._request("GET", f"/v1/files/{file_id}/content")
