"""State layers (spec/crossmodel.md, KVW-STATE-*): SSM / linear-attention state as chunks.

A state layer's cache is a few named tensors (conv state, recurrent state) holding the
layer's state after its last token. They are not indexed by token, so each tensor is one
chunk that spans the layer's whole token range, with ``head_start`` naming the tensor
(its index in ``LayerSpec.state_tensors``) and its own dtype. The grid checks of
``chunks.py`` treat these rows through ``state_rows``; readers and writers use the
helpers below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import registry as R
from .crossmodel_header import MAX_STATE_TENSORS

STATE = R.COMPONENTS["state"]
STATE_CODECS = (R.CODECS["raw"], R.CODECS["zstd"])  # KVW-STATE-8: lossless, no codec spec


def state_tables(h) -> tuple[np.ndarray, np.ndarray] | None:
    """(tensor count [L], tensor nbytes [L, MAX_STATE_TENSORS]) of a header, None without state layers."""
    layers = h.arch.layers
    if not any(s.kind == "state" for s in layers):
        return None
    count = np.zeros(len(layers), np.int64)
    nbytes = np.zeros((len(layers), MAX_STATE_TENSORS), np.int64)
    for i, s in enumerate(layers):
        if s.kind == "state":
            count[i] = len(s.state_tensors)
            nbytes[i, :count[i]] = [t.nbytes for t in s.state_tensors]
    return count, nbytes


@dataclass(frozen=True)
class StateRows:
    mask: np.ndarray  # which records name the STATE component
    head_max: np.ndarray  # largest valid head_start per record (tensor count - 1; 0 for K/V/latent)
    nbytes: np.ndarray  # raw_length a state record must have


def state_rows(tables, rec: np.ndarray, layer: np.ndarray, comp: np.ndarray) -> StateRows | None:
    if tables is None:
        return None
    count, nbytes = tables
    mask = comp == STATE
    head = np.minimum(rec["head_start"].astype(np.int64), MAX_STATE_TENSORS - 1)
    return StateRows(mask, np.where(mask, count[layer] - 1, 0), nbytes[layer, head])


def planned_state_chunks(h):
    """(layer, tensor index) of every state chunk, in canonical order (KVW-STATE-7)."""
    if h.token_count == 0:
        return
    for layer, spec in enumerate(h.arch.layers):
        if spec.kind == "state":
            for index in range(len(spec.state_tensors)):
                yield layer, index


def layer_tensors(layer: dict):
    """(name, tensor) of every tensor of a KVCache layer, state tensors included ("state.<name>")."""
    for comp, x in layer.items():
        if comp == "state":
            for name, t in x.items():
                yield f"state.{name}", t
        else:
            yield comp, x


def check_state_tensors(spec, layer: int, tensors, token_count: int) -> None:
    """A KVCache's state layer holds exactly the declared tensors (none for a cache of 0 tokens)."""
    from .tensors import dtype_name

    names = {t.name for t in spec.state_tensors} if token_count else set()
    if not isinstance(tensors, dict) or set(tensors) != names:
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise ValueError(f"layer {layer} (state) needs {{name: tensor}} for {sorted(names)}, "
                         f"got {got}")
    for t in spec.state_tensors:
        if t.name not in tensors:
            continue
        x = tensors[t.name]
        if tuple(x.shape) != t.shape or dtype_name(x) != t.dtype:
            raise ValueError(f"layer {layer} state {t.name!r}: {tuple(x.shape)} {dtype_name(x)}, header declares "
                             f"{t.shape} {t.dtype}")


def state_tensor_of(header, layer: int, index: int) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of state tensor ``index`` of ``layer``: how its chunk's bytes are viewed."""
    t = header.arch.layers[layer].state_tensors[index]
    return t.dtype, t.shape


def read_state_layer(reader, layer: int, verify: bool, backend: str) -> dict:
    """{"state": {name: tensor}} of a state layer; empty tensors dict for a cache of 0 tokens."""
    spec = reader.header.arch.layers[layer]
    out = {}
    if reader.header.token_count:
        for index, t in enumerate(spec.state_tensors):
            i = int(reader._lookup[reader._table.base[layer, STATE] + index])
            x = reader._decode(i, verify, backend)
            if reader._info(i).codec == "raw":  # a view of the container: layer()/load() own their memory
                x = x.copy() if backend == "numpy" else x.clone()
            out[t.name] = x
    return {"state": out}
