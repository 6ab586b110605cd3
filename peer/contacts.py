"""A bootstrap node's contacts, kept in a file beside its identity file across restarts.

A restarted node keeps its PeerID (the identity file) but knows nobody, and its peers' tables
hold the address it had before. On the same port they find it again; on another port (the
default ``--port 0``) nobody did: a trial's restarted bootstrap node served an empty network
while the volunteers went on averaging among themselves, and every newcomer that joined
through it averaged alone. With this file the node dials the contacts it had, which then
learn its new address, and newcomers meet the swarm through it.

The file is ``IDENTITY_FILE.contacts``, JSON (``{"format": "swarm-contacts/1", "contacts":
["PEERID@HOST:PORT", ...]}``), rewritten whole (a temporary file, then a rename) so that a
node killed while writing leaves the previous version.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import random
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from protocol.address import Address
from protocol.errors import ProtocolError
from protocol.identity import temp_stem

from .dht import DHT

__all__ = [
    "CONTACTS_SUFFIX",
    "MAX_SAVED_CONTACTS",
    "contacts_file",
    "keep_contacts",
    "load_contacts",
    "save_contacts",
]

logger = logging.getLogger(__name__)

CONTACTS_SUFFIX = ".contacts"
FORMAT = "swarm-contacts/1"
MAX_SAVED_CONTACTS = 256
"""More than a routing table holds in all but a huge swarm; a few KiB of file."""
MAX_FILE_BYTES = 1 << 20
"""A larger file is no file of ours: refused unread (a bootstrap node stays under 60 MiB)."""
CHECK_INTERVAL = 1.0
"""How often the routing table is compared with what was saved (cheap: a set of strings)."""
SAVE_INTERVAL = 10.0
"""The least time between two writes once the node has run ``EAGER_FOR`` seconds (a table
changes often under churn)."""
EAGER_FOR = 60.0
"""Seconds after the start during which every change is written within ``CHECK_INTERVAL``:
the table fills up then, and a node killed early must not have saved only its first
contact (a trial: a bootstrap pair killed 9 s after the start; one had saved only the
other, whose address had changed, and came back alone)."""
RETRY_FIRST, RETRY_MAX = 5.0, 300.0
"""Seconds before a saved contact that did not answer is tried again, doubling up to the max."""
FORGET_AFTER = 3600.0
"""A saved contact that has not answered for this long is dropped from the file."""
_STALE_TEMPORARY = 60.0  # seconds: a temporary file this old was left by a killed write


def contacts_file(identity_file: str | os.PathLike[str]) -> Path:
    """Where the node with ``identity_file`` keeps its contacts."""
    path = Path(identity_file)
    return path.with_name(path.name + CONTACTS_SUFFIX)


def load_contacts(path: str | os.PathLike[str]) -> list[Address]:
    """The contacts saved in ``path``: none when there is no such file; none, with a
    warning, when it is no regular file, is larger than ``MAX_FILE_BYTES``, cannot be read
    or is no contacts file (the next save replaces it); entries that are not
    ``PEERID@HOST:PORT`` are skipped with a warning. Temporary files that killed writes
    left beside it are removed."""
    path = Path(path)
    _remove_stale_temporaries(path)
    try:
        text = _read_small_regular_file(path)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the contacts file %s: %s; starting without it", path, exc)
        return []
    try:
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        entries = document.get("contacts")
        if not isinstance(entries, list):
            raise ValueError("no list of contacts")
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError;
        # RecursionError: arrays nested a thousand deep, which fit in a few KiB)
        logger.warning(
            "%s is no contacts file (%s): starting without it (it will be rewritten)", path, exc
        )
        return []
    contacts: list[Address] = []
    skipped = 0
    for entry in entries[:MAX_SAVED_CONTACTS]:
        try:
            address = Address.parse(entry)
        except ProtocolError:
            address = None
        if address is None or address.peer_id is None or address.port == 0:
            skipped += 1
        elif address not in contacts:
            contacts.append(address)
    if skipped:
        logger.warning("%s: skipped %d entries that are not PEERID@HOST:PORT", path, skipped)
    return contacts


def _read_small_regular_file(path: Path) -> bytes:
    """The bytes of ``path`` (a link to a regular file is followed).

    Raises:
        FileNotFoundError: no such file.
        OSError: unreadable.
        ValueError: no regular file (a FIFO would block the read, a device never end), or
            larger than ``MAX_FILE_BYTES``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO: opens, refused below)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, MAX_FILE_BYTES + 1)  # (a regular file: read whole, or to the cap)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data


def _temporary_glob(path: Path) -> str:
    return f".{glob.escape(temp_stem(path))}.*.tmp"


def _remove_stale_temporaries(path: Path) -> None:
    now = time.time()
    for temporary in path.parent.glob(_temporary_glob(path)):
        try:
            if now - temporary.lstat().st_mtime > _STALE_TEMPORARY:
                temporary.unlink()
        except OSError:
            continue


def save_contacts(path: str | os.PathLike[str], contacts: Sequence[Address]) -> None:
    """Write ``contacts`` (the first ``MAX_SAVED_CONTACTS``) to ``path`` (mode 0600: who
    takes part is nobody else's business): to a new temporary file in the same directory
    first (``.NAME.PID.tmp``), flushed to disk, then renamed over ``path``.

    Raises:
        OSError: the file cannot be written (``path`` is then unchanged).
    """
    path = Path(path)
    entries = [str(a) for a in contacts[:MAX_SAVED_CONTACTS]]
    data = json.dumps({"format": FORMAT, "contacts": entries}, indent=1).encode() + b"\n"
    # A name of this process's own, made anew each time: what a killed write of ours left
    # is removed first, and a link found there is removed, never written through.
    temporary = path.with_name(f".{temp_stem(path)}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _table_texts(dht: DHT) -> list[str]:
    """The routing table's contacts as ``PEERID@HOST:PORT`` (no parsing: checked each second)."""
    return [f"{peer_id}@{hostport}" for peer_id, hostport in dht.routing_table_peers()]


def _peer_ids(texts: Sequence[str]) -> set[str]:
    """The PeerID part of each ``PEERID@HOST:PORT``."""
    return {text.partition("@")[0] for text in texts}


def _parsed(texts: Sequence[str]) -> list[Address]:
    contacts = []
    for text in texts:
        try:
            contacts.append(Address.parse(text))
        except ProtocolError:  # (the table holds parsed addresses: not expected)
            continue
    return contacts


class _Untried:
    """Contacts to dial until they answer, kept in the file meanwhile: the saved ones, at a
    start (a node restarted while its own network was down, a reboot, must not forget its
    swarm at its first save), and those that left the routing table of a running node (a
    node cut off from its peers loses them all, at once or one by one, and its first
    newcomer must not replace them). Each is tried again after ``RETRY_FIRST`` seconds,
    doubling up to ``RETRY_MAX``, and dropped once it has not answered for
    ``FORGET_AFTER``; at most ``MAX_SAVED_CONTACTS``, the oldest dropped."""

    def __init__(self) -> None:
        self._rng = random.Random()
        # text -> (address, next try, current delay, first try)
        self.pending: dict[str, tuple[Address, float, float, float]] = {}
        self.added = trio.Event()

    def add(self, addresses: Sequence[Address], now: float, wait: float = 0.0) -> None:
        """Add ``addresses`` (those already in keep their schedule), tried in ``wait`` s."""
        for address in addresses:
            self.pending.setdefault(str(address), (address, now + wait, RETRY_FIRST, now))
        while len(self.pending) > MAX_SAVED_CONTACTS:
            del self.pending[next(iter(self.pending))]
        self.added.set()

    def due(self, now: float) -> list[Address]:
        return [entry[0] for entry in self.pending.values() if entry[1] <= now]

    def settle(self, peer_ids: set[str]) -> None:
        """Drop those whose PeerID is in the table again (back on their own, or at another
        address: dialing the old one would reach the peer over its pooled connection,
        answer, and put the dead address back in the table, a review found)."""
        for text in [t for t in self.pending if t.partition("@")[0] in peer_ids]:
            del self.pending[text]

    def tried(self, addresses: Sequence[Address], now: float) -> None:
        """Schedule the next try of those of ``addresses`` still pending (call
        :meth:`settle` first: one that answered into a full bucket's replacement cache,
        not the table, stays pending, or it would be in neither the table nor the file)."""
        for address in addresses:
            text = str(address)
            entry = self.pending.pop(text, None)
            if entry is None or now - entry[3] >= FORGET_AFTER:
                continue
            _, _, delay, first = entry
            wait = delay * self._rng.uniform(0.75, 1.25)
            self.pending[text] = (address, now + wait, min(2 * delay, RETRY_MAX), first)

    def next_try(self) -> float:
        return min(entry[1] for entry in self.pending.values())


async def _try_untried(dht: DHT, untried: _Untried, path: Path) -> None:
    """Dial the untried contacts when due (see DHT.contact), forever."""
    first = True
    while True:
        untried.added = trio.Event()
        untried.settle(_peer_ids(_table_texts(dht)))
        due = untried.due(trio.current_time())
        if due:
            answered = await dht.contact(due)
            untried.settle(_peer_ids(_table_texts(dht)))
            untried.tried(due, trio.current_time())
            level = logging.INFO if first or answered else logging.DEBUG
            text = "%d of %d saved or lost contacts answered (%s)"
            logger.log(level, text, len(answered), len(due), path)
            first = False
        with trio.move_on_at(untried.next_try() if untried.pending else math.inf):
            await untried.added.wait()


async def keep_contacts(
    dht: DHT,
    path: str | os.PathLike[str],
    saved: Sequence[Address],
    *,
    check_interval: float = CHECK_INTERVAL,
    save_interval: float = SAVE_INTERVAL,
) -> None:
    """Dial the ``saved`` contacts, and those that do not answer again later (see
    :class:`_Untried`); save the routing table's contacts, with the untried ones, to
    ``path`` whenever they changed: within ``check_interval`` for the first ``EAGER_FOR``
    seconds, then at most once per ``save_interval``, and once more when cancelled. Runs
    until cancelled.

    An empty list is never saved, and contacts that leave the table join the untried (a
    node cut off for a while keeps the contacts it had). A file that cannot be written is
    said once, at WARNING, and tried again each ``save_interval``; the node goes on
    without it.
    """
    path = Path(path)
    eager_until = trio.current_time() + EAGER_FOR
    untried = _Untried()
    untried.add(saved, trio.current_time())
    written: list[str] = []
    last_table: list[str] = []
    last_write = -math.inf
    failed = False

    def changed() -> list[str] | None:
        nonlocal last_table
        table = _table_texts(dht)
        in_table = _peer_ids(table)
        # (by PeerID: one whose address changed has not left; the DHT pings those that
        # left again soon itself, ours come later)
        left = [text for text in last_table if text.partition("@")[0] not in in_table]
        if left:
            untried.add(_parsed(left), trio.current_time(), RETRY_FIRST)
        untried.settle(in_table)
        last_table = table
        texts = list(dict.fromkeys([*table, *untried.pending]))
        return texts if texts and set(texts) != set(written) else None

    def write(texts: list[str]) -> None:
        nonlocal written, failed
        try:
            save_contacts(path, _parsed(texts))
        except OSError as exc:
            if not failed:
                logger.warning("cannot save contacts to %s: %s", path, exc)
            failed = True
        else:
            written, failed = texts, False

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_try_untried, dht, untried, path)
            while True:
                texts = changed()
                now = trio.current_time()
                gap = 0.0 if now < eager_until and not failed else save_interval
                if texts is not None and now - last_write >= gap:
                    last_write = now  # (a failed write waits as long)
                    # (on the loop: 0.6 ms for 20 contacts, 1.9 ms for 256, fsync included,
                    # here; in a thread, virtual-time tests raced it)
                    write(texts)
                await trio.sleep(check_interval)
    finally:
        # (here, synchronous: the node's shutdown is cancelling us, and the table is
        # still whole; a few milliseconds at most)
        if (texts := changed()) is not None:
            write(texts)
