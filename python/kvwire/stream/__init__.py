"""Transport: layer-wise streaming, decode-phase segments, multi-target writes, statistics.

Everything here is a thin I/O layer over the sans-IO ``Encoder`` and ``StreamDecoder``;
no container byte is parsed or built outside them.

* ``LayerWriter(sink, header)``: the header goes out at once, then each layer as the producer
  hands it over (``write_layer``), as zero-copy ``sendmsg`` / ``writev`` of the caller's
  tensor memory from a background thread, so sending layer i overlaps computing i+1.
* ``LayerReader(source)``: yields each layer, in layer order, as soon as its chunks have
  arrived and been verified. Bodies are received with ``recvmsg_into`` / ``readv``
  straight into one preallocated (optionally pinned) buffer carved into the layer
  tensors; a receive thread works up to ``prefetch`` layers ahead of the consumer.
* ``DecodeWriter``: decode-phase tokens accumulate until a cell of the chunk grid is
  full and go out as one *segment* container (spec KVW-STREAM-4); ``flush()`` sends the
  partial tail, which the next segment of the same cell supersedes (KVW-STREAM-6).
  ``read_segments`` and ``Reassembler`` are the receiving side.
* ``SharedBuffers`` / ``fanout``: one encoded container written to several sinks (file,
  socket, ``MemorySink``) from the same buffers, reference counted, never copied.
* ``timeout=`` on ``LayerReader``, ``LayerWriter`` and ``fanout``: the longest a stalled peer may
  keep a transport call waiting; then ``StreamTimeout`` (a ``TimeoutError``).
* ``TransferStats``: bytes, wall time, GB/s and utilization of a declared link bandwidth,
  on every reader and writer; ``MemorySink`` counts lookup hits and misses.

Sinks: a socket, a file descriptor, an object with ``fileno()`` (file, pipe), or one with
``write()``. Sources: a socket, a file descriptor, an unbuffered file (``readv``) or an
object with ``readinto()``.

The public API is what ``__all__`` lists. ``Reader``, ``Writer`` and ``MemoryStore`` are
deprecated names of ``LayerReader``, ``LayerWriter`` and ``MemorySink`` (they said the
same as ``kvwire.Reader``, the container reader, and ``kvwire.store.MemoryStore``, a
backend of the store protocol); they still work and warn (``DeprecationWarning``).
"""


from ..deprecation import former_names
from .fanout import MemorySink, SharedBuffers, encode_shared, fanout
from .reader import Layer, LayerReader, Placed, SparseNotSupported
from .segments import DecodeWriter, Reassembler, read_segments
from .transport import StreamTimeout, TransferStats
from .writer import LayerWriter

__all__ = [
    "DecodeWriter", "Layer", "LayerReader", "LayerWriter", "MemorySink", "Placed", "Reassembler", "SharedBuffers",
    "SparseNotSupported", "StreamTimeout", "TransferStats", "encode_shared", "fanout", "read_segments",
]

_RENAMED = {"Reader": "LayerReader", "Writer": "LayerWriter", "MemoryStore": "MemorySink"}  # old -> new


def _moved(name: str) -> tuple[object, str] | None:
    new = _RENAMED.get(name)
    return None if new is None else (globals()[new], f"kvwire.stream.{new} (the same class)")


__getattr__ = former_names(__name__, _moved)  # the deprecated names, with a DeprecationWarning
