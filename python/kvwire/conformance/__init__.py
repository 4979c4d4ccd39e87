"""The kvwire conformance kit: gold vectors, a runner for any implementation, and the
reference implementation of its subprocess protocol.

* ``neutral`` — the neutral JSON model: formats and the header <-> JSON mapping (JSON
  twins, decode output, encode input); ``digests`` — canonical tensor bytes and their
  SHA-256; ``compare`` — a reported decode output against a twin.
* ``impl`` — ``kvwire conformance impl``: the reference codec behind the protocol.
* ``runner`` — ``kvwire conformance run``: reader, writer and round-trip levels and the
  producer x consumer matrix; ``vectors`` loads the gold vectors, ``drivers`` drives an
  implementation (subprocess protocol or in-process reference), ``levels`` judges one
  case, ``results`` holds the verdicts.
* ``report`` — console summary, JUnit XML and Markdown.
* ``crossmodel`` — ``kvwire conformance crossmodel``: real tiny models of every
  architecture, decoded in a fresh process, continue bit-identically (needs transformers);
  ``crossmodel_receiver`` is that process, ``crossmodel_checks`` its checks, ``generation``
  runs the models (also for ``kvwire demo``).

The vectors themselves live in the source tree (``conformance/vectors/<version>/``);
``conformance/PROTOCOL.md`` is the normative description of the protocol. A wheel carries
both as package data (``data/``, copied there by setup.py), so the kit runs from an
installed package with no checkout; a checkout's copy is found first.
"""

from .drivers import CommandImpl, ReferenceImpl, default_impl_argv
from .results import RunResult
from .runner import Runner
from .vectors import load_vector_sets

__all__ = ["CommandImpl", "ReferenceImpl", "Runner", "RunResult", "default_impl_argv", "load_vector_sets"]
