"""Who may call what: the caller of a call, each service's table of method → roles, and the
one server interceptor that enforces it (and the per-key abuse limits) before a servicer
method runs.

    peer certificate  URI SAN spiffe://spotinfer/role/<role>  ─┐
    (mutual TLS)      coordinator | worker | daemon | operator  │
                      URI SAN spiffe://spotinfer/node/<name>    ├─▶ Caller(roles, tenant)
                      a daemon of the server's own node: own-daemon
                      a worker of the server's own node: own-worker
    API key           authorization: Bearer spk_<id>_<secret>   ─┘        │
                      tenant | admin (common.api_keys)                    ▼
                                         table[method] ∩ roles ? call : PERMISSION_DENIED

The own daemon: a server that names its node (a worker: its worker id) takes a daemon
certificate for the `OWN_DAEMON` role when the certificate names that node, or, for one that
names no node (one bundle shared by a fleet's worker VMs proves no node), when the call
comes over a connection no other machine can open (a unix socket, loopback). A daemon
certificate naming another node is never its own daemon, on any connection. The own worker
(`OWN_WORKER`, a daemon's caller for what it staged for its worker) is the same with the
roles swapped; a server that names no node (a daemon) takes a worker certificate for it over
a local connection only.

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
NODE_URI_PREFIX = "spiffe://spotinfer/node/"
COORDINATOR = "coordinator"
WORKER = "worker"
DAEMON = "daemon"
OPERATOR = "operator"
NODE_ROLES = (COORDINATOR, WORKER, DAEMON, OPERATOR)
OWN_DAEMON = "own-daemon"
"""Not a certificate role: what a daemon certificate counts as on a server of its own node."""
OWN_WORKER = "own-worker"
"""Not a certificate role: what a worker certificate counts as on a server of its own node."""
AUTHORIZATION_METADATA_KEY = "authorization"

Table = Mapping[str, Mapping[str, frozenset[str]]]
"""service full name → method name → the roles that may call it. A method of a listed service
that its table does not name is refused; services not listed (health, reflection) are open."""


def role_uri(role: str) -> str:
    return ROLE_URI_PREFIX + role


def node_uri(node: str) -> str:
    return NODE_URI_PREFIX + node


def roles(*names: str) -> frozenset[str]:
    return frozenset(names)


@dataclass(frozen=True)
class Caller:
    """Who is calling: roles from the peer certificate and from the API key, and the tenant."""

    roles: frozenset[str]
    tenant: str = ""
    key_id: str = ""


OPEN_CALLER = Caller(roles(TENANT_ROLE, ADMIN_ROLE, *NODE_ROLES, OWN_DAEMON, OWN_WORKER))
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
        foreign = ""
        if OWN_DAEMON in allowed and DAEMON in caller.roles:
            foreign = " (a daemon of another node)"
        elif OWN_WORKER in allowed and WORKER in caller.roles:
            foreign = " (a worker of another node)"
        raise PermissionDenied(
            f"{what} is for {', '.join(sorted(allowed))}; the caller is "
            f"{', '.join(sorted(caller.roles))}{foreign}"
        )

    @contextmanager
    def admitted(self, caller: Caller) -> Iterator[None]:
        """The key's limits for the length of a call (none for a call without a key)."""
        if self._limits is None or not caller.key_id:
            yield
            return
        with self._limits.admitted(caller.key_id):
            yield


def certificate_roles(
    context: grpc.aio.ServicerContext, trust_plaintext: bool, own_node: str = ""
) -> frozenset[str]:
    """The node roles the peer's certificate names (the URI SAN), with `OWN_DAEMON` for a
    daemon of ``own_node`` (the server's node, "" for none) and `OWN_WORKER` for a worker of
    it; on a plaintext connection of a server trusting those, every role."""
    auth = context.auth_context() or {}
    security = auth.get("transport_security_type", [b""])
    if security != [b"ssl"]:
        return roles(*NODE_ROLES, OWN_DAEMON, OWN_WORKER) if trust_plaintext else roles()
    found = set()
    nodes = set()
    for uri in auth.get("peer_uri", []) + auth.get("peer_spiffe_id", []):
        text = uri.decode(errors="replace")
        if text.startswith(ROLE_URI_PREFIX) and text[len(ROLE_URI_PREFIX) :] in NODE_ROLES:
            found.add(text[len(ROLE_URI_PREFIX) :])
        elif text.startswith(NODE_URI_PREFIX):
            nodes.add(text[len(NODE_URI_PREFIX) :])
    if DAEMON in found and own_node and is_own_node(nodes, own_node, context.peer()):
        found.add(OWN_DAEMON)
    if WORKER in found and is_own_node(nodes if own_node else set(), own_node, context.peer()):
        found.add(OWN_WORKER)
    return frozenset(found)


def is_own_node(peer_nodes: set[str], own_node: str, peer_address: str) -> bool:
    """Whether a peer is of the server's node ``own_node``: its certificate names that node,
    or it names none and ``peer_address`` (gRPC's peer string) is a unix socket or
    loopback, which only processes of this machine can connect from."""
    if peer_nodes:
        return own_node in peer_nodes
    return peer_address.startswith(_LOCAL_PEER_PREFIXES)


_LOCAL_PEER_PREFIXES = ("unix:", "ipv4:127.", "ipv6:[::1]:", "ipv6:%5B::1%5D:")


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call of a service in ``table`` before its servicer method runs; the
    caller is then `current_caller()` inside the method."""

    def __init__(self, table: Table, gatekeeper: Gatekeeper | None = None, node: str = "") -> None:
        """``node``: the server's own node (a worker's id), whose daemon holds `OWN_DAEMON`."""
        self._table = table
        self._gatekeeper = gatekeeper or Gatekeeper()
        self._node = node

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
        return _guarded(handler, self._gatekeeper, allowed, f"{service}/{method}", self._node)


def _metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode()
    return ""


def _guarded(
    handler: grpc.RpcMethodHandler,
    gatekeeper: Gatekeeper,
    allowed: frozenset[str],
    what: str,
    own_node: str,
) -> grpc.RpcMethodHandler:
    trust_plaintext = not gatekeeper.holds_keys

    async def enter(context: grpc.aio.ServicerContext) -> Caller:
        try:
            caller = gatekeeper.caller(
                certificate_roles(context, trust_plaintext, own_node),
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
