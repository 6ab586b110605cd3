"""Walk the DHT to list every reachable peer (used by ``swarm status``).

Asks each peer it learns of for the nodes closest to a few spread-out targets,
until no new peer turns up. Peers that do not answer are left out: the result
is who can be reached *now*, not who was ever announced.
"""

from __future__ import annotations

import heapq
import logging
import random

import trio

from protocol.address import Address
from protocol.dhtid import DHTID, ID_BITS
from protocol.errors import SwarmError
from protocol.identity import PeerID
from protocol.messages import FindNodeRequest, FindNodeResponse

from .network import out_of_files
from .node import Peer

logger = logging.getLogger(__name__)

# Targets spread over the id space so every region of each routing table is asked.
_TARGETS_PER_PEER = 8
# Nodes taken from each answer: its closest to the target, as a lookup takes (an answer may
# name up to 64; a hostile one named 64 made-up peers per target, 576 a peer)
_TAKEN_PER_ANSWER = 20
# Addresses at which one PeerID is visited: two or three processes with one key file are a
# mistake worth listing whole; a node naming itself at 32 relay ports made ``swarm status``
# count 37 peers among 5 (an outside review)
_MAX_ADDRESSES_PER_PEER = 4


async def crawl(
    node: Peer,
    *,
    request_timeout: float = 5.0,
    max_parallel: int = 16,
    answered: dict[PeerID, str] | None = None,
    elsewhere: dict[PeerID, set[str]] | None = None,
    short_of_files: set[str] | None = None,
) -> list[tuple[PeerID, str]]:
    """Every peer that answered, with its ``HOST:PORT``, sorted by PeerID.

    Args:
        answered: filled as peers answer, so a caller whose deadline cuts the walk short
            keeps the peers found so far.
        request_timeout: seconds for a peer's first answer, its connection included (at
            ~430 ms round trips with 2 % loss, 3 s left a live peer out of one walk in 6:
            a trial), and then for the rest of its answers.
        elsewhere: filled with the other ``HOST:PORT``s at which a PeerID in ``answered``
            answered too (each proved it in its handshake): another process with its key.
        short_of_files: filled with the ``HOST:PORT``s not asked because this process had no
            file descriptor left to dial them with (the walk is then incomplete).

    Each peer's connection is closed once it answered every target (the node's own
    contacts' too: its join held one each; it dials again when it needs one), and a
    peer not dialed for want of a file descriptor is visited again later (3 times at
    most) with half as many visits at once: a walk that kept every connection and gave
    up on those peers listed at most the file limit less 9 peers (an outside tester,
    under ``ulimit -n 24``: 15 of 30).

    One address, one node: once a PeerID answered at a ``HOST:PORT``, or a visit there
    timed out, other PeerIDs named at it are not visited, and a wave visits one PeerID
    per ``HOST:PORT`` (the others wait for the next): a hostile node naming 64 made-up
    peers per target at an address that never answers made every walk time out (an
    outside review: ``swarm status`` exited 1 after 21-22 s in 5 of 5 runs).

    Raises:
        SwarmError: never for an unreachable peer; those are skipped.
    """
    rng = random.Random(0)
    targets = [DHTID(rng.getrandbits(ID_BITS)) for _ in range(_TARGETS_PER_PEER)]
    if answered is None:
        answered = {}
    short = set() if short_of_files is None else short_of_files
    retried: dict[str, int] = {}
    again: list[Address] = []
    seen: set[str] = set()
    settled: dict[str, PeerID | None] = {}  # HOST:PORT -> who answered there (None: silent)
    frontier: list[Address] = [addr for _, addr in _known(node)]
    limiter = trio.CapacityLimiter(max_parallel)
    # a full node names itself as any request of its DHT does: asked without a sender, a
    # peer takes it for one that restarted in client mode, and drops it from its table
    sender = node.dht.protocol.sender

    async def ask(address: Address, target: DHTID, found: list[Address]) -> bool:
        try:
            reply = await node.rpc.call(
                address, "dht.find_node", FindNodeRequest(sender=sender, target=target).to_body()
            )
            response = FindNodeResponse.from_body(reply.body)
        except (SwarmError, OSError) as exc:
            if out_of_files(exc):
                short.add(address.hostport)
            logger.debug("crawl: %s did not answer: %s", address, exc)
            return False
        if address.peer_id is not None:
            first = answered.setdefault(address.peer_id, address.hostport)
            if first != address.hostport and elsewhere is not None:
                elsewhere.setdefault(address.peer_id, set()).add(address.hostport)
        nodes = heapq.nsmallest(
            _TAKEN_PER_ANSWER, response.nodes, key=lambda n: DHTID.from_peer_id(n.peer_id) ^ target
        )
        for info in nodes:
            if info.address is not None:
                found.append(Address.parse(info.address).with_peer_id(info.peer_id))
        return True

    async def visit(address: Address, found: list[Address]) -> None:
        # the targets at once: asked one after another, each a round trip, 16 peers took
        # 12-14 s at 400 ms round trip (a trial), against status's 20 s timeout; a frozen
        # or stalling peer still costs one request_timeout
        async with limiter:
            if address.peer_id is not None:
                visiting[address.peer_id] = visiting.get(address.peer_id, 0) + 1
            with trio.move_on_after(request_timeout) as scope:
                # the first (a new connection's handshake) alone: the others reuse it
                if await ask(address, targets[0], found):
                    settled[address.hostport] = address.peer_id
                    async with trio.open_nursery() as nursery:
                        own = DHTID.from_peer_id(address.peer_id or node.peer_id)
                        for target in [*targets[1:], own]:
                            nursery.start_soon(ask, address, target, found)
            if address.peer_id is not None:
                visiting[address.peer_id] -= 1
                # (not while its twin at another address is asked: one key, two processes)
                if not visiting[address.peer_id]:
                    await node.rpc.disconnect(address.peer_id)
            if scope.cancelled_caught:
                logger.debug("crawl: %s did not answer within %s s", address, request_timeout)
                settled.setdefault(address.hostport, None)
            key = str(address)
            if address.hostport in short and retried.get(key, 0) < 3:
                retried[key] = retried.get(key, 0) + 1
                short.discard(address.hostport)
                limiter.total_tokens = max(1, limiter.total_tokens // 2)
                again.append(address)

    def taken(address: Address) -> bool:
        """Whether another PeerID answered at its HOST:PORT, or a visit there timed out,
        or its PeerID was visited at _MAX_ADDRESSES_PER_PEER others."""
        at = addresses.get(address.peer_id) if address.peer_id is not None else None
        if at is not None and len(at) >= _MAX_ADDRESSES_PER_PEER and address.hostport not in at:
            return True
        if address.hostport not in settled:
            return False
        return settled[address.hostport] is None or settled[address.hostport] != address.peer_id

    visiting: dict[PeerID, int] = {}
    addresses: dict[PeerID, set[str]] = {}  # where each PeerID was visited
    while frontier:
        found: list[Address] = []
        later: list[Address] = []  # another PeerID at the same HOST:PORT in this wave
        async with trio.open_nursery() as nursery:
            hosts: set[str] = set()
            for address in frontier:
                key = str(address)
                if key in seen or taken(address):
                    continue
                if address.hostport in hosts:
                    later.append(address)
                    continue
                hosts.add(address.hostport)
                seen.add(key)
                if address.peer_id is not None:
                    addresses.setdefault(address.peer_id, set()).add(address.hostport)
                nursery.start_soon(visit, address, found)
        frontier = [a for a in [*later, *found] if str(a) not in seen]
        for address in again:  # visited anew (out of file descriptors)
            seen.discard(str(address))
        frontier += again
        again = []
    return sorted(answered.items())


def _known(node: Peer) -> list[tuple[PeerID, Address]]:
    return [
        (pid, Address.parse(addr).with_peer_id(pid))
        for pid, addr in node.dht.routing_table_peers()
        if addr is not None
    ]
