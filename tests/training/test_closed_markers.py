"""A "done" marker keeps its peer's declaration and the step tags of the declarations in
the read that decided its step (protocol.md 9.2, ``closed`` and ``saw``). The peer that
pairs leave alone withdraws a few ms after its read; a reader slower than that grouped
without it: another phase, other pairs, and two peers that each led the other ("nobody
joined"). A reader whose tag a marker lists now counts that marker's peer as declared."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from peer import Peer
from protocol.identity import Identity
from training import Outcome
from training.averaging.grouping import (
    Declaration,
    closed_marker,
    decided_set,
    parse_closed,
    parse_done,
)

STEPS = 12


def _slow_reads(node: Peer, seconds: float) -> None:
    """Every read of a round by ``node`` starts ``seconds`` late."""
    dht = node.dht
    read_entries = dht.read_entries

    async def slow_read(key: str, **kwargs: Any) -> Any:
        await trio.sleep(seconds)
        return await read_entries(key, **kwargs)

    dht.read_entries = slow_read  # type: ignore[method-assign,assignment]


async def test_a_reader_slower_than_the_lone_peers_marker_groups_the_same_set(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three peers in pairs (one sits each round out), steps back to back; every read of
    the round by peer 0 takes 0.1 s longer. Before markers kept declarations, these seeds
    gave 6 steps in 36 where two peers each led the other."""
    notes: list[str] = []
    outcomes: Counter[Outcome] = Counter()
    with trio.fail_after(300):
        async with memnet_swarm(3, first_seed=100) as (_, nodes):
            members = make_members(nodes, 4096, fast_config(group_size=2))
            _slow_reads(nodes[0], 0.1)

            async def run(i: int) -> None:
                for _ in range(STEPS):
                    info = await members[i].averager.step(weight=1.0, epoch=0, timeout=20.0)
                    outcomes[info.outcome] += 1
                    notes.append(info.note)
                    await trio.sleep(0.05)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(run, i)
    assert not [n for n in notes if "nobody joined" in n], notes
    assert outcomes[Outcome.AVERAGED] + outcomes[Outcome.ALONE] == 3 * STEPS, outcomes
    # one peer sits out each round; steps within one slot may repeat a round's grouping
    assert outcomes[Outcome.ALONE] <= STEPS + 2, outcomes


def test_a_marker_keeps_its_declaration_for_the_readers_it_saw() -> None:
    """A kept declaration reads as declared only for a reader whose step tag the marker
    saw (not for another step of that reader, nor for a reader without a tag); one that
    fails the table (here: another peer's address) keeps nothing; ours is skipped."""
    ids = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(3)]
    decls = [
        Declaration(p, f"{p}@10.0.0.{i + 1}:1000", 1.0, 0, 1.0, "ours", 0, 64, step=100 + i)
        for i, p in enumerate(ids)
    ]
    forged = {
        **closed_marker("ours", decls[1], [7]),
        "closed": {**decls[1].to_wire(), "address": decls[2].address},
    }
    entries = {
        str(ids[0]): closed_marker("ours", decls[0], [7, 8]),
        str(ids[1]): forged,
        str(ids[2]): closed_marker("ours", decls[2], [7]),
    }
    kept = replace(decls[0], step=0)  # a marker keeps no tag (and no detail)
    assert parse_closed(entries, exclude=str(ids[2]), step=7) == [kept]
    assert parse_closed(entries, exclude="", step=8) == [kept]
    assert parse_closed(entries, exclude="", step=9) == []  # another step of that reader
    assert parse_closed(entries, exclude="", step=0) == []  # a reader without a tag
    assert parse_done(entries, exclude="") == Counter({"ours": 3})
    # a tag list with anything but tags keeps nothing (a float or a bool is no tag)
    for saw in ([7.0], [True], [7, "x"], [0, 7], [7] * 1025, "7"):
        odd = {str(ids[0]): {**closed_marker("ours", decls[0], []), "saw": saw}}
        assert parse_closed(odd, exclude="", step=7 if saw != [True] else 1) == [], saw
    # a tag that is no int in [0, 2**32) reads as none: the declaration still counts
    for step in (-1, 2**32, 1.5, True, "7"):
        wire = {**decls[0].to_wire(), "step": step}
        assert Declaration.from_wire(ids[0], wire) == replace(decls[0], step=0), step
    # what a join or a confirmation carries leaves the tag out (older peers refuse keys
    # they do not know); what the DHT holds has it
    assert "step" not in decls[0].to_wire(tagged=False)
    assert Declaration.from_wire(ids[0], decls[0].to_wire()) == decls[0]


async def _newcomer_after_an_early_close(first_seed: int) -> list[Any]:
    """Four peers in pairs meet for 3 rounds (each then closes early at 4 declared). In the
    4th, peer 3 reads the round 0.3 s late, and peer 4 declares in it for the first time
    after the other three closed early: the reports of that round's steps, peer 3's first."""
    async with memnet_swarm(5, first_seed=first_seed) as (_, nodes):
        members = make_members(nodes, 4096, fast_config(group_size=2))
        for _ in range(3):
            await step_all(members[:4], timeout=20.0)
        _slow_reads(nodes[3], 0.3)
        infos: list[Any] = [None] * 5

        async def step(i: int, after: float = 0.0) -> None:
            await trio.sleep(after)
            infos[i] = await members[i].averager.step(weight=1.0, epoch=0, timeout=20.0)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(step, i)
            nursery.start_soon(step, 4, 0.2)  # after the early close, before peer 3's read
    return [infos[3], *infos[:3], infos[4]]


@pytest.mark.parametrize("first_seed", [10, 20, 30])
async def test_a_declaration_after_the_early_close_does_not_regroup_the_round(
    autojump_clock: trio.testing.MockClock, first_seed: int
) -> None:
    """A reader whose declaration the early closers' reads had groups the set they
    grouped, not that set plus a newcomer who declared since: one peer more reshuffled
    every pair of the grid, and peers that had waited together were each alone ("nobody
    joined"; an outside tester: 1.9 % of the steps of 8-16 peers in pairs arriving up to
    3 s apart)."""
    with trio.fail_after(300):
        infos = await _newcomer_after_an_early_close(first_seed)
    late, *early, newcomer = infos
    assert late.outcome == Outcome.AVERAGED, late.note
    assert all(info.outcome == Outcome.AVERAGED for info in early), [i.note for i in early]
    assert newcomer.outcome != Outcome.AVERAGED  # the round was decided without it


def test_the_decided_set_is_read_from_markers_of_our_layout_alone() -> None:
    """Peers of another layout group apart, and their markers list every tag their reads
    saw: taken as our round's decision, they left out our peers that declared after those
    reads, and 4 peers of one layout split into 2 + 2 (an outside re-check, 5 of 5 seeds).
    An untagged declaration (a peer before step tags) no list can name: it stays."""
    ids = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(5)]

    def declaration(i: int, layout: str, step: int) -> Declaration:
        return Declaration(
            ids[i], f"{ids[i]}@10.0.0.{i + 1}:1000", 1.0, 0, 1.0, layout, 0, 64, step=step
        )

    me, early, late, untagged, foreign = (
        declaration(0, "ours", 100),
        declaration(1, "ours", 101),
        declaration(2, "ours", 102),
        declaration(3, "ours", 0),
        declaration(4, "theirs", 104),
    )
    declared = [me, late, untagged, foreign]
    # a marker of another layout that saw us: no decision of ours
    theirs = {str(ids[4]): closed_marker("theirs", foreign, [100, 101])}
    assert decided_set(declared, theirs, me) == declared
    # one of our layout: the late declaration goes, the untagged and the foreign stay
    ours = {**theirs, str(ids[1]): closed_marker("ours", early, [100, 104])}
    assert decided_set(declared, ours, me) == [me, untagged, foreign]
