"""vLLM 0.29-0.32 attention backends: where K and V lie in the view they hand connectors.

Every backend's per-layer view has vLLM's shape ``[num_blocks, H, block_size, 2 * head_size]``,
but the content-dim backends (FlashAttention, Triton, FlashInfer, Flex, ...) read it as
``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` while the CPU backend reads it as
``kv_cache.view(B, H, 2 * block_size, -1).chunk(2, dim=2)`` (cpu_attn.py:414-416), and its
vector kernels (``cpu_attn_reshape_and_cache``, ISA vec / vec16 / ...) write each block's K
transposed: ``key_cache + block * stride0 + head * stride1 + c * block_size + n``
(csrc/cpu/cpu_attn_vec.hpp). The references below are exactly those reads, written here
with plain torch indexing; ``test_the_cpu_kernels_of_vllm_agree`` runs vLLM's own op.
Binders are told the backend (KVW-BIND-4) and never assume its packing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from test_layouts import CK, MLA_C, NB, H, L, N, _bytes, roundtrip
from test_layouts_vllm032 import vllm_allocate

import kvwire
from kvwire import layouts
from kvwire.layouts import LayoutMismatchError

REPO = Path(__file__).resolve().parents[2]
SPEC_MD = REPO / "spec" / "layouts.md"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
CPU = "vllm.v0_29.cpu.vec"
VEC_ISAS = ("vec", "vec16", "rvv", "vsx", "vxe", "neon")
CONTENT = ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "FLEX_ATTENTION", "FLASHINFER",
           "HPC_ATTN", "ROCM_AITER_UNIFIED_ATTN")


def cpu_kernel_views(view):
    """(K transposed [B, H, D, N], V [B, H, N, D]) of a CPU_ATTN view, read as vLLM does:
    cpu_attn.py's view/chunk, then the vec kernels' K addressing inside each block."""
    b, h, n, c = view.shape
    key_cache, value_cache = view.view((b, h, n * 2, -1)).chunk(2, dim=2)
    return key_cache.flatten(2).view(b, h, c // 2, n), value_cache


def content_views(view, head_size):
    """(K, V) as [B, N, H, D] as the content-dim backends read the view (flash_attn.py:1252)."""
    return view.transpose(1, 2).split(head_size, dim=-1)


def _cpu_entry():
    """(make, ref, bind kwargs) for test_layouts.roundtrip: vLLM's LBHNC views, the CPU reading."""
    def make(dt, g, s):
        views, _, _ = vllm_allocate("LBHNC", dtype=dt, gen=g, sentinel=s)
        return views, [cpu_kernel_views(v) for v in views]

    def ref(st_, layer, c, p):
        kt, v = st_[layer]
        return kt[p[0], :, :, p[1]] if c == "k" else v[p[0], :, p[1]]

    return make, ref, {"num_heads": H, "block_size": N, "head_dim": CK}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_kvw_bind_4_cpu_vec_roundtrip_bit_exact(dtype):
    """gather -> encode -> decode == the CPU backend's reading of its view; scatter at other
    block ids writes exactly those tokens, read back the same way."""
    roundtrip(CPU, getattr(torch, dtype), entry=_cpu_entry())
    roundtrip(CPU, getattr(torch, dtype), entry=_cpu_entry(), indexed=True, chunk_tokens=N + 1, seed=3)


@st.composite
def cpu_cases(draw):
    g = dict(num_layers=draw(st.integers(1, 3)), num_blocks=draw(st.integers(2, 6)), heads=draw(st.integers(1, 3)),
             block_size=draw(st.integers(1, 5)), head_size=draw(st.integers(1, 6)))
    n = draw(st.integers(1, g["num_blocks"] * g["block_size"]))
    need = -(-n // g["block_size"])
    ids = draw(st.permutations(range(g["num_blocks"])))[:need]
    ids2 = draw(st.permutations(range(g["num_blocks"])))[:need]
    return g, n, ids, ids2, draw(st.sampled_from(VEC_ISAS)), draw(st.booleans()), draw(st.integers(0, 2**31))


@given(cpu_cases())
def test_kvw_bind_4_property_cpu_views_against_the_cpu_kernels(case):
    """Any geometry and block ids: K and V written the way CPU_ATTN's kernels write them are
    gathered back exactly; a scatter writes them where those kernels read them, nothing else."""
    g, n, ids, ids2, isa, indexed, seed = case
    bs, hs, heads = g["block_size"], g["head_size"], g["heads"]
    gen = torch.Generator().manual_seed(seed)
    views, _, _ = vllm_allocate("LBHNC", dtype=torch.float16, sentinel=0, **g)
    k = torch.randint(-2**15, 2**15, (g["num_layers"], n, heads, hs), dtype=torch.int16, generator=gen)
    v = torch.randint(-2**15, 2**15, (g["num_layers"], n, heads, hs), dtype=torch.int16, generator=gen)
    for layer, view in enumerate(views):  # cpu_attn_reshape_and_cache, token t at slot ids[t // bs] * bs + t % bs
        kt, vc = cpu_kernel_views(view.view(torch.int16))
        for t in range(n):
            kt[ids[t // bs], :, :, t % bs] = k[layer, t]
            vc[ids[t // bs], :, t % bs] = v[layer, t]
    kw = dict(num_kv_heads=heads, head_dim=hs, block_size=bs, attn_backend="CPU_ATTN", cpu_isa=isa)
    assert layouts.vllm_layout_of(views, **kw).name == CPU
    eb = layouts.bind_vllm(views, **kw)
    eb.indexed_copies = indexed
    got = eb.gather(ids, n)
    for layer in range(g["num_layers"]):
        assert torch.equal(got[layer]["k"].view(torch.int16), k[layer].permute(1, 0, 2))
        assert torch.equal(got[layer]["v"].view(torch.int16), v[layer].permute(1, 0, 2))
    data = layouts.encode_from_engine(eb, ids, n, chunk_tokens=max(1, bs - 1))
    views2, _, buf2 = vllm_allocate("LBHNC", dtype=torch.float16, sentinel=0x5A, **g)
    eb2 = layouts.bind_vllm(views2, **kw)
    eb2.indexed_copies = indexed
    with kvwire.open(data) as r:
        eb2.scatter(r, ids2).synchronize()
    for layer, view in enumerate(views2):
        kt, vc = cpu_kernel_views(view.view(torch.int16))
        for t in range(n):
            assert torch.equal(kt[ids2[t // bs], :, :, t % bs], k[layer, t])
            assert torch.equal(vc[ids2[t // bs], :, t % bs], v[layer, t])
    touched = int((buf2.view(torch.uint8) != 0x5A).sum())
    assert touched <= g["num_layers"] * n * heads * hs * 2 * 2  # K and V of those tokens, 2 bytes each, no more


KERNEL = r"""
import sys, numpy as np, torch
import vllm._custom_ops  # noqa: F401 (registers torch.ops._C)
out = sys.argv[1]
B, H, N, D, T = 5, 2, 32, 32, 70
ids = np.array([3, 0, 4], dtype=np.int64)
slots = torch.from_numpy(np.array([ids[t // N] * N + t % N for t in range(T)], dtype=np.int64))
g = torch.Generator().manual_seed(0)
for isa in ("vec", "vec16"):
    for name in ("bfloat16", "float16", "float32"):
        dt = getattr(torch, name)
        k, v = torch.randn(T, H, D, generator=g).to(dt), torch.randn(T, H, D, generator=g).to(dt)
        kv = torch.zeros(B, H, N, 2 * D, dtype=dt)  # one CPU_ATTN layer view
        kc, vc = kv.view(B, H, 2 * N, -1).chunk(2, dim=2)  # cpu_attn.py:415-416
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 1.0, 1.0, "auto")
        for what, x in (("k", k), ("v", v), ("kv", kv)):
            np.save(f"{out}/{isa}-{name}-{what}.npy", x.contiguous().view(torch.uint8).numpy(), allow_pickle=False)
"""


@pytest.mark.vllm
def test_the_cpu_kernels_of_vllm_agree(tmp_path):
    """KVW-BIND-4 against vLLM 0.32 itself: K and V written into a CPU_ATTN view by its own
    ``cpu_attn_reshape_and_cache`` (ISA vec and vec16) gather back bit-exactly through
    ``vllm.v0_29.cpu.vec``; read as a content-dim view they would not."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: `make test` builds the vLLM venv (make vllm-venv)")
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    run = subprocess.run([str(VLLM_PY), str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    B, H_, N_, D, T, ids = 5, 2, 32, 32, 70, [3, 0, 4]
    for isa in ("vec", "vec16"):
        for name in ("bfloat16", "float16", "float32"):
            dt = getattr(torch, name)
            load = {w: torch.from_numpy(np.load(tmp_path / f"{isa}-{name}-{w}.npy")).view(dt) for w in ("k", "v", "kv")}
            kv = load["kv"].view(B, H_, N_, 2 * D)
            eb = layouts.bind_vllm([kv], num_kv_heads=H_, head_dim=D, block_size=N_, attn_backend="CPU_ATTN",
                                   cpu_isa=isa)
            got = eb.gather(ids, T)[0]
            for c in ("k", "v"):
                want = load[c].view(T, H_, D).permute(1, 0, 2)
                assert np.array_equal(_bytes(got[c]), _bytes(want)), (isa, name, c)
            assumed = layouts.bind_vllm([kv], num_kv_heads=H_, head_dim=D, block_size=N_,
                                        kv_cache_layout="LBHNC").gather(ids, T)[0]
            assert not np.array_equal(_bytes(assumed["k"]), _bytes(got["k"]))  # why the backend must be known


@pytest.mark.parametrize("backend", CONTENT)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_kvw_bind_4_content_dim_backends_read_as_they_do(backend, layout):
    """The content-dim backends give ``vllm.v0_29.X``; gather equals their own split of the view."""
    views, _, _ = vllm_allocate(layout, gen=torch.Generator().manual_seed(11))
    kw = dict(num_kv_heads=H, head_dim=CK, block_size=N, attn_backend=backend, kv_cache_layout=layout)
    assert layouts.vllm_layout_of(views, **kw).name == f"vllm.v0_29.{layout}"
    assert layouts.vllm_kv_packing(backend) == "channels"
    ids = [5, 2, 7]
    got = layouts.bind_vllm(views, **kw).gather(ids, 2 * N + 1)
    for layer, view in enumerate(views):
        kc, vc = content_views(view, CK)  # [B, N, H, D]
        for c, x in (("k", kc), ("v", vc)):
            want = torch.stack([x[ids[t // N], t % N] for t in range(2 * N + 1)], 1)
            assert np.array_equal(_bytes(got[layer][c]), _bytes(want))


def test_kvw_bind_4_the_packing_of_each_backend():
    assert layouts.vllm_kv_packing("CPU_ATTN") == "tokens"
    assert layouts.vllm_kv_packing("FLASHINFER") == "channels"
    assert layouts.vllm_kv_packing("FLASHINFER", kv_cache_dtype="nvfp4") == "heads"  # flashinfer.py:2159
    assert layouts.vllm_kv_packing("FLASH_ATTN", num_head_slots=2) == "heads"  # ROCm AITER, shuffled KV cache
    assert layouts.vllm_kv_packing("FLASH_ATTN", kv_cache_dtype="fp8") == "channels"
    for name in ("ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "B12X"):
        assert layouts.vllm_kv_packing(name) == "heads"
    assert layouts.vllm_kv_packing("TURBOQUANT") == layouts.vllm_kv_packing("ULTRAQUANT") == "quantised"
    assert layouts.vllm_kv_packing("FLASHMLA") == layouts.vllm_kv_packing("CPU_MLA") == "latent"
    assert {p for p, _ in layouts.VLLM_BACKENDS.values()} == set(layouts.KV_PACKINGS)


@pytest.mark.parametrize("name", ["NOPE_ATTN", "MAMBA2_ATTN", "flash_attn", ""])
def test_kvw_bind_4_an_unknown_backend_is_refused_naming_the_known(name):
    views, _, _ = vllm_allocate("LBHNC", gen=torch.Generator().manual_seed(12))
    for call in (lambda: layouts.vllm_kv_packing(name),
                 lambda: layouts.vllm_layout_of(views, num_kv_heads=H, head_dim=CK, block_size=N, attn_backend=name)):
        with pytest.raises(LayoutMismatchError, match=r"known: .*CPU_ATTN.*FLASH_ATTN.*KVW-BIND-4"):
            call()
    with pytest.raises(TypeError, match="get_name"):
        layouts.vllm_kv_packing(None)


def _cpu(views, **kw):
    base = dict(num_kv_heads=H, head_dim=CK, block_size=N, attn_backend="CPU_ATTN", cpu_isa="vec")
    return layouts.vllm_layout_of(views, **{**base, **kw}).name


@pytest.mark.parametrize("call,match", [
    (lambda v: _cpu(v, cpu_isa=None), r"pass cpu_isa= .*registered: vec, vec16"),
    (lambda v: _cpu(v, cpu_isa="amx"), "AMX tiles"),
    (lambda v: _cpu(v, cpu_isa="sve"), "not known here; known: vec"),
    (lambda v: _cpu(v, cpu_isa="neon"), "BFMMLA"),  # vllm_allocate's views are bfloat16
    (lambda v: _cpu(v, kv_cache_layout="NHD"), "LBHNC only"),
    (lambda v: _cpu(v, kv_cache_layout="BLHNC"), "LBHNC only"),
    (lambda v: _cpu(v, mla=True), "the caller said mla=True"),
    (lambda v: _cpu(layouts.vllm_cross_layer_view(v), num_layers=L), "per-layer views"),
    (lambda v: _cpu([x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for x in v]), "not the CPU backend's"),
    (lambda v: _cpu(v, num_kv_heads=H + 1), "not vLLM's"),
    (lambda v: _cpu(v, attn_backend="FLASHMLA", mla=True, num_kv_heads=1, head_dim=CK, cpu_isa=None),
     "not vLLM's"),
    (lambda v: _cpu(v, attn_backend="FLASHMLA", cpu_isa=None), "keeps one MLA latent"),
    (lambda v: _cpu(v, attn_backend="FLASH_ATTN", mla=True, cpu_isa=None), "the caller said mla=True"),
    (lambda v: _cpu(v, attn_backend="ROCM_ATTN", cpu_isa=None), "as heads .* no registered layout"),
    (lambda v: _cpu(v, attn_backend="TURBOQUANT", cpu_isa=None), "as quantised"),
])
def test_kvw_bind_4_what_the_backend_rules_out_is_refused(call, match):
    views, _, _ = vllm_allocate("LBHNC", gen=torch.Generator().manual_seed(13))
    with pytest.raises(LayoutMismatchError, match=match):
        call(views)


def test_cpu_isa_without_the_cpu_backend_is_misuse():
    views, _, _ = vllm_allocate("LBHNC", gen=torch.Generator().manual_seed(13))
    for backend in (None, "FLASH_ATTN"):
        with pytest.raises(ValueError, match="CPU_ATTN") as e:
            _cpu(views, attn_backend=backend)
        assert not isinstance(e.value, LayoutMismatchError)


def test_kvw_bind_4_backend_and_kv_cache_layout_together():
    views, _, _ = vllm_allocate("LBHNC", dtype=torch.float16, gen=torch.Generator().manual_seed(14))
    for isa in VEC_ISAS:  # every vector ISA writes the same layout; neon for float16 / float32 only
        assert _cpu(views, cpu_isa=isa) == CPU
    assert _cpu(views, kv_cache_layout="HND") == _cpu(views, kv_cache_layout="LBHNC") == CPU
    assert _cpu([v.clone() for v in views]) == CPU  # separate tensors: the CPU backend has one layout anyway
    assert _cpu(views[:1]) == CPU  # one layer: no kv_cache_layout needed either
    # the content-dim backends still need kv_cache_layout where the strides fit several (KVW-BIND-2)
    one = views[:1]
    with pytest.raises(LayoutMismatchError, match="alike: pass kv_cache_layout="):
        _cpu(one, attn_backend="FLASH_ATTN", cpu_isa=None)
    assert _cpu(one, attn_backend="FLASH_ATTN", cpu_isa=None, kv_cache_layout="BLHNC") == "vllm.v0_29.BLHNC"
    nhd, _, _ = vllm_allocate("LBNHC", gen=torch.Generator().manual_seed(14))
    with pytest.raises(LayoutMismatchError, match="kv_cache_layout says LBHNC"):
        _cpu(nhd, attn_backend="TRITON_ATTN", cpu_isa=None, kv_cache_layout="LBHNC")
    with pytest.raises(LayoutMismatchError, match="not the CPU backend's"):
        _cpu(nhd)
    mla, _, _ = vllm_allocate("LBHNC", mla=True, head_size=MLA_C, gen=torch.Generator().manual_seed(14))
    assert _cpu(mla, attn_backend="CPU_MLA", mla=True, num_kv_heads=1, head_dim=MLA_C, cpu_isa=None,
                kv_cache_layout="LBHNC") == "vllm.v0_29.mla.LBHNC"


def test_without_a_backend_the_content_dim_packing_is_assumed():
    """attn_backend=None keeps the behaviour of earlier releases (documented as an
    assumption): a CPU view is read as ``vllm.v0_29.LBHNC``, which means other bytes."""
    views, _, _ = vllm_allocate("LBHNC", gen=torch.Generator().manual_seed(15))
    assert _cpu(views, attn_backend=None, cpu_isa=None) == "vllm.v0_29.LBHNC"
    kw = dict(num_kv_heads=H, head_dim=CK, block_size=N)
    assumed = layouts.bind_vllm(views, **kw).gather([1, 4], N + 2)
    cpu = layouts.bind_vllm(views, attn_backend="CPU_ATTN", cpu_isa="vec16", **kw).gather([1, 4], N + 2)
    assert not np.array_equal(_bytes(assumed[0]["k"]), _bytes(cpu[0]["k"]))


def test_the_cpu_descriptor_binds_the_engine_view_or_its_reinterpretation():
    """Binding takes the [B, H, N, 2*C] view as vLLM hands it over, or the same memory as
    [B, H, 2, N, C]; no size hints are needed (the 5-D form fits no other layout), given
    ones are checked, and a view whose rows are not dense cannot be read."""
    d = layouts.get_layout(CPU)
    assert d.axes == "B,H,KV,N,C" and d.order_of("k") == (0, 1, 2, 4, 3) and d.order_of("v") == (0, 1, 2, 3, 4)
    assert str(d) == f"{CPU} [B,H,KV,N,C], K memory B,H,KV,C,N (split, per layer)"
    assert layouts.needed_hints(d, False) == {}
    views, _, _ = vllm_allocate("LBHNC", gen=torch.Generator().manual_seed(16))
    five = [v.view(NB, H, 2, N, CK) for v in views]
    a, b = layouts.bind(CPU, views), layouts.bind(CPU, five, num_heads=H, block_size=N, num_layers=L, head_dim=CK)
    assert a.block_size == N and a.geometry[0].heads == H and a.geometry[0].dim_k == CK
    for x, y in zip(a.gather([2, 6], N + 3), b.gather([2, 6], N + 3)):
        assert all(np.array_equal(_bytes(x[c]), _bytes(y[c])) for c in x)
    assert a.engine_layout().name == CPU and a.engine_layout().axes == "B,H,KV,N,C"
    for bad, match in ((dict(block_size=N + 1), "wrong layout name"), (dict(num_heads=H + 1), "wrong layout name")):
        with pytest.raises(LayoutMismatchError, match=match):
            layouts.bind(CPU, views, **bad)
    with pytest.raises(LayoutMismatchError, match="cannot be read as"):
        layouts.bind(CPU, [v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for v in views])
    with pytest.raises(LayoutMismatchError, match="odd size"):
        layouts.bind(CPU, [torch.zeros(NB, H, N, 2 * CK + 1)])


def test_component_order_and_engine_view_are_validated():
    D = layouts.LayoutDescriptor
    dims = (("B",), ("H",), ("KV",), ("N",), ("C",))
    with pytest.raises(ValueError, match="component_order"):
        D("x", dims, (0, 1, 2, 3, 4), "split", "layer", component_order=(("k", (0, 2, 1, 4, 3)),))  # crosses KV
    with pytest.raises(ValueError, match="component_order"):
        D("x", dims, (0, 1, 2, 3, 4), "split", "layer", component_order=(("latent", (0, 1, 2, 4, 3)),))
    with pytest.raises(ValueError, match="component_order"):
        D("x", (("B",), ("H",), ("N",), ("KV", "C")), (0, 1, 2, 3), "fused", "layer",
          component_order=(("k", (0, 1, 3, 2)),))
    with pytest.raises(ValueError, match="engine_view"):
        D("x", dims, (0, 1, 2, 3, 4), "split", "layer", engine_view="B,H,N,C")  # K and V need a doubled size
    with pytest.raises(ValueError, match="engine_view"):
        D("x", dims, (0, 1, 2, 3, 4), "split", "layer", engine_view="B,T,N,2*C")


def test_spec_states_each_backends_packing_and_kvw_bind_4():
    """spec/layouts.md 3.4 lists every backend of VLLM_BACKENDS with its packing, every
    CPU ISA, and the rule."""
    text = SPEC_MD.read_text()
    assert '<a id="kvw-bind-4"></a>' in text and "**KVW-BIND-4**" in text and f"`{CPU}`" in text
    rows = dict(re.findall(r"^\| `([A-Z0-9_]+)` \| (channels|tokens|heads|latent|quantised) \|", text, re.MULTILINE))
    named = {k: p for k, (p, _) in layouts.VLLM_BACKENDS.items() if p != "latent"}
    assert {k: rows.get(k) for k in named} == named
    assert all(f"`{k}`" in text for k in layouts.VLLM_BACKENDS)
    assert all(f"`{isa}`" in text for isa in layouts.CPU_ISAS)
