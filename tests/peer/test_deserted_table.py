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
