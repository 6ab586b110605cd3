"""The round's codec applied to ranges of the flat vector, one blob per tensor.

The flat vector puts the tensors end to end, and a chunk may span several of them. int8
scales each block of ``block_size`` elements by the block's largest magnitude: a block
that straddles two tensors would quantize a tensor of small values (a bias, a LayerNorm
gradient) with its neighbour's scale (values of ~1 next to values of ~100 came back with
errors of ~1.3, 56x the bound of their own magnitudes). So under int8 a chunk's payload is
one blob per tensor it overlaps, end to end, each over that tensor's share of the chunk:
blocks restart at every tensor boundary (protocol.md, section 9.1, "Chunks that span
tensors"). A chunk within one tensor is a single blob, as before. The other codecs have no
blocks (float16 and none work per element; topk picks its ``k`` over the whole chunk) and
keep one blob per chunk.

Everyone derives the same pieces from the layout (the tensors' sizes, part of the layout
fingerprint), so a payload's size is known before it is read.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.codecs import Int8Codec
from protocol.codecs.base import Codec, Float32Array, header_size, read_header
from protocol.errors import RemoteProtocolError

Span = tuple[int, int]

MANY_PIECES = 16
"""Ranges of more pieces than this are encoded and decoded in whole-range passes
(``Int8Codec.encode_pieces_into``): a codec call per piece costs ~40 us of Python, the
passes ~0.8 ms per 524,288 values in up to ~500 pieces (measured on this project's 2-core
VM: 200,000 tensors of 3 values took 7.7 s to encode a piece at a time, 35 ms at once; the
two break even at 16 to 32 pieces a chunk)."""


class RangeCodec:
    """``codec`` over ranges ``[start, stop)`` of a flat vector whose tensors begin at
    ``offsets`` (the flat vector's ``offsets``: 0, each tensor's end, the total)."""

    def __init__(self, codec: Codec, offsets: Sequence[int]) -> None:
        self.codec = codec
        inner = sorted({int(x) for x in offsets[1:-1]}) if len(offsets) > 2 else []
        # only int8 has blocks to keep within a tensor
        self.cuts: tuple[int, ...] = tuple(inner) if isinstance(codec, Int8Codec) else ()

    def _check_blob(self, blob: bytes | memoryview, length: int) -> None:
        """An int8 blob must be of the round's block size, over ``length`` elements in one
        dimension: the codec decodes any block size, and another one that makes as many
        blocks has the same size (a review: blocks of 300 under a round's 256 counted,
        straddling the round's blocks, so a tensor's error no longer bounded by its own
        magnitudes). The other codecs' sizes pin their parameters.

        Raises:
            RemoteProtocolError: another block size, or shape.
        """
        if not isinstance(self.codec, Int8Codec):
            return
        header = read_header(blob)
        if header.codec == "int8" and header.param != self.codec.block_size:
            raise RemoteProtocolError(
                f"an int8 blob of block_size {header.param}, not the round's "
                f"{self.codec.block_size}"
            )
        if header.shape != (length,):
            raise RemoteProtocolError(f"a blob of shape {header.shape}, not ({length},)")

    def pieces(self, start: int, stop: int) -> list[Span]:
        """``[start, stop)`` cut at the tensor boundaries inside it (flat indices)."""
        cuts = self.cuts
        if not cuts:
            return [(start, stop)]
        out: list[Span] = []
        i = bisect.bisect_right(cuts, start)
        while i < len(cuts) and cuts[i] < stop:
            out.append((start, cuts[i]))
            start = cuts[i]
            i += 1
        out.append((start, stop))
        return out

    def encoded_size(self, start: int, stop: int) -> int:
        """Bytes of the payload of ``flat[start:stop]``.

        Raises:
            LocalProtocolError: as the codec's ``encoded_size``.
        """
        if not self.cuts:
            return self.codec.encoded_size(stop - start)
        return sum(self.codec.encoded_size(b - a) for a, b in self.pieces(start, stop))

    def most_cuts(self, window: int) -> int:
        """The most tensor boundaries any range of ``window`` elements has inside it."""
        if not self.cuts:
            return 0
        # a range starting just before each cut: the cuts before its end, less those before
        # it (one numpy pass: a loop over 80,000 tensors' cuts took 70 ms a call)
        cuts = np.asarray(self.cuts, dtype=np.int64)
        inside = np.searchsorted(cuts, cuts + (window - 1), side="left") - np.arange(cuts.size)
        return int(inside.max())

    def piece_overhead(self) -> int:
        """The most bytes a tensor boundary inside a range adds to its payload: a second
        blob header and a block's scale."""
        return header_size(1, self.codec.has_params) + 4 if self.cuts else 0

    def encode_into(self, values: npt.NDArray[Any], out: bytearray | memoryview, start: int) -> int:
        """Encode ``values`` (``flat[start:start + len(values)]``) into ``out``; the size.

        Raises:
            NonFiniteError, LocalProtocolError: as the codec's ``encode_into``.
        """
        stop = start + len(values)
        pieces = self.pieces(start, stop)
        if len(pieces) == 1:
            return self.codec.encode_into(values, out)
        if len(pieces) > MANY_PIECES:
            assert isinstance(self.codec, Int8Codec)  # (the only codec with pieces)
            return self.codec.encode_pieces_into(values, [b - a for a, b in pieces], out)
        view, offset = memoryview(out), 0
        for a, b in pieces:
            offset += self.codec.encode_into(values[a - start : b - start], view[offset:])
        return offset

    def decode_into(
        self, payload: bytes | memoryview, out: Float32Array, start: int
    ) -> Float32Array:
        """Decode the payload of ``flat[start:start + out.size]`` into ``out``.

        Raises:
            RemoteProtocolError: a blob that is malformed or not of its piece's size, or
                bytes left over.
        """
        pieces = self.pieces(start, start + out.size)
        if len(pieces) == 1:
            self._check_blob(payload, out.size)
            return self.codec.decode_into(payload, out)
        if len(pieces) > MANY_PIECES:
            assert isinstance(self.codec, Int8Codec)
            return self.codec.decode_pieces_into(payload, [b - a for a, b in pieces], out)
        view, offset = memoryview(payload).cast("B"), 0
        for a, b in pieces:
            size = self.codec.encoded_size(b - a)
            if offset + size > view.nbytes:
                raise RemoteProtocolError("a payload shorter than its tensors' blobs")
            self._check_blob(view[offset : offset + size], b - a)
            self.codec.decode_into(view[offset : offset + size], out[a - start : b - start])
            offset += size
        if offset != view.nbytes:
            raise RemoteProtocolError("a payload longer than its tensors' blobs")
        return out
