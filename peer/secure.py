"""A secure channel over any ``trio.abc.Stream``: the Noise XX handshake, then sealed data.

    secure = await secure_handshake(raw, identity, initiator=True, expected_peer_id=pid)
    await secure.send_all(b"hello")
    data = await secure.receive_some()

The data path avoids copies: outgoing data is sealed (``encrypt_into``) into one reusable
buffer a slice at a time and written from it; :meth:`SecureStream.receive_into` decrypts
straight into the caller's buffer. Memory follows the traffic: nothing is allocated per
stream up front, reads start at 64 KiB and grow to 1 MiB while they come back full (bulk),
and the send buffer grows to the largest slice sealed.

Blame: a tampered, replayed or truncated message from the peer closes the stream and raises
``trio.BrokenResourceError`` whose ``__cause__`` is the ``ProtocolError``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence

import trio

from protocol.errors import LocalProtocolError, ProtocolError
from protocol.identity import Identity, PeerID
from protocol.noise import (
    BUSY_SIGNAL,
    MAX_PLAINTEXT_PER_MESSAGE,
    NEED_DATA,
    NoiseHandshake,
    NoiseTransport,
    sealed_size,
)

from .buffer_pool import FRAME_POOL
from .errors import PeerBusyError, PeerUnavailableError
from .network import partial_sender, remote_host_of

__all__ = ["SecureStream", "secure_handshake", "turn_away"]

logger = logging.getLogger(__name__)

RECEIVE_SIZE = 1 << 20
"""Most bytes asked of the raw stream per read (trio reads fastest at <= 1 MiB)."""
_MIN_RECEIVE_SIZE = 1 << 16
"""First read size; doubled after each read that comes back full, halved after short ones."""
SEAL_SLICE = 1 << 20
"""Plaintext sealed per write: bounds a send's seal buffer to ``sealed_size(SEAL_SLICE)``."""
_KEEP_SEAL_BUFFER = 16 << 10
"""A connection keeps a seal buffer of its own up to this size (its small frames); a larger
send borrows one from the process's pool and gives it back after (see ``send_pieces``)."""
_HANDSHAKE_READ = 4096
_MAX_SEALED_WRITE = sealed_size(SEAL_SLICE)
_OVERHEAD = sealed_size(1) - 1  # a transport message's length prefix and tag
# Seconds of deciphering after which a receive lets the other tasks run: a megabyte read at
# once may hold 58,000 one-byte messages (a security review's peer sent them: the node's
# loop stood still 0.7-1 s per connection so used, averaging stopped). Checked every
# _CLOCK_EVERY messages; large messages take ~20-40 us each, so honest transfers pass it
# about once per 5 ms of deciphering, as the RPC reader does with frames.
_OPEN_AT_MOST = 0.005
_CLOCK_EVERY = 32

Buffer = bytes | bytearray | memoryview


class SecureStream(trio.abc.Stream):
    """A Noise-sealed stream with a proven remote identity (made by :func:`secure_handshake`).

    One task may send and one may receive at a time, as with any trio stream.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        transport: NoiseTransport,
        remote_peer_id: PeerID,
        remote_host: str | None = None,
    ):
        self.transport_stream = stream
        self.remote_peer_id = remote_peer_id
        self.remote_host = remote_host_of(stream) if remote_host is None else remote_host
        self._transport = transport
        self._own_out = bytearray()  # this connection's seal buffer, for small sends
        self._out: bytearray | memoryview = self._own_out  # or one lent by the pool
        self._send_some = partial_sender(stream)
        self._owed: memoryview | None = None  # sealed bytes of a cancelled write, unsent
        self._torn = False  # a send was cut off with its data not all sealed, or unknown
        self._receive_size = _MIN_RECEIVE_SIZE
        self._pending: memoryview | None = None  # decrypted bytes not yet handed out
        self._eof = False
        self._closed = False
        self._sending = False
        self._receiving = False
        self.last_received = -math.inf
        """trio time ciphertext last arrived (-inf: none yet), whole messages or not."""
        self._plaintext_received = 0  # bytes decrypted so far
        self._opening = 0.0  # seconds spent deciphering since the last scheduler pass
        self.write_started: float | None = None
        """trio time the raw write in progress (at most ``SEAL_SLICE`` bytes of data) began;
        None between writes. The host cuts off a peer that lets one stall (see ``HostConfig``):
        a deadline per write would cost more than the write of a small frame."""

    def __repr__(self) -> str:
        return f"<SecureStream {self.remote_peer_id.short()} at {self.remote_host}>"

    @property
    def bytes_received(self) -> int:
        """Bytes of data received so far: those decrypted, and the ciphertext of messages
        not whole yet (a slow message counts as it comes). An empty message adds nothing:
        18 bytes of it a second must not pass for a frame's progress."""
        return self._plaintext_received + self._transport.buffered

    # -- sending ---------------------------------------------------------------------------

    async def send_all(self, data: Buffer) -> None:
        """Seal and send ``data``.

        Raises:
            trio.BrokenResourceError: if the connection failed.
            trio.ClosedResourceError: if we closed the stream.
            trio.BusyResourceError: if another task is sending.
        """
        await self.send_pieces((data,))

    async def send_pieces(self, pieces: Sequence[Buffer]) -> None:
        """Seal and send several buffers back to back, in as few writes as possible.
        ``pieces`` is read again after every await (an item may be replaced meanwhile).

        Cancelled once all of ``pieces`` was sealed, the stream keeps what did not go out
        yet and sends it first at the next send (so the peer still gets every byte, in
        order): it stays :attr:`intact`. Cancelled earlier, or on a raw stream that cannot
        tell how much of a write went out, it is torn: every later send raises.

        Raises:
            trio.BrokenResourceError: if the connection failed, or an earlier send was
                cut off midway (see :attr:`intact`).
            trio.ClosedResourceError: if we closed the stream.
            trio.BusyResourceError: if another task is sending.
        """
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        sealing = False  # between the first seal of this send and the last
        lent: memoryview | None = None  # a pooled seal buffer, for a large send
        try:
            if self._closed:
                raise trio.ClosedResourceError("stream closed")
            if self._torn:
                raise trio.BrokenResourceError("an earlier send was cut off midway")
            if self._owed is not None:
                await self._send_owed()
            # A write seals at most SEAL_SLICE of plaintext plus its messages' overhead
            # (below: it writes before adding a slice that would go beyond), so this much
            # holds the whole send, write by write (each piece's messages: at most one
            # more than its whole ones, 18 bytes of overhead each).
            plain = sum(memoryview(piece).nbytes for piece in pieces)
            need = plain + _OVERHEAD * (len(pieces) + plain // MAX_PLAINTEXT_PER_MESSAGE)
            if need > _KEEP_SEAL_BUFFER:
                lent = self._out = FRAME_POOL.get(min(need, _MAX_SEALED_WRITE))
            sealing = True
            used = 0
            for index in range(len(pieces)):
                size = memoryview(pieces[index]).nbytes
                for start in range(0, size, SEAL_SLICE):
                    take = min(SEAL_SLICE, size - start)
                    if used and used + take > SEAL_SLICE:
                        await self._write(used)
                        used = 0
                    # The piece is read again after every await: its owner may have
                    # swapped it for a copy meanwhile (a cancelled call's payload).
                    with (
                        memoryview(pieces[index]) as view,
                        view.cast("B") as flat,
                        flat[start : start + take] as part,
                    ):
                        used += self._seal(part, used)
            sealing = False
            if used:
                await self._write(used)
            else:
                await trio.lowlevel.checkpoint()
        except BaseException:
            if sealing:
                self._torn = True
            raise
        finally:
            if lent is not None:  # back to the pool: no view of it is left (owed bytes
                self._out = self._own_out  # were copied out)
                del lent
            self._sending = False

    @property
    def intact(self) -> bool:
        """False once a send was cut off midway in a way that loses bytes (see
        :meth:`send_pieces`): the byte stream the peer reads is broken from there on."""
        return not self._torn

    def _seal(self, data: memoryview, offset: int) -> int:
        try:
            return self._transport.seal_into(data, self._out, offset)
        except LocalProtocolError as exc:  # nonce exhausted: this connection is spent
            raise trio.BrokenResourceError("the secure channel cannot send more") from exc

    async def _write(self, size: int) -> None:
        """Send ``self._out[:size]``. Interrupted, the part not sent is kept as owed when
        the raw stream says how much went out; else the stream is torn."""
        self.write_started = trio.current_time()
        try:
            with memoryview(self._out) as view, view[:size] as chunk:
                if self._send_some is None:
                    try:
                        await self.transport_stream.send_all(chunk)
                    except BaseException:
                        self._torn = True
                        raise
                    return
                sent = 0
                try:
                    while sent < size:
                        with chunk[sent:] as rest:
                            sent += await self._send_some(rest)
                except BaseException:
                    with chunk[sent:] as rest:
                        self._owed = memoryview(bytes(rest))  # _out is reused next time
                    raise
        finally:
            self.write_started = None

    async def _send_owed(self) -> None:
        """Send what a cancelled write left unsent (it may be cancelled again: what is
        still owed stays owed)."""
        assert self._send_some is not None
        self.write_started = trio.current_time()
        try:
            while self._owed is not None:
                sent = await self._send_some(self._owed)
                self._owed = self._owed[sent:] if sent < self._owed.nbytes else None
        finally:
            self.write_started = None

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    # -- receiving -------------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The next decrypted bytes (at most ``max_bytes``), or ``b""`` at end of stream.

        Raises:
            trio.BrokenResourceError: on a tampered/replayed/truncated message or a failure.
            trio.ClosedResourceError: if we closed the stream.
            trio.BusyResourceError: if another task is receiving.
        """
        size = MAX_PLAINTEXT_PER_MESSAGE if max_bytes is None else max_bytes
        if size < 1:
            raise ValueError("max_bytes must be >= 1")
        buffer = bytearray(size)
        n = await self.receive_into(buffer)
        del buffer[n:]
        return bytes(buffer)

    async def receive_into(self, buffer: bytearray | memoryview) -> int:
        """Decrypt the next bytes straight into ``buffer``; returns the count, 0 at EOF.

        Only waits for the network when nothing is decrypted or decryptable yet; then fills
        ``buffer`` with every whole buffered message that fits. A message larger than
        ``buffer`` is decrypted aside and handed out over several calls.

        Raises:
            trio.BrokenResourceError: on a tampered/replayed/truncated message or a failure.
            trio.ClosedResourceError: if we closed the stream.
            trio.BusyResourceError: if another task is receiving.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        try:
            if self._closed:
                raise trio.ClosedResourceError("stream closed")
            target = memoryview(buffer).cast("B")
            if not len(target):
                return 0
            while True:
                if self._pending is not None:
                    return self._take_pending(target)
                if self._opening > _OPEN_AT_MOST:
                    self._opening = 0.0
                    await trio.lowlevel.checkpoint()  # (cancelled here: nothing taken)
                n = self._open_into(target)
                if n is not None:
                    return n
                if self._eof or not await self._fill():
                    return 0
        finally:
            self._receiving = False

    async def wait_buffered(self, nbytes: int) -> None:
        """Wait until ``nbytes`` have arrived that no ``receive_into`` took yet (sealed or
        not; a sealed message counts its 18 bytes of overhead too), or the stream ended.
        A reader calls it before allocating a large buffer for data announced but not yet
        sent: memory then follows what the peer actually sent.

        Raises:
            trio.BrokenResourceError: if the connection failed or ended inside a message.
            trio.ClosedResourceError: if we closed the stream.
            trio.BusyResourceError: if another task is receiving.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        try:
            while not self._eof and self._buffered < nbytes:
                if self._closed:
                    raise trio.ClosedResourceError("stream closed")
                await self._fill()
        finally:
            self._receiving = False

    @property
    def _buffered(self) -> int:
        pending = 0 if self._pending is None else len(self._pending)
        return pending + self._transport.buffered

    @property
    def unread(self) -> int:
        """Bytes that arrived and no ``receive_into`` took yet (sealed or not)."""
        return self._buffered

    def _take_pending(self, target: memoryview) -> int:
        assert self._pending is not None
        n = min(len(target), len(self._pending))
        target[:n] = self._pending[:n]
        rest = self._pending[n:]
        self._pending = rest if len(rest) else None
        return n

    def _open_into(self, target: memoryview) -> int | None:
        """Decrypt every whole message that fits into ``target`` (a larger first one goes
        aside); None if no whole message is buffered yet."""
        transport = self._transport
        filled = opened = 0
        started = time.perf_counter()
        try:
            while filled < len(target):
                opened += 1
                if opened % _CLOCK_EVERY == 0 and (
                    time.perf_counter() - started + self._opening > _OPEN_AT_MOST
                ):
                    break  # (filled: a message before this one had a plaintext)
                try:
                    n = transport.next_plaintext_into(target[filled:] if filled else target)
                except LocalProtocolError:  # the next message does not fit in what is left
                    if filled:
                        break
                    plaintext = transport.next_plaintext()  # aside, in its own bytes
                    if plaintext is NEED_DATA:
                        return None
                    assert isinstance(plaintext, bytes)
                    self._plaintext_received += len(plaintext)
                    self._pending = memoryview(plaintext)
                    return self._take_pending(target)
                if n is NEED_DATA:
                    break
                assert isinstance(n, int)
                self._plaintext_received += n
                filled += n
        except ProtocolError as exc:
            self._fail(exc)
            raise trio.BrokenResourceError(f"secure channel failed: {exc}") from exc
        finally:
            self._opening += time.perf_counter() - started
        return filled or None

    async def _fill(self) -> bool:
        """Read more ciphertext; False at a clean end of stream."""
        size = self._receive_size
        data = await self.transport_stream.receive_some(size)
        self._opening = 0.0  # (a scheduler pass: trio's streams checkpoint)
        if len(data) >= size:
            self._receive_size = min(2 * size, RECEIVE_SIZE)
        elif len(data) < size // 4:
            self._receive_size = max(size // 2, _MIN_RECEIVE_SIZE)
        if not data:
            self._eof = True
            if self._transport.buffered:
                exc = ProtocolError("stream ended inside a sealed message")
                self._fail(exc)
                raise trio.BrokenResourceError("secure channel truncated") from exc
            return False
        try:
            self._transport.receive_data(data)
        except ProtocolError as exc:
            self._fail(exc)
            raise trio.BrokenResourceError(f"secure channel failed: {exc}") from exc
        self.last_received = trio.current_time()
        return True

    def _fail(self, exc: ProtocolError) -> None:
        logger.debug("secure channel with %s failed: %s", self.remote_peer_id.short(), exc)
        self._pending = None
        self._eof = True

    # -- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the stream (and the raw stream under it)."""
        self._closed = True
        self._pending = None
        await self.transport_stream.aclose()


async def secure_handshake(
    stream: trio.abc.Stream,
    identity: Identity,
    *,
    initiator: bool,
    expected_peer_id: PeerID | None = None,
    busy_if_cancelled: Callable[[], bool] | None = None,
    on_reply: Callable[[], None] | None = None,
) -> SecureStream:
    """Run the Noise XX handshake on ``stream`` and return the secure stream.

    Not bounded in time: wrap it in a cancel scope. On any failure (including
    cancellation) ``stream`` is closed. A responder cancelled before its reply sends
    ``BUSY_SIGNAL`` first when ``busy_if_cancelled()`` says so (it was cut off to make
    room: the dialer should count us as busy, not gone). ``on_reply()`` is called as a
    responder's reply first goes out (from then on, a cut off says nothing).

    Raises:
        PeerUnavailableError: the peer closed the stream, sent something invalid, or proved
            an identity other than ``expected_peer_id`` (``__cause__`` says which).
    """
    heard = False  # a byte of the peer's handshake came
    # Read now: a socket reset by the peer has no peer address any more, yet still hands
    # out what came before the reset (its last handshake message, and a request). Before
    # our reply, the dialer cannot have finished its handshake: it is still connected.
    remote_host = remote_host_of(stream)
    replied = False  # a byte of our own handshake went out
    try:
        handshake = NoiseHandshake(identity, initiator=initiator, expected_peer_id=expected_peer_id)
        while not handshake.complete:
            if out := handshake.data_to_send():
                if not replied and on_reply is not None:
                    on_reply()
                replied = True
                await stream.send_all(out)
            data = await stream.receive_some(_HANDSHAKE_READ)
            if initiator and not heard:
                data = await _read_first_bytes(stream, data)
                if data.startswith(BUSY_SIGNAL):
                    raise PeerBusyError(_TURNED_AWAY)
                if not data:
                    raise PeerUnavailableError(_CLOSED_UNHEARD)
            if not data:
                raise PeerUnavailableError("connection closed during the handshake")
            heard = True
            handshake.receive_data(data)
        if out := handshake.data_to_send():
            await stream.send_all(out)
        peer_id = handshake.remote_peer_id
        return SecureStream(stream, handshake.into_transport(), peer_id, remote_host)
    except BaseException as exc:
        cut_off = isinstance(exc, trio.Cancelled) and not replied
        if cut_off and busy_if_cancelled is not None and busy_if_cancelled():
            await _send_busy_shielded(stream)
        await trio.aclose_forcefully(stream)
        if isinstance(exc, ProtocolError):
            raise PeerUnavailableError(f"handshake failed: {exc}") from exc
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            if initiator and not heard and not isinstance(exc, trio.ClosedResourceError):
                raise PeerUnavailableError(f"{_CLOSED_UNHEARD} ({exc})") from exc
            raise PeerUnavailableError(f"connection lost during the handshake: {exc}") from exc
        raise


async def _read_first_bytes(stream: trio.abc.Stream, data: bytes | bytearray) -> bytes | bytearray:
    """``data`` (the first read of the responder's bytes), completed to at least as long
    as ``BUSY_SIGNAL`` unless the stream ends first: it may come in pieces."""
    while data and len(data) < len(BUSY_SIGNAL):
        more = await stream.receive_some(_HANDSHAKE_READ)
        if not more:
            break
        data += more
    return data


async def _send_busy_shielded(stream: trio.abc.Stream) -> None:
    """Send ``BUSY_SIGNAL`` from inside a cancelled scope (at most 0.5 s: a connection's
    buffers take 2 bytes at once)."""
    with trio.move_on_after(0.5) as scope:
        scope.shield = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.send_all(BUSY_SIGNAL)


async def turn_away(stream: trio.abc.Stream) -> None:
    """Refuse a connection before its handshake: send ``BUSY_SIGNAL`` (the dialer learns
    that we are up but at a limit, not gone) and close. Waits at most a second to write
    (a fresh connection's buffers take 2 bytes at once)."""
    try:
        with trio.move_on_after(1.0):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await stream.send_all(BUSY_SIGNAL)
    finally:  # closed even when cancelled (the host closing): else the dialer waits
        await trio.aclose_forcefully(stream)


_TURNED_AWAY = (
    "the peer turned the connection away before its handshake: busy, or at its limit of "
    "connections from our address; try again later"
)
_CLOSED_UNHEARD = (
    "the peer closed the connection before its handshake (nothing behind a proxy, or not "
    "a swarm peer)"
)
