"""``kvwire conformance run|crossmodel|impl``: the command-line face of the conformance kit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools.cliargs import positive, positive_float
from .drivers import CommandImpl, default_impl_argv
from .results import LEVELS
from .runner import Runner
from .vectors import find_protocol, find_vectors_root, load_vector_sets


def _levels(text: str) -> tuple:
    levels = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in levels if x not in LEVELS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown level(s) {bad}; choose from {', '.join(LEVELS)}")
    return levels


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="conformance_cmd", required=True)
    r = sub.add_parser("run", help="run the gold vectors, writer cases and producer x consumer matrix",
                       description="Drive implementations through the conformance protocol "
                                   "(conformance/PROTOCOL.md) and report per vector, per level and per matrix cell.")
    r.add_argument("--impl", action="append", metavar="CMD",
                   help="command line of an implementation of the protocol (repeatable); "
                        "default: the reference codec (`kvwire conformance impl`)")
    r.add_argument("--vectors", metavar="DIR", help="a version folder (with manifest.json) or the folder of "
                   "version folders; default: conformance/vectors of the checkout here or above, "
                   "else the copy the installed package carries")
    r.add_argument("--junit", metavar="FILE", help="write JUnit XML here")
    r.add_argument("--markdown", metavar="FILE", help="write a Markdown report here")
    r.add_argument("--levels", type=_levels, default=LEVELS, metavar="L1,L2",
                   help=f"levels to run (default: {','.join(LEVELS)})")
    r.add_argument("--select", action="append", default=[], metavar="PATTERN",
                   help="only vectors / writer cases whose id matches (glob or substring; repeatable)")
    r.add_argument("--jobs", "-j", type=positive, default=None, help="parallel commands (default: CPU count)")
    r.add_argument("--timeout", type=positive_float, default=60.0, help="seconds per command before it counts as a hang")
    r.add_argument("--no-serve", action="store_true",
                   help="one process per command even if the implementation offers `serve`")
    r.add_argument("--lenient-codes", action="store_true",
                   help="a rejection with another registry code than expected is a warning, not a failure")
    r.add_argument("--keep", metavar="DIR", help="keep the work files (writer specs, outputs) in DIR")
    r.add_argument("-q", "--quiet", action="store_true", help="print only non-passing checks and the summary")
    r.set_defaults(func=cmd_run)
    x = sub.add_parser("crossmodel", help="real tiny models of every architecture: prefill, encode, decode in a "
                                          "fresh process, continue bit-identically; compatibility verdicts",
                       description="For each tiny transformers model (conformance/README.md, 'Cross-model "
                                   "conformance suite'): encode its prefill cache, decode it in one fresh receiver "
                                   "process, require tokens and logits bit-identical to continuing from the original "
                                   "cache, and check the compatibility verdicts. Needs torch and transformers.")
    x.add_argument("--models", metavar="A,B", help="model types to run (default: every tiny model of the zoo)")
    x.add_argument("--junit", metavar="FILE", help="write JUnit XML here")
    x.add_argument("--markdown", metavar="FILE", help="write a Markdown report here")
    x.add_argument("--keep", metavar="DIR", help="keep the containers, jobs and receiver results in DIR")
    x.add_argument("--timeout", type=positive_float, default=600.0, help="seconds the receiver process may take")
    x.add_argument("-q", "--quiet", action="store_true", help="print only non-passing checks and the table")
    x.set_defaults(func=cmd_crossmodel)
    i = sub.add_parser("impl", help="the reference implementation of the protocol (the default --impl)",
                       description="decode IN.kvw OUT_DIR | encode SPEC.json OUT.kvw | validate IN.kvw | info")
    i.add_argument("args", nargs=argparse.REMAINDER)
    i.set_defaults(func=cmd_impl)


def cmd_impl(args) -> int:
    from .impl import main

    return main(args.args)


def cmd_crossmodel(args) -> int:
    from . import crossmodel as X
    from .generation import MissingDependency
    from .report import case_line, junit_xml

    def progress(c):
        if not args.quiet or c.status != "pass":
            print(case_line(c), flush=True)

    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        result = X.run_suite(models, workdir=args.keep, timeout=args.timeout, progress=progress)
    except MissingDependency as exc:
        print(exc, file=sys.stderr)
        return 2
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(X.summary_text(result))
    if args.junit:
        Path(args.junit).write_bytes(junit_xml(result.as_run()))
    if args.markdown:
        Path(args.markdown).write_text(X.markdown(result))
    return 0 if result.ok else 1


def cmd_run(args) -> int:
    from .report import case_line, junit_xml, markdown, summary_text

    root = Path(args.vectors) if args.vectors else find_vectors_root()
    if root is None:
        print("no conformance/vectors found here or above, and the installed kvwire carries none (an editable "
              "install outside its checkout?); pass --vectors DIR", file=sys.stderr)
        return 2
    protocol = find_protocol(root)
    print(f"vectors: {root}" + (f"  (protocol: {protocol})" if protocol else ""), flush=True)
    try:
        sets = load_vector_sets(root)
    except (OSError, ValueError) as exc:
        print(f"cannot load vectors: {exc}", file=sys.stderr)
        return 2
    impls = [CommandImpl(cmd, timeout=args.timeout, use_serve=not args.no_serve)
             for cmd in (args.impl or [default_impl_argv()])]

    def progress(c):
        if not args.quiet or c.status not in ("pass", "skip"):
            print(case_line(c), flush=True)

    run = Runner(impls, sets, levels=args.levels, select=args.select, jobs=args.jobs,
                 lenient_codes=args.lenient_codes, workdir=args.keep, progress=progress).run()
    print(summary_text(run))
    if args.junit:
        Path(args.junit).write_bytes(junit_xml(run))
    if args.markdown:
        Path(args.markdown).write_text(markdown(run))
    return 0 if run.ok else 1
