"""A host's budget for frames on their way out, over all of its connections together.

Each connection queues at most ``QUEUE_BYTES`` of frames for its writer (``peer.wire.Outbox``)
so that a peer that stops reading holds our memory to that, not to every reply it asked
for. Per connection that was not enough: a client that opened 128 connections, asked on
each for 1 MiB FIND_VALUE pages and read none made a bootstrap node hold 1.3 GB (an outside
tester; the queue, the batch being written and the reply waiting for room, ~9 MiB a
connection, and up to 1,024 connections). So frames of ``CHARGED_FROM`` bytes or more take
their size from this budget when they are queued and give it back once written (or
withdrawn, or their connection closed); a frame that does not fit waits, its producer
with it (a handler, a result stream, a caller's upload), and a quick request's large
reply waits in its connection's queue of quick requests, as the handler's reply object
(it is encoded again once there is room: no copy of it held meanwhile).

- One remote host (an IPv4 address, an IPv6 /64: ``peer.remote_hosts.host_group``) may be
  held to ``per_host`` of it (but always one frame), so that one host's unread replies
  do not hold every other host's back; loopback hosts are not counted apart. Off by
  default (``HostConfig.send_budget_per_host``), as for the receive budget: the peers of
  a NAT share one address. ``swarm bootstrap`` sets it.
- A frame larger than what is free goes out alone, once nothing else is charged.
- Smaller frames (pings, DHT lookups and their replies) take nothing from it: they never
  wait behind others' large replies; each connection queues at most ``capacity`` of them
  (but a quick request queued behind one of its own connection's large replies answers in
  turn).
- A connection whose peer reads nothing holds its share until ``HostConfig.send_timeout``
  cuts it off (its write stalled): other hosts' large frames wait for room meanwhile.
"""

from __future__ import annotations

from collections import Counter

import trio

__all__ = ["CHARGED_FROM", "SendBudget", "Wait"]

CHARGED_FROM = 4 << 10
"""Frames of at least this many bytes count against the budget (a DHT lookup's reply of 20
contacts is ~1.6 KB; a FIND_VALUE page or a result chunk is up to megabytes)."""


class Wait:
    """One frame waiting for room: woken (``event``) when it may fit, or when its
    connection closes (its outbox sets the event itself)."""

    __slots__ = ("event", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.event = trio.Event()


class SendBudget:
    """Bytes of queued outbound frames, all connections together, at most ``limit`` (and
    ``per_host`` for one remote host group, when given). Waiting frames are woken oldest
    first, as many as the room given back may take (not all of them on every give-back: a
    thousand connections' waiters, each woken to find no room, cost ~4 ms a give-back in a
    reviewer's microbenchmark)."""

    def __init__(self, limit: int, per_host: int | None = None) -> None:
        if limit < 1 or (per_host is not None and per_host < 1):
            raise ValueError("a send budget must be at least one byte (and its host share)")
        self.limit = limit
        self.per_host = per_host
        self.used = 0
        self._by_group: Counter[str] = Counter()
        self._waiting: list[Wait] = []  # for the total, oldest first
        self._share: dict[str, list[Wait]] = {}  # for a host's share, oldest first

    def fits(self, size: int, group: str | None) -> bool:
        """Whether a frame of ``size`` bytes to ``group`` may be queued now (always, when
        nothing is charged: a frame larger than the budget goes alone)."""
        return not self._blocked(size, group)

    def _blocked(self, size: int, group: str | None) -> str:
        """ "total" or "host" when a frame of ``size`` does not fit that limit now, else ""."""
        if self.used and self.used + size > self.limit:
            return "total"
        if self.per_host is not None and group is not None:
            held = self._by_group.get(group, 0)
            if held and held + size > self.per_host:
                return "host"
        return ""

    def take(self, size: int, group: str | None) -> None:
        self.used += size
        if group is not None:
            self._by_group[group] += size

    def give(self, size: int, group: str | None) -> None:
        if not size:
            return
        self.used -= size
        if group is not None:
            left = self._by_group[group] - size
            if left > 0:
                self._by_group[group] = left
            else:
                del self._by_group[group]
            waits = self._share.get(group)
            if waits:
                held = self._by_group.get(group, 0)
                assert self.per_host is not None
                self._wake(waits, self.per_host - held, held == 0)
        self._wake(self._waiting, self.limit - self.used, self.used == 0)

    @staticmethod
    def _wake(waits: list[Wait], room: int, empty: bool) -> None:
        """Wake the oldest waiters whose frames fit ``room`` together (the first one
        whatever its size when nothing is held: it goes alone). A waiter woken and not run
        yet counts against the room too; it leaves the list once it runs."""
        for wait in waits:
            if wait.size > room and not empty:
                return
            empty = False
            room -= wait.size
            wait.event.set()

    async def wait(self, size: int, group: str | None, mine: set[Wait]) -> None:
        """Until a frame of ``size`` to ``group`` may fit: what blocks it (the total, or the
        host's share) was given back, as far as its turn goes. ``mine`` holds the wait
        meanwhile, for its outbox to wake on close (then check that)."""
        if self._blocked(size, group) == "host" and group is not None:
            waits = self._share.setdefault(group, [])
        else:
            waits = self._waiting
        wait = Wait(size)
        waits.append(wait)
        mine.add(wait)
        try:
            await wait.event.wait()
        finally:
            mine.discard(wait)
            waits.remove(wait)
            if not waits and group is not None and self._share.get(group) is waits:
                del self._share[group]
