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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs.presets import PRESETS
from ..format import registry as R
from ..format.prefix import HASH_SIZE, prefix_hashes

KEY_VERSION = "kvw1"
LOSSLESS = "lossless"
LOSSLESS_CODECS = ("raw", "zstd", "byteplane")
MAX_FINGERPRINT = 64


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
    """The key root of one model, dtype, shard, layer range, fidelity and chunk size."""

    fingerprint: bytes
    dtype: str
    chunk_tokens: int
    layers: tuple[int, int]
    tp_rank: int = 0
    tp_size: int = 1
    fidelity: str = LOSSLESS

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
        if self.fidelity != LOSSLESS and self.fidelity not in PRESETS:
            raise ValueError(f"fidelity {self.fidelity!r} is neither 'lossless' nor a lossy preset name")

    @classmethod
    def of(cls, header, *, tp_rank: int = 0, tp_size: int = 1, codec="raw") -> "KeySpace":
        """The key space of a cache's header (all of its layers)."""
        return cls(header.model.compat_fingerprint, header.dtype, header.chunk_tokens, (0, header.num_layers),
                   tp_rank, tp_size, codec_fidelity(codec))

    @property
    def root(self) -> str:
        a, b = self.layers
        return (f"{KEY_VERSION}/{self.fingerprint.hex()}/{self.dtype}/tp{self.tp_rank}of{self.tp_size}/l{a}-{b}/"
                f"{self.fidelity}/c{self.chunk_tokens}/")

    def key(self, chunk_hash: bytes) -> str:
        h = bytes(chunk_hash)
        if len(h) != HASH_SIZE:
            raise ValueError(f"a chunk hash is {HASH_SIZE} bytes, not {len(h)}")
        return self.root + h.hex()

    def hashes(self, tokens, *, partial: bool = False) -> list[bytes]:
        """The chain's hashes of the whole chunks of ``tokens`` (and of the trailing partial
        one when ``partial``), from position 0."""
        raw = prefix_hashes(tokens, self.chunk_tokens, self.fingerprint)
        out = [raw[i:i + HASH_SIZE] for i in range(0, len(raw), HASH_SIZE)]
        if not partial and len(tokens) % self.chunk_tokens:
            out.pop()
        return out

    def keys(self, tokens, *, partial: bool = False) -> list[str]:
        """The keys of the chunk objects of ``tokens``, in order (KVW-STORE-11)."""
        return [self.key(h) for h in self.hashes(tokens, partial=partial)]


__all__ = ["KEY_VERSION", "LOSSLESS", "KeySpace", "codec_fidelity"]
