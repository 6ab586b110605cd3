"""Bulk dtype conversions that the codecs run, replaceable by faster implementations.

numpy converts float32 to float16 one scalar at a time (~0.5 GB/s here, 20x slower than a
vectorized F16C loop), and ``protocol/`` must not import torch. So a codec instance reads
its conversions from ``codec.casts``: :data:`NUMPY_CASTS` by default; a caller that has a
faster library (``training`` has torch) assigns its own :class:`Casts` to the instance it
uses. A replacement must produce the same values for every finite and infinite input;
NaN stays NaN (its payload bits may differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["NUMPY_CASTS", "Casts"]

AnyArray: TypeAlias = npt.NDArray[Any]

CHUNK_ELEMENTS = 1 << 18
"""Elements converted per step by the float16 table lookup (stays in cache)."""
_HALF_TO_FLOAT: npt.NDArray[np.float32] = (
    np.arange(1 << 16, dtype=np.uint32).astype("<u2").view("<f2").astype(np.float32)
)
"""float32 value of every float16 bit pattern (256 KiB)."""


def _numpy_scale_rows(src: AnyArray, factors: AnyArray, dst: AnyArray) -> None:
    np.multiply(src, factors[:, None], out=dst)


@dataclass(frozen=True, slots=True)
class Casts:
    """The codecs' bulk array operations. Conversions ``dst[...] = src`` between flat,
    C-contiguous arrays of equal size:

    ``to_half(src, dst)``: float32 to float16, rounding to nearest even (beyond float16's
    range: infinity). ``to_float(src, dst)``: float16 or int8 to float32 (exact).

    And ``scale_rows(src, factors, dst)``: ``dst = src * factors[:, None]`` for 2-D float32
    ``src`` and ``dst`` (the same array allowed) and one float32 factor per row, each
    product rounded once (int8's scales; numpy's broadcast multiply runs at half the speed
    of a plain one here).
    """

    to_half: Callable[[AnyArray, AnyArray], None]
    to_float: Callable[[AnyArray, AnyArray], None]
    scale_rows: Callable[[AnyArray, AnyArray, AnyArray], None] = _numpy_scale_rows


def _numpy_to_half(src: AnyArray, dst: AnyArray) -> None:
    with np.errstate(over="ignore"):
        np.copyto(dst, src, casting="same_kind")


def _numpy_to_float(src: AnyArray, dst: AnyArray) -> None:
    if src.dtype.itemsize != 2:
        np.copyto(dst, src, casting="safe")
        return
    # A table lookup on the raw bits, in cache-sized chunks, is about twice as fast as
    # numpy's float16 cast here, and bit-identical to it (NaN payloads included).
    bits = src.view("<u2")
    for start in range(0, bits.size, CHUNK_ELEMENTS):
        stop = start + CHUNK_ELEMENTS
        np.take(_HALF_TO_FLOAT, bits[start:stop], out=dst[start:stop], mode="clip")


NUMPY_CASTS = Casts(to_half=_numpy_to_half, to_float=_numpy_to_float)
"""Pure numpy conversions (bit-exact, NaN payloads included); every codec's default."""
