"""Top-k error feedback: what compression kept out of our contributions goes into the next.

With the ``topk`` codec every contribution is sparse, so each peer keeps a residual, one
float32 per element of the flat vector (per tensor slot), and one round goes::

    c = x + residual            # our contribution: this round's values plus what is owed
    residual = c                # everything is owed ...
    send topk(c) chunk by chunk (our own part too: the reducer sparsifies its own values)
    residual -= topk(c)         # ... except what a reducer counted (its result header says)

so after any number of rounds, exactly (elementwise, ``c - s + s == c`` in float32)::

    sum of what the reducers counted from us + residual == sum of our inputs

(up to the rounding of the additions ``x + residual``). A part whose reducer did not count
us (dead, refused, deadline) leaves all of ``c`` owed: the next round sends it. Reducers send
the mean back losslessly (every non-zero of the sum of sparse contributions; see
``reducing``), so the averaged values are exactly the weighted mean of what was counted.
Non-finite values are never carried: an owed NaN or infinity is reset to zero.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np

from protocol.codecs import Codec

from .layout import FlatVector, Float32Array, chunk_count, chunk_span

logger = logging.getLogger(__name__)

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residual of one averager and the blobs it sent in the current round."""

    def __init__(self, total: int, codec: Codec, chunk_elements: int) -> None:
        self.residual: Float32Array = np.zeros(total, dtype=np.float32)  # (total,)
        self.codec = codec
        self.chunk_elements = chunk_elements
        self._scratch: Float32Array = np.empty(chunk_elements, dtype=np.float32)
        self._sent: dict[int, list[tuple[int, bytes]]] = {}  # part -> (flat start, blob)

    def begin(self, flat: FlatVector) -> None:
        """Load the tensors into ``flat`` and add the residual: the round's contribution.
        Until :meth:`finish`, all of it is owed."""
        flat.load()
        # values near FLT_MAX plus what is owed may overflow: the infinity is dropped as
        # non-finite like any other; numpy's warning must not escape step() (-W error)
        with np.errstate(over="ignore"):
            np.add(flat.array, self.residual, out=flat.array)
        np.copyto(self.residual, flat.array)
        self._sent.clear()

    def record(self, part: int, start: int, blob: bytes) -> None:
        """We sent ``blob`` for ``flat[start:...]`` of ``part``."""
        self._sent.setdefault(part, []).append((start, blob))

    def sparsify_own(self, part: int, values: Float32Array, start: int) -> None:
        """Replace our own part's values (``flat[start:start+len]``, in place) by their
        top-k, chunk by chunk, as if we had sent them to ourselves.

        Raises:
            NonFiniteError: if the values hold NaN or infinity (the caller drops them).
        """
        length = len(values)
        for index in range(chunk_count(length, self.chunk_elements)):
            a, b = chunk_span(length, self.chunk_elements, index)
            blob = self.codec.encode(values[a:b])
            self.codec.decode_into(blob, values[a:b])
            self.record(part, start + a, blob)

    def finish(self, counted: Collection[int]) -> None:
        """Subtract what we sent for the ``counted`` parts (those whose reducer's result
        header lists us, even if its result did not reach us); keep the rest owed."""
        for part in counted:
            for start, blob in self._sent.get(part, ()):
                header_n = self._decode(blob)
                self.residual[start : start + header_n] -= self._scratch[:header_n]
        self._sent.clear()
        if not np.isfinite(self.residual).all():
            logger.warning("error feedback: dropping non-finite owed values")
            np.nan_to_num(self.residual, copy=False, nan=0.0, posinf=0.0, neginf=0.0)

    def _decode(self, blob: bytes) -> int:
        values = self.codec.decode(blob).reshape(-1)
        self._scratch[: values.size] = values
        return int(values.size)
