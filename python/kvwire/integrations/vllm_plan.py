"""The engine-neutral half of the vLLM connector: which model the cache is, what to load and
save each step, and which slots of vLLM's paged buffers hold a request's tokens.

Why apart from ``vllm.py``: this half imports no vLLM, so its rules (a block-aligned match
that leaves one token to compute, chunks saved once and only when whole, slots from block
ids) are tested without an engine, and the connector class stays a thin adapter.

The copies between vLLM's paged views and kvwire's standard ``[heads, tokens, head_dim]``
layout belong to the engine layouts: ``kvwire.layouts.gather_slots`` / ``scatter_slots``,
for every packing (spec/layouts.md 3.4). Their former names here (``gather_layer``,
``scatter_layer``, ``PACKINGS``, ``check_packing``, ``cpu_vec_views``, ``cpu_amx_views``,
``AMX_ROWS``) still work for one release and warn (``DeprecationWarning``).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..cache.kvcache import KVCache
from ..deprecation import former_names
from ..format.header import Architecture, Header, ModelIdentity, TokenRange
from ..layouts import SlotPlan, scatter_slots
from ..model.identity import config_fingerprint, make_identity, weights_fingerprint
from ..store.keys import KeySpace, codec_fidelity

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}


def layer_index(name: str) -> int:
    """The model layer of a vLLM attention layer name (``model.layers.3.self_attn.attn``)."""
    m = LAYER_NAME.search(name)
    if m is None:
        raise ValueError(f"cannot tell the model layer of the attention layer {name!r} (expected '...layers.N....')")
    return int(m.group(1))


def files_digest(directory: str, patterns: tuple[str, ...]) -> bytes:
    """SHA-256 over the names and bytes of the files of ``directory`` that end with one of
    ``patterns``, in name order (empty directory part: 32 zero bytes)."""
    h, seen = hashlib.sha256(), False
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.endswith(patterns):
            seen = True
            h.update(name.encode() + b"\0")
            with open(os.path.join(directory, name), "rb") as f:
                for block in iter(lambda: f.read(8 << 20), b""):
                    h.update(block)
    return h.digest() if seen else bytes(32)


def model_weights_fingerprint(directory: str) -> bytes:
    """``weights_fingerprint`` (crossmodel.md) of the safetensors files of a model directory:
    the named tensors, read through safetensors' memory map."""
    from safetensors import safe_open

    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{directory}: no *.safetensors weights to fingerprint; give the connector "
                         "kv_connector_extra_config['model_fingerprint'] (hex) instead")
    opened = [safe_open(os.path.join(directory, n), framework="pt") for n in names]
    named = sorted(((k, f) for f in opened for k in f.keys()), key=lambda kf: kf[0])  # a name in two shards: ValueError
    return weights_fingerprint((k, f.get_tensor(k)) for k, f in named)


@dataclass(frozen=True)
class ModelKey:
    """Everything the store keys and checks bind for one vLLM model and shard."""

    arch: Architecture
    dtype: str
    identity: ModelIdentity
    space: KeySpace

    @classmethod
    def of(cls, arch: Architecture, dtype: str, model_dir: str, *, chunk_tokens: int, codec: str = "raw",
           tp_rank: int = 0, tp_size: int = 1, config: dict | None = None, fingerprint: str | None = None):
        tokenizer = files_digest(model_dir, ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                             "vocab.json", "merges.txt"))
        weights = bytes.fromhex(fingerprint) if fingerprint else model_weights_fingerprint(model_dir)
        ident = make_identity(arch, dtype, tokenizer=tokenizer, weights=weights,
                              config=config_fingerprint(config or {}))
        space = KeySpace(ident.compat_fingerprint, dtype, chunk_tokens, (0, arch.num_layers), tp_rank, tp_size,
                         codec_fidelity(codec))
        return cls(arch, dtype, ident, space)


# -- scheduler bookkeeping -------------------------------------------------------------------

@dataclass
class LoadSpec:
    """Load tokens [start, stop) of ``tokens`` (the prompt up to the last stored chunk the
    load needs) into the request's blocks."""

    req_id: str
    tokens: list
    start: int
    stop: int
    block_ids: list
    identity: object = None  # the request's kvwire.store.RequestIdentity (KVW-IDENT-7)


@dataclass
class SaveSpec:
    """Save chunks [first, stop) (of ``chunk_tokens``) of ``tokens`` from the blocks: whole
    chunks, and with ``partial`` the prompt's trailing partial chunk as the last one
    (``tokens`` is then the whole prompt)."""

    req_id: str
    tokens: list
    first: int
    stop: int
    block_ids: list
    partial: bool = False
    identity: object = None  # the request's kvwire.store.RequestIdentity (KVW-IDENT-7)

    def token_range(self, chunk_tokens: int) -> tuple[int, int]:
        return self.first * chunk_tokens, min(self.stop * chunk_tokens, len(self.tokens))


@dataclass
class RequestState:
    prompt: list
    block_ids: list = field(default_factory=list)
    saved: int = 0  # chunks already saved, loaded or planned
    tail_saved: bool = False  # the trailing partial chunk: saved, loaded or planned
    stored: int = 0  # leading chunks the lookup found in the store: never gathered to be saved again
    tail_stored: bool = False  # the lookup found the trailing partial chunk too
    identity: object = None  # kvwire.store.RequestIdentity


def matched_tokens(hit_tokens: int, prompt_len: int, num_computed: int, block_size: int) -> int:
    """Tokens the connector offers beyond the ``num_computed`` vLLM already has: the stored
    prefix, cut to leave exactly one prompt token to compute (vLLM must run the last one to
    sample). Not cut to whole blocks (``block_size`` is not used any more): vLLM's scheduler
    takes a load that ends inside a block and computes only what follows, where cutting to
    whole blocks made every hit recompute up to a block of tokens (32 here: on the CPU about
    half of a 4K-token hit's engine time, measured in bench_vllm)."""
    del block_size
    return max(0, min(hit_tokens, prompt_len - 1) - num_computed)


def stored_chunks(hit_tokens: int, prompt_len: int, chunk_tokens: int) -> tuple[int, bool]:
    """(leading whole chunks, trailing partial chunk) of a prompt that a lookup found
    stored: a request that recomputes part of them (vLLM computes at least the last prompt
    token) does not gather them from every layer to have the store skip them as existing."""
    covered = min(hit_tokens, prompt_len)
    return covered // chunk_tokens, prompt_len % chunk_tokens != 0 and covered == prompt_len


def chunks_to_save(state: RequestState, computed_after: int, chunk_tokens: int) -> tuple[int, int] | None:
    """The chunks [first, stop) of the prompt that are whole once ``computed_after`` tokens
    are computed and were not saved yet (the prompt's partial last chunk never is)."""
    stop = min(computed_after, len(state.prompt)) // chunk_tokens
    if stop <= state.saved:
        return None
    first, state.saved = max(state.saved, min(state.stored, stop)), stop
    return (first, stop) if first < stop else None


def tail_to_save(state: RequestState, computed_after: int, chunk_tokens: int) -> int | None:
    """The chunk index of the prompt's trailing partial chunk once the whole prompt is
    computed and every whole chunk before it is saved (``chunks_to_save`` first), once; None
    when the prompt has no partial chunk or it is done (KVW-STORE-11, "partial")."""
    n = len(state.prompt)
    if n % chunk_tokens == 0 or state.tail_saved or computed_after < n or state.saved < n // chunk_tokens:
        return None
    if state.tail_stored:  # found by the lookup: there already
        state.tail_saved = True
        return None
    state.tail_saved = True
    return n // chunk_tokens


def slots(block_ids, block_size: int, start: int, stop: int) -> np.ndarray:
    """The paged slots (block * block_size + offset) of tokens [start, stop)."""
    t = np.arange(start, stop, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    if stop > len(blocks) * block_size:
        raise ValueError(f"tokens up to {stop} need {-(-stop // block_size)} blocks, the request has {len(blocks)}")
    return blocks[t // block_size] * block_size + t % block_size


def place_parts(layer, parts, block_ids, block_size: int, start: int, stop: int, plans: dict | None = None) -> int:
    """Scatter tokens [start, stop) of one layer's ``parts`` (``LayerwiseLoad.parts``:
    [(first token, {component: [heads, tokens, dim]})], or None) into the request's blocks
    of ``layer`` (a ``kvwire.layouts.PagedLayer``), each part straight from its memory;
    ``plans`` (kept by the caller for a load's layers) holds each part's ``SlotPlan``.
    Returns the tokens placed."""
    placed = 0
    plans = {} if plans is None else plans
    for a, arrays in parts or ():
        lo, hi = max(a, start), min(a + next(iter(arrays.values())).shape[1], stop)
        if hi > lo:
            if (lo, hi) not in plans:  # the same slots in every layer
                plans[lo, hi] = SlotPlan(slots(block_ids, block_size, lo, hi), block_size)
            layer.scatter(plans[lo, hi], {c: x[:, lo - a:hi - a] for c, x in arrays.items()})
            placed += hi - lo
    return placed


def chunk_cache(key: ModelKey, layers: list, first_token: int, count: int, engine_layout=None,
                kv_scales=None) -> KVCache:
    """A KVCache of tokens [first_token, first_token + count) from gathered layers
    (``engine_layout``: the ``EngineLayout`` they were gathered from, informational;
    ``kv_scales``: an fp8 cache's per-layer (k_scale, v_scale), kvwire-v1.md KVW-SCALE-*).
    Gathered uint8 tensors of an fp8 cache are viewed as its fp8 dtype."""
    h = Header(arch=key.arch, token_count=count, dtype=key.dtype, first_position=first_token,
               layer_tokens=tuple(TokenRange(first_token, count) for _ in range(key.arch.num_layers)),
               chunk_tokens=key.space.chunk_tokens, model=key.identity, engine_layout=engine_layout,
               kv_scales=kv_scales)
    if key.dtype in FP8_TORCH:
        import torch

        fp8 = getattr(torch, FP8_TORCH[key.dtype])
        layers = [{c: x.view(fp8) if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 else x
                   for c, x in layer.items()} for layer in layers]
    return KVCache(h, layers)


def dtype_of(torch_dtype_obj) -> str:
    name = str(torch_dtype_obj)
    if name not in TORCH_DTYPES:
        raise ValueError(f"the kvwire connector stores {', '.join(TORCH_DTYPES.values())} KV caches (and fp8 "
                         f"ones, kv_cache_dtype 'fp8'), not {name}")
    return TORCH_DTYPES[name]


# vLLM's kv_cache_dtype -> kvwire dtype (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE: fp8 caches are
# uint8 tensors holding OCP fp8 elements; "fp8" is the platform's fp8, e4m3fn, or e4m3fnuz on ROCm).
CACHE_DTYPES = {"fp8_e4m3": "f8_e4m3fn", "fp8_e5m2": "f8_e5m2", "bfloat16": "bf16", "float16": "f16",
                "half": "f16", "float32": "f32", "float": "f32"}
FP8_TORCH = {"f8_e4m3fn": "float8_e4m3fn", "f8_e5m2": "float8_e5m2", "f8_e4m3fnuz": "float8_e4m3fnuz"}


def cache_dtype_of(model_dtype, cache_dtype, platform_fp8: str = "f8_e4m3fn") -> str:
    """The kvwire dtype of vLLM's KV cache: the model's for "auto", the fp8 format for "fp8"
    ("fp8" is ``platform_fp8``: vLLM's ``current_platform.fp8_dtype()``), "fp8_e4m3",
    "fp8_e5m2"; other quantised caches (per-token-head scales, nvfp4, int8) are refused."""
    if cache_dtype in (None, "auto"):
        return dtype_of(model_dtype)
    if cache_dtype == "fp8":
        return platform_fp8
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={cache_dtype!r}: the kvwire connector stores 'auto', 'fp8', "
                         f"{', '.join(repr(k) for k in CACHE_DTYPES)} caches (per-layer scales); per-token or "
                         "per-head scaled and packed formats are not supported (turboquant slot tensors: "
                         "kvwire.integrations.vllm_quantized converts them without re-quantizing)")
    return CACHE_DTYPES[cache_dtype]


def layer_scales(k_scale: float, v_scale: float, mla: bool) -> tuple[float, float]:
    """One layer's (k_scale, v_scale) for a header: an MLA latent is scaled by k_scale and
    its unused v_scale is 1.0 (KVW-SCALE-5)."""
    return float(k_scale), 1.0 if mla else float(v_scale)


__all__ = ["CACHE_DTYPES", "FP8_TORCH", "LoadSpec", "ModelKey", "RequestState", "SaveSpec", "cache_dtype_of",
           "place_parts",
           "chunk_cache", "chunks_to_save", "dtype_of", "files_digest", "layer_index", "layer_scales", "matched_tokens",
           "model_weights_fingerprint", "slots", "tail_to_save"]


# -- former names of what kvwire.layouts now owns: deprecated aliases, for one release ---------

# the connector's former packing names -> (kvwire.layouts packing, CPU kernels' ISA)
_FORMER_PACKINGS = {"channels": ("channels", None), "cpu_vec": ("tokens", "vec"), "cpu_amx": ("tokens", "amx")}


def _former_packing(packing: str) -> str:
    if packing not in _FORMER_PACKINGS:
        raise ValueError(f"packing must be one of {tuple(_FORMER_PACKINGS)} (how the attention backend keeps K and V "
                         f"in its view), not {packing!r}")
    return packing


def _former_args(mla: bool, packing: str) -> tuple[str, str | None]:
    return ("latent", None) if mla else _FORMER_PACKINGS[_former_packing(packing)]


def _gather_layer(kv_layer, slot_ids, head_dim: int, mla: bool, packing: str = "channels"):
    from ..layouts import gather_slots

    return gather_slots(kv_layer, slot_ids, head_dim, *_former_args(mla, packing))


def _scatter_layer(kv_layer, slot_ids, arrays: dict, head_dim: int, mla: bool, packing: str = "channels") -> None:

    scatter_slots(kv_layer, slot_ids, arrays, head_dim, *_former_args(mla, packing))


def _moved(name: str):
    from .. import layouts

    return {"PACKINGS": (tuple(_FORMER_PACKINGS), "kvwire.layouts.SLOT_PACKINGS (packing 'tokens' with cpu_isa 'vec' "
                                                  "or 'amx' for 'cpu_vec' and 'cpu_amx')"),
            "AMX_ROWS": (layouts.AMX_ROWS, "kvwire.layouts.AMX_ROWS"),
            "check_packing": (_former_packing, "kvwire.layouts.check_slot_packing"),
            "cpu_vec_views": (layouts.cpu_vec_views, "kvwire.layouts.cpu_vec_views"),
            "cpu_amx_views": (layouts.cpu_amx_views, "kvwire.layouts.cpu_amx_views"),
            "gather_layer": (_gather_layer, "kvwire.layouts.gather_slots"),
            "scatter_layer": (_scatter_layer, "kvwire.layouts.scatter_slots")}.get(name)


__getattr__ = former_names(__name__, _moved)
