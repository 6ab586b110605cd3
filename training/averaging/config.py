"""The averager's one config dataclass."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.codecs import CODEC_NAMES
from protocol.records import MAX_TTL

MiB = 1 << 20

_INTEGERS = {
    "group_size": 2,
    "max_staleness": 0,
    "chunk_bytes": 4096,
    "max_inflight": 1,
    "max_downloads": 1,
    "retain_budget": 0,
}
"""The integer fields and their least values."""

MAX_GROUP_SIZE = 256
"""The most members a group confirmation may list (``messages.MAX_MEMBERS``): a larger
``group_size`` let 257 peers form a group whose confirmation every member refused."""

DECLARATION_SLACK = 30.0
"""Seconds a declaration outlives its round's gather and joins (slow DHT operations)."""

MIN_GATHER_WINDOW = 0.05
"""Seconds: below that, peers cannot see each other's declarations before a slot closes
(a DHT store takes milliseconds even on loopback), and round numbers (time / window) grow
absurd."""


def default_retain_budget(vector_bytes: int) -> int:
    """``AveragerConfig.retain_budget`` when None, for a flat vector of ``vector_bytes``."""
    return max(64 << 20, vector_bytes // 4)


@dataclass(frozen=True, slots=True)
class AveragerConfig:
    """Tuning of one :class:`~training.averaging.Averager`. Every time is in seconds.

    The step's own ``timeout`` bounds everything; the knobs below split it.
    """

    group_size: int = 16  # most peers in one all-reduce group, 2 to 256 (Moshpit grid)
    # "none", "float16", "int8" or "topk" (gradients or updates only: what is outside every
    # member's top k comes back as 0, so averaged parameters would be zeroed): part of the layout
    codec: str = "none"
    codec_params: dict[str, Any] = field(default_factory=dict)  # e.g. {"fraction": 0.01}
    max_staleness: int = 2  # S: contributions older than max_epoch_in_group - S are dropped
    staleness_decay: float = 0.5  # weight x decay**staleness for accepted stale contributions
    # Rendezvous slot: a lone peer waits between window/2 and 1.5*window for partners; peers
    # arriving while a round is open join it. Closes early when everybody seen last round is back.
    gather_window: float = 2.0
    join_timeout: float = 1.0  # a leader waits this long after closing for expected members
    # A sender that delivers nothing for this long is dropped from the part ("frozen" when a
    # ping goes unanswered too, "dead" when its host refuses). Also bounds idle downloads.
    stall_timeout: float = 5.0
    # Share of the all-reduce budget that reducers leave for streaming results back: they stop
    # accepting contributions once (1 - result_share) of the budget has passed.
    result_share: float = 0.35
    default_timeout: float = 60.0  # step() timeout when none is given and no caller deadline
    bandwidth: float = 1.0  # declared throughput (any unit, same for all): part sizes follow it
    client_mode: bool | None = None  # sender only (no part); None: same as the node
    # float32 bytes per chunk on the wire (before compression): the largest that fits a frame,
    # as every chunk costs an RPC call, a finite check and a reply (2 MiB: -5 % CPU at 4 peers)
    chunk_bytes: int = 2 * MiB
    max_inflight: int = 8  # chunk uploads in flight per peer, all parts together (16 MiB)
    max_downloads: int = 8  # result streams read at once per peer
    # Received chunks are kept until their sender's whole part arrived, so that a sender that
    # fails mid-part can be taken out exactly. Reducers admit senders while the retained bytes
    # fit this budget (one sender always fits). None: max(64 MiB, a quarter of the vector).
    retain_budget: int | None = None
    # This machine's unix-time clock, for rendezvous slots; the node's network offset
    # (peer.netclock: its peers' median clock) is added. None: the node's own clock
    # (open_peer's clock=; by default wall time read through trio's clock, so that
    # virtual-time tests under MockClock work too).
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        for name, least in _INTEGERS.items():
            self._check_integer(name, least)
        if self.group_size > MAX_GROUP_SIZE:
            raise ValueError(
                f"AveragerConfig.group_size must be at most {MAX_GROUP_SIZE} (the most members "
                f"a group confirmation lists), got {self.group_size}"
            )
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"AveragerConfig.codec must be one of {CODEC_NAMES}")
        if not 0.0 < self._real("staleness_decay") <= 1.0:
            raise ValueError("AveragerConfig.staleness_decay must be in (0, 1]")
        for name in ("gather_window", "join_timeout", "stall_timeout", "default_timeout"):
            value = self._real(name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"AveragerConfig.{name} must be a finite positive number, got {value!r}"
                )
        if self.gather_window < MIN_GATHER_WINDOW:
            raise ValueError(
                f"AveragerConfig.gather_window must be at least {MIN_GATHER_WINDOW} s (peers "
                f"need that long to see each other's declarations), got {self.gather_window!r}"
            )
        declared_for = 3 * self.gather_window + self.join_timeout + DECLARATION_SLACK
        if declared_for > MAX_TTL:
            raise ValueError(
                "AveragerConfig: a declaration lives 3 x gather_window + join_timeout + "
                f"{DECLARATION_SLACK:g} s in the DHT, at most its {MAX_TTL:g} s ttl limit; got "
                f"gather_window={self.gather_window!r}, join_timeout={self.join_timeout!r}"
            )
        if not 0.0 < self._real("result_share") < 1.0:
            raise ValueError("AveragerConfig.result_share must be in (0, 1)")
        if not (math.isfinite(self._real("bandwidth")) and self.bandwidth > 0):
            raise ValueError(
                f"AveragerConfig.bandwidth must be a finite positive number, got {self.bandwidth!r}"
            )
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4:
            raise ValueError("AveragerConfig.chunk_bytes must be a multiple of 4, >= 4096")
        if self.chunk_bytes > 2 * MiB:
            raise ValueError("AveragerConfig.chunk_bytes must fit a frame (<= 2 MiB)")
        if self.client_mode is not None and not isinstance(self.client_mode, bool):
            raise ValueError(
                f"AveragerConfig.client_mode must be True, False or None, got {self.client_mode!r}"
            )
        if self.clock is not None and not callable(self.clock):
            raise ValueError(
                "AveragerConfig.clock must be a function returning unix time in seconds (or "
                f"None), got {self.clock!r}"
            )
        if not isinstance(self.codec_params, Mapping):
            raise ValueError(
                f"AveragerConfig.codec_params must be a dict, got {self.codec_params!r}"
            )

    def _real(self, name: str) -> float:
        """A real-number field (not a bool), stored as ``float``.

        Raises:
            ValueError: naming the field.
        """
        value = getattr(self, name)
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"AveragerConfig.{name} must be a number, got {value!r}")
        object.__setattr__(self, name, float(value))  # frozen: set once, here
        return float(value)

    def _check_integer(self, name: str, least: int) -> None:
        """An integer field (numpy's too, stored as ``int``; not a bool) of at least ``least``.

        Raises:
            ValueError: naming the field.
        """
        value = getattr(self, name)
        if value is None and name == "retain_budget":
            return
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
            raise ValueError(f"AveragerConfig.{name} must be an integer >= {least}, got {value!r}")
        object.__setattr__(self, name, int(value))  # frozen: set once, here

    @property
    def chunk_elements(self) -> int:
        return self.chunk_bytes // 4
