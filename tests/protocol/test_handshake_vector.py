"""The handshake test vector of docs/protocol.md, section 2.4: the reference implementation
produces exactly those bytes, and the document shows exactly these (an outside tester who
wrote a client from the document alone asked for one: a wrong nonce in message 3 shows up
only as a silent close)."""

from __future__ import annotations

from pathlib import Path

from protocol.identity import Identity
from protocol.noise import NoiseHandshake
from protocol.noise.handshake import PROLOGUE
from protocol.noise.state import HandshakeState

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _handshake() -> dict[str, bytes]:
    initiator = NoiseHandshake.from_state(
        Identity.from_seed(b"\x01" * 32),
        HandshakeState(initiator=True, s=b"\x11" * 32, e=b"\x33" * 32, prologue=PROLOGUE),
    )
    responder = NoiseHandshake.from_state(
        Identity.from_seed(b"\x02" * 32),
        HandshakeState(initiator=False, s=b"\x22" * 32, e=b"\x44" * 32, prologue=PROLOGUE),
    )
    out: dict[str, bytes] = {}
    out["message 1"] = initiator.data_to_send()
    responder.receive_data(out["message 1"])
    out["message 2"] = responder.data_to_send()
    initiator.receive_data(out["message 2"])
    out["message 3"] = initiator.data_to_send()
    responder.receive_data(out["message 3"])
    sender, receiver = initiator.into_transport(), responder.into_transport()
    out["handshake hash h"] = sender.handshake_hash
    out["first transport message"] = sender.seal(b"hello")
    assert receiver.receive_and_open(out["first transport message"]) == [b"hello"]
    assert receiver.handshake_hash == sender.handshake_hash
    return out


def _documented() -> dict[str, bytes]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("### 2.4 Test vector") : text.index("### 2.5 ")]
    block = section[section.index("```") + 3 : section.rindex("```")]
    found: dict[str, bytes] = {}
    for chunk in block.strip().split("\n\n"):
        title, *lines = chunk.splitlines()
        name = title.split(" (")[0].split(",")[0]
        found[name] = bytes.fromhex("".join(lines))
    return found


def test_the_documented_handshake_is_what_the_reference_implementation_writes() -> None:
    made, documented = _handshake(), _documented()
    assert list(documented) == list(made)
    for name, data in made.items():
        assert documented[name] == bytes(data), name
    assert [len(made[f"message {n}"]) for n in (1, 2, 3)] == [34, 218, 186]


def test_the_documented_peer_ids_are_the_seeds() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("### 2.4 Test vector") : text.index("### 2.5 ")]
    for seed in (b"\x01", b"\x02"):
        assert str(Identity.from_seed(seed * 32).peer_id) in section
