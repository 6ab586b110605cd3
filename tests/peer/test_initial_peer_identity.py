"""An initial peer whose address now proves another identity (its node lost its key file
and restarted on the same port) is named as such, with what to give instead: a trial's
volunteers never found the restarted bootstrap again and only DEBUG said why, and a
newcomer read "no initial peer answered (... remote proved identity NEW, expected OLD)"."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from peer import PeerUnavailableError
from peer.memnet import MemoryNetwork
from peer.node import open_peer
from protocol.identity import Identity

OLD = Identity.from_seed(b"o" * 32)
NEW = Identity.from_seed(b"n" * 32)


async def test_an_initial_peer_with_a_new_identity_is_named_with_what_to_give(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    net = MemoryNetwork()
    old_address = f"{OLD.peer_id}@10.0.0.1:1000"
    with trio.fail_after(120), caplog.at_level(logging.WARNING, logger="peer.dht"):
        async with open_peer("10.0.0.1:1000", identity=NEW, network=net.interface("10.0.0.1")):
            for _ in range(2):
                with pytest.raises(PeerUnavailableError) as error:
                    async with open_peer(
                        "10.0.0.2:1000", [old_address], network=net.interface("10.0.0.2")
                    ):
                        pass  # pragma: no cover
                message = str(error.value)
                assert "10.0.0.1:1000 now answers with another identity" in message
                assert f"give {NEW.peer_id}@10.0.0.1:1000, or 10.0.0.1:1000" in message
            # a node that starts alone all the same (swarm bootstrap) logs it in full once,
            # and its "no initial peer answered" refers to it (a re-check read the same
            # ~330 characters twice in a row)
            caplog.clear()
            async with open_peer(
                "10.0.0.2:1000",
                [old_address],
                network=net.interface("10.0.0.2"),
                ensure_bootstrap_success=False,
            ):
                pass
            lines = [r.getMessage() for r in caplog.records]
            full = [line for line in lines if "now answers with another identity" in line]
            summary = [line for line in lines if "no initial peer answered" in line]
            assert len(full) == 1 and len(summary) == 1, lines
            assert "answers with another identity (the warning above)" in summary[0]
            # a running peer re-tries it at every refresh: said at WARNING, once
            async with open_peer("10.0.0.3:1000", network=net.interface("10.0.0.3")) as other:
                caplog.clear()
                async with open_peer(
                    "10.0.0.2:1000", [old_address, other.address], network=net.interface("10.0.0.2")
                ) as volunteer:
                    await volunteer.dht.refresh()
                    await volunteer.dht.refresh()
                warned = [r.getMessage() for r in caplog.records]
                assert len(warned) == 1 and "another identity" in warned[0], warned
