"""A bootstrap node's contacts, saved beside its identity file (``peer.contacts``). A trial:
a bootstrap node restarted with its identity file on another port kept its PeerID but knew
nobody, and its peers' tables held its old address; newcomers that joined through it
averaged alone while the swarm went on without them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from peer import Peer, open_peer
from peer.contacts import (
    MAX_SAVED_CONTACTS,
    contacts_file,
    keep_contacts,
    load_contacts,
    save_contacts,
)
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.identity import Identity

BOOT, A, B, NEW = (Identity.from_seed(bytes([40 + i]) * 32) for i in range(4))


def _address(identity: Identity, port: int = 4000) -> Address:
    return Address("10.0.0.9", port, identity.peer_id)


# -- the file ------------------------------------------------------------------------------


def test_the_file_sits_beside_the_identity_file() -> None:
    assert contacts_file("/srv/swarm/node.key") == Path("/srv/swarm/node.key.contacts")


def test_contacts_round_trip_in_order_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "k.contacts"
    contacts = [_address(A), _address(B, 4001), Address("::1", 5, NEW.peer_id)]
    save_contacts(path, contacts)
    assert load_contacts(path) == contacts
    save_contacts(path, [*contacts, contacts[0]])
    assert load_contacts(path) == contacts
    assert not (tmp_path / "k.contacts.tmp").exists()


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
     b'{"format": "swarm-contacts/1", "contacts": "x"}'],
    ids=["empty", "binary", "truncated", "a-list", "another-format", "contacts-not-a-list"],
)  # fmt: skip
def test_a_corrupt_file_is_said_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "k.contacts"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="peer.contacts"):
        assert load_contacts(path) == []
    assert f"{path} is no contacts file" in caplog.text


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
    assert not (tmp_path / "k.contacts.tmp").exists()


def test_a_temporary_file_left_by_a_killed_write_does_not_matter(tmp_path: Path) -> None:
    path = tmp_path / "k.contacts"
    save_contacts(path, [_address(A)])
    (tmp_path / "k.contacts.tmp").write_bytes(b'{"format": "swarm-con')  # cut short
    assert load_contacts(path) == [_address(A)]
    save_contacts(path, [_address(B)])
    assert load_contacts(path) == [_address(B)]


def test_a_link_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "k.contacts.tmp").symlink_to(victim)
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


async def test_saves_follow_the_table_at_most_once_per_interval_and_never_empty(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "boot.key.contacts"
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            boot = await nursery.start(_bootstrap, net, 4000, path)
            await trio.sleep(3)
            assert not path.exists()  # an empty table is not saved
            _, a_scope = await _start_stoppable(
                nursery, _volunteer, net, "10.0.0.2", A, boot.address
            )
            await trio.sleep(1.5)
            first = path.stat().st_mtime_ns, load_contacts(path)
            assert first[1] == [Address("10.0.0.2", 4000, A.peer_id)]
            written_at = trio.current_time()
            await nursery.start(_volunteer, net, "10.0.0.3", B, boot.address)
            await trio.sleep(5)  # changed, but the last write was less than 10 s ago
            assert load_contacts(path) == first[1]
            await trio.sleep(written_at + 11 - trio.current_time())
            assert len(load_contacts(path)) == 2
            # A leaves; once the table forgets it, the file follows
            a_scope.cancel()
            net.kill_host("10.0.0.2")
            for _ in range(300):
                await trio.sleep(10)
                if len(boot.dht.routing_table_peers()) == 1:
                    break
            await trio.sleep(11)
            assert load_contacts(path) == [Address("10.0.0.3", 4000, B.peer_id)]
            nursery.cancel_scope.cancel()


async def test_an_unwritable_file_is_said_once_and_the_node_goes_on(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "no-such-dir" / "boot.key.contacts"
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


async def test_a_stop_saves_the_last_table_but_not_before_the_saved_ones_were_tried(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "boot.key.contacts"
    saved = [Address("10.0.0.7", 4000, NEW.peer_id), Address("10.0.0.3", 4000, B.peer_id)]
    save_contacts(path, saved)
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(_volunteer, net, "10.0.0.7", NEW, None)
            await nursery.start(_volunteer, net, "10.0.0.3", B, None)
            net.freeze_host("10.0.0.7")  # its try lasts request_timeout; B answers at once
            boot, boot_scope = await _start_stoppable(nursery, _bootstrap, net, 4000, path)
            await trio.sleep(1)
            assert [p for p, _ in boot.dht.routing_table_peers()] == [B.peer_id]
            boot_scope.cancel()  # stopped while the saved ones are being tried
            await trio.sleep(1)
            assert load_contacts(path) == saved  # not the one answer so far
            # stopped later, the table's last state is saved at once (no wait for a write)
            net.unfreeze_host("10.0.0.7")
            boot, again_scope = await _start_stoppable(nursery, _bootstrap, net, 4001, path)
            await trio.sleep(4)  # both answered; written
            assert set(load_contacts(path)) == set(saved)
            await nursery.start(_volunteer, net, "10.0.0.2", A, boot.address)
            await trio.sleep(2)  # a new contact, but the last write was 10 s ago or less
            assert len(load_contacts(path)) == 2
            again_scope.cancel()
            await trio.sleep(0.1)  # (the node's shutdown runs; no check comes in between)
            assert set(load_contacts(path)) == {*saved, Address("10.0.0.2", 4000, A.peer_id)}
            nursery.cancel_scope.cancel()
