"""What peers that ask for large replies and read none cost a `swarm bootstrap` node.

    .venv/bin/python benchmarks/unread_replies.py [--connections 128] [--requests 100]

Each load runs against a fresh `swarm bootstrap` on loopback (a process keeps what its
allocator once took, so loads are not measured one after the other), after a client-mode
peer stored one key of ~1 MiB there (64 subkeys of 16,000 random bytes): a FIND_VALUE
reply for it is a 1 MiB page. Then ``--connections`` secure connections from this process
(its own Noise handshake, a fresh identity each; at most 128 from one address):

- ``unread_pages``: each sends ``--requests`` FIND_VALUE requests for the key at once and
  reads nothing (a 4 KiB receive buffer, so the kernel holds little for it);
- ``one_page_each``: each asks for one page, reads it whole, and stays open, idle;
- ``half_message``: each sends ~1.9 MiB of frames (31 requests of 60 KiB for no method:
  small error replies) in one burst ending halfway through a transport message, and
  waits.

Prints JSON: for each load, the node's resident memory (VmRSS, MiB) before the
connections, with them held for 5 s, and its peak (VmHWM). What bounds each: the host's
send budget (8 MiB on a bootstrap node, 1 MiB per remote host) and one queue per
connection for requests waiting for it; seal buffers lent by the buffer pool for a send,
not kept by each connection; a partial message copied out of its 1 MiB read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stalled_frames import bootstrap_node, memory_mib  # noqa: E402  (the same node, alike)

from peer import open_peer  # noqa: E402
from peer.secure import SecureStream, secure_handshake  # noqa: E402
from protocol.address import Address  # noqa: E402
from protocol.dhtid import DHTID  # noqa: E402
from protocol.framing import NEED_DATA, FrameDecoder  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import FindValueRequest  # noqa: E402
from protocol.rpc import FrameKind, RpcFrame, encode_rpc_frame  # noqa: E402

KEY = "unread-replies/page"
HOLD = 5.0


def _frame(
    kind: FrameKind, request_id: int, method: str | None = None, body: object = None
) -> bytes:
    pieces = encode_rpc_frame(RpcFrame(kind, request_id, method=method, body=body))
    return b"".join(bytes(piece) for piece in pieces)


def _find_value(request_id: int) -> bytes:
    request = FindValueRequest(None, DHTID.from_key(KEY))
    return _frame(FrameKind.REQUEST, request_id, FindValueRequest.METHOD, request.to_body())


async def _connect(address: Address, small_receive_buffer: bool = False) -> SecureStream:
    sock = trio.socket.socket()
    if small_receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((address.host, address.port))
    return await secure_handshake(trio.SocketStream(sock), Identity.generate(), initiator=True)


async def unread_pages(address: Address, requests: int) -> SecureStream:
    stream = await _connect(address, small_receive_buffer=True)
    await stream.send_all(b"".join(_find_value(i) for i in range(1, requests + 1)))
    return stream


async def one_page_each(address: Address, requests: int) -> SecureStream:
    stream = await _connect(address)
    await stream.send_all(_find_value(1))
    decoder = FrameDecoder()
    while True:
        decoder.receive_data(await stream.receive_some(1 << 20))
        if decoder.next_frame() is not NEED_DATA:
            return stream


async def half_message(address: Address, requests: int) -> SecureStream:
    stream = await _connect(address)
    # 31 requests of 60 KiB (below what the receive budget counts) for no method: small
    # error replies; the node's reads grow to 1 MiB on the way
    burst = b"".join(
        b"".join(
            bytes(piece)
            for piece in encode_rpc_frame(
                RpcFrame(FrameKind.REQUEST, i, method="none", payload=bytes(60 << 10))
            )
        )
        for i in range(1, 32)
    )
    # sealed here and written raw: half of the last transport message goes out
    transport, raw = stream._transport, stream.transport_stream
    sealed = transport.seal(burst)
    last = transport.seal(bytes(1000))  # (sealed after: the nonces count up)
    await raw.send_all(sealed + last[: len(last) // 2])
    return stream


async def _store_page(address: Address) -> None:
    async with open_peer(initial_peers=[address], client_mode=True) as node:
        for i in range(64):
            assert await node.dht.store(KEY, os.urandom(16_000), ttl=600.0, subkey=f"s{i}")


async def run(
    pid: int,
    address: Address,
    load: Callable[[Address, int], Awaitable[SecureStream]],
    connections: int,
    requests: int,
) -> dict[str, object]:
    await _store_page(address)
    await trio.sleep(1.0)
    before = memory_mib(pid)["VmRSS"]
    streams = [await load(address, requests) for _ in range(connections)]
    await trio.sleep(HOLD)
    held = memory_mib(pid)
    for stream in streams:
        await trio.aclose_forcefully(stream)
    return {"rss_before_mib": before, "rss_held_mib": held["VmRSS"], "peak_mib": held["VmHWM"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=128)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    report: dict[str, object] = {"connections": args.connections, "requests": args.requests}
    for load in (unread_pages, one_page_each, half_message):
        with bootstrap_node() as (pid, address):
            report[load.__name__] = trio.run(
                run, pid, address, load, args.connections, args.requests
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
