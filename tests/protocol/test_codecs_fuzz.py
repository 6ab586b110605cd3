"""Fuzzing every codec decoder: random and mutated blobs raise ProtocolError, nothing else.

About 128,000 inputs in all, over six codec configurations:
- 102,000 from a seeded mutation loop over valid blobs (bit flips, byte overwrites,
  truncation, extension, header fields and payload words set to boundary values, splices);
- 24,000 random byte strings, half behind a valid magic/codec/version prefix;
- 1,920 from hypothesis (random bytes, and byte edits of valid blobs).
A decode that succeeds must return a float32 array of the header's shape (finite for int8
and topk) that agrees with ``decode_into``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs import Codec, get_codec, read_header
from protocol.errors import ProtocolError

# too_slow: data generation time depends on the machine's load, not on the code.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FUZZ_EDITS = settings(FUZZ, max_examples=60)
MAX_ELEMENTS = 1 << 20  # bounds what a mutated header can make a decoder allocate
MUTATIONS = 17_000  # per codec configuration: 6 x 17,000 = 102,000
RANDOM_BLOBS = 4_000  # per codec configuration
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("float16", {}),
    ("int8", {"block_size": 4096}),
    ("int8", {"block_size": 3}),
    ("topk", {"k": 5}),
    ("topk", {"fraction": 0.25}),
]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for name, p in CONFIGS]
SHAPES = [(), (0,), (1,), (5,), (13,), (64,), (4, 3), (2, 3, 2), (0, 4)]
U64 = [0, 1, 2, 3, 4, 5, 12, 13, 63, 64, 65, 4096, 2**20, 2**20 + 1, 2**31, 2**32, 2**32 + 1]
U64 += [2**63, 2**64 - 1]
U32 = [0, 1, 4, 5, 12, 13, 64, 127, 128, 255, 2**31, 2**32 - 1]
F32 = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e38, 3.4e38, float("nan"), float("inf"), float("-inf")]


def make_codec(name: str, params: dict[str, Any]) -> Codec:
    return get_codec(name, max_elements=MAX_ELEMENTS, **params)


def seed_blobs(codec: Codec, rng: np.random.Generator) -> list[bytes]:
    blobs = []
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[::4] = 0
        blobs.append(codec.encode(x))
    return blobs


def check(codec: Codec, blob: bytes | bytearray) -> bool:
    """Decode ``blob``; True if accepted (and sane), False on ProtocolError."""
    try:
        y = codec.decode(blob)
    except ProtocolError:
        return False
    header = read_header(blob)
    assert y.dtype == np.float32 and y.shape == header.shape
    if codec.name in ("int8", "topk"):
        assert np.isfinite(y).all()
    out = np.empty(header.n_elements, np.float32)
    codec.decode_into(blob, out)
    assert np.array_equal(out.view(np.uint32), y.reshape(-1).view(np.uint32))
    return True


class Draws:
    """Seeded numpy random draws, taken from a pre-generated pool (scalar draws are slow)."""

    def __init__(self, seed: int, size: int = 1 << 20) -> None:
        self._rng = np.random.default_rng(seed)
        self._size = size
        self._refill()

    def _refill(self) -> None:
        self._pool = self._rng.integers(0, 1 << 62, self._size).tolist()
        self._next = 0

    def below(self, n: int) -> int:
        """An int in [0, n)."""
        if self._next == self._size:
            self._refill()
        self._next += 1
        return int(self._pool[self._next - 1] % n)

    def choice(self, options: list[Any]) -> Any:
        return options[self.below(len(options))]

    def bytes(self, n: int) -> bytes:
        return bytes(self.below(256) for _ in range(n))


def header_fields(blob: bytes) -> list[tuple[int, str]]:
    """(offset, struct format) of each header field of a valid blob."""
    header = read_header(blob)
    found = [(2, "<B"), (3, "<B"), (4, "<B"), (5, "<B"), (6, "<H")]
    found += [(8 + 8 * i, "<Q") for i in range(len(header.shape))]
    if header.payload_offset > 8 + 8 * len(header.shape):
        found.append((header.payload_offset - 8, "<Q"))
    return found


def mutate(draw: Draws, blob: bytes, fields: list[tuple[int, str]], other: bytes) -> bytearray:
    b = bytearray(blob)
    kind = draw.below(7)
    if kind == 0 and b:  # bit flips
        for _ in range(1 + draw.below(4)):
            b[draw.below(len(b))] ^= 1 << draw.below(8)
    elif kind == 1 and b:  # byte overwrites, mostly in the header
        for _ in range(1 + draw.below(3)):
            b[draw.below(min(len(b), 48))] = draw.below(256)
    elif kind == 2:  # truncation
        del b[draw.below(len(b) + 1) :]
    elif kind == 3:  # extension
        b += draw.bytes(1 + draw.below(16))
    elif kind == 4:  # a header field set to a boundary or random value
        offset, fmt = draw.choice(fields)
        size = struct.calcsize(fmt)
        if fmt == "<Q" and draw.below(5):
            struct.pack_into(fmt, b, offset, draw.choice(U64))
        else:
            b[offset : offset + size] = draw.bytes(size)
    elif kind == 5:  # a payload word set to a boundary value
        start = read_header(blob).payload_offset
        if len(b) >= start + 4:
            at = start + 4 * draw.below((len(b) - start) // 4)
            if draw.below(2):
                struct.pack_into("<f", b, at, draw.choice(F32))
            else:
                struct.pack_into("<I", b, at, draw.choice(U32))
            if draw.below(3) == 0:
                b[at] = 0x80  # int8 -128
    else:  # splice: one blob's head, another's tail
        b = b[: draw.below(len(b) + 1)] + other[draw.below(len(other) + 1) :]
    return b


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_mutated_blobs(name: str, params: dict[str, Any]) -> None:
    codec = make_codec(name, params)
    index = CONFIGS.index((name, params))
    blobs = seed_blobs(codec, np.random.default_rng(index))
    fields = [header_fields(blob) for blob in blobs]
    assert all(check(codec, blob) for blob in blobs)
    draw = Draws(20240601 + index)
    accepted = 0
    for i in range(MUTATIONS):
        mutated = mutate(draw, blobs[i % len(blobs)], fields[i % len(blobs)], draw.choice(blobs))
        try:
            accepted += check(codec, mutated)
        except Exception as exc:
            pytest.fail(f"{name} mutation {i}: {exc!r} for blob {bytes(mutated).hex()}")
    assert 0 < accepted < MUTATIONS // 2  # some mutations stay valid, most do not


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
def test_random_blobs(name: str, params: dict[str, Any]) -> None:
    codec = make_codec(name, params)
    rng = np.random.default_rng(7 + CONFIGS.index((name, params)))
    prefix = codec.encode(np.zeros(3, np.float32))[:5]  # magic, codec id, version, dtype
    for i in range(RANDOM_BLOBS):
        blob = rng.bytes(int(rng.integers(0, 80)))
        if i % 2:
            blob = prefix + bytes([int(rng.integers(4))]) + b"\0\0" + blob
        try:
            check(codec, blob)
        except Exception as exc:
            pytest.fail(f"{name} random blob {i}: {exc!r} for blob {blob.hex()}")


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@FUZZ
@given(blob=st.binary(max_size=120))
def test_hypothesis_bytes(name: str, params: dict[str, Any], blob: bytes) -> None:
    codec = make_codec(name, params)
    check(codec, blob)
    check(codec, codec.encode(np.ones(2, np.float32))[:6] + b"\0\0" + blob)


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=IDS)
@FUZZ_EDITS
@given(
    shape_index=st.integers(0, len(SHAPES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, 300),
)
def test_hypothesis_edits(
    name: str, params: dict[str, Any], shape_index: int, edits: list[tuple[int, int]], cut: int
) -> None:
    codec = make_codec(name, params)
    x = np.linspace(-3, 3, num=int(np.prod(SHAPES[shape_index])), dtype=np.float32)
    blob = bytearray(codec.encode(x.reshape(SHAPES[shape_index])))
    for position, value in edits:
        if position < len(blob):
            blob[position] = value
    check(codec, blob[:cut])
    check(codec, blob)
