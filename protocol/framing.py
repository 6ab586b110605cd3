"""Length-prefixed frames, sans-I/O.

A frame is a 4-byte big-endian length followed by that many bytes. The decoder
takes bytes as they arrive and hands out whole frames; a declared length above
the configured maximum is refused *before* anything is buffered for it.

    decoder = FrameDecoder(max_frame_size=4 << 20)
    decoder.receive_data(chunk)
    while (frame := decoder.next_frame()) is not NEED_DATA:
        handle(frame)
"""

from __future__ import annotations

import enum
import struct

from .errors import LocalProtocolError, RemoteProtocolError

DEFAULT_MAX_FRAME_SIZE = 4 << 20
MIN_PEER_FRAME_SIZE = (2 << 20) + (64 << 10)
"""The smallest maximum frame size a peer may have: the largest frame a sender may count on
every peer to accept (a DHT reply or store of 64 entries: ~1.1 MiB; an averaging chunk of
the largest ``chunk_bytes``, 2 MiB, with its header)."""
HEADER = struct.Struct(">I")


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _Sentinel.NEED_DATA
"""Returned by :meth:`FrameDecoder.next_frame` when no whole frame is buffered yet."""


def encode_frame_header(length: int, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The 4-byte prefix for a payload of ``length`` bytes.

    Raises:
        LocalProtocolError: if ``length`` exceeds ``max_frame_size``.
    """
    if length > max_frame_size:
        raise LocalProtocolError(f"frame of {length} bytes exceeds the maximum {max_frame_size}")
    return HEADER.pack(length)


def encode_frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix ``payload`` with its length.

    Raises:
        LocalProtocolError: if the payload exceeds ``max_frame_size``.
    """
    return encode_frame_header(len(payload), max_frame_size) + payload


class FrameDecoder:
    """Reassembles frames from a byte stream."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size <= 0 or max_frame_size >= 1 << 32:
            raise ValueError("max_frame_size must be in 1 .. 2**32-1")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._start = 0
        self._expected: int | None = None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes from the stream."""
        if self._start and self._start >= len(self._buffer) // 2:
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        return len(self._buffer) - self._start

    def next_frame(self) -> bytes | _Sentinel:
        """The next whole frame, or ``NEED_DATA``.

        Raises:
            RemoteProtocolError: if the declared length exceeds the maximum.
        """
        if self._expected is None:
            if self.buffered < HEADER.size:
                return NEED_DATA
            (length,) = HEADER.unpack_from(self._buffer, self._start)
            if length > self.max_frame_size:
                raise RemoteProtocolError(
                    f"peer declared a frame of {length} bytes; maximum is {self.max_frame_size}"
                )
            self._start += HEADER.size
            self._expected = length
        if self.buffered < self._expected:
            return NEED_DATA
        end = self._start + self._expected
        frame = bytes(self._buffer[self._start : end])
        self._start = end
        self._expected = None
        return frame

    def close(self) -> None:
        """Signal end of stream.

        Raises:
            RemoteProtocolError: if a partial frame was left buffered (truncated frame).
        """
        if self._expected is not None or self.buffered:
            raise RemoteProtocolError("stream ended inside a frame (truncated frame)")
