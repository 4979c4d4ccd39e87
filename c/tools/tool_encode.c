/*
 * kvwire-c encode (PROTOCOL.md 2.5): an encode spec's header and tensor files through the
 * library's writer into a container, dense tensors cut on the chunk grid and sparse ones
 * per head (spec/sparse.md). Kept apart from the reading commands: it is the only one
 * that drives kvw_writer.
 */
#include "tool_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- encode (PROTOCOL.md 2.5) ------------------------------------------------------- */

/* The file of tensor (layer, label) of the encode spec, read whole. */
static int spec_tensor(const jv *tensors, const char *base, uint32_t layer, const char *label, uint8_t **data,
                       size_t *len, tool_io *o) {
    size_t i;
    char path[4096];
    for (i = 0; tensors && i < tensors->len; i++) {
        const jv *t = &tensors->items[i];
        uint64_t l;
        const char *c = json_str(json_get(t, "component")), *f = json_str(json_get(t, "file"));
        if (json_u64(json_get(t, "layer"), &l) || l != layer || !c || strcmp(c, label) != 0) continue;
        if (!f) break;
        if ((f[0] == '/' ? snprintf(path, sizeof path, "%s", f) : snprintf(path, sizeof path, "%s/%s", base, f)) >=
            (int)sizeof path)
            break;
        return kvw_tool_read_file(path, data, len, o);
    }
    sb_printf(&o->err, "kvwire-c encode: no tensor file for layer %u %s\n", layer, label);
    return -1;
}

/* Add every chunk of one (layer, component) tensor [heads, count, dim] on the grid. */
static int add_tensor_chunks(kvw_writer *w, const kvw_header *h, uint32_t layer, int comp, const uint8_t *data,
                             size_t len, int codec, kvw_error *e, tool_io *o) {
    const kvw_layer_spec *s = kvw_layer(h, layer);
    uint32_t heads = comp == KVW_COMP_LATENT ? 1 : s->num_kv_heads;
    uint32_t dim = comp == KVW_COMP_V ? s->head_dim_v : s->head_dim_k;
    uint32_t lo = 0, hi = h->token_count, C = h->chunk_tokens ? h->chunk_tokens : 1, t0, hd;
    uint64_t row = (uint64_t)dim * kvw_dtype_size(h->dtype), need;
    kvw_iovec *parts;
    if (layer < h->layer_tokens_count) {
        lo = h->layer_tokens[layer].start;
        hi = lo + h->layer_tokens[layer].count;
    }
    need = (uint64_t)heads * (hi - lo) * row;
    if (need != len) {
        sb_printf(&o->err, "kvwire-c encode: layer %u %s: file has %zu bytes, the header implies %llu\n", layer,
                  kvw_component_name(comp), len, (unsigned long long)need);
        return EXIT_INTERNAL;
    }
    if (heads == 0 || hi == lo) return 0;
    parts = malloc(heads * sizeof *parts);
    if (!parts) return EXIT_INTERNAL;
    for (t0 = lo; t0 < hi;) {
        uint32_t t1 = (t0 / C + 1) * C;
        if (t1 > hi || t1 < t0) t1 = hi;
        for (hd = 0; hd < heads; hd++) {
            parts[hd].base = data + ((uint64_t)hd * (hi - lo) + (t0 - lo)) * row;
            parts[hd].len = (size_t)((t1 - t0) * row);
        }
        if (kvw_writer_add(w, layer, comp, t0, t1 - t0, codec, 0, parts, (int)heads, e) != KVW_OK) {
            free(parts);
            return kvw_tool_fail(o, e);
        }
        t0 = t1;
    }
    free(parts);
    return 0;
}

/* Sparse containers (spec/sparse.md): the canonical tensor holds the heads' retained rows
 * concatenated in head order ([sum of retained, dim]; POSITIONS: int64 positions). Every
 * chunk holds one head's cell of its retained index space (KVW-SPARSE-7); POSITIONS bodies
 * are delta varints from first_position (KVW-SPARSE-10). */
static uint32_t sparse_heads_of(const kvw_layer_spec *s) {
    if (!s || s->kind == KVW_KIND_SHARED || s->kind == KVW_KIND_STATE) return 0;
    return s->kind == KVW_KIND_MLA_LATENT ? 1 : s->num_kv_heads;
}

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    do {
        uint8_t g = (uint8_t)(v & 0x7F);
        v >>= 7;
        p[n++] = (uint8_t)(g | (v ? 0x80 : 0));
    } while (v);
    return n;
}

static int add_sparse_chunks(kvw_writer *w, const kvw_header *h, uint32_t layer, int comp, const uint8_t *data,
                             size_t len, int codec, kvw_error *e, tool_io *o) {
    const kvw_layer_spec *s = kvw_layer(h, layer);
    uint32_t heads = sparse_heads_of(s), hd, C = h->chunk_tokens ? h->chunk_tokens : 1, i;
    uint32_t dim = comp == KVW_COMP_V ? s->head_dim_v : s->head_dim_k;
    uint64_t row = comp == KVW_COMP_POSITIONS ? 8 : (uint64_t)dim * kvw_dtype_size(h->dtype), first = 0, total = 0;
    uint8_t *vbuf = NULL;
    for (i = 0; i < layer; i++) first += sparse_heads_of(kvw_layer(h, i));
    for (hd = 0; hd < heads; hd++)
        if (first + hd < h->sparse.retained_counts.count)
            total += kvw_u32_at(h->sparse.retained_counts, (uint32_t)(first + hd));
    if (total * row != len) {
        sb_printf(&o->err, "kvwire-c encode: layer %u %s: file has %zu bytes, the header implies %llu\n", layer,
                  kvw_component_name(comp), len, (unsigned long long)(total * row));
        return EXIT_INTERNAL;
    }
    if (comp == KVW_COMP_POSITIONS && !(vbuf = malloc((size_t)C * 10 + 1))) return EXIT_INTERNAL;
    for (hd = 0, total = 0; hd < heads; hd++) {
        uint32_t n = first + hd < h->sparse.retained_counts.count
                         ? kvw_u32_at(h->sparse.retained_counts, (uint32_t)(first + hd)) : 0, t0;
        for (t0 = 0; t0 < n;) {
            uint32_t t1 = n - t0 > C ? t0 + C : n;
            kvw_iovec part;
            if (comp == KVW_COMP_POSITIONS) {
                uint64_t prev = 0, k, vlen = 0;
                for (k = t0; k < t1; k++) {
                    const uint8_t *q = data + (total + k) * 8;
                    uint64_t p = (uint64_t)q[0] | (uint64_t)q[1] << 8 | (uint64_t)q[2] << 16 |
                                 (uint64_t)q[3] << 24 | (uint64_t)q[4] << 32 | (uint64_t)q[5] << 40 |
                                 (uint64_t)q[6] << 48 | (uint64_t)q[7] << 56;
                    vlen += put_varint(vbuf + vlen, k == t0 ? p - h->first_position : p - prev - 1);
                    prev = p;
                }
                part.base = vbuf;
                part.len = (size_t)vlen;
            } else {
                part.base = data + (total + t0) * row;
                part.len = (size_t)((t1 - t0) * row);
            }
            if (kvw_writer_add_head(w, layer, comp, (int)hd, t0, t1 - t0,
                                    comp == KVW_COMP_POSITIONS && codec > KVW_CODEC_ZSTD ? KVW_CODEC_RAW : codec, 0,
                                    &part, 1, e) != KVW_OK) {
                free(vbuf);
                return kvw_tool_fail(o, e);
            }
            t0 = t1;
        }
        total += n;
    }
    free(vbuf);
    return 0;
}

int kvw_tool_cmd_encode(const char *spec_path, const char *out_path, tool_io *o) {
    uint8_t *text = NULL;
    size_t text_len;
    jv *spec = NULL;
    char msg[300], base[4096];
    const char *form, *codec_name, *slash;
    const jv *tensors;
    kvw_header h;
    neutral_arena arena = {0};
    kvw_writer_options wo;
    kvw_writer *w = NULL;
    kvw_file_sink *sink = NULL;
    kvw_error e;
    int rc = EXIT_INTERNAL, codec;
    uint32_t layer;
    memset(&e, 0, sizeof e);
    if (kvw_tool_read_file(spec_path, &text, &text_len, o)) return EXIT_INTERNAL;
    if (json_parse((const char *)text, text_len, &spec, msg, sizeof msg)) {
        sb_printf(&o->err, "kvwire-c encode: %s: %s\n", spec_path, msg);
        goto done;
    }
    if (!json_str(json_get(spec, "format")) || strcmp(json_str(json_get(spec, "format")), "kvwire-encode-spec")) {
        sb_printf(&o->err, "kvwire-c encode: %s: not a kvwire-encode-spec document\n", spec_path);
        goto done;
    }
    if (neutral_header_from_json(json_get(spec, "header"), &h, &arena, msg, sizeof msg)) {
        sb_printf(&o->err, "kvwire-c encode: %s\n", msg);
        goto done;
    }
    form = json_str(json_get(spec, "form"));
    codec_name = json_str(json_get(spec, "codec"));
    tensors = json_get(spec, "tensors");
    memset(&wo, 0, sizeof wo);
    wo.form = form && strcmp(form, "stream") == 0 ? KVW_FORM_STREAM : KVW_FORM_FILE;
    codec = codec_name && strcmp(codec_name, "zstd") == 0 ? KVW_CODEC_ZSTD : KVW_CODEC_RAW;
    slash = strrchr(spec_path, '/');
    if (slash) snprintf(base, sizeof base, "%.*s", (int)(slash - spec_path), spec_path);
    else snprintf(base, sizeof base, ".");
    if (kvw_file_sink_open(out_path, &sink, &e) != KVW_OK ||
        kvw_writer_new(&h, &wo, kvw_file_sink_write, sink, &w, &e) != KVW_OK) {
        rc = kvw_tool_fail(o, &e);
        goto done;
    }
    rc = 0;
    for (layer = 0; layer < h.arch.num_layers && rc == 0; layer++) {
        int comps[80];
        uint32_t which[80], n = kvw_tool_layer_tensors(&h, layer, comps, which, 80), k;
        for (k = 0; k < n && rc == 0; k++) {
            char label[300];
            uint8_t *data = NULL;
            size_t len = 0;
            const kvw_layer_spec *s = kvw_layer(&h, layer);
            kvw_tool_component_label(comps[k], s, which[k], label, sizeof label);
            if (spec_tensor(tensors, base, layer, label, &data, &len, o)) { rc = EXIT_INTERNAL; break; }
            if (comps[k] == KVW_COMP_STATE) {
                /* KVW-STATE-7: one chunk per state tensor, tokens [0, T), in state_tensors order. */
                kvw_iovec part;
                part.base = data;
                part.len = len;
                if (kvw_writer_add(w, layer, KVW_COMP_STATE, 0, h.token_count, codec, 0, &part, 1, &e) != KVW_OK)
                    rc = kvw_tool_fail(o, &e);
            } else if (h.has_sparse) {
                rc = add_sparse_chunks(w, &h, layer, comps[k], data, len, codec, &e, o);
            } else {
                rc = add_tensor_chunks(w, &h, layer, comps[k], data, len, codec, &e, o);
            }
            free(data);
        }
    }
    if (rc == 0 && kvw_writer_finish(w, &e) != KVW_OK) rc = kvw_tool_fail(o, &e);
done:
    if (w) kvw_writer_free(w);
    if (sink) {
        kvw_error e2;
        if (kvw_file_sink_close(sink, rc == 0, &e2) != KVW_OK && rc == 0) rc = kvw_tool_fail(o, &e2);
    }
    if (rc == 0) sb_puts(&o->out, "ENCODED\n");
    neutral_arena_free(&arena);
    json_free(spec);
    free(text);
    return rc;
}
