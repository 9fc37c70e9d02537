"""A pipeline object that changes in place and runs itself, as in Zephon 0.2.0.

``docs/guide/from-zephon.md`` lists every difference from Zephon 0.2.0.
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from ..runtime.checkpoint import build, checkpoint_to_state_dict, select_lanes, state_dict_to_checkpoint
from ..runtime.loader import Loader
from ..runtime.options import Options
from . import pipeline as values

#: The value's methods that return a changed pipeline: here they change the wrapper and return it.
_IN_PLACE = frozenset({*values._BUILDERS, "add", "options"})


class Pipeline:
    """A pipeline object with running state, over a :class:`zephon.Pipeline` value.

    Args:
        source: a :class:`zephon.Pipeline` (wrapped as it is) or anything ``zephon.Pipeline``
            takes as its source.
        operators, options: as for ``zephon.Pipeline`` (with a source only).

    State kept: ``pipeline``, the current value (a pending restore is its ``resume_from``), and
    ``latest``, the loader the last ``iter()`` started. ``restore(ck)`` resumes ``latest`` in place
    *and* makes the next ``iter()`` (only) start at ``ck``. A pickled or copied wrapper keeps its
    value, never its loader.

    Examples:
        >>> from zephon.compat import Pipeline
        >>> p = Pipeline([{"n": i} for i in range(10)])
        >>> p.batch(4)                                     # in place, as in Zephon 0.2.0
        <zephon.compat.Pipeline ...>
        >>> it = iter(p); first = next(it)
        >>> ck = p.checkpoint()                            # the running loader's
        >>> [r.payload["n"] for r in next(iter(p.restore(ck)))]
        [4, 5, 6, 7]
    """

    def __init__(self, source: Any, operators: Any = (), *, options: Options | None = None):
        source = source.pipeline if isinstance(source, Pipeline) else source
        if isinstance(source, values.Pipeline) and (operators or options is not None):
            raise TypeError("compat.Pipeline(pipeline) wraps a zephon.Pipeline as it is; pass operators and options to a source only")
        if not isinstance(source, values.Pipeline):
            source = values.Pipeline(source, operators, options=options or Options())
        self.pipeline = source
        self.latest: Loader | None = None

    def __repr__(self) -> str:
        return f"<zephon.compat.Pipeline of {len(self.pipeline.operators)} operator(s)>"

    def __reduce__(self) -> tuple:
        return (Pipeline, (self.pipeline,))

    def __getattr__(self, name: str) -> Any:
        if name in ("pipeline", "latest"):  # not set yet (during unpickling): never the value's
            raise AttributeError(name)
        attr = getattr(self.pipeline, name)
        if name not in _IN_PLACE:
            return attr

        def in_place(*args: Any, **kwargs: Any) -> "Pipeline":
            self.pipeline = attr(*args, **kwargs)
            return self

        in_place.__doc__ = f"As zephon.Pipeline.{name}, changing this pipeline in place; returns it."
        return in_place

    def loader(self, checkpoint: dict[str, Any] | None = None) -> Loader:
        """A new loader from ``checkpoint`` (default: a pending restore), kept as ``latest``."""
        return self._started(self.pipeline.loader(checkpoint))

    def __iter__(self) -> Loader:
        return self._started(iter(self.pipeline))

    def _started(self, loader: Loader) -> Loader:
        """``loader``, remembered as ``latest``; a pending restore is used up."""
        self.latest = loader
        if self.pipeline.resume_from is not None:
            self.pipeline = attrs.evolve(self.pipeline, resume_from=None)
        return loader

    def steps(self, *, concat: bool = False) -> Iterator[Any]:
        """Iterate by optimizer step with a new loader (remembered as ``latest``); see :meth:`Loader.steps`."""
        return iter(self).steps(concat=concat)

    def restore(self, checkpoint: dict[str, Any]) -> "Pipeline":
        """Resume from ``checkpoint``: ``latest`` resumes in place, and the next ``iter()`` starts there.

        Raises:
            ValueError: a checkpoint of other data settings, listing the differing fields.
        """
        self.pipeline = self.pipeline.restore(checkpoint)
        if self.latest is not None:
            self.latest.restore(checkpoint)
        return self

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (possibly saved on another number of ranks)."""
        self.restore(state_dict_to_checkpoint(state_dict))

    def checkpoint(self) -> dict[str, Any]:
        """``latest``'s checkpoint; before any iteration, the pending restore (this rank's lanes) or the start."""
        if self.latest is not None:
            return self.latest.checkpoint()
        lanes = self.pipeline.topology().lanes
        pending = self.pipeline.resume_from
        if pending is not None:
            return {**pending, "lanes": {str(k): v for k, v in select_lanes(pending, lanes).items()}}
        plan = self.pipeline.compile()
        return build(plan.fingerprint(), {lane: plan.encode(plan.init(lane)) for lane in lanes})

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint as a DCP-friendly mapping (``{"zephon_fingerprint": ..., "lane_00003": ...}``)."""
        return checkpoint_to_state_dict(self.checkpoint())

    def stats(self) -> dict[str, Any]:
        """``latest``'s :meth:`Loader.stats`; before any iteration, the counters of nothing read."""
        if self.latest is not None:
            return self.latest.stats()
        from ..runtime.stats import Deliveries, summarize

        empty = summarize(operators={}, meter=None, deliveries=Deliveries())
        nothing = {"outputs": 0, "records": 0, "tokens": 0}
        return {"delivered": 0, "complete_steps": 0, "lanes": {}, "undelivered": nothing, "operators": {}, **empty}

    def stats_table(self) -> str:
        """:meth:`stats` rendered as a plain-text report."""
        from ..runtime.stats import format_stats

        return format_stats(self.stats())

    def close(self) -> None:
        """Stop ``latest``'s workers; its checkpoint and stats stay readable."""
        if self.latest is not None:
            self.latest.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
