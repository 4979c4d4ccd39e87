"""Cross-model reuse (spec/crossmodel.md), on the format and the cache API.

- ``identity``: canonical JSON and the config, tokenizer, weights, per-layer and compat
  fingerprints of ``ModelIdentity`` (KVW-ID);
- ``compat``: ``check_compatible``, the two-tier check decided from a header alone (KVW-XM);
- ``prefix``: ``covered_tokens`` and ``PrefixIndex``, cache hits from prefix chains (KVW-PREFIX);
- ``rope``: RoPE re-positioning of cached keys (KVW-ROPE).

Not a public namespace (docs/api.md): the API is what ``kvwire`` and its public
subpackages list in ``__all__``; modules here may move between releases.
"""
