"""API keys of the public API: a keys file of salted hashes, each key bound to a tenant.

    keys file (JSON lines, 0600)                         the key a client holds (shown once)
    {"id": "k3f9…", "tenant": "acme", "role": "tenant",   spk_k3f9…_<secret>
     "salt": "<hex>", "iterations": 200000,
     "hash": "<hex PBKDF2-HMAC-SHA256 of the secret>"}

The id in the key finds its line; the secret is checked against the hash (constant-time). A
verified key is remembered by a SHA-256 digest of it, so only a key's first use pays the
PBKDF2 cost. Roles: ``tenant`` (Inference) and ``admin`` (Inference and Control).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

KEY_PREFIX = "spk"
TENANT_ROLE = "tenant"
ADMIN_ROLE = "admin"
KEY_ROLES = (TENANT_ROLE, ADMIN_ROLE)
PBKDF2_ITERATIONS = 200_000
_SALT_BYTES = 16
_SECRET_BYTES = 24


@dataclass(frozen=True)
class ApiKey:
    """One line of the keys file (no secret in it)."""

    id: str
    tenant: str
    role: str
    salt: str
    hash: str
    iterations: int = PBKDF2_ITERATIONS

    def __post_init__(self) -> None:
        if self.role not in KEY_ROLES:
            raise ValueError(f"key role must be one of {KEY_ROLES}, got {self.role!r}")
        if not self.id or "_" in self.id:
            raise ValueError(f"key id must be non-empty without '_', got {self.id!r}")

    def matches(self, secret: str) -> bool:
        digest = _hash(secret, bytes.fromhex(self.salt), self.iterations)
        return hmac.compare_digest(digest.hex(), self.hash)


def _hash(secret: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)


def new_key(tenant: str, role: str = TENANT_ROLE) -> tuple[ApiKey, str]:
    """A fresh key: the line to store and the key to hand to the client (once)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    salt = secrets.token_bytes(_SALT_BYTES)
    record = ApiKey(key_id, tenant, role, salt.hex(), _hash(secret, salt, PBKDF2_ITERATIONS).hex())
    return record, f"{KEY_PREFIX}_{key_id}_{secret}"


def append_key(path: Path, record: ApiKey) -> None:
    """Adds a line to the keys file, creating it 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as out:
        out.write(json.dumps(asdict(record), sort_keys=True) + "\n")


def load_keys(path: Path) -> list[ApiKey]:
    """The keys of a keys file; raises ValueError naming the line of a bad one."""
    keys = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            keys.append(ApiKey(**json.loads(line)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a key line: {exc}") from None
    return keys


class KeyRing:
    """The keys a server accepts; `verify` answers the key's line or None."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_id = {key.id: key for key in keys}
        self._verified: dict[bytes, ApiKey] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str) -> KeyRing:
        return cls(load_keys(Path(path)))

    def __len__(self) -> int:
        return len(self._by_id)

    def verify(self, token: str) -> ApiKey | None:
        memo = hashlib.sha256(token.encode()).digest()
        with self._lock:
            known = self._verified.get(memo)
        if known is not None:
            return known
        prefix, _, rest = token.partition("_")
        key_id, _, secret = rest.partition("_")
        record = self._by_id.get(key_id)
        if prefix != KEY_PREFIX or record is None or not secret or not record.matches(secret):
            return None
        with self._lock:
            self._verified[memo] = record
        return record


def bearer_token(header: str) -> str:
    """The key of an ``authorization`` value ``Bearer <key>``; "" when there is none."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
