"""Store keys (spec/store.md, KVW-STORE-11..17): the exact string under which a chunk
object lives, so every implementation finds the same objects.

A key is the prefix hash of the chunk (spec/crossmodel.md, KVW-PREFIX-3: it binds every
token up to the end of the chunk, the compat fingerprint and the chunk size) under a root
of everything else that must never collide: the compat fingerprint spelled out (so a
store can be listed or flushed per model), the storage dtype (SGLang #33268 mixed bf16
and fp8 pages under dtype-less keys), the tensor-parallel rank and size, the layer range,
the fidelity of the codec (a lossy codec changes the decoded tensors, a lossless one does
not) and the chunk size::

    kvw1/<fingerprint hex>/<dtype>/tp<rank>of<size>/l<start>-<stop>/<fidelity>/c<chunk_tokens>/<chunk hash hex>

and a chunk with a request identity (a tenant's salt, a LoRA adapter, an image before its
end: ``identity.RequestIdentity``, spec/store.md section 10) has one more segment, its
identity digest, before the hash (``.../c<chunk_tokens>/i<I_k hex>/<chunk hash hex>``).

``KeySpace.parse`` reads a key back (a store listed by ``kvwire store``), and
``header_mismatches`` says how an object's header disagrees with its key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from ..codecs.presets import PRESETS
from ..format import registry as R
from ..format.header import LayerMapEntry
from ..format.prefix import HASH_SIZE, PREFIX_SCHEME, prefix_hashes
from .identity import DIGEST_SIZE, METADATA_KEY, check_identity

KEY_VERSION = "kvw1"
LOSSLESS = "lossless"
LOSSLESS_CODECS = ("raw", "zstd", "byteplane")
MAX_FINGERPRINT = 64
_DEC = "(0|[1-9][0-9]*)"  # KVW-STORE-13: decimal, no sign, no leading zeros (ASCII digits only)
_SEGMENTS = {  # segment name -> strict pattern (re.fullmatch); the values are checked after
    "fingerprint": re.compile(rf"(?:[0-9a-f]{{2}}){{1,{MAX_FINGERPRINT}}}"),
    "shard": re.compile(f"tp{_DEC}of{_DEC}"),
    "layers": re.compile(f"l{_DEC}-{_DEC}"),
    "chunk size": re.compile(f"c{_DEC}"),
    "hash": re.compile(rf"[0-9a-f]{{{2 * HASH_SIZE}}}"),
    "identity": re.compile(rf"i[0-9a-f]{{{2 * DIGEST_SIZE}}}"),  # KVW-IDENT-5
}


def codec_fidelity(codec) -> str:
    """The key's fidelity segment of a codec name (KVW-STORE-15): "lossless" for raw, zstd
    and byteplane (they decode to the same tensors), else the lossy preset's name."""
    if codec is None or codec in LOSSLESS_CODECS:
        return LOSSLESS
    if isinstance(codec, str) and codec in PRESETS:
        return codec
    raise ValueError(f"the store keys a codec by name: one of {', '.join(LOSSLESS_CODECS + tuple(PRESETS))}, "
                     f"not {codec!r}")


@dataclass(frozen=True)
class KeySpace:
    """The key root of one model, dtype, shard, layer range, fidelity and chunk size
    (``identity_digest``: the request identity digest of the one chunk a key read back by
    ``parse`` names, or of ``scoped``; None: no identity segment, KVW-IDENT-5)."""

    fingerprint: bytes
    dtype: str
    chunk_tokens: int
    layers: tuple[int, int]
    tp_rank: int = 0
    tp_size: int = 1
    fidelity: str = LOSSLESS
    identity_digest: bytes | None = None

    def __post_init__(self):
        fp = bytes(self.fingerprint)
        object.__setattr__(self, "fingerprint", fp)
        if not 0 < len(fp) <= MAX_FINGERPRINT:
            raise ValueError("the store needs the cache's compat fingerprint (Header.model.compat_fingerprint, "
                             f"1..{MAX_FINGERPRINT} bytes; kvwire.model.identity.make_identity computes it): keys "
                             "without model identity would mix caches of different models (KVW-STORE-12)")
        if self.dtype not in R.DTYPES:
            raise ValueError(f"unknown storage dtype {self.dtype!r}; one of {', '.join(R.DTYPES)}")
        if not isinstance(self.chunk_tokens, int) or not 1 <= self.chunk_tokens < 1 << 32:
            raise ValueError(f"chunk_tokens {self.chunk_tokens!r} is not a positive u32")
        if not (isinstance(self.tp_size, int) and isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tensor-parallel rank {self.tp_rank!r} of size {self.tp_size!r}: need 0 <= rank < size")
        a, b = self.layers
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b):
            raise ValueError(f"layer range {self.layers!r}: need 0 <= start < stop")
        if self.fidelity != LOSSLESS and (self.fidelity not in PRESETS or self.fidelity in LOSSLESS_CODECS):
            raise ValueError(f"fidelity {self.fidelity!r} is neither 'lossless' nor a lossy preset name")
        if self.identity_digest is not None:
            d = bytes(self.identity_digest)
            if len(d) != DIGEST_SIZE:
                raise ValueError(f"an identity digest is {DIGEST_SIZE} bytes (SHA-256, KVW-IDENT-2), not {len(d)}")
            object.__setattr__(self, "identity_digest", d)

    @classmethod
    def of(cls, header, *, tp_rank: int = 0, tp_size: int = 1, codec="raw") -> KeySpace:
        """The key space of a cache's header (all of its layers)."""
        return cls(header.model.compat_fingerprint, header.dtype, header.chunk_tokens, (0, header.num_layers),
                   tp_rank, tp_size, codec_fidelity(codec))

    @cached_property  # once per space: a 1M-token hit query builds 4096 keys on it
    def root(self) -> str:
        a, b = self.layers
        return (f"{KEY_VERSION}/{self.fingerprint.hex()}/{self.dtype}/tp{self.tp_rank}of{self.tp_size}/l{a}-{b}/"
                f"{self.fidelity}/c{self.chunk_tokens}/")

    def key(self, chunk_hash: bytes) -> str:
        h = bytes(chunk_hash)
        if len(h) != HASH_SIZE:
            raise ValueError(f"a chunk hash is {HASH_SIZE} bytes, not {len(h)}")
        if self.identity_digest is not None:
            return f"{self.root}i{self.identity_digest.hex()}/{h.hex()}"
        return self.root + h.hex()

    def scoped(self, digest: bytes | None) -> KeySpace:
        """This space for one chunk of identity digest ``digest`` (None: unscoped)."""
        if digest == self.identity_digest:
            return self
        if digest is not None and len(digest) != DIGEST_SIZE:
            raise ValueError(f"an identity digest is {DIGEST_SIZE} bytes (SHA-256, KVW-IDENT-2), not {len(digest)}")
        out = object.__new__(KeySpace)  # the checked fields and the cached root, with another digest
        out.__dict__.update(self.__dict__, identity_digest=None if digest is None else bytes(digest))
        return out

    def chunk_spaces(self, n_chunks: int, identity=None) -> list:
        """The scoped space of each of chunks 0..n_chunks-1 of a request of ``identity``
        (a ``RequestIdentity`` or None: every chunk unscoped, KVW-IDENT-4)."""
        if self.identity_digest is not None:
            raise ValueError("this space names one chunk's keys (a scoped space, from parse or scoped); a request's "
                             "keys come from its unscoped space")
        if check_identity(identity) is None:
            return [self] * n_chunks
        spaces: dict = {}
        return [spaces.setdefault(d, self.scoped(d)) for d in identity.digests(n_chunks, self.chunk_tokens)]

    def hashes(self, tokens, *, partial: bool = False) -> list[bytes]:
        """The chain's hashes of the whole chunks of ``tokens`` (and of the trailing partial
        one when ``partial``), from position 0."""
        raw = prefix_hashes(tokens, self.chunk_tokens, self.fingerprint)
        out = [raw[i:i + HASH_SIZE] for i in range(0, len(raw), HASH_SIZE)]
        if not partial and len(tokens) % self.chunk_tokens:
            out.pop()
        return out

    def keys(self, tokens, *, partial: bool = False, identity=None) -> list[str]:
        """The keys of the chunk objects of ``tokens``, in order (KVW-STORE-11), for a request
        of ``identity`` (a ``RequestIdentity``; None: none, KVW-IDENT-4)."""
        hashes = self.hashes(tokens, partial=partial)
        return [s.key(h) for s, h in zip(self.chunk_spaces(len(hashes), identity), hashes)]

    @classmethod
    def parse(cls, key: str) -> tuple[KeySpace, bytes]:
        """(space, chunk hash) of a key, the inverse of ``key``: strictly the layout of
        KVW-STORE-13..16 (lower-case hex, decimals without leading zeros, 0 <= rank < size,
        start < stop, a registry dtype, "lossless" or a lossy preset), with or without the
        identity segment ``i<64 hex>`` of KVW-IDENT-5 (then ``space.identity_digest``);
        anything else is a ValueError naming the bad segment."""
        if not isinstance(key, str):
            raise TypeError(f"a store key is a str, not {type(key).__name__}")
        parts = key.split("/")
        if len(parts) not in (8, 9):
            raise ValueError(f"key {key[:120]!r}: {len(parts)} segments, a {KEY_VERSION} key has 8 "
                             f"({KEY_VERSION}/<fp>/<dtype>/tp<r>of<n>/l<a>-<b>/<fidelity>/c<C>/<hash>) or, with a "
                             "request identity, 9 (.../c<C>/i<identity digest>/<hash>)")
        ident = parts.pop(7) if len(parts) == 9 else None
        if ident is not None and _SEGMENTS["identity"].fullmatch(ident) is None:
            raise ValueError(f"key {key[:120]!r}: 9 segments, so a bad identity segment {ident!r} before the hash "
                             f"({_EXPECT['identity']})")
        version, fp, dtype, shard, layers, fidelity, chunk, h = parts
        if version != KEY_VERSION:
            raise ValueError(f"key {key[:120]!r}: version segment {version!r} is not {KEY_VERSION!r}")
        found = {}
        for name, text in (("fingerprint", fp), ("shard", shard), ("layers", layers), ("chunk size", chunk),
                           ("hash", h)):
            m = _SEGMENTS[name].fullmatch(text)
            if m is None:
                raise ValueError(f"key {key[:120]!r}: bad {name} segment {text!r} ({_EXPECT[name]})")
            found[name] = [int(g) for g in m.groups()]
        if dtype not in R.DTYPES:
            raise ValueError(f"key {key[:120]!r}: bad dtype segment {dtype!r}; one of {', '.join(R.DTYPES)}")
        if fidelity != LOSSLESS and (fidelity not in PRESETS or fidelity in LOSSLESS_CODECS):
            lossy = [p for p in PRESETS if p not in LOSSLESS_CODECS]
            raise ValueError(f"key {key[:120]!r}: bad fidelity segment {fidelity!r}; {LOSSLESS!r} or one of "
                             f"{', '.join(lossy)} (KVW-STORE-15)")
        (rank, size), (a, b), (c,) = found["shard"], found["layers"], found["chunk size"]
        if not rank < size:
            raise ValueError(f"key {key[:120]!r}: bad shard segment {shard!r}: need rank < size (KVW-STORE-16)")
        if not a < b:
            raise ValueError(f"key {key[:120]!r}: bad layers segment {layers!r}: need start < stop (KVW-STORE-16)")
        if not 1 <= c < 1 << 32:
            raise ValueError(f"key {key[:120]!r}: bad chunk size segment {chunk!r}: need 1 <= C < 2**32")
        return (cls(bytes.fromhex(fp), dtype, c, (a, b), rank, size, fidelity,
                    None if ident is None else bytes.fromhex(ident[1:])), bytes.fromhex(h))


_EXPECT = {
    "fingerprint": f"1..{MAX_FINGERPRINT} bytes in lower-case hex",
    "shard": "tp<rank>of<size>, decimals without leading zeros",
    "layers": "l<start>-<stop>, decimals without leading zeros",
    "chunk size": "c<C>, a decimal without leading zeros",
    "hash": f"{2 * HASH_SIZE} lower-case hex digits",
    "identity": f"i and {2 * DIGEST_SIZE} lower-case hex digits, KVW-IDENT-5",
}


def range_map(start: int, stop: int) -> tuple:
    """The layer map of a container holding model layers [start, stop): receiver layer
    ``start + i`` copies transmitted layer ``i`` (the others, unlisted, are recomputed)."""
    return tuple(LayerMapEntry(start + i, i, "copy") for i in range(stop - start))


def held_layers(header) -> tuple[int, int]:
    """The model layers [start, stop) a cache holds: its range map's, else all of its own."""
    n, m = header.num_layers, header.layer_map
    if m and len(m) == n and m == range_map(m[0].receiver_layer, m[0].receiver_layer + n):
        return m[0].receiver_layer, m[0].receiver_layer + n
    return 0, n


def header_mismatches(header, space: KeySpace, chunk_hash: bytes) -> list[str]:
    """How an object's header disagrees with its key, as far as key and header alone
    decide (KVW-STORE-17): fingerprint, dtype, chunk size, number of layers, token count
    in 1..C, first position a multiple of C, a scheme-1 prefix chain whose hashes are the
    key's hash, and the request identity entry (KVW-IDENT-6: the key's digest, absent on a key
    without one). Empty when the header agrees. (Whether ``first_position`` is the right
    multiple, and whether the architecture matches the neighbouring chunks, needs the
    request's tokens and is the loader's check.)"""
    C, out = space.chunk_tokens, []
    fp = header.model.compat_fingerprint
    if fp != space.fingerprint:
        out.append(f"compat fingerprint {fp.hex() or '(none)'} != key's {space.fingerprint.hex()}")
    if header.dtype != space.dtype:
        out.append(f"dtype {header.dtype} != key's {space.dtype}")
    if header.chunk_tokens != C:
        out.append(f"chunk_tokens {header.chunk_tokens} != key's {C}")
    want_layers = space.layers[1] - space.layers[0]
    if header.num_layers != want_layers:
        out.append(f"{header.num_layers} layers != key's l{space.layers[0]}-{space.layers[1]} ({want_layers})")
    if not 1 <= header.token_count <= C:
        out.append(f"token_count {header.token_count} not in 1..{C}")
    if header.first_position % C:
        out.append(f"first_position {header.first_position} is not a multiple of {C}")
    if header.sparse is not None:
        out.append("a sparse container (the store holds dense chunks)")
    if space.layers[0] > 0 and header.layer_map != range_map(*space.layers):
        out.append(f"its layer map does not say it holds model layers {space.layers[0]}..{space.layers[1] - 1} "
                   "(KVW-STORE-16)")
    p = header.prefix
    if p is None:
        out.append("no prefix chain (KVW-STORE-11 needs one)")
    else:
        if p.scheme != PREFIX_SCHEME:
            out.append(f"prefix chain scheme {p.scheme} != {PREFIX_SCHEME}")
        if p.hashes != bytes(chunk_hash):
            out.append(f"prefix chain hashes {p.hashes.hex()[:80] or '(none)'} != key's hash {bytes(chunk_hash).hex()}")
    got = header.metadata.get(METADATA_KEY)
    if got != space.identity_digest:
        out.append(f"request identity {got.hex() if got is not None else '(none)'} != key's "
                   f"{space.identity_digest.hex() if space.identity_digest is not None else '(none)'} (KVW-IDENT-6)")
    return out


__all__ = ["KEY_VERSION", "LOSSLESS", "KeySpace", "codec_fidelity", "header_mismatches", "held_layers", "range_map"]
