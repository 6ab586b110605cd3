"""``NoiseHandshake``: swarm/1's sans-I/O Noise XX handshake with identity payloads.

Bytes in, bytes out; no clock, no sockets::

    hs = NoiseHandshake(identity, initiator=True, expected_peer_id=None)
    while not hs.complete:
        if out := hs.data_to_send():
            await stream.send_all(out)
        hs.receive_data(await stream.receive_some())   # EOF mid-handshake is the caller's
    if out := hs.data_to_send():                       # the initiator's message 3
        await stream.send_all(out)
    transport = hs.into_transport()

Wire: every handshake message is a 2-byte big-endian length, then the Noise message.

Rules (one row per state; ``read`` means "a whole framed message arrived")::

    role       state        event                           next         effect
    initiator  AWAIT_2      (constructed)                    -            message 1 queued
    initiator  AWAIT_2      read msg 2, payload verified     COMPLETE     message 3 queued
    responder  AWAIT_1      read msg 1, empty payload        AWAIT_3      message 2 queued
    responder  AWAIT_3      read msg 3, payload verified     COMPLETE
    any        COMPLETE     receive_data                     COMPLETE     kept for transport
    any        COMPLETE     into_transport                   CONVERTED    NoiseTransport
    any        any          error                            FAILED       every call raises

Messages 2 (responder) and 3 (initiator) carry the identity payload of ``payload.py``.

Static keys: every ``NoiseHandshake`` generates a fresh X25519 static key, so a static key
lives for one connection and is vouched for by the identity's signature each time; nothing
links two connections of the same peer except the identity it chooses to reveal.
"""

from __future__ import annotations

import enum
import logging

from ..errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ..identity import Identity, PeerID
from .cipher import Buffer
from .payload import encode_payload, verify_payload
from .state import HandshakeState, protocol_name
from .transport import LENGTH_PREFIX, NoiseTransport

logger = logging.getLogger(__name__)

PROLOGUE = b"swarm/1"
"""The prologue of swarm/1: both sides mix it into the handshake hash."""
DEFAULT_CIPHER = "AESGCM"
"""swarm/1 runs ``Noise_XX_25519_AESGCM_SHA256``."""
MAX_HANDSHAKE_MESSAGE_LENGTH = 1024
"""swarm/1 handshake messages are 32, 216 and 184 bytes; a larger length prefix is refused."""
BUSY_SIGNAL = b"\x00\x00"
"""An empty handshake message, sent instead of message 2 by a responder that turns the
connection away (its limits for the dialer's address, or for all) before closing it: the
dialer then knows the peer is up and may try again later, where a bare close (a proxy in
front of a process that is gone) says nothing. No real message 2 is empty."""


class _State(enum.Enum):
    AWAIT_1 = "AWAIT_1"
    AWAIT_2 = "AWAIT_2"
    AWAIT_3 = "AWAIT_3"
    COMPLETE = "COMPLETE"
    CONVERTED = "CONVERTED"
    FAILED = "FAILED"


class NoiseHandshake:
    """One side of a swarm/1 Noise XX handshake.

    Args:
        identity: our Ed25519 identity; it signs this connection's static key.
        initiator: True for the side that opened the connection.
        expected_peer_id: when given, the remote must prove exactly this identity.
        cipher: ``"AESGCM"`` (swarm/1) or ``"ChaChaPoly"``.
        prologue: must match the remote's; ``b"swarm/1"`` for swarm/1.

    Raises:
        LocalProtocolError: for an unknown cipher name.
    """

    def __init__(
        self,
        identity: Identity,
        initiator: bool,
        expected_peer_id: PeerID | None = None,
        cipher: str = DEFAULT_CIPHER,
        prologue: bytes = PROLOGUE,
    ) -> None:
        state = HandshakeState(initiator=initiator, prologue=prologue, cipher=cipher)
        self._setup(identity, state, expected_peer_id)

    @classmethod
    def from_state(
        cls, identity: Identity, state: HandshakeState, expected_peer_id: PeerID | None = None
    ) -> NoiseHandshake:
        """Wrap an explicit, fresh :class:`HandshakeState` (fixed keys: tests and vectors).

        Raises:
            LocalProtocolError: if ``state`` has already processed a message.
        """
        if state.message_index != 0:
            raise LocalProtocolError("NoiseHandshake needs a fresh HandshakeState")
        handshake = cls.__new__(cls)
        handshake._setup(identity, state, expected_peer_id)
        return handshake

    def _setup(
        self, identity: Identity, state: HandshakeState, expected_peer_id: PeerID | None
    ) -> None:
        self._identity = identity
        self.initiator = state.initiator
        self.expected_peer_id = expected_peer_id
        self._noise = state
        self._in = bytearray()
        self._in_pos = 0
        self._out = bytearray()
        self._remote_public_key: bytes | None = None
        self._remote_peer_id: PeerID | None = None
        if self.initiator:
            self._write(b"")
            self._state = _State.AWAIT_2
        else:
            self._state = _State.AWAIT_1

    # -- public surface ---------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """True once both identities are proven (the initiator may still have msg 3 queued)."""
        return self._state in (_State.COMPLETE, _State.CONVERTED)

    @property
    def remote_peer_id(self) -> PeerID:
        """The remote's proven PeerID.

        Raises:
            LocalProtocolError: before the remote's identity payload has been verified.
        """
        if self._remote_peer_id is None:
            raise LocalProtocolError("the remote identity is not known yet")
        return self._remote_peer_id

    @property
    def remote_public_key(self) -> bytes:
        """The remote's proven Ed25519 public key (32 bytes).

        Raises:
            LocalProtocolError: before the remote's identity payload has been verified.
        """
        if self._remote_public_key is None:
            raise LocalProtocolError("the remote identity is not known yet")
        return self._remote_public_key

    def data_to_send(self) -> bytes:
        """Drain the framed handshake bytes waiting to go out (``b""`` when none)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive_data(self, data: Buffer) -> None:
        """Feed bytes from the stream; processes every whole handshake message in them.

        Bytes after the last handshake message are kept and handed to the transport by
        :meth:`into_transport`; feeding more bytes once ``complete`` is allowed.

        Raises:
            RemoteProtocolError: for an oversized length prefix, a malformed or unauthentic
                message, an invalid identity payload or an unexpected PeerID.
            LocalProtocolError: after an earlier failure or after :meth:`into_transport`.
        """
        self._check_usable()
        self._in += data
        if self._state is _State.COMPLETE:
            return
        try:
            while (message := self._next_message()) is not None:
                self._handle(message)
                if self._state is _State.COMPLETE:
                    break
        except ProtocolError as exc:
            self._state = _State.FAILED
            logger.debug("noise handshake failed: %s", exc)
            raise

    def into_transport(self) -> NoiseTransport:
        """The transport for this connection; the handshake object is spent afterwards.

        Raises:
            LocalProtocolError: if the handshake is not complete, its outgoing bytes have
                not all been taken with :meth:`data_to_send`, or it was already converted.
        """
        self._check_usable()
        if self._state is not _State.COMPLETE:
            raise LocalProtocolError("the Noise handshake is not complete")
        if self._out:
            raise LocalProtocolError("send data_to_send() before switching to the transport")
        assert self._noise.cipher_states is not None
        c1, c2 = self._noise.cipher_states
        send, receive = (c1, c2) if self.initiator else (c2, c1)
        leftover = bytes(memoryview(self._in)[self._in_pos :])
        self._in.clear()
        self._state = _State.CONVERTED
        return NoiseTransport(send, receive, self._noise.handshake_hash, leftover)

    # -- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._state is _State.FAILED:
            raise LocalProtocolError("the Noise handshake already failed")
        if self._state is _State.CONVERTED:
            raise LocalProtocolError("the Noise handshake was turned into a transport")

    def _next_message(self) -> bytes | None:
        available = len(self._in) - self._in_pos
        if available < LENGTH_PREFIX.size:
            return None
        (length,) = LENGTH_PREFIX.unpack_from(self._in, self._in_pos)
        if length > MAX_HANDSHAKE_MESSAGE_LENGTH:
            raise RemoteProtocolError(
                f"handshake message of {length} bytes exceeds {MAX_HANDSHAKE_MESSAGE_LENGTH}"
                " (not a swarm peer? its first bytes read"
                f" {bytes(self._in[self._in_pos : self._in_pos + 8])!r})"
            )
        if available < LENGTH_PREFIX.size + length:
            return None
        start = self._in_pos + LENGTH_PREFIX.size
        self._in_pos = start + length
        return bytes(self._in[start : self._in_pos])

    def _handle(self, message: bytes) -> None:
        if not message and self._state is _State.AWAIT_2:
            raise RemoteProtocolError(
                "the responder is busy (an empty handshake message 2, the busy signal of"
                " protocol.md 2.2): dial it again later"
            )
        try:
            payload = self._noise.read_message(message)
        except RemoteProtocolError as exc:
            if self._state is _State.AWAIT_1 or "authentication" not in str(exc):
                raise
            if not self.initiator:
                # message 2, under the same prologue and protocol name, passed at the
                # initiator (it would not have sent message 3 otherwise): no mismatch
                raise RemoteProtocolError(
                    "handshake message 3 failed authentication: damaged or tampered with on the way"
                ) from exc
            # message 2 is the first encrypted under keys that the prologue and the
            # protocol name went into: that they differ is the likely cause
            ours = protocol_name(self._noise.symmetric.cipher_class.name).decode()
            raise RemoteProtocolError(
                "handshake message 2 failed authentication: the peer speaks another "
                f"protocol version or cipher than ours ({ours}, prologue "
                f"{self._noise.prologue!r}), or the message was damaged on the way"
            ) from exc
        if self._state is _State.AWAIT_1:
            if payload:
                raise RemoteProtocolError("handshake message 1 must have an empty payload")
            self._write(encode_payload(self._identity, self._noise.s_public))
            self._state = _State.AWAIT_3
            return
        self._verify(payload)
        if self._state is _State.AWAIT_2:
            self._write(encode_payload(self._identity, self._noise.s_public))
        self._state = _State.COMPLETE
        logger.debug("noise handshake complete with %s", self._remote_peer_id)

    def _verify(self, payload: bytes) -> None:
        assert self._noise.rs is not None
        proven = verify_payload(payload, self._noise.rs, self.expected_peer_id)
        self._remote_public_key = proven.identity
        self._remote_peer_id = PeerID.from_public_key(proven.identity)

    def _write(self, payload: bytes) -> None:
        message = self._noise.write_message(payload)
        self._out += LENGTH_PREFIX.pack(len(message))
        self._out += message
