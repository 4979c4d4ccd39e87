"""Which size hints a binding needs: layouts that one tensor fits with different meanings.

Binding accepts a tensor in two forms (spec/layouts.md 2.1): the engine's view (shape
in dims order, memory in stride order) or the raw allocation (shape in memory order,
contiguous). Two registered layouts *confuse* each other in a form when a tensor of the
same number of dimensions and the same memory order fits both, and some dimension means
one free axis under one name and another free axis under the other: a contiguous
``(2, B, X, Y, C)`` tensor is ``vllm.v0_4_3_to_0_22.flash_nhd`` (X = block_size) or the raw
``vllm.v0_9_1_to_0_22.flash_hnd`` (X = heads), and nothing in the tensor says which.

Free axes are those whose size the layout leaves open: B, N, T, H, L and C. ``KV`` (2, or 1
for a shared latent) and ``H`` of a shared (MLA) layout (1) are fixed: a confusion that
would need a free axis to have a fixed size (``num_blocks == 2``) is caught by that check
and is not counted. For every confusion the caller must give the sizes of the confused
axes that have a hint, ``block_size`` (N), ``num_heads`` (H) and ``num_layers`` (L), so
that a wrong name is refused (KVW-BIND-1); B and T are the capacity and have none.

Pure Python and cached per (descriptor, form): binding calls ``needed_hints`` once per
tensor form, and custom descriptors are checked against the registry like registered ones.
"""

from __future__ import annotations

import functools

from .descriptor import LAYOUTS, LayoutDescriptor

__all__ = ["HINTS", "confusions", "needed_hints"]

HINTS = {"N": "block_size", "H": "num_heads", "L": "num_layers"}  # axis -> bind keyword


def _cells(desc: LayoutDescriptor, raw: bool):
    """(memory order, per tensor dimension (axes, fixed)) of a tensor in one form, or None
    when the layout has no such form (raw of an identity stride order is its view)."""
    n = len(desc.dims)
    ident = tuple(range(n))
    if raw and desc.stride_order == ident:
        return None
    dims = [desc.dims[i] for i in desc.stride_order] if raw else list(desc.dims)
    order = ident if raw else desc.stride_order

    def fixed(axes):  # the size a dimension must have, None when it is free
        one = 1 if desc.packing == "shared" else 2
        sizes = [one if a == "KV" else 1 if (a == "H" and desc.packing == "shared") else None for a in axes]
        return None if None in sizes else _prod(sizes)

    return order, tuple((d, fixed(d)) for d in dims)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _forms(desc: LayoutDescriptor):
    return [c for c in (_cells(desc, False), _cells(desc, True)) if c is not None]


def _kind(desc: LayoutDescriptor):
    return desc.scope, desc.packing == "separate"  # what container the buffers come in


@functools.cache
def confusions(desc: LayoutDescriptor, raw: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((other layout name, the axes of ``desc`` it reads differently), ...) for a tensor
    bound to ``desc`` in the given form (``raw``: the raw allocation)."""
    mine = _cells(desc, raw)
    if mine is None:
        return ()
    order, cells = mine
    out = []
    for other in LAYOUTS.values():
        if _kind(other) != _kind(desc) or len(other.dims) != len(desc.dims):
            continue
        for o_order, o_cells in _forms(other):
            if o_order != order:
                continue
            differ, possible = [], True
            for (axes, fix), (o_axes, o_fix) in zip(cells, o_cells):
                if fix is not None and o_fix is not None:
                    if fix != o_fix:  # the sizes exclude each other
                        possible = False
                        break
                    continue  # both fixed to one size: the same for every tensor
                if axes == o_axes and fix == o_fix:
                    continue
                if (fix is None) != (o_fix is None):  # fixed against free: the size check catches it
                    possible = False
                    break
                differ.append(axes)
            if possible and differ:
                out.append((other.name, tuple(a for axes in differ for a in axes)))
                break
    return tuple(out)


@functools.cache
def needed_hints(desc: LayoutDescriptor, raw: bool) -> dict[str, tuple[str, ...]]:
    """{bind keyword: names of the layouts it tells apart} that binding ``desc`` in this
    form requires (KVW-BIND-1); empty when the tensor's form says what it holds."""
    need: dict[str, list[str]] = {}
    for name, axes in confusions(desc, raw):
        for a in axes:
            if a in HINTS:
                need.setdefault(HINTS[a], []).append(name)
    return {k: tuple(dict.fromkeys(v)) for k, v in need.items()}
