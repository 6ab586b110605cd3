"""The Averager: average a list of tensors in place with whoever is ready at the same time.

    averager = Averager(node, prefix="run1/grads", tensors=[p.grad for p in params],
                        codec="int8", group_size=16, max_staleness=2)
    info = await averager.step(weight=32.0, epoch=7, timeout=30.0)
    info.averaged_fraction        # 1.0 when every part was averaged over the whole group

One step: copy the tensors into the flat buffer, find a group (matchmaking), run the
butterfly all-reduce (butterfly, reducing), copy back exactly the spans that were averaged,
and report what happened (report). Nothing waits beyond ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import trio

from peer import BackgroundPeer, Peer, PeerStoppedError
from protocol.codecs import NonFiniteError, get_codec
from protocol.identity import PeerID

from .arguments import check_chunk_fits, check_node, check_prefix
from .benching import Benching
from .buffers import BufferPool, SharedBuffer
from .butterfly import Butterfly
from .casts import TORCH_CASTS
from .config import AveragerConfig
from .descriptions import (
    cut_here,
    deadline_note,
    describe_settings,
    left_note,
    sentences,
    stale_note,
    twin_note,
)
from .feedback import ErrorFeedback
from .grouping import (
    LAYOUT_VERSION,
    MAX_EPOCH,
    MAX_STEP_TAG,
    Declaration,
    phase_of,
)
from .handlers import Handlers, _Active
from .layout import FlatVector, Float32Array
from .loopwatch import LoopWatch
from .matchmaking import Matchmaker
from .messages import method_prefix
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducing import ReducerService
from .report import AveragingInfo, Outcome, merge_dropped, outcome_of
from .round_state import MatchResult
from .stepping import MARGIN_SHARE as MARGIN_SHARE
from .stepping import MAX_MARGIN as MAX_MARGIN
from .stepping import MIN_MARGIN as MIN_MARGIN
from .stepping import Stepping
from .tensor_warnings import TensorWarnings

logger = logging.getLogger(__name__)

_LEFT_GROUPS = 8  # groups our last steps left, remembered (see Averager._left)


def network_time(node: Peer, local: Callable[[], float]) -> Callable[[], float]:
    """``local`` corrected by the node's network offset (``peer.netclock``): rounds are
    cut by the clock that the DHT's expirations and every peer of the run agree on."""
    network_clock = node.clock

    def now() -> float:
        seconds = local()
        if not isinstance(seconds, float | int) or isinstance(seconds, bool):
            raise TypeError(f"AveragerConfig.clock returned {seconds!r}, not a number of seconds")
        return seconds + network_clock.offset

    return now


_CLOSING: weakref.WeakSet[Averager] = weakref.WeakSet()
"""Averagers closed during a step: they keep their prefix until it ends (see ``close``)."""
_OPEN: weakref.WeakSet[Averager] = weakref.WeakSet()
"""Averagers whose methods their node serves (``Averager.opened`` finds them)."""


# step() and step_blocking() are Stepping's (stepping.py), the RPC handlers Handlers'
# (handlers.py); the step itself, _step, is here.
class Averager(Handlers, Benching, Stepping, TensorWarnings):
    """Averages ``tensors`` (in place) with peers that step under the same ``prefix``.

    Args:
        node: a running peer: ``peer.open_peer`` (then ``await step()``), or
            ``peer.run_in_background`` for plain scripts (then ``step()`` without
            ``await`` blocks; ``step_blocking()`` is the same).
        prefix: names the averaged quantity; peers with the same prefix average together
            (their tensor shapes, dtypes and codec must match).
        tensors: CPU, contiguous, floating, writable torch tensors or numpy arrays;
            averaged in place (in float32), from when the group is confirmed until the
            step returns: change them only between steps.
        codec, group_size, max_staleness: shortcuts for the same ``AveragerConfig`` fields;
            when given, they win over ``config``'s.
        config: everything else.

    Raises:
        TypeError: if ``node`` is not a peer (``run_in_background(...)`` itself, not the
            ``node`` its ``with`` block gives).
        TypeError, ValueError: for unusable tensors (not floating, read-only, sparse,
            inference tensors, or sharing memory with another one), config, or prefix (a
            non-empty str of at most ~480 bytes).
        ValueError: if an averager for ``prefix`` is already open on this node.
    """

    def __init__(
        self,
        node: Peer | BackgroundPeer,
        prefix: str,
        tensors: Sequence[torch.Tensor | np.ndarray[Any, Any]],
        *,
        codec: str | None = None,
        group_size: int | None = None,
        max_staleness: int | None = None,
        config: AveragerConfig | None = None,
    ) -> None:
        config = config or AveragerConfig()
        overrides: dict[str, Any] = {
            "codec": codec,
            "group_size": group_size,
            "max_staleness": max_staleness,
        }
        config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
        check_node(node)
        self._background = node if isinstance(node, BackgroundPeer) else None
        if isinstance(node, BackgroundPeer):
            node = node.peer
        self.node = node
        self.prefix = check_prefix(prefix)
        self.config = config
        self.flat = FlatVector.of(tensors)
        try:  # e.g. topk's fraction left in codec_params after a switch to int8
            self.codec = get_codec(config.codec, **config.codec_params)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"AveragerConfig.codec_params: {exc}") from None
        self.codec.casts = TORCH_CASTS  # same values as numpy's, many times faster
        check_chunk_fits(
            self.codec, config, self.flat.total, RangeCodec(self.codec, self.flat.offsets)
        )
        self.layout = self.flat.layout
        # peers must agree on the codec, the chunking, the group size (a group must fit
        # every member's) and the wire format (v2: raw result blobs reused; topk results
        # lossless with error feedback; v3: raw float32 payloads with the none codec; v4:
        # convex sums, the group size; v5: grids that n fills exactly; v6: the grid phase is
        # the median count; both so that peers form the same groups; v7: int8 blocks
        # restart at each tensor boundary, a blob per tensor of a chunk; v8: the group tag
        # in the confirmation, chunks, result requests and round pings),
        # and on the staleness rule: each reducer applies its own, so with different ones
        # parts were weighed differently, or a reducer waited until the cutoff for a sender
        # that had found itself stale and sent nothing
        self.layout_id = self.layout.fingerprint(
            f"{self.codec!r}|{config.chunk_bytes}|group_size={config.group_size}|{LAYOUT_VERSION}"
            f"|S={config.max_staleness}|decay={float(config.staleness_decay)!r}"
        )
        self._detail = describe_settings(self.layout, self.codec, config)
        if config.client_mode is False and node.rpc.listen_address is None:
            raise ValueError(
                "AveragerConfig(client_mode=False) asks this peer to reduce a part, which "
                "takes connections from the group, but its node accepts none (made with "
                "client_mode=True or listen=None): leave client_mode None"
            )
        client = node.client_mode if config.client_mode is None else config.client_mode
        self.client_mode = client or node.rpc.listen_address is None
        self._methods = method_prefix(prefix)
        self._matchmaker = Matchmaker(
            node,
            prefix,
            config,
            self.flat.total,
            network_time(node, config.clock or node.clock.local),
        )
        self._count = 0
        self._active: _Active | None = None
        # the coroutine of our last step() in async code until it first runs (see step)
        self._unstarted: weakref.ref[Any] | None = None
        # (round, group tag) of the groups our last steps left: a late message naming one
        # is not_found even while our next step, in a round of the same number, waits for
        # its own group (a review: a ping was answered alive, a result request held)
        self._left: deque[tuple[int, bytes]] = deque(maxlen=_LEFT_GROUPS)
        # senders our reducer dropped as nonfinite in our last step with a group (and its
        # round): one that does so again did not heal (see _bench_garbage)
        self._nonfinite: tuple[int, set[PeerID]] = (0, set())
        self._busy = False
        self._closed = False
        self._registered = False
        self._warned_unreferenced = False
        self._reference_checks = 0  # steps that asked (see _warn_if_unreferenced)
        chunk = config.chunk_elements
        self._scratch: Float32Array = np.empty(chunk, dtype=np.float32)
        self._zeros: Float32Array = np.zeros(chunk, dtype=np.float32)
        # upload blobs, reused across rounds: as many as calls can be in flight (the
        # per-part share of max_inflight is rounded up, see Butterfly)
        self._pool = BufferPool(config.max_inflight + config.group_size)
        self._results = SharedBuffer()  # our part's encoded mean, reused across rounds
        self._wide = SharedBuffer()  # our part's float64 sum (see wide_sum_wanted), reused
        # topk: what compression kept out of our contributions, sent with the next ones
        self.feedback = (
            ErrorFeedback(self.flat.total, self.codec, chunk) if self.codec.name == "topk" else None
        )
        if self._background is not None:  # the registry belongs to the peer's thread
            self._background.run_sync(self._register)
        else:
            self._register()

    def _register(self) -> None:
        """Serve this averager's methods until :meth:`close`.

        Raises:
            ValueError: if an averager for the same prefix is open on this node.
        """
        rpc = self.node.rpc
        try:
            rpc.register(f"{self._methods}.ping", self._on_ping)
        except ValueError:
            if any(a.node is self.node and a.prefix == self.prefix for a in list(_CLOSING)):
                raise ValueError(
                    f"the Averager for prefix {self.prefix!r} on this node was closed during a"
                    " step, which still serves its group: the prefix is free once that step"
                    " returns (by its timeout at the latest)"
                ) from None
            raise ValueError(
                f"an Averager for prefix {self.prefix!r} is already open on this node: "
                "close() it first (one no longer referenced too: its node serves it until "
                "closed; Averager.opened(node, prefix) gives it), or use another prefix"
            ) from None
        rpc.register(f"{self._methods}.join", self._on_join)
        rpc.register(f"{self._methods}.chunk", self._on_chunk)
        rpc.register_stream(f"{self._methods}.result", self._on_result)
        self._registered = True
        _OPEN.add(self)

    @staticmethod
    def opened(node: Peer | BackgroundPeer, prefix: str) -> Averager | None:
        """The Averager open for ``prefix`` on ``node`` (not closed, or closed during a
        step that still runs), or None. A dropped averager stays open, as its node serves
        its methods: this reaches it to ``close()`` it (a notebook cell that made one, run
        again after ``del``, was refused the prefix for good: an outside tester)."""
        peer = node.peer if isinstance(node, BackgroundPeer) else node
        return next((a for a in list(_OPEN) if a.node is peer and a.prefix == prefix), None)

    def __repr__(self) -> str:
        return f"<Averager {self.prefix!r}: {self.layout.describe()}, codec {self.codec.name}>"

    def __reduce__(self) -> Any:
        # sent to another process (a spawned DataLoader worker, a Pool argument)
        raise TypeError(
            "an Averager cannot be sent to another process (it serves its peer's RPCs "
            "here); step it in this process, or make one on a peer of that process"
        )

    def __enter__(self) -> Averager:
        """``with Averager(...) as averager:`` closes it when the block ends (sync or async
        code alike: :meth:`close` does not block)."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving this averager's RPCs (requests for them answer ``unknown_method``
        from now on); the prefix is free again for a new Averager on this node. During a
        step, that step goes on serving its group and closes the averager when it ends
        (its group would otherwise wait for our part until the cutoff)."""
        if self._closed:
            return
        self._closed = True
        if self._background is None:
            self._release()
        else:  # the registry belongs to the peer's thread; a stopped peer serves nothing
            with contextlib.suppress(PeerStoppedError):
                self._background.run_sync(self._release)

    def _release(self) -> None:
        if not self._busy:
            self._unregister()
        else:  # the step unregisters when it ends
            _CLOSING.add(self)

    def _unregister(self) -> None:
        _CLOSING.discard(self)
        if self._registered:
            self._registered = False
            _OPEN.discard(self)
            for name in ("ping", "join", "chunk", "result"):
                self.node.rpc.unregister(f"{self._methods}.{name}")

    # -- the step ------------------------------------------------------------------------

    async def _step(self, weight: float, epoch: int, deadline: float) -> AveragingInfo:
        t0 = trio.current_time()
        self._matchmaker.bench.tick()
        me = Declaration(
            self.node.peer_id,
            None if self.client_mode else self.node.address,
            weight,
            epoch,
            self.config.bandwidth,
            self.layout_id,
            self._count,
            self.flat.total,
            self.config.group_size,
            self._detail,
            secrets.randbelow(MAX_STEP_TAG - 1) + 1,  # this step's tag (grouping.closed_marker)
        )
        match = await self._find_group(me, deadline)
        t1 = trio.current_time()
        # The grid phase the peers of our layout follow (a median: no one peer chooses it):
        # a newcomer, or a peer that missed rounds, takes it up.
        seen_phase = self._matchmaker.seen_phase
        if seen_phase is not None:
            self._count = seen_phase
        withdraw_by = min(deadline, t1 + self.config.join_timeout)
        if match.confirmation is None:
            await self._matchmaker.withdraw(match.round, withdraw_by)
            outcome = Outcome.ALONE if match.alone else Outcome.UNCONFIRMED
            return AveragingInfo(
                outcome, match.round, (me.peer_id,), match.leader, (), self.flat.total,
                epoch=epoch, matchmaking_s=t1 - t0, me=me.peer_id,
                note=sentences(twin_note(self.node), match.note),
            )  # fmt: skip
        conf = match.confirmation
        plan = Plan.of(conf, me.peer_id, self.config)
        versions = self.flat.versions()  # read and written from here on: see _warn_if_changed
        # One round more than the group's phase, the same for every member (the median of
        # the counts that the confirmation lists); it wraps within what a declaration
        # carries: a count of 2**62 must not push our declarations out of range, where
        # nobody reads them.
        self._count = (max(self._count, phase_of(conf.members)) + 1) % MAX_EPOCH
        feedback = self.feedback
        if feedback is not None:  # topk: flat = tensors + residual, sparsified as sent
            feedback.begin(self.flat)
            if plan.my_part is not None and plan.weights[me.peer_id] is not None:
                start, stop = plan.spans[plan.my_part]
                # non-finite values: the reducer drops our own values as such
                with contextlib.suppress(NonFiniteError):
                    feedback.sparsify_own(plan.my_part, self.flat.array[start:stop], start)
        # otherwise the reducer loads our part itself once the uploads are under way
        # Our own deadline, not receipt + the leader's budget (its own time left): a leader
        # whose caller left it 0.02 s cut every member's round to that, where the same
        # short timeout on any other member cost the others nothing. A leader that leaves
        # first is then a member that left, as any other (confirmation.py, _lead).
        cutoff = t1 + (deadline - t1) * (1 - self.config.result_share)
        liveness = Liveness(self.node, plan, f"{self._methods}.ping", self.config.stall_timeout / 2)
        service = None
        if plan.my_part is not None:
            service = ReducerService(
                plan, plan.my_part, self.flat, self.codec, self.config, liveness,
                self._scratch, self._results, self._wide,
            )  # fmt: skip
        assert self._active is not None
        self._active.service = service
        self._active.group_id = plan.group_id
        self._active.ready.set()
        butterfly = Butterfly(
            self.node, plan, self.flat, self.codec, self.config, self._methods, service,
            liveness, self._zeros, self._pool, feedback,
        )  # fmt: skip
        watch = LoopWatch()
        async with trio.open_nursery() as nursery:  # the DHT store runs beside the butterfly
            nursery.start_soon(self._matchmaker.withdraw, match.round, max(withdraw_by, cutoff))
            nursery.start_soon(watch.run)
            parts = await butterfly.run(cutoff, deadline)
            watch.stop()
            self._warn_if_changed(versions)
            in_place = service.part if service is not None and service.in_place else None
            for part in parts:  # the received parts into the tensors (unless already there)
                there = part.index == in_place or butterfly.in_its_tensor(part.index)
                if part.received and not there:
                    self.flat.store(part.span)
            self.flat.mark_written(part.span for part in parts if part.received)
            if feedback is not None:
                feedback.finish(butterfly.counted)
            allreduce_s = trio.current_time() - t1  # not the DHT store's wait, if longer
        self._bench_garbage(conf.round, match.leader, parts, liveness)
        dropped = merge_dropped(parts)
        stall = watch.note(self.config.stall_timeout / 2, dropped=bool(dropped))
        return AveragingInfo(
            outcome_of(parts, self.flat.total), conf.round, plan.group, match.leader, parts,
            self.flat.total, epoch=plan.max_epoch, matchmaking_s=t1 - t0,
            allreduce_s=allreduce_s, dropped=dropped,
            note=sentences(
                twin_note(self.node),
                match.note,
                stall,
                stale_note(plan, self.config.max_staleness),
                cut_here(service),
                # (a stall of stall_timeout or more: members then drop us; a shorter one
                # is no likely cause of a reducer that never served: a re-check)
                deadline_note(
                    butterfly.cut_by_deadline,
                    stalled=watch.longest >= self.config.stall_timeout,
                ),
                left_note(dropped, liveness),
            ),
            me=me.peer_id,
            group_id=int.from_bytes(plan.group_id[:8], "big"),  # (the report's: a number)
        )  # fmt: skip

    async def _find_group(self, me: Declaration, deadline: float) -> MatchResult:
        """The matchmaker's answer, its note telling when this process stood still during
        matchmaking (a suspended laptop read "unconfirmed: the timeout ended the gather
        window" with no word of why)."""
        watch = LoopWatch("matchmaking")
        error: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            try:
                match = await self._matchmaker.find_group(me, deadline, on_round=self._enter_round)
            except BaseException as exc:  # re-raised below, outside the nursery (no group)
                error = exc
            finally:
                watch.stop()
        if error is not None:
            raise error
        stall = watch.note(self.config.stall_timeout / 2)
        # the stall first: the matchmaker's guesses of why nobody joined come after the
        # likelier cause (a tester's suspended leader read "they may have read it before
        # our declaration reached them" first)
        return replace(match, note=sentences(stall, match.note)) if stall else match

    def _enter_round(self, number: int) -> None:
        if self._active is not None:
            self._active.ready.set()
        self._active = _Active(number)
