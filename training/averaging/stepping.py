"""How a step of the :class:`~.averager.Averager` is called (``Stepping``, a base class of
it): awaited in async code, or blocking in a plain script on a ``peer.run_in_background``
peer (``step_blocking``, or ``step`` outside a trio task); the timeout's default under the
caller's deadline; one step at a time, none once closed; and what a step that ends, however
it ends, leaves for the next. The step itself is ``Averager._step``."""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from peer import BackgroundPeer, Peer, PeerStoppedError
from peer.interrupts import interrupt_in

from .arguments import check_step_arguments, declared_epoch
from .config import AveragerConfig
from .handlers import _Active
from .layout import FlatVector
from .matchmaking import Matchmaker
from .report import AveragingInfo

MARGIN_SHARE, MIN_MARGIN, MAX_MARGIN = 0.1, 0.05, 1.0
"""Without a ``timeout``, a step under a caller's deadline ``left`` seconds away ends
``clamp(MARGIN_SHARE * left, MIN_MARGIN, MAX_MARGIN)`` before it (at most half of ``left``),
so that it returns its report before the caller's cancel scope fires."""


def _in_trio_task() -> bool:
    """Whether the caller runs in a trio task (async code), not a plain thread."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


class Stepping:
    """The calling of a step of :class:`~.averager.Averager`, one of its base classes (the
    attributes below are the averager's)."""

    node: Peer
    prefix: str
    config: AveragerConfig
    flat: FlatVector
    _background: BackgroundPeer | None
    _matchmaker: Matchmaker
    _active: _Active | None
    # (round, group tag) of the groups our last steps left (see Averager._left)
    _left: deque[tuple[int, bytes]]
    # the coroutine of our last step() in async code until it first runs (see step)
    _unstarted: weakref.ref[Any] | None
    _busy: bool
    _closed: bool
    # the averager's own: the step itself, a warning (see tensor_warnings.py), and the end of
    # its registration on the node
    _step: Callable[[float, int, float], Awaitable[AveragingInfo]]
    _warn_if_unreferenced: Callable[..., None]
    _unregister: Callable[[], None]

    def step(self, weight: float = 1.0, epoch: int = 0, timeout: float | None = None) -> Any:
        """Average the tensors with a group of peers; returns within ``timeout`` seconds.

        In async code, ``info = await averager.step(...)``: an awaitable of the
        :class:`AveragingInfo`. On a ``peer.run_in_background`` peer, called from a plain
        script (no trio task running in this thread), it blocks and returns the
        :class:`AveragingInfo` itself: the same method, no ``await``, as the background
        peer's ``dht.store`` and ``dht.get`` (:meth:`step_blocking` is the same call). In
        a trio task it is always the awaitable (a ``step()`` not awaited does nothing, as
        for any coroutine, and the next ``step()`` then raises ``RuntimeError``); called
        outside any trio task on an ``open_peer`` averager it raises ``RuntimeError``, as
        that peer's loop is the only one that can run it.

        Args:
            weight: this peer's share of the weighted mean (e.g. its sample count).
            epoch: this peer's training epoch (staleness is measured against the group's);
                one beyond ``2**62 - 1``, the largest a declaration carries, is declared as
                that (``info.epoch`` is never more, so ``max(epoch, info.epoch) + 1`` never
                fails).
            timeout: seconds for the whole step. Default: a margin before the caller's
                cancel-scope deadline when it has one (10 % of the time left, 50 ms to 1 s;
                ``MARGIN_SHARE``), so that the report comes back before the scope fires;
                else ``config.default_timeout``.

        Raises:
            ValueError: for a weight that is not a positive finite number up to 1e300,
                an epoch that is not a non-negative integer (``int``, numpy integer or
                other ``numbers.Integral``, 0-d torch integer tensor), a timeout that is
                not a positive finite number; for a bool (numpy's and torch's too) or an
                array or tensor with a dimension, even of one element (0-d ones are numbers).
            RuntimeError: if another step of this averager is running, or it was closed, or
                the previous ``step()`` in async code was dropped without being awaited; or
                if a tensor object now holds other memory than when the averager was made
                (``p.data = ...``, ``model.to(dtype)``): the averager would average the old.
            LayoutMismatchError: the peers of the round average another tensor layout,
                codec, group size or staleness rule under this prefix (once this averager
                has met a peer of its own layout, such a round is ``alone`` instead).
            PeerStoppedError: the node's ``open_peer`` context has ended.
        """
        if not _in_trio_task():
            if self._background is None:  # the coroutine could never run in this thread
                raise RuntimeError(
                    "this Averager is on open_peer()'s peer: await averager.step(...) in "
                    "that peer's trio loop, or build it on peer.run_in_background(...) to "
                    "call step from a plain thread"
                )
            return self._blocking(weight, epoch, timeout)  # (which checks _check_awaited)
        self._check_awaited()
        coroutine = self._step_async(weight, epoch, timeout)
        self._unstarted = weakref.ref(coroutine)
        return coroutine

    async def _step_async(
        self,
        weight: float = 1.0,
        epoch: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - the step splits it between phases
        called_at: float | None = None,
    ) -> AveragingInfo:
        """:meth:`step` in async code (its arguments and errors). ``called_at``: the
        ``time.monotonic()`` of a blocking call, which made the per-tensor checks already;
        the time since counts against ``timeout``."""
        self._unstarted = None  # (a step() that runs was awaited, or started as a task)
        check_step_arguments(weight, epoch, timeout)
        epoch = declared_epoch(epoch)
        if timeout is not None:
            timeout = float(timeout)
        else:
            left = trio.current_effective_deadline() - trio.current_time()
            if math.isfinite(left):
                margin = min(max(MARGIN_SHARE * left, MIN_MARGIN), MAX_MARGIN, left / 2)
                timeout = left - margin
            else:
                timeout = self.config.default_timeout
        background = self._background
        if background is not None and trio.lowlevel.current_trio_token() != background.token:
            # another trio loop than the peer's: the peer's tasks would run in the wrong one
            raise RuntimeError(
                "this Averager is on a background peer (run_in_background): call "
                "step_blocking() from a thread, or build it on open_peer()'s peer in async code"
            )
        self._check_open()
        if self._busy:  # e.g. step_blocking from two threads: one step at a time
            raise RuntimeError(
                f"the averager {self.prefix!r} is already in a step (from another task or "
                "thread): its steps run one at a time"
            )
        # The deadline counts from the call: the checks below take ~2-4 us per tensor (a
        # trial's 100,000 one-element tensors: 0.57 s, while its steps had 0.3 s)
        deadline = trio.current_time() + timeout
        if called_at is None:
            self.flat.check_memory()
            self._warn_if_unreferenced()
        else:
            deadline -= time.monotonic() - called_at
        self._busy = True
        try:
            return await self._step(float(weight), epoch, deadline)
        except BaseExceptionGroup as group:
            interrupt = interrupt_in(group)  # Ctrl-C, wrapped by a nursery of the step's
            if interrupt is not None:  # (peer/interrupts.py)
                raise interrupt from None
            # The open_peer block ended under the all-reduce: its tasks fail together (dials
            # refused, the host stopped, trio's shutdown); say that, as before the butterfly.
            if self.node.rpc.stopped or group.subgroup(PeerStoppedError) is not None:
                block = "run_in_background" if self._background else "open_peer"
                raise PeerStoppedError(
                    f"the peer stopped during a step of averager {self.prefix!r}: its "
                    f"{block} block has ended"
                ) from group
            raise
        finally:
            if self._active is not None:
                if self._active.group_id is not None:
                    self._left.append((self._active.round, self._active.group_id))
                self._active.ready.set()
                if self._active.service is not None:  # its waiting result streams end
                    self._active.service.close()
                self._active = None
            self._matchmaker.led = None
            self._matchmaker.withdraw_left_over()
            self._busy = False
            if self._closed:  # closed during the step
                self._unregister()

    def _check_awaited(self) -> None:
        """Raise if our last ``step()`` in async code was dropped before it ever ran; before a
        blocking step too (a background averager's ``step()`` dropped in a trio task of the
        caller's went unsaid when the next came from a plain thread: an outside tester)."""
        unstarted = self._unstarted
        if unstarted is not None and unstarted() is None:
            self._unstarted = None
            raise RuntimeError(
                "the previous averager.step(...) was never awaited, so it averaged nothing: "
                "in async code, write info = await averager.step(...)"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the averager {self.prefix!r} is closed: make a new one")

    def step_blocking(
        self, weight: float = 1.0, epoch: int = 0, timeout: float | None = None
    ) -> AveragingInfo:
        """:meth:`step` for plain scripts: runs it on the background peer's loop and blocks
        (what ``averager.step(...)`` does there too, outside a trio task).

        Raises:
            RuntimeError: if the averager was not made with a ``peer.run_in_background`` peer
                (or as :meth:`step`).
            ValueError, LayoutMismatchError: as :meth:`step`.
        """
        return self._blocking(weight, epoch, timeout)

    def _blocking(self, weight: float, epoch: int, timeout: float | None) -> AveragingInfo:
        """:meth:`step_blocking` (or :meth:`step` outside a trio task) itself."""
        called_at = time.monotonic()
        self._check_awaited()
        if self._background is None:
            raise RuntimeError(
                "step_blocking needs a peer from peer.run_in_background; on open_peer()'s "
                "peer, in its trio loop, use info = await averager.step(...)"
            )
        check_step_arguments(weight, epoch, timeout)
        self._check_open()  # before the warning below: a closed averager says only that
        self.flat.check_memory()
        self._warn_if_unreferenced(stacklevel=4)  # here: the warning names the caller's line
        return self._background.run(self._step_async, weight, epoch, timeout, called_at)
