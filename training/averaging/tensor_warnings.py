"""Warnings about the :class:`~.averager.Averager`'s tensors (``TensorWarnings``, a base
class of it): tensors that nothing but the averager holds any more (their average would go
unseen: a ``.grad`` that ``zero_grad()`` let go, a parameter given other memory), and
tensors that torch changed in place while the all-reduce read and wrote them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from .layout import FlatVector


def _shorten(indices: Sequence[int], most: int = 8) -> str:
    """``[0, 1, ...]``: the first ``most`` indices of a list."""
    return str(indices[:most])[:-1] + (", ...]" if len(indices) > most else "]")


class TensorWarnings:
    """The warnings of :class:`~.averager.Averager` about its tensors, one of its base
    classes (the attributes below are the averager's)."""

    prefix: str
    flat: FlatVector
    _warned_unreferenced: bool
    _reference_checks: int  # steps that asked (see _warn_if_unreferenced)

    def _warn_if_unreferenced(self, stacklevel: int = 3) -> None:
        """Warn (once) when some tensors are held by nothing but this averager: nobody would
        see their average, while the report says they were averaged. The usual cause is
        ``optimizer.zero_grad()``, which sets ``.grad`` to None (torch's default), so the next
        backward writes a new tensor and the one given to the averager is left behind.
        Asked at the first 4 steps, then at steps 8, 16, 32...: it costs ~4 us per tensor
        (a trial's 100,000 tensors: 0.39 s a step)."""
        if self._warned_unreferenced:
            return
        self._reference_checks += 1
        count = self._reference_checks
        if count > 4 and count & (count - 1):
            return
        lost = self.flat.unreferenced()
        if lost:
            self._warned_unreferenced = True
            warnings.warn(
                f"Averager {self.prefix!r}: {len(lost)} of its {len(self.flat.tensors)} tensors "
                f"({_shorten(lost)}) are referenced by nothing but this "
                "averager, so nobody will see their average. Were they parameters' .grad? "
                "optimizer.zero_grad() sets .grad to None (torch's default) and the next "
                "backward makes new tensors: call zero_grad(set_to_none=False) so the same "
                "tensors are reused. Or were they p.data of parameters that got other memory "
                "(model.to(dtype), model.half(), load_state_dict(assign=True), p.data = ...)? "
                "Make the Averager with the new tensors",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def _warn_if_changed(self, versions: Sequence[int]) -> None:
        """Warn when torch changed tensors in place while the all-reduce read and wrote them
        (another task, or another thread while :meth:`step_blocking` waits): some of the
        change may have been sent, and the step's writes overwrite it."""
        changed = self.flat.changed_since(versions)
        if changed:
            warnings.warn(
                f"Averager {self.prefix!r}: tensors {_shorten(changed)} were changed in "
                "place during the all-reduce (by another task or thread): part of the change "
                "may have been averaged, and the step's writes (the received parts; with "
                "int8 or float16, also our own values put back where a part failed) "
                "overwrote the rest. Change the tensors only between steps",
                RuntimeWarning,
                stacklevel=2,
            )
