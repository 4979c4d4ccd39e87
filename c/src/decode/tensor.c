/*
 * Random-access reader, after opening: canonical tensors (conformance/PROTOCOL.md 2.3:
 * dense [heads, layer tokens, dim], sparse rows [sum of retained, dim] with int64
 * POSITIONS, state tensors) assembled chunk by chunk straight into the caller's buffer,
 * and full validation (1.4, 14.1: padding, frames against the index, every body, and the
 * POSITIONS bodies of sparse containers, sparse.md 4.1).
 */
#include "decode/reader.h"

#include <stdint.h>
#include <stdlib.h>

static const kvw_state_tensor *state_tensor(const kvw_reader *r, uint32_t layer, int comp,
                                            uint32_t which) {
    if (comp != KVW_COMP_STATE || kvw_grid_cells(&r->g, layer, comp) == 0) return NULL;
    const kvw_layer_spec *s = kvw_layer(&r->h, layer);
    return s && which < s->state_tensor_count ? &s->state_tensors[which] : NULL;
}

static uint64_t sparse_rows(const kvw_reader *r, uint32_t layer) {
    uint64_t rows = 0;
    uint32_t hs = kvw_grid_sparse_heads(&r->g, layer);
    for (uint32_t hd = 0; hd < hs; hd++) rows += kvw_grid_retained(&r->h, &r->g, layer, hd);
    return rows;
}

kvw_code kvw_tensor_info_of(const kvw_reader *r, uint32_t layer, int component,
                            uint32_t which, kvw_tensor_info *info, kvw_error *err) {
    if (!r || !info) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL argument");
    memset(info, 0, sizeof *info);
    const kvw_layer_spec *s = kvw_layer(&r->h, layer);
    const kvw_grid_impl *gi = kvw_gi(&r->g);
    if (!s || component < 0 || component >= KVW_NCOMP ||
        gi->heads[(size_t)layer * KVW_NCOMP + (size_t)component] == 0)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "layer %u does not store component %d", layer, component);
    uint32_t heads = gi->heads[(size_t)layer * KVW_NCOMP + (size_t)component];
    uint32_t dim = gi->dims[(size_t)layer * KVW_NCOMP + (size_t)component];
    unsigned isz = kvw_dtype_size(r->h.dtype);
    if (component == KVW_COMP_STATE) {
        const kvw_state_tensor *t = state_tensor(r, layer, component, which);
        if (!t)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                            "layer %u has no state tensor %u (a cache of 0 tokens holds none)",
                            layer, which);
        info->ndim = t->shape.count;
        uint64_t nb = kvw_dtype_size(t->dtype);
        for (uint32_t i = 0; i < t->shape.count && i < 8; i++) {
            info->shape[i] = kvw_u32_at(t->shape, i);
            nb *= info->shape[i]; /* <= 2^32 by STATE-2 */
        }
        info->nbytes = nb;
        info->dtype = t->dtype;
        return KVW_OK;
    }
    if (which != 0)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "`which` is 0 except for state");
    if (r->h.has_sparse) {
        uint64_t rows = sparse_rows(r, layer);
        if (component == KVW_COMP_POSITIONS) {
            info->ndim = 1;
            info->shape[0] = rows;
            info->nbytes = 8 * rows;
            info->dtype = 0xFF;
        } else {
            info->ndim = 2;
            info->shape[0] = rows;
            info->shape[1] = dim;
            info->nbytes = rows * dim * isz;
            info->dtype = r->h.dtype;
        }
        return KVW_OK;
    }
    uint64_t T = r->h.layer_tokens[layer].count;
    info->ndim = 3;
    info->shape[0] = heads;
    info->shape[1] = T;
    info->shape[2] = dim;
    info->nbytes = (uint64_t)heads * T * dim * isz; /* < 2^62 */
    info->dtype = r->h.dtype;
    return KVW_OK;
}

/* Decode chunk i into dst (raw_length bytes, contiguous). */
static kvw_code decode_into(kvw_reader *r, size_t i, uint8_t *dst, kvw_error *err) {
    const kvw_record *x = &r->rec[i];
    if (x->codec == KVW_CODEC_RAW) /* copy and checksum in one pass */
        return kvw_reader_scatter_raw(r, i, dst, 1, x->raw_length, x->raw_length, err);
    const uint8_t *stored;
    kvw_code c = kvw_reader_stored(r, i, &stored, err);
    if (c) return c;
    return kvw_decode_body(&r->h, x, stored, dst, err);
}

/* A dense chunk [H, tc, dim] into the layer tensor [H, T, dim] at token a. Raw bodies are
 * copied once per head; a compressed body with one head decodes in place, with several
 * into scratch first (the chunk's heads are not contiguous in the layer tensor). */
static kvw_code place_dense(kvw_reader *r, size_t i, uint8_t *out, uint64_t T, uint64_t a,
                            uint64_t row, uint8_t **scratch, size_t *scap, kvw_error *err) {
    const kvw_record *x = &r->rec[i];
    uint64_t H = x->head_count, tc = x->token_count;
    uint64_t piece = tc * row;
    if (H == 1 || tc == T) return decode_into(r, i, out + a * row, err);
    const uint8_t *src;
    if (x->codec == KVW_CODEC_RAW) /* each head's rows to its token slice, hashed as copied */
        return kvw_reader_scatter_raw(r, i, out + a * row, H, piece, T * row, err);
    {
        if (*scap < x->raw_length) {
            uint8_t *s = realloc(*scratch, (size_t)x->raw_length);
            if (!s) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
            *scratch = s;
            *scap = (size_t)x->raw_length;
        }
        kvw_code c = decode_into(r, i, *scratch, err);
        if (c) return c;
        src = *scratch;
    }
    for (uint64_t hd = 0; hd < H; hd++)
        memcpy(out + (hd * T + a) * row, src + hd * piece, (size_t)piece);
    return KVW_OK;
}

/* The raw varint bytes of POSITIONS chunk i: in place for raw, decoded into scratch. */
static kvw_code positions_raw(kvw_reader *r, size_t i, const uint8_t **raw, uint8_t **scratch,
                              size_t *scap, kvw_error *err) {
    const kvw_record *x = &r->rec[i];
    if (x->codec == KVW_CODEC_RAW) return kvw_reader_stored(r, i, raw, err);
    if (*scap < x->raw_length) {
        uint8_t *s = realloc(*scratch, (size_t)x->raw_length);
        if (!s) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
        *scratch = s;
        *scap = (size_t)x->raw_length;
    }
    kvw_code c = decode_into(r, i, *scratch, err);
    *raw = *scratch;
    return c;
}

/* Every cell of (layer, head)'s POSITIONS in order, decoded into out (int64 per retained
 * token, 8-byte aligned) and checked within and across cells (SPARSE-10, SPARSE-11). */
static kvw_code head_positions(kvw_reader *r, uint32_t layer, uint32_t hd, int64_t *out,
                               uint8_t **scratch, size_t *scap, kvw_error *err) {
    uint64_t C = r->h.chunk_tokens;
    uint32_t cnt = kvw_grid_retained(&r->h, &r->g, layer, hd);
    uint64_t slot0 = kvw_grid_base(&r->g, layer, KVW_COMP_POSITIONS) +
                     kvw_grid_head_base(&r->g, layer, hd);
    uint64_t prev_last = UINT64_MAX;
    for (uint64_t k = 0; k * C < cnt; k++) {
        size_t i = r->lookup[slot0 + k];
        const kvw_record *x = &r->rec[i];
        const uint8_t *raw;
        kvw_code c = positions_raw(r, i, &raw, scratch, scap, err);
        if (c) return c;
        int64_t *p = out + x->token_start;
        c = kvw_positions_decode(raw, (size_t)x->raw_length, x->token_count,
                                 r->h.first_position, r->h.sparse.next_position, prev_last,
                                 UINT64_MAX, p, err);
        if (c) return c;
        prev_last = (uint64_t)p[x->token_count - 1];
    }
    return KVW_OK;
}

kvw_code kvw_read_tensor(kvw_reader *r, uint32_t layer, int component, uint32_t which,
                         void *out, size_t out_len, kvw_error *err) {
    kvw_error_clear(err);
    kvw_tensor_info info;
    kvw_code c = kvw_tensor_info_of(r, layer, component, which, &info, err);
    if (c) return c;
    if (out_len < info.nbytes || (!out && info.nbytes))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "out_len %zu, the tensor has %llu bytes", out_len,
                        (unsigned long long)info.nbytes);
    uint8_t *o = out;
    uint8_t *scratch = NULL;
    size_t scap = 0;
    uint64_t base = kvw_grid_base(&r->g, layer, component);
    uint64_t C = r->h.chunk_tokens;
    if (component == KVW_COMP_STATE) {
        c = decode_into(r, r->lookup[base + which], o, err);
    } else if (r->h.has_sparse) {
        uint32_t hs = kvw_grid_sparse_heads(&r->g, layer);
        uint64_t dim = kvw_gi(&r->g)->dims[(size_t)layer * KVW_NCOMP + (size_t)component];
        uint64_t row = component == KVW_COMP_POSITIONS ? 8 : dim * kvw_dtype_size(r->h.dtype);
        uint64_t at = 0; /* first row of the head */
        for (uint32_t hd = 0; hd < hs && !c; hd++) {
            uint32_t cnt = kvw_grid_retained(&r->h, &r->g, layer, hd);
            if (component == KVW_COMP_POSITIONS) {
                if (((uintptr_t)o & 7) == 0) {
                    c = head_positions(r, layer, hd, (int64_t *)(void *)o + at, &scratch,
                                       &scap, err);
                } else { /* an unaligned buffer: one head at a time through aligned memory */
                    int64_t *tmp = malloc((size_t)(cnt ? cnt : 1) * sizeof *tmp);
                    if (!tmp) c = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
                    if (!c) c = head_positions(r, layer, hd, tmp, &scratch, &scap, err);
                    if (!c) memcpy(o + at * row, tmp, (size_t)cnt * 8);
                    free(tmp);
                }
            } else {
                uint64_t slot0 = base + kvw_grid_head_base(&r->g, layer, hd);
                for (uint64_t k = 0; k * C < cnt && !c; k++) {
                    size_t i = r->lookup[slot0 + k];
                    c = decode_into(r, i, o + (at + r->rec[i].token_start) * row, err);
                }
            }
            at += cnt;
        }
    } else {
        uint64_t T = info.shape[1], lo = r->h.layer_tokens[layer].start;
        uint64_t row = info.shape[2] * kvw_dtype_size(r->h.dtype);
        uint64_t cells = kvw_grid_cells(&r->g, layer, component);
        for (uint64_t j = 0; j < cells && !c; j++) {
            size_t i = r->lookup[base + j];
            c = place_dense(r, i, o, T, r->rec[i].token_start - lo, row, &scratch, &scap, err);
        }
    }
    free(scratch);
    return c;
}

kvw_code kvw_validate(kvw_reader *r, kvw_error *err) {
    kvw_error_clear(err);
    if (!r) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL reader");
    uint8_t *scratch = NULL;
    size_t scap = 0;
    kvw_code c = KVW_OK;
    uint64_t end = KVW_PREAMBLE_SIZE + (uint64_t)r->hlen;
    for (size_t i = 0; i < r->count && !c; i++) {
        const kvw_record *x = &r->rec[i];
        const uint8_t *stored;
        c = kvw_reader_stored(r, i, &stored, err); /* FILE-4, CSUM-1 */
        if (c) break;
        uint64_t frame = x->offset - KVW_FRAME_SIZE;
        c = kvw_zero_check(r->buf + end, (size_t)(frame - end), end, err);
        if (c) break;
        if (x->codec != KVW_CODEC_RAW) {
            if (scap < x->raw_length) {
                uint8_t *s = realloc(scratch, (size_t)x->raw_length);
                if (!s) {
                    c = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
                    break;
                }
                scratch = s;
                scap = (size_t)x->raw_length;
            }
            c = kvw_decode_body(&r->h, x, stored, scratch, err);
            if (c) break;
        }
        end = x->offset + x->stored_length;
    }
    if (!c) c = kvw_zero_check(r->buf + end, (size_t)(r->end_frame_at - end), end, err);
    if (!c && r->h.has_sparse) { /* POSITIONS bodies, within and across cells */
        uint64_t most = 0; /* one head's positions at a time */
        for (uint32_t l = 0; l < r->h.arch.num_layers; l++)
            for (uint32_t hd = 0; hd < kvw_grid_sparse_heads(&r->g, l); hd++)
                if (kvw_grid_retained(&r->h, &r->g, l, hd) > most)
                    most = kvw_grid_retained(&r->h, &r->g, l, hd);
        int64_t *pos = malloc((size_t)(most ? most : 1) * sizeof *pos);
        if (!pos) c = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
        for (uint32_t l = 0; l < r->h.arch.num_layers && !c; l++)
            for (uint32_t hd = 0; hd < kvw_grid_sparse_heads(&r->g, l) && !c; hd++)
                c = head_positions(r, l, hd, pos, &scratch, &scap, err);
        free(pos);
    }
    free(scratch);
    return c;
}
