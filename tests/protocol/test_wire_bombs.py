"""Hostile msgpack inside well-framed input: bombs that cost the receiver far more than
the bytes that carry them.

msgpack allocates an array's slots when it reads the array's header. Nested headers that
each claim tens of thousands of elements, with nothing after them, made one 5 KB RPC
header (or one DHT value) allocate ~80 MB and burn ~70 ms before the decoder noticed the
data ended; a STORE carries 64 values, so one request cost seconds of CPU. Allocation is
measured with tracemalloc (deterministic, unlike timing).
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgpack
import pytest

from protocol import DHTID, Entry, RecordError, RemoteProtocolError, validate_entry
from protocol.records import MAX_VALUE_BYTES, decode_value
from protocol.rpc import MAX_HEADER_SIZE, FrameKind, check_whole_msgpack, decode_rpc_frame

_ONE_MB = 1 << 20


def _array32_spine(depth: int, claim: int = 65535) -> bytes:
    """``depth`` nested array-32 headers, each claiming ``claim`` elements, and nothing else."""
    return (b"\xdd" + struct.pack(">I", claim)) * depth


def _array16_spine(depth: int, claim: int = 65535) -> bytes:
    return (b"\xdc" + struct.pack(">H", claim)) * depth


def _rpc_frame(header: bytes) -> bytes:
    return struct.pack(">I", len(header)) + header


@contextmanager
def _peak_allocation() -> Iterator[Callable[[], int]]:
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("spine", [_array32_spine(1000), _array16_spine(1000)])
def test_nested_array_headers_in_an_rpc_header_allocate_nothing(spine: bytes) -> None:
    with _peak_allocation() as peak:
        with pytest.raises(RemoteProtocolError, match="malformed RPC header"):
            decode_rpc_frame(_rpc_frame(spine))
        assert peak() < _ONE_MB


def test_a_bomb_inside_a_valid_looking_header_allocates_nothing() -> None:
    # a header map whose body's last field opens the spine: the keys before it parse fine
    good = msgpack.packb({"v": 1, "k": "req", "id": 1, "m": "x"}, use_bin_type=True)
    header = b"\x85" + good[1:] + b"\xa1b" + b"\x81\xa1x" + _array32_spine(900)
    with _peak_allocation() as peak:
        with pytest.raises(RemoteProtocolError):
            decode_rpc_frame(_rpc_frame(header))
        assert peak() < _ONE_MB


def test_a_bomb_in_a_large_header_allocates_nothing() -> None:
    # over 64 KiB the header is checked whole without the byte scan
    pad = msgpack.packb({"pad": b"\x00" * 100_000}, use_bin_type=True)
    header = b"\x82" + pad[1:] + b"\xa1x" + _array32_spine(1000)
    with _peak_allocation() as peak:
        with pytest.raises(RemoteProtocolError):
            decode_rpc_frame(_rpc_frame(header))
        assert peak() < _ONE_MB + 4 * len(header)


def test_a_dht_value_made_of_array_headers_allocates_nothing() -> None:
    # each claim below the value's length: msgpack's own default limit lets it through
    value = _array32_spine(MAX_VALUE_BYTES // 5, claim=MAX_VALUE_BYTES - 10)
    with _peak_allocation() as peak:
        with pytest.raises(ValueError):
            decode_value(value)
        assert peak() < _ONE_MB


def test_a_store_of_bomb_values_is_refused_cheaply() -> None:
    key = DHTID.from_key("k")
    entry = Entry(None, _array16_spine(3000, claim=8000), 1000.0)
    with _peak_allocation() as peak:
        for _ in range(64):  # one full STORE request
            with pytest.raises(RecordError, match="not a DHT value"):
                validate_entry(key, entry, now=0.0)
        assert peak() < _ONE_MB


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(ValueError):
        check_whole_msgpack(b"\x91" * 2000 + b"\xc0")
    with pytest.raises(RemoteProtocolError):
        decode_rpc_frame(_rpc_frame(b"\x91" * 2000 + b"\xc0"))


def test_large_arrays_and_random_bytes_that_look_like_array_headers_still_decode() -> None:
    body = {
        "t": "x",
        "many": list(range(70_000)),
        "small": [b"\xdd\xdc" * 40, "\u00dd"],
        "nested": [[[1] * 20] * 20],
    }
    header = msgpack.packb({"v": 1, "k": "res", "id": 7, "b": body}, use_bin_type=True)
    frame = decode_rpc_frame(_rpc_frame(header))
    assert frame.kind is FrameKind.RESPONSE
    assert frame.body["many"] == tuple(range(70_000))
    assert frame.body["small"] == (b"\xdd\xdc" * 40, "\u00dd")
    small = msgpack.packb({"v": 1, "k": "res", "id": 7, "b": {"a": [0] * 16}})
    assert decode_rpc_frame(_rpc_frame(small)).body == {"a": (0,) * 16}
    assert decode_value(msgpack.packb([b"\xdd" * 3, list(range(300))])) == [
        b"\xdd" * 3,
        list(range(300)),
    ]


def test_trailing_bytes_and_truncation_are_still_refused() -> None:
    with pytest.raises(ValueError, match="after"):
        check_whole_msgpack(b"\xdc\x00\x01\xc0\xc0")
    with pytest.raises(ValueError, match="truncated"):
        check_whole_msgpack(b"\xdc\x00\x02\xc0")
    with pytest.raises(ValueError):
        decode_value(b"\xdc\x00\x01\xc0\xc0")


def test_a_few_array_headers_skip_the_whole_check_and_cost_little() -> None:
    # random bytes in keys and signatures look like array headers: up to 15 go unchecked
    spine = _array32_spine(15, claim=MAX_HEADER_SIZE)
    with _peak_allocation() as peak:
        with pytest.raises(RemoteProtocolError, match="malformed RPC header"):
            decode_rpc_frame(_rpc_frame(spine))
        assert peak() < 4 * _ONE_MB
    # a DHT value is checked at the first one: a STORE of 64 values is not dropped
    with pytest.raises(ValueError, match="truncated"):
        decode_value(_array32_spine(1, claim=MAX_VALUE_BYTES - 10))
