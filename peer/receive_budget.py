"""A host's budget for large frames on their way in, over all of its connections together.

A frame's 4-byte header announces its length (up to ``max_frame_size``, 4 MiB by default)
before the bytes come. Without a common bound, peers that announce large frames, send part
of each and stall make the host hold that memory on every connection at once: a trial held
2.6 GB with 600 connections that each sent 2.2 MiB of a 4 MiB frame, on a bootstrap node
meant to stay small. So a reader takes a frame's length from the budget before it reads the
frame's body, and gives it back once the frame is whole (the payload then belongs to
whoever handles it, e.g. a reducer within its ``retain_budget``).

- One remote host (an IPv4 address, an IPv6 /64: ``peer.remote_hosts.host_group``) holds
  at most ``share`` of the budget (but always room for one frame), so that one host cannot
  take it all; loopback hosts are not counted apart (local experiments run every peer on
  127.0.0.1).
- When the budget (or the host's share) is spent, a reader waits; its peer is not read
  meanwhile, so TCP holds the sender back.
- While a frame waits, frames that are not arriving are cut off to make room (their
  connections end with a protocol error): one that got no byte for ``stall_timeout``, or
  that got less than ``MIN_RATE`` bytes per second on average since it began, once it is
  ``stall_timeout`` old. A peer that trickles a byte now and then to keep its place must
  send at that rate, for every frame it holds.
- A frame larger than the whole budget goes in alone. Small frames (under 64 KiB) take
  nothing from it: each connection reads at most one frame at a time, and
  ``HostConfig.max_connections`` bounds those.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol

import trio

__all__ = ["MIN_RATE", "ByteMeter", "FrameHold", "Meter", "ReceiveBudget"]

MIN_RATE = 16 << 10
"""Bytes per second below which a frame that others wait behind counts as stalled (a
writer to a peer that reads slower than ~17 KiB/s is cut off too: ``HostConfig.send_timeout``)."""


class Meter(Protocol):
    """Where a frame's bytes are counted as they arrive (a ``SecureStream`` counts its
    ciphertext, whole messages or not)."""

    last_received: float
    bytes_received: int


class ByteMeter:
    """A meter for streams that count nothing themselves: the reader counts."""

    __slots__ = ("bytes_received", "last_received")

    def __init__(self) -> None:
        self.last_received = -math.inf
        self.bytes_received = 0


class FrameHold:
    """One frame's share of the budget while it arrives; ``scope`` is cancelled to cut it off."""

    __slots__ = ("_base", "_meter", "group", "scope", "size", "started")

    def __init__(self, size: int, group: str | None, meter: Meter, now: float) -> None:
        self.size = size
        self.group = group
        self.started = now
        self.scope = trio.CancelScope()
        self._meter = meter
        self._base = meter.bytes_received

    def stalled_until(self, stall_timeout: float) -> float:
        """When the frame counts as stalled if nothing more arrives: no byte for
        ``stall_timeout``, or under ``MIN_RATE`` on average once that old."""
        received = self._meter.bytes_received - self._base
        last = max(self._meter.last_received, self.started)
        slow_until = max(self.started + stall_timeout, self.started + received / MIN_RATE)
        return min(last + stall_timeout, slow_until)


class ReceiveBudget:
    """At most ``limit`` bytes of large frames being received at once, ``share`` of it from
    one remote host group."""

    def __init__(self, limit: int, stall_timeout: float, share: float = 0.125) -> None:
        self.limit = limit
        self.stall_timeout = stall_timeout
        self.host_limit = max(1, int(limit * share))
        self.used = 0
        self.cut_off = 0  # stalled frames cut off to make room (for tests and stats)
        self._by_group: Counter[str] = Counter()
        self._holds: set[FrameHold] = set()
        self._released = trio.lowlevel.ParkingLot()

    async def acquire(self, size: int, group: str | None, meter: Meter) -> FrameHold:
        """Take ``size`` bytes for one frame from remote host ``group`` (None: counted in
        the total only), waiting for room and cutting off stalled frames to make it; give
        them back with :meth:`release`."""
        while not self._fits(size, group):
            now = trio.current_time()
            wake_at = math.inf
            for hold in self._holds:
                if hold.scope.cancel_called:
                    continue
                stalled_at = hold.stalled_until(self.stall_timeout)
                if now >= stalled_at:
                    hold.scope.cancel()
                    self.cut_off += 1
                else:
                    wake_at = min(wake_at, stalled_at)
            with trio.move_on_at(wake_at):  # a release, or the next frame that stalls enough
                await self._released.park()
        hold = FrameHold(size, group, meter, trio.current_time())
        self._holds.add(hold)
        self.used += size
        if group is not None:
            self._by_group[group] += size
        return hold

    def release(self, hold: FrameHold) -> None:
        """The frame is whole, or its reading ended."""
        if hold in self._holds:
            self._holds.discard(hold)
            self.used -= hold.size
            if hold.group is not None:
                self._by_group[hold.group] -= hold.size
                if not self._by_group[hold.group]:
                    del self._by_group[hold.group]
            self._released.unpark_all()

    def _fits(self, size: int, group: str | None) -> bool:
        if self.used and self.used + size > self.limit:
            return False
        if group is None:
            return True
        held = self._by_group.get(group, 0)
        return not held or held + size <= self.host_limit
