"""The error hierarchy shared by every layer.

Blame is part of the type: a ``LocalProtocolError`` means *we* tried to do
something the protocol forbids; a ``RemoteProtocolError`` means the other side
sent something malformed or hostile. Both are ``ProtocolError``.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error raised on purpose by swarm."""


class ProtocolError(SwarmError):
    """Malformed, oversized or hostile input: the connection that carried it is dropped."""


class LocalProtocolError(ProtocolError):
    """We were about to violate the protocol (e.g. send an oversized frame)."""


class RemoteProtocolError(ProtocolError):
    """The remote peer violated the protocol."""


class AddressError(ProtocolError, ValueError):
    """A malformed ``[PEERID@]HOST:PORT`` address: a ``ValueError`` too, since it is most
    often an argument (``listen=``, ``initial_peers=``) that a caller got wrong."""
