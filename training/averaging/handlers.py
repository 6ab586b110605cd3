"""The :class:`~.averager.Averager`'s RPC handlers (``Handlers``, a base class of it): pings,
joins (passed on to the matchmaker), chunks for the part we reduce, and result streams;
each checks that the caller's round and group are the step we are in. See messages.py for
the bodies."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

import trio

from peer import RemoteError, Reply, Request
from protocol.errors import RemoteProtocolError
from protocol.identity import PeerID

from .config import AveragerConfig, default_retain_budget
from .grouping import DECLARATION_KEYS
from .layout import FlatVector
from .matchmaking import Matchmaker
from .messages import ChunkHeader, parse_ping, parse_result_request
from .reducer import DropReason
from .reducing import ReducerService

_CHUNK_SLACK = 1 << 16  # bytes of codec header a chunk's blob may carry beyond its values
_JOIN_KEYS = frozenset({"round", "decl", "skipped"})
_RESULT_KEYS = frozenset({"round", "group", "part"})


def _check_small(request: Request, keys: frozenset[str]) -> None:
    """Refuse a request that carries a payload or body keys beyond ``keys``: join and
    result requests wait (for the round to close, the group to form) while holding the
    request, so one padded to the frame limit (4 MiB) would be held that long, 128 at
    once per connection.

    Raises:
        RemoteError: ``bad_request``.
    """
    if len(request.payload) or not request.body.keys() <= keys:
        raise RemoteError("bad_request", "unexpected payload or keys in the request")


@dataclass
class _Active:
    """The round this averager is in, as the RPC handlers see it."""

    round: int
    ready: trio.Event = field(default_factory=trio.Event)
    service: ReducerService | None = None
    group_id: bytes | None = None  # the confirmed group's tag (None: no group, or not yet)
    # chunks that came before our group was confirmed wait, payload and all, until it is:
    # per sender and in bytes, bounded (anyone who read our round from the DHT can send)
    parked: Counter[PeerID] = field(default_factory=Counter)
    parked_bytes: int = 0


class Handlers:
    """The RPC handlers of :class:`~.averager.Averager`, one of its base classes (the
    attributes below are the averager's)."""

    config: AveragerConfig
    flat: FlatVector
    _matchmaker: Matchmaker
    _active: _Active | None
    _left: deque[tuple[int, bytes]]

    async def _on_ping(self, request: Request) -> Reply:
        """``{}``: alive. ``{round}``: alive *and* in that round, else ``not_found``: a peer
        whose step ended (or was cancelled) answers pings, but will not send or serve.
        ``{round, group}``: in that round and, once our group is confirmed, in that group
        (a slot holds consecutive steps: our next step in the same round is not the one
        the caller waits on)."""
        round_no, group_id = parse_ping(request.body)
        if round_no is not None:
            active = self._active
            if active is None or active.round != round_no:
                raise RemoteError("not_found", f"not in round {round_no}")
            if group_id is not None and (
                (round_no, group_id) in self._left
                or (active.ready.is_set() and active.group_id != group_id)
            ):
                raise RemoteError("not_found", f"not in that group of round {round_no}")
        return Reply({})

    async def _on_join(self, request: Request) -> Reply:
        _check_small(request, _JOIN_KEYS)
        decl = request.body.get("decl")
        if isinstance(decl, dict) and not decl.keys() <= DECLARATION_KEYS:
            raise RemoteError("bad_request", "unknown keys in the declaration")
        return await self._matchmaker.on_join(request)

    async def _service(
        self, round_no: int, group_id: bytes, chunk: Request | None = None
    ) -> ReducerService:
        """Our reducer for ``round_no`` once the group is confirmed (a ``chunk`` that comes
        before waits for it, within the bounds of :meth:`_park`), if that group is
        ``group_id``.

        Raises:
            RemoteError: ``not_found`` when we are not in that round and group (a message
                of the caller's step before, in a round of the same number, lands here);
                ``bad_request`` when we reduce no part.
        """
        active = self._active
        if active is None or active.round != round_no:
            raise RemoteError("not_found", f"not in round {round_no}")
        if (round_no, group_id) in self._left:
            raise RemoteError("not_found", f"not in that group of round {round_no}: it left")
        if chunk is not None and not active.ready.is_set():
            with self._park(active, chunk):
                await active.ready.wait()
        else:
            await active.ready.wait()
        if active.group_id != group_id:
            raise RemoteError("not_found", f"not in that group of round {round_no}")
        if active.service is None:
            raise RemoteError("bad_request", "no part is reduced here")
        return active.service

    async def _on_chunk(self, request: Request) -> Reply:
        try:
            header = ChunkHeader.from_body(request.body)
        except RemoteProtocolError:
            await self._drop_for_garbage(request)
            raise
        service = await self._service(header.round, header.group_id, request)
        return await service.on_chunk(request.peer_id, header, request.payload)

    @contextlib.contextmanager
    def _park(self, active: _Active, chunk: Request) -> Iterator[None]:
        """Hold ``chunk`` until our group is confirmed: at most ``2 * max_inflight`` chunks
        per sender (an honest one has ``max_inflight`` uploads in flight), each no larger
        than a chunk's largest blob, and the reducer's default ``retain_budget`` in all. A hostile
        peer that read our round from the DHT sent 240 calls of 4 MiB before our group
        formed: 590 MB held until then, to be refused as a non-member afterwards.

        Raises:
            RemoteError: ``busy`` beyond those bounds.
        """
        size = len(chunk.payload)
        config = self.config
        # the reducer's default retain_budget (a smaller one still admits a sender at a
        # time once ready: every early chunk of one sender must fit)
        budget = max(
            default_retain_budget(self.flat.array.nbytes),
            4 * config.max_inflight * config.chunk_bytes,
        )
        if (
            size > 2 * config.chunk_bytes + _CHUNK_SLACK  # (topk near 1: indices too)
            or active.parked[chunk.peer_id] >= 2 * config.max_inflight
            or active.parked_bytes + size > budget
        ):
            raise RemoteError("busy", "too many chunks before the group was confirmed")
        active.parked[chunk.peer_id] += 1
        active.parked_bytes += size
        try:
            yield
        finally:
            active.parked[chunk.peer_id] -= 1
            active.parked_bytes -= size

    async def _drop_for_garbage(self, request: Request) -> None:
        """A malformed chunk header that names our round, group and part drops its sender
        from the part at once (``garbage``): left pending, it would hold the others to the
        cutoff. One that comes before the group is confirmed waits for it as a chunk does,
        within :meth:`_park`'s bounds (it holds its payload: a security review's 128 calls
        of 4 MiB were all held, +515 MB); beyond them it is answered at once."""
        body = request.body
        round_no, group_id, part = body.get("round"), body.get("group"), body.get("part")
        if type(round_no) is not int or type(group_id) is not bytes or type(part) is not int:
            return
        try:
            service = await self._service(round_no, group_id, request)  # (as a chunk waits)
        except RemoteError:
            return
        if service.part == part:
            service.drop_sender(request.peer_id, DropReason.GARBAGE)

    async def _on_result(self, request: Request) -> AsyncIterator[Reply]:
        _check_small(request, _RESULT_KEYS)
        round_no, group_id, part = parse_result_request(request.body)
        service = await self._service(round_no, group_id)
        if part != service.part or service.plan.member(request.peer_id) is None:
            raise RemoteError("bad_request", f"part {part} is not reduced here for you")
        async with aclosing(service.results(request.peer_id)) as items:
            async for item in items:
                yield item
