"""Issue 16 item 5: choosing a codec (spec/codecs.md, docs/codecs.md).

A codec map key that matches no chunk is a ValueError naming the valid keys (it silently
wrote raw); a codec that stores a cache in more bytes than raw warns (CodecGrowthWarning);
valid maps still round trip (property test).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.codecs import CodecGrowthWarning
from kvwire.format.codec_specs import CodecSpec


def cache(tokens=64, head_dim=16, layers=2, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal((2, tokens, head_dim)).astype(dtype) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(kv, [x * 0.5 for x in kv])


@pytest.mark.parametrize("bad", [{"x": "int8"}, {(5, "k"): "int8"}, {(0, "latent"): "int8"}, {"latent": "int8"},
                                 {(0, "k"): "int8", "kk": "zstd"}, {0: "int8"},
                                 {(0, "positions"): "zstd"}])
def test_codec_map_key_matching_nothing_is_a_value_error_naming_the_keys(bad):
    """A mistyped codec map key (today {"x": "int8"} silently wrote raw) is refused, naming the valid keys."""
    with pytest.raises(ValueError, match=r"match no chunk of this cache.*None .*'k', 'v'.*\[0, 2\)"):
        kvwire.encode(cache(), codec=bad)


@pytest.mark.parametrize("good", [{"k": "int8"}, {(1, "v"): "int8", None: "zstd"}, {(0, "k"): "int8", "v": "fp8-e4m3"},
                                  {"k": "int8", "latent": "int8"}])
def test_codec_map_valid_keys_still_encode_lossy_where_asked(good):
    """Valid keys keep working (a preset-like map may name a component other layers have)."""
    data = kvwire.encode(cache(), codec=good)
    r = kvwire.Reader(data)
    assert r.header.codec_specs  # the lossy spec was really applied, not raw
    assert kvwire.check_compatible(r.header, kvwire.LocalModel(r.header.arch, r.header.dtype)).notes


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.sampled_from([None, "k", "v", (0, "k"), (0, "v"), (1, "k"), (1, "v")]), min_size=1,
                     max_size=4, unique=True),
       codec=st.sampled_from(["raw", "zstd", "byteplane"]))
def test_codec_map_round_trip_property(keys, codec):
    """Any map of valid keys to lossless codecs decodes bit for bit."""
    c = cache(tokens=20)
    out = kvwire.Reader(kvwire.encode(c, codec={k: codec for k in keys})).load()
    pairs = list(zip(c.chunk_arrays(), out.chunk_arrays()))
    assert len(pairs) == 4
    for (chunk, a), (chunk2, b) in pairs:
        assert chunk == chunk2 and np.array_equal(np.asarray(a), np.asarray(b))


def test_codec_growth_warning_when_stored_exceeds_raw():
    """A codec whose bodies exceed the raw elements warns, naming both sizes; the bytes still decode."""
    tiny_groups = CodecSpec("int_affine", bits=8, group_size=2, group_axis="channels")  # f32 scale+zero per 2
    c = cache()
    with pytest.warns(CodecGrowthWarning, match=r"more than its \d+ raw f16 bytes \(0\.\d\dx\)") as got:
        data = kvwire.encode(c, codec=tiny_groups)
    assert got[0].filename == __file__  # points at the caller's line, not kvwire's
    assert kvwire.Reader(data).load().header.token_count == c.header.token_count
    assert issubclass(CodecGrowthWarning, UserWarning)


@pytest.mark.parametrize("codec", ["raw", "zstd", "byteplane", "int8", "fp8-e4m3", "int4-g32-zstd", "kivi2",
                                   "kivi4"])
def test_no_growth_warning_for_presets_on_a_200_token_cache(codec):
    """The presets never grow a 200-token f16 cache (kivi2 at 200 tokens measures about 1.4x: its last
    128 tokens stay f16), so no warning; lossless raw fallbacks never warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CodecGrowthWarning)
        data = kvwire.encode(cache(tokens=200, head_dim=64), codec=codec)
    raw = len(kvwire.encode(cache(tokens=200, head_dim=64)))
    assert len(data) <= raw + 1024  # header codec specs only


def test_growth_warning_from_the_encoder_and_save(tmp_path):
    """Encoder.end() and kvwire.save warn too (the check sits where the last record is known)."""
    tiny_groups = CodecSpec("int_affine", bits=8, group_size=2, group_axis="channels")
    c = cache()
    with pytest.warns(CodecGrowthWarning):
        kvwire.save(tmp_path / "c.kvw", c, codec=tiny_groups)
    enc = kvwire.cache.encoder.Encoder(c.header, codec=tiny_groups)
    enc.begin()
    for chunk, data in c.chunk_arrays():
        enc.put(chunk, data)
    with pytest.warns(CodecGrowthWarning) as got:
        enc.end()
    assert got[0].filename == __file__
