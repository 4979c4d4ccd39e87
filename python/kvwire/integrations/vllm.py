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

Scheduler side: ``get_num_new_matched_tokens`` returns the stored prefix cut to whole
blocks, leaving at least one token to compute; ``build_connector_meta`` hands the workers a
``KVWireMetadata`` of loads (tokens and block ids) and saves (whole chunks that this step
completes and that were not loaded). Worker side: ``register_kv_caches`` takes vLLM's
standardised per-layer view ``[num_blocks, heads, block_size, 2 * head_dim]``; loads are
done in ``start_load_kv`` before the forward pass (each chunk's checksums verified), and a
chunk that fails (missing, evicted, corrupted, store down) reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them: a failed load costs time, never
wrong tokens (set ``kv_load_failure_policy: "recompute"``; vLLM's default fails the
request). ``save_kv_layer`` gathers each layer's slots of the chunks to save;
``wait_for_save`` stores them, skipping objects that exist.

Extra config: ``store`` (a ``kvwire.store`` URL, default ``file://`` + a temporary
directory), ``chunk_tokens`` (256), ``codec`` ("raw"; "zstd", or a lossy preset such as
"int8"), ``timeout`` (store call timeout, seconds), ``model_fingerprint`` (hex; instead of
hashing the model's safetensors), ``stats_path`` (files ``<stats_path>.scheduler.json`` and
``<stats_path>.worker.json``, rewritten with each side's counters when they change).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)

from ..adapters.hf_model import arch_from_config
from ..model.compat import LocalModel
from ..store import KVStore, StoreError, open_store
from .vllm_plan import (
    LoadSpec, ModelKey, RequestState, SaveSpec, chunk_cache, chunks_to_save, dtype_of, gather_layer, layer_index,
    matched_tokens, scatter_layer, slots,
)

log = logging.getLogger("kvwire.vllm")


def model_config_json(model_dir: str) -> dict:
    """The model's config.json as written (its canonical JSON is the config fingerprint)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


@dataclass
class KVWireMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)  # LoadSpec
    saves: list = field(default_factory=list)  # SaveSpec


class KVWireConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = int(extra.get("chunk_tokens", 256))
        if self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a multiple of vLLM's block_size "
                             f"{self.block_size}")
        self.codec = extra.get("codec", "raw")
        url = extra.get("store") or "file://" + os.path.join(tempfile.gettempdir(), "kvwire-store")
        options = {"timeout": float(extra["timeout"])} if "timeout" in extra and not url.startswith(("file:", "memory:")) else {}
        self.store_url, self.stats_path = url, extra.get("stats_path")
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            raise ValueError(f"KVWireConnector: kv_cache_dtype={cache_dtype!r} is not supported yet (only 'auto', "
                             "the model's dtype)")
        hf = mc.hf_config
        self.arch = arch_from_config(hf)
        self.key = ModelKey.of(self.arch, dtype_of(mc.dtype), mc.model, chunk_tokens=self.chunk_tokens,
                               codec=self.codec, tp_rank=getattr(pc, "rank", 0) % max(1, pc.tensor_parallel_size),
                               tp_size=pc.tensor_parallel_size, config=model_config_json(mc.model),
                               fingerprint=extra.get("model_fingerprint"))
        self.local = LocalModel(self.arch, self.key.dtype, self.key.identity, chunk_tokens=self.chunk_tokens)
        self.kv = KVStore(open_store(url, **options))
        self.counts = dict(lookups=0, lookup_errors=0, matched_tokens=0, loaded_tokens=0, load_failed_tokens=0,
                           saved_chunks=0, save_errors=0, skipped_chunks=0)
        # scheduler side
        self._reqs: dict[str, RequestState] = {}
        self._pending_load: dict[str, tuple[int, int]] = {}
        # worker side
        self._layers: dict[str, Any] = {}
        self._order: list[str] = []
        self._gathered: dict[str, dict[int, dict]] = {}
        self._load_errors: set[int] = set()
        log.info("kvwire connector (%s): store %s, chunks of %d tokens, codec %s, key root %s", role, url,
                 self.chunk_tokens, self.codec, self.key.space.root)

    # == scheduler side =========================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        prompt = list(request.prompt_token_ids or [])
        self.counts["lookups"] += 1
        try:
            hit = self.kv.lookup(prompt, self.key.space, local=self.local)
        except StoreError as exc:  # the store is down: no hit, vLLM computes
            self.counts["lookup_errors"] += 1
            log.warning("kvwire lookup failed, treating as a miss: %s", exc)
            self._write_stats(True)
            return 0, False
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
            prompt = list(new.prompt_token_ids or [])
            st = self._reqs[new.req_id] = RequestState(prompt, list(new.block_ids[0]))
            load = self._pending_load.pop(new.req_id, None)
            if load is not None:
                start, stop = load
                meta.loads.append(LoadSpec(new.req_id, prompt[:-(-stop // C) * C], start, stop, st.block_ids))
                self.counts["matched_tokens"] += stop - start
                st.saved = stop // C  # chunks that came from the store are there already
            self._plan_save(meta, st, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            if ids is not None:
                st.block_ids = list(ids[0]) if req_id in cached.resumed_req_ids else st.block_ids + list(ids[0])
            done = cached.num_computed_tokens[i]
            if done < st.saved * C:  # vLLM rolled back to recompute blocks a load failed on: save them again
                st.saved = done // C
            self._plan_save(meta, st, req_id, done + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta, st: RequestState, req_id: str, computed_after: int) -> None:
        span = chunks_to_save(st, computed_after, self.chunk_tokens)
        if span is not None:
            meta.saves.append(SaveSpec(req_id, st.prompt[:span[1] * self.chunk_tokens], span[0], span[1],
                                       list(st.block_ids)))

    def request_finished(self, request, block_ids):
        self._reqs.pop(request.request_id, None)
        self._pending_load.pop(request.request_id, None)
        return False, None

    # == worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict):
        self._layers = dict(kv_caches)
        self._order = sorted(kv_caches, key=layer_index)
        if len(self._order) != self.arch.num_layers:
            raise ValueError(f"vLLM handed {len(self._order)} attention layers, the model config has "
                             f"{self.arch.num_layers}")
        for i, name in enumerate(self._order):
            t, spec = kv_caches[name], self.arch.layers[i]
            want_c = spec.head_dim_k if spec.kind == "mla_latent" else spec.head_dim_k + spec.head_dim_v
            if t.dim() != 4 or t.shape[2] != self.block_size or t.shape[3] != want_c or t.shape[1] != spec.num_kv_heads:
                raise ValueError(f"{name}: KV buffer {tuple(t.shape)} is not vLLM 0.32's [blocks, {spec.num_kv_heads} "
                                 f"heads, {self.block_size} tokens, {want_c} channels] view")

    def _mla(self, i: int) -> bool:
        return self.arch.layers[i].kind == "mla_latent"

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        for spec in meta.loads:
            self._load(spec)
        self._write_stats(bool(meta.loads))

    def _load(self, spec: LoadSpec) -> None:
        C = self.chunk_tokens
        try:
            got = self.kv.get_cache(spec.tokens, self.key.space, n_chunks=-(-spec.stop // C))
        except StoreError as exc:
            log.warning("kvwire load of %s failed, vLLM recomputes: %s", spec.req_id, exc)
            got = None
        served = 0 if got is None or got.cache is None else min(got.tokens, spec.stop)
        if served > spec.start:
            ids = slots(spec.block_ids, self.block_size, spec.start, served)
            for i, name in enumerate(self._order):
                layer = {c: x[:, spec.start:served] for c, x in got.cache.layers[i].items()}
                scatter_layer(self._layers[name], ids, layer, self.arch.layers[i].head_dim_k, self._mla(i))
            self.counts["loaded_tokens"] += served - spec.start
        if served < spec.stop:  # vLLM recomputes these blocks (kv_load_failure_policy "recompute")
            first = max(served, spec.start) // self.block_size
            self._load_errors.update(spec.block_ids[first:-(-spec.stop // self.block_size)])
            self.counts["load_failed_tokens"] += spec.stop - max(served, spec.start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load completes in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        i = self._order.index(layer_name)
        C = self.chunk_tokens
        for spec in meta.saves:
            ids = slots(spec.block_ids, self.block_size, spec.first * C, spec.stop * C)
            self._gathered.setdefault(spec.req_id, {})[i] = gather_layer(
                kv_layer, ids, self.arch.layers[i].head_dim_k, self._mla(i))

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        C = self.chunk_tokens
        for spec in meta.saves:
            layers = self._gathered.pop(spec.req_id, {})
            if len(layers) != self.arch.num_layers:
                continue  # no forward ran for it this step
            cache = chunk_cache(self.key, [layers[i] for i in range(self.arch.num_layers)], spec.first * C,
                                (spec.stop - spec.first) * C)
            try:
                res = self.kv.put_cache(cache, spec.tokens, codec=self.codec, tp_rank=self.key.space.tp_rank,
                                        tp_size=self.key.space.tp_size)
                self.counts["saved_chunks"] += res.written
                self.counts["skipped_chunks"] += res.skipped
            except StoreError as exc:  # a lost save is a later miss, never an error for the request
                self.counts["save_errors"] += 1
                log.warning("kvwire save of %s failed: %s", spec.req_id, exc)
        self._gathered.clear()
        self._write_stats(bool(meta.saves))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # == stats ==================================================================================
    def stats(self) -> dict:
        return {**self.counts, "store": self.kv.stats(), "store_url": self.store_url}

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
