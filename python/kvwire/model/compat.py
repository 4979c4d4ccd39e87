"""The two-tier compatibility check (spec/crossmodel.md, KVW-XM-*).

``check_compatible(header, local)`` decides from a header alone whether the receiver
described by ``local`` can use the cache: *exact* (use as is), *convertible* (use after
the listed conversions) or *incompatible* (with every reason, not just the first, so an
operator sees the whole picture at once). Reasons and conversions are strings that start
with a stable area word ("tokenizer:", "weights:", "layer 3:", "positions:", "scales:",
"cast ", "recompute ", "rescale ", "foreign layers") followed by free text. The "dtype:",
"scales:" and missing-fingerprint reasons say how to get past them (the option to pass, and
what it gives up). ``Verdict.notes`` say what changes no status ("lossy: ...").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..format import registry as R
from ..format.header import Architecture, Header, LayerSpec, ModelIdentity, RopeParams
from ..format.kv_scales import FP8_DTYPES, NEUTRAL
from ..format.layermap import resolve
from .identity import FINGERPRINT_SCHEME, compat_fingerprint
from .rescale import check_scales

EXACT, CONVERTIBLE, INCOMPATIBLE = "exact", "convertible", "incompatible"
# identity parts whose fingerprint a receiver may let be absent on one side (LocalModel.allow_missing)
FINGERPRINT_PARTS = ("tokenizer", "model")
_GIVES_UP = {"tokenizer": "the tokenizer check only",
             "model": "the model check (weights, config, compat) only; the tokenizer is still compared"}

@dataclass(frozen=True)
class LocalModel:
    """What the receiver is: its architecture, compute dtype and identity, plus what it can convert.

    ``head_range`` = (start, stop): the receiver holds KV heads [start, stop) of every
    attention layer (a tensor-parallel shard). ``first_position``: the model position the
    receiver will give cache token 0 (None: whatever the container says).
    ``accept_foreign_weights``: a cache with a layer map whose mapped layers were computed by
    other weights (another model, a fine-tune) is used anyway, listed as a "foreign layers"
    conversion instead of a reason; off by default, as such layers are not the receiver's own KV.
    ``kv_scales``: an fp8 receiver's own per-layer scales, one ``KVScale`` or ``(k_scale,
    v_scale)`` pair per layer of ``arch`` (all (1.0, 1.0) for an engine that keeps none),
    checked like ``Header.kv_scales`` (KVW-SCALE-2..5); None states none, and a scaled cache is
    then refused (KVW-XM-10). ``accept_rescale``: layers whose scales differ from the
    cache's are requantized on load ("rescale layers", ``kvwire.model.rescale.rescale_cache``)
    rather than refused. ``allow_missing``: identity parts ("tokenizer", "model") whose
    fingerprint may be absent on one side (KVW-XM-3, KVW-XM-4); absent on both sides is never
    a reason. ``require_fingerprints=False`` allows both parts to be missing.
    """

    arch: Architecture
    dtype: str
    identity: ModelIdentity = field(default_factory=ModelIdentity)
    chunk_tokens: int | None = None
    accept_casts: frozenset[str] = frozenset()
    head_range: tuple[int, int] | None = None
    layout: str | None = None
    first_position: int | None = None
    allow_recompute: bool = True
    accept_layer_map: bool = True
    require_fingerprints: bool = True  # False: allow_missing=FINGERPRINT_PARTS (KVW-XM-3, KVW-XM-4)
    allow_missing: frozenset[str] = frozenset()  # parts whose fingerprint may be absent on one side
    accept_foreign_weights: bool = False  # under a layer map, use layers other weights computed (KVW-XM-6)
    kv_scales: tuple | None = None  # 1.1: the receiver's per-layer fp8 scales (KVW-XM-10)
    accept_rescale: bool = True  # requantize layers whose scales differ (KVW-SCALE-7)

    def __post_init__(self):
        allow = self.allow_missing
        if isinstance(allow, str) or not all(isinstance(p, str) for p in allow):
            raise TypeError(f"LocalModel allow_missing must be a set of part names "
                            f"({', '.join(FINGERPRINT_PARTS)}), not {allow!r}")
        unknown = sorted(set(allow) - set(FINGERPRINT_PARTS))
        if unknown:
            raise ValueError(f"LocalModel allow_missing: unknown part(s) {', '.join(map(repr, unknown))}; "
                             f"the parts are {', '.join(map(repr, FINGERPRINT_PARTS))}")
        object.__setattr__(self, "allow_missing", frozenset(allow))
        if self.kv_scales is not None:
            if not isinstance(self.arch, Architecture):
                raise TypeError(f"LocalModel arch must be a kvwire.Architecture, not {type(self.arch).__name__}")
            object.__setattr__(self, "kv_scales", check_scales(self.arch, self.dtype, self.kv_scales,
                                                               "LocalModel kv_scales"))


@dataclass(frozen=True)
class Verdict:
    """``status`` exact / convertible / incompatible; ``conversions`` to apply on load; ``reasons``
    for a refusal; ``notes``: facts that change no status, e.g. "lossy: ..." when the cache's
    values went through a lossy codec (decoded they are close to, not equal to, the sender's)."""

    status: str
    conversions: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.status != INCOMPATIBLE


def effective_rope(arch: Architecture, layer: int) -> RopeParams | None | str:
    """RoPE in effect for a layer (KVW-ARCH-8): params, None (no rotation) or "unknown"."""
    s = arch.layers[layer]
    if s.kind == "shared":
        s = arch.layers[s.source_layer]
    if not s.uses_rope:
        return None
    return s.rope or arch.rope or "unknown"


_SHAPE_FIELDS = [f.name for f in fields(LayerSpec) if f.name != "rope"]


def _resolve(arch: Architecture, layer: int) -> tuple[int, LayerSpec]:
    s = arch.layers[layer]
    return (s.source_layer, arch.layers[s.source_layer]) if s.kind == "shared" else (layer, s)


def _layer_diffs(sent: Architecture, i: int, mine: Architecture, r: int) -> list[str]:
    """Differences between the sender's layer i and the receiver's layer r that no conversion bridges."""
    a, b = sent.layers[i], mine.layers[r]
    out = [f"{name} {getattr(a, name)!r} != {getattr(b, name)!r}" for name in _SHAPE_FIELDS
           if getattr(a, name) != getattr(b, name)]
    ra, rb = effective_rope(sent, i), effective_rope(mine, r)
    if ra != rb:
        out.append("rope parameters differ" if "unknown" not in (ra, rb) else "rope parameters unknown on one side")
    return out


def _needed_tokens(spec: LayerSpec, token_count: int, first_position: int) -> tuple[int, int]:
    """Cache tokens a layer must hold so the receiver can continue after the last one (KVW-XM-8)."""
    if spec.kind == "sliding_attention":
        return max(0, token_count - (spec.window - 1)), token_count
    if spec.kind == "chunked_attention":
        chunk_start = (first_position + token_count) // spec.window * spec.window - first_position
        return max(0, chunk_start), token_count
    if spec.kind in ("shared",):
        return 0, 0
    return 0, token_count


def _identity(h: Header, local: LocalModel, mapped: bool, reasons: list, conversions: list) -> None:
    """Hard tier (KVW-XM-3, KVW-XM-4, KVW-XM-6): fingerprints, compared before any body is read."""
    m, lm = h.model, local.identity
    for who, ident in (("sender", m), ("receiver", lm)):
        if ident.fingerprint_scheme not in (0, FINGERPRINT_SCHEME) and ident.compat_fingerprint:
            reasons.append(f"identity: {who} fingerprint scheme {ident.fingerprint_scheme} is not known")
            return

    def compare(what: str, a: bytes, b: bytes, part: str = "model") -> bool | None:
        if a and b:
            if a != b:
                reasons.append(f"{what}: fingerprints differ")
            return a == b
        if a or b:  # absent on both sides: nothing to compare, no mismatch (KVW-XM-3, KVW-XM-4)
            _missing(what, "receiver" if a else "sender", part, local, reasons)
        return None

    compare("tokenizer", m.tokenizer_fingerprint, lm.tokenizer_fingerprint, "tokenizer")
    if m.compat_fingerprint and m.compat_fingerprint == lm.compat_fingerprint:
        return
    # differing weights or config: reasons, or under a layer map "foreign layers" if the receiver opts in
    foreign: list[str] = []
    if mapped and _mapped_layer_weights(h, local, foreign):
        pass
    elif not (m.compat_fingerprint and lm.compat_fingerprint):
        if m.compat_fingerprint or lm.compat_fingerprint:  # both absent: neither side states a model
            _missing("compat", "sender" if not m.compat_fingerprint else "receiver", "model", local, reasons)
        return
    else:
        if m.config_fingerprint and lm.config_fingerprint and m.config_fingerprint != lm.config_fingerprint:
            foreign.append("config: fingerprints differ")
        if m.weights_fingerprint and lm.weights_fingerprint and m.weights_fingerprint != lm.weights_fingerprint:
            if mapped:  # per-layer chains were missing: the whole models are compared
                foreign.append("weights: fingerprints differ")
            else:
                _weights(h, local, reasons, conversions)
        elif bool(m.weights_fingerprint) != bool(lm.weights_fingerprint):
            compare("weights", m.weights_fingerprint, lm.weights_fingerprint)
        else:  # same (or on both sides no) weights: if the sender's own parts do not give its compat
            expect = compat_fingerprint(h.arch, local.dtype, tokenizer=m.tokenizer_fingerprint,
                                        weights=m.weights_fingerprint, config=m.config_fingerprint)
            if expect != m.compat_fingerprint:  # model computes keys and values in another dtype
                reasons.append(f"compat: the sender's fingerprint is not that of its architecture computed in "
                               f"{local.dtype}: its model computes keys and values in another dtype")
    if foreign and mapped and local.accept_foreign_weights:
        conversions.append("foreign layers: " + "; ".join(foreign))
    else:
        reasons.extend(foreign)


def _missing(what: str, side: str, part: str, local: LocalModel, reasons: list) -> None:
    """A fingerprint present on one side only: a reason saying how to get past it and what that
    gives up, unless the receiver lets that part be absent (KVW-XM-3, KVW-XM-4)."""
    if not local.require_fingerprints or part in local.allow_missing:
        return
    fix = ("pass the same tokenizer on both sides (kvwire.adapters.hf.identity(model, tokenizer), "
           "hf.local_model(model, tokenizer)), or " if part == "tokenizer" else "")
    reasons.append(f"{what}: fingerprint missing on the {side} side: {fix}pass "
                   f"LocalModel(allow_missing={{{part!r}}}) to accept it, which gives up {_GIVES_UP[part]} "
                   "(require_fingerprints=False gives up both the tokenizer and the model checks)")


def _mapped_pairs(h: Header, mine: Architecture) -> list[tuple[int, int, int, int]]:
    """(receiver layer, transmitted layer, resolved transmitted, resolved receiver) per copy/alias entry."""
    return [(r, t, _resolve(h.arch, t)[0], _resolve(mine, r)[0])
            for r, (op, t) in enumerate(resolve(h.layer_map, mine.num_layers, [])) if op in ("copy", "alias")]


def _mapped_layer_weights(h: Header, local: LocalModel, foreign: list) -> bool:
    """Layer map with per-layer chains on both sides (KVW-XM-6): each copy/alias entry reuses the
    transmitted layer's KV only if the sender's cumulative fingerprint of that layer equals the
    receiver's of the layer it fills (both resolved to their source when shared). False: no chains."""
    a, b = h.model.layer_weights_fingerprints, local.identity.layer_weights_fingerprints
    if not (a and b and len(a) == 32 * h.num_layers and len(b) == 32 * local.arch.num_layers):
        return False
    m, lm = h.model, local.identity
    if m.config_fingerprint and lm.config_fingerprint and m.config_fingerprint != lm.config_fingerprint:
        foreign.append("config: fingerprints differ")
    differ = [f"{r}<-{t}" for r, t, ts, rs in _mapped_pairs(h, local.arch)
              if a[32 * ts:32 * ts + 32] != b[32 * rs:32 * rs + 32]]
    if differ:
        foreign.append(f"weights: mapped layers computed by other weights (receiver<-transmitted {', '.join(differ)})")
    return True


def _weights(h: Header, local: LocalModel, reasons: list, conversions: list) -> None:
    """Whole-model weights differ: per-layer chains tell which layers stay reusable (KVW-XM-5)."""
    a, b = h.model.layer_weights_fingerprints, local.identity.layer_weights_fingerprints
    n = h.num_layers
    if not (len(a) == len(b) == 32 * n and n == local.arch.num_layers):
        reasons.append("weights: fingerprints differ")
        return
    first = next(i for i in range(n + 1) if i == n or a[32 * i:32 * i + 32] != b[32 * i:32 * i + 32])
    if first == n:  # all layers agree: only tensors no cache depends on differ (e.g. the LM head)
        conversions.append("reuse all layers (weights differ only outside the cached layers)")
        return
    if first == 0 or not local.allow_recompute:
        reasons.append(f"weights: differ from layer {first} on (layers {first}..{n - 1} not reusable)")
        return
    conversions.append(f"recompute layers {first}..{n - 1}")


def _structure(h: Header, local: LocalModel, reasons: list, conversions: list) -> None:
    """Layer structure: same layers one to one, or through the header's layer map (KVW-XM-6)."""
    sent, mine = h.arch, local.arch
    if h.layer_map:
        if not local.accept_layer_map:
            reasons.append("layer map: the receiver does not apply layer maps")
            return
        plan = resolve(h.layer_map, mine.num_layers, reasons)
        ops: dict[str, int] = {}
        for r, (op, t) in enumerate(plan):
            ops[op] = ops.get(op, 0) + 1
            if op in ("copy", "alias"):
                for d in _layer_diffs(sent, _resolve(sent, t)[0], mine, _resolve(mine, r)[0]):
                    reasons.append(f"layer {r}: from transmitted layer {t}: {d}")
        if plan:
            conversions.append("layer map: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
        return
    if sent.num_layers != mine.num_layers:
        reasons.append(f"arch: {sent.num_layers} layers, receiver has {mine.num_layers}")
        return
    if sent.keys_post_rope != mine.keys_post_rope:
        reasons.append(f"arch: keys_post_rope {sent.keys_post_rope} != {mine.keys_post_rope}")
    for i in range(sent.num_layers):
        for d in _layer_diffs(sent, i, mine, i):
            reasons.append(f"layer {i}: {d}")


def _layer_list(layers) -> str:
    """Layer numbers as runs: ``0..2, 5``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _scales(h: Header, local: LocalModel, reasons: list, conversions: list) -> None:
    """fp8 scales (KVW-XM-10): with the same dtype, every receiver layer whose scales differ
    from those of the cache layer it takes (bit for bit; 1.0 where absent) is rescaled, or a
    reason. Other dtypes are the cast's business (``_soft``)."""
    S, Rs = h.kv_scales, local.kv_scales
    if h.dtype != local.dtype or h.dtype not in FP8_DTYPES or (S is None and Rs is None):
        return
    if S is not None and len(S) != h.num_layers:
        reasons.append(f"scales: the header has {len(S)} kv_scales for {h.num_layers} layers (KVW-SCALE-2)")
        return
    if Rs is None:
        reasons.append(f"scales: the cache's {h.dtype} elements carry per-layer scales (kv_scales) and the "
                       "receiver states none: pass LocalModel(kv_scales=...) with its own (all (1.0, 1.0) if it "
                       "keeps none) to load them rescaled, or a float dtype with "
                       f"accept_casts=frozenset({{{h.dtype!r}}}) to load their values (KVCache.dequantize)")
        return
    if h.layer_map:
        # receiver layer r (resolved: rs holds its cache) takes transmitted layer t's values (resolved: ts)
        pairs = [(rs, ts) for _, _, ts, rs in _mapped_pairs(h, local.arch)]
    elif h.num_layers == local.arch.num_layers:
        pairs = [(i, i) for i in range(h.num_layers)]
    else:
        return  # a structure reason already
    differ = sorted({r for r, t in pairs if (NEUTRAL if S is None else S[t]) != Rs[r]})
    if not differ:
        return
    if local.accept_rescale:
        conversions.append(f"rescale layers {_layer_list(differ)}")
    else:
        reasons.append(f"scales: layers {_layer_list(differ)} have other scales than the receiver's and it accepts "
                       "no requantization: pass accept_rescale=True (kvwire.model.rescale.rescale_cache)")


def _soft(h: Header, local: LocalModel, reasons: list, conversions: list) -> None:
    """Soft tier (KVW-XM-7, KVW-XM-10): what the receiver converts on load."""
    if h.dtype != local.dtype:
        values = " (of the values: elements times kv_scales, KVCache.dequantize)" if h.kv_scales is not None else ""
        if h.dtype in local.accept_casts:
            conversions.append(f"cast {h.dtype}->{local.dtype}{values}")
        else:
            reasons.append(f"dtype: cache is {h.dtype}, receiver uses {local.dtype} and accepts no cast from it: "
                           f"pass accept_casts=frozenset({{{h.dtype!r}}}) to cast{values}")
    _scales(h, local, reasons, conversions)
    if local.chunk_tokens is not None and local.chunk_tokens != h.chunk_tokens:
        conversions.append(f"rechunk {h.chunk_tokens}->{local.chunk_tokens}")
    if local.head_range is not None:
        a, b = local.head_range
        heads = {s.num_kv_heads for s in h.arch.layers if s.kind not in ("shared", "mla_latent", "state")}
        if not (0 <= a < b) or any(b > n for n in heads):
            reasons.append(f"heads: receiver shard [{a}, {b}) outside the sent layers' {sorted(heads)} heads")
        elif heads and (heads != {b - a} or a):
            conversions.append(f"select heads {a}..{b - 1}")
    if local.layout and h.engine_layout is not None and h.engine_layout.name and h.engine_layout.name != local.layout:
        conversions.append(f"permute layout {h.engine_layout.name}->{local.layout}")
    pos = h.first_position if local.first_position is None else local.first_position
    for i, (s, r) in enumerate(zip(h.arch.layers, h.layer_tokens)):
        lo, hi = _needed_tokens(s, h.token_count, pos)
        if lo < hi and not (r.start <= lo and hi <= r.stop):
            reasons.append(f"layer {i}: holds tokens [{r.start}, {r.stop}), the receiver needs [{lo}, {hi})")
    if pos != h.first_position:
        _shift(h, pos, reasons, conversions)


def _shift(h: Header, position: int, reasons: list, conversions: list) -> None:
    """Moving a cache re-rotates its keys: a conversion exactly when ``rope.shift`` performs it (KVW-XM-9)."""
    from .rope import shift_problems

    problems = shift_problems(h, position)
    reasons.extend(f"positions: {r}" if i is None else f"layer {i}: {r}" for i, r in problems)
    if not problems:
        conversions.append(f"shift positions by {position - h.first_position:+d}")


def check_compatible(header: Header, local: LocalModel) -> Verdict:
    """Can ``local`` use the cache ``header`` describes? Decided from the header alone (KVW-XM-2)."""
    if not isinstance(header, Header):
        raise TypeError(f"check_compatible(header, local): header must be a kvwire.Header (Reader.header, "
                        f"kvwire.probe(first_bytes)), not {type(header).__name__}")
    if not isinstance(local, LocalModel):
        raise TypeError(f"check_compatible(header, local): local must be a kvwire.LocalModel, "
                        f"not {type(local).__name__}")
    if local.dtype not in R.DTYPES:
        raise ValueError(f"unknown dtype {local.dtype!r}; one of {', '.join(sorted(R.DTYPES))}")
    reasons: list[str] = []
    conversions: list[str] = []
    mapped = bool(header.layer_map)
    _identity(header, local, mapped, reasons, conversions)
    _structure(header, local, reasons, conversions)
    _soft(header, local, reasons, conversions)
    status = INCOMPATIBLE if reasons else CONVERTIBLE if conversions else EXACT
    return Verdict(status, tuple(conversions), tuple(reasons), _lossy_notes(header))


def _lossy_notes(h: Header) -> tuple[str, ...]:
    """"lossy: ..." when the header lists a lossy codec spec (spec/codecs.md): the decoded values
    approximate the sender's; no status changes, as the receiver loads them as they are."""
    lossy = [s for s in h.codec_specs if s.lossy]
    if not lossy:
        return ()
    names = ", ".join(dict.fromkeys(s.codec + (f" {s.bits}-bit" if s.codec == "int_affine" else "") for s in lossy))
    return (f"lossy: the cache was compressed with a lossy codec ({names}): its decoded keys and values "
            "approximate the sender's, not bit for bit",)
