"""Mistakes an ML user makes in a plain training script, each a clear error."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import trio
from torch.utils.data import DataLoader, Dataset

import peer
from training import Averager
from training.averaging.config import AveragerConfig


def test_the_context_manager_instead_of_the_peer_is_a_type_error_that_says_so() -> None:
    """``node = peer.run_in_background(...)`` without ``with``: before, an AttributeError
    about ``client_mode`` from inside the Averager."""
    with pytest.raises(TypeError, match=r"context manager.*with peer\.run_in_background"):
        Averager(peer.run_in_background(), "mistake/p", [torch.zeros(4)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="node must be a running peer, got NoneType"):
        Averager(None, "mistake/p", [torch.zeros(4)])  # type: ignore[arg-type]


def test_an_averager_on_a_stopped_peer_is_refused_when_made() -> None:
    """An outside tester made an Averager on a peer whose block had ended: no error until
    its first step. Both kinds of peer now refuse at once."""
    with peer.run_in_background() as node:
        pass
    with pytest.raises(peer.PeerStoppedError, match="this peer has stopped"):
        Averager(node, "mistake/p", [torch.zeros(4)])

    async def main() -> peer.Peer:
        async with peer.open_peer() as node:
            return node

    stopped = trio.run(main)
    with pytest.raises(peer.PeerStoppedError, match="this peer has stopped"):
        Averager(stopped, "mistake/p", [torch.zeros(4)])


class _SocketsInWorker(Dataset[torch.Tensor]):
    """Each item: how many TCP sockets the DataLoader worker that loads it holds."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        count = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                sock = socket.socket(fileno=int(name))
            except OSError:
                continue
            count += sock.family in (socket.AF_INET, socket.AF_INET6)
            sock.detach()
        return torch.tensor(count)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc: Linux")
def test_dataloader_workers_forked_after_the_peer_hold_none_of_its_sockets() -> None:
    """A DataLoader made after run_in_background forks its workers: before, each held
    copies of the peer's sockets (a peer that left stayed connected for the others, and
    its port kept accepting). The parent averages while they live."""
    config = AveragerConfig(gather_window=0.5)
    with (
        peer.run_in_background() as first,
        peer.run_in_background(initial_peers=[first.address]) as second,
    ):
        mine, theirs = torch.full((1000,), 2.0), torch.zeros(1000)
        averager = Averager(first, "dl/p", [mine], config=config)
        other = Averager(second, "dl/p", [theirs], config=config)
        loader = DataLoader(
            _SocketsInWorker(),
            batch_size=1,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
        assert [int(count) for count in loader] == [0, 0, 0, 0]
        # Two steps started together on a loaded machine may still meet in different
        # rounds (each then alone, its tensor untouched): a few tries, both or neither.
        for _attempt in range(3):
            with ThreadPoolExecutor(1) as pool:
                theirs_done = pool.submit(other.step_blocking, timeout=10.0)
                info = averager.step_blocking(timeout=10.0)
                fractions = (info.averaged_fraction, theirs_done.result().averaged_fraction)
            if fractions == (1.0, 1.0):
                break
            assert fractions == (0.0, 0.0), fractions
        assert fractions == (1.0, 1.0)
        assert torch.equal(mine, torch.ones(1000)) and torch.equal(theirs, torch.ones(1000))
        assert [int(count) for count in loader] == [0, 0, 0, 0]  # the same workers
        del loader


def test_step_blocking_from_two_threads_says_which_mistake() -> None:
    """Was "the averager is closed or already in a step" for both mistakes."""
    with peer.run_in_background() as node:
        tensor = torch.zeros(4)
        averager = Averager(node, "threads/p", [tensor], config=AveragerConfig(gather_window=0.5))
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(averager.step_blocking, timeout=3.0)
            deadline = time.monotonic() + 5
            while not node.run_sync(lambda: averager._busy):
                assert time.monotonic() < deadline and not first.done()
                time.sleep(0.01)
            with pytest.raises(RuntimeError, match=r"already in a step \(from another task or"):
                averager.step_blocking(timeout=3.0)
            assert first.result().outcome in ("alone", "unconfirmed")
        averager.close()
        with pytest.raises(RuntimeError, match="'threads/p' is closed: make a new one"):
            averager.step_blocking(timeout=3.0)


def test_sending_the_peer_or_averager_to_another_process_says_so() -> None:
    """A spawned DataLoader worker's dataset or a Pool argument holding them: was "cannot
    pickle ... Ed25519PrivateKey"."""
    with peer.run_in_background() as node:
        tensor = torch.zeros(3)
        averager = Averager(node, "pickle/p", [tensor])
        with pytest.raises(TypeError, match="background peer cannot be sent to another"):
            pickle.dumps(node)
        with pytest.raises(TypeError, match="Averager cannot be sent to another process"):
            pickle.dumps(averager)
        averager.close()
