"""Data types that flow through a pipeline."""

from .core.bad_records import Failure
from .core.records import Meta, Record, SampleBatch, Segment

__all__ = ["Failure", "Meta", "Record", "SampleBatch", "Segment"]
