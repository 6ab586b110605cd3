"""Averaging requests with a field out of range or of the wrong type are ``bad_request``,
as protocol.md's introduction says, whatever round the callee is in (a wire-fuzz trial:
``result`` with round -1 or part 2**62, and ``ping`` with round -1, 2**62 or nil, were
answered ``not_found`` as if well-formed; a join with ``skipped: []`` was accepted though
the key is sent only when non-empty; a client-mode declaration took an address of any
type)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_averaging_support import declaration_wire, fast_config, make_members, memnet_swarm

from peer import RemoteError
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from training.averaging.grouping import Declaration
from training.averaging.messages import JoinRequest, parse_ping, parse_result_request

PEER = Identity.from_seed(b"r" * 32).peer_id
DECL = declaration_wire(address=f"{PEER}@127.0.0.1:4000")
BAD_ROUNDS = [-1, 2**62, None, True, 1.0, "1", [1]]


TAG = bytes(range(16))  # a group tag: 16 bytes (v9)
BAD_GROUPS = [0, 1, 2**62 - 1, None, True, 1.0, "1", [1], b"", TAG[:15], TAG + b"x", TAG.hex()]


@pytest.mark.parametrize("value", BAD_ROUNDS)
def test_a_ping_round_out_of_range_or_nil_is_malformed(value: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_ping({"round": value})
    assert parse_ping({}) == (None, None)
    assert parse_ping({"round": 2**62 - 1}) == (2**62 - 1, None)
    assert parse_ping({"round": 3, "group": TAG}) == (3, TAG)


@pytest.mark.parametrize("value", BAD_GROUPS)
def test_a_ping_group_out_of_range_or_nil_is_malformed(value: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_ping({"round": 3, "group": value})


def test_a_ping_group_without_its_round_is_malformed() -> None:
    with pytest.raises(RemoteProtocolError, match="only with its round"):
        parse_ping({"group": TAG})


@pytest.mark.parametrize(
    "body",
    [
        *({"round": r, "group": TAG, "part": 0} for r in BAD_ROUNDS),
        *({"round": 5, "group": g, "part": 0} for g in BAD_GROUPS),
        {"round": 5, "group": TAG, "part": -1},
        {"round": 5, "group": TAG, "part": 256},
        {"round": 5, "group": TAG, "part": 2**62},
        {"round": 5, "group": TAG, "part": None},
        {"round": 5, "group": TAG},
        {"round": 5, "part": 0},
        {"group": TAG, "part": 0},
    ],
)
def test_a_result_request_out_of_range_is_malformed(body: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_result_request(body)


def test_a_result_request_in_range_parses() -> None:
    assert parse_result_request({"round": 0, "group": TAG, "part": 255}) == (0, TAG, 255)


def test_an_empty_skipped_list_is_malformed() -> None:
    with pytest.raises(RemoteProtocolError, match="omitted when empty"):
        JoinRequest.from_body(PEER, {"round": 1, "decl": DECL, "skipped": []})
    request = JoinRequest.from_body(PEER, {"round": 1, "decl": DECL})
    assert request.skipped == ()


@pytest.mark.parametrize("address", [5, 1.5, {"a": 1}, ["x"], b"127.0.0.1:4000", True])
@pytest.mark.parametrize("client_mode", [True, False])
def test_a_declared_address_is_a_str_or_nil(address: Any, client_mode: bool) -> None:
    with pytest.raises(RemoteProtocolError, match="str or nil"):
        Declaration.from_wire(PEER, declaration_wire(address=address, client_mode=client_mode))


def test_a_full_members_address_must_name_its_peer_id() -> None:
    """Dialed without a PeerID, whoever answers at the address passes for the member: a
    lying leader listed an honest member under a host of its own, whose garbage results
    got the member benched by everyone (a review). v9 refuses such a declaration."""
    with pytest.raises(RemoteProtocolError, match="must name its PeerID"):
        Declaration.from_wire(PEER, declaration_wire(address="127.0.0.1:4000"))
    other = Identity.from_seed(b"o" * 32).peer_id
    with pytest.raises(RemoteProtocolError, match="names another peer"):
        Declaration.from_wire(PEER, declaration_wire(address=f"{other}@127.0.0.1:4000"))
    assert Declaration.from_wire(PEER, DECL).address == f"{PEER}@127.0.0.1:4000"


def test_a_client_declaration_without_an_address_parses() -> None:
    parsed = Declaration.from_wire(PEER, declaration_wire(address=None))
    assert parsed.client_mode and parsed.address is None
    wire = declaration_wire(address="127.0.0.1:4000", client_mode=True)
    parsed = Declaration.from_wire(PEER, wire)
    assert parsed.client_mode and parsed.address is None  # ignored, as documented


async def test_a_live_averager_answers_bad_request_not_not_found(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            (member,) = make_members(nodes[:1], 64, fast_config())
            methods = member.averager._methods
            address = nodes[0].address
            caller = nodes[1]
            codes: list[str] = []

            async def ask(method: str, body: dict[str, Any]) -> None:
                try:
                    if method == "result":
                        async with caller.rpc.stream(address, f"{methods}.result", body) as items:
                            async for _ in items:
                                pass
                    else:
                        await caller.rpc.call(address, f"{methods}.{method}", body)
                    codes.append("ok")
                except RemoteError as exc:
                    codes.append(exc.code)

            for value in (-1, 2**62, None):
                await ask("ping", {"round": value})
                await ask("result", {"round": value, "group": TAG, "part": 0})
            await ask("result", {"round": 5, "group": TAG, "part": -1})
            await ask("result", {"round": 5, "group": TAG, "part": 2**62})
            await ask("result", {"round": 5, "group": 0, "part": 0})
            await ask("ping", {"round": 5, "group": TAG[:15]})
            assert codes == ["bad_request"] * 10, codes
            codes.clear()
            await ask("ping", {})
            await ask("ping", {"round": 5})  # well-formed, not in that round
            await ask("ping", {"round": 5, "group": TAG})
            await ask("result", {"round": 5, "group": TAG, "part": 0})
            assert codes == ["ok", "not_found", "not_found", "not_found"], codes
            member.averager.close()
