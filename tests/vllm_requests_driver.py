"""vLLM's own scheduler ``Request`` objects through the connector's scheduler side, for
tests/integrations/test_vllm_identity.py, in the vLLM venv (.venv-vllm), without starting an engine:

    .venv-vllm/bin/python tests/vllm_requests_driver.py MODEL STORE_DIR OUT.json

Builds a ``VllmConfig`` for MODEL and a ``KVWireConnector`` (scheduler role) on
``file://STORE_DIR``; stores, for a request with image ``img-x`` (placeholder at tokens
300..363), every chunk of its prompt under the identity the connector binds, then asks
``get_num_new_matched_tokens`` for requests with the same prompt and other images or none,
prompt embeddings, and an adapter whose files are missing. OUT: {name: matched tokens}, the
connector's counters, its refusal of ``memory://`` and its store URL when none is configured.
"""

import json
import sys


def main():
    model, store, out = sys.argv[1:4]
    import torch
    from vllm import SamplingParams
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from kvwire.integrations.vllm import KVWireConnector
    from kvwire.integrations.vllm_identity import request_identity
    from kvwire.integrations.vllm_plan import chunk_cache

    def config(extra):
        return VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048),
            cache_config=CacheConfig(block_size=32),
            kv_transfer_config=KVTransferConfig(kv_connector="KVWireConnector", kv_role="kv_both",
                                                kv_connector_module_path="kvwire.integrations.vllm",
                                                kv_connector_extra_config=extra))

    try:  # refused, with the reason
        KVWireConnector(config({"store": "memory://"}), KVConnectorRole.SCHEDULER)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    default = KVWireConnector(config({}), KVConnectorRole.SCHEDULER).store_url  # XDG_CACHE_HOME set by the test
    conn = KVWireConnector(config({"store": f"file://{store}"}), KVConnectorRole.SCHEDULER)
    prompt = [(7 * i) % 251 for i in range(700)]

    def image(name, offset=300, length=64):
        return MultiModalFeatureSpec(data=None, modality="image", identifier=name,
                                     mm_position=PlaceholderRange(offset=offset, length=length))

    def request(rid, **kw):
        return Request(rid, prompt if "prompt_embeds" not in kw else None, SamplingParams(max_tokens=1), None, **kw)

    owner = request("owner", mm_features=[image("img-x")])
    ident, why = request_identity(owner)
    assert why is None, why
    g = torch.Generator().manual_seed(0)
    layers = [{c: torch.randn(s.num_kv_heads, len(prompt), s.head_dim_k, generator=g).to(torch.bfloat16)
               for c in ("k", "v")} for s in conn.arch.layers]
    conn.kv.put_cache(chunk_cache(conn.key, layers, 0, len(prompt)), prompt, partial=True, identity=ident)
    asks = {
        "same image": request("a", mm_features=[image("img-x")]),
        "other image": request("b", mm_features=[image("img-y")]),
        "same image elsewhere": request("c", mm_features=[image("img-x", offset=320)]),
        "no image": request("d"),
        "image and salt": request("e", mm_features=[image("img-x")], cache_salt="tenant-a"),
        "prompt embeds": request("f", prompt_embeds=torch.zeros(700, 256), prompt_is_token_ids=[False] * 700),
        "missing adapter": request("g", mm_features=[image("img-x")],
                                   lora_request=LoRARequest("gone", 1, f"{store}/no-such-adapter")),
    }
    res = {name: conn.get_num_new_matched_tokens(r, 0)[0] for name, r in asks.items()}
    with open(out, "w") as f:
        json.dump({"matched": res, "counts": conn.counts.as_dict(), "memory_refusal": refusal, "default_store": default}, f)


if __name__ == "__main__":
    main()
