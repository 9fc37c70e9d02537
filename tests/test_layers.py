"""The package's layers: each folder imports only the folders below it, and no module imports itself back.

The layers, from the bottom: ``training`` (payload fields, the training-tensor spec and its
conversion: it reads a batch's records by their attributes and imports nothing else of zephon),
``core`` (records, keys, the operator protocol and chain, state encoding, atomic writes, caches,
logging), ``text`` (tokenizers and chat templates), ``sources`` (datasets, formats, work
sources, mixtures, calibration), ``ops`` (the operators), ``runtime`` (lanes, executors, loader,
checkpoints, stats), ``integrations`` (torch, torchtitan), ``pipeline`` (the ``Pipeline`` value,
config files, explain, plans) and ``cli``. The package root's modules (``zephon``, ``zephon.io``,
``zephon.work``, ``zephon.plan``, ...) are public faces that re-export from the layers; no layer
imports them. Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zephon

LAYERS = ("training", "core", "text", "sources", "ops", "runtime", "integrations", "pipeline", "cli")
PACKAGE = Path(zephon.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exists(name: str) -> bool:
    base = PACKAGE.parent / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports(path: Path) -> set[str]:
    """The zephon modules ``path`` imports (a ``from package import module`` counts the module)."""
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module or ""
            for name in [base, *(f"{base}.{a.name}" for a in node.names)]:
                if name.startswith("zephon") and exists(name) and name.split(".")[-1] not in LAYERS:
                    out.add(name)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("zephon.") and exists(a.name))
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) - {module_name(p)} for p in PACKAGE.rglob("*.py")}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_layer_or_is_a_public_face():
    faces = {"zephon", "zephon.__main__", "zephon.chat", "zephon.compat", "zephon.io", "zephon.ledger", "zephon.integrations", "zephon.plan", "zephon.testing", "zephon.types", "zephon.work"}
    loose = sorted(m for m in graph() if layer(m) is None and m not in faces)
    assert not loose, f"modules outside the layers: {loose}"


def test_no_layer_imports_a_layer_above_it_or_a_public_face():
    wrong = []
    for name, targets in graph().items():
        here = layer(name)
        if here is None:
            continue
        for target in targets:
            there = layer(target)
            if there is None and target != "zephon":
                wrong.append(f"{name} -> {target} (a public face)")
            elif there is not None and LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_package_has_no_import_cycles():
    g = graph()
    cycles = []

    def visit(node, stack, done):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(g.get(node, ())):
            if nxt != "zephon":  # the package root loads its names lazily, on first use
                visit(nxt, stack + [node], done)
        done.add(node)

    done: set = set()
    for node in sorted(g):
        visit(node, [], done)
    assert not cycles, f"import cycles: {cycles[:3]}"
