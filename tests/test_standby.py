"""Workers started with the pipeline: waiting before ``iter()`` with its encoders built, then given lanes.

A pipeline whose options ask for worker processes has them started (and its tokenizers' encoders
built in them) while the caller goes on, so the first batch does not wait for a worker's start;
the batches are the same as inline, and a worker never taken exits on its own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from _util import texts, train_bytelevel
from zephon import Pipeline
from zephon.io import Dataset
from zephon.runtime import standby
from zephon.testing import outputs_equal

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")


def recipe(tokenizer, workers: int) -> Pipeline:
    data = Dataset.from_rows("web", [{"text": t} for t in texts(240)])
    return (
        Pipeline(data)
        .options(canonical_replicas=4, workers=workers)
        .tokenize(tokenizer=str(tokenizer), special_tokens="eos")
        .pack_flat(33)
        .batch(2)
    )


def first(pipe: Pipeline, n: int) -> list:
    loader = pipe.loader()
    try:
        return [b for b, _ in zip(loader, range(n))]
    finally:
        loader.close()


def children() -> set[int]:
    return {p.pid for p in mp.active_children()}


@pytest.fixture
def tokenizer(tmp_path):
    standby.discard()  # none left by other tests: what is waiting here was started here
    yield train_bytelevel(tmp_path / "tok")
    standby.discard()


def test_the_workers_of_a_pipeline_wait_before_iter_and_deliver_its_batches(tokenizer):
    expected = first(recipe(tokenizer, 0), 10)
    before = children()
    pipe = recipe(tokenizer, 2)
    standby.take(0)  # waits for the start under way, takes nothing
    waiting = children() - before
    assert len(waiting) == 2
    loader = pipe.loader()
    got = [b for b, _ in zip(loader, range(10))]
    assert children() - before == waiting  # the waiting workers run the lanes: none was started at iter()
    assert all(outputs_equal(a, b) for a, b in zip(got, expected)) and len(got) == 10
    loader.close()
    assert not children() - before
    assert all(outputs_equal(a, b) for a, b in zip(first(pipe, 10), expected))  # the next loader starts its own


def test_a_waiting_worker_never_taken_exits_on_its_own(tokenizer, monkeypatch):
    monkeypatch.setattr(standby, "IDLE_S", 0.5)
    before = children()
    pipe = recipe(tokenizer, 1)
    standby.take(0)
    waiting = children() - before
    assert len(waiting) == 1
    deadline = time.monotonic() + 30
    while children() & waiting and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() & waiting
    assert all(outputs_equal(a, b) for a, b in zip(first(pipe, 6), first(recipe(tokenizer, 0), 6)))


def test_a_forked_child_does_not_take_its_parents_waiting_workers(tokenizer):
    recipe(tokenizer, 2)
    standby.take(0)
    pid = os.fork()
    if pid == 0:  # the child: its pool is empty
        os._exit(0 if standby.take(8) == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    taken = standby.take(8)
    assert len(taken) == 2  # still the parent's
    for proc, conn in taken:
        conn.send(("stop",))
        proc.join(timeout=10)
        assert proc.exitcode == 0
