"""Ed25519 keys and signature halves of small order: with the identity point as the key,
R the identity and S = 0, a signature verified for every message, so anyone could claim
that key's PeerID (its handshake proof) and write its owned DHT records (a security
review). The blocklist is checked here against the curve itself (RFC 8032's arithmetic)."""

from __future__ import annotations

import pytest

from protocol.dhtid import DHTID
from protocol.identity import (
    SMALL_ORDER_POINTS,
    Identity,
    PeerID,
    has_small_order,
    verify_signature,
)
from protocol.records import Entry, RecordError, owned_key, validate_entry

P = 2**255 - 19
D = -121665 * pow(121666, P - 2, P) % P
SQRT_M1 = pow(2, (P - 1) // 4, P)
Point = tuple[int, int, int, int]


def _decode(encoding: bytes) -> Point | None:
    """The point of an encoding, read as a lenient verifier does (y taken modulo p)."""
    y = int.from_bytes(encoding, "little")
    sign, y = y >> 255, (y & ((1 << 255) - 1)) % P
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * SQRT_M1 % P
    if (x * x - x2) % P:
        return None
    if x & 1 != sign:
        x = (P - x) % P
    return (x, y, 1, x * y % P)


def _add(a: Point, b: Point) -> Point:
    e = (a[1] - a[0]) * (b[1] - b[0]) % P
    f = (a[1] + a[0]) * (b[1] + b[0]) % P
    c = 2 * a[3] * b[3] * D % P
    dd = 2 * a[2] * b[2] % P
    e, f, g, h = f - e, dd - c, dd + c, f + e  # RFC 8032's E, F, G, H
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def _times_8_is_identity(point: Point) -> bool:
    for _ in range(3):
        point = _add(point, point)
    return point[0] % P == 0 and (point[1] - point[2]) % P == 0


@pytest.mark.parametrize("encoding", sorted(SMALL_ORDER_POINTS))
def test_each_listed_encoding_is_a_point_of_small_order(encoding: bytes) -> None:
    for sign in (0, 0x80):
        point = _decode(encoding[:31] + bytes([encoding[31] | sign]))
        if point is not None:  # (x = 0 with the sign bit set names no point)
            assert _times_8_is_identity(point)


def test_real_keys_are_not_of_small_order() -> None:
    for seed in range(50):
        key = Identity.from_seed(bytes([seed]) * 32).public_key
        point = _decode(key)
        assert point is not None and not _times_8_is_identity(point)
        assert not has_small_order(key)


@pytest.mark.parametrize("encoding", sorted(SMALL_ORDER_POINTS))
def test_a_small_order_key_verifies_nothing(encoding: bytes) -> None:
    """Before: the identity key with R = identity, S = 0 verified any message."""
    for key in (encoding, encoding[:31] + bytes([encoding[31] | 0x80])):
        for r in SMALL_ORDER_POINTS:
            assert not verify_signature(key, r + bytes(32), b"any message")


def test_a_small_order_r_is_refused_with_a_real_key() -> None:
    identity = Identity.from_seed(b"r" * 32)
    good = identity.sign(b"m")
    assert verify_signature(identity.public_key, good, b"m")
    for r in SMALL_ORDER_POINTS:
        assert not verify_signature(identity.public_key, r + good[32:], b"m")


def test_an_owned_record_cannot_be_written_with_a_keyless_identity() -> None:
    """The review's forged record: owner key the identity point, signature R = identity
    and S = 0, under the owned key of that key's PeerID."""
    key = b"\x01" + bytes(31)
    owner = PeerID.from_public_key(key)
    dht_key = DHTID.from_key(owned_key("model-release", owner))
    forged = Entry(None, b"\xa4evil", 1_900_000_100.0, key, b"\x01" + bytes(63))
    with pytest.raises(RecordError, match="signature"):
        validate_entry(dht_key, forged, now=1_900_000_000.0, key_owner=owner)
