"""Issue 16 item 1: compatibility without a tokenizer (spec/crossmodel.md KVW-XM-3, KVW-XM-4).

A fingerprint absent on both sides is nothing to compare, not a mismatch; present on one side
only it stays a refusal, whose reason says what to pass to get past it and what that gives up.
Also the verdict's "lossy:" note. Real tiny transformers models, real
subprocesses for the "saved, checked in a fresh process" journey.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire import LocalModel
from kvwire.model.compat import FINGERPRINT_PARTS
from kvwire.model.identity import make_identity

ARCH = kvwire.Architecture.uniform(2, 2, 8, rope=kvwire.RopeParams())
TOK, W, CFG = b"t" * 32, b"w" * 32, b"c" * 32


def ident(*, tok=TOK, weights=W, config=CFG, dtype="bf16"):
    return make_identity(ARCH, dtype, tokenizer=tok, weights=weights, config=config)


def header(model) -> kvwire.Header:
    return kvwire.Header(ARCH, token_count=6, dtype="bf16", chunk_tokens=4, model=model)


def check(sender, receiver, **kw) -> kvwire.Verdict:
    return kvwire.check_compatible(header(sender), LocalModel(ARCH, "bf16", receiver, **kw))


# -- the issue's journey, in fresh processes ------------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import sys, torch, kvwire
    from kvwire.adapters import hf, zoo
    torch.set_num_threads(1)
    m = zoo.build("llama")
    path = sys.argv[2]
    if sys.argv[1] == "save":
        ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = m(ids, use_cache=True)
        cache = hf.from_hf(out.past_key_values, m.config, identity=hf.identity(m))
        open(path, "wb").write(kvwire.encode(cache))
    else:
        h = kvwire.Reader(open(path, "rb").read()).header
        v = kvwire.check_compatible(h, hf.local_model(m))
        print(v.status, "|", " ; ".join(v.reasons))
""")


@pytest.mark.slow
def test_xm3_issue_case_no_tokenizer_on_either_side_is_exact_in_a_fresh_process(tmp_path):
    """KVW-XM-3: hf.identity(model) without a tokenizer, saved, checked in another process against
    hf.local_model(model): exact (it was 'tokenizer: fingerprint missing on the sender side')."""
    script, path = tmp_path / "journey.py", tmp_path / "c.kvw"
    script.write_text(_SCRIPT)
    for step in ("save", "check"):
        run = subprocess.run([sys.executable, str(script), step, str(path)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "exact |"


# -- one side only: still a refusal, with the way past it ------------------------------------------

def test_xm3_tokenizer_on_one_side_only_is_refused_with_the_narrow_switch_named():
    """KVW-XM-3: present on one side only is a reason naming allow_missing={'tokenizer'} and what
    it gives up; that switch accepts it and keeps the weights check."""
    for sender, receiver, side in ((ident(tok=b""), ident(), "sender"), (ident(), ident(tok=b""), "receiver")):
        v = check(sender, receiver)
        assert v.status == "incompatible"
        tok = [r for r in v.reasons if r.startswith("tokenizer:")]
        assert len(tok) == 1 and f"missing on the {side} side" in tok[0]
        assert "allow_missing={'tokenizer'}" in tok[0] and "gives up the tokenizer check only" in tok[0]
        assert "require_fingerprints=False gives up both" in tok[0]
        assert not [r for r in check(sender, receiver, allow_missing={"tokenizer"}).reasons
                    if r.startswith("tokenizer:")]
    # the narrow switch still compares the weights: other weights stay refused
    v = check(ident(tok=b""), ident(weights=b"o" * 32), allow_missing=("tokenizer",))
    assert v.status == "incompatible" and any(r.startswith("weights:") for r in v.reasons)
    # the broad switch gives up the model check too (kept: documented), but not a tokenizer difference
    assert check(ident(tok=b"", weights=b""), ident(), require_fingerprints=False).status == "exact"
    v = check(ident(tok=b"u" * 32), ident(), require_fingerprints=False)
    assert v.reasons == ("tokenizer: fingerprints differ",)


def test_xm3_hf_tokenizer_on_the_receiver_only_is_refused():
    """KVW-XM-3 on real objects: a receiver identified with a tokenizer refuses a cache saved without one."""
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from kvwire.adapters import hf, zoo

    torch.set_num_threads(1)
    m = zoo.build("llama")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, "a": 1}, "<unk>")))
    sender = hf.identity(m)
    h = header(sender).replace(arch=hf.arch_from_config(m), dtype="f32")
    v = kvwire.check_compatible(h, hf.local_model(m, tokenizer))
    assert v.status == "incompatible"
    assert v.reasons[0].startswith("tokenizer: fingerprint missing on the sender side")
    assert "hf.identity(model, tokenizer)" in v.reasons[0]
    # the compat fingerprints differ (the receiver's covers its tokenizer), but weights, config and
    # dtype agree: with the tokenizer let go, accepted
    assert kvwire.check_compatible(h, hf.local_model(m, tokenizer, allow_missing={"tokenizer"})).status == "exact"


def test_xm4_model_fingerprints_absent_on_both_sides_or_one():
    """KVW-XM-4: no model fingerprint on either side is no mismatch; on one side a reason naming
    allow_missing={'model'}, which keeps the tokenizer check."""
    bare = kvwire.ModelIdentity()
    assert check(bare, bare) == kvwire.Verdict("exact")
    v = check(bare, ident())
    assert [r.split(":")[0] for r in v.reasons] == ["tokenizer", "compat"]
    compat = v.reasons[1]
    assert "allow_missing={'model'}" in compat and "the tokenizer is still compared" in compat
    v = check(bare, ident(), allow_missing={"model"})
    assert [r.split(":")[0] for r in v.reasons] == ["tokenizer"]
    assert check(bare, ident(), allow_missing=FINGERPRINT_PARTS).status == "exact"


def test_xm4_weights_absent_on_both_sides_still_catch_a_compute_dtype_difference():
    """KVW-XM-4: weights absent on both sides are not a mismatch, but compat fingerprints that then
    differ (same tokenizer and config) still say the model computes in another dtype."""
    assert check(ident(weights=b""), ident(weights=b"")) == kvwire.Verdict("exact")
    v = check(ident(weights=b"", dtype="f16"), ident(weights=b""))
    assert v.status == "incompatible" and v.reasons[0].startswith("compat:") and "another dtype" in v.reasons[0]
    v = check(ident(weights=b""), ident())
    assert v.status == "incompatible" and v.reasons[0].startswith("weights: fingerprint missing on the sender")


def test_allow_missing_misuse_names_the_parts():
    with pytest.raises(ValueError, match="'tokenizer', 'model'"):
        LocalModel(ARCH, "bf16", allow_missing={"tokeniser"})
    with pytest.raises(TypeError, match="set of part names"):
        LocalModel(ARCH, "bf16", allow_missing="tokenizer")
    assert LocalModel(ARCH, "bf16", allow_missing=["model"]).allow_missing == frozenset({"model"})


_FP = st.sampled_from([b"", b"a" * 32, b"b" * 32])


@settings(max_examples=150, deadline=None)
@given(st_tok=_FP, rt_tok=_FP, allow=st.sets(st.sampled_from(FINGERPRINT_PARTS)), required=st.booleans())
def test_xm3_tokenizer_reason_exactly_when_present_and_different_or_one_sided(st_tok, rt_tok, allow, required):
    """KVW-XM-3 as a property: a tokenizer reason iff both present and differ, or one side only and
    not waived; never for absent on both sides."""
    v = check(ident(tok=st_tok), ident(tok=rt_tok), allow_missing=allow, require_fingerprints=required)
    tok = [r for r in v.reasons if r.startswith("tokenizer:")]
    one_sided = bool(st_tok) != bool(rt_tok)
    expect = (st_tok and rt_tok and st_tok != rt_tok) or (one_sided and required and "tokenizer" not in allow)
    assert bool(tok) == bool(expect)
    if not st_tok and not rt_tok:
        assert v.status == "exact"


# -- the lossy note (item 5) -----------------------------------------------------------------------

def _cache(tokens=40):
    rng = np.random.default_rng(1)
    kv = [rng.standard_normal((2, tokens, 8)).astype(np.float16) for _ in range(2)]
    return kvwire.KVCache.from_tensors(kv, kv)


@pytest.mark.parametrize("codec, lossy", [("raw", None), ("zstd", None), ("byteplane", None),
                                          ("int8", "int_affine 8-bit"), ("fp8-e4m3", "fp8"),
                                          ("int4-g32-zstd", "int_affine 4-bit")])
def test_verdict_says_when_a_cache_was_lossy_compressed(codec, lossy):
    """spec/codecs.md: a cache that went through a lossy codec is still exact for the receiver, and
    the verdict notes it ("lossy: ..."); a lossless one has no note."""
    h = kvwire.Reader(kvwire.encode(_cache(), codec=codec)).header
    v = kvwire.check_compatible(h, LocalModel(h.arch, h.dtype))
    assert v.status == "exact" and bool(v)
    if lossy is None:
        assert v.notes == ()
    else:
        assert len(v.notes) == 1 and v.notes[0].startswith("lossy:") and lossy in v.notes[0]
