"""Confirming a round's groups, once every peer has computed them from the declarations.

The leader (a group's first non-client member) waits for the expected members' join calls
(at most ``join_timeout`` after the slot's close) and answers every joiner with the same
``GroupConfirmation``. A member calls the leader's join and waits for that answer; when the
leader fails at once (unreachable, no averager, not in the round: a ghost), it calls the
next-ranked non-client member instead, telling it whom it skipped, and leads the group
itself when every member ranked before it is gone. A non-leader called by a member that
skipped our own leader pings that leader first: it redirects the caller when the leader
answers, and otherwise moves on as the caller did.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import trio

from peer import Peer, PeerUnavailableError, RemoteError, Reply, Request
from peer.errors import PeerBusyError
from protocol.address import Address
from protocol.errors import ProtocolError
from protocol.identity import PeerID

from .bench import Bench
from .config import AveragerConfig
from .grouping import Declaration, round_key
from .layout import bounded_bandwidths, split_spans
from .messages import MAX_GROUP_ID, GroupConfirmation, JoinRequest, method_prefix
from .round_state import LayoutMismatchError, MatchResult, RoundState

GONE_CODES = frozenset({"not_found", "unknown_method"})
"""Remote errors to a join or a ping that tell at once that the peer leads nothing in this
round: it runs no averager under the prefix, or is not in the round. With a refused or
broken connection (``PeerUnavailableError``, but not ``PeerBusyError``: that one is up),
they make a member skip that leader for the next-ranked member (``Confirmation._join``)."""


def _nobody_joined(state: RoundState) -> str:
    """Why a leader is alone, as far as it can tell: its expected members read the round
    otherwise (a grid trial: 1 step in 240, the others grouped without our declaration) or
    are gone."""
    waited, left = len(state.expected), len(state.left)
    gone = f"{left} other peer(s) we led had left the round (a ping said so)" if left else ""
    if not waited:
        return f"nobody joined: {gone}" if gone else "nobody joined"
    note = (
        f"nobody joined: we led {waited} other peer(s) by our read of the round; they may"
        f" have read it before our declaration reached them (storing it took"
        f" {state.store_s:.2f} s) and grouped without us, or be gone"
    )
    return f"{note}; {gone}" if gone else note


@dataclass(frozen=True, slots=True)
class _Failed:
    """A join call that brought no answer: why, and whether the callee is gone (a fast,
    unambiguous failure: skip it)."""

    note: str
    gone: bool = False
    retry: bool = False
    why: str = ""  # in a word, for the report of a member that skipped it


class Confirmation:
    """The confirmation of :class:`~.matchmaking.Matchmaker`, one of its base classes (the
    attributes below are the matchmaker's)."""

    node: Peer
    prefix: str
    config: AveragerConfig
    total: int
    clock: Callable[[], float]
    current: RoundState | None
    led: RoundState | None
    bench: Bench

    def _expected(self, state: RoundState, group: Sequence[Declaration]) -> set[PeerID]:
        """The members a leader waits for: its group, less itself, those found gone and
        those it benched (refused when they join)."""
        expected = {d.peer_id for d in group if d.peer_id not in self.bench}
        return expected - {state.me.peer_id} - state.gone

    def _after_slot_close(self, state: RoundState, seconds: float) -> float:
        """``seconds`` after the round's slot closes, or after now once it has closed (in
        trio time)."""
        close_in = max(state.number * self.config.gather_window - self.clock(), 0.0)
        return trio.current_time() + close_in + seconds

    async def _lead(
        self,
        state: RoundState,
        group: Sequence[Declaration],
        deadline: float,
        declared: int,
        not_before: float = 0.0,
    ) -> MatchResult:
        # Until join_timeout after the slot's close, even when we closed early: a member
        # with no history of the swarm (it just restarted) reads the round only at the
        # close, and a leader that had given up on it by then left it alone round after
        # round (7 to 13 rounds in the averaging soak), while the others remembered it.
        # Such a member is in the round and answers a ping; one that is not any more is not
        # waited for (_drop_if_gone).
        until = max(self._after_slot_close(state, self.config.join_timeout), not_before)
        with trio.move_on_at(min(deadline, until)):
            async with trio.open_nursery() as nursery:
                for member in group:
                    if member.peer_id in state.expected:
                        nursery.start_soon(self._drop_if_gone, state, member)
                while not state.expected <= state.joined.keys():
                    await state.changed.wait()
                nursery.cancel_scope.cancel()
        last = len(state.order)
        members = sorted(  # as the confirmation carries them: without step tags
            (replace(d, step=0) for d in state.joined.values()),
            key=lambda d: (state.order.get(d.peer_id, last), d.peer_id.raw),
        )
        # What is left of our own step: members keep their own deadlines (averager.py), so
        # a leader given little time does not cut their rounds short.
        state.budget = max(deadline - trio.current_time(), 1e-3)
        if len(members) < 2:
            state.answered.set()
            return MatchResult(
                state.number, None, state.me.peer_id, declared, _nobody_joined(state), alone=True
            )
        reducers = [m.bandwidth for m in members if not m.client_mode]
        spans = split_spans(self.total, bounded_bandwidths(reducers))
        state.confirmation = GroupConfirmation(
            state.number,
            tuple(members),
            tuple(spans),
            state.budget,
            group_id=secrets.randbelow(MAX_GROUP_ID - 1) + 1,  # its tag (messages.py)
        )
        state.answered_at = trio.current_time()
        state.answered.set()
        return MatchResult(state.number, state.confirmation, state.me.peer_id, declared)

    async def _drop_if_gone(self, state: RoundState, member: Declaration) -> None:
        """Stop waiting for an expected ``member`` that a ping finds out of the round (see
        ``_answers``): its step was cancelled after it declared, its averager is closed, or
        its process is gone. Its declaration stays in the round key until it expires, and
        the others close early on it: the leader used to wait for it until join_timeout
        after the slot's close (1 s more in 3 of 4 trials). A client-mode member has no
        address to ping: it is waited for as before."""
        if member.address is None or member.peer_id in state.joined:
            return
        if await self._answers(state, member.address) or member.peer_id in state.joined:
            return
        state.expected.discard(member.peer_id)
        state.left.add(member.peer_id)
        state.notify()

    async def _join(
        self, state: RoundState, group: Sequence[Declaration], deadline: float, declared: int
    ) -> MatchResult:
        """Join the first non-client member, in rank order, that does not fail at once; lead
        the rest ourselves when every one before us did (``_take_over``). Each call says
        whom we skipped, so that the callee checks them too (``on_join``)."""
        ranked = [d for d in group if not d.client_mode]
        note, retry = "the leader did not confirm in time", False
        redirect: tuple[PeerID, str] | None = None
        redirected = False
        passed: list[str] = []  # the skipped leaders and why (the report's note)
        # ranked members that sent us garbage lately: we skip them as leaders (bench.py)
        benched = {d.peer_id for d in ranked if d.peer_id in self.bench}
        noted: set[PeerID] = set()
        try:
            while True:
                if redirect is None:
                    pick = None
                    for d in ranked:
                        if d.peer_id in state.gone:
                            continue
                        if d.peer_id not in benched:
                            pick = d
                            break
                        if d.peer_id not in noted:  # skipped as if gone (see bench.py)
                            noted.add(d.peer_id)
                            passed.append(f"{d.peer_id.short()} (benched by us)")
                    if pick is None:  # we are in client mode, and every full member failed
                        if noted:
                            note = "every full member of our group failed or was benched by us"
                        break
                    if pick.peer_id == state.me.peer_id:
                        return await self._take_over(state, group, deadline, declared, passed)
                    assert pick.address is not None  # ranked: not in client mode
                    target, address = pick.peer_id, pick.address
                else:
                    (target, address), redirect = redirect, None
                    if target in self.bench:
                        note = f"redirected to {target.short()}, which we benched"
                        break
                state.leader, state.leader_address = target, address
                state.notify()
                skipped = tuple(d.peer_id for d in ranked if d.peer_id in state.gone)
                body = JoinRequest(state.number, state.me, skipped).to_body()
                answer = await self._call_join(state, target, address, body)
                if isinstance(answer, _Failed):
                    note, retry = answer.note, answer.retry
                    if answer.gone and not redirected:  # the next-ranked member, then
                        state.gone.add(target)
                        passed.append(f"{target.short()} ({answer.why})")
                        continue
                    break
                status = answer.body.get("status")
                if status == "ok":
                    try:
                        conf = GroupConfirmation.from_body(answer.body, self.total)
                        problem = _misstated(conf, state.me, self.config.group_size, self.total)
                    except ProtocolError as exc:
                        problem = f"malformed: {exc}"
                    if problem is not None:
                        # No honest leader sends one, and unbenched it would lead this
                        # group's every round: an unconfirmed round leaves the grid phase,
                        # and so the ranking, as it was (a hostile peer's trial, 12 of 12).
                        self.bench.record(
                            target, f"a bad confirmation in round {state.number}: {problem}"
                        )
                        note = f"the leader's confirmation is {problem} (we benched it)"
                        break
                    if conf.round == state.number and any(
                        m.peer_id == state.me.peer_id for m in conf.members
                    ):
                        return MatchResult(
                            state.number, conf, target, declared, _passed_note(passed)
                        )
                    note = "left out by the leader"
                    retry = True
                elif status == "not_leader":
                    leader, where = answer.body.get("leader"), answer.body.get("address")
                    if isinstance(leader, str) and isinstance(where, str) and not redirected:
                        try:
                            redirect = _redirect(leader, where)
                        except ProtocolError as exc:
                            note = f"the leader redirected us to a malformed address: {exc}"
                            break
                        redirected = True
                        note = "redirected, then no confirmation in time"
                        continue
                    if not redirected:
                        note = "the leader leads no group"
                elif status == "benched":  # it saw garbage from us (see bench.py)
                    reason = answer.body.get("reason")
                    note = "the leader left us out: it benched us"
                    if isinstance(reason, str):
                        note += ": " + "".join(c if c.isprintable() else "?" for c in reason[:200])
                else:
                    note = f"the leader answered {status!r}"
                    # closed, or full (its group took others: our view of the round
                    # differed, as when the group left us out): no place for us here
                    retry = status in ("closed", "full")
                break
        finally:
            state.settled = True
            state.notify()
        if passed:
            note = f"{note}; {_passed_note(passed)}"
        return MatchResult(state.number, None, state.leader, declared, note, retry=retry)

    async def _call_join(
        self, state: RoundState, target: PeerID, address: str, body: dict[str, Any]
    ) -> Reply | _Failed:
        """One join call, until ``state.give_up``, or until ``on_join`` finds ``target``
        gone meanwhile (a ping it made for another member) and cuts it short.

        Raises:
            LayoutMismatchError: the callee refused our layout.
        """
        scope = trio.CancelScope(deadline=state.give_up)
        state.attempt = (target, scope)
        try:
            with scope:
                # with the PeerID of the leader we mean: whoever answers there must be it
                where = Address.parse(address).with_peer_id(target)
                return await self.node.rpc.call(where, self._method("join"), body)
        except RemoteError as exc:
            if exc.code == "mismatch":
                raise LayoutMismatchError(exc.message) from None
            gone = exc.code in GONE_CODES  # not in that round, or runs no averager
            return _Failed(f"the leader refused: {exc}", gone, gone, exc.code)
        except PeerBusyError as exc:  # up, but turned us away for now
            return _Failed(f"the leader is unreachable: {exc}", retry=True)
        except PeerUnavailableError as exc:
            return _Failed(f"the leader is unreachable: {exc}", True, True, "unreachable")
        except ProtocolError as exc:  # its address or its answer did not parse
            return _Failed(f"the leader's address or answer is malformed: {exc}")
        finally:
            state.attempt = None
        if target in state.gone:
            return _Failed("the leader failed a ping meanwhile", True, True, "failed a ping")
        # named: a leader that holds every join (a hostile one ground its rank to lead
        # every round) reads as a pattern only when the notes say who it was
        return _Failed(f"the leader {target.short()} did not confirm in time")

    async def _take_over(
        self,
        state: RoundState,
        group: Sequence[Declaration],
        deadline: float,
        declared: int,
        passed: list[str],
    ) -> MatchResult:
        """Every non-client member ranked before us failed at once: lead the group without
        them, as its first leader would have."""
        me = state.me
        state.is_leader = True
        state.leader, state.leader_address = me.peer_id, me.address
        state.expected = self._expected(state, group)
        state.joined[me.peer_id] = me
        state.notify()
        # Members that found the leader gone later than we did (its connection broke while
        # they waited) get join_timeout too, and our answer well before they give up.
        not_before = min(
            trio.current_time() + self.config.join_timeout,
            state.give_up - self.config.stall_timeout / 2,
        )
        result = await self._lead(state, group, deadline, declared, not_before)
        note = f"we led: {_passed_note(passed)}"
        return replace(result, note=f"{result.note}; {note}" if result.note else note)

    # -- leader side ---------------------------------------------------------------------

    async def on_join(self, request: Request) -> Reply:
        """The join RPC: wait until this round's group is final, then answer.

        Raises:
            RemoteError: ``mismatch`` for another layout; ``not_found`` when we are not in
                that round.
        """
        join = JoinRequest.from_body(request.peer_id, request.body, self.config.group_size)
        state = self.current
        if state is None or state.number != join.round:
            led = self.led
            if (
                led is not None
                and led.number == join.round
                and led.confirmation is not None
                and any(m.peer_id == request.peer_id for m in led.confirmation.members)
            ):
                # A member we confirmed asks again (its answer was lost with a connection,
                # or a peer it asked sent it back to us): the same answer while our step is
                # in the round. "not in round" would make it skip us as gone. The budget
                # is what is left of our step's time, as the first answer said.
                left = led.confirmation.budget - (trio.current_time() - led.answered_at)
                return Reply(replace(led.confirmation, budget=max(left, 0.001)).to_body())
            raise RemoteError("not_found", f"not in round {join.round}")
        if join.declaration.layout != state.me.layout:
            raise RemoteError(
                "mismatch",
                "tensor layout, codec, group_size or staleness rule differs: ours "
                f"{state.me.describe_layout()}, yours {join.declaration.describe_layout()}",
            )
        state.wake.set()
        await state.closed.wait()
        if not state.is_leader:
            reply = await self._as_member(state, join, request.peer_id)
            if reply is not None:
                return reply
        if state.answered.is_set():
            return Reply({"status": "closed"})
        joiner = join.declaration.peer_id
        if (why := self.bench.reason(joiner)) is not None:  # it sent us garbage lately
            return Reply({"status": "benched", "reason": why})
        unexpected = False  # (a caller we did not expect, counted as expected once checked)
        if joiner not in state.joined:
            if joiner in state.elsewhere:
                # We saw it declare, and the round put it in another group: one peer that
                # joins every group with room (and serves none) spoiled each of them. A
                # caller we did not see at all (another view of the round) is welcome.
                return Reply({"status": "full"})
            # room for those we expect first: a caller we did not expect (another view of
            # the round, or an intruder) must not take the place of a member on its way
            missing = state.expected - state.joined.keys() - {joiner}
            if len(state.joined) + len(missing) >= self.config.group_size:
                return Reply({"status": "full"})
            unexpected = joiner not in state.expected
            if unexpected and not await self._declared_now(state, joiner):
                # Nor one that never declared: it skipped the check above by not declaring,
                # joined every leader with room, took its share of the vector and froze
                # (an outside review: every honest step partial, 0 % averaged, held to its
                # timeout). Declared, it is placed by the ranking like everyone else.
                return Reply({"status": "full"})
            if state.answered.is_set():  # (answered meanwhile: our deadline came)
                return Reply({"status": "closed"})
            state.joined[joiner] = join.declaration
            state.notify()
        state.waiting[joiner] += 1
        try:
            await state.answered.wait()
        finally:
            state.waiting[joiner] -= 1
            if not state.answered.is_set() and not state.waiting[joiner]:
                # The caller left before we answered (its connection ended: the handler is
                # cancelled; or it gave up): confirmed, it would be waited for as dead, a
                # whole stall_timeout (a client-trial member killed after its join).
                state.joined.pop(joiner, None)
                if unexpected:  # (counted as expected since its check: not waited for)
                    state.expected.discard(joiner)
                state.notify()
        conf = state.confirmation
        if conf is None or not any(m.peer_id == request.peer_id for m in conf.members):
            return Reply({"status": "closed"})
        return Reply(conf.to_body())

    async def _declared_now(self, state: RoundState, joiner: PeerID) -> bool:
        """Whether ``joiner`` has a declaration (or a "done" marker) in our round now: a
        read of the round key, within ``join_timeout`` (a caller with another view of the
        round declared before it read, so before it joins). Meanwhile the caller counts as
        expected, so that we do not answer the others without it (a read of 0.5 s on a
        slow link let the leader confirm first, and an honest caller with another view
        was left alone in the next round)."""
        state.expected.add(joiner)
        declared = False
        try:
            with trio.move_on_after(self.config.join_timeout):
                entries = await self.node.dht.get_entries(round_key(self.prefix, state.number))
                declared = str(joiner) in entries
        finally:
            if not declared:
                state.expected.discard(joiner)
                state.notify()
        return declared

    async def _as_member(
        self, state: RoundState, join: JoinRequest, caller: PeerID
    ) -> Reply | None:
        """A join reached us, not a leader: point the caller at the leader we follow. When
        the caller skipped that leader (it failed at once for the caller), ping it first: if
        it answers, redirect the caller; if not, we skip it too, and once our own walk has
        moved on (our call fails, or we cut it), answer from where it stands. None: we lead
        now (every peer ranked before us is gone), so the caller joins us."""
        while not state.is_leader:
            target, address = state.leader, state.leader_address
            if target is None or target == caller:
                return Reply({"status": "closed"})
            if state.settled:
                if target in state.gone:
                    return Reply({"status": "closed"})
            elif target in state.gone:  # our walk is leaving it: wait for its next step
                if trio.current_time() >= state.give_up:
                    return Reply({"status": "closed"})
                with trio.move_on_at(state.give_up):
                    await state.changed.wait()
                continue
            elif target in join.skipped and target not in state.alive:
                if await self._answers(state, address):
                    state.alive.add(target)
                else:
                    state.gone.add(target)
                    if state.attempt is not None and state.attempt[0] == target:
                        state.attempt[1].cancel()
                continue
            return Reply({"status": "not_leader", "leader": str(target), "address": address})
        return None

    async def _answers(self, state: RoundState, address: str | None) -> bool:
        """Whether the peer at ``address`` is in this round: a ping (answered at once by a
        live averager), until ``stall_timeout / 2`` or our give-up time. False only for the
        failures that make a member skip a leader (see ``GONE_CODES``)."""
        if address is None:
            return False
        bound = min(state.give_up, trio.current_time() + self.config.stall_timeout / 2)
        with trio.move_on_at(bound):
            try:
                await self.node.rpc.call(
                    Address.parse(address), self._method("ping"), {"round": state.number}
                )
            except RemoteError as exc:
                return exc.code not in GONE_CODES
            except PeerUnavailableError as exc:
                return isinstance(exc, PeerBusyError)
            except ProtocolError:
                return True
        return True

    def _method(self, name: str) -> str:
        return f"{method_prefix(self.prefix)}.{name}"


def _misstated(conf: GroupConfirmation, me: Declaration, group_size: int, total: int) -> str | None:
    """What makes a well-formed confirmation one that no honest leader sends (None: nothing):
    more members than ``group_size`` (a leader takes at most that many joiners), a member of
    another layout (a join of another layout is refused), our own declaration other than
    we sent it (a leader that forged our weight or epoch had the others average with a
    weight, or drop themselves as stale against an epoch, that we never declared), or parts
    cut otherwise than the listed bandwidths cut them (a hostile leader made itself the
    reducer of the whole vector, every other part empty, and set every value: an outside
    review; the cut is a pure function of the members it lists, bounded as in spans.py)."""
    reducers = [m.bandwidth for m in conf.members if not m.client_mode]
    try:
        expected = split_spans(total, bounded_bandwidths(reducers))
    except ValueError as exc:  # no reducer, or bandwidths that cut nothing
        return f"listing members whose bandwidths cut no parts ({exc})"
    if [tuple(span) for span in conf.spans] != [tuple(span) for span in expected]:
        return "cutting the parts otherwise than its members' declared bandwidths do"
    if len(conf.members) > group_size:
        return f"listing {len(conf.members)} members, more than our group_size {group_size}"
    sent = Declaration.from_wire(me.peer_id, me.to_wire(tagged=False))  # as the leader read it
    for member in conf.members:
        if member.layout != me.layout:
            return f"listing {member.peer_id.short()} with another layout"
        if member.peer_id == me.peer_id and member != sent:
            return (
                f"misstating our declaration (weight {member.weight:g}, epoch {member.epoch}; "
                f"we declared weight {sent.weight:g}, epoch {sent.epoch})"
            )
    return None


def _passed_note(passed: list[str]) -> str:
    """The leaders a member skipped (each with why), for the report's note."""
    return f"ranked leader(s) skipped: {', '.join(passed)}" if passed else ""


def _redirect(leader: str, where: str) -> tuple[PeerID, str]:
    """The leader and address a ``not_leader`` answer names, the address carrying that
    leader's PeerID: dialed so, only that leader can answer there (a reviewer: a redirect to
    one peer's name at another's bare ``HOST:PORT`` had members report a peer that never
    took part as their leader, and join a leader they had benched).

    Raises:
        ProtocolError: a malformed PeerID or address, or one that names another peer.
    """
    peer_id = PeerID.from_base58(leader)
    address = Address.parse(where)
    if address.peer_id is not None and address.peer_id != peer_id:
        raise ProtocolError(f"the address {where} names another peer than {leader}")
    return peer_id, str(address.with_peer_id(peer_id))
