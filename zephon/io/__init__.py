"""Data sources: datasets of files (JSONL, Parquet, Arrow, token files; local or remote) or rows in memory, read by ``(shard, row)``."""

from ._dataset import Dataset as Dataset
from ._dataset import InMemoryShard as InMemoryShard
from ._dataset import as_dataset as as_dataset
from ._dataset import build_index as build_index
from ._digest import ShardChangedError as ShardChangedError
from ._storage import CacheOptions as CacheOptions
from ._storage import IoOptions as IoOptions
from ._storage import StorageError as StorageError

__all__ = ["CacheOptions", "Dataset", "InMemoryShard", "IoOptions", "ShardChangedError", "StorageError", "as_dataset", "build_index"]
