"""Matchmaking on the memory network (virtual time): stragglers, layouts, lost leaders."""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import math
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
import trio
from test_averaging_support import (
    fast_config,
    host_of,
    make_members,
    memnet_swarm,
    slow_joins,
    step_all,
    verify_round,
    virtual_clock,
)

from peer import Peer, open_peer
from peer.netclock import wall_clock
from protocol.address import Address
from training import Averager, AveragerConfig, AveragingInfo, LayoutMismatchError, Outcome
from training.averaging.arguments import check_prefix, check_step_arguments
from training.averaging.grouping import Declaration, rank_key, round_closing_after, round_key
from training.averaging.layout_check import MAX_FOREIGN_LAYOUTS
from training.averaging.match_notes import _with_refused
from training.averaging.messages import method_prefix
from training.averaging.round_state import MatchResult


async def test_peers_arriving_within_half_a_window_meet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, 4096, fast_config(gather_window=2.0))
            infos = [None] * 4
            # land just before a slot boundary, so that late arrivals must join an open round
            await trio.sleep(2.0 - (trio.current_time() % 2.0) + 1.2)

            async def one(i: int, delay: float) -> None:
                await trio.sleep(delay)
                infos[i] = await members[i].averager.step(members[i].weight, timeout=20.0)  # type: ignore[call-overload]

            async with trio.open_nursery() as nursery:
                for i, delay in enumerate([0.0, 0.3, 0.5, 0.6]):
                    nursery.start_soon(one, i, delay)
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(info.outcome is Outcome.AVERAGED and len(info.group) == 4 for info in infos)  # type: ignore[attr-defined]


async def test_peers_split_by_a_slot_boundary_meet_in_the_next_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that arrives early in a slot declares there; one arriving in the slot's last
    eighth declares in the next. The first, alone when its round closes although it had
    partners before, follows into the next round instead of giving up for this step."""
    window = 2.0
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, 4096, fast_config(gather_window=window))
            first = await step_all(members, timeout=20.0)
            assert all(info.outcome is Outcome.AVERAGED for info, _ in first)  # type: ignore[union-attr]
            for m in members:
                m.data = m.array.copy()  # what each holds now is its next contribution
            await trio.sleep(window - (trio.current_time() % window))  # at a boundary
            infos = [None, None]

            async def one(i: int, delay: float) -> None:
                await trio.sleep(delay)
                infos[i] = await members[i].averager.step(members[i].weight, timeout=20.0)  # type: ignore[call-overload]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, 0.2)  # 1.8 s before the close: this round
                nursery.start_soon(one, 1, window - 0.1)  # 0.1 s before: the next one
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(info.outcome is Outcome.AVERAGED and len(info.group) == 2 for info in infos)  # type: ignore[attr-defined]
    assert infos[0].round == infos[1].round  # type: ignore[attr-defined]


async def test_layout_mismatch_is_a_clear_error_and_others_still_average(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors = await _three_average_beside_an_odd_one(
        fast_config(),
        lambda node: Averager(node, "t/x", [np.zeros(999, np.float32)], config=fast_config()),
    )
    assert len(errors) == 1 and "layout" in str(errors[0])


@pytest.mark.parametrize("change", [{"max_staleness": 0}, {"staleness_decay": 1.0}])
async def test_another_staleness_rule_is_a_layout_mismatch(
    autojump_clock: trio.testing.MockClock, change: dict[str, object]
) -> None:
    # Each reducer weighs its part by its own rule: mixed rules weighed the parts of one
    # vector differently, and a reducer with a larger S waited until the cutoff for a
    # sender that counted itself stale by its smaller S and sent nothing.
    errors = await _three_average_beside_an_odd_one(
        fast_config(),
        lambda node: Averager(
            node, "t/x", [np.zeros(1000, np.float32)], config=fast_config(**change)
        ),
    )
    assert len(errors) == 1 and "staleness rule" in str(errors[0])


async def _three_average_beside_an_odd_one(
    config: AveragerConfig, make_odd: Callable[[Peer], Averager]
) -> list[LayoutMismatchError]:
    """Three peers of 1000 elements and ``config`` step beside ``make_odd``'s averager:
    they average among themselves (checked here); the odd one's errors are returned."""
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], 1000, config)
            odd = make_odd(nodes[3])
            errors: list[LayoutMismatchError] = []

            async def odd_step() -> None:
                try:
                    await odd.step(timeout=20.0)
                except LayoutMismatchError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(odd_step)
                results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(info.outcome is Outcome.AVERAGED and len(info.group) == 3 for info in infos)  # type: ignore[union-attr]
    return errors


async def test_a_leader_frozen_after_confirming_costs_members_little_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with memnet_swarm(3) as (net, nodes):
            config = fast_config(join_timeout=0.5, stall_timeout=2.0)
            members = make_members(nodes, 1000, config)
            seed = hashlib.sha256(b"t/x|round|0").digest()
            leader = min(range(3), key=lambda i: rank_key(seed, members[i].peer_id))
            lead = members[leader].averager
            original = lead._matchmaker._lead  # type: ignore[attr-defined]

            async def lead_then_freeze(*args: object) -> object:
                net.freeze_host(host_of(leader))  # before any member hears back
                return await original(*args)

            lead._matchmaker._lead = lead_then_freeze  # type: ignore[attr-defined]
            results = await step_all(members, timeout=30.0)
    for i, (info, elapsed) in enumerate(results):
        assert info is not None
        if i == leader:
            continue
        assert info.outcome is Outcome.UNCONFIRMED and info.parts == ()
        assert elapsed < 1.5 + 0.5 + 2.0 + 1.0  # gather + join_timeout + stall, not 30 s
        np.testing.assert_array_equal(members[i].array, members[i].data)


async def test_step_arguments_are_checked(autojump_clock: trio.testing.MockClock) -> None:
    async with memnet_swarm(1) as (_, nodes):
        (member,) = make_members(nodes, 10, fast_config())
        with pytest.raises(ValueError):
            await member.averager.step(weight=0.0)
        with pytest.raises(ValueError):
            await member.averager.step(epoch=-1)
        for bad in (7.0, True, np.int64(-1)):
            with pytest.raises(ValueError, match="non-negative integer"):
                await member.averager.step(epoch=bad)  # type: ignore[arg-type]
        for weight in (True, math.nan, math.inf, "1.0", 10**400, -(10**400)):
            with pytest.raises(ValueError, match="weight"):
                await member.averager.step(weight=weight)  # type: ignore[arg-type]
        for timeout in (math.inf, math.nan, 10**400):
            with pytest.raises(ValueError, match=r"finite number of seconds.*None uses"):
                await member.averager.step(timeout=timeout)
        for timeout in (0.0, -1.0, True):
            with pytest.raises(ValueError, match="timeout"):
                await member.averager.step(timeout=timeout)
        with trio.fail_after(5):  # any integer type will do (numpy's too)
            info = await member.averager.step(epoch=np.int64(7))  # type: ignore[arg-type]
        assert info.epoch == 7 and type(info.epoch) is int
        # The largest epoch the wire takes; beyond, declared as that: a loop's
        # `epoch = max(epoch, info.epoch) + 1` after a round with a peer that declared the
        # largest made every honest loop raise at its next step (an outside tester's trial).
        for big in (2**62 - 1, 2**62, 2**70):
            with trio.fail_after(5):
                info = await member.averager.step(epoch=big)
            assert info.epoch == 2**62 - 1
        with trio.fail_after(5):  # a 0-d torch integer too, as numpy's
            info = await member.averager.step(epoch=torch.tensor(3))  # type: ignore[arg-type]
        assert info.epoch == 3 and type(info.epoch) is int
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member.averager.step)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(RuntimeError):
                await member.averager.step()
        with trio.fail_after(5):  # the caller's deadline is the default timeout
            info = await member.averager.step()
        assert info.outcome is Outcome.ALONE


def check_one(name: str, value: object) -> None:
    """``check_step_arguments`` with ``value`` as argument ``name``, the others valid."""
    arguments: dict[str, object] = {"weight": 1.0, "epoch": 0, "timeout": None, name: value}
    check_step_arguments(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["weight", "epoch", "timeout"])
@pytest.mark.parametrize("value", [True, np.True_, np.array(True), torch.tensor(True)])
def test_a_bool_is_refused_whichever_library_made_it(name: str, value: object) -> None:
    """An outside tester: ``weight=np.True_`` counted as weight 1 where ``True`` was refused."""
    with pytest.raises(ValueError, match=rf"^{name} must be a "):
        check_one(name, value)


@pytest.mark.parametrize("name", ["weight", "epoch", "timeout"])
@pytest.mark.parametrize(
    "value",
    [np.array([2]), np.array([[2]]), torch.tensor([2]), torch.tensor([[2]]), torch.zeros(0)],
    ids=repr,
)
def test_an_array_or_tensor_with_a_dimension_is_refused_even_of_one_element(
    name: str, value: object
) -> None:
    """One rule for numpy and torch (a tester: ``torch.tensor([2.0])`` was a weight,
    ``np.array([2.0])`` "must be a number"): 0-d ones are numbers, the others are not."""
    with pytest.raises(ValueError, match=rf"^{name} must be a single number, got \w+ of shape"):
        check_one(name, value)


@pytest.mark.parametrize("name", ["weight", "epoch", "timeout"])
@pytest.mark.parametrize(
    "value", [np.int64(2), np.array(2), torch.tensor(2), torch.tensor(2, dtype=torch.int32)]
)
def test_numpy_and_torch_integers_with_no_dimension_are_numbers(name: str, value: object) -> None:
    """A tester: ``epoch=torch.tensor(3)`` was refused where ``np.int64(3)`` was taken."""
    check_one(name, value)


@pytest.mark.parametrize("value", [np.float64(2.0), np.array(2.0), torch.tensor(2.0)])
def test_numpy_and_torch_floats_are_weights_and_timeouts_not_epochs(value: object) -> None:
    check_one("weight", value)
    check_one("timeout", value)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
        check_one("epoch", value)


@pytest.mark.parametrize(
    "weight",
    [1e301, 10**400, np.float64(1e301), torch.tensor(1e301, dtype=torch.float64)],
    ids=["1e301", "10**400", "numpy", "torch"],
)
def test_a_weight_beyond_the_limit_is_told_the_limit(weight: object) -> None:
    """A tester: ``10**400`` read "must be a positive finite number" (it is a number, only
    too large), where ``1e301`` named the limit. The message stays short."""
    with pytest.raises(ValueError, match=r"weight must be at most 1e\+300 \(the wire") as info:
        check_one("weight", weight)
    assert len(str(info.value)) < 120


@pytest.mark.parametrize(("scope", "ends"), [(0.3, 0.25), (2.0, 1.8), (20.0, 19.0)])
async def test_without_a_timeout_the_step_ends_before_the_callers_deadline(
    autojump_clock: trio.testing.MockClock, scope: float, ends: float
) -> None:
    """A margin of 10 % of the time left (50 ms to 1 s): the report comes back before the
    caller's cancel scope fires, even for a peer that waits for a round still open."""
    async with memnet_swarm(1) as (_, nodes):
        (member,) = make_members(nodes, 10, fast_config(gather_window=60.0))
        start = trio.current_time()
        info = None
        with trio.move_on_after(scope):
            info = await member.averager.step()
        assert info is not None, "the caller's scope fired first"
        assert info.outcome in (Outcome.ALONE, Outcome.UNCONFIRMED)
        assert trio.current_time() - start == pytest.approx(ends)


async def test_a_prefix_is_free_again_after_close(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, 500, fast_config())
            with pytest.raises(ValueError, match="already open on this node"):
                Averager(nodes[0], "t/x", [np.zeros(500, dtype=np.float32)])
            members[0].averager.close()
            members[0].averager = Averager(
                nodes[0], "t/x", [members[0].array], config=fast_config()
            )
            results = await step_all(members, timeout=20.0)  # the new one serves the prefix
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(info is not None and info.outcome is Outcome.AVERAGED for info in infos)


async def test_a_dropped_averager_is_found_by_prefix_and_closed() -> None:
    """Its node serves it until it is closed, so dropping the last reference does not
    free the prefix (a notebook cell run again after ``del``: refused for good, an outside
    tester); ``Averager.opened`` reaches it."""
    with trio.fail_after(30):
        async with open_peer() as node:
            Averager(node, "t/dropped", [np.zeros(8, dtype=np.float32)])
            gc.collect()
            with pytest.raises(ValueError, match=r"Averager\.opened\(node, prefix\)"):
                Averager(node, "t/dropped", [np.zeros(8, dtype=np.float32)])
            dropped = Averager.opened(node, "t/dropped")
            assert dropped is not None and dropped.prefix == "t/dropped"
            assert Averager.opened(node, "t/other") is None
            dropped.close()
            assert Averager.opened(node, "t/dropped") is None
            again = Averager(node, "t/dropped", [np.zeros(8, dtype=np.float32)])
            assert Averager.opened(node, "t/dropped") is again
            again.close()


async def test_close_during_a_step_lets_the_step_serve_its_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """close() mid-step used to unregister at once: the others got unknown_method for our
    part and waited until the cutoff. Now the step ends normally, then frees the prefix."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 3000, fast_config())
            async with trio.open_nursery() as nursery:
                done: list[list[tuple[AveragingInfo | None, float]]] = []

                async def run() -> None:
                    done.append(await step_all(members, timeout=20.0))

                nursery.start_soon(run)
                await trio.sleep(0.01)  # virtual time: every step has started
                members[0].averager.close()
                with pytest.raises(RuntimeError, match="closed"):
                    await members[0].averager.step()
                # not "already open: close() it first" (a trial had just called close())
                with pytest.raises(ValueError, match=r"closed during a step.*once that step"):
                    Averager(nodes[0], "t/x", [np.zeros(3000, dtype=np.float32)])
            Averager(nodes[0], "t/x", [members[0].array])  # the prefix is free again
    infos = [info for info, _ in done[0]]
    verify_round(members, infos)  # type: ignore[arg-type]
    assert all(info is not None and info.outcome is Outcome.AVERAGED for info in infos)
    assert max(elapsed for _, elapsed in done[0]) < 5.0


def test_a_prefix_that_no_step_could_use_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="prefix must be a str"):
        check_prefix(b"t/x")
    with pytest.raises(ValueError, match="must not be empty"):
        check_prefix("")
    with pytest.raises(ValueError, match="prefix too long"):
        check_prefix("p" * 500)
    assert check_prefix("p" * 400) == "p" * 400
    with pytest.raises(ValueError, match=r"prefix not usable: .*no lone surrogates"):
        check_prefix("runs/\udc80/grads")  # (os.fsdecode of an undecodable name)


def test_the_wall_clock_follows_each_run_and_keeps_nothing_after_it() -> None:
    """The default rendezvous clock: unix time moving with trio's (virtual) clock, its offset
    fixed per run; nothing of a finished run is kept (every run's clock used to be)."""
    readings: list[float] = []

    async def read() -> None:
        first = wall_clock()
        await trio.sleep(1000.0)
        readings.append(wall_clock() - first)

    clocks = []
    for _ in range(3):
        clock = trio.testing.MockClock(autojump_threshold=0)
        trio.run(read, clock=clock)
        clocks.append(weakref.ref(clock))
        del clock
    gc.collect()
    assert readings == [pytest.approx(1000.0, abs=1e-3)] * 3
    assert [ref() for ref in clocks] == [None] * 3


async def test_seven_peers_in_pairs_keep_the_group_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """group_size 2 with an odd count: three pairs average, one peer sits the round out."""
    with trio.fail_after(120):
        async with memnet_swarm(7) as (_, nodes):
            members = make_members(nodes, 500, fast_config(group_size=2))
            results = await step_all(members, timeout=20.0)
    infos = [info for info, _ in results]
    verify_round(members, infos)  # type: ignore[arg-type]
    assert sorted(len(info.group) for info in infos) == [1, 2, 2, 2, 2, 2, 2]  # type: ignore[union-attr]
    assert sum(info.outcome is Outcome.AVERAGED for info in infos) == 6  # type: ignore[union-attr]


async def test_consecutive_steps_in_one_slot_and_a_peer_that_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fast steps reuse a slot's key; what a departed peer left there must not matter."""
    with trio.fail_after(120):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 500, fast_config(gather_window=4.0))
            for _ in range(2):
                results = await step_all(members, timeout=20.0)
                assert {info.round for info, _ in results}.__len__() == 1  # type: ignore[union-attr]
                assert all(info.outcome is Outcome.AVERAGED for info, _ in results)  # type: ignore[union-attr]
            members[2].averager.close()  # leaves: its last declaration stays in the DHT
            for _ in range(2):
                for m in members[:2]:
                    m.data = m.array.copy()
                results = await step_all(members[:2], timeout=20.0)
                infos = [info for info, _ in results]
                verify_round(members[:2], infos)  # type: ignore[arg-type]
                for info, elapsed in results:
                    assert info is not None and info.outcome is Outcome.AVERAGED
                    assert len(info.group) == 2 and elapsed <= 1.5 * 4.0 + 1.0


async def test_a_newcomer_gets_into_a_swarm_whose_groups_are_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Established peers only count peers as far along as they are (rounds done); a
    newcomer catches up on that count, so it is grouped by its next step at the latest."""
    with trio.fail_after(120):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, 600, fast_config(group_size=3))
            for _ in range(2):
                results = await step_all(members[:3], timeout=20.0)
                assert all(info.outcome is Outcome.AVERAGED for info, _ in results)  # type: ignore[union-attr]
            for m in members:
                m.data = m.array.copy()
            outcomes = []
            for _ in range(2):
                results = await step_all(members, timeout=20.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                outcomes.append(infos[3].outcome)  # type: ignore[union-attr]
                for m in members:
                    m.data = m.array.copy()
            assert Outcome.AVERAGED in outcomes
            assert outcomes[-1] is Outcome.AVERAGED


@pytest.mark.parametrize("value", [2.5, True, 1, "4", np.float64(4.0)])
def test_group_size_must_be_an_integer_of_at_least_two(value: object) -> None:
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        AveragerConfig(group_size=value)  # type: ignore[arg-type]
    assert AveragerConfig(group_size=np.int64(3)).group_size == 3  # type: ignore[arg-type]
    assert type(AveragerConfig(group_size=np.int64(3)).group_size) is int  # type: ignore[arg-type]


def test_a_declaration_must_fit_the_dhts_ttl_limit() -> None:
    """A declaration lives 3 gather windows + join_timeout + 30 s in the DHT; beyond a
    week (MAX_TTL) every step raised the DHT's 'ttl must be in (0, 604800]'."""
    with pytest.raises(ValueError, match="at most its 604800 s ttl limit"):
        AveragerConfig(join_timeout=700_000.0)
    with pytest.raises(ValueError, match=r"gather_window=250000\.0"):
        AveragerConfig(gather_window=250_000.0)
    assert AveragerConfig(gather_window=60.0, join_timeout=600.0).gather_window == 60.0


def test_group_size_is_at_most_what_a_confirmation_lists() -> None:
    """A confirmation lists at most 256 members, and every member refuses a longer one: with
    a larger group_size, 257 peers would form a group that could never confirm."""
    assert AveragerConfig(group_size=256).group_size == 256
    with pytest.raises(ValueError, match="group_size must be at most 256"):
        AveragerConfig(group_size=257)


async def test_a_peer_declaring_a_new_layout_every_round_is_remembered_boundedly(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Other layouts are warned about once each, and only so many are remembered: a peer
    that declares another one every round costs neither memory nor a warning per round."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 1000, fast_config())
            odd, declared = nodes[2], itertools.count()

            async def declare_new_layouts() -> None:
                while True:  # in the round open now and the next, as a stepping peer would
                    i = next(declared)
                    decl = Declaration(odd.peer_id, odd.address, 1.0, 0, 1.0, f"x{i}", 0, 1 + i)
                    now = round_closing_after(
                        virtual_clock(), members[0].averager.config.gather_window
                    )
                    for number in (now, now + 1):
                        key = round_key("t/x", number)
                        await odd.dht.store(key, decl.to_wire(), ttl=20.0, subkey=str(odd.peer_id))
                    await trio.sleep(0.2)

            with caplog.at_level(logging.WARNING, logger="training.averaging.matchmaking"):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(declare_new_layouts)
                    # a new layout each round: the bound fills in MAX_FOREIGN_LAYOUTS
                    # rounds, then 8 more rounds must add nothing (unbounded: 24 each)
                    for _ in range(MAX_FOREIGN_LAYOUTS + 8):
                        for info, _elapsed in await step_all(members, timeout=20.0):
                            assert info is not None and info.outcome is Outcome.AVERAGED
                    nursery.cancel_scope.cancel()
    assert next(declared) > 2 * MAX_FOREIGN_LAYOUTS  # far more than are remembered
    for m in members:
        assert len(m.averager._matchmaker._foreign) == MAX_FOREIGN_LAYOUTS
    warned = [r for r in caplog.records if "another tensor layout" in r.getMessage()]
    assert 0 < len(warned) <= 2 * MAX_FOREIGN_LAYOUTS


async def test_a_peer_with_another_group_size_gets_a_layout_mismatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """group_size is part of what must match: a peer of group_size 2 among peers of 16 is
    told so, and is never put in their group (which could exceed its own bound)."""
    errors = await _three_average_beside_an_odd_one(
        fast_config(group_size=16),
        lambda node: Averager(
            node, "t/x", [np.zeros(1000, np.float32)], config=fast_config(group_size=2)
        ),
    )
    assert len(errors) == 1
    assert "group_size 2" in str(errors[0]) and "group_size 16" in str(errors[0])


async def test_two_group_sizes_under_one_prefix_average_apart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two peers of group_size 2 and three of 16 (the tester's case): each kind groups
    with its own, in both rounds, and no group exceeds a member's group_size."""
    with trio.fail_after(120):
        async with memnet_swarm(5) as (_, nodes):
            members = [
                *make_members(nodes[:2], 500, fast_config(group_size=2), seed=1),
                *make_members(nodes[2:], 500, fast_config(group_size=16), seed=2),
            ]
            pairs = {m.peer_id for m in members[:2]}
            for _ in range(2):
                results = await step_all(members, timeout=20.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for member, info in zip(members, infos, strict=True):
                    assert info is not None and info.outcome is Outcome.AVERAGED, info
                    assert len(info.group) <= member.averager.config.group_size
                    assert (set(info.group) == pairs) == (member.peer_id in pairs)
                for m in members:
                    m.data = m.array.copy()


async def test_a_timeout_shorter_than_the_gather_window_is_unconfirmed_not_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both peers declared, but the step's timeout came before the round closed: no group,
    and the report says the timeout did it (``alone`` would say nobody else came)."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            members = make_members(nodes, 100, fast_config(gather_window=2.0))
            await trio.sleep(2.0 - trio.current_time() % 2.0)  # a fresh slot: 1 s to 3 s away
            results = await step_all(members, timeout=0.3)
    for member, (info, elapsed) in zip(members, results, strict=True):
        assert info is not None and elapsed == pytest.approx(0.3)
        assert info.outcome is Outcome.UNCONFIRMED and info.parts == ()
        assert info.note.startswith("the timeout ended the gather window before a group formed")
        np.testing.assert_array_equal(member.array, member.data)


# -- hostile or buggy peers speaking the protocol by hand -----------------------------------


async def test_members_declaring_enormous_bandwidths_do_not_crash_the_leader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bandwidths are any positive finite number: the leader's split of the vector used to
    overflow (``OverflowError`` out of its step) when members declared 1e308 (two of them,
    or one before the last in the group's order). Now they share the vector."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = [
                *make_members(nodes[:1], 3000, fast_config()),
                *make_members(nodes[1:], 3000, fast_config(bandwidth=1e308), seed=1),
            ]
            results = await step_all(members, timeout=20.0)
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            for info in infos:
                assert info is not None and info.outcome is Outcome.AVERAGED
                assert [p.size for p in info.parts if p.reducer == members[0].peer_id] == [0]


async def _declare_in_rounds(node: Peer, value: dict[str, object], rounds: int = 8) -> None:
    """Store ``value`` as ``node``'s declaration in the next ``rounds`` rounds of ``t/x``
    (gather_window 1.0), as any peer of the DHT may."""
    first = round_closing_after(virtual_clock(), 1.0)
    for number in range(first, first + rounds):
        await node.dht.store(round_key("t/x", number), value, ttl=60.0, subkey=str(node.peer_id))


async def test_a_declared_round_count_of_2_62_minus_1_does_not_push_ours_out_of_range(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Peers adopted the largest round count declared (the grid phase). One declaration of
    2**62 - 1 took the count to 2**62 after the next round: beyond what a declaration may
    carry, so that nobody read the peers' declarations any more (here each saw only the odd
    peer, and its step raised LayoutMismatchError). Counts wrap; and now the phase is the
    median count of our own layout's peers, so the odd peer does not move ours at all."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 3000, fast_config())
            odd = {
                "address": nodes[2].address, "weight": 1.0, "epoch": 0, "bandwidth": 1.0,
                "client_mode": False, "layout": "another", "count": 2**62 - 1,
            }  # fmt: skip
            await _declare_in_rounds(nodes[2], odd)
            for number in range(1, 5):
                results = await step_all(members, timeout=20.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for info in infos:
                    assert info is not None and info.outcome is Outcome.AVERAGED, info
                for m in members:  # a count of another layout is no phase of ours
                    assert m.averager._count == number
                    m.data = m.array.copy()


async def test_one_member_declaring_huge_round_counts_moves_nobody_elses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A member that declares a count of its own choosing every round (here 2**40, its
    averaging otherwise honest) used to set every peer's grid phase, and with it who led
    (a hostile one chose to lead every round and refuse every join). The phase is now the
    lower median of the counts: the three others keep theirs, one more per round, and the
    groups are the ones their counts give."""
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes, 3000, fast_config())
            odd = members[3].averager
            for number in range(1, 5):
                odd._count = 2**40
                results = await step_all(members, timeout=20.0)
                infos = [info for info, _ in results]
                verify_round(members, infos)  # type: ignore[arg-type]
                for info in infos:
                    assert info is not None and info.outcome is Outcome.AVERAGED, info
                    assert len(info.group) == 4
                for m in members[:3]:
                    assert m.averager._count == number
                for m in members:
                    m.data = m.array.copy()


async def test_an_unexpected_joiner_cannot_take_the_place_of_an_expected_member(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A leader accepts joiners it did not expect while it has room; that room no longer
    includes the places of the members it expects. Here the group is full (3 of 3) and the
    members' joins are a little slow: an intruder (a peer without an averager, copying the
    layout) used to get the place of one of them, leaving it out of the round. Now the
    intruder is told ``full``."""
    with trio.fail_after(60):
        async with memnet_swarm(4) as (_, nodes):
            members = make_members(nodes[:3], 3000, fast_config(group_size=3))
            intruder = nodes[3]
            for m in members:  # connected beforehand: its join arrives at once
                await intruder.rpc.connect(Address.parse(m.averager.node.address))
            for m in members:  # (the leader calls no join)
                slow_joins(m.averager.node, 0.3)  # within the leader's join_timeout (0.5 s)
            replies: list[object] = []

            async def intrude() -> None:
                while True:
                    for m in members:
                        state = m.averager._matchmaker.current
                        if state is not None and state.is_leader:
                            assert state.me.address is not None
                            body = {
                                "round": state.number,
                                "decl": dict(state.me.to_wire(), address=intruder.address),
                            }
                            method = f"{method_prefix('t/x')}.join"
                            reply = await intruder.rpc.call(
                                Address.parse(state.me.address), method, body
                            )
                            replies.append(reply.body)
                            return
                    await trio.sleep(0.001)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(intrude)
                results = await step_all(members, timeout=20.0)
            assert replies == [{"status": "full"}]
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            for info, elapsed in results:
                assert info is not None and info.outcome is Outcome.AVERAGED, info
                assert elapsed < 2.0


async def test_client_mode_peers_alone_together_are_told_so_even_after_a_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two client-mode peers cannot average (neither can reduce a part). One that averaged
    with a server-mode peer before must not close the round early with the other client
    (then follow into the next round): its "done" marker told the other it had found a
    group. Both wait for the close and say why they are alone (docs audit)."""
    async with memnet_swarm(3) as (_, nodes):
        server = Averager(nodes[0], "t/x", [np.zeros(8, np.float32)], config=fast_config())
        clients = [
            Averager(node, "t/x", [np.ones(8, np.float32)], config=fast_config(client_mode=True))
            for node in nodes[1:]
        ]
        with trio.fail_after(60):
            first = await step_averagers([server, clients[0]], timeout=10.0)
            assert [info.outcome for info in first] == [Outcome.AVERAGED] * 2, first
            server.close()
            second = await step_averagers(clients, timeout=10.0)
        for info in second:
            assert info.outcome is Outcome.ALONE
            assert "all client-mode like us" in info.note, info.note
            assert "finished matchmaking" not in info.note, info.note
        assert second[0].round == second[1].round


async def step_averagers(averagers: list[Averager], timeout: float) -> list[AveragingInfo]:  # noqa: ASYNC109
    infos: dict[int, AveragingInfo] = {}

    async def one(i: int) -> None:
        infos[i] = await averagers[i].step(timeout=timeout)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return [infos[i] for i in range(len(averagers))]


def test_a_step_alone_after_a_round_that_left_it_out_still_says_why() -> None:
    """A benched peer tried the next round, found nobody there, and was told only "nobody
    declared in this round; peers meet only with the same prefix and gather_window": a
    hint at a mismatch it did not have (an outside tester)."""
    left_out = MatchResult(
        7, None, None, 4, note="the leader left us out: it benched us: garbage", retry=True
    )
    alone = MatchResult(8, None, None, 1, note="no partner (nobody declared)", alone=True)
    assert _with_refused(alone, left_out).note == (
        "no partner (nobody declared); before that, round 7: the leader left us out: it "
        "benched us: garbage"
    )
    assert _with_refused(left_out, left_out) is left_out  # its own round: said already
    assert _with_refused(alone, None) is alone


@pytest.mark.parametrize("seed", [1, 50])
async def test_two_peers_stepping_two_prefixes_in_turn_out_of_phase_still_meet(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Each peer steps prefix a, then b, then a...; the second starts a slot after the
    first, so each is alone in every slot (a at even slots for one, odd for the other: an
    outside tester's loop stayed so for 8 iterations in 4 runs of 6). After two lone steps
    of a prefix, a lone peer that sees a peer of its layout in the rounds before follows
    into the next round on a coin toss, until the two share a slot (fixed identities: the
    coins are a hash of PeerID and round; over 29 seeds the pair averaged 0 to 8 of its 12
    steps, 6.9 on average, and in 28 of them 3 or more)."""
    window = 2.0
    config = fast_config(gather_window=window)
    with trio.fail_after(120):
        async with memnet_swarm(2, first_seed=seed) as (_, nodes):
            pairs = [
                [Averager(node, p, [np.ones(4096, np.float32) * i], config=config) for p in "ab"]
                for i, node in enumerate(nodes)
            ]
            outcomes: list[list[Outcome]] = [[], []]

            async def loop(i: int, start: float) -> None:
                await trio.sleep_until(start)
                for _ in range(6):
                    for averager in pairs[i]:
                        info = await averager.step(timeout=30.0)
                        outcomes[i].append(info.outcome)

            slot = (trio.current_time() // window + 1) * window  # the next slot's start
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop, 0, slot + 0.1)
                nursery.start_soon(loop, 1, slot + window + 0.1)
    # in step after a slot or two (the second peer's last steps, once the first is done,
    # are alone again)
    assert all(o.count(Outcome.AVERAGED) >= 4 for o in outcomes), outcomes


async def _loops_with_work(seed: int, slots: tuple[int, ...], work: float) -> list[list[Outcome]]:
    """One Averager per peer (prefix ``a``, gather_window 2 s), each peer starting at its
    slot of ``slots`` from the next slot's start, stepping 10 times with ``work`` seconds
    between steps; returns each peer's outcomes."""
    window = 2.0
    config = fast_config(gather_window=window)
    outcomes: list[list[Outcome]] = [[] for _ in slots]
    with trio.fail_after(300):
        async with memnet_swarm(len(slots), first_seed=seed) as (_, nodes):
            averagers = [
                Averager(node, "a", [np.ones(4096, np.float32) * i], config=config)
                for i, node in enumerate(nodes)
            ]

            async def loop(i: int, start: float) -> None:
                await trio.sleep_until(start)
                for _ in range(10):
                    info = await averagers[i].step(timeout=30.0)
                    outcomes[i].append(info.outcome)
                    await trio.sleep(work)

            slot = (trio.current_time() // window + 1) * window  # the next slot's start
            async with trio.open_nursery() as nursery:
                for i, offset in enumerate(slots):
                    nursery.start_soon(loop, i, slot + offset * window + 0.1)
    return outcomes


@pytest.mark.parametrize("seed", [1, 50])
async def test_two_peers_with_long_work_between_steps_a_slot_apart_fall_into_step(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """8 s of work between steps (gather_window 2 s: a step every 5 rounds), the second
    peer starting a slot after the first: each is alone in every round until one follows.
    The one that sees the other further back than half its cadence follows (the other sees
    it nearer and stays), a round per lone step, and they meet when the follower comes
    from 4 rounds back (a look-back fixed at 3 rounds and a coin never met: 0 of 20 steps
    averaged, a review)."""
    outcomes = await _loops_with_work(seed, (0, 1), work=8.0)
    # (16 of 20 with either seed: alone for the first steps, then in step for good)
    assert all(o.count(Outcome.AVERAGED) >= 6 for o in outcomes), outcomes
    assert all(o[-4:] == [Outcome.AVERAGED] * 4 for o in outcomes), outcomes


@pytest.mark.parametrize("seed", [1, 50])
async def test_three_peers_spread_over_their_cadence_fall_into_step(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """8 s of work between steps (a step every 5 rounds), the peers starting at slots 0, 1
    and 3: each is alone in every round, and each sees the one before it less than half a
    cadence back (2, 1 and 2 rounds). Comparing that gap with half a cadence had all three
    stay for good (0 of 30 steps averaged, a review); the one whose gap before is wider
    than its gap after (the first: 2 against 1) follows."""
    outcomes = await _loops_with_work(seed, (0, 1, 3), work=8.0)
    assert all(o.count(Outcome.AVERAGED) >= 4 for o in outcomes), outcomes


async def test_a_loop_that_adopts_the_largest_epoch_a_peer_declared_goes_on_averaging(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer declaring epoch 2**62 - 1 (the largest a declaration carries) left the others'
    ``epoch = max(epoch, info.epoch) + 1`` at 2**62, which every later step refused: one
    peer stopped every honest training loop of the swarm. Declared as 2**62 - 1, the next
    step averages all three, none stale."""
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes, 300, fast_config())
            members[0].epoch = 2**62 - 1
            first = await step_all(members, timeout=10.0)
            for m, (info, _) in zip(members, first, strict=True):
                assert info is not None and info.epoch == 2**62 - 1, info
                m.epoch = max(m.epoch, info.epoch) + 1  # the README's loop
                m.data = m.array.copy()
            results = await step_all(members, timeout=10.0)
            infos = [info for info, _ in results]
            verify_round(members, infos)  # type: ignore[arg-type]
            for info in infos:
                assert info is not None and info.outcome is Outcome.AVERAGED, info
                assert info.epoch == 2**62 - 1 and not info.dropped, info
