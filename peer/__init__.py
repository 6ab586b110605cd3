"""swarm's networked node: transport, secure channels, RPC, the Kademlia DHT, the Peer.

    async with peer.open_peer(listen="0.0.0.0:4000", initial_peers=[...]) as node:
        await node.dht.store("run/x", {"a": 1}, ttl=60.0)

    with peer.run_in_background(initial_peers=[...]) as node:   # plain scripts
        node.dht.get("run/x")

Everything else lives in modules named after what they hold (``peer.dht``, ``peer.host``).
"""

from __future__ import annotations

from protocol.errors import SwarmError as SwarmError
from protocol.records import RecordError as RecordError
from protocol.records import RecordTooLargeError as RecordTooLargeError

from .background import BackgroundDHT as BackgroundDHT
from .background import BackgroundPeer as BackgroundPeer
from .background import PeerStoppedError as PeerStoppedError
from .background import run_in_background as run_in_background
from .dht import DHT as DHT
from .dht import DHTConfig as DHTConfig
from .errors import LimitExceededError as LimitExceededError
from .errors import PeerUnavailableError as PeerUnavailableError
from .errors import RemoteError as RemoteError
from .host import HostConfig as HostConfig
from .host import RpcHost as RpcHost
from .host import open_rpc_host as open_rpc_host
from .memnet import MemoryNetwork as MemoryNetwork
from .network import Network as Network
from .network import TcpNetwork as TcpNetwork
from .node import Peer as Peer
from .node import PeerConfig as PeerConfig
from .node import open_peer as open_peer
from .rpc import Reply as Reply
from .rpc import Request as Request

__all__ = [
    "DHT",
    "BackgroundDHT",
    "BackgroundPeer",
    "DHTConfig",
    "HostConfig",
    "LimitExceededError",
    "MemoryNetwork",
    "Network",
    "Peer",
    "PeerConfig",
    "PeerStoppedError",
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
