"""Hypothesis profiles for the property suite, and access to the unit tests' helpers.

Profiles (pick one with ``HYPOTHESIS_PROFILE``; the default is ``ci`` when the ``CI`` environment
variable is set, as on the CI runner, else ``dev``):

* ``dev``: a modest number of examples, for the edit-test loop.
* ``ci``: derandomized (the same examples on every run, no example database), no deadline, and
  failing examples printed as reproduction blobs; sized so the whole property suite runs in a
  few minutes on two cores.
* ``nightly``: many examples, to search harder.
* ``deep``: random (not derandomized: every run draws new examples), at least 500 examples a
  law (a law that caps its count for ci lifts the cap: ``_budget.examples``), no deadline,
  failing examples printed as reproduction blobs. It is run before an issue is resolved
  (``HYPOTHESIS_PROFILE=deep pytest property_tests``), and every failure it finds is fixed and
  then pinned as an ``@example`` on its law, so that the derandomized ``ci`` profile, which may
  never draw that case, checks it on every run.

Every profile turns off the ``too_slow`` and ``data_too_large`` health checks and the deadline:
one example builds several datasets and runs whole multi-lane pipelines (sometimes a few times,
on different numbers of ranks), so generation and run time legitimately vary by orders of
magnitude with the drawn sizes, and a per-example deadline would only measure that.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# pyproject.toml puts tests/ on the path (pythonpath = ["tests"]); keep ``_util`` importable when
# this directory is run with another configuration too. Spawned worker processes inherit sys.path,
# which is how they unpickle ``_util.toks_to_ids``.
_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

_SLOW_IS_EXPECTED = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=_SLOW_IS_EXPECTED)
settings.register_profile(
    "ci",
    max_examples=50,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=_SLOW_IS_EXPECTED,
)
settings.register_profile("nightly", max_examples=500, deadline=None, suppress_health_check=_SLOW_IS_EXPECTED)
settings.register_profile(
    "deep",
    max_examples=500,
    derandomize=False,
    deadline=None,
    print_blob=True,
    suppress_health_check=_SLOW_IS_EXPECTED,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
