"""Peer addresses: ``HOST:PORT`` or ``PEERID@HOST:PORT`` (IPv6 hosts in brackets)."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from .errors import AddressError, ProtocolError
from .identity import PeerID

MAX_ADDRESS_LENGTH = 300
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_NUMERIC_IPV4 = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]+|[0-9]+)){0,3}")
"""What resolvers read as an IPv4 address (inet_aton's forms: ``0`` is 0.0.0.0, ``0x7f.1``
is 127.0.0.1), dotted-quad or not."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where to reach a peer, and optionally who it must prove to be."""

    host: str
    port: int
    peer_id: PeerID | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise AddressError(f"port {self.port!r} out of range")
        if not isinstance(self.host, str) or not self.host or len(self.host) > 255:
            raise AddressError("empty or oversized host")
        if not self.host.isprintable() or any(c.isspace() or c in "@[]/" for c in self.host):
            raise AddressError(f"host {self.host!r} has forbidden characters")
        if ":" in self.host:
            try:
                ipaddress.IPv6Address(self.host)  # (a zone, "%eth0", is allowed)
            except ValueError:
                # the resolver would take it for a name, and may raise UnicodeError on it
                raise AddressError(f"host {self.host!r} is no IPv6 address") from None
        elif not _valid_dns_name(self.host):
            # the resolver would raise UnicodeError on it, deep inside a dial
            raise AddressError(
                f"host {self.host!r} is not a valid host name (each dot-separated label "
                "must have 1 to 63 characters, 253 in all)"
            )

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``[PEERID@]HOST:PORT``; IPv6 hosts are written ``[::1]:PORT``.

        Raises:
            AddressError: (a ProtocolError and a ValueError) on any malformed part.
        """
        if not isinstance(text, str) or not text or len(text) > MAX_ADDRESS_LENGTH:
            raise AddressError(f"malformed address {text!r}")
        if "," in text or len(text.split()) > 1:
            if len(text.replace(",", " ").split()) == 1:  # "A," : one, and a stray comma
                raise AddressError(f"malformed address {text!r}: a stray comma")
            raise AddressError(
                f"{text!r} is several addresses: give a list with one address per item"
            )
        peer_id = None
        rest = text
        if "@" in rest:
            peer_text, rest = rest.split("@", 1)
            try:
                peer_id = PeerID.from_base58(peer_text)
            except ProtocolError as exc:
                # named, with its address: "invalid base58 character 'I'" alone did not say
                # which of several initial peers was wrong, nor that its PeerID was (a trial)
                detail = (
                    str(exc) if str(exc).startswith("PeerID") else f"PeerID {peer_text!r}: {exc}"
                )
                raise AddressError(f"malformed address {text!r}: {detail}") from None
        if rest.startswith("["):
            if rest.endswith("]"):
                raise AddressError(f"address {text!r} has no port: give [IPV6]:PORT")
            host, sep, port_text = rest[1:].partition("]:")
            if not sep or ":" not in host:
                raise AddressError(f"malformed IPv6 address {text!r}")
        else:
            host, sep, port_text = rest.rpartition(":")
            if not sep:
                raise AddressError(f"address {text!r} has no port: give HOST:PORT")
            if ":" in host:
                raise AddressError(f"address {text!r} is not HOST:PORT (IPv6 needs brackets)")
        if not (port_text.isascii() and port_text.isdigit()):
            raise AddressError(f"malformed port in {text!r}")
        try:
            return cls(host, int(port_text), peer_id)
        except AddressError as exc:  # a bad host or port, named with its address
            raise AddressError(f"malformed address {text!r}: {exc}") from None

    @property
    def dialable(self) -> bool:
        """Whether a peer can listen at this host: False for an unspecified (``0.0.0.0``,
        ``::``), multicast or broadcast IP, and for a numeric IPv4 host written other than
        as a dotted quad (``0``, ``0x7f.1``: resolvers read it as an IP, ``0`` as 0.0.0.0).
        Loopback and private IPs are dialable (tests, LANs); so is any DNS name."""
        return _dialable_host(self.host)

    @property
    def hostport(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def with_peer_id(self, peer_id: PeerID | None) -> Address:
        return Address(self.host, self.port, peer_id)

    def __str__(self) -> str:
        if self.peer_id is None:
            return self.hostport
        return f"{self.peer_id}@{self.hostport}"


def canonical_host(host: str) -> str:
    """``host`` as others will see it: an IPv6 literal (bracketed or not) in its short
    form (``0:0:0:0:0:0:0:1`` and ``[::1]`` are ``::1``); anything else unchanged."""
    if not isinstance(host, str):
        return host  # (the Address built from it says what is wrong)
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" not in inner:
        return host
    try:
        return ipaddress.IPv6Address(inner).compressed
    except ValueError:
        return host  # (the Address built from it says what is wrong)


@functools.lru_cache(maxsize=4096)
def _valid_dns_name(host: str) -> bool:
    """Whether the resolver can encode ``host`` (an IPv4 literal or a DNS name; one final
    dot allowed): the label lengths its IDNA codec checks, without its cost for ASCII."""
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return False
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(0 < len(label) <= 63 for label in name.split("."))


def _dialable_host(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return _NUMERIC_IPV4.fullmatch(host) is None  # a DNS name, or a disguised IPv4
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_unspecified or ip.is_multicast or ip == _BROADCAST)
