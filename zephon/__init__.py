"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.

The public names are imported on first use (PEP 562), so ``import zephon`` stays cheap (no numpy,
tokenizers or torch until a pipeline is built); ``from zephon import Pipeline`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module defining it
_LAZY = {
    "Explanation": "._explain",
    "Loader": "._loader",
    "Options": "._options",
    "Pipeline": "._pipeline",
    "SampleBatch": "._records",
    "TrainingSpec": "._training_spec",
    "WorkerError": "._executor",
    "disable_logging": "._log",
    "enable_logging": "._log",
    "load_checkpoint": "._checkpoint",
    "load_pipeline_config": "._config",
    "merge_checkpoints": "._checkpoint",
    "pipeline_from_config": "._config",
    "save_checkpoint": "._checkpoint",
    "to_training": "._training",
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from ._checkpoint import load_checkpoint, merge_checkpoints, save_checkpoint
    from ._config import load_pipeline_config, pipeline_from_config
    from ._executor import WorkerError
    from ._explain import Explanation
    from ._loader import Loader
    from ._log import disable_logging, enable_logging
    from ._options import Options
    from ._pipeline import Pipeline
    from ._records import SampleBatch
    from ._training import to_training
    from ._training_spec import TrainingSpec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
