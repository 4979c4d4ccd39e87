"""Revision 1.3: vLLM's TurboQuant key codebook (spec/codecs.md section 9, KVW-TQ-*).

vLLM 0.32's ``turboquant_*_nc`` caches store each key row as Lloyd-Max indices after an
unsigned Hadamard rotation, plus the row's fp16 L2 norm, and decode the codebook vector
re-normalised to unit length times the norm. kvwire carries those codes and norms as they
are (``int_affine`` with ``codebook = turboquant``, ``rotation = sylvester``), so that every
reader gets the keys vLLM would and a vLLM engine gets its own bytes back. The tables are
vLLM's (``solve_lloyd_max``): one per bit width and parity of ``log2(D)``, since vLLM's
tables for other powers of two are these times powers of two, which the normalisation
cancels exactly (KVW-TQ-4).

Decoding is fp32 in a fixed order (the squares added one channel at a time), so every
reader produces the same bytes; the writer follows vLLM's store kernel (norm, unit vector,
rotation, midpoints of vLLM's scaled table).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format import registry as RG
from ..format.codec_specs import CodecSpec
from ..format.errors import CodecError
from . import kernels as K
from . import rotation as RT
from . import scales as SC

F32 = np.dtype("<f4")
_EPS = np.float32(1e-8)  # vLLM's x / (||x|| + 1e-8)

# (bits, log2(D) odd): vLLM's centroids for D = 128 (odd) and D = 64 (even), upper half, fp32 bits
_LEVEL_BITS = {
    (3, True): (0x3CB16317, 0x3D88C955, 0x3DF3243D, 0x3E42A09F),
    (3, False): (0x3CFADCFB, 0x3DC171FC, 0x3E2BED53, 0x3E899F54),
    (4, True): (0x3C39FBAE, 0x3D0C8559, 0x3D6DD0E1, 0x3DAA99F2, 0x3DE3682B, 0x3E126F17, 0x3E3B36E7, 0x3E772CC4),
    (4, False): (0x3C83828A, 0x3D46B9FF, 0x3DA82948, 0x3DF1444A, 0x3E20CD0C, 0x3E4F16C0, 0x3E846170, 0x3EAEC76E),
}


def _full(upper: tuple[int, ...]) -> np.ndarray:
    u = np.array(upper, np.uint32).view(F32)
    out = np.concatenate([-u[::-1], u])
    out.flags.writeable = False
    return out


LEVELS = {key: _full(v) for key, v in _LEVEL_BITS.items()}  # L[u], u = 0 .. 2^b - 1, ascending


def levels(bits: int, dim: int) -> np.ndarray:
    """KVW-TQ-4's table ``L`` for ``bits`` and the parity of ``log2(dim)``."""
    return LEVELS[bits, (dim.bit_length() - 1) % 2 == 1]


def vllm_table(bits: int, dim: int) -> np.ndarray:
    """vLLM's own table for ``dim`` (``solve_lloyd_max(dim, bits)`` in fp32): ``L`` times
    ``2^-((k - 7) / 2)`` (odd ``k = log2(dim)``) or ``2^-((k - 6) / 2)`` (even), exactly."""
    k = dim.bit_length() - 1
    scaled: np.ndarray = np.ldexp(levels(bits, dim), -((k - 7) // 2 if k % 2 else (k - 6) // 2)).astype(F32)
    return scaled


def check_geometry(spec: CodecSpec, dim: int) -> None:
    """KVW-TQ-2 at a chunk: ``D`` a power of two, one group per token row."""
    if dim & (dim - 1) or spec.group_size < dim:
        raise CodecError("DECODE_FAILED", f"the turboquant codebook needs head_dim a power of two and group_size >= "
                         f"head_dim (one group per token row); has head_dim {dim}, group_size {spec.group_size}",
                         rule="KVW-TQ-2")


def row_sums_of_squares(v: np.ndarray) -> np.ndarray:
    """Per row of ``v`` [..., D] (fp32), the squares added one channel at a time, in order."""
    acc = np.zeros(v.shape[:-1], F32)
    with np.errstate(over="ignore", under="ignore"):
        for d in range(v.shape[-1]):
            e = v[..., d]
            acc += e * e
    return acc


def values(u: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
    """KVW-TQ-4: codes ``u`` [H, M, D] (integers) and row scales ``s`` [H, M, 1] (fp32) to the
    rotated fp32 values ``(L[u] * (1 / sqrt(n))) * s``."""
    v = levels(bits, u.shape[-1])[u.astype(np.intp)]
    inv = (np.float32(1) / np.sqrt(row_sums_of_squares(v)))[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        np.multiply(v, inv, out=v)
        np.multiply(v, s, out=v)
    return v


def body(y: np.ndarray, spec: CodecSpec, pieces: list[Any]) -> list[Any]:
    """The writer's body of unrotated fp32 rows ``y`` [H, M, D] (section 9, informative; ``y``
    is overwritten): norms, unit rows, the rotation (signed when ``spec.rotation`` is
    ``hadamard``, as section 8.4 allows), codes against the midpoints of vLLM's table,
    norms rounded to ``scale_dtype``. Raises ``NotFaithful`` where a norm is not finite in
    ``scale_dtype`` or a nonzero row's norm rounds to 0 (KVW-TQ-5, KVW-INT-3)."""
    dim = y.shape[-1]
    if dim & (dim - 1) or spec.group_size < dim:  # API misuse, not a refusal: say what fits
        raise ValueError(f"the turboquant codebook needs head_dim a power of two and group_size >= head_dim "
                         f"(KVW-TQ-2): this layer has head_dim {dim}, the spec group_size {spec.group_size}")
    n = np.sqrt(row_sums_of_squares(y))
    s = RT.rms_to_dtype(n, RG.DTYPES[spec.scale_dtype][2])
    sf = s.astype(F32)
    live = (y != 0).any(axis=-1)
    SC.check(np.isfinite(sf), f"have a norm beyond {spec.scale_dtype}")
    SC.check(~live | (sf != 0), "with nonzero input would decode to zero")
    with np.errstate(over="ignore", invalid="ignore"):
        np.divide(y, (n + _EPS)[..., None], out=y)
    if spec.rotation != "none":
        RT.forward(y, spec.rotation_seed, signed=spec.rotation == "hadamard")
    t = vllm_table(spec.bits, dim)
    mids = ((t[:-1] + t[1:]) / np.float32(2)).astype(F32)
    u = np.zeros(y.shape, np.uint8)
    for m in mids:  # u = #{ j : y >= M_j }, vLLM's bucketize
        u += y >= m
    np.copyto(y, u, casting="unsafe")
    return pieces + [s.astype(s.dtype.newbyteorder("<")).view(np.uint8).reshape(-1), K.pack_codes(y, spec.bits)]
