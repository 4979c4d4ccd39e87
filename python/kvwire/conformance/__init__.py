"""The kvwire conformance kit: gold vectors, a runner for any implementation, and the
reference implementation of its subprocess protocol.

* ``neutral`` — the neutral JSON model (JSON twins, decode output, encode input).
* ``impl`` — ``kvwire conformance impl``: the reference codec behind the protocol.
* ``runner`` — ``kvwire conformance run``: reader, writer and round-trip levels and the
  producer x consumer matrix.
* ``report`` — console summary, JUnit XML and Markdown.
* ``crossmodel`` — ``kvwire conformance crossmodel``: real tiny models of every
  architecture, decoded in a fresh process, continue bit-identically (needs transformers).

The vectors themselves live in the source tree (``conformance/vectors/<version>/``);
``conformance/PROTOCOL.md`` is the normative description of the protocol.
"""

from .runner import CommandImpl, ReferenceImpl, Runner, RunResult, default_impl_argv, load_vector_sets

__all__ = ["CommandImpl", "ReferenceImpl", "Runner", "RunResult", "default_impl_argv", "load_vector_sets"]
