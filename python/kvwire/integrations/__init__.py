"""kvwire inside inference engines: connectors that engines load by name.

``kvwire.integrations.vllm.KVWireConnector`` is a vLLM v1 KV connector
(``--kv-transfer-config '{"kv_connector": "KVWireConnector", "kv_connector_module_path":
"kvwire.integrations.vllm", ...}'``) that stores and loads prompt prefixes through
``kvwire.store``. Each connector module imports its engine; this package imports nothing,
so ``import kvwire`` never pulls an engine in.
"""
