"""Plans: what a run will read, step by step, before it runs (see :mod:`zephon.pipeline.plan`)."""

from .pipeline.plan import Plan, Simulation, StepShape, simulate_source

__all__ = ["Plan", "Simulation", "StepShape", "simulate_source"]
