"""The vLLM connector's former names for what kvwire.layouts now owns (the packing tables,
the CPU views and the per-layer gather / scatter): importable for one release, each warning
with a DeprecationWarning that names its replacement, and still doing what they did, in the
connector's former packing names ("channels", "cpu_vec", "cpu_amx"; MLA by ``mla=True``).
Tested without vLLM: these modules import none."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from kvwire import layouts
from kvwire.format.header import LayerSpec
from kvwire.layouts import gather_slots, slots_from_blocks

PLAN = {"PACKINGS": "SLOT_PACKINGS", "AMX_ROWS": "AMX_ROWS", "check_packing": "check_slot_packing",
        "cpu_vec_views": "cpu_vec_views", "cpu_amx_views": "cpu_amx_views", "gather_layer": "gather_slots",
        "scatter_layer": "scatter_slots"}
ENGINE = {"KV_PACKING": "VLLM_BACKENDS", "CPU_ISA_PACKING": "CPU_ISAS", "CPU_ISA_HEADER_LAYOUT": "CPU_HEADER_LAYOUTS",
          "kv_packing": "layer_packing"}
FORMER = {"channels": ("channels", None), "cpu_vec": ("tokens", "vec"), "cpu_amx": ("tokens", "amx")}


def former(module: str, name: str):
    """``module.name`` and the DeprecationWarning its use gives (exactly one)."""
    mod = importlib.import_module(f"kvwire.integrations.{module}")
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(mod, name)
    assert len(caught) == 1
    return value, str(caught[0].message)


@pytest.mark.parametrize(("module", "name", "instead"), [("vllm_plan", k, v) for k, v in PLAN.items()]
                         + [("vllm_engine", k, v) for k, v in ENGINE.items()])
def test_former_names_warn_and_name_their_replacement(module, name, instead):
    value, message = former(module, name)
    assert f"kvwire.integrations.{module}.{name} is deprecated" in message and instead in message
    assert value is not None
    with pytest.warns(DeprecationWarning, match=name):  # `from ... import name` warns the same
        exec(f"from kvwire.integrations.{module} import {name}", {})


def test_current_names_do_not_warn_and_unknown_names_are_attribute_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvwire.integrations.vllm_engine import engine_layout_of, layer_packing  # noqa: F401 (the former names still import)
        from kvwire.integrations.vllm_plan import ModelKey, chunk_cache, slots  # noqa: F401 (the former names still import)
    import kvwire.integrations.vllm_plan as plan

    with pytest.raises(AttributeError, match="no attribute 'gather_layers'"):
        plan.gather_layers  # noqa: B018 (the attribute access is what warns)
    assert not {*PLAN, *ENGINE} & {*plan.__all__, *importlib.import_module("kvwire.integrations.vllm_engine").__all__}


@pytest.mark.parametrize("packing", sorted(FORMER))
def test_former_gather_and_scatter_copy_as_the_layouts_functions_do(packing):
    """gather_layer / scatter_layer (kv_layer, slot_ids, head_dim, mla, packing) give what
    gather_slots / scatter_slots give for the same packing in kvwire.layouts' names."""
    gather_layer, _ = former("vllm_plan", "gather_layer")
    scatter_layer, _ = former("vllm_plan", "scatter_layer")
    gen = torch.Generator().manual_seed(1)
    buf = torch.randint(-2**15, 2**15 - 1, (4, 2, 32, 64), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    ids = slots_from_blocks([2, 0, 3], 32, 80)[7:]
    new = gather_slots(buf, ids, 32, *FORMER[packing])
    old = gather_layer(buf, ids, 32, False, packing)
    assert all(torch.equal(old[c].view(torch.int16), new[c].view(torch.int16)) for c in ("k", "v"))
    dst = torch.zeros_like(buf)
    scatter_layer(dst, ids, old, 32, False, packing)
    assert torch.equal(gather_slots(dst, ids, 32, *FORMER[packing])["k"].view(torch.int16), new["k"].view(torch.int16))
    latent = gather_layer(buf, ids, 64, True, packing)  # MLA: the whole row, whatever the packing said
    assert torch.equal(latent["latent"].view(torch.int16), gather_slots(buf, ids, 64, "latent")["latent"].view(torch.int16))
    check_packing, _ = former("vllm_plan", "check_packing")
    assert check_packing(packing) == packing
    with pytest.raises(ValueError, match="packing must be one of"):
        check_packing("tokens")


def test_former_tables_answer_from_the_layouts_tables():
    kv, _ = former("vllm_engine", "KV_PACKING")
    assert kv["FLASH_ATTN"] == kv["TRITON_ATTN"] == kv["FLASHINFER"] == kv["FLEX_ATTENTION"] == "channels"
    assert kv["CPU_ATTN"] is None and "ROCM_ATTN" not in kv and "TURBOQUANT" not in kv
    isa, _ = former("vllm_engine", "CPU_ISA_PACKING")
    assert isa["vec"] == isa["vec16"] == "cpu_vec" and isa["amx"] == "cpu_amx"
    assert set(isa) == {k for k, (name, _) in layouts.CPU_ISAS.items() if name} | set(layouts.CPU_HEADER_LAYOUTS)
    header, _ = former("vllm_engine", "CPU_ISA_HEADER_LAYOUT")
    assert header == {"amx": "vllm.v0_32.cpu.amx"}
    rows, _ = former("vllm_plan", "AMX_ROWS")
    assert rows == 16 and former("vllm_plan", "PACKINGS")[0] == ("channels", "cpu_vec", "cpu_amx")
    kv_packing, _ = former("vllm_engine", "kv_packing")
    assert kv_packing(None, "model.layers.0.self_attn.attn", LayerSpec("mla_latent", 1, 576, 0, kv_lora_rank=512,
                                                                    qk_rope_head_dim=64), 16) == "channels"
    views, _ = former("vllm_plan", "cpu_vec_views")
    assert views is layouts.cpu_vec_views
    assert [tuple(t.shape) for t in views(torch.zeros(1, 1, 4, 8))] == [(1, 1, 4, 4), (1, 1, 4, 4)]
