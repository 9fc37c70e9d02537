"""Work sources: which sample comes at each position of the training stream."""

from ..sources.estimate import Calibration as Calibration
from ..sources.estimate import TokenEstimation as TokenEstimation
from ..sources.mixture import MixtureSchedule as MixtureSchedule
from ..sources.mixture import MixtureSpec as MixtureSpec
from ..sources.work_source import SourceState as SourceState
from ..sources.work_source import StaticMixtureWorkSource as StaticMixtureWorkSource

__all__ = ["Calibration", "MixtureSchedule", "MixtureSpec", "SourceState", "StaticMixtureWorkSource", "TokenEstimation"]
