"""Registries of the format: numeric codes on the wire <-> names used in the API.

The tables mirror the enums of ``schemas/kvwire.fbs`` and the registry sections of the
spec. Names are the spec's lower-case spellings; code elsewhere never uses bare numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import NamedTuple

import numpy as np

FORMAT_MAJOR = 1
FORMAT_MINOR = 0  # what a writer writes for a container that uses no feature added after 1.0 (KVW-EVOL-12)
FORMAT_MINOR_IMPLEMENTED = 4  # the newest revision this codec implements: 1.4 (checksummed zstd frames, KVW-CODEC-4/5)

# DType registry: name -> (code, itemsize, numpy dtype). bf16 and the fp8 types come from ml_dtypes, whose
# import is most of `import kvwire`'s time (seconds on a busy machine): it is imported the first time one of
# those numpy dtypes is asked for, not when the package is imported.
DTYPE_CODES: dict[str, tuple[int, int]] = {  # name -> (code, itemsize): the wire registry, no numpy needed
    "bf16": (0, 2), "f16": (1, 2), "f32": (2, 4), "f8_e4m3fn": (3, 1), "f8_e5m2": (4, 1), "f8_e4m3fnuz": (5, 1),
    "i8": (6, 1), "u8": (7, 1),
}
_NUMPY_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f8_e4m3fn": "float8_e4m3fn",
                "f8_e5m2": "float8_e5m2", "f8_e4m3fnuz": "float8_e4m3fnuz", "i8": "int8", "u8": "uint8"}


def ml_dtypes() -> ModuleType:
    """The ml_dtypes module (bf16 and fp8 numpy types), imported on first use."""
    try:
        import ml_dtypes as mld
    except ImportError as exc:  # pragma: no cover - ml_dtypes is a declared dependency
        raise ImportError("kvwire needs ml_dtypes for bf16/fp8 numpy arrays: pip install ml_dtypes") from exc
    return mld


class DType(NamedTuple):
    code: int
    itemsize: int
    numpy: np.dtype


class DTypeTable(Mapping[str, DType]):
    """``DTYPES[name] -> (code, itemsize, numpy dtype)``, a read-only mapping whose numpy dtypes are made
    on first access (bf16/fp8 import ml_dtypes then)."""

    def __init__(self) -> None:
        self._made: dict[str, DType] = {}

    def __getitem__(self, name: str) -> DType:
        got = self._made.get(name)
        if got is None:
            code, size = DTYPE_CODES[name]
            npn = _NUMPY_NAMES[name]
            got = DType(code, size, np.dtype(getattr(np, npn) if hasattr(np, npn) else getattr(ml_dtypes(), npn)))
            self._made[name] = got
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_CODES)

    def __len__(self) -> int:
        return len(DTYPE_CODES)

    def __contains__(self, name: object) -> bool:
        return name in DTYPE_CODES


DTYPES = DTypeTable()
DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPE_CODES.items()}

CODECS = {"raw": 0, "zstd": 1, "byteplane_zstd": 2, "fp8": 3, "int_affine": 4}
CODEC_BY_CODE = {v: k for k, v in CODECS.items()}

COMPONENTS = {"k": 0, "v": 1, "latent": 2, "state": 3, "positions": 4}
COMPONENT_BY_CODE = {v: k for k, v in COMPONENTS.items()}

LAYER_KINDS = {
    "full_attention": 0,
    "sliding_attention": 1,
    "chunked_attention": 2,
    "mla_latent": 3,
    "shared": 4,
    "state": 5,
}
LAYER_KIND_BY_CODE = {v: k for k, v in LAYER_KINDS.items()}

# Components a layer of each kind stores, in canonical order (spec: KVW-ARCH-3).
KIND_COMPONENTS = {
    "full_attention": ("k", "v"),
    "sliding_attention": ("k", "v"),
    "chunked_attention": ("k", "v"),
    "mla_latent": ("latent",),
    "shared": (),
    "state": ("state",),
}

CHECKSUM_ALGORITHMS = {"xxh3_64": 0}
CHECKSUM_BY_CODE = {v: k for k, v in CHECKSUM_ALGORITHMS.items()}

ROPE_TYPES = {"none": 0, "default": 1, "linear": 2, "dynamic": 3, "yarn": 4, "longrope": 5, "llama3": 6}
ROPE_TYPE_BY_CODE = {v: k for k, v in ROPE_TYPES.items()}

MAP_OPS = {"copy": 0, "alias": 1, "recompute": 2, "drop": 3}
MAP_OP_BY_CODE = {v: k for k, v in MAP_OPS.items()}

# CodecSpec enums (spec/codecs.md)
SCALE_GRANULARITIES = {"tensor": 0, "head": 1, "token": 2}
SCALE_GRANULARITY_BY_CODE = {v: k for k, v in SCALE_GRANULARITIES.items()}
GROUP_AXES = {"tokens": 0, "channels": 1}
GROUP_AXIS_BY_CODE = {v: k for k, v in GROUP_AXES.items()}
# revision 1.2 (spec/codecs.md section 8.5); code 2 of each is revision 1.3's (section 9)
ROTATIONS = {"none": 0, "hadamard": 1, "sylvester": 2}
CODEBOOKS = {"uniform": 0, "gaussian": 1, "turboquant": 2}

# Feature registry (spec section 20.8). A writer sets a required bit when the container
# uses the feature; a reader that does not implement a set required bit refuses the
# container (KVW-EVOL-3) instead of misreading it.
REQUIRED_FEATURES = {
    "codec_specs": 1 << 0,  # ChunkRecord.reserved0 indexes Header.codec_specs (spec/codecs.md)
    "sparse": 1 << 1,  # Header.sparse: per-(layer, head) token subsets (spec/sparse.md)
    "state_layers": 1 << 2,  # LayerKind STATE / Component STATE (spec/crossmodel.md)
    "kv_scales": 1 << 3,  # revision 1.1: Header.kv_scales, per-layer fp8 scales (spec section 5.10)
    "rotation": 1 << 4,  # revision 1.2: CodecSpec fields 11-13, 3-bit codes (spec/codecs.md section 8)
    "turboquant": 1 << 5,  # revision 1.3: vLLM's TurboQuant key codebook (spec/codecs.md section 9)
}
# The minor version that defines each feature (section 20.8, "Since"): a writer writes the
# largest one among the features a container uses as format_minor (KVW-EVOL-12).
FEATURE_MINOR = {"codec_specs": 0, "sparse": 0, "state_layers": 0, "kv_scales": 1, "rotation": 2, "turboquant": 3}

# Codes that a feature registers: outside containers that set the feature's required bit
# they are out of range, exactly as in a v1.0 container (KVW-EVOL-9).
FEATURE_GATED = {
    "codec": {"byteplane_zstd": "codec_specs", "fp8": "codec_specs", "int_affine": "codec_specs"},
    "component": {"state": "state_layers", "positions": "sparse"},
    "layer_kind": {"state": "state_layers"},
    "rotation": {"sylvester": "turboquant"},  # CodecSpec fields 11 and 13 (spec/codecs.md KVW-TQ-1)
    "codebook": {"turboquant": "turboquant"},
}
_GATED_REGISTRIES = {"codec": CODECS, "component": COMPONENTS, "layer_kind": LAYER_KINDS, "rotation": ROTATIONS,
                     "codebook": CODEBOOKS}


def enabled_codes(registry: str, required_features: int) -> np.ndarray:
    """Boolean lookup table over 0..255: which codes of ``registry`` a container may use."""
    out = np.zeros(256, dtype=bool)
    gates = FEATURE_GATED[registry]
    for name, code in _GATED_REGISTRIES[registry].items():
        feature = gates.get(name)
        out[code] = feature is None or bool(required_features & REQUIRED_FEATURES[feature])
    return out


# Required-feature bits this reader implements (spec: "Feature registry"): those of 1.0 and
# revision 1.1's kv_scales, 1.2's rotation and 1.3's turboquant. A reader without a bit rejects its
# containers (KVW-EVOL-3).
KNOWN_REQUIRED_FEATURES = (0 | REQUIRED_FEATURES["sparse"] | REQUIRED_FEATURES["codec_specs"]
                           | REQUIRED_FEATURES["state_layers"] | REQUIRED_FEATURES["kv_scales"]
                           | REQUIRED_FEATURES["rotation"] | REQUIRED_FEATURES["turboquant"])
KNOWN_OPTIONAL_FEATURES = 0
# ChunkRecord.flags: bits 0-7 optional (ignored when unknown), bits 8-15 required.
KNOWN_REQUIRED_CHUNK_FLAGS = 0
CHUNK_FLAGS_REQUIRED_MASK = 0xFF00


def dtype_info(name: str) -> tuple[int, int, np.dtype]:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None
