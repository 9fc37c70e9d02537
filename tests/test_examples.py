"""The examples run end to end (they are part of the documentation)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name, *args, timeout=600):
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout)


def test_quickstart_runs_and_proves_resume():
    proc = run("quickstart.py", "--lanes", "2")
    assert proc.returncode == 0, proc.stderr
    assert "matches the uninterrupted run" in proc.stdout
    assert "tokens/s" in proc.stdout


@pytest.mark.integration
def test_elastic_resume_example():
    pytest.importorskip("torch")
    proc = run("elastic_resume.py", "--steps", "3", "--resume-steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("identical to the single-process run") == 2


@pytest.mark.parametrize("name", ["sft_packed.py", "sft_padded.py"])
def test_sft_examples(name):
    proc = run(name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batches" in proc.stdout
