"""Checks that any operator, including your own, keeps zephon's guarantees.

``check_operator(op, records_from(payloads))`` runs every check below on one input: chunking
invariance, exact resumes from every step boundary (state through JSON, held records rebuilt from
their metas as a pipeline does), msgpack round trips, and a flush that ends.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import msgspec
import numpy as np

from .core.operator import Operator, sample_meta
from .core.records import Meta, Record, payload_equal
from .core.state import output_ref

__all__ = [
    "assert_checkpoint_equivalence", "assert_chunking_invariance", "assert_flush_ends", "assert_states_round_trip",
    "check_operator", "input_resolver", "outputs_equal", "records_from", "run",
]


def records_from(payloads: Sequence[Any], *, lane: int = 0, dataset: int = 0, shard: int = 0) -> list[Record]:
    """Source records for ``payloads``: row ``i`` of ``shard`` of ``dataset`` in ``lane`` (distinct metas).

    Examples:
        >>> [r.meta.segments[0].row for r in records_from([{"x": 1}, {"x": 2}])]
        [0, 1]
    """
    return [Record(p, sample_meta(lane, dataset, shard, i)) for i, p in enumerate(payloads)]


def check_operator(op: Operator, records: Sequence[Record], *, key: int = 0, chunk_size: int = 3) -> None:
    """Run every check of this module on ``op`` (a module-level class, so it pickles) over
    ``records`` (distinct metas, see :func:`records_from`), ``key`` passed to ``op.init``: chunking
    invariance (one chunk, single records, ``chunk_size``, two halves), then resumes, ``rebuild``
    and msgpack round trips over chunks of ``chunk_size``.

    Raises:
        AssertionError: naming the check, the step boundary or state, and the first difference.
    """
    records = list(records)
    n = len(records)
    assert_flush_ends(op, [records], key=key)
    for cuts in ([], list(range(1, n)), list(range(chunk_size, n, chunk_size)), [n // 2]):
        assert_chunking_invariance(op, records, cuts, key=key)
    chunks = [records[i : i + chunk_size] for i in range(0, n, chunk_size)]
    assert_checkpoint_equivalence(op, chunks, key=key)
    assert_states_round_trip(op, chunks, key=key)


def assert_flush_ends(op: Operator, chunks: Sequence[Sequence[Any]], *, key: int = 0, pieces: int | None = None) -> None:
    """Assert that flushing after ``chunks`` ends within ``pieces`` calls (default: one per input
    record, plus one), and that a flushed state hands out nothing again."""
    state = op.init(key)
    for chunk in chunks:
        state, _ = op.step(state, list(chunk))
    limit = sum(map(len, chunks)) + 1 if pieces is None else pieces
    for _ in range(limit):
        state, out = _flush_piece(op, state)
        if not out:
            again, more = op.flush(state)
            assert not more, f"{op.kind}: a flushed state handed out {len(more)} more outputs; a flush ends with nothing left"
            return
    raise AssertionError(f"{op.kind}: flush still hands out outputs after {limit} calls; a flush hands out what the state holds")


def assert_states_round_trip(op: Operator, chunks: Sequence[Sequence[Record]], *, key: int = 0) -> None:
    """Assert that every state ``op`` reaches over ``chunks`` (flush included) encodes to msgpack
    bytes that decode to an equal state and encode to the same bytes again."""
    chunks = [list(c) for c in chunks]
    resolve = input_resolver(chunks)
    states, _ = _trace(op, chunks, key)
    for i, saved in enumerate(states):
        wire = msgspec.msgpack.encode(op.encode_state(saved))
        decoded = op.decode_state(msgspec.msgpack.decode(wire), resolve)
        assert msgspec.msgpack.encode(op.encode_state(decoded)) == wire, f"{op.kind}: state {i} re-encodes to other msgpack bytes"
        assert decoded == saved, f"{op.kind}: state {i} decodes from msgpack to a different state: {decoded!r} != {saved!r}"


def input_resolver(chunks: Sequence[Sequence[Record]]):
    """A resolver that rebuilds input records from their metas (what a source does)."""
    table: dict[Meta, Record] = {}
    for chunk in chunks:
        for rec in chunk:
            if rec.meta in table and not payload_equal(table[rec.meta].payload, rec.payload):
                raise ValueError(f"two different input records share the meta {rec.meta!r}; give each a distinct row")
            table[rec.meta] = rec

    def resolve(metas: Sequence[Meta]) -> list[Record]:
        missing = [m for m in metas if m not in table]
        if missing:
            raise KeyError(f"no input record with meta {missing[0]!r}")
        return [table[m] for m in metas]

    return resolve


def run(op: Operator, chunks: Sequence[Sequence[Any]], key: int = 0, state: Any = None) -> tuple[Any, list]:
    """Run ``op`` over ``chunks`` and flush until it returns nothing; returns (final state, all outputs)."""
    states, produced = _trace(op, chunks, key, state)
    return states[-1], [x for part in produced for x in part]


def _trace(op: Operator, chunks: Sequence, key: int, state: Any = None) -> tuple[list, list]:
    """Every state ``op`` passes through over ``chunks`` and each piece of the flush (the start included,
    the last flush handing out nothing), and the outputs of each step: ``(states, produced)``."""
    state = op.init(key) if state is None else state
    states, produced = [state], []
    for chunk in chunks:
        state, out = op.step(state, list(chunk))
        states.append(state)
        produced.append(out)
    while True:
        state, out = _flush_piece(op, state)
        states.append(state)
        produced.append(out)
        if not out:
            return states, produced


def _flush_piece(op: Operator, state: Any) -> tuple[Any, list]:
    """One ``flush`` call; a call that hands out outputs must change the state (or it would forever)."""
    flushed, out = op.flush(state)
    assert not (out and flushed is state), (
        f"{op.kind}: flush returned outputs and the state it was given; a flush hands out what the state holds "
        "and returns a state without it"
    )
    return flushed, out


def outputs_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Exact equality of output lists (records or batches), payload arrays included."""
    return list(a) == list(b)  # records compare metas and payloads; batches, their records


def _describe_mismatch(expected: Sequence[Any], got: Sequence[Any]) -> str:
    if len(expected) != len(got):
        return f"{len(got)} outputs instead of {len(expected)}"
    for i, (x, y) in enumerate(zip(expected, got)):
        if x != y:
            return f"output {i} differs: expected {x!r}, got {y!r}"
    return "outputs differ"


def assert_checkpoint_equivalence(op: Operator, chunks: Sequence[Sequence[Record]], *, key: int = 0) -> None:
    """Assert that stopping ``op`` at any step boundary of ``chunks`` (records with distinct metas)
    and restoring its state from JSON changes no output, and that ``rebuild`` from metas works."""
    chunks = [list(c) for c in chunks]
    resolve = input_resolver(chunks)
    states, produced = _trace(op, chunks, key)  # each piece of the flush is a boundary too
    everything = [x for part in produced for x in part]

    rebuilt = op.rebuild([output_ref(x) for x in everything], resolve)
    assert outputs_equal(everything, rebuilt), f"{op.kind}: rebuild() from metas differs: {_describe_mismatch(everything, rebuilt)}"

    for k, saved in enumerate(states):
        encoded = op.encode_state(saved)
        wire = json.loads(json.dumps(encoded))
        restored = op.decode_state(wire, resolve)
        again = op.encode_state(restored)
        assert json.dumps(again, sort_keys=True) == json.dumps(encoded, sort_keys=True), (
            f"{op.kind}: state at boundary {k} does not round-trip through encode/decode"
        )
        _, rest = run(op, chunks[k:], state=restored)
        expected = [x for part in produced[k:] for x in part]
        assert outputs_equal(expected, rest), (
            f"{op.kind}: resuming at boundary {k} of {len(states) - 1} changed the outputs: {_describe_mismatch(expected, rest)}"
        )


def assert_chunking_invariance(op: Operator, records: Sequence[Any], cuts: Sequence[int], *, key: int = 0) -> None:
    """Assert that splitting ``records`` at ``cuts`` gives the same outputs as one chunk."""
    _, whole = run(op, [list(records)], key=key)
    bounds = [0] + sorted(c for c in cuts if 0 < c < len(records)) + [len(records)]
    chunks = [list(records[a:b]) for a, b in zip(bounds, bounds[1:])]
    _, split = run(op, chunks, key=key)
    assert outputs_equal(whole, split), f"{op.kind}: chunking at {cuts} changed the outputs: {_describe_mismatch(whole, split)}"


# -- generated data for mixture experiments ---------------------------------------------------------------


def word_tokenizer(vocab_size: int = 256) -> Any:
    """A word-level ``tokenizers.Tokenizer`` over the words ``w0 .. w{vocab_size-1}`` (one token per word).

    Id 0 is ``[UNK]``, id 1 ``<eos>``; it builds in milliseconds and makes token counts exact.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    return tok


def length_datasets(mean_words: dict[str, int], rows: int, *, shards: int = 4, seed: int = 0, vocab_size: int = 256) -> list:
    """In-memory datasets of ``{"text": ...}`` rows of :func:`word_tokenizer` words, one per
    ``{name: mean words}``, ``rows`` rows over ``shards`` shards, lengths uniform in [m/2, 3m/2]."""
    from .io import Dataset

    rng = np.random.default_rng(seed)
    out = []
    for name, m in mean_words.items():
        lengths = rng.integers(max(1, m // 2), m + m // 2 + 1, size=rows)
        words = rng.integers(0, vocab_size, size=int(lengths.sum()))
        docs = np.split(words, np.cumsum(lengths)[:-1])
        texts = [" ".join(f"w{w}" for w in doc.tolist()) for doc in docs]
        per = -(-rows // shards)
        out.append(Dataset.from_dict(name, {str(s): [{"text": t} for t in texts[s * per : (s + 1) * per]] for s in range(shards)}))
    return out
