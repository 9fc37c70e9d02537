"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.
"""

from ._distributed import load_checkpoint as load_checkpoint
from ._distributed import merge_checkpoints as merge_checkpoints
from ._distributed import save_checkpoint as save_checkpoint
from ._executor import WorkerError as WorkerError
from ._pipeline import Options as Options
from ._pipeline import Pipeline as Pipeline
from ._records import SampleBatch as SampleBatch
from ._training import to_training as to_training

__version__ = "0.1.0"

__all__ = [
    "Options",
    "Pipeline",
    "SampleBatch",
    "WorkerError",
    "__version__",
    "load_checkpoint",
    "merge_checkpoints",
    "save_checkpoint",
    "to_training",
]
