"""kvwire.load(..., device="cuda"): bit-exact through the pinned staging ring."""

import numpy as np
import pytest

import forge
import kvwire
from kvwire.format import registry as R

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch.cuda.is_available() is False: no CUDA device to load onto")


def _host_bytes(t) -> np.ndarray:
    from kvwire.cache.tensors import as_numpy

    return as_numpy(t.cpu()).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("form", ["file", "stream"])
def test_cuda_load_is_bit_exact_for_every_dtype(codec, form):
    for dtype in sorted(R.DTYPES):
        cache = forge.small_cache(3, 2, 16, 70, dtype=dtype, chunk_tokens=16, compressible=(codec == "zstd"),
                                  head_dim_v=8, seed=11)
        data = kvwire.encode(cache, form=form, codec=codec)
        loaded = kvwire.load(data, device="cuda")
        assert loaded.header == cache.header
        for src, dst in zip(cache.layers, loaded.layers):
            for comp, x in src.items():
                t = dst[comp]
                assert t.is_cuda and tuple(t.shape) == x.shape, dtype
                assert np.array_equal(_host_bytes(t), x.reshape(-1).view(np.uint8)), dtype


def test_cuda_load_of_mixed_architecture_and_uneven_layers(tmp_path):
    from test_roundtrip import mixed_cache

    cache = mixed_cache(dtype="bf16", seed=3)
    path = tmp_path / "m.kvw"
    kvwire.save(path, cache, codec="zstd")
    loaded = kvwire.load(path, device="cuda:0")
    assert loaded.layers[3] == {}
    for src, dst in zip(cache.layers, loaded.layers):
        for comp, x in src.items():
            assert dst[comp].device.type == "cuda"
            assert np.array_equal(_host_bytes(dst[comp]), x.reshape(-1).view(np.uint8))


def test_cuda_load_verifies_checksums():
    data = kvwire.encode(forge.small_cache())
    off, _ = forge.layout(data).bodies[3]
    bad = forge.xor_byte(data, off)
    with pytest.raises(kvwire.ChecksumError) as info:
        kvwire.load(bad, device="cuda")
    assert info.value.code == "BODY_CHECKSUM"


def test_cuda_tensors_as_encoder_input():
    k = torch.randint(0, 256, (2, 33, 16), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    v = torch.randint(0, 256, (2, 33, 8), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    cache = kvwire.KVCache.from_tensors([k], [v], chunk_tokens=16)
    loaded = kvwire.load(kvwire.encode(cache), device="cuda")
    assert torch.equal(loaded.keys(0).view(torch.int16), k.view(torch.int16))
    assert torch.equal(loaded.values(0).view(torch.int16), v.view(torch.int16))
