"""Transport: layer-wise streaming, decode-phase segments, multi-target writes, statistics.

Everything here is a thin I/O layer over the sans-IO ``Encoder`` and ``StreamDecoder``;
no container byte is parsed or built outside them.

* ``Writer(sink, header)``: the header goes out at once, then each layer as the producer
  hands it over (``write_layer``), as zero-copy ``sendmsg`` / ``writev`` of the caller's
  tensor memory from a background thread, so sending layer i overlaps computing i+1.
* ``Reader(source)``: yields each layer, in layer order, as soon as its chunks have
  arrived and been verified. Bodies are received with ``recvmsg_into`` / ``readv``
  straight into one preallocated (optionally pinned) buffer carved into the layer
  tensors; a receive thread works up to ``prefetch`` layers ahead of the consumer.
* ``DecodeWriter``: decode-phase tokens accumulate until a cell of the chunk grid is
  full and go out as one *segment* container (spec KVW-STREAM-4); ``flush()`` sends the
  partial tail, which the next segment of the same cell supersedes (KVW-STREAM-6).
  ``read_segments`` and ``Reassembler`` are the receiving side.
* ``SharedBuffers`` / ``fanout``: one encoded container written to several sinks (file,
  socket, ``MemoryStore``) from the same buffers, reference counted, never copied.
* ``timeout=`` on ``Reader``, ``Writer`` and ``fanout``: the longest a stalled peer may
  keep a transport call waiting; then ``StreamTimeout`` (a ``TimeoutError``).
* ``TransferStats``: bytes, wall time, GB/s and utilization of a declared link bandwidth,
  on every reader and writer; ``MemoryStore`` counts lookup hits and misses.

Sinks: a socket, a file descriptor, an object with ``fileno()`` (file, pipe), or one with
``write()``. Sources: a socket, a file descriptor, an unbuffered file (``readv``) or an
object with ``readinto()``.
"""

from .fanout import MemoryStore, SharedBuffers, encode_shared, fanout
from .segments import DecodeWriter, Reassembler, read_segments
from .reader import Layer, Placed, Reader, SparseNotSupported
from .transport import StreamTimeout, TransferStats
from .writer import Writer

__all__ = [
    "DecodeWriter", "Layer", "MemoryStore", "Placed", "Reader", "Reassembler", "SharedBuffers", "StreamTimeout",
    "SparseNotSupported", "TransferStats",
    "Writer", "encode_shared", "fanout", "read_segments",
]
