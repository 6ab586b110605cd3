"""Which round a peer ready shortly before a round closes takes (docs/protocol.md 9.2):
that round only when a peer of its own layout declared there. A declaration of another
layout (a misconfigured or newer peer) drew a correct newcomer into a round where it
could only fail (LayoutMismatchError), while the next correct peer, ready a moment later,
took the round after and waited there for it (an outside tester, 4 of 5 runs). Memory
network, virtual time."""

from __future__ import annotations

import math

import trio
import trio.testing
from test_averaging_support import (
    declaration_wire,
    fast_config,
    make_members,
    memnet_swarm,
    verify_round,
    virtual_clock,
)

from training import Outcome
from training.averaging.grouping import round_key


async def test_a_declaration_of_another_layout_does_not_draw_a_newcomer_into_its_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = fast_config()  # gather_window 1 s
    window = config.gather_window
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            odd, honest = nodes[0], nodes[1:]
            members = make_members(honest, 64, config)
            closing = math.floor(virtual_clock() / window) + 3  # a round well ahead
            declaration = declaration_wire(address=odd.address, layout="v9:odd")
            key = round_key("t/x", closing)
            assert await odd.dht.store(key, declaration, ttl=30.0, subkey=str(odd.peer_id))
            results: list[object] = [None, None]

            async def step(index: int, at: float) -> None:
                await trio.sleep(at - virtual_clock())
                member = members[index]
                results[index] = await member.averager.step(
                    weight=member.weight, epoch=member.epoch, timeout=10.0
                )

            async with trio.open_nursery() as nursery:
                # the first is ready 0.3 s before the round closes (between w/8 and w/2:
                # it takes that round if a peer of its layout declared there), the second
                # 0.05 s before (under w/8: it takes the next)
                nursery.start_soon(step, 0, closing * window - 0.3)
                nursery.start_soon(step, 1, closing * window - 0.05)
    verify_round(members, results)  # type: ignore[arg-type]
    for info in results:
        assert info is not None and info.outcome is Outcome.AVERAGED, info  # type: ignore[attr-defined]
        assert len(info.group) == 2  # type: ignore[attr-defined]
