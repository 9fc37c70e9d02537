"""Skipping global steps: exactly the uninterrupted run's later steps, on any D and executor, recorded and resumable.

The reference is always the uninterrupted run itself: skipping ``n`` steps at step ``k`` must give
its steps ``k + n, k + n + 1, ...`` (every microbatch equal, lane by lane).
"""

import json
import time

import pytest

from _util import assert_steps, take_steps as take, toy_pipeline
from zephon import merge_checkpoints
from zephon.cli.main import main
from zephon.ledger import Ledger, diff, read_skips
from zephon.runtime.thread_executor import ThreadExecutor
from zephon.testing import outputs_equal

L = 4
STEPS = 14  # the uninterrupted run's steps that the tests compare against


@pytest.fixture(scope="module")
def uninterrupted():
    """The first ``STEPS`` global steps of the run, each the L microbatches in lane order."""
    with toy_pipeline(L).loader() as loader:
        return [step for _, step in zip(range(STEPS), loader.steps())]


def rank_loaders(D, checkpoint=None, **options):
    return [toy_pipeline(L, **options).options(dp_degree=D, dp_rank=r).loader(checkpoint) for r in range(D)]


@pytest.mark.parametrize("D", [1, 2, 4])
def test_skipping_gives_the_uninterrupted_runs_later_steps_on_every_D(uninterrupted, D):
    loaders = rank_loaders(D)
    assert_steps(take(loaders, 2), uninterrupted[:2])
    skips = [loader.skip_steps(5) for loader in loaders]
    assert {(s.first, s.count, s.last) for s in skips} == {(2, 5, 6)}
    assert all(loader.next_step == 7 for loader in loaders)
    assert_steps(take(loaders, 3), uninterrupted[7:10])
    for loader in loaders:
        stats = loader.stats()
        assert stats["skipped_steps"]["steps"] == 5 and stats["skipped_steps"]["ranges"] == [[2, 6]]
        assert stats["skipped_steps"]["outputs"] == 5 * (L // D)
        assert "skipped: steps 2\u20136; here 5 steps" in loader.stats_table()
        loader.close()


@pytest.mark.parametrize("D, options", [(2, {"workers": 2}), (1, {"workers": 2}), (1, {"thread": True})],
                         ids=["D=2-workers=2", "D=1-workers=2", "D=1-thread"])
def test_skipping_while_batches_are_read_ahead_is_exact(uninterrupted, D, options):
    loaders = rank_loaders(D, prefetch=3, **options)
    try:
        assert_steps(take(loaders, 1), uninterrupted[:1])
        for loader in loaders:
            skipped = loader.skip_steps(6)
            assert skipped.count == 6 and 0 <= skipped.discarded <= 3 * (L // D)
            assert loader.stats()["skipped_steps"]["discarded"] == skipped.discarded
        assert_steps(take(loaders, 3), uninterrupted[7:10])
        # The checkpoint after it is the one of the same skip in this process, lane for lane.
        with toy_pipeline(L).loader() as inline:
            take([inline], 1)
            inline.skip_steps(6)
            take([inline], 3)
            assert merge_checkpoints([loader.checkpoint() for loader in loaders]) == inline.checkpoint()
    finally:
        for loader in loaders:
            loader.close()


def test_outputs_read_ahead_for_skipped_steps_are_dropped_and_counted(uninterrupted):
    plan = toy_pipeline(L).plan
    executor = ThreadExecutor(plan, {lane: plan.init(lane) for lane in range(L)}, credit=2)
    try:
        deadline = time.monotonic() + 30
        while any(q.qsize() < 2 for q in executor.queues.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        reached, discarded = executor.skip({lane: 3 for lane in range(L)})
        assert reached == {lane: 3 for lane in range(L)} and discarded == 2 * L  # outputs 1 and 2 of each lane
        assert outputs_equal([executor.next(lane) for lane in range(L)], uninterrupted[3])
    finally:
        executor.close()


def test_two_skips_compose_and_a_checkpoint_after_them_resumes_after_them(uninterrupted):
    with toy_pipeline(L).loader() as loader:
        steps = loader.steps()
        assert outputs_equal(next(steps), uninterrupted[0])
        loader.skip_steps(2)
        assert outputs_equal(next(steps), uninterrupted[3])
        loader.skip_steps(3)
        assert outputs_equal(next(steps), uninterrupted[7])
        assert loader.skips == ((1, 2), (4, 3))
        ck = json.loads(json.dumps(loader.checkpoint()))
    assert all(state["skipped_steps"] == [[1, 2], [4, 3]] for state in ck["lanes"].values())
    for D in (1, 2, 4):
        resumed = rank_loaders(D, ck)
        assert all(r.skips == ((1, 2), (4, 3)) and r.next_step == 8 for r in resumed)
        assert_steps(take(resumed, 2), uninterrupted[8:10])


def test_pipeline_loader_skips_after_its_checkpoint(uninterrupted):
    with toy_pipeline(L).loader() as loader:
        take([loader], 3)
        ck = loader.checkpoint()
    for workers in (0, 2):
        with toy_pipeline(L, workers=workers).loader(ck, skip_steps=4) as resumed:
            assert resumed.skips == ((3, 4),)
            assert_steps(take([resumed], 2), uninterrupted[7:9])


def test_skipping_no_steps_changes_nothing(uninterrupted):
    with toy_pipeline(L).loader(skip_steps=0) as loader:
        assert loader.skip_steps(0).count == 0 and loader.skips == ()
        assert "skipped_steps" not in loader.checkpoint()["lanes"]["0"]
        assert_steps(take([loader], 2), uninterrupted[:2])


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_a_bad_step_count_is_refused_by_name(bad):
    with toy_pipeline(L).loader() as loader:
        with pytest.raises(ValueError, match=r"skip_steps: n must be an int >= 0"):
            loader.skip_steps(bad)
    with pytest.raises(ValueError, match=r"skip_steps must be an int >= 0"):
        toy_pipeline(L).loader(skip_steps=bad)


def test_skipping_inside_a_global_step_is_refused():
    with toy_pipeline(L).loader() as loader:
        next(loader)  # lane 0's output of step 0 only
        with pytest.raises(ValueError, match="inside global step 0"):
            loader.skip_steps(1)


def test_skipping_past_the_end_of_finite_data_warns_and_ends():
    full = list(toy_pipeline(L, policy="stop").steps())
    with toy_pipeline(L, policy="stop").loader() as loader:
        with pytest.warns(RuntimeWarning, match=f"the data ends at step {len(full)}, inside the steps skipped"):
            skipped = loader.skip_steps(len(full) + 5)
        assert (skipped.count, skipped.ended_at) == (len(full) + 5, len(full))
        assert list(loader.steps()) == []
        assert loader.skips == ((0, len(full) + 5),)


def test_a_checkpoint_of_lanes_that_skipped_differently_is_refused():
    with toy_pipeline(L).loader() as a, toy_pipeline(L).loader() as b:
        b.skip_steps(2)
        ca, cb = a.checkpoint(), b.checkpoint()
    mixed = {**ca, "lanes": {"0": cb["lanes"]["0"], **{k: v for k, v in ca["lanes"].items() if k != "0"}}}
    with pytest.raises(ValueError, match="record different skipped steps"):
        toy_pipeline(L).loader(mixed)


def _record(folder, loader, steps):
    """Record ``steps`` steps numbered as the uninterrupted run numbers them, skipping 4 after step 2."""
    with Ledger(folder / "rank-0.jsonl") as ledger:
        for _, step in zip(range(steps), loader.steps()):
            ledger.record(loader.next_step - 1, step)
            if loader.next_step == 3:
                ledger.record_skip(loader.skip_steps(4))


def test_the_ledger_shows_the_skip_and_diff_expects_it(tmp_path, capsys):
    with toy_pipeline(L).loader() as loader:
        _record(tmp_path / "skipping", loader, 6)  # steps 0-2, then 7-9
    with toy_pipeline(L).loader() as loader:
        with Ledger(tmp_path / "full" / "rank-0.jsonl") as ledger:
            for k, step in zip(range(10), loader.steps()):
                ledger.record(k, step)
    assert read_skips(tmp_path / "skipping") == [(3, 6)]
    assert main(["ledger", "show", str(tmp_path / "skipping")]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "steps 3\u20136 skipped" in shown
    assert [line.split()[0] for line in shown] == ["0", "1", "2", "steps", "7", "8", "9"]
    result = diff(tmp_path / "skipping", tmp_path / "full")
    assert result.match and result.compared == 6 and result.skipped == {"a": [(3, 6)], "b": []}
    assert main(["ledger", "diff", str(tmp_path / "full"), str(tmp_path / "skipping")]) == 0
    assert "steps 3\u20136 skipped in B (expected, not compared)" in capsys.readouterr().out


def test_the_ledger_numbers_steps_after_a_skip_by_the_uninterrupted_run(tmp_path):
    # Recorded with next_step, the skipping run's digests match the uninterrupted run's at the same steps.
    with toy_pipeline(L).loader() as loader:
        with Ledger(tmp_path / "a" / "rank-0.jsonl") as ledger:
            ledger.record_skip(loader.skip_steps(3))
            for _, step in zip(range(2), loader.steps()):
                ledger.record(loader.next_step - 1, step)
    with toy_pipeline(L).loader() as loader:
        with Ledger(tmp_path / "b" / "rank-0.jsonl") as ledger:
            for k, step in zip(range(3), loader.steps()):
                ledger.record(k + 2, step)  # misnumbered: step 2 recorded as 4
    result = diff(tmp_path / "a", tmp_path / "b")
    assert not result.match and result.step == 3


def test_the_torch_dataloader_skips_and_resumes_on_any_number_of_workers(uninterrupted):
    import torch
    import torch.utils.data

    from zephon.integrations.torch import DataLoader

    def tensors(steps):
        return [torch.utils.data.default_convert(b.to_training(return_labels=True)) for step in steps for b in step]

    def equal(a, b):
        return torch.equal(a, b) and a.dtype == b.dtype if isinstance(a, torch.Tensor) else a == b

    def same(xs, ys):
        pairs = list(zip(xs, ys))
        return len(xs) == len(ys) and all(x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x) for x, y in pairs)

    dl = DataLoader(toy_pipeline(L), num_workers=2, return_labels=True)
    it = iter(dl)
    assert same([next(it) for _ in range(2 * L)], tensors(uninterrupted[:2]))
    skipped = dl.skip_steps(3)
    assert (skipped.first, skipped.count) == (2, 3)
    assert same([x for _, x in zip(range(2 * L), dl)], tensors(uninterrupted[5:7]))
    state = dl.state_dict()
    dl.close()
    resumed = DataLoader(toy_pipeline(L), num_workers=0, checkpoint=state, return_labels=True)
    assert same([x for _, x in zip(range(L), resumed)], tensors(uninterrupted[7:8]))
    assert all(lane["skipped_steps"] == [[2, 3]] for lane in resumed.checkpoint()["lanes"].values())
