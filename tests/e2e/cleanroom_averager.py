"""An averaging member written only from docs/protocol.md section 9 (a clean-room interop check).

Like `cleanroom_client` (whose handshake, DHT entries and identities it reuses), it imports
nothing from `protocol/`, `peer/` or `training/`: blocking sockets, threads, `msgpack`,
`numpy`. Section numbers refer to docs/protocol.md; "averaging.md" is docs/averaging.md.

What it does, for one step (`CleanroomAverager.step`):

1. chooses the round from its own clock (9.2), declares in the DHT, reads the round when it
   closes and groups the declarations (9.4);
2. leads (answers joins with a confirmation, 9.5) or joins its leader;
3. sends its chunks of every other part to that part's reducer with the round's codec (9.1;
   `none` alternately raw and as a blob, `int8`, `float16`), reduces its own part when it
   is a reducer (the weighted mean of 9.6), serves the result, and downloads the others'.

It averages one float32 tensor, so 9.1's rule for int8 chunks that span tensors (a blob per
tensor, since `v7`) never applies to its chunks.

Every blocking wait is bounded by a socket timeout or a deadline. Where the spec left a
choice, the comment says `READING:` and what was assumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import queue
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from cleanroom_client import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_HEADER_SIZE,
    MAX_PLAINTEXT_PER_MESSAGE,
    PROTOCOL_VERSION,
    TAG_SIZE,
    Address,
    CleanroomError,
    ConnectionClosed,
    HandshakeResult,
    Identity,
    RemoteError,
    _SocketReader,
    b58decode,
    b58encode,
    dht_id,
    encode_rpc_frame,
    initiator_handshake,
    make_entry,
    packb,
    responder_handshake,
    unpack_value,
    verify_entry_signature,
)

# ---------------------------------------------------------------- constants (sections 9, 10)

MAX_MEMBERS = 256
MAX_EPOCH = 2**62
DEFAULT_MAX_ELEMENTS = 2**28
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
DROP_REASONS = {"dead", "frozen", "timeout", "garbage", "nonfinite", "stale"}
CODEC_IDS = {"none": 0, "float16": 1, "int8": 2, "topk": 3}
# 9.1: the largest float32 `s` with 127 * s finite
MAX_INT8_SCALE = float(np.frombuffer(struct.pack("<I", 0x7C010203), "<f4")[0])
SMALLEST_NORMAL_F32 = 2.0**-126


def method_prefix(prefix: str) -> str:
    """Section 9: `avg.` + the first 16 hex digits of SHA-256(UTF-8 of the prefix)."""
    return "avg." + hashlib.sha256(prefix.encode("utf-8")).hexdigest()[:16]


def round_key(prefix: str, round_number: int) -> str:
    """Section 9.2: round `r` is the DHT key `{prefix}/round/{r}`."""
    return f"{prefix}/round/{round_number}"


def is_peer_id_text(text: object) -> bool:
    """Section 6 rule 3: decodes to exactly 32 bytes and re-encodes to the same text."""
    if not isinstance(text, str):
        return False
    try:
        raw = b58decode(text)
    except ValueError:
        return False
    return len(raw) == 32 and b58encode(raw) == text


# ---------------------------------------------------------------- 9.1 codec blobs


class BlobError(ValueError):
    """A blob a decoder must refuse (9.1)."""


def codec_repr(codec: str, block_size: int = 4096, max_elements: int = DEFAULT_MAX_ELEMENTS) -> str:
    """9.3: the codec's Python `repr`, as the examples show it."""
    if codec == "none":
        return f"NoneCodec(max_elements={max_elements})"
    if codec == "float16":
        return f"Float16Codec(max_elements={max_elements})"
    if codec == "int8":
        return f"Int8Codec(block_size={block_size}, max_elements={max_elements})"
    raise ValueError(f"codec {codec!r} not supported by the clean-room member")


def int8_quantize(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """9.1's encoder: per block `scale = absmax / 127` in float32, capped; a scale below the
    smallest normal float32 is 0 with values 0; `q = rint(x * (1 / scale))` in float32."""
    values = np.asarray(values, dtype=np.float32)
    n = values.size
    blocks = -(-n // block_size)
    scales = np.zeros(blocks, dtype=np.float32)
    q = np.zeros(n, dtype=np.int8)
    for j in range(blocks):
        block = values[j * block_size : (j + 1) * block_size]
        absmax = np.float32(np.max(np.abs(block))) if block.size else np.float32(0)
        scale = np.float32(absmax / np.float32(127))
        scale = min(scale, np.float32(MAX_INT8_SCALE))
        if scale < SMALLEST_NORMAL_F32:
            continue
        inverse = np.float32(1) / np.float32(scale)
        rounded = np.rint(block * inverse)  # float32 arithmetic, ties to even
        q[j * block_size : j * block_size + block.size] = np.clip(rounded, -127, 127)
        scales[j] = scale
    return scales, q


def blob_header(codec: str, n: int, parameter: int | None = None) -> bytes:
    """The 9.1 header for a 1-d float32 array of `n` elements (dtype code 1, ndim 1)."""
    header = b"SC" + bytes([CODEC_IDS[codec], 1, 1, 1]) + b"\0\0" + struct.pack("<Q", n)
    if parameter is not None:
        header += struct.pack("<Q", parameter)
    return header


def encode_blob(codec: str, values: np.ndarray, block_size: int = 4096) -> bytes:
    """A 1-d blob of `values` (9.1; "a chunk's blob encodes the chunk as a 1-d array")."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    n = values.size
    if codec == "none":
        return blob_header(codec, n) + values.astype("<f4").tobytes()
    if codec == "float16":
        return blob_header(codec, n) + values.astype("<f2").tobytes()
    if codec == "int8":
        if not np.all(np.isfinite(values)):
            raise ValueError("int8 refuses NaN and infinity")
        scales, q = int8_quantize(values, block_size)
        return blob_header(codec, n, block_size) + scales.astype("<f4").tobytes() + q.tobytes()
    raise ValueError(f"codec {codec!r} not supported")


def blob_size(codec: str, n: int, block_size: int = 4096) -> int:
    """The size the round's codec makes of a chunk of `n` elements (9.1's payload table)."""
    if codec == "none":
        return 16 + 4 * n
    if codec == "float16":
        return 16 + 2 * n
    if codec == "int8":
        return 24 + n + 4 * -(-n // block_size)
    raise ValueError(codec)


def decode_blob(
    blob: bytes, expected_codec: str, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> np.ndarray:
    """A float32 array of the blob's shape, flattened; refuses everything 9.1 lists.

    Raises:
        BlobError: a malformed blob or one of another codec.
    """
    if len(blob) < 8 or blob[:2] != b"SC":
        raise BlobError("not a blob (magic)")
    codec_id, version, dtype_code, ndim = blob[2], blob[3], blob[4], blob[5]
    if codec_id != CODEC_IDS.get(expected_codec):
        raise BlobError(f"codec id {codec_id}, expected {expected_codec}")
    if version != 1 or dtype_code not in (1, 2, 3) or ndim > 32 or blob[6:8] != b"\0\0":
        raise BlobError("bad version, dtype, ndim or reserved bytes")
    offset = 8 + 8 * ndim
    if len(blob) < offset:
        raise BlobError("shorter than its header")
    shape = struct.unpack(f"<{ndim}Q", blob[8:offset])
    if math.prod(max(d, 1) for d in shape) > 2**32:
        raise BlobError("shape over 2**32 elements")
    n = math.prod(shape)
    if n > max_elements:
        raise BlobError("more elements than max_elements")
    if expected_codec == "none":
        payload = blob[offset:]
        if len(payload) != 4 * n:
            raise BlobError("payload size")
        return np.frombuffer(payload, "<f4").astype(np.float32)
    if expected_codec == "float16":
        payload = blob[offset:]
        if len(payload) != 2 * n:
            raise BlobError("payload size")
        return np.frombuffer(payload, "<f2").astype(np.float32)
    if expected_codec == "int8":
        if len(blob) < offset + 8:
            raise BlobError("shorter than its header")
        (block_size,) = struct.unpack("<Q", blob[offset : offset + 8])
        if not 1 <= block_size <= 2**31:
            raise BlobError("block_size")
        payload = blob[offset + 8 :]
        blocks = -(-n // block_size)
        if len(payload) != n + 4 * blocks:
            raise BlobError("payload size")
        scales = np.frombuffer(payload[: 4 * blocks], "<f4")
        q = np.frombuffer(payload[4 * blocks :], np.int8)
        if np.any(np.isnan(scales)) or np.any(scales < 0) or np.any(scales > MAX_INT8_SCALE):
            raise BlobError("bad scale")
        if np.any(q == -128):
            raise BlobError("the value -128")
        out = q.astype(np.float32) * np.repeat(scales, block_size)[:n]
        return out.astype(np.float32)
    raise BlobError(f"codec {expected_codec!r} not supported")


def chunk_pieces(codec: str, bounds: list[int], a: int, b: int) -> list[tuple[int, int]]:
    """9.1, "Chunks that span tensors": under int8, the flat range `[a, b)` cut at each tensor
    boundary inside it (`bounds`: where each tensor after the first begins); one piece
    under the other codecs."""
    if codec != "int8":
        return [(a, b)]
    cuts = sorted({c for c in bounds if a < c < b})
    edges = [a, *cuts, b]
    return list(itertools.pairwise(edges))


def chunk_payload_size(codec: str, bounds: list[int], a: int, b: int, block_size: int) -> int:
    """The size of the payload of `flat[a:b]`: its pieces' blobs end to end."""
    return sum(
        blob_size(codec, hi - lo, block_size) for lo, hi in chunk_pieces(codec, bounds, a, b)
    )


def encode_chunk(
    codec: str, bounds: list[int], values: np.ndarray, start: int, block_size: int
) -> bytes:
    """The payload of a chunk, `values` = `flat[start:start + len(values)]`."""
    pieces = chunk_pieces(codec, bounds, start, start + len(values))
    return b"".join(
        encode_blob(codec, values[lo - start : hi - start], block_size) for lo, hi in pieces
    )


def decode_chunk(
    codec: str, bounds: list[int], payload: bytes, start: int, length: int, block_size: int
) -> np.ndarray:
    """The values of `flat[start:start + length]` from its payload; every piece must be a
    blob of its own size, end to end.

    Raises:
        BlobError: as `decode_blob`, or a payload that is not the pieces' blobs.
    """
    stop = start + length
    if len(payload) != chunk_payload_size(codec, bounds, start, stop, block_size):
        raise BlobError("not the size the round's codec makes")
    values, offset = [], 0
    for lo, hi in chunk_pieces(codec, bounds, start, stop):
        size = blob_size(codec, hi - lo, block_size)
        piece = decode_blob(payload[offset : offset + size], codec)
        if piece.size != hi - lo:
            raise BlobError("element count")
        values.append(piece)
        offset += size
    return np.concatenate(values) if values else np.zeros(0, np.float32)


# ---------------------------------------------------------------- 9.3 layout fingerprint


def codec_text(
    codec: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    group_size: int = 16,
    max_staleness: int = 2,
    staleness_decay: float = 0.5,
    block_size: int = 4096,
) -> str:
    return (
        f"{codec_repr(codec, block_size)}|{chunk_bytes}|group_size={group_size}|v9"
        f"|S={max_staleness}|decay={float(staleness_decay)!r}"
    )


def layout_fingerprint(shapes: list[tuple[int, ...]], dtypes: list[str], text: str) -> str:
    """9.3: first 16 hex digits of SHA-256 of `repr((shapes, dtypes, codec_text))`."""
    shaped = tuple(tuple(int(d) for d in shape) for shape in shapes)
    hashed = repr((shaped, tuple(dtypes), text))
    return hashlib.sha256(hashed.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------- 9.2 declarations


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


def parse_declaration(declarer: str, value: object) -> dict[str, Any] | None:
    """A declaration that passes 9.2's table (other keys ignored), normalised; else None."""
    if not isinstance(value, dict):
        return None
    required = ("address", "weight", "epoch", "bandwidth", "layout", "count")
    if any(key not in value for key in required):
        return None
    address, weight, epoch = value["address"], value["weight"], value["epoch"]
    bandwidth, layout, count = value["bandwidth"], value["layout"], value["count"]
    if address is not None and not isinstance(address, str):
        return None
    if not _is_number(weight) or not math.isfinite(weight) or not 0 < weight <= 1e300:
        return None
    if not _is_int(epoch) or not 0 <= epoch < MAX_EPOCH:
        return None
    if not _is_number(bandwidth) or not math.isfinite(bandwidth) or bandwidth <= 0:
        return None
    if not isinstance(layout, str) or len(layout) > 64:
        return None
    if not _is_int(count) or not 0 <= count < MAX_EPOCH:
        return None
    client_mode = value.get("client_mode", address is None)
    if not isinstance(client_mode, bool):
        return None
    if not client_mode and not isinstance(address, str):
        return None
    for key in ("total", "group_size"):
        if key in value and not (_is_int(value[key]) and 0 <= value[key] < MAX_EPOCH):
            return None
    if "detail" in value and not (isinstance(value["detail"], str) and len(value["detail"]) <= 200):
        return None
    if not client_mode:
        try:
            parsed = Address.parse(address)  # type: ignore[arg-type]
        except ValueError:
            return None  # 7: a malformed address is skipped
        if parsed.peer_id is None or b58encode(parsed.peer_id) != declarer:
            return None  # v9: a full member's address names the declarer's own PeerID
    return {
        "address": None if client_mode else address,
        "weight": weight,
        "epoch": epoch,
        "bandwidth": bandwidth,
        "layout": layout,
        "count": count,
        "client_mode": client_mode,
        "raw": dict(value),
    }


def group_tag(
    round_no: int,
    drawn: int,
    members: list[tuple[str, dict[str, Any]]],
    spans: list[tuple[int, int]],
) -> bytes:
    """9 ("Group tags"): what our chunks, result requests and pings name: a digest of the
    confirmation as we received it, not the leader's draw itself."""

    def address(d: dict[str, Any]) -> str:  # "" for client mode, whatever it declared
        client = d.get("client_mode", d.get("address") is None)
        return "" if client else d.get("address") or ""

    listed = [
        [
            b58decode(p),
            address(d),
            float(d["weight"]),
            int(d["epoch"]),
            float(d["bandwidth"]),
            d["layout"],
        ]
        for p, d in members
    ]
    packed = msgpack.packb(
        [round_no, drawn, listed, [[int(a), int(b)] for a, b in spans]], use_bin_type=True
    )
    return hashlib.sha256(packed).digest()[:16]


def _is_tag(value: object) -> bool:
    """9: a group tag in a chunk, result request or ping is 16 bytes (msgpack bin)."""
    return isinstance(value, bytes) and len(value) == 16


# ---------------------------------------------------------------- 9.4 groups


def lower_median(values: list[int] | list[float]) -> Any:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def grid_sides(n: int, g: int) -> tuple[int, ...]:
    """9.4 step 3."""
    d = 1
    while g**d < n:
        d += 1
    found: list[tuple[int, ...]] = []

    def search(prefix: tuple[int, ...], remaining: int, largest: int, left: int) -> None:
        if left == 0:
            if remaining == 1:
                found.append(prefix)
            return
        for side in range(min(largest, remaining, g), 0, -1):
            if remaining % side == 0:
                search((*prefix, side), remaining // side, side, left - 1)

    search((), n, g, d)
    if found:
        return min(found, key=lambda sides: (sides[0], sides))
    m = 1
    while m**d < n:
        m += 1
    return (m,) * d


def rank_key(seed: bytes, peer_id_text: str) -> bytes:
    """9.4 step 4: SHA-256 of the 64 bytes `seed + peer_id_bytes`."""
    return hashlib.sha256(seed + b58decode(peer_id_text)).digest()


def seeds(prefix: str, phase: int, d: int) -> tuple[bytes, bytes]:
    block_seed = hashlib.sha256(f"{prefix}|grid|{phase // d}".encode()).digest()
    round_seed = hashlib.sha256(f"{prefix}|round|{phase}".encode()).digest()
    return block_seed, round_seed


def make_groups(prefix: str, declarations: dict[str, dict[str, Any]], g: int) -> list[list[str]]:
    """9.4 steps 2 to 9 for the declarations of ONE layout: groups of base58 PeerIDs, each
    in its final (round-seed) order."""
    full = [p for p, d in declarations.items() if not d["client_mode"]]
    clients = [p for p, d in declarations.items() if d["client_mode"]]
    phase = lower_median([d["count"] for d in declarations.values()])
    n = len(full) or 1
    sides = grid_sides(n, g)
    d = len(sides)
    block_seed, round_seed = seeds(prefix, phase, d)
    ranked = sorted(full, key=lambda p: rank_key(block_seed, p))
    free = phase % d
    by_digits: dict[tuple[int, ...], list[str]] = {}
    for i, peer in enumerate(ranked):
        digits, radix = [], 1
        for side in sides:
            digits.append((i // radix) % side)
            radix *= side
        kept = tuple(digit for j, digit in enumerate(digits) if j != free)
        by_digits.setdefault(kept, []).append(peer)
    groups = [by_digits[key] for key in sorted(by_digits)]

    # step 6: singletons
    i = 0
    while i < len(groups):
        if len(groups[i]) == 1 and len(groups) > 1:
            others = [j for j in range(len(groups)) if j != i]
            roomy = [j for j in others if len(groups[j]) < g]
            if roomy:
                target = min(roomy, key=lambda j: (len(groups[j]), j))
                groups[target].append(groups[i][0])
                del groups[i]
                continue
            largest = min(others, key=lambda j: (-len(groups[j]), j))
            if len(groups[largest]) >= 3:
                groups[i].append(groups[largest].pop())
        i += 1

    # step 7: the odd one
    singles = [j for j, group in enumerate(groups) if len(group) == 1]
    if len(singles) == 1 and len(groups) >= 2 and ranked:
        odd = groups[singles[0]][0]
        mover = ranked[phase % n] if phase % n < len(ranked) else None
        if mover is not None and mover != odd:
            for group in groups:
                if mover in group:
                    group[group.index(mover)] = odd
                    break
            groups[singles[0]][0] = mover

    # step 8: clients
    full_set = set(full)
    lent = False
    alone: list[list[str]] = []
    for client in sorted(clients, key=lambda p: rank_key(round_seed, p)):
        roomy = [j for j in range(len(groups)) if len(groups[j]) < g]
        if roomy:
            target = min(roomy, key=lambda j: (len(groups[j]), j))
            groups[target].append(client)
            continue
        full_counts = [sum(1 for p in group if p in full_set) for group in groups]
        if not lent and full_counts and max(full_counts) >= 3:
            j = full_counts.index(max(full_counts))
            last_full = [p for p in groups[j] if p in full_set][-1]
            groups[j].remove(last_full)
            groups.append([last_full, client])
            lent = True
            continue
        alone.append([client])
    groups.extend(alone)

    # step 9
    return [sorted(group, key=lambda p: rank_key(round_seed, p)) for group in groups]


def compute_spans(bandwidths: list[float], total: int) -> list[tuple[int, int]]:
    """9.5 "Spans", as ours (the library) computes them as a leader."""
    k = len(bandwidths)
    median = lower_median(list(bandwidths))
    clipped = [min(b, 4 * median) for b in bandwidths]
    largest = max(clipped)
    scaled = [b / largest for b in clipped]
    weight = math.fsum(scaled)
    unit = 4096 if total >= 4096 * 4 * k else 1
    units = -(-total // unit)
    spans, start, acc = [], 0, 0.0
    for i, share in enumerate(scaled):
        acc += share
        stop = total if i == k - 1 else min(total, max(start, round(units * acc / weight) * unit))
        spans.append((start, stop))
        start = stop
    return spans


def effective_weights(
    members: list[tuple[str, dict[str, Any]]], max_staleness: int, decay: float
) -> dict[str, float | None]:
    """9.6: `weight * decay ** (E - e)`, or None for a stale member."""
    newest = max(d["epoch"] for _, d in members)
    return {
        p: (
            None
            if newest - d["epoch"] > max_staleness
            else d["weight"] * decay ** (newest - d["epoch"])
        )
        for p, d in members
    }


# ---------------------------------------------------------------- sections 2-4: one connection


@dataclass
class Incoming:
    """A request the remote sent us, answered by exactly one of reply/stream/error."""

    conn: MuxConnection
    request_id: int
    method: str
    body: dict[str, Any]
    payload: bytes
    timeout: float | None
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def peer_id(self) -> bytes:
        return self.conn.remote_peer_id

    def reply(self, body: dict[str, Any], payload: bytes = b"") -> None:
        self.conn.send_header({"v": 1, "k": "res", "id": self.request_id, "b": body}, payload)

    def item(self, body: dict[str, Any], payload: bytes = b"") -> None:
        self.conn.send_header({"v": 1, "k": "item", "id": self.request_id, "b": body}, payload)

    def end(self) -> None:
        self.conn.send_header({"v": 1, "k": "end", "id": self.request_id})

    def error(self, code: str, msg: str) -> None:
        self.conn.send_header(
            {"v": 1, "k": "err", "id": self.request_id, "code": code[:64], "msg": msg[:1024]}
        )


RequestHandler = Callable[[Incoming], None]


class MuxConnection:
    """One secure connection (sections 2-4) with concurrent calls both ways: a reader thread
    dispatches replies to waiting calls by id and requests to `handler` in threads."""

    def __init__(
        self,
        sock: socket.socket,
        handshake: HandshakeResult,
        leftover: bytes,
        handler: RequestHandler,
        outbound: bool,
    ) -> None:
        self.sock = sock
        self.handshake = handshake
        self.handler = handler
        self.outbound = outbound
        self.remote_peer_id = handshake.remote_peer_id
        self._raw = bytearray(leftover)
        self._plain = bytearray()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, queue.Queue[tuple[str, dict[str, Any], bytes]]] = {}
        self._serving: dict[int, Incoming] = {}
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self.got_bye = False
        self.violations: list[str] = []
        self.handler_failures: list[BaseException] = []
        sock.settimeout(10.0)  # bounds every sendall
        self._thread = threading.Thread(target=self._read_loop, daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        return not self.closed.is_set() and not self.got_bye

    # -- writing
    def send_header(self, header: dict[str, Any], payload: bytes = b"") -> None:
        content = encode_rpc_frame(header, payload)
        if len(content) > DEFAULT_MAX_FRAME_SIZE:
            raise CleanroomError(f"frame of {len(content)} bytes over the maximum")
        data = struct.pack(">I", len(content)) + content
        with self._send_lock:
            if self.closed.is_set():
                raise ConnectionClosed("connection closed")
            wire = bytearray()
            for start in range(0, len(data), MAX_PLAINTEXT_PER_MESSAGE):
                sealed = self.handshake.send.encrypt(
                    b"", data[start : start + MAX_PLAINTEXT_PER_MESSAGE]
                )
                wire += struct.pack(">H", len(sealed)) + sealed
            try:
                self.sock.sendall(wire)
            except OSError as exc:
                self._close(f"send failed: {exc!r}")
                raise ConnectionClosed("send failed") from exc

    # -- calls
    def _start_call(
        self, method: str, body: dict[str, Any], payload: bytes, timeout: float | None
    ) -> tuple[int, queue.Queue[tuple[str, dict[str, Any], bytes]]]:
        request_id = next(self._ids) % 2**32
        inbox: queue.Queue[tuple[str, dict[str, Any], bytes]] = queue.Queue()
        with self._lock:
            if not self.usable:
                raise ConnectionClosed("connection closed")
            self._pending[request_id] = inbox
        header: dict[str, Any] = {"v": 1, "k": "req", "id": request_id, "m": method}
        if timeout is not None:
            header["t"] = float(min(max(timeout, 0.001), 86400.0))
        header["b"] = body
        try:
            self.send_header(header, payload)
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            raise
        return request_id, inbox

    def _next(
        self,
        request_id: int,
        inbox: queue.Queue[tuple[str, dict[str, Any], bytes]],
        deadline: float,
    ) -> tuple[str, dict[str, Any], bytes]:
        try:
            return inbox.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            with self._lock:
                self._pending.pop(request_id, None)
            with contextlib.suppress(CleanroomError):
                self.send_header({"v": 1, "k": "cancel", "id": request_id})
            raise TimeoutError("no answer in time") from None

    def call(
        self, method: str, body: dict[str, Any], payload: bytes = b"", timeout: float = 5.0
    ) -> tuple[dict[str, Any], bytes]:
        """One request, its `res` (body, payload).

        Raises:
            RemoteError: an `err` answer. ConnectionClosed: the connection ended first.
            TimeoutError: no answer within `timeout` (a `cancel` is sent).
        """
        deadline = time.monotonic() + timeout
        request_id, inbox = self._start_call(method, body, payload, timeout)
        kind, header, got = self._next(request_id, inbox, deadline)
        with self._lock:
            self._pending.pop(request_id, None)
        if kind == "err":
            raise RemoteError(header.get("code", ""), header.get("msg", ""))
        if kind == "closed":
            raise ConnectionClosed(header.get("why", "closed"))
        if kind != "res":
            self.violations.append(f"{kind} frame answering plain call {method}")
            raise CleanroomError(f"unexpected {kind} for a plain call")
        return dict(header["b"]), got

    def stream(
        self, method: str, body: dict[str, Any], timeout: float, payload: bytes = b""
    ) -> Iterator[tuple[dict[str, Any], bytes]]:
        """A streaming request: yields each item (body, payload) until `end`.

        Raises: as `call`.
        """
        deadline = time.monotonic() + timeout
        request_id, inbox = self._start_call(method, body, payload, timeout)
        try:
            while True:
                kind, header, got = self._next(request_id, inbox, deadline)
                if kind == "item":
                    yield dict(header["b"]), got
                elif kind == "end":
                    return
                elif kind == "err":
                    raise RemoteError(header.get("code", ""), header.get("msg", ""))
                elif kind == "closed":
                    raise ConnectionClosed(header.get("why", "closed"))
                else:
                    self.violations.append(f"{kind} frame answering stream {method}")
                    raise CleanroomError(f"unexpected {kind} for a stream")
        finally:
            with self._lock:
                self._pending.pop(request_id, None)

    # -- reading
    def _read_loop(self) -> None:
        try:
            self._consume()  # bytes that came with the handshake's last message
            while not self.closed.is_set():
                ready, _, _ = select.select([self.sock], [], [], 0.25)
                if not ready:
                    continue
                try:
                    data = self.sock.recv(1 << 20)
                except (TimeoutError, BlockingIOError):
                    continue
                if not data:
                    self._close("closed by the remote")
                    return
                self._raw += data
                self._consume()
        except (OSError, ValueError) as exc:
            self._close(f"read failed: {exc!r}")
        except CleanroomError as exc:
            self.violations.append(str(exc))
            self._close(f"protocol violation: {exc}")

    def _consume(self) -> None:
        while len(self._raw) >= 2:
            (length,) = struct.unpack(">H", self._raw[:2])
            if length < TAG_SIZE:
                raise CleanroomError("transport message shorter than its tag")
            if len(self._raw) < 2 + length:
                break
            sealed = bytes(self._raw[2 : 2 + length])
            del self._raw[: 2 + length]
            self._plain += self.handshake.receive.decrypt(b"", sealed)
        while len(self._plain) >= 4:
            (length,) = struct.unpack(">I", self._plain[:4])
            if length > DEFAULT_MAX_FRAME_SIZE:
                raise CleanroomError(f"frame of {length} bytes")
            if len(self._plain) < 4 + length:
                break
            content = bytes(self._plain[4 : 4 + length])
            del self._plain[: 4 + length]
            self._dispatch(content)

    def _dispatch(self, content: bytes) -> None:
        if len(content) < 4:
            raise CleanroomError("RPC frame shorter than its header length")
        (header_length,) = struct.unpack(">I", content[:4])
        if header_length > MAX_HEADER_SIZE or 4 + header_length > len(content):
            raise CleanroomError("bad header length")
        try:
            header = msgpack.unpackb(
                content[4 : 4 + header_length], raw=False, use_list=False, strict_map_key=False
            )
        except Exception as exc:  # msgpack raises several types
            raise CleanroomError("header is not msgpack") from exc
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            raise CleanroomError(f"bad header {header!r}")
        payload = content[4 + header_length :]
        kind = header.get("k")
        if kind == "req":
            body = header.get("b")
            if not isinstance(body, dict) or not isinstance(header.get("m"), str):
                raise CleanroomError(f"bad request header {header!r}")
            incoming = Incoming(
                self, header["id"], header["m"], dict(body), payload, header.get("t")
            )
            with self._lock:
                self._serving[incoming.request_id] = incoming
            threading.Thread(target=self._serve, args=(incoming,), daemon=True).start()
        elif kind in ("res", "item", "end", "err"):
            with self._lock:
                inbox = self._pending.get(header.get("id", -1))
            if inbox is not None:
                inbox.put((kind, header, payload))
        elif kind == "cancel":
            with self._lock:
                served = self._serving.get(header.get("id", -1))
            if served is not None:
                served.cancelled.set()
        elif kind == "bye":
            # 4.3: the sender closes this idle connection now; fail what still waits here
            self.got_bye = True
            self._fail_pending("bye")
        else:
            raise CleanroomError(f"unknown kind {kind!r}")

    def _serve(self, incoming: Incoming) -> None:
        try:
            self.handler(incoming)
        except RemoteError as exc:
            with contextlib.suppress(CleanroomError):
                incoming.error(exc.code, exc.msg)
        except ConnectionClosed:
            pass
        except Exception as exc:
            self.handler_failures.append(exc)
            with contextlib.suppress(CleanroomError):
                incoming.error("internal", type(exc).__name__)
        finally:
            with self._lock:
                self._serving.pop(incoming.request_id, None)

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for inbox in pending:
            inbox.put(("closed", {"why": why}, b""))

    def _close(self, why: str) -> None:
        self.closed.set()
        self._fail_pending(why)
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._close("closed by us")
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)


class ConnectionPool:
    """Our connections, by remote PeerID: calls reuse any usable one, inbound ones included
    (section 5: the reference host keeps one connection per peer and calls over it)."""

    def __init__(self, identity: Identity, handler: RequestHandler) -> None:
        self.identity = identity
        self.handler = handler
        self._conns: dict[bytes, list[MuxConnection]] = {}
        self._lock = threading.Lock()
        self.all: list[MuxConnection] = []

    def add(self, conn: MuxConnection) -> None:
        with self._lock:
            self._conns.setdefault(conn.remote_peer_id, []).append(conn)
            self.all.append(conn)

    def get(self, address: str, fresh: bool = False) -> MuxConnection:
        """A usable connection to the peer `address` names (`PEERID@HOST:PORT`), dialled
        when none is open (or when `fresh`).

        Raises: OSError, CleanroomError: the dial or handshake failed.
        """
        parsed = Address.parse(address)
        if parsed.peer_id is not None and not fresh:
            with self._lock:
                for conn in reversed(self._conns.get(parsed.peer_id, [])):
                    if conn.usable:
                        return conn
        sock = socket.create_connection((parsed.host, parsed.port), timeout=5.0)
        try:
            sock.settimeout(5.0)
            reader = _SocketReader(sock)
            handshake = initiator_handshake(sock, reader, self.identity, parsed.peer_id)
        except BaseException:
            sock.close()
            raise
        conn = MuxConnection(sock, handshake, bytes(reader.buffer), self.handler, outbound=True)
        self.add(conn)
        return conn

    def has_usable(self, peer_id: bytes) -> MuxConnection | None:
        with self._lock:
            for conn in reversed(self._conns.get(peer_id, [])):
                if conn.usable:
                    return conn
        return None

    def close(self) -> None:
        with self._lock:
            conns = list(self.all)
        for conn in conns:
            conn.close()


class Listener:
    """Accepts connections on `host:0` and hands them, handshaken, to the pool."""

    def __init__(self, host: str, pool: ConnectionPool) -> None:
        self.pool = pool
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.host = host
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready or self._stop.is_set():
                continue
            try:
                sock, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(10.0)
            reader = _SocketReader(sock)
            handshake = responder_handshake(sock, reader, self.pool.identity)
        except (OSError, CleanroomError) as exc:
            self.failures.append(exc)
            sock.close()
            return
        conn = MuxConnection(
            sock, handshake, bytes(reader.buffer), self.pool.handler, outbound=False
        )
        self.pool.add(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


# ---------------------------------------------------------------- sections 5, 6: the DHT over a mux


def _dht_call(conn: MuxConnection, method: str, body: dict[str, Any]) -> dict[str, Any]:
    reply, _ = conn.call(method, {"t": f"{method}.req", "sender": None, **body}, timeout=5.0)
    if reply.get("t") != f"{method}.res":
        raise CleanroomError(f"reply to {method} has tag {reply.get('t')!r}")
    return reply


def dht_find_entries(
    conn: MuxConnection, key: str
) -> tuple[list[dict[str, Any]], list[tuple[bytes, str | None]]]:
    """Every entry a node holds under `key` (all pages) and the nodes it names."""
    entries: list[dict[str, Any]] = []
    nodes: list[tuple[bytes, str | None]] = []
    after: bytes | None = None
    while True:
        body = _dht_call(conn, "dht.find_value", {"key": dht_id(key), "after": after})
        nodes += [(node["p"], node["a"]) for node in body["nodes"]]
        if body["entries"] is None:
            return entries, nodes
        page = [dict(entry) for entry in body["entries"]]
        entries += page
        if not body["more"] or not page:
            return entries, nodes
        after = packb(page[-1]["s"])


# ---------------------------------------------------------------- the averager


@dataclass
class PartOutcome:
    index: int
    reducer: str
    span: tuple[int, int]
    status: str = "none"  # all / some / none
    contributors: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    weight: float = 0.0
    note: str = ""


@dataclass
class StepReport:
    outcome: str = "unconfirmed"
    round: int = -1
    group: list[str] = field(default_factory=list)  # the confirmed members (else our group)
    dht_group: list[str] = field(default_factory=list)  # our group by 9.4, from our read
    leader: str | None = None
    led: bool = False
    confirmation: dict[str, Any] | None = None
    declarations: dict[str, dict[str, Any]] = field(default_factory=dict)
    parts: list[PartOutcome] = field(default_factory=list)
    result: np.ndarray | None = None
    note: str = ""
    observations: list[str] = field(default_factory=list)  # spec findings, in words
    fetched_by: list[str] = field(default_factory=list)  # who downloaded our result
    chunks_from: dict[str, int] = field(default_factory=dict)  # chunks taken per sender
    raw_result_items: int = 0
    blob_result_items: int = 0
    phase: int | None = None
    next_count: int = 0  # 9.2 `count` for this averager's next declaration
    expirations: dict[str, float] = field(default_factory=dict)  # `x` of each entry read
    read_at: float = 0.0  # when we read the round
    read_entries: dict[Any, Any] = field(default_factory=dict)  # that read: subkey -> value
    repeat_answers: dict[str, str] = field(default_factory=dict)


class _Reducer:
    """Our part, as a reducer (9.6)."""

    def __init__(
        self,
        owner: CleanroomAverager,
        index: int,
        span: tuple[int, int],
        members: list[tuple[str, dict[str, Any]]],
        weights: dict[str, float | None],
        own: np.ndarray,
        cutoff: float,
        end: float,
    ) -> None:
        self.owner = owner
        self.index = index
        self.span = span
        self.members = dict(members)
        self.weights = weights
        self.own = own
        self.cutoff = cutoff  # time.time() values
        self.end = end
        n = span[1] - span[0]
        self.chunk_elems = owner.chunk_bytes // 4
        self.count = -(-n // self.chunk_elems) if n else 0
        me = owner.identity.peer_id_text
        self.senders = [p for p, _ in members if p != me]
        self.state: dict[str, str] = {}  # pending / complete / a drop reason
        self.chunks: dict[str, dict[int, tuple[bytes, np.ndarray]]] = {p: {} for p in self.senders}
        for p in self.senders:
            self.state[p] = "stale" if weights[p] is None else "pending"
        self.cond = threading.Condition()
        self.final = False
        self.header: dict[str, Any] | None = None
        self.items: list[tuple[dict[str, Any], bytes]] = []
        self.result: np.ndarray | None = None
        self.fetched: set[str] = set()
        self.last_progress = time.monotonic()

    def chunk_length(self, chunk: int) -> int:
        n = self.span[1] - self.span[0]
        return min(self.chunk_elems, n - chunk * self.chunk_elems)

    def take(self, sender: str, body: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """A chunk call; returns the reply body or raises RemoteError (9, `{m}.chunk`)."""
        with self.cond:
            if sender not in self.state:
                raise RemoteError("bad_request", "not a sender of this part")
            status = self.state[sender]
            if status == "complete":
                raise RemoteError("dropped", "complete")
            if status != "pending":
                raise RemoteError("dropped", status)
            if time.time() > self.cutoff or self.final:
                self._drop(sender, "timeout")
                raise RemoteError("dropped", "timeout")
            declared = self.members[sender]
            if (
                body["epoch"] != declared["epoch"]
                or body["weight"] != declared["weight"]
                or type(body["weight"]) is not type(declared["weight"])
            ):
                self._drop(sender, "garbage")
                raise RemoteError("dropped", "garbage")
            if "abort" in body:
                self._drop(sender, body["abort"] if body["abort"] in DROP_REASONS else "garbage")
                return {}
            chunk = body["chunk"]
            if chunk >= self.count:
                self._drop(sender, "garbage")
                raise RemoteError("dropped", "garbage")
            if chunk in self.chunks[sender]:
                if body.get("retry") and self.chunks[sender][chunk][0] == payload:
                    return {}
                self._drop(sender, "garbage")
                raise RemoteError("dropped", "garbage")
            length = self.chunk_length(chunk)
            try:
                if body.get("raw"):
                    if self.owner.codec != "none" or len(payload) != 4 * length:
                        raise BlobError("raw payload")
                    values = np.frombuffer(payload, "<f4").astype(np.float32)
                else:
                    owner = self.owner
                    start = self.span[0] + chunk * self.chunk_elems
                    values = decode_chunk(
                        owner.codec, owner.bounds, payload, start, length, owner.block_size
                    )
            except BlobError:
                self._drop(sender, "garbage")
                raise RemoteError("dropped", "garbage") from None
            if not np.all(np.isfinite(values)):
                self._drop(sender, "nonfinite")
                raise RemoteError("dropped", "nonfinite")
            self.chunks[sender][chunk] = (bytes(payload), values)
            self.owner.report.chunks_from[sender] = self.owner.report.chunks_from.get(sender, 0) + 1
            if len(self.chunks[sender]) == self.count:
                self.state[sender] = "complete"
            self.last_progress = time.monotonic()
            self.cond.notify_all()
            return {}

    def _drop(self, sender: str, reason: str) -> None:
        self.state[sender] = reason
        self.chunks[sender] = {}
        self.cond.notify_all()

    def finish(self) -> None:
        """Wait until every sender is in or out, or the cutoff; then the mean (9.6)."""
        with self.cond:
            if self.count == 0:
                for sender, status in self.state.items():
                    if status == "pending":
                        self.state[sender] = "complete"  # an empty part: nothing to send
            while any(s == "pending" for s in self.state.values()):
                left = self.cutoff - time.time()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.1))
            for sender, status in self.state.items():
                if status == "pending":
                    self._drop(sender, "timeout")
            me = self.owner.identity.peer_id_text
            contributors = [me] if self.weights[me] is not None else []
            contributors += [p for p in self.senders if self.state[p] == "complete"]
            dropped = [[p, self.state[p]] for p in self.senders if self.state[p] != "complete"]
            if self.weights[me] is None:
                # READING: 9.6 does not say whether a stale reducer lists itself in `dropped`;
                # the library's stale reducer does (and accepts a header that does not)
                dropped.insert(0, [me, "stale"])
            weight = math.fsum(self.weights[p] for p in contributors)  # type: ignore[misc]
            n = self.span[1] - self.span[0]
            header: dict[str, Any] = {
                "contributors": contributors,
                "dropped": dropped,
                "weight": weight,
                "chunks": self.count if weight > 0 else 0,
            }
            mean = self.own.astype(np.float64).copy()
            if weight > 0 and n:
                # READING: 9.6 "any mean of the contributors' values within the codec's error
                # interoperates": float64 weights normalised by the largest, one division
                largest = max(self.weights[p] for p in contributors)  # type: ignore[type-var]
                total = np.zeros(n, dtype=np.float64)
                for p in contributors:
                    share = self.weights[p] / largest  # type: ignore[operator]
                    if p == me:
                        values = self.own.astype(np.float64)
                    else:
                        values = np.concatenate([self.chunks[p][c][1] for c in range(self.count)])
                    total += share * values.astype(np.float64)
                mean = total / math.fsum(self.weights[p] / largest for p in contributors)  # type: ignore[operator]
            mean32 = mean.astype(np.float32)
            items: list[tuple[dict[str, Any], bytes]] = []
            own_copy = self.own.copy()
            if header["chunks"]:
                pieces = []
                for c in range(self.count):
                    piece = mean32[
                        c * self.chunk_elems : c * self.chunk_elems + self.chunk_length(c)
                    ]
                    if self.owner.codec == "none":
                        items.append(({"chunk": c, "raw": True}, piece.astype("<f4").tobytes()))
                        pieces.append(piece)
                    else:
                        owner, start = self.owner, self.span[0] + c * self.chunk_elems
                        codec, bounds = owner.codec, owner.bounds
                        blob = encode_chunk(codec, bounds, piece, start, owner.block_size)
                        items.append(({"chunk": c}, blob))
                        pieces.append(  # the same blobs
                            decode_chunk(codec, bounds, blob, start, piece.size, owner.block_size)
                        )
                own_copy = np.concatenate(pieces) if pieces else own_copy
            self.header = header
            self.items = items
            self.result = own_copy
            self.final = True
            self.last_progress = time.monotonic()
            self.cond.notify_all()

    def serve(self, incoming: Incoming) -> None:
        """The result stream (9.6): header item, chunk items, end."""
        caller = b58encode(incoming.peer_id)
        if caller not in self.members or caller == self.owner.identity.peer_id_text:
            raise RemoteError("bad_request", "not a member of this group")
        with self.cond:
            while not self.final:
                left = self.end - time.time()
                if left <= 0 or incoming.cancelled.is_set():
                    raise RemoteError("unavailable", "the round ended before the result")
                self.cond.wait(min(left, 0.1))
            header, items = self.header, list(self.items)
        assert header is not None
        incoming.item(header)
        for body, payload in items:
            if incoming.cancelled.is_set():
                return
            incoming.item(body, payload)
        incoming.end()
        with self.cond:
            self.fetched.add(caller)
            self.owner.report.fetched_by.append(caller)
            self.last_progress = time.monotonic()
            self.cond.notify_all()

    def wait_fetched(self, stall_timeout: float) -> None:
        """9.6 "Serving": until every member fetched, no progress for stall_timeout, or the end."""
        wanted = set(self.senders)
        with self.cond:
            while not wanted <= self.fetched:
                if time.time() >= self.end or time.monotonic() - self.last_progress > stall_timeout:
                    return
                self.cond.wait(0.1)


class CleanroomAverager:
    """One averaging member of `prefix` over a 1-d float32 vector (see the module doc)."""

    def __init__(
        self,
        identity: Identity,
        bootstrap: str,
        prefix: str,
        values: np.ndarray,
        *,
        codec: str = "none",
        block_size: int = 4096,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        group_size: int = 16,
        max_staleness: int = 2,
        staleness_decay: float = 0.5,
        gather_window: float = 2.0,
        join_timeout: float = 1.0,
        stall_timeout: float = 5.0,
        result_share: float = 0.35,
        bandwidth: float = 1.0,
        client_mode: bool = False,
        shapes: list[tuple[int, ...]] | None = None,
        host: str = "127.0.0.1",
        none_blobs: bool = True,
        on_confirmed: Callable[[CleanroomAverager, dict[str, Any]], None] | None = None,
        declare: bool = True,
        abort_parts: frozenset[int] = frozenset(),
        probe_repeats: bool = False,
        dht_everywhere: bool = True,
    ) -> None:
        self.identity = identity
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        self.codec = codec
        self.block_size = block_size
        self.chunk_bytes = chunk_bytes
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.staleness_decay = staleness_decay
        self.gather_window = gather_window
        self.join_timeout = join_timeout
        self.stall_timeout = stall_timeout
        self.result_share = result_share
        self.bandwidth = bandwidth
        self.client_mode = client_mode
        self.none_blobs = none_blobs  # under `none`, send odd chunks as blobs (both ways, 9)
        self.on_confirmed = on_confirmed  # a test's probes, run before our uploads start
        # False: a caller of "another view of the round" (9.5): no declaration; reads the
        # round just before it closes and joins the leader of the others' group
        self.declare = declare
        self.abort_parts = abort_parts  # parts we withdraw from (`abort`, 9) instead
        # on the first part we upload: send chunk 0 again with `retry`, and after the last
        # chunk once more without it; the answers go to `report.repeat_answers`
        self.probe_repeats = probe_repeats
        # False: read and store through the bootstrap only, so that the library peers
        # have no connection to us and must dial our declared address
        self.dht_everywhere = dht_everywhere
        # set once the repeats are probed: until then we do not fetch that part's result
        # (the reducer serves until every member fetched: its round, ours, stays open)
        self._probed = threading.Event()
        self._probed_part: int | None = None
        self.m = method_prefix(prefix)
        text = codec_text(
            codec, chunk_bytes, group_size, max_staleness, staleness_decay, block_size
        )
        # the tensors the vector holds end to end (9.3's shapes; one by default)
        self.shapes = list(shapes) if shapes is not None else [self.values.shape]
        sizes = [math.prod(shape) for shape in self.shapes]
        if sum(sizes) != self.values.size:
            raise ValueError("the shapes do not hold the values")
        self.bounds = list(itertools.accumulate(sizes))[:-1]  # where the later ones begin
        self.layout = layout_fingerprint(self.shapes, ["float32"] * len(self.shapes), text)
        self.pool = ConnectionPool(identity, self._handle)
        self.listener = None if client_mode else Listener(host, self.pool)
        self.address = (
            None
            if self.listener is None
            else f"{identity.peer_id_text}@{host}:{self.listener.port}"
        )
        self.report = StepReport()
        self._state_lock = threading.Condition()
        self._round: int | None = None  # the round we are in (handlers answer for it)
        self._grouped = False
        self._leading = False
        self._leader_address: tuple[str, str] | None = None
        self._expected: list[str] = []
        self._group: list[str] = []
        self._other_groups: set[str] = set()
        self._joined: dict[str, dict[str, Any]] = {}
        self._confirmation: dict[str, Any] | None = None
        self._confirmed = False
        self._group_id: bytes | None = None  # 9: the group's tag (group_tag)
        self._reducer: _Reducer | None = None
        self._decl: dict[str, Any] = {}
        self._saw: list[int] | None = None  # 9.2: the step tags our read grouped (marker)
        self.join_requests: list[dict[str, Any]] = []
        self.ping_requests: list[dict[str, Any]] = []
        self.unknown_requests: list[str] = []
        # every request the library sent us: (method less `{m}`, body, header `t`, payload
        # size, the payload's first 24 bytes)
        self.requests_seen: list[tuple[str, dict[str, Any], float | None, int, bytes]] = []
        # (method less `{m}`, whether it came on a connection the remote opened)
        self.inbound_requests: list[tuple[str, bool]] = []
        self.result_items_seen: list[tuple[int, dict[str, Any], int]] = []  # part, body, size

    # ------------------------------------------------------------ serving

    def _handle(self, incoming: Incoming) -> None:
        method = incoming.method
        self.inbound_requests.append((method.removeprefix(self.m), not incoming.conn.outbound))
        self.requests_seen.append(
            (
                method.removeprefix(self.m),
                dict(incoming.body),
                incoming.timeout,
                len(incoming.payload),
                bytes(incoming.payload[:24]),
            )
        )
        if method == f"{self.m}.join":
            incoming.reply(self._on_join(incoming))
        elif method == f"{self.m}.chunk":
            incoming.reply(self._on_chunk(incoming))
        elif method == f"{self.m}.result":
            self._on_result(incoming)
        elif method == f"{self.m}.ping":
            self.ping_requests.append(dict(incoming.body))
            round_number = incoming.body.get("round")
            if "round" in incoming.body:
                if not isinstance(round_number, int) or isinstance(round_number, bool):
                    raise RemoteError("bad_request", "bad round")
                if not 0 <= round_number < MAX_EPOCH:
                    raise RemoteError("bad_request", "bad round")
                group = incoming.body.get("group")
                if "group" in incoming.body and not _is_tag(group):
                    raise RemoteError("bad_request", "bad group")
                with self._state_lock:
                    if round_number != self._round:
                        raise RemoteError("not_found", f"not in round {round_number}")
                    if group is not None and self._confirmed and group != self._group_id:
                        raise RemoteError("not_found", "not in that group")
            elif "group" in incoming.body:
                raise RemoteError("bad_request", "a group without its round")
            incoming.reply({})
        else:
            self.unknown_requests.append(method)
            raise RemoteError("unknown_method", f"no method {method}")

    def _on_join(self, incoming: Incoming) -> dict[str, Any]:
        body = incoming.body
        self.join_requests.append(dict(body))
        if set(body) - {"round", "decl", "skipped"} or not {"round", "decl"} <= set(body):
            raise RemoteError("bad_request", "join keys")
        if incoming.payload:
            raise RemoteError("bad_request", "a join carries no payload")
        caller = b58encode(incoming.peer_id)
        decl = parse_declaration(caller, body["decl"])
        if decl is None or not _is_int(body["round"]):
            raise RemoteError("bad_request", "bad declaration")
        with self._state_lock:
            if body["round"] != self._round:
                raise RemoteError("not_found", f"not in round {body['round']}")
            if decl["layout"] != self.layout:
                raise RemoteError("mismatch", f"layout {self.layout}")
            # a join before our read of the round waits for it ("a join also wakes a leader")
            limit = time.time() + self.gather_window + self.join_timeout + 1.0
            while not self._grouped and time.time() < limit:
                self._state_lock.wait(0.05)
            if not self._grouped:
                raise RemoteError("not_found", "round not decided")
            skipped = body.get("skipped") or ()
            # averaging.md, "A ghost leader": a join naming our own leader as skipped is
            # answered from where our own walk stands once we know whether that leader is
            # gone (READING: protocol.md's join row does not say; answering `not_leader`
            # at once sent the library member back to the ghost, unconfirmed)
            while (
                not self._leading
                and self._leader_address is not None
                and self._leader_address[0] in skipped
                and time.time() < limit
            ):
                self._state_lock.wait(0.02)
            if not self._leading:
                if self._leader_address is None:
                    return {"status": "closed"}
                leader, address = self._leader_address
                return {"status": "not_leader", "leader": leader, "address": address}
            if self._confirmation is None:
                if caller not in self._expected and caller in self._other_groups:
                    return {"status": "full"}
                if (
                    caller not in self._expected
                    and len(self._group) + len([p for p in self._joined if p not in self._group])
                    >= self.group_size
                ):
                    return {"status": "full"}
                self._joined[caller] = {k: v for k, v in decl["raw"].items()}
                self._state_lock.notify_all()
            while self._confirmation is None and time.time() < limit + self.join_timeout:
                self._state_lock.wait(0.05)
            if self._confirmation is None:
                return {"status": "closed"}
            if caller not in [p for p, _ in self._confirmation["members"]]:
                return {"status": "closed"}
            return self._confirmation

    def _on_chunk(self, incoming: Incoming) -> dict[str, Any]:
        body = incoming.body
        required = {"round", "group", "part", "chunk", "epoch", "weight"}
        optional = {"raw", "abort", "retry"}
        names_round = all(_is_int(body.get(k)) for k in ("round", "part")) and _is_tag(
            body.get("group")
        )
        with self._state_lock:
            reducer = self._reducer
            in_round = body.get("round") == self._round and self._round is not None
            confirmed = self._confirmed
            group_id = self._group_id
        well_formed = (
            required <= set(body)
            and not set(body) - required - optional
            and all(_is_int(body[k]) for k in ("round", "part", "chunk", "epoch"))
            and _is_tag(body["group"])
            and 0 <= body["part"] < 256
            and 0 <= body["chunk"] < 2**32
            and _is_number(body["weight"])
            and all(isinstance(body[k], bool) for k in ("raw", "retry") if k in body)
            and ("abort" not in body or isinstance(body["abort"], str))
        )
        if not well_formed:
            ours = names_round and in_round and body["group"] == group_id
            if ours and reducer is not None and body["part"] == reducer.index:
                with reducer.cond:
                    caller = b58encode(incoming.peer_id)
                    if reducer.state.get(caller) == "pending":
                        reducer._drop(caller, "garbage")
            raise RemoteError("bad_request", "malformed chunk")
        if not in_round:
            raise RemoteError("not_found", f"not in round {body['round']}")
        if not confirmed:
            raise RemoteError("busy", "group not confirmed yet")  # 9: "busy at once"
        if body["group"] != group_id:
            raise RemoteError("not_found", "not in that group")
        if reducer is None or body["part"] != reducer.index:
            raise RemoteError("bad_request", "not a part we reduce")
        return reducer.take(b58encode(incoming.peer_id), body, incoming.payload)

    def _on_result(self, incoming: Incoming) -> None:
        body = incoming.body
        if set(body) != {"round", "group", "part"} or incoming.payload:
            raise RemoteError("bad_request", "result keys")
        if not all(_is_int(body[k]) for k in ("round", "part")) or not 0 <= body["part"] < 256:
            raise RemoteError("bad_request", "result keys")
        if not _is_tag(body["group"]):
            raise RemoteError("bad_request", "result keys")
        limit = time.time() + 10.0
        with self._state_lock:
            if body["round"] != self._round:
                raise RemoteError("not_found", f"not in round {body['round']}")
            while not self._confirmed and time.time() < limit:
                self._state_lock.wait(0.05)
            if body["group"] != self._group_id:
                raise RemoteError("not_found", "not in that group")
            reducer = self._reducer
        if reducer is None or body["part"] != reducer.index:
            raise RemoteError("bad_request", "not a part we reduce")
        reducer.serve(incoming)

    # ------------------------------------------------------------ DHT

    def _dht_nodes(self, key: str) -> list[str]:
        """The bootstrap and the nodes it names for `key` (addresses with PeerIDs)."""
        conn = self.pool.get(self.bootstrap)
        nodes = [self.bootstrap]
        if not self.dht_everywhere:
            return nodes
        body = _dht_call(conn, "dht.find_node", {"target": dht_id(key)})
        for node in body["nodes"]:
            if node["a"] is not None:
                nodes.append(f"{b58encode(node['p'])}@{node['a']}")
        return nodes

    def _store(self, key: str, value: Any, ttl: float) -> int:
        """Store `value` under our own PeerID subkey, signed, on every node we know; returns
        how many accepted it."""
        entry = make_entry(key, self.identity.peer_id_text, value, time.time() + ttl, self.identity)
        accepted = 0
        for address in self._dht_nodes(key):
            try:
                conn = self.pool.get(address)
                reply = _dht_call(
                    conn,
                    "dht.store",
                    {"key": dht_id(key), "name": key, "entries": [entry], "want_nodes": False},
                )
            except (OSError, CleanroomError, TimeoutError):
                continue
            accepted += bool(reply["accepted"][0])
        return accepted

    def _read(self, key: str) -> dict[Any, Any]:
        """Every node's entries under `key`, merged (the later expiration wins), checked."""
        best: dict[Any, dict[str, Any]] = {}
        for address in self._dht_nodes(key):
            try:
                conn = self.pool.get(address)
                entries, _ = dht_find_entries(conn, key)
            except (OSError, CleanroomError, TimeoutError):
                continue
            for entry in entries:
                if not verify_entry_signature(dht_id(key), entry):
                    self.report.observations.append(f"forged entry under {key}")
                    continue
                subkey = entry["s"]
                if is_peer_id_text(subkey):
                    owner = entry.get("o")
                    if owner is None or b58encode(hashlib.sha256(owner).digest()) != subkey:
                        continue  # 6 rule 3, checked by readers too
                if time.time() >= entry["x"]:
                    continue
                if subkey not in best or entry["x"] > best[subkey]["x"]:
                    best[subkey] = entry
        self.report.expirations = {str(s): float(e["x"]) for s, e in best.items()}
        return {subkey: unpack_value(entry["v"]) for subkey, entry in best.items()}

    # ------------------------------------------------------------ a step

    def _choose_round(self, now: float) -> int:
        """9.2: floor(t / w) + 1 when it closes at least w/2 away; else that one if still
        w/8 away and somebody of our layout declared in it; else the next."""
        window = self.gather_window
        r = math.floor(now / window) + 1
        if r * window - now >= window / 2:
            return r
        if r * window - now >= window / 8:
            read = self._read(round_key(self.prefix, r))
            for s, v in read.items():
                decl = parse_declaration(s, v) if is_peer_id_text(s) else None
                if (
                    decl is not None
                    and decl["layout"] == self.layout
                    and s != self.identity.peer_id_text
                ):
                    return r
        return r + 1

    def step(self, weight: float, epoch: int, timeout: float = 15.0, count: int = 0) -> StepReport:
        """One averaging step; `count` is the round count to declare (9.2)."""
        report = self.report
        report.next_count = count
        started = time.time()
        deadline = started + timeout
        ttl = 3 * self.gather_window + self.join_timeout + 30
        r = self._choose_round(started)
        report.round = r
        key = round_key(self.prefix, r)
        self._decl = {
            "address": self.address,
            "weight": weight,
            "epoch": epoch,
            "bandwidth": self.bandwidth,
            "client_mode": self.client_mode,
            "layout": self.layout,
            "count": count,
            "total": int(self.values.size),
            "group_size": self.group_size,
            "detail": f"float32, {self.codec}, clean-room member, layout v9",
            "step": secrets.randbelow(2**32 - 1) + 1,  # 9.2: a random tag, anew each step
        }
        with self._state_lock:
            self._round = r  # entered: from here we answer for this round
        close = r * self.gather_window
        self._saw = None
        if not self.declare:
            time.sleep(max(close - 0.4 - time.time(), 0.0))
            return self._step_as_stranger(key, close, deadline, ttl)
        if not self._store(key, self._decl, ttl):
            report.observations.append("no node accepted our declaration")
        time.sleep(max(close - time.time(), 0.0))

        # read the round when it closes, add ourselves, group (9.2, 9.4)
        read = self._read(key)
        report.read_at = time.time()
        report.read_entries = dict(read)
        me = self.identity.peer_id_text
        decls: dict[str, dict[str, Any]] = {}
        for subkey, value in read.items():
            if is_peer_id_text(subkey):
                parsed = parse_declaration(subkey, value)
                if parsed is None and subkey != me and self._saw_us(value):
                    # 9.2: it read our declaration, grouped and withdrew: group what it did
                    parsed = parse_declaration(subkey, value["closed"])
                if parsed is not None:
                    decls[subkey] = parsed
        tags = (d["raw"].get("step", 0) for p, d in decls.items() if p != me)
        self._saw = sorted({t for t in tags if type(t) is int and 0 < t < 2**32})[:1024]
        decls[me] = parse_declaration(me, self._decl)  # type: ignore[assignment]
        report.declarations = {p: d["raw"] for p, d in decls.items()}
        mine = {p: d for p, d in decls.items() if d["layout"] == self.layout}
        groups = make_groups(self.prefix, mine, self.group_size)
        report.phase = lower_median([d["count"] for d in mine.values()])
        if len(mine) > 1:  # 9.2: read other peers of its layout: take the round's phase
            report.next_count = report.phase
        group = next(g for g in groups if me in g)
        report.group = list(group)
        report.dht_group = list(group)
        full_members = [p for p in group if not mine[p]["client_mode"]]
        with self._state_lock:
            self._group = list(group)
            self._other_groups = {p for g in groups if me not in g for p in g}
        if len(group) < 2 or not full_members:
            with self._state_lock:
                self._grouped = True
                self._state_lock.notify_all()
            report.outcome = "alone"
            report.note = "the grouping left us alone"
            self._finish_step(key, ttl)
            return report

        confirmation = self._lead_or_join(group, full_members, mine, close, deadline)
        if confirmation is None:
            self._finish_step(key, ttl)
            return report
        receipt = time.time()
        report.confirmation = confirmation
        report.group = [p for p, _ in confirmation["members"]]
        counts = [int(d["count"]) for _, d in confirmation["members"]]
        report.next_count = (max(report.phase, lower_median(counts)) + 1) % MAX_EPOCH
        if self.on_confirmed is not None:
            self.on_confirmed(self, confirmation)
        self._butterfly(confirmation, receipt, deadline)
        self._finish_step(key, ttl)
        return report

    def _step_as_stranger(self, key: str, close: float, deadline: float, ttl: float) -> StepReport:
        """Join the leader of the others' group before it answers, undeclared (9.5: "a
        caller of another view of the round, admitted while there was room")."""
        report = self.report
        read = self._read(key)
        report.read_at = time.time()
        report.read_entries = dict(read)
        decls = {
            s: d
            for s, d in (
                (s, parse_declaration(s, v)) for s, v in read.items() if is_peer_id_text(s)
            )
            if d is not None and d["layout"] == self.layout
        }
        report.declarations = {p: d["raw"] for p, d in decls.items()}
        groups = make_groups(self.prefix, decls, self.group_size) if decls else []
        if not groups:
            report.outcome = "alone"
            return report
        full_members = [p for p in groups[0] if not decls[p]["client_mode"]]
        report.dht_group = list(groups[0])
        confirmation = self._lead_or_join(groups[0], full_members, decls, close, deadline)
        if confirmation is None:
            return report
        receipt = time.time()
        report.confirmation = confirmation
        report.group = [p for p, _ in confirmation["members"]]
        if self.on_confirmed is not None:
            self.on_confirmed(self, confirmation)
        self._butterfly(confirmation, receipt, deadline)
        with self._state_lock:
            self._round = None
        return report

    def _lead_or_join(
        self,
        group: list[str],
        full_members: list[str],
        decls: dict[str, dict[str, Any]],
        close: float,
        deadline: float,
    ) -> dict[str, Any] | None:
        me = self.identity.peer_id_text
        report = self.report
        skipped: list[str] = []
        give_up = close + self.join_timeout + self.stall_timeout
        redirected = False
        candidates = list(full_members)
        while candidates:
            leader = candidates[0]
            if leader == me:
                return self._lead(group, skipped, close, deadline)
            report.leader = leader
            with self._state_lock:
                self._leader_address = (leader, decls[leader]["address"])
                self._grouped = True
                self._state_lock.notify_all()
            body: dict[str, Any] = {"round": report.round, "decl": self._decl}
            if skipped:
                body["skipped"] = list(skipped)
            try:
                conn = self.pool.get(decls[leader]["address"])
                answer, _ = conn.call(
                    f"{self.m}.join", body, timeout=max(give_up - time.time(), 0.05)
                )
            except RemoteError as exc:
                if exc.code in ("not_found", "unknown_method"):
                    skipped.append(leader)
                    candidates.pop(0)
                    continue
                report.outcome = "unconfirmed"
                report.note = f"join refused: {exc}"
                return None
            except (OSError, ConnectionClosed) as exc:
                skipped.append(leader)
                candidates.pop(0)
                report.observations.append(f"join to {leader} failed at once: {exc!r}")
                continue
            except (TimeoutError, CleanroomError) as exc:
                report.outcome = "unconfirmed"
                report.note = f"no confirmation: {exc!r}"
                return None
            status = answer.get("status")
            if status == "not_leader" and not redirected:
                report.observations.append(f"redirected by {leader}: {answer!r}")
                redirected = True
                named = str(answer.get("leader"))
                decls.setdefault(named, {"address": answer.get("address"), "client_mode": False})
                decls[named]["address"] = answer.get("address")
                candidates.insert(0, named)
                continue
            if status != "ok":
                report.outcome = "unconfirmed"
                report.note = f"leader answered {answer!r}"
                return None
            return self._accept_confirmation(answer)
        report.outcome = "unconfirmed"
        report.note = "no leader answered"
        return None

    def _accept_confirmation(self, answer: dict[str, Any]) -> dict[str, Any] | None:
        """9.5: only for our round and with us among `members`; spans must tile."""
        report = self.report
        me = self.identity.peer_id_text
        if set(answer) != {"status", "round", "group", "members", "spans", "budget"}:
            report.observations.append(f"confirmation keys {sorted(answer)}")
        group = answer.get("group")
        if not (_is_int(group) and 1 <= group < 2**62):
            report.outcome = "unconfirmed"
            report.note = f"a confirmation's group tag is {group!r}"
            return None
        members = [(p, dict(d)) for p, d in answer["members"]]
        spans = [tuple(s) for s in answer["spans"]]
        if answer["round"] != report.round or me not in [p for p, _ in members]:
            report.outcome = "unconfirmed"
            report.note = "a confirmation for another round or without us"
            return None
        total = int(self.values.size)
        start = 0
        for a, b in spans:
            if a != start or b < a:
                report.outcome = "unconfirmed"
                report.note = f"spans do not tile: {spans}"
                return None
            start = b
        reducers = [p for p, d in members if not d.get("client_mode", d.get("address") is None)]
        if start != total or len(spans) != len(reducers):
            report.outcome = "unconfirmed"
            report.note = f"spans do not tile [0, {total}): {spans}"
            return None
        confirmation = {**answer, "members": members, "spans": spans}
        with self._state_lock:
            self._confirmation = confirmation
            self._group_id = group_tag(report.round, group, members, spans)
        return confirmation

    def _lead(
        self, group: list[str], skipped: list[str], close: float, deadline: float
    ) -> dict[str, Any] | None:
        """9.5 as a leader: wait for the expected members (or join_timeout after the close),
        then answer every join with the same confirmation."""
        me = self.identity.peer_id_text
        report = self.report
        report.led = True
        report.leader = me
        expected = [p for p in group if p != me and p not in skipped]
        with self._state_lock:
            self._leading = True
            self._expected = expected
            self._grouped = True
            self._state_lock.notify_all()
            wait_until = max(close, time.time()) + self.join_timeout
            while not set(expected) <= set(self._joined) and time.time() < wait_until:
                self._state_lock.wait(0.02)
            joined = dict(self._joined)
        if not joined:
            report.outcome = "alone"
            report.note = "nobody joined"
            with self._state_lock:
                self._confirmation = None
                self._leading = False
            return None
        in_group = [p for p in group if p == me or p in joined]
        strangers = sorted((p for p in joined if p not in group), key=b58decode)
        order = in_group + strangers
        members = [(p, self._decl if p == me else joined[p]) for p in order]
        reducers = [d for _, d in members if not d.get("client_mode", d.get("address") is None)]
        spans = compute_spans([float(d["bandwidth"]) for d in reducers], int(self.values.size))
        budget = max(deadline - time.time(), 0.001)
        group = secrets.randbelow(2**62 - 1) + 1  # 9.5: a tag for this group
        confirmation = {
            "status": "ok",
            "round": report.round,
            "group": group,
            "members": [[p, d] for p, d in members],
            "spans": [list(s) for s in spans],
            "budget": budget,
        }
        with self._state_lock:
            self._confirmation = confirmation
            self._group_id = group_tag(report.round, group, members, spans)
            self._state_lock.notify_all()
        return {**confirmation, "members": members, "spans": spans}

    def _butterfly(self, confirmation: dict[str, Any], receipt: float, deadline: float) -> None:
        report = self.report
        me = self.identity.peer_id_text
        members: list[tuple[str, dict[str, Any]]] = confirmation["members"]
        spans: list[tuple[int, int]] = confirmation["spans"]
        end = min(deadline, receipt + float(confirmation["budget"]))
        cutoff = receipt + (end - receipt) * (1 - self.result_share)
        parsed = {p: parse_declaration(p, d) for p, d in members}
        if any(v is None for v in parsed.values()):
            report.observations.append("a confirmation member's declaration does not parse")
        decl_of = {p: parsed[p] or d for p, d in members}
        reducers = [p for p, _ in members if not decl_of[p]["client_mode"]]
        weights = effective_weights(
            [(p, decl_of[p]) for p, _ in members], self.max_staleness, self.staleness_decay
        )
        my_part = reducers.index(me) if me in reducers else None
        result = self.values.copy()
        report.parts = [PartOutcome(i, reducers[i], spans[i]) for i in range(len(reducers))]
        if my_part is not None:
            a, b = spans[my_part]
            reducer = _Reducer(
                self,
                my_part,
                (a, b),
                [(p, decl_of[p]) for p, _ in members],
                weights,
                self.values[a:b].copy(),
                cutoff,
                end,
            )
            with self._state_lock:
                self._reducer = reducer
        with self._state_lock:
            self._confirmed = True
            self._state_lock.notify_all()

        threads = []
        fetched: dict[int, np.ndarray] = {}
        probed = next(
            (
                i
                for i in range(len(reducers))
                if i != my_part and spans[i][1] > spans[i][0] and i not in self.abort_parts
            ),
            None,
        )
        self._probed_part = probed if self.probe_repeats else None
        for i, reducer_id in enumerate(reducers):
            if i == my_part:
                continue
            address = decl_of[reducer_id]["address"]
            threads.append(
                threading.Thread(
                    target=self._upload,
                    args=(
                        i,
                        reducer_id,
                        address,
                        spans[i],
                        cutoff,
                        self.probe_repeats and i == probed,
                    ),
                    daemon=True,
                )
            )
            threads.append(
                threading.Thread(
                    target=self._download,
                    args=(i, reducer_id, address, spans[i], end, members, weights, fetched),
                    daemon=True,
                )
            )
        for thread in threads:
            thread.start()
        if my_part is not None:
            own_reducer = self._reducer
            assert own_reducer is not None
            own_reducer.finish()
            outcome = report.parts[my_part]
            assert own_reducer.header is not None and own_reducer.result is not None
            outcome.contributors = list(own_reducer.header["contributors"])
            outcome.dropped = {p: why for p, why in own_reducer.header["dropped"]}
            outcome.weight = own_reducer.header["weight"]
            a, b = spans[my_part]
            if own_reducer.header["weight"] > 0 and outcome.contributors != [me]:
                result[a:b] = own_reducer.result
                everyone = {p for p, _ in members}
                outcome.status = "all" if set(outcome.contributors) == everyone else "some"
        for thread in threads:
            thread.join(max(end - time.time(), 0) + 2.0)
        for i, values in fetched.items():
            a, b = spans[i]
            result[a:b] = values
        if my_part is not None:
            assert self._reducer is not None
            self._reducer.wait_fetched(self.stall_timeout)
        report.result = result
        statuses = [part.status for part in report.parts]
        if all(s == "all" for s in statuses):
            report.outcome = "averaged"
        elif any(s != "none" for s in statuses):
            report.outcome = "partial"
        else:
            report.outcome = "failed"

    def _upload(
        self,
        part: int,
        reducer: str,
        address: str | None,
        span: tuple[int, int],
        cutoff: float,
        probe: bool = False,
    ) -> None:
        """Send our chunks of `part` (9, `{m}.chunk`): busy or not_found are sent again after
        20 ms, doubling up to 0.5 s; the weight and epoch as declared."""
        report = self.report
        a, b = span
        n = b - a
        chunk_elems = self.chunk_bytes // 4
        count = -(-n // chunk_elems) if n else 0
        if part in self.abort_parts and count:
            withdrawal: dict[str, Any] = {
                "round": report.round,
                "group": self._group_id,
                "part": part,
                "chunk": 0,
                "epoch": self._decl["epoch"],
                "weight": self._decl["weight"],
                "abort": "nonfinite",
            }
            report.repeat_answers[f"abort part {part}"] = self._answer(
                reducer, address, withdrawal, b"", cutoff
            )
            return
        for c in range(count):
            piece = self.values[a + c * chunk_elems : a + min((c + 1) * chunk_elems, n)]
            body: dict[str, Any] = {
                "round": report.round,
                "group": self._group_id,
                "part": part,
                "chunk": c,
                "epoch": self._decl["epoch"],
                "weight": self._decl["weight"],
            }
            if self.codec == "none" and not (self.none_blobs and c % 2 == 1):
                body["raw"] = True
                payload = piece.astype("<f4").tobytes()
            else:
                payload = encode_chunk(
                    self.codec, self.bounds, piece, a + c * chunk_elems, self.block_size
                )
            backoff, retried = 0.02, False
            while True:
                try:
                    conn = self._conn_to(reducer, address)
                    conn.call(
                        f"{self.m}.chunk", body, payload, timeout=max(cutoff - time.time(), 0.05)
                    )
                    break
                except RemoteError as exc:
                    if exc.code in ("busy", "not_found") and time.time() + backoff < cutoff:
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 0.5)
                        continue
                    report.observations.append(f"chunk {c} of part {part} refused: {exc}")
                    return
                except (OSError, ConnectionClosed) as exc:
                    if retried or time.time() >= cutoff:
                        report.observations.append(f"upload of part {part} broke: {exc!r}")
                        return
                    retried = True
                    body["retry"] = True
                    continue
                except (TimeoutError, CleanroomError) as exc:
                    report.observations.append(f"upload of part {part} failed: {exc!r}")
                    return
            if probe and c == 0:
                again = {**body, "retry": True}
                report.repeat_answers["chunk 0 again with retry"] = self._answer(
                    reducer, address, again, payload, cutoff
                )
            if probe and c == count - 1:
                first = self.values[a : a + min(chunk_elems, n)]
                again = {**body, "chunk": 0}
                again.pop("retry", None)
                if self.codec == "none":
                    again["raw"] = True
                    payload = first.astype("<f4").tobytes()
                else:
                    again.pop("raw", None)
                    payload = encode_chunk(self.codec, self.bounds, first, a, self.block_size)
                report.repeat_answers["chunk 0 again once complete"] = self._answer(
                    reducer, address, again, payload, cutoff
                )
                self._probed.set()

    def _answer(
        self, reducer: str, address: str | None, body: dict[str, Any], payload: bytes, cutoff: float
    ) -> str:
        """One chunk call: "ok" or "code: message"."""
        try:
            conn = self._conn_to(reducer, address)
            conn.call(f"{self.m}.chunk", body, payload, timeout=max(cutoff - time.time(), 0.05))
        except RemoteError as exc:
            return f"{exc.code}: {exc.msg}"
        except (OSError, CleanroomError, TimeoutError) as exc:
            return repr(exc)
        return "ok"

    def _conn_to(self, peer: str, address: str | None) -> MuxConnection:
        conn = self.pool.has_usable(b58decode(peer))
        if conn is not None:
            return conn
        if address is None:
            raise ConnectionClosed(f"client {peer} has no open connection to us")
        return self.pool.get(address)

    def _download(
        self,
        part: int,
        reducer: str,
        address: str | None,
        span: tuple[int, int],
        end: float,
        members: list[tuple[str, dict[str, Any]]],
        weights: dict[str, float | None],
        fetched: dict[int, np.ndarray],
    ) -> None:
        """Fetch part `part`'s result and check its header (9.6)."""
        outcome = self.report.parts[part]
        me = self.identity.peer_id_text
        a, b = span
        n = b - a
        chunk_elems = self.chunk_bytes // 4
        count = -(-n // chunk_elems) if n else 0
        member_ids = [p for p, _ in members]
        if part == self._probed_part:
            self._probed.wait(max(end - time.time(), 0.0))
        for attempt in range(2):
            try:
                conn = self._conn_to(reducer, address)
                items = conn.stream(
                    f"{self.m}.result",
                    {"round": self.report.round, "group": self._group_id, "part": part},
                    timeout=max(end - time.time(), 0.05),
                )
                header_body, header_payload = next(items)
                self.result_items_seen.append((part, dict(header_body), len(header_payload)))
                problem = self._check_result_header(header_body, member_ids, weights, count)
                if header_payload:
                    problem = problem or "the result header carries a payload"
                if problem:
                    outcome.note = f"garbage result header: {problem}"
                    outcome.dropped[reducer] = "garbage"
                    self.report.observations.append(f"part {part}: {problem}: {header_body!r}")
                    return
                outcome.contributors = list(header_body["contributors"])
                outcome.dropped.update({p: why for p, why in header_body["dropped"]})
                outcome.weight = header_body["weight"]
                pieces = []
                for expected_index, (body, payload) in zip(
                    range(header_body["chunks"]), items, strict=False
                ):
                    length = min(chunk_elems, n - expected_index * chunk_elems)
                    self.result_items_seen.append((part, dict(body), len(payload)))
                    if body.get("chunk") != expected_index or set(body) - {"chunk", "raw"}:
                        raise CleanroomError(
                            f"result item {body!r}, expected chunk {expected_index}"
                        )
                    if body.get("raw"):
                        self.report.raw_result_items += 1
                        if self.codec != "none" or len(payload) != 4 * length:
                            raise CleanroomError("raw result item under another codec or size")
                        values = np.frombuffer(payload, "<f4").astype(np.float32)
                    else:
                        self.report.blob_result_items += 1
                        start = a + expected_index * chunk_elems
                        try:
                            values = decode_chunk(
                                self.codec, self.bounds, payload, start, length, self.block_size
                            )
                        except BlobError as exc:
                            raise CleanroomError(f"result item: {exc}") from None
                    if not np.all(np.isfinite(values)):
                        raise CleanroomError("non-finite result")
                    pieces.append(values)
                rest = list(items)  # the `end`
                if rest:
                    raise CleanroomError(f"{len(rest)} result items beyond `chunks`")
                if (
                    header_body["weight"] > 0
                    and len(pieces) == count
                    and outcome.contributors != [me]
                ):
                    fetched[part] = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
                    everyone = set(member_ids)
                    outcome.status = "all" if set(outcome.contributors) == everyone else "some"
                else:
                    outcome.note = header_body.get("note", "no result")
                return
            except (OSError, ConnectionClosed) as exc:
                if attempt == 0 and time.time() < end:
                    continue
                outcome.note = f"download broke: {exc!r}"
                outcome.dropped[reducer] = "dead"
            except (RemoteError, TimeoutError, CleanroomError, BlobError, StopIteration) as exc:
                outcome.note = f"download failed: {exc!r}"
                outcome.dropped[reducer] = "timeout"
                return

    def _check_result_header(
        self,
        header: dict[str, Any],
        member_ids: list[str],
        weights: dict[str, float | None],
        count: int,
    ) -> str | None:
        """9.6 "What a member checks"; returns the problem or None."""
        if not {"contributors", "dropped", "weight", "chunks"} <= set(header) or set(header) - {
            "contributors",
            "dropped",
            "weight",
            "chunks",
            "note",
        }:
            return f"keys {sorted(header)}"
        contributors, dropped = list(header["contributors"]), [tuple(x) for x in header["dropped"]]
        weight, chunks = header["weight"], header["chunks"]
        listed = contributors + [p for p, _ in dropped]
        if any(p not in member_ids for p in listed):
            return "a listed PeerID is not a member"
        if len(set(listed)) != len(listed):
            return "a PeerID listed twice"
        if any(weights[p] is None for p in contributors):
            return "a stale contributor"
        if any(why not in DROP_REASONS for _, why in dropped):
            return "an unknown drop reason"
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            return "weight"
        if chunks not in (0, count):
            return f"chunks {chunks}, part has {count}"
        if weight > 0:
            if not contributors:
                return "weight without contributors"
            exact = math.fsum(weights[p] for p in contributors)  # type: ignore[misc]
            if weight != exact:
                return f"weight {weight!r} is not the fsum of the effective weights {exact!r}"
            if chunks != count:
                return "chunks"
        elif chunks != 0:
            return "chunks with weight 0"
        return None

    def _saw_us(self, value: object) -> bool:
        """9.2: a done marker that keeps a declaration and lists our step tag in `saw`."""
        if not isinstance(value, dict) or value.get("done") is not True or "closed" not in value:
            return False
        saw = value.get("saw")
        if not isinstance(saw, list) or len(saw) > 1024:
            return False
        if not all(_is_int(t) and 0 < t < 2**32 for t in saw):
            return False  # 9.2: anything but tags in the list: the marker keeps nothing
        return self._decl.get("step") in saw

    def _finish_step(self, key: str, ttl: float) -> None:
        """9.2: replace our declaration with a done marker, keeping what our read grouped;
        leave the round."""
        with contextlib.suppress(OSError, CleanroomError, TimeoutError):
            marker: dict[str, Any] = {"done": True, "layout": self.layout}
            if self._saw is not None:
                keys = ("address", "weight", "epoch", "bandwidth", "layout", "count")
                marker["closed"] = {k: self._decl[k] for k in (*keys, "client_mode")}
                marker["saw"] = self._saw
            self._store(key, marker, ttl)
        with self._state_lock:
            self._round = None
            self._state_lock.notify_all()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.pool.close()

    def failures(self) -> list[str]:
        """Protocol violations and handler errors seen on any connection."""
        found: list[str] = []
        for conn in self.pool.all:
            found += conn.violations
            found += [repr(exc) for exc in conn.handler_failures]
        if self.listener is not None:
            found += [repr(exc) for exc in self.listener.failures if not isinstance(exc, OSError)]
        return found
