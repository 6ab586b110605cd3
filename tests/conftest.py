"""Suite-wide set-up."""

from __future__ import annotations

import signal

# A suite started in the background by a non-interactive shell (`make check &`, nohup)
# inherits SIGINT ignored, and so would every command the tests start: `swarm bootstrap`
# keeps an inherited ignored SIGINT ignored (by design), and the tests that stop it with
# Ctrl-C would fail. A handler here makes the commands start with SIGINT's default action
# (exec resets caught signals, not ignored ones); the tests of an ignored SIGINT set it
# themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
