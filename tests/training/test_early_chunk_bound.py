"""Chunks that come before our group is confirmed wait for it, payload and all; anyone who
read our round from the DHT can send them. A hostile trial peer sent 240 calls of 4 MiB to
a peer in the gather window: ~590 MB held until the group formed, then refused. Now a
sender parks at most ``2 * max_inflight`` chunks, none larger than a chunk's blob, and
the rest are refused (``busy``) at once."""

from __future__ import annotations

import pytest
import trio
from test_averaging_support import fast_config, make_members, memnet_swarm

from peer import RemoteError
from protocol.address import Address
from training import Averager
from training.averaging.messages import ChunkHeader, method_prefix


def _on_entering_a_round(averager: Averager) -> trio.Event:
    """An event set once ``averager`` has entered a round: its gather window, no group yet."""
    entered = trio.Event()
    enter_round = averager._enter_round

    def entering(number: int) -> None:
        enter_round(number)
        entered.set()

    averager._enter_round = entering  # type: ignore[method-assign]
    return entered


async def test_early_chunks_are_bounded_per_sender_and_in_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = fast_config(gather_window=10.0, max_inflight=4)
    with trio.fail_after(120):
        async with memnet_swarm(2) as (_, nodes):
            victim, attacker = nodes
            [member] = make_members([victim], 4096, config)
            outcomes: list[str] = []

            async def flood(round_no: int, payload: bytes) -> None:
                body = ChunkHeader(
                    round_no, 0, 0, 0, 1.0, group_id=(1).to_bytes(16, "big")
                ).to_body()
                method = f"{method_prefix('t/x')}.chunk"
                assert victim.rpc.listen_address is not None
                address = Address.parse(victim.address)
                try:
                    await attacker.rpc.call(address, method, body, payload)
                    outcomes.append("answered")
                except RemoteError as exc:
                    outcomes.append(exc.code)

            entered = _on_entering_a_round(member.averager)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member.averager.step)
                await entered.wait()  # in its gather window: no group yet
                assert member.averager._active is not None
                round_no = member.averager._active.round
                for _ in range(20):
                    nursery.start_soon(flood, round_no, bytes(1024))
                nursery.start_soon(flood, round_no, bytes(1 << 20))  # larger than any chunk
                await trio.sleep(1.0)
                busy_at_once = outcomes.count("busy")
    # 8 parked (2 x max_inflight), 12 small ones and the large one refused at once
    assert busy_at_once == 13, outcomes
    assert len(outcomes) == 21 and outcomes.count("busy") == 13


async def test_early_chunks_with_a_malformed_header_are_bounded_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A chunk whose header does not parse but names our round and group waits for the
    group too (to drop its sender as garbage): a security review's 128 such calls of 4 MiB
    were all held, payload and all, until the group formed (+515 MB, one connection). They
    are parked within the same bounds now; the rest are answered bad_request at once."""
    config = fast_config(gather_window=10.0, max_inflight=4)
    with trio.fail_after(120):
        async with memnet_swarm(2) as (_, nodes):
            victim, attacker = nodes
            [member] = make_members([victim], 4096, config)
            outcomes: list[str] = []

            async def flood(round_no: int, payload: bytes) -> None:
                body = {"round": round_no, "group": (1).to_bytes(16, "big"), "part": 0}
                method = f"{method_prefix('t/x')}.chunk"
                try:
                    await attacker.rpc.call(Address.parse(victim.address), method, body, payload)
                    outcomes.append("answered")
                except RemoteError as exc:
                    outcomes.append(exc.code)

            entered = _on_entering_a_round(member.averager)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member.averager.step)
                await entered.wait()
                assert member.averager._active is not None
                round_no = member.averager._active.round
                for _ in range(20):
                    nursery.start_soon(flood, round_no, bytes(1024))
                nursery.start_soon(flood, round_no, bytes(1 << 20))
                await trio.sleep(1.0)
                at_once = list(outcomes)
                assert member.averager._active.parked_bytes == 8 * 1024
    assert at_once == ["bad_request"] * 13, at_once
    assert outcomes == ["bad_request"] * 21


async def test_join_and_result_requests_carry_nothing_extra(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Join and result requests wait (for the round to close, the group to form) while
    holding the request: one padded with a payload or extra keys is refused at once, not
    held for the gather window."""
    config = fast_config(gather_window=10.0)
    with trio.fail_after(120):
        async with memnet_swarm(2) as (_, nodes):
            victim, attacker = nodes
            [member] = make_members([victim], 4096, config)
            entered = _on_entering_a_round(member.averager)
            address = Address.parse(victim.address)
            methods = method_prefix("t/x")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member.averager.step)
                await entered.wait()
                assert member.averager._active is not None
                round_no = member.averager._active.round
                decl = member.averager._matchmaker.current.me.to_wire()  # type: ignore[union-attr]
                joins = [
                    ({"round": round_no, "decl": decl}, bytes(1 << 20)),
                    ({"round": round_no, "decl": decl, "pad": "x" * 1000}, b""),
                    ({"round": round_no, "decl": {**decl, "pad": "x"}}, b""),
                ]
                for body, payload in joins:
                    start = trio.current_time()
                    with pytest.raises(RemoteError, match="bad_request"):
                        await attacker.rpc.call(address, f"{methods}.join", body, payload)
                    assert trio.current_time() - start < 0.1
                results = [
                    ({"round": round_no, "group": (1).to_bytes(16, "big"), "part": 0}, b"x"),
                    ({"round": round_no, "group": (1).to_bytes(16, "big"), "part": 0, "p": 1}, b""),
                ]
                for body, payload in results:
                    start = trio.current_time()
                    with pytest.raises(RemoteError, match="bad_request"):
                        async with attacker.rpc.stream(
                            address, f"{methods}.result", body, payload
                        ) as items:
                            async for _ in items:
                                pass
                    assert trio.current_time() - start < 0.1
