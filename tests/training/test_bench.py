"""The bench (training/averaging/bench.py): how long a peer that sent us garbage sits out."""

from __future__ import annotations

from protocol.identity import Identity, PeerID
from training.averaging.bench import BENCH_STEPS, MAX_BENCH_STEPS, MAX_BENCHED, Bench


def peer(i: int) -> PeerID:
    return Identity.from_seed(i.to_bytes(32, "big")).peer_id


def test_a_first_offense_sits_out_the_next_steps_then_returns() -> None:
    bench = Bench()
    bench.tick()  # our step 1, in which the peer sent garbage
    bench.record(peer(1), "it sent us garbage chunks in round 7")
    benched = []
    for _ in range(BENCH_STEPS + 2):
        bench.tick()
        benched.append(peer(1) in bench)
    assert benched == [True] * BENCH_STEPS + [False, False]
    assert peer(2) not in bench and "not a peer" not in bench


def test_the_reason_says_what_and_how_long() -> None:
    bench = Bench()
    bench.record(peer(1), "it sent us garbage chunks in round 7")
    bench.tick()
    assert bench.reason(peer(1)) == (
        f"it sent us garbage chunks in round 7 (benched for {BENCH_STEPS} more step(s) of ours)"
    )
    assert bench.reason(peer(2)) is None


def test_each_new_offense_doubles_the_bench_up_to_a_cap() -> None:
    bench = Bench()
    lengths = []
    for _ in range(12):
        bench.record(peer(1), "garbage")
        steps = 0
        while True:
            bench.tick()
            if peer(1) not in bench:
                break
            steps += 1
        lengths.append(steps)
    assert lengths[:4] == [BENCH_STEPS, 2 * BENCH_STEPS, 4 * BENCH_STEPS, 8 * BENCH_STEPS]
    assert max(lengths) == MAX_BENCH_STEPS == lengths[-1]


def test_it_remembers_a_bounded_number_of_offenders() -> None:
    bench = Bench()
    for i in range(MAX_BENCHED + 10):
        bench.record(peer(i), "garbage")
    assert peer(0) not in bench  # the oldest offenses are forgotten first
    assert peer(MAX_BENCHED + 9) in bench
    assert sum(peer(i) in bench for i in range(MAX_BENCHED + 10)) == MAX_BENCHED
