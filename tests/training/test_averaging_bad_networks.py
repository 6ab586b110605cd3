"""Honest members on bad networks (memory network, virtual time): partitions during the
gather window, after the confirmation and mid all-reduce; a straggler on a slow link;
one-way reachability; connections reset or silently dead mid-round; a skewed clock. Every
member returns within its timeout and its tensors are exactly what its report says; a
connection that breaks (or goes silent) between live peers is replaced, not taken for a
dead peer; after a partition heals, the next round averages everybody (the DHT re-contacts
the contacts it dropped 2 s after, not at its next refresh 10 minutes later)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from test_allreduce_faults import after_acks, non_leader
from test_averaging_support import (
    Member,
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    step_all,
    verify_round,
    virtual_clock,
)

from peer import MemoryNetwork, Peer
from protocol.codecs import get_codec
from protocol.identity import Identity, PeerID
from protocol.messages import NodeInfo
from training import AveragingInfo, DropReason, Outcome, PartStatus
from training.averaging import averager as averager_module
from training.averaging.reducer import ChunkRejected, PartReducer
from training.averaging.reducer import Member as Member_
from training.averaging.reducing import ReducerService

SIZE = 16_384  # 4 equal parts of 4 chunks (1024 elements each) in a group of 4
TIMEOUT = 30.0


class Link:
    """One direction of a host's link: ``rate`` bytes per (virtual) second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    async def take(self, size: int) -> None:
        self.free_at = max(trio.current_time(), self.free_at) + size / self.rate
        await trio.sleep_until(self.free_at)


class ShapedStream(trio.abc.Stream):
    """A stream of ``host``'s, behind its rate-limited link (both directions) when it has
    one (looked up at every write and read: links may be limited once connections exist)."""

    def __init__(self, inner: trio.abc.Stream, net: BadNetwork, host: str) -> None:
        self.inner = inner
        self.net, self.host = net, host

    def __getattr__(self, name: str) -> Any:  # remote_host and the like
        return getattr(self.inner, name)

    async def send_all(self, data: Any) -> None:
        if id(getattr(self.inner, "_conn", None)) in self.net.holes:
            await trio.lowlevel.checkpoint()  # lost on the way; the writer cannot tell
            return
        view = memoryview(data).cast("B")
        for start in range(0, len(view), 16384):
            piece = view[start : start + 16384]
            link = self.net.links.get(self.host)
            if link is not None:
                await link[0].take(len(piece))
            await self.inner.send_all(piece)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(min(max_bytes or 16384, 16384))
        link = self.net.links.get(self.host)
        if data and link is not None:
            await link[1].take(len(data))
        return bytes(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class BadNetwork(MemoryNetwork):
    """The memory network, plus one-way blocks (``a`` cannot dial ``b``) and hosts behind a
    rate-limited link."""

    def __init__(self, latency: float) -> None:
        super().__init__(latency=latency)
        self.blocked: set[tuple[str, str]] = set()
        self.links: dict[str, tuple[Link, Link]] = {}
        self.holes: set[int] = set()  # ids of connections that lose whatever is written

    def blackhole(self, a: str, b: str) -> int:
        """Lose everything written from now on to the connections between ``a`` and ``b``,
        silently (a NAT or middlebox that dropped them: no reset, no error); new
        connections work."""
        conns = [c for c in self._connections if set(c.hosts) == {a, b}]
        self.holes.update(id(c) for c in conns)
        return len(conns)

    def limit_rate(self, host: str, rate: float) -> None:
        self.links[host] = (Link(rate), Link(rate))

    def block(self, source: str, target: str) -> None:
        """``source`` cannot dial ``target`` from now on (the other way still works); their
        connections break, so that who dials next matters."""
        self.blocked.add((source, target))
        for conn in list(self._connections):
            if set(conn.hosts) == {source, target}:
                self._break(conn, "one-way block")

    def _shape(self, host: str, stream: trio.abc.Stream) -> trio.abc.Stream:
        return ShapedStream(stream, self, host)

    async def _connect(self, source: str, host: str, port: int) -> trio.abc.Stream:
        if (source, host) in self.blocked:
            self.connections_refused += 1
            raise ConnectionRefusedError(f"{source} cannot reach {host}")
        return self._shape(source, await super()._connect(source, host, port))

    async def _serve(
        self,
        host: str,
        port: int,
        handler: Any,
        task_status: trio.TaskStatus[int],
        admit: Any = None,
    ) -> None:
        async def shaped(stream: trio.abc.Stream) -> None:
            await handler(self._shape(host, stream))

        await super()._serve(host, port, shaped, task_status, admit)


@asynccontextmanager
async def bad_swarm(n: int, latency: float = 0.005) -> AsyncIterator[tuple[BadNetwork, list[Peer]]]:
    net = BadNetwork(latency)
    async with memnet_swarm(n, network=net, first_seed=1) as (_, nodes):  # the same runs
        yield net, nodes


def hosts(indices: list[int]) -> list[str]:
    return [host_of(i) for i in indices]


def check_round(
    members: list[Member], results: list[tuple[AveragingInfo | None, float]]
) -> list[AveragingInfo]:
    """Every member returned within its timeout with a report its tensors match."""
    infos = []
    for i, (info, elapsed) in enumerate(results):
        assert info is not None, f"member {i} has no report"
        assert elapsed <= TIMEOUT + 1e-6, f"member {i} took {elapsed}"
        infos.append(info)
    verify_round(members, infos)
    return infos


def describe(members: list[Member], infos: list[AveragingInfo]) -> str:
    index = {m.peer_id: i for i, m in enumerate(members)}
    lines = []
    for i, info in enumerate(infos):
        parts = " ".join(
            f"{index[p.reducer]}:{p.status.value}{sorted(index[c] for c in p.contributors)}"
            for p in info.parts
        )
        group = sorted(index[p] for p in info.group)
        lines.append(f"{i}: {info.outcome.value} r{info.round} group {group} {parts} {info.note}")
        lines += [
            f"   part {p.index}: {p.note} { ({index[d]: r.value for d, r in p.dropped.items()}) }"
            for p in info.parts
            if p.note or p.dropped
        ]
    return "\n".join(lines)


def break_between(net: BadNetwork, a: str, b: str) -> int:
    """Reset every connection between hosts ``a`` and ``b`` (both may dial again at once)."""
    broken = 0
    for conn in list(net._connections):
        if set(conn.hosts) == {a, b}:
            net._break(conn, "connection reset")
            broken += 1
    return broken


def on_result_item(member: Member, items_before: int, action: Callable[[Any], None]) -> list[bool]:
    """Run ``action(address)`` once ``member`` had ``items_before`` result items (header
    included) from a reducer; once, until the returned flag is set again."""
    rpc = member.averager.node.rpc
    stream = rpc.stream
    armed = [True]

    @asynccontextmanager
    async def watching(
        address: Any, method: str, body: Any = None, payload: Any = b""
    ) -> AsyncIterator[AsyncIterator[Any]]:
        async with stream(address, method, body, payload) as items:

            async def watched() -> AsyncIterator[Any]:
                seen = 0
                async for item in items:
                    yield item
                    seen += 1
                    if seen == items_before and armed[0]:
                        armed[0] = False
                        action(address)

            yield watched()

    rpc.stream = watching  # type: ignore[method-assign]
    return armed


def host_index(members: list[Member]) -> dict[PeerID, str]:
    return {m.peer_id: host_of(i) for i, m in enumerate(members)}


async def one_round(members: list[Member]) -> tuple[list[AveragingInfo], list[float]]:
    """A round of every member, checked (see ``check_round``); the seconds each took."""
    for m in members:
        m.data = m.array.copy()
    results = await step_all(members, timeout=TIMEOUT)
    infos = check_round(members, results)
    return infos, [elapsed for _, elapsed in results]


def fully_averaged(infos: list[AveragingInfo], size: int) -> bool:
    return all(i.outcome is Outcome.AVERAGED and len(i.group) == size for i in infos)


# -- a connection reset mid-round: retried, not "dead" --------------------------------------


async def test_connection_reset_after_a_chunk_arrived_is_retried(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection between a sender and a reducer breaks right after the reducer took a
    chunk, before its answer went out (once per round, three rounds). The sender dials
    again and sends the chunk again; the reducer acknowledges the same bytes once more
    (it used to drop the sender as garbage, "sent twice", and before that both peers
    called each other dead on the first broken call: two parts partial for everyone)."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            where = host_index(members)
            resets: list[int] = []  # rounds with a reset so far (armed again after each)
            resends: list[bool] = []
            on_chunk, is_resend = ReducerService.on_chunk, PartReducer.is_resend

            async def resetting(self: ReducerService, sender: PeerID, header: Any, payload: Any):  # type: ignore[no-untyped-def]
                reply = await on_chunk(self, sender, header, payload)
                if header.chunk == 1 and len(resets) < round_no[0]:
                    # the answer is lost with the connection
                    resets.append(break_between(net, where[sender], where[self.plan.me]))
                    assert resets[-1] >= 1
                return reply

            def counting(self: PartReducer, *args: Any) -> bool:
                again = is_resend(self, *args)
                resends.append(again)
                return again

            monkeypatch.setattr(ReducerService, "on_chunk", resetting)
            monkeypatch.setattr(PartReducer, "is_resend", counting)
            round_no = [1]
            for _ in range(3):
                infos, elapsed = await one_round(members)
                assert fully_averaged(infos, 4), describe(members, infos)
                assert max(elapsed) < 2 * members[0].averager.config.gather_window + 1
                round_no[0] += 1
            assert len(resets) == 3 and resends.count(True) >= 3


@pytest.mark.parametrize("items", [1, 2], ids=["after-header", "mid-result"])
async def test_connection_reset_mid_result_stream_is_retried(
    autojump_clock: trio.testing.MockClock, items: int
) -> None:
    """A member's connection to a reducer breaks while it downloads the reducer's result
    (after the header, or after a chunk of it), once per round over three rounds: it
    dials again and downloads the result again; every round averages everybody (the
    member used to keep its own values for that part, and both called each other dead)."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            resets: list[int] = []

            def reset(address: Any) -> None:
                resets.append(break_between(net, host_of(0), address.host))

            armed = on_result_item(members[0], items, reset)
            for _ in range(3):
                infos, _ = await one_round(members)
                assert fully_averaged(infos, 4), describe(members, infos)
                armed[0] = True
            assert len(resets) == 3 and min(resets) >= 1


async def test_link_that_keeps_breaking_is_given_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A link between two members that breaks at every call (dials still succeed) costs
    a few retries, then the two are dead to each other for the round: the step does not
    spin until its deadline, and the reports say which parts went without whom."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            for member in members[:2]:
                rpc = member.averager.node.rpc
                call = rpc.call
                other = host_of(1) if member is members[0] else host_of(0)

                async def flaky(address: Any, method: str, *args: Any, call: Any = call,
                                other: str = other) -> Any:  # fmt: skip
                    if method.endswith(".chunk") and address.host == other:
                        break_between(net, host_of(0), host_of(1))
                    return await call(address, method, *args)

                rpc.call = flaky  # type: ignore[method-assign]
            infos, _ = await one_round(members)
            stall = members[0].averager.config.stall_timeout
            assert all(i.allreduce_s <= 2 * stall for i in infos), describe(members, infos)
            for me, other in [(members[0], members[1]), (members[1], members[0])]:
                info = infos[members.index(me)]
                for part in info.parts:
                    if part.reducer == other.peer_id:  # we kept our own values there
                        assert part.status is PartStatus.NONE
                        assert part.dropped[other.peer_id] is DropReason.DEAD, describe(
                            members, infos
                        )
                    elif part.reducer == me.peer_id and other.peer_id in info.group:
                        assert other.peer_id not in part.contributors


def test_only_the_same_chunk_is_taken_as_a_resend() -> None:
    """A retried chunk (the sender's connection broke before the answer came) is
    acknowledged again only when its bytes are the ones that arrived, and adds nothing;
    a different payload under the same index stays garbage, as does a repeat that the
    sender does not flag as a retry (ReducerService checks the flag)."""
    members = [Member_(Identity.from_seed(bytes([i + 7]) * 32).peer_id, 1.0, 0) for i in range(2)]
    codec = get_codec("none")
    acc = np.zeros(16, np.float32)
    reducer = PartReducer(
        length=16, chunk_elements=8, codec=codec, members=members,
        senders=[m.peer_id for m in members], max_staleness=2, decay=0.5, acc=acc,
        scratch=np.empty(8, np.float32), local=members[0].peer_id,
    )  # fmt: skip
    sender = members[1].peer_id
    blob = codec.encode(np.arange(8, dtype=np.float32))
    assert not reducer.is_resend(sender, 0, blob)  # not arrived yet
    reducer.add_chunk(sender, 0, 0, 1.0, blob)
    before = acc.copy()
    assert reducer.is_resend(sender, 0, blob)
    assert not reducer.is_resend(sender, 0, blob, raw=True)
    other = codec.encode(np.ones(8, dtype=np.float32))
    assert not reducer.is_resend(sender, 0, other) and not reducer.is_resend(sender, 1, blob)
    np.testing.assert_array_equal(acc, before)
    with pytest.raises(ChunkRejected):  # a repeat that is no resend: garbage, as before
        reducer.check_chunk(sender, 0, 0, 1.0, other)
    assert reducer.reason(sender) is DropReason.GARBAGE
    assert not reducer.is_resend(sender, 0, blob)  # dropped: nothing is acknowledged


# -- partitions ------------------------------------------------------------------------------

SPLITS = {"halves": [[0, 1], [2, 3]], "one-cut": [[0, 1, 2], [3]]}


@pytest.mark.parametrize("split", list(SPLITS))
async def test_partition_mid_allreduce(autojump_clock: trio.testing.MockClock, split: str) -> None:
    """The group splits while its members upload: each side averages what it has among
    itself, and says so (its parts "some" over its side, the other side's parts "none"),
    soon after the split (refused connections, not the deadline). A member alone on its
    side keeps its own values: its part, the mean of nothing but them, is "none" too."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            groups = SPLITS[split]
            after_acks(members[non_leader(members)], 2, lambda: net.partition(*map(hosts, groups)))
            infos, _ = await one_round(members)
            stall = members[0].averager.config.stall_timeout
            for group in groups:
                side = {members[i].peer_id for i in group}
                for i in group:
                    info = infos[i]
                    assert len(info.group) == 4 and info.averaged_fraction == 0.0
                    assert info.allreduce_s <= 2 * stall, describe(members, infos)
                    for part in info.parts:
                        if part.reducer in side and len(side) == 1:  # its own values only
                            assert part.status is PartStatus.NONE
                            assert part.note.startswith("only our own values reached")
                        elif part.reducer in side:
                            assert part.received and set(part.contributors) == side
                        else:
                            assert part.status is PartStatus.NONE
                            assert part.dropped[part.reducer] is DropReason.DEAD


async def test_partition_between_confirmation_and_allreduce(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The network splits as the leader confirms: members that got the confirmation average
    among their side, the others try the next round; every report is true."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            of = averager_module.Plan.of
            split: list[int] = []

            def confirmed(conf: Any, me: PeerID, config: Any) -> Any:
                if not split:  # the first member to hold the confirmation
                    split.append(1)
                    net.partition(hosts([0, 1]), hosts([2, 3]))
                return of(conf, me, config)

            monkeypatch.setattr(averager_module.Plan, "of", confirmed)
            infos, _ = await one_round(members)
            assert split
            halves = [{members[i].peer_id for i in half} for half in ([0, 1], [2, 3])]
            for info in infos:
                for part in info.parts:  # nothing crossed the split
                    side = next(h for h in halves if part.reducer in h)
                    assert set(part.contributors) <= side


async def test_partition_during_gather_window(autojump_clock: trio.testing.MockClock) -> None:
    """The network splits after the members declared, before the round closes: every
    member returns in time with a true report, no group spans the split."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))

            async def split_soon() -> None:
                await trio.sleep(0.3)  # declared (a store takes a few 10 ms), not closed
                net.partition(hosts([0, 1]), hosts([2, 3]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(split_soon)
                infos, _ = await one_round(members)
            halves = [{members[i].peer_id for i in half} for half in ([0, 1], [2, 3])]
            for info in infos:
                for part in info.parts:
                    side = next(h for h in halves if part.reducer in h)
                    assert set(part.contributors) <= side


async def test_next_round_after_a_partition_heals_averages_everybody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each half's DHT dropped the other half's contacts during the partition; they come
    back within seconds of the heal (``Upkeep.recontact_soon`` in peer/dht/upkeep.py), not
    at the next refresh."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            after_acks(
                members[non_leader(members)], 2, lambda: net.partition(hosts([0, 1]), hosts([2, 3]))
            )
            await one_round(members)
            net.heal()
            await trio.sleep(5.0)
            infos, _ = await one_round(members)
            assert fully_averaged(infos, 4), describe(members, infos)


async def test_everybody_averages_together_within_a_minute_of_a_long_partitions_heal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a 200 s split each side had stopped pinging the other's dropped contacts (they
    were pinged 2, 10, 42, 170 and 682 s after they left): a trial's 3 + 3 averagers met
    again 50-110 s after the heal, 30 DHT peers 4 minutes after. They are now pinged every
    minute for half an hour."""
    with trio.fail_after(600):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            net.partition(hosts([0, 1]), hosts([2, 3]))
            split_at = trio.current_time()
            await one_round(members)
            await trio.sleep(split_at + 200.0 - trio.current_time())
            net.heal()
            healed_at = trio.current_time()
            while True:
                infos, _ = await one_round(members)
                if fully_averaged(infos, 4):
                    break
                assert trio.current_time() - healed_at < 75.0, describe(members, infos)


# -- slow and one-way links ------------------------------------------------------------------


async def test_straggler_on_a_link_100x_slower(autojump_clock: trio.testing.MockClock) -> None:
    """One member's link is 100x slower than the others' (10 kB/s against 1 MB/s): its
    parts take seconds, the round waits for it as long as bytes keep coming (well within
    the step's timeout) and every report, the straggler's own included, is true."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3, stall_timeout=5.0))
            for i in range(3):
                net.limit_rate(host_of(i), 1e6)
            net.limit_rate(host_of(3), 1e4)
            for _ in range(2):
                infos, elapsed = await one_round(members)
                print(elapsed, describe(members, infos))
                assert max(elapsed) < TIMEOUT


@pytest.mark.parametrize("direction", ["cannot-dial", "cannot-be-dialed"])
async def test_one_way_reachability(autojump_clock: trio.testing.MockClock, direction: str) -> None:
    """One member cannot dial the others (or cannot be dialed by them), while the other
    way works: its connections (one per pair, used both ways) carry every call, whoever
    dialed; rounds average everybody."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            for i in range(1, 4):
                if direction == "cannot-dial":
                    net.block(host_of(0), host_of(i))
                else:
                    net.block(host_of(i), host_of(0))
            for _ in range(3):
                infos, _ = await one_round(members)
                assert fully_averaged(infos, 4), describe(members, infos)


@pytest.mark.slow
async def test_moshpit_grid_with_mixed_bandwidths_and_a_slow_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Eight members in groups of four, declaring bandwidths from 1 to 100 (part sizes
    follow), one of them behind a 100x slower link: every round completes within its
    timeout with true reports."""
    with trio.fail_after(600):
        async with bad_swarm(8) as (net, nodes):
            members = []
            for i, node in enumerate(nodes):
                config = fast_config(max_inflight=3, group_size=4, bandwidth=[1.0, 100.0][i % 2])
                members += make_members([node], SIZE, config, seed=i)
            for i in range(8):
                net.limit_rate(host_of(i), 1e4 if i == 5 else 1e6)
            for _ in range(3):
                infos, _ = await one_round(members)
                assert all(i.group and len(i.group) <= 4 for i in infos)


async def test_peer_whose_declaration_lands_late_is_told_the_others_went_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer whose DHT store takes longer than the gather window (a slow, far link) reads
    the round after the others formed their group: it is alone, and its note says that
    the others had their groups already and how long its store took (it said "no partner",
    which sent its owner looking for a missing swarm rather than at the link)."""
    with trio.fail_after(300):
        async with bad_swarm(3) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            dht = members[2].averager.node.dht
            store = dht.store

            async def slow_store(key: str, value: Any, *args: Any, **kwargs: Any) -> bool:
                await trio.sleep(1.2)  # more than the 1 s window
                return await store(key, value, *args, **kwargs)

            dht.store = slow_store  # type: ignore[method-assign]
            infos, _ = await one_round(members)
            assert fully_averaged(infos[:2], 2), describe(members, infos)
            assert infos[2].outcome is Outcome.ALONE
            assert "2 other peer(s) had finished matchmaking" in infos[2].note, infos[2].note
            assert "storing our declaration took 1.2" in infos[2].note, infos[2].note


async def test_peer_with_a_clock_5s_ahead_meets_nobody_but_harms_nobody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rendezvous slots are wall-clock times (docs: clocks must agree to well within
    gather_window / 8). A peer 5 s ahead declares in rounds the others reach only later,
    after it left: it is alone every time, within its timeout, and the others average
    among themselves undisturbed (its stale keys hold "done" markers by then)."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (_, nodes):
            timing = {"gather_window": 2.0, "join_timeout": 1.0, "stall_timeout": 5.0}
            members = make_members(nodes[:3], SIZE, fast_config(**timing))
            ahead = fast_config(**timing, clock=lambda: virtual_clock() + 5.0)
            members += make_members(nodes[3:], SIZE, ahead, seed=3)
            for _ in range(2):
                infos, elapsed = await one_round(members)
                assert fully_averaged(infos[:3], 3), describe(members, infos)
                assert infos[3].outcome is Outcome.ALONE and elapsed[3] < TIMEOUT


async def test_silently_dead_connection_mid_round_is_replaced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The connection between two members goes silent mid-round (a NAT or middlebox
    dropped it: what is written is lost, nobody gets a reset). The stalled member pings,
    hears nothing, closes the connection and pings over a fresh dial: the peer answers, the
    broken calls are made again on the new connection, and the round averages everybody.
    Both used to call the other "frozen", and the next rounds reused the dead connection
    (frozen again, or unconfirmed: the join went over it) until the host cut it off."""
    with trio.fail_after(300):
        async with bad_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            holes: list[int] = []
            after_acks(members[1], 1, lambda: holes.append(net.blackhole(host_of(0), host_of(1))))
            for _ in range(2):
                infos, elapsed = await one_round(members)
                assert fully_averaged(infos, 4), describe(members, infos)
                stall = members[0].averager.config.stall_timeout
                assert max(elapsed) <= 3 * stall
            assert holes == [1]


async def test_a_dead_pooled_connection_beside_a_live_one_is_replaced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A NAT forgot a connection mid-round: what either side writes on it is lost, and the
    peer that lost it (its side timed out unseen) dials afresh, so that its bytes now come
    over a second connection while our calls still go over the dead, pooled one. The
    silence was taken for a busy peer (its bytes kept coming, on the other connection),
    the dead connection was never closed, and every round with that pair ran to its
    timeout for 40-70 s (an outside tester, real TCP and nftables). Only bytes over the
    connection our calls use show a busy peer."""
    with trio.fail_after(300):
        async with bad_swarm(3) as (net, nodes):
            members = make_members(nodes[:2], SIZE, fast_config(max_inflight=3))
            infos, _ = await one_round(members)  # the pair's connection is up
            assert fully_averaged(infos, 2), describe(members, infos)
            # ``us`` keeps the old connection pooled when ``lost`` dials anew: the new one
            # takes the pool's place only when its dialer's PeerID is the lower
            for us, lost in (nodes[:2], nodes[1::-1]):
                old = us.rpc._by_peer[lost.peer_id]
                dialer = us.rpc._connections[old]
                if dialer == lost.peer_id or lost.peer_id.raw > dialer.raw:
                    break
            target = NodeInfo(us.peer_id, us.address.rpartition("@")[2])
            forgot = trio.Event()

            def forget() -> None:
                if not forgot.is_set():
                    assert net.blackhole(host_of(0), host_of(1)) == 1
                    del lost.rpc._by_peer[us.peer_id]  # forgotten on its side, unseen on ours
                    forgot.set()

            async def keep_talking() -> None:  # its DHT traffic, over its new connection
                await forgot.wait()
                while True:
                    await lost.dht.protocol.ping(target)
                    await trio.sleep(0.2)

            after_acks(members[0], 1, forget)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_talking)
                infos, elapsed = await one_round(members)
                assert forgot.is_set()
                nursery.cancel_scope.cancel()
            assert fully_averaged(infos, 2), describe(members, infos)
            assert max(elapsed) <= 3 * members[0].averager.config.stall_timeout, elapsed
            infos, _ = await one_round(members)  # and the next round too
            assert fully_averaged(infos, 2), describe(members, infos)
