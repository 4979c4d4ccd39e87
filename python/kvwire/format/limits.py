"""Limits of format v1 (spec section "Limits", KVW-LIM-*).

A reader checks every size it reads from the wire against these before it allocates or
loops, so a hostile container can make it fail but never make it allocate or spin.
"""

MAX_HEADER_LENGTH = 16 << 20
MAX_INDEX_LENGTH = 64 << 20
MAX_CHUNKS = 1 << 20
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 1 << 16
MAX_TOKENS = (1 << 31) - 1
MAX_CHUNK_TOKENS = 1 << 20
MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 1 << 21
MAX_CHUNK_RAW_LENGTH = 1 << 32
MAX_METADATA_ENTRIES = 4096
MAX_STRING_LENGTH = 1 << 16
MAX_BYTES_LENGTH = 1 << 20
MAX_PREFIX_HASH_BYTES = 1 << 23  # PrefixChain.hashes: 2^18 token chunks of 32 bytes (KVW-PREFIX-7)
MAX_STATE_TENSORS_VECTOR = 4096  # LayerSpec.state_tensors entries; more than 64 is STATE_INVALID (KVW-STATE-2)
MAX_STATE_SHAPE = 4096  # StateTensor.shape entries; more than 8 is STATE_INVALID (KVW-STATE-2)
MAX_ROPE_FACTORS = 1 << 16
MAX_FB_TABLES = 1 << 16
# Parse budget of one FlatBuffer (KVW-LIM-7): PER_BYTE x its length + BASE units; a table
# visit costs PARSE_TABLE_COST, a vector or string body one unit per byte.
PARSE_BUDGET_PER_BYTE = 8
PARSE_BUDGET_BASE = 1 << 16
PARSE_TABLE_COST = 32
DEFAULT_MAX_DECODED_BYTES = 64 << 30
