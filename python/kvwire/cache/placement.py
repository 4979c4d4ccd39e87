"""Where a ``StreamDecoder``'s chunk bodies land: placements and the read-into input style.

``PlacementMixin`` holds the part of ``StreamDecoder`` (``cache.decoder``) that decides
the destination of each body: ``_place`` asks the caller's ``placement`` callback for
the tensor (or ``Placed`` buffers) a chunk goes to and checks it, in either input style;
``read_targets`` / ``filled`` are the read-into style, which names the exact buffers the
next bytes must go to (a raw body straight into its placement) so that a transport can
``recv_into`` / ``readv`` into them and never read past the end frame. The mixin holds
no state of its own: the attributes it uses are set up by ``StreamDecoder.__init__``,
and the state machine it drives (``_advance``, ``_append``) is the decoder's.

The record field indices (``REC_*``) are shared with the state machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format import registry as R
from ..format.container import FRAME_SIZE, PREAMBLE_SIZE, next_frame_offset
from ..format.header import Header
from .events import Placed
from .tensors import as_numpy, as_uint

# Fields of RECORD_STRUCT (RECORD_DTYPE order): offset, stored_length, raw_length, checksum, token_start,
# token_count, layer, component, codec, flags, head_start, head_count, reserved0, reserved1
REC_OFFSET, REC_STORED, REC_RAW, REC_CHECKSUM, REC_T0, REC_COUNT, REC_LAYER, REC_COMP, REC_CODEC = range(9)
REC_HEAD0, REC_HEADS = 10, 11
REC_SPEC = 12  # reserved0: codec_spec with the codec_specs feature (spec/codecs.md)
IOV_MAX = 1024  # most buffers one readv / recvmsg_into call accepts on Linux
TAIL_READ = 64 << 10  # read size after the end frame while looking for a file-form tail
BODY_FIRST = 4 << 20  # first receive buffer of a compressed body; it doubles as its bytes arrive (KVW-LIM-8)


def head_pieces(x) -> list:
    """Writable byte views of an array whose heads each have contiguous rows."""
    u = as_uint(as_numpy(x))
    if u.flags.c_contiguous:
        return [u.data.cast("B")]
    return [u[i].data.cast("B") for i in range(u.shape[0])]


class PlacementMixin:
    """Placement and read-into input of ``StreamDecoder``; the state and the state machine are the decoder's."""

    # the decoder's state, set up by StreamDecoder.__init__ (described there)
    placement: Callable[[int, str, int, int], Any] | None
    header: Header | None
    _mode: str | None
    _pending: deque
    _scratch: bytearray
    _dst: Any
    _dst_pieces: list | None
    _pieces: list | None
    _got: int
    _cap: int
    _base: int
    _pos: int
    _state: str
    _hlen: int
    _rec: tuple | None
    _records: bytearray

    if TYPE_CHECKING:  # the decoder's state machine and input
        def _advance(self) -> Any: ...
        def _append(self, data) -> None: ...
        def _set_mode(self, mode: str) -> None: ...
        @property
        def received(self) -> int: ...

    def _place(self, rec) -> tuple:
        """(data, pieces or None) of the placement for this record, or (None, None)."""
        if self.placement is None:
            return None, None
        h = self.header
        assert h is not None  # a record comes after the header
        if h.sparse is not None:
            raise ValueError("placement is not supported for sparse containers (chunks hold one head each)")
        layer, comp = rec[REC_LAYER], R.COMPONENT_BY_CODE[rec[REC_COMP]]
        t0, n = rec[REC_T0], rec[REC_COUNT]
        dst = self.placement(layer, comp, t0, n)
        if dst is None:
            return None, None
        if isinstance(dst, Placed):
            if sum(p.nbytes for p in dst.pieces) != rec[REC_RAW]:
                raise ValueError(f"placement pieces for layer {layer} {comp} tokens {t0}+{n} do not hold "
                                 f"{rec[REC_RAW]} bytes")
            return dst.data, list(dst.pieces)
        x = as_numpy(dst)
        shape = h.arch.layers[layer].shape(comp, n)
        if tuple(x.shape) != shape or x.dtype != R.DTYPES[h.dtype][2]:
            raise ValueError(f"placement for layer {layer} {comp} tokens {t0}+{n}: {tuple(x.shape)} {x.dtype}, "
                             f"need {shape} {h.dtype}")
        if not x.flags.writeable or (x.shape[0] and not x[0].flags.c_contiguous):  # heads share strides
            raise ValueError("placement arrays must be writable with each head's rows contiguous")
        return dst, None

    def _receive_body(self, rec) -> None:
        """Where the body of ``rec`` is received in the read-into style. A raw body goes
        straight into its placement, or into a buffer of ``raw_length`` (bounded by
        KVW-LIM-4 and the running KVW-LIM-5 sum, both checked) that its event owns. A
        compressed body's ``stored_length`` is bounded by no limit, so its buffer starts at
        ``BODY_FIRST`` bytes at most and doubles only when full (``_grow_body``): memory
        follows the bytes that arrived, never the declared length (KVW-LIM-8)."""
        stored = rec[REC_STORED]
        if rec[REC_CODEC] == 0:
            if self._dst is not None:  # raw: straight into place
                if self._dst_pieces is None:
                    self._dst_pieces = head_pieces(self._dst)
                self._pieces = self._dst_pieces
            else:  # np.empty: pages are committed only as the bytes land
                self._pieces = [np.empty(stored, np.uint8).data]
            self._cap = stored
        else:
            self._cap = min(stored, BODY_FIRST)
            self._pieces = [np.empty(self._cap, np.uint8).data]
        self._got = 0

    def _grow_body(self) -> None:
        """The full receive buffer of a compressed body, doubled (at most to its ``stored_length``)."""
        assert self._pieces is not None and self._rec is not None  # a compressed body being received
        old = self._pieces[0]
        self._cap = min(self._rec[REC_STORED], 2 * self._cap)
        new = np.empty(self._cap, np.uint8).data
        new[: self._got] = old[: self._got]
        self._pieces = [new]
        old.release()

    def read_targets(self) -> list:
        """Writable buffers that the next input bytes must fill, in order (at most IOV_MAX).

        Their total is what the decoder needs next, never more; an empty list means the
        container is complete (``stop_at_end``) or closed. After a transport call wrote
        ``n`` bytes into them, call ``filled(n)``, then take ``events()``.
        """
        self._set_mode("into")
        while True:
            if self._state in ("done", "closed"):
                return []
            if self._state == "tail":
                if len(self._scratch) < TAIL_READ:
                    self._scratch = bytearray(TAIL_READ)
                return [memoryview(self._scratch)]
            if self._state == "body" and self._pieces is not None:
                rec = self._rec
                assert rec is not None and self.header is not None  # in a body
                if self._got == self._cap < rec[REC_STORED]:
                    self._grow_body()
                targets = self._remaining_pieces()
                if len(targets) < IOV_MAX and self._cap == rec[REC_STORED]:
                    # read ahead: padding and the next frame always follow a body
                    end = rec[REC_OFFSET] + rec[REC_STORED]
                    ahead = next_frame_offset(end, self.header.alignment) + FRAME_SIZE - end
                    if len(self._scratch) < ahead:
                        self._scratch = bytearray(ahead)
                    targets.append(memoryview(self._scratch)[:ahead])
                return targets
            need = self._needed() - self.received
            if need > 0:
                if len(self._scratch) < need:
                    self._scratch = bytearray(need)
                return [memoryview(self._scratch)[:need]]
            ev = self._advance()  # the bytes for the current step are here: advance
            if ev is not None:
                self._pending.append(ev)

    def filled(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffers of the last ``read_targets()``."""
        if self._mode != "into":
            raise RuntimeError("filled() without read_targets()")
        if nbytes < 0:
            raise ValueError("negative byte count")
        if self._state == "body" and self._pieces is not None:
            body = min(nbytes, self._cap - self._got)
            self._got += body
            self._base += body  # body bytes bypass _buf, which is empty here
            nbytes -= body  # the rest went to the read-ahead at the start of the scratch buffer
        if nbytes:
            self._append(memoryview(self._scratch)[:nbytes])

    def _needed(self) -> int:
        """Absolute offset up to which the current step needs input."""
        if self._state == "preamble":
            return PREAMBLE_SIZE
        if self._state == "header":
            return PREAMBLE_SIZE + self._hlen
        if self._state == "frame":
            assert self.header is not None  # frames follow the header
            return next_frame_offset(self._pos, self.header.alignment) + FRAME_SIZE
        if self._state == "body":
            assert self._rec is not None  # set with the state
            return self._rec[REC_OFFSET] + self._rec[REC_STORED]
        raise AssertionError(self._state)

    def waiting_for(self) -> str:
        """What the decoder needs next, in words (for a transport's timeout message)."""
        state = self._state
        if state in ("preamble", "header"):
            need = self._needed()
            return f"the {state} (bytes {min(self.received, need)} of {need})"
        if state == "frame":
            return f"the frame after {len(self._records) // 56} chunk frames"
        if state == "body":
            rec = self._rec
            assert rec is not None  # set with the state
            got = self.received - rec[REC_OFFSET]
            return (f"the body of chunk layer {rec[REC_LAYER]} {R.COMPONENT_BY_CODE[rec[REC_COMP]]} tokens "
                    f"{rec[REC_T0]}+{rec[REC_COUNT]} ({got} of {rec[REC_STORED]} bytes)")
        if state == "tail":
            return "a file-form tail or the end of input"
        return "nothing (the container is complete)"

    def _remaining_pieces(self) -> list:
        assert self._pieces is not None  # in a body, "into" mode
        if not self._got and len(self._pieces) < IOV_MAX:
            return list(self._pieces)
        out, skip = [], self._got
        for p in self._pieces:
            if skip >= p.nbytes:
                skip -= p.nbytes
                continue
            out.append(p[skip:])
            skip = 0
            if len(out) == IOV_MAX:
                break
        return out
