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

The receiver is the ``worker`` entry point of this module (``python -m <this module>
worker JOBS RESULTS [MODEL_TYPE...]``): jobs and results are JSON, logits raw
little-endian float32 files; nothing is pickled. Results are ``runner.CaseResult`` s so the JUnit writer of ``report``
applies unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model.compat import check_compatible
from .runner import ERROR, FAIL, PASS, SKIP, CaseResult, RunResult

LEVEL = "crossmodel"
CORE_CHECKS = ("roundtrip", "verdict", "soft", "other_model", "other_seed")  # every model type
CHECKS = CORE_CHECKS + ("sliding", "alias")  # + where the architecture has such layers
PROMPT_TOKENS = 20  # > every tiny sliding window (8): sliding layers keep fewer tokens
NEW_TOKENS = 4
OTHER_SEED = 1
RECHUNK = 3  # chunk_tokens of the rechunked copy: off every other grid, a partial last chunk
INSTALL_HINT = "pip install 'kvwire[hf]' torch  (transformers >= 5, torch >= 2.4)"


class MissingDependency(RuntimeError):
    """torch, transformers or the HF adapter is not importable."""


def _hf():
    """The optional modules the suite needs, imported on first use (the core has no torch)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        from ..adapters import hf
        from ..adapters import zoo
    except ImportError as exc:
        raise MissingDependency(f"the cross-model suite needs torch and transformers ({exc}); {INSTALL_HINT}") \
            from None
    return hf, zoo


# ---------------------------------------------------------------------------------------
# Running a model (shared by producer, receiver and `kvwire demo`)
# ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_torch(threads: int = 1):
    """One intra-op thread (the same kernels in both processes, so logits can match bit
    for bit) and no config or deprecation chatter; thread count and verbosity are restored."""
    import torch
    from transformers import logging as hf_logging

    before, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(before)
        hf_logging.set_verbosity(verbosity)


def prompt_ids(vocab_size: int, n: int, seed: int = 0) -> list:
    """A fixed pseudo-random prompt, ids in [3, vocab) (0-2 are pad/bos/eos in the zoo)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, vocab_size, n)]


def forward(model, ids, cache=None):
    """(logits of the last position as float32 numpy, cache) of one forward pass."""
    import torch

    out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), cache=cache, use_cache=True)
    return out.logits[0, -1].float().numpy().copy(), out.cache


def greedy(model, cache, first_token: int, steps: int):
    """Feed ``first_token`` and continue greedily for ``steps`` forward passes on ``cache``.

    Returns (tokens, logits [steps, vocab] float32): token i is argmax of logits row i.
    The cache is updated in place, as generation does.
    """
    tok, tokens, rows = int(first_token), [], []
    for _ in range(steps):
        row, cache = forward(model, [tok], cache)
        tok = int(np.argmax(row))
        tokens.append(tok)
        rows.append(row)
    return tokens, np.stack(rows) if rows else np.zeros((0, 0), np.float32)


def verdict_json(v) -> dict:
    """A Verdict as JSON: status, conversions and reasons as strings."""
    status = getattr(v, "status", v)
    return {"status": str(status), "ok": bool(v),
            "conversions": [str(c) for c in getattr(v, "conversions", ()) or ()],
            "reasons": [str(r) for r in getattr(v, "reasons", ()) or ()]}


# ---------------------------------------------------------------------------------------
# The receiver (fresh process)
# ---------------------------------------------------------------------------------------

def _receiver_model(models: dict, model_type: str, seed: int):
    """(model, LocalModel) built by the receiver itself from the seed, once per process."""
    if (model_type, seed) not in models:
        hf, zoo = _hf()
        model = zoo.build(model_type, seed)
        models[model_type, seed] = (model, hf.local_model(model, zoo.tokenizer(model.config.vocab_size)))
    return models[model_type, seed]


def _receive(job: dict, models: dict, root: Path) -> dict:
    """One job: verdict from the header; for ``continue`` jobs load, convert, generate."""
    from ..cache.reader import open as kv_open

    hf, _ = _hf()
    model, local = _receiver_model(models, job["model_type"], job["seed"])
    if job.get("local"):  # what this receiver accepts beyond its own model (soft tier)
        opts = dict(job["local"])
        if "accept_casts" in opts:
            opts["accept_casts"] = frozenset(opts["accept_casts"])
        local = dataclasses.replace(local, **opts)
    out: dict = {}
    with kv_open(root / job["file"]) as r:
        out["verdict"] = verdict_json(check_compatible(r.header, local))
        if not job.get("steps"):
            return out
        if not out["verdict"]["ok"]:
            out["error"] = "the receiver refused the cache: " + "; ".join(out["verdict"]["reasons"])
            return out
        cache = r.load()
    tokens, logits = greedy(model, hf.to_hf(cache, model), job["first_token"], job["steps"])
    name = job["id"].replace("/", ".") + ".logits.f32"
    (root / name).write_bytes(logits.astype("<f4").tobytes())
    out.update(tokens=tokens, logits=name, shape=list(logits.shape))
    return out


def worker_main(argv) -> int:
    """``worker JOBS.json RESULTS.json [MODEL_TYPE...]``: run every job, one result (or error) each.

    With model types, the receiver is started before the producer has written anything: it
    imports torch and transformers and builds those models (both seeds) meanwhile, then
    waits for "go" on stdin before it reads JOBS.json. It still shares nothing with the
    producer but the files.
    """
    if len(argv) < 3 or argv[0] != "worker":
        print("usage: python -m kvwire.conformance.crossmodel worker JOBS.json RESULTS.json [MODEL_TYPE...]",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    jobs_path, results_path, prebuild = Path(argv[1]), Path(argv[2]), argv[3:]
    spec = None if prebuild else json.loads(jobs_path.read_text())  # before the slow imports
    try:
        _hf()
    except MissingDependency as exc:
        print(exc, file=sys.stderr)
        return 3
    results, models = {}, {}
    with quiet_torch():
        for mt in prebuild:
            for seed in (0, OTHER_SEED):
                with contextlib.suppress(Exception):  # a failing build fails its jobs, with the reason
                    _receiver_model(models, mt, seed)
        if prebuild and sys.stdin.readline().strip() != "go":
            return 4  # the producer gave up: nothing to receive
        spec = spec or json.loads(jobs_path.read_text())
        for job in spec["jobs"]:
            t = time.perf_counter()
            try:
                res = _receive(job, models, jobs_path.parent)
            except Exception as exc:  # a broken adapter must fail its cell, not the suite
                res = {"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc(limit=-4)}
            res["seconds"] = time.perf_counter() - t
            results[job["id"]] = res
    results_path.write_text(json.dumps({"results": results, "pid": os.getpid(), "seconds": time.perf_counter() - t0}))
    return 0


def _worker_argv() -> list:
    return [sys.executable, "-m", __name__]


def subprocess_env() -> dict:
    """The environment of the receiver: the package importable (vendored copies too)."""
    env = dict(os.environ)
    top = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(top), env.get("PYTHONPATH", "")) if p)
    return env


# ---------------------------------------------------------------------------------------
# The producer (this process)
# ---------------------------------------------------------------------------------------

@dataclass
class Produced:
    """What the producer made of one model type, and what the receiver must reproduce."""

    model_type: str
    first_token: int
    tokens: list
    logits: np.ndarray
    header: object
    describe: str
    hf_tokens: list  # tokens each transformers cache layer held after the prefill (None: no cache)
    windows: list  # sliding window of each transformers cache layer (0: none)
    expected_alias: dict  # receiver layer -> transmitted layer transformers reuses (gemma3n)


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
    from ..tools.fidelity import astype
    from ..cache.encoder import iter_buffers
    from ..cache.files import atomic_write, save

    hf, zoo = _hf()
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
# Checks: pure functions of what producer and receiver reported (no torch needed)
# ---------------------------------------------------------------------------------------

def compare_continuation(p: Produced, got: dict, root: Path) -> tuple[str, str]:
    """Tokens and every logit bit-identical to the producer's continuation."""
    if "error" in got:
        return FAIL, got["error"]
    if got.get("tokens") != p.tokens:
        return FAIL, f"tokens {got.get('tokens')} != {p.tokens} from the original cache"
    data = (root / got["logits"]).read_bytes()
    want = p.logits.astype("<f4")
    if len(data) != want.nbytes:
        return FAIL, f"logits: {len(data)} bytes, expected {want.nbytes}"
    mine = np.frombuffer(data, "<f4").reshape(want.shape)
    differ = mine.view("<u4") != want.view("<u4")
    if differ.any():
        step, col = map(int, np.argwhere(differ)[0])
        return FAIL, (f"logits differ in {int(differ.sum())} of {differ.size} values (first: step {step} "
                      f"token {col}: {mine[step, col]!r} != {want[step, col]!r}, max |diff| "
                      f"{float(np.abs(mine - want).max()):.3g})")
    return PASS, f"{len(p.tokens)} tokens {p.tokens} and {want.size} logits bit-identical"


def check_verdict_exact(got: dict) -> tuple[str, str]:
    v = got.get("verdict")
    if v is None:
        return FAIL, got.get("error", "no verdict")
    if v["status"] != "exact":
        return FAIL, f"own model judged {v['status']}: " + "; ".join(v["reasons"] + v["conversions"])
    return PASS, "exact"


def check_accepted_with(got: dict, conversion: str) -> tuple[str, str]:
    """Accepted, listing a conversion that starts with ``conversion``."""
    v = got.get("verdict")
    if v is None:
        return FAIL, got.get("error", "no verdict")
    if not v["ok"]:
        return FAIL, "rejected: " + "; ".join(v["reasons"])
    if not any(c.startswith(conversion) for c in v["conversions"]):
        return FAIL, f"accepted ({v['status']}) without a {conversion!r} conversion: {v['conversions']}"
    return PASS, f"{v['status']}: " + "; ".join(v["conversions"])


def check_rejected(got: dict, area: str | None = None) -> tuple[str, str]:
    """Rejected with at least one reason (one in ``area`` when given, e.g. "weights")."""
    v = got.get("verdict")
    if v is None:
        return FAIL, got.get("error", "no verdict")
    if v["ok"]:
        return FAIL, f"accepted ({v['status']}) a cache of another model"
    if not v["reasons"]:
        return FAIL, "rejected without a reason"
    if area and not any(r.startswith(area) for r in v["reasons"]):
        return FAIL, f"rejected, but no {area!r} reason: " + "; ".join(v["reasons"])
    return PASS, "rejected: " + "; ".join(v["reasons"])


def check_sliding(p: Produced) -> tuple[str, str] | None:
    """Sliding layers: window from the config, the most recent ``hf`` tokens, fewer than full ones."""
    h = p.header
    if not any(p.windows):
        return None
    if len(p.windows) != h.num_layers:
        return FAIL, f"{h.num_layers} layers in the header, transformers' cache has {len(p.windows)}"
    problems, seen = [], set()
    for i, (spec, tr, w) in enumerate(zip(h.arch.layers, h.layer_tokens, p.windows)):
        kept = p.hf_tokens[i] if i < len(p.hf_tokens) else None
        if not w or spec.kind == "shared":
            if spec.kind != "shared" and tr.count != h.token_count:
                problems.append(f"layer {i} ({spec.kind}) holds {tr.count} of {h.token_count} tokens")
            continue
        if spec.kind != "sliding_attention" or spec.window != w:
            problems.append(f"layer {i}: {spec.kind} window {spec.window}, config says sliding window {w}")
        if kept is not None and tr.count != kept:
            problems.append(f"layer {i}: {tr.count} tokens, transformers kept {kept}")
        if tr.stop != h.token_count or tr.count >= h.token_count:
            problems.append(f"layer {i}: tokens [{tr.start}, {tr.stop}) are not the last ones of {h.token_count}")
        seen.add(tr.count)
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"sliding layers keep {sorted(seen)} of {h.token_count} tokens"


def check_alias(p: Produced) -> tuple[str, str] | None:
    """KV-shared layers map to the layer transformers reuses (gemma3n's ``kv_sharing_modes``).

    Either representation counts, and both must agree when both are present: layer-map
    ``alias`` entries (receiver layer <- transmitted layer) and ``shared`` layer specs
    (``source_layer``). Every shared layer must be covered; nothing else may be aliased.
    """
    if not p.expected_alias:
        return None
    h = p.header
    by_map = {e.receiver_layer: e.transmitted_layer for e in h.layer_map if e.op == "alias"}
    by_kind = {i: s.source_layer for i, s in enumerate(h.arch.layers) if s.kind == "shared"}
    if not by_map and not by_kind:
        return FAIL, f"no alias entries and no shared layers; transformers reuses {p.expected_alias}"
    for name, got in (("layer map alias entries", by_map), ("shared layers' source_layer", by_kind)):
        if got and got != p.expected_alias:
            return FAIL, f"{name} {got}, transformers reuses {p.expected_alias}"
    how = " and ".join(n for n, got in (("layer map alias", by_map), ("shared layers", by_kind)) if got)
    return PASS, f"{how}: " + ", ".join(f"{r}<-{t}" for r, t in sorted(p.expected_alias.items()))


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


def _cells(p: Produced, res: dict, root: Path) -> dict:
    """check -> (status, message) for one model type, from the receiver's results."""
    mt = p.model_type
    got = {k.split("/", 1)[1]: v for k, v in res.items() if k.startswith(mt + "/")}
    missing = {"error": "the receiver reported nothing for this job"}
    rt = compare_continuation(p, got.get("roundtrip", missing), root)
    cells = {"roundtrip": rt, "verdict": check_verdict_exact(got.get("roundtrip", missing))}
    soft = [("rechunk", check_accepted_with(got.get("rechunk", missing), "rechunk")),
            ("rechunk continuation", compare_continuation(p, got.get("rechunk", missing), root)),
            ("bf16", check_accepted_with(got.get("cast", missing), "cast bf16->")),
            ("layer map", check_accepted_with(got.get("mapped", missing), "layer map"))]
    bad = [f"{name}: {msg}" for name, (st, msg) in soft if st != PASS]
    cells["soft"] = (FAIL, "; ".join(bad)) if bad else \
        (PASS, f"chunk_tokens {RECHUNK}/zstd/stream: {soft[0][1][1]}, same continuation; bf16: {soft[2][1][1]}; "
               f"identity layer map: {soft[3][1][1]}")
    cells["other_model"] = check_rejected(got.get("other_model", missing))
    seeds = [("plain", check_rejected(got.get("other_seed", missing), "weights")),
             ("with a layer map", check_rejected(got.get("other_seed_mapped", missing), "weights"))]
    bad = [f"{name}: {msg}" for name, (st, msg) in seeds if st != PASS]
    cells["other_seed"] = (FAIL, "; ".join(bad)) if bad else \
        (PASS, f"{seeds[0][1][1]}; with a layer map: {seeds[1][1][1]}")
    for name, fn in (("sliding", check_sliding), ("alias", check_alias)):
        cell = fn(p)
        if cell is not None:  # both need the continuation to hold as well
            cells[name] = cell if cell[0] != PASS or rt[0] == PASS else (FAIL, f"{cell[1]}, but {rt[1]}")
    return cells


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
    hf, zoo = _hf()
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
                for check, (status, message) in _cells(p, res, root).items():
                    jobs_of = [res.get(f"{mt}/{j}", {}) for j in _JOBS_OF.get(check, (check,))]
                    record(mt, check, status, message, sum(j.get("seconds", 0.0) for j in jobs_of),
                           [line for j in jobs_of for line in j.get("traceback", "").splitlines()])
    result.seconds = time.perf_counter() - t0
    return result


class Receiver:
    """The receiver process. Started with ``prebuild`` model types, it imports and builds
    while the producer works (2 cores: both run at once) and reads the jobs on ``finish``."""

    def __init__(self, root: Path, prebuild=()):
        self.root = root
        self.log = open(root / "receiver.log", "w+b")
        argv = _worker_argv() + ["worker", str(root / "jobs.json"), str(root / "results.json"), *prebuild]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=subprocess_env())

    def finish(self, timeout: float, *, go: bool = True) -> tuple[dict, str]:
        """(results by job id, "" or why the receiver failed as a whole)."""
        with contextlib.suppress(OSError):  # it may have exited already: its status says why
            if go:
                self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return {}, f"receiver process timed out after {timeout:.0f} s"
        self.log.seek(0)
        tail = self.log.read().decode("utf-8", "replace").strip()[-800:]
        self.log.close()
        if rc != 0:
            return {}, f"receiver process exited {rc}: {tail}"
        try:
            return json.loads((self.root / "results.json").read_text())["results"], ""
        except (OSError, ValueError, KeyError) as exc:
            return {}, f"receiver process wrote no readable results: {exc}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.log.close()


def _run_worker(root: Path, timeout: float) -> tuple[dict, str]:
    """Receive the jobs already in ``root`` in a new process."""
    return Receiver(root).finish(timeout, go=False)


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


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
