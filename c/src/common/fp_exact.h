/*
 * Included first by the files that compute lossy codec values (codecs_lossy.c, codecs_qenc.c):
 * spec/codecs.md KVW-LOSSY-3 fixes fp32 arithmetic with one rounding per operation, so the
 * compiler must not contract a*b+c into a fused multiply-add (a different rounding, other
 * bytes than every other reader) and must evaluate float expressions in float.
 */
#ifndef KVW_FP_EXACT_H
#define KVW_FP_EXACT_H

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <float.h>
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "KVW-LOSSY-3 needs fp32 evaluation (FLT_EVAL_METHOD 0): build with -msse2 -mfpmath=sse"
#endif

#endif /* KVW_FP_EXACT_H */
