"""The RPC envelope: layout, every kind, strict validation both ways."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest

from protocol import (
    MAX_HEADER_SIZE,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameKind,
    LocalProtocolError,
    PingRequest,
    RemoteProtocolError,
    RpcFrame,
    decode_rpc_frame,
    encode_rpc_frame,
)

# One ping request frame, as documented byte by byte in docs/protocol.md.
PING_FRAME_HEX = (
    "00000045" "00000041"
    "85" "a176" "01" "a16b" "a3726571" "a26964" "01" "a16d" "a86468742e70696e67"
    "a162" "82" "a174" "ac6468742e70696e672e726571"
    "a673656e646572" "ae3132372e302e302e313a34303030"
)  # fmt: skip


def wire(frame: RpcFrame, **kwargs: Any) -> bytes:
    return b"".join(bytes(p) for p in encode_rpc_frame(frame, **kwargs))


def round_trip(frame: RpcFrame) -> RpcFrame:
    data = wire(frame)
    (length,) = struct.unpack_from(">I", data)
    assert length == len(data) - 4
    return decode_rpc_frame(data[4:])


def raw_frame(header: Any, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + payload


def test_documented_ping_frame() -> None:
    body = PingRequest(sender="127.0.0.1:4000").to_body()
    frame = RpcFrame(FrameKind.REQUEST, 1, method="dht.ping", body=body)
    assert wire(frame).hex() == PING_FRAME_HEX
    decoded = decode_rpc_frame(bytes.fromhex(PING_FRAME_HEX)[4:])
    assert decoded == frame
    assert PingRequest.from_body(decoded.body) == PingRequest("127.0.0.1:4000")


def test_docs_show_the_same_ping_frame() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    assert PING_FRAME_HEX in "".join(docs.read_text().split())


@pytest.mark.parametrize(
    "frame",
    [
        RpcFrame(FrameKind.REQUEST, 0, method="dht.ping", body={"x": 1}),
        RpcFrame(FrameKind.REQUEST, 2**32 - 1, method="a", payload=b"\x00" * 10, timeout=0.5),
        RpcFrame(FrameKind.REQUEST, 5, method="avg.part_7", timeout=86400.0),
        RpcFrame(FrameKind.RESPONSE, 7, body={"ok": True, "n": [1, 2]}, payload=b"tensor"),
        RpcFrame(FrameKind.ITEM, 7, body={"i": 3}, payload=bytes(range(256))),
        RpcFrame(FrameKind.ITEM, 7),
        RpcFrame(FrameKind.END, 7),
        RpcFrame(FrameKind.ERROR, 7, error_code="timeout", error_message="too slow " * 100),
        RpcFrame(FrameKind.ERROR, 7),
        RpcFrame(FrameKind.CANCEL, 9),
        RpcFrame(FrameKind.BYE, 0),
    ],
    ids=lambda f: f.kind.value,
)
def test_round_trip_every_kind(frame: RpcFrame) -> None:
    decoded = round_trip(frame)
    assert decoded.kind is frame.kind
    assert decoded.request_id == frame.request_id
    assert decoded.method == frame.method
    assert decoded.timeout == frame.timeout
    assert (decoded.error_code, decoded.error_message) == (frame.error_code, frame.error_message)
    assert bytes(decoded.payload) == bytes(frame.payload)
    assert msgpack.packb(decoded.body) == msgpack.packb(frame.body)


def test_arrays_in_bodies_decode_as_tuples() -> None:
    decoded = round_trip(RpcFrame(FrameKind.RESPONSE, 1, body={"a": [1, [2, 3]], "m": {"k": []}}))
    assert decoded.body == {"a": (1, (2, 3)), "m": {"k": ()}}


def test_integer_timeout_becomes_float() -> None:
    decoded = round_trip(RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=3))
    assert decoded.timeout == 3.0 and type(decoded.timeout) is float


def test_payload_is_neither_copied_on_encode_nor_on_decode() -> None:
    payload = memoryview(bytearray(b"p" * 100_000))
    pieces = encode_rpc_frame(RpcFrame(FrameKind.ITEM, 1, payload=payload))
    assert len(pieces) == 2 and pieces[1] is payload
    content = b"".join(bytes(p) for p in pieces)[4:]
    decoded = decode_rpc_frame(content)
    assert isinstance(decoded.payload, memoryview)
    assert decoded.payload.obj is content
    assert decoded.payload == payload


def test_decode_accepts_bytearray_and_memoryview() -> None:
    content = wire(RpcFrame(FrameKind.RESPONSE, 3, body={"a": 1}, payload=b"xy"))[4:]
    for view in (bytearray(content), memoryview(content)):
        decoded = decode_rpc_frame(view)
        assert decoded.request_id == 3 and decoded.payload == b"xy"


def test_through_the_frame_decoder() -> None:
    frames = [RpcFrame(FrameKind.RESPONSE, i, body={"i": i}, payload=b"z" * i) for i in range(50)]
    decoder = FrameDecoder()
    decoder.receive_data(b"".join(wire(f) for f in frames))
    for expected in frames:
        content = decoder.next_frame()
        assert isinstance(content, bytes)
        decoded = decode_rpc_frame(content)
        assert decoded.request_id == expected.request_id and decoded.payload == expected.payload


# --- encoding refuses what the protocol forbids ---


@pytest.mark.parametrize(
    "frame",
    [
        RpcFrame(FrameKind.REQUEST, -1, method="m"),
        RpcFrame(FrameKind.REQUEST, 2**32, method="m"),
        RpcFrame(FrameKind.REQUEST, True, method="m"),
        RpcFrame(FrameKind.REQUEST, 1),
        RpcFrame(FrameKind.REQUEST, 1, method="Dht.ping"),
        RpcFrame(FrameKind.REQUEST, 1, method="dht ping"),
        RpcFrame(FrameKind.REQUEST, 1, method="dht.ping\n"),
        RpcFrame(FrameKind.REQUEST, 1, method="m" * 65),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=0),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=-1.0),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=86400.5),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=float("nan")),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=float("inf")),
        RpcFrame(FrameKind.REQUEST, 1, method="m", timeout=True),
        RpcFrame(FrameKind.REQUEST, 1, method="m", body={1: "x"}),  # type: ignore[dict-item]
        RpcFrame(FrameKind.REQUEST, 1, method="m", body=[("a", 1)]),  # type: ignore[arg-type]
        RpcFrame(FrameKind.REQUEST, 1, method="m", body={"o": object()}),
        RpcFrame(FrameKind.RESPONSE, 1, method="m"),
        RpcFrame(FrameKind.RESPONSE, 1, timeout=1.0),
        RpcFrame(FrameKind.RESPONSE, 1, error_code="x"),
        RpcFrame(FrameKind.END, 1, body={"a": 1}),
        RpcFrame(FrameKind.END, 1, payload=b"x"),
        RpcFrame(FrameKind.CANCEL, 1, payload=b"x"),
        RpcFrame(FrameKind.BYE, 0, payload=b"x"),
        RpcFrame(FrameKind.ERROR, 1, error_code="c" * 65),
        RpcFrame(FrameKind.ERROR, 1, error_message="m" * 1025),
        RpcFrame(FrameKind.ERROR, 1, payload=b"x"),
        RpcFrame("bogus", 1),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses(frame: RpcFrame) -> None:
    with pytest.raises(LocalProtocolError):
        encode_rpc_frame(frame)


def test_encode_respects_max_frame_size() -> None:
    frame = RpcFrame(FrameKind.ITEM, 1, payload=b"x" * 1000)
    size = len(wire(frame)) - 4
    assert wire(frame, max_frame_size=size)
    with pytest.raises(LocalProtocolError):
        encode_rpc_frame(frame, max_frame_size=size - 1)


def test_encode_refuses_an_oversized_header() -> None:
    body = {"v": b"x" * MAX_HEADER_SIZE}
    with pytest.raises(LocalProtocolError):
        encode_rpc_frame(RpcFrame(FrameKind.RESPONSE, 1, body=body), max_frame_size=1 << 30)


def test_kind_given_as_plain_string() -> None:
    frame = RpcFrame("cancel", 4)  # type: ignore[arg-type]
    assert round_trip(frame).kind is FrameKind.CANCEL


# --- decoding refuses malformed frames ---

GOOD = {"v": PROTOCOL_VERSION, "k": "req", "id": 1, "m": "dht.ping", "b": {}}


def changed(**changes: Any) -> dict[str, Any]:
    header = {**GOOD, **changes}
    return {k: v for k, v in header.items() if v is not DROP}


DROP = object()
MIXED_KEYS: dict[Any, Any] = {**GOOD, b"m": "x"}
BYTES_METHOD_KEY: dict[Any, Any] = {b"m": "dht.ping"}


@pytest.mark.parametrize(
    "header",
    [
        changed(v=2),
        changed(v=True),
        changed(v=1.0),
        changed(v=DROP),
        changed(k="REQ"),
        changed(k=b"req"),
        changed(k=DROP),
        changed(id=-1),
        changed(id=2**32),
        changed(id=True),
        changed(id=1.0),
        changed(id=None),
        changed(id=DROP),
        changed(m=""),
        changed(m="A"),
        changed(m=1),
        changed(m=DROP),
        changed(b=[]),
        changed(b=None),
        changed(b={b"k": 1}),
        changed(b=DROP),
        changed(t=0),
        changed(t=-1),
        changed(t=86401),
        changed(t=float("nan")),
        changed(t=float("inf")),
        changed(t=None),
        changed(t=True),
        changed(t="1"),
        changed(extra=1),
        MIXED_KEYS,  # a bytes key next to str keys
        {**changed(m=DROP), **BYTES_METHOD_KEY},
        changed(code="x"),
        {**changed(k="res"), "m": "x"},
        {"v": 1, "k": "res", "id": 1},
        {"v": 1, "k": "end", "id": 1, "b": {}},
        {"v": 1, "k": "err", "id": 1, "code": "x"},
        {"v": 1, "k": "err", "id": 1, "code": "x" * 65, "msg": ""},
        {"v": 1, "k": "err", "id": 1, "code": "", "msg": "m" * 1025},
        {"v": 1, "k": "err", "id": 1, "code": 1, "msg": ""},
        {"v": 1, "k": "cancel", "id": 1, "t": 1.0},
        [1, "req", 1],
        "req",
        None,
    ],
)
def test_decode_refuses_header(header: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_rpc_frame(raw_frame(header))


def test_the_good_header_decodes() -> None:
    assert decode_rpc_frame(raw_frame(GOOD)).method == "dht.ping"


@pytest.mark.parametrize("kind", ["end", "err", "cancel"])
def test_decode_refuses_payload_on_kinds_without_one(kind: str) -> None:
    header: dict[str, Any] = {"v": 1, "k": kind, "id": 1}
    if kind == "err":
        header |= {"code": "c", "msg": "m"}
    assert decode_rpc_frame(raw_frame(header)).kind == kind
    with pytest.raises(RemoteProtocolError):
        decode_rpc_frame(raw_frame(header, b"x"))


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\x00\x00",
        b"\x00\x00\x00\x00",  # empty header
        b"\x00\x00\x00\x05\x80",  # header length past the end
        struct.pack(">I", MAX_HEADER_SIZE + 1) + b"\x80" * 10,
        b"\x00\x00\x00\x02\x80\x80",  # two maps in the header
        b"\x00\x00\x00\x03\xa2\xff\xfe",  # invalid UTF-8
        b"\x00\x00\x00\x04\xd4\x05\x01\x02",  # an ext type
        b"\x00\x00\x00\x06\xd6\xff\x00\x00\x00\x01",  # a msgpack timestamp
        b"\x00\x00\x00\x03\x81\x01\x02",  # int map key
        b"\x00\x00\x00\x01\xc1",  # reserved byte
        b"\x00\x00\x00\x03\xdc\xff\xff",  # array claims 65535 items
        struct.pack(">I", 2001) + b"\x91" * 2000 + b"\xc0",  # nesting too deep
    ],
)
def test_decode_refuses_bytes(content: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_rpc_frame(content)


def test_ext_type_inside_the_body_is_refused() -> None:
    header = {**GOOD, "b": {"x": msgpack.ExtType(3, b"abc")}}
    with pytest.raises(RemoteProtocolError):
        decode_rpc_frame(raw_frame(header))


def test_integer_timeout_on_the_wire_is_accepted() -> None:
    assert decode_rpc_frame(raw_frame(changed(t=30))).timeout == 30.0
