/*
 * Helpers every kvwire-c command shares (conformance/PROTOCOL.md): a library failure as
 * the protocol's rejection line or an internal error, reading a whole file, and which
 * tensors a layer stores and what they are called (section 2.3).
 */
#include "tool_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A library failure: a rejection (exit 1, "CODE RULE message") or an internal error. */
int kvw_tool_fail(tool_io *o, const kvw_error *e) {
    if (kvw_code_is_format_error(e->code)) {
        sb_printf(&o->out, "%s", kvw_code_name(e->code));
        if (e->rule && e->rule[0]) sb_printf(&o->out, " %s", e->rule);
        if (e->message[0]) sb_printf(&o->out, " %s", e->message);
        sb_puts(&o->out, "\n");
        return EXIT_REJECTED;
    }
    sb_printf(&o->err, "kvwire-c: %s: %s\n", kvw_code_name(e->code), e->message);
    return EXIT_INTERNAL;
}

int kvw_tool_read_file(const char *path, uint8_t **data, size_t *len, tool_io *o) {
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    *data = NULL;
    *len = 0;
    if (!f) {
        sb_printf(&o->err, "kvwire-c: %s: %s\n", path, strerror(errno));
        return -1;
    }
    for (;;) {
        size_t got;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 65536;
            uint8_t *nb = realloc(buf, nc);
            if (!nb) { free(buf); fclose(f); sb_printf(&o->err, "kvwire-c: %s: out of memory\n", path); return -1; }
            buf = nb;
            cap = nc;
        }
        got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        fclose(f);
        sb_printf(&o->err, "kvwire-c: %s: read error\n", path);
        return -1;
    }
    fclose(f);
    *data = buf;
    *len = n;
    return 0;
}

const char *kvw_tool_component_label(int component, const kvw_layer_spec *s, uint32_t which, char *buf,
                                 size_t n) {
    if (component == KVW_COMP_STATE) {
        const kvw_state_tensor *t = &s->state_tensors[which];
        snprintf(buf, n, "state.%.*s", (int)t->name.len, (const char *)t->name.ptr);
    } else {
        snprintf(buf, n, "%s", kvw_component_name(component));
    }
    return buf;
}

/* The (component, which) pairs a layer stores (PROTOCOL.md 2.3); returns the count. */
uint32_t kvw_tool_layer_tensors(const kvw_header *h, uint32_t layer, int comps[], uint32_t which[], uint32_t max) {
    const kvw_layer_spec *s = kvw_layer(h, layer);
    uint32_t n = 0, j;
    if (!s) return 0;
    switch (s->kind) {
    case KVW_KIND_FULL_ATTENTION:
    case KVW_KIND_SLIDING_ATTENTION:
    case KVW_KIND_CHUNKED_ATTENTION:
        comps[n] = KVW_COMP_K; which[n++] = 0;
        comps[n] = KVW_COMP_V; which[n++] = 0;
        break;
    case KVW_KIND_MLA_LATENT:
        comps[n] = KVW_COMP_LATENT; which[n++] = 0;
        break;
    case KVW_KIND_STATE:
        if (layer < h->layer_tokens_count && h->layer_tokens[layer].count == 0) return 0;
        if (h->token_count == 0) return 0;
        for (j = 0; j < s->state_tensor_count && n < max; j++) { comps[n] = KVW_COMP_STATE; which[n++] = j; }
        return n;
    default:
        return 0;
    }
    if (h->has_sparse && n < max) { comps[n] = KVW_COMP_POSITIONS; which[n++] = 0; }
    return n;
}
