"""``kvwire conformance crossmodel``: caches of real architectures cross a process boundary.

For every tiny model of ``adapters.zoo`` (one per Hugging Face ``model_type``: MHA, GQA,
MQA, MLA latent, sliding windows, shared layers) the *producer* (this process) prefills a
prompt, encodes the transformers cache with ``adapters.hf.from_hf`` and continues greedy
generation from the original cache. ONE *receiver* subprocess, started first so that its
torch/transformers import overlaps the producer's work, builds its own models from the
same seeds and then takes every file:
it checks compatibility from the header (``kvwire.check_compatible``), loads the cache,
converts it back (``adapters.hf.to_hf``) and continues generation. The checks:

* ``roundtrip`` -- tokens AND logits of the receiver's continuation are bit-identical to
  the producer's (float32 bytes, every step);
* ``verdict`` -- the receiver's own model is judged compatible without conversions;
* ``soft`` -- a copy rechunked (``chunk_tokens`` 3), zstd-compressed and in stream form
  is still compatible and continues bit-identically; a bf16 copy is accepted with a dtype
  conversion, a copy with an identity layer map with a "layer map" conversion;
* ``other_model`` -- another model type (with another fingerprint) rejects the cache and
  says why;
* ``other_seed`` -- the same config built from another seed (same shapes, other weights)
  rejects it, naming the weights fingerprint, also when the cache carries a layer map (an
  identity map, which the same-seed receiver accepts as a "layer map" conversion in ``soft``);
* ``sliding`` -- (models with sliding-window layers) those layers carry fewer tokens than
  the full layers, ``window - 1`` as transformers keeps them, and still continue exactly;
* ``alias`` -- (models with KV-shared layers, gemma3n) every shared layer is mapped (layer
  map ``alias`` entries and/or ``shared`` layers' ``source_layer``) to the layer whose KV
  transformers actually reuses.

The receiver is ``crossmodel_receiver`` (its own ``-m`` entry point, a fresh process);
the checks are ``crossmodel_checks``; running the models is ``generation``. This module
is the suite: the producer, the jobs, the run and its reports. Results are
``results.CaseResult`` s so the JUnit writer of ``report`` applies unchanged.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .crossmodel_checks import CHECKS, CORE_CHECKS, RECHUNK, Produced, check_cells
from .crossmodel_receiver import OTHER_SEED, Receiver
from .generation import forward, greedy, hf_modules, prompt_ids, quiet_torch
from .results import ERROR, FAIL, PASS, SKIP, CaseResult, RunResult

LEVEL = "crossmodel"
PROMPT_TOKENS = 20  # > every tiny sliding window (8): sliding layers keep fewer tokens
NEW_TOKENS = 4


# ---------------------------------------------------------------------------------------
# The producer (this process)
# ---------------------------------------------------------------------------------------

def _hf_layer_tokens(cache) -> list:
    out = []
    for layer in getattr(cache, "layers", ()):
        keys = getattr(layer, "keys", None)
        out.append(int(keys.shape[-2]) if keys is not None and getattr(keys, "ndim", 0) == 4 else None)
    return out


def _cache_windows(cache) -> list:
    """Sliding window of each layer as transformers' own cache layers have it (0: none)."""
    return [int(getattr(layer, "sliding_window", 0) or 0) for layer in getattr(cache, "layers", ())]


def _config_aliases(config) -> dict:
    """Receiver layer -> the layer whose KV it reuses, as transformers decides (gemma3n's
    ``kv_sharing_modes``: "reuse" layers take the "store" layer of their layer type)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if not modes:
        return {}
    types = config.layer_types
    store = {types[i]: i for i, m in enumerate(modes) if m == "store"}
    return {i: store[types[i]] for i, m in enumerate(modes) if m == "reuse"}


def _describe_layers(layers) -> str:
    """"full_attention 2x16, sliding_attention/8 2x16, shared" (kind[/window] heads x head_dim)."""
    seen = []
    for s in layers:
        if s.kind == "mla_latent":
            text = f"mla_latent {s.kv_lora_rank}+{s.qk_rope_head_dim}"
        elif s.kind == "shared":
            text = "shared"
        else:
            text = f"{s.kind}{f'/{s.window}' if s.window else ''} {s.num_kv_heads}x{s.head_dim_k}"
        if text not in seen:
            seen.append(text)
    return ", ".join(seen)


def identity_map(header) -> tuple:
    """A layer map that changes nothing: every layer a copy of itself (a shared layer: an alias of
    its source, KVW-MAP-4/5). A map must not lift the weights check (KVW-XM-6)."""
    from ..format.header import LayerMapEntry

    return tuple(LayerMapEntry(r, s.source_layer, "alias") if s.kind == "shared" else LayerMapEntry(r, r, "copy")
                 for r, s in enumerate(header.arch.layers))


def produce(model_type: str, root: Path, *, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS):
    """Prefill, write the container and its soft variants, continue from the original cache."""
    from ..cache.encoder import iter_buffers
    from ..cache.files import atomic_write, save
    from ..tools.fidelity import astype

    hf, zoo = hf_modules()
    model = zoo.build(model_type, 0)
    ids = prompt_ids(model.config.vocab_size, prompt_tokens)
    row, cache = forward(model, ids)
    first = int(np.argmax(row))
    kvc = hf.from_hf(cache, model, identity=hf.identity(model, zoo.tokenizer(model.config.vocab_size)))
    save(root / f"{model_type}.kvw", kvc)
    # encoded before generation touches the cache; variants differ only in soft attributes
    atomic_write(root / f"{model_type}.rechunk.kvw",
                 iter_buffers(kvc.with_header(chunk_tokens=RECHUNK), codec="zstd", form="stream"))
    save(root / f"{model_type}.bf16.kvw", astype(kvc, "bf16"))  # the receiver casts back
    save(root / f"{model_type}.mapped.kvw", kvc.with_header(layer_map=identity_map(kvc.header)))
    hf_tokens, windows = _hf_layer_tokens(cache), _cache_windows(cache)
    tokens, logits = greedy(model, cache, first, new_tokens)
    h = kvc.header
    describe = f"{h.num_layers} layers ({_describe_layers(h.arch.layers)}), {h.token_count} tokens, {h.dtype}"
    return Produced(model_type, first, tokens, logits, h, describe, hf_tokens, windows,
                    _config_aliases(model.config))


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def _jobs(p: Produced, other: str) -> list:
    """What the receiver does with one model type's files."""
    mt = p.model_type
    return [
        {"id": f"{mt}/roundtrip", "file": f"{mt}.kvw", "model_type": mt, "seed": 0,
         "first_token": p.first_token, "steps": len(p.tokens)},
        {"id": f"{mt}/rechunk", "file": f"{mt}.rechunk.kvw", "model_type": mt, "seed": 0,
         "first_token": p.first_token, "steps": len(p.tokens), "local": {"chunk_tokens": 256}},
        {"id": f"{mt}/cast", "file": f"{mt}.bf16.kvw", "model_type": mt, "seed": 0,
         "local": {"accept_casts": ["bf16"]}},
        {"id": f"{mt}/other_model", "file": f"{mt}.kvw", "model_type": other, "seed": 0},
        {"id": f"{mt}/other_seed", "file": f"{mt}.kvw", "model_type": mt, "seed": OTHER_SEED},
        {"id": f"{mt}/mapped", "file": f"{mt}.mapped.kvw", "model_type": mt, "seed": 0},
        {"id": f"{mt}/other_seed_mapped", "file": f"{mt}.mapped.kvw", "model_type": mt, "seed": OTHER_SEED},
    ]


_JOBS_OF = {"verdict": ("roundtrip",), "soft": ("rechunk", "cast", "mapped"), "sliding": (), "alias": (),
            "other_seed": ("other_seed", "other_seed_mapped")}  # check -> jobs


@dataclass
class SuiteResult:
    model_types: list
    cases: list = field(default_factory=list)
    descriptions: dict = field(default_factory=dict)
    seconds: float = 0.0
    worker_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(c.status in (PASS, SKIP) for c in self.cases)

    def cell(self, model_type: str, check: str):
        return next((c for c in self.cases if c.impl == model_type and c.case == check), None)

    def as_run(self) -> RunResult:
        """The shape ``report.junit_xml`` takes: one testsuite per model type."""
        return RunResult(list(self.model_types), dict(self.descriptions), [], list(self.cases), {}, (LEVEL,),
                         False, self.seconds)


def run_suite(model_types=None, *, workdir=None, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
              timeout: float = 600.0, progress=None) -> SuiteResult:
    """Produce every model type's cache here, receive them all in ONE fresh process, check.

    Raises MissingDependency when torch/transformers are missing.
    """
    hf, zoo = hf_modules()
    every = list(zoo.TINY_CONFIGS)
    model_types = list(model_types or every)
    unknown = [m for m in model_types if m not in every]
    if unknown:
        raise ValueError(f"no tiny model for {unknown}; known: {', '.join(every)}")
    t0 = time.perf_counter()
    result = SuiteResult(model_types)

    def record(mt, check, status, message, seconds=0.0, details=()):
        c = CaseResult(LEVEL, mt, check, status, message, list(details), seconds)
        result.cases.append(c)
        if progress:
            progress(c)

    with contextlib.ExitStack() as stack:
        root = Path(workdir) if workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        produced, jobs = {}, []
        receiver = Receiver(root, model_types)
        stack.callback(receiver.close)
        with quiet_torch():
            for mt in model_types:
                t = time.perf_counter()
                try:
                    produced[mt] = produce(mt, root, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
                except Exception as exc:  # a broken adapter fails its model type, not the suite
                    tb = traceback.format_exc(limit=-6).splitlines()
                    for check in CORE_CHECKS:
                        record(mt, check, ERROR, f"producer: {type(exc).__name__}: {exc}", time.perf_counter() - t, tb)
                    continue
                result.descriptions[mt] = produced[mt].describe
                jobs += _jobs(produced[mt], every[(every.index(mt) + 1) % len(every)])
        if produced:
            (root / "jobs.json").write_text(json.dumps({"jobs": jobs}, indent=1))
            t = time.perf_counter()
            res, failure = receiver.finish(timeout)
            result.worker_seconds = time.perf_counter() - t
            for mt, p in produced.items():
                if failure:
                    for check in CORE_CHECKS:
                        record(mt, check, ERROR, failure)
                    continue
                for check, (status, message) in check_cells(p, res, root).items():
                    jobs_of = [res.get(f"{mt}/{j}", {}) for j in _JOBS_OF.get(check, (check,))]
                    record(mt, check, status, message, sum(j.get("seconds", 0.0) for j in jobs_of),
                           [line for j in jobs_of for line in j.get("traceback", "").splitlines()])
    result.seconds = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------

_MARK = {PASS: "pass", FAIL: "FAIL", ERROR: "ERROR", SKIP: "skip"}


def table(result: SuiteResult) -> list:
    """Console rows: model type x check; "-" where a check does not apply."""
    width = max([len("model type")] + [len(m) for m in result.model_types]) + 2
    rows = ["model type".ljust(width) + "".join(c.ljust(max(len(c), 5) + 2) for c in CHECKS)]
    for mt in result.model_types:
        cells = []
        for check in CHECKS:
            c = result.cell(mt, check)
            cells.append((_MARK[c.status] if c else "-").ljust(max(len(check), 5) + 2))
        rows.append(mt.ljust(width) + "".join(cells))
    return rows


def summary_text(result: SuiteResult) -> str:
    n = {s: sum(c.status == s for c in result.cases) for s in _MARK}
    lines = [f"kvwire cross-model suite: {len(result.model_types)} model types, {len(result.cases)} checks in "
             f"{result.seconds:.1f} s (receiver process {result.worker_seconds:.1f} s)"]
    lines += ["  " + row for row in table(result)]
    lines.append(f"  {n[PASS]} passed, {n[FAIL]} failed, {n[ERROR]} errors")
    lines.append("RESULT: " + ("PASS" if result.ok else "FAIL"))
    return "\n".join(lines)


def markdown(result: SuiteResult) -> str:
    from .report import md_cell

    out = ["# kvwire cross-model conformance report", "",
           f"Model types: {len(result.model_types)}. Checks: {len(result.cases)}. Time: {result.seconds:.1f} s "
           f"(receiver process {result.worker_seconds:.1f} s).", "",
           f"**Result: {'PASS' if result.ok else 'FAIL'}**", "",
           "| model type | cache | " + " | ".join(CHECKS) + " |", "|---|---|" + "---|" * len(CHECKS)]
    for mt in result.model_types:
        cells = [(_MARK[c.status] if c else "-") for c in (result.cell(mt, ch) for ch in CHECKS)]
        out.append(f"| {mt} | {md_cell(result.descriptions.get(mt, ''))} | " + " | ".join(cells) + " |")
    out += ["", "## Details", "", "| model type | check | status | message |", "|---|---|---|---|"]
    out += [f"| {c.impl} | {c.case} | {_MARK[c.status]} | {md_cell(c.message)} |" for c in result.cases]
    return "\n".join(out) + "\n"

