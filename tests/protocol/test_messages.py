"""Typed DHT messages: round trips, dispatch, strict validation both ways."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    DHTID,
    MAX_ENTRIES_PER_STORE,
    MAX_NODES,
    MESSAGE_TYPES,
    METHODS,
    Entry,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    FrameKind,
    Identity,
    LocalProtocolError,
    Message,
    NodeInfo,
    PeerID,
    PingRequest,
    PingResponse,
    RemoteProtocolError,
    RpcFrame,
    StoreRequest,
    StoreResponse,
    decode_message,
    decode_rpc_frame,
    encode_rpc_frame,
    register_message,
    sign_entry,
)

ALICE = Identity.from_seed(b"\x01" * 32)
KEY = DHTID.from_key("k")
NODE = NodeInfo(ALICE.peer_id, "10.0.0.1:4000")
ENTRY = Entry("sub", b"\x01", 1_700_000_000.5)
SIGNED = sign_entry(ALICE, KEY, str(ALICE.peer_id), b"\x02", 1_700_000_001.0)

EXAMPLES: list[Message] = [
    PingRequest("10.0.0.1:4000"),
    PingRequest(None),
    PingResponse(),
    FindNodeRequest("[::1]:4000", KEY),
    FindNodeResponse((NODE, NodeInfo(ALICE.peer_id, None))),
    FindNodeResponse(()),
    FindValueRequest(None, KEY),
    FindValueRequest("10.0.0.1:4000", KEY, b"\xa3sub"),
    FindValueResponse(None, (NODE,)),
    FindValueResponse((ENTRY,), (), more=True),
    FindValueResponse((), ()),
    FindValueResponse((ENTRY, SIGNED, Entry(None, b"", 1.0), Entry(-5, b"", 2.0)), (NODE,)),
    StoreRequest("host.example:1", KEY, "k", (ENTRY, SIGNED)),
    StoreResponse((True, False)),
]


def over_the_wire(body: dict[str, Any]) -> dict[str, Any]:
    """Send ``body`` in a request frame and decode it as the callee would."""
    pieces = encode_rpc_frame(RpcFrame(FrameKind.REQUEST, 1, method="x", body=body))
    return decode_rpc_frame(b"".join(bytes(p) for p in pieces)[4:]).body


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    body = message.to_body()
    assert body["t"] == message.TAG and next(iter(body)) == "t"
    assert type(message).from_body(body) == message
    assert type(message).from_body(over_the_wire(body)) == message
    assert decode_message(over_the_wire(body)) == message


def test_methods_table() -> None:
    assert set(METHODS) == {"dht.ping", "dht.find_node", "dht.find_value", "dht.store"}
    for method, (request, response) in METHODS.items():
        assert method == request.METHOD  # type: ignore[attr-defined]
        assert MESSAGE_TYPES[request.TAG] is request
        assert MESSAGE_TYPES[response.TAG] is response
    assert METHODS["dht.store"] == (StoreRequest, StoreResponse)


def test_tags_are_unique_and_namespaced() -> None:
    tags = [cls.TAG for cls in MESSAGE_TYPES.values()]
    assert len(tags) == len(set(tags))
    assert {t for t in tags if t.startswith("dht.")} >= {
        "dht.ping.req",
        "dht.ping.res",
        "dht.store.req",
        "dht.store.res",
    }


def test_lists_become_tuples() -> None:
    message = FindNodeResponse([NODE])  # type: ignore[arg-type]
    assert message.nodes == (NODE,)
    assert StoreResponse([True]).accepted == (True,)  # type: ignore[arg-type]
    hash(PingRequest(None))  # frozen messages without lists are hashable


def test_register_a_new_message() -> None:
    @dataclass(frozen=True, slots=True)
    class Hello(Message):
        TAG: ClassVar[str] = "test.hello"
        FIELDS: ClassVar[tuple[str, ...]] = ("n",)
        n: int

        def _encode(self) -> dict[str, Any]:
            return {"n": self.n}

        @classmethod
        def _decode(cls, body: dict[str, Any]) -> Hello:
            if type(body["n"]) is not int:
                raise RemoteProtocolError("n must be an int")
            return cls(body["n"])

    register_message(Hello)
    try:
        assert decode_message(over_the_wire(Hello(3).to_body())) == Hello(3)
        with pytest.raises(ValueError):
            register_message(Hello)
        with pytest.raises(RemoteProtocolError):
            decode_message({"t": "test.hello", "n": "3"})
    finally:
        del MESSAGE_TYPES["test.hello"]


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"t": "nope"},
        {"t": 1},
        {"t": ("dht.ping.req",)},
        {"t": {"x": 1}},
    ],
)
def test_decode_message_refuses_unknown(body: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(body)


# --- local construction is checked ---

SENDERS_OK = [None, "1.2.3.4:5", "[::1]:80", "[2001:db8::1]:65535", "host-name.example:4000"]
SENDERS_BAD = [
    "",
    "host",
    "host:0",
    "host:01",
    " host:1",
    "::1:80",
    "host:\u0663",
    f"{ALICE.peer_id}@host:1",
    b"host:1",
    4000,
    "h" * 300 + ":1",
]


@pytest.mark.parametrize("sender", ["bad host:1", "a:1,b:2", "host:1\n", "a\tb:1"])
def test_a_sender_with_a_space_or_comma_says_so(sender: str) -> None:
    """Was the address parser's "is several addresses: give a list with one address per
    item", which a wire client never sends (a clean-room client trial)."""
    with pytest.raises(RemoteProtocolError, match="holds a space or a comma") as caught:
        PingRequest.from_body({"t": PingRequest.TAG, "sender": sender})
    assert "list" not in str(caught.value)


@pytest.mark.parametrize("sender", SENDERS_OK)
def test_good_senders(sender: str | None) -> None:
    assert PingRequest.from_body(PingRequest(sender).to_body()).sender == sender
    assert NodeInfo(ALICE.peer_id, sender).address == sender


@pytest.mark.parametrize("sender", SENDERS_BAD)
def test_bad_senders(sender: Any) -> None:
    with pytest.raises(LocalProtocolError):
        PingRequest(sender)
    with pytest.raises(LocalProtocolError):
        NodeInfo(ALICE.peer_id, sender)
    with pytest.raises(RemoteProtocolError):
        PingRequest.from_body({"t": PingRequest.TAG, "sender": sender})
    with pytest.raises(RemoteProtocolError):
        NodeInfo.from_body({"p": ALICE.peer_id.raw, "a": sender})


@pytest.mark.parametrize(
    "make",
    [
        lambda: NodeInfo(ALICE.peer_id.raw, None),  # type: ignore[arg-type]
        lambda: FindNodeRequest(None, int(KEY)),  # type: ignore[arg-type]
        lambda: FindValueRequest(None, KEY.to_raw()),  # type: ignore[arg-type]
        lambda: FindNodeResponse((NODE,) * (MAX_NODES + 1)),
        lambda: FindNodeResponse((NODE.to_body(),)),  # type: ignore[arg-type]
        lambda: FindNodeResponse(NODE),  # type: ignore[arg-type]
        lambda: FindValueResponse((NODE,), ()),  # type: ignore[arg-type]
        lambda: FindValueResponse(None, (NODE,) * (MAX_NODES + 1)),
        lambda: FindValueResponse(None, (NODE,), more=True),  # more of nothing: a loop
        lambda: FindValueResponse((ENTRY,), (), more=1),  # type: ignore[arg-type]
        lambda: FindValueRequest(None, KEY, "sub"),  # type: ignore[arg-type]
        lambda: FindValueRequest(None, KEY, bytes(200)),  # longer than any packed subkey
        lambda: StoreRequest(None, KEY, "k", ()),
        lambda: StoreRequest(None, KEY, "k", (ENTRY,) * (MAX_ENTRIES_PER_STORE + 1)),
        lambda: StoreRequest(None, KEY, "not k", (ENTRY,)),  # name must hash to key
        lambda: StoreRequest(None, KEY, b"k", (ENTRY,)),  # type: ignore[arg-type]
        lambda: StoreResponse((1, 0)),  # type: ignore[arg-type]
        lambda: StoreResponse((True,) * (MAX_ENTRIES_PER_STORE + 1)),
    ],
)
def test_invalid_local_messages(make: Any) -> None:
    with pytest.raises(LocalProtocolError):
        make()


def test_limits_are_inclusive() -> None:
    FindNodeResponse((NODE,) * MAX_NODES)
    StoreRequest(None, KEY, "k", (ENTRY,) * MAX_ENTRIES_PER_STORE)
    StoreResponse((True,) * MAX_ENTRIES_PER_STORE)


# --- received bodies are checked ---

RAW_KEY = KEY.to_raw()
NODE_BODY = NODE.to_body()


def store_body(**fields: Any) -> dict[str, Any]:
    """A valid ``dht.store.req`` body with ``fields`` replaced."""
    body = {
        "t": "dht.store.req",
        "sender": None,
        "key": RAW_KEY,
        "name": "k",
        "entries": (ENTRY.to_body(),),
        "want_nodes": True,
    }
    return body | fields


def test_store_body_is_valid_as_is() -> None:
    """So that each invalid store body below fails for the one field it changes."""
    assert StoreRequest.from_body(store_body()).want_nodes is True


@pytest.mark.parametrize(
    ("cls", "body"),
    [
        (PingRequest, {"t": "dht.ping.res", "sender": None}),
        (PingRequest, {"t": "dht.ping.req"}),
        (PingRequest, {"t": "dht.ping.req", "sender": None, "extra": 1}),
        (PingRequest, ["dht.ping.req", None]),
        (PingResponse, {"t": "dht.ping.res", "x": 1}),
        (FindNodeRequest, {"t": "dht.find_node.req", "sender": None, "target": RAW_KEY[:31]}),
        (FindNodeRequest, {"t": "dht.find_node.req", "sender": None, "target": RAW_KEY + b"x"}),
        (FindNodeRequest, {"t": "dht.find_node.req", "sender": None, "target": int(KEY)}),
        (FindNodeRequest, {"t": "dht.find_node.req", "sender": None, "target": RAW_KEY.hex()}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": None}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": NODE_BODY}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": (NODE_BODY,) * (MAX_NODES + 1)}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": ({"p": RAW_KEY},)}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": ({"p": RAW_KEY[:5], "a": None},)}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": ({"p": "x" * 32, "a": None},)}),
        (FindNodeResponse, {"t": "dht.find_node.res", "nodes": ((RAW_KEY, None),)}),
        (FindValueRequest, {"t": "dht.find_value.req", "sender": None, "target": RAW_KEY}),
        (FindValueResponse, {"t": "dht.find_value.res", "entries": None}),
        (FindValueResponse, {"t": "dht.find_value.res", "entries": {}, "nodes": ()}),
        (FindValueResponse, {"t": "dht.find_value.res", "entries": ({"s": None},), "nodes": ()}),
        (StoreRequest, {"t": "dht.store.req", "sender": None, "key": RAW_KEY, "entries": ()}),
        (StoreRequest, store_body(entries=())),
        (StoreRequest, store_body(entries=None)),
        (StoreRequest, store_body(name="not k")),  # does not hash to key
        (StoreRequest, store_body(entries=(ENTRY.to_body(),) * (MAX_ENTRIES_PER_STORE + 1))),
        (StoreRequest, store_body(entries=({"s": None, "v": b"x" * 20000, "x": 1.0},))),
        (StoreRequest, store_body(want_nodes=1)),  # not a bool
        (StoreResponse, {"t": "dht.store.res", "accepted": (1,)}),
        (StoreResponse, {"t": "dht.store.res", "accepted": True}),
        (StoreResponse, {"t": "dht.store.res", "accepted": (True,) * 65}),
    ],
)
def test_invalid_remote_bodies(cls: type[Message], body: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        cls.from_body(body)
    if isinstance(body, dict):
        with pytest.raises(RemoteProtocolError):
            decode_message(body)


UNDIALABLE = ["0.0.0.0:4000", "[::]:4000", "255.255.255.255:4000", "224.0.0.1:4000", "0:4000"]


@pytest.mark.parametrize(
    "make",
    [
        lambda nodes: FindNodeResponse(nodes),
        lambda nodes: FindValueResponse(None, nodes),
        lambda nodes: StoreResponse((True,), nodes),
    ],
)
def test_replies_drop_only_their_undialable_contacts(make: Any) -> None:
    """A contact nobody can dial is left out of a received reply; the others stay."""
    client = NodeInfo(ALICE.peer_id, None)
    undialable = tuple(NodeInfo(ALICE.peer_id, a) for a in UNDIALABLE)
    body = over_the_wire(make((undialable[0], NODE, *undialable[1:], client)).to_body())
    assert decode_message(body) == make((NODE, client))


# --- property: every valid message survives the wire ---

peer_ids = st.builds(PeerID, st.binary(min_size=32, max_size=32))
hostports = st.sampled_from(["10.0.0.1:1", "[::1]:65535", "a.example:80", None])
nodes = st.builds(NodeInfo, peer_ids, hostports)
subkeys = st.one_of(
    st.none(),
    st.text(max_size=30),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.binary(max_size=128),
)
entries = st.builds(
    Entry,
    subkeys,
    st.binary(max_size=64),
    st.floats(allow_nan=False, allow_infinity=False),
)
dht_ids = st.integers(0, (1 << 256) - 1).map(DHTID)
messages = st.one_of(
    st.builds(PingRequest, hostports),
    st.builds(FindNodeRequest, hostports, dht_ids),
    st.builds(FindNodeResponse, st.lists(nodes, max_size=5).map(tuple)),
    st.builds(FindValueRequest, hostports, dht_ids),
    st.builds(
        FindValueResponse,
        st.none() | st.lists(entries, max_size=5).map(tuple),
        st.lists(nodes, max_size=3).map(tuple),
    ),
    st.text(max_size=40).flatmap(
        lambda name: st.builds(
            StoreRequest,
            hostports,
            st.just(DHTID.from_key(name)),
            st.just(name),
            st.lists(entries, min_size=1, max_size=5).map(tuple),
            st.booleans(),
        )
    ),
    st.builds(
        StoreResponse,
        st.lists(st.booleans(), max_size=64).map(tuple),
        st.lists(nodes, max_size=3).map(tuple),
    ),
)


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(messages)
def test_every_valid_message_survives_the_wire(message: Message) -> None:
    body = over_the_wire(message.to_body())
    assert decode_message(body) == message
    assert msgpack.packb(type(message).from_body(body).to_body()) == msgpack.packb(
        message.to_body()
    )
