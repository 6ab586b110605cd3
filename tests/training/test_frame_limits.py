"""Frames every peer must accept, and chunks that must fit them (a new-user trial: a peer
with ``HostConfig(max_frame_size=1 MiB)`` got empty gets for large keys and dropped its
healthy peers; ``topk`` with ``fraction=1.0`` made 4 MiB chunks, and every step raised a
nested ExceptionGroup around a ``LimitExceededError``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import trio
import trio.testing
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all, verify_round

from peer import HostConfig, PeerConfig, run_in_background
from peer.node import MIN_PEER_FRAME_SIZE
from training import Averager, AveragerConfig, Outcome


def test_a_peer_refuses_a_frame_limit_below_what_peers_send() -> None:
    with pytest.raises(ValueError, match=r"HostConfig\.max_frame_size must be at least 2162688"):
        PeerConfig(host=HostConfig(max_frame_size=1 << 20))
    PeerConfig(host=HostConfig(max_frame_size=MIN_PEER_FRAME_SIZE))


def test_topk_chunks_beyond_any_frame_are_refused_with_a_chunk_size_that_fits() -> None:
    with run_in_background() as node:
        tensor = np.zeros(1 << 20, dtype=np.float32)
        config = AveragerConfig(codec="topk", codec_params={"fraction": 1.0})
        with pytest.raises(ValueError, match=r"chunk_bytes=2097152 makes .* chunks of") as info:
            Averager(node, "t/topk", [tensor], config=config)
        found = re.search(r"use chunk_bytes <= (\d+)", str(info.value))
        assert found is not None
        fits = int(found.group(1))
        assert 1 << 20 <= fits < 2 << 20
        Averager(node, "t/topk", [tensor], config=AveragerConfig(
            codec="topk", codec_params={"fraction": 1.0}, chunk_bytes=fits
        )).close()  # fmt: skip
        with pytest.raises(ValueError, match="use chunk_bytes"):
            Averager(node, "t/topk", [tensor], config=AveragerConfig(
                codec="topk", codec_params={"fraction": 1.0}, chunk_bytes=fits + 4096
            ))  # fmt: skip
        # a fraction of a half or less fits the largest chunk
        half = AveragerConfig(codec="topk", codec_params={"fraction": 0.5})
        Averager(node, "t/topk", [tensor], config=half).close()


def test_a_codec_max_elements_below_a_chunk_is_a_value_error_naming_it() -> None:
    # (a new-user trial: max_elements=1000 for a 2M-element vector raised the codec's
    # LocalProtocolError about "524288 elements", the chunk size it never named)
    with run_in_background() as node:
        tensor = np.zeros(2_000_000, dtype=np.float32)
        for limit in (0, 1000):
            config = AveragerConfig(codec_params={"max_elements": limit})
            with pytest.raises(ValueError, match=rf"max_elements={limit} is below the 524288"):
                Averager(node, "t/max", [tensor], config=config)
        small = AveragerConfig(codec_params={"max_elements": 1024}, chunk_bytes=4096)
        Averager(node, "t/max", [tensor], config=small).close()
        # a vector smaller than a chunk is one chunk of its own size (a review)
        tiny = AveragerConfig(codec_params={"max_elements": 10})
        Averager(node, "t/max", [np.zeros(10, dtype=np.float32)], config=tiny).close()
        with pytest.raises(ValueError, match=r"max_elements=9 is below the 10 elements"):
            Averager(node, "t/max", [np.zeros(10, dtype=np.float32)], config=AveragerConfig(
                codec_params={"max_elements": 9}
            ))  # fmt: skip


async def test_topk_with_every_value_averages_in_chunks_that_fit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            config = fast_config(codec="topk", codec_params={"fraction": 1.0}, chunk_bytes=8192)
            members = make_members(nodes, 10_000, config)
            results = await step_all(members, timeout=20.0)
            infos = [info for info, _ in results if info is not None]
            verify_round(members, infos)
            assert [i.outcome for i in infos] == [Outcome.AVERAGED] * 2
