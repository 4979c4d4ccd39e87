"""The helpers a ranged reader (a store's layer-wise loader) uses to find the index of a
file-form container from its end, and the bounds that keep a hostile trailer from making
it allocate (kvwire.format.container: trailer_fields, file_size, tail_bound, size_bound)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire.format.container import (
    FRAME_SIZE,
    TRAILER_SIZE,
    file_size,
    max_records,
    parse_trailer,
    size_bound,
    tail_bound,
    tensor_bytes_per_token,
    trailer_fields,
)
from kvwire.format.errors import TruncatedError


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 70), layers=st.integers(1, 3), codec=st.sampled_from(["raw", "zstd"]),
       seed=st.integers(0, 3))
def test_the_tail_and_the_bounds_hold_for_every_real_container(tokens, layers, codec, seed):
    """For any file-form container: the trailer's fields are parse_trailer's, file_size is
    the container's size, the end frame, index and trailer fit in tail_bound, and the
    whole container in size_bound."""
    cache = forge.small_cache(layers=layers, tokens=tokens, seed=seed)
    data = kvwire.encode(cache, form="file", codec=codec)
    r = kvwire.Reader(data)
    off, length = trailer_fields(data)
    assert trailer_fields(data[-TRAILER_SIZE:]) == (off, length)
    index_offset, index = parse_trailer(data)
    assert (off, length) == (index_offset, len(index)) and file_size(off, length) == len(data)
    assert len(r.records) <= max_records(r.header)
    assert len(data) - (off - FRAME_SIZE) <= tail_bound(r.header)
    first = len(data) - sum(int(n) for n in r.records["stored_length"])  # structure bytes, at most
    assert len(data) <= size_bound(r.header, first)
    assert tensor_bytes_per_token(r.header) * r.header.token_count == cache.nbytes


def test_a_tail_shorter_than_a_trailer_is_truncated():
    with pytest.raises(TruncatedError) as exc:
        trailer_fields(b"\0" * (TRAILER_SIZE - 1))
    assert exc.value.needed == TRAILER_SIZE
