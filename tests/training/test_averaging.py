"""Averaging on the memory network (virtual time): exact weighted means, codecs, mixing."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import trio
from test_averaging_support import (
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    step_all,
    step_averagers,
    verify_round,
    virtual_clock,
)

from peer import open_peer
from training import Averager, DropReason, Outcome, PartStatus
from training.averaging.match_notes import _with_slow_link
from training.averaging.round_state import MatchResult


@pytest.mark.parametrize(
    ("n", "codec"),
    [(2, "none"), (4, "none"), (4, "float16"), (4, "int8"), (16, "none"), (16, "int8")],
)
async def test_group_averages_to_the_weighted_mean(
    autojump_clock: trio.testing.MockClock, n: int, codec: str
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(n) as (_, nodes):
            members = make_members(nodes, 20_000, fast_config(codec=codec))
            results = await step_all(members, timeout=30.0)
    infos = [info for info, _ in results]
    assert all(info is not None for info in infos)
    verify_round(members, infos, codec=codec)  # type: ignore[arg-type]
    for info, elapsed in results:
        assert info is not None and elapsed <= 30.0
        assert info.outcome is Outcome.AVERAGED and info.averaged_fraction == 1.0
        assert len(info.group) == n and len(info.parts) == n
    expected = sum(m.weight * m.data.astype(np.float64) for m in members) / sum(
        m.weight for m in members
    )
    scale = max(float(np.abs(m.data).max()) for m in members)
    bound = {"none": 1e-6, "float16": 2 * 2**-11, "int8": 2 / 254}[codec] * scale
    for m in members:
        assert float(np.abs(m.array - expected).max()) <= bound
    if codec == "none":  # element by element too, where the contributions cancel
        # (a float32 sum of 3 or more rounded a few hundred elements of these past 1e-6)
        for m in members:
            np.testing.assert_allclose(m.array, expected, rtol=1e-6, atol=0)
    if codec != "none":  # every member decoded the same blobs: identical results
        for m in members[1:]:
            np.testing.assert_array_equal(m.array, members[0].array)


@pytest.mark.parametrize("weights", [(1.0, 3.0), (0.3, 1.7), (32.0, 48.0), (1.0, 1.0, 0.1)])
async def test_none_gives_each_element_within_a_rounding_of_the_exact_mean(
    autojump_clock: trio.testing.MockClock, weights: tuple[float, ...]
) -> None:
    """Where the contributions nearly cancel, too, and with weights whose ratios float32
    does not hold (two peers: 2**-24 rounding of the shares or of our scaled values was
    large beside such a mean, a tester found 230 of 100,000 elements beyond rtol=1e-6 with
    weights 1 and 3); exact opposites average to exactly 0."""
    with trio.fail_after(60):
        async with memnet_swarm(len(weights)) as (_, nodes):
            members = make_members(nodes, 20_000, fast_config())
            rng = np.random.default_rng(5)
            for member, weight in zip(members, weights, strict=True):
                member.weight = weight
            # the last one cancels the others' weighted sum but for a small remainder,
            # except at the first 100 elements, where the first two are exact opposites
            partial = sum(m.weight * m.data.astype(np.float64) for m in members[:-1])
            last = (1e-3 * rng.standard_normal(20_000) - partial) / members[-1].weight
            members[-1].data[:] = last.astype(np.float32)
            members[1].data[:100] = -members[0].data[:100]
            members[-1].data[:100] = 0.0 if len(members) > 2 else members[-1].data[:100]
            for m in members:
                m.array[:] = m.data
            results = await step_all(members, timeout=20.0)
    assert all(info is not None and info.outcome is Outcome.AVERAGED for info, _ in results)
    total = sum(weights)
    expected = sum(m.weight * m.data.astype(np.float64) for m in members) / total
    for m in members:
        np.testing.assert_allclose(m.array, expected, rtol=1e-6, atol=0)
    if len(members) > 2:
        for m in members:
            np.testing.assert_array_equal(m.array[:100], np.zeros(100, np.float32))


async def test_torch_tensors_of_several_shapes_and_dtypes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            gen = torch.Generator().manual_seed(0)
            tensors = [
                [
                    torch.randn(7, 9, generator=gen),
                    torch.randn(3000, generator=gen, dtype=torch.float64),
                    torch.randn(2, 2, 2, generator=gen),
                ]
                for _ in nodes
            ]
            originals = [[t.clone() for t in ts] for ts in tensors]
            averagers = [
                Averager(node, "t/torch", ts, config=fast_config())
                for node, ts in zip(nodes, tensors, strict=True)
            ]
            async with trio.open_nursery() as nursery:
                for averager in averagers:
                    nursery.start_soon(averager.step)
    for k in range(3):
        expected = sum(o[k].double() for o in originals) / 3
        for ts in tensors:
            assert ts[k].dtype == originals[0][k].dtype
            assert torch.allclose(ts[k].double(), expected, atol=1e-6)


async def test_repeated_rounds_mix_sixteen_peers_in_groups_of_four(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with memnet_swarm(16) as (_, nodes):
            members = make_members(nodes, 2_000, fast_config(group_size=4))
            for m in members:
                m.weight = 1.0
            target = np.mean([m.data.astype(np.float64) for m in members], axis=0)
            spreads = []
            for _round in range(2):  # the second round already averages everyone exactly
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=30.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for info in infos:
                    assert info is not None and len(info.group) == 4
                    assert info.outcome is Outcome.AVERAGED
                spread = max(float(np.abs(m.array - target).max()) for m in members)
                spreads.append(spread)
                print(f"round {_round}: max distance to the global mean {spread:.3g}")
    assert spreads[0] > 0.1
    assert spreads[1] < 1e-5  # a 4x4 grid: two rounds average everyone exactly


@pytest.mark.parametrize("carry_weight", [True, False])
async def test_unequal_weights_reach_the_weighted_mean_when_each_passes_its_groups_weight(
    autojump_clock: trio.testing.MockClock, carry_weight: bool
) -> None:
    """A grid trial (16 processes' peers, weight i + 1): two full rounds left a spread of
    1.0, not the exact weighted mean: the second round weighs each peer by the weight it
    passes, not by the total its values already stand for. Passing the part's total weight
    of the first round (``info.parts[i].weight``) makes it exact, as averaging.md says."""
    with trio.fail_after(300):
        async with memnet_swarm(16) as (_, nodes):
            members = make_members(nodes, 2_000, fast_config(group_size=4))
            for i, m in enumerate(members):
                m.weight = float(i + 1)
            weights = np.array([m.weight for m in members])
            data = np.array([m.data.astype(np.float64) for m in members])
            target = weights @ data / weights.sum()
            spreads = []
            for _round in range(2):
                for m in members:
                    m.data = m.array.copy()
                results = await step_all(members, timeout=30.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for m, info in zip(members, infos, strict=True):
                    assert info is not None and info.outcome is Outcome.AVERAGED
                    assert len({part.weight for part in info.parts}) == 1
                    if carry_weight:
                        m.weight = info.parts[0].weight
                spread = max(float(np.abs(m.array - target).max()) for m in members)
                spreads.append(spread)
                print(f"round {_round}: max distance to the weighted mean {spread:.3g}")
    if carry_weight:
        assert spreads[1] < 1e-5
    else:
        assert spreads[1] > 0.01


async def test_a_lone_peer_gets_a_clear_answer_and_keeps_its_tensors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            (member,) = make_members(nodes[:1], 100, fast_config())
            start = trio.current_time()
            info = await member.averager.step(timeout=10.0)
            assert trio.current_time() - start <= 1.5 * 1.0 + 0.1
    assert info.outcome is Outcome.ALONE
    assert info.group == (member.peer_id,) and info.me == member.peer_id
    assert info.averaged_fraction == 0.0 and info.parts == ()
    # its node knows the other node; a peer whose gather_window differs from the others'
    # meets nobody either, and nothing else would tell it (a trial: 2.1 s beside 2.0 s)
    note = (
        "no partner (nobody declared in this round; peers meet only with the same prefix and "
        "gather_window, 1 s here)"
    )
    assert info.note == note
    assert str(info) == f"alone in round {info.round}; {note}"  # was "0% over 1 peers"
    np.testing.assert_array_equal(member.array, member.data)


async def test_a_peer_whose_clock_is_off_beyond_correction_is_told_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A trial's peer whose clock was 5,000 s behind (network time corrects 3,600 s at
    most) read "nobody declared in this round" every step; the clock's warning was in the
    log only. Its rounds are the others' past, so its note now names the clock."""
    with trio.fail_after(120):
        async with (
            memnet_swarm(2) as (net, nodes),
            open_peer(
                listen=f"{host_of(2)}:1000",
                initial_peers=[nodes[0].address],
                network=net.interface(host_of(2)),
                clock=lambda: virtual_clock() - 5000.0,
            ) as behind,
        ):
            # (its clock heard the others as it joined)
            assert behind.clock.uncorrected == pytest.approx(1400.0, abs=1.0)
            assert nodes[0].clock.uncorrected == 0.0  # its own time counts: median 0
            members = make_members(nodes, 100, fast_config())
            late = Averager(behind, "t/x", [np.ones(100, np.float32)], config=fast_config())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step_all, members, 10.0)
                info = await late.step(timeout=10.0)
    assert info.outcome is Outcome.ALONE
    assert "differ by 1400 s more than network time corrects" in info.note
    assert "set the wrong clock" in info.note


@pytest.mark.parametrize("latency", [0.1, 0.25])
async def test_a_slow_link_against_the_gather_window_is_named(
    autojump_clock: trio.testing.MockClock, latency: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A trial's 4 peers at 400 ms round trip, whose declarations took 0.7-1.4 s of the
    2 s window to store, split into pairs that met in alternate rounds, each reporting
    "averaged 100% over 2 peers", with nothing said. Stores that take over a quarter of
    the window (their median over the last steps, at least 3) are named now, with the
    window to set; here one store is one round trip (2 x latency) against a 1 s window."""
    with trio.fail_after(120):
        async with memnet_swarm(3, latency=latency) as (_, nodes):
            members = make_members(nodes, 500, fast_config())
            for _ in range(3):
                results = await step_all(members, timeout=30.0)
    for info, _ in results:
        assert info is not None and info.outcome is Outcome.AVERAGED, str(info)
        if latency < 0.15:
            assert "gather_window" not in info.note, info.note
        else:
            assert info.note == (
                "storing our declaration takes 0.50 s, over a quarter of gather_window (1 s): "
                "on links this slow, peers a moment apart miss each other's rounds, and the "
                "swarm may split into groups that average apart, each in full; set "
                "gather_window to 2.5 s or more (5 times that) on every peer of the prefix"
            ), info.note
    # and logged, once per averager
    assert caplog.text.count("storing our declaration takes") == (3 if latency > 0.15 else 0)


def test_the_slow_link_note_asks_for_the_window_the_trials_needed() -> None:
    """Two WAN trials (stores 0.8 s median at ~430 ms round trip): a 3 s window, which the
    first rule (3 x the median store) asked for and then fell silent at, still split
    half of the steps; 4 s had all four peers in 216 of 220."""
    alone = MatchResult(1, None, None, 1, note="no partner", alone=True)
    assert _with_slow_link(alone, [1.56], 2.0) is alone  # one slow store says little
    for window in (2.0, 3.0):
        note = _with_slow_link(alone, [0.8, 0.75, 0.9], window).note
        assert note.startswith("no partner; storing our declaration takes 0.80 s"), note
        assert "set gather_window to 4 s or more" in note, note
    assert _with_slow_link(alone, [0.8, 0.75, 0.9], 4.0) is alone
    assert _with_slow_link(alone, [0.2, 0.23, 0.35], 2.0) is alone  # 50 ms each way


async def test_a_peer_whose_read_nobody_answered_does_not_say_nobody_declared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A trial: a 10 Mbit/s peer among 1 Gbit/s ones, its link still busy after a round
    cut short, was told "nobody declared in this round; peers meet only with the same
    prefix and gather_window" in rounds where the three others had declared: its read of
    the round asked other nodes and heard from none, and got only its own copy. Here its
    link is far (5 s each way): every request it sends outlasts the request timeout."""
    with trio.fail_after(120):
        async with memnet_swarm(3, first_seed=40) as (net, nodes):
            members = make_members(nodes, 100, fast_config())
            net.slow_host(host_of(2), 5.0)
            results = await step_all(members, timeout=20.0)
    slow = results[2][0]
    assert slow is not None and slow.outcome is Outcome.ALONE
    assert "nobody declared" not in slow.note
    assert slow.note.startswith(
        "no partner (none of the nodes our read of this round asked answered: a busy or "
        "slow link, ours or theirs, or nodes that left?)"
    )
    np.testing.assert_array_equal(members[2].array, members[2].data)


async def test_a_leader_the_others_grouped_without_says_what_it_can_tell(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A grid trial (1 step in 240): a peer whose declaration the others' reads missed led
    its group by its own read, nobody joined, and its note said only "nobody joined".
    (Where it does not rank first in its own read, it joins the others' leader, which
    takes it: first_seed 4 makes it the leader here.)"""
    with trio.fail_after(60):
        async with memnet_swarm(3, first_seed=4) as (_, nodes):
            members = make_members(nodes, 64, fast_config())
            hidden = str(nodes[0].peer_id)
            for node in nodes[1:]:  # their reads miss the first peer's declaration
                read = node.dht.read_entries

                async def without(key: str, *, latest: bool = True, read: Any = read) -> Any:
                    got = await read(key, latest=latest)
                    entries = {k: v for k, v in got.entries.items() if k != hidden}
                    return replace(got, entries=entries)

                node.dht.read_entries = without  # type: ignore[method-assign]
            results = await step_all(members, timeout=10.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    first = infos[0]
    assert first is not None and first.outcome is Outcome.ALONE
    assert first.note.startswith("nobody joined: we led 2 other peer(s) by our read of the")
    assert "grouped without us, or be gone" in first.note
    assert all(i is not None and i.outcome is Outcome.AVERAGED for i in infos[1:])


async def test_a_lone_peer_whose_node_knows_nobody_is_told_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A churn trial's newcomer joined through a bootstrap node restarted a moment before
    (it knew nobody yet) and read only "no partner" for two steps."""
    with trio.fail_after(60):
        async with memnet_swarm(1) as (_, nodes):
            (member,) = make_members(nodes, 100, fast_config())
            info = await member.averager.step(timeout=10.0)
    assert info.outcome is Outcome.ALONE
    assert info.note == (
        "no partner (this node knows no other peer in the DHT: none joined yet, all left, "
        "or our link was too busy to answer their pings)"
    )


async def test_bandwidth_sizes_parts_and_client_mode_gets_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            configs = [
                fast_config(bandwidth=1.0),
                fast_config(bandwidth=3.0),
                fast_config(bandwidth=1.0),
                fast_config(client_mode=True),
            ]
            rng = np.random.default_rng(5)
            members = make_members(nodes, 1 << 16, configs[0])
            for m, config in zip(members, configs, strict=True):
                m.averager.close()
                m.averager = Averager(m.averager.node, "t/bw", [m.array], config=config)
                m.data = rng.standard_normal(1 << 16).astype(np.float32)
                m.array[:] = m.data
            results = await step_all(members, timeout=30.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    info = infos[0]
    assert info is not None and info.outcome is Outcome.AVERAGED
    assert len(info.parts) == 3  # the client-mode peer reduces nothing
    reducers = {p.reducer: p.size for p in info.parts}
    assert members[3].peer_id not in reducers
    ideal = {0: (1 << 16) / 5, 1: 3 * (1 << 16) / 5, 2: (1 << 16) / 5}
    for i, share in ideal.items():  # boundaries fall on multiples of 4096 elements
        assert abs(reducers[members[i].peer_id] - share) <= 4096
    assert all(p.status is PartStatus.ALL for p in info.parts)


async def test_tiny_vector_with_empty_parts(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(5) as (_, nodes):
            members = make_members(nodes, 3, fast_config())
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    for info in infos:
        assert info is not None and info.outcome is Outcome.AVERAGED
        assert sorted(p.size for p in info.parts) == [0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("codec", "weights", "scale"),
    [
        ("none", (1.0, 1.0), 1.2e38),  # the weighted sum overflowed float32
        ("float16", (1.0, 1.0), 3e4),  # ... or float16, where the mean still fits it
        ("int8", (1.0, 1.0), 1.2e38),
        ("none", (1e20, 1e20), 1e20),  # weight x value overflowed
        ("none", (1e300, 1e300), 1.0),  # weights beyond float32
        ("none", (1e-46, 1e-40), 1.0),  # ... and below it
        ("none", (1e-300, 1e300), 1.0),
    ],
)
async def test_extreme_values_and_weights_average_to_the_weighted_mean(
    autojump_clock: trio.testing.MockClock, codec: str, weights: tuple[float, ...], scale: float
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, 10_000, fast_config(codec=codec))
            rng = np.random.default_rng(3)
            for i, (m, weight) in enumerate(zip(members, weights, strict=True)):
                m.weight = weight
                m.data = (scale * (i + 1) * rng.uniform(0.5, 1.0, 10_000)).astype(np.float32)
                m.array[:] = m.data
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos, codec=codec)  # type: ignore[arg-type]
    for info in infos:
        assert info is not None and info.outcome is Outcome.AVERAGED, info
    for m in members:
        assert np.isfinite(m.array).all()


async def test_weights_no_group_can_sum_are_refused_by_step_and_on_the_wire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two members of weight 1e308 made each reducer's exact sum of the weights (math.fsum)
    overflow, and every member's step raise OverflowError, a third member's of weight 1
    too. A weight above 1e300 is now refused: by step(), and in a declaration read from
    another peer (one that skips the check, as another implementation might)."""
    with trio.fail_after(60):
        async with memnet_swarm(5) as (_, nodes):
            members = make_members(nodes, 3000, fast_config())
            with pytest.raises(ValueError, match=r"weight must be at most 1e\+300"):
                await members[0].averager.step(weight=1e301, timeout=5.0)
            honest, heavy = members[:3], members[3:]
            infos: dict[int, Any] = {}

            async def run(index: int, weight: float) -> None:
                averager = members[index].averager
                deadline = trio.current_time() + 20.0
                infos[index] = await averager._step(weight, 0, deadline)  # no argument check

            async with trio.open_nursery() as nursery:
                for i in range(len(members)):
                    nursery.start_soon(run, i, 1e308 if members[i] in heavy else members[i].weight)
    honest_infos = [infos[i] for i in range(len(honest))]
    verify_round(honest, honest_infos)
    for info in honest_infos:
        assert info.outcome is Outcome.AVERAGED, info
        assert set(info.group) == {m.averager.node.peer_id for m in honest}
    for i in range(len(honest), len(members)):  # nobody groups with a malformed declaration
        assert infos[i].outcome in (Outcome.ALONE, Outcome.UNCONFIRMED), infos[i]


@pytest.mark.parametrize(
    ("dtype", "top", "beside"),
    [(torch.float16, 65504.0, 65600.0), (torch.bfloat16, 3.3895313892515355e38, 3.4e38)],
)
async def test_codec_error_past_a_narrow_dtypes_largest_value_saturates_there(
    autojump_clock: trio.testing.MockClock, dtype: torch.dtype, top: float, beside: float
) -> None:
    """A float16 tensor of 65504s beside a float32 65600 in one chunk. When int8 blocks
    spanned tensors (before wire v7), 65504 decoded as 127 x 65600/127 = 65600 (within
    int8's error) and float16 made that infinite, in a part reported `all`; so what a
    codec's error takes past a dtype's largest value stays there. Now each tensor has its
    own blocks and 65504 comes back as itself (bfloat16 likewise)."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            tensors = [
                [torch.full((1,), beside), torch.full((3,), top, dtype=dtype)] for _ in nodes
            ]
            averagers = [
                Averager(node, "t/x", pair, codec="int8", config=fast_config())
                for node, pair in zip(nodes, tensors, strict=True)
            ]
            infos: list[Any] = [None, None]

            async def one(i: int) -> None:
                infos[i] = await averagers[i].step(timeout=20.0)

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
    for info, (_, narrow) in zip(infos, tensors, strict=True):
        assert info.outcome is Outcome.AVERAGED and info.averaged_fraction == 1.0, info
        assert torch.isfinite(narrow).all(), narrow
        assert (narrow.float() == top).all(), narrow


async def test_topk_values_whose_owed_remainder_overflows_are_reported_not_warned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """topk: values above half of float32's largest, written again before each step, plus
    the remainder still owed from the last round overflow to infinity. numpy's overflow
    warning escaped step(), which raised it under -W error (this suite's setting); the
    infinities are now dropped as non-finite like any others, and the step reports it."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            config = fast_config(codec_params={"fraction": 0.01})
            arrays = [np.empty(1000, np.float32) for _ in nodes]
            averagers = [
                Averager(node, "t/x", [array], codec="topk", config=config)
                for node, array in zip(nodes, arrays, strict=True)
            ]
            for round_index in range(2):
                for i, array in enumerate(arrays):
                    array[:] = 2e38 + 5e37 * i
                infos: list[Any] = [None, None]

                async def one(i: int, out: list[Any]) -> None:
                    out[i] = await averagers[i].step(timeout=20.0)

                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(one, i, infos)
                expected = Outcome.AVERAGED if round_index == 0 else Outcome.FAILED
                for info in infos:
                    assert info.outcome is expected, info
                    if expected is Outcome.FAILED:
                        assert set(info.dropped.values()) == {DropReason.NONFINITE}


async def test_a_mean_beyond_float16_is_reported_as_an_overflow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """float16 cannot carry 1.2e38: each peer's upload is dropped as nonfinite, and each
    reducer's mean (its own float32 values) cannot be sent back. Nobody is blamed for
    garbage, no part claims a result, and every tensor keeps its own values."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, 10_000, fast_config(codec="float16"))
            for i, m in enumerate(members):
                m.data = np.full(10_000, 1.2e38 * (i + 1), np.float32)
                m.array[:] = m.data
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos, codec="float16")  # type: ignore[arg-type]
    for member, info in zip(members, infos, strict=True):
        assert info is not None and info.outcome is Outcome.FAILED
        assert DropReason.GARBAGE not in info.dropped.values()
        for part in info.parts:
            assert part.status is PartStatus.NONE and part.contributors == ()
            assert "overflows float16" in part.note
        np.testing.assert_array_equal(member.array, member.data)


async def test_topk_results_are_made_a_chunk_at_a_time_between_checkpoints(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reducer made all of its part's topk result blobs in one go, without a checkpoint:
    ~0.6 s of a 5.6M-element part with the event loop held, and steps ran past their
    timeout (an outside tester). Each chunk's blob now comes in a task step of its own."""
    import sys

    from training.averaging import reducing

    steps: dict[Any, int] = {}

    class CountSteps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            steps[task] = steps.get(task, 0) + 1

    made: list[tuple[Any, int]] = []
    encode = reducing.TopKCodec.encode

    def counted(self: Any, values: Any) -> bytes:
        if sys._getframe(1).f_code.co_name == "_sparse_results":  # (not the uploads)
            task = trio.lowlevel.current_task()
            made.append((task, steps.get(task, 0)))
        return encode(self, values)

    monkeypatch.setattr(reducing.TopKCodec, "encode", counted)
    trio.lowlevel.add_instrument(CountSteps())
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            config = fast_config(codec_params={"fraction": 0.1})  # chunks of 1024 values
            averagers = [
                Averager(
                    node,
                    "t/x",
                    [np.random.default_rng(i).standard_normal(8192, np.float32)],
                    codec="topk",
                    config=config,
                )
                for i, node in enumerate(nodes)
            ]
            infos = await step_averagers(averagers)
    assert all(info.outcome is Outcome.AVERAGED for info in infos), infos
    by_task: dict[Any, list[int]] = {}
    for task, step in made:
        by_task.setdefault(task, []).append(step)
    assert by_task and all(len(s) >= 4 for s in by_task.values()), by_task  # 4 chunks a part
    for task_steps in by_task.values():
        assert len(set(task_steps)) == len(task_steps), task_steps  # no two in one step
