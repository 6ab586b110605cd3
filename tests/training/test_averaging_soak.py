"""The averaging soak (benchmarks/averaging_soak.py) on a short schedule: real processes, a
``swarm bootstrap`` node, rounds through all three codecs, each member checking its tensor
against the weighted mean of the inputs and against its own report. And what the soak found,
reduced to the memory network with virtual time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from test_averaging_support import (
    Member,
    fast_config,
    memnet_swarm,
    step_all,
)

from peer import Peer
from training import Averager

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "benchmarks" / "averaging_soak.py"
ROUNDS = 3  # one per codec: none, float16, int8
PERIOD = 2.0
MEMBERS = 2


def run_soak(*args: str, timeout: float) -> dict[str, Any]:
    """The soak's summary line; the driver ends every process it started (or is killed)."""
    out = subprocess.run(
        [sys.executable, str(SOAK), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    summaries = [line for line in lines if line.get("event") == "summary"]
    assert len(summaries) == 1, out.stdout[-2000:]
    return summaries[0]


def test_a_short_soak_averages_every_round_exactly_and_holds_steady(tmp_path: Path) -> None:
    """Every round of every member is ``averaged`` over the whole swarm, its tensor is the
    weighted mean of everybody's inputs within the codec's error and agrees with its report,
    and nothing (tasks, connections) is left behind from one round to the next."""
    summary = run_soak(
        "--workers", str(MEMBERS), "--duration", str(ROUNDS * PERIOD), "--period", str(PERIOD),
        "--size", "20000", "--timeout", "4", "--sample-every", "1", "--events", "",
        "--workdir", str(tmp_path),  # not a new folder under /tmp on every run
        timeout=90,
    )  # fmt: skip
    for index in range(MEMBERS):
        member = summary[f"m{index}"]
        assert member["rounds"] == ROUNDS, member
        assert member["errors"] == [] and member["check_failures"] == 0, member
        assert member["outcomes"] == {"averaged": ROUNDS}, member
        assert member["full"] == ROUNDS, member
        assert member["fraction"] == [1.0, 1.0], member
        tasks, conns = member["tasks"], member["conns"]
        # each connection runs 4 tasks here; nothing else may pile up from round to round
        assert tasks[1] - 4 * conns[1] <= tasks[0] - 4 * conns[0], member
        assert conns[2] <= 2 * MEMBERS, member  # the bootstrap and the others, both ways at most
        assert member["stderr_lines"]["traceback"] == 0, member


@asynccontextmanager
async def seeded_swarm(n: int, first_seed: int) -> AsyncIterator[list[Peer]]:
    """``n`` peers on the memory network with identities from fixed seeds: the groups and
    leaders of every round are the same from run to run."""
    async with memnet_swarm(n, first_seed=first_seed) as (_, nodes):
        yield nodes


async def test_a_restarted_member_is_grouped_again(autojump_clock: trio.testing.MockClock) -> None:
    """A member whose process restarts (a fresh Averager: no history) within 3 rounds is
    still in the others' count: they close early on seeing it, while it waits for the
    slot's close, when they have withdrawn. It must average with them again at once, not
    be left ``alone`` until it happens to lead a round (the soak: every float16 round for
    40 s; with these identities it leads none of the 3 rounds below)."""
    with trio.fail_after(120):
        async with seeded_swarm(4, first_seed=11) as nodes:
            config = fast_config()  # gather_window 1.0, join_timeout 0.5
            arrays = [np.full(2048, float(i), dtype=np.float32) for i in range(4)]
            members = [
                Member(Averager(node, "t/x", [a], config=config), a.copy(), a)
                for node, a in zip(nodes, arrays, strict=True)
            ]
            for _ in range(3):  # everybody has seen 4 peers in its last rounds
                await step_all(members, timeout=5.0)
            members[3].averager.close()  # its process restarts: a fresh averager
            members[3].averager = Averager(nodes[3], "t/x", [arrays[3]], config=config)
            sizes = []
            for _ in range(3):
                now = trio.current_time()
                await trio.sleep(math.ceil(now) + 0.05 - now)  # all just after a slot opened
                results = await step_all(members, timeout=5.0)
                sizes.append([len(info.group) if info else 0 for info, _ in results])
    assert sizes == [[4] * 4] * 3, sizes  # now: [[3, 3, 3, 1]] * 3
