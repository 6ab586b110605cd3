"""A slow member dropped at its reducer's cutoff still reads the result (memory network,
virtual time).

A member whose uplink is slow is still uploading when the reducer's cutoff passes: the
reducer averages the others and streams the mean back over the member's fast downlink.
Both ways share one connection per pair of peers, and its reader stops behind a result
stream's 32 unread items (peer/calls.py ``STREAM_BUFFER_ITEMS``). The member took result
chunks only once its own upload of the part was encoded, which waited for the answers to
its chunk calls, stuck behind those items: with more than 32 result chunks in the part it
stalled until ``stall_timeout``, pinged the reducer (whose step had ended meanwhile) and
reported it ``dead``, the part lost, its step taking 9.75 s of 10 instead of 7.1 s (a
member that reduces a part too: the part lost, the step to its deadline). The result
header now stops the encoding of its remaining chunks (the part is final), so that the
results are read while its last calls wait for their answers.
"""

from __future__ import annotations

import pytest
import trio
from test_averaging_bad_networks import Link, bad_swarm, describe
from test_averaging_support import fast_config, host_of, make_members, step_all, verify_round

from training import DropReason

TIMEOUT = 10.0
CHUNKS = 48  # result chunks in the reducer's part: more than a stream buffers (32)
SLOW_UPLINK = {"none": 1e4, "int8": 2.5e3}  # bytes per second: its upload takes 20 s
FAST = 1e6


@pytest.mark.parametrize(
    ("client_mode", "codec", "uplink"),
    [
        (True, "none", SLOW_UPLINK["none"]),
        (True, "int8", SLOW_UPLINK["int8"]),
        (False, "none", SLOW_UPLINK["none"]),
        # (only 1e4 passed before: the others' last chunk calls waited until the deadline)
        (False, "none", 0.95 * SLOW_UPLINK["none"]),
        (False, "none", 1.1 * SLOW_UPLINK["none"]),
    ],
)
async def test_slow_member_dropped_at_the_cutoff_reads_the_result(
    autojump_clock: trio.testing.MockClock, client_mode: bool, codec: str, uplink: float
) -> None:
    """Member 1 (slow uplink; a sender only, or a reducer too) is dropped from member 0's
    part at the cutoff: it still receives that part, the mean of member 0's values, soon
    after member 0 served it, and does not report the honest reducer as dropped.

    A member that reduces a part too serves its result over that slow uplink, and its last
    chunk calls to member 0 (under way at the cutoff) were queued behind it: its step
    waited for their answers until its deadline, the part it had received reported lost.
    Those calls are cancelled once the download of the part has ended (the part is
    final); only the one uplink rate the test was tuned at had escaped that."""
    parts = 1 if client_mode else 2
    with trio.fail_after(120):
        async with bad_swarm(2) as (net, nodes):
            config = fast_config(max_inflight=2, codec=codec)
            members = make_members(nodes[:1], parts * CHUNKS * 1024, config)
            slow = fast_config(max_inflight=2, codec=codec, client_mode=client_mode)
            members += make_members(nodes[1:], parts * CHUNKS * 1024, slow, seed=1)
            net.links[host_of(0)] = (Link(FAST), Link(FAST))
            net.links[host_of(1)] = (Link(uplink), Link(FAST))
            results = await step_all(members, timeout=TIMEOUT)
            infos = [info for info, _ in results]
            assert all(info is not None for info in infos)
            verify_round(members, infos, codec=codec)  # type: ignore[arg-type]
            reducer, member = members
            info = infos[1]
            assert info is not None
            report = describe(members, infos)  # type: ignore[arg-type]
            part = next(p for p in info.parts if p.reducer == reducer.peer_id)
            assert part.received, report
            assert part.contributors == (reducer.peer_id,), report
            assert part.dropped == {member.peer_id: DropReason.TIMEOUT}, report
            # the reports say whose cutoff it was, and mark our own PeerID (an outside
            # tester read its own upload's drop as another member's)
            assert f"{member.peer_id.short()} (us) timeout" in str(info), str(info)
            assert infos[0] is not None and "our part's cutoff" in infos[0].note, infos[0]
            # it read the result as soon as it came (the cutoff is at 6.9 s, the result
            # takes 0.2 s), not after a stall and a probe (9.75 s, or the deadline)
            _, done = results[1]
            assert done < 0.8 * TIMEOUT, done
