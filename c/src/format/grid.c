/*
 * The chunk grid (spec 8.2; sparse.md 3.1 for sparse containers; crossmodel.md STATE-7
 * for state layers) and the per-record checks of section 8 in the order of the note at
 * the end of 8.3 (with CSPEC-9, STATE-8 and SPARSE-7..9 where the companions put them).
 * The grid says which chunks a header implies, so every record has exactly one slot.
 * The record checks that use it are in grid_check.c.
 */
#include "format/grid.h"

#include <stdlib.h>

static int stores_dense(uint8_t kind, int comp) {
    switch (kind) {
    case KVW_KIND_FULL_ATTENTION:
    case KVW_KIND_SLIDING_ATTENTION:
    case KVW_KIND_CHUNKED_ATTENTION: return comp == KVW_COMP_K || comp == KVW_COMP_V;
    case KVW_KIND_MLA_LATENT: return comp == KVW_COMP_LATENT;
    case KVW_KIND_STATE: return comp == KVW_COMP_STATE;
    default: return 0;
    }
}

/* heads(l) of sparse.md 2: kv heads, 1 for MLA, 0 for shared (and state). */
static uint32_t sparse_layer_heads(const kvw_layer_spec *s) {
    switch (s->kind) {
    case KVW_KIND_FULL_ATTENTION:
    case KVW_KIND_SLIDING_ATTENTION:
    case KVW_KIND_CHUNKED_ATTENTION: return s->num_kv_heads;
    case KVW_KIND_MLA_LATENT: return 1;
    default: return 0;
    }
}

static void comp_geometry(const kvw_layer_spec *s, int comp, uint32_t *heads, uint32_t *dim) {
    switch (comp) {
    case KVW_COMP_K: *heads = s->num_kv_heads; *dim = s->head_dim_k; break;
    case KVW_COMP_V: *heads = s->num_kv_heads; *dim = s->head_dim_v; break;
    case KVW_COMP_LATENT: *heads = 1; *dim = s->head_dim_k; break;
    case KVW_COMP_STATE: *heads = 1; *dim = 0; break;
    default: *heads = sparse_layer_heads(s); *dim = 0; break; /* POSITIONS */
    }
}

static uint64_t range_cells(uint64_t lo, uint64_t count, uint64_t c) {
    if (count == 0) return 0;
    return (lo + count - 1) / c - lo / c + 1;
}

void kvw_grid_free(kvw_grid *g) {
    if (!g) return;
    kvw_grid_impl *gi = (kvw_grid_impl *)g->impl_;
    if (gi) {
        free(gi->base);
        free(gi->cells);
        free(gi->heads);
        free(gi->dims);
        free(gi->lo_cell);
        free(gi->entry);
        free(gi->head_base);
        free(gi);
    }
    g->impl_ = NULL;
    g->total = 0;
}

static kvw_code no_mem(kvw_grid *g, kvw_error *err) {
    kvw_grid_free(g);
    return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory building the chunk grid");
}

kvw_code kvw_grid_build(const kvw_header *h, kvw_grid *g, kvw_error *err) {
    g->impl_ = NULL;
    g->total = 0;
    uint32_t L = h->arch.num_layers;
    if (L > KVW_MAX_LAYERS || (L && (!h->layer_tokens || h->layer_tokens_count < L)))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "header without resolved layer ranges");
    uint64_t C = h->chunk_tokens ? h->chunk_tokens : 1;
    int sparse = h->has_sparse;
    /* First the total, without allocating per chunk (14.1 step 5, KVW-LIM-1). */
    uint64_t total = 0, entries = 0;
    for (uint32_t l = 0; l < L; l++) {
        const kvw_layer_spec *s = kvw_layer(h, l);
        if (!s) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "layer %u has no spec", l);
        uint64_t layer_cells = 0;
        int ncomp = 0;
        if (sparse) {
            uint32_t hs = sparse_layer_heads(s);
            for (uint32_t hd = 0; hd < hs; hd++, entries++) {
                if (entries >= h->sparse.retained_counts.count)
                    return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "retained_counts too short");
                uint64_t n = kvw_u32_at(h->sparse.retained_counts, (uint32_t)entries);
                layer_cells += (n + C - 1) / C;
            }
            ncomp = hs ? (s->kind == KVW_KIND_MLA_LATENT ? 2 : 3) : 0;
        } else if (s->kind == KVW_KIND_STATE) {
            layer_cells = h->layer_tokens[l].count ? s->state_tensor_count : 0;
            ncomp = 1;
        } else {
            layer_cells = range_cells(h->layer_tokens[l].start, h->layer_tokens[l].count, C);
            ncomp = s->kind == KVW_KIND_SHARED ? 0 : (s->kind == KVW_KIND_MLA_LATENT ? 1 : 2);
        }
        uint64_t t;
        if (kvw_mul_ovf(layer_cells, (uint64_t)ncomp, &t) || kvw_add_ovf(total, t, &total))
            total = UINT64_MAX;
    }
    if (total > KVW_MAX_CHUNKS)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1",
                        "the header implies %llu chunks, more than the limit of %u",
                        (unsigned long long)total, (unsigned)KVW_MAX_CHUNKS);

    kvw_grid_impl *gi = calloc(1, sizeof *gi);
    if (!gi) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory building the chunk grid");
    g->impl_ = gi;
    gi->nlayers = L;
    gi->sparse = sparse;
    size_t n5 = (size_t)L * KVW_NCOMP + 1;
    gi->base = calloc(n5, sizeof *gi->base);
    gi->cells = calloc(n5, sizeof *gi->cells);
    gi->heads = calloc(n5, sizeof *gi->heads);
    gi->dims = calloc(n5, sizeof *gi->dims);
    gi->lo_cell = calloc((size_t)L + 1, sizeof *gi->lo_cell);
    gi->chunk = C;
    if (!gi->base || !gi->cells || !gi->heads || !gi->dims || !gi->lo_cell) return no_mem(g, err);
    if (sparse) {
        gi->entry = calloc((size_t)L + 1, sizeof *gi->entry);
        gi->head_base = calloc((size_t)entries + 1, sizeof *gi->head_base);
        if (!gi->entry || !gi->head_base) return no_mem(g, err);
    }
    uint64_t slot = 0, e = 0;
    for (uint32_t l = 0; l < L; l++) {
        const kvw_layer_spec *s = kvw_layer(h, l);
        uint64_t lc = 0;
        gi->lo_cell[l] = h->layer_tokens[l].start / C;
        if (sparse) {
            uint32_t hs = sparse_layer_heads(s);
            gi->entry[l] = e;
            for (uint32_t hd = 0; hd < hs; hd++, e++) {
                gi->head_base[e] = lc;
                lc += ((uint64_t)kvw_u32_at(h->sparse.retained_counts, (uint32_t)e) + C - 1) / C;
            }
        } else if (s->kind == KVW_KIND_STATE) {
            lc = h->layer_tokens[l].count ? s->state_tensor_count : 0;
        } else {
            lc = range_cells(h->layer_tokens[l].start, h->layer_tokens[l].count, C);
        }
        for (int c = 0; c < KVW_NCOMP; c++) {
            size_t k = (size_t)l * KVW_NCOMP + (size_t)c;
            int stored = stores_dense(s->kind, c) ||
                         (sparse && c == KVW_COMP_POSITIONS && sparse_layer_heads(s) > 0 &&
                          s->kind != KVW_KIND_STATE);
            if (sparse && c == KVW_COMP_STATE) stored = 0;
            gi->base[k] = slot;
            if (!stored) continue;
            uint32_t hd, dim;
            comp_geometry(s, c, &hd, &dim);
            gi->heads[k] = hd;
            gi->dims[k] = dim;
            gi->cells[k] = lc;
            slot += lc;
        }
    }
    if (sparse) gi->entry[L] = e;
    g->total = slot;
    return KVW_OK;
}

uint64_t kvw_grid_cells(const kvw_grid *g, uint32_t layer, int comp) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || layer >= gi->nlayers || comp < 0 || comp >= KVW_NCOMP) return 0;
    return gi->cells[(size_t)layer * KVW_NCOMP + (size_t)comp];
}

uint64_t kvw_grid_base(const kvw_grid *g, uint32_t layer, int comp) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || layer >= gi->nlayers || comp < 0 || comp >= KVW_NCOMP) return 0;
    return gi->base[(size_t)layer * KVW_NCOMP + (size_t)comp];
}

uint32_t kvw_grid_sparse_heads(const kvw_grid *g, uint32_t layer) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || !gi->sparse || layer >= gi->nlayers) return 0;
    return (uint32_t)(gi->entry[layer + 1] - gi->entry[layer]);
}

uint32_t kvw_grid_retained(const kvw_header *h, const kvw_grid *g, uint32_t layer,
                           uint32_t head) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || !gi->sparse || layer >= gi->nlayers) return 0;
    uint64_t e = gi->entry[layer] + head;
    if (e >= gi->entry[layer + 1]) return 0;
    return kvw_u32_at(h->sparse.retained_counts, (uint32_t)e);
}

uint64_t kvw_grid_head_base(const kvw_grid *g, uint32_t layer, uint32_t head) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || !gi->sparse || layer >= gi->nlayers) return 0;
    uint64_t e = gi->entry[layer] + head;
    if (e >= gi->entry[layer + 1]) return 0;
    return gi->head_base[e];
}

uint64_t kvw_grid_slot(const kvw_grid *g, const kvw_record *r) {
    const kvw_grid_impl *gi = kvw_gi(g);
    if (!gi || r->layer >= gi->nlayers || r->component >= KVW_NCOMP) return UINT64_MAX;
    size_t k = (size_t)r->layer * KVW_NCOMP + r->component;
    uint64_t base = gi->base[k];
    if (gi->sparse) { /* base + head_base(layer, head) + token_start / C (SPARSE-7) */
        uint64_t e = gi->entry[r->layer] + r->head_start;
        if (e >= gi->entry[r->layer + 1]) return UINT64_MAX;
        return base + gi->head_base[e] + r->token_start / gi->chunk;
    }
    if (r->component == KVW_COMP_STATE) return base + r->head_start; /* STATE-7 */
    return base + r->token_start / gi->chunk - gi->lo_cell[r->layer];
}
