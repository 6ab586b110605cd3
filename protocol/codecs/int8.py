"""Blockwise 8-bit quantization with one absmax scale per block.

The flat array is cut into blocks of ``block_size`` elements (the last may be shorter).
For each block, ``scale = absmax / 127`` (float32) and each value is sent as
``round(x / scale)`` in int8, within [-127, 127]. Payload::

    float32 scales[n_blocks] | int8 values[n_elements]

so the wire size is ``n + 4 * ceil(n / block_size)`` plus the header: 0.2502x of float32
at the default block of 4096.

Error bound: ``|x - decoded| <= absmax(block) / 254`` plus float32 rounding (about 1e-7
of absmax). Two edge cases: a block whose scale would be subnormal (absmax below about
1.5e-36) is sent as zeros, and scales are capped just below ``FLT_MAX / 127`` so that
decoding never overflows; both stay within the bound up to float32 rounding, except that
flushed blocks err by their absmax (< 1.5e-36).

Non-finite input is refused with :class:`NonFiniteError`. Decoding refuses negative, NaN,
infinite or overlarge scales and the value -128, so a decoded array is always finite.

Arrays are processed in cache-sized chunks of whole blocks, into scratch buffers kept on
the instance, so that no temporary of the array's size is created.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import RemoteProtocolError
from .base import (
    CODEC_IDS,
    DEFAULT_MAX_ELEMENTS,
    BlobHeader,
    Codec,
    Float32Array,
    NonFiniteError,
    as_float32,
    int_param,
)

DEFAULT_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 31
CHUNK_ELEMENTS = 1 << 18
"""Elements processed per step (1 MiB of float32): the temporaries stay in cache."""

_FLT_MIN = np.finfo(np.float32).tiny


def _largest_safe_scale() -> np.float32:
    """The largest float32 scale with ``127 * scale`` finite."""
    scale = np.float32(np.finfo(np.float32).max) / np.float32(127)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(127) * scale):
            scale = np.nextafter(scale, np.float32(0))
    return np.float32(scale)


MAX_SCALE = _largest_safe_scale()


class Int8Codec(Codec):
    """Blockwise absmax int8 quantization (see the module docstring for the format).

    Args:
        block_size: elements per scale, 1 to 2**31. Decoding accepts any block size.
        max_elements: see :class:`Codec`.

    Raises:
        TypeError: if ``block_size`` is not an int.
        ValueError: if ``block_size`` is out of range.
    """

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = CODEC_IDS["int8"]
    has_params: ClassVar[bool] = True
    finite_output: ClassVar[bool] = True

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, *, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> None:
        super().__init__(max_elements=max_elements)
        self.block_size = int_param("block_size", block_size, 1, MAX_BLOCK_SIZE)
        self._work = np.empty(0, dtype=np.float32)

    @property
    def params(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this codec with :func:`get_codec`."""
        return {"block_size": self.block_size, **super().params}

    def _payload_size(self, n_elements: int) -> int:
        return n_elements + 4 * -(-n_elements // self.block_size)

    def _work_buffer(self, n_elements: int) -> Float32Array:
        if self._work.size < n_elements:
            self._work = np.empty(n_elements, dtype=np.float32)
        return self._work[:n_elements]

    # -- encoding -----------------------------------------------------------------------

    def _encode_payload(self, a: npt.NDArray[Any], payload: memoryview) -> int:
        x = as_float32(a).reshape(-1)
        n, bs = x.size, self.block_size
        n_blocks = -(-n // bs)
        scales = np.frombuffer(payload, dtype="<f4", count=n_blocks)
        q = np.frombuffer(payload, dtype=np.int8, count=n, offset=4 * n_blocks)
        full = n // bs
        self._quantize(x[: full * bs].reshape(full, bs), q[: full * bs].reshape(full, bs), scales)
        if full < n_blocks:
            tail = x[full * bs :].reshape(1, -1)
            self._quantize(tail, q[full * bs :].reshape(1, -1), scales[full:])
        return bs

    def _quantize(self, x: Float32Array, q: npt.NDArray[np.int8], scales: Float32Array) -> None:
        """Quantize the rows of ``x`` (one block each) into ``q`` and ``scales``."""
        n_rows, width = x.shape
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        work = self._work_buffer(step * width + 3 * step)
        for start in range(0, n_rows, step):
            stop = min(start + step, n_rows)
            rows = stop - start
            xc = x[start:stop]
            # (rows,) temporaries live at the end of the work buffer
            absmax = work[step * width : step * width + rows]
            negmin = work[step * width + step : step * width + step + rows]
            inverse = work[step * width + 2 * step : step * width + 2 * step + rows]
            np.max(xc, axis=1, out=absmax)
            np.min(xc, axis=1, out=negmin)
            np.negative(negmin, out=negmin)
            np.maximum(absmax, negmin, out=absmax)  # NaN propagates through max and min
            if not np.isfinite(absmax).all():
                raise NonFiniteError("int8 cannot encode NaN or infinity")
            sc = scales[start:stop]
            np.divide(absmax, np.float32(127), out=sc)
            np.minimum(sc, MAX_SCALE, out=sc)
            normal: npt.NDArray[np.bool_] = sc >= _FLT_MIN
            sc[~normal] = 0  # flush blocks whose scale would be subnormal (or is zero)
            inverse.fill(0)
            np.divide(np.float32(1), sc, out=inverse, where=normal)
            t = work[: rows * width].reshape(rows, width)
            self.casts.scale_rows(xc, inverse, t)
            np.rint(t, out=t)
            np.copyto(q[start:stop], t, casting="unsafe")  # |t| <= 127: exact

    # -- decoding -----------------------------------------------------------------------

    def _expected_payload_size(self, header: BlobHeader) -> int:
        block_size = header.param
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise RemoteProtocolError(f"int8 block_size {block_size} out of range")
        n = header.n_elements
        return n + 4 * -(-n // block_size)

    def _validate_payload(self, header: BlobHeader, payload: memoryview) -> None:
        self._checked_arrays(header, payload)

    @staticmethod
    def _checked_arrays(
        header: BlobHeader, payload: memoryview
    ) -> tuple[Float32Array, npt.NDArray[np.int8]]:
        """The payload's scales and values, checked (see the module docstring)."""
        n, bs = header.n_elements, header.param
        n_blocks = -(-n // bs)
        scales = np.frombuffer(payload, dtype="<f4", count=n_blocks)
        q = np.frombuffer(payload, dtype=np.int8, count=n, offset=4 * n_blocks)
        if not ((scales >= 0) & (scales <= MAX_SCALE)).all():
            raise RemoteProtocolError("int8 scales must be finite, non-negative and bounded")
        if n and q.min() < -127:
            raise RemoteProtocolError("int8 value -128 is not allowed")
        return scales, q

    def _decode_payload(
        self, header: BlobHeader, payload: memoryview, out: Float32Array, out_is_zero: bool
    ) -> None:
        n, bs = header.n_elements, header.param
        if n == 0:
            return
        scales, q = self._checked_arrays(header, payload)
        n_blocks = len(scales)
        full = n // bs
        self._dequantize(q[: full * bs].reshape(full, bs), scales, out[: full * bs])
        if full < n_blocks:
            self._dequantize(q[full * bs :].reshape(1, -1), scales[full:], out[full * bs :])

    def _dequantize(self, q: npt.NDArray[np.int8], scales: Float32Array, out: Float32Array) -> None:
        n_rows, width = q.shape
        out2 = out.reshape(n_rows, width)
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        for start in range(0, n_rows, step):
            stop = min(start + step, n_rows)
            # widen, then scale in place while the rows are in cache: two same-type loops
            # beat numpy's mixed int8 x float32 multiply
            rows = out2[start:stop]
            self.casts.to_float(q[start:stop].reshape(-1), rows.reshape(-1))
            self.casts.scale_rows(rows, scales[start:stop], rows)
