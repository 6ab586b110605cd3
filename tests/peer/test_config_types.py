"""Each peer config names a field of the wrong type when it is made (peer/config_types.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from peer.dht import DHTConfig
from peer.host_config import HostConfig
from peer.netclock import ClockConfig
from peer.node import PeerConfig


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: HostConfig(idle_timeout="5"), ValueError, "HostConfig.idle_timeout must be a"),
        (lambda: ClockConfig(enabled=1), ValueError, "ClockConfig.enabled must be True or"),
        (lambda: PeerConfig(dht=5), TypeError, "PeerConfig.dht must be a DHTConfig, got int"),
        (lambda: PeerConfig(host=DHTConfig()), TypeError, "PeerConfig.host must be a HostC"),
    ],
)
def test_wrong_types_in_a_peer_config_are_named(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    """An outside tester: ``PeerConfig(dht=5)`` was taken, and ``open_peer`` then failed
    with "'int' object has no attribute 'client_mode'"."""
    with pytest.raises(error, match=message):
        make()
