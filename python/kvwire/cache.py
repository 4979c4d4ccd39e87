"""``KVCache``: a whole cache in the standard layout, the unit users encode and load.

Each stored layer maps component name ("k", "v" or "latent") to one tensor of shape
[heads, tokens, head_dim] (the canonical body layout, KVW-CHUNK-4), where tokens is the
layer's own token count (a sliding-window layer may hold fewer than a full one).
A state layer (SSM / linear attention, spec/crossmodel.md) maps "state" to
``{name: tensor}``, each tensor in the shape and dtype its ``StateTensor`` declares.
Tensors may be numpy arrays or torch tensors; the header says what they mean.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from .header import Architecture, Header, LayerSpec, ModelIdentity, TokenRange
from .state import check_state_tensors, layer_tensors
from .tensors import as_numpy, dtype_name, is_torch


class KVCache:
    __slots__ = ("header", "layers")

    def __init__(self, header: Header, layers: Sequence[Mapping[str, object]]):
        if len(layers) != header.num_layers:
            raise ValueError(f"{len(layers)} layers given, header describes {header.num_layers}")
        for i, (spec, r, layer) in enumerate(zip(header.arch.layers, header.layer_tokens, layers)):
            if set(layer) != set(spec.components):
                raise ValueError(f"layer {i} ({spec.kind}) needs components {spec.components}, got {tuple(layer)}")
            if spec.kind == "state":  # {"state": {name: tensor}}, each in its declared shape and dtype
                check_state_tensors(spec, i, layer["state"], header.token_count)
                continue
            for comp, x in layer.items():
                want = spec.shape(comp, r.count)
                if tuple(x.shape) != want:
                    raise ValueError(f"layer {i} {comp}: shape {tuple(x.shape)}, header implies {want}")
                if dtype_name(x) != header.dtype:
                    raise ValueError(f"layer {i} {comp}: dtype {dtype_name(x)}, header says {header.dtype}")
        self.header = header
        self.layers = [dict(layer) for layer in layers]

    @classmethod
    def from_tensors(
        cls,
        keys: Sequence,
        values: Sequence,
        *,
        model: ModelIdentity | None = None,
        first_position: int = 0,
        metadata: Mapping[str, bytes] | None = None,
        **header_fields,
    ) -> "KVCache":
        """A cache of full-attention layers from per-layer K and V tensors [heads, tokens, head_dim].

        Layers may differ in head count, head dims and token count (a layer with fewer
        tokens holds the most recent ones, as a sliding-window layer does).
        """
        if len(keys) != len(values) or not keys:
            raise ValueError("need the same, non-zero number of key and value tensors")
        specs, ranges = [], []
        token_count = max(int(k.shape[1]) for k in keys)
        for i, (k, v) in enumerate(zip(keys, values)):
            if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must be "
                                 "[heads, tokens, head_dim] with equal heads and tokens")
            specs.append(LayerSpec("full_attention", int(k.shape[0]), int(k.shape[2]), int(v.shape[2])))
            ranges.append(TokenRange(token_count - int(k.shape[1]), int(k.shape[1])))
        header = Header(
            arch=Architecture(tuple(specs)),
            token_count=token_count,
            dtype=dtype_name(keys[0]),
            first_position=first_position,
            layer_tokens=tuple(ranges),
            model=model or ModelIdentity(),
            metadata=dict(metadata or {}),
            **header_fields,
        )
        return cls(header, [{"k": k, "v": v} for k, v in zip(keys, values)])

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    def keys(self, layer: int):
        return self.layers[layer].get("k")

    def values(self, layer: int):
        return self.layers[layer].get("v")

    def state(self, layer: int) -> dict:
        """{name: tensor} of a state layer (spec/crossmodel.md); empty for other layers."""
        return self.layers[layer].get("state", {})

    @property
    def nbytes(self) -> int:
        return sum(as_numpy(x).nbytes for layer in self.layers for _, x in layer_tensors(layer))

    def with_header(self, **changes) -> "KVCache":
        """Same tensors, header fields replaced (e.g. ``chunk_tokens``, ``model``)."""
        return KVCache(replace(self.header, **changes), self.layers)

    def equal(self, other: "KVCache") -> bool:
        """Bit-exact equality of header and every tensor (NaNs compare by bits)."""
        if self.header != other.header:
            return False
        for a, b in zip(self.layers, other.layers):
            ta, tb = dict(layer_tensors(a)), dict(layer_tensors(b))
            if a.keys() != b.keys() or ta.keys() != tb.keys():
                return False
            for comp in ta:
                x, y = as_numpy(ta[comp]), as_numpy(tb[comp])
                if x.shape != y.shape or x.tobytes() != y.tobytes():
                    return False
        return True

    def __repr__(self) -> str:
        h = self.header
        backend = "torch" if any(is_torch(x) for layer in self.layers for _, x in layer_tensors(layer)) else "numpy"
        return (f"KVCache({h.num_layers} layers, {h.token_count} tokens, {h.dtype}, {backend}, "
                f"{self.nbytes / 2**20:.1f} MiB)")
