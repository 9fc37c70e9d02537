"""Checkpoint documents: build, validate, compare, merge, convert for DCP, save and load.

A checkpoint is ``{"format", "fingerprint", "lanes": {lane id: lane state}}``: builtins only
(JSON- and msgpack-safe), keyed by *global* lane id, so the checkpoints of every rank merge by
union and restore on any data-parallel size that divides the lane count. This module knows
nothing about pipelines or executors: it takes their fingerprint and encoded lane states.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import msgspec

#: The checkpoint format this version writes and reads.
FORMAT = "zephon.checkpoint/2"


def build(fingerprint: dict[str, Any], encoded: dict[int, Any]) -> dict[str, Any]:
    """A checkpoint document from a plan's fingerprint and encoded lane states."""
    return {"format": FORMAT, "fingerprint": fingerprint, "lanes": {str(lane): encoded[lane] for lane in sorted(encoded)}}


def validate(fingerprint: dict[str, Any], checkpoint: Any) -> None:
    """Raise unless ``checkpoint`` is a checkpoint of this format taken with ``fingerprint``.

    Raises:
        TypeError: not a mapping.
        ValueError: missing fields, another format, or other data settings (the differing fields
            are listed).
    """
    if not isinstance(checkpoint, dict):
        raise TypeError(f"restore() takes the dict returned by checkpoint(), got {type(checkpoint).__name__}")
    missing = [k for k in ("format", "fingerprint", "lanes") if k not in checkpoint]
    if missing:
        raise ValueError(f"not a zephon checkpoint: missing fields {missing}")
    if checkpoint["format"] != FORMAT:
        raise ValueError(f"checkpoint format {checkpoint['format']!r} is not supported (this version reads {FORMAT!r})")
    diffs = fingerprint_diff(checkpoint["fingerprint"], fingerprint)
    if diffs:
        lines = "\n".join(f"  {path}: checkpoint={a} pipeline={b}" for path, a, b in diffs[:20])
        more = f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
        raise ValueError(
            "cannot restore: the checkpoint was taken with different data settings; these differ:\n"
            f"{lines}{more}\nRebuild the pipeline with the checkpoint's settings (performance options may differ)."
        )


def fingerprint_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, str, str]]:
    """The paths where two fingerprints differ, with short renderings of both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append((sub, _short(a.get(k, "<absent>")), _short(b.get(k, "<absent>"))))
            else:
                out.extend(fingerprint_diff(a[k], b[k], sub))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out.extend(fingerprint_diff(x, y, f"{path}[{i}]"))
        return out
    if _norm(a) != _norm(b):
        return [(path or "<root>", _short(a), _short(b))]
    return []


def _norm(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True, default=str))


def _short(x: Any) -> str:
    s = json.dumps(x, sort_keys=True, default=str)
    return s if len(s) <= 80 else s[:77] + "..."


def select_lanes(checkpoint: dict[str, Any], lanes: Iterable[int]) -> dict[int, Any]:
    """The states of ``lanes`` from a (merged) checkpoint; errors name the missing lanes."""
    have = checkpoint["lanes"]
    lanes = list(lanes)
    missing = [lane for lane in lanes if str(lane) not in have]
    if missing:
        raise ValueError(
            f"the checkpoint holds lanes {sorted(int(k) for k in have)} but this rank needs {lanes} "
            f"(missing {missing}); merge every rank's checkpoint with zephon.merge_checkpoints, "
            "or save and load them with zephon.save_checkpoint / zephon.load_checkpoint"
        )
    return {lane: have[str(lane)] for lane in lanes}


def merge_checkpoints(checkpoints: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Join per-rank checkpoints into one holding every lane.

    Ranks that share lanes (tensor/pipeline-parallel peers) must agree on them exactly.

    Raises:
        ValueError: different formats or fingerprints, or conflicting states for one lane.
    """
    checkpoints = list(checkpoints)
    if not checkpoints:
        raise ValueError("merge_checkpoints needs at least one checkpoint")
    first = checkpoints[0]
    lanes: dict[str, Any] = {}
    for i, ck in enumerate(checkpoints):
        if ck.get("format") != first.get("format"):
            raise ValueError(f"checkpoint {i} has format {ck.get('format')!r}, checkpoint 0 has {first.get('format')!r}")
        diffs = fingerprint_diff(first["fingerprint"], ck["fingerprint"])
        if diffs:
            raise ValueError(f"checkpoint {i} was taken with different data settings than checkpoint 0: {diffs[:5]}")
        for lane, state in ck["lanes"].items():
            if lane in lanes and lanes[lane] != state:
                raise ValueError(
                    f"checkpoints disagree on lane {lane}: were they taken at the same step on every rank? "
                    "Call checkpoint() on all ranks after the same number of steps."
                )
            lanes[lane] = state
    return {"format": first["format"], "fingerprint": first["fingerprint"], "lanes": dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))}


# -- torch.distributed.checkpoint -----------------------------------------------------------------

_STATE_KEY = re.compile(r"^lane_(\d+)$")


def checkpoint_to_state_dict(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as one entry per lane, for ``torch.distributed.checkpoint``.

    Each rank's entries have distinct keys, so DCP keeps every rank's lanes, and a rank of
    another data-parallel size asks for exactly the lanes it needs.
    """
    out: dict[str, Any] = {"zephon_format": checkpoint["format"], "zephon_fingerprint": msgspec.json.encode(checkpoint["fingerprint"]).decode()}
    for lane, state in checkpoint["lanes"].items():
        out[f"lane_{int(lane):05d}"] = msgspec.msgpack.encode(state)
    return out


def state_dict_to_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`checkpoint_to_state_dict`."""
    try:
        lanes = {}
        for key, value in state_dict.items():
            m = _STATE_KEY.match(key)
            if m:
                data = bytes(value) if not isinstance(value, bytes) else value
                lanes[str(int(m.group(1)))] = msgspec.msgpack.decode(data)
        return {"format": state_dict["zephon_format"], "fingerprint": msgspec.json.decode(state_dict["zephon_fingerprint"]), "lanes": lanes}
    except KeyError as exc:
        raise ValueError(f"not a zephon state_dict: missing {exc}; pass the mapping returned by state_dict()") from exc


# -- files ----------------------------------------------------------------------------------------

_FILE = re.compile(r"^zephon-lanes-(\d+)-(\d+)\.msgpack$")


def save_checkpoint(directory: str | os.PathLike, loader: Any) -> Path:
    """Write this rank's checkpoint to ``directory`` (one file per rank, named by its lanes).

    Args:
        directory: created if missing.
        loader: a running loader (``iter(pipeline)``), or a pipeline (its latest loader).

    Returns the written path. The write is atomic, so a crash never leaves a torn file.
    """
    ck = loader.checkpoint()
    lanes = sorted(int(k) for k in ck["lanes"])
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"zephon-lanes-{lanes[0]:05d}-{lanes[-1]:05d}.msgpack"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(msgspec.msgpack.encode(ck))
    os.replace(tmp, path)
    return path


def read_checkpoint(directory: str | os.PathLike, lanes: Iterable[int]) -> dict[str, Any]:
    """The merged checkpoint of the files in ``directory`` that hold ``lanes``."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {d}")
    need = set(lanes)
    files = []
    for p in sorted(d.iterdir()):
        m = _FILE.match(p.name)
        if m and need & set(range(int(m.group(1)), int(m.group(2)) + 1)):
            files.append(p)
    if not files:
        raise FileNotFoundError(f"no zephon-lanes-*.msgpack file in {d} covers lanes {sorted(need)}")
    return merge_checkpoints(msgspec.msgpack.decode(p.read_bytes()) for p in files)


def load_checkpoint(directory: str | os.PathLike, target: Any) -> Any:
    """Restore ``target`` (a pipeline or a loader) from the files in ``directory`` holding its lanes.

    Works for any data-parallel size: a rank reads only the files covering its lanes. Returns
    what ``target.restore`` returns.
    """
    topology = target.topology() if callable(getattr(target, "topology", None)) else target.topology
    return target.restore(read_checkpoint(directory, topology.lanes))
