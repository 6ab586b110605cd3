"""A clean-room averaging member (docs/protocol.md section 9 alone) averages with real peers.

`cleanroom_averager` imports nothing from `protocol/`, `peer/` or `training/`. Here it meets
a real `swarm bootstrap` and library peers in subprocesses that use only the public API
(`peer.run_in_background`, `training.Averager`, `step_blocking`), over loopback TCP. If
these fail while the project's own tests pass, the docs and the code disagree.

Readings of the spec these tests pin (where protocol.md is silent or ambiguous, the library
was found to do this): an empty part's result header lists every sender as a contributor
(full weight, `chunks` 0); a stale reducer may list itself as `stale` in `dropped`; a
non-leader that gets a join naming its own leader in `skipped` must first learn whether that
leader is gone (answering `not_leader` at once sends the caller back to the ghost); a
full member must serve `avg.*` requests on connections it opened (the library calls over
any connection it has with us, a DHT client connection included).

Every blocking wait is bounded (socket timeouts, deadlines, `select` on the children's
output); every subprocess is killed at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cleanroom_averager import (
    CleanroomAverager,
    ConnectionPool,
    MuxConnection,
    StepReport,
    chunk_payload_size,
    chunk_pieces,
    codec_text,
    compute_spans,
    decode_blob,
    encode_blob,
    grid_sides,
    group_tag,
    layout_fingerprint,
    make_groups,
    method_prefix,
    parse_declaration,
    rank_key,
    seeds,
)
from cleanroom_client import Connection, DHTClient, Identity, RemoteError, unpack_value
from tests_support_paths import bootstrap_process, env_with_root

# Shorter than the library's default (2 s) to keep the file quick: every peer, ours
# included, is given it (9.2: "peers meet only with the same prefix and gather_window").
GATHER_WINDOW = 1.0
JOIN_TIMEOUT = 1.0  # the library's default
DECLARATION_TTL = 3 * GATHER_WINDOW + JOIN_TIMEOUT + 30  # 9.2
STEP_TIMEOUT = 20.0
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024

# A library peer: prints {"peer_id", "address"}, then for each command line read on stdin
# makes an Averager and runs one step at each of the command's `starts`, printing each
# step's AveragingInfo as JSON (its tensor goes to the command's `out`, formatted with the
# step's index).
LIBRARY_PEER = r"""
import json, sys, time
import numpy as np
import torch
import peer
from training import Averager, AveragerConfig

INFO = ("outcome", "group", "leader", "round", "averaged", "averaged_fraction",
        "received_fraction", "dropped", "stale", "epoch", "total", "note")
PART = ("index", "reducer", "span", "status", "contributors", "dropped", "received",
        "weight", "note")

def plain(value):
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return str(value)

torch.set_num_threads(1)
with peer.run_in_background(listen="127.0.0.1:0", initial_peers=[sys.argv[1]]) as node:
    print(json.dumps({"peer_id": str(node.peer_id), "address": str(node.address)}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        values = np.random.default_rng(cmd["seed"]).standard_normal(cmd["total"])
        flat = values.astype(np.float32)
        bounds = np.cumsum(cmd.get("sizes") or [cmd["total"]])[:-1]
        tensors = [torch.from_numpy(piece.copy()) for piece in np.split(flat, bounds)]
        config = AveragerConfig(chunk_bytes=cmd["chunk_bytes"], bandwidth=cmd["bandwidth"],
                                group_size=cmd["group_size"],
                                gather_window=cmd["gather_window"])
        averager = Averager(node, cmd["prefix"], tensors, codec=cmd["codec"], config=config)
        for i, start in enumerate(cmd["starts"]):
            time.sleep(max(start - time.time(), 0.0))
            began = time.time()
            info = averager.step_blocking(weight=cmd["weight"], epoch=cmd["epoch"],
                                          timeout=cmd["timeout"])
            ended = time.time()
            np.save(cmd["out"].format(i), np.concatenate([t.numpy() for t in tensors]))
            report = {name: plain(getattr(info, name, None)) for name in INFO}
            report["parts"] = [{name: plain(getattr(p, name, None)) for name in PART}
                               for p in info.parts]
            report["text"] = str(info)
            report["began"], report["ended"], report["asked_start"] = began, ended, start
            print(json.dumps(report), flush=True)
"""


def values_for(seed: int, total: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(total).astype(np.float32)


# ---------------------------------------------------------------- offline: the spec's examples


def test_fingerprint_and_int8_blob_reproduce_the_worked_examples() -> None:
    """9.3's fingerprint and 9.1's int8 blob, byte for byte."""
    text = codec_text("none")
    assert text == "NoneCodec(max_elements=268435456)|2097152|group_size=16|v9|S=2|decay=0.5"
    assert layout_fingerprint([(3, 4), (5,)], ["float32", "float16"], text) == "e57772a6944b8ac8"
    blob = encode_blob("int8", np.array([1, -2, 0.5], np.float32), block_size=2)
    assert blob.hex() == ("5343020101010000030000000000000002000000000000000402813c0402813b40817f")
    assert decode_blob(blob, "int8").tolist() == pytest.approx([64 * 2 / 127, -2, 0.5], rel=1e-6)
    assert method_prefix("run1/grads").startswith("avg.") and len(method_prefix("x")) == 20


def test_grid_and_singletons_follow_the_examples_of_9_4() -> None:
    assert grid_sides(8, 4) == (4, 2)
    assert grid_sides(7, 4) == (3, 3)
    assert grid_sides(2, 16) == (2,)
    # 10 peers at group size 3 (averaging.md): groups of 3, 3, 2, 2 when the free axis is
    # a full side
    ids = [Identity.generate().peer_id_text for _ in range(10)]
    decls = {p: {"client_mode": False, "count": 0} for p in ids}
    sizes = sorted(len(g) for g in make_groups("x", decls, 3))
    assert sizes == [2, 2, 3, 3]


# ---------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    with bootstrap_process(wait=30.0) as address:
        yield address


class LibraryPeer:
    """A library averaging peer in its own process (public API only)."""

    def __init__(self, bootstrap: str, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LIBRARY_PEER, bootstrap],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env_with_root(),
        )
        self.peer_id = ""
        self.address = ""
        self._pending = b""  # bytes read past the last line returned

    def started(self, timeout: float) -> None:
        hello = self.read(timeout)
        self.peer_id, self.address = hello["peer_id"], hello["address"]

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        """The next line of JSON it prints, within `timeout` (unbuffered reads: a buffered
        readline could swallow a second line that select() then never reports)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0.0))
            data = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not data:
                self.proc.kill()
                pytest.fail(f"library peer said nothing in {timeout} s:\n{self.stderr_tail()}")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        result: dict[str, Any] = json.loads(line)
        return result

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()[-4000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


@pytest.fixture(scope="module")
def library(
    bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LibraryPeer]]:
    """Two library peers, started at once (their imports overlap), killed at the end."""
    folder = tmp_path_factory.mktemp("library")
    peers = [LibraryPeer(bootstrap, folder / f"peer{i}.stderr") for i in range(2)]
    try:
        for peer in peers:
            peer.started(60.0)
        yield peers
    finally:
        for peer in peers:
            peer.kill()


# ---------------------------------------------------------------- one round


@dataclass
class Member:
    weight: float
    epoch: int
    bandwidth: float = 1.0
    seed: int = 0


@dataclass
class Round:
    report: StepReport
    cleanroom: CleanroomAverager
    library: list[dict[str, Any]]
    results: dict[str, np.ndarray]  # base58 PeerID -> final vector
    expected: np.ndarray
    largest: float
    library_ids: list[str]


def pick_identity(round_seed: bytes, others: list[str], lead: bool) -> Identity:
    """9.4 step 9: the leader is the first non-client in rank-key order under round_seed;
    draw identities until ours ranks first (lead) or not."""
    best_other = min(rank_key(round_seed, p) for p in others)
    for _ in range(10_000):
        identity = Identity.generate()
        ours = rank_key(round_seed, identity.peer_id_text)
        if (ours < best_other) == lead:
            return identity
    raise AssertionError("no identity found")


def safe_start(window: float = GATHER_WINDOW, lead: float = 0.5) -> float:
    """A start time just after a slot boundary, so that every peer takes the round that
    closes next (9.2: at least window/2 away) even if some start a little late."""
    earliest = time.time() + lead
    slot = math.ceil((earliest - 0.05) / window)
    return slot * window + 0.08


def store_declaration(
    bootstrap: str, prefix: str, round_number: int, owner: Identity, declaration: dict[str, Any]
) -> None:
    """Store a declaration as `owner` (a ghost, a stranger) under the round's key."""
    key = f"{prefix}/round/{round_number}"
    with Connection.open(bootstrap, owner, timeout=5.0) as connection:
        assert DHTClient(connection).store(
            key, declaration, ttl=40.0, subkey=owner.peer_id_text, signer=owner
        )


def ghost_declaration(layout: str, total: int) -> dict[str, Any]:
    """A declaration whose address nobody listens at (a crashed peer, averaging.md)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        "address": f"127.0.0.1:{port}",
        "weight": 1.0,
        "epoch": 0,
        "bandwidth": 1.0,
        "client_mode": False,
        "layout": layout,
        "count": 0,
        "total": total,
        "group_size": 16,
        "detail": "a ghost",
    }


def run_round(
    bootstrap: str,
    peers: list[LibraryPeer],
    tmp_path: Path,
    *,
    codec: str,
    total: int,
    mine: Member,
    theirs: list[Member],
    lead: bool | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    client_mode: bool = False,
    group_size: int = 16,
    identity: Identity | None = None,
    prefix: str | None = None,
    my_delay: float = 0.0,
    their_delays: list[float] | None = None,
    before: Callable[[str, int, str], None] | None = None,
    on_confirmed: Callable[[CleanroomAverager, dict[str, Any]], None] | None = None,
    count: int = 0,
    declare: bool = True,
    abort_parts: frozenset[int] = frozenset(),
    probe_repeats: bool = False,
    dht_everywhere: bool = True,
    sizes: list[int] | None = None,
) -> Round:
    """One round: the clean-room member and `len(theirs)` library peers step together
    (each `delay` seconds after a safe start). `before(prefix, round, layout)` runs first
    (to store ghosts). `sizes`: the vector as tensors of these sizes (one by default)."""
    prefix = prefix or f"cleanroom/averaging/{uuid.uuid4().hex}"
    used = peers[: len(theirs)]
    library_ids = [peer.peer_id for peer in used]
    if identity is None:
        # every Averager is fresh: count 0, phase 0; n <= 16 full peers: d = 1
        _, round_seed = seeds(prefix, 0, 1)
        identity = pick_identity(round_seed, library_ids, bool(lead))
    start_at = safe_start()
    round_number = math.floor(start_at / GATHER_WINDOW) + 1
    values = values_for(mine.seed, total)
    cleanroom = CleanroomAverager(
        identity,
        bootstrap,
        prefix,
        values,
        codec=codec,
        chunk_bytes=chunk_bytes,
        bandwidth=mine.bandwidth,
        client_mode=client_mode,
        gather_window=GATHER_WINDOW,
        group_size=group_size,
        on_confirmed=on_confirmed,
        declare=declare,
        abort_parts=abort_parts,
        probe_repeats=probe_repeats,
        dht_everywhere=dht_everywhere,
        shapes=None if sizes is None else [(size,) for size in sizes],
    )
    try:
        if before is not None:
            before(prefix, round_number, cleanroom.layout)
        delays = their_delays or [0.0] * len(theirs)
        for i, (peer, member) in enumerate(zip(used, theirs, strict=True)):
            peer.send(
                {
                    "prefix": prefix,
                    "codec": codec,
                    "total": total,
                    "sizes": sizes,
                    "seed": member.seed,
                    "chunk_bytes": chunk_bytes,
                    "bandwidth": member.bandwidth,
                    "group_size": group_size,
                    "gather_window": GATHER_WINDOW,
                    "weight": member.weight,
                    "epoch": member.epoch,
                    "timeout": STEP_TIMEOUT,
                    "starts": [start_at + delays[i]],
                    "out": str(tmp_path / f"library{i}-{{}}.npy"),
                }
            )
        time.sleep(max(start_at + my_delay - time.time(), 0.0))
        report = cleanroom.step(
            weight=mine.weight, epoch=mine.epoch, timeout=STEP_TIMEOUT, count=count
        )
        library = [peer.read(STEP_TIMEOUT + 15.0) for peer in used]
    finally:
        cleanroom.close()
    results = {peer.peer_id: np.load(tmp_path / f"library{i}-0.npy") for i, peer in enumerate(used)}
    if report.result is not None:
        results[identity.peer_id_text] = report.result

    everyone = [mine, *theirs]
    newest = max(m.epoch for m in everyone)
    inputs = [values_for(m.seed, total).astype(np.float64) for m in everyone]
    effective = [m.weight * 0.5 ** (newest - m.epoch) for m in everyone]
    expected = np.zeros(total)
    for w, v in zip(effective, inputs, strict=True):
        expected += w * v
    expected /= math.fsum(effective)
    largest = max(float(np.max(np.abs(v))) for v in inputs)
    return Round(report, cleanroom, library, results, expected, largest, library_ids)


def joins_to(done: Round) -> list[tuple[str, dict[str, Any], float | None, int, bytes]]:
    return [seen for seen in done.cleanroom.requests_seen if seen[0] == ".join"]


def assert_averaged(done: Round, codec: str) -> None:
    me = done.cleanroom.identity.peer_id_text
    report = done.report
    context = (
        f"clean-room report: {report.outcome} {report.note} {report.observations}\n"
        + "\n".join(
            f"{info['text']} | {info['note']} | began {info['began'] - info['asked_start']:.3f} s"
            f" late, ran {info['ended'] - info['began']:.3f} s"
            for info in done.library
        )
        + f"\njoins to us, skipped: {[b.get('skipped') for m, b, *_ in joins_to(done)]}"
        + f"\nround {report.round}, read {report.read_at - report.round * GATHER_WINDOW:+.3f} s"
        + f" after the close; declarations read: {sorted(report.declarations)}"
    )
    assert not done.cleanroom.failures(), done.cleanroom.failures()
    for info in done.library:
        assert info["outcome"] == "averaged", context
        assert me in info["group"], context
        assert sorted(info["group"]) == sorted([me, *done.library_ids]), context
        assert all(part["status"] == "all" for part in info["parts"]), context
    assert report.outcome == "averaged", context
    assert sorted(report.group) == sorted([me, *done.library_ids]), context
    # the weighted mean, within the codec's error (averaging.md, "Errors are measured
    # against the largest magnitude"; 9.1: int8 within two quantizations of 1/254)
    # float16: two roundings of at most 2**-11 of the magnitude (averaging.md, Codecs)
    bound = {"none": 1e-6, "int8": 2 / 254 * (1 + 1e-5) + 1e-6, "float16": 2 * 2**-11 + 1e-6}[codec]
    for peer, result in done.results.items():
        error = float(np.max(np.abs(result.astype(np.float64) - done.expected)))
        assert error <= bound * done.largest, (peer, error, bound * done.largest)
    # guarantee 3: every member holds the same values (one encoding of each part's mean)
    arrays = list(done.results.values())
    for other in arrays[1:]:
        assert np.array_equal(arrays[0], other)


def assert_reduced_by_cleanroom(done: Round) -> None:
    """We reduced a part: every library peer sent us chunks and fetched our result."""
    me = done.cleanroom.identity.peer_id_text
    confirmation = done.report.confirmation
    assert confirmation is not None
    reducers = [p for p, d in confirmation["members"] if not d.get("client_mode", False)]
    index = reducers.index(me)
    start, stop = confirmation["spans"][index]
    assert stop > start, confirmation["spans"]
    assert set(done.report.chunks_from) == set(done.library_ids)
    assert sorted(done.report.fetched_by) == sorted(done.library_ids)
    for info in done.library:
        part = info["parts"][index]
        assert part["reducer"] == me and part["status"] == "all"
        assert sorted(part["contributors"]) == sorted([me, *done.library_ids])


# ---------------------------------------------------------------- the rounds


@pytest.mark.slow
def test_cleanroom_leads_one_library_peer_codec_none(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=10_000,
        lead=True,
        mine=Member(weight=3.0, epoch=5, seed=1),
        theirs=[Member(weight=1.0, epoch=5, seed=2)],
        chunk_bytes=4096,  # 1024 elements a chunk: several chunks per part, raw and blobs
        dht_everywhere=False,  # the library peer has no connection to us: it must dial
    )
    assert done.report.led
    assert_averaged(done, "none")
    assert_reduced_by_cleanroom(done)
    # it dialled the address we declared (and the handshake proved our PeerID, 9.2)
    assert (".join", True) in done.cleanroom.inbound_requests
    assert done.library[0]["leader"] == done.cleanroom.identity.peer_id_text
    # 9.2: the library's declaration lived 3 x gather_window + join_timeout + 30 s from its
    # store (made between the start and the close), and it is now a done marker naming its
    # layout, with the same TTL from when the round was decided
    theirs = done.library_ids[0]
    close = done.report.round * GATHER_WINDOW
    declared_until = done.report.expirations[theirs]
    ttl = DECLARATION_TTL
    assert close - GATHER_WINDOW + ttl - 0.5 <= declared_until <= close + ttl + 0.5
    key = f"{done.cleanroom.prefix}/round/{done.report.round}"
    with Connection.open(bootstrap, Identity.generate(), timeout=5.0) as connection:
        entries, _, _ = DHTClient(connection).find_value_page(key)
        now = time.time()
    assert entries is not None
    marker = next(e for e in entries if e["s"] == theirs)
    value = unpack_value(marker["v"])
    # 9.2: the marker keeps the declaration its read grouped, and the step tags it saw:
    # ours among them
    kept = parse_declaration(theirs, value.pop("closed"))
    assert kept is not None and kept["layout"] == done.cleanroom.layout
    ours = done.report.declarations[done.cleanroom.identity.peer_id_text]
    assert value.pop("saw") == [ours["step"]]
    assert value == {"done": True, "layout": done.cleanroom.layout}
    assert close + ttl - 0.5 <= marker["x"] <= now + ttl + 0.5
    assert done.report.raw_result_items > 0  # 9: a reducer under `none` sends raw items


def answer_code(
    conn: MuxConnection,
    method: str,
    body: dict[str, Any],
    payload: bytes = b"",
    stream: bool = False,
) -> str:
    """ "ok" or the error code the callee answers (a stream: its first item)."""
    try:
        if stream:
            next(iter(conn.stream(method, body, timeout=3.0, payload=payload)))
        else:
            conn.call(method, body, payload, timeout=3.0)
    except RemoteError as exc:
        return exc.code
    except TimeoutError:
        return "no answer within 3 s"
    return "ok"


# What sections 9, 9.5 and 4.3 say the callee answers (our round is confirmed by then).
EXPECTED_PROBES = {
    "ping {}": "ok",
    "ping {round}": "ok",
    "ping another round": "not_found",
    "ping round nil": "bad_request",
    "ping {round} + another key": "ok",  # "a ping ignores keys other than round and group"
    "ping {round, group}": "ok",
    "ping another group": "not_found",  # 9, "Group tags"
    "ping group 0": "bad_request",
    "ping group without round": "bad_request",
    "result with a t key": "bad_request",
    "result for a part it does not reduce": "bad_request",
    "result for another round": "not_found",
    "result for another group": "not_found",
    "result without group": "bad_request",
    "result with a payload": "bad_request",
    "join with an empty skipped": "bad_request",
    "join whose decl has an 11th key": "bad_request",
    "join with a t key": "bad_request",
    "join with a payload": "bad_request",
    "an unknown avg method": "unknown_method",
    "stranger: chunk": "bad_request",  # not a sender of that part
    "stranger: result": "bad_request",  # "from a peer outside the group"
}


def probe_library_leader(
    found: dict[str, str],
) -> Callable[[CleanroomAverager, dict[str, Any]], None]:
    def probe(averager: CleanroomAverager, confirmation: dict[str, Any]) -> None:
        r, m = averager.report.round, averager.m
        # the tag the group's messages name: 9's digest of the confirmation, not the draw
        g = group_tag(r, confirmation["group"], confirmation["members"], confirmation["spans"])
        other_g = bytes(b ^ 1 for b in g)  # another valid tag
        members = confirmation["members"]
        leader, leader_decl = (
            members[0] if members[0][0] != averager.identity.peer_id_text else members[1]
        )
        reducers = [p for p, _ in members]
        theirs, ours = reducers.index(leader), reducers.index(averager.identity.peer_id_text)
        conn = averager.pool.get(leader_decl["address"])
        decl = averager._decl
        cases: dict[str, tuple[str, dict[str, Any], bytes, bool]] = {
            "ping {}": ("ping", {}, b"", False),
            "ping {round}": ("ping", {"round": r}, b"", False),
            "ping another round": ("ping", {"round": r + 1}, b"", False),
            "ping round nil": ("ping", {"round": None}, b"", False),
            "ping {round} + another key": ("ping", {"round": r, "x": 1}, b"", False),
            "ping {round, group}": ("ping", {"round": r, "group": g}, b"", False),
            "ping another group": ("ping", {"round": r, "group": other_g}, b"", False),
            "ping group 0": ("ping", {"round": r, "group": 0}, b"", False),
            "ping group without round": ("ping", {"group": g}, b"", False),
            "result with a t key": (
                "result",
                {"round": r, "group": g, "part": theirs, "t": "x"},
                b"",
                True,
            ),
            "result for a part it does not reduce": (
                "result",
                {"round": r, "group": g, "part": ours},
                b"",
                True,
            ),
            "result for another round": (
                "result",
                {"round": r + 1, "group": g, "part": theirs},
                b"",
                True,
            ),
            "result for another group": (
                "result",
                {"round": r, "group": other_g, "part": theirs},
                b"",
                True,
            ),
            "result without group": ("result", {"round": r, "part": theirs}, b"", True),
            "result with a payload": (
                "result",
                {"round": r, "group": g, "part": theirs},
                b"x",
                True,
            ),
            "join with an empty skipped": (
                "join",
                {"round": r, "decl": decl, "skipped": []},
                b"",
                False,
            ),
            "join whose decl has an 11th key": (
                "join",
                {"round": r, "decl": {**decl, "x": 1}},
                b"",
                False,
            ),
            "join with a t key": ("join", {"round": r, "decl": decl, "t": "x"}, b"", False),
            "join with a payload": ("join", {"round": r, "decl": decl}, b"x", False),
            "an unknown avg method": ("nothing", {}, b"", False),
        }
        for name, (method, body, payload, stream) in cases.items():
            found[name] = answer_code(conn, f"{m}.{method}", body, payload, stream)
        stranger = ConnectionPool(Identity.generate(), lambda incoming: None)
        try:
            other = stranger.get(leader_decl["address"])
            chunk = {
                **{"round": r, "group": g, "part": theirs, "chunk": 0},
                **{"epoch": 0, "weight": 1.0, "raw": True},
            }
            found["stranger: chunk"] = answer_code(other, f"{m}.chunk", chunk, b"\0" * 16)
            found["stranger: result"] = answer_code(
                other, f"{m}.result", {"round": r, "group": g, "part": theirs}, stream=True
            )
        finally:
            stranger.close()

    return probe


@pytest.mark.slow
def test_cleanroom_joins_a_library_leader_codec_none(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """Also probes the library leader's refusals once the group is confirmed."""
    found: dict[str, str] = {}
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=10_000,
        lead=False,
        mine=Member(weight=1.0, epoch=5, seed=3),
        theirs=[Member(weight=2.5, epoch=5, seed=4)],
        chunk_bytes=4096,
        on_confirmed=probe_library_leader(found),
    )
    assert not done.report.led
    assert done.report.leader == done.library_ids[0]
    assert_averaged(done, "none")
    assert_reduced_by_cleanroom(done)
    assert found == EXPECTED_PROBES


@pytest.mark.slow
def test_cleanroom_joins_two_library_peers_codec_int8_with_staleness_and_bandwidths(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """A library leader; unequal declared bandwidths (one clipped to 4x the lower median)
    and epochs one apart (decay 0.5); 50,000 elements, so spans fall on 4096-element units."""
    theirs = [
        Member(weight=1.0, epoch=7, bandwidth=2.0, seed=6),
        Member(weight=2.0, epoch=6, bandwidth=30.0, seed=7),
    ]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="int8",
        total=50_000,
        lead=False,
        mine=Member(weight=1.5, epoch=7, bandwidth=1.0, seed=5),
        theirs=theirs,
        chunk_bytes=16384,
    )
    assert not done.report.led
    assert_averaged(done, "int8")
    assert_reduced_by_cleanroom(done)
    confirmation = done.report.confirmation
    assert confirmation is not None
    bandwidths = [float(d["bandwidth"]) for _, d in confirmation["members"]]
    # 9.5 "Spans": the library leader's spans follow the formula
    assert [tuple(s) for s in confirmation["spans"]] == compute_spans(bandwidths, 50_000)
    assert done.report.blob_result_items > 0


@pytest.mark.slow
def test_cleanroom_leads_two_library_peers_codec_int8(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    theirs = [Member(weight=1.0, epoch=3, seed=9), Member(weight=4.0, epoch=3, seed=10)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="int8",
        total=12_345,
        lead=True,
        mine=Member(weight=2.0, epoch=3, seed=8),
        theirs=theirs,
        chunk_bytes=4096,
    )
    assert done.report.led
    assert_averaged(done, "int8")
    assert_reduced_by_cleanroom(done)
    for info in done.library:
        assert info["leader"] == done.cleanroom.identity.peer_id_text


@pytest.mark.slow
@pytest.mark.parametrize("lead", [True, False])
def test_cleanroom_and_library_peers_send_int8_chunks_over_tensors_as_a_blob_per_tensor(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path, lead: bool
) -> None:
    """9.1, "Chunks that span tensors" (v7): the vector is seven tensors (one empty), chunks
    of 1024 elements span several of them, and parts cut through them. A payload of another
    size is garbage, so a round averaged over everyone means both sides cut the same
    pieces; the library reducer's result items are checked against the spec's sizes."""
    sizes = [10, 5000, 7, 0, 3000, 33, 1]
    theirs = [Member(weight=1.0, epoch=3, seed=31), Member(weight=2.0, epoch=3, seed=32)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="int8",
        total=sum(sizes),
        lead=lead,
        mine=Member(weight=1.5, epoch=3, seed=30),
        theirs=theirs,
        chunk_bytes=4096,
        sizes=sizes,
    )
    assert done.report.led is lead
    assert_averaged(done, "int8")
    assert_reduced_by_cleanroom(done)
    confirmation = done.report.confirmation
    assert confirmation is not None
    bounds = list(itertools.accumulate(sizes))[:-1]
    spans = confirmation["spans"]
    split = 0
    for part, body, size in done.cleanroom.result_items_seen:
        if "chunk" not in body:
            continue  # a result header
        start = spans[part][0] + body["chunk"] * 1024
        stop = min(start + 1024, spans[part][1])
        assert size == chunk_payload_size("int8", bounds, start, stop, 4096), (part, body)
        split += len(chunk_pieces("int8", bounds, start, stop)) > 1
    assert split > 0  # some result items spanned tensors


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "float16"])
def test_cleanroom_in_client_mode_with_two_library_peers(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path, codec: str
) -> None:
    """Client mode (9.2: address nil): we send and download only, over our own dials."""
    theirs = [Member(weight=1.0, epoch=1, seed=12), Member(weight=1.0, epoch=1, seed=13)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec=codec,
        total=10_000,
        lead=False,
        mine=Member(weight=2.0, epoch=1, seed=11),
        theirs=theirs,
        client_mode=True,
    )
    assert_averaged(done, codec)
    confirmation = done.report.confirmation
    assert confirmation is not None
    assert len(confirmation["spans"]) == 2  # clients reduce nothing
    assert not done.report.chunks_from


# ---------------------------------------------------------------- 9.4 with group_size 2


@pytest.mark.slow
def test_group_size_two_three_peers_grid_and_odd_one_rotation(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """n = 3 at g = 2: d = 2, a 2 x 2 grid with one line short; phase 0 frees axis 0, so
    ranks 0 and 1 pair up and rank 2 is the odd one; step 7 trades rank `phase mod n` = 0
    with it. We take rank 2 (the largest rank key under block_seed): paired with rank 1,
    rank 0 alone (9.4 steps 3, 5, 7)."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    ids = [peer.peer_id for peer in library]
    block_seed, _ = seeds(prefix, 0, 2)
    identity = Identity.generate()
    while rank_key(block_seed, identity.peer_id_text) < max(rank_key(block_seed, p) for p in ids):
        identity = Identity.generate()
    me = identity.peer_id_text
    rank0, rank1 = sorted(ids, key=lambda p: rank_key(block_seed, p))
    decls = {p: {"client_mode": False, "count": 0} for p in [*ids, me]}
    assert sorted(map(sorted, make_groups(prefix, decls, 2))) == sorted(
        [sorted([me, rank1]), [rank0]]
    )
    theirs = [Member(weight=1.0, epoch=2, seed=21), Member(weight=3.0, epoch=2, seed=22)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=4000,
        identity=identity,
        prefix=prefix,
        mine=Member(weight=2.0, epoch=2, seed=20),
        theirs=theirs,
        group_size=2,
    )
    by_id = dict(zip(ids, done.library, strict=True))
    context = f"{done.report.outcome} {done.report.note}\n" + "\n".join(
        f"{p}: {i['text']} | {i['note']}" for p, i in by_id.items()
    )
    assert by_id[rank0]["outcome"] == "alone", context
    assert by_id[rank1]["outcome"] == "averaged", context
    assert sorted(by_id[rank1]["group"]) == sorted([me, rank1]), context
    assert done.report.outcome == "averaged", context
    assert sorted(done.report.group) == sorted([me, rank1])
    paired = {
        me: (2.0, 20),
        rank1: (theirs[ids.index(rank1)].weight, theirs[ids.index(rank1)].seed),
    }
    expected = np.zeros(4000)
    for w, seed in paired.values():
        expected += w * values_for(seed, 4000).astype(np.float64)
    expected /= sum(w for w, _ in paired.values())
    for peer in (me, rank1):
        assert np.max(np.abs(done.results[peer] - expected)) <= 1e-6 * 5
    alone_seed = theirs[ids.index(rank0)].seed
    assert np.array_equal(done.results[rank0], values_for(alone_seed, 4000))


# ---------------------------------------------------------------- 9.2 a late starter


@pytest.mark.slow
def test_library_peer_starting_late_joins_the_round_we_declared_in(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """9.2: ready less than gather_window / 2 but more than / 8 before the close, a peer
    takes that round when a valid declaration is already there (ours)."""
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=3000,
        lead=True,
        mine=Member(weight=1.0, epoch=0, seed=30),
        theirs=[Member(weight=1.0, epoch=0, seed=31)],
        # 0.3 s before the close: between window / 8 and window / 2
        their_delays=[0.62 * GATHER_WINDOW],
    )
    assert_averaged(done, "none")
    assert done.library[0]["round"] == done.report.round


# ---------------------------------------------------------------- a ghost leader


def _ordered_identity(round_seed: bytes, below: str | None, above: str | None) -> Identity:
    """An identity whose rank key lies between those of `below` and `above`."""
    low = rank_key(round_seed, below) if below else b""
    high = rank_key(round_seed, above) if above else b"\xff" * 33
    for _ in range(100_000):
        identity = Identity.generate()
        if low < rank_key(round_seed, identity.peer_id_text) < high:
            return identity
    raise AssertionError("no identity in range")


@pytest.mark.slow
@pytest.mark.parametrize("we_lead", [True, False], ids=["cleanroom-next", "library-next"])
def test_a_ghost_leader_is_skipped_and_named_in_skipped(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path, we_lead: bool
) -> None:
    """9.4: a member whose join fails at once asks the next non-client member, naming the
    ones it passed in `skipped`; a ghost (declared, nobody listening) ranks first."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    _, round_seed = seeds(prefix, 0, 1)
    theirs_id = library[0].peer_id
    ghost = _ordered_identity(round_seed, None, theirs_id)
    if we_lead:
        identity = _ordered_identity(round_seed, ghost.peer_id_text, theirs_id)
    else:
        identity = _ordered_identity(round_seed, theirs_id, None)

    def store_ghost(prefix: str, round_number: int, layout: str) -> None:
        declaration = ghost_declaration(layout, 5000)
        declaration["address"] = f"{ghost.peer_id_text}@{declaration['address']}"
        store_declaration(bootstrap, prefix, round_number, ghost, declaration)

    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="int8",
        total=5000,
        identity=identity,
        prefix=prefix,
        mine=Member(weight=1.0, epoch=4, seed=40),
        theirs=[Member(weight=2.0, epoch=4, seed=41)],
        before=store_ghost,
    )
    assert_averaged(done, "int8")
    assert ghost.peer_id_text in done.report.declarations
    assert ghost.peer_id_text not in done.library[0]["group"]
    assert done.report.led == we_lead
    if we_lead:
        joins = [body for method, body, *_ in done.cleanroom.requests_seen if method == ".join"]
        assert [list(body.get("skipped", ())) for body in joins] == [[ghost.peer_id_text]]
    else:
        assert done.library[0]["leader"] == theirs_id
    # averaging.md: the report's note names the skipped leaders (by their first 8 characters)
    assert ghost.peer_id_text[:8] in done.library[0]["note"], done.library[0]["note"]


# ---------------------------------------------------------------- 9.4 step 2: the phase


@pytest.mark.slow
def test_phase_is_the_lower_median_of_counts_clients_included(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """Two ghost clients declare count 7 beside us (7) and a fresh library peer (0): the
    counts sorted are 0, 7, 7, 7, the lower median 7; the round seed of phase 7 makes us
    the leader, that of phase 0 would not. The ghosts never join: the leader confirms
    without them join_timeout after the close."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    theirs_id = library[0].peer_id
    _, seed7 = seeds(prefix, 7, 1)
    _, seed0 = seeds(prefix, 0, 1)
    identity = Identity.generate()
    while not (
        rank_key(seed7, identity.peer_id_text) < rank_key(seed7, theirs_id)
        and rank_key(seed0, identity.peer_id_text) > rank_key(seed0, theirs_id)
    ):
        identity = Identity.generate()

    def store_ghost_clients(prefix: str, round_number: int, layout: str) -> None:
        for _ in range(2):
            ghost = {**ghost_declaration(layout, 2000), "address": None, "client_mode": True}
            ghost["count"] = 7
            store_declaration(bootstrap, prefix, round_number, Identity.generate(), ghost)

    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=2000,
        identity=identity,
        prefix=prefix,
        mine=Member(weight=1.0, epoch=0, seed=70),
        theirs=[Member(weight=1.0, epoch=0, seed=71)],
        before=store_ghost_clients,
        count=7,
    )
    assert done.report.phase == 7
    assert done.report.led
    assert done.library[0]["leader"] == identity.peer_id_text
    assert_averaged(done, "none")


# ---------------------------------------------------------------- 9.5: a caller of another view


@pytest.mark.slow
def test_an_undeclared_caller_is_refused_and_the_group_averages_without_it(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """We do not declare; just before the close we read the round, and join the leader of
    the two library peers' group. A caller the leader did not expect must have a
    declaration in the round (9.5 "Order"): one that never declared joined every leader
    with room, took its share of the vector and froze (an outside review). So it is told
    `full`, and the two library peers average between themselves, the whole vector."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    theirs = [Member(weight=1.0, epoch=2, seed=81), Member(weight=2.0, epoch=2, seed=82)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=6000,
        identity=Identity.generate(),
        prefix=prefix,
        mine=Member(weight=4, epoch=2, seed=80),
        theirs=theirs,
        declare=False,
    )
    me = done.cleanroom.identity.peer_id_text
    assert me not in done.report.declarations
    assert done.report.confirmation is None
    assert "'full'" in done.report.note, done.report.note
    expected = sum(m.weight * values_for(m.seed, 6000).astype(np.float64) for m in theirs)
    expected /= sum(m.weight for m in theirs)
    for info, peer in zip(done.library, done.library_ids, strict=True):
        assert info["outcome"] == "averaged", info
        assert sorted(info["group"]) == sorted(done.library_ids), info
        np.testing.assert_allclose(done.results[peer], expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- 9: abort, retry, complete


@pytest.mark.slow
def test_abort_withdraws_us_from_one_part_and_retry_and_complete_are_answered(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """We lead (part 0); we withdraw from part 1 (`abort`: `nonfinite`); on part 2 we send
    chunk 0 again with `retry` (acknowledged, counted once) and once more after the last
    chunk (`dropped`: `complete`, and what we delivered still counts)."""
    total = 9000
    theirs = [Member(weight=1.0, epoch=1, seed=91), Member(weight=3.0, epoch=1, seed=92)]
    mine = Member(weight=2.0, epoch=1, seed=90)
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=total,
        lead=True,
        mine=mine,
        theirs=theirs,
        chunk_bytes=4096,
        abort_parts=frozenset({1}),
        probe_repeats=True,
    )
    me = done.cleanroom.identity.peer_id_text
    confirmation = done.report.confirmation
    assert confirmation is not None, done.report.note
    members = [p for p, _ in confirmation["members"]]
    assert members[0] == me
    assert done.report.repeat_answers == {
        "abort part 1": "ok",
        "chunk 0 again with retry": "ok",
        "chunk 0 again once complete": "dropped: complete",
    }
    by_id = {me: mine, **dict(zip(done.library_ids, theirs, strict=True))}
    spans = confirmation["spans"]
    expected = np.zeros(total)
    for index, (start, stop) in enumerate(spans):
        counted = [p for p in members if not (index == 1 and p == me)]
        weights = [by_id[p].weight for p in counted]
        mean = sum(
            w * values_for(by_id[p].seed, total)[start:stop].astype(np.float64)
            for w, p in zip(weights, counted, strict=True)
        ) / math.fsum(weights)
        expected[start:stop] = mean
    for peer, result in done.results.items():
        assert np.max(np.abs(result - expected)) <= 1e-6 * 5, peer
    for info in done.library:
        assert info["outcome"] == "partial", info["text"]
        statuses = [part["status"] for part in info["parts"]]
        assert statuses == ["all", "some", "all"], info["text"]
        assert info["parts"][1]["dropped"] == {me: "nonfinite"}
    assert done.report.parts[1].status == "some"
    assert done.report.parts[1].dropped == {me: "nonfinite"}


# ---------------------------------------------------------------- 9.5: empty parts


@pytest.mark.slow
@pytest.mark.parametrize("we_lead", [True, False], ids=["we-lead", "we-reduce-the-empty-part"])
def test_an_empty_part(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path, we_lead: bool
) -> None:
    """2 elements over 3 equal reducers: spans [0, 1), [1, 1), [1, 2) ("Parts may be
    empty"); the empty part's result is a header without chunks (9.6)."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    _, round_seed = seeds(prefix, 0, 1)
    ranked = sorted((p.peer_id for p in library), key=lambda p: rank_key(round_seed, p))
    if we_lead:
        identity = _ordered_identity(round_seed, None, ranked[0])
    else:
        identity = _ordered_identity(round_seed, ranked[0], ranked[1])
    theirs = [Member(weight=1.0, epoch=0, seed=101), Member(weight=1.0, epoch=0, seed=102)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=2,
        identity=identity,
        prefix=prefix,
        mine=Member(weight=1.0, epoch=0, seed=100),
        theirs=theirs,
    )
    confirmation = done.report.confirmation
    assert confirmation is not None, done.report.note
    assert [tuple(s) for s in confirmation["spans"]] == [(0, 1), (1, 1), (1, 2)]
    assert [p for p, _ in confirmation["members"]][1] == (
        ranked[0] if we_lead else identity.peer_id_text
    )
    assert_averaged(done, "none")
    if not we_lead:
        assert sorted(done.report.fetched_by) == sorted(done.library_ids)
    else:
        headers = [body for part, body, _ in done.cleanroom.result_items_seen if part == 1]
        assert headers and headers[0]["chunks"] == 0, headers


# ---------------------------------------------------------------- 9.6: a stale member


@pytest.mark.slow
def test_a_stale_cleanroom_member_is_dropped_and_still_receives_the_mean(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """Epoch 0 beside two peers at epoch 3 (S = 2): our chunks are refused `stale`, our own
    part is the mean of theirs (we list ourselves `stale`), and we receive their mean."""
    total = 3000
    theirs = [Member(weight=1.0, epoch=3, seed=121), Member(weight=2.0, epoch=3, seed=122)]
    done = run_round(
        bootstrap,
        library,
        tmp_path,
        codec="none",
        total=total,
        lead=True,
        mine=Member(weight=1.0, epoch=0, seed=120),
        theirs=theirs,
    )
    me = done.cleanroom.identity.peer_id_text
    expected = (values_for(121, total) + 2.0 * values_for(122, total).astype(np.float64)) / 3
    for peer, result in done.results.items():
        assert np.max(np.abs(result - expected)) <= 1e-6 * 5, peer
    assert sorted(done.report.observations) == [
        "chunk 0 of part 1 refused: dropped: stale",
        "chunk 0 of part 2 refused: dropped: stale",
    ]
    for info in done.library:
        assert info["stale"] == [me], info["text"]
        assert info["outcome"] == "partial", info["text"]
        assert [part["status"] for part in info["parts"]] == ["some"] * 3
        assert all(part["dropped"] == {me: "stale"} for part in info["parts"]), info["parts"]


# ---------------------------------------------------------------- 9.2: `count` across rounds


def steps_at(
    starts: list[float],
    identity: Identity,
    bootstrap: str,
    prefix: str,
    values: np.ndarray,
    count: int = 0,
    group_size: int = 16,
) -> list[StepReport]:
    """Our steps under one identity, one at each of `starts`: each takes the count (9.2)
    and the values the one before left."""
    reports: list[StepReport] = []
    for start in starts:
        averager = CleanroomAverager(
            identity, bootstrap, prefix, values, gather_window=GATHER_WINDOW, group_size=group_size
        )
        try:
            time.sleep(max(start - time.time(), 0.0))
            reports.append(averager.step(weight=1.0, epoch=0, timeout=STEP_TIMEOUT, count=count))
        finally:
            averager.close()
        count = reports[-1].next_count
        values = reports[-1].result if reports[-1].result is not None else values
    return reports


@pytest.mark.slow
def test_count_after_a_confirmed_round_sets_the_next_phase(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """Two steps under one prefix. Step 1: we declare count 5, the fresh library peer 0:
    phase 0 (the lower median), the library leads. After a confirmed group a peer's count
    is max(phase, lower median of the members' counts) + 1 = 1 (not 6, the largest count
    as before v6). Step 2: both declare 1, phase 1, whose round seed makes us the leader."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    peer = library[0]
    _, seed0 = seeds(prefix, 0, 1)
    _, seed1 = seeds(prefix, 1, 1)
    identity = Identity.generate()
    while not (
        rank_key(seed0, identity.peer_id_text) > rank_key(seed0, peer.peer_id)
        and rank_key(seed1, identity.peer_id_text) < rank_key(seed1, peer.peer_id)
    ):
        identity = Identity.generate()
    total, first = 2000, safe_start()
    starts = [first, first + 3 * GATHER_WINDOW]
    peer.send(
        {
            "prefix": prefix, "codec": "none", "total": total, "seed": 131,
            "chunk_bytes": DEFAULT_CHUNK_BYTES, "bandwidth": 1.0, "group_size": 16,
            "gather_window": GATHER_WINDOW, "weight": 1.0, "epoch": 0,
            "timeout": STEP_TIMEOUT, "starts": starts, "out": str(tmp_path / "library-{}.npy"),
        }
    )  # fmt: skip
    reports = steps_at(starts, identity, bootstrap, prefix, values_for(130, total), count=5)
    infos = [peer.read(STEP_TIMEOUT + 15.0) for _ in starts]
    context = "\n".join(f"{i['text']} | {i['note']}" for i in infos)
    assert [r.outcome for r in reports] == ["averaged", "averaged"], context
    assert [i["outcome"] for i in infos] == ["averaged", "averaged"], context
    assert [r.phase for r in reports] == [0, 1]
    assert reports[1].declarations[peer.peer_id]["count"] == 1
    assert [r.led for r in reports] == [False, True]
    assert [i["leader"] for i in infos] == [peer.peer_id, identity.peer_id_text]


@pytest.mark.slow
def test_library_peers_that_close_early_are_grouped_from_their_kept_declarations(
    bootstrap: str, library: list[LibraryPeer], tmp_path: Path
) -> None:
    """9.2, kept declarations: three peers in groups of at most 2, three steps. From the
    second on, the library peers have met three peers and close early, before the slot's
    end, and withdraw; we read only at the close. Their markers keep what they grouped
    and list our step tag, so we group the same set (before kept declarations, such a
    read computed another phase: we and a library peer both led, and nobody joined)."""
    prefix = f"cleanroom/averaging/{uuid.uuid4().hex}"
    ids = [peer.peer_id for peer in library]
    identity = Identity.generate()
    me = identity.peer_id_text
    total, first = 2000, safe_start()
    starts = [first + i * 3 * GATHER_WINDOW for i in range(3)]
    for i, peer in enumerate(library):
        peer.send(
            {
                "prefix": prefix, "codec": "none", "total": total, "seed": 140 + i,
                "chunk_bytes": DEFAULT_CHUNK_BYTES, "bandwidth": 1.0, "group_size": 2,
                "gather_window": GATHER_WINDOW, "weight": 1.0, "epoch": 0,
                "timeout": STEP_TIMEOUT, "starts": starts,
                "out": str(tmp_path / f"library{i}-{{}}.npy"),
            }
        )  # fmt: skip
    reports = steps_at(starts, identity, bootstrap, prefix, values_for(150, total), group_size=2)
    infos = [[peer.read(STEP_TIMEOUT + 15.0) for _ in starts] for peer in library]
    withdrawn_before_our_read = 0
    for step, report in enumerate(reports):
        theirs = {p: infos[i][step] for i, p in enumerate(ids)}
        context = f"step {step}: ours {report.outcome} {report.group} {report.note}\n" + "\n".join(
            f"  {p}: {i['text']} | {i['note']}" for p, i in theirs.items()
        )
        # one view of the round: each peer's group is what every other peer computed
        groups = {me: sorted(report.group)} | {p: sorted(i["group"]) for p, i in theirs.items()}
        for group in groups.values():
            assert all(groups[other] == group for other in group), context
        outcomes = sorted([report.outcome, *(i["outcome"] for i in theirs.values())])
        assert outcomes == ["alone", "averaged", "averaged"], context
        assert not any("nobody joined" in i["note"] for i in theirs.values()), context
        if step:
            entries = report.read_entries
            withdrawn_before_our_read += sum(
                isinstance(entries.get(p), dict) and entries[p].get("done") is True for p in ids
            )
    assert withdrawn_before_our_read, "the library peers never closed before our read"
