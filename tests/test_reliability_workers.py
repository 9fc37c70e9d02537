"""Executor reliability: no hangs, exact states after any stop, causes that say what happened.

Every scenario that could hang, or that kills or signals processes, runs in a fresh Python
process with a wall-clock limit (and a faulthandler dump shortly before it), so a regression
fails the test with a traceback instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def run_script(tmp_path: Path, body: str, timeout: float = 90, name: str = "scenario.py") -> str:
    """Run ``body`` as a script file in a new process group; its stdout, or the test fails.

    A file (not ``-c``) so that spawned workers can import the script's module-level functions.
    The script dumps every thread's stack and exits a few seconds before ``timeout``.
    """
    header = textwrap.dedent(
        f"""
        import faulthandler, sys
        faulthandler.dump_traceback_later({timeout - 10}, exit=True)
        sys.path[:0] = [{str(TESTS)!r}, {str(ROOT)!r}]
        """
    )
    script = tmp_path / name
    script.write_text(header + textwrap.dedent(body), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the scenario hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    return proc.stdout


# -- 1. a worker output that cannot be pickled ----------------------------------------------------------


def test_unpicklable_output_is_an_error_naming_lane_record_and_cause(tmp_path):
    out = run_script(
        tmp_path,
        """
        import threading, time
        import numpy as np
        from zephon import Pipeline, WorkerError

        def with_lock(p):  # a result holding a lock cannot cross processes
            out = {"input_ids": np.arange(3, dtype=np.int32) + p["n"]}
            if p["n"] == 5:
                out["lock"] = threading.Lock()
            return out

        if __name__ == "__main__":
            pipe = Pipeline([{"n": i} for i in range(40)]).options(canonical_replicas=2, workers=2)
            pipe = pipe.map(with_lock).batch(1)
            start = time.monotonic()
            try:
                list(pipe)
            except WorkerError as exc:
                print("ERROR", round(time.monotonic() - start, 2))
                print(exc)
            else:
                print("NO ERROR")
        """,
        timeout=60,
    )
    assert out.startswith("ERROR"), out
    assert float(out.split()[1]) < 10
    assert "lane 1 failed in a worker process" in out
    assert "output 6 of lane 1 cannot be sent between processes" in out
    assert "dataset 0, shard 0, row 5" in out
    assert "cannot pickle '_thread.lock' object" in out


# -- 2. lifecycle: iter / next / checkpoint / restore / close in any order ------------------------------

MODES = {"inline": {}, "thread": {"thread": True, "prefetch": 2}, "workers1": {"workers": 1, "prefetch": 3}}


def _lifecycle_pipeline(mode: str):
    from _util import toy_dataset, toy_pipeline

    return toy_pipeline(2, policy=None, data=toy_dataset(n=80), **MODES[mode])


def _canonical(ck):
    return json.loads(json.dumps(ck))


def run_lifecycle_machine(mode: str, examples: int, steps: int) -> None:
    """A randomized lifecycle over one pipeline object against the reference (inline) stream.

    Model: the position of the current loader, whether it was closed, whether it saw the end,
    the checkpoints saved so far and the pipeline's pending restore. After ``close()`` before the
    end, ``next()`` raises ``RuntimeError``; after the end, ``StopIteration``.
    """
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

    from zephon.testing import outputs_equal

    reference = list(_lifecycle_pipeline("inline"))
    ref_cks = []
    it = iter(_lifecycle_pipeline("inline"))
    for k in range(len(reference) + 1):
        ref_cks.append(_canonical(it.checkpoint()))
        if k < len(reference):
            next(it)

    class Lifecycle(RuleBasedStateMachine):
        saved = Bundle("saved")  # (checkpoint, position)

        @initialize()
        def start(self):
            from zephon import compat

            self.pipe = compat.Pipeline(_lifecycle_pipeline(mode))  # checkpoint/restore/close via the pipeline object, too
            self.loader = iter(self.pipe)
            self.pos, self.closed, self.finished, self.pending = 0, False, False, None

        def teardown(self):
            self.pipe.close()

        @rule()
        def new_iter(self):
            self.loader = iter(self.pipe)  # the previous loader is dropped (collected, its workers stopped)
            self.pos, self.pending = (self.pending if self.pending is not None else 0), None
            self.closed = self.finished = False

        @rule(n=st.integers(1, 6))
        def take(self, n):
            for _ in range(n):
                if self.closed and not self.finished:
                    try:
                        next(self.loader)
                    except RuntimeError as exc:
                        assert "closed loader" in str(exc)
                    else:
                        raise AssertionError("next() after close() must raise")
                    return
                if self.pos == len(reference):
                    try:
                        next(self.loader)
                    except StopIteration:
                        self.finished = True
                    else:
                        raise AssertionError("the stream went past its end")
                    continue
                out = next(self.loader)
                assert outputs_equal([out], [reference[self.pos]]), f"output {self.pos} differs"
                self.pos += 1

        @rule(target=saved, via_pipeline=st.booleans())
        def checkpoint(self, via_pipeline):
            ck = (self.pipe if via_pipeline else self.loader).checkpoint()
            assert _canonical(ck) == ref_cks[self.pos], f"checkpoint at {self.pos} differs"
            return ck, self.pos

        @rule(saved=saved, via_pipeline=st.booleans())
        def restore(self, saved, via_pipeline):
            ck, pos = saved
            if via_pipeline:
                self.pipe.restore(ck)  # the facade's latest loader resumes in place; the next iter() starts there too
                self.pending = pos
            else:
                self.loader.restore(ck)
            self.pos, self.closed, self.finished = pos, False, False

        @rule(via_pipeline=st.booleans(), twice=st.booleans())
        def close(self, via_pipeline, twice):
            for _ in range(2 if twice else 1):
                (self.pipe if via_pipeline else self.loader).close()
            self.closed = True

        @invariant()
        def delivered_count(self):
            if hasattr(self, "loader"):
                assert self.loader.stats()["delivered"] == self.pos

    Lifecycle.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )
    Lifecycle.TestCase().runTest()


@pytest.mark.parametrize("mode,examples,steps", [("inline", 60, 15), ("thread", 60, 15), ("workers1", 8, 10)])
def test_lifecycle_never_blocks_and_matches_the_reference(tmp_path, mode, examples, steps):
    out = run_script(
        tmp_path,
        f"""
        import test_reliability_workers as t
        if __name__ == "__main__":
            t.run_lifecycle_machine({mode!r}, {examples}, {steps})
            print("OK")
        """,
        timeout=240,
    )
    assert out.strip().endswith("OK")


@pytest.mark.parametrize("mode", list(MODES))
def test_compat_pipeline_restore_resumes_its_latest_loader_in_place(tmp_path, mode):
    out = run_script(
        tmp_path,
        f"""
        import test_reliability_workers as t
        from zephon import compat
        from zephon.testing import outputs_equal
        if __name__ == "__main__":
            reference = list(t._lifecycle_pipeline("inline"))
            pipe = compat.Pipeline(t._lifecycle_pipeline({mode!r}))
            it = iter(pipe)
            got = [next(it), next(it), next(it)]
            pipe.restore(pipe.checkpoint())
            got += [next(it) for _ in range(4)]
            it.restore(it.checkpoint())
            got += list(it)
            assert outputs_equal(got, reference)
            it.close(); it.close()
            try:
                next(it)
            except StopIteration:
                pass
            print("OK")
        """,
        timeout=60,
    )
    assert out.strip() == "OK"


@pytest.mark.parametrize("mode", list(MODES))
def test_next_after_close_raises_and_checkpoint_and_restore_still_work(tmp_path, mode):
    out = run_script(
        tmp_path,
        f"""
        import test_reliability_workers as t
        from zephon.testing import outputs_equal
        if __name__ == "__main__":
            reference = list(t._lifecycle_pipeline("inline"))
            with t._lifecycle_pipeline({mode!r}).loader() as it:
                got = [next(it) for _ in range(5)]
            it.close()  # a second close is harmless
            for _ in range(2):
                try:
                    next(it)
                except RuntimeError as exc:
                    assert "closed loader" in str(exc), exc
                else:
                    raise AssertionError("next() after close() returned")
            ck = it.checkpoint()
            assert it.stats()["delivered"] == 5
            assert outputs_equal(got + list(it.restore(ck)), reference)
            print("OK")
        """,
        timeout=60,
    )
    assert out.strip() == "OK"


def test_a_checkpoint_that_does_not_decode_leaves_the_running_loader_as_it_was(tmp_path):
    out = run_script(
        tmp_path,
        """
        import copy
        import test_reliability_workers as t
        from zephon.testing import outputs_equal
        if __name__ == "__main__":
            reference = list(t._lifecycle_pipeline("inline"))
            for mode in ("inline", "thread"):
                it = iter(t._lifecycle_pipeline(mode))
                got = [next(it) for _ in range(3)]
                bad = copy.deepcopy(it.checkpoint())
                del bad["lanes"]["1"]["done"]
                try:
                    it.restore(bad)
                except Exception:
                    pass
                else:
                    raise AssertionError("a lane state without 'done' was accepted")
                got += list(it)
                assert outputs_equal(got, reference), mode
            print("OK")
        """,
        timeout=60,
    )
    assert out.strip() == "OK"


# -- 3. Ctrl-C and workers that stop: the caller's states survive ----------------------------------------


def test_ctrl_c_to_the_process_group_leaves_a_working_checkpoint(tmp_path):
    out = run_script(
        tmp_path,
        """
        import os, signal, time
        from _util import toy_pipeline
        from zephon.testing import outputs_equal

        if __name__ == "__main__":
            reference = list(toy_pipeline(4, policy=None))
            pipe = toy_pipeline(4, workers=2, policy=None)
            it = iter(pipe)
            got = []
            try:
                for out in it:
                    got.append(out)
                    if len(got) == 9:
                        time.sleep(0.3)  # the workers run ahead and wait
                        os.killpg(os.getpgid(0), signal.SIGINT)  # what a terminal's Ctrl-C does
                        time.sleep(5)
                raise AssertionError("no KeyboardInterrupt")
            except KeyboardInterrupt:
                pass
            time.sleep(0.5)
            assert all(p.is_alive() for p in it.executor.procs), [p.exitcode for p in it.executor.procs]
            ck = it.checkpoint()
            assert sum(v["delivered"] for v in ck["lanes"].values()) == len(got) == 9
            it.close()
            rest = list(toy_pipeline(4, policy=None).restore(ck))
            assert outputs_equal(got + rest, reference)
            print("OK")
        """,
        timeout=90,
    )
    assert out.strip() == "OK"


def test_worker_killed_by_sigterm_names_the_cause_and_checkpoint_still_works(tmp_path):
    out = run_script(
        tmp_path,
        """
        import json, os, signal, time
        from _util import toy_pipeline
        from zephon import WorkerError
        from zephon.testing import outputs_equal

        def canonical(ck):
            return json.loads(json.dumps(ck))

        if __name__ == "__main__":
            reference = list(toy_pipeline(4, policy=None))
            inline = iter(toy_pipeline(4, policy=None))
            it = iter(toy_pipeline(4, workers=2, policy=None, prefetch=3))
            got = [next(it) for _ in range(5)]
            it.checkpoint()  # the states at 5 outputs are now kept in this process
            got += [next(it) for _ in range(6)]
            os.kill(it.executor.procs[1].pid, signal.SIGTERM)
            start = time.monotonic()
            try:
                while True:
                    got.append(next(it))
            except WorkerError as exc:
                message = str(exc)
            surfaced = time.monotonic() - start
            assert "lanes [1, 3] was killed by signal 15 (SIGTERM)" in message, message
            assert "job scheduler" in message, message
            assert surfaced < 5, surfaced
            try:
                next(it)
            except WorkerError as exc:  # the same failure again, never a silent continuation
                assert str(exc) == message
            for _ in got:
                next(inline)
            ck = it.checkpoint()  # rebuilt here by replaying from the kept states
            assert canonical(ck) == canonical(inline.checkpoint())
            assert it.stats()["delivered"] == len(got)
            it.close()
            assert outputs_equal(got + list(toy_pipeline(4, policy=None).restore(ck)), reference)
            print("OK", len(got))
        """,
        timeout=90,
    )
    assert out.startswith("OK")


def test_checkpoint_after_close_when_a_worker_was_already_gone(tmp_path):
    out = run_script(
        tmp_path,
        """
        import json, os, signal, time
        from _util import toy_pipeline
        from zephon.testing import outputs_equal

        if __name__ == "__main__":
            reference = list(toy_pipeline(2, policy=None))
            it = iter(toy_pipeline(2, workers=2, policy=None))
            got = [next(it) for _ in range(4)]
            proc = it.executor.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
            it.close()  # does not raise: the states are rebuilt when asked for
            ck = it.checkpoint()
            assert outputs_equal(got + list(toy_pipeline(2, policy=None).restore(ck)), reference)
            print("OK")
        """,
        timeout=60,
    )
    assert out.strip() == "OK"


# -- 4. map functions that workers cannot import ---------------------------------------------------------


def worker_error(tmp_path: Path, top: str, guarded: str, run: str) -> str:
    """What a script prints for the ``WorkerError`` that ``run`` raises ("NO ERROR" if none): its
    module-level code ``top``, then, under the main guard, ``guarded`` and ``run``."""
    body = textwrap.dedent(top) + '\nif __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(guarded), "    ")
    body += f"""
    try:
        {run}
    except WorkerError as exc:
        print(exc)
    else:
        print("NO ERROR")
"""
    return run_script(tmp_path, body, timeout=60)


def test_function_defined_under_the_main_guard_gets_a_clear_error(tmp_path):
    out = worker_error(
        tmp_path,
        "from zephon import Pipeline, WorkerError\n",
        """
        def local_fn(p):
            return p
        """,
        'list(Pipeline([{"n": i} for i in range(10)]).options(workers=1).map(local_fn))',
    )
    assert "could not load the pipeline" in out, out
    assert "Can't get attribute 'local_fn'" in out
    assert "must be importable" in out
    assert "Move the function above the `if __name__ == '__main__':` line" in out


def test_workers_run_the_script_only_when_the_pipeline_refers_to_it(tmp_path):
    # The script records every process that runs its module-level code. Its imports (torch in a
    # training script) would otherwise delay every worker's start; a worker runs it only to unpickle
    # what is defined in it.
    out = run_script(
        tmp_path,
        """
        import multiprocessing as mp
        import os
        from zephon import Pipeline
        from _util import toy_pipeline
        from zephon.testing import outputs_equal

        with open("ran-by.txt", "a") as f:
            f.write(f"{os.getpid()}\\n")

        def plus_one(p):  # defined here: a pipeline that maps it makes the workers run the script
            return {"input_ids": [t + 1 for t in p["input_ids"]]}

        if __name__ == "__main__":
            def ran_by():
                with open("ran-by.txt") as f:
                    return set(map(int, f.read().split())) - {os.getpid()}

            def delivered(pipe):
                loader = pipe.loader()
                try:
                    return [b for b, _ in zip(loader, range(6))], {p.pid for p in mp.active_children()}
                finally:
                    loader.close()

            built_in, pids = delivered(toy_pipeline(2, workers=2))
            assert outputs_equal(built_in, delivered(toy_pipeline(2))[0]) and len(pids) == 2
            print("built-in ops, script run by workers:", len(ran_by() & pids))
            mapped = Pipeline([{"input_ids": [i, i]} for i in range(40)]).options(canonical_replicas=2, workers=2)
            got, pids = delivered(mapped.map(plus_one).batch(2))
            assert outputs_equal(got, delivered(mapped.options(workers=0).map(plus_one).batch(2))[0])
            print("a function of the script, script run by workers:", len(ran_by() & pids))
        """,
        timeout=90,
    )
    assert "built-in ops, script run by workers: 0" in out, out
    assert "a function of the script, script run by workers: 2" in out, out


def test_a_spawned_process_gives_its_workers_the_functions_of_the_script(tmp_path):
    # In a process started by spawn (torch.multiprocessing.spawn, a DDP launcher), the script is
    # the module __mp_main__: its functions pickle under that name and its workers must run it too.
    out = run_script(
        tmp_path,
        """
        import multiprocessing as mp
        from zephon import Pipeline
        from zephon.testing import outputs_equal

        def plus_one(p):
            return {"input_ids": [t + 1 for t in p["input_ids"]]}

        def child(queue):
            assert plus_one.__module__ == "__mp_main__"
            pipe = Pipeline([{"input_ids": [i, i]} for i in range(40)]).options(canonical_replicas=2).map(plus_one).batch(2)
            queue.put(outputs_equal(list(pipe.options(workers=2)), list(pipe)))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            print("equal:", queue.get(timeout=60))
            proc.join()
        """,
        timeout=90,
    )
    assert "equal: True" in out, out


# -- 5. signals are named, with their likely cause --------------------------------------------------------


@pytest.mark.parametrize(
    "sig,expected",
    [("SIGSEGV", "signal 11 (SIGSEGV)", ), ("SIGKILL", "signal 9 (SIGKILL)"), ("SIGBUS", "signal 7 (SIGBUS)")],
)
def test_worker_signal_is_named_with_its_likely_cause(tmp_path, sig, expected):
    out = run_script(
        tmp_path,
        f"""
        import os, signal
        from _util import toy_pipeline
        from zephon import WorkerError

        if __name__ == "__main__":
            it = iter(toy_pipeline(2, workers=2))
            for _ in range(3):  # the workers start after the first output
                next(it)
            os.kill(it.executor.procs[0].pid, signal.{sig})
            try:
                for _ in range(100_000):
                    next(it)
            except WorkerError as exc:
                print(exc)
        """,
        timeout=60,
    )
    assert expected in out, out
    cause = {"SIGSEGV": "native code", "SIGKILL": "out-of-memory killer", "SIGBUS": "memory-mapped file"}[sig]
    assert cause in out
    if sig != "SIGKILL":
        assert "out of memory" not in out and "out-of-memory" not in out


def test_a_checkpoint_is_answered_while_a_worker_is_inside_user_code(tmp_path, monkeypatch):
    import time

    from _util import assert_steps, gated_toks_to_ids, take_steps, toy_dataset
    from zephon import Pipeline
    from zephon.work import StaticMixtureWorkSource

    gate = tmp_path / "gate"
    monkeypatch.setenv("ZEPHON_TEST_GATE", str(gate))

    def build(**options):
        src = StaticMixtureWorkSource([toy_dataset()], {"web": 1.0}, chunk_size=8, exhausted_policy="repeat")
        return (Pipeline(src).options(canonical_replicas=2, **options)
                .map(gated_toks_to_ids).pack_flat(16).shuffle(8, seed=42).batch(2))

    with build().loader() as loader:
        reference = take_steps([loader], 8)
    with build(workers=1, read_ahead=0).loader() as loader:  # the map runs in the worker's loop itself
        steps = loader.steps()
        got = [next(steps) for _ in range(2)]
        gate.touch()
        got.append(next(steps))  # frees credit: the worker reads on, and its map waits at the gate
        deadline = time.monotonic() + 20
        while not (tmp_path / "gate.waiting").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "gate.waiting").exists(), "the worker never reached the gate"
        checkpoint = loader.checkpoint()  # the worker answers while its loop is held in the map
        gate.unlink()
        got += [next(steps) for _ in range(2)]
    assert_steps(got, reference[:5])
    with build().loader(checkpoint) as resumed:
        assert_steps(take_steps([resumed], 3), reference[3:6])
