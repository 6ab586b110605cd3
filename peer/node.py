"""The Peer: an identity, an RPC host and a DHT node, run by one trio nursery.

    async with open_peer(listen="127.0.0.1:0", initial_peers=["PEERID@10.0.0.2:4000"]) as node:
        print(node.address)                        # PEERID@127.0.0.1:PORT
        await node.dht.store("run/x", {"a": 1}, ttl=60.0)
        await node.dht.get("run/x")                # {"a": 1}
        node.rpc.register("my.method", handler)   # other services share the host

``open_peer`` returns once the peer is listening and has bootstrapped; when initial peers
were given and none answered it raises PeerUnavailableError (or, with
``ensure_bootstrap_success=False``, starts alone with a warning and retries them at each
refresh). Leaving the context stops every task of the peer and closes its connections.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import trio

from protocol.address import Address, canonical_host
from protocol.errors import AddressError
from protocol.framing import MIN_PEER_FRAME_SIZE
from protocol.identity import Identity, PeerID

from .dht import DHT, DHTConfig
from .dht.node import address_list
from .errors import PeerUnavailableError
from .host import WILDCARD_HOSTS, HostConfig, RpcHost, open_rpc_host
from .interrupts import interrupt_in
from .netclock import ClockConfig, ClockService, NetworkClock, wall_clock
from .network import Network

__all__ = ["MIN_PEER_FRAME_SIZE", "Peer", "PeerConfig", "open_peer"]


logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Everything tunable about a peer, one part per component."""

    host: HostConfig = field(default_factory=HostConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)

    def __post_init__(self) -> None:
        for name, kind in (("host", HostConfig), ("dht", DHTConfig), ("clock", ClockConfig)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"PeerConfig.{name} must be a {kind.__name__}, got {type(value).__name__}"
                )
        # Other peers send frames this large whatever our limit (it is a receiver's only):
        # a node that refused them would drop its healthy peers' connections, each of its
        # gets of a large key would come back empty, and its averagers could not send a chunk.
        if self.host.max_frame_size < MIN_PEER_FRAME_SIZE:
            raise ValueError(
                f"HostConfig.max_frame_size must be at least {MIN_PEER_FRAME_SIZE} bytes (2 MiB"
                f" + 64 KiB) for a peer, got {self.host.max_frame_size}: DHT replies and "
                "stores reach 1.1 MiB and averaging chunks 2 MiB"
            )


class Peer:
    """A running peer, made by :func:`open_peer`.

    Attributes:
        identity: the peer's key pair; ``peer_id`` its id.
        rpc: the RPC host; other services register their methods on it and call peers.
        dht: the DHT node (``store``, ``get``, ``get_entries``, ``find_peers``, ...).
        address: ``"PEERID@HOST:PORT"`` to give to others, or ``str(peer_id)`` for a
            client-mode peer (it cannot be dialed).
        clock: network time (:class:`peer.netclock.NetworkClock`): ``clock.now()`` is
            this machine's clock corrected by its peers' median offset (``clock.offset``
            seconds); the DHT and averaging rounds run on it.
    """

    def __init__(
        self,
        identity: Identity,
        rpc: RpcHost,
        dht: DHT,
        address: str,
        clock: NetworkClock,
        nursery: trio.Nursery | None = None,
    ) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.rpc = rpc
        self.dht = dht
        self.address = address
        self.clock = clock
        self._nursery = nursery

    def start_background(
        self, async_fn: Callable[..., Awaitable[object]], *args: object, name: str | None = None
    ) -> bool:
        """Run ``async_fn(*args)`` in the peer's own nursery, beside the caller: it may
        outlive the caller's task and is cancelled when the peer closes. An exception it
        raises is logged and ends that task only. For short best-effort follow-ups (a step
        cut short by its deadline tells the others it left). False, and nothing runs, once
        the peer is closing."""

        async def guarded() -> None:
            try:
                await async_fn(*args)
            except Exception:
                logger.warning("background task %s failed", name or async_fn, exc_info=True)

        if self._nursery is None:
            return False
        try:
            self._nursery.start_soon(guarded, name=name or async_fn)
        except RuntimeError:  # the nursery is closed: the peer is shutting down
            return False
        return True

    @property
    def client_mode(self) -> bool:
        return self.dht.config.client_mode

    def __repr__(self) -> str:
        return f"<Peer {self.address}>"


def _check_arguments(listen: object, identity: object, client_mode: object, config: object) -> None:
    """Wrong types fail here, named, instead of deep inside the start-up."""
    if listen is not None and not isinstance(listen, str):
        raise TypeError(f"listen must be a 'HOST:PORT' string or None, not {type(listen).__name__}")
    if not isinstance(identity, Identity | str | os.PathLike) and identity is not None:
        raise TypeError(
            f"identity must be an Identity, a key-file path or None, not {type(identity).__name__}"
            " (for a 32-byte seed: Identity.from_seed(seed))"
        )
    if type(client_mode) is not bool:
        raise TypeError(f"client_mode must be a bool, not {type(client_mode).__name__}")
    if config is not None and not isinstance(config, PeerConfig):
        raise TypeError(
            f"config must be a PeerConfig (or None), not {type(config).__name__}:"
            " PeerConfig(dht=DHTConfig(k=...), host=HostConfig(...))"
        )


def as_list(initial_peers: Iterable[str | Address] | None) -> list[str | Address]:
    """The initial peers as a list: one address is not its characters, None is none
    (hivemind's default).

    Raises:
        TypeError: if ``initial_peers`` is neither an address nor an iterable of them.
    """
    if initial_peers is None:
        return []
    if isinstance(initial_peers, str | Address):
        return [initial_peers]
    if isinstance(initial_peers, bytes | bytearray | memoryview):  # not a list of ints
        raise TypeError(
            "initial_peers: give addresses as text ('PEERID@HOST:PORT'), not"
            f" {type(initial_peers).__name__} (decode it first)"
        )
    try:
        return list(initial_peers)
    except TypeError:
        raise TypeError(
            "initial_peers must be a list of 'PEERID@HOST:PORT' strings (or one), not"
            f" {type(initial_peers).__name__}"
        ) from None


def load_identity(identity: Identity | str | os.PathLike[str] | None) -> Identity:
    """An Identity as given, loaded from (or created at) a key-file path, or a fresh one.

    Raises:
        IdentityFileError: if the file exists but is not a key file.
    """
    if identity is None:
        return Identity.generate()
    if isinstance(identity, Identity):
        return identity
    return Identity.load_or_create(identity)


def _warn_if_unreachable(public: Address, peers: list[Address]) -> None:
    """Warn when we announce a loopback address but join peers elsewhere: they learn an
    address of ours that none of them can dial (the default listen host is 127.0.0.1),
    and averaging rounds with us would lose our part."""
    if not _is_loopback(public.host):
        return
    remote = [p for p in peers if not _is_loopback(p.host)]
    if remote:
        logger.warning(
            "announcing %s, which only this machine can dial, while joining %s: peers there "
            "cannot reach us; pass listen='0.0.0.0:PORT' and announce_host='PUBLIC_IP' "
            "(swarm bootstrap: --host 0.0.0.0 --announce-host PUBLIC_IP), or "
            "client_mode=True behind a NAT",
            public.hostport,
            remote[0].hostport,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a DNS name: it may be anything


def _check_in_trio() -> None:
    """Refuse to start outside a trio run: under asyncio the peer failed deep inside trio
    with an ``AttributeError`` that named neither (an outside tester)."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise RuntimeError(
            "open_peer runs under trio (trio.run(main)), not asyncio or another event loop: "
            "from asyncio or plain code use peer.run_in_background(...), whose methods block "
            "(in asyncio, call them through asyncio.to_thread to keep the loop running)"
        ) from None


@asynccontextmanager
async def open_peer(
    listen: str | None = "127.0.0.1:0",
    initial_peers: Iterable[str | Address] | None = (),
    identity: Identity | str | os.PathLike[str] | None = None,
    client_mode: bool = False,
    network: Network | None = None,
    config: PeerConfig | None = None,
    *,
    announce_host: str | None = None,
    clock: Callable[[], float] = wall_clock,
    ensure_bootstrap_success: bool = True,
) -> AsyncIterator[Peer]:
    """Start a peer, bootstrap its DHT through ``initial_peers``, and yield it.

    Args:
        listen: ``HOST:PORT`` to accept connections on (port 0: any free one); None, or
            ``client_mode=True``, makes a client-mode peer that listens nowhere.
        initial_peers: ``PEERID@HOST:PORT`` or ``HOST:PORT`` of peers already in the swarm
            (a list; a single string is taken as one address); empty or None: start a
            new swarm.
        identity: an Identity, a key-file path (created when missing), or None (fresh).
        network: where connections come from (default: real TCP).
        config: host and DHT tuning.
        announce_host: the host others should dial (default: the listen host; a wildcard
            listen host announces the loopback address).
        clock: this machine's unix time (default: the system time at the first reading,
            moving with trio's monotonic clock, :func:`peer.netclock.wall_clock`; tests
            pass a virtual one); the peer runs on it corrected by its peers' median offset
            (``node.clock``, ``PeerConfig.clock``).
        ensure_bootstrap_success: when ``initial_peers`` are given and none answers, raise
            (a mistyped address must not leave a volunteer training alone); False starts
            alone with a warning instead (a bootstrap node whose peers are down). Named
            as hivemind's ``DHT`` argument of the same meaning.

    Raises:
        AddressError: (a ``ProtocolError`` and a ``ValueError``) if ``listen`` or an initial
            peer is not a valid address, or an initial peer has port 0, or
            ``announce_host`` carries a port.
        ValueError: if ``listen`` names a PeerID other than this peer's, or
            ``announce_host`` is one no peer dials (``0.0.0.0``, multicast: they skip it),
            or is given to a client-mode peer.
        TypeError: if an argument has the wrong type.
        IdentityFileError: if the identity file exists but is not a key file.
        OSError: if the listen address cannot be bound, or the identity file cannot be
            read or created (a missing directory: FileNotFoundError).
        RuntimeError: outside a trio run (under asyncio: use ``run_in_background``).
        PeerUnavailableError: if no initial peer answered (see ``ensure_bootstrap_success``);
            initial peers that turned us away as busy are dialed again first, for up to
            ``DHTConfig.busy_join_timeout``.
    """
    _check_in_trio()
    _check_arguments(listen, identity, client_mode, config)
    config = config or PeerConfig()
    client = client_mode or listen is None or config.dht.client_mode
    dht_config = replace(config.dht, client_mode=client)
    me = load_identity(identity)
    parsed = None if listen is None else Address.parse(listen)  # (checked in client mode too)
    listen_address = None if client else parsed
    if client and announce_host is not None:
        raise ValueError(
            f"announce_host={announce_host!r} with a client-mode peer, which listens nowhere"
            " and is never dialed: drop client_mode (and give a reachable listen address) to"
            " be dialed, or drop announce_host"
        )
    _check_announce_host(announce_host)
    if listen_address is not None:  # one spelling for an IPv6 host, as the CLI's
        listen_address = Address(
            canonical_host(listen_address.host), listen_address.port, listen_address.peer_id
        )
    if listen_address is not None and listen_address.peer_id not in (None, me.peer_id):
        raise ValueError(
            f"listen={listen!r} names another peer: give HOST:PORT (the PeerID is the identity's)"
        )
    peers = address_list(as_list(initial_peers))
    if client and not peers:
        logger.warning(
            "a client-mode peer without initial peers knows nobody, and nobody can dial it:"
            " it cannot start a network (its stores and gets find no node); give"
            " initial_peers"
        )
    for initial in peers:
        if initial.port == 0:  # a listen port asked of the OS, never one to dial
            raise AddressError(f"initial peer {initial}: port 0 cannot be dialed")
    body_error: BaseException | None = None
    async with open_rpc_host(
        me, listen=listen_address, network=network, config=config.host
    ) as host:
        sender = None
        address = str(me.peer_id)
        if host.listen_address is not None:
            bound = host.listen_address
            if announce_host is None:
                announce_host = WILDCARD_HOSTS.get(bound.host, bound.host)
                if bound.host in WILDCARD_HOSTS:
                    logger.warning("listening on %s: announcing %s", bound.host, announce_host)
            public = Address(canonical_host(announce_host), bound.port, me.peer_id)
            if not public.dialable:  # checked once bound: a bad listen host fails first
                raise ValueError(
                    f"announce_host {announce_host!r} is not an address peers can dial (they"
                    " skip it): give this machine's public IP or DNS name"
                )
            sender, address = public.hostport, str(public)
            host.announce_host = public.host
            _warn_if_unreachable(public, peers)
        network_clock = NetworkClock(clock, config.clock, count_own=not client)
        dht = DHT(host, me, dht_config, sender=sender, clock=network_clock.now)
        clock_service = ClockService(host, network_clock, dht.routing_table_peers)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(dht.serve)
                await nursery.start(clock_service.serve)
                # raised below instead: a plain script would print the same text twice
                reached = await dht.bootstrap(peers, warn=not ensure_bootstrap_success)
                if peers and not reached and ensure_bootstrap_success:
                    tried = "; ".join(f"{p}: {dht.contact_errors.get(str(p), '?')}" for p in peers)
                    body_error = PeerUnavailableError(f"no initial peer answered (tried {tried})")
                    nursery.cancel_scope.cancel()
                else:
                    await clock_service.sync()  # before the first round is cut by the clock
                    try:
                        yield Peer(me, host, dht, address, network_clock, nursery)
                    except BaseException as exc:  # re-raised below, outside the nursery
                        body_error = exc
                    finally:
                        nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Ctrl-C while joining (the bootstrap's lookups run in nurseries): a plain
            # KeyboardInterrupt, as from the body or any public call (peer/interrupts.py)
            interrupt = interrupt_in(group)
            if interrupt is None:
                raise
            body_error = interrupt
        if body_error is not None:  # inside the host's block: it then closes without draining
            raise body_error


def _check_announce_host(host: object) -> None:
    """Refuse a ``HOST:PORT`` given as ``announce_host`` with the advice the CLI gives (the
    Address check alone read ``'1.2.3.4:5'`` as a malformed IPv6 address)."""
    if host is not None and not isinstance(host, str):  # (5 read "empty or oversized host")
        raise TypeError(f"announce_host must be a host name or IP (str), not {type(host).__name__}")
    if host is None or ":" not in host:
        return
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.IPv6Address(inner)
    except ValueError:
        raise AddressError(
            f"announce_host {host!r} is not a host: give the host without a port (peers dial"
            " it at the port this peer listens on)"
        ) from None
