"""The limits and timeouts of an RPC host (``peer.host``), in one frozen dataclass."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from protocol.framing import DEFAULT_MAX_FRAME_SIZE
from protocol.rpc import MAX_INFLIGHT_REQUESTS

from .config_types import check_field_types


@dataclass(frozen=True)
class HostConfig:
    """Limits and timeouts of an :class:`RpcHost` (seconds, bytes)."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_connections: int = 1024
    """Connections in all; beyond, a new inbound one takes the slot of the oldest inbound
    handshake stalled for a second, else of the inbound connection idle the longest (once
    its own handshake completes), else of the oldest handshake not answered yet, or is told
    busy (``peer.admission`` has the whole order)."""
    max_connections_per_ip: int = 128
    """Inbound connections from one remote host (one /64 for IPv6); generous, since NATs
    share addresses. Beyond, a new one from that host takes the slot of the host's own
    stalled handshake, else of its inbound connection idle the longest (once its own
    handshake completes), else of its oldest handshake not answered yet, or is told busy."""
    max_inflight_requests: int = MAX_INFLIGHT_REQUESTS
    """Requests a peer may have in flight on one connection; one that exceeds it is dropped.
    The protocol has every peer accept 128 (``protocol.rpc.MAX_INFLIGHT_REQUESTS``), so
    fewer drops peers that keep to it (a warning says so; for tests, or swarms where every
    peer sets the same); more only accepts more. Our own calls keep to the smaller of this
    and 128 (less one, of 16 or more: kept for the silence probe, see ``silence_timeout``),
    each waiting for a slot."""
    handshake_rate_per_ip: float = 16.0
    """New inbound connections per second one host (or /64) may open on average, in
    bursts of ``handshake_burst_per_ip``; beyond, a new one is closed at once, before its
    handshake: that costs us ~2 ms of CPU and the opener nothing (it may replay a recorded
    first message), so one host opening connections in a loop would keep a core busy (see
    ``peer.ratelimit``). ``math.inf`` turns it off."""
    handshake_burst_per_ip: int = 128
    """Enough for a crowd of peers behind one NAT joining at once (as many as
    ``max_connections_per_ip`` lets in)."""
    rate_limit_loopback: bool = False
    """Apply ``handshake_rate_per_ip`` to loopback addresses too. Off by default: those are
    this machine's own processes, where local experiments start peers by the hundred, and
    a process on the same machine can take our CPU by other means anyway."""
    handshake_timeout: float = 10.0
    idle_timeout: float = 60.0
    """A connection with no call in flight and no traffic for this long is closed."""
    send_timeout: float = 60.0
    """A write of up to 1 MiB to a peer that has not finished after this long (the peer
    stopped reading, or reads under ~17 KiB/s) closes the connection (found within a
    quarter of it more)."""
    silence_timeout: float = 10.0
    """A connection on which calls that waited a second or more went unanswered, with
    nothing at all from the peer since the first of them was sent, for this long, is
    probed (a request every live peer answers at once) and closed when nothing comes
    within half this long more (the DHT then pings the peer over a fresh dial): a NAT or
    middlebox that drops a connection loses what is written without a reset, and the
    kernel keeps retrying for about 15 minutes, every call meanwhile timing out."""
    dial_timeout: float = 10.0
    """Connect plus handshake, for outbound connections."""
    receive_budget: int = 256 << 20
    """Bytes of large frames (64 KiB or more) being received at once, all connections
    together; a frame that does not fit waits for room, its peer not read meanwhile (see
    ``peer.receive_budget``). It bounds what peers that announce large frames and send part
    of each can make us hold. Keep it well above what averaging receives at once (a chunk,
    2 MiB by default, from each member, and a result item from each reducer): a connection
    whose frame waits is not read, and the averager's pings on it go unanswered."""
    receive_budget_per_host: int | None = None
    """Of ``receive_budget``, the most that one remote host (an IPv6 /64) may hold (but one
    frame of any size); loopback hosts are not counted apart. None: no limit apart (the
    peers behind a NAT share one address)."""
    send_budget: int = 256 << 20
    """Bytes of queued outbound frames of 4 KiB or more (replies, result chunks, uploads), all
    connections together, from when they are queued until they are written; a frame that
    does not fit waits (see ``peer.send_budget``). It bounds what peers that ask for large
    replies and read none can make us hold (each connection also queues at most 4 MiB).
    Keep it well above what averaging sends at once (``max_inflight`` chunks of 2 MiB, and
    each member's result items)."""
    send_budget_per_host: int | None = None
    """Of ``send_budget``, the most that frames to one remote host (an IPv6 /64) may hold (but
    one frame of any size); loopback hosts are not counted apart. None: no limit apart."""
    receive_stall_timeout: float = 10.0
    """A large frame that received nothing for this long, or, once this old, under 16 KiB/s
    on average or too slow at that average to bring the rest within 3 times this long
    more, is cut off (its connection closed) when another frame waits for room in
    ``receive_budget``."""
    drain_timeout: float = 3.0
    """On a clean exit: how long connections may go on answering and writing what they
    queued (a result stream's last chunks) before they are closed."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in (
            "max_frame_size",
            "max_connections",
            "max_connections_per_ip",
            "max_inflight_requests",
            "receive_budget",
            "send_budget",
        ):
            self._check_at_least_one(name)
        for name in ("handshake_timeout", "idle_timeout", "dial_timeout", "receive_stall_timeout"):
            value = getattr(self, name)
            if not value > 0:  # NaN too; math.inf: never
                raise ValueError(f"HostConfig.{name} must be positive seconds, got {value!r}")
        if not (self.drain_timeout >= 0 and math.isfinite(self.drain_timeout)):
            raise ValueError(
                f"HostConfig.drain_timeout must be finite seconds >= 0, got {self.drain_timeout!r}"
            )
        if not self.send_timeout > 0:  # math.inf turns the check off
            raise ValueError(f"HostConfig.send_timeout must be positive, got {self.send_timeout}")
        if not self.handshake_rate_per_ip > 0:  # math.inf turns the limit off
            raise ValueError(
                "HostConfig.handshake_rate_per_ip must be positive, "
                f"got {self.handshake_rate_per_ip}"
            )
        if self.handshake_burst_per_ip < 1:
            raise ValueError(
                "HostConfig.handshake_burst_per_ip must be at least 1, "
                f"got {self.handshake_burst_per_ip}"
            )
        for name in ("receive_budget_per_host", "send_budget_per_host"):
            per_host = getattr(self, name)
            if per_host is not None and (
                isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1
            ):
                raise ValueError(
                    f"HostConfig.{name} must be None or an integer of at least 1, got {per_host!r}"
                )
        if not self.silence_timeout > 0:  # math.inf turns the check off
            raise ValueError(
                f"HostConfig.silence_timeout must be positive, got {self.silence_timeout}"
            )

    def _check_at_least_one(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"HostConfig.{name} must be an integer of at least 1, got {value!r}")
