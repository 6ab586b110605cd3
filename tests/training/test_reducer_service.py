"""ReducerService on its own: results are served while the mean is still being encoded,
a publication cut short ends the result streams, and a mean beyond what the codec carries
is refused before any chunk goes out."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing
from test_averaging_support import no_node

from peer import RemoteError
from protocol.codecs import get_codec
from protocol.identity import Identity, PeerID
from training.averaging.config import AveragerConfig
from training.averaging.grouping import Declaration
from training.averaging.layout import FlatVector
from training.averaging.messages import ChunkHeader, ResultHeader
from training.averaging.plan import Liveness, Plan
from training.averaging.reducing import ReducerService

CHUNK = 1024  # elements (AveragerConfig.chunk_bytes = 4096)
CHUNKS = 3


def peer(i: int) -> PeerID:
    return Identity.from_seed(bytes([i + 11]) * 32).peer_id


def service_for(codec: str, local: np.ndarray) -> tuple[ReducerService, torch.Tensor]:
    """We (peer 0) reduce the whole vector; peer 1 sends it to us."""
    me, other = peer(0), peer(1)
    members = tuple(
        Declaration(p, f"{p}@127.0.0.1:1", 1.0, 0, 1.0, "layout", 0, len(local))
        for p in (me, other)
    )
    plan = Plan(
        round=1,
        me=me,
        members=members,
        reducers=members[:1],
        spans=((0, len(local)),),
        weights={me: 1.0, other: 1.0},
        max_epoch=0,
        group_id=(1).to_bytes(16, "big"),
    )
    tensor = torch.from_numpy(local.copy())
    flat = FlatVector([tensor])
    config = AveragerConfig(chunk_bytes=4 * CHUNK)
    liveness = Liveness(no_node(plan), plan, "ping", 1.0)  # type: ignore[arg-type]  # never probes
    scratch = np.empty(CHUNK, np.float32)
    return ReducerService(plan, 0, flat, get_codec(codec), config, liveness, scratch), tensor


async def send_all(service: ReducerService, codec: str, values: np.ndarray) -> None:
    encoder = get_codec(codec)
    for chunk in range(CHUNKS):
        blob = encoder.encode(values[chunk * CHUNK : (chunk + 1) * CHUNK])
        await service.on_chunk(
            peer(1), ChunkHeader(1, 0, chunk, 0, 1.0, group_id=(1).to_bytes(16, "big")), blob
        )


async def test_result_chunks_are_served_while_the_mean_is_encoded() -> None:
    rng = np.random.default_rng(0)
    mine = rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32)
    theirs = rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32)
    service, tensor = service_for("int8", mine)
    with trio.fail_after(5):
        await service.load()
        await send_all(service, "int8", theirs)
        outcome = await service.reduce(math.inf)
        assert outcome.weight == 2.0
        assert service.header is not None and service.header.chunks == CHUNKS

        items: list[Any] = []
        encoded_when_served: list[int] = []

        async def fetch() -> None:
            async for item in service.results(peer(1)):
                items.append(item)
                encoded_when_served.append(len(service.blobs))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await trio.testing.wait_all_tasks_blocked()
            assert len(items) == 1  # the header goes out before any chunk is encoded
            assert ResultHeader.from_body(items[0].body) == service.header
            await service.publish()
    # the first chunk went out while later ones were still to be encoded
    assert encoded_when_served[1] < CHUNKS
    assert service.in_place  # our tensor holds exactly what the others decode
    decoder = get_codec("int8")
    served = np.concatenate([decoder.decode(item.payload) for item in items[1:]])
    np.testing.assert_array_equal(served, tensor.numpy())
    bound = 2 * np.abs((mine + theirs) / 2).max() / 127
    np.testing.assert_allclose(served, (mine + theirs) / 2, atol=bound)


async def test_a_mean_beyond_the_codec_is_refused_before_any_chunk() -> None:
    """float16 carries up to 65504: our own values (float32) pull the mean beyond it."""
    mine = np.full(CHUNKS * CHUNK, 2e5, np.float32)
    service, tensor = service_for("float16", mine)
    with trio.fail_after(5):
        await service.load()
        await send_all(service, "float16", np.full(CHUNKS * CHUNK, 1e4, np.float32))
        outcome = await service.reduce(math.inf)
        await service.publish()
    assert outcome.weight == 0 and outcome.contributors == ()
    assert "overflows float16" in outcome.note
    header = service.header
    assert header is not None and header.chunks == 0 and header.note == outcome.note
    assert ResultHeader.from_body(header.to_body()) == header  # the members read why
    assert not service.in_place and not service.blobs
    np.testing.assert_array_equal(tensor.numpy(), mine)  # our values stay as they were


async def test_values_near_float32s_largest_average_without_overflow() -> None:
    """The sum is convex (each value times its share of the weight): 3e38 and 3e38 average
    to 3e38 instead of overflowing to infinity."""
    big = np.full(CHUNKS * CHUNK, 3e38, np.float32)
    service, tensor = service_for("int8", big)
    with trio.fail_after(5):
        await service.load()
        await send_all(service, "int8", big)
        outcome = await service.reduce(math.inf)
        await service.publish()
    assert outcome.weight == 2.0 and outcome.note == ""
    assert service.header is not None and len(service.blobs) == service.header.chunks == CHUNKS
    np.testing.assert_allclose(tensor.numpy(), big, rtol=1 / 127)


async def test_a_publication_cut_short_ends_the_result_streams() -> None:
    rng = np.random.default_rng(1)
    mine = rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32)
    service, tensor = service_for("int8", mine)
    errors: list[RemoteError] = []
    with trio.fail_after(5):
        await service.load()
        await send_all(service, "int8", rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32))
        await service.reduce(math.inf)
        fetched: list[Any] = []

        async def fetch() -> None:
            try:
                async for item in service.results(peer(1)):
                    fetched.append(item)
            except RemoteError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            with trio.CancelScope() as deadline:
                deadline.cancel()  # the round's deadline passes at publish's first checkpoint
                await service.publish()
    assert len(service.blobs) == 1 and len(fetched) == 2  # the header and chunk 0
    assert [e.code for e in errors] == ["unavailable"]  # the stream ended, it did not hang
    # chunk 0 went back into our tensor as the others decode it, the rest as the mean (a
    # caller that cancelled the step stores nothing: no part is left half averaged); in
    # place: the averager stores nothing over it either
    assert service.in_place
    np.testing.assert_array_equal(
        tensor.numpy()[:CHUNK], get_codec("int8").decode(fetched[1].payload)
    )
    np.testing.assert_array_equal(tensor.numpy()[CHUNK:], service.reducer.mean()[CHUNK:])
    assert not np.array_equal(tensor.numpy()[CHUNK:], mine[CHUNK:])


@pytest.mark.parametrize("codec", ["int8", "float16"])
async def test_a_deadline_right_after_the_last_chunk_keeps_what_the_members_decode(
    codec: str,
) -> None:
    """The round's deadline at publish's checkpoint after its last chunk: every member
    fetches the whole part and decodes it; our tensor holds the same values (in place), not
    the mean stored over them from the flat vector (which differed by up to the codec's
    error: a review)."""
    rng = np.random.default_rng(2)
    service, tensor = service_for(codec, rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32))
    with trio.fail_after(5):
        await service.load()
        await send_all(service, codec, rng.standard_normal(CHUNKS * CHUNK, dtype=np.float32))
        await service.reduce(math.inf)
        encode = service._encode
        with trio.CancelScope() as deadline:

            def encode_then_expire(values: Any, out: Any, start: int) -> int:
                size = encode(values, out, start)
                if len(service.blobs) == CHUNKS - 1:  # the last one
                    deadline.cancel()
                return size

            service._encode = encode_then_expire  # type: ignore[method-assign]
            await service.publish()
        assert deadline.cancelled_caught
    assert len(service.blobs) == CHUNKS and service.in_place
    decoded = np.concatenate([get_codec(codec).decode(blob) for blob in service.blobs])
    np.testing.assert_array_equal(tensor.numpy(), decoded)


async def test_a_mean_rounded_up_to_infinity_is_clamped_back() -> None:
    """A finite sum of about FLT_MAX can round to infinity when divided; int8 would refuse
    to encode it midway through the results, so the reducer clamps it to FLT_MAX."""
    big = np.full(CHUNKS * CHUNK, 1.0, np.float32)
    service, tensor = service_for("int8", big)
    with trio.fail_after(5):
        await service.load()
        await send_all(service, "int8", big)
        await service.reduce(math.inf)  # the sum is finite: the header promises every chunk
        service.reducer.mean()[5] = np.inf  # what such a division would leave in chunk 0
        await service.publish()
    assert service.header is not None and len(service.blobs) == service.header.chunks
    first = get_codec("int8").decode(service.blobs[0])
    assert np.isfinite(first).all() and first[5] > 3.4e38  # 127 x the largest safe scale
    np.testing.assert_array_equal(tensor.numpy()[:CHUNK], first)
    assert service.in_place
