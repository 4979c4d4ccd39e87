"""Sparse caches -> Hugging Face transformers (spec/sparse.md section 6).

transformers' ``DynamicCache`` holds one ``[batch, heads, tokens, dim]`` tensor per layer
and builds one attention mask for all layers, so it can hold a sparse cache only when
every kv head of every attention layer retains the same number of tokens (StreamingLLM,
H2O / SnapKV with a head-shared budget). Which positions each head kept does not matter
once the keys carry their rotation (KVW-SPARSE-12): the next token attends to every
retained token, and it gets position ``next_position`` (KVW-SPARSE-13), not the number of
retained tokens. Anything else is refused with a ``SparseLoadError`` that says why.

transformers and torch are imported only when a function here is called.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..cache.kvcache import KVCache
from ..cache.sparse import SparseKVCache
from ..cache.tensors import as_numpy
from ..format.errors import Error
from ..format.header import Header
from ..format.sparse import layer_heads
from . import hf


class SparseLoadError(Error, ValueError):
    """The sparse cache cannot be represented in the target engine's cache."""

    code = "SPARSE_LOAD_FAILED"


class HFSparse(NamedTuple):
    cache: object  # transformers.DynamicCache
    position_ids: object  # torch.long [1, 1]: next_position, the RoPE position of the next token
    cache_position: object  # torch.long [1]: retained tokens, the cache slot of the next token
    next_position: int


def uniform_count(sparse: SparseKVCache) -> int:
    """The one retained count shared by every head of every attention layer, or a
    ``SparseLoadError`` naming the first layer and heads that differ."""
    h = sparse.header
    assert h.sparse is not None  # a SparseKVCache's header
    counts = iter(h.sparse.retained_counts)
    common = None
    for i, spec in enumerate(h.arch.layers):
        if spec.kind in ("sliding_attention", "chunked_attention"):
            raise SparseLoadError(f"layer {i} is {spec.kind}: transformers keeps the last window - 1 tokens of such "
                                  "layers, which an evicted subset does not describe; load sparse caches of "
                                  "full-attention (or MLA) layers only")
        layer = [next(counts) for _ in range(layer_heads(spec))]
        if not layer:
            continue
        if len(set(layer)) != 1:
            raise SparseLoadError(f"layer {i} retains {layer} tokens per kv head: transformers' DynamicCache needs "
                                  "equal lengths per head ([batch, heads, tokens, dim]); use an engine with per-head "
                                  "lengths or a per-head attention mask")
        if common is None:
            common = layer[0]
        elif layer[0] != common:
            raise SparseLoadError(f"layer {i} retains {layer[0]} tokens, an earlier layer {common}: transformers "
                                  "builds one attention mask for all layers, so every layer needs the same length")
    return common or 0


def to_dense(sparse: SparseKVCache) -> KVCache:
    """The retained tokens as a dense ``KVCache`` (heads stacked; token t of head h is
    retained token t of that head). Its positions are no longer ``first_position + t``:
    keep ``sparse.next_position`` for the next token."""
    n = uniform_count(sparse)
    h = sparse.header
    layers: list[dict[str, Any]] = []
    for spec, heads in zip(h.arch.layers, sparse.layers):
        if not heads:
            layers.append({})
            continue
        comps = ("latent",) if spec.kind == "mla_latent" else ("k", "v")
        layers.append({c: np.stack([as_numpy(head[c]) for head in heads]) for c in comps})
    dense = Header(arch=h.arch, token_count=n, dtype=h.dtype, first_position=h.first_position, model=h.model,
                   chunk_tokens=h.chunk_tokens, alignment=h.alignment)
    return KVCache(dense, layers)


def to_hf(sparse: SparseKVCache, model) -> HFSparse:
    """A ``DynamicCache`` holding ``sparse`` for ``model``, and where to continue.

    Call the model on the next token with ``past_key_values=result.cache``,
    ``position_ids=result.position_ids`` and ``cache_position=result.cache_position``
    (then advance both by one per token). Raises ``SparseLoadError`` when the heads or
    layers retain different numbers of tokens.
    """
    import torch

    if not getattr(sparse, "is_sparse", False):
        raise TypeError("to_hf expects a SparseKVCache; use kvwire.adapters.hf.to_hf for a dense KVCache")
    if not sparse.header.arch.keys_post_rope:
        raise SparseLoadError("the cache stores keys before RoPE; transformers caches them after")
    dense = to_dense(sparse)
    cache = hf.to_hf(dense, model)
    device = next(model.parameters()).device
    nxt = sparse.next_position
    return HFSparse(cache, torch.tensor([[nxt]], dtype=torch.long, device=device),
                    torch.tensor([dense.header.token_count], dtype=torch.long, device=device), nxt)
