"""Loaded at start-up by every Python process of benchmarks/bench_vllm.py's LMCache engines (and
only those: the benchmark puts this folder on their PYTHONPATH): installs the CPU gather/scatter
of benchmarks/lmcache_cpu_bridge.py into LMCache before vLLM builds its connector."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import lmcache_cpu_bridge
    lmcache_cpu_bridge.install()
except ImportError as e:  # the benchmark checks that LMCache imports before it starts these engines
    print(f"lmcache_cpu_bridge not installed: {e}", file=sys.stderr)
