"""An asyncio gRPC channel that follows its certificate files: when they change (a renewal),
the next call goes out on a new channel built from the new files.

gRPC Python has no client-side certificate reload: a channel's credentials are fixed when it
is made, and every reconnect presents the same certificate, however long the process runs.
So the channel is rebuilt instead::

    stub ─▶ RenewingChannel.unary_stream(method) ─▶ _Renewing (one per method)
                                                       │ each call: files changed?
                                                       ▼ yes, and the pair is whole: rebuild
                                        current channel (generation n) ─▶ the call

A stub binds its methods once, when it is made; they stay bound to this object, so stubs made
before a renewal use the new certificate too. Calls in flight finish on the channel they
started on (a generation is closed only with the whole RenewingChannel). A half-written pair
(the key replaced, the certificate not yet) keeps the current channel until the next change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class RenewingChannel(grpc.aio.Channel):
    """``build`` makes a channel from the files as they are now; ``changed`` says (once) that
    a file changed since the last look; ``usable`` whether the files form a whole pair."""

    def __init__(
        self,
        build: Callable[[], grpc.aio.Channel],
        changed: Callable[[], bool],
        usable: Callable[[], bool],
    ) -> None:
        self._build = build
        self._changed = changed
        self._usable = usable
        self._lock = threading.Lock()
        self._current = build()
        self._retired: list[grpc.aio.Channel] = []
        self.generation = 0
        """How many times the channel was rebuilt for renewed files."""

    def current(self) -> grpc.aio.Channel:
        """The channel for the next call: rebuilt first if the files changed."""
        if self._changed():
            with self._lock:
                self._renew()
        return self._current

    def _renew(self) -> None:
        if not self._usable():
            log.warning("certificate files changed but do not form a pair yet; keeping the old")
            return
        try:
            fresh = self._build()
        except (OSError, ValueError) as exc:
            log.warning("certificate files unreadable, keeping the current channel: %s", exc)
            return
        self._retired.append(self._current)
        self._current = fresh
        self.generation += 1
        log.info("client certificate renewed: new connections present the new files")

    async def __aenter__(self) -> RenewingChannel:
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        channels = [*self._retired, self._current]
        self._retired = []
        for channel in channels:
            await channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._current.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Renewing(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Renewing(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Renewing(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Renewing(self, "stream_stream", method, args, kwargs)


class _Renewing:
    """A stub's method: each call on the channel's current generation (its multicallable
    made once per generation)."""

    def __init__(
        self,
        owner: RenewingChannel,
        kind: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._bound: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        bound = self._bound
        if bound is None or bound[0] is not channel:
            factory = getattr(channel, self._kind)
            bound = (channel, factory(self._method, *self._args, **self._kwargs))
            self._bound = bound
        return bound[1](*args, **kwargs)
