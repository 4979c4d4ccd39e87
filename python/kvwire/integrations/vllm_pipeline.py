"""The layer pipeline of the vLLM connector: one engine step's loads read a layer ahead of
the forward pass, in a background thread.

Why: vLLM calls ``wait_for_layer_load(layer)`` as each attention layer starts. Reading
every layer before the forward pass (``start_load_kv``) makes the first layer wait for the
whole transfer; here a thread opens the step's loads (``kvwire.store.LayerwiseLoad``: two
batched reads) and then fetches and decodes layer after layer (one batched ranged read per
layer for all the step's requests, checksums verified), staying at most ``depth`` layers
ahead of the forward pass so staging memory stays ``depth`` layers. A ready layer goes into
the paged buffers (``kvwire.layouts.scatter_slots``) through ``place``: on the CPU the
loader thread places it itself before it says the layer is ready, so the engine thread only
waits (the copy leaves the forward pass's critical path); on a GPU the engine thread places
it (one index copy per component, ordered with the compute stream). Once the pipeline is
stopped (``close``, or a layer that timed out) no placement starts, and one under way has
ended: nothing is written into the engine's buffers after the connector gave up on a load.

Nothing here can hang the engine: a layer not ready within ``timeout`` seconds, an error in
the thread, or a layer the forward pass never waited for (its attention ran without it)
counts as a failed load of every token of that step, and the connector reports the blocks
to vLLM, which recomputes them. Engine-neutral (no vLLM import), so it is unit-tested
without an engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for

from ..format.kv_scales import KVScale
from ..model.rescale import rescale_fp8
from ..store import KVStore
from ..store.layerwise import LayerwiseLoad, fetch_layer

log = logging.getLogger("kvwire.vllm")


def rescale_layer(arrays: dict, header, layer: int, kv_scales) -> dict:
    """One layer's fp8 arrays requantized from the header's scales to ``kv_scales`` (None:
    1.0), K and LATENT by k_scale, V by v_scale (crossmodel.md KVW-XM-10): new arrays where
    a scale differs (the given ones may be read-only views of a store's reply)."""
    src = header.kv_scales[layer] if header.kv_scales is not None else KVScale()
    dst = KVScale(*kv_scales[layer]) if kv_scales is not None else KVScale()
    out = {}
    for comp, x in arrays.items():
        a, b = (src.v_scale, dst.v_scale) if comp == "v" else (src.k_scale, dst.k_scale)
        out[comp] = rescale_fp8(x, a, b, header.dtype) if a != b else x
    return out


def same_scales(header, kv_scales) -> bool:
    """Does a stored chunk carry exactly the engine's fp8 scales (both None when unscaled)?"""
    if kv_scales is None:
        return header.kv_scales is None
    return header.kv_scales is not None and header.kv_scales == tuple(KVScale(k, v) for k, v in kv_scales)


class Loader(Executor):
    """Long-lived daemon threads (``threads``, 1 by default) that take the submitted calls in
    order: the connector's loader, so no thread is started per engine step. Unlike a
    ThreadPoolExecutor's workers they never hold up the interpreter's exit (an engine that
    dies mid-step leaves its pipeline waiting for a forward pass that will not come)."""

    def __init__(self, name: str = "kvwire-layer-loads", threads: int = 1, cores: set[int] | None = None):
        """``cores``: the CPUs the threads may run on (None: the creating thread's, which
        they inherit)."""
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, not {threads!r}")
        self.cores = set(cores) if cores else None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._serve, name=f"{name}-{k}" if k else name, daemon=True)
                        for k in range(threads)]
        self.thread = self.threads[0]
        for t in self.threads:
            t.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
        if self.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)  # this thread only (Linux): not the engine's main thread
        while True:
            future, fn, args, kwargs = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 (handed to the future's owner)
                    future.set_exception(exc)


class LayerPipeline:
    """Loads ``[(req_id, tokens, n_chunks[, identity])]`` of ``kv`` in ``space``, layer by
    layer (``identity``: the request's ``RequestIdentity``, KVW-IDENT-4), on ``executor``
    (the connector's long-lived loader threads: no thread started per engine step) or,
    without one, on a thread of its own.

    ``inline=True``: every layer is loaded and placed before the constructor returns, the
    layers spread over the executor's threads (the schedule for CPU engines, whose forward
    pass needs every core the loader would take: ``KVWireConnector``'s ``layerwise``)."""

    def __init__(self, kv: KVStore, space, loads, num_layers: int, *, depth: int = 2, timeout: float = 30.0,
                 kv_scales=None, executor: Executor | None = None, place=None, inline: bool = False):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth (layers read ahead) must be an int >= 1, not {depth!r}")
        if inline and (executor is None or place is None):
            raise ValueError("inline=True loads on the executor's threads and places there: give executor and place")
        self.kv, self.space, self.num_layers, self.timeout = kv, space, num_layers, timeout
        self.specs = list(loads)
        self.loads: Sequence[LayerwiseLoad | None] = [None] * len(self.specs)
        self.ready: list[list | None] = [None] * num_layers  # per layer: per load, parts or None
        self.events = [threading.Event() for _ in range(num_layers)]
        self.slots = threading.Semaphore(depth)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.waited: set[int] = set()
        self.kv_scales = kv_scales  # the engine's fp8 scales: objects stored with others are requantized
        self.rescaled = 0  # loads whose objects carried other scales (KVW-SCALE-7)
        self.place = place  # place(layer, per-load parts or None) in the loader thread; None: the caller places
        self.placing = threading.Lock()  # held while placing: stopping waits for a placement under way
        self.placed = threading.Condition()  # inline: placements under way (in_place), which halt() waits out
        self.in_place = 0
        self.thread: threading.Thread | None = None
        self.future: Future | None = None
        self._convert: list[bool] = []
        if inline:
            assert executor is not None
            self._run_inline(executor)
        elif executor is not None:
            self.future = executor.submit(self._run)
        else:
            self.thread = threading.Thread(target=self._run, name="kvwire-layer-loads", daemon=True)
            self.thread.start()

    def running(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the loads to end; True when they still run."""
        if self.future is not None:
            return not wait_for([self.future], timeout).done
        if self.thread is None:
            return False  # inline: ended before the constructor returned
        self.thread.join(timeout)
        return self.thread.is_alive()

    def _open(self) -> list[LayerwiseLoad]:
        """Open every load (``self.loads``); returns those that hit."""
        loads = [LayerwiseLoad(self.kv, s[1], self.space, s[2], identity=s[3] if len(s) > 3 else None)
                 for s in self.specs]
        self.loads = loads
        # KVW-SCALE-7: fp8 elements mean something only with their scales; a request's objects share one
        # set (KVStore refuses to join others), so a load whose first object's differ is requantized
        self._convert = [x.header is not None and not same_scales(x.header, self.kv_scales) for x in loads]
        self.rescaled = sum(self._convert)
        return [x for x in loads if x.header is not None]

    def _layer(self, live: list[LayerwiseLoad], layer: int) -> list:
        """Per load, ``layer``'s parts (or None): fetched, checked, requantized if need be."""
        fetch_layer(live, layer)
        loads = [x for x in self.loads if x is not None]  # all opened by _open
        got = [x.parts(layer) if x.header is not None and x.served else None for x in loads]
        for k, (x, parts, c) in enumerate(zip(loads, got, self._convert)):
            if c and parts:
                got[k] = [(a, rescale_layer(arrays, x.header, layer, self.kv_scales)) for a, arrays in parts]
        return got

    def _run(self) -> None:
        try:
            live = self._open()
            for layer in range(self.num_layers):
                while not self.slots.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                got = self.ready[layer] = self._layer(live, layer)
                if self.place is not None:
                    with self.placing:
                        if self.stop.is_set():
                            return
                        self.place(layer, got)
                self.events[layer].set()
        except BaseException as exc:  # reported as failed loads, never raised in the engine
            self.error = exc
            log.warning("kvwire layer-wise load failed, vLLM recomputes: %r", exc)
        finally:
            for e in self.events:
                e.set()

    def _inline_layer(self, live: list, layer: int) -> None:
        got = self._layer(live, layer)
        with self.placed:  # placements run side by side; halt() waits until none is under way
            if self.stop.is_set():
                return
            self.in_place += 1
        try:
            self.place(layer, got)
        finally:
            with self.placed:
                self.in_place -= 1
                self.placed.notify_all()

    def _run_inline(self, executor: Executor) -> None:
        """Open, then load and place every layer on the executor's threads; waits for all."""
        try:
            live = self._open()
            jobs = [executor.submit(self._inline_layer, live, i) for i in range(self.num_layers)]
            if wait_for(jobs, self.timeout).not_done:
                raise TimeoutError(f"the layers were not loaded within {self.timeout:.0f} s")
            for f in jobs:
                f.result()
            self.waited = set(range(self.num_layers))
        except BaseException as exc:  # reported as failed loads, never raised in the engine
            self.halt()
            self.error = exc
            log.warning("kvwire load failed, vLLM recomputes: %r", exc)
        finally:
            for e in self.events:
                e.set()

    def wait(self, layer: int) -> list:
        """Per load, ``layer``'s parts (``LayerwiseLoad.parts``: [(first token, {component:
        [heads, tokens, dim]})], read-only views) or None; call ``done(layer)`` after using it."""
        self.waited.add(layer)
        if not self.events[layer].wait(self.timeout):
            log.warning("kvwire: layer %d not loaded within %.0f s, vLLM recomputes", layer, self.timeout)
            self.error = self.error or TimeoutError(f"layer {layer} not loaded within {self.timeout} s")
            self.halt()
        got = self.ready[layer]
        if self.error is not None or got is None:
            return [None] * len(self.specs)
        return got

    def done(self, layer: int) -> None:
        self.ready[layer] = None  # staging memory goes as soon as the layer is in place
        self.slots.release()

    def halt(self) -> None:
        """Stop: no layer is fetched or placed after this returns."""
        self.stop.set()
        with self.placing:
            pass
        with self.placed:
            self.placed.wait_for(lambda: self.in_place == 0)

    def close(self) -> list[int]:
        """Stop the thread; per load, the tokens every layer holds (0 after an error, or when
        a layer was never waited for: its attention ran without it)."""
        self.halt()
        if self.running(self.timeout) or self.error is not None or len(self.waited) < self.num_layers:
            return [0] * len(self.specs)
        return [0 if x is None or x.header is None else min(x.served, x.tokens) for x in self.loads]


__all__ = ["LayerPipeline", "Loader", "rescale_layer", "same_scales"]
