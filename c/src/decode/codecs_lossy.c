/*
 * Lossy codec decoding (spec/codecs.md sections 3-5: KVW-LOSSY-*, KVW-FP8-*, KVW-INT-*):
 * the geometry of a lossy body from the spec and the record alone, then the normative
 * fp32 arithmetic (one rounding per operation, no fused multiply-add) and the final round
 * to nearest even into the header dtype with canonical NaNs, so that the decoded bytes are
 * the same in every conforming reader. Kept apart from codecs.c, which handles the frames
 * around these bodies; the geometry of a body (kvwc_lossy_geometry) is in format/codec_geom.c.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "common/cpu.h"
#include "decode/decode.h"

#include <stdlib.h>

#define BLK 512 /* elements converted per block (stack buffers) */

/* The decoders' loops compiled twice, for any x86-64 and for AVX2, the copy picked once at
 * load by the CPU (GCC/clang target_clones: an ifunc); the values are the same bit for bit
 * (no contraction, fp_exact.h; the AVX2 copy only has wider vectors). */
#if KVW_BUILD_AVX2_CLONES
#define KVW_CLONES __attribute__((target_clones("avx2", "default")))
#define KVW_INLINED static inline __attribute__((always_inline)) /* into each copy, at its width */
#else
#define KVW_CLONES
#define KVW_INLINED static
#endif

static int f32_finite(float f) { return (kvwc_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

/* 2^k for a normal fp32 exponent k. */
static float pow2(int k) { return kvwc_bits_f32((uint32_t)(k + 127) << 23); }

/* Exact fp32 value of every code of an fp8 format (KVW-FP8-1, section 20.1). */
static void fp8_table(unsigned fmt, float tab[256]) {
    for (unsigned c = 0; c < 256; c++) {
        float sgn = (c & 0x80) ? -1.0f : 1.0f, v;
        if (fmt == KVW_DTYPE_F8_E5M2) {
            unsigned e = (c >> 2) & 31, m = c & 3;
            if (e == 31) v = m ? kvwc_bits_f32(0x7FC00000u) : kvwc_bits_f32(0x7F800000u);
            else v = e == 0 ? (float)m * 0x1p-16f : (float)(4 + m) * pow2((int)e - 17);
        } else if (fmt == KVW_DTYPE_F8_E4M3FN) {
            unsigned e = (c >> 3) & 15, m = c & 7;
            if (e == 15 && m == 7) v = kvwc_bits_f32(0x7FC00000u);
            else v = e == 0 ? (float)m * 0x1p-9f : (float)(8 + m) * pow2((int)e - 10);
        } else { /* e4m3fnuz: bias 8, 0x80 the only NaN, no negative zero */
            unsigned e = (c >> 3) & 15, m = c & 7;
            if (c == 0x80) v = kvwc_bits_f32(0x7FC00000u);
            else v = e == 0 ? (float)m * 0x1p-10f : (float)(8 + m) * pow2((int)e - 11);
        }
        tab[c] = v * sgn;
    }
}

/* The first n of BLK fp32 results -> header dtype bytes at dst (KVW-LOSSY-4). The loops
 * run over the whole block (constant trip count, so that compilers vectorize them at -O2);
 * only n results are stored. */
KVW_INLINED void store_blk(uint8_t *dst, const float *x, size_t n, unsigned dtype) {
    if (dtype == KVW_DTYPE_F32) {
        uint32_t t[BLK];
        for (size_t i = 0; i < BLK; i++) t[i] = kvwc_to_f32(x[i]);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(dst, t, n * 4);
#else
        for (size_t i = 0; i < n; i++) kvw_st32(dst + 4 * i, t[i]);
#endif
        return;
    }
    uint16_t t[BLK];
    if (dtype == KVW_DTYPE_BF16)
        for (size_t i = 0; i < BLK; i++) t[i] = kvwc_to_bf16(x[i]);
    else
        for (size_t i = 0; i < BLK; i++) t[i] = kvwc_to_f16(x[i]);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(dst, t, n * 2);
#else
    for (size_t i = 0; i < n; i++) kvw_st16(dst + 2 * i, t[i]);
#endif
}

static uint32_t to_dtype_bits(float x, unsigned dtype) {
    return dtype == KVW_DTYPE_BF16 ? kvwc_to_bf16(x)
         : dtype == KVW_DTYPE_F16 ? kvwc_to_f16(x) : kvwc_to_f32(x);
}

/* Codes through a 256-entry table of results (one scale for the whole run). */
KVW_INLINED void lut_run(uint8_t *dst, const uint8_t *codes, size_t n, const uint32_t lut[256],
                    unsigned w) {
    if (w == 2) {
        uint16_t l16[256], t[BLK];
        for (unsigned c = 0; c < 256; c++) l16[c] = (uint16_t)lut[c];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* eight codes a load and four results a store (the loop is bound by its loads and stores) */
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            uint64_t c, a, b;
            memcpy(&c, codes + i, 8);
            a = (uint64_t)l16[c & 255] | (uint64_t)l16[(c >> 8) & 255] << 16 |
                (uint64_t)l16[(c >> 16) & 255] << 32 | (uint64_t)l16[(c >> 24) & 255] << 48;
            b = (uint64_t)l16[(c >> 32) & 255] | (uint64_t)l16[(c >> 40) & 255] << 16 |
                (uint64_t)l16[(c >> 48) & 255] << 32 | (uint64_t)l16[c >> 56] << 48;
            memcpy(dst + 2 * i, &a, 8);
            memcpy(dst + 2 * i + 8, &b, 8);
        }
        for (; i < n; i++) memcpy(dst + 2 * i, &l16[codes[i]], 2);
        (void)t;
        return;
#endif
        for (size_t i0 = 0; i0 < n; i0 += BLK) {
            size_t m = n - i0 < BLK ? n - i0 : BLK;
            for (size_t i = 0; i < m; i++) t[i] = l16[codes[i0 + i]];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            memcpy(dst + 2 * i0, t, m * 2);
#else
            for (size_t i = 0; i < m; i++) kvw_st16(dst + 2 * (i0 + i), t[i]);
#endif
        }
    } else {
        for (size_t i = 0; i < n; i++) kvw_st32(dst + 4 * i, lut[codes[i]]);
    }
}

KVW_CLONES static kvw_code fp8_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const uint8_t *params, const uint8_t *codes, uint8_t *out,
                           kvw_error *err) {
    for (uint64_t k = 0; k < g->nparams; k++) { /* KVW-FP8-3 */
        float sv = kvw_ldf32(params + 4 * k);
        if (!(sv > 0.0f) || !f32_finite(sv))
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-FP8-3",
                            "fp8 scale %llu (%g, bits 0x%08X) is not finite and > 0",
                            (unsigned long long)k, (double)sv, (unsigned)kvwc_f32_bits(sv));
    }
    float tab[256];
    fp8_table(s->fp8_format, tab);
    uint64_t H = g->H, D = g->D, M = g->M, w = g->w, n = M * D;
    uint32_t lut[256];
    float x[BLK];
    memset(x, 0, sizeof x);
    for (uint64_t hh = 0; hh < H; hh++) {
        /* The quantized rows of one head are contiguous in the output and in the codes. */
        uint8_t *dst = out + hh * g->ohs + g->P * D * w;
        const uint8_t *cr = codes + hh * n;
        if (s->scale_granularity != KVW_SCALE_TOKEN || D >= 256) {
            for (uint64_t m = 0; m < (s->scale_granularity == KVW_SCALE_TOKEN ? M : 1); m++) {
                uint64_t si = s->scale_granularity == KVW_SCALE_TOKEN ? hh * M + m
                            : s->scale_granularity == KVW_SCALE_HEAD ? hh : 0;
                float sc = kvw_ldf32(params + 4 * si);
                for (unsigned c = 0; c < 256; c++) lut[c] = to_dtype_bits(tab[c] * sc, h->dtype);
                uint64_t len = s->scale_granularity == KVW_SCALE_TOKEN ? D : n;
                lut_run(dst + m * D * w, cr + m * D, (size_t)len, lut, (unsigned)w);
            }
            continue;
        }
        const uint8_t *sp = params + 4 * hh * M; /* token scales: one per row of D codes */
        uint64_t d = 0;
        float sc = kvw_ldf32(sp);
        for (uint64_t e0 = 0; e0 < n; e0 += BLK) {
            size_t k, m = (size_t)(n - e0 < BLK ? n - e0 : BLK);
            for (k = 0; k < m;) { /* runs of one token: one scale */
                size_t len = (size_t)(D - d < m - k ? D - d : m - k);
                const uint8_t *cc = cr + e0 + k;
                for (size_t j = 0; j < len; j++) x[k + j] = tab[cc[j]] * sc;
                k += len, d += len;
                if (d == D && e0 + k < n) d = 0, sp += 4, sc = kvw_ldf32(sp);
            }
            store_blk(dst + e0 * w, x, m, h->dtype);
        }
    }
    return KVW_OK;
}

KVW_INLINED float load_param(const uint8_t *p, unsigned dtype) {
    return dtype == KVW_DTYPE_F32 ? kvw_ldf32(p)
         : dtype == KVW_DTYPE_F16 ? kvwc_from_f16(kvw_ld16(p)) : kvwc_from_bf16(kvw_ld16(p));
}
/* load_param's value without branches per element (kvwc_from_f16's three cases as selects). */
static inline float load_param_nb(const uint8_t *p, unsigned dtype) {
    if (dtype == KVW_DTYPE_F32) return kvw_ldf32(p);
    uint16_t h = kvw_ld16(p);
    if (dtype != KVW_DTYPE_F16) return kvwc_from_bf16(h);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t sub = sign | kvwc_f32_bits((float)m * 5.9604644775390625e-8f); /* m * 2^-24, exact */
    uint32_t big = sign | (e == 0x1F ? 0x7F800000u : (e + 112u) << 23) | (m << 13);
    return kvwc_bits_f32(e == 0 ? sub : big);
}

/* n b-bit codes from element index i0 on (KVW-INT-4: least significant bits first); ut[v]
 * holds the codes of byte value v. */
KVW_INLINED void unpack(const uint8_t *codes, uint64_t i0, size_t n, unsigned b,
                   const uint8_t (*ut)[4], uint8_t *u) {
    if (b == 8) {
        memcpy(u, codes + i0, n);
        return;
    }
    unsigned mask = (1u << b) - 1u;
    uint64_t bit = i0 * b;
    size_t k = 0;
    while (k < n && (bit & 7)) { /* up to the next byte boundary */
        u[k++] = (uint8_t)((codes[bit >> 3] >> (bit & 7)) & mask);
        bit += b;
    }
    const uint8_t *p = codes + (bit >> 3);
    if (b == 4) {
        for (; k + 2 <= n; k += 2, p++) memcpy(u + k, ut[*p], 2);
    } else {
        for (; k + 4 <= n; k += 4, p++) memcpy(u + k, ut[*p], 4);
    }
    for (unsigned j = 0; k < n; k++, j++) u[k] = (uint8_t)((*p >> (j * b)) & mask);
}

KVW_CLONES static kvw_code int_params(const kvw_codec_spec *s, const kvwc_geom *g, const uint8_t *params,
                         const uint8_t *codes, float **out, kvw_error *err) {
    uint64_t np = g->nparams;
    unsigned ps = g->psize, b = g->bits;
    *out = NULL;
    /* np floats per parameter array: np * 4 <= 2 * (bytes of the parameters in the body). */
    float *sc = (float *)malloc(np ? (size_t)np * sizeof(float) * (g->zeros ? 2u : 1u) : 1u);
    if (!sc) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine: %llu parameters",
                             (unsigned long long)np);
    float *zr = g->zeros ? sc + np : NULL;
    /* The common case in branch-free loops that vectorise (a chunk has thousands of
     * parameters); a bad one is then found and reported by the loops below. */
    uint32_t bad = 0;
    unsigned sd = s->scale_dtype;
    for (uint64_t k = 0; k < np; k++) {
        uint32_t u = kvwc_f32_bits(sc[k] = load_param_nb(params + k * ps, sd));
        bad |= ((u & 0x7F800000u) == 0x7F800000u) | (u >> 31);
    }
    for (uint64_t k = 0; zr && k < np; k++) {
        uint32_t u = kvwc_f32_bits(zr[k] = load_param_nb(params + (np + k) * ps, sd));
        bad |= (u & 0x7F800000u) == 0x7F800000u;
    }
    for (uint64_t k = 0; bad && k < np; k++) { /* KVW-INT-3: scales */
        float v = load_param(params + k * ps, s->scale_dtype);
        if (!f32_finite(v) || (kvwc_f32_bits(v) >> 31)) {
            free(sc);
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-INT-3",
                            "int_affine scale %llu (%g) is not finite with the sign bit clear",
                            (unsigned long long)k, (double)v);
        }
        sc[k] = v;
    }
    for (uint64_t k = 0; bad && zr && k < np; k++) { /* KVW-INT-3: zeros */
        float v = load_param(params + (np + k) * ps, s->scale_dtype);
        if (!f32_finite(v)) {
            free(sc);
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-INT-3",
                            "int_affine zero %llu (%g) is not finite", (unsigned long long)k,
                            (double)v);
        }
        zr[k] = v;
    }
    uint64_t used = (g->H * g->M * g->D * b) % 8; /* KVW-INT-4 / ROT-3: zero padding bits */
    if (used && (codes[g->code_bytes - 1] >> used)) {
        free(sc);
        return kvw_fail(err, KVW_DECODE_FAILED, b == 3 ? "KVW-ROT-3" : "KVW-INT-4",
                        "int_affine: padding bits after the last code are not zero (last byte "
                        "0x%02X, %u bits used)", codes[g->code_bytes - 1], (unsigned)used);
    }
    *out = sc;
    return KVW_OK;
}

/* Extern callers (codecs_rot.c, codecs_tq.c) reach the clones through a plain function:
 * clang resolves target_clones of static functions only. */
kvw_code kvwc_int_params(const kvw_codec_spec *s, const kvwc_geom *g, const uint8_t *params,
                         const uint8_t *codes, float **out, kvw_error *err) {
    return int_params(s, g, params, codes, out, err);
}

KVW_CLONES static kvw_code int_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const uint8_t *params, const uint8_t *codes, uint8_t *out,
                           kvw_error *err) {
    unsigned b = g->bits;
    float *sc;
    kvw_code rc = int_params(s, g, params, codes, &sc, err);
    if (rc) return rc;
    float *zr = g->zeros ? sc + g->nparams : NULL;
    uint64_t H = g->H, D = g->D, M = g->M, w = g->w, G = s->group_size, n = M * D;
    int tokens_axis = s->group_axis == KVW_GROUP_TOKENS;
    float half = (float)(1u << (b - 1));
    uint8_t u[BLK], ut[256][4];
    for (unsigned v = 0; v < 256; v++)
        for (unsigned q = 0; q < 4; q++) ut[v][q] = (uint8_t)(q < 8 / b ? (v >> (q * b)) & ((1u << b) - 1u) : 0);
    float x[BLK], sx[BLK], zx[BLK];
    memset(u, 0, sizeof u);
    memset(sx, 0, sizeof sx);
    memset(zx, 0, sizeof zx);
    for (uint64_t hh = 0; hh < H; hh++) {
        /* One head's quantized rows: n elements, contiguous in the codes and the output. */
        uint8_t *dst = out + hh * g->ohs + g->P * D * w;
        /* Walk the scales with counters: tokens axis group (h, m / G, d), channels axis group
         * (h, m, d / G). */
        const float *srow = sc + (tokens_axis ? hh * g->gm * D : hh * M * g->gd);
        const float *zrow = zr ? zr + (srow - sc) : NULL;
        uint64_t d = 0, m = 0, c = 0, left = G;
        for (uint64_t e0 = 0; e0 < n; e0 += BLK) {
            size_t k, cnt = (size_t)(n - e0 < BLK ? n - e0 : BLK);
            unpack(codes, hh * n + e0, cnt, b, (const uint8_t(*)[4])ut, u);
            if (!tokens_axis) { /* runs of one group: its scale and zero are constants */
                for (k = 0; k < cnt;) {
                    size_t len = (size_t)(D - d < cnt - k ? D - d : cnt - k), j = 0;
                    if (left < len) len = (size_t)left;
                    float sv = srow[c], zv = zrow ? zrow[c] : 0.0f;
                    const uint8_t *uu = u + k;
                    float *xx = x + k;
                    if (s->symmetric) {
                        for (; j + 8 <= len; j += 8)
                            for (size_t q = 0; q < 8; q++) xx[j + q] = ((float)uu[j + q] - half) * sv;
                        for (; j < len; j++) xx[j] = ((float)uu[j] - half) * sv;
                    } else {
                        for (; j + 8 <= len; j += 8)
                            for (size_t q = 0; q < 8; q++) {
                                float p = (float)uu[j + q] * sv; /* two roundings (LOSSY-3) */
                                xx[j + q] = p + zv;
                            }
                        for (; j < len; j++) {
                            float p = (float)uu[j] * sv;
                            xx[j] = p + zv;
                        }
                    }
                    k += len, d += len, left -= len;
                    if (d == D) {
                        d = 0, c = 0, left = G;
                        if (e0 + k < n) srow += g->gd, zrow = zrow ? zrow + g->gd : NULL;
                    } else if (left == 0) {
                        c++, left = G;
                    }
                }
                store_blk(dst + e0 * w, x, cnt, h->dtype);
                continue;
            }
            for (k = 0; k < cnt;) { /* tokens axis: runs of one scale row */
                size_t len = (size_t)(D - d < cnt - k ? D - d : cnt - k);
                memcpy(sx + k, srow + d, len * sizeof(float));
                if (zrow) memcpy(zx + k, zrow + d, len * sizeof(float));
                k += len, d += len;
                if (d == D) {
                    d = 0;
                    if (++m % G == 0 && e0 + k < n) srow += D, zrow = zrow ? zrow + D : NULL;
                }
            }
            if (s->symmetric) {
                for (k = 0; k < BLK; k++) x[k] = ((float)u[k] - half) * sx[k];
            } else {
                for (k = 0; k < BLK; k++) {
                    float p = (float)u[k] * sx[k]; /* two roundings (KVW-LOSSY-3) */
                    x[k] = p + zx[k];
                }
            }
            store_blk(dst + e0 * w, x, cnt, h->dtype);
        }
    }
    free(sc);
    return KVW_OK;
}

kvw_code kvwc_lossy_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const uint8_t *body, uint8_t *out, kvw_error *err) {
    uint64_t rowb = g->D * g->w, P = g->P, Q = g->Q, M = g->M;
    const uint8_t *resid = body + g->H * P * rowb;
    for (uint64_t hh = 0; hh < g->H; hh++) { /* kept tokens, bit for bit (KVW-LOSSY-4) */
        if (P) memcpy(out + hh * g->ohs, body + hh * P * rowb, (size_t)(P * rowb));
        if (Q) memcpy(out + hh * g->ohs + (P + M) * rowb, resid + hh * Q * rowb, (size_t)(Q * rowb));
    }
    if (!M || !g->D) return KVW_OK;
    const uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    if (s->codec == KVW_CODEC_FP8) return fp8_decode(h, s, g, params, codes, out, err);
    if (s->codebook == KVW_CODEBOOK_TURBOQUANT) /* revision 1.3: codecs_tq.c */
        return kvwc_tq_decode(h, s, g, params, codes, out, err);
    /* revision 1.2: codecs_rot.c; its fused AVX2 rows also decode unrotated 2-4 bit codes
     * (no mask: no butterflies), the same operations as int_decode's loops, value for value */
    if (kvw_codec_spec_uses_rotation(s) || kvwc_rot_fused_fits(s, g))
        return kvwc_rot_decode(h, s, g, params, codes, out, err);
    return int_decode(h, s, g, params, codes, out, err);
}
