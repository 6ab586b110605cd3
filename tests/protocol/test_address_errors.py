"""A malformed address is an ``AddressError``: a ``ProtocolError`` (it may come off the wire)
and a ``ValueError`` (most often it is an argument a caller got wrong, as a new-user trial
expected of ``open_peer(listen="nonsense")``)."""

from __future__ import annotations

import pytest
import trio

from peer import open_peer
from protocol.address import Address
from protocol.errors import AddressError, ProtocolError


@pytest.mark.parametrize(
    "text", ["nonsense", "127.0.0.1:99999", "::1:80", "[::1:80", "notapeerid@127.0.0.1:80", ""]
)
def test_a_malformed_address_is_both_kinds_of_error(text: str) -> None:
    with pytest.raises(AddressError) as info:
        Address.parse(text)
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "arguments", [{"listen": "nonsense"}, {"initial_peers": ["127.0.0.1:99999"]}]
)
async def test_open_peer_raises_a_value_error_for_a_bad_address(arguments: dict) -> None:
    with trio.fail_after(10), pytest.raises(ValueError, match=r"99999|HOST:PORT"):
        async with open_peer(**arguments):
            pass  # pragma: no cover - never entered
