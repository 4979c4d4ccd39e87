"""kvwire: an open wire format and reference codec for LLM KV caches.

First screen of the API::

    kvwire.save(path, cache)            # atomic file write (or a binary file object / BytesIO)
    kvwire.load(path_or_bytes)          # a KVCache with checksums verified (paths, bytes, file objects)
    kvwire.open(path_or_bytes)          # Reader: header + chunk views (mmap=: mapped or read, see open)
    kvwire.save_tensors({"layers.0.k": k0, "layers.0.v": v0, ...}, path)   # safetensors-style dicts
    cache.keys[i], cache.values[i], cache.astype("float32"), cache.to("cuda"), cache == other
    kvwire.probe(first_bytes)           # the header alone, from the first bytes
    kvwire.encode(cache) -> bytes       # iter_buffers(cache) for writev without copies
    kvwire.layouts.bind(name, buffers)  # engine buffers in an engine layout (vLLM, SGLang...) <-> chunks
    kvwire.save(path, cache, codec="kivi2")          # byteplane, fp8-e4m3, int8, int4-g32...
    kvwire.check_compatible(header, local_model)     # exact / convertible / incompatible
    kvwire.adapters.hf.from_hf(cache, model)         # transformers DynamicCache <-> KVCache

The public API is what the ``__all__`` of a public namespace lists: ``kvwire`` itself,
``kvwire.stream``, ``kvwire.store``, ``kvwire.layouts``, ``kvwire.rope``, ``kvwire.codecs``,
``kvwire.adapters.hf``, ``kvwire.integrations.vllm``, ``kvwire.integrations.vllm_quantized``
and ``kvwire.conformance`` (docs/api*.md). Import names from those namespaces: the modules
below them (``kvwire.cache.encoder``, ``kvwire.stream.reader``, ...) are implementation and
may move. A renamed public name keeps working for a while as a deprecated alias that warns
(``DeprecationWarning``). Every exception kvwire raises is a ``kvwire.Error`` with a stable
``code``; it keeps its builtin kind too (``FormatError`` is a ``ValueError``,
``StreamTimeout`` a ``TimeoutError``), and the codes are listed in docs/errors.md.

Three things are called a layout, always with their qualifier: the *container layout*
(where frames, bodies and padding sit, spec section 9.3; broken: ``LayoutError``), the
*canonical tensor layout* of a chunk body ([heads, tokens, dim], KVW-CHUNK-4) and an
*engine layout* (how an engine holds its cache in memory: ``kvwire.layouts``,
``EngineLayout``, spec/layouts.md; buffers that disagree: ``LayoutMismatchError``).

The package uses relative imports only and keeps no global state (beyond a per-process
note of file systems that refuse to link unnamed temporary files, and libkvwire's handle with
its parsed copies of live headers and its decoding threads: ``kvwire.codecs.native``), so it
can be vendored under another name.
"""

from . import layouts, stream
from .cache.decoder import ChunkEvent, EndEvent, HeaderEvent, StreamDecoder
from .cache.encoder import Encoder, iter_buffers
from .cache.files import encode, load, load_tensors, open, save, save_tensors  # typed keywords, file objects
from .cache.kvcache import KVCache
from .cache.reader import Reader, probe
from .cache.sparse import SparseInfo, SparseKVCache
from .codecs.policy import Plan, plan  # after the submodule import, kvwire.plan is the function
from .format.codec_specs import CodecSpec
from .format.crossmodel import PrefixChain, StateTensor
from .format.errors import (
    ChecksumError,
    CodecError,
    Error,
    FeatureError,
    FormatError,
    HeaderError,
    LayoutError,
    LimitError,
    MagicError,
    SchemaError,
    TruncatedError,
    VersionError,
)
from .format.header import (
    Architecture,
    EngineLayout,
    Header,
    LayerMapEntry,
    LayerSpec,
    ModelIdentity,
    Producer,
    RopeParams,
    TokenRange,
)
from .format.kv_scales import KVScale  # 1.1: per-layer fp8 scales (Header.kv_scales, spec 5.10)
from .format.prefix import prefix_hashes
from .model import rope  # kvwire.rope.reposition / shift (spec/crossmodel.md, KVW-ROPE-*)
from .model.compat import LocalModel, Verdict, check_compatible
from .model.prefix import PrefixIndex, covered_tokens
from .version import __version__

__all__ = [
    "Architecture", "ChecksumError", "CodecSpec", "ChunkEvent", "EndEvent", "HeaderEvent", "StreamDecoder", "CodecError", "Encoder", "Error", "EngineLayout", "FeatureError",
    "FormatError", "Header",
    "HeaderError", "KVCache", "KVScale", "LayerMapEntry", "LayerSpec", "LayoutError", "LimitError", "MagicError",
    "ModelIdentity", "Producer", "Reader", "RopeParams", "SchemaError", "SparseInfo", "SparseKVCache", "TokenRange", "TruncatedError",
    "LocalModel", "PrefixChain", "PrefixIndex", "StateTensor", "Verdict", "check_compatible", "covered_tokens",
    "prefix_hashes",
    "Plan", "VersionError", "__version__", "encode", "iter_buffers", "layouts", "load", "load_tensors", "open", "plan", "probe", "rope", "save", "save_tensors", "stream",
]
