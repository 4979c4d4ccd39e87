"""vLLM's CPU attention with its "amx" kernels (bfloat16 on CPUs with AMX tiles): where K and
V lie in the paged view, and kvwire.layouts' copies of them (packing "tokens", ISA "amx";
spec/layouts.md KVW-BIND-5), which the vLLM connector uses.

The layout was measured, never assumed: ``test_kvw_bind_5_amx_packing_is_what_vllms_amx_kernels_write``
writes random K and V into a sentinel-filled view with vLLM's own ``cpu_attn_reshape_and_cache``
(isa "amx", in the vLLM venv) and checks that ``gather_slots(..., "tokens", "amx")`` gives
exactly those K and V and that ``scatter_slots`` reproduces the op's buffer byte for byte. The
property test checks the same packing against the element formula of KVW-BIND-5 for any
geometry, without vLLM. tests/integrations/test_vllm_e2e.py runs real engines (amx where vLLM picks it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from kvwire.integrations.vllm_plan import slots
from kvwire.layouts import (
    CPU_HEADER_LAYOUTS,
    check_slot_packing,
    cpu_amx_views,
    cpu_header_layout,
    gather_slots,
    scatter_slots,
)

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"

# (block_size, head_dim, kv heads, vLLM kv_cache_dtype): block sizes and head sizes vLLM gives the amx kernels
CASES = [(32, 64, 2, "auto"), (64, 128, 3, "auto"), (128, 32, 1, "auto"), (32, 512, 1, "auto"),
         (32, 256, 2, "fp8"), (64, 64, 2, "fp8_e5m2")]

KERNEL = r"""
import json, sys, numpy as np, torch
import vllm._custom_ops  # noqa: F401 (registers torch.ops._C)
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from kvwire.integrations.vllm_plan import slots
from kvwire.layouts import gather_slots, scatter_slots

out = {"isa_bf16": _get_attn_isa(torch.bfloat16, 32, 64, "auto"),
       "isa_f16": _get_attn_isa(torch.float16, 32, 64, "auto"), "cases": []}
for n, d, h, cdt in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n * d + h)
    blocks, t = [4, 1, 0], 3 * n - 7  # shuffled block ids, the last block partly filled
    ids = slots(blocks, n, 0, t)
    if cdt == "auto":  # any finite bf16 bit pattern
        def rnd():
            x = torch.randint(-2**15, 2**15, (t, h, d), dtype=torch.int16, generator=g)
            return torch.where((x & 0x7F80) == 0x7F80, x & ~0x4000, x).view(torch.bfloat16)
        k, v = rnd(), rnd()
        want_k, want_v = k, v
        buf = torch.full((6, h, n, 2 * d), 0x5A5A, dtype=torch.int16).view(torch.bfloat16)
    else:  # normal fp8 values, exact in bf16: the op's conversion is exact
        f8 = torch.float8_e4m3fn if cdt == "fp8" else torch.float8_e5m2
        def rnd():
            m = torch.randint(0, 4, (t, h, d), generator=g).float()
            e = torch.randint(-4, 5, (t, h, d), generator=g).float()
            s = torch.randint(0, 2, (t, h, d), generator=g).float() * 2 - 1
            return (s * (1 + m / 4) * 2 ** e).to(torch.bfloat16)
        k, v = rnd(), rnd()
        want_k, want_v = k.to(f8).view(torch.uint8), v.to(f8).view(torch.uint8)
        buf = torch.full((6, h, n, 2 * d), 0x5A, dtype=torch.uint8)
    before = buf.clone()
    kc, vc = buf.view(6, h, 2 * n, -1).chunk(2, dim=2)  # cpu_attn.py:415-416
    try:
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.from_numpy(ids), "amx", 1.0, 1.0, cdt)
    except Exception as e:  # noqa: BLE001 - a build without the amx kernels: reported, the test decides
        out["cases"].append({"case": [n, d, h, cdt], "refused": str(e)[:300]})
        continue
    b = lambda x: x.contiguous().view(torch.uint8)
    got = gather_slots(buf, ids, d, "tokens", "amx")
    mine = before.clone()
    scatter_slots(mine, ids, {"k": want_k.permute(1, 0, 2).contiguous(), "v": want_v.permute(1, 0, 2).contiguous()},
                  d, "tokens", "amx")
    vec = gather_slots(buf, ids, d, "tokens", "vec")
    out["cases"].append({
        "case": [n, d, h, cdt], "touched": int((b(buf) != b(before)).sum()),
        "gather_k": torch.equal(b(got["k"]), b(want_k.permute(1, 0, 2))),
        "gather_v": torch.equal(b(got["v"]), b(want_v.permute(1, 0, 2))),
        "scatter_bytes": torch.equal(b(mine), b(buf)),
        "vec_reading_differs": not torch.equal(b(vec["k"]), b(want_k.permute(1, 0, 2)))})
json.dump(out, sys.stdout)
"""


@pytest.mark.vllm
def test_kvw_bind_5_amx_packing_is_what_vllms_amx_kernels_write():
    """KVW-BIND-5, measured: K and V written by vLLM's cpu_attn_reshape_and_cache with isa
    "amx" (bfloat16, fp8 and fp8_e5m2 caches; block sizes 32-128, head sizes 32-512; shuffled
    block ids, a partial last block) are gathered back exactly with packing "cpu_amx", and a
    scatter of them into the same sentinel buffer gives the op's buffer byte for byte (nothing
    else touched); the vec kernels' reading of those bytes is wrong. Wherever vLLM would pick
    amx for bfloat16, the op must have run."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: `make test` builds the vLLM venv (make vllm-venv)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), VLLM_LOGGING_LEVEL="ERROR")
    p = subprocess.run([str(VLLM_PY), "-c", KERNEL, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(REPO))
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout)
    assert res["isa_f16"] != "amx"  # vLLM 0.32 gives amx bfloat16 only
    ran = [c for c in res["cases"] if "refused" not in c]
    if res["isa_bf16"] == "amx":  # this host runs bf16 engines on the amx kernels: every case measured
        assert len(ran) == len(CASES), res
    for c in ran:
        n, d, h, cdt = c["case"]
        assert c["gather_k"] and c["gather_v"] and c["scatter_bytes"] and c["vec_reading_differs"], c
        width = 2 if cdt == "auto" else 1
        assert 0 < c["touched"] <= (3 * n - 7) * h * d * 2 * width, c  # K and V of those tokens, no more


@st.composite
def geometries(draw):
    n = 16 * draw(st.integers(1, 4))
    d = 16 * draw(st.integers(1, 4))
    h, nb = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    t = draw(st.integers(1, nb * n))
    ids = draw(st.permutations(range(nb)))[:-(-t // n)]
    return n, d, h, nb, t, ids, draw(st.sampled_from([torch.bfloat16, torch.uint8])), draw(st.integers(0, 2**31))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(geometries())
def test_kvw_bind_5_cpu_amx_addresses_the_spec_formula(geo):
    """KVW-BIND-5 for any block size and head size (multiples of 16), head count, block ids
    and dtype width: scatter with packing "cpu_amx" puts token t's channel c of K at element
    (t/16 * D/2 + c/2) * 32 + t%16 * 2 + c%2 of the block and head's K half and of V at
    (c/16 * N/2 + t/2) * 32 + c%16 * 2 + t%2 of its V half, touches nothing else, and gather
    reads exactly those K and V back."""
    n, d, h, nb, t, ids, dtype, seed = geo
    gen = torch.Generator().manual_seed(seed)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.uint8

    def rand(shape):
        lo, hi = (-2**15, 2**15) if bits == torch.int16 else (0, 256)
        return torch.randint(lo, hi, shape, dtype=torch.int32, generator=gen).to(bits)

    k, v = rand((h, t, d)), rand((h, t, d))
    buf = torch.zeros((nb, h, n, 2 * d), dtype=bits)
    sl = slots(ids, n, 0, t)
    scatter_slots(buf.view(dtype), sl, {"k": k.view(dtype), "v": v.view(dtype)}, d, "tokens", "amx")
    halves = buf.view(nb, h, 2, n * d)
    tt = np.arange(t)
    blk, off = np.asarray(ids)[tt // n], tt % n
    c = np.arange(d)
    kpos = ((off[:, None] // 16) * (d // 2) + c[None] // 2) * 32 + (off[:, None] % 16) * 2 + c[None] % 2  # [t, d]
    vpos = ((c[None] // 16) * (n // 2) + off[:, None] // 2) * 32 + (c[None] % 16) * 2 + off[:, None] % 2
    bt = torch.from_numpy(blk)[:, None]
    for head in range(h):
        assert torch.equal(halves[bt, head, 0, torch.from_numpy(kpos)], k[head])
        assert torch.equal(halves[bt, head, 1, torch.from_numpy(vpos)], v[head])
    assert int((buf != 0).sum()) == int((k != 0).sum() + (v != 0).sum())  # nothing else written
    got = gather_slots(buf.view(dtype), sl, d, "tokens", "amx")
    assert torch.equal(got["k"].view(bits), k) and torch.equal(got["v"].view(bits), v)


def test_kvw_bind_5_amx_views_refuse_other_geometries_and_the_connector_maps_amx():
    """Block sizes or head sizes that are not multiples of 16 are refused (a ValueError naming
    the rule's sizes), never read as tiles; vLLM's "amx" ISA is copied as such (the vector ISAs
    as "vec") and has the header layout name of KVW-BIND-5."""
    for shape in ((2, 1, 24, 64), (2, 1, 32, 40)):
        with pytest.raises(ValueError, match="multiples of 16"):
            cpu_amx_views(torch.zeros(shape, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="multiples of 16"):
            gather_slots(torch.zeros(shape, dtype=torch.bfloat16), np.arange(3), shape[3] // 2, "tokens", "amx")
    assert check_slot_packing("tokens", "amx") == "amx"
    assert check_slot_packing("tokens", "vec") == check_slot_packing("tokens", "vec16", "bfloat16") == "vec"
    assert CPU_HEADER_LAYOUTS == {"amx": "vllm.v0_32.cpu.amx"} == {"amx": cpu_header_layout("amx", "bfloat16")}
    assert cpu_header_layout("vec", "bfloat16") == "vllm.v0_29.cpu.vec"
    assert "`vllm.v0_32.cpu.amx`" in (REPO / "spec" / "layouts.md").read_text()
