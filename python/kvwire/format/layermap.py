"""Applying the layer map (spec/kvwire-v1.md section 7, KVW-MAP-5..7).

``layer_for(header, r)`` answers, for receiver layer ``r``, where its cache comes from:
a copy of a transmitted layer, an alias of the buffer another receiver layer owns, or
nothing (recompute / drop). Transmitted ``shared`` layers resolve to their source layer,
so a Gemma 3n-style container without a map reads the same way as one with aliases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerSource:
    """Where receiver layer ``receiver_layer``'s cache comes from.

    ``op``: "copy" (its own buffer holding transmitted layer ``transmitted_layer``),
    "alias" (no buffer of its own: it uses receiver layer ``owner``'s, or, when no
    receiver layer copies the transmitted layer, the transmitted layer's buffer itself,
    ``owner`` = -1), "recompute" or "drop" (``transmitted_layer`` = ``owner`` = -1).
    """

    receiver_layer: int
    op: str
    transmitted_layer: int = -1
    owner: int = -1


def _stored(arch: Any, t: int) -> int:
    """The transmitted layer that holds ``t``'s chunks: its source when ``t`` is shared (KVW-MAP-5)."""
    s = arch.layers[t]
    stored: int = s.source_layer if s.kind == "shared" else t
    return stored


def layer_for(header: Any, receiver_layer: int) -> LayerSource:
    """Where receiver layer ``receiver_layer`` gets its cache from (KVW-MAP-6)."""
    arch, r = header.arch, receiver_layer
    if r < 0:
        raise ValueError(f"receiver layer {r} is negative")
    if not header.layer_map:  # identity map; shared layers alias their source (KVW-ARCH-4)
        if r >= arch.num_layers:
            raise ValueError(f"receiver layer {r}: the container has {arch.num_layers} layers and no layer map")
        t = _stored(arch, r)
        return LayerSource(r, "copy", r, r) if t == r else LayerSource(r, "alias", t, t)
    entry = next((e for e in header.layer_map if e.receiver_layer == r), None)
    if entry is None:  # not listed in a non-empty map: the receiver computes it (KVW-MAP-6)
        return LayerSource(r, "recompute")
    if entry.op in ("recompute", "drop"):
        return LayerSource(r, entry.op)
    t = _stored(arch, entry.transmitted_layer)
    if entry.op == "copy":  # a copy of a shared transmitted layer copies its source's cache
        return LayerSource(r, "copy", t, r)
    owners = [e.receiver_layer for e in header.layer_map
              if e.op == "copy" and e.transmitted_layer == entry.transmitted_layer]
    return LayerSource(r, "alias", t, min(owners, default=-1))


def resolve(layer_map: Any, receiver_layers: int, reasons: list[str]) -> list[tuple[str, int]]:
    """(op, transmitted layer) for every receiver layer 0..receiver_layers-1; reasons for entries beyond it."""
    by_r = {e.receiver_layer: e for e in layer_map}
    for r in sorted(by_r):
        if r >= receiver_layers:
            reasons.append(f"layer map: entry for receiver layer {r}, the receiver has {receiver_layers} layers")
    plan = []
    for r in range(receiver_layers):
        e = by_r.get(r)
        plan.append(("recompute", -1) if e is None else (e.op, e.transmitted_layer))
    return plan
