"""Matchmaking rules, pure: rendezvous rounds, the Moshpit grid, leaders (the declarations
they group, as they travel, and the "done" markers are declarations.py's).

Rounds. Round ``r`` of an averager is the DHT key ``{prefix}/round/{r}``; it *closes* at
unix time ``r * window``. A peer that becomes ready at time ``t`` joins the round that closes
next if that is at least ``window / 2`` away, or if somebody has already declared in it and
it is still ``margin`` away; otherwise the round after. So peers that step within about half
a window of each other meet, a lone peer waits between ``window / 2`` and ``1.5 * window``,
and nobody needs a counter that all peers must agree on.

Groups. Everybody who declared in a round computes the same grouping from the same set:
full (non-client) peers are ranked by ``sha256(seed | peer id)`` where the seed changes
every ``d`` rounds, placed on a ``d``-dimensional grid with sides ``<= group_size`` (see
``grid_sides``), and grouped by all coordinates but one; the free coordinate cycles with
the shared ``phase`` (the lower median of the round counts declared, ``phase_of``). After
``d`` rounds over a stable population every peer has (indirectly) averaged with every
other (exactly, when ``n`` fills the grid). Client-mode peers join the smallest groups
that have room; when none has, one full peer (one per round) leaves the group with the
most of them to start one for clients. Singletons are merged or balanced away wherever
group_size allows (see ``_merge_singletons``). Each group's leader is its first non-client
member in hash order.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Sequence

from protocol.identity import PeerID

from .declarations import DECLARATION_KEYS as DECLARATION_KEYS
from .declarations import LAYOUT_VERSION as LAYOUT_VERSION
from .declarations import MAX_DETAIL as MAX_DETAIL
from .declarations import MAX_EPOCH as MAX_EPOCH
from .declarations import MAX_LAYOUT as MAX_LAYOUT
from .declarations import MAX_SAW as MAX_SAW
from .declarations import MAX_STEP_TAG as MAX_STEP_TAG
from .declarations import MAX_WEIGHT as MAX_WEIGHT
from .declarations import Declaration
from .declarations import closed_marker as closed_marker
from .declarations import decided_set as decided_set
from .declarations import done_marker as done_marker
from .declarations import parse_closed as parse_closed
from .declarations import parse_declarations as parse_declarations
from .declarations import parse_done as parse_done
from .declarations import peers_of_layout as peers_of_layout
from .declarations import saw_tag as saw_tag


def round_closing_after(now: float, window: float) -> int:
    """The first round that closes strictly after ``now``."""
    return math.floor(now / window) + 1


def round_key(prefix: str, round_no: int) -> str:
    return f"{prefix}/round/{round_no}"


def rank_key(seed: bytes, peer_id: PeerID) -> bytes:
    return hashlib.sha256(seed + peer_id.raw).digest()


def grid_sides(n: int, group_size: int) -> tuple[int, ...]:
    """The grid for ``n`` peers, in the fewest dimensions ``d`` with ``group_size**d >= n``:
    sides of at most ``group_size`` whose product is exactly ``n`` when some are (the most
    even such, largest first), else ``d`` equal sides ``m``, the smallest with
    ``m**d >= n``. A grid that ``n`` fills (8 peers at group size 4: 4 x 2) has no short
    line, so ``d`` rounds give the exact mean; 3 x 3 for those 8 left a short line every
    round, and the mean was only approached (the spread fell ~3x per round). Where no sides
    fit exactly, unequal ones mixed worse than equal ones in as many cases as they mixed
    better (a simulation of 3d rounds, n up to 70), so the equal ones stay."""
    group_size = max(group_size, 1)
    d = 1
    while group_size**d < n:
        d += 1
    m = max(1, math.ceil(n ** (1.0 / d)))
    while m**d < n:
        m += 1
    while m > 1 and (m - 1) ** d >= n:
        m -= 1
    best: tuple[int, int, tuple[int, ...]] | None = None

    def search(sides: tuple[int, ...], product: int) -> None:
        nonlocal best
        left = d - len(sides)
        if not left:
            key = (product, max(sides), sides)
            if product >= n and (best is None or key < best):
                best = key
            return
        # this side is at most the previous one (largest first); the rest can multiply by
        # at most side**(left - 1), so it must be at least n / product ** (1 / left)
        top = sides[-1] if sides else group_size
        low = max(1, math.ceil((n / product) ** (1.0 / left) - 1e-9))
        for side in range(min(top, group_size), low - 1, -1):
            if product * side * side ** (left - 1) < n:
                break
            search((*sides, side), product * side)

    search((), 1)
    assert best is not None
    return best[2] if best[0] == n else (m,) * d


def make_groups(
    declarations: Sequence[Declaration], group_size: int, prefix: str
) -> list[list[Declaration]]:
    """Deterministic grouping of one round's declarations (same input, same output).

    Peers are first split by layout fingerprint (only equal layouts average together); each
    group is sorted in hash order (leader first).
    """
    by_layout: dict[str, list[Declaration]] = {}
    for decl in sorted(declarations, key=lambda d: d.peer_id.raw):
        by_layout.setdefault(decl.layout, []).append(decl)
    groups: list[list[Declaration]] = []
    for layout in sorted(by_layout):
        groups.extend(_group_one_layout(by_layout[layout], group_size, prefix))
    return groups


def _group_one_layout(
    decls: list[Declaration], group_size: int, prefix: str
) -> list[list[Declaration]]:
    full = [d for d in decls if not d.client_mode]
    clients = [d for d in decls if d.client_mode]
    phase = phase_of(decls)
    sides = grid_sides(max(len(full), 1), group_size)
    d = len(sides)
    block_seed = hashlib.sha256(f"{prefix}|grid|{phase // d}".encode()).digest()
    round_seed = hashlib.sha256(f"{prefix}|round|{phase}".encode()).digest()
    ranked = sorted(full, key=lambda x: rank_key(block_seed, x.peer_id))
    free_axis = phase % d
    cells: dict[tuple[int, ...], list[Declaration]] = {}
    for rank, decl in enumerate(ranked):
        digits = []
        for side in sides:  # mixed radix: the first side varies fastest
            rank, digit = divmod(rank, side)
            digits.append(digit)
        digits[free_axis] = -1
        cells.setdefault(tuple(digits), []).append(decl)
    groups = [cells[key] for key in sorted(cells)]
    _merge_singletons(groups, group_size)
    _rotate_the_odd_one(groups, ranked[phase % len(ranked)] if ranked else None)
    clients.sort(key=lambda x: rank_key(round_seed, x.peer_id))
    leftovers: list[list[Declaration]] = []
    lent = False
    for client in clients:
        roomy = [g for g in groups if len(g) < group_size]
        if roomy:
            min(roomy, key=len).append(client)
        elif not lent and (lender := _most_full(groups)) is not None:
            # Every group is full: one full peer leaves the group with the most of them to
            # start a group for clients. Else full peers that fill their groups exactly (4
            # of them, group_size 4) would shut a client out round after round. Only one
            # per round: a client's declaration cannot be checked, and ghost clients (that
            # never join) would otherwise pull every full peer away from the others.
            taken = max(i for i, d in enumerate(lender) if not d.client_mode)
            groups.append([lender.pop(taken), client])
            lent = True
        else:
            leftovers.append([client])  # no room: alone (and without a leader) this round
    groups.extend(leftovers)
    return [sorted(g, key=lambda x: rank_key(round_seed, x.peer_id)) for g in groups]


def phase_of(declarations: Sequence[Declaration]) -> int:
    """The grid phase of a round: the lower median of the declared round counts (0 for
    none). Every other rule of the grouping is fixed, so whoever chose the phase would choose
    the grid and the order within each group, and with it who leads; a median leaves one
    declarer no choice while two or more others declare the same count (the largest count,
    the rule before, let a peer pick the phase under which it led every round and refused
    every join)."""
    counts = sorted(d.count for d in declarations)
    return counts[(len(counts) - 1) // 2] if counts else 0


def _most_full(groups: Sequence[list[Declaration]]) -> list[Declaration] | None:
    """The first group with the most full (non-client) members, if it has three or more:
    one of them can lead another group and two stay together. (Lent from a pair, the one
    left behind would be the only full peer of its group: with ghost clients, alone.)"""
    counts = [sum(not d.client_mode for d in g) for g in groups]
    if not counts or max(counts) < 3:
        return None
    return groups[counts.index(max(counts))]


def _merge_singletons(groups: list[list[Declaration]], group_size: int) -> None:
    """Leave nobody alone that can be grouped (a grid that ``n`` does not fill has short
    lines): a singleton joins the smallest group with room; if none has room, it takes the
    last member of the largest group of 3 or more (10 peers in groups of 3: 3, 3, 2, 2, not
    3, 3, 3, 1, where the free axis is a full side of the 3 x 3 x 3 grid). Groups never
    exceed ``group_size``: with pairs and an odd count, one peer stays out of the round
    (the grid puts another one out in the next)."""
    i = 0
    while i < len(groups):
        if len(groups[i]) == 1 and len(groups) > 1:
            others = [g for j, g in enumerate(groups) if j != i]
            roomy = [g for g in others if len(g) < group_size]
            largest = max(others, key=len)
            if roomy:
                min(roomy, key=len).extend(groups.pop(i))
                continue
            if len(largest) >= 3:
                groups[i].append(largest.pop())
        i += 1


def _rotate_the_odd_one(groups: list[list[Declaration]], out: Declaration | None) -> None:
    """A peer left alone by the grid (pairs and an odd count: nobody has room) is the one
    whose grid line is short, and it stayed out in d - 1 of every d rounds (9 peers in
    pairs: the same peer out 3 rounds in a row, a trial). ``out`` (the caller's pick, a
    different peer each round of a block) sits out instead: it trades places with the
    singleton."""
    alone = [g for g in groups if len(g) == 1]
    if len(alone) != 1 or len(groups) < 2 or out is None:
        return
    for group in groups:
        for j, decl in enumerate(group):
            if decl is out:
                group[j], alone[0][0] = alone[0][0], decl
                return


def leader_of(group: Sequence[Declaration]) -> Declaration | None:
    """The first non-client member (groups are already in hash order), or None."""
    return next((d for d in group if not d.client_mode), None)


def find_group(
    groups: Sequence[Sequence[Declaration]], peer_id: PeerID
) -> Sequence[Declaration] | None:
    return next((g for g in groups if any(d.peer_id == peer_id for d in g)), None)


def majority_layout(declarations: Sequence[Declaration]) -> str | None:
    """The most common layout fingerprint (ties: the smallest), or None when empty."""
    counts = Counter(d.layout for d in declarations)
    if not counts:
        return None
    return min(counts, key=lambda layout: (-counts[layout], layout))
