"""The vLLM CPU path that LMCache 0.5.6 lacks, for benchmarks/bench_vllm.py's LMCache rows only.

Why: LMCache's released ``CreateGPUConnector`` has no branch for vLLM on the CPU (it raises
"No supported cpu connector found."): its vLLM connectors move KV between the paged buffer and
its memory objects through a CUDA kernel and CUDA streams. To compare with LMCache on a CPU-only
machine, the benchmark's LMCache engines replace that one function, and nothing else, with
``CpuPagedConnector`` below: a plain-torch gather/scatter, the same transfer that LMCache's
unmerged upstream pull request #4268 adds.

What it does, exactly: vLLM's CPU attention backend gives each layer one bf16 tensor
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (K in the first head_dim channels of C,
V in the rest). For a slot s (block s // block_size, offset s % block_size):
``from_gpu`` (store) copies every layer's K and V of the slots ``slot_mapping[start:end]``
into LMCache's ``KV_2LTD`` memory object ``[2, layers, tokens, kv_heads * head_dim]``;
``to_gpu`` (load) writes them back, skipping the first ``vllm_cached_tokens - start`` tokens
(vLLM already holds them) and negative slots (padding). One advanced-indexing copy per layer
and direction, on the calling thread; no streams, no native code. MLA caches, layer-wise
transfer and any other layout are refused. vLLM's ``LMCacheConnectorV1`` and the rest of
LMCache run unchanged.

``benchmarks/lmcache_site/sitecustomize.py`` calls ``install()`` in every process of an
LMCache engine (the benchmark puts that folder on PYTHONPATH for those engines only).
"""

from __future__ import annotations

import torch


def _slots(slot_mapping: torch.Tensor, start: int, end: int, skip: int = 0):
    """(token positions in the memory object, slot ids) of the slots to move."""
    slots = slot_mapping[start:end].to(torch.long)
    pos = torch.arange(slots.numel())
    keep = (slots >= 0) & (pos >= skip)
    return pos[keep], slots[keep]


class CpuPagedConnector:
    """LMCache's GPUConnectorInterface for vLLM's CPU paged KV buffer (fused K/V layout)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.hidden_dim_size = kv_heads * head_dim
        self.kvcaches: list[torch.Tensor] | None = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def _layers(self, kwargs) -> list[torch.Tensor]:
        """Each layer as [blocks, heads, block_size, 2, head_dim]."""
        self.initialize_kvcaches_ptr(**kwargs)
        if not self.kvcaches:
            raise ValueError("no kvcaches given to the CPU connector")
        out = []
        for kv in self.kvcaches:
            if kv.dim() != 4 or kv.shape[1] != self.kv_heads or kv.shape[3] != 2 * self.head_dim:
                raise NotImplementedError(f"CPU bridge: unsupported KV layout {tuple(kv.shape)}")
            out.append(kv.view(kv.shape[0], kv.shape[1], kv.shape[2], 2, self.head_dim))
        return out

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Gather the slots of tokens [start, end) into ``memory_obj`` (KV_2LTD)."""
        from lmcache.v1.memory_management import MemoryFormat

        layers = self._layers(kwargs)
        bs = layers[0].shape[2]
        pos, slots = _slots(kwargs["slot_mapping"], start, end)
        mem = memory_obj.tensor  # [2, L, T, H * D]
        for i, kv in enumerate(layers):
            sel = kv[slots // bs, :, slots % bs]  # [T, H, 2, D]
            mem[0, i, pos] = sel[:, :, 0].reshape(-1, self.hidden_dim_size).to(mem.dtype)
            mem[1, i, pos] = sel[:, :, 1].reshape(-1, self.hidden_dim_size).to(mem.dtype)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Scatter ``memory_obj`` (KV_2LTD) into the slots of tokens [start, end)."""
        layers = self._layers(kwargs)
        bs = layers[0].shape[2]
        skip = max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start)
        pos, slots = _slots(kwargs["slot_mapping"], start, end, skip)
        mem = memory_obj.tensor
        h, d = self.kv_heads, self.head_dim
        for i, kv in enumerate(layers):
            k = mem[0, i, pos].view(-1, h, d)
            v = mem[1, i, pos].view(-1, h, d)
            kv[slots // bs, :, slots % bs] = torch.stack((k, v), dim=2).to(kv.dtype)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)


def install() -> None:
    """Route LMCache's vLLM connector creation on the CPU to ``CpuPagedConnector``."""
    import lmcache.v1.gpu_connector as gc
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    original = gc.CreateGPUConnector
    GPUConnectorInterface.register(CpuPagedConnector)

    def create(config, metadata, engine, layout_hints=None):
        if engine != EngineType.VLLM or gc.torch_device_type != "cpu":
            return original(config, metadata, engine, layout_hints)
        if metadata.use_mla or config.use_layerwise:
            raise NotImplementedError("CPU bridge: MLA and layer-wise transfer are not supported")
        num_layers, _, _, kv_heads, head_dim = metadata.kv_shape
        return CpuPagedConnector(num_layers, kv_heads, head_dim)

    gc.CreateGPUConnector = create
