"""The package as people install it: its distribution name, metadata, version and typing marker, and a
clear refusal when the index's other ``zephon`` (DatologyAI's Zephon, same import name) shares the environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import zephon

ROOT = Path(__file__).resolve().parents[1]


def _import_zephon(extra_path: Path | None) -> subprocess.CompletedProcess:
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = "import zephon; print(zephon.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


def _fake_dist(folder: Path, name: str) -> None:
    info = folder / name
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zephon\nVersion: 0.2.0\n")
    (info / "RECORD").write_text("zephon/__init__.py,,\n")


@pytest.mark.parametrize("name", ["zephon-0.2.0.dist-info", "zephon-0.2.0-py3.11.egg-info"])
def test_another_distribution_of_the_zephon_import_name_fails_the_import_naming_it_and_the_fix(tmp_path, name):
    _fake_dist(tmp_path, name)
    result = _import_zephon(tmp_path)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and str(tmp_path / name) in result.stderr
    assert "DatologyAI's Zephon" in result.stderr and "pip uninstall -y zephon zephon-lanes" in result.stderr


def test_our_own_distribution_and_unrelated_ones_do_not_stop_the_import(tmp_path):
    for unrelated in ("zephon_lanes-0.1.0.dist-info", "zephonic-1.0.dist-info", "zephon-tools.dist-info"):
        (tmp_path / unrelated).mkdir()
    result = _import_zephon(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == zephon.__version__


def test_the_wheel_has_its_own_name_an_spdx_license_the_version_and_the_typing_marker(tmp_path):
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache")
    shutil.copytree(ROOT, source, ignore=skip, symlinks=True)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True,
    )
    assert built.returncode == 0, built.stderr
    assert "license" not in "\n".join(line for line in built.stderr.lower().splitlines() if "deprecat" in line)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "zephon-lanes" and meta["Version"] == zephon.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta.get("License") is None
    assert "zephon/py.typed" in names and f"{info}/licenses/LICENSE" in names
    assert "Typing :: Typed" in meta.get_all("Classifier")
    extras = set(meta.get_all("Provides-Extra"))
    assert {"torch", "fast", "chat", "parquet", "hf", "titan", "stateful", "lightning", "transformers", "trl", "dev"} <= extras
    assert "zephon = zephon.cli.main:main" in entry_points


def test_install_hints_name_this_distribution_never_the_other_zephon():
    hints = []
    for path in [*(ROOT / "zephon").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        hints += [(path.name, line) for line in text.splitlines() if "pip install" in line and "zephon[" in line]
    assert hints == []


def _command(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_command = _command("\n".join(line for line in ci.splitlines() if not line.startswith(("#", "set ", "cd ", "export "))))
    demo, tests = block.split("\n", 1)
    assert demo.startswith("pip install -e . && python examples/")
    assert _command(tests) == ci_command
