"""A minimal HTTP client for cloud metadata services (stdlib only, never through a proxy)."""

from __future__ import annotations

import email.message
import http.client
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from context_daemon.notices.errors import NoticeSourceError


@dataclass(frozen=True)
class MetadataResponse:
    status: int
    headers: Mapping[str, str]
    """Header names lower-cased."""
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class MetadataHttp:
    """Sends one request and returns any status as a MetadataResponse (4xx/5xx included).

    Metadata services live on a link-local address; a proxy from the environment would send
    the request somewhere else entirely, so proxies are switched off.
    """

    def __init__(self) -> None:
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        timeout_seconds: float,
        body: bytes | None = None,
    ) -> MetadataResponse:
        request = urllib.request.Request(url, data=body, headers=dict(headers), method=method)
        try:
            with self._opener.open(request, timeout=timeout_seconds) as reply:
                return MetadataResponse(reply.status, _lower(reply.headers), reply.read())
        except urllib.error.HTTPError as error:
            return MetadataResponse(error.code, _lower(error.headers), error.read())
        except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
            raise NoticeSourceError(f"{method} {url}: {error}") from error


def _lower(headers: email.message.Message) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}
