"""Data types that flow through a pipeline."""

from ._records import Meta as Meta
from ._records import Record as Record
from ._records import SampleBatch as SampleBatch
from ._records import Segment as Segment

__all__ = ["Meta", "Record", "SampleBatch", "Segment"]
