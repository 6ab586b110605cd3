"""Whether two ``HOST:PORT``s reach one listening socket: the same port at hosts that
resolve to a common IP (``localhost`` and ``127.0.0.1``; ``[0:0::1]`` and ``[::1]``;
``[::ffff:127.0.0.1]`` and ``127.0.0.1``). ``swarm status`` uses it to tell a node reached
under two names from two processes sharing one key file."""

from __future__ import annotations

import ipaddress
import socket

import trio

from protocol.address import Address

RESOLVE_TIMEOUT = 2.0
"""Seconds for all the names of one PeerID to resolve; a name not resolved by then counts
as an endpoint of its own (a twin warned of, as before, rather than one hidden)."""


def _ip(text: str) -> str:
    """An IP in one spelling: IPv6 compressed, an IPv4-mapped IPv6 as its IPv4, no zone."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


async def _resolved(address: Address) -> set[tuple[str, int]]:
    """The ``(ip, port)``s ``address`` names; the host itself when it cannot be resolved."""
    try:
        return {(_ip(address.host), address.port)}
    except ValueError:  # a name
        pass
    try:
        infos = await trio.socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
    except OSError:
        return {(address.host, address.port)}
    return {(_ip(str(info[4][0])), address.port) for info in infos}


async def distinct_endpoints(hostports: list[str]) -> list[str]:
    """``hostports`` less those that reach the same socket as one listed before them."""
    addresses = [Address.parse(text) for text in hostports]
    names: list[set[tuple[str, int]]] = [{(a.host, a.port)} for a in addresses]

    async def resolve(i: int) -> None:
        names[i] = await _resolved(addresses[i])

    with trio.move_on_after(RESOLVE_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(len(addresses)):
                nursery.start_soon(resolve, i)
    kept: list[str] = []
    seen: set[tuple[str, int]] = set()
    for text, endpoint in zip(hostports, names, strict=True):
        if not endpoint & seen:
            kept.append(text)
        seen |= endpoint
    return kept
