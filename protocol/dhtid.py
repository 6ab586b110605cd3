"""Ids in the 256-bit DHT space: keys and peers share it; distance is XOR."""

from __future__ import annotations

import hashlib

from .errors import ProtocolError
from .identity import PeerID

ID_BITS = 256
ID_BYTES = ID_BITS // 8


class DHTID(int):
    """A 256-bit unsigned id. A key's id is SHA-256 of its UTF-8; a peer's is its PeerID bytes."""

    __slots__ = ()

    def __new__(cls, value: int) -> DHTID:
        if not 0 <= value < 1 << ID_BITS:
            raise ProtocolError("DHT id out of the 256-bit range")
        return super().__new__(cls, value)

    @classmethod
    def from_key(cls, key: str) -> DHTID:
        return cls(int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "big"))

    @classmethod
    def from_peer_id(cls, peer_id: PeerID) -> DHTID:
        return cls(int.from_bytes(peer_id.raw, "big"))

    @classmethod
    def from_bytes_exact(cls, raw: bytes) -> DHTID:
        """Parse 32 raw bytes.

        Raises:
            ProtocolError: if not exactly 32 bytes.
        """
        if not isinstance(raw, bytes) or len(raw) != ID_BYTES:
            raise ProtocolError(f"a DHT id is {ID_BYTES} bytes")
        return cls(int.from_bytes(raw, "big"))

    def to_raw(self) -> bytes:
        return int(self).to_bytes(ID_BYTES, "big")

    def distance(self, other: int) -> int:
        return int(self) ^ int(other)

    def bucket_index(self, other: int) -> int:
        """Index of the k-bucket (0..255) holding ``other`` from our point of view; -1 for self."""
        return (int(self) ^ int(other)).bit_length() - 1

    def __repr__(self) -> str:
        return f"DHTID({int(self):064x})"
