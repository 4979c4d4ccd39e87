"""``import kvwire`` stays cheap: ml_dtypes (bf16/fp8 numpy types, most of the import time on a busy machine)
and torch are imported on first use, not with the package. Checked in a fresh interpreter."""

import subprocess
import sys

CODE = """
import sys
import kvwire, kvwire.store, kvwire.stream, kvwire.layouts
print(sorted(m for m in ("ml_dtypes", "torch", "redis", "vllm", "transformers") if m in sys.modules))
"""


def test_import_kvwire_leaves_heavy_modules_unloaded():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_bf16_and_fp8_dtypes_resolve_on_first_use():
    code = ("import sys, numpy as np, kvwire\nfrom kvwire.format import registry as R\n"
            "assert 'ml_dtypes' not in sys.modules\n"
            "d = R.DTYPES['bf16']\nassert 'ml_dtypes' in sys.modules\n"
            "import ml_dtypes\nassert d == (0, 2, np.dtype(ml_dtypes.bfloat16)) and d.numpy.itemsize == 2\n"
            "assert list(R.DTYPES) == list(R.DTYPE_CODES) and 'f8_e5m2' in R.DTYPES and 'f64' not in R.DTYPES\n"
            "assert {n: (c, s) for n, (c, s, _) in R.DTYPES.items()} == R.DTYPE_CODES\n")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
