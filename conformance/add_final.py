"""Conformance vectors of the spec 1.0 Final corrections (issue 13), added to format 1.0
after its vectors were frozen: the places where an independent reader had to guess.

``gen_final(g)`` is registered in ``generate.py``'s ``ADDITIONS`` as ``final_1_0``;
``generate.py --add final_1_0`` appends these vectors to a version folder.
"""

from __future__ import annotations

import dataclasses

import forge
import kvwire
from add_crossmodel import FULL, JAMBA, PRODUCER, STATE_BIT, _cache
from kvwire import LayerSpec, PrefixChain, StateTensor
from kvwire.format.codec_specs import CodecSpec
from kvwire.format.header import Architecture, Header, TokenRange
from kvwire.format.prefix import prefix_hashes, prefix_root


def gen_final(g) -> None:
    """Valid: a prefix chain over 2^15 token chunks, segments with state layers and with prefix
    chains. Invalid: each reader behaviour the corrections changed or pinned."""
    I, Wr = g.invalid, forge.wrap_header

    def hdr(h: Header) -> bytes:
        return Wr(forge.header_of(h))

    # KVW-PREFIX-7: 32,769 token chunks (1,048,608 bytes of hashes, over the old 2^20 cap)
    n = 32769
    arch = Architecture((LayerSpec("sliding_attention", 1, 4, 4, window=4),))
    tokens = [(i * 31) % 50000 for i in range(n)]
    hp = Header(arch, token_count=n, dtype="f16", chunk_tokens=1, producer=PRODUCER,
                layer_tokens=(TokenRange(n - 1, 1),), prefix=PrefixChain(1, prefix_root(b"", 1),
                                                                          prefix_hashes(tokens, 1, b"")))
    cp = _cache(hp, 13001)
    g.valid("final-prefix7-chain-over-2-20-bytes", kvwire.encode(cp, form="stream"), cp,
            writer={"form": "stream", "codec": "raw"}, rules=["KVW-PREFIX-7", "KVW-PREFIX-3", "KVW-LIM-2"],
            description="a prefix chain of 32,769 token chunks (chunk_tokens 1): 1,048,608 bytes of hashes, more "
                        "than 2^20 and within MAX_PREFIX_HASH_BYTES = 2^23; a sliding layer holding only the last "
                        "token keeps the container small")

    # KVW-STATE-2: the vector bounds come first, then STATE_INVALID
    h0 = Header(Architecture((FULL, JAMBA, FULL)), token_count=0, dtype="f16", chunk_tokens=4, producer=PRODUCER,
                required_features=STATE_BIT)

    def state_spec(**kw) -> bytes:
        return hdr(h0.replace(arch=Architecture((FULL, dataclasses.replace(JAMBA, **kw), FULL))))

    I("final-state2-name-257-bytes", state_spec(state_tensors=(StateTensor("c" * 257, (1, 4, 3)),)),
      rule="KVW-STATE-2", code="STATE_INVALID",
      description="a state tensor name of 257 bytes: within the string limit (65,536), so STATE_INVALID, not "
                  "LIMIT_EXCEEDED")
    I("final-state2-nine-dimensions", state_spec(state_tensors=(StateTensor("conv", (1,) * 9),)),
      rule="KVW-STATE-2", code="STATE_INVALID",
      description="a state tensor shape of 9 dimensions: within the vector limit (4096), so STATE_INVALID")
    I("final-state2-source-layer", state_spec(source_layer=0), rule="KVW-STATE-2", code="STATE_INVALID",
      rules=["KVW-ARCH-4"],
      description="a state layer with source_layer 0: STATE-2 alone governs a state layer's fields, so "
                  "STATE_INVALID, not ARCH_INVALID (ARCH-4)")

    # KVW-CSPEC-10 / KVW-EVOL-10: codec_specs is read whatever bits are set
    hc = Header(Architecture((FULL,)), token_count=0, dtype="bf16", chunk_tokens=4, producer=PRODUCER,
                codec_specs=(CodecSpec("byteplane_zstd"),))
    I("final-cspec10-specs-without-bit", hdr(hc), rule="KVW-CSPEC-10", code="CODEC_SPEC_INVALID",
      rules=["KVW-EVOL-10"],
      description="Header.codec_specs with one spec but required bit 0 (codec_specs) not set: the field is part "
                  "of the 1.0 schema and is rejected, not ignored")

    # KVW-STREAM-8: segments with a state layer; the reassembled state is the last segment's
    hs = Header(Architecture((FULL, JAMBA)), dtype="f16", chunk_tokens=4, producer=PRODUCER,
                required_features=STATE_BIT)
    seq = _cache(hs.replace(token_count=10), 13002)

    def part(s: int, e: int, seed: int | None = None) -> kvwire.KVCache:
        h = hs.replace(first_position=s, token_count=e - s)
        state = _cache(h, seed).layers[1] if seed is not None else seq.layers[1]
        return kvwire.KVCache(h, [{c: x[:, s:e, :] for c, x in seq.layers[0].items()}, state])

    def stream(*parts) -> bytes:
        return b"".join(kvwire.encode(p, form="stream") for p in parts)

    last = part(8, 10, 13004)
    want = kvwire.KVCache(hs.replace(token_count=10), [seq.layers[0], last.layers[1]])
    g.valid("final-stream8-segments-state-layer", stream(part(0, 4, 13003), part(4, 8, 13005), part(8, 9, 13006),
                                                         last), want, segments=4,
            rules=["KVW-STREAM-8", "KVW-STREAM-6"],
            description="segments [0, 4), [4, 8), partial [8, 9), [8, 10) superseding it, with a full-attention "
                        "layer and a state layer: every segment carries its own state; the reassembled state is "
                        "the last segment's")

    # KVW-STREAM-9: segments with prefix chains
    hq = Header(Architecture((FULL,)), dtype="f16", chunk_tokens=4, producer=PRODUCER)
    toks = [(i * 7) % 1000 for i in range(10)]
    chain = prefix_hashes(toks, 4, b"")
    seq2 = _cache(hq.replace(token_count=10), 13007)

    def pseg(s: int, e: int, root=None) -> kvwire.KVCache:
        k0, k1 = s // 4, -(-e // 4)
        sub = prefix_hashes(toks[:e], 4, b"")[32 * k0:32 * k1]
        r = root if root is not None else (prefix_root(b"", 4) if s == 0 else chain[32 * (k0 - 1):32 * k0])
        h = hq.replace(first_position=s, token_count=e - s, prefix=PrefixChain(1, r, sub))
        return kvwire.KVCache(h, [{c: x[:, s:e, :] for c, x in seq2.layers[0].items()}])

    want2 = kvwire.KVCache(hq.replace(token_count=10, prefix=PrefixChain(1, prefix_root(b"", 4), chain)),
                           seq2.layers)
    g.valid("final-stream9-segments-prefix-chain", stream(pseg(0, 4), pseg(4, 6), pseg(4, 10)), want2, segments=3,
            rules=["KVW-STREAM-9", "KVW-STREAM-7"],
            description="segments [0, 4), partial [4, 6), [4, 10) superseding it, each with its own prefix chain "
                        "(root = the chain value before its first token); the reassembled cache has the whole "
                        "chain of 3 hashes")
    I("final-stream9-segment-root-breaks-chain", stream(pseg(0, 4), pseg(4, 8, root=prefix_root(b"", 4))),
      rule="KVW-STREAM-9", code="SEGMENT_MISMATCH", segments=True,
      description="the second segment's prefix root is the model root R0, not the hash of chunk 0 of the sequence")
    I("final-stream9-chain-in-one-segment-only", stream(pseg(0, 4), kvwire.KVCache(
        hq.replace(first_position=4, token_count=4), [{c: x[:, 4:8, :] for c, x in seq2.layers[0].items()}])),
      rule="KVW-STREAM-5", code="SEGMENT_MISMATCH", segments=True, rules=["KVW-STREAM-7"],
      description="the first segment carries a prefix chain and the second none")

    # KVW-STREAM-10: no segment at all
    I("final-stream10-no-segment", b"", rule="KVW-STREAM-10", code="TRUNCATED", segments=True,
      description="an empty stream: a sequence has at least one segment")


ADDITION = {
    "make": gen_final,
    "spec": "spec/kvwire-v1.md 1.0 Final corrections (issue 13): KVW-PREFIX-7, KVW-STATE-2 bounds and precedence, "
            "KVW-CSPEC-10 / KVW-EVOL-10, segments KVW-STREAM-7..10",
    "rules_without_vector": {
        "KVW-HDR-21": "The FlatBuffers check order pins which of FB_BOUNDS, FB_ALIGNMENT, LIMIT_EXCEEDED a reader "
                      "reports; the frozen fb-* vectors each break one check (tests/format/test_rules.py covers the order).",
        "KVW-EVOL-11": "Binds revisions of the spec, not containers.",
        "KVW-CODEC-2 (codes)": "Clarified text only: invalid/codec2-frame-cut and codec2-declares-more-than-held "
                               "already want DECODE_FAILED.",
        "KVW-PREFIX-7 (over the limit)": "A chain over 2^23 bytes needs a header over 8 MiB; tests/format/test_rules.py "
                                         "covers LIMIT_EXCEEDED.",
    },
}
