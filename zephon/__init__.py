"""zephon: deterministic, elastic LLM data loading.

Every global batch is a pure function of (data, configuration, seed, lane, step), so it is
bit-identical whatever the number of GPUs, worker processes or restarts.
"""

from ._pipeline import Pipeline as Pipeline
from ._records import SampleBatch as SampleBatch

__version__ = "0.1.0"

__all__ = ["Pipeline", "SampleBatch", "__version__"]
