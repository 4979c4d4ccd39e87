"""Seeded synthetic caches, for demos, tests and benchmarks.

Values are drawn so that they look like a KV cache to a compressor (bf16 normals with a
few large-magnitude channels in K, as trained models have), not like uniform noise.
"""

from __future__ import annotations

import numpy as np

from ..cache.kvcache import KVCache
from ..format import registry as R
from ..format.header import Architecture, Header, ModelIdentity


def synth_cache(layers: int = 4, kv_heads: int = 8, head_dim: int = 128, tokens: int = 512, *,
                dtype: str = "bf16", chunk_tokens: int = 256, seed: int = 0, model_type: str = "synthetic") -> KVCache:
    rng = np.random.default_rng(seed)
    np_dtype = R.dtype_info(dtype)[2]
    outliers = rng.random(head_dim) < 0.05
    scale = np.where(outliers, 8.0, 1.0).astype(np.float32)
    out = []
    for _ in range(layers):
        k = rng.standard_normal((kv_heads, tokens, head_dim), dtype=np.float32) * scale
        v = rng.standard_normal((kv_heads, tokens, head_dim), dtype=np.float32)
        if dtype in ("i8", "u8"):
            k, v = np.clip(k * 16, -128, 127), np.clip(v * 16, -128, 127)
            if dtype == "u8":
                k, v = k + 128, v + 128
        out.append({"k": k.astype(np_dtype), "v": v.astype(np_dtype)})
    header = Header(
        arch=Architecture.uniform(layers, kv_heads, head_dim),
        token_count=tokens,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
        model=ModelIdentity(model_type=model_type, model_id=f"synthetic/seed-{seed}"),
    )
    return KVCache(header, out)
