"""Noise XX byte for byte against the published cacophony test vector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import protocol.noise
from protocol.noise import HandshakeState, NoiseTransport
from protocol.noise.cipher import ChaChaPoly


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(2, "big") + message


SHARED_VECTORS = Path("/work/shared/noise/cacophony_Noise_XX_25519_ChaChaPoly_SHA256.json")
# The cacophony vector for Noise_XX_25519_ChaChaPoly_SHA256 (public domain; from
# mcginty/snow tests/vectors/cacophony.txt), embedded so the test needs no outside file.
CACOPHONY_XX: dict[str, Any] = {
    "protocol_name": "Noise_XX_25519_ChaChaPoly_SHA256",
    "init_prologue": "4a6f686e2047616c74",
    "init_static": "e61ef9919cde45dd5f82166404bd08e38bceb5dfdfded0a34c8df7ed542214d1",
    "init_ephemeral": "893e28b9dc6ca8d611ab664754b8ceb7bac5117349a4439a6b0569da977c464a",
    "resp_prologue": "4a6f686e2047616c74",
    "resp_static": "4a3acbfdb163dec651dfa3194dece676d437029c62a408b4c5ea9114246e4893",
    "resp_ephemeral": "bbdb4cdbd309f1a1f2e1456967fe288cadd6f712d65dc7b7793d5e63da6b375b",
    "handshake_hash": "c8e5f64e846193be2a834104c2a009868d6c9f3bd3c186299888b488b2f1f58e",
    "messages": [
        {
            "payload": "4c756477696720766f6e204d69736573",
            "ciphertext": (
                "ca35def5ae56cec33dc2036731ab14896bc4c75dbb07a61f879f8e3afa4c79444c756477"
                "696720766f6e204d69736573"
            ),
        },
        {
            "payload": "4d757272617920526f746862617264",
            "ciphertext": (
                "95ebc60d2b1fa672c1f46a8aa265ef51bfe38e7ccb39ec5be34069f14480884381cbad1f"
                "276e038c48378ffce2b65285e08d6b68aaa3629a5a8639392490e5b9bd5269c2f1e4f488"
                "ed8831161f19b7815528f8982ffe09be9b5c412f8a0db50f8814c7194e83f23dbd8d162c"
                "9326ad"
            ),
        },
        {
            "payload": "462e20412e20486179656b",
            "ciphertext": (
                "c7195ffacac1307ff99046f219750fc47693e23c3cb08b89c2af808b444850a80ae475b9"
                "df0f169ae80a89be0865b57f58c9fea0d4ec82a286427402f113e4b6ae769a1d95941d49"
                "b25030"
            ),
        },
        {
            "payload": "4361726c204d656e676572",
            "ciphertext": "96763ed773f8e47bb3712f0e29b3060ffc956ffc146cee53d5e1df",
        },
        {
            "payload": "4a65616e2d426170746973746520536179",
            "ciphertext": "3e40f15f6f3a46ae446b253bf8b1d9ffb6ed9b174d272328ff91a7e2e5c79c07f5",
        },
        {
            "payload": "457567656e2042f6686d20766f6e2042617765726b",
            "ciphertext": (
                "eb3f3515110702e047a6c9da4478b6ead94873c11c0f2d710ddb3f09fce024b3a58502ae3f"
            ),
        },
    ],
}


def test_embedded_vector_matches_the_shared_file() -> None:
    if not SHARED_VECTORS.exists():
        pytest.skip("the shared vector file is only on the development machines")
    assert json.loads(SHARED_VECTORS.read_text())["vectors"] == [CACOPHONY_XX]


def test_cacophony_vector_byte_for_byte() -> None:
    vector = CACOPHONY_XX
    assert vector["protocol_name"] == "Noise_XX_25519_ChaChaPoly_SHA256"
    h = bytes.fromhex
    initiator = HandshakeState(
        initiator=True,
        s=h(vector["init_static"]),
        e=h(vector["init_ephemeral"]),
        prologue=h(vector["init_prologue"]),
        cipher="ChaChaPoly",
    )
    responder = HandshakeState(
        initiator=False,
        s=h(vector["resp_static"]),
        e=h(vector["resp_ephemeral"]),
        prologue=h(vector["resp_prologue"]),
        cipher="ChaChaPoly",
    )
    messages = vector["messages"]
    for index, message in enumerate(messages[:3]):
        writer, reader = (initiator, responder) if index % 2 == 0 else (responder, initiator)
        ciphertext = writer.write_message(h(message["payload"]))
        assert ciphertext.hex() == message["ciphertext"]
        assert reader.read_message(ciphertext) == h(message["payload"])
    assert initiator.complete and responder.complete
    assert initiator.handshake_hash.hex() == vector["handshake_hash"]
    assert responder.handshake_hash.hex() == vector["handshake_hash"]
    assert initiator.rs == responder.s_public and responder.rs == initiator.s_public

    # Transport messages alternate, starting with the responder (message 3).
    assert initiator.cipher_states and responder.cipher_states
    i_c1, i_c2 = initiator.cipher_states
    r_c1, r_c2 = responder.cipher_states
    ours_i = NoiseTransport(i_c1, i_c2, initiator.handshake_hash)
    ours_r = NoiseTransport(r_c2, r_c1, responder.handshake_hash)
    for index, message in enumerate(messages[3:], start=3):
        sender, receiver = (ours_r, ours_i) if index % 2 == 1 else (ours_i, ours_r)
        wire = sender.seal(h(message["payload"]))
        assert wire == frame(h(message["ciphertext"]))
        assert receiver.receive_and_open(wire) == [h(message["payload"])]
    assert ours_i.handshake_hash == h(vector["handshake_hash"])


def test_protocol_names_and_nonces() -> None:
    aes = HandshakeState(initiator=True, cipher="AESGCM")
    # 28-byte name, zero-padded to HASHLEN, then the (empty) prologue hashed in.
    assert len(b"Noise_XX_25519_AESGCM_SHA256") == 28
    assert aes.symmetric.ck == b"Noise_XX_25519_AESGCM_SHA256" + bytes(4)
    assert protocol.noise.AESGCM(bytes(32)).nonce(1) == bytes(4) + (1).to_bytes(8, "big")
    assert ChaChaPoly(bytes(32)).nonce(1) == bytes(4) + (1).to_bytes(8, "little")
