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
from fractions import Fraction
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


def scale_magnitude(dst: np.ndarray, src: Float32Array | None, factor: float) -> float:
    """``dst[...] = factor * src`` (``src`` None: ``dst *= factor``), and :func:`magnitude`
    of the result, each piece measured right after it is written (one pass over memory);
    stops at the first piece that is not finite (and returns its magnitude). A float64
    ``dst`` gets the product in float64 (not a float32 product widened)."""
    largest = 0.0
    widen = dst.dtype != np.float32
    for i in range(0, len(dst), PIECE):
        piece = torch.from_numpy(dst[i : i + PIECE])
        if src is not None and widen:
            piece.copy_(as_tensor(src[i : i + PIECE]))
            piece.mul_(factor)
        elif src is not None:
            torch.mul(as_tensor(src[i : i + PIECE]), factor, out=piece)
        elif factor != 1.0:
            piece.mul_(factor)
        size = magnitude(piece)
        if not math.isfinite(size):
            return size
        largest = max(largest, size)
    return largest


def convex_shares(weights: Mapping[K, float], own: K | None = None) -> dict[K, float]:
    """Each sender's factor in the reducer's float32 sum: float32 values in [0, 1] that sum
    to at most 1 (and to about 1/2 or more), so a sum of ``share * value`` never exceeds the
    largest ``|value|`` but by rounding, whatever the weights (any positive finite float64;
    a share below float32's smallest subnormal is 0).

    The reducer adds the others with a fused multiply-add (exact products) but scales its
    own values (``own``) in place, which rounds unless its share is a power of two; then it
    divides by the shares' sum, unless that is 1. So, in order:

    - when every weight is ``own``'s times a float32 ratio exactly (equal weights, 1 and 2,
      32 and 48, staleness-decayed copies), the ratios over the smallest power of two at
      least their sum: our share is a power of two, every share exact (equal weights of 2,
      4, 8 peers: 1/2, 1/4, 1/8, summing to 1);
    - else each weight over the smallest power of two at least the total (after scaling all
      by a power of two near the largest): exact for integer weights below 2**24.
    """
    if not weights:
        return {}
    if own is not None and weights.get(own, 0.0) > 0:
        base = Fraction(weights[own])
        ratios = {key: weight / weights[own] for key, weight in weights.items()}
        if all(
            0 < ratio <= FLT_MAX  # (finite: Fraction takes no infinity)
            and float(np.float32(ratio)) == ratio
            and Fraction(ratio) == Fraction(weight) / base
            for ratio, weight in zip(ratios.values(), weights.values(), strict=True)
        ):
            exact = _over_power_of_two(ratios, exact_only=True)
            if exact is not None:
                return exact
    _, top = math.frexp(max(weights.values()))
    scaled = {key: math.ldexp(weight, -top) for key, weight in weights.items()}  # < 1 each
    shares = _over_power_of_two(scaled)
    assert shares is not None
    return shares


def _over_power_of_two(
    values: Mapping[K, float], exact_only: bool = False
) -> dict[K, float] | None:
    """``values`` over the smallest power of two at least their exact sum, each rounded down
    to a float32; with ``exact_only``, None when any of them rounds."""
    total = sum(map(Fraction, values.values()), Fraction(0))
    if total == 0:
        return dict.fromkeys(values, 0.0)
    exponent = math.frexp(float(total))[1]
    while Fraction(2) ** exponent < total:
        exponent += 1
    while Fraction(2) ** (exponent - 1) >= total:
        exponent -= 1
    shares = {}
    for key, value in values.items():
        exact = math.ldexp(value, -exponent)
        share = float32_below(exact)
        if exact_only and Fraction(share) != Fraction(value) / Fraction(2) ** exponent:
            return None
        shares[key] = share
    return shares


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
