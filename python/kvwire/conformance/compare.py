"""Comparing what an implementation reports with a gold vector's JSON twin.

A reported header (``decoded.json``'s ``header``) is checked field by field against the
twin's (PROTOCOL.md: which fields a decoder MUST report, which it may leave out, which a
reader must ignore for a shared layer), and the reported tensor digests against the
twin's ``tensors``. The runner's reader, writer and round-trip levels judge with these.
"""

from __future__ import annotations

import math

from .neutral import float_from_json

# Fields a decode output MUST report (PROTOCOL.md); the others are compared when present.
CORE_HEADER_FIELDS = ("format_major", "format_minor", "required_features", "optional_features", "dtype",
                      "alignment", "chunk_tokens", "first_position", "token_count", "checksum_algorithm",
                      "layer_tokens", "arch")
# Fields a decode output MUST report when the twin has them: fp8 elements without their
# scales are wrong by a factor (spec KVW-SCALE-7).
CORE_WHEN_PRESENT = ("kv_scales",)
CORE_LAYER_FIELDS = ("kind", "num_kv_heads", "head_dim_k", "head_dim_v", "window", "source_layer")
# Fields a reader must ignore for a shared layer (KVW-ARCH-7): never compared.
SHARED_IGNORED = ("window", "uses_rope", "rope", "kv_lora_rank", "qk_rope_head_dim")
# Optional members of a reported object that the twin omits when they hold their default
# (PROTOCOL.md 2.2): omitted and reported-with-the-default compare equal.
OPTIONAL_DEFAULTS: dict[str, dict[str, object]] = {
    "model": {"framework": "", "framework_version": "", "layer_weights_fingerprints": "", "fingerprint_scheme": 0},
    "rope": {"truncate": True},
}


def _without_defaults(value, kind: str):
    if not isinstance(value, dict):
        return value
    defaults = OPTIONAL_DEFAULTS[kind]
    return {k: v for k, v in value.items() if not (k in defaults and _eq(v, defaults[k]))}


def _same_float(a, b) -> bool:
    """Equal binary64 values (JSON numbers or the non-finite strings); NaN equals NaN, -0 is not 0."""
    try:
        x, y = float_from_json(a), float_from_json(b)
    except (KeyError, TypeError, ValueError):
        return False
    return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))


def _eq(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) or isinstance(b, float) or isinstance(a, str) and a in ("NaN", "Infinity", "-Infinity"):
        return _same_float(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _short(v, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def compare_header(expected: dict, actual, *, ignore=("producer",), require_all: bool = False) -> tuple[list, list]:
    """(errors, notes) comparing a reported header with the expected one.

    A field present in ``actual`` must equal the expected value. A missing core field is
    an error; a missing optional field is a note (or an error with ``require_all``).
    """
    errors: list[str] = []
    notes: list[str] = []
    if not isinstance(actual, dict):
        return [f"header is {type(actual).__name__}, not an object"], notes

    def missing(path: str, core: bool) -> None:
        (errors if core or require_all else notes).append(f"{path}: not reported")

    for key, want in expected.items():
        if key in ignore:
            continue
        core = key in CORE_HEADER_FIELDS or key in CORE_WHEN_PRESENT
        if key not in actual:
            missing(key, core)
            continue
        got = actual[key]
        if key == "arch":
            _compare_arch(want, got, errors, notes, require_all)
        elif key == "model" and _eq(_without_defaults(want, "model"), _without_defaults(got, "model")):
            continue
        elif not _eq(want, got):
            errors.append(f"{key}: expected {_short(want)}, got {_short(got)}")
    return errors, notes


def _compare_arch(want: dict, got, errors: list, notes: list, require_all: bool) -> None:
    if not isinstance(got, dict):
        errors.append("arch: not an object")
        return
    for key in ("schema_version", "keys_post_rope", "rope"):
        if key not in got:
            (errors if require_all else notes).append(f"arch.{key}: not reported")
        elif not _eq(*(_without_defaults(x[key], "rope") if key == "rope" else x[key] for x in (want, got))):
            errors.append(f"arch.{key}: expected {_short(want[key])}, got {_short(got[key])}")
    layers = got.get("layers")
    if not isinstance(layers, list) or len(layers) != len(want["layers"]):
        errors.append(f"arch.layers: expected {len(want['layers'])} layers, got "
                      f"{len(layers) if isinstance(layers, list) else _short(layers)}")
        return
    for i, (w, g) in enumerate(zip(want["layers"], layers)):
        if not isinstance(g, dict):
            errors.append(f"arch.layers[{i}]: not an object")
            continue
        for key, value in w.items():
            if w["kind"] == "shared" and key in SHARED_IGNORED:
                continue
            if key not in g:
                (errors if key in CORE_LAYER_FIELDS or require_all else notes).append(
                    f"arch.layers[{i}].{key}: not reported")
            elif not _eq(*(_without_defaults(x, "rope") if key == "rope" else x for x in (value, g[key]))):
                errors.append(f"arch.layers[{i}].{key}: expected {_short(value)}, got {_short(g[key])}")


def compare_tensors(expected: list, actual: list) -> list[str]:
    """Errors comparing reported tensors ({layer, component, shape, sha256}) with the twin's."""
    errors = []
    want = {(t["layer"], t["component"]): t for t in expected}
    got: dict = {}
    for t in actual:
        key = (t.get("layer"), t.get("component"))
        if key in got:
            errors.append(f"tensor layer {key[0]} {key[1]}: reported twice")
        got[key] = t
    for key in sorted(set(got) - set(want), key=str):
        errors.append(f"tensor layer {key[0]} {key[1]}: not stored by this container")
    for key, t in want.items():
        g = got.get(key)
        name = f"tensor layer {key[0]} {key[1]}"
        if g is None:
            errors.append(f"{name}: missing")
            continue
        if list(g.get("shape", [])) != list(t["shape"]):
            errors.append(f"{name}: shape {g.get('shape')}, expected {t['shape']}")
        elif g.get("sha256") != t["sha256"]:
            errors.append(f"{name}: bytes differ (sha256 {str(g.get('sha256'))[:16]}..., expected "
                          f"{t['sha256'][:16]}...; {g.get('nbytes')} bytes, expected {t['nbytes']})")
    return errors
