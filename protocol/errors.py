"""The error hierarchy shared by every layer.

Blame is part of the type: a ``LocalProtocolError`` means *we* tried to do
something the protocol forbids; a ``RemoteProtocolError`` means the other side
sent something malformed or hostile. Both are ``ProtocolError``.
"""

from __future__ import annotations

import reprlib

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 57, 57
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 4


def brief(value: object) -> str:
    """A short repr of a received value for an error message: bounded in length and in
    depth (``repr`` of a list nested 1000 deep, which msgpack may carry, raises
    RecursionError)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
