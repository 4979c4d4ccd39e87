"""Canonical tensor bytes and their digests (conformance/PROTOCOL.md, "Neutral JSON").

Tensor bytes are *canonical*: for every (layer, component) the layer stores, the
little-endian row-major ``[heads, layer tokens, head_dim]`` tensor (all its chunks
concatenated in token order). A twin lists their SHA-256 digests; a ``decode`` command
writes one raw file per tensor and an ``encode`` command reads them. Kept apart from the
header JSON (``neutral``) because only this side touches array data.
"""

from __future__ import annotations

import hashlib

from ..format import registry as R


def stored_components(header_json: dict):
    """(layer, component, shape) of every tensor a decoder reports, in canonical order."""
    for i, (spec, r) in enumerate(zip(header_json["arch"]["layers"], header_json["layer_tokens"])):
        if spec["kind"] == "state":  # one tensor per state tensor, if the cache has tokens (spec/crossmodel.md)
            for t in spec["state_tensors"] if r["count"] else ():
                yield i, f"state.{t['name']}", list(t["shape"])
            continue
        for comp in R.KIND_COMPONENTS[spec["kind"]]:
            heads, dim = {
                "k": (spec["num_kv_heads"], spec["head_dim_k"]),
                "v": (spec["num_kv_heads"], spec["head_dim_v"]),
                "latent": (1, spec["head_dim_k"]),
            }[comp]
            yield i, comp, [heads, r["count"], dim]


def tensor_file_name(layer: int, component: str) -> str:
    return f"layer{layer}_{component}.bin"


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_bytes(array) -> bytes:
    """Canonical bytes of a host array [heads, tokens, head_dim] (C order, little-endian host)."""
    import numpy as np

    from ..cache.tensors import as_numpy

    return np.ascontiguousarray(as_numpy(array)).tobytes()


def cache_tensors(cache):
    """(layer, component, array) of every canonical tensor of a cache. A sparse cache
    (spec/sparse.md) has, per (layer, component), its heads' rows concatenated in head order
    ([retained tokens of all heads, dim]) and POSITIONS as int64 little-endian."""
    if getattr(cache, "is_sparse", False):
        yield from cache.canonical_tensors()
        return
    for i, layer in enumerate(cache.layers):
        for comp in cache.header.arch.layers[i].components:
            if comp == "state":  # "state.<name>" per state tensor, in declaration order (spec/crossmodel.md)
                for t in cache.header.arch.layers[i].state_tensors:
                    if t.name in layer["state"]:
                        yield i, f"state.{t.name}", layer["state"][t.name]
                continue
            yield i, comp, layer[comp]


def tensor_digests(cache) -> list[dict]:
    """The twin's ``tensors`` list for a ``KVCache`` (or ``SparseKVCache``)."""
    out = []
    for i, comp, x in cache_tensors(cache):
        data = canonical_bytes(x)
        out.append({"layer": i, "component": comp, "shape": list(x.shape), "nbytes": len(data),
                    "sha256": sha256(data)})
    return out
