"""The local value store: merge rules, expiry on an injected clock, signatures, limits."""

from __future__ import annotations

import msgpack
import pytest

from peer.dht.storage import ENTRY_OVERHEAD, DHTStorage, merge_entry
from protocol.dhtid import DHTID
from protocol.identity import Identity
from protocol.messages import Entry
from protocol.records import MAX_VALUE_BYTES, RecordError, RecordTooLargeError, sign_entry

KEY = DHTID.from_key("run/progress")
ALICE = Identity.from_seed(bytes([1]) * 32)
MALLORY = Identity.from_seed(bytes([2]) * 32)


def v(value: object) -> bytes:
    """A value as stored: its msgpack form."""
    return msgpack.packb(value, use_bin_type=True)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def storage(clock: Clock) -> DHTStorage:
    return DHTStorage(clock=clock)


def test_store_get_and_expire_on_the_injected_clock(storage: DHTStorage, clock: Clock) -> None:
    entry = Entry(None, b"\x01", clock.now + 10)
    assert storage.store(KEY, entry)
    assert storage.get(KEY) == {None: entry}
    clock.now += 9.9
    assert storage.get(KEY) == {None: entry}
    clock.now += 0.1  # expiration <= now: gone
    assert storage.get(KEY) == {}
    assert storage.expire() == 1 and KEY not in storage and len(storage) == 0


def test_later_expiration_wins_and_older_replays_lose(storage: DHTStorage, clock: Clock) -> None:
    old = Entry("a", v("old"), clock.now + 10)
    new = Entry("a", v("new"), clock.now + 20)
    assert storage.store(KEY, new)
    assert not storage.store(KEY, old)  # a replay of an older version
    # same age, different: the smaller serialized value wins, on every node alike
    assert v("new") < v("other") and not storage.store(KEY, Entry("a", v("other"), clock.now + 20))
    assert storage.store(KEY, new)  # the same record again (a republish) is fine
    assert storage.get(KEY) == {"a": new}
    newest = Entry("a", v("newest"), clock.now + 30)
    assert storage.store(KEY, newest)
    assert storage.get(KEY) == {"a": newest}
    clock.now += 20.5  # the replaced versions' expiry must not remove the newest
    assert storage.expire() == 0 and storage.get(KEY) == {"a": newest}


def test_a_plain_value_is_one_subkey_among_the_others(clock: Clock) -> None:
    """No store pushes another subkey out: an unsigned plain value with a long ttl must not
    erase owner-bound entries (nor a subkey a plain value)."""
    record: dict = {}
    a, b = Entry("a", b"1", clock.now + 10), Entry("b", b"2", clock.now + 30)
    assert merge_entry(record, a) and merge_entry(record, b)
    plain = Entry(None, b"p", clock.now + 40)
    assert merge_entry(record, plain) and record == {"a": a, "b": b, None: plain}
    assert not merge_entry(record, Entry(None, b"q", clock.now + 20))  # older: refused
    c = Entry("c", b"3", clock.now + 5)
    assert merge_entry(record, c) and record[None] == plain and record["c"] == c


def test_full_dictionary_drops_soonest_expiring_for_a_longer_lived_newcomer(clock: Clock) -> None:
    storage = DHTStorage(clock=clock, max_subkeys_per_key=3)
    for i in range(3):
        assert storage.store(KEY, Entry(i, b"x", clock.now + 10 + i))
    assert not storage.store(KEY, Entry(9, b"x", clock.now + 5))
    assert storage.store(KEY, Entry(9, b"x", clock.now + 50))
    assert set(storage.get(KEY)) == {1, 2, 9}


def test_a_full_dictionary_keeps_its_entries_against_a_newcomer_that_expires_with_them(
    clock: Clock,
) -> None:
    """A full dictionary makes room only for a newcomer that outlives its soonest-expiring
    entry (docs/dht.md, "What a node stores for others"): one that expires at the same time
    is refused, in a lookup's merge of answers as in the store."""
    record: dict = {}
    for i in range(3):
        assert merge_entry(record, Entry(i, b"x", clock.now + 10 + i), max_subkeys=3)
    assert not merge_entry(record, Entry(9, b"x", clock.now + 10), max_subkeys=3)
    assert set(record) == {0, 1, 2}
    assert merge_entry(record, Entry(9, b"x", clock.now + 10.5), max_subkeys=3)
    assert set(record) == {1, 2, 9}
    storage = DHTStorage(clock=clock, max_subkeys_per_key=3)
    for i in range(3):
        assert storage.store(KEY, Entry(i, b"x", clock.now + 10 + i))
    assert not storage.store(KEY, Entry(9, b"x", clock.now + 10))
    assert set(storage.get(KEY)) == {0, 1, 2}


def test_expired_keys_leave_no_name_behind(storage: DHTStorage, clock: Clock) -> None:
    """The key texts kept for handover go with their keys: a node that sees many
    short-lived keys (a round key per averaging slot) must not grow without bound.
    ``name_of`` hides a leftover name (it asks whether the key lives), so this looks at
    the private map itself."""
    for i in range(50):
        name = f"run/round/{i}"
        assert storage.store(DHTID.from_key(name), Entry(None, b"x", clock.now + 5), name=name)
    assert storage.name_of(DHTID.from_key("run/round/7")) == "run/round/7"
    clock.now += 5
    assert storage.expire() == 50 and len(storage) == 0
    assert storage.name_of(DHTID.from_key("run/round/7")) is None
    assert len(storage._names) == 0


def test_storage_refuses_new_keys_when_full(clock: Clock) -> None:
    storage = DHTStorage(clock=clock, max_keys=2)
    for name in ("a", "b"):
        assert storage.store(DHTID.from_key(name), Entry(None, b"x", clock.now + 5))
    assert not storage.store(DHTID.from_key("c"), Entry(None, b"x", clock.now + 5))
    assert storage.store(DHTID.from_key("a"), Entry(None, b"y", clock.now + 6))  # known key: ok
    clock.now += 5.5  # the old keys expire: room again
    assert storage.store(DHTID.from_key("c"), Entry(None, b"x", clock.now + 5))


def test_storage_refuses_entries_beyond_its_byte_budget(clock: Clock) -> None:
    storage = DHTStorage(clock=clock, max_bytes=2 * ENTRY_OVERHEAD + 100)
    assert storage.store(KEY, Entry("a", v(bytes(58)), clock.now + 5))
    assert not storage.store(KEY, Entry("b", v(bytes(58)), clock.now + 5))
    assert storage.store(KEY, Entry("a", v(bytes(28)), clock.now + 6))  # replaces: 30 bytes held
    assert storage.num_bytes == ENTRY_OVERHEAD + 30
    assert storage.store(KEY, Entry("b", v(bytes(58)), clock.now + 5))
    clock.now += 5.5
    storage.expire()
    assert storage.num_bytes == ENTRY_OVERHEAD + 30 and set(storage.get(KEY)) == {"a"}


def test_tiny_values_count_their_overhead_toward_the_byte_budget(clock: Clock) -> None:
    """Regression: only value bytes counted, so 1-byte values under long subkeys held ~400
    times the budget (192,000 entries: +81 MiB RSS for 0.2 MB of "values")."""
    storage = DHTStorage(clock=clock, max_bytes=100 * (ENTRY_OVERHEAD + 1))
    subkeys = [f"{i:03d}".ljust(128, "x") for i in range(150)]
    accepted = [storage.store(KEY, Entry(s, v(0), clock.now + 60)) for s in subkeys]
    assert accepted == [True] * 100 + [False] * 50
    assert storage.num_bytes == storage.max_bytes and storage.num_entries == 100


def test_re_stores_and_updates_keep_the_expiry_heap_bounded(
    storage: DHTStorage, clock: Clock
) -> None:
    """Regression: each accepted store pushed an expiry item that stayed until its
    expiration (up to 7 days), so a peer re-storing one record grew the node without bound."""
    republished = Entry("a", v(1), clock.now + 86400)
    for _ in range(5000):  # what owners' republishes send: the identical entry
        assert storage.store(KEY, republished)
    for i in range(5000):  # updates, each with a later expiration
        assert storage.store(KEY, Entry("b", v(i), clock.now + 86400 + i))
    assert len(storage._expiry) <= 2 * 2 + 1024  # 10,000 before the fix
    assert storage.num_entries == 2
    clock.now += 86400 + 4998.5  # "a" and every version of "b" but the last expire
    assert storage.expire() == 1
    assert storage.get(KEY) == {"b": Entry("b", v(4999), clock.now + 0.5)}
    assert storage.num_entries == 1
    clock.now += 1
    assert storage.expire() == 1 and len(storage) == 0 and storage.num_entries == 0
    assert storage._expiry == []


def test_owner_bound_subkeys_need_the_owners_signature(storage: DHTStorage, clock: Clock) -> None:
    subkey = str(ALICE.peer_id)
    signed = sign_entry(ALICE, KEY, subkey, v("alice"), clock.now + 10)
    assert storage.store(KEY, signed)

    with pytest.raises(RecordError, match="unsigned"):
        storage.store(KEY, Entry(subkey, v("mallory"), clock.now + 20))
    forged = sign_entry(MALLORY, KEY, str(MALLORY.peer_id), v("mallory"), clock.now + 20)
    stolen = Entry(subkey, forged.value, forged.expiration, forged.owner_key, forged.signature)
    with pytest.raises(RecordError, match="another peer"):
        storage.store(KEY, stolen)
    assert signed.signature is not None and signed.owner_key is not None
    tampered = Entry(subkey, v("tampered"), signed.expiration, signed.owner_key, signed.signature)
    with pytest.raises(RecordError, match="signature"):
        storage.store(KEY, tampered)
    other_key = Entry(subkey, v("alice"), clock.now + 30, signed.owner_key, signed.signature)
    with pytest.raises(RecordError, match="signature"):
        storage.store(KEY, other_key)  # a signature does not carry over to a new expiration

    older = sign_entry(ALICE, KEY, subkey, v("alice-older"), clock.now + 5)
    assert not storage.store(KEY, older)  # validly signed but older: a replay
    assert storage.get(KEY) == {subkey: signed}


def test_expired_and_oversized_records_are_refused_clearly(
    storage: DHTStorage, clock: Clock
) -> None:
    with pytest.raises(RecordError, match="expired"):
        storage.store(KEY, Entry(None, b"x", clock.now - 1))
    with pytest.raises(RecordTooLargeError, match="MAX_VALUE_BYTES") as info:
        Entry(None, bytes(MAX_VALUE_BYTES + 1), clock.now + 5)
    assert isinstance(info.value, ValueError)
    assert len(storage) == 0


def test_a_full_store_takes_a_newer_version_of_an_entry_it_holds() -> None:
    """The entry it replaces makes room: a full store refused an owner's newer version of
    its own entry of the same size, and kept serving the stale one (a review)."""
    now = [1_700_000_000.0]
    value = msgpack.packb("x" * 100)
    cost = len(value) + ENTRY_OVERHEAD
    storage = DHTStorage(clock=lambda: now[0], max_bytes=cost * 4, max_share_per_source=1.0)
    key = DHTID.from_key("run/progress")
    assert storage.store(key, Entry("peerA", msgpack.packb("y" * 100), now[0] + 100))
    for i in range(3):
        assert storage.store(DHTID.from_key(f"other{i}"), Entry(None, value, now[0] + 1000))
    assert storage.num_bytes == storage.max_bytes  # full
    newer = Entry("peerA", msgpack.packb("z" * 100), now[0] + 200)
    assert storage.store(key, newer)
    assert storage.get(key)["peerA"] == newer
    assert storage.num_bytes == storage.max_bytes
    bigger = Entry("peerA", msgpack.packb("z" * 101), now[0] + 300)  # one byte more: no room
    assert not storage.store(key, bigger)
    assert storage.store(key, newer)  # the same entry again (a republish) is held
    assert not storage.store(DHTID.from_key("new"), Entry(None, value, now[0] + 1000))


def test_the_same_entry_again_is_not_checked_again(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A security review's peer sent one signed store of 64 entries 128 times at once:
    each time every signature was checked again (1.7 s of a node's loop) before storage
    found that it changed nothing. An entry held, not expired, and identical (signature
    included) was checked when stored and is valid while it lives."""
    import peer.dht.storage as storage_module
    from protocol.records import validate_entry

    checks = 0

    def counting(*args: object, **kwargs: object) -> None:
        nonlocal checks
        checks += 1
        validate_entry(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage_module, "validate_entry", counting)
    storage = DHTStorage(clock=clock)
    owner = Identity.from_seed(b"o" * 32)
    signed = sign_entry(owner, KEY, str(owner.peer_id), b"\x01", clock.now + 30)
    assert storage.store(KEY, signed)
    for _ in range(5):
        assert storage.store(KEY, signed)
    assert checks == 1
    other = sign_entry(owner, KEY, str(owner.peer_id), b"\x02", clock.now + 31)
    assert storage.store(KEY, other) and checks == 2  # a new version: checked
    forged = Entry(other.subkey, other.value, other.expiration, other.owner_key, bytes(64))
    with pytest.raises(RecordError):  # the same but its signature: checked, refused
        storage.store(KEY, forged)
    assert checks == 3
