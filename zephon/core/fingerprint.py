"""Fingerprints of the functions given to operators: what decides a function's output.

:func:`describe_callable` covers a function's code (source, else bytecode), closure cells,
defaults, ``partial`` arguments, a bound method's instance and the module-level data and functions
it reads, described deterministically (a long description as its digest). Anything else is a
marker (:func:`unfingerprintable`), and a restore is refused until the user names the function
with ``fingerprint="..."`` (``docs/design/operators.md``). Keeps a cache of code digests.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import linecache
import logging
import operator
import re
import sys
import textwrap
import types
import weakref
from typing import Any, Iterator

import attrs
import msgspec

#: How every marker of an undescribable value starts.
MARKER = "<unfingerprintable: "

#: Descriptions longer than this (as JSON) are stored as their digest.
_MAX_INLINE = 240

_CODE_DIGESTS: "weakref.WeakKeyDictionary[types.CodeType, str]" = weakref.WeakKeyDictionary()
_TREES: dict[str, tuple[str, ast.AST | None]] = {}

_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
_BUILTIN_CALLABLES += (types.MethodWrapperType, types.ClassMethodDescriptorType)
_REPR_CALLABLES = (operator.itemgetter, operator.attrgetter, operator.methodcaller)


class FingerprintWarning(UserWarning):
    """A function given to an operator holds a value its fingerprint cannot describe."""


def is_callable_value(value: Any) -> bool:
    """Whether :func:`describe_callable` (rather than a plain value description) applies."""
    return isinstance(value, (types.FunctionType, types.MethodType, functools.partial, _BUILTIN_CALLABLES, _REPR_CALLABLES))


def describe_callable(fn: Any) -> dict[str, Any]:
    """The fingerprint of a callable: a JSON-friendly mapping of everything that decides its output.

    Examples:
        >>> import functools, operator
        >>> describe_callable(functools.partial(operator.add, 2))["args"]
        [2]
        >>> def make(k):
        ...     return lambda p: p * k
        >>> describe_callable(make(2))["closure"], describe_callable(make(3))["closure"]
        ({'k': 2}, {'k': 3})
    """
    return _Describer().callable(fn, "the function")


def unfingerprintable(fingerprint: Any) -> list[str]:
    """The markers of undescribable values in a fingerprint, in order, each once."""
    return list(dict.fromkeys(_markers(fingerprint)))


def _markers(tree: Any) -> Iterator[str]:
    if isinstance(tree, str) and tree.startswith(MARKER):
        yield tree
    elif isinstance(tree, (dict, list, tuple)):
        for v in tree.values() if isinstance(tree, dict) else tree:
            yield from _markers(v)


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    return f"{module}.{qual}"


def _json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, default=str)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class _Describer:
    """One fingerprint computation; ``active`` holds the ids of what is being described (cycles)."""

    def __init__(self) -> None:
        self.active: set[int] = set()

    def callable(self, fn: Any, where: str) -> Any:
        if id(fn) in self.active:
            return f"<recursive: {_qualname(fn)}>"
        self.active.add(id(fn))
        try:
            return self._callable(fn, where)
        finally:
            self.active.discard(id(fn))

    def _callable(self, fn: Any, where: str) -> Any:
        if isinstance(fn, functools.partial):
            keywords = sorted(fn.keywords.items())
            return {
                "partial": self.callable(fn.func, f"the function of the partial in {where}"),
                "args": [self.slot(a, f"partial argument {i} in {where}") for i, a in enumerate(fn.args)],
                "keywords": {str(k): self.slot(v, f"partial keyword {k!r} in {where}") for k, v in keywords},
            }
        if isinstance(fn, types.MethodType):
            instance = self.slot(fn.__self__, f"the instance of the method in {where}")
            return {"method": self.callable(fn.__func__, where), "self": instance}
        if isinstance(fn, types.FunctionType):
            return self._function(fn, where)
        if isinstance(fn, _REPR_CALLABLES):
            return {"builtin": repr(fn)}
        if isinstance(fn, _BUILTIN_CALLABLES):
            owner = getattr(fn, "__self__", None)
            out: dict[str, Any] = {"builtin": _qualname(fn)}
            if owner is not None and not isinstance(owner, (types.ModuleType, type)):
                out["self"] = self.slot(owner, f"the instance of the method in {where}")
            return out
        if isinstance(fn, type):
            return {"class": _qualname(fn)}
        fp = getattr(fn, "fingerprint", None)
        if callable(fp):
            return {"type": _qualname(type(fn)), "fingerprint": fp()}
        if _is_record_value(fn):  # a configured callable object: its fields and its __call__
            return {"instance": self._compound(fn, where), "call": self.callable(type(fn).__call__, where)}
        return f"{MARKER}{type(fn).__qualname__} in {where}>"

    def _function(self, fn: types.FunctionType, where: str) -> dict[str, Any]:
        code = fn.__code__
        out: dict[str, Any] = {"code": code_digest(code)}
        if fn.__closure__:
            cells = {}
            for name, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    contents = cell.cell_contents
                except ValueError:
                    cells[name] = "<empty cell>"
                    continue
                cells[name] = self.slot(contents, f"closure cell {name!r}" + _of(where))
            out["closure"] = cells
        if fn.__defaults__:
            positional = code.co_varnames[: code.co_argcount]
            names = positional[len(positional) - len(fn.__defaults__) :]
            out["defaults"] = {n: self.slot(v, f"default of {n!r}" + _of(where)) for n, v in zip(names, fn.__defaults__)}
        if fn.__kwdefaults__:
            kwdefaults = sorted(fn.__kwdefaults__.items())
            out["kwdefaults"] = {n: self.slot(v, f"keyword default of {n!r}" + _of(where)) for n, v in kwdefaults}
        read = {}
        # Modules and classes are code, named by their import; loggers do not decide the output.
        skipped = (types.ModuleType, type, logging.Logger, logging.LoggerAdapter)
        for name in sorted(_global_names(code)):
            value = fn.__globals__.get(name, skipped)
            if value is not skipped and not isinstance(value, skipped):
                describe = self.callable if is_callable_value(value) else self.slot
                read[name] = describe(value, f"global {name!r}" + _of(where))
        if read:
            out["globals"] = read
        return out

    def slot(self, value: Any, where: str) -> Any:
        """A value's description; a long one (without markers) becomes its digest."""
        desc = self.value(value, where)
        if isinstance(desc, (dict, list)):
            text = _json(desc)
            if len(text) > _MAX_INLINE and MARKER not in text:
                return {"sha256": _sha(text.encode()), "type": type(value).__qualname__}
        return desc

    def value(self, value: Any, where: str) -> Any:
        if type(value) in (bool, int, float, str, type(None)):
            return value
        if isinstance(value, enum.Enum):
            return {"enum": f"{_qualname(type(value))}.{value.name}"}
        if isinstance(value, (bool, int, float, str)):
            base = next(t for t in (bool, int, float, str) if isinstance(value, t))
            return {"type": _qualname(type(value)), "value": base(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": bytes(value).hex()} if len(value) <= 64 else {"bytes_sha256": _sha(value)}
        if isinstance(value, re.Pattern):
            return {"regex": self.value(value.pattern, where), "flags": value.flags}
        if is_callable_value(value) or isinstance(value, type):
            return self.callable(value, where)
        if isinstance(value, types.ModuleType):
            return {"module": value.__name__}
        if id(value) in self.active:
            return "<recursive>"
        self.active.add(id(value))
        try:
            return self._compound(value, where)
        finally:
            self.active.discard(id(value))

    def _compound(self, value: Any, where: str) -> Any:
        if isinstance(value, (list, tuple)):
            return [self.value(v, where) for v in value]
        if isinstance(value, dict):
            return {_key(k): self.value(v, where) for k, v in value.items()}
        if isinstance(value, (set, frozenset)):
            items = [self.value(v, where) for v in value]
            return {"set": sorted(items, key=_json)}
        if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):
            if value.dtype.hasobject:
                return f"{MARKER}numpy array of objects in {where}>"
            shape = list(getattr(value, "shape", ()))
            return {"array": str(value.dtype), "shape": shape, "sha256": _sha(value.tobytes())}
        fp = getattr(value, "fingerprint", None)
        if callable(fp) and not isinstance(value, type):
            return {"type": _qualname(type(value)), "fingerprint": fp()}
        if _is_record_value(value):
            fields = {n: self.value(v, f"field {n!r} of {where}") for n, v in _fields(value)}
            return {"type": _qualname(type(value)), "fields": fields}
        return f"{MARKER}{type(value).__qualname__} in {where}>"


def _of(where: str) -> str:
    return "" if where == "the function" else f" of {where}"


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, (bool, int, float)):
        return repr(k)
    return _json(_Describer().value(k, "a dict key"))


def _is_record_value(value: Any) -> bool:
    cls = type(value)
    return attrs.has(cls) or dataclasses.is_dataclass(cls) or isinstance(value, msgspec.Struct)


def _fields(value: Any) -> list[tuple[str, Any]]:
    cls = type(value)
    if attrs.has(cls):
        return [(f.name, getattr(value, f.name)) for f in attrs.fields(cls)]
    if dataclasses.is_dataclass(cls):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    return [(n, getattr(value, n)) for n in value.__struct_fields__]


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object (and the code nested in it) looks up: globals, attributes, builtins."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def code_digest(code: types.CodeType) -> str:
    """``"source:<sha256>"`` of the code's source text, else ``"bytecode-<python>:<sha256>"`` (cached)."""
    digest = _CODE_DIGESTS.get(code)
    if digest is None:
        text = _source_text(code)
        if text is not None:
            digest = "source:" + _sha(text.encode())
        else:
            version = f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}"
            digest = f"bytecode-{version}:{bytecode_digest(code)}"
        _CODE_DIGESTS[code] = digest
    return digest


def bytecode_digest(code: types.CodeType) -> str:
    """A digest of the bytecode, constants (nested code recursively) and names: one Python version only."""
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        h.update(bytecode_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    return h.hexdigest()[:32]


def _source_text(code: types.CodeType) -> str | None:
    """The source text of a function (dedented), or of a lambda expression alone; ``None`` if unknown."""
    if code.co_name == "<lambda>":
        return _lambda_text(code)
    try:
        return textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError, IndexError):
        return None


def _lambda_text(code: types.CodeType) -> str | None:
    """The lambda's own text (``lambda p: p * 2``): among the lambdas of its file's syntax tree
    starting on its first line, the innermost whose body spans the instructions' positions."""
    filename = code.co_filename
    lines = linecache.getlines(filename)
    if not lines:
        return None
    text = "".join(lines)
    cached = _TREES.get(filename)
    if cached is None or cached[0] != text:
        try:
            tree: ast.AST | None = ast.parse(text)
        except (SyntaxError, ValueError):
            tree = None
        _TREES[filename] = cached = (text, tree)
    tree = cached[1]
    if tree is None:
        return None
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == code.co_firstlineno]
    if len(found) > 1:
        spans = [(a, c, b, d) for a, b, c, d in code.co_positions() if None not in (a, b, c, d) and (c, d) != (0, 0)]
        if not spans:
            return None
        start, end = min((a, c) for a, c, _, _ in spans), max((b, d) for _, _, b, d in spans)
        found = [
            n for n in found
            if (n.body.lineno, n.body.col_offset) <= start and end <= (n.body.end_lineno, n.body.end_col_offset)
        ]
        found = [n for n in found if not any(m is not n and _contains(n, m) for m in found)]  # the innermost
    if len(found) != 1:
        return None
    return ast.get_source_segment(text, found[0])


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    """Whether ``inner``'s span lies within ``outer``'s (a lambda nested in another lambda)."""
    starts = (outer.lineno, outer.col_offset) <= (inner.lineno, inner.col_offset)
    return starts and (inner.end_lineno, inner.end_col_offset) <= (outer.end_lineno, outer.end_col_offset)
