"""Helpers shared by the averaging tests: swarms on the memory network, and the verifier that
checks a round's tensors against its reports (what every test calls after a round)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import trio

from peer import MemoryNetwork, Peer, open_peer
from protocol.address import Address
from protocol.identity import Identity, PeerID
from training import (
    Averager,
    AveragerConfig,
    AveragingInfo,
    LayoutMismatchError,
    Outcome,
    PartStatus,
)
from training.averaging.plan import Plan

T0 = 1_700_000_000.0


def virtual_clock() -> float:
    """Unix-like time that follows trio's (virtual) clock."""
    return T0 + trio.current_time()


def fast_config(**changes: object) -> AveragerConfig:
    base: dict[str, object] = {
        "clock": virtual_clock,
        "chunk_bytes": 4096,
        "gather_window": 1.0,
        "join_timeout": 0.5,
        "stall_timeout": 2.0,
    }
    base.update(changes)
    return AveragerConfig(**base)  # type: ignore[arg-type]


def declaration_wire(**changes: object) -> dict[str, object]:
    """A well-formed declaration as it travels (grouping.Declaration.from_wire reads it)."""
    base: dict[str, object] = {
        "address": "127.0.0.1:4000",
        "weight": 1.0,
        "epoch": 0,
        "bandwidth": 1.0,
        "layout": "v6:abc",
        "count": 1,
    }
    base.update(changes)
    return base


def host_of(i: int) -> str:
    return f"10.0.{i // 200}.{i % 200 + 1}"


@asynccontextmanager
async def memnet_swarm(
    n: int,
    latency: float = 0.005,
    *,
    network: MemoryNetwork | None = None,
    first_seed: int | None = None,
) -> AsyncIterator[tuple[MemoryNetwork, list[Peer]]]:
    """``n`` peers on ``network`` (a new memory network by default), each joining through
    the first; with ``first_seed``, identities from fixed seeds (``first_seed + i``): the
    groups and leaders of every round are then the same from run to run."""
    net = network if network is not None else MemoryNetwork(latency=latency)
    async with AsyncExitStack() as stack:
        nodes: list[Peer] = []
        for i in range(n):
            seed = None if first_seed is None else bytes([first_seed + i]) * 32
            node = await stack.enter_async_context(
                open_peer(
                    listen=f"{host_of(i)}:1000",
                    initial_peers=[nodes[0].address] if nodes else [],
                    network=net.interface(host_of(i)),
                    clock=virtual_clock,
                    identity=None if seed is None else Identity.from_seed(seed),
                )
            )
            nodes.append(node)
        yield net, nodes


@dataclass
class Member:
    """One test peer's averager, its original values and its live (averaged) array."""

    averager: Averager
    data: np.ndarray  # original flat values
    array: np.ndarray  # the averaged array (one tensor)
    weight: float = 1.0
    epoch: int = 0

    @property
    def peer_id(self) -> PeerID:
        return self.averager.node.peer_id


def make_members(
    nodes: Sequence[Peer], size: int, config: AveragerConfig, seed: int = 0, prefix: str = "t/x"
) -> list[Member]:
    rng = np.random.default_rng(seed)
    members = []
    for i, node in enumerate(nodes):
        data = rng.standard_normal(size).astype(np.float32)
        array = data.copy()
        averager = Averager(node, prefix, [array], config=config)
        members.append(Member(averager, data, array, weight=float(i % 3 + 1)))
    return members


async def step_all(
    members: Sequence[Member],
    timeout: float,  # noqa: ASYNC109 - passed on to step()
) -> list[tuple[AveragingInfo | None, float]]:
    """Step every member at once; each result is (info, seconds it took)."""
    results: list[tuple[AveragingInfo | None, float]] = [(None, 0.0)] * len(members)

    async def one(i: int) -> None:
        start = trio.current_time()
        info = await members[i].averager.step(
            weight=members[i].weight, epoch=members[i].epoch, timeout=timeout
        )
        results[i] = (info, trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        for i in range(len(members)):
            nursery.start_soon(one, i)
    return results


async def step_averagers(averagers: Sequence[Averager]) -> list[AveragingInfo]:
    """Step every averager at once (default arguments); their reports, in order."""
    infos: list[AveragingInfo | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        infos[i] = await averagers[i].step()

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return [info for info in infos if info is not None]


async def next_round_among(
    members: Sequence[Member],
    timeout: float,  # noqa: ASYNC109 - passed on to step()
) -> None:
    """A further round among ``members`` only (their averaged arrays as the new data): it
    averages the whole vector over all of them, as the report and the tensors agree."""
    for m in members:
        m.data = m.array.copy()
    results = await step_all(members, timeout=timeout)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for info, elapsed in results:
        assert info is not None and elapsed <= timeout
        assert info.outcome is Outcome.AVERAGED and len(info.group) == len(members)


def tolerance(codec: str, scale: float) -> float:
    """Largest error allowed per element after upload and download through ``codec``."""
    return {
        "none": 1e-6 * scale,
        "float16": 2.0 * scale * 2**-11,
        "int8": 2.0 * scale / 254 + 1e-6 * scale,
    }[codec]


def verify_round(
    members: Sequence[Member],
    infos: Sequence[AveragingInfo],
    codec: str = "none",
    max_staleness: int = 2,
    decay: float = 0.5,
    without_report: Sequence[Member] = (),
) -> None:
    """Check that every member's tensors are exactly what its report claims
    (``without_report``: group members whose step returned none, e.g. it was cancelled)."""
    by_id = {m.peer_id: m for m in [*members, *without_report]}
    scale = max(float(np.abs(m.data).max()) for m in members)
    tol = tolerance(codec, scale)
    seen_contributors: dict[tuple[int, PeerID, int], tuple[PeerID, ...]] = {}
    for member, info in zip(members, infos, strict=True):
        group = set(info.group)
        newest = max((by_id[p].epoch for p in group), default=0)
        total = sum(p.size for p in info.parts if p.status is PartStatus.ALL)
        assert abs(info.averaged_fraction - (total / info.total if info.parts else 0.0)) < 1e-12
        for part in info.parts:
            start, stop = part.span
            got = member.array[start:stop]
            if not part.received:
                assert part.status is PartStatus.NONE
                np.testing.assert_array_equal(got, member.data[start:stop])
                continue
            assert part.contributors, "a received part has contributors"
            assert (part.status is PartStatus.ALL) == (set(part.contributors) == group)
            key = (info.round, part.reducer, part.span[0])
            assert seen_contributors.setdefault(key, part.contributors) == part.contributors
            weights = {}
            for p in part.contributors:
                staleness = newest - by_id[p].epoch
                assert staleness <= max_staleness
                weights[p] = by_id[p].weight * decay**staleness
            expected = sum(
                w * by_id[p].data[start:stop].astype(np.float64) for p, w in weights.items()
            ) / sum(weights.values())
            err = float(np.abs(got - expected).max()) if stop > start else 0.0
            assert err <= tol, f"part {part.index}: error {err} > {tol}"
            assert not set(part.contributors) & set(part.dropped)
            assert set(part.contributors) | set(part.dropped) <= group


async def step_or_mismatch(
    averager: Averager, seconds: float, outcome: list[AveragingInfo | LayoutMismatchError]
) -> None:
    """One step (its timeout: ``seconds``), its info or its ``LayoutMismatchError``
    appended to ``outcome`` (to run in a nursery beside the other members' steps)."""
    try:
        outcome.append(await averager.step(timeout=seconds))
    except LayoutMismatchError as exc:
        outcome.append(exc)


def no_node(plan: Plan) -> SimpleNamespace:
    """A stand-in peer for a ``Liveness`` that never probes (unit tests of one reducer):
    every member of ``plan`` stays connected, no connection ever ends."""
    members = [m.peer_id for m in plan.members]
    return SimpleNamespace(
        rpc=SimpleNamespace(
            disconnected=trio.Event(),
            connected_peers=lambda: list(members),
            lost_at=lambda peer_id: -math.inf,
        )
    )


def slow_joins(node: Peer, delay: float, to: PeerID | None = None) -> list[object]:
    """Delay ``node``'s join calls (to ``to`` only, if given) by ``delay`` seconds; return
    the list that collects the replies to its joins (a body, or the error)."""
    rpc, replies = node.rpc, list[object]()
    call: Callable[..., Awaitable[object]] = rpc.call

    async def slow(
        address: Address, method: str, body: object = None, payload: bytes = b""
    ) -> object:
        if not method.endswith(".join"):
            return await call(address, method, body, payload)
        if to is None or address.peer_id == to:
            await trio.sleep(delay)
        try:
            reply = await call(address, method, body, payload)
        except Exception as exc:
            replies.append(exc)
            raise
        replies.append(reply.body)  # type: ignore[attr-defined]
        return reply

    rpc.call = slow  # type: ignore[assignment,method-assign]
    return replies
