"""Suite-wide set-up."""

from __future__ import annotations

import signal

import pytest

# A suite started in the background by a non-interactive shell (`make check &`, nohup)
# inherits SIGINT ignored, and so would every command the tests start: Python then installs
# no KeyboardInterrupt handler, and the tests that stop an example with Ctrl-C would fail.
# A handler here makes the commands start with SIGINT's default action (exec resets caught
# signals, not ignored ones); the tests of an ignored SIGINT set it themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_the_file_limit(wanted: int = 16384) -> None:
    """Some tests hold thousands of loopback connections in this one process (50 TCP peers
    meshed, a 1,000-connection flood): both ends of each are our descriptors. Under the
    common soft limit of 1024 they failed with EMFILE. Raise the soft limit towards the
    hard one, as a server's unit file would (LimitNOFILE); children inherit it."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


_raise_the_file_limit()


@pytest.fixture
def oversized_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let this test's hosts send frames up to their own maximum (4 MiB by default), as a
    hostile peer may: ours send at most ``MIN_PEER_FRAME_SIZE``, which every peer accepts."""
    from protocol.framing import DEFAULT_MAX_FRAME_SIZE

    monkeypatch.setattr("peer.rpc_link.MIN_PEER_FRAME_SIZE", DEFAULT_MAX_FRAME_SIZE)
