"""Codec blobs re-implemented from docs/protocol.md section 9.1 alone, checked against ours.

The encoders and decoders below were written from the text of section 9.1 (and the limits
table of section 10), without reading `protocol/codecs/*.py`: if they agree with the library
byte for byte and bit for bit, the text is enough to write an interoperable peer. The one
disagreement found (which NaN float16 gives) is settled in the text now: a NaN of
unspecified sign and payload.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from protocol.codecs import get_codec
from protocol.errors import ProtocolError

F32 = npt.NDArray[np.float32]
Params = dict[str, Any]

# --- constants, as section 9.1 and section 10 state them -------------------------------------

MAGIC = b"SC"
CODEC_IDS = {"none": 0, "float16": 1, "int8": 2, "topk": 3}
VERSION = 1
DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.float16): 2, np.dtype(np.float64): 3}
MAX_NDIM = 32
SHAPE_BOUND = 2**32
DEFAULT_MAX_ELEMENTS = 2**28
DEFAULT_BLOCK_SIZE = 4096  # section 10: "int8 block_size ... (default 4096)"
MAX_BLOCK_SIZE = 2**31
MAX_SCALE = np.array([0x7C010203], dtype=np.uint32).view(np.float32)[0]
MIN_NORMAL = np.float32(2.0**-126)
FLT_MAX = np.finfo(np.float32).max
DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


class SpecError(Exception):
    """Our from-the-text decoder refusing a blob (section 9.1, "A decoder refuses")."""


# --- float16, by hand: the text says "rounded to nearest even", not "what numpy does" --------


def _float_to_half_bits(x: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    """IEEE half bits of float32 or float64 values: round to nearest even, overflow to
    infinity, NaN kept as a quiet NaN (IEEE 754 6.2.3) with its sign and top payload bits."""
    if x.dtype == np.float16:
        return x.view(np.uint16).copy()
    if x.dtype == np.float32:
        bits = x.view(np.uint32).astype(np.int64)
        mant_bits, exp_bits, bias = 23, 8, 127
    else:
        bits = x.astype(np.float64).view(np.uint64)
        mant_bits, exp_bits, bias = 52, 11, 1023
    ubits = bits.astype(np.uint64)
    sign = ((ubits >> np.uint64(mant_bits + exp_bits)) & np.uint64(1)).astype(np.int64) << 15
    exp = ((ubits >> np.uint64(mant_bits)) & np.uint64((1 << exp_bits) - 1)).astype(np.int64)
    mant = (ubits & np.uint64((1 << mant_bits) - 1)).astype(np.int64)
    exp_max = (1 << exp_bits) - 1
    out = np.zeros(x.shape, dtype=np.int64)
    finite = (exp > 0) & (exp < exp_max)  # zeros and subnormals of the source round to 0
    # value = m * 2**e2 exactly; the half quantum at that value is 2**q.
    m = mant | (1 << mant_bits)
    e2 = exp - bias - mant_bits
    q = np.maximum(exp - bias - 10, -24)
    shift = np.clip(q - e2, 1, 62)  # >= mant_bits - 10 > 0 for every finite input
    r = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    r = r + ((rem > half) | ((rem == half) & ((r & 1) == 1))).astype(np.int64)
    # r * 2**q in half bits is ((q + 24) << 10) + r, continuous across the subnormal edge
    # and the binade edges; 0x7C00 and above is infinity.
    halfbits = np.minimum(((q + 24) << 10) + r, 0x7C00)
    out[finite] = halfbits[finite]
    inf = (exp == exp_max) & (mant == 0)
    out[inf] = 0x7C00
    nan = (exp == exp_max) & (mant != 0)
    out[nan] = 0x7E00 | (mant[nan] >> (mant_bits - 10))
    return (out | sign).astype(np.uint16)


def _half_bits_to_float32(h: npt.NDArray[np.uint16]) -> F32:
    """Float32 values of IEEE half bits: exact, NaN payload kept and quieted (IEEE 754)."""
    h32 = h.astype(np.uint32)
    sign = (h32 >> 15) << 31
    exp = (h32 >> 10) & 0x1F
    frac = h32 & 0x3FF
    normal = ((exp + 112) << 23) | (frac << 13)  # 112 = 127 - 15
    special = np.uint32(0x7F800000) | (frac << 13)
    special = np.where(frac != 0, special | np.uint32(0x00400000), special)
    sub = (frac.astype(np.float64) * 2.0**-24).astype(np.float32).view(np.uint32)
    bits = np.where(exp == 0, sub, np.where(exp == 0x1F, special, normal)).astype(np.uint32)
    return (bits | sign).astype(np.uint32).view(np.float32)


# --- the encoder, from the text --------------------------------------------------------------


def _topk_k(n: int, params: Params) -> int:
    """The text's "`k` being the codec's `k` or `ceil(fraction x n)`, at most `n`", with
    fraction x n the float64 product."""
    k = int(params["k"]) if "k" in params else math.ceil(float(params["fraction"]) * n)
    return min(k, n)


def spec_encode(name: str, params: Params, x: npt.NDArray[Any]) -> bytes:
    """A blob of `x` as section 9.1 describes it: header, then the codec's payload."""
    dtype_code = DTYPE_CODES[x.dtype]
    shape = x.shape
    n = math.prod(shape)
    if name == "float16":
        payload = _float_to_half_bits(np.ascontiguousarray(x).reshape(-1)).astype("<u2")
        param: int | None = None
        body = payload.tobytes()
    else:
        v = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if name == "none":
            param, body = None, v.astype("<f4").tobytes()
        elif name == "int8":
            if not np.all(np.isfinite(v)):
                raise ValueError("int8 refuses NaN and infinity")
            param = int(params.get("block_size", DEFAULT_BLOCK_SIZE))
            body = _int8_payload(v, param)
        elif name == "topk":
            if not np.all(np.isfinite(v)):
                raise ValueError("topk refuses NaN and infinity")
            param = _topk_k(n, params)
            body = _topk_payload(v, param)
        else:
            raise AssertionError(name)
    header = struct.pack("<2sBBBBH", MAGIC, CODEC_IDS[name], VERSION, dtype_code, len(shape), 0)
    header += struct.pack(f"<{len(shape)}Q", *shape)
    if param is not None:
        header += struct.pack("<Q", param)
    return header + body


def _int8_payload(v: F32, block: int) -> bytes:
    """Per block: scale = absmax / 127 in float32, capped at the largest scale, below the
    smallest normal sent as 0 with values 0; q = rint(x * (1 / scale)) in float32."""
    n = v.size
    if n == 0:
        return b""
    starts = np.arange(0, n, block, dtype=np.int64)
    absmax = np.maximum.reduceat(np.abs(v), starts)
    scale = (absmax / np.float32(127)).astype(np.float32)
    scale = np.minimum(scale, MAX_SCALE)
    scale = np.where(scale < MIN_NORMAL, np.float32(0), scale).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    per = np.arange(n, dtype=np.int64) // block
    q = np.rint(v * inv[per]).astype(np.float32)
    assert np.all(np.abs(q) <= 127), "the text's q leaves [-127, 127]"
    return scale.astype("<f4").tobytes() + q.astype(np.int8).tobytes()


def _topk_payload(v: F32, k: int) -> bytes:
    """The k largest magnitudes (ties: the lower index): indices ascending, then values."""
    mags = np.abs(v).view(np.uint32).astype(np.int64)  # finite, sign cleared: order-preserving
    order = np.argsort(-mags, kind="stable")
    idx = np.sort(order[:k])
    return idx.astype("<u4").tobytes() + v[idx].astype("<f4").tobytes()


# --- the decoder, from the text --------------------------------------------------------------


def spec_decode(name: str, blob: bytes, max_elements: int = DEFAULT_MAX_ELEMENTS) -> F32:
    """Decode a blob expected to be of codec `name`, refusing what section 9.1 refuses."""
    if len(blob) < 8:
        raise SpecError("shorter than its header")
    magic, cid, version, dtype_code, ndim, reserved = struct.unpack_from("<2sBBBBH", blob)
    if magic != MAGIC:
        raise SpecError("magic")
    if cid not in CODEC_IDS.values():
        raise SpecError("codec id")
    if cid != CODEC_IDS[name]:
        raise SpecError("another codec than expected")
    if version != VERSION:
        raise SpecError("version")
    if dtype_code not in DTYPE_CODES.values():
        raise SpecError("dtype code")
    if ndim > MAX_NDIM:
        raise SpecError("ndim")
    if reserved != 0:
        raise SpecError("reserved")
    has_param = name in ("int8", "topk")
    header_len = 8 + 8 * ndim + (8 if has_param else 0)
    if len(blob) < header_len:
        raise SpecError("shorter than its header")
    shape = struct.unpack_from(f"<{ndim}Q", blob, 8)
    if math.prod(max(d, 1) for d in shape) > SHAPE_BOUND:
        raise SpecError("shape product")
    n = math.prod(shape)
    if n > max_elements:
        raise SpecError("max_elements")
    param = struct.unpack_from("<Q", blob, 8 + 8 * ndim)[0] if has_param else 0
    payload = blob[header_len:]
    if name == "none":
        if len(payload) != 4 * n:
            raise SpecError("payload size")
        flat = np.frombuffer(payload, dtype="<f4").astype(np.float32)
    elif name == "float16":
        if len(payload) != 2 * n:
            raise SpecError("payload size")
        flat = _half_bits_to_float32(np.frombuffer(payload, dtype="<u2").astype(np.uint16))
    elif name == "int8":
        flat = _int8_decode(payload, n, param)
    else:
        flat = _topk_decode(payload, n, param)
    return flat.reshape(shape)


def _int8_decode(payload: bytes, n: int, block: int) -> F32:
    """Scales then int8 values; refuses bad block sizes, bad scales and -128."""
    if block == 0 or block > MAX_BLOCK_SIZE:
        raise SpecError("block_size")
    blocks = -(-n // block)
    if len(payload) != n + 4 * blocks:
        raise SpecError("payload size")
    scale = np.frombuffer(payload, dtype="<f4", count=blocks).astype(np.float32)
    q = np.frombuffer(payload, dtype=np.int8, offset=4 * blocks)
    if np.any(np.isnan(scale)) or np.any(scale < 0) or np.any(scale > MAX_SCALE):
        raise SpecError("scale")
    if np.any(q == -128):
        raise SpecError("-128")
    per = np.arange(n, dtype=np.int64) // block
    return (q.astype(np.float32) * scale[per]).astype(np.float32)


def _topk_decode(payload: bytes, n: int, k: int) -> F32:
    """k indices then k values; every other element 0."""
    if k > n:
        raise SpecError("k > n")
    if len(payload) != 8 * k:
        raise SpecError("payload size")
    idx = np.frombuffer(payload, dtype="<u4", count=k).astype(np.int64)
    vals = np.frombuffer(payload, dtype="<f4", offset=4 * k).astype(np.float32)
    if k and (np.any(np.diff(idx) <= 0) or idx[-1] >= n):
        raise SpecError("indices")
    if not np.all(np.isfinite(vals)):
        raise SpecError("non-finite value")
    out = np.zeros(n, dtype=np.float32)
    out[idx] = vals
    return out


# --- inputs ----------------------------------------------------------------------------------

CONFIGS: list[tuple[str, Params]] = [
    ("none", {}),
    ("float16", {}),
    ("int8", {}),
    ("int8", {"block_size": 1}),
    ("int8", {"block_size": 7}),
    ("int8", {"block_size": 256}),
    ("int8", {"block_size": MAX_BLOCK_SIZE}),
    ("topk", {"k": 1}),
    ("topk", {"k": 7}),
    ("topk", {"k": 1000}),
    ("topk", {"fraction": 0.01}),
    ("topk", {"fraction": 0.07}),
    ("topk", {"fraction": 0.5}),
    ("topk", {"fraction": 1.0}),
]
SHAPES: list[tuple[int, ...]] = [
    *[(n,) for n in (0, 1, 2, 6, 7, 8, 100, 255, 256, 257, 3001, 4095, 4096, 4097, 8193)],
    (100_003,),
    (),
    (3, 0, 5),
    (2, 3, 4),
    (17, 33),
    (2, 2, 2, 2, 2),
]
KINDS = ["normal", "tiny", "huge", "zeros", "constant", "wide", "ties", "mixed"]


def _cid(config: tuple[str, Params]) -> str:
    name, params = config
    return name + "".join(f"-{k}={v}" for k, v in params.items())


@functools.cache
def make(kind: str, shape: tuple[int, ...]) -> F32:
    """A seeded float32 array of `kind`; read-only so that no test changes a shared one."""
    n = math.prod(shape)
    rng = np.random.default_rng([KINDS.index(kind), n, len(shape)])
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), n)
    if kind == "normal":
        v = rng.standard_normal(n).astype(np.float32)
    elif kind == "tiny":  # subnormals and values around the int8 zero-scale edge, 127 * 2**-126
        sub = rng.integers(1, 0x800000, n, dtype=np.uint32).view(np.float32)
        edge = np.float32(127 * 2.0**-126) * rng.uniform(0.98, 1.02, n).astype(np.float32)
        v = np.where(rng.random(n) < 0.5, sub, edge).astype(np.float32) * sign
    elif kind == "huge":
        v = (FLT_MAX * rng.uniform(0.5, 1.0, n)).astype(np.float32) * sign
        if n:
            v[rng.integers(0, n, max(1, n // 50))] = FLT_MAX
            v[rng.integers(0, n, max(1, n // 50))] = -FLT_MAX
    elif kind == "zeros":
        v = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    elif kind == "constant":  # runs of one value, some runs zero
        vals = rng.standard_normal(n // 37 + 1).astype(np.float32)
        vals[::3] = 0
        v = np.repeat(vals, 37)[:n]
    elif kind == "wide":  # every finite float32 magnitude, mixed signs
        bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0xBFFFFFFF, bits)
        v = bits.astype(np.uint32).view(np.float32)
    elif kind == "ties":  # many equal magnitudes, both signs
        v = rng.integers(-3, 4, n).astype(np.float32)
    else:  # mixed: normal values with spikes and tiny ones
        v = rng.standard_normal(n).astype(np.float32)
        v *= np.float32(10.0) ** rng.integers(-40, 38, n).astype(np.float32)
        v = np.where(np.isfinite(v), v, np.float32(1.0)).astype(np.float32)
    out = np.ascontiguousarray(v, dtype=np.float32).reshape(shape)
    out.flags.writeable = False
    return out


def _bits(a: npt.NDArray[Any]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same(got: npt.NDArray[Any], want: F32) -> None:
    """Equal dtype, shape and float32 bits (NaN payloads and signed zeros included)."""
    assert got.dtype == np.float32
    assert got.shape == want.shape
    assert np.array_equal(_bits(got), _bits(want))


# --- (a), (b), (c): both directions on many arrays -------------------------------------------

CASES = [
    pytest.param(config, kind, shape, id=f"{_cid(config)}-{kind}-{'x'.join(map(str, shape))}")
    for config in CONFIGS
    for kind in KINDS
    for shape in SHAPES
]


@pytest.mark.parametrize(("config", "kind", "shape"), CASES)
def test_encoders_and_decoders_agree(
    config: tuple[str, Params], kind: str, shape: tuple[int, ...]
) -> None:
    """(a) our bytes are the library's; (b) we decode its blob to its own decode, bit for bit;
    (c) it decodes our blob to what we decode it to."""
    name, params = config
    x = make(kind, shape)
    codec = get_codec(name, **params)
    theirs = codec.encode(x)
    ours = spec_encode(name, params, x)
    assert ours == theirs, "(a) encoder bytes differ"
    assert_same(spec_decode(name, theirs), codec.decode(theirs))  # (b)
    assert_same(codec.decode(ours), spec_decode(name, ours))  # (c)
    if len(shape) == 1:
        assert codec.encoded_size(shape[0]) == len(ours)


def _bits_f32(*words: int) -> F32:
    return np.array(words, dtype=np.uint32).view(np.float32)


def _float16_edges() -> F32:
    """Halfway points, overflow edges, subnormal edges and quiet NaNs for the float16 text."""
    vals: list[float] = [0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 65536.0, 1e6]
    vals += [2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 2.0**-14, 2.0**-14 * 0.9999]
    vals += [1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-11 + 2.0**-23, 3 * 2.0**-25, 5 * 2.0**-25]
    vals += [math.inf, -math.inf, math.nan]
    edges = np.array(vals, dtype=np.float32)
    quiet = _bits_f32(0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFE02000)
    rng = np.random.default_rng(16)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits = np.where((bits & 0x7F800000) == 0x7F800000, bits | 0x00400000, bits)  # quiet NaNs
    near = rng.integers(0x33000000, 0x47800000, 100_000, dtype=np.uint32) & ~np.uint32(0xFFF)
    near = near | np.uint32(0x1000)  # exact float16 halfway points of normal halves
    return np.concatenate([edges, quiet, bits.view(np.float32), near.view(np.float32)])


def assert_same_but_nan_bits(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> None:
    """Equal float32 bits, except that a NaN only has to be a NaN: 9.1 leaves a float16 NaN's
    sign and payload unspecified (numpy keeps them unquieted, torch does not)."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))
    assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_float16_rounding_edges() -> None:
    """Round to nearest even, overflow past 65504, subnormal halves and quiet NaNs."""
    x = _float16_edges()
    codec = get_codec("float16")
    theirs = codec.encode(x)
    assert spec_encode("float16", {}, x) == theirs
    assert_same(spec_decode("float16", theirs), codec.decode(theirs))


def _every_half(signaling: bool) -> npt.NDArray[np.float16]:
    """All half bit patterns that are (or are not) signaling NaNs: exponent 31, frac in
    [1, 0x1FF]."""
    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0) & ((h & 0x200) == 0)
    return h[snan == signaling].view(np.float16)


@pytest.mark.parametrize("signaling", [False, True], ids=["other", "snan"])
def test_float16_decodes_every_half(signaling: bool) -> None:
    """Every half bit pattern decodes the same way: 64,514 of them, then the 1,022 sNaNs
    (any NaN for those: which one the text leaves open)."""
    blob = spec_encode("float16", {}, _every_half(signaling))
    assert blob[4] == DTYPE_CODES[np.dtype(np.float16)]
    codec = get_codec("float16")
    if signaling:
        assert_same_but_nan_bits(spec_decode("float16", blob), codec.decode(blob))
    else:
        assert_same(spec_decode("float16", blob), codec.decode(blob))


def test_float16_encodes_signaling_nans_as_nans() -> None:
    """A float32 signaling NaN becomes a half NaN; which one, the text leaves open."""
    x = _bits_f32(0x7F800001, 0x7FA00000, 0xFF800001, 0x7FBFFFFF)
    halves = np.frombuffer(get_codec("float16").encode(x)[-8:], dtype="<f2")
    assert np.isnan(halves).all()
    ours = np.frombuffer(spec_encode("float16", {}, x)[-8:], dtype="<f2")
    assert np.isnan(ours).all()


def test_none_carries_every_nan_bit() -> None:
    """`none` is the float32 values themselves: signaling NaNs and payloads go through."""
    x = _bits_f32(0x7F800001, 0xFFBFFFFF, 0x7FC00001, 0x7F800000, 0xFF800000, 0x80000000)
    codec = get_codec("none")
    theirs = codec.encode(x)
    assert spec_encode("none", {}, x) == theirs
    assert_same(codec.decode(theirs), x)
    assert_same(spec_decode("none", theirs), x)


def test_worked_examples() -> None:
    """The two hex dumps at the end of section 9.1, for [1, -2, 0.5]."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split("### 9.1 Codec blobs", 1)[1].split("### 9.2", 1)[0]
    dump = block.split("```", 2)[1]
    x = np.array([1, -2, 0.5], dtype=np.float32)
    examples: dict[str, bytes] = {}
    lines = [ln for ln in dump.splitlines() if ln.strip()]
    for first, second in zip(lines[::2], lines[1::2], strict=True):
        label, hex1 = first.split(":", 1)
        hex2 = re.split(r"\s{3,}", second.strip())[0]
        examples[label.strip()] = bytes.fromhex(hex1 + hex2)
    assert set(examples) == {"int8, block_size 2", "topk, k 2"}
    for label, params in (("int8, block_size 2", {"block_size": 2}), ("topk, k 2", {"k": 2})):
        name = label.split(",")[0]
        assert spec_encode(name, params, x) == examples[label]
        assert get_codec(name, **params).encode(x) == examples[label]


@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
def test_any_memory_order_encodes_in_c_order(config: tuple[str, Params]) -> None:
    """The payload is "in C order": a transposed or strided view encodes as its copy would."""
    name, params = config
    base = np.array(make("normal", (17, 33)))
    codec = get_codec(name, **params)
    for x in (base.T, base[::2, 1::3], base[:, ::-1]):
        assert spec_encode(name, params, x) == codec.encode(x)
        assert codec.encode(x) == codec.encode(np.ascontiguousarray(x))


@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_input_dtypes(config: tuple[str, Params], dtype: type[np.floating[Any]]) -> None:
    """The dtype code is the input's; float64 rounds straight to half under `float16`
    ("rounded to nearest even" of the value), and to float32 first under the others."""
    name, params = config
    rng = np.random.default_rng(64)
    x = (rng.standard_normal(5000) * 10.0 ** rng.integers(-6, 5, 5000)).astype(dtype)
    if dtype is np.float64:
        x[:4] = [1 + 2.0**-11 + 2.0**-40, -(1 + 2.0**-11 + 2.0**-40), 1e-300, 65519.99999]
    codec = get_codec(name, **params)
    theirs = codec.encode(x)
    assert theirs[4] == DTYPE_CODES[np.dtype(dtype)]
    assert spec_encode(name, params, x) == theirs
    assert_same(spec_decode(name, theirs), codec.decode(theirs))


# "k being the codec's k or ceil(fraction x n)": fraction x n as the float64 product.
TOPK_FRACTIONS = [(0.07, 100, 8), (0.1, 10, 1), (0.29, 100, 29), (0.5, 3, 2), (1e-9, 5, 1)]


@pytest.mark.parametrize(("fraction", "n", "k"), TOPK_FRACTIONS)
def test_topk_fraction_k(fraction: float, n: int, k: int) -> None:
    """The header's k is ceil of the float64 product (0.07 x 100 is 7.000000000000001: 8)."""
    x = make("normal", (n,))
    assert _topk_k(n, {"fraction": fraction}) == k
    blob = get_codec("topk", fraction=fraction).encode(x)
    assert struct.unpack_from("<Q", blob, 16)[0] == k
    assert spec_encode("topk", {"fraction": fraction}, x) == blob


def _encode_refused(name: str, params: Params, x: F32) -> bool:
    """Whether the library's encoder refuses `x` (the text names no exception type)."""
    try:
        get_codec(name, **params).encode(x)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] in ("int8", "topk")], ids=_cid)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_int8_and_topk_encoders_refuse_non_finite(config: tuple[str, Params], bad: float) -> None:
    """The text's "Both refuse NaN and infinity", wherever it sits in the array."""
    name, params = config
    for where in (0, 4095, 4999):
        x = np.array(make("normal", (5000,)))
        x[where] = bad
        assert _encode_refused(name, params, x)
        with pytest.raises(ValueError):
            spec_encode(name, params, x)


@pytest.mark.parametrize("name", ["none", "float16"])
def test_none_and_float16_encode_non_finite(name: str) -> None:
    """The text's "`none` and `float16` carry NaN and infinity"."""
    x = np.array([math.nan, math.inf, -math.inf, 1.0], dtype=np.float32)
    codec = get_codec(name)
    blob = codec.encode(x)
    assert blob == spec_encode(name, {}, x)
    assert_same(codec.decode(blob), spec_decode(name, blob))


# --- (d): what the text says a decoder refuses, and what it does not -------------------------


def raw_blob(
    cid: int,
    shape: tuple[int, ...],
    payload: bytes,
    *,
    param: int | None = None,
    magic: bytes = MAGIC,
    version: int = VERSION,
    dtype: int = 1,
    reserved: int = 0,
) -> bytes:
    """A blob laid out field by field from the header table, any field set to anything."""
    head = struct.pack("<2sBBBBH", magic, cid, version, dtype, len(shape), reserved)
    head += struct.pack(f"<{len(shape)}Q", *shape)
    if param is not None:
        head += struct.pack("<Q", param)
    return head + payload


def f32(*values: float) -> bytes:
    """Little-endian float32 bytes."""
    return np.array(values, dtype="<f4").tobytes()


def u32(*values: int) -> bytes:
    """Little-endian u32 bytes (u32 bit patterns of float32s, or topk indices)."""
    return np.array(values, dtype="<u4").tobytes()


def i8(*values: int) -> bytes:
    """int8 bytes."""
    return np.array(values, dtype=np.int8).tobytes()


# A valid blob of each codec, shape (2, 3), n = 6, that the cases below break one way each.
PAYLOADS: dict[str, tuple[bytes, int | None]] = {
    "none": (f32(1, -2, 0.5, 0, 3, 4), None),
    "float16": (np.array([1, -2, 0.5, 0, 3, 4], dtype="<f2").tobytes(), None),
    "int8": (f32(0.5, 0.25) + i8(1, -2, 3, 127, -127, 0), 4),
    "topk": (u32(0, 2, 5) + f32(1, -2, 0.5), 3),
}
PARAMS: dict[str, Params] = {"none": {}, "float16": {}, "int8": {"block_size": 4}, "topk": {"k": 3}}


def valid(name: str, **fields: Any) -> bytes:
    """The valid (2, 3) blob of `name`, with some header fields replaced."""
    payload, param = PAYLOADS[name]
    kw: dict[str, Any] = {"param": param, **fields}
    shape = kw.pop("shape", (2, 3))
    payload = kw.pop("payload", payload)
    return raw_blob(CODEC_IDS[name], shape, payload, **kw)


def malformed() -> list[Any]:
    """(name, max_elements, blob) that section 9.1's "A decoder refuses" list refuses."""
    out: list[Any] = []

    def add(name: str, label: str, blob: bytes, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        out.append(pytest.param(name, max_elements, blob, id=f"{name}-{label}"))

    for name in CODEC_IDS:
        base = valid(name)
        header_len = len(base) - len(PAYLOADS[name][0])
        for magic in (b"SD", b"CS", b"\0\0", b"sc"):
            add(name, f"magic-{magic.hex()}", valid(name, magic=magic))
        for other, cid in CODEC_IDS.items():
            if other != name:
                add(name, f"codec-{other}", valid(other))
                add(name, f"codec-id-{cid}", raw_blob(cid, (2, 3), PAYLOADS[name][0]))
        for cid in (4, 255):
            add(name, f"codec-id-{cid}", base[:2] + bytes([cid]) + base[3:])
        for version in (0, 2, 255):
            add(name, f"version-{version}", valid(name, version=version))
        for dtype in (0, 4, 255):
            add(name, f"dtype-{dtype}", valid(name, dtype=dtype))
        add(name, "ndim-33", valid(name, shape=(1,) * 32 + (6,)))
        add(name, "ndim-255", base[:5] + b"\xff" + base[6:])
        add(name, "reserved-6", base[:6] + b"\x01\x00" + base[8:])
        add(name, "reserved-7", base[:6] + b"\x00\x80" + base[8:])
        for cut in range(header_len):
            add(name, f"short-{cut}", base[:cut])
        for shape in [
            (2**32 + 1,),
            (2**16, 2**16 + 1),
            (0, 2**32 + 1),
            (2**33, 0, 2),
            (2**64 - 1,),
        ]:
            add(name, f"shape-{'x'.join(map(str, shape))}", valid(name, shape=shape, payload=b""))
        add(name, "max-elements-5", base, max_elements=5)
        add(name, "payload-plus-1", base + b"\0")
        add(name, "payload-plus-8", base + bytes(8))
        add(name, "payload-minus-1", base[:-1])
        add(name, "payload-empty", base[:header_len])

    q = i8(1, -2, 3, 127, -127, 0)
    for block in (0, MAX_BLOCK_SIZE + 1, 2**63, 2**64 - 1):
        add("int8", f"block-{block}", valid("int8", param=block))
    add("int8", "block-1-too-few-scales", valid("int8", param=1))
    for word in (
        0xBF800000,
        0x80000001,
        0xFF800000,
        0x7FC00000,
        0x7F800001,
        0xFFC00000,
        0x7F800000,
        0x7C010204,
        0x7F7FFFFF,
    ):
        add("int8", f"scale-{word:08x}", valid("int8", payload=u32(0x3F000000, word) + q))
    for at in (0, 3, 5):
        bad = bytearray(q)
        bad[at] = 0x80
        add("int8", f"q-128-at-{at}", valid("int8", payload=f32(0.5, 0.25) + bytes(bad)))
    topk_bad = {
        "k-7": (u32(*range(7)) + f32(*[1] * 7), 7),
        "k-2**32": (b"", 2**32),
        "repeated": (u32(0, 2, 2) + f32(1, 2, 3), 3),
        "decreasing": (u32(0, 5, 2) + f32(1, 2, 3), 3),
        "index-n": (u32(0, 2, 6) + f32(1, 2, 3), 3),
        "index-max": (u32(0, 2, 2**32 - 1) + f32(1, 2, 3), 3),
        "nan": (u32(0, 2, 5) + u32(0x3F800000, 0x7FC00000, 0x3F800000), 3),
        "snan": (u32(0, 2, 5) + u32(0x3F800000, 0x7F800001, 0x3F800000), 3),
        "inf": (u32(0, 2, 5) + f32(1, math.inf, 1), 3),
        "-inf": (u32(0, 2, 5) + f32(-math.inf, 1, 1), 3),
        "k-2-payload-of-3": (PAYLOADS["topk"][0], 2),
    }
    for label, (payload, k) in topk_bad.items():
        add("topk", label, valid("topk", payload=payload, param=k))
    return out


@pytest.mark.parametrize(("name", "max_elements", "blob"), malformed())
def test_malformed_blobs_are_refused(name: str, max_elements: int, blob: bytes) -> None:
    """(d) Both decoders refuse each blob the text lists, the library with a ProtocolError."""
    codec = get_codec(name, **PARAMS[name], max_elements=max_elements)
    with pytest.raises(ProtocolError):
        codec.decode(blob)
    with pytest.raises(SpecError):
        spec_decode(name, blob, max_elements)


def accepted() -> list[Any]:
    """(name, max_elements, blob) that no clause of the refusal list covers: both decode them,
    to the same bits."""
    out: list[Any] = []

    def add(
        name: str,
        label: str,
        blob: bytes,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        out.append(pytest.param(name, max_elements, blob, id=f"{name}-{label}"))

    for name in PAYLOADS:
        add(name, "base", valid(name))
        for dtype in (2, 3):
            add(name, f"dtype-{dtype}", valid(name, dtype=dtype))
        add(name, "max-elements-6", valid(name), max_elements=6)
        shape32 = (1,) * 31 + (6,)
        add(name, "ndim-32", valid(name, shape=shape32))
        for shape in [(0, 2**32), (2**16, 2**16, 0), (0,), (0, 0, 0, 2**31)]:
            param = {"int8": 4, "topk": 0}.get(name)
            add(
                name,
                f"shape-{'x'.join(map(str, shape))}",
                valid(name, shape=shape, payload=b"", param=param),
            )
    add("none", "scalar", raw_blob(0, (), f32(-3.5)))
    add("float16", "scalar", raw_blob(1, (), np.array([65504], dtype="<f2").tobytes()))
    add(
        "none",
        "nan-payloads",
        valid("none", payload=u32(0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x80000000, 1)),
    )
    q = i8(1, -2, 3, 127, -127, 0)
    for block in (1, 2, 5, 6, 7, MAX_BLOCK_SIZE):
        blocks = -(-6 // block)
        scales = f32(*[0.5 + j for j in range(blocks)])
        add("int8", f"block-{block}", valid("int8", param=block, payload=scales + q))
    # -0.0 is not 'negative' (-0.0 < 0 is false): nothing refuses it.
    for word in (0x7C010203, 0x00000001, 0x007FFFFF, 0x00000000, 0x7C000000, 0x80000000):
        add("int8", f"scale-{word:08x}", valid("int8", payload=u32(word, word) + q))
    add("int8", "scalar", raw_blob(2, (), f32(0.25) + i8(-127), param=4096))
    for k, payload in [(0, b""), (1, u32(5) + f32(-0.0)), (6, u32(*range(6)) + f32(*range(6)))]:
        add("topk", f"k-{k}", valid("topk", param=k, payload=payload))
    add("topk", "scalar", raw_blob(3, (), u32(0) + f32(-7.0), param=1))
    add(
        "topk",
        "huge-values",
        valid("topk", payload=u32(1, 3, 4) + u32(0x7F7FFFFF, 0xFF7FFFFF, 0x00000001)),
    )
    return out


@pytest.mark.parametrize(("name", "max_elements", "blob"), accepted())
def test_blobs_the_text_does_not_refuse(name: str, max_elements: int, blob: bytes) -> None:
    """Nothing in the refusal list covers these (another dtype code, ndim 32, a zero
    dimension beside a huge one, another block_size or k than the codec's own, the largest
    scale, subnormal scales, scale 0 or -0.0 with q != 0, -0.0 values): both decode them alike."""
    codec = get_codec(name, **PARAMS[name], max_elements=max_elements)
    assert_same(codec.decode(blob), spec_decode(name, blob, max_elements))


def test_int8_zero_and_capped_scales() -> None:
    """Blocks whose absmax / 127 is below 2**-126 go out as scale 0 with q 0; blocks at the
    float32 limit are capped at the largest scale, bits 0x7C010203."""
    edge = np.float32(127 * 2.0**-126)
    x = np.array(
        [
            edge,
            -edge * np.float32(0.999),
            np.nextafter(edge, np.float32(0)),
            0,
            FLT_MAX,
            -FLT_MAX,
            np.float32(2.0**-149),
            -np.float32(2.0**-149),
        ],
        dtype=np.float32,
    )
    codec = get_codec("int8", block_size=2)
    blob = codec.encode(x)
    assert blob == spec_encode("int8", {"block_size": 2}, x)
    scales = np.frombuffer(blob, dtype="<u4", count=4, offset=24)
    assert scales[2] == 0x7C010203 and scales[3] == 0
    assert_same(codec.decode(blob), spec_decode("int8", blob))


def test_int8_multiplies_by_the_reciprocal() -> None:
    """The text's "q = rint(x x (1 / scale)) in float32" is not rint(x / scale): near-ties
    where the two differ are encoded by the text's reading."""
    rng = np.random.default_rng(127)
    n = 200_000
    absmax = rng.uniform(0.5, 2.0, n).astype(np.float32)
    scale = (absmax / np.float32(127)).astype(np.float32)
    tie = ((rng.integers(-127, 127, n) + np.float32(0.5)) * scale).astype(np.float32)
    x = (tie + rng.integers(-2, 3, n) * np.spacing(tie)).astype(np.float32)
    x = np.clip(x, -absmax, absmax)
    by_reciprocal = np.rint(x * (np.float32(1) / scale).astype(np.float32))
    differ = np.nonzero(by_reciprocal != np.rint(x / scale))[0]
    assert differ.size >= 100
    pairs = np.stack([absmax[differ], x[differ]], axis=1).reshape(-1)
    codec = get_codec("int8", block_size=2)
    blob = codec.encode(pairs)
    assert blob == spec_encode("int8", {"block_size": 2}, pairs)
    assert_same(codec.decode(blob), spec_decode("int8", blob))


@pytest.mark.parametrize("config", CONFIGS, ids=_cid)
def test_no_blob_the_text_refuses_is_made(config: tuple[str, Params]) -> None:
    """The text says nothing of the encoder's limits, but whatever the library's encoder
    returns for 33 dimensions or more than `max_elements` must pass the text's decoder."""
    name, params = config
    for x, max_elements in (
        (np.zeros((1,) * 33, np.float32), DEFAULT_MAX_ELEMENTS),
        (np.zeros(11, np.float32), 10),
    ):
        try:
            blob = get_codec(name, **params, max_elements=max_elements).encode(x)
        except Exception:
            continue
        spec_decode(name, blob, max_elements)
