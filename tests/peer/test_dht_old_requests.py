"""A DHT request that does not parse is ``bad_request`` and is said once at WARNING, naming
its sender: a mixed-versions trial's peer of two days before joined, was listed by
``swarm status``, and had every store and get refused, which only DEBUG showed on either
side."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from peer import RemoteError
from peer.memnet import MemoryNetwork
from peer.node import open_peer

OLD_STORE = {"t": "dht.store.req", "sender": None, "key": b"k" * 32, "entries": []}


async def test_an_unparsable_dht_request_is_refused_and_its_sender_named_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    net = MemoryNetwork()
    with trio.fail_after(120), caplog.at_level(logging.WARNING, logger="peer.dht.protocol"):
        async with (
            open_peer("10.0.0.1:1000", network=net.interface("10.0.0.1")) as node,
            open_peer(
                None, [node.address], client_mode=True, network=net.interface("10.0.0.2")
            ) as old,
            open_peer(
                None, [node.address], client_mode=True, network=net.interface("10.0.0.3")
            ) as other,
        ):
            for _ in range(3):
                with pytest.raises(RemoteError) as error:
                    await old.rpc.call(node.address, "dht.store", OLD_STORE)
                assert error.value.code == "bad_request"
            [line] = [r.getMessage() for r in caplog.records]
            assert f"peer {old.peer_id.short()} at 10.0.0.2 sent a dht.store" in line
            assert "another version of swarm" in line and "faulty peer?" in line
            # another sender within the minute: not named (a crowd sending garbage
            # cannot flood the log); after it, it is
            with pytest.raises(RemoteError):
                await other.rpc.call(node.address, "dht.store", OLD_STORE)
            assert len(caplog.records) == 1
            await trio.sleep(61.0)
            with pytest.raises(RemoteError):
                await other.rpc.call(node.address, "dht.store", OLD_STORE)
            assert len(caplog.records) == 2
            assert other.peer_id.short() in caplog.records[1].getMessage()
            # the node serves everyone as before
            assert await other.dht.store("k", 1, ttl=30.0)
            assert await old.dht.get("k") == 1
