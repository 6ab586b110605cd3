"""The probe that tells a frozen peer from a busy one (``training.averaging.plan.Liveness``),
and the rule in a round: late ping answers with bytes arriving mean busy, a member that
left the round is dropped at once, one that answers pings but completes no chunk ends by
the cutoff."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing
from test_allreduce_faults import SIZE, after_acks
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from peer.errors import PeerUnavailableError
from protocol.identity import Identity, PeerID
from training import Outcome, PartStatus
from training.averaging.butterfly import Butterfly
from training.averaging.grouping import Declaration, round_key
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

    def last_heard(self, peer_id: PeerID, *, pooled: bool = False) -> float:
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
    plan = Plan(
        1,
        ME,
        members,
        members,
        ((0, 1), (1, 2)),
        {ME: 1.0, OTHER: 1.0},
        0,
        group_id=(7).to_bytes(16, "big"),
    )
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


class _StaleConnectionHost(_SlowHost):
    """A host whose pooled connection to the peer broke unseen (the peer closed it while
    our process was stopped): the first ``stale`` calls fail at once as they are written;
    later ones, over a fresh dial, are answered when ``alive``."""

    def __init__(self, stale: int, alive: bool) -> None:
        super().__init__()
        self.stale = stale
        self.alive = alive
        self.calls = 0

    async def call(self, *args: Any) -> None:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        if self.calls <= self.stale or not self.alive:
            raise PeerUnavailableError("connection lost: [Errno 32] Broken pipe")


@pytest.mark.parametrize(
    ("stale", "alive", "verdict"),
    [(1, True, None), (2, True, DropReason.DEAD), (1, False, DropReason.DEAD)],
    ids=["broken-pooled-connection", "broken-twice", "refused"],
)
async def test_a_ping_whose_pooled_connection_broke_unseen_is_sent_once_more(
    autojump_clock: trio.testing.MockClock, stale: int, alive: bool, verdict: object
) -> None:
    """An outside trial stopped a member's process (SIGSTOP) for 8 s mid-round: the
    others closed their silent connections to it meanwhile, and on waking its probes
    wrote their pings on those connections, which it had not yet seen closed, and found
    every live member dead at once: its part was averaged over itself alone and the
    others took that (its own values) for their result. A ping that fails so is now sent
    once more over a fresh dial; a peer that cannot be reached that way is still dead."""
    node = _Node()
    node.rpc = _StaleConnectionHost(stale, alive)
    liveness = _liveness(node, f"{OTHER}@127.0.0.1:2")
    with trio.fail_after(10):
        assert await liveness.probe(OTHER) is verdict
    assert node.rpc.calls == 2
    assert liveness.bad.get(OTHER) is verdict
    assert trio.current_time() < 0.1  # no timeout waited: a broken connection fails at once


@pytest.mark.parametrize(
    ("shared", "verdict"), [("probe", DropReason.FROZEN), ("reconnect", False)]
)
async def test_a_shared_probe_whose_caller_is_cancelled_leaves_the_others_a_verdict(
    autojump_clock: trio.testing.MockClock, shared: str, verdict: object
) -> None:
    """The upload, the download and the reducer share one probe of a peer (and calls that
    failed together one reconnect). When the call that runs it ends first (an upload
    cancelled once its part's download has ended), the others got no verdict, which read
    as alive (retry, for a reconnect: a review): a frozen peer was waited for a stall
    timeout more. They now probe again."""
    node = _Node()
    liveness = _liveness(node, f"{OTHER}@127.0.0.1:2")  # silent: never answers
    ask = getattr(liveness, shared)
    answers: list[object] = []

    async def share() -> None:
        await trio.sleep(0.1)
        answers.append(await ask(OTHER))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(share)
            with trio.move_on_after(0.3):  # the caller that runs the probe, cancelled
                await ask(OTHER)
        assert answers == [verdict]
        assert trio.current_time() < 3.0  # its own probe: two pings of 1 s
    assert liveness.bad.get(OTHER) is DropReason.FROZEN


@pytest.mark.parametrize("withdraws", [True, False], ids=["withdraws", "withdrawal-lost"])
@pytest.mark.parametrize("client_mode", [False, True], ids=["pingable", "client-mode"])
async def test_a_member_that_left_the_round_but_talks_to_us_is_dropped_at_once(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    client_mode: bool,
    withdraws: bool,
) -> None:
    """A member's step is cancelled mid-upload (it left the round), and its node goes on
    with DHT traffic to everybody (its next step polls the round key). Bytes from it keep
    arriving, but it will never send the rest: the survivors drop it (it says it left;
    without that word, as dead within a few stall timeouts), not at the cutoff, and their
    tensors are what their reports say."""

    async def lost(self: Butterfly, parts: list[int]) -> None:
        return None

    if not withdraws:
        monkeypatch.setattr(Butterfly, "_withdraw", lost)
    with trio.fail_after(300):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], SIZE, fast_config(max_inflight=3))
            config = fast_config(max_inflight=3, client_mode=client_mode)
            members += make_members(nodes[3:], SIZE, config)
            leaver = members[3]
            survivors = members[:3]
            left = trio.CancelScope()
            after_acks(leaver, 2, left.cancel)

            async def leaver_step() -> None:
                with left:
                    await leaver.averager.step(leaver.weight, timeout=30.0)
                while True:  # still talking to the swarm, as its next step would
                    await leaver.averager.node.dht.get_entries(round_key("t/x", 1))
                    await trio.sleep(0.1)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(leaver_step)
                results = await step_all(survivors, timeout=30.0)
                nursery.cancel_scope.cancel()
    infos = [info for info, _ in results]
    verify_round(survivors, infos, without_report=[leaver])  # type: ignore[arg-type]
    stall = survivors[0].averager.config.stall_timeout
    for info in infos:
        assert info is not None
        assert info.allreduce_s <= 3 * stall, info.allreduce_s
        assert len(info.group) == 4
        for part in info.parts:
            if leaver.peer_id not in part.contributors and part.reducer != leaver.peer_id:
                assert part.status is PartStatus.SOME
                # it withdrew (timeout), or a ping found it gone first (dead)
                reasons = (DropReason.DEAD, DropReason.TIMEOUT) if withdraws else (DropReason.DEAD,)
                assert part.dropped[leaver.peer_id] in reasons, part
    said = [info.note for info in infos if info is not None]
    # its word, or a ping it answered, says its step ended (none for a silent client)
    if withdraws or not client_mode:
        assert any("its step left the round" in note for note in said), said
    # no survivor's cutoff came (30 s): a withdrawal dropped as timeout is not blamed on it
    assert not any("cutoff" in note for note in said), said


async def test_a_member_alive_to_pings_that_never_completes_a_chunk_ends_by_the_cutoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hostile member keeps its connections busy and answers every ping (as one
    trickling a byte a second would count as alive) but never completes another chunk:
    nobody waits past the step's timeout, it is dropped as ``timeout`` where it owed
    chunks, and every report matches the tensors."""
    timeout = 12.0
    with trio.fail_after(300):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            hostile = members[3]
            rpc = hostile.averager.node.rpc
            call = rpc.call
            acked: dict[int, int] = {}

            async def stalling_call(
                address: Any, method: str, body: Any = None, payload: Any = b""
            ) -> Any:
                if method.endswith(".chunk"):
                    if acked.get(body["part"], 0) >= 2:
                        await trio.sleep_forever()
                    acked[body["part"]] = acked.get(body["part"], 0) + 1
                return await call(address, method, body, payload)

            rpc.call = stalling_call  # type: ignore[method-assign]
            results = await step_all(members, timeout=timeout)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for i, (info, elapsed) in enumerate(results):
        assert info is not None and elapsed <= timeout + 1e-6, (i, elapsed)
        if i == 3:
            continue
        assert info.outcome is Outcome.PARTIAL, info
        for part in info.parts:
            if part.reducer != hostile.peer_id:
                assert part.status is PartStatus.SOME
                assert part.dropped[hostile.peer_id] is DropReason.TIMEOUT, part


async def test_a_gone_client_is_dead_at_the_deadline_it_was_given(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``mark_gone_clients`` returns when a client with no connection is found dead; asked
    again at exactly that time it must find it so. It compared ``now - since`` with the
    grace while returning ``since + grace``: at since = 0.08, grace 0.5, the two differ
    by rounding, nothing was marked and a reducer waiting until the deadline spun there
    (for good under a virtual clock: an outside tester's fuzzer)."""
    node = _Node()
    node.rpc.connected_peers = lambda: []  # type: ignore[method-assign]  # the client left
    liveness = _liveness(node, None)  # OTHER: a client (no address)
    autojump_clock.jump(0.08 - trio.current_time())
    assert trio.current_time() == 0.08
    due = liveness.mark_gone_clients([OTHER])
    assert due == 0.08 + 0.5 and OTHER not in liveness.bad
    await trio.sleep_until(due)
    assert liveness.mark_gone_clients([OTHER]) == math.inf
    assert liveness.bad == {OTHER: DropReason.DEAD}
