"""State layers (spec/crossmodel.md, KVW-STATE-*): SSM / linear-attention state as chunks.

A state layer's cache is a few named tensors (conv state, recurrent state) holding the
layer's state after its last token. They are not indexed by token, so each tensor is one
chunk that spans the layer's whole token range, with ``head_start`` naming the tensor
(its index in ``LayerSpec.state_tensors``) and its own dtype. The grid checks of
``chunks.py`` treat these rows through ``state_rows``; ``chunks.chunk_plan`` places
them in the canonical order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import registry as R
from .crossmodel import MAX_STATE_TENSORS

STATE = R.COMPONENTS["state"]
STATE_CODECS = (R.CODECS["raw"], R.CODECS["zstd"])  # KVW-STATE-8: lossless, no codec spec


def state_tables(h: Any) -> tuple[np.ndarray, np.ndarray] | None:
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


def state_rows(tables: tuple[np.ndarray, np.ndarray] | None, rec: np.ndarray, layer: np.ndarray, comp: np.ndarray) -> StateRows | None:
    if tables is None:
        return None
    count, nbytes = tables
    mask = comp == STATE
    head = np.minimum(rec["head_start"].astype(np.int64), MAX_STATE_TENSORS - 1)
    return StateRows(mask, np.where(mask, count[layer] - 1, 0), nbytes[layer, head])


def state_tensor_of(header: Any, layer: int, index: int) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of state tensor ``index`` of ``layer``: how its chunk's bytes are viewed."""
    t = header.arch.layers[layer].state_tensors[index]
    return t.dtype, t.shape
