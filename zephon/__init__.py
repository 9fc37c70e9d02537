"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.
"""

from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import merge_checkpoints as merge_checkpoints
from ._checkpoint import save_checkpoint as save_checkpoint
from ._executor import WorkerError as WorkerError
from ._loader import Loader as Loader
from ._options import Options as Options
from ._pipeline import Pipeline as Pipeline
from ._records import SampleBatch as SampleBatch
from ._training import to_training as to_training
from ._training_spec import TrainingSpec as TrainingSpec

__version__ = "0.1.0"

__all__ = [
    "Loader",
    "Options",
    "Pipeline",
    "SampleBatch",
    "TrainingSpec",
    "WorkerError",
    "__version__",
    "load_checkpoint",
    "merge_checkpoints",
    "save_checkpoint",
    "to_training",
]
