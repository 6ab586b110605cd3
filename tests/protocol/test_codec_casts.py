"""Codec fast paths: replaceable bulk conversions (``casts``) and ``validate``."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from protocol.codecs import get_codec
from protocol.codecs.casts import NUMPY_CASTS, Casts
from protocol.errors import RemoteProtocolError


def test_codecs_use_their_casts() -> None:
    calls: list[str] = []

    def to_half(src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> None:
        calls.append("half")
        NUMPY_CASTS.to_half(src, dst)

    def to_float(src: npt.NDArray[Any], dst: npt.NDArray[Any]) -> None:
        calls.append(f"float<-{src.dtype}")
        NUMPY_CASTS.to_float(src, dst)

    def scale_rows(src: npt.NDArray[Any], factors: npt.NDArray[Any], dst: npt.NDArray[Any]) -> None:
        calls.append(f"rows{src.shape}")
        NUMPY_CASTS.scale_rows(src, factors, dst)

    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    for name in ("float16", "int8"):
        plain, hooked = get_codec(name), get_codec(name)
        hooked.casts = Casts(to_half=to_half, to_float=to_float, scale_rows=scale_rows)
        assert plain.casts is NUMPY_CASTS
        blob = hooked.encode(x)
        assert blob == plain.encode(x)
        np.testing.assert_array_equal(hooked.decode(blob), plain.decode(blob))
    # float16: one conversion each way; int8 (block 4096): a full block and the tail
    assert calls == [
        "half",
        "float<-float16",
        "rows(1, 4096)",
        "rows(1, 904)",
        "float<-int8",
        "rows(1, 4096)",
        "float<-int8",
        "rows(1, 904)",
    ]


def test_numpy_casts_are_exact() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.float32)
    NUMPY_CASTS.to_float(bits.view(np.float16), out)
    np.testing.assert_array_equal(
        out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32)
    )
    q = np.arange(-127, 128, dtype=np.int8)
    out = np.empty(q.size, np.float32)
    NUMPY_CASTS.to_float(q, out)
    np.testing.assert_array_equal(out, q.astype(np.float32))


def test_validate_checks_without_decoding() -> None:
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    for name in ("none", "float16", "int8", "topk"):
        codec = get_codec(name, fraction=0.1) if name == "topk" else get_codec(name)
        blob = codec.encode(x)
        assert codec.validate(blob).n_elements == 5000
        with pytest.raises(RemoteProtocolError):
            codec.validate(blob[:-1])
    int8 = get_codec("int8")
    blob = bytearray(int8.encode(x))
    blob[-1] = 0x80  # the value -128
    with pytest.raises(RemoteProtocolError, match="-128"):
        int8.validate(blob)
    blob = bytearray(int8.encode(x))
    offset = len(blob) - 5000 - 8  # the first of the two scales
    blob[offset : offset + 4] = np.float32(np.nan).tobytes()
    with pytest.raises(RemoteProtocolError, match="scales"):
        int8.validate(blob)
