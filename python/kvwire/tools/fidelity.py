"""Fidelity of a codec: what it costs in bits and what it does to the model.

Two levels, because a small tensor error can still flip a token and a large one in an
unimportant channel may not:

- tensor level (numpy only): per layer and component, MSE, max abs error and cosine of
  the decoded cache against the reference; size as bits per element *including* every
  byte of the container (header, records, index, codec metadata such as scales), and the
  ratio against the same cache stored as raw bf16 elements.
- model level (needs a ``ModelHook``, e.g. ``HFHook`` over a transformers causal LM):
  the reference and the decoded cache are each put back into the model; it reads the same
  continuation tokens and we compare next-token distributions (KL(ref || test), top-1
  agreement) and greedy generations (common-prefix fraction of N tokens).

torch is imported only by ``HFHook`` and ``prefill_hf``, never at ``import kvwire``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..cache.encoder import encode_bytes
from ..cache.files import load
from ..cache.kvcache import KVCache
from ..cache.tensors import as_numpy, dtype_name
from .cliargs import count, positive
from .progress import Progress

BF16_BITS = 16


@dataclass(frozen=True)
class TensorError:
    """Error of one decoded tensor (one layer, one component) against the reference."""

    layer: int
    component: str
    mse: float
    max_abs: float
    cosine: float


@dataclass(frozen=True)
class ModelMetrics:
    """Model-level agreement of a decoded cache with the reference cache.

    ``kl``: mean over positions of KL(p_ref || p_test) in nats; ``top1``: fraction of
    positions whose argmax agrees; ``greedy_match``: mean over sequences of (length of
    the common prefix of the two greedy generations) / ``greedy_tokens``.
    """

    kl: float
    top1: float
    greedy_match: float
    positions: int
    greedy_tokens: int


@dataclass
class CodecResult:
    codec: str
    container_bytes: int
    elements: int
    encode_s: float
    decode_s: float
    errors: list = field(default_factory=list)
    model: ModelMetrics | None = None

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.container_bytes / self.elements

    @property
    def ratio_vs_bf16(self) -> float:
        """Raw bf16 element bytes over container bytes (metadata counted against the codec)."""
        return self.elements * BF16_BITS / 8 / self.container_bytes

    @property
    def max_abs(self) -> float:
        return max((e.max_abs for e in self.errors), default=0.0)

    @property
    def min_cosine(self) -> float:
        return min((e.cosine for e in self.errors), default=1.0)

    def mse(self, component: str) -> float:
        """Mean over layers of one component's MSE."""
        vals = [e.mse for e in self.errors if e.component == component]
        return float(np.mean(vals)) if vals else 0.0

    def as_dict(self) -> dict:
        d = {"codec": self.codec, "container_bytes": self.container_bytes, "elements": self.elements,
             "bits_per_element": self.bits_per_element, "ratio_vs_bf16": self.ratio_vs_bf16,
             "encode_s": self.encode_s, "decode_s": self.decode_s, "max_abs": self.max_abs,
             "min_cosine": self.min_cosine, "k_mse": self.mse("k"), "v_mse": self.mse("v"),
             "layers": [e.__dict__ for e in self.errors]}
        if self.model is not None:
            d["model"] = self.model.__dict__
        return d


def _f64(x) -> np.ndarray:
    return as_numpy(x).astype(np.float64)


def tensor_errors(ref: KVCache, test: KVCache) -> list:
    """Per layer and component errors of ``test`` against ``ref`` (same geometry)."""
    if ref.num_layers != test.num_layers:
        raise ValueError(f"{ref.num_layers} reference layers, {test.num_layers} test layers")
    out = []
    for i, (a_layer, b_layer) in enumerate(zip(ref.layers, test.layers)):
        for comp in a_layer:
            a, b = _f64(a_layer[comp]), _f64(b_layer[comp])
            if a.shape != b.shape:
                raise ValueError(f"layer {i} {comp}: shapes {a.shape} and {b.shape} differ")
            d = b - a
            den = np.linalg.norm(a) * np.linalg.norm(b)
            cos = float(np.dot(a.ravel(), b.ravel()) / den) if den else float(np.array_equal(a, b))
            out.append(TensorError(i, comp, float(np.mean(d * d)) if d.size else 0.0,
                                   float(np.max(np.abs(d))) if d.size else 0.0, cos))
    return out


def elements(cache: KVCache) -> int:
    return sum(as_numpy(x).size for layer in cache.layers for x in layer.values())


def roundtrip(caches: Sequence[KVCache], codec, *, label: str | None = None, **encode_opts) -> tuple:
    """Encode each cache with ``codec`` (anything ``kvwire.encode`` accepts) through the
    public API, decode it back with ``kvwire.load``.

    Returns (CodecResult without model metrics, decoded caches)."""
    blobs: list[bytes] = []
    decoded: list[KVCache] = []
    t0 = time.perf_counter()
    for c in caches:
        blobs.append(encode_bytes(c, codec=codec, **encode_opts))
    t1 = time.perf_counter()
    for b in blobs:
        dec = load(b)
        assert isinstance(dec, KVCache)  # a dense cache decodes to one
        decoded.append(dec)
    t2 = time.perf_counter()
    errs = [tensor_errors(ref, dec) for ref, dec in zip(caches, decoded)]
    # over caches: mean MSE, worst max abs error and cosine
    merged = [TensorError(e[0].layer, e[0].component, float(np.mean([x.mse for x in e])),
                          max(x.max_abs for x in e), min(x.cosine for x in e)) for e in zip(*errs)]
    size, count = sum(len(b) for b in blobs), sum(elements(c) for c in caches)
    return CodecResult(label or str(codec), size, count, t1 - t0, t2 - t1, merged), decoded


class ModelHook(Protocol):
    """What the model-level metrics need from a model, whatever its framework."""

    def logits(self, caches: Sequence[KVCache], tokens: np.ndarray) -> np.ndarray:
        """Logits [batch, n, vocab] after reading ``tokens`` [batch, n] past ``caches``
        (one cache per batch row)."""

    def greedy(self, caches: Sequence[KVCache], first: np.ndarray, n: int) -> np.ndarray:
        """[batch, n] greedy tokens generated after reading ``first`` [batch] past ``caches``."""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def logit_agreement(ref_logits: np.ndarray, test_logits: np.ndarray) -> tuple:
    """(mean KL(ref || test) in nats, top-1 agreement) over every position."""
    lp, lq = _log_softmax(ref_logits), _log_softmax(test_logits)
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))
    top1 = float(np.mean(ref_logits.argmax(-1) == test_logits.argmax(-1)))
    return max(kl, 0.0), top1


def common_prefix_fraction(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of (common prefix length / row length)."""
    a, b = np.asarray(a), np.asarray(b)
    same = np.cumprod(a == b, axis=-1)
    return float(same.sum(-1).mean() / a.shape[-1]) if a.size else 1.0


def model_metrics(hook: ModelHook, ref: Sequence[KVCache], test: Sequence[KVCache], continuation: np.ndarray,
                  *, greedy_tokens: int = 32, ref_out: dict | None = None) -> ModelMetrics:
    """Compare the model's behaviour past ``test`` with its behaviour past ``ref``.

    ``continuation`` [batch, n] are the tokens that follow each cached prefix. Pass the
    same dict as ``ref_out`` across calls to compute the reference outputs once."""
    cont = np.asarray(continuation)
    ref_out = {} if ref_out is None else ref_out
    if "logits" not in ref_out:
        ref_out["logits"] = hook.logits(ref, cont)
        ref_out["greedy"] = hook.greedy(ref, cont[:, 0], greedy_tokens) if greedy_tokens else None
    kl, top1 = logit_agreement(ref_out["logits"], hook.logits(test, cont))
    match = 1.0
    if greedy_tokens:
        match = common_prefix_fraction(ref_out["greedy"], hook.greedy(test, cont[:, 0], greedy_tokens))
    return ModelMetrics(kl, top1, match, int(cont.size), greedy_tokens)


def evaluate(caches: Sequence[KVCache], codecs: Sequence[str], *, hook: ModelHook | None = None,
             continuation: np.ndarray | None = None, greedy_tokens: int = 32, on_codec=None, **encode_opts) -> list:
    """A ``CodecResult`` per codec: size, tensor errors and (with a hook) model metrics.

    ``codecs``: names/presets, or (label, codec) pairs for anything else ``encode`` takes;
    ``on_codec(label)`` is called before each (progress)."""
    if hook is not None and continuation is None:
        raise ValueError("a model hook needs the continuation tokens to score")
    out: list[CodecResult] = []
    ref_out: dict = {}
    for item in codecs:
        label, codec = item if isinstance(item, tuple) else (item, item)
        if on_codec is not None:
            on_codec(label)
        res, decoded = roundtrip(caches, codec, label=label, **encode_opts)
        if hook is not None and continuation is not None:
            res.model = model_metrics(hook, caches, decoded, continuation, greedy_tokens=greedy_tokens,
                                      ref_out=ref_out)
        out.append(res)
    return out


# --- K/V statistics ------------------------------------------------------------------

def channel_stats(x) -> dict:
    """Outlier statistics of one [heads, tokens, dim] tensor, per (head, channel).

    ``max_over_median``: largest channel mean magnitude over the median one (a channel
    that is 10x the median wastes most of a per-token quantizer's range);
    ``kurtosis``: excess kurtosis of all elements (0 for a Gaussian);
    ``channel_kurtosis``: excess kurtosis of the per-channel mean magnitudes."""
    a = _f64(x)
    mag = np.abs(a).mean(axis=1).ravel()  # per (head, channel)
    return {"max_over_median": float(mag.max() / max(np.median(mag), 1e-30)),
            "kurtosis": _kurtosis(a.ravel()), "channel_kurtosis": _kurtosis(mag)}


def _kurtosis(v: np.ndarray) -> float:
    v = v - v.mean()
    var = float(np.mean(v * v))
    return float(np.mean(v ** 4) / var ** 2 - 3.0) if var > 0 else 0.0


def kv_stats(cache: KVCache) -> list:
    """Per layer: ``channel_stats`` of K and of V."""
    return [{"layer": i, **{f"{c}_{k}": v for c in ("k", "v") if c in layer
                             for k, v in channel_stats(layer[c]).items()}}
            for i, layer in enumerate(cache.layers)]


# --- transformers models ---------------------------------------------------------------

def astype(cache: KVCache, dtype: str) -> KVCache:
    """The same cache with every tensor converted to ``dtype`` (numpy, rounding to nearest)."""
    from ..format.registry import dtype_info

    np_dtype = dtype_info(dtype)[2]
    return KVCache(cache.header.replace(dtype=dtype),
                   [{c: as_numpy(x).astype(np_dtype) for c, x in layer.items()} for layer in cache.layers])


def prefill_hf(model, input_ids, *, dtype: str = "bf16") -> list:
    """Run a transformers causal LM over ``input_ids`` [batch, tokens]; one ``KVCache``
    per row (``kvwire.adapters.hf.from_hf_batch``), cast to ``dtype``: the form an engine
    would hold and send."""
    import torch

    from ..adapters.hf import from_hf_batch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    past = getattr(out, "cache", None)
    past = past if past is not None else out.past_key_values
    return [astype(c, dtype) for c in from_hf_batch(past, model)]


class HFHook:
    """``ModelHook`` over a transformers causal LM (full-attention layers, K/V only).

    Caches are cast to the model's compute dtype and batched into a ``DynamicCache`` by
    ``kvwire.adapters.hf.to_hf``; one forward pass per call (teacher forcing) or per
    generated token (greedy)."""

    def __init__(self, model):
        import inspect

        import torch

        self.model = model
        self.torch = torch
        self.dtype = dtype_name(next(model.parameters()).detach()[:0])
        # transformers 5 renamed ``past_key_values`` to ``cache``
        self._kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _past(self, caches: Sequence[KVCache]):
        from ..adapters.hf import to_hf

        return to_hf([c if c.header.dtype == self.dtype else astype(c, self.dtype) for c in caches], self.model)

    def logits(self, caches, tokens):
        torch = self.torch
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True, **{self._kw: self._past(caches)})
        return out.logits.float().numpy()

    def greedy(self, caches, first, n):
        torch = self.torch
        past = self._past(caches)
        ids = torch.as_tensor(np.asarray(first), dtype=torch.long)[:, None]
        out = []
        with torch.no_grad():
            for _ in range(n):
                res = self.model(input_ids=ids, use_cache=True, **{self._kw: past})
                past = getattr(res, self._kw)
                ids = res.logits[:, -1].argmax(-1, keepdim=True)
                out.append(ids)
        return torch.cat(out, 1).numpy()


# --- reports and the ``kvwire fidelity`` command ------------------------------------------

def default_codecs() -> list:
    from ..codecs import PRESETS

    return ["raw", "zstd", *PRESETS]


def format_table(results: Sequence[CodecResult]) -> str:
    """A Markdown table of ``evaluate`` results (model columns when measured)."""
    model = any(r.model is not None for r in results)
    head = ["codec", "bits/elem", "ratio vs bf16", "K MSE", "V MSE", "max abs err", "min cosine"]
    if model:
        head += ["logit KL", "top-1", "greedy match"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [f"`{r.codec}`", f"{r.bits_per_element:.2f}", f"{r.ratio_vs_bf16:.2f}x", f"{r.mse('k'):.2e}",
                 f"{r.mse('v'):.2e}", f"{r.max_abs:.3g}", f"{r.min_cosine:.6f}"]
        if model:
            m = r.model
            cells += [f"{m.kl:.2e}", f"{m.top1:.2%}", f"{m.greedy_match:.2%}"] if m else ["-"] * 3
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def text_windows(data: bytes, count: int, length: int, seed: int = 0) -> np.ndarray:
    """``count`` seeded random windows of ``length`` bytes as byte-level token ids."""
    buf = np.frombuffer(data, np.uint8)
    if len(buf) < length + 1:
        raise ValueError(f"text has {len(buf)} bytes, need more than {length}")
    starts = np.random.default_rng(seed).integers(0, len(buf) - length, size=count)
    return np.stack([buf[s:s + length] for s in starts]).astype(np.int64)


def load_hf_model(path):
    """A transformers causal LM from a local directory, float32, eval mode, offline."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()


def configure_cli(p) -> None:
    p.add_argument("--model", help="local transformers model directory (byte-level vocab of 256)")
    p.add_argument("--text", help="text file to draw prompts from (bytes are token ids)")
    p.add_argument("--cache", help="a .kvw container: tensor-level metrics only, no model needed")
    p.add_argument("--codec", action="append", help="codec or preset (repeatable; default: all presets)")
    p.add_argument("--prompts", type=positive, default=8)
    p.add_argument("--prompt-tokens", type=positive, default=512)
    p.add_argument("--continuation", type=count, default=64, help="teacher-forced tokens scored for KL / top-1")
    p.add_argument("--greedy", type=count, default=32, help="greedy tokens compared (0: skip)")
    p.add_argument("--seed", type=count, default=0)
    p.add_argument("--json", help="also write the results as JSON to this path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    p.set_defaults(func=cmd_fidelity)


def cmd_fidelity(args) -> int:
    import json

    codecs = args.codec or default_codecs()
    if args.continuation < 1:
        raise SystemExit("kvwire fidelity: --continuation must be at least 1")
    if args.cache:
        cache = load(args.cache)
        if not isinstance(cache, KVCache):
            raise SystemExit(f"kvwire fidelity: {args.cache} holds a sparse cache; the harness compares dense caches")
        caches, hook, cont = [cache], None, None
    elif args.model and args.text:
        model = load_hf_model(args.model)
        with open(args.text, "rb") as f:
            ids = text_windows(f.read(), args.prompts, args.prompt_tokens + args.continuation, args.seed)
        caches = prefill_hf(model, ids[:, :args.prompt_tokens])
        hook, cont = HFHook(model), ids[:, args.prompt_tokens:]
    else:
        raise SystemExit("kvwire fidelity: give --cache FILE, or --model DIR and --text FILE")
    bar = Progress(len(codecs), "fidelity", quiet=args.quiet)  # stderr, a terminal only
    results = evaluate(caches, codecs, hook=hook, continuation=cont, greedy_tokens=args.greedy, on_codec=bar.step)
    bar.done()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
    return 0
