"""What the benchmark scripts share: the machine line of their reports.

Why: the figures of one run are only comparable with another's on the same processor (two
sessions' 2-core VMs differed by 2x in every row), and ``platform.processor()`` says only
"x86_64" on Linux; the model name from /proc/cpuinfo tells the runs apart.
"""

from __future__ import annotations

import platform


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
