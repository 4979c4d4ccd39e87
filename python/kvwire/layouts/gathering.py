"""Gather: engine buffers -> chunks in kvwire's standard layout (``GatherMixin``).

``gather_range`` returns a chunk [heads, tokens, head_dim]: a view when the tokens lie in
one block or a contiguous run of mergeable blocks, else one ``index_select`` into a
fresh tensor already in the standard layout (the one copy the hardware needs).

A mixin of ``EngineBuffers`` (binding.py), which supplies the bound views and the
checks: ``layout``, ``block_size``, ``torch_dtype``, ``geometry``, ``int_views``,
``use_index_kernels()`` and ``check_ids()``. All copies go through those integer views,
so they are bit-exact for every dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .descriptor import BoundBuffers
from .ids import id_runs, run_start

__all__ = ["GatherMixin"]


class GatherMixin(BoundBuffers):
    """The gather methods of ``EngineBuffers``."""

    if TYPE_CHECKING:  # supplied by EngineBuffers (binding.py)
        def check_ids(self, ids, num_tokens: int) -> np.ndarray: ...

    def gather_range(self, layer: int, component: str, ids: np.ndarray, t0: int, t1: int):
        """Tokens [t0, t1) of one component as [heads, tokens, head_dim] (``ids`` already
        checked, see ``gather``): a view where the layout allows, else one copy."""
        import torch

        v = self.int_views[layer][component]
        n = t1 - t0
        if self.layout.addressing == "block":
            N = self.block_size
            b0, b1 = t0 // N, (t1 - 1) // N + 1
            blocks, off = ids[b0:b1], t0 - b0 * N
            run = run_start(blocks)
            if run is not None:
                src = v[run : run + len(blocks)]
                if len(blocks) == 1:
                    return src[0, off : off + n].permute(1, 0, 2).view(self.torch_dtype)
                if src.stride(0) == src.shape[1] * src.stride(1):
                    return src.flatten(0, 1)[off : off + n].permute(1, 0, 2).view(self.torch_dtype)
            H, C = v.shape[2], v.shape[3]
            out = torch.empty((H, len(blocks) * N, C), dtype=v.dtype, device=v.device)
            o4, src4 = out.view(H, len(blocks), N, C), v.permute(2, 0, 1, 3)  # (H, B, N, C)
            if self.use_index_kernels():
                torch.index_select(src4, 1, torch.as_tensor(blocks, device=v.device), out=o4)
            else:  # strided copies per run of blocks: far faster than CPU index kernels
                for j, b, k in id_runs(blocks):
                    o4[:, j : j + k].copy_(src4[:, b : b + k])
            return out[:, off : off + n].view(self.torch_dtype)
        slots = ids[t0:t1]
        run = run_start(slots)
        if run is not None:
            return v[run : run + n].permute(1, 0, 2).view(self.torch_dtype)
        out = torch.empty((v.shape[1], n, v.shape[2]), dtype=v.dtype, device=v.device)
        src3 = v.permute(1, 0, 2)  # (H, T, C)
        if self.use_index_kernels():
            torch.index_select(src3, 1, torch.as_tensor(slots, device=v.device), out=out)
        else:
            for j, s0, k in id_runs(slots):
                out[:, j : j + k].copy_(src3[:, s0 : s0 + k])
        return out.view(self.torch_dtype)

    def gather_layer(self, layer: int, ids, num_tokens: int) -> dict:
        """{component: [heads, num_tokens, head_dim]} of one layer."""
        a = self.check_ids(ids, num_tokens)
        return {c: self.gather_range(layer, c, a, 0, num_tokens) for c in self.geometry[layer].components}

    def gather(self, ids, num_tokens: int) -> list[dict]:
        """Every layer in the standard layout (see ``gather_range`` for views vs copies)."""
        a = self.check_ids(ids, num_tokens)
        return [{c: self.gather_range(i, c, a, 0, num_tokens) for c in g.components}
                for i, g in enumerate(self.geometry)]
