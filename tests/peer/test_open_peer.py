"""open_peer's contract at its edges: wrong arguments, and a peer used after it stopped."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from peer import PeerStoppedError, open_peer
from peer.dht import DHTConfig
from peer.memnet import MemoryNetwork
from protocol.errors import AddressError, ProtocolError
from protocol.identity import Identity, IdentityFileError

OTHER = Identity.from_seed(bytes([9]) * 32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"listen": f"{OTHER.peer_id}@10.0.0.1:0"}, ValueError, "names another peer"),
        ({"listen": 4000}, TypeError, "listen must be"),
        ({"identity": bytes(32)}, TypeError, "Identity.from_seed"),
        ({"client_mode": "yes"}, TypeError, "client_mode must be a bool"),
        ({"config": {"k": 5}}, TypeError, "config must be a PeerConfig"),
        ({"config": DHTConfig()}, TypeError, "config must be a PeerConfig"),
        ({"announce_host": "0.0.0.0"}, ValueError, "not an address peers can dial"),
        ({"announce_host": "224.0.0.1"}, ValueError, "not an address peers can dial"),
        # an outside tester: "'1.2.3.4:5' is no IPv6 address" (the CLI names the port)
        ({"announce_host": "203.0.113.7:5"}, AddressError, "give the host without a port"),
        ({"announce_host": "[::1]:5"}, AddressError, "give the host without a port"),
        # a client-mode trial: both were ignored without a word
        ({"client_mode": True, "announce_host": "203.0.113.7"}, ValueError, "client-mode"),
        ({"client_mode": True, "listen": "garbage"}, ProtocolError, "no port"),
        # an outside tester: "identity path  names a folder" (the CLI says the name is empty)
        ({"identity": ""}, IdentityFileError, "^identity path is empty"),
        # an outside tester: bytes were read as a list of ints ("malformed address 53")
        ({"initial_peers": b"x@10.0.0.2:4000"}, TypeError, "not bytes"),
        ({"initial_peers": bytearray(b"10.0.0.2:4000")}, TypeError, "not bytearray"),
        ({"initial_peers": [4000]}, TypeError, "not int"),
        ({"announce_host": 5}, TypeError, "announce_host must be a host name or IP"),
    ],
)
async def test_wrong_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    net = MemoryNetwork()
    with trio.fail_after(10), pytest.raises(error, match=match):
        async with open_peer(
            **{"listen": "10.0.0.1:0", "network": net.interface("10.0.0.1"), **kwargs}
        ):
            pass


async def test_a_stopped_peer_refuses_work_instead_of_pretending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After its context ended a peer cannot store or look up anything: a clear
    PeerStoppedError, not a store that "succeeded" locally or a closed-nursery error."""
    net = MemoryNetwork()
    with trio.fail_after(60):
        async with open_peer("10.0.0.1:0", network=net.interface("10.0.0.1")) as first:
            async with open_peer(
                "10.0.0.2:0", [first.address], network=net.interface("10.0.0.2")
            ) as second:
                assert await second.dht.store("k", 1)
            stopped = second
            with pytest.raises(PeerStoppedError):
                await stopped.dht.store("k", 2)
            with pytest.raises(PeerStoppedError):
                await stopped.dht.get("k")
            with pytest.raises(PeerStoppedError):
                await stopped.dht.find_peers()
            with pytest.raises(PeerStoppedError):
                await stopped.rpc.call(first.rpc.listen_address, "dht.ping")  # type: ignore[arg-type]
            assert await first.dht.get("k") == 1


async def test_a_lone_start_warns_with_addresses_but_not_about_itself(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Every host may be given the same list, its own address included: that one is no
    failure. A dead one is named, with the reason."""
    me = Identity.from_seed(bytes([3]) * 32)
    own, dead = f"{me.peer_id}@10.0.0.1:4000", f"{OTHER.peer_id}@10.0.0.9:4000"
    net = MemoryNetwork()
    # its own HOST:PORT without the PeerID too (`swarm bootstrap --port P --initial-peers
    # HOST:P`): the dial reaches this host itself, which is no failure either
    for initial, warned in (([own], False), ([own, dead], True), (["10.0.0.1:4000"], False)):
        caplog.clear()
        with trio.fail_after(60):
            async with open_peer(
                "10.0.0.1:4000",
                initial,
                identity=me,
                network=net.interface("10.0.0.1"),
                ensure_bootstrap_success=False,
            ):
                pass
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(dead in w for w in warnings) == warned, warnings
        assert not any("10.0.0.1:4000:" in w for w in warnings), warnings


async def test_a_loopback_peer_joining_peers_elsewhere_is_warned(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The default listen host is 127.0.0.1: a volunteer that joins a swarm on other
    machines with it announces an address none of them can dial, and is told how to fix it;
    peers that are all on this machine are not warned."""
    net = MemoryNetwork()
    with trio.fail_after(30):
        async with open_peer(listen="10.0.0.1:4000", network=net.interface("10.0.0.1")) as far:
            async with open_peer(
                listen="127.0.0.1:0",
                network=net.interface("127.0.0.1"),
                initial_peers=[far.address],
            ):
                pass
            assert "only this machine can dial" in caplog.text
            assert "announce_host" in caplog.text
            caplog.clear()
            async with (
                open_peer(listen="127.0.0.2:0", network=net.interface("127.0.0.2")) as near,
                open_peer(
                    listen="127.0.0.1:0",
                    network=net.interface("127.0.0.1"),
                    initial_peers=[near.address],
                ),
            ):
                pass
            assert "only this machine can dial" not in caplog.text


async def test_an_initial_peer_at_port_0_is_refused_as_malformed() -> None:
    """Port 0 asks the OS for a port to listen at; dialing it was tried, then reported as
    unreachable (an operator trial). A malformed address, so an ``AddressError`` (a
    ``ValueError``), as dht.md says of every bad ``initial_peers`` entry."""
    with trio.fail_after(10), pytest.raises(AddressError, match="port 0 cannot be dialed"):
        async with open_peer(initial_peers=["127.0.0.1:0"]):
            pass


async def test_a_client_without_initial_peers_is_warned(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """It started without a word and every store was False (a client-mode trial)."""
    net = MemoryNetwork()
    with trio.fail_after(30):
        async with open_peer(None, client_mode=True, network=net.interface("10.0.0.3")) as node:
            assert "cannot start a network" in caplog.text
            assert not await node.dht.store("k", 1, ttl=30.0)
        caplog.clear()
        async with (
            open_peer("10.0.0.1:0", network=net.interface("10.0.0.1")) as first,
            open_peer(None, [first.address], client_mode=True, network=net.interface("10.0.0.3")),
        ):
            pass
        assert "cannot start a network" not in caplog.text


async def test_a_background_task_outlives_its_caller_and_ends_with_the_peer(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``Peer.start_background``: the task runs after the caller's scope ended; an error in
    it is logged and ends that task only; it is cancelled when the peer closes; once the
    peer is closed nothing starts."""
    net = MemoryNetwork()
    ran: list[str] = []

    async def later(name: str) -> None:
        await trio.sleep(1.0)
        ran.append(name)

    async def fails() -> None:
        raise ValueError("broken follow-up")

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            ran.append("cancelled")

    with trio.fail_after(30):
        async with open_peer("a:1", network=net.interface("a")) as node:

            async def caller() -> None:  # a task that ends before what it started
                assert node.start_background(later, "after", name="later")
                assert node.start_background(fails)
                assert node.start_background(forever)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
            assert ran == []
            await trio.sleep(2.0)
            assert ran == ["after"]
            assert "broken follow-up" in caplog.text
        assert ran == ["after", "cancelled"]
        assert not node.start_background(later, "too late")
