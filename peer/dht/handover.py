"""Handing keys over to a newcomer: the keys we hold for which a new contact is among the k
closest nodes go to it at once (the Kademlia paper's join rule), from the few closest holders
of each. A part of :class:`peer.dht.node.DHT`, kept apart from its lookups and records.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from protocol.dhtid import DHTID
from protocol.errors import SwarmError
from protocol.messages import NodeInfo
from protocol.records import MAX_ENTRIES_PER_STORE

from .bounded import each_bounded

if TYPE_CHECKING:
    from .node import DHT

logger = logging.getLogger(__name__)

_HANDOVER_QUEUE = 64
_HANDOVER_MAX_KEYS = 10_000  # a handover scans every key we hold, once per new contact
# The closest holders of a key that hand it to a newcomer: more than one, because the
# closest may not know the newcomer, or may not hold the key yet (its own handover is
# still on the way when the newcomer meets it).
_HANDOVER_SENDERS = 3
_HANDOVER_PARALLEL = 8  # STOREs in flight to one newcomer (a round trip each, one key each)
_HANDOVER_NEWCOMERS = 4  # newcomers served at once


class Handover:
    """Hands a :class:`DHT`'s keys over to new contacts (only a node that stores keys)."""

    def __init__(self, dht: DHT) -> None:
        self._dht = dht
        # New contacts whose keys we may hold, for the handover task (bounded: a burst of
        # joins drops some, and republish covers those).
        self._newcomers_send, self._newcomers = trio.open_memory_channel[tuple[NodeInfo, bool]](
            _HANDOVER_QUEUE
        )

    def on_new_contact(self, node: NodeInfo, check: bool = False) -> None:
        """A contact new to the routing table: hand it the keys it should hold (queued);
        ``check``: a known one that may have restarted, handed them only if it lacks one
        (see :meth:`hand_over`)."""
        try:
            self._newcomers_send.send_nowait((node, check))
        except trio.WouldBlock:
            logger.debug("handover queue full: %s waits for republish", node.peer_id.short())

    async def run(self) -> None:
        """Hand keys over to the queued newcomers, a few at a time, until cancelled."""
        slots = trio.Semaphore(_HANDOVER_NEWCOMERS)  # the rest wait in the bounded queue

        async def one(node: NodeInfo, check: bool) -> None:
            try:
                await self.hand_over(node, check=check)
            except SwarmError:
                logger.debug("handover to %s failed", node.peer_id.short(), exc_info=True)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            async for node, check in self._newcomers:
                await slots.acquire()
                nursery.start_soon(one, node, check)

    async def hand_over(self, node: NodeInfo, *, check: bool = False) -> int:
        """Store at ``node``, a new contact, the keys we hold for which it is among the k
        closest nodes we know, when we are among the ``_HANDOVER_SENDERS`` (3) closest to the
        key of the others (the paper's join rule, with a few senders per key, not all k).
        With ``check`` (a known contact that may have restarted), first ask it for the first
        of those keys: nothing is handed over when it holds some of it.

        Returns:
            How many keys were handed over.

        Raises:
            Nothing for an unreachable node: what it does not get, republish brings.
        """
        if self._dht.storage is None:
            return 0
        if len(self._dht.storage) > _HANDOVER_MAX_KEYS:
            return 0  # one pass per newcomer would cost too much: republish covers it
        new_id = DHTID.from_peer_id(node.peer_id)
        # Counting the contacts closer to the key than us (or the newcomer) among all of
        # them decides as among the k + 1 nearest would (the thresholds are at most k),
        # without sorting the table or rehashing ids once per key (~5x less CPU).
        others = self._dht.table.contact_ids(exclude=node.peer_id)
        k = self._dht.config.store_replicas
        todo: list[tuple[DHTID, str]] = []
        for index, key_id in enumerate(self._dht.storage.keys()):
            if index % 256 == 255:
                await trio.lowlevel.checkpoint()
            name = self._dht.storage.name_of(key_id)
            if name is None:
                continue
            if should_hand_over(others, key_id, self._dht.node_id, new_id, k):
                todo.append((key_id, name))
                if check:
                    break  # one is enough to ask about
        if check and todo:
            reply = await self._dht.protocol.find_value(node, todo[0][0])
            if reply is None or reply.entries:
                return 0  # gone, or it kept its storage: no restart to make up for
            return await self.hand_over(node)
        sent = 0

        async def one(job: tuple[DHTID, str]) -> None:
            nonlocal sent
            assert self._dht.storage is not None
            key_id, name = job
            entries = tuple(self._dht.storage.get(key_id).values())
            for start in range(0, len(entries), MAX_ENTRIES_PER_STORE):
                chunk = entries[start : start + MAX_ENTRIES_PER_STORE]
                reply = await self._dht.protocol.store(node, key_id, name, chunk, want_nodes=False)
                if reply is None:  # gone or unreachable: republish covers the rest
                    raise _NewcomerGone
            sent += bool(entries)

        try:
            await each_bounded(todo, one, _HANDOVER_PARALLEL)
        except* _NewcomerGone:
            pass  # the other workers were cancelled with it
        if sent:
            logger.debug("handed %d keys over to %s", sent, node.peer_id.short())
        return sent


class _NewcomerGone(Exception):
    """A handover STORE failed: the newcomer left or cannot be reached."""


def should_hand_over(others: Sequence[int], key: int, us: int, newcomer: int, k: int) -> bool:
    """Whether we hand ``key`` to ``newcomer``: it is among the k closest to the key of
    the nodes we know (``others``: our contacts' ids, the newcomer's excluded, and us), and
    we are among the ``_HANDOVER_SENDERS`` closest of them (the closer ones send it)."""
    ours, theirs = us ^ key, newcomer ^ key
    if _count_closer(others, key, ours, _HANDOVER_SENDERS) >= _HANDOVER_SENDERS:
        return False  # closer holders hand it over
    needed = k - (ours < theirs)
    return _count_closer(others, key, theirs, needed) < needed


def _count_closer(ids: Sequence[int], key: int, distance: int, enough: int) -> int:
    """How many of ``ids`` are closer to ``key`` than ``distance``, counting up to ``enough``."""
    count = 0
    for other in ids:
        if other ^ key < distance:
            count += 1
            if count >= enough:
                break
    return count
