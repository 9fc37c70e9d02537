"""The examples run end to end (they are part of the documentation)."""

import os
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


@pytest.mark.integration
def test_tiny_gpt_trains_on_two_ranks_and_resumes_on_one_bit_for_bit(tmp_path):
    pytest.importorskip("torch")
    png = tmp_path / "loss.png"
    proc = run("train_tiny_gpt.py", "--steps", "16", "--ckpt-at", "8", "--ranks", "2", "--every", "1", "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "steps 8..15 equal the uninterrupted run's bit for bit" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(16))
    resumed = [r for r in rows if len(r) == 4]
    assert [int(r[0]) for r in resumed] == list(range(8, 16)) and all(r[3] == "yes" for r in resumed)
    assert float(rows[-1][1]) < float(rows[0][1])  # it learns
    assert "tokens/s" in proc.stdout and "packing: efficiency" in proc.stdout
    assert png.stat().st_size > 0


def test_trl_sft_example_resumes_bit_for_bit():
    pytest.importorskip("torch")
    if not os.environ.get("CI"):  # CI installs trl (the test extra): there its absence is a failure
        pytest.importorskip("trl")
    proc = run("sft_trl.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "resumed from checkpoint-2: bit for bit" in proc.stdout
    assert "supervised:" in proc.stdout
