"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.

The public names are imported on first use (PEP 562), so ``import zephon`` stays cheap (no numpy,
tokenizers or torch until a pipeline is built); ``from zephon import Pipeline`` works as usual.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

#: the version of the ``zephon-lanes`` distribution (its one source: pyproject reads it from here)
__version__ = "0.1.0"


def _other_owner() -> str | None:
    """The metadata folder of another distribution that installs ``zephon/`` (the index's ``zephon``,
    DatologyAI's Zephon, shares this import name), or ``None``. Lists the import path's folders only:
    ``importlib.metadata`` would cost more than the rest of ``import zephon``."""
    for folder in dict.fromkeys(sys.path):
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            stem, _, rest = name.partition("-")
            if stem.lower() == "zephon" and rest[:1].isdigit() and name.endswith((".dist-info", ".egg-info")):
                return os.path.join(folder, name)
    return None


if (_owner := _other_owner()) is not None:
    raise ImportError(
        f"the import package zephon/ ({os.path.dirname(__file__)}) is also installed by another distribution, "
        f"'zephon' ({_owner}): DatologyAI's Zephon, which uses the same import name, so its files and these mix. "
        "Use one per environment: `pip uninstall -y zephon zephon-lanes && pip install zephon-lanes` keeps this "
        "library (zephon-lanes); a separate virtual environment keeps both"
    )

#: public name -> the module defining it
_LAZY = {
    "Explanation": ".pipeline.explain",
    "LengthSchedule": ".ops.lengths",
    "Loader": ".runtime.loader",
    "Options": ".runtime.options",
    "Pipeline": ".pipeline.pipeline",
    "SampleBatch": ".core.records",
    "SkipLimitError": ".core.bad_records",
    "SkippedRecordWarning": ".runtime.bad_records",
    "SkippedSteps": ".runtime.skip_steps",
    "TrainingSpec": ".training.spec",
    "WorkerError": ".runtime.executor",
    "disable_logging": ".core.log",
    "enable_logging": ".core.log",
    "load_checkpoint": ".runtime.checkpoint",
    "load_pipeline_config": ".pipeline.config",
    "merge_checkpoints": ".runtime.checkpoint",
    "pipeline_from_config": ".pipeline.config",
    "save_checkpoint": ".runtime.checkpoint",
    "to_training": ".training.convert",
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from .runtime.checkpoint import load_checkpoint, merge_checkpoints, save_checkpoint
    from .pipeline.config import load_pipeline_config, pipeline_from_config
    from .runtime.executor import WorkerError
    from .pipeline.explain import Explanation
    from .ops.lengths import LengthSchedule
    from .runtime.loader import Loader
    from .core.log import disable_logging, enable_logging
    from .runtime.options import Options
    from .pipeline.pipeline import Pipeline
    from .core.records import SampleBatch
    from .core.bad_records import SkipLimitError
    from .runtime.bad_records import SkippedRecordWarning
    from .runtime.skip_steps import SkippedSteps
    from .training.convert import to_training
    from .training.spec import TrainingSpec


def __getattr__(name: str) -> Any:
    if name == "compat":  # a public submodule, reachable as an attribute without an import
        return importlib.import_module(".compat", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
