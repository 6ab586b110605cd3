"""Ctrl-C out of a public coroutine as a plain ``KeyboardInterrupt``.

Trio delivers ``KeyboardInterrupt`` to the main task. When that task is waiting in a
nursery (a lookup's parallel requests, an averaging step's phases), the nursery collects the
interrupt with its children's exceptions and raises them as a ``BaseExceptionGroup``, so
``except KeyboardInterrupt`` around ``await node.dht.get(...)`` or ``await averager.step(...)``
missed it, depending on where the call was when the signal came (an outside tester: 23 of 36
interrupts of an async averaging loop came out as a group, its script's exit code 1, not
130). The public coroutines unwrap it: what the caller sees does not depend on our nurseries.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

__all__ = ["interrupt_in", "plain_interrupt"]

P = ParamSpec("P")
T = TypeVar("T")


def interrupt_in(group: BaseExceptionGroup) -> KeyboardInterrupt | None:
    """The first ``KeyboardInterrupt`` in ``group``, at any depth; None when there is none."""
    match = group.subgroup(KeyboardInterrupt)
    if match is None:
        return None
    leaf: BaseException = match
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, KeyboardInterrupt)
    return leaf


def plain_interrupt(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Wrap a public coroutine function so that a ``KeyboardInterrupt`` wrapped in an
    exception group by its nurseries comes out alone (the rest of the group, the tasks
    the interrupt cancelled, is what the interrupt caused, so it is dropped)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except BaseExceptionGroup as group:
            interrupt = interrupt_in(group)
            if interrupt is None:
                raise
            raise interrupt from None

    return wrapper
