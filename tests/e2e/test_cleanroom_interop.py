"""A client written from docs/protocol.md alone talks to a real `swarm bootstrap`.

`cleanroom_client` imports nothing from `protocol/` or `peer/`: if these tests fail while
the project's own tests pass, the docs and the code disagree. Every network call is bounded
by a socket timeout; the bootstrap process is killed at the end.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from cleanroom_client import (
    DEFAULT_MAX_FRAME_SIZE,
    CleanroomError,
    Connection,
    DHTClient,
    Handler,
    Identity,
    Node,
    RemoteError,
    b58encode,
    dht_id,
    dht_responder,
    encode_rpc_frame,
    make_entry,
    owned_key,
    request_header,
    signing_bytes,
)
from tests_support_paths import bootstrap_process

TIMEOUT = 5.0
PING = {"t": "dht.ping.req", "sender": None}


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    """The address a real `swarm bootstrap` prints; the process is killed afterwards."""
    with bootstrap_process(wait=15.0) as address:
        yield address


@pytest.fixture
def me() -> Identity:
    return Identity.generate()


def connect(address: str, identity: Identity) -> Connection:
    return Connection.open(address, identity, timeout=TIMEOUT)


# ---------------------------------------------------------------- the docs' own examples


def test_client_reproduces_the_worked_examples_of_the_docs() -> None:
    zero = Identity.from_seed(bytes(32))
    assert zero.public_key.hex() == (
        "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29"
    )
    assert zero.peer_id_text == "2KagShR4Usj2uARXJeDw7XJEKvQ3XDr84dC47hUB3Uyd"
    assert signing_bytes(dht_id("run/peers"), "sub", b"val", 1.5).hex() == (
        "737761726d2d7265636f72642f313a94c420c0bab53d967b86c38cc67486ead1c2fd3455d774ea10d1b5"
        "6a52dc30686fdf0ca3737562c40376616ccb3ff8000000000000"
    )
    body = {"t": "dht.ping.req", "sender": "127.0.0.1:4000"}
    frame = encode_rpc_frame(request_header(1, "dht.ping", body))
    assert (struct.pack(">I", len(frame)) + frame).hex() == (
        "000000450000004185a17601a16ba3726571a2696401a16da86468742e70696e67a16282a174ac6468742e"
        "70696e672e726571a673656e646572ae3132372e302e302e313a34303030"
    )


# ---------------------------------------------------------------- the happy path


@pytest.mark.slow
def test_handshake_proves_the_printed_peer_id_and_ping_answers(
    bootstrap: str, me: Identity
) -> None:
    with connect(bootstrap, me) as connection:
        assert b58encode(connection.remote_peer_id) == bootstrap.split("@")[0]
        DHTClient(connection).ping()


@pytest.mark.slow
def test_store_then_find_value_plain(bootstrap: str, me: Identity) -> None:
    value = {"lr": 0.1, "layers": [1, 2, 3], "blob": b"\x00\xff", "name": "run"}
    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        entries, _, more = dht.find_value_page("cleanroom/missing")
        assert (entries, more) == (None, False)
        assert me.peer_id not in [node.peer_id for node in dht.find_node(me.peer_id)]
        assert dht.store("cleanroom/plain", value, ttl=60.0)
        assert dht.find_value("cleanroom/plain") == {None: value}


@pytest.mark.slow
def test_owner_bound_subkey_signed_by_owner_only(bootstrap: str, me: Identity) -> None:
    key, other = "cleanroom/shared", Identity.generate()
    expiration = time.time() + 60.0
    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        assert dht.store(key, "mine", subkey=me.peer_id_text, signer=me)
        forged_by_other = make_entry(key, me.peer_id_text, "forged", expiration + 10, other)
        unsigned = make_entry(key, me.peer_id_text, "forged", expiration + 10)
        bad_signature = make_entry(key, me.peer_id_text, "forged", expiration + 10, me)
        bad_signature["g"] = bytes(64)
        replayed = make_entry(key, me.peer_id_text, "older", expiration - 30, me)  # genuine, older
        refused = dht.store_entries(key, [forged_by_other, unsigned, bad_signature, replayed])
        assert refused == [False, False, False, False]
        dht.ping()  # a refused entry is no reason to drop the connection
        assert dht.find_value(key) == {me.peer_id_text: "mine"}  # signatures verified


@pytest.mark.slow
def test_owned_key_takes_only_its_owners_entries(bootstrap: str, me: Identity) -> None:
    key, other = owned_key("cleanroom/state", me.peer_id_text), Identity.generate()
    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        assert dht.store(key, {"step": 10}, signer=me)
        assert not dht.store(key, {"step": 11}, ttl=90.0, signer=other)
        assert not dht.store(key, {"step": 12}, ttl=90.0, subkey="x")
        assert dht.find_value(key) == {None: {"step": 10}}


class CleanroomNode:
    """The clean-room client as a full DHT node: it listens on 127.0.0.2 (another host
    than the one it dials from), joins by a `sender` claim that the node must prove by
    dialling it (section 5), and serves `answer` on every connection, the one it opened
    included (the node hands keys over to a newcomer at once, on either connection)."""

    def __init__(self, identity: Identity, answer: Handler) -> None:
        self.identity = identity
        self.answer = answer
        self.asked: list[str] = []
        self.dialled_by: list[bytes] = []
        self.failures: list[Exception] = []
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.listener = socket.socket()
        try:
            self.listener.bind(("127.0.0.2", 0))
        except OSError:
            self.listener.close()
            pytest.skip("127.0.0.2 is not a local address here")
        self.listener.listen()
        self.address = f"127.0.0.2:{self.listener.getsockname()[1]}"

    def __enter__(self) -> CleanroomNode:
        self._start(self._accept_loop)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._threads[0].join(2 * TIMEOUT)  # the accept loop: no new sockets after it
        for sock in self._sockets:  # wakes the serving threads: they see the end of data
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads[1:]:
            thread.join(2 * TIMEOUT)
        for sock in [*self._sockets, self.listener]:
            sock.close()

    def join(self, bootstrap: str) -> None:
        """Claim our address to the node, then wait until it hands it out (proven)."""
        outbound = connect(bootstrap, self.identity)
        self._sockets.append(outbound.sock)
        DHTClient(outbound, sender=self.address).ping()
        self._start(functools.partial(self._serve, outbound))
        me = Node(self.identity.peer_id, self.address)
        with connect(bootstrap, Identity.generate()) as reader:
            deadline = time.monotonic() + TIMEOUT
            while me not in DHTClient(reader).find_node(me.peer_id):
                assert time.monotonic() < deadline, "the node never listed our sender claim"
                time.sleep(0.02)

    def _start(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            # a short poll to see _stop, but the handshake gets the full TIMEOUT: with 0.05 s
            # for each of its reads, a node slow to answer on a busy machine was dropped
            # unnoticed (a TimeoutError) and never proved our sender claim
            ready, _, _ = select.select([self.listener], [], [], 0.05)
            if not ready:
                continue
            try:
                incoming = Connection.accept(self.listener, self.identity, timeout=TIMEOUT)
            except (OSError, CleanroomError) as exc:
                self.failures.append(exc)
                continue
            self._sockets.append(incoming.sock)
            if self._stop.is_set():  # a dial that raced our exit
                incoming.close()
                return
            self.dialled_by.append(incoming.remote_peer_id)
            self._start(functools.partial(self._serve, incoming))

    def _serve(self, connection: Connection) -> None:
        try:
            self.asked += connection.serve(self.answer, wait=4 * TIMEOUT)
        except (OSError, CleanroomError) as exc:
            if not self._stop.is_set():
                self.failures.append(exc)


@pytest.mark.slow
def test_node_dials_a_sender_claim_and_the_client_answers_as_responder(
    bootstrap: str, me: Identity
) -> None:
    """Section 5 `sender`: a claim at another host is dialled and proven before it is
    handed out; here the clean-room client is the Noise responder (section 2.2)."""
    with CleanroomNode(me, dht_responder({})) as node:
        node.join(bootstrap)
    assert not node.failures, node.failures
    # the proof; the node may dial again after we hung up (it pings a peer that left)
    assert {b58encode(peer) for peer in node.dialled_by} == {bootstrap.split("@")[0]}


@pytest.mark.slow
def test_project_reader_refuses_forged_entries_from_a_cleanroom_node(
    bootstrap: str, me: Identity
) -> None:
    """A storing node refuses forged entries; so must a reader that meets a node which
    returns them anyway (sections 5 and 6; docs/dht.md "checked ... by readers")."""
    from peer import run_in_background

    forger, stranger = Identity.generate(), Identity.generate()
    key = f"cleanroom/forged/{time.time()}"
    owned = owned_key(key, me.peer_id_text)
    later = time.time() + 120.0
    bad_signature = make_entry(key, "free", "bad signature", later, forger)
    bad_signature["g"] = bytes(64)
    forged = {
        dht_id(key): [
            make_entry(key, me.peer_id_text, "signed by another", later, forger),
            make_entry(key, stranger.peer_id_text, "owner-bound, unsigned", later),
            bad_signature,
            make_entry(key, "open", "a free subkey: anyone may write it", later),
        ],
        dht_id(owned): [
            make_entry(owned, None, "owned key, signed by another", later, forger),
            make_entry(owned, "x", "owned key, unsigned", later),
        ],
    }
    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        assert dht.store(key, "genuine", subkey=me.peer_id_text, signer=me)
        assert dht.store(owned, "genuine", signer=me)

    with CleanroomNode(forger, dht_responder(forged)) as evil:
        evil.join(bootstrap)
        with run_in_background(initial_peers=[bootstrap]) as reader:
            got = reader.dht.get(key)
            got_owned = reader.dht.get(owned)
    assert "dht.find_value" in evil.asked  # the reader did meet the forger
    assert got == {me.peer_id_text: "genuine", "open": "a free subkey: anyone may write it"}
    assert got_owned == "genuine"


# ---------------------------------------------------------------- documented errors


@pytest.mark.slow
def test_unknown_method_is_an_error_and_the_connection_stays(bootstrap: str, me: Identity) -> None:
    with connect(bootstrap, me) as connection:
        with pytest.raises(RemoteError) as caught:
            connection.call("cleanroom.nothing", {})
        assert caught.value.code == "unknown_method"
        DHTClient(connection).ping()


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, body",
    [
        ("dht.ping", {"t": "dht.ping.req"}),  # a field missing
        ("dht.ping", {**PING, "extra": 1}),  # a field added
        ("dht.ping", {"t": "dht.find_node.req", "sender": None}),  # another method's tag
        ("dht.ping", {"t": "dht.ping.req", "sender": "127.0.0.1:04000"}),  # not canonical
        # a host the resolver cannot encode (empty label): dialing it ended the node
        ("dht.ping", {"t": "dht.ping.req", "sender": "a..b:4000"}),
        ("dht.ping", {"t": "dht.ping.req", "sender": "[a..b:c]:4000"}),  # the same, bracketed
        (
            "dht.store",  # an entry that breaks the entry table: the whole request
            {
                "t": "dht.store.req",
                "sender": None,
                "key": dht_id("k"),
                "name": "k",
                "entries": [{"s": True, "v": b"\x01", "x": time.time() + 60}],
                "want_nodes": False,
            },
        ),
    ],
)
def test_bad_body_is_bad_request_and_the_connection_stays(
    bootstrap: str, me: Identity, method: str, body: dict[str, object]
) -> None:
    with connect(bootstrap, me) as connection:
        with pytest.raises(RemoteError) as caught:
            connection.call(method, body)
        assert caught.value.code == "bad_request"
        DHTClient(connection).ping()


@pytest.mark.slow
@pytest.mark.parametrize(
    "violation",
    [
        struct.pack(">I", DEFAULT_MAX_FRAME_SIZE + 1),  # oversize: refused on its length
        struct.pack(">I", 0),  # an empty frame is no RPC frame
        struct.pack(">I", 5) + encode_rpc_frame({"v": 2, "k": "req", "id": 0})[:5],  # H > L
    ],
    ids=["oversize", "empty", "header-longer-than-frame"],
)
def test_malformed_frame_drops_only_that_connection(
    bootstrap: str, me: Identity, violation: bytes
) -> None:
    with connect(bootstrap, me) as bystander, connect(bootstrap, me) as offender:
        offender.channel.send_plain(violation)
        assert offender.is_closed_by_remote(wait=TIMEOUT)
        DHTClient(bystander).ping()


@pytest.mark.slow
def test_malformed_header_drops_the_connection(bootstrap: str, me: Identity) -> None:
    with connect(bootstrap, me) as connection:
        connection.send_raw_frame(encode_rpc_frame({**request_header(0, "dht.ping", PING), "v": 2}))
        assert connection.is_closed_by_remote(wait=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("arrays, dropped", [(1022, False), (1023, True)])
def test_header_nesting_limit_is_1024_containers(
    bootstrap: str, me: Identity, arrays: int, dropped: bool
) -> None:
    """The header map, the body map and `arrays` nested arrays in `sender` (section 4.1)."""
    header = encode_rpc_frame(request_header(0, "dht.ping", {**PING, "sender": "PLACEHOLDER"}))
    nested = b"\x91" * arrays + b"\x01"
    content = header[4:].replace(b"\xabPLACEHOLDER", nested)
    with connect(bootstrap, me) as connection:
        connection.send_raw_frame(struct.pack(">I", len(content)) + content)
        if dropped:
            assert connection.is_closed_by_remote(wait=TIMEOUT)
        else:
            with pytest.raises(RemoteError) as caught:  # parsed: only the sender is wrong
                connection.wait_reply(0)
            assert caught.value.code == "bad_request"


@pytest.mark.slow
def test_stray_replies_and_empty_messages_are_ignored(bootstrap: str, me: Identity) -> None:
    with connect(bootstrap, me) as connection:
        connection.send_raw_frame(encode_rpc_frame({"v": 1, "k": "res", "id": 99, "b": {}}))
        connection.send_raw_frame(encode_rpc_frame({"v": 1, "k": "cancel", "id": 99}))
        sealed = connection.channel.handshake.send.encrypt(b"", b"")  # N = 16: carries nothing
        connection.sock.sendall(struct.pack(">H", len(sealed)) + sealed)
        DHTClient(connection).ping()


@pytest.mark.slow
def test_frame_split_over_many_transport_messages(bootstrap: str, me: Identity) -> None:
    frame = encode_rpc_frame(request_header(0, "dht.ping", PING))
    with connect(bootstrap, me) as connection:
        for byte in struct.pack(">I", len(frame)) + frame:
            connection.channel.send_plain(bytes([byte]))
        assert connection.wait_reply(0).body == {"t": "dht.ping.res"}


# ---------------------------------------------------------------- the project's own API


@pytest.mark.slow
def test_values_cross_between_the_cleanroom_client_and_the_project_api(
    bootstrap: str, me: Identity
) -> None:
    from peer import run_in_background  # the project itself, only to read and write back

    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        assert dht.store("cleanroom/to-project", {"from": "cleanroom"}, ttl=60.0)
        assert dht.store("cleanroom/signed", [1, "x"], subkey=me.peer_id_text, signer=me)

    with run_in_background(initial_peers=[bootstrap]) as node:
        assert node.dht.get("cleanroom/to-project") == {"from": "cleanroom"}
        assert node.dht.get("cleanroom/signed") == {me.peer_id_text: [1, "x"]}
        assert node.dht.store("cleanroom/from-project", {"from": "project"}, ttl=60.0)
        writer = str(node.peer_id)
        assert node.dht.store("cleanroom/project-signed", b"y", ttl=60.0, subkey=writer)

    with connect(bootstrap, me) as connection:
        dht = DHTClient(connection)
        assert dht.find_value("cleanroom/from-project") == {None: {"from": "project"}}
        # find_value verifies the project's signature with the documented signing bytes
        assert dht.find_value("cleanroom/project-signed") == {writer: b"y"}
