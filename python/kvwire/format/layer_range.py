"""The header of a layer range: layers ``[start, stop)`` of a model as a container of their own.

A pipeline-parallel stage, or a store object of a layer range (spec/store.md), holds some
layers of a model. Every per-layer value of its header must then be that of the layers it
holds, in order: the layer specs, their token ranges, the per-layer weights fingerprints
(crossmodel.md KVW-ID-7) and the fp8 scales (kvwire-v1.md KVW-SCALE-8). ``Header.layer_slice``
calls ``layer_slice`` here, so that no caller forgets one of them. It must not import
``header`` (which imports it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

HASH_SIZE = 32  # bytes per layer of ModelIdentity.layer_weights_fingerprints


def layer_slice(h: Any, start: int, stop: int) -> Any:
    """``h`` reduced to its layers ``[start, stop)``: arch, ``layer_tokens``, ``kv_scales`` and
    ``layer_weights_fingerprints`` sliced, shared layers' ``source_layer`` renumbered, and no
    layer map (the caller adds the one it needs, e.g. receiver layer ``start + i`` a copy of
    transmitted layer ``i``). A sparse header, whose retained counts are per (layer, head),
    and a shared layer whose source lies before ``start`` are refused with ``ValueError``."""
    n = h.num_layers
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop)) or not 0 <= start < stop <= n:
        raise ValueError(f"layer range [{start!r}, {stop!r}) is not a non-empty range within [0, {n})")
    if h.sparse is not None:
        raise ValueError("a sparse header's retained counts are per (layer, head): slice the SparseKVCache instead")
    layers = []
    for i, spec in enumerate(h.arch.layers[start:stop], start):
        if spec.kind == "shared":
            if spec.source_layer < start:
                raise ValueError(f"shared layer {i} uses layer {spec.source_layer}, outside [{start}, {stop})")
            spec = replace(spec, source_layer=spec.source_layer - start)
        layers.append(spec)
    m = h.model
    if m.layer_weights_fingerprints:
        m = replace(m, layer_weights_fingerprints=m.layer_weights_fingerprints[HASH_SIZE * start:HASH_SIZE * stop])
    return h.replace(arch=replace(h.arch, layers=tuple(layers)), layer_tokens=tuple(h.layer_tokens[start:stop]),
                     model=m, layer_map=(), kv_scales=None if h.kv_scales is None else h.kv_scales[start:stop])
