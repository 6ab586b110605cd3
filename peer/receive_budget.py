"""A host's budget for large frames on their way in, over all of its connections together.

A frame's 4-byte header announces its length (up to ``max_frame_size``, 4 MiB by default)
before the bytes come. Without a common bound, peers that announce large frames, send part
of each and stall make the host hold that memory on every connection at once: a trial held
2.6 GB with 600 connections that each sent 2.2 MiB of a 4 MiB frame, on a bootstrap node
meant to stay small. So a reader takes a frame's length from the budget before it reads the
frame's body, and gives it back once the frame is whole (the payload then belongs to
whoever handles it, e.g. a reducer within its ``retain_budget``).

- One remote host (an IPv4 address, an IPv6 /64: ``peer.remote_hosts.host_group``) may be
  held to ``host_limit`` of it (but always room for one frame), so that one host cannot
  take it all; loopback hosts are not counted apart (local experiments run every peer on
  127.0.0.1). Off by default (``HostConfig.receive_budget_per_host``): the peers of a NAT
  share one address, and 17 averaging peers behind one, limited to an eighth of the
  budget at each other's, lost nearly whole rounds on 10 Mbit/s links (their frames
  waited, and a connection whose frame waits is not read: the pings on it went
  unanswered). ``swarm bootstrap`` sets it.
- When the budget (or the host's share) is spent, a reader waits; its peer is not read
  meanwhile, so TCP holds the sender back. Frames get room in the order they asked (a
  large one is not starved by smaller ones), but for one that waits for its own host's
  share: frames from other hosts go past it. A waiting connection is neither silent nor
  idle: we send keepalives on it meanwhile (``peer.rpc``), and an honest upload may wait
  longer than ``idle_timeout`` behind a slow frame. It holds a connection slot, not a
  buffer; parked connections end once their frame gets room and stalls (below).
- While a frame waits, frames that are not arriving are cut off to make room (their
  connections end with a protocol error): one that got no byte for ``stall_timeout``, or,
  once it is ``stall_timeout`` old, that got less than ``MIN_RATE`` bytes per second on
  average since it began, or so little that the rest would take more than
  ``FINISH_WITHIN`` stall timeouts at that average; only the waiting frame's own host's,
  when it waits for that host's share (cutting off another host's would free nothing it
  can use). A peer that trickles bytes to keep its place must send at that rate, for
  every frame it holds: a 4 MiB frame within ~40 s.
- A frame larger than the whole budget goes in alone. Small frames (under 64 KiB) take
  nothing from it: each connection reads at most one frame at a time, and
  ``HostConfig.max_connections`` bounds those.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import trio

__all__ = ["MIN_RATE", "ByteMeter", "FrameHold", "Meter", "ReceiveBudget"]

FINISH_WITHIN = 3
"""A frame that others wait behind counts as stalled, once ``stall_timeout`` old, when at its
average rate the rest of it would take more than this many stall timeouts (30 s by default):
two peers that trickled a 4 MiB frame each at 24 KiB/s, just above ``MIN_RATE``, held a
bootstrap node's whole 8 MiB for ~3 minutes, and every larger store waited (an outside
tester). An honest 1.1 MB store over a 1 Mbit/s link takes ~9 s (1.1 MB at 125 KB/s)."""
MIN_RATE = 16 << 10
"""Bytes per second below which a frame that others wait behind counts as stalled (a
writer to a peer that reads slower than ~17 KiB/s is cut off too: ``HostConfig.send_timeout``)."""


class Meter(Protocol):
    """Where a frame's bytes are counted as they arrive (a ``SecureStream`` counts them,
    whole messages or not)."""

    @property
    def last_received(self) -> float: ...

    @property
    def bytes_received(self) -> int: ...


class ByteMeter:
    """A meter for streams that count nothing themselves: the reader counts."""

    __slots__ = ("bytes_received", "last_received")

    def __init__(self) -> None:
        self.last_received = -math.inf
        self.bytes_received = 0


class FrameHold:
    """One frame's share of the budget while it arrives; ``scope`` is cancelled to cut it off."""

    __slots__ = ("_base", "_meter", "group", "scope", "size", "started")

    def __init__(
        self, size: int, group: str | None, meter: Meter, now: float, arrived: int = 0
    ) -> None:
        self.size = size
        self.group = group
        self.started = now
        self.scope = trio.CancelScope()
        self._meter = meter
        self._base = meter.bytes_received - arrived  # bytes of it in already count

    def stalled_until(self, stall_timeout: float) -> float:
        """When the frame counts as stalled if nothing more arrives: no byte for
        ``stall_timeout``; or, once that old, an average rate under ``MIN_RATE``, or too
        slow to bring the rest within ``FINISH_WITHIN`` stall timeouts more."""
        received = self._meter.bytes_received - self._base
        last = max(self._meter.last_received, self.started)
        remaining = max(0, self.size - received)
        least_rate = max(MIN_RATE, remaining / (FINISH_WITHIN * stall_timeout))
        slow_until = max(self.started + stall_timeout, self.started + received / least_rate)
        return min(last + stall_timeout, slow_until)


class _Waiter:
    __slots__ = ("arrived", "event", "group", "hold", "meter", "size")

    def __init__(self, size: int, group: str | None, meter: Meter, arrived: int = 0) -> None:
        self.size = size
        self.group = group
        self.meter = meter
        self.arrived = arrived
        self.event = trio.Event()
        self.hold: FrameHold | None = None  # granted


class ReceiveBudget:
    """At most ``limit`` bytes of large frames being received at once, ``host_limit`` of it
    from one remote host group (None: no limit apart). Frames get room in the order they
    asked, but for one that waits for its own host's share: other hosts' frames go past it."""

    def __init__(self, limit: int, stall_timeout: float, host_limit: int | None = None) -> None:
        self.limit = limit
        self.stall_timeout = stall_timeout
        self.host_limit = limit if host_limit is None else host_limit
        self.used = 0
        self.cut_off = 0  # stalled frames cut off to make room (for tests and stats)
        self._by_group: Counter[str] = Counter()
        self._holds: set[FrameHold] = set()
        self._waiters: list[_Waiter] = []  # oldest first

    async def acquire(
        self,
        size: int,
        group: str | None,
        meter: Meter,
        keepalive: Callable[[], None] | None = None,
        every: float = math.inf,
        arrived: int = 0,
    ) -> FrameHold:
        """Take ``size`` bytes for one frame from remote host ``group`` (None: counted in
        the total only), waiting for room and cutting off stalled frames to make it; give
        them back with :meth:`release`. While it waits, ``keepalive()`` runs every
        ``every`` seconds (the peer, not read meanwhile, must not take us for gone).
        ``arrived``: bytes of the frame the stream holds already (not read while it
        waits: they count as received, not as still to come, a review)."""
        waiter = _Waiter(size, group, meter, arrived)
        self._waiters.append(waiter)
        next_keepalive = trio.current_time() + every
        try:
            self._grant({group})
            while waiter.hold is None:
                # the oldest frame waiting for the total cuts off stalled frames of any
                # host; one waiting for its host's share, only that host's
                blocked = self._blocked(size, group)
                if blocked and self._first_blocked(blocked, group) is waiter:
                    wake_at = self._cut_off_stalled(None if blocked == "total" else group)
                else:
                    wake_at = math.inf
                # room granted, a frame stalls enough, or a keepalive is due
                with trio.move_on_at(min(wake_at, next_keepalive)):
                    await waiter.event.wait()
                waiter.event = trio.Event()
                now = trio.current_time()
                if keepalive is not None and waiter.hold is None and now >= next_keepalive:
                    keepalive()
                    next_keepalive = now + every
        except BaseException:
            if waiter.hold is not None:  # granted as we were cancelled
                self.release(waiter.hold)
            raise
        finally:
            self._waiters.remove(waiter)
            self._grant({group})  # (it may have held up the frames behind it)
        return waiter.hold

    def release(self, hold: FrameHold) -> None:
        """The frame is whole, or its reading ended."""
        if hold in self._holds:
            self._holds.discard(hold)
            self.used -= hold.size
            if hold.group is not None:
                self._by_group[hold.group] -= hold.size
                if not self._by_group[hold.group]:
                    del self._by_group[hold.group]
            self._grant({hold.group})

    def _grant(self, changed: set[str | None]) -> None:
        """Give room to the waiting frames that fit, oldest first; one that does not fit
        the total stops the others (a large frame is not starved by smaller ones), one
        that waits for its host's share does not. The first of those that still wait for
        the total, and the first of each host's that wait for its share when that host's
        frames or waiters ``changed`` (or it got room for one now), are woken too: they
        are the ones that cut off stalled frames, and the frames now held are new (the
        next waiter used to sleep on when the one before it left, and nothing was cut off
        again; waking every host's on every change cost a core with 60 hosts waiting)."""
        hosts_seen: set[str | None] = set()
        for waiter in self._waiters:
            if waiter.hold is not None:
                continue
            blocked = self._blocked(waiter.size, waiter.group)
            if blocked == "total":
                waiter.event.set()
                return
            if blocked == "host":
                if waiter.group not in hosts_seen:
                    hosts_seen.add(waiter.group)
                    if waiter.group in changed:
                        waiter.event.set()
                continue
            waiter.hold = self._take(waiter.size, waiter.group, waiter.meter, waiter.arrived)
            changed.add(waiter.group)
            waiter.event.set()

    def _first_blocked(self, blocked: str, group: str | None) -> _Waiter | None:
        """The oldest waiter blocked by ``blocked`` ("total", or "host": of ``group``)."""
        for waiter in self._waiters:
            if (
                waiter.hold is None
                and (blocked == "total" or waiter.group == group)
                and self._blocked(waiter.size, waiter.group) == blocked
            ):
                return waiter
        return None

    def _take(self, size: int, group: str | None, meter: Meter, arrived: int = 0) -> FrameHold:
        hold = FrameHold(size, group, meter, trio.current_time(), arrived)
        self._holds.add(hold)
        self.used += size
        if group is not None:
            self._by_group[group] += size
        return hold

    def _cut_off_stalled(self, group: str | None) -> float:
        """Cut off the stalled frames (of ``group`` only, when given); returns when the
        next one will have stalled, if nothing more arrives for it."""
        now = trio.current_time()
        wake_at = math.inf
        for hold in self._holds:
            if hold.scope.cancel_called or (group is not None and hold.group != group):
                continue
            stalled_at = hold.stalled_until(self.stall_timeout)
            if now >= stalled_at:
                hold.scope.cancel()
                self.cut_off += 1
            else:
                wake_at = min(wake_at, stalled_at)
        return wake_at

    def _blocked(self, size: int, group: str | None) -> str:
        """ "total" or "host" when a frame does not fit that limit now, else ""."""
        if self.used and self.used + size > self.limit:
            return "total"
        if group is None:
            return ""
        held = self._by_group.get(group, 0)
        return "host" if held and held + size > self.host_limit else ""
