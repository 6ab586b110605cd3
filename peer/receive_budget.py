"""A host's budget for large frames on their way in, over all of its connections together.

A frame's 4-byte header announces its length (up to ``max_frame_size``, 4 MiB by default)
before the bytes come. Without a common bound, peers that announce large frames, send part
of each and stall make the host hold that memory on every connection at once: a trial held
2.6 GB with 600 connections that each sent 2.2 MiB of a 4 MiB frame, on a bootstrap node
meant to stay under 60 MiB. So a reader takes a frame's length from the budget before it
reads the frame's body, and gives it back once the frame is whole (the payload then belongs
to whoever handles it, e.g. a reducer within its ``retain_budget``).

When the budget is spent, a reader waits (its peer is not read meanwhile: TCP holds the
sender back) and frames that have received nothing for ``stall_timeout`` are cut off to
make room (their connections end with a protocol error). A frame larger than the whole
budget goes in alone. Small frames (under 64 KiB) take nothing from it: each connection
reads at most one frame at a time, and ``HostConfig.max_connections`` bounds those.
"""

from __future__ import annotations

import math

import trio

__all__ = ["FrameHold", "ReceiveBudget"]


class FrameHold:
    """One frame's share of the budget while it arrives; ``scope`` is cancelled to cut it off."""

    __slots__ = ("last_progress", "scope", "size")

    def __init__(self, size: int, now: float) -> None:
        self.size = size
        self.last_progress = now
        self.scope = trio.CancelScope()

    def progressed(self) -> None:
        """Bytes of the frame arrived."""
        self.last_progress = trio.current_time()


class ReceiveBudget:
    """At most ``limit`` bytes of large frames being received at once."""

    def __init__(self, limit: int, stall_timeout: float) -> None:
        self.limit = limit
        self.stall_timeout = stall_timeout
        self.used = 0
        self.cut_off = 0  # stalled frames cut off to make room (for tests and stats)
        self._holds: set[FrameHold] = set()
        self._released = trio.lowlevel.ParkingLot()

    async def acquire(self, size: int) -> FrameHold:
        """Take ``size`` bytes for one frame, waiting for room (and cutting off stalled
        frames to make it); give them back with :meth:`release`."""
        while self.used and self.used + size > self.limit:
            now = trio.current_time()
            wake_at = math.inf
            for hold in self._holds:
                if hold.scope.cancel_called:
                    continue
                stalled_until = hold.last_progress + self.stall_timeout
                if now >= stalled_until:
                    hold.scope.cancel()
                    self.cut_off += 1
                else:
                    wake_at = min(wake_at, stalled_until)
            with trio.move_on_at(wake_at):  # a release, or the next frame that stalls long enough
                await self._released.park()
        hold = FrameHold(size, trio.current_time())
        self._holds.add(hold)
        self.used += size
        return hold

    def release(self, hold: FrameHold) -> None:
        """The frame is whole, or its reading ended."""
        if hold in self._holds:
            self._holds.discard(hold)
            self.used -= hold.size
            self._released.unpark_all()
