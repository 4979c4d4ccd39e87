"""numpy / torch interop without copies.

The codec works on numpy arrays (ml_dtypes supplies bf16 and fp8). torch is optional:
it is imported only when a caller hands in a tensor or asks for ``backend="torch"``.
Buffers are always exchanged as uint8 views, because bf16/fp8 arrays cannot export the
buffer protocol.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..format import registry as R

_TORCH_NAMES = {
    "bf16": "bfloat16", "f16": "float16", "f32": "float32", "f8_e4m3fn": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2", "f8_e4m3fnuz": "float8_e4m3fnuz", "i8": "int8", "u8": "uint8",
}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _torch():
    import torch

    return torch


def is_torch(x) -> bool:
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(x, mod.Tensor)


def torch_dtype(name: str):
    return getattr(_torch(), _TORCH_NAMES[name])


def dtype_name(x) -> str:
    """Registry name of an array's or tensor's element type."""
    if is_torch(x):
        for name, tname in _TORCH_NAMES.items():
            if x.dtype == getattr(_torch(), tname, None):
                return name
        raise TypeError(f"tensor dtype {x.dtype} has no kvwire dtype")
    for name, (_, _, npd) in R.DTYPES.items():
        if x.dtype == npd:
            return name
    raise TypeError(f"array dtype {x.dtype} has no kvwire dtype")


def as_numpy(x) -> np.ndarray:
    """A numpy view of a CPU array or tensor (GPU tensors are copied to the host)."""
    if not is_torch(x):
        return np.asarray(x)
    name = dtype_name(x)
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    np_dtype = R.DTYPES[name][2]
    torch = _torch()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[np_dtype.itemsize]
    return t.view(int_dtype).numpy().view(np_dtype)


def as_uint(a: np.ndarray) -> np.ndarray:
    """The same memory as unsigned integers of the same width (numpy copies custom dtypes
    such as bf16 element by element; integer copies are memcpy)."""
    return a.view(_UINT_OF_SIZE[a.dtype.itemsize])


def byte_view(a: np.ndarray) -> np.ndarray:
    """Flat uint8 view of a C-contiguous array (the buffer protocol form of any dtype)."""
    return a.reshape(-1).view(np.uint8)


def writable(buffer):
    """``buffer`` itself when it is already a fresh writable buffer (a bytearray, or the
    array a codec decoded into), else a writable copy: decoded chunks are handed out
    writable (torch has no read-only tensors) without copying them a second time."""
    if isinstance(buffer, bytearray) or (isinstance(buffer, np.ndarray) and buffer.flags.writeable):
        return buffer
    return bytearray(buffer)


def view(buffer, offset: int, dtype: str, shape: tuple, backend: str):
    """Zero-copy array over ``buffer[offset:]``; shares memory with the buffer."""
    count = math.prod(shape)
    if backend == "numpy":
        return np.frombuffer(buffer, R.DTYPES[dtype][2], count, offset).reshape(shape)
    if backend == "torch":
        torch = _torch()
        if count == 0:
            return torch.empty(shape, dtype=torch_dtype(dtype))
        return torch.frombuffer(buffer, dtype=torch_dtype(dtype), count=count, offset=offset).reshape(shape)
    raise ValueError(f"backend must be 'numpy' or 'torch', not {backend!r}")


def empty(shape: tuple, dtype: str, backend: str, device=None):
    if backend == "numpy":
        if device not in (None, "cpu"):
            raise ValueError("numpy arrays live on the CPU; use backend='torch' for a device")
        return np.empty(shape, R.DTYPES[dtype][2])
    return _torch().empty(shape, dtype=torch_dtype(dtype), device=device)


def carve(shapes: list, dtype: str, backend: str, device=None) -> list:
    """Tensors of the given shapes cut from one allocation, each starting 64-byte aligned.

    One large allocation is mapped with huge pages and faulted in far faster than many
    per-layer ones (about 2x for a 256 MiB cache); the tensors share its lifetime.
    """
    itemsize = R.DTYPES[dtype][1]
    sizes = [math.prod(s) * itemsize for s in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + 63) & ~63
    if backend == "torch" and device in (None, "cpu"):  # numpy's allocator asks for huge pages
        slab = _torch().from_numpy(np.empty(max(total, 1), np.uint8))
    else:
        slab = empty((max(total, 1),), "u8", backend, device)
    out = []
    for shape, off, n in zip(shapes, offsets, sizes):
        part = slab[off : off + n]
        if backend == "numpy":
            out.append(part.view(R.DTYPES[dtype][2]).reshape(shape))
        else:
            out.append(part.view(torch_dtype(dtype)).view(shape))
    return out


# -- raw chunks into host memory ------------------------------------------------------------

def copy_raw(reader, i: int, verify: bool, dst, token_offset: int) -> None:
    """Raw chunk ``i`` of ``reader`` into ``dst`` (an integer view [heads, tokens, dim] of host
    memory) at ``token_offset``: checksum first, which brings the body into the CPU caches,
    then one copy from there, with no temporary (``Reader.layer``, hence ``load``).

    One thread: splitting the chunks of a layer over two threads measured half as fast on
    the shared 2-core machine of benchmarks/results (0.22x against 0.46x of XXH3 there:
    the helper thread waits for a core at every layer)."""
    c, stored = reader.stored(i, verify)
    dst[:, token_offset : token_offset + c.token_count, :] = np.frombuffer(stored, dst.dtype).reshape(c.shape)
