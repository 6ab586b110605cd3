"""Network time (peer/netclock.py): a peer whose clock is off follows its peers' median
clock, so that its DHT records do not expire early and its averaging rounds meet theirs;
a minority of wrong clocks moves nobody; answers that cannot be trusted are not counted."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio.testing

from peer.host import open_rpc_host
from peer.memnet import MemoryNetwork
from peer.netclock import ClockConfig, ClockService, NetworkClock, wall_clock
from peer.node import Peer, PeerConfig, open_peer
from protocol.address import Address
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import ClockResponse

BASE = 1_700_000_000.0


def virtual(skew: float = 0.0) -> Callable[[], float]:
    """A unix-like clock on trio's virtual time, ``skew`` seconds off."""
    return lambda: BASE + trio.current_time() + skew


@asynccontextmanager
async def swarm(
    skews: Sequence[float], config: PeerConfig | None = None, latency: float = 0.01
) -> AsyncIterator[list[Peer]]:
    """Peers on hosts 10.0.0.1.. of a memory network, joined through the first one, with
    their clocks ``skews`` seconds off."""
    net = MemoryNetwork(latency=latency)
    async with AsyncExitStack() as stack:
        nodes: list[Peer] = []
        for i, skew in enumerate(skews):
            nodes.append(await start_peer(stack, net, i, skew, nodes[:1], config))
        yield nodes


async def start_peer(
    stack: AsyncExitStack,
    net: MemoryNetwork,
    index: int,
    skew: float,
    initial: Sequence[Peer],
    config: PeerConfig | None = None,
) -> Peer:
    """Peer ``index`` on host 10.0.0.<index + 1>, its clock ``skew`` seconds off, joined
    through ``initial``, open until ``stack`` closes."""
    host = f"10.0.0.{index + 1}"
    return await stack.enter_async_context(
        open_peer(
            f"{host}:1000",
            [node.address for node in initial],
            network=net.interface(host),
            clock=virtual(skew),
            config=config,
        )
    )


# -- the estimate ----------------------------------------------------------------------


def test_the_offset_is_the_median_of_the_hosts_and_our_own_zero() -> None:
    clock = NetworkClock(lambda: 100.0)
    assert clock.record("10.0.0.2", 110.0, sent=99.9, received=100.1)  # +10
    assert clock.offset == pytest.approx(5.0)  # [0, 10]: halfway
    clock.record("10.0.0.3", 110.5, sent=100.0, received=100.0)
    assert clock.offset == pytest.approx(10.0)  # [0, 10, 10.5]
    clock.record("10.0.0.4", 90.0, sent=100.0, received=100.0)
    assert clock.offset == pytest.approx(5.0)  # [-10, 0, 10, 10.5]
    assert clock.now() == pytest.approx(105.0)
    assert clock.samples == 3


def test_two_camps_far_apart_move_nobody_halfway() -> None:
    """The median of an even count is halfway between the two middle offsets, unless they
    are a minute or more apart: then whichever value between them is nearest the offset
    we run on. A node with as many lying voices (+3600 s) as honest ones went 1800 s off,
    nobody's time (an outside tester: settled peers, for up to a minute)."""
    clock = NetworkClock(lambda: 0.0)
    clock.record("10.0.0.2", 0.0, 0.0, 0.0)
    clock.record("10.0.0.3", 3600.0, 0.0, 0.0)
    clock.record("10.0.0.4", 3600.0, 0.0, 0.0)
    assert clock.offset == 0.0  # [0, 0, 3600, 3600]: was 1800
    clock.record("10.0.0.5", 3600.0, 0.0, 0.0)
    assert clock.offset == 3600.0  # a majority
    clock.record("10.0.0.6", 0.0, 0.0, 0.0)
    assert clock.offset == 3600.0  # [0, 0, 0, 3600, 3600, 3600]: stays where it runs


def test_one_sample_per_host_the_latest() -> None:
    clock = NetworkClock(lambda: 0.0)
    for _ in range(5):  # a crowd of identities on one machine: one voice
        clock.record("10.0.0.9", 50.0, 0.0, 0.0)
    clock.record("10.0.0.2", 0.0, 0.0, 0.0)
    clock.record("10.0.0.3", 0.0, 0.0, 0.0)
    assert clock.samples == 3 and clock.offset == 0.0  # [0, 0, 0, 50]: median 0
    clock.record("2001:db8::1", 7.0, 0.0, 0.0)
    clock.record("2001:db8::2", 7.0, 0.0, 0.0)  # the same /64: replaces the one above
    assert clock.samples == 4


def test_on_loopback_each_peer_counts() -> None:
    """Peers on this machine share its clock; experiments that skew them (``clock=``) must
    not collapse into one sample, as a remote host's identities do."""
    clock = NetworkClock(lambda: 0.0)
    ids = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(3)]
    clock.record("127.0.0.1", 5.0, 0.0, 0.0, ids[0])
    clock.record("127.0.0.1", 5.0, 0.0, 0.0, ids[1])
    clock.record("10.0.0.7", 1.0, 0.0, 0.0, ids[2])
    assert clock.samples == 3 and clock.offset == pytest.approx(3.0)  # [0, 1, 5, 5]


def test_identities_on_one_remote_host_count_once() -> None:
    """Only loopback counts peer by peer: distinct identities answering from one remote
    IPv4 host, or from one global IPv6 /64, are one sample, so that a machine running a
    crowd of peers cannot outvote the other hosts."""
    clock = NetworkClock(lambda: 0.0)
    ids = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(4)]
    for peer_id in ids:
        clock.record("10.0.0.9", 50.0, 0.0, 0.0, peer_id)
    assert clock.samples == 1
    for i, peer_id in enumerate(ids):
        clock.record(f"2001:db8::{i + 1}", 50.0, 0.0, 0.0, peer_id)
    assert clock.samples == 2
    clock.record("10.0.0.2", 0.0, 0.0, 0.0, ids[0])
    clock.record("10.0.0.3", 0.0, 0.0, 0.0, ids[1])
    assert clock.samples == 4 and clock.offset == 0.0  # [0, 0, 0, 50, 50]: median 0


def test_asked_back_answers_count_only_while_few_were_picked() -> None:
    """Anyone may call us and be asked back: a crowd of hosts doing so to move our clock
    gets as many voices as the contacts we picked (one while we picked none: the first
    node of a swarm), and none once we picked 3. Beside 8 picked, 3 of them liars, 5 liars
    asked back had moved us (an outside tester: 7 honest voices against 8)."""
    clock = NetworkClock(lambda: 0.0)
    for i in range(10):
        clock.record(f"10.0.1.{i}", 100.0, 0.0, 0.0, picked=False)
    assert clock.offset == pytest.approx(50.0)  # nothing picked yet: one voice, halfway
    for i in range(2):
        clock.record(f"10.0.0.{i}", 0.0, 0.0, 0.0)
    assert clock.samples == 4  # [0, 0, 0, 100, 100]: 2 asked back beside 2 picked
    assert clock.offset == 0.0
    clock.record("10.0.0.1", 0.0, 0.0, 0.0, picked=False)  # picked already: stays picked
    assert clock.picked == 2
    for i in range(2, 8):  # 8 picked, 3 of them lying
        clock.record(f"10.0.0.{i}", 100.0 if i < 5 else 0.0, 0.0, 0.0)
    assert clock.samples == 8 and clock.offset == 0.0  # [0, 0 x5, 100 x3]: none asked back


def test_beyond_max_offset_says_so(caplog: pytest.LogCaptureFixture) -> None:
    clock = NetworkClock(lambda: 0.0, ClockConfig(max_offset=60.0))
    for i in range(3):
        clock.record(f"10.0.0.{i}", 4000.0, 0.0, 0.0)
    clock.log_change()
    assert clock.offset == 60.0
    assert "4000.000 s behind the median of 3 peers' clocks, beyond" in caplog.text
    assert "correcting by only 60 s; set this machine's clock" in caplog.text


def test_beyond_max_offset_with_one_peer_blames_neither(caplog: pytest.LogCaptureFixture) -> None:
    """One peer's clock far off (an outside tester's fake initial peer said 1e9) does not
    tell which of the two is wrong: the warning says so, the bound holds."""
    clock = NetworkClock(lambda: 0.0, ClockConfig(max_offset=60.0))
    clock.record("10.0.0.1", -4000.0, 0.0, 0.0)
    clock.log_change()
    assert clock.offset == -60.0
    [line] = caplog.messages
    assert "4000.000 s ahead of the one peer's clock it knows (either may be the wrong one)" in line
    assert "beyond ClockConfig.max_offset: correcting by only 60 s" in line
    assert "set this machine's clock" not in line and "median" not in line

    client = NetworkClock(lambda: 0.0, ClockConfig(max_offset=60.0), count_own=False)
    client.record("10.0.0.1", 4000.0, 0.0, 0.0)  # a client follows its one peer all the way
    client.log_change()
    assert client.offset == 60.0
    assert "4000.000 s behind the one peer's clock it knows" in caplog.messages[-1]


def test_the_default_clock_does_not_follow_a_step_of_the_system_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NTP stepping the system time (or a resumed VM) in the middle of a run would move
    this node's rounds and expirations at once, and its offset, measured before, would
    then be wrong until the next answers."""

    async def main() -> tuple[float, float]:
        before = wall_clock()
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 5.0)
        await trio.sleep(1.0)
        return before, wall_clock()

    before, after = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert after - before == pytest.approx(1.0)


def test_suspended_time_is_added_back_and_outside_trio_it_is_the_system_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A laptop's sleep stops the monotonic clock (trio's) but not time: the default clock
    adds what the system says it spent suspended, instead of running that far behind."""
    from peer import netclock

    async def main() -> float:
        before = wall_clock()
        monkeypatch.setattr(netclock, "_suspended", lambda: 600.0)  # from 0 at the anchor
        await trio.sleep(1.0)
        return wall_clock() - before

    monkeypatch.setattr(netclock, "_suspended", lambda: 0.0)
    moved = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert moved == pytest.approx(601.0)
    assert wall_clock() == pytest.approx(time.time(), abs=1.0)  # no run: a thread's view


def test_a_client_mode_peer_follows_all_the_way() -> None:
    """Nobody asks a client back, so counting its own clock would leave it halfway from a
    node it is alone with."""
    clock = NetworkClock(lambda: 0.0, count_own=False)
    assert clock.median() == 0.0  # nothing heard yet: as it was
    clock.record("10.0.0.2", 3.0, 0.0, 0.0)
    assert clock.offset == 3.0


def test_slow_or_impossible_round_trips_are_not_counted() -> None:
    clock = NetworkClock(lambda: 0.0, ClockConfig(max_round_trip=0.5))
    assert not clock.record("10.0.0.2", 99.0, sent=10.0, received=10.6)
    assert not clock.record("10.0.0.2", 99.0, sent=10.0, received=9.0)  # the clock stepped
    assert clock.samples == 0 and clock.offset == 0.0


def test_an_estimate_within_half_the_round_trip_of_zero_counts_as_zero() -> None:
    """An answer that waited 0.6 s on the answerer's busy loop reads as a skew of 0.3 s: a
    benchmark peer on loopback (one clock for all) followed +0.29 s and met the others a
    slot late. A skew larger than half the round trip still counts in full."""
    clock = NetworkClock(lambda: 0.0, count_own=False)
    assert clock.record("10.0.0.2", 10.6, sent=10.0, received=10.6)  # +0.3, round trip 0.6
    assert clock.offset == 0.0 and clock.samples == 1
    clock.record("10.0.0.2", 10.6, sent=10.0, received=10.2)  # +0.5, round trip 0.2
    assert clock.offset == pytest.approx(0.5)
    clock.record("10.0.0.2", 4.0, sent=10.0, received=10.2)  # -6.1
    assert clock.offset == pytest.approx(-6.1)


def test_a_slow_answer_does_not_replace_a_much_faster_one_of_the_same_host() -> None:
    """A busy answerer (its loop computing for 0.7 s) errs by half its round trip: the
    fastest recent answer of a host counts (NTP's clock filter)."""
    clock = NetworkClock(lambda: 0.0, count_own=False)
    clock.record("10.0.0.2", 13.0, sent=10.0, received=10.02)  # +2.99, round trip 0.02
    assert clock.offset == pytest.approx(2.99)
    assert clock.record("10.0.0.2", 13.6, sent=10.0, received=10.7)  # +3.25 after 0.7 s
    assert clock.offset == pytest.approx(2.99)
    clock.record("10.0.0.2", 14.5, sent=11.0, received=11.01)  # faster still: it counts
    assert clock.offset == pytest.approx(3.495)
    clock.record("10.0.0.2", 400.0, sent=399.0, received=399.7)  # the faster one is old
    assert clock.offset == pytest.approx(0.65)


def test_small_moves_are_ignored_and_the_correction_is_capped() -> None:
    clock = NetworkClock(lambda: 0.0, ClockConfig(threshold=0.1, max_offset=60.0))
    clock.record("10.0.0.2", 0.05, 0.0, 0.0)
    assert clock.offset == 0.0  # [0, 0.05]: median 0.025, within the threshold
    clock.record("10.0.0.3", 0.3, 0.0, 0.0)
    assert clock.offset == 0.0  # [0, 0.05, 0.3]: 0.05
    clock.record("10.0.0.4", 0.4, 0.0, 0.0)
    assert clock.offset == pytest.approx(0.175)  # [0, 0.05, 0.3, 0.4]: moved by more
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
        clock.record(host, 1e6, 0.0, 0.0)
    assert clock.offset == 60.0


def test_only_the_latest_hosts_count() -> None:
    clock = NetworkClock(lambda: 0.0, ClockConfig(max_samples=2))
    clock.record("10.0.0.2", 100.0, 0.0, 0.0)
    clock.record("10.0.0.3", 0.0, 0.0, 0.0)
    clock.record("10.0.0.4", 0.0, 0.0, 0.0)  # 10.0.0.2 goes
    assert clock.samples == 2 and clock.median() == 0.0


@pytest.mark.parametrize("time", [float("nan"), float("inf"), -1.0, 2.0**41, True, "1", None])
def test_a_malformed_answer_is_a_protocol_error(time: object) -> None:
    with pytest.raises(RemoteProtocolError):
        ClockResponse.from_body({"t": "clock.now.res", "time": time})


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="interval"):
        ClockConfig(interval=0)
    with pytest.raises(ValueError, match="max_samples"):
        ClockConfig(max_samples=0)


# -- on the memory network -------------------------------------------------------------


async def test_a_skewed_peer_follows_the_others_and_they_stay_put(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "peer.netclock")
    with trio.fail_after(60):
        async with swarm([0.0, 0.0, 0.0, 10.0]) as nodes:
            skewed = nodes[-1]
            assert skewed.clock.offset == pytest.approx(-10.0, abs=0.02)
            assert skewed.clock.now() == pytest.approx(nodes[0].clock.now(), abs=0.02)
            await trio.sleep(1.0)  # the others asked it back: one voice of three, ignored
            for node in nodes[:-1]:
                assert node.clock.offset == 0.0
    [line] = caplog.messages  # one line for the whole first batch of answers
    assert "clock is 10.000 s ahead of the median of" in line


async def test_a_slow_answer_is_asked_again_twice(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer slower than 0.2 s round trip (here the link's latency; in a trial, an
    answerer whose loop was busy) is asked again, twice at most, 1-3 s apart: three
    answers for each ask on a slow link, one on a fast link."""
    answers: list[tuple[str, bool]] = []
    record = NetworkClock.record

    def counting(self: NetworkClock, host: str, *args: object, **kwargs: object) -> bool:
        answers.append((host, bool(kwargs.get("picked", True))))
        return record(self, host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(NetworkClock, "record", counting)
    counts = []
    for latency in (0.01, 0.15):
        answers.clear()
        with trio.fail_after(60):
            async with swarm([0.0, 3.0], latency=latency) as (first, second):
                await trio.sleep(10.0)
                assert second.clock.offset == pytest.approx(-1.5, abs=0.02)  # halfway
                assert first.clock.offset == pytest.approx(1.5, abs=0.02)
        counts.append(answers.count(("10.0.0.1", True)))  # the second asked the first
    fast, slow = counts
    assert fast >= 1 and slow == 3 * fast, counts


async def test_two_peers_meet_halfway(autojump_clock: trio.testing.MockClock) -> None:
    """The first node of a swarm has nobody to ask; the second asks it, and it asks back."""
    with trio.fail_after(60):
        async with swarm([0.0, 6.0]) as (first, second):
            await trio.sleep(1.0)  # virtual: the ask back takes two round trips
            assert first.clock.offset == pytest.approx(3.0, abs=0.02)
            assert second.clock.offset == pytest.approx(-3.0, abs=0.02)
            assert first.clock.now() == pytest.approx(second.clock.now(), abs=0.02)


async def test_a_lying_minority_moves_nobody(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(60):
        async with swarm([0.0, 0.0, 500.0, 0.0, -500.0, 0.0]) as nodes:
            await trio.sleep(1.0)
            for i in (0, 1, 3, 5):
                assert nodes[i].clock.offset == 0.0


async def test_a_record_from_a_peer_whose_clock_is_behind_is_not_expired_on_arrival(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Expirations are absolute: a peer 60 s behind stamped a 30 s record with a time the
    storing nodes had already passed, and they dropped it."""
    for enabled, found in ((True, {"step": 1}), (False, None)):
        config = PeerConfig(clock=ClockConfig(enabled=enabled))
        with trio.fail_after(60):
            async with swarm([0.0, 0.0, 0.0, -60.0], config) as nodes:
                assert await nodes[-1].dht.store("run/progress", {"step": 1}, ttl=30.0)
                assert await nodes[1].dht.get("run/progress") == found


async def test_disabled_means_the_local_clock(autojump_clock: trio.testing.MockClock) -> None:
    config = PeerConfig(clock=ClockConfig(enabled=False))
    with trio.fail_after(60):
        async with swarm([0.0, 10.0], config) as (first, second):
            await trio.sleep(1.0)
            assert first.clock.offset == second.clock.offset == 0.0
            assert first.clock.samples == second.clock.samples == 0


async def test_peers_ask_again_every_interval(autojump_clock: trio.testing.MockClock) -> None:
    """A machine whose clock is stepped while it runs follows the swarm again."""
    skew = [0.0]
    net = MemoryNetwork(latency=0.01)
    # (connections idle out after HostConfig.idle_timeout: asking again uses those up)
    config = PeerConfig(clock=ClockConfig(interval=30.0))
    with trio.fail_after(300):
        async with (
            open_peer("10.0.0.1:1000", network=net.interface("10.0.0.1"), clock=virtual()) as a,
            open_peer(
                "10.0.0.2:1000", [a.address], network=net.interface("10.0.0.2"), clock=virtual()
            ) as b,
            open_peer(
                "10.0.0.3:1000",
                [a.address],
                network=net.interface("10.0.0.3"),
                clock=lambda: BASE + trio.current_time() + skew[0],
                config=config,
            ) as c,
        ):
            assert b.clock.offset == 0.0 and c.clock.offset == 0.0
            skew[0] = 20.0  # e.g. a manual change of the system time
            await trio.sleep(40.0)
            assert c.clock.offset == pytest.approx(-20.0, abs=0.02)


async def test_early_joiners_catch_up_with_later_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first node of a swarm (10 s ahead) and the first to join it meet halfway; as
    more peers come (they ask both, which ask them back), both follow the majority."""
    with trio.fail_after(300):
        async with swarm([10.0, 0.0, 0.0, 0.0]) as nodes:
            await trio.sleep(60.0)
            assert nodes[0].clock.offset == pytest.approx(-10.0, abs=0.02)
            for node in nodes[1:]:
                assert node.clock.offset == 0.0


async def test_a_crowd_of_lying_hosts_that_call_us_moves_nobody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten hosts 100 s ahead join six honest peers and call them (they are asked back):
    each honest peer counts them only as many times as the contacts it picked. The liars,
    off by 100 s from those they asked, ask more contacts 30, 60 and 90 s on: with
    clock.peek, never asked back (with clock.now, their re-asks moved honest peers in 6
    of 30 runs of this test)."""
    with trio.fail_after(300):
        async with swarm([0.0] * 6 + [100.0] * 10) as nodes:
            for _ in range(40):  # through the liars' three re-asks
                await trio.sleep(5.0)
                assert [node.clock.offset for node in nodes[:6]] == [0.0] * 6


async def test_a_newcomer_whose_first_contacts_lie_follows_the_swarm_once_it_knows_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Five liars (+3600 s) are all a newcomer knows when it joins: it follows them. Six
    honest peers join after it (asking nobody themselves, so no ask back brings it home):
    it followed the liars until its re-ask 5 minutes on, over the connections it had then
    (an outside tester: up to ~10 minutes, honest peers split off in their averaging). A
    correction of a second or more now has it ask contacts it has not asked yet 30 s on."""
    net = MemoryNetwork(latency=0.01)
    honest = PeerConfig(clock=ClockConfig(peers=0))
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:

            async def start(i: int, skew: float, config: PeerConfig | None = None) -> Peer:
                host = f"10.0.0.{i + 1}"
                initial = [liars[0].address] if i else []
                return await stack.enter_async_context(
                    open_peer(
                        f"{host}:1000",
                        initial,
                        network=net.interface(host),
                        clock=virtual(skew),
                        config=config,
                    )
                )

            liars: list[Peer] = []
            for i in range(5):
                liars.append(await start(i, 3600.0))
            newcomer = await start(5, 0.0)
            assert newcomer.clock.offset == 3600.0  # all it knows
            joined = trio.current_time()
            for i in range(6, 12):
                await start(i, 0.0, honest)
            await trio.sleep(joined + 120.0 - trio.current_time())
            assert newcomer.clock.offset == 0.0, newcomer.clock.offset
            # the liars it asked with clock.peek did not ask it back: none of them moved
            assert [liar.clock.offset for liar in liars] == [0.0] * 5


async def test_one_listening_node_and_client_mode_peers_agree(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The usual small swarm: one public node, volunteers behind NATs. The clients follow
    the node; the node, asked by nobody in its routing table, keeps its time (it used to
    move halfway towards whichever client asked it last)."""
    net = MemoryNetwork(latency=0.01)
    skews = [3.0, -2.0, 1.0]
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(
                open_peer("10.0.0.1:1000", network=net.interface("10.0.0.1"), clock=virtual())
            )
            clients = [
                await stack.enter_async_context(
                    open_peer(
                        None,
                        [server.address],
                        client_mode=True,
                        network=net.interface(f"10.0.1.{i}"),
                        clock=virtual(skew),
                    )
                )
                for i, skew in enumerate(skews)
            ]
            await trio.sleep(30.0)
            assert server.clock.offset == 0.0
            for client, skew in zip(clients, skews, strict=True):
                assert client.clock.offset == pytest.approx(-skew, abs=0.02)


async def test_the_round_trip_timed_is_the_call_not_the_dial(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Asking a peer we are not connected to dials it first: a dial and handshake inside
    the timed round trip (several one-way delays, all before the answer) moved the
    midpoint by half their time (4.95 s measured for 5 s at 50 ms each way)."""
    net = MemoryNetwork(latency=0.05)
    ids = [Identity.from_seed(bytes([40 + i]) * 32) for i in range(2)]
    with trio.fail_after(60):
        async with (
            open_rpc_host(
                ids[0], listen=Address.parse("10.0.0.1:1000"), network=net.interface("10.0.0.1")
            ) as there,
            open_rpc_host(ids[1], listen=None, network=net.interface("10.0.0.2")) as here,
        ):
            ClockService(there, NetworkClock(virtual()), list)
            ours = NetworkClock(virtual(5.0), count_own=False)
            asker = ClockService(here, ours, list)
            target = Address("10.0.0.1", 1000, ids[0].peer_id)
            assert await asker.ask(target, "10.0.0.1")
            assert ours.offset == pytest.approx(-5.0, abs=1e-6)


@pytest.mark.parametrize("peek", [False, True])
async def test_clock_peek_is_answered_and_never_asked_back(
    autojump_clock: trio.testing.MockClock, peek: bool
) -> None:
    """A peer in our routing table that asks ``clock.now`` is asked back (its clock then
    counts in ours); one that asks ``clock.peek`` (widening, see ClockService.serve) gets
    the same answer and is not asked back."""
    net = MemoryNetwork(latency=0.01)
    ids = [Identity.from_seed(bytes([50 + i]) * 32) for i in range(2)]
    with trio.fail_after(60):
        async with (
            open_rpc_host(
                ids[0], listen=Address.parse("10.0.0.1:1000"), network=net.interface("10.0.0.1")
            ) as there,
            open_rpc_host(
                ids[1], listen=Address.parse("10.0.0.2:1000"), network=net.interface("10.0.0.2")
            ) as here,
            trio.open_nursery() as nursery,
        ):
            theirs = NetworkClock(virtual())
            answerer = ClockService(there, theirs, lambda: [(ids[1].peer_id, "10.0.0.2:1000")])
            await nursery.start(answerer.serve)
            ours = NetworkClock(virtual(10.0))
            asker = ClockService(here, ours, list)
            await nursery.start(asker.serve)
            assert await asker.ask(Address("10.0.0.1", 1000, ids[0].peer_id), "10.0.0.1", peek=peek)
            assert ours.offset == pytest.approx(-5.0, abs=0.02)  # halfway: our own voice
            await trio.sleep(5.0)
            assert theirs.samples == (0 if peek else 1)
            assert theirs.offset == (0.0 if peek else pytest.approx(5.0, abs=0.02))
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("owned", [False, True])
async def test_a_store_after_our_time_moved_back_replaces_our_earlier_one(
    autojump_clock: trio.testing.MockClock, owned: bool
) -> None:
    """A clock-skew trial: a peer that first met one peer (halfway: 15 s ahead), stored,
    and was then corrected 15 s back by the swarm's median, could not replace its own
    value for 15 s: the new store expired earlier than the old one by the numbers, every
    node kept the old value (get read v1 with 44.5 s left of a 30 s ttl), and store said
    False; its averaging declarations were refused so for three rounds."""
    with trio.fail_after(120):
        async with swarm([0.0, 0.0, 0.0, 0.0]) as nodes:
            writer, reader = nodes[-1], nodes[1]
            subkey = str(writer.peer_id) if owned else None
            assert await writer.dht.store("run/state", "v1", ttl=30.0, subkey=subkey)
            await trio.sleep(2.0)
            writer.clock.offset -= 15.0  # what following the others' median does
            assert await writer.dht.store("run/state", "v2", ttl=30.0, subkey=subkey)
            entries = await reader.dht.get_entries("run/state")
            value, expiration = entries[subkey]
            assert value == "v2"
            # just after v1's expiration (28 s away), which is 43 s away in the writer's
            # corrected time: at most the correction longer than the ttl
            assert expiration - reader.clock.now() == pytest.approx(28.0, abs=0.1)
            assert expiration - writer.clock.now() == pytest.approx(43.0, abs=0.1)
            # and so does the next store (a recheck found it refused again: v3 expired
            # before the stretched v2 by the numbers)
            await trio.sleep(1.0)
            assert await writer.dht.store("run/state", "v3", ttl=30.0, subkey=subkey)
            assert (await reader.dht.get_entries("run/state"))[subkey][0] == "v3"
            await trio.sleep(14.0)  # past the stretch: a store's own expiration is later
            assert await writer.dht.store("run/state", "v4", ttl=30.0, subkey=subkey)
            value, expiration = (await reader.dht.get_entries("run/state"))[subkey]
            assert value == "v4"
            assert expiration - writer.clock.now() == pytest.approx(30.0, abs=0.1)
            await trio.sleep(31.0)  # gone once that passed, as any record
            assert await reader.dht.get("run/state") is None


async def test_a_refused_store_does_not_hide_the_live_one_from_the_next_correction(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A review: a store refused for its shorter ttl took the live one's place in what the
    writer remembered, and the next store after a correction was compared with it and
    refused as well."""
    with trio.fail_after(120):
        async with swarm([0.0, 0.0, 0.0, 0.0]) as nodes:
            writer, reader = nodes[-1], nodes[1]
            assert await writer.dht.store("run/state", "v1", ttl=60.0)
            await trio.sleep(1.0)
            assert not await writer.dht.store("run/state", "v2", ttl=10.0)
            await trio.sleep(1.0)
            writer.clock.offset -= 15.0
            # expires at 57 by the numbers, before v1's 60; at 72 on the monotonic clock
            assert await writer.dht.store("run/state", "v3", ttl=70.0)
            assert await reader.dht.get("run/state") == "v3"


async def test_without_a_correction_a_shorter_ttl_still_does_not_replace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The expiration stays the version: only a correction of our own time carries over."""
    with trio.fail_after(120):
        async with swarm([0.0, 0.0, 0.0]) as nodes:
            writer, reader = nodes[-1], nodes[1]
            assert await writer.dht.store("run/state", "v1", ttl=60.0)
            await trio.sleep(2.0)
            assert not await writer.dht.store("run/state", "v2", ttl=30.0)
            assert await reader.dht.get("run/state") == "v1"


def test_a_clock_back_in_line_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Not "0.000 s ahead of the median ...: following them" (a clock-skew trial)."""
    clock = NetworkClock(lambda: 100.0)
    with caplog.at_level(logging.INFO, logger="peer.netclock"):
        clock.record("10.0.0.2", 110.0, sent=100.0, received=100.0)  # +10: halfway
        clock.log_change()
        clock.record("10.0.0.2", 100.0, sent=100.0, received=100.0)  # now agrees
        clock.log_change()
    first, second = (r.getMessage() for r in caplog.records)
    # one peer: halfway to it, and either clock may be the wrong one (an outside tester:
    # a machine with NTP was told its clock was behind)
    assert "10.000 s behind the one peer's clock it knows (either may be the wrong one)" in first
    assert "moving halfway, 5.000 s" in first
    assert "agrees with the median of 1 peers' clocks again" in second
