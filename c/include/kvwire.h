/*
 * libkvwire: a C11 implementation of the kvwire format (spec/kvwire-v1.md, revision 1.3, with
 * the companions spec/codecs.md, spec/sparse.md and spec/crossmodel.md).
 *
 * Why a C library: the engines and stores around KV caches are C and C++ (or call C), and a
 * second implementation written from spec/ alone proves the spec is enough. It depends on
 * libzstd and libxxhash only, verifies FlatBuffers itself (no generated code), keeps no
 * global state and never allocates before the bytes or the limit that justify it.
 *
 * Layers (h11-style): everything below is pure functions over caller buffers -- the header
 * parser, the random-access reader over a buffer or a mapped file, the sans-IO stream
 * decoder (feed bytes, take events) and the writer (emits buffer lists to a sink). Files
 * and mmap are thin adapters (kvw_open_file, kvw_write_file).
 *
 * Conventions: every function that can fail returns a kvw_code (KVW_OK = 0) and fills the
 * caller's kvw_error when one is given (NULL is allowed). Format errors carry the code of
 * the spec's registry (section 18) and the rule id; API misuse, memory and I/O failures
 * have codes >= KVW_ERR_INVALID_ARGUMENT, which are never format errors.
 */
#ifndef KVWIRE_H
#define KVWIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVW_VERSION_STRING "0.1.0"
#define KVW_FORMAT_MAJOR 1
#define KVW_FORMAT_MINOR 4 /* the newest revision this library implements (1.4) */

/* ------------------------------------------------------------------------------------ */
/* Error codes: spec/kvwire-v1.md section 18.                                              */
/* ------------------------------------------------------------------------------------ */
/* The numbers are ABI (libkvwire.so.0, and callers that store or send them): every
 * enumerator carries its number explicitly. Append only, never renumber or reuse: a new
 * registry code takes the next number below 1000 (KVW_FORMAT_CODE_COUNT moves up by one),
 * a new non-format code the next number from 1000 on; a retired code keeps its number
 * reserved forever (its enumerator stays, documented as retired). Codes 1..65 are the
 * registry of revisions 1.0-1.4 in alphabetical order; later ones are in order of
 * addition. c/tests/error_codes.txt pins every number (tests/c/test_c_abi.py). */
typedef enum kvw_code {
    KVW_OK = 0,
    KVW_ARCH_INVALID = 1,
    KVW_BAD_ALIGNMENT = 2,
    KVW_BAD_CHUNK_TOKENS = 3,
    KVW_BAD_FRAME_MARKER = 4,
    KVW_BAD_MAGIC = 5,
    KVW_BAD_OFFSET = 6,
    KVW_BODY_CHECKSUM = 7,
    KVW_BODY_OUT_OF_BOUNDS = 8,
    KVW_CHUNK_BOUNDARY = 9,
    KVW_CHUNK_DUPLICATE = 10,
    KVW_CHUNK_MISSING = 11,
    KVW_CODEC_SPEC_INVALID = 12,
    KVW_CODEC_SPEC_MISMATCH = 13,
    KVW_COMPONENT_INVALID = 14,
    KVW_DECODED_SIZE_LIMIT = 15,
    KVW_DECODED_SIZE_MISMATCH = 16,
    KVW_DECODE_FAILED = 17,
    KVW_ENUM_OUT_OF_RANGE = 18,
    KVW_FB_ALIGNMENT = 19,
    KVW_FB_BOUNDS = 20,
    KVW_FB_IDENTIFIER = 21,
    KVW_FB_REQUIRED = 22,
    KVW_FB_STRING = 23,
    KVW_FB_TOO_COMPLEX = 24,
    KVW_FB_VTABLE = 25,
    KVW_FINGERPRINT_INVALID = 26,
    KVW_FORMAT_ERROR = 27,
    KVW_FRAME_CHECKSUM = 28,
    KVW_HEADER_CHECKSUM = 29,
    KVW_HEADER_TOO_LARGE = 30,
    KVW_HEAD_RANGE = 31,
    KVW_INDEX_CHECKSUM = 32,
    KVW_INDEX_MISMATCH = 33,
    KVW_INDEX_POSITION = 34,
    KVW_INDEX_TOO_LARGE = 35,
    KVW_KV_SCALES_INVALID = 36,
    KVW_LAYER_MAP_INVALID = 37,
    KVW_LAYER_OUT_OF_RANGE = 38,
    KVW_LENGTH_MISMATCH = 39,
    KVW_LIMIT_EXCEEDED = 40,
    KVW_METADATA_KEY_DUPLICATE = 41,
    KVW_METADATA_KEY_INVALID = 42,
    KVW_METADATA_VALUE_INVALID = 43,
    KVW_MISSING_END = 44,
    KVW_NONZERO_PADDING = 45,
    KVW_POSITIONS_CODEC = 46,
    KVW_POSITIONS_ENCODING = 47,
    KVW_POSITIONS_ORDER = 48,
    KVW_PREAMBLE_CHECKSUM = 49,
    KVW_PREFIX_INVALID = 50,
    KVW_RAW_LENGTH_MISMATCH = 51,
    KVW_RESERVED_NONZERO = 52,
    KVW_SEGMENT_MISMATCH = 53,
    KVW_SEGMENT_ORDER = 54,
    KVW_SPARSE_INVALID = 55,
    KVW_STATE_INVALID = 56,
    KVW_TEXT_MODE_MANGLED = 57,
    KVW_TOKEN_RANGE_INVALID = 58,
    KVW_TRAILING_BYTES = 59,
    KVW_TRUNCATED = 60,
    KVW_UNKNOWN_CODEC = 61,
    KVW_UNSUPPORTED_FEATURE = 62,
    KVW_UNSUPPORTED_VERSION = 63,
    KVW_VERSION_MISMATCH = 64,
    KVW_ZSTD_CHECKSUM_MISSING = 65, /* revision 1.4, KVW-CODEC-5 */
    KVW_FORMAT_CODE_COUNT = 66, /* one past the last registry code (grows when one is added) */

    /* Not format errors (never reported for a container's content). */
    KVW_ERR_INVALID_ARGUMENT = 1000, /* API misuse: the message names the valid choices */
    KVW_ERR_NO_MEMORY = 1001,
    KVW_ERR_IO = 1002,
    KVW_ERR_UNSUPPORTED = 1003, /* a valid request this library does not do (said in the message) */
    KVW_ERR_STATE = 1004, /* a call in the wrong state (e.g. add a chunk after finish) */
} kvw_code;

typedef struct kvw_error {
    kvw_code code;
    const char *rule;  /* static rule id, e.g. "KVW-CSUM-1"; "" when none */
    uint64_t needed;   /* TRUNCATED: total bytes from offset 0 needed (KVW-ERR-3), 0 unknown */
    char message[240]; /* free text for people; never parse it */
} kvw_error;

/* "BODY_CHECKSUM" for KVW_BODY_CHECKSUM; "INVALID_ARGUMENT" etc. for the others. */
const char *kvw_code_name(kvw_code code);
/* 1 when code is a registry code (a rejection of the input), 0 otherwise. */
int kvw_code_is_format_error(kvw_code code);
/* Registry code by name, KVW_OK when unknown. */
kvw_code kvw_code_from_name(const char *name);

/* ------------------------------------------------------------------------------------ */
/* Registries (spec section 20). Values are the wire codes.                               */
/* ------------------------------------------------------------------------------------ */
typedef enum kvw_dtype {
    KVW_DTYPE_BF16 = 0, KVW_DTYPE_F16 = 1, KVW_DTYPE_F32 = 2, KVW_DTYPE_F8_E4M3FN = 3,
    KVW_DTYPE_F8_E5M2 = 4, KVW_DTYPE_F8_E4M3FNUZ = 5, KVW_DTYPE_I8 = 6, KVW_DTYPE_U8 = 7
} kvw_dtype;
#define KVW_DTYPE_COUNT 8

typedef enum kvw_codec {
    KVW_CODEC_RAW = 0, KVW_CODEC_ZSTD = 1, KVW_CODEC_BYTEPLANE_ZSTD = 2, KVW_CODEC_FP8 = 3,
    KVW_CODEC_INT_AFFINE = 4
} kvw_codec;
#define KVW_CODEC_COUNT 5

typedef enum kvw_component {
    KVW_COMP_K = 0, KVW_COMP_V = 1, KVW_COMP_LATENT = 2, KVW_COMP_STATE = 3,
    KVW_COMP_POSITIONS = 4
} kvw_component;
#define KVW_COMPONENT_COUNT 5

typedef enum kvw_layer_kind {
    KVW_KIND_FULL_ATTENTION = 0, KVW_KIND_SLIDING_ATTENTION = 1,
    KVW_KIND_CHUNKED_ATTENTION = 2, KVW_KIND_MLA_LATENT = 3, KVW_KIND_SHARED = 4,
    KVW_KIND_STATE = 5
} kvw_layer_kind;
#define KVW_LAYER_KIND_COUNT 6

typedef enum kvw_rope_type {
    KVW_ROPE_NONE = 0, KVW_ROPE_DEFAULT = 1, KVW_ROPE_LINEAR = 2, KVW_ROPE_DYNAMIC = 3,
    KVW_ROPE_YARN = 4, KVW_ROPE_LONGROPE = 5, KVW_ROPE_LLAMA3 = 6
} kvw_rope_type;
#define KVW_ROPE_TYPE_COUNT 7

typedef enum kvw_map_op {
    KVW_MAP_COPY = 0, KVW_MAP_ALIAS = 1, KVW_MAP_RECOMPUTE = 2, KVW_MAP_DROP = 3
} kvw_map_op;
#define KVW_MAP_OP_COUNT 4

typedef enum kvw_scale_granularity {
    KVW_SCALE_TENSOR = 0, KVW_SCALE_HEAD = 1, KVW_SCALE_TOKEN = 2
} kvw_scale_granularity;
typedef enum kvw_group_axis { KVW_GROUP_TOKENS = 0, KVW_GROUP_CHANNELS = 1 } kvw_group_axis;
/* Revision 1.2 (spec/codecs.md section 8): int_affine's rotation stage and codebook; code 2
 * of each is revision 1.3's (section 9), in range only with required bit 5. */
typedef enum kvw_rotation {
    KVW_ROTATION_NONE = 0, KVW_ROTATION_HADAMARD = 1, KVW_ROTATION_SYLVESTER = 2
} kvw_rotation;
typedef enum kvw_codebook {
    KVW_CODEBOOK_UNIFORM = 0, KVW_CODEBOOK_GAUSSIAN = 1, KVW_CODEBOOK_TURBOQUANT = 2
} kvw_codebook;

#define KVW_CHECKSUM_XXH3_64 0

/* Required feature bits (section 20.8). */
#define KVW_FEATURE_CODEC_SPECS  (UINT64_C(1) << 0)
#define KVW_FEATURE_SPARSE       (UINT64_C(1) << 1)
#define KVW_FEATURE_STATE_LAYERS (UINT64_C(1) << 2)
#define KVW_FEATURE_KV_SCALES    (UINT64_C(1) << 3) /* revision 1.1 */
#define KVW_FEATURE_ROTATION     (UINT64_C(1) << 4) /* revision 1.2 (codecs.md KVW-ROT-1) */
#define KVW_FEATURE_TURBOQUANT   (UINT64_C(1) << 5) /* revision 1.3 (codecs.md KVW-TQ-1) */
#define KVW_FEATURES_KNOWN       (UINT64_C(0x3F))

/* Registry names ("bf16", "byteplane_zstd", "latent", "sliding_attention", "llama3",
 * "alias", "token", "channels"); NULL for a code outside the registry. */
const char *kvw_dtype_name(int code);
const char *kvw_codec_name(int code);
const char *kvw_component_name(int code);
const char *kvw_layer_kind_name(int code);
const char *kvw_rope_type_name(int code);
const char *kvw_map_op_name(int code);
const char *kvw_scale_granularity_name(int code);
const char *kvw_group_axis_name(int code);
const char *kvw_rotation_name(int code); /* "none", "hadamard", "sylvester" */
const char *kvw_codebook_name(int code); /* "uniform", "gaussian", "turboquant" */
/* Element size in bytes of a dtype (1, 2 or 4), 0 for a code outside the registry. */
unsigned kvw_dtype_size(int code);

/* ------------------------------------------------------------------------------------ */
/* The header (spec sections 5-7), decoded. Strings and byte vectors point into the      */
/* FlatBuffer the header was parsed from (zero copy: keep that buffer alive); arrays the   */
/* parser builds live in the header's own allocation (kvw_header_free).                    */
/* A writer fills the same struct with its own pointers (kvw_header_init first).           */
/* ------------------------------------------------------------------------------------ */

/* A byte string or a string (not NUL-terminated in general; len bytes at ptr). */
typedef struct kvw_bytes { const uint8_t *ptr; uint32_t len; } kvw_bytes;

/* A vector of little-endian scalars as stored (possibly unaligned): read with kvw_f64_at,
 * kvw_u32_at. count is the element count. */
typedef struct kvw_vec { const uint8_t *ptr; uint32_t count; } kvw_vec;
double kvw_f64_at(kvw_vec v, uint32_t i);
uint32_t kvw_u32_at(kvw_vec v, uint32_t i);

typedef struct kvw_rope {
    uint8_t rope_type;          /* kvw_rope_type, default DEFAULT */
    double theta;               /* 10000.0 */
    uint32_t rotary_dim;
    uint8_t interleaved;        /* bool, default 0 */
    double factor;              /* 1.0 */
    uint32_t original_max_position_embeddings;
    double low_freq_factor;     /* 1.0 */
    double high_freq_factor;    /* 4.0 */
    double beta_fast;           /* 32.0 */
    double beta_slow;           /* 1.0 */
    double attention_factor;    /* 1.0 */
    double mscale;              /* 1.0 */
    double mscale_all_dim;      /* 0.0 */
    kvw_vec short_factor;       /* f64 */
    kvw_vec long_factor;        /* f64 */
    kvw_vec mrope_section;      /* u32 */
    uint64_t seq_len_at_encode;
    uint8_t truncate;           /* bool, default 1 */
} kvw_rope;

typedef struct kvw_state_tensor {
    kvw_bytes name;
    kvw_vec shape; /* u32 */
    uint8_t dtype; /* kvw_dtype, default F32 */
} kvw_state_tensor;

typedef struct kvw_layer_spec {
    uint8_t kind;              /* kvw_layer_kind */
    uint32_t num_kv_heads;
    uint32_t head_dim_k;
    uint32_t head_dim_v;
    uint32_t window;
    int32_t source_layer;      /* default -1 */
    uint8_t uses_rope;         /* bool, default 1 */
    const kvw_rope *rope;      /* NULL when absent */
    uint32_t kv_lora_rank;
    uint32_t qk_rope_head_dim;
    const kvw_state_tensor *state_tensors;
    uint32_t state_tensor_count;
} kvw_layer_spec;

typedef struct kvw_arch {
    uint16_t schema_version;   /* default 1 */
    uint32_t num_layers;
    const kvw_layer_spec *layer_specs;
    uint32_t layer_spec_count;
    const uint16_t *layer_spec_index; /* num_layers entries (host order) */
    uint32_t layer_spec_index_count;
    const kvw_rope *rope;      /* NULL when absent */
    uint8_t keys_post_rope;    /* bool, default 1 */
} kvw_arch;

typedef struct kvw_model {
    kvw_bytes model_type, model_id, revision;
    kvw_bytes config_fingerprint, tokenizer_fingerprint, weights_fingerprint,
        compat_fingerprint;
    kvw_bytes framework, framework_version;
    kvw_bytes layer_weights_fingerprints;
    uint16_t fingerprint_scheme;
} kvw_model;

typedef struct kvw_layer_map_entry {
    uint32_t receiver_layer;
    int32_t transmitted_layer;
    uint8_t op; /* kvw_map_op */
} kvw_layer_map_entry;

typedef struct kvw_token_range { uint32_t start, count; } kvw_token_range;

typedef struct kvw_key_value { kvw_bytes key, value; } kvw_key_value;

typedef struct kvw_engine_layout {
    kvw_bytes name, axes, stride_order, engine;
    uint32_t block_size;
} kvw_engine_layout;

typedef struct kvw_prefix {
    uint16_t scheme; /* default 1 */
    kvw_bytes root, hashes;
} kvw_prefix;

typedef struct kvw_codec_spec {
    uint8_t codec;             /* default RAW */
    uint8_t lossless;          /* default RAW */
    uint8_t fp8_format;        /* default F8_E4M3FN */
    uint8_t scale_granularity; /* default TENSOR */
    uint8_t bits;              /* default 8 */
    uint32_t group_size;       /* default 32 */
    uint8_t group_axis;        /* default TOKENS */
    uint8_t symmetric;         /* bool, default 0 */
    uint8_t scale_dtype;       /* default F32 */
    uint32_t sink_tokens;
    uint32_t residual_tokens;
    /* Revision 1.2: read and written only with required bit 4 (KVW-ROT-1); the defaults
     * (none, 0, uniform) otherwise. */
    uint8_t rotation;          /* kvw_rotation, default NONE */
    uint64_t rotation_seed;    /* SplitMix64 seed of the sign vector (KVW-ROT-5) */
    uint8_t codebook;          /* kvw_codebook, default UNIFORM */
} kvw_codec_spec;

/* 1 when the spec needs required bit 4: rotation hadamard, codebook gaussian or bits 3. */
int kvw_codec_spec_uses_rotation(const kvw_codec_spec *c);
/* 1 when the spec needs required bit 5 (with bit 4): rotation sylvester or codebook
 * turboquant (revision 1.3, codecs.md KVW-TQ-1). */
int kvw_codec_spec_uses_turboquant(const kvw_codec_spec *c);

typedef struct kvw_sparse_info {
    kvw_bytes method;
    uint64_t next_position;
    kvw_vec retained_counts; /* u32, one per (layer, kv head) as sparse.md says */
    uint32_t sink_tokens;
    uint32_t window_tokens;
} kvw_sparse_info;

typedef struct kvw_kv_scale { float k_scale, v_scale; } kvw_kv_scale;

typedef struct kvw_header {
    uint16_t format_major, format_minor;
    uint64_t required_features, optional_features;
    int has_producer;
    kvw_bytes producer_library, producer_version;
    int has_model;
    kvw_model model;
    kvw_arch arch;
    const kvw_layer_map_entry *layer_map; /* NULL / 0 when absent or empty */
    uint32_t layer_map_count;
    uint8_t dtype;              /* default BF16 */
    uint32_t alignment;         /* default 64 */
    uint32_t chunk_tokens;      /* default 256 */
    uint64_t first_position;
    uint32_t token_count;
    /* has_layer_tokens = 0 (absent or empty vector, KVW-HDR-15): the parser fills the
     * default ranges, num_layers entries. has_layer_tokens = 1: the carried entries as they
     * are (layer_tokens_count = the carried count, which rules.c checks against num_layers,
     * KVW-HDR-13). After a successful parse the count is always num_layers. */
    const kvw_token_range *layer_tokens;
    uint32_t layer_tokens_count;
    int has_layer_tokens;
    uint8_t checksum_algorithm; /* default XXH3_64 */
    const kvw_key_value *metadata;
    uint32_t metadata_count;
    int has_engine_layout;
    kvw_engine_layout engine_layout;
    int has_prefix;
    kvw_prefix prefix;
    const kvw_codec_spec *codec_specs;
    uint32_t codec_spec_count;
    int has_sparse;
    kvw_sparse_info sparse;
    /* Revision 1.1: read only when required bit 3 is set (KVW-SCALE-1). */
    const kvw_kv_scale *kv_scales;
    uint32_t kv_scale_count;
    int has_kv_scales;

    void *owned_; /* the parser's allocation; NULL in a writer-filled header */
} kvw_header;

/* Defaults of every field (schema defaults; no layers). */
void kvw_header_init(kvw_header *h);
/* Schema defaults of the sub-tables, for writers filling a header. */
void kvw_rope_init(kvw_rope *r);
void kvw_layer_spec_init(kvw_layer_spec *s);
void kvw_codec_spec_init(kvw_codec_spec *c);

/* Frees what kvw_header_parse allocated; the header is then kvw_header_init'ed. */
void kvw_header_free(kvw_header *h);

/* Layer i's spec (layer_specs[layer_spec_index[i]]); NULL when i is out of range. */
const kvw_layer_spec *kvw_layer(const kvw_header *h, uint32_t i);

/*
 * Parse and check a header FlatBuffer (the header_length bytes after the preamble):
 * verification and decoding in the order of spec 14.1 step 2, then the header rules of
 * step 3. The version agreement with a preamble (HDR-9) is the caller's: the reader does
 * it. `fb` must stay alive while `out` is used.
 */
kvw_code kvw_header_parse(const uint8_t *fb, size_t len, kvw_header *out, kvw_error *err);

/* ------------------------------------------------------------------------------------ */
/* Chunk records (spec 8.1), host-order copies of the 56-byte wire structs.              */
/* ------------------------------------------------------------------------------------ */
typedef struct kvw_record {
    uint64_t offset, stored_length, raw_length, checksum;
    uint32_t token_start, token_count;
    uint16_t layer;
    uint8_t component, codec;
    uint16_t flags, head_start, head_count;
    uint16_t reserved0; /* codec_spec when feature codec_specs is set */
    uint32_t reserved1;
} kvw_record;

#define KVW_RECORD_SIZE 56
void kvw_record_decode(const uint8_t wire[KVW_RECORD_SIZE], kvw_record *out);
void kvw_record_encode(const kvw_record *r, uint8_t wire[KVW_RECORD_SIZE]);

/* ------------------------------------------------------------------------------------ */
/* Random-access reader (spec 14.1) over a caller's buffer or a mapped file.             */
/* ------------------------------------------------------------------------------------ */
typedef struct kvw_options {
    uint64_t max_decoded_bytes; /* KVW-LIM-5; 0 means the default 64 GiB */
    int skip_body_checksums;    /* KVW-CSUM-3: only on a path that already verified them */
} kvw_options;

typedef enum kvw_form { KVW_FORM_STREAM = 0, KVW_FORM_FILE = 1 } kvw_form;

typedef struct kvw_reader kvw_reader;

/* Open: steps 1-12 of 14.1 (structure, no body read). The buffer must outlive the reader. */
kvw_code kvw_open(const void *buf, size_t len, const kvw_options *opt, kvw_reader **out,
                  kvw_error *err);
/* Map a file read-only and open it; the mapping is released by kvw_close. */
kvw_code kvw_open_file(const char *path, const kvw_options *opt, kvw_reader **out,
                       kvw_error *err);
void kvw_close(kvw_reader *r);

const kvw_header *kvw_reader_header(const kvw_reader *r);
kvw_form kvw_reader_form(const kvw_reader *r);
size_t kvw_reader_size(const kvw_reader *r);          /* container length in bytes */
uint64_t kvw_reader_decoded_size(const kvw_reader *r); /* sum of raw_length */
size_t kvw_chunk_count(const kvw_reader *r);
/* Record i in container order; NULL when out of range. */
const kvw_record *kvw_chunk_record(const kvw_reader *r, size_t i);
/* Container index of the chunk (layer, component, cell j) in canonical order (11.4). */
kvw_code kvw_find_chunk(const kvw_reader *r, uint32_t layer, int component, uint32_t cell,
                        size_t *index, kvw_error *err);

/* Decode chunk i into out (out_len >= raw_length): frame/index agreement on first access
 * (FILE-4), checksum (CSUM-1), codec. One copy for raw bodies, none beyond the codec's
 * own output for the others. */
kvw_code kvw_read_chunk(kvw_reader *r, size_t i, void *out, size_t out_len, kvw_error *err);
/* Zero copy for raw bodies: after the same checks, *ptr points at the body in the buffer.
 * KVW_ERR_INVALID_ARGUMENT for a chunk whose codec is not raw. */
kvw_code kvw_chunk_view(kvw_reader *r, size_t i, const uint8_t **ptr, size_t *len,
                        kvw_error *err);

/* The canonical tensor of (layer, component) (PROTOCOL.md 2.3): shape and byte size.
 * For K/V/LATENT [heads, layer tokens, dim] in the header dtype; sparse: [sum of
 * retained, dim] and POSITIONS int64; state: component KVW_COMP_STATE with the tensor
 * index in `which` (0 otherwise). Returns KVW_ERR_INVALID_ARGUMENT when the layer does
 * not store the component. */
typedef struct kvw_tensor_info {
    uint32_t ndim;
    uint64_t shape[8];
    uint64_t nbytes;
    uint8_t dtype; /* header dtype, a state tensor's dtype, or 0xFF for int64 positions */
} kvw_tensor_info;
kvw_code kvw_tensor_info_of(const kvw_reader *r, uint32_t layer, int component,
                            uint32_t which, kvw_tensor_info *info, kvw_error *err);
/* Assemble that tensor into out (out_len >= info.nbytes), each chunk decoded in place. */
kvw_code kvw_read_tensor(kvw_reader *r, uint32_t layer, int component, uint32_t which,
                         void *out, size_t out_len, kvw_error *err);

/* Full validation (1.4, 14.1): every padding byte, every frame against the index, every
 * body's checksum and decoding. Decodes into a scratch buffer of one chunk at a time. */
kvw_code kvw_validate(kvw_reader *r, kvw_error *err);

/* ------------------------------------------------------------------------------------ */
/* Sans-IO stream decoder (spec 14.2): feed bytes as they arrive, take events.            */
/* ------------------------------------------------------------------------------------ */
typedef enum kvw_event_type {
    KVW_EVENT_NEED_DATA = 0, /* feed more bytes (ev.needed: total bytes it wants, if known) */
    KVW_EVENT_HEADER = 1,    /* ev.header valid until the decoder is freed or reset */
    KVW_EVENT_CHUNK = 2,     /* ev.record, ev.body (stored bytes, checksum verified) and,
                                when decode_bodies is set, ev.data (raw_length decoded) */
    KVW_EVENT_END = 3,       /* the container is complete (ev.form); for concatenated
                                streams the next kvw_next starts the next container */
    KVW_EVENT_EOF = 4        /* kvw_decoder_finish was called and every container ended */
} kvw_event_type;

typedef struct kvw_event {
    kvw_event_type type;
    uint64_t needed;
    const kvw_header *header;
    const kvw_record *record;
    const uint8_t *body;
    const uint8_t *data;
    size_t data_len;
    kvw_form form;
} kvw_event;

typedef struct kvw_decoder_options {
    kvw_options base;
    int decode_bodies;  /* decode each chunk (ev.data); else only the checksum is checked */
    int concatenated;   /* KVW-STREAM-3: bytes after an end frame are the next container */
} kvw_decoder_options;

typedef struct kvw_decoder kvw_decoder;
kvw_code kvw_decoder_new(const kvw_decoder_options *opt, kvw_decoder **out, kvw_error *err);
void kvw_decoder_free(kvw_decoder *d);
/* Hand bytes to the decoder (it copies what it must keep). */
kvw_code kvw_decoder_feed(kvw_decoder *d, const void *data, size_t len, kvw_error *err);
/* The input has ended. */
kvw_code kvw_decoder_finish(kvw_decoder *d, kvw_error *err);
/* Next event. Pointers in ev stay valid until the next call. After an error the decoder
 * keeps returning it. */
kvw_code kvw_next(kvw_decoder *d, kvw_event *ev, kvw_error *err);

/* ------------------------------------------------------------------------------------ */
/* Codecs (spec section 13, codecs.md).                                                   */
/* ------------------------------------------------------------------------------------ */
/* Decode one stored body into out (raw_length bytes): the record's codec, with its codec
 * spec when the header has codec_specs. Does not check the checksum. */
kvw_code kvw_decode_body(const kvw_header *h, const kvw_record *rec, const uint8_t *stored,
                         void *out, kvw_error *err);

/* ------------------------------------------------------------------------------------ */
/* Writer (spec section 15): both forms, chunks given as buffer lists (never concatenated) */
/* ------------------------------------------------------------------------------------ */
typedef struct kvw_iovec { const void *base; size_t len; } kvw_iovec;

/* The writer's output: called with the next bytes of the container, in order. Return 0,
 * or non-zero to abort (the writer then fails with KVW_ERR_IO and emits no end frame). */
typedef int (*kvw_sink_fn)(void *ctx, const kvw_iovec *parts, int nparts);

typedef struct kvw_writer_options {
    kvw_form form;     /* KVW_FORM_FILE (index + trailer) or KVW_FORM_STREAM */
    int zstd_level;    /* 0: library default (3) */
} kvw_writer_options;

typedef struct kvw_writer kvw_writer;
/* Checks the header against every rule of sections 5-7 (KVW-WRITE-1) by encoding and
 * parsing it back, then emits preamble and header. The writer sets format_minor,
 * producer and the feature bits the header's fields imply (KVW-EVOL-12, SCALE-1,
 * CSPEC-10). */
kvw_code kvw_writer_new(const kvw_header *h, const kvw_writer_options *opt,
                        kvw_sink_fn sink, void *ctx, kvw_writer **out, kvw_error *err);
/* Add one chunk: its raw bytes as a list of parts (e.g. one per head). codec is any of the
 * registry (KVW_CODEC_RAW ... KVW_CODEC_INT_AFFINE); codecs 2-4 need a matching codec spec
 * in the header, named by codec_spec (1-based, spec/codecs.md CSPEC-9). A compressed body
 * that would not be smaller is stored raw (KVW-CHUNK-6); a chunk a lossy codec cannot
 * store faithfully (NaN/inf, LOSSY-5/6) is stored with zstd and codec_spec 0. */
kvw_code kvw_writer_add(kvw_writer *w, uint32_t layer, int component, uint32_t token_start,
                        uint32_t token_count, int codec, uint16_t codec_spec,
                        const kvw_iovec *parts, int nparts, kvw_error *err);
/* Emit the end frame (and index and trailer in file form); checks every slot was filled. */
kvw_code kvw_writer_finish(kvw_writer *w, kvw_error *err);
void kvw_writer_free(kvw_writer *w);

/* Atomic file write (KVW-FILE-6): sink into path.tmp.XXXXXX, fsync, rename. */
typedef struct kvw_file_sink kvw_file_sink;
kvw_code kvw_file_sink_open(const char *path, kvw_file_sink **out, kvw_error *err);
int kvw_file_sink_write(void *ctx, const kvw_iovec *parts, int nparts); /* a kvw_sink_fn */
/* commit != 0: fsync and rename into place; 0: remove the temporary file. Frees. */
kvw_code kvw_file_sink_close(kvw_file_sink *s, int commit, kvw_error *err);

/* ==== segments additions ==== */
/* Segment reassembly (spec 10.2-10.3, KVW-STREAM-3..10): a byte stream of concatenated
 * stream-form containers, the segments of one growing sequence, read with full
 * validation and joined into one cache. Rejections have the code of the first failing
 * rule (SEGMENT_MISMATCH, SEGMENT_ORDER, TRUNCATED for an empty stream, or the
 * decoder's). The buffer need not outlive the call. */
typedef struct kvw_reassembly kvw_reassembly;
kvw_code kvw_reassemble(const void *buf, size_t len, const kvw_options *opt,
                        kvw_reassembly **out, kvw_error *err);
void kvw_reassembly_free(kvw_reassembly *ra);
/* The reassembled header: the segments' shared header with first_position and
 * token_count of the reassembled positions, default layer_tokens and the joined prefix
 * chain (KVW-STREAM-9). Valid while ra lives. */
const kvw_header *kvw_reassembly_header(const kvw_reassembly *ra);
size_t kvw_reassembly_segments(const kvw_reassembly *ra);
/* A canonical tensor of the reassembled cache, as kvw_tensor_info_of describes it (state
 * layers: the last accepted segment's state, KVW-STREAM-8); *data points into ra. */
kvw_code kvw_reassembly_tensor(const kvw_reassembly *ra, uint32_t layer, int component,
                               uint32_t which, kvw_tensor_info *info, const uint8_t **data,
                               kvw_error *err);
/* ==== end segments ==== */

/* ==== writing additions ==== */
/* kvw_writer_add with the head named: `head` is the kv head of a sparse chunk
 * (sparse.md KVW-SPARSE-7, required there) or the state tensor index of a STATE chunk
 * (crossmodel.md KVW-STATE-7); -1 lets the writer choose (dense chunks: all heads; state
 * chunks: the first tensor of the layer not yet written). kvw_writer_add is head -1. */
kvw_code kvw_writer_add_head(kvw_writer *w, uint32_t layer, int component, int head,
                             uint32_t token_start, uint32_t token_count, int codec,
                             uint16_t codec_spec, const kvw_iovec *parts, int nparts,
                             kvw_error *err);
/* ==== end writing ==== */

/* ==== FFI additions ==== */
/* For foreign callers (ctypes, cffi) that hold a header as bytes and chunks as wire
 * records. kvw_header_new copies the FlatBuffer, parses and checks it (kvw_header_parse);
 * free it with kvw_header_delete (only headers from kvw_header_new). kvw_decode_wire
 * decodes one stored body (stored_len == the record's stored_length, out_len >= its
 * raw_length; KVW_ERR_INVALID_ARGUMENT otherwise) as kvw_decode_body does, without the
 * checksum. The header is only read: calls over one header may run on many threads.
 * kvw_error_size is sizeof(kvw_error), for callers that mirror the struct; kvw_version is
 * KVW_VERSION_STRING as the library was built (a loader compares it with its own). */
kvw_code kvw_header_new(const uint8_t *fb, size_t len, kvw_header **out, kvw_error *err);
void kvw_header_delete(kvw_header *h);
/* Reusable decoding scratch (a zstd context and a body buffer) for kvw_decode_wire: one per
 * thread, owned by the caller. ctx NULL decodes without reuse (kvw_decode_body). */
typedef struct kvw_decode_ctx kvw_decode_ctx;
kvw_code kvw_decode_ctx_new(kvw_decode_ctx **out, kvw_error *err);
void kvw_decode_ctx_free(kvw_decode_ctx *ctx);
kvw_code kvw_decode_wire(kvw_decode_ctx *ctx, const kvw_header *h,
                         const uint8_t record[KVW_RECORD_SIZE], const uint8_t *stored,
                         size_t stored_len, void *out, size_t out_len, kvw_error *err);
/* kvw_decode_wire with the output's heads head_stride bytes apart (>= the record's
 * raw_length / head_count; out_len >= (heads - 1) * head_stride + that): a chunk decoded
 * straight into its token slice of a [heads, layer tokens, dim] tensor. ctx is required. */
kvw_code kvw_decode_wire_heads(kvw_decode_ctx *ctx, const kvw_header *h,
                               const uint8_t record[KVW_RECORD_SIZE], const uint8_t *stored,
                               size_t stored_len, void *out, size_t out_len, size_t head_stride,
                               kvw_error *err);
size_t kvw_error_size(void);
const char *kvw_version(void);
/* ==== end FFI ==== */

/* ==== FFI copy additions ==== */
/* Checked copy of one chunk body (for readers assembling layers from another language):
 * src's n bytes (the stored body, or a decoded one with verify 0) go as n / run runs of
 * run bytes to dst + r * dst_stride, hashed (XXH3, KVW-CSUM-1) block by block as they are
 * copied when verify != 0; KVW_BODY_CHECKSUM when the digest is not checksum (dst then holds
 * the unverified bytes: the caller must not use them). dst NULL or run 0: hash only. */
kvw_code kvw_copy_checked(const uint8_t *src, size_t n, uint64_t checksum, int verify, uint8_t *dst,
                          size_t run, size_t dst_stride, kvw_error *err);
/* XXH3-64 of the concatenation of runs runs of run bytes at src + r * stride (a chunk's
 * heads in a layer tensor, as a writer checksums a body it sends as pieces). */
uint64_t kvw_xxh3_runs(const uint8_t *src, size_t runs, size_t run, size_t stride);
/* Slot-addressed copies between a standard [heads, tokens, dim] array (elements of esize 1, 2,
 * 4 or 8 bytes; a token's dim elements contiguous, heads std_head_stride bytes apart) and an
 * engine's paged view [n_blocks, heads, block_size, dim] whose byte strides are strides[4]
 * (block, head, token, channel: any, e.g. K transposed per block and head). Token t of the
 * standard array is slot slots[t] = block * block_size + offset of the view. Every slot is
 * checked (0 <= slot < n_blocks * block_size) before a byte is copied: KVW_ERR_INVALID_ARGUMENT
 * otherwise. Runs of consecutive slots in one block copy as rows (memcpy) or as tiles
 * transposed in the caches. Thread-safe; distinct destinations may be copied in parallel. */
kvw_code kvw_scatter_slots(const uint8_t *src, size_t heads, size_t tokens, size_t dim, size_t esize,
                           size_t std_head_stride, const int64_t *slots, uint8_t *dst, size_t n_blocks,
                           size_t block_size, const size_t strides[4], kvw_error *err);
/* The reverse: the view's slots into the standard array dst. */
kvw_code kvw_gather_slots(uint8_t *dst, size_t heads, size_t tokens, size_t dim, size_t esize,
                          size_t std_head_stride, const int64_t *slots, const uint8_t *src, size_t n_blocks,
                          size_t block_size, const size_t strides[4], kvw_error *err);
/* ==== end FFI copy ==== */

/* ==== ffi encode additions ==== */
/* The lossy body (fp8 or int_affine, without its lossless stage) of one chunk of raw_len
 * bytes (== the wire record's raw_length; codec and codec_spec from the record) into dst
 * (dst_len >= the body's length; *written is set to it; a shorter dst fails with
 * KVW_ERR_INVALID_ARGUMENT and err->needed = the body's length). KVW_ERR_UNSUPPORTED for a chunk
 * that KVW-LOSSY-5/6 forbids a lossy body for (the message says why): store it
 * losslessly. Same bytes as kvw_encode_body's lossy body; nothing is allocated per call
 * except for a chunk with groups near the dtype extremes (section 3.1). Thread-safe over
 * one header. */
kvw_code kvw_lossy_encode_wire(const kvw_header *h, const uint8_t record[KVW_RECORD_SIZE],
                               const uint8_t *raw, size_t raw_len, uint8_t *dst, size_t dst_len,
                               size_t *written, kvw_error *err);
/* ==== end ffi encode additions ==== */

#ifdef __cplusplus
}
#endif
#endif /* KVWIRE_H */
