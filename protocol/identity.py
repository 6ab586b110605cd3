"""Peer identities: Ed25519 key pairs and the PeerIDs derived from them.

A PeerID is the SHA-256 of the raw 32-byte Ed25519 public key, shown in base58.
Key files hold the raw 32-byte private seed, created with mode 0600.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .base58 import b58decode, b58encode
from .errors import ProtocolError, SwarmError

PEER_ID_LENGTH = 32
PUBLIC_KEY_LENGTH = 32
SIGNATURE_LENGTH = 64
_SEED_LENGTH = 32
_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
# non-blocking: opening a FIFO must not wait for a writer; no tty becomes ours either
_OPEN_KEY = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


@dataclass(frozen=True, slots=True, order=True)
class PeerID:
    """A peer's identity: SHA-256 of its Ed25519 public key (32 bytes)."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PEER_ID_LENGTH:
            raise ProtocolError(f"a PeerID is {PEER_ID_LENGTH} bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        """Derive the PeerID of a raw 32-byte Ed25519 public key.

        Raises:
            ProtocolError: if the key is not 32 bytes.
        """
        if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_LENGTH:
            raise ProtocolError(f"an Ed25519 public key is {PUBLIC_KEY_LENGTH} bytes")
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse the base58 form.

        Raises:
            ProtocolError: if the text is not base58 of exactly 32 bytes.
        """
        raw = b58decode(text)
        if len(raw) != PEER_ID_LENGTH:
            raise ProtocolError(f"PeerID {text!r} does not decode to {PEER_ID_LENGTH} bytes")
        return cls(raw)

    def to_base58(self) -> str:
        return b58encode(self.raw)

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    # Written out (the dataclass would hash and compare a tuple of the fields): PeerIDs key
    # the routing table, every lookup and every connection, hundreds of times per DHT get.
    def __hash__(self) -> int:
        return hash(self.raw)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is PeerID:
            return self.raw == other.raw
        return NotImplemented

    def short(self) -> str:
        """A few leading characters, for logs."""
        return self.to_base58()[:8]


_P_MINUS_1 = bytes([0xEC]) + b"\xff" * 30 + bytes([0x7F])
SMALL_ORDER_POINTS = frozenset(
    {
        bytes(32),  # y = 0 (order 4)
        b"\x01" + bytes(31),  # the identity, y = 1
        bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
        bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
        _P_MINUS_1,  # y = -1 (order 2)
        bytes([0xED]) + _P_MINUS_1[1:],  # y = p, read as 0
        bytes([0xEE]) + _P_MINUS_1[1:],  # y = p + 1, read as 1
    }
)
"""Encodings of the Ed25519 points of order 1, 2, 4 and 8 (sign bit cleared), as
libsodium refuses them: with such a key, or such an R, a signature verifies without any
private key (the identity as the key, R the identity and S = 0 verify for every message:
anyone could claim that key's PeerID and write its owned records; a security review)."""


def has_small_order(encoding: bytes) -> bool:
    """Whether a 32-byte point encoding is one of :data:`SMALL_ORDER_POINTS`, either sign."""
    return encoding[:31] + bytes([encoding[31] & 0x7F]) in SMALL_ORDER_POINTS


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``.
    A key or an R (the signature's first half) of small order is refused, whatever the
    rest (see :data:`SMALL_ORDER_POINTS`)."""
    if len(public_key) != PUBLIC_KEY_LENGTH or len(signature) != SIGNATURE_LENGTH:
        return False
    if has_small_order(bytes(public_key)) or has_small_order(bytes(signature[:32])):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError):
        return False
    return True


class IdentityFileError(SwarmError):
    """A key file exists but does not hold a key (wrong size), or is a dangling link; or
    the path is empty or names a folder."""


class Identity:
    """An Ed25519 key pair: signs handshakes and DHT records."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: PeerID = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests, reproducible ids)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(bytes(data))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the private seed to ``path`` with mode 0600, atomically: a fresh temp file
        in the same directory, then a rename over ``path`` (a link there is replaced, never
        followed).

        Raises:
            OSError: if the file cannot be written; it names ``path``.
        """
        path = Path(path)
        _remove_stale_temps(path)
        tmp = self._write_temp(path)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _naming(exc, path) from exc
        finally:
            _remove(tmp)
        _sync_directory(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a key file written by :meth:`save`.

        Raises:
            IdentityFileError: if the file does not hold a 32-byte seed, or is no regular
                file (a FIFO, a device: never waited on, never read without end).
            OSError: if it cannot be read (FileNotFoundError when missing,
                IsADirectoryError for a directory).
        """
        return cls.from_seed(_read_seed(Path(path)))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key file, or create it (mode 0600) when it is missing.

        Creation never overwrites: when two processes create the same file at once, the
        first one's key is published whole (temp file, then a hard link to ``path``) and
        both end with it.

        Raises:
            IdentityFileError: if the file exists but is not a valid key file, or is a
                link to a missing file; or ``path`` is empty or names a folder (it ends
                with a path separator, ``.`` or ``..``).
            OSError: if it cannot be read or created; it names ``path``.
        """
        text = os.fspath(path)
        if not text:  # Path("") is the current folder: the error below would name nothing
            raise IdentityFileError(
                "identity path is empty: give the key file's path, e.g. swarm.key"
            )
        # Path() drops a trailing "/" or "/.": "keys/" would make a file named "keys"
        if os.path.basename(text) in ("", ".", ".."):
            raise IdentityFileError(
                f"identity path {text} names a folder: give the key file's path in it, "
                f"e.g. {os.path.join(text, 'swarm.key')}"
            )
        path = Path(path)
        _remove_stale_temps(path)
        try:
            return cls.load(path)
        except FileNotFoundError:
            pass
        identity = cls.generate()
        tmp = identity._write_temp(path)
        try:
            os.link(tmp, path)  # unlike a rename, fails when ``path`` appeared meanwhile
        except FileExistsError:
            return cls._load_existing(path)  # another process was first: its key, whole
        except OSError as exc:
            raise _naming(exc, path) from exc
        finally:
            _remove(tmp)
        _sync_directory(path)
        return identity

    @classmethod
    def _load_existing(cls, path: Path) -> Identity:
        """Load ``path``, which creating it found to exist.

        Raises:
            IdentityFileError: if it is a link to a missing file (never written through);
                as :meth:`load` otherwise.
        """
        try:
            return cls.load(path)
        except FileNotFoundError:
            if not path.is_symlink():
                raise  # removed again meanwhile
            raise IdentityFileError(
                f"identity file {path} is a link to {os.readlink(path)}, which does not exist"
                " (a key is never created through a link: give the target's path instead)"
            ) from None

    def _write_temp(self, path: Path) -> Path:
        """The seed in a new file (mode 0600) next to ``path``, fsynced: never an existing
        file, never through a link (O_EXCL), so nothing planted there is written to.

        Raises:
            OSError: naming ``path``, e.g. when its directory is missing or read-only.
        """
        for _ in range(100):
            tmp = path.with_name(f".{temp_stem(path)}.{os.urandom(6).hex()}.tmp")
            try:
                fd = os.open(tmp, _CREATE_NEW, 0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _naming(exc, path) from exc
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                if os.write(fd, self.seed()) != _SEED_LENGTH:
                    raise OSError(errno.EIO, "short write")
                os.fsync(fd)
            except OSError as exc:
                _remove(tmp)
                raise _naming(exc, path) from exc
            finally:
                os.close(fd)
            return tmp
        raise FileExistsError(errno.EEXIST, "no free temporary file name", os.fspath(path))

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


def temp_stem(path: Path) -> str:
    """The part of ``path``'s name that its temp files' names carry: at most 200
    characters, so that ``.STEM.<12 hex digits>.tmp`` fits the 255 a file name may have (a
    key file named with 238 to 255 characters could not be created: an outside tester)."""
    return path.name[:200]


STALE_TEMP_AGE = 60.0
"""Seconds after which a temp key file next to ``path`` is a leftover: a writer keeps its
own for the milliseconds between writing it and linking or renaming it."""


def _remove_stale_temps(path: Path) -> None:
    """Remove the temp files (copies of a private key) that a process killed while creating
    or saving ``path`` left behind; older than STALE_TEMP_AGE, so never another writer's."""
    pattern = re.compile(rf"\.{re.escape(temp_stem(path))}\.[0-9a-f]{{12}}\.tmp")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return  # (a missing directory: creating the file will say so)
    now = time.time()
    for name in names:
        if not pattern.fullmatch(name):
            continue
        leftover = path.with_name(name)
        try:
            if now - leftover.lstat().st_mtime > STALE_TEMP_AGE:
                leftover.unlink()
        except OSError:
            pass  # gone meanwhile, or not ours to remove: it harms nobody


def _read_seed(path: Path) -> bytes:
    """The 32 bytes of a key file, reading at most one more.

    Raises:
        IdentityFileError, OSError: as :meth:`Identity.load`.
    """
    fd = os.open(path, _OPEN_KEY)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(info.st_mode):
            raise IdentityFileError(f"identity file {path} is not a regular file")
        data = b""
        while len(data) <= _SEED_LENGTH:
            chunk = os.read(fd, _SEED_LENGTH + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) != _SEED_LENGTH:
        size = len(data) if len(data) < _SEED_LENGTH else max(len(data), info.st_size)
        raise IdentityFileError(
            f"identity file {path} holds {size} bytes, expected {_SEED_LENGTH}: the raw Ed25519 "
            "seed that swarm writes there when the file does not exist (not a PEM, OpenSSH "
            "or hex key)"
        )
    return data


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` about ``path``, the name the user gave (not a temp file's)."""
    return OSError(exc.errno, exc.strerror, os.fspath(path))


def _remove(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _sync_directory(path: Path) -> None:
    """Make the new directory entry durable (best effort: not every system can)."""
    with suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
