"""The public faces of `peer` and `training`: what the README and examples may use."""

from __future__ import annotations

import subprocess
import sys

import peer

PEER_API = {
    "BackgroundDHT", "BackgroundPeer", "ClockConfig", "DHT", "DHTConfig", "HostConfig",
    "LimitExceededError", "MemoryNetwork", "Network", "Peer", "PeerBusyError", "PeerConfig",
    "PeerStoppedError", "PeerThreadError",
    "PeerUnavailableError", "RecordError", "RecordTooLargeError", "RemoteError", "Reply",
    "Request", "RpcHost", "SwarmError", "TcpNetwork", "open_peer", "open_rpc_host",
    "run_in_background",
}  # fmt: skip


def test_peer_public_surface_is_pinned() -> None:
    assert set(peer.__all__) == PEER_API
    assert all(hasattr(peer, name) for name in PEER_API)


def test_importing_peer_loads_neither_torch_nor_training() -> None:
    code = (
        "import sys, peer; "
        "bad = [m for m in ('torch', 'training') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
