"""Data sources: datasets of JSONL files or in-memory rows, read by ``(shard, row)``."""

from ._dataset import Dataset as Dataset
from ._dataset import InMemoryShard as InMemoryShard
from ._dataset import as_dataset as as_dataset
from ._jsonl import ShardChangedError as ShardChangedError

__all__ = ["Dataset", "InMemoryShard", "ShardChangedError", "as_dataset"]
