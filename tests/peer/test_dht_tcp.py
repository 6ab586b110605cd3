"""Dozens of DHT peers on real loopback TCP in one process."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

import pytest
import trio

from peer.node import Peer, open_peer
from protocol.identity import Identity
from protocol.messages import Entry
from protocol.records import (
    MAX_VALUE_BYTES,
    RecordError,
    RecordTooLargeError,
    check_key,
    owned_key,
    sign_entry,
)

N_PEERS = 50
N_KEYS = 50


async def _run_peer(index: int, initial: list[str], *, task_status: trio.TaskStatus[Peer]) -> None:
    identity = Identity.from_seed((1000 + index).to_bytes(32, "big"))
    async with open_peer("127.0.0.1:0", initial, identity=identity) as node:
        task_status.started(node)
        await trio.sleep_forever()


@pytest.mark.slow
async def test_50_tcp_peers_store_get_and_reject_forgeries() -> None:
    rng = random.Random(50)
    started = time.perf_counter()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            first: Peer = await nursery.start(_run_peer, 0, [])
            peers = [first]
            for index in range(1, N_PEERS):
                peers.append(await nursery.start(_run_peer, index, [first.address]))
            joined = time.perf_counter()

            # plain values: stored from one random peer, found from another
            for i in range(N_KEYS):
                assert await rng.choice(peers).dht.store(f"tcp/{i}", {"i": i}, ttl=60.0)
            for i in range(N_KEYS):
                assert await rng.choice(peers).dht.get(f"tcp/{i}") == {"i": i}

            # an owner-bound subkey, then forgeries of it by another peer
            alice, mallory = peers[3], peers[4]
            subkey = str(alice.peer_id)
            assert await alice.dht.store("tcp/owned", "alice's", ttl=60.0, subkey=subkey)
            with pytest.raises(RecordError, match="owned by"):
                await mallory.dht.store("tcp/owned", "mallory's", ttl=60.0, subkey=subkey)

            key = check_key("tcp/owned")
            expiration = mallory.dht.now() + 120.0
            own = sign_entry(mallory.identity, key, str(mallory.peer_id), b"\xa1m", expiration)
            forged_by_mallory = replace(own, subkey=subkey)  # Mallory's key, Alice's subkey
            real = (await alice.dht.get_entries("tcp/owned"))[subkey]
            alice_entry = sign_entry(alice.identity, key, subkey, b"\xa1a", real[1])
            replayed = replace(alice_entry, value=b"\xa1m", expiration=expiration)  # old sig
            unsigned = Entry(subkey, b"\xa1m", expiration)
            holders = (await mallory.dht.find_nodes(key)).closest
            assert len(holders) == 20
            for forged in (forged_by_mallory, replayed, unsigned):
                for holder in holders:
                    response = await mallory.dht.protocol.store(holder, key, "tcp/owned", (forged,))
                    assert response is not None and response.accepted == (False,)
            for node in rng.sample(peers, 5):
                assert await node.dht.get("tcp/owned") == {subkey: "alice's"}

            # a key marked owned by Alice: any subkey, only her signature
            owned = owned_key("tcp/state", alice.peer_id)
            assert await alice.dht.store(owned, {"step": 1}, ttl=60.0)
            with pytest.raises(RecordError, match="key is owned by"):
                await mallory.dht.store(owned, {"step": 666}, ttl=60.0)
            owned_id = check_key(owned)
            expiration = mallory.dht.now() + 120.0
            by_mallory = sign_entry(mallory.identity, owned_id, None, b"\x01", expiration)
            for forged in (by_mallory, Entry(None, b"\x01", expiration)):
                for holder in (await mallory.dht.find_nodes(owned_id)).closest:
                    response = await mallory.dht.protocol.store(holder, owned_id, owned, (forged,))
                    assert response is not None and response.accepted == (False,)
            for node in rng.sample(peers, 5):
                assert await node.dht.get(owned) == {"step": 1}

            # oversized values are refused at the caller, with a clear ValueError
            with pytest.raises(RecordTooLargeError, match="MAX_VALUE_BYTES") as info:
                await first.dht.store("tcp/big", b"x" * (MAX_VALUE_BYTES + 1))
            assert isinstance(info.value, ValueError)
            with pytest.raises(ValueError, match="MAX_KEY_BYTES"):
                await first.dht.get("k" * 10_000)
            # so are values msgpack cannot carry, and bad ttls
            for bad in (object(), 2**70, {"a": {1, 2}}, {(1, 2): 3}):  # a tuple key: no read
                with pytest.raises(TypeError, match="msgpack-serializable"):
                    await first.dht.store("tcp/bad", bad)
            with pytest.raises(TypeError, match="a tuple key is sent as a list"):
                await first.dht.store("tcp/bad", {(1, 2): 3})
            with pytest.raises(ValueError, match="ttl"):
                await first.dht.store("tcp/bad", 1, ttl=0)
            with pytest.raises(TypeError, match="ttl must be a number"):
                await first.dht.store("tcp/bad", 1, ttl="60")  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()
    print(
        f"\n{N_PEERS} TCP peers joined in {joined - started:.1f} s; {N_KEYS} stores and gets "
        f"plus forgeries in {time.perf_counter() - joined:.1f} s"
    )


async def test_a_peer_that_exits_cleanly_is_logged_as_gone_not_silent() -> None:
    """A volunteer that stopped (its port closed) was logged "peer left: X (no answer to a
    ping)", as if frozen: every `make demo` printed it for each volunteer (two trials)."""
    lines: list[str] = []
    left = trio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("peer left: "):
                lines.append(record.getMessage())
                left.set()

    logger = logging.getLogger("peer.dht")
    watch, level = Watch(), logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.INFO)
    try:
        with trio.fail_after(30):
            async with open_peer() as first:
                async with open_peer(initial_peers=[first.address]) as second:
                    gone = second.peer_id.short()
                await left.wait()
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
    assert lines == [f"peer left: {gone} (its address no longer takes connections)"]
