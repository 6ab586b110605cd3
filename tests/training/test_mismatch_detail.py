"""A peer of another layout is told which setting differs: its declaration says its dtypes,
codec and staleness rule in words beside the fingerprint (a new-user trial got "ours: 100000
elements, group_size 16 (8bea...); theirs: 100000 elements, group_size 16 (ec81...)" for a
float64 tensor among float32 ones: both sides read the same)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
import trio
from test_averaging_support import fast_config, make_members, memnet_swarm, step_all

from protocol.codecs import get_codec
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from training import Averager, AveragerConfig, LayoutMismatchError
from training.averaging.descriptions import describe_settings, setting_differences
from training.averaging.grouping import DECLARATION_KEYS, MAX_DETAIL, Declaration
from training.averaging.layout import TensorLayout
from training.averaging.layout_check import _same_words_note


async def mismatch_beside(newcomer: Averager, *others: Callable[[], Awaitable[object]]) -> str:
    """The text of the LayoutMismatchError that ``newcomer``'s step raises while ``others``
    (the swarm's steps) run beside it."""
    errors: list[LayoutMismatchError] = []

    async def step_newcomer() -> None:
        with pytest.raises(LayoutMismatchError) as info:
            await newcomer.step(timeout=20.0)
        errors.append(info.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step_newcomer)
        for other in others:
            nursery.start_soon(other)
    return str(errors[0])


async def test_a_newcomer_with_another_dtype_is_told_the_dtypes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 500, fast_config())
            newcomer = Averager(nodes[2], "t/x", [np.zeros(500, np.float64)], config=fast_config())
            message = await mismatch_beside(newcomer, partial(step_all, members, timeout=20.0))
    print(message)
    assert "1 float64" in message and "1 float32" in message
    assert "codec" in message and "max_staleness" in message


def test_the_detail_travels_and_is_bounded() -> None:
    peer = Identity.from_seed(b"d" * 32).peer_id
    me = Declaration(peer, None, 1.0, 0, 1.0, "abc", 0, 10, 4, "1 tensors (1 float32)")
    back = Declaration.from_wire(peer, me.to_wire())
    assert back == me
    assert set(me.to_wire()) == DECLARATION_KEYS  # what a join may carry (averager._on_join)
    assert "1 tensors (1 float32)" in back.describe_layout()
    wire = me.to_wire()
    del wire["detail"]  # an older peer's declaration
    assert Declaration.from_wire(peer, wire).detail == ""
    for bad in ("x" * (MAX_DETAIL + 1), 7, None):
        with pytest.raises(RemoteProtocolError, match="detail"):
            Declaration.from_wire(peer, {**me.to_wire(), "detail": bad})


def test_the_detail_names_the_shapes_when_they_fit() -> None:
    """An acceptance audit's transposed tensor read "shapes f325adc6" against "c190bb19",
    and the codec as "NoneCodec(max_elements=268435456)"."""
    config = AveragerConfig()
    wide = TensorLayout.of([torch.zeros(10, 1000), torch.zeros(3)])
    tall = TensorLayout.of([torch.zeros(1000, 10), torch.zeros(3)])
    text = describe_settings(wide, get_codec("none"), config)
    assert "shapes 10x1000 3)" in text and "codec none," in text
    assert "shapes 1000x10 3)" in describe_settings(tall, get_codec("none"), config)
    assert "codec int8(block_size=4096)" in describe_settings(wide, get_codec("int8"), config)
    many = TensorLayout.of([torch.zeros(i + 1, 7) for i in range(40)])
    text = describe_settings(many, get_codec("none"), config)
    assert "shapes hash " in text and len(text) <= MAX_DETAIL
    # words too long even with the hash are cut before the version, which stays last (a
    # docs check: 4000 tensors of 4 dtypes, topk, a long staleness_decay lost it)
    dtypes = [torch.float16, torch.float32, torch.float64, torch.bfloat16]
    huge = TensorLayout.of([torch.zeros(2, dtype=dtypes[i % 4]) for i in range(4000)])
    odd = AveragerConfig(max_staleness=1000, staleness_decay=0.30000000000000004)
    text = describe_settings(huge, get_codec("topk", fraction=0.012345), odd)
    assert len(text) == MAX_DETAIL and text.endswith(", layout v9"), text


async def test_a_peer_of_another_version_is_named_as_such(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A mixed-versions trial: a newcomer beside peers of the layout before v5 read both
    sides' settings word for word the same, apart from the fingerprints, and went looking
    for a tensor or codec difference that did not exist."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            newcomer = Averager(nodes[2], "t/x", [np.zeros(500, np.float32)], config=fast_config())
            old = [
                Averager(node, "t/x", [np.zeros(500, np.float32)], config=fast_config())
                for node in nodes[:2]
            ]
            ours = newcomer._detail
            assert ours.endswith(", layout v9")
            for averager in old:  # what an older version declares: no version in its words
                averager.layout_id = "0123456789abcdef"
                averager._detail = ours.removesuffix(", layout v9")
            message = await mismatch_beside(newcomer, *(averager.step for averager in old))
    print(message)
    assert "another version of swarm" in message and "update the older side" in message


def test_only_the_same_words_read_as_another_version() -> None:
    peer = Identity.from_seed(b"d" * 32).peer_id
    words = "1 tensors (1 float32; shapes 10), codec none"
    me = Declaration(peer, None, 1.0, 0, 1.0, "aaa", 0, 10, 4, f"{words}, layout v8")
    assert me.reads_like(Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 10, 4, words))
    assert me.reads_like(
        Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 10, 4, f"{words}, layout v8")
    )
    assert not me.reads_like(Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 10, 4, ""))
    assert not me.reads_like(Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 10, 8, words))
    assert not me.reads_like(Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 11, 4, words))


def test_the_detail_tells_the_order_of_the_dtypes() -> None:
    """An outside tester: [float32, float16] against [float16, float32] both read "2 tensors
    (1 float16, 1 float32; shapes 1000 1000)", only the fingerprints differing."""
    config = AveragerConfig()
    ab = TensorLayout.of([torch.zeros(1000), torch.zeros(1000, dtype=torch.float16)])
    ba = TensorLayout.of([torch.zeros(1000, dtype=torch.float16), torch.zeros(1000)])
    text = describe_settings(ab, get_codec("none"), config)
    assert "(1 float16, 1 float32; dtypes float32 float16; shapes 1000 1000)" in text, text
    assert "dtypes float16 float32;" in describe_settings(ba, get_codec("none"), config)
    one = TensorLayout.of([torch.zeros(3), torch.zeros(4)])  # one dtype: no order to tell
    assert "(2 float32; shapes 3 4)" in describe_settings(one, get_codec("none"), config)
    # too many to spell out: hashes of the shapes, then of the dtypes' order, apart
    mixed = [torch.zeros(i + 1, dtype=torch.float16 if i % 3 else torch.float32) for i in range(60)]
    text = describe_settings(TensorLayout.of(mixed), get_codec("none"), config)
    swapped = describe_settings(TensorLayout.of(mixed[1:] + mixed[:1]), get_codec("none"), config)
    assert "; dtypes hash " in text and "; shapes hash " in text and len(text) <= MAX_DETAIL
    assert text.split("; shapes")[0] != swapped.split("; shapes")[0]


async def test_peers_of_one_version_with_the_dtypes_in_another_order_are_told_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The tester's two orders again: the error blamed "another version of swarm", although
    both sides ran v9."""
    ab = [np.zeros(1000, np.float32), np.zeros(1000, np.float16)]
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            newcomer = Averager(nodes[2], "t/x", ab[::-1], config=fast_config())
            swarm = [Averager(node, "t/x", ab, config=fast_config()) for node in nodes[:2]]
            message = await mismatch_beside(newcomer, *(averager.step for averager in swarm))
    print(message)
    assert "dtypes float16 float32" in message and "dtypes float32 float16" in message
    assert "another version" not in message


def test_the_same_words_of_the_same_version_are_not_called_another_version() -> None:
    """When the words cannot tell two layouts of one version apart (a codec parameter they
    leave out), the note says so and how to line the tensors up, not "update"."""
    peer = Identity.from_seed(b"d" * 32).peer_id
    words = "2 tensors (2 float32; shapes 3 4), codec none"
    me = Declaration(peer, None, 1.0, 0, 1.0, "aaa", 0, 7, 4, f"{words}, layout v9")
    same = Declaration(peer, None, 1.0, 0, 1.0, "bbb", 0, 7, 4, f"{words}, layout v9")
    older = Declaration(peer, None, 1.0, 0, 1.0, "ccc", 0, 7, 4, words)
    assert me.version == same.version == "v9" and older.version is None
    note = _same_words_note(me, [same])
    assert "list the same tensors in the same order" in note and "another version" not in note
    assert "another version of swarm" in _same_words_note(me, [older])
    assert _same_words_note(me, [replace(same, detail="other words, layout v9")]) == ""
    assert _same_words_note(me, [replace(same, layout="aaa")]) == ""  # our own layout


async def test_a_newcomer_with_another_group_size_is_told_just_that(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A trial's group_size 8 peer beside group_size 4 ones got two ~250-character
    descriptions to compare by eye; the setting that differs now comes first."""
    with trio.fail_after(300):
        async with memnet_swarm(3) as (_, nodes):
            members = make_members(nodes[:2], 500, fast_config(group_size=4))
            newcomer = Averager(
                nodes[2], "t/x", [np.zeros(500, np.float32)], config=fast_config(group_size=8)
            )
            message = await mismatch_beside(newcomer, partial(step_all, members, timeout=20.0))
    print(message)
    assert "rule (theirs differ in: group_size 4 (ours: group_size 8); ours: " in message
    assert "1 tensor (1 float32" in message  # one tensor, not "1 tensors"


def test_the_differences_name_each_setting_that_differs() -> None:
    peer = Identity.from_seed(b"d" * 32).peer_id
    words = (
        "2 tensors (1 bfloat16, 1 float16; dtypes float16 bfloat16; shapes 30 4x5), codec "
        "none, chunk_bytes 4096, max_staleness 2, staleness_decay 0.5, layout v9"
    )
    ours = Declaration(peer, None, 1.0, 0, 1.0, "a", 0, 50, 4, words)
    theirs = replace(
        ours,
        layout="b",
        group_size=8,
        detail=words.replace("dtypes float16 bfloat16", "dtypes bfloat16 float16")
        .replace("codec none", "codec int8(block_size=1024)")
        .replace("max_staleness 2", "max_staleness 3"),
    )
    assert setting_differences(ours, theirs) == (
        "group_size 8 (ours: group_size 4), dtypes bfloat16 float16 (ours: dtypes float16 "
        "bfloat16), codec int8(block_size=1024) (ours: codec none), max_staleness 3 (ours: "
        "max_staleness 2)"
    )
    more = replace(ours, layout="c", total=51, detail=words.replace("2 tensors", "3 tensors"))
    assert setting_differences(ours, more) == (
        f"51 elements (ours: 50 elements), {more.detail.split('), ')[0]}) (ours: "
        f"{words.split('), ')[0]}))"
    )
    assert setting_differences(ours, replace(ours, layout="d")) == ""  # the words agree
    # an older peer says nothing beyond its size: nothing to name
    assert setting_differences(ours, replace(ours, layout="e", detail="")) == ""
