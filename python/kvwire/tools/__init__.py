"""Tools on top of everything else: the ``kvwire`` command (``cli``), the end-to-end
``demo``, the ``fidelity`` harness for lossy codecs and ``synth`` caches for tests and
benchmarks. Nothing below imports from here (the conformance kit sits beside it).

Not a public namespace (docs/api.md): the API is what ``kvwire`` and its public
subpackages list in ``__all__``; modules here may move between releases.
"""
