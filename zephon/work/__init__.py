"""Work sources: which sample comes at each position of the training stream."""

from ..sources.estimate import Calibration, TokenEstimation
from ..sources.mixture import MixtureSchedule, MixtureSpec
from ..sources.work_source import SourceState, StaticMixtureWorkSource

__all__ = ["Calibration", "MixtureSchedule", "MixtureSpec", "SourceState", "StaticMixtureWorkSource", "TokenEstimation"]
