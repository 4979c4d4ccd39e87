"""``kvwire demo``: the end-to-end story (prefill, save, a fresh process checks, loads and
continues with identical tokens), its fallback without torch/transformers, and the
synthetic demo."""

import json
import subprocess
import sys

import pytest

from kvwire.tools.cli import main


@pytest.mark.slow
def test_end_to_end_demo_continues_identically_in_a_fresh_process(capsys):
    assert main(["demo", "--layers", "2", "--tokens", "48", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "prefill of 48 tokens" in out
    assert "fresh process (pid " in out
    assert "verdict exact" in out
    assert "a model with other weights (seed 1) would get: incompatible (weights:" in out
    assert "ms saved" in out and "recomputing the prefill takes" in out
    produced = next(line for line in out.splitlines() if "producer continues:" in line).split(":", 1)[1]
    received = next(line for line in out.splitlines() if "receiver continues:" in line).split(":", 1)[1]
    assert produced == received and len(json.loads(produced)) == 5  # the first token + 4 generated
    assert "identical tokens: True (and equal to recomputing the prefill: True)" in out


def test_synthetic_demo_needs_only_the_core(capsys):
    assert main(["demo", "--synthetic", "--layers", "2", "--tokens", "300"]) == 0
    out = capsys.readouterr().out
    assert "round trip bit-exact: True" in out and "chunk view shares the mapping: True" in out


@pytest.mark.slow
def test_without_transformers_the_demo_says_how_to_install_and_falls_back():
    code = ("import sys; sys.modules['transformers'] = None; from kvwire.tools.cli import main; "
            "sys.exit(main(['demo', '--layers', '1', '--tokens', '64']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in p.stdout
    assert "round trip bit-exact: True" in p.stdout
