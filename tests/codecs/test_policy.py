"""Load-or-recompute policy (spec/policy.md, informative): cost model, decisions, CLI."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvwire
from kvwire.codecs.policy import (
    DEFAULT_CODECS,
    MODELS,
    CodecCost,
    ModelCost,
    parse_bandwidth,
    parse_codec,
    parse_model,
    pipelined_seconds,
    recompute_seconds,
)
from kvwire.tools.cli import main

LLAMA = MODELS["llama-3-8b"]
RAW = CodecCost("raw", 16.0, math.inf, True)
# A prefill speed at which raw bf16 at 32 Gbps costs 1.5x a short-prompt token's prefill.
T32 = LLAMA.elements_per_token * 2 * 8 / 32e9
PPS = 1.5 / T32


def test_bandwidth_units():
    assert parse_bandwidth("32Gbps") == 32e9
    assert parse_bandwidth("100 Gbit/s") == 100e9
    assert parse_bandwidth("4GB/s") == 32e9
    assert parse_bandwidth(1e9) == 1e9
    for bad in ("fast", "-3Gbps", 0, "0Gbps", float("inf")):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_recompute_cost_grows_with_position():
    """A chunk's prefill time is n/pps * (1 + mean position / half_tokens) (spec/policy.md 3)."""
    m = ModelCost(2, 1, 4, 1, 1.0, attention_half_tokens=100)
    assert recompute_seconds(m, 0, 1, 10.0) == pytest.approx(0.1)
    assert recompute_seconds(m, 100, 1, 10.0) == pytest.approx(0.2)
    # closed form equals the sum over tokens
    assert recompute_seconds(m, 50, 30, 10.0) == pytest.approx(sum((1 + p / 100) / 10 for p in range(50, 80)))
    # default half_tokens from FLOP counts: params / (2 * layers * q_heads * head_dim)
    assert LLAMA.half_tokens == pytest.approx(6.98e9 / (2 * 32 * 32 * 128))


def test_brief_example_32_gbps_loads_only_long_contexts_64_loads_all():
    """The design brief's example, qualitatively: at 32 Gbps only long contexts are worth
    loading (for a given prefill speed), at 64 Gbps and above every context is."""
    for ctx in (2048, 4096, 8192):
        assert kvwire.plan("32Gbps", ctx, PPS, [RAW]).loaded_tokens == 0
    long = kvwire.plan("32Gbps", 262144, PPS, [RAW])
    assert long.load_fraction > 0.9 and long.chunks[-1].action == "load" and long.chunks[0].action == "recompute"
    for bw in ("64Gbps", "100Gbps", "400Gbps"):
        for ctx in (256, 4096, 65536, 262144):
            p = kvwire.plan(bw, ctx, PPS, [RAW])
            assert p.load_fraction == 1.0, (bw, ctx)
            assert p.pipelined_s < p.recompute_all_s


def test_densest_codec_that_beats_recompute():
    slow_dense = CodecCost("dense", 4.0, 2.0)
    p = kvwire.plan("100Gbps", 131072, PPS, [RAW, slow_dense], prefer="densest")
    # early chunks: the slow decoder loses to recompute, raw does not; late chunks: dense wins
    assert p.chunks[0].codec == "raw" and p.chunks[-1].codec == "dense"
    for c in p.chunks:
        assert c.action == "load" and c.load_s < c.recompute_s
        if c.codec == "raw":  # the denser codec must not have beaten recompute here
            elements = c.tokens * LLAMA.elements_per_token
            assert elements * 4 / 8 * 8 / 100e9 + elements * 2 / 2e9 >= c.recompute_s
    fast = kvwire.plan("100Gbps", 131072, PPS, [RAW, slow_dense])  # the default: prefer="fastest"
    assert fast == kvwire.plan("100Gbps", 131072, PPS, [RAW, slow_dense], prefer="fastest")
    assert {c.codec for c in fast.chunks} == {"raw"}
    assert fast.pipelined_s <= p.pipelined_s and fast.stored_bytes > p.stored_bytes


def test_table_and_runs():
    p = kvwire.plan("32Gbps", 65536, PPS, [RAW])
    runs = p.runs()
    assert [r[2] for r in runs] == ["recompute", "load"]
    assert runs[0][0] == 0 and runs[-1][0] + runs[-1][1] == 65536
    text = p.table()
    assert "recompute" in text and "load" in text and "65536" in text


def test_pipelined_makespan():
    """Link and compute overlap; decode waits for arrival (spec/policy.md 5)."""
    from kvwire.codecs.policy import ChunkDecision as C

    chunks = [C(0, 0, 1, "recompute", None, 3.0, 0, 0, 0), C(1, 1, 1, "load", "raw", 9.0, 2.0, 1.0, 1),
              C(2, 2, 1, "load", "raw", 9.0, 2.0, 1.0, 1)]
    # link: chunk1 arrives at 2, chunk2 at 4; compute: recompute 0-3, decode 3-4, decode 4-5
    assert pipelined_seconds(chunks) == 5.0
    assert pipelined_seconds([]) == 0.0


def test_cached_prefix_and_latency():
    p = kvwire.plan("64Gbps", 4096, PPS, [RAW], cached_tokens=1024)
    assert p.chunks[0].token_start == 1024 and sum(c.tokens for c in p.chunks) == 3072
    no_latency = kvwire.plan("64Gbps", 4096, PPS, [RAW])
    rtt = kvwire.plan("64Gbps", 4096, PPS, [RAW], latency_s=1e-3)
    assert rtt.load_fraction == 1.0 and rtt.pipelined_s == pytest.approx(no_latency.pipelined_s + 1e-3)
    assert rtt.serial_s == pytest.approx(no_latency.serial_s + 1e-3)
    slow = kvwire.plan("64Gbps", 4096, PPS, [RAW], latency_s=10.0)  # a one-time cost larger than the gain
    assert slow.loaded_tokens == 0 and slow.pipelined_s == slow.recompute_all_s == slow.serial_s


def test_rejects_bad_inputs():
    for kw in (dict(context_tokens=-1), dict(prefill_tokens_per_s=0), dict(chunk_tokens=0),
               dict(cached_tokens=5000), dict(codecs=[]), dict(prefer="cheapest")):
        args = dict(bandwidth="32Gbps", context_tokens=4096, prefill_tokens_per_s=PPS, codecs=[RAW]) | kw
        with pytest.raises(ValueError):
            kvwire.plan(**args)
    assert parse_model("80:8:128:64:68.5e9") == MODELS["llama-3-70b"] and parse_model("qwen2.5-7b").kv_heads == 4
    with pytest.raises(ValueError):
        parse_model("8:8:128")
    assert parse_codec("q:4.5:2") == CodecCost("q", 4.5, 2.0)
    assert parse_codec("raw") == DEFAULT_CODECS[0]
    with pytest.raises(ValueError):
        parse_codec("q")


@given(ctx=st.integers(0, 300_000), chunk=st.sampled_from([64, 256, 1000]), lo=st.floats(1e9, 1e11),
       factor=st.floats(1.0, 8.0), pps=st.floats(1e3, 1e5))
def test_properties(ctx, chunk, lo, factor, pps):
    """Chunks tile the context; loaded chunks form a suffix (recompute cost rises with
    position, transfer cost does not); more bandwidth never loads less; the plan is never
    slower than recomputing everything."""
    a = kvwire.plan(lo, ctx, pps, DEFAULT_CODECS, chunk_tokens=chunk)
    b = kvwire.plan(lo * factor, ctx, pps, DEFAULT_CODECS, chunk_tokens=chunk)
    assert sum(c.tokens for c in a.chunks) == ctx
    actions = [c.action for c in a.chunks]
    if "load" in actions:
        assert "recompute" not in actions[actions.index("load"):]
    assert b.loaded_tokens >= a.loaded_tokens
    assert a.serial_s <= a.recompute_all_s * (1 + 1e-9)
    assert a.pipelined_s <= a.serial_s * (1 + 1e-9)


def test_cli_table_and_sweep(capsys):
    assert main(["plan", "--bandwidth", "32Gbps", "--context", "65536", "--prefill-tokens-per-s", str(PPS),
                 "--codec", "raw:16"]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "load" in out and "loaded 80% of 65536 tokens" in out
    assert main(["plan", "--sweep", "--prefill-tokens-per-s", str(PPS), "--codec", "raw:16", "--model",
                 "32:8:128:32:6.98e9"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "context" not in line}
    assert "recompute" in rows["4096"].split("|")[4]  # 32 Gbps column
    assert "recompute" not in rows["4096"].split("|")[5]  # 64 Gbps column
    with pytest.raises(SystemExit):
        main(["plan", "--bandwidth", "fast", "--prefill-tokens-per-s", "1000"])
