"""Round trip through both forms and both core codecs."""

import numpy as np
import pytest

import kvwire
from kvwire.tools.synth import synth_cache


@pytest.mark.parametrize("form", ["file", "stream"])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_round_trip(form, codec):
    cache = synth_cache(3, 2, 16, 300, chunk_tokens=128, seed=1)
    data = kvwire.encode(cache, form=form, codec=codec)
    with kvwire.open(data) as r:
        assert r.form == form
        r.validate()
        assert r.load().equal(cache)
    assert kvwire.load(data).equal(cache)
    assert kvwire.probe(data).token_count == 300
    k = kvwire.load(data).keys(0)
    np.testing.assert_array_equal(k.view(np.uint16), cache.keys(0).view(np.uint16))
