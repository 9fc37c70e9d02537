"""Zephon 0.2.0's stateful pipeline object, over zephon's pipeline values (see :mod:`zephon.pipeline.compat`).

``zephon.compat.Pipeline(p)`` wraps a :class:`zephon.Pipeline`: builders change it in place, and
``checkpoint()`` / ``restore()`` / ``stats()`` / ``close()`` speak for the loader it last started.
"""

from .pipeline.compat import Pipeline

__all__ = ["Pipeline"]
