"""What a PyTorch user passes to an Averager: a real model's state, tensors that torch can
view in odd ways, tensors whose memory changes between or during steps (memory network,
virtual time). Every expectation is computed here, independently of the averager."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import trio
from test_averaging_support import fast_config, memnet_swarm, tolerance

from peer import MemoryNetwork, run_in_background
from training import Averager, AveragingInfo, Outcome


async def step_together(averagers: Sequence[Averager], weights: Sequence[float]) -> list[Any]:
    infos: list[AveragingInfo | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        infos[i] = await averagers[i].step(weight=weights[i], timeout=10.0)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return infos


# -- a real model's state ------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """An embedding tied to the output head, BatchNorm (float buffers and an int64 counter),
    a 0-d parameter, an empty one, and buffers of other float dtypes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, listed once by parameters()
        self.scale = torch.nn.Parameter(torch.tensor(1.0 + seed))  # 0-d
        self.unused = torch.nn.Parameter(torch.zeros(0, 4))  # empty
        self.register_buffer("ema64", torch.randn(3, dtype=torch.float64))
        self.register_buffer("bf16", torch.randn(5).to(torch.bfloat16))
        self.register_buffer("fp16", torch.randn(5).to(torch.float16))
        self.norm(torch.randn(8, 4) * (seed + 1))  # running stats differ per peer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)) * self.scale)

    def averaged(self) -> list[torch.Tensor]:
        """What a user averages: parameters and the floating buffers."""
        return [*self.parameters(), *(b for b in self.buffers() if b.is_floating_point())]


TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no false alarm on a plain step
async def test_a_real_models_state_averages_to_the_weighted_mean_in_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    weights = [1.0, 2.0, 3.0]
    models = [TinyLM(seed) for seed in range(3)]
    lists = [model.averaged() for model in models]
    expected = [
        sum(w * t.detach().double() for w, t in zip(weights, column, strict=True)) / sum(weights)
        for column in zip(*lists, strict=True)
    ]
    pointers = [[t.data_ptr() for t in tensors] for tensors in lists]
    dtypes = [t.dtype for t in lists[0]]
    counters = [model.norm.num_batches_tracked.item() for model in models]
    with trio.fail_after(60):
        async with memnet_swarm(3) as (_, nodes):
            averagers = [
                Averager(node, "t/model", tensors, config=fast_config())
                for node, tensors in zip(nodes, lists, strict=True)
            ]
            infos = await step_together(averagers, weights)
    assert all(info.outcome is Outcome.AVERAGED for info in infos)
    for model, tensors, before, counter in zip(models, lists, pointers, counters, strict=True):
        assert [t.data_ptr() for t in tensors] == before  # in place: the same memory
        assert [t.dtype for t in tensors] == dtypes
        for tensor, mean in zip(tensors, expected, strict=True):
            scale = max(1.0, float(mean.abs().max())) if mean.numel() else 1.0
            error = float((tensor.detach().double() - mean).abs().max()) if mean.numel() else 0
            assert error <= TOLERANCE[tensor.dtype] * scale * 2, (tensor.dtype, error)
        assert model.head.weight is model.embed.weight  # still tied
        assert model.norm.num_batches_tracked.item() == counter  # not averaged, untouched
        for p in model.parameters():
            assert p.requires_grad and p.is_leaf and p.grad is None
        model(torch.tensor([1, 2, 3])).sum().backward()  # autograd still works
        assert model.embed.weight.grad is not None


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tiny_tensors(seed: int, count: int = 1000) -> list[torch.Tensor]:
    """Many tiny tensors of every float dtype, 0-d and empty ones among them, so that every
    chunk (and int8 block) straddles dozens of tensors of different dtypes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(), (0,), (1,), (3,), (2, 2)]
    return [
        torch.randn(shapes[i % len(shapes)], generator=gen).to(DTYPES[i % len(DTYPES)])
        for i in range(count)
    ]


@pytest.mark.parametrize("codec", ["none", "float16", "int8"])
async def test_a_thousand_tiny_tensors_of_mixed_dtypes_average_elementwise(
    autojump_clock: trio.testing.MockClock, codec: str
) -> None:
    lists = [tiny_tensors(seed) for seed in range(2)]
    expected = [(a.double() + b.double()) / 2 for a, b in zip(*lists, strict=True)]
    scale = max(float(t.abs().max()) for t in lists[0] + lists[1] if t.numel())
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "t/tiny", tensors, config=fast_config(codec=codec))
                for node, tensors in zip(nodes, lists, strict=True)
            ]
            infos = await step_together(averagers, [1.0, 1.0])
    assert all(info.averaged_fraction == 1.0 for info in infos)
    codec_error = tolerance(codec, scale)
    for tensors in lists:
        for tensor, mean, dtype in zip(tensors, expected, itertools.cycle(DTYPES), strict=False):
            assert tensor.dtype == dtype
            if mean.numel():  # the codec's error, then the rounding to the tensor's dtype
                rounding = TOLERANCE[dtype] * float(mean.abs().max())
                assert float((tensor.double() - mean).abs().max()) <= codec_error + rounding
    for a, b in zip(*lists, strict=True):
        assert torch.equal(a, b)  # every member holds the same values


# -- refused when the Averager is made -----------------------------------------------------


def _negative_view() -> torch.Tensor:
    return torch.zeros(3)._neg_view()


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(3)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (_inference_tensor, ValueError, r"tensor 1 is an inference tensor"),
        (_negative_view, ValueError, r"tensor 1 is a negative view"),
        (lambda: np.zeros(3, dtype=">f4"), ValueError, r"tensor 1 .*>f4.* byte order"),
        (lambda: np.zeros(6, dtype=np.float32)[::-2], ValueError, r"tensor 1 .*negative"),
        (lambda: np.zeros(3, dtype=np.longdouble), TypeError, r"tensor 1 \(a numpy array"),
        (lambda: torch.nn.BatchNorm1d(2).num_batches_tracked, TypeError, "num_batches_tracked"),
        # numpy's own name for the dtype it was given (not torch.int32)
        (lambda: np.zeros(3, dtype=np.int32), TypeError, "tensor 1 has dtype int32: only"),
        # a scale format and a packed one: a copy of the second failed only mid-step
        (lambda: torch.ones(3).to(torch.float8_e8m0fnu), TypeError, "e8m0fnu, which does not"),
        (lambda: torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), TypeError, "x2,"),
        # its masked elements were averaged like the others, the mask ignored
        (lambda: np.ma.masked_array(np.zeros(3), mask=[0, 1, 0]), TypeError, "masked array"),
    ],
    ids=[
        "inference",
        "neg-view",
        "big-endian",
        "negative-strides",
        "longdouble",
        "int64",
        "np-int32",
        "float8-e8m0",
        "float4",
        "masked",
    ],
)
async def test_tensors_that_cannot_be_averaged_in_place_are_refused_naming_them(
    autojump_clock: trio.testing.MockClock,
    make: Callable[[], Any],
    error: type[Exception],
    message: str,
) -> None:
    """An inference tensor was accepted, and every step then raised mid-round, after part of
    the tensor had been written; a negative view raised numpy's RuntimeError; numpy's
    refusals did not say which tensor."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(error, match=message):
                Averager(nodes[0], "t/x", [torch.zeros(2), make()], config=fast_config())


async def test_a_model_or_a_state_dict_instead_of_tensors_says_what_to_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A model was "got Linear" (no way out named); a state_dict's advice listed a tied
    weight twice, which the next check refuses (an outside trial)."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    model[1].weight = model[0].weight  # tied
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(TypeError, match=r"got the model \(Sequential\): pass list"):
                Averager(nodes[0], "t/m", model, config=fast_config())
            with pytest.raises(TypeError, match="a state_dict") as refused:
                Averager(nodes[0], "t/s", model.state_dict(), config=fast_config())
            advice = str(refused.value).partition("under each name): ")[2]
            sd = model.state_dict()  # the advice, run as written, is accepted
            tensors = eval(advice, {"sd": sd})
            Averager(nodes[0], "t/s", tensors, config=fast_config()).close()
            assert len(tensors) == 2 and len(sd) == 3


@pytest.mark.parametrize("tensors", [None, 5], ids=["None", "int"])
async def test_tensors_that_are_not_a_list_say_what_was_expected(
    autojump_clock: trio.testing.MockClock, tensors: Any
) -> None:
    """None and 5 were "'NoneType' object is not iterable" and "'int' object is ..."."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            with pytest.raises(TypeError, match="tensors must be a list of tensors, got"):
                Averager(nodes[0], "t/x", tensors, config=fast_config())


@pytest.mark.parametrize(
    ("codec", "params", "error", "message"),
    [
        ("int8", {"fraction": 0.1}, TypeError, "'int8' takes no parameter 'fraction'"),
        ("none", {"zzz": 1}, TypeError, "'none' takes no parameter 'zzz'"),
        ("topk", {}, ValueError, "topk takes exactly one of k and fraction"),
    ],
)
async def test_codec_params_the_codec_does_not_take_are_named(
    autojump_clock: trio.testing.MockClock,
    codec: str,
    params: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    """A topk fraction left in codec_params after a switch to int8 was "Int8Codec.__init__()
    got an unexpected keyword argument 'fraction'"."""
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            config = fast_config(codec_params=params)
            with pytest.raises(error, match=f"AveragerConfig.codec_params: .*{message}"):
                Averager(nodes[0], "t/x", [torch.zeros(2)], codec=codec, config=config)


# -- memory that changes between steps -----------------------------------------------------


async def test_tensors_moved_to_shared_memory_after_the_averager_was_made_are_followed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``model.share_memory()`` moves each storage in place: the averager used to go on
    reading and writing the freed memory (garbage in, the caller's tensors untouched)."""
    lists = [[torch.full((1000,), 2.0 * i), torch.full((7,), 4.0 * i)] for i in range(2)]
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "t/shared", tensors, config=fast_config())
                for node, tensors in zip(nodes, lists, strict=True)
            ]
            for tensors in lists:
                for tensor in tensors:
                    tensor.share_memory_()
            infos = await step_together(averagers, [1.0, 1.0])
    assert all(info.averaged_fraction == 1.0 for info in infos)
    for tensors in lists:
        assert tensors[0].is_shared()
        assert torch.all(tensors[0] == 1.0) and torch.all(tensors[1] == 2.0)


def _to_double(model: torch.nn.Linear) -> None:
    model.double()


def _assign_data(model: torch.nn.Linear) -> None:
    model.weight.data = model.weight.data.clone()


def _vector_to_parameters(model: torch.nn.Linear) -> None:
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector, model.parameters())


@pytest.mark.parametrize(
    "replace", [_to_double, _assign_data, _vector_to_parameters], ids=lambda f: f.__name__
)
async def test_a_parameter_given_new_memory_is_an_error_at_the_next_step(
    autojump_clock: trio.testing.MockClock, replace: Callable[[torch.nn.Linear], None]
) -> None:
    """The parameter objects stay, their ``.data`` is new: the averager averaged the old
    memory, which the model no longer reads, and reported ``averaged``."""
    model = torch.nn.Linear(3, 2)
    keep = [p.detach() for p in model.parameters()]  # e.g. an EMA copy: no warning either
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            averager = Averager(nodes[0], "t/p", list(model.parameters()), config=fast_config())
            replace(model)
            with pytest.raises(RuntimeError, match=r"tensor 0 now holds other memory"):
                await averager.step(timeout=5.0)
    assert keep


@pytest.mark.parametrize(
    "reshape",
    [
        lambda t: t.unsqueeze_(0),
        lambda t: t.t_(),  # square: the shape stays, the strides do not
        lambda t: t.resize_(2),  # shrinks in place: the same memory, less of it
    ],
    ids=["unsqueeze_", "t_", "resize_"],
)
async def test_a_tensor_reshaped_in_place_is_an_error_that_says_so(
    autojump_clock: trio.testing.MockClock, reshape: Callable[[torch.Tensor], object]
) -> None:
    """The same memory under another shape or strides: refused as at creation (a transposed
    tensor is), and the error names the in-place reshape, not a replaced ``.data`` that
    never happened (an outside tester followed that lead after ``unsqueeze_``)."""
    tensor = torch.arange(4.0).reshape(2, 2)
    address = tensor.data_ptr()
    with trio.fail_after(30):
        async with memnet_swarm(1) as (_, nodes):
            averager = Averager(nodes[0], "t/p", [tensor], config=fast_config())
            reshape(tensor)
            assert tensor.data_ptr() == address
            before = tensor.clone()
            with pytest.raises(
                RuntimeError, match=r"tensor 0 changed its shape or strides"
            ) as error:
                await averager.step(timeout=5.0)
    assert "replaced" not in str(error.value)
    assert torch.equal(tensor, before)  # nothing written


def test_the_blocking_step_refuses_replaced_memory_before_warning_about_it() -> None:
    """In a plain script: the error, not the warning that the old memory is unreferenced."""
    net = MemoryNetwork()
    model = torch.nn.Linear(3, 2)
    config = fast_config(clock=None)
    with run_in_background(listen="10.0.0.1:1000", network=net.interface("10.0.0.1")) as node:
        averager = Averager(node, "t/p", list(model.parameters()), config=config)
        model.double()
        with pytest.raises(RuntimeError, match=r"tensor 0 now holds other memory.*double"):
            averager.step_blocking(timeout=2.0)
        averager.close()


# -- autograd and concurrent changes -------------------------------------------------------


async def test_backward_through_a_graph_that_saved_an_averaged_parameter_raises(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Averaging between forward and backward changes what the graph saved. With int8 every
    result is decoded into the parameter through numpy, which torch did not see: backward
    used the averaged values as the saved ones, silently (a torch write raised, as after
    ``optimizer.step()``); now both raise."""
    params = [torch.nn.Parameter(torch.full((8192,), 1.0 + i)) for i in range(2)]
    losses = [(p * p).sum() for p in params]  # saves p for backward
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "t/w", [p], config=fast_config(codec="int8"))
                for node, p in zip(nodes, params, strict=True)
            ]
            infos = await step_together(averagers, [1.0, 1.0])
    assert all(info.averaged_fraction == 1.0 for info in infos)
    for p, loss in zip(params, losses, strict=True):
        assert torch.allclose(p.detach(), torch.full_like(p, 1.5), rtol=1e-2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


async def test_tensors_changed_in_place_during_the_all_reduce_warn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A task (or thread) that keeps training while the step runs: part of its changes is
    sent, the rest is overwritten by the received mean. The docs say not to; the step says
    that it happened."""
    lists = [[torch.full((5000,), float(i))] for i in range(2)]
    with trio.fail_after(60):
        async with memnet_swarm(2) as (_, nodes):
            averagers = [
                Averager(node, "t/busy", tensors, config=fast_config())
                for node, tensors in zip(nodes, lists, strict=True)
            ]
            infos: list[Any] = []

            async def both() -> None:
                infos.extend(await step_together(averagers, [1.0, 1.0]))
                nursery.cancel_scope.cancel()

            async def keep_training() -> None:
                while True:
                    lists[0][0].add_(1.0)
                    await trio.sleep(0.001)

            with pytest.warns(RuntimeWarning, match=r"tensors \[0\] were changed in place"):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(both)
                    nursery.start_soon(keep_training)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # left alone, the next step does not warn
                infos = await step_together(averagers, [1.0, 1.0])
    assert all(info.averaged_fraction == 1.0 for info in infos)
    assert torch.equal(lists[0][0], lists[1][0])


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16]
    + [getattr(torch, f"float8_{n}") for n in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")],
    ids=str,
)
def test_a_mean_beyond_a_narrow_dtypes_range_is_stored_as_its_largest_value(
    dtype: torch.dtype,
) -> None:
    """Finite float32 values beyond a narrow dtype's range (a hostile sender's, or a codec's
    error) are stored as ±its largest value: float8_e5m2 made them infinite and the fnuz
    float8s NaN, in a part reported ``all`` (a review; only float8_e4m3fn saturates by
    itself). Infinities and NaN stay as they are."""
    from training.averaging.layout import FlatVector

    top = float(torch.finfo(dtype).max)
    target = torch.zeros(6, dtype=dtype)
    flat = FlatVector.of([target])
    beyond = min(top * 4, float(np.finfo(np.float32).max))  # finite in float32
    inf = float("inf")
    flat.tensor.copy_(torch.tensor([beyond, -beyond, 1.0, -2.0, inf, float("nan")]))
    flat.store((0, 4))  # the finite ones
    assert target.float()[:4].tolist() == [top, -top, 1.0, -2.0]
    flat.store((4, 6))
    stored = target.float()[4:]
    if dtype in (torch.float8_e4m3fn,):  # no infinity in the dtype: its cast saturates
        assert stored[0] == top
    elif "fnuz" in str(dtype):  # no infinity either: NaN stands for it
        assert stored[0].isnan()
    else:
        assert stored[0] == inf
    assert stored[1].isnan()
