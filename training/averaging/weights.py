"""A part's weights: each member's staleness-decayed weight, and, for a sum kept in
float64, whether one is wanted and its shares (the float32 shares are
``scans.convex_shares``). The rules are reducer.py's module docstring's."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

from protocol.codecs import Codec, NoneCodec
from protocol.identity import PeerID

from .scans import convex_shares
from .senders import Member


def effective_weights(
    members: Iterable[Member], max_staleness: int, decay: float
) -> dict[PeerID, float | None]:
    """Each member's staleness-decayed weight, or None when it is too stale to count."""
    members = list(members)
    newest = max(m.epoch for m in members)
    out: dict[PeerID, float | None] = {}
    for m in members:
        staleness = newest - m.epoch
        out[m.peer_id] = None if staleness > max_staleness else m.weight * decay**staleness
    return out


def wide_sum_wanted(
    codec: Codec, weights: Mapping[PeerID, float | None], own: PeerID | None
) -> bool:
    """Whether a part's sum is kept in float64 (``weights``: the part's senders' effective
    weights, None for the stale; ``own``: the reducing peer).

    Only with the ``none`` codec (the lossy codecs' own error dwarfs float32's), and only
    where the float32 sum would round more than twice: with three senders or more (each
    addition rounds, by up to 2**-24 of the partial sums, which is large beside a mean where
    the contributions cancel), or with two whose float32 shares are not exact ratios of
    their weights with ours a power of two (then our values, scaled in place, round too).
    Two senders with equal weights, or weights 1 and 2, keep the float32 sum: one fused
    multiply-add and at most one division. Costs 8 bytes per element of the part."""
    if not isinstance(codec, NoneCodec):
        return False
    counted = {p: w for p, w in weights.items() if w is not None}
    if len(counted) < 2:
        return False
    if len(counted) > 2 or own is None or own not in counted:
        return True
    shares = convex_shares(counted, own=own)
    ours = shares[own]
    if ours <= 0 or math.frexp(ours)[0] != 0.5:  # not a power of two
        return True
    base = Fraction(counted[own]) / Fraction(ours)
    return any(Fraction(w) != Fraction(shares[p]) * base for p, w in counted.items())


def _wide_shares(weights: Mapping[PeerID, float]) -> dict[PeerID, float]:
    """Each weight over the smallest power of two at least their total, in float64: exact
    (but for weights 2**1000 times smaller than the largest, which underflow), so that
    equal weights give equal shares and opposite contributions cancel exactly."""
    top = max(weights.values(), default=0.0)
    if top <= 0:
        return dict.fromkeys(weights, 0.0)
    _, shift = math.frexp(top)
    scaled = {p: math.ldexp(w, -shift) for p, w in weights.items()}  # < 1 each, exact
    mantissa, exponent = math.frexp(math.fsum(scaled.values()))
    if mantissa == 0.5:  # the total is a power of two: that one
        exponent -= 1
    return {p: math.ldexp(w, -exponent) for p, w in scaled.items()}
