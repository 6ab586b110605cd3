"""Two processes with one identity (a key file copied with a machine image): each sees it
and says so, and no report claims the other's values as its own. A twin's averaging report
listed the shared PeerID as a contributor, with the other twin's values in its tensor; a
bootstrap node joined through its twin started a second network without a word (a trial)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config

from peer import Peer, PeerUnavailableError, open_peer
from peer.errors import DuplicateIdentityError, SelfDialError
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.identity import Identity
from protocol.messages import NodeInfo
from training import Averager, AveragingInfo, Outcome

SHARED = Identity.from_seed(b"t" * 32)
OTHER = Identity.from_seed(b"o" * 32)  # a peer of its own identity, the twins' way in


def _peer(
    net: MemoryNetwork, listen: str, identity: Identity, via: Peer | None = None
) -> AbstractAsyncContextManager[Peer]:
    """A peer on ``net`` at ``listen`` (``HOST:PORT``), joining through ``via``."""
    host = listen.split(":")[0]
    initial = [via.address] if via is not None else []
    return open_peer(listen, initial, identity, network=net.interface(host))


async def test_a_twin_among_the_initial_peers_is_named_as_such(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(30):
        async with open_peer(
            "10.0.0.1:4000", identity=SHARED, network=net.interface("10.0.0.1")
        ) as a:
            with pytest.raises(
                PeerUnavailableError, match="another process uses the same identity"
            ):
                async with open_peer(
                    "10.0.0.2:4000", [a.address], SHARED, network=net.interface("10.0.0.2")
                ):
                    pass  # pragma: no cover - never entered
            with pytest.raises(DuplicateIdentityError):
                async with open_peer(
                    "10.0.0.3:4001", identity=SHARED, network=net.interface("10.0.0.3")
                ) as b:
                    await b.rpc.connect(Address.parse(a.address))
    assert "another process uses the same identity" in caplog.text


async def test_twins_in_one_round_the_loser_stays_out_and_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(60):
        async with (
            _peer(net, "10.0.0.1:4000", OTHER) as n,
            _peer(net, "10.0.0.2:4000", SHARED, via=n) as t1,
            _peer(net, "10.0.0.3:4000", SHARED, via=n) as t2,
        ):
            values = {n: 1.0, t1: 2.0, t2: 4.0}
            tensors = {node: np.full(16, v, np.float32) for node, v in values.items()}
            averagers = [
                Averager(node, "twins/grads", [tensors[node]], config=fast_config())
                for node in values
            ]
            infos: dict[int, AveragingInfo] = {}

            async def step(i: int) -> None:
                infos[i] = await averagers[i].step(timeout=20.0)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(step, i)
    twin_infos = [infos[1], infos[2]]
    out = [
        info
        for info in twin_infos
        if "another process declared under this peer's PeerID" in info.note
    ]
    assert len(out) == 1, [str(i) for i in infos.values()]
    assert out[0].outcome is Outcome.UNCONFIRMED
    loser = tensors[t1] if out[0] is infos[1] else tensors[t2]
    assert np.all(loser == (2.0 if out[0] is infos[1] else 4.0))  # untouched
    # the normal peer and the winning twin averaged each other, and only each other
    winner_value = 4.0 if out[0] is infos[1] else 2.0
    assert infos[0].averaged_fraction == 1.0 and len(infos[0].group) == 2
    assert np.allclose(tensors[n], (1.0 + winner_value) / 2)


async def test_a_twin_that_joins_through_others_is_found_and_both_are_told(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A trial's second process with a copied key file joined through a bootstrap node
    (not through its twin): neither DHT noticed, the second process's steps said "nobody
    declared" while three peers averaged, and healthy peers' rounds went partial. Its
    join's lookup of its own id is answered with our PeerID at the twin's address: it
    dials that, the handshake proves the twin, and both twins' reports say so."""
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(60):
        async with (
            _peer(net, "10.0.0.1:4000", OTHER) as n,
            _peer(net, "10.0.0.2:4000", SHARED, via=n) as t1,
        ):
            assert t1.rpc.twin is None and n.rpc.twin is None
            async with _peer(net, "10.0.0.3:4000", SHARED, via=n) as t2:
                await trio.sleep(3.0)  # the check runs in the background (a second of it
                # waits for an echo of our own dial: see RpcHost._came_back)
                assert t2.rpc.twin is not None and t2.rpc.twin[0] == "10.0.0.2:4000"
                assert t1.rpc.twin is not None and t1.rpc.twin[0] == "10.0.0.3 (it dialed us)"
                assert n.rpc.twin is None
                averager = Averager(t2, "twins/x", [np.ones(4, np.float32)], config=fast_config())
                info = await averager.step(timeout=10.0)
    assert "another process uses this peer's identity (seen at 10.0.0.2:4000" in info.note
    assert caplog.text.count("another process uses the same identity") == 2  # once each


async def test_our_own_old_address_is_no_twin(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Our PeerID named at an old address of ours (the process before a restart on
    another port, gone; a node that has not noticed yet still names it) is no other
    process: the check's dial finds nobody there, and nothing is said."""
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(60):
        async with _peer(net, "10.0.0.1:4000", OTHER) as n:
            async with _peer(net, "10.0.0.2:4000", SHARED, via=n):
                pass
            async with _peer(net, "10.0.0.2:4001", SHARED, via=n) as again:
                again.dht._check_twin(NodeInfo(SHARED.peer_id, "10.0.0.2:4000"))
                again.dht._check_twin(NodeInfo(SHARED.peer_id, "10.0.0.2:4001"))  # ours
                await trio.sleep(5.0)
                assert list(again.dht._twin_checks) == ["10.0.0.2:4000"]  # it did look
                assert again.rpc.twin is None
    assert "same identity" not in caplog.text


async def test_our_own_address_under_another_name_is_no_twin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node dialing itself as ``localhost:PORT`` while it listens on 127.0.0.1 (its
    own address among the initial peers, under another name) met its own PeerID there and
    warned of another process with its key; it is this very node, and says nothing."""
    with trio.fail_after(30):
        async with open_peer("127.0.0.1:0") as node:
            port = Address.parse(node.address).port
            with pytest.raises(SelfDialError, match="under another name"):
                await node.rpc.connect(Address.parse(f"localhost:{port}"))
            assert node.rpc.twin is None
    assert "same identity" not in caplog.text
