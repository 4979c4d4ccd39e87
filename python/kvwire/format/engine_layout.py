"""The engine layout: which engine buffer layout a cache was gathered from (spec 5.9).

``EngineLayout`` is the header's informational ``engine_layout`` table. Writers are held
to its rules (``check_engine_layout``: KVW-HDR-7, KVW-HDR-19, KVW-LIM-1); readers verify
the table like every other one but never judge its content (KVW-HDR-18), so reading it
cannot fail beyond the FlatBuffers checks.

It is separate from ``header`` because it is a self-contained diagnostic table that the
engine layouts (``kvwire.layouts``, spec/layouts.md) and connectors deal in, with rules
of its own that no other header field shares. ``header`` builds and reads it for its
``engine_layout`` field and re-exports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import flatbuffers

from . import limits as L
from .fbfields import SCALAR, read_numbers, scalar_vector
from .fbs import EngineLayout as fbEngine
from .flatbuf import Table

MAX_LAYOUT_DIMS = 64  # EngineLayout.stride_order entries (spec section 17)
_AXES = re.compile(r"^[A-Z][A-Z0-9]*(\*[A-Z][A-Z0-9]*)*(,[A-Z][A-Z0-9]*(\*[A-Z][A-Z0-9]*)*)*$")


@dataclass(frozen=True)
class EngineLayout:
    """Which engine buffer layout a cache was gathered from (spec 5.9): diagnostics only.

    ``axes`` names the engine tensor's dimensions in its shape order, comma-separated,
    with merged axes joined by ``*`` (``"KV,B,N,H,C"``, ``"KV,L,T,H*C"``); ``stride_order``
    lists the dimensions from outermost to innermost in memory (empty: shape order).
    Readers never change decoding because of it (KVW-HDR-18).
    """

    name: str = ""
    axes: str = ""
    stride_order: tuple[int, ...] = ()
    block_size: int = 0
    engine: str = ""


def check_engine_layout(e: EngineLayout) -> None:
    """Writer rules of the EngineLayout table (KVW-HDR-7, KVW-HDR-19, KVW-LIM-1)."""
    for s in (e.name, e.axes, e.engine):
        if not isinstance(s, str) or "\0" in s or len(s.encode("utf-8")) > L.MAX_STRING_LENGTH:
            raise ValueError(f"engine_layout string {str(s)[:40]!r}: no NUL, at most {L.MAX_STRING_LENGTH} UTF-8 "
                             "bytes (KVW-HDR-7)")
    if not 0 <= e.block_size < 1 << 32:
        raise ValueError(f"engine_layout.block_size {e.block_size} is not a u32")
    if e.axes and not _AXES.fullmatch(e.axes):
        raise ValueError(f"engine_layout.axes {e.axes!r}: comma-separated dimensions of '*'-joined upper-case "
                         "axis names, e.g. 'KV,B,N,H,C' (KVW-HDR-19)")
    order = tuple(e.stride_order)
    if len(order) > MAX_LAYOUT_DIMS:
        raise ValueError(f"engine_layout.stride_order has {len(order)} entries, limit {MAX_LAYOUT_DIMS} (KVW-LIM-1)")
    if order:
        ndims = len(e.axes.split(",")) if e.axes else -1
        if sorted(order) != list(range(ndims)):
            raise ValueError(f"engine_layout.stride_order {order} is not a permutation of the {max(ndims, 0)} "
                             "dimensions of axes (KVW-HDR-19)")


def build_engine_layout(b: flatbuffers.Builder, e: EngineLayout) -> int:
    """Write the EngineLayout table; empty strings, stride order and block size are omitted."""
    strings = {fid: b.CreateString(v) for fid, v in ((0, e.name), (1, e.axes), (4, e.engine)) if v}
    order = scalar_vector(b, "u1", e.stride_order) if e.stride_order else None
    fbEngine.Start(b)
    for fid, off in strings.items():
        b.PrependUOffsetTRelativeSlot(fid, off, 0)
    if order is not None:
        fbEngine.AddStrideOrder(b, order)
    if e.block_size:
        fbEngine.AddBlockSize(b, e.block_size)
    end: int = fbEngine.End(b)
    return end


def read_engine_layout(t: Table | None) -> EngineLayout | None:
    """Verified like every table (KVW-HDR-2); its content is never judged (KVW-HDR-18)."""
    if t is None:
        return None
    return EngineLayout(
        name=t.string(0, L.MAX_STRING_LENGTH) or "",
        axes=t.string(1, L.MAX_STRING_LENGTH) or "",
        stride_order=read_numbers(t, 2, "B", 1, MAX_LAYOUT_DIMS),
        block_size=t.scalar(3, SCALAR["I"], 0),
        engine=t.string(4, L.MAX_STRING_LENGTH) or "",
    )
