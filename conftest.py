"""Doctest collection of the package: skip the integration modules whose optional extra is missing."""

import importlib.util

collect_ignore = [
    path
    for path, needs in [("zephon/integrations/torch.py", "torch"), ("zephon/integrations/torchtitan.py", "torchtitan")]
    if importlib.util.find_spec(needs) is None
]
