"""Framework adapters: convert between a framework's in-memory cache and ``kvwire.KVCache``.

``kvwire.adapters.hf``: Hugging Face transformers 5.x (``from_hf``, ``to_hf``,
``arch_from_config``, ``identity``); ``kvwire.adapters.zoo``: tiny offline models of each
supported architecture for tests and demos. Neither imports transformers or torch until
one of its functions is called, so ``import kvwire`` stays light.
"""
