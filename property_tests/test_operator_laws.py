"""Laws of single operators on generated streams.

The operators: ``pack_flat`` and ``pack_sequences`` with every packing algorithm, ``shuffle``,
``order_by``, ``batch`` (plain and grouped by length), and named chains of them. Inputs are sample-level records
made by ``_util.docs``: document ``row`` holds the tokens ``1000 * row + [0, n)``, so every token
of a stream is distinct (lengths stay below 1000) and where a token went is visible. Chunkings are
random, empty chunks included.

Laws for every operator:
    * chunk-boundary invariance: any split of the input gives the same outputs;
    * checkpoint equivalence: saving, encoding and restoring the state at any step boundary
      (including after the flush) resumes with exactly the remaining outputs;
    * state round trip: every state reached encodes to msgpack bytes that decode to an equal
      state, which encodes to the same bytes;
    * determinism: the same input gives the same outputs.

Laws of one operator:
    * pack_flat (wrap) conserves tokens: every token appears once, in order, except the
      end-of-data remainder, which is padded or counted;
    * pack_flat (every algorithm) emits each token at most once, in rows whose metas name their
      token ranges, and counts every token it does not emit;
    * shuffle emits a permutation of its input and never holds more than its buffer;
    * order_by emits each window of its input (consecutive runs of ``window`` arrivals, cut short
      at a schedule switch and at the end) sorted by key, ties by record identity, and never holds
      a full window;
    * batch keeps order and only the very last batch may be short; grouped by length, each batch
      is a run of its window sorted by length (token budgets: ``test_max_tokens_laws``).
"""

from __future__ import annotations

import bisect
import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

from _util import docs
from zephon.ops.pack import ALGORITHMS as PACK_ALGORITHMS
from zephon.ops import Batch, Chain, OrderBy, PackFlat, PackSequences, Shuffle, token_count
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, input_resolver, outputs_equal, run


# -- strategies -------------------------------------------------------------------------------------

keys = st.integers(0, 2**64 - 1)
seeds = st.integers(-(2**31), 2**40)
lanes = st.integers(0, 7)
# Mostly short streams; sometimes long ones of short documents, so that one chunk completes many
# documents (packers compact their pending work after dozens of them).
lengths = st.one_of(st.lists(st.integers(0, 24), max_size=40), st.lists(st.integers(0, 6), min_size=65, max_size=150))


@st.composite
def streams(draw, lengths=lengths):
    """Sample-level records of one lane, with distinct tokens and distinct metas."""
    return docs(draw(lengths), lane=draw(lanes))


@st.composite
def chunkings(draw, records):
    """``records`` split at random cut points (repeated cuts give empty chunks)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(records)), max_size=8)))
    bounds = [0, *cuts, len(records)]
    return [records[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def pack_settings(draw, algorithm: str, *, flat: bool = True):
    """Keyword arguments of a valid packer for ``algorithm``, exploring every knob it has:
    ``PackFlat`` when ``flat``, else ``PackSequences`` (never padded)."""
    kwargs = {"max_length": draw(st.integers(1, 16)), "algorithm": algorithm}
    pads = st.one_of(st.just(0), st.integers(1, 50_000))
    if flat:
        kwargs["emit_positions"] = draw(st.booleans())
        # Only uncapped wrap can do without a pad id: every other row may come out short.
        kwargs["pad_token_id"] = draw(st.none() | pads) if algorithm == "wrap" else draw(pads)
    padded = kwargs.get("pad_token_id") is not None
    if algorithm != "wrap" or padded or not flat:
        kwargs["max_sequences_per_bin"] = draw(st.none() | st.integers(1, 4))
    if algorithm in ("first_fit", "best_fit"):
        kwargs["num_bins"] = draw(st.integers(1, 4))
        kwargs["min_sequence_length"] = draw(st.integers(0, 3))
    elif algorithm == "best_fit_wrap":
        kwargs["candidate_pool_size"] = draw(st.integers(1, 8))
        kwargs["max_candidate_age"] = draw(st.none() | st.integers(1, 24))
    if algorithm != "wrap":
        kwargs["oversized"] = draw(st.sampled_from(["split", "drop", "truncate"]))
    return kwargs


def pack_flats(algorithm: str):
    return pack_settings(algorithm).map(lambda kwargs: PackFlat(**kwargs))


def pack_sequences(algorithm: str):
    return pack_settings(algorithm, flat=False).map(lambda kwargs: PackSequences(**kwargs))


#: Lane sample positions of a schedule's switches (see ``Shuffle.drains``): none in most draws.
drain_points = st.one_of(st.just(()), st.lists(st.integers(1, 120), max_size=4, unique=True).map(lambda ds: tuple(sorted(ds))))
shuffles = st.builds(Shuffle, buffer_size=st.one_of(st.integers(1, 8), st.integers(9, 64)), seed=seeds, drains=drain_points)


def length_mod_3(payload):
    """A key with many ties."""
    return len(payload["input_ids"]) % 3


def odd_then_longest(payload):
    """A tuple key: odd lengths first, then longest first."""
    n = len(payload["input_ids"])
    return (1 - n % 2, -n)


order_keys = st.sampled_from([token_count, length_mod_3, odd_then_longest])
order_bys = st.builds(
    OrderBy, key=order_keys, window=st.one_of(st.integers(1, 8), st.integers(9, 40)), reverse=st.booleans(), drains=drain_points
)


@st.composite
def batches(draw):
    """A ``Batch``, grouping by length or not (a grouping window is a multiple of the batch size)."""
    mbs, drop_last = draw(st.integers(1, 6), label="microbatch_size"), draw(st.booleans(), label="drop_last")
    if not draw(st.booleans(), label="group_by_length"):
        return Batch(mbs, drop_last=drop_last)
    return Batch(mbs, drop_last=drop_last, group_by_length=True, buffer_size=draw(st.none() | st.integers(1, 5).map(lambda k: k * mbs)))


@st.composite
def budget_batches(draw):
    """A ``Batch`` by token budget: arrival order or a sort window; a budget narrower than the
    longest drawn document (24 tokens, rounded up) drops such documents instead of failing."""
    multiple = draw(st.none() | st.integers(1, 8), label="pad_to_multiple_of")
    max_tokens = draw(st.integers(multiple or 1, 100), label="max_tokens")
    wide = max_tokens < -(-24 // (multiple or 1)) * (multiple or 1)
    return Batch(
        max_tokens=max_tokens, pad_to_multiple_of=multiple, sort_window=draw(st.integers(0, 9), label="sort_window"),
        drop_last=draw(st.booleans(), label="drop_last"),
        oversized="drop" if wide else draw(st.sampled_from(["error", "drop"])),
    )


@st.composite
def chains(draw):
    """A named chain: pack_flat and an optional shuffle in either order, then an optional batch."""
    body = [("pack", draw(pack_flats(draw(st.sampled_from(PACK_ALGORITHMS)))))]
    if draw(st.booleans()):
        shuffle = ("shuffle", draw(shuffles))
        body = [shuffle, *body] if draw(st.booleans()) else [*body, shuffle]
    if draw(st.booleans()):
        body.append(("batch", draw(batches())))
    return Chain(tuple(body))


OPERATORS = {
    **{f"pack_flat[{a}]": pack_flats(a) for a in PACK_ALGORITHMS},
    **{f"pack_sequences[{a}]": pack_sequences(a) for a in PACK_ALGORITHMS},
    "shuffle": shuffles,
    "order_by": order_bys,
    "batch": batches(),
    "batch[max_tokens]": budget_batches(),
    "chain": chains(),
}
each_operator = pytest.mark.parametrize("kind", list(OPERATORS))


def states_reached(op, chunks, key):
    """Every state ``op`` passes through on ``chunks``: initial, after each chunk, after each piece
    of the flush (flushed until it returns nothing)."""
    state = op.init(key)
    states = [state]
    for chunk in chunks:
        state, _ = op.step(state, chunk)
        states.append(state)
    while True:
        state, out = op.flush(state)
        states.append(state)
        if not out:
            return states


def real_tokens(row):
    ids = row.payload["input_ids"]
    return ids[: len(ids) - row.meta.padding_length]


def concat(arrays):
    arrays = list(arrays)
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)


# -- laws for every operator --------------------------------------------------------------------------


@each_operator
@given(data=st.data(), records=streams(), key=keys)
def test_chunk_boundaries_never_change_the_outputs(kind, data, records, key):
    op = data.draw(OPERATORS[kind], label="operator")
    cuts = data.draw(st.lists(st.integers(0, len(records)), max_size=8), label="cuts")
    assert_chunking_invariance(op, records, cuts, key=key)


@each_operator
@given(data=st.data(), records=streams(), key=keys)
def test_restoring_at_any_step_boundary_resumes_with_the_same_outputs(kind, data, records, key):
    op = data.draw(OPERATORS[kind], label="operator")
    chunks = data.draw(chunkings(records), label="chunks")
    assert_checkpoint_equivalence(op, chunks, key=key)


@each_operator
@given(data=st.data(), records=streams(), key=keys)
def test_every_state_round_trips_through_msgpack_bytes(kind, data, records, key):
    op = data.draw(OPERATORS[kind], label="operator")
    chunks = data.draw(chunkings(records), label="chunks")
    resolve = input_resolver(chunks)
    for i, state in enumerate(states_reached(op, chunks, key)):
        wire = msgspec.msgpack.encode(op.encode_state(state))
        decoded = op.decode_state(msgspec.msgpack.decode(wire), resolve)
        assert msgspec.msgpack.encode(op.encode_state(decoded)) == wire, f"state {i} re-encodes differently"
        assert decoded == state, f"state {i} decodes to a different state"


@each_operator
@given(data=st.data(), records=streams(), key=keys)
def test_same_operator_same_input_same_outputs(kind, data, records, key):
    op = data.draw(OPERATORS[kind], label="operator")
    chunks = data.draw(chunkings(records), label="chunks")
    _, first = run(op, chunks, key=key)
    _, second = run(op, [list(c) for c in chunks], key=key)
    assert outputs_equal(first, second)


# -- pack_flat ------------------------------------------------------------------------------------------


def check_rows(op, records, rows):
    """Every row is ``max_length`` long, holds exactly the token ranges its meta names, padded at
    the end with ``pad_token_id``, with positions restarting at every piece and at the padding."""
    by_row = {r.meta.segments[0].row: r.payload["input_ids"] for r in records}
    for r in rows:
        ids, padding = r.payload["input_ids"], r.meta.padding_length
        assert len(ids) == op.max_length and 0 <= padding < op.max_length
        assert r.meta.lane == records[0].meta.lane
        pieces = [by_row[s.row][s.start : s.end] for s in r.meta.segments]
        assert all(len(p) == s.end - s.start > 0 for p, s in zip(pieces, r.meta.segments))
        assert np.array_equal(concat(pieces), real_tokens(r))
        assert (ids[len(ids) - padding :] == op.pad_token_id).all()
        if op.max_sequences_per_bin is not None:
            assert len(r.meta.segments) <= op.max_sequences_per_bin
        if op.emit_positions:
            restarts = [np.arange(len(p)) for p in pieces] + [np.arange(padding)]
            assert np.array_equal(r.payload["positions"], concat(restarts))


@given(data=st.data(), records=streams(), max_length=st.integers(1, 16), pad=st.one_of(st.none(), st.just(0), st.integers(1, 99)))
def test_pack_flat_wrap_keeps_every_token_once_in_order(data, records, max_length, pad):
    op = PackFlat(max_length, algorithm="wrap", pad_token_id=pad)
    chunks = data.draw(chunkings(records), label="chunks")
    state, rows = run(op, chunks)
    stream = concat(r.payload["input_ids"] for r in records)
    remainder = len(stream) % max_length
    note(f"{len(stream)} tokens, {len(rows)} rows, remainder {remainder}")
    check_rows(op, records, rows)

    # Only the last row can be padded, and only with a pad id; without one the remainder is counted.
    assert all(r.meta.padding_length == 0 for r in rows[:-1])
    kept = concat(real_tokens(r) for r in rows)
    report = op.report(state)
    if pad is None:
        assert np.array_equal(kept, stream[: len(stream) - remainder])
        assert report["dropped_tokens"] == remainder
    else:
        assert np.array_equal(kept, stream)
        assert report["dropped_tokens"] == 0
        assert (rows[-1].meta.padding_length if rows else 0) == (max_length - remainder) % max_length
    assert report["rows"] == len(rows)
    assert report["dropped_empty_records"] == sum(len(r.payload["input_ids"]) == 0 for r in records)


@pytest.mark.parametrize("algorithm", PACK_ALGORITHMS)
@given(data=st.data(), records=streams())
def test_pack_flat_emits_each_token_at_most_once_and_counts_the_rest(algorithm, data, records):
    op = data.draw(pack_flats(algorithm), label="operator")
    chunks = data.draw(chunkings(records), label="chunks")
    state, rows = run(op, chunks)
    check_rows(op, records, rows)

    kept: dict[int, list[tuple[int, int]]] = {r.meta.segments[0].row: [] for r in records}
    for r in rows:
        for s in r.meta.segments:
            kept[s.row].append((s.start, s.end))
    tail_dropped = op.algorithm == "wrap" and op.pad_token_id is None and op.max_sequences_per_bin is None
    for rec in records:
        n, ranges = len(rec.payload["input_ids"]), sorted(kept[rec.meta.segments[0].row])
        covered = [t for a, b in ranges for t in range(a, b)]
        assert len(covered) == len(set(covered)), f"document {rec.meta.segments[0].row} has a token in two rows"
        if tail_dropped:
            continue  # the end-of-data remainder is dropped: see the wrap law above
        keep = {"split": n, "truncate": min(n, op.max_length), "drop": n if n <= op.max_length else 0}[op.oversized_policy]
        assert covered == list(range(keep)), f"document {rec.meta.segments[0].row} ({n} tokens, oversized={op.oversized_policy!r})"

    report = op.report(state)
    total = sum(len(r.payload["input_ids"]) for r in records)
    assert report["pending_tokens"] == 0
    assert report["tokens"] == sum(len(real_tokens(r)) for r in rows)
    assert report["tokens"] + report["dropped_tokens"] == total
    assert report["padding_tokens"] == sum(r.meta.padding_length for r in rows)
    assert report["rows"] == len(rows)
    assert report["dropped_empty_records"] == sum(len(r.payload["input_ids"]) == 0 for r in records)


# -- shuffle ----------------------------------------------------------------------------------------------


def cut(records, cuts):
    """``records`` split at ``cuts`` (taken modulo ``len(records) + 1``; repeated cuts give empty chunks)."""
    bounds = [0, *sorted(c % (len(records) + 1) for c in cuts), len(records)]
    return [records[a:b] for a, b in zip(bounds, bounds[1:])]


# A buffer larger than one flush piece (``FLUSH_PIECE`` = 8) left full at the end: the flush hands
# out 9 records over two calls.
@example(op=Shuffle(9, seed=0), records=docs([1] * 17), cuts=[], key=0)
@given(op=shuffles, records=streams(st.lists(st.integers(0, 3), max_size=120)), cuts=st.lists(st.integers(0, 120), max_size=8), key=keys)
def test_shuffle_emits_a_permutation_and_respects_its_buffer(op, records, cuts, key):
    chunks = cut(records, cuts)
    state, out, seen = op.init(key), [], 0
    for chunk in chunks:
        state, emitted = op.step(state, chunk)
        out.extend(emitted)
        seen += len(chunk)
        assert len(state.buffer) <= op.buffer_size
        assert state.emitted == len(out) and len(out) + len(state.buffer) == seen
    state, emitted = run(op, [], state=state)  # flush until it returns nothing (it hands out pieces)
    out.extend(emitted)
    assert sorted(r.meta.segments[0].row for r in out) == list(range(len(records)))
    by_row = {r.meta.segments[0].row: r for r in records}
    assert all(r is by_row[r.meta.segments[0].row] for r in out), "shuffle must pass records through unchanged"
    assert op.report(state) == {"buffered": 0, "emitted": len(records)}
    # Records never cross a drain: every record from before a switch leaves before any from after it.
    phases = [bisect.bisect_right(op.drains, r.meta.segments[0].row) for r in out]
    assert phases == sorted(phases), "a shuffle moved records across a schedule switch"


# -- order_by ---------------------------------------------------------------------------------------------


@given(op=order_bys, docs_in_row_order=streams(), data=st.data(), cuts=st.lists(st.integers(0, 200), max_size=8), key=keys)
def test_order_by_sorts_each_window_and_emits_every_record_once(op, docs_in_row_order, data, cuts, key):
    records = data.draw(st.permutations(docs_in_row_order), label="arrival order")  # ties never go by arrival
    state, out, seen = op.init(key), [], 0
    for chunk in cut(records, cuts):
        state, emitted = op.step(state, chunk)
        out.extend(emitted)
        seen += len(chunk)
        assert len(state.buffer) < op.window and len(out) + len(state.buffer) == seen
    state, emitted = run(op, [], state=state)
    out.extend(emitted)

    # Each document is one sample start, so arrival i is lane sample i; windows are runs of `window`
    # arrivals of one phase.
    row = lambda r: r.meta.segments[0].row  # noqa: E731
    windows = []
    for _, phase in itertools.groupby(enumerate(records), key=lambda ir: bisect.bisect_right(op.drains, ir[0])):
        phase = [r for _, r in phase]
        windows += [phase[i : i + op.window] for i in range(0, len(phase), op.window)]
    want = [r for w in windows for r in sorted(sorted(w, key=row), key=lambda r: op.key(r.payload), reverse=op.reverse)]
    assert [row(r) for r in out] == [row(r) for r in want]
    assert all(a is b for a, b in zip(out, want)), "order_by must pass records through unchanged"
    assert op.report(state) == {"buffered": 0, "windows": len(windows), "emitted": len(records)}


# -- batch ------------------------------------------------------------------------------------------------


def check_batch_report(op, state, out, dropped):
    report = op.report(state)
    assert report["batches"] == len(out)
    assert report["dropped_records_at_end"] == dropped
    lengths = [[len(r.payload["input_ids"]) for r in b.records] for b in out]
    assert report["real_tokens"] == sum(map(sum, lengths))
    assert report["padded_slots"] == sum(len(ls) * max(ls) for ls in lengths)


@given(data=st.data(), records=streams(st.lists(st.integers(0, 8), max_size=60)))
def test_batch_keeps_order_and_only_the_end_is_short(data, records):
    op = Batch(data.draw(st.integers(1, 6), label="microbatch_size"), drop_last=data.draw(st.booleans(), label="drop_last"))
    chunks = data.draw(chunkings(records), label="chunks")
    state, out = run(op, chunks)
    full, rest = divmod(len(records), op.microbatch_size)
    assert [len(b) for b in out] == [op.microbatch_size] * full + ([] if op.drop_last or not rest else [rest])
    flat = [r for b in out for r in b.records]
    assert len(flat) == len(records) - (rest if op.drop_last else 0)
    assert all(x is y for x, y in zip(flat, records))
    check_batch_report(op, state, out, rest if op.drop_last else 0)


@given(data=st.data(), records=streams(st.lists(st.integers(0, 8), max_size=80)), key=keys)
def test_batch_grouped_by_length_cuts_each_window_sorted_by_length(data, records, key):
    mbs = data.draw(st.integers(1, 6), label="microbatch_size")
    buffer_size = data.draw(st.none() | st.integers(1, 5).map(lambda k: k * mbs), label="buffer_size")
    op = Batch(mbs, drop_last=data.draw(st.booleans(), label="drop_last"), group_by_length=True, buffer_size=buffer_size)
    chunks = data.draw(chunkings(records), label="chunks")
    state, out = run(op, chunks, key=key)

    # Windows of `window` arrivals are grouped separately, in arrival order; at the end of data
    # the last window loses its last `len % mbs` arrivals under drop_last.
    windows = [records[i : i + op.window] for i in range(0, len(records), op.window)]
    dropped = len(windows[-1]) % mbs if windows and op.drop_last else 0
    if dropped:
        windows[-1] = windows[-1][: len(windows[-1]) - dropped]
    position = {id(r): i for i, r in enumerate(records)}
    emitted = iter(out)
    for w, window in enumerate(windows):
        ranked = sorted(window, key=lambda r: (len(r.payload["input_ids"]), position[id(r)]))
        mine = [next(emitted) for _ in range(-(-len(window) // mbs))]
        # Each batch is a run of the window sorted by (length, arrival); only a final window's
        # longest batch can be short.
        mine.sort(key=lambda b: ranked.index(b.records[0]))
        assert [r for b in mine for r in b.records] == ranked, f"window {w}"
        assert all(len(b) == mbs for b in mine[:-1])
    assert next(emitted, None) is None
    check_batch_report(op, state, out, dropped)
