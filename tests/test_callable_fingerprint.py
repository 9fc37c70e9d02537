"""A function's fingerprint covers what decides its output, so a checkpoint never restores into
another function: code (source text), closure cells, defaults, ``functools.partial`` arguments, a
bound method's instance, and the plain module-level values it reads. A value that cannot be
described is named in the fingerprint, warned about when the pipeline is built, and makes restores
refuse until ``fingerprint=`` names the function's version.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import attrs
import pytest

from zephon import Pipeline
from zephon.core.fingerprint import describe_callable, unfingerprintable
from zephon.ops import FingerprintWarning, stateless

ROWS = [{"n": i} for i in range(40)]
OFFSET = 1
LOG = logging.getLogger("zephon.test_callable_fingerprint")


def add(k, p):
    return {"n": p["n"] + k}


def add_to(p, k):
    return {"n": p["n"] + k}


def make(k):
    def scale(p):
        return {"n": p["n"] * k}

    return scale


def with_default(p, k=2):
    return {"n": p["n"] * k}


def shifted(p):
    LOG.debug("shifting %s", p)  # a logger read by the function decides nothing: not described
    return {"n": p["n"] + OFFSET}


def calls_shifted(p):
    return shifted(p)


def countdown(n):  # calls itself by its global name
    return 0 if n <= 0 else countdown(n - 1)


def recursive_map(p):
    return {"n": p["n"] + countdown(2)}


@attrs.frozen
class Scaler:
    k: int

    def __call__(self, p):
        return {"n": p["n"] * self.k}

    def apply(self, p):
        return {"n": p["n"] * self.k}


def pipeline(fn, **kwargs):
    return Pipeline(ROWS).map(fn, name="scale", **kwargs).batch(4)


def ns(batches):
    return [[r.payload["n"] for r in b.records] for b in batches]


def checkpoint_after(pipe, steps=3):
    loader = iter(pipe)
    taken = [next(loader) for _ in range(steps)]
    ck = loader.checkpoint()
    loader.close()
    return taken, ck


def refused(before, after, *expected):
    _, ck = checkpoint_after(before)
    with pytest.raises(ValueError) as info:
        after.loader(ck)
    message = str(info.value)
    for text in expected:
        assert text in message, message
    return message


def test_partial_arguments_decide_the_fingerprint():
    refused(pipeline(functools.partial(add, 2)), pipeline(functools.partial(add, 3)), "map 'scale': partial argument 0 differs")


def test_partial_keywords_decide_the_fingerprint():
    refused(pipeline(functools.partial(add_to, k=2)), pipeline(functools.partial(add_to, k=3)), "map 'scale': partial keyword 'k' differs")


def test_closure_cells_decide_the_fingerprint():
    refused(pipeline(make(2)), pipeline(make(3)), "map 'scale': closure cell 'k' differs", "checkpoint=2 pipeline=3")


def test_the_same_closure_value_restores_and_yields_the_same_batches():
    full = ns(pipeline(make(2)))
    taken, ck = checkpoint_after(pipeline(make(2)))
    rest = ns(pipeline(make(2)).loader(ck))  # another closure object holding the same value
    assert ns(taken) + rest == full
    assert rest == [[4 * i * 2 + 2 * j for j in range(4)] for i in range(3, 10)]


def test_a_changed_default_is_refused():
    assert describe_callable(with_default)["defaults"] == {"k": 2}
    refused(pipeline(make_default(2)), pipeline(make_default(3)), "map 'scale': default of 'k' differs")


def make_default(k):
    def fn(p, k=k):
        return {"n": p["n"] * k}

    return fn


def test_a_changed_keyword_default_is_refused():
    def make_kw(k):
        def fn(p, *, k=k):
            return {"n": p["n"] * k}

        return fn

    refused(pipeline(make_kw(2)), pipeline(make_kw(3)), "map 'scale': keyword default of 'k' differs")


def test_a_bound_method_of_a_frozen_attrs_instance_is_fingerprinted_by_its_fields():
    refused(pipeline(Scaler(2).apply), pipeline(Scaler(3).apply), "map 'scale': the method's instance: field 'k' differs")


def test_a_callable_attrs_instance_is_fingerprinted_by_its_fields():
    refused(pipeline(Scaler(2)), pipeline(Scaler(3)), "map 'scale': the callable's fields: field 'k' differs")


def test_a_changed_global_constant_is_refused(monkeypatch):
    assert describe_callable(shifted)["globals"] == {"OFFSET": 1}
    before = pipeline(shifted)
    _, ck = checkpoint_after(before)
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 2)
    with pytest.raises(ValueError, match="map 'scale': global 'OFFSET' differs"):
        pipeline(shifted).loader(ck)


def test_a_global_read_by_a_called_function_is_covered(monkeypatch):
    _, ck = checkpoint_after(pipeline(calls_shifted))
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 5)
    with pytest.raises(ValueError, match="map 'scale': global 'shifted': global 'OFFSET' differs"):
        pipeline(calls_shifted).loader(ck)


def test_a_recursive_function_is_fingerprinted_once():
    fp = describe_callable(recursive_map)
    assert fp["globals"]["countdown"]["globals"]["countdown"] == f"<recursive: {__name__}.countdown>"
    assert fp == describe_callable(recursive_map)


def test_a_filter_predicate_is_fingerprinted_and_named():
    def above(t):
        return lambda p: p["n"] > t

    before = Pipeline(ROWS).filter(above(3), name="keep").batch(4)
    after = Pipeline(ROWS).filter(above(4), name="keep").batch(4)
    refused(before, after, "filter 'keep': closure cell 't' differs")


def test_an_open_file_is_named_warned_and_refused_until_the_function_is_named(tmp_path):
    path = tmp_path / "offsets.txt"
    path.write_text("7\n")
    with open(path) as f:

        def read_offset(p):
            f.seek(0)
            return {"n": p["n"] + int(f.read())}

        marker = "<unfingerprintable: TextIOWrapper in closure cell 'f'>"
        assert unfingerprintable(describe_callable(read_offset)) == [marker]
        with pytest.warns(FingerprintWarning, match=r"map 'scale'.*TextIOWrapper in closure cell 'f'.*fingerprint="):
            unnamed = pipeline(read_offset)
        with pytest.raises(ValueError, match=r"map 'scale' holds a value its fingerprint cannot describe.*fingerprint='v1'"):
            unnamed.loader(checkpoint_after(unnamed)[1])

        with warnings.catch_warnings():
            warnings.simplefilter("error", FingerprintWarning)  # naming the version silences the warning
            named = pipeline(read_offset, fingerprint="v1")
        full = ns(named)
        taken, ck = checkpoint_after(named)
        assert ck["fingerprint"]["operators"][0][1]["fn"] == "v1"
        assert ns(taken) + ns(pipeline(read_offset, fingerprint="v1").loader(ck)) == full
        with pytest.raises(ValueError, match="map 'scale': the function differs"):
            pipeline(read_offset, fingerprint="v2").loader(ck)


def test_the_fingerprint_name_must_be_a_string():
    with pytest.raises(TypeError, match="fingerprint must be a string"):
        pipeline(make(2), fingerprint=1)
    assert stateless(make(2), fingerprint="v1").fingerprint() == {"op": "MapOp", "fn": "v1"}


def first_place():
    return lambda p: {"n": p["n"] * 2}


def second_place():
    fn = lambda p: {"n": p["n"] * 2}  # noqa: E731  (the same text, elsewhere in the file)
    return fn


def test_lambdas_defined_identically_in_two_places_restore():
    a, b = first_place(), second_place()
    assert a.__qualname__ != b.__qualname__
    taken, ck = checkpoint_after(pipeline(a))
    assert ns(taken) + ns(pipeline(b).loader(ck)) == ns(pipeline(a))


def test_two_lambdas_on_one_line_differ():
    inc, dec = (lambda p: {"n": p["n"] + 1}), (lambda p: {"n": p["n"] - 1})
    assert describe_callable(inc)["code"].startswith("source:")
    assert describe_callable(inc) != describe_callable(dec)
    refused(pipeline(inc), pipeline(dec), "map 'scale': the code differs")


def test_a_changed_body_is_refused():
    def twice(p):
        return {"n": p["n"] * 2}

    def thrice(p):
        return {"n": p["n"] * 3}

    refused(pipeline(twice), pipeline(thrice), "map 'scale': the code differs")


MODULE = '''
import functools

import attrs

LIMIT = 4
TABLE = {"a": [1, 2], "b": frozenset({3, 1, 2})}


def add(k, p):
    return p + k + LIMIT


def make(k):
    return lambda p: p * k + len(TABLE)


@attrs.frozen
class Scaler:
    k: int

    def apply(self, p):
        return p * self.k


FUNCTIONS = [functools.partial(add, 2), make(3), Scaler(5).apply]
'''


def test_the_fingerprint_is_the_same_in_every_process(tmp_path):
    (tmp_path / "fp_module.py").write_text(textwrap.dedent(MODULE))
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import fp_module; "
        "from zephon.core.fingerprint import describe_callable; "
        "print(json.dumps([describe_callable(f) for f in fp_module.FUNCTIONS], sort_keys=True))"
    )
    outs = []
    for seed in ("0", "1"):  # other string hashes, so other set orders
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        outs.append(json.loads(done.stdout))
    assert outs[0] == outs[1]
    text = json.dumps(outs[0])
    assert "0x" not in text and "<unfingerprintable" not in text
    assert [fp.get("args") for fp in outs[0]] == [[2], None, None]
