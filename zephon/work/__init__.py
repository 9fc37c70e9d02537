"""Work sources: which sample comes at each position of the training stream."""

from ._mixture import MixtureSpec as MixtureSpec
from ._source import SourceState as SourceState
from ._source import StaticMixtureWorkSource as StaticMixtureWorkSource

__all__ = ["MixtureSpec", "SourceState", "StaticMixtureWorkSource"]
