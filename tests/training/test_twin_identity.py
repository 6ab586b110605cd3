"""Two processes with one identity (a key file copied with a machine image): each sees it
and says so, and no report claims the other's values as its own. A twin's averaging report
listed the shared PeerID as a contributor, with the other twin's values in its tensor; a
bootstrap node joined through its twin started a second network without a word (a trial)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config

from peer import PeerUnavailableError, open_peer
from peer.errors import DuplicateIdentityError
from peer.memnet import MemoryNetwork
from protocol.address import Address
from protocol.identity import Identity
from training import Averager, AveragingInfo, Outcome

SHARED = Identity.from_seed(b"t" * 32)


async def test_a_twin_among_the_initial_peers_is_named_as_such(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    net = MemoryNetwork(latency=0.005)
    with trio.fail_after(30):
        async with open_peer(
            "10.0.0.1:4000", identity=SHARED, network=net.interface("10.0.0.1")
        ) as a:
            with pytest.raises(
                PeerUnavailableError, match="another process uses the same identity"
            ):
                async with open_peer(
                    "10.0.0.2:4000", [a.address], SHARED, network=net.interface("10.0.0.2")
                ):
                    pass  # pragma: no cover - never entered
            with pytest.raises(DuplicateIdentityError):
                async with open_peer(
                    "10.0.0.3:4001", identity=SHARED, network=net.interface("10.0.0.3")
                ) as b:
                    await b.rpc.connect(Address.parse(a.address))
    assert "another process uses the same identity" in caplog.text


async def test_twins_in_one_round_the_loser_stays_out_and_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork(latency=0.005)
    other = Identity.from_seed(b"o" * 32)
    with trio.fail_after(60):
        async with (
            open_peer("10.0.0.1:4000", identity=other, network=net.interface("10.0.0.1")) as n,
            open_peer(
                "10.0.0.2:4000", [n.address], SHARED, network=net.interface("10.0.0.2")
            ) as t1,
            open_peer(
                "10.0.0.3:4000", [n.address], SHARED, network=net.interface("10.0.0.3")
            ) as t2,
        ):
            values = {n: 1.0, t1: 2.0, t2: 4.0}
            tensors = {node: np.full(16, v, np.float32) for node, v in values.items()}
            averagers = [
                Averager(node, "twins/grads", [tensors[node]], config=fast_config())
                for node in values
            ]
            infos: dict[int, AveragingInfo] = {}

            async def step(i: int) -> None:
                infos[i] = await averagers[i].step(timeout=20.0)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(step, i)
    twin_infos = [infos[1], infos[2]]
    out = [
        info
        for info in twin_infos
        if "another process declared under this peer's PeerID" in info.note
    ]
    assert len(out) == 1, [str(i) for i in infos.values()]
    assert out[0].outcome is Outcome.UNCONFIRMED
    loser = tensors[t1] if out[0] is infos[1] else tensors[t2]
    assert np.all(loser == (2.0 if out[0] is infos[1] else 4.0))  # untouched
    # the normal peer and the winning twin averaged each other, and only each other
    winner_value = 4.0 if out[0] is infos[1] else 2.0
    assert infos[0].averaged_fraction == 1.0 and len(infos[0].group) == 2
    assert np.allclose(tensors[n], (1.0 + winner_value) / 2)
