"""The way averaging.md tells test writers to make a member send garbage (wrap its node's
``rpc.call``: the averager sends every chunk through it) works, and the round then reports
the culprit as the guarantees say."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from training.averaging.reducer import DropReason
from training.averaging.report import PartStatus


async def test_a_member_whose_chunk_calls_are_wrapped_sends_garbage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with memnet_swarm(4) as (_, nodes):
        members = make_members(nodes, 6000, fast_config())
        culprit = members[3]

        # as in averaging.md, "Your own tests, in virtual time"
        rpc = nodes[3].rpc
        honest_call = rpc.call

        async def corrupting_call(
            address: Any, method: str, body: Any = None, payload: Any = b"", **kwargs: Any
        ) -> Any:
            if method.endswith(".chunk"):  # "{prefix}.chunk": protocol.md section 9
                payload = bytes(payload)[:-4]  # not the codec's size: dropped as garbage
            return await honest_call(address, method, body, payload, **kwargs)

        rpc.call = corrupting_call  # type: ignore[method-assign]

        with trio.fail_after(60):
            results = await step_all(members, timeout=30.0)
        infos = [info for info, _ in results]
        assert all(info is not None and elapsed <= 30.0 for info, elapsed in results)
        verify_round(members, infos)  # type: ignore[arg-type]
        for member, info in zip(members[:3], infos[:3], strict=True):
            assert info is not None and len(info.group) == 4
            for part in info.parts:
                if part.reducer == culprit.peer_id:  # its own part: nothing to corrupt
                    assert part.status is PartStatus.ALL
                else:
                    assert part.status is PartStatus.SOME
                    assert part.dropped == {culprit.peer_id: DropReason.GARBAGE}
            culprit_part = next(p for p in info.parts if p.reducer == culprit.peer_id)
            assert info.averaged_fraction == culprit_part.size / info.total
            assert info.received_fraction == 1.0
            assert not np.array_equal(member.array, member.data)
