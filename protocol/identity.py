"""Peer identities: Ed25519 key pairs and the PeerIDs derived from them.

A PeerID is the SHA-256 of the raw 32-byte Ed25519 public key, shown in base58.
Key files hold the raw 32-byte private seed, created with mode 0600.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .base58 import b58decode, b58encode
from .errors import ProtocolError, SwarmError

PEER_ID_LENGTH = 32
PUBLIC_KEY_LENGTH = 32
SIGNATURE_LENGTH = 64
_SEED_LENGTH = 32


@dataclass(frozen=True, slots=True, order=True)
class PeerID:
    """A peer's identity: SHA-256 of its Ed25519 public key (32 bytes)."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PEER_ID_LENGTH:
            raise ProtocolError(f"a PeerID is {PEER_ID_LENGTH} bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        """Derive the PeerID of a raw 32-byte Ed25519 public key.

        Raises:
            ProtocolError: if the key is not 32 bytes.
        """
        if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_LENGTH:
            raise ProtocolError(f"an Ed25519 public key is {PUBLIC_KEY_LENGTH} bytes")
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse the base58 form.

        Raises:
            ProtocolError: if the text is not base58 of exactly 32 bytes.
        """
        raw = b58decode(text)
        if len(raw) != PEER_ID_LENGTH:
            raise ProtocolError(f"PeerID {text!r} does not decode to {PEER_ID_LENGTH} bytes")
        return cls(raw)

    def to_base58(self) -> str:
        return b58encode(self.raw)

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    # Written out (the dataclass would hash and compare a tuple of the fields): PeerIDs key
    # the routing table, every lookup and every connection, hundreds of times per DHT get.
    def __hash__(self) -> int:
        return hash(self.raw)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is PeerID:
            return self.raw == other.raw
        return NotImplemented

    def short(self) -> str:
        """A few leading characters, for logs."""
        return self.to_base58()[:8]


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``."""
    if len(public_key) != PUBLIC_KEY_LENGTH or len(signature) != SIGNATURE_LENGTH:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError):
        return False
    return True


class IdentityFileError(SwarmError):
    """A key file exists but cannot be used (wrong size, unreadable)."""


class Identity:
    """An Ed25519 key pair: signs handshakes and DHT records."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: PeerID = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests, reproducible ids)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(bytes(data))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the private seed with mode 0600, atomically (temp file + rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, self.seed())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a key file written by :meth:`save`.

        Raises:
            IdentityFileError: if the file does not hold a 32-byte seed.
        """
        data = Path(path).read_bytes()
        if len(data) != _SEED_LENGTH:
            raise IdentityFileError(
                f"identity file {path} holds {len(data)} bytes, expected {_SEED_LENGTH}"
            )
        return cls.from_seed(data)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key file, or create it (mode 0600) when it is missing.

        Raises:
            IdentityFileError: if the file exists but is not a valid key file.
        """
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"
