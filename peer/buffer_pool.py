"""Large byte buffers shared by the whole process, reused once nothing refers to them.

A fresh large buffer costs page faults (about 2 GB/s on the development VM, as slow as the
copy it is for), so the frame readers take every large frame's buffer from here, and the
secure streams take a seal buffer from here for each large send and give it back after
(a connection that once sent a 1 MiB reply kept a 1 MiB buffer for as long as it stayed
open: an outside tester's 300 connections that each read one FIND_VALUE page held 310 MiB
on a bootstrap node).
"""

from __future__ import annotations

import sys

__all__ = ["FRAME_POOL", "POOL_BYTES", "POOL_MIN", "FramePool"]

POOL_MIN = 1 << 16
"""Buffers at least this large are pooled (sizes rounded up to a multiple of it)."""
POOL_BYTES = 96 << 20
"""Most bytes of large buffers the process keeps for reuse (in use or free)."""


class FramePool:
    """Large buffers shared by every reader and secure stream of the process, reused once
    unreferenced.

    A frame's payload may outlive the read loop (a reducer keeps received chunks until the
    sender's part is complete), so a buffer is free again only when no view of it is alive
    (its reference count says so). Buffers come in size classes (multiples of 64 KiB); the
    pool tracks at most ``limit`` bytes of them, in use or free, and beyond that hands out
    untracked buffers (a fresh large buffer costs page faults, ~2 GB/s here).
    """

    def __init__(self, limit: int = POOL_BYTES) -> None:
        self.limit = limit
        self.tracked = 0  # bytes of the buffers in ``_classes``
        self.allocated = 0  # buffers made so far (pooled or not): what reuse saves
        self._classes: dict[int, list[bytearray]] = {}

    def get(self, length: int) -> memoryview:
        """A writable view of exactly ``length`` bytes (a fresh buffer for small ones)."""
        if length < POOL_MIN:
            return memoryview(bytearray(length))
        size = -(-length // POOL_MIN) * POOL_MIN
        buffers = self._classes.setdefault(size, [])
        for buffer in buffers:
            # referenced by the list, the loop and getrefcount only: no view is alive
            if sys.getrefcount(buffer) <= 3:
                return memoryview(buffer)[:length]
        self.allocated += 1
        buffer = bytearray(size)
        if self.tracked + size > self.limit:
            self._evict(self.tracked + size - self.limit)
        if self.tracked + size <= self.limit:
            buffers.append(buffer)
            self.tracked += size
        return memoryview(buffer)[:length]

    def _evict(self, need: int) -> None:
        """Forget free buffers of any class until ``need`` bytes are released (or none is)."""
        for size, buffers in self._classes.items():
            for i in range(len(buffers) - 1, -1, -1):
                if need <= 0:
                    return
                if sys.getrefcount(buffers[i]) <= 2:  # the list and getrefcount
                    del buffers[i]
                    self.tracked -= size
                    need -= size


FRAME_POOL = FramePool()
"""The pool every :class:`FrameReader` draws from by default. Loops in other threads may share
it: a buffer another thread is looking at has a reference more, so it is never handed out
twice (the byte counts are only approximate then)."""
