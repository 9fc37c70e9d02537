"""User code never runs where it can kill the training process; no background thread changes process-wide state.

With ``workers >= 1`` every map/filter function runs in a worker process, so a function that crashes the interpreter (a segfault, ``os._exit``, the
out-of-memory killer) ends only a worker: the training process gets a ``WorkerError`` naming the
signal or exit code and the lanes, and its ``checkpoint()`` still covers exactly the delivered
outputs. The crashing runs are in subprocesses, so that a crash here cannot end pytest.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _util import toy_dataset, toy_pipeline

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: The scenario: a map that crashes the interpreter on the record with id ``CRASH_AT`` (any record
#: when ``CRASH_AT`` is -1) while ``ZEPHON_TEST_CRASH`` names how (``exit``: ``os._exit(3)``,
#: ``segv``: a SIGSEGV). The same function, once the variable is unset, is the fixed one: the
#: pipeline (and its fingerprint) is the same. The function ends the
#: process with exit code 5 if it ever runs in the training process after the reference run: not
#: while iterating, nor while rebuilding the checkpoint after the crash, nor while restoring.
SCENARIO = """
import json, os, signal, sys
import numpy as np
from zephon import Pipeline, WorkerError
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource
from _util import toy_dataset

CRASH_AT = int(sys.argv[1])

def crashing(payload):
    how = os.environ.get("ZEPHON_TEST_CRASH")
    if how and CRASH_AT in (-1, payload["id"]):
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    if os.environ.get("ZEPHON_TEST_MAIN_PID") == str(os.getpid()):
        os._exit(5)  # user code ran in the training process
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32)}

def build(**options):
    src = StaticMixtureWorkSource([toy_dataset(2000)], {"web": 1.0}, chunk_size=8, exhausted_policy=None)
    return (Pipeline(src).options(canonical_replicas=4, **options)
            .map(crashing).pack_flat(16).shuffle(8, seed=42).batch(2))

if __name__ == "__main__":
    how, options = sys.argv[2], json.loads(sys.argv[3])
    reference = list(build())  # the variable is not set yet: nothing crashes
    os.environ["ZEPHON_TEST_CRASH"] = how
    os.environ["ZEPHON_TEST_MAIN_PID"] = str(os.getpid())  # from here on, never in this process
    it = iter(build(workers=2, **options))
    got = []
    try:
        for out in it:
            got.append(out)
    except WorkerError as exc:
        print("ERROR", json.dumps(str(exc)))
    else:
        print("NO ERROR")
    ck = it.checkpoint()
    print("DELIVERED", sum(lane["delivered"] for lane in ck["lanes"].values()), len(got))
    del os.environ["ZEPHON_TEST_CRASH"]  # the fixed function
    resumed = list(build(workers=2, **options).restore(json.loads(json.dumps(ck))))
    print("CONTINUES", outputs_equal(got + resumed, reference), len(got), len(resumed), len(reference))
"""


def _scenario(tmp_path: Path, how: str, crash_at: int, **options) -> subprocess.CompletedProcess:
    """Run :data:`SCENARIO` in a fresh process (a file, so that the workers can import its functions)."""
    script = tmp_path / "scenario.py"
    script.write_text(f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(ROOT)!r}]\n" + SCENARIO, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("ZEPHON_TEST_CRASH", None)
    try:
        return subprocess.run(
            [sys.executable, str(script), str(crash_at), how, json.dumps(options)],
            capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the scenario hung:\n{exc.stdout}\n{exc.stderr}")


def _lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    assert proc.returncode == 0, f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}


# -- user code that crashes the interpreter ------------------------------------------------------------

@pytest.mark.parametrize("how, named", [("exit", "exited with code 3"), ("segv", "killed by signal 11 (SIGSEGV)")])
def test_a_map_that_crashes_the_interpreter_ends_a_worker_not_the_training_process(tmp_path, how, named):
    out = _lines(_scenario(tmp_path, how, crash_at=1900))
    assert "ERROR" in out, out
    message = json.loads(out["ERROR"])
    assert named in message
    assert re.search(r"the worker process for lanes \[[0-9], [0-9]\]", message), message
    delivered, got = out["DELIVERED"].split()
    assert delivered == got and int(got) > 0  # the checkpoint covers exactly what was delivered
    equal, got, resumed, total = out["CONTINUES"].split()
    assert equal == "True" and int(got) + int(resumed) == int(total)  # the fixed function continues exactly


def test_a_crash_before_any_output_leaves_a_checkpoint_of_the_start(tmp_path):
    out = _lines(_scenario(tmp_path, "segv", crash_at=-1))
    assert "SIGSEGV" in json.loads(out["ERROR"])
    assert out["DELIVERED"] == "0 0"
    assert out["CONTINUES"].split()[0] == "True"


# -- the garbage collector ---------------------------------------------------------------------------

def test_a_restore_on_the_calling_thread_leaves_the_collector_as_it_found_it():
    it = iter(toy_pipeline(4, data=toy_dataset(600), buffer=200))
    for _ in range(12):
        next(it)
    ck = it.checkpoint()
    it.close()
    gc.disable()
    try:
        resumed = iter(toy_pipeline(4, data=toy_dataset(600), buffer=200).restore(ck))
        next(resumed)
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
    resumed.close()
    resumed = iter(toy_pipeline(4, data=toy_dataset(600), buffer=200).restore(ck))
    next(resumed)
    assert gc.isenabled()
    resumed.close()
