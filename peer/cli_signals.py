"""How ``swarm`` owns SIGINT/SIGTERM (see peer.cli): the first one stops the command,
later ones are ignored."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupted(BaseException):
    """A stop signal arrived before the trio loop ran: unwinds the start-up to main()."""


class _SignalStop:
    """Owns SIGINT/SIGTERM for the whole run of main(): the first one stops, later ones are ignored.

    Until ``hand_over()`` (just before ``trio.run``) a signal raises _Interrupted, wherever
    the start-up is; after it, a signal cancels the scope given to ``cancelling()`` through
    the trio token (safe in a signal handler), or is kept for ``cancelling()`` to see.

    Later signals reach the same handler, which ignores them. It must stay a Python
    handler while main() runs: Python runs the handlers of signals that arrived together
    one after another, and one whose handler was set to SIG_IGN in between is reported as
    "ignored due to race condition" (a traceback on stderr, e.g. for SIGINT then SIGTERM).
    Only ``restore()``, after the trio loop, sets SIG_IGN, which outlives even the
    interpreter's own teardown, so ``timeout``'s double SIGTERM cannot kill a node that is
    stopping.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._raise = True
        self._mask: set[int | signal.Signals] | None = None  # this thread's, before _handle blocked
        self._cancel: Callable[[], object] | None = None
        # Taken over even when ignored from the start: a shell script starts its background
        # jobs with SIGINT ignored (`swarm bootstrap & ... kill -INT $!`), and a node that
        # kept ignoring it never stopped there (an outside tester; the contract is "stops
        # cleanly on SIGINT/SIGTERM").
        self.signals = _STOP_SIGNALS
        # No raise while they go in: a SIGTERM that came once its handler was in ran it
        # inside the next one's signal.signal(), and the _Interrupted came out of this
        # constructor, before main() could catch it (a traceback, exit code 1, in a CI
        # run). main() looks at ``signum`` first thing instead.
        self._raise = False
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        self._raise = True
        # The _Interrupted a handler raises where Python cannot propagate it (a weakref
        # callback during an import) is printed as "Exception ignored"; start-up then goes
        # on and stops where it next looks at ``signum``. No traceback for that.
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._quiet_if_interrupted

    def _quiet_if_interrupted(self, unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, _Interrupted):
            self._unraisable(unraisable)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # already stopping
            return
        self.signum = signum
        if self._raise:
            raise _Interrupted
        # Later ones wait with the kernel (this thread's, the one that gets them while the
        # others' masks let it), dropped at restore()'s SIG_IGN: caught, each is written to
        # trio's wakeup socket, and one that came while trio closed it printed a
        # BrokenPipeError traceback on a clean stop (an outside tester: 1 of ~80 stops by
        # `timeout`, which sends SIGTERM twice).
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        if self._cancel is not None:
            self._cancel()

    def hand_over(self) -> None:
        """From now on a signal never raises: the trio loop is about to start."""
        self._raise = False

    @contextmanager
    def cancelling(self, scope: trio.CancelScope) -> Iterator[None]:
        """Within this block (inside trio), a stop signal cancels ``scope``."""
        import trio

        token = trio.lowlevel.current_trio_token()
        outer, self._cancel = self._cancel, lambda: token.run_sync_soon(scope.cancel)
        try:
            if self.signum is not None:  # came between hand_over() and here
                scope.cancel()
            yield
        finally:
            self._cancel = outer

    def restore(self) -> None:
        """Put the previous handlers back, unless a signal arrived (then ignore them for good)."""
        self._raise = False  # main() is returning: a signal now must not raise past it
        sys.unraisablehook = self._unraisable
        if self.signum is None:
            for s, handler in self._previous.items():
                if handler is not None:  # None: not set from Python, nothing to put back
                    signal.signal(s, handler)
            return
        # Blocked while switching: signal.signal() runs the handlers of signals already
        # caught, then sets SIG_IGN; one caught in between would be "ignored due to race
        # condition". A blocked one stays with the kernel, which drops it at SIG_IGN.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        try:
            for s in self.signals:
                signal.signal(s, signal.SIG_IGN)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask if self._mask is None else self._mask)
