"""Members fall back to the next-ranked leader when their group's leader is a ghost: a peer
that declared in the round but does not answer its join (no averager, not in the round, or
gone), all within the same round. Memory network, virtual time."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
from test_averaging_support import (
    Member,
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    slow_joins,
    step_all,
    verify_round,
    virtual_clock,
)

from peer import Peer, RemoteError, Reply, Request
from protocol.errors import RemoteProtocolError
from protocol.identity import PeerID
from training import Averager, AveragingInfo, Outcome
from training.averaging.grouping import Declaration, rank_key, round_closing_after, round_key
from training.averaging.messages import JoinRequest, method_prefix
from training.averaging.round_state import RoundState

SIZE = 3000
WINDOW = 1.0  # fast_config's gather_window
JOIN_TIMEOUT = 0.5  # fast_config's join_timeout


def by_rank(nodes: Sequence[Peer]) -> list[int]:
    """Indices of ``nodes`` in the order the first round ranks them (leader first): the
    seed of round count 0 under prefix t/x, see grouping._group_one_layout."""
    seed = hashlib.sha256(b"t/x|round|0").digest()
    return sorted(range(len(nodes)), key=lambda i: rank_key(seed, nodes[i].peer_id))


@asynccontextmanager
async def ghost_declaring(node: Peer, *, serve: bool = False) -> AsyncIterator[Averager]:
    """While in the context, ``node`` declares with the members' layout in the round open
    now and the next one, again every quarter window (as the sybils of the trial in
    docs/averaging.md did): whichever round the members take, and any they retry in, has
    the ghost. Without ``serve`` its averager is closed, so that the node answers the join
    with ``unknown_method`` (a bare node, a sybil); with it, the averager stays open but
    never steps (``not_found``: not in the round)."""
    averager = Averager(node, "t/x", [np.zeros(SIZE, np.float32)], config=fast_config())
    decl = Declaration(
        node.peer_id, node.address, 1.0, 0, averager.config.bandwidth, averager.layout_id, 0,
        SIZE, averager.config.group_size, averager._detail,
    )  # fmt: skip
    if not serve:
        averager.close()

    async def declare_now() -> None:
        now = round_closing_after(virtual_clock(), WINDOW)
        for number in (now, now + 1):
            with trio.move_on_after(WINDOW / 4):
                key = round_key("t/x", number)
                await node.dht.store(key, decl.to_wire(), ttl=20.0, subkey=str(node.peer_id))

    async def declare(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await declare_now()
        task_status.started()
        while True:
            await trio.sleep(WINDOW / 4)
            await declare_now()

    async with trio.open_nursery() as nursery:
        await nursery.start(declare)
        yield averager
        nursery.cancel_scope.cancel()
    averager.close()


def assert_one_group_without(
    members: Sequence[Member], results: Sequence[tuple[AveragingInfo | None, float]],
    ghosts: Sequence[PeerID], leader: PeerID,
) -> None:  # fmt: skip
    """Every member averaged the whole vector with all the others in one round (the
    ghosts' round: no retry), led by ``leader``; the reports name the skipped ghosts."""
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    everyone = {m.peer_id for m in members}
    for info, elapsed in results:
        assert info is not None and info.outcome is Outcome.AVERAGED, info
        assert set(info.group) == everyone and not set(ghosts) & set(info.group)
        assert info.leader == leader and info.round == infos[0].round  # type: ignore[union-attr]
        # a lone peer waits at most 1.5 windows; a retry would have taken another window
        assert info.matchmaking_s <= 1.5 * WINDOW + JOIN_TIMEOUT, info.matchmaking_s
        assert elapsed < 5.0
        for ghost in ghosts:
            assert ghost.short() in info.note, info.note


async def test_a_ghost_leader_that_runs_no_averager_is_skipped_in_the_same_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The top-ranked peer declared but serves no join (``unknown_method``): the others
    still average together in that round, led by the second-ranked one. Before, all of them
    were ``unconfirmed``, round after round while the ghost kept declaring."""
    with trio.fail_after(60):
        async with memnet_swarm(6, first_seed=40) as (_, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]  # nodes[0] is only the bootstrap
            ghost, rest = nodes[order[0]], [nodes[i] for i in order[1:]]
            members = make_members(rest, SIZE, fast_config())
            async with ghost_declaring(ghost):
                results = await step_all(members, timeout=20.0)
    assert_one_group_without(members, results, [ghost.peer_id], members[0].peer_id)
    lead = results[0][0]
    assert lead is not None and "we led" in lead.note, lead


async def test_two_ghosts_ranked_first_and_second_are_both_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first ghost runs no averager, the second crashed after declaring (its host is
    gone: the connection is refused): the third-ranked peer leads the rest."""
    with trio.fail_after(60):
        async with memnet_swarm(7, first_seed=60) as (net, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]
            bare, crashed = nodes[order[0]], nodes[order[1]]
            members = make_members([nodes[i] for i in order[2:]], SIZE, fast_config())
            async with ghost_declaring(bare), ghost_declaring(crashed, serve=True):
                net.kill_host(host_of(order[1]))  # it declared: its declaration stays
                results = await step_all(members, timeout=20.0)
    ghosts = [bare.peer_id, crashed.peer_id]
    assert_one_group_without(members, results, ghosts, members[0].peer_id)


async def test_a_ghost_that_answers_not_in_the_round_is_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The top-ranked peer is reachable and runs an averager under the prefix, but it is
    not in the round (its join answers ``not_found``, and so does its ping)."""
    with trio.fail_after(60):
        async with memnet_swarm(5, first_seed=80) as (_, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]
            ghost = nodes[order[0]]
            members = make_members([nodes[i] for i in order[1:]], SIZE, fast_config())
            async with ghost_declaring(ghost, serve=True):
                results = await step_all(members, timeout=20.0)
    assert_one_group_without(members, results, [ghost.peer_id], members[0].peer_id)
    assert "not_found" in results[1][0].note  # type: ignore[union-attr]


async def test_a_member_told_of_the_ghost_before_trying_it_checks_and_takes_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The second-ranked peer is slow to call the ghost: a join naming the ghost as skipped
    reaches it first. It must not point that caller back at the ghost: it pings the ghost,
    finds it gone, cuts its own call short and leads."""
    with trio.fail_after(60):
        async with memnet_swarm(5, first_seed=40) as (_, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]
            ghost = nodes[order[0]]
            members = make_members([nodes[i] for i in order[1:]], SIZE, fast_config())
            slow_joins(members[0].averager.node, delay=0.3)
            replies = [slow_joins(m.averager.node, 0.0) for m in members[1:]]
            pings = spy_pings(members[0].averager)
            async with ghost_declaring(ghost):
                results = await step_all(members, timeout=20.0)
    # it checked the ghost for the callers (each that came while no answer was known yet)
    assert pings and set(pings) == {(ghost.address, False)}, pings
    assert_one_group_without(members, results, [ghost.peer_id], members[0].peer_id)
    for got in replies:  # one refusal from the ghost, then the confirmation: no redirect
        assert len(got) == 2 and got[1]["status"] == "ok", got  # type: ignore[index]
    lead = results[0][0]  # it cut its own slow call to the ghost short
    assert lead is not None and "failed a ping" in lead.note, lead


def spy_pings(averager: Averager) -> list[tuple[str | None, bool]]:
    """What ``averager``'s matchmaker finds when a caller's join names its own leader as
    skipped and it pings that leader: (address, whether it answered) each time. Not the
    pings it makes as a leader, to its expected members that have not joined."""
    matchmaker = averager._matchmaker
    answers, seen = matchmaker._answers, []

    async def spy(state: RoundState, address: str | None) -> bool:
        as_leader = state.is_leader
        result = await answers(state, address)
        if not as_leader:
            seen.append((address, result))
        return result

    matchmaker._answers = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("cut", ["third", "second", "second_and_third", "slow_third"])
async def test_a_leader_alive_but_unreachable_for_some_does_not_split_a_group(
    autojump_clock: trio.testing.MockClock, cut: str
) -> None:
    """The leader (A) is alive; some members cannot reach it (their connections to it are
    refused: a partition between them), or one reaches it slowly. A member that skipped A
    is redirected to it by the next-ranked B, which reaches A; B leads only when it cannot
    reach A itself, and then only those that could not either. No member is ever in two
    groups; everyone in a group reports the same group."""
    with trio.fail_after(60):
        async with memnet_swarm(5, first_seed=40) as (net, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]
            hosts = [host_of(i) for i in order]  # A, B, C, D in rank order
            members = make_members([nodes[i] for i in order], SIZE, fast_config())
            a, b, c, d = (m.peer_id for m in members)
            pings = spy_pings(members[1].averager)
            if cut == "slow_third":  # slow, not failing: joins A late, within join_timeout
                slow_joins(members[2].averager.node, delay=0.3, to=a)
            else:
                cut_off = {"third": [2], "second": [1], "second_and_third": [1, 2]}[cut]
                net.partition([hosts[0]], [hosts[i] for i in cut_off])
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    assert all(info is not None for info in infos)
    verify_round(members, infos)  # type: ignore[arg-type]
    groups = {
        m.peer_id: (frozenset(info.group), info.leader)
        for m, info in zip(members, infos, strict=True)
        if info is not None and info.outcome is Outcome.AVERAGED
    }
    for me, (group, _) in groups.items():  # a group is the same for all its members...
        assert me in group and all(groups[p] == groups[me] for p in group), groups
    distinct = set(groups.values())  # ... and no member is in two of them
    assert sum(len(g) for g, _ in distinct) == len({p for g, _ in distinct for p in g})
    expected = {
        "third": {(frozenset({a, b, d}), a)},  # C is unconfirmed: redirected to A, refused
        "second": {(frozenset({a, c, d}), a)},  # B led nobody: the others had A
        "second_and_third": {(frozenset({a, d}), a), (frozenset({b, c}), b)},
        "slow_third": {(frozenset({a, b, c, d}), a)},
    }[cut]
    assert distinct == expected, (cut, groups)
    # B checked A for C only where B reached A itself (else it had found A gone already)
    assert pings == ([(members[0].averager.node.address, True)] if cut == "third" else [])
    for m, info in zip(members, infos, strict=True):
        if m.peer_id not in groups:
            assert info is not None and info.outcome in (Outcome.UNCONFIRMED, Outcome.ALONE)
            assert len(info.group) == 1


def test_a_join_body_without_skipped_still_parses_and_the_list_is_bounded() -> None:
    """An older member's body (``round``, ``decl``) parses with nothing skipped; a new one
    carries ``skipped`` only when non-empty, bounded by the group size."""
    peer = PeerID(bytes(32))
    decl = Declaration(peer, None, 1.0, 0, 1.0, "lay", 0)
    old = {"round": 7, "decl": decl.to_wire(tagged=False)}
    assert JoinRequest.from_body(peer, old) == JoinRequest(7, decl)
    assert JoinRequest(7, decl).to_body() == old
    skipped = tuple(PeerID(bytes([i]) * 32) for i in range(1, 4))
    body = JoinRequest(7, decl, skipped).to_body()
    assert body["skipped"] == [str(p) for p in skipped]
    assert JoinRequest.from_body(peer, body, max_skipped=3).skipped == skipped
    with pytest.raises(RemoteProtocolError, match="at most 2"):
        JoinRequest.from_body(peer, body, max_skipped=2)
    for bad in ("abc", [1], ["not base58!"], {"a": 1}):
        with pytest.raises(RemoteProtocolError):
            JoinRequest.from_body(peer, dict(old, skipped=bad))


async def test_a_redirect_is_dialed_with_the_peer_id_of_the_leader_it_names(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reviewer's attack: the top-ranked peer answers every join ``not_leader``, naming a
    bystander (which never averages) at another member's bare ``HOST:PORT``. Dialed without
    the named PeerID, the member there answered for it: three members reported the
    bystander as their leader, and one joined the real host there although it had benched
    it. The redirect is now dialed with the PeerID it names, so nobody reaches the
    bystander there, and nobody takes anyone else for it."""
    with trio.fail_after(60):
        async with memnet_swarm(6, first_seed=40) as (_, nodes):
            order = [i + 1 for i in by_rank(nodes[1:])]
            redirector, rest = nodes[order[0]], [nodes[i] for i in order[1:]]
            bystander = nodes[0]  # runs no averager
            members = make_members(rest, SIZE, fast_config())
            real = members[0]  # who answers at the address the redirect gives
            members[2].averager._matchmaker.bench.record(real.peer_id, "test: garbage")
            bare = str(real.averager.node.address).split("@", 1)[1]  # HOST:PORT only

            async def join(request: Request) -> Reply:
                if request.peer_id == real.peer_id:
                    raise RemoteError("not_found", "not in the round")
                body = {"status": "not_leader", "leader": str(bystander.peer_id), "address": bare}
                return Reply(body)

            async with ghost_declaring(redirector):
                redirector.rpc.register(f"{method_prefix('t/x')}.join", join)
                results = await step_all(members, timeout=20.0)
    for info, _ in results:
        assert info is not None
        assert info.leader != bystander.peer_id, str(info)
        assert bystander.peer_id not in info.group, str(info)
    benched_it = results[2][0]
    assert benched_it is not None
    assert benched_it.leader != real.peer_id or real.peer_id not in benched_it.group, str(
        benched_it
    )
