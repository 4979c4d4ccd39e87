"""Request identity through the vLLM connector (spec/store.md KVW-IDENT-1, -4, -7): two
tenants (``cache_salt``) and two LoRA adapters in a real vLLM 0.32 engine never share a
stored chunk and each hits its own; a request with prompt embeddings is neither saved nor
loaded; vLLM's own multimodal ``Request`` objects through the connector's scheduler side
share only the chunks before their image. A missing vLLM venv is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_vllm_e2e import MODEL, REPO, TEXT, run, stats, stored_tokens, vllm_python

pytestmark = pytest.mark.vllm


def make_adapter(path, seed: int):
    """A PEFT-format LoRA adapter (rank 8, q_proj and v_proj of every layer), random
    weights large enough to change the model's KV."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((MODEL / "config.json").read_text())
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * d, "v_proj": cfg["num_key_value_heads"] * d}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, out in outs.items():
            pre = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(8, hidden, generator=g) * 0.3).to(torch.bfloat16)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out, 8, generator=g) * 0.3).to(torch.bfloat16)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(MODEL), "modules_to_save": None}))
    return str(path)


def test_ident7_tenants_and_adapters_never_share_in_a_real_engine(tmp_path):
    """KVW-IDENT-1/7, one engine (vLLM's prefix cache off: every cached token came through
    the connector): tenant B after tenant A with the same prompt gets 0 external hits, then
    each tenant hits its own; adapter 2 after adapter 1 gets nothing, adapter 1 hits its own;
    a request without salt or adapter finds none of theirs; a prompt-embeddings request is
    counted unbindable. The store holds only identified keys for them."""
    p = list(TEXT[:700])
    lora1, lora2 = make_adapter(tmp_path / "lora1", 1), make_adapter(tmp_path / "lora2", 2)
    asks = [dict(prompt_token_ids=p, cache_salt="tenant-a"), dict(prompt_token_ids=p, cache_salt="tenant-b"),
            dict(prompt_token_ids=p, cache_salt="tenant-a"), dict(prompt_token_ids=p, cache_salt="tenant-b"),
            dict(prompt_token_ids=p, lora=["one", 1, lora1]), dict(prompt_token_ids=p, lora=["two", 2, lora2]),
            dict(prompt_token_ids=p, lora=["one", 1, lora1]), dict(prompt_token_ids=p, lora=["two", 2, lora2]),
            {"embeds": 300}, p]
    store = tmp_path / "store"
    res = run(tmp_path, "engine", asks, dict(store=f"file://{store}", stats_path=str(tmp_path / "s")),
              one_by_one=True, dtype="float16", engine=dict(enable_lora=True, max_lora_rank=8, max_loras=2,
                                           enable_prompt_embeds=True))
    cached = [o["num_cached_tokens"] for o in res["outputs"]]
    hit = stored_tokens(p)
    assert cached == [0, 0, hit, hit, 0, 0, hit, hit, 0, 0], cached
    toks = [o["tokens"] for o in res["outputs"]]
    assert toks[2] == toks[0] and toks[3] == toks[1] and toks[6] == toks[4] and toks[7] == toks[5]
    assert toks[4] != toks[5]  # the adapters change the model: sharing their KV would be wrong output
    sched, worker = stats(tmp_path / "s")
    assert sched["unbindable"] == 1 and sched["lookups"] == 9
    assert worker["saved_chunks"] >= 4 * 3 + 3  # 2 tenants + 2 adapters + the plain prompt, 3 chunks each
    segs = {d for _, dirs, _ in os.walk(store) for d in dirs if d.startswith("i") and len(d) == 65}
    assert len(segs) == 4  # one identity digest per tenant and per adapter (KVW-IDENT-5)


def test_ident7_multimodal_requests_share_only_before_the_image(tmp_path):
    """KVW-IDENT-4/7 with vLLM's own Request objects (MultiModalFeatureSpec, PlaceholderRange)
    through the connector's scheduler side: a prompt stored with image img-x at tokens
    300..363 serves the same image fully (699 of 700: all but the last token), a
    different image, the same image at another position or no image only chunk 0 (256, before
    the image), a salted request nothing; prompt embeddings and an adapter whose files are
    missing are unbindable, never looked up. Also the connector's store defaults: ``memory://`` refused with the reason, no store = ``default_store_url()``."""
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), VLLM_LOGGING_LEVEL="WARNING",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([vllm_python(), str(REPO / "tests" / "vllm_requests_driver.py"), str(MODEL),
                           str(tmp_path / "store"), str(out)], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    assert got["matched"] == {"same image": 699, "other image": 256, "same image elsewhere": 256, "no image": 256,
                              "image and salt": 0, "prompt embeds": 0, "missing adapter": 0}
    assert got["counts"]["unbindable"] == 2 and got["counts"]["lookups"] == 5
    # memory:// is refused with the reason; no store = the private per-user directory
    assert "memory://" in got["memory_refusal"] and "separate processes" in got["memory_refusal"]
    assert got["default_store"] == f"file://{tmp_path / 'cache' / 'kvwire' / 'store'}"
