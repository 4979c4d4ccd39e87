"""Every benchmark script answers ``--help`` with its usage and runs nothing: a benchmark
takes minutes, starts engines and servers and rewrites benchmarks/results/, so a user
asking how to run it must not start it (bench_vllm.py once ran whole on ``--help``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


@pytest.mark.slow  # one interpreter per script, torch imported by most
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_runs_nothing(script, tmp_path):
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    p = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0 and p.stdout.lstrip().startswith("usage:"), p.stdout[-2000:] + p.stderr[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before
    assert list(tmp_path.iterdir()) == []


def test_every_benchmark_script_is_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_core.py", "bench_vllm.py", "bench_c.py", "bench_layouts_gather.py"} <= names, names
