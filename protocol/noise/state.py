"""The Noise XX core: SymmetricState and HandshakeState (Noise spec rev 34, sections 5.2-5.3).

This is the spec's state machine with explicit keys and no framing or payload rules, so it
can be checked byte for byte against published test vectors (inject ``s``, ``e`` and the
prologue). ``NoiseHandshake`` in ``handshake.py`` wraps it with swarm's framing and
identity payloads.

DH is X25519 and the keys come from ``cryptography``; HASH is SHA-256 and HKDF is the
HMAC construction of spec section 4.3, written out here exactly as the spec defines it
(the standard library's ``hmac.digest`` is the HMAC-SHA256).

XX, message by message (``->`` initiator to responder)::

    -> e
    <- e, ee, s, es
    -> s, se

Roles alternate: the initiator writes messages 0 and 2 and reads message 1; the responder
does the opposite. After message 2 both sides ``split()`` into two CipherStates.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ..errors import LocalProtocolError, RemoteProtocolError
from .cipher import TAG_LENGTH, Buffer, CipherState, cipher_class

DHLEN = 32
HASHLEN = 32
MAX_MESSAGE_LENGTH = 65535
"""Every Noise message, handshake or transport, is at most this many bytes."""

PATTERN_XX: tuple[tuple[str, ...], ...] = (
    ("e",),
    ("e", "ee", "s", "es"),
    ("s", "se"),
)


def protocol_name(cipher: str) -> bytes:
    """The full Noise protocol name for XX over X25519 and SHA-256 with ``cipher``."""
    return f"Noise_XX_25519_{cipher}_SHA256".encode("ascii")


def hash_(data: Buffer) -> bytes:
    """HASH(data): SHA-256."""
    return hashlib.sha256(data).digest()


def hkdf(chaining_key: bytes, input_key_material: bytes, num_outputs: int) -> tuple[bytes, ...]:
    """HKDF(chaining_key, input_key_material, num_outputs) of Noise spec section 4.3."""
    temp_key = hmac.digest(chaining_key, input_key_material, "sha256")
    output1 = hmac.digest(temp_key, b"\x01", "sha256")
    output2 = hmac.digest(temp_key, output1 + b"\x02", "sha256")
    if num_outputs == 2:
        return output1, output2
    output3 = hmac.digest(temp_key, output2 + b"\x03", "sha256")
    return output1, output2, output3


def public_bytes(private_key: X25519PrivateKey) -> bytes:
    """The raw 32-byte X25519 public key of ``private_key``."""
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def dh(private_key: X25519PrivateKey, public_key: bytes) -> bytes:
    """DH(key_pair, public_key): X25519.

    Raises:
        RemoteProtocolError: if the remote public key is malformed or of low order
            (the shared secret would be all zeros).
    """
    try:
        return private_key.exchange(X25519PublicKey.from_public_bytes(public_key))
    except ValueError:
        raise RemoteProtocolError("remote sent an invalid X25519 public key") from None


class SymmetricState:
    """The chaining key ``ck``, the handshake hash ``h`` and a CipherState (spec 5.2)."""

    __slots__ = ("cipher_class", "cipher_state", "ck", "h")

    def __init__(self, cipher: str) -> None:
        self.cipher_class = cipher_class(cipher)
        name = protocol_name(self.cipher_class.name)
        self.h = name.ljust(HASHLEN, b"\x00") if len(name) <= HASHLEN else hash_(name)
        self.ck = self.h
        self.cipher_state = CipherState(self.cipher_class)

    def mix_key(self, input_key_material: bytes) -> None:
        self.ck, temp_k = hkdf(self.ck, input_key_material, 2)
        self.cipher_state.initialize_key(temp_k[:32])

    def mix_hash(self, data: Buffer) -> None:
        self.h = hash_(self.h + bytes(data))

    def encrypt_and_hash(self, plaintext: Buffer) -> bytes:
        ciphertext = self.cipher_state.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: Buffer) -> bytes:
        """Raises: RemoteProtocolError if authentication fails."""
        plaintext = self.cipher_state.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        temp_k1, temp_k2 = hkdf(self.ck, b"", 2)
        c1 = CipherState(self.cipher_class)
        c1.initialize_key(temp_k1[:32])
        c2 = CipherState(self.cipher_class)
        c2.initialize_key(temp_k2[:32])
        return c1, c2


class HandshakeState:
    """Noise XX with explicit keys.

    Args:
        initiator: our role.
        s: our static X25519 private key (32 raw bytes); generated when ``None``.
        e: our ephemeral private key; generated when ``None`` (inject only for test vectors).
        prologue: bytes both sides must agree on; mixed into the handshake hash.
        cipher: ``"AESGCM"`` or ``"ChaChaPoly"``.

    After the last message, ``complete`` is true and ``cipher_states`` holds
    ``(c1, c2)``: c1 encrypts initiator-to-responder, c2 responder-to-initiator.
    Any error leaves the state dead: every further call raises ``LocalProtocolError``.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        s: bytes | None = None,
        e: bytes | None = None,
        prologue: bytes = b"",
        cipher: str = "AESGCM",
    ) -> None:
        self.initiator = initiator
        self.prologue = prologue
        self.symmetric = SymmetricState(cipher)
        self.s = (
            X25519PrivateKey.generate() if s is None else X25519PrivateKey.from_private_bytes(s)
        )
        self.s_public = public_bytes(self.s)
        self.e: X25519PrivateKey | None = (
            None if e is None else X25519PrivateKey.from_private_bytes(e)
        )
        self.rs: bytes | None = None
        self.re: bytes | None = None
        self.message_index = 0
        self.cipher_states: tuple[CipherState, CipherState] | None = None
        self._failed = False
        self.symmetric.mix_hash(prologue)

    @property
    def complete(self) -> bool:
        return self.cipher_states is not None

    @property
    def handshake_hash(self) -> bytes:
        """The handshake hash ``h`` (final once ``complete``)."""
        return self.symmetric.h

    def _begin(self, writing: bool) -> tuple[str, ...]:
        if self._failed:
            raise LocalProtocolError("the handshake already failed")
        if self.complete:
            raise LocalProtocolError("the handshake is already complete")
        ours = (self.message_index % 2 == 0) == self.initiator
        if ours != writing:
            raise LocalProtocolError(
                f"handshake message {self.message_index + 1} is to be "
                f"{'written' if ours else 'read'} by us now"
            )
        return PATTERN_XX[self.message_index]

    def _finish(self) -> None:
        self.message_index += 1
        if self.message_index == len(PATTERN_XX):
            self.cipher_states = self.symmetric.split()

    def _dh_token(self, token: str) -> bytes:
        # ee: DH(e, re); es: DH(e, rs) as initiator, DH(s, re) as responder;
        # se: DH(s, re) as initiator, DH(e, rs) as responder.
        assert self.e is not None and self.re is not None
        if token == "ee":
            return dh(self.e, self.re)
        if (token == "es") == self.initiator:
            assert self.rs is not None
            return dh(self.e, self.rs)
        return dh(self.s, self.re)

    def write_message(self, payload: Buffer = b"") -> bytes:
        """WriteMessage(payload): the next handshake message (unframed).

        Raises:
            LocalProtocolError: if it is not our turn to write, the handshake is over or
                failed, or the message would exceed 65535 bytes.
        """
        tokens = self._begin(writing=True)
        try:
            out = bytearray()
            for token in tokens:
                if token == "e":
                    if self.e is None:
                        self.e = X25519PrivateKey.generate()
                    e_public = public_bytes(self.e)
                    out += e_public
                    self.symmetric.mix_hash(e_public)
                elif token == "s":
                    out += self.symmetric.encrypt_and_hash(self.s_public)
                else:
                    self.symmetric.mix_key(self._dh_token(token))
            out += self.symmetric.encrypt_and_hash(payload)
            if len(out) > MAX_MESSAGE_LENGTH:
                raise LocalProtocolError(f"handshake message of {len(out)} bytes is too long")
        except BaseException:
            self._failed = True
            raise
        self._finish()
        return bytes(out)

    def read_message(self, message: Buffer) -> bytes:
        """ReadMessage(message): process a handshake message (unframed); returns its payload.

        Raises:
            RemoteProtocolError: if the message is truncated, carries an invalid key or
                fails authentication.
            LocalProtocolError: if it is not our turn to read, or the handshake is over.
        """
        tokens = self._begin(writing=False)
        try:
            data = memoryview(bytes(message))
            if len(data) > MAX_MESSAGE_LENGTH:
                raise RemoteProtocolError(f"handshake message of {len(data)} bytes is too long")
            pos = 0
            for token in tokens:
                if token in ("e", "s"):
                    size = DHLEN + (
                        TAG_LENGTH if token == "s" and self.symmetric.cipher_state.has_key() else 0
                    )
                    if len(data) - pos < size:
                        raise RemoteProtocolError(
                            f"handshake message {self.message_index + 1} is truncated"
                        )
                    chunk = data[pos : pos + size]
                    pos += size
                    if token == "e":
                        self.re = bytes(chunk)
                        self.symmetric.mix_hash(chunk)
                    else:
                        self.rs = self.symmetric.decrypt_and_hash(chunk)
                else:
                    self.symmetric.mix_key(self._dh_token(token))
            payload = self.symmetric.decrypt_and_hash(data[pos:])
        except BaseException:
            self._failed = True
            raise
        self._finish()
        return payload
