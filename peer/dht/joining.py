"""Joining the network: the initial peers dialed and pinged (those busy dialed again, backing
off), contacts known from before dialed again, and why each one failed, for the caller's
error message. A part of :class:`peer.dht.node.DHT`, kept apart from its lookups and records.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import trio

from protocol.address import Address
from protocol.errors import SwarmError
from protocol.identity import PeerID
from protocol.messages import NodeInfo
from protocol.noise import IdentityMismatchError

from ..errors import DuplicateIdentityError, PeerBusyError, SelfDialError

if TYPE_CHECKING:
    from .node import DHT

logger = logging.getLogger(__name__)

_CONTACT_AT_ONCE = 32  # known contacts dialed at once (see Joining.contact)
_OWN_ADDRESS = "that is this peer's own address"
# Initial peers that turned us away as busy (their limits for our address, which a crowd
# behind our NAT joining at once uses up) are dialed again after a mean delay of this
# much, doubling up to _BUSY_RETRY_MAX, each delay jittered by x0.5-1.5 so that the crowd
# spreads out (the limit refills at 16 connections per second).
_BUSY_RETRY_FIRST = 0.5
_BUSY_RETRY_MAX = 4.0


class Joining:
    """How a :class:`DHT` joins: through its initial peers, or contacts known from before."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht
        self.initial_peers: list[Address] = []
        # initial peers that did not answer at the last contact -> why (for error messages)
        self.contact_errors: dict[str, str] = {}
        # HOST:PORT of each initial peer that answered (handshake and ping) -> its PeerID
        self.answered: dict[str, PeerID] = {}
        self._twins: set[str] = set()  # initial peers that proved our own PeerID
        # initial peers whose address proved another PeerID, each said once (with it)
        self._changed_identities: set[tuple[str, PeerID]] = set()

    async def bootstrap(self, initial_peers: Sequence[Address], *, warn: bool = True) -> int:
        """Join through ``initial_peers``: ping them, then look up our own id.

        The join goes on as soon as one of them answered; the others are still dialed in
        the background (see ``_contact``). When none answered but some turned us away as
        busy, those are dialed again with jittered exponential backoff until one answers;
        no new try starts after ``busy_join_timeout`` (each one is bounded by
        ``request_timeout``).

        Args:
            warn: log a warning naming each initial peer when none answered (off when the
                caller raises that instead).

        Returns:
            How many initial peers had answered when the join went on (0: we are alone,
            e.g. the first node).

        Raises:
            Nothing for unreachable peers: they count as not answering.
        """
        deadline = trio.current_time() + self._dht.config.busy_join_timeout
        self.initial_peers = list(dict.fromkeys(initial_peers))  # each one contacted once
        # a peer that joined a network is alarmed to lose it; its first node is not (a
        # bootstrap node whose volunteers all ended their run)
        self._dht.protocol.has_initial_peers = bool(self.initial_peers)
        reached, busy = await self._contact(self.initial_peers, until_one=True)
        if not reached and busy and self._dht.config.busy_join_timeout > 0:
            reached = await self._retry_busy(busy, deadline)
        if reached:
            await self._dht.find_nodes(self._dht.node_id)
            await self._dht._upkeep.refresh_far_buckets()
        else:
            # our own address among them is no failure (the same list on every host)
            others = [  # (a twin, another process with our key, is worth the warning)
                a
                for a in self.initial_peers
                if self.contact_errors.get(str(a)) != _OWN_ADDRESS
                and (a.peer_id != self._dht.peer_id or str(a) in self._twins)
            ]
            if others and warn:
                tried = "; ".join(
                    f"{a}: {self._said(str(a)) or self.contact_errors.get(str(a), '?')}"
                    for a in others
                )
                logger.warning("no initial peer answered (tried %s)", tried)
        return reached

    async def contact(self, addresses: Sequence[Address]) -> list[Address]:
        """Dial and ping each of ``addresses`` (those with our own PeerID, or one already in
        the routing table, skipped), at most ``_CONTACT_AT_ONCE`` at a time, each dial
        within the host's ``dial_timeout`` and its ping within ``request_timeout``: those
        that answer join the routing table and learn our address. Then, if any answered,
        look up our own id, as a join does. For contacts known from before, such as a
        restarted bootstrap node's saved ones (``peer.contacts``): unlike initial peers,
        one that does not answer is said at DEBUG only and never tried again here.

        Returns:
            Those that answered.
        """
        self._dht._check_running()
        answered: list[Address] = []
        limiter = trio.CapacityLimiter(_CONTACT_AT_ONCE)

        async def one(address: Address) -> None:
            async with limiter:  # (held while the dial runs: a dial outlives no waiter here)
                try:
                    peer_id = await self._dht.host.connect(address)
                except (SwarmError, OSError) as exc:
                    logger.debug("contact %s: %r", address, exc)
                    return
                if peer_id != self._dht.peer_id and await self._dht.protocol.ping(
                    NodeInfo(peer_id, address.hostport)
                ):
                    answered.append(address)

        # (one in the table already is skipped: at an old address, the call would reach it
        # over its pooled connection, answer, and put that address back in the table)
        wanted = [
            a
            for a in dict.fromkeys(addresses)
            if a.peer_id != self._dht.peer_id
            and (a.peer_id is None or a.peer_id not in self._dht.table)
        ]
        async with trio.open_nursery() as nursery:
            for address in wanted:
                nursery.start_soon(one, address)
        if answered:
            await self._dht.find_nodes(self._dht.node_id)
        return answered

    async def redial_missing(self) -> None:
        """Dial and ping again the initial peers missing from the routing table (a refresh
        does: it heals a partition that emptied the table of them)."""
        missing = [a for a in self.initial_peers if a.peer_id not in self._dht.table]
        if missing:
            await self._contact(missing)

    async def _retry_busy(self, busy: list[Address], deadline: float) -> int:
        """Dial the initial peers in ``busy`` again, backing off, until one answers, none
        is busy any more, or the next try would start after ``deadline`` (trio time).

        Returns:
            How many answered at the try that ended it (0: none did).
        """
        logger.info(
            "initial peers busy (at their connection limits for our address, as when many"
            " peers behind one NAT join at once): trying %s again for up to %.0f s",
            ", ".join(str(a) for a in busy),
            max(deadline - trio.current_time(), 0.0),
        )
        started, tries, delay = trio.current_time(), 1, _BUSY_RETRY_FIRST
        while busy:
            wait = delay * self._dht._rng.uniform(0.5, 1.5)
            if trio.current_time() + wait > deadline:
                break
            await trio.sleep(wait)
            delay = min(2 * delay, _BUSY_RETRY_MAX)
            tries += 1
            reached, busy = await self._contact(busy, until_one=True)
            if reached:
                logger.debug("joined after %d tries", tries)
                return reached
        elapsed = trio.current_time() - started
        for address in busy:  # the final error says how long they stayed busy
            key = str(address)
            self.contact_errors[key] = (
                f"busy at each of {tries} tries over {elapsed:.0f} s: {self.contact_errors[key]}"
            )
        return 0

    async def _contact(
        self, addresses: Sequence[Address], *, until_one: bool = False
    ) -> tuple[int, list[Address]]:
        """Dial and ping each of ``addresses`` (``contact_errors`` says why one failed).

        ``until_one``: return once one answered; the others go on in the service nursery
        (each within ``request_timeout``), and those that answer join the routing table.
        A silent one (it accepts connections and never answers: a hung process, a proxy
        that black-holes) held every join up for the whole ``request_timeout``.

        Returns:
            How many had answered by then, and those that turned us away as busy
            (PeerBusyError).
        """
        reached = 0
        busy: list[Address] = []
        pending = len(addresses)
        settled = trio.Event()  # every one is done, or (until_one) one answered

        async def one(address: Address) -> None:
            nonlocal pending
            try:
                await dial(address)
            finally:
                pending -= 1
                if not pending or (until_one and reached):
                    settled.set()

        async def dial(address: Address) -> None:
            nonlocal reached
            key = str(address)
            self.contact_errors[key] = f"no answer within {self._dht.config.request_timeout} s"
            peer_id: PeerID | None = None
            with trio.move_on_after(self._dht.config.request_timeout):
                try:  # (a pooled connection is reused; a new one proves the id)
                    peer_id = await self._dht.host.connect(address)
                except DuplicateIdentityError as exc:  # another process with our key
                    self.contact_errors[key] = str(exc)
                    self._twins.add(key)
                    return
                except SelfDialError:  # our own HOST:PORT, given without a PeerID
                    self.contact_errors[key] = _OWN_ADDRESS
                    return
                except PeerBusyError as exc:  # up, but not now: bootstrap tries it again
                    logger.debug("initial peer %s: %r", address, exc)
                    self.contact_errors[key] = str(exc)
                    busy.append(address)
                    return
                except (SwarmError, OSError) as exc:
                    logger.debug("initial peer %s: %r", address, exc)
                    self.contact_errors[key] = str(exc) or type(exc).__name__
                    if (mismatch := cause_of_type(exc, IdentityMismatchError)) is not None:
                        self._identity_changed(key, address, mismatch)
                    return
                if peer_id == self._dht.peer_id:
                    self.contact_errors[key] = _OWN_ADDRESS
                    return
            if peer_id is None:  # no connection within request_timeout
                return
            # The ping has its own request_timeout: a crowd of volunteer processes starting
            # on busy cores had handshakes done 2.85 s into the 3 s, and the ping then cut
            # off, the volunteer sent home ("no answer within 3.0 s") by a bootstrap node
            # that had logged it joining (an outside tester: 8-14 of 32 in 5 of 7 runs).
            failure = await self._dht.protocol.ping_or_why(NodeInfo(peer_id, address.hostport))
            if failure is None:
                reached += 1
                self.contact_errors.pop(key, None)  # (the same address given twice)
                self.answered[address.hostport] = peer_id
            else:
                self.contact_errors[key] = failure

        background = self._dht._service if until_one else None
        if background is None:  # (or bootstrap() before serve(): all of them, as before)
            async with trio.open_nursery() as nursery:
                for address in addresses:
                    nursery.start_soon(one, address)
        elif addresses:
            for address in addresses:
                background.start_soon(one, address)
            await settled.wait()
        return reached, list(busy)

    def _said(self, key: str) -> str:
        """A short stand-in for an initial peer's error already logged in full (the
        changed identity), so that a summary does not repeat ~300 characters."""
        if any(warned == key for warned, _ in self._changed_identities):
            return "answers with another identity (the warning above)"
        return ""

    def _identity_changed(self, key: str, address: Address, exc: IdentityMismatchError) -> None:
        """An initial peer's address proved another identity: its node lost its key file
        (or another program took its port). Said once per address and identity, at
        WARNING, since it is re-tried at every refresh and nothing else would tell (a
        trial: volunteers given a restarted bootstrap's old address never found it again,
        and only DEBUG said why)."""
        hostport = address.hostport
        text = (
            f"{hostport} now answers with another identity, {exc.actual}, not {exc.expected}:"
            f" that node lost its key file (or another program took its port); give"
            f" {exc.actual}@{hostport}, or {hostport} to accept any identity there"
        )
        self.contact_errors[key] = text
        if (key, exc.actual) not in self._changed_identities:
            if len(self._changed_identities) >= 1024:
                self._changed_identities.clear()
            self._changed_identities.add((key, exc.actual))
            logger.warning("initial peer %s: %s", address, text)


_E = TypeVar("_E", bound=BaseException)


def cause_of_type(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of ``kind`` in ``exc``'s chain of causes (``exc`` included)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 16:
        if isinstance(current, kind):
            return current
        current, seen = current.__cause__, seen + 1
    return None
