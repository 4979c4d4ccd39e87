/*
 * Atomic file sink (spec 11.5 KVW-FILE-6, 15 KVW-WRITE-2..5): a kvw_sink_fn that writes a
 * container into a temporary file in the target's directory and, on commit, fsyncs it,
 * gives it its final mode, renames it over the target and fsyncs the directory. A failed
 * or abandoned write leaves the target untouched and removes the temporary file.
 *
 * The temporary file is unnamed where Linux allows (O_TMPFILE, named with linkat only for
 * the instant before the rename), otherwise ".<name>.<host>.<pid>.<random>.kvwtmp",
 * created 0600. A symbolic link as target is followed: the file it resolves to is
 * replaced in its own directory and the link stays (KVW-WRITE-4).
 */
#define _GNU_SOURCE
#include "common/common.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

struct kvw_file_sink {
    int fd;
    int unnamed;          /* O_TMPFILE: no name until commit */
    int failed;           /* a write failed: commit refuses */
    int write_errno;
    char *dir;            /* directory of the resolved target */
    char *target;         /* resolved target path */
    char *tmp;            /* temporary name (named mode, or the link name at commit) */
};

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* The file a path names after following symbolic links (up to 40), even when the last
 * link dangles (KVW-WRITE-4). malloc'ed, NULL on error (errno set). */
static char *resolve_target(const char *path) {
    char *cur = dup_str(path);
    for (int hops = 0; cur && hops < 40; hops++) {
        struct stat st;
        if (lstat(cur, &st) != 0 || !S_ISLNK(st.st_mode)) return cur; /* missing or not a link */
        char link[PATH_MAX];
        ssize_t n = readlink(cur, link, sizeof link - 1);
        if (n < 0) { free(cur); return NULL; }
        link[n] = 0;
        char *next;
        if (link[0] == '/') {
            next = dup_str(link);
        } else {
            const char *slash = strrchr(cur, '/');
            size_t dl = slash ? (size_t)(slash - cur) + 1 : 0;
            next = malloc(dl + (size_t)n + 1);
            if (next) { memcpy(next, cur, dl); memcpy(next + dl, link, (size_t)n + 1); }
        }
        free(cur);
        cur = next;
    }
    if (cur) { free(cur); errno = ELOOP; }
    return NULL;
}

static kvw_code io_fail(kvw_error *err, const char *what, const char *path, int e) {
    return kvw_fail(err, KVW_ERR_IO, "KVW-FILE-6", "%s %s: %s", what, path ? path : "", strerror(e));
}

/* The mode the new file gets (KVW-WRITE-3): the replaced file's, or 0666 & ~umask. */
static mode_t final_mode(const char *target) {
    struct stat st;
    if (stat(target, &st) == 0 && S_ISREG(st.st_mode)) return st.st_mode & 07777;
    mode_t mask = 022;
    FILE *f = fopen("/proc/self/status", "r"); /* reads the umask without changing it */
    if (f) {
        char line[128];
        while (fgets(line, sizeof line, f))
            if (strncmp(line, "Umask:", 6) == 0) { mask = (mode_t)strtoul(line + 6, NULL, 8); break; }
        fclose(f);
    }
    return 0666 & ~mask;
}

static void free_sink(kvw_file_sink *s) {
    if (s->fd >= 0) close(s->fd);
    free(s->dir);
    free(s->target);
    free(s->tmp);
    free(s);
}

/* A fresh temporary name next to the target. */
static char *tmp_name(const kvw_file_sink *s, unsigned attempt) {
    const char *base = strrchr(s->target, '/');
    base = base ? base + 1 : s->target;
    char host[64] = "host";
    if (gethostname(host, sizeof host - 1) != 0) strcpy(host, "host");
    host[sizeof host - 1] = 0;
    for (char *p = host; *p; p++) if (*p == '/' || *p == '.') *p = '_';
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long rnd = ((unsigned long long)ts.tv_nsec << 20) ^ (unsigned long long)ts.tv_sec ^
                             ((unsigned long long)(uintptr_t)s >> 4) ^ ((unsigned long long)attempt * 0x9E3779B97F4A7C15ull);
    size_t n = strlen(s->dir) + strlen(base) + strlen(host) + 64;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/.%s.%s.%ld.%08llx.kvwtmp", s->dir, base, host, (long)getpid(), rnd & 0xffffffffull);
    return p;
}

kvw_code kvw_file_sink_open(const char *path, kvw_file_sink **out, kvw_error *err) {
    if (out) *out = NULL;
    if (!path || !*path || !out)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_file_sink_open: a path and out are required");
    kvw_file_sink *s = calloc(1, sizeof *s);
    if (!s) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "file sink: out of memory");
    s->fd = -1;
    s->target = resolve_target(path);
    if (!s->target) {
        kvw_code c = io_fail(err, "cannot resolve", path, errno);
        free_sink(s);
        return c;
    }
    const char *slash = strrchr(s->target, '/');
    if (!slash) s->dir = dup_str(".");
    else if (slash == s->target) s->dir = dup_str("/");
    else if ((s->dir = malloc((size_t)(slash - s->target) + 1)) != NULL) {
        memcpy(s->dir, s->target, (size_t)(slash - s->target));
        s->dir[slash - s->target] = 0;
    }
    if (!s->dir) { free_sink(s); return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "file sink: out of memory"); }
#ifdef O_TMPFILE
    s->fd = open(s->dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    if (s->fd >= 0) { s->unnamed = 1; *out = s; return KVW_OK; }
#endif
    for (unsigned attempt = 0; attempt < 100; attempt++) {
        free(s->tmp);
        s->tmp = tmp_name(s, attempt);
        if (!s->tmp) break;
        s->fd = open(s->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (s->fd >= 0 || errno != EEXIST) break;
    }
    if (s->fd < 0) {
        kvw_code c = io_fail(err, "cannot create a temporary file in", s->dir, errno);
        free(s->tmp);
        s->tmp = NULL;
        free_sink(s);
        return c;
    }
    *out = s;
    return KVW_OK;
}

int kvw_file_sink_write(void *ctx, const kvw_iovec *parts, int nparts) {
    kvw_file_sink *s = ctx;
    if (!s || s->failed || s->fd < 0) return -1;
    struct iovec v[64];
    int i = 0;
    size_t skip = 0; /* bytes of parts[i] already written */
    while (i < nparts) {
        int n = 0;
        for (int j = i; j < nparts && n < 64 && n < IOV_MAX; j++) {
            size_t off = j == i ? skip : 0;
            if (parts[j].len == off) continue;
            v[n].iov_base = (void *)((const uint8_t *)parts[j].base + off);
            v[n].iov_len = parts[j].len - off;
            n++;
        }
        if (n == 0) break;
        ssize_t w = writev(s->fd, v, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            s->failed = 1;
            s->write_errno = errno;
            return -1;
        }
        size_t left = (size_t)w;
        while (i < nparts && left >= parts[i].len - skip) { left -= parts[i].len - skip; skip = 0; i++; }
        skip += left;
        if (w == 0) { s->failed = 1; s->write_errno = EIO; return -1; }
    }
    return 0;
}

kvw_code kvw_file_sink_close(kvw_file_sink *s, int commit, kvw_error *err) {
    if (!s) return KVW_OK;
    kvw_code c = KVW_OK;
    if (commit && s->failed) {
        c = io_fail(err, "write failed, target left untouched:", s->target, s->write_errno);
        commit = 0;
    }
    if (commit) {
        char fdpath[64];
        if (fchmod(s->fd, final_mode(s->target)) != 0 || fsync(s->fd) != 0) {
            c = io_fail(err, "cannot finish the temporary file for", s->target, errno);
            commit = 0;
        } else if (s->unnamed) {
            snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", s->fd);
            for (unsigned attempt = 0; attempt < 100; attempt++) {
                free(s->tmp);
                s->tmp = tmp_name(s, attempt);
                if (!s->tmp) break;
                if (linkat(AT_FDCWD, fdpath, AT_FDCWD, s->tmp, AT_SYMLINK_FOLLOW) == 0) break;
                int e = errno;
                free(s->tmp);
                s->tmp = NULL;
                if (e != EEXIST) { errno = e; break; }
            }
            if (!s->tmp) { c = io_fail(err, "cannot name the temporary file for", s->target, errno); commit = 0; }
        }
    }
    if (s->fd >= 0) {
        if (close(s->fd) != 0 && commit) { c = io_fail(err, "close failed for", s->target, errno); commit = 0; }
        s->fd = -1;
    }
    if (commit) {
        if (rename(s->tmp, s->target) != 0) {
            c = io_fail(err, "cannot rename into", s->target, errno);
            commit = 0;
        } else {
            free(s->tmp);
            s->tmp = NULL;
            int dfd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) {
                if (fsync(dfd) != 0 && errno != EINVAL) c = io_fail(err, "fsync of the directory", s->dir, errno);
                close(dfd);
            }
        }
    }
    if (s->tmp) unlink(s->tmp); /* not committed: the temporary file goes, the target stays */
    free_sink(s);
    return c;
}
