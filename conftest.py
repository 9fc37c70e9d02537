"""Doctest collection of the package: skip the integration modules whose optional extra is missing,
and import every other module once, first, under its package name, so that collecting a module's
doctests finds it in ``sys.modules`` instead of running a second copy of it (whose classes would
not be the ones the package exports, and would not pickle)."""

import importlib
import importlib.util
import pkgutil

import zephon

collect_ignore = [
    path
    for path, needs in [("zephon/integrations/torch.py", "torch"), ("zephon/integrations/torchtitan.py", "torchtitan")]
    if importlib.util.find_spec(needs) is None
]

for _module in pkgutil.walk_packages(zephon.__path__, "zephon."):
    _path = "zephon/" + "/".join(_module.name.split(".")[1:]) + ".py"
    if not _module.name.endswith("__main__") and _path not in collect_ignore:
        importlib.import_module(_module.name)
