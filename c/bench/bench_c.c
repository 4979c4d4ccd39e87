/*
 * bench_c: libkvwire's speed on one container against the physical limits (memcpy and
 * XXH3 over the same bytes). Why: the C library exists to be the fast path next to the
 * engines; its claims (open in microseconds, validation near XXH3 speed, decoding one
 * copy) are measured here. benchmarks/bench_c.py writes the container with the Python
 * reference, runs this, and writes benchmarks/results/c.md.
 *
 *   bench_c FILE.kvw [REPEAT [INNER_OPEN]]
 *   bench_c --encode [REPEAT]      lossy encoding (kvw_lossy_encode_wire), one chunk per spec
 *
 * Prints one JSON object per line: {"name", "median_ns", "min_ns", "bytes", "inner"}.
 * Every row is the median and min of REPEAT timed samples after one warm-up; open rows
 * average INNER_OPEN calls per sample. "bytes" is what GB/s is computed over: the
 * payload (sum of raw_length) for decode rows, the container for checksum rows.
 */
#define _POSIX_C_SOURCE 200809L
#include "kvwire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct bench_ctx {
    const char *path;
    const uint8_t *buf;
    size_t len;
    uint8_t **outs; /* one prefaulted buffer per tensor */
    size_t *out_lens;
    uint32_t *out_layer;
    int *out_comp;
    size_t ntensors;
    uint8_t *copy_dst;
    size_t payload;
    volatile uint64_t sink;
    int failed;
} bench_ctx;

typedef void (*bench_fn)(bench_ctx *c);

static void report(const char *name, uint64_t *samples, int n, uint64_t bytes, int inner) {
    qsort(samples, (size_t)n, sizeof *samples, cmp_u64);
    uint64_t med = n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
    printf("{\"name\": \"%s\", \"median_ns\": %llu, \"min_ns\": %llu, \"bytes\": %llu, \"inner\": %d}\n",
           name, (unsigned long long)med, (unsigned long long)samples[0], (unsigned long long)bytes, inner);
    fflush(stdout);
}

static void run(bench_ctx *c, const char *name, bench_fn fn, int repeat, int inner, uint64_t bytes) {
    uint64_t *s = calloc((size_t)repeat, sizeof *s);
    if (!s) exit(2);
    for (int rep = 0; rep <= repeat; rep++) {
        uint64_t t0 = now_ns();
        for (int i = 0; i < inner; i++) fn(c);
        uint64_t t1 = now_ns();
        if (rep) s[rep - 1] = (t1 - t0) / (uint64_t)inner;
        if (c->failed) {
            fprintf(stderr, "bench_c: %s failed\n", name);
            exit(1);
        }
    }
    report(name, s, repeat, bytes, inner);
    free(s);
}

/* Speed of fn relative to ref, measured in alternating pairs so that both see the same
 * load (this machine's throughput moves by up to 2x over seconds): the median over pairs
 * of time(ref) / time(fn). Printed as {"name", "ratio_median", "ratio_min", "ratio_max"}. */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void run_paired(bench_ctx *c, const char *name, bench_fn fn, bench_fn ref, int repeat) {
    double *q = calloc((size_t)repeat, sizeof *q);
    if (!q) exit(2);
    for (int rep = 0; rep <= repeat; rep++) {
        uint64_t t0 = now_ns();
        ref(c);
        uint64_t t1 = now_ns();
        fn(c);
        uint64_t t2 = now_ns();
        if (c->failed) {
            fprintf(stderr, "bench_c: %s failed\n", name);
            exit(1);
        }
        if (rep) q[rep - 1] = (double)(t1 - t0) / (double)(t2 - t1);
    }
    qsort(q, (size_t)repeat, sizeof *q, cmp_double);
    double med = repeat % 2 ? q[repeat / 2] : (q[repeat / 2 - 1] + q[repeat / 2]) / 2;
    printf("{\"name\": \"%s\", \"ratio_median\": %.4f, \"ratio_min\": %.4f, \"ratio_max\": %.4f}\n",
           name, med, q[0], q[repeat - 1]);
    fflush(stdout);
    free(q);
}

static void die(const char *what, kvw_code rc, const kvw_error *err) {
    fprintf(stderr, "bench_c: %s: %s %s %s\n", what, kvw_code_name(rc), err->rule, err->message);
    exit(1);
}

/* ---- the rows ---- */
static void b_memcpy(bench_ctx *c) {
    memcpy(c->copy_dst, c->buf, c->len);
    c->sink += c->copy_dst[c->len / 2];
}
static void b_xxh3(bench_ctx *c) { c->sink += XXH3_64bits(c->buf, c->len); }

static void b_open_buffer(bench_ctx *c) {
    kvw_reader *r;
    kvw_error err;
    kvw_code rc = kvw_open(c->buf, c->len, NULL, &r, &err);
    if (rc) { c->failed = 1; return; }
    c->sink += kvw_chunk_count(r);
    kvw_close(r);
}
static void b_open_file(bench_ctx *c) {
    kvw_reader *r;
    kvw_error err;
    kvw_code rc = kvw_open_file(c->path, NULL, &r, &err);
    if (rc) { c->failed = 1; return; }
    c->sink += kvw_chunk_count(r);
    kvw_close(r);
}

static void validate_reader(bench_ctx *c, kvw_reader *r) {
    kvw_error err;
    if (kvw_validate(r, &err)) c->failed = 1;
    kvw_close(r);
}
static void b_validate_buffer(bench_ctx *c) {
    kvw_reader *r;
    if (kvw_open(c->buf, c->len, NULL, &r, NULL)) { c->failed = 1; return; }
    validate_reader(c, r);
}
static void b_validate_file(bench_ctx *c) {
    kvw_reader *r;
    if (kvw_open_file(c->path, NULL, &r, NULL)) { c->failed = 1; return; }
    validate_reader(c, r);
}

static void read_all(bench_ctx *c, kvw_reader *r) {
    kvw_error err;
    for (size_t i = 0; i < c->ntensors; i++)
        if (kvw_read_tensor(r, c->out_layer[i], c->out_comp[i], 0, c->outs[i], c->out_lens[i], &err)) {
            c->failed = 1;
            break;
        }
    kvw_close(r);
}
static void b_decode_buffer(bench_ctx *c) {
    kvw_reader *r;
    if (kvw_open(c->buf, c->len, NULL, &r, NULL)) { c->failed = 1; return; }
    read_all(c, r);
}
static void b_decode_file(bench_ctx *c) {
    kvw_reader *r;
    if (kvw_open_file(c->path, NULL, &r, NULL)) { c->failed = 1; return; }
    read_all(c, r);
}
static void b_decode_nocheck(bench_ctx *c) {
    kvw_reader *r;
    kvw_options o;
    memset(&o, 0, sizeof o);
    o.skip_body_checksums = 1;
    if (kvw_open(c->buf, c->len, &o, &r, NULL)) { c->failed = 1; return; }
    read_all(c, r);
}

static void b_stream_decoder(bench_ctx *c) {
    kvw_decoder_options o;
    memset(&o, 0, sizeof o);
    kvw_decoder *d;
    kvw_error err;
    if (kvw_decoder_new(&o, &d, &err)) { c->failed = 1; return; }
    /* fed in 1 MiB pieces, as from a socket */
    size_t fed = 0;
    int done = 0, finished = 0;
    while (!done) {
        kvw_event ev;
        if (kvw_next(d, &ev, &err)) { c->failed = 1; break; }
        if (ev.type == KVW_EVENT_EOF) break;
        if (ev.type == KVW_EVENT_CHUNK) c->sink += ev.body[0];
        if (ev.type != KVW_EVENT_NEED_DATA) continue;
        if (fed < c->len) {
            size_t n = c->len - fed < (1u << 20) ? c->len - fed : (1u << 20);
            if (kvw_decoder_feed(d, c->buf + fed, n, &err)) { c->failed = 1; break; }
            fed += n;
        } else if (!finished) {
            if (kvw_decoder_finish(d, &err)) { c->failed = 1; break; }
            finished = 1;
        } else {
            c->failed = 1;
            done = 1;
        }
    }
    kvw_decoder_free(d);
}

/* bench_c --encode [REPEAT]: kvw_lossy_encode_wire (the fused lossy encoders) over one chunk
 * of 8 heads x 256 tokens x 128 bf16 (approximately Gaussian, every 16th channel x8 as the
 * outlier channels of real K caches) for a grid of codec specs; "bytes" is the raw chunk. */
static int bench_encode(int repeat) {
    enum { EH = 8, ET = 256, ED = 128 };
    static uint8_t raw[EH * ET * ED * 2], dst[EH * ET * ED * 8];
    uint32_t x = 1;
    for (size_t i = 0; i < (size_t)EH * ET * ED; i++) {
        float v = 0;
        for (int k = 0; k < 4; k++) {
            x = x * 1103515245u + 12345u;
            v += (float)((x >> 8) & 0xFFFF) / 65536.0f - 0.5f;
        }
        v *= (i % ED) % 16 == 0 ? 8.0f : 1.7f;
        uint32_t u;
        memcpy(&u, &v, 4);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        raw[2 * i] = (uint8_t)u, raw[2 * i + 1] = (uint8_t)(u >> 8);
    }
    static const struct { const char *name; int codec, fmt, gran, bits, axis, sym, sd; } G[] = {
        {"fp8-e4m3fn-tensor", KVW_CODEC_FP8, KVW_DTYPE_F8_E4M3FN, KVW_SCALE_TENSOR, 8, 0, 0, 0},
        {"fp8-e5m2-head", KVW_CODEC_FP8, KVW_DTYPE_F8_E5M2, KVW_SCALE_HEAD, 8, 0, 0, 0},
        {"fp8-e4m3fnuz-token", KVW_CODEC_FP8, KVW_DTYPE_F8_E4M3FNUZ, KVW_SCALE_TOKEN, 8, 0, 0, 0},
        {"int8-sym-tokens-f32", KVW_CODEC_INT_AFFINE, 0, 0, 8, KVW_GROUP_TOKENS, 1, KVW_DTYPE_F32},
        {"int4-asym-tokens-f16", KVW_CODEC_INT_AFFINE, 0, 0, 4, KVW_GROUP_TOKENS, 0, KVW_DTYPE_F16},
        {"int2-asym-tokens-f16", KVW_CODEC_INT_AFFINE, 0, 0, 2, KVW_GROUP_TOKENS, 0, KVW_DTYPE_F16},
        {"int8-asym-channels-bf16", KVW_CODEC_INT_AFFINE, 0, 0, 8, KVW_GROUP_CHANNELS, 0, KVW_DTYPE_BF16},
        {"int4-sym-channels-bf16", KVW_CODEC_INT_AFFINE, 0, 0, 4, KVW_GROUP_CHANNELS, 1, KVW_DTYPE_BF16},
        {"int2-asym-channels-f16", KVW_CODEC_INT_AFFINE, 0, 0, 2, KVW_GROUP_CHANNELS, 0, KVW_DTYPE_F16},
    };
    kvw_layer_spec ls;
    kvw_layer_spec_init(&ls);
    ls.num_kv_heads = EH, ls.head_dim_k = ED, ls.head_dim_v = ED;
    uint16_t index = 0;
    uint64_t *smp = calloc((size_t)repeat, sizeof *smp);
    if (!smp) return 2;
    for (size_t k = 0; k < sizeof G / sizeof G[0]; k++) {
        kvw_codec_spec spec;
        kvw_codec_spec_init(&spec);
        spec.codec = (uint8_t)G[k].codec, spec.fp8_format = (uint8_t)G[k].fmt;
        spec.scale_granularity = (uint8_t)G[k].gran, spec.bits = (uint8_t)G[k].bits;
        spec.group_axis = (uint8_t)G[k].axis, spec.symmetric = (uint8_t)G[k].sym;
        spec.scale_dtype = (uint8_t)G[k].sd;
        kvw_header h;
        kvw_header_init(&h);
        h.arch.num_layers = 1, h.arch.layer_specs = &ls, h.arch.layer_spec_count = 1;
        h.arch.layer_spec_index = &index, h.arch.layer_spec_index_count = 1;
        h.dtype = KVW_DTYPE_BF16, h.chunk_tokens = ET, h.token_count = ET;
        h.codec_specs = &spec, h.codec_spec_count = 1, h.required_features = KVW_FEATURE_CODEC_SPECS;
        kvw_record rec;
        memset(&rec, 0, sizeof rec);
        rec.token_count = ET, rec.codec = spec.codec, rec.head_count = EH, rec.reserved0 = 1;
        rec.raw_length = sizeof raw;
        uint8_t wire[KVW_RECORD_SIZE];
        kvw_record_encode(&rec, wire);
        for (int r = 0; r <= repeat; r++) {
            size_t wr = 0;
            kvw_error err;
            uint64_t t0 = now_ns();
            kvw_code rc = kvw_lossy_encode_wire(&h, wire, raw, sizeof raw, dst, sizeof dst, &wr, &err);
            uint64_t t1 = now_ns();
            if (rc) die(G[k].name, rc, &err);
            if (r) smp[r - 1] = t1 - t0;
        }
        char name[64];
        snprintf(name, sizeof name, "encode %s", G[k].name);
        report(name, smp, repeat, sizeof raw, 1);
    }
    free(smp);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "--encode") == 0)
        return bench_encode(argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 50);
    if (argc < 2) {
        fprintf(stderr, "usage: bench_c FILE.kvw [REPEAT [INNER_OPEN]]\n");
        return 2;
    }
    int repeat = argc > 2 ? atoi(argv[2]) : 5;
    int inner_open = argc > 3 ? atoi(argv[3]) : 200;
    if (repeat < 1) repeat = 1;
    if (inner_open < 1) inner_open = 1;
    bench_ctx c;
    memset(&c, 0, sizeof c);
    c.path = argv[1];

    FILE *f = fopen(c.path, "rb");
    if (!f) { perror(c.path); return 1; }
    fseek(f, 0, SEEK_END);
    long flen = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(flen > 0 ? (size_t)flen : 1);
    if (!buf || fread(buf, 1, (size_t)flen, f) != (size_t)flen) { fprintf(stderr, "read failed\n"); return 1; }
    fclose(f);
    c.buf = buf;
    c.len = (size_t)flen;

    kvw_reader *r;
    kvw_error err;
    kvw_code rc = kvw_open(c.buf, c.len, NULL, &r, &err);
    if (rc) die("open", rc, &err);
    const kvw_header *h = kvw_reader_header(r);
    c.payload = (size_t)kvw_reader_decoded_size(r);
    size_t cap = (size_t)h->arch.num_layers * 2;
    c.outs = calloc(cap ? cap : 1, sizeof *c.outs);
    c.out_lens = calloc(cap ? cap : 1, sizeof *c.out_lens);
    c.out_layer = calloc(cap ? cap : 1, sizeof *c.out_layer);
    c.out_comp = calloc(cap ? cap : 1, sizeof *c.out_comp);
    if (!c.outs || !c.out_lens || !c.out_layer || !c.out_comp) return 2;
    for (uint32_t l = 0; l < h->arch.num_layers; l++)
        for (int k = 0; k < 2; k++) {
            kvw_tensor_info info;
            if (kvw_tensor_info_of(r, l, k, 0, &info, &err) != KVW_OK) continue;
            uint8_t *o = malloc(info.nbytes ? (size_t)info.nbytes : 1);
            if (!o) return 2;
            memset(o, 1, (size_t)info.nbytes); /* prefaulted: the rows time decoding, not page faults */
            c.outs[c.ntensors] = o;
            c.out_lens[c.ntensors] = (size_t)info.nbytes;
            c.out_layer[c.ntensors] = l;
            c.out_comp[c.ntensors] = k;
            c.ntensors++;
        }
    printf("{\"config\": {\"file_bytes\": %zu, \"payload_bytes\": %zu, \"chunks\": %zu, \"tensors\": %zu, "
           "\"layers\": %u, \"token_count\": %u, \"chunk_tokens\": %u, \"repeat\": %d, \"inner_open\": %d, "
           "\"library\": \"%s\"}}\n",
           c.len, c.payload, kvw_chunk_count(r), c.ntensors, h->arch.num_layers, h->token_count,
           h->chunk_tokens, repeat, inner_open, KVW_VERSION_STRING);
    kvw_close(r);
    c.copy_dst = malloc(c.len);
    if (!c.copy_dst) return 2;
    memset(c.copy_dst, 1, c.len);

    run(&c, "memcpy", b_memcpy, repeat, 1, c.len);
    run(&c, "xxh3", b_xxh3, repeat, 1, c.len);
    run(&c, "open_buffer", b_open_buffer, repeat, inner_open, c.payload);
    run(&c, "open_file", b_open_file, repeat, inner_open, c.payload);
    run(&c, "validate_buffer", b_validate_buffer, repeat, 1, c.len);
    run(&c, "validate_file", b_validate_file, repeat, 1, c.len);
    run(&c, "read_tensor_buffer", b_decode_buffer, repeat, 1, c.payload);
    run(&c, "read_tensor_file", b_decode_file, repeat, 1, c.payload);
    run(&c, "read_tensor_nocheck", b_decode_nocheck, repeat, 1, c.payload);
    run(&c, "stream_decoder", b_stream_decoder, repeat, 1, c.len);
    run_paired(&c, "validate_vs_xxh3", b_validate_buffer, b_xxh3, repeat);
    run_paired(&c, "read_tensor_vs_xxh3", b_decode_buffer, b_xxh3, repeat);
    run_paired(&c, "read_tensor_nocheck_vs_memcpy", b_decode_nocheck, b_memcpy, repeat);
    if (c.sink == 42) puts("");
    for (size_t i = 0; i < c.ntensors; i++) free(c.outs[i]);
    free(c.outs);
    free(c.out_lens);
    free(c.out_layer);
    free(c.out_comp);
    free(c.copy_dst);
    free(buf);
    return 0;
}
