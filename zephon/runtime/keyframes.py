"""Keyframes: lane states saved every few global steps, so that a skip starts near its target.

The lane states at global step ``s`` are a pure function of (data, plan, ``s``). With
``options(keyframes=folder)`` a loader saves this rank's checkpoint every ``keyframe_every`` global
steps as ``folder/step-<s>/zephon-lanes-<first>-<last>.msgpack`` (serving any D), keeping the
newest ``keyframe_keep``; ``skip_steps(n)`` restores the newest one up to its target and produces
only the steps from there. Only the data position comes from a keyframe: the run keeps its own
skips and mixture counts. A keyframe that cannot serve is passed over, named in a warning.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable

from .checkpoint import read_checkpoint, seal, select_lanes, validate, write_checkpoint

_STEP = re.compile(r"^step-(\d{12})$")


def step_folder(folder: str | os.PathLike, step: int) -> Path:
    """Where the keyframe of global step ``step`` lives."""
    return Path(folder) / f"step-{step:012d}"


def keyframe_steps(folder: str | os.PathLike) -> list[int]:
    """The steps that have a keyframe folder in ``folder``, in increasing order (none if it is missing)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)


def save_keyframe(folder: str | os.PathLike, step: int, checkpoint: dict[str, Any], keep: int) -> Path:
    """Write this rank's ``checkpoint`` of global step ``step`` and remove all but the newest
    ``keep`` keyframes (never one a lagging rank could still write)."""
    path = write_checkpoint(step_folder(folder, step), checkpoint, durable=False, manifest_in=folder)
    steps = keyframe_steps(folder)
    for old in steps[: max(0, len(steps) - keep)]:
        if old < step:
            shutil.rmtree(step_folder(folder, old), ignore_errors=True)
    return path


def latest_keyframe(folder: str | os.PathLike, fingerprint: dict[str, Any], lanes: Iterable[int], after: int,
                    upto: int) -> tuple[int, dict[int, Any]] | None:
    """The newest keyframe ``s`` with ``after < s <= upto`` holding ``lanes`` of this plan, as
    ``(s, encoded lane states)`` or ``None``; those passed over are named in one RuntimeWarning."""
    lanes = list(lanes)
    passed, found = [], None
    for step in reversed(keyframe_steps(folder)):
        if not after < step <= upto:
            continue
        where = step_folder(folder, step)
        try:
            checkpoint = read_checkpoint(where, lanes)
            validate(fingerprint, checkpoint)
            states = select_lanes(checkpoint, lanes)
        except (OSError, ValueError) as exc:
            passed.append(f"{where}: {str(exc).splitlines()[0]}")
            continue
        stray = sorted(lane for lane, state in states.items() if state["delivered"] != step)
        if not stray:
            found = step, states
            break
        passed.append(f"{where}: lanes {stray} are not at step {step}")
    if passed:
        warnings.warn(
            "skip_steps: keyframes passed over (the skip produces their steps instead): " + "; ".join(passed),
            RuntimeWarning, stacklevel=3,
        )
    return found


def from_keyframe(states: dict[int, Any], current: dict[int, Any]) -> dict[int, Any]:
    """The keyframe's lane ``states`` with the mixture counts of ``current``, resealed."""
    out = {}
    for lane, state in states.items():
        body = {k: v for k, v in state.items() if k not in ("checksum", "skipped_steps")}
        out[lane] = seal(lane, {**body, "mixture": current[lane]["mixture"]})
    return out
