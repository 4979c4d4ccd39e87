"""Sparse caches into Hugging Face transformers (spec/sparse.md sections 5 and 6)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import forge
import kvwire
from kvwire.cache.sparse import SparseKVCache
from kvwire.format.header import Architecture, Header, LayerSpec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvwire.adapters import hf, hf_sparse, zoo

N = 24


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", seed=1)
    ids = torch.randint(3, 128, (1, N + 1), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model(ids[:, :N], use_cache=True)
    return model, ids, hf.from_hf(out.past_key_values, model)


def _next_logits(model, ids, loaded: hf_sparse.HFSparse, position=None):
    pos = loaded.position_ids if position is None else torch.tensor([[position]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(ids[:, N:], past_key_values=loaded.cache, position_ids=pos, cache_position=loaded.cache_position)
    return out.logits[0, -1]


def _reference(model, ids, keep):
    """The full sequence with a 4D mask: the prompt attends causally (the prefill that made
    the cache), the next token only to the retained positions and itself."""
    allowed = torch.ones(N + 1, N + 1).tril().bool()
    allowed[N] = False
    allowed[N, torch.as_tensor(np.asarray(keep))] = True
    allowed[N, N] = True
    mask = torch.zeros(1, 1, N + 1, N + 1)
    mask[0, 0][~allowed] = torch.finfo(torch.float32).min
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[0, N]


@pytest.mark.parametrize("method", ["streaming", "h2o"])
def test_sparse12_13_continuation_matches_attention_over_retained_tokens(llama, method):
    """KVW-SPARSE-12/13: keys keep the rotation of their own positions and the next token
    gets position next_position: continuing from the loaded sparse cache gives the logits of
    a model whose next token attends to exactly the retained tokens."""
    model, ids, dense = llama
    if method == "streaming":
        sparse = SparseKVCache.streaming(dense, 4, 8)
    else:  # a per-layer, head-shared selection of 10 tokens (H2O/SnapKV style)
        keep = np.zeros(N, bool)
        keep[[0, 2, 3, 7, 11, 12, 16, 19, 22, 23]] = True
        sparse = SparseKVCache.from_mask(dense, [np.broadcast_to(keep, (2, N))] * 2, method="h2o")
    sparse = kvwire.load(kvwire.encode(sparse, codec="zstd"))
    loaded = hf_sparse.to_hf(sparse, model)
    assert loaded.next_position == N and int(loaded.cache_position) == sparse.header.token_count
    got = _next_logits(model, ids, loaded)
    want = _reference(model, ids, sparse.positions(0, 0))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # the position matters: the retained count as position gives other logits
    wrong = _next_logits(model, ids, hf_sparse.to_hf(sparse, model), position=sparse.header.token_count)
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_retaining_everything_is_the_dense_cache(llama):
    """A sparse cache that keeps every token continues exactly like the dense one."""
    model, ids, dense = llama
    loaded = hf_sparse.to_hf(SparseKVCache.streaming(dense, 0, N), model)
    with torch.no_grad():
        full = model(ids).logits[0, N]
    assert torch.allclose(_next_logits(model, ids, loaded), full, atol=1e-5)


def test_per_head_subsets_are_refused_with_the_reason(llama):
    """DynamicCache needs equal lengths per head and per layer: a clear SparseLoadError."""
    model, _, dense = llama
    rng = np.random.default_rng(0)
    masks = [rng.random((2, N)) < 0.5 for _ in range(2)]
    masks[0][0, :] = True
    with pytest.raises(hf_sparse.SparseLoadError, match="equal lengths per head"):
        hf_sparse.to_hf(SparseKVCache.from_mask(dense, masks), model)
    keep = np.ones((2, N), bool)
    per_layer = SparseKVCache.from_mask(dense, [keep, np.broadcast_to(np.arange(N) % 2 == 0, (2, N))])
    with pytest.raises(hf_sparse.SparseLoadError, match="every layer needs the same length"):
        hf_sparse.to_hf(per_layer, model)
    with pytest.raises(TypeError):
        hf_sparse.to_hf(dense, model)


def test_sliding_layers_are_refused():
    """Sliding-window layers keep the last window - 1 tokens in transformers: refused."""
    arch = Architecture((LayerSpec("sliding_attention", 1, 4, 4, window=8),))
    h = Header(arch=arch, token_count=6, dtype="f32")
    rng = np.random.default_rng(1)
    dense = kvwire.KVCache(h, [{"k": forge.random_tensor(rng, (1, 6, 4), "f32"),
                               "v": forge.random_tensor(rng, (1, 6, 4), "f32")}])
    with pytest.raises(hf_sparse.SparseLoadError, match="sliding_attention"):
        hf_sparse.to_hf(SparseKVCache.streaming(dense, 1, 2), None)


def test_to_dense_stacks_heads():
    """to_dense: head h's retained rows become head h of a [heads, n, dim] tensor."""
    dense = forge.small_cache(layers=2, heads=2, tokens=12)
    s = SparseKVCache.streaming(dense, 2, 3)
    d = hf_sparse.to_dense(s)
    assert d.header.token_count == 5
    assert np.array_equal(d.layers[1]["v"].view(np.uint16), dense.layers[1]["v"][:, [0, 1, 9, 10, 11]].view(np.uint16))
