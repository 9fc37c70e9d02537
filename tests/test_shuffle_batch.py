import numpy as np
import pytest

from _util import docs
from zephon.ops import Batch, Shuffle
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, run


def rows_of(outputs):
    return [r.meta.segments[0].row for r in outputs]


def test_shuffle_is_a_permutation_that_actually_shuffles():
    records = docs([1] * 200)
    _, out = run(Shuffle(32, seed=0), [records])
    assert sorted(rows_of(out)) == list(range(200))
    assert rows_of(out) != list(range(200))


def test_shuffle_depends_on_seed_and_key():
    records = docs([1] * 50)
    a = rows_of(run(Shuffle(16, seed=0), [records])[1])
    b = rows_of(run(Shuffle(16, seed=1), [records])[1])
    c = rows_of(run(Shuffle(16, seed=0), [records], key=7)[1])
    assert a != b and a != c
    assert a == rows_of(run(Shuffle(16, seed=0), [records])[1])


def test_shuffle_warmup_emits_early():
    op = Shuffle(1024)
    assert op.warmup == 64
    _, out = op.step(op.init(0), docs([1] * 65))
    assert len(out) == 1  # the 65th arrival exceeds the warm-up window


def test_shuffle_buffer_of_one_is_pass_through():
    records = docs([1] * 10)
    assert rows_of(run(Shuffle(1), [records])[1]) == list(range(10))


def test_shuffle_window_never_exceeds_buffer_size():
    op = Shuffle(8)
    state = op.init(0)
    for rec in docs([1] * 100):
        state, _ = op.step(state, [rec])
        assert len(state.buffer) <= 8


def test_shuffle_golden_seed_42():
    # Known-answer test: pins the exact order (changing it is a breaking change).
    _, out = run(Shuffle(8, seed=42), [docs([1] * 20)])
    assert rows_of(out) == GOLDEN_SHUFFLE


GOLDEN_SHUFFLE = [0, 2, 4, 3, 1, 6, 8, 10, 14, 9, 7, 12, 16, 13, 19, 17, 15, 5, 18, 11]


@pytest.mark.parametrize("cuts", [[1], [5, 6], [3, 9, 17]])
def test_shuffle_chunking_invariance(cuts):
    assert_chunking_invariance(Shuffle(8, seed=3), docs([1] * 20), cuts)


def test_shuffle_checkpoint_equivalence():
    records = docs([2] * 30)
    assert_checkpoint_equivalence(Shuffle(8, seed=5), [records[:3], records[3:4], records[4:20], records[20:]])


def test_shuffle_flushes_a_piece_at_a_time_and_each_piece_is_a_checkpoint_boundary():
    from zephon.ops.shuffle import FLUSH_PIECE

    op = Shuffle(64, seed=5)
    records = docs([1] * 100)
    state, _ = op.step(op.init(0), records)
    held = len(state.buffer)
    assert held > 3 * FLUSH_PIECE
    pieces = []
    while True:
        state, piece = op.flush(state)
        if not piece:
            break
        assert len(piece) <= FLUSH_PIECE and len(state.buffer) == held - sum(map(len, pieces)) - len(piece)
        pieces.append(piece)
    assert len(pieces) == -(-held // FLUSH_PIECE) and state.buffer == ()
    _, whole = run(op, [records])
    assert rows_of(whole[-held:]) == rows_of([r for p in pieces for r in p])
    assert sorted(rows_of(whole)) == list(range(100))
    # resuming from the state after any piece (through JSON) gives the rest: checked at every boundary
    assert_checkpoint_equivalence(op, [records[:50], records[50:]])


def test_a_chain_flushes_each_operator_fully_before_the_next():
    """Pieces of a shuffle's flush reach the batch before its own flush: only the last batch is short."""
    from zephon.core.operator import Chain

    records = docs([1] * 70)
    chain = Chain((("shuffle", Shuffle(64, seed=1)), ("batch", Batch(3, drop_last=False))))
    _, batches = run(chain, [records[:30], records[30:]])
    _, shuffled = run(Shuffle(64, seed=1), [records], key=_child_key(0, "shuffle"))
    assert [rows_of(b.records) for b in batches] == [rows_of(shuffled[i : i + 3]) for i in range(0, 70, 3)]
    assert [len(b.records) for b in batches][-2:] == [3, 1]


def _child_key(key, name):
    from zephon.core.keys import fold_in

    return fold_in(key, name)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_shuffle_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="buffer_size"):
        Shuffle(bad)


def test_batch_groups_and_drops_last_counted():
    op = Batch(3)
    state, out = run(op, [docs([1] * 8)])
    assert [rows_of(b.records) for b in out] == [[0, 1, 2], [3, 4, 5]]
    assert op.report(state) == {
        "batches": 2, "rows": 6, "dropped_records_at_end": 2, "dropped_tokens_at_end": 2, "real_tokens": 6, "padded_slots": 6
    }


def test_batch_keep_last():
    _, out = run(Batch(3, drop_last=False), [docs([1] * 8)])
    assert [len(b) for b in out] == [3, 3, 2]


def test_batch_checkpoint_equivalence():
    records = docs([1] * 11)
    assert_checkpoint_equivalence(Batch(4, drop_last=False), [records[:3], records[3:9], records[9:]])


def test_batch_rejects_bad_size():
    with pytest.raises(ValueError, match="microbatch_size"):
        Batch(0)


def test_group_by_length_cuts_padding_and_keeps_every_record():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=256).tolist()
    plain_op, grouped_op = Batch(4), Batch(4, group_by_length=True, buffer_size=64)
    plain_state, plain = run(plain_op, [docs(lengths)])
    grouped_state, grouped = run(grouped_op, [docs(lengths)])
    assert sorted(r.meta.segments[0].row for b in grouped for r in b.records) == list(range(256))
    waste = lambda bs: 1 - sum(sum(len(r.payload["input_ids"]) for r in b.records) for b in bs) / sum(4 * max(len(r.payload["input_ids"]) for r in b.records) for b in bs)
    assert waste(grouped) < waste(plain) / 3
    for op, state, batches in ((plain_op, plain_state, plain), (grouped_op, grouped_state, grouped)):
        report = op.report(state)
        assert abs((1 - report["real_tokens"] / report["padded_slots"]) - waste(batches)) < 1e-12
    assert abs(grouped[0].padding_waste - (1 - sum(len(r.payload["input_ids"]) for r in grouped[0].records) / (4 * max(len(r.payload["input_ids"]) for r in grouped[0].records)))) < 1e-12
    # groups are not emitted shortest-first
    firsts = [max(len(r.payload["input_ids"]) for r in b.records) for b in grouped[:16]]
    assert firsts != sorted(firsts)


def test_group_by_length_restores_and_is_chunking_invariant():
    records = docs([5, 1, 9, 3, 3, 7, 2, 8, 6, 4, 1, 1, 9])
    op = Batch(2, group_by_length=True, buffer_size=4, drop_last=False)
    assert_checkpoint_equivalence(op, [records[:3], records[3:9], records[9:]])
    assert_chunking_invariance(op, records, [2, 7])


def test_group_by_length_validation():
    with pytest.raises(ValueError, match="multiple of microbatch_size"):
        Batch(3, group_by_length=True, buffer_size=10)
    with pytest.raises(ValueError, match="only applies"):
        Batch(3, buffer_size=9)
