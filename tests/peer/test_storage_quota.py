"""The per-source storage quota: one host holds at most a share of a node's keys and bytes.

Unit tests check the accounting on an injected clock through every way an entry leaves
or changes hands; a memory-network test checks that one host's junk leaves room for an
honest peer's store.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import msgpack
import pytest
import trio
import trio.testing

from peer.dht import DHTConfig
from peer.dht.storage import ENTRY_OVERHEAD, SUBKEY_SHARE_PER_SOURCE, DHTStorage
from peer.memnet import MemoryNetwork
from peer.node import Peer, PeerConfig, open_peer
from protocol.address import Address
from protocol.dhtid import DHTID
from protocol.identity import Identity
from protocol.messages import Entry, NodeInfo
from protocol.records import check_key

EVE, BOB = "10.6.6.6", "10.0.0.2"
KEY = DHTID.from_key("run/quota")
EPOCH = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = EPOCH) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(i: int) -> DHTID:
    return DHTID.from_key(f"k{i}")


def value(size: int) -> bytes:
    """A stored value of exactly ``size`` bytes (its msgpack form)."""
    packed: bytes = msgpack.packb(bytes(size - 2), use_bin_type=True)
    assert len(packed) == size
    return packed


def cost(size: int) -> int:
    return size + ENTRY_OVERHEAD


def check_accounting(storage: DHTStorage) -> None:
    """The counters equal what a recount of the held entries gives."""
    held = [(k, e) for k, record in storage._records.items() for e in record.values()]
    assert storage.num_entries == len(held)
    assert storage.num_bytes == sum(cost(len(e.value)) for _, e in held)
    keys: dict[str, int] = {}
    num_bytes: dict[str, int] = {}
    for k, sources in storage._sources.items():
        assert sources and set(sources) <= set(storage._records[k])  # held entries only
        for subkey, source in sources.items():
            size = len(storage._records[k][subkey].value)
            num_bytes[source] = num_bytes.get(source, 0) + cost(size)
        for source in set(sources.values()):
            keys[source] = keys.get(source, 0) + 1
    assert storage._keys_by_source == keys and storage._bytes_by_source == num_bytes
    subkeys = {k: Counter(sources.values()) for k, sources in storage._sources.items()}
    assert storage._subkeys_by_source == subkeys
    assert all(sum(c.values()) <= storage.max_subkeys_per_key for c in subkeys.values())
    assert all(n <= storage.max_keys_per_source for n in keys.values())
    assert all(n <= storage.max_bytes_per_source for n in num_bytes.values())


def test_one_host_holds_at_most_its_share_of_the_keys() -> None:
    clock = Clock()
    storage = DHTStorage(clock=clock, max_keys=16)  # 1/8 by default: 2 keys per host
    expiration = clock.now + 60
    assert storage.store(key(0), Entry(None, b"\x01", expiration), source=EVE)
    assert storage.store(key(1), Entry(None, b"\x01", expiration), source=EVE)
    assert not storage.store(key(2), Entry(None, b"\x01", expiration), source=EVE)
    # more subkeys under a key it holds take no new key; other hosts and our own stores
    # are not charged to it
    assert storage.store(key(1), Entry("b", b"\x01", expiration), source=EVE)
    assert storage.store(key(2), Entry(None, b"\x01", expiration), source=BOB)
    assert storage.store(key(3), Entry(None, b"\x01", expiration))
    # a key another source opened counts for eve once she holds an entry in it
    assert not storage.store(key(2), Entry("e", b"\x01", expiration), source=EVE)
    assert storage.held_by(EVE) == (2, 3 * cost(1)) and storage.held_by(BOB) == (1, cost(1))
    assert len(storage) == 4
    check_accounting(storage)


def test_one_host_holds_at_most_its_share_of_the_bytes() -> None:
    clock = Clock()
    storage = DHTStorage(clock=clock, max_bytes=8 * (3 * cost(100)))  # 3 entries per host
    expiration = clock.now + 60
    for subkey in "abc":
        assert storage.store(KEY, Entry(subkey, value(100), expiration), source=EVE)
    assert not storage.store(KEY, Entry("d", value(100), expiration), source=EVE)
    assert not storage.store(KEY, Entry("a", value(101), expiration + 1), source=EVE)
    # at its quota, a host still replaces its own entries with newer ones of the same size
    assert storage.store(KEY, Entry("a", value(100), expiration + 1), source=EVE)
    assert storage.store(KEY, Entry("d", value(100), expiration), source=BOB)
    assert storage.held_by(EVE) == (1, 3 * cost(100)) == (1, storage.max_bytes_per_source)
    check_accounting(storage)


def test_accounting_through_replace_expire_evict_and_refusal() -> None:
    clock = Clock()
    storage = DHTStorage(clock=clock, max_subkeys_per_key=2, subkey_share_per_source=1.0)
    now = clock.now
    assert storage.store(KEY, Entry("a", value(10), now + 10), source=EVE)
    assert storage.store(KEY, Entry("b", value(20), now + 20), source=EVE)
    assert storage.held_by(EVE) == (1, cost(10) + cost(20))
    # replaced by a newer version from another host: charged to that one now
    assert storage.store(KEY, Entry("b", value(30), now + 25), source=BOB)
    assert storage.held_by(EVE) == (1, cost(10)) and storage.held_by(BOB) == (1, cost(30))
    # an identical entry stored again by another host changes nothing
    assert storage.store(KEY, Entry("b", value(30), now + 25), source=EVE)
    assert storage.held_by(EVE) == (1, cost(10)) and storage.held_by(BOB) == (1, cost(30))
    # dropped from a full dictionary (the soonest-expiring, eve's "a") for bob's newcomer
    assert storage.store(KEY, Entry("c", value(40), now + 30), source=BOB)
    assert storage.held_by(EVE) == (0, 0) and storage.held_by(BOB) == (1, cost(30) + cost(40))
    assert set(storage.get(KEY)) == {"b", "c"}
    # refused (older than what is held; a full dictionary that outlives it): no change
    assert not storage.store(KEY, Entry("b", value(50), now + 5), source=EVE)
    assert not storage.store(KEY, Entry("d", value(50), now + 5), source=EVE)
    assert storage.held_by(EVE) == (0, 0) and storage.held_by(BOB) == (1, cost(30) + cost(40))
    # replaced by this node's own store: bob is refunded, nobody charged
    assert storage.store(KEY, Entry("c", value(60), now + 35))
    assert storage.held_by(BOB) == (1, cost(30)) and storage.num_bytes == cost(30) + cost(60)
    check_accounting(storage)
    clock.now += 25  # bob's "b" expires
    assert storage.expire() == 1
    assert storage.held_by(BOB) == (0, 0) and storage._sources == {}
    check_accounting(storage)
    clock.now += 10
    assert storage.expire() == 1 and len(storage) == 0 and storage.num_bytes == 0
    check_accounting(storage)


def test_random_stores_keep_the_accounting_exact() -> None:
    """Stores of random keys, subkeys, sizes and expirations from three hosts and from the
    node itself, with the clock moving on: the counters always equal a recount, and no host
    holds more than its quota."""
    rng = random.Random(7)
    clock = Clock()
    storage = DHTStorage(
        clock=clock, max_keys=24, max_bytes=24 * cost(60), max_subkeys_per_key=3
    )  # 3 keys and 3 * cost(60) bytes per host
    sources: Sequence[str | None] = (EVE, BOB, "10.0.0.3", None)
    outcomes = {True: 0, False: 0}
    for step in range(3000):
        entry = Entry(
            rng.choice(["a", "b", "c", "d", None]),
            value(rng.randrange(2, 120)),
            clock.now + rng.randrange(1, 40),
        )
        outcomes[storage.store(key(rng.randrange(10)), entry, source=rng.choice(sources))] += 1
        if step % 7 == 0:
            clock.now += rng.random() * 3
        check_accounting(storage)
    assert min(outcomes.values()) > 300  # both outcomes well exercised
    clock.now += 40
    storage.expire()
    assert storage.num_bytes == storage.num_entries == len(storage) == 0
    assert storage._sources == storage._keys_by_source == storage._bytes_by_source == {}


def test_the_share_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="max_share_per_source"):
        DHTStorage(max_share_per_source=0)
    with pytest.raises(ValueError, match="max_stored_share_per_host"):
        DHTConfig(max_stored_share_per_host=1.5)


# ---- on the memory network --------------------------------------------------------------


async def _run_peer(
    net: MemoryNetwork,
    host: str,
    seed: int,
    initial_peers: Sequence[str],
    config: PeerConfig,
    *,
    task_status: trio.TaskStatus[Peer],
) -> None:
    async with open_peer(
        listen=f"{host}:0",
        initial_peers=initial_peers,
        identity=Identity.from_seed(seed.to_bytes(32, "big")),
        network=net.interface(host),
        config=config,
        clock=lambda: EPOCH + trio.current_time(),
    ) as peer:
        task_status.started(peer)
        await trio.sleep_forever()


@pytest.mark.parametrize(
    ("junk_host", "quota_loopback", "junk_held"),
    [
        (EVE, False, 5),  # one host: its share only
        ("127.6.6.6", False, 40),  # loopback (local experiments): exempt by default
        ("127.6.6.6", True, 5),
    ],
)
async def test_one_host_filling_a_node_leaves_room_for_an_honest_store(
    autojump_clock: trio.testing.MockClock, junk_host: str, quota_loopback: bool, junk_held: int
) -> None:
    """Three identities on one host send a node 40 keys of junk, the most it holds (5 are
    one host's share); an honest peer's store then still finds room there."""
    net = MemoryNetwork(latency=0.01)
    dht = DHTConfig(max_stored_keys=40, storage_quota_loopback=quota_loopback)
    config = PeerConfig(dht=dht)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            node: Peer = await nursery.start(_run_peer, net, "10.0.0.1", 1, [], config)
            junk: list[Peer] = [
                await nursery.start(_run_peer, net, junk_host, 10 + i, [node.address], config)
                for i in range(3)
            ]
            honest: Peer = await nursery.start(_run_peer, net, BOB, 2, [node.address], config)
            target = NodeInfo(node.peer_id, Address.parse(node.address).hostport)
            expiration = EPOCH + trio.current_time() + 3600
            accepted = 0
            for i in range(40):
                name = f"junk/{i}"
                entries = (Entry(None, value(100), expiration),)
                sender = junk[i % len(junk)].dht.protocol
                reply = await sender.store(target, check_key(name), name, entries, want_nodes=False)
                assert reply is not None  # refused, not failed: the reply says not stored
                accepted += sum(reply.accepted)
            storage = node.dht.storage
            assert storage is not None
            assert accepted == junk_held == len(storage)
            assert await honest.dht.store("honest/key", "hello", ttl=600.0)
            held_there = bool(storage.get(check_key("honest/key")))
            assert held_there == (junk_held < 40)  # a full node refuses it
            if held_there:
                assert storage.held_by(BOB)[0] == 1
            nursery.cancel_scope.cancel()


def test_one_host_cannot_take_a_shared_key_from_its_other_writers() -> None:
    """A full dictionary makes room for a newcomer that outlives its soonest-expiring
    entry: one host storing long ttls under a shared key (a matchmaking round) pushed
    every other writer's short-lived entries out. A host holds at most a quarter of a
    key's subkeys now (``SUBKEY_SHARE_PER_SOURCE``); its own it may still replace."""
    clock = Clock()
    storage = DHTStorage(clock=clock, max_subkeys_per_key=8)
    assert storage.max_subkeys_per_source == 8 * SUBKEY_SHARE_PER_SOURCE == 2
    honest = [f"10.0.1.{i}" for i in range(6)]
    for i, host in enumerate(honest):  # short-lived declarations
        assert storage.store(KEY, Entry(f"peer{i}", value(10), clock.now + 5), source=host)
    week = clock.now + 7 * 24 * 3600
    assert storage.store(KEY, Entry("junk0", value(10), week), source=EVE)
    assert storage.store(KEY, Entry("junk1", value(10), week), source=EVE)  # key full now
    for n in range(2, 10):  # each would push an honest entry out
        assert not storage.store(KEY, Entry(f"junk{n}", value(10), week), source=EVE)
    assert storage.store(KEY, Entry("junk0", value(11), week + 1), source=EVE)  # its own
    assert len([s for s in storage.get(KEY) if str(s).startswith("peer")]) == 6
    check_accounting(storage)
    # an honest host's own newer declaration still replaces its old one
    assert storage.store(KEY, Entry("peer0", value(10), clock.now + 9), source=honest[0])
    check_accounting(storage)


def test_while_there_is_room_a_host_may_write_beyond_its_share_and_then_gives_way() -> None:
    """A node handing a large dictionary over to a newcomer, or hundreds of peers behind
    one NAT declaring in one round, write far more than a quarter of a key's subkeys from
    one host: all of it is kept while there is room. Once the dictionary is full, what a
    host holds beyond its share gives way to any other writer, whatever the expirations
    (else week-long entries written while the key was empty would lock everyone out)."""
    clock = Clock()
    storage = DHTStorage(clock=clock, max_subkeys_per_key=8)
    week = clock.now + 7 * 24 * 3600
    for n in range(8):
        assert storage.store(KEY, Entry(f"junk{n}", value(10), week + n), source=EVE)
    assert len(storage.get(KEY)) == 8  # the whole dictionary, from one host
    check_accounting(storage)
    for i in range(6):  # short-lived declarations, each taking the place of eve's soonest
        host = f"10.0.1.{i}"
        assert storage.store(KEY, Entry(f"peer{i}", value(10), clock.now + 5), source=host)
        assert f"junk{i}" not in storage.get(KEY)
        check_accounting(storage)
    assert sorted(str(s) for s in storage.get(KEY) if str(s).startswith("junk")) == [
        "junk6",
        "junk7",
    ]  # eve is down to her share: the next writer must outlive the soonest entry
    assert not storage.store(KEY, Entry("late", value(10), clock.now + 1), source=BOB)
    assert storage.store(KEY, Entry("later", value(10), clock.now + 60), source=BOB)
    assert "peer0" not in storage.get(KEY)  # the soonest-expiring made room
    # at her share, eve's new subkeys only take the place of her own entries
    honest = {s for s in storage.get(KEY) if not str(s).startswith("junk")}
    assert storage.store(KEY, Entry("junk8", value(10), week + 99), source=EVE)
    assert not storage.store(KEY, Entry("junk9", value(10), week + 1), source=EVE)
    assert {s for s in storage.get(KEY) if str(s).startswith("junk")} == {"junk7", "junk8"}
    assert {s for s in storage.get(KEY) if not str(s).startswith("junk")} == honest
    check_accounting(storage)


def test_our_own_store_takes_room_from_a_host_beyond_its_share() -> None:
    clock = Clock()
    storage = DHTStorage(clock=clock, max_subkeys_per_key=4)
    for n in range(4):
        assert storage.store(KEY, Entry(f"junk{n}", value(10), clock.now + 100 + n), source=EVE)
    assert storage.store(KEY, Entry("mine", value(10), clock.now + 5))  # no source: this node
    assert "junk0" not in storage.get(KEY) and "mine" in storage.get(KEY)
    check_accounting(storage)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"k": 65}, "DHTConfig.k must be at most 64"),
        (
            {"max_republished_records": 0},
            "max_republished_records must be an integer of at least 1",
        ),
        ({"alpha": 0}, "DHTConfig.alpha must be an integer of at least 1, got 0"),
        ({"k": 2.5}, "DHTConfig.k must be an integer"),
        ({"max_stored_keys": True}, "DHTConfig.max_stored_keys must be an integer"),
        ({"request_timeout": 0}, "DHTConfig.request_timeout must be positive seconds, got 0"),
        ({"hedge_after": float("nan")}, "DHTConfig.hedge_after must be positive"),
        ({"republish_margin": -1.0}, "DHTConfig.republish_margin must be seconds >= 0"),
        ({"max_stored_bytes": 100_000}, "must hold one largest entry"),
        ({"max_stored_bytes": 1 << 20, "max_stored_share_per_host": 0.01}, "largest entry"),
        # an outside tester: "'>' not supported between instances of 'str' and 'int'"
        ({"request_timeout": "3"}, "DHTConfig.request_timeout must be a number, got '3'"),
        ({"client_mode": "yes"}, "DHTConfig.client_mode must be True or False"),
    ],
)
def test_dht_settings_that_cannot_work_are_refused(changes: dict[str, int], message: str) -> None:
    """Each was taken and failed quietly: k = 80 made every reply that names the k closest
    overflow a reply's 64 nodes (peers that joined later knew one other); no republish
    list; a per-host share too small for one 16 KiB value from another host. Each error
    names its field (an outside trial: "timeouts and intervals must be positive" named
    none, and NaN timeouts passed)."""
    with pytest.raises(ValueError, match=message):
        DHTConfig(**changes)  # type: ignore[arg-type]
    assert DHTConfig(k=64).k == 64
    assert DHTConfig(max_stored_bytes=8 << 20).max_stored_bytes == 8 << 20  # the bootstrap's
