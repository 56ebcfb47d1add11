/*
 * dev/fuzz/fuzz_common.h — what every libFuzzer target of dev/fuzz/ shares: the production code
 * compiled in (megatron.h's host implementation, stb style), a scratch directory per process for
 * the files a parser reads by path, and the split of one fuzz input into several files.
 *
 * Inputs that stand for several files are the files' bytes joined by FZ_SEP ("\n--8<--\n"); a
 * target names what each part is. The scratch directory is in $FUZZ_TMPDIR, else /dev/shm (memory,
 * fast), else /tmp, and is removed at exit.
 */
#ifndef FUZZ_COMMON_H
#define FUZZ_COMMON_H

#define MEGATRON_IMPLEMENTATION
#include "megatron.h"

#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FZ_SEP "\n--8<--\n"
#define FZ_SEP_LEN 8
#define FZ_MAX_PARTS 16

typedef struct {
    const uint8_t* data[FZ_MAX_PARTS];
    size_t size[FZ_MAX_PARTS];
    int count;
} fz_parts;

/* Cuts data at each FZ_SEP into at most FZ_MAX_PARTS parts (the last takes the rest). */
static void fz_split(const uint8_t* data, size_t size, fz_parts* p) {
    p->count = 0;
    const uint8_t* end = data + size;
    while (p->count < FZ_MAX_PARTS - 1) {
        const uint8_t* cut = (const uint8_t*)memmem(data, (size_t)(end - data), FZ_SEP, FZ_SEP_LEN);
        if (!cut) break;
        p->data[p->count] = data;
        p->size[p->count++] = (size_t)(cut - data);
        data = cut + FZ_SEP_LEN;
    }
    p->data[p->count] = data;
    p->size[p->count++] = (size_t)(end - data);
}

/* Part i, or an empty one when the input has fewer. */
static const uint8_t* fz_part(const fz_parts* p, int i, size_t* size) {
    if (i >= p->count) { *size = 0; return (const uint8_t*)""; }
    *size = p->size[i];
    return p->data[i];
}

/* A NUL-terminated malloc'd copy (for parsers that take C strings). */
static char* fz_cstr(const uint8_t* data, size_t size) {
    char* s = (char*)malloc(size + 1);
    if (!s) abort();
    memcpy(s, data, size);
    s[size] = 0;
    return s;
}

/* Little-endian numbers taken from the front of a byte string (zeros once it is used up). */
typedef struct {
    const uint8_t* p;
    size_t n;
} fz_bytes;

static uint64_t fz_take(fz_bytes* b, int bytes) {
    uint64_t v = 0;
    for (int k = 0; k < bytes; k++) {
        uint64_t c = b->n ? (b->n--, *b->p++) : 0;
        v |= c << (8 * k);
    }
    return v;
}

static char fz_root[256];

static int fz__remove(const char* path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return 0;
    if (S_ISDIR(sb.st_mode)) {
        DIR* d = opendir(path);
        if (d) {
            struct dirent* e;
            while ((e = readdir(d)) != NULL) {
                if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
                char child[4096];
                snprintf(child, sizeof(child), "%s/%s", path, e->d_name);
                fz__remove(child);
            }
            closedir(d);
        }
        return rmdir(path);
    }
    return unlink(path);
}

static void fz__cleanup(void) {
    if (fz_root[0]) fz__remove(fz_root);
}

/* The process's scratch directory (created on first use). */
static const char* fz_dir(void) {
    if (fz_root[0]) return fz_root;
    const char* base = getenv("FUZZ_TMPDIR");
    struct stat sb;
    if (!base) base = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(fz_root, sizeof(fz_root), "%s/mtfuzz.XXXXXX", base);
    if (!mkdtemp(fz_root)) {
        fprintf(stderr, "fuzz: cannot create a scratch directory under %s: %s\n", base, strerror(errno));
        abort();
    }
    atexit(fz__cleanup);
    return fz_root;
}

/* Empties the scratch directory (so one input's files never meet the next input). */
static void fz_reset(void) {
    const char* root = fz_dir();
    DIR* d = opendir(root);
    if (!d) return;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[4096];
        snprintf(child, sizeof(child), "%s/%s", root, e->d_name);
        fz__remove(child);
    }
    closedir(d);
}

/* <scratch>/<name> (directories on the way made), holding data; the path goes into out. 0, or -1
 * when it cannot be written (a name the input chose may clash with a directory). */
static int fz_try_write(const char* name, const void* data, size_t size, char* out, size_t cap) {
    snprintf(out, cap, "%s/%s", fz_dir(), name);
    for (char* p = out + strlen(fz_dir()) + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(out, 0755); *p = '/'; }
    FILE* f = fopen(out, "wb");
    if (!f) return -1;
    int ok = (!size || fwrite(data, 1, size, f) == size);
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* The same for a name the target chose: failing to write it is the harness's failure. */
static void fz_write(const char* name, const void* data, size_t size, char* out, size_t cap) {
    if (fz_try_write(name, data, size, out, cap) != 0) {
        fprintf(stderr, "fuzz: cannot write %s: %s\n", out, strerror(errno));
        abort();
    }
}

/* <scratch>/<name> as a path, without writing anything. */
static void fz_path(const char* name, char* out, size_t cap) { snprintf(out, cap, "%s/%s", fz_dir(), name); }

/* A library error must come with its text (what train_gpt and the tools print), NUL-terminated. */
static void fz_check_error(const mt_error* err) {
    size_t n = strnlen(err->message, sizeof(err->message));
    if (n == 0 || n == sizeof(err->message)) {
        fprintf(stderr, "fuzz: an error without its text: '%.*s'\n", (int)n, err->message);
        abort();
    }
    if (getenv("FUZZ_VERBOSE")) fprintf(stderr, "refused: %s\n", err->message);
}

/* Touches every byte (ASan reports a read beyond the allocation; the sum keeps it from being elided). */
static volatile uint8_t fz_sink;
static void fz_touch(const void* p, size_t n) {
    const uint8_t* b = (const uint8_t*)p;
    uint8_t s = 0;
    for (size_t i = 0; i < n; i++) s ^= b[i];
    fz_sink ^= s;
}

/* The input form fuzz_jsonl and fuzz_preprocess share: an options byte, the JSON keys (one per line,
 * at most 4; none: "text"), FZ_SEP, the JSONL text. *keys_copy holds the keys' text (caller frees). */
typedef struct {
    uint8_t options;
    const char* keys[4];
    int num_keys;
    const uint8_t* text;
    size_t text_size;
    char* keys_copy;
} fz_jsonl_input;

static int fz_jsonl_input_parse(const uint8_t* data, size_t size, fz_jsonl_input* in) {
    if (size < 1) return -1;
    in->options = data[0];
    fz_parts parts;
    fz_split(data + 1, size - 1, &parts);
    size_t nkeys_text;
    const uint8_t* keys_text = fz_part(&parts, 0, &nkeys_text);
    in->text = fz_part(&parts, 1, &in->text_size);
    in->keys_copy = fz_cstr(keys_text, nkeys_text);
    in->num_keys = 0;
    for (char* p = in->keys_copy; *p && in->num_keys < 4;) {
        char* nl = strchr(p, '\n');
        if (nl) *nl = 0;
        in->keys[in->num_keys++] = p;
        if (!nl) break;
        p = nl + 1;
    }
    if (in->num_keys == 0) in->keys[in->num_keys++] = "text";
    return 0;
}

#define FZ_ASSERT(cond, ...)                                                  \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
            abort();                                                          \
        }                                                                     \
    } while (0)

#endif /* FUZZ_COMMON_H */
