"""Pipeline config files: a pipeline's source, run options and operators, in TOML or JSON.

``[source]`` (``StaticMixtureWorkSource`` settings and ``[[source.datasets]]``), ``[options]``
and ``[[operators]]`` in order, each an ``op`` (a builder method; ``map``/``filter`` and
``order_by`` take ``function = "module:name"``) with its keyword arguments. Paths are relative
to the file; the format is in ``docs/guide/observability.md``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import attrs

from ..runtime.options import Options

#: Builder methods an operator table may name, besides ``map`` and ``filter``.
OPERATORS = ("tokenize", "tokenize_chat", "pack_flat", "pack_sequences", "shuffle", "order_by", "batch")
_TOP = ("source", "options", "operators")
_SOURCE = ("datasets", "seed", "exhausted_policy", "passes", "shuffle_shards", "shuffle_within_shard", "chunk_size", "lane_assignment")
_DATASET = ("name", "path", "weight", "format", "on_error", "max_skipped")
#: Operator arguments that name files: resolved against the config file's folder when the file is there.
_PATH_ARGS = ("tokenizer", "chat_template")


def read_config(path: str | os.PathLike, *, what: str = "pipeline config") -> dict[str, Any]:
    """The document of a ``.toml`` or ``.json`` file (a pipeline config, or ``what`` it holds)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no {what} file {p}")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {p}: not valid JSON ({exc})") from None
    if p.suffix != ".toml":
        raise ValueError(f"{what} {p}: use a .toml or .json file")
    try:
        return parse_toml(text)
    except ValueError as exc:  # tomllib's and tomli's TOMLDecodeError
        raise ValueError(f"{what} {p}: not valid TOML ({exc})") from None


def parse_toml(text: str) -> dict[str, Any]:
    """A TOML document (``tomllib``, or ``tomli`` on Python 3.10); a syntax error is a ``ValueError``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ImportError(
                "reading TOML on Python 3.10 needs tomli: pip install 'zephon-lanes[toml]' (or use a .json config)"
            ) from None
    return tomllib.loads(text)


def load_pipeline_config(path: str | os.PathLike) -> Any:
    """Build the :class:`~zephon.Pipeline` a config file describes (see the module docstring).

    Raises:
        FileNotFoundError: no such config file.
        ValueError: an invalid file, key, dataset, ``op`` or argument, naming the file and table.
    """
    p = Path(path)
    return pipeline_from_config(read_config(p), base=p.parent, where=str(p))


def check_keys(table: Any, allowed: tuple[str, ...], where: str) -> Mapping[str, Any]:
    """``table``, checked to be a mapping of ``allowed`` keys only (errors name ``where``)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table (mapping), got {type(table).__name__}")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")
    return table


def _function(spec: Any, where: str) -> Any:
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{where}: function must be 'module:name' (an importable module-level function), got {spec!r}")
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{where}: cannot import {spec!r} ({exc})") from None


def pipeline_from_config(doc: Mapping[str, Any], *, base: str | os.PathLike = ".", where: str = "pipeline config") -> Any:
    """Build a :class:`~zephon.Pipeline` from a config document (a parsed TOML/JSON mapping).

    Examples:
        >>> doc = {"source": {"datasets": [{"name": "toy", "path": "toy"}]},
        ...        "operators": [{"op": "shuffle", "buffer_size": 4}, {"op": "batch", "microbatch_size": 2}]}
        >>> pipeline_from_config(doc)
        Traceback (most recent call last):
        ...
        FileNotFoundError: pipeline config: source.datasets[0] (toy): no data at toy
    """
    from .pipeline import Pipeline
    from ..sources.dataset import Dataset
    from ..sources.work_source import StaticMixtureWorkSource

    base = Path(base)
    check_keys(doc, _TOP, where)
    source = dict(check_keys(doc.get("source", {}), _SOURCE, f"{where}: [source]"))
    tables = source.pop("datasets", None)
    if not isinstance(tables, list) or not tables:
        raise ValueError(
            f"{where}: [source] needs a non-empty list of datasets ([[source.datasets]] with name and path)"
        )
    datasets, weights = [], {}
    for i, table in enumerate(tables):
        at = f"{where}: source.datasets[{i}]"
        check_keys(table, _DATASET, at)
        if "name" not in table or "path" not in table:
            raise ValueError(f"{at}: a dataset needs 'name' and 'path'")
        at = f"{at} ({table['name']})"
        data = base / table["path"]  # an absolute path stays as it is
        if not data.exists():
            raise FileNotFoundError(f"{at}: no data at {data}")
        kwargs = {k: table[k] for k in ("format", "on_error", "max_skipped") if k in table}
        datasets.append(Dataset.from_path(table["name"], data, **kwargs))
        weights[table["name"]] = table.get("weight", 1.0)
    try:
        pipe = Pipeline(StaticMixtureWorkSource(datasets, weights, **source))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: [source]: {exc}") from None
    names = (*(f.name for f in attrs.fields(Options)), "num_workers")
    try:
        pipe = pipe.options(**check_keys(doc.get("options", {}), names, f"{where}: [options]"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: [options]: {exc}") from None
    ops = doc.get("operators", [])
    if not isinstance(ops, list):
        raise ValueError(f"{where}: operators must be a list of tables ([[operators]])")
    for i, table in enumerate(ops):
        if not isinstance(table, Mapping) or "op" not in table:
            raise ValueError(
                f"{where}: operators[{i}] needs an 'op' key naming one of {[*OPERATORS, 'map', 'filter']}"
            )
        kwargs = dict(table)
        op = kwargs.pop("op")
        at, args = f"{where}: operators[{i}] ({op})", []
        if op in ("map", "filter"):
            check_keys(kwargs, ("function", "name", "on_error", "max_skipped"), at)
            args.append(_function(kwargs.pop("function", None), at))
        elif op not in OPERATORS:
            raise ValueError(f"{at}: unknown op {op!r}; use one of {[*OPERATORS, 'map', 'filter']}")
        elif op == "order_by" and "function" in kwargs:
            if "key" in kwargs:
                raise ValueError(f"{at}: give key (a field name) or function ('module:name'), not both")
            kwargs["key"] = _function(kwargs.pop("function"), at)
        for k in _PATH_ARGS:
            value = kwargs.get(k)
            if isinstance(value, str) and not os.path.isabs(value) and (base / value).exists():
                kwargs[k] = str(base / value)
        try:
            pipe = getattr(pipe, op)(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{at}: {exc}") from None
    return pipe
