"""What a get makes of its holders' copies when some are hostile (a review, three repros):
a copy of 1024 long-lived junk subkeys, from a liar or from a flooder's stores at each
holder, pushed every honest subkey out of the getter's merge (capped at a key's 1024); and
a reply of invalid entries only counted as a holder toward the quorum, so three nodes near
an owned key hid the owner's signed value. Now the merge keeps the subkeys most holders
agree on, and a holder is one that sent a valid entry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import msgpack
import pytest
import trio
import trio.testing

from peer import Peer, Reply, Request
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from protocol.dhtid import DHTID
from protocol.identity import Identity
from protocol.messages import Entry, FindValueRequest, FindValueResponse, NodeInfo
from protocol.records import MAX_SUBKEYS_PER_KEY, MAX_TTL, owned_key, sign_entry

EPOCH = 1_700_000_000.0


def clock() -> float:
    return EPOCH + trio.current_time()


@asynccontextmanager
async def swarm(seeds: Sequence[int], client: int | None = None) -> AsyncIterator[list[Peer]]:
    """Peers of identities from ``seeds``, each joining through the first (and a client-mode
    one of seed ``client``, last)."""
    net = MemoryNetwork(latency=0.01)
    async with AsyncExitStack() as stack:
        peers: list[Peer] = []
        for i, seed in enumerate([*seeds, *([client] if client is not None else [])]):
            host = f"10.0.{seed // 250}.{seed % 250 + 1}"
            is_client = client is not None and i == len(seeds)
            peers.append(
                await stack.enter_async_context(
                    open_peer(
                        None if is_client else f"{host}:1",
                        [peers[0].address] if peers else [],
                        identity=Identity.from_seed(seed.to_bytes(32, "big")),
                        client_mode=is_client,
                        network=net.interface(host),
                        clock=clock,
                    )
                )
            )
        yield peers


def junk(first: int) -> tuple[Entry, ...]:
    """A key's worth of unsigned subkeys that outlive any honest declaration."""
    far = clock() + MAX_TTL
    return tuple(
        Entry(first + i, msgpack.packb(0), far - i * 1e-3) for i in range(MAX_SUBKEYS_PER_KEY)
    )


def lying_closest(peers: Sequence[Peer], hostile: Peer) -> str:
    """A key whose closest node of all is ``hostile``, which from now on answers every
    FIND_VALUE with a key's worth of junk."""
    ids = {p.peer_id: DHTID.from_peer_id(p.peer_id) for p in peers}
    key = next(
        k
        for k in (f"round/{n}" for n in range(10_000))
        if min(ids, key=lambda p: ids[p] ^ DHTID.from_key(k)) == hostile.peer_id
    )

    def lying_find_value(request: Request) -> Reply:
        FindValueRequest.from_body(request.body)
        return Reply(FindValueResponse(junk(0), ()).to_body())

    hostile.rpc.unregister("dht.find_value")
    hostile.rpc.register_quick("dht.find_value", lying_find_value)
    return key


async def store_declarations(key: str, writers: Sequence[Peer]) -> set[str]:
    for p in writers:  # each writer its own, signed, owner-bound subkey
        assert await p.dht.store(key, {"me": str(p.peer_id)}, ttl=60.0, subkey=str(p.peer_id))
    return {str(p.peer_id) for p in writers}


async def test_a_liars_full_copy_does_not_push_honest_subkeys_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with swarm([*range(1, 7), 9]) as peers:
            honest, hostile = peers[:6], peers[6]
            key = lying_closest(peers, hostile)  # the liar answers first
            writers = await store_declarations(key, honest)
            result = await honest[-1].dht.get(key)
            assert writers <= set(result), len(writers & set(result))
            assert len(result) == MAX_SUBKEYS_PER_KEY


async def test_a_flooders_different_copies_do_not_push_honest_subkeys_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with swarm([*range(1, 7), 9]) as peers:
            honest, hostile = peers[:6], peers[6]
            key, kid = "round/1", DHTID.from_key("round/1")
            # filled by hand at each holder while there was room (allowed), other junk at each
            for j, p in enumerate(honest):
                assert p.rpc.listen_address is not None
                target = NodeInfo(p.peer_id, p.rpc.listen_address.hostport)
                entries = junk(j * 10_000)
                for s in range(0, len(entries), 64):
                    reply = await hostile.dht.protocol.store(
                        target, kid, key, entries[s : s + 64], want_nodes=False
                    )
                    assert reply is not None and all(reply.accepted)
            writers = await store_declarations(key, honest)
            result = await honest[-1].dht.get(key)
            assert writers <= set(result), len(writers & set(result))


async def test_replies_of_invalid_entries_are_no_holders(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        owner_key = owned_key("cfg", Identity.from_seed((1).to_bytes(32, "big")).peer_id)
        kid = DHTID.from_key(owner_key)
        # three identities that share the key's first 8 bits (~256 tries each)
        near = [
            s
            for s in range(100, 100_000)
            if (
                int(DHTID.from_peer_id(Identity.from_seed(s.to_bytes(32, "big")).peer_id))
                ^ int(kid)
            )
            >> 248
            == 0
        ][:3]
        async with swarm([*range(1, 8), *near], client=30) as peers:
            owner, hostile, getter = peers[0], peers[7:10], peers[10]
            assert await owner.dht.store(owner_key, {"lr": 0.1}, ttl=120.0)
            forge = [False]

            def find_value(request: Request) -> Reply:
                FindValueRequest.from_body(request.body)
                # one unsigned entry: invalid under an owned key
                entries = (Entry(None, msgpack.packb("x"), clock() + 60.0),) if forge[0] else None
                return Reply(FindValueResponse(entries, ()).to_body())

            for h in hostile:
                h.rpc.unregister("dht.find_value")
                h.rpc.register_quick("dht.find_value", find_value)
            assert await getter.dht.get(owner_key) == {"lr": 0.1}  # "nothing here": no harm
            forge[0] = True
            assert await getter.dht.get(owner_key) == {"lr": 0.1}


@pytest.mark.parametrize("newer_at_getter", [False, True])
async def test_holders_of_older_versions_support_a_subkey_too(
    autojump_clock: trio.testing.MockClock, newer_at_getter: bool
) -> None:
    """A newer version of each declaration (as matchmaking's done marker) reached only the
    getter, whose own copy is merged first: the other holders' older versions counted for
    nothing, every honest subkey had the liar's junk's support, 1, and lost to its later
    expiration (a review). Any valid version of a subkey counts for its holder."""
    with trio.fail_after(300):
        async with swarm([*range(1, 7), 9]) as peers:
            honest, hostile = peers[:6], peers[6]
            key = lying_closest(peers, hostile)
            kid = DHTID.from_key(key)
            writers = await store_declarations(key, honest)  # version 1 at every holder
            getter = honest[-1]
            targets = [getter] if newer_at_getter else honest[:-1]
            for p in honest:  # version 2 of each, at the targets only
                entry = sign_entry(
                    p.identity, kid, str(p.peer_id), msgpack.packb({"done": True}), clock() + 90
                )
                for target in targets:
                    if target is p:
                        assert p.dht.storage is not None
                        assert p.dht.storage.store(kid, entry, name=key)
                        continue
                    assert target.rpc.listen_address is not None
                    info = NodeInfo(target.peer_id, target.rpc.listen_address.hostport)
                    reply = await p.dht.protocol.store(info, kid, key, (entry,), want_nodes=False)
                    assert reply is not None and all(reply.accepted)
            result = await getter.dht.get(key)
            assert writers <= set(result), len(writers & set(result))
