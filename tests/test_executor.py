"""Worker processes: same batches for any worker count, exact checkpoints, loud failures."""

import os
import signal
import time

import pytest

from _util import fail_on_row_7, toks_to_ids, toy_dataset, toy_pipeline, with_lock, without_lock
from zephon import Pipeline, WorkerError
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource


def finite(lanes, workers, **kw):
    return toy_pipeline(lanes, workers=workers, policy=None, **kw)


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_worker_count_never_changes_the_batches(workers):
    assert outputs_equal(list(finite(4, 0)), list(finite(4, workers)))


def test_checkpoint_while_workers_run_ahead_covers_only_what_was_received():
    reference = list(finite(3, 0))
    pipe = finite(3, 2, prefetch=8)
    it = iter(pipe)
    got = [next(it) for _ in range(7)]
    time.sleep(0.3)  # let the workers run ahead
    ckpt = it.checkpoint()
    assert {k: v["delivered"] for k, v in ckpt["lanes"].items()} == {"0": 3, "1": 2, "2": 2}
    rest = list(finite(3, 0).restore(ckpt))
    assert outputs_equal(got + rest, reference)
    it.close()


def test_restore_into_workers():
    reference = list(finite(2, 0))
    pipe = finite(2, 0)
    it = iter(pipe)
    for _ in range(5):
        next(it)
    assert outputs_equal(list(finite(2, 2).restore(it.checkpoint())), reference[5:])


def test_checkpoint_after_the_end_with_workers():
    loader = finite(2, 2).loader()
    n = len(list(loader))
    ck = loader.checkpoint()
    assert sum(v["delivered"] for v in ck["lanes"].values()) == n
    assert list(finite(2, 0).restore(ck)) == []
    assert loader.stats()["operators"]["pack_flat"]["rows"] > 0


def _failing(workers, **options):
    src = StaticMixtureWorkSource([toy_dataset()], {"web": 1.0}, chunk_size=8, shuffle_shards=False)
    return Pipeline(src).options(canonical_replicas=2, workers=workers, **options).map(fail_on_row_7).batch(1)


def test_exception_in_user_code_names_the_lane_and_cause():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"lane [01] failed in a worker process: ValueError: row 7 is bad") as info:
        list(_failing(2))
    assert "raised by map on the record from dataset 0, shard 0, row 7" in str(info.value)
    assert time.monotonic() - start < 30


def test_start_inline_true_is_refused_and_says_what_to_use():
    # The workers own their lanes from iter() on: no lane runs here first, so user code never does.
    with pytest.raises(ValueError, match=r"start_inline=True is not supported.*use workers=0 \(thread=True"):
        finite(2, 2, start_inline=True)
    with pytest.warns(DeprecationWarning, match="start_inline=False is what workers > 0 always does; drop the argument"):
        pipe = finite(2, 2, start_inline=False)
    assert outputs_equal(list(pipe), list(finite(2, 0)))


def test_workers_ignore_ctrl_c_from_their_start():
    """SIGINT while a worker still imports (before any code of ours runs there) leaves it alive."""
    it = iter(finite(4, 2))  # they start at iter()
    for proc in it.executor.procs:
        os.kill(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert [p.exitcode for p in it.executor.procs] == [None, None]
    assert outputs_equal(list(it), list(finite(4, 0)))


def test_records_that_do_not_pickle_may_wait_in_a_workers_buffers():
    # The shuffle buffer holds records with a lock; only the batches (without it) cross processes.
    def build(**options):
        return (
            Pipeline(toy_dataset(120)).options(canonical_replicas=2, **options)
            .map(toks_to_ids).map(with_lock).shuffle(8, seed=1).map(without_lock).batch(2)
        )

    with build(workers=1).loader() as it:
        got = [next(it) for _ in range(5)]
        ck = it.checkpoint()  # encoded in the worker
        got.extend(it)
    assert outputs_equal(got, list(build()))
    assert outputs_equal(list(build(workers=1).restore(ck)), got[5:])


def test_same_exception_in_process():
    with pytest.raises(ValueError, match="row 7 is bad") as info:
        list(_failing(0))
    assert any("shard 0, row 7" in note for note in info.value.__notes__)


def test_killed_worker_is_reported_within_seconds_and_nothing_is_left_behind():
    pipe = toy_pipeline(2, workers=2)
    it = iter(pipe)
    for _ in range(3):  # the workers start after the first output
        next(it)
    procs = list(it.executor.procs)
    assert len(procs) == 2
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"lanes \[1\] was killed by signal 9"):
        for _ in range(10_000):
            next(it)
    assert time.monotonic() - start < 5
    for p in procs:
        p.join(timeout=5)
        assert not p.is_alive()


def test_close_and_context_manager_stop_workers():
    with toy_pipeline(2, workers=2).loader() as it:
        for _ in range(3):
            next(it)
        procs = list(it.executor.procs)
        assert len(procs) == 2
    for p in procs:
        p.join(timeout=5)
        assert not p.is_alive()


def test_lambdas_with_workers_get_a_clear_error():
    pipe = Pipeline([{"a": 1}]).options(workers=1).map(lambda p: p)
    with pytest.raises(TypeError, match="module-level function"):
        iter(pipe)


def test_num_workers_alias():
    assert Pipeline([{"a": 1}]).options(num_workers=3).run_options.workers == 3


def test_background_thread_gives_the_same_batches_and_exact_checkpoints():
    reference = list(finite(3, 0))
    assert outputs_equal(list(finite(3, 0, thread=True)), reference)
    pipe = finite(3, 0, thread=True, prefetch=8)
    it = iter(pipe)
    got = [next(it) for _ in range(5)]
    time.sleep(0.2)
    rest = list(finite(3, 0).restore(it.checkpoint()))
    assert outputs_equal(got + rest, reference)
    it.close()


def test_background_thread_surfaces_exceptions():
    src = StaticMixtureWorkSource([toy_dataset()], {"web": 1.0}, chunk_size=8, shuffle_shards=False)
    pipe = Pipeline(src).options(canonical_replicas=2, thread=True).map(fail_on_row_7).batch(1)
    with pytest.raises(ValueError, match="row 7 is bad"):
        list(pipe)


def test_checkpoint_after_a_worker_failure_explains_itself():
    loader = _failing(2).loader()
    with pytest.raises(WorkerError):
        list(loader)
    with pytest.raises(WorkerError, match="Restore the last checkpoint"):
        loader.checkpoint()


def test_after_a_restore_mid_step_the_background_thread_computes_the_lanes_the_caller_needs_first(monkeypatch):
    # A restore three outputs into a global step of four lanes: the caller asks for lane 3, then
    # lanes 0, 1, 2 of the next step. The background thread must compute them in that order, or
    # the first batch waits for three lanes it does not need yet (each possibly flushing a buffer).
    from zephon.runtime.lanes import Plan

    pipe = finite(4, 0, thread=True)
    loader = iter(pipe)
    for _ in range(4 * 3 + 3):
        next(loader)
    ckpt = loader.checkpoint()
    loader.close()
    expected = list(finite(4, 0).restore(ckpt))  # before recording: only the background thread's calls count
    order = []
    real_next = Plan.next

    def recording(self, lane, state, *args, **kwargs):
        order.append(lane)
        return real_next(self, lane, state, *args, **kwargs)

    monkeypatch.setattr(Plan, "next", recording)
    resumed = iter(pipe.restore(ckpt))
    got = [next(resumed) for _ in range(4)]
    resumed.close()
    assert order[:4] == [3, 0, 1, 2], order[:8]
    assert outputs_equal(got, expected[:4])


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_share_the_cpus_for_tiktoken_threads(workers, monkeypatch):
    from _util import with_encoder_threads
    from zephon.io import Dataset, InMemoryShard

    monkeypatch.delenv("ZEPHON_ENCODER_THREADS", raising=False)  # the workers inherit this environment
    rows = [{"id": i} for i in range(8)]
    pipe = Pipeline(Dataset.from_dict("d", {"s": InMemoryShard(rows)})).options(
        canonical_replicas=2, workers=workers  # every record is read in a worker
    ).map(with_encoder_threads)
    seen = {r.payload["encoder_threads"] for r in pipe}
    cpus = os.cpu_count() or 1
    share = max(1, cpus // workers)
    # Each worker's share, set for tiktoken in every thread: a single worker takes a thread per CPU,
    # without the calling process's extra read-ahead thread (the main process needs the cores too).
    assert seen == {str(share)}


def with_marker(payload):
    """Tags the record with this process's ``ZEPHON_TEST_MARKER`` (module-level: the workers import it)."""
    return {**payload, "marker": os.environ.get("ZEPHON_TEST_MARKER")}


def test_workers_see_the_environment_of_the_caller_at_iter_not_of_when_the_pipeline_was_built(monkeypatch):
    from zephon.io import Dataset, InMemoryShard

    monkeypatch.setenv("ZEPHON_TEST_MARKER", "when built")
    rows = [{"id": i} for i in range(8)]
    pipe = Pipeline(Dataset.from_dict("d", {"s": InMemoryShard(rows)})).options(
        canonical_replicas=2, workers=2  # the workers' fork server may start here, with this environment
    ).map(with_marker)
    monkeypatch.setenv("ZEPHON_TEST_MARKER", "at iter")
    seen = [r.payload["marker"] for r in pipe]
    assert seen == ["at iter"] * len(rows)
