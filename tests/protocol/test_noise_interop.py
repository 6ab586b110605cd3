"""Interop with the reference ``noiseprotocol`` package: swarm/1 handshakes both ways.

The noiseprotocol side builds and checks the swarm identity payload here, with msgpack
and Ed25519 directly, so nothing of ``protocol.noise.payload`` is trusted on that side.
"""

from __future__ import annotations

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from noise.connection import Keypair, NoiseConnection

from protocol.identity import Identity, verify_signature
from protocol.noise import MAX_PLAINTEXT_PER_MESSAGE, NoiseHandshake, NoiseTransport

PREFIX = b"swarm-noise-static-key:"


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(2, "big") + message


def unframe(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 2], "big")
        out.append(data[pos + 2 : pos + 2 + length])
        pos += 2 + length
    assert pos == len(data)
    return out


class ReferencePeer:
    """A swarm/1 peer built on noiseprotocol's NoiseConnection."""

    def __init__(self, initiator: bool, cipher: str) -> None:
        self.identity = Identity.from_seed(b"\x07" * 32)
        static = X25519PrivateKey.generate()
        self.static_public = static.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.conn = NoiseConnection.from_name(f"Noise_XX_25519_{cipher}_SHA256".encode())
        if initiator:
            self.conn.set_as_initiator()
        else:
            self.conn.set_as_responder()
        self.conn.set_prologue(b"swarm/1")
        self.conn.set_keypair_from_private_bytes(
            Keypair.STATIC, static.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        )
        self.conn.start_handshake()
        # noiseprotocol drops its HandshakeState after the last message; keep a handle on
        # it to read the remote static key.
        self.state = self.conn.noise_protocol.handshake_state

    def payload(self) -> bytes:
        signature = self.identity.sign(PREFIX + self.static_public)
        return msgpack.packb(
            {"identity": self.identity.public_key, "signature": signature}, use_bin_type=True
        )

    def check_payload(self, payload: bytes, expected: Identity) -> None:
        fields = msgpack.unpackb(payload, raw=False)
        assert set(fields) == {"identity", "signature"}
        assert fields["identity"] == expected.public_key
        remote_static = self.state.rs.public_bytes
        assert verify_signature(fields["identity"], fields["signature"], PREFIX + remote_static)


@pytest.mark.parametrize("cipher", ["AESGCM", "ChaChaPoly"])
def test_ours_as_initiator(cipher: str) -> None:
    me = Identity.from_seed(b"\x01" * 32)
    ref = ReferencePeer(initiator=False, cipher=cipher)
    ours = NoiseHandshake(me, initiator=True, expected_peer_id=ref.identity.peer_id, cipher=cipher)
    (message1,) = unframe(ours.data_to_send())
    assert ref.conn.read_message(message1) == b""
    ours.receive_data(frame(ref.conn.write_message(ref.payload())))
    assert ours.complete and ours.remote_public_key == ref.identity.public_key
    (message3,) = unframe(ours.data_to_send())
    ref.check_payload(ref.conn.read_message(message3), expected=me)
    assert ref.conn.handshake_finished
    exchange(ours.into_transport(), ref.conn)


@pytest.mark.parametrize("cipher", ["AESGCM", "ChaChaPoly"])
def test_ours_as_responder(cipher: str) -> None:
    me = Identity.from_seed(b"\x02" * 32)
    ref = ReferencePeer(initiator=True, cipher=cipher)
    ours = NoiseHandshake(me, initiator=False, cipher=cipher)
    ours.receive_data(frame(ref.conn.write_message(b"")))
    (message2,) = unframe(ours.data_to_send())
    ref.check_payload(ref.conn.read_message(message2), expected=me)
    ours.receive_data(frame(ref.conn.write_message(ref.payload())))
    assert ours.complete and ours.remote_peer_id == ref.identity.peer_id
    assert ref.conn.handshake_finished
    exchange(ours.into_transport(), ref.conn)


def exchange(ours: NoiseTransport, ref: NoiseConnection) -> None:
    assert ours.handshake_hash == ref.get_handshake_hash()
    assert [ref.decrypt(m) for m in unframe(ours.seal(b"hello"))] == [b"hello"]
    assert ours.receive_and_open(frame(ref.encrypt(b"world"))) == [b"world"]
    big = bytes(range(256)) * 600  # 153600 bytes: three messages
    messages = unframe(ours.seal(big))
    assert [len(m) for m in messages[:-1]] == [MAX_PLAINTEXT_PER_MESSAGE + 16] * 2
    assert b"".join(ref.decrypt(m) for m in messages) == big
    wire = b"".join(frame(ref.encrypt(big[i : i + 50000])) for i in range(0, len(big), 50000))
    assert b"".join(ours.receive_and_open(wire)) == big
    buf = bytearray()
    n = ours.seal_into(b"via seal_into", buf)
    assert [ref.decrypt(m) for m in unframe(bytes(buf[:n]))] == [b"via seal_into"]
