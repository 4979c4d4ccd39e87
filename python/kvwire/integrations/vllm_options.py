"""The vLLM connector's options (``kv_connector_extra_config``), checked in one place.

Why apart from the connector: every option is checked before a store is opened or a model
hashed, each with an error naming the valid choices (a misspelt key too: silently ignored,
``"layerwize": false`` would change nothing and say nothing), and the checks run, and are
tested, without vLLM. The connector and docs/vllm.md's table name the same keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..store import default_store_url

KEYS = ("store", "chunk_tokens", "codec", "timeout", "layerwise", "load_threads", "prefetch_layers", "save_partial",
        "model_fingerprint", "auth_key_file", "stats_path")


@dataclass(frozen=True)
class ConnectorOptions:
    """The checked options; see docs/vllm.md "Configuration" for what each does."""

    store: str
    chunk_tokens: int = 256
    codec: Any = "raw"
    timeout: float | None = None  # None: the store's default
    layerwise: bool | str = "auto"
    load_threads: int | str = "auto"
    prefetch_layers: int = 2
    save_partial: bool = True
    model_fingerprint: str | None = None
    auth_key_file: str | None = None
    stats_path: str | None = None

    @property
    def store_options(self) -> dict:
        """Keyword arguments of ``open_store`` (a file store has no timeout)."""
        return {"timeout": self.timeout} if self.timeout is not None and not self.store.startswith("file:") else {}

    @property
    def load_timeout(self) -> float:
        """How long a load may take in all before its chunks are recomputed."""
        return max(30.0, 4 * (self.timeout if self.timeout is not None else 5.0))


def _int(extra: dict, key: str, default: int, least: int, what: str) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{key} ({what}) must be an int >= {least}, not {value!r}")
    return value


def connector_options(extra: dict | None, block_size: int) -> ConnectorOptions:
    """``ConnectorOptions`` of ``extra`` for an engine whose blocks hold ``block_size``
    tokens; ``ValueError`` naming the valid choices for anything else."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}: the kvwire connector takes "
                         f"{', '.join(KEYS)} (docs/vllm.md, Configuration)")
    chunk = _int(extra, "chunk_tokens", 256, 1, "tokens per stored object")
    if chunk % block_size:
        raise ValueError(f"chunk_tokens {chunk} must be a multiple of vLLM's block_size {block_size}")
    layerwise = extra.get("layerwise", "auto")
    if not isinstance(layerwise, bool) and layerwise != "auto":
        raise ValueError(f"layerwise must be true, false or \"auto\", not {layerwise!r}")
    threads = extra.get("load_threads", "auto")
    if threads != "auto":
        threads = _int(extra, "load_threads", 1, 1, "threads that load and place, or \"auto\"")
    save_partial = extra.get("save_partial", True)
    if not isinstance(save_partial, bool):
        raise ValueError(f"save_partial must be true or false, not {save_partial!r}")
    timeout = extra.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 < timeout < float("inf")):
        raise ValueError(f"timeout (seconds one store call may wait) must be a positive number, not {timeout!r}")
    url = extra.get("store") or default_store_url()
    if not isinstance(url, str) or url.split("://", 1)[0].lower() == "memory":
        raise ValueError(f"store {url!r}: the kvwire connector needs a store its scheduler and workers share "
                         "(file://DIR, redis://, redis-cluster://); memory:// lives in one process and vLLM's "
                         "scheduler and workers are separate processes, so it could never hit")
    paths = {}
    for key in ("auth_key_file", "stats_path"):
        if extra.get(key) is not None and not isinstance(extra[key], (str, os.PathLike)):
            raise ValueError(f"{key} must be a path, not {extra[key]!r}")
        paths[key] = None if extra.get(key) is None else os.fspath(extra[key])
    fingerprint = extra.get("model_fingerprint")
    if fingerprint is not None:
        try:
            bytes.fromhex(fingerprint)
        except (TypeError, ValueError):
            raise ValueError(f"model_fingerprint must be the weights' fingerprint in hex, not {fingerprint!r}") \
                from None
    return ConnectorOptions(
        store=url, chunk_tokens=chunk, codec=extra.get("codec", "raw"),
        timeout=None if timeout is None else float(timeout), layerwise=layerwise, load_threads=threads,
        prefetch_layers=_int(extra, "prefetch_layers", 2, 1, "layers read ahead of the forward pass"),
        save_partial=save_partial, model_fingerprint=fingerprint, **paths)


__all__ = ["KEYS", "ConnectorOptions", "connector_options"]
