"""A swarm/1 client written only from docs/protocol.md (a clean-room interop check).

Nothing here imports the project's `protocol` or `peer` packages: the point is that an
outside developer can speak to a real node from the published spec alone. It uses only
`cryptography`, `msgpack` and blocking sockets. Section numbers refer to docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# section 2
NOISE_PROTOCOL_NAME = b"Noise_XX_25519_AESGCM_SHA256"
PROLOGUE = b"swarm/1"
STATIC_KEY_CONTEXT = b"swarm-noise-static-key:"
MAX_HANDSHAKE_MESSAGE = 1024
MAX_PLAINTEXT_PER_MESSAGE = 65535 - 16
TAG_SIZE = 16
# sections 3, 4, 10
DEFAULT_MAX_FRAME_SIZE = 4 * 1024 * 1024
MAX_HEADER_SIZE = 2 * 1024 * 1024
PROTOCOL_VERSION = 1
# section 6
RECORD_CONTEXT = b"swarm-record/1:"
MAX_VALUE_BYTES = 16384
# section 7
BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class CleanroomError(Exception):
    """Anything the remote sent that this client cannot accept, or a closed connection."""


class ConnectionClosed(CleanroomError):
    """The remote closed the TCP connection."""


class RemoteError(CleanroomError):
    """The remote answered a request with an `err` frame (section 4.3)."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


def packb(obj: Any) -> bytes:
    """msgpack as the docs use it: str and bin kept apart, floats as float64."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# ---------------------------------------------------------------- section 7: identities


def b58encode(data: bytes) -> str:
    """Base58 (Bitcoin alphabet); each leading zero byte becomes a leading `1`."""
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, digit = divmod(number, 58)
        digits.append(BASE58_ALPHABET[digit])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(digits))


def b58decode(text: str) -> bytes:
    """The inverse of `b58encode`.

    Raises:
        ValueError: a character outside the alphabet.
    """
    number = 0
    for char in text:
        number = number * 58 + BASE58_ALPHABET.index(char)
    zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * zeros + body


def raw_public(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair; the PeerID is SHA-256 of the raw public key."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        return raw_public(self.private.public_key())

    @property
    def peer_id(self) -> bytes:
        return hashlib.sha256(self.public_key).digest()

    @property
    def peer_id_text(self) -> str:
        return b58encode(self.peer_id)

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


@dataclass(frozen=True)
class Address:
    """`HOST:PORT` or `PEERID@HOST:PORT`; an IPv6 host in brackets."""

    host: str
    port: int
    peer_id: bytes | None = None

    @classmethod
    def parse(cls, text: str) -> Address:
        """Raises: ValueError for a malformed address."""
        peer_id = None
        if "@" in text:
            peer_text, text = text.split("@", 1)
            peer_id = b58decode(peer_text)
            if len(peer_id) != 32:
                raise ValueError(f"not a PeerID: {peer_text!r}")
        host, _, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"not HOST:PORT: {text!r}")
        return cls(host, int(port), peer_id)


def dht_id(key: str) -> bytes:
    """Section 8: the id of a user key is SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).digest()


# ---------------------------------------------------------------- section 2: Noise XX


def _hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    temp_key = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp_key, b"\x01", "sha256")
    out2 = hmac.digest(temp_key, out1 + b"\x02", "sha256")
    return out1, out2


def _aesgcm_nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class CipherState:
    """Noise CipherState for AESGCM: 32-byte key, nonce `0000 || u64be(n)`."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self.nonce = 0

    def encrypt(self, ad: bytes, plaintext: bytes) -> bytes:
        if self.key is None:
            return plaintext
        sealed = AESGCM(self.key).encrypt(_aesgcm_nonce(self.nonce), plaintext, ad)
        self.nonce += 1
        return sealed

    def decrypt(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self.key is None:
            return ciphertext
        try:
            opened = AESGCM(self.key).decrypt(_aesgcm_nonce(self.nonce), ciphertext, ad)
        except InvalidTag as exc:
            raise CleanroomError("Noise message failed authentication") from exc
        self.nonce += 1
        return opened


class SymmetricState:
    def __init__(self, protocol_name: bytes) -> None:
        if len(protocol_name) <= 32:
            self.h = protocol_name.ljust(32, b"\0")
        else:
            self.h = hashlib.sha256(protocol_name).digest()
        self.ck = self.h
        self.cipher = CipherState()

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, key = _hkdf2(self.ck, ikm)
        self.cipher = CipherState(key)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        first, second = _hkdf2(self.ck, b"")
        return CipherState(first), CipherState(second)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # low-order point: all-zero shared secret
        raise CleanroomError("invalid X25519 public key") from exc


def identity_payload(identity: Identity, static_public: bytes) -> bytes:
    """Section 2.2: {identity, signature over the context and our static X25519 key}."""
    signature = identity.sign(STATIC_KEY_CONTEXT + static_public)
    return packb({"identity": identity.public_key, "signature": signature})


def verify_identity_payload(payload: bytes, remote_static: bytes) -> bytes:
    """The remote's Ed25519 public key, once its payload passed every check of 2.2.

    Raises:
        CleanroomError: any failed check.
    """
    if len(payload) > 256:
        raise CleanroomError("identity payload over 256 bytes")
    try:
        decoded = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises several types for malformed data
        raise CleanroomError("identity payload is not one msgpack object") from exc
    if not isinstance(decoded, dict) or set(decoded) != {"identity", "signature"}:
        raise CleanroomError(f"identity payload has the wrong keys: {decoded!r}")
    public, signature = decoded["identity"], decoded["signature"]
    if not (isinstance(public, bytes) and len(public) == 32):
        raise CleanroomError("identity is not bin(32)")
    if not (isinstance(signature, bytes) and len(signature) == 64):
        raise CleanroomError("signature is not bin(64)")
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(
            signature, STATIC_KEY_CONTEXT + remote_static
        )
    except InvalidSignature as exc:
        raise CleanroomError("identity signature does not verify") from exc
    return public


class _SocketReader:
    """Exact reads from a blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def read_exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(n - len(self.buffer), 1 << 16))
            if not chunk:
                raise ConnectionClosed("connection closed by the remote")
            self.buffer += chunk
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data


def _send_noise_message(sock: socket.socket, message: bytes) -> None:
    sock.sendall(struct.pack(">H", len(message)) + message)


def _read_noise_message(reader: _SocketReader, limit: int) -> bytes:
    (length,) = struct.unpack(">H", reader.read_exact(2))
    if length > limit:
        raise CleanroomError(f"Noise message of {length} bytes over {limit}")
    return reader.read_exact(length)


@dataclass
class HandshakeResult:
    send: CipherState
    receive: CipherState
    remote_public_key: bytes
    handshake_hash: bytes

    @property
    def remote_peer_id(self) -> bytes:
        return hashlib.sha256(self.remote_public_key).digest()


def initiator_handshake(
    sock: socket.socket,
    reader: _SocketReader,
    identity: Identity,
    expected_peer_id: bytes | None = None,
) -> HandshakeResult:
    """Run the XX handshake as the initiator (section 2.2).

    Raises:
        CleanroomError: the remote's messages are malformed, unauthentic, or prove
            another PeerID than `expected_peer_id`.
    """
    state = SymmetricState(NOISE_PROTOCOL_NAME)
    state.mix_hash(PROLOGUE)
    static = X25519PrivateKey.generate()
    ephemeral = X25519PrivateKey.generate()

    # -> e (empty payload)
    e_public = raw_public(ephemeral.public_key())
    state.mix_hash(e_public)
    _send_noise_message(sock, e_public + state.encrypt_and_hash(b""))

    # <- e, ee, s, es (payload: the responder's identity)
    message = _read_noise_message(reader, MAX_HANDSHAKE_MESSAGE)
    if len(message) < 32 + 32 + TAG_SIZE + TAG_SIZE:
        raise CleanroomError("handshake message 2 too short")
    remote_ephemeral = message[:32]
    state.mix_hash(remote_ephemeral)
    state.mix_key(_dh(ephemeral, remote_ephemeral))
    remote_static = state.decrypt_and_hash(message[32 : 32 + 32 + TAG_SIZE])
    state.mix_key(_dh(ephemeral, remote_static))
    remote_public = verify_identity_payload(
        state.decrypt_and_hash(message[32 + 32 + TAG_SIZE :]), remote_static
    )
    if expected_peer_id is not None and hashlib.sha256(remote_public).digest() != expected_peer_id:
        raise CleanroomError("the responder proved another PeerID than the address names")

    # -> s, se (payload: our identity)
    s_public = raw_public(static.public_key())
    encrypted_static = state.encrypt_and_hash(s_public)
    state.mix_key(_dh(static, remote_ephemeral))
    encrypted_payload = state.encrypt_and_hash(identity_payload(identity, s_public))
    _send_noise_message(sock, encrypted_static + encrypted_payload)

    send, receive = state.split()  # initiator: first encrypts initiator-to-responder
    return HandshakeResult(send, receive, remote_public, state.h)


def responder_handshake(
    sock: socket.socket, reader: _SocketReader, identity: Identity
) -> HandshakeResult:
    """Run the XX handshake as the responder (section 2.2): the side that was dialled.

    Raises:
        CleanroomError: the initiator's messages are malformed or unauthentic.
    """
    state = SymmetricState(NOISE_PROTOCOL_NAME)
    state.mix_hash(PROLOGUE)
    static = X25519PrivateKey.generate()
    ephemeral = X25519PrivateKey.generate()

    # -> e (its payload must be empty)
    message = _read_noise_message(reader, MAX_HANDSHAKE_MESSAGE)
    if len(message) < 32:
        raise CleanroomError("handshake message 1 too short")
    remote_ephemeral = message[:32]
    state.mix_hash(remote_ephemeral)
    if state.decrypt_and_hash(message[32:]):
        raise CleanroomError("handshake message 1 carries a payload")

    # <- e, ee, s, es (payload: our identity)
    e_public = raw_public(ephemeral.public_key())
    state.mix_hash(e_public)
    state.mix_key(_dh(ephemeral, remote_ephemeral))
    s_public = raw_public(static.public_key())
    encrypted_static = state.encrypt_and_hash(s_public)
    state.mix_key(_dh(static, remote_ephemeral))
    encrypted_payload = state.encrypt_and_hash(identity_payload(identity, s_public))
    _send_noise_message(sock, e_public + encrypted_static + encrypted_payload)

    # -> s, se (payload: the initiator's identity)
    message = _read_noise_message(reader, MAX_HANDSHAKE_MESSAGE)
    if len(message) < 32 + TAG_SIZE + TAG_SIZE:
        raise CleanroomError("handshake message 3 too short")
    remote_static = state.decrypt_and_hash(message[: 32 + TAG_SIZE])
    state.mix_key(_dh(ephemeral, remote_static))
    remote_public = verify_identity_payload(
        state.decrypt_and_hash(message[32 + TAG_SIZE :]), remote_static
    )

    receive, send = state.split()  # the first CipherState encrypts initiator-to-responder
    return HandshakeResult(send, receive, remote_public, state.h)


# ---------------------------------------------------------------- sections 2.3, 3: streams


class SecureChannel:
    """Transport messages over a socket, and the frame layer of section 3 on top."""

    def __init__(
        self,
        sock: socket.socket,
        reader: _SocketReader,
        handshake: HandshakeResult,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.sock = sock
        self.reader = reader
        self.handshake = handshake
        self.max_frame_size = max_frame_size
        self.plaintext = bytearray()

    def send_plain(self, data: bytes) -> None:
        """Seal `data` into transport messages of at most 65519 plaintext bytes each."""
        wire = bytearray()
        for start in range(0, len(data), MAX_PLAINTEXT_PER_MESSAGE):
            chunk = data[start : start + MAX_PLAINTEXT_PER_MESSAGE]
            sealed = self.handshake.send.encrypt(b"", chunk)
            wire += struct.pack(">H", len(sealed)) + sealed
        self.sock.sendall(wire)

    def _receive_message(self) -> None:
        sealed = _read_noise_message(self.reader, 65535)
        if len(sealed) < TAG_SIZE:
            raise CleanroomError("transport message shorter than its tag")
        self.plaintext += self.handshake.receive.decrypt(b"", sealed)

    def read_plain(self, n: int) -> bytes:
        while len(self.plaintext) < n:
            self._receive_message()
        data = bytes(self.plaintext[:n])
        del self.plaintext[:n]
        return data

    def send_frame(self, content: bytes) -> None:
        self.send_plain(struct.pack(">I", len(content)) + content)

    def receive_frame(self) -> bytes:
        (length,) = struct.unpack(">I", self.read_plain(4))
        if length > self.max_frame_size:
            raise CleanroomError(f"frame of {length} bytes over {self.max_frame_size}")
        return self.read_plain(length)


# ---------------------------------------------------------------- section 4: RPC frames


def encode_rpc_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """The content of one frame: u32 header length, msgpack header, payload."""
    packed = packb(header)
    return struct.pack(">I", len(packed)) + packed + payload


def request_header(
    request_id: int, method: str, body: dict[str, Any], timeout: float | None = None
) -> dict[str, Any]:
    """A `req` header in the reference key order v, k, id, m, t, b (section 4.4)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": "req", "id": request_id, "m": method}
    if timeout is not None:
        header["t"] = timeout
    header["b"] = body
    return header


def decode_rpc_frame(content: bytes) -> tuple[dict[str, Any], bytes]:
    """Split a frame into its header map and payload, checking the 4.1/4.2 layout.

    Raises:
        CleanroomError: a malformed frame.
    """
    if len(content) < 4:
        raise CleanroomError("RPC frame shorter than its header length")
    (header_length,) = struct.unpack(">I", content[:4])
    if header_length > MAX_HEADER_SIZE or 4 + header_length > len(content):
        raise CleanroomError(f"bad header length {header_length}")
    try:
        header = msgpack.unpackb(
            content[4 : 4 + header_length], raw=False, use_list=False, strict_map_key=False
        )
    except Exception as exc:  # msgpack raises several types for malformed data
        raise CleanroomError("RPC header is not one msgpack object") from exc
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise CleanroomError(f"bad RPC header {header!r}")
    if header.get("k") not in {"req", "res", "item", "end", "err", "cancel", "bye"}:
        raise CleanroomError(f"bad RPC kind in {header!r}")
    return header, content[4 + header_length :]


@dataclass(frozen=True)
class Reply:
    body: dict[str, Any]
    payload: bytes


Handler = Callable[[str, dict[str, Any]], dict[str, Any] | None]


class Connection:
    """One secure connection to a node, with blocking request/reply calls.

    The remote may also call us (it is a full peer); this client serves nothing and
    answers any request with `unknown_method`, as section 4.3 allows.
    """

    def __init__(self, channel: SecureChannel) -> None:
        self.channel = channel
        self.next_id = 0
        self.sock = channel.sock

    @classmethod
    def open(
        cls, address: str, identity: Identity, *, timeout: float = 5.0, verify_peer_id: bool = True
    ) -> Connection:
        """Dial `address`, handshake and return the connection.

        Raises:
            CleanroomError: the handshake failed.
            OSError: the TCP connection failed.
        """
        parsed = Address.parse(address)
        sock = socket.create_connection((parsed.host, parsed.port), timeout=timeout)
        try:
            sock.settimeout(timeout)
            reader = _SocketReader(sock)
            expected = parsed.peer_id if verify_peer_id else None
            handshake = initiator_handshake(sock, reader, identity, expected)
        except BaseException:
            sock.close()
            raise
        return cls(SecureChannel(sock, reader, handshake))

    @classmethod
    def accept(
        cls, listener: socket.socket, identity: Identity, *, timeout: float = 5.0
    ) -> Connection:
        """Accept one connection on `listener` and handshake as the responder.

        Raises:
            CleanroomError: the handshake failed.
            TimeoutError: nobody dialled within `timeout`.
        """
        listener.settimeout(timeout)
        sock, _ = listener.accept()
        try:
            sock.settimeout(timeout)
            reader = _SocketReader(sock)
            handshake = responder_handshake(sock, reader, identity)
        except BaseException:
            sock.close()
            raise
        return cls(SecureChannel(sock, reader, handshake))

    @property
    def remote_peer_id(self) -> bytes:
        return self.channel.handshake.remote_peer_id

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send_raw_frame(self, content: bytes) -> None:
        self.channel.send_frame(content)

    def call(
        self,
        method: str,
        body: dict[str, Any],
        payload: bytes = b"",
        deadline: float | None = None,
    ) -> Reply:
        """Send one request and wait for its `res`.

        Raises:
            RemoteError: the remote answered with `err`.
            CleanroomError: the connection closed or sent something malformed.
        """
        request_id = self.next_id
        self.next_id += 1
        self.send_raw_frame(
            encode_rpc_frame(request_header(request_id, method, body, deadline), payload)
        )
        return self.wait_reply(request_id)

    def wait_reply(self, request_id: int) -> Reply:
        """The reply to `request_id`, answering the remote's own requests on the way.

        Raises:
            RemoteError: the remote answered with `err`.
            CleanroomError: the connection closed or sent something malformed.
        """
        while True:
            header, payload = decode_rpc_frame(self.channel.receive_frame())
            kind = header["k"]
            if kind == "bye":  # 4.3: the remote closes this connection; our call is lost
                raise CleanroomError("the remote said bye before answering")
            if kind == "req":
                self._refuse(header)
                continue
            if kind == "cancel" or header.get("id") != request_id:
                continue
            if kind == "err":
                raise RemoteError(header["code"], header["msg"])
            if kind != "res":
                raise CleanroomError(f"unexpected {kind!r} frame for a plain call")
            return Reply(dict(header["b"]), payload)

    def _refuse(self, request: dict[str, Any]) -> None:
        answer = {"v": PROTOCOL_VERSION, "k": "err", "id": request["id"]}
        answer.update(code="unknown_method", msg="clean-room client serves nothing")
        self.send_raw_frame(encode_rpc_frame(answer))

    def serve(self, answer: Handler, wait: float) -> list[str]:
        """Serve the remote's requests until it goes quiet for `wait` seconds or closes:
        `answer(method, body)` gives the reply body, or None for `unknown_method`.
        Returns the methods asked for, in order."""
        self.sock.settimeout(wait)
        asked = []
        try:
            while True:
                header, _ = decode_rpc_frame(self.channel.receive_frame())
                if header["k"] == "bye":  # 4.3: the remote closes this idle connection
                    return asked
                if header["k"] != "req":
                    continue
                asked.append(header["m"])
                body = answer(header["m"], dict(header["b"]))
                if body is None:
                    self._refuse(header)
                    continue
                reply = {"v": PROTOCOL_VERSION, "k": "res", "id": header["id"], "b": body}
                self.send_raw_frame(encode_rpc_frame(reply))
        except (TimeoutError, ConnectionClosed, ConnectionResetError):
            return asked

    def is_closed_by_remote(self, wait: float = 2.0) -> bool:
        """True when the remote closes the connection (EOF or reset) within `wait` s."""
        self.sock.settimeout(wait)
        try:
            while True:
                self.channel.receive_frame()
        except (ConnectionClosed, ConnectionResetError):
            return True
        except TimeoutError:
            return False


# ---------------------------------------------------------------- sections 5, 6: the DHT


def pack_value(value: Any) -> bytes:
    """The `v` of an entry: the msgpack form of the user's value (str and bin apart)."""
    packed = packb(value)
    if len(packed) > MAX_VALUE_BYTES:
        raise ValueError(f"value of {len(packed)} bytes over {MAX_VALUE_BYTES}")
    return packed


def unpack_value(packed: bytes) -> Any:
    return msgpack.unpackb(packed, raw=False, strict_map_key=False)


Subkey = None | str | int | bytes


def signing_bytes(key_id: bytes, subkey: Subkey, value: bytes, expiration: float) -> bytes:
    """Section 6: the context, then msgpack [K, s, v, x as float64]."""
    body = packb([key_id, subkey, value, float(expiration)])
    return RECORD_CONTEXT + body


def make_entry(
    key: str,
    subkey: Subkey,
    value: Any,
    expiration: float,
    signer: Identity | None = None,
) -> dict[str, Any]:
    """An entry map (section 5); signed by `signer` when given."""
    entry: dict[str, Any] = {"s": subkey, "v": pack_value(value), "x": float(expiration)}
    if signer is not None:
        entry["o"] = signer.public_key
        entry["g"] = signer.sign(signing_bytes(dht_id(key), subkey, entry["v"], expiration))
    return entry


def verify_entry_signature(key_id: bytes, entry: dict[str, Any]) -> bool:
    """True when the entry is unsigned or its signature verifies (rule 5)."""
    if "o" not in entry:
        return True
    data = signing_bytes(key_id, entry["s"], entry["v"], entry["x"])
    try:
        Ed25519PublicKey.from_public_bytes(entry["o"]).verify(entry["g"], data)
    except InvalidSignature:
        return False
    return True


def owned_key(name: str, peer_id_text: str) -> str:
    """Section 6 rule 4: a key only `peer_id_text` may write."""
    return f"{name}[owner:{peer_id_text}]"


@dataclass(frozen=True)
class Node:
    peer_id: bytes
    address: str | None


def _nodes(raw: Any) -> list[Node]:
    return [Node(node["p"], node["a"]) for node in raw]


class DHTClient:
    """The four DHT requests of section 5, in client mode (`sender` nil) by default."""

    def __init__(self, connection: Connection, sender: str | None = None) -> None:
        self.connection = connection
        self.sender = sender

    def _call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        tag = f"{method}.req"
        reply = self.connection.call(method, {"t": tag, "sender": self.sender, **body})
        if reply.body.get("t") != f"{method}.res":
            raise CleanroomError(f"reply to {method} has tag {reply.body.get('t')!r}")
        return reply.body

    def ping(self) -> None:
        self._call("dht.ping", {})

    def find_node(self, target: bytes) -> list[Node]:
        return _nodes(self._call("dht.find_node", {"target": target})["nodes"])

    def find_value_page(
        self, key: str, after: bytes | None = None
    ) -> tuple[list[dict[str, Any]] | None, list[Node], bool]:
        body = self._call("dht.find_value", {"key": dht_id(key), "after": after})
        entries = None if body["entries"] is None else [dict(e) for e in body["entries"]]
        return entries, _nodes(body["nodes"]), body["more"]

    def find_value(self, key: str) -> dict[Subkey, Any] | None:
        """Every live entry under `key` as {subkey: value}, reading all pages; None: nothing.

        Raises:
            CleanroomError: a returned entry whose signature does not verify.
        """
        result: dict[Subkey, Any] = {}
        after: bytes | None = None
        while True:
            entries, _, more = self.find_value_page(key, after)
            if entries is None:
                return result or None
            for entry in entries:
                if not verify_entry_signature(dht_id(key), entry):
                    raise CleanroomError(f"entry {entry['s']!r} under {key!r} is forged")
                result[entry["s"]] = unpack_value(entry["v"])
            if not more:
                return result
            after = packb(entries[-1]["s"])

    def store_entries(
        self, key: str, entries: list[dict[str, Any]], want_nodes: bool = False
    ) -> list[bool]:
        body = {"key": dht_id(key), "name": key, "entries": entries, "want_nodes": want_nodes}
        return list(self._call("dht.store", body)["accepted"])

    def store(
        self,
        key: str,
        value: Any,
        ttl: float = 60.0,
        subkey: Subkey = None,
        signer: Identity | None = None,
    ) -> bool:
        entry = make_entry(key, subkey, value, time.time() + ttl, signer)
        return self.store_entries(key, [entry])[0]


def dht_responder(entries_by_key: dict[bytes, list[dict[str, Any]]]) -> Handler:
    """A DHT node's answers (section 5) that knows nobody, takes every store without
    keeping it, and answers find_value with the canned `entries_by_key` (key id ->
    entries), which may be forged: to check what readers accept."""

    def answer(method: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if method == "dht.ping":
            return {"t": "dht.ping.res"}
        if method == "dht.find_node":
            return {"t": "dht.find_node.res", "nodes": []}
        if method == "dht.find_value":
            entries = entries_by_key.get(body["key"])
            return {"t": "dht.find_value.res", "entries": entries, "nodes": [], "more": False}
        if method == "dht.store":
            accepted = [True] * len(body["entries"])
            return {"t": "dht.store.res", "accepted": accepted, "nodes": []}
        return None

    return answer
