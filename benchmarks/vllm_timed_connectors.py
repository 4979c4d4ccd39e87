"""The connectors bench_vllm.py runs, each timed where the engine waits for it (benchmark
instrumentation only, loaded into the engine processes by module path).

Why: a hit's TTFT mixes the connector's work with the engine's (the tail's prefill, the
first token, scheduling), and on a shared 2-core machine the engine's part drifts by tens of
milliseconds between runs. The time the engine spends inside a connector's calls on its
critical path separates the two: ``start_load_kv`` + ``wait_for_layer_load`` (the load: on
the CPU every connector here loads synchronously before or during the forward pass),
``save_kv_layer`` + ``wait_for_save`` (the save) and ``get_num_new_matched_tokens`` (the
scheduler's lookup). Each call's start (CLOCK_MONOTONIC, shared by the machine's processes)
and duration go as one line to the file named by ``KVWIRE_BENCH_STEPS``; the benchmark
assigns them to requests by the driver's per-prompt spans. The subclasses change nothing
else: every method is the connector's own.
"""

from __future__ import annotations

import os
import threading
import time

TIMED = ("get_num_new_matched_tokens", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
_lock = threading.Lock()


def _record(name: str, start: float, seconds: float) -> None:
    path = os.environ.get("KVWIRE_BENCH_STEPS")
    if path:
        with _lock, open(path, "a") as f:
            f.write(f"{name} {start:.6f} {seconds:.6f}\n")


def timed(cls: type) -> type:
    """A subclass of connector ``cls`` whose ``TIMED`` methods record their wall time."""
    ns = {}
    for name in TIMED:
        fn = getattr(cls, name)

        def call(self, *args, _fn=fn, _name=name, **kwargs):
            t = time.monotonic()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                _record(_name, t, time.monotonic() - t)

        ns[name] = call
    return type("Timed" + cls.__name__, (cls,), ns)


def __getattr__(name: str) -> type:
    """``TimedKVWireConnector``, ``TimedExampleConnector``, ``TimedLMCacheConnectorV1``: the
    connector imported only when vLLM asks for it (LMCache is optional)."""
    if name == "TimedKVWireConnector":
        from kvwire.integrations.vllm import KVWireConnector as cls
    elif name == "TimedExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector as cls
    elif name == "TimedLMCacheConnectorV1":
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1 as cls
    else:
        raise AttributeError(name)
    made = timed(cls)
    globals()[name] = made
    return made


def per_request(lines: list[str], spans: list) -> list[dict]:
    """Per driver span [start, end) (one request), the seconds of each phase: "load"
    (start_load_kv + wait_for_layer_load), "save" (save_kv_layer + wait_for_save) and
    "lookup" (get_num_new_matched_tokens) of the calls that started inside it."""
    phase = {"start_load_kv": "load", "wait_for_layer_load": "load", "save_kv_layer": "save",
             "wait_for_save": "save", "get_num_new_matched_tokens": "lookup"}
    out = [{"load": 0.0, "save": 0.0, "lookup": 0.0} for _ in spans]
    calls = sorted((float(t), name, float(s)) for name, t, s in (ln.split() for ln in lines if ln.strip()))
    for t, name, s in calls:
        for k, (a, b) in enumerate(spans):
            if a <= t < b:
                out[k][phase[name]] += s
                break
    return out
