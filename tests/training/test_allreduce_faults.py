"""Faults during a round, on the memory network (virtual time): a member killed, frozen,
sending garbage, holding NaN, or too stale. Every survivor returns within its deadline,
its tensors are exactly what its report says, and the next round works without the culprit."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import trio
from test_averaging_support import (
    Member,
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    next_round_among,
    step_all,
    verify_round,
)

from peer import PeerUnavailableError, RemoteError, Reply
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.codecs import Codec
from protocol.identity import PeerID
from training import AveragingInfo, DropReason, Outcome, PartStatus
from training.averaging.bench import BENCH_STEPS
from training.averaging.butterfly import Butterfly
from training.averaging.grouping import rank_key
from training.averaging.messages import GroupConfirmation, ResultHeader, method_prefix
from training.averaging.plan import Liveness, Plan
from training.averaging.reducing import ReducerService

SIZE = 16_384  # 4 equal parts of 4 chunks (1024 elements each) in a group of 4
PART = SIZE // 4
TIMEOUT = 30.0


class HookedCodec:
    """Wraps a member's codec: ``on_encode(part, chunk_start, blob)`` may act or replace blobs."""

    def __init__(self, member: Member, on_encode: Callable[[int, int, bytes], bytes]) -> None:
        self.inner: Codec = member.averager.codec
        self.member = member
        self.on_encode = on_encode
        self.encoded: dict[int, int] = {}  # part index -> chunks encoded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, values: np.ndarray) -> bytes:
        base = self.member.array  # uploads read the (one, float32) tensor in place
        offset = (values.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4
        part = offset // PART
        self.encoded[part] = self.encoded.get(part, 0) + 1
        return self.on_encode(part, offset, self.inner.encode(values))

    def encode_into(self, values: np.ndarray, out: bytearray | memoryview) -> int:
        blob = self.encode(values)  # (never longer than the real blob)
        memoryview(out)[: len(blob)] = blob
        return len(blob)


def hook(member: Member, on_encode: Callable[[int, int, bytes], bytes]) -> HookedCodec:
    codec = HookedCodec(member, on_encode)
    member.averager.codec = codec  # type: ignore[assignment]
    return codec


def check_survivors(
    results: list[tuple[AveragingInfo | None, float]], members: list[Member], victim: int
) -> list[AveragingInfo]:
    infos = []
    for i, (info, elapsed) in enumerate(results):
        assert info is not None
        assert elapsed <= TIMEOUT + 1e-6, f"member {i} took {elapsed}"
        if i != victim:
            # not just within the deadline: a lost member costs a stall timeout and a ping
            stall = members[i].averager.config.stall_timeout
            assert info.allreduce_s <= 3 * stall, f"member {i}: {info.allreduce_s} s"
            infos.append(info)
    survivors = [m for i, m in enumerate(members) if i != victim]
    verify_round([*survivors, members[victim]], [*infos, results[victim][0]])  # type: ignore[list-item]
    return infos


async def next_round_without(members: list[Member], victim: int) -> None:
    await next_round_among([m for i, m in enumerate(members) if i != victim], TIMEOUT)


def non_leader(members: list[Member], prefix: str = "t/x") -> int:
    """Index of a member that will not lead the first round (same rule as grouping)."""
    seed = hashlib.sha256(f"{prefix}|round|0".encode()).digest()
    leader = min(range(len(members)), key=lambda i: rank_key(seed, members[i].peer_id))
    return (leader + 1) % len(members)


def after_acks(
    member: Member, acks: int, action: Callable[[], None], parts: int = 1
) -> dict[int, int]:
    """Run ``action`` once ``parts`` of the member's parts had ``acks`` chunks acknowledged."""
    rpc = member.averager.node.rpc
    call = rpc.call
    counts: dict[int, int] = {}

    async def counting_call(address: Any, method: str, body: Any = None, payload: Any = b"") -> Any:
        reply = await call(address, method, body, payload)
        if method.endswith(".chunk"):
            counts[body["part"]] = counts.get(body["part"], 0) + 1
            if counts[body["part"]] == acks and sum(c >= acks for c in counts.values()) == parts:
                action()
        return reply

    rpc.call = counting_call  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("fault", ["kill", "freeze"])
@pytest.mark.parametrize("acks", [2, 4], ids=["mid-part", "after-upload"])
async def test_member_lost_mid_round(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    acks: int,
) -> None:
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            # one chunk in flight per part: a member lost after 2 acks delivered 2 or 3 of 4
            members = make_members(nodes, SIZE, fast_config(max_inflight=3))
            victim = non_leader(members)
            lose = net.kill_host if fault == "kill" else net.freeze_host
            victim_id = members[victim].peer_id
            if acks == 4:  # lost after all its uploads, before anyone got its own part
                acked = after_acks(members[victim], 4, lambda: lose(host_of(victim)), parts=3)
                serve = ReducerService.results

                async def hold_back(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                    if self.plan.me == victim_id:
                        await trio.sleep_forever()
                    async for item in serve(self, member):
                        yield item

                monkeypatch.setattr(ReducerService, "results", hold_back)
            else:  # lost in the middle of its uploads
                acked = after_acks(members[victim], acks, lambda: lose(host_of(victim)))
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            reason = DropReason.DEAD if fault == "kill" else DropReason.FROZEN
            for info in infos:
                assert info.outcome is Outcome.PARTIAL and 0.0 <= info.averaged_fraction < 1.0
                assert len(info.group) == 4
                for part in info.parts:
                    if part.reducer == victim_id:  # its part: everybody kept local values
                        assert part.status is PartStatus.NONE and not part.received
                        assert part.dropped[victim_id] is reason
                    elif victim_id in part.contributors:  # all its chunks had arrived
                        assert part.status is PartStatus.ALL
                    else:
                        assert part.status is PartStatus.SOME
                        assert part.dropped[victim_id] in (reason, DropReason.TIMEOUT)
                        assert acked.get(part.index, 0) < 4  # an acked part always counts
                statuses = {p.status for p in info.parts if p.reducer != victim_id}
                assert statuses == ({PartStatus.SOME} if acks == 2 else {PartStatus.ALL})
            await next_round_without(members, victim)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_client_mode_member_lost_mid_round(
    autojump_clock: trio.testing.MockClock, fault: str
) -> None:
    """A client-mode sender cannot be pinged: a killed one (its connections gone) is
    reported dead, a frozen one (connections open) frozen; it used to be frozen either way."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes[:3], SIZE, fast_config(max_inflight=3))
            members += make_members(nodes[3:], SIZE, fast_config(max_inflight=3, client_mode=True))
            victim = 3
            lose = net.kill_host if fault == "kill" else net.freeze_host
            after_acks(members[victim], 2, lambda: lose(host_of(victim)))
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            reason = DropReason.DEAD if fault == "kill" else DropReason.FROZEN
            victim_id = members[victim].peer_id
            for info in infos:
                assert info.outcome is Outcome.PARTIAL and len(info.parts) == 3
                assert {part.dropped[victim_id] for part in info.parts} == {reason}
            await next_round_without(members, victim)


async def test_client_killed_before_its_first_chunk_arrived(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client-mode sender killed while its first chunk calls were on their way (connected
    to every reducer, nothing delivered) is dead to the reducers once its connections have
    been gone for half a stall timeout: it cannot be pinged, and waiting for it to stall
    cost the others a whole stall timeout and more (docs/averaging.md, Limitations)."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes[:3], SIZE, fast_config(max_inflight=3))
            members += make_members(nodes[3:], SIZE, fast_config(max_inflight=3, client_mode=True))
            victim = 3
            rpc = members[victim].averager.node.rpc
            call = rpc.call
            killed_at: list[float] = []

            async def connect_then_die(
                address: Any, method: str, body: Any = None, payload: Any = b""
            ) -> Any:
                if not method.endswith(".chunk"):
                    return await call(address, method, body, payload)
                if not killed_at:
                    for node in nodes[:3]:  # every reducer, before any chunk is written
                        await rpc.connect(Address.parse(node.address))
                    assert len(rpc.connected_peers()) >= 3
                    killed_at.append(trio.current_time())
                    net.kill_host(host_of(victim))
                await trio.sleep_forever()

            rpc.call = connect_then_die  # type: ignore[method-assign]
            results = await step_all(members, timeout=TIMEOUT)
            assert killed_at
            victim_id = members[victim].peer_id
            stall = members[0].averager.config.stall_timeout
            for info, _ in results[:victim]:
                assert info is not None and info.outcome is Outcome.PARTIAL
                assert {part.dropped[victim_id] for part in info.parts} == {DropReason.DEAD}
                assert not any(victim_id in part.contributors for part in info.parts)
                assert info.allreduce_s <= 0.75 * stall, info.allreduce_s
            infos = [info for info, _ in results[:victim]]
            verify_round(members[:victim], infos, without_report=[members[victim]])  # type: ignore[arg-type]
            await next_round_without(members, victim)


class Watched:
    """A result stream that calls ``on_item`` after each item it hands over."""

    def __init__(self, items: AsyncIterator[Any], on_item: Callable[[], None]) -> None:
        self.items = items
        self.on_item = on_item

    def __aiter__(self) -> Watched:
        return self

    async def __anext__(self) -> Any:
        item = await self.items.__anext__()
        self.on_item()
        return item


def watch_streams_from(member: Member, reducer: PeerID, on_item: Callable[[], None]) -> None:
    """``on_item`` runs after each item of the result streams ``member`` reads from
    ``reducer``."""
    rpc = member.averager.node.rpc

    @asynccontextmanager
    async def watching(
        address: Address, method: str, body: Any = None, payload: Any = b"",
        stream: Any = rpc.stream,
    ) -> AsyncIterator[AsyncIterator[Any]]:  # fmt: skip
        async with stream(address, method, body, payload) as items:
            yield Watched(items, on_item) if address.peer_id == reducer else items

    rpc.stream = watching  # type: ignore[method-assign]


async def test_reducer_killed_after_its_result_header(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everybody has the header of the victim's result (listing all four contributors), none
    of its chunks: nobody's values in that part are averaged, so it lists no contributors."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config())
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            serve = ReducerService.results

            async def header_only(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                async with aclosing(serve(self, member)) as items:
                    async for item in items:
                        yield item
                        if self.plan.me == victim_id:  # the header went out: no chunks
                            await trio.sleep_forever()

            monkeypatch.setattr(ReducerService, "results", header_only)
            headers: list[int] = []

            def count_header() -> None:
                headers.append(1)
                if len(headers) == len(members) - 1:  # every survivor has it: kill the victim
                    net.kill_host(host_of(victim))

            for i, member in enumerate(members):
                if i != victim:
                    watch_streams_from(member, victim_id, count_header)
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            assert len(headers) == len(members) - 1
            for info in infos:
                assert info.outcome is Outcome.PARTIAL and len(info.group) == 4
                (part,) = [p for p in info.parts if p.reducer == victim_id]
                assert part.status is PartStatus.NONE and not part.received
                assert part.contributors == () and part.weight == 0.0
                assert part.dropped[victim_id] is DropReason.DEAD
                assert part.note == "the reducer is dead"


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_reducer_killed_after_its_last_chunk_still_averaged_its_part(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """Every survivor has the victim's whole result, header and every chunk, but not the
    stream's end: the victim is killed first. The part was averaged, and counts (it was
    reported "the reducer is dead" with the local values put back; int8 results are
    decoded into the tensor as they come, and stay)."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(codec=codec))
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            serve = ReducerService.results

            async def no_end(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                async with aclosing(serve(self, member)) as items:
                    async for item in items:
                        yield item
                if self.plan.me == victim_id:  # every item went out: no end of stream
                    await trio.sleep_forever()

            monkeypatch.setattr(ReducerService, "results", no_end)
            whole: list[int] = []

            for i, member in enumerate(members):
                if i == victim:
                    continue
                counted = [0]

                def count_item(counted: list[int] = counted) -> None:
                    counted[0] += 1
                    if counted[0] == 1 + PART // 1024:  # the header and every chunk
                        whole.append(1)
                        if len(whole) == len(members) - 1:
                            net.kill_host(host_of(victim))

                watch_streams_from(member, victim_id, count_item)
            results = await step_all(members, timeout=TIMEOUT)
            survivors = [m for i, m in enumerate(members) if i != victim]
            infos = [info for i, (info, _) in enumerate(results) if i != victim]
            assert len(whole) == len(members) - 1
            verify_round([*survivors, members[victim]], [*infos, results[victim][0]], codec=codec)  # type: ignore[list-item]
            for info in infos:
                assert info is not None and len(info.group) == 4
                (part,) = [p for p in info.parts if p.reducer == victim_id]
                assert part.received and part.status is PartStatus.ALL, part
                assert len(part.contributors) == 4


async def test_frozen_sender_holding_the_only_admission_slot_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With room to keep one sender's chunks at a time, reducers admit senders one by one;
    a sender frozen while admitted is dropped after the stall timeout and the rest go on."""
    with trio.fail_after(300):
        async with memnet_swarm(4) as (net, nodes):
            members = make_members(nodes, SIZE, fast_config(max_inflight=3, retain_budget=1))
            victim = non_leader(members)
            after_acks(members[victim], 2, lambda: net.freeze_host(host_of(victim)))
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            victim_id = members[victim].peer_id
            for info in infos:
                assert info.outcome is Outcome.PARTIAL and len(info.group) == 4
                for part in info.parts:
                    expected = PartStatus.NONE if part.reducer == victim_id else PartStatus.SOME
                    assert part.status is expected
                    assert part.dropped[victim_id] in (DropReason.FROZEN, DropReason.TIMEOUT)
                    if part.reducer != victim_id:
                        assert len(part.contributors) == 3


async def test_member_sending_garbage_is_dropped_from_that_part_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config())
            victim = 1
            target: list[int] = []

            def on_encode(part: int, offset: int, blob: bytes) -> bytes:
                if not target:
                    target.append(part)
                if part == target[0] and codec.encoded[part] == 2:
                    return blob[:-8]  # truncated: the reducer cannot decode it
                return blob

            codec = hook(members[victim], on_encode)
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            victim_id = members[victim].peer_id
            for info in infos:
                bad = info.parts[target[0]]
                assert bad.status is PartStatus.SOME
                assert bad.dropped == {victim_id: DropReason.GARBAGE}
                others = [p for p in info.parts if p.index != target[0]]
                assert all(p.status is PartStatus.ALL for p in others)
                assert info.averaged_fraction == pytest.approx(1 - bad.size / SIZE)
            members[victim].averager.codec = codec.inner
            await next_round_without(members, victim)


def garble_uploads(member: Member) -> None:
    """Every chunk the member uploads loses its last 8 bytes (a payload of the wrong size:
    garbage to any reducer); its own reducer and its downloads stay sound."""
    rpc = member.averager.node.rpc
    call = rpc.call

    async def garbling_call(address: Any, method: str, body: Any = None, payload: Any = b"") -> Any:
        if method.endswith(".chunk") and len(payload) > 8:
            payload = bytes(payload)[:-8]
        return await call(address, method, body, payload)

    rpc.call = garbling_call  # type: ignore[method-assign]


@pytest.mark.parametrize("victim", range(4))
async def test_a_member_that_keeps_sending_garbage_is_benched_and_the_others_average(
    autojump_clock: trio.testing.MockClock, victim: int
) -> None:
    """The garbage member keeps stepping, garbling every chunk it sends. Every honest
    member's reducer saw its garbage under the round's group tag, so each benches it,
    whoever led (the tag is a digest of the confirmation: a lying leader could not have
    caused it, see test_members_a_leader_lied_to_do_not_bench_each_other). The next rounds
    average the whole vector over the honest peers (the issue: "the next round succeeds
    without the faulty member"), and the culprit is told why and keeps its values."""
    with trio.fail_after(120):
        async with memnet_swarm(4, first_seed=60) as (_, nodes):  # the same ranks each run
            members = make_members(nodes, SIZE, fast_config())
            garble_uploads(members[victim])
            culprit = members[victim].peer_id
            survivors = [m for i, m in enumerate(members) if i != victim]
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            for info in infos:
                assert set(info.group) == {m.peer_id for m in members}
                for part in info.parts:
                    if part.reducer != culprit:
                        assert part.dropped == {culprit: DropReason.GARBAGE}
            for m in survivors:  # each saw it as a reducer, whoever led
                assert culprit in m.averager._matchmaker.bench, m.peer_id
            for _ in range(4):  # several rounds: the leader changes from round to round
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=TIMEOUT)
                infos = [info for info, _ in results if info is not None]
                assert len(infos) == len(members)
                culprit_info = infos.pop(victim)
                verify_round(survivors, infos, without_report=[members[victim]])
                for info in infos:  # where the culprit ranks first, they join the next
                    assert info.outcome is Outcome.AVERAGED, str(info)
                    assert set(info.group) == {m.peer_id for m in survivors}, str(info)
                if culprit_info.outcome is Outcome.UNCONFIRMED:
                    assert "benched us: it sent us garbage" in culprit_info.note
                assert culprit_info.outcome is not Outcome.PARTIAL, str(culprit_info)
                np.testing.assert_array_equal(members[victim].array, members[victim].data)


async def test_members_a_leader_lied_to_do_not_bench_each_other(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader that tells one member another weight for a second member (each join gets
    its own answer) would make the two honest peers' chunks look like garbage to each
    other. Their group tags, digests of what each was told, differ: they take each other's
    chunks for another group's, and nobody benches anybody (with the leader's random draw
    for a tag, the first would have benched the second, now that garbage under our own
    tag benches whoever led)."""
    of = Plan.of.__func__  # type: ignore[attr-defined]
    told: dict[str, PeerID] = {}

    def lied_to(cls: type[Plan], conf: GroupConfirmation, me: PeerID, config: Any) -> Plan:
        if me == told["lied_to"]:
            members = tuple(
                replace(m, weight=2 * m.weight) if m.peer_id == told["about"] else m
                for m in conf.members
            )
            conf = replace(conf, members=members)
        return of(cls, conf, me, config)  # type: ignore[no-any-return]

    monkeypatch.setattr(Plan, "of", classmethod(lied_to))
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config())
            told.update(lied_to=members[0].peer_id, about=members[1].peer_id)
            results = await step_all(members, timeout=TIMEOUT)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    first = infos[0]
    assert first is not None and first.outcome is not Outcome.AVERAGED, str(first)
    assert DropReason.GARBAGE not in first.dropped.values(), str(first)
    for m in members:
        for other in members:
            assert other.peer_id not in m.averager._matchmaker.bench, (m.peer_id, other.peer_id)


async def test_a_leader_cannot_list_an_honest_member_under_a_host_of_its_own(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's attack: a lying leader sends everyone one confirmation (one group tag)
    that lists an honest member at an accomplice's host, which answers its pings and
    serves a garbage result for its part: every member benched the honest one. Declared
    addresses name their PeerID (``Declaration.from_wire``), and members dial the plan's
    members with it, so the accomplice fails the handshake: the honest member is dropped
    as unreachable for that round, never as garbage, and nobody benches it."""
    of = Plan.of.__func__  # type: ignore[attr-defined]
    victim: dict[str, PeerID] = {}

    def rewritten(cls: type[Plan], conf: GroupConfirmation, me: PeerID, config: Any) -> Plan:
        members = tuple(  # (past from_wire: a bare HOST:PORT is refused there)
            replace(m, address=f"{host_of(4)}:1000") if m.peer_id == victim["id"] else m
            for m in conf.members
        )
        return of(cls, replace(conf, members=members), me, config)  # type: ignore[no-any-return]

    monkeypatch.setattr(Plan, "of", classmethod(rewritten))
    with trio.fail_after(120):
        async with memnet_swarm(5) as (_, nodes):
            accomplice, m = nodes[4], method_prefix("t/x")

            async def answer(request: Any) -> Reply:
                return Reply({})

            async def garbage_result(request: Any) -> AsyncIterator[Reply]:
                yield Reply({"contributors": [], "dropped": [], "weight": 1.0, "chunks": 0})

            accomplice.rpc.register(f"{m}.ping", answer)
            accomplice.rpc.register(f"{m}.chunk", answer)
            accomplice.rpc.register_stream(f"{m}.result", garbage_result)
            members = make_members(nodes[:4], SIZE, fast_config())
            victim["id"] = members[1].peer_id
            results = await step_all(members, timeout=TIMEOUT)
    for info, _ in results:
        assert info is not None
        assert DropReason.GARBAGE not in info.dropped.values(), str(info)
    for mm in members:
        assert victim["id"] not in mm.averager._matchmaker.bench, mm.peer_id


@pytest.mark.parametrize("nan_at", [[5], [0, PART, 2 * PART + 7, SIZE - 1]])
async def test_member_with_nan_is_dropped_where_it_has_nan(
    autojump_clock: trio.testing.MockClock, nan_at: list[int]
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config())
            victim = members[3]
            victim.data[nan_at] = np.nan  # in one part, or in every part (its own included)
            victim.array[:] = victim.data
            results = await step_all(members, timeout=TIMEOUT)
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            for info in infos:
                assert info is not None
                for part in info.parts:
                    if any(part.span[0] <= i < part.span[1] for i in nan_at):
                        assert part.status is PartStatus.SOME
                        assert part.dropped == {victim.peer_id: DropReason.NONFINITE}
                    else:
                        assert part.status is PartStatus.ALL
                expected = 1 - len({i // PART for i in nan_at}) / 4
                assert info.averaged_fraction == pytest.approx(expected)
            assert np.isfinite(victim.array).all()  # it took the others' mean everywhere


async def test_a_member_that_keeps_sending_non_finite_values_is_benched_on_the_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An outside trial's junk sender under ``none`` (random bytes: nearly always a NaN in
    each chunk) was dropped as ``nonfinite``, never benched, and kept every round partial.
    A NaN once is healed by the mean the member receives; one dropped as nonfinite by our
    part again in our next step is benched, and the round after goes on without it."""
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config())
            victim = members[3]
            honest = members[:3]
            for round_no in range(3):
                for m in members:
                    m.data = m.array.copy()
                victim.data[::97] = np.nan  # in every part, every round: not healed
                victim.array[:] = victim.data
                results = await step_all(members, timeout=TIMEOUT)
                infos = [info for info, _ in results[:3]]
                benched = [victim.peer_id in m.averager._matchmaker.bench for m in honest]
                if round_no < 2:  # the first offense heals, the second benches
                    verify_round(members, [info for info, _ in results])  # type: ignore[misc]
                    for info in infos:
                        assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
                        assert info.dropped == {victim.peer_id: DropReason.NONFINITE}, str(info)
                    assert benched == [round_no == 1] * 3
                else:
                    verify_round(honest, infos, without_report=[victim])  # type: ignore[arg-type]
                    for info in infos:
                        assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
                        assert victim.peer_id not in info.group, str(info)


async def test_member_too_stale_is_dropped_and_staleness_decays_weights(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(max_staleness=2))
            for m, epoch in zip(members, [5, 5, 4, 2], strict=True):
                m.epoch = epoch
            results = await step_all(members, timeout=TIMEOUT)
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            stale_id = members[3].peer_id
            for info in infos:
                assert info is not None
                assert info.outcome is Outcome.PARTIAL and info.averaged_fraction == 0.0
                assert info.received_fraction == 1.0 and info.epoch == 5
                assert info.stale == (stale_id,)
                for part in info.parts:
                    assert part.dropped == {stale_id: DropReason.STALE}
                if info.me == stale_id:  # its note says why, and what to do
                    assert "our epoch 2 is more than max_staleness (2) behind the group's" in (
                        info.note
                    ), str(info)
                    assert "continue from info.epoch" in info.note
                else:
                    assert "epoch" not in info.note, str(info)
            members[3].epoch = 5
            for m in members:
                m.data = m.array.copy()
            await next_round_without(members, victim=len(members))


async def test_a_member_far_ahead_of_all_others_is_told_in_its_note(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every other member stale: the whole group takes on the one peer's values, and its
    own report (every part ``none``) says why (an outside tester: a local count as epoch)."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(max_staleness=2))
            for m, epoch in zip(members, [13, 10, 9], strict=True):
                m.epoch = epoch
            results = await step_all(members, timeout=TIMEOUT)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    ahead, *others = infos
    assert ahead is not None and ahead.outcome is Outcome.FAILED, str(ahead)
    assert "every other member's epoch (at most 10) is more than max_staleness (2) behind ours" in (
        ahead.note
    ), str(ahead)
    for info in others:
        assert info is not None and info.received_fraction == 1.0, str(info)
        assert "our epoch" in info.note and "behind the group's newest (13)" in info.note


async def test_a_reducer_whose_result_misses_the_deadline_is_listed_as_dropped(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reducer that freezes for good near the deadline (here: it never serves its result,
    while its host still answers pings) is caught by no stall timeout before the deadline;
    its part is none for the others all the same, and lists it as dropped (``timeout``)."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, SIZE, fast_config(stall_timeout=60.0))
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            serve = ReducerService.results

            async def never(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                if self.plan.me == victim_id:
                    await trio.sleep_forever()
                async for item in serve(self, member):
                    yield item

            monkeypatch.setattr(ReducerService, "results", never)
            results = await step_all(members, timeout=10.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for i, (info, elapsed) in enumerate(results):
        assert info is not None and elapsed <= 10.0 + 1e-9  # float rounding of trio time
        if i == victim:
            continue
        assert info.outcome is Outcome.PARTIAL and info.dropped == {victim_id: DropReason.TIMEOUT}
        (part,) = [p for p in info.parts if p.reducer == victim_id]
        assert part.status is PartStatus.NONE and part.dropped == {victim_id: DropReason.TIMEOUT}
        assert "deadline" in part.note
        assert all(p.status is PartStatus.ALL for p in info.parts if p is not part)


def _forge(header: ResultHeader, group: tuple[PeerID, ...], kind: str) -> ResultHeader:
    if kind == "no chunks":  # a result without its chunks: members kept their values
        return ResultHeader(group, (), header.weight, 0)
    if kind == "no contributors":  # values, but "nobody's": members said none and took them
        return ResultHeader((), (), header.weight, header.chunks)
    if kind == "listed twice":
        return ResultHeader(group + group[:1], (), header.weight, header.chunks)
    if kind == "counted and dropped":
        return ResultHeader(group, ((group[0], DropReason.GARBAGE),), header.weight, header.chunks)
    assert kind == "weight"
    return ResultHeader(group, (), header.weight * 3, header.chunks)


@pytest.mark.parametrize(
    "kind", ["no chunks", "no contributors", "listed twice", "counted and dropped", "weight"]
)
async def test_a_result_header_that_contradicts_itself_or_the_plan_is_garbage(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A reducer's result header is checked against what a member knows: group members,
    each once, nobody both counted and dropped, the contributors' weight from the plan, and
    every chunk for a result. A header of a result without chunks was taken for a full
    result (the tensors kept their values, the report said ``all``); one without
    contributors had its chunks stored while the report said ``none``."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config())
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            serve = ReducerService.results

            async def forged(self: ReducerService, member: Any) -> AsyncIterator[Any]:
                async with aclosing(serve(self, member)) as items:
                    async for item in items:
                        if self.plan.me == victim_id and "contributors" in item.body:
                            header = ResultHeader.from_body(item.body)
                            yield Reply(_forge(header, self.plan.group, kind).to_body())
                            if kind == "no chunks":
                                return
                            continue
                        yield item

            monkeypatch.setattr(ReducerService, "results", forged)
            results = await step_all(members, timeout=TIMEOUT)
            infos = check_survivors(results, members, victim)
            for info in infos:
                (part,) = [p for p in info.parts if p.reducer == victim_id]
                assert part.status is PartStatus.NONE and not part.received
                assert part.dropped[victim_id] is DropReason.GARBAGE
                assert part.note == "the reducer is garbage"
                assert all(p.status is PartStatus.ALL for p in info.parts if p is not part)
            monkeypatch.setattr(ReducerService, "results", serve)
            # mended: each member saw its garbage result itself (under the round's group
            # tag, whoever led) and benches it for BENCH_STEPS of its steps, so it sits
            # out those rounds, and the other two average without it
            benchers = [m for m in members if victim_id in m.averager._matchmaker.bench]
            assert {m.peer_id for m in benchers} == {m.peer_id for m in members} - {victim_id}
            for _ in range(BENCH_STEPS):
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=TIMEOUT)
                infos = [info for info, _ in results if info]
                assert len(infos) == 3
                verify_round(members, infos)  # each report against its own group
                # without the victim: the benchers skip it where it ranks first
                done = [i for i in infos if i.outcome is Outcome.AVERAGED]
                assert all(victim_id not in i.group for i in done), [str(i) for i in infos]
                assert len(done) >= 2 and all(
                    i.outcome in (Outcome.UNCONFIRMED, Outcome.ALONE)
                    for i in infos
                    if i not in done
                ), [str(i) for i in infos]
            for m in members:
                m.data = m.array.copy()
            results = await step_all(members, timeout=TIMEOUT)
            verify_round(members, [info for info, _ in results])  # type: ignore[misc]
            assert all(info.outcome is Outcome.AVERAGED for info, _ in results)  # type: ignore[union-attr]


async def test_a_member_whose_step_was_cancelled_costs_the_others_little(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A member whose step ends early (cancelled by its caller, here after one chunk went
    out) tells the reducers it left (``Butterfly._withdraw``: dropped as ``timeout``); its
    part is no longer served either (dropped as dead), whichever the others learn first.
    Without either word it would still answer pings: the liveness pings name the round,
    and a peer no longer in it answers ``not_found``."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config(max_inflight=1))
            victim = non_leader(members)
            scope = trio.CancelScope()
            after_acks(members[victim], 1, scope.cancel)
            results: list[tuple[AveragingInfo | None, float]] = [(None, 0.0)] * 3

            async def one(i: int) -> None:
                start = trio.current_time()
                with scope if i == victim else contextlib.nullcontext():
                    info = await members[i].averager.step(members[i].weight, timeout=TIMEOUT)
                    results[i] = (info, trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            assert results[victim][0] is None  # cancelled: no report
            victim_id = members[victim].peer_id
            survivors = [m for i, m in enumerate(members) if i != victim]
            infos = [info for i, (info, _) in enumerate(results) if i != victim]
            verify_round(survivors, infos, without_report=[members[victim]])  # type: ignore[arg-type]
            for info in infos:
                assert info is not None and info.outcome is Outcome.PARTIAL
                assert info.allreduce_s <= 2 * members[0].averager.config.stall_timeout
                assert set(info.dropped) == {victim_id}
                assert info.dropped[victim_id] in (DropReason.DEAD, DropReason.TIMEOUT)
            await next_round_without(members, victim)


@pytest.mark.parametrize("withdraws", [True, False], ids=["withdraws", "withdrawal-lost"])
async def test_a_member_whose_deadline_ends_its_upload_midway_tells_the_reducers(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, withdraws: bool
) -> None:
    """Slow links; one member's step timeout ends while its chunks are on their way. Its
    reducers waited for the rest until their stall timeout (5 s of a 1.4 s round: an
    outside tester saw 5.3 s against 0.15 s); told that it left (``Butterfly._withdraw``,
    after its step returned), they drop it as ``timeout`` at once and finish the round."""

    async def lost(self: Butterfly, parts: list[int]) -> None:
        return None

    if not withdraws:
        monkeypatch.setattr(Butterfly, "_withdraw", lost)
    net = MemoryNetwork(latency=0.05, window=64 << 10)
    config = fast_config(gather_window=1.0, chunk_bytes=64 << 10, stall_timeout=5.0)
    with trio.fail_after(120):
        async with memnet_swarm(3, network=net) as (_, nodes):
            members = make_members(nodes, 1 << 20, config)
            await trio.sleep(1.0 - trio.current_time() % 1.0 + 0.1)  # early in a slot
            results: list[tuple[AveragingInfo | None, float]] = [(None, 0.0)] * 3

            async def one(i: int) -> None:
                start = trio.current_time()
                # the round: ~1.05 s of matchmaking, then ~1.4 s of butterfly
                timeout = 1.6 if i == 2 else 30.0
                info = await members[i].averager.step(members[i].weight, timeout=timeout)
                results[i] = (info, trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
    verify_round(members, [info for info, _ in results])  # type: ignore[misc]
    late = members[2].peer_id
    assert results[2][1] == pytest.approx(1.6, abs=0.01)
    own = results[2][0]
    assert own is not None and "this step's timeout came before" in own.note, own.note
    for info, took in results[:2]:
        assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
        assert "cutoff" not in info.note, info.note  # their own timeouts were 30 s
        if withdraws:
            assert info.dropped.get(late) is DropReason.TIMEOUT, str(info)
            assert took < 3.0, took  # 1.6 s, and the others' downloads
            assert "its step left the round" in info.note, info.note
        else:
            assert took > 5.0, took  # the stall timeout after its last chunk


async def test_a_reducer_whose_step_ends_before_its_mean_is_ready_ends_waiting_downloads(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's step is cancelled (by its caller) after the group was confirmed, while
    another member's request for its part waits for the mean: that request is answered
    ``not_found`` at once, as a request that comes after the step ended is, so the others
    drop the part and finish at once (a review found them held a whole stall timeout)."""
    results = ReducerService.results
    caught: list[bool] = []

    async def cancelling_results(self: ReducerService, member: PeerID) -> AsyncIterator[Reply]:
        if self.plan.me == victim_id and not caught:
            caught.append(not self.ready.is_set())
            scope.cancel()  # the victim's step ends while this request waits
        async with aclosing(results(self, member)) as items:
            async for item in items:
                yield item

    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config())
            victim = non_leader(members)
            victim_id = members[victim].peer_id
            scope = trio.CancelScope()
            monkeypatch.setattr(ReducerService, "results", cancelling_results)
            took: list[tuple[AveragingInfo | None, float]] = [(None, 0.0)] * 3

            async def one(i: int) -> None:
                start = trio.current_time()
                with scope if i == victim else contextlib.nullcontext():
                    info = await members[i].averager.step(members[i].weight, timeout=TIMEOUT)
                    took[i] = (info, trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            monkeypatch.setattr(ReducerService, "results", results)
            assert caught == [True]  # the request came before the victim's mean was ready
            stall = members[0].averager.config.stall_timeout
            for i, (info, elapsed) in enumerate(took):
                if i == victim:
                    assert info is None
                    continue
                assert info is not None and info.outcome is Outcome.PARTIAL, str(info)
                # dead (its part is no longer served) or timeout (it withdrew), whichever
                # the survivor learned first
                assert info.dropped.get(victim_id) in (DropReason.DEAD, DropReason.TIMEOUT)
                assert elapsed < stall, (elapsed, stall)
            await next_round_without(members, victim)


async def test_a_download_retried_after_a_reset_that_the_reducer_no_longer_serves_says_so(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial over flaky links: a member's result stream broke after the reducer had sent
    it all (so the reducer's step ended, and its next step began in the same slot); the
    retry was refused ``bad_request: part 0 is not reduced here for you``, which read as a
    wrong request of ours. The part stays ``none``, and the note now says what happened."""
    fetch = Butterfly._fetch
    calls: list[int] = []

    async def breaking_fetch(self: Butterfly, index: int, *args: Any) -> tuple[bool, str]:
        if self.plan.me != victim_id or self.plan.reducers[index].peer_id != reducer_id:
            return await fetch(self, index, *args)
        calls.append(index)
        if len(calls) == 1:
            raise PeerUnavailableError("connection reset")
        raise RemoteError("bad_request", f"part {index} is not reduced here for you")

    async def always(self: Liveness, peer_id: PeerID) -> bool:
        return True

    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3 * 4096, fast_config())
            victim_id, reducer_id = members[0].peer_id, members[1].peer_id
            monkeypatch.setattr(Butterfly, "_fetch", breaking_fetch)
            monkeypatch.setattr(Liveness, "reconnect", always)
            results = await step_all(members, timeout=TIMEOUT)
    info = results[0][0]
    assert info is not None and calls and len(calls) == 2
    (part,) = [p for p in info.parts if p.reducer == reducer_id]
    assert part.status is PartStatus.NONE and not part.received
    assert part.note.startswith(
        "the connection broke during the download, and by our retry the reducer no longer "
        "served this round's result (bad_request: part"
    ), part.note


async def test_a_client_that_benched_every_full_member_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client-mode member skips the full members it benched as leaders; with none left it
    has nobody to join, and its note says that (it read "the leader did not confirm in
    time"). The full members, which benched nobody, average between themselves."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], SIZE, fast_config())
            members += make_members(nodes[2:], SIZE, fast_config(client_mode=True), seed=1)
            client = members[2]
            for full in members[:2]:
                client.averager._matchmaker.bench.record(full.peer_id, "it sent us garbage")
            results = await step_all(members, timeout=TIMEOUT)
    info = results[2][0]
    assert info is not None and info.outcome is Outcome.UNCONFIRMED
    assert "every full member of our group failed or was benched by us" in info.note, info.note
    np.testing.assert_array_equal(client.array, client.data)
    for full_info, _ in results[:2]:
        assert full_info is not None and full_info.outcome is Outcome.AVERAGED
        assert len(full_info.group) == 2


@pytest.mark.parametrize("seed", [1, 20])
async def test_a_late_withdrawal_does_not_drop_the_members_next_step_in_a_round_of_the_same_number(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Two members average early in a long slot (closed early: each knows the other); both
    step timeouts end mid-butterfly, one 0.1 s after the other, and both step again at
    once, in a round of the same number (the slot is far from closing). Each one's "we
    left" word (``Butterfly._withdraw``) for the first step reached the other in its second
    step (behind the cut upload on a slow link), waited there for the group, and then
    dropped the sender's new contribution, and its part with it: both second steps failed.
    Such a word is not held for a group, and a part that has nothing of the sender yet
    ignores it."""
    window = 8.0
    net = MemoryNetwork(latency=0.05, window=64 << 10)
    config = fast_config(gather_window=window, chunk_bytes=64 << 10, stall_timeout=5.0)
    with trio.fail_after(300):
        async with memnet_swarm(2, network=net, first_seed=seed) as (_, nodes):
            members = make_members(nodes, 1 << 20, config)
            warm = await step_all(members, timeout=60.0)  # each learns the other
            assert all(i is not None and i.outcome is Outcome.AVERAGED for i, _ in warm)
            await trio.sleep(window - trio.current_time() % window + 0.1)  # early in a slot
            infos: list[list[AveragingInfo]] = [[], []]

            async def one(i: int, first_timeout: float) -> None:
                averager = members[i].averager
                infos[i].append(await averager.step(timeout=first_timeout))
                infos[i].append(await averager.step(timeout=60.0))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, 1.3)
                nursery.start_soon(one, 1, 1.4)
    first = {rows[0].round for rows in infos}
    assert len(first) == 1
    for rows in infos:
        assert rows[0].outcome is not Outcome.AVERAGED  # cut short
        assert {rows[1].round} == first  # the next step, in a round of the same number
        assert rows[1].outcome is Outcome.AVERAGED and not rows[1].dropped, str(rows[1])
