"""The checks of one case at each level (conformance/README.md): reader, writer, round trip.

Each function judges one vector or one matrix cell, given the implementation(s) to call
and a work folder, and returns the verdict; none keeps state or runs anything in
parallel. ``runner.Runner`` decides which cases run, in what order and on how many
threads, and assembles the matrix from these verdicts.

* reader: ``check_valid`` (a valid vector decodes to its twin, ``validate`` accepts it)
  and ``check_invalid`` (``validate`` and ``decode`` reject it with an allowed code);
* writer and round trip: ``prepare_spec`` writes a writer case's ``spec.json``,
  ``encode_case`` has a producer encode it, ``check_cell`` has a consumer decode the
  output and compares it with the case (``check_output``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cache.files import open as kv_open
from . import digests as D
from . import neutral as N
from .compare import compare_header, compare_tensors
from .drivers import Call
from .results import ERROR, FAIL, PASS, SKIP, WARN, CaseResult, worst
from .vectors import Vector, WriterCase

# ---------------------------------------------------------------------------------------
# Reader level
# ---------------------------------------------------------------------------------------

def check_valid(impl, v: Vector, work: Path) -> CaseResult:
    res = CaseResult("reader", impl.label, v.id, PASS)
    if v.integrity:
        return CaseResult("reader", impl.label, v.id, ERROR, "vector integrity: " + "; ".join(v.integrity))
    if v.entry.get("input") == "segments":
        dec = impl.reassemble(v.path, work)
        val = Call("ok")
    else:
        dec = impl.decode(v.path, work)
        val = impl.validate(v.path, work)
    res.seconds = dec.seconds + val.seconds
    problems: list[str] = []
    notes: list[str] = []
    if dec.status == "unsupported" or val.status == "unsupported":
        return CaseResult("reader", impl.label, v.id, SKIP, "command not supported: " + (dec.detail or val.detail))
    if dec.status != "ok":
        res.status = ERROR if dec.status in ("error", "timeout") else FAIL
        problems.append(f"decode: {dec.describe()} (valid vector)")
    else:
        assert dec.result is not None and v.twin is not None  # an "ok" decode's result; a valid vector's twin
        errs, notes = compare_header(v.twin["header"], dec.result.get("header"), ignore=())
        errs += compare_tensors(v.twin["tensors"], dec.result.get("tensors") or [])
        if errs:
            res.status = FAIL
            problems += ["decode: " + e for e in errs]
    if val.status != "ok":
        res.status = worst(res.status, ERROR if val.status in ("error", "timeout") else FAIL)
        problems.append(f"validate: {val.describe()} (valid vector)")
    res.message = problems[0] if problems else "decoded header and tensors match the twin; validate accepts"
    res.details = problems + [f"note: {n}" for n in notes]
    return res


def judge_rejection(v: Vector, call: Call, what: str, *, lenient_codes: bool) -> tuple[str, str]:
    """(status, message) of one command's answer to an invalid vector; a rejection with
    another registry code than allowed is a failure, or a warning with ``lenient_codes``."""
    allowed = v.allowed_codes()
    if call.status == "unsupported":
        return SKIP, f"{what} not supported"
    if call.status == "ok":
        return FAIL, f"{what}: accepted an invalid vector (expected {v.entry.get('expected_code')})"
    if call.status in ("error", "timeout"):
        return ERROR, f"{what}: {call.describe()}"
    if allowed is None or call.code in allowed:
        return PASS, f"{what}: {call.describe()}"
    status = WARN if lenient_codes else FAIL
    return status, (f"{what}: rejected, wrong code: {call.code}, expected {v.entry['expected_code']}"
                    + (f" (or {', '.join(sorted(allowed - {v.entry['expected_code']}))})"
                       if len(allowed) > 1 else ""))


def check_invalid(impl, v: Vector, work: Path, *, lenient_codes: bool) -> CaseResult:
    if v.integrity:
        return CaseResult("reader", impl.label, v.id, ERROR, "vector integrity: " + "; ".join(v.integrity))
    if v.entry.get("input") == "segments":
        dec = impl.reassemble(v.path, work)
        s1, m1 = s2, m2 = judge_rejection(v, dec, "reassemble", lenient_codes=lenient_codes)
        val = Call("skipped")
    else:
        val = impl.validate(v.path, work)
        dec = impl.decode(v.path, work)
        s1, m1 = judge_rejection(v, val, "validate", lenient_codes=lenient_codes)
        s2, m2 = judge_rejection(v, dec, "decode", lenient_codes=lenient_codes)
    status = worst(s1, s2)
    if {s1, s2} == {SKIP}:
        status = SKIP
    elif SKIP in (s1, s2):
        status = worst(*(s for s in (s1, s2) if s != SKIP))
    msgs = [m for s, m in ((s1, m1), (s2, m2)) if s != PASS] or [m1]
    details = list(dict.fromkeys([m1, m2]))
    exp_rule = v.entry.get("rule")
    for c in (val, dec):
        if c.status == "rejected" and c.rule and exp_rule and c.rule != exp_rule:
            details.append(f"note: reported rule {c.rule}, vector violates {exp_rule}")
    return CaseResult("reader", impl.label, v.id, status, msgs[0], details, val.seconds + dec.seconds)


# ---------------------------------------------------------------------------------------
# Writer and round-trip levels
# ---------------------------------------------------------------------------------------

def prepare_spec(case: WriterCase, d: Path) -> Path:
    """spec.json + raw tensors of a writer case, decoded from its vector by the reference."""
    d.mkdir(parents=True, exist_ok=True)
    with kv_open(str(case.vector.path)) as r:
        r.validate()
        cache = r.load()
    assert case.vector.twin is not None  # a writer case is a valid vector, with its twin
    tensors = []
    for i, comp, x in D.cache_tensors(cache):
        name = D.tensor_file_name(i, comp)
        (d / name).write_bytes(D.canonical_bytes(x))
        tensors.append({"layer": i, "component": comp, "shape": list(x.shape), "file": name})
    spec = {"format": N.ENCODE_SPEC_FORMAT, "version": N.MODEL_JSON_VERSION, "form": case.form,
            "codec": case.codec, "header": case.vector.twin["header"], "tensors": tensors}
    path = d / "spec.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


def check_output(consumer, case: WriterCase, produced: Path, work: Path) -> tuple[str, str, list]:
    dec = consumer.decode(produced, work)
    if dec.status == "unsupported":
        return SKIP, "decode not supported", []
    if dec.status != "ok":
        return (ERROR if dec.status in ("error", "timeout") else FAIL), f"decode: {dec.describe()}", []
    assert case.vector.twin is not None  # a writer case is a valid vector, with its twin
    errs, notes = compare_header(case.vector.twin["header"], dec.result.get("header"))
    errs += compare_tensors(case.vector.twin["tensors"], dec.result.get("tensors") or [])
    if dec.result.get("form") not in (None, case.form):
        errs.append(f"form: {dec.result.get('form')}, {case.form} was requested")
    if errs:
        return FAIL, errs[0], errs + [f"note: {n}" for n in notes]
    return PASS, "decoded header and tensors match the case", [f"note: {n}" for n in notes]


def encode_case(prod, spec: Path, d: Path):
    """The path of ``prod``'s encoding of ``spec`` in ``d``, or (status, message) when it has none."""
    d.mkdir(parents=True, exist_ok=True)
    out = d / "out.kvw"
    if not prod.supports("encode"):
        return SKIP, "encode not supported"
    try:
        call = prod.encode(spec, out, d)
    except Exception as exc:  # the in-process reference writer failing: a bug of the kit
        call = Call("error", detail=f"{type(exc).__name__}: {exc}")
    if call.status == "ok":
        return out if out.is_file() else (FAIL, "encode: exit 0 but no output file")
    if call.status == "unsupported":
        return SKIP, "encode not supported"
    return (ERROR if call.status in ("error", "timeout") else FAIL), f"encode: {call.describe()}"


def check_cell(prod, cons, case: WriterCase, produced, d: Path, *, reference) -> CaseResult:
    """One matrix cell: ``cons`` decodes ``prod``'s output (``encode_case``'s answer). The
    cell (impl -> ``reference``) is the writer level; every other one is the round trip."""
    writer = cons is reference and prod is not reference
    level = "writer" if writer else "roundtrip"
    name = case.id if writer else f"{case.id} [{prod.label} -> {cons.label}]"
    res = CaseResult(level, prod.label if writer else cons.label, name, PASS, producer=prod.label,
                     consumer=cons.label)
    if produced is None or isinstance(produced, tuple):
        status, msg = produced or (ERROR, "no output")
        if writer:
            res.status, res.message = status, msg
        else:  # counted once, at the producer's writer level
            res.status, res.message = SKIP, f"producer {prod.label} has no output ({msg})"
        return res
    d.mkdir(parents=True, exist_ok=True)
    try:
        res.status, res.message, res.details = check_output(cons, case, produced, d)
    except Exception as exc:  # a consumer's decode output the kit cannot read
        res.status, res.message = ERROR, f"{type(exc).__name__}: {exc}"
    if writer and res.status == FAIL and res.message.startswith("decode: rejected"):
        res.message = "the reference reader " + res.message[len("decode: "):] + " (KVW-WRITE-1)"
    return res
