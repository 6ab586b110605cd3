"""The lossless-layout codecs: ``none`` (float32 as-is) and ``float16``.

Both carry NaN and infinity faithfully and never refuse finite input. float64 input is
rounded to the wire dtype once (float64 values beyond its range become infinite).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from .base import (
    CODEC_IDS,
    HEADER,
    MAGIC,
    VERSION,
    Blob,
    BlobHeader,
    Codec,
    Float32Array,
    as_float_array,
    header_size,
)


class NoneCodec(Codec):
    """No compression: the payload is the float32 values, little-endian, in C order.

    ``decode`` returns a zero-copy view of the blob: read-only when the blob is ``bytes``,
    and sharing memory with it otherwise. Use ``decode_into`` (or copy) for an owned array.
    float16 input is widened exactly; float64 input is rounded to float32.
    """

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = CODEC_IDS["none"]

    def _payload_size(self, n_elements: int) -> int:
        return 4 * n_elements

    def encode(self, array: npt.NDArray[Any]) -> bytes:
        """Encode ``array``; float32 input costs a single copy into the returned bytes.

        Raises:
            TypeError: if ``array`` is not float16, float32 or float64.
            LocalProtocolError: if ``array`` exceeds ``max_elements`` or 32 dimensions.
        """
        a = as_float_array(array)
        if a.dtype != np.dtype("<f4") or not a.flags.c_contiguous:
            return super().encode(a)
        self.encoded_size(a.size, a.ndim)  # enforces the limits
        header = bytearray(header_size(a.ndim, has_params=False))
        HEADER.pack_into(header, 0, MAGIC, self.codec_id, VERSION, 1, a.ndim, 0)
        header[HEADER.size :] = np.asarray(a.shape, dtype="<u8").tobytes()
        return b"".join((header, a.data))

    def _encode_payload(self, a: npt.NDArray[Any], payload: memoryview) -> int:
        dst = np.frombuffer(payload, dtype="<f4").reshape(a.shape)
        with np.errstate(over="ignore"):
            np.copyto(dst, a, casting="same_kind")
        return 0

    def decode(self, blob: Blob) -> Float32Array:
        """A float32 view of the blob's payload with the encoded shape (zero-copy).

        Raises:
            RemoteProtocolError: if ``blob`` is malformed, truncated, oversized, made by
                another codec, or holds more than ``max_elements`` elements.
        """
        header, payload = self._parse(blob)
        values: Float32Array = np.frombuffer(payload, dtype="<f4", count=header.n_elements)
        return values.reshape(header.shape)

    def _decode_payload(
        self, header: BlobHeader, payload: memoryview, out: Float32Array, out_is_zero: bool
    ) -> None:
        np.copyto(out, np.frombuffer(payload, dtype="<f4", count=header.n_elements))


class Float16Codec(Codec):
    """Half precision: the payload is the float16 values, little-endian, in C order.

    Rounds to nearest even: the relative error is at most 2**-11 in float16's normal range
    (magnitudes from 2**-14 to 65504); smaller magnitudes lose relative precision down to
    an absolute error of 2**-25. Magnitudes that round above 65504 become infinite (no
    error is raised); NaN and infinity stay what they are.
    """

    name: ClassVar[str] = "float16"
    codec_id: ClassVar[int] = CODEC_IDS["float16"]

    def _payload_size(self, n_elements: int) -> int:
        return 2 * n_elements

    def _encode_payload(self, a: npt.NDArray[Any], payload: memoryview) -> int:
        dst = np.frombuffer(payload, dtype="<f2")
        if a.dtype == np.dtype("<f4") and a.flags.c_contiguous:
            self.casts.to_half(a.reshape(-1), dst)
        else:
            with np.errstate(over="ignore"):
                np.copyto(dst.reshape(a.shape), a, casting="same_kind")
        return 0

    def _decode_payload(
        self, header: BlobHeader, payload: memoryview, out: Float32Array, out_is_zero: bool
    ) -> None:
        self.casts.to_float(np.frombuffer(payload, dtype="<f2", count=header.n_elements), out)
