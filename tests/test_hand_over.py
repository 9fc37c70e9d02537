"""Workers that start while the lanes run in the main process (``start_inline=True``, opt-in).

The lanes run here until each worker has loaded the pipeline, then move to it with their states,
and the chunks read ahead for them. Where the hand-over happens never shows: not in the batches,
the checkpoints, the counters or the errors. ``pin_hand_over`` pins the hand-over of each
worker to a number of outputs computed here. The laws over generated pipelines are in
``property_tests/test_pipeline_laws.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from _hand_over_pin import pin_hand_over
from _util import toks_to_ids, toy_dataset, toy_pipeline, with_lock, without_lock
from zephon import Pipeline, WorkerError
from zephon.testing import outputs_equal

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")


def _counts(stats):
    """The operators' counters of ``stats()``, without times."""
    return {name: {k: v for k, v in op.items() if not k.endswith("_s") and "per_s" not in k} for name, op in stats["operators"].items()}


def _finite(lanes=4, **options):
    return toy_pipeline(lanes, policy=None, start_inline=True, **options)


@pytest.mark.parametrize(
    "after, moved",
    [((0, 0), [0, 1, 2, 3]), ((1, 10**6), [0, 2]), ((5, 2), [1, 3]), ((10**6, 10**6), [])],
)
def test_where_the_lanes_move_never_changes_batches_checkpoints_or_counters(monkeypatch, after, moved):
    pin_hand_over(monkeypatch, after)
    inline = iter(_finite())
    expected = list(inline)
    reference = iter(_finite())
    for _ in range(7):
        next(reference)
    with _finite(workers=2).loader() as it:
        got = [next(it) for _ in range(7)]
        assert [lane for lane in range(4) if lane not in it.executor.lead_states] == moved
        ck = it.checkpoint()  # lanes here and lanes in workers
        assert ck == reference.checkpoint()
        got.extend(it)
        assert outputs_equal(got, expected)
        assert _counts(it.stats()) == _counts(inline.stats())
    with _finite(workers=2).loader(json.loads(json.dumps(ck))) as resumed:  # restored lanes move encoded
        assert outputs_equal(list(resumed), expected[7:])


def test_a_state_that_does_not_pickle_moves_as_its_checkpoint_encoding(monkeypatch):
    pin_hand_over(monkeypatch, (3,))

    def build(**options):  # the shuffle buffer holds records with a lock; the batches do not
        return (
            Pipeline(toy_dataset(120)).options(canonical_replicas=2, start_inline=True, **options)
            .map(toks_to_ids).map(with_lock).shuffle(8, seed=1).map(without_lock).batch(2)
        )

    expected = list(build())
    with build(workers=1).loader() as it:
        got = [next(it) for _ in range(5)]
        assert not it.executor.lead_states  # moved after 3 outputs, encoded: the buffer is rebuilt there
        got.extend(it)
    assert outputs_equal(got, expected)


def test_a_worker_that_dies_before_it_takes_its_lanes_is_reported_and_the_checkpoint_holds(monkeypatch):
    pin_hand_over(monkeypatch, (10**6, 10**6))
    reference = iter(_finite())
    it = iter(_finite(workers=2))
    got = [next(it) for _ in range(3)]
    os.kill(it.executor.procs[1].pid, signal.SIGKILL)
    it.executor.procs[1].join(10)
    with pytest.raises(WorkerError, match=r"lanes \[1, 3\] was killed by signal 9"):
        for _ in range(1000):
            got.append(next(it))
    for _ in got:
        next(reference)
    assert it.checkpoint() == reference.checkpoint()  # every lane was still here
    it.close()


@pytest.mark.parametrize("cpus, lanes_here_after_two", [(64, [0, 1, 2, 3]), (2, [0, 2])])
def test_the_workers_start_after_the_first_output_and_the_lanes_wait_for_them_without_spare_cores(
    monkeypatch, cpus, lanes_here_after_two
):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    it = iter(_finite(workers=2))
    got = [next(it)]  # computed here, with every core
    assert it.executor.procs == []
    got.append(next(it))  # lane 1: the workers start; without a core each, lane 1 waits for its worker
    assert len(it.executor.procs) == 2
    assert sorted(it.executor.lead_states) == lanes_here_after_two
    got.extend(it)
    assert outputs_equal(got, list(_finite()))


def test_workers_ignore_ctrl_c_from_their_start():
    """SIGINT while a worker still imports (before any code of ours runs there) leaves it alive."""
    it = iter(toy_pipeline(4, policy=None, workers=2))  # they start at iter()
    for proc in it.executor.procs:
        os.kill(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert [p.exitcode for p in it.executor.procs] == [None, None]
    got = list(it)
    assert outputs_equal(got, list(_finite()))
