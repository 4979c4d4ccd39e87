"""The checks of the cross-model suite: pure functions of what the producer made and the
receiver reported (no torch needed), so they are also tested on fabricated results.

``check_cells`` turns one model type's receiver results into (status, message) per check of
``CHECKS``; ``Produced`` is what the producer made of a model type and the receiver must
reproduce. The suite itself (``crossmodel``) produces, runs the receiver and records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..format.header import Header
from .results import FAIL, PASS

CORE_CHECKS = ("roundtrip", "verdict", "soft", "other_model", "other_seed")  # every model type
CHECKS = CORE_CHECKS + ("sliding", "alias")  # + where the architecture has such layers
RECHUNK = 3  # chunk_tokens of the rechunked copy: off every other grid, a partial last chunk


@dataclass
class Produced:
    """What the producer made of one model type, and what the receiver must reproduce."""

    model_type: str
    first_token: int
    tokens: list
    logits: np.ndarray
    header: Header
    describe: str
    hf_tokens: list  # tokens each transformers cache layer held after the prefill (None: no cache)
    windows: list  # sliding window of each transformers cache layer (0: none)
    expected_alias: dict  # receiver layer -> transmitted layer transformers reuses (gemma3n)


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


def check_cells(p: Produced, res: dict, root: Path) -> dict:
    """check -> (status, message) for one model type, from the receiver's results (keyed
    "<model type>/<job>", the jobs of ``crossmodel``'s job list)."""
    mt = p.model_type
    got = {k.split("/", 1)[1]: v for k, v in res.items() if k.startswith(mt + "/")}
    missing = {"error": "the receiver reported nothing for this job"}
    rt = compare_continuation(p, got.get("roundtrip", missing), root)
    out = {"roundtrip": rt, "verdict": check_verdict_exact(got.get("roundtrip", missing))}
    soft = [("rechunk", check_accepted_with(got.get("rechunk", missing), "rechunk")),
            ("rechunk continuation", compare_continuation(p, got.get("rechunk", missing), root)),
            ("bf16", check_accepted_with(got.get("cast", missing), "cast bf16->")),
            ("layer map", check_accepted_with(got.get("mapped", missing), "layer map"))]
    bad = [f"{name}: {msg}" for name, (st, msg) in soft if st != PASS]
    out["soft"] = (FAIL, "; ".join(bad)) if bad else \
        (PASS, f"chunk_tokens {RECHUNK}/zstd/stream: {soft[0][1][1]}, same continuation; bf16: {soft[2][1][1]}; "
               f"identity layer map: {soft[3][1][1]}")
    out["other_model"] = check_rejected(got.get("other_model", missing))
    seeds = [("plain", check_rejected(got.get("other_seed", missing), "weights")),
             ("with a layer map", check_rejected(got.get("other_seed_mapped", missing), "weights"))]
    bad = [f"{name}: {msg}" for name, (st, msg) in seeds if st != PASS]
    out["other_seed"] = (FAIL, "; ".join(bad)) if bad else \
        (PASS, f"{seeds[0][1][1]}; with a layer map: {seeds[1][1][1]}")
    for name, fn in (("sliding", check_sliding), ("alias", check_alias)):
        cell = fn(p)
        if cell is not None:  # both need the continuation to hold as well
            out[name] = cell if cell[0] != PASS or rt[0] == PASS else (FAIL, f"{cell[1]}, but {rt[1]}")
    return out
