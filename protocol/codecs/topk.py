"""Top-k sparsification: keep the k largest magnitudes, send them as (index, value) pairs.

Payload::

    uint32 indices[k] (strictly increasing) | float32 values[k]

so the wire size is ``8 * k`` plus the header. Values are sent exactly (as float32); the
rest decode to zero. Among equal magnitudes at the threshold, lower indices win, so the
choice is deterministic.

Error feedback is the caller's job: :meth:`TopKCodec.encode_with_residual` returns what was
not sent (``input - decoded``, exactly), to be added to the next round's input::

    blob, residual = codec.encode_with_residual(grad + residual)

or, in place on an accumulator, ``codec.encode_with_residual(acc, residual_out=acc)``.

Non-finite input is refused with :class:`NonFiniteError`. Decoding refuses k > n,
indices that are out of range, repeated or unsorted, and non-finite values.

Selection is exact: the threshold is first estimated on a strided sample (deterministic),
then the exact top k is chosen among the elements above it; if the estimate was too high
(fewer than k candidates) or useless (too many), it falls back to one full partition.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import RemoteProtocolError
from .base import (
    CODEC_IDS,
    DEFAULT_MAX_ELEMENTS,
    ELEMENTS_LIMIT,
    BlobHeader,
    Codec,
    Float32Array,
    NonFiniteError,
    as_float32,
    as_float_array,
    int_param,
)

Indices = npt.NDArray[np.intp]

SAMPLE_SIZE = 1 << 14
"""Elements sampled to estimate the threshold (arrays of at least 4x this size)."""


def _select(mag: Float32Array, k: int) -> Indices:
    """Sorted positions of the ``k`` largest entries of ``mag`` (ties: lower positions)."""
    n = mag.size
    if k >= n:
        return np.arange(n)
    if k == 0:
        return np.empty(0, dtype=np.intp)
    kth = np.partition(mag, n - k)[n - k]
    keep = mag > kth
    need = k - int(np.count_nonzero(keep))
    keep[np.flatnonzero(mag == kth)[:need]] = True
    return np.flatnonzero(keep)


def top_indices(mag: Float32Array, k: int) -> Indices:
    """Sorted indices of the ``k`` largest values of the non-negative 1-d array ``mag``.

    Among equal values at the threshold the lower indices are chosen.
    """
    n = mag.size
    if n >= 4 * SAMPLE_SIZE and 0 < k <= n // 8:
        sample = mag[:: n // SAMPLE_SIZE]
        m = sample.size
        expected = k * m / n
        rank = min(m, math.ceil(1.25 * expected + 4 * math.sqrt(expected) + 16))
        threshold = np.partition(sample, m - rank)[m - rank]
        candidates = np.flatnonzero(mag >= threshold)
        if k <= candidates.size <= 4 * k + SAMPLE_SIZE:
            chosen: Indices = candidates[_select(mag[candidates], k)]
            return chosen
    return _select(mag, k)


class TopKCodec(Codec):
    """Keeps the k largest magnitudes (see the module docstring for the format).

    Args:
        k: how many values to keep (at most the array's size), or
        fraction: the share of values to keep, in (0, 1]: ``ceil(fraction * n)``.
        max_elements: see :class:`Codec`.

    Exactly one of ``k`` and ``fraction`` must be given. Decoding accepts any k. The
    instance keeps a float32 scratch buffer as large as the largest array it encoded.

    Raises:
        ValueError: if neither or both of ``k`` and ``fraction`` are given, or either is
            out of range.
        TypeError: if ``k`` is not an int.
    """

    name: ClassVar[str] = "topk"
    codec_id: ClassVar[int] = CODEC_IDS["topk"]
    has_params: ClassVar[bool] = True
    finite_output: ClassVar[bool] = True
    zeroed_output: ClassVar[bool] = True

    def __init__(
        self,
        k: int | None = None,
        *,
        fraction: float | None = None,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        super().__init__(max_elements=max_elements)
        if (k is None) == (fraction is None):
            raise ValueError("topk takes exactly one of k and fraction")
        self.k = None if k is None else int_param("k", k, 1, ELEMENTS_LIMIT)
        if fraction is not None and (
            isinstance(fraction, bool)
            or not isinstance(fraction, float | int | np.floating)
            or not 0 < fraction <= 1
        ):
            raise ValueError("topk fraction must be a number in (0, 1]")
        self.fraction = None if fraction is None else float(fraction)
        self._mag = np.empty(0, dtype=np.float32)
        self._last_indices: Indices = np.empty(0, dtype=np.intp)

    @property
    def params(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this codec with :func:`get_codec`."""
        chosen = {"k": self.k} if self.k is not None else {"fraction": self.fraction}
        return {**chosen, **super().params}

    def k_for(self, n_elements: int) -> int:
        """How many values an array of ``n_elements`` keeps."""
        if self.k is not None:
            return min(self.k, n_elements)
        assert self.fraction is not None
        return min(n_elements, math.ceil(self.fraction * n_elements))

    def _payload_size(self, n_elements: int) -> int:
        return 8 * self.k_for(n_elements)

    # -- encoding -----------------------------------------------------------------------

    def _encode_payload(self, a: npt.NDArray[Any], payload: memoryview) -> int:
        x = as_float32(a).reshape(-1)
        n = x.size
        k = self.k_for(n)
        self._last_indices = np.empty(0, dtype=np.intp)
        if n == 0:
            return 0
        if self._mag.size < n:
            self._mag = np.empty(n, dtype=np.float32)
        mag = np.abs(x, out=self._mag[:n])
        if not np.isfinite(mag.max()):
            raise NonFiniteError("topk cannot encode NaN or infinity")
        indices = top_indices(mag, k)
        np.copyto(np.frombuffer(payload, dtype="<u4", count=k), indices, casting="unsafe")
        np.take(x, indices, out=np.frombuffer(payload, dtype="<f4", count=k, offset=4 * k))
        self._last_indices = indices
        return k

    def encode_with_residual(
        self, array: npt.NDArray[Any], residual_out: npt.NDArray[Any] | None = None
    ) -> tuple[bytes, npt.NDArray[Any]]:
        """Encode ``array`` and return ``(blob, residual)``, ``residual = array - decoded``.

        The residual has the dtype and shape of ``array`` and is exact: zero where a value
        was sent (for float64 input, the float32 rounding error of the sent value) and the
        input elsewhere. It is written into ``residual_out`` when given (which may be
        ``array`` itself, for in-place error feedback), else into a new array.

        Raises:
            TypeError: if ``array`` is not float16, float32 or float64, or
                ``residual_out`` does not match its dtype and shape.
            ValueError: if ``residual_out`` is read-only or not C-contiguous.
            NonFiniteError: if ``array`` holds NaN or infinity.
            LocalProtocolError: if ``array`` exceeds ``max_elements`` or 32 dimensions.
        """
        a = as_float_array(array)
        if residual_out is not None:
            if residual_out.dtype != a.dtype or residual_out.shape != a.shape:
                raise TypeError("residual_out must match the array's dtype and shape")
            if not residual_out.flags.c_contiguous or not residual_out.flags.writeable:
                raise ValueError("residual_out must be C-contiguous and writable")
        blob = self.encode(a)
        indices, self._last_indices = self._last_indices, np.empty(0, dtype=np.intp)
        sent = as_float32(a).reshape(-1)[indices]  # exactly the values in the blob
        if residual_out is None:
            residual = np.array(a, order="C", copy=True)
        else:
            residual = residual_out
            if residual.ctypes.data != a.ctypes.data or not a.flags.c_contiguous:
                np.copyto(residual, a)  # (skipped when residual_out is the input itself)
        flat = residual.reshape(-1)
        flat[indices] -= sent.astype(a.dtype)  # exact: x - x, or x - float32(x) in float64
        return blob, residual

    # -- decoding -----------------------------------------------------------------------

    def _expected_payload_size(self, header: BlobHeader) -> int:
        if header.param > header.n_elements:
            raise RemoteProtocolError(f"topk k={header.param} exceeds {header.n_elements}")
        return 8 * header.param

    def _decode_payload(
        self, header: BlobHeader, payload: memoryview, out: Float32Array, out_is_zero: bool
    ) -> None:
        k = header.param
        indices = np.frombuffer(payload, dtype="<u4", count=k)
        values = np.frombuffer(payload, dtype="<f4", count=k, offset=4 * k)
        if k:
            if int(indices[-1]) >= header.n_elements:
                raise RemoteProtocolError("topk index out of range")
            if not (indices[1:] > indices[:-1]).all():
                raise RemoteProtocolError("topk indices must be strictly increasing")
            if not np.isfinite(values).all():
                raise RemoteProtocolError("topk values must be finite")
        if not out_is_zero:
            out.fill(0)
        out[indices] = values
