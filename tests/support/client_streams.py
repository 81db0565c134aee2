"""Streams read by the Python client on threads, each recording what its client was given:
what the coordinator-restart tests watch while they stop and start coordinators."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.requests import Sampling, TokenChunk
from spotinfer.client import Client, ClientConfig


@dataclass
class ClientStream:
    """What one client (spotinfer.client.Client) was given."""

    request_id: str
    chunks: list[TokenChunk] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]


def start_streams(
    streams: Sequence[ClientStream],
    prompts: Sequence[list[int]],
    config: ClientConfig,
    max_tokens: int,
) -> list[threading.Thread]:
    """One thread per stream: a greedy request of `max_tokens` (EOS ignored) under the
    stream's id, its chunks recorded as they come, any error kept for the test."""

    def read(stream: ClientStream, prompt: list[int]) -> None:
        try:
            with Client(config) as client:
                sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                for chunk in client.stream(prompt, sampling, request_id=stream.request_id):
                    stream.chunks.append(chunk)
        except BaseException as exc:  # reported by the test
            stream.error = exc

    threads = [
        threading.Thread(target=read, args=(s, p), daemon=True)
        for s, p in zip(streams, prompts, strict=True)
    ]
    for thread in threads:
        thread.start()
    return threads
