"""Passes over float32 values that check them while they are in cache, and the convex weights.

Every pass over the vector costs as much as a copy (memory bound), so the checks ride along
with a copy or an add that happens anyway: ``copy_finite`` and ``copy_magnitude`` check each
piece right after copying it; the reducer measures each chunk (``magnitude``) right before
adding it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch

from protocol.codecs import Codec, Float16Codec

from .layout import Float32Array

K = TypeVar("K")

FLT_MAX = float(np.finfo(np.float32).max)

PIECE = 1 << 16
"""Elements per piece of the fused copies (256 KiB: still in cache for the second pass)."""


def as_tensor(values: Float32Array) -> torch.Tensor:
    """A torch view of ``values``, read-only ones included (torch only warns about those;
    we never write through the view)."""
    if values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def all_finite(values: Float32Array, zeros: Float32Array) -> bool:
    """True when ``values`` holds no NaN or infinity (one BLAS pass: x . 0 is NaN iff it has
    any; ``zeros`` is a zero array of the same length)."""
    with np.errstate(invalid="ignore"):
        return bool(np.isfinite(np.dot(values, zeros)))


def copy_finite(dst: Float32Array, src: Float32Array, zeros: Float32Array) -> bool:
    """``dst[...] = src``, and whether ``src`` holds no NaN or infinity: each piece is
    checked right after its copy, while in cache (one pass over memory instead of two).
    ``zeros`` is a zero array (pieces are at most its length)."""
    finite = True
    step = max(1, min(PIECE, len(zeros)))
    for i in range(0, len(src), step):
        piece = dst[i : i + step]
        np.copyto(piece, src[i : i + step])
        finite = finite and all_finite(piece, zeros[: len(piece)])
    return finite


def magnitude(values: torch.Tensor) -> float:
    """The largest ``|value|`` (0 when empty); NaN or infinity when ``values`` holds any."""
    if not values.numel():
        return 0.0
    low, high = torch.aminmax(values)  # NaN anywhere: both are NaN
    return max(-float(low), float(high))


def scale_magnitude(dst: Float32Array, src: Float32Array | None, factor: float) -> float:
    """``dst[...] = factor * src`` (``src`` None: ``dst *= factor``), and :func:`magnitude`
    of the result, each piece measured right after it is written (one pass over memory);
    stops at the first piece that is not finite (and returns its magnitude)."""
    largest = 0.0
    for i in range(0, len(dst), PIECE):
        piece = torch.from_numpy(dst[i : i + PIECE])
        if src is not None:
            torch.mul(as_tensor(src[i : i + PIECE]), factor, out=piece)
        elif factor != 1.0:
            piece.mul_(factor)
        size = magnitude(piece)
        if not math.isfinite(size):
            return size
        largest = max(largest, size)
    return largest


def convex_shares(weights: Mapping[K, float]) -> dict[K, float]:
    """Each weight divided by the smallest power of two at least the total weight, rounded
    *down* to a float32: the shares sum to at most 1 (and more than 1/2), so a sum of
    ``share * value`` never exceeds the largest ``|value|`` but by rounding.

    A power of two rather than the total itself: a weight of few significant bits (any
    integer below 2**24, 0.5, 32.0...) then has an exact share, so ``share * value`` is
    exact where the weight times the value is, and the reducer's one division by the
    shares' sum at the end is its only rounding beyond the float32 additions. (Equal
    weights of 2 or 4 peers have shares of exactly 1/2 or 1/4, summing to 1: no division.)
    Any positive finite float64 weights: they are scaled by a power of two near the largest
    first, so the total cannot overflow; a share below float32's smallest subnormal is 0."""
    if not weights:
        return {}
    _, top = math.frexp(max(weights.values()))
    scaled = {key: math.ldexp(weight, -top) for key, weight in weights.items()}  # < 1 each
    fraction, exponent = math.frexp(math.fsum(scaled.values()))
    if fraction == 0.5:  # the total is a power of two itself
        exponent -= 1
    return {key: float32_below(math.ldexp(value, -exponent)) for key, value in scaled.items()}


def float32_below(value: float) -> float:
    """The largest float32 that is ``<= value`` (for ``value >= 0``), as a Python float."""
    rounded = np.float32(value)
    if float(rounded) > value:
        rounded = np.nextafter(rounded, np.float32(0))
    return float(rounded)


def result_limit(codec: Codec) -> float:
    """The largest ``|mean|`` that ``codec`` sends back finite: float32's, or float16's
    (values below 65520 round to at most 65504)."""
    return 65519.0 if isinstance(codec, Float16Codec) else FLT_MAX


def overflow_note(codec: Codec) -> str:
    if isinstance(codec, Float16Codec):
        return "the mean overflows float16 (beyond +-65504): use int8 or none for such values"
    return "the mean overflows float32 (near or beyond +-3.4e38)"
