"""When every other peer has left a node's network, the node cannot tell that apart from
being cut off itself: its refresh pings then only count as failures, so the last contact
of a deserted table stays listed until it has failed three requests, over two or three
refreshes (20 to 30 minutes at the default 10-minute ``refresh_interval``), and the "peer
left" line then says why (docs/bootstrap.md). A contact that leaves while others still
answer goes at the next refresh."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
import trio.testing

from peer import open_peer
from peer.dht import DHTConfig
from peer.memnet import MemoryNetwork
from protocol.identity import Identity, PeerID
from protocol.messages import NodeInfo

BOOT = Identity.from_seed(b"b" * 32)
REFRESH = DHTConfig().refresh_interval


async def _serve(
    net: MemoryNetwork,
    host: str,
    boot: str,
    seed: bytes,
    *,
    task_status: trio.TaskStatus[trio.CancelScope],
) -> None:
    identity = Identity.from_seed(seed * 32)
    with trio.CancelScope() as scope:
        async with open_peer(f"{host}:4000", [boot], identity, network=net.interface(host)):
            task_status.started(scope)
            await trio.sleep_forever()


class _Departures(logging.Handler):
    """Keeps the "peer left" lines for ``peer_id`` (any node's: the logger is shared)."""

    def __init__(self, peer_id: PeerID) -> None:
        super().__init__(logging.INFO)
        self.prefix = f"peer left: {peer_id.short()} ("
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.lines.append(record.getMessage())


@contextmanager
def _watch_departure(peer_id: PeerID) -> Iterator[_Departures]:
    handler = _Departures(peer_id)
    logger = logging.getLogger("peer")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize(
    ("others", "within", "why"),
    [
        # deserted: two or three refreshes (1130 s here), as failed requests
        (0, (REFRESH, 3 * REFRESH + 20), "(a request failed)"),
        # another contact answers: the next refresh removes it
        (1, (0, REFRESH + 20), "(its address no longer takes connections)"),
    ],
    ids=["deserted", "others-answer"],
)
async def test_when_a_contact_that_went_quiet_then_died_leaves_the_table(
    autojump_clock: trio.testing.MockClock, others: int, within: tuple[float, float], why: str
) -> None:
    net = MemoryNetwork(latency=0.005)
    victim = Identity.from_seed(b"x" * 32).peer_id
    async with (
        open_peer("10.0.0.1:4000", identity=BOOT, network=net.interface("10.0.0.1")) as boot,
        trio.open_nursery() as nursery,
    ):
        scope = await nursery.start(_serve, net, "10.0.0.2", boot.address, b"x")
        for i in range(others):
            await nursery.start(_serve, net, f"10.0.0.{3 + i}", boot.address, bytes([i]))
        assert (victim, "10.0.0.2:4000") in boot.dht.routing_table_peers()
        await trio.sleep(120)  # the connections idle out: the victim's end will tell nobody
        assert net.open_connections == 0
        killed = trio.current_time()
        left = trio.Event()  # the bootstrap's table, not the other peer's (both log)
        on_departed = boot.dht.table.on_departed
        assert on_departed is not None

        def departed(node: NodeInfo) -> None:
            on_departed(node)
            if node.peer_id == victim:
                left.set()

        boot.dht.table.on_departed = departed
        with _watch_departure(victim) as departure, trio.fail_after(4 * REFRESH):
            net.kill_host("10.0.0.2")
            scope.cancel()
            await left.wait()
        assert within[0] < trio.current_time() - killed <= within[1]
        assert any(line.endswith(why) for line in departure.lines), departure.lines
        assert (victim, "10.0.0.2:4000") not in boot.dht.routing_table_peers()
        nursery.cancel_scope.cancel()


class _LineEvent(logging.Handler):
    """Sets ``event`` when a line containing ``text`` is logged; keeps those lines."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self.event = trio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.records.append(record)
            self.event.set()


async def _serve_boot(
    net: MemoryNetwork, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with trio.CancelScope() as scope:
        async with open_peer("10.0.0.1:4000", identity=BOOT, network=net.interface("10.0.0.1")):
            task_status.started(scope)
            await trio.sleep_forever()


async def test_a_peer_left_alone_says_so_and_when_it_is_back_in_touch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client whose only contact (its bootstrap node) died answered every get with None
    and every store with False for minutes, with only a "peer left" line at INFO (an
    outside tester): the last contact leaving is a WARNING, and coming back in touch says
    so too."""
    net = MemoryNetwork(latency=0.005)
    alone, back = _LineEvent("knows no other peer now"), _LineEvent("in touch with the network")
    every = _LineEvent("")
    logger = logging.getLogger("peer")
    level = logger.level
    logger.setLevel(logging.INFO)
    for handler in (alone, back, every):
        logger.addHandler(handler)
    try:
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                scope = await nursery.start(_serve_boot, net)
                boot = f"{BOOT.peer_id}@10.0.0.1:4000"
                async with open_peer(
                    None, [boot], client_mode=True, network=net.interface("10.0.1.1")
                ) as client:
                    assert await client.dht.store("k", 1, ttl=600)
                    net.kill_host("10.0.0.1")
                    scope.cancel()
                    await alone.event.wait()
                    assert [r.levelno for r in alone.records] == [logging.WARNING]
                    assert BOOT.peer_id.short() in alone.records[0].getMessage()
                    assert "and its initial peers at each refresh" in alone.records[0].getMessage()
                    lines = [r.getMessage() for r in every.records]
                    left = lines.index(next(m for m in lines if m.startswith("peer left: ")))
                    assert "knows no other peer now" in lines[left + 1], lines  # right after
                    assert len(client.dht.table) == 0
                    assert await client.dht.store("k", 2, ttl=600) is False
                    # back at its address: the client's pings of departed contacts find it
                    net.revive_host("10.0.0.1")
                    await nursery.start(_serve_boot, net)
                    await back.event.wait()
                    assert len(back.records) == 1 and len(client.dht.table) == 1
                nursery.cancel_scope.cancel()
    finally:
        for handler in (alone, back, every):
            logger.removeHandler(handler)
        logger.setLevel(level)


async def test_the_first_node_left_alone_names_no_initial_peers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first node of a network has no initial peers to ping: its line said it would
    ping them (an outside tester, at every bootstrap node's shutdown of its swarm)."""
    net = MemoryNetwork(latency=0.005)
    alone = _LineEvent("knows no other peer now")
    logger = logging.getLogger("peer")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(alone)
    try:
        with trio.fail_after(3600):
            async with trio.open_nursery() as nursery:
                await nursery.start(_serve_boot, net)
                boot = f"{BOOT.peer_id}@10.0.0.1:4000"
                async with open_peer("10.0.0.2:4000", [boot], network=net.interface("10.0.0.2")):
                    pass  # joined, and gone: the boot node finds it gone at a refresh
                await alone.event.wait()
                nursery.cancel_scope.cancel()
        assert [r.levelno for r in alone.records] == [logging.INFO]
        message = alone.records[0].getMessage()
        assert "initial peers" not in message, message
        assert message.endswith("it pings the departed contacts at each refresh"), message
    finally:
        logger.removeHandler(alone)
        logger.setLevel(level)
