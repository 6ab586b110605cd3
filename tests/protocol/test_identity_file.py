"""Key files: written only through a fresh temp file, published atomically, never via a link."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol import Identity, IdentityFileError, PeerID
from protocol.identity import STALE_TEMP_AGE

SEED = bytes(range(32))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.mark.parametrize("create", [True, False], ids=["load_or_create", "save"])
def test_a_planted_link_at_path_tmp_is_not_followed(tmp_path: Path, create: bool) -> None:
    path = tmp_path / "node.key"
    leak = tmp_path / "leak.txt"
    leak.write_bytes(b"")
    leak.chmod(0o644)
    (tmp_path / "node.key.tmp").symlink_to(leak.name)  # another local user's trap

    identity = Identity.load_or_create(path) if create else Identity.from_seed(SEED)
    if not create:
        identity.save(path)

    assert leak.read_bytes() == b""  # the seed went nowhere near the link
    assert not path.is_symlink() and path.read_bytes() == identity.seed()
    assert _mode(path) == 0o600
    assert (tmp_path / "node.key.tmp").is_symlink()  # left as it was
    assert _names(tmp_path) == {"node.key", "node.key.tmp", "leak.txt"}  # no temp left


@pytest.mark.parametrize("create", [True, False], ids=["load_or_create", "save"])
def test_a_stale_world_readable_path_tmp_does_not_lend_its_mode(
    tmp_path: Path, create: bool
) -> None:
    path = tmp_path / "node.key"
    stale = tmp_path / "node.key.tmp"
    stale.write_bytes(b"stale")
    stale.chmod(0o644)

    if create:
        Identity.load_or_create(path)
    else:
        Identity.from_seed(SEED).save(path)

    assert _mode(path) == 0o600
    assert stale.read_bytes() == b"stale" and _mode(stale) == 0o644
    assert _names(tmp_path) == {"node.key", "node.key.tmp"}


def test_save_replaces_a_link_at_path_instead_of_writing_through_it(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    path = tmp_path / "node.key"
    path.symlink_to(target.name)
    Identity.from_seed(SEED).save(path)
    assert target.read_bytes() == b"keep"
    assert not path.is_symlink() and path.read_bytes() == SEED and _mode(path) == 0o600


def test_created_with_mode_0600_even_under_umask_0777(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        identity = Identity.load_or_create(tmp_path / "k")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "k") == 0o600
    assert Identity.load(tmp_path / "k").peer_id == identity.peer_id


@pytest.mark.parametrize("create", [True, False], ids=["load_or_create", "save"])
def test_an_unwritable_place_is_reported_under_the_name_given(tmp_path: Path, create: bool) -> None:
    path = tmp_path / "no" / "such" / "dir" / "x.key"
    with pytest.raises(FileNotFoundError) as error:
        if create:
            Identity.load_or_create(path)
        else:
            Identity.from_seed(SEED).save(path)
    assert error.value.filename == str(path)
    assert str(error.value) == f"[Errno 2] No such file or directory: {str(path)!r}"


def test_a_file_created_meanwhile_by_another_process_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race, made deterministic: the other creator publishes between our check that
    the file is missing and our publishing; we end with its key, and nothing is overwritten."""
    path = tmp_path / "node.key"
    other = Identity.from_seed(SEED)
    real_write_temp = Identity._write_temp

    def write_temp_while_another_creates(self: Identity, target: Path) -> Path:
        tmp = real_write_temp(self, target)
        path.write_bytes(other.seed())  # the other process got there first
        return tmp

    monkeypatch.setattr(Identity, "_write_temp", write_temp_while_another_creates)
    assert Identity.load_or_create(path).peer_id == other.peer_id
    assert path.read_bytes() == SEED
    assert _names(tmp_path) == {"node.key"}


def _create_all_at_once(path: Path, creators: int) -> list[PeerID]:
    start = threading.Barrier(creators)
    ids: list[PeerID] = []

    def create() -> None:
        start.wait(timeout=10)
        ids.append(Identity.load_or_create(path).peer_id)

    threads = [threading.Thread(target=create) for _ in range(creators)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    return ids


def test_concurrent_creators_all_end_with_the_same_identity(tmp_path: Path) -> None:
    for round_ in range(20):
        path = tmp_path / f"node{round_}.key"
        ids = _create_all_at_once(path, 8)
        assert len(ids) == 8 and len(set(ids)) == 1
        assert Identity.load(path).peer_id == ids[0]
    assert all(not name.endswith(".tmp") for name in _names(tmp_path))


@pytest.mark.parametrize("content", [b"", b"\x00" * 31, b"\x00" * 33])
def test_loading_stays_strict_and_never_rewrites(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityFileError, match="identity file"):
        Identity.load_or_create(path)
    assert path.read_bytes() == content


def test_a_link_to_a_missing_file_is_named_not_reported_missing(tmp_path: Path) -> None:
    """Said before: "No such file or directory" about a path that exists (as a link)."""
    path = tmp_path / "node.key"
    target = tmp_path / "elsewhere" / "real.key"
    path.symlink_to(target)
    with pytest.raises(IdentityFileError) as error:
        Identity.load_or_create(path)
    assert str(error.value).startswith(f"identity file {path} is a link to {target}, which does")
    assert not target.exists() and path.is_symlink()  # nothing written through the link
    assert _names(tmp_path) == {"node.key"}


def test_a_link_to_an_existing_key_is_loaded(tmp_path: Path) -> None:
    target = tmp_path / "real.key"
    Identity.from_seed(SEED).save(target)
    path = tmp_path / "node.key"
    path.symlink_to(target)
    assert Identity.load_or_create(path).peer_id == Identity.from_seed(SEED).peer_id


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """Was a start-up that hung in open(), deaf to SIGTERM (the read blocks the event loop)."""
    path = tmp_path / "node.key"
    os.mkfifo(path)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            Identity.load_or_create(path)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(timeout=10)
    if loader.is_alive():  # the old behaviour: unblock it with a writer, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        loader.join(timeout=10)
        pytest.fail("loading a FIFO waited for a writer")
    assert [str(e) for e in errors] == [f"identity file {path} is not a regular file"]
    assert isinstance(errors[0], IdentityFileError)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_is_refused_without_reading_it_to_the_end() -> None:
    """Was a read of /dev/zero without end: memory until a MemoryError traceback. In a
    child process with 1 GiB of address space, so that the old behaviour fails, bounded."""
    code = (
        "from protocol import Identity, IdentityFileError\n"
        "try:\n"
        "    Identity.load_or_create('/dev/zero')\n"
        "except IdentityFileError as exc:\n"
        "    print(exc)\n"
    )

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=limit_memory,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert (out.returncode, out.stdout) == (0, "identity file /dev/zero is not a regular file\n")


def test_a_directory_is_reported_as_one(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError) as error:
        Identity.load_or_create(tmp_path)
    assert error.value.filename == str(tmp_path)


def test_a_large_file_is_refused_by_its_size_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "big.key"
    with path.open("wb") as big:
        big.truncate(1 << 26)  # sparse: 64 MiB that cost no disk
    with pytest.raises(IdentityFileError) as error:
        Identity.load(path)
    assert str(error.value).startswith(f"identity file {path} holds {1 << 26} bytes, expected 32:")
    assert "not a PEM, OpenSSH or hex key" in str(error.value)


def test_a_leftover_temp_key_of_a_killed_writer_is_removed_at_the_next_start(
    tmp_path: Path,
) -> None:
    """A process killed between writing its temp key and linking it left a copy of a private
    key next to the key file for good (an operator trial); the next start removes such
    leftovers once they are older than a writer ever keeps one, and nothing else."""
    path = tmp_path / "id.key"
    old = tmp_path / f".id.key.{'ab' * 6}.tmp"
    fresh = tmp_path / f".id.key.{'cd' * 6}.tmp"  # another writer's, right now
    other = tmp_path / f".other.key.{'ef' * 6}.tmp"
    for leftover in (old, fresh, other):
        leftover.write_bytes(b"k" * 32)
    stale = time.time() - 2 * STALE_TEMP_AGE
    os.utime(old, (stale, stale))
    os.utime(other, (stale, stale))
    identity = Identity.load_or_create(path)
    assert not old.exists()
    assert fresh.exists() and other.exists()
    assert Identity.load_or_create(path).peer_id == identity.peer_id
    os.utime(fresh, (stale, stale))
    identity.save(path)
    assert not fresh.exists() and other.exists()


def test_a_path_ending_with_a_separator_is_a_folder_not_a_file(tmp_path: Path) -> None:
    """``--identity keys/`` made a key file named ``keys`` (an outside tester): the folder
    the operator meant is named in the error instead, and nothing is created."""
    folder = f"{tmp_path}/keys/"
    with pytest.raises(IdentityFileError, match=r"keys/ names a folder.*keys/swarm.key"):
        Identity.load_or_create(folder)
    for name in ("keys/.", "keys/..", "."):  # Path() drops those too
        with pytest.raises(IdentityFileError, match="names a folder"):
            Identity.load_or_create(f"{tmp_path}/{name}")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_path_is_refused_as_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_peer(identity="")`` said "identity path  names a folder" (an outside tester):
    the error says the path is empty, as the CLI's ``--identity ''`` does."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(IdentityFileError, match=r"^identity path is empty: .*e\.g\. swarm\.key$"):
        Identity.load_or_create("")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("length", [238, 255])
def test_a_key_file_with_the_longest_names_a_folder_takes_is_created(
    tmp_path: Path, length: int
) -> None:
    """Its temp file, `.NAME.<12 hex>.tmp`, went past the 255 characters of a file name:
    names of 238 to 255 characters failed with "File name too long" (an outside tester).
    The temp name carries the first 200 characters; leftovers are still found."""
    path = tmp_path / ("k" * length)
    identity = Identity.load_or_create(path)
    assert Identity.load_or_create(path).peer_id == identity.peer_id
    leftover = tmp_path / f".{'k' * 200}.{'ab' * 6}.tmp"
    leftover.write_bytes(b"k" * 32)
    stale = time.time() - 2 * STALE_TEMP_AGE
    os.utime(leftover, (stale, stale))
    identity.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
