"""``Pipeline.explain()``: the compiled plan, in words and as a dict.

Data and performance settings, the lanes of each rank and worker, and what a checkpoint holds and
its size (measuring runs lane 0 in this process; nothing here runs a loader).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import attrs
import msgspec

from ..runtime.checkpoint import build
from ..core.operator import Operator, StatelessOp, describe
from ..runtime.distributed import Topology
from ..runtime.lanes import Plan
from ..runtime.options import Options
from ..sources.mixture import MixtureSpec
from ..core.records import Record, SampleBatch
from ..text.tokenizer import TokenizerHandle
from ..training.fields import TOKEN_FIELDS

#: Options that decide the data; every other option only decides where and how fast lanes run.
DATA_OPTIONS = ("canonical_replicas",)
_SOURCE_SETTINGS = (
    "seed", "exhausted_policy", "passes", "shuffle_shards", "shuffle_within_shard", "chunk_size", "lane_assignment"
)
_EXECUTOR_SETTINGS = ("workers", "thread", "prefetch", "read_size", "read_ahead")


@attrs.frozen
class Explanation:
    """The compiled plan of a pipeline: ``print()`` it, or read :attr:`data` (a JSON-safe dict)."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def __str__(self) -> str:
        return render(self.data)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython shows the text
        p.text(str(self))


def _settings(op: Operator) -> tuple[dict[str, Any], dict[str, Any]]:
    """An operator's ``(data settings, performance settings)``, as JSON-friendly values."""
    data, perf = {}, {}
    fingerprint = op.fingerprint()
    for f in attrs.fields(type(op)):
        if f.name.startswith("_"):
            continue  # internal bookkeeping, not a setting
        if f.metadata.get("data", True) and f.name not in fingerprint and getattr(op, f.name) == f.default:
            continue  # a setting the fingerprint leaves out at its default (a shuffle's drains)
        if f.metadata.get("omit_default") and getattr(op, f.name) == f.default:
            continue  # a setting shown only when used (max_skipped)
        value = describe(getattr(op, f.name))
        (data if f.metadata.get("data", True) else perf)[f.name] = value
    handle = getattr(op, "tokenizer", None)
    if isinstance(handle, TokenizerHandle) and "backend" in perf:
        # The encoder in use, which "auto" resolved when the operator was built.
        if perf["backend"] != handle.backend:
            perf["backend_asked"] = perf["backend"]
        perf["backend"] = handle.backend
    return data, perf


def _held(op: Operator) -> tuple[str, int | None]:
    """What an operator's state holds at most, in records (by reference): in words, and as a bound if known."""
    if isinstance(op, StatelessOp) and op.on_error == "skip":
        return "no records (counters, and the references and errors of up to 100 skipped records)", 0
    if isinstance(op, StatelessOp):
        return "no records (a counter of inputs that produced nothing)", 0
    if op.kind == "shuffle":
        return f"up to {op.buffer_size} records", op.buffer_size
    if op.kind == "order_by":
        return f"up to {op.window - 1} records (the open window)", op.window - 1
    if op.kind == "batch" and getattr(op, "max_tokens", None) is not None:
        if op.sort_window:
            return f"up to {op.sort_window - 1} records (the sort window being filled)", op.sort_window - 1
        return f"the open microbatch (under max_tokens={op.max_tokens} token slots)", None
    if op.kind == "batch" and getattr(op, "tokens_per_microbatch", None) is not None:
        return f"the open microbatch (fewer than tokens_per_microbatch={op.tokens_per_microbatch} tokens of rows)", None
    if op.kind == "batch" and getattr(op, "group_by_length", False):
        return f"up to {op.window} records (length grouping buffer)", op.window
    if op.kind == "batch":
        return f"up to {op.microbatch_size - 1} records (a partial batch)", op.microbatch_size - 1
    if op.kind not in ("pack_flat", "pack_sequences"):
        return "see the operator's documentation", None
    algorithm = getattr(op, "algorithm", "")
    if algorithm == "wrap" and hasattr(op.max_length, "longest"):
        held = f"pieces of documents shorter than the next row (under {op.max_length.longest}"
        return held + " tokens; they carry over to a new length)", None
    if algorithm == "wrap":
        return f"pieces of documents shorter than one row ({op.max_length} tokens)", None
    if algorithm == "best_fit_wrap":
        return f"up to {op.candidate_pool_size or 'the default number of'} candidate pieces", None
    return f"up to {op.num_bins or 'the default number of'} open rows of documents", None


def _count_records(tree: Any) -> int:
    if isinstance(tree, Record):
        return 1
    if isinstance(tree, SampleBatch):
        return len(tree.records)
    if isinstance(tree, msgspec.Struct):
        return sum(_count_records(getattr(tree, n)) for n in tree.__struct_fields__)
    if isinstance(tree, (tuple, list)):
        return sum(_count_records(x) for x in tree)
    return 0


def _size(obj: Any) -> int:
    return len(msgspec.msgpack.encode(obj))


def _measure(plan: Plan, steps: int, ops: Sequence[tuple[str, Operator]]) -> dict[str, Any]:
    """Run lane 0 for ``steps`` outputs here; sizes of its encoded state, whole and per operator."""
    state, done = plan.init(0), 0
    for _ in range(steps):
        state, out = plan.next(0, state)
        if out is None:
            break
        done += 1
    encoded, per_op = plan.encode(state), {}
    lane_bytes = estimate = _size(encoded)
    for (name, op), s in zip(ops, state.chain.states):
        size, held, bound = _size(encoded["ops"][name]), _count_records(s), _held(op)[1]
        full = size
        if held and bound is not None and bound > held:
            full = size + (size / held) * (bound - held)  # bytes per held record, to a full buffer
        per_op[name] = {"bytes": size, "records_held": held, "bytes_when_full": int(full)}
        estimate += int(full) - size
    return {"steps": done, "lane_bytes": lane_bytes, "per_operator": per_op, "lane_bytes_when_full": estimate}


def _operator(name: str, op: Operator) -> dict[str, Any]:
    data, perf = _settings(op)
    fields = list(getattr(op.state_type, "__struct_fields__", ()))
    state = {"type": op.state_type.__name__, "fields": fields, "holds": _held(op)[0]}
    out = {"name": name, "operator": type(op).__name__, "data_settings": data, "performance_settings": perf}
    return {**out, "fans_out": bool(getattr(op, "fans_out", False)), "state": state}


def explain_plan(
    plan: Plan, options: Options, topology: Topology, ops: Sequence[tuple[str, Operator]], *, measure: int = 0
) -> Explanation:
    """The :class:`Explanation` of a compiled plan (see :meth:`zephon.Pipeline.explain`)."""
    source = plan.source
    fixed = isinstance(source.mixture, MixtureSpec)  # a schedule's weights change over time
    integer = source.mixture.integer_weights(source.names) if fixed else None
    datasets = [
        {"name": ds.name, "format": getattr(ds, "format", None), "shards": len(ds.shard_ids),
         "rows": ds.num_rows, "weight": None if integer is None else integer[i] / sum(integer)}
        for i, ds in enumerate(source.datasets)
    ]
    source_settings = {k: getattr(source, k) for k in _SOURCE_SETTINGS}
    operators = [_operator(name, op) for name, op in ops]
    L = plan.lanes
    batch = ops[-1][1] if ops and ops[-1][1].kind == "batch" else None
    microbatch = getattr(batch, "microbatch_size", None)
    lanes: dict[str, Any] = {"canonical_replicas": L, "microbatch_size": microbatch}
    if microbatch:
        lanes["records_per_global_step"] = L * microbatch
    budget = getattr(batch, "max_tokens", None)
    if budget is not None:
        lanes.update(max_tokens=budget, sort_window=batch.sort_window, pad_to_multiple_of=batch.pad_to_multiple_of)
        lanes["token_slots_per_global_step"] = L * budget
    tokens = getattr(batch, "tokens_per_microbatch", None)
    if tokens is not None:
        lanes.update(tokens_per_microbatch=tokens, training_tokens_per_global_step=L * tokens)
        pack = next((op for _, op in ops if op.kind == "pack_flat"), None)
        if pack is not None:
            phases = getattr(pack.max_length, "phases", None)
            points = phases(tokens) if phases else [(0, pack.max_length, tokens // (pack.max_length - 1), 0)]
            lanes["row_lengths"] = [{"from_step": p[0], "length": p[1], "rows_per_microbatch": p[2]} for p in points]
    executor: dict[str, Any] = {k: getattr(options, k) for k in _EXECUTOR_SETTINGS}
    threads = "a background thread" if options.thread else "the calling thread"
    executor["kind"] = "worker processes (spawned)" if options.workers else threads
    D, per, mine = topology.dp_degree, L // topology.dp_degree, list(topology.lanes)
    ranks = {str(r): [r * per, (r + 1) * per - 1] for r in range(D)}
    lanes.update(dp_degree=D, dp_rank=topology.dp_rank, lanes_of_this_rank=mine, ranks=ranks)
    if options.workers:
        n = max(1, min(options.workers, len(mine)))
        executor.update(
            processes=n,
            start="the workers compute every output, from iter() on",
            lanes_per_process={f"worker {w}": mine[w::n] for w in range(n)},
            tokenizer_threads_per_process=max(1, (os.cpu_count() or 1) // n),
        )
    start = build(plan.fingerprint(), {lane: plan.encode(plan.init(lane)) for lane in range(L)})
    checkpoint: dict[str, Any] = {
        "per_lane": [
            "source: the lane's cursor in the mixture [work chunk, offset]",
            *(f"ops.{o['name']}: {o['state']['type']}, holding {o['state']['holds']}" for o in operators),
            "pending: outputs computed and not yet delivered (by reference)",
            "delivered, done: the lane's output count and whether it ended; checksum",
        ],
        "records_by_reference": "records are stored as (dataset, shard, row, token range) and rebuilt on restore",
        "bytes_at_start": _size(start),
        "lanes": L,
    }
    if options.keyframes:
        checkpoint["keyframes"] = {"folder": options.keyframes, "every": options.keyframe_every, "keep": options.keyframe_keep}
    if measure:
        m = _measure(plan, measure, ops)
        checkpoint["measured"] = m
        checkpoint["estimated_bytes_when_full"] = m["lane_bytes_when_full"] * L
    run_options = {f.name: getattr(options, f.name) for f in attrs.fields(Options)}
    data_options = {k: v for k, v in run_options.items() if k in DATA_OPTIONS}
    performance = {k: v for k, v in run_options.items() if k not in DATA_OPTIONS}
    return Explanation({
        "source": {"type": type(source).__name__, "datasets": datasets, "settings": source_settings},
        "operators": operators,
        "options": {"data": data_options, "performance": performance},
        "lanes": lanes,
        "executor": executor,
        "checkpoint": checkpoint,
    })


def _kib(n: float) -> str:
    return f"{n:,.0f} B" if n < 1024 else (f"{n / 1024:,.1f} KiB" if n < 1024**2 else f"{n / 1024**2:,.1f} MiB")


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items()) or "-"


def render(data: dict[str, Any]) -> str:
    """The text of an :class:`Explanation`."""
    src = data["source"]
    out = [f"source: {src['type']} ({_kv(src['settings'])})"]
    for ds in src["datasets"]:
        w = "" if ds["weight"] is None else f", weight {ds['weight']:.3f}"
        out.append(f"  dataset {ds['name']!r}: {ds['shards']} shard(s), {ds['rows']:,} rows{w}")
    out += ["", "operators (data settings decide the batches; performance settings may change between a checkpoint and its restore):"]
    for i, o in enumerate(data["operators"], 1):
        out.append(f"  {i}. {o['name']}: {o['operator']}{' (splits records)' if o['fans_out'] else ''}")
        out.append(f"       data: {_kv(o['data_settings'])}")
        if o["performance_settings"]:
            out.append(f"       performance: {_kv(o['performance_settings'])}")
        out.append(f"       state: {o['state']['type']} {o['state']['fields']}; holds {o['state']['holds']}")
    opts = data["options"]
    out += ["", f"options: data: {_kv(opts['data'])}; performance: {_kv(opts['performance'])}"]
    lanes = data["lanes"]
    line = f"lanes: L={lanes['canonical_replicas']}"
    if lanes.get("microbatch_size"):
        line += f", microbatch {lanes['microbatch_size']}, {lanes['records_per_global_step']} records per global step"
    if lanes.get("max_tokens"):
        sort = f"sorted {lanes['sort_window']} records at a time" if lanes["sort_window"] else "in arrival order"
        multiple = lanes["pad_to_multiple_of"]
        multiple = f", rows rounded up to multiples of {multiple}" if multiple else ""
        line += (
            f", microbatches of up to {lanes['max_tokens']:,} token slots (rows x longest row{multiple}; a variable "
            f"number of rows, {sort}), up to {lanes['token_slots_per_global_step']:,} slots per global step"
        )
    if lanes.get("tokens_per_microbatch"):
        line += (
            f", {lanes['tokens_per_microbatch']:,} training tokens per microbatch "
            f"({lanes['training_tokens_per_global_step']:,} per global step)"
        )
        for p in lanes.get("row_lengths", []):
            rows = f"rows of {p['length']} tokens, {p['rows_per_microbatch']} per microbatch"
            line += f"\n  from step {p['from_step']}: {rows}"
    out.append(line)
    ranks = lanes["ranks"]
    shown = list(ranks.items())[:8]
    parts = ", ".join(f"rank {r}: lanes {a}-{b}" if a != b else f"rank {r}: lane {a}" for r, (a, b) in shown)
    more = f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else ""
    out.append(f"  D={lanes['dp_degree']} ranks, this is rank {lanes['dp_rank']}; {parts}{more}")
    ex = data["executor"]
    line = f"executor: {ex['kind']}, prefetch {ex['prefetch']} per lane, read_size {ex['read_size']}"
    line += f", read_ahead {ex['read_ahead'] or 'off'}"
    if "processes" in ex:
        line += f"; {ex['processes']} process(es), {ex['tokenizer_threads_per_process']} tokenizer thread(s) each"
    out.append(line)
    out += [f"  {w}: lanes {lanes_of}" for w, lanes_of in ex.get("lanes_per_process", {}).items()]
    ck = data["checkpoint"]
    out += ["", f"checkpoint: one state per lane ({ck['lanes']} lanes), {ck['records_by_reference']}:"]
    out += [f"  - {item}" for item in ck["per_lane"]]
    out.append(f"  size at the start: {_kib(ck['bytes_at_start'])} (msgpack, all lanes)")
    if kf := ck.get("keyframes"):
        out.append(f"  keyframes: every {kf['every']} global steps in {kf['folder']}, the newest {kf['keep']} kept (skip_steps starts there)")
    if m := ck.get("measured"):
        out.append(
            f"  measured on lane 0 after {m['steps']} output(s): {_kib(m['lane_bytes'])}; with full buffers about "
            f"{_kib(m['lane_bytes_when_full'])} per lane, {_kib(ck['estimated_bytes_when_full'])} for all lanes"
        )
        for name, s in m["per_operator"].items():
            out.append(f"    {name}: {_kib(s['bytes'])} holding {s['records_held']} record(s); full: {_kib(s['bytes_when_full'])}")
    else:
        out.append("  (explain(measure=N) runs lane 0 for N outputs and estimates the size with full buffers)")
    return "\n".join(out)


#: Payload fields of conversations, which ``tokenize_chat`` renders.
_CHAT_FIELDS = ("messages", "conversations", "conversation")


def untokenized_warning(plan: Plan, lane: int) -> str | None:
    """Why a pipeline without operators that yields text records (a forgotten or discarded ``tokenize``)
    should be warned about, from its first record; ``None`` when it yields tokens."""
    try:
        _, first = plan.next(lane, plan.init(lane))
    except Exception:  # noqa: BLE001 - the loader reads the same record and raises its error with context
        return None
    payload = getattr(first, "payload", None)
    if not isinstance(payload, dict) or any(name in payload for name in TOKEN_FIELDS):
        return None
    fields = [name for name, value in payload.items() if isinstance(value, str) or _is_conversation(value)]
    if not fields:
        return None
    chat = [f for f in fields if f in _CHAT_FIELDS or not isinstance(payload[f], str)]
    fix = f"p = p.tokenize_chat(tokenizer, field={chat[0]!r})" if chat else f"p = p.tokenize(tokenizer, field={fields[0]!r})"
    return (
        f"this pipeline has no operators, so it yields the source's records as they are: text, not tokens "
        f"(fields {fields} of the first record). Add a tokenizer, e.g. `{fix}`, and assign the result: "
        "builder methods return a new pipeline."
    )


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def describe_record(plan: Plan, rec: Any) -> dict[str, Any]:
    """Where a record's tokens come from: ``(dataset, shard, row, start, end)`` per segment, and its padding."""
    ds = plan.source.datasets
    segments = [(ds[s.dataset].name, ds[s.dataset].shard_ids[s.shard], s.row, s.start, s.end) for s in rec.meta.segments]
    return {"segments": segments, "padding_length": rec.meta.padding_length}
