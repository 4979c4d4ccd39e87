"""``kvwire store stats|ls|inspect|gc --url URL``: look into a shared KV store and clean it.

A store shared by many inference nodes (spec/store.md) outlives every process that wrote
to it, so an operator needs to see what it holds (per model, dtype, shard, layer range,
fidelity and chunk size), check one object against its key (KVW-STORE-17) without reading
its tensors, and remove what must go: stale temporaries, corrupted objects, a model's
objects after a weight update, or the least recently used ones down to a size. Headers are
read with one ranged get of ``HEAD_BYTES`` (KVW-STORE-19); only ``--verify`` reads whole
objects. An operation a backend does not offer is refused (exit 2), never faked.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from ..store import StoreError, open_store
from ..store.auth import is_tag_key
from ..store.keys import KEY_VERSION
from ..store.local_admin import init_store
from ..store.urls import file_url
from .cliargs import count
from .store_objects import check_object, heads, parse_key, problem, sizes_of, space_dict

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
MISMATCH = "STORE_KEY_MISMATCH"  # stderr code of an object whose header disagrees with its key
DESCRIPTION = """Look into a kvwire store (spec/store.md) and clean it. URLs: file:///abs/dir,
file://rel/dir, file:///abs/dir?shared=group, memory:// (one process: always empty
here), redis://HOST:PORT/DB. No command but init ever creates a file:// store.

  stats    the backend's own figures, then objects and bytes per key root
  ls       keys with sizes; --long adds each object's token range from its header
  inspect  one object: its key parsed, its header, the KVW-STORE-17 verdict; --verify
           also checks every checksum (exit 1 when the object is bad, 2 when missing)
  gc       remove stale temporaries, and with --fingerprint / --max-bytes / --verify a
           model's objects, the least recently used ones, or the bad ones (--all: every
           one); --dry-run only says what it would remove. Only kvwire objects go
  init     create a file:// store, or adopt a directory that holds only kvwire objects

Reading a header is a get: on file:// it counts as a use for the LRU clock."""


def fingerprint_hex(text: str) -> str:
    """A compat fingerprint as in a key: 1..64 bytes of hex (upper case is lowered)."""
    t = text.lower()
    if not re.fullmatch(r"(?:[0-9a-f]{2}){1,64}", t):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fingerprint: 2 to 128 hex digits, an even number")
    return t


def configure_cli(p) -> None:
    p.description, p.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    sub = p.add_subparsers(dest="store_cmd", required=True, metavar="COMMAND")

    def command(name, help, func):
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("--url", required=True, help="the store: file:///abs/dir, file://rel/dir or memory://")
        s.set_defaults(func=_guarded(func))
        return s

    s = command("stats", "the backend's info() and objects/bytes per key root", cmd_stats)
    s.add_argument("--json", action="store_true")
    s = command("ls", "keys and their sizes", cmd_ls)
    s.add_argument("--prefix", default="", help="only keys starting with this (e.g. kvw1/<fingerprint>/)")
    s.add_argument("--long", action="store_true", help="also each object's token range (one ranged get of "
                                                       "its first 64 KiB)")
    s.add_argument("--json", action="store_true")
    s = command("inspect", "one object's key, header and KVW-STORE-17 verdict (exit 1 bad, 2 missing)",
                cmd_inspect)
    s.add_argument("key")
    s.add_argument("--verify", action="store_true", help="read the whole object and verify every checksum")
    s.add_argument("--json", action="store_true")
    s = command("init", "create a file:// store, or adopt a directory holding only kvwire objects (KVW-STORE-35)",
                cmd_init)
    s = command("gc", "remove stale temporaries, and the objects the options select", cmd_gc)
    s.add_argument("--fingerprint", type=fingerprint_hex, help="remove every object of this model (compat "
                                                               "fingerprint in hex), e.g. after a weight update")
    s.add_argument("--max-bytes", type=count, help="evict least-recently-used objects until at most N bytes "
                                                   "remain (file:// only; 0 needs --all)")
    s.add_argument("--all", action="store_true", help="remove every kvwire object (what --max-bytes 0 does; "
                                                      "file:// only)")
    s.add_argument("--verify", action="store_true", help="remove every kvw1 object failing its key checks or "
                                                         "checksums (reads every object whole; runs last)")
    s.add_argument("--dry-run", action="store_true", help="remove nothing; print what would be removed")


def _guarded(func):
    """A store that fails (StoreError: unreachable, unsupported URL, I/O) is one line, exit 2."""
    def run(args) -> int:
        try:
            if func is cmd_init:
                return cmd_init(args)
            with open_store(args.url, create=False) as store:  # only init creates a store
                return func(args, store)
        except StoreError as exc:
            print(f"kvwire store {args.store_cmd}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return run


def _text(v) -> str:
    if isinstance(v, bytes):
        return v.hex()
    return json.dumps(v) if isinstance(v, (dict, list, tuple)) else str(v)


# -- stats ------------------------------------------------------------------------------------
def cmd_stats(args, store) -> int:
    info = store.info()
    keys = store.list()
    roots: dict[str, dict[str, Any]] = {}
    other: dict[str, Any] = {"objects": 0, "bytes": 0}
    for key, size in zip(keys, sizes_of(store, keys)):
        parsed = parse_key(key)
        if parsed is None:
            g = other
        else:
            sp = parsed[0]
            g = roots.setdefault(sp.root, {"root": sp.root, **space_dict(sp, b""), "objects": 0, "tags": 0,
                                           "bytes": 0})
            g.pop("hash", None)
        g["tags" if parsed is not None and is_tag_key(key) else "objects"] += 1
        g["bytes"] += size or 0
    rows = sorted(roots.values(), key=lambda g: g["root"])
    if args.json:
        print(json.dumps({"info": info, "roots": rows, "other": other}, indent=2, default=str))
        return EXIT_OK
    print(f"{info.get('url', args.url)}: {info.get('backend', type(store).__name__)}")
    for k, v in info.items():
        if k not in ("url", "backend"):
            print(f"  {k:<20} {_text(v)}")
    print("by key root:")
    head = ("model", "dtype", "shard", "layers", "fidelity", "chunk", "objects", "tags", "bytes")
    table = [head] + [(g["fingerprint"][:12], g["dtype"], g["shard"], "{}-{}".format(*g["layers"]), g["fidelity"],
                       str(g["chunk_tokens"]), str(g["objects"]), str(g["tags"]), str(g["bytes"])) for g in rows]
    if other["objects"]:
        table.append((f"(not {KEY_VERSION})", "", "", "", "", "", str(other["objects"]), "", str(other["bytes"])))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  " + "  ".join(c.rjust(w) if i >= 6 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    if len(table) == 1:
        print("  (no objects)")
    return EXIT_OK


# -- ls ---------------------------------------------------------------------------------------
def cmd_ls(args, store) -> int:
    keys = store.list(args.prefix)
    sizes = sizes_of(store, keys)
    rows = [{"key": k, "size": s} for k, s in zip(keys, sizes)]
    if args.long:  # a tag (K.tag, KVW-AUTH-3) has no container header: listed as what it is
        found = heads(store, [k for k in keys if not is_tag_key(k)])
        for row, (_, h, _, err) in ((r, next(found)) for r in rows if not is_tag_key(r["key"])):
            if h is not None:
                row.update(first_position=h.first_position, token_count=h.token_count)
            else:
                row["error"] = err if isinstance(err, str) else err.code
        for row in rows:
            if is_tag_key(row["key"]):
                row["error"] = "tag"
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for row in rows:
        size = "-" if row["size"] is None else str(row["size"])
        if not args.long:
            print(f"{size:>10}  {row['key']}")
            continue
        a = row.get("first_position")
        span = f"[{a}, {a + row['token_count']})" if a is not None else row["error"]
        print(f"{size:>10}  {span:<18}  {row['key']}")
    return EXIT_OK


# -- inspect ----------------------------------------------------------------------------------
def cmd_inspect(args, store) -> int:
    d = check_object(store, args.key, args.verify)
    if d["missing"]:
        print(f"kvwire store inspect: error: {store.url}: no object under {args.key}", file=sys.stderr)
        return EXIT_USAGE
    bad = problem(d)
    if args.json:
        print(json.dumps({**d, "url": store.url, "ok": bad is None}, indent=2))
    else:
        _print_inspect(store, d, bad)
    if bad is not None:
        print(d["error"]["code"] if d["error"] else MISMATCH, file=sys.stderr)
        print(f"{args.key}: {bad}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _print_inspect(store, d, bad) -> None:
    k, h = d["parsed"], d["header"]
    print(f"{d['key']}: {d['size']} bytes in {store.url}")
    print(f"  key        model {k['fingerprint']}, dtype {k['dtype']}, {k['shard']}, layers "
          f"[{k['layers'][0]}, {k['layers'][1]}), {k['fidelity']}, chunks of {k['chunk_tokens']}")
    print(f"  hash       {k['hash']}")
    if h is not None:
        a = h["first_position"]
        print(f"  model      type={h['model_type']!r} id={h['model_id']!r} "
              f"compat_fingerprint={h['compat_fingerprint'] or '(none)'}")
        print(f"  tokens     [{a}, {a + h['token_count']}): {h['token_count']} from position {a}, "
              f"chunks of {h['chunk_tokens']}")
        print(f"  dtype      {h['dtype']}")
        print(f"  layers     {h['num_layers']}")
        if h["codec_specs"]:
            print(f"  codecs     {', '.join(h['codec_specs'])} (pipelines of the header)")
        p = h["prefix"]
        print("  prefix     " + ("(none)" if p is None else f"scheme {p['scheme']}, hashes {p['hashes'][:64]}"))
    if d["records"] is not None:
        print("  records    " + ", ".join(f"{n} x{c}" for n, c in d["records"].items()))
    verdict = "ok" if not d["mismatches"] else "MISMATCH: " + "; ".join(d["mismatches"])
    print(f"  verdict    KVW-STORE-17: {verdict if h is not None else 'no header: ' + bad}")
    if d["error"] is None:
        print("  checksums  " + ("verified" if d["verified"] else "not checked (--verify reads the whole object)"))
    elif h is not None:
        print(f"  checksums  FAILED: {d['error']['message']}")


# -- init -------------------------------------------------------------------------------------
def cmd_init(args) -> int:
    if not args.url.lower().startswith("file://"):
        raise StoreError(f"init makes a file:// store; {args.url.split('://')[0]}:// stores need none")
    path, query = file_url(args.url)
    done = init_store(path, **query)
    print(f"{done['url']}: " + ("created a store" if done["created"] else
                                f"adopted as a store ({done['adopted']} kvwire objects)" if done["adopted"] else
                                "already a store"))
    return EXIT_OK


# -- gc ---------------------------------------------------------------------------------------
def cmd_gc(args, store) -> int:
    backend = type(store).__name__
    if args.max_bytes == 0 and not args.all:
        print("kvwire store gc: error: --max-bytes 0 removes every object; give --all as well to empty the "
              "store on purpose", file=sys.stderr)
        return EXIT_USAGE
    if args.all:
        if args.max_bytes not in (None, 0):
            print(f"kvwire store gc: error: --all removes every object; it contradicts --max-bytes {args.max_bytes}",
                  file=sys.stderr)
            return EXIT_USAGE
        args.max_bytes = 0
    selected = args.fingerprint is not None or args.max_bytes is not None or args.verify
    if args.max_bytes is not None and not callable(getattr(store, "evict", None)):
        print(f"kvwire store gc: error: --max-bytes is not supported by {backend} ({store.url}): it has no "
              "least-recently-used eviction to a target (file:// stores have it)", file=sys.stderr)
        return EXIT_USAGE
    has_gc = callable(getattr(store, "gc", None))
    if not has_gc and not selected:
        print(f"kvwire store gc: error: removing stale temporaries is not supported by {backend} ({store.url}); "
              "give --verify, --fingerprint or --max-bytes", file=sys.stderr)
        return EXIT_USAGE
    verb = "would remove" if args.dry_run else "removed"
    gone: dict[str, int] = {}  # key -> bytes, removed (or, dry, selected) so far

    def remove(key, size, why) -> None:
        if args.dry_run or store.delete(key):
            gone[key] = size or 0
            print(f"{verb} {key} ({why})")

    if args.fingerprint is not None:  # only keys that parse as kvwire keys are ever touched
        keys = [k for k in store.list(f"{KEY_VERSION}/{args.fingerprint}/") if parse_key(k) is not None]
        for key, size in zip(keys, sizes_of(store, keys)):
            remove(key, size, f"model {args.fingerprint[:12]}")
    temps = 0
    if has_gc:
        temps = store.info().get("stale_temporaries", 0) if args.dry_run else store.gc()
        print(f"{verb} {temps} stale temporaries")
    else:
        print(f"stale temporaries: not supported by {backend}, skipped")
    if args.max_bytes is not None:  # before --verify reads objects, which would reset the LRU clock
        _evict(store, args.max_bytes, args.dry_run, gone)
    if args.verify:
        _verify_all(store, remove, gone)
    print(f"gc: {verb} {len(gone)} objects ({sum(gone.values())} bytes) and {temps} temporaries"
          + (" (dry run)" if args.dry_run else ""))
    return EXIT_OK


def _evict(store, target: int, dry: bool, gone: dict) -> None:
    keys = [k for k in store.list() if k not in gone]
    sizes = dict(zip(keys, sizes_of(store, keys)))
    total = store.total_bytes  # the kvwire objects only: other files neither count nor go (KVW-STORE-34)
    if dry:  # objects a dry run selected before are still there; the real run would have removed them
        total -= sum(gone.values())
    if total <= target:
        print(f"{total} bytes <= --max-bytes {target}: nothing to evict")
        return
    if dry:
        print(f"would evict least-recently-used objects: {total} bytes > --max-bytes {target}")
        return
    store.evict(target)
    left = set(store.list())
    for key in keys:
        if key not in left:
            gone[key] = sizes[key] or 0
            print(f"removed {key} (least recently used)")


def _verify_all(store, remove, gone: dict) -> None:
    foreign = unparsed = 0
    for key in store.list():
        if key in gone:
            continue
        if not key.startswith(KEY_VERSION + "/"):
            foreign += 1  # not a kvwire object (a shared server's other keys): left alone
            continue
        if parse_key(key) is None:  # a kvw1 key no conforming writer makes (KVW-STORE-13..16): not ours either
            unparsed += 1
            continue
        if is_tag_key(key):  # checked by keyed readers (KVW-AUTH-6); --verify holds no keys
            continue
        d = check_object(store, key, verify=True)
        bad = problem(d)
        if bad is not None and not d["missing"]:
            remove(key, d["size"], bad)
    if foreign:
        print(f"skipped {foreign} keys outside {KEY_VERSION}/ (not kvwire objects)")
    if unparsed:
        print(f"skipped {unparsed} keys under {KEY_VERSION}/ that do not parse as kvwire keys (not kvwire objects)")


__all__ = ["configure_cli"]
