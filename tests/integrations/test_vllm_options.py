"""The vLLM connector's options (``kvwire.integrations.vllm_options``; docs/vllm.md,
"Configuration"): defaults, and every bad value or unknown key refused with an error that
names the valid choices, before any store is opened. No vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.integrations.vllm_options import KEYS, ConnectorOptions, connector_options
from kvwire.store import default_store_url


def test_defaults_are_the_documented_ones():
    o = connector_options(None, 16)
    assert o == ConnectorOptions(store=default_store_url())
    assert (o.chunk_tokens, o.codec, o.layerwise, o.load_threads, o.prefetch_layers, o.save_partial) == \
        (256, "raw", "auto", "auto", 2, True)
    assert o.timeout is None and o.store_options == {} and o.load_timeout == 30.0
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    table = doc[doc.index("Keys of `kv_connector_extra_config`"):doc.index("## What is shared")]
    assert sorted(k for k in KEYS) == sorted(line.split("`")[1] for line in table.splitlines()
                                             if line.startswith("| `"))


def test_given_values_are_kept():
    o = connector_options({"store": "redis://127.0.0.1:6379/0", "chunk_tokens": 512, "codec": "int8", "timeout": 10,
                           "layerwise": False, "load_threads": 3, "prefetch_layers": 4, "save_partial": False,
                           "model_fingerprint": "ab" * 32, "auth_key_file": Path("/run/k"),
                           "stats_path": "/tmp/s"}, 32)
    assert (o.chunk_tokens, o.codec, o.layerwise, o.load_threads, o.prefetch_layers, o.save_partial) == \
        (512, "int8", False, 3, 4, False)
    assert o.store_options == {"timeout": 10.0} and o.load_timeout == 40.0
    assert (o.auth_key_file, o.stats_path, o.model_fingerprint) == ("/run/k", "/tmp/s", "ab" * 32)
    assert connector_options({"store": "file:///x", "timeout": 3}, 16).store_options == {}  # files have no timeout


@pytest.mark.parametrize("extra, message", [
    ({"layerwize": False}, r"unknown kv_connector_extra_config key\(s\) \['layerwize'\].*layerwise"),
    ({"chunk_tokens": 100}, "chunk_tokens 100 must be a multiple of vLLM's block_size 16"),
    ({"chunk_tokens": "256"}, "chunk_tokens .* must be an int >= 1, not '256'"),
    ({"chunk_tokens": 256.0}, "chunk_tokens .* must be an int"),
    ({"layerwise": 1}, "layerwise must be true, false or \"auto\", not 1"),
    ({"layerwise": "yes"}, "layerwise must be true, false or \"auto\""),
    ({"load_threads": 0}, "load_threads .* must be an int >= 1, not 0"),
    ({"load_threads": True}, "load_threads .* must be an int >= 1, not True"),
    ({"load_threads": "4"}, "load_threads .* must be an int >= 1"),
    ({"prefetch_layers": 0}, "prefetch_layers .* must be an int >= 1, not 0"),
    ({"save_partial": "false"}, "save_partial must be true or false, not 'false'"),
    ({"timeout": 0}, "timeout .* must be a positive number, not 0"),
    ({"timeout": "5"}, "timeout .* must be a positive number"),
    ({"timeout": float("inf")}, "timeout .* must be a positive number"),
    ({"store": "memory://"}, "memory:// lives in one process"),
    ({"store": 5}, "store 5"),
    ({"model_fingerprint": "xyz"}, "model_fingerprint must be the weights' fingerprint in hex"),
    ({"auth_key_file": 3}, "auth_key_file must be a path, not 3"),
])
def test_bad_options_are_refused_naming_the_valid_choices(extra, message):
    with pytest.raises(ValueError, match=message):
        connector_options(extra, 16)
