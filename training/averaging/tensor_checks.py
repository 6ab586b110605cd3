"""The caller's tensors, checked before an averager takes them: a list of CPU, dense,
contiguous, writable floating tensors (numpy arrays are viewed through torch, without a
copy) of a dtype that averages, no two sharing memory. Each refusal names the tensor and
says what to pass instead."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .spans import Span

_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
_FLOAT8 = tuple(getattr(torch, name) for name in _FLOAT8_NAMES if hasattr(torch, name))
AVERAGED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, *_FLOAT8)
"""The float dtypes that average. Not the scale and packed formats (``float8_e8m0fnu``
holds no sign and no zero, ``float4_e2m1fn_x2`` two values per byte): a mean of them is
not a value of theirs."""

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
            tensor nor a numpy array (or one torch cannot view), a numpy masked array, or
            not floating, or of a float dtype that does not average (not in
            ``AVERAGED_DTYPES``: float8_e8m0fnu, float4_e2m1fn_x2).
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
                "p.grad = torch.zeros_like(p); a frozen parameter (requires_grad=False) never "
                "gets one: leave it out ([p.grad for p in model.parameters() if "
                "p.requires_grad])"
            )
        if isinstance(item, np.ma.MaskedArray):  # its mask would be silently ignored
            raise TypeError(
                f"tensor {i} is a numpy masked array: averaging ignores masks and would "
                "average the masked elements too; pass its .data to average every element"
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
        if tensor.device.type == "meta":  # no data: .to("cpu") fails, to_empty does not
            raise ValueError(
                f"tensor {i} is on meta (a shape without data): materialize the model first, "
                "e.g. model.to_empty(device='cpu') then initialize or load its weights"
            )
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {i} is on {tensor.device}: move it to the CPU")
        if tensor.layout != torch.strided:
            hint = ""
            if tensor.layout == torch.sparse_coo:  # nn.Embedding(sparse=True)'s .grad
                hint = (
                    " (a sparse gradient, e.g. nn.Embedding(sparse=True)'s: make the layer "
                    "with sparse=False, whose .grad is dense, to average it)"
                )
            raise ValueError(f"tensor {i} is {tensor.layout}: only dense tensors average{hint}")
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
