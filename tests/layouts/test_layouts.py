"""Engine layouts <-> kvwire: every named layout round-trips bit-exactly through
gather -> encode -> decode -> scatter, and mismatches are errors, never guesses.

Each layout has a *reference accessor* written here independently of the descriptor
code (plain indexing of the engine tensors as the engines document them), so a bug that
gather and scatter share cannot cancel out.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvwire

torch = pytest.importorskip("torch")
from kvwire import layouts
from kvwire.layouts import LayoutMismatchError

L, H, CK, CV, N = 3, 2, 8, 6, 4  # layers, heads, head dims (sglang.mha: K/V differ), block size
NB, NS = 9, 40  # blocks / token slots in the engine buffers
MLA_C, RANK = 12, 8  # MLA latent channels and kv_lora_rank (rope 4)


def rand(shape, dtype, gen):
    """Arbitrary bit patterns (NaN payloads included) of a torch dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def fill(shape, dtype, gen, sentinel):
    if sentinel is None:
        return rand(shape, dtype, gen)
    return torch.full((int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),), sentinel,
                      dtype=torch.uint8).view(dtype).view(shape)


def _hc(x):  # a merged H*C row -> (H, C)
    return x.reshape(H, -1)


# name -> (make(dtype, gen, sentinel) -> (buffers, state), ref(state, layer, comp, pos) -> [H, C], bind kwargs)
# pos is (block, offset) for paged layouts, a slot for token-slot layouts.
def _spec():
    S = {}

    def per_layer(shape):
        return lambda dt, g, s: (lambda ts: (ts, ts))([fill(shape, dt, g, s) for _ in range(L)])

    def one(shape):
        return lambda dt, g, s: (lambda t: (t, t))(fill(shape, dt, g, s))

    kv = {"k": 0, "v": 1, "latent": 0}
    NH = {"num_heads": H, "block_size": N}  # KVW-BIND-1: contiguous 5-D vLLM tensors need both
    S["vllm.v0_4_3_to_0_22.flash_nhd"] = (per_layer((2, NB, N, H, CK)), lambda st, l, c, p: st[l][kv[c], p[0], p[1]],
                                          NH)

    def hnd_view(dt, g, s):
        raws = [fill((2, NB, H, N, CK), dt, g, s) for _ in range(L)]
        return [r.permute(0, 1, 3, 2, 4) for r in raws], raws  # what vLLM registers: a permuted view

    S["vllm.v0_9_1_to_0_22.flash_hnd"] = (hnd_view, lambda st, l, c, p: st[l][kv[c], p[0], :, p[1]], {})
    S["vllm.v0_9_1_to_0_22.flash_hnd#raw"] = (per_layer((2, NB, H, N, CK)),
                                              lambda st, l, c, p: st[l][kv[c], p[0], :, p[1]], NH)
    S["vllm.v0_11_1_to_0_22.cpu"] = (per_layer((2, NB, H, N, CK)), lambda st, l, c, p: st[l][kv[c], p[0], :, p[1]],
                                     NH)
    S["vllm.v0_4_2_to_0_25.blocks_first"] = (per_layer((NB, 2, N, H, CK)),
                                             lambda st, l, c, p: st[l][p[0], kv[c], p[1]], NH)

    def bf_hnd(dt, g, s):
        raws = [fill((NB, 2, H, N, CK), dt, g, s) for _ in range(L)]
        return [r.permute(0, 1, 3, 2, 4) for r in raws], raws

    S["vllm.v0_8_5_to_0_25.blocks_first_hnd"] = (bf_hnd, lambda st, l, c, p: st[l][p[0], kv[c], :, p[1]], {})
    S["vllm.v0_23_to_0_28.packed"] = (per_layer((NB, H, N, 2 * CK)),
                                      lambda st, l, c, p: st[l][p[0], :, p[1], kv[c] * CK : (kv[c] + 1) * CK], NH)

    def packed_nhd(dt, g, s):  # 0.26-0.28 NHD: allocated (num_blocks, block_size, H, 2*D), registered permuted
        raws = [fill((NB, N, H, 2 * CK), dt, g, s) for _ in range(L)]
        return [r.permute(0, 2, 1, 3) for r in raws], raws

    S["vllm.v0_26_to_0_28.packed_nhd"] = (packed_nhd,
                                          lambda st, l, c, p: st[l][p[0], p[1], :, kv[c] * CK : (kv[c] + 1) * CK], {})
    S["vllm.v0_7_1_to_0_28.mla"] = (per_layer((NB, N, MLA_C)), lambda st, l, c, p: st[l][p[0], p[1]][None],
                                    {"kv_lora_rank": RANK})
    def sgl_mha(dt, g, s):
        pool = {"k": [fill((NS, H, CK), dt, g, s) for _ in range(L)],
                "v": [fill((NS, H, CV), dt, g, s) for _ in range(L)]}
        return pool, pool

    S["sglang.mha"] = (sgl_mha, lambda st, l, c, p: st[c][l][p], {})
    S["sglang.mla"] = (per_layer((NS, 1, MLA_C)), lambda st, l, c, p: st[l][p], {"kv_lora_rank": RANK})
    LY, LYH, LYR = {"num_layers": L}, {"num_layers": L, "num_heads": H}, {"num_layers": L, "kv_lora_rank": RANK}
    S["sglang.host.layer_first"] = (one((2, L, NS, H, CK)), lambda st, l, c, p: st[kv[c], l, p], LY)
    S["sglang.host.page_first"] = (one((2, NS, L, H, CK)), lambda st, l, c, p: st[kv[c], p, l], LY)
    S["sglang.host.page_first_direct"] = (one((2, NB, L, N, H, CK)), lambda st, l, c, p: st[kv[c], p[0], l, p[1]],
                                          LYH)
    S["sglang.host.page_head"] = (one((2, NB, H, N, L, CK)), lambda st, l, c, p: st[kv[c], p[0], :, p[1], l], LYH)
    S["sglang.host.mla.layer_first"] = (one((L, NS, 1, MLA_C)), lambda st, l, c, p: st[l, p], LYR)
    S["sglang.host.mla.page_first"] = (one((NS, L, 1, MLA_C)), lambda st, l, c, p: st[p, l], LYR)
    S["sglang.host.mla.page_first_direct"] = (one((NB, L, N, 1, MLA_C)), lambda st, l, c, p: st[p[0], l, p[1]], LYR)
    S["lmcache.KV_2LTD"] = (one((2, L, NS, H * CK)), lambda st, l, c, p: _hc(st[kv[c], l, p]), {"num_heads": H})
    S["lmcache.KV_T2D"] = (per_layer((NS, 2, H * CK)), lambda st, l, c, p: _hc(st[l][p, kv[c]]), {"head_dim": CK})
    S["lmcache.KV_2TD"] = (per_layer((2, NS, H * CK)), lambda st, l, c, p: _hc(st[l][kv[c], p]), {"num_heads": H})
    S["lmcache.KV_MLA_FMT"] = (one((1, L, NS, MLA_C)), lambda st, l, c, p: st[0, l, p][None], {"kv_lora_rank": RANK})
    S["dynamo.fully_contiguous"] = (one((NB, L, 2, N, H * CK)), lambda st, l, c, p: _hc(st[p[0], l, kv[c], p[1]]),
                                    {"num_heads": H})
    S["dynamo.layer_separate"] = (per_layer((NB, 2, N, H * CK)), lambda st, l, c, p: _hc(st[l][p[0], kv[c], p[1]]),
                                  {"num_heads": H})
    S["dynamo.layer_separate_outer"] = (per_layer((2, NB, N, H * CK)),
                                        lambda st, l, c, p: _hc(st[l][kv[c], p[0], p[1]]), {"num_heads": H})
    S["kvwire.page"] = (one((NB, L, 2, H, N, CK)), lambda st, l, c, p: st[p[0], l, kv[c], :, p[1]], {})
    S["kvwire.page.mla"] = (one((NB, L, 1, N, MLA_C)), lambda st, l, c, p: st[p[0], l, :, p[1]], LYR)
    return S


SPECS = _spec()
FLASH_NHD = "vllm.v0_4_3_to_0_22.flash_nhd"
NH = {"num_heads": H, "block_size": N}


def test_every_registered_layout_is_tested():
    """vLLM 0.29+ layouts (built as vLLM builds them) are in test_layouts_vllm032.py."""
    assert {n for n in layouts.layout_names() if not n.startswith("vllm.v0_29.")} == {k.split("#")[0] for k in SPECS}


def _ids(name, num_tokens, rng):
    """Non-contiguous, unsorted ids covering ``num_tokens`` (a partial last block)."""
    paged = layouts.get_layout(name.split("#")[0]).addressing == "block"
    need = -(-num_tokens // N) if paged else num_tokens
    return rng.permutation(NB if paged else NS)[:need]


def _pos(name, ids, t):
    if layouts.get_layout(name.split("#")[0]).addressing == "block":
        return int(ids[t // N]), t % N
    return int(ids[t])


def _bytes(x):
    from kvwire.cache.tensors import as_numpy

    return as_numpy(x.contiguous() if hasattr(x, "contiguous") else x).reshape(-1).view(np.uint8)


def _bind(name, buffers, kw):
    return layouts.bind(name.split("#")[0], buffers, **kw)


def roundtrip(name, dtype, *, tokens=13, chunk_tokens=6, codec="raw", seed=0, indexed=None, entry=None):
    """gather -> encode -> decode == the reference; scatter at other ids writes exactly
    those positions (``entry``: a (make, ref, kw) of another module, else ``SPECS[name]``)."""
    make, ref, kw = entry or SPECS[name]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    bufs, st = make(dtype, gen, None)
    ids = _ids(name, tokens, rng)
    eb = _bind(name, bufs, kw)
    eb.indexed_copies = indexed
    data = layouts.encode_from_engine(eb, ids, tokens, chunk_tokens=chunk_tokens, codec=codec)
    r = kvwire.open(data)
    h = r.header
    assert h.engine_layout.name == name.split("#")[0] and h.engine_layout.axes == eb.layout.axes
    # decoded container == the engine memory, read through the independent reference
    for layer, spec in enumerate(h.arch.layers):
        got = r.layer(layer)
        for comp in spec.components:
            want = torch.stack([ref(st, layer, comp, _pos(name, ids, t)) for t in range(tokens)], 1)
            assert np.array_equal(_bytes(want), _bytes(got[comp])), (name, layer, comp)
    # scatter into sentinel-filled buffers at other ids
    bufs2, st2 = make(dtype, gen, 0x5A)
    ids2 = _ids(name, tokens, np.random.default_rng(seed + 1))
    eb2 = _bind(name, bufs2, kw)
    eb2.indexed_copies = indexed
    layouts.scatter(r, eb2, ids2).synchronize()
    written = set()
    for layer, spec in enumerate(h.arch.layers):
        for comp in spec.components:
            for t in range(tokens):
                p = _pos(name, ids2, t)
                written.add((layer, comp, p))
                want = ref(st, layer, comp, _pos(name, ids, t))
                assert np.array_equal(_bytes(ref(st2, layer, comp, p)), _bytes(want))
    # nothing else was touched: every other position (incl. the rest of a partial block) keeps the sentinel
    paged = eb2.layout.addressing == "block"
    positions = [(b, o) for b in range(NB) for o in range(N)] if paged else range(NS)
    for layer, spec in enumerate(h.arch.layers):
        for comp in spec.components:
            for p in positions:
                if (layer, comp, p) not in written:
                    assert (_bytes(ref(st2, layer, comp, p)) == 0x5A).all(), (name, layer, comp, p)
    r.close()
    return data


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_roundtrip_bit_exact(name, dtype):
    roundtrip(name, getattr(torch, dtype))


@pytest.mark.parametrize("name", ["vllm.v0_9_1_to_0_22.flash_hnd", "sglang.mha", "lmcache.KV_2LTD",
                                  "vllm.v0_7_1_to_0_28.mla", "sglang.host.page_head", "vllm.v0_26_to_0_28.packed_nhd"])
def test_roundtrip_index_kernels_and_zstd(name):
    """The device code path (index_select / index_put_) run on the CPU, with zstd bodies
    and chunks that are multiples of, equal to, or smaller than a block."""
    for chunk_tokens in (1, N, 2 * N, 64):
        roundtrip(name, torch.float16, chunk_tokens=chunk_tokens, codec="zstd", indexed=True, seed=chunk_tokens)


def test_roundtrip_through_a_file(tmp_path):
    make, ref, kw = SPECS["vllm.v0_9_1_to_0_22.flash_hnd"]
    bufs, _ = make(torch.bfloat16, torch.Generator().manual_seed(3), None)
    eb = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", bufs, engine="vllm/test")
    ids = [4, 0, 7]
    size = layouts.save_from_engine(tmp_path / "c.kvw", eb, ids, 10, chunk_tokens=N)
    assert size == (tmp_path / "c.kvw").stat().st_size
    cache = kvwire.load(tmp_path / "c.kvw")
    assert cache.header.engine_layout == kvwire.EngineLayout("vllm.v0_9_1_to_0_22.flash_hnd", "KV,B,N,H,C",
                                                             (0, 1, 3, 2, 4), N, "vllm/test")
    want = layouts.gather_cache(eb, ids, 10, chunk_tokens=N)
    assert kvwire.encode(want) == kvwire.encode(cache.with_header(engine_layout=want.header.engine_layout))


@pytest.mark.parametrize("target", ["vllm.v0_4_3_to_0_22.flash_nhd", "vllm.v0_23_to_0_28.packed",
                                    "sglang.host.page_head", "lmcache.KV_2LTD", "dynamo.fully_contiguous",
                                    "kvwire.page", "sglang.mha"])
def test_kvw_hdr_18_a_container_restores_into_any_layout(target):
    """The header says vllm.v0_9_1_to_0_22.flash_hnd; the destination layout comes from the caller."""
    make, _, kw = SPECS["vllm.v0_9_1_to_0_22.flash_hnd"]
    bufs, _ = make(torch.bfloat16, torch.Generator().manual_seed(8), None)
    src = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", bufs)
    ids = [6, 2, 8, 0]
    data = layouts.encode_from_engine(src, ids, 4 * N - 2, chunk_tokens=5)
    make2, _, kw2 = SPECS[target]
    if target == "sglang.mha":  # K and V of equal head_dim here
        dst_bufs = {c: [torch.zeros((NS, H, CK), dtype=torch.bfloat16) for _ in range(L)] for c in "kv"}
    else:
        dst_bufs, _ = make2(torch.bfloat16, torch.Generator().manual_seed(9), 0)
    dst = layouts.bind(target, dst_bufs, **kw2)
    ids2 = _ids(target, 4 * N - 2, np.random.default_rng(3))
    with kvwire.open(data) as r:
        assert r.header.engine_layout.name == "vllm.v0_9_1_to_0_22.flash_hnd"
        layouts.scatter(r, dst, ids2)
    want, got = layouts.gather(src, ids, 4 * N - 2), layouts.gather(dst, ids2, 4 * N - 2)
    for layer in range(L):
        for comp in "kv":
            assert np.array_equal(_bytes(want[layer][comp]), _bytes(got[layer][comp]))


# ---------------------------------------------------------------------------------------
# Views and copies
# ---------------------------------------------------------------------------------------

def _inside(x, base):
    start = base.untyped_storage().data_ptr()
    return start <= x.data_ptr() < start + base.untyped_storage().nbytes()


def test_gather_is_a_view_where_the_layout_allows():
    make, _, kw = SPECS["vllm.v0_9_1_to_0_22.flash_hnd#raw"]
    bufs, _ = make(torch.bfloat16, torch.Generator().manual_seed(0), None)
    eb = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", bufs, **kw)
    a = np.array([5, 6, 2])
    one_block = eb.gather_range(0, "k", a, 0, N)  # inside block 5: a view, heads outer -> contiguous per head
    assert _inside(one_block, bufs[0]) and one_block[0].is_contiguous()
    across = eb.gather_range(0, "k", a, 2, 2 * N + 1)  # blocks 5, 6, 2: one gather copy
    assert not _inside(across, bufs[0]) and across[0].is_contiguous()
    nhd = [t.permute(0, 1, 3, 2, 4).contiguous() for t in bufs]
    ebn = layouts.bind("vllm.v0_4_3_to_0_22.flash_nhd", nhd, **kw)
    run = ebn.gather_range(1, "v", a, 0, 2 * N)  # consecutive blocks 5, 6 merge in NHD: a view
    assert _inside(run, nhd[1])
    assert torch.equal(run.view(torch.int16), eb.gather_range(1, "v", a, 0, 2 * N).view(torch.int16))


def test_scatter_makes_no_intermediate_copy():
    """Memory accounting: scattering 4 chunks of 64 KiB allocates (almost) nothing: each
    chunk goes from the container bytes to the engine buffers in one copy."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(1)
    bufs = [rand((2, 32, 8, 16, 64), torch.bfloat16, gen) for _ in range(2)]  # raw HND: 8 heads, blocks of 16
    eb = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", bufs, num_heads=8, block_size=16)
    data = layouts.encode_from_engine(eb, np.arange(32)[::-1].copy(), 500, chunk_tokens=256)
    dst = [torch.zeros_like(t) for t in bufs]
    eb2 = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", dst, num_heads=8, block_size=16)
    chunk_bytes = 8 * 256 * 64 * 2
    with kvwire.open(data) as r:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.empty(chunk_bytes, dtype=torch.uint8)  # positive control: the profiler sees allocations
            eb2.scatter(r, np.random.default_rng(0).permutation(32))
    allocs = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocs) >= chunk_bytes  # the control
    assert sum(allocs) - chunk_bytes < chunk_bytes // 16
    with kvwire.open(data) as r:
        for layer in range(2):
            for comp in "kv":
                assert torch.equal(eb2.gather(np.random.default_rng(0).permutation(32), 500)[layer][comp].view(
                    torch.int16), torch.from_numpy(r.layer(layer)[comp].view(np.int16)))


# ---------------------------------------------------------------------------------------
# Never guessed
# ---------------------------------------------------------------------------------------

def test_shape_identical_layouts_give_different_results_and_the_named_one_is_used():
    """A raw (2, B, X, X, C) buffer is NHD or HND; when H == block_size even the hints
    (KVW-BIND-1) fit both, and only the name says which."""
    gen = torch.Generator().manual_seed(5)
    raw = [rand((2, NB, N, N, CK), torch.bfloat16, gen) for _ in range(L)]  # H == N == 4
    ids = [3, 1]
    nhd = layouts.gather(layouts.bind("vllm.v0_4_3_to_0_22.flash_nhd", raw, num_heads=N, block_size=N), ids, 2 * N)
    hnd = layouts.gather(layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", raw, num_heads=N, block_size=N), ids, 2 * N)
    assert not torch.equal(nhd[0]["k"].view(torch.int16), hnd[0]["k"].view(torch.int16))
    for t in range(2 * N):
        b, o = ids[t // N], t % N
        assert torch.equal(nhd[0]["k"][:, t].view(torch.int16), raw[0][0, b, o].view(torch.int16))  # [b, N, H]
        assert torch.equal(hnd[0]["k"][:, t].view(torch.int16), raw[0][0, b, :, o].view(torch.int16))  # [b, H, N]


def test_strides_contradicting_the_named_layout_are_an_error():
    gen = torch.Generator().manual_seed(0)
    hnd_view = [rand((2, NB, H, N, CK), torch.bfloat16, gen).permute(0, 1, 3, 2, 4) for _ in range(L)]
    with pytest.raises(LayoutMismatchError, match="strides"):
        layouts.bind("vllm.v0_4_3_to_0_22.flash_nhd", hnd_view)  # the engine is HND, the caller said NHD
    layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", hnd_view)
    nhd = [rand((2, NB, N, H, CK), torch.bfloat16, gen) for _ in range(L)]
    with pytest.raises(LayoutMismatchError, match="wrong layout name"):
        layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", nhd, num_heads=H, block_size=N)  # sizes given: the swap is caught


@pytest.mark.parametrize("change,match", [
    ({"heads": 4}, "KV heads"), ({"dim": 16}, "head_dim"), ({"mla": True}, "MLA latent"),
    ({"dtype": torch.float8_e4m3fn}, "dtype"), ({"layers": 2}, "layers"),
])
def test_container_and_buffers_that_disagree_are_an_error(change, match):
    gen = torch.Generator().manual_seed(0)
    src = layouts.bind(FLASH_NHD, [rand((2, NB, N, H, CK), torch.bfloat16, gen) for _ in range(L)], **NH)
    data = layouts.encode_from_engine(src, [1, 2], 2 * N)
    heads, dim, layers = change.get("heads", H), change.get("dim", CK), change.get("layers", L)
    dt = change.get("dtype", torch.bfloat16)
    if change.get("mla"):
        dst = layouts.bind("vllm.v0_7_1_to_0_28.mla", [torch.zeros((NB, N, MLA_C), dtype=dt) for _ in range(layers)])
    else:
        dst = layouts.bind(FLASH_NHD, [torch.zeros((2, NB, N, heads, dim), dtype=dt) for _ in range(layers)],
                           num_heads=heads, block_size=N)
    with kvwire.open(data) as r, pytest.raises(LayoutMismatchError, match=match):
        layouts.scatter(r, dst, [3, 4])
    assert all(not t.view(torch.uint8).any() for t in dst.tensors[0].values())  # nothing written


def test_mla_container_into_attention_buffers_is_an_error():
    gen = torch.Generator().manual_seed(0)
    src = layouts.bind("vllm.v0_7_1_to_0_28.mla", [rand((NB, N, MLA_C), torch.bfloat16, gen) for _ in range(L)],
                       kv_lora_rank=RANK)
    data = layouts.encode_from_engine(src, [1], 3)
    assert kvwire.probe(data).arch.layers[0] == kvwire.LayerSpec("mla_latent", 1, MLA_C, 0, kv_lora_rank=RANK,
                                                                 qk_rope_head_dim=MLA_C - RANK)
    dst = layouts.bind("sglang.mha", {"k": [torch.zeros((NS, 1, MLA_C), dtype=torch.bfloat16)] * L,
                                      "v": [torch.zeros((NS, 1, MLA_C), dtype=torch.bfloat16)] * L})
    with kvwire.open(data) as r, pytest.raises(LayoutMismatchError, match="MLA"):
        layouts.scatter(r, dst, [0, 1, 2])


@pytest.mark.parametrize("bad,match", [
    (lambda: layouts.bind(FLASH_NHD, [torch.zeros((1, NB, N, H, CK))], **NH), "KV axis of size 1"),
    (lambda: layouts.bind(FLASH_NHD, torch.zeros((L, 2, NB, N, H, CK))), "one tensor per layer"),
    (lambda: layouts.bind(FLASH_NHD, [torch.zeros((2, NB, N, H))]), "dimensions"),
    (lambda: layouts.bind(FLASH_NHD, [torch.zeros((2, NB, N, H, CK))], num_layers=2, **NH), "num_layers 1"),
    (lambda: layouts.bind("lmcache.KV_2LTD", torch.zeros((2, L, NS, 12))), "num_heads= or head_dim="),
    (lambda: layouts.bind("lmcache.KV_2LTD", torch.zeros((2, L, NS, 12)), num_heads=5), "merges H\\*C"),
    (lambda: layouts.bind("sglang.mha", [torch.zeros((NS, H, CK))] * L), "keeps K and V apart"),
    (lambda: layouts.bind("sglang.mla", [torch.zeros((NS, 2, MLA_C))]), "2 heads"),
    (lambda: layouts.bind(FLASH_NHD, [torch.zeros((2, NB, N, H, CK)), torch.zeros((2, NB, N, H, CK),
                                                                            dtype=torch.float16)], **NH),
     "one dtype"),
    (lambda: layouts.bind("nope.layout", []), "unknown layout"),
])
def test_bind_errors(bad, match):
    with pytest.raises((LayoutMismatchError, TypeError, ValueError), match=match):
        bad()


def test_ids_are_checked():
    gen = torch.Generator().manual_seed(0)
    eb = layouts.bind(FLASH_NHD, [rand((2, NB, N, H, CK), torch.bfloat16, gen) for _ in range(L)], **NH)
    with pytest.raises(LayoutMismatchError, match="need 3 block ids"):
        eb.gather([1, 2], 2 * N + 1)
    with pytest.raises(LayoutMismatchError, match="outside"):
        eb.gather([1, NB], 2 * N)
    data = layouts.encode_from_engine(eb, [1, 2], 2 * N)
    with kvwire.open(data) as r, pytest.raises(LayoutMismatchError, match="repeat"):
        eb.scatter(r, [3, 3])
    assert list(layouts.slots_from_blocks([2, 0], 4, 6)) == [8, 9, 10, 11, 0, 1]


def test_mla_header_needs_the_rank():
    gen = torch.Generator().manual_seed(0)
    eb = layouts.bind("vllm.v0_7_1_to_0_28.mla", [rand((NB, N, MLA_C), torch.bfloat16, gen)])
    with pytest.raises(LayoutMismatchError, match="kv_lora_rank"):
        layouts.encode_from_engine(eb, [0], 2)


def test_descriptors_print_and_validate():
    d = layouts.get_layout("vllm.v0_9_1_to_0_22.flash_hnd")
    assert d.axes == "KV,B,N,H,C" and d.physical_axes == "KV,B,H,N,C" and d.addressing == "block"
    assert str(d) == "vllm.v0_9_1_to_0_22.flash_hnd [KV,B,N,H,C], memory KV,B,H,N,C (split, per layer)"
    assert layouts.get_layout("lmcache.KV_2LTD").axes == "KV,L,T,H*C"
    with pytest.raises(ValueError):
        layouts.LayoutDescriptor("x", (("B",), ("H",), ("C",)), (0, 1, 2), "split", "layer")  # B without N
    with pytest.raises(ValueError):
        layouts.LayoutDescriptor("x", (("T",), ("H",), ("C",)), (0, 0, 1), "separate", "layer")


@pytest.mark.slow
def test_import_kvwire_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, kvwire; kvwire.layouts.layout_names(); kvwire.layouts.get_layout('vllm.v0_7_1_to_0_28.mla'); " \
           "kvwire.layouts.needed_hints(kvwire.layouts.get_layout('vllm.v0_29.LBHNC'), False); " \
           "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_layouts_names_are_plain_imports_that_need_no_torch():
    """Every public name of kvwire.layouts is a plain import (static tools follow it; no
    module ``__getattr__``), and importing them all works where torch cannot be imported."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import kvwire, kvwire.layouts as L; "
            "assert not hasattr(L, '__getattr__'); missing = [n for n in L.__all__ if not hasattr(L, n)]; "
            "assert not missing, missing; assert L.layout_names()[:2]; "
            "from kvwire.integrations import vllm_plan, vllm_engine")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_containers_are_accepted_as_engines_hold_them():
    """vLLM's dict of layer name -> tensor, SGLang pool objects, a custom descriptor."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(6)
    per_layer = [rand((2, NB, N, H, CK), torch.bfloat16, gen) for _ in range(L)]
    by_name = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(per_layer)}
    a, b = layouts.bind(FLASH_NHD, by_name, **NH), layouts.bind(FLASH_NHD, per_layer, **NH)
    assert all(torch.equal(x["k"].view(torch.int16), y["k"].view(torch.int16))
               for x, y in zip(a.gather([1, 2], 5), b.gather([1, 2], 5)))
    pool = SimpleNamespace(k_buffer=[rand((NS, H, CK), torch.float16, gen) for _ in range(L)],
                           v_buffer=[rand((NS, H, CV), torch.float16, gen) for _ in range(L)])
    eb = layouts.bind("sglang.mha", pool)
    assert eb.geometry[0] == layouts.LayerGeometry(False, H, CK, CV, NS)
    mla_pool = SimpleNamespace(kv_buffer=[rand((NS, 1, MLA_C), torch.float16, gen) for _ in range(L)])
    assert layouts.bind("sglang.mla", mla_pool, kv_lora_rank=RANK).geometry[0].mla
    custom = layouts.LayoutDescriptor("acme.hnd_flat", (("B",), ("H",), ("N",), ("KV", "C")), (0, 1, 2, 3), "fused",
                                      "layer")
    bufs = [rand((NB, H, N, 2 * CK), torch.bfloat16, gen) for _ in range(L)]
    with pytest.raises(LayoutMismatchError, match="KVW-BIND-1"):  # checked against the registry like a registered one
        layouts.bind(custom, bufs)
    got = layouts.bind(custom, bufs, **NH).gather([4], 3)
    assert torch.equal(got[0]["v"][:, 2].view(torch.int16), bufs[0][4, :, 2, CK:].view(torch.int16))
