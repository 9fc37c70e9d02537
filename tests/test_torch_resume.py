"""Resuming torch iteration: a restored pipeline's dataset, and a DataLoader whose state ignores workers.

``zephon.integrations.torch.DataLoader`` tracks in the main process which outputs the caller
received, so its ``state_dict()`` is zephon's lane checkpoint after exactly those outputs, the
same for 0, 1, 2 or 4 DataLoader workers, and it resumes on any of them.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.utils.data  # noqa: E402

from _util import toy_dataset, toy_pipeline  # noqa: E402
from zephon.integrations.torch import DataLoader  # noqa: E402

OPTIONS = dict(return_labels=True, return_num_valid_tokens=True)


def same(a, b):
    """Two training-tensor dicts are identical: keys, and every value (tensors by dtype and content)."""
    return a.keys() == b.keys() and all(
        (isinstance(b[k], torch.Tensor) and torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype)
        if isinstance(a[k], torch.Tensor)
        else a[k] == b[k]
        for k in a
    )


def same_seq(xs, ys):
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def reference(pipe, n=None):
    """The pipeline's own microbatches as training tensors, through a plain DataLoader's conversion."""
    loader = pipe.loader()
    batches = [b for _, b in zip(range(n), loader)] if n else list(loader)
    loader.close()
    return [torch.utils.data.default_convert(b.to_training(**OPTIONS)) for b in batches]


def checkpoint_after(pipe, n):
    loader = pipe.loader()
    for _ in range(n):
        next(loader)
    ck = loader.checkpoint()
    loader.close()
    return ck


def take(iterable, n):
    return [x for _, x in zip(range(n), iterable)]


# -- a pipeline carrying a restore ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("cut", [6, 5])  # 5: mid-step, and odd (the first item belongs to worker 1's lanes)
def test_the_dataset_of_a_restored_pipeline_starts_at_the_checkpoint(workers, cut):
    expected = reference(toy_pipeline(4), cut + 8)
    ck = checkpoint_after(toy_pipeline(4), cut)
    restored = toy_pipeline(4).restore(ck)
    got = take(torch.utils.data.DataLoader(restored.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=workers), 8)
    assert same_seq(got, expected[cut:])
    explicit = toy_pipeline(4).to_torch_dataset(checkpoint=ck, **OPTIONS)
    got = take(torch.utils.data.DataLoader(explicit, batch_size=None, num_workers=workers), 8)
    assert same_seq(got, expected[cut:])


def test_every_consumer_of_a_restored_pipeline_starts_at_the_checkpoint():
    expected = reference(toy_pipeline(2), 10)
    ck = checkpoint_after(toy_pipeline(2), 3)
    pipe = toy_pipeline(2).restore(ck)
    assert pipe.loader().checkpoint() == ck
    dataset = pipe.to_torch_dataset(**OPTIONS)
    for _ in range(2):  # every loader and every iteration of the dataset starts there, not only the first
        loader = pipe.loader()
        assert same_seq([torch.utils.data.default_convert(b.to_training(**OPTIONS)) for b in take(loader, 4)], expected[3:7])
        loader.close()
        assert same_seq(take(torch.utils.data.DataLoader(dataset, batch_size=None), 4), expected[3:7])
        assert same_seq(take(DataLoader(pipe, **OPTIONS), 4), expected[3:7])
    fresh = toy_pipeline(2).loader()  # the pipeline it was restored from starts at the beginning
    assert same_seq([torch.utils.data.default_convert(b.to_training(**OPTIONS)) for b in take(fresh, 2)], expected[:2])
    fresh.close()


def test_a_dataset_checkpoint_of_other_settings_fails_when_the_dataset_is_made():
    ck = checkpoint_after(toy_pipeline(4), 3)
    with pytest.raises(ValueError, match="different data settings"):
        toy_pipeline(4, max_length=17).to_torch_dataset(checkpoint=ck, **OPTIONS)


# -- zephon's DataLoader: a state that does not depend on the workers -----------------------------------

PAIRS = [(2, 1), (2, 0), (2, 4), (1, 2), (0, 4), (4, 0), (4, 2)]


@pytest.mark.parametrize("before, after", PAIRS)
def test_the_dataloader_resumes_exactly_on_another_number_of_workers(before, after):
    expected = reference(toy_pipeline(4), 24)
    first = DataLoader(toy_pipeline(4), num_workers=before, **OPTIONS)
    it = iter(first)
    head = [next(it) for _ in range(11)]  # 11: mid-step (3 of the 4 lanes of step 2 delivered)
    state = first.state_dict()
    first.close()
    resumed = DataLoader(toy_pipeline(4), num_workers=after, **OPTIONS)
    resumed.load_state_dict(state)
    assert same_seq(head + take(resumed, 13), expected)


def test_the_state_is_the_same_checkpoint_whatever_the_workers():
    states = {}
    for workers in (0, 1, 2, 4):
        loader = DataLoader(toy_pipeline(4), num_workers=workers, **OPTIONS)
        take(loader, 7)
        states[workers] = loader.checkpoint()
        loader.close()
    assert states[0] == checkpoint_after(toy_pipeline(4), 7)
    assert states[1] == states[0] and states[2] == states[0] and states[4] == states[0]


def test_the_dataloader_continues_on_the_next_iter_and_takes_a_checkpoint():
    expected = reference(toy_pipeline(4), 16)
    ck = checkpoint_after(toy_pipeline(4), 5)
    loader = DataLoader(toy_pipeline(4).to_torch_dataset(**OPTIONS), num_workers=2, checkpoint=ck)
    first = iter(loader)
    head = [next(first) for _ in range(3)]
    second = iter(loader)  # continues after the 3 items delivered; the first iterator is replaced
    assert same_seq(head + take(second, 8), expected[5:16])
    with pytest.raises(RuntimeError, match="replaced"):
        next(first)
    loader.close()


def test_finite_data_ends_where_the_pipeline_ends_with_any_workers_and_resumes_there():
    pipe = lambda: toy_pipeline(4, policy=None, data=toy_dataset(97, seed=3))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = reference(pipe())
    assert len(expected) % 4 != 0  # the data ends inside a step
    for workers in (0, 2, 4):
        loader = DataLoader(pipe(), num_workers=workers, **OPTIONS)
        with pytest.warns(RuntimeWarning, match="not delivered"):
            assert same_seq(list(loader), expected)
        resumed = DataLoader(pipe(), num_workers=2, checkpoint=checkpoint_after(pipe(), len(expected) - 3), **OPTIONS)
        with pytest.warns(RuntimeWarning, match="not delivered"):
            assert same_seq(list(resumed), expected[-3:])
        # A new pass after the end starts from the beginning of the data, as a torch epoch does.
        assert same_seq(take(resumed, 5), expected[:5])
        resumed.close()


def test_a_statefuldataloader_state_loads_into_the_dataloader_on_any_workers():
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    expected = reference(toy_pipeline(4), 20)
    first = StatefulDataLoader(toy_pipeline(4).to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2)
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = first.state_dict()
    del it, first
    for workers in (0, 1, 4):
        resumed = DataLoader(toy_pipeline(4), num_workers=workers, **OPTIONS)
        resumed.load_state_dict(state)
        assert same_seq(head + take(resumed, 11), expected), workers
        resumed.close()


def test_a_statefuldataloader_refusing_other_workers_names_the_loader_that_works():
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    first = StatefulDataLoader(toy_pipeline(4).to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2)
    it = iter(first)
    take(it, 5)
    state = first.state_dict()
    del it, first
    resumed = StatefulDataLoader(toy_pipeline(4).to_torch_dataset(**OPTIONS), batch_size=None, num_workers=1)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"zephon\.integrations\.torch\.DataLoader") as err:
        next(iter(resumed))
    assert "merge every rank" not in str(err.value)


def test_the_dataloader_refuses_settings_it_owns_and_bad_states():
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(toy_pipeline(4), batch_size=4, **OPTIONS)
    with pytest.raises(ValueError, match="drain"):
        DataLoader(toy_pipeline(4, drain=True), num_workers=2, **OPTIONS)
    with pytest.raises(TypeError, match="did you mean 'return_labels'"):
        DataLoader(toy_pipeline(4), return_label=True)
    loader = DataLoader(toy_pipeline(4), **OPTIONS)
    with pytest.raises(ValueError, match="no zephon checkpoint"):
        loader.load_state_dict({"something": 1})
    with pytest.raises(ValueError, match="different data settings"):
        loader.load_state_dict(checkpoint_after(toy_pipeline(4, max_length=17), 2))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_dataloader_saves_keyframes_from_its_workers_and_skips_from_them(tmp_path, workers):
    folder = tmp_path / "keyframes"
    pipe = toy_pipeline(4, keyframes=folder, keyframe_every=5)
    expected = reference(toy_pipeline(4), 4 * 16)
    loader = DataLoader(pipe, num_workers=workers, **OPTIONS)
    assert same_seq(take(loader, 4 * 12), expected[: 4 * 12])
    loader.close()
    loader = DataLoader(pipe, num_workers=workers, **OPTIONS)
    skipped = loader.skip_steps(13)  # to step 13: from the keyframe of step 10, saved by the workers' lanes
    assert (skipped.first, skipped.count, skipped.keyframe) == (0, 13, 10)
    assert same_seq(take(loader, 4 * 3), expected[4 * 13 :])
    loader.close()
