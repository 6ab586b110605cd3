"""Fuzzing every wire decoder: random and mutated inputs may only raise ProtocolError.

Two sources of input, over 100,000 in all (the budget is pinned below):
- a seeded mutation loop over valid encodings (bit flips, truncation, insertion,
  byte overwrite with msgpack-significant values, slice duplication), plus structural
  mutations of valid bodies (a field replaced, dropped or added);
- hypothesis, for random bytes, random msgpack values and random text.

Anything but a ``ProtocolError`` escaping a decoder fails the test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    DHTID,
    MESSAGE_TYPES,
    NEED_DATA,
    Address,
    Entry,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    FrameDecoder,
    FrameKind,
    Identity,
    Message,
    NodeInfo,
    PeerID,
    PingRequest,
    PingResponse,
    ProtocolError,
    RpcFrame,
    StoreRequest,
    StoreResponse,
    decode_message,
    decode_rpc_frame,
    encode_rpc_frame,
    sign_entry,
    validate_entry,
)

N_RPC = 100_000
N_STREAMS = 20_000
N_ADDRESSES = 15_000
N_PEER_IDS = 15_000
N_BODIES = 15_000
N_ENTRIES = 10_000
HYPOTHESIS = settings(max_examples=150, deadline=None, derandomize=True, database=None)
# Random nested msgpack values are slow to generate; the mutation loops carry the volume.
HYPOTHESIS_NESTED = settings(HYPOTHESIS, max_examples=60)

NOW = 1_700_000_000.0
ALICE = Identity.from_seed(b"\x07" * 32)
KEY = DHTID.from_key("run/peers")
NODE = NodeInfo(ALICE.peer_id, "10.1.2.3:4000")
PLAIN = Entry(7, msgpack.packb([1, 2.5, "x"]), NOW + 100)
SIGNED = sign_entry(ALICE, KEY, str(ALICE.peer_id), msgpack.packb({"a": 1}), NOW + 100)
MESSAGES: list[Message] = [
    PingRequest("10.1.2.3:4000"),
    PingResponse(),
    FindNodeRequest("[::1]:9", KEY),
    FindNodeResponse((NODE, NodeInfo(ALICE.peer_id, None))),
    FindValueRequest(None, KEY),
    FindValueResponse((PLAIN, SIGNED), (NODE,)),
    FindValueResponse(None, ()),
    StoreRequest("h.example:1", KEY, "run/peers", (SIGNED, PLAIN, Entry(b"\x00", b"", NOW + 1))),
    StoreResponse((True, False, True)),
]
FRAMES = [
    RpcFrame(FrameKind.REQUEST, 3, method="dht.x", body=m.to_body(), timeout=2.5) for m in MESSAGES
] + [
    RpcFrame(FrameKind.RESPONSE, 2**32 - 1, body={"k": [1, {"n": None}]}, payload=b"\x01" * 9),
    RpcFrame(FrameKind.ITEM, 5, body={}, payload=b"abc"),
    RpcFrame(FrameKind.END, 5),
    RpcFrame(FrameKind.ERROR, 5, error_code="busy", error_message="try later"),
    RpcFrame(FrameKind.CANCEL, 0),
    RpcFrame(FrameKind.BYE, 0),
]
WIRE = [b"".join(bytes(p) for p in encode_rpc_frame(f)) for f in FRAMES]
CONTENTS = [w[4:] for w in WIRE]
ADDRESSES = [
    "10.0.0.1:4000",
    "[::1]:65535",
    "[2001:db8::7]:1",
    "host.example:80",
    f"{ALICE.peer_id}@10.0.0.1:4000",
    f"{ALICE.peer_id}@[::1]:9",
]
PEER_ID_TEXTS = [str(ALICE.peer_id), str(PeerID(b"\x00" * 32)), str(PeerID(b"\xff" * 32))]
INTERESTING = (
    b"\x00\x01\x7f\x80\xff\x90\xa0\xc0\xc1\xc2\xc3\xc4\xca\xcb\xcf\xd3\xd4\xd9\xdc\xdd\xde\xdf"
)
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1 << 63, (1 << 64) - 1, 1.5, math.nan, -math.inf,
    "", "x" * 300, "\udcff", "1.2.3.4:5", b"", b"\x00" * 32, b"\x01" * 64, b"x" * 20_000,
    (), [], {}, (None,), {"x": 1}, {1: 2}, NODE.to_body(), PLAIN.to_body(), SIGNED.to_body(),
    (NODE.to_body(),) * 65, (PLAIN.to_body(),) * 65,
]  # fmt: skip


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif op == 1:
            del buf[rng.randrange(len(buf) + 1) :]
        elif op == 2:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            buf[rng.randrange(len(buf))] = rng.choice(INTERESTING)
        elif op == 4 and buf:
            start = rng.randrange(len(buf))
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = buf[start : start + rng.randint(1, 16)]
    return bytes(buf)


def mutate_text(text: str, rng: random.Random) -> str:
    return mutate(text.encode(), rng).decode("utf-8", "surrogateescape")


def survives(fn: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
    """Call ``fn``: True if it accepted the input, False if it raised ProtocolError."""
    try:
        fn(*args, **kwargs)
    except ProtocolError:
        return False
    return True


def full_decode(content: bytes | memoryview) -> None:
    """Everything a node does with a received frame, down to the record rules."""
    frame = decode_rpc_frame(content)
    if "t" in frame.body:
        message = decode_message(frame.body)
        key = getattr(message, "key", KEY)
        for entry in getattr(message, "entries", None) or ():
            survives(validate_entry, key, entry, now=NOW)


def test_the_budget_is_at_least_100k_inputs() -> None:
    total = N_RPC + N_STREAMS + N_ADDRESSES + N_PEER_IDS + N_BODIES + N_ENTRIES
    assert total + 4 * HYPOTHESIS.max_examples + 2 * HYPOTHESIS_NESTED.max_examples >= 100_000


def test_mutated_rpc_frames() -> None:
    rng = random.Random(1)
    accepted = sum(
        survives(lambda: full_decode(mutate(rng.choice(CONTENTS), rng))) for _ in range(N_RPC)
    )
    assert 0 < accepted < N_RPC


def test_mutated_frame_streams() -> None:
    rng = random.Random(2)
    whole = 0
    for _ in range(N_STREAMS):
        stream = mutate(b"".join(rng.sample(WIRE, 3)), rng)
        decoder = FrameDecoder(max_frame_size=rng.choice([64, 1 << 20]))

        def feed(data: bytes = stream, decoder: FrameDecoder = decoder) -> None:
            for start in range(0, len(data), 50):
                decoder.receive_data(data[start : start + 50])
                while (frame := decoder.next_frame()) is not NEED_DATA:
                    assert isinstance(frame, bytes)
                    survives(full_decode, frame)
            decoder.close()

        whole += survives(feed)
    assert 0 < whole < N_STREAMS


def test_mutated_addresses() -> None:
    rng = random.Random(3)
    accepted = sum(
        survives(lambda: Address.parse(mutate_text(rng.choice(ADDRESSES), rng)))
        for _ in range(N_ADDRESSES)
    )
    assert 0 < accepted < N_ADDRESSES


def test_mutated_peer_ids() -> None:
    rng = random.Random(4)
    accepted = sum(
        survives(lambda: PeerID.from_base58(mutate_text(rng.choice(PEER_ID_TEXTS), rng)))
        for _ in range(N_PEER_IDS)
    )
    assert 0 < accepted < N_PEER_IDS


def mutate_structure(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """Replace, drop or add one thing somewhere inside a decoded body."""
    if isinstance(value, dict) and value and (depth == 0 or rng.random() < 0.6):
        body = dict(value)
        key = rng.choice(list(body))
        roll = rng.random()
        if roll < 0.5:
            body[key] = mutate_structure(body[key], rng, depth + 1)
        elif roll < 0.7:
            del body[key]
        elif roll < 0.85:
            body[rng.choice(["x", "t", "sender", "a", "s", "o", "g"])] = rng.choice(ODD_VALUES)
        else:
            body[key] = rng.choice(ODD_VALUES)
        return body
    if isinstance(value, tuple | list) and value and rng.random() < 0.7:
        items = list(value)
        at = rng.randrange(len(items))
        items[at] = mutate_structure(items[at], rng, depth + 1)
        return tuple(items)
    return rng.choice(ODD_VALUES)


def test_mutated_bodies_for_every_message_class() -> None:
    rng = random.Random(5)
    bodies = [m.to_body() for m in MESSAGES]
    classes = list(MESSAGE_TYPES.values())
    accepted = 0
    for i in range(N_BODIES):
        body = mutate_structure(rng.choice(bodies), rng)
        cls = classes[i % len(classes)]
        accepted += survives(cls.from_body, body)
        survives(decode_message, body)
    assert accepted < N_BODIES


def validate_entry_body(body: Any, now: float) -> None:
    validate_entry(KEY, Entry.from_body(body), now=now)


def test_mutated_entries_through_validation() -> None:
    rng = random.Random(6)
    bodies = [PLAIN.to_body(), SIGNED.to_body()]
    valid = 0
    for _ in range(N_ENTRIES):
        body = mutate_structure(rng.choice(bodies), rng) if rng.random() < 0.8 else None
        if body is None:  # a byte-level mutation of the packed entry instead
            packed = mutate(msgpack.packb(rng.choice(bodies)), rng)
            try:
                body = msgpack.unpackb(packed, raw=False, use_list=False, strict_map_key=False)
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
        now = rng.choice([NOW, NOW + 100, NOW - 1e9, math.inf, math.nan])
        valid += survives(validate_entry_body, body, now)
    assert 0 < valid < N_ENTRIES


# --- hypothesis ---

msgpack_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
    | st.sampled_from([b"\x00" * 32, b"\x01" * 64, NOW + 10, str(ALICE.peer_id)])
)
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda children: (
        st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)


@HYPOTHESIS
@given(st.binary(max_size=200))
def test_random_rpc_frames(data: bytes) -> None:
    survives(lambda: full_decode(data))


@HYPOTHESIS
@given(st.binary(max_size=200), st.integers(1, 100))
def test_random_frame_streams(data: bytes, chunk: int) -> None:
    decoder = FrameDecoder(max_frame_size=64)

    def feed() -> None:
        for start in range(0, len(data), chunk):
            decoder.receive_data(data[start : start + chunk])
            while (frame := decoder.next_frame()) is not NEED_DATA:
                assert isinstance(frame, bytes)
                survives(full_decode, frame)
        decoder.close()

    survives(feed)


@HYPOTHESIS_NESTED
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.text(max_size=10), msgpack_values, max_size=2),
    st.lists(msgpack_values, max_size=3),
)
def test_random_bodies(tag: str, extra: dict[str, Any], values: list[Any]) -> None:
    cls = MESSAGE_TYPES[tag]
    body: dict[str, Any] = {"t": tag, **dict(zip(cls.FIELDS, values, strict=False)), **extra}
    survives(lambda: cls.from_body(body))
    frame = RpcFrame(FrameKind.RESPONSE, 1, body=body)
    survives(lambda: full_decode(b"".join(bytes(p) for p in encode_rpc_frame(frame))[4:]))


@HYPOTHESIS
@given(st.text(max_size=60))
def test_random_address_text(text: str) -> None:
    survives(lambda: Address.parse(text))


@HYPOTHESIS
@given(
    st.text(alphabet="123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0O", max_size=60)
)
def test_random_peer_id_text(text: str) -> None:
    survives(lambda: PeerID.from_base58(text))


@HYPOTHESIS_NESTED
@given(msgpack_values, msgpack_leaves, msgpack_leaves, msgpack_leaves, msgpack_leaves)
def test_random_entries(subkey: Any, value: Any, expiration: Any, owner: Any, sig: Any) -> None:
    def check() -> None:
        entry = Entry(subkey, value, expiration, owner, sig)
        validate_entry(KEY, entry, now=NOW)

    survives(check)
