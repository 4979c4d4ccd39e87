/*
 * test_unit: libkvwire's own tests, no framework, no Python. Why: the conformance kit
 * (tests/c/test_c_impl.py) drives the CLI over the gold vectors; this program exercises the
 * public API directly -- the pieces a vendoring project calls -- and the failure paths the
 * vectors cannot reach (API misuse, every truncation of a container, a byte-at-a-time feed).
 *
 *   build/c/test_unit            run everything; exit 0 when every check passed
 *   build/c/test_unit -v         also print each passing group
 */
#define _POSIX_C_SOURCE 200809L /* getpid, unlink: the file-sink test */
#include "encode/encode.h" /* every internal layer (encode includes the ones below): the codec pieces */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct tstate { int checks, failures, verbose; } tstate;

#define CHECK(t, cond, ...)                                                                \
    do {                                                                                   \
        (t)->checks++;                                                                     \
        if (!(cond)) {                                                                     \
            (t)->failures++;                                                               \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
        }                                                                                  \
    } while (0)

/* Registry names in the enum order of kvwire.h (spec section 18 is alphabetical). */
static const char *const REGISTRY_NAMES[] = {
    "ARCH_INVALID", "BAD_ALIGNMENT", "BAD_CHUNK_TOKENS", "BAD_FRAME_MARKER", "BAD_MAGIC",
    "BAD_OFFSET", "BODY_CHECKSUM", "BODY_OUT_OF_BOUNDS", "CHUNK_BOUNDARY", "CHUNK_DUPLICATE",
    "CHUNK_MISSING", "CODEC_SPEC_INVALID", "CODEC_SPEC_MISMATCH", "COMPONENT_INVALID",
    "DECODED_SIZE_LIMIT", "DECODED_SIZE_MISMATCH", "DECODE_FAILED", "ENUM_OUT_OF_RANGE",
    "FB_ALIGNMENT", "FB_BOUNDS", "FB_IDENTIFIER", "FB_REQUIRED", "FB_STRING",
    "FB_TOO_COMPLEX", "FB_VTABLE", "FINGERPRINT_INVALID", "FORMAT_ERROR", "FRAME_CHECKSUM",
    "HEADER_CHECKSUM", "HEADER_TOO_LARGE", "HEAD_RANGE", "INDEX_CHECKSUM", "INDEX_MISMATCH",
    "INDEX_POSITION", "INDEX_TOO_LARGE", "KV_SCALES_INVALID", "LAYER_MAP_INVALID",
    "LAYER_OUT_OF_RANGE", "LENGTH_MISMATCH", "LIMIT_EXCEEDED", "METADATA_KEY_DUPLICATE",
    "METADATA_KEY_INVALID", "METADATA_VALUE_INVALID", "MISSING_END", "NONZERO_PADDING",
    "POSITIONS_CODEC", "POSITIONS_ENCODING", "POSITIONS_ORDER", "PREAMBLE_CHECKSUM",
    "PREFIX_INVALID", "RAW_LENGTH_MISMATCH", "RESERVED_NONZERO", "SEGMENT_MISMATCH",
    "SEGMENT_ORDER", "SPARSE_INVALID", "STATE_INVALID", "TEXT_MODE_MANGLED",
    "TOKEN_RANGE_INVALID", "TRAILING_BYTES", "TRUNCATED", "UNKNOWN_CODEC",
    "UNSUPPORTED_FEATURE", "UNSUPPORTED_VERSION", "VERSION_MISMATCH", "ZSTD_CHECKSUM_MISSING",
};

/* ---- KVW-CONV-3 test values ------------------------------------------------------- */
static void test_xxh3(tstate *t) {
    uint8_t seq[256];
    for (int i = 0; i < 256; i++) seq[i] = (uint8_t)i;
    CHECK(t, kvw_xxh3("", 0) == UINT64_C(0x2D06800538D394C2), "empty");
    CHECK(t, kvw_xxh3("kvwire", 6) == UINT64_C(0x3F79916E9B5AA22D), "kvwire");
    CHECK(t, kvw_xxh3(KVW_MAGIC, 8) == UINT64_C(0xC55A6C3362214774), "magic");
    CHECK(t, kvw_xxh3(seq, 256) == UINT64_C(0x9408A4433B952D71), "00..FF");
    CHECK(t, kvw_check32("kvwire", 6) == UINT32_C(0x9B5AA22D), "check32 is the low half");
    static const uint8_t magic[8] = {0x89, 0x4B, 0x56, 0x57, 0x0D, 0x0A, 0x1A, 0x0A};
    CHECK(t, memcmp(KVW_MAGIC, magic, 8) == 0, "KVW_MAGIC bytes");
    CHECK(t, memcmp(KVW_TRAILER_MAGIC, "KVWINDEX", 8) == 0, "trailer magic");
}

/* ---- records (8.1) ------------------------------------------------------------------ */
static void test_records(tstate *t) {
    kvw_record r = {0}, back;
    r.offset = UINT64_C(0x0102030405060708);
    r.stored_length = 0x1112131415161718u;
    r.raw_length = 0x2122232425262728u;
    r.checksum = UINT64_C(0xF1F2F3F4F5F6F7F8);
    r.token_start = 0x31323334u;
    r.token_count = 0x41424344u;
    r.layer = 0x5152;
    r.component = 0x61;
    r.codec = 0x62;
    r.flags = 0x7172;
    r.head_start = 0x8182;
    r.head_count = 0x9192;
    r.reserved0 = 0xA1A2;
    r.reserved1 = 0xB1B2B3B4u;
    uint8_t w[KVW_RECORD_SIZE];
    memset(w, 0xEE, sizeof w);
    kvw_record_encode(&r, w);
    /* byte positions of the table in 8.1, little-endian */
    CHECK(t, w[0] == 0x08 && w[7] == 0x01, "offset at 0");
    CHECK(t, w[8] == 0x18 && w[16] == 0x28 && w[24] == 0xF8, "lengths, checksum");
    CHECK(t, w[32] == 0x34 && w[36] == 0x44, "token fields at 32, 36");
    CHECK(t, w[40] == 0x52 && w[41] == 0x51 && w[42] == 0x61 && w[43] == 0x62, "layer, component, codec");
    CHECK(t, w[44] == 0x72 && w[46] == 0x82 && w[48] == 0x92 && w[50] == 0xA2, "flags, heads, reserved0");
    CHECK(t, w[52] == 0xB4 && w[55] == 0xB1, "reserved1 at 52");
    kvw_record_decode(w, &back);
    CHECK(t, memcmp(&r, &back, sizeof r) == 0 ||
                 (back.offset == r.offset && back.stored_length == r.stored_length &&
                  back.raw_length == r.raw_length && back.checksum == r.checksum &&
                  back.token_start == r.token_start && back.token_count == r.token_count &&
                  back.layer == r.layer && back.component == r.component &&
                  back.codec == r.codec && back.flags == r.flags &&
                  back.head_start == r.head_start && back.head_count == r.head_count &&
                  back.reserved0 == r.reserved0 && back.reserved1 == r.reserved1),
          "round trip");
}

/* ---- error codes and registries ----------------------------------------------------- */
static void test_codes(tstate *t) {
    int n = (int)(sizeof REGISTRY_NAMES / sizeof REGISTRY_NAMES[0]);
    CHECK(t, n == KVW_FORMAT_CODE_COUNT - 1, "registry size %d vs %d", n, KVW_FORMAT_CODE_COUNT - 1);
    for (int i = 1; i < KVW_FORMAT_CODE_COUNT && i - 1 < n; i++) {
        const char *name = kvw_code_name((kvw_code)i);
        CHECK(t, name && strcmp(name, REGISTRY_NAMES[i - 1]) == 0, "code %d named %s, want %s", i,
              name ? name : "(null)", REGISTRY_NAMES[i - 1]);
        CHECK(t, kvw_code_from_name(REGISTRY_NAMES[i - 1]) == (kvw_code)i, "from_name %s",
              REGISTRY_NAMES[i - 1]);
        CHECK(t, kvw_code_is_format_error((kvw_code)i), "%s is a format error", REGISTRY_NAMES[i - 1]);
        if (i > 1) CHECK(t, strcmp(REGISTRY_NAMES[i - 2], REGISTRY_NAMES[i - 1]) < 0, "alphabetical");
    }
    CHECK(t, !kvw_code_is_format_error(KVW_OK), "OK");
    CHECK(t, kvw_code_from_name("NOT_A_CODE") == KVW_OK, "unknown name");
    CHECK(t, kvw_code_from_name("") == KVW_OK, "empty name");
    static const struct { kvw_code c; const char *n; } api[] = {
        {KVW_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT"}, {KVW_ERR_NO_MEMORY, "NO_MEMORY"},
        {KVW_ERR_IO, NULL}, {KVW_ERR_UNSUPPORTED, NULL}, {KVW_ERR_STATE, NULL}};
    for (size_t i = 0; i < sizeof api / sizeof api[0]; i++) {
        const char *name = kvw_code_name(api[i].c);
        /* the header promises "INVALID_ARGUMENT etc."; the others only need a distinct name */
        CHECK(t, name && (!api[i].n || strcmp(name, api[i].n) == 0), "api code %d named %s", (int)api[i].c,
              name ? name : "(null)");
        if (!name) continue;
        for (size_t j = 0; j < i; j++) CHECK(t, strcmp(name, kvw_code_name(api[j].c)) != 0, "distinct names");
        CHECK(t, kvw_code_from_name(name) == KVW_OK, "from_name gives registry codes only");
        if (!api[i].n) continue;
    }
    for (size_t i = 0; i < sizeof api / sizeof api[0]; i++)
        CHECK(t, !kvw_code_is_format_error(api[i].c), "%d is not a format error", (int)api[i].c);
    CHECK(t, kvw_code_name((kvw_code)777) != NULL, "unknown code still has a name");
}

static void test_registries(tstate *t) {
    static const char *const dt[] = {"bf16", "f16", "f32", "f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz", "i8", "u8"};
    static const unsigned ds[] = {2, 2, 4, 1, 1, 1, 1, 1};
    for (int i = 0; i < KVW_DTYPE_COUNT; i++) {
        CHECK(t, kvw_dtype_name(i) && strcmp(kvw_dtype_name(i), dt[i]) == 0, "dtype %d", i);
        CHECK(t, kvw_dtype_size(i) == ds[i], "dtype size %d", i);
    }
    CHECK(t, kvw_dtype_name(KVW_DTYPE_COUNT) == NULL && kvw_dtype_name(-1) == NULL, "dtype range");
    CHECK(t, kvw_dtype_size(KVW_DTYPE_COUNT) == 0 && kvw_dtype_size(255) == 0, "dtype size range");
    static const char *const co[] = {"raw", "zstd", "byteplane_zstd", "fp8", "int_affine"};
    for (int i = 0; i < KVW_CODEC_COUNT; i++)
        CHECK(t, kvw_codec_name(i) && strcmp(kvw_codec_name(i), co[i]) == 0, "codec %d", i);
    CHECK(t, kvw_codec_name(KVW_CODEC_COUNT) == NULL, "codec range");
    static const char *const cm[] = {"k", "v", "latent", "state", "positions"};
    for (int i = 0; i < KVW_COMPONENT_COUNT; i++)
        CHECK(t, kvw_component_name(i) && strcmp(kvw_component_name(i), cm[i]) == 0, "component %d", i);
    CHECK(t, kvw_component_name(KVW_COMPONENT_COUNT) == NULL, "component range");
    static const char *const lk[] = {"full_attention", "sliding_attention", "chunked_attention",
                                     "mla_latent", "shared", "state"};
    for (int i = 0; i < KVW_LAYER_KIND_COUNT; i++)
        CHECK(t, kvw_layer_kind_name(i) && strcmp(kvw_layer_kind_name(i), lk[i]) == 0, "kind %d", i);
    CHECK(t, kvw_layer_kind_name(KVW_LAYER_KIND_COUNT) == NULL, "kind range");
    static const char *const rt[] = {"none", "default", "linear", "dynamic", "yarn", "longrope", "llama3"};
    for (int i = 0; i < KVW_ROPE_TYPE_COUNT; i++)
        CHECK(t, kvw_rope_type_name(i) && strcmp(kvw_rope_type_name(i), rt[i]) == 0, "rope %d", i);
    CHECK(t, kvw_rope_type_name(KVW_ROPE_TYPE_COUNT) == NULL, "rope range");
    static const char *const mo[] = {"copy", "alias", "recompute", "drop"};
    for (int i = 0; i < KVW_MAP_OP_COUNT; i++)
        CHECK(t, kvw_map_op_name(i) && strcmp(kvw_map_op_name(i), mo[i]) == 0, "map op %d", i);
    CHECK(t, kvw_map_op_name(KVW_MAP_OP_COUNT) == NULL, "map op range");
    CHECK(t, strcmp(kvw_scale_granularity_name(2), "token") == 0 && kvw_scale_granularity_name(3) == NULL, "granularity");
    CHECK(t, strcmp(kvw_group_axis_name(1), "channels") == 0 && kvw_group_axis_name(2) == NULL, "group axis");
}

/* ---- layout rule (9.3, Appendix B) --------------------------------------------------- */
static void test_layout(tstate *t) {
    static const uint64_t stored[3] = {8192, 5000, 100};
    static const uint64_t a64[4] = {1280, 9536, 14656, 14848};  /* frames, then end frame */
    static const uint64_t a4k[4] = {4032, 16320, 24512, 28608};
    const uint64_t *want[2] = {a64, a4k};
    const uint64_t align[2] = {64, 4096};
    for (int k = 0; k < 2; k++) {
        uint64_t prev = 32 + 1234, frame = 0;
        for (int i = 0; i < 4; i++) {
            CHECK(t, kvw_next_frame_offset(prev, align[k], &frame) == 0, "no overflow");
            CHECK(t, frame == want[k][i], "A=%llu item %d: frame %llu want %llu",
                  (unsigned long long)align[k], i, (unsigned long long)frame,
                  (unsigned long long)want[k][i]);
            if (i < 3) prev = frame + 64 + stored[i];
        }
        CHECK(t, frame + 64 == (k ? 28672u : 14912u), "container end");
    }
    uint64_t out;
    CHECK(t, kvw_next_frame_offset(UINT64_MAX - 10, 64, &out) == 1, "overflow detected");
    CHECK(t, kvw_align_up(UINT64_MAX - 2, 64, &out) == 1, "align_up overflow");
    CHECK(t, kvw_align_up(65, 64, &out) == 0 && out == 128, "align_up");
    CHECK(t, kvw_mul_ovf(UINT64_C(1) << 40, UINT64_C(1) << 30, &out) == 1, "mul overflow");
    CHECK(t, kvw_add_ovf(UINT64_MAX, 1, &out) == 1, "add overflow");
}

/* ---- a small cache: 3 layers (full, full, sliding) x 2 heads x 8 dim, bf16 --------------- */
enum { L = 3, H = 2, D = 8, T = 10, CT = 4 };

typedef struct msink { uint8_t *buf; size_t len, cap; int fail_after; int calls; } msink;

static int msink_write(void *ctx, const kvw_iovec *parts, int nparts) {
    msink *s = ctx;
    if (s->fail_after >= 0 && s->calls++ >= s->fail_after) return 1;
    for (int i = 0; i < nparts; i++) {
        if (s->len + parts[i].len > s->cap) {
            size_t cap = s->cap ? s->cap : 4096;
            while (cap < s->len + parts[i].len) cap *= 2;
            uint8_t *b = realloc(s->buf, cap);
            if (!b) return 1;
            s->buf = b;
            s->cap = cap;
        }
        if (parts[i].len) memcpy(s->buf + s->len, parts[i].base, parts[i].len);
        s->len += parts[i].len;
    }
    return 0;
}

typedef struct cache {
    kvw_layer_spec specs[2];
    uint16_t index[L];
    kvw_header h;
    uint8_t tensors[L][2][H * T * D * 2]; /* canonical bytes [heads, T, dim] bf16 */
} cache;

static void cache_init(cache *c, int compressible) {
    kvw_layer_spec_init(&c->specs[0]);
    c->specs[0].num_kv_heads = H;
    c->specs[0].head_dim_k = D;
    c->specs[0].head_dim_v = D;
    kvw_layer_spec_init(&c->specs[1]);
    c->specs[1] = c->specs[0];
    c->specs[1].kind = KVW_KIND_SLIDING_ATTENTION;
    c->specs[1].window = 4;
    c->index[0] = 0;
    c->index[1] = 0;
    c->index[2] = 1;
    kvw_header_init(&c->h);
    c->h.arch.num_layers = L;
    c->h.arch.layer_specs = c->specs;
    c->h.arch.layer_spec_count = 2;
    c->h.arch.layer_spec_index = c->index;
    c->h.arch.layer_spec_index_count = L;
    c->h.dtype = KVW_DTYPE_BF16;
    c->h.chunk_tokens = CT;
    c->h.token_count = T;
    c->h.first_position = 5;
    uint32_t x = 12345;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < sizeof c->tensors[l][k]; i++) {
                x = x * 1103515245u + 12345u;
                c->tensors[l][k][i] = compressible ? (uint8_t)((i / 16) & 3) : (uint8_t)(x >> 16);
            }
}

/* Write the cache with the given form and codec; chunks in reverse container order when
 * `reverse` (any order is allowed, KVW-CHUNK-8). Returns the writer's result. */
static kvw_code write_cache(cache *c, kvw_form form, int codec, int reverse, msink *s,
                            kvw_error *err) {
    kvw_writer_options wo = {form, 0};
    kvw_writer *w = NULL;
    kvw_code rc = kvw_writer_new(&c->h, &wo, msink_write, s, &w, err);
    if (rc) return rc;
    int nchunks = (T + CT - 1) / CT;
    for (int n = 0; n < L * 2 * nchunks && !rc; n++) {
        int idx = reverse ? L * 2 * nchunks - 1 - n : n;
        int l = idx / (2 * nchunks), k = (idx / nchunks) % 2, j = idx % nchunks;
        uint32_t start = (uint32_t)(j * CT), count = (uint32_t)(T - start < CT ? T - start : CT);
        kvw_iovec parts[H];
        for (int hh = 0; hh < H; hh++) {
            parts[hh].base = c->tensors[l][k] + ((size_t)hh * T + start) * D * 2;
            parts[hh].len = (size_t)count * D * 2;
        }
        rc = kvw_writer_add(w, (uint32_t)l, k, start, count, codec, 0, parts, H, err);
    }
    if (!rc) rc = kvw_writer_finish(w, err);
    kvw_writer_free(w);
    return rc;
}

static void check_reader(tstate *t, cache *c, const msink *s, kvw_form form, const char *what) {
    kvw_error err;
    kvw_reader *r = NULL;
    kvw_code rc = kvw_open(s->buf, s->len, NULL, &r, &err);
    CHECK(t, rc == KVW_OK, "%s: open: %s %s %s", what, kvw_code_name(rc), err.rule, err.message);
    if (rc) return;
    CHECK(t, kvw_reader_form(r) == form, "%s: form", what);
    CHECK(t, kvw_reader_size(r) == s->len, "%s: size", what);
    const kvw_header *h = kvw_reader_header(r);
    CHECK(t, h && h->arch.num_layers == L && h->token_count == T && h->chunk_tokens == CT &&
                 h->first_position == 5 && h->dtype == KVW_DTYPE_BF16, "%s: header fields", what);
    CHECK(t, h && h->layer_tokens_count == L && !h->has_layer_tokens, "%s: default layer ranges", what);
    CHECK(t, h && h->layer_tokens && h->layer_tokens[2].count == T, "%s: layer range count", what);
    CHECK(t, h && kvw_layer(h, 2) && kvw_layer(h, 2)->kind == KVW_KIND_SLIDING_ATTENTION &&
                 kvw_layer(h, 2)->window == 4 && kvw_layer(h, 3) == NULL, "%s: kvw_layer", what);
    CHECK(t, h && h->format_major == 1, "%s: format_major", what);
    CHECK(t, kvw_chunk_count(r) == (size_t)L * 2 * 3, "%s: chunk count %zu", what, kvw_chunk_count(r));
    CHECK(t, kvw_reader_decoded_size(r) == (uint64_t)L * 2 * H * T * D * 2, "%s: decoded size", what);
    CHECK(t, kvw_chunk_record(r, kvw_chunk_count(r)) == NULL, "%s: record out of range", what);
    rc = kvw_validate(r, &err);
    CHECK(t, rc == KVW_OK, "%s: validate: %s %s %s", what, kvw_code_name(rc), err.rule, err.message);
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) {
            kvw_tensor_info info;
            rc = kvw_tensor_info_of(r, (uint32_t)l, k, 0, &info, &err);
            CHECK(t, rc == KVW_OK && info.ndim == 3 && info.shape[0] == H && info.shape[1] == T &&
                         info.shape[2] == D && info.nbytes == sizeof c->tensors[l][k] &&
                         info.dtype == KVW_DTYPE_BF16,
                  "%s: tensor info %d/%d: %s", what, l, k, kvw_code_name(rc));
            uint8_t out[H * T * D * 2 + 8];
            memset(out, 0xCD, sizeof out);
            rc = kvw_read_tensor(r, (uint32_t)l, k, 0, out, sizeof out, &err);
            CHECK(t, rc == KVW_OK, "%s: read_tensor %d/%d: %s %s", what, l, k, kvw_code_name(rc), err.message);
            CHECK(t, memcmp(out, c->tensors[l][k], sizeof c->tensors[l][k]) == 0, "%s: tensor %d/%d bytes", what, l, k);
            CHECK(t, out[sizeof out - 1] == 0xCD, "%s: no write past nbytes", what);
            size_t idx = 99;
            rc = kvw_find_chunk(r, (uint32_t)l, k, 2, &idx, &err);
            CHECK(t, rc == KVW_OK && idx < kvw_chunk_count(r), "%s: find_chunk", what);
            if (!rc && idx < kvw_chunk_count(r)) {
                const kvw_record *rec = kvw_chunk_record(r, idx);
                CHECK(t, rec->layer == l && rec->component == k && rec->token_start == 8 &&
                             rec->token_count == 2 && rec->raw_length == (uint64_t)H * 2 * D * 2,
                      "%s: found record", what);
                uint8_t one[H * 2 * D * 2];
                rc = kvw_read_chunk(r, idx, one, sizeof one, &err);
                CHECK(t, rc == KVW_OK, "%s: read_chunk %s", what, kvw_code_name(rc));
                for (int hh = 0; hh < H && !rc; hh++)
                    CHECK(t, memcmp(one + (size_t)hh * 2 * D * 2,
                                    c->tensors[l][k] + ((size_t)hh * T + 8) * D * 2, 2 * D * 2) == 0,
                          "%s: chunk bytes head %d", what, hh);
                if (rec->codec == KVW_CODEC_RAW) {
                    const uint8_t *p = NULL;
                    size_t n = 0;
                    rc = kvw_chunk_view(r, idx, &p, &n, &err);
                    CHECK(t, rc == KVW_OK && n == rec->raw_length && p >= (const uint8_t *)s->buf &&
                                 p + n <= (const uint8_t *)s->buf + s->len, "%s: chunk_view", what);
                } else {
                    const uint8_t *p = NULL;
                    size_t n = 0;
                    rc = kvw_chunk_view(r, idx, &p, &n, &err);
                    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: view of a %s chunk: %s", what,
                          kvw_codec_name(rec->codec), kvw_code_name(rc));
                }
            }
        }
    /* misuse */
    uint8_t small[4];
    rc = kvw_read_tensor(r, 0, KVW_COMP_K, 0, small, sizeof small, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: short output buffer: %s", what, kvw_code_name(rc));
    kvw_tensor_info info;
    rc = kvw_tensor_info_of(r, L, KVW_COMP_K, 0, &info, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: layer out of range: %s", what, kvw_code_name(rc));
    rc = kvw_tensor_info_of(r, 0, KVW_COMP_LATENT, 0, &info, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: component not stored: %s", what, kvw_code_name(rc));
    rc = kvw_tensor_info_of(r, 0, 99, 0, &info, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: component code: %s", what, kvw_code_name(rc));
    size_t idx;
    rc = kvw_find_chunk(r, 0, KVW_COMP_K, 3, &idx, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: cell out of range: %s", what, kvw_code_name(rc));
    rc = kvw_read_chunk(r, kvw_chunk_count(r), small, sizeof small, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: chunk index out of range: %s", what, kvw_code_name(rc));
    rc = kvw_read_chunk(r, 0, small, sizeof small, &err);
    CHECK(t, rc == KVW_ERR_INVALID_ARGUMENT, "%s: short chunk buffer: %s", what, kvw_code_name(rc));
    kvw_close(r);
}

/* Feed the container one byte at a time; every chunk event's data must match. */
static void check_decoder(tstate *t, cache *c, const msink *s, kvw_form form, const char *what,
                          size_t step) {
    kvw_decoder_options o;
    memset(&o, 0, sizeof o);
    o.decode_bodies = 1;
    kvw_decoder *d = NULL;
    kvw_error err;
    kvw_code rc = kvw_decoder_new(&o, &d, &err);
    CHECK(t, rc == KVW_OK, "%s: decoder_new", what);
    if (rc) return;
    size_t fed = 0;
    int headers = 0, chunks = 0, ends = 0, eof = 0, guard = 0;
    while (!eof && guard++ < 10000000) {
        kvw_event ev;
        rc = kvw_next(d, &ev, &err);
        if (rc) {
            CHECK(t, 0, "%s: next at %zu: %s %s %s", what, fed, kvw_code_name(rc), err.rule, err.message);
            break;
        }
        switch (ev.type) {
        case KVW_EVENT_NEED_DATA:
            if (fed < s->len) {
                size_t n = s->len - fed < step ? s->len - fed : step;
                rc = kvw_decoder_feed(d, s->buf + fed, n, &err);
                fed += n;
            } else {
                rc = kvw_decoder_finish(d, &err);
                fed++; /* finish only once */
            }
            if (rc) {
                CHECK(t, 0, "%s: feed/finish: %s %s", what, kvw_code_name(rc), err.message);
                eof = 1;
            }
            if (fed > s->len + 1) { CHECK(t, 0, "%s: NEED_DATA after finish", what); eof = 1; }
            break;
        case KVW_EVENT_HEADER:
            headers++;
            CHECK(t, ev.header && ev.header->token_count == T && ev.header->arch.num_layers == L, "%s: header event", what);
            break;
        case KVW_EVENT_CHUNK: {
            chunks++;
            const kvw_record *rec = ev.record;
            CHECK(t, rec && ev.data && ev.data_len == rec->raw_length, "%s: chunk event", what);
            if (rec && ev.data && rec->layer < L && rec->component < 2 && rec->token_start + rec->token_count <= T) {
                size_t row = (size_t)rec->token_count * D * 2;
                for (int hh = 0; hh < H; hh++)
                    CHECK(t, memcmp(ev.data + hh * row,
                                    c->tensors[rec->layer][rec->component] +
                                        ((size_t)hh * T + rec->token_start) * D * 2, row) == 0,
                          "%s: chunk data l%u c%u t%u", what, rec->layer, rec->component, rec->token_start);
            }
            break;
        }
        case KVW_EVENT_END:
            ends++;
            CHECK(t, ev.form == form, "%s: END form %d", what, (int)ev.form);
            break;
        case KVW_EVENT_EOF:
            eof = 1;
            break;
        }
    }
    CHECK(t, headers == 1 && chunks == L * 2 * 3 && ends == 1 && eof, "%s: events h%d c%d e%d eof%d",
          what, headers, chunks, ends, eof);
    kvw_decoder_free(d);
}

/* Every proper prefix of the container is rejected with a registry code by the reader and
 * by the decoder, except the stream-form prefix of a file-form container (a valid stream). */
static void check_truncations(tstate *t, const msink *s, size_t stream_len, const char *what) {
    int bad = 0;
    for (size_t n = 0; n < s->len; n++) {
        kvw_error err;
        kvw_reader *r = NULL;
        /* a copy of exactly n bytes, so ASan sees any read past the end */
        uint8_t *copy = malloc(n ? n : 1);
        if (!copy) { CHECK(t, 0, "malloc"); return; }
        if (n) memcpy(copy, s->buf, n);
        kvw_code rc = kvw_open(copy, n, NULL, &r, &err);
        if (rc == KVW_OK) {
            rc = kvw_validate(r, &err);
            if (rc == KVW_OK && !(n == stream_len && kvw_reader_form(r) == KVW_FORM_STREAM)) {
                if (bad++ < 5) CHECK(t, 0, "%s: prefix of %zu bytes accepted", what, n);
            }
            kvw_close(r);
        }
        if (rc != KVW_OK && !(kvw_code_is_format_error(rc) && err.code == rc && strncmp(err.rule, "KVW-", 4) == 0)) {
            if (bad++ < 5)
                CHECK(t, 0, "%s: prefix %zu: code %s rule '%s' (%s)", what, n, kvw_code_name(rc), err.rule, err.message);
        }
        /* the decoder: whole prefix, then finish */
        kvw_decoder_options o;
        memset(&o, 0, sizeof o);
        kvw_decoder *d = NULL;
        if (kvw_decoder_new(&o, &d, &err) == KVW_OK) {
            rc = kvw_decoder_feed(d, copy, n, &err);
            if (!rc) rc = kvw_decoder_finish(d, &err);
            kvw_event ev;
            memset(&ev, 0, sizeof ev);
            int guard = 0;
            while (!rc && guard++ < 1000) {
                rc = kvw_next(d, &ev, &err);
                if (!rc && (ev.type == KVW_EVENT_EOF || ev.type == KVW_EVENT_NEED_DATA)) break;
            }
            if (rc == KVW_OK && n != stream_len) {
                if (bad++ < 5) CHECK(t, 0, "%s: decoder accepted a prefix of %zu bytes (event %d)", what, n, (int)ev.type);
            } else if (rc != KVW_OK && !kvw_code_is_format_error(rc)) {
                if (bad++ < 5) CHECK(t, 0, "%s: decoder prefix %zu: %s", what, n, kvw_code_name(rc));
            }
            kvw_decoder_free(d);
        }
        free(copy);
    }
    CHECK(t, bad == 0, "%s: %d bad prefixes", what, bad);
}

static void test_roundtrips(tstate *t) {
    static const struct { kvw_form form; int codec; int compressible; int reverse; const char *what; } cases[] = {
        {KVW_FORM_FILE, KVW_CODEC_RAW, 0, 0, "file raw"},
        {KVW_FORM_STREAM, KVW_CODEC_RAW, 0, 1, "stream raw reversed"},
        {KVW_FORM_FILE, KVW_CODEC_ZSTD, 1, 1, "file zstd reversed"},
        {KVW_FORM_STREAM, KVW_CODEC_ZSTD, 1, 0, "stream zstd"},
        {KVW_FORM_FILE, KVW_CODEC_ZSTD, 0, 0, "file zstd incompressible"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cache *c = calloc(1, sizeof *c);
        if (!c) { CHECK(t, 0, "calloc"); return; }
        cache_init(c, cases[i].compressible);
        msink s = {NULL, 0, 0, -1, 0};
        kvw_error err;
        kvw_code rc = write_cache(c, cases[i].form, cases[i].codec, cases[i].reverse, &s, &err);
        CHECK(t, rc == KVW_OK, "%s: write: %s %s %s", cases[i].what, kvw_code_name(rc), err.rule, err.message);
        if (rc == KVW_OK) {
            check_reader(t, c, &s, cases[i].form, cases[i].what);
            check_decoder(t, c, &s, cases[i].form, cases[i].what, 1);
            check_decoder(t, c, &s, cases[i].form, cases[i].what, 777);
            /* the codec the writer chose: zstd where it is smaller, raw otherwise (CHUNK-6) */
            kvw_reader *r = NULL;
            if (kvw_open(s.buf, s.len, NULL, &r, NULL) == KVW_OK) {
                int zstd = 0;
                for (size_t j = 0; j < kvw_chunk_count(r); j++) zstd += kvw_chunk_record(r, j)->codec == KVW_CODEC_ZSTD;
                if (cases[i].codec == KVW_CODEC_ZSTD && cases[i].compressible)
                    CHECK(t, zstd > 0, "%s: compressible chunks stored zstd", cases[i].what);
                if (cases[i].codec == KVW_CODEC_RAW || !cases[i].compressible)
                    CHECK(t, zstd == 0, "%s: %d zstd chunks", cases[i].what, zstd);
                /* the header parser on its own, over the header bytes */
                if (s.len >= 32) {
                    uint32_t hl = kvw_ld32(s.buf + 12);
                    if (hl <= s.len - 32) {
                        kvw_header h;
                        kvw_header_init(&h);
                        rc = kvw_header_parse(s.buf + 32, hl, &h, &err);
                        CHECK(t, rc == KVW_OK && h.token_count == T && h.arch.num_layers == L,
                              "%s: header_parse %s %s", cases[i].what, kvw_code_name(rc), err.message);
                        kvw_header_free(&h);
                        rc = kvw_header_parse(s.buf + 32, hl - 1, &h, &err);
                        CHECK(t, rc != KVW_OK && kvw_code_is_format_error(rc), "%s: short header: %s", cases[i].what, kvw_code_name(rc));
                        kvw_header_free(&h);
                    }
                }
                kvw_close(r);
            }
            /* truncations (the two raw containers; zstd ones add nothing structural) */
            if (cases[i].codec == KVW_CODEC_RAW || i == 3) {
                size_t stream_len = s.len;
                if (cases[i].form == KVW_FORM_FILE) {
                    msink st = {NULL, 0, 0, -1, 0};
                    if (write_cache(c, KVW_FORM_STREAM, cases[i].codec, cases[i].reverse, &st, NULL) == KVW_OK)
                        stream_len = st.len;
                    free(st.buf);
                }
                check_truncations(t, &s, stream_len, cases[i].what);
                /* a flipped body byte: BODY_CHECKSUM on validate */
                uint8_t *mut = malloc(s.len);
                if (mut) {
                    memcpy(mut, s.buf, s.len);
                    kvw_reader *r2 = NULL;
                    if (kvw_open(mut, s.len, NULL, &r2, NULL) == KVW_OK) {
                        uint64_t off = kvw_chunk_record(r2, 0)->offset;
                        int raw0 = kvw_chunk_record(r2, 0)->codec == KVW_CODEC_RAW;
                        kvw_close(r2);
                        mut[off] ^= 1;
                        rc = kvw_open(mut, s.len, NULL, &r2, &err);
                        if (rc == KVW_OK) {
                            rc = kvw_validate(r2, &err);
                            kvw_close(r2);
                        }
                        CHECK(t, rc == KVW_BODY_CHECKSUM && strcmp(err.rule, "KVW-CSUM-1") == 0,
                              "%s: flipped body byte: %s %s", cases[i].what, kvw_code_name(rc), err.rule);
                        kvw_options o = {0, 1};
                        rc = kvw_open(mut, s.len, &o, &r2, &err);
                        if (rc == KVW_OK) {
                            uint8_t out[H * T * D * 2];
                            rc = kvw_read_tensor(r2, 0, KVW_COMP_K, 0, out, sizeof out, &err);
                            kvw_close(r2);
                        }
                        /* a raw body is read as it is; a compressed one may no longer decode */
                        CHECK(t, raw0 ? rc == KVW_OK : (rc == KVW_OK || rc == KVW_DECODE_FAILED),
                              "%s: skip_body_checksums reads the flipped body: %s", cases[i].what, kvw_code_name(rc));
                    }
                    free(mut);
                }
            }
        }
        free(s.buf);
        free(c);
    }
}

/* The atomic file sink (KVW-FILE-6) and kvw_open_file over what it wrote. */
static void test_file_sink(tstate *t) {
    cache *c = calloc(1, sizeof *c);
    if (!c) return;
    cache_init(c, 1);
    char path[512];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/kvw-test-unit-%ld.kvw", dir && *dir ? dir : "/tmp", (long)getpid());
    kvw_error err;
    for (int commit = 0; commit < 2; commit++) {
        kvw_file_sink *fs = NULL;
        kvw_code rc = kvw_file_sink_open(path, &fs, &err);
        CHECK(t, rc == KVW_OK, "file_sink_open %s: %s %s", path, kvw_code_name(rc), err.message);
        if (rc) break;
        kvw_writer_options wo = {KVW_FORM_FILE, 0};
        kvw_writer *w = NULL;
        rc = kvw_writer_new(&c->h, &wo, kvw_file_sink_write, fs, &w, &err);
        int nchunks = (T + CT - 1) / CT;
        for (int l = 0; l < L && !rc; l++)
            for (int k = 0; k < 2 && !rc; k++)
                for (int j = 0; j < nchunks && !rc; j++) {
                    uint32_t start = (uint32_t)(j * CT), count = (uint32_t)(T - start < CT ? T - start : CT);
                    kvw_iovec parts[H];
                    for (int hh = 0; hh < H; hh++) {
                        parts[hh].base = c->tensors[l][k] + ((size_t)hh * T + start) * D * 2;
                        parts[hh].len = (size_t)count * D * 2;
                    }
                    rc = kvw_writer_add(w, (uint32_t)l, k, start, count, KVW_CODEC_ZSTD, 0, parts, H, &err);
                }
        if (!rc) rc = kvw_writer_finish(w, &err);
        kvw_writer_free(w);
        CHECK(t, rc == KVW_OK, "write to the file sink: %s %s", kvw_code_name(rc), err.message);
        rc = kvw_file_sink_close(fs, commit, &err);
        CHECK(t, rc == KVW_OK, "file_sink_close(commit=%d): %s %s", commit, kvw_code_name(rc), err.message);
        struct stat st;
        int exists = stat(path, &st) == 0;
        CHECK(t, exists == commit, "commit=%d: the file %s", commit, exists ? "exists" : "does not exist");
    }
    kvw_reader *r = NULL;
    kvw_code rc = kvw_open_file(path, NULL, &r, &err);
    CHECK(t, rc == KVW_OK, "open_file: %s %s", kvw_code_name(rc), err.message);
    if (rc == KVW_OK) {
        CHECK(t, kvw_reader_form(r) == KVW_FORM_FILE, "file form");
        CHECK(t, kvw_validate(r, &err) == KVW_OK, "validate the mapped file: %s", err.message);
        uint8_t out[H * T * D * 2];
        rc = kvw_read_tensor(r, 2, KVW_COMP_V, 0, out, sizeof out, &err);
        CHECK(t, rc == KVW_OK && memcmp(out, c->tensors[2][1], sizeof out) == 0, "tensor from the mapped file");
        kvw_close(r);
    }
    unlink(path);
    free(c);
}

static void test_decoder_concatenated(tstate *t) {
    cache *c = calloc(1, sizeof *c);
    if (!c) return;
    cache_init(c, 0);
    msink s = {NULL, 0, 0, -1, 0};
    if (write_cache(c, KVW_FORM_STREAM, KVW_CODEC_RAW, 0, &s, NULL) == KVW_OK &&
        write_cache(c, KVW_FORM_STREAM, KVW_CODEC_RAW, 1, &s, NULL) == KVW_OK) {
        kvw_decoder_options o;
        memset(&o, 0, sizeof o);
        kvw_error err;
        kvw_decoder *d = NULL;
        int ends = 0, chunks = 0;
        kvw_code rc = kvw_decoder_new(&o, &d, &err);
        if (!rc) rc = kvw_decoder_feed(d, s.buf, s.len, &err);
        if (!rc) rc = kvw_decoder_finish(d, &err);
        kvw_event ev;
        memset(&ev, 0, sizeof ev);
        for (int g = 0; !rc && g < 1000; g++) {
            rc = kvw_next(d, &ev, &err);
            if (rc || ev.type == KVW_EVENT_EOF || ev.type == KVW_EVENT_NEED_DATA) break;
            ends += ev.type == KVW_EVENT_END;
            chunks += ev.type == KVW_EVENT_CHUNK;
        }
        CHECK(t, rc != KVW_OK && kvw_code_is_format_error(rc), "two containers without concatenated: %s", kvw_code_name(rc));
        kvw_decoder_free(d);
        o.concatenated = 1;
        d = NULL;
        ends = chunks = 0;
        rc = kvw_decoder_new(&o, &d, &err);
        if (!rc) rc = kvw_decoder_feed(d, s.buf, s.len, &err);
        if (!rc) rc = kvw_decoder_finish(d, &err);
        for (int g = 0; !rc && g < 1000; g++) {
            rc = kvw_next(d, &ev, &err);
            if (rc || ev.type == KVW_EVENT_EOF || ev.type == KVW_EVENT_NEED_DATA) break;
            ends += ev.type == KVW_EVENT_END;
            chunks += ev.type == KVW_EVENT_CHUNK;
        }
        CHECK(t, rc == KVW_OK && ev.type == KVW_EVENT_EOF && ends == 2 && chunks == 2 * L * 2 * 3,
              "concatenated: %s ends %d chunks %d", kvw_code_name(rc), ends, chunks);
        /* after an error the decoder keeps returning it */
        kvw_decoder_free(d);
        d = NULL;
        if (kvw_decoder_new(&o, &d, &err) == KVW_OK) {
            uint8_t junk[64] = "not a kvwire container at all..";
            kvw_decoder_feed(d, junk, sizeof junk, &err);
            kvw_code a = kvw_next(d, &ev, &err);
            kvw_code b = kvw_next(d, &ev, &err);
            CHECK(t, a == KVW_BAD_MAGIC && b == a, "sticky error: %s then %s", kvw_code_name(a), kvw_code_name(b));
            kvw_decoder_free(d);
        }
    }
    free(s.buf);
    free(c);
}

/* ---- API misuse --------------------------------------------------------------------- */
static void test_misuse(tstate *t) {
    kvw_error err;
    kvw_reader *r = NULL;
    static const uint8_t junk[64] = {0};
    CHECK(t, kvw_open(junk, sizeof junk, NULL, NULL, &err) == KVW_ERR_INVALID_ARGUMENT, "open without out");
    CHECK(t, kvw_open(NULL, 10, NULL, &r, &err) == KVW_ERR_INVALID_ARGUMENT, "open NULL buffer with a length");
    kvw_code rc = kvw_open(junk, sizeof junk, NULL, &r, &err);
    CHECK(t, rc == KVW_BAD_MAGIC && err.code == KVW_BAD_MAGIC, "zeros: %s", kvw_code_name(rc));
    rc = kvw_open(junk, sizeof junk, NULL, &r, NULL);
    CHECK(t, rc == KVW_BAD_MAGIC, "NULL error pointer is allowed");
    rc = kvw_open(KVW_MAGIC, 8, NULL, &r, &err);
    CHECK(t, rc == KVW_TRUNCATED && err.needed >= 32, "magic only: %s needed %llu", kvw_code_name(rc),
          (unsigned long long)err.needed);
    rc = kvw_open_file("/nonexistent/dir/x.kvw", NULL, &r, &err);
    CHECK(t, rc == KVW_ERR_IO, "missing file: %s", kvw_code_name(rc));
    kvw_close(NULL);
    kvw_decoder_free(NULL);
    kvw_writer_free(NULL);
    kvw_header h;
    kvw_header_init(&h);
    kvw_header_free(&h);
    CHECK(t, h.alignment == 64 && h.chunk_tokens == 256 && h.dtype == KVW_DTYPE_BF16, "header defaults");

    cache *c = calloc(1, sizeof *c);
    if (!c) return;
    cache_init(c, 0);
    msink s = {NULL, 0, 0, -1, 0};
    kvw_writer *w = NULL;
    kvw_writer_options wo = {KVW_FORM_FILE, 0};
    rc = kvw_writer_new(&c->h, &wo, msink_write, &s, &w, &err);
    CHECK(t, rc == KVW_OK, "writer_new: %s %s", kvw_code_name(rc), err.message);
    if (!rc) {
        kvw_iovec part = {c->tensors[0][0], (size_t)CT * D * 2};
        kvw_iovec parts[H] = {part, part};
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 1, CT, KVW_CODEC_RAW, 0, parts, H, &err);
        CHECK(t, rc != KVW_OK, "chunk off the grid accepted");
        rc = kvw_writer_add(w, L, KVW_COMP_K, 0, CT, KVW_CODEC_RAW, 0, parts, H, &err);
        CHECK(t, rc != KVW_OK, "layer out of range accepted");
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 0, CT, 42, 0, parts, H, &err);
        CHECK(t, rc != KVW_OK, "unknown codec accepted");
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 0, CT, KVW_CODEC_RAW, 0, parts, 1, &err);
        CHECK(t, rc != KVW_OK, "short chunk accepted");
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 0, CT, KVW_CODEC_RAW, 0, parts, H, &err);
        CHECK(t, rc == KVW_OK, "good chunk: %s %s", kvw_code_name(rc), err.message);
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 0, CT, KVW_CODEC_RAW, 0, parts, H, &err);
        CHECK(t, rc != KVW_OK, "duplicate chunk accepted");
        rc = kvw_writer_finish(w, &err);
        CHECK(t, rc != KVW_OK && !kvw_code_is_format_error(rc), "finish with missing chunks: %s", kvw_code_name(rc));
        kvw_writer_free(w);
    }
    /* a header breaking a rule: no writer (KVW-WRITE-1) */
    c->h.chunk_tokens = 0;
    w = NULL;
    rc = kvw_writer_new(&c->h, &wo, msink_write, &s, &w, &err);
    CHECK(t, rc != KVW_OK && w == NULL, "chunk_tokens 0 accepted: %s", kvw_code_name(rc));
    c->h.chunk_tokens = CT;
    /* the sink fails: KVW_ERR_IO */
    for (int after = 0; after < 4; after++) {
        msink fs = {NULL, 0, 0, after, 0};
        rc = write_cache(c, KVW_FORM_FILE, KVW_CODEC_RAW, 0, &fs, &err);
        CHECK(t, rc == KVW_ERR_IO, "sink failing after %d calls: %s", after, kvw_code_name(rc));
        free(fs.buf);
    }
    /* finish twice, add after finish */
    s.len = 0;
    w = NULL;
    c->h.token_count = 0; /* no chunks */
    rc = kvw_writer_new(&c->h, &wo, msink_write, &s, &w, &err);
    if (rc == KVW_OK) {
        rc = kvw_writer_finish(w, &err);
        CHECK(t, rc == KVW_OK, "empty cache finish: %s %s", kvw_code_name(rc), err.message);
        kvw_iovec part = {c->tensors[0][0], 16};
        rc = kvw_writer_add(w, 0, KVW_COMP_K, 0, 1, KVW_CODEC_RAW, 0, &part, 1, &err);
        CHECK(t, rc == KVW_ERR_STATE, "add after finish: %s", kvw_code_name(rc));
        rc = kvw_writer_finish(w, &err);
        CHECK(t, rc == KVW_ERR_STATE, "finish twice: %s", kvw_code_name(rc));
        kvw_writer_free(w);
        r = NULL;
        rc = kvw_open(s.buf, s.len, NULL, &r, &err);
        CHECK(t, rc == KVW_OK && kvw_chunk_count(r) == 0, "zero-token container: %s %s", kvw_code_name(rc), err.message);
        if (r) {
            CHECK(t, kvw_validate(r, &err) == KVW_OK, "zero-token validate");
            kvw_close(r);
        }
    } else {
        CHECK(t, 0, "zero-token writer: %s %s", kvw_code_name(rc), err.message);
    }
    free(s.buf);
    free(c);

    kvw_decoder *d = NULL;
    CHECK(t, kvw_decoder_new(NULL, &d, &err) == KVW_OK, "decoder with default options");
    if (d) {
        kvw_event ev;
        CHECK(t, kvw_next(d, &ev, &err) == KVW_OK && ev.type == KVW_EVENT_NEED_DATA, "fresh decoder needs data");
        CHECK(t, kvw_decoder_feed(d, NULL, 0, &err) == KVW_OK, "feeding nothing (NULL, 0)");
        CHECK(t, kvw_decoder_finish(d, &err) == KVW_OK, "finish");
        rc = kvw_next(d, &ev, &err);
        CHECK(t, rc == KVW_TRUNCATED, "empty input is TRUNCATED: %s", kvw_code_name(rc));
        kvw_decoder_free(d);
    }
    CHECK(t, kvw_decoder_new(NULL, NULL, &err) == KVW_ERR_INVALID_ARGUMENT, "decoder_new without out");
}

/* Lossy writing (spec/codecs.md): an fp8 codec spec on K/V chunks, decoded within fp8's
 * error; a chunk holding NaN (KVW-LOSSY-6) is stored losslessly with codec_spec 0. */
static void test_lossy_writer(tstate *t) {
    cache *c = calloc(1, sizeof *c);
    if (!c) { CHECK(t, 0, "calloc"); return; }
    cache_init(c, 0);
    for (int l = 0; l < L; l++) /* finite bf16 values in [-2, 2): the upper halves of floats */
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < sizeof c->tensors[l][k] / 2; i++) {
                float f = (float)((int)((i * 37 + (size_t)l * 11 + (size_t)k * 5) % 64) - 32) / 16.0f;
                uint32_t u;
                memcpy(&u, &f, 4);
                c->tensors[l][k][2 * i] = (uint8_t)(u >> 16);
                c->tensors[l][k][2 * i + 1] = (uint8_t)(u >> 24);
            }
    c->tensors[1][0][1] = 0x7F; /* layer 1 K, first element: bf16 NaN 0x7FC0 */
    c->tensors[1][0][0] = 0xC0;
    kvw_codec_spec spec;
    kvw_codec_spec_init(&spec);
    spec.codec = KVW_CODEC_FP8;
    spec.scale_granularity = KVW_SCALE_HEAD;
    c->h.codec_specs = &spec;
    c->h.codec_spec_count = 1;
    c->h.required_features = KVW_FEATURE_CODEC_SPECS;
    msink s = {NULL, 0, 0, -1, 0};
    kvw_error err;
    kvw_writer_options wo = {KVW_FORM_FILE, 0};
    kvw_writer *w = NULL;
    kvw_code rc = kvw_writer_new(&c->h, &wo, msink_write, &s, &w, &err);
    CHECK(t, rc == KVW_OK, "lossy: writer_new %s %s", kvw_code_name(rc), err.message);
    int nchunks = (T + CT - 1) / CT;
    for (int idx = 0; idx < L * 2 * nchunks && !rc; idx++) {
        int l = idx / (2 * nchunks), k = (idx / nchunks) % 2, j = idx % nchunks;
        uint32_t start = (uint32_t)(j * CT), count = (uint32_t)(T - start < CT ? T - start : CT);
        kvw_iovec parts[H];
        for (int hh = 0; hh < H; hh++) {
            parts[hh].base = c->tensors[l][k] + ((size_t)hh * T + start) * D * 2;
            parts[hh].len = (size_t)count * D * 2;
        }
        rc = kvw_writer_add(w, (uint32_t)l, k, start, count, KVW_CODEC_FP8, 1, parts, H, &err);
        CHECK(t, rc == KVW_OK, "lossy: add %d: %s %s", idx, kvw_code_name(rc), err.message);
    }
    /* a state-less misuse: fp8 without its codec spec names what is needed */
    kvw_iovec none = {c->tensors[0][0], 2};
    CHECK(t, kvw_writer_add(w, 0, 0, 0, 1, KVW_CODEC_FP8, 0, &none, 1, &err) == KVW_ERR_INVALID_ARGUMENT &&
                 strstr(err.message, "codec_spec") != NULL, "lossy: fp8 without a codec spec is misuse");
    if (!rc) rc = kvw_writer_finish(w, &err);
    CHECK(t, rc == KVW_OK, "lossy: finish %s %s", kvw_code_name(rc), err.message);
    kvw_writer_free(w);
    kvw_reader *r = NULL;
    if (!rc) rc = kvw_open(s.buf, s.len, NULL, &r, &err);
    CHECK(t, rc == KVW_OK, "lossy: open %s %s", kvw_code_name(rc), err.message);
    if (!rc) {
        CHECK(t, kvw_validate(r, &err) == KVW_OK, "lossy: validate %s", err.message);
        size_t lossy = 0, lossless = 0;
        for (size_t i = 0; i < kvw_chunk_count(r); i++) {
            const kvw_record *rec = kvw_chunk_record(r, i);
            if (rec->codec == KVW_CODEC_FP8 && rec->reserved0 == 1) lossy++;
            if (rec->layer == 1 && rec->component == 0 && rec->token_start == 0)
                CHECK(t, rec->codec <= KVW_CODEC_ZSTD && rec->reserved0 == 0,
                      "lossy: the NaN chunk is stored losslessly (codec %u)", rec->codec);
            else if (rec->codec <= KVW_CODEC_ZSTD) lossless++;
        }
        CHECK(t, lossy == (size_t)L * 2 * 3 - 1 && lossless == 0, "lossy: %zu fp8 chunks", lossy);
        uint8_t out[H * T * D * 2];
        for (int l = 0; l < L; l++)
            for (int k = 0; k < 2; k++) {
                CHECK(t, kvw_read_tensor(r, (uint32_t)l, k, 0, out, sizeof out, &err) == KVW_OK,
                      "lossy: read %d/%d", l, k);
                double worst = 0;
                for (size_t i = 0; i < sizeof out / 2; i++) {
                    uint32_t a = (uint32_t)c->tensors[l][k][2 * i] << 16 | (uint32_t)c->tensors[l][k][2 * i + 1] << 24;
                    uint32_t b = (uint32_t)out[2 * i] << 16 | (uint32_t)out[2 * i + 1] << 24;
                    float fa, fb;
                    memcpy(&fa, &a, 4);
                    memcpy(&fb, &b, 4);
                    if (fa != fa) { CHECK(t, fb != fb, "lossy: NaN kept"); continue; }
                    double e = fa > fb ? fa - fb : fb - fa;
                    if (e > worst) worst = e;
                }
                /* e4m3 keeps 3 fraction bits: at most 1/16 relative to the head's max 2 */
                CHECK(t, worst <= 0.125 + 1e-9, "lossy: layer %d comp %d error %g", l, k, worst);
            }
        kvw_close(r);
    }
    free(s.buf);
    free(c);
}


/* The fused lossy encoders (codecs_qenc_fast.c) against the careful path, which a chunk in
 * two parts always takes: the same body bytes and the same refusals for every codec
 * variant, on data at the fast path's boundaries (round-half ties, signed zeros, f16
 * subnormal scales, groups near the safe range's ends, NaN). */
static void put_val(uint8_t *p, float f, unsigned dt) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (dt == KVW_DTYPE_F32) { memcpy(p, &u, 4); return; }
    uint16_t b = dt == KVW_DTYPE_BF16 ? (uint16_t)(u >> 16) : 0;
    if (dt == KVW_DTYPE_F16 && f != f) b = 0x7E00;
    else if (dt == KVW_DTYPE_F16) { /* exact for the values below (|v| a multiple of 2^-24, < 2^15) */
        float a = f < 0 ? -f : f;
        int e = 0;
        while (a >= 2048.0f) a /= 2, e++;
        while (a < 1024.0f && e > -24) a *= 2, e--;
        uint32_t m = (uint32_t)a;
        b = (uint16_t)(e + 25 > 0 && m >= 1024 ? ((uint32_t)(e + 25) << 10) | (m - 1024) : m);
        if (f < 0 || (f == 0 && (u >> 31))) b |= 0x8000;
    }
    memcpy(p, &b, 2);
}
static void test_lossy_fast(tstate *t) {
    enum { FH = 2, FT = 64, FD = 16 };
    static uint8_t raw[FH * FT * FD * 4], a[1 << 16], b[1 << 16];
    kvw_layer_spec ls;
    kvw_layer_spec_init(&ls);
    ls.num_kv_heads = FH, ls.head_dim_k = FD, ls.head_dim_v = FD;
    uint16_t index = 0;
    kvw_codec_spec specs[64];
    float nan;
    uint32_t nanbits = 0x7FC00000u;
    memcpy(&nan, &nanbits, 4);
    int ns = 0;
    for (unsigned f = KVW_DTYPE_F8_E4M3FN; f <= KVW_DTYPE_F8_E4M3FNUZ; f++)
        for (unsigned g = KVW_SCALE_TENSOR; g <= KVW_SCALE_TOKEN; g++) {
            kvw_codec_spec_init(&specs[ns]);
            specs[ns].codec = KVW_CODEC_FP8, specs[ns].fp8_format = (uint8_t)f;
            specs[ns++].scale_granularity = (uint8_t)g;
        }
    for (unsigned bits = 2; bits <= 8; bits *= 2)
        for (unsigned ax = 0; ax < 2; ax++)
            for (unsigned sym = 0; sym < 2; sym++)
                for (unsigned sd = 0; sd < 3; sd++) {
                    kvw_codec_spec_init(&specs[ns]);
                    specs[ns].codec = KVW_CODEC_INT_AFFINE, specs[ns].bits = (uint8_t)bits;
                    specs[ns].group_axis = (uint8_t)ax, specs[ns].symmetric = (uint8_t)sym;
                    specs[ns].scale_dtype = (uint8_t)sd, specs[ns].group_size = ax ? 8 : 32;
                    specs[ns].sink_tokens = sym, specs[ns].residual_tokens = 2 * sym;
                    ns++;
                }
    for (unsigned v = 0; v < 16; v++) { /* revision 1.2: rotation, gaussian codebook, 3 bits */
        static const uint8_t bits[4] = {2, 3, 4, 8};
        kvw_codec_spec_init(&specs[ns]);
        specs[ns].codec = KVW_CODEC_INT_AFFINE, specs[ns].bits = bits[v % 4];
        specs[ns].group_axis = (uint8_t)((v / 4) % 2), specs[ns].symmetric = (uint8_t)(v / 8 || v % 4 == 1);
        specs[ns].scale_dtype = (uint8_t)(v % 3), specs[ns].group_size = v % 2 ? 8 : 32;
        specs[ns].rotation = (uint8_t)(v % 4 != 1 || v >= 8), specs[ns].rotation_seed = specs[ns].rotation ? v * 977u : 0;
        specs[ns].codebook = (uint8_t)(v >= 8 && bits[v % 4] != 8);
        specs[ns].residual_tokens = v % 3;
        ns++;
    }
    int fast_ok = 0, refused = 0;
    for (unsigned dt = 0; dt < 3; dt++)
        for (int pat = 0; pat < 7; pat++) {
            unsigned w = dt == KVW_DTYPE_F32 ? 4 : 2;
            uint32_t x = 777u + (uint32_t)pat;
            for (size_t i = 0; i < (size_t)FH * FT * FD; i++) {
                x = x * 1103515245u + 12345u;
                int r = (int)((x >> 16) % 512) - 256;
                float v = pat == 0 ? (float)r / 32.0f              /* ties: halves of codes */
                        : pat == 1 ? (r % 3 ? 0.0f : -0.0f) + (float)(r % 2) / 4 /* signed zeros */
                        : pat == 2 ? (float)r * 0x1p-22f            /* f16 subnormal scales */
                        : pat == 3 ? (float)r * 0x1p-12f            /* near int lo for f16 */
                        : pat == 4 ? (i % 97 ? (float)r : 30000.0f) /* one large group */
                        : pat == 5 ? (float)r * 0x1p-14f
                                   : (i == 300 ? nan : (float)r / 8);
                if (pat == 5 && i % 5 == 0) v = -0.0f; /* a zero group mixed in */
                put_val(raw + i * w, v, dt);
            }
            for (int k = 0; k < ns; k++) {
                kvw_header h;
                kvw_header_init(&h);
                h.arch.num_layers = 1, h.arch.layer_specs = &ls, h.arch.layer_spec_count = 1;
                h.arch.layer_spec_index = &index, h.arch.layer_spec_index_count = 1;
                h.dtype = (uint8_t)dt, h.chunk_tokens = FT, h.token_count = FT;
                h.codec_specs = &specs[k], h.codec_spec_count = 1;
                h.required_features = KVW_FEATURE_CODEC_SPECS |
                    (kvw_codec_spec_uses_rotation(&specs[k]) ? KVW_FEATURE_ROTATION : 0);
                kvw_record rec;
                memset(&rec, 0, sizeof rec);
                rec.token_count = FT, rec.codec = specs[k].codec, rec.head_count = FH;
                rec.reserved0 = 1, rec.raw_length = (uint64_t)FH * FT * FD * w;
                uint8_t wire[KVW_RECORD_SIZE];
                kvw_record_encode(&rec, wire);
                size_t la = 0, n = (size_t)rec.raw_length;
                kvw_error e1, e2;
                memset(a, 0xA5, sizeof a);
                kvw_code r1 = kvw_lossy_encode_wire(&h, wire, raw, n, a, sizeof a, &la, &e1);
                kvw_iovec two[2] = {{raw, 7}, {raw + 7, n - 7}};
                uint8_t *body = NULL;
                size_t lb = 0;
                kvw_code r2 = kvw_encode_body(&h, specs[k].codec, &specs[k], &rec, two, 2, 3, &body,
                                              &lb, &e2);
                CHECK(t, r1 == r2, "lossy fast: dt %u pattern %d spec %d: %s vs careful %s (%s)", dt,
                      pat, k, kvw_code_name(r1), kvw_code_name(r2), e1.message);
                if (r1 == KVW_OK && r2 == KVW_OK && specs[k].lossless == KVW_CODEC_RAW) {
                    memcpy(b, body, lb);
                    CHECK(t, la == lb && memcmp(a, b, lb) == 0,
                          "lossy fast: dt %u pattern %d spec %d: bodies differ", dt, pat, k);
                    fast_ok++;
                }
                if (r1 == KVW_ERR_UNSUPPORTED) refused++;
                free(body);
            }
        }
    CHECK(t, fast_ok > 500 && refused > 0, "lossy fast: %d bodies compared, %d refused", fast_ok,
          refused);
}

/* Revision 1.2 pieces (spec/codecs.md section 8): the sign vectors and c_B of the spec, the
 * AVX2 row transform against the portable one bit for bit (also on infinities, NaN and
 * subnormals), field 11's registry range, and fields 11-13 ignored without bit 4. */
static void test_rotation(tstate *t) {
    uint32_t m[64];
    char sg[33];
    static const char *const want[2] = {"-++-+++-+-+-----+-+----+--++---+", "---++---+-+-+-++----++++++--+---"};
    for (uint64_t seed = 0; seed < 2; seed++) {
        kvwc_rot_signs(seed, 32, m);
        for (int d = 0; d < 32; d++) sg[d] = m[d] ? '-' : '+';
        sg[32] = 0;
        CHECK(t, strcmp(sg, want[seed]) == 0, "rotation: signs of seed %u: %s", (unsigned)seed, sg);
    }
    CHECK(t, kvwc_f32_bits(kvwc_rot_cb(128)) == 0x3DB504F3u && kvwc_rot_cb(1) == 1.0f &&
             kvwc_f32_bits(kvwc_rot_cb(2)) == 0x3F3504F3u && kvwc_rot_cb(64) == 0.125f &&
             kvwc_rot_block(96) == 32 && kvwc_rot_block(80) == 16, "rotation: c_B and B");
    static const uint64_t dims[] = {8, 16, 24, 32, 40, 64, 80, 96, 128, 256, 512, 1024, 2048};
    static float y1[2048], y2[2048];
    static uint32_t mk[2048];
    uint32_t x = 99;
    int differ = 0;
    int avx2 = kvw_simd_rot(); /* the kernels run only where the CPU has AVX2 */
    for (size_t di = 0; avx2 && di < sizeof dims / sizeof dims[0]; di++)
        for (int rep = 0; rep < 20; rep++) {
            uint64_t D = dims[di], B = kvwc_rot_block(D);
            kvwc_rot_signs((uint64_t)rep * 31, D, mk);
            for (uint64_t d = 0; d < D; d++) {
                x = x * 1103515245u + 12345u;
                uint32_t bitsv = rep % 5 == 4 ? x : (x >> 9) | 0x3F800000u; /* any pattern, or [1, 2) */
                y1[d] = y2[d] = kvwc_bits_f32(rep % 5 == 4 || !(x & 1) ? bitsv : bitsv | 0x80000000u);
            }
            kvwc_rot_row_portable(y1, D, B, kvwc_rot_cb(B), rep % 2 ? mk : NULL);
            kvwc_rot_row_avx2(y2, D, B, kvwc_rot_cb(B), rep % 2 ? mk : NULL);
            for (uint64_t d = 0; d < D; d++) {
                uint32_t a = kvwc_f32_bits(y1[d]), b = kvwc_f32_bits(y2[d]);
                differ += a != b && !(y1[d] != y1[d] && y2[d] != y2[d]);
            }
        }
    CHECK(t, differ == 0, "rotation: AVX2 (run %d) and portable rows differ in %d values", avx2, differ);
    /* the decoder's AVX2 dequantization and bf16 rounding against the portable expressions */
    static uint8_t u[2048];
    static float sx[2048], zx[2048], lv[16];
    static uint16_t b16[2048];
    differ = 0;
    for (int c = 0; c < 16; c++) lv[c] = (float)c * 0.37f - 2.5f;
    for (int rep = 0; avx2 && rep < 8; rep++) {
        for (int d = 0; d < 2048; d++) {
            x = x * 1103515245u + 12345u;
            u[d] = (uint8_t)(x >> 28);
            sx[d] = kvwc_bits_f32((x & 0x807FFFFFu) | (rep < 4 ? 0x3F000000u : ((x >> 3) & 0x7F800000u)));
            zx[d] = kvwc_bits_f32(x * 2654435761u);
        }
        kvwc_rot_dequant_avx2(u, lv, sx, rep % 2 ? zx : NULL, y2, 2048);
        kvwc_rot_to_bf16_avx2(y2, b16, 2048);
        for (int d = 0; d < 2048; d++) {
            float p = lv[u[d]] * sx[d], v = rep % 2 ? p + zx[d] : p;
            differ += (kvwc_f32_bits(v) != kvwc_f32_bits(y2[d]) && !(v != v && y2[d] != y2[d])) ||
                      kvwc_to_bf16(y2[d]) != b16[d];
        }
    }
    CHECK(t, differ == 0, "rotation: AVX2 dequantization / bf16 rounding differ in %d values", differ);
    /* Header fields: rotation 2 is out of its registry (with bit 4; without it fields 11-13
     * are not read: tests/c/test_c_rotation.py builds those headers). */
    kvw_layer_spec ls;
    kvw_layer_spec_init(&ls);
    ls.num_kv_heads = 1, ls.head_dim_k = 64, ls.head_dim_v = 64;
    uint16_t index = 0;
    kvw_codec_spec cs;
    kvw_codec_spec_init(&cs);
    cs.codec = KVW_CODEC_INT_AFFINE, cs.bits = 3, cs.rotation = 2, cs.rotation_seed = 5;
    {
        kvw_header h, back;
        kvw_header_init(&h);
        h.arch.num_layers = 1, h.arch.layer_specs = &ls, h.arch.layer_spec_count = 1;
        h.arch.layer_spec_index = &index, h.arch.layer_spec_index_count = 1;
        h.codec_specs = &cs, h.codec_spec_count = 1, h.format_major = 1, h.format_minor = 2;
        h.required_features = KVW_FEATURE_CODEC_SPECS | KVW_FEATURE_ROTATION;
        uint8_t *fb = NULL;
        size_t n = 0;
        kvw_error e;
        CHECK(t, kvw_header_encode(&h, &fb, &n, &e) == KVW_OK, "rotation: header encode");
        kvw_header_init(&back);
        kvw_code rc = fb ? kvw_header_parse(fb, n, &back, &e) : KVW_ERR_NO_MEMORY;
        CHECK(t, rc == KVW_ENUM_OUT_OF_RANGE, "rotation: rotation code 2 gives %s", kvw_code_name(rc));
        cs.rotation = 1;
        free(fb);
        fb = NULL;
        kvw_header_free(&back);
        kvw_header_init(&back);
        rc = kvw_header_encode(&h, &fb, &n, &e);
        if (!rc) rc = kvw_header_parse(fb, n, &back, &e);
        CHECK(t, rc == KVW_OK && back.codec_spec_count == 1 && back.codec_specs[0].rotation == 1 &&
                 back.codec_specs[0].rotation_seed == 5 && back.codec_specs[0].bits == 3,
              "rotation: fields 11-13 round trip (%s)", kvw_code_name(rc));
        kvw_header_free(&back);
        free(fb);
        /* Revision 1.3: code 2 of both is in range with bit 5 (KVW-TQ-1), and round trips. */
        cs.bits = 4, cs.symmetric = 1, cs.group_axis = KVW_GROUP_CHANNELS, cs.group_size = 65536;
        cs.rotation = KVW_ROTATION_SYLVESTER, cs.rotation_seed = 0, cs.codebook = KVW_CODEBOOK_TURBOQUANT;
        h.required_features |= KVW_FEATURE_TURBOQUANT, h.format_minor = 3;
        kvw_header_init(&back);
        fb = NULL;
        rc = kvw_header_encode(&h, &fb, &n, &e);
        if (!rc) rc = kvw_header_parse(fb, n, &back, &e);
        CHECK(t, rc == KVW_OK && back.codec_spec_count == 1 && back.codec_specs[0].rotation == 2 &&
                 back.codec_specs[0].codebook == 2 && kvw_codec_spec_uses_turboquant(&back.codec_specs[0]),
              "turboquant: fields 11-13 round trip with bit 5 (%s)", kvw_code_name(rc));
        kvw_header_free(&back);
        free(fb);
    }
    /* KVW-TQ-4's table (odd log2(D): D = 128's row) and the unsigned rotation's masks. */
    float tq_lv[16];
    uint32_t mask[8] = {1, 1, 1, 1, 1, 1, 1, 1}, any = 0;
    kvwc_tq_levels(3, 128, tq_lv);
    CHECK(t, kvwc_f32_bits(tq_lv[4]) == 0x3CB16317u && kvwc_f32_bits(tq_lv[3]) == 0xBCB16317u &&
             kvwc_f32_bits(tq_lv[7]) == 0x3E42A09Fu, "turboquant: the 3-bit levels of D = 128");
    kvwc_tq_levels(4, 64, tq_lv);
    CHECK(t, kvwc_f32_bits(tq_lv[15]) == 0x3EAEC76Eu && kvwc_f32_bits(tq_lv[0]) == 0xBEAEC76Eu,
          "turboquant: the 4-bit levels of D = 64");
    cs.rotation = KVW_ROTATION_SYLVESTER;
    kvwc_rot_mask(&cs, 8, mask);
    for (int d = 0; d < 8; d++) any |= mask[d];
    CHECK(t, any == 0, "turboquant: the sylvester rotation has every sign +1");
}

int main(int argc, char **argv) {
    tstate t = {0, 0, argc > 1 && strcmp(argv[1], "-v") == 0};
    static const struct { const char *name; void (*fn)(tstate *); } groups[] = {
        {"xxh3 (KVW-CONV-3)", test_xxh3},
        {"records (8.1)", test_records},
        {"error codes (18)", test_codes},
        {"registries (20)", test_registries},
        {"layout rule (9.3, App. B)", test_layout},
        {"writer/reader/decoder round trips", test_roundtrips},
        {"concatenated streams", test_decoder_concatenated},
        {"file sink and mapped files", test_file_sink},
        {"lossy codec specs (codecs.md)", test_lossy_writer},
        {"fused lossy encoders vs careful", test_lossy_fast},
        {"rotation (codecs.md section 8)", test_rotation},
        {"API misuse", test_misuse},
    };
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
        int before = t.failures;
        groups[i].fn(&t);
        if (t.verbose || t.failures != before)
            printf("%-36s %s\n", groups[i].name, t.failures == before ? "ok" : "FAILED");
    }
    printf("test_unit: %d checks, %d failed\n", t.checks, t.failures);
    return t.failures ? 1 : 0;
}
