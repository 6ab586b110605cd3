"""The host's send budget (peer.send_budget): totals, host shares, and who is woken."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.send_budget import SendBudget
from peer.wire import Outbox


async def test_waiters_of_a_share_and_of_the_total_are_all_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four frames of one host wait for its share, one of another host for the total. When
    room comes back, every frame that fits gets in, and those that do not yet wait on a
    parking lot that the next give-back wakes: waiters woken together used to drop each
    other's new lot (in trio's shuffled order, some of the time: hence the repeats)."""
    for _ in range(20):
        budget = SendBudget(limit=100, per_host=4)
        budget.take(4, "a")
        budget.take(50, "b")
        got: list[str] = []

        async def frame(
            name: str, size: int, group: str, budget: SendBudget = budget, got: list[str] = got
        ) -> None:
            while not budget.fits(size, group):
                await budget.wait(size, group, set())
            budget.take(size, group)
            got.append(name)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for name in ("a1", "a2", "a3", "a4"):
                    nursery.start_soon(frame, name, 2, "a")  # a's share is full
                nursery.start_soon(frame, "c", 51, "c")  # the total is, for this one
                await trio.testing.wait_all_tasks_blocked()
                assert got == []
                budget.give(4, "a")  # a's frames woken together: two fit its share
                await trio.testing.wait_all_tasks_blocked()
                assert len(got) == 2 and "c" not in got and budget.used == 54
                budget.give(50, "b")  # room in the total: c's frame
                await trio.testing.wait_all_tasks_blocked()
                assert len(got) == 3 and "c" in got
                budget.give(4, "a")  # the other two of a's
                await trio.testing.wait_all_tasks_blocked()
        assert sorted(got) == ["a1", "a2", "a3", "a4", "c"]
        assert budget.used == 4 + 51 and not budget._share


def test_a_frame_larger_than_the_budget_goes_alone_and_limits_are_checked() -> None:
    budget = SendBudget(limit=10, per_host=4)
    assert budget.fits(50, "a")  # nothing charged: it goes alone
    budget.take(50, "a")
    assert not budget.fits(1, "b")
    budget.give(50, "a")
    assert budget.used == 0 and budget.fits(10, "a")
    with pytest.raises(ValueError):
        SendBudget(limit=0)


async def test_a_put_waiting_for_the_budget_ends_when_its_outbox_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller's upload waiting for room stayed blocked after its connection died, until
    another connection gave some back (forever, if none did): a review."""
    budget = SendBudget(limit=100_000)
    other = Outbox(8, budget=budget)
    other.put_nowait([bytes(100_000)])  # another connection's unread reply holds it all
    outbox = Outbox(8, budget=budget)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def upload() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await outbox.put([bytes(8192)])

            nursery.start_soon(upload)
            await trio.testing.wait_all_tasks_blocked()
            outbox.close()
    other.close()
    assert budget.used == 0 and not budget._waiting
