"""Typed RPC bodies: one frozen dataclass per message, strict both ways.

Every message is a msgpack map whose ``"t"`` key is the message's type tag; the other
keys are the message's fields, all required, no others allowed (a new field means a
new tag or a new protocol version). Constructing a message checks it (a bad local
message raises :class:`LocalProtocolError`); ``from_body`` checks a received one (a bad
remote one raises :class:`RemoteProtocolError`), so a message object is always valid.
One leniency: a reply's contacts at a host no peer can listen at (``0.0.0.0``, multicast:
see :attr:`Address.dialable`) are dropped on decoding, and the rest of the reply stands
(an honest peer may relay such a contact); nobody dials them.

    body = FindNodeRequest(sender="10.0.0.1:4000", target=DHTID.from_key("x")).to_body()
    request = decode_message(body)          # dispatches on body["t"]

Other layers add their own messages with :func:`register_message` and their own
methods in their own tables; :data:`METHODS` lists the four DHT methods. ``clock.now``
(:class:`ClockRequest`) and ``clock.peek`` (:class:`ClockPeekRequest`) are the peer's
network-time methods (``peer.netclock``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from .address import MAX_ADDRESS_LENGTH, Address
from .dhtid import DHTID, ID_BYTES
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError, brief
from .identity import PeerID
from .records import (
    MAX_ENTRIES_PER_STORE,
    MAX_KEY_BYTES,
    MAX_SUBKEY_BYTES,
    MAX_SUBKEYS_PER_KEY,
    Entry,
)
from .records import Subkey as Subkey  # re-exported: entries are part of the messages

MAX_UNIX_TIME = 2.0**40
"""Largest clock reading a ``clock.now`` reply may carry (about the year 36812)."""
MAX_NODES = 64
"""Most nodes in one FIND_NODE or FIND_VALUE reply."""
MAX_SUBKEY_ORDER_BYTES = MAX_SUBKEY_BYTES + 9
"""Longest FIND_VALUE cursor: a subkey in msgpack (its header takes at most 9 bytes)."""


class Message:
    """Base of every typed body. Subclasses set ``TAG`` and implement the two hooks."""

    __slots__ = ()
    TAG: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_body(self) -> dict[str, Any]:
        """The msgpack-ready map, ``"t"`` first."""
        return {"t": self.TAG, **self._encode()}

    @classmethod
    def from_body(cls, body: Any) -> Self:
        """Parse and check a received body.

        Raises:
            RemoteProtocolError: on a wrong tag, missing or unknown keys, wrong types,
                sizes, counts or ranges.
        """
        if not isinstance(body, dict):
            raise RemoteProtocolError(f"{cls.__name__} body must be a map")
        if body.get("t") != cls.TAG:
            raise RemoteProtocolError(f"expected message {cls.TAG!r}, got {_show(body.get('t'))}")
        if len(body) != len(cls.FIELDS) + 1 or not all(name in body for name in cls.FIELDS):
            got = _show([k for k in body if k != "t"])
            raise RemoteProtocolError(f"{cls.TAG} has fields {list(cls.FIELDS)}, got {got}")
        try:
            return cls._decode(body)
        except RemoteProtocolError:
            raise
        except (ProtocolError, TypeError, ValueError, OverflowError) as exc:
            raise RemoteProtocolError(f"malformed {cls.TAG}: {exc}") from exc

    def _encode(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls()


MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Every registered message class by its tag."""

_M = TypeVar("_M", bound=type[Message])


def register_message(cls: _M) -> _M:
    """Class decorator: make ``cls`` known to :func:`decode_message` by its ``TAG``.

    Raises:
        ValueError: if the tag is empty or already taken.
    """
    if not cls.TAG or cls.TAG in MESSAGE_TYPES:
        raise ValueError(f"message tag {cls.TAG!r} is empty or already registered")
    MESSAGE_TYPES[cls.TAG] = cls
    return cls


def decode_message(body: Any) -> Message:
    """Parse any registered message, chosen by the body's ``"t"``.

    Raises:
        RemoteProtocolError: if the tag is unknown or the body is malformed.
    """
    tag = body.get("t") if isinstance(body, dict) else None
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {_show(tag)}")
    return cls.from_body(body)


def _show(value: object) -> str:
    """A bounded repr for error messages: received values can be long, or deep."""
    return brief(value)


# --- field checks (raise LocalProtocolError; from_body turns them into remote blame) ---


def _check_hostport(value: object, what: str) -> None:
    """``None`` (client mode) or a canonical ``HOST:PORT`` without a PeerID (dialable or
    not: a request's sender at ``0.0.0.0`` is answered, just not learnt)."""
    if value is None:
        return
    if type(value) is not str or len(value) > MAX_ADDRESS_LENGTH:
        raise LocalProtocolError(f"{what} must be a HOST:PORT string or None")
    problem = _hostport_problem(value)
    if problem is not None:
        raise LocalProtocolError(f"{what}{problem}")


@functools.lru_cache(maxsize=8192)
def _hostport_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a canonical ``HOST:PORT`` (None: nothing). Cached:
    every DHT reply names up to k nodes, mostly ones seen before, and parsing is costly."""
    if "," in value or any(c.isspace() for c in value):  # (the parser's words suit a user's
        # list of addresses, not one field: "is several addresses: give a list")
        return f" {_show(value)} holds a space or a comma: a HOST:PORT has none"
    try:
        address = Address.parse(value)
    except ProtocolError as exc:
        return f": {exc}"
    if address.peer_id is not None or address.port == 0 or address.hostport != value:
        return f" {_show(value)} is not a canonical HOST:PORT with port > 0"
    return None


def _check_dhtid(value: object, what: str) -> None:
    if not isinstance(value, DHTID):
        raise LocalProtocolError(f"{what} must be a DHTID")


def _tuple_of(owner: object, name: str, kind: type, limit: int) -> None:
    """Coerce ``owner.name`` from a list to a tuple, then check item types and count."""
    items = getattr(owner, name)
    if isinstance(items, list):
        items = tuple(items)
        object.__setattr__(owner, name, items)
    if not isinstance(items, tuple):
        raise LocalProtocolError(f"{name} must be a tuple")
    if len(items) > limit:
        raise LocalProtocolError(f"{name} holds {len(items)} items; at most {limit}")
    if not all(type(item) is kind for item in items):
        raise LocalProtocolError(f"{name} must hold only {kind.__name__}")


def _seq(value: object, name: str, limit: int) -> tuple[Any, ...] | list[Any]:
    """A received array (decoded as tuple, or a list from a local body) of bounded length."""
    if not isinstance(value, tuple | list):
        raise RemoteProtocolError(f"{name} must be an array")
    if len(value) > limit:
        raise RemoteProtocolError(f"{name} holds {len(value)} items; at most {limit}")
    return value


def _raw_id(value: object, what: str) -> DHTID:
    if type(value) is not bytes or len(value) != ID_BYTES:
        raise RemoteProtocolError(f"{what} must be {ID_BYTES} raw bytes")
    return DHTID.from_bytes_exact(value)


# --- the DHT messages ---


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A DHT contact: ``{"p": PeerID (32 bytes), "a": "HOST:PORT" or nil}``.

    ``address`` ``None`` marks a client-mode peer (not routable).

    Raises:
        LocalProtocolError: on a wrong type or a malformed address.
    """

    peer_id: PeerID
    address: str | None

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, PeerID):
            raise LocalProtocolError("peer_id must be a PeerID")
        _check_hostport(self.address, "address")

    def to_body(self) -> dict[str, Any]:
        return {"p": self.peer_id.raw, "a": self.address}

    @classmethod
    def from_body(cls, body: Any) -> NodeInfo:
        """Parse ``{"p": bytes, "a": str | nil}``.

        Raises:
            RemoteProtocolError: on anything malformed.
        """
        if not isinstance(body, dict) or body.keys() != {"p", "a"}:
            raise RemoteProtocolError("a node is a map with exactly the keys p and a")
        raw, address = body["p"], body["a"]
        if type(raw) is not bytes:
            raise RemoteProtocolError("a node's p must be bytes")
        key = (raw, address) if address is None or type(address) is str else None
        node = _known_nodes.get(key) if key is not None else None
        if node is not None:
            return node
        try:
            node = cls(PeerID(raw), address)
        except ProtocolError as exc:
            raise RemoteProtocolError(f"malformed node: {exc}") from exc
        if len(_known_nodes) >= _KNOWN_NODES_LIMIT:
            _known_nodes.clear()
        _known_nodes[(raw, address)] = node
        return node


_KNOWN_NODES_LIMIT = 16384
_known_nodes: dict[tuple[bytes, str | None], NodeInfo] = {}
"""Nodes already parsed, by their wire form: replies name mostly known nodes, and a
NodeInfo is immutable, so one checked instance serves every reply that names it."""


def _nodes(value: object) -> tuple[NodeInfo, ...]:
    """A reply's contacts, less those at an address nobody can be dialed at."""
    nodes = (NodeInfo.from_body(item) for item in _seq(value, "nodes", MAX_NODES))
    return tuple(node for node in nodes if node.address is None or _dialable(node.address))


@functools.lru_cache(maxsize=8192)
def _dialable(hostport: str) -> bool:
    """Whether a checked ``HOST:PORT`` is :attr:`Address.dialable` (cached, as above)."""
    return Address.parse(hostport).dialable


def _entries(value: object, limit: int) -> tuple[Entry, ...]:
    return tuple(Entry.from_body(item) for item in _seq(value, "entries", limit))


@register_message
@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """``dht.ping``: is the callee alive? ``sender`` is our listen address (None: client)."""

    TAG: ClassVar[str] = "dht.ping.req"
    METHOD: ClassVar[str] = "dht.ping"
    FIELDS: ClassVar[tuple[str, ...]] = ("sender",)
    sender: str | None

    def __post_init__(self) -> None:
        _check_hostport(self.sender, "sender")

    def _encode(self) -> dict[str, Any]:
        return {"sender": self.sender}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls(body["sender"])


@register_message
@dataclass(frozen=True, slots=True)
class PingResponse(Message):
    """Reply to ``dht.ping``: no fields."""

    TAG: ClassVar[str] = "dht.ping.res"


@register_message
@dataclass(frozen=True, slots=True)
class FindNodeRequest(Message):
    """``dht.find_node``: the callee's closest known contacts to ``target``."""

    TAG: ClassVar[str] = "dht.find_node.req"
    METHOD: ClassVar[str] = "dht.find_node"
    FIELDS: ClassVar[tuple[str, ...]] = ("sender", "target")
    sender: str | None
    target: DHTID

    def __post_init__(self) -> None:
        _check_hostport(self.sender, "sender")
        _check_dhtid(self.target, "target")

    def _encode(self) -> dict[str, Any]:
        return {"sender": self.sender, "target": self.target.to_raw()}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls(body["sender"], _raw_id(body["target"], "target"))


@register_message
@dataclass(frozen=True, slots=True)
class FindNodeResponse(Message):
    """Reply to ``dht.find_node``: at most ``MAX_NODES`` contacts."""

    TAG: ClassVar[str] = "dht.find_node.res"
    FIELDS: ClassVar[tuple[str, ...]] = ("nodes",)
    nodes: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        _tuple_of(self, "nodes", NodeInfo, MAX_NODES)

    def _encode(self) -> dict[str, Any]:
        return {"nodes": [node.to_body() for node in self.nodes]}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls(_nodes(body["nodes"]))


@register_message
@dataclass(frozen=True, slots=True)
class FindValueRequest(Message):
    """``dht.find_value``: the callee's entries under ``key`` and its closest contacts.
    ``after``: only entries whose subkey orders after this one (its
    :func:`~protocol.records.subkey_order` form), to continue a reply that said ``more``."""

    TAG: ClassVar[str] = "dht.find_value.req"
    METHOD: ClassVar[str] = "dht.find_value"
    FIELDS: ClassVar[tuple[str, ...]] = ("sender", "key", "after")
    sender: str | None
    key: DHTID
    after: bytes | None = None

    def __post_init__(self) -> None:
        _check_hostport(self.sender, "sender")
        _check_dhtid(self.key, "key")
        if self.after is not None and (
            type(self.after) is not bytes or len(self.after) > MAX_SUBKEY_ORDER_BYTES
        ):
            raise LocalProtocolError(
                f"after must be nil or at most {MAX_SUBKEY_ORDER_BYTES} bytes (a packed subkey)"
            )

    def _encode(self) -> dict[str, Any]:
        return {"sender": self.sender, "key": self.key.to_raw(), "after": self.after}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls(body["sender"], _raw_id(body["key"], "key"), body["after"])


@register_message
@dataclass(frozen=True, slots=True)
class FindValueResponse(Message):
    """Reply to ``dht.find_value``. ``entries`` None: the callee stores nothing for the key
    (after the request's cursor). ``more``: the entries did not all fit; they come in
    subkey order, and a request ``after`` the last one's subkey continues."""

    TAG: ClassVar[str] = "dht.find_value.res"
    FIELDS: ClassVar[tuple[str, ...]] = ("entries", "nodes", "more")
    entries: tuple[Entry, ...] | None
    nodes: tuple[NodeInfo, ...]
    more: bool = False

    def __post_init__(self) -> None:
        if self.entries is not None:
            _tuple_of(self, "entries", Entry, MAX_SUBKEYS_PER_KEY)
        _tuple_of(self, "nodes", NodeInfo, MAX_NODES)
        if type(self.more) is not bool:
            raise LocalProtocolError("more must be a bool")
        if self.more and not self.entries:
            raise LocalProtocolError("a reply with more to come carries entries")

    def _encode(self) -> dict[str, Any]:
        entries = None if self.entries is None else [entry.to_body() for entry in self.entries]
        return {
            "entries": entries,
            "nodes": [node.to_body() for node in self.nodes],
            "more": self.more,
        }

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        raw = body["entries"]
        entries = None if raw is None else _entries(raw, MAX_SUBKEYS_PER_KEY)
        return cls(entries, _nodes(body["nodes"]), body["more"])


@register_message
@dataclass(frozen=True, slots=True)
class StoreRequest(Message):
    """``dht.store``: store 1..``MAX_ENTRIES_PER_STORE`` entries under ``key``, whose text
    is ``name`` (``key`` is its SHA-256; the text tells storing nodes whether the key is
    owned, see ``protocol.records.key_owner``). ``want_nodes`` False: the caller's lookup
    has converged, so the reply need not name the callee's closest contacts."""

    TAG: ClassVar[str] = "dht.store.req"
    METHOD: ClassVar[str] = "dht.store"
    FIELDS: ClassVar[tuple[str, ...]] = ("sender", "key", "name", "entries", "want_nodes")
    sender: str | None
    key: DHTID
    name: str
    entries: tuple[Entry, ...]
    want_nodes: bool = True

    def __post_init__(self) -> None:
        _check_hostport(self.sender, "sender")
        _check_dhtid(self.key, "key")
        _check_name(self.name, self.key)
        _tuple_of(self, "entries", Entry, MAX_ENTRIES_PER_STORE)
        if not self.entries:
            raise LocalProtocolError("a store request carries at least one entry")
        if type(self.want_nodes) is not bool:
            raise LocalProtocolError("want_nodes must be a bool")

    def _encode(self) -> dict[str, Any]:
        return {
            "sender": self.sender,
            "key": self.key.to_raw(),
            "name": self.name,
            "entries": [entry.to_body() for entry in self.entries],
            "want_nodes": self.want_nodes,
        }

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        key = _raw_id(body["key"], "key")
        entries = _entries(body["entries"], MAX_ENTRIES_PER_STORE)
        return cls(body["sender"], key, body["name"], entries, body["want_nodes"])


def _check_name(name: object, key: DHTID) -> None:
    if type(name) is not str:
        raise LocalProtocolError("name must be a str")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError("name must be valid Unicode") from exc
    if len(raw) > MAX_KEY_BYTES:
        raise LocalProtocolError(f"name of {len(raw)} bytes exceeds {MAX_KEY_BYTES}")
    if DHTID.from_key(name) != key:
        raise LocalProtocolError("name does not hash to key")


@register_message
@dataclass(frozen=True, slots=True)
class StoreResponse(Message):
    """Reply to ``dht.store``: one flag per entry, in order (False: rejected), and the
    callee's closest contacts to the key, so that a store is also a lookup step."""

    TAG: ClassVar[str] = "dht.store.res"
    FIELDS: ClassVar[tuple[str, ...]] = ("accepted", "nodes")
    accepted: tuple[bool, ...]
    nodes: tuple[NodeInfo, ...] = ()

    def __post_init__(self) -> None:
        _tuple_of(self, "accepted", bool, MAX_ENTRIES_PER_STORE)
        _tuple_of(self, "nodes", NodeInfo, MAX_NODES)

    def _encode(self) -> dict[str, Any]:
        return {"accepted": list(self.accepted), "nodes": [node.to_body() for node in self.nodes]}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        accepted = tuple(_seq(body["accepted"], "accepted", MAX_ENTRIES_PER_STORE))
        return cls(accepted, _nodes(body["nodes"]))


@register_message
@dataclass(frozen=True, slots=True)
class ClockRequest(Message):
    """``clock.now``: the callee's wall clock, for network time (``peer.netclock``)."""

    TAG: ClassVar[str] = "clock.now.req"
    METHOD: ClassVar[str] = "clock.now"


@register_message
@dataclass(frozen=True, slots=True)
class ClockPeekRequest(Message):
    """``clock.peek``: as ``clock.now`` (the reply is a :class:`ClockResponse`), but the
    callee does not ask the caller back: a peer checking its correction against more
    contacts must not make them count its own clock."""

    TAG: ClassVar[str] = "clock.peek.req"
    METHOD: ClassVar[str] = "clock.peek"


@register_message
@dataclass(frozen=True, slots=True)
class ClockResponse(Message):
    """Reply to ``clock.now``: the callee's own clock (unix seconds, not corrected by its
    peers' offsets) when it answered."""

    TAG: ClassVar[str] = "clock.now.res"
    FIELDS: ClassVar[tuple[str, ...]] = ("time",)
    time: float

    def __post_init__(self) -> None:
        if isinstance(self.time, bool) or not isinstance(self.time, int | float):
            raise LocalProtocolError(f"time must be a number, not {type(self.time).__name__}")
        if not (math.isfinite(self.time) and 0 <= self.time < MAX_UNIX_TIME):
            raise LocalProtocolError(f"time must be a unix time in [0, 2**40), got {self.time}")

    def _encode(self) -> dict[str, Any]:
        return {"time": float(self.time)}

    @classmethod
    def _decode(cls, body: dict[str, Any]) -> Self:
        return cls(body["time"])


METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    PingRequest.METHOD: (PingRequest, PingResponse),
    FindNodeRequest.METHOD: (FindNodeRequest, FindNodeResponse),
    FindValueRequest.METHOD: (FindValueRequest, FindValueResponse),
    StoreRequest.METHOD: (StoreRequest, StoreResponse),
}
"""DHT method name -> (request class, response class)."""
