/*
 * libFuzzer target for libkvwire: every entry point that reads untrusted bytes, on one
 * input. Why: the spec's hostile-input rules (section 17, KVW-ERR-2) say any byte string
 * is either a valid container or rejected with a registry code -- never a crash, a hang,
 * an out-of-bounds read or a non-registry code. This target traps on anything else.
 *
 *   make -C c fuzz && build/c-fuzz/fuzz_kvwire CORPUS_DIR     (root: make fuzz-c)
 *
 * Per input: kvw_open + kvw_validate + kvw_read_tensor of every tensor; the stream
 * decoder fed in two pieces (split at a point the input's size picks) with bodies
 * decoded; kvw_header_parse over the header bytes the preamble names; then the reader and
 * the decoder again over a truncation of the input (an exact-size copy). Allocation is
 * bounded by max_decoded_bytes, so -malloc_limit_mb catches any allocation that does
 * not wait for its limit check.
 */
#include "kvwire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_MAX_DECODED (UINT64_C(64) << 20)

/* OK, a registry code, or out of memory: anything else is a bug. */
static void expect_code(kvw_code rc, const kvw_error *err) {
    if (rc == KVW_OK || rc == KVW_ERR_NO_MEMORY) return;
    if (!kvw_code_is_format_error(rc)) __builtin_trap();
    if (err->code != rc) __builtin_trap();
}

static void run_reader(const uint8_t *data, size_t size) {
    kvw_options opt;
    memset(&opt, 0, sizeof opt);
    opt.max_decoded_bytes = FUZZ_MAX_DECODED;
    kvw_reader *r = NULL;
    kvw_error err;
    kvw_code rc = kvw_open(data, size, &opt, &r, &err);
    expect_code(rc, &err);
    if (rc != KVW_OK) return;
    rc = kvw_validate(r, &err);
    expect_code(rc, &err);
    const kvw_header *h = kvw_reader_header(r);
    if (kvw_reader_decoded_size(r) > FUZZ_MAX_DECODED) __builtin_trap(); /* LIM-5 not applied */
    for (uint32_t l = 0; h && l < h->arch.num_layers; l++) {
        const kvw_layer_spec *s = kvw_layer(h, l);
        uint32_t nstate = s ? s->state_tensor_count : 0;
        for (int comp = 0; comp < KVW_COMPONENT_COUNT; comp++) {
            uint32_t nwhich = comp == KVW_COMP_STATE ? nstate : 1;
            for (uint32_t which = 0; which < nwhich; which++) {
                kvw_tensor_info info;
                kvw_code ic = kvw_tensor_info_of(r, l, comp, which, &info, &err);
                if (ic == KVW_ERR_INVALID_ARGUMENT) continue; /* the layer has no such tensor */
                expect_code(ic, &err);
                if (ic != KVW_OK || info.nbytes > FUZZ_MAX_DECODED) continue;
                void *out = malloc(info.nbytes ? (size_t)info.nbytes : 1);
                if (!out) continue;
                rc = kvw_read_tensor(r, l, comp, which, out, (size_t)info.nbytes, &err);
                expect_code(rc, &err);
                free(out);
            }
        }
    }
    kvw_close(r);
}

static void run_decoder(const uint8_t *data, size_t size) {
    kvw_decoder_options opt;
    memset(&opt, 0, sizeof opt);
    opt.base.max_decoded_bytes = FUZZ_MAX_DECODED;
    opt.decode_bodies = 1;
    opt.concatenated = size % 3 == 0; /* both modes over the corpus */
    kvw_decoder *d = NULL;
    kvw_error err;
    kvw_code rc = kvw_decoder_new(&opt, &d, &err);
    if (rc != KVW_OK) {
        if (rc != KVW_ERR_NO_MEMORY) __builtin_trap();
        return;
    }
    size_t split = (size_t)(((uint64_t)size * UINT64_C(2654435761)) % ((uint64_t)size + 1));
    const uint8_t *pieces[2] = {data, data + split};
    size_t lens[2] = {split, size - split};
    int next_piece = 0, finished = 0;
    /* Each event consumes input or is a header/chunk/end; bound the loop generously. */
    size_t guard = 0, limit = 4 * size + 64;
    for (; guard < limit; guard++) {
        kvw_event ev;
        rc = kvw_next(d, &ev, &err);
        if (rc != KVW_OK) {
            expect_code(rc, &err);
            /* sticky (the API promises it) */
            kvw_event ev2;
            kvw_error err2;
            if (kvw_next(d, &ev2, &err2) != rc) __builtin_trap();
            break;
        }
        if (ev.type == KVW_EVENT_EOF) break;
        if (ev.type == KVW_EVENT_CHUNK && ev.record && ev.data_len != ev.record->raw_length && ev.data)
            __builtin_trap();
        if (ev.type != KVW_EVENT_NEED_DATA) continue;
        if (finished) __builtin_trap(); /* NEED_DATA after finish: it would never end */
        if (next_piece < 2) {
            rc = kvw_decoder_feed(d, pieces[next_piece], lens[next_piece], &err);
            next_piece++;
        } else {
            rc = kvw_decoder_finish(d, &err);
            finished = 1;
        }
        if (rc != KVW_OK) {
            expect_code(rc, &err);
            break;
        }
    }
    if (guard == limit) __builtin_trap(); /* more events than the input can hold: a loop */
    kvw_decoder_free(d);
}

static void run_header(const uint8_t *data, size_t size) {
    if (size < 32) return;
    uint32_t n = (uint32_t)data[12] | ((uint32_t)data[13] << 8) | ((uint32_t)data[14] << 16) |
                 ((uint32_t)data[15] << 24);
    size_t len = n <= size - 32 ? n : size - 32; /* a short header is also a hostile input */
    /* an exact-size copy so that any read past the header is caught */
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy) return;
    memcpy(copy, data + 32, len);
    kvw_header h;
    kvw_header_init(&h);
    kvw_error err;
    kvw_code rc = kvw_header_parse(copy, len, &h, &err);
    expect_code(rc, &err);
    if (rc == KVW_OK) {
        /* touch what the parser built */
        volatile uint64_t sink = 0;
        for (uint32_t i = 0; i < h.arch.num_layers; i++) {
            const kvw_layer_spec *s = kvw_layer(&h, i);
            if (s) sink += s->num_kv_heads + s->head_dim_k;
        }
        for (uint32_t i = 0; i < h.layer_tokens_count; i++) sink += h.layer_tokens[i].count;
        for (uint32_t i = 0; i < h.metadata_count; i++)
            if (h.metadata[i].key.len) sink += h.metadata[i].key.ptr[h.metadata[i].key.len - 1];
        (void)sink;
    }
    kvw_header_free(&h);
    free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const uint8_t empty[1] = {0};
    if (!data) data = empty; /* libFuzzer's empty input (NULL, 0): test_unit covers that call */
    run_reader(data, size);
    run_decoder(data, size);
    run_header(data, size);
    /* A truncation of the same input (mutations seldom cut a valid container short, and a
     * cut that keeps every checksum valid is where length arithmetic goes wrong): the last
     * 1 to 1024 bytes dropped, in an exact-size copy so that ASan sees a read past it. */
    if (size > 32) {
        size_t span = size - 32 < 1024 ? size - 32 : 1024;
        size_t cut = size - 1 - (size_t)(((uint64_t)size * UINT64_C(40503)) % span);
        uint8_t *copy = malloc(cut);
        if (copy) {
            memcpy(copy, data, cut);
            run_reader(copy, cut);
            run_decoder(copy, cut);
            free(copy);
        }
    }
    return 0;
}
