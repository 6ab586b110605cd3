"""A malformed address is an ``AddressError``: a ``ProtocolError`` (it may come off the wire)
and a ``ValueError`` (most often it is an argument a caller got wrong, as a new-user trial
expected of ``open_peer(listen="nonsense")``)."""

from __future__ import annotations

import socket

import pytest
import trio

from peer import MemoryNetwork, PeerUnavailableError, open_peer
from protocol.address import Address, canonical_host
from protocol.errors import AddressError, ProtocolError


@pytest.mark.parametrize(
    "text", ["nonsense", "127.0.0.1:99999", "::1:80", "[::1:80", "notapeerid@127.0.0.1:80", ""]
)
def test_a_malformed_address_is_both_kinds_of_error(text: str) -> None:
    with pytest.raises(AddressError) as info:
        Address.parse(text)
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "arguments", [{"listen": "nonsense"}, {"initial_peers": ["127.0.0.1:99999"]}]
)
async def test_open_peer_raises_a_value_error_for_a_bad_address(arguments: dict) -> None:
    with trio.fail_after(10), pytest.raises(ValueError, match=r"99999|HOST:PORT"):
        async with open_peer(**arguments):
            pass  # pragma: no cover - never entered


@pytest.mark.parametrize("text", ["A@127.0.0.1:1,B@127.0.0.1:2", "127.0.0.1:1 127.0.0.1:2"])
def test_several_addresses_in_one_string_say_so(text: str) -> None:
    """Was "is not HOST:PORT (IPv6 needs brackets)" for a comma-joined list (the CLI
    already said what was wrong)."""
    with pytest.raises(AddressError, match="is several addresses: give a list with one"):
        Address.parse(text)


@pytest.mark.parametrize("text", ["A@127.0.0.1:1,", ",127.0.0.1:1"])
def test_one_address_with_a_stray_comma_says_so(text: str) -> None:
    """Was "is several addresses" for one address and a trailing comma (a new user)."""
    with pytest.raises(AddressError, match="a stray comma"):
        Address.parse(text)


@pytest.mark.parametrize("ensure", [True, False])
async def test_a_join_that_no_initial_peer_answered_is_said_once(
    ensure: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Raised (the default), it is not also logged: a plain script printed the same text
    twice. Started alone instead (``ensure_bootstrap_success=False``), the warning is all
    the user gets."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{closed.getsockname()[1]}"
    with trio.fail_after(10):
        if ensure:
            with pytest.raises(PeerUnavailableError, match="no initial peer answered"):
                async with open_peer(initial_peers=[nobody]):
                    pass  # pragma: no cover - never entered
        else:
            async with open_peer(initial_peers=[nobody], ensure_bootstrap_success=False):
                pass
    warned = [r for r in caplog.records if "no initial peer answered" in r.getMessage()]
    assert len(warned) == (0 if ensure else 1)


@pytest.mark.parametrize(
    "host",
    [
        "a..b",
        ".",
        "x.",
        "..",
        "a" * 64,
        "x." + "a" * 64,
        ("a" * 63 + ".") * 3 + "a" * 62,
        "b\u00fccher..de",
    ],
)
def test_a_host_name_the_resolver_cannot_encode_is_refused(host: str) -> None:
    """Such a name made the resolver raise UnicodeError inside a dial, which ended the whole
    node when it came in a ping's sender field (a trial's crafted ping; a peer started with
    ``--announce-host x..y`` did it too)."""
    if host == "x.":
        Address(host, 1)  # one final dot: a fully qualified name
        return
    with pytest.raises(AddressError, match="is not a valid host name"):
        Address(host, 1)
    with pytest.raises(AddressError, match="is not a valid host name"):
        Address.parse(f"{host}:80")


@pytest.mark.parametrize(
    "host", ["example.org", "example.org.", "a" * 63, ("a" * 62 + ".") * 4, "b\u00fccher.de", "a_b"]
)
def test_valid_host_names_are_kept(host: str) -> None:
    assert Address.parse(f"{host}:80").host == host


@pytest.mark.parametrize("host", ["a..b:c", "a:b", "1::2::3", ":::"])
def test_a_bracketed_host_must_be_an_ipv6_address(host: str) -> None:
    """``[a..b:c]`` skipped the name check (it has a colon) and crashed the resolver too."""
    with pytest.raises(AddressError, match="is no IPv6 address"):
        Address.parse(f"[{host}]:80")


@pytest.mark.parametrize("host", ["::1", "fe80::1%eth0", "::ffff:1.2.3.4"])
def test_ipv6_hosts_with_zones_and_mapped_ipv4_are_kept(host: str) -> None:
    assert Address.parse(f"[{host}]:80").host == host


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1", r"address '127.0.0.1' has no port: give HOST:PORT"),
        ("example.org", r"address 'example.org' has no port: give HOST:PORT"),
        ("[::1]", r"address '\[::1\]' has no port: give \[IPV6\]:PORT"),
        ("::1:80", r"IPv6 needs brackets"),
    ],
)
def test_an_address_without_a_port_says_so(text: str, message: str) -> None:
    """Was "is not HOST:PORT (IPv6 needs brackets)" for 127.0.0.1, and "malformed IPv6
    address" for [::1] (an IPv6 trial)."""
    with pytest.raises(AddressError, match=message):
        Address.parse(text)


@pytest.mark.parametrize(
    ("host", "canonical"),
    [
        ("0:0:0:0:0:0:0:1", "::1"),
        ("[0:0::1]", "::1"),
        ("2001:0DB8:0::1", "2001:db8::1"),
        ("127.0.0.1", "127.0.0.1"),
        ("Example.org", "Example.org"),
        ("[not-ipv6]", "[not-ipv6]"),
    ],
)
def test_canonical_host_spells_ipv6_literals_one_way(host: str, canonical: str) -> None:
    assert canonical_host(host) == canonical


async def test_open_peer_announces_an_ipv6_host_in_its_short_form() -> None:
    """`swarm bootstrap --host 0:0:0:0:0:0:0:1` printed [::1], open_peer kept the long
    form in node.address and in others' tables; a bracketed announce_host was refused."""
    net = MemoryNetwork()
    with trio.fail_after(20):
        async with (
            open_peer("[0:0:0:0:0:0:0:1]:4000", network=net.interface("::1")) as first,
            open_peer(
                "[::1]:4001",
                [first.address],
                announce_host="[0:0::1]",
                network=net.interface("::1"),
            ) as second,
        ):
            assert first.address.endswith("@[::1]:4000")
            assert second.address.endswith("@[::1]:4001")
            assert (second.peer_id, "[::1]:4001") in first.dht.routing_table_peers()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("PEERID@HOST:PORT", "malformed address 'PEERID@HOST:PORT': PeerID 'PEERID': invalid"),
        ("abc@127.0.0.1:1", "malformed address 'abc@127.0.0.1:1': PeerID 'abc' does not decode"),
        ("I@h:1", "malformed address 'I@h:1': PeerID 'I': invalid base58 character 'I'"),
        (" 127.0.0.1:4000", "malformed address ' 127.0.0.1:4000': host ' 127.0.0.1' has"),
        ("127.0.0.1:99999", "malformed address '127.0.0.1:99999': port 99999 out of range"),
    ],
)
def test_a_malformed_address_is_named_with_the_part_at_fault(text: str, said: str) -> None:
    """Was "invalid base58 character 'I'" for the docs' placeholder left in place: it named
    neither the address (one of several initial peers) nor its PeerID (a new-user trial)."""
    with pytest.raises(AddressError) as info:
        Address.parse(text)
    assert str(info.value).startswith(said)
