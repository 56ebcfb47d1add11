/* tests/test_dataset.h — datasets (host tests), megatron.h sections 2-4: .bin/.idx reader and
 * writer, Megatron's GPT sample index (document/sample/shuffle index, splits, blending) and the .npy
 * writer.
 *
 * The expected values come from dev/gen_dataset_vectors.py, a numpy re-statement of Megatron's
 * dataset code that uses numpy.random.RandomState itself; its output is committed under
 * dev/data/dataset_vectors/. Every element of every index array is compared, the tokens of a few
 * samples per split, and the .npy files megatron.h writes must be byte-identical to numpy.save's.
 * Run from the repository root (the vectors are found by relative path). */
#ifndef MT_TEST_DATASET_H
#define MT_TEST_DATASET_H

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "test_common.h"

#define TDS_ROOT "dev/data/dataset_vectors"

/* ---- small helpers ----------------------------------------------------------------------------- */

/* A .npy array (format 1.0, C order), parsed in place from bytes it may own (raw). */
typedef struct {
    char* raw; /* owned, or NULL */
    size_t raw_size;
    char descr[8];
    int ndim;
    int64_t shape[4];
    int64_t count;
    size_t itemsize;
    const unsigned char* data;
} tds_npy;

static void tds_npy_free(tds_npy* a) { free(a->raw); memset(a, 0, sizeof(*a)); }

/* Parses the n bytes at p (one whole .npy) into a; returns 0 on success. */
static int tds_npy_parse(const char* p, size_t n, tds_npy* a) {
    if (!p || n < 10 || memcmp(p, "\x93NUMPY\x01\x00", 8) != 0) return -1;
    size_t hlen = (unsigned char)p[8] | ((size_t)(unsigned char)p[9] << 8);
    if (10 + hlen > n || hlen < 1 || hlen > 4000) return -1;
    char h[4096];
    memcpy(h, p + 10, hlen);
    h[hlen - 1] = 0; /* the '\n' */
    const char* d = strstr(h, "'descr': '");
    const char* s = strstr(h, "'shape': (");
    if (!d || !s) return -1;
    d += 10;
    size_t k = 0;
    while (d[k] && d[k] != '\'' && k < sizeof(a->descr) - 1) { a->descr[k] = d[k]; k++; }
    a->descr[k] = 0;
    s += 10;
    a->count = 1;
    while (*s && *s != ')') {
        while (*s == ' ' || *s == ',') s++;
        if (*s == ')') break;
        if (a->ndim == 4) return -1;
        char* end;
        a->shape[a->ndim] = strtoll(s, &end, 10);
        if (end == s) return -1;
        a->count *= a->shape[a->ndim++];
        s = end;
    }
    a->itemsize = (size_t)atoi(a->descr + 2);
    a->data = (const unsigned char*)p + 10 + hlen;
    if ((size_t)a->count * a->itemsize != n - 10 - hlen) return -1;
    return 0;
}

static int tds_npy_load(const char* path, tds_npy* a) {
    memset(a, 0, sizeof(*a));
    a->raw = test_read_file(path, &a->raw_size);
    return tds_npy_parse(a->raw, a->raw_size, a);
}

/* The arrays of one case: arrays.npys and the "array NAME OFFSET SIZE" lines of its meta.txt. */
typedef struct {
    char* blob;
    size_t blob_size;
    int count;
    char name[64][48];
    size_t offset[64], size[64];
} tds_case_arrays;

/* The bytes of array `name` (NULL if missing), and its parse into a. */
static const char* tds_case_array(const tds_case_arrays* c, const char* name, tds_npy* a, size_t* size) {
    memset(a, 0, sizeof(*a));
    for (int i = 0; i < c->count; i++)
        if (strcmp(c->name[i], name) == 0 && c->offset[i] + c->size[i] <= c->blob_size) {
            if (tds_npy_parse(c->blob + c->offset[i], c->size[i], a) != 0) return NULL;
            if (size) *size = c->size[i];
            return c->blob + c->offset[i];
        }
    return NULL;
}

/* Element i as int64 (signed or unsigned integer dtypes up to 8 bytes). */
static int64_t tds_npy_get(const tds_npy* a, int64_t i) {
    const unsigned char* p = a->data + (size_t)i * a->itemsize;
    int uns = a->descr[1] == 'u';
    switch (a->itemsize) {
        case 1: return uns ? (int64_t)p[0] : (int64_t)(int8_t)p[0];
        case 2: { uint16_t v; memcpy(&v, p, 2); return uns ? (int64_t)v : (int64_t)(int16_t)v; }
        case 4: { uint32_t v; memcpy(&v, p, 4); return uns ? (int64_t)v : (int64_t)(int32_t)v; }
        default: { int64_t v; memcpy(&v, p, 8); return v; }
    }
}

static int tds_write_file(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

static int tds_files_equal(const char* a, const char* b) {
    size_t na = 0, nb = 0;
    char* x = test_read_file(a, &na);
    char* y = test_read_file(b, &nb);
    int eq = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return eq;
}

/* A fresh directory under /tmp (into buf). */
static int tds_tmpdir(char* buf, size_t n) {
    snprintf(buf, n, "/tmp/mt_test_dataset_XXXXXX");
    return mkdtemp(buf) ? 0 : -1;
}

/* Removes every file in dir, then dir; returns the number of files it found. */
static int tds_rmdir(const char* dir) {
    DIR* d = opendir(dir);
    int count = 0;
    if (!d) return -1;
    struct dirent* e;
    char path[1024];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        unlink(path);
        count++;
    }
    closedir(d);
    rmdir(dir);
    return count;
}

static int tds_have_vectors(void) {
    struct stat st;
    return stat(TDS_ROOT "/cases.txt", &st) == 0;
}

/* ---- generator and splits ---------------------------------------------------------------------- */

static test_result test_dataset_rng(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    char* text = test_read_file(TDS_ROOT "/rng.txt", NULL);
    EXPECT(text, "cannot read rng.txt");
    int checked = 0;
    for (char* line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char kind[32];
        int used = 0;
        if (sscanf(line, "%31s%n", kind, &used) != 1) continue;
        char* p = line + used;
        if (strcmp(kind, "mt19937") == 0) {
            unsigned long long seed = strtoull(p, &p, 10);
            mt_mt19937 rng;
            mt_mt19937_seed(&rng, (uint32_t)seed);
            for (int i = 0; i < 8; i++) {
                unsigned long long want = strtoull(p, &p, 10);
                uint32_t got = mt_mt19937_next32(&rng);
                EXPECT(got == want, "seed %llu word %d: got %u, numpy %llu", seed, i, got, want);
            }
        } else if (strcmp(kind, "interval64") == 0) {
            unsigned long long seed = strtoull(p, &p, 10), max = strtoull(p, &p, 10);
            mt_mt19937 rng;
            mt_mt19937_seed(&rng, (uint32_t)seed);
            for (int i = 0; i < 6; i++) {
                unsigned long long want = strtoull(p, &p, 10);
                uint64_t got = mt_mt19937_interval(&rng, max);
                EXPECT(got == want, "interval(%llu) draw %d: got %llu, numpy %llu", max, i, (unsigned long long)got,
                       want);
            }
        } else if (strcmp(kind, "shuffle") == 0) {
            unsigned long long seed = strtoull(p, &p, 10), n = strtoull(p, &p, 10), sum = strtoull(p, &p, 10);
            uint32_t* a = (uint32_t*)malloc(n * sizeof(uint32_t));
            EXPECT(a, "oom");
            for (unsigned long long i = 0; i < n; i++) a[i] = (uint32_t)i;
            mt_mt19937 rng;
            mt_mt19937_seed(&rng, (uint32_t)seed);
            mt_shuffle(&rng, a, (int64_t)n, sizeof(uint32_t));
            uint64_t got = 0;
            for (unsigned long long i = 0; i < n; i++) got += (uint64_t)a[i] * (uint64_t)(i + 1);
            int ok = got == sum;
            for (int i = 0; i < 16 && ok; i++) {
                unsigned long long want = strtoull(p, &p, 10);
                ok = a[i < 8 ? (unsigned long long)i : n - 16 + (unsigned long long)i] == want;
            }
            free(a);
            EXPECT(ok, "shuffle of %llu elements (seed %llu) differs from numpy", n, seed);
        } else {
            continue;
        }
        checked++;
    }
    free(text);
    EXPECT(checked == 8, "rng.txt had %d entries, expected 8", checked);
    return TEST_PASS;
}

static test_result test_dataset_split(void) {
    mt_split_matrix m;
    mt_error err_, *err = &err_;
    int64_t b, e;
    EXPECT_OK(mt_split_parse("969, 30, 1", &m, err), err);
    EXPECT(m.present[0] && m.present[1] && m.present[2], "all three splits present");
    mt_split_range(&m, MT_SPLIT_TRAIN, 2000, &b, &e);
    EXPECT(b == 0 && e == 1938, "train [%lld, %lld)", (long long)b, (long long)e);
    mt_split_range(&m, MT_SPLIT_TEST, 2000, &b, &e);
    EXPECT(b == 1998 && e == 2000, "test [%lld, %lld)", (long long)b, (long long)e);
    /* "1,1,2" of 10: 0.25*10 = 2.5 rounds half to even, to 2 (round-half-up would give 3). */
    EXPECT_OK(mt_split_parse("1,1,2", &m, err), err);
    mt_split_range(&m, MT_SPLIT_TRAIN, 10, &b, &e);
    EXPECT(b == 0 && e == 2, "train [%lld, %lld), expected [0, 2)", (long long)b, (long long)e);
    mt_split_range(&m, MT_SPLIT_VALID, 10, &b, &e);
    EXPECT(b == 2 && e == 5, "valid [%lld, %lld)", (long long)b, (long long)e);
    mt_split_range(&m, MT_SPLIT_TRAIN, 6, &b, &e); /* 1.5 -> 2 */
    EXPECT(b == 0 && e == 2, "train of 6 [%lld, %lld)", (long long)b, (long long)e);
    /* Missing entries pad with 0 (an empty split); anything between numbers is ignored. */
    EXPECT_OK(mt_split_parse("98/2", &m, err), err);
    EXPECT(m.present[0] && m.present[1] && !m.present[2], "98/2 -> train, valid, no test");
    EXPECT_OK(mt_split_parse("0,1,0", &m, err), err);
    EXPECT(!m.present[0] && m.present[1] && !m.present[2], "only valid");
    mt_split_range(&m, MT_SPLIT_TRAIN, 100, &b, &e);
    EXPECT(b == 0 && e == 0, "empty split range");
    EXPECT(mt_split_parse("1.2.3", &m, err) == MT_ERR_ARG, "1.2.3 is not a number");
    EXPECT(mt_split_parse("1,2,3,4", &m, err) == MT_ERR_ARG, "four numbers");
    EXPECT(mt_split_parse("0,0", &m, err) == MT_ERR_ARG, "zero sum");
    EXPECT(mt_split_parse(".", &m, err) == MT_ERR_ARG, "a lone dot");
    int64_t ns[3];
    EXPECT(mt_gpt_num_samples(500, 100, 10, 8, ns, NULL) == MT_OK, "num_samples");
    EXPECT(ns[0] == 4000 && ns[1] == 480 && ns[2] == 80, "num samples %lld %lld %lld", (long long)ns[0],
           (long long)ns[1], (long long)ns[2]);
    /* Sampler: mbs 2, dp 4: rank 1 takes indices 2,3 then 10,11. */
    EXPECT(mt_sampler_index(0, 2, 1, 0) == 2 && mt_sampler_index(0, 2, 1, 1) == 3, "sampler chunk 0");
    EXPECT(mt_sampler_index(8, 2, 1, 0) == 10, "sampler chunk 1");
    /* --data-path forms (get_blend_from_list). */
    const char* args1[4] = {"0.3", "a", "70", "b"};
    const char* args2[3] = {"a", "b", "c"};
    const char* args3[4] = {"0.3", "a", "b", "c"};
    const char* pfx[4];
    double pw[4];
    int np_ = 0, weighted = 0;
    EXPECT_OK(mt_data_path_parse(4, args1, pfx, pw, &np_, &weighted, err), err);
    EXPECT(np_ == 2 && weighted && pw[0] == 0.3 && pw[1] == 70 && strcmp(pfx[1], "b") == 0, "weighted data path");
    EXPECT_OK(mt_data_path_parse(3, args2, pfx, pw, &np_, &weighted, err), err);
    EXPECT(np_ == 3 && !weighted && strcmp(pfx[2], "c") == 0, "plain prefixes");
    EXPECT(mt_data_path_parse(4, args3, pfx, pw, &np_, &weighted, err) == MT_ERR_ARG, "a mix of weights and prefixes");
    double w[2] = {30, 70}, nw[2];
    mt_normalize_weights(w, 2, nw);
    EXPECT(nw[0] == 0.3 && nw[1] == 0.7, "normalize %.17g %.17g", nw[0], nw[1]);
    return TEST_PASS;
}

/* ---- the numpy vectors ------------------------------------------------------------------------- */

/* Compares an index array (any integer itemsize) with the case's expected array of the same dtype. */
static int tds_compare_array(const tds_case_arrays* c, const char* path, const void* data, int itemsize, int64_t count,
                             int ndim, const int64_t* shape, char* why, size_t whyn) {
    tds_npy a;
    if (!tds_case_array(c, path, &a, NULL)) {
        snprintf(why, whyn, "no array %s", path);
        return 0;
    }
    int ok = 1;
    if ((int)a.itemsize != itemsize || a.count != count || a.ndim != ndim) {
        snprintf(why, whyn, "%s: dtype %s count %lld ndim %d, megatron.h has itemsize %d count %lld ndim %d", path,
                 a.descr, (long long)a.count, a.ndim, itemsize, (long long)count, ndim);
        ok = 0;
    }
    for (int i = 0; ok && i < ndim; i++)
        if (a.shape[i] != shape[i]) {
            snprintf(why, whyn, "%s: shape[%d] %lld vs %lld", path, i, (long long)a.shape[i], (long long)shape[i]);
            ok = 0;
        }
    for (int64_t i = 0; ok && i < count; i++) {
        int64_t want = tds_npy_get(&a, i), got;
        if (itemsize == 2) got = ((const int16_t*)data)[i];
        else if (itemsize == 4 && a.descr[1] == 'u') got = ((const uint32_t*)data)[i];
        else if (itemsize == 4) got = ((const int32_t*)data)[i];
        else got = ((const int64_t*)data)[i];
        if (got != want) {
            snprintf(why, whyn, "%s: element %lld is %lld, numpy has %lld", path, (long long)i, (long long)got,
                     (long long)want);
            ok = 0;
        }
    }
    return ok;
}

/* One line of cases.txt: builds the data with megatron.h and checks it against the case directory. */
static test_result tds_check_case(char* line) {
    char* fields[7];
    int nf = 0;
    for (char* p = line; nf < 7;) {
        fields[nf++] = p;
        char* bar = strchr(p, '|');
        if (!bar) break;
        *bar = 0;
        p = bar + 1;
    }
    EXPECT(nf == 7, "bad cases.txt line");
    const char* name = fields[0];
    char prefix_buf[8][256];
    const char* prefixes[8];
    int np_ = 0;
    for (char* p = strtok(fields[1], ","); p && np_ < 8; p = strtok(NULL, ",")) {
        snprintf(prefix_buf[np_], sizeof(prefix_buf[np_]), TDS_ROOT "/datasets/%s", p);
        prefixes[np_] = prefix_buf[np_];
        np_++;
    }
    double weights[8];
    int has_weights = strcmp(fields[2], "-") != 0;
    if (has_weights) {
        char* p = fields[2];
        for (int k = 0; k < np_; k++) {
            weights[k] = strtod(p, &p);
            if (*p == ',') p++;
        }
    }
    const char* split = fields[3];
    int seq_length = atoi(fields[4]);
    uint32_t seed = (uint32_t)strtoul(fields[5], NULL, 10);
    int64_t samples[3];
    {
        char* p = fields[6];
        for (int i = 0; i < 3; i++) {
            samples[i] = strtoll(p, &p, 10);
            if (*p == ',') p++;
        }
    }
    mt_gpt_data* d = NULL;
    mt_error err_, *err = &err_;
    EXPECT_OK(mt_gpt_data_open(&d, np_, prefixes, has_weights ? weights : NULL, split, seq_length, seed, samples, err),
              err);

    char path[512], meta_path[512], why[512], tmp[256];
    snprintf(meta_path, sizeof(meta_path), TDS_ROOT "/cases/%s/meta.txt", name);
    char* meta = test_read_file(meta_path, NULL);
    EXPECT(meta, "%s: cannot read %s", name, meta_path);
    static tds_case_arrays arrays;
    memset(&arrays, 0, sizeof(arrays));
    snprintf(path, sizeof(path), TDS_ROOT "/cases/%s/arrays.npys", name);
    arrays.blob = test_read_file(path, &arrays.blob_size);
    EXPECT(arrays.blob, "%s: cannot read %s", name, path);
    for (const char* l = meta; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        unsigned long long off, size;
        if (arrays.count < 64 &&
            sscanf(l, "array %47s %llu %llu", arrays.name[arrays.count], &off, &size) == 3) {
            arrays.offset[arrays.count] = (size_t)off;
            arrays.size[arrays.count] = (size_t)size;
            arrays.count++;
        }
    }
    EXPECT(tds_tmpdir(tmp, sizeof(tmp)) == 0, "mkdtemp");
    int32_t* tokens = (int32_t*)malloc(((size_t)seq_length + 1) * sizeof(int32_t));
    test_result result = TEST_PASS;
#define TDS_CHECK(cond, ...)                                 \
    do {                                                     \
        if (!(cond)) {                                       \
            printf("    FAIL %s:%d: case %s: ", __FILE__, __LINE__, name); \
            printf(__VA_ARGS__);                             \
            printf("\n");                                    \
            result = TEST_FAIL;                              \
            goto out;                                        \
        }                                                    \
    } while (0)
    {
        char* save = NULL;
        for (char* l = strtok_r(meta, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
            char kind[16], sp[16];
            int s = -1, used = 0;
            if (sscanf(l, "%15s %15s%n", kind, sp, &used) != 2 || strcmp(kind, "array") == 0) continue;
            for (int i = 0; i < 3; i++)
                if (strcmp(sp, mt_split_name(i)) == 0) s = i;
            TDS_CHECK(s >= 0, "bad split in meta line %s", l);
            if (strcmp(kind, "size") == 0) {
                long long size = atoll(l + used);
                TDS_CHECK(mt_gpt_data_num_samples(d, s) == size, "%s size %lld, numpy %lld", sp,
                          (long long)mt_gpt_data_num_samples(d, s), size);
                if (mt_gpt_data_is_blended(d) && size > 0) {
                    int64_t shape[1] = {size};
                    snprintf(path, sizeof(path), "%s-dataset_index", sp);
                    TDS_CHECK(tds_compare_array(&arrays, path, mt_gpt_data_blend_dataset_index(d, s), 2, size, 1, shape, why,
                                                sizeof(why)), "%s", why);
                    snprintf(path, sizeof(path), "%s-dataset_sample_index", sp);
                    TDS_CHECK(tds_compare_array(&arrays, path, mt_gpt_data_blend_sample_index(d, s), 8, size, 1, shape, why,
                                                sizeof(why)), "%s", why);
                }
            } else if (strcmp(kind, "mid") == 0) {
                long long k, begin, end, req, T, E, sep, sans, n;
                TDS_CHECK(sscanf(l + used, "%lld %lld %lld %lld %lld %lld %lld %lld %lld", &k, &begin, &end, &req, &T, &E,
                                 &sep, &sans, &n) == 9, "bad meta line %s", l);
                const mt_gpt_dataset* g = mt_gpt_data_dataset(d, s, (int)k);
                TDS_CHECK(g, "no %s dataset %lld", sp, k);
                mt_gpt_dataset_info info;
                mt_gpt_dataset_get_info(g, &info);
                TDS_CHECK(info.begin == begin && info.end == end, "%s/%lld range [%lld, %lld), numpy [%lld, %lld)", sp,
                          k, (long long)info.begin, (long long)info.end, begin, end);
                TDS_CHECK(info.num_samples_requested == req, "%s/%lld asked for %lld samples, numpy %lld", sp, k,
                          (long long)info.num_samples_requested, req);
                TDS_CHECK(info.tokens_per_epoch == T && info.num_epochs == E && info.separate_final_epoch == sep &&
                              info.num_samples_sans_final_epoch == sans && info.num_samples == n,
                          "%s/%lld: T %lld E %lld separate %d sans %lld n %lld; numpy %lld %lld %lld %lld %lld", sp, k,
                          (long long)info.tokens_per_epoch, (long long)info.num_epochs, info.separate_final_epoch,
                          (long long)info.num_samples_sans_final_epoch, (long long)info.num_samples, T, E, sep, sans,
                          n);
                int64_t shape1[1] = {info.document_index_length};
                snprintf(path, sizeof(path), "%s-%lld-document_index", sp, k);
                TDS_CHECK(tds_compare_array(&arrays, path, info.document_index, 4, info.document_index_length, 1, shape1, why,
                                            sizeof(why)), "%s", why);
                int64_t shape2[2] = {info.num_samples + 1, 2};
                snprintf(path, sizeof(path), "%s-%lld-sample_index", sp, k);
                TDS_CHECK(tds_compare_array(&arrays, path, info.sample_index, info.sample_index_itemsize,
                                            2 * (info.num_samples + 1), 2, shape2, why, sizeof(why)), "%s", why);
                int64_t shape3[1] = {info.num_samples};
                snprintf(path, sizeof(path), "%s-%lld-shuffle_index", sp, k);
                TDS_CHECK(tds_compare_array(&arrays, path, info.shuffle_index, info.shuffle_index_itemsize, info.num_samples, 1,
                                            shape3, why, sizeof(why)), "%s", why);
                /* The .npy files megatron.h writes are numpy.save's bytes. */
                EXPECT_OK(mt_gpt_dataset_save_indices(g, tmp, "x-", err), err);
                const char* names[3] = {"document_index", "sample_index", "shuffle_index"};
                for (int i = 0; i < 3; i++) {
                    char mine[512];
                    snprintf(mine, sizeof(mine), "%s/x-%s.npy", tmp, names[i]);
                    snprintf(path, sizeof(path), "%s-%lld-%s", sp, k, names[i]);
                    tds_npy a;
                    size_t want_size = 0, got_size = 0;
                    const char* want = tds_case_array(&arrays, path, &a, &want_size);
                    char* got = test_read_file(mine, &got_size);
                    int same = want && got && got_size == want_size && memcmp(got, want, got_size) == 0;
                    free(got);
                    TDS_CHECK(same, "%s differs from numpy.save's %s", mine, path);
                }
            } else if (strcmp(kind, "tokens") == 0) {
                tds_npy a;
                snprintf(path, sizeof(path), "%s-tokens", sp);
                int bad = !tds_case_array(&arrays, path, &a, NULL) || a.ndim != 2 || a.shape[1] != seq_length + 1;
                TDS_CHECK(!bad, "no array %s", path);
                char* p = l + used;
                for (int64_t r = 0; r < a.shape[0]; r++) {
                    int64_t idx = strtoll(p, &p, 10);
                    mt_status st = mt_gpt_data_get(d, s, idx, tokens, err);
                    int same = st == MT_OK;
                    int64_t c = 0;
                    for (; same && c <= seq_length; c++) same = tokens[c] == tds_npy_get(&a, r * (seq_length + 1) + c);
                    TDS_CHECK(same, "%s sample %lld: %s", sp, (long long)idx,
                              st != MT_OK ? err->message : "tokens differ from numpy");
                }
                /* One past the end is an error, not a crash. */
                int64_t size = mt_gpt_data_num_samples(d, s);
                TDS_CHECK(mt_gpt_data_get(d, s, size, tokens, err) == MT_ERR_RANGE, "index %lld accepted",
                          (long long)size);
            }
        }
    }
#undef TDS_CHECK
out:
    free(tokens);
    free(meta);
    free(arrays.blob);
    tds_rmdir(tmp);
    mt_gpt_data_close(d);
    return result;
}

static test_result test_dataset_megatron_vectors(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    char* text = test_read_file(TDS_ROOT "/cases.txt", NULL);
    EXPECT(text, "cannot read cases.txt");
    int cases = 0;
    char* save = NULL;
    for (char* line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (!*line) continue;
        test_result r = tds_check_case(line);
        if (r != TEST_PASS) {
            free(text);
            return r;
        }
        cases++;
    }
    free(text);
    EXPECT(cases >= 10, "only %d cases", cases);
    return TEST_PASS;
}

/* ---- reader ------------------------------------------------------------------------------------ */

static test_result test_dataset_reader(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    mt_indexed_dataset* ds = NULL;
    mt_error err_, *err = &err_;
    EXPECT_OK(mt_indexed_dataset_open(&ds, TDS_ROOT "/datasets/sent", err), err);
    EXPECT(mt_indexed_dataset_dtype(ds) == MT_DTYPE_UINT16, "dtype %d", mt_indexed_dataset_dtype(ds));
    EXPECT(mt_indexed_dataset_num_documents(ds) == 300, "documents %lld",
           (long long)mt_indexed_dataset_num_documents(ds));
    int64_t n = mt_indexed_dataset_num_sequences(ds), total = 0, empty_docs = 0;
    for (int64_t k = 0; k < 300; k++)
        empty_docs += mt_indexed_dataset_document_start(ds, k) == mt_indexed_dataset_document_start(ds, k + 1);
    EXPECT(empty_docs > 0, "the sentence-level set has empty documents");
    EXPECT(mt_indexed_dataset_document_start(ds, 300) == n, "last document entry is N");
    /* Every token through the reader equals the .bin read directly. */
    size_t bin_size = 0;
    char* bin = test_read_file(TDS_ROOT "/datasets/sent.bin", &bin_size);
    EXPECT(bin, "cannot read sent.bin");
    int32_t buf[64];
    for (int64_t i = 0; i < n; i++) {
        int64_t len = mt_indexed_dataset_sequence_length(ds, i);
        EXPECT(len >= 0 && len <= 64, "length %lld", (long long)len);
        EXPECT_OK(mt_indexed_dataset_read(ds, i, 0, len, buf, err), err);
        for (int64_t j = 0; j < len; j++) {
            uint16_t v;
            memcpy(&v, bin + 2 * (total + j), 2);
            EXPECT(buf[j] == v, "sequence %lld token %lld", (long long)i, (long long)j);
        }
        total += len;
    }
    free(bin);
    EXPECT(total == mt_indexed_dataset_num_tokens(ds) && (size_t)total * 2 == bin_size, "token count");
    EXPECT(mt_indexed_dataset_read(ds, n, 0, 1, buf, err) == MT_ERR_RANGE, "sequence out of range");
    EXPECT(mt_indexed_dataset_read(ds, 0, mt_indexed_dataset_sequence_length(ds, 0), 1, buf, err) == MT_ERR_RANGE,
           "token out of range");
    mt_indexed_dataset_close(ds);
    return TEST_PASS;
}

/* Writes a corrupted copy of datasets/u16 into dir as "bad" and checks that open refuses it with a
 * one-line message naming the file and containing `needle`. */
static test_result tds_expect_rejected(const char* dir, const char* what, const char* idx, size_t idx_size,
                                       const char* bin, size_t bin_size, const char* needle) {
    char prefix[512], path[600];
    snprintf(prefix, sizeof(prefix), "%s/bad", dir);
    snprintf(path, sizeof(path), "%s.idx", prefix);
    EXPECT(tds_write_file(path, idx, idx_size) == 0, "write %s", path);
    snprintf(path, sizeof(path), "%s.bin", prefix);
    EXPECT(tds_write_file(path, bin, bin_size) == 0, "write %s", path);
    mt_indexed_dataset* ds = NULL;
    mt_error err_, *err = &err_;
    err_.message[0] = 0;
    mt_status st = mt_indexed_dataset_open(&ds, prefix, err);
    EXPECT(st == MT_ERR_FORMAT && ds == NULL, "%s: accepted (status %s)", what, mt_status_name(st));
    EXPECT(strstr(err->message, "/bad.") && strstr(err->message, needle) && !strchr(err->message, '\n'),
           "%s: message \"%s\" should name the file and say \"%s\"", what, err->message, needle);
    return TEST_PASS;
}

static test_result test_dataset_reader_rejects(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    size_t ni = 0, nb = 0;
    char* idx = test_read_file(TDS_ROOT "/datasets/u16.idx", &ni);
    char* bin = test_read_file(TDS_ROOT "/datasets/u16.bin", &nb);
    EXPECT(idx && bin && ni > 100, "cannot read u16");
    char dir[256];
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    char* c = (char*)malloc(ni + 8);
    test_result r = TEST_PASS;
#define TDS_REJECT(what, idx_, ni_, bin_, nb_, needle)                          \
    if (r == TEST_PASS) r = tds_expect_rejected(dir, what, idx_, ni_, bin_, nb_, needle)
    TDS_REJECT("truncated header", idx, 20, bin, nb, "truncated");
    TDS_REJECT("truncated arrays", idx, ni - 8, bin, nb, "truncated");
    memcpy(c, idx, ni); memcpy(c + ni, "\0\0\0\0\0\0\0\0", 8);
    TDS_REJECT("trailing bytes", c, ni + 8, bin, nb, "need");
    memcpy(c, idx, ni); c[0] = 'X';
    TDS_REJECT("wrong magic", c, ni, bin, nb, "magic");
    memcpy(c, idx, ni); c[9] = 2;
    TDS_REJECT("wrong version", c, ni, bin, nb, "version 2");
    memcpy(c, idx, ni); c[17] = 9;
    TDS_REJECT("unknown dtype", c, ni, bin, nb, "dtype code 9");
    memcpy(c, idx, ni); c[17] = 4; /* int32: the pointers no longer match the lengths */
    TDS_REJECT("pointers of another dtype", c, ni, bin, nb, "points to byte");
    memcpy(c, idx, ni); c[34 + 4 * 5] = (char)0xff; c[34 + 4 * 5 + 3] = (char)0xff; /* a negative length */
    TDS_REJECT("negative length", c, ni, bin, nb, "negative length");
    memcpy(c, idx, ni); c[ni - 8] ^= 1; /* the last document entry is no longer N */
    TDS_REJECT("document index end", c, ni, bin, nb, "document index");
    TDS_REJECT("bin too short", idx, ni, bin, nb - 2, ".bin");
#undef TDS_REJECT
    if (r == TEST_PASS) {
        /* a .bin one token too long */
        char* b2 = (char*)malloc(nb + 2);
        memcpy(b2, bin, nb);
        b2[nb] = b2[nb + 1] = 0;
        r = tds_expect_rejected(dir, "bin too long", idx, ni, b2, nb + 2, "bytes, but the index describes");
        free(b2);
    }
    free(c);
    free(idx);
    free(bin);
    tds_rmdir(dir);
    return r;
}

/* ---- writer ------------------------------------------------------------------------------------ */

/* Rewrites the sentence-level dataset document by document through the writer: the files must be
 * byte-identical to the ones the Python (Megatron-format) writer made. */
static test_result test_dataset_writer_roundtrip(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    mt_indexed_dataset* ds = NULL;
    mt_indexed_writer* w = NULL;
    mt_error err_, *err = &err_;
    char dir[256], prefix[300], a[400], b[400];
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(prefix, sizeof(prefix), "%s/copy", dir);
    EXPECT_OK(mt_indexed_dataset_open(&ds, TDS_ROOT "/datasets/sent", err), err);
    EXPECT_OK(mt_indexed_writer_open(&w, prefix, mt_indexed_dataset_dtype(ds), err), err);
    int32_t tokens[512];
    int64_t lengths[16];
    for (int64_t k = 0; k < mt_indexed_dataset_num_documents(ds); k++) {
        int64_t s0 = mt_indexed_dataset_document_start(ds, k), s1 = mt_indexed_dataset_document_start(ds, k + 1), t = 0;
        EXPECT(s1 - s0 <= 16, "document too long for the test buffer");
        for (int64_t s = s0; s < s1; s++) {
            lengths[s - s0] = mt_indexed_dataset_sequence_length(ds, s);
            EXPECT_OK(mt_indexed_dataset_read(ds, s, 0, lengths[s - s0], tokens + t, err), err);
            t += lengths[s - s0];
        }
        EXPECT_OK(mt_indexed_writer_add_document(w, tokens, lengths, s1 - s0, err), err);
    }
    /* A token that does not fit uint16 is refused and changes nothing. */
    int32_t big = 70000;
    int64_t one = 1;
    EXPECT(mt_indexed_writer_add_document(w, &big, &one, 1, err) == MT_ERR_RANGE, "70000 accepted as uint16");
    EXPECT(mt_indexed_writer_num_documents(w) == 300, "documents %lld", (long long)mt_indexed_writer_num_documents(w));
    EXPECT_OK(mt_indexed_writer_finalize(w, err), err);
    mt_indexed_dataset_close(ds);
    snprintf(a, sizeof(a), "%s.bin", prefix);
    EXPECT(tds_files_equal(a, TDS_ROOT "/datasets/sent.bin"), "rewritten .bin differs");
    snprintf(a, sizeof(a), "%s.idx", prefix);
    EXPECT(tds_files_equal(a, TDS_ROOT "/datasets/sent.idx"), "rewritten .idx differs");

    /* int32 tokens, an empty first document, a zero-length sequence. */
    snprintf(b, sizeof(b), "%s/i32", dir);
    EXPECT_OK(mt_indexed_writer_open(&w, b, MT_DTYPE_INT32, err), err);
    int32_t t2[5] = {100000, -5, 7, 2000000000, 3};
    int64_t l2[3] = {2, 0, 3};
    EXPECT_OK(mt_indexed_writer_add_document(w, NULL, NULL, 0, err), err);
    EXPECT_OK(mt_indexed_writer_add_document(w, t2, l2, 3, err), err);
    EXPECT_OK(mt_indexed_writer_finalize(w, err), err);
    EXPECT_OK(mt_indexed_dataset_open(&ds, b, err), err);
    EXPECT(mt_indexed_dataset_num_sequences(ds) == 3 && mt_indexed_dataset_num_documents(ds) == 2 &&
               mt_indexed_dataset_num_tokens(ds) == 5,
           "counts");
    EXPECT(mt_indexed_dataset_document_start(ds, 0) == 0 && mt_indexed_dataset_document_start(ds, 1) == 0 &&
               mt_indexed_dataset_document_start(ds, 2) == 3,
           "document index");
    int32_t r3[3];
    EXPECT_OK(mt_indexed_dataset_read(ds, 2, 0, 3, r3, err), err);
    EXPECT(r3[0] == 7 && r3[1] == 2000000000 && r3[2] == 3, "tokens");
    mt_indexed_dataset_close(ds);
    EXPECT(tds_rmdir(dir) == 4, "expected exactly the two datasets' four files");
    return TEST_PASS;
}

/* The writer's token buffer starts at 64 KiB and grows to 16 MiB, flushing whenever it is full, and
 * the .idx goes through the same buffer: a 24 MB dataset (int32 tokens, documents of 1 to 70,000
 * tokens over 1-3 sequences: every growth step and several flushes) and a dataset of 12,000 one-token
 * sequences (a 24 KB .bin, so the buffer stays 64 KiB, and a 240 KB .idx that must be flushed
 * through it) read back token by token, sequence by sequence and document by document. */
static test_result test_dataset_writer_large(void) {
    mt_error err_, *err = &err_;
    char dir[256], big[300], many[300];
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(big, sizeof(big), "%s/big", dir);
    snprintf(many, sizeof(many), "%s/many", dir);
    const int64_t total = 6000000;
    std::vector<int32_t> tokens((size_t)total);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (auto& t : tokens) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        t = (int32_t)(x >> 33);
    }
    std::vector<int64_t> seq_len, doc_start; /* what was written, to compare */
    mt_indexed_writer* w = NULL;
    EXPECT_OK(mt_indexed_writer_open(&w, big, MT_DTYPE_INT32, err), err);
    for (int64_t at = 0; at < total;) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int64_t n = 1 + (int64_t)((x >> 33) % 70000);
        if (n > total - at) n = total - at;
        int64_t parts[3] = {n, 0, 0}, np = 1;
        if (n >= 3 && (x >> 20) % 2) { /* three sequences */
            parts[0] = n / 3;
            parts[1] = n / 3;
            parts[2] = n - 2 * (n / 3);
            np = 3;
        }
        doc_start.push_back((int64_t)seq_len.size());
        for (int64_t k = 0; k < np; k++) seq_len.push_back(parts[k]);
        EXPECT_OK(mt_indexed_writer_add_document(w, tokens.data() + at, parts, np, err), err);
        at += n;
    }
    EXPECT_OK(mt_indexed_writer_finalize(w, err), err);
    mt_indexed_dataset* ds = NULL;
    EXPECT_OK(mt_indexed_dataset_open(&ds, big, err), err);
    EXPECT(mt_indexed_dataset_num_tokens(ds) == total && mt_indexed_dataset_num_sequences(ds) == (int64_t)seq_len.size() &&
               mt_indexed_dataset_num_documents(ds) == (int64_t)doc_start.size(),
           "counts: %lld tokens, %lld sequences, %lld documents", (long long)mt_indexed_dataset_num_tokens(ds),
           (long long)mt_indexed_dataset_num_sequences(ds), (long long)mt_indexed_dataset_num_documents(ds));
    std::vector<int32_t> got(70000);
    int64_t at = 0;
    for (int64_t s = 0; s < (int64_t)seq_len.size(); s++) {
        EXPECT(mt_indexed_dataset_sequence_length(ds, s) == seq_len[(size_t)s], "sequence %lld's length", (long long)s);
        EXPECT_OK(mt_indexed_dataset_read(ds, s, 0, seq_len[(size_t)s], got.data(), err), err);
        EXPECT(memcmp(got.data(), tokens.data() + at, sizeof(int32_t) * (size_t)seq_len[(size_t)s]) == 0,
               "sequence %lld's tokens", (long long)s);
        at += seq_len[(size_t)s];
    }
    for (size_t d = 0; d < doc_start.size(); d++)
        EXPECT(mt_indexed_dataset_document_start(ds, (int64_t)d) == doc_start[d], "document %zu's start", d);
    mt_indexed_dataset_close(ds);

    EXPECT_OK(mt_indexed_writer_open(&w, many, MT_DTYPE_UINT16, err), err);
    for (int32_t k = 0; k < 12000; k++) {
        int32_t t = k % 65536;
        int64_t one = 1;
        EXPECT_OK(mt_indexed_writer_add_document(w, &t, &one, 1, err), err);
    }
    EXPECT_OK(mt_indexed_writer_finalize(w, err), err);
    EXPECT_OK(mt_indexed_dataset_open(&ds, many, err), err);
    EXPECT(mt_indexed_dataset_num_sequences(ds) == 12000 && mt_indexed_dataset_num_documents(ds) == 12000,
           "12000 one-token documents");
    for (int64_t s = 0; s < 12000; s++) {
        int32_t t = -1;
        EXPECT_OK(mt_indexed_dataset_read(ds, s, 0, 1, &t, err), err);
        EXPECT(t == (int32_t)s && mt_indexed_dataset_document_start(ds, s) == s, "document %lld", (long long)s);
    }
    mt_indexed_dataset_close(ds);
    EXPECT(tds_rmdir(dir) == 4, "expected exactly the two datasets' four files");
    return TEST_PASS;
}

static test_result test_dataset_writer_abort(void) {
    char dir[256], prefix[300];
    mt_indexed_writer* w = NULL;
    mt_error err_, *err = &err_;
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(prefix, sizeof(prefix), "%s/aborted", dir);
    EXPECT_OK(mt_indexed_writer_open(&w, prefix, MT_DTYPE_UINT16, err), err);
    int32_t t[3] = {1, 2, 3};
    int64_t l = 3;
    EXPECT_OK(mt_indexed_writer_add_document(w, t, &l, 1, err), err);
    mt_indexed_writer_abort(w);
    int left = tds_rmdir(dir);
    EXPECT(left == 0, "abort left %d files behind", left);
    /* A writer whose directory does not exist fails cleanly. */
    EXPECT(mt_indexed_writer_open(&w, "/nonexistent-dir/x", MT_DTYPE_UINT16, err) == MT_ERR_IO && !w,
           "open in a missing directory");
    EXPECT(strstr(err->message, "/nonexistent-dir/x.bin"), "message \"%s\" names the file", err->message);
    EXPECT(mt_indexed_writer_open(&w, "/tmp/x", MT_DTYPE_FLOAT32, err) == MT_ERR_ARG, "float dtype");
    EXPECT(mt_indexed_dtype_for_vocab(50257) == MT_DTYPE_UINT16 && mt_indexed_dtype_for_vocab(65500) == MT_DTYPE_INT32,
           "optimal dtype");
    return TEST_PASS;
}

/* add_index, as tools/merge_datasets.py uses it. */
static test_result test_dataset_merge(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    char dir[256], prefix[300];
    mt_indexed_writer* w = NULL;
    mt_indexed_dataset *m = NULL, *a = NULL, *b = NULL;
    mt_error err_, *err = &err_;
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(prefix, sizeof(prefix), "%s/merged", dir);
    EXPECT_OK(mt_indexed_writer_open(&w, prefix, MT_DTYPE_UINT16, err), err);
    EXPECT_OK(mt_indexed_writer_add_index(w, TDS_ROOT "/datasets/sent", err), err);
    EXPECT_OK(mt_indexed_writer_add_index(w, TDS_ROOT "/datasets/u16", err), err);
    mt_status st = mt_indexed_writer_add_index(w, TDS_ROOT "/datasets/i32", err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err->message, "dtype"), "int32 into uint16: %s", err->message);
    EXPECT_OK(mt_indexed_writer_finalize(w, err), err);
    EXPECT_OK(mt_indexed_dataset_open(&m, prefix, err), err);
    EXPECT_OK(mt_indexed_dataset_open(&a, TDS_ROOT "/datasets/sent", err), err);
    EXPECT_OK(mt_indexed_dataset_open(&b, TDS_ROOT "/datasets/u16", err), err);
    int64_t na = mt_indexed_dataset_num_sequences(a), da = mt_indexed_dataset_num_documents(a);
    EXPECT(mt_indexed_dataset_num_sequences(m) == na + mt_indexed_dataset_num_sequences(b), "sequences");
    EXPECT(mt_indexed_dataset_num_documents(m) == da + mt_indexed_dataset_num_documents(b), "documents");
    for (int64_t k = 0; k <= mt_indexed_dataset_num_documents(b); k++)
        EXPECT(mt_indexed_dataset_document_start(m, da + k) == na + mt_indexed_dataset_document_start(b, k),
               "document %lld not shifted", (long long)k);
    int32_t x[64], y[64];
    for (int64_t i = 0; i < mt_indexed_dataset_num_sequences(b); i += 97) {
        int64_t len = mt_indexed_dataset_sequence_length(b, i);
        EXPECT(mt_indexed_dataset_sequence_length(m, na + i) == len, "length");
        EXPECT_OK(mt_indexed_dataset_read(b, i, 0, len, x, err), err);
        EXPECT_OK(mt_indexed_dataset_read(m, na + i, 0, len, y, err), err);
        EXPECT(memcmp(x, y, (size_t)len * 4) == 0, "tokens of sequence %lld", (long long)i);
    }
    mt_indexed_dataset_close(m);
    mt_indexed_dataset_close(a);
    mt_indexed_dataset_close(b);
    tds_rmdir(dir);
    return TEST_PASS;
}

/* ---- .npy and data errors ------------------------------------------------------------------------ */

static test_result test_dataset_npy(void) {
    char dir[256], path[300];
    mt_error err_, *err = &err_;
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(path, sizeof(path), "%s/a.npy", dir);
    int64_t data[6] = {1, -2, 3, 4, 5, 6}, shape[2] = {3, 2};
    EXPECT_OK(mt_npy_write(path, "<i8", 2, shape, data, err), err);
    size_t n = 0;
    char* raw = test_read_file(path, &n);
    EXPECT(raw, "read back");
    /* numpy.save's header for this array, including the 21-digit growth padding. */
    const char* want = "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 2), }";
    int ok = n == 128 + 48 && raw[8] == 118 && raw[9] == 0 && memcmp(raw + 10, want, strlen(want)) == 0 &&
             raw[127] == '\n' && memcmp(raw + 128, data, 48) == 0;
    free(raw);
    EXPECT(ok, "unexpected .npy bytes");
    tds_npy a;
    EXPECT(tds_npy_load(path, &a) == 0 && a.ndim == 2 && a.shape[0] == 3 && tds_npy_get(&a, 1) == -2, "reparse");
    tds_npy_free(&a);
    EXPECT(mt_npy_write(path, "<c8", 1, shape, data, err) == MT_ERR_ARG, "complex dtype accepted");
    tds_rmdir(dir);
    return TEST_PASS;
}

static test_result test_dataset_open_errors(void) {
    if (!tds_have_vectors()) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", TDS_ROOT);
    mt_gpt_data* d = NULL;
    mt_error err_, *err = &err_;
    const char* u16 = TDS_ROOT "/datasets/u16";
    const char* small = TDS_ROOT "/datasets/small";
    int64_t ns[3] = {10, 10, 10};
    /* small has 10 sequences: "969,30,1" leaves the valid split [10, 10) with no tokens. */
    EXPECT(mt_gpt_data_open(&d, 1, &small, NULL, "969,30,1", 8, 1234, ns, err) == MT_ERR_CONFIG && !d,
           "an empty split accepted");
    EXPECT(strstr(err->message, "small") && strstr(err->message, "the valid split of --split \"969,30,1\"") &&
               strstr(err->message, "change --split"),
           "the message does not say which split and flag: %s", err->message);
    EXPECT(mt_gpt_data_open(&d, 1, &small, NULL, NULL, 8, 1234, ns, err) == MT_ERR_CONFIG &&
               strstr(err->message, "of --split \"969, 30, 1\""), /* the default, named as such */
           "default split: %s", err->message);
    const char* missing = "/nonexistent/data";
    EXPECT(mt_gpt_data_open(&d, 1, &missing, NULL, NULL, 8, 1234, ns, err) == MT_ERR_IO, "missing file");
    double w = 1.0;
    int64_t none[3] = {-1, -1, -1};
    EXPECT(mt_gpt_data_open(&d, 1, &u16, &w, "1,1,1", 8, 1234, none, err) == MT_ERR_CONFIG,
           "weights without sizes");
    double neg = -1.0;
    EXPECT(mt_gpt_data_open(&d, 1, &u16, &neg, "1,1,1", 8, 1234, ns, err) == MT_ERR_ARG, "negative weight");
    EXPECT(mt_gpt_data_open(&d, 1, &u16, NULL, "1,1,1", 1, 1234, ns, err) == MT_ERR_ARG, "seq length 1");
    /* An empty split ("98,2,0": test) has no samples and refuses get. */
    EXPECT_OK(mt_gpt_data_open(&d, 1, &u16, NULL, "98,2,0", 8, 1234, ns, err), err);
    int32_t t[9];
    EXPECT(mt_gpt_data_num_samples(d, MT_SPLIT_TEST) == 0 && !mt_gpt_data_dataset(d, MT_SPLIT_TEST, 0), "test empty");
    EXPECT(mt_gpt_data_get(d, MT_SPLIT_TEST, 0, t, err) == MT_ERR_RANGE, "get from an empty split");
    EXPECT_OK(mt_gpt_data_get(d, MT_SPLIT_TRAIN, 0, t, err), err);
    mt_gpt_data_close(d);
    /* a float32 dataset (Megatron's reader opens one) is refused when the GPT dataset is built, not at
     * the first sample deep in training (dev/fuzz/fuzz_indexed) */
    char dir[256], path[300];
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    static const unsigned char idx[] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, /* float32 */
                                        1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, /* 1 sequence, 1 document */
                                        4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, /* length 4, pointer 0 */
                                        0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0};
    const float tokens[4] = {1, 2, 3, 4};
    snprintf(path, sizeof(path), "%s/f.idx", dir);
    FILE* f = fopen(path, "wb");
    EXPECT(f && fwrite(idx, 1, sizeof(idx), f) == sizeof(idx) && fclose(f) == 0, "write %s", path);
    snprintf(path, sizeof(path), "%s/f.bin", dir);
    f = fopen(path, "wb");
    EXPECT(f && fwrite(tokens, 4, 4, f) == 4 && fclose(f) == 0, "write %s", path);
    snprintf(path, sizeof(path), "%s/f", dir);
    const char* fp = path;
    int64_t two[3] = {2, 0, 0};
    EXPECT(mt_gpt_data_open(&d, 1, &fp, NULL, "1,0,0", 2, 1234, two, err) == MT_ERR_FORMAT && !d &&
               strstr(err->message, "float32: a GPT dataset needs integer token ids"),
           "float32 dataset: %s", err->message);
    snprintf(path, sizeof(path), "rm -rf %s", dir);
    EXPECT(system(path) == 0, "rm");
    return TEST_PASS;
}

/* ---- prepro/dataset_info ------------------------------------------------------------------------ */

/* print_text of prepro/dataset_info.c: bytes as one quoted line, control characters escaped. */
static std::string tds_quoted(const char* s, size_t n) {
    std::string o = "\"";
    char hex[8];
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') o += "\\n";
        else if (c == '\t') o += "\\t";
        else if (c == '\r') o += "\\r";
        else if (c == '"') o += "\\\"";
        else if (c == '\\') o += "\\\\";
        else if (c < 0x20 || c == 0x7f) { snprintf(hex, sizeof(hex), "\\x%02x", c); o += hex; }
        else o += (char)c;
    }
    return o + "\"";
}

/* The lines of out that start with "train sample ". */
static std::string tds_sample_lines(const char* out) {
    std::string r;
    for (const char* l = out; *l;) {
        const char* e = strchr(l, '\n');
        size_t n = e ? (size_t)(e - l) + 1 : strlen(l);
        if (!strncmp(l, "train sample ", 13)) r.append(l, n);
        l += n;
    }
    return r;
}

/* dataset_info takes the tokenizer flags every other tool takes (--tokenizer-type and its files):
 * a dataset made with a Hugging Face tokenizer.json (preprocess_data, HuggingFaceTokenizer, GPT-2's
 * tokenizer.json under dev/data/tokenizers) is decoded with --tokenizer-type HuggingFaceTokenizer,
 * each sample exactly as the library decodes the same sample; GPT2BPETokenizer's files decode it to
 * the same text; the old --tokenizer-kind still works (with a note) when the r50k rank file is in
 * the shared data; tokenizer files without --tokenizer-type are refused naming it. And on a small
 * corpus the default --split fails with a line that names the split and --split. */
static test_result test_dataset_info_tool(void) {
    if (access("prepro/dataset_info", X_OK) != 0) SKIP("prepro/dataset_info is not built (make all)");
    char dir[256], input[300], prefix[300], ds[320], cmd[2048];
    EXPECT(tds_tmpdir(dir, sizeof(dir)) == 0, "mkdtemp");
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    snprintf(prefix, sizeof(prefix), "%s/corpus", dir);
    snprintf(ds, sizeof(ds), "%s_text_document", prefix);
    std::string jsonl;
    char line[200];
    for (int d = 0; d < 30; d++) {
        snprintf(line, sizeof(line), "{\"text\": \"Document %d: the quick brown fox\\tjumps over the lazy dog \\u00e9\\n\"}\n", d);
        jsonl += line;
    }
    EXPECT(tds_write_file(input, jsonl.data(), jsonl.size()) == 0, "write %s", input);
    mt_error err;
    mt_tokenizer* tok = NULL;
    EXPECT_OK(mt_tokenizer_load_hf(&tok, "dev/data/tokenizers/gpt2", 1, &err), &err);
    const char* inputs[1] = {input};
    mt_preprocess_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.inputs = inputs;
    pc.num_inputs = 1;
    pc.output_prefix = prefix;
    pc.tokenizer = tok;
    pc.append_eod = 1;
    pc.workers = 1;
    EXPECT_OK(mt_preprocess(&pc, NULL, &err), &err);
    /* what dataset_info must print: the first 3 train samples of --split 1,0,0, decoded by the library */
    const int seq = 16;
    std::string want;
    mt_gpt_data* d = NULL;
    const char* dsp = ds;
    int64_t none[3] = {-1, -1, -1};
    EXPECT_OK(mt_gpt_data_open(&d, 1, &dsp, NULL, "1,0,0", seq, 1234, none, &err), &err);
    for (int i = 0; i < 3; i++) {
        int32_t t[seq + 1];
        char* text = NULL;
        size_t len = 0;
        EXPECT_OK(mt_gpt_data_get(d, MT_SPLIT_TRAIN, i, t, &err), &err);
        EXPECT_OK(mt_tokenizer_decode(tok, t, seq + 1, &text, &len, &err), &err);
        snprintf(line, sizeof(line), "train sample %d (%d tokens): ", i, seq + 1);
        want += line + tds_quoted(text, len) + "\n";
        free(text);
    }
    mt_gpt_data_close(d);
    mt_tokenizer_free(tok);
    static char out[65536];
    const char* base = "prepro/dataset_info --data-path %s --seq-length 16 --split 1,0,0 --samples 3 %s";
    const char* variants[2] = {"--tokenizer-type HuggingFaceTokenizer --tokenizer-model dev/data/tokenizers/gpt2",
                               "--tokenizer-type=GPT2BPETokenizer --vocab-file dev/data/gpt2/gpt2-vocab.json "
                               "--merge-file dev/data/gpt2/gpt2-merges.txt"};
    for (int v = 0; v < 2; v++) {
        snprintf(cmd, sizeof(cmd), base, ds, variants[v]);
        int code = test_command_output(cmd, out, sizeof(out));
        std::string got = tds_sample_lines(out);
        EXPECT(code == 0 && got == want, "%s: exit %d\n      got:\n%s      want:\n%s", variants[v], code, got.c_str(), want.c_str());
    }
    char r50k[600];
    const char* shared = getenv("MT_SHARED_DATA");
    snprintf(r50k, sizeof(r50k), "%s/tiktoken/r50k_base.tiktoken", shared && shared[0] ? shared : "../shared/data");
    if (access(r50k, R_OK) == 0) {
        char old_form[700];
        snprintf(old_form, sizeof(old_form), "--tokenizer-model %s --tokenizer-kind r50k_base 2>&1", r50k);
        snprintf(cmd, sizeof(cmd), base, ds, old_form);
        int code = test_command_output(cmd, out, sizeof(out));
        EXPECT(code == 0 && tds_sample_lines(out) == want && strstr(out, "--tokenizer-kind is deprecated"),
               "--tokenizer-kind r50k_base: exit %d, output:\n%s", code, out);
    } else {
        printf("    (no %s: --tokenizer-kind not tried)\n", r50k);
    }
    snprintf(cmd, sizeof(cmd), base, ds, "--tokenizer-model dev/data/tokenizers/gpt2 2>&1");
    int code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code != 0 && strstr(out, "dataset_info: error: tokenizer files given without --tokenizer-type"),
           "a tokenizer file without --tokenizer-type: exit %d, %s", code, out);
    /* 30 documents: the default split's test share (0.1%) is no document */
    snprintf(cmd, sizeof(cmd), "prepro/dataset_info --data-path %s --seq-length 16 2>&1 >/dev/null", ds);
    code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code != 0 && strstr(out, "the test split of --split \"969, 30, 1\" is sequences [30, 30) of 30, 0 tokens") &&
               strstr(out, "change --split") && strchr(out, '\n') == out + strlen(out) - 1,
           "small corpus, default split: exit %d, %s", code, out);
    tds_rmdir(dir);
    return TEST_PASS;
}

static const test_case dataset_tests[] = {
    {"dataset_rng", test_dataset_rng},
    {"dataset_split", test_dataset_split},
    {"dataset_megatron_vectors", test_dataset_megatron_vectors},
    {"dataset_reader", test_dataset_reader},
    {"dataset_reader_rejects", test_dataset_reader_rejects},
    {"dataset_writer_roundtrip", test_dataset_writer_roundtrip},
    {"dataset_writer_large", test_dataset_writer_large},
    {"dataset_writer_abort", test_dataset_writer_abort},
    {"dataset_merge", test_dataset_merge},
    {"dataset_npy", test_dataset_npy},
    {"dataset_open_errors", test_dataset_open_errors},
    {"dataset_info_tool", test_dataset_info_tool},
};

#endif
