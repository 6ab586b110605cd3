"""The flat vector: tensors laid end to end, split into parts and chunks.

Every tensor is viewed as 1-d and copied into one reused float32 buffer (``FlatVector``);
the all-reduce works on spans ``[start, stop)`` of that buffer. Part ``i`` is reduced by
the ``i``-th reducing member; parts are cut in proportion to declared bandwidth and travel
in chunks of ``chunk_elements``::

    flat  |-------- part 0 --------|---- part 1 ----|------ part 2 ------|
    part  |chunk 0|chunk 1|chunk 2 |

The cut into parts and chunks is spans.py's; the checks of the caller's tensors are
tensor_checks.py's.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from .spans import ALIGN as ALIGN
from .spans import MAX_BANDWIDTH_SPREAD as MAX_BANDWIDTH_SPREAD
from .spans import Span
from .spans import bounded_bandwidths as bounded_bandwidths
from .spans import check_spans as check_spans
from .spans import chunk_count as chunk_count
from .spans import chunk_span as chunk_span
from .spans import overlap as overlap
from .spans import split_spans as split_spans
from .tensor_checks import AVERAGED_DTYPES, as_list, as_tensors

Float32Array: TypeAlias = npt.NDArray[np.float32]

_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors hold a storage (private torch API: without it, no tensor is reported
unreferenced)."""


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Shapes and dtypes of the averaged tensors: peers must agree on it exactly."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> TensorLayout:
        return cls(
            tuple(tuple(t.shape) for t in tensors),
            tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def fingerprint(self, codec: str) -> str:
        """A short hash of the layout and the codec (what must match to average together)."""
        text = repr((self.shapes, self.dtypes, codec))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.shapes)} tensors, {self.total} elements"


class FlatVector:
    """A reused float32 buffer holding every tensor end to end, with copy in and out."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], originals: Sequence[object] | None = None
    ) -> None:
        """``tensors``: what :func:`as_tensors` made of ``originals``, the caller's objects
        (when given, :meth:`check_memory` tells when one of them got other memory)."""
        self.tensors = list(tensors)
        self.layout = TensorLayout.of(self.tensors)
        sizes = self.layout.sizes
        self.offsets = tuple(int(x) for x in np.cumsum((0, *sizes)))
        self.total = self.offsets[-1]
        self.tensor = torch.empty(self.total, dtype=torch.float32)  # (total,)
        self.array: Float32Array = self.tensor.numpy()
        # the caller's torch tensors, weakly: a parameter whose .data is replaced keeps its
        # object, and we would average the old memory (numpy arrays cannot be replaced so)
        self._originals: list[weakref.ref[torch.Tensor] | None] = [
            weakref.ref(item) if isinstance(item, torch.Tensor) else None
            for item in (originals if originals is not None else ())
        ]
        self._addresses = [t.data_ptr() for t in self.tensors]
        # which storages torch allocated, asked before our numpy views make them fixed-size
        self._storages = [_torch_allocated(t) for t in self.tensors]
        # float32 tensors are read in place (see source); others are converted on load
        self._views: list[Float32Array | None] = [_float32_view(t) for t in self.tensors]

    @classmethod
    def of(cls, tensors: Iterable[Any]) -> FlatVector:
        """The flat vector of the caller's tensors (checked as by :func:`as_tensors`).

        Raises:
            TypeError, ValueError: as :func:`as_tensors`.
        """
        originals = as_list(tensors)
        return cls(as_tensors(originals), originals)

    def check_memory(self) -> None:
        """Before a step: follow memory that moved under the same tensor, and refuse a
        tensor object that now holds other memory than the one averaged.

        ``share_memory_()`` (``model.share_memory()``) moves a storage to shared memory in
        place: our tensors follow it, but a numpy view made before would read and write the
        freed memory, so views are made again. ``p.data = x`` (``model.to(dtype)``,
        ``model.double()``, ``vector_to_parameters``), ``set_()`` or ``resize_()`` give the
        caller's object other memory, while we hold the old one: averaging it would go
        unseen.

        Raises:
            RuntimeError: naming the first tensor whose object holds other memory.
        """
        for i, (tensor, address) in enumerate(zip(self.tensors, self._addresses, strict=True)):
            if tensor.data_ptr() != address:  # moved in place (shared memory)
                if tensor.untyped_storage().nbytes() < _bytes_used(tensor):
                    raise RuntimeError(
                        f"tensor {i}'s storage was freed or shrunk (untyped_storage()."
                        "resize_()): make a new Averager with the current tensors"
                    )
                self._addresses[i] = tensor.data_ptr()
                self._storages[i] = None  # (not torch's any more, or not resizable)
                self._views[i] = _float32_view(tensor)
        for i, ref in enumerate(self._originals):
            original = ref() if ref is not None else None
            if original is None:
                continue
            ours = self.tensors[i]
            if _same_memory(original, ours):
                if original.shape == ours.shape and original.stride() == ours.stride():
                    continue
                raise RuntimeError(
                    f"tensor {i} changed its shape or strides in place "
                    f"({tuple(original.shape)}, strides {original.stride()}; was "
                    f"{tuple(ours.shape)}, strides {ours.stride()}): unsqueeze_(), squeeze_(),"
                    " t_(), transpose_(), as_strided_() or a shrinking resize_() on the same "
                    "memory; the averager averages the layout it was made with: make a new "
                    "Averager with the current tensors (close() this one first), or reshape "
                    "out of place (x.unsqueeze(0)) and keep the original"
                )
            else:
                raise RuntimeError(
                    f"tensor {i} now holds other memory than when the Averager was made "
                    f"({tuple(original.shape)} {original.dtype} on {original.device}, was "
                    f"{tuple(self.tensors[i].shape)} {self.tensors[i].dtype}): its .data was "
                    "replaced (model.to(dtype), model.double(), p.data = ..., "
                    "vector_to_parameters) or it was resized; averaging would write into the "
                    "old memory, which it no longer reads: make a new Averager with the "
                    "current tensors (close() this one first)"
                )

    def versions(self) -> tuple[int, ...]:
        """Each tensor's autograd version counter: torch's in-place operations (an
        optimizer step, a backward accumulating into ``.grad``) increase it."""
        return tuple(t._version for t in self.tensors)

    def changed_since(self, versions: Sequence[int]) -> list[int]:
        """Indices of the tensors changed in place through torch since :meth:`versions`."""
        return [
            i
            for i, (t, v) in enumerate(zip(self.tensors, versions, strict=True))
            if t._version != v
        ]

    def mark_written(self, spans: Iterable[Span]) -> None:
        """Tell autograd that the tensors overlapping ``spans`` were written in place (some
        results are written through numpy, which torch does not see): a backward through a
        graph that saved one of them then raises, as after ``optimizer.step()``, instead of
        using the averaged values as if they were the saved ones."""
        written = {i for span in spans for i, _, _ in self._pieces(span)}
        if written:
            torch.autograd.graph.increment_version([self.tensors[i] for i in sorted(written)])

    def unreferenced(self) -> list[int]:
        """Indices of the torch tensors whose memory nothing but this vector holds any more.

        Whatever is averaged into them is never seen: typically a parameter's ``.grad``
        that ``optimizer.zero_grad()`` (``set_to_none=True``, torch's default) dropped, the
        next backward allocating a new one. Only memory torch allocated is counted (a
        tensor over a numpy array or a buffer is held by that, which torch cannot see);
        a list of the old tensors kept by the caller still counts as a reference.
        """
        if _STORAGE_USE_COUNT is None:
            return []
        ours: dict[int, int] = {}  # storage address -> tensors of ours holding it
        candidates: dict[int, list[int]] = {}
        for i, (key, view) in enumerate(zip(self._storages, self._views, strict=True)):
            if key is None:
                continue
            ours[key] = ours.get(key, 0) + 1 + (view is not None)  # the view: one more
            candidates.setdefault(key, []).append(i)
        if not candidates:
            return []
        overhead = _storage_uses(torch.empty(1)) - 1  # what asking costs (a temporary)
        out: list[int] = []
        for key, indices in candidates.items():
            if _storage_uses(self.tensors[indices[0]]) - overhead <= ours[key]:
                out.extend(indices)
        return sorted(out)

    def load(self) -> None:
        """Copy every tensor into the buffer."""
        self.load_span((0, self.total))

    def load_span(self, span: Span) -> None:
        """Copy the tensors' values of ``flat[span]`` into the buffer."""
        for i, lo, hi in self._pieces(span):
            t_start = self.offsets[i]
            self.tensor[lo:hi].copy_(self.tensors[i].view(-1)[lo - t_start : hi - t_start])

    def source(self, start: int, stop: int) -> Float32Array:
        """The tensors' values of ``flat[start:stop]``, to read: a view of the tensor when one
        float32 tensor holds them all (no copy), else loaded into the buffer."""
        view = self.view(start, stop)
        if view is not None:
            return view
        self.load_span((start, stop))
        return self.array[start:stop]

    def view(self, start: int, stop: int) -> Float32Array | None:
        """A view of the one float32 tensor that holds ``flat[start:stop]``, else None."""
        for i, lo, hi in self._pieces((start, stop)):
            view = self._views[i]
            if view is not None and (lo, hi) == (start, stop):
                t_start = self.offsets[i]
                return view[lo - t_start : hi - t_start]
            break
        return None

    def _pieces(self, span: Span) -> list[tuple[int, int, int]]:
        """``(tensor index, start, stop)`` of each tensor's share of ``span`` (flat indices)."""
        start, stop = span
        out: list[tuple[int, int, int]] = []
        if start >= stop:
            return out
        first = bisect.bisect_right(self.offsets, start) - 1
        for i in range(max(first, 0), len(self.tensors)):
            t_start, t_stop = self.offsets[i], self.offsets[i + 1]
            if t_start >= stop:
                break
            lo, hi = max(start, t_start), min(stop, t_stop)
            if lo < hi:
                out.append((i, lo, hi))
        return out

    def store(self, span: Span) -> None:
        """Copy ``flat[span]`` back into the tensors it overlaps."""
        for i, lo, hi in self._pieces(span):
            t_start = self.offsets[i]
            target = self.tensors[i].view(-1)[lo - t_start : hi - t_start]
            values = self.tensor[lo:hi]
            top = _NARROW_MAX.get(target.dtype)
            if top is not None:
                values = _saturated(values, top)
            target.copy_(values)


_SATURATING = tuple(getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n))
_NARROW_MAX = {
    dtype: float(torch.finfo(dtype).max)
    for dtype in AVERAGED_DTYPES
    if dtype.itemsize < 4 and dtype not in _SATURATING
}
"""The largest finite value of the float dtypes narrower than float32 whose casts from it
overflow: to infinity (float16, bfloat16, float8_e5m2) or NaN (the ``fnuz`` float8s).
A sender's finite values beyond the range made an honest reducer's tensor infinite or
NaN, its part reported ``all`` (a review). float8_e4m3fn's cast saturates by itself (its
infinities too): a range check would be a pass for nothing."""


def _saturated(values: torch.Tensor, top: float) -> torch.Tensor:
    """``values`` with its finite elements beyond ``±top`` set to ``±top``: a mean of values
    that a narrow dtype holds is within its range, but the codec's error can take it past
    (int8: 65504 in a block whose largest value is 65600 decodes as 65600, which float16
    makes infinite). Infinities and NaN stay (a peer's own values put back)."""
    if not values.numel():
        return values
    low, high = torch.aminmax(values)  # (a NaN makes both NaN: then each element is seen)
    if -top <= float(low) and float(high) <= top:
        return values
    beyond = (values.abs() > top) & torch.isfinite(values)
    return torch.where(beyond, torch.copysign(torch.tensor(top), values), values)


def _float32_view(tensor: torch.Tensor) -> Float32Array | None:
    """A numpy view of a float32 tensor's memory (read and written in place), else None."""
    return tensor.detach().view(-1).numpy() if tensor.dtype == torch.float32 else None


def _bytes_used(tensor: torch.Tensor) -> int:
    """Bytes of its storage that a contiguous tensor reaches."""
    return int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())


def _same_memory(original: torch.Tensor, ours: torch.Tensor) -> bool:
    """Whether the caller's tensor still holds the memory we average (``ours``), whatever
    its shape now (see :meth:`FlatVector.check_memory`); other memory (another device, a
    sparse tensor too) has another address, and empty tensors none."""
    if (original.dtype, original.device, original.layout) != (
        ours.dtype,
        ours.device,
        ours.layout,
    ):
        return False
    if ours.numel() == 0:
        return original.numel() == 0
    return original.data_ptr() == ours.data_ptr() and original.numel() <= ours.numel()


def _torch_allocated(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's storage when torch allocated it (still resizable: not
    over a numpy array or a buffer, and with no numpy view yet), else None. (A helper, so
    that no storage object outlives the question: it would count as a use.)"""
    storage = tensor.untyped_storage()
    if tensor.numel() == 0 or not storage.resizable():
        return None
    return int(storage.data_ptr())


def _storage_uses(tensor: torch.Tensor) -> int:
    assert _STORAGE_USE_COUNT is not None
    return int(_STORAGE_USE_COUNT(tensor.untyped_storage()._cdata))
