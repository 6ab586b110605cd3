"""Spans of the flat vector (``[start, stop)`` of its elements): the cut into parts, in
proportion to the declared bandwidths (bounded, so that no member takes the whole vector),
and the chunks a part travels in (see layout.py)::

    flat  |-------- part 0 --------|---- part 1 ----|------ part 2 ------|
    part  |chunk 0|chunk 1|chunk 2 |
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TypeAlias

Span: TypeAlias = tuple[int, int]

ALIGN = 4096
"""Part boundaries fall on multiples of this many elements when the vector is large enough
(int8 blocks then never straddle parts)."""


MAX_BANDWIDTH_SPREAD = 4.0
"""A declared bandwidth counts for at most this many times the group's median."""


def bounded_bandwidths(bandwidths: Sequence[float]) -> list[float]:
    """``bandwidths`` clipped to ``MAX_BANDWIDTH_SPREAD`` times their lower median. Bandwidth
    is declared, not measured, and a part's reducer is trusted with its values: one member
    declaring 1e300 was handed the whole vector (every other part empty) and could then
    send back anything as everyone's mean. Clipped, it reduces at most about 4x the
    median member's share. The lower median, so that in a pair (whose median is the mean)
    a liar still gets at most 4x the other's share, not all of it."""
    if not bandwidths:
        return []
    limit = statistics.median_low(bandwidths) * MAX_BANDWIDTH_SPREAD
    return [min(bandwidth, limit) for bandwidth in bandwidths]


def split_spans(total: int, bandwidths: Sequence[float], align: int = ALIGN) -> list[Span]:
    """Cut ``[0, total)`` into one span per bandwidth, sizes in proportion to it.

    Boundaries are multiples of ``align`` when every part can hold a few aligned blocks,
    else of 1. Parts may be empty (a zero share). The last span ends at ``total``. Any
    finite bandwidths (a joiner may declare 1e308): they are scaled by the largest first,
    so that their sum cannot overflow.

    Raises:
        ValueError: if there are no bandwidths, or one is negative or not finite, or all zero.
    """
    if not bandwidths:
        raise ValueError("need at least one bandwidth")
    if any(not math.isfinite(b) or b < 0 for b in bandwidths):
        raise ValueError("bandwidths must be finite and non-negative")
    top = max(bandwidths)
    if top <= 0:
        raise ValueError("at least one bandwidth must be positive")
    bandwidths = [bandwidth / top for bandwidth in bandwidths]
    weight = math.fsum(bandwidths)
    unit = align if total >= align * len(bandwidths) * 4 else 1
    units = -(-total // unit)
    spans: list[Span] = []
    start = 0
    acc = 0.0
    for i, bandwidth in enumerate(bandwidths):
        acc += bandwidth
        if i == len(bandwidths) - 1:
            stop = total
        else:
            stop = min(total, max(start, round(units * acc / weight) * unit))
        spans.append((start, stop))
        start = stop
    return spans


def check_spans(spans: Sequence[Span], total: int) -> None:
    """Check that ``spans`` tile ``[0, total)`` in order.

    Raises:
        ValueError: when they do not.
    """
    position = 0
    for start, stop in spans:
        if start != position or stop < start:
            raise ValueError(f"spans {list(spans)} do not tile [0, {total})")
        position = stop
    if position != total:
        raise ValueError(f"spans {list(spans)} do not tile [0, {total})")


def chunk_count(length: int, chunk_elements: int) -> int:
    """Number of chunks of a part of ``length`` elements."""
    return -(-length // chunk_elements)


def chunk_span(length: int, chunk_elements: int, index: int) -> Span:
    """Span of chunk ``index`` inside a part of ``length`` elements (part-relative)."""
    start = index * chunk_elements
    return start, min(length, start + chunk_elements)


def overlap(a: Span, b: Span) -> int:
    """Number of elements two spans share."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))
