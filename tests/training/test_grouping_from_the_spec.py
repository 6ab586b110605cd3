"""Averaging groups re-derived from docs/protocol.md, section 9.4, and compared with the library.

The reference below is written from the text of section 9.4 alone (with 9.2 for `count`), not
from `training/averaging/grouping.py`: if the two agree on hundreds of random declared sets,
the text is enough for a peer in another language to compute the same groups.

Where the text is silent this file reads it as follows (each reading is what the library does):
a singleton that "moves into" a group (step 6) goes to its end, which decides which member
step 8 lends later; "no peer was lent yet this round" (step 8) counts per layout; a client
"alone this round" is a one-member group after the others; the result lists the layouts'
groups in an order the text does not give, so they are compared layout by layout.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from protocol.identity import Identity, PeerID
from training.averaging.grouping import Declaration, make_groups

COUNT_END = 2**62  # a declaration's `count` lies in [0, 2**62) (section 9.2)


@dataclass(frozen=True)
class Peer:
    """What 9.4 reads of a declaration: who, which layout, its count, and whether it is full."""

    raw: bytes
    layout: str
    count: int
    full: bool


# --- the reference, step by step -------------------------------------------------------------


def lower_median(counts: Sequence[int]) -> int:
    """Step 2: the counts sorted ascending, the one at index (m - 1) // 2."""
    ordered = sorted(counts)
    return ordered[(len(ordered) - 1) // 2]


def sides_of(n: int, g: int) -> tuple[int, ...]:
    """Step 3: exact sides in [1, g] with the smallest s_0 (then lexicographic), else m**d."""
    d = 1
    while g**d < n:
        d += 1
    exact = [
        sides
        for sides in itertools.product(range(g, 0, -1), repeat=d)
        if all(a >= b for a, b in itertools.pairwise(sides)) and _product(sides) == n
    ]
    if exact:
        return min(exact, key=lambda sides: (sides[0], sides))
    m = 1
    while m**d < n:
        m += 1
    return (m,) * d


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def rank_key(seed: bytes, raw: bytes) -> bytes:
    """Step 4: SHA-256 of the 64 bytes seed + PeerID bytes."""
    return hashlib.sha256(seed + raw).digest()


def group_one_layout(peers: Sequence[Peer], g: int, prefix: str) -> list[list[Peer]]:
    """Steps 2 to 9 for the declarations of one layout."""
    full = [p for p in peers if p.full]
    clients = [p for p in peers if not p.full]
    phase = lower_median([p.count for p in peers])
    n = len(full) or 1
    sides = sides_of(n, g)
    d = len(sides)
    block_seed = hashlib.sha256(f"{prefix}|grid|{phase // d}".encode()).digest()
    round_seed = hashlib.sha256(f"{prefix}|round|{phase}".encode()).digest()

    # step 5: ranks under block_seed, mixed-radix digits, the free axis dropped
    ranked = sorted(full, key=lambda p: rank_key(block_seed, p.raw))
    free = phase % d
    lines: dict[tuple[int, ...], list[Peer]] = {}
    for i, p in enumerate(ranked):
        digits = [(i // _product(sides[:j])) % sides[j] for j in range(d)]
        kept = tuple(digit for j, digit in enumerate(digits) if j != free)
        lines.setdefault(kept, []).append(p)
    groups = [lines[key] for key in sorted(lines)]

    # step 6: singletons
    i = 0
    while i < len(groups):
        if len(groups[i]) == 1 and len(groups) > 1:
            others = [k for k in range(len(groups)) if k != i]
            roomy = [k for k in others if len(groups[k]) < g]
            if roomy:
                target = min(roomy, key=lambda k: len(groups[k]))  # min keeps the first
                groups[target].append(groups[i][0])
                del groups[i]
                continue
            largest = max(others, key=lambda k: len(groups[k]))  # max keeps the first
            if len(groups[largest]) >= 3:
                groups[i].append(groups[largest].pop())
        i += 1

    # step 7: the odd one trades places with the full peer of rank phase mod n
    singles = [k for k, group in enumerate(groups) if len(group) == 1]
    if len(singles) == 1 and len(groups) >= 2:
        chosen = ranked[phase % n]
        odd = groups[singles[0]][0]
        for group in groups:
            for pos, member in enumerate(group):
                if member is chosen:
                    group[pos] = odd
                elif member is odd:
                    group[pos] = chosen

    # step 8: clients, in round_seed order
    alone: list[list[Peer]] = []
    lent = False
    for client in sorted(clients, key=lambda p: rank_key(round_seed, p.raw)):
        roomy = [k for k in range(len(groups)) if len(groups[k]) < g]
        fulls = [sum(m.full for m in group) for group in groups]
        if roomy:
            groups[min(roomy, key=lambda k: len(groups[k]))].append(client)
        elif not lent and any(f >= 3 for f in fulls):
            donor = groups[fulls.index(max(fulls))]
            last = max(pos for pos, m in enumerate(donor) if m.full)
            groups.append([donor.pop(last), client])
            lent = True
        else:
            alone.append([client])

    # step 9: each group in round_seed order
    return [sorted(group, key=lambda p: rank_key(round_seed, p.raw)) for group in groups + alone]


def spec_groups(peers: Sequence[Peer], g: int, prefix: str) -> dict[str, list[list[bytes]]]:
    """Step 1: each layout on its own; the groups of each, as PeerID bytes."""
    layouts = sorted({p.layout for p in peers})
    return {
        layout: [
            [p.raw for p in group]
            for group in group_one_layout([p for p in peers if p.layout == layout], g, prefix)
        ]
        for layout in layouts
    }


# --- the library, seen the same way ------------------------------------------------------------

IDS = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(80)]


def declaration(i: int, peer: Peer, weight: float, bandwidth: float) -> Declaration:
    """A Declaration of the library for one reference peer (address None for a client)."""
    pid = PeerID(peer.raw)
    address = f"{pid}@10.0.0.{i}:1000" if peer.full else None
    return Declaration(pid, address, weight, 0, bandwidth, peer.layout, peer.count, 100)


def library_groups(
    peers: Sequence[Peer], g: int, prefix: str, rng: random.Random | None = None
) -> dict[str, list[list[bytes]]]:
    """make_groups' groups split by their layout, each layout's in the library's order."""
    decls = [
        declaration(
            i,
            p,
            rng.uniform(0.1, 10) if rng else 1.0,
            rng.uniform(0.1, 10) if rng else 1.0,
        )
        for i, p in enumerate(peers)
    ]
    out: dict[str, list[list[bytes]]] = {}
    for group in make_groups(decls, g, prefix):
        layouts = {m.layout for m in group}
        assert len(layouts) == 1, "a group mixes layouts"
        out.setdefault(layouts.pop(), []).append([m.peer_id.raw for m in group])
    return dict(sorted(out.items()))


def make_peers(
    n_full: int, n_clients: int, counts: Sequence[int], layouts: Sequence[str]
) -> list[Peer]:
    """Full peers first, then clients, from the fixed identity pool."""
    kinds = [True] * n_full + [False] * n_clients
    return [Peer(IDS[i].raw, layouts[i], counts[i], full) for i, full in enumerate(kinds)]


def sizes(groups: list[list[bytes]]) -> list[int]:
    """Group sizes in list order, for the shapes the docs promise."""
    return [len(group) for group in groups]


# --- fixed cases the text names ---------------------------------------------------------------


def test_grid_sides_from_the_examples() -> None:
    """Step 3's own examples: 8 peers at g 4 are 4 x 2, 7 peers at g 4 are 3 x 3."""
    assert sides_of(8, 4) == (4, 2)
    assert sides_of(7, 4) == (3, 3)
    assert sides_of(10, 3) == (3, 3, 3)
    assert sides_of(16, 4) == (4, 4)
    assert sides_of(1, 5) == (1,)
    assert sides_of(72, 6) == (6, 4, 3)  # (6, 6, 2) has the same s_0: the tuple breaks the tie


@pytest.mark.parametrize("phase", [0, 1, 2])
def test_tied_exact_grids(phase: int) -> None:
    """72 peers at g 6: 6 x 4 x 3 (not 6 x 6 x 2), so lines of 6, 4 or 3 by the free axis."""
    peers = make_peers(72, 0, [phase] * 72, ["L"] * 72)
    mine = spec_groups(peers, 6, "run")
    assert set(sizes(mine["L"])) == {(6, 4, 3)[phase]}
    assert mine == library_groups(peers, 6, "run")


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_eight_peers_at_four(phase: int) -> None:
    """averaging.md: 8 peers at group_size 4 make groups of 4, then of 2 (4 x 2)."""
    peers = make_peers(8, 0, [phase] * 8, ["L"] * 8)
    mine = spec_groups(peers, 4, "run")
    assert sorted(sizes(mine["L"])) == ([4, 4] if phase % 2 == 0 else [2, 2, 2, 2])
    assert mine == library_groups(peers, 4, "run")


@pytest.mark.parametrize("phase", [0, 1])
def test_seven_peers_at_four(phase: int) -> None:
    """Step 3: 7 peers at g 4 lie on 3 x 3: lines of 3, 3, 1 (the 1 merged), or 3, 2, 2."""
    peers = make_peers(7, 0, [phase] * 7, ["L"] * 7)
    mine = spec_groups(peers, 4, "run")
    assert sorted(sizes(mine["L"])) == ([3, 4] if phase == 0 else [2, 2, 3])
    assert mine == library_groups(peers, 4, "run")


@pytest.mark.parametrize("phase", [0, 1, 2])
def test_ten_peers_in_threes(phase: int) -> None:
    """averaging.md: 10 peers in groups of 3 are 3, 3, 2, 2, not 3, 3, 3, 1.

    That holds when the free axis is a full one (phases 0 and 1 of the 3 x 3 x 3 grid); at
    phase 2 the lines run along the third axis, 2 long at most, and the set splits in pairs.
    """
    peers = make_peers(10, 0, [phase] * 10, ["L"] * 10)
    mine = spec_groups(peers, 3, "run")
    assert sorted(sizes(mine["L"])) == ([2, 2, 3, 3] if phase < 2 else [2] * 5)
    assert mine == library_groups(peers, 3, "run")


def test_four_full_peers_lend_one_to_a_client() -> None:
    """averaging.md: 4 full peers at group_size 4 give a client a group of its own."""
    peers = make_peers(4, 2, [0] * 6, ["L"] * 6)
    mine = spec_groups(peers, 4, "run")
    assert sorted(sizes(mine["L"])) == [3, 3]  # the second client joins the first
    assert mine == library_groups(peers, 4, "run")


def test_odd_count_at_two_leaves_one_out() -> None:
    """averaging.md: with group_size 2 and an odd n one peer sits the round out."""
    for phase in range(6):
        peers = make_peers(5, 0, [phase] * 5, ["L"] * 5)
        mine = spec_groups(peers, 2, "run")
        assert sorted(sizes(mine["L"])) == [1, 2, 2]
        assert mine == library_groups(peers, 2, "run")


def test_lending_is_per_layout() -> None:
    """Step 8's "no peer was lent yet this round" counts within a layout (step 1)."""
    layouts = ["L"] * 4 + ["M"] * 4 + ["L", "L", "M", "M"]
    peers = make_peers(8, 4, [0] * 12, layouts)
    mine = spec_groups(peers, 4, "run")
    assert {layout: sizes(groups) for layout, groups in mine.items()} == {
        "L": [3, 3],
        "M": [3, 3],
    }
    assert mine == library_groups(peers, 4, "run")


@pytest.mark.parametrize(
    ("n_full", "n_clients", "g", "expected"),
    [(0, 3, 4, [1, 1, 1]), (2, 3, 2, [2, 1, 1, 1]), (3, 5, 3, [3, 3, 1, 1])],
)
def test_clients_without_room_are_alone(
    n_full: int, n_clients: int, g: int, expected: list[int]
) -> None:
    """Step 8's "alone": each such client is a one-member group after the others.

    At g 3, 3 full peers lend one to the first client without room, and only one.
    """
    total = n_full + n_clients
    peers = make_peers(n_full, n_clients, [5] * total, ["L"] * total)
    mine = spec_groups(peers, g, "run")
    assert sizes(mine["L"]) == expected
    assert mine == library_groups(peers, g, "run")


def test_a_merged_singleton_is_its_groups_last_member() -> None:
    """Step 6 says a singleton "moves into" a group, not where; read here as at its end.

    It matters through step 8's "its last full member": 5 peers at g 3 and phase 1 make lines
    of ranks {0, 3}, {1, 4}, {2}; rank 2 joins the first line, a client fills the second, and
    the next client gets the first line's last full member: rank 2 appended last, where a
    "keep rank order" reading would lend rank 3 (the library agrees with the former).
    """
    peers = make_peers(5, 2, [1] * 7, ["L"] * 7)
    mine = spec_groups(peers, 3, "run")
    assert sorted(sizes(mine["L"])) == [2, 2, 3]
    assert mine == library_groups(peers, 3, "run")


# --- random cases -----------------------------------------------------------------------------

RANDOM_CASES = 600


def random_case(rng: random.Random) -> tuple[list[Peer], int, str]:
    """A declared set: 0-40 full peers, 0-6 clients, one or two layouts, equal or mixed counts."""
    n_full = rng.randint(0, 40)
    n_clients = rng.randint(0, 6)
    total = n_full + n_clients
    big = rng.random() < 0.3
    top = COUNT_END - 1 if big else rng.choice([3, 20, 1000])
    if rng.random() < 0.5:
        counts = [rng.randint(0, top)] * total
    else:
        counts = [rng.randint(0, top) for _ in range(total)]
        if big and total and rng.random() < 0.3:
            counts[rng.randrange(total)] = COUNT_END - 1
    if rng.random() < 0.3:
        layouts = [rng.choice(["L", "M"]) for _ in range(total)]
    else:
        layouts = ["L"] * total
    peers = make_peers(n_full, n_clients, counts, layouts)
    rng.shuffle(peers)
    return peers, rng.randint(2, 6), rng.choice(["run", "swarm/exp-1", "é"])


def test_random_sets_match_the_library() -> None:
    """Hundreds of seeded random sets: the text's groups are the library's, in order."""
    rng = random.Random(94)
    for case in range(RANDOM_CASES):
        peers, g, prefix = random_case(rng)
        mine = spec_groups(peers, g, prefix)
        theirs = library_groups(peers, g, prefix, rng)
        assert mine == theirs, f"case {case}: g={g} prefix={prefix!r} peers={peers}"
