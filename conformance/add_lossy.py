"""Conformance vectors for lossy codecs at the extremes of the header dtype
(spec/codecs.md KVW-LOSSY-5/6, section 3.1), appended to format 1.0 with
``generate.py --add lossy_extremes``.

One valid container per header dtype (f16, bf16, f32): each layer uses one lossy preset
of the reference codec, and each layer's tokens hold, chunk by chunk, the largest finite
values, small multiples of the smallest subnormal, mixed magnitudes, all-zero groups, NaN
and infinities, and ordinary values. The reference writer encodes them; the expected
decoded values (the JSON twin's tensors) come from ``tests/codec_reference.py``, the
literal decoder of the spec text, and the generator checks that they are finite wherever
the input is, that no chunk with nonzero input decodes to zeros, and that the chunks
holding NaN or infinity are stored losslessly, bit for bit.
"""

from __future__ import annotations

import numpy as np

import kvwire
from add_codecs import PRODUCER, expected
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec

PRESETS = ("int8", "int8-asym", "int4-g32", "kivi2", "kivi4", "fp8-e4m3", "fp8-e4m3-token", "fp8-e5m2",
           "fp8-e4m3fnuz")
LARGEST = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}
SMALLEST = {"f16": 2.0 ** -24, "bf16": 2.0 ** -133, "f32": 2.0 ** -149}
CHUNK, DIM = 32, 16
PATTERNS = ("largest", "subnormal", "mixed", "zeros", "non-finite", "ordinary")  # one chunk each


def _tensor(rng, dtype: str) -> np.ndarray:
    """[1, 6 * CHUNK, DIM] of ``dtype``: the PATTERNS, one chunk of tokens each."""
    top, sub = LARGEST[dtype], SMALLEST[dtype]
    shape = (1, CHUNK, DIM)
    g = rng.standard_normal(shape)
    nf = g.copy()
    nf[0, 3, :3] = [np.nan, np.inf, -np.inf]
    parts = [
        np.sign(g) * top * (1 - rng.integers(0, 3, shape) * 2.0 ** -7),  # +-max and neighbours
        rng.integers(-8, 9, shape) * sub,  # small multiples of the smallest subnormal
        g * np.where(rng.random(shape) < 0.5, top / 8, top * 2.0 ** -40),  # mixed magnitudes in every group
        np.where(np.arange(CHUNK)[:, None] % 2 == 0, 0.0, g) * (np.arange(DIM) % 3 != 0),  # zero groups
        nf,  # NaN and +-inf: stored losslessly (KVW-LOSSY-6)
        g,
    ]
    x = np.concatenate([np.clip(p, -top, top) if i != 4 else p for i, p in enumerate(parts)], axis=1)
    return x.astype(R.DTYPES[dtype][2])


def gen_lossy_extremes(g) -> None:
    """spec/codecs.md KVW-LOSSY-5 (finite, not all-zero), KVW-LOSSY-6 (non-finite input
    stored losslessly), section 3.1 (scales at the extremes)."""
    for dtype, seed in (("f16", 6101), ("bf16", 6102), ("f32", 6103)):
        rng = np.random.default_rng(seed)
        h = Header(Architecture((LayerSpec("full_attention", 1, DIM, DIM),) * len(PRESETS)),
                   token_count=CHUNK * len(PATTERNS), dtype=dtype, chunk_tokens=CHUNK, producer=PRODUCER)
        layers = [{c: _tensor(rng, dtype) for c in ("k", "v")} for _ in PRESETS]
        cache = kvwire.KVCache(h, layers)
        choice = {(i, c): p for i, p in enumerate(PRESETS) for c in ("k", "v")}
        data = kvwire.encode(cache, codec=choice)
        exp = expected(data)
        with kvwire.open(data) as r:
            recs = [(r.info(i).layer, r.info(i).component, r.info(i).token_start, int(rec["reserved0"]))
                    for i, rec in enumerate(r.records)]
        lossy = 0
        for layer, comp, t0, spec in recs:
            x = layers[layer][comp][:, t0 : t0 + CHUNK]
            y = exp.layers[layer][comp][:, t0 : t0 + CHUNK]
            xf, yf = x.astype(np.float32), y.astype(np.float32)
            if PATTERNS[t0 // CHUNK] == "non-finite":
                assert y.tobytes() == x.tobytes(), (dtype, layer, comp)  # bit for bit, NaN payloads too
                assert spec == 0 or PRESETS[layer].startswith("kivi"), PRESETS[layer]  # kivi: residual tokens
                continue
            assert np.isfinite(yf).all(), (dtype, PRESETS[layer], comp, t0)  # KVW-LOSSY-5 (a)
            assert (yf != 0).any() or not (xf != 0).any(), (dtype, PRESETS[layer], comp, t0)  # (b), per chunk
            lossy += spec != 0
        assert lossy >= len(PRESETS) * 2 * 3, (dtype, lossy)  # most extreme chunks stay lossy
        g.valid(f"lossy-extremes-{dtype}", data, exp,
                rules=["KVW-LOSSY-5", "KVW-LOSSY-6", "KVW-LOSSY-4", "KVW-CSPEC-9", "KVW-CSPEC-10"],
                description=f"{dtype} cache, one lossy preset per layer ({', '.join(PRESETS)}), K and V each "
                            f"{len(PATTERNS)} chunks of {CHUNK} tokens (1 head, dim {DIM}): "
                            f"{', '.join(PATTERNS)}. Every finite input decodes finite and no chunk with "
                            "nonzero input decodes to zeros (scales chosen after rounding: f16 +-65504 under "
                            "int8 uses the scale 515.5, not 516); chunks a preset cannot carry faithfully and "
                            "the NaN/inf chunk are raw or zstd records (codec_spec 0); expected values from "
                            "the literal decoder", expect_header=exp.header)


ADDITION = {
    "make": gen_lossy_extremes,
    "spec": "spec/codecs.md KVW-LOSSY-5, KVW-LOSSY-6 and section 3.1 (lossy codecs at the extremes)",
    "rules_without_vector": {
        "KVW-LOSSY-5 (refusal)": "Writer-only: which chunks a writer stores losslessly is its choice within the "
                                 "rule; the vectors show the reference writer's, and readers decode every body "
                                 "as before.",
    },
}
