/*
 * int_affine revision 1.2 encoding (spec/codecs.md section 8.4, the reference writer's
 * informative encoding, python/kvwire/codecs/rotation.py): rotate each quantized token row
 * (r = x * sigma, the butterflies of KVW-ROT-6, then r * c_B), then quantize the rotated
 * values with the uniform encoder of codecs_qenc.c (KVW-INT-6) or with the gaussian codebook
 * (s = the group's root mean square, u = the nearest level, ties to the larger magnitude).
 * Why a decode afterwards: KVW-ROT-7 (LOSSY-5 read on decoded rows) is a property of the
 * bytes a reader produces, so the writer checks it on exactly those bytes (the decoder of
 * codecs_rot.c) and refuses the chunk (KVW_ERR_UNSUPPORTED: stored losslessly) when a
 * finite element decodes to a non-finite value or a nonzero row (group, unrotated) to zeros.
 * The fast path (kvwc_rot_qenc_fast) never needs that decode: inside the band the
 * rule holds by construction, and outside it the careful path encodes and checks. With AVX2
 * it loads, bounds and rotates a row in one pass (simd/rot_avx2.c), and the gaussian
 * codebook over channel groups works on eight rows at a time while they sit in L1.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "encode/encode.h"

#include <math.h>
#include <stdlib.h>

#define REFUSE(rule, ...) kvw_fail(err, KVW_ERR_UNSUPPORTED, rule, __VA_ARGS__)

static int fin(float f) { return (kvwc_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

/* The forward rotation of every row of x ([rows, D]): signs, butterflies, then c_B. */
static void rotate_rows(float *x, uint64_t rows, uint64_t D, const kvw_codec_spec *s,
                        uint32_t *mask) {
    uint64_t B = kvwc_rot_block(D);
    float cb = kvwc_rot_cb(B);
    kvwc_rot_mask(s, D, mask); /* sylvester (1.3, codecs_tq.c): every sign + */
    for (uint64_t r = 0; r < rows; r++) {
        float *y = x + r * D;
        for (uint64_t d = 0; d < D; d++) y[d] = kvwc_bits_f32(kvwc_f32_bits(y[d]) ^ mask[d]);
        kvwc_rot_row(y, D, B, cb, NULL);
        for (uint64_t d = 0; d < D; d++) y[d] = y[d] * cb;
    }
}

/* n codes u (b = 2, 3 or 4 bits) of element i0 on or-ed into the bit string (KVW-ROT-3);
 * whole bytes at a time from a byte boundary. */
static void pack_or(const uint8_t *u, uint64_t i0, uint64_t n, unsigned b, uint8_t *codes) {
    uint64_t k = 0;
    for (; k < n && ((i0 + k) * b) % 8; k++) {
        uint64_t bit = (i0 + k) * b;
        codes[bit >> 3] |= (uint8_t)(u[k] << (bit & 7));
        if ((bit & 7) + b > 8) codes[(bit >> 3) + 1] |= (uint8_t)(u[k] >> (8 - (bit & 7)));
    }
    uint8_t *p = codes + (i0 + k) * b / 8;
    uint64_t runs = (n - k) / 8; /* 8 codes: b whole bytes */
    for (uint64_t r = 0; r < runs; r++, p += b) {
        uint32_t v = 0;
        for (unsigned q = 0; q < 8; q++) v |= (uint32_t)u[k + 8 * r + q] << (b * q);
        for (unsigned q = 0; q < b; q++) p[q] = (uint8_t)(v >> (8 * q)); /* fresh bytes */
    }
    for (k += 8 * runs; k < n; k++) {
        uint64_t bit = (i0 + k) * b;
        codes[bit >> 3] |= (uint8_t)(u[k] << (bit & 7));
        if ((bit & 7) + b > 8) codes[(bit >> 3) + 1] |= (uint8_t)(u[k] >> (8 - (bit & 7)));
    }
}

/* Gaussian codebook (section 8.4): scale = RMS in fp32 (squares summed in element order)
 * rounded to scale_dtype to nearest; code = nearest level of r / s, a midpoint taking the
 * level of larger magnitude (0 the positive one); a zero scale gives codes 2^(b-1). Without
 * a rotation every group must also keep a nonzero value (KVW-LOSSY-5 (b), section 3).
 * Two row-major passes: the sums (tokens axis: a row of channel sums at a time, each still
 * in its group's order), then the codes, branch-free over the midpoints. */
static kvw_code encode_gauss(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                             const float *x, uint8_t *params, uint8_t *codes, int *suspect,
                             kvw_error *err) {
    unsigned b = s->bits, sd = s->scale_dtype, half = 1u << (b - 1);
    uint64_t H = g->H, M = g->M, D = g->D, G = s->group_size, np = g->nparams;
    int tok = s->group_axis == KVW_GROUP_TOKENS;
    float lv[16], mid[8] = {0}; /* mid[j]: between levels half + j and half + j + 1 */
    kvwc_codebook_levels(b, lv);
    for (unsigned j = 0; j + 1 < half; j++) mid[j] = (lv[half + j] + lv[half + j + 1]) / 2.0f;
    for (unsigned j = half - 1; j < 8; j++) mid[j] = INFINITY; /* never reached */
    /* acc, live and top per group, then the scales as fp32 */
    float *acc = (float *)calloc((size_t)np * 2 + 1, sizeof(float)), *sf = acc + np;
    uint8_t *flag = (uint8_t *)calloc((size_t)np + 1, 2); /* live, top */
    if (!acc || !flag) {
        free(acc), free(flag);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine: %llu groups", (unsigned long long)np);
    }
    int avx2 = D % 8 == 0 && kvw_simd_rot();
    uint64_t r8 = !tok && G % 8 == 0 && avx2 ? (H * M) / 8 * 8 : 0; /* rows by eights: lanes per row */
    for (uint64_t r = 0; r < r8; r += 8)
        kvwc_rot_sumsq8_avx2(x + r * D, D, G, acc + r * g->gd, flag + r * g->gd);
    for (uint64_t hh = r8 / M; hh < H; hh++)
        for (uint64_t m = hh == r8 / M ? r8 % M : 0; m < M; m++) {
            const float *xr = x + (hh * M + m) * D;
            if (tok) {
                float *ar = acc + (hh * g->gm + m / G) * D;
                uint8_t *lr = flag + (hh * g->gm + m / G) * D;
                for (uint64_t d = 0; d < D; d++) {
                    float sq = xr[d] * xr[d];
                    ar[d] = ar[d] + sq;
                    lr[d] |= xr[d] != 0.0f;
                }
            } else {
                uint64_t k = (hh * M + m) * g->gd;
                for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G) {
                    uint64_t d1 = D - d0 < G ? D : d0 + G;
                    float a = 0.0f;
                    uint8_t live = 0;
                    for (uint64_t d = d0; d < d1; d++) {
                        float sq = xr[d] * xr[d];
                        a = a + sq;
                        live |= xr[d] != 0.0f;
                    }
                    acc[k + c] = a, flag[k + c] = live;
                }
            }
        }
    for (uint64_t k = 0; k < np; k++) {
        uint64_t n = tok ? ((k / D) % g->gm + 1) * G > M ? M - (k / D) % g->gm * G : G
                         : ((k % g->gd) + 1) * G > D ? D - (k % g->gd) * G : G;
        /* Squares below 2^-126 lose precision or vanish (a nonzero group of tiny values gets
         * the scale 0 and decodes to zeros), which rotation.band does not foresee: such a
         * chunk is checked on its decoded bytes (KVW-ROT-7), whatever its row maxima. */
        if (flag[k] && !(acc[k] >= 0x1p-126f)) *suspect = 1;
        uint32_t sb = kvwc_nearest_bits(sqrtf(acc[k] / (float)n), sd);
        sf[k] = kvwc_bits_value(sb, sd);
        if (!fin(sf[k])) {
            free(acc), free(flag);
            return REFUSE("KVW-LOSSY-5", "int_affine gaussian group %llu: its root mean square "
                          "is beyond the scale dtype", (unsigned long long)k);
        }
        if (g->psize == 4) kvw_st32(params + 4 * k, sb); else kvw_st16(params + 2 * k, (uint16_t)sb);
    }
    uint8_t *top = flag + np;
    uint8_t *u = (uint8_t *)malloc(2 * (size_t)D + 8), *jj = u + D;
    float *sv = (float *)malloc((size_t)D * sizeof(float) + 4);
    /* AVX2 codes of rotated rows (no group maxima needed): scales per channel or per
     * register (grp), fresh bytes per row (D * b a multiple of 8) */
    int vcodes = avx2 && s->rotation != KVW_ROTATION_NONE && (tok || G % 8 == 0);
    uint16_t *grp = (uint16_t *)malloc((size_t)D / 8 * sizeof(uint16_t) + 2);
    if (!u || !sv || !grp) {
        free(acc), free(flag), free(u), free(sv), free(grp);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine: rows of %llu", (unsigned long long)D);
    }
    for (uint64_t k = 0; k < D / 8; k++) grp[k] = (uint16_t)(8 * k / G);
    for (uint64_t hh = 0; hh < H; hh++)
        for (uint64_t m = 0; m < M; m++) {
            const float *xr = x + (hh * M + m) * D;
            uint64_t k0 = tok ? (hh * g->gm + m / G) * D : (hh * M + m) * g->gd;
            if (vcodes) {
                kvwc_rot_gauss_codes_avx2(xr, sf + k0, tok ? NULL : grp, D, b, mid,
                                          codes + (hh * M + m) * D * b / 8);
                continue;
            }
            if (tok) memcpy(sv, sf + k0, (size_t)D * sizeof(float));
            else
                for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G)
                    for (uint64_t d = d0; d < (D - d0 < G ? D : d0 + G); d++) sv[d] = sf[k0 + c];
            for (uint64_t d = 0; d < D; d++) { /* branch-free: vectorizes */
                float sc = sv[d], y = xr[d] / (sc > 0 ? sc : 1.0f), a = y < 0 ? -y : y;
                unsigned j = (a >= mid[0]) + (a >= mid[1]) + (a >= mid[2]) + (a >= mid[3]) +
                             (a >= mid[4]) + (a >= mid[5]) + (a >= mid[6]);
                j = sc > 0 ? (j < half - 1 ? j : half - 1) : 0; /* an infinite ratio: the top level */
                jj[d] = (uint8_t)j;
                u[d] = (uint8_t)(y < 0 && sc > 0 ? half - 1 - j : half + j);
            }
            if (s->rotation == KVW_ROTATION_NONE) { /* the groups' largest levels (LOSSY-5) */
                if (tok)
                    for (uint64_t d = 0; d < D; d++) top[k0 + d] = jj[d] > top[k0 + d] ? jj[d] : top[k0 + d];
                else
                    for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G)
                        for (uint64_t d = d0; d < (D - d0 < G ? D : d0 + G); d++)
                            top[k0 + c] = jj[d] > top[k0 + c] ? jj[d] : top[k0 + c];
            }
            pack_or(u, (hh * M + m) * D, D, b, codes);
        }
    kvw_code rc = KVW_OK;
    for (uint64_t k = 0; !rc && s->rotation == KVW_ROTATION_NONE && k < np; k++)
        if (flag[k] && (kvwc_nearest_bits(lv[half + top[k]] * sf[k], h->dtype) &
                        (h->dtype == KVW_DTYPE_F32 ? 0x7FFFFFFFu : 0x7FFFu)) == 0)
            rc = REFUSE("KVW-LOSSY-5", "int_affine gaussian group %llu with nonzero input "
                        "would decode to zeros", (unsigned long long)k);
    free(acc), free(flag), free(u), free(sv), free(grp);
    return rc;
}

/* KVW-ROT-7 on the decoded chunk (rotation.faithful): every element decodes finite (the
 * input is finite, LOSSY-6) and every row [h, m, :] with a nonzero input element decodes to
 * a row with a nonzero value. */
kvw_code kvwc_rot_check_decoded(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const float *x0, const uint8_t *body, kvw_error *err) {
    uint64_t n = g->H * g->T * g->D * g->w, D = g->D;
    uint8_t *dec = (uint8_t *)malloc(n ? (size_t)n : 1);
    if (!dec) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "decoded chunk of %llu bytes",
                              (unsigned long long)n);
    kvw_code rc = kvwc_lossy_decode(h, s, g, body, dec, err);
    unsigned w = (unsigned)g->w;
    uint32_t inf = w == 4 ? 0x7F800000u : h->dtype == KVW_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    for (uint64_t r = 0; !rc && r < g->H * g->M; r++) {
        uint64_t hh = r / g->M, m = r % g->M;
        const uint8_t *p = dec + ((hh * g->T + g->P + m) * D) * w;
        int live = 0, any = 0;
        for (uint64_t d = 0; d < D; d++) {
            uint32_t v = (w == 4 ? kvw_ld32(p + 4 * d) : kvw_ld16(p + 2 * d)) & (inf | (inf - 1u));
            if (v >= inf) {
                rc = REFUSE("KVW-ROT-7", "int_affine: head %llu token %llu would decode a finite "
                            "element to a non-finite value", (unsigned long long)hh,
                            (unsigned long long)(g->P + m));
                break;
            }
            live |= x0[r * D + d] != 0.0f, any |= v != 0;
        }
        if (!rc && live && !any)
            rc = REFUSE("KVW-ROT-7", "int_affine: the nonzero row of head %llu token %llu would "
                        "decode to zeros", (unsigned long long)hh, (unsigned long long)(g->P + m));
    }
    free(dec);
    return rc;
}

static const double SMALLEST[3] = {0x1p-133, 0x1p-24, 0x1p-149}; /* bf16, f16, f32 */
static const double LARGEST[3] = {0x1.fep127, 65504.0, FLT_MAX};

/* Every nonzero row's largest magnitude inside rotation.band: ROT-7 then holds by
 * construction (section 8.4). lo compares in binary64, hi as its nearest binary32, as
 * numpy compares the reference's fp32 row maxima with them. */
void kvwc_rot_band(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g, double *lo, float *hi) {
    unsigned sd = s->scale_dtype, dt = h->dtype;
    uint64_t D = g->D;
    double small = SMALLEST[sd] > SMALLEST[dt] ? SMALLEST[sd] : SMALLEST[dt];
    if (small < 0x1p-126) small = 0x1p-126;
    double big = LARGEST[sd] < LARGEST[dt] ? LARGEST[sd] : LARGEST[dt];
    double r2 = pow((double)FLT_MAX, 0.5);
    *lo = 1024.0 * sqrt((double)D) * small;
    *hi = (float)((big < r2 ? big : r2) / (double)(4 * D));
}
/* a: a row's largest magnitude as fp32 bits (finite). */
int kvwc_rot_in_band(uint32_t a, double lo, float hi) {
    float af = kvwc_bits_f32(a);
    return a == 0 || ((double)af >= lo && af <= hi);
}
static int rows_in_band(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        const float *x) {
    double lo;
    float hi;
    kvwc_rot_band(h, s, g, &lo, &hi);
    uint64_t D = g->D;
    for (uint64_t r = 0; r < g->H * g->M; r++) { /* x is finite: magnitudes as bits */
        uint32_t a = 0;
        const float *xr = x + r * D;
        for (uint64_t d = 0; d < D; d++) {
            uint32_t v = kvwc_f32_bits(xr[d]) & 0x7FFFFFFFu;
            a = v > a ? v : a;
        }
        if (!kvwc_rot_in_band(a, lo, hi)) return 0;
    }
    return 1;
}

kvw_code kvwc_rot_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         float *x, uint8_t *body, kvw_error *err) {
    uint64_t n = g->H * g->M * g->D;
    uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    int rot = s->rotation != KVW_ROTATION_NONE;
    int gauss = s->codebook == KVW_CODEBOOK_GAUSSIAN, check = (rot || gauss) && !rows_in_band(h, s, g, x);
    /* The input (for the check; gaussian: it may turn out needed) and the sign masks. */
    int keep = check || gauss;
    float *x0 = (float *)malloc((keep ? (size_t)n * sizeof(float) : 0) + (size_t)g->D * 4 + 4);
    if (!x0) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine: %llu elements",
                             (unsigned long long)n);
    uint32_t *mask = (uint32_t *)(void *)(x0 + (keep ? n : 0));
    if (keep) memcpy(x0, x, (size_t)n * sizeof(float));
    if (rot) rotate_rows(x, g->H * g->M, g->D, s, mask);
    kvw_code rc = gauss ? encode_gauss(h, s, g, x, params, codes, &check, err)
                        : kvwc_encode_int(h, s, g, x, params, codes, err);
    if (!rc && check) rc = kvwc_rot_check_decoded(h, s, g, x0, body, err);
    free(x0);
    return rc;
}

/* Header dtype row -> fp32; 0 when an element is not finite (LOSSY-6: the careful path
 * refuses the chunk and says where). */
static int load_row(const uint8_t *p, uint64_t D, unsigned dt, float *y) {
    uint32_t bad = 0;
    if (dt == KVW_DTYPE_F32) {
        memcpy(y, p, (size_t)D * 4);
        for (uint64_t d = 0; d < D; d++) bad |= (kvwc_f32_bits(y[d]) & 0x7F800000u) == 0x7F800000u;
    } else if (dt == KVW_DTYPE_BF16) {
        for (uint64_t d = 0; d < D; d++) {
            uint16_t u;
            memcpy(&u, p + 2 * d, 2);
            bad |= (u & 0x7F80u) == 0x7F80u;
            y[d] = kvwc_bits_f32((uint32_t)u << 16);
        }
    } else {
        for (uint64_t d = 0; d < D; d++) {
            uint16_t u;
            memcpy(&u, p + 2 * d, 2);
            bad |= (u & 0x7C00u) == 0x7C00u;
            y[d] = kvwc_from_f16(u);
        }
    }
    return !bad;
}

/* encode_gauss for groups along channels (G % 8 == 0, D % 8 == 0) straight from the raw
 * rows, eight at a time while they sit in L1: the fused load and rotation, then the group
 * sums (a lane per row), scales and codes, the same values as the passes over the chunk.
 * 0 (the careful path encodes the chunk) on whatever makes the fast path give up there: a
 * non-finite element, a row outside the band, a suspect group or a scale beyond its dtype. */
static int gauss_channels_fused(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const uint8_t *raw, uint8_t *params, uint8_t *codes,
                                const uint32_t *mask, double lo, float hi) {
    unsigned b = s->bits, sd = s->scale_dtype, half = 1u << (b - 1);
    uint64_t M = g->M, D = g->D, G = s->group_size, gd = g->gd, R = g->H * M, rowb = D * g->w;
    uint64_t B = kvwc_rot_block(D);
    float cb = kvwc_rot_cb(B), lv[16], mid[8] = {0};
    kvwc_codebook_levels(b, lv);
    for (unsigned j = 0; j + 1 < half; j++) mid[j] = (lv[half + j] + lv[half + j + 1]) / 2.0f;
    for (unsigned j = half - 1; j < 8; j++) mid[j] = INFINITY;
    float *y = (float *)malloc((size_t)(8 * D + 16 * gd) * sizeof(float) + 8 * (size_t)gd + D / 4 + 8);
    if (!y) return 0;
    float *acc = y + 8 * D, *sf = acc + 8 * gd;
    uint8_t *live = (uint8_t *)(sf + 8 * gd);
    uint16_t *grp = (uint16_t *)(void *)(live + 8 * gd + ((8 * gd) & 1));
    for (uint64_t k = 0; k < D / 8; k++) grp[k] = (uint16_t)(8 * k / G);
    int ok = 1;
    for (uint64_t r0 = 0; ok && r0 < R; r0 += 8) {
        uint64_t nr = R - r0 < 8 ? R - r0 : 8;
        for (uint64_t i = 0; ok && i < nr; i++) {
            uint64_t r = r0 + i;
            uint32_t a;
            kvwc_rot_enc_row_avx2(raw + ((r / M) * g->T + g->P + r % M) * rowb, h->dtype, D, B, cb, mask,
                                  y + i * D, &a);
            ok = a < 0x7F800000u && kvwc_rot_in_band(a, lo, hi);
        }
        if (!ok) break;
        if (nr == 8) {
            kvwc_rot_sumsq8_avx2(y, D, G, acc, live);
        } else {
            for (uint64_t i = 0; i < nr; i++)
                for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G) {
                    uint64_t d1 = D - d0 < G ? D : d0 + G;
                    float a = 0.0f;
                    uint8_t lf = 0;
                    for (uint64_t d = d0; d < d1; d++) {
                        float sq = y[i * D + d] * y[i * D + d];
                        a = a + sq;
                        lf |= y[i * D + d] != 0.0f;
                    }
                    acc[i * gd + c] = a, live[i * gd + c] = lf;
                }
        }
        for (uint64_t j = 0; ok && j < nr * gd; j++) { /* encode_gauss's scales, group by group */
            uint64_t c = j % gd, n = (c + 1) * G > D ? D - c * G : G, k = r0 * gd + j;
            if (live[j] && !(acc[j] >= 0x1p-126f)) ok = 0; /* suspect: the careful path checks it */
            uint32_t sb = kvwc_nearest_bits(sqrtf(acc[j] / (float)n), sd);
            sf[j] = kvwc_bits_value(sb, sd);
            ok = ok && fin(sf[j]);
            if (g->psize == 4) kvw_st32(params + 4 * k, sb); else kvw_st16(params + 2 * k, (uint16_t)sb);
        }
        for (uint64_t i = 0; ok && i < nr; i++)
            kvwc_rot_gauss_codes_avx2(y + i * D, sf + i * gd, grp, D, b, mid, codes + (r0 + i) * D * b / 8);
    }
    free(y);
    return ok;
}

int kvwc_rot_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                       const uint8_t *raw, uint8_t *body) {
    uint64_t H = g->H, M = g->M, D = g->D, n = H * M * D, rowb = D * g->w;
    uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    int rot = s->rotation != KVW_ROTATION_NONE, gauss = s->codebook == KVW_CODEBOOK_GAUSSIAN;
    float *x = (float *)malloc((size_t)n * sizeof(float) + (size_t)D * 4);
    if (!x) return 0;
    uint32_t *mask = (uint32_t *)(void *)(x + n);
    int ok = 1, suspect = 0;
    if (D % 8 == 0 && h->dtype != KVW_DTYPE_F16 && kvw_simd_rot()) {
        /* One pass a row: load, largest magnitude (finite, band), rotation; the same
         * refusals as below (either returns 0 for the careful path). */
        uint64_t B = kvwc_rot_block(D);
        float cb = kvwc_rot_cb(B), hi = 0;
        double lo = 0;
        if (rot) kvwc_rot_mask(s, D, mask); /* sylvester: every sign + */
        if (rot || gauss) kvwc_rot_band(h, s, g, &lo, &hi);
        if (rot && gauss && s->group_axis != KVW_GROUP_TOKENS && s->group_size % 8 == 0) {
            memset(params, 0, (size_t)(g->param_bytes + g->code_bytes)); /* any padding */
            ok = gauss_channels_fused(h, s, g, raw, params, codes, mask, lo, hi);
            free(x);
            return ok;
        }
        for (uint64_t r = 0; ok && r < H * M; r++) {
            uint32_t a;
            kvwc_rot_enc_row_avx2(raw + ((r / M) * g->T + g->P + r % M) * rowb, h->dtype, D, B, cb,
                                  rot ? mask : NULL, x + r * D, &a);
            ok = a < 0x7F800000u && (!(rot || gauss) || kvwc_rot_in_band(a, lo, hi));
        }
    } else {
        for (uint64_t r = 0; ok && r < H * M; r++) /* the quantized rows, in fp32 */
            ok = load_row(raw + ((r / M) * g->T + g->P + r % M) * rowb, D, h->dtype, x + r * D);
        /* Outside the band the careful path decodes and checks the chunk (KVW-ROT-7). */
        ok = ok && (!(rot || gauss) || rows_in_band(h, s, g, x));
        if (ok && rot) rotate_rows(x, H * M, D, s, mask);
    }
    if (ok && gauss) {
        memset(params, 0, (size_t)(g->param_bytes + g->code_bytes)); /* codes are or-ed in */
        ok = encode_gauss(h, s, g, x, params, codes, &suspect, NULL) == KVW_OK && !suspect;
    } else if (ok) {
        ok = kvwc_qenc_int_f32(h, s, g, x, params, codes);
    }
    free(x);
    return ok;
}
