"""StoreConfig's start-up refusals and the MAC keyring file format."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import StoreConfig
from store.mac_keyring import LOOPBACK_KEYRING, parse_keyring


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "redis://localhost:1/0", "redis://[::1]:1/0", "unix:///r.sock"],
)
def test_plaintext_on_loopback_starts(url: str) -> None:
    StoreConfig(url=url).check_exposure()


def test_plaintext_off_loopback_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--insecure-redis"):
        StoreConfig(url="redis://10.0.0.2:6379/0").check_exposure()
    # the operator's say-so lifts the TLS refusal, not the keyring one
    with pytest.raises(ValueError, match="--kv-mac-key-file"):
        StoreConfig(url="redis://10.0.0.2:6379/0", insecure=True).check_exposure()
    StoreConfig(url="redis://10.0.0.2:6379/0", insecure=True, mac_key_file="k").check_exposure()


def test_tls_off_loopback_still_needs_a_keyring() -> None:
    with pytest.raises(ValueError, match="--kv-mac-key-file"):
        StoreConfig(url="rediss://redis.internal:6380/0").check_exposure()
    StoreConfig(url="rediss://redis.internal:6380/0", mac_key_file="k").check_exposure()


def test_tls_files_need_rediss_and_go_in_pairs() -> None:
    with pytest.raises(ValueError, match="rediss://"):
        StoreConfig(url="redis://127.0.0.1:1/0", tls_ca_file="ca.pem")
    with pytest.raises(ValueError, match="go together"):
        StoreConfig(url="rediss://127.0.0.1:1/0", tls_cert_file="c.pem")


def test_keyring_lines_last_signs_all_verify(tmp_path: Path) -> None:
    old, new = "11" * 32, "22" * 32
    keyring = parse_keyring(f"# rotated 2026-12-01\n1:{old}\n2:{new}\n")
    assert keyring.current_id == 2 and set(keyring.keys) == {1, 2}
    key_id, mac = parse_keyring(f"1:{old}\n").sign([b"data"])
    assert key_id == 1 and keyring.verify(1, mac, [b"da", b"ta"])
    assert not keyring.verify(1, mac, [b"datA"])
    assert not keyring.verify(3, mac, [b"data"])
    assert not LOOPBACK_KEYRING.verify(1, mac, [b"data"])


def test_keyring_json_and_bad_files() -> None:
    keyring = parse_keyring('{"current": 7, "keys": {"7": "' + "ab" * 16 + '"}}')
    assert keyring.current_id == 7
    with pytest.raises(ValueError, match="no MAC key"):
        parse_keyring("# empty\n", "k.txt")
    with pytest.raises(ValueError, match="shorter than"):
        parse_keyring("1:abcd\n")
    with pytest.raises(ValueError, match="not a MAC keyring"):
        parse_keyring("1:not-hex\n")
