
import numpy as np
import pytest

from _util import global_steps, toy_pipeline
from zephon.cli.main import main
from zephon.ledger import Ledger, batch_digest, diff, global_digests, read_ledger, step_digest
from zephon.types import Meta, Record, SampleBatch, Segment


def _batch(values, pad=0):
    rec = Record({"input_ids": np.asarray(values, dtype=np.int32)}, Meta(0, (Segment(0, 0, 0, 0, 0, len(values)),), pad))
    return SampleBatch((rec,))


def test_batch_digest_sees_values_dtype_and_padding():
    base = batch_digest(_batch([1, 2, 3]))
    assert base == batch_digest(_batch([1, 2, 3]))
    assert base != batch_digest(_batch([1, 2, 4]))
    assert base != batch_digest(_batch([1, 2, 3], pad=1))
    rec = Record({"input_ids": np.asarray([1, 2, 3], dtype=np.int64)}, Meta(0, (), 0))
    assert base != batch_digest(SampleBatch((rec,)))


def test_batch_digest_sees_list_and_string_fields():
    def make(value):
        return SampleBatch((Record({"input_ids": value, "text": "a"}, Meta(0, (), 0)),))

    assert batch_digest(make([1, 2, 3])) != batch_digest(make([1, 2, 4]))
    assert batch_digest(make([1, 2, 3])) == batch_digest(make([1, 2, 3]))


def _write(tmp_path, name, steps, per_rank):
    folder = tmp_path / name
    lanes = len(steps[0])
    per = lanes // per_rank
    for r in range(per_rank):
        with Ledger(folder / f"rank-{r}.jsonl") as ledger:
            for k, step in enumerate(steps):
                ledger.record(k, step[r * per : (r + 1) * per])
    return folder


def test_ledgers_from_different_rank_counts_combine_to_the_same_digests(tmp_path):
    steps1, _ = global_steps(lambda: toy_pipeline(), 4, 1, 5)
    steps4, _ = global_steps(lambda: toy_pipeline(), 4, 4, 5)
    a = _write(tmp_path, "a", steps1, 1)
    b = _write(tmp_path, "b", steps4, 4)
    ga, gb = global_digests(read_ledger(a)), global_digests(read_ledger(b))
    assert ga == gb and len(ga) == 5
    assert ga[0] == step_digest([batch_digest(b) for b in steps1[0]])
    assert diff(a, b).match
    assert main(["ledger", "diff", str(a), str(b)]) == 0


def test_diff_names_the_first_diverging_step_and_lane(tmp_path, capsys):
    steps, _ = global_steps(lambda: toy_pipeline(), 4, 1, 6)
    other, _ = global_steps(lambda: toy_pipeline(seed=1), 4, 1, 6)
    mixed = steps[:3] + [steps[3][:2] + other[3][2:]] + steps[4:]
    a = _write(tmp_path, "a", steps, 2)
    b = _write(tmp_path, "b", mixed, 1)
    result = diff(a, b)
    assert (result.step, result.lane, result.compared) == (3, 2, 3)
    assert main(["ledger", "diff", str(a), str(b)]) == 1
    assert "diverge at step 3, lane 2" in capsys.readouterr().out


def test_bad_ledger_lines_are_reported(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"step": 0, "lanes": {"0": "ab"}}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_ledger(f)
    assert main(["ledger", "show", str(tmp_path / "missing")]) == 2
