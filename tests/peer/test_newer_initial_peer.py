"""An initial peer that answers the ping, but as another version of swarm would (an error
for a request it cannot parse, or a reply we cannot parse), is named as such in
"no initial peer answered (tried ...)". It was "no answer to a ping": a volunteer whose
bootstrap node had been upgraded first was told the node did not answer, with no hint to
update (an outside tester). Memory network, virtual time."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest
import trio
import trio.testing

from peer import PeerUnavailableError, open_peer
from peer.calls import Reply, Request
from peer.errors import RemoteError
from peer.memnet import MemoryNetwork
from protocol.messages import PingResponse


def _refuse(request: Request) -> Reply:
    raise RemoteError("bad_request", "dht.ping.req has fields [...]: update swarm")


def _reply_with_a_new_field(request: Request) -> Reply:
    return Reply({**PingResponse().to_body(), "hint": "new in v2"})


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (
            _refuse,
            r"it answered a ping with an error \(bad_request: .*update swarm\): another version",
        ),
        (
            _reply_with_a_new_field,
            r"its answer to a ping does not parse \(.*hint.*\): another version",
        ),
    ],
    ids=["error", "new-field"],
)
async def test_an_initial_peer_of_another_version_is_named_so(
    autojump_clock: trio.testing.MockClock, answer: Callable[[Request], Reply], said: str
) -> None:
    net = MemoryNetwork(latency=0.01)
    with trio.fail_after(60):
        async with open_peer("10.0.0.1:4000", [], network=net.interface("10.0.0.1")) as newer:
            newer.rpc.unregister("dht.ping")
            newer.rpc.register_quick("dht.ping", answer)
            started = trio.current_time()
            with pytest.raises(PeerUnavailableError, match="no initial peer answered") as info:
                async with open_peer(
                    "10.0.0.2:4000", [newer.address], network=net.interface("10.0.0.2")
                ):
                    pass
            assert trio.current_time() - started < 1.0  # it answered: no timeout waited for
            message = str(info.value)
            assert newer.address in message
            assert "no answer" not in message
            assert re.search(said, message), message


async def test_a_peer_that_refuses_our_requests_as_unparsable_is_named_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusing side warned; the refused one said nothing at the default level (a
    tester: an older node's hand-overs to a newer contact refused 8 times, silently)."""
    net = MemoryNetwork(latency=0.01)

    def refuse_store(request: Request) -> Reply:
        raise RemoteError("bad_request", "dht.store.req has fields [...]: update swarm")

    with trio.fail_after(60):
        async with open_peer("10.0.0.1:4000", [], network=net.interface("10.0.0.1")) as newer:
            newer.rpc.unregister("dht.store")
            newer.rpc.register_quick("dht.store", refuse_store)
            async with open_peer(
                "10.0.0.2:4000", [newer.address], network=net.interface("10.0.0.2")
            ) as older:
                caplog.set_level(logging.WARNING, logger="peer.dht.protocol")
                for n in range(3):
                    await older.dht.store(f"k{n}", n, ttl=60.0)  # stored at home only
    said = [r.getMessage() for r in caplog.records if "refused our dht.store" in r.getMessage()]
    assert len(said) == 1, said
    assert newer.peer_id.short() in said[0] and "another version of swarm" in said[0]
