"""vLLM 0.29-0.32 KV caches: built exactly as vLLM builds them, derived, bound, round-tripped.

``vllm_allocate`` replicates vLLM 0.32's code path (identical in 0.29, 0.30 and 0.31) step
by step on plain torch tensors, with no vLLM import:

* ``get_kv_cache_config_from_groups`` (``vllm/v1/core/kv_cache_utils.py``): bytes per
  block (block-outermost layouts: all layers' pages of a block, rounded up to the block
  stride alignment), the buffer size, the ``KVCacheTensor``'s layer and block strides from
  ``compute_layout_strides`` with the block stride fixed;
* ``allocate_kv_cache`` (``vllm/v1/worker/utils.py``): one zeroed int8 buffer;
* ``create_kv_cache_views`` (``vllm/v1/kv_cache_interface.py``): ``torch.as_strided`` of the
  buffer as the logical ``[L, B, H, N, C bytes]`` with byte strides in the layout's order,
  then per layer ``view_5d[l].view(dtype)``: what ``register_kv_caches`` receives.

The references read that logical tensor with plain indexing, ``x[l, b, :, n, :D]`` for K:
the meaning the content-dim backends give it (K = C[:head_size], V = C[head_size:]:
FlashAttention, Triton, FlashInfer, Flex; MLA: H = 1, C = latent). The CPU backend reads
the same view otherwise (``vllm.v0_29.cpu.vec``, tests/layouts/test_layouts_vllm_backends.py).
"""

from __future__ import annotations

import re
import warnings
from enum import Enum
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from test_layouts import CK, MLA_C, NB, RANK, SPECS, H, L, N, _bytes, fill, roundtrip

import kvwire
from kvwire import layouts
from kvwire.layouts import LayoutMismatchError

ORDERS = {  # vllm/v1/kv_cache_layout.py, KVCacheLayout member -> value (stride_order)
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
SPEC_MD = Path(__file__).resolve().parents[2] / "spec" / "layouts.md"


def compute_layout_strides(shape, order, fixed):
    """vLLM's ``compute_layout_strides`` (no padded pages): strides in logical order."""
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def vllm_allocate(layout, *, num_layers=L, num_blocks=NB, heads=H, block_size=N, head_size=CK, dtype=torch.bfloat16,
                  mla=False, align=1, gen=None, sentinel=None):
    """(per-layer views as vLLM registers them, the logical [L, B, H, N, C] tensor, the int8 buffer)."""
    order = ORDERS[layout]
    elt = torch.empty((), dtype=dtype).element_size()
    heads = 1 if mla else heads
    content = head_size * elt if mla else 2 * head_size * elt  # AttentionSpec.state_content_size_bytes
    page = heads * block_size * content  # AttentionSpec.page_size_bytes
    shape = (num_layers, num_blocks, heads, block_size, content)
    block_outer = order[0] == 1  # KVCacheLayout.is_block_outermost
    if block_outer:  # _get_kv_cache_bytes_per_block: the packed block, rounded up to the alignment
        bytes_per_block = -(-num_layers * page // align) * align
        block_stride = bytes_per_block
    else:  # each layer's block stride is its own page padded to the alignment (block-compact layouts only)
        padded = -(-page // align) * align
        assert padded == page or set(order[:2]) == {0, 1}, "vLLM pads pages of block-compact layouts only"
        bytes_per_block = num_layers * padded
        block_stride = padded if padded != page else None
    size = bytes_per_block * num_blocks
    layer_stride, block_stride = compute_layout_strides(shape, order, (None, block_stride, None, None, None))[:2]
    buf = torch.zeros(size, dtype=torch.int8)  # allocate_kv_cache
    if sentinel is not None:
        buf.view(torch.uint8).fill_(sentinel)
    else:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
    strides = compute_layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
    view_5d = torch.as_strided(buf, size=shape, stride=strides, storage_offset=buf.storage_offset())
    views = [view_5d[layer].view(dtype) for layer in range(num_layers)]  # create_kv_cache_views
    return views, view_5d.view(dtype), buf


# name -> (make, ref, bind kwargs) in test_layouts.SPECS' form, for test_layouts.roundtrip
def _specs29():
    S = {}
    kv = {"k": 0, "v": 1, "latent": 0}
    for name in ORDERS:
        for mla in (False, True):
            for model in (False, True):
                def make(dt, g, s, name=name, mla=mla, model=model):
                    views, x, _ = vllm_allocate(name, dtype=dt, mla=mla, head_size=MLA_C if mla else CK, gen=g,
                                                sentinel=s, align=64 if name in ("BLHNC", "LBNHC") else 1)
                    return (layouts.vllm_cross_layer_view(views) if model else views), x

                if mla:
                    def ref(x, layer, c, p):
                        return x[layer, p[0], :, p[1]]
                    kw = {"block_size": N, "head_dim": MLA_C, "kv_lora_rank": RANK}
                else:
                    def ref(x, layer, c, p):
                        return x[layer, p[0], :, p[1], kv[c] * CK : (kv[c] + 1) * CK]
                    kw = {"block_size": N, "num_heads": H, "head_dim": CK}
                full = f"vllm.v0_29.{'model.' if model else ''}{'mla.' if mla else ''}{name}"
                S[full] = (make, ref, {**kw, **({"num_layers": L} if model else {})})
    return S


SPECS29 = _specs29()


def test_every_v0_29_layout_is_built_as_vllm_builds_it():
    cpu = {n for n in layouts.layout_names() if n.startswith("vllm.v0_29.cpu.")}  # test_layouts_vllm_backends.py
    assert cpu == {"vllm.v0_29.cpu.vec"}
    assert {n for n in layouts.layout_names() if n.startswith("vllm.v0_29.")} - cpu == set(SPECS29)
    for name, order in ORDERS.items():  # the descriptors carry vLLM's orders (layer_view_order per layer)
        assert layouts.get_layout(f"vllm.v0_29.model.{name}").stride_order == order
        assert layouts.get_layout(f"vllm.v0_29.{name}").stride_order == tuple(i - 1 for i in order if i != 0)


@pytest.mark.parametrize("name", sorted(SPECS29))
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_roundtrip_bit_exact(name, dtype):
    """gather -> encode -> decode == plain indexing of vLLM's logical tensor; scatter at
    other block ids writes exactly those tokens of a second allocation."""
    roundtrip(name, getattr(torch, dtype), entry=SPECS29[name])


@pytest.mark.parametrize("name", ["vllm.v0_29.BLHNC", "vllm.v0_29.LHBNC", "vllm.v0_29.model.BHLNC",
                                  "vllm.v0_29.mla.BLNHC"])
def test_roundtrip_index_kernels_and_zstd(name):
    for chunk_tokens in (1, N, 2 * N + 1):
        roundtrip(name, torch.float16, chunk_tokens=chunk_tokens, codec="zstd", indexed=True, seed=chunk_tokens,
                  entry=SPECS29[name])


# ---------------------------------------------------------------------------------------
# Deriving the layout (KVW-BIND-2)
# ---------------------------------------------------------------------------------------

def _derive(views, mla=False, **kw):
    return layouts.vllm_layout_of(views, num_kv_heads=1 if mla else H, head_dim=MLA_C if mla else CK,
                                  block_size=N, mla=mla, **kw).name


@pytest.mark.parametrize("name", list(ORDERS))
def test_kvw_bind_2_the_layout_is_derived_from_what_vllm_hands_over(name):
    views, _, _ = vllm_allocate(name, gen=torch.Generator().manual_seed(1))
    by_name = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}
    assert _derive(by_name) == _derive(views) == f"vllm.v0_29.{name}"  # no name needed: strides + placement
    assert _derive(by_name, kv_cache_layout=name) == f"vllm.v0_29.{name}"
    whole = layouts.vllm_cross_layer_view(views)
    assert _derive(whole, num_layers=L) == f"vllm.v0_29.model.{name}"
    others = [k for k in ORDERS if k != name]
    with pytest.raises(LayoutMismatchError, match="kv_cache_layout says"):
        _derive(views, kv_cache_layout=others[0])


def test_kvw_bind_2_ambiguity_is_refused_naming_kv_cache_layout():
    """One layer, layers in separate tensors, or H = 1 (MLA): the strides fit several."""
    one, _, _ = vllm_allocate("BLHNC", num_layers=1, gen=torch.Generator().manual_seed(2))
    with pytest.raises(LayoutMismatchError, match=r"LBHNC, BLHNC, BHLNC alike: pass kv_cache_layout="):
        _derive(one)
    assert _derive(one, kv_cache_layout="BLHNC") == "vllm.v0_29.BLHNC"
    views, _, _ = vllm_allocate("LBNHC", gen=torch.Generator().manual_seed(2))
    apart = [v.clone() for v in views]  # separate tensors: placement unknown
    with pytest.raises(LayoutMismatchError, match="LBNHC, BLNHC alike"):
        _derive(apart)
    assert _derive(apart, kv_cache_layout="NHD") == "vllm.v0_29.LBNHC"  # vLLM's legacy alias
    lhbnc, _, _ = vllm_allocate("LHBNC", gen=torch.Generator().manual_seed(2))
    assert _derive([v.clone() for v in lhbnc]) == "vllm.v0_29.LHBNC"  # its per-layer order is its own
    mla, _, _ = vllm_allocate("BHLNC", mla=True, head_size=MLA_C, gen=torch.Generator().manual_seed(2))
    with pytest.raises(LayoutMismatchError, match="BLHNC, BLNHC, BHLNC alike"):
        _derive(mla, mla=True)

    class KVCacheLayout(Enum):  # what vllm_config.cache_config.get_resolved_kv_cache_layout() returns
        BHLNC = (1, 2, 0, 3, 4)

    assert _derive(mla, mla=True, kv_cache_layout=KVCacheLayout.BHLNC) == "vllm.v0_29.mla.BHLNC"


@pytest.mark.parametrize("bad,match", [
    (lambda v: _derive(v, kv_cache_layout="HNDX"), "valid: LBHNC"),
    (lambda v: layouts.vllm_layout_of(v, num_kv_heads=H + 1, head_dim=CK, block_size=N), "not vLLM's"),
    (lambda v: layouts.vllm_layout_of(v, num_kv_heads=H, head_dim=CK, block_size=2 * N), "not vLLM's"),
    (lambda v: layouts.vllm_layout_of(v, num_kv_heads=H, head_dim=CK // 2, block_size=N), "not vLLM's"),
    (lambda v: _derive(layouts.vllm_cross_layer_view(v)), "pass num_layers="),
    (lambda v: _derive([torch.zeros((2, NB, N, H, CK))]), "older release"),
    (lambda v: _derive([x.transpose(1, 2) for x in v]), "not vLLM's"),
    (lambda v: _derive([torch.zeros((2 * CK, N, H, NB)).permute(3, 2, 1, 0)]), "fit no KVCacheLayout"),
    (lambda v: layouts.vllm_cross_layer_view([v[0], v[0]]), "constant, increasing distance"),
    (lambda v: layouts.vllm_cross_layer_view([v[0], v[1].clone()]), "not a view of layer 0"),
])
def test_kvw_bind_2_what_does_not_fit_is_refused(bad, match):
    views, _, _ = vllm_allocate("BLHNC", gen=torch.Generator().manual_seed(3))
    with pytest.raises((LayoutMismatchError, ValueError), match=match):
        bad(views)


def test_the_cross_layer_view_is_the_allocation_itself():
    """0.29-0.32 expose no cross-layer tensor; the per-layer views of a block-outermost
    layout are strided slices of one buffer, and the [L, B, H, N, C] view over it is
    rebuilt without a copy: a block of all layers is one contiguous run (BLHNC)."""
    views, x, buf = vllm_allocate("BLHNC", gen=torch.Generator().manual_seed(4))
    whole = layouts.vllm_cross_layer_view({f"l{i}": v for i, v in enumerate(views)})
    assert whole.data_ptr() == buf.data_ptr() and whole.shape == x.shape and whole.stride() == x.stride()
    assert torch.equal(whole.view(torch.int16), x.view(torch.int16))
    assert views[1].stride(0) == L * H * N * 2 * CK  # a layer's block stride spans all layers' pages
    eb = layouts.bind_vllm(whole, num_kv_heads=H, head_dim=CK, block_size=N, num_layers=L)
    assert eb.layout.name == "vllm.v0_29.model.BLHNC" and eb.layout.physical_axes == "B,L,H,N,KV*C"
    page = x[:, 3]  # block 3 of every layer: one contiguous run of bytes in the buffer
    assert page.is_contiguous() and page.data_ptr() == buf.data_ptr() + 3 * L * H * N * 2 * CK * 2
    got = eb.gather([3], N)
    for layer in range(L):
        assert torch.equal(got[layer]["v"].view(torch.int16), x[layer, 3, :, :, CK:].view(torch.int16))


# ---------------------------------------------------------------------------------------
# Property: any geometry, any block ids; derivation never picks a wrong layout
# ---------------------------------------------------------------------------------------

@st.composite
def geometries(draw):
    name = draw(st.sampled_from(list(ORDERS)))
    mla = draw(st.booleans())
    g = dict(num_layers=draw(st.integers(1, 3)), num_blocks=draw(st.integers(2, 6)),
             heads=1 if mla else draw(st.integers(1, 3)), block_size=draw(st.integers(1, 5)),
             head_size=draw(st.integers(1, 6)), mla=mla)
    g["align"] = draw(st.sampled_from([1, 64])) if set(ORDERS[name][:2]) == {0, 1} or ORDERS[name][0] == 1 else 1
    n = draw(st.integers(1, g["num_blocks"] * g["block_size"]))
    need = -(-n // g["block_size"])
    run = draw(st.booleans())
    if run:  # consecutive blocks: the views and strided copies of runs
        start = draw(st.integers(0, g["num_blocks"] - need))
        ids = list(range(start, start + need))
    else:
        ids = draw(st.permutations(range(g["num_blocks"])))[:need]
    ids2 = draw(st.permutations(range(g["num_blocks"])))[:need]
    return name, g, n, ids, ids2, draw(st.booleans())


@given(geometries())
def test_property_derive_bind_gather_scatter(case):
    name, g, n, ids, ids2, indexed = case
    heads, bs, hs, mla = g["heads"], g["block_size"], g["head_size"], g["mla"]
    views, x, _ = vllm_allocate(name, dtype=torch.float16, gen=torch.Generator().manual_seed(len(ids)), **g)
    kw = dict(num_kv_heads=heads, head_dim=hs, block_size=bs, mla=mla)
    try:  # without the layout name: the right one, or refused, never another
        assert layouts.vllm_layout_of(views, **kw).name == f"vllm.v0_29.{'mla.' if mla else ''}{name}"
    except LayoutMismatchError as e:
        assert "pass kv_cache_layout=" in str(e)
    eb = layouts.bind_vllm(views, kv_cache_layout=name, kv_lora_rank=1 if mla and hs > 1 else None, **kw)
    eb.indexed_copies = indexed
    got = eb.gather(ids, n)
    comps = {"latent": slice(0, hs)} if mla else {"k": slice(0, hs), "v": slice(hs, 2 * hs)}
    for layer in range(g["num_layers"]):
        for c, sl in comps.items():
            want = torch.stack([x[layer, ids[t // bs], :, t % bs, sl] for t in range(n)], 1)
            assert torch.equal(got[layer][c].view(torch.int16), want.view(torch.int16))
    if mla and hs == 1:
        return  # an MLA header needs 1 <= kv_lora_rank < latent
    data = layouts.encode_from_engine(eb, ids, n, chunk_tokens=max(1, bs - 1))
    views2, x2, buf2 = vllm_allocate(name, dtype=torch.float16, sentinel=0x5A, **g)
    eb2 = layouts.bind_vllm(views2, kv_cache_layout=name, kv_lora_rank=1 if mla else None, **kw)
    eb2.indexed_copies = indexed
    with kvwire.open(data) as r:
        eb2.scatter(r, ids2).synchronize()
    written = torch.zeros(x2.shape[:-1], dtype=torch.bool)
    for t in range(n):
        written[:, ids2[t // bs], :, t % bs] = True
        for _c, sl in comps.items():
            assert torch.equal(x2[:, ids2[t // bs], :, t % bs, sl].view(torch.int16),
                               x[:, ids[t // bs], :, t % bs, sl].view(torch.int16))
    assert (x2[~written].view(torch.uint8) == 0x5A).all()  # nothing else in the logical tensor
    touched = buf2.view(torch.uint8) != 0x5A
    assert int(touched.sum()) <= int(written.sum()) * x2.shape[-1] * 2  # nor outside it (padding)


# ---------------------------------------------------------------------------------------
# Size hints (KVW-BIND-1) and the CPU backend's case
# ---------------------------------------------------------------------------------------

def test_kvw_bind_1_the_cpu_backend_tensor_is_not_accepted_as_nhd():
    """vLLM 0.11.1-0.22 CPU backend: (2, num_blocks, H, block_size, D), contiguous. Bound
    as FlashAttention NHD it used to be accepted with block_size and heads swapped."""
    gen = torch.Generator().manual_seed(7)
    heads, bs = 2, 32  # the CPU backend needs blocks of a multiple of 32
    cpu = [fill((2, NB, heads, bs, CK), torch.bfloat16, gen, None) for _ in range(L)]
    for name in ("vllm.v0_4_3_to_0_22.flash_nhd", "vllm.flash_nhd"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with pytest.raises(LayoutMismatchError, match=r"pass block_size= and num_heads= \(KVW-BIND-1\)"):
                layouts.bind(name, cpu)
            with pytest.raises(LayoutMismatchError, match="wrong layout name"):
                layouts.bind(name, cpu, num_heads=heads, block_size=bs)  # the hints expose the swap
    eb = layouts.bind("vllm.v0_11_1_to_0_22.cpu", cpu, num_heads=heads, block_size=bs)
    assert eb.block_size == bs and eb.geometry[0].heads == heads
    got = eb.gather([5, 2], bs + 3)
    assert torch.equal(got[1]["v"][:, bs + 2].view(torch.int16), cpu[1][1, 2, :, 2].view(torch.int16))
    assert layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", cpu, num_heads=heads, block_size=bs).gather(
        [5, 2], bs + 3)[1]["v"].view(torch.int16).equal(got[1]["v"].view(torch.int16))  # the same memory


# every registered layout whose tensors (in the form the tests build) another layout reads with
# exchanged axes, and the hints binding it needs; all others bind without size hints
HINTED = {
    "vllm.v0_4_3_to_0_22.flash_nhd": {"block_size", "num_heads"},
    "vllm.v0_9_1_to_0_22.flash_hnd#raw": {"block_size", "num_heads"},
    "vllm.v0_11_1_to_0_22.cpu": {"block_size", "num_heads"},
    "vllm.v0_4_2_to_0_25.blocks_first": {"block_size", "num_heads"},
    "vllm.v0_23_to_0_28.packed": {"block_size", "num_heads"},
    "sglang.host.layer_first": {"num_layers"}, "sglang.host.page_first": {"num_layers"},
    "sglang.host.page_first_direct": {"num_layers", "num_heads"}, "sglang.host.page_head": {"num_layers", "num_heads"},
    "sglang.host.mla.layer_first": {"num_layers"}, "sglang.host.mla.page_first": {"num_layers"},
    "sglang.host.mla.page_first_direct": {"num_layers"}, "kvwire.page.mla": {"num_layers"},
    **{f"vllm.v0_29.{k}": {"block_size", "num_heads"} for k in ("LBHNC", "BLHNC", "BHLNC")},
    "vllm.v0_29.model.LBHNC": {"block_size", "num_heads", "num_layers"},  # contiguous: BLHNC's raw form too
    "vllm.v0_29.model.mla.LBHNC": {"num_layers"},
}
SIZE_HINTS = ("block_size", "num_heads", "num_layers")


@pytest.mark.parametrize("name", sorted({**SPECS, **SPECS29}))
def test_kvw_bind_1_every_layout_needs_exactly_the_hints_that_tell_it_apart(name):
    make, _, kw = {**SPECS, **SPECS29}[name]
    bufs, _ = make(torch.bfloat16, torch.Generator().manual_seed(5), None)
    base = name.split("#")[0]
    merged = any(len(d) > 1 and "KV" not in d for d in layouts.get_layout(base).dims)  # H*C needs its split
    bare = {k: v for k, v in kw.items() if k not in SIZE_HINTS or (merged and k == "num_heads")}
    need = HINTED.get(name, set())
    if need:
        with pytest.raises(LayoutMismatchError, match="KVW-BIND-1") as e:
            layouts.bind(base, bufs, **bare)
        named = set(re.findall(r"(\w+)=", str(e.value).split("pass ")[-1]))
        assert named == need - set(bare), (name, named)
        for k in need:  # each missing one is refused alone too
            partial = {**bare, **{h: kw[h] for h in need if h != k}}
            if k not in bare:
                with pytest.raises(LayoutMismatchError, match=f"{k}="):
                    layouts.bind(base, bufs, **partial)
    else:
        layouts.bind(base, bufs, **bare)
    eb = layouts.bind(base, bufs, **kw)  # with them it binds, and a wrong one is refused
    wrong = {"block_size": eb.block_size + 1, "num_heads": eb.geometry[0].heads + 1, "num_layers": eb.num_layers + 1}
    for k in set(kw) & set(SIZE_HINTS):
        if not (k == "block_size" and eb.layout.addressing == "slot"):
            with pytest.raises(LayoutMismatchError):
                layouts.bind(base, bufs, **{**kw, k: wrong[k]})


# ---------------------------------------------------------------------------------------
# Deprecated names (KVW-BIND-3)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("old,new", sorted(layouts.DEPRECATED.items()))
def test_kvw_bind_3_deprecated_names_warn_and_still_bind(old, new):
    key = new if new in SPECS else new + "#raw"
    make, _, kw = SPECS[key]
    bufs, _ = make(torch.bfloat16, torch.Generator().manual_seed(6), None)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        eb = layouts.bind(old, bufs, **kw)
    assert old not in layouts.layout_names() and new in layouts.layout_names()
    d_old, d_new = eb.layout, layouts.get_layout(new)
    assert d_old.name == old and (d_old.dims, d_old.stride_order, d_old.packing) == (d_new.dims, d_new.stride_order,
                                                                                      d_new.packing)
    ids = [4, 1]
    assert eb.engine_layout().name == old  # what it writes in headers is what it wrote before (KVW-HDR-18)
    same = layouts.bind(new, bufs, **kw)
    for a, b in zip(eb.gather(ids, N + 1), same.gather(ids, N + 1)):
        assert all(np.array_equal(_bytes(a[c]), _bytes(b[c])) for c in a)
    data = layouts.encode_from_engine(same, ids, N + 1)
    with kvwire.open(data) as r:  # a container written under either name restores through the other
        dst, _ = make(torch.bfloat16, torch.Generator().manual_seed(7), 0)
        with pytest.warns(DeprecationWarning):
            layouts.scatter(r, layouts.bind(old, dst, **kw), [2, 0])
        got = layouts.bind(new, dst, **kw).gather([2, 0], N + 1)
        assert all(np.array_equal(_bytes(got[i][c]), _bytes(r.layer(i)[c])) for i in range(L) for c in got[i])


def test_spec_lists_every_name():
    text = SPEC_MD.read_text()
    for name in [*layouts.layout_names(), *layouts.DEPRECATED]:
        assert f"`{name}`" in text or name.startswith("vllm.v0_29."), name
    for name in ORDERS:
        assert f"`vllm.v0_29.{name}`" in text and f"`vllm.v0_29.model.{name}`" in text
