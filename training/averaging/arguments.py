"""What an :class:`~training.averaging.averager.Averager` refuses at construction or at
``step``, each with an error that names the argument: a node that is not a running peer, a
prefix no round key can be made of, a codec whose chunks no peer would accept, a weight,
epoch or timeout out of range."""

from __future__ import annotations

import math
import numbers
import sys

from peer import BackgroundPeer, Peer
from peer.errors import STOPPED, PeerStoppedError
from peer.node import MIN_PEER_FRAME_SIZE
from protocol.codecs import Codec
from protocol.errors import brief
from protocol.records import RecordError, RecordTooLargeError, check_key

from .config import AveragerConfig
from .grouping import MAX_EPOCH, MAX_WEIGHT, round_key
from .pieces import RangeCodec


def declared_epoch(epoch: int) -> int:
    """The epoch a step declares: ``epoch``, or the largest a declaration carries
    (``2**62 - 1``) when it is beyond. A loop's ``epoch = max(epoch, info.epoch) + 1`` takes
    2**62 after a round with a peer that declared the largest one (a hostile peer's trial:
    every honest loop of the swarm then raised at its next step); saturated, the loop goes
    on, and its peers, at the same epoch as that one, are not stale against it."""
    return min(int(epoch), MAX_EPOCH - 1)


def check_step_arguments(weight: float, epoch: int, timeout: float | None) -> None:
    """Numbers may be Python's, numpy scalars, or 0-d numpy arrays and torch tensors; a bool
    (numpy's and torch's too) is refused, as is an array or tensor with a dimension, even of
    one element (see ``_item``).

    Raises: ValueError naming the argument that :meth:`Averager.step` cannot take."""
    # an int of any size stays exact: 10**400 is beyond the limit, not infinite
    if not 0 < (number := _real(weight, "weight")) < math.inf:
        raise ValueError(f"weight must be a positive finite number, got {brief(weight)}")
    if number > MAX_WEIGHT:  # what a declaration can carry
        raise ValueError(
            f"weight must be at most {MAX_WEIGHT:g} (the wire limit), got {brief(weight)}"
        )
    integer = _item(epoch, "epoch")
    if not isinstance(integer, numbers.Integral) or isinstance(integer, bool) or integer < 0:
        raise ValueError(f"epoch must be a non-negative integer, got {brief(epoch)}")
    if timeout is None:
        return
    # not NaN, not infinite, and (an int) within float's range, as the step counts in floats
    if not abs(seconds := _real(timeout, "timeout")) <= sys.float_info.max:
        raise ValueError(
            f"timeout must be a finite number of seconds, got {brief(timeout)}; None uses "
            "the default (a margin before the caller's cancel-scope deadline, else "
            "AveragerConfig.default_timeout)"
        )
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {brief(timeout)}")


def check_prefix(prefix: object) -> str:
    """Refuse, at construction, a prefix that every step would fail with.

    Raises:
        TypeError: if it is not a str.
        ValueError: if it is empty, or its round keys would exceed the DHT's key limit.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not prefix:
        raise ValueError("prefix must not be empty (e.g. 'my-run/grads')")
    try:
        check_key(prefix)  # (its own words for what is not length: lone surrogates)
        check_key(round_key(prefix, 2**64))  # round numbers are unix times over the window
    except RecordError as exc:
        # (a prefix with a lone surrogate was "too long": an outside tester)
        what = "too long" if isinstance(exc, RecordTooLargeError) else "not usable"
        raise ValueError(f"prefix {what}: its round keys cannot be DHT keys ({exc})") from None
    return prefix


def check_node(node: object) -> None:
    """Raises: TypeError for a node that is not a running peer (the usual one: the context
    manager of ``run_in_background``, the ``with`` forgotten); PeerStoppedError for one
    whose block has ended (an outside tester's averager was made so, only its step
    failing)."""
    if isinstance(node, Peer | BackgroundPeer):
        if (node.peer if isinstance(node, BackgroundPeer) else node).rpc.stopped:
            raise PeerStoppedError(STOPPED)
        return
    hint = ""
    if hasattr(type(node), "__enter__") or hasattr(type(node), "__aenter__"):
        hint = (
            ": this is a context manager; the peer is what entering it gives "
            "(`with peer.run_in_background(...) as node:`, or "
            "`async with peer.open_peer(...) as node:`)"
        )
    raise TypeError(f"node must be a running peer, got {type(node).__name__}{hint}")


CHUNK_HEADER_ROOM = 4096
"""Bytes of a chunk's frame besides its blob (the RPC header with the chunk's body: ~200)."""


def check_chunk_fits(
    codec: Codec, config: AveragerConfig, n_elements: int, ranges: RangeCodec | None = None
) -> None:
    """A chunk's blob must fit the frame every peer accepts (``MIN_PEER_FRAME_SIZE``):
    ``topk`` with a fraction over about half makes blobs larger than the chunk's float32
    bytes (an index beside each value), and each upload then failed deep in the step.

    Raises:
        ValueError: naming ``chunk_bytes`` and the largest that fits; or naming
            ``max_elements`` when ``codec_params`` set it below the elements of a chunk
            (every chunk is encoded on its own, so the largest chunk must fit: the
            vector's ``n_elements``, or ``chunk_bytes / 4`` when the vector is larger).
    """
    largest = min(config.chunk_elements, n_elements)
    if codec.max_elements < largest:
        raise ValueError(
            f"AveragerConfig.codec_params: max_elements={codec.max_elements} is below the "
            f"{largest} elements of a chunk (the vector's {n_elements} in chunks of "
            f"chunk_bytes={config.chunk_bytes} / 4): use max_elements >= {largest}, or "
            "leave it out"
        )
    room = MIN_PEER_FRAME_SIZE - CHUNK_HEADER_ROOM

    def most_bytes(elements: int) -> int:  # int8: a blob header more per tensor boundary
        extra = ranges.most_cuts(elements) * ranges.piece_overhead() if ranges else 0
        return codec.encoded_size(elements) + extra

    blob = max(most_bytes(largest), 4 * largest)
    if blob <= room:
        return
    # the largest multiple of 4096 (at least one) whose chunks fit: a binary search, as the
    # payload grows with the chunk (a step of 4096 at a time took ~400 passes over the
    # layout's cuts: 29 s to refuse 80,000 tensors under int8, an outside tester)
    low, high = 1, max(1, config.chunk_bytes * room // blob // 4096)
    while low < high:
        middle = (low + high + 1) // 2
        if most_bytes(min(middle * 4096 // 4, codec.max_elements)) <= room:
            low = middle
        else:
            high = middle - 1
    fits = low * 4096
    raise ValueError(
        f"AveragerConfig.chunk_bytes={config.chunk_bytes} makes {codec!r} chunks of {blob} "
        f"bytes, beyond the {MIN_PEER_FRAME_SIZE} bytes a frame to any peer may hold: use "
        f"chunk_bytes <= {fits}"
    )


def _item(value: object, name: str) -> object:
    """``value`` itself, or the Python number a numpy scalar, 0-d numpy array or 0-d torch
    tensor holds (``.item()``: a bool for theirs, which the checks then refuse as they do
    ``True``). One rule for numpy and torch: ``float()`` takes a one-element torch tensor
    of any shape but no numpy array with a dimension, and a tester found ``[2.0]`` a weight
    in one and not the other.

    Raises: ValueError for an array or tensor with a dimension."""
    ndim = getattr(value, "ndim", None)
    if ndim is None or not callable(item := getattr(value, "item", None)):
        return value
    if ndim:
        shape = tuple(getattr(value, "shape", ()))
        raise ValueError(
            f"{name} must be a single number, got {type(value).__name__} of shape {shape}: "
            "pass a number or a 0-d array or tensor (x.item() of a one-element one)"
        )
    return item()


def _real(value: object, name: str) -> float:
    """``value`` as a Python float, or an int kept exact (``_item`` unwraps numpy and torch
    numbers first); bools and text are refused.

    Raises: ValueError naming ``name`` for anything else."""
    number = _item(value, name)
    if isinstance(number, bool):  # numpy's and torch's too, once unwrapped
        raise ValueError(f"{name} must be a number, not a bool, got {brief(value)}")
    if isinstance(number, numbers.Integral):
        return int(number)
    try:
        if isinstance(number, str | bytes):
            raise TypeError
        return float(number)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {brief(value)}") from None
