"""A contact that restarted at another address is not kept at its old one by answers that
reach it over a connection to its new one. Calls go over any pooled connection with the
peer; one that reached it at its new address answered for its old address too, and the
dial of the old address, remembered from before the restart, passed for proof that it
listens there: a client held a peer killed at its first address and restarted elsewhere
at the dead address for 31 minutes and more (an outside tester's soak), its refresh pings
answered over the new connection."""

from __future__ import annotations

import trio
import trio.testing

from peer import open_peer
from peer.memnet import MemoryNetwork
from protocol.identity import Identity
from protocol.messages import NodeInfo

MOVER = Identity.from_seed(b"m" * 32)


async def _serve(
    net: MemoryNetwork, host: str, boot: str, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with trio.CancelScope() as scope:
        async with open_peer(f"{host}:4000", [boot], MOVER, network=net.interface(host)):
            task_status.started(scope)
            await trio.sleep_forever()


async def test_answers_over_the_new_connection_move_the_contact_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.005)
    old, new = "10.0.0.2:4000", "10.0.0.3:4000"
    with trio.fail_after(120):
        async with (
            open_peer("10.0.0.1:4000", network=net.interface("10.0.0.1")) as boot,
            trio.open_nursery() as nursery,
        ):
            first = await nursery.start(_serve, net, "10.0.0.2", boot.address)
            async with open_peer(
                None, [boot.address], client_mode=True, network=net.interface("10.0.1.1")
            ) as client:
                assert (MOVER.peer_id, old) in client.dht.routing_table_peers()
                protocol = client.dht.protocol
                assert await protocol.ping(NodeInfo(MOVER.peer_id, old))  # dialed there
                net.kill_host("10.0.0.2")  # killed, and restarted elsewhere with its key
                first.cancel()
                await nursery.start(_serve, net, "10.0.0.3", boot.address)

                assert await protocol.ping(NodeInfo(MOVER.peer_id, new))
                assert (MOVER.peer_id, new) in client.dht.routing_table_peers()
                # a stale reply names it at its old address: asked there, it answers over
                # the connection to its new one
                assert await protocol.ping(NodeInfo(MOVER.peer_id, old))
                assert (MOVER.peer_id, new) in client.dht.routing_table_peers()
                assert (MOVER.peer_id, old) not in client.dht.routing_table_peers()
            nursery.cancel_scope.cancel()
