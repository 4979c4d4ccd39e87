"""Authenticated store objects (spec/store.md section 11, KVW-AUTH-*): keys and tags.

Why: every check a store reader makes (XXH3 checksums, the header against the key,
KVW-STORE-17) proves that an object is well formed and claims to be the key's, not who
wrote it. Anyone who can write the store can plant a valid container with wrong tensors
under a victim's key. A deployment that gives its writers a secret key closes that: each
object gets a small companion *tag* object (``<object key>.tag``) holding an HMAC-SHA256,
under a key id, over the object's key and the SHA-256 digests of its preamble and header,
its index and each stored body; a reader holding the key serves an object only when its
tag verifies, and checks each body's digest before that body is decoded (a layer-wise
reader too). XXH3 is no defence against a forger, SHA-256 is.

Here: the ``Keyring`` (key id -> secret, from a file or the environment, never a URL),
the tag layout (``pack_tag``/``parse_tag``), the digests of a container given as the
encoder's buffers (``container_digests``) and the checks a reader makes, as the
``TagChecks`` methods that ``KVStore`` inherits (its writer and reader hooks).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import hmac
import os
import re
import stat
import struct
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from ..codecs.native import pool
from ..format.container import PREAMBLE_SIZE, TRAILER_SIZE, parse_index, parse_preamble, parse_trailer, trailer_fields
from ..format.errors import Error, FormatError
from .base import StoreError

TAG_SUFFIX = ".tag"  # the tag of object K is the object K + ".tag" (KVW-AUTH-3)
TAG_MAGIC = b"\x89KVT\r\n\x1a\n"
TAG_VERSION = 1
DOMAIN = b"kvwire store tag v1"
DIGEST = 32  # SHA-256 and HMAC-SHA256 sizes
MAX_TAG_BYTES = 65536
MAX_KEY_ID = 64
MAX_TAG_BODIES = (MAX_TAG_BYTES - 112 - MAX_KEY_ID) // DIGEST  # 2040: a store object has 1-2 bodies a layer
MIN_SECRET = 32
MAX_SECRET = 1024
MAX_KEY_FILE = 64 << 10
ENV_KEY_FILE = "KVWIRE_STORE_KEY_FILE"
ENV_KEYS = "KVWIRE_STORE_KEYS"
KEY_ID_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_KEY_ID}}}")
# not "key": that is a rediss:// URL's TLS client key file (KVW-STORE-36)
URL_KEY_PARAMETERS = ("auth", "auth_key", "auth_key_file", "auth_keys", "hmac", "keys", "secret", "tag_key")
_HEAD = struct.Struct("<8sHBBI")  # magic, version, key id length, reserved, body count
WHERE_KEYS_GO = (f"keys come from a file named by {ENV_KEY_FILE} (or the connector's auth_key_file option), or "
                 f"from {ENV_KEYS}")


class TagError(Error, ValueError):
    """A tag that does not authenticate its object, of one ``kind`` (KVW-AUTH-7):
    "missing" (no tag), "malformed" (not a tag this implementation parses), "foreign" (a
    key id this reader does not hold) or "forged" (it fails under a key this reader holds:
    a wrong HMAC, or digests that disagree with the object)."""

    code = "TAG_INVALID"

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Tag:
    """A parsed tag (KVW-AUTH-4): the key id, the digests it covers and the HMAC."""

    key_id: str
    header: bytes
    index: bytes
    bodies: tuple
    mac: bytes


def tag_key(key: str) -> str:
    """The key of object ``key``'s tag."""
    return key + TAG_SUFFIX


def is_tag_key(key: str) -> bool:
    return key.endswith(TAG_SUFFIX)


def pack_tag(tag: Tag) -> bytes:
    kid = tag.key_id.encode("ascii")
    return (_HEAD.pack(TAG_MAGIC, TAG_VERSION, len(kid), 0, len(tag.bodies)) + kid + tag.header + tag.index
            + b"".join(tag.bodies) + tag.mac)


def parse_tag(data) -> Tag:
    """Strictly the layout of KVW-AUTH-4; any other bytes are a ``TagError``."""
    data = bytes(data)
    if not _HEAD.size + 1 + 3 * DIGEST <= len(data) <= MAX_TAG_BYTES:
        raise TagError(f"a tag is {_HEAD.size + 1 + 3 * DIGEST} to {MAX_TAG_BYTES} bytes, not {len(data)}")
    magic, version, n, reserved, m = _HEAD.unpack_from(data)
    if magic != TAG_MAGIC or version != TAG_VERSION or reserved:
        raise TagError("not a version-1 tag (magic, version or reserved byte)")
    if not 1 <= n <= MAX_KEY_ID or m > MAX_TAG_BODIES or len(data) != _HEAD.size + n + DIGEST * (m + 3):
        raise TagError(f"tag length {len(data)} disagrees with its key id length {n} and body count {m}")
    kid = data[_HEAD.size:_HEAD.size + n].decode("ascii", "replace")
    if not KEY_ID_RE.fullmatch(kid):
        raise TagError("a tag's key id is 1-64 characters of [A-Za-z0-9._-]")
    d = [data[i:i + DIGEST] for i in range(_HEAD.size + n, len(data), DIGEST)]
    return Tag(kid, d[0], d[1], tuple(d[2:-1]), d[-1])


def tag_message(object_key: str, tag_prefix: bytes) -> bytes:
    """What the HMAC covers (KVW-AUTH-5): the domain, the object's key and the tag's bytes
    before the HMAC, each prefixed with its length (u32 little-endian)."""
    parts = (DOMAIN, object_key.encode("ascii"), bytes(tag_prefix))
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


class _Bytes:
    """A container given as a list of buffers (the encoder's, unjoined): ranges gathered
    or hashed without joining the whole."""

    def __init__(self, bufs):
        self.views = [memoryview(b).cast("B") for b in bufs]
        self.starts = [0]
        for v in self.views:
            self.starts.append(self.starts[-1] + v.nbytes)
        self.size = self.starts[-1]

    def pieces(self, a: int, b: int):
        if not 0 <= a <= b <= self.size:
            raise TagError(f"range {a}..{b} outside the object's {self.size} bytes")
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while a < b:
            s = self.starts[i]
            v = self.views[i]
            j = min(b, s + v.nbytes)
            if j > a:
                yield v[a - s:j - s]
            a, i = max(a, j), i + 1

    def gather(self, a: int, b: int) -> bytes:
        return b"".join(self.pieces(a, b))

    def sha256(self, a: int, b: int) -> bytes:
        h = hashlib.sha256()
        for p in self.pieces(a, b):
            h.update(p)
        return h.digest()


PARALLEL_BYTES = 4 << 20  # below this much to hash, threads cost more than they save


def digests_of(spans, digest) -> list:
    """``[digest(a, b) for a, b in spans]``, on the shared worker threads when there is
    enough to hash: hashlib releases the GIL for large buffers, and SHA-256 over every
    stored byte is what authentication costs (KVW-AUTH-5, 6)."""
    spans = list(spans)
    threads = os.cpu_count() or 1  # one pool, kept (native.pool)
    if threads < 2 or len(spans) < 2 or sum(b - a for a, b in spans) < PARALLEL_BYTES:
        return [digest(a, b) for a, b in spans]
    return list(pool(threads).map(lambda ab: digest(*ab), spans))


def container_digests(bufs) -> tuple[bytes, bytes, list]:
    """(SHA-256 of preamble and header, of the index, [of each stored body in index
    order]) of a file-form container given as one buffer or a list of them."""
    try:
        c = _Bytes([bufs] if isinstance(bufs, (bytes, bytearray, memoryview, np.ndarray)) else bufs)
        _, hlen, _ = parse_preamble(c.gather(0, min(c.size, PREAMBLE_SIZE)))
        if c.size < PREAMBLE_SIZE + hlen + TRAILER_SIZE:
            raise TagError("too short for a file-form container")
        index_offset, index_length = trailer_fields(c.gather(c.size - TRAILER_SIZE, c.size))
        if not PREAMBLE_SIZE <= index_offset <= c.size - TRAILER_SIZE:
            raise TagError("no file-form trailer")
        _, index = parse_trailer(c.gather(index_offset, c.size), base=index_offset)
        records = parse_index(index)
    except FormatError as exc:
        raise TagError(f"not a file-form container: {exc}") from None
    bodies = digests_of(((int(o), int(o) + int(n)) for o, n in zip(records["offset"], records["stored_length"])),
                        c.sha256)
    return c.sha256(0, PREAMBLE_SIZE + hlen), hashlib.sha256(index).digest(), bodies


class Keyring:
    """Key ids and secrets (KVW-AUTH-1): a writer tags with the first (current) key, a
    reader accepts a tag under any of them (rotation: add the new key second, then make it
    first everywhere, then drop the old one). ``repr`` shows key ids, never secrets."""

    def __init__(self, keys):
        """``keys``: ``(key_id, secret bytes)`` pairs or a dict, the current key first."""
        items = list(keys.items() if isinstance(keys, dict) else keys)
        if not items:
            raise ValueError("a Keyring needs at least one (key_id, secret) pair")
        self.secrets: dict = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"a Keyring takes (key_id, secret) pairs, not {type(item).__name__}")
            kid, secret = item
            if not isinstance(kid, str) or not KEY_ID_RE.fullmatch(kid):
                raise ValueError(f"key id {str(kid)[:80]!r}: 1-{MAX_KEY_ID} characters of [A-Za-z0-9._-]")
            if not isinstance(secret, (bytes, bytearray)) or not MIN_SECRET <= len(secret) <= MAX_SECRET:
                raise ValueError(f"key {kid!r}: a secret is {MIN_SECRET} to {MAX_SECRET} random bytes "
                                 "(python -c 'import secrets; print(secrets.token_hex(32))')")
            if kid in self.secrets:
                raise ValueError(f"key id {kid!r} appears twice")
            self.secrets[kid] = bytes(secret)
        self.current = items[0][0]

    def __repr__(self) -> str:
        return f"Keyring(current={self.current!r}, key_ids={list(self.secrets)!r})"

    # -- sources (KVW-AUTH-2) ------------------------------------------------------------
    @classmethod
    def from_text(cls, text: str, source: str = "keys") -> Keyring:
        """Entries ``<key id> <secret>`` (hex, or ``base64:`` then standard base64), one a
        line (or separated by commas); blank lines and ``#`` comments are skipped."""
        pairs = []
        for n, line in enumerate(re.split(r"[\n,]", text), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise StoreError(f"{source}: entry {n} is not '<key id> <secret>'")
            pairs.append((parts[0], _secret(parts[1], f"{source}: key {parts[0][:64]!r}")))
        if not pairs:
            raise StoreError(f"{source}: no keys (entries '<key id> <hex secret>')")
        try:
            return cls(pairs)
        except ValueError as exc:
            raise StoreError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path) -> Keyring:
        """A key file: a regular file readable by its owner alone (mode 0600 or 0400)."""
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreError(f"key file {path!r}: cannot open it: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"key file {path!r} is not a regular file")
            if st.st_mode & 0o077:
                raise StoreError(f"key file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group and others "
                                 f"must have no access to secrets (chmod 600 {path})")
            if st.st_size > MAX_KEY_FILE:
                raise StoreError(f"key file {path!r} is {st.st_size} bytes, more than a key file's {MAX_KEY_FILE}")
            data = os.read(fd, MAX_KEY_FILE + 1)
        finally:
            os.close(fd)
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise StoreError(f"key file {path!r} is not ASCII text") from None
        return cls.from_text(text, f"key file {path!r}")

    @classmethod
    def load(cls, key_file=None, environ=None) -> Keyring | None:
        """The keyring a process is configured with: ``key_file`` when given, else the file
        named by ``KVWIRE_STORE_KEY_FILE``, else ``KVWIRE_STORE_KEYS``; None when none is set
        (no authentication). Setting both variables is refused."""
        env = os.environ if environ is None else environ
        if key_file is not None:
            return cls.from_file(key_file)
        if env.get(ENV_KEY_FILE) and env.get(ENV_KEYS):
            raise StoreError(f"both {ENV_KEY_FILE} and {ENV_KEYS} are set: set one")
        if env.get(ENV_KEY_FILE):
            return cls.from_file(env[ENV_KEY_FILE])
        if env.get(ENV_KEYS):
            return cls.from_text(env[ENV_KEYS], ENV_KEYS)
        return None

    # -- tags ----------------------------------------------------------------------------
    def tag(self, object_key: str, bufs) -> bytes:
        """The tag of the container ``bufs`` (one buffer or the encoder's list) stored
        under ``object_key``, made with the current key."""
        header, index, bodies = container_digests(bufs)
        if len(bodies) > MAX_TAG_BODIES:
            raise ValueError(f"an object of {len(bodies)} bodies cannot be tagged (at most {MAX_TAG_BODIES})")
        prefix = pack_tag(Tag(self.current, header, index, tuple(bodies), b""))
        return prefix + hmac.new(self.secrets[self.current], tag_message(object_key, prefix), "sha256").digest()

    def open(self, object_key: str, data) -> Tag:
        """The tag ``data`` of ``object_key``, its HMAC verified (KVW-AUTH-6), else TagError."""
        if data is None:
            raise TagError("no tag", "missing")
        t = parse_tag(data)
        secret = self.secrets.get(t.key_id)
        if secret is None:
            raise TagError(f"tag under key id {t.key_id!r}, which this reader does not hold", "foreign")
        want = hmac.new(secret, tag_message(object_key, bytes(data)[:-DIGEST]), "sha256").digest()
        if not hmac.compare_digest(want, t.mac):
            raise TagError(f"tag HMAC under key {t.key_id!r} does not verify", "forged")
        return t


def _secret(text: str, where: str) -> bytes:
    try:
        if text.startswith("base64:"):
            return base64.b64decode(text[7:], validate=True)
        if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", text):
            return bytes.fromhex(text)
    except ValueError:
        pass
    raise StoreError(f"{where}: the secret is neither hex nor base64:<standard base64>")


def check_url(url: str) -> None:
    """KVW-AUTH-2: a store URL never carries keys; one with a key-like parameter is refused
    (its value is not repeated in the message)."""
    try:
        names = {n.lower() for n, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
    except ValueError:
        return  # not a URL this module judges; open_store refuses it
    bad = sorted(names & set(URL_KEY_PARAMETERS))
    if bad:
        raise StoreError(f"store URL parameter {bad[0]!r}: keys are never taken from a URL (URLs appear in logs "
                         f"and process lists); {WHERE_KEYS_GO}")


__all__ = ["ENV_KEYS", "ENV_KEY_FILE", "Keyring", "MAX_TAG_BYTES", "TAG_SUFFIX", "Tag", "TagError", "check_url",
           "container_digests", "digests_of", "is_tag_key", "pack_tag", "parse_tag", "tag_key", "tag_message"]
