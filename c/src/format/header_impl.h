/*
 * The Header decoder's private contract between header.c (the decoding order of 14.1
 * step 2, the Architecture subtree, the header's memory) and header_fields.c (the other
 * Header fields): the decoding state, the count limits of KVW-LIM-1, and the helpers.
 */
#ifndef KVW_HEADER_IMPL_H
#define KVW_HEADER_IMPL_H

#include "common/fb.h"
#include "format/format.h"

#define MAX_STRING_LENGTH UINT32_C(65536)
#define MAX_BYTES_LENGTH (UINT32_C(1) << 20)
#define MAX_PREFIX_HASH_BYTES (UINT32_C(1) << 23)
#define MAX_ROPE_FACTORS UINT32_C(65536)
#define MAX_STATE_TENSORS_VECTOR UINT32_C(4096)
#define MAX_STATE_SHAPE UINT32_C(4096)
#define MAX_METADATA_ENTRIES UINT32_C(4096)
#define MAX_METADATA_KEY UINT32_C(256)
#define MAX_LAYOUT_DIMS UINT32_C(64)
#define MAX_CODEC_SPECS UINT32_C(4096)
#define MAX_RETAINED_ENTRIES (UINT32_C(4096) * UINT32_C(4096))
#define CHECKSUM_COUNT 1

/* One block of the header's own memory; the data follows the (max-aligned) link. */
typedef union hblock {
    union hblock *next;
    max_align_t align_;
} hblock;

typedef struct hdec {
    kvw_fb fb;
    kvw_header *h;
    kvw_error *err;
    /* RopeParams decoded so far, by position (the KVW-LIM-7 exemption) */
    kvw_rope *ropes;
    uint64_t *rope_pos;
    uint32_t nropes, rope_cap;
} hdec;

/* n elements of size bytes, zeroed, owned by the header; NULL for n == 0 (and on OOM:
 * callers check n && !p). n was checked against its limit before. */
void *kvw_hd_alloc(hdec *d, size_t n, size_t size);
kvw_code kvw_hd_oom(hdec *d);
/* Visit every table of a vector of tables (in element order, before any is decoded). */
kvw_code kvw_hd_visit_all(hdec *d, const kvw_fbvec *v);
void kvw_hd_elem_table(hdec *d, const kvw_fbvec *v, uint32_t j, kvw_fbt *t);
kvw_vec kvw_hd_as_vec(const hdec *d, const kvw_fbvec *v);

/* header_fields.c: the Header fields outside Architecture, each read in 14.1 step 2 order */
kvw_code kvw_hd_producer_model(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_layer_map(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_layer_tokens(hdec *d, const kvw_fbt *root);
/* The default ranges (5.7) when the container carries none. */
kvw_code kvw_hd_resolve_layer_tokens(hdec *d);
kvw_code kvw_hd_metadata(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_engine_layout(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_sparse(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_codec_specs(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_prefix(hdec *d, const kvw_fbt *root);
kvw_code kvw_hd_kv_scales(hdec *d, const kvw_fbt *root);

#endif
