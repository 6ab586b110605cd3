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

import json
import logging
import os
import random
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from protocol.address import Address
from protocol.errors import ProtocolError

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
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data


def _temporary_glob(path: Path) -> str:
    return f".{path.name}.*.tmp"


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
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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


def _table_contacts(dht: DHT) -> list[Address]:
    contacts = []
    for peer_id, hostport in dht.routing_table_peers():
        try:
            contacts.append(Address.parse(hostport).with_peer_id(peer_id))
        except ProtocolError:  # (the table holds parsed addresses: not expected)
            continue
    return contacts


class _SavedContacts:
    """The saved contacts that have not answered yet: when each is tried next, and since
    when it has not answered. They stay in the file meanwhile, so that a node restarted
    while its own network was down (a reboot) does not forget its swarm at its first save."""

    def __init__(self, saved: Sequence[Address], now: float) -> None:
        self._rng = random.Random()
        # address -> (next try, current delay, first try)
        self.pending = {a: (now, RETRY_FIRST, now) for a in saved}

    def due(self, now: float) -> list[Address]:
        return [a for a, (at, _, _) in self.pending.items() if at <= now]

    def tried(self, addresses: Sequence[Address], answered: Sequence[Address], now: float) -> None:
        for address in addresses:
            _, delay, first = self.pending.pop(address)
            if address in answered or now - first >= FORGET_AFTER:
                continue
            wait = delay * self._rng.uniform(0.75, 1.25)
            self.pending[address] = (now + wait, min(2 * delay, RETRY_MAX), first)

    def next_try(self) -> float:
        return min(at for at, _, _ in self.pending.values())


async def _try_saved(dht: DHT, saved: _SavedContacts, path: Path) -> None:
    """Dial the saved contacts until each answered or was dropped (see DHT.contact)."""
    first = True
    while saved.pending:
        now = trio.current_time()
        due = saved.due(now)
        if due:
            answered = await dht.contact(due)
            saved.tried(due, answered, trio.current_time())
            level = logging.INFO if first else logging.DEBUG
            text = "%d of %d saved contacts answered (%s)"
            logger.log(level, text, len(answered), len(due), path)
            first = False
        if saved.pending:
            await trio.sleep_until(saved.next_try())


async def keep_contacts(
    dht: DHT,
    path: str | os.PathLike[str],
    saved: Sequence[Address],
    *,
    check_interval: float = CHECK_INTERVAL,
    save_interval: float = SAVE_INTERVAL,
) -> None:
    """Dial the ``saved`` contacts, and those that do not answer again later (after
    ``RETRY_FIRST`` seconds, doubling up to ``RETRY_MAX``, for up to ``FORGET_AFTER``); save
    the routing table's contacts, with the saved ones not yet answered, to ``path``
    whenever they changed: within ``check_interval`` for the first ``EAGER_FOR`` seconds,
    then at most once per ``save_interval``, and once more when cancelled. Runs until
    cancelled.

    An empty list is never saved (a node cut off for a while keeps the contacts it had). A
    file that cannot be written is said once, at WARNING, and tried again each
    ``save_interval``; the node goes on without it.
    """
    path = Path(path)
    eager_until = trio.current_time() + EAGER_FOR
    untried = _SavedContacts(saved, trio.current_time())
    written: set[str] | None = None
    last_write = -float("inf")
    failed = False

    def changed() -> list[Address] | None:
        contacts = _table_contacts(dht)
        contacts += [a for a in untried.pending if a not in contacts]
        texts = {str(a) for a in contacts}
        return contacts if texts and texts != written else None

    def saved_now(contacts: list[Address]) -> None:
        nonlocal written, failed
        written, failed = {str(a) for a in contacts}, False

    def failure(exc: OSError) -> None:
        nonlocal failed
        if not failed:
            logger.warning("cannot save contacts to %s: %s", path, exc)
        failed = True

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_try_saved, dht, untried, path)
            while True:
                contacts = changed()
                now = trio.current_time()
                gap = 0.0 if now < eager_until and not failed else save_interval
                if contacts is not None and now - last_write >= gap:
                    last_write = trio.current_time()  # (a failed write waits as long)
                    try:  # (on the loop, ~1 ms: in a thread, virtual-time tests raced it)
                        save_contacts(path, contacts)
                    except OSError as exc:
                        failure(exc)
                    else:
                        saved_now(contacts)
                await trio.sleep(check_interval)
    finally:
        # (here, synchronous: the node's shutdown is cancelling us, and the table is
        # still whole; a few milliseconds at most)
        if (contacts := changed()) is not None:
            try:
                save_contacts(path, contacts)
            except OSError as exc:
                failure(exc)
