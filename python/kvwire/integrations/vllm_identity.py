"""A vLLM request's identity for the store's keys (spec/store.md KVW-IDENT-7).

Why apart: vLLM's own block hashes bind a request's ``cache_salt``, LoRA adapter,
multimodal items and prompt embeddings (``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``); the connector must bind the same, or another tenant,
adapter or image gets this one's KV. This half reads the scheduler's ``Request`` by its
attribute names only (no vLLM import), so it is tested without an engine.
"""

from __future__ import annotations

from ..store.identity import Adapter, MultimodalItem, RequestIdentity, adapter_fingerprint


def request_identity(request) -> tuple[RequestIdentity | None, str | None]:
    """(identity, None), or (None, why) for a request the connector cannot bind faithfully
    (KVW-IDENT-1): prompt embeddings, an adapter whose files it cannot fingerprint, a
    multimodal item without an identifier. An empty identity means no salt, adapter or item."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None, "prompt embeddings (no token ids to key)"
    salt = getattr(request, "cache_salt", None) or None  # vLLM: an empty salt is no salt
    if salt is not None and not isinstance(salt, str):
        return None, f"cache_salt of type {type(salt).__name__}"
    adapter = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = getattr(lora, "lora_path", "") or ""
        try:
            adapter = Adapter(str(lora.lora_name), adapter_fingerprint(path))
        except (OSError, ValueError) as exc:
            return None, f"LoRA adapter files not readable ({type(exc).__name__}: {exc})"
    items = []
    for f in getattr(request, "mm_features", None) or []:
        ident, pos = getattr(f, "identifier", None), getattr(f, "mm_position", None)
        if not ident or pos is None:
            return None, "a multimodal item without an identifier or placeholder range"
        try:
            items.append(MultimodalItem(str(ident).encode("utf-8"), int(pos.offset), int(pos.length)))
        except (TypeError, ValueError) as exc:
            return None, f"a multimodal item it cannot encode ({exc})"
    try:
        return RequestIdentity(None if salt is None else salt.encode("utf-8"), adapter, tuple(items)), None
    except ValueError as exc:
        return None, f"an identity it cannot encode ({exc})"


def reason_kind(why: str) -> str:
    """The reason's kind (its text before any detail), logged once per kind."""
    return why.split(" (", 1)[0]


__all__ = ["reason_kind", "request_identity"]
