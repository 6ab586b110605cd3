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

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ..errors import RemoteProtocolError
from .base import (
    CODEC_IDS,
    DEFAULT_MAX_ELEMENTS,
    DTYPE_CODES,
    HEADER,
    MAGIC,
    VERSION,
    BlobHeader,
    Codec,
    Float32Array,
    NonFiniteError,
    as_bytes_view,
    as_float32,
    as_float_array,
    header_size,
    int_param,
    read_header,
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

    # -- many blobs at once --------------------------------------------------------------

    def encode_pieces_into(
        self, array: npt.NDArray[Any], lengths: Sequence[int], out: bytearray | memoryview
    ) -> int:
        """Encode 1-d ``array`` as one blob per consecutive piece of ``lengths`` elements,
        end to end in ``out``: byte for byte what :meth:`encode_into` makes of each piece
        in turn, in a few passes over the whole array (a call per piece costs tens of
        microseconds of Python: 200,000 tiny tensors took seconds). Returns the size.

        Raises:
            ValueError: if ``lengths`` do not tile the array, or ``out`` is too short.
            TypeError, NonFiniteError, LocalProtocolError: as :meth:`encode_into`.
        """
        a = as_float_array(array)
        x = as_float32(a).reshape(-1)
        plan = _PiecesPlan(lengths, self.block_size, x.size)
        self.encoded_size(int(plan.lengths.max(initial=0)))  # within max_elements
        mv = as_bytes_view(out)
        if mv.readonly:
            raise TypeError("out must be a writable buffer")
        if len(mv) < plan.total:
            raise ValueError(f"out holds {len(mv)} bytes, the blobs need {plan.total}")
        if plan.n_blocks:
            absmax = np.maximum.reduceat(np.abs(x), plan.block_starts)
            if not np.isfinite(absmax).all():
                raise NonFiniteError("int8 cannot encode NaN or infinity")
            scales = np.divide(absmax, np.float32(127)).astype(np.float32, copy=False)
            np.minimum(scales, MAX_SCALE, out=scales)
            normal = scales >= _FLT_MIN
            scales[~normal] = 0
            inverse = np.zeros_like(scales)
            np.divide(np.float32(1), scales, out=inverse, where=normal)
            t = x * np.repeat(inverse, plan.block_lengths)
            np.rint(t, out=t)
            q = t.astype(np.int8)
        else:
            scales, q = np.zeros(0, np.float32), np.zeros(0, np.int8)
        dtype_code = DTYPE_CODES[a.dtype.newbyteorder("=")]
        target = np.frombuffer(mv, dtype=np.uint8, count=plan.total)
        kinds = plan.byte_kinds()
        target[kinds == 0] = plan.headers(self.codec_id, dtype_code).reshape(-1)
        target[kinds == 1] = scales.astype("<f4", copy=False).view(np.uint8)
        target[kinds == 2] = q.view(np.uint8)
        return plan.total

    def decode_pieces_into(
        self, blob: bytes | memoryview, lengths: Sequence[int], out: Float32Array
    ) -> Float32Array:
        """Decode blobs of this codec's ``block_size`` over consecutive pieces of
        ``lengths`` elements (what :meth:`encode_pieces_into` makes) into 1-d ``out``.

        Raises:
            RemoteProtocolError: as :meth:`decode_into` of each piece, a blob of another
                block size (which :meth:`decode_into` takes), or a payload whose size is
                not theirs.
            ValueError: if ``lengths`` do not tile ``out``.
        """
        plan = _PiecesPlan(lengths, self.block_size, out.size)
        mv = as_bytes_view(blob)
        if len(mv) != plan.total:
            raise RemoteProtocolError(f"{len(mv)} bytes, not the {plan.total} of the blobs")
        source = np.frombuffer(mv, dtype=np.uint8)
        kinds = plan.byte_kinds()
        headers = source[kinds == 0].reshape(-1, plan.header_size).copy()
        dtype_codes = headers[:, 4].copy()
        headers[:, 4] = 1
        expected = plan.headers(self.codec_id, 1)
        if not (np.array_equal(headers, expected) and np.isin(dtype_codes, (1, 2, 3)).all()):
            # another header somewhere: each blob on its own says what is wrong with it
            offset = 0
            for start, length in zip(plan.starts.tolist(), plan.lengths.tolist(), strict=True):
                size = self.encoded_size(length)
                piece = mv[offset : offset + size]
                header = read_header(piece)
                if header.codec == self.name and header.param != self.block_size:
                    # (as many blocks of another size would decode: blocks of ours, stated)
                    raise RemoteProtocolError(
                        f"an int8 blob of block_size {header.param}, not {self.block_size}"
                    )
                self.decode_into(piece, out[start : start + length])
                offset += size
            return out
        scales = source[kinds == 1].view("<f4")
        q = source[kinds == 2].view(np.int8)
        if not ((scales >= 0) & (scales <= MAX_SCALE)).all():
            raise RemoteProtocolError("int8 scales must be finite, non-negative and bounded")
        if q.size and q.min() < -127:
            raise RemoteProtocolError("int8 value -128 is not allowed")
        np.multiply(q, np.repeat(scales, plan.block_lengths), out=out, casting="unsafe")
        return out

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


class _PiecesPlan:
    """Where the blobs of consecutive pieces put their headers, scales and values."""

    def __init__(self, lengths: Sequence[int], block_size: int, n: int) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if (self.lengths < 0).any() or int(self.lengths.sum()) != n:
            raise ValueError(f"piece lengths {list(lengths)[:8]}... do not tile {n} values")
        self.block_size = block_size
        self.header_size = header_size(1, True)
        self.starts = np.cumsum(self.lengths) - self.lengths
        blocks = -(-self.lengths // block_size)
        self.blocks = blocks
        self.n_blocks = int(blocks.sum())
        piece_of_block = np.repeat(np.arange(len(self.lengths)), blocks)
        index_in_piece = np.arange(self.n_blocks) - (np.cumsum(blocks) - blocks)[piece_of_block]
        self.block_starts = self.starts[piece_of_block] + index_in_piece * block_size
        self.block_lengths = np.minimum(
            block_size, self.lengths[piece_of_block] - index_in_piece * block_size
        )
        self.total = int((self.header_size + 4 * blocks + self.lengths).sum())

    def byte_kinds(self) -> npt.NDArray[np.uint8]:
        """Per byte of the blobs: 0 a header's, 1 a scale's, 2 a value's."""
        m = len(self.lengths)
        sizes = np.empty(3 * m, dtype=np.int64)
        sizes[0::3] = self.header_size
        sizes[1::3] = 4 * self.blocks
        sizes[2::3] = self.lengths
        return np.repeat(np.tile(np.arange(3, dtype=np.uint8), m), sizes)

    def headers(self, codec_id: int, dtype_code: int) -> npt.NDArray[np.uint8]:
        """Each blob's header, one row each: 1-d of its piece's length, our block size."""
        m = len(self.lengths)
        rows = np.empty((m, self.header_size), dtype=np.uint8)
        fixed = HEADER.pack(MAGIC, codec_id, VERSION, dtype_code, 1, 0)
        rows[:, : HEADER.size] = np.frombuffer(fixed, dtype=np.uint8)
        rows[:, HEADER.size : HEADER.size + 8] = (
            self.lengths.astype("<u8").view(np.uint8).reshape(m, 8)
        )
        rows[:, HEADER.size + 8 :] = np.frombuffer(
            np.uint64(self.block_size).astype("<u8").tobytes(), np.uint8
        )
        return rows
