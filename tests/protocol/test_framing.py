"""Length-prefixed frames: reassembly at any split, limits, truncation."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    FrameDecoder,
    LocalProtocolError,
    RemoteProtocolError,
    encode_frame,
    encode_frame_header,
)

PAYLOADS = [b"", b"a", b"hello", bytes(range(256)), b"\x00" * 1000, b""]


def drain(decoder: FrameDecoder) -> list[bytes]:
    frames = []
    while (frame := decoder.next_frame()) is not NEED_DATA:
        assert isinstance(frame, bytes)
        frames.append(frame)
    return frames


def test_encode_frame_layout() -> None:
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame_header(0x01020304, max_frame_size=1 << 31) == b"\x01\x02\x03\x04"
    assert DEFAULT_MAX_FRAME_SIZE == 4 << 20


def test_round_trip_one_frame() -> None:
    decoder = FrameDecoder()
    assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(encode_frame(b"payload"))
    assert decoder.next_frame() == b"payload"
    assert decoder.next_frame() is NEED_DATA
    decoder.close()


def test_split_at_every_byte_boundary() -> None:
    stream = b"".join(encode_frame(p) for p in PAYLOADS)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        decoder.receive_data(stream[:cut])
        frames = drain(decoder)
        decoder.receive_data(stream[cut:])
        frames += drain(decoder)
        assert frames == PAYLOADS, cut
        decoder.close()


def test_byte_by_byte() -> None:
    stream = b"".join(encode_frame(p) for p in PAYLOADS)
    decoder = FrameDecoder()
    frames: list[bytes] = []
    for i in range(len(stream)):
        decoder.receive_data(memoryview(stream)[i : i + 1])
        frames += drain(decoder)
    assert frames == PAYLOADS
    decoder.close()


def test_many_frames_in_one_chunk() -> None:
    payloads = [i.to_bytes(4, "big") * (i % 7) for i in range(2000)]
    decoder = FrameDecoder()
    decoder.receive_data(bytearray(b"".join(encode_frame(p) for p in payloads)))
    assert drain(decoder) == payloads
    assert decoder.buffered == 0
    decoder.close()


def test_buffer_stays_bounded_on_a_long_stream() -> None:
    """Consumed bytes are dropped, so a long stream does not grow the buffer."""
    decoder = FrameDecoder()
    chunk = encode_frame(b"x" * 1000) * 10
    for _ in range(500):
        decoder.receive_data(chunk)
        assert len(drain(decoder)) == 10
        assert decoder.buffered == 0
    assert len(decoder._buffer) <= 2 * len(chunk)


def test_oversized_declared_length_is_refused_before_buffering() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    decoder.receive_data(struct.pack(">I", 101))  # no payload sent at all
    with pytest.raises(RemoteProtocolError, match="101"):
        decoder.next_frame()


def test_huge_declared_length_with_default_limit() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\xff\xff\xff\xff")
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_frame_of_exactly_the_maximum_is_accepted() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    decoder.receive_data(encode_frame(b"z" * 100, max_frame_size=100))
    assert decoder.next_frame() == b"z" * 100


def test_encoding_an_oversized_frame_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(b"z" * 101, max_frame_size=100)
    with pytest.raises(LocalProtocolError):
        encode_frame_header(DEFAULT_MAX_FRAME_SIZE + 1)


@pytest.mark.parametrize("size", [0, -1, 1 << 32])
def test_invalid_maximum(size: int) -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=size)


@pytest.mark.parametrize(
    "tail",
    [b"\x00", b"\x00\x00\x00", b"\x00\x00\x00\x05", b"\x00\x00\x00\x05abcd"],
    ids=["1-byte-header", "3-byte-header", "header-only", "short-payload"],
)
def test_truncated_at_close(tail: bytes) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(b"whole") + tail)
    assert decoder.next_frame() == b"whole"
    assert decoder.next_frame() is NEED_DATA
    with pytest.raises(RemoteProtocolError, match="truncated"):
        decoder.close()


def test_clean_close_after_whole_frames() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(b"a") + encode_frame(b""))
    assert drain(decoder) == [b"a", b""]
    decoder.close()


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=10),
)
def test_random_payloads_and_random_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    points = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    decoder = FrameDecoder(max_frame_size=300)
    frames: list[bytes] = []
    for start, end in itertools.pairwise(points):
        decoder.receive_data(stream[start:end])
        frames += drain(decoder)
    assert frames == payloads
    decoder.close()
