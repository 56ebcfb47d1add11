/* tests/test_tensorboard.h — megatron.h section 16: TensorBoard event files (host).
 *
 * CRC-32C against its published check values (RFC 3720 B.4 and "123456789") and the masked form
 * against the tensorboard package's masked_crc32c; each kind of Event against the bytes protobuf
 * itself serialises (the vectors below are printed by `python3 dev/tb_check.py --vectors`, from the
 * tensorboard package's own Event classes); a written file read back by the small reader below,
 * which accounts for every byte: the framing, both CRCs of each record, every protobuf field (an
 * unknown field or a byte left over fails), the values' float32 bits; the queue (nothing but the
 * first record reaches the file before the queue fills or a flush); refused arguments.
 *
 * tensorboard_sample_run writes a synthetic train_gpt log and its event directory with Megatron's
 * names and cadence; with MT_TB_SAMPLE_DIR=<dir> it leaves them there (<dir>/train.log, <dir>/tb)
 * for `python3 dev/tb_check.py <dir>/train.log <dir>/tb`, TensorBoard's own reader. */
#ifndef MT_TEST_TENSORBOARD_H
#define MT_TEST_TENSORBOARD_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "test_common.h"
#include "test_dataset.h" /* tds_tmpdir, tds_rmdir */

/* ---- a reader that accounts for every byte ---------------------------------------------------- */

typedef struct {
    double wall_time;
    int64_t step;
    char file_version[32];
    char tag[256];
    int has_value; /* simple_value present */
    float value;
    int has_tensor;
    int64_t dtype, dim_size, dims;
    char text[1024];
    char plugin[32];
} ttb_event;

static int ttb_varint(const unsigned char** p, const unsigned char* end, uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*p >= end) return 0;
        unsigned char b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 1;
    }
    return 0;
}

/* Reads one field's key and, for a length-delimited one, its payload bounds; 0 on malformed bytes. */
static int ttb_field(const unsigned char** p, const unsigned char* end, int* field, int* wire, const unsigned char** sub,
                     size_t* sub_n) {
    uint64_t key, n;
    if (!ttb_varint(p, end, &key)) return 0;
    *field = (int)(key >> 3);
    *wire = (int)(key & 7);
    if (*wire != 2) return 1;
    if (!ttb_varint(p, end, &n) || n > (uint64_t)(end - *p)) return 0;
    *sub = *p;
    *sub_n = (size_t)n;
    *p += n;
    return 1;
}

static void ttb_copy_string(char* dst, size_t cap, const unsigned char* s, size_t n) {
    if (n >= cap) n = cap - 1;
    memcpy(dst, s, n);
    dst[n] = 0;
}

/* Each parser returns NULL, or what was wrong. Only the fields megatron.h writes are known. */
static const char* ttb_parse_dim(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    while (p < end) {
        int f, w; const unsigned char* s; size_t n; uint64_t v;
        if (!ttb_field(&p, end, &f, &w, &s, &n) || f != 1 || w != 0 || !ttb_varint(&p, end, &v)) return "Dim field";
        e->dim_size = (int64_t)v;
    }
    return NULL;
}
static const char* ttb_parse_shape(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    while (p < end) {
        int f, w; const unsigned char* s; size_t n;
        if (!ttb_field(&p, end, &f, &w, &s, &n) || f != 2 || w != 2) return "TensorShapeProto field";
        e->dims++;
        const char* why = ttb_parse_dim(s, s + n, e);
        if (why) return why;
    }
    return NULL;
}
static const char* ttb_parse_tensor(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    while (p < end) {
        int f, w; const unsigned char* s; size_t n; uint64_t v;
        if (!ttb_field(&p, end, &f, &w, &s, &n)) return "TensorProto bytes";
        if (f == 1 && w == 0 && ttb_varint(&p, end, &v)) e->dtype = (int64_t)v;
        else if (f == 2 && w == 2) { const char* why = ttb_parse_shape(s, s + n, e); if (why) return why; }
        else if (f == 8 && w == 2) ttb_copy_string(e->text, sizeof(e->text), s, n);
        else return "TensorProto field";
    }
    return NULL;
}
static const char* ttb_parse_metadata(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    while (p < end) { /* SummaryMetadata { plugin_data (1) { plugin_name (1) } } */
        int f, w; const unsigned char* s; size_t n;
        if (!ttb_field(&p, end, &f, &w, &s, &n) || f != 1 || w != 2) return "SummaryMetadata field";
        const unsigned char* q = s;
        while (q < s + n) {
            int f2, w2; const unsigned char* s2; size_t n2;
            if (!ttb_field(&q, s + n, &f2, &w2, &s2, &n2) || f2 != 1 || w2 != 2) return "PluginData field";
            ttb_copy_string(e->plugin, sizeof(e->plugin), s2, n2);
        }
    }
    return NULL;
}
static const char* ttb_parse_value(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    while (p < end) {
        int f, w; const unsigned char* s; size_t n;
        if (!ttb_field(&p, end, &f, &w, &s, &n)) return "Summary.Value bytes";
        if (f == 1 && w == 2) ttb_copy_string(e->tag, sizeof(e->tag), s, n);
        else if (f == 2 && w == 5) {
            if (end - p < 4) return "simple_value truncated";
            memcpy(&e->value, p, 4);
            p += 4;
            e->has_value = 1;
        } else if (f == 8 && w == 2) {
            e->has_tensor = 1;
            const char* why = ttb_parse_tensor(s, s + n, e);
            if (why) return why;
        } else if (f == 9 && w == 2) {
            const char* why = ttb_parse_metadata(s, s + n, e);
            if (why) return why;
        } else return "Summary.Value field";
    }
    return NULL;
}
static const char* ttb_parse_event(const unsigned char* p, const unsigned char* end, ttb_event* e) {
    memset(e, 0, sizeof(*e));
    int values = 0;
    while (p < end) {
        int f, w; const unsigned char* s; size_t n; uint64_t v;
        if (!ttb_field(&p, end, &f, &w, &s, &n)) return "Event bytes";
        if (f == 1 && w == 1) {
            if (end - p < 8) return "wall_time truncated";
            memcpy(&e->wall_time, p, 8);
            p += 8;
        } else if (f == 2 && w == 0 && ttb_varint(&p, end, &v)) e->step = (int64_t)v;
        else if (f == 3 && w == 2) ttb_copy_string(e->file_version, sizeof(e->file_version), s, n);
        else if (f == 5 && w == 2) { /* Summary { value (1) } */
            const unsigned char* q = s;
            while (q < s + n) {
                int f2, w2; const unsigned char* s2; size_t n2;
                if (!ttb_field(&q, s + n, &f2, &w2, &s2, &n2) || f2 != 1 || w2 != 2) return "Summary field";
                values++;
                const char* why = ttb_parse_value(s2, s2 + n2, e);
                if (why) return why;
            }
        } else return "Event field";
    }
    return values > 1 ? "more than one value in a Summary" : NULL;
}

/* Reads a whole event file: every record's framing and CRCs, then its Event. Returns the number of
 * events (up to max), or -1 with why filled. */
static int ttb_read_file(const char* path, ttb_event* events, int max, char* why, size_t why_n) {
    size_t size = 0;
    unsigned char* data = (unsigned char*)test_read_file(path, &size);
    if (!data) { snprintf(why, why_n, "cannot read %.200s", path); return -1; }
    size_t at = 0;
    int count = 0;
    while (at < size) {
        uint64_t n;
        uint32_t crc_n, crc_d;
        if (size - at < 12) { snprintf(why, why_n, "record header truncated at byte %zu", at); count = -1; break; }
        memcpy(&n, data + at, 8);
        memcpy(&crc_n, data + at + 8, 4);
        if (crc_n != mt_tb_masked_crc32c(data + at, 8)) { snprintf(why, why_n, "length CRC at byte %zu", at); count = -1; break; }
        if (n > size - at - 16) { snprintf(why, why_n, "record at byte %zu runs past the end", at); count = -1; break; }
        memcpy(&crc_d, data + at + 12 + n, 4);
        if (crc_d != mt_tb_masked_crc32c(data + at + 12, (size_t)n)) {
            snprintf(why, why_n, "data CRC at byte %zu", at);
            count = -1;
            break;
        }
        if (count == max) { snprintf(why, why_n, "more than %d events", max); count = -1; break; }
        const char* bad = ttb_parse_event(data + at + 12, data + at + 12 + n, &events[count]);
        if (bad) { snprintf(why, why_n, "event %d: %s", count, bad); count = -1; break; }
        count++;
        at += 16 + (size_t)n;
    }
    free(data);
    return count;
}

/* The event files in dir (names into names[], sorted), or -1. */
static int ttb_list(const char* dir, char names[][512], int max) {
    DIR* d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, "tfevents") && n < max) snprintf(names[n++], 512, "%.200s/%.300s", dir, e->d_name);
    closedir(d);
    for (int i = 1; i < n; i++) /* insertion sort: a handful of names */
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char t[512];
            memcpy(t, names[j], 512); memcpy(names[j], names[j - 1], 512); memcpy(names[j - 1], t, 512);
        }
    return n;
}

static double ttb_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + (double)tv.tv_usec * 1e-6;
}

/* ---- tests ------------------------------------------------------------------------------------ */

static test_result test_tensorboard_crc32c(void) {
    unsigned char zeros[32], ones[32], ascending[32];
    for (int i = 0; i < 32; i++) { zeros[i] = 0; ones[i] = 0xff; ascending[i] = (unsigned char)i; }
    /* RFC 3720 B.4 (iSCSI) and the common check value; masked: tensorboard's masked_crc32c */
    struct { const void* data; size_t n; uint32_t crc, masked; } v[] = {
        {"123456789", 9, 0xe3069283u, 0xc78ab0e5u}, {zeros, 32, 0x8a9136aau, 0x0fd7fffau},
        {ones, 32, 0x62a8ab43u, 0xf909b029u},      {ascending, 32, 0x46dd794eu, 0x951f7892u},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        EXPECT(mt_tb_crc32c(v[i].data, v[i].n) == v[i].crc, "vector %zu: crc32c %08x, expected %08x", i,
               mt_tb_crc32c(v[i].data, v[i].n), v[i].crc);
        EXPECT(mt_tb_masked_crc32c(v[i].data, v[i].n) == v[i].masked, "vector %zu: masked %08x, expected %08x", i,
               mt_tb_masked_crc32c(v[i].data, v[i].n), v[i].masked);
    }
    uint64_t length = 27; /* a record's length word: masked_crc32c(struct.pack("<Q", 27)) */
    EXPECT(mt_tb_masked_crc32c(&length, 8) == 0x139e0d1au, "length word");
    return TEST_PASS;
}

static test_result test_tensorboard_event_bytes(void) {
    /* protobuf's serialisation of Event(...) at wall_time 1700000000.25 (dev/tb_check.py --vectors) */
    static const unsigned char file_version[] = {
        0x09, 0x00, 0x00, 0x10, 0x40, 0xfc, 0x54, 0xd9, 0x41, 0x1a, 0x0d, 0x62, 0x72, 0x61, 0x69, 0x6e,
        0x2e, 0x45, 0x76, 0x65, 0x6e, 0x74, 0x3a, 0x32};
    static const unsigned char scalar[] = { /* step 300, "lm loss" = 2.5 */
        0x09, 0x00, 0x00, 0x10, 0x40, 0xfc, 0x54, 0xd9, 0x41, 0x10, 0xac, 0x02, 0x2a, 0x10, 0x0a, 0x0e,
        0x0a, 0x07, 0x6c, 0x6d, 0x20, 0x6c, 0x6f, 0x73, 0x73, 0x15, 0x00, 0x00, 0x20, 0x40};
    static const unsigned char scalar_zero[] = { /* step 0 (left out), "x" = 0.0 (kept: a oneof) */
        0x09, 0x00, 0x00, 0x10, 0x40, 0xfc, 0x54, 0xd9, 0x41, 0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, 0x78,
        0x15, 0x00, 0x00, 0x00, 0x00};
    static const unsigned char text[] = { /* step 7, add_text("lr", "6e-4") */
        0x09, 0x00, 0x00, 0x10, 0x40, 0xfc, 0x54, 0xd9, 0x41, 0x10, 0x07, 0x2a, 0x2d, 0x0a, 0x2b, 0x0a,
        0x0f, 0x6c, 0x72, 0x2f, 0x74, 0x65, 0x78, 0x74, 0x5f, 0x73, 0x75, 0x6d, 0x6d, 0x61, 0x72, 0x79,
        0x42, 0x0e, 0x08, 0x07, 0x12, 0x04, 0x12, 0x02, 0x08, 0x01, 0x42, 0x04, 0x36, 0x65, 0x2d, 0x34,
        0x4a, 0x08, 0x0a, 0x06, 0x0a, 0x04, 0x74, 0x65, 0x78, 0x74};
    struct { const unsigned char* bytes; size_t n; int64_t step; int kind; const char* tag; float value; const char* text; } v[] = {
        {file_version, sizeof(file_version), 0, MT__TB_FILE_VERSION, NULL, 0.0f, NULL},
        {scalar, sizeof(scalar), 300, MT__TB_SCALAR, "lm loss", 2.5f, NULL},
        {scalar_zero, sizeof(scalar_zero), 0, MT__TB_SCALAR, "x", 0.0f, NULL},
        {text, sizeof(text), 7, MT__TB_TEXT, "lr/text_summary", 0.0f, "6e-4"},
    };
    unsigned char out[256];
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        size_t n = mt__tb_event(NULL, 1700000000.25, v[i].step, v[i].kind, v[i].tag, v[i].value, v[i].text);
        EXPECT(n == v[i].n, "vector %zu: %zu bytes, protobuf has %zu", i, n, v[i].n);
        memset(out, 0xee, sizeof(out));
        size_t written = mt__tb_event(out, 1700000000.25, v[i].step, v[i].kind, v[i].tag, v[i].value, v[i].text);
        EXPECT(written == n, "vector %zu: wrote %zu bytes, sized %zu", i, written, n);
        for (size_t k = 0; k < n; k++)
            EXPECT(out[k] == v[i].bytes[k], "vector %zu: byte %zu is %02x, protobuf has %02x", i, k, out[k], v[i].bytes[k]);
        EXPECT(out[n] == 0xee, "vector %zu: wrote past its size", i);
    }
    char tag[201], long_text[5000]; /* 200 and 4999 bytes: two-byte lengths */
    memset(tag, 'a', sizeof(tag) - 1); tag[sizeof(tag) - 1] = 0;
    memset(long_text, 'b', sizeof(long_text) - 1); long_text[sizeof(long_text) - 1] = 0;
    size_t n = mt__tb_event(NULL, 1.0, 1, MT__TB_TEXT, tag, 0.0f, long_text);
    unsigned char* big = (unsigned char*)malloc(n);
    EXPECT(big != NULL, "malloc");
    EXPECT(mt__tb_event(big, 1.0, 1, MT__TB_TEXT, tag, 0.0f, long_text) == n, "long text size");
    ttb_event e;
    const char* bad = ttb_parse_event(big, big + n, &e);
    free(big);
    EXPECT(!bad, "long text: %s", bad);
    EXPECT(strlen(e.tag) == sizeof(tag) - 1 && e.has_tensor && e.dtype == 7 && e.dims == 1 && e.dim_size == 1 &&
               !strcmp(e.plugin, "text") && strlen(e.text) == sizeof(e.text) - 1, "long text read back");
    return TEST_PASS;
}

static test_result test_tensorboard_file(void) {
    char root[256], dir[320];
    EXPECT(tds_tmpdir(root, sizeof(root)) == 0, "mkdtemp");
    snprintf(dir, sizeof(dir), "%s/runs", root); /* created by mt_tb_open */
    mt_error err;
    mt_tb_writer* w = NULL;
    double t0 = ttb_now();
    EXPECT_OK(mt_tb_open(&w, dir, 1000, &err), &err);
    const char* path = mt_tb_path(w);
    const char* name = strrchr(path, '/') + 1;
    EXPECT(!strncmp(name, "events.out.tfevents.", 20) && strlen(name) > 31 && name[30] == '.', "file name %s", name);
    for (int k = 20; k < 30; k++) EXPECT(name[k] >= '0' && name[k] <= '9', "file name %s: 10-digit time", name);
    /* random values, steps up to 2^40 (a 6-byte varint), and a text */
    enum { N = 40 };
    double values[N];
    int64_t steps[N];
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    char tag[64];
    for (int i = 0; i < N; i++) {
        seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
        values[i] = ((double)(seed >> 11) / 9007199254740992.0 - 0.5) * pow(10.0, (double)(i % 13) - 6);
        steps[i] = i % 7 == 0 ? (int64_t)1 << 40 : (int64_t)i * 37;
        snprintf(tag, sizeof(tag), "scalar %d", i % 5);
        EXPECT_OK(mt_tb_scalar(w, tag, values[i], steps[i], &err), &err);
    }
    EXPECT_OK(mt_tb_text(w, "data_path", "['0.7', 'a_text_document', '0.3', 'b_text_document']", 12, &err), &err);
    EXPECT_OK(mt_tb_scalar_pair(w, "lm loss", 3.25, 5, 160, &err), &err);
    /* nothing but the first record is on disk before the flush (the queue holds 1000) */
    ttb_event events[64];
    char why[256];
    EXPECT(ttb_read_file(path, events, 64, why, sizeof(why)) == 1, "before the flush: %s", why);
    EXPECT(!strcmp(events[0].file_version, "brain.Event:2") && events[0].step == 0, "first record: file_version");
    EXPECT_OK(mt_tb_flush(w, &err), &err);
    char kept[512];
    snprintf(kept, sizeof(kept), "%s", path);
    EXPECT_OK(mt_tb_close(w, &err), &err);
    double t1 = ttb_now();

    int n = ttb_read_file(kept, events, 64, why, sizeof(why));
    EXPECT(n == 1 + N + 1 + 2, "read %d events: %s", n, why);
    for (int i = 0; i < n; i++)
        EXPECT(events[i].wall_time >= t0 - 1e-3 && events[i].wall_time <= t1 + 1e-3, "event %d: wall_time %f outside [%f, %f]",
               i, events[i].wall_time, t0, t1);
    for (int i = 0; i < N; i++) {
        const ttb_event* e = &events[1 + i];
        float expected = (float)values[i];
        snprintf(tag, sizeof(tag), "scalar %d", i % 5);
        EXPECT(!strcmp(e->tag, tag) && e->step == steps[i] && e->has_value && !e->has_tensor, "scalar %d: fields", i);
        EXPECT(memcmp(&e->value, &expected, 4) == 0, "scalar %d: %.9g, wrote %.9g", i, e->value, expected);
    }
    const ttb_event* t = &events[1 + N];
    EXPECT(!strcmp(t->tag, "data_path/text_summary") && t->step == 12 && t->has_tensor && !t->has_value && t->dtype == 7 &&
               t->dims == 1 && t->dim_size == 1 && !strcmp(t->plugin, "text") &&
               !strcmp(t->text, "['0.7', 'a_text_document', '0.3', 'b_text_document']"),
           "text event: tag %s step %lld dtype %lld plugin %s text %s", t->tag, (long long)t->step, (long long)t->dtype,
           t->plugin, t->text);
    EXPECT(!strcmp(events[n - 2].tag, "lm loss") && events[n - 2].step == 5 && events[n - 2].value == 3.25f, "pair: iteration");
    EXPECT(!strcmp(events[n - 1].tag, "lm loss vs samples") && events[n - 1].step == 160 && events[n - 1].value == 3.25f,
           "pair: vs samples");

    /* the reader is not blind: one flipped byte anywhere in a record is refused */
    size_t size = 0;
    unsigned char* data = (unsigned char*)test_read_file(kept, &size);
    EXPECT(data != NULL, "read back");
    for (size_t at = 0; at < size; at += 37) {
        data[at] ^= 0x20;
        FILE* f = fopen(kept, "wb");
        int ok = f && fwrite(data, 1, size, f) == size;
        if (f) fclose(f);
        data[at] ^= 0x20;
        if (!ok) { free(data); EXPECT(0, "rewrite %s", kept); }
        if (ttb_read_file(kept, events, 64, why, sizeof(why)) >= 0) { free(data); EXPECT(0, "byte %zu flipped: not noticed", at); }
    }
    free(data);

    /* the queue: with queue size 2 the third event is on disk without a flush; a second writer in
     * the same directory in the same second gets a new name */
    mt_tb_writer* a = NULL;
    mt_tb_writer* b = NULL;
    EXPECT_OK(mt_tb_open(&a, dir, 2, &err), &err);
    EXPECT_OK(mt_tb_open(&b, dir, 2, &err), &err);
    EXPECT(strcmp(mt_tb_path(a), mt_tb_path(b)) != 0, "two writers, one file name %s", mt_tb_path(a));
    EXPECT_OK(mt_tb_scalar(a, "x", 1.0, 1, &err), &err);
    EXPECT(ttb_read_file(mt_tb_path(a), events, 64, why, sizeof(why)) == 1, "one pending: %s", why);
    EXPECT_OK(mt_tb_scalar(a, "x", 2.0, 2, &err), &err);
    EXPECT(ttb_read_file(mt_tb_path(a), events, 64, why, sizeof(why)) == 3, "queue full, flushed: %s", why);
    EXPECT_OK(mt_tb_close(a, &err), &err);
    EXPECT_OK(mt_tb_close(b, &err), &err);
    EXPECT_OK(mt_tb_close(NULL, &err), &err);
    char names[8][512];
    EXPECT(ttb_list(dir, names, 8) == 3, "three event files in %s", dir);
    tds_rmdir(dir);
    tds_rmdir(root);
    return TEST_PASS;
}

static test_result test_tensorboard_refused(void) {
    mt_error err;
    mt_tb_writer* w = (mt_tb_writer*)&err; /* must come back NULL */
    EXPECT(mt_tb_open(&w, "/tmp", 0, &err) == MT_ERR_ARG && !w, "queue size 0");
    EXPECT(strstr(err.message, "queue size 0"), "message: %s", err.message);
    EXPECT(mt_tb_open(&w, "", 10, &err) == MT_ERR_ARG && !w, "empty directory");
    char root[256], file[320], under[400];
    EXPECT(tds_tmpdir(root, sizeof(root)) == 0, "mkdtemp");
    snprintf(file, sizeof(file), "%s/plain_file", root);
    FILE* f = fopen(file, "w");
    EXPECT(f != NULL, "create %s", file);
    fclose(f);
    snprintf(under, sizeof(under), "%s/tb", file); /* a directory under a file cannot exist */
    EXPECT(mt_tb_open(&w, under, 10, &err) == MT_ERR_IO && !w, "directory under a file");
    EXPECT(strstr(err.message, "cannot create the TensorBoard directory") && strstr(err.message, under), "message: %s",
           err.message);
    tds_rmdir(root);
    return TEST_PASS;
}

/* A synthetic train_gpt run: 6 iterations, --log-interval 2, --tensorboard-log-interval 1, a
 * validation at 4 and at 6, Megatron's names through the writer, and the log lines train_gpt
 * prints for it. Checked here by the reader; dev/tb_check.py checks it with TensorBoard's reader. */
static test_result test_tensorboard_sample_run(void) {
    const char* keep = getenv("MT_TB_SAMPLE_DIR");
    char root[256], tb[320], log_path[320];
    if (keep && *keep) {
        snprintf(root, sizeof(root), "%s", keep);
        EXPECT(mt_make_directories(root) == 0, "mkdir %s", root);
    } else {
        EXPECT(tds_tmpdir(root, sizeof(root)) == 0, "mkdtemp");
    }
    snprintf(tb, sizeof(tb), "%s/tb", root);
    snprintf(log_path, sizeof(log_path), "%s/train.log", root);
    FILE* log = fopen(log_path, "w");
    EXPECT(log != NULL, "create %s", log_path);
    mt_error err;
    mt_tb_writer* w = NULL;
    EXPECT_OK(mt_tb_open(&w, tb, 1000, &err), &err);
    EXPECT_OK(mt_tb_text(w, "train_iters", "6", 0, &err), &err);
    const int gbs = 8;
    double interval_loss = 0.0;
    for (int it = 1; it <= 6; it++) {
        int64_t consumed = (int64_t)it * gbs;
        double loss = 10.0 - 0.37 * it + 0.01 * (it % 3), lr = 6e-4 * it / 6.0, norm = 1.5 / it;
        interval_loss += loss;
        EXPECT_OK(mt_tb_scalar_pair(w, "learning-rate", lr, it, consumed, &err), &err);
        EXPECT_OK(mt_tb_scalar_pair(w, "batch-size", gbs, it, consumed, &err), &err);
        EXPECT_OK(mt_tb_scalar_pair(w, "lm loss", loss, it, consumed, &err), &err);
        EXPECT_OK(mt_tb_scalar_pair(w, "loss-scale", 1.0, it, consumed, &err), &err);
        EXPECT_OK(mt_tb_scalar_pair(w, "grad-norm", norm, it, consumed, &err), &err);
        if (it % 2 == 0) {
            double ms = 100.0 + it, tflops = 12.5 + it;
            EXPECT_OK(mt_tb_scalar(w, "iteration-time", ms / 1000.0, it, &err), &err);
            EXPECT_OK(mt_tb_scalar(w, "throughput", tflops, it, &err), &err);
            fprintf(log,
                    " [2025-01-01 00:00:00.000000] iteration %8d/%8d | consumed samples: %12lld | elapsed time per "
                    "iteration (ms): %.1f | throughput per GPU (TFLOP/s/GPU): %.1f | learning rate: %.6E | global batch "
                    "size: %5d | lm loss: %.6E | loss scale: %.1f | grad norm: %.3f | number of skipped iterations: %3d | "
                    "number of nan iterations: %3d | MFU: %.1f%% |\n",
                    it, 6, (long long)consumed, ms, tflops, lr, gbs, interval_loss / 2, 1.0, norm, 0, 0, 1.0);
            interval_loss = 0.0;
            EXPECT_OK(mt_tb_flush(w, &err), &err);
        }
        if (it == 4 || it == 6) {
            double val = 9.0 - 0.1 * it, ppl = exp(val);
            EXPECT_OK(mt_tb_scalar_pair(w, "lm loss validation", val, it, consumed, &err), &err);
            EXPECT_OK(mt_tb_scalar_pair(w, "lm loss validation ppl", ppl, it, consumed, &err), &err);
            fprintf(log, " validation loss at iteration %d | lm loss value: %.6E | lm loss PPL: %.6E | \n", it, val, ppl);
        }
    }
    char path[512];
    snprintf(path, sizeof(path), "%s", mt_tb_path(w));
    EXPECT_OK(mt_tb_close(w, &err), &err);
    fclose(log);
    ttb_event events[128];
    char why[256];
    int n = ttb_read_file(path, events, 128, why, sizeof(why));
    EXPECT(n == 1 + 1 + 6 * 10 + 3 * 2 + 2 * 4, "%d events: %s", n, why);
    if (keep && *keep) printf("    kept %s and %s/ for dev/tb_check.py\n", log_path, tb);
    else {
        tds_rmdir(tb);
        remove(log_path);
        tds_rmdir(root);
    }
    return TEST_PASS;
}

static const test_case tensorboard_tests[] = {
    {"tensorboard_crc32c", test_tensorboard_crc32c},
    {"tensorboard_event_bytes", test_tensorboard_event_bytes},
    {"tensorboard_file", test_tensorboard_file},
    {"tensorboard_refused", test_tensorboard_refused},
    {"tensorboard_sample_run", test_tensorboard_sample_run},
};

#endif
