"""Plans: what a run will read, step by step, before it runs (see :mod:`zephon.pipeline.plan`)."""

from .pipeline.plan import Plan as Plan
from .pipeline.plan import Simulation as Simulation
from .pipeline.plan import StepShape as StepShape
from .pipeline.plan import simulate_source as simulate_source

__all__ = ["Plan", "Simulation", "StepShape", "simulate_source"]
