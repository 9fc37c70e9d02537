import importlib
import os
import socket
from pathlib import Path
from typing import ClassVar

import attrs
import msgspec
import numpy as np

from zephon.core.operator import Operator
from zephon.types import Meta, Record, Segment



def doc(row: int, n: int, *, lane: int = 0, dataset: int = 0, shard: int = 0, **fields) -> Record:
    """A sample-level record whose tokens are ``1000 * row + [0, n)`` (distinct per row)."""
    payload = {"input_ids": np.arange(1000 * row, 1000 * row + n, dtype=np.int32), **fields}
    return Record(payload, Meta(lane, (Segment(dataset, shard, row, 0, 0, -1),), 0))


def docs(lengths, **kw):
    return [doc(i, n, **kw) for i, n in enumerate(lengths)]




def toks_to_ids(payload):
    """Module-level (picklable) map for pipelines run in worker processes."""
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32)}


def gated_toks_to_ids(payload):
    """:func:`toks_to_ids` that waits, while the file named by ``$ZEPHON_TEST_GATE`` exists, for it to
    go (after creating ``<gate>.waiting``): user code that holds a worker's loop. Up to 20 s, then it raises."""
    import time

    gate = os.environ.get("ZEPHON_TEST_GATE")
    if gate and os.path.exists(gate):
        Path(gate + ".waiting").touch()
        deadline = time.monotonic() + 20
        while os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError("the gate stayed closed for 20 s")
            time.sleep(0.005)
    return toks_to_ids(payload)


def read_only_ids(payload):
    """Module-level map whose arrays are read-only, as those of memory-mapped token files are."""
    ids = np.asarray(payload["toks"], dtype=np.int32)
    ids.flags.writeable = False
    return {"input_ids": ids}


def fail_on_row_7(payload):
    if payload.get("id") == 7:
        raise ValueError("row 7 is bad")
    return payload


def ids_unless_bad(payload):
    """``toks_to_ids``, raising on a payload marked ``"bad"`` (module-level: workers unpickle it)."""
    if payload.get("bad"):
        raise ValueError(f"row {payload.get('id')} is marked bad")
    return toks_to_ids(payload)


def not_bad(payload):
    """The predicate that removes the payloads ``ids_unless_bad`` raises on."""
    return not payload.get("bad")


def toy_dataset(n=160, seed=0, name="web"):
    """An in-memory dataset of rows {"toks": [...], "id": i} with random lengths (some empty)."""
    from zephon.io import Dataset, InMemoryShard

    rng = np.random.default_rng(seed)
    rows = [{"toks": rng.integers(1, 1000, size=int(rng.integers(0, 40))).tolist(), "id": i} for i in range(n)]
    return Dataset.from_dict(name, {"a": InMemoryShard(rows[: n // 2]), "b": InMemoryShard(rows[n // 2 :])})


def toy_pipeline(lanes=1, *, workers=0, data=None, max_length=16, buffer=8, mbs=2, seed=0, policy="repeat", **options):
    """map(toks_to_ids) -> pack_flat -> shuffle -> batch over a toy source (endless by default)."""
    from zephon import Pipeline
    from zephon.work import StaticMixtureWorkSource

    src = StaticMixtureWorkSource([data or toy_dataset()], {"web": 1.0}, seed=seed, chunk_size=8, exhausted_policy=policy)
    return (
        Pipeline(src)
        .options(canonical_replicas=lanes, workers=workers, **options)
        .map(toks_to_ids)
        .pack_flat(max_length)
        .shuffle(buffer, seed=42)
        .batch(mbs)
    )


def take_steps(loaders, steps):
    """``steps`` global steps assembled from the ranks' loaders (rank order is lane order)."""
    iters = [loader.steps() for loader in loaders]
    return [[b for it in iters for b in next(it)] for _ in range(steps)]


def assert_steps(got, expected):
    """Two lists of global steps are the same, microbatch for microbatch."""
    from zephon.testing import outputs_equal

    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(got, expected)):
        assert outputs_equal(a, b), f"step {k} differs"


def global_steps(make, lanes, dp, steps, restore=None):
    """Run ``dp`` ranks (in this process) for ``steps`` global steps; returns (steps, rank loaders).

    Each global step is the list of L microbatches in lane order, assembled from the ranks; each
    rank's loader starts at ``restore`` (or the beginning).
    """
    loaders = [make().options(canonical_replicas=lanes, dp_degree=dp, dp_rank=r).loader(restore) for r in range(dp)]
    iters = [loader.steps() for loader in loaders]
    out = []
    for _ in range(steps):
        out.append([b for it in iters for b in next(it)])
    return out, loaders


WORDS = "the of and to in is it that for on with as was by this be are from at an not have or data lanes".split()


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=int(rng.integers(0, 60)))) for _ in range(n)]


def train_bytelevel(folder):
    """Train a small byte-level BPE with <|endoftext|> (EOS) and <|bos|> (BOS); returns tokenizer.json."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|bos|>"], show_progress=False)
    tok.train_from_iterator(texts(300), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def text_records(strings, lane=0):
    from zephon.types import Meta, Record, Segment

    return [Record({"text": t}, Meta(lane, (Segment(0, 0, i, 0, 0, -1),), 0)) for i, t in enumerate(strings)]


#: The built-in chat templates' markers (and a plain ``<|bos|>``), each one special token of the
#: tokenizers the tests train.
CHAT_SPECIALS = [
    "<|endoftext|>",
    "<|bos|>",
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def compress(data: bytes, suffix: str) -> bytes:
    """``data`` compressed as a shard with ``suffix`` (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) holds it."""
    if suffix == ".jsonl.gz":
        import gzip

        return gzip.compress(data)
    if suffix == ".jsonl.zst":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


def with_encoder_threads(payload):
    """Module-level map recording the process's ``ZEPHON_ENCODER_THREADS`` (what a worker set)."""
    import os

    return {**payload, "encoder_threads": os.environ.get("ZEPHON_ENCODER_THREADS", "")}


def with_lock(payload):
    """``payload`` holding a lock, which cannot be pickled (dropped again by :func:`without_lock`)."""
    import threading

    return {**payload, "lock": threading.Lock()}


def without_lock(payload):
    return {k: v for k, v in payload.items() if k != "lock"}


class Held(msgspec.Struct, frozen=True, tag="held"):
    """The state of :class:`Holds`: the records it received."""

    records: tuple[Record, ...] = ()


@attrs.frozen
class Holds(Operator):
    """An operator that keeps every record it receives and emits none while stepping (tests
    subclass it to flush or decode in the ways under test)."""

    kind: ClassVar[str] = "holds"
    state_type: ClassVar[type] = Held

    def init(self, key):
        return Held()

    def step(self, state, chunk):
        return Held(state.records + tuple(chunk)), []


def free_port() -> int:
    """A TCP port free on localhost now (for a torch.distributed rendezvous of processes a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(*modules: str, extra: str) -> None:
    """Import ``modules`` or skip the test module; under ``CI`` (which installs the test extra) fail instead."""
    import pytest

    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{', '.join(modules)} not installed: pip install 'zephon-lanes[{extra}]'", allow_module_level=True)
