/*
 * JSON emitter of the kvwire-c tool (see json.h): the growable output buffer sbuf and the
 * writers of JSON strings, numbers and hex. Split from the parser (json.c) because the
 * two share no code; every answer and decoded.json the tool writes goes through here.
 */
#include "json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sb_init(sbuf *b) { memset(b, 0, sizeof *b); }
void sb_free(sbuf *b) { free(b->p); memset(b, 0, sizeof *b); }

void sb_putn(sbuf *b, const char *s, size_t n) {
    if (b->oom || n == 0) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        char *np;
        while (nc < b->len + n + 1) {
            if (nc > SIZE_MAX / 2) { b->oom = 1; return; }
            nc *= 2;
        }
        np = realloc(b->p, nc);
        if (!np) { b->oom = 1; return; }
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

void sb_printf(sbuf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) { sb_putn(b, small, (size_t)n); return; }
    {
        char *big = malloc((size_t)n + 1);
        if (!big) { b->oom = 1; return; }
        va_start(ap, fmt);
        vsnprintf(big, (size_t)n + 1, fmt, ap);
        va_end(ap);
        sb_putn(b, big, (size_t)n);
        free(big);
    }
}

/* Length of the valid UTF-8 sequence at s[0..n) (1-4), 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n) {
    size_t k, i;
    uint32_t cp;
    if (s[0] < 0x80) return 1;
    if (s[0] >= 0xC2 && s[0] <= 0xDF) k = 2, cp = s[0] & 0x1Fu;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) k = 3, cp = s[0] & 0x0Fu;
    else if (s[0] >= 0xF0 && s[0] <= 0xF4) k = 4, cp = s[0] & 0x07u;
    else return 0;
    if (n < k) return 0;
    for (i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3Fu);
    }
    if ((k == 3 && (cp < 0x800 || (cp >= 0xD800 && cp < 0xE000))) || (k == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;
    return k;
}

/* Invalid UTF-8 (possible in free-text messages) is written as U+FFFD, so every line the
 * tool writes is valid JSON text. */
void sb_jstr(sbuf *b, const char *s, size_t n) {
    size_t i = 0, run = 0;
    sb_putn(b, "\"", 1);
    if (!s) n = 0;
    while (i < n) {
        const unsigned char *u = (const unsigned char *)s + i;
        size_t k;
        if (*u >= 0x20 && *u != '"' && *u != '\\' && *u < 0x80) { run++; i++; continue; }
        k = *u >= 0x80 ? utf8_len(u, n - i) : 0;
        if (k) { run += k; i += k; continue; }
        if (run) sb_putn(b, s + i - run, run);
        run = 0;
        if (*u == '"') sb_puts(b, "\\\"");
        else if (*u == '\\') sb_puts(b, "\\\\");
        else if (*u == '\n') sb_puts(b, "\\n");
        else if (*u == '\t') sb_puts(b, "\\t");
        else if (*u == '\r') sb_puts(b, "\\r");
        else if (*u >= 0x80) sb_puts(b, "\\ufffd");
        else sb_printf(b, "\\u%04x", *u);
        i++;
    }
    if (run) sb_putn(b, s + n - run, run);
    sb_putn(b, "\"", 1);
}

void sb_jcstr(sbuf *b, const char *s) { sb_jstr(b, s, strlen(s)); }

void sb_f64(sbuf *b, double x) {
    char buf[64];
    int prec;
    if (isnan(x)) { sb_puts(b, "\"NaN\""); return; }
    if (isinf(x)) { sb_puts(b, x > 0 ? "\"Infinity\"" : "\"-Infinity\""); return; }
    for (prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0"); /* keeps -0.0 and integral values floats */
    sb_puts(b, buf);
}

void sb_u64(sbuf *b, uint64_t v) { sb_printf(b, "%llu", (unsigned long long)v); }
void sb_i64(sbuf *b, int64_t v) { sb_printf(b, "%lld", (long long)v); }

void sb_hex(sbuf *b, const uint8_t *p, size_t n) {
    static const char digits[] = "0123456789abcdef";
    char chunk[128];
    size_t i, k = 0;
    sb_putn(b, "\"", 1);
    for (i = 0; p && i < n; i++) {
        chunk[k++] = digits[p[i] >> 4];
        chunk[k++] = digits[p[i] & 15];
        if (k == sizeof chunk) { sb_putn(b, chunk, k); k = 0; }
    }
    sb_putn(b, chunk, k);
    sb_putn(b, "\"", 1);
}
