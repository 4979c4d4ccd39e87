/*
 * Shared helpers: registry names (spec section 20 and the error registry of section 18),
 * error filling, checksums (KVW-CONV-3), record wire conversion (8.1) and header defaults
 * (KVW-HDR-14). Kept apart so that every module names codes the same way.
 */
#include "common/common.h"

#include <stdio.h>
#include <stdlib.h>
#include <xxhash.h>

const uint8_t KVW_MAGIC[8] = {0x89, 0x4B, 0x56, 0x57, 0x0D, 0x0A, 0x1A, 0x0A};
const uint8_t KVW_TRAILER_MAGIC[8] = {'K', 'V', 'W', 'I', 'N', 'D', 'E', 'X'};

/* Designated by enumerator, not by position: the numbers are fixed in kvwire.h (append
 * only), so a retired code leaves a NULL hole here and is never named. */
static const char *const CODE_NAMES[KVW_FORMAT_CODE_COUNT] = {
    [KVW_OK] = "OK",
    [KVW_ARCH_INVALID] = "ARCH_INVALID",
    [KVW_BAD_ALIGNMENT] = "BAD_ALIGNMENT",
    [KVW_BAD_CHUNK_TOKENS] = "BAD_CHUNK_TOKENS",
    [KVW_BAD_FRAME_MARKER] = "BAD_FRAME_MARKER",
    [KVW_BAD_MAGIC] = "BAD_MAGIC",
    [KVW_BAD_OFFSET] = "BAD_OFFSET",
    [KVW_BODY_CHECKSUM] = "BODY_CHECKSUM",
    [KVW_BODY_OUT_OF_BOUNDS] = "BODY_OUT_OF_BOUNDS",
    [KVW_CHUNK_BOUNDARY] = "CHUNK_BOUNDARY",
    [KVW_CHUNK_DUPLICATE] = "CHUNK_DUPLICATE",
    [KVW_CHUNK_MISSING] = "CHUNK_MISSING",
    [KVW_CODEC_SPEC_INVALID] = "CODEC_SPEC_INVALID",
    [KVW_CODEC_SPEC_MISMATCH] = "CODEC_SPEC_MISMATCH",
    [KVW_COMPONENT_INVALID] = "COMPONENT_INVALID",
    [KVW_DECODED_SIZE_LIMIT] = "DECODED_SIZE_LIMIT",
    [KVW_DECODED_SIZE_MISMATCH] = "DECODED_SIZE_MISMATCH",
    [KVW_DECODE_FAILED] = "DECODE_FAILED",
    [KVW_ENUM_OUT_OF_RANGE] = "ENUM_OUT_OF_RANGE",
    [KVW_FB_ALIGNMENT] = "FB_ALIGNMENT",
    [KVW_FB_BOUNDS] = "FB_BOUNDS",
    [KVW_FB_IDENTIFIER] = "FB_IDENTIFIER",
    [KVW_FB_REQUIRED] = "FB_REQUIRED",
    [KVW_FB_STRING] = "FB_STRING",
    [KVW_FB_TOO_COMPLEX] = "FB_TOO_COMPLEX",
    [KVW_FB_VTABLE] = "FB_VTABLE",
    [KVW_FINGERPRINT_INVALID] = "FINGERPRINT_INVALID",
    [KVW_FORMAT_ERROR] = "FORMAT_ERROR",
    [KVW_FRAME_CHECKSUM] = "FRAME_CHECKSUM",
    [KVW_HEADER_CHECKSUM] = "HEADER_CHECKSUM",
    [KVW_HEADER_TOO_LARGE] = "HEADER_TOO_LARGE",
    [KVW_HEAD_RANGE] = "HEAD_RANGE",
    [KVW_INDEX_CHECKSUM] = "INDEX_CHECKSUM",
    [KVW_INDEX_MISMATCH] = "INDEX_MISMATCH",
    [KVW_INDEX_POSITION] = "INDEX_POSITION",
    [KVW_INDEX_TOO_LARGE] = "INDEX_TOO_LARGE",
    [KVW_KV_SCALES_INVALID] = "KV_SCALES_INVALID",
    [KVW_LAYER_MAP_INVALID] = "LAYER_MAP_INVALID",
    [KVW_LAYER_OUT_OF_RANGE] = "LAYER_OUT_OF_RANGE",
    [KVW_LENGTH_MISMATCH] = "LENGTH_MISMATCH",
    [KVW_LIMIT_EXCEEDED] = "LIMIT_EXCEEDED",
    [KVW_METADATA_KEY_DUPLICATE] = "METADATA_KEY_DUPLICATE",
    [KVW_METADATA_KEY_INVALID] = "METADATA_KEY_INVALID",
    [KVW_METADATA_VALUE_INVALID] = "METADATA_VALUE_INVALID",
    [KVW_MISSING_END] = "MISSING_END",
    [KVW_NONZERO_PADDING] = "NONZERO_PADDING",
    [KVW_POSITIONS_CODEC] = "POSITIONS_CODEC",
    [KVW_POSITIONS_ENCODING] = "POSITIONS_ENCODING",
    [KVW_POSITIONS_ORDER] = "POSITIONS_ORDER",
    [KVW_PREAMBLE_CHECKSUM] = "PREAMBLE_CHECKSUM",
    [KVW_PREFIX_INVALID] = "PREFIX_INVALID",
    [KVW_RAW_LENGTH_MISMATCH] = "RAW_LENGTH_MISMATCH",
    [KVW_RESERVED_NONZERO] = "RESERVED_NONZERO",
    [KVW_SEGMENT_MISMATCH] = "SEGMENT_MISMATCH",
    [KVW_SEGMENT_ORDER] = "SEGMENT_ORDER",
    [KVW_SPARSE_INVALID] = "SPARSE_INVALID",
    [KVW_STATE_INVALID] = "STATE_INVALID",
    [KVW_TEXT_MODE_MANGLED] = "TEXT_MODE_MANGLED",
    [KVW_TOKEN_RANGE_INVALID] = "TOKEN_RANGE_INVALID",
    [KVW_TRAILING_BYTES] = "TRAILING_BYTES",
    [KVW_TRUNCATED] = "TRUNCATED",
    [KVW_UNKNOWN_CODEC] = "UNKNOWN_CODEC",
    [KVW_UNSUPPORTED_FEATURE] = "UNSUPPORTED_FEATURE",
    [KVW_UNSUPPORTED_VERSION] = "UNSUPPORTED_VERSION",
    [KVW_VERSION_MISMATCH] = "VERSION_MISMATCH",
    [KVW_ZSTD_CHECKSUM_MISSING] = "ZSTD_CHECKSUM_MISSING",
};

const char *kvw_code_name(kvw_code code) {
    if ((int)code >= 0 && code < KVW_FORMAT_CODE_COUNT && CODE_NAMES[code]) return CODE_NAMES[code];
    switch (code) {
    case KVW_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case KVW_ERR_NO_MEMORY: return "NO_MEMORY";
    case KVW_ERR_IO: return "IO_ERROR";
    case KVW_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case KVW_ERR_STATE: return "BAD_STATE";
    default: return "UNKNOWN";
    }
}

int kvw_code_is_format_error(kvw_code code) {
    return code > KVW_OK && code < KVW_FORMAT_CODE_COUNT && CODE_NAMES[code] != NULL;
}

kvw_code kvw_code_from_name(const char *name) {
    if (!name) return KVW_OK;
    for (int i = 1; i < KVW_FORMAT_CODE_COUNT; i++)
        if (CODE_NAMES[i] && strcmp(CODE_NAMES[i], name) == 0) return (kvw_code)i;
    return KVW_OK;
}

void kvw_error_clear(kvw_error *err) {
    if (!err) return;
    err->code = KVW_OK;
    err->rule = "";
    err->needed = 0;
    err->message[0] = 0;
}

kvw_code kvw_fail(kvw_error *err, kvw_code code, const char *rule, const char *fmt, ...) {
    if (err) {
        err->code = code;
        err->rule = rule ? rule : "";
        err->needed = 0;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return code;
}

kvw_code kvw_fail_truncated(kvw_error *err, const char *rule, uint64_t needed) {
    kvw_fail(err, KVW_TRUNCATED, rule, "input ends early: %llu bytes needed",
             (unsigned long long)needed);
    if (err) err->needed = needed;
    return KVW_TRUNCATED;
}

uint32_t kvw_check32(const void *p, size_t n) { return (uint32_t)kvw_xxh3(p, n); } /* kvw_xxh3: hash.c */

/* ---- registry names ---- */
#define NAME_TABLE(fn, ...)                                                              \
    const char *fn(int code) {                                                           \
        static const char *const t[] = {__VA_ARGS__};                                    \
        return (code >= 0 && code < (int)(sizeof t / sizeof t[0])) ? t[code] : NULL;     \
    }
NAME_TABLE(kvw_dtype_name, "bf16", "f16", "f32", "f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz",
           "i8", "u8")
NAME_TABLE(kvw_codec_name, "raw", "zstd", "byteplane_zstd", "fp8", "int_affine")
NAME_TABLE(kvw_component_name, "k", "v", "latent", "state", "positions")
NAME_TABLE(kvw_layer_kind_name, "full_attention", "sliding_attention", "chunked_attention",
           "mla_latent", "shared", "state")
NAME_TABLE(kvw_rope_type_name, "none", "default", "linear", "dynamic", "yarn", "longrope",
           "llama3")
NAME_TABLE(kvw_map_op_name, "copy", "alias", "recompute", "drop")
NAME_TABLE(kvw_scale_granularity_name, "tensor", "head", "token")
NAME_TABLE(kvw_group_axis_name, "tokens", "channels")
NAME_TABLE(kvw_rotation_name, "none", "hadamard", "sylvester") /* 2: revision 1.3 */
NAME_TABLE(kvw_codebook_name, "uniform", "gaussian", "turboquant")

unsigned kvw_dtype_size(int code) {
    static const unsigned sizes[KVW_DTYPE_COUNT] = {2, 2, 4, 1, 1, 1, 1, 1};
    return (code >= 0 && code < KVW_DTYPE_COUNT) ? sizes[code] : 0;
}

double kvw_f64_at(kvw_vec v, uint32_t i) { return kvw_ldf64(v.ptr + 8u * (size_t)i); }
uint32_t kvw_u32_at(kvw_vec v, uint32_t i) { return kvw_ld32(v.ptr + 4u * (size_t)i); }

/* ---- records (8.1) ---- */
void kvw_record_decode(const uint8_t w[KVW_RECORD_SIZE], kvw_record *r) {
    r->offset = kvw_ld64(w);
    r->stored_length = kvw_ld64(w + 8);
    r->raw_length = kvw_ld64(w + 16);
    r->checksum = kvw_ld64(w + 24);
    r->token_start = kvw_ld32(w + 32);
    r->token_count = kvw_ld32(w + 36);
    r->layer = kvw_ld16(w + 40);
    r->component = w[42];
    r->codec = w[43];
    r->flags = kvw_ld16(w + 44);
    r->head_start = kvw_ld16(w + 46);
    r->head_count = kvw_ld16(w + 48);
    r->reserved0 = kvw_ld16(w + 50);
    r->reserved1 = kvw_ld32(w + 52);
}

void kvw_record_encode(const kvw_record *r, uint8_t w[KVW_RECORD_SIZE]) {
    kvw_st64(w, r->offset);
    kvw_st64(w + 8, r->stored_length);
    kvw_st64(w + 16, r->raw_length);
    kvw_st64(w + 24, r->checksum);
    kvw_st32(w + 32, r->token_start);
    kvw_st32(w + 36, r->token_count);
    kvw_st16(w + 40, r->layer);
    w[42] = r->component;
    w[43] = r->codec;
    kvw_st16(w + 44, r->flags);
    kvw_st16(w + 46, r->head_start);
    kvw_st16(w + 48, r->head_count);
    kvw_st16(w + 50, r->reserved0);
    kvw_st32(w + 52, r->reserved1);
}

/* ---- header defaults (KVW-HDR-14, the schema defaults) ---- */
void kvw_header_init(kvw_header *h) {
    memset(h, 0, sizeof *h);
    h->arch.schema_version = 1;
    h->arch.keys_post_rope = 1;
    h->dtype = KVW_DTYPE_BF16;
    h->alignment = 64;
    h->chunk_tokens = 256;
    h->checksum_algorithm = KVW_CHECKSUM_XXH3_64;
    h->prefix.scheme = 1;
}

const kvw_layer_spec *kvw_layer(const kvw_header *h, uint32_t i) {
    if (!h || i >= h->arch.num_layers || !h->arch.layer_spec_index) return NULL;
    uint16_t s = h->arch.layer_spec_index[i];
    if (s >= h->arch.layer_spec_count) return NULL;
    return &h->arch.layer_specs[s];
}

void kvw_rope_init(kvw_rope *r) {
    memset(r, 0, sizeof *r);
    r->rope_type = KVW_ROPE_DEFAULT;
    r->theta = 10000.0;
    r->factor = 1.0;
    r->low_freq_factor = 1.0;
    r->high_freq_factor = 4.0;
    r->beta_fast = 32.0;
    r->beta_slow = 1.0;
    r->attention_factor = 1.0;
    r->mscale = 1.0;
    r->truncate = 1;
}

void kvw_layer_spec_init(kvw_layer_spec *s) {
    memset(s, 0, sizeof *s);
    s->kind = KVW_KIND_FULL_ATTENTION;
    s->source_layer = -1;
    s->uses_rope = 1;
}

void kvw_codec_spec_init(kvw_codec_spec *c) {
    memset(c, 0, sizeof *c);
    c->fp8_format = KVW_DTYPE_F8_E4M3FN;
    c->bits = 8;
    c->group_size = 32;
    c->scale_dtype = KVW_DTYPE_F32;
}

int kvw_codec_spec_uses_rotation(const kvw_codec_spec *c) {
    return c->rotation != KVW_ROTATION_NONE || c->codebook != KVW_CODEBOOK_UNIFORM || c->bits == 3;
}

int kvw_codec_spec_uses_turboquant(const kvw_codec_spec *c) {
    return c->rotation == KVW_ROTATION_SYLVESTER || c->codebook == KVW_CODEBOOK_TURBOQUANT;
}
