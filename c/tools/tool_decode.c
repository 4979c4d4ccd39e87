/*
 * The kvwire-c commands that check or unpack a container: validate, decode (PROTOCOL.md
 * 2.4: one file per tensor plus decoded.json) and reassemble (1.2, the same output from a
 * segmented stream). They share the decoded-directory writers kept static here.
 */
#include "tool_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tool_write_file(const char *path, const void *data, size_t len, tool_io *o) {
    FILE *f = fopen(path, "wb");
    if (!f || (len && fwrite(data, 1, len, f) != len) || fclose(f) != 0) {
        sb_printf(&o->err, "kvwire-c: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* decoded.json (PROTOCOL.md 2.4) around a header; tensors_json is the tensors array. */
static int tool_write_decoded(const char *dir, const char *form, const char *extra_key, uint64_t extra,
                       const kvw_header *h, const sbuf *tensors_json, tool_io *o) {
    sbuf doc;
    char path[4096];
    int rc;
    sb_init(&doc);
    sb_printf(&doc, "{\"format\": \"kvwire-decoded\", \"version\": 1, \"form\": \"%s\", \"%s\": ", form, extra_key);
    sb_u64(&doc, extra);
    sb_puts(&doc, ", \"header\": ");
    neutral_header_to_json(&doc, h);
    sb_puts(&doc, ", \"tensors\": [");
    sb_putn(&doc, tensors_json->p ? tensors_json->p : "", tensors_json->len);
    sb_puts(&doc, "]}\n");
    if (doc.oom) { sb_free(&doc); sb_puts(&o->err, "kvwire-c: out of memory\n"); return -1; }
    snprintf(path, sizeof path, "%s/decoded.json", dir);
    rc = tool_write_file(path, doc.p, doc.len, o);
    sb_free(&doc);
    return rc;
}

/* One tensor entry plus its file. */
static int tool_emit_tensor(const char *dir, uint32_t layer, const char *label, const kvw_tensor_info *info,
                     const void *data, sbuf *tensors_json, tool_io *o) {
    char name[512], path[4096];
    uint32_t d;
    snprintf(name, sizeof name, "layer%u_%s.bin", layer, label);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (tool_write_file(path, data, (size_t)info->nbytes, o)) return -1;
    if (tensors_json->len) sb_puts(tensors_json, ", ");
    sb_printf(tensors_json, "{\"layer\": %u, \"component\": ", layer);
    sb_jcstr(tensors_json, label);
    sb_puts(tensors_json, ", \"shape\": [");
    for (d = 0; d < info->ndim && d < 8; d++) {
        if (d) sb_puts(tensors_json, ", ");
        sb_u64(tensors_json, info->shape[d]);
    }
    sb_puts(tensors_json, "], \"file\": ");
    sb_jcstr(tensors_json, name);
    sb_puts(tensors_json, "}");
    return 0;
}

int kvw_tool_cmd_validate(const char *in, tool_io *o) {
    kvw_reader *r = NULL;
    kvw_error e;
    kvw_code c;
    memset(&e, 0, sizeof e);
    c = kvw_open_file(in, NULL, &r, &e);
    if (c == KVW_OK) c = kvw_validate(r, &e);
    kvw_close(r);
    if (c != KVW_OK) return kvw_tool_fail(o, &e);
    sb_puts(&o->out, "VALID\n");
    return 0;
}

int kvw_tool_cmd_decode(const char *in, const char *dir, tool_io *o) {
    kvw_reader *r = NULL;
    kvw_error e;
    kvw_code c;
    const kvw_header *h;
    sbuf tensors;
    uint32_t i, k;
    int rc = 0;
    memset(&e, 0, sizeof e);
    c = kvw_open_file(in, NULL, &r, &e);
    if (c == KVW_OK) c = kvw_validate(r, &e);
    if (c != KVW_OK) { kvw_close(r); return kvw_tool_fail(o, &e); }
    h = kvw_reader_header(r);
    sb_init(&tensors);
    for (i = 0; i < h->arch.num_layers && rc == 0; i++) {
        int comps[80];
        uint32_t which[80], n = kvw_tool_layer_tensors(h, i, comps, which, 80);
        for (k = 0; k < n && rc == 0; k++) {
            kvw_tensor_info info;
            uint8_t *buf;
            char label[300];
            c = kvw_tensor_info_of(r, i, comps[k], which[k], &info, &e);
            if (c != KVW_OK) { rc = kvw_tool_fail(o, &e); break; }
            if (info.nbytes > SIZE_MAX || !(buf = malloc(info.nbytes ? (size_t)info.nbytes : 1))) {
                sb_puts(&o->err, "kvwire-c: out of memory\n");
                rc = EXIT_INTERNAL;
                break;
            }
            c = kvw_read_tensor(r, i, comps[k], which[k], buf, (size_t)info.nbytes, &e);
            if (c != KVW_OK) rc = kvw_tool_fail(o, &e);
            else if (tool_emit_tensor(dir, i, kvw_tool_component_label(comps[k], kvw_layer(h, i), which[k], label,
                                                                  sizeof label),
                                      &info, buf, &tensors, o))
                rc = EXIT_INTERNAL;
            free(buf);
        }
    }
    if (rc == 0 && tool_write_decoded(dir, kvw_reader_form(r) == KVW_FORM_FILE ? "file" : "stream", "chunk_count",
                                      kvw_chunk_count(r), h, &tensors, o))
        rc = EXIT_INTERNAL;
    sb_free(&tensors);
    kvw_close(r);
    if (rc == 0) sb_puts(&o->out, "DECODED\n");
    return rc;
}

/* ---- reassemble (PROTOCOL.md 1.2) --------------------------------------------------- */

int kvw_tool_cmd_reassemble(const char *in, const char *dir, tool_io *o) {
    uint8_t *buf = NULL;
    size_t len;
    kvw_reassembly *ra = NULL;
    kvw_error e;
    const kvw_header *h;
    sbuf tensors;
    uint32_t i, k;
    int rc = 0;
    memset(&e, 0, sizeof e);
    if (kvw_tool_read_file(in, &buf, &len, o)) return EXIT_INTERNAL;
    if (kvw_reassemble(buf, len, NULL, &ra, &e) != KVW_OK) {
        free(buf);
        return kvw_tool_fail(o, &e);
    }
    free(buf);
    h = kvw_reassembly_header(ra);
    sb_init(&tensors);
    for (i = 0; i < h->arch.num_layers && rc == 0; i++) {
        int comps[80];
        uint32_t which[80], n = kvw_tool_layer_tensors(h, i, comps, which, 80);
        for (k = 0; k < n && rc == 0; k++) {
            kvw_tensor_info info;
            const uint8_t *data;
            char label[300];
            if (kvw_reassembly_tensor(ra, i, comps[k], which[k], &info, &data, &e) != KVW_OK) {
                rc = kvw_tool_fail(o, &e);
                break;
            }
            if (tool_emit_tensor(dir, i, kvw_tool_component_label(comps[k], kvw_layer(h, i), which[k], label,
                                                              sizeof label),
                                 &info, data, &tensors, o))
                rc = EXIT_INTERNAL;
        }
    }
    if (rc == 0 && tool_write_decoded(dir, "segments", "segments", kvw_reassembly_segments(ra), h, &tensors, o))
        rc = EXIT_INTERNAL;
    if (rc == 0) sb_printf(&o->out, "REASSEMBLED %zu\n", kvw_reassembly_segments(ra));
    sb_free(&tensors);
    kvw_reassembly_free(ra);
    return rc;
}
