"""DHT record rules: sizes, expirations, owner-bound subkeys and signatures."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import msgpack
import pytest

from protocol import (
    DHTID,
    MAX_CLOCK_SKEW,
    MAX_ENTRIES_PER_STORE,
    MAX_KEY_BYTES,
    MAX_SUBKEY_BYTES,
    MAX_SUBKEYS_PER_KEY,
    MAX_TTL,
    MAX_VALUE_BYTES,
    Entry,
    Identity,
    PeerID,
    ProtocolError,
    RecordError,
    RecordTooLargeError,
    RemoteProtocolError,
    check_key,
    key_owner,
    owned_key,
    owner_of,
    sign_entry,
    signing_bytes,
    validate_entry,
)
from protocol.messages import MAX_SUBKEY_ORDER_BYTES
from protocol.records import decode_value, subkey_order

NOW = 1_700_000_000.0
ALICE = Identity.from_seed(b"\x01" * 32)
BOB = Identity.from_seed(b"\x02" * 32)
KEY = DHTID.from_key("run/peers")
VALUE = msgpack.packb({"addr": "10.0.0.1:4000"})


def test_limits() -> None:
    assert (MAX_KEY_BYTES, MAX_SUBKEY_BYTES, MAX_VALUE_BYTES) == (512, 128, 16384)
    assert (MAX_ENTRIES_PER_STORE, MAX_SUBKEYS_PER_KEY, MAX_TTL) == (64, 1024, 86400 * 7)
    assert MAX_CLOCK_SKEW > 0


def test_errors_are_protocol_errors() -> None:
    assert issubclass(RecordError, ProtocolError)
    assert issubclass(RecordTooLargeError, RecordError)
    assert issubclass(RecordTooLargeError, ValueError)


def test_an_enum_key_or_subkey_is_refused_with_the_plain_value_to_pass() -> None:
    """A key or subkey of a str or int subclass would read back as the plain value (msgpack
    knows no enums): it is refused, and the error now names the value to pass."""
    import enum

    from protocol.records import check_subkey

    class Key(enum.StrEnum):
        LR = "lr"

    class Rank(enum.IntEnum):
        FIRST = 3

    with pytest.raises(
        RecordError, match=r"not Key \(a subclass of str: pass the plain value, 'lr'\)"
    ):
        check_key(Key.LR)  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=r"not Rank \(a subclass of int: .*value, 3\)"):
        check_subkey(Rank.FIRST)
    with pytest.raises(RecordError, match=r"not bool$"):  # (no hint: True is no int here)
        check_subkey(True)


def test_a_peer_id_as_a_subkey_is_refused_with_its_text_to_pass() -> None:
    from protocol.records import check_subkey

    with pytest.raises(RecordError, match=rf"not PeerID \(.*pass '{ALICE.peer_id}'\)$"):
        check_subkey(ALICE.peer_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [b"run1/config", 42, 1.5, None])
def test_a_key_of_another_type_is_refused_without_a_subclass_hint(key: object) -> None:
    """``b"k"`` and ``42`` are wrong as bytes and int: the error once called them
    subclasses and told the user to pass the value they had passed (a tester)."""
    import enum

    class Rank(enum.IntEnum):
        FIRST = 3

    for wrong in (key, Rank.FIRST):
        with pytest.raises(RecordError, match=rf"^a DHT key is a str, not {type(wrong).__name__}$"):
            check_key(wrong)  # type: ignore[arg-type]


# --- owner-bound subkeys ---


def test_owner_of() -> None:
    peer_id = ALICE.peer_id
    assert owner_of(str(peer_id)) == peer_id
    assert owner_of(peer_id.raw) is None  # bytes are never owner-bound
    assert owner_of(None) is None
    assert owner_of(42) is None
    assert owner_of("plain") is None
    assert owner_of(str(peer_id)[:-1]) is None  # decodes to fewer than 32 bytes
    assert owner_of("1" + str(peer_id)) is None  # 33 bytes
    assert owner_of(str(peer_id) + "\n") is None


def test_owned_keys() -> None:
    key = owned_key("run1/state", ALICE.peer_id)
    assert key == f"run1/state[owner:{ALICE.peer_id}]"
    assert key_owner(key) == ALICE.peer_id
    assert key_owner("run1/state") is None
    assert key_owner(f"run1/state[owner:{ALICE.peer_id}] ") is None  # must end the key
    assert key_owner(f"run1/state[owner:{ALICE.peer_id}") is None  # not closed
    assert key_owner(f"run1/state[owner:{ALICE.peer_id})") is None  # closed by another char
    assert key_owner(f"run1/state[owner:{str(ALICE.peer_id)[:-1]}]") is None
    assert key_owner("[owner:]") is None
    assert key_owner(f"[owner:x][owner:{BOB.peer_id}]") == BOB.peer_id  # the last mark
    assert owned_key("run1/state", str(ALICE.peer_id)) == key  # its base58 text


@pytest.mark.parametrize(
    ("owner", "error"),
    [
        (ALICE.peer_id.raw, TypeError),  # the raw bytes: a key nobody owns, open to all
        (None, TypeError),
        ("not-a-peer-id", ValueError),
        (str(ALICE.peer_id)[:-1], ValueError),  # a mistyped id
    ],
)
def test_an_owned_key_for_something_that_is_no_peer_id_is_refused(
    owner: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="owned_key"):
        owned_key("run1/state", owner)  # type: ignore[arg-type]


def test_owned_key_entries_must_be_signed_by_the_owner() -> None:
    key_id = DHTID.from_key(owned_key("run1/state", ALICE.peer_id))
    owner = ALICE.peer_id
    for subkey in (None, "any", 7):
        entry = sign_entry(ALICE, key_id, subkey, VALUE, NOW + 60, key_owner=owner)
        validate_entry(key_id, entry, now=NOW, key_owner=owner)
        with pytest.raises(RecordError, match="unsigned"):
            validate_entry(key_id, Entry(subkey, VALUE, NOW + 60), now=NOW, key_owner=owner)
        by_bob = sign_entry(BOB, key_id, subkey, VALUE, NOW + 60)
        with pytest.raises(RecordError, match="not by the entry's signer"):
            validate_entry(key_id, by_bob, now=NOW, key_owner=owner)
    with pytest.raises(RecordError, match="key is owned by"):
        sign_entry(BOB, key_id, None, VALUE, NOW + 60, key_owner=owner)


# --- signing bytes ---


def test_signing_bytes_layout() -> None:
    data = signing_bytes(KEY, "sub", b"val", 1.5)
    expected = b"swarm-record/1:" + b"\x94\xc4\x20" + KEY.to_raw()
    expected += b"\xa3sub" + b"\xc4\x03val" + b"\xcb" + bytes.fromhex("3ff8000000000000")
    assert data == expected


def test_documented_signing_bytes() -> None:
    """The example in docs/protocol.md."""
    assert signing_bytes(KEY, "sub", b"val", 1.5).hex() == (
        "737761726d2d7265636f72642f313a94c420"
        "c0bab53d967b86c38cc67486ead1c2fd3455d774ea10d1b56a52dc30686fdf0c"
        "a3737562c40376616ccb3ff8000000000000"
    )


def test_signing_bytes_distinguish_types_and_normalize_expiration() -> None:
    assert signing_bytes(KEY, "a", b"", 2.0) != signing_bytes(KEY, b"a", b"", 2.0)
    assert signing_bytes(KEY, 1, b"", 2.0) != signing_bytes(KEY, "1", b"", 2.0)
    assert signing_bytes(KEY, None, b"", 2) == signing_bytes(KEY, None, b"", 2.0)
    assert signing_bytes(KEY, None, b"", 2.0).startswith(b"swarm-record/1:")


@pytest.mark.parametrize(
    ("key", "subkey", "value", "expiration"),
    [
        (123, None, b"", 1.0),
        (KEY, True, b"", 1.0),
        (KEY, 1.5, b"", 1.0),
        (KEY, None, "text", 1.0),
        (KEY, None, b"", "1"),
        (KEY, None, b"", True),
    ],
)
def test_signing_bytes_type_checks(
    key: object, subkey: object, value: object, expiration: object
) -> None:
    with pytest.raises(RecordError):
        signing_bytes(key, subkey, value, expiration)  # type: ignore[arg-type]


# --- entries ---


def test_entry_body_round_trip() -> None:
    plain = Entry(b"\x00sub", VALUE, NOW + 10)
    assert plain.to_body() == {"s": b"\x00sub", "v": VALUE, "x": NOW + 10}
    assert Entry.from_body(plain.to_body()) == plain and not plain.is_signed
    signed = sign_entry(ALICE, KEY, str(ALICE.peer_id), VALUE, NOW + 10)
    assert set(signed.to_body()) == {"s", "v", "x", "o", "g"}
    assert Entry.from_body(signed.to_body()) == signed and signed.is_signed


def test_int_expiration_becomes_float() -> None:
    entry = Entry(None, b"", 5)
    assert entry.expiration == 5.0 and type(entry.expiration) is float


@pytest.mark.parametrize(
    "kwargs",
    [
        {"subkey": "x" * (MAX_SUBKEY_BYTES + 1)},
        {"subkey": "é" * (MAX_SUBKEY_BYTES // 2 + 1)},  # counted in UTF-8 bytes
        {"subkey": b"x" * (MAX_SUBKEY_BYTES + 1)},
        {"subkey": 1 << 64},
        {"subkey": -(1 << 63) - 1},
        {"value": b"x" * (MAX_VALUE_BYTES + 1)},
    ],
)
def test_entry_too_large(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"subkey": None, "value": b"", "expiration": NOW, **kwargs}
    with pytest.raises(RecordTooLargeError):
        Entry(**fields)  # type: ignore[arg-type]


def test_entry_limits_are_inclusive() -> None:
    Entry("x" * MAX_SUBKEY_BYTES, b"x" * MAX_VALUE_BYTES, NOW)
    Entry((1 << 64) - 1, b"", NOW)
    Entry(-(1 << 63), b"", NOW)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"subkey": True},
        {"subkey": 1.0},
        {"subkey": ("a",)},
        {"subkey": "\ud800"},  # lone surrogate
        {"value": "text"},
        {"value": bytearray(b"x")},
        {"expiration": float("nan")},
        {"expiration": float("inf")},
        {"expiration": True},
        {"expiration": "1"},
        {"owner_key": b"k" * 32},
        {"signature": b"s" * 64},
        {"owner_key": b"k" * 31, "signature": b"s" * 64},
        {"owner_key": b"k" * 32, "signature": b"s" * 63},
        {"owner_key": "k" * 32, "signature": b"s" * 64},
    ],
)
def test_entry_bad_fields(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"subkey": None, "value": b"", "expiration": NOW, **kwargs}
    with pytest.raises(RecordError):
        Entry(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body",
    [
        {"s": None, "v": b""},
        {"s": None, "v": b"", "x": 1.0, "z": 1},
        {"s": None, "v": b"", "x": 1.0, "o": None, "g": None},
        {"s": None, "v": b"", "x": 1.0, "o": b"k" * 32},
        {"s": None, "v": "x", "x": 1.0},
        [None, b"", 1.0],
        {"s": None, "v": b"", "x": 1.0, b"s": None, 2: 3},  # keys of mixed types
    ],
)
def test_entry_from_bad_body(body: object) -> None:
    with pytest.raises(RemoteProtocolError):
        Entry.from_body(body)


# --- validation ---


def test_signed_owner_bound_entry_is_valid() -> None:
    entry = sign_entry(ALICE, KEY, str(ALICE.peer_id), VALUE, NOW + 60)
    assert entry.owner_key == ALICE.public_key
    assert PeerID.from_public_key(entry.owner_key) == ALICE.peer_id
    validate_entry(KEY, entry, now=NOW)


def test_plain_entries_need_no_signature_but_a_present_one_must_verify() -> None:
    validate_entry(KEY, Entry("free", VALUE, NOW + 60), now=NOW)
    signed = sign_entry(BOB, KEY, "free", VALUE, NOW + 60)
    validate_entry(KEY, signed, now=NOW)
    with pytest.raises(RecordError, match="signature"):
        validate_entry(KEY, replace(signed, value=b"other"), now=NOW)


def test_owner_bound_entry_without_signature() -> None:
    with pytest.raises(RecordError, match="unsigned"):
        validate_entry(KEY, Entry(str(ALICE.peer_id), VALUE, NOW + 60), now=NOW)


def test_owner_bound_entry_signed_by_another_peer() -> None:
    forged = sign_entry(BOB, KEY, "placeholder", VALUE, NOW + 60)
    forged = replace(forged, subkey=str(ALICE.peer_id))
    with pytest.raises(RecordError, match="another peer"):
        validate_entry(KEY, forged, now=NOW)
    with pytest.raises(RecordError, match="owned by"):
        sign_entry(BOB, KEY, str(ALICE.peer_id), VALUE, NOW + 60)


@pytest.mark.parametrize(
    "change",
    [
        {"value": b"tampered"},
        {"expiration": NOW + 61},
        {"signature": b"\x00" * 64},
    ],
)
def test_tampered_owner_bound_entry(change: dict[str, object]) -> None:
    entry = sign_entry(ALICE, KEY, str(ALICE.peer_id), VALUE, NOW + 60)
    with pytest.raises(RecordError, match="signature"):
        validate_entry(KEY, replace(entry, **change), now=NOW)  # type: ignore[arg-type]


def test_signature_is_bound_to_the_key() -> None:
    entry = sign_entry(ALICE, KEY, str(ALICE.peer_id), VALUE, NOW + 60)
    with pytest.raises(RecordError, match="signature"):
        validate_entry(DHTID.from_key("run/other"), entry, now=NOW)


def test_expiration_window() -> None:
    with pytest.raises(RecordError, match="expired"):
        validate_entry(KEY, Entry(None, b"\xc0", NOW), now=NOW)
    with pytest.raises(RecordError, match="expired"):
        validate_entry(KEY, Entry(None, b"\xc0", NOW - 1), now=NOW)
    validate_entry(KEY, Entry(None, b"\xc0", math.nextafter(NOW, math.inf)), now=NOW)
    furthest = NOW + MAX_TTL + MAX_CLOCK_SKEW
    validate_entry(KEY, Entry(None, b"\xc0", furthest), now=NOW)
    with pytest.raises(RecordError, match="MAX_TTL"):
        validate_entry(KEY, Entry(None, b"\xc0", furthest + 1), now=NOW)


def test_validate_rechecks_a_bypassed_entry() -> None:
    entry = Entry(None, b"\xc0", NOW + 1)
    object.__setattr__(entry, "value", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(RecordTooLargeError):
        validate_entry(KEY, entry, now=NOW)
    with pytest.raises(RecordError):
        validate_entry(KEY, "not an entry", now=NOW)  # type: ignore[arg-type]


# --- keys ---


def test_check_key() -> None:
    assert check_key("run/peers") == KEY
    assert check_key("") == int.from_bytes(hashlib.sha256(b"").digest(), "big")
    check_key("é" * (MAX_KEY_BYTES // 2))
    with pytest.raises(RecordTooLargeError):
        check_key("é" * (MAX_KEY_BYTES // 2) + "x")
    with pytest.raises(ValueError):
        check_key("k" * (MAX_KEY_BYTES + 1))
    with pytest.raises(RecordError):
        check_key("\udc00")
    with pytest.raises(RecordError):
        check_key(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        msgpack.packb(msgpack.ExtType(3, b"x")),
        msgpack.packb({"at": [msgpack.Timestamp(1, 0)]}),
        msgpack.packb({"at": msgpack.Timestamp(1, 0)}),
        msgpack.packb({msgpack.Timestamp(1, 0): "at"}),  # a timestamp as a map key
        msgpack.packb([{"a": {msgpack.Timestamp(1, 0): 1}}]),
        b"\x92\x01",  # truncated
        b"\x01\x02",  # two objects
        b"\x81\x91\x01\x02",  # a list as a map key
    ],
)
def test_values_that_do_not_read_back_are_refused(value: bytes) -> None:
    with pytest.raises(ValueError):
        decode_value(value)
    with pytest.raises(RecordError, match="not a DHT value"):
        validate_entry(KEY, Entry(None, value, NOW + 1), now=NOW)


def test_decode_value_reads_plain_values() -> None:
    value = {"a": [1, 2.5, None, True, b"\xff\xff", "x" * 300], 255: {"b": -1}}
    assert decode_value(msgpack.packb(value, use_bin_type=True)) == value


def test_a_value_nests_at_most_1024_containers_deep() -> None:
    """The limit protocol.md section 6 states (msgpack's unpacker stack): 1024 nested
    arrays or maps are stored, 1025 are refused (an outside tester found no limit stated)."""
    for container in (b"\x91", b"\x81\x00"):  # [x], {0: x}
        deepest = container * 1023 + b"\x90"  # the innermost one empty: 1024 deep
        validate_entry(KEY, Entry(None, deepest, NOW + 1), now=NOW)
        with pytest.raises(RecordError, match="not a DHT value"):
            validate_entry(KEY, Entry(None, container + deepest, NOW + 1), now=NOW)


def test_subkey_order_is_a_total_order_over_every_subkey_type() -> None:
    subkeys = [None, "a", "b", str(ALICE.peer_id), b"a", 0, -1, 2**64 - 1, -(2**63)]
    orders = [subkey_order(s) for s in subkeys]
    assert len(set(orders)) == len(subkeys)
    assert all(len(o) <= MAX_SUBKEY_ORDER_BYTES for o in orders)
    assert len(subkey_order("x" * MAX_SUBKEY_BYTES)) <= MAX_SUBKEY_ORDER_BYTES
