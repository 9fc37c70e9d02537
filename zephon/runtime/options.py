"""Run settings of a pipeline: lanes, ranks, workers, reads, and what happens at the end of data.

Only ``canonical_replicas`` decides the data; the others may change between checkpoint and restore.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import attrs

from ..sources.storage import io_options


def _io_options(value: Any) -> Any:
    return None if value is None else io_options(value)


def _opt_int(minimum: int):
    def check(instance, attribute, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"options: {attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _opt_bool(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"options: {attribute.name} must be True, False or None, got {value!r}")


@attrs.frozen
class Options:
    """Run settings (docs/guide/pipeline.md describes each in full).

    Attributes:
        canonical_replicas: L, the number of lanes; decides the data (a common multiple of every D).
        dp_degree: D, data-parallel ranks (``None``: ``torch.distributed``, ``WORLD_SIZE``, or 1).
        dp_rank: this rank's index (``None``: ``torch.distributed``, ``RANK``, or 0).
        workers: worker processes that run this rank's lanes ahead (0: in the calling thread).
        prefetch: outputs each lane may run ahead of the caller (with ``workers > 0`` or ``thread``).
        read_size: source samples read per lane step (tokenizer batch size).
        read_ahead: samples read and tokenized in one call for the lanes about to read (0: off).
        global_batch_size: optional check: a multiple of L x microbatch_size.
        start_inline: accepted by :meth:`evolve` only: ``True`` raises ``ValueError``, ``False`` warns.
        thread: with ``workers=0``, run the lanes ahead in a background thread.
        drain: at the end of finite data, deliver what lanes still have (the same only for one D).
        agree_on_end: every rank stops at the same global step (``None``: ``steps()`` does when D
            comes from ``torch.distributed``; ``True``: plain iteration too; ``False``: neither).
        log_every: log a one-line summary every this many global steps (INFO, ``"zephon.loader"``).
        io_options: how shards are fetched and cached (``None``: each dataset's own).
        keyframes: a folder for this rank's lane states every ``keyframe_every`` global steps
            (the newest ``keyframe_keep`` kept), where ``skip_steps`` starts from.
    """

    canonical_replicas: int = attrs.field(default=1, validator=_opt_int(1))
    dp_degree: int | None = attrs.field(default=None, validator=_opt_int(1))
    dp_rank: int | None = attrs.field(default=None, validator=_opt_int(0))
    workers: int = attrs.field(default=0, validator=_opt_int(0))
    prefetch: int = attrs.field(default=4, validator=_opt_int(1))
    read_size: int = attrs.field(default=64, validator=_opt_int(1))
    read_ahead: int = attrs.field(default=512, validator=_opt_int(0))
    global_batch_size: int | None = attrs.field(default=None, validator=_opt_int(1))
    drain: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    thread: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    agree_on_end: bool | None = attrs.field(default=None, validator=_opt_bool)
    log_every: int | None = attrs.field(default=None, validator=_opt_int(1))
    io_options: Any = attrs.field(default=None, converter=_io_options)
    keyframes: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    keyframe_every: int = attrs.field(default=50, validator=_opt_int(1))
    keyframe_keep: int = attrs.field(default=100, validator=_opt_int(1))

    @property
    def decodes_inline(self) -> bool:
        """Whether restored lane states are decoded in the calling process (``workers=0``), not in workers."""
        return self.workers == 0

    def evolve(self, **changes) -> "Options":
        """New options with ``changes`` (``num_workers`` is accepted for ``workers``)."""
        if "num_workers" in changes:
            changes["workers"] = changes.pop("num_workers")
        if "start_inline" in changes:  # gone: True raises, False warns
            inline = changes.pop("start_inline")
            if inline is not False:
                raise ValueError(
                    f"options: start_inline={inline!r} is not supported: with workers > 0 the workers run their lanes from "
                    "iter() on, so user code never runs in this process (their fork server starts at options(workers=N), "
                    "so the first batch waits for it only briefly). Drop start_inline; for the lanes in this process use "
                    "workers=0 (thread=True runs them ahead in a background thread)"
                )
            warnings.warn("options: start_inline=False is what workers > 0 always does; drop the argument",
                          DeprecationWarning, stacklevel=3)
        known = [f.name for f in attrs.fields(Options)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise TypeError(f"options: unknown option(s) {unknown}; known: {known}")
        return attrs.evolve(self, **changes)

