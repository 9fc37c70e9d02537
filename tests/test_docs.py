"""The documentation's Python examples run, as a reader runs them.

Every ```python block of README.md and docs/**/*.md runs; the blocks of one page run in order,
sharing their names, as one script in a fresh temporary working directory (blocks write files
such as ``web/`` and ``tokenizer.json``). The script keeps the page's line numbers, so a traceback
points at the line of the page that failed.

A block that cannot run on its own (a fragment, a script for ``torchrun``) is marked on the line
just before its fence, with the reason:

    <!-- skip-test: a fragment: needs a torch DeviceMesh -->
    ```python

Skips are listed in ``EXPECTED_SKIPS``; adding one means adding it there.

A block may use the project's shared data by the path a reader uses from the repository root,
``../shared/...``: the working directory sits next to a link to it. Without the files it names,
such a page is skipped, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from _shared import SHARED, shared_path

ROOT = Path(__file__).resolve().parents[1]

#: (page, reason) of every block marked ``skip-test``.
EXPECTED_SKIPS = {
    ("docs/guide/distributed.md", "a fragment: needs a torch DeviceMesh and a pipeline `pipe`"),
    ("docs/guide/distributed.md", "a script for torchrun (torch.distributed process group); examples/elastic_resume.py is tested"),
    ("docs/guide/trainers.md", "a TorchTitan config module for an 8-GPU launch (importing it needs torchtitan.trainer, hence triton); examples/torchtitan_cpu.py is tested"),
}

#: Seconds one page may take; the whole file stays well under a minute on two cores.
PAGE_TIMEOUT = 120

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_SKIP = re.compile(r"^\s*<!--\s*skip-test:(?P<reason>.*?)-->\s*$")
_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")


class Block(NamedTuple):
    page: str  # path relative to the repository root
    line: int  # 1-based line of the first code line
    code: str
    skip: str | None  # the reason, for a block marked skip-test


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(path: Path, page: str) -> list[Block]:
    """The ```python blocks of the page at ``path`` (named ``page``), with their skip markers;
    malformed markers raise."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info = m["info"].strip()
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(m["fence"]) and not lines[j].strip().strip(m["fence"][0])),
            None,
        )
        if end is None:
            raise ValueError(f"{page}:{i + 1}: code fence is never closed")
        words = info.split()
        previous = lines[i - 1] if i > 0 else ""
        if words[:1] == ["python"]:
            where = f"{page}:{i + 1}"
            if words[1:]:
                raise ValueError(f"{where}: write ```python alone; to skip a block put <!-- skip-test: reason --> on the line before")
            skip = _SKIP.match(previous)
            if skip:
                reason = skip["reason"].strip()
                if not reason:
                    raise ValueError(f"{where}: <!-- skip-test: --> needs a reason")
            elif _COMMENT.match(previous):
                raise ValueError(f"{where}: unknown marker {previous.strip()!r}; to skip the block use <!-- skip-test: reason -->")
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(page, i + 2, code, reason if skip else None))
        elif _SKIP.match(previous):
            raise ValueError(f"{page}:{i}: skip-test marks a ```{info} block; only ```python blocks run")
        i = end + 1
    for n, text in enumerate(lines, 1):
        if _SKIP.match(text) and not (n < len(lines) and _FENCE.match(lines[n])):
            raise ValueError(f"{page}:{n}: a skip-test marker must be on the line just before a code fence")
    return blocks


def page_script(blocks: list[Block]) -> str:
    """The runnable blocks of one page as one script, each at its own line number."""
    out: list[str] = []
    for b in blocks:
        if b.skip is not None:
            continue
        out += [""] * (b.line - 1 - len(out))
        out += b.code.splitlines()
    return "\n".join(out) + "\n"


ALL = {rel(p): python_blocks(p, rel(p)) for p in pages()}
RUNNABLE = sorted(page for page, blocks in ALL.items() if any(b.skip is None for b in blocks))


def test_every_python_fence_is_collected():
    # A cross-check of the parser by plain counting, so that a parsing mistake cannot quietly
    # leave examples out.
    for page, blocks in ALL.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        assert len(blocks) == len(re.findall(r"^[ \t]*(```|~~~)python[ \t]*$", text, flags=re.M)), page
    assert sum(len(b) for b in ALL.values()) >= 25
    assert {"README.md", "docs/guide/quickstart.md", "docs/guide/pipeline.md"} <= set(RUNNABLE)


def test_skipped_blocks_are_a_small_known_set():
    skipped = {(b.page, b.skip) for blocks in ALL.values() for b in blocks if b.skip is not None}
    assert skipped == EXPECTED_SKIPS
    assert sum(b.skip is not None for blocks in ALL.values() for b in blocks) == len(EXPECTED_SKIPS)


def test_markers_are_checked(tmp_path):
    page = tmp_path / "page.md"
    cases = {
        "<!-- skip-test: -->\n```python\npass\n```\n": "needs a reason",
        "<!-- norun -->\n```python\npass\n```\n": "unknown marker",
        "```python no-test\npass\n```\n": "write ```python alone",
        "<!-- skip-test: why -->\n\n```python\npass\n```\n": "just before a code fence",
        "<!-- skip-test: why -->\n```bash\nls\n```\n": "only ```python blocks run",
        "```python\npass\n": "never closed",
    }
    for text, message in cases.items():
        page.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            python_blocks(page, "page.md")
    page.write_text("a\n<!-- skip-test: why -->\n```python\nx = 1\n```\n\n```python\n  y = x\n```\n~~~python\nz = 2\n~~~\n")
    blocks = python_blocks(page, "page.md")
    assert [(b.line, b.code, b.skip) for b in blocks] == [(4, "x = 1", "why"), (8, "y = x", None), (11, "z = 2", None)]
    assert page_script(blocks).splitlines() == [""] * 7 + ["y = x", "", "", "z = 2"]


def run_script(name: str, script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``script`` as ``name`` in a fresh working directory that sits beside ``shared``."""
    cwd = tmp_path / "repo"
    cwd.mkdir()
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED, target_is_directory=True)
    path = cwd / (re.sub(r"\W", "_", name) + ".py")
    path.write_text(script, encoding="utf-8")
    # This checkout's zephon first; spawned worker processes inherit the path.
    path_env = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "ZEPHON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path_env}
    return subprocess.run([sys.executable, path.name], cwd=cwd, env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT)


def test_blocks_find_shared_data_where_a_reader_does(tmp_path):
    shared_path("data", "gpt2", "tokenizer.json")
    script = "from tokenizers import Tokenizer\nprint(Tokenizer.from_file('../shared/data/gpt2/tokenizer.json').get_vocab_size())\n"
    proc = run_script("shared", script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["50257"]


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_examples_run(page, tmp_path):
    blocks = ALL[page]
    script = page_script(blocks)
    for used in re.findall(r"\.\./shared/([\w.+/-]+)", script):
        shared_path(*used.split("/"))  # skips without it, fails under CI=true
    proc = run_script(page, script, tmp_path)
    if proc.returncode != 0:
        starts = ", ".join(str(b.line) for b in blocks if b.skip is None)
        pytest.fail(
            f"the examples of {page} failed (blocks at lines {starts}; line numbers below are the page's):\n"
            f"{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}",
            pytrace=False,
        )
