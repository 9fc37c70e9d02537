"""Work sources: which sample comes at each position of the training stream."""

from ._estimate import Calibration as Calibration
from ._estimate import TokenEstimation as TokenEstimation
from ._mixture import MixtureSchedule as MixtureSchedule
from ._mixture import MixtureSpec as MixtureSpec
from ._source import SourceState as SourceState
from ._source import StaticMixtureWorkSource as StaticMixtureWorkSource

__all__ = ["Calibration", "MixtureSchedule", "MixtureSpec", "SourceState", "StaticMixtureWorkSource", "TokenEstimation"]
