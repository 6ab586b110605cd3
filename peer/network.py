"""Pluggable byte transports: everything above runs on ``trio.abc.Stream``.

:class:`TcpNetwork` is the real thing; :class:`peer.memnet.MemoryNetwork` is an in-memory
switchboard with latency, partitions and crashes for tests. Both implement :class:`Network`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import trio

__all__ = ["Network", "ConnectionHandler", "TcpNetwork", "remote_host_of"]

logger = logging.getLogger(__name__)

ConnectionHandler = Callable[[trio.abc.Stream], Awaitable[None]]


@runtime_checkable
class Network(Protocol):
    """Where connections come from: dial out, or accept in."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a stream to ``host:port``.

        Raises:
            OSError: if the address cannot be reached.
        """
        ...

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``host:port`` forever, running ``handler`` on each.

        Reports the bound port with ``task_status.started(port)`` (``port=0`` picks one).
        The handler owns the stream and must close it.

        Raises:
            OSError: if the address cannot be bound.
        """
        ...


class TcpNetwork:
    """Real TCP through trio; ``TCP_NODELAY`` on every stream."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a TCP stream to ``host:port``.

        Raises:
            OSError: on refusal, unreachable host or a failed lookup.
        """
        stream = await trio.open_tcp_stream(host, port)
        _set_nodelay(stream)
        return stream

    async def serve(
        self,
        host: str,
        port: int,
        handler: ConnectionHandler,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` and run ``handler`` on each accepted stream.

        Raises:
            OSError: if the address cannot be bound.
        """
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        bound_port: int = listeners[0].socket.getsockname()[1]

        async def accepted(stream: trio.SocketStream) -> None:
            _set_nodelay(stream)
            await handler(stream)

        task_status.started(bound_port)
        await trio.serve_listeners(accepted, listeners)


def _set_nodelay(stream: trio.abc.Stream) -> None:
    if isinstance(stream, trio.SocketStream):
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:  # pragma: no cover - e.g. a non-TCP socket
            logger.debug("could not set TCP_NODELAY", exc_info=True)


def remote_host_of(stream: trio.abc.Stream) -> str:
    """The remote host (IP) of a stream, for per-host limits; ``"?"`` when unknown."""
    if isinstance(stream, trio.SocketStream):
        try:
            peer = stream.socket.getpeername()
        except OSError:
            return "?"
        return str(peer[0]) if isinstance(peer, tuple) else str(peer)
    host = getattr(stream, "remote_host", None)
    return host if isinstance(host, str) else "?"
