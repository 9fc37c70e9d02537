"""Data types that flow through a pipeline."""

from .core.records import Meta as Meta
from .core.records import Record as Record
from .core.records import SampleBatch as SampleBatch
from .core.records import Segment as Segment
from .core.bad_records import Failure as Failure

__all__ = ["Failure", "Meta", "Record", "SampleBatch", "Segment"]
