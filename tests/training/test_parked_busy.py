"""A reducer parks the chunks that come before its group is confirmed, within a budget that
anyone who read the round can fill. A member whose early chunk found it full used to take
the ``busy`` answer as final and give up its part for the round (a stranger's 16 calls of
4 MiB cost an honest pair half the vector: averaged_fraction 0.5 after 13.3 s, black-box
trial). Now the sender tries again shortly: it gets in once the group is confirmed."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from peer import RemoteError
from protocol.address import Address
from training.averaging.matchmaking import Matchmaker
from training.averaging.messages import ChunkHeader, method_prefix
from training.averaging.report import Outcome

MiB = 1 << 20


async def test_a_member_refused_as_busy_before_confirmation_sends_again(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    oversized_sends: None,  # the stranger's 4 MiB chunks
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            victim, honest, stranger = nodes
            members = make_members([victim, honest], 6144, fast_config(chunk_bytes=2 * MiB))
            find_group = Matchmaker.find_group

            async def late(self: Matchmaker, *args: Any, **kwargs: Any) -> Any:
                found = await find_group(self, *args, **kwargs)
                if self.node is victim:  # its loop busy for 20 ms after the confirmation:
                    await trio.sleep(0.02)  # the other's first chunk comes before it is ready
                return found

            monkeypatch.setattr(Matchmaker, "find_group", late)
            answers: list[str] = []

            async def flood(round_no: int) -> None:
                body = ChunkHeader(
                    round_no, 0, 0, 0, 1.0, group_id=(1).to_bytes(16, "big")
                ).to_body()
                method = f"{method_prefix('t/x')}.chunk"
                try:  # the most a chunk may carry, parked until the group is confirmed
                    await stranger.rpc.call(
                        Address.parse(victim.address), method, body, bytes(4 * MiB - 400)
                    )
                    answers.append("ok")
                except RemoteError as exc:
                    answers.append(exc.code)

            results: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def steps() -> None:
                    results.extend(await step_all(members, timeout=20.0))

                nursery.start_soon(steps)
                averager = members[0].averager
                while averager._active is None:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.001)
                active = averager._active
                for _ in range(16):
                    nursery.start_soon(flood, active.round)
                filled = 0
                while not active.ready.is_set():
                    filled = max(filled, active.parked_bytes)
                    await trio.sleep(0.001)
    infos = [info for info, _ in results]
    verify_round(members, infos)
    assert filled > 60 * MiB  # the stranger did fill the room for early chunks
    assert "ok" not in answers  # and was refused as a non-member once the group formed
    for info, took in results:
        assert info.outcome is Outcome.AVERAGED and info.averaged_fraction == 1.0
        assert took < 2.0  # (13.3 s, at the cutoff, when the honest part was given up)
