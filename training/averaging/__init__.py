"""Decentralized averaging: DHT matchmaking and a fault-tolerant butterfly all-reduce.

See ``docs/averaging.md`` for the protocol, its guarantees and the report fields.
"""

from .averager import Averager as Averager
from .config import AveragerConfig as AveragerConfig
from .reducer import DropReason as DropReason
from .report import AveragingInfo as AveragingInfo
from .report import Outcome as Outcome
from .report import PartReport as PartReport
from .report import PartStatus as PartStatus
from .round_state import LayoutMismatchError as LayoutMismatchError

__all__ = [
    "Averager",
    "AveragerConfig",
    "AveragingInfo",
    "DropReason",
    "LayoutMismatchError",
    "Outcome",
    "PartReport",
    "PartStatus",
]
