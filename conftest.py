"""Doctest collection of the package: import every module once, first, under its package name, so
that collecting a module's doctests finds it in ``sys.modules`` instead of running a second copy of
it (whose classes would not be the ones the package exports, and would not pickle); leave out the
integration modules whose framework (torch, torchtitan, lightning, ...) is missing."""

import importlib
import pkgutil

import zephon

collect_ignore = []

for _module in pkgutil.walk_packages(zephon.__path__, "zephon."):
    if _module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(_module.name)
    except ImportError:
        if not _module.name.startswith("zephon.integrations."):  # only the adapters need an extra
            raise
        collect_ignore.append(_module.name.replace(".", "/") + ".py")
