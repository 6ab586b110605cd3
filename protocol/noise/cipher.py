"""Noise cipher functions and the CipherState (Noise spec rev 34, sections 4.2 and 5.1).

Two cipher functions are pluggable by name, each an AEAD from ``cryptography`` with the
nonce encoding the spec fixes for it:

=============  =========================  ==============================================
name           AEAD                       96-bit nonce for counter ``n``
=============  =========================  ==============================================
``ChaChaPoly`` ChaCha20-Poly1305          4 zero bytes + ``n`` as 8 bytes little-endian
``AESGCM``     AES-256-GCM                4 zero bytes + ``n`` as 8 bytes big-endian
=============  =========================  ==============================================

Both append a 16-byte tag. Rekey is not implemented (swarm/1 does not use it).
"""

from __future__ import annotations

import struct
from typing import ClassVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM as _AESGCM
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ..errors import LocalProtocolError, RemoteProtocolError

KEY_LENGTH = 32
TAG_LENGTH = 16
MAX_NONCE = (1 << 64) - 1
"""The spec reserves nonce 2**64-1: a CipherState that reaches it refuses to go on."""

Buffer = bytes | bytearray | memoryview


class Cipher:
    """A keyed AEAD with the Noise nonce encoding of its cipher name.

    Subclasses set ``name``, ``_aead_class`` and ``_nonce`` (a ``struct.Struct`` that
    packs the 64-bit counter into the 12-byte nonce). The hot path (``NoiseTransport``)
    reads ``aead`` and ``nonce`` directly to avoid a method call per message.
    """

    name: ClassVar[str]
    _aead_class: ClassVar[type[_AESGCM] | type[ChaCha20Poly1305]]
    _nonce: ClassVar[struct.Struct]

    __slots__ = ("aead", "nonce")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_LENGTH:
            raise ValueError(f"a Noise cipher key is {KEY_LENGTH} bytes")
        self.aead: _AESGCM | ChaCha20Poly1305 = self._aead_class(bytes(key))
        self.nonce = self._nonce.pack
        """``nonce(n) -> bytes``: the 12-byte nonce for counter ``n``."""

    def encrypt(self, n: int, ad: Buffer | None, plaintext: Buffer) -> bytes:
        """ENCRYPT(k, n, ad, plaintext): ciphertext followed by the 16-byte tag."""
        return self.aead.encrypt(self._nonce.pack(n), plaintext, ad)

    def decrypt(self, n: int, ad: Buffer | None, ciphertext: Buffer) -> bytes:
        """DECRYPT(k, n, ad, ciphertext).

        Raises:
            cryptography.exceptions.InvalidTag: if authentication fails.
        """
        return self.aead.decrypt(self._nonce.pack(n), ciphertext, ad)


class ChaChaPoly(Cipher):
    """ChaCha20-Poly1305; nonce = 4 zero bytes + little-endian 64-bit counter."""

    name = "ChaChaPoly"
    _aead_class = ChaCha20Poly1305
    _nonce = struct.Struct("<4xQ")
    __slots__ = ()


class AESGCM(Cipher):
    """AES-256-GCM; nonce = 4 zero bytes + big-endian 64-bit counter."""

    name = "AESGCM"
    _aead_class = _AESGCM
    _nonce = struct.Struct(">4xQ")
    __slots__ = ()


CIPHERS: dict[str, type[Cipher]] = {ChaChaPoly.name: ChaChaPoly, AESGCM.name: AESGCM}
"""Cipher functions by their Noise name."""


def cipher_class(name: str) -> type[Cipher]:
    """The cipher functions called ``name`` (``"AESGCM"`` or ``"ChaChaPoly"``).

    Raises:
        LocalProtocolError: for any other name.
    """
    try:
        return CIPHERS[name]
    except KeyError:
        raise LocalProtocolError(
            f"unknown Noise cipher {name!r}; known: {', '.join(sorted(CIPHERS))}"
        ) from None


class CipherState:
    """A key (or none yet) and a 64-bit nonce counter (Noise spec section 5.1)."""

    __slots__ = ("cipher", "cipher_class", "n")

    def __init__(self, cipher_class: type[Cipher]) -> None:
        self.cipher_class = cipher_class
        self.cipher: Cipher | None = None
        self.n = 0

    def initialize_key(self, key: bytes | None) -> None:
        """InitializeKey(key): set the key (or clear it) and reset the nonce to 0."""
        self.cipher = None if key is None else self.cipher_class(key)
        self.n = 0

    def has_key(self) -> bool:
        return self.cipher is not None

    def _next_nonce(self) -> int:
        if self.n >= MAX_NONCE:
            raise LocalProtocolError("Noise nonce exhausted; the connection must be re-established")
        return self.n

    def encrypt_with_ad(self, ad: Buffer, plaintext: Buffer) -> bytes:
        """EncryptWithAd: encrypt when a key is set, else return the plaintext unchanged.

        Raises:
            LocalProtocolError: if the nonce counter is exhausted.
        """
        if self.cipher is None:
            return bytes(plaintext)
        out = self.cipher.encrypt(self._next_nonce(), ad, plaintext)
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: Buffer, ciphertext: Buffer) -> bytes:
        """DecryptWithAd: decrypt when a key is set, else return the ciphertext unchanged.

        On failure the nonce is not advanced.

        Raises:
            RemoteProtocolError: if authentication fails (tampered, replayed or reordered).
            LocalProtocolError: if the nonce counter is exhausted.
        """
        if self.cipher is None:
            return bytes(ciphertext)
        n = self._next_nonce()
        try:
            out = self.cipher.decrypt(n, ad, ciphertext)
        except InvalidTag:
            raise RemoteProtocolError("Noise message failed authentication") from None
        self.n += 1
        return out
