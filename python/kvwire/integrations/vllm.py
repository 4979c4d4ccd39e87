"""``KVWireConnector``: a vLLM (v1 connector API, 0.32) KV connector on ``kvwire.store``.

vLLM loads it by name::

    --kv-transfer-config '{"kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "file:///var/cache/kvwire", "chunk_tokens": 256}}'

Why this shape: the scheduler decides a hit from metadata alone (``KVStore.lookup``: the hit
query over the prompt's chunk keys in one round trip, then the first hit's header, checked
against this model: a foreign model never matches), and workers move whole 256-token chunk
objects that any kvwire reader can read (one file-form container per chunk, keyed by the
prefix hash chain, spec/store.md). Two requests sharing a prefix share objects, so a
document or a system prompt stored by one vLLM instance serves every other.

Scheduler side: ``get_num_new_matched_tokens`` returns the stored prefix up to the prompt's
last token, which vLLM computes (a load may end inside a block); ``build_connector_meta`` hands the workers a
``KVWireMetadata`` of loads (tokens and block ids) and saves (whole chunks that this step
completes and that were not loaded). Worker side: ``register_kv_caches`` takes vLLM's
standardised per-layer view ``[num_blocks, heads, block_size, 2 * head_dim]``; loads are
read layer by layer (``LayerPipeline``: the step's chunk objects opened with two batched
reads, then one batched read per layer, each chunk's frames and checksums verified where the
store's reply lies, and each chunk copied from there into its blocks: one copy). On devices a
loader thread stays one or two layers ahead of the forward pass and ``wait_for_layer_load``
scatters the ready layer just before its attention runs; on the CPU, whose forward pass
computes on every core the loader would take, ``start_load_kv`` loads every layer first on as
many threads as the engine computes with (``layerwise``: "auto"). A chunk that fails (missing,
evicted, corrupted, store down) reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them: a failed load costs time, never
wrong tokens (set ``kv_load_failure_policy: "recompute"``; vLLM's default fails the
request). ``save_kv_layer`` gathers each layer's slots of the chunks to save;
``wait_for_save`` stores them, skipping objects that exist.

Request identity (spec/store.md section 10): each request's ``cache_salt``, LoRA adapter
(name and a fingerprint of its files) and multimodal items (vLLM's content hashes and
placeholder ranges) are bound into its keys, as vLLM's own block hashes bind them: another
tenant, adapter or image never gets this request's KV. A request the connector cannot bind
(prompt embeddings, adapter files it cannot read) is neither looked up nor saved, counted
as ``unbindable`` and logged once per reason.

Options: ``kv_connector_extra_config``, checked by ``vllm_options.connector_options`` (the keys,
and why unknown ones are refused); what each does: docs/vllm.md, "Configuration".
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..adapters.hf_model import arch_from_config
from ..layouts import PagedLayer
from ..model.compat import LocalModel, check_compatible
from ..store import KVStore, StoreError, open_store
from ..store.auth import Keyring
from .vllm_engine import (
    compute_threads,
    engine_cores,
    engine_layout_of,
    layer_packing,
    layer_scales_of,
    model_config_json,
    platform_fp8,
)
from .vllm_identity import reason_kind, request_identity
from .vllm_options import connector_options
from .vllm_pipeline import LayerPipeline, Loader
from .vllm_plan import (
    FP8_TORCH,
    LoadSpec,
    ModelKey,
    RequestState,
    SaveSpec,
    cache_dtype_of,
    chunk_cache,
    chunks_to_save,
    layer_index,
    matched_tokens,
    place_parts,
    slots,
    stored_chunks,
    tail_to_save,
)
from .vllm_stats import ConnectorCounts, connector_stats

log = logging.getLogger("kvwire.vllm")

@dataclass
class KVWireMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step: the chunks to load into and save
    from the engine's KV cache blocks."""

    loads: list = field(default_factory=list)  # LoadSpec
    saves: list = field(default_factory=list)  # SaveSpec


class KVWireConnector(KVConnectorBase_V1):
    """vLLM's KV connector (v1) over a kvwire store: configured by ``kv_transfer_config``'s
    ``kv_connector_extra_config`` (store URL, chunk_tokens, codec, layerwise ...); the
    scheduler side looks chunks up, the worker side loads and saves them layer by layer."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.options = opts = connector_options(self._kv_transfer_config.kv_connector_extra_config, self.block_size)
        self.chunk_tokens, self.codec, self.layerwise = opts.chunk_tokens, opts.codec, opts.layerwise
        self.save_partial, self.depth, self.load_threads = opts.save_partial, opts.prefetch_layers, opts.load_threads
        self.stats_path, self.load_timeout = opts.stats_path, opts.load_timeout
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        dtype = cache_dtype_of(mc.dtype, vllm_config.cache_config.cache_dtype, platform_fp8())
        self.fp8 = dtype in FP8_TORCH  # uint8 buffers of fp8 elements with per-layer scales (KVW-SCALE-*)
        hf = mc.hf_config
        self.arch = arch_from_config(hf)
        self.key = ModelKey.of(self.arch, dtype, mc.model, chunk_tokens=self.chunk_tokens,
                               codec=self.codec, tp_rank=getattr(pc, "rank", 0) % max(1, pc.tensor_parallel_size),
                               tp_size=pc.tensor_parallel_size, config=model_config_json(mc.model),
                               fingerprint=opts.model_fingerprint)
        self.local = LocalModel(self.arch, self.key.dtype, self.key.identity, chunk_tokens=self.chunk_tokens)
        self.kv = KVStore(open_store(opts.store, **opts.store_options), auth=Keyring.load(opts.auth_key_file))
        self.store_url = self.kv.store.url  # redacted (KVW-STORE-39): it goes to the log and the stats file
        self.counts = ConnectorCounts()
        # scheduler side
        self._reqs: dict[str, RequestState] = {}
        self._pending_load: dict[str, tuple[int, int]] = {}
        self._stored: dict[str, tuple[int, bool]] = {}  # request -> stored_chunks of its lookup
        self._idents: dict = {}  # req_id -> RequestIdentity (KVW-IDENT-7); absent: unbindable or unseen
        self._unbound_logged: set[str] = set()
        # worker side
        self._layers: dict[str, Any] = {}
        self._order: list[str] = []
        self._index: dict[str, int] = {}
        self.engine_layout = None
        self._packing: list[tuple] = []  # per layer (packing, cpu_isa): kvwire.layouts' gather_slots arguments
        self._paged: list[PagedLayer] = []  # per layer, the paged view slots are copied with
        self._plans: dict[str, dict] = {}  # per request loading this step: each part's SlotPlan (same in every layer)
        self._pipe: LayerPipeline | None = None
        self._loader: Loader | None = None  # the loader threads, started with the KV buffers
        self._ahead = True  # layer-wise (resolved from layerwise when the KV buffers are known)
        self._on_cpu = False  # the KV buffers are in host memory (known with them)
        self._piped: list = []  # the LoadSpecs the pipeline is reading
        self._gathered: dict[str, dict[int, dict]] = {}
        self._load_errors: set[int] = set()
        log.info("kvwire connector (%s): store %s, chunks of %d tokens, codec %s, key root %s", role, self.store_url,
                 self.chunk_tokens, self.codec, self.key.space.root)

    # == scheduler side =========================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        identity, why = request_identity(request)
        if identity is None:  # KVW-IDENT-1: neither loaded nor saved
            assert why is not None  # request_identity says why
            self._idents.pop(request.request_id, None)
            self._pending_load.pop(request.request_id, None)
            self.counts.add("unbindable")
            if reason_kind(why) not in self._unbound_logged:
                self._unbound_logged.add(reason_kind(why))
                log.warning("kvwire: request %s not looked up or saved: its identity cannot be bound: %s",
                            request.request_id, why)
            self._write_stats(True)
            return 0, False
        self._idents[request.request_id] = identity
        prompt = list(request.prompt_token_ids or [])
        self.counts.add("lookups")
        try:
            hit = self.kv.lookup(prompt, self.key.space, local=None if self.fp8 else self.local,
                                 partial=self.save_partial, identity=identity)
            if self.fp8 and hit.header is not None:  # the scheduler holds no attention layers, hence no scales:
                # it checks the rest, and the workers requantize chunks stored with other scales (KVW-SCALE-7)
                if not check_compatible(hit.header, replace(self.local, kv_scales=hit.header.kv_scales)):
                    hit = replace(hit, chunks=0, tokens=0)
        except StoreError as exc:  # the store is down: no hit, vLLM computes
            self.counts.add("lookup_errors")
            log.warning("kvwire lookup failed, treating as a miss: %s", exc)
            self._write_stats(True)
            return 0, False
        self._stored[request.request_id] = stored_chunks(hit.tokens, len(prompt), self.chunk_tokens)
        n = matched_tokens(hit.tokens, len(prompt), num_computed_tokens, self.block_size)
        if n:
            self._pending_load[request.request_id] = (num_computed_tokens, num_computed_tokens + n)
        else:
            self._pending_load.pop(request.request_id, None)
        self._write_stats(True)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens == 0:
            self._pending_load.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, C = KVWireMetadata(), self.chunk_tokens
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending_load.pop(new.req_id, None)
            stored = self._stored.pop(new.req_id, (0, False))
            if new.req_id not in self._idents:
                continue  # unbindable (KVW-IDENT-1): no state, so never loaded or saved
            prompt = list(new.prompt_token_ids or [])
            st = RequestState(prompt, list(new.block_ids[0]), identity=self._idents[new.req_id], stored=stored[0],
                              tail_stored=stored[1])
            self._reqs[new.req_id] = st
            if load is not None:
                start, stop = load
                meta.loads.append(LoadSpec(new.req_id, prompt[:-(-stop // C) * C], start, stop, st.block_ids,
                                           st.identity))
                self.counts.add("matched_tokens", stop - start)
                st.saved = stop // C  # chunks that came from the store are there already
                st.tail_saved = stop > len(prompt) // C * C  # the load used the stored partial chunk
            self._plan_save(meta, st, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            cst = self._reqs.get(req_id)
            if cst is None:
                continue
            ids = cached.new_block_ids[i]
            if ids is not None:
                cst.block_ids = list(ids[0]) if req_id in cached.resumed_req_ids else cst.block_ids + list(ids[0])
            done = cached.num_computed_tokens[i]
            if done < cst.saved * C or (cst.tail_saved and done < len(cst.prompt)):
                cst.saved = min(cst.saved, done // C)  # vLLM rolled back to recompute blocks a load failed on:
                cst.stored = min(cst.stored, cst.saved)  # save them again (a bad object was deleted)
                cst.tail_saved = cst.tail_stored = False
            self._plan_save(meta, cst, req_id, done + scheduler_output.num_scheduled_tokens[req_id])
        self._write_stats(bool(meta.loads))  # matched_tokens counts the loads planned here
        return meta

    def _plan_save(self, meta, st: RequestState, req_id: str, computed_after: int) -> None:
        C = self.chunk_tokens
        span = chunks_to_save(st, computed_after, C)
        tail = tail_to_save(st, computed_after, C) if self.save_partial else None
        if tail is not None:
            first = span[0] if span is not None else tail
            meta.saves.append(SaveSpec(req_id, list(st.prompt), first, tail + 1, list(st.block_ids), partial=True,
                                       identity=st.identity))
        elif span is not None:
            first = span[0]
            meta.saves.append(SaveSpec(req_id, st.prompt[:span[1] * C], first, span[1], list(st.block_ids),
                                       identity=st.identity))

    def request_finished(self, request, block_ids):
        self._reqs.pop(request.request_id, None)
        self._pending_load.pop(request.request_id, None)
        self._stored.pop(request.request_id, None)
        self._idents.pop(request.request_id, None)
        return False, None

    # == worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict):
        self._layers = dict(kv_caches)
        self._order = sorted(kv_caches, key=layer_index)
        self._index = {name: i for i, name in enumerate(self._order)}
        if len(self._order) != self.arch.num_layers:
            raise ValueError(f"vLLM handed {len(self._order)} attention layers, the model config has "
                             f"{self.arch.num_layers}")
        for i, name in enumerate(self._order):
            t, spec = kv_caches[name], self.arch.layers[i]
            want_c = spec.head_dim_k if spec.kind == "mla_latent" else spec.head_dim_k + spec.head_dim_v
            if t.dim() != 4 or t.shape[2] != self.block_size or t.shape[3] != want_c or t.shape[1] != spec.num_kv_heads:
                raise ValueError(f"{name}: KV buffer {tuple(t.shape)} is not vLLM 0.32's [blocks, {spec.num_kv_heads} "
                                 f"heads, {self.block_size} tokens, {want_c} channels] view")
        self._packing = [layer_packing(self._vllm_config, name, spec, self.block_size)
                         for name, spec in zip(self._order, self.arch.layers)]
        self._paged = [PagedLayer(kv_caches[name], spec.head_dim_k, *packing)  # views worked out once
                       for name, spec, packing in zip(self._order, self.arch.layers, self._packing)]
        self.engine_layout = engine_layout_of(self._vllm_config, self._order, [kv_caches[n] for n in self._order],
                                              self.arch, self.block_size)
        self._on_cpu = on_cpu = next(iter(self._layers.values())).device.type == "cpu"
        # "auto": layer-wise on devices; on the CPU every layer before the forward pass, whose kernels use every
        # core a loader thread would compete for (docs/vllm.md: 1K hits 15-20% slower with the loader)
        self._ahead = self.layerwise if self.layerwise != "auto" else not on_cpu
        # inline loads run while the forward pass waits: on every core the engine computes on (engine_cores; a
        # thread started here would inherit the main thread's one core under vLLM's CPU thread binding)
        cores = None if self._ahead else engine_cores()
        threads = self.load_threads if self.load_threads != "auto" else 1 if self._ahead else compute_threads(cores)
        self._loader = Loader(threads=threads, cores=cores)

    def _scales(self):
        """The per-layer (k_scale, v_scale) of an fp8 cache (None otherwise), read when used:
        vLLM may compute them at the first forward pass."""
        return layer_scales_of(self._vllm_config, self._order, self.arch) if self.fp8 else None

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        C = self.chunk_tokens
        self._piped = specs = list(meta.loads)
        loads = [(s.req_id, s.tokens, -(-s.stop // C), s.identity) for s in specs]
        place = (lambda i, got: self._place(i, specs, got)) if self._on_cpu or not self._ahead else None
        # layer-wise: a loader thread reads a layer or two ahead of the forward pass (places them itself on the
        # CPU); otherwise every layer is read and placed here, on the loader's threads, before the forward pass
        self._pipe = LayerPipeline(self.kv, self.key.space, loads, self.arch.num_layers, depth=self.depth,
                                   timeout=self.load_timeout, kv_scales=self._scales(), executor=self._loader,
                                   place=place, inline=not self._ahead)
        if not self._ahead:
            self._finish_loads()

    def _loaded(self, spec: LoadSpec, served: int) -> None:
        """Count a load that put tokens [start, served) in place; vLLM recomputes the rest."""
        served = min(served, spec.stop)
        if served > spec.start:
            self.counts.add("loaded_tokens", served - spec.start)
        if served < spec.stop:  # vLLM recomputes these blocks (kv_load_failure_policy "recompute")
            first = max(served, spec.start) // self.block_size
            self._load_errors.update(spec.block_ids[first:-(-spec.stop // self.block_size)])
            self.counts.add("load_failed_tokens", spec.stop - max(served, spec.start))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pipe is None:
            return  # no load this step, or every load completed in start_load_kv
        i = self._index[layer_name]
        try:
            got = self._pipe.wait(i)
            if self._pipe.place is None:
                self._place(i, self._piped, got)
        finally:
            self._pipe.done(i)

    def _place(self, i: int, specs: list, got: list) -> None:
        """Layer ``i`` of each load (its parts, or None) into the paged buffer, from the
        load's first token to the tokens it served, straight from the store's bytes."""
        for spec, parts in zip(specs, got):
            place_parts(self._paged[i], parts, spec.block_ids, self.block_size, spec.start, spec.stop,
                        self._plans.setdefault(spec.req_id, {}))

    def _finish_loads(self) -> None:
        """After the forward pass: the tokens every layer got, and load errors for the rest."""
        if self._pipe is None:
            return
        pipe, self._pipe = self._pipe, None
        self._plans = {}
        self.counts.add("rescaled_loads", pipe.rescaled)
        for spec, served in zip(self._piped, pipe.close()):
            self._loaded(spec, served)
        self._piped = []
        self._write_stats(True)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        i = self._index[layer_name]
        C = self.chunk_tokens
        paged = self._paged[i] if kv_layer is self._layers[layer_name] else \
            PagedLayer(kv_layer, self.arch.layers[i].head_dim_k, *self._packing[i])
        for spec in meta.saves:
            ids = slots(spec.block_ids, self.block_size, *spec.token_range(C))
            self._gathered.setdefault(spec.req_id, {})[i] = paged.gather(ids)

    def wait_for_save(self):
        self._finish_loads()
        meta = self._get_connector_metadata()
        C = self.chunk_tokens
        for spec in meta.saves:
            layers = self._gathered.pop(spec.req_id, {})
            if len(layers) != self.arch.num_layers:
                continue  # no forward ran for it this step
            a, b = spec.token_range(C)
            cache = chunk_cache(self.key, [layers[i] for i in range(self.arch.num_layers)], a, b - a,
                                self.engine_layout, self._scales())
            try:
                res = self.kv.put_cache(cache, spec.tokens, codec=self.codec, tp_rank=self.key.space.tp_rank,
                                        tp_size=self.key.space.tp_size, partial=spec.partial, identity=spec.identity)
                self.counts.add(saved_chunks=res.written, skipped_chunks=res.skipped)
            except StoreError as exc:  # a lost save is a later miss, never an error for the request
                self.counts.add("save_errors")
                log.warning("kvwire save of %s failed: %s", spec.req_id, exc)
        self._gathered.clear()
        self._write_stats(bool(meta.saves))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # == stats ==================================================================================
    def stats(self) -> dict:
        return connector_stats(self.counts, self.kv, self.store_url)

    def _write_stats(self, changed: bool) -> None:
        if not (changed and self.stats_path):
            return
        path = f"{self.stats_path}.{self.role.name.lower()}.json"  # the scheduler's and the worker's counters
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f, default=str)
        os.replace(tmp, path)

    def shutdown(self):
        self._write_stats(True)
        self.kv.store.close()


__all__ = ["KVWireConnector", "KVWireMetadata", "KVConnectorRole"]
