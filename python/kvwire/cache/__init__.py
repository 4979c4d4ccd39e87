"""The encode/decode API: caches as objects and their containers, on ``format`` and ``codecs``.

- ``kvcache``: ``KVCache``, a dense cache in the canonical tensor layout ([heads, tokens,
  dim] per layer, KVW-CHUNK-4; state layers included);
- ``sparse``: ``SparseKVCache``, per-(layer, head) retained tokens (spec/sparse.md);
- ``encoder``: the sans-IO ``Encoder`` and ``iter_buffers``/``encode_bytes``, one encoder for
  dense, state and sparse caches through the header's chunk plan;
- ``reader``: ``open``/``load``/``probe`` and ``Reader``, verified zero-copy access to a
  container in memory or memory-mapped;
- ``decoder``: ``StreamDecoder``, incremental decoding of bytes as they arrive;
- ``files``: ``encode``, ``save`` and ``load`` with typed keywords, atomic file writes with
  ``writev``;
- ``tensors``: numpy/torch views without copies; ``cuda``: decoding onto a CUDA device.

Not a public namespace (docs/api.md): the API is what ``kvwire`` and its public
subpackages list in ``__all__``; modules here may move between releases.
"""
