"""Values nested deeper than Python's recursion limit (msgpack carries up to 1022 levels)
are malformed input, not an ``internal`` error: a message that put the received value's
``repr`` in its text raised RecursionError instead (a hostile-peer trial: a join whose
``decl.weight``, a chunk whose ``abort``, was a list nested 1000 deep)."""

from __future__ import annotations

import pytest
from test_averaging_support import declaration_wire

from protocol.errors import RemoteProtocolError, brief
from protocol.identity import Identity
from protocol.messages import PingRequest
from training.averaging.grouping import Declaration
from training.averaging.messages import ChunkHeader, ResultHeader
from training.averaging.reducer import DropReason


def deep(levels: int = 1000) -> list[object]:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


PEER = Identity.from_seed(b"d" * 32).peer_id


def test_brief_is_short_and_survives_any_depth() -> None:
    assert brief(deep()) == "[[[[...]]]]"
    assert len(brief("x" * 1000)) <= 60
    assert brief(3) == "3"


@pytest.mark.parametrize("field", ["weight", "bandwidth", "epoch", "count", "total", "layout"])
def test_a_deep_declaration_field_is_malformed(field: str) -> None:
    with pytest.raises(RemoteProtocolError):
        wire = declaration_wire(address=f"{PEER}@127.0.0.1:4000", **{field: deep()})
        Declaration.from_wire(PEER, wire)


def test_a_deep_abort_reason_is_malformed() -> None:
    body = ChunkHeader(
        9, 1, 3, 7, 2.0, DropReason.NONFINITE, group_id=(5).to_bytes(16, "big")
    ).to_body()
    with pytest.raises(RemoteProtocolError, match="'abort' must be a string"):
        ChunkHeader.from_body({**body, "abort": deep()})


def test_a_deep_drop_reason_is_malformed() -> None:
    body = {"contributors": [], "dropped": [[str(PEER), deep()]], "weight": 0, "chunks": 0}
    with pytest.raises(RemoteProtocolError, match="drop reason must be a string"):
        ResultHeader.from_body(body)


def test_a_deep_message_tag_is_malformed() -> None:
    with pytest.raises(RemoteProtocolError, match=r"got \[\[\[\[\.\.\.\]\]\]\]"):
        PingRequest.from_body({"t": deep(), "sender": None})
