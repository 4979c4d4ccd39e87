"""The events a ``StreamDecoder`` hands out, and the ``Placed`` a placement may hand it.

They are the decoder's vocabulary shared with its callers (transports, the top-level
API): plain frozen values, no decoding logic. ``cache.decoder`` re-exports them, so
``kvwire.cache.decoder.ChunkEvent`` and ``kvwire.ChunkEvent`` keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..format.header import Header


@dataclass(frozen=True)
class HeaderEvent:
    """The header is complete and checked: the first event of a container."""

    header: Header


@dataclass(frozen=True)
class ChunkEvent:
    """One chunk decoded and verified: ``data`` is its [heads, tokens, head_dim] tensor (or,
    for a sparse container's POSITIONS chunk, the positions) of ``component`` of ``layer``
    from token ``token_start``."""

    layer: int
    component: str
    token_start: int
    data: object  # [heads, tokens, head_dim], owned by the event (or the caller's placement)
    head_start: int = 0  # sparse containers: the chunk's one head; data is then [1, tokens, dim] or positions


class Placed(NamedTuple):
    """A placement with its byte buffers: ``pieces`` are writable byte memoryviews whose
    concatenation, in order, is where the chunk's raw bytes go (e.g. one per head of a
    token slice of a [heads, T, dim] tensor); ``data`` is what the ``ChunkEvent`` carries."""

    data: object
    pieces: list


@dataclass(frozen=True)
class EndEvent:
    """The end frame arrived and checked (count and digest of the chunks): the container is
    complete, and only now may what was received be used (KVW-STREAM-2)."""

    chunk_count: int


__all__ = ["ChunkEvent", "EndEvent", "HeaderEvent", "Placed"]
