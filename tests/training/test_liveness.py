"""The probe that tells a frozen peer from a busy one (``training.averaging.plan.Liveness``)."""

from __future__ import annotations

import math
from typing import Any

import trio
import trio.testing

from protocol.identity import Identity, PeerID
from training.averaging.grouping import Declaration
from training.averaging.plan import Liveness, Plan
from training.averaging.reducer import DropReason

ME = Identity.from_seed(b"m" * 32).peer_id
OTHER = Identity.from_seed(b"o" * 32).peer_id


class _SlowHost:
    """A host whose calls never get their answer (a ping queued behind 2 MiB chunks on a
    starved peer) while frames from the peer may still arrive at ``heard``."""

    def __init__(self) -> None:
        self.heard = -math.inf

    async def call(self, *args: Any) -> None:
        await trio.sleep_forever()

    def last_heard(self, peer_id: PeerID) -> float:
        return self.heard

    def connected_peers(self) -> list[PeerID]:
        return [OTHER]

    async def disconnect(self, peer_id: PeerID) -> None:
        pass  # (a probe closes a silent connection before pinging over a fresh one)


class _Node:
    def __init__(self) -> None:
        self.rpc = _SlowHost()


def _liveness(node: _Node, other_address: str | None) -> Liveness:
    members = (
        Declaration(ME, f"{ME}@127.0.0.1:1", 1.0, 0, 1.0, "layout", 0),
        Declaration(OTHER, other_address, 1.0, 0, 1.0, "layout", 0),
    )
    plan = Plan(1, ME, members, members, ((0, 1), (1, 2)), {ME: 1.0, OTHER: 1.0}, 0)
    return Liveness(node, plan, "ping", timeout=1.0)  # type: ignore[arg-type]


async def test_a_peer_whose_ping_is_late_but_whose_frames_keep_coming_is_busy_not_frozen(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Measured between processes on a loaded 2-core VM: with stall_timeout 1.5 s every
    healthy peer was dropped as frozen (a ping's answer waited behind chunks for more than
    0.75 s) and the round was lost. A frame from the peer during the probe, or shortly
    before it, now means busy; a peer that sends nothing is still frozen."""
    node = _Node()
    liveness = _liveness(node, f"{OTHER}@127.0.0.1:2")

    async def frames_keep_coming() -> None:
        while True:
            await trio.sleep(0.3)
            node.rpc.heard = trio.current_time()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(frames_keep_coming)
            assert await liveness.probe(OTHER) is None
            nursery.cancel_scope.cancel()
        await trio.sleep(5)  # silent since
        assert await liveness.probe(OTHER) is DropReason.FROZEN
    assert liveness.bad == {OTHER: DropReason.FROZEN}


async def test_a_busy_client_mode_sender_is_not_frozen_either(
    autojump_clock: trio.testing.MockClock,
) -> None:
    node = _Node()
    liveness = _liveness(node, None)  # cannot be pinged
    node.rpc.heard = trio.current_time()
    with trio.fail_after(10):
        assert await liveness.probe(OTHER) is None
        await trio.sleep(5)
        assert await liveness.probe(OTHER) is DropReason.FROZEN
