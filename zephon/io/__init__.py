"""Data sources: datasets of files (JSONL, Parquet, Arrow, token files; local or remote) or rows in memory, read by ``(shard, row)``."""

from ..core.bad_records import RecordDecodeError as RecordDecodeError
from ..sources.dataset import Dataset as Dataset
from ..sources.dataset import InMemoryShard as InMemoryShard
from ..sources.dataset import as_dataset as as_dataset
from ..sources.index import build_index as build_index
from ..sources.digest import ShardChangedError as ShardChangedError
from ..sources.storage import CacheOptions as CacheOptions
from ..sources.storage import IoOptions as IoOptions
from ..sources.storage import StorageError as StorageError

__all__ = [
    "CacheOptions", "Dataset", "InMemoryShard", "IoOptions", "RecordDecodeError", "ShardChangedError", "StorageError",
    "as_dataset", "build_index",
]
