"""``distinct_endpoints``: a node reached under two names is one endpoint (``swarm status``
listed it twice and warned of a copied key file: an outside tester)."""

from __future__ import annotations

import pytest
import trio

from peer.endpoints import distinct_endpoints


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (["127.0.0.1:5", "localhost:5"], ["127.0.0.1:5"]),
        (["localhost:5", "127.0.0.1:5"], ["localhost:5"]),
        (["127.0.0.1:5", "[::ffff:127.0.0.1]:5"], ["127.0.0.1:5"]),
        (["[::1]:5", "[0:0::1]:5"], ["[::1]:5"]),
        (["127.0.0.1:5", "127.0.0.1:6"], ["127.0.0.1:5", "127.0.0.1:6"]),  # two processes
        (["10.0.0.1:5", "10.0.0.2:5"], ["10.0.0.1:5", "10.0.0.2:5"]),
        # a name that does not resolve is an endpoint of its own: warned of, not hidden
        (["127.0.0.1:5", "nosuch.invalid:5"], ["127.0.0.1:5", "nosuch.invalid:5"]),
    ],
)
async def test_names_of_one_socket_count_once(given: list[str], kept: list[str]) -> None:
    with trio.fail_after(10):
        assert await distinct_endpoints(given) == kept
