"""What the host needs to know of a remote host: whether it is this machine, what the
per-host limits count it as (an IPv6 /64 is one subscriber), and the address that reaches a
peer over its connection only."""

from __future__ import annotations

import ipaddress

from protocol.address import Address
from protocol.identity import PeerID

UNDIALABLE_HOST = "client-mode.invalid"
"""A host no lookup resolves (RFC 6761): an address at it reaches a peer only over the
connection it already has with us (:func:`over_its_connection`)."""


def over_its_connection(peer_id: PeerID) -> Address:
    """An address for calls to ``peer_id`` over its pooled connection only (a client-mode
    peer has no address to dial; a gone one fails at once instead of being dialed)."""
    return Address(UNDIALABLE_HOST, 0, peer_id)


def is_loopback_host(host: str) -> bool:
    """Whether a remote host (an IP, as streams report it) is this machine (loopback)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False  # a memory network's host name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback  # a dual-stack socket's view of 127.0.0.1
    return address.is_loopback


def host_group(host: str) -> str:
    """What ``max_connections_per_ip`` counts by: the host, or its /64 for a global IPv6
    address (one subscriber holds a whole /64). Link-local and unique-local addresses
    count one by one: every machine of a LAN shares their /64, and no stranger holds one."""
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if address.is_link_local or address in _UNIQUE_LOCAL:
        return str(address)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


_UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")
