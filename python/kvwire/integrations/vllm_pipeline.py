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


def rescale_layer(arrays: dict, header, layer: int, kv_scales) -> None:
    """Requantize one layer's fp8 arrays in place from the header's scales to ``kv_scales``
    (None: 1.0), K and LATENT by k_scale, V by v_scale (crossmodel.md KVW-XM-10)."""
    src = header.kv_scales[layer] if header.kv_scales is not None else KVScale()
    dst = KVScale(*kv_scales[layer]) if kv_scales is not None else KVScale()
    for comp, x in arrays.items():
        a, b = (src.v_scale, dst.v_scale) if comp == "v" else (src.k_scale, dst.k_scale)
        if a != b:
            x[...] = rescale_fp8(x, a, b, header.dtype)


def same_scales(header, kv_scales) -> bool:
    """Does a stored chunk carry exactly the engine's fp8 scales (both None when unscaled)?"""
    if kv_scales is None:
        return header.kv_scales is None
    return header.kv_scales is not None and header.kv_scales == tuple(KVScale(k, v) for k, v in kv_scales)


class Loader(Executor):
    """One long-lived daemon thread that runs the submitted calls in order: the connector's
    loader, so no thread is started per engine step. Unlike a ThreadPoolExecutor's worker it
    never holds up the interpreter's exit (an engine that dies mid-step leaves its pipeline
    waiting for a forward pass that will not come)."""

    def __init__(self, name: str = "kvwire-layer-loads"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
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
    (the connector's one long-lived loader thread: no thread started per engine step) or,
    without one, on a thread of its own."""

    def __init__(self, kv: KVStore, space, loads, num_layers: int, *, depth: int = 2, timeout: float = 30.0,
                 kv_scales=None, executor: Executor | None = None, place=None):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth (layers read ahead) must be an int >= 1, not {depth!r}")
        self.kv, self.space, self.num_layers, self.timeout = kv, space, num_layers, timeout
        self.specs = list(loads)
        self.loads: Sequence[LayerwiseLoad | None] = [None] * len(self.specs)
        self.ready: list[list | None] = [None] * num_layers  # per layer: per load, arrays or None
        self.events = [threading.Event() for _ in range(num_layers)]
        self.slots = threading.Semaphore(depth)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.waited: set[int] = set()
        self.kv_scales = kv_scales  # the engine's fp8 scales: objects stored with others are requantized
        self.rescaled = 0  # loads whose objects carried other scales (KVW-SCALE-7)
        self.place = place  # place(layer, per-load arrays or None) in the loader thread; None: the caller places
        self.placing = threading.Lock()  # held while placing: stopping waits for a placement under way
        self.thread: threading.Thread | None = None
        self.future: Future | None = None
        if executor is not None:
            self.future = executor.submit(self._run)
        else:
            self.thread = threading.Thread(target=self._run, name="kvwire-layer-loads", daemon=True)
            self.thread.start()

    def running(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the loads to end; True when they still run."""
        if self.future is not None:
            return not wait_for([self.future], timeout).done
        assert self.thread is not None
        self.thread.join(timeout)
        return self.thread.is_alive()

    def _run(self) -> None:
        try:
            loads = [LayerwiseLoad(self.kv, s[1], self.space, s[2], identity=s[3] if len(s) > 3 else None)
                     for s in self.specs]
            self.loads = loads
            # KVW-SCALE-7: fp8 elements mean something only with their scales; a request's objects share one
            # set (KVStore refuses to join others), so a load whose first object's differ is requantized
            convert = [x.header is not None and not same_scales(x.header, self.kv_scales) for x in loads]
            self.rescaled = sum(convert)
            live = [x for x in loads if x.header is not None]
            for layer in range(self.num_layers):
                while not self.slots.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                fetch_layer(live, layer)
                got = [x.decode(layer) if x.header is not None and x.served else None for x in loads]
                for x, arrays, c in zip(loads, got, convert):
                    if c and arrays is not None:
                        rescale_layer(arrays, x.header, layer, self.kv_scales)
                self.ready[layer] = got
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

    def wait(self, layer: int) -> list:
        """Per load, {component: [heads, tokens, dim]} of ``layer`` (the served tokens from
        0) or None; call ``done(layer)`` after using it."""
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

    def close(self) -> list[int]:
        """Stop the thread; per load, the tokens every layer holds (0 after an error, or when
        a layer was never waited for: its attention ran without it)."""
        self.halt()
        if self.running(self.timeout) or self.error is not None or len(self.waited) < self.num_layers:
            return [0] * len(self.specs)
        return [0 if x is None or x.header is None else min(x.served, x.tokens) for x in self.loads]


__all__ = ["LayerPipeline", "Loader", "rescale_layer", "same_scales"]
