"""Payload fields shared by every operator family: which field holds the tokens, which fields are
aligned with them (one entry per token, made 1-D numpy arrays at an operator's input), and the
per-segment fields every other one becomes. Imports nothing from zephon, so every layer may use it.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Sequence

import numpy as np

#: Token field names tried in order when ``tokens_field="auto"``.
TOKEN_FIELDS = ("input_ids", "tokens", "token_ids", "ids")
#: Fields that must be aligned with the tokens whenever they are present (a wrong length is an error).
ALIGNED_FIELDS = ("loss_mask", "labels", "attention_mask", "positions", "position_ids", "token_type_ids")
#: Which special tokens ``tokenize`` adds around a text.
SPECIAL_TOKEN_MODES = ("bos_eos", "bos", "eos", "none")
#: The keys of a segment's dict (its offset and token count in the row); no document field may use them.
SEGMENT_KEYS = ("start", "length")
#: Values carried as they are, without trying to pickle them.
_PLAIN = (str, int, float, bool, bytes, type(None), np.generic)


def find_token_field(payload: Any, tokens_field: str, where: str) -> str:
    """The name of the token field of ``payload`` (``tokens_field``, or with ``"auto"`` the first of
    :data:`TOKEN_FIELDS` present); ``where`` names the operator in errors (a ``TypeError`` for a
    payload that is not a dict, a ``ValueError`` for a missing field)."""
    if not isinstance(payload, dict):
        raise TypeError(f"{where}: payloads must be dicts with a token field, got {type(payload).__name__}")
    if tokens_field != "auto":
        if tokens_field not in payload:
            raise ValueError(
                f"{where}: token field {tokens_field!r} missing; payload keys are {sorted(payload)[:8]}; "
                "tokenize first or pass tokens_field="
            )
        return tokens_field
    for name in TOKEN_FIELDS:
        if name in payload:
            return name
    raise ValueError(
        f"{where}: no token field ({', '.join(TOKEN_FIELDS)}) in payload with keys {sorted(payload)[:8]}; "
        f"put tokenize() before {where}() or pass tokens_field="
    )


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and not (isinstance(value, np.ndarray) and value.ndim != 1)


def _numeric(value: Sequence[Any]) -> np.ndarray | None:
    """``value`` as a 1-D numeric array, or ``None`` when it does not hold numbers."""
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in "biuf" else None
    if not all(isinstance(x, (int, float, bool, np.integer, np.floating, np.bool_)) for x in value):
        return None
    arr = np.asarray(value)
    return arr if arr.ndim == 1 and arr.dtype.kind in "biuf" else None


def is_aligned(value: Any, length: int) -> bool:
    """Whether ``value`` is token-aligned: a numeric list, tuple or 1-D array of ``length`` entries."""
    return _is_sequence(value) and len(value) == length and _numeric(value) is not None


def aligned_payload(payload: dict, tfield: str, where: str, record: str = "") -> tuple[dict, tuple[str, ...]]:
    """Normalise the token field ``tfield`` and the token-aligned fields of ``payload`` to 1-D arrays.

    A field is aligned when it is numeric and as long as the tokens; one named in
    :data:`ALIGNED_FIELDS` must be (else ``ValueError``, as for a token field that is not 1-D
    integers; ``where`` and ``record`` name it). Returns the payload (a new dict when a field was
    converted) and the aligned field names, the token field first.
    """
    at = f" in {record}" if record else ""
    tokens = payload[tfield]
    converted: dict[str, Any] = {}
    if not isinstance(tokens, np.ndarray):
        arr = np.asarray(tokens if len(tokens) else np.zeros(0, np.int64))
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"{where}: token field {tfield!r}{at} must be a 1-D sequence of integer ids, got {_brief(tokens)}")
        converted[tfield] = arr
    n = len(tokens)
    keys = [tfield]
    for k, v in payload.items():
        if k == tfield:
            continue
        must = k in ALIGNED_FIELDS
        if not _is_sequence(v):
            if must and isinstance(v, np.ndarray):
                raise ValueError(f"{where}: field {k!r}{at} has shape {v.shape}; it must be 1-D with one entry per token ({n})")
            continue
        if len(v) != n:
            if must:
                raise ValueError(
                    f"{where}: field {k!r}{at} has {len(v)} entries but the tokens ({tfield!r}) have {n}; "
                    f"{k!r} must have one entry per token"
                )
            continue
        arr = _numeric(v)
        if arr is None:
            if must:
                raise ValueError(f"{where}: field {k!r}{at} must hold numbers, got {_brief(v)}")
            continue
        if arr is not v:
            converted[k] = arr
        keys.append(k)
    if converted:
        payload = {**payload, **converted}
    return payload, tuple(keys)


def check_carried(name: str, value: Any, where: str, record: str, fix: str) -> None:
    """Refuse (``ValueError`` naming the field, the record and ``fix``) a per-segment field value
    that does not pickle, since segments travel to DataLoader workers. Plain values and numpy
    arrays of a non-object dtype pass at once; anything else is pickled once."""
    if isinstance(value, _PLAIN) or (isinstance(value, np.ndarray) and not value.dtype.hasobject):
        return
    try:
        pickle.dumps(value, protocol=5)
    except Exception as e:  # whatever the value's reducer raises
        at = f" of {record}" if record else ""
        raise ValueError(
            f"{where}: field {name!r}{at} holds a {type(value).__name__} that cannot be carried with its segment "
            f"(it does not pickle: {type(e).__name__}: {e}); {fix}"
        ) from None


def segment_entry(start: int, length: int, fields: dict, copy: bool = False) -> dict:
    """One segment's dict: ``{"start": ..., "length": ..., **fields}`` (field values copied if asked)."""
    if copy:
        fields = {k: _copied(v) for k, v in fields.items()}
    return {"start": start, "length": length, **fields}


def _copied(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple, dict)):
        return copy.deepcopy(value)
    return value


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def payload_length(payload: Any, where: str = "batch") -> int:
    """Tokens in a payload: its token field's length, or a bare sequence's length."""
    if isinstance(payload, dict):
        for k in TOKEN_FIELDS:
            if k in payload:
                return len(payload[k])
        raise ValueError(f"{where}: needs a token field ({', '.join(TOKEN_FIELDS)}), payload keys {sorted(payload)[:8]}")
    return len(payload)


def padding_waste(records: Sequence[Any]) -> float:
    """``1 - real tokens / (B x T_batch)`` for records padded to the longest one (packed padding included)."""
    if not records:
        return 0.0
    lengths = [payload_length(r.payload) for r in records]
    real = sum(n - r.meta.padding_length for n, r in zip(lengths, records))
    return 1.0 - real / (len(lengths) * max(lengths)) if max(lengths) else 0.0


def unique_names(value: Any) -> Any:
    """A sequence of names as a tuple, first occurrence kept; anything else (a string, ``None``, an
    unhashable name) is returned as given, for the setting's validator to name."""
    if isinstance(value, str):
        return value
    try:
        return tuple(dict.fromkeys(value))
    except TypeError:  # not iterable, or unhashable names
        return value
