"""A researcher's training loop, as the docs lead one to write it: a torch model whose
gradients (or parameters) are averaged every step, on the memory network (virtual time)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import trio
from test_averaging_support import fast_config, memnet_swarm

from peer import MemoryNetwork, Peer, Reply, Request, run_in_background
from training import Averager, AveragingInfo, Outcome

IN, OUT, BATCH = 6, 1, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights, as data parallelism does
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, OUT))


def batches(n: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` lists of one batch per peer."""
    gen = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen))
         for _ in range(n)]
        for _ in range(steps)
    ]  # fmt: skip


def backward(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()


async def step_together(averagers: list[Averager]) -> list[AveragingInfo]:
    infos: list[AveragingInfo | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        infos[i] = await averagers[i].step(weight=float(BATCH), timeout=10.0)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    assert all(info is not None for info in infos)
    return infos  # type: ignore[return-value]


async def test_gradient_averaging_trains_like_one_process_with_the_whole_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Data parallelism: averaged gradients of equal batches are the whole batch's gradient,
    so every peer's model follows one model trained on all the batches at once."""
    n, steps = 3, 4
    data = batches(n, steps)
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with trio.fail_after(120):
        async with memnet_swarm(n) as (_, nodes):
            models = [make_model() for _ in nodes]
            opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
            averagers: list[Averager] = []
            for step in range(steps):
                for model, opt, batch in zip(models, opts, data[step], strict=True):
                    opt.zero_grad(set_to_none=False)  # keep the tensors the averager holds
                    backward(model, batch)
                if not averagers:  # the grads exist after the first backward
                    averagers = [
                        Averager(node, "t/grads", [p.grad for p in m.parameters()],
                                 config=fast_config())
                        for node, m in zip(nodes, models, strict=True)
                    ]  # fmt: skip
                infos = await step_together(averagers)
                assert all(info.outcome is Outcome.AVERAGED for info in infos)
                for opt in opts:
                    opt.step()
                ref_opt.zero_grad()
                x = torch.cat([b[0] for b in data[step]])
                y = torch.cat([b[1] for b in data[step]])
                backward(reference, (x, y))
                ref_opt.step()
    for model in models:
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


async def test_grads_replaced_by_zero_grad_are_flagged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``zero_grad()`` (set_to_none=True, torch's default) drops the .grad tensors given to
    the averager, and backward makes new ones: the averager kept averaging the dropped
    tensors and reported 100 %, while the optimizer used the local gradients."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            models = [make_model() for _ in nodes]
            data = batches(2, 2)
            for model, batch in zip(models, data[0], strict=True):
                backward(model, batch)
            averagers = [
                Averager(node, "t/grads", [p.grad for p in m.parameters()], config=fast_config())
                for node, m in zip(nodes, models, strict=True)
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the live grads are averaged: no warning
                await step_together(averagers)
            for model, batch in zip(models, data[1], strict=True):
                model.zero_grad()
                backward(model, batch)
            with pytest.warns(RuntimeWarning, match=r"zero_grad\(set_to_none=False\)"):
                await step_together(averagers)


async def _one_averager(node: Peer, tensors: object) -> None:
    Averager(node, "t/x", tensors, config=fast_config())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (torch.zeros(1000), r"got one Tensor: pass \[tensor\]"),
        (torch.zeros(3, 4).numpy(), r"got one ndarray"),
        ({"weight": torch.zeros(3)}, r"state_dict"),
        ([torch.zeros(3), None], r"tensor 1 is None .*\.grad before the first backward"),
    ],
    ids=["tensor", "array", "state_dict", "none-grad"],
)
async def test_what_a_user_may_pass_instead_of_a_list_is_a_clear_error(
    autojump_clock: trio.testing.MockClock, tensors: object, message: str
) -> None:
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(TypeError, match=message):
                await _one_averager(nodes[0], tensors)


def _frozen_bias_grads() -> list[torch.Tensor | None]:
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    model(torch.ones(2, 4)).sum().backward()
    return [p.grad for p in model.parameters()]


def _sparse_embedding_grad() -> list[torch.Tensor | None]:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    return [embedding.weight.grad]


@pytest.mark.parametrize(
    ("tensors", "error", "message"),
    [
        (_frozen_bias_grads, TypeError, r"frozen parameter .*if p\.requires_grad"),
        (
            lambda: list(torch.nn.Linear(4, 3, device="meta").parameters()),
            ValueError,
            r"on meta .*to_empty\(device='cpu'\)",
        ),
        (_sparse_embedding_grad, ValueError, r"sparse_coo.*sparse=False"),
    ],
    ids=["frozen-parameter-grad", "meta-parameters", "sparse-grad"],
)
async def test_what_a_real_model_may_hand_over_is_refused_with_the_way_out(
    autojump_clock: trio.testing.MockClock,
    tensors: Callable[[], list[torch.Tensor | None]],
    error: type[Exception],
    message: str,
) -> None:
    """A frozen layer's ``.grad`` stays None through every backward, so "run a backward
    first" was no way out; ``.to("cpu")`` fails on meta parameters; a sparse gradient
    named no fix (an outside tester, a DDP user)."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(error, match=message):
                await _one_averager(nodes[0], tensors())


async def test_a_transposed_weight_is_refused_with_what_to_pass_instead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            weight = torch.nn.Linear(4, 3).weight
            with pytest.raises(ValueError, match=r"not contiguous .*the parameter itself"):
                await _one_averager(nodes[0], [weight.t()])


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.asfortranarray(np.ones((3, 4), np.float32)), r"numpy array in Fortran order"),
        (np.ones((3, 4), np.float32)[:, ::2], r"numpy array in a strided view"),
        (np.ones((3, 4), np.float32).T, r"numpy array in Fortran order"),
    ],
    ids=["fortran", "step-slice", "transpose"],
)
async def test_a_non_c_order_numpy_array_is_refused_with_numpy_advice(
    autojump_clock: trio.testing.MockClock, array: np.ndarray, message: str
) -> None:
    """The advice is numpy's (np.ascontiguousarray), not torch's .contiguous() (a trial)."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(ValueError, match=message) as caught:
                await _one_averager(nodes[0], [np.zeros(2, np.float32), array])
            assert "tensor 1" in str(caught.value)
            assert "np.ascontiguousarray" in str(caught.value)
            assert "torch" not in str(caught.value)


async def test_parameters_generator_and_mixed_dtypes_average_in_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``model.parameters()`` (a generator of leaf tensors that require grad), float64 and
    bfloat16 tensors and a numpy array: averaged in place, dtypes kept, autograd intact."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            models, extras = [], []
            for i in range(2):
                model = torch.nn.Linear(3, 2)
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(float(i))
                models.append(model)
                extras.append([
                    torch.full((5,), 2.0 * i, dtype=torch.float64),
                    torch.full((4,), 1.0 + i, dtype=torch.bfloat16),
                    np.full(3, 4.0 * i, dtype=np.float16),
                ])  # fmt: skip
            averagers = [
                Averager(node, "t/mixed", [*m.parameters(), *extra], config=fast_config())
                for node, m, extra in zip(nodes, models, extras, strict=True)
            ]
            infos = await step_together(averagers)
    assert all(info.averaged_fraction == 1.0 for info in infos)
    for model, extra in zip(models, extras, strict=True):
        for p in model.parameters():
            assert p.requires_grad and p.is_leaf and torch.all(p == 0.5)
        assert extra[0].dtype == torch.float64 and torch.all(extra[0] == 1.0)
        assert extra[1].dtype == torch.bfloat16 and torch.all(extra[1] == 1.5)
        assert extra[2].dtype == np.float16 and np.all(extra[2] == 2.0)
        model(torch.zeros(1, 3)).sum().backward()  # still a working leaf


async def test_a_peer_left_out_of_the_groups_is_told_why_not_that_nobody_came(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two client-mode peers declare together but cannot average (neither reduces a part);
    with ``group_size=2`` one of three peers sits out. Both were reported "no partner", as
    if nobody else had come."""
    with trio.fail_after(60):
        async with memnet_swarm(5) as (_, nodes):
            clients = [
                Averager(node, "t/clients", [np.ones(10, np.float32)],
                         config=fast_config(client_mode=True))
                for node in nodes[:2]
            ]  # fmt: skip
            for info in await step_together(clients):
                assert info.outcome is Outcome.ALONE
                assert "1 other peer(s) declared, all client-mode like us" in info.note
            pairs = [
                Averager(node, "t/pairs", [np.ones(10, np.float32)], group_size=2,
                         config=fast_config())
                for node in nodes[2:]
            ]  # fmt: skip
            infos = await step_together(pairs)
    (odd,) = [info for info in infos if info.outcome is Outcome.ALONE]
    assert "2 other peer(s) declared, and the groups (at most 2) left us out" in odd.note
    assert sum(info.outcome is Outcome.AVERAGED for info in infos) == 2


@pytest.mark.parametrize("method", ["step_blocking", "step"])
def test_the_blocking_step_warns_at_the_callers_line_too(method: str) -> None:
    """The same trap in a plain script (``run_in_background`` + ``step_blocking``, or
    ``step`` without ``await``): the warning points at the script's line, not into the
    peer's thread."""
    net = MemoryNetwork()
    model = make_model()
    backward(model, batches(1, 1)[0][0])
    config = fast_config(clock=None, gather_window=0.2, join_timeout=0.1)
    with run_in_background(listen="10.0.0.1:1000", network=net.interface("10.0.0.1")) as node:
        averager = Averager(node, "t/grads", [p.grad for p in model.parameters()], config=config)
        model.zero_grad()  # set_to_none=True: the averager's tensors are dropped
        with pytest.warns(RuntimeWarning, match="referenced by nothing but this averager") as seen:
            info = getattr(averager, method)(timeout=2.0)
        averager.close()
    assert info.outcome is Outcome.ALONE
    assert seen[0].filename == __file__


async def test_a_joiner_told_full_tries_the_next_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A leader whose group is full answers an unexpected joiner ``full`` (its view of the
    round differed: e.g. a peer stepping again in the slot it just averaged in reads the
    leader's declaration before the leader's "done" marker). Like a joiner the leader left
    out, it tries the next round while time remains; it used to return ``unconfirmed`` at
    once, and its training step averaged nothing."""
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "t/full", [np.full(10, float(i), np.float32)],
                         config=fast_config())
                for i, node in enumerate(nodes)
            ]  # fmt: skip
            refused: list[object] = []
            for averager in averagers:
                matchmaker = averager._matchmaker
                original = matchmaker.on_join

                async def on_join(request: Request, original: Any = original) -> Reply:
                    if not refused:  # the first join anywhere: the group is "full"
                        refused.append(request.peer_id)
                        return Reply({"status": "full"})
                    return await original(request)  # type: ignore[no-any-return]

                matchmaker.on_join = on_join  # type: ignore[method-assign]
            reports: dict[int, list[AveragingInfo]] = {0: [], 1: []}

            async def steps(i: int) -> None:
                while len(reports[i]) < 3 and not (
                    reports[i] and reports[i][-1].outcome is Outcome.AVERAGED
                ):
                    reports[i].append(await averagers[i].step(timeout=20.0))

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(steps, i)
    assert len(refused) == 1
    joiner = 0 if averagers[0].node.peer_id == refused[0] else 1
    (first, *_) = reports[joiner]
    assert first.outcome is Outcome.AVERAGED, first
