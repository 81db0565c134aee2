"""Who may call what: the caller of a call, each service's table of method → roles, and the
one server interceptor that enforces it (and the per-key abuse limits) before a servicer
method runs.

    peer certificate  URI SAN spiffe://spotinfer/role/<role>  ─┐
    (mutual TLS)      coordinator | worker | daemon | operator  ├─▶ Caller(roles, tenant)
    API key           authorization: Bearer spk_<id>_<secret>   ─┘        │
                      tenant | admin (common.api_keys)                    ▼
                                         table[method] ∩ roles ? call : PERMISSION_DENIED

A plaintext connection can only come to a server without TLS (loopback, tests): its peer is
trusted as any cluster node, unless the server holds API keys. A server without a keys file
treats every caller as the default tenant with the admin role (the local, loopback case).
Errors are `common.errors` ServiceErrors: UNAUTHENTICATED (no or wrong key), PERMISSION_DENIED
(a role the table does not list), RESOURCE_EXHAUSTED (a key over its rate or concurrency).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.api_keys import ADMIN_ROLE, TENANT_ROLE, KeyRing, bearer_token
from common.errors import PermissionDenied, RateLimited, ServiceError, Unauthenticated

ROLE_URI_PREFIX = "spiffe://spotinfer/role/"
COORDINATOR = "coordinator"
WORKER = "worker"
DAEMON = "daemon"
OPERATOR = "operator"
NODE_ROLES = (COORDINATOR, WORKER, DAEMON, OPERATOR)
AUTHORIZATION_METADATA_KEY = "authorization"

Table = Mapping[str, Mapping[str, frozenset[str]]]
"""service full name → method name → the roles that may call it. A method of a listed service
that its table does not name is refused; services not listed (health, reflection) are open."""


def role_uri(role: str) -> str:
    return ROLE_URI_PREFIX + role


def roles(*names: str) -> frozenset[str]:
    return frozenset(names)


@dataclass(frozen=True)
class Caller:
    """Who is calling: roles from the peer certificate and from the API key, and the tenant."""

    roles: frozenset[str]
    tenant: str = ""
    key_id: str = ""


OPEN_CALLER = Caller(roles(TENANT_ROLE, ADMIN_ROLE, *NODE_ROLES))
# Without a keys file every caller holds the key roles; node roles still come from certificates.
_KEYLESS_ROLES = roles(TENANT_ROLE, ADMIN_ROLE)
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("spotinfer_caller")


def current_caller() -> Caller:
    """The caller of the call being served (set by the interceptor); open outside one."""
    return _CALLER.get(OPEN_CALLER)


@dataclass(frozen=True)
class AccessConfig:
    """API keys of the public API and the per-key abuse limits."""

    file: str = field(
        default="",
        metadata={
            "help": "keys file (JSON lines of salted hashes, `spotinfer keys add`); empty: no "
            "keys, allowed only on a loopback address"
        },
    )
    requests_per_second: float = field(
        default=0.0, metadata={"help": "requests each key may start per second; 0: no limit"}
    )
    burst: int = field(
        default=0, metadata={"help": "requests a key may start at once above its rate; 0: rate"}
    )
    max_concurrent: int = field(
        default=0, metadata={"help": "requests of one key in flight at once; 0: no limit"}
    )

    def __post_init__(self) -> None:
        if self.requests_per_second < 0 or self.burst < 0 or self.max_concurrent < 0:
            raise ValueError("api key limits must not be negative")


class TokenBucket:
    """``rate`` tokens a second up to ``capacity``; `take` answers 0 or the ms to wait."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._capacity = capacity
        self._tokens = capacity
        self._clock = clock
        self._last = clock()

    def take(self) -> int:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0
        return max(1, int((1 - self._tokens) / self._rate * 1000))


class KeyLimits:
    """Per key: a token bucket on request starts and a cap on requests in flight."""

    def __init__(self, config: AccessConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def admitted(self, key_id: str) -> Iterator[None]:
        """Holds one of the key's slots for the block; raises RateLimited."""
        self._enter(key_id)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[key_id] -= 1

    def _enter(self, key_id: str) -> None:
        config = self._config
        with self._lock:
            if config.max_concurrent and self._in_flight.get(key_id, 0) >= config.max_concurrent:
                raise RateLimited(
                    f"key {key_id} has {config.max_concurrent} requests in flight",
                    retry_after_ms=1000,
                )
            if config.requests_per_second:
                bucket = self._buckets.get(key_id)
                if bucket is None:
                    capacity = float(config.burst or max(1.0, config.requests_per_second))
                    bucket = TokenBucket(config.requests_per_second, capacity, self._clock)
                    self._buckets[key_id] = bucket
                wait_ms = bucket.take()
                if wait_ms:
                    raise RateLimited(
                        f"key {key_id} is over {config.requests_per_second:g} requests/s",
                        retry_after_ms=wait_ms,
                    )
            self._in_flight[key_id] = self._in_flight.get(key_id, 0) + 1


class Gatekeeper:
    """Turns what a connection shows (certificate roles, an authorization value) into a
    Caller, checks it against a method's roles, and holds the key's limits. Shared by the
    gRPC interceptor and the HTTP front."""

    def __init__(self, keys: KeyRing | None = None, limits: KeyLimits | None = None) -> None:
        self._keys = keys
        self._limits = limits

    @classmethod
    def from_config(cls, config: AccessConfig) -> Gatekeeper:
        keys = KeyRing.from_file(config.file) if config.file else None
        return cls(keys, KeyLimits(config))

    @property
    def holds_keys(self) -> bool:
        return self._keys is not None

    def caller(self, node_roles: frozenset[str], authorization: str) -> Caller:
        """Raises Unauthenticated for a key the keys file does not hold."""
        if self._keys is None:
            return Caller(_KEYLESS_ROLES | node_roles)
        token = bearer_token(authorization)
        if not token:
            return Caller(node_roles)
        key = self._keys.verify(token)
        if key is None:
            raise Unauthenticated("the API key is not valid")
        key_roles = roles(TENANT_ROLE, ADMIN_ROLE) if key.role == ADMIN_ROLE else roles(TENANT_ROLE)
        return Caller(node_roles | key_roles, key.tenant, key.id)

    def check(self, caller: Caller, allowed: frozenset[str], what: str) -> None:
        if caller.roles & allowed:
            return
        if not caller.roles:
            raise Unauthenticated(
                f"{what} needs an API key (authorization: Bearer <key>) or a client certificate"
            )
        raise PermissionDenied(
            f"{what} is for {', '.join(sorted(allowed))}; the caller is "
            f"{', '.join(sorted(caller.roles))}"
        )

    @contextmanager
    def admitted(self, caller: Caller) -> Iterator[None]:
        """The key's limits for the length of a call (none for a call without a key)."""
        if self._limits is None or not caller.key_id:
            yield
            return
        with self._limits.admitted(caller.key_id):
            yield


def certificate_roles(context: grpc.aio.ServicerContext, trust_plaintext: bool) -> frozenset[str]:
    """The node roles the peer's certificate names (the URI SAN), or, on a plaintext
    connection of a server trusting those, every node role."""
    auth = context.auth_context() or {}
    security = auth.get("transport_security_type", [b""])
    if security != [b"ssl"]:
        return roles(*NODE_ROLES) if trust_plaintext else roles()
    found = set()
    for uri in auth.get("peer_uri", []) + auth.get("peer_spiffe_id", []):
        text = uri.decode(errors="replace")
        if text.startswith(ROLE_URI_PREFIX) and text[len(ROLE_URI_PREFIX) :] in NODE_ROLES:
            found.add(text[len(ROLE_URI_PREFIX) :])
    return frozenset(found)


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call of a service in ``table`` before its servicer method runs; the
    caller is then `current_caller()` inside the method."""

    def __init__(self, table: Table, gatekeeper: Gatekeeper | None = None) -> None:
        self._table = table
        self._gatekeeper = gatekeeper or Gatekeeper()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        methods = self._table.get(service)
        if handler is None or methods is None:
            return handler
        allowed = methods.get(method, frozenset())
        return _guarded(handler, self._gatekeeper, allowed, f"{service}/{method}")


def _metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode()
    return ""


def _guarded(
    handler: grpc.RpcMethodHandler, gatekeeper: Gatekeeper, allowed: frozenset[str], what: str
) -> grpc.RpcMethodHandler:
    trust_plaintext = not gatekeeper.holds_keys

    async def enter(context: grpc.aio.ServicerContext) -> Caller:
        try:
            caller = gatekeeper.caller(
                certificate_roles(context, trust_plaintext),
                _metadata_value(context, AUTHORIZATION_METADATA_KEY),
            )
            gatekeeper.check(caller, allowed, what)
        except ServiceError as exc:
            await context.abort(exc.grpc_code, str(exc), trailing_metadata=exc.trailing_metadata())
        _CALLER.set(caller)
        return caller

    async def refused(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
        await context.abort(exc.grpc_code, str(exc), trailing_metadata=exc.trailing_metadata())

    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            caller = await enter(context)
            try:
                with gatekeeper.admitted(caller):
                    return await inner_unary(request, context)
            except RateLimited as exc:
                await refused(context, exc)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            caller = await enter(context)
            try:
                with gatekeeper.admitted(caller):
                    async for item in inner_stream(request, context):
                        yield item
            except RateLimited as exc:
                await refused(context, exc)

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary is not None:
        inner_upload = handler.stream_unary

        async def upload(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await enter(context)
            return await inner_upload(requests, context)

        return grpc.stream_unary_rpc_method_handler(
            upload, handler.request_deserializer, handler.response_serializer
        )
    raise AssertionError(f"{what}: no bidirectional RPC is expected in spotinfer's services")
