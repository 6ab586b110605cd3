"""The flat vector: tensors laid end to end, split into parts and chunks.

Every tensor is viewed as 1-d and copied into one reused float32 buffer (``FlatVector``);
the all-reduce works on spans ``[start, stop)`` of that buffer. Part ``i`` is reduced by
the ``i``-th reducing member; parts are cut in proportion to declared bandwidth and travel
in chunks of ``chunk_elements``::

    flat  |-------- part 0 --------|---- part 1 ----|------ part 2 ------|
    part  |chunk 0|chunk 1|chunk 2 |
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import statistics
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

Span: TypeAlias = tuple[int, int]
Float32Array: TypeAlias = npt.NDArray[np.float32]

_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors hold a storage (private torch API: without it, no tensor is reported
unreferenced)."""

ALIGN = 4096
"""Part boundaries fall on multiples of this many elements when the vector is large enough
(int8 blocks then never straddle parts)."""


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


_INTEGER_HINT = (
    " (leave integer buffers such as BatchNorm's num_batches_tracked out, e.g. "
    "[b for b in model.buffers() if b.is_floating_point()])"
)


def as_list(tensors: Iterable[Any]) -> list[Any]:
    """The user's tensors as a list (a generator such as ``model.parameters()`` too).

    Raises:
        TypeError: if ``tensors`` is one tensor, a mapping (a ``state_dict()``) or anything
            else but an iterable of tensors.
    """
    if isinstance(tensors, torch.Tensor | np.ndarray):  # iterating it would average its rows
        # (each 0-d for a vector: millions of tensors) or, for numpy, refuse its scalars
        raise TypeError(
            f"tensors must be a list of tensors, got one {type(tensors).__name__}: pass [tensor]"
        )
    if isinstance(tensors, Mapping):  # iterating it yields the keys
        raise TypeError(
            "tensors must be a list of tensors, got a mapping (a state_dict()?): pass "
            "list(model.parameters()), or the floating tensors of state_dict().values() "
            "with each tied weight once (a state_dict lists it under each name): "
            "list({t.data_ptr(): t for t in sd.values() if t.is_floating_point()}.values())"
        )
    if isinstance(tensors, torch.nn.Module):  # iterating it fails, or yields submodules
        raise TypeError(
            f"tensors must be a list of tensors, got the model ({type(tensors).__name__}): "
            "pass list(model.parameters()), or [p.grad for p in model.parameters()] for "
            "its gradients"
        )
    try:
        iterator = iter(tensors)
    except TypeError:  # (list() said "'NoneType' object is not iterable")
        raise TypeError(
            f"tensors must be a list of tensors, got {type(tensors).__name__}"
        ) from None
    return list(iterator)


def as_tensors(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """Torch views of the user's tensors (numpy arrays are wrapped without copying).

    Raises:
        TypeError: if ``tensors`` is one tensor or a mapping (a ``state_dict()``) rather than a
            list, or an item is None (a ``.grad`` before the first backward), neither a torch
            tensor nor a numpy array (or one torch cannot view), or not floating, or of
            a float dtype that does not average (not in ``AVERAGED_DTYPES``:
            float8_e8m0fnu, float4_e2m1fn_x2).
        ValueError: if a tensor is not on the CPU, sparse, not contiguous, read-only, an
            inference tensor or a negative view, if two tensors share memory, or if the list
            is empty.
    """
    tensors = as_list(tensors)
    out: list[torch.Tensor] = []
    read_only = _read_only_ranges()
    for i, item in enumerate(tensors):
        if item is None:
            raise TypeError(
                f"tensor {i} is None (a parameter's .grad before the first backward?): run a "
                "backward first, or give each parameter a gradient to average into, e.g. "
                "p.grad = torch.zeros_like(p)"
            )
        if isinstance(item, np.ndarray):
            if not item.flags.writeable:  # averaged in place: writing would be an error (or,
                # for a memmap opened with mode "r", a segfault)
                raise ValueError(
                    f"tensor {i} is a read-only numpy array (flags.writeable is False, e.g. a "
                    "memmap opened with mode 'r'): averaging writes in place; pass a writable "
                    "array (np.array(x) copies it)"
                )
            tensor = _from_numpy(i, item)
        elif isinstance(item, torch.Tensor):
            tensor = item.detach()
        else:
            raise TypeError(f"tensor {i} is a {type(item).__name__}, not a torch tensor or array")
        if not tensor.is_floating_point():
            hint = "" if tensor.is_complex() else _INTEGER_HINT
            dtype = item.dtype if isinstance(item, np.ndarray) else tensor.dtype  # as given
            raise TypeError(f"tensor {i} has dtype {dtype}: only floating tensors average{hint}")
        if tensor.dtype not in AVERAGED_DTYPES:  # checked before its first copy fails
            names = ", ".join(str(d).removeprefix("torch.") for d in AVERAGED_DTYPES)
            raise TypeError(
                f"tensor {i} has dtype {tensor.dtype}, which does not average; the float "
                f"dtypes that do: {names}"
            )
        if tensor.is_inference():  # its first in-place write would raise, mid-round
            raise ValueError(
                f"tensor {i} is an inference tensor (made under torch.inference_mode()): it "
                "cannot be written in place outside inference mode; make it under "
                "torch.no_grad() instead, or pass a clone()"
            )
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {i} is on {tensor.device}: move it to the CPU")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {i} is {tensor.layout}: only dense tensors average")
        if not tensor.is_contiguous() and isinstance(item, np.ndarray):
            order = "Fortran order" if item.flags.f_contiguous else "a strided view"
            raise ValueError(
                f"tensor {i} is a numpy array in {order} (strides {item.strides}): only C "
                "order averages, in place; np.ascontiguousarray(x) would be a copy that "
                "nobody reads, so average that copy and keep it (or the array it views)"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"tensor {i} is not contiguous (a transpose, a strided slice, channels_last?): "
                "averaging writes in place, and .contiguous() would be a copy that nobody "
                "reads; pass the contiguous tensor it views (e.g. the parameter itself), or "
                "make the parameter contiguous first (p.data = p.data.contiguous(), or "
                "model.to(memory_format=torch.contiguous_format))"
            )
        if tensor.is_neg():  # a lazily negated view (e.g. of a complex tensor's .imag)
            raise ValueError(
                f"tensor {i} is a negative view (is_neg()): its memory holds the opposite "
                "values; pass the tensor it views"
            )
        start = tensor.data_ptr()
        stop = start + tensor.numel() * tensor.element_size()
        first = bisect.bisect_right(read_only, start, key=lambda r: r[1])  # first ending later
        if start < stop and first < len(read_only) and read_only[first][0] < stop:
            raise ValueError(
                f"tensor {i} lies in read-only memory (e.g. built from a memmap opened with "
                "mode 'r'): averaging writes in place; pass a writable copy"
            )
        out.append(tensor)
    if not out:
        raise ValueError("nothing to average: the tensor list is empty")
    _check_disjoint(out)
    return out


def _check_disjoint(tensors: Sequence[torch.Tensor]) -> None:
    """Each tensor's memory is averaged once: the same memory twice would be loaded twice
    and written back twice, and a partial round's report could not be right for it.

    Raises:
        ValueError: if two tensors share memory.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, t in enumerate(tensors)
        if t.numel()
    )
    for (_, stop, i), (start, _, j) in itertools.pairwise(spans):
        if start < stop:
            raise ValueError(
                f"tensors {min(i, j)} and {max(i, j)} share memory (the same tensor twice, "
                "overlapping views, or tied weights from a state_dict()): pass each once, "
                "e.g. list(model.parameters()), which lists a tied weight once"
            )


def _from_numpy(index: int, array: np.ndarray[Any, Any]) -> torch.Tensor:
    """``torch.from_numpy``, its refusals naming the tensor.

    Raises:
        TypeError: for a dtype torch has no match for (e.g. ``np.longdouble``).
        ValueError: for a byte order other than the machine's, or negative strides.
    """
    try:
        return torch.from_numpy(array)
    except TypeError as exc:
        raise TypeError(f"tensor {index} (a numpy array of {array.dtype}): {exc}") from None
    except ValueError as exc:  # a copy would be averaged, not the caller's array
        raise ValueError(
            f"tensor {index} (a numpy array of {array.dtype}, strides {array.strides}) cannot "
            f"be averaged in place: {exc}"
        ) from None


def _read_only_ranges() -> list[Span]:
    """Address ranges ``[lo, hi)``, in order, that this process may not write (from Linux's
    ``/proc/self/maps``; elsewhere none are known): a torch tensor over a read-only memmap
    has no flag saying so, and writing to it kills the process."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    ranges: list[Span] = []
    for line in lines:
        fields = line.split(maxsplit=2)
        if len(fields) >= 2 and "w" not in fields[1]:
            lo, _, hi = fields[0].partition("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


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
            if original is not None and not _same_memory(original, self.tensors[i]):
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


_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
_FLOAT8 = tuple(getattr(torch, name) for name in _FLOAT8_NAMES if hasattr(torch, name))
AVERAGED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, *_FLOAT8)
"""The float dtypes that average. Not the scale and packed formats (``float8_e8m0fnu``
holds no sign and no zero, ``float4_e2m1fn_x2`` two values per byte): a mean of them is
not a value of theirs."""

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
    """Whether the caller's tensor still is the memory we average (``ours``); other memory
    (another device, a sparse tensor too) has another address, and empty tensors none."""
    if original.dtype != ours.dtype or original.shape != ours.shape:
        return False
    return original.data_ptr() == ours.data_ptr() or ours.numel() == 0


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


MAX_BANDWIDTH_SPREAD = 4.0
"""A declared bandwidth counts for at most this many times the group's median."""


def bounded_bandwidths(bandwidths: Sequence[float]) -> list[float]:
    """``bandwidths`` clipped to ``MAX_BANDWIDTH_SPREAD`` times their lower median. Bandwidth
    is declared, not measured, and a part's reducer is trusted with its values: one member
    declaring 1e300 was handed the whole vector (every other part empty) and could then
    send back anything as everyone's mean. Clipped, it reduces at most about 4x the
    median member's share. The lower median, so that in a pair (whose median is the mean)
    a liar still gets at most 4x the other's share, not all of it."""
    if not bandwidths:
        return []
    limit = statistics.median_low(bandwidths) * MAX_BANDWIDTH_SPREAD
    return [min(bandwidth, limit) for bandwidth in bandwidths]


def split_spans(total: int, bandwidths: Sequence[float], align: int = ALIGN) -> list[Span]:
    """Cut ``[0, total)`` into one span per bandwidth, sizes in proportion to it.

    Boundaries are multiples of ``align`` when every part can hold a few aligned blocks,
    else of 1. Parts may be empty (a zero share). The last span ends at ``total``. Any
    finite bandwidths (a joiner may declare 1e308): they are scaled by the largest first,
    so that their sum cannot overflow.

    Raises:
        ValueError: if there are no bandwidths, or one is negative or not finite, or all zero.
    """
    if not bandwidths:
        raise ValueError("need at least one bandwidth")
    if any(not math.isfinite(b) or b < 0 for b in bandwidths):
        raise ValueError("bandwidths must be finite and non-negative")
    top = max(bandwidths)
    if top <= 0:
        raise ValueError("at least one bandwidth must be positive")
    bandwidths = [bandwidth / top for bandwidth in bandwidths]
    weight = math.fsum(bandwidths)
    unit = align if total >= align * len(bandwidths) * 4 else 1
    units = -(-total // unit)
    spans: list[Span] = []
    start = 0
    acc = 0.0
    for i, bandwidth in enumerate(bandwidths):
        acc += bandwidth
        if i == len(bandwidths) - 1:
            stop = total
        else:
            stop = min(total, max(start, round(units * acc / weight) * unit))
        spans.append((start, stop))
        start = stop
    return spans


def check_spans(spans: Sequence[Span], total: int) -> None:
    """Check that ``spans`` tile ``[0, total)`` in order.

    Raises:
        ValueError: when they do not.
    """
    position = 0
    for start, stop in spans:
        if start != position or stop < start:
            raise ValueError(f"spans {list(spans)} do not tile [0, {total})")
        position = stop
    if position != total:
        raise ValueError(f"spans {list(spans)} do not tile [0, {total})")


def chunk_count(length: int, chunk_elements: int) -> int:
    """Number of chunks of a part of ``length`` elements."""
    return -(-length // chunk_elements)


def chunk_span(length: int, chunk_elements: int, index: int) -> Span:
    """Span of chunk ``index`` inside a part of ``length`` elements (part-relative)."""
    start = index * chunk_elements
    return start, min(length, start + chunk_elements)


def overlap(a: Span, b: Span) -> int:
    """Number of elements two spans share."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))
