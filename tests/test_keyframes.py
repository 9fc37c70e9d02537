"""Keyframes: a skip restarts from the lane states a run saved near its target, and stays exact.

The reference is the uninterrupted run: after skipping from a keyframe, every later global step
is that run's, lane by lane; the run's own skips and mixture counts are kept; a keyframe that
cannot serve is passed over with a warning naming it.
"""

import os

import pytest

from _util import assert_steps, take_steps as take, toy_pipeline

L = 4
STEPS = 30


@pytest.fixture(scope="module")
def uninterrupted():
    with toy_pipeline(L).loader() as loader:
        return [step for _, step in zip(range(STEPS), loader.steps())]


def saved_run(folder, steps, D=1, every=5, keep=100, workers=0):
    """A run over ``steps`` global steps on ``D`` ranks that saves keyframes in ``folder``."""
    loaders = [toy_pipeline(L, workers=workers, keyframes=folder, keyframe_every=every, keyframe_keep=keep)
               .options(dp_degree=D, dp_rank=r).loader() for r in range(D)]
    got = take(loaders, steps)
    for loader in loaders:
        loader.close()
    return got


@pytest.mark.parametrize("D_saved,D_skip,workers", [(1, 1, 0), (2, 1, 0), (1, 4, 0), (2, 2, 2)])
def test_a_skip_from_a_keyframe_gives_the_uninterrupted_steps(tmp_path, uninterrupted, D_saved, D_skip, workers):
    folder = tmp_path / "keyframes"  # workers: of the run that saves and of the one that skips
    assert_steps(saved_run(folder, 22, D=D_saved, workers=workers), uninterrupted[:22])
    assert sorted(os.listdir(folder))[:4] == ["step-000000000005", "step-000000000010", "step-000000000015",
                                             "step-000000000020"]
    loaders = [toy_pipeline(L, workers=workers, keyframes=folder).options(dp_degree=D_skip, dp_rank=r).loader()
               for r in range(D_skip)]
    assert_steps(take(loaders, 3), uninterrupted[:3])
    skips = [loader.skip_steps(14) for loader in loaders]  # to step 17: from the keyframe of step 15
    assert {(s.first, s.count, s.keyframe) for s in skips} == {(3, 14, 15)}
    assert_steps(take(loaders, 6), uninterrupted[17:23])
    for loader in loaders:
        stats = loader.stats()["skipped_steps"]
        assert loader.skips == ((3, 14),) and stats["ranges"] == [[3, 16]]
        assert (stats["steps"], stats["from_keyframes"]) == (14, 12)  # 3 -> 15 restored, 15 and 16 produced
        assert "14 steps (12 from keyframes;" in loader.stats_table()
        loader.close()


def test_the_run_keeps_its_skips_and_counts_and_resumes_exactly(tmp_path, uninterrupted):
    folder = tmp_path / "keyframes"
    saved_run(folder, 20)
    with toy_pipeline(L, keyframes=folder).loader() as plain, toy_pipeline(L).loader() as reference:
        for loader in (plain, reference):
            take([loader], 2)
            first = loader.skip_steps(3)  # 2 -> 5: the keyframe of step 5 is the target itself
            take([loader], 1)
            second = loader.skip_steps(11)  # 6 -> 17, from the keyframe of step 15
        assert (first.keyframe, second.keyframe) == (None, None)  # the reference saves none
        assert [s.keyframe for s in (plain.skip_steps(0),)] == [None]
        assert [s for s in plain.skips] == [(2, 3), (6, 11)] == list(reference.skips)
        with_keyframes, without = plain.checkpoint(), reference.checkpoint()
        # The same lane states as skipping without keyframes, mixture counts included (skipped outputs
        # are never counted), so the checkpoint resumes the same way.
        assert with_keyframes["lanes"] == without["lanes"]
        assert plain.stats()["mixture"] == reference.stats()["mixture"]
    with toy_pipeline(L).loader(with_keyframes) as resumed:
        assert resumed.skips == ((2, 3), (6, 11))
        assert_steps(take([resumed], 4), uninterrupted[17:21])


def test_keyframes_that_cannot_serve_are_passed_over_by_name(tmp_path, uninterrupted):
    folder = tmp_path / "keyframes"
    saved_run(folder, 20)
    (folder / "step-000000000015" / "zephon-lanes-00000-00003.msgpack").write_bytes(b"damaged")
    other = tmp_path / "other"
    saved_run(other, 10)
    with toy_pipeline(L, seed=1, keyframes=other).loader() as loader:  # other data settings: all passed over
        with pytest.warns(RuntimeWarning, match=r"step-000000000010.*different data settings"):
            assert loader.skip_steps(10).keyframe is None
    with toy_pipeline(L, keyframes=folder).loader() as loader:
        take([loader], 1)
        with pytest.warns(RuntimeWarning, match=r"keyframes passed over.*step-000000000015.*not a zephon checkpoint"):
            skipped = loader.skip_steps(16)
        assert skipped.keyframe == 10  # the newest one that serves
        assert_steps(take([loader], 3), uninterrupted[17:20])


def test_old_keyframes_are_removed_and_no_keyframe_is_a_plain_skip(tmp_path, uninterrupted):
    folder = tmp_path / "keyframes"
    saved_run(folder, 24, every=3, keep=2)
    assert sorted(os.listdir(folder)) == ["step-000000000021", "step-000000000024"]
    with toy_pipeline(L, keyframes=folder).loader() as loader:
        assert loader.skip_steps(10).keyframe is None  # 0 -> 10: the kept keyframes are later
        assert loader.skip_steps(12).keyframe == 21  # 10 -> 22
        assert_steps(take([loader], 2), uninterrupted[22:24])


def test_a_folder_that_cannot_be_written_is_warned_about_once(tmp_path, uninterrupted):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with toy_pipeline(L, keyframes=blocker / "keyframes", keyframe_every=2).loader() as loader:
        with pytest.warns(RuntimeWarning, match="keyframes: cannot save step 2") as caught:
            got = take([loader], 7)
    assert len([w for w in caught if "keyframes" in str(w.message)]) == 1
    assert_steps(got, uninterrupted[:7])


def test_explain_shows_where_keyframes_go(tmp_path):
    shown = toy_pipeline(L, keyframes=tmp_path / "kf", keyframe_every=25).explain()
    assert f"keyframes: every 25 global steps in {tmp_path / 'kf'}, the newest 100 kept" in str(shown)
    assert shown.to_dict()["checkpoint"]["keyframes"] == {"folder": str(tmp_path / "kf"), "every": 25, "keep": 100}
    assert "keyframes: every" not in str(toy_pipeline(L).explain())
