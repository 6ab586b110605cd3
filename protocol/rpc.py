"""The RPC envelope, sans-I/O: one RPC frame per length-prefixed frame.

Frame content (what :mod:`protocol.framing` wraps in its 4-byte length)::

    u32 big-endian header_length | msgpack header (a map) | raw payload (may be empty)

The payload is never msgpack: it carries tensor bytes and is handed out as a
zero-copy ``memoryview``. Header keys (all others are refused)::

    all kinds   v: 1 (PROTOCOL_VERSION)   k: kind   id: request id, 0 <= id < 2**32
    "req"       m: method ([a-z0-9_.]{1,64})   b: body (map, str keys)   [t: seconds left]
    "res"       b: body (the final reply)
    "item"      b: body (one item of a streaming reply)
    "end"       (end of a streaming reply)
    "err"       code: str (<= 64 chars)   msg: str (<= 1024 chars)
    "cancel"    (the caller gave up)

Rules of the conversation (enforced by ``peer/``, not here): ``req`` and ``cancel`` go
caller -> callee; ``res``, ``item``, ``end`` and ``err`` go callee -> caller, and each
side numbers its own requests, so the same id can be in flight both ways. A request
is answered by one ``res`` or ``err``, or by ``item``\\* then ``end`` or ``err``.
Only ``req``, ``res`` and ``item`` may carry a payload. ``t`` is optional (omitted,
never nil), a positive number of at most ``MAX_TIMEOUT`` seconds.

Decoding uses ``use_list=False``: msgpack arrays inside a body come back as tuples
(immutable, like the frozen messages built from them). Ext types (timestamps too)
are refused, so a body holds only nil, bool, int, float, str, bytes, tuples and maps.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .framing import DEFAULT_MAX_FRAME_SIZE, encode_frame_header

__all__ = [
    "MAX_ERROR_CODE_LENGTH",
    "MAX_ERROR_MESSAGE_LENGTH",
    "MAX_HEADER_SIZE",
    "MAX_INFLIGHT_REQUESTS",
    "MAX_METHOD_LENGTH",
    "MAX_REQUEST_ID",
    "MAX_TIMEOUT",
    "PROTOCOL_VERSION",
    "FrameKind",
    "RpcFrame",
    "check_whole_msgpack",
    "decode_rpc_frame",
    "encode_rpc_frame",
    "may_hold_array_bomb",
]

PROTOCOL_VERSION = 1
MAX_HEADER_SIZE = 2 << 20
"""Largest msgpack header. DHT bodies live in the header (a full STORE of 64 entries of
16 KiB is ~1.1 MB), so this is 2 MiB; the frame maximum still bounds it too."""
MAX_METHOD_LENGTH = 64
MAX_ERROR_CODE_LENGTH = 64
MAX_ERROR_MESSAGE_LENGTH = 1024
MAX_TIMEOUT = 86400.0
MAX_REQUEST_ID = (1 << 32) - 1
MAX_INFLIGHT_REQUESTS = 128
"""Requests one peer may have in flight on one connection: every peer serves this many at
once, so a caller keeps no more unanswered (see docs/protocol.md 4.3)."""

_HEADER_LENGTH = struct.Struct(">I")
_METHOD = re.compile(r"[a-z0-9_.]{1,64}")
_COMMON_KEYS = frozenset({"v", "k", "id"})


class FrameKind(enum.StrEnum):
    REQUEST = "req"
    RESPONSE = "res"
    ITEM = "item"
    END = "end"
    ERROR = "err"
    CANCEL = "cancel"
    BYE = "bye"  # id 0: the sender closes this idle connection now (not a departure)


# Per kind: (required keys beyond v/k/id, optional keys, may carry a payload).
_SHAPES: dict[FrameKind, tuple[frozenset[str], frozenset[str], bool]] = {
    FrameKind.REQUEST: (frozenset({"m", "b"}), frozenset({"t"}), True),
    FrameKind.RESPONSE: (frozenset({"b"}), frozenset(), True),
    FrameKind.ITEM: (frozenset({"b"}), frozenset(), True),
    FrameKind.END: (frozenset(), frozenset(), False),
    FrameKind.ERROR: (frozenset({"code", "msg"}), frozenset(), False),
    FrameKind.CANCEL: (frozenset(), frozenset(), False),
    FrameKind.BYE: (frozenset(), frozenset(), False),
}


@dataclass(frozen=True, slots=True)
class RpcFrame:
    """One RPC frame. Fields that do not belong to ``kind`` keep their defaults."""

    kind: FrameKind
    request_id: int
    method: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""
    timeout: float | None = None
    error_code: str = ""
    error_message: str = ""


def _show(value: object) -> str:
    """A bounded repr for error messages: received values can be megabytes long."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_request_id(value: object, error: type[ProtocolError]) -> int:
    if type(value) is not int or not 0 <= value <= MAX_REQUEST_ID:
        raise error(f"request id {_show(value)} is not an int in 0 .. 2**32-1")
    return value


def _check_method(value: object, error: type[ProtocolError]) -> str:
    if type(value) is not str or _METHOD.fullmatch(value) is None:
        raise error(f"method {_show(value)} is not 1..64 characters of [a-z0-9_.]")
    return value


def _check_body(value: object, error: type[ProtocolError]) -> dict[str, Any]:
    if type(value) is not dict or not all(type(key) is str for key in value):
        raise error("an RPC body must be a map with str keys")
    return value


def _check_timeout(value: object, error: type[ProtocolError]) -> float:
    if (type(value) is int or type(value) is float) and 0 < value <= MAX_TIMEOUT:
        return float(value)  # NaN and inf fail the range check above
    raise error(f"timeout {_show(value)} is not a number in (0, {MAX_TIMEOUT}]")


def _check_text(value: object, limit: int, what: str, error: type[ProtocolError]) -> str:
    if type(value) is not str or len(value) > limit:
        raise error(f"{what} must be a str of at most {limit} characters")
    return value


def encode_rpc_frame(
    frame: RpcFrame, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> list[bytes | memoryview]:
    """The pieces to write for ``frame``, in order, frame length prefix included.

    ``[4-byte frame length + 4-byte header length + header, payload]``: the payload is
    not copied. Write both pieces (or their join) to the stream.

    Raises:
        LocalProtocolError: if a field is invalid for the kind, a field that does not
            belong to the kind is set, the body cannot be packed, or the frame would
            exceed ``MAX_HEADER_SIZE`` or ``max_frame_size``.
    """
    try:
        kind = FrameKind(frame.kind)
    except ValueError:
        raise LocalProtocolError(f"unknown frame kind {_show(frame.kind)}") from None
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "k": kind.value,
        "id": _check_request_id(frame.request_id, LocalProtocolError),
    }
    if kind is FrameKind.REQUEST:
        header["m"] = _check_method(frame.method, LocalProtocolError)
        if frame.timeout is not None:
            header["t"] = _check_timeout(frame.timeout, LocalProtocolError)
    elif frame.method or frame.timeout is not None:
        raise LocalProtocolError(f"a {kind.value!r} frame has no method or timeout")
    if kind in (FrameKind.REQUEST, FrameKind.RESPONSE, FrameKind.ITEM):
        header["b"] = _check_body(frame.body, LocalProtocolError)
    elif frame.body:
        raise LocalProtocolError(f"a {kind.value!r} frame has no body")
    if kind is FrameKind.ERROR:
        header["code"] = _check_text(
            frame.error_code, MAX_ERROR_CODE_LENGTH, "error code", LocalProtocolError
        )
        header["msg"] = _check_text(
            frame.error_message, MAX_ERROR_MESSAGE_LENGTH, "error message", LocalProtocolError
        )
    elif frame.error_code or frame.error_message:
        raise LocalProtocolError(f"a {kind.value!r} frame has no error code or message")
    try:
        payload_size = memoryview(frame.payload).nbytes
    except TypeError:
        raise LocalProtocolError("the payload must be bytes-like") from None
    if payload_size and not _SHAPES[kind][2]:
        raise LocalProtocolError(f"a {kind.value!r} frame carries no payload")
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot pack the RPC header: {exc}") from exc
    if len(packed) > MAX_HEADER_SIZE:
        raise LocalProtocolError(f"RPC header of {len(packed)} bytes exceeds {MAX_HEADER_SIZE}")
    total = _HEADER_LENGTH.size + len(packed) + payload_size
    prefix = encode_frame_header(total, max_frame_size)
    return [prefix + _HEADER_LENGTH.pack(len(packed)) + packed, frame.payload]


_ARRAY16, _ARRAY32 = b"\xdc", b"\xdd"
_TOLERATED_ARRAY_HEADERS = 15
_ALWAYS_CHECK_FROM = 1 << 16
"""Headers this large skip the cheap test below and are always checked whole first."""


def check_whole_msgpack(data: bytes | memoryview) -> None:
    """Check that ``data`` holds one complete msgpack object, without building it.

    The unpacker allocates an array's slots when it reads the array's header, before
    its elements, so a few bytes of nested headers that each claim 65535 elements
    (3 bytes apiece, up to 1024 deep) make it allocate ~80 MB and burn ~70 ms before it
    notices that the data ends: a CPU and memory bomb. Skipping the structure first
    builds nothing; once it is known to be complete, every slot allocated later holds an
    element that is really there, so decoding costs what the bytes are worth.

    Raises:
        ValueError: if ``data`` is truncated, malformed, nested 1024 deep or more, or
            has bytes after the object.
    """
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        raise ValueError("truncated msgpack") from None
    if unpacker.tell() != len(data):
        raise ValueError("bytes after the msgpack object")


def may_hold_array_bomb(data: bytes, tolerated: int = _TOLERATED_ARRAY_HEADERS) -> bool:
    """Whether ``data`` holds more than ``tolerated`` type bytes of arrays of 16 or more
    elements (fixarrays are too small to matter), so that :func:`check_whole_msgpack` must
    run first. Each one costs at most ~70 us, even opening an empty array that claims
    2**32 elements; an RPC header that does so is malformed and its connection dropped, and
    the random bytes of keys and signatures rarely hold more than 15, so most skip the check.
    """
    return data.count(_ARRAY16) + data.count(_ARRAY32) > tolerated


def _unpack_header(view: memoryview) -> Any:
    data: bytes | memoryview = view
    try:
        if len(view) >= _ALWAYS_CHECK_FROM:
            check_whole_msgpack(view)
        else:
            data = bytes(view)  # small: a copy makes the scan a memchr
            if may_hold_array_bomb(data):
                check_whole_msgpack(data)
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_SIZE,
            max_bin_len=MAX_HEADER_SIZE,
            max_array_len=MAX_HEADER_SIZE,
            max_map_len=MAX_HEADER_SIZE // 2,
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        # UnicodeDecodeError, ExtraData, StackError and FormatError are ValueErrors.
        raise RemoteProtocolError(f"malformed RPC header: {_show(exc)}") from exc


def decode_rpc_frame(frame: bytes | bytearray | memoryview) -> RpcFrame:
    """Parse the content of one frame (without its 4-byte frame length).

    The returned payload is a ``memoryview`` slice of ``frame`` (no copy): keep ``frame``
    alive and unmodified while the payload is in use.

    Raises:
        RemoteProtocolError: on any malformation: bad lengths, msgpack, version, kind,
            id, missing or unknown keys, wrong types or ranges, a payload on a kind
            that has none.
    """
    data = memoryview(frame)
    if data.ndim != 1 or data.itemsize != 1:
        data = data.cast("B")
    if len(data) < _HEADER_LENGTH.size:
        raise RemoteProtocolError("RPC frame shorter than its header length")
    (header_length,) = _HEADER_LENGTH.unpack_from(data)
    end = _HEADER_LENGTH.size + header_length
    if header_length > MAX_HEADER_SIZE or end > len(data):
        raise RemoteProtocolError(f"RPC header length {header_length} exceeds the frame")
    header = _unpack_header(data[_HEADER_LENGTH.size : end])
    if type(header) is not dict:
        raise RemoteProtocolError("RPC header is not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {_show(version)}")
    kind_text = header.get("k")
    try:
        kind = FrameKind(kind_text) if type(kind_text) is str else None
    except ValueError:
        kind = None
    if kind is None:
        raise RemoteProtocolError(f"unknown RPC frame kind {_show(kind_text)}")
    required, optional, may_carry_payload = _SHAPES[kind]
    keys = header.keys()
    if not (required | _COMMON_KEYS) <= keys or not keys <= required | optional | _COMMON_KEYS:
        raise RemoteProtocolError(f"wrong keys for a {kind.value!r} frame: {_show(list(keys))}")
    request_id = _check_request_id(header["id"], RemoteProtocolError)
    payload = data[end:]
    if len(payload) and not may_carry_payload:
        raise RemoteProtocolError(f"a {kind.value!r} frame carries no payload")
    err = RemoteProtocolError
    if kind is FrameKind.REQUEST:
        timeout = header.get("t")
        return RpcFrame(
            kind,
            request_id,
            method=_check_method(header["m"], err),
            body=_check_body(header["b"], err),
            payload=payload,
            timeout=None if "t" not in header else _check_timeout(timeout, err),
        )
    if kind in (FrameKind.RESPONSE, FrameKind.ITEM):
        return RpcFrame(kind, request_id, body=_check_body(header["b"], err), payload=payload)
    if kind is FrameKind.ERROR:
        return RpcFrame(
            kind,
            request_id,
            error_code=_check_text(header["code"], MAX_ERROR_CODE_LENGTH, "error code", err),
            error_message=_check_text(
                header["msg"], MAX_ERROR_MESSAGE_LENGTH, "error message", err
            ),
        )
    return RpcFrame(kind, request_id)
