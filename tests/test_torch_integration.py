"""PyTorch: DataLoader and StatefulDataLoader over pipeline.to_torch_dataset(), DCP next to a model."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from _util import toy_dataset, toy_pipeline  # noqa: E402
from zephon.integrations.torch import checkpoint_from_state  # noqa: E402

OPTIONS = dict(return_labels=True, return_num_valid_tokens=True)


def same(a, b):
    """Two training-tensor dicts are identical: keys, and every value (tensors by dtype and content)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif plain(x) != plain(y):  # DataLoader's default_convert turns tuples into lists
            return False
    return True


def plain(x):
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def same_seq(xs, ys):
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def reference(pipe, n=None):
    """The pipeline's own batches converted with the same options (all of them, or the first n)."""
    it = iter(pipe)
    out = [b.to_training(**OPTIONS) for _, b in zip(range(n), it)] if n else [b.to_training(**OPTIONS) for b in it]
    it.close()
    return out


def take(loader, n):
    return [x for _, x in zip(range(n), loader)]


def test_num_workers_0_yields_exactly_the_pipeline_batches_to_the_end():
    pipe = toy_pipeline(4, policy=None)  # finite: the end must match too
    with pytest.warns(RuntimeWarning, match="not delivered"):
        expected = reference(pipe)
    assert len(expected) > 8
    with pytest.warns(RuntimeWarning, match="not delivered"):
        got = list(DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=0))
    assert same_seq(got, expected)
    assert [t["num_valid_tokens"] for t in got] == [t["num_valid_tokens"] for t in expected]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_dataloader_workers_share_lanes_and_keep_the_order(workers):
    pipe = toy_pipeline(4)
    expected = reference(pipe, 24)
    got = take(DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=workers), 24)
    # Neither duplicated nor dropped: the exact sequence, lane after lane.
    assert same_seq(got, expected)


def test_a_rank_of_two_with_two_workers_delivers_its_share_of_every_global_step():
    full = reference(toy_pipeline(8), 32)  # global step k = items 8k..8k+7, lanes 0..7
    rank1 = toy_pipeline(8, dp_degree=2, dp_rank=1)
    got = take(DataLoader(rank1.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2), 16)
    expected = [full[8 * k + lane] for k in range(4) for lane in range(4, 8)]
    assert same_seq(got, expected)


@pytest.mark.parametrize("lanes, workers, seed", [(2, 1, 0), (4, 2, 3), (8, 4, 4)])
def test_workers_reach_the_end_of_finite_data_exactly_where_the_pipeline_stops(lanes, workers, seed):
    # The first missing item is inside a step (lane 3 of 4, lane 5 of 8): the workers holding the
    # later lanes have produced their items of that step and must not hand them over.
    pipe = toy_pipeline(lanes, policy=None, data=toy_dataset(97, seed=seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the undelivered tail, tested elsewhere
        expected = reference(pipe)
    # (a worker process warns about its own lanes' undelivered tail on its stderr)
    got = list(DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=workers))
    assert len(expected) % lanes != 0 or workers == 1
    assert same_seq(got, expected)


def test_workers_beyond_a_divisor_of_the_lanes_stay_idle():
    # 3 workers for 4 lanes: 2 run them (1 idle, as in Zephon 0.2.0), and the order holds to the end.
    pipe = toy_pipeline(4, policy=None, data=toy_dataset(97, seed=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = reference(pipe)
    got = list(DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=3))
    assert same_seq(got, expected)


def test_a_plain_dataset_has_stateless_iterators():
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(iter(toy_pipeline(2).to_torch_dataset(**OPTIONS)), Stateful)
    plain = toy_pipeline(2).to_torch_dataset(stateful=False, **OPTIONS)
    assert not isinstance(iter(plain), Stateful)
    assert same_seq(take(DataLoader(plain, batch_size=None), 4), reference(toy_pipeline(2), 4))


def test_dataset_needs_a_batched_pipeline_and_valid_options():
    from zephon import Pipeline

    with pytest.raises(ValueError, match="must end in batch"):
        Pipeline([{"input_ids": np.arange(4)}]).to_torch_dataset()
    with pytest.raises(TypeError, match="did you mean 'return_labels'"):
        toy_pipeline(2).to_torch_dataset(return_label=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(workers):
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    pipe = toy_pipeline(4)
    expected = reference(pipe, 30)
    first = StatefulDataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=workers)
    it = iter(first)
    head = [next(it) for _ in range(11)]  # 11: mid-step, and not a multiple of the workers
    state = first.state_dict()
    del it, first

    resumed = StatefulDataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=workers)
    resumed.load_state_dict(state)
    tail = take(resumed, 19)
    assert same_seq(head + tail, expected)

    # The state carries zephon's checkpoint: a plain loader continues from it too.
    ck = checkpoint_from_state(state)
    assert sorted(ck["lanes"]) == ["0", "1", "2", "3"]
    loader = toy_pipeline(4).loader(ck)
    assert same_seq([b.to_training(**OPTIONS) for _, b in zip(range(19), loader)], expected[11:])
    loader.close()


def test_stateful_dataloader_state_is_refused_by_another_pipeline():
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    dl = StatefulDataLoader(toy_pipeline(4).to_torch_dataset(**OPTIONS), batch_size=None)
    take(dl, 3)
    state = dl.state_dict()
    other = StatefulDataLoader(toy_pipeline(4, max_length=17).to_torch_dataset(**OPTIONS), batch_size=None)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="different data settings"):
        next(iter(other))


def test_dcp_saves_data_state_next_to_model_and_optimizer(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    pipe = toy_pipeline(4)
    expected = reference(pipe, 12)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(loader, model, opt, n):
        losses = []
        for _, batch in zip(range(n), loader):
            t = batch.to_training(**OPTIONS)
            loss = torch.nn.functional.cross_entropy(model(t["input_ids"]).flatten(0, 1), t["labels"].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt = build()
    loader = pipe.loader()
    train(loader, model, opt, 5)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "data": loader}, checkpoint_id=str(tmp_path / "step-5"))
    after = train(loader, model, opt, 4)  # the uninterrupted run
    loader.close()

    model2, opt2 = build()
    model_sd, optim_sd = get_state_dict(model2, opt2)
    state = {"model": model_sd, "optim": optim_sd, "data": toy_pipeline(4).loader()}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-5"))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_loader = state["data"]
    assert train(resumed_loader, model2, opt2, 4) == after  # same data, model and optimizer: same losses, bit for bit
    rest = [b.to_training(**OPTIONS) for _, b in zip(range(3), resumed_loader)]
    assert same_seq(rest, expected[9:12])
    resumed_loader.close()


def test_megatron_layout_keys_shapes_and_dtypes():
    pipe = toy_pipeline(2)  # pack_flat(16) rows with positions, batch(2)
    batch = next(iter(pipe))
    t = batch.to_training(layout="megatron")
    assert list(t) == ["tokens", "labels", "position_ids", "loss_mask", "cu_seqlens", "max_seqlen"]
    B, S = 2, 15
    for name, dtype in [("tokens", torch.int64), ("labels", torch.int64), ("position_ids", torch.int64), ("loss_mask", torch.float32)]:
        assert t[name].shape == (B, S) and t[name].dtype == dtype, name
    assert t["position_ids"].tolist() == [list(range(S))] * B  # Megatron's default positions
    assert t["cu_seqlens"].dtype == torch.int32 and t["cu_seqlens"].shape[0] == B
    assert t["max_seqlen"].dtype == torch.int32 and t["max_seqlen"].shape == (B,)
    assert torch.equal(t["loss_mask"], (t["labels"] != -100).float())
    plain = batch.to_training(return_labels=True, return_cu_seqlens=True)
    assert torch.equal(t["tokens"], plain["input_ids"]) and torch.equal(t["labels"], plain["labels"])
    assert torch.equal(t["cu_seqlens"], plain["cu_seqlens"])
    # Options next to the layout override it; unknown layouts fail with the choices.
    t2 = batch.to_training(layout="megatron", position_mode="preserve", return_cu_seqlens=False)
    assert torch.equal(t2["position_ids"], plain["positions"]) and "cu_seqlens" not in t2
    with pytest.raises(ValueError, match=r"unknown layout 'nemo'; the layouts are \['hf', 'megatron'\]"):
        batch.to_training(layout="nemo")
    # The dataset takes the layout too.
    first = next(iter(DataLoader(pipe.to_torch_dataset(layout="megatron"), batch_size=None)))
    assert same(first, t)


@pytest.mark.parametrize("workers", [0, 2])
def test_zephon_dataloader_leaves_torch_random_state_alone(workers):
    # A trainer restores its random state and then iterates (the HF Trainer on resume): iter() must not draw.
    from zephon.integrations.torch import DataLoader as ZephonDataLoader

    loader = ZephonDataLoader(toy_pipeline(2), num_workers=workers, return_labels=True)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    first = next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
    # A generator of the caller's is still the one the workers' seeds come from.
    loader.close()
    mine = torch.Generator().manual_seed(5)
    drawn = mine.get_state()
    again = ZephonDataLoader(toy_pipeline(2), num_workers=workers, return_labels=True, generator=mine)
    assert torch.equal(next(iter(again))["input_ids"], first["input_ids"]) and not torch.equal(mine.get_state(), drawn)
    again.close()


def test_finite_data_with_workers_resumes_and_ends_exactly_across_epochs():
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    pipe = toy_pipeline(4, policy=None, data=toy_dataset(97, seed=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = reference(pipe)
    # Two epochs of one DataLoader with persistent workers: each starts over and ends exactly.
    dl = DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2, persistent_workers=True)
    assert same_seq(list(dl), expected) and same_seq(list(dl), expected)
    # A resume 5 items before the end, through StatefulDataLoader, ends where the pipeline ends.
    first = StatefulDataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2)
    it = iter(first)
    head = [next(it) for _ in range(len(expected) - 5)]
    state = first.state_dict()
    del it, first
    resumed = StatefulDataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    assert same_seq(head + list(resumed), expected)


def test_spawned_workers_receive_the_rank_and_the_end_of_data_block():
    # Under "spawn" the dataset is pickled into each worker: D, the rank and the shared block travel with it.
    pipe = toy_pipeline(8, policy=None, data=toy_dataset(97, seed=4), dp_degree=2, dp_rank=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = reference(pipe)
    dl = DataLoader(pipe.to_torch_dataset(**OPTIONS), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert same_seq(list(dl), expected)
