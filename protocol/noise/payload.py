"""The swarm/1 identity payload carried in Noise XX messages 2 and 3.

The payload binds the sender's long-term Ed25519 identity to the X25519 static key it
uses in this handshake::

    msgpack map {
        "identity":  32-byte Ed25519 public key (bin),
        "signature": 64-byte Ed25519 signature (bin) over
                     b"swarm-noise-static-key:" + sender's 32-byte static X25519 public key,
    }

Noise authenticates the static key itself (the handshake proves the sender holds its
private half); the signature proves the identity key's owner chose that static key.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..errors import RemoteProtocolError
from ..identity import (
    PUBLIC_KEY_LENGTH,
    SIGNATURE_LENGTH,
    Identity,
    PeerID,
    verify_signature,
)

SIGNATURE_PREFIX = b"swarm-noise-static-key:"
MAX_PAYLOAD_LENGTH = 256
"""A well-formed payload is 120 bytes; anything much longer is refused before parsing."""

_KEYS = frozenset({"identity", "signature"})


class IdentityMismatchError(RemoteProtocolError):
    """The remote proved another identity (``actual``) than the one dialed (``expected``):
    the node at that address lost its key file, or another program took its port."""

    def __init__(self, actual: PeerID, expected: PeerID) -> None:
        super().__init__(f"remote proved identity {actual}, expected {expected}")
        self.actual = actual
        self.expected = expected


@dataclass(frozen=True, slots=True)
class IdentityPayload:
    """A decoded (not yet verified) identity payload."""

    identity: bytes
    signature: bytes


def signed_static_key(static_public_key: bytes) -> bytes:
    """The exact bytes the identity key signs for ``static_public_key``."""
    return SIGNATURE_PREFIX + static_public_key


def encode_payload(identity: Identity, static_public_key: bytes) -> bytes:
    """The msgpack payload in which ``identity`` vouches for ``static_public_key``."""
    signature = identity.sign(signed_static_key(static_public_key))
    return msgpack.packb(
        {"identity": identity.public_key, "signature": signature}, use_bin_type=True
    )


def decode_payload(data: bytes) -> IdentityPayload:
    """Parse a payload strictly: a map with exactly the two keys, bin values of exact length.

    Raises:
        RemoteProtocolError: if the payload is malformed in any way.
    """
    if len(data) > MAX_PAYLOAD_LENGTH:
        raise RemoteProtocolError(f"identity payload of {len(data)} bytes is too long")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"identity payload is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _KEYS:
        raise RemoteProtocolError("identity payload must be a map of 'identity' and 'signature'")
    identity, signature = obj["identity"], obj["signature"]
    if not isinstance(identity, bytes) or len(identity) != PUBLIC_KEY_LENGTH:
        raise RemoteProtocolError(f"'identity' must be {PUBLIC_KEY_LENGTH} bytes")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_LENGTH:
        raise RemoteProtocolError(f"'signature' must be {SIGNATURE_LENGTH} bytes")
    return IdentityPayload(identity=identity, signature=signature)


def verify_payload(
    data: bytes, remote_static_key: bytes, expected_peer_id: PeerID | None
) -> IdentityPayload:
    """Decode ``data`` and check it vouches for ``remote_static_key`` (and the expected id).

    Raises:
        RemoteProtocolError: if the payload is malformed, the signature does not cover the
            static key the remote used in this handshake, or the identity is not
            ``expected_peer_id``.
    """
    payload = decode_payload(data)
    if not verify_signature(
        payload.identity, payload.signature, signed_static_key(remote_static_key)
    ):
        raise RemoteProtocolError("identity signature does not cover the remote's static key")
    if expected_peer_id is not None:
        actual = PeerID.from_public_key(payload.identity)
        if actual != expected_peer_id:
            raise IdentityMismatchError(actual, expected_peer_id)
    return payload
