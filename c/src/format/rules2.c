/*
 * Header rules of spec/kvwire-v1.md 14.1 step 3, second part (split from rules.c to keep
 * both files short): the prefix chain (crossmodel.md PREFIX-1..5, with the SHA-256 of
 * the model root), fingerprints (ID-10), metadata keys (META-1), codec specs (codecs.md
 * CSPEC-10, EVOL-3, CSPEC-3..6, FP8-1, INT-1, INT-2, ROT-1/2, TQ-1/2) and kv scales
 * (revision 1.1, SCALE-1..5). Called by kvw_header_rules in this order.
 */
#include "format/format.h"

#include <math.h>

/* ---- SHA-256 (FIPS 180-4), for the model root of KVW-PREFIX-2 ------------------------ */

typedef struct sha256_ctx {
    uint32_t h[8];
    uint8_t buf[64];
    uint64_t total;
    size_t fill;
} sha256_ctx;

static const uint32_t SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static uint32_t ror32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static void sha256_block(uint32_t st[8], const uint8_t p[64]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
               (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = ror32(w[t - 15], 7) ^ ror32(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = ror32(w[t - 2], 17) ^ ror32(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6],
             h = st[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = h + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) +
                      SHA256_K[t] + w[t];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d;
    st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

static void sha256_init(sha256_ctx *c) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, iv, sizeof iv);
    c->total = 0;
    c->fill = 0;
}

static void sha256_update(sha256_ctx *c, const uint8_t *p, size_t n) {
    c->total += n;
    while (n) {
        if (c->fill == 0 && n >= 64) {
            sha256_block(c->h, p);
            p += 64;
            n -= 64;
            continue;
        }
        size_t k = 64 - c->fill;
        if (k > n) k = n;
        memcpy(c->buf + c->fill, p, k);
        c->fill += k;
        p += k;
        n -= k;
        if (c->fill == 64) {
            sha256_block(c->h, c->buf);
            c->fill = 0;
        }
    }
}

static void sha256_final(sha256_ctx *c, uint8_t out[32]) {
    uint64_t bits = c->total * 8;
    uint8_t pad[72] = {0x80};
    size_t padlen = (c->fill < 56) ? 56 - c->fill : 120 - c->fill;
    for (int i = 0; i < 8; i++) pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(c, pad, padlen + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

void kvw_sha256(const void *p, size_t n, uint8_t out[32]) {
    sha256_ctx c;
    sha256_init(&c);
    sha256_update(&c, (const uint8_t *)p, n);
    sha256_final(&c, out);
}

void kvw_prefix_root(const uint8_t *fingerprint, uint32_t len, uint32_t chunk_tokens,
                     uint8_t out[32]) {
    static const char tag[] = "kvwire.prefix.v1"; /* then one zero byte (the terminator) */
    uint8_t fields[10];
    kvw_st16(fields, 1);
    kvw_st32(fields + 2, chunk_tokens);
    kvw_st32(fields + 6, len);
    sha256_ctx c;
    sha256_init(&c);
    sha256_update(&c, (const uint8_t *)tag, sizeof tag); /* 16 characters + 0x00 */
    sha256_update(&c, fields, sizeof fields);
    if (len) sha256_update(&c, fingerprint, len);
    sha256_final(&c, out);
}

/* ---- prefix chain (crossmodel.md section 5) ----------------------------------------- */

kvw_code kvw_rules_prefix(const kvw_header *h, kvw_error *err) {
    if (!h->has_prefix || h->prefix.scheme != 1) return KVW_OK; /* PREFIX-1: treated as absent */
    uint64_t c = h->chunk_tokens;
    if (c == 0) /* HDR-11 comes first in kvw_header_rules; a guard for direct callers */
        return kvw_fail(err, KVW_BAD_CHUNK_TOKENS, "KVW-HDR-11", "chunk_tokens 0");
    uint64_t chunks = (h->token_count + c - 1) / c;
    uint64_t want = 32 * chunks;
    if (h->prefix.hashes.len != want)
        return kvw_fail(err, KVW_PREFIX_INVALID, "KVW-PREFIX-3",
                        "prefix chain has %u hash bytes; %llu token chunks of %u tokens need "
                        "%llu",
                        (unsigned)h->prefix.hashes.len, (unsigned long long)chunks,
                        (unsigned)h->chunk_tokens, (unsigned long long)want);
    if (h->prefix.root.len != 32)
        return kvw_fail(err, KVW_PREFIX_INVALID, "KVW-PREFIX-2",
                        "prefix root has %u bytes, not 32", (unsigned)h->prefix.root.len);
    if (h->first_position == 0) {
        uint8_t r0[32];
        const kvw_bytes f = h->model.compat_fingerprint;
        kvw_prefix_root(f.ptr, f.len, h->chunk_tokens, r0);
        if (memcmp(r0, h->prefix.root.ptr, 32) != 0)
            return kvw_fail(err, KVW_PREFIX_INVALID, "KVW-PREFIX-2",
                            "prefix root is not the model root of this compat fingerprint "
                            "(%u bytes) and chunk_tokens %u",
                            (unsigned)f.len, (unsigned)h->chunk_tokens);
    } else if (h->first_position % c) {
        return kvw_fail(err, KVW_PREFIX_INVALID, "KVW-PREFIX-5",
                        "a prefix chain needs first_position %llu to be a multiple of "
                        "chunk_tokens %u",
                        (unsigned long long)h->first_position, (unsigned)h->chunk_tokens);
    }
    return KVW_OK;
}

/* ---- fingerprints (crossmodel.md KVW-ID-10) ----------------------------------------- */

kvw_code kvw_rules_fingerprints(const kvw_header *h, kvw_error *err) {
    const kvw_model *m = &h->model;
    if (!h->has_model || m->fingerprint_scheme != 1) return KVW_OK;
    const struct { const char *name; uint32_t len; } fps[4] = {
        {"config_fingerprint", m->config_fingerprint.len},
        {"tokenizer_fingerprint", m->tokenizer_fingerprint.len},
        {"weights_fingerprint", m->weights_fingerprint.len},
        {"compat_fingerprint", m->compat_fingerprint.len}};
    for (int i = 0; i < 4; i++)
        if (fps[i].len != 0 && fps[i].len != 32)
            return kvw_fail(err, KVW_FINGERPRINT_INVALID, "KVW-ID-10",
                            "%s has %u bytes; fingerprint_scheme 1 needs 0 or 32", fps[i].name,
                            (unsigned)fps[i].len);
    uint64_t lw = m->layer_weights_fingerprints.len;
    if (lw != 0 && lw != 32 * (uint64_t)h->arch.num_layers)
        return kvw_fail(err, KVW_FINGERPRINT_INVALID, "KVW-ID-10",
                        "layer_weights_fingerprints has %llu bytes; fingerprint_scheme 1 "
                        "needs 0 or 32 x %u layers",
                        (unsigned long long)lw, (unsigned)h->arch.num_layers);
    return KVW_OK;
}

/* ---- metadata keys (5.8, KVW-META-1) ------------------------------------------------- */

static int ns_char(uint8_t c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}
static int seg_char(uint8_t c) { return ns_char(c) || (c >= 'A' && c <= 'Z'); }

/* key = namespace 1*("." segment); namespace = 1*[a-z0-9_-]; segment = 1*[A-Za-z0-9_-] */
static int key_valid(kvw_bytes k) {
    if (!k.ptr || k.len < 1 || k.len > 256) return 0;
    uint32_t i = 0;
    while (i < k.len && ns_char(k.ptr[i])) i++;
    if (i == 0 || i == k.len) return 0; /* empty namespace, or no segment */
    while (i < k.len) {
        if (k.ptr[i] != '.') return 0;
        uint32_t s = ++i;
        while (i < k.len && seg_char(k.ptr[i])) i++;
        if (i == s) return 0; /* empty segment */
    }
    return 1;
}

kvw_code kvw_rules_metadata(const kvw_header *h, kvw_error *err) {
    for (uint32_t i = 0; i < h->metadata_count; i++) {
        const kvw_key_value *kv = &h->metadata[i];
        if (!key_valid(kv->key)) {
            char shown[48];
            uint32_t n = kv->key.len < 40 ? kv->key.len : 40;
            for (uint32_t j = 0; j < n; j++) {
                uint8_t ch = kv->key.ptr[j];
                shown[j] = (ch >= 0x20 && ch < 0x7F) ? (char)ch : '?';
            }
            shown[n] = 0;
            return kvw_fail(err, KVW_METADATA_KEY_INVALID, "KVW-META-1",
                            "metadata key %u \"%s%s\" (%u bytes) is not 'namespace.name'",
                            (unsigned)i, shown, kv->key.len > 40 ? "..." : "",
                            (unsigned)kv->key.len);
        }
        if (kv->value.len > (UINT32_C(1) << 20))
            return kvw_fail(err, KVW_METADATA_VALUE_INVALID, "KVW-META-1",
                            "metadata value %u has %u bytes, limit 1048576", (unsigned)i,
                            (unsigned)kv->value.len);
    }
    return KVW_OK;
}

/* ---- codec specs (codecs.md section 1.1) ---------------------------------------------- */

static kvw_code cspec_invalid(kvw_error *err, uint32_t i, const char *rule, const char *what,
                              unsigned value) {
    return kvw_fail(err, KVW_CODEC_SPEC_INVALID, rule, "codec_specs[%u]: %s %u", (unsigned)i,
                    what, value);
}

/* One spec, in the order CSPEC-3, CSPEC-4, CSPEC-5, CSPEC-6, FP8-1, INT-1, INT-2. */
static kvw_code check_codec_spec(const kvw_header *h, const kvw_codec_spec *s, uint32_t i,
                                 kvw_error *err) {
    /* Code 2 of rotation / codebook is registered by bit 5 (KVW-TQ-1, EVOL-9): a parsed
     * header never has it without the bit; a header built in memory may. */
    if ((h->required_features & KVW_FEATURE_ROTATION) &&
        !(h->required_features & KVW_FEATURE_TURBOQUANT) && kvw_codec_spec_uses_turboquant(s))
        return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-TQ-1", "codec_specs[%u]: rotation %u / "
                        "codebook %u need required feature bit 5 (turboquant)", (unsigned)i,
                        (unsigned)s->rotation, (unsigned)s->codebook);
    if (s->codec != KVW_CODEC_BYTEPLANE_ZSTD && s->codec != KVW_CODEC_FP8 &&
        s->codec != KVW_CODEC_INT_AFFINE)
        return cspec_invalid(err, i, "KVW-CSPEC-3",
                             "codec must be byteplane_zstd, fp8 or int_affine, not", s->codec);
    if (s->lossless > KVW_CODEC_BYTEPLANE_ZSTD)
        return cspec_invalid(err, i, "KVW-CSPEC-4",
                             "lossless stage must be raw, zstd or byteplane_zstd, not",
                             s->lossless);
    int fp8 = s->codec == KVW_CODEC_FP8, ia = s->codec == KVW_CODEC_INT_AFFINE;
    /* CSPEC-5: fields the codec does not use hold their defaults (field-id order; 11-13
     * are int_affine's, revision 1.2, defaults when bit 4 is clear: KVW-ROT-2) */
    const struct { const char *name; int used; uint64_t value, dflt; } f[13] = {
        {"lossless", fp8 || ia, s->lossless, KVW_CODEC_RAW},
        {"fp8_format", fp8, s->fp8_format, KVW_DTYPE_F8_E4M3FN},
        {"scale_granularity", fp8, s->scale_granularity, KVW_SCALE_TENSOR},
        {"bits", ia, s->bits, 8},
        {"group_size", ia, s->group_size, 32},
        {"group_axis", ia, s->group_axis, KVW_GROUP_TOKENS},
        {"symmetric", ia, s->symmetric, 0},
        {"scale_dtype", ia, s->scale_dtype, KVW_DTYPE_F32},
        {"sink_tokens", fp8 || ia, s->sink_tokens, 0},
        {"residual_tokens", fp8 || ia, s->residual_tokens, 0},
        {"rotation", ia, s->rotation, KVW_ROTATION_NONE},
        {"rotation_seed", ia, s->rotation_seed, 0},
        {"codebook", ia, s->codebook, KVW_CODEBOOK_UNIFORM}};
    for (int j = 0; j < 13; j++)
        if (!f[j].used && f[j].value != f[j].dflt)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-5",
                            "codec_specs[%u]: %s does not use %s; it must keep its default %llu, "
                            "not %llu",
                            (unsigned)i, kvw_codec_name(s->codec), f[j].name,
                            (unsigned long long)f[j].dflt, (unsigned long long)f[j].value);
    if ((fp8 || ia) && h->dtype != KVW_DTYPE_BF16 && h->dtype != KVW_DTYPE_F16 &&
        h->dtype != KVW_DTYPE_F32)
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-6",
                        "codec_specs[%u]: lossy codec %s on header dtype %s: needs bf16, f16 "
                        "or f32",
                        (unsigned)i, kvw_codec_name(s->codec),
                        kvw_dtype_name(h->dtype) ? kvw_dtype_name(h->dtype) : "?");
    if (fp8 && s->fp8_format != KVW_DTYPE_F8_E4M3FN && s->fp8_format != KVW_DTYPE_F8_E5M2 &&
        s->fp8_format != KVW_DTYPE_F8_E4M3FNUZ)
        return cspec_invalid(err, i, "KVW-FP8-1",
                             "fp8_format must be f8_e4m3fn, f8_e5m2 or f8_e4m3fnuz, not dtype",
                             s->fp8_format);
    int rot = (h->required_features & KVW_FEATURE_ROTATION) != 0; /* bits 3: KVW-ROT-2 */
    if (ia) {
        if ((s->bits != 2 && s->bits != 4 && s->bits != 8 && !(rot && s->bits == 3)) ||
            (s->scale_dtype != KVW_DTYPE_F16 && s->scale_dtype != KVW_DTYPE_BF16 &&
             s->scale_dtype != KVW_DTYPE_F32))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-INT-1",
                            "codec_specs[%u]: bits %u / scale_dtype %u: bits must be 2, 4 or "
                            "8, scale_dtype f16, bf16 or f32",
                            (unsigned)i, (unsigned)s->bits, (unsigned)s->scale_dtype);
        if (s->group_size < 1 || s->group_size > 65536)
            return cspec_invalid(err, i, "KVW-INT-2", "group_size must be in [1, 65536], not",
                                 (unsigned)s->group_size);
        /* KVW-ROT-2 (the fields are defaults without bit 4, so this passes there) */
        if (s->rotation == KVW_ROTATION_NONE && s->rotation_seed != 0)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-ROT-2",
                            "codec_specs[%u]: rotation_seed %llu without a rotation (must be 0)",
                            (unsigned)i, (unsigned long long)s->rotation_seed);
        if (s->codebook == KVW_CODEBOOK_GAUSSIAN && (!s->symmetric || s->bits == 8))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-ROT-2",
                            "codec_specs[%u]: the gaussian codebook needs symmetric = true and "
                            "bits 2, 3 or 4 (symmetric %u, bits %u)",
                            (unsigned)i, (unsigned)s->symmetric, (unsigned)s->bits);
        /* KVW-TQ-2 (revision 1.3; codes 2 only with bit 5) */
        if (s->rotation == KVW_ROTATION_SYLVESTER && s->rotation_seed != 0)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-TQ-2",
                            "codec_specs[%u]: rotation_seed %llu with the unsigned rotation (must "
                            "be 0)", (unsigned)i, (unsigned long long)s->rotation_seed);
        if (s->codebook == KVW_CODEBOOK_TURBOQUANT &&
            (!s->symmetric || s->group_axis != KVW_GROUP_CHANNELS || (s->bits != 3 && s->bits != 4)))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-TQ-2", "codec_specs[%u]: the "
                            "turboquant codebook needs symmetric, group_axis channels, bits 3 or "
                            "4 (has %u, %u, %u)", (unsigned)i, (unsigned)s->symmetric,
                            (unsigned)s->group_axis, (unsigned)s->bits);
    }
    return KVW_OK;
}

kvw_code kvw_rules_codec_specs(const kvw_header *h, kvw_error *err) {
    int bit = (h->required_features & KVW_FEATURE_CODEC_SPECS) != 0;
    int rot = (h->required_features & KVW_FEATURE_ROTATION) != 0, used = 0, used_tq = 0;
    int tq = (h->required_features & KVW_FEATURE_TURBOQUANT) != 0;
    if (h->codec_spec_count == 0) {
        if (bit)
            return kvw_fail(err, KVW_UNSUPPORTED_FEATURE, "KVW-EVOL-3",
                            "required feature bit 0 (codec_specs) is set but Header.codec_specs "
                            "is absent or empty (KVW-CSPEC-10): treated as an unknown bit");
        if (rot)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-ROT-1",
                            "required feature bit 4 (rotation) without codec specs");
        if (tq)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-TQ-1",
                            "required feature bit 5 (turboquant) without codec specs");
        return KVW_OK;
    }
    /* From here the codec_specs bit is set, so the codec codes it registers (2-4) are in
     * range (KVW-EVOL-9 can reject no spec field); registry range is checked at decoding. */
    if (!bit)
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-10",
                        "%u codec specs without the codec_specs required feature bit",
                        (unsigned)h->codec_spec_count);
    if (h->codec_spec_count > 4096 || !h->codec_specs)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1", "%u codec specs, limit 4096",
                        (unsigned)h->codec_spec_count);
    for (uint32_t i = 0; i < h->codec_spec_count; i++) {
        kvw_code rc = check_codec_spec(h, &h->codec_specs[i], i, err);
        if (rc != KVW_OK) return rc;
        used |= kvw_codec_spec_uses_rotation(&h->codec_specs[i]);
        used_tq |= kvw_codec_spec_uses_turboquant(&h->codec_specs[i]);
    }
    if (rot && !used) /* KVW-ROT-1, after every spec's rules */
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-ROT-1",
                        "required feature bit 4 (rotation) is set but no codec spec has "
                        "rotation hadamard, codebook gaussian or bits 3");
    if (tq && !(rot && used_tq)) /* KVW-TQ-1, after KVW-ROT-1 */
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-TQ-1", "required feature bit 5 "
                        "(turboquant) without bit 4 or without a spec using its codes");
    return KVW_OK;
}

/* ---- kv scales (5.10, revision 1.1) -------------------------------------------------- */

static int scale_ok(float x) { return x > 0.0f && x < INFINITY; } /* false for NaN */

kvw_code kvw_rules_kv_scales(const kvw_header *h, kvw_error *err) {
    if (!(h->required_features & KVW_FEATURE_KV_SCALES)) return KVW_OK; /* field 20 not read */
    if (!h->has_kv_scales)
        return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-1",
                        "required feature bit 3 (kv_scales) is set but Header.kv_scales is "
                        "absent");
    if (h->dtype != KVW_DTYPE_F8_E4M3FN && h->dtype != KVW_DTYPE_F8_E5M2 &&
        h->dtype != KVW_DTYPE_F8_E4M3FNUZ)
        return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-4",
                        "kv_scales with dtype %s: scales describe fp8 caches (f8_e4m3fn, "
                        "f8_e5m2, f8_e4m3fnuz)",
                        kvw_dtype_name(h->dtype) ? kvw_dtype_name(h->dtype) : "?");
    uint32_t n = h->arch.num_layers;
    if (h->kv_scale_count != n || (n && !h->kv_scales))
        return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-2",
                        "kv_scales has %u entries for %u layers (one per layer)",
                        (unsigned)h->kv_scale_count, (unsigned)n);
    for (uint32_t i = 0; i < n; i++) {
        const kvw_kv_scale *e = &h->kv_scales[i];
        if (!scale_ok(e->k_scale) || !scale_ok(e->v_scale)) {
            int k = !scale_ok(e->k_scale);
            return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-3",
                            "layer %u %s %g: every scale is a finite binary32 above 0",
                            (unsigned)i, k ? "k_scale" : "v_scale",
                            (double)(k ? e->k_scale : e->v_scale));
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        const kvw_kv_scale *e = &h->kv_scales[i];
        const kvw_layer_spec *s = kvw_layer(h, i);
        if ((s->kind == KVW_KIND_SHARED || s->kind == KVW_KIND_STATE) &&
            (e->k_scale != 1.0f || e->v_scale != 1.0f))
            return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-5",
                            "%s layer %u has scales (%g, %g): a layer without K/V/LATENT "
                            "chunks of its own has 1.0 and 1.0",
                            kvw_layer_kind_name(s->kind), (unsigned)i, (double)e->k_scale,
                            (double)e->v_scale);
        if (s->kind == KVW_KIND_MLA_LATENT && e->v_scale != 1.0f)
            return kvw_fail(err, KVW_KV_SCALES_INVALID, "KVW-SCALE-5",
                            "mla_latent layer %u has v_scale %g: a layer without V has 1.0",
                            (unsigned)i, (double)e->v_scale);
    }
    return KVW_OK;
}
