"""Iterative Kademlia lookups: alpha requests in flight until the k closest have answered.

:class:`LookupState` is the sans-I/O core; :func:`iterative_lookup` drives it with an
injected async ``query(node) -> nodes | None`` (None: the node failed), so the same
code runs over RPC, over an in-memory network, or over a dict in a unit test.

Rules:
- Candidates are kept sorted by XOR distance to the target; nodes that fail are
  dropped from them (and never asked again).
- The next node asked is the closest not-yet-asked candidate among the k closest
  candidates still alive; at most ``alpha`` requests are in flight until ``alpha``
  answers in a row bring no candidate closer than the closest already seen (the paper's
  round that finds nothing closer): from then on the lookup has converged and asks every
  remaining one of the k closest at once (the paper's final round, which saves round
  trips, not requests).
- The lookup ends when the k closest live candidates have all answered (or fewer,
  when the network knows fewer), and nothing is in flight.
- A lookup that has no answer yet does not end while a request it gave up on runs: with
  nobody else to ask, it waits for them (to their own timeout). A request given up on
  before the first answer (under a guess from the caller's recent lookups), more recently
  than twice that answer's own round trip, is waited for again. A volunteer whose round
  trip grew past that guess gave up on its few contacts in turn, ended with no answer,
  and failed every store and get while they answered, later (an outside tester: 2
  contacts at 60 ms more each way).
- A request left unanswered through a silence of the hedge delay (no answer at all for
  that long, and the lookup's timer not woken more than half that late: a loop that
  late is busy, and the answers may be waiting in it unread) is given up on: it stops
  counting as in flight and among the k closest, so the next candidate takes its place,
  and a late answer is still used. Requests given up
  on and still unanswered when the lookup ends are cancelled and reported (a frozen node
  costs a lookup about two round trips, not the whole request timeout). One request per
  silence, not all: where latencies differ widely, a slow node among the k closest must
  still get its turn (a store to it is not cancelled after one fast answer).
- One address, one node: once a request to an address is given up on (silence), the
  other candidates at that address are given up on too (those in flight), or never asked
  (the rest, and any named there later in the lookup). A reply naming dozens of made-up
  PeerIDs at one address that never answers cost every lookup through it a hedge delay
  per made-up node (~1.2 s a get, a security review); one now.
- A node that failed, went silent or was skipped at one address, and that a reply names
  at another (or named there while it was being asked), is asked there, up to
  ``_MAX_ADDRESS_RETRIES`` addresses; whichever of its requests answers first counts, the
  others are superseded. A liar answering first could name a genuine node's real PeerID
  at a silent address and keep it out of the lookup (an outside re-check: 40 of 40).
- A reply whose nodes went silent is discredited: each silence (a request given up on,
  once per address) counts against the replies that named the node, in shares (1/m each
  for m replies), and a reply with ``_REFERRER_SILENCES`` of them, more than its nodes'
  answers, is discredited until they answer as often. While another reply keeps its
  credit, its other nodes are asked only when a credible reply (or the seeds) names them
  too, and its requests in flight are given up on. A liar naming 20 made-up nodes at 20
  addresses that never answer cost a lookup a hedge delay each (~1 s); about three now.
  Honest replies share the blame for the nodes that froze among the closest (every reply
  names them), and keep credit; a lookup's only reply is never discredited.
- A node the caller knows to be silent (``silent(node)``: it let a recent request go
  unanswered) is asked but given up on at once, while another request is in flight or a
  candidate is left to ask: its answer still counts if it comes, and the lookup does not
  wait a hedge delay for each such node that replies keep naming.
- An answer contributes its k nodes closest to the target (a reply may name up to 64).
- Hops: the seeds are hop 1; a node first named by a hop-h node is hop h + 1.
  ``rounds`` is the largest hop among the nodes that answered.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import trio

from protocol.identity import PeerID
from protocol.messages import NodeInfo

Query = Callable[[NodeInfo], Awaitable[Sequence[NodeInfo] | None]]
MIN_HEDGE_DELAY = 0.05
"""Seconds: a very fast first answer (a neighbour on the LAN) must not make a get ask
another node every few milliseconds while farther ones are still on their way."""


class _Status(enum.Enum):
    NEW = enum.auto()
    IN_FLIGHT = enum.auto()
    ANSWERED = enum.auto()
    FAILED = enum.auto()
    GIVEN_UP = enum.auto()  # in flight, but no longer waited for
    SKIPPED = enum.auto()  # never asked: another node at its address was silent
    UNVOUCHED = enum.auto()  # never asked (yet): only discredited replies named it


@dataclass(slots=True)
class _Candidate:
    node: NodeInfo
    distance: int
    hop: int
    status: _Status = _Status.NEW
    failed_at: set[str] | None = None  # addresses at which it failed (see LookupState.add)
    elsewhere: NodeInfo | None = None  # named at another address while asked at this one
    named_by: list[PeerID] | None = None  # the nodes whose answers named it (None: a seed)


_ASK_ELSEWHERE = frozenset({_Status.FAILED, _Status.GIVEN_UP, _Status.SKIPPED})
_MAX_ADDRESS_RETRIES = 3
"""Other addresses a node that failed is asked at, when replies name it there: a lie about
its address (a dead one) must not hide it for good, nor may lies cost many dials."""
_REFERRER_SILENCES = 3.0
"""Silences (requests given up on) among the nodes a reply named, each shared among the
replies that named it, after which that reply's other nodes are asked only if another
reply names them too, while its nodes' silences outnumber their answers."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """What a lookup found."""

    target: int
    closest: tuple[NodeInfo, ...]  # nodes that answered, closest first, at most k
    rounds: int  # longest referral chain to a node that answered (0: nobody answered)
    queried: int  # requests sent
    failed: int  # requests that failed
    first_answer_s: float | None = None  # seconds to the first answer (None: no answer)


class LookupState:
    """The bookkeeping of one lookup; see the module rules."""

    def __init__(
        self,
        target: int,
        k: int,
        exclude: PeerID | None = None,
        settle_after: int = 1,
        on_excluded: Callable[[NodeInfo], None] | None = None,
    ) -> None:
        """``on_excluded(node)``: called for each ``exclude`` node named with an address
        (our own PeerID: at an address of ours, an old one, or a twin's)."""
        self.target = int(target)
        self.on_excluded = on_excluded
        self.k = k
        self.settle_after = settle_after  # quiet answers in a row that mean "converged"
        self.exclude = exclude
        self._candidates: dict[PeerID, _Candidate] = {}
        self._order: list[tuple[int, PeerID]] = []  # (distance, peer) of live candidates
        self.in_flight = 0
        self.answers = 0
        self.queried = 0
        self.failed = 0
        self.converged = False
        self.quiet = 0  # answers in a row that brought no node closer than the closest seen
        self._closest_seen: int | None = None
        self._silent_addresses: set[str] = set()  # where a request was given up on
        # requests given up on, still running at an address their node was since named
        # elsewhere and asked there: their outcome no longer moves the node's status
        self._superseded: dict[tuple[PeerID, str | None], _Candidate] = {}
        # per node that answered: the silences and answers of the nodes it named (see
        # _REFERRER_SILENCES), and the nodes discredited by them
        self._silences: dict[PeerID, float] = {}
        self._vouched: dict[PeerID, int] = {}
        self._discredited: set[PeerID] = set()
        self._referrers: set[PeerID] = set()  # nodes whose answers named nodes

    def add(self, node: NodeInfo, hop: int, named_by: PeerID | None = None) -> None:
        """Learn of ``node`` (a seed, or named in the answer of ``named_by``); duplicates
        keep the lower hop."""
        if node.address is None:
            return
        if node.peer_id == self.exclude:
            if self.on_excluded is not None:
                self.on_excluded(node)
            return
        known = self._candidates.get(node.peer_id)
        if known is not None:
            known.hop = min(known.hop, hop)
            if known.named_by is not None:
                if named_by is None:
                    known.named_by = None  # a seed: no reply's word needed
                elif named_by not in known.named_by:
                    known.named_by.append(named_by)
            if known.status is _Status.UNVOUCHED and not self._unvouched(known):
                known.status = _Status.NEW  # vouched for by another reply now
                bisect.insort(self._order, (known.distance, node.peer_id))
            if known.status is _Status.IN_FLIGHT and node.address != known.node.address:
                known.elsewhere = known.elsewhere or node  # (should this request fail)
            else:
                self._ask_elsewhere(known, node)
            return
        distance = self._distance(node)
        if node.address in self._silent_addresses:
            self._candidates[node.peer_id] = _Candidate(node, distance, hop, _Status.SKIPPED)
            return
        referrers = None if named_by is None else [named_by]
        self._candidates[node.peer_id] = _Candidate(node, distance, hop, named_by=referrers)
        bisect.insort(self._order, (distance, node.peer_id))
        if self._closest_seen is None or distance < self._closest_seen:
            self._closest_seen = distance

    def _ask_elsewhere(self, known: _Candidate, node: NodeInfo) -> None:
        """It failed, went silent, or was skipped at the address we first heard; a reply
        names another: ask it there (an initial peer that named the k closest at dead
        addresses hid them from a newcomer for good; a liar naming a node's real PeerID at
        a silent address hid it from every lookup the liar answered first: reviews). A
        request still running at the first address is superseded (see on_answer)."""
        failed_at = known.failed_at or set()
        if (
            known.status not in _ASK_ELSEWHERE
            or node.address == known.node.address
            or node.address in failed_at
            or node.address in self._silent_addresses
            or len(failed_at) > _MAX_ADDRESS_RETRIES
        ):
            return
        if known.node.address is not None:
            known.failed_at = failed_at | {known.node.address}
        if known.status is _Status.GIVEN_UP:
            self._superseded[node.peer_id, known.node.address] = known
        known.node, known.status, known.elsewhere = node, _Status.NEW, None
        bisect.insort(self._order, (known.distance, node.peer_id))

    def _distance(self, node: NodeInfo) -> int:
        return int.from_bytes(node.peer_id.raw, "big") ^ self.target  # its DHTID's

    def next_to_query(self) -> NodeInfo | None:
        """The closest unasked node among the k closest live ones, now marked in flight."""
        i = 0
        while i < self.k and i < len(self._order):
            candidate = self._candidates[self._order[i][1]]
            if candidate.status is _Status.NEW:
                if self._discredited and self._unvouched(candidate):
                    candidate.status = _Status.UNVOUCHED  # (see the module rules)
                    del self._order[i]
                    continue
                candidate.status = _Status.IN_FLIGHT
                self.in_flight += 1
                self.queried += 1
                return candidate.node
            i += 1
        return None

    def _unvouched(self, candidate: _Candidate) -> bool:
        """Whether only discredited replies named ``candidate``, while another reply keeps
        its credit (the only reply of a lookup, a newcomer's bootstrap node naming the
        frozen nodes closest to it first, was discredited, and the newcomer joined knowing
        that node alone: an outside re-check, 9 of 24 joins)."""
        named_by = candidate.named_by
        return (
            named_by is not None
            and len(self._referrers) > len(self._discredited)
            and all(p in self._discredited for p in named_by)
        )

    def _count_silence(self, candidate: _Candidate) -> bool:
        """``candidate`` went silent: a share of it against each reply that named it.
        Returns whether that discredited one."""
        if not candidate.named_by:
            return False
        share = 1.0 / len(candidate.named_by)
        discredited = False
        for referrer in candidate.named_by:
            silences = self._silences[referrer] = self._silences.get(referrer, 0.0) + share
            if (
                silences >= _REFERRER_SILENCES
                and silences > self._vouched.get(referrer, 0)
                and referrer not in self._discredited
            ):
                self._discredited.add(referrer)
                discredited = True
        if discredited and len(self._discredited) == len(self._referrers):
            self._revive()  # none keeps its credit: no reply's word counts against another
        return discredited

    def _count_answer(self, candidate: _Candidate) -> None:
        """``candidate`` answered: to the credit of each reply that named it."""
        for referrer in candidate.named_by or ():
            vouched = self._vouched[referrer] = self._vouched.get(referrer, 0) + 1
            if referrer in self._discredited and vouched >= self._silences[referrer]:
                self._discredited.discard(referrer)
                self._revive()

    def _revive(self) -> None:
        """Ask again the nodes left unasked for want of a credible reply naming them, now
        that a reply naming them has its credit back (or none has)."""
        for peer_id, candidate in self._candidates.items():
            if candidate.status is _Status.UNVOUCHED and not self._unvouched(candidate):
                candidate.status = _Status.NEW
                bisect.insort(self._order, (candidate.distance, peer_id))

    def parallelism(self, alpha: int) -> int:
        """How many requests may be in flight now."""
        return self.k if self.converged else alpha

    def in_flight_nodes(self) -> list[NodeInfo]:
        """Nodes asked and still waited for."""
        return [c.node for c in self._candidates.values() if c.status is _Status.IN_FLIGHT]

    def has_unasked(self) -> bool:
        """Whether a live candidate has not been asked yet."""
        return any(self._candidates[p].status is _Status.NEW for _, p in self._order)

    def give_up(self, node: NodeInfo) -> None:
        """Stop waiting for ``node`` (too slow): the next candidate takes its place among
        the k closest; its answer, should it come, still counts."""
        candidate = self._candidates[node.peer_id]
        if candidate.status is not _Status.IN_FLIGHT:
            return
        candidate.status = _Status.GIVEN_UP
        self.in_flight -= 1
        self._order.remove((candidate.distance, node.peer_id))
        address = candidate.node.address
        if address not in self._silent_addresses and self._count_silence(candidate):
            # nor is any request waited for that only a discredited reply's word sent
            for other in self._candidates.values():
                if other.status is _Status.IN_FLIGHT and self._unvouched(other):
                    self.give_up(other.node)
        if address is not None and address not in self._silent_addresses:
            self._silent_addresses.add(address)
            for other in self._candidates.values():  # (see the module rules)
                if other.node.address != address:
                    continue
                if other.status is _Status.IN_FLIGHT:
                    self.give_up(other.node)
                elif other.status is _Status.NEW:
                    other.status = _Status.SKIPPED
                    self._order.remove((other.distance, other.node.peer_id))
        if candidate.elsewhere is not None:
            self._ask_elsewhere(candidate, candidate.elsewhere)

    def resume(self, node: NodeInfo) -> None:
        """Wait for ``node`` again, given up on under a hedge delay that the lookup's first
        answer showed too short (our round trip grew): in flight, among the closest."""
        candidate = self._candidates[node.peer_id]
        if candidate.status is not _Status.GIVEN_UP or candidate.node != node:
            return
        candidate.status = _Status.IN_FLIGHT
        self.in_flight += 1
        bisect.insort(self._order, (candidate.distance, node.peer_id))

    def given_up(self) -> list[NodeInfo]:
        """Nodes given up on that never answered nor failed."""
        return [c.node for c in self._candidates.values() if c.status is _Status.GIVEN_UP]

    def on_answer(self, node: NodeInfo, nodes: Iterable[NodeInfo]) -> None:
        self.answers += 1
        candidate = self._candidates[node.peer_id]
        if self._superseded.pop((node.peer_id, node.address), None) is not None:
            # A request superseded by the node's new address answered first (the handshake
            # proved the node there): this address wins, the request at the new one is
            # superseded in turn (a liar naming a slow node at a silent address must not
            # hide its late answer).
            key = (node.peer_id, candidate.node.address)
            if candidate.status is _Status.ANSWERED:
                return  # (answered at the new address already)
            if candidate.status is _Status.IN_FLIGHT:
                self._superseded[key] = candidate
                self.in_flight -= 1
                self._order.remove((candidate.distance, node.peer_id))
            elif candidate.status is _Status.NEW:
                self._order.remove((candidate.distance, node.peer_id))
            elif candidate.status is _Status.GIVEN_UP:
                self._superseded[key] = candidate
            candidate.node, candidate.status = node, _Status.GIVEN_UP  # (answered below)
        if candidate.status is _Status.GIVEN_UP:  # late, but alive: back among the closest
            bisect.insort(self._order, (candidate.distance, node.peer_id))
        else:
            self.in_flight -= 1
        candidate.status = _Status.ANSWERED
        self._count_answer(candidate)
        closest_before = self._closest_seen
        if len(nodes := list(nodes)) > self.k:  # a reply names k contacts; more buy nothing
            nodes = heapq.nsmallest(self.k, nodes, key=self._distance)
        if nodes:
            self._referrers.add(node.peer_id)
        for other in nodes:
            self.add(other, candidate.hop + 1, node.peer_id)
        if self._closest_seen == closest_before:
            self.quiet += 1
            self.converged = self.converged or self.quiet >= self.settle_after
        else:
            self.quiet = 0

    def on_failure(self, node: NodeInfo) -> None:
        if self._superseded.pop((node.peer_id, node.address), None) is not None:
            self.failed += 1
            return
        candidate = self._candidates[node.peer_id]
        if node.address is not None:
            candidate.failed_at = (candidate.failed_at or set()) | {node.address}
        self.failed += 1
        if candidate.status is not _Status.GIVEN_UP:
            self.in_flight -= 1
            self._order.remove((candidate.distance, node.peer_id))
        candidate.status = _Status.FAILED
        if candidate.elsewhere is not None:
            self._ask_elsewhere(candidate, candidate.elsewhere)

    def done(self) -> bool:
        if self.in_flight:
            return False
        return all(self._candidates[p].status is _Status.ANSWERED for _, p in self._order[: self.k])

    def result(self) -> LookupResult:
        answered = [
            self._candidates[p]
            for _, p in self._order
            if self._candidates[p].status is _Status.ANSWERED
        ]
        return LookupResult(
            target=self.target,
            closest=tuple(c.node for c in answered[: self.k]),
            rounds=max((c.hop for c in answered), default=0),
            queried=self.queried,
            failed=self.failed,
        )


async def iterative_lookup(
    target: int,
    seeds: Iterable[NodeInfo],
    query: Query,
    *,
    k: int,
    alpha: int,
    exclude: PeerID | None = None,
    stop: Callable[[], bool] | None = None,
    wanted: Callable[[], int] | None = None,
    hedge_after: float = math.inf,
    may_hedge: Callable[[], bool] = lambda: True,
    on_given_up: Callable[[NodeInfo, bool], None] | None = None,
    max_in_flight: int | None = None,
    first_hedge: float | None = None,
    silent: Callable[[NodeInfo], bool] | None = None,
    on_excluded: Callable[[NodeInfo], None] | None = None,
) -> LookupResult:
    """Run one lookup of ``target`` from ``seeds``, with ``alpha`` queries in flight.

    ``query(node)`` returns the nodes ``node`` knows closest to the target, or None when
    it failed; it must bound its own time (a cancel scope) and not raise for a dead peer.
    ``stop()``, when given, is asked after each answer: True ends the lookup at once
    (queries in flight are cancelled), e.g. when a value was found. ``wanted()``, when
    given, caps the queries in flight at how many more answers could end the lookup (a get
    that needs two more holders keeps two in flight, not the converged lookup's k).

    Hedging: each silence of twice the first answer's delay (at least 50 ms, at most
    ``hedge_after`` seconds, which is also the wait before any answer) gives up on the
    oldest request in flight (see the module rules), when ``may_hedge()`` allows it (False
    while our own requests queue for a slot: then the silence is ours, not the peer's;
    the requests this lookup gave up on, which may hold those slots, are cancelled then).
    ``on_given_up(node, proven)`` is called for each request given up on that was still
    unanswered at the end (cancelled then); ``proven``: the lookup had an answer to a
    request sent no earlier, a hedge delay or more before it ended (our link worked while
    the node stayed silent; not so when a stall of ours ended just before the lookup).
    ``max_in_flight``: at most this many requests at once (the caller's slots: more would
    only queue, and stop the hedging). ``first_hedge``:
    the silence before any answer instead of ``hedge_after`` (at most that), e.g. from
    the first answers of the caller's recent lookups: frozen nodes among the first asked
    would each cost ``hedge_after`` otherwise. ``silent(node)``: whether ``node`` is
    asked without being waited for (see the module rules). ``on_excluded``: as
    :class:`LookupState`'s.

    Raises:
        Exception: whatever ``query`` raises (a bug there, not a dead peer).
    """
    state = LookupState(target, k, exclude, settle_after=alpha, on_excluded=on_excluded)
    for node in seeds:
        state.add(node, hop=1)
    send, receive = trio.open_memory_channel[tuple[NodeInfo, Sequence[NodeInfo] | None]](math.inf)

    # requests still waited on by their task, by node and address (a node named anew at
    # another address is asked there while its request at the first may still run)
    running: dict[tuple[PeerID, str | None], trio.CancelScope] = {}

    async def ask(node: NodeInfo) -> None:
        with trio.CancelScope() as scope:
            running[node.peer_id, node.address] = scope
            try:
                send.send_nowait((node, await query(node)))
            finally:
                del running[node.peer_id, node.address]

    hedge_delay = hedge_after if first_hedge is None else min(hedge_after, first_hedge)
    first_answer: float | None = None
    start = trio.current_time()
    sent_at: dict[tuple[PeerID, str | None], float] = {}
    unwaited: set[tuple[PeerID, str | None]] = set()  # known silent: asked, not waited for
    answered_at: list[float] = []  # when answers came, in order
    async with trio.open_nursery() as nursery:
        while True:
            limit = state.parallelism(alpha)
            if wanted is not None:
                limit = min(limit, max(wanted(), 1))
            if max_in_flight is not None:
                limit = min(limit, max_in_flight)
            while state.in_flight < limit:
                next_node = state.next_to_query()
                if next_node is None:
                    break
                sent_at[next_node.peer_id, next_node.address] = trio.current_time()
                nursery.start_soon(ask, next_node)
                if (
                    silent is not None
                    and silent(next_node)
                    and (state.in_flight > 1 or state.has_unasked())
                ):
                    state.give_up(next_node)  # asked, not waited for
                    unwaited.add((next_node.peer_id, next_node.address))
            received = None
            if state.in_flight == 0 and (state.answers or not running):
                try:  # (an answer already here still counts)
                    received = receive.receive_nowait()
                except trio.WouldBlock:
                    break
            else:
                waited_from = trio.current_time()
                # nobody left to ask, nobody answered yet: wait for those given up on (they
                # bound their own time; see the module rules)
                with trio.move_on_after(hedge_delay if state.in_flight else math.inf):
                    received = await receive.receive()
            if received is None:  # nothing answered for hedge_delay seconds
                if trio.current_time() - waited_from > 1.5 * hedge_delay:
                    # Woken that late, our own event loop is behind (a busy process): the
                    # answers may be here, unread. The silence is ours, not the peer's.
                    continue
                if may_hedge():
                    waiting = state.in_flight_nodes()
                    state.give_up(min(waiting, key=lambda n: sent_at[n.peer_id, n.address]))
                else:  # our requests queue for slots that those given up on may hold
                    for given_up in state.given_up():
                        if scope := running.get((given_up.peer_id, given_up.address)):
                            scope.cancel()
                continue
            node, answer = received
            if answer is not None and state.answers == 0:
                now = trio.current_time()
                first_answer = now - start
                hedge_delay = min(hedge_after, max(2 * first_answer, MIN_HEDGE_DELAY))
                # those given up on under a guess this answer's own round trip shows too
                # short: wait again (its round trip, not the lookup's time: frozen nodes
                # asked first delay the first answer, and must not be waited for again)
                window = max(2 * (now - sent_at[node.peer_id, node.address]), MIN_HEDGE_DELAY)
                for given_up in state.given_up():
                    key = (given_up.peer_id, given_up.address)
                    if key in running and key not in unwaited and now - sent_at[key] < window:
                        state.resume(given_up)
            if answer is None:
                state.on_failure(node)
            else:
                answered_at.append(trio.current_time())
                state.on_answer(node, answer)
                if stop is not None and stop():
                    break
        nursery.cancel_scope.cancel()  # requests given up on and still unanswered
    if on_given_up is not None:
        end = trio.current_time()
        for node in state.given_up():
            after = bisect.bisect_left(answered_at, sent_at[node.peer_id, node.address])
            on_given_up(node, after < len(answered_at) and end - answered_at[after] >= hedge_delay)
    return replace(state.result(), first_answer_s=first_answer)
