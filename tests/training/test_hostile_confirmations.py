"""A leader whose confirmation no honest leader sends (malformed, parts not cut by the
listed bandwidths, more members than ``group_size``, a member of another layout, our own
declaration misstated) is benched by
each member that got it: the members skip it from the next round on and average without
it. Before, an unconfirmed round left the grid phase, and so the ranking, as it was, and
the same hostile leader led, and spoiled, every later round (an outside tester's trial:
12 of 12 rounds). Memory network, virtual time; the members' own join calls alter what the
first leader answers, as a hostile leader would send it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from test_averaging_support import (
    fast_config,
    make_members,
    memnet_swarm,
    step_all,
    verify_round,
)

from peer import Peer, Reply
from protocol.address import Address
from protocol.identity import Identity, PeerID
from training import Outcome

SIZE = 3000
Tamper = Callable[[dict[str, Any], PeerID], dict[str, Any]]


def _bad_spans(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    return {**body, "spans": [[0, 1] for _ in body["spans"]]}  # they do not tile


def _whole_vector_to_the_first(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    """Parts that tile, cut as no bandwidths cut them: the first reducer (the leader, in
    hash order) takes the whole vector, every other part empty (an outside review's
    leader set every value so, and every report said averaged, ``all``)."""
    total = body["spans"][-1][1]
    return {**body, "spans": [[0, total], *([total, total] for _ in body["spans"][1:])]}


def _a_fifth_member(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    """One more (client-mode, so that the spans stay right) member than group_size 4."""
    extra = Identity.from_seed(b"\x07" * 32).peer_id
    wire = {**body["members"][0][1], "address": None, "client_mode": True}
    return {**body, "members": [*body["members"], [str(extra), wire]]}


def _another_layout(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    members = [list(m) for m in body["members"]]
    other = next(i for i, (peer, _) in enumerate(members) if peer != str(me))
    members[other][1] = {**members[other][1], "layout": "v9:another"}
    return {**body, "members": members}


def _our_weight_forged(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    members = [
        [peer, {**wire, "weight": 1e300} if peer == str(me) else wire]
        for peer, wire in body["members"]
    ]
    return {**body, "members": members}


def _our_epoch_forged(body: dict[str, Any], me: PeerID) -> dict[str, Any]:
    members = [
        [peer, {**wire, "epoch": 2**62 - 1} if peer == str(me) else wire]
        for peer, wire in body["members"]
    ]
    return {**body, "members": members}


def tamper_first_leader(nodes: list[Peer], how: Tamper) -> list[PeerID]:
    """Every node's join calls see the first leader that confirms (and only it) answer
    ``how(body, caller)`` instead; returns the list that then holds that leader's PeerID."""
    hostile: list[PeerID] = []
    for node in nodes:
        call: Callable[..., Awaitable[Reply]] = node.rpc.call

        async def altered(
            address: Address,
            method: str,
            body: object = None,
            payload: bytes = b"",
            *,
            _call: Callable[..., Awaitable[Reply]] = call,
            _me: PeerID = node.peer_id,
        ) -> Reply:
            reply = await _call(address, method, body, payload)
            if method.endswith(".join") and reply.body.get("status") == "ok":
                if not hostile:
                    hostile.append(address.peer_id)  # type: ignore[arg-type]
                if address.peer_id == hostile[0]:
                    return Reply(how(dict(reply.body), _me), reply.payload)
            return reply

        node.rpc.call = altered  # type: ignore[method-assign]
    return hostile


@pytest.mark.parametrize(
    ("how", "said"),
    [
        (_bad_spans, "malformed"),
        (_whole_vector_to_the_first, "cutting the parts otherwise than its members'"),
        (_a_fifth_member, "listing 5 members, more than our group_size 4"),
        (_another_layout, "with another layout"),
        (_our_weight_forged, "misstating our declaration (weight 1e+300"),
        (_our_epoch_forged, "epoch 4611686018427387903; we declared"),
    ],
    ids=[
        "malformed",
        "whole-vector",
        "over-group-size",
        "another-layout",
        "our-weight",
        "our-epoch",
    ],
)
async def test_a_leader_that_sends_a_bad_confirmation_is_benched_and_left_out(
    autojump_clock: trio.testing.MockClock, how: Tamper, said: str
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(group_size=4))
            hostile = tamper_first_leader(nodes, how)
            first = await step_all(members, timeout=10.0)
            assert hostile, "a leader confirmed"
            honest = [m for m in members if m.peer_id != hostile[0]]
            for m in honest:
                (info, elapsed) = first[members.index(m)]
                assert info is not None and elapsed <= 10.0
                assert info.outcome is Outcome.UNCONFIRMED, info
                assert said in info.note and "(we benched it)" in info.note, info.note
                m.data = m.array.copy()  # (untouched: nothing was averaged)
            # The next rounds: the same ranking, the same first-ranked leader; the
            # members skip it and average among themselves, the whole vector.
            for _ in range(2):
                results = await step_all(members, timeout=10.0)
                infos = [results[members.index(m)][0] for m in honest]
                verify_round(honest, infos)  # type: ignore[arg-type]
                for info in infos:
                    assert info is not None and info.outcome is Outcome.AVERAGED, info
                    assert set(info.group) == {m.peer_id for m in honest}
                    assert info.averaged_fraction == 1.0
                for m in honest:
                    m.data = m.array.copy()
