"""A node that restarts with the same identity (a bootstrap host's key file) comes back with
empty storage but already known to its neighbours: being known, it got no handover, and a
rolling restart of every holder lost the records whose owners had left (a review). A known
contact that looks up its own id, as a joining node does, or comes back at another
address, now gets the keys it should hold, at most once per republish interval."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.memnet import MemoryNetwork
from peer.node import Peer, open_peer
from protocol.identity import Identity, PeerID
from protocol.messages import NodeInfo

EPOCH = 1_700_000_000.0


def _clock() -> float:
    return EPOCH + trio.current_time()


async def _start(
    nursery: trio.Nursery, net: MemoryNetwork, host: str, port: int, seed: int, initial: list[str]
) -> tuple[Peer, trio.CancelScope]:
    scope = trio.CancelScope()

    async def life(*, task_status: trio.TaskStatus[Peer]) -> None:
        with scope:
            async with open_peer(
                listen=f"{host}:{port}",
                initial_peers=initial,
                identity=Identity.from_seed(seed.to_bytes(32, "big")),
                network=net.interface(host),
                clock=_clock,
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

    node = await nursery.start(life)
    return node, scope


@pytest.mark.parametrize("new_port", [False, True], ids=["same-address", "new-port"])
async def test_a_rolling_restart_with_the_same_identities_keeps_a_record_alive(
    autojump_clock: trio.testing.MockClock, new_port: bool
) -> None:
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nodes = {1: await _start(nursery, net, "10.0.0.1", 4000, 1, [])}
            first = nodes[1][0].address
            for i in range(2, 5):
                nodes[i] = await _start(nursery, net, f"10.0.0.{i}", 4000, i, [first])
            writer, writer_scope = await _start(nursery, net, "10.0.0.9", 4000, 9, [first])
            assert await writer.dht.store("run/config", {"lr": 0.1}, ttl=1200)
            writer_scope.cancel()  # its owner left: nobody republishes it
            await trio.sleep(120)  # connections idle out: nobody sees the restarts
            for i in range(1, 5):
                other = nodes[2 if i == 1 else 1][0].address
                nodes[i][1].cancel()
                await trio.sleep(30)
                port = 4001 if new_port else 4000
                nodes[i] = await _start(nursery, net, f"10.0.0.{i}", port, i, [other])
                await trio.sleep(90)
            held = [len(nodes[i][0].dht.storage or ()) for i in range(1, 5)]
            assert held == [1, 1, 1, 1]
            assert await nodes[2][0].dht.get("run/config") == {"lr": 0.1}
            nursery.cancel_scope.cancel()


async def test_refreshes_and_joins_hand_nothing_over_twice(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node looks up its own id at each refresh (10 min, beyond the once-per-5-min
    rule): each contact it asked handed it every key again, with no restart at all, and a
    newcomer got its initial peer's handover twice (its join, then its own-id lookup; a
    review). A known contact is asked for one key first now, and a join's own-id lookup
    hands nothing over again."""
    import collections

    from peer.dht.handover import Handover

    handed: list[tuple[PeerID, PeerID, int]] = []  # (from, to, keys)
    hand_over = Handover.hand_over

    async def counted(self: Handover, node: NodeInfo, **kwargs: bool) -> int:
        sent = await hand_over(self, node, **kwargs)
        handed.append((self._dht.peer_id, node.peer_id, sent))
        return sent

    monkeypatch.setattr(Handover, "hand_over", counted)
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            first, _ = await _start(nursery, net, "10.0.0.1", 4000, 1, [])
            nodes = [first]
            for i in range(2, 13):
                nodes.append(
                    (await _start(nursery, net, f"10.0.0.{i}", 4000, i, [first.address]))[0]
                )
            await trio.sleep(30)
            for j in range(60):
                assert await nodes[j % len(nodes)].dht.store(f"k{j}", j, ttl=3000)
            await trio.sleep(30)
            handed.clear()
            newcomer, _ = await _start(nursery, net, "10.0.0.99", 4000, 99, [first.address])
            await trio.sleep(20)
            per_sender = collections.Counter(a for a, b, _ in handed if b == newcomer.peer_id)
            assert per_sender[first.peer_id] == 1, per_sender
            assert sum(n for _, b, n in handed if b == newcomer.peer_id) > 0
            await trio.sleep(700)
            handed.clear()
            await trio.sleep(1800)  # three refreshes: no join, no restart
            assert sum(n for _, _, n in handed) == 0, handed
            nursery.cancel_scope.cancel()
