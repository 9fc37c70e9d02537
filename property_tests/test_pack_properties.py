"""Laws of the packers, for random documents, row lengths, algorithms and options.

- Conservation: every input token is emitted exactly once (in input order for wrap), except
  those a documented policy drops, and ``report()`` counts exactly the missing ones.
- Shape: rows never exceed ``max_length`` nor the sequence cap; flat rows are exactly
  ``max_length`` with ``padding_length`` recording the rest.
- Chunking: any split of the input into chunks gives the same outputs.
- Restore: the state round-trips through JSON and resuming from it changes nothing.
"""

import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from _util import docs
from zephon.ops.pack import PackSequences
from zephon.ops import PackFlat
from zephon.testing import assert_checkpoint_equivalence, outputs_equal, run


@st.composite
def packers(draw):
    """A packer (flat or envelope) with valid, random options."""
    max_length = draw(st.integers(1, 12))
    algorithm = draw(st.sampled_from(["first_fit", "best_fit", "wrap", "best_fit_wrap"]))
    flat = draw(st.booleans())
    kw = {"algorithm": algorithm, "max_sequences_per_bin": draw(st.none() | st.integers(1, 4))}
    kw["oversized"] = draw(st.sampled_from(["split", "drop", "truncate"]))
    if algorithm in ("first_fit", "best_fit"):
        kw["num_bins"] = draw(st.integers(1, 4))
        kw["min_sequence_length"] = draw(st.integers(0, 3))
    if algorithm == "best_fit_wrap":
        kw["candidate_pool_size"] = draw(st.integers(1, 5))
        kw["max_candidate_age"] = draw(st.none() | st.integers(1, 8))
    if not flat:
        return PackSequences(max_length, **kw)
    needs_pad = algorithm != "wrap" or kw["max_sequences_per_bin"] is not None
    kw["pad_token_id"] = 0 if needs_pad or draw(st.booleans()) else None
    return PackFlat(max_length, **kw)


lengths = st.lists(st.integers(0, 30), max_size=24)


def chunked(records, cuts):
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(records)}) + [len(records)]
    return [records[a:b] for a, b in zip(bounds, bounds[1:])]


def emitted(op, rows):
    """The real tokens of each output, in output order."""
    if isinstance(op, PackSequences):
        return [np.concatenate([p["input_ids"] for p in r.payload["packed_samples"]]) for r in rows]
    return [r.payload["input_ids"][: op.max_length - r.meta.padding_length] for r in rows]


def expected_tokens(op, sizes):
    """The tokens the policy keeps, and how many it drops, before any end-of-data remainder."""
    kept, dropped = [], 0
    for i, n in enumerate(sizes):
        toks = list(range(1000 * i, 1000 * i + n))
        if n > op.max_length and op.oversized_policy == "drop":
            dropped += n
        elif n > op.max_length and op.oversized_policy == "truncate":
            kept += toks[: op.max_length]
            dropped += n - op.max_length
        else:
            kept += toks
    return kept, dropped


@given(op=packers(), sizes=lengths)
def test_every_token_is_emitted_once_or_counted(op, sizes):
    state, rows = run(op, [docs(sizes)])
    got = [t for part in emitted(op, rows) for t in part.tolist()]
    kept, dropped = expected_tokens(op, sizes)
    report = op.report(state)
    tail = report["dropped_tail_tokens"]
    assert tail == 0 or (op.algorithm == "wrap" and isinstance(op, PackFlat) and op.pad_token_id is None)
    if op.algorithm == "wrap":
        assert got == kept[: len(kept) - tail]  # in order; only the unpadded end-of-data remainder is missing
    else:
        assert sorted(got) == sorted(kept) and len(set(got)) == len(got)
    assert report["dropped_tokens"] == dropped + tail
    assert report["tokens"] == len(got) and report["pending_tokens"] == 0
    assert report["dropped_empty_records"] == sizes.count(0)
    assert report["rows"] == len(rows)


@given(op=packers(), sizes=lengths)
def test_rows_respect_max_length_and_the_cap(op, sizes):
    _, rows = run(op, [docs(sizes)])
    cap = op.max_sequences_per_bin
    for row in rows:
        n = row.meta.num_tokens
        assert 1 <= n <= op.max_length
        assert all(s.end > s.start for s in row.meta.segments)
        if cap is not None:
            assert len(row.meta.segments) <= cap
        if isinstance(op, PackFlat):
            assert row.meta.padding_length == op.max_length - n
            assert len(row.payload["input_ids"]) == op.max_length
            pos = row.payload["positions"]
            starts = np.flatnonzero(pos == 0).tolist()
            bounds = np.cumsum([0] + [s.end - s.start for s in row.meta.segments]).tolist()
            assert starts == bounds[:-1] + ([n] if row.meta.padding_length else [])
        else:
            assert row.meta.padding_length == 0
            assert [len(p["input_ids"]) for p in row.payload["packed_samples"]] == [s.end - s.start for s in row.meta.segments]


@given(op=packers(), sizes=lengths, cuts=st.lists(st.integers(1, 23), max_size=6))
def test_output_does_not_depend_on_chunking(op, sizes, cuts):
    records = docs(sizes)
    _, whole = run(op, [records])
    _, split = run(op, chunked(records, cuts))
    assert outputs_equal(whole, split)


@given(op=packers(), sizes=st.lists(st.integers(0, 30), max_size=12), cuts=st.lists(st.integers(1, 11), max_size=4))
def test_state_round_trips_and_restores_exactly(op, sizes, cuts):
    records = docs(sizes)
    # Encode -> JSON -> decode -> encode is the identity, and resuming changes nothing, at every boundary.
    assert_checkpoint_equivalence(op, chunked(records, cuts))


@given(op=packers(), sizes=st.lists(st.integers(0, 30), min_size=1, max_size=24))
def test_state_holds_no_token_arrays(op, sizes):
    state, _ = op.step(op.init(0), docs(sizes))
    wire = json.dumps(op.encode_state(state))
    assert "input_ids" not in wire
    # Pieces are (meta, start, end[, arrival]): a handful of ints each, whatever the document length.
    held = len(state.stream) + len(state.pool) + sum(len(b) for b in state.bins)
    assert len(wire) <= 600 + 60 * held
