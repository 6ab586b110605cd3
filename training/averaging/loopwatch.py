"""How long this process's event loop stood still during an all-reduce (or matchmaking).

A peer that was suspended (SIGSTOP, a laptop lid, a debugger) or starved of CPU for
seconds cannot tell from its own view of the round: when it runs again, the others have
dropped it, and its report blames them (``timeout``), although they were healthy. A task
that wakes every ``PERIOD`` and measures how late it woke tells the difference, at the
cost of a few wake-ups per second of a step.
"""

from __future__ import annotations

import trio

PERIOD = 0.25
"""Seconds between wake-ups; a stall shorter than this may go unseen (it is harmless)."""


class LoopWatch:
    """Run :meth:`run` beside the work, :meth:`stop` after it; ``longest`` is the longest
    stretch (in seconds) during which the loop ran none of our wake-ups beyond ``PERIOD``."""

    def __init__(self, phase: str = "the all-reduce") -> None:
        self.phase = phase
        self.longest = 0.0
        self._scope = trio.CancelScope()
        self._slept_at: float | None = None  # when the wake-up under way was asked for

    async def run(self) -> None:
        with self._scope:
            while True:
                self._slept_at = before = trio.current_time()
                await trio.sleep(PERIOD)
                self.longest = max(self.longest, trio.current_time() - before - PERIOD)

    def stop(self) -> None:
        """Stop watching; a wake-up still due counts too (after a suspension, the work may
        end before our late wake-up runs: a leader suspended while it held the joins read
        ``alone`` with no word of the stall, an outside tester found)."""
        if self._slept_at is not None:
            late = trio.current_time() - self._slept_at - PERIOD
            self.longest = max(self.longest, late)
        self._scope.cancel()

    def note(self, threshold: float, dropped: bool = True) -> str:
        """A sentence for the report when the loop stood still ``threshold`` seconds or
        more (empty otherwise); ``dropped``: members were dropped in the all-reduce (what
        the stall may explain)."""
        if self.longest < threshold:
            return ""
        why = "suspended, starved of CPU, or another thread holding Python's GIL"
        if self.phase == "matchmaking":
            return (
                f"this process stood still for {self.longest:.1f} s during matchmaking "
                f"({why}): the others may have formed their groups, or given up on us, "
                "meanwhile"
            )
        stood = f"this process stood still for {self.longest:.1f} s during {self.phase} ({why})"
        if not dropped:
            return stood
        return (
            f"{stood}: the members dropped in this round may have been alive, waiting for "
            "us or gone on without us"
        )
