"""swarm's networked node: transport, secure channels, RPC, the Kademlia DHT, the Peer.

    async with peer.open_peer(listen="0.0.0.0:4000", initial_peers=[...]) as node:
        await node.dht.store("run/x", {"a": 1}, ttl=60.0)

    with peer.run_in_background(initial_peers=[...]) as node:   # plain scripts
        node.dht.get("run/x")

Everything else lives in modules named after what they hold (``peer.dht``, ``peer.host``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The exports load on first use (PEP 562), so that `swarm` (peer.cli) can take over
# SIGINT/SIGTERM before trio and cryptography are imported: a signal in the first ~0.3 s of
# a start-up must end it as cleanly as one later.
_EXPORTS = {
    "SwarmError": "protocol.errors",
    "RecordError": "protocol.records",
    "RecordTooLargeError": "protocol.records",
    "BackgroundDHT": ".background",
    "BackgroundPeer": ".background",
    "PeerStoppedError": ".errors",
    "PeerThreadError": ".background",
    "run_in_background": ".background",
    "DHT": ".dht",
    "DHTConfig": ".dht",
    "LimitExceededError": ".errors",
    "PeerBusyError": ".errors",
    "PeerUnavailableError": ".errors",
    "RemoteError": ".errors",
    "HostConfig": ".host",
    "RpcHost": ".host",
    "open_rpc_host": ".host",
    "MemoryNetwork": ".memnet",
    "ClockConfig": ".netclock",
    "Network": ".network",
    "TcpNetwork": ".network",
    "Peer": ".node",
    "PeerConfig": ".node",
    "open_peer": ".node",
    "Reply": ".rpc",
    "Request": ".rpc",
}
_SUBMODULES = {
    "background", "calls", "cli", "crawl", "dht", "errors", "host", "memnet", "netclock",
    "network", "node", "rpc", "secure", "wire",
}  # fmt: skip

if TYPE_CHECKING:
    from protocol.errors import SwarmError as SwarmError
    from protocol.records import RecordError as RecordError
    from protocol.records import RecordTooLargeError as RecordTooLargeError

    from .background import BackgroundDHT as BackgroundDHT
    from .background import BackgroundPeer as BackgroundPeer
    from .background import PeerThreadError as PeerThreadError
    from .background import run_in_background as run_in_background
    from .dht import DHT as DHT
    from .dht import DHTConfig as DHTConfig
    from .errors import LimitExceededError as LimitExceededError
    from .errors import PeerBusyError as PeerBusyError
    from .errors import PeerStoppedError as PeerStoppedError
    from .errors import PeerUnavailableError as PeerUnavailableError
    from .errors import RemoteError as RemoteError
    from .host import HostConfig as HostConfig
    from .host import RpcHost as RpcHost
    from .host import open_rpc_host as open_rpc_host
    from .memnet import MemoryNetwork as MemoryNetwork
    from .netclock import ClockConfig as ClockConfig
    from .network import Network as Network
    from .network import TcpNetwork as TcpNetwork
    from .node import Peer as Peer
    from .node import PeerConfig as PeerConfig
    from .node import open_peer as open_peer
    from .rpc import Reply as Reply
    from .rpc import Request as Request


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


__all__ = [
    "DHT",
    "BackgroundDHT",
    "BackgroundPeer",
    "ClockConfig",
    "DHTConfig",
    "HostConfig",
    "LimitExceededError",
    "MemoryNetwork",
    "Network",
    "Peer",
    "PeerBusyError",
    "PeerConfig",
    "PeerStoppedError",
    "PeerThreadError",
    "PeerUnavailableError",
    "RecordError",
    "RecordTooLargeError",
    "RemoteError",
    "Reply",
    "Request",
    "RpcHost",
    "SwarmError",
    "TcpNetwork",
    "open_peer",
    "open_rpc_host",
    "run_in_background",
]
