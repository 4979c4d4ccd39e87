"""Slot-addressed copies between kvwire's standard ``[heads, tokens, dim]`` arrays and an
engine's paged view, through libkvwire (``kvw_scatter_slots`` / ``kvw_gather_slots``).

Why: a connector places each loaded layer into the engine's paged blocks by slot ids. On the
CPU numpy's strided copies do it with the GIL held, and a view that keeps K transposed per
block (vLLM's CPU kernels) is copied element by element: about 1 GB/s, the largest cost of a
hit after the read itself. libkvwire copies a run of consecutive slots of one block as one
row copy per head, or as a tile transposed in the CPU caches, with the GIL released (ctypes),
so the loader's threads copy layers in parallel. The numpy copies stay the reference and the
fallback: these functions return False when native is off or the arrays are not a shape C
takes, and the caller copies as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .native import cdll
from .native_lib import KvwError

__all__ = ["gather_slots", "scatter_slots"]


def _args(std: np.ndarray[Any, Any], ids: np.ndarray[Any, Any], paged: np.ndarray[Any, Any]) -> tuple[Any, ...] | None:
    """The C arguments for ``std`` [H, T, D] (token rows contiguous), int64 slot ``ids`` [T]
    and the ``paged`` [B, H, N, D] view (the same element size, non-negative strides), or
    None when C does not take them."""
    if std.ndim != 3 or paged.ndim != 4 or ids.ndim != 1 or ids.dtype != np.int64 or not ids.flags.c_contiguous:
        return None
    h, t, d = std.shape
    w = std.itemsize
    if (paged.itemsize != w or paged.shape[1] != h or paged.shape[3] != d or len(ids) != t or
            std.strides[2] != w or (t > 1 and std.strides[1] != d * w) or std.strides[0] < 0 or min(paged.strides) < 0):
        return None
    strides = (ctypes.c_size_t * 4)(*paged.strides)
    return (h, t, d, w, std.strides[0], ids.ctypes.data, paged.ctypes.data, paged.shape[0], paged.shape[2], strides)


def _copy(name: str, std: np.ndarray[Any, Any], ids: np.ndarray[Any, Any], paged: np.ndarray[Any, Any],
          written: np.ndarray[Any, Any]) -> bool:
    """``kvw_scatter_slots`` or ``kvw_gather_slots`` over the arrays (``written``: the one
    the call writes); False when native is off or C does not take them."""
    lib = cdll()
    if lib is None or not written.flags.writeable or not std.size:
        return False
    a = _args(std, ids, paged)
    if a is None:
        return False
    h, t, d, w, hs, ids_ptr, paged_ptr, nb, n, strides = a
    e = KvwError()
    if getattr(lib, name)(std.ctypes.data, h, t, d, w, hs, ids_ptr, paged_ptr, nb, n, strides, ctypes.byref(e)):
        raise ValueError(e.message.decode(errors="replace"))
    return True


def scatter_slots(std: np.ndarray[Any, Any], ids: np.ndarray[Any, Any], paged: np.ndarray[Any, Any]) -> bool:
    """Write ``std`` [heads, tokens, dim] into the slots ``ids`` (int64, one per token) of the
    writable ``paged`` [blocks, heads, block_size, dim] view. False (nothing written) when
    native is off or C does not take the arrays; a ValueError for a slot outside the view
    (checked before any byte is written)."""
    return _copy("kvw_scatter_slots", std, ids, paged, paged)


def gather_slots(paged: np.ndarray[Any, Any], ids: np.ndarray[Any, Any], std: np.ndarray[Any, Any]) -> bool:
    """Copy the slots ``ids`` of ``paged`` into the writable ``std`` [heads, tokens, dim];
    False when native is off or C does not take the arrays (see ``scatter_slots``)."""
    return _copy("kvw_gather_slots", std, ids, paged, std)
