"""Reused byte buffers for blobs on their way out (a fresh large buffer costs page faults,
~2 GB/s here, about as much as sealing it).

- :class:`BufferPool`: chunk-sized buffers for uploads. A buffer goes back to the pool only
  once the call that carried it was answered (so the peer has read every byte of it); a
  buffer whose call failed or was cancelled may still sit in a connection's outbox and is
  simply dropped.
- :class:`SharedBuffer`: one large buffer (a reducer's encoded results) reused from round
  to round while nothing references it any more; otherwise a new one is made.
"""

from __future__ import annotations

import sys

__all__ = ["BufferPool", "SharedBuffer"]


class BufferPool:
    """Up to ``limit`` free buffers of at least ``size`` bytes each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.allocated = 0  # buffers made so far: what reuse saves
        self._free: list[bytearray] = []

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (reused when one is free)."""
        while self._free:
            buffer = self._free.pop()
            if len(buffer) >= size:
                return buffer
        self.allocated += 1
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        """Return a buffer nothing reads any more."""
        if len(self._free) < self.limit:
            self._free.append(buffer)


class SharedBuffer:
    """One buffer reused while unreferenced (no memoryview or array of it is alive)."""

    def __init__(self) -> None:
        self._buffer: bytearray | None = None
        self.allocated = 0  # buffers made so far

    def get(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes that nothing else references."""
        buffer = self._buffer
        # references: self._buffer, ``buffer`` and getrefcount's argument; a live export
        # (a memoryview slice handed to a connection) adds one
        if buffer is None or len(buffer) < size or sys.getrefcount(buffer) > 3:
            buffer = self._buffer = bytearray(size)
            self.allocated += 1
        return buffer
