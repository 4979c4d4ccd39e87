"""Two inference nodes share KV caches through a store (``kvwire.store``): a file store
or Redis.

What it shows: node A (this process) prefills a prompt (a synthetic 4-layer model here,
with a model identity whose fingerprints root the keys) and ``put_cache``s it: one
file-form container per whole chunk of 256 tokens, keyed by the prefix hash chain of the
token ids. Node B (a second process started here, as another machine would be) gets a
longer prompt that shares that prefix: ``lookup`` answers from the store's metadata alone
(one round trip plus the first hit's header, checked against B's model), then
``get_cache`` loads the leading chunks with every checksum verified. B prints a digest
of what it loaded, which A checks against the first chunks of its own cache; B's store
counters show the hits. A model with other weights gets other keys (a miss, never a wrong
cache): B also asks for that.

Run it from the repository root (numpy only; Redis needs redis-py, ``pip install -e '.[redis]'``):

    python examples/shared_store.py                                  # a file store in a temp dir
    python examples/shared_store.py --url file:///var/tmp/kvstore
    python examples/shared_store.py --url redis://127.0.0.1:6379/0   # a running redis-server
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile

import numpy as np

import kvwire
from kvwire.model.identity import make_identity
from kvwire.store import KeySpace, KVStore, open_store

LAYERS, HEADS, DIM, CHUNK = 4, 2, 64, 256


def model(weights: bytes = b"example weights v1"):
    """(architecture, identity, LocalModel) of the pretend model; ``weights`` stands in for
    the fingerprint of its weights (``kvwire.adapters.hf.identity`` hashes real ones)."""
    arch = kvwire.Architecture(tuple(kvwire.LayerSpec("full_attention", HEADS, DIM, DIM) for _ in range(LAYERS)))
    ident = make_identity(arch, "f16", tokenizer=hashlib.sha256(b"bytes tokenizer").digest(),
                          weights=hashlib.sha256(weights).digest(), model_type="llama", model_id="example/tiny")
    return arch, ident, kvwire.LocalModel(arch, "f16", ident)


def prompt(n: int) -> list[int]:
    return list(np.random.default_rng(42).integers(0, 32000, n))


def prefill(tokens) -> kvwire.KVCache:
    """Stands in for the forward pass: K and V per layer, [heads, tokens, head_dim]."""
    rng = np.random.default_rng(len(tokens))
    shape = (HEADS, len(tokens), DIM)
    keys = [rng.standard_normal(shape).astype(np.float16) for _ in range(LAYERS)]
    values = [rng.standard_normal(shape).astype(np.float16) for _ in range(LAYERS)]
    return kvwire.KVCache.from_tensors(keys, values, model=model()[1], chunk_tokens=CHUNK)


def digest(cache: kvwire.KVCache, tokens: int) -> str:
    h = hashlib.sha256()
    for layer in cache.layers:
        for c in ("k", "v"):
            h.update(np.ascontiguousarray(layer[c][:, :tokens]).tobytes())
    return h.hexdigest()


def node_b(url: str, prompt_tokens: int) -> int:
    """The second node: look up a longer prompt with the same prefix, load what is stored."""
    kv = KVStore(open_store(url))
    _, ident, local = model()
    tokens = prompt(prompt_tokens)
    space = KeySpace(ident.compat_fingerprint, "f16", CHUNK, (0, LAYERS))
    hit = kv.lookup(tokens, space, local=local)          # metadata only: no tensor read yet
    got = kv.get_cache(tokens, space, n_chunks=hit.chunks)
    other = model(b"a fine-tune")[1]
    miss = kv.lookup(tokens, KeySpace(other.compat_fingerprint, "f16", CHUNK, (0, LAYERS)))
    print(json.dumps({"hit_chunks": hit.chunks, "verdict": hit.verdict.status, "tokens": got.tokens,
                      "sha256": digest(got.cache, got.tokens), "other_weights_chunks": miss.chunks,
                      "stats": {k: kv.stats()[k] for k in ("hits", "misses")}}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="file://DIR, redis://HOST:PORT/DB or redis-cluster://...; default: a temp dir")
    ap.add_argument("--tokens", type=int, default=700, help="node A's prompt length")
    ap.add_argument("--node-b", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.node_b:
        return node_b(a.url, a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        url = a.url or f"file://{tmp}/kvstore"
        tokens = prompt(a.tokens)
        cache = prefill(tokens)
        put = KVStore(open_store(url)).put_cache(cache, tokens)   # whole chunks only
        print(f"node A: {a.tokens} tokens -> {put.written} chunk objects written at {url} "
              f"({put.bytes_out} bytes; the partial last chunk is not stored)")
        b = subprocess.run([sys.executable, __file__, "--node-b", "--url", url, "--tokens", str(a.tokens + 300)],
                           capture_output=True, text=True, timeout=120, check=False)
        if b.returncode:
            print(b.stderr, file=sys.stderr)
            return 1
        res = json.loads(b.stdout.splitlines()[-1])
        ok = (res["hit_chunks"] == a.tokens // CHUNK and res["sha256"] == digest(cache, res["tokens"])
              and res["other_weights_chunks"] == 0)
        print(f"node B (fresh process): {res['hit_chunks']} chunks hit ({res['tokens']} tokens), "
              f"verdict {res['verdict']}, identical to node A's: {res['sha256'] == digest(cache, res['tokens'])}; "
              f"a model with other weights: {res['other_weights_chunks']} chunks; B's counters {res['stats']}")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
