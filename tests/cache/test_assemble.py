"""Layer assembly on threads through libkvwire (kvwire.cache.assemble) against the numpy
reference path: the same bytes for every codec, thread count and destination layout
(fresh, caller buffers, head-strided views, torch CPU tensors), the same error for a
corrupted body whichever thread meets it, and clear errors for a bad ``threads``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvwire
from forge import random_tensor, small_cache, xor_byte
from kvwire.cache import assemble
from kvwire.codecs import native
from kvwire.format.errors import ChecksumError

CODECS = ["raw", "zstd", "byteplane", "fp8-e4m3", "fp8-e4m3-token", "int8", "int8-asym", "int4-g32", "int4-g32-zstd",
          "kivi4", "kivi2"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


def cache_of(seed: int, heads: int = 3, dim: int = 16, tokens: int = 300, layers: int = 2, dtype: str = "bf16"):
    return small_cache(layers, heads, dim, tokens, dtype=dtype, chunk_tokens=64, seed=seed, compressible=False)


def numpy_load(data):
    native.disable()
    return kvwire.load(data)


def layers_bytes(c: kvwire.KVCache) -> list:
    return [np.ascontiguousarray(layer[k]).view(np.uint8).tobytes() for layer in c.layers for k in sorted(layer)]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_load_equals_numpy(lib, codec, threads):
    data = kvwire.encode(cache_of(1), codec=codec)
    ref = numpy_load(data)
    native.enable(lib)
    with kvwire.open(data) as r:
        got = r.load(threads=threads)
    assert layers_bytes(got) == layers_bytes(ref)


@SETTINGS
@given(seed=st.integers(0, 2**16), codec=st.sampled_from(CODECS), threads=st.integers(1, 4),
       heads=st.integers(1, 4), tokens=st.integers(1, 700), dtype=st.sampled_from(["bf16", "f16", "f32"]))
def test_layer_out_property(lib, seed, codec, threads, heads, tokens, dtype):
    """Any cache, codec and thread count: layer(out=) of caller buffers and of head-strided
    views (a bigger buffer's slices) are byte-identical with the numpy path."""
    data = kvwire.encode(cache_of(seed, heads=heads, tokens=tokens, dtype=dtype), codec=codec)
    ref = numpy_load(data)
    native.enable(lib)
    with kvwire.open(data) as r:
        for i, layer in enumerate(ref.layers):
            shape = layer["k"].shape
            big = {c: np.zeros((shape[0] * 2,) + shape[1:], layer[c].dtype) for c in layer}
            outs = {c: big[c][::2] for c in layer}  # head stride twice the run: runs still contiguous
            r.layer(i, out=outs, threads=threads)
            for c in layer:
                assert outs[c].view(np.uint8).tobytes() == np.ascontiguousarray(layer[c]).view(np.uint8).tobytes()
                assert not big[c][1::2].view(np.uint8).any()  # nothing written between the heads


def test_non_contiguous_runs_take_the_numpy_path(lib):
    """A destination whose token rows are not contiguous (a transposed view) is filled by
    numpy, correctly, with native on."""
    data = kvwire.encode(cache_of(2), codec="int8")
    ref = numpy_load(data)
    native.enable(lib)
    with kvwire.open(data) as r:
        k = ref.layers[0]["k"]
        t = np.zeros((k.shape[0], k.shape[2], k.shape[1]), k.dtype)
        outs = {"k": t.transpose(0, 2, 1), "v": np.zeros_like(ref.layers[0]["v"])}
        assert not assemble.runs_contiguous(outs["k"])
        r.layer(0, out=outs, threads=2)
    assert np.ascontiguousarray(outs["k"]).view(np.uint8).tobytes() == k.view(np.uint8).tobytes()


def test_torch_cpu_destination(lib):
    torch = pytest.importorskip("torch")
    data = kvwire.encode(cache_of(3), codec="fp8-e4m3")
    ref = numpy_load(data)
    native.enable(lib)
    got = kvwire.open(data).load(backend="torch", threads=2)
    for a, b in zip(got.layers, ref.layers):
        assert isinstance(a["k"], torch.Tensor)
        assert a["k"].view(torch.int16).numpy().tobytes() == b["k"].view(np.uint8).tobytes()


@pytest.mark.parametrize("codec", ["raw", "int4-g32"])
def test_corrupt_body_raises_with_threads(lib, codec):
    """A flipped byte in one body: ChecksumError (KVW-CSUM-1) on every thread count, and with
    verify=False the numpy and native paths agree on what they decode."""
    data = kvwire.encode(cache_of(4, tokens=600), codec=codec)
    with kvwire.open(data) as r:
        c = r.info(r.chunk_count // 2)
    bad = xor_byte(data, c.offset + 1)
    for threads in (1, 2, 4):
        native.enable(lib)
        with kvwire.open(bad) as r:
            with pytest.raises(ChecksumError) as e:
                r.load(threads=threads)
        assert e.value.code == "BODY_CHECKSUM" and e.value.rule == "KVW-CSUM-1"
    if codec == "raw":
        native.disable()
        ref = kvwire.open(bad).load(verify=False)
        native.enable(lib)
        got = kvwire.open(bad).load(verify=False, threads=2)
        assert layers_bytes(got) == layers_bytes(ref)


def test_threads_argument(lib):
    data = kvwire.encode(cache_of(5))
    native.disable()
    assert assemble.resolve_threads(None) == 1  # numpy: one thread
    native.enable(lib)
    assert 1 <= assemble.resolve_threads(None) <= assemble.MAX_THREADS
    with kvwire.open(data) as r:
        with pytest.raises(ValueError, match="at least 1"):
            r.load(threads=0)
        with pytest.raises(ValueError, match="non-negative"):
            r.layer(0, threads=-2)
        with pytest.raises(TypeError, match="integer"):
            r.layer(0, threads="2")


def test_without_native_threads_change_nothing(lib):
    """Native off: threads > 1 is accepted and the numpy path fills the buffers."""
    rng = np.random.default_rng(6)
    k = [random_tensor(rng, (2, 100, 8), "f16") for _ in range(2)]
    data = kvwire.encode(kvwire.KVCache.from_tensors(k, k, chunk_tokens=32), codec="zstd")
    native.disable()
    got = kvwire.open(data).load(threads=4)
    assert np.array_equal(got.layers[1]["k"].view(np.uint8), k[1].view(np.uint8))


@SETTINGS
@given(n_runs=st.integers(0, 5), run=st.integers(1, 70000), gap=st.integers(0, 100), seed=st.integers(0, 2**16))
def test_copy_runs_hashes_like_xxhash(lib, n_runs, run, gap, seed):
    """libkvwire's XXH3 (inline, AVX2 where the CPU has it: c/src/common/hash.c), streamed block by
    block by kvw_copy_checked or in one call when hashing only, equals xxhash-python's; the
    runs land at their stride and nothing between them is written."""
    import xxhash

    native.enable(lib)
    src = np.random.default_rng(seed).integers(0, 256, n_runs * run, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src)
    dst = np.zeros(max(n_runs * (run + gap), 1), np.uint8)
    native.copy_runs(src.ctypes.data, src.nbytes, dst.ctypes.data, run, run + gap, checksum=want)
    view = np.lib.stride_tricks.as_strided(dst, (n_runs, run), (run + gap, 1))
    assert np.array_equal(view.reshape(-1), src)
    assert int(dst.sum()) == int(src.sum())  # the gaps stay zero
    native.copy_runs(src.ctypes.data, src.nbytes, 0, 0, 0, checksum=want)  # hash only
    if src.nbytes:
        with pytest.raises(ChecksumError) as e:
            native.copy_runs(src.ctypes.data, src.nbytes, dst.ctypes.data, run, run + gap, checksum=want ^ 1)
        assert e.value.rule == "KVW-CSUM-1"
        with pytest.raises(ChecksumError):
            native.copy_runs(src.ctypes.data, src.nbytes, 0, 0, 0, checksum=want ^ (1 << 63))


def test_copy_runs_misuse(lib):
    native.enable(lib)
    a = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="whole number of runs"):
        native.copy_runs(a.ctypes.data, 100, a.ctypes.data, 30, 30)
    with pytest.raises(ValueError, match="whole number of runs"):
        native.copy_runs(0, 100, a.ctypes.data, 10, 10)
    native.disable()
    with pytest.raises(RuntimeError, match="not enabled"):
        native.copy_runs(a.ctypes.data, 100, a.ctypes.data, 10, 10)


@pytest.mark.parametrize("codec", CODECS)
def test_native_encode_writes_the_same_container(lib, codec):
    """kvwire.encode with native codecs on (libkvwire's lossy encoders, codecs.choice) writes
    byte for byte the container numpy writes, near-extreme and non-finite chunks included
    (those fall back to a lossless codec the same way)."""
    cache = cache_of(7, tokens=520)
    k = cache.layers[0]["k"]
    k[0, 3, :] = np.float32(3e38)  # beyond bf16's finite range after rounding: a careful-path group
    k[1, 70, 2] = np.nan  # a chunk int_affine refuses (KVW-LOSSY-6)
    native.disable()
    ref = kvwire.encode(cache, codec=codec)
    native.enable(lib)
    assert kvwire.encode(cache, codec=codec) == ref
