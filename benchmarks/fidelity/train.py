"""Train the small byte-level decoder used by the fidelity benchmark.

Why a trained model: random weights have no outlier key channels, and outlier channels are
what makes key quantization hard (KIVI quantizes keys per channel because of them). The
model is tiny (4 layers, GQA 4:2, RoPE, head_dim 64, vocab 256 = raw bytes, so no
tokenizer files are needed) and trains on the CPython 3.11 standard library sources that
Debian ships in /usr/lib/python3.11 (about 12 MB of .py files, tests excluded).

Reproducible: fixed seeds, deterministic algorithms, a fixed thread count (one: on a
busy machine a second thread mostly spins), a sorted file list. Run (about 20 minutes, one
core; 900 steps of 2 x 1024 bytes)::

    .venv/bin/python benchmarks/fidelity/train.py --out benchmarks/fidelity/model

Writes model.safetensors (bf16), config.json, train_log.json (loss curve) into --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

DATA_ROOT = Path("/usr/lib/python3.11")
SEQ_LEN = 1024


def model_config():
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def source_files(root: Path = DATA_ROOT) -> list:
    """Sorted stdlib .py files, tests and third-party packages excluded."""
    skip = ("test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3")
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]):
            continue
        out.append(p)
    return out


def corpus(root: Path = DATA_ROOT):
    """(train bytes, held-out bytes): every 20th file is held out."""
    train, held = [], []
    for i, p in enumerate(source_files(root)):
        (held if i % 20 == 0 else train).append(p.read_bytes())
    return np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(held), np.uint8)


def batches(data: np.ndarray, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - SEQ_LEN - 1, size=batch)
        x = np.stack([data[s:s + SEQ_LEN + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def evaluate(model, held: np.ndarray, n: int = 8) -> float:
    model.eval()
    with torch.no_grad():
        x = next(batches(held, n, 1, seed=1234))
        out = model(input_ids=x[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), x[:, 1:].reshape(-1))
    model.train()
    return float(loss)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "model"))
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    from transformers import AutoModelForCausalLM

    train, held = corpus()
    print(f"corpus: {len(train)} train bytes, {len(held)} held-out bytes", flush=True)
    model = AutoModelForCausalLM.from_config(model_config(), attn_implementation="sdpa").float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))
    log = []
    t0 = time.time()
    for step, x in enumerate(batches(train, a.batch, a.steps, a.seed)):
        out = model(input_ids=x[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == a.steps - 1:
            rec = {"step": step, "loss": round(float(loss), 4), "elapsed_s": round(time.time() - t0, 1)}
            if step % 100 == 0 or step == a.steps - 1:
                rec["held_out_loss"] = round(evaluate(model, held), 4)
            log.append(rec)
            print(json.dumps(rec), flush=True)

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(str(out_dir / "config.json"))
    digest = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()
    (out_dir / "train_log.json").write_text(json.dumps({
        "args": vars(a) | {"out": None}, "data": str(DATA_ROOT), "train_bytes": int(len(train)),
        "held_out_bytes": int(len(held)), "log": log, "sha256": digest,
        "torch": torch.__version__, "seconds": round(time.time() - t0, 1)}, indent=1) + "\n")
    print(f"wrote {out_dir}/model.safetensors sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
