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
CHECK_INTERVAL = 1.0
"""How often the routing table is compared with what was saved (cheap: a set of strings)."""
SAVE_INTERVAL = 10.0
"""The least time between two writes after the first (a table changes often under churn)."""


def contacts_file(identity_file: str | os.PathLike[str]) -> Path:
    """Where the node with ``identity_file`` keeps its contacts."""
    path = Path(identity_file)
    return path.with_name(path.name + CONTACTS_SUFFIX)


def load_contacts(path: str | os.PathLike[str]) -> list[Address]:
    """The contacts saved in ``path``: none when there is no such file; none, with a
    warning, when it cannot be read or is no contacts file (the next save replaces it);
    entries that are not ``PEERID@HOST:PORT`` are skipped with a warning."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("cannot read the contacts file %s: %s; starting without it", path, exc)
        return []
    try:
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        entries = document.get("contacts")
        if not isinstance(entries, list):
            raise ValueError("no list of contacts")
    except ValueError as exc:  # (json's errors, UnicodeDecodeError too, are ValueErrors)
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


def save_contacts(path: str | os.PathLike[str], contacts: Sequence[Address]) -> None:
    """Write ``contacts`` (the first ``MAX_SAVED_CONTACTS``) to ``path``: to ``path.tmp``
    first, flushed to disk, then renamed over ``path``.

    Raises:
        OSError: the file cannot be written (``path`` is then unchanged).
    """
    path = Path(path)
    entries = [str(a) for a in contacts[:MAX_SAVED_CONTACTS]]
    data = json.dumps({"format": FORMAT, "contacts": entries}, indent=1).encode() + b"\n"
    temporary = path.with_name(path.name + ".tmp")
    # a new file each time: a stale one (a killed write) is removed, and a link found
    # there is removed, never written through
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
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


async def keep_contacts(
    dht: DHT,
    path: str | os.PathLike[str],
    saved: Sequence[Address],
    *,
    check_interval: float = CHECK_INTERVAL,
    save_interval: float = SAVE_INTERVAL,
) -> None:
    """Dial the ``saved`` contacts (see :meth:`DHT.contact`), then save the routing table's
    contacts to ``path`` whenever they changed: at once the first time, then at most once
    per ``save_interval``, and once more when cancelled. Runs until cancelled.

    An empty table is never saved (a node cut off for a while keeps the contacts it had),
    nor anything before the saved contacts were tried (a table still filling up would
    replace a longer list). A file that cannot be written is said once, at WARNING; the
    node goes on without it.
    """
    if saved:
        answered = await dht.contact(saved)
        logger.info("%d of %d saved contacts answered (%s)", answered, len(saved), path)
    written: set[str] | None = None
    last_write = -float("inf")
    failed = False

    def save_if_changed() -> None:
        nonlocal written, last_write, failed
        contacts = _table_contacts(dht)
        texts = {str(a) for a in contacts}
        if not texts or texts == written:
            return
        try:
            save_contacts(path, contacts)
        except OSError as exc:
            if not failed:
                logger.warning("cannot save contacts to %s: %s", path, exc)
            failed = True
            return
        written, last_write, failed = texts, trio.current_time(), False

    try:
        while True:
            if written is None or trio.current_time() - last_write >= save_interval:
                save_if_changed()
            await trio.sleep(check_interval)
    finally:
        save_if_changed()  # (synchronous: runs while the node's shutdown is cancelling us)
