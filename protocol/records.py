"""DHT record rules, pure: entries, their limits, owner-bound subkeys and signatures.

A DHT value is a dictionary ``key -> {subkey -> Entry}``. An :class:`Entry` is one
``(subkey, value, expiration)`` triple, optionally signed. The rules every storing
node applies (no clock is read here: ``now`` is an argument):

- sizes: a subkey (UTF-8 of a ``str``, or ``bytes``) is at most ``MAX_SUBKEY_BYTES``;
  an ``int`` subkey fits msgpack (-2**63 .. 2**64-1); a value is at most ``MAX_VALUE_BYTES``.
- expiration: an absolute unix time, finite, in ``(now, now + MAX_TTL + MAX_CLOCK_SKEW]``.
- owner-bound subkeys: a ``str`` subkey that is the canonical base58 form of a PeerID may
  be written only by that peer: ``owner_key`` must hash to that PeerID and ``signature``
  must verify over :func:`signing_bytes`.
- owned keys: a key that ends with ``[owner:PEERID]`` (see :func:`owned_key`) may be
  written only by that peer, under any subkey: every entry must be signed by it. Storing
  nodes see the key text in STORE requests (``StoreRequest.name``), readers know it anyway.
- any signature that is present must verify, owner-bound subkey or not.
- a value decodes as msgpack without extension types (:func:`decode_value`): readers
  get only None, bool, int, float, str, bytes, and lists and maps of them.

A record that breaks a rule raises :class:`RecordError`. For a record received from a
peer this rejects *that record* (a STORE answers ``accepted=False`` for it); it is not a
reason to drop the connection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import msgpack

from .dhtid import DHTID
from .errors import ProtocolError, RemoteProtocolError
from .identity import (
    PUBLIC_KEY_LENGTH,
    SIGNATURE_LENGTH,
    Identity,
    PeerID,
    verify_signature,
)
from .rpc import check_whole_msgpack, may_hold_array_bomb

MAX_KEY_BYTES = 512
"""Longest user key string, in UTF-8 bytes (keys travel as 32-byte DHT ids)."""
MAX_SUBKEY_BYTES = 128
"""Longest ``str`` (UTF-8 bytes) or ``bytes`` subkey."""
MAX_VALUE_BYTES = 16384
"""Longest value: the msgpack serialization of the user's value."""
MAX_ENTRIES_PER_STORE = 64
"""Most entries one STORE request may carry."""
MAX_SUBKEYS_PER_KEY = 1024
"""Most subkeys a node keeps under one key, and most entries in one FIND_VALUE reply."""
MAX_TTL = 86400 * 7
"""Furthest an expiration may lie in the future, in seconds."""
MAX_CLOCK_SKEW = 300.0
"""Slack allowed on top of ``MAX_TTL`` for clocks that disagree, in seconds."""
SIGNING_PREFIX = b"swarm-record/1:"
"""Domain separation for record signatures (never valid as a handshake signature)."""

_INT_MIN = -(1 << 63)
_INT_LIMIT = 1 << 64
# A 32-byte PeerID is 43 or 44 base58 characters; anything outside 32..44 is not one.
_PEER_ID_TEXT_LENGTHS = range(32, 45)

Subkey: TypeAlias = str | int | bytes | None
"""A subkey under a DHT key; a plain (non-dictionary) value uses ``None``."""


class RecordError(ProtocolError):
    """A DHT record breaks the rules: reject the record (not the connection)."""


class RecordTooLargeError(RecordError, ValueError):
    """A key, subkey or value exceeds its size limit."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored ``(subkey, value, expiration)``, optionally signed by ``owner_key``.

    ``value`` is the msgpack serialization of the user's value; ``expiration`` is an
    absolute unix time. ``owner_key`` (raw Ed25519, 32 bytes) and ``signature``
    (64 bytes over :func:`signing_bytes`) are both set or both ``None``.

    Construction checks types and sizes.

    Raises:
        RecordTooLargeError: if the subkey or value is too large.
        RecordError: on a wrong type, a non-finite expiration, or a half-signed entry.
    """

    subkey: Subkey
    value: bytes
    expiration: float
    owner_key: bytes | None = None
    signature: bytes | None = None

    def __post_init__(self) -> None:
        check_subkey(self.subkey)
        if type(self.value) is not bytes:
            raise RecordError("an entry's value must be bytes (serialized with msgpack)")
        if len(self.value) > MAX_VALUE_BYTES:
            raise RecordTooLargeError(
                f"value of {len(self.value)} bytes exceeds MAX_VALUE_BYTES={MAX_VALUE_BYTES}"
            )
        expiration = self.expiration
        if type(expiration) is int:
            object.__setattr__(self, "expiration", float(expiration))
        elif type(expiration) is not float:
            raise RecordError("expiration must be a float (unix time)")
        if not math.isfinite(self.expiration):
            raise RecordError("expiration must be finite")
        if (self.owner_key is None) != (self.signature is None):
            raise RecordError("owner_key and signature must be given together")
        if self.owner_key is not None and (
            type(self.owner_key) is not bytes or len(self.owner_key) != PUBLIC_KEY_LENGTH
        ):
            raise RecordError(f"owner_key must be {PUBLIC_KEY_LENGTH} bytes")
        if self.signature is not None and (
            type(self.signature) is not bytes or len(self.signature) != SIGNATURE_LENGTH
        ):
            raise RecordError(f"signature must be {SIGNATURE_LENGTH} bytes")

    @property
    def is_signed(self) -> bool:
        return self.signature is not None

    def to_body(self) -> dict[str, Any]:
        """The wire map: ``s`` subkey, ``v`` value, ``x`` expiration, and ``o``/``g`` if signed."""
        body: dict[str, Any] = {"s": self.subkey, "v": self.value, "x": self.expiration}
        if self.owner_key is not None:
            body["o"] = self.owner_key
            body["g"] = self.signature
        return body

    @classmethod
    def from_body(cls, body: Any) -> Entry:
        """Parse the wire map written by :meth:`to_body`.

        Raises:
            RemoteProtocolError: on missing, unknown or ill-typed keys or broken limits.
        """
        if not isinstance(body, dict):
            raise RemoteProtocolError("an entry must be a map")
        keys = body.keys()
        if not {"s", "v", "x"} <= keys or not keys <= {"s", "v", "x", "o", "g"}:
            raise RemoteProtocolError(f"an entry has keys s, v, x [, o, g]; got {len(keys)} keys")
        if body.get("o", b"") is None or body.get("g", b"") is None:
            raise RemoteProtocolError("an unsigned entry omits o and g (nil is not allowed)")
        try:
            return cls(body["s"], body["v"], body["x"], body.get("o"), body.get("g"))
        except ProtocolError as exc:
            raise RemoteProtocolError(f"malformed entry: {exc}") from exc


def _plain_value_hint(item: object) -> str:
    """For a subclass of str, int or bytes (an enum member: it would read back as the plain
    value, msgpack knowing no enums), the plain value to pass instead; else empty (the
    plain types themselves too: ``b"k"`` for a key is wrong as bytes, not as a subclass)."""
    if isinstance(item, bool) or type(item) in (str, int, bytes):
        return ""
    if isinstance(item, str):
        plain: object = str.__str__(item)
    elif isinstance(item, int):
        plain = int(item)
    elif isinstance(item, bytes):
        plain = bytes(item)
    else:
        return ""
    return f" (a subclass of {type(plain).__name__}: pass the plain value, {plain!r})"


def check_subkey(subkey: object) -> None:
    """Raises: RecordError for a subkey that is not None, str, int or bytes (a bool, a
    float, a list...) or a str with lone surrogates; RecordTooLargeError (a RecordError
    and a ValueError) for one over its size."""
    if subkey is None:
        return
    if type(subkey) is int:
        if not _INT_MIN <= subkey < _INT_LIMIT:
            raise RecordTooLargeError("an int subkey must fit in 64 bits")
        return
    if type(subkey) is str:
        try:
            size = len(subkey.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise RecordError("a str subkey must be valid Unicode (no lone surrogates)") from exc
    elif type(subkey) is bytes:
        size = len(subkey)
    else:
        hint = _plain_value_hint(subkey)
        if isinstance(subkey, PeerID):  # an owner-bound subkey is the PeerID's text
            hint = f" (an owner-bound subkey is a PeerID's text: pass {str(subkey)!r})"
        raise RecordError(f"a subkey is None, str, int or bytes, not {type(subkey).__name__}{hint}")
    if size > MAX_SUBKEY_BYTES:
        raise RecordTooLargeError(
            f"subkey of {size} bytes exceeds MAX_SUBKEY_BYTES={MAX_SUBKEY_BYTES}"
        )


def owner_of(subkey: Subkey) -> PeerID | None:
    """The peer a subkey is bound to: a ``str`` that is the canonical base58 of a PeerID."""
    if type(subkey) is not str or len(subkey) not in _PEER_ID_TEXT_LENGTHS:
        return None
    try:
        peer_id = PeerID.from_base58(subkey)
    except ProtocolError:
        return None
    return peer_id if peer_id.to_base58() == subkey else None


_OWNER_MARK = "[owner:"


def owned_key(name: str, owner: PeerID | str) -> str:
    """The key ``name`` marked as owned by ``owner``: only ``owner`` may write under it.

    ``owner`` is a PeerID or its canonical base58 text. Anything else is refused: a key
    marked with text that is no PeerID would be owned by nobody, open to every writer.

    Raises:
        TypeError: if ``owner`` is neither (raw bytes, say). ValueError: if it is text
            that is not a canonical base58 PeerID.
    """
    if isinstance(owner, str):
        if owner_of(owner) is None:
            raise ValueError(f"owned_key: {owner!r} is not a PeerID's canonical base58 text")
    elif not isinstance(owner, PeerID):
        raise TypeError(
            f"owned_key takes the owner's PeerID (node.peer_id), not a {type(owner).__name__}"
        )
    return f"{name}{_OWNER_MARK}{owner}]"


def key_owner(key: str) -> PeerID | None:
    """The peer that owns ``key``: its text ends with ``[owner:PEERID]`` (canonical base58)."""
    if not key.endswith("]"):
        return None
    start = key.rfind(_OWNER_MARK)
    if start < 0:
        return None
    return owner_of(key[start + len(_OWNER_MARK) : -1])


def signing_bytes(key: DHTID, subkey: Subkey, value: bytes, expiration: float) -> bytes:
    """What a record signature covers.

    ``b"swarm-record/1:" + msgpack([key as 32 raw bytes, subkey, value, expiration])``
    with str as msgpack str, bytes as bin, ints in their shortest form and the
    expiration always as float64: the same record always gives the same bytes.

    Raises:
        RecordError: if a part has the wrong type.
    """
    if not isinstance(key, DHTID):
        raise RecordError("the key must be a DHTID")
    check_subkey(subkey)
    if type(value) is not bytes:
        raise RecordError("the value must be bytes")
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise RecordError("expiration must be a float")
    packed = msgpack.packb([key.to_raw(), subkey, value, float(expiration)], use_bin_type=True)
    return SIGNING_PREFIX + packed


def sign_entry(
    identity: Identity,
    key: DHTID,
    subkey: Subkey,
    value: bytes,
    expiration: float,
    *,
    key_owner: PeerID | None = None,
) -> Entry:
    """An entry signed by ``identity``, as needed for an owner-bound subkey or an owned key
    (``key_owner``: the owner named by the key's text).

    Raises:
        RecordTooLargeError: if the subkey or value is too large.
        RecordError: if a part has the wrong type, or the subkey or key is bound to
            another peer.
    """
    unsigned = Entry(subkey, value, expiration)
    owner = owner_of(subkey)
    if owner is not None and owner != identity.peer_id:
        raise RecordError(f"subkey is owned by {owner}, not by {identity.peer_id}")
    if key_owner is not None and key_owner != identity.peer_id:
        raise RecordError(f"key is owned by {key_owner}, not by {identity.peer_id}")
    signature = identity.sign(signing_bytes(key, subkey, value, unsigned.expiration))
    return replace(unsigned, owner_key=identity.public_key, signature=signature)


def validate_entry(
    key: DHTID, entry: Entry, *, now: float, key_owner: PeerID | None = None
) -> None:
    """Check every rule a storing node applies to ``entry`` under ``key`` at time ``now``;
    ``key_owner`` is the owner the key's text names (:func:`key_owner`), if any.

    Raises:
        RecordTooLargeError: if the subkey or value is too large.
        RecordError: if the entry is expired or expires too far ahead, if an owner-bound
            subkey or an owned key's entry is unsigned or signed by another key, or if a
            signature is invalid.
    """
    if not isinstance(entry, Entry):
        raise RecordError("not an Entry")
    Entry.__post_init__(entry)  # re-check sizes and types: cheap, and entries are untrusted
    if entry.expiration <= now:
        raise RecordError(f"entry expired at {entry.expiration} (now {now})")
    if entry.expiration > now + MAX_TTL + MAX_CLOCK_SKEW:
        raise RecordError(
            f"expiration {entry.expiration} is more than MAX_TTL={MAX_TTL}s after now ({now})"
        )
    owner = owner_of(entry.subkey)
    if owner is not None:
        if entry.owner_key is None:
            raise RecordError(f"subkey {entry.subkey!r} is owner-bound but the entry is unsigned")
        if PeerID.from_public_key(entry.owner_key) != owner:
            raise RecordError(f"subkey {entry.subkey!r} is owner-bound to another peer's key")
    if key_owner is not None:
        if entry.owner_key is None:
            raise RecordError(f"the key is owned by {key_owner} but the entry is unsigned")
        if PeerID.from_public_key(entry.owner_key) != key_owner:
            raise RecordError(f"the key is owned by {key_owner}, not by the entry's signer")
    if entry.owner_key is not None and entry.signature is not None:
        data = signing_bytes(key, entry.subkey, entry.value, entry.expiration)
        if not verify_signature(entry.owner_key, entry.signature, data):
            raise RecordError("invalid record signature")
    try:
        decode_value(entry.value)
    except ValueError as exc:
        raise RecordError(f"the value is not a DHT value: {exc}") from exc


def decode_value(data: bytes) -> Any:
    """The user's value from an entry's serialized ``value``.

    Raises:
        ValueError: if ``data`` is not one complete msgpack object, or uses an extension
            type (a timestamp included): a value must read back as what a store accepts.
    """
    try:
        # nested array headers claiming more than is there; any: a STORE carries 64 values
        # and its connection stays up
        if may_hold_array_bomb(data, tolerated=0):
            check_whole_msgpack(data)
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_refuse_extension)
    except TypeError as exc:  # a map key that Python cannot hash (a list)
        raise ValueError(
            f"a dict key would read back as a list, which cannot be a key ({exc}); a tuple"
            " key is sent as a list: use str, int, float, bytes or bool keys"
        ) from exc
    # msgpack decodes its timestamp extension (type -1) without calling ext_hook; its
    # type byte 0xff is in the data whenever one is, so most values skip the walk
    if b"\xff" in data and _holds_timestamp(value):
        raise ValueError("msgpack timestamps are not DHT values")
    return value


def _refuse_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not a DHT value")


def _holds_timestamp(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, msgpack.Timestamp):
            return True
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False


def subkey_order(subkey: Subkey) -> bytes:
    """A total order on subkeys of every type (their msgpack form): the cursor by which a
    FIND_VALUE reply that cannot hold every entry of a key is continued."""
    return msgpack.packb(subkey, use_bin_type=True)


def check_key(key: str) -> DHTID:
    """The DHT id of a user key, after checking its size.

    Raises:
        RecordTooLargeError: if the key's UTF-8 exceeds ``MAX_KEY_BYTES``.
        RecordError: if the key is not a valid Unicode ``str``.
    """
    if type(key) is not str:
        hint = _plain_value_hint(key) if isinstance(key, str) else ""  # (an int is no key)
        raise RecordError(f"a DHT key is a str, not {type(key).__name__}{hint}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RecordError("a DHT key must be valid Unicode (no lone surrogates)") from exc
    if size > MAX_KEY_BYTES:
        raise RecordTooLargeError(f"key of {size} bytes exceeds MAX_KEY_BYTES={MAX_KEY_BYTES}")
    return DHTID.from_key(key)
