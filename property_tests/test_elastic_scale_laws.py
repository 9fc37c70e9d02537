"""Elasticity at scale: 64 lanes over 1,000 shards of a two-dataset mixture under a schedule of
weights, stopped on one data-parallel size and resumed on another, give the global steps of the
uninterrupted single-rank run.

The data are fixed (built once): ``web``, 700 in-memory shards of one to three rows, and ``code``,
300 shards of one or two, every row ``{"toks": [t, ...]}`` with a running counter ``t``, so every
sample of the data is distinct. A generated case is the source's order (seed, shuffles, chunk
size, lane routing), a schedule by step of two or three points (held or ramped), the microbatch
size, the number of steps, where the run stops and the two sizes ``D1`` and ``D2`` out of
1, 2, ..., 64, each simulated as ``D`` loaders in this process (``dp_degree=D, dp_rank=r``).
The integration test runs the same recipe on 8 processes of a gloo group (``D`` and ``r`` from
``torch.distributed``), and resumes their checkpoint files on 1 and on 4 ranks.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from _budget import examples
from _util import free_port, toks_to_ids
from zephon import Pipeline, load_checkpoint, merge_checkpoints
from zephon.io import Dataset, InMemoryShard
from zephon.ledger import batch_digest, global_digests, read_ledger, step_digest
from zephon.testing import outputs_equal
from zephon.work import MixtureSchedule, StaticMixtureWorkSource

LANES = 64
SIZES = (1, 2, 4, 8, 16, 32, 64)
SHARDS = {"web": (700, 3), "code": (300, 2)}  # name: (shards, most rows a shard holds)


@functools.lru_cache(maxsize=1)
def datasets() -> tuple[Dataset, ...]:
    """The two datasets (1,000 shards), built once: their identity is then computed once too."""
    out, token = [], 1
    for name, (shards, most) in SHARDS.items():
        mapping = {}
        for s in range(shards):
            rows = []
            for _ in range(1 + (s * 7 + len(name)) % most):
                rows.append({"toks": [token, token + 1][: 1 + token % 2]})
                token += 2
            mapping[f"{name}-{s:04d}"] = InMemoryShard(rows)
        out.append(Dataset.from_dict(name, mapping))
    return tuple(out)


@attrs.frozen
class Case:
    """The source's order, its schedule (``(step, web weight, code weight)`` points) and the batch size."""

    seed: int
    shuffle_shards: bool
    shuffle_within_shard: bool
    chunk_size: int
    lane_assignment: str
    points: tuple[tuple[int, int, int], ...]
    interpolation: str
    microbatch_size: int

    def schedule(self) -> MixtureSchedule:
        points = [(at, {"web": web, "code": code}) for at, web, code in self.points]
        return MixtureSchedule(points, by="step", interpolation=self.interpolation)

    def build(self, dp: int | None = 1, rank: int | None = 0, **options) -> Pipeline:
        """The recipe as rank ``rank`` of ``dp`` (``None``: from torch.distributed); ``options``: run options."""
        source = StaticMixtureWorkSource(
            list(datasets()), self.schedule(), seed=self.seed, shuffle_shards=self.shuffle_shards,
            shuffle_within_shard=self.shuffle_within_shard, chunk_size=self.chunk_size,
            lane_assignment=self.lane_assignment, exhausted_policy="repeat",
        )
        topology = {} if dp is None else {"dp_degree": dp, "dp_rank": rank}
        pipe = Pipeline(source).options(canonical_replicas=LANES, **topology, **options)
        return pipe.map(toks_to_ids).batch(self.microbatch_size)


weight = st.integers(0, 4)


@st.composite
def cases(draw) -> Case:
    n = draw(st.integers(2, 3), label="schedule points")
    steps = sorted(draw(st.sets(st.integers(1, 5), min_size=n - 1, max_size=n - 1)))
    points = []
    for at in [0, *steps]:
        web, code = draw(weight), draw(weight)
        points.append((at, web, code if web or code else 1))
    return Case(
        seed=draw(st.integers(0, 2**32 - 1)),
        shuffle_shards=draw(st.booleans()),
        shuffle_within_shard=draw(st.booleans()),
        chunk_size=draw(st.integers(1, 3)),
        lane_assignment=draw(st.sampled_from(["permute", "modulo"])),
        points=tuple(points),
        interpolation=draw(st.sampled_from(["step", "linear"])),
        microbatch_size=draw(st.integers(1, 2)),
    )


def run(case: Case, dp: int, steps: int, checkpoint: dict | None = None) -> tuple[list[list], list]:
    """``steps`` global steps of ``dp`` ranks in this process (from ``checkpoint``), and the loaders.

    The ranks read without a read-ahead thread each (a performance setting, which never changes the
    batches: ``test_pipeline_laws``), so that 64 of them in one process do not take turns on threads.
    """
    loaders = [case.build(dp, r, read_ahead=0).loader(checkpoint) for r in range(dp)]
    groups = [loader.steps() for loader in loaders]
    return [[b for g in groups for b in next(g)] for _ in range(steps)], loaders


def digests(steps: list[list]) -> list[str]:
    return [step_digest([batch_digest(b) for b in step]) for step in steps]


@settings(max_examples=examples(8))
@given(case=cases(), steps=st.integers(2, 6), data=st.data())
def test_64_lanes_stopped_on_d1_ranks_and_resumed_on_d2_ranks_give_the_single_rank_run(case, steps, data):
    reference, _ = run(case, 1, steps)
    assert all([b.lane for b in step] == list(range(LANES)) for step in reference)
    stop = data.draw(st.integers(0, steps), label="steps before stopping")
    before, after = data.draw(st.sampled_from(SIZES), label="D1"), data.draw(st.sampled_from(SIZES), label="D2")
    note(f"stop after {stop} of {steps} steps on {before} ranks, resume on {after}")
    event(f"D1 -> D2: {'same' if before == after else 'grows' if after > before else 'shrinks'}")
    _, ranks = run(case, before, stop)
    merged = json.loads(json.dumps(merge_checkpoints([loader.checkpoint() for loader in ranks])))
    assert sorted(map(int, merged["lanes"])) == list(range(LANES))
    resumed, _ = run(case, after, steps - stop, merged)
    for k, (got, want) in enumerate(zip(resumed, reference[stop:])):
        assert outputs_equal(got, want), f"global step {stop + k} differs"
    # The schedule is in force: the run reads a dataset only where a point gives it weight.
    read = {seg.pointer[0] for step in reference for b in step for r in b.records for seg in r.meta.segments}
    weighted = {j for _, *w in case.points for j, x in enumerate(w) if x}
    assert read <= weighted


# -- 8 processes ---------------------------------------------------------------------------------------------

GLOO = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = [{here!r}, {tests!r}]
    import torch.distributed as dist
    from test_elastic_scale_laws import GLOO_CASE
    from zephon import save_checkpoint
    from zephon.ledger import Ledger

    def main(rank, world, folder, steps):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["ZEPHON_TEST_PORT"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        loader = GLOO_CASE.build(None).loader()  # D and r from torch.distributed
        with Ledger(os.path.join(folder, "ledger", f"rank-{{rank:03d}}.jsonl")) as ledger:
            for step, group in zip(range(steps), loader.steps()):
                ledger.record(step, group)
        save_checkpoint(os.path.join(folder, "ckpt"), loader)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        world, folder, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        GLOO_CASE.build(1, 0).fingerprint()  # imports and the data's identity once, before the ranks fork
        mp.start_processes(main, args=(world, folder, steps), nprocs=world, join=True, start_method="fork")
    """
)

GLOO_CASE = Case(seed=11, shuffle_shards=True, shuffle_within_shard=True, chunk_size=2, lane_assignment="permute",
                 points=((0, 3, 1), (2, 1, 3)), interpolation="step", microbatch_size=1)


@pytest.mark.integration
def test_8_gloo_processes_give_the_single_rank_digests_and_resume_on_1_and_4_ranks(tmp_path):
    pytest.importorskip("torch")
    first, rest = 3, 3
    script = tmp_path / "ranks.py"
    script.write_text(GLOO.format(here=str(Path(__file__).parent), tests=str(Path(__file__).parents[1] / "tests")))
    env = {**os.environ, "ZEPHON_TEST_PORT": str(free_port())}
    subprocess.run([sys.executable, str(script), "8", str(tmp_path), str(first)], check=True, env=env, timeout=300)

    reference, _ = run(GLOO_CASE, 1, first + rest)
    expected = dict(enumerate(digests(reference)))
    assert global_digests(read_ledger(tmp_path / "ledger")) == {k: expected[k] for k in range(first)}
    assert len(list((tmp_path / "ckpt").glob("zephon-lanes-*.msgpack"))) == 8
    for dp in (1, 4):
        ranks = [load_checkpoint(tmp_path / "ckpt", GLOO_CASE.build(dp, r)) for r in range(dp)]
        groups = [p.steps() for p in ranks]
        resumed = [[b for g in groups for b in next(g)] for _ in range(rest)]
        assert digests(resumed) == [expected[k] for k in range(first, first + rest)], f"resumed on {dp} ranks"
