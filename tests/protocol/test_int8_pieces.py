"""``Int8Codec.encode_pieces_into`` / ``decode_pieces_into``: many blobs in whole-array
passes, byte for byte what a call per piece makes and reads (protocol.md 9.1, "Chunks that
span tensors"), refusing what those calls refuse."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codecs import NonFiniteError, get_codec
from protocol.codecs.base import read_header
from protocol.codecs.int8 import MAX_SCALE, Int8Codec
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError


def one_by_one(codec: Int8Codec, values: np.ndarray, lengths: list[int]) -> bytes:
    blobs, offset = [], 0
    for length in lengths:
        blobs.append(codec.encode(values[offset : offset + length]))
        offset += length
    return b"".join(blobs)


def read_one_by_one(codec: Int8Codec, payload: bytes, lengths: list[int]) -> np.ndarray:
    """A call per piece, each a blob of ``codec``'s block size (decode_into alone takes any:
    one of another size that makes as many blocks is as long)."""
    values, offset = [], 0
    for length in lengths:
        size = codec.encoded_size(length)
        out = np.empty(length, np.float32)
        piece = payload[offset : offset + size]
        header = read_header(piece)
        if header.codec == "int8" and header.param != codec.block_size:
            raise RemoteProtocolError("another block size")
        values.append(codec.decode_into(piece, out))
        offset += size
    if offset != len(payload):
        raise RemoteProtocolError("bytes left over")
    return np.concatenate(values) if values else np.zeros(0, np.float32)


def random_case(rng: np.random.Generator, trial: int) -> tuple[Int8Codec, np.ndarray, list[int]]:
    codec = get_codec("int8", block_size=int(rng.choice([1, 2, 3, 7, 64, 4096])))
    assert isinstance(codec, Int8Codec)
    lengths = [int(x) for x in rng.integers(0, 50, size=int(rng.integers(1, 40)))]
    if trial % 7 == 0:
        lengths = [0] * len(lengths)
    n = sum(lengths)
    # magnitudes from subnormal-scale blocks (flushed to 0) to near the largest scale
    values = rng.standard_normal(n) * 10.0 ** rng.integers(-40, 30, size=n)
    if trial % 5 == 0 and n:
        values[rng.integers(0, n, 3)] = 0
    dtype = (np.float32, np.float64, np.float16)[trial % 3]
    if dtype is np.float16:
        values = np.clip(values, -6e4, 6e4)
    return codec, values.astype(dtype), lengths


def test_the_passes_write_and_read_what_a_call_per_piece_does() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        codec, values, lengths = random_case(rng, trial)
        expected = one_by_one(codec, values, lengths)
        out = bytearray(len(expected) + 5)
        size = codec.encode_pieces_into(values, lengths, out)
        assert size == len(expected) and bytes(out[:size]) == expected, trial
        back = np.empty(sum(lengths), np.float32)
        codec.decode_pieces_into(expected, lengths, back)
        np.testing.assert_array_equal(back, read_one_by_one(codec, expected, lengths))


def test_a_damaged_payload_is_refused_exactly_when_a_call_per_piece_refuses_it() -> None:
    """Any single byte changed (a header's, a scale's, a value's): the passes and the calls
    per piece agree on refusing it or not, and on the values when not."""
    rng = np.random.default_rng(1)
    refused = 0
    for trial in range(400):
        codec, values, lengths = random_case(rng, trial)
        payload = bytearray(one_by_one(codec, values, lengths))
        if not payload:
            continue
        position = int(rng.integers(0, len(payload)))
        payload[position] ^= int(rng.integers(1, 256))
        try:
            expected: np.ndarray | None = read_one_by_one(codec, bytes(payload), lengths)
        except ProtocolError:
            expected = None
        back = np.empty(sum(lengths), np.float32)
        if expected is None:
            refused += 1
            with pytest.raises(RemoteProtocolError):
                codec.decode_pieces_into(bytes(payload), lengths, back)
        else:
            codec.decode_pieces_into(bytes(payload), lengths, back)
            np.testing.assert_array_equal(back, expected)
    assert refused > 100  # headers and scales are most of these small payloads


def test_what_the_passes_refuse() -> None:
    codec = get_codec("int8", block_size=2)
    assert isinstance(codec, Int8Codec)
    values = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match="do not tile"):
        codec.encode_pieces_into(values, [2, 2], bytearray(200))
    with pytest.raises(ValueError, match="the blobs need"):
        codec.encode_pieces_into(values, [3, 3], bytearray(10))
    with pytest.raises(NonFiniteError):
        codec.encode_pieces_into(np.array([1, np.inf, 3], np.float32), [1, 2], bytearray(200))
    payload = one_by_one(codec, values, [3, 3])
    with pytest.raises(RemoteProtocolError, match="bytes, not the"):
        codec.decode_pieces_into(payload[:-1], [3, 3], np.empty(6, np.float32))
    with pytest.raises(RemoteProtocolError):  # pieces of other lengths, as long in all
        codec.decode_pieces_into(one_by_one(codec, values, [2, 4]), [3, 3], np.empty(6, np.float32))
    # blobs of another block size that makes as many blocks: as long, and refused
    eight = np.arange(8, dtype=np.float32)
    other = get_codec("int8", block_size=3)
    assert isinstance(other, Int8Codec)
    forged = one_by_one(other, eight, [4, 4])
    assert len(forged) == len(one_by_one(codec, eight, [4, 4]))
    with pytest.raises(RemoteProtocolError, match="block_size 3, not 2"):
        codec.decode_pieces_into(forged, [4, 4], np.empty(8, np.float32))


def test_pieces_longer_than_max_elements_are_not_encoded() -> None:
    """``max_elements`` bounds each blob as :meth:`encode_into` does: a piece longer than it
    is refused before any byte is written (the receiver would refuse the blob anyway)."""
    codec = Int8Codec(block_size=2, max_elements=4)
    values = np.arange(8, dtype=np.float32)
    out = bytearray(200)
    with pytest.raises(LocalProtocolError):
        codec.encode_pieces_into(values, [3, 5], out)
    assert out == bytearray(200)
    assert codec.encode_pieces_into(values, [4, 4], bytearray(200)) == len(
        one_by_one(codec, values, [4, 4])
    )


def test_the_largest_floats_are_encoded_with_a_capped_scale() -> None:
    """Values near ``FLT_MAX`` make a scale of ``FLT_MAX / 127``, above ``MAX_SCALE``: the
    passes cap it as a call per piece does, so the blobs are the same bytes and decode (in
    passes or per piece) to finite values within the error bound, not a refused scale."""
    codec = get_codec("int8", block_size=4)
    assert isinstance(codec, Int8Codec)
    fmax = np.finfo(np.float32).max
    values = np.array([fmax, -fmax, 1, 0, 5, -fmax, 3], np.float32)
    lengths = [4, 3]
    expected = one_by_one(codec, values, lengths)
    out = bytearray(len(expected))
    assert codec.encode_pieces_into(values, lengths, out) == len(expected)
    assert bytes(out) == expected
    back = np.empty(values.size, np.float32)
    codec.decode_pieces_into(bytes(out), lengths, back)
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back, read_one_by_one(codec, expected, lengths))
    for start, length in ((0, 4), (4, 3)):
        absmax = np.abs(values[start : start + length].astype(np.float64)).max()
        error = np.abs(
            values[start : start + length].astype(np.float64) - back[start : start + length]
        )
        assert error.max() <= absmax / 254 + 1e-6 * absmax


@pytest.mark.parametrize(
    "scale", [np.inf, np.nextafter(MAX_SCALE, np.float32(np.inf))], ids=["inf", "above_max"]
)
def test_an_infinite_or_overlarge_scale_is_refused(scale: float) -> None:
    """A scale above ``MAX_SCALE`` (infinite, or just above it with the value 127) would
    decode to infinity: refused as each blob on its own refuses it, so that a decoded array
    is always finite."""
    codec = get_codec("int8", block_size=2)
    assert isinstance(codec, Int8Codec)
    values = np.array([1, -1, 2, 0], np.float32)
    payload = bytearray(one_by_one(codec, values, [4]))
    offset = read_header(payload).payload_offset
    payload[offset : offset + 4] = np.array([scale], "<f4").tobytes()  # block 0: [127, -127]
    with pytest.raises(RemoteProtocolError, match="scales"):
        codec.decode_into(bytes(payload), np.empty(4, np.float32))
    with pytest.raises(RemoteProtocolError, match="scales"):
        codec.decode_pieces_into(bytes(payload), [4], np.empty(4, np.float32))


def test_bytes_after_the_blobs_are_refused() -> None:
    """A payload longer than its blobs is the sender's error: a protocol error, which
    callers handle, not an IndexError from the byte masks."""
    codec = get_codec("int8", block_size=2)
    assert isinstance(codec, Int8Codec)
    values = np.arange(6, dtype=np.float32)
    payload = one_by_one(codec, values, [3, 3])
    for extra in (b"\0", bytes(50)):
        with pytest.raises(RemoteProtocolError, match="bytes, not the"):
            codec.decode_pieces_into(payload + extra, [3, 3], np.empty(6, np.float32))
