"""Key files: written only through a fresh temp file, published atomically, never via a link."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from protocol import Identity, IdentityFileError, PeerID

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
