"""Tensor codecs: round trips, error bounds, exact sizes, refusals and targeted bad blobs."""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import protocol.codecs
from protocol.codecs import (
    CODEC_NAMES,
    Codec,
    Int8Codec,
    NonFiniteError,
    TopKCodec,
    get_codec,
    read_header,
)
from protocol.codecs.int8 import MAX_SCALE
from protocol.errors import LocalProtocolError, ProtocolError, SwarmError

# too_slow: data generation time depends on the machine's load, not on the code.
FAST = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FLT_MIN = float(np.finfo(np.float32).tiny)
SHAPES = [(), (0,), (1,), (7,), (4096,), (4097,), (3, 0, 5), (2, 3, 4), (17, 33), (2, 2, 2, 2, 2)]
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("float16", {}),
    ("int8", {}),
    ("int8", {"block_size": 5}),
    ("topk", {"k": 3}),
    ("topk", {"fraction": 0.1}),
]


def sample(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def int8_bound_ok(x: np.ndarray, y: np.ndarray, block_size: int) -> bool:
    """|x - y| <= absmax(block) / 254 (+ float32 rounding); tiny blocks decode to zero."""
    xf = x.astype(np.float64).reshape(-1)
    yf = y.astype(np.float64).reshape(-1)
    for start in range(0, xf.size, block_size):
        xb, yb = xf[start : start + block_size], yf[start : start + block_size]
        absmax = np.abs(xb).max()
        if absmax < 127 * FLT_MIN:
            if np.any(yb != 0):
                return False
        elif np.abs(xb - yb).max() > absmax / 254 + 1e-6 * absmax:
            return False
    return True


def topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest magnitudes, lower indices first among ties."""
    flat = np.abs(x.astype(np.float32).reshape(-1))
    order = np.lexsort((np.arange(flat.size), -flat))
    return np.sort(order[:k])


def strided_trap(rng: np.random.Generator, n: int) -> np.ndarray:
    """Large distinct values exactly where the strided threshold sample looks."""
    x = rng.standard_normal(n).astype(np.float32)
    stride = n // 16384
    x[::stride] = 100 + np.arange(x[::stride].size)
    return x


def blob_indices(blob: bytes) -> np.ndarray:
    header = read_header(blob)
    return np.frombuffer(blob, "<u4", header.param, header.payload_offset).astype(np.int64)


# -- public surface -----------------------------------------------------------------------


def test_public_surface() -> None:
    assert sorted(protocol.codecs.__all__) == sorted(
        [
            "CODEC_NAMES",
            "BlobHeader",
            "Codec",
            "Float16Codec",
            "Int8Codec",
            "NonFiniteError",
            "NoneCodec",
            "TopKCodec",
            "get_codec",
            "read_header",
        ]
    )
    assert CODEC_NAMES == ("none", "float16", "int8", "topk")
    assert issubclass(NonFiniteError, SwarmError) and issubclass(NonFiniteError, ValueError)


def test_codecs_import_neither_trio_nor_torch() -> None:
    code = "import sys, protocol.codecs; print('trio' in sys.modules, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_get_codec_validates_names_and_params() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("gzip")
    with pytest.raises(TypeError):
        get_codec("none", block_size=4)
    for bad in ({"block_size": 0}, {"block_size": 1 << 32}):
        with pytest.raises(ValueError):
            get_codec("int8", **bad)
    for bad in ({"block_size": True}, {"block_size": 64.0}):
        with pytest.raises(TypeError):
            get_codec("int8", **bad)
    for bad in ({}, {"k": 1, "fraction": 0.5}, {"k": 0}, {"fraction": 0.0}, {"fraction": 1.5}):
        with pytest.raises(ValueError):
            get_codec("topk", **bad)
    with pytest.raises(TypeError):
        get_codec("topk", k=2.0)
    with pytest.raises(ValueError):
        get_codec("none", max_elements=(1 << 32) + 1)
    assert get_codec("int8", block_size=np.int64(64)).params["block_size"] == 64


@pytest.mark.parametrize(("name", "params"), CONFIGS)
def test_params_rebuild_an_equivalent_codec(name: str, params: dict[str, Any]) -> None:
    codec = get_codec(name, **params)
    assert isinstance(codec, Codec) and codec.name == name
    twin = get_codec(codec.name, **codec.params)
    x = sample((1000,))
    assert twin.encode(x) == codec.encode(x)
    assert repr(codec).startswith(type(codec).__name__)


# -- round trips, sizes, buffers ---------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), CONFIGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_shapes_and_sizes(
    name: str, params: dict[str, Any], shape: tuple[int, ...]
) -> None:
    codec = get_codec(name, **params)
    x = sample(shape)
    blob = codec.encode(x)
    assert isinstance(blob, bytes)
    assert len(blob) == codec.encoded_size(x.size, x.ndim)
    header = read_header(blob)
    assert (header.codec, header.shape, header.n_elements) == (name, shape, x.size)
    assert header.payload_offset % 8 == 0
    y = codec.decode(blob)
    assert y.dtype == np.float32 and y.shape == shape
    if name == "none":
        np.testing.assert_array_equal(y, x)
    elif name == "float16":
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    elif name == "int8":
        assert int8_bound_ok(x, y, codec.params["block_size"])
    else:
        assert isinstance(codec, TopKCodec)
        kept = topk_reference(x, codec.k_for(x.size))
        np.testing.assert_array_equal(blob_indices(blob), kept)
        expected = np.zeros(x.size, np.float32)
        expected[kept] = x.reshape(-1)[kept]
        np.testing.assert_array_equal(y.reshape(-1), expected)

    buf = bytearray(len(blob) + 5)
    assert codec.encode_into(x, buf) == len(blob)
    assert bytes(buf[: len(blob)]) == blob
    out = np.full(x.size, np.nan, np.float32)  # any shape with the right size
    assert codec.decode_into(memoryview(blob), out) is out
    np.testing.assert_array_equal(out, y.reshape(-1))


@pytest.mark.parametrize(("name", "params"), CONFIGS)
def test_non_contiguous_big_endian_and_other_float_inputs(
    name: str, params: dict[str, Any]
) -> None:
    codec = get_codec(name, **params)
    base = sample((40, 30))
    reference = codec.decode(codec.encode(base.T.copy()))
    np.testing.assert_array_equal(codec.decode(codec.encode(base.T)), reference)
    assert codec.encode(base.astype(">f4")) == codec.encode(base)
    for dtype in (np.float16, np.float64):
        blob = codec.encode(base.astype(dtype))
        assert read_header(blob).source_dtype == np.dtype(dtype).name
        assert codec.decode(blob).dtype == np.float32
    for bad in (base.astype(np.int32), base.astype(np.complex64), np.array([True])):
        with pytest.raises(TypeError):
            codec.encode(bad)


def test_output_buffer_checks() -> None:
    codec = get_codec("int8")
    x = sample((100,))
    blob = codec.encode(x)
    with pytest.raises(ValueError):
        codec.encode_into(x, bytearray(len(blob) - 1))
    with pytest.raises(TypeError):
        codec.encode_into(x, memoryview(bytes(len(blob))))
    with pytest.raises(TypeError):
        codec.decode_into(blob, np.empty(100, np.float64))
    with pytest.raises(ValueError):
        codec.decode_into(blob, np.empty(200, np.float32)[::2])
    with pytest.raises(ProtocolError):
        codec.decode_into(blob, np.empty(99, np.float32))


def test_none_decode_is_zero_copy() -> None:
    codec = get_codec("none")
    x = sample((3, 4))
    blob = codec.encode(x)
    y = codec.decode(blob)
    assert not y.flags.writeable and np.shares_memory(y, np.frombuffer(blob, np.uint8))
    assert codec.decode(bytearray(blob)).flags.writeable


def test_element_limit_on_both_sides() -> None:
    small = get_codec("int8", max_elements=10)
    with pytest.raises(LocalProtocolError):
        small.encode(np.zeros(11, np.float32))
    with pytest.raises(LocalProtocolError):
        get_codec("none").encode(np.zeros((1,) * 33, np.float32))
    with pytest.raises(ProtocolError, match="max_elements"):
        small.decode(get_codec("int8").encode(np.zeros(11, np.float32)))


# -- none and float16: faithful ------------------------------------------------------------


def test_none_and_float16_carry_nan_and_inf() -> None:
    x = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, 3e38], np.float32)
    y = get_codec("none").decode(get_codec("none").encode(x))
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))
    z = get_codec("float16").decode(get_codec("float16").encode(x))
    np.testing.assert_array_equal(z[:4], x[:4])
    assert z[4] == 0 and z[5] == np.inf  # underflow to zero, overflow to inf
    big = np.array([1e300, -1e300], np.float64)  # float64 beyond float32: infinite, no warning
    none = get_codec("none")
    np.testing.assert_array_equal(none.decode(none.encode(big)), [np.inf, -np.inf])


@FAST
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=20),
        elements=st.floats(2**-14, 65504, width=32) | st.floats(-65504, -(2**-14), width=32),
    )
)
def test_float16_relative_error(x: np.ndarray) -> None:
    codec = get_codec("float16")
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape
    assert np.all(np.abs(y.astype(np.float64) - x) <= 2.0**-10 * np.abs(x.astype(np.float64)))


def test_float16_small_and_huge_magnitudes() -> None:
    codec = get_codec("float16")
    tiny = np.linspace(-(2.0**-14), 2.0**-14, 1001, dtype=np.float32)
    assert np.abs(codec.decode(codec.encode(tiny)) - tiny).max() <= 2.0**-25
    huge = np.array([65504, 65519, 65520, 1e6, -1e6], np.float32)
    np.testing.assert_array_equal(
        codec.decode(codec.encode(huge)), [65504, 65504, np.inf, np.inf, -np.inf]
    )


# -- int8 ----------------------------------------------------------------------------------

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@FAST
@given(
    hnp.arrays(np.float32, st.integers(0, 300), elements=finite32),
    st.sampled_from([1, 3, 64, 4096]),
)
def test_int8_error_bound(x: np.ndarray, block_size: int) -> None:
    codec = get_codec("int8", block_size=block_size)
    y = codec.decode(codec.encode(x))
    assert np.all(np.isfinite(y))
    assert int8_bound_ok(x, y, block_size)


@pytest.mark.parametrize("n", [4096 * 64, 4096 * 64 + 123])
def test_int8_error_bound_and_wire_ratio_large(n: int) -> None:
    codec = get_codec("int8")
    x = sample((n,), seed=1) * np.float32(3)
    blob = codec.encode(x)
    assert len(blob) / x.nbytes <= 0.26
    assert int8_bound_ok(x, codec.decode(blob), 4096)


def test_int8_edge_blocks() -> None:
    codec = get_codec("int8", block_size=4)
    fmax = np.finfo(np.float32).max
    x = np.array(
        [0, 0, 0, 0, 1e-40, -1e-39, 0, 0, fmax, -fmax, 1, 0, 1e-36, 2e-36, 0, 0], np.float32
    )
    y = codec.decode(codec.encode(x))
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[:8], 0)  # all-zero block, subnormal block flushed
    assert int8_bound_ok(x, y, 4)
    scales = np.frombuffer(codec.encode(x), "<f4", 4, read_header(codec.encode(x)).payload_offset)
    assert scales[2] <= MAX_SCALE


@pytest.mark.parametrize("name", ["int8", "topk"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_and_topk_refuse_non_finite(name: str, bad: float) -> None:
    codec = get_codec(name, **({"k": 2} if name == "topk" else {}))
    x = sample((5000,))
    x[4321] = bad
    with pytest.raises(NonFiniteError):
        codec.encode(x)
    with pytest.raises(NonFiniteError):
        codec.encode(np.array([1e300, 1.0]))  # float64 that overflows float32


# -- topk ----------------------------------------------------------------------------------


def test_topk_k_for() -> None:
    assert TopKCodec(k=10).k_for(3) == 3
    assert TopKCodec(k=10).k_for(0) == 0
    assert TopKCodec(fraction=0.01).k_for(1) == 1
    assert TopKCodec(fraction=0.01).k_for(1000) == 10
    assert TopKCodec(fraction=0.01).k_for(1001) == 11
    assert TopKCodec(fraction=1.0).encoded_size(10) == len(TopKCodec(k=10).encode(sample((10,))))


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: rng.standard_normal(300_000).astype(np.float32),  # sampled threshold
        lambda rng: np.round(rng.standard_normal(300_000) * 4).astype(np.float32),  # many ties
        lambda rng: np.zeros(300_000, np.float32),  # every value ties
        lambda rng: np.where(rng.random(300_000) < 0.001, 5.0, 0.0).astype(np.float32),
        lambda rng: np.sort(rng.standard_normal(300_000)).astype(np.float32),
        lambda rng: strided_trap(rng, 300_000),  # the sample overestimates the threshold
        lambda rng: rng.standard_normal(1000).astype(np.float32),  # small: full partition
    ],
)
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3])
def test_topk_selects_exactly_the_k_largest(make: Any, fraction: float) -> None:
    x = make(np.random.default_rng(7))
    codec = TopKCodec(fraction=fraction)
    blob, residual = codec.encode_with_residual(x)
    k = codec.k_for(x.size)
    np.testing.assert_array_equal(blob_indices(blob), topk_reference(x, k))
    decoded = codec.decode(blob)
    np.testing.assert_array_equal(residual + decoded, x)


@FAST
@given(
    hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12),
        elements=st.floats(-1e4, 1e4, width=16),
    ),
    st.integers(1, 50),
)
def test_topk_residual_is_exact(x: np.ndarray, k: int) -> None:
    codec = TopKCodec(k=k)
    blob, residual = codec.encode_with_residual(x)
    assert residual.dtype == x.dtype and residual.shape == x.shape
    decoded = codec.decode(blob)
    kept = blob_indices(blob)
    np.testing.assert_array_equal(kept, topk_reference(x, min(k, x.size)))
    assert np.all(residual.astype(np.float64) + decoded == x.astype(np.float64))
    np.testing.assert_array_equal(decoded.reshape(-1)[kept], x.astype(np.float32).reshape(-1)[kept])


def test_topk_residual_in_place_and_float64_rounding() -> None:
    codec = TopKCodec(k=4)
    acc = sample((10,))
    original = acc.copy()
    blob, residual = codec.encode_with_residual(acc, residual_out=acc)
    assert residual is acc
    np.testing.assert_array_equal(acc + codec.decode(blob), original)
    x64 = np.array([1 / 3, 2 / 3, 1e-3, -5.1], np.float64)
    blob, residual = codec.encode_with_residual(x64)
    assert np.all(residual + codec.decode(blob).astype(np.float64) == x64)
    assert residual[3] == x64[3] - np.float64(np.float32(x64[3])) != 0
    with pytest.raises(TypeError):
        codec.encode_with_residual(acc, residual_out=np.empty(10, np.float64))


# -- targeted bad blobs ----------------------------------------------------------------------


def patch(blob: bytes, offset: int, fmt: str, value: Any) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def bad_blobs() -> list[tuple[str, Codec, bytes]]:
    x = sample((10,))
    none, f16, i8, tk = (get_codec("none"), get_codec("float16"), Int8Codec(4), TopKCodec(k=3))
    nb, fb, ib, tb = none.encode(x), f16.encode(x), i8.encode(x), tk.encode(x)
    p = 24  # payload offset of a 1-d int8/topk blob
    return [
        ("empty", none, b""),
        ("short header", none, nb[:7]),
        ("short shape", none, nb[:12]),
        ("truncated payload", none, nb[:-1]),
        ("trailing byte", none, nb + b"\0"),
        ("bad magic", none, b"XX" + nb[2:]),
        ("other codec", none, fb),
        ("unknown codec", none, patch(nb, 2, "<B", 9)),
        ("version", none, patch(nb, 3, "<B", 2)),
        ("dtype code", none, patch(nb, 4, "<B", 0)),
        ("ndim 200", none, patch(nb, 5, "<B", 200)),
        ("reserved", none, patch(nb, 6, "<H", 1)),
        ("shape vs payload", f16, patch(fb, 8, "<Q", 11)),
        ("shape 2**64-1", f16, patch(fb, 8, "<Q", 2**64 - 1)),
        ("block_size 0", i8, patch(ib, 16, "<Q", 0)),
        ("block_size 2**40", i8, patch(ib, 16, "<Q", 2**40)),
        ("block_size vs payload", i8, patch(ib, 16, "<Q", 5)),
        ("negative scale", i8, patch(ib, p, "<f", -1.0)),
        ("nan scale", i8, patch(ib, p + 4, "<f", float("nan"))),
        ("inf scale", i8, patch(ib, p + 8, "<f", float("inf"))),
        ("huge scale", i8, patch(ib, p, "<f", 1e38)),
        ("value -128", i8, patch(ib, p + 12 + 9, "<b", -128)),
        ("k > n", tk, patch(patch(tk.encode(sample((2,))), 16, "<Q", 3), 8, "<Q", 2)),
        ("k vs payload", tk, patch(tb, 16, "<Q", 2)),
        ("index out of range", tk, patch(tb, p + 8, "<I", 10)),
        ("duplicate index", tk, patch(tb, p + 4, "<I", struct.unpack_from("<I", tb, p)[0])),
        ("unsorted index", tk, patch(tb, p, "<I", 9)),
        ("nan value", tk, patch(tb, p + 12, "<f", float("nan"))),
        ("too many elements", get_codec("none", max_elements=5), nb),
    ]


@pytest.mark.parametrize(("label", "codec", "blob"), bad_blobs(), ids=lambda v: str(v)[:30])
def test_bad_blobs_raise_protocol_error(label: str, codec: Codec, blob: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(blob)
    with pytest.raises(ProtocolError):
        codec.decode_into(blob, np.empty(10, np.float32))
