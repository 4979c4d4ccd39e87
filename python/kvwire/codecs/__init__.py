"""Body codecs (spec section 13 and spec/codecs.md): a chunk's canonical raw bytes to its
stored bytes and back. ``zstd`` holds raw and zstd, ``byteplane`` and ``quant`` the codec
spec stages (byteplane_zstd; fp8 and int_affine), ``pipeline`` decodes any chunk,
``choice`` plans a writer's codec per chunk, ``presets`` names common pipelines and
``policy`` decides per chunk whether to send it or have the receiver recompute it
(spec/policy.md). Codecs sit on ``kvwire.format`` and know nothing of caches or I/O.
"""

from . import byteplane, quant
from .choice import CodecGrowthWarning, CodecPlan, check_codec_map
from .pipeline import decode_chunk, lossy_range
from .presets import PRESETS, resolve
from .zstd import DEFAULT_ZSTD_LEVEL, BodyEncoder, decode_body

__all__ = ["BodyEncoder", "CodecGrowthWarning", "CodecPlan", "DEFAULT_ZSTD_LEVEL", "PRESETS", "byteplane", "check_codec_map", "decode_body",
           "decode_chunk", "lossy_range", "quant", "resolve"]
