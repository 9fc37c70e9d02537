"""Checkpoint documents: build, validate, compare, merge, convert for DCP, save and load.

A checkpoint is ``{"format", "fingerprint", "lanes": {lane id: lane state}}`` (builtins, keyed by
global lane id: ranks' checkpoints merge by union and restore on any D dividing L). Each lane
state carries a ``checksum``; a checkpoint file adds a SHA-256 of its bytes, written atomically.
The shard lists are a manifest beside the files (:mod:`zephon.runtime.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import msgspec

from ..core.atomic import replacing
from ..core.fingerprint import unfingerprintable
from .manifest import explain, normalized, note_folder, pin_data, write_manifest

#: The checkpoint format this version writes and reads.
FORMAT = "zephon.checkpoint/4"
#: The layout of a checkpoint file written by :func:`save_checkpoint`.
FILE_FORMAT = "zephon.checkpoint-file/1"
#: The fields of an encoded lane state, besides its checksum.
LANE_FIELDS = ("source", "ops", "pending", "delivered", "done", "mixture")
#: Fields held only when used: the reading's skip logs, and the run's skipped global steps.
OPTIONAL_LANE_FIELDS = ("skipped", "skipped_steps")

_CANONICAL = msgspec.msgpack.Encoder(order="sorted")


def lane_checksum(lane: int, state: Mapping[str, Any]) -> str:
    """BLAKE2b-128 of a lane id and its encoded state's canonical msgpack, ``checksum`` left out
    (it survives JSON and msgpack round trips; it guards against accidents, not edits).

    Examples:
        >>> lane_checksum(3, {"delivered": 0}) == lane_checksum(3, {"delivered": 0, "checksum": "x"})
        True
        >>> lane_checksum(3, {"delivered": 0}) != lane_checksum(2, {"delivered": 0})
        True
    """
    try:
        data = _CANONICAL.encode({k: v for k, v in state.items() if k != "checksum"})
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"lane {lane}: the state holds a value a checkpoint never contains ({exc})") from None
    h = hashlib.blake2b(digest_size=16, person=b"zephon-lane")
    h.update(f"{FORMAT}\0{int(lane)}\0".encode())
    h.update(data)
    return "blake2b:" + h.hexdigest()


def seal(lane: int, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with its :func:`lane_checksum` (any previous checksum is replaced)."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": lane_checksum(lane, body)}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _counts(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(_is_int(v) and v >= 0 for v in x)


def _skip_pairs(value: Any) -> bool:
    """Whether ``value`` holds ``[first step, count]`` int pairs, increasing, not overlapping."""
    if not isinstance(value, (list, tuple)):
        return False
    end = 0
    for pair in value:
        if not (_counts(pair) and len(pair) == 2 and pair[0] >= end and pair[1] >= 1):
            return False
        end = pair[0] + pair[1]
    return True


#: Per field of a lane state: whether a value is valid, and what it must be.
_FIELD_CHECKS = {
    "source": (lambda v: _counts(v) and len(v) == 2, "be [work chunk, offset], two ints >= 0"),
    "ops": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
            "map operator names to states"),
    "pending": (lambda v: isinstance(v, (list, tuple)), "be a list of output references"),
    "delivered": (lambda v: _is_int(v) and v >= 0, "be an int >= 0"),
    "done": (lambda v: isinstance(v, bool), "be true or false"),
    "mixture": (lambda v: _counts(v) and not len(v) % 2,
                "be [samples, tokens] per dataset, ints >= 0"),
    "skipped": (lambda v: isinstance(v, (list, tuple)), "be a list of skip logs, one per dataset"),
    "skipped_steps": (_skip_pairs, "list [first step, count] pairs of ints (count >= 1) in "
                      "increasing order"),
}


def check_lane_state(lane: int, state: Any, *, require_checksum: bool = True) -> None:
    """Raise a ValueError naming the lane and field unless ``state`` is an unmodified lane state
    of this format: its checksum (unless ``require_checksum=False``), fields, types and ranges."""
    if state is None:
        raise ValueError(f"lane {lane}: the state is null; expected the mapping checkpoint() wrote for the lane")
    if not isinstance(state, dict):
        raise ValueError(f"lane {lane}: the state must be a mapping, got {type(state).__name__}")
    if "checksum" in state:
        given = state["checksum"]
        if not isinstance(given, str):
            raise ValueError(f"lane {lane}: field 'checksum' must be a string, got {type(given).__name__}")
        if given != lane_checksum(lane, state):
            raise ValueError(
                f"lane {lane}: checksum mismatch: the state was modified after it was written (a corrupted copy, "
                "a hand edit, or the state of another lane); restore an unmodified checkpoint"
            )
    elif require_checksum:
        raise ValueError(
            f"lane {lane}: the state has no checksum; a {FORMAT!r} checkpoint holds lane states exactly as "
            "checkpoint() wrote them"
        )
    fields = set(state) - {"checksum", *OPTIONAL_LANE_FIELDS}
    if fields != set(LANE_FIELDS):
        raise ValueError(
            f"lane {lane}: state fields {sorted(fields)} do not match {sorted(LANE_FIELDS)} "
            f"(missing {sorted(set(LANE_FIELDS) - fields)}, unknown {sorted(fields - set(LANE_FIELDS))})"
        )
    for name, (valid, what) in _FIELD_CHECKS.items():
        if name in state and not valid(state[name]):
            raise ValueError(f"lane {lane}: field {name!r} must {what}, got {_short(state[name])}")


def _check_head(checkpoint: Any, where: str = "") -> None:
    """Raise unless ``checkpoint`` is a mapping with the fields of this format."""
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{where}not a zephon checkpoint: expected the mapping checkpoint() returns, got {type(checkpoint).__name__}")
    missing = [k for k in ("format", "fingerprint", "lanes") if k not in checkpoint]
    if missing:
        raise ValueError(f"{where}not a zephon checkpoint: missing fields {missing}")
    _check_format(checkpoint["format"], where)


def _check_document(checkpoint: Any, where: str = "", decoded_next: Iterable[int] = ()) -> None:
    """Raise unless ``checkpoint`` is intact (of ``decoded_next``, checked later, only lane ids)."""
    _check_head(checkpoint, where)
    if not isinstance(checkpoint["fingerprint"], dict):
        raise ValueError(f"{where}field 'fingerprint' must be a mapping, got {type(checkpoint['fingerprint']).__name__}")
    lanes = checkpoint["lanes"]
    if not isinstance(lanes, dict):
        raise ValueError(f"{where}field 'lanes' must map lane ids to states, got {type(lanes).__name__}")
    count = checkpoint["fingerprint"].get("lanes")
    count = count if _is_int(count) and count > 0 else None
    later = set(decoded_next)
    for key, state in lanes.items():  # keyed by canonical decimal strings in [0, count)
        if not (isinstance(key, str) and key.isdigit() and key.isascii() and str(int(key)) == key):
            raise ValueError(f"{where}lane id {key!r} is not a lane number: lanes are keyed by decimal strings ('0', '1', ...)")
        lane = int(key)
        if count is not None and lane >= count:
            raise ValueError(f"{where}lane {lane} outside [0, {count}): the checkpoint's pipeline has {count} lanes")
        if lane in later:
            continue
        try:
            check_lane_state(lane, state)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None


def _check_format(fmt: Any, where: str = "") -> None:
    if fmt == FORMAT:
        return
    if isinstance(fmt, str) and fmt.startswith("zephon.checkpoint/"):
        raise ValueError(
            f"{where}checkpoint format {fmt!r} is not supported: this version reads {FORMAT!r} (lane states "
            "with checksums and per-dataset counts); resume it with the zephon version that wrote it, or start from a new checkpoint"
        )
    raise ValueError(f"{where}checkpoint format {fmt!r} is not supported (this version reads {FORMAT!r})")


def build(fingerprint: dict[str, Any], encoded: dict[int, Any]) -> dict[str, Any]:
    """A checkpoint of a plan's fingerprint and encoded lane states (sealed here); the data's shard
    lists stay in memory, so a restore into other data names the shards."""
    pin_data(fingerprint)
    return {"format": FORMAT, "fingerprint": fingerprint, "lanes": {str(lane): seal(lane, encoded[lane]) for lane in sorted(encoded)}}


def validate(fingerprint: dict[str, Any], checkpoint: Any, *, decoded_next: Iterable[int] = ()) -> None:
    """Raise unless ``checkpoint`` is an intact checkpoint of this format taken with
    ``fingerprint``: a TypeError for a non-mapping, else a ValueError naming the differing fields
    (or shards), the lane id or the lane and field. ``decoded_next``: lanes ``Plan.decode_lanes``
    checks right after (with the same errors), so only their ids are checked here."""
    if not isinstance(checkpoint, dict):
        raise TypeError(f"restore() takes the dict returned by checkpoint(), got {type(checkpoint).__name__}")
    _check_head(checkpoint)
    diffs = fingerprint_diff(normalized(checkpoint["fingerprint"]), normalized(fingerprint))
    if diffs:
        lines = "\n".join(f"  {_named_change(path, fingerprint)}{path}: checkpoint={a} pipeline={b}" for path, a, b in diffs[:20])
        more = f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
        changed = explain(checkpoint["fingerprint"], fingerprint, diffs)
        if changed is not None:
            raise ValueError(f"cannot restore: {changed}; these differ:\n{lines}{more}")
        # The parts of the pipeline that differ, by the first field of each path.
        part = {"source": "plan", "operators": "processing", "lanes": "lane count"}
        parts = sorted({part.get(re.split(r"[.\[]", path)[0], "settings") for path, _, _ in diffs})
        hint = (
            " To change the plan (mixture, schedule, datasets, ends) of a running job from a step "
            "on, use Pipeline.change_plan(new_source, from_step=k, checkpoint=...)."
        ) if "plan" in parts else ""
        raise ValueError(
            f"cannot restore: the checkpoint was taken with different data settings (the {' and the '.join(parts)} "
            f"{'differ' if len(parts) > 1 else 'differs'}); these differ:\n"
            f"{lines}{more}\nRebuild the pipeline with the checkpoint's settings (performance options may differ).{hint}"
        )
    _refuse_undescribed(fingerprint)
    _check_document(checkpoint, decoded_next=decoded_next)


def _operator_label(index: int, fingerprint: Any) -> str | None:
    """``"map 'scale'"`` (``"operator 'pack' (PackFlat)"``) for operator ``index`` of a pipeline fingerprint."""
    try:
        name, fp = fingerprint["operators"][index]
        op = fp["op"]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    kind = {"MapOp": "map", "FilterOp": "filter", "OrderBy": "order_by"}.get(op)
    return f"{kind} {name!r}" if kind else f"operator {name!r} ({op})"


_OPERATOR_PATH = re.compile(r"operators\[(\d+)\]\[1\]\.?(.*)")
#: Parts of a function's fingerprint (``zephon.core.fingerprint``) followed by a name, in words.
_NAMED_PARTS = {
    "closure": "closure cell", "defaults": "default of", "kwdefaults": "keyword default of",
    "globals": "global", "keywords": "partial keyword", "fields": "field",
}
_PARTS = {
    "code": "the code", "partial": "the partial's function", "method": "the method's function",
    "self": "the method's instance", "instance": "the callable's fields", "call": "its __call__",
}


def _named_change(path: str, fingerprint: Any) -> str:
    """``"map 'scale': closure cell 'k' differs; "`` for a path inside an operator's fingerprint, else ``""``."""
    m = _OPERATOR_PATH.fullmatch(path)
    label = _operator_label(int(m[1]), fingerprint) if m else None
    if label is None:
        return ""
    tokens = re.findall(r"\[\d+\]|[^.\[\]]+", m[2])
    if not tokens:
        return f"{label}: differs; "
    field, rest = tokens[0], tokens[1:]
    if field not in ("fn", "predicate", "key"):
        return f"{label}: setting {field!r} differs; "
    words: list[str] = []
    while rest:
        token = rest.pop(0)
        if token in _NAMED_PARTS and rest:
            words.append(f"{_NAMED_PARTS[token]} {rest.pop(0)!r}")
        elif token == "args" and rest and rest[0].startswith("["):
            words.append(f"partial argument {rest.pop(0)[1:-1]}")
        elif token in _PARTS:
            words.append(_PARTS[token])
        else:
            break  # inside a value: the path says where
    return f"{label}: {': '.join(words) if words else 'the function'} differs; "


def _refuse_undescribed(fingerprint: Any) -> None:
    """Refuse a restore into a pipeline whose fingerprint holds a value it could not describe."""
    for i, entry in enumerate(fingerprint.get("operators") or ()):
        markers = unfingerprintable(entry)
        if markers:
            raise ValueError(
                f"cannot restore: {_operator_label(i, fingerprint) or f'operator {i}'} holds a value its fingerprint cannot "
                f"describe ({'; '.join(markers)}), so the checkpoint cannot tell whether this pipeline computes what it "
                "computed. Name the function's version, map(fn, fingerprint='v1') (order_by(key, window, fingerprint='v1') "
                "for a key; change it whenever its output changes), "
                "and resume from a checkpoint taken with that name"
            )


_ABSENT = object()  # a key that one fingerprint has and the other has not


def fingerprint_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, str, str]]:
    """The paths where two fingerprints differ, with short renderings of both values."""
    if not path and _norm(a) == _norm(b):
        return []  # the usual case, in one comparison
    if isinstance(a, dict) and isinstance(b, dict):
        keys = list(a) + [k for k in b if k not in a]
        subs = [(f"{path}.{k}" if path else str(k), a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in keys]
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        subs = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    else:
        same = a is not _ABSENT and b is not _ABSENT and _norm(a) == _norm(b)
        return [] if same else [(path or "<root>", _short(a), _short(b))]
    return [d for sub, x, y in subs for d in fingerprint_diff(x, y, sub)]


def _norm(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True, default=str))


def _short(x: Any) -> str:
    if x is _ABSENT:
        return "<absent>"
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
    """Join per-rank checkpoints into one holding every lane, each verified; ranks that share lanes
    (tensor/pipeline-parallel peers) must agree on them exactly, else ValueError."""
    return _merge([(f"checkpoint {i}", ck) for i, ck in enumerate(checkpoints)])


def _merge(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Merge labelled checkpoints; errors name the checkpoint (``"checkpoint 2"``, a file path)."""
    if not items:
        raise ValueError("merge_checkpoints needs at least one checkpoint")
    for label, ck in items:
        _check_document(ck, f"{label}: ")
    first_label, first = items[0]
    lanes: dict[str, tuple[str, Any]] = {}  # lane id -> (the first checkpoint holding it, its state)
    reference = normalized(first["fingerprint"])
    for label, ck in items:
        diffs = fingerprint_diff(reference, normalized(ck["fingerprint"]))
        if diffs:
            raise ValueError(f"{label} was taken with different data settings than {first_label}: {diffs[:5]}")
        for lane, state in ck["lanes"].items():
            owner, held = lanes.setdefault(lane, (label, state))
            if held != state:
                raise ValueError(
                    f"{owner} and {label} disagree on lane {lane}: were they taken at the same step on every rank? "
                    "Call checkpoint() on all ranks after the same number of steps."
                )
    states = _by_lane({lane: state for lane, (_, state) in lanes.items()})
    return {"format": first["format"], "fingerprint": first["fingerprint"], "lanes": states}


def _by_lane(lanes: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))


_STATE_KEY = re.compile(r"^lane_(\d+)$")


def checkpoint_to_state_dict(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as one msgpack entry per lane, for ``torch.distributed.checkpoint`` (a rank of
    another data-parallel size asks for the lanes it needs)."""
    fingerprint = msgspec.json.encode(checkpoint["fingerprint"]).decode()
    lanes = {f"lane_{int(k):05d}": msgspec.msgpack.encode(s)
             for k, s in checkpoint["lanes"].items()}
    return {"zephon_format": checkpoint["format"], "zephon_fingerprint": fingerprint, **lanes}


def state_dict_to_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`checkpoint_to_state_dict`; every lane is verified (ValueError)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict() takes the mapping returned by state_dict(), got {type(state_dict).__name__}")
    missing = [k for k in ("zephon_format", "zephon_fingerprint") if k not in state_dict]
    if missing:
        raise ValueError(f"not a zephon state_dict: missing {missing}; pass the mapping returned by state_dict()")
    lanes: dict[str, Any] = {}
    for key, value in state_dict.items():
        m = _STATE_KEY.match(key) if isinstance(key, str) else None
        if not m:
            continue
        lane = str(int(m.group(1)))
        if lane in lanes:
            raise ValueError(f"state_dict entry {key!r}: lane {lane} appears twice")
        try:
            lanes[lane] = msgspec.msgpack.decode(bytes(value))
        except (TypeError, ValueError, msgspec.DecodeError) as exc:
            raise ValueError(f"state_dict entry {key!r}: not a msgpack lane state ({exc})") from None
    try:
        fingerprint = msgspec.json.decode(state_dict["zephon_fingerprint"])
    except (TypeError, msgspec.DecodeError) as exc:
        raise ValueError(f"state_dict entry 'zephon_fingerprint': not the JSON state_dict() wrote ({exc})") from None
    ck = {"format": state_dict["zephon_format"], "fingerprint": fingerprint, "lanes": _by_lane(lanes)}
    _check_document(ck, "state_dict: ")
    return ck

# A file is the msgpack map {"format": FILE_FORMAT, "sha256": hex, "checkpoint": msgpack bytes}.
_FILE = re.compile(r"^zephon-lanes-(\d+)-(\d+)\.msgpack$")
_FILE_FIELDS = {"format", "sha256", "checkpoint"}


def encode_file(checkpoint: dict[str, Any]) -> bytes:
    """The bytes :func:`save_checkpoint` writes for ``checkpoint``."""
    body = msgspec.msgpack.encode(checkpoint)
    return msgspec.msgpack.encode({"format": FILE_FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "checkpoint": body})


def decode_file(data: bytes, name: str | os.PathLike = "<bytes>") -> dict[str, Any]:
    """The checkpoint in a file's bytes, verified; a ValueError names the file and what is wrong."""
    where = f"checkpoint file {os.fspath(name)}"
    if not data:
        raise ValueError(f"{where} is empty (0 bytes): it was not written completely; use an earlier checkpoint")
    try:
        doc = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        if "truncated" in str(exc):
            raise ValueError(
                f"{where} is truncated ({len(data)} bytes): it was not written completely or was cut short; "
                "use an earlier checkpoint"
            ) from None
        raise ValueError(f"{where} is not a zephon checkpoint: not valid msgpack ({exc})") from None
    if isinstance(doc, dict) and "lanes" in doc and "format" in doc:  # a bare document: older versions wrote these
        _check_format(doc["format"], f"{where}: ")
        raise ValueError(
            f"{where} holds a bare checkpoint document without the file's checksum; write checkpoint files with "
            "zephon.save_checkpoint (or restore the document with pipeline.restore)"
        )
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT or set(doc) != _FILE_FIELDS:
        if isinstance(doc, dict) and isinstance(doc.get("format"), str) and doc["format"].startswith("zephon.checkpoint-file/"):
            raise ValueError(f"{where} has file format {doc['format']!r}; this version reads {FILE_FORMAT!r}")
        fields = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where} is not a zephon checkpoint: expected the fields {sorted(_FILE_FIELDS)} of {FILE_FORMAT!r}, got {fields}")
    body, digest = doc["checkpoint"], doc["sha256"]
    if not isinstance(body, bytes) or not isinstance(digest, str):
        raise ValueError(f"{where} is not a zephon checkpoint: 'checkpoint' must be bytes and 'sha256' a string")
    if hashlib.sha256(body).hexdigest() != digest:
        raise ValueError(f"{where}: checksum mismatch: the file was modified or corrupted after it was written; use an earlier checkpoint")
    try:
        ck = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where} is not a zephon checkpoint: its document is not valid msgpack ({exc})") from None
    _check_document(ck, f"{where}: ")
    return ck


def save_checkpoint(directory: str | os.PathLike, loader: Any) -> Path:
    """Write this rank's checkpoint (of a loader or ``zephon.compat.Pipeline``) to ``directory``,
    one file per rank named by its lanes, and return its path. The file carries a SHA-256 and is
    written atomically (a crash leaves at most a hidden ``.zephon-lanes-*.tmp``, which loading
    ignores); the data's manifest is written beside it unless there."""
    return write_checkpoint(directory, loader.checkpoint())


def write_checkpoint(directory: str | os.PathLike, checkpoint: dict[str, Any], *, durable: bool = True,
                     manifest_in: str | os.PathLike | None = None) -> Path:
    """Write one rank's ``checkpoint`` as :func:`save_checkpoint` does; the manifest goes to
    ``manifest_in`` when given, else next to the file. ``durable=False`` skips the fsyncs."""
    lanes = sorted(int(k) for k in checkpoint["lanes"])
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_manifest(d if manifest_in is None else manifest_in, checkpoint["fingerprint"])
    path = d / f"zephon-lanes-{lanes[0]:05d}-{lanes[-1]:05d}.msgpack"
    with replacing(path, durable=durable) as out:
        out.write(encode_file(checkpoint))
    return path


def read_checkpoint(directory: str | os.PathLike, lanes: Iterable[int]) -> dict[str, Any]:
    """The merged checkpoint of the verified ``zephon-lanes-*.msgpack`` files in ``directory`` holding ``lanes``."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {d}")
    need = set(lanes)
    items = []
    for p in sorted(d.iterdir()):
        m = _FILE.match(p.name)
        if not m:
            continue
        first, last = int(m.group(1)), int(m.group(2))
        if not any(first <= lane <= last for lane in need):
            continue
        ck = decode_file(p.read_bytes(), p)
        outside = [k for k in ck["lanes"] if not first <= int(k) <= last]
        if outside:
            raise ValueError(
                f"checkpoint file {p} holds lanes {sorted(map(int, outside))} outside the range {first}-{last} its "
                "name gives; was it renamed? Keep the names save_checkpoint wrote"
            )
        items.append((f"checkpoint file {p}", ck))
    if not items:
        raise FileNotFoundError(f"no zephon-lanes-*.msgpack file in {d} covers lanes {sorted(need)}")
    merged = _merge(items)
    note_folder(merged["fingerprint"], d)
    return merged


def load_checkpoint(directory: str | os.PathLike, target: Any) -> Any:
    """``target.restore(ck)`` of the files in ``directory`` holding its lanes, for any data-parallel
    size (FileNotFoundError: none; ValueError: a damaged file, named, or other data settings)."""
    topology = target.topology() if callable(getattr(target, "topology", None)) else target.topology
    return target.restore(read_checkpoint(directory, topology.lanes))
