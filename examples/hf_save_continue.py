"""Save a Hugging Face model's KV cache after the prefill; a fresh process checks it from
its header, loads it and continues generation with the same tokens.

What it shows: ``kvwire.adapters.hf.from_hf`` turns transformers' ``DynamicCache`` into a
``KVCache`` with the model's identity (config, weights and per-layer fingerprints; pass
``tokenizer=`` to fingerprint a tokenizer too); ``kvwire.save`` writes it. The receiver
(a second Python process, as a decode instance would be) reads only the header
(``kvwire.probe``), asks ``kvwire.check_compatible`` whether its own model may use the
cache (exact / convertible / incompatible, with reasons), loads it as a ``DynamicCache``
(``hf.to_hf``) and continues greedy decoding. Both sides' tokens must be identical, and a
model with other weights must be refused.

Needs torch and transformers (``pip install torch==2.13.0 && pip install -e '.[hf]'``);
runs offline on the small trained model shipped in the repository. From the repository root:

    python examples/hf_save_continue.py [--model benchmarks/fidelity/model] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def greedy(model, past, first_token: int, n: int) -> list[int]:
    """``n`` greedy tokens after ``first_token``, continuing from ``past`` (a DynamicCache)."""
    import torch

    out, tok = [first_token], first_token
    with torch.no_grad():
        for _ in range(n):
            o = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = o.past_key_values, int(o.logits[0, -1].argmax())
            out.append(tok)
    return out


def produce(model_dir: str, path: str, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import kvwire
    from kvwire.adapters import hf

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = list((REPO / "python" / "kvwire" / "cache" / "files.py").read_bytes()[:400])  # byte tokens
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    cache = hf.from_hf(out.past_key_values, model, identity=hf.identity(model))
    size = kvwire.save(path, cache)
    tokens = greedy(model, out.past_key_values, first, new_tokens)      # the producer continues too
    return {"prompt_tokens": len(prompt), "bytes": size, "first": first, "tokens": tokens}


def receive(model_dir: str, path: str, first: int, new_tokens: int, other_seed: int | None) -> dict:
    """The receiving process: header first, verdict, then load and continue."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import kvwire
    from kvwire.adapters import hf

    with open(path, "rb") as f:
        header = kvwire.probe(f.read(65536))                            # no tensor read
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    verdict = kvwire.check_compatible(header, hf.local_model(model))
    res = {"verdict": verdict.status, "reasons": list(verdict.reasons)}
    if verdict:
        past = hf.to_hf(kvwire.load(path), model)                       # a DynamicCache, bit-exact
        res["tokens"] = greedy(model, past, first, new_tokens)
    if other_seed is not None:                                          # same shapes, other weights
        torch.manual_seed(other_seed)
        other = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(model.dtype)
        v = kvwire.check_compatible(header, hf.local_model(other))
        res["other_model"] = {"verdict": v.status, "reasons": list(v.reasons)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "benchmarks" / "fidelity" / "model"))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--receive", nargs=2, metavar=("PATH", "FIRST_TOKEN"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.receive:
        print(json.dumps(receive(a.model, a.receive[0], int(a.receive[1]), a.new_tokens, other_seed=1)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "prompt.kvw")
        p = produce(a.model, path, a.new_tokens)
        print(f"producer: prefill of {p['prompt_tokens']} tokens saved to {path} ({p['bytes']} bytes)")
        r = subprocess.run([sys.executable, __file__, "--model", a.model, "--new-tokens", str(a.new_tokens),
                            "--receive", path, str(p["first"])], capture_output=True, text=True, timeout=300, check=False)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        got = json.loads(r.stdout.splitlines()[-1])
    print(f"receiver (fresh process): verdict {got['verdict']} {got['reasons']}")
    print(f"producer continues: {p['tokens']}")
    print(f"receiver continues: {got.get('tokens')}")
    print(f"identical tokens: {got.get('tokens') == p['tokens']}")
    om = got["other_model"]
    print(f"a model with other weights: {om['verdict']} ({'; '.join(om['reasons'])})")
    return 0 if got.get("tokens") == p["tokens"] and om["verdict"] == "incompatible" else 1


if __name__ == "__main__":
    raise SystemExit(main())
