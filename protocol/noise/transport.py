"""``NoiseTransport``: sealing and opening swarm/1 transport messages, sans-I/O.

Wire: each transport message is a 2-byte big-endian length ``L`` (16 <= L <= 65535) and
``L`` bytes of AEAD ciphertext (plaintext + 16-byte tag), with no associated data and the
counter nonce of the cipher. Application data longer than ``MAX_PLAINTEXT_PER_MESSAGE``
is split across several messages; the receiver gets it back message by message.

Sending::

    buf = bytearray()                     # one per connection, reused for every send
    n = transport.seal_into(data, buf)    # writes buf[0:n], growing buf when too small
    await stream.send_all(memoryview(buf)[:n])

Receiving::

    transport.receive_data(await stream.receive_some())
    while (plaintext := transport.next_plaintext()) is not NEED_DATA:
        handle(plaintext)

A message that fails authentication (tampered, replayed, reordered, truncated into the
next one) raises ``RemoteProtocolError`` and kills the transport: every later call raises
``LocalProtocolError``.

Speed: received ``bytes`` are kept by reference, not copied; a message wholly inside one
received chunk is decrypted straight from it, and only a message straddling two chunks is
gathered into a scratch buffer. Sealing writes ciphertext straight into the caller's buffer
with ``encrypt_into``; ``next_plaintext_into`` decrypts straight into the caller's buffer.
Memory: once every whole message is out, a partial one at the end of a large chunk is kept
as a copy of its bytes, not by holding the chunk.
"""

from __future__ import annotations

import collections
import logging
import struct
from typing import NoReturn

from cryptography.exceptions import InvalidTag

from ..errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ..framing import NEED_DATA, _Sentinel
from .cipher import MAX_NONCE, TAG_LENGTH, Buffer, CipherState

logger = logging.getLogger(__name__)

LENGTH_PREFIX = struct.Struct(">H")
MAX_MESSAGE_LENGTH = 65535
MAX_PLAINTEXT_PER_MESSAGE = MAX_MESSAGE_LENGTH - TAG_LENGTH  # 65519
_FULL_FRAME = LENGTH_PREFIX.size + MAX_MESSAGE_LENGTH  # 65537 bytes on the wire
# Empty messages carry nothing and senders do not produce them, but each costs a
# decryption: a security review's peer sent a megabyte of them at a time, and the loop that
# skipped them held the receiving node's event loop 0.25 s per megabyte.
MAX_EMPTY_IN_A_ROW = 16
_MERGE_BELOW = 4096
"""Bytes fed in pieces smaller than this join the buffered piece before them while that is
smaller too (one copy of at most this much per piece)."""
_COMPACT_FROM = 64 << 10
"""Received chunks holding more than this, over twice the bytes still unread in them, are
replaced by a copy of those bytes once every whole message is out (see ``_compact``)."""


def sealed_size(plaintext_length: int) -> int:
    """Wire bytes :meth:`NoiseTransport.seal` produces for ``plaintext_length`` bytes."""
    full, rest = divmod(plaintext_length, MAX_PLAINTEXT_PER_MESSAGE)
    return full * _FULL_FRAME + (rest + LENGTH_PREFIX.size + TAG_LENGTH if rest else 0)


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class NoiseTransport:
    """The two directions of an established Noise session (normally from ``into_transport``).

    Args:
        send: the CipherState that encrypts what we send.
        receive: the CipherState that decrypts what we receive.
        handshake_hash: the final handshake hash ``h``.
        received: bytes already read from the stream past the last handshake message.

    Raises:
        LocalProtocolError: if either CipherState has no key.
    """

    def __init__(
        self,
        send: CipherState,
        receive: CipherState,
        handshake_hash: bytes,
        received: Buffer = b"",
    ) -> None:
        if send.cipher is None or receive.cipher is None:
            raise LocalProtocolError("a transport needs keyed CipherStates")
        self._handshake_hash = bytes(handshake_hash)
        self._seal_aead, self._seal_nonce, self._seal_n = (
            send.cipher.aead,
            send.cipher.nonce,
            send.n,
        )
        self._open_aead, self._open_nonce, self._open_n = (
            receive.cipher.aead,
            receive.cipher.nonce,
            receive.n,
        )
        # Unread received bytes: read-only views of immutable chunks; _pos indexes chunks[0].
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._pos = 0
        self._buffered = 0
        self._scratch: bytearray | None = None  # made when a message first straddles chunks
        self._error: ProtocolError | None = None
        self._empty_run = 0  # empty messages opened since the last non-empty one
        if received:
            self.receive_data(received)

    @property
    def handshake_hash(self) -> bytes:
        """The handshake hash: identical on both sides; usable for channel binding."""
        return self._handshake_hash

    @property
    def buffered(self) -> int:
        """Received bytes not yet opened (for flow control)."""
        return self._buffered

    # -- sending -------------------------------------------------------------------------

    def seal(self, data: Buffer) -> bytes:
        """Framed transport messages carrying ``data`` (split as needed); ``b""`` for no data.

        ``data`` is any C-contiguous buffer (bytes, bytearray, memoryview, numpy array).
        Convenient for small data; large data is faster through :meth:`seal_into`.

        Raises:
            LocalProtocolError: if the transport is dead or the nonce is exhausted.
        """
        self._check_alive()
        src = _byte_view(data)
        size = len(src)
        self._reserve_nonces(size)
        parts: list[bytes] = []
        encrypt, nonce, n = self._seal_aead.encrypt, self._seal_nonce, self._seal_n
        for start in range(0, size, MAX_PLAINTEXT_PER_MESSAGE):
            ciphertext = encrypt(nonce(n), src[start : start + MAX_PLAINTEXT_PER_MESSAGE], None)
            n += 1
            parts.append(LENGTH_PREFIX.pack(len(ciphertext)))
            parts.append(ciphertext)
        self._seal_n = n
        return b"".join(parts)

    def seal_into(self, data: Buffer, out: bytearray | memoryview, offset: int = 0) -> int:
        """Seal ``data`` (any C-contiguous buffer) into ``out[offset : offset + k]``; return ``k``.

        ``k == sealed_size(len(data))`` (0 for empty data). A bytearray ``out`` is grown when
        shorter than ``offset + k`` and never shrunk, so one bytearray per connection, passed on
        every call, settles at the largest size sent and is never reallocated afterwards; a
        writable memoryview ``out`` (a pooled buffer) must be long enough.
        Bytes of ``out`` outside ``[offset, offset + k)`` are left untouched. ``out`` must
        not be exported (no live memoryview on it) when it needs to grow: release the view
        passed to ``send_all`` before sealing again. To bound the buffer, seal large data a
        slice at a time (e.g. 1 MiB per call).

        Raises:
            LocalProtocolError: if the transport is dead or the nonce is exhausted.
            BufferError: if ``out`` must grow while a memoryview on it is alive.
            ValueError: if ``out`` is a memoryview shorter than ``offset + k``.
        """
        self._check_alive()
        src = _byte_view(data)
        size = len(src)
        total = sealed_size(size)
        if total == 0:
            return 0
        self._reserve_nonces(size)
        end = offset + total
        if len(out) < end:
            if not isinstance(out, bytearray):
                raise ValueError(f"a buffer of {len(out)} bytes cannot hold {end} sealed bytes")
            out.extend(bytes(end - len(out)))
        encrypt_into, nonce, n = self._seal_aead.encrypt_into, self._seal_nonce, self._seal_n
        pack_into = LENGTH_PREFIX.pack_into
        pos = offset
        with memoryview(out) as view:
            for start in range(0, size, MAX_PLAINTEXT_PER_MESSAGE):
                chunk = src[start : start + MAX_PLAINTEXT_PER_MESSAGE]
                length = len(chunk) + TAG_LENGTH
                pack_into(out, pos, length)
                pos += LENGTH_PREFIX.size
                encrypt_into(nonce(n), chunk, None, view[pos : pos + length])
                n += 1
                pos += length
        self._seal_n = n
        return total

    def _reserve_nonces(self, size: int) -> None:
        messages = -(-size // MAX_PLAINTEXT_PER_MESSAGE)
        if self._seal_n + messages > MAX_NONCE:
            self._fail(LocalProtocolError("Noise send nonce exhausted"))

    # -- receiving -----------------------------------------------------------------------

    def receive_data(self, data: Buffer) -> None:
        """Feed bytes read from the stream. ``bytes`` are kept by reference, others copied.

        Raises:
            LocalProtocolError: if the transport is dead.
        """
        self._check_alive()
        view = memoryview(data)
        if type(view.obj) is not bytes or view.format != "B" or view.ndim != 1:
            view = memoryview(view.tobytes())  # the caller may reuse a mutable buffer
        if view.nbytes:
            chunks = self._chunks
            if chunks and view.nbytes < _MERGE_BELOW and chunks[-1].nbytes < _MERGE_BELOW:
                # a trickle of tiny reads: an object each held ~320 bytes per byte of a
                # message not complete yet (a review); merged, at most ~5 %
                chunks[-1] = memoryview(b"".join((chunks[-1], view)))
            else:
                chunks.append(view)
            self._buffered += view.nbytes

    def next_message_size(self) -> int | None:
        """Plaintext bytes of the next message, or None while its length prefix is not
        buffered yet (the message itself may still be incomplete).

        Raises:
            RemoteProtocolError: if the declared length is impossible (the transport dies).
            LocalProtocolError: if the transport is already dead.
        """
        self._check_alive()
        length = self._peek_length()
        return None if length is None else length - TAG_LENGTH

    def next_plaintext(self) -> bytes | _Sentinel:
        """The plaintext of the next whole message, or ``NEED_DATA``. Never ``b""``: empty
        messages are authenticated and skipped.

        Raises:
            RemoteProtocolError: if a message fails authentication or has an impossible
                length; the transport is dead afterwards.
            LocalProtocolError: if the transport is already dead.
        """
        self._check_alive()
        decrypt = self._open_aead.decrypt
        while (ciphertext := self._take_message()) is not None:
            try:
                plaintext = decrypt(self._open_nonce(self._open_n), ciphertext, None)
            except InvalidTag:
                self._fail(RemoteProtocolError("transport message failed authentication"))
            self._open_n += 1
            if plaintext:
                self._empty_run = 0
                return plaintext
            self._count_empty()
        self._compact()
        return NEED_DATA

    def next_plaintext_into(self, out: bytearray | memoryview) -> int | _Sentinel:
        """Decrypt the next whole message straight into ``out[:k]`` and return ``k`` (> 0),
        or ``NEED_DATA``. A buffer of ``MAX_PLAINTEXT_PER_MESSAGE`` bytes always suffices.

        Raises:
            LocalProtocolError: if ``out`` is too small for the next message (nothing is
                consumed), or the transport is already dead.
            RemoteProtocolError: if a message fails authentication or has an impossible
                length; the transport is dead and ``out``'s contents are undefined.
        """
        self._check_alive()
        with memoryview(out) as target:
            capacity = target.nbytes
            while (ciphertext := self._take_message(capacity)) is not None:
                k = len(ciphertext) - TAG_LENGTH
                try:
                    self._open_aead.decrypt_into(
                        self._open_nonce(self._open_n), ciphertext, None, target[:k]
                    )
                except InvalidTag:
                    self._fail(RemoteProtocolError("transport message failed authentication"))
                self._open_n += 1
                if k:
                    self._empty_run = 0
                    return k
                self._count_empty()
        self._compact()
        return NEED_DATA

    def receive_and_open(self, data: Buffer) -> list[bytes]:
        """:meth:`receive_data`, then every whole message's plaintext, in order.

        Raises:
            RemoteProtocolError: as :meth:`next_plaintext`.
            LocalProtocolError: if the transport is already dead.
        """
        self.receive_data(data)
        out: list[bytes] = []
        while (plaintext := self.next_plaintext()) is not NEED_DATA:
            assert isinstance(plaintext, bytes)
            out.append(plaintext)
        return out

    # -- internals -----------------------------------------------------------------------

    def _count_empty(self) -> None:
        self._empty_run += 1
        if self._empty_run > MAX_EMPTY_IN_A_ROW:
            self._fail(
                RemoteProtocolError(
                    f"more than {MAX_EMPTY_IN_A_ROW} empty transport messages in a row"
                )
            )

    def _check_alive(self) -> None:
        if self._error is not None:
            raise LocalProtocolError(f"Noise transport is dead: {self._error}") from self._error

    def _fail(self, error: ProtocolError) -> NoReturn:
        self._error = error
        self._chunks.clear()
        self._buffered = 0
        logger.debug("noise transport failed: %s", error)
        raise error

    def _compact(self) -> None:
        """Keep a copy of a partial message's bytes instead of the chunks they lie in: the
        tail of a 1 MiB read kept the whole read alive until the rest came (a peer that
        sent a burst ending halfway through a message, then waited, held ~0.8 MiB per
        connection of a node). Called with no view of the chunks handed out."""
        chunks = self._chunks
        if not chunks:
            return
        held = len(chunks[0]) if len(chunks) == 1 else sum(len(chunk) for chunk in chunks)
        if held > _COMPACT_FROM and held > 2 * self._buffered:
            rest = b"".join([chunks[0][self._pos :], *list(chunks)[1:]])
            self._chunks = collections.deque([memoryview(rest)])
            self._pos = 0

    def _peek_length(self) -> int | None:
        """The next message's declared length, or None while its prefix is incomplete."""
        if self._buffered < LENGTH_PREFIX.size:
            return None
        head = self._chunks[0]
        if len(head) - self._pos >= LENGTH_PREFIX.size:
            length = (head[self._pos] << 8) | head[self._pos + 1]
        else:
            length = (head[self._pos] << 8) | self._chunks[1][0]
        if length < TAG_LENGTH:
            self._fail(RemoteProtocolError(f"transport message of {length} bytes has no tag"))
        return length

    def _take_message(self, capacity: int = MAX_PLAINTEXT_PER_MESSAGE) -> memoryview | None:
        """Consume the next whole message and return its ciphertext, or None if incomplete.

        Raises LocalProtocolError, consuming nothing, if its plaintext exceeds ``capacity``.
        """
        if self._buffered < LENGTH_PREFIX.size:
            return None
        if self._open_n >= MAX_NONCE:
            self._fail(RemoteProtocolError("Noise receive nonce exhausted"))
        head, pos = self._chunks[0], self._pos
        if len(head) - pos >= LENGTH_PREFIX.size:
            length = (head[pos] << 8) | head[pos + 1]
            end = pos + LENGTH_PREFIX.size + length
            if TAG_LENGTH <= length <= capacity + TAG_LENGTH and end <= len(head):
                # Fast path: prefix and ciphertext both inside the first chunk.
                self._buffered -= LENGTH_PREFIX.size + length
                if end == len(head):
                    self._chunks.popleft()
                    self._pos = 0
                else:
                    self._pos = end
                return head[end - length : end]
        declared = self._peek_length()
        assert declared is not None
        if declared - TAG_LENGTH > capacity:
            raise LocalProtocolError(
                f"buffer of {capacity} bytes is too small for a message of "
                f"{declared - TAG_LENGTH} bytes"
            )
        if self._buffered < LENGTH_PREFIX.size + declared:
            return None
        self._take(LENGTH_PREFIX.size)
        return self._take(declared)

    def _take(self, size: int) -> memoryview:
        """Consume ``size`` (<= 65535) buffered bytes: a view of the chunk when contiguous,
        else of a copy in the scratch buffer, valid until the next call."""
        self._buffered -= size
        head = self._chunks[0]
        end = self._pos + size
        if end <= len(head):
            taken = head[self._pos : end]
            if end == len(head):
                self._chunks.popleft()
                self._pos = 0
            else:
                self._pos = end
            return taken
        # Straddles chunks: gather into the scratch buffer (valid until the next _take).
        if self._scratch is None:
            self._scratch = bytearray(MAX_MESSAGE_LENGTH)
        gathered = self._scratch
        filled = 0
        while filled < size:
            head = self._chunks[0]
            piece = min(size - filled, len(head) - self._pos)
            gathered[filled : filled + piece] = head[self._pos : self._pos + piece]
            filled += piece
            if self._pos + piece == len(head):
                self._chunks.popleft()
                self._pos = 0
            else:
                self._pos += piece
        return memoryview(gathered)[:size]
