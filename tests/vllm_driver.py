"""One real vLLM engine run for tests/integrations/test_vllm_e2e.py, in the vLLM venv (.venv-vllm).

    .venv-vllm/bin/python tests/vllm_driver.py SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[token ids]], "connector": null | {extra config},
"kv_connector": "KVWireConnector" (default) or "ExampleConnector", "one_by_one": false,
"pause_after": n (with one_by_one: before prompt n, touch "pause_flag" and wait for "resume_flag"),
"max_tokens": 8, "wait_for": path or null (start the engine, then wait for this file
before generating: a consumer running beside its producer), "done": path or null (touch
after generating), "engine": {extra LLM keywords, e.g. enable_lora}}. A prompt is a list of
token ids or {"prompt_token_ids": [...], "cache_salt": str, "lora": [name, id, path],
"embeds": n (n random prompt embeddings instead of tokens)}. OUT: {"outputs": [{"tokens": [...], "num_cached_tokens": n}],
"seconds": generate time, "ttft": [per-prompt seconds of a 1-token run when asked], "spans": [per-prompt
(start, end) on the machine's monotonic clock, one_by_one only]}. "kv_connector_module": the module
of the kv_connector class instead of vLLM's registry (benchmarks time connectors this way).
"""

import json
import os
import sys
import time


def prompt_of(p, hidden: int):
    """(vLLM prompt, LoRARequest or None) of one spec prompt."""
    if isinstance(p, list):
        return {"prompt_token_ids": p}, None
    if "embeds" in p:
        import torch

        return {"prompt_embeds": torch.randn(p["embeds"], hidden, generator=torch.Generator().manual_seed(0))}, None
    out = {"prompt_token_ids": p["prompt_token_ids"]}
    if p.get("cache_salt"):
        out["cache_salt"] = p["cache_salt"]
    lora = None
    if p.get("lora"):
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(*p["lora"])
    return out, lora


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("connector") is not None:
        name = spec.get("kv_connector", "KVWireConnector")  # or vLLM's own "ExampleConnector" (benchmarks)
        path = {"kv_connector_module_path": "kvwire.integrations.vllm"} if name == "KVWireConnector" else {}
        if spec.get("kv_connector_module"):  # another module's class (benchmarks/vllm_timed_connectors.py)
            path = {"kv_connector_module_path": spec["kv_connector_module"]}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"], **path)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
              max_model_len=spec.get("max_model_len", 2048), enforce_eager=True, block_size=32,
              enable_prefix_caching=spec.get("prefix_caching", False),
              **({"max_num_batched_tokens": spec["max_num_batched_tokens"]} if "max_num_batched_tokens" in spec else {}),
              **spec.get("engine", {}), **kw)
    hidden = json.load(open(os.path.join(spec["model"], "config.json")))["hidden_size"]
    if spec.get("wait_for"):
        deadline = time.time() + 600
        while not os.path.exists(spec["wait_for"]):
            if time.time() > deadline:
                raise SystemExit("timed out waiting for " + spec["wait_for"])
            time.sleep(0.2)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, detokenize=False)
    outputs, ttft, spans = [], [], []
    t0 = time.perf_counter()
    if spec.get("one_by_one"):
        for n, p in enumerate(spec["prompts"]):
            if n == spec.get("pause_after"):  # let the test break something mid-run, then go on
                open(spec["pause_flag"], "w").close()
                while not os.path.exists(spec["resume_flag"]):
                    time.sleep(0.1)
            a, span0 = time.perf_counter(), time.monotonic()
            prompt, lora = prompt_of(p, hidden)
            o = llm.generate([prompt], params, use_tqdm=False, **({"lora_request": lora} if lora else {}))[0]
            ttft.append(time.perf_counter() - a)
            spans.append((span0, time.monotonic()))
            outputs.append(o)
    else:
        outputs = llm.generate([prompt_of(p, hidden)[0] for p in spec["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    out = {"outputs": [{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                       for o in outputs], "seconds": seconds, "ttft": ttft, "spans": spans}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    if spec.get("done"):
        open(spec["done"], "w").close()


if __name__ == "__main__":
    main()
