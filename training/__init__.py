"""Training on top of a peer: averaging (and, as they land, the collaborative optimizer,
state sync, sharding and the run loop behind ``swarm join``)."""

from .averaging import Averager as Averager
from .averaging import AveragerConfig as AveragerConfig
from .averaging import AveragingInfo as AveragingInfo
from .averaging import DropReason as DropReason
from .averaging import LayoutMismatchError as LayoutMismatchError
from .averaging import Outcome as Outcome
from .averaging import PartReport as PartReport
from .averaging import PartStatus as PartStatus

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
