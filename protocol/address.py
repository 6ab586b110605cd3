"""Peer addresses: ``HOST:PORT`` or ``PEERID@HOST:PORT`` (IPv6 hosts in brackets)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ProtocolError
from .identity import PeerID

MAX_ADDRESS_LENGTH = 300


@dataclass(frozen=True, slots=True)
class Address:
    """Where to reach a peer, and optionally who it must prove to be."""

    host: str
    port: int
    peer_id: PeerID | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ProtocolError(f"port {self.port!r} out of range")
        if not isinstance(self.host, str) or not self.host or len(self.host) > 255:
            raise ProtocolError("empty or oversized host")
        if not self.host.isprintable() or any(c.isspace() or c in "@[]/" for c in self.host):
            raise ProtocolError(f"host {self.host!r} has forbidden characters")

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``[PEERID@]HOST:PORT``; IPv6 hosts are written ``[::1]:PORT``.

        Raises:
            ProtocolError: on any malformed part.
        """
        if not isinstance(text, str) or not text or len(text) > MAX_ADDRESS_LENGTH:
            raise ProtocolError(f"malformed address {text!r}")
        peer_id = None
        rest = text
        if "@" in rest:
            peer_text, rest = rest.split("@", 1)
            peer_id = PeerID.from_base58(peer_text)
        if rest.startswith("["):
            host, sep, port_text = rest[1:].partition("]:")
            if not sep or ":" not in host:
                raise ProtocolError(f"malformed IPv6 address {text!r}")
        else:
            host, sep, port_text = rest.rpartition(":")
            if not sep or ":" in host:
                raise ProtocolError(f"address {text!r} is not HOST:PORT (IPv6 needs brackets)")
        if not (port_text.isascii() and port_text.isdigit()):
            raise ProtocolError(f"malformed port in {text!r}")
        return cls(host, int(port_text), peer_id)

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
