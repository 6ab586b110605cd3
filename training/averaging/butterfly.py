"""One butterfly all-reduce round, the member side: send every part, fetch every mean.

    for each part j (reduced by member j), concurrently:
        upload:   chunks of flat[span j], encoded, several calls in flight -> member j
        download: member j's result stream -> decoded straight into flat[span j]
                  (into one float32 tensor: into the tensor itself)
    our own part: a ReducerService (see reducing) runs beside them

A part whose upload failed is still downloaded (the reducer averaged the others). Its
result header stops the encoding of our remaining chunks of the part (it is final), so
that the results are read while our last calls wait for their answers: both ways share
one connection, whose reader stops behind 32 unread result items; once the download has
ended, those calls are cancelled (their answers change nothing). A part
whose download did not complete keeps our local values: ``FlatVector.store`` copies back
into the tensors only the spans that were fully received, and a part decoded into its
tensor as it came gets its local values back from flat[span j], where each chunk's were
kept before it was overwritten; so the tensors are exactly what the report says.
Everything ends by the round's deadline.
"""

from __future__ import annotations

import math

import trio

from peer import Peer
from protocol.codecs import Codec

from .buffers import BufferPool
from .config import AveragerConfig
from .downloads import SOLO_NOTE, Downloads
from .feedback import ErrorFeedback
from .layout import FlatVector, Float32Array
from .messages import ResultHeader
from .pieces import RangeCodec
from .plan import Liveness, Plan
from .reducer import DropReason
from .reducing import ReducerService
from .report import PartReport, part_status
from .uploads import WITHDRAW_BOUND as WITHDRAW_BOUND
from .uploads import Uploads


class Butterfly(Uploads, Downloads):
    """Runs one round for this member (its reducer, if any, is ``self.service``)."""

    def __init__(
        self,
        node: Peer,
        plan: Plan,
        flat: FlatVector,
        codec: Codec,
        config: AveragerConfig,
        methods: str,
        service: ReducerService | None,
        liveness: Liveness,
        zeros: Float32Array,
        pool: BufferPool,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.node = node
        self.plan = plan
        self.flat = flat
        self.codec = codec
        self.ranges = RangeCodec(codec, flat.offsets)  # int8: a blob per tensor of a chunk
        self.config = config
        self.methods = methods
        self.service = service
        self.liveness = liveness
        self._zeros = zeros
        self.pool = pool
        self.feedback = feedback  # topk: we send flat (values + residual) and note the blobs
        self.reports: dict[int, PartReport] = {}
        self.counted: set[int] = set()  # parts whose result header lists us (error feedback)
        self._fetched: dict[int, list[ResultHeader]] = {}  # part -> its header, once it came
        # parts decoded into their tensor as they came: elements done (see _fetch)
        self.in_tensor: dict[int, int] = {}
        # per part: cancelled by the result header, it ends the encoding of our chunks
        self._encoding: dict[int, trio.CancelScope] = {}
        remote = max(1, len(plan.reducers) - (service is not None))
        self.per_part_inflight = max(1, math.ceil(config.max_inflight / remote))
        self._downloads = trio.Semaphore(config.max_downloads)
        # remote parts whose exchange (upload and download) ended by itself: the others
        # were cut short by our deadline or a cancellation (see _withdraw)
        self._exchanged: set[int] = set()
        self.cut_by_deadline = 0  # parts whose report our step's deadline cut short

    async def run(self, cutoff: float, deadline: float) -> tuple[PartReport, ...]:
        try:
            with trio.move_on_at(deadline):
                async with trio.open_nursery() as nursery:
                    for index, reducer in enumerate(self.plan.reducers):
                        if reducer.peer_id != self.plan.me:
                            nursery.start_soon(self._exchange, index)
                    if self.service is not None:  # it loads our part while uploads start
                        nursery.start_soon(self._reduce, cutoff)
            for index, reducer in enumerate(self.plan.reducers):
                if index in self.reports:
                    continue
                self.cut_by_deadline += 1
                if reducer.peer_id == self.plan.me:
                    note = "the deadline passed before our own reduction finished"
                else:  # frozen, or too slow: out of this part either way
                    self.liveness.mark(reducer.peer_id, DropReason.TIMEOUT)
                    note = "the deadline passed before the reducer's result arrived"
                fetched = self._fetched.get(index)
                header = fetched[0] if fetched else None
                self.reports[index] = self._report(index, header, False, note)
            return tuple(self.reports[i] for i in range(len(self.plan.reducers)))
        finally:
            cut = [
                i for i, r in enumerate(self.plan.reducers)
                if r.peer_id != self.plan.me and i not in self._exchanged
                and self.liveness.bad.get(r.peer_id) is not DropReason.DEAD
            ]  # fmt: skip
            if cut:
                self.node.start_background(self._withdraw, cut, name="withdraw")
            # a part whose whole result came, then the deadline (or a cancellation) cut
            # its report short, does not count: its tensor gets our values back too
            for index in list(self.in_tensor):
                report = self.reports.get(index)
                if report is None or not report.received:
                    self._restore(index)

    def _report(
        self, index: int, header: ResultHeader | None, received: bool, note: str = ""
    ) -> PartReport:
        reducer = self.plan.reducers[index].peer_id
        counted = header is not None and self.plan.me in header.contributors
        if counted:
            self.counted.add(index)
        # no result received: nobody's values are in ours (the header's drops still explain)
        contributors = header.contributors if header is not None and received else ()
        dropped = dict(header.dropped) if header is not None else {}
        if not received and reducer in self.liveness.bad:
            dropped.setdefault(reducer, self.liveness.bad[reducer])
        return PartReport(
            index=index,
            reducer=reducer,
            span=self.plan.spans[index],
            status=part_status(self.plan.group, contributors, received),
            contributors=contributors,
            dropped=dropped,
            received=received,
            weight=header.weight if header is not None and received else 0.0,
            note="" if received else note,
            counted=counted,
        )

    async def _reduce(self, cutoff: float) -> None:
        assert self.service is not None
        part = self.service.part
        await self.service.load()
        outcome = await self.service.reduce(cutoff)
        received = outcome.weight > 0 and not self.service.solo
        note = outcome.note or "no contributions"
        if self.service.solo and not outcome.note:  # (an overflow's note says more)
            note = SOLO_NOTE
        self.reports[part] = self._report(part, self.service.header, received, note)
        await self.service.publish()
        await self.service.serve()

    # -- one remote part -----------------------------------------------------------------

    async def _exchange(self, index: int) -> None:
        reducer = self.plan.reducers[index]
        address = self.plan.address(reducer.peer_id)
        assert address is not None
        encoded = trio.Event()  # our values of the part are all encoded: results may land
        self._encoding[index] = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            if self.plan.weights[self.plan.me] is not None:
                nursery.start_soon(self._upload, index, address, encoded)
            else:
                encoded.set()
            header, received, note = await self._download(index, address, encoded)
            if header is not None:
                # The part is final: our chunk calls still under way change nothing (the
                # reducer refuses them), so they are not waited for. A member with a slow
                # uplink that reduces a part too had its last calls queued behind its own
                # result stream, and its step waited for them until its deadline.
                nursery.cancel_scope.cancel()
        self.reports[index] = self._report(index, header, received, note)
        self._exchanged.add(index)  # not reached when the deadline cut it short
