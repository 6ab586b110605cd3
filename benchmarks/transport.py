"""The secure transport against its floor: 64 MiB one way between two processes on loopback.

``floor``: blocking sockets and AES-GCM straight from Python, with no framing beyond the
Noise transport's (65519-byte messages sealed with ``encrypt_into`` a 1 MiB slice at a time,
opened with ``decrypt_into`` from a large receive buffer): what the machine's kernel and
AES-GCM cost, with as little interpreter as Python allows. ``secure``: this project's
``SecureStream`` after a real Noise handshake, over trio TCP, written in 2 MiB pieces (an
all-reduce chunk) and read with ``receive_into`` into a 2 MiB buffer. Each side reports
its own CPU time; the ratio says how much the event loop, the stream and the transport's
bookkeeping add to the floor. An all-reduce peer moves 2 (n - 1) / n of the vector each
way per round (64 MiB each way at 2 peers), so twice these CPU figures bound its round.

    python benchmarks/transport.py [--mib 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PIECE = 2 << 20  # bytes per write and per read in the secure mode (one all-reduce chunk)
SLICE = 1 << 20  # plaintext sealed per write in the floor mode (as SecureStream does)


def _floor_send(port: int, size: int) -> dict[str, float]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from protocol.noise.transport import MAX_PLAINTEXT_PER_MESSAGE

    aead, nonce = AESGCM(bytes(32)), bytes(12)  # one nonce: nothing here is secret
    data = memoryview(bytearray(b"\x01") * size)  # touched: no page faults while timed
    out = bytearray(SLICE + 64 * 18)
    view = memoryview(out)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started, cpu = time.perf_counter(), time.process_time()
        pos = 0
        while pos < size:
            used = 0
            while used + MAX_PLAINTEXT_PER_MESSAGE <= SLICE and pos < size:
                take = min(MAX_PLAINTEXT_PER_MESSAGE, size - pos)
                out[used : used + 2] = (take + 16).to_bytes(2, "big")
                aead.encrypt_into(
                    nonce, data[pos : pos + take], None, view[used + 2 : used + 18 + take]
                )
                used += take + 18
                pos += take
            sock.sendall(view[:used])
        sock.recv(1)  # the receiver opened everything
        return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - started}


def _floor_receive(listener: socket.socket, size: int) -> dict[str, float]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, nonce = AESGCM(bytes(32)), bytes(12)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    plain = memoryview(bytearray(PIECE))  # reused, as the secure mode's target
    sock, _ = listener.accept()
    with sock:
        cpu = time.process_time()
        pending = opened = 0
        while opened < size:
            pending += sock.recv_into(view[pending:])
            pos = 0
            while pending - pos >= 2:
                length = int.from_bytes(buffer[pos : pos + 2], "big")
                if pending - pos < 2 + length:
                    break
                take = length - 16
                at = opened % PIECE if opened % PIECE + take <= PIECE else 0
                aead.decrypt_into(
                    nonce, view[pos + 2 : pos + 2 + length], None, plain[at : at + take]
                )
                opened += take
                pos += 2 + length
            buffer[: pending - pos] = buffer[pos:pending]
            pending -= pos
        result = {"cpu_s": time.process_time() - cpu}
        sock.sendall(b"!")
    return result


async def _secure_send(port: int, size: int) -> dict[str, float]:
    import trio

    from peer.secure import secure_handshake
    from protocol.identity import Identity

    raw = await trio.open_tcp_stream("127.0.0.1", port)
    stream = await secure_handshake(raw, Identity.generate(), initiator=True)
    data = memoryview(bytearray(b"\x01") * size)
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, size, PIECE):
        await stream.send_all(data[start : start + PIECE])
    await stream.receive_some(1)
    result = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - started}
    await stream.aclose()
    return result


async def _secure_receive(listener: socket.socket, size: int) -> dict[str, float]:
    import trio

    from peer.secure import secure_handshake
    from protocol.identity import Identity

    sock = trio.socket.from_stdlib_socket(listener)
    accepted, _ = await sock.accept()
    stream = await secure_handshake(
        trio.SocketStream(accepted), Identity.generate(), initiator=False
    )
    target = memoryview(bytearray(PIECE))
    cpu = time.process_time()
    got = 0
    while got < size:
        n = await stream.receive_into(target)
        if not n:
            raise RuntimeError("the sender closed early")
        got += n
    result = {"cpu_s": time.process_time() - cpu}
    await stream.send_all(b"!")
    await stream.aclose()
    return result


def _child(mode: str, size: int) -> None:
    """The receiving process: listen, print the port, receive, print its CPU time."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    if mode == "floor":
        result = _floor_receive(listener, size)
    else:
        import trio

        result = trio.run(_secure_receive, listener, size)
    print(json.dumps(result), flush=True)


def _one(mode: str, size: int) -> dict[str, float]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", mode, "--bytes", str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        if mode == "floor":
            sent = _floor_send(port, size)
        else:
            import trio

            sent = trio.run(_secure_send, port, size)
        received = json.loads(child.stdout.readline())
        child.stdout.close()
        if child.wait(timeout=60) != 0:
            raise RuntimeError(f"the {mode} receiver failed")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return {
        "sender_cpu_s": sent["cpu_s"],
        "receiver_cpu_s": received["cpu_s"],
        "wall_s": sent["wall_s"],
    }


def main(mib: int, repeat: int) -> dict[str, Any]:
    size = mib << 20
    report: dict[str, Any] = {"mib": mib, "repeat": repeat}
    runs: dict[str, list[dict[str, float]]] = {"floor": [], "secure": []}
    for _ in range(repeat):  # alternated, so that a slow moment of the VM hits both
        for mode in runs:
            runs[mode].append(_one(mode, size))
    for mode, results in runs.items():
        summary = {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}
        summary["gbps"] = round(size / summary["wall_s"] / 1e9, 2)
        report[mode] = summary
    for side in ("sender_cpu_s", "receiver_cpu_s"):
        report[f"secure_over_floor_{side[:-6]}"] = round(
            report["secure"][side] / report["floor"][side], 2
        )
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="runs of each mode (medians)")
    parser.add_argument("--child", choices=["floor", "secure"], help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.bytes)
    else:
        print(json.dumps(main(args.mib, args.repeat), indent=2))
