"""The blob format shared by every codec, and the :class:`Codec` base class.

A blob is a fixed little-endian header followed by raw payload bytes (never msgpack)::

    offset  size     field
    0       2        magic b"SC"
    2       1        codec id (0 none, 1 float16, 2 int8, 3 topk)
    3       1        format version (1)
    4       1        dtype of the array that was encoded (1 float32, 2 float16, 3 float64)
    5       1        ndim (0..32)
    6       2        reserved, zero
    8       8*ndim   shape, one uint64 per dimension
    ...     0 or 8   codec parameter, uint64 (int8: block_size; topk: k)
    ...              payload; it starts at a multiple of 8, so its arrays are aligned

Decoding treats the blob as hostile: every size is checked against the header *before*
anything is allocated, and anything malformed raises
:class:`~protocol.errors.RemoteProtocolError` (a :class:`~protocol.errors.ProtocolError`),
never ``IndexError``, ``struct.error`` or ``MemoryError``.

Decoded arrays are always float32 with the encoded shape, whatever dtype was encoded.
A codec instance keeps scratch buffers between calls: it is cheap to reuse and not
thread-safe (use one instance per task or thread).
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

from ..errors import LocalProtocolError, RemoteProtocolError, SwarmError
from .casts import NUMPY_CASTS, Casts

MAGIC = b"SC"
VERSION = 1
MAX_NDIM = 32
HEADER = struct.Struct("<2sBBBBH")  # magic, codec id, version, dtype code, ndim, reserved
PARAMS_SIZE = 8
ELEMENTS_LIMIT = 1 << 32
"""Hard ceiling on ``max_elements`` (topk indices are uint32)."""
DEFAULT_MAX_ELEMENTS = 1 << 28
"""Default largest tensor a codec encodes or decodes: 256 Mi elements, 1 GiB as float32."""

DTYPE_CODES: dict[np.dtype[Any], int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(np.float64): 3,
}
DTYPE_NAMES: dict[int, str] = {1: "float32", 2: "float16", 3: "float64"}
CODEC_IDS: dict[str, int] = {"none": 0, "float16": 1, "int8": 2, "topk": 3}
CODEC_NAMES_BY_ID: dict[int, str] = {codec_id: name for name, codec_id in CODEC_IDS.items()}
PARAM_CODEC_IDS: frozenset[int] = frozenset({CODEC_IDS["int8"], CODEC_IDS["topk"]})
"""Codecs whose header carries the 8 parameter bytes."""

Blob: TypeAlias = bytes | bytearray | memoryview
"""Anything a blob may arrive as; a memoryview must be C-contiguous."""
Float32Array: TypeAlias = npt.NDArray[np.float32]


class NonFiniteError(SwarmError, ValueError):
    """The array holds NaN or infinity and the codec cannot represent it faithfully."""


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """The parsed, validated header of a codec blob."""

    codec: str
    """Name of the codec that made the blob."""
    source_dtype: str
    """Name of the dtype that was encoded (informational: decoding yields float32)."""
    shape: tuple[int, ...]
    n_elements: int
    param: int
    """int8: block_size; topk: k; 0 for the other codecs."""
    payload_offset: int


def header_size(ndim: int, has_params: bool) -> int:
    """Bytes before the payload for an array of ``ndim`` dimensions."""
    return HEADER.size + 8 * ndim + (PARAMS_SIZE if has_params else 0)


def read_header(blob: Blob) -> BlobHeader:
    """Parse and validate the header of ``blob`` (its payload is not examined).

    Raises:
        RemoteProtocolError: bad magic, unknown codec id, version or dtype code, ndim above
            32, nonzero reserved bits, a blob shorter than its header, or a shape of more
            than 2**32 elements.
    """
    mv = as_bytes_view(blob)
    if len(mv) < HEADER.size:
        raise RemoteProtocolError(f"codec blob of {len(mv)} bytes is shorter than its header")
    magic, codec_id, version, dtype_code, ndim, reserved = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad codec blob magic {magic!r}")
    if codec_id not in CODEC_NAMES_BY_ID:
        raise RemoteProtocolError(f"unknown codec id {codec_id}")
    if version != VERSION:
        raise RemoteProtocolError(f"unsupported codec blob version {version}")
    if dtype_code not in DTYPE_NAMES:
        raise RemoteProtocolError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise RemoteProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if reserved:
        raise RemoteProtocolError("reserved header bits are set")
    has_params = codec_id in PARAM_CODEC_IDS
    offset = header_size(ndim, has_params)
    if len(mv) < offset:
        raise RemoteProtocolError(f"codec blob of {len(mv)} bytes is shorter than its header")
    shape = struct.unpack_from(f"<{ndim}Q", mv, HEADER.size)
    # Bound the product with empty dimensions counted as 1, so that shapes such as
    # (0, 2**63) are refused too: numpy cannot allocate them.
    bound = 1
    for dim in shape:
        bound *= max(dim, 1)
        if bound > ELEMENTS_LIMIT:
            raise RemoteProtocolError(f"shape {shape} exceeds {ELEMENTS_LIMIT} elements")
    param = 0
    if has_params:
        (param,) = struct.unpack_from("<Q", mv, offset - PARAMS_SIZE)
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    return BlobHeader(
        CODEC_NAMES_BY_ID[codec_id], DTYPE_NAMES[dtype_code], shape, n_elements, param, offset
    )


def as_bytes_view(blob: Blob) -> memoryview:
    """A flat unsigned-byte view of ``blob``, without copying.

    Raises:
        TypeError: if ``blob`` is not a C-contiguous bytes-like object.
    """
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def as_float_array(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``array`` as an ndarray after checking that its dtype is float16, float32 or float64.

    Raises:
        TypeError: for any other dtype.
    """
    a = np.asarray(array)
    if a.dtype.kind != "f" or a.dtype.itemsize not in (2, 4, 8):
        raise TypeError(f"codecs encode float16, float32 or float64 arrays, not {a.dtype}")
    return a


def as_float32(a: npt.NDArray[Any]) -> Float32Array:
    """``a`` as a C-contiguous little-endian float32 array; no copy when it already is one.

    Values beyond the float32 range become infinite (without a warning).
    """
    with np.errstate(over="ignore"):
        return np.asarray(a, dtype="<f4", order="C")


def int_param(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int within [low, high] (numpy integers accepted, bools refused).

    Raises:
        TypeError: if ``value`` is not an integer.
        ValueError: if it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], not {value}")
    return int(value)


def check_out_array(out: npt.NDArray[Any], n_elements: int) -> Float32Array:
    """The flat float32 view of a caller-supplied output array.

    Raises:
        TypeError: if ``out`` is not a float32 ndarray.
        ValueError: if it is read-only or not C-contiguous.
        RemoteProtocolError: if its size differs from the blob's element count.
    """
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise TypeError("out must be a float32 numpy array")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    if out.size != n_elements:
        raise RemoteProtocolError(f"blob holds {n_elements} elements, out has {out.size}")
    flat: Float32Array = out.reshape(-1)
    return flat


class Codec(abc.ABC):
    """Base class: a tensor compression codec (numpy in, bytes out, float32 back).

    Subclasses define the payload; this class owns the header, the size checks and the
    buffer handling. Every codec accepts float16, float32 and float64 arrays of any shape
    (including 0-d and empty ones) and decodes to float32 of the same shape.

    Args:
        max_elements: the largest element count this instance encodes or decodes
            (at most 2**32). It bounds what a hostile header can make ``decode`` allocate.

    Raises:
        TypeError, ValueError: if ``max_elements`` is not an int in range.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    has_params: ClassVar[bool] = False
    """Whether the header carries the 8 parameter bytes (must match ``PARAM_CODEC_IDS``)."""
    zeroed_output: ClassVar[bool] = False
    """Whether decoding writes only some elements (so ``decode`` allocates zeros)."""
    finite_output: ClassVar[bool] = False
    """Whether decoded values are always finite (decoding refuses blobs that would not be),
    so that callers need not check them again."""

    def __init__(self, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
        self.max_elements = int_param("max_elements", max_elements, 0, ELEMENTS_LIMIT)
        self._scratch = bytearray()
        self.casts: Casts = NUMPY_CASTS
        """Bulk conversions (see ``casts``); a caller may install faster ones."""

    @property
    def params(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this codec with :func:`get_codec`."""
        return {"max_elements": self.max_elements}

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.params.items())
        return f"{type(self).__name__}({args})"

    # -- sizes --------------------------------------------------------------------------

    def encoded_size(self, n_elements: int, ndim: int = 1) -> int:
        """Exact size in bytes of the blob for an array of ``n_elements`` and ``ndim`` dims.

        Raises:
            LocalProtocolError: if ``n_elements`` exceeds ``max_elements`` or ``ndim`` 32.
            ValueError: if either is negative.
        """
        if n_elements < 0 or ndim < 0:
            raise ValueError("n_elements and ndim must be non-negative")
        if n_elements > self.max_elements:
            raise LocalProtocolError(
                f"{n_elements} elements exceed max_elements={self.max_elements}"
            )
        if ndim > MAX_NDIM:
            raise LocalProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
        return header_size(ndim, self.has_params) + self._payload_size(n_elements)

    @abc.abstractmethod
    def _payload_size(self, n_elements: int) -> int:
        """Payload bytes for ``n_elements`` (after the header)."""

    # -- encoding -----------------------------------------------------------------------

    def encode(self, array: npt.NDArray[Any]) -> bytes:
        """Encode ``array`` into a self-describing blob.

        Raises:
            TypeError: if ``array`` is not float16, float32 or float64.
            NonFiniteError: if the codec refuses non-finite values and ``array`` has some.
            LocalProtocolError: if ``array`` exceeds ``max_elements`` or 32 dimensions.
        """
        a = as_float_array(array)
        size = self.encoded_size(a.size, a.ndim)
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        mv = memoryview(self._scratch)
        written = self.encode_into(a, mv)
        return bytes(mv[:written])

    def encode_into(self, array: npt.NDArray[Any], out: bytearray | memoryview) -> int:
        """Encode ``array`` into the start of the writable buffer ``out``; no allocation.

        Returns the number of bytes written (:meth:`encoded_size`). On error the content
        of ``out`` is unspecified.

        Raises:
            TypeError: if ``array`` is not float16, float32 or float64, or ``out`` is
                read-only.
            ValueError: if ``out`` is shorter than the blob.
            NonFiniteError: if the codec refuses non-finite values and ``array`` has some.
            LocalProtocolError: if ``array`` exceeds ``max_elements`` or 32 dimensions.
        """
        a = as_float_array(array)
        size = self.encoded_size(a.size, a.ndim)
        mv = as_bytes_view(out)
        if mv.readonly:
            raise TypeError("out must be a writable buffer")
        if len(mv) < size:
            raise ValueError(f"out holds {len(mv)} bytes, the blob needs {size}")
        dtype_code = DTYPE_CODES[a.dtype.newbyteorder("=")]
        HEADER.pack_into(mv, 0, MAGIC, self.codec_id, VERSION, dtype_code, a.ndim, 0)
        struct.pack_into(f"<{a.ndim}Q", mv, HEADER.size, *a.shape)
        offset = header_size(a.ndim, self.has_params)
        param = self._encode_payload(a, mv[offset:size])
        if self.has_params:
            struct.pack_into("<Q", mv, offset - PARAMS_SIZE, param)
        return size

    @abc.abstractmethod
    def _encode_payload(self, a: npt.NDArray[Any], payload: memoryview) -> int:
        """Write the payload of ``a`` into ``payload`` (exactly sized); return the param."""

    # -- decoding -----------------------------------------------------------------------

    def decode(self, blob: Blob) -> Float32Array:
        """Decode ``blob`` into a new float32 array of the encoded shape.

        Raises:
            RemoteProtocolError: if ``blob`` is malformed, truncated, oversized, made by
                another codec, or holds more than ``max_elements`` elements.
        """
        header, payload = self._parse(blob)
        alloc = np.zeros if self.zeroed_output else np.empty
        out: Float32Array = alloc(header.shape, dtype=np.float32)
        self._decode_payload(header, payload, out.reshape(-1), self.zeroed_output)
        return out

    def decode_into(self, blob: Blob, out: npt.NDArray[np.float32]) -> Float32Array:
        """Decode ``blob`` into ``out``, a preallocated float32 array; returns ``out``.

        ``out`` must be C-contiguous, writable and hold exactly as many elements as the
        blob (its shape may differ: the values are written in C order). On error the
        content of ``out`` is unspecified.

        Raises:
            TypeError: if ``out`` is not a float32 ndarray.
            ValueError: if ``out`` is read-only or not C-contiguous.
            RemoteProtocolError: if ``blob`` is malformed (see :meth:`decode`) or its
                element count differs from ``out.size``.
        """
        header, payload = self._parse(blob)
        flat = check_out_array(out, header.n_elements)
        self._decode_payload(header, payload, flat, False)
        return out

    def validate(self, blob: Blob) -> BlobHeader:
        """Check ``blob`` as :meth:`decode` would, without keeping the values; its header.

        Cheap for codecs that can check a payload without decoding it (int8); the others
        decode it aside.

        Raises:
            RemoteProtocolError: if :meth:`decode` would raise it.
        """
        header, payload = self._parse(blob)
        self._validate_payload(header, payload)
        return header

    def _validate_payload(self, header: BlobHeader, payload: memoryview) -> None:
        """Raise what decoding the payload (exactly sized) would raise."""
        alloc = np.zeros if self.zeroed_output else np.empty
        out: Float32Array = alloc(header.n_elements, dtype=np.float32)
        self._decode_payload(header, payload, out, self.zeroed_output)

    def _parse(self, blob: Blob) -> tuple[BlobHeader, memoryview]:
        mv = as_bytes_view(blob)
        header = read_header(mv)
        if header.codec != self.name:
            raise RemoteProtocolError(f"blob was made by codec {header.codec!r}, not {self.name!r}")
        if header.n_elements > self.max_elements:
            raise RemoteProtocolError(
                f"blob holds {header.n_elements} elements, above max_elements={self.max_elements}"
            )
        expected = self._expected_payload_size(header)
        actual = len(mv) - header.payload_offset
        if actual != expected:
            raise RemoteProtocolError(f"payload is {actual} bytes, the header implies {expected}")
        return header, mv[header.payload_offset :]

    def _expected_payload_size(self, header: BlobHeader) -> int:
        """Validate the codec parameter; return the payload size it implies."""
        return self._payload_size(header.n_elements)

    @abc.abstractmethod
    def _decode_payload(
        self, header: BlobHeader, payload: memoryview, out: Float32Array, out_is_zero: bool
    ) -> None:
        """Validate the payload (exactly sized) and write its values into flat ``out``."""
