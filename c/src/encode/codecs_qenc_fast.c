/*
 * Lossy encoders, fused fast path: the common case of codecs_qenc.c (one
 * contiguous chunk, every group inside the safe range of section 3.1) in one or two
 * cache-resident passes per group, with the header dtype fixed per specialised loop so
 * that the compiler vectorises the extremes and the quantisation. Same fp32 arithmetic as
 * the careful path (one rounding per operation, no contraction: fp_exact.h), and integer
 * rounding only where it equals rint under round-to-nearest-even: for 0 <= |y| < 2^23 the
 * mantissa bits of |y| + 2^23 are rint(|y|) exactly. Anything else (non-finite input, a
 * group near the extremes, several parts, odd packing) returns 0 and the careful path
 * encodes the chunk, so the bytes and refusals are the careful path's in every case.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "encode/encode.h"
#include "simd/qenc_prm.h"

#define MAXD KVWC_QCH_MAXD /* longest row (int tokens axis) or group run kept on the stack */

static const float SMALLEST[3] = {0x1p-133f, 0x1p-24f, 0x1p-149f}; /* bf16, f16, f32 */
static const float LARGEST[3] = {3.3895313892515355e38f, 65504.0f, FLT_MAX};
static const int PRECISION[3] = {8, 11, 24};

INL float ld(const uint8_t *p, size_t i, unsigned dt) {
    if (dt == KVW_DTYPE_F32) { float f; memcpy(&f, p + 4 * i, 4); return f; }
    uint16_t u;
    memcpy(&u, p + 2 * i, 2);
    return dt == KVW_DTYPE_BF16 ? kvwc_bits_f32((uint32_t)u << 16) : kvwc_from_f16(u);
}
/* Largest magnitude bits of n elements (the dtype's bits without sign; >= inf: not finite). */
INL uint32_t max_abs_bits(const uint8_t *p, size_t n, unsigned dt) {
    uint32_t m = 0;
    if (dt == KVW_DTYPE_F32) {
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, p + 4 * i, 4);
            u &= 0x7FFFFFFFu;
            m = u > m ? u : m;
        }
    } else {
        int16_t m16 = 0; /* magnitudes < 2^15: signed compares (SSE2 pmaxsw) */
        for (size_t i = 0; i < n; i++) {
            int16_t u;
            memcpy(&u, p + 2 * i, 2);
            u = (int16_t)(u & 0x7FFF);
            m16 = u > m16 ? u : m16;
        }
        m = (uint32_t)m16;
    }
    return m;
}
static uint32_t inf_bits(unsigned dt) {
    return dt == KVW_DTYPE_F32 ? 0x7F800000u : dt == KVW_DTYPE_F16 ? 0x7C00u : 0x7F80u;
}

/* ---- fp8 -------------------------------------------------------------------------------- */
INL void fp8_run(const uint8_t *p, size_t n, float sc, float f, unsigned fmt, unsigned dt,
                 uint8_t *out) {
    unsigned mb = fmt == KVW_DTYPE_F8_E5M2 ? 2 : 3, sh = 23 - mb;
    int bias = fmt == KVW_DTYPE_F8_E5M2 ? 15 : fmt == KVW_DTYPE_F8_E4M3FN ? 7 : 8;
    float thr = kvwc_bits_f32((uint32_t)(128 - bias) << 23);
    float k1 = kvwc_bits_f32((uint32_t)(127 + bias - 1 + (int)mb) << 23);
    uint32_t off = (uint32_t)(127 - bias) << mb, rnd = (1u << (sh - 1)) - 1u;
    for (size_t i = 0; i < n; i++) {
        float y = ld(p, i, dt) / sc;
        y = y > f ? f : y;
        y = y < -f ? -f : y;
        uint32_t u = kvwc_f32_bits(y), a = u & 0x7FFFFFFFu;
        float av = kvwc_bits_f32(a);
        uint32_t cs = rint_abs(av * k1);                         /* subnormal code */
        uint32_t cn = ((a + rnd + ((a >> sh) & 1u)) >> sh) - off; /* normal, RNE */
        uint32_t code = av < thr ? cs : cn;
        uint32_t sg = (u >> 31) << 7;
        if (fmt == KVW_DTYPE_F8_E4M3FNUZ) sg = code ? sg : 0; /* no negative zero */
        out[i] = (uint8_t)(code | sg);
    }
}

INL int fp8_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                 const uint8_t *raw, uint8_t *params, uint8_t *codes, unsigned dt) {
    uint64_t H = g->H, T = g->T, M = g->M, D = g->D, w = g->w, rowb = D * w, n = M * D;
    unsigned fmt = s->fp8_format;
    (void)h;
    float f = fmt == KVW_DTYPE_F8_E5M2 ? 57344.0f : fmt == KVW_DTYPE_F8_E4M3FN ? 448.0f : 240.0f;
    float lo = 0x1p-125f * f, hi = LARGEST[dt] / 4;
    if (lo < 4 * SMALLEST[dt]) lo = 4 * SMALLEST[dt];
    int gran = s->scale_granularity;
    uint32_t mb = 0;
    if (gran == KVW_SCALE_TENSOR)
        for (uint64_t hh = 0; hh < H; hh++) {
            uint32_t m = max_abs_bits(raw + (hh * T + g->P) * rowb, (size_t)n, dt);
            mb = m > mb ? m : mb;
        }
    uint64_t run = gran == KVW_SCALE_TOKEN ? D : n, runs = gran == KVW_SCALE_TOKEN ? M : 1;
    for (uint64_t hh = 0; hh < H; hh++) {
        const uint8_t *src = raw + (hh * T + g->P) * rowb;
        if (gran == KVW_SCALE_HEAD) mb = max_abs_bits(src, (size_t)n, dt);
        for (uint64_t r = 0; r < runs; r++) {
            const uint8_t *p = src + r * run * w;
            if (gran == KVW_SCALE_TOKEN) mb = max_abs_bits(p, (size_t)run, dt);
            if (mb >= inf_bits(dt)) return 0;
            float a = kvwc_bits_value(mb, dt), sc = a / f;
            if (!(a >= lo && a <= hi)) return 0;
            uint64_t k = gran == KVW_SCALE_TOKEN ? hh * M + r : gran == KVW_SCALE_HEAD ? hh : 0;
            kvw_st32(params + 4 * k, kvwc_f32_bits(sc));
            fp8_run(p, (size_t)run, sc, f, fmt, dt, codes + hh * n + r * run);
        }
    }
    return 1;
}

/* ---- int_affine ------------------------------------------------------------------------- */
/* One code: clamp, round to nearest even, offset (symmetric). */
INL uint32_t icode(float y, float qmax, float half, int sym) {
    float loc = sym ? -qmax : 0.0f;
    y = y > qmax ? qmax : y;
    y = y < loc ? loc : y;
    uint32_t u = kvwc_f32_bits(y), r = rint_abs(kvwc_bits_f32(u & 0x7FFFFFFFu));
    if (!sym) return r;
    uint32_t neg = u >> 31;
    return (uint32_t)half + ((r ^ (0u - neg)) + neg);
}
/* n codes (n * b a whole number of bytes) packed at out, least significant bits first. */
static void pack(const uint8_t *c, size_t n, unsigned b, uint8_t *out) {
    if (b == 8) { memcpy(out, c, n); return; }
    if (b == 4) {
        for (size_t j = 0; j < n / 2; j++) out[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
        return;
    }
    if (b == 3) { /* revision 1.2: 8 codes in 3 bytes, least significant first (KVW-ROT-3) */
        for (size_t j = 0; j < n / 8; j++) {
            uint32_t v = 0;
            for (unsigned q = 0; q < 8; q++) v |= (uint32_t)c[8 * j + q] << (3 * q);
            out[3 * j] = (uint8_t)v, out[3 * j + 1] = (uint8_t)(v >> 8), out[3 * j + 2] = (uint8_t)(v >> 16);
        }
        return;
    }
    for (size_t j = 0; j < n / 4; j++)
        out[j] = (uint8_t)(c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) | (c[4 * j + 3] << 6));
}

INL int int_tokens(const iprm *q, const kvwc_geom *g, uint64_t G, const uint8_t *raw,
                   uint8_t *params, uint8_t *codes, unsigned dt, int vec) {
    uint64_t T = g->T, M = g->M, D = g->D, w = g->w, rowb = D * w;
    float mn[MAXD], mx[MAXD], sv[MAXD], zv[MAXD], den[MAXD];
    uint8_t cb[MAXD];
    for (uint64_t hh = 0; hh < g->H; hh++)
        for (uint64_t gi = 0; gi < g->gm; gi++) {
            uint64_t m0 = gi * G, n = M - m0 < G ? M - m0 : G;
            const uint8_t *p0 = raw + (hh * T + g->P + m0) * rowb;
            if (vec) { /* the AVX2 kernels (simd/qenc_avx2.c), the same three steps */
                if (!kvwc_qtok_extremes_avx2(p0, (size_t)n, (size_t)rowb, (size_t)D, dt, mn, mx))
                    return 0; /* NaN or infinity: LOSSY-6 on the careful path */
                if (!kvwc_qch_params_avx2(q, (size_t)D, mn, mx, sv, zv, den, params, (hh * g->gm + gi) * D))
                    return 0;
                kvwc_qtok_codes_avx2(p0, (size_t)n, (size_t)rowb, (size_t)D, dt, zv, den, q->sym, q->b,
                                     codes + (hh * M + m0) * D * q->b / 8);
                continue;
            }
            for (size_t d = 0; d < D; d++) mn[d] = mx[d] = ld(p0, d, dt);
            for (uint64_t r = 1; r < n; r++) {
                const uint8_t *p = p0 + r * rowb;
                for (size_t d = 0; d < D; d++) {
                    float v = ld(p, d, dt);
                    mn[d] = mn[d] < v ? mn[d] : v; /* equal: the last (numpy's minimum) */
                    mx[d] = mx[d] > v ? mx[d] : v;
                }
            }
            if (!row_params(q, (size_t)D, mn, mx, sv, zv, den, params, (hh * g->gm + gi) * D))
                return 0;
            for (uint64_t r = 0; r < n; r++) {
                const uint8_t *p = p0 + r * rowb;
                if (q->sym)
                    for (size_t d = 0; d < D; d++)
                        cb[d] = (uint8_t)icode(ld(p, d, dt) / den[d], q->qmax, q->half, 1);
                else
                    for (size_t d = 0; d < D; d++)
                        cb[d] = (uint8_t)icode((ld(p, d, dt) - zv[d]) / den[d], q->qmax, q->half, 0);
                pack(cb, (size_t)D, q->b, codes + (hh * M + m0 + r) * D * q->b / 8);
            }
        }
    return 1;
}

/* Extremes of n elements, the last of equal values kept (numpy's minimum / maximum). In LN
 * lanes; lanes differ from one sequential pass only in which zero they keep, so a zero
 * result is taken again sequentially. */
#define LN 4 /* lanes of extremes() */
INL void extremes(const uint8_t *p, size_t n, unsigned dt, float *a, float *c) {
    float lo8[LN], hi8[LN];
    size_t i = 0;
    if (n >= LN) {
        for (size_t j = 0; j < LN; j++) lo8[j] = hi8[j] = ld(p, j, dt);
        for (i = LN; i + LN <= n; i += LN)
            for (size_t j = 0; j < LN; j++) {
                float v = ld(p, i + j, dt);
                lo8[j] = lo8[j] < v ? lo8[j] : v;
                hi8[j] = hi8[j] > v ? hi8[j] : v;
            }
    } else {
        lo8[0] = hi8[0] = ld(p, 0, dt);
        for (size_t j = 1; j < LN; j++) lo8[j] = hi8[j] = lo8[0];
        i = 1;
    }
    float x = lo8[0], y = hi8[0];
    for (size_t j = 1; j < LN; j++) {
        if (lo8[j] <= x) x = lo8[j];
        if (hi8[j] >= y) y = hi8[j];
    }
    for (; i < n; i++) {
        float v = ld(p, i, dt);
        if (v <= x) x = v;
        if (v >= y) y = v;
    }
    if (x == 0 || y == 0) { /* which zero: the last one, as in one pass */
        x = y = ld(p, 0, dt);
        for (i = 1; i < n; i++) {
            float v = ld(p, i, dt);
            if (v <= x) x = v;
            if (v >= y) y = v;
        }
    }
    *a = x, *c = y;
}

/* Groups along channels. When vec, the AVX2 kernels (simd/qenc_avx2.c) take the three
 * steps, the extremes also finding non-finite input, for blocks of rows that stay in L1
 * between the passes; the parameters are the same row_params source either way. */
#define VEC_BLOCK 8192 /* bytes of input rows per block on the AVX2 path */
INL int int_channels(const iprm *q, const kvwc_geom *g, uint64_t G, const uint8_t *raw,
                     uint8_t *params, uint8_t *codes, unsigned dt, int vec) {
    uint64_t T = g->T, M = g->M, D = g->D, w = g->w, rowb = D * w, gd = g->gd;
    uint64_t R = MAXD / gd; /* rows whose groups' parameters are made together */
    if (vec && R * rowb > VEC_BLOCK) R = VEC_BLOCK / rowb > 0 ? VEC_BLOCK / rowb : 1;
    float mn[MAXD], mx[MAXD], sv[MAXD], zv[MAXD], den[MAXD];
    uint8_t cb[MAXD];
    for (uint64_t hh = 0; hh < g->H; hh++)
        for (uint64_t m0 = 0; m0 < M; m0 += R) {
            uint64_t nr = M - m0 < R ? M - m0 : R;
            const uint8_t *rows = raw + (hh * T + g->P + m0) * rowb;
            uint8_t *out = codes + (hh * M + m0) * D * q->b / 8;
            if (vec && !kvwc_qch_extremes_avx2(rows, (size_t)nr, (size_t)D, (size_t)G, dt, mn, mx))
                return 0; /* NaN or infinity: LOSSY-6 on the careful path */
            for (uint64_t r = 0; !vec && r < nr; r++)
                for (uint64_t c = 0; c < gd; c++) {
                    uint64_t d0 = c * G, n = D - d0 < G ? D - d0 : G;
                    extremes(rows + r * rowb + d0 * w, (size_t)n, dt, &mn[r * gd + c], &mx[r * gd + c]);
                }
            if (!(vec ? kvwc_qch_params_avx2 : row_params)(q, (size_t)(nr * gd), mn, mx, sv, zv, den, params,
                                                            (hh * M + m0) * gd))
                return 0;
            if (vec) {
                kvwc_qch_codes_avx2(rows, (size_t)nr, (size_t)D, (size_t)G, dt, zv, den, q->sym, q->b, out);
                continue;
            }
            for (uint64_t r = 0; r < nr; r++) {
                const uint8_t *row = rows + r * rowb;
                for (uint64_t c = 0; c < gd; c++) { /* a group: its scale and zero constants */
                    uint64_t d0 = c * G, n = D - d0 < G ? D - d0 : G;
                    const uint8_t *p = row + d0 * w;
                    float dv = den[r * gd + c], z = zv[r * gd + c];
                    if (q->sym)
                        for (size_t i = 0; i < n; i++)
                            cb[d0 + i] = (uint8_t)icode(ld(p, i, dt) / dv, q->qmax, q->half, 1);
                    else
                        for (size_t i = 0; i < n; i++)
                            cb[d0 + i] = (uint8_t)icode((ld(p, i, dt) - z) / dv, q->qmax, q->half, 0);
                }
                pack(cb, (size_t)D, q->b, out + r * D * q->b / 8);
            }
        }
    return 1;
}

static inline int use_avx2(void) { return kvw_simd_qch(); }

INL int int_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                 const uint8_t *raw, uint8_t *params, uint8_t *codes, unsigned dt, unsigned bd) {
    iprm q;
    q.sd = s->scale_dtype, q.b = s->bits, q.ps = g->psize, q.sym = s->symmetric;
    q.np = g->nparams;
    q.qmax = (float)(q.sym ? (1u << (q.b - 1)) - 1u : (1u << q.b) - 1u);
    q.half = (float)(1u << (q.b - 1));
    q.lo = kvwc_bits_f32((uint32_t)(127 + PRECISION[q.sd]) << 23) * SMALLEST[q.sd];
    q.hi = (LARGEST[bd] < LARGEST[q.sd] ? LARGEST[bd] : LARGEST[q.sd]) / 4; /* bd: header dtype */
    if (q.lo < 4 * SMALLEST[bd]) q.lo = 4 * SMALLEST[bd];
    (void)h;
    int chan = s->group_axis != KVW_GROUP_TOKENS;
    int vec = chan && s->group_size % 8 == 0 && g->D % 8 == 0 && use_avx2(); /* packs 8/4/3/2 */
    int vtok = !chan && g->D % 8 == 0 && use_avx2(); /* the extremes kernel checks finiteness */
    for (uint64_t hh = 0; !vec && !vtok && hh < g->H; hh++) /* LOSSY-6: the careful path says which element */
        if (max_abs_bits(raw + (hh * g->T + g->P) * g->D * g->w, (size_t)(g->M * g->D), dt) >=
            inf_bits(dt))
            return 0;
    return chan ? int_channels(&q, g, s->group_size, raw, params, codes, dt, vec)
                : int_tokens(&q, g, s->group_size, raw, params, codes, dt, vtok);
}

static int fp8_bf16(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                    const uint8_t *raw, uint8_t *p, uint8_t *c) { return fp8_fast(h, s, g, raw, p, c, KVW_DTYPE_BF16); }
static int fp8_f16(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *p, uint8_t *c) { return fp8_fast(h, s, g, raw, p, c, KVW_DTYPE_F16); }
static int fp8_f32(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *p, uint8_t *c) { return fp8_fast(h, s, g, raw, p, c, KVW_DTYPE_F32); }
static int int_bf16(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                    const uint8_t *raw, uint8_t *p, uint8_t *c) { return int_fast(h, s, g, raw, p, c, KVW_DTYPE_BF16, KVW_DTYPE_BF16); }
static int int_f16(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *p, uint8_t *c) { return int_fast(h, s, g, raw, p, c, KVW_DTYPE_F16, KVW_DTYPE_F16); }
static int int_f32(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *p, uint8_t *c) { return int_fast(h, s, g, raw, p, c, KVW_DTYPE_F32, KVW_DTYPE_F32); }

int kvwc_qenc_int_f32(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                      const float *x, uint8_t *params, uint8_t *codes) {
    kvwc_geom g2 = *g; /* x is the quantized part alone, in fp32 */
    g2.T = g->M, g2.P = 0, g2.Q = 0, g2.w = 4;
    if (h->dtype > KVW_DTYPE_F32 || g->D > MAXD || (g->D * s->bits) % 8 || s->scale_dtype > KVW_DTYPE_F32)
        return 0;
    return int_fast(h, s, &g2, (const uint8_t *)(const void *)x, params, codes, KVW_DTYPE_F32, h->dtype);
}

int kvwc_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *body) {
    unsigned dt = h->dtype;
    if (dt > KVW_DTYPE_F32 || g->D > MAXD || !g->M || !g->H || !g->D) return 0;
    int rot = s->codec == KVW_CODEC_INT_AFFINE && kvw_codec_spec_uses_rotation(s);
    if (s->codec == KVW_CODEC_INT_AFFINE &&
        ((g->D * s->bits) % 8 || s->scale_dtype > KVW_DTYPE_F32 || s->group_size == 0))
        return 0;
    uint64_t rowb = g->D * g->w;
    uint8_t *resid = body + g->H * g->P * rowb;
    for (uint64_t hh = 0; hh < g->H; hh++) { /* kept tokens as they are (KVW-LOSSY-2) */
        memcpy(body + hh * g->P * rowb, raw + hh * g->T * rowb, (size_t)(g->P * rowb));
        memcpy(resid + hh * g->Q * rowb, raw + (hh * g->T + g->P + g->M) * rowb, (size_t)(g->Q * rowb));
    }
    if (rot && s->codebook == KVW_CODEBOOK_TURBOQUANT) /* revision 1.3: codecs_tq.c */
        return kvwc_tq_qenc_fast(h, s, g, raw, body);
    if (rot) return kvwc_rot_qenc_fast(h, s, g, raw, body); /* revision 1.2: codecs_rot_enc.c */
    uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    typedef int (*fast_fn)(const kvw_header *, const kvw_codec_spec *, const kvwc_geom *,
                           const uint8_t *, uint8_t *, uint8_t *);
    static const fast_fn FP8[3] = {fp8_bf16, fp8_f16, fp8_f32}, INT[3] = {int_bf16, int_f16, int_f32};
    return (s->codec == KVW_CODEC_FP8 ? FP8 : INT)[dt](h, s, g, raw, params, codes);
}
