"""A bootstrap node's contacts, saved beside its identity file (``peer.contacts``). A trial:
a bootstrap node restarted with its identity file on another port kept its PeerID but knew
nobody, and its peers' tables held its old address; newcomers that joined through it
averaged alone while the swarm went on without them."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import peer.contacts
from peer import Peer, open_peer
from peer.contacts import (
    EAGER_FOR,
    FORGET_AFTER,
    MAX_FILE_BYTES,
    MAX_SAVED_CONTACTS,
    RETRY_MAX,
    contacts_file,
    keep_contacts,
    load_contacts,
    save_contacts,
)
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.identity import Identity

BOOT, A, B, NEW, X = (Identity.from_seed(bytes([40 + i]) * 32) for i in range(5))


def _address(identity: Identity, port: int = 4000) -> Address:
    return Address("10.0.0.9", port, identity.peer_id)


# -- the file ------------------------------------------------------------------------------


def test_the_file_sits_beside_the_identity_file() -> None:
    assert contacts_file("/srv/swarm/node.key") == Path("/srv/swarm/node.key.contacts")


def _temporaries(directory: Path) -> list[Path]:
    return sorted(directory.glob(".k.contacts.*.tmp"))


def test_contacts_round_trip_in_order_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "k.contacts"
    contacts = [_address(A), _address(B, 4001), Address("::1", 5, NEW.peer_id)]
    save_contacts(path, contacts)
    assert load_contacts(path) == contacts
    save_contacts(path, [*contacts, contacts[0]])
    assert load_contacts(path) == contacts
    assert not _temporaries(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600  # who takes part is nobody else's business


def test_at_most_max_saved_contacts_are_written(tmp_path: Path) -> None:
    path = tmp_path / "k.contacts"
    many = [_address(A, port) for port in range(1, MAX_SAVED_CONTACTS + 50)]
    save_contacts(path, many)
    assert load_contacts(path) == many[:MAX_SAVED_CONTACTS]


def test_no_file_is_no_contacts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert load_contacts(tmp_path / "missing.contacts") == []
    assert not caplog.records


@pytest.mark.parametrize(
    "content",
    [b"", b"\xff\xfe garbage", b"{not json", b"[1, 2]", b'{"format": "other/1", "contacts": []}',
     b'{"format": "swarm-contacts/1", "contacts": "x"}', b"[" * 100_000 + b"]" * 100_000],
    ids=["empty", "binary", "truncated", "a-list", "another-format", "contacts-not-a-list",
         "nested-deep"],
)  # fmt: skip
def test_a_corrupt_file_is_said_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "k.contacts"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="peer.contacts"):
        assert load_contacts(path) == []
    assert f"{path} is no contacts file" in caplog.text


@pytest.mark.parametrize("kind", ["fifo", "directory", "too-large", "link-to-a-device"])
def test_what_is_no_small_regular_file_is_refused_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """(a review: a FIFO there blocked the node's loop for good once its address was out,
    and a 19 MiB file took its memory to 113 MiB, beyond a bootstrap node's 60)"""
    path = tmp_path / "k.contacts"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "too-large":
        entries = [str(_address(A, 1 + i % 60000)) for i in range(MAX_FILE_BYTES // 50)]
        path.write_text(json.dumps({"format": "swarm-contacts/1", "contacts": entries}))
    else:
        path.symlink_to("/dev/zero")
    loaded: list[list[Address]] = []
    with caplog.at_level(logging.WARNING, logger="peer.contacts"):
        reader = threading.Thread(target=lambda: loaded.append(load_contacts(path)), daemon=True)
        reader.start()
        reader.join(10)  # (a FIFO's reader would block for good)
    assert loaded == [[]]
    assert "cannot read the contacts file" in caplog.text
    if kind == "directory":  # (a review: each load of a directory leaked a descriptor)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            load_contacts(path)
        assert len(os.listdir("/proc/self/fd")) == before


def test_entries_that_are_no_full_address_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "k.contacts"
    good = _address(A)
    entries = [str(good), "127.0.0.1:4000", f"{B.peer_id}@10.0.0.1:0", 7, None, "x@y:z"]
    path.write_text(json.dumps({"format": "swarm-contacts/1", "contacts": entries}))
    with caplog.at_level(logging.WARNING, logger="peer.contacts"):
        assert load_contacts(path) == [good]
    assert "skipped 5 entries" in caplog.text


def test_a_write_that_fails_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "k.contacts"
    save_contacts(path, [_address(A)])
    before = path.read_bytes()

    def killed(*args: object) -> None:  # as a kill between the write and the rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="No space"):
        save_contacts(path, [_address(B)])
    assert path.read_bytes() == before
    assert not _temporaries(tmp_path)


def test_temporary_files_left_by_killed_writes_do_not_matter_and_go(tmp_path: Path) -> None:
    path = tmp_path / "k.contacts"
    save_contacts(path, [_address(A)])
    ours = tmp_path / f".k.contacts.{os.getpid()}.tmp"
    old, recent = tmp_path / ".k.contacts.1.tmp", tmp_path / ".k.contacts.2.tmp"
    for left in (ours, old, recent):
        left.write_bytes(b'{"format": "swarm-con')  # cut short
    os.utime(old, (1, 1))  # a killed write of long ago: removed at the next start
    assert load_contacts(path) == [_address(A)]
    assert _temporaries(tmp_path) == sorted([ours, recent])  # recent: maybe another's write
    save_contacts(path, [_address(B)])  # ours is made anew
    assert load_contacts(path) == [_address(B)]
    assert _temporaries(tmp_path) == [recent]


def test_a_link_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / f".k.contacts.{os.getpid()}.tmp").symlink_to(victim)
    save_contacts(tmp_path / "k.contacts", [_address(A)])
    assert victim.read_bytes() == b"keep me"
    assert load_contacts(tmp_path / "k.contacts") == [_address(A)]


# -- keeping them --------------------------------------------------------------------------


async def _volunteer(
    net: MemoryNetwork, host: str, identity: Identity, initial: str | None, *,
    task_status: trio.TaskStatus[Peer],
) -> None:  # fmt: skip
    initial_peers = [initial] if initial else []
    interface = net.interface(host)
    async with open_peer(f"{host}:4000", initial_peers, identity, network=interface) as p:
        task_status.started(p)
        await trio.sleep_forever()


async def _bootstrap(
    net: MemoryNetwork, port: int, path: Path, *, task_status: trio.TaskStatus[Peer]
) -> None:
    """A bootstrap node as ``swarm bootstrap --identity`` runs it (peer.cli)."""
    interface = net.interface("10.0.0.1")
    async with open_peer(f"10.0.0.1:{port}", [], BOOT, network=interface) as node:
        task_status.started(node)
        await keep_contacts(node.dht, path, load_contacts(path))


async def _start_stoppable(
    nursery: trio.Nursery, life: Callable[..., Awaitable[None]], *args: object
) -> tuple[Peer, trio.CancelScope]:
    """Start ``life(*args)`` (a peer's) in ``nursery``; cancelling the scope stops it alone."""
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[Peer]) -> None:
        with scope:
            await life(*args, task_status=task_status)

    return await nursery.start(run), scope


async def test_a_bootstrap_restarted_on_another_port_finds_its_swarm_again(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            boot, boot_scope = await _start_stoppable(nursery, _bootstrap, net, 4000, path)
            a = await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            b = await nursery.start(_volunteer, net, "10.0.0.3", B, boot.address)
            await trio.sleep(2)  # checked every second; written at once the first time
            assert set(load_contacts(path)) == {
                Address("10.0.0.2", 4000, A.peer_id),
                Address("10.0.0.3", 4000, B.peer_id),
            }
            boot_scope.cancel()  # (the node stops; its port is gone)
            await trio.sleep(1)

            again = await nursery.start(_bootstrap, net, 4001, path)
            assert again.address != boot.address and again.peer_id == boot.peer_id
            await trio.sleep(5)
            # the volunteers learnt the new address, and a newcomer meets them through it
            for volunteer in (a, b):
                assert (BOOT.peer_id, "10.0.0.1:4001") in volunteer.dht.routing_table_peers()
            newcomer = await nursery.start(_volunteer, net, "10.0.0.4", NEW, again.address)
            assert await a.dht.store("after/restart", 7, ttl=60)
            assert await newcomer.dht.get("after/restart") == 7
            assert {A.peer_id, B.peer_id} <= {p for p, _ in newcomer.dht.routing_table_peers()}
            nursery.cancel_scope.cancel()


async def test_saves_follow_the_table_eagerly_then_at_most_every_interval_never_empty(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    at = {
        name: Address(f"10.0.0.{i}", 4000, identity.peer_id)
        for i, (name, identity) in enumerate([("a", A), ("b", B), ("new", NEW), ("x", X)], 2)
    }
    with trio.fail_after(7200):
        async with trio.open_nursery() as nursery:
            boot = await nursery.start(_bootstrap, net, 4000, path)
            await trio.sleep(3)
            assert not path.exists()  # an empty table is not saved
            _, a_scope = await _start_stoppable(
                nursery, _volunteer, net, "10.0.0.2", A, boot.address
            )
            await trio.sleep(1.5)
            assert load_contacts(path) == [at["a"]]
            # in the first minute, each change within a second
            await nursery.start(_volunteer, net, "10.0.0.3", B, boot.address)
            await trio.sleep(1.5)
            assert set(load_contacts(path)) == {at["a"], at["b"]}
            # then at most every 10 s
            await trio.sleep(EAGER_FOR)
            await nursery.start(_volunteer, net, "10.0.0.4", NEW, boot.address)
            await trio.sleep(1.5)
            written_at = trio.current_time()
            assert set(load_contacts(path)) == {at["a"], at["b"], at["new"]}
            await nursery.start(_volunteer, net, "10.0.0.5", X, boot.address)
            await trio.sleep(5)  # changed, but the last write was less than 10 s ago
            assert len(load_contacts(path)) == 3
            await trio.sleep(written_at + 11 - trio.current_time())
            assert len(load_contacts(path)) == 4
            # A dies; once the table forgets it, it is tried again for an hour, kept in the
            # file meanwhile (a node cut off from A could not tell), then dropped
            a_scope.cancel()
            net.kill_host("10.0.0.2")
            for _ in range(300):
                await trio.sleep(10)
                if len(boot.dht.routing_table_peers()) == 3:
                    break
            assert len(boot.dht.routing_table_peers()) == 3
            await trio.sleep(11)
            assert len(load_contacts(path)) == 4
            await trio.sleep(FORGET_AFTER + 1.25 * RETRY_MAX)
            assert set(load_contacts(path)) == {at["b"], at["new"], at["x"]}
            nursery.cancel_scope.cancel()


async def test_an_unwritable_file_is_said_once_and_tried_again_each_interval(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "no-such-dir" / "boot.key.contacts"
    tries: list[float] = []

    def counted(*args: Any) -> None:
        tries.append(trio.current_time())
        save_contacts(*args)

    monkeypatch.setattr(peer.contacts, "save_contacts", counted)
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120), caplog.at_level(logging.WARNING, logger="peer.contacts"):
        async with trio.open_nursery() as nursery:
            boot = await nursery.start(_bootstrap, net, 4000, path)
            a = await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            await nursery.start(_volunteer, net, "10.0.0.3", B, boot.address)
            await trio.sleep(30)
            assert await a.dht.store("still/serving", 1, ttl=60)
            nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if "cannot save contacts" in r.getMessage()]
    assert len(warnings) == 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(tries[:-1])]
    assert 2 <= len(gaps) <= 3 and min(gaps) >= 10  # (the last try: the stop's own)


async def test_a_stop_saves_the_last_table_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(_volunteer, net, "10.0.0.3", B, None)
            save_contacts(path, [Address("10.0.0.3", 4000, B.peer_id)])
            boot, scope = await _start_stoppable(nursery, _bootstrap, net, 4000, path)
            await trio.sleep(EAGER_FOR)  # B answered; written
            await nursery.start(_volunteer, net, "10.0.0.4", NEW, boot.address)
            await trio.sleep(1.5)  # written at once: the last write was long ago
            assert len(load_contacts(path)) == 2
            await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            await trio.sleep(2)  # a new contact, but the last write was 10 s ago or less
            assert len(load_contacts(path)) == 2
            scope.cancel()
            await trio.sleep(0.1)  # (the node's shutdown runs; no check comes in between)
            assert set(load_contacts(path)) == {
                Address("10.0.0.3", 4000, B.peer_id),
                Address("10.0.0.4", 4000, NEW.peer_id),
                Address("10.0.0.2", 4000, A.peer_id),
            }
            nursery.cancel_scope.cancel()


async def test_saved_contacts_that_do_not_answer_stay_and_are_tried_again(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A review: a bootstrap node restarted while its own network was down (a reboot)
    tried its saved contacts once, and its first newcomer's entry then replaced them in
    the file for good. Now they stay in the file, and are tried again until they answer
    (or have not for FORGET_AFTER)."""
    path = tmp_path / "boot.key.contacts"
    a_at, b_at = Address("10.0.0.2", 4000, A.peer_id), Address("10.0.0.3", 4000, B.peer_id)
    gone = Address("10.0.0.8", 4000, Identity.from_seed(b"\x99" * 32).peer_id)  # never up
    save_contacts(path, [a_at, b_at, gone])
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(FORGET_AFTER + 1800):
        async with trio.open_nursery() as nursery:
            a = await nursery.start(_volunteer, net, "10.0.0.2", A, None)
            await nursery.start(_volunteer, net, "10.0.0.3", B, None)
            net.partition(["10.0.0.1", "10.0.0.4"], ["10.0.0.2", "10.0.0.3"])
            boot = await nursery.start(_bootstrap, net, 4000, path)
            await nursery.start(_volunteer, net, "10.0.0.4", NEW, boot.address)
            await trio.sleep(11)  # (written at once, then at most every 10 s)
            new_at = Address("10.0.0.4", 4000, NEW.peer_id)
            assert set(load_contacts(path)) == {a_at, b_at, gone, new_at}
            await trio.sleep(60)
            net.heal()
            await trio.sleep(120)  # (tried again 5, 10, 20, 40, 80 s apart, +-25 %)
            assert (BOOT.peer_id, "10.0.0.1:4000") in a.dht.routing_table_peers()
            assert {A.peer_id, B.peer_id, NEW.peer_id} <= {
                p for p, _ in boot.dht.routing_table_peers()
            }
            assert set(load_contacts(path)) == {a_at, b_at, gone, new_at}
            await trio.sleep(FORGET_AFTER + 1.25 * RETRY_MAX)  # (its last try may come late)
            assert set(load_contacts(path)) == {a_at, b_at, new_at}
            nursery.cancel_scope.cancel()


async def test_the_first_contacts_are_saved_while_saved_ones_are_still_dialed(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """(a trial: with saved contacts that never answered, the first save waited for their
    dials, 12 s; a node killed meanwhile would have come back knowing only those)"""
    path = tmp_path / "boot.key.contacts"
    silent = Address("10.0.0.7", 4000, NEW.peer_id)
    save_contacts(path, [silent])
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(_volunteer, net, "10.0.0.7", NEW, None)
            net.freeze_host("10.0.0.7")
            boot = await nursery.start(_bootstrap, net, 4000, path)
            await trio.sleep(0.3)
            await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            await trio.sleep(1.5)
            assert set(load_contacts(path)) == {silent, Address("10.0.0.2", 4000, A.peer_id)}
            nursery.cancel_scope.cancel()


async def test_a_running_node_cut_off_keeps_its_contacts_and_finds_them_again(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A review: a bootstrap node cut off from its volunteers emptied its table, and its
    first newcomer on its side of the cut then replaced all of them in the file: a restart
    before the network healed, on another port, came back alone."""
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    a_at, b_at = Address("10.0.0.2", 4000, A.peer_id), Address("10.0.0.3", 4000, B.peer_id)
    with trio.fail_after(4 * 3600):
        async with trio.open_nursery() as nursery:
            boot = await nursery.start(_bootstrap, net, 4000, path)
            a = await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            await nursery.start(_volunteer, net, "10.0.0.3", B, boot.address)
            await trio.sleep(2)
            assert set(load_contacts(path)) == {a_at, b_at}
            net.partition(["10.0.0.1", "10.0.0.4"], ["10.0.0.2", "10.0.0.3"])
            for _ in range(600):
                await trio.sleep(10)
                if not boot.dht.routing_table_peers():
                    break
            assert not boot.dht.routing_table_peers()
            await nursery.start(_volunteer, net, "10.0.0.4", NEW, boot.address)
            await trio.sleep(11)
            new_at = Address("10.0.0.4", 4000, NEW.peer_id)
            assert set(load_contacts(path)) == {a_at, b_at, new_at}
            net.heal()
            await trio.sleep(400)  # (tried again at doubling intervals, up to 5 min)
            assert {A.peer_id, B.peer_id} <= {p for p, _ in boot.dht.routing_table_peers()}
            assert (BOOT.peer_id, "10.0.0.1:4000") in a.dht.routing_table_peers()
            assert set(load_contacts(path)) == {a_at, b_at, new_at}
            nursery.cancel_scope.cancel()


async def test_a_peer_back_at_another_port_is_not_dialed_at_its_old_one(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: the old address of a volunteer restarted on another port (same key) was
    dialed again as a contact that left; the call went over the pooled connection to the
    same PeerID, "answered", and put the dead address back in the table, which then
    flipped between the two ports every 5 s for half an hour."""
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    dialed: list[list[Address]] = []
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            boot = await nursery.start(_bootstrap, net, 4000, path)
            contact = boot.dht.contact

            async def counted(addresses: list[Address]) -> list[Address]:
                dialed.append(list(addresses))
                return await contact(addresses)

            monkeypatch.setattr(boot.dht, "contact", counted)
            _, first = await _start_stoppable(nursery, _volunteer, net, "10.0.0.2", A, boot.address)
            await trio.sleep(70)
            await boot.dht.host.close_connections()  # idle, then dialed by the node itself
            assert await boot.dht.host.connect(Address("10.0.0.2", 4000, A.peer_id)) == A.peer_id
            first.cancel()
            await trio.sleep(1)
            interface = net.interface("10.0.0.2")
            await nursery.start(_serve_at, interface, "10.0.0.2:4001", A, boot.address)
            seen = []
            for _ in range(120):
                await trio.sleep(5)
                seen += [hostport for _, hostport in boot.dht.routing_table_peers()]
            assert seen == ["10.0.0.2:4001"] * 120  # never the dead port again
            assert not dialed
            assert load_contacts(path) == [Address("10.0.0.2", 4001, A.peer_id)]
            # nor by DHT.contact, whoever asks: a PeerID in the table is skipped (a call
            # would go over the pooled connection to A, and answer)
            assert await boot.dht.host.connect(Address("10.0.0.2", 4001, A.peer_id))
            assert await contact([Address("10.0.0.2", 4000, A.peer_id)]) == []
            assert [hp for _, hp in boot.dht.routing_table_peers()] == ["10.0.0.2:4001"]
            nursery.cancel_scope.cancel()


async def _serve_at(
    interface: Any, listen: str, identity: Identity, initial: str, *,
    task_status: trio.TaskStatus[Peer],
) -> None:  # fmt: skip
    async with open_peer(listen, [initial], identity, network=interface) as node:
        task_status.started(node)
        await trio.sleep_forever()


def test_the_contacts_of_a_key_file_with_a_long_name_are_kept(tmp_path: Path) -> None:
    """`KEY.contacts` of a 240-character key name: its temporary file's name went past the
    255 characters a file name may have, and the contacts were never written."""
    path = tmp_path / ("k" * 240 + ".contacts")
    save_contacts(path, [_address(A)])
    assert load_contacts(path) == [_address(A)]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
