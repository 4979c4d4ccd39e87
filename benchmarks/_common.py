"""What the benchmark scripts share: the machine line of their reports and the arguments
that give the synthetic cache's shape and the fidelity runs' prompts.

Why: the figures of one run are only comparable with another's on the same processor (two
sessions' 2-core VMs differed by 2x in every row), and ``platform.processor()`` says only
"x86_64" on Linux; the model name from /proc/cpuinfo tells the runs apart. The arguments
were copied into eight scripts; one definition keeps their defaults and help the same.
"""

from __future__ import annotations

import platform
import statistics
import time


def cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median and min seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), min(out)


def cache_shape_args(ap, *, layers: int = 32, tokens: int = 2048) -> None:
    """--layers, --heads, --head-dim, --tokens: the synthetic cache's shape (default: the
    Llama-3-8B-shaped 256 MiB cache at 32 layers x 8 KV heads x 2048 tokens x 128)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=tokens)


def model_eval_args(ap) -> None:
    """--prompts, --prompt-tokens, --continuation, --greedy: how a model reads a decoded cache
    in the fidelity benchmarks (the same defaults, so their tables compare)."""
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=960)
    ap.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens scored for KL / top-1")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared (0: skip)")
