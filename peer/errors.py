"""Errors raised by the networked layer, by blame.

- :class:`RemoteError`: the remote peer answered, but with an error (its handler raised, or it
  refused the request). The connection is fine.
- :class:`PeerUnavailableError`: we could not reach the peer, it failed the handshake or proved
  a different identity, or the connection died mid-call. ``__cause__`` says how.
- :class:`LimitExceededError`: a local limit refused the operation (oversized message, too many
  connections).
- :class:`PeerStoppedError`: our own peer no longer runs (used after its context ended).
"""

from __future__ import annotations

from protocol.errors import SwarmError

__all__ = [
    "LimitExceededError",
    "PeerBusyError",
    "PeerStoppedError",
    "PeerUnavailableError",
    "RemoteError",
]


class RemoteError(SwarmError):
    """The remote handler raised or refused the request.

    ``code`` is a short machine-readable word; the ones swarm uses are ``"not_found"``,
    ``"bad_request"``, ``"internal"``, ``"unknown_method"``, ``"timeout"`` and
    ``"unavailable"`` (see docs/protocol.md, section 4.3).
    A handler may raise ``RemoteError(code, message)`` itself to answer with a typed error.
    """

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str]]:
        return (type(self), (self.code, self.message))


class PeerUnavailableError(SwarmError):
    """The peer cannot be reached, failed the handshake, or the connection died mid-call."""


class PeerSilentError(PeerUnavailableError):
    """Nothing came from the peer in time: a dial or handshake that outlasted the dial
    timeout, or a connection silent while calls waited on it. Our own link stalling looks
    the same from here (the DHT tells the two apart by whether a request of ours sent
    later was answered)."""


class PeerBusyError(PeerUnavailableError):
    """The peer answered the connection with the busy signal (``protocol.noise.BUSY_SIGNAL``)
    instead of its handshake: it is up, but turned us away for now (its connection limits
    for our address, which a flood from a neighbour behind the same NAT can use up); dial
    again a little later."""


class SelfDialError(PeerUnavailableError):
    """The address reached this peer itself (e.g. its own ``HOST:PORT`` among the initial
    peers, given without a PeerID)."""


class DuplicateIdentityError(SelfDialError):
    """An address that is not this peer's proved this peer's own PeerID: another process
    uses the same identity (a copied key file), and the two cannot tell their peers apart."""


class LimitExceededError(SwarmError):
    """A configured limit refused the operation (message size, connections)."""


class PeerStoppedError(SwarmError):
    """This peer is no longer running: its ``open_peer`` context (or background thread)
    has ended, or its loop crashed."""


STOPPED = "this peer has stopped: its open_peer (or run_in_background) block has ended"
"""What a call on a stopped peer raises :class:`PeerStoppedError` with (host and DHT alike)."""
