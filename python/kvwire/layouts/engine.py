"""Encoding straight from engine buffers, and the module-level gather and scatter functions.

``encode_from_engine`` / ``iter_buffers_from_engine`` / ``save_from_engine`` feed
``kvwire.Encoder`` chunk by chunk from ``EngineBuffers.gather_range``: no whole-cache
copy is ever assembled, and a chunk that lies in one block (or a mergeable run) is a view
of the engine memory. The header records the layout the cache came from
(``Header.engine_layout``), for diagnostics only.
"""

from __future__ import annotations

from ..cache.encoder import Encoder
from ..cache.files import atomic_write
from ..cache.kvcache import KVCache
from ..codecs import DEFAULT_ZSTD_LEVEL
from ..format.chunks import planned_chunks
from ..format.header import Architecture, Header, LayerSpec
from .binding import EngineBuffers, LayoutMismatchError


def architecture_of(eb: EngineBuffers) -> Architecture:
    """Per-layer geometry of the buffers as a kvwire Architecture (MLA needs ``kv_lora_rank``)."""
    specs = []
    for i, g in enumerate(eb.geometry):
        if g.mla:
            r = eb.kv_lora_rank
            if r is None or not 1 <= r < g.dim_k:
                raise LayoutMismatchError(f"layer {i} is an MLA latent of {g.dim_k} channels: bind with "
                                          "kv_lora_rank= (e.g. 512 of 576) to describe its nope/rope split")
            specs.append(LayerSpec("mla_latent", 1, g.dim_k, 0, kv_lora_rank=r, qk_rope_head_dim=g.dim_k - r))
        else:
            specs.append(LayerSpec("full_attention", g.heads, g.dim_k, g.dim_v))
    distinct: dict[LayerSpec, LayerSpec] = {}
    return Architecture(tuple(distinct.setdefault(s, s) for s in specs))


def header_for(eb: EngineBuffers, num_tokens: int, *, arch: Architecture | None = None, **fields) -> Header:
    """The header of a cache of ``num_tokens`` tokens gathered from ``eb``.

    ``arch`` (optional) is checked against the buffers; other keywords are Header fields
    (``chunk_tokens``, ``model``, ``first_position``, ``metadata`` ...)."""
    h = Header(arch=arch or architecture_of(eb), token_count=num_tokens, dtype=eb.dtype,
               engine_layout=fields.pop("engine_layout", eb.engine_layout()), **fields)
    eb.check_header(h)
    return h


def iter_chunks(eb: EngineBuffers, ids, header: Header):
    """(layer, component, token_start, [heads, tokens, head_dim]) of every chunk ``header`` implies."""
    a = eb.check_ids(ids, header.token_count)
    for layer, comp, t0, n in planned_chunks(header):
        yield layer, comp, t0, eb.gather_range(layer, comp, a, t0, t0 + n)


def iter_buffers_from_engine(eb: EngineBuffers, ids, num_tokens: int, *, codec: str = "raw",
                             level: int = DEFAULT_ZSTD_LEVEL, form: str = "file", **header_fields):
    """The container's buffers (bytes and views), chunk by chunk from the engine."""
    h = header_fields.pop("header", None) or header_for(eb, num_tokens, **header_fields)
    enc = Encoder(h, codec=codec, level=level)
    yield from enc.begin()
    for layer, comp, t0, x in iter_chunks(eb, ids, h):
        yield from enc.chunk(layer, comp, t0, x)
    yield from enc.end(form=form)


def encode_from_engine(eb: EngineBuffers, ids, num_tokens: int, **opts) -> bytes:
    """The whole container as bytes (options: see ``iter_buffers_from_engine``)."""
    return b"".join(iter_buffers_from_engine(eb, ids, num_tokens, **opts))


def save_from_engine(path, eb: EngineBuffers, ids, num_tokens: int, *, fsync: bool = False, **opts) -> int:
    """Write the cache to ``path`` atomically (temporary file + rename); returns its size."""
    return atomic_write(path, iter_buffers_from_engine(eb, ids, num_tokens, form="file", **opts), fsync=fsync)


def gather_cache(eb: EngineBuffers, ids, num_tokens: int, **header_fields) -> KVCache:
    """A ``KVCache`` in the standard layout (tensors are views of the engine memory where
    the layout allows, else one copy each)."""
    h = header_for(eb, num_tokens, **header_fields)
    return KVCache(h, eb.gather(ids, num_tokens))


def gather(eb: EngineBuffers, ids, num_tokens: int) -> list[dict]:
    """Per layer {component: [heads, num_tokens, head_dim]} (see ``EngineBuffers.gather``)."""
    return eb.gather(ids, num_tokens)


def scatter(reader, eb: EngineBuffers, ids, **kw):
    """Decode ``reader`` into ``eb`` at ``ids`` (see ``EngineBuffers.scatter``)."""
    return eb.scatter(reader, ids, **kw)
