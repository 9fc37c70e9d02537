"""Data sources: datasets of files (JSONL, Parquet, Arrow, token files; local or remote) or rows in memory, read by ``(shard, row)``."""

from ..core.bad_records import RecordDecodeError
from ..sources.dataset import Dataset, InMemoryShard, as_dataset
from ..sources.digest import ShardChangedError
from ..sources.index import build_index
from ..sources.storage import CacheOptions, IoOptions, StorageError

__all__ = [
    "CacheOptions", "Dataset", "InMemoryShard", "IoOptions", "RecordDecodeError", "ShardChangedError", "StorageError",
    "as_dataset", "build_index",
]
