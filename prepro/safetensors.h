/*
 * prepro/safetensors.h — a strict JSON reader and a safetensors reader/writer (stb style).
 *
 * A safetensors file (https://github.com/huggingface/safetensors, format section) is
 *
 *     u64 N (little-endian) | N bytes of JSON header | the data region
 *
 * and the header is one JSON object: for each tensor "name": {"dtype": "F32", "shape": [2, 3],
 * "data_offsets": [begin, end]} (byte offsets into the data region), plus an optional
 * "__metadata__": {"key": "value", ...} of strings. The writer pads the header with spaces so the
 * data starts at a multiple of 8 bytes, as the format allows. A Hugging Face checkpoint too large
 * for one file is sharded: model.safetensors.index.json holds {"weight_map": {"tensor name":
 * "model-00001-of-00002.safetensors", ...}} and every shard is a safetensors file of its own.
 *
 * Opening validates everything before anything is read (the same rules as the reference Rust
 * implementation): the header length fits the file, the header is well-formed JSON of the shape
 * above, every dtype is known, every shape's byte size equals its data_offsets span, and the
 * tensors tile the data region exactly (no overlap, no gap, nothing missing at the end). Any
 * violation is one mt_error line naming the file and the problem.
 *
 * Part A is a small strict JSON reader (RFC 8259: no comments, no trailing commas, no NaN,
 * duplicate keys rejected), also used for config.json and the shard index. Integers are kept
 * exactly as int64 next to their double value.
 *
 * Use: #define MT_SAFETENSORS_IMPLEMENTATION in exactly one C or C++ file before including this
 * header, or before including it again after a declarations-only include. It includes "megatron.h"
 * (mt_status, mt_error, mt_fail): keep the two side by side, or put megatron.h's directory on the
 * include path (-I). POSIX (mmap, fsync, fileno): fileno is hidden by a strict ISO C mode, so a
 * -std=c99/c11 build of the implementation needs -D_POSIX_C_SOURCE=200809L (gnu modes and C++ need
 * nothing). Files are read and written little-endian, as is every host megatron.c builds for.
 * Library code never prints.
 */
#ifndef MT_SAFETENSORS_H
#define MT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "megatron.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* A. JSON                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
    MT_JSON_NULL = 0,
    MT_JSON_FALSE,
    MT_JSON_TRUE,
    MT_JSON_NUMBER,
    MT_JSON_STRING,
    MT_JSON_ARRAY,
    MT_JSON_OBJECT
} mt_json_type;

typedef struct mt_json mt_json;
struct mt_json {
    mt_json_type type;
    double number;     /* numbers */
    int is_integer;    /* 1: a literal without fraction or exponent that fits int64 (then `integer` is exact) */
    int64_t integer;
    char* string;      /* strings: UTF-8, NUL-terminated; `length` counts an embedded \u0000 (refused in keys) */
    size_t length;     /* strings: bytes */
    int count;         /* arrays and objects: elements */
    char** keys;       /* objects: keys[count], in file order */
    mt_json* items;    /* arrays and objects: values[count] */
};

/* Parses text[0 .. length) as one JSON value (surrounding whitespace allowed). `what` names the
 * source in error messages ("config.json: malformed JSON at byte 17: ..."). */
mt_status mt_json_parse(mt_json** out, const char* text, size_t length, const char* what, mt_error* err);
/* Reads and parses a whole file. */
mt_status mt_json_parse_file(mt_json** out, const char* path, mt_error* err);
void mt_json_free(mt_json* value);
/* The value of key in an object; NULL if absent or value is not an object. */
const mt_json* mt_json_get(const mt_json* object, const char* key);

/* ---------------------------------------------------------------------------------------------- */
/* B. safetensors                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
    MT_ST_BOOL = 0, MT_ST_U8, MT_ST_I8, MT_ST_F8_E5M2, MT_ST_F8_E4M3, MT_ST_I16, MT_ST_U16, MT_ST_F16,
    MT_ST_BF16, MT_ST_I32, MT_ST_U32, MT_ST_F32, MT_ST_F64, MT_ST_I64, MT_ST_U64,
    MT_ST_NUM_DTYPES
} mt_st_dtype;

const char* mt_st_dtype_name(mt_st_dtype dtype);   /* "F32" ... */
size_t mt_st_dtype_size(mt_st_dtype dtype);         /* bytes per element */

#define MT_ST_MAX_DIMS 8

typedef struct {
    const char* name;
    mt_st_dtype dtype;
    int ndim;
    int64_t shape[MT_ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;  /* data_offsets: bytes into the data region of its file */
    int file;             /* which file of a sharded checkpoint (0 for a single file) */
} mt_st_tensor;

typedef struct mt_safetensors mt_safetensors;

/* Opens a .safetensors file, or a sharded checkpoint through its index (a path ending in .json:
 * every shard named in "weight_map" is opened from the index's directory, every tensor the map
 * names must be in the shard it names, and no tensor name may occur in two shards). Files are
 * mmapped read-only and fully validated. */
mt_status mt_safetensors_open(mt_safetensors** out, const char* path, mt_error* err);
void mt_safetensors_close(mt_safetensors* st);

int mt_safetensors_count(const mt_safetensors* st);
/* Tensor i, in name order (0 <= i < count). */
const mt_st_tensor* mt_safetensors_at(const mt_safetensors* st, int i);
/* The tensor called name, or NULL. */
const mt_st_tensor* mt_safetensors_find(const mt_safetensors* st, const char* name);
/* The file a tensor lives in (for messages). */
const char* mt_safetensors_file_path(const mt_safetensors* st, const mt_st_tensor* t);
/* A "__metadata__" string of the (first) file, or NULL. */
const char* mt_safetensors_metadata(const mt_safetensors* st, const char* key);
/* The raw little-endian bytes of a tensor (end - begin of them). */
const void* mt_safetensors_data(const mt_safetensors* st, const mt_st_tensor* t);
/* A tensor converted to float32 (from F32, F16, BF16 or F64): out holds numel floats. */
mt_status mt_safetensors_read_f32(const mt_safetensors* st, const mt_st_tensor* t, float* out, mt_error* err);

/* Writer: tensors given as float32, stored as F32, BF16 or F16 (rounded to nearest even). */
typedef struct {
    const char* name;
    mt_st_dtype dtype;     /* MT_ST_F32, MT_ST_BF16 or MT_ST_F16 */
    int ndim;
    int64_t shape[MT_ST_MAX_DIMS];
    const float* data;     /* prod(shape) floats */
} mt_st_write_tensor;

/* Writes `count` tensors, in the order given, and the metadata (NULL, or key, value, key, value,
 * ..., NULL) to path.tmp.<pid>, then renames it to path; on failure nothing is left behind. */
mt_status mt_safetensors_write(const char* path, const mt_st_write_tensor* tensors, int count,
                               const char* const* metadata, mt_error* err);

/* float32 <-> bfloat16 / float16 bit patterns (round to nearest even; NaN stays NaN). */
uint16_t mt_st_f32_to_bf16(float x);
float mt_st_bf16_to_f32(uint16_t x);
uint16_t mt_st_f32_to_f16(float x);
float mt_st_f16_to_f32(uint16_t x);

#ifdef __cplusplus
}
#endif

#endif /* MT_SAFETENSORS_H */

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
/* Outside the declarations' guard (so the implementation may follow a declarations-only include),
 * with its own guard (so it appears once however often the header is included). */
#if defined(MT_SAFETENSORS_IMPLEMENTATION) && !defined(MT_SAFETENSORS_IMPLEMENTATION_DONE)
#define MT_SAFETENSORS_IMPLEMENTATION_DONE

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A. JSON ---------------------------------------------------------------------------------------- */

#define MT_JSON_MAX_DEPTH 64

typedef struct {
    const char* p;
    const char* begin;
    const char* end;
    const char* what;
    mt_error* err;
    mt_status status;
} mt_json__parser;

static int mt_json__fail(mt_json__parser* ps, const char* problem) {
    if (ps->status == MT_OK)
        ps->status = mt_fail(ps->err, MT_ERR_FORMAT, "%s: malformed JSON at byte %zu: %s", ps->what,
                             (size_t)(ps->p - ps->begin), problem);
    return -1;
}

static void mt_json__skip_ws(mt_json__parser* ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}

static void mt_json__free_value(mt_json* v) {
    if (!v) return;
    if (v->type == MT_JSON_ARRAY || v->type == MT_JSON_OBJECT) {
        for (int i = 0; i < v->count; i++) {
            mt_json__free_value(&v->items[i]);
            if (v->keys) free(v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    free(v->string);
    memset(v, 0, sizeof(*v));
}

static int mt_json__hex4(mt_json__parser* ps, unsigned* out) {
    if (ps->end - ps->p < 4) return mt_json__fail(ps, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = ps->p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return mt_json__fail(ps, "bad hex digit in \\u escape");
    }
    ps->p += 4;
    *out = v;
    return 0;
}

/* Length of the valid UTF-8 sequence at p (1..4), or 0 if invalid (overlong, surrogate, > U+10FFFF). */
static int mt_json__utf8_len(const unsigned char* p, const unsigned char* end) {
    unsigned c = p[0];
    int n;
    unsigned min;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) { n = 2; min = 0x80; c &= 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 3; min = 0x800; c &= 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 4; min = 0x10000; c &= 0x07; }
    else return 0;
    if (end - p < n) return 0;
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        c = (c << 6) | (p[i] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
    return n;
}

/* A string starting at the opening quote; returns a malloc'd NUL-terminated copy. \u0000 is refused
 * in keys (they are compared as C strings) and kept in values (a tokenizer's byte 0). */
static int mt_json__string(mt_json__parser* ps, char** out, size_t* out_len, int is_key) {
    ps->p++; /* the quote */
    size_t cap = 16, n = 0;
    char* s = (char*)malloc(cap);
    if (!s) return mt_json__fail(ps, "out of memory");
    for (;;) {
        if (ps->p >= ps->end) { free(s); return mt_json__fail(ps, "unterminated string"); }
        unsigned char c = (unsigned char)*ps->p;
        char buf[4];
        int k = 0;
        if (c == '"') { ps->p++; break; }
        if (c < 0x20) { free(s); return mt_json__fail(ps, "control character in string"); }
        if (c == '\\') {
            ps->p++;
            if (ps->p >= ps->end) { free(s); return mt_json__fail(ps, "unterminated string"); }
            char e = *ps->p++;
            switch (e) {
                case '"': buf[k++] = '"'; break;
                case '\\': buf[k++] = '\\'; break;
                case '/': buf[k++] = '/'; break;
                case 'b': buf[k++] = '\b'; break;
                case 'f': buf[k++] = '\f'; break;
                case 'n': buf[k++] = '\n'; break;
                case 'r': buf[k++] = '\r'; break;
                case 't': buf[k++] = '\t'; break;
                case 'u': {
                    unsigned cp;
                    if (mt_json__hex4(ps, &cp)) { free(s); return -1; }
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        unsigned lo;
                        if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') {
                            free(s);
                            return mt_json__fail(ps, "unpaired surrogate in \\u escape");
                        }
                        ps->p += 2;
                        if (mt_json__hex4(ps, &lo)) { free(s); return -1; }
                        if (lo < 0xDC00 || lo > 0xDFFF) { free(s); return mt_json__fail(ps, "unpaired surrogate in \\u escape"); }
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                        free(s);
                        return mt_json__fail(ps, "unpaired surrogate in \\u escape");
                    }
                    if (cp == 0 && is_key) { free(s); return mt_json__fail(ps, "\\u0000 in an object key"); }
                    if (cp < 0x80) buf[k++] = (char)cp;
                    else if (cp < 0x800) { buf[k++] = (char)(0xC0 | (cp >> 6)); buf[k++] = (char)(0x80 | (cp & 0x3F)); }
                    else if (cp < 0x10000) {
                        buf[k++] = (char)(0xE0 | (cp >> 12));
                        buf[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                        buf[k++] = (char)(0x80 | (cp & 0x3F));
                    } else {
                        buf[k++] = (char)(0xF0 | (cp >> 18));
                        buf[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                        buf[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                        buf[k++] = (char)(0x80 | (cp & 0x3F));
                    }
                    break;
                }
                default: free(s); ps->p--; return mt_json__fail(ps, "bad escape in string");
            }
        } else {
            k = mt_json__utf8_len((const unsigned char*)ps->p, (const unsigned char*)ps->end);
            if (!k) { free(s); return mt_json__fail(ps, "invalid UTF-8 in string"); }
            memcpy(buf, ps->p, (size_t)k);
            ps->p += k;
        }
        if (n + (size_t)k + 1 > cap) {
            cap = cap * 2 + (size_t)k;
            char* t = (char*)realloc(s, cap);
            if (!t) { free(s); return mt_json__fail(ps, "out of memory"); }
            s = t;
        }
        memcpy(s + n, buf, (size_t)k);
        n += (size_t)k;
    }
    s[n] = 0;
    *out = s;
    *out_len = n;
    return 0;
}

static int mt_json__number(mt_json__parser* ps, mt_json* v) {
    const char* start = ps->p;
    const char* q = ps->p;
    int integer = 1;
    if (q < ps->end && *q == '-') q++;
    if (q >= ps->end || *q < '0' || *q > '9') return mt_json__fail(ps, "bad number");
    if (*q == '0') {
        q++;
        if (q < ps->end && *q >= '0' && *q <= '9') return mt_json__fail(ps, "leading zero in number");
    } else {
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < ps->end && *q == '.') {
        integer = 0;
        q++;
        if (q >= ps->end || *q < '0' || *q > '9') { ps->p = q; return mt_json__fail(ps, "bad number (digit expected after '.')"); }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        integer = 0;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-')) q++;
        if (q >= ps->end || *q < '0' || *q > '9') { ps->p = q; return mt_json__fail(ps, "bad number (digit expected in exponent)"); }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    size_t n = (size_t)(q - start);
    char buf[128];
    if (n >= sizeof(buf)) return mt_json__fail(ps, "number too long");
    memcpy(buf, start, n);
    buf[n] = 0;
    v->type = MT_JSON_NUMBER;
    v->number = strtod(buf, NULL);
    v->is_integer = 0;
    if (integer) {
        /* exact int64, with overflow detection */
        const char* d = buf;
        int neg = *d == '-';
        if (neg) d++;
        uint64_t acc = 0, limit = neg ? (uint64_t)INT64_MAX + 1u : (uint64_t)INT64_MAX;
        int fits = 1;
        for (; *d; d++) {
            unsigned dig = (unsigned)(*d - '0');
            if (acc > (limit - dig) / 10) { fits = 0; break; }
            acc = acc * 10 + dig;
        }
        if (fits) {
            v->is_integer = 1;
            v->integer = neg ? (acc == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)acc) : (int64_t)acc;
        }
    }
    ps->p = q;
    return 0;
}

static int mt_json__value(mt_json__parser* ps, mt_json* v, int depth);

/* Objects with many keys (a tokenizer's vocabulary) are checked for a repeated key once complete,
 * by sorting, instead of comparing each key with all before it. */
#define MT_JSON_SMALL_OBJECT 32
static int mt_json__cmp_key(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }
static int mt_json__unique_keys(mt_json__parser* ps, const mt_json* v) {
    if (v->count < MT_JSON_SMALL_OBJECT) return 0;
    char** sorted = (char**)malloc(sizeof(char*) * (size_t)v->count);
    if (!sorted) return mt_json__fail(ps, "out of memory");
    memcpy(sorted, v->keys, sizeof(char*) * (size_t)v->count);
    qsort(sorted, (size_t)v->count, sizeof(char*), mt_json__cmp_key);
    int dup = 0;
    for (int i = 1; i < v->count && !dup; i++) dup = !strcmp(sorted[i - 1], sorted[i]);
    free(sorted);
    return dup ? mt_json__fail(ps, "duplicate object key") : 0;
}

static int mt_json__push(mt_json__parser* ps, mt_json* v, int* cap, int with_keys) {
    if (v->count < *cap) return 0;
    int nc = *cap ? *cap * 2 : 4;
    mt_json* items = (mt_json*)realloc(v->items, sizeof(mt_json) * (size_t)nc);
    if (!items) return mt_json__fail(ps, "out of memory");
    v->items = items;
    if (with_keys) {
        char** keys = (char**)realloc(v->keys, sizeof(char*) * (size_t)nc);
        if (!keys) return mt_json__fail(ps, "out of memory");
        v->keys = keys;
    }
    *cap = nc;
    return 0;
}

static int mt_json__value(mt_json__parser* ps, mt_json* v, int depth) {
    memset(v, 0, sizeof(*v));
    mt_json__skip_ws(ps);
    if (ps->p >= ps->end) return mt_json__fail(ps, "unexpected end of input");
    if (depth > MT_JSON_MAX_DEPTH) return mt_json__fail(ps, "nested too deeply");
    char c = *ps->p;
    if (c == '{' || c == '[') {
        int obj = c == '{', cap = 0;
        v->type = obj ? MT_JSON_OBJECT : MT_JSON_ARRAY;
        ps->p++;
        mt_json__skip_ws(ps);
        if (ps->p < ps->end && *ps->p == (obj ? '}' : ']')) { ps->p++; return 0; }
        for (;;) {
            if (mt_json__push(ps, v, &cap, obj)) return -1;
            char* key = NULL;
            if (obj) {
                mt_json__skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != '"') return mt_json__fail(ps, "object key (a string) expected");
                const char* key_at = ps->p;
                size_t klen;
                if (mt_json__string(ps, &key, &klen, 1)) return -1;
                for (int i = 0; i < v->count && v->count < MT_JSON_SMALL_OBJECT; i++) /* big objects: mt_json__unique_keys */
                    if (!strcmp(v->keys[i], key)) {
                        free(key);
                        ps->p = key_at;
                        return mt_json__fail(ps, "duplicate object key");
                    }
                mt_json__skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != ':') { free(key); return mt_json__fail(ps, "':' expected"); }
                ps->p++;
            }
            int r = mt_json__value(ps, &v->items[v->count], depth + 1);
            if (obj) v->keys[v->count] = key;
            v->count++; /* a partly parsed value is freed with the rest */
            if (r) return -1;
            mt_json__skip_ws(ps);
            if (ps->p >= ps->end) return mt_json__fail(ps, obj ? "unterminated object" : "unterminated array");
            if (*ps->p == ',') { ps->p++; continue; }
            if (*ps->p == (obj ? '}' : ']')) { ps->p++; return obj ? mt_json__unique_keys(ps, v) : 0; }
            return mt_json__fail(ps, obj ? "',' or '}' expected" : "',' or ']' expected");
        }
    }
    if (c == '"') {
        v->type = MT_JSON_STRING;
        return mt_json__string(ps, &v->string, &v->length, 0);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return mt_json__number(ps, v);
    static const struct { const char* word; mt_json_type type; } words[] = {
        {"null", MT_JSON_NULL}, {"false", MT_JSON_FALSE}, {"true", MT_JSON_TRUE}};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i].word);
        if ((size_t)(ps->end - ps->p) >= n && !memcmp(ps->p, words[i].word, n)) {
            ps->p += n;
            v->type = words[i].type;
            return 0;
        }
    }
    return mt_json__fail(ps, "unexpected character");
}

mt_status mt_json_parse(mt_json** out, const char* text, size_t length, const char* what, mt_error* err) {
    *out = NULL;
    mt_json__parser ps;
    ps.p = ps.begin = text;
    ps.end = text + length;
    ps.what = what ? what : "JSON";
    ps.err = err;
    ps.status = MT_OK;
    mt_json* v = (mt_json*)calloc(1, sizeof(mt_json));
    if (!v) return mt_fail(err, MT_ERR_OOM, "%s: out of memory parsing JSON", ps.what);
    if (mt_json__value(&ps, v, 0) == 0) {
        mt_json__skip_ws(&ps);
        if (ps.p != ps.end) mt_json__fail(&ps, "trailing characters after the JSON value");
    }
    if (ps.status != MT_OK) {
        mt_json_free(v);
        return ps.status;
    }
    *out = v;
    return MT_OK;
}

void mt_json_free(mt_json* value) {
    if (!value) return;
    mt_json__free_value(value);
    free(value);
}

mt_status mt_json_parse_file(mt_json** out, const char* path, mt_error* err) {
    *out = NULL;
    char* buf = NULL;
    size_t n = 0;
    mt_status st = mt_read_file(path, (size_t)1 << 30, &buf, &n, err); /* a regular file of at most 1 GiB */
    if (st != MT_OK) return st;
    st = mt_json_parse(out, buf, n, path, err);
    free(buf);
    return st;
}

const mt_json* mt_json_get(const mt_json* object, const char* key) {
    if (!object || object->type != MT_JSON_OBJECT) return NULL;
    for (int i = 0; i < object->count; i++)
        if (!strcmp(object->keys[i], key)) return &object->items[i];
    return NULL;
}

/* B. safetensors --------------------------------------------------------------------------------- */

static const struct { const char* name; size_t size; } mt_st__dtypes[MT_ST_NUM_DTYPES] = {
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
    {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}, {"U64", 8},
};

const char* mt_st_dtype_name(mt_st_dtype dtype) {
    return (int)dtype >= 0 && dtype < MT_ST_NUM_DTYPES ? mt_st__dtypes[dtype].name : "unknown";
}

size_t mt_st_dtype_size(mt_st_dtype dtype) {
    return (int)dtype >= 0 && dtype < MT_ST_NUM_DTYPES ? mt_st__dtypes[dtype].size : 0;
}

/* Python safetensors refuses headers above 100 MB; so does this reader. */
#define MT_ST_MAX_HEADER ((uint64_t)100000000)

typedef struct {
    char* path;
    unsigned char* map;
    size_t size;
    uint64_t header_len;
    const unsigned char* data; /* the data region */
    uint64_t data_size;
} mt_st__file;

struct mt_safetensors {
    int num_files;
    mt_st__file* files;
    int num_tensors;
    mt_st_tensor* tensors; /* sorted by name */
    int num_metadata;
    char** meta_keys;
    char** meta_values;
};

static char* mt_st__strdup(const char* s) {
    size_t n = strlen(s) + 1;
    char* d = (char*)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

static int mt_st__cmp_name(const void* a, const void* b) {
    return strcmp(((const mt_st_tensor*)a)->name, ((const mt_st_tensor*)b)->name);
}

static int mt_st__cmp_offsets(const void* a, const void* b) {
    const mt_st_tensor* x = *(const mt_st_tensor* const*)a;
    const mt_st_tensor* y = *(const mt_st_tensor* const*)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* A JSON number that is a non-negative integer. */
static int mt_st__uint(const mt_json* v, uint64_t* out) {
    if (!v || v->type != MT_JSON_NUMBER) return 0;
    if (v->is_integer) {
        if (v->integer < 0) return 0;
        *out = (uint64_t)v->integer;
        return 1;
    }
    return 0;
}

static void mt_st__shape_string(const mt_st_tensor* t, char* buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* Parses and validates the header of f, appending its tensors to st (file index fi). */
static mt_status mt_st__parse_file(mt_safetensors* st, int fi, int take_metadata, mt_error* err) {
    mt_st__file* f = &st->files[fi];
    const char* path = f->path;
    if (f->size < 8)
        return mt_fail(err, MT_ERR_FORMAT, "%s: truncated: %zu bytes, but a safetensors file starts with an 8-byte header length",
                       path, f->size);
    uint64_t n;
    memcpy(&n, f->map, 8);
    if (n > (uint64_t)(f->size - 8))
        return mt_fail(err, MT_ERR_FORMAT, "%s: header length %llu is larger than the file (%zu bytes): truncated or not a safetensors file",
                       path, (unsigned long long)n, f->size);
    if (n > MT_ST_MAX_HEADER)
        return mt_fail(err, MT_ERR_FORMAT, "%s: header length %llu exceeds the format's limit of 100 MB", path,
                       (unsigned long long)n);
    if (n < 2 || f->map[8] != '{')
        return mt_fail(err, MT_ERR_FORMAT, "%s: the header does not start with '{': not a safetensors file", path);
    f->header_len = n;
    f->data = f->map + 8 + n;
    f->data_size = (uint64_t)f->size - 8 - n;

    char what[4200];
    snprintf(what, sizeof(what), "%s: header", path);
    mt_json* root = NULL;
    mt_status s = mt_json_parse(&root, (const char*)f->map + 8, (size_t)n, what, err);
    if (s != MT_OK) return s;
    if (root->type != MT_JSON_OBJECT) {
        mt_json_free(root);
        return mt_fail(err, MT_ERR_FORMAT, "%s: the header is not a JSON object", path);
    }
    int first = st->num_tensors;
    mt_st_tensor* grown = (mt_st_tensor*)realloc(st->tensors, sizeof(mt_st_tensor) * (size_t)(st->num_tensors + root->count + 1));
    if (!grown) { mt_json_free(root); return mt_fail(err, MT_ERR_OOM, "%s: out of memory", path); }
    st->tensors = grown;
    s = MT_OK;
    for (int i = 0; i < root->count && s == MT_OK; i++) {
        const char* name = root->keys[i];
        const mt_json* e = &root->items[i];
        if (!strcmp(name, "__metadata__")) {
            if (e->type != MT_JSON_OBJECT) { s = mt_fail(err, MT_ERR_FORMAT, "%s: __metadata__ is not an object", path); break; }
            for (int k = 0; k < e->count; k++)
                if (e->items[k].type != MT_JSON_STRING)
                    s = mt_fail(err, MT_ERR_FORMAT, "%s: __metadata__ value of \"%s\" is not a string", path, e->keys[k]);
            if (s != MT_OK || !take_metadata) continue;
            st->meta_keys = (char**)calloc((size_t)e->count + 1, sizeof(char*));
            st->meta_values = (char**)calloc((size_t)e->count + 1, sizeof(char*));
            if (!st->meta_keys || !st->meta_values) { s = mt_fail(err, MT_ERR_OOM, "%s: out of memory", path); break; }
            for (int k = 0; k < e->count; k++) {
                st->meta_keys[k] = mt_st__strdup(e->keys[k]);
                st->meta_values[k] = mt_st__strdup(e->items[k].string);
                st->num_metadata = k + 1;
                if (!st->meta_keys[k] || !st->meta_values[k]) { s = mt_fail(err, MT_ERR_OOM, "%s: out of memory", path); break; }
            }
            continue;
        }
        if (e->type != MT_JSON_OBJECT) { s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": entry is not an object", path, name); break; }
        const mt_json* dtype = mt_json_get(e, "dtype");
        const mt_json* shape = mt_json_get(e, "shape");
        const mt_json* offsets = mt_json_get(e, "data_offsets");
        if (!dtype || !shape || !offsets || e->count != 3) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": expected exactly the keys dtype, shape and data_offsets", path, name);
            break;
        }
        mt_st_tensor* t = &st->tensors[st->num_tensors];
        memset(t, 0, sizeof(*t));
        t->file = fi;
        if (dtype->type != MT_JSON_STRING) { s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": dtype is not a string", path, name); break; }
        int dt = -1;
        for (int k = 0; k < MT_ST_NUM_DTYPES; k++)
            if (!strcmp(dtype->string, mt_st__dtypes[k].name)) dt = k;
        if (dt < 0) { s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", path, name, dtype->string); break; }
        t->dtype = (mt_st_dtype)dt;
        if (shape->type != MT_JSON_ARRAY || shape->count > MT_ST_MAX_DIMS) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": shape is not an array of at most %d integers", path, name, MT_ST_MAX_DIMS);
            break;
        }
        t->ndim = shape->count;
        /* the byte size, element count x element size, checked before each product is formed: at
         * most 2^62 (a wrapped product could otherwise pass the span check below) */
        uint64_t numel = 1, bytes_limit = (uint64_t)1 << 62, numel_limit = bytes_limit / mt_st__dtypes[dt].size;
        for (int d = 0; d < t->ndim && s == MT_OK; d++) {
            uint64_t dim;
            if (!mt_st__uint(&shape->items[d], &dim))
                s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": shape entry %d is not a non-negative integer", path, name, d);
            else if (dim != 0 && numel > numel_limit / dim)
                s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": shape is impossibly large", path, name);
            else {
                t->shape[d] = (int64_t)dim;
                numel *= dim;
            }
        }
        if (s != MT_OK) break;
        t->numel = (int64_t)numel;
        uint64_t need = numel * mt_st__dtypes[dt].size; /* <= 2^62 */
        if (offsets->type != MT_JSON_ARRAY || offsets->count != 2 || !mt_st__uint(&offsets->items[0], &t->begin) ||
            !mt_st__uint(&offsets->items[1], &t->end)) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": data_offsets is not [begin, end] of non-negative integers", path, name);
            break;
        }
        if (t->end < t->begin) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%llu, %llu] end before begin", path, name,
                        (unsigned long long)t->begin, (unsigned long long)t->end);
            break;
        }
        if (t->end - t->begin != need) {
            char sh[256];
            mt_st__shape_string(t, sh, sizeof(sh));
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\": data_offsets [%llu, %llu] span %llu bytes but shape %s of %s needs %llu",
                        path, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)(t->end - t->begin), sh, mt_st__dtypes[dt].name, (unsigned long long)need);
            break;
        }
        if (t->end > f->data_size) {
            s = mt_fail(err, MT_ERR_FORMAT,
                        "%s: truncated: tensor \"%s\" ends at byte %llu of the data region, which holds only %llu bytes", path,
                        name, (unsigned long long)t->end, (unsigned long long)f->data_size);
            break;
        }
        t->name = mt_st__strdup(name);
        if (!t->name) { s = mt_fail(err, MT_ERR_OOM, "%s: out of memory", path); break; }
        st->num_tensors++;
    }
    mt_json_free(root);
    if (s != MT_OK) return s;

    /* the tensors must tile the data region: sorted by offsets, each begins where the last ended */
    int count = st->num_tensors - first;
    mt_st_tensor** order = (mt_st_tensor**)malloc(sizeof(mt_st_tensor*) * (size_t)(count + 1));
    if (!order) return mt_fail(err, MT_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < count; i++) order[i] = &st->tensors[first + i];
    qsort(order, (size_t)count, sizeof(*order), mt_st__cmp_offsets);
    uint64_t expected = 0;
    const mt_st_tensor* prev = NULL;
    for (int i = 0; i < count && s == MT_OK; i++) {
        const mt_st_tensor* t = order[i];
        if (t->begin < expected)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensors \"%s\" [%llu, %llu) and \"%s\" [%llu, %llu) overlap", path, prev->name,
                        (unsigned long long)prev->begin, (unsigned long long)prev->end, t->name,
                        (unsigned long long)t->begin, (unsigned long long)t->end);
        else if (t->begin > expected)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: bytes [%llu, %llu) of the data region belong to no tensor (before \"%s\")",
                        path, (unsigned long long)expected, (unsigned long long)t->begin, t->name);
        expected = t->end;
        prev = t;
    }
    free(order);
    if (s == MT_OK && expected != f->data_size)
        s = mt_fail(err, MT_ERR_FORMAT, "%s: %llu bytes after the last tensor (the data region holds %llu, the tensors %llu)",
                    path, (unsigned long long)(f->data_size - expected), (unsigned long long)f->data_size,
                    (unsigned long long)expected);
    return s;
}

static mt_status mt_st__map(mt_st__file* f, mt_error* err) {
    int fd = mt_open_regular_file(f->path, err);
    if (fd < 0) return MT_ERR_IO;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return mt_fail(err, MT_ERR_IO, "cannot stat %s", f->path);
    }
    f->size = (size_t)sb.st_size;
    if (f->size > 0) {
        void* p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return mt_fail(err, MT_ERR_IO, "cannot mmap %s: %s", f->path, strerror(e));
        }
        f->map = (unsigned char*)p;
    }
    close(fd);
    return MT_OK;
}

void mt_safetensors_close(mt_safetensors* st) {
    if (!st) return;
    for (int i = 0; i < st->num_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    for (int i = 0; i < st->num_tensors; i++) free((char*)st->tensors[i].name);
    free(st->tensors);
    for (int i = 0; i < st->num_metadata; i++) {
        free(st->meta_keys[i]);
        free(st->meta_values[i]);
    }
    free(st->meta_keys);
    free(st->meta_values);
    free(st);
}

static int mt_st__ends_with(const char* s, const char* suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

static mt_status mt_st__add_file(mt_safetensors* st, const char* path, mt_error* err) {
    mt_st__file* files = (mt_st__file*)realloc(st->files, sizeof(mt_st__file) * (size_t)(st->num_files + 1));
    if (!files) return mt_fail(err, MT_ERR_OOM, "out of memory opening %s", path);
    st->files = files;
    mt_st__file* f = &st->files[st->num_files];
    memset(f, 0, sizeof(*f));
    f->path = mt_st__strdup(path);
    if (!f->path) return mt_fail(err, MT_ERR_OOM, "out of memory opening %s", path);
    st->num_files++;
    mt_status s = mt_st__map(f, err);
    if (s == MT_OK) s = mt_st__parse_file(st, st->num_files - 1, st->num_files == 1, err);
    return s;
}

/* A sharded checkpoint: the index's weight_map names the shards. */
static mt_status mt_st__open_index(mt_safetensors* st, const char* index_path, mt_error* err) {
    mt_json* index = NULL;
    mt_status s = mt_json_parse_file(&index, index_path, err);
    if (s != MT_OK) return s;
    const mt_json* map = mt_json_get(index, "weight_map");
    if (!map || map->type != MT_JSON_OBJECT) {
        mt_json_free(index);
        return mt_fail(err, MT_ERR_FORMAT, "%s: no \"weight_map\" object: not a safetensors index", index_path);
    }
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", index_path);
    char* slash = strrchr(dir, '/');
    if (slash) slash[1] = 0;
    else dir[0] = 0;
    /* the distinct shard names, in order of first appearance */
    const char** shards = (const char**)malloc(sizeof(char*) * (size_t)(map->count + 1));
    int num_shards = 0;
    if (!shards) s = mt_fail(err, MT_ERR_OOM, "out of memory reading %s", index_path);
    for (int i = 0; i < map->count && s == MT_OK; i++) {
        const mt_json* v = &map->items[i];
        if (v->type != MT_JSON_STRING || !v->length) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: weight_map entry \"%s\" is not a file name", index_path, map->keys[i]);
            break;
        }
        if (v->string[0] == '/' || strstr(v->string, "..")) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: weight_map entry \"%s\" names \"%s\", outside the checkpoint's directory",
                        index_path, map->keys[i], v->string);
            break;
        }
        int seen = 0;
        for (int k = 0; k < num_shards; k++) seen |= !strcmp(shards[k], v->string);
        if (!seen) shards[num_shards++] = v->string;
    }
    if (s == MT_OK && num_shards == 0) s = mt_fail(err, MT_ERR_FORMAT, "%s: the weight_map is empty", index_path);
    for (int k = 0; k < num_shards && s == MT_OK; k++) {
        char path[8192];
        snprintf(path, sizeof(path), "%s%s", dir, shards[k]);
        s = mt_st__add_file(st, path, err);
    }
    if (s == MT_OK) {
        qsort(st->tensors, (size_t)st->num_tensors, sizeof(mt_st_tensor), mt_st__cmp_name);
        for (int i = 1; i < st->num_tensors && s == MT_OK; i++)
            if (!strcmp(st->tensors[i].name, st->tensors[i - 1].name))
                s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\" is in two shards (%s and %s)", index_path,
                            st->tensors[i].name, st->files[st->tensors[i - 1].file].path, st->files[st->tensors[i].file].path);
    }
    for (int i = 0; i < map->count && s == MT_OK; i++) {
        const mt_st_tensor* t = mt_safetensors_find(st, map->keys[i]);
        const char* shard = map->items[i].string;
        if (!t)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\" is mapped to %s, which does not hold it", index_path,
                        map->keys[i], shard);
        else if (!mt_st__ends_with(st->files[t->file].path, shard) ||
                 strlen(st->files[t->file].path) != strlen(dir) + strlen(shard))
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\" is mapped to %s but found in %s", index_path, map->keys[i],
                        shard, st->files[t->file].path);
    }
    free(shards);
    mt_json_free(index);
    return s;
}

mt_status mt_safetensors_open(mt_safetensors** out, const char* path, mt_error* err) {
    *out = NULL;
    mt_safetensors* st = (mt_safetensors*)calloc(1, sizeof(mt_safetensors));
    if (!st) return mt_fail(err, MT_ERR_OOM, "out of memory opening %s", path);
    mt_status s;
    if (mt_st__ends_with(path, ".json")) {
        s = mt_st__open_index(st, path, err);
    } else {
        s = mt_st__add_file(st, path, err);
        if (s == MT_OK) qsort(st->tensors, (size_t)st->num_tensors, sizeof(mt_st_tensor), mt_st__cmp_name);
        /* JSON keys are unique, so names are too */
    }
    if (s != MT_OK) {
        mt_safetensors_close(st);
        return s;
    }
    *out = st;
    return MT_OK;
}

int mt_safetensors_count(const mt_safetensors* st) { return st->num_tensors; }

const mt_st_tensor* mt_safetensors_at(const mt_safetensors* st, int i) {
    return i >= 0 && i < st->num_tensors ? &st->tensors[i] : NULL;
}

const mt_st_tensor* mt_safetensors_find(const mt_safetensors* st, const char* name) {
    int lo = 0, hi = st->num_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(st->tensors[mid].name, name);
        if (!c) return &st->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char* mt_safetensors_file_path(const mt_safetensors* st, const mt_st_tensor* t) { return st->files[t->file].path; }

const char* mt_safetensors_metadata(const mt_safetensors* st, const char* key) {
    for (int i = 0; i < st->num_metadata; i++)
        if (!strcmp(st->meta_keys[i], key)) return st->meta_values[i];
    return NULL;
}

const void* mt_safetensors_data(const mt_safetensors* st, const mt_st_tensor* t) {
    return st->files[t->file].data + t->begin;
}

float mt_st_bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t mt_st_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays (quiet) NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);                                              /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float mt_st_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
    if (e == 0x1F) u = sign | 0x7F800000u | (m << 13);           /* inf, NaN */
    else if (e != 0) u = sign | ((e + 112u) << 23) | (m << 13);  /* normal: bias 15 -> 127 */
    else if (m == 0) u = sign;                                   /* zero */
    else {                                                       /* subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-08f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t mt_st_f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);       /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);      /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                                         /* below 2^-14: subnormal or zero */
        /* value = a_float; half subnormal unit is 2^-24: round(a_float * 2^24) to nearest even */
        float f;
        memcpy(&f, &a, 4);
        float scaled = f * 16777216.0f; /* exact: a power of two */
        uint32_t q = (uint32_t)scaled;
        float rem = scaled - (float)q;
        if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
        return (uint16_t)(sign | q); /* q == 0x400 becomes the smallest normal, correctly */
    }
    uint32_t e = (a >> 23) - 112u, m = a & 0x7FFFFFu;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rest = m & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* may carry into the exponent: fine */
    return (uint16_t)(sign | h);
}

mt_status mt_safetensors_read_f32(const mt_safetensors* st, const mt_st_tensor* t, float* out, mt_error* err) {
    const unsigned char* p = (const unsigned char*)mt_safetensors_data(st, t);
    int64_t n = t->numel;
    switch (t->dtype) {
        case MT_ST_F32: memcpy(out, p, sizeof(float) * (size_t)n); break;
        case MT_ST_BF16:
            for (int64_t i = 0; i < n; i++) { uint16_t v; memcpy(&v, p + 2 * i, 2); out[i] = mt_st_bf16_to_f32(v); }
            break;
        case MT_ST_F16:
            for (int64_t i = 0; i < n; i++) { uint16_t v; memcpy(&v, p + 2 * i, 2); out[i] = mt_st_f16_to_f32(v); }
            break;
        case MT_ST_F64:
            for (int64_t i = 0; i < n; i++) { double v; memcpy(&v, p + 8 * i, 8); out[i] = (float)v; }
            break;
        default:
            return mt_fail(err, MT_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; only F32, F16, BF16 and F64 convert to float32",
                           mt_safetensors_file_path(st, t), t->name, mt_st_dtype_name(t->dtype));
    }
    return MT_OK;
}

/* ---- writer ---- */

typedef struct { char* s; size_t n, cap; int oom; } mt_st__buf;

static void mt_st__append(mt_st__buf* b, const char* s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->cap ? b->cap * 2 : 1024) + n;
        char* t = (char*)realloc(b->s, cap);
        if (!t) { b->oom = 1; return; }
        b->s = t;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void mt_st__appendf(mt_st__buf* b, const char* fmt, long long a, long long c) {
    char tmp[64];
    int k = snprintf(tmp, sizeof(tmp), fmt, a, c);
    mt_st__append(b, tmp, (size_t)k);
}

/* A JSON string literal. */
static void mt_st__append_string(mt_st__buf* b, const char* s) {
    mt_st__append(b, "\"", 1);
    for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
        char tmp[8];
        if (*p == '"' || *p == '\\') { tmp[0] = '\\'; tmp[1] = (char)*p; mt_st__append(b, tmp, 2); }
        else if (*p < 0x20) { snprintf(tmp, sizeof(tmp), "\\u%04x", *p); mt_st__append(b, tmp, 6); }
        else mt_st__append(b, (const char*)p, 1);
    }
    mt_st__append(b, "\"", 1);
}

static int mt_st__write_all(FILE* f, const void* p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }

mt_status mt_safetensors_write(const char* path, const mt_st_write_tensor* tensors, int count,
                               const char* const* metadata, mt_error* err) {
    /* the header */
    mt_st__buf h;
    memset(&h, 0, sizeof(h));
    mt_st__append(&h, "{", 1);
    int first = 1;
    if (metadata && metadata[0]) {
        mt_st__append(&h, "\"__metadata__\":{", 16);
        for (int k = 0; metadata[k]; k += 2) {
            if (!metadata[k + 1]) { free(h.s); return mt_fail(err, MT_ERR_ARG, "%s: metadata key \"%s\" has no value", path, metadata[k]); }
            if (k) mt_st__append(&h, ",", 1);
            mt_st__append_string(&h, metadata[k]);
            mt_st__append(&h, ":", 1);
            mt_st__append_string(&h, metadata[k + 1]);
        }
        mt_st__append(&h, "}", 1);
        first = 0;
    }
    uint64_t offset = 0;
    for (int i = 0; i < count; i++) {
        const mt_st_write_tensor* t = &tensors[i];
        if (t->dtype != MT_ST_F32 && t->dtype != MT_ST_BF16 && t->dtype != MT_ST_F16) {
            free(h.s);
            return mt_fail(err, MT_ERR_ARG, "%s: tensor \"%s\": the writer stores F32, BF16 or F16, not %s", path, t->name,
                           mt_st_dtype_name(t->dtype));
        }
        if (t->ndim < 0 || t->ndim > MT_ST_MAX_DIMS || !strcmp(t->name, "__metadata__")) {
            free(h.s);
            return mt_fail(err, MT_ERR_ARG, "%s: tensor \"%s\": bad name or number of dimensions", path, t->name);
        }
        for (int j = 0; j < i; j++)
            if (!strcmp(tensors[j].name, t->name)) {
                free(h.s);
                return mt_fail(err, MT_ERR_ARG, "%s: tensor \"%s\" given twice", path, t->name);
            }
        int64_t numel = 1;
        for (int d = 0; d < t->ndim && numel >= 0; d++)
            if (t->shape[d] < 0 || mt_mul_overflows_i64(numel, t->shape[d], &numel) || numel > ((int64_t)1 << 60)) numel = -1;
        if (numel < 0 || offset > ((uint64_t)1 << 62)) { /* as the reader: at most 2^62 bytes */
            free(h.s);
            return mt_fail(err, MT_ERR_ARG, "%s: tensor \"%s\": a negative or impossibly large shape", path, t->name);
        }
        uint64_t bytes = (uint64_t)numel * mt_st_dtype_size(t->dtype);
        if (!first) mt_st__append(&h, ",", 1);
        first = 0;
        mt_st__append_string(&h, t->name);
        mt_st__append(&h, ":{\"dtype\":\"", 11);
        mt_st__append(&h, mt_st_dtype_name(t->dtype), strlen(mt_st_dtype_name(t->dtype)));
        mt_st__append(&h, "\",\"shape\":[", 11);
        for (int d = 0; d < t->ndim; d++) mt_st__appendf(&h, d ? ",%lld" : "%lld", (long long)t->shape[d], 0);
        mt_st__appendf(&h, "],\"data_offsets\":[%lld,%lld]}", (long long)offset, (long long)(offset + bytes));
        offset += bytes;
    }
    mt_st__append(&h, "}", 1);
    while (!h.oom && (8 + h.n) % 8) mt_st__append(&h, " ", 1); /* the data starts 8-byte aligned */
    if (h.oom) { free(h.s); return mt_fail(err, MT_ERR_OOM, "%s: out of memory building the header", path); }

    char* tmp = mt_temporary_path(path);
    if (!tmp) { free(h.s); return mt_fail(err, MT_ERR_OOM, "%s: out of memory", path); }
    mt_remove_stale_temporaries(path);
    FILE* f = fopen(tmp, "wb");
    if (!f) {
        mt_status st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
        free(h.s);
        free(tmp);
        return st;
    }
    uint64_t n = h.n;
    int bad = mt_st__write_all(f, &n, 8) || mt_st__write_all(f, h.s, h.n);
    free(h.s);
    enum { CHUNK = 1 << 16 };
    uint16_t* half = (uint16_t*)malloc(sizeof(uint16_t) * CHUNK);
    if (!half) bad = 1;
    for (int i = 0; i < count && !bad; i++) {
        const mt_st_write_tensor* t = &tensors[i];
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        if (t->dtype == MT_ST_F32) {
            bad = numel && mt_st__write_all(f, t->data, sizeof(float) * (size_t)numel);
            continue;
        }
        for (int64_t s = 0; s < numel && !bad; s += CHUNK) {
            int64_t k = numel - s < CHUNK ? numel - s : (int64_t)CHUNK;
            for (int64_t j = 0; j < k; j++)
                half[j] = t->dtype == MT_ST_BF16 ? mt_st_f32_to_bf16(t->data[s + j]) : mt_st_f32_to_f16(t->data[s + j]);
            bad = mt_st__write_all(f, half, sizeof(uint16_t) * (size_t)k);
        }
    }
    free(half);
    int e = errno;
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) { bad = 1; e = errno; }
    if (fclose(f) != 0 && !bad) { bad = 1; e = errno; }
    mt_status st = bad ? mt_fail(err, MT_ERR_IO, "cannot write %s: %s", tmp, strerror(e)) : mt_commit_file(tmp, path, err);
    if (bad) unlink(tmp);
    free(tmp);
    return st;
}

#ifdef __cplusplus
}
#endif

#endif /* MT_SAFETENSORS_IMPLEMENTATION */
