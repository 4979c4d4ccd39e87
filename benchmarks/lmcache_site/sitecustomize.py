"""Loaded at start-up by every Python process of benchmarks/bench_vllm.py's LMCache engines (and
only those: the benchmark puts this folder on their PYTHONPATH): when LMCache's
``lmcache.v1.gpu_connector`` is first imported, installs the CPU gather/scatter of
benchmarks/lmcache_cpu_bridge.py into it. Lazily: importing LMCache before vLLM has set up its
workers breaks vLLM's start-up (its kernel registry walks every loaded module)."""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "lmcache.v1.gpu_connector"


class _BridgeHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module, then run the bridge after it loads
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            import lmcache_cpu_bridge

            lmcache_cpu_bridge.install()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _BridgeHook())
