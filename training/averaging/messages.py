"""RPC bodies of the averaging protocol, with strict validation.

Methods (``{m}`` = ``avg.<hash of the prefix>``, so several averagers share a node):

    {m}.join     member -> leader    {round, decl[, skipped]}  ->  GroupConfirmation | refusal
    {m}.chunk    sender -> reducer   ChunkHeader + payload (one codec blob)  ->  {}
    {m}.result   member -> reducer   {round, group, part}  =>  ResultHeader, then {chunk} + payload
    {m}.ping     anyone -> anyone    {}, {round} or {round, group}  ->  {} (not_found: not in it)

``group`` in a chunk, result request or ping is the group's tag (``plan.group_tag``): a
digest of the confirmation as the member received it, the leader's random draw (the
confirmation's ``group``) included. Consecutive steps of a slot share a round number, and
the tag tells one step's group from the next one's (a late chunk, result request or ping
of the step before is answered ``not_found``); members that a lying leader told different
things have different tags.

With the ``none`` codec a payload may be *raw* (``"raw": true`` in the chunk's body or the
result item's): the chunk's float32 values, little-endian, without the codec blob header,
so that they are sent straight from the tensor without a copy.

Anything malformed raises :class:`~protocol.errors.RemoteProtocolError`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ProtocolError, RemoteProtocolError, brief
from protocol.identity import PeerID

from .config import MAX_GROUP_SIZE
from .grouping import Declaration
from .layout import Span, check_spans
from .reducer import DropReason

MAX_MEMBERS = MAX_GROUP_SIZE
MAX_NOTE = 200  # characters in a result header's note


def method_prefix(prefix: str) -> str:
    """RPC method namespace of one averager prefix (method names are ``[a-z0-9_.]``)."""
    return "avg." + hashlib.sha256(prefix.encode()).hexdigest()[:16]


def _int(body: Mapping[str, Any], key: str, low: int = 0, high: int = 1 << 62) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value < high:
        raise RemoteProtocolError(f"field {key!r} must be an int in [{low}, {high})")
    return value


def _peer(text: Any) -> PeerID:
    if not isinstance(text, str):
        raise RemoteProtocolError("a peer id is a base58 string")
    try:
        return PeerID.from_base58(text)
    except ProtocolError as exc:
        raise RemoteProtocolError(str(exc)) from None


def _map(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RemoteProtocolError("a body is a map")
    return body


MAX_GROUP_ID = 1 << 62
"""A leader's draw for its group (the confirmation's ``group``) is an int in [1, MAX_GROUP_ID)."""
TAG_BYTES = 16
"""A group tag (the ``group`` of a chunk, result request or ping) is this many bytes: 128
bits, so that no leader can find two confirmations with one tag (``plan.group_tag``)."""


def _tag(body: Mapping[str, Any]) -> bytes:
    value = body.get("group")
    if type(value) is not bytes or len(value) != TAG_BYTES:
        raise RemoteProtocolError(f"field 'group' must be a group tag: {TAG_BYTES} bytes")
    return value


def parse_ping(body: Any) -> tuple[int | None, bytes | None]:
    """``(round, group)`` a ping asks about: ``(None, None)`` for a plain ``{}`` (alive?),
    ``(round, None)`` for the round alone (a leader asking an expected member).

    Raises: RemoteProtocolError when ``round`` is present but not an int in range, or
    ``group`` present but not a tag (nil included: nil never stands in for an absent key),
    or ``group`` comes without ``round``."""
    body = _map(body)
    if "group" in body and "round" not in body:
        raise RemoteProtocolError("a ping names a group only with its round")
    round_no = _int(body, "round") if "round" in body else None
    group = _tag(body) if "group" in body else None
    return round_no, group


def parse_result_request(body: Any) -> tuple[int, bytes, int]:
    """``(round, group, part)`` of a result request.

    Raises: RemoteProtocolError unless ``round`` and ``part`` are ints in range ([0,
    2**62), [0, 256)) and ``group`` a tag."""
    body = _map(body)
    return (_int(body, "round"), _tag(body), _int(body, "part", 0, MAX_MEMBERS))


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A member asking to join. ``skipped``: members ranked before the callee in the group
    that the caller found gone this round (they failed its join at once), so that it asks
    the callee to lead in their place; absent on the wire when empty (older peers send no
    such key, and refuse it)."""

    round: int
    declaration: Declaration
    skipped: tuple[PeerID, ...] = ()

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"round": self.round, "decl": self.declaration.to_wire(tagged=False)}
        if self.skipped:
            body["skipped"] = [str(p) for p in self.skipped]
        return body

    @classmethod
    def from_body(cls, peer_id: PeerID, body: Any, max_skipped: int = MAX_MEMBERS) -> JoinRequest:
        """``max_skipped``: the most ``skipped`` entries accepted (the group size).

        Raises: RemoteProtocolError on malformed input."""
        body = _map(body)
        skipped = body.get("skipped", [])
        if "skipped" in body and not skipped:  # sent only when non-empty (see to_body)
            raise RemoteProtocolError("skipped must be omitted when empty")
        if not isinstance(skipped, list | tuple) or len(skipped) > max_skipped:
            raise RemoteProtocolError(f"skipped must be a list of at most {max_skipped} peer ids")
        return cls(
            _int(body, "round"),
            Declaration.from_wire(peer_id, body.get("decl")),
            tuple(_peer(p) for p in skipped),
        )


@dataclass(frozen=True, slots=True)
class GroupConfirmation:
    """The leader's final word: the members in order, and part ``i`` for ``reducers[i]``.
    ``group_id``: the number the leader drew for this group (every message of its exchange
    names the tag made from it and the rest: see the module's docstring)."""

    round: int
    members: tuple[Declaration, ...]
    spans: tuple[Span, ...]  # one per non-client member, in member order
    budget: float  # seconds left of the leader's step, from receipt (members keep their own)
    group_id: int = field(kw_only=True)

    @property
    def reducers(self) -> tuple[Declaration, ...]:
        return tuple(m for m in self.members if not m.client_mode)

    def to_body(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "round": self.round,
            "group": self.group_id,
            "members": [[str(m.peer_id), m.to_wire(tagged=False)] for m in self.members],
            "spans": [list(span) for span in self.spans],
            "budget": self.budget,
        }

    @classmethod
    def from_body(cls, body: Any, total: int) -> GroupConfirmation:
        """Raises: RemoteProtocolError on malformed input or spans that do not tile."""
        body = _map(body)
        if body.get("status") != "ok":  # a refusal (the join code tells those apart first)
            raise RemoteProtocolError("a confirmation's status is 'ok'")
        members_raw = body.get("members")
        spans_raw = body.get("spans")
        budget = body.get("budget")
        if not isinstance(members_raw, Sequence) or not 1 <= len(members_raw) <= MAX_MEMBERS:
            raise RemoteProtocolError("members must be a non-empty list")
        members: list[Declaration] = []
        for item in members_raw:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise RemoteProtocolError("a member is [peer_id, declaration]")
            members.append(Declaration.from_wire(_peer(item[0]), item[1]))
        if len({m.peer_id for m in members}) != len(members):
            raise RemoteProtocolError("a member is listed twice")
        if not isinstance(spans_raw, Sequence):
            raise RemoteProtocolError("spans must be a list")
        spans = []
        for item in spans_raw:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise RemoteProtocolError("a span is [start, stop]")
            if not all(type(x) is int for x in item):
                raise RemoteProtocolError("span bounds are ints")
            spans.append((int(item[0]), int(item[1])))
        if len(spans) != sum(not m.client_mode for m in members):
            raise RemoteProtocolError("one span per non-client member")
        try:
            check_spans(spans, total)
        except ValueError as exc:
            raise RemoteProtocolError(str(exc)) from None
        if (
            isinstance(budget, bool)  # (True passed for one second)
            or not isinstance(budget, int | float)
            or not (math.isfinite(budget) and budget > 0)
        ):
            raise RemoteProtocolError("budget must be a positive number")
        return cls(
            _int(body, "round"),
            tuple(members),
            tuple(spans),
            float(budget),
            group_id=_int(body, "group", 1, MAX_GROUP_ID),
        )


def raw_flag(body: Mapping[str, Any]) -> bool:
    """The optional ``raw`` field of a chunk or a result item (absent: False).

    Raises:
        RemoteProtocolError: if it is present and not a bool.
    """
    raw = body.get("raw", False)
    if type(raw) is not bool:
        raise RemoteProtocolError("field 'raw' must be a bool")
    return raw


_CHUNK_KEYS = frozenset(
    {"round", "group", "part", "chunk", "epoch", "weight", "abort", "raw", "retry"}
)
_RESULT_KEYS = frozenset({"contributors", "dropped", "weight", "chunks", "note"})


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """One chunk of a sender's part, or (``abort`` set) the sender withdrawing from it."""

    round: int
    part: int
    chunk: int
    epoch: int
    weight: float
    abort: DropReason | None = None
    raw: bool = False  # the payload is raw float32 values (codec none), not a codec blob
    # sent again after the connection broke before the answer came: the same bytes are
    # acknowledged again (any other repeat of a chunk is garbage)
    retry: bool = False
    group_id: bytes = field(kw_only=True)  # the group's tag (see the module docstring)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "round": self.round,
            "group": self.group_id,
            "part": self.part,
            "chunk": self.chunk,
            "epoch": self.epoch,
            "weight": self.weight,
        }
        if self.abort is not None:
            body["abort"] = self.abort.value
        if self.raw:
            body["raw"] = True
        if self.retry:
            body["retry"] = True
        return body

    @classmethod
    def from_body(cls, body: Any) -> ChunkHeader:
        """Raises: RemoteProtocolError on malformed input."""
        body = _map(body)
        if not body.keys() <= _CHUNK_KEYS:
            raise RemoteProtocolError("unknown keys in a chunk header")
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, float | int):
            raise RemoteProtocolError("weight must be a number")
        retry = body.get("retry", False)
        if type(retry) is not bool:
            raise RemoteProtocolError("field 'retry' must be a bool")
        abort = body.get("abort")
        reason = None
        if abort is not None:
            if type(abort) is not str:  # (DropReason(x) reprs x: deep lists recurse)
                raise RemoteProtocolError("field 'abort' must be a string")
            try:
                reason = DropReason(abort)
            except ValueError:
                raise RemoteProtocolError(f"unknown abort reason {brief(abort)}") from None
        return cls(
            _int(body, "round"),
            _int(body, "part", 0, MAX_MEMBERS),
            _int(body, "chunk", 0, 1 << 32),
            _int(body, "epoch"),
            float(weight),
            reason,
            raw_flag(body),
            retry,
            group_id=_tag(body),
        )


@dataclass(frozen=True, slots=True)
class ResultHeader:
    """First item of a result stream: how the part was averaged, then ``chunks`` items."""

    contributors: tuple[PeerID, ...]
    dropped: tuple[tuple[PeerID, DropReason], ...]
    weight: float
    chunks: int
    note: str = ""  # why there is no result although some sent everything (e.g. overflow)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "contributors": [str(p) for p in self.contributors],
            "dropped": [[str(p), r.value] for p, r in self.dropped],
            "weight": self.weight,
            "chunks": self.chunks,
        }
        if self.note:
            body["note"] = self.note
        return body

    @classmethod
    def from_body(cls, body: Any) -> ResultHeader:
        """Raises: RemoteProtocolError on malformed input."""
        body = _map(body)
        if not body.keys() <= _RESULT_KEYS:
            raise RemoteProtocolError("unknown keys in a result header")
        contributors_raw = body.get("contributors")
        dropped_raw = body.get("dropped")
        weight = body.get("weight")
        if not isinstance(contributors_raw, Sequence) or len(contributors_raw) > MAX_MEMBERS:
            raise RemoteProtocolError("contributors must be a list")
        if not isinstance(dropped_raw, Sequence) or len(dropped_raw) > MAX_MEMBERS:
            raise RemoteProtocolError("dropped must be a list")
        dropped = []
        for item in dropped_raw:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise RemoteProtocolError("a dropped entry is [peer_id, reason]")
            if type(item[1]) is not str:
                raise RemoteProtocolError("a drop reason must be a string")
            try:
                dropped.append((_peer(item[0]), DropReason(item[1])))
            except ValueError:
                raise RemoteProtocolError(f"unknown drop reason {brief(item[1])}") from None
        if (
            isinstance(weight, bool)
            or not isinstance(weight, float | int)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise RemoteProtocolError("weight must be a non-negative number")
        note = body.get("note", "")
        if not isinstance(note, str) or len(note) > MAX_NOTE:
            raise RemoteProtocolError(f"a note is a string of at most {MAX_NOTE} characters")
        return cls(
            tuple(_peer(p) for p in contributors_raw),
            tuple(dropped),
            float(weight),
            _int(body, "chunks", 0, 1 << 32),
            note,
        )
