"""Hugging Face ``datasets.Dataset`` objects as zephon datasets: a shard is a range of rows,
identified by the HF fingerprint. Streams are refused: without row numbers no sample has a name.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def hf_kind(obj: Any) -> str | None:
    """``"Dataset"``, ``"DatasetDict"``, ``"IterableDataset"``, ``"IterableDatasetDict"`` or ``None``."""
    for c in type(obj).__mro__:
        if c.__module__.startswith("datasets.") and c.__name__ in ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict"):
            return c.__name__
    return None


def refuse_stream(obj: Any, name: str) -> TypeError:
    """The error for a source without row numbers: an HF stream, an iterator or a generator."""
    kind = hf_kind(obj)
    if kind in ("IterableDataset", "IterableDatasetDict"):
        return TypeError(
            f"dataset {name!r}: a datasets.{kind} is a stream without row numbers, so zephon cannot name its samples by "
            "(dataset, shard, row) nor resume exactly on another number of GPUs. Materialize it: load it without "
            "streaming=True (datasets.load_dataset(..., streaming=False)), or write it to Parquet shards "
            "(datasets.Dataset.from_generator(lambda: (yield from stream)).to_parquet('data/part-00000.parquet'), or per "
            "shard with stream.shard(num_shards=N, index=i)) and read them with Dataset.from_path(name, 'data/*.parquet')."
        )
    return TypeError(
        f"dataset {name!r}: a {type(obj).__module__}.{type(obj).__name__} is a one-pass iterator without row numbers, so "
        "zephon cannot name its samples nor resume exactly. Materialize it: a list of dicts (Dataset.from_rows(name, "
        "list(it))) for small data, or write it to JSONL or Parquet shards and use Dataset.from_path(name, 'data/*.parquet')."
    )


def select_split(obj: Any, name: str, split: str | None) -> Any:
    """The HF ``Dataset`` to read: ``obj`` itself, or its ``split`` if it is a ``DatasetDict``."""
    kind = hf_kind(obj)
    if kind == "DatasetDict":
        if split is None:
            if len(obj) == 1:
                return next(iter(obj.values()))
            raise ValueError(f"dataset {name!r}: a DatasetDict holds the splits {sorted(obj)}; pass split='train' (or one of them), or ds['train']")
        if split not in obj:
            raise KeyError(f"dataset {name!r}: the DatasetDict has no split {split!r}; its splits are {sorted(obj)}")
        return obj[split]
    if kind == "Dataset":
        if split is not None and str(getattr(obj, "split", None)) != split:
            raise ValueError(f"dataset {name!r}: split={split!r} is only for a DatasetDict; this Dataset is the {obj.split!r} split")
        return obj
    raise refuse_stream(obj, name) if kind else TypeError(f"dataset {name!r}: expected a datasets.Dataset or DatasetDict, got {type(obj).__name__}")


class HfShard:
    """Rows ``[start, stop)`` of a Hugging Face dataset ``data``, and its fingerprint then."""

    __slots__ = ("data", "start", "stop", "hf_fingerprint")

    def __init__(self, data: Any, start: int, stop: int):
        self.hf_fingerprint = str(getattr(data, "_fingerprint", "")) or None
        if getattr(data, "format", {}).get("type") is not None:  # rows as Python values, whatever the format
            data = data.with_format(None)
        self.data, self.start, self.stop = data, start, stop

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def read(self, rows: np.ndarray, dataset: str, io: Any = None) -> list:
        if rows.shape[0] == 0:
            return []
        try:
            columns = self.data[(rows + self.start).tolist()]
        except Exception as err:
            raise ValueError(f"dataset {dataset!r}: Hugging Face dataset rows {self.start + int(rows.min())}..{self.start + int(rows.max())} cannot be read ({type(err).__name__}: {err})") from err
        names = list(columns)
        return [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]

    def fingerprint(self) -> dict[str, Any]:
        return {"path": None, "bytes": None, "rows": self.num_rows, "identity": f"hf:{self.hf_fingerprint}[{self.start}:{self.stop}]"}

    def __repr__(self) -> str:
        return f"HfShard(rows {self.start}..{self.stop})"
