"""Adapters from a zephon :class:`~zephon.Pipeline` to training frameworks: torch
(:mod:`~zephon.integrations.torch`), TorchTitan, Lightning and Hugging Face. Each module imports its
framework itself, never on ``import zephon``.
"""
