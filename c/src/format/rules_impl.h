/*
 * The private contract between rules.c (the header rules of 14.1 step 3 and their order)
 * and rules_arch.c (the architecture rules): one shared size and one entry.
 */
#ifndef KVW_RULES_IMPL_H
#define KVW_RULES_IMPL_H

#include "format/format.h"

#define SPEC_BITSET_WORDS (KVW_MAX_LAYERS / 64)

/* Section 6 with crossmodel.md STATE-2/3 (rules_arch.c). */
kvw_code kvw_rules_architecture(const kvw_header *h, kvw_error *err);

#endif
