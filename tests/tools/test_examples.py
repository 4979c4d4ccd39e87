"""Every script in examples/ runs as its docstring says and shows what it claims: run as a user would, in a subprocess from the repository root, with small sizes.

Why: examples that are not run rot first. Each test checks the example's own verdict
(exit status) and the figures it prints, so an example that silently stops doing what it
shows fails here. The Redis variant of the store example runs against a real
redis-server (tests/redisfix.py, the session server of conftest.py); the vLLM connector
example runs real vLLM engines from .venv-vllm (marker ``vllm``, like test_vllm_e2e.py).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
TESTED = {"layerwise_producer.py", "stream_two_processes.py", "shared_store.py", "hf_save_continue.py",
          "conformance_adapter.py", "vllm_connector.py"}


def run(*args, python=sys.executable, timeout=300, env=None, cwd=REPO):
    p = subprocess.run([python, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                       env=env)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


def test_every_example_is_tested_and_says_what_it_shows_and_how_to_run_it():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == TESTED, f"an example without a test (or a test without its example): {scripts ^ TESTED}"
    for name in sorted(scripts):
        doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
        assert doc and "What it shows" in doc and f"examples/{name}" in doc, name


@pytest.mark.slow
def test_layerwise_producer_builds_a_header_and_encodes_layer_by_layer(tmp_path):
    out = run(EXAMPLES / "layerwise_producer.py", "--layers", 3, "--tokens", 300, "--codec", "zstd",
              "--out", tmp_path / "p.kvw")
    sent = [int(m) for m in re.findall(r"layer \d sent \((\d+) bytes so far\)", out)]
    assert len(sent) == 3 and sent == sorted(set(sent))  # bytes leave after every layer, not at the end
    assert "300 tokens x 3 layers, model example/tiny-llama, bit-exact: True" in out


@pytest.mark.slow
def test_stream_between_two_processes_delivers_every_layer_identically():
    out = run(EXAMPLES / "stream_two_processes.py", "--layers", 4, "--tokens", 300, "--codec", "zstd")
    times = [float(t) for t in re.findall(r"layer \d usable after ([\d.]+) ms", out)]
    assert len(times) == 4 and times == sorted(times)
    assert "every layer identical: True" in out


@pytest.mark.slow
def test_shared_store_file_backend_serves_the_prefix_to_a_second_process(tmp_path):
    out = run(EXAMPLES / "shared_store.py", "--url", f"file://{tmp_path}/kv", "--tokens", 600)
    assert "2 chunk objects written" in out
    assert "2 chunks hit (512 tokens), verdict exact, identical to node A's: True" in out
    assert "a model with other weights: 0 chunks" in out


def test_shared_store_redis_backend_against_a_real_server(redis_url):
    out = run(EXAMPLES / "shared_store.py", "--url", redis_url, "--tokens", 520)
    assert "2 chunk objects written at redis://" in out
    assert "2 chunks hit (512 tokens), verdict exact, identical to node A's: True" in out


@pytest.mark.slow
def test_hf_save_continue_gives_identical_tokens_in_a_fresh_process():
    pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
    out = run(EXAMPLES / "hf_save_continue.py", "--new-tokens", 4, timeout=600,
              env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "receiver (fresh process): verdict exact []" in out
    assert "identical tokens: True" in out
    assert re.search(r"a model with other weights: incompatible \(weights: differ", out)


def conformance(*impl_args, select):
    impl = " ".join([sys.executable, str(EXAMPLES / "conformance_adapter.py"), *impl_args])
    args = ["-m", "kvwire", "conformance", "run", "--impl", impl, "--levels", "reader", "-q"]
    for s in select:
        args += ["--select", s]
    p = subprocess.run([sys.executable, *args[0:]], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    return p.stdout + p.stderr


@pytest.mark.slow
def test_conformance_adapter_passes_the_reader_level_on_gold_vectors():
    out = conformance(select=["dtype-bf16", "pre6-header-checksum", "file3-index-checksum"])
    assert re.search(r"reader\s+pass.* 3/3 passed", out), out
    assert "RESULT: PASS" in out


@pytest.mark.slow
def test_conformance_kit_catches_a_broken_adapter():
    out = conformance("--bug", "accept-all", select=["pre6-header-checksum", "file3-index-checksum"])
    assert "accepted an invalid vector (expected HEADER_CHECKSUM)" in out
    assert "RESULT: FAIL" in out


@pytest.mark.vllm
def test_vllm_connector_example_loads_the_stored_prefix_in_a_second_engine():
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: `make test` builds the vLLM venv (make vllm-venv)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    out = run(EXAMPLES / "vllm_connector.py", python=str(VLLM_PY), timeout=1200, env=env)
    loaded = [int(n) for n in re.findall(r"(\d+) tokens loaded", out)]
    assert len(loaded) == 2 and min(loaded) >= 512, out
    assert "same greedy tokens as the producer: True" in out
