"""Header parts of the cross-model companion spec (spec/crossmodel.md): state layers,
the prefix chain and layer-map ordering.

Kept out of ``header.py`` so that module stays the v1.0 core; ``header.py`` calls the
check/build/read functions here. Functions take the header duck-typed to avoid an import
cycle.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

import flatbuffers
import numpy as np

from . import limits as L
from . import registry as R
from .errors import FormatError, LimitError, SchemaError
from .fbfields import offset_vector
from .fbs import PrefixChain as fbPrefix
from .fbs import StateTensor as fbState
from .flatbuf import Table
from .prefix import HASH_SIZE, PREFIX_SCHEME, num_chunks, prefix_root

MAX_STATE_TENSORS = 64  # per state layer (KVW-STATE-2)
MAX_STATE_DIMS = 8
MAX_STATE_NAME = 256
_STATE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class StateTensor:
    """One named non-KV state tensor of a ``state`` layer: its value after the layer's last token."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * R.DTYPES[self.dtype][1]


@dataclass(frozen=True)
class PrefixChain:
    """Prefix hash chain: ``hashes[32k:32k+32]`` is the key of token chunk k (KVW-PREFIX-*)."""

    scheme: int = PREFIX_SCHEME
    root: bytes = b""
    hashes: bytes = b""

    def hash_of(self, token_start: int, chunk_tokens: int) -> bytes:
        """The key of the chunk holding cache token ``token_start`` (KVW-PREFIX-4)."""
        k = token_start // chunk_tokens
        return self.hashes[k * HASH_SIZE:(k + 1) * HASH_SIZE]


def _fail(code: str, rule: str, msg: str, exc: type[FormatError] = SchemaError) -> NoReturn:
    raise exc(code, msg, rule=rule)


def check_state_spec(s: Any, i: int) -> None:
    """KVW-STATE-2 and KVW-STATE-3 for one LayerSpec."""
    if s.kind != "state":
        if s.state_tensors:
            _fail("STATE_INVALID", "KVW-STATE-3", f"layer {i} ({s.kind}) declares state tensors")
        return
    if s.num_kv_heads or s.head_dim_k or s.head_dim_v or s.window or s.kv_lora_rank or s.qk_rope_head_dim \
            or s.source_layer != -1:
        _fail("STATE_INVALID", "KVW-STATE-2", f"state layer {i} declares attention dimensions, a window or a "
              "source layer")
    if not 1 <= len(s.state_tensors) <= MAX_STATE_TENSORS:
        _fail("STATE_INVALID", "KVW-STATE-2", f"state layer {i} has {len(s.state_tensors)} state tensors, "
              f"need 1..{MAX_STATE_TENSORS}")
    names: set[str] = set()
    for t in s.state_tensors:
        if not (1 <= len(t.name.encode("utf-8")) <= MAX_STATE_NAME and _STATE_NAME.fullmatch(t.name)) or t.name in names:
            _fail("STATE_INVALID", "KVW-STATE-2", f"state layer {i}: tensor name {t.name[:40]!r} is empty, "
                  "repeated or not [A-Za-z0-9_.-]")
        names.add(t.name)
        if t.dtype not in R.DTYPES:
            _fail("ENUM_OUT_OF_RANGE", "KVW-HDR-10", f"state layer {i} tensor {t.name!r} dtype {t.dtype!r}")
        if not (1 <= len(t.shape) <= MAX_STATE_DIMS and all(d >= 1 for d in t.shape)):
            _fail("STATE_INVALID", "KVW-STATE-2", f"state layer {i} tensor {t.name!r} shape {t.shape}: 1 to "
                  f"{MAX_STATE_DIMS} dimensions, each at least 1")
        if t.nbytes > L.MAX_CHUNK_RAW_LENGTH:
            _fail("LIMIT_EXCEEDED", "KVW-LIM-4", f"state layer {i} tensor {t.name!r} exceeds "
                  f"{L.MAX_CHUNK_RAW_LENGTH} bytes", LimitError)


def with_state_bit(h: Any) -> Any:
    """``h`` with required bit ``state_layers`` set when a layer is a state layer (KVW-STATE-1):
    a writer derives the bit from the architecture, so callers never set it by hand."""
    bit = R.REQUIRED_FEATURES["state_layers"]
    if h.required_features & bit or not any(s.kind == "state" for s in h.arch.layers):
        return h
    return h.replace(required_features=h.required_features | bit)


def check_state_layers(h: Any) -> None:
    """KVW-STATE-4, KVW-STATE-5: placement and token range of state layers."""
    layers = h.arch.layers
    for i, (s, r) in enumerate(zip(layers, h.layer_tokens, strict=True)):  # lengths checked (KVW-HDR-13)
        if s.kind == "shared" and layers[s.source_layer].kind == "state":
            _fail("STATE_INVALID", "KVW-STATE-5", f"shared layer {i} has state layer {s.source_layer} as source")
        if s.kind == "state" and (r.start, r.count) != (0, h.token_count):
            _fail("TOKEN_RANGE_INVALID", "KVW-STATE-4", f"state layer {i} tokens [{r.start}, {r.stop}): a state "
                  f"covers exactly [0, {h.token_count})")


def check_prefix(h: Any) -> None:
    """KVW-PREFIX-1..5 on a header's prefix chain (absent, or a scheme this reader does not know: nothing)."""
    p = h.prefix
    if p is None or p.scheme != PREFIX_SCHEME:
        return
    n = num_chunks(h.token_count, h.chunk_tokens)
    if len(p.hashes) != HASH_SIZE * n:
        _fail("PREFIX_INVALID", "KVW-PREFIX-3", f"prefix chain has {len(p.hashes)} hash bytes, {n} chunks of "
              f"{h.chunk_tokens} tokens need {HASH_SIZE * n}")
    if len(p.root) != HASH_SIZE:
        _fail("PREFIX_INVALID", "KVW-PREFIX-2", f"prefix root has {len(p.root)} bytes, not {HASH_SIZE}")
    if h.first_position == 0:
        if p.root != prefix_root(h.model.compat_fingerprint, h.chunk_tokens):
            _fail("PREFIX_INVALID", "KVW-PREFIX-2", "prefix root is not the root of this model's compat fingerprint "
                  "and chunk_tokens")
    elif h.first_position % h.chunk_tokens:
        _fail("PREFIX_INVALID", "KVW-PREFIX-5", f"a prefix chain needs first_position ({h.first_position}) to be a "
              f"multiple of chunk_tokens ({h.chunk_tokens})")


def check_fingerprints(h: Any) -> None:
    """KVW-ID-10: with fingerprint_scheme 1 every fingerprint is a SHA-256 (or absent)."""
    m = h.model
    if m.fingerprint_scheme != 1:
        return  # 0: opaque byte strings (KVW-HDR-20); other values: not interpreted
    for name in ("config_fingerprint", "tokenizer_fingerprint", "weights_fingerprint", "compat_fingerprint"):
        if len(getattr(m, name)) not in (0, HASH_SIZE):
            _fail("FINGERPRINT_INVALID", "KVW-ID-10", f"{name} has {len(getattr(m, name))} bytes, scheme 1 "
                  f"needs 0 or {HASH_SIZE}")
    if len(m.layer_weights_fingerprints) not in (0, HASH_SIZE * h.num_layers):
        _fail("FINGERPRINT_INVALID", "KVW-ID-10", f"layer_weights_fingerprints has {len(m.layer_weights_fingerprints)}"
              f" bytes, scheme 1 needs 0 or {HASH_SIZE} x {h.num_layers} layers")


def check_layer_map_order(layer_map: Any) -> None:
    """KVW-MAP-4: a transmitted layer's owner (its lowest copy entry) comes before its aliases."""
    owner: dict[int, int] = {}
    for e in layer_map:
        if e.op == "copy":
            owner[e.transmitted_layer] = min(owner.get(e.transmitted_layer, e.receiver_layer), e.receiver_layer)
    for e in layer_map:
        if e.op == "alias" and owner.get(e.transmitted_layer, -1) > e.receiver_layer:
            _fail("LAYER_MAP_INVALID", "KVW-MAP-4", f"receiver layer {e.receiver_layer} aliases transmitted layer "
                  f"{e.transmitted_layer} before receiver layer {owner[e.transmitted_layer]} copies it "
                  "(a consumer before its producer)")


def check_writable(h: Any) -> None:
    """Writer-only limits of the cross-model fields (KVW-HDR-7, KVW-LIM-1)."""
    m = h.model
    for s in (m.framework, m.framework_version):
        if "\0" in s or len(s.encode("utf-8")) > L.MAX_STRING_LENGTH:
            raise ValueError(f"string {s[:40]!r}: no NUL, at most {L.MAX_STRING_LENGTH} UTF-8 bytes (KVW-HDR-7)")
    if not 0 <= m.fingerprint_scheme < 1 << 16:
        raise ValueError(f"fingerprint_scheme {m.fingerprint_scheme} is not a u16")
    if len(m.layer_weights_fingerprints) > L.MAX_BYTES_LENGTH:
        raise ValueError("layer_weights_fingerprints exceeds its limit (KVW-LIM-1)")
    if h.prefix is not None and (len(h.prefix.hashes) > L.MAX_PREFIX_HASH_BYTES or len(h.prefix.root) >
                                 L.MAX_BYTES_LENGTH or not 0 <= h.prefix.scheme < 1 << 16):
        raise ValueError(f"prefix chain of {len(h.prefix.hashes) // HASH_SIZE} token chunks exceeds "
                         f"{L.MAX_PREFIX_HASH_BYTES // HASH_SIZE} (KVW-PREFIX-7): use a larger chunk_tokens or omit it")


# ---------------------------------------------------------------------------------------
# FlatBuffers
# ---------------------------------------------------------------------------------------

def build_state_tensors(b: flatbuffers.Builder, tensors: Any) -> int:
    offs = []
    for t in tensors:
        name = b.CreateString(t.name)
        shape = b.CreateNumpyVector(np.asarray(t.shape, dtype="<u4"))
        fbState.Start(b)
        fbState.AddName(b, name)
        fbState.AddShape(b, shape)
        if t.dtype != "f32":
            fbState.AddDtype(b, R.DTYPES[t.dtype][0])
        offs.append(fbState.End(b))
    return offset_vector(b, offs)


def read_state_tensors(t: Table) -> tuple[StateTensor, ...]:
    import struct

    out = []
    for st in t.tables(10, L.MAX_STATE_TENSORS_VECTOR):  # more than 64: STATE_INVALID (KVW-STATE-2)
        v = st.vector(1, 4, 4, L.MAX_STATE_SHAPE)  # more than 8 dimensions: STATE_INVALID
        shape = struct.unpack_from(f"<{v[1]}I", st.buf.data, v[0]) if v else ()
        code = st.scalar(2, struct.Struct("<B"), R.DTYPES["f32"][0])
        if code not in R.DTYPE_BY_CODE:
            raise SchemaError("ENUM_OUT_OF_RANGE", f"state tensor dtype code {code}", rule="KVW-HDR-10")
        # a name over 256 bytes is STATE_INVALID (KVW-STATE-2); only one over the string limit is LIMIT_EXCEEDED
        out.append(StateTensor(st.string(0, L.MAX_STRING_LENGTH, required=True), tuple(shape), R.DTYPE_BY_CODE[code]))
    return tuple(out)


def build_prefix(b: flatbuffers.Builder, p: PrefixChain) -> int:
    root = b.CreateByteVector(bytes(p.root)) if p.root else None
    hashes = b.CreateByteVector(bytes(p.hashes)) if p.hashes else None
    fbPrefix.Start(b)
    if p.scheme != 1:
        fbPrefix.AddScheme(b, p.scheme)
    if root is not None:
        fbPrefix.AddRoot(b, root)
    if hashes is not None:
        fbPrefix.AddHashes(b, hashes)
    end: int = fbPrefix.End(b)
    return end


def read_prefix(t: Table | None) -> PrefixChain | None:
    if t is None:
        return None
    import struct

    return PrefixChain(t.scalar(0, struct.Struct("<H"), 1), t.blob(1, L.MAX_BYTES_LENGTH) or b"",
                       t.blob(2, L.MAX_PREFIX_HASH_BYTES) or b"")  # KVW-PREFIX-7
