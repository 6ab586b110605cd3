"""A peer's "done" marker names its layout: a newcomer that reads a round only after the
others closed it early and withdrew (or, in a race, after the one correct peer there read it
and withdrew) still learns of a layout mismatch, and a late newcomer of the right layout is
told nothing wrong. Markers of unknown layout (older peers) count for nothing."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import (
    Member,
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    step_or_mismatch,
    verify_round,
)

from peer import Peer
from protocol.identity import Identity
from training import Averager, AveragingInfo, LayoutMismatchError, Outcome
from training.averaging.grouping import Declaration, done_marker, parse_done
from training.averaging.layout_check import OUTNUMBERED_ROUNDS
from training.averaging.matchmaking import Matchmaker

WINDOW = 1.0  # fast_config's gather_window
Marker = Callable[[dict[str, Any]], dict[str, Any]]


def _is_marker(value: object) -> bool:
    return isinstance(value, dict) and value.get("done") is True


def _on_done_markers(
    members: list[Member], count: int, rewrite: Marker | None = None
) -> trio.Event:
    """An event set once ``count`` of ``members`` stored a done marker (``rewrite`` changes
    what they store: an older peer's marker)."""
    stored: set[int] = set()
    event = trio.Event()
    for i, member in enumerate(members):
        dht = member.averager.node.dht

        async def store(
            key: str, value: Any, *args: Any, i: int = i, original: Any = dht.store, **kwargs: Any
        ) -> bool:
            if _is_marker(value) and rewrite is not None:
                value = rewrite(value)
            ok: bool = await original(key, value, *args, **kwargs)
            if _is_marker(value):
                stored.add(i)
                if len(stored) >= count:
                    event.set()
            return ok

        dht.store = store  # type: ignore[method-assign]
    return event


def _declare_after(node: Peer, event: trio.Event) -> None:
    """``node`` stores its declarations only once ``event`` is set (a slow store)."""
    original = node.dht.store

    async def store(key: str, value: Any, *args: Any, **kwargs: Any) -> bool:
        if not _is_marker(value):
            await event.wait()
        ok: bool = await original(key, value, *args, **kwargs)
        return ok

    node.dht.store = store  # type: ignore[method-assign]


async def _newcomer_after_early_close(
    elements: int, rewrite: Marker | None = None
) -> tuple[AveragingInfo | LayoutMismatchError, Averager]:
    """Three peers that averaged once (so they close their next round early) step again;
    a fresh newcomer of ``elements`` steps beside them in the same round, but its
    declaration lands only once all three withdrew (done markers, changed by ``rewrite``).
    They average among themselves; the newcomer's info or error is returned."""
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], 1000, fast_config())
            first = await step_all(members, timeout=10.0)
            assert all(info.outcome is Outcome.AVERAGED for info, _ in first)  # type: ignore[union-attr]
            for m in members:
                m.data = m.array.copy()
            newcomer = Averager(
                nodes[3], "t/x", [np.ones(elements, np.float32)], config=fast_config()
            )
            withdrawn = _on_done_markers(members, 3, rewrite)
            _declare_after(nodes[3], withdrawn)
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.05)  # a slot's start
            outcome: list[AveragingInfo | LayoutMismatchError] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step_or_mismatch, newcomer, 10.0, outcome)
                results = await step_all(members, timeout=10.0)
            assert withdrawn.is_set()
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for info in infos:
        assert info is not None and info.outcome is Outcome.AVERAGED and len(info.group) == 3
        assert info.matchmaking_s < WINDOW / 2, info  # closed early, before the newcomer came
        assert info.round == infos[0].round  # type: ignore[union-attr]
    (result,) = outcome
    if isinstance(result, AveragingInfo):
        assert result.round == infos[0].round  # type: ignore[union-attr]
    return result, newcomer


async def test_a_newcomer_of_another_layout_after_an_early_close_is_told(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """It read only done markers, which said nothing of layout: it was "alone" every
    round, its note suggesting the others had just been faster."""
    result, _ = await _newcomer_after_early_close(999)
    assert isinstance(result, LayoutMismatchError), result
    assert "3 peer(s) that had finished matchmaking" in str(result), result


async def test_a_newcomer_of_our_layout_after_an_early_close_is_only_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    result, newcomer = await _newcomer_after_early_close(1000)
    assert isinstance(result, AveragingInfo), result
    assert result.outcome is Outcome.ALONE
    assert "3 other peer(s) had finished matchmaking" in result.note, result.note
    # they did declare in this round: "nobody declared in this round" beside it
    # contradicted it (a trial)
    assert "nobody declared" not in result.note, result.note
    assert "another layout" not in result.note, result.note
    assert newcomer._matchmaker._own_layout_seen


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda v: {"done": True},  # an older peer's marker
        lambda v: {**v, "layout": 7},
        lambda v: {**v, "layout": "f" * 65},
    ],
    ids=["without", "not-a-string", "too-long"],
)
async def test_a_marker_of_unknown_layout_counts_for_nothing(
    autojump_clock: trio.testing.MockClock, rewrite: Marker
) -> None:
    result, newcomer = await _newcomer_after_early_close(999, rewrite)
    assert isinstance(result, AveragingInfo), result
    assert result.outcome is Outcome.ALONE
    assert "3 other peer(s) had finished matchmaking" in result.note, result.note
    assert "another layout" not in result.note, result.note
    assert not newcomer._matchmaker._own_layout_seen


async def test_a_newcomer_reading_after_the_lone_correct_peer_withdrew_is_told(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The race of test_a_misconfigured_newcomer_does_not_raise_in_a_peer_of_the_swarm,
    made certain: the correct peer reads the round at its close (the newcomer declared),
    is alone and withdraws; only then does the newcomer's read get through. The correct
    peer sits the round out; the newcomer, reading only its done marker, raises (the marker
    keeps the declaration that the peer's read at the close grouped: the newcomer, which had
    declared by then, counts it as declared, of another layout)."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 64, fast_config())
            first = await step_all(members, timeout=10.0)
            assert all(info.outcome is Outcome.AVERAGED for info, _ in first)  # type: ignore[union-attr]
            values = members[0].array.copy()
            newcomer = Averager(nodes[2], "t/x", [np.ones(65, np.float32)], config=fast_config())
            withdrawn = _on_done_markers(members[:1], 1)
            reads: list[float] = []
            read_entries = nodes[2].dht.read_entries

            async def late_read(key: str, **kwargs: Any) -> Any:
                if newcomer._matchmaker.current is not None:
                    await withdrawn.wait()  # the gather's read, not the choice of a round
                    reads.append(trio.current_time())
                return await read_entries(key, **kwargs)

            nodes[2].dht.read_entries = late_read  # type: ignore[method-assign,assignment]
            await trio.sleep(WINDOW - trio.current_time() % WINDOW + 0.05)
            outcome: list[AveragingInfo | LayoutMismatchError] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step_or_mismatch, newcomer, 4.0, outcome)
                info = await members[0].averager.step(timeout=4.0)
    assert reads, "the newcomer never read the round"
    [error] = outcome
    assert isinstance(error, LayoutMismatchError), error
    assert "every other peer under 't/x' has another tensor layout" in str(error), error
    assert "65 elements" in str(error) and "64 elements" in str(error), error
    assert info.outcome is Outcome.ALONE, info
    assert "another layout" in info.note, info.note
    np.testing.assert_array_equal(members[0].array, values)  # untouched


async def test_done_strangers_with_company_count_toward_being_outnumbered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer left behind by a swarm that closes early reads only the swarm's markers: two
    or more of one layout count as strangers with company (it is told after
    OUTNUMBERED_ROUNDS rounds); a lone one, or markers of unknown layout, do not."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            matchmaker = Matchmaker(nodes[0], "t/x", fast_config(), 1000, lambda: 0.0)
            me = Declaration(nodes[0].peer_id, nodes[0].address, 1.0, 0, 1.0, "ours", 0, 1000)
            mate = Declaration(nodes[1].peer_id, nodes[1].address, 1.0, 0, 1.0, "ours", 0, 1000)
            matchmaker._check_layouts(me, [mate], Counter())
            for _ in range(5):  # never outnumbered: sits these out
                matchmaker._check_layouts(me, [], Counter({"theirs": 1, None: 4}))
            matchmaker._check_layouts(me, [], Counter({"theirs": 2}))  # outnumbered once...
            matchmaker._check_layouts(me, [], Counter({"ours": 1, "theirs": 3}))  # ...reset
            for _ in range(OUTNUMBERED_ROUNDS - 1):
                matchmaker._check_layouts(me, [], Counter({"theirs": 2}))
            with pytest.raises(LayoutMismatchError, match="finished matchmaking"):
                matchmaker._check_layouts(me, [], Counter({"theirs": 2}))


def test_done_markers_are_counted_by_layout() -> None:
    entries = {
        "me": done_marker("ours"),
        "a": done_marker("ours"),
        "b": done_marker("theirs"),
        "c": {"done": True},
        "d": {"done": True, "layout": ["x"]},
        "e": {"done": False, "layout": "ours"},
        "f": "done",
    }
    assert parse_done(entries, exclude="me") == Counter({"ours": 1, "theirs": 1, None: 2})


WORDS = "1 tensor (1 float32; shapes 1000), codec none, layout v9"


def _ours_two(nodes: list[Peer]) -> tuple[Matchmaker, Declaration, Declaration]:
    """The first node's matchmaker, its declaration, and a mate's of the same layout."""
    matchmaker = Matchmaker(nodes[0], "t/x", fast_config(), 1000, lambda: 0.0)
    me = Declaration(nodes[0].peer_id, nodes[0].address, 1.0, 0, 1.0, "ours", 0, 1000)
    me = replace(me, detail=WORDS)
    return matchmaker, me, replace(me, peer_id=nodes[1].peer_id, address=nodes[1].address)


async def test_a_foreign_layout_is_warned_about_once_whatever_describes_it(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A stranger's declaration names its settings in words; its "done" marker keeps the
    declaration without them. Keyed by the words, the one layout was warned about twice,
    the second time without what differs (an outside tester). Once per fingerprint, with
    the fullest words at hand."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            matchmaker, me, mate = _ours_two(nodes)
            odd = replace(
                me,
                peer_id=nodes[2].peer_id,
                address=nodes[2].address,
                layout="theirs",
                detail=WORDS.replace("codec none", "codec float16"),
            )
            caplog.set_level(logging.WARNING, logger="training.averaging.matchmaking")
            bare = replace(odd, detail="")  # as its done marker keeps it
            for others in ([mate, bare], [mate, odd], [mate, odd, bare], [mate, bare]):
                matchmaker._check_layouts(me, others, Counter())
    said = [r.getMessage() for r in caplog.records if "another tensor layout" in r.getMessage()]
    assert len(said) == 1, said
    where = nodes[2].address.rpartition("@")[2]
    assert f"declared by {nodes[2].peer_id.short()} at {where})" in said[0], said  # who


async def test_each_foreign_layout_warning_names_only_its_own_declarers_and_stays_short(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A second stranger's warning listed the first one's layout and differences too,
    under the second one's name only; 300 strangers of distinct layouts made one warning
    of 40,785 characters (a re-check)."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            matchmaker, me, mate = _ours_two(nodes)
            first = replace(
                me, peer_id=nodes[2].peer_id, address=nodes[2].address, layout="f16",
                detail=WORDS.replace("codec none", "codec float16"),
            )  # fmt: skip
            second_id = Identity.from_seed(b"s" * 32).peer_id
            second = replace(
                me, peer_id=second_id, address=f"{second_id}@10.9.0.2:7000", layout="2k",
                total=2000, detail=WORDS.replace("shapes 1000", "shapes 2000"),
            )  # fmt: skip
            caplog.set_level(logging.WARNING, logger="training.averaging.matchmaking")
            matchmaker._check_layouts(me, [mate, first], Counter())
            matchmaker._check_layouts(me, [mate, first, second], Counter())
            ids = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(256)]
            crowd = [
                replace(second, peer_id=p, address=f"{p}@10.9.1.{i}:7000", layout=f"x{i}")
                for i, p in enumerate(ids)
            ]
            matchmaker._check_layouts(me, [mate, *crowd], Counter())
    said = [r.getMessage() for r in caplog.records if "another tensor layout" in r.getMessage()]
    assert len(said) == 3, said
    assert "codec float16" in said[0] and "shapes 2000" not in said[0]
    assert "shapes 2000" in said[1] and "codec float16" not in said[1], said[1]
    assert f"declared by {second_id.short()} at 10.9.0.2:7000)" in said[1], said[1]
    assert len(said[2]) < 5000, len(said[2])
