"""Identities, base58, addresses, DHT ids, key files, and the package's import hygiene."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from protocol import (
    DHTID,
    Address,
    Identity,
    IdentityFileError,
    PeerID,
    ProtocolError,
    b58decode,
    b58encode,
    verify_signature,
)

SEED = bytes(range(32))
FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None)


# --- identity ---


def test_identity_from_seed_is_deterministic() -> None:
    a, b = Identity.from_seed(SEED), Identity.from_seed(SEED)
    assert a.public_key == b.public_key and len(a.public_key) == 32
    assert a.peer_id == b.peer_id
    assert a.peer_id.raw == hashlib.sha256(a.public_key).digest()
    assert a.seed() == SEED
    assert Identity.generate().peer_id != a.peer_id


def test_documented_peer_id() -> None:
    """The example in docs/protocol.md: the all-zero seed."""
    identity = Identity.from_seed(bytes(32))
    assert identity.public_key.hex() == (
        "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29"
    )
    assert str(identity.peer_id) == "2KagShR4Usj2uARXJeDw7XJEKvQ3XDr84dC47hUB3Uyd"


def test_sign_and_verify() -> None:
    identity = Identity.from_seed(SEED)
    signature = identity.sign(b"data")
    assert len(signature) == 64
    assert verify_signature(identity.public_key, signature, b"data")
    assert not verify_signature(identity.public_key, signature, b"datA")
    assert not verify_signature(Identity.generate().public_key, signature, b"data")
    assert not verify_signature(identity.public_key[:31], signature, b"data")
    assert not verify_signature(identity.public_key, signature[:63], b"data")
    assert not verify_signature(b"\xff" * 32, signature, b"data")


def test_peer_id_base58_round_trip() -> None:
    peer_id = Identity.from_seed(SEED).peer_id
    text = peer_id.to_base58()
    assert str(peer_id) == text and 43 <= len(text) <= 44
    assert PeerID.from_base58(text) == peer_id
    assert repr(peer_id) == f"PeerID({text})"
    assert peer_id.short() == text[:8]


@pytest.mark.parametrize("raw", [b"", b"\x01" * 31, b"\x01" * 33, "x" * 32, bytearray(32)])
def test_peer_id_needs_32_bytes(raw: object) -> None:
    with pytest.raises(ProtocolError):
        PeerID(raw)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "1", "0OIl", "1" * 33, "z" * 200, "abc\n"])
def test_peer_id_from_bad_base58(text: str) -> None:
    with pytest.raises(ProtocolError):
        PeerID.from_base58(text)


def test_public_key_length_is_checked() -> None:
    with pytest.raises(ProtocolError):
        PeerID.from_public_key(b"\x00" * 31)


# --- base58 ---


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"", ""),
        (b"\x00", "1"),
        (b"\x00\x00\x01", "112"),
        (b"hello world", "StV1DL6CwTryKyV"),
        # the Bitcoin wiki's version-1 address example: leading zero byte -> leading "1"
        (
            bytes.fromhex("00010966776006953D5567439E5E39F86A0D273BEED61967F6"),
            "16UwLL9Risc3QfPqBUvKofHmBQ7wMtjvM",
        ),
    ],
)
def test_base58_vectors(data: bytes, text: str) -> None:
    assert b58encode(data) == text
    assert b58decode(text) == data


@FAST
@given(st.binary(max_size=64))
def test_base58_round_trip(data: bytes) -> None:
    assert b58decode(b58encode(data)) == data


@pytest.mark.parametrize("text", ["0", "O", "I", "l", "+", "é", "1" * 129])
def test_base58_rejects(text: str) -> None:
    with pytest.raises(ProtocolError):
        b58decode(text)


def test_base58_rejects_non_str() -> None:
    with pytest.raises(ProtocolError):
        b58decode(b"abc")  # type: ignore[arg-type]


# --- addresses ---


def test_address_forms() -> None:
    peer_id = Identity.from_seed(SEED).peer_id
    assert Address.parse("example.org:4000") == Address("example.org", 4000)
    assert Address.parse("10.0.0.1:1") == Address("10.0.0.1", 1)
    full = Address.parse(f"{peer_id}@10.0.0.1:4000")
    assert full == Address("10.0.0.1", 4000, peer_id)
    assert str(full) == f"{peer_id}@10.0.0.1:4000"
    assert full.hostport == "10.0.0.1:4000"
    assert full.with_peer_id(None) == Address("10.0.0.1", 4000)


def test_address_ipv6_brackets() -> None:
    peer_id = Identity.from_seed(SEED).peer_id
    address = Address.parse("[::1]:4000")
    assert address.host == "::1" and address.port == 4000
    assert address.hostport == "[::1]:4000" and str(address) == "[::1]:4000"
    full = Address.parse(f"{peer_id}@[2001:db8::7]:65535")
    assert (full.host, full.port, full.peer_id) == ("2001:db8::7", 65535, peer_id)
    assert str(full) == f"{peer_id}@[2001:db8::7]:65535"
    assert Address.parse(str(full)) == full


@pytest.mark.parametrize(
    "text",
    [
        "",
        "host",
        "host:",
        ":80",
        "host:abc",
        "host:-1",
        "host:+1",
        "host:65536",
        "::1:80",  # IPv6 needs brackets
        "[::1]80",
        "[::1]",
        "[]:80",
        "[::1]:80:",
        "@host:1",
        "notapeerid@host:1",
        "x" * 301,
    ],
)
def test_address_rejects(text: str) -> None:
    with pytest.raises(ProtocolError):
        Address.parse(text)


@pytest.mark.parametrize("text", ["host:\u00b2", "host:\u0663"])
def test_address_rejects_non_ascii_port_digits(text: str) -> None:
    """str.isdigit() accepts superscripts and Arabic-Indic digits; a port is ASCII."""
    with pytest.raises(ProtocolError):
        Address.parse(text)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "10.0.0.1", "192.168.1.7", "::1", "fe80::1", "2001:db8::7", "example.org"],
)
def test_loopback_private_and_named_hosts_are_dialable(host: str) -> None:
    assert Address(host, 4000).dialable


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "255.255.255.255",
        "224.0.0.1",
        "239.255.255.250",
        "ff02::1",
        "::ffff:0.0.0.0",  # IPv4-mapped
        "::ffff:224.0.0.1",
        "0",  # what resolvers read as an IPv4 address: 0.0.0.0
        "0x0",
        "4294967295",  # 255.255.255.255
        "0xe0000001",  # 224.0.0.1
        "127.1",  # not a dotted quad: refused whatever it names
    ],
)
def test_unspecified_multicast_and_broadcast_hosts_are_not_dialable(host: str) -> None:
    assert not Address(host, 4000).dialable


def test_address_checks_fields() -> None:
    with pytest.raises(ProtocolError):
        Address("", 1)
    with pytest.raises(ProtocolError):
        Address("h", 70000)


# --- DHT ids ---


def test_dhtid_from_key_is_sha256_of_utf8() -> None:
    key = "run/peers/é"
    expected = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "big")
    assert DHTID.from_key(key) == expected
    assert DHTID.from_key(key).to_raw() == hashlib.sha256(key.encode()).digest()


def test_dhtid_from_peer_id_and_raw() -> None:
    peer_id = Identity.from_seed(SEED).peer_id
    dht_id = DHTID.from_peer_id(peer_id)
    assert dht_id.to_raw() == peer_id.raw
    assert DHTID.from_bytes_exact(peer_id.raw) == dht_id
    for bad in (b"\x00" * 31, b"\x00" * 33, "x" * 32):
        with pytest.raises(ProtocolError):
            DHTID.from_bytes_exact(bad)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        DHTID(1 << 256)
    with pytest.raises(ProtocolError):
        DHTID(-1)


@FAST
@given(st.integers(0, (1 << 256) - 1), st.integers(0, (1 << 256) - 1))
def test_dhtid_xor_distance(a: int, b: int) -> None:
    x, y = DHTID(a), DHTID(b)
    assert x.distance(y) == y.distance(x) == a ^ b
    assert x.distance(x) == 0
    assert x.bucket_index(y) == (a ^ b).bit_length() - 1
    assert DHTID.from_bytes_exact(x.to_raw()) == x


def test_bucket_index_edges() -> None:
    zero = DHTID(0)
    assert zero.bucket_index(zero) == -1
    assert zero.bucket_index(1) == 0
    assert zero.bucket_index(1 << 255) == 255


# --- key files ---


def test_key_file_is_created_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    created = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == created.seed()
    assert Identity.load_or_create(path).peer_id == created.peer_id
    assert Identity.load(path).peer_id == created.peer_id
    assert not (tmp_path / "identity.key.tmp").exists()


def test_save_keeps_mode_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        Identity.from_seed(SEED).save(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600


@pytest.mark.parametrize("content", [b"", b"\x00" * 31, b"\x00" * 64])
def test_bad_key_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityFileError):
        Identity.load_or_create(path)


# --- the package ---


def test_import_protocol_loads_no_trio_torch_or_sockets() -> None:
    code = (
        "import sys, protocol\n"
        "assert 'trio' not in sys.modules, 'trio'\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "bad = [m for m in ('socket', 'ssl', 'asyncio', 'selectors') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_public_surface_is_pinned() -> None:
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None, name
    assert len(set(protocol.__all__)) == len(protocol.__all__)
    assert {
        "RpcFrame",
        "FrameKind",
        "encode_rpc_frame",
        "decode_rpc_frame",
        "PingRequest",
        "StoreRequest",
        "METHODS",
        "Entry",
        "validate_entry",
        "sign_entry",
        "PeerID",
        "Identity",
        "Address",
        "DHTID",
        "FrameDecoder",
        "ProtocolError",
    } <= set(protocol.__all__)
    public = {n for n in vars(protocol) if not n.startswith("_")}
    modules = {"address", "base58", "dhtid", "errors", "framing", "identity"}
    modules |= {"messages", "records", "rpc", "annotations"}
    assert public - modules == set(protocol.__all__)
    assert {"noise", "codecs"} <= set(protocol.__all__)
    assert callable(protocol.noise.NoiseHandshake) and callable(protocol.codecs.get_codec)
