"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.
"""

from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import merge_checkpoints as merge_checkpoints
from ._checkpoint import save_checkpoint as save_checkpoint
from ._config import load_pipeline_config as load_pipeline_config
from ._config import pipeline_from_config as pipeline_from_config
from ._executor import WorkerError as WorkerError
from ._explain import Explanation as Explanation
from ._loader import Loader as Loader
from ._log import disable_logging as disable_logging
from ._log import enable_logging as enable_logging
from ._options import Options as Options
from ._pipeline import Pipeline as Pipeline
from ._records import SampleBatch as SampleBatch
from ._training import to_training as to_training
from ._training_spec import TrainingSpec as TrainingSpec

__version__ = "0.1.0"

__all__ = [
    "Explanation",
    "Loader",
    "Options",
    "Pipeline",
    "SampleBatch",
    "TrainingSpec",
    "WorkerError",
    "__version__",
    "disable_logging",
    "enable_logging",
    "load_checkpoint",
    "load_pipeline_config",
    "merge_checkpoints",
    "pipeline_from_config",
    "save_checkpoint",
    "to_training",
]
