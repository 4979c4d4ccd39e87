"""A producer that builds a ``kvwire.Header`` itself and encodes layer by layer.

What it shows: an engine that has no ``KVCache`` object (it computes one layer at a time)
describes the cache up front in a ``Header`` (the per-layer geometry in an
``Architecture`` of ``LayerSpec``s, the token count, the storage dtype, the chunk size and
the model's identity), then hands each chunk to the sans-IO ``kvwire.Encoder`` as soon as
it exists: ``begin()`` returns the header's bytes, ``chunk(layer, component, token_start,
tensor)`` each chunk's frame and body, ``end(form=...)`` the closing bytes. Every call
returns buffers to send (here: to write to a file); nothing is buffered inside, so layer 0
is on the wire before layer 1 is computed. The result is read back with ``kvwire.load``
and compared with the tensors the "engine" produced.

Run it from the repository root (numpy only):

    python examples/layerwise_producer.py [--layers 4] [--tokens 600] [--out produced.kvw]
"""

from __future__ import annotations

import argparse

import numpy as np

import kvwire


def build_header(layers: int, kv_heads: int, head_dim: int, tokens: int, chunk_tokens: int) -> kvwire.Header:
    """The header a Llama-shaped model with grouped-query attention would declare."""
    specs = tuple(kvwire.LayerSpec("full_attention", kv_heads, head_dim, head_dim) for _ in range(layers))
    arch = kvwire.Architecture(specs)
    return kvwire.Header(arch, token_count=tokens, dtype="f16", chunk_tokens=chunk_tokens,
                         model=kvwire.ModelIdentity(model_type="llama", model_id="example/tiny-llama"))


def compute_layer(i: int, kv_heads: int, head_dim: int, tokens: int):
    """Stands in for the engine's forward pass of layer ``i``: K and V as [heads, tokens, dim]."""
    rng = np.random.default_rng(i)
    k = rng.standard_normal((kv_heads, tokens, head_dim)).astype(np.float16)
    v = rng.standard_normal((kv_heads, tokens, head_dim)).astype(np.float16)
    return k, v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--codec", default="zstd", help="raw, zstd or a preset such as int8")
    ap.add_argument("--out", default="produced.kvw")
    a = ap.parse_args(argv)

    header = build_header(a.layers, a.kv_heads, a.head_dim, a.tokens, a.chunk_tokens)
    enc = kvwire.Encoder(header, codec=a.codec)
    produced = []
    with open(a.out, "wb") as f:
        f.writelines(enc.begin())                                  # the header goes out first
        for i in range(a.layers):
            k, v = compute_layer(i, a.kv_heads, a.head_dim, a.tokens)
            produced.append({"k": k, "v": v})
            for t0 in range(0, a.tokens, a.chunk_tokens):          # one chunk per cell of the grid
                f.writelines(enc.chunk(i, "k", t0, k[:, t0:t0 + a.chunk_tokens]))
                f.writelines(enc.chunk(i, "v", t0, v[:, t0:t0 + a.chunk_tokens]))
            print(f"layer {i} sent ({enc.position} bytes so far)")
        f.writelines(enc.end(form="stream"))

    back = kvwire.load(a.out)
    same = all(np.array_equal(back.layers[i][c], produced[i][c]) for i in range(a.layers) for c in "kv")
    print(f"{a.out}: {back.header.token_count} tokens x {back.header.arch.num_layers} layers, "
          f"model {back.header.model.model_id}, bit-exact: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
