/* tests/test_hf.h — prepro/safetensors.h (JSON reader, safetensors reader/writer) and
 * prepro/hf_checkpoint.h with its mappings prepro/hf_gpt2.h and prepro/hf_llama.h (Hugging Face
 * GPT-2 and Llama <-> megatron.c parameters and checkpoints).
 *
 * Host tests: the JSON reader's strictness; safetensors files written and read back (F32, BF16,
 * F16, metadata, scalars, empty tensors, sharded through an index); every kind of corrupt file
 * refused with its message; float <-> bf16/fp16 rounding; the GPT-2 mapping both ways, bitwise,
 * and against an independent statement of the QKV layout; a GPT-2 forward written the way
 * transformers computes it (Conv1D weights, [q | k | v] columns) run on exported reference weights
 * must give dev/ref_gpt.py's logits (dev/data/gpt_vectors/gpt2_tiny.bin); whole directories
 * through import, checkpoint and export. Llama: tiny HF directories written here tensor by tensor
 * (GQA with head_dim != hidden / heads, llama3 rope scaling, untied; and a tied MHA one) are imported
 * (every tensor checked in place against an independent statement of Megatron's grouped QKV and
 * [gate; up] layouts, the header's flavour words), exported back bitwise with config.json's fields,
 * and every unsupported config.json or weight file is refused with its one-line message; weights that
 * hold a NaN or an infinity are refused naming file, tensor and index. Mixtral and Qwen3-MoE
 * (prepro/hf_moe.h): the mapping both ways bitwise, tiny directories written here imported (every
 * expert, router and q/k norm tensor in place against an independent statement of our layout, the MoE
 * config) and exported back bitwise with config.json's fields, every refusal (sliding window, jitter,
 * dense layers, shared experts, biases; routers transformers cannot hold; convert_hf --export without
 * --moe-router-topk). GPU tests: GPT-2 and Llama checkpoints written by the converter load into the
 * trainer (same bytes back) and their logits equal a forward written the way transformers computes it;
 * transformers' own tiny Mixtral and Qwen3-MoE models (dev/hf_moe_check.py --write) give the trainer's
 * logits transformers' float64 ones (skipped without python's transformers).
 *
 * Files go to /tmp/mt_test_hf_<pid>_*, removed at the end. Run from the repository root. */
#ifndef MT_TEST_HF_H
#define MT_TEST_HF_H

#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_common.h"
#include "test_configs.h"

#define MT_SAFETENSORS_IMPLEMENTATION
#include "../prepro/safetensors.h"
#define MT_HF_IMPLEMENTATION
#include "../prepro/hf_checkpoint.h"

/* ---- helpers ------------------------------------------------------------------------------------ */

static void thf_path(char* buf, size_t cap, const char* name) {
    snprintf(buf, cap, "/tmp/mt_test_hf_%d_%s", (int)getpid(), name);
}

/* rm -r of the small trees these tests make */
static void thf_remove(const char* path) {
    char cmd[600];
    if (strncmp(path, "/tmp/mt_test_hf_", 16) != 0) return; /* never anything else */
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", path);
    if (system(cmd) != 0) { /* nothing more to do */ }
}

static int thf_write_bytes(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f) return -1;
    size_t k = fwrite(data, 1, n, f);
    return fclose(f) == 0 && k == n ? 0 : -1;
}

/* A safetensors file from a header text and n data bytes (the header padded with spaces to 8). */
static int thf_write_raw(const char* path, const char* header, size_t data_bytes) {
    size_t hn = strlen(header), pad = (8 - (8 + hn) % 8) % 8;
    size_t total = 8 + hn + pad + data_bytes;
    unsigned char* b = (unsigned char*)calloc(total, 1);
    if (!b) return -1;
    uint64_t n = hn + pad;
    memcpy(b, &n, 8);
    memcpy(b + 8, header, hn);
    memset(b + 8 + hn, ' ', pad);
    for (size_t i = 0; i < data_bytes; i++) b[8 + hn + pad + i] = (unsigned char)(i * 7);
    int r = thf_write_bytes(path, b, total);
    free(b);
    return r;
}

/* Opening path must fail with `status` and a message containing `words`. */
static int thf_rejects(const char* path, mt_status status, const char* words, char* message, size_t cap) {
    mt_safetensors* st = NULL;
    mt_error err;
    err.message[0] = 0;
    mt_status s = mt_safetensors_open(&st, path, &err);
    snprintf(message, cap, "status %s, message \"%s\"", mt_status_name(s), err.message);
    if (st) mt_safetensors_close(st);
    return s == status && st == NULL && strstr(err.message, words) != NULL;
}

static uint64_t thf_rng = 88172645463325252ull;
static float thf_uniform(void) { /* xorshift64, [-1, 1) */
    thf_rng ^= thf_rng << 13;
    thf_rng ^= thf_rng >> 7;
    thf_rng ^= thf_rng << 17;
    return (float)((double)(thf_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* A 2-layer, hidden 64, 4-head GPT-2 with a 100-token vocabulary (padded 128), 16 positions. */
static mt_config thf_small_config(void) {
    mt_hf_gpt2_config hf;
    memset(&hf, 0, sizeof(hf));
    hf.n_layer = 2;
    hf.n_embd = 64;
    hf.n_head = 4;
    hf.n_inner = 256;
    hf.n_positions = 16;
    hf.vocab_size = 100;
    hf.layer_norm_epsilon = 1e-5;
    hf.tie_word_embeddings = 1;
    mt_config c;
    mt_error err;
    if (mt_hf_gpt2_to_mt_config(&hf, &c, &err) != MT_OK) printf("    config: %s\n", err.message);
    return c;
}

/* Random canonical parameters; the padded vocabulary rows zero (as an import leaves them). */
static float* thf_random_params(const mt_config* c) {
    int64_t n = mt_num_parameters(c);
    float* p = (float*)malloc(sizeof(float) * (size_t)n);
    if (!p) return NULL;
    for (int64_t i = 0; i < n; i++) p[i] = thf_uniform();
    memset(p + c->vocab_size * c->hidden_size, 0, sizeof(float) * (size_t)((c->padded_vocab_size - c->vocab_size) * c->hidden_size));
    return p;
}

/* ---- JSON --------------------------------------------------------------------------------------- */

static test_result test_hf_json(void) {
    mt_json* v = NULL;
    mt_error err;
    const char* good =
        " {\"a\": [1, -2, 3.5e2, true, false, null], \"s\": \"x\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\","
        " \"big\": 9223372036854775807, \"neg\": -9223372036854775808, \"huge\": 18446744073709551616,"
        " \"o\": {}, \"e\": []} \n";
    EXPECT_OK(mt_json_parse(&v, good, strlen(good), "good", &err), &err);
    EXPECT(v->type == MT_JSON_OBJECT && v->count == 7, "root");
    const mt_json* a = mt_json_get(v, "a");
    EXPECT(a && a->type == MT_JSON_ARRAY && a->count == 6, "array");
    EXPECT(a->items[0].is_integer && a->items[0].integer == 1 && a->items[1].integer == -2, "ints");
    EXPECT(!a->items[2].is_integer && a->items[2].number == 350.0, "float");
    EXPECT(a->items[3].type == MT_JSON_TRUE && a->items[4].type == MT_JSON_FALSE && a->items[5].type == MT_JSON_NULL, "words");
    const mt_json* s = mt_json_get(v, "s");
    EXPECT(s && !strcmp(s->string, "x\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80"), "escapes: %s", s ? s->string : "");
    EXPECT(mt_json_get(v, "big")->is_integer && mt_json_get(v, "big")->integer == INT64_MAX, "int64 max exact");
    EXPECT(mt_json_get(v, "neg")->is_integer && mt_json_get(v, "neg")->integer == INT64_MIN, "int64 min exact");
    EXPECT(!mt_json_get(v, "huge")->is_integer, "2^64 is not an int64");
    EXPECT(mt_json_get(v, "o")->count == 0 && mt_json_get(v, "e")->count == 0 && !mt_json_get(v, "zz"), "empties");
    mt_json_free(v);

    struct { const char* text; const char* words; } bad[] = {
        {"{\"a\": 1,}", "object key"},
        {"[1, 2,]", "unexpected character"},
        {"{\"a\": 01}", "leading zero"},
        {"{\"a\": 1, \"a\": 2}", "duplicate object key"},
        {"{\"a\": \"abc", "unterminated string"},
        {"{\"a\": \"a\x01\"}", "control character"},
        {"{\"a\": NaN}", "unexpected character"},
        {"{\"a\": 1} x", "trailing characters"},
        {"{\"a\" 1}", "':' expected"},
        {"{\"a\": \"\\ud800\"}", "unpaired surrogate"},
        {"{\"a\": \"\\q\"}", "bad escape"},
        {"{\"a\": \"\xff\"}", "invalid UTF-8"},
        {"{\"a\": 1.}", "digit expected"},
        {"{\"a\": tru}", "unexpected character"},
        {"", "unexpected end"},
        {"// c\n{}", "unexpected character"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err.message[0] = 0;
        mt_status st = mt_json_parse(&v, bad[i].text, strlen(bad[i].text), "bad.json", &err);
        EXPECT(st == MT_ERR_FORMAT && !v && strstr(err.message, bad[i].words) && strstr(err.message, "bad.json: malformed JSON"),
               "case %zu (%s): %s", i, bad[i].text, err.message);
    }
    char deep[200];
    memset(deep, '[', 100);
    memset(deep + 100, ']', 100);
    EXPECT(mt_json_parse(&v, deep, 200, "deep", &err) == MT_ERR_FORMAT && strstr(err.message, "nested too deeply"),
           "depth: %s", err.message);
    return TEST_PASS;
}

/* ---- safetensors -------------------------------------------------------------------------------- */

static test_result test_hf_float_conversions(void) {
    EXPECT(mt_st_f32_to_bf16(1.0f) == 0x3F80 && mt_st_bf16_to_f32(0x3F80) == 1.0f, "bf16 1");
    EXPECT(mt_st_f32_to_bf16(-2.5f) == 0xC020, "bf16 -2.5");
    /* 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: ties to even (1); 1 + 3*2^-8 -> 1 + 2^-6 */
    EXPECT(mt_st_f32_to_bf16(1.00390625f) == 0x3F80 && mt_st_f32_to_bf16(1.01171875f) == 0x3F82, "bf16 ties to even");
    EXPECT(mt_st_f32_to_bf16(nextafterf(1.00390625f, 2.0f)) == 0x3F81, "bf16 just above the tie rounds up");
    EXPECT(mt_st_bf16_to_f32(mt_st_f32_to_bf16(NAN)) != mt_st_bf16_to_f32(mt_st_f32_to_bf16(NAN)), "bf16 NaN");
    EXPECT(mt_st_f32_to_bf16(INFINITY) == 0x7F80 && mt_st_f32_to_bf16(3.4e38f) == 0x7F80, "bf16 overflow to inf");
    EXPECT(mt_st_f32_to_f16(1.0f) == 0x3C00 && mt_st_f16_to_f32(0x3C00) == 1.0f, "f16 1");
    EXPECT(mt_st_f32_to_f16(65504.0f) == 0x7BFF && mt_st_f32_to_f16(65520.0f) == 0x7C00 && mt_st_f32_to_f16(65519.0f) == 0x7BFF,
           "f16 max / overflow");
    EXPECT(mt_st_f32_to_f16(-0.0f) == 0x8000 && mt_st_f16_to_f32(0x8000) == 0.0f, "f16 -0");
    EXPECT(mt_st_f32_to_f16(5.9604644775390625e-08f) == 0x0001 && mt_st_f16_to_f32(0x0001) == 5.9604644775390625e-08f,
           "f16 smallest subnormal");
    EXPECT(mt_st_f32_to_f16(2.98023223876953125e-08f) == 0x0000, "half the smallest subnormal ties to 0");
    EXPECT(mt_st_f32_to_f16(6.103515625e-05f) == 0x0400 && mt_st_f16_to_f32(0x03FF) == 6.097555160522461e-05f,
           "f16 smallest normal, largest subnormal");
    EXPECT(mt_st_f32_to_f16(1.00048828125f) == 0x3C00 && mt_st_f32_to_f16(1.00146484375f) == 0x3C02, "f16 ties to even");
    EXPECT(mt_st_f16_to_f32(mt_st_f32_to_f16(NAN)) != mt_st_f16_to_f32(mt_st_f32_to_f16(NAN)), "f16 NaN");
    /* every f16 value survives f16 -> f32 -> f16 */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue; /* NaNs */
        uint16_t back = mt_st_f32_to_f16(mt_st_f16_to_f32((uint16_t)h));
        EXPECT(back == h, "f16 %04x -> %g -> %04x", h, mt_st_f16_to_f32((uint16_t)h), back);
    }
    return TEST_PASS;
}

static test_result test_hf_safetensors_roundtrip(void) {
    char path[256];
    thf_path(path, sizeof(path), "rt.safetensors");
    float a[6] = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-30f};
    float b[5] = {1.0f, -2.0f, 0.5f, 1.00390625f, 3.14159265f}; /* the last two round in bf16 */
    float scalar = 42.0f;
    float c[3] = {1.0f, 0.000061035156f, -65504.0f};
    mt_st_write_tensor t[5];
    memset(t, 0, sizeof(t));
    t[0].name = "weights.f32"; t[0].dtype = MT_ST_F32; t[0].ndim = 2; t[0].shape[0] = 2; t[0].shape[1] = 3; t[0].data = a;
    t[1].name = "b \"quoted\" \\ name"; t[1].dtype = MT_ST_BF16; t[1].ndim = 1; t[1].shape[0] = 5; t[1].data = b;
    t[2].name = "scalar"; t[2].dtype = MT_ST_F32; t[2].ndim = 0; t[2].data = &scalar;
    t[3].name = "empty"; t[3].dtype = MT_ST_BF16; t[3].ndim = 2; t[3].shape[0] = 0; t[3].shape[1] = 4; t[3].data = NULL;
    t[4].name = "half"; t[4].dtype = MT_ST_F16; t[4].ndim = 1; t[4].shape[0] = 3; t[4].data = c;
    const char* const meta[] = {"format", "pt", "note", "a\nb", NULL};
    mt_error err;
    EXPECT_OK(mt_safetensors_write(path, t, 5, meta, &err), &err);
    /* header length: data 8-byte aligned */
    size_t size = 0;
    char* raw = test_read_file(path, &size);
    EXPECT(raw, "cannot read back %s", path);
    uint64_t n;
    memcpy(&n, raw, 8);
    EXPECT((8 + n) % 8 == 0 && raw[8] == '{' && size == 8 + n + 24 + 10 + 4 + 0 + 6, "header %llu, size %zu",
           (unsigned long long)n, size);
    free(raw);
    char tmpname[300];
    snprintf(tmpname, sizeof(tmpname), "%s.tmp.%d", path, (int)getpid());
    EXPECT(access(tmpname, F_OK) != 0, "temporary file left behind");

    mt_safetensors* st = NULL;
    EXPECT_OK(mt_safetensors_open(&st, path, &err), &err);
    EXPECT(mt_safetensors_count(st) == 5, "count %d", mt_safetensors_count(st));
    EXPECT(!strcmp(mt_safetensors_metadata(st, "format"), "pt") && !strcmp(mt_safetensors_metadata(st, "note"), "a\nb") &&
               !mt_safetensors_metadata(st, "x"), "metadata");
    const mt_st_tensor* ta = mt_safetensors_find(st, "weights.f32");
    const mt_st_tensor* tb = mt_safetensors_find(st, "b \"quoted\" \\ name");
    const mt_st_tensor* ts = mt_safetensors_find(st, "scalar");
    const mt_st_tensor* te = mt_safetensors_find(st, "empty");
    const mt_st_tensor* th = mt_safetensors_find(st, "half");
    EXPECT(ta && tb && ts && te && th && !mt_safetensors_find(st, "nope"), "find");
    EXPECT(ta->dtype == MT_ST_F32 && ta->ndim == 2 && ta->shape[0] == 2 && ta->shape[1] == 3 && ta->numel == 6, "f32 entry");
    EXPECT(tb->dtype == MT_ST_BF16 && tb->ndim == 1 && tb->numel == 5, "bf16 entry");
    EXPECT(ts->ndim == 0 && ts->numel == 1 && te->numel == 0 && th->dtype == MT_ST_F16, "scalar, empty, f16");
    float out[8];
    EXPECT_OK(mt_safetensors_read_f32(st, ta, out, &err), &err);
    EXPECT(!memcmp(out, a, sizeof(a)), "f32 bitwise");
    EXPECT_OK(mt_safetensors_read_f32(st, tb, out, &err), &err);
    for (int i = 0; i < 5; i++)
        EXPECT(out[i] == mt_st_bf16_to_f32(mt_st_f32_to_bf16(b[i])), "bf16 %d: %g", i, out[i]);
    EXPECT(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f && out[3] == 1.0f && out[4] == 3.140625f, "bf16 values");
    EXPECT_OK(mt_safetensors_read_f32(st, ts, out, &err), &err);
    EXPECT(out[0] == 42.0f, "scalar");
    EXPECT_OK(mt_safetensors_read_f32(st, th, out, &err), &err);
    EXPECT(out[0] == 1.0f && out[2] == -65504.0f && fabsf(out[1] - 0.000061035156f) < 1e-9f, "f16 values");
    mt_safetensors_close(st);

    /* the writer refuses what it cannot store, and leaves nothing */
    char bad_path[256];
    thf_path(bad_path, sizeof(bad_path), "bad.safetensors");
    t[0].dtype = MT_ST_I64;
    EXPECT(mt_safetensors_write(bad_path, t, 1, NULL, &err) == MT_ERR_ARG && strstr(err.message, "I64"), "I64: %s", err.message);
    t[0].dtype = MT_ST_F32;
    t[1].name = t[0].name;
    EXPECT(mt_safetensors_write(bad_path, t, 2, NULL, &err) == MT_ERR_ARG && strstr(err.message, "twice"), "dup: %s", err.message);
    EXPECT(access(bad_path, F_OK) != 0, "refused file exists");
    char nodir[300];
    snprintf(nodir, sizeof(nodir), "/nonexistent_dir_%d/x.safetensors", (int)getpid());
    EXPECT(mt_safetensors_write(nodir, t, 1, NULL, &err) == MT_ERR_IO && strstr(err.message, "cannot create"), "io: %s", err.message);
    thf_remove(path);
    return TEST_PASS;
}

static test_result test_hf_safetensors_rejects(void) {
    char path[256], msg[700];
    thf_path(path, sizeof(path), "corrupt.safetensors");
    /* a good file to start from: two F32 tensors of 4 and 2 elements */
    const char* good = "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}";
    EXPECT(thf_write_raw(path, good, 24) == 0, "write");
    mt_safetensors* st = NULL;
    mt_error err;
    EXPECT_OK(mt_safetensors_open(&st, path, &err), &err);
    mt_safetensors_close(st);

    /* truncated: the data region is shorter than the largest end */
    size_t size = 0;
    char* raw = test_read_file(path, &size);
    EXPECT(raw, "read");
    EXPECT(truncate(path, (off_t)(size - 3)) == 0, "truncate");
    EXPECT(thf_rejects(path, MT_ERR_FORMAT, "truncated: tensor \"b\" ends at byte 24 of the data region, which holds only 21",
                       msg, sizeof(msg)), "%s", msg);
    EXPECT(strstr(msg, path) != NULL, "message names the file: %s", msg);
    /* truncated inside the header */
    EXPECT(truncate(path, 40) == 0, "truncate");
    EXPECT(thf_rejects(path, MT_ERR_FORMAT, "is larger than the file", msg, sizeof(msg)), "%s", msg);
    /* shorter than the length field; empty */
    EXPECT(truncate(path, 5) == 0 && thf_rejects(path, MT_ERR_FORMAT, "truncated: 5 bytes", msg, sizeof(msg)), "%s", msg);
    EXPECT(truncate(path, 0) == 0 && thf_rejects(path, MT_ERR_FORMAT, "truncated: 0 bytes", msg, sizeof(msg)), "%s", msg);
    /* bad header length */
    uint64_t huge = (uint64_t)1 << 40;
    memcpy(raw, &huge, 8);
    EXPECT(thf_write_bytes(path, raw, size) == 0, "write");
    EXPECT(thf_rejects(path, MT_ERR_FORMAT, "header length 1099511627776 is larger than the file", msg, sizeof(msg)), "%s", msg);
    free(raw);
    /* trailing bytes after the last tensor */
    EXPECT(thf_write_raw(path, good, 30) == 0, "write");
    EXPECT(thf_rejects(path, MT_ERR_FORMAT, "6 bytes after the last tensor", msg, sizeof(msg)), "%s", msg);

    struct { const char* header; const char* words; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},}", "malformed JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}", "malformed JSON"},
        {"[1, 2]", "does not start with '{'"},
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", "tensor \"a\": unknown dtype \"F33\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[16,0]}}", "end before begin"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", "span 12 bytes but shape [2, 2] of F32 needs 16"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],"
         "\"data_offsets\":[12,20]}}", "tensors \"a\" [0, 16) and \"b\" [12, 20) overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],"
         "\"data_offsets\":[0,8]}}", "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[4,20]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[20,24]}}", "bytes [0, 4) of the data region belong to no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},\"b\":{\"dtype\":\"F32\",\"shape\":[3],"
         "\"data_offsets\":[16,28]}}", "truncated: tensor \"b\" ends at byte 28"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,-2],\"data_offsets\":[0,16]}}", "shape entry 1 is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2.0],\"data_offsets\":[0,16]}}", "shape entry 1"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0]}}", "data_offsets is not [begin, end]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2]}}", "expected exactly the keys"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16],\"x\":1}}", "expected exactly the keys"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,16]}}", "impossibly large"},
        {"{\"__metadata__\":{\"format\":1},\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}",
         "__metadata__ value of \"format\" is not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
         "\"data_offsets\":[16,24]}}", "duplicate object key"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        EXPECT(thf_write_raw(path, cases[i].header, 24) == 0, "write");
        EXPECT(thf_rejects(path, MT_ERR_FORMAT, cases[i].words, msg, sizeof(msg)), "case %zu: %s", i, msg);
    }
    /* a tensor of another dtype opens, but does not convert to float32 */
    EXPECT(thf_write_raw(path, "{\"i\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[0,24]}}", 24) == 0, "write");
    EXPECT_OK(mt_safetensors_open(&st, path, &err), &err);
    float out[3];
    mt_status s = mt_safetensors_read_f32(st, mt_safetensors_find(st, "i"), out, &err);
    mt_safetensors_close(st);
    EXPECT(s == MT_ERR_FORMAT && strstr(err.message, "has dtype I64"), "I64 read: %s", err.message);
    /* a missing file */
    thf_remove(path);
    EXPECT(thf_rejects(path, MT_ERR_IO, "cannot open", msg, sizeof(msg)), "%s", msg);
    return TEST_PASS;
}

static test_result test_hf_safetensors_sharded(void) {
    char dir[256], p1[300], p2[300], index[300], msg[700];
    thf_path(dir, sizeof(dir), "shards");
    thf_remove(dir);
    EXPECT(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    snprintf(p1, sizeof(p1), "%s/model-00001-of-00002.safetensors", dir);
    snprintf(p2, sizeof(p2), "%s/model-00002-of-00002.safetensors", dir);
    snprintf(index, sizeof(index), "%s/model.safetensors.index.json", dir);
    float x[4] = {1, 2, 3, 4}, y[2] = {5, 6};
    mt_st_write_tensor t[2];
    memset(t, 0, sizeof(t));
    t[0].name = "x"; t[0].dtype = MT_ST_F32; t[0].ndim = 1; t[0].shape[0] = 4; t[0].data = x;
    t[1].name = "y"; t[1].dtype = MT_ST_BF16; t[1].ndim = 1; t[1].shape[0] = 2; t[1].data = y;
    mt_error err;
    EXPECT_OK(mt_safetensors_write(p1, &t[0], 1, NULL, &err), &err);
    EXPECT_OK(mt_safetensors_write(p2, &t[1], 1, NULL, &err), &err);
    const char* good = "{\"metadata\": {\"total_size\": 20}, \"weight_map\": {\"x\": \"model-00001-of-00002.safetensors\", "
                       "\"y\": \"model-00002-of-00002.safetensors\"}}";
    EXPECT(thf_write_bytes(index, good, strlen(good)) == 0, "write index");
    mt_safetensors* st = NULL;
    EXPECT_OK(mt_safetensors_open(&st, index, &err), &err);
    EXPECT(mt_safetensors_count(st) == 2, "count");
    float out[4];
    EXPECT_OK(mt_safetensors_read_f32(st, mt_safetensors_find(st, "x"), out, &err), &err);
    EXPECT(out[0] == 1 && out[3] == 4, "x");
    EXPECT_OK(mt_safetensors_read_f32(st, mt_safetensors_find(st, "y"), out, &err), &err);
    EXPECT(out[0] == 5 && out[1] == 6, "y");
    EXPECT(strstr(mt_safetensors_file_path(st, mt_safetensors_find(st, "y")), "00002") != NULL, "file path");
    mt_safetensors_close(st);

    struct { const char* text; mt_status status; const char* words; } bad[] = {
        {"{\"weight_map\": {\"x\": \"model-00001-of-00002.safetensors\", \"z\": \"model-00002-of-00002.safetensors\"}}",
         MT_ERR_FORMAT, "tensor \"z\" is mapped to model-00002-of-00002.safetensors, which does not hold it"},
        {"{\"weight_map\": {\"x\": \"model-00002-of-00002.safetensors\", \"y\": \"model-00001-of-00002.safetensors\"}}",
         MT_ERR_FORMAT, "is mapped to model-00002-of-00002.safetensors but found in"},
        {"{\"weight_map\": {\"x\": \"model-00003-of-00002.safetensors\"}}", MT_ERR_IO, "cannot open"},
        {"{\"weight_map\": {\"x\": \"../x.safetensors\"}}", MT_ERR_FORMAT, "outside the checkpoint's directory"},
        {"{\"weight_map\": {}}", MT_ERR_FORMAT, "the weight_map is empty"},
        {"{\"weights\": {}}", MT_ERR_FORMAT, "no \"weight_map\" object"},
        {"{\"weight_map\": {\"x\": 1}}", MT_ERR_FORMAT, "is not a file name"},
        {"{\"weight_map\": ", MT_ERR_FORMAT, "malformed JSON"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        EXPECT(thf_write_bytes(index, bad[i].text, strlen(bad[i].text)) == 0, "write index");
        EXPECT(thf_rejects(index, bad[i].status, bad[i].words, msg, sizeof(msg)), "case %zu: %s", i, msg);
    }
    /* the same tensor in two shards */
    t[1].name = "x";
    EXPECT_OK(mt_safetensors_write(p2, &t[1], 1, NULL, &err), &err);
    EXPECT(thf_write_bytes(index, good, strlen(good)) == 0, "write index");
    EXPECT(thf_rejects(index, MT_ERR_FORMAT, "tensor \"x\" is in two shards", msg, sizeof(msg)), "%s", msg);
    thf_remove(dir);
    return TEST_PASS;
}

/* ---- the GPT-2 mapping -------------------------------------------------------------------------- */

/* Canonical -> every HF tensor -> canonical is the identity, bitwise; and HF -> canonical -> HF too. */
static test_result test_hf_gpt2_mapping_roundtrip(void) {
    mt_config c = thf_small_config();
    int64_t V = c.vocab_size, n = mt_num_parameters(&c);
    mt_error err;
    EXPECT(c.padded_vocab_size == 128 && c.kv_channels == 16 && c.ffn_hidden_size == 256, "config");
    EXPECT_OK(mt_hf_gpt2_check_shape(&c, V, &err), &err);
    EXPECT(mt_hf_gpt2_num_tensors(&c) == 28, "tensor count %d", mt_hf_gpt2_num_tensors(&c));
    float* p = thf_random_params(&c);
    float* q = (float*)calloc((size_t)n, sizeof(float));
    float* hf = (float*)malloc(sizeof(float) * (size_t)n);
    float* hf2 = (float*)malloc(sizeof(float) * (size_t)n);
    EXPECT(p && q && hf && hf2, "alloc");
    for (int64_t i = 0; i < n; i++) q[i] = 12345.0f; /* every element must be overwritten */
    int64_t total = 0;
    for (int i = 0; i < mt_hf_gpt2_num_tensors(&c); i++) {
        mt_hf_tensor t;
        mt_hf_gpt2_tensor(&c, V, i, &t);
        mt_hf_gpt2_export_tensor(&c, V, &t, p, hf + total);
        mt_hf_gpt2_import_tensor(&c, V, &t, hf + total, q);
        total += t.numel;
    }
    EXPECT(total == n - (c.padded_vocab_size - V) * c.hidden_size, "HF holds every parameter but the padding: %lld", (long long)total);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "canonical -> HF -> canonical is not bitwise the identity");
    total = 0;
    for (int i = 0; i < mt_hf_gpt2_num_tensors(&c); i++) {
        mt_hf_tensor t;
        mt_hf_gpt2_tensor(&c, V, i, &t);
        mt_hf_gpt2_export_tensor(&c, V, &t, q, hf2 + total);
        total += t.numel;
    }
    EXPECT(!memcmp(hf, hf2, sizeof(float) * (size_t)total), "HF -> canonical -> HF is not bitwise the identity");

    /* names and shapes as transformers' GPT2LMHeadModel has them */
    mt_hf_tensor t;
    mt_hf_gpt2_tensor(&c, V, 0, &t);
    EXPECT(!strcmp(t.name, "transformer.wte.weight") && t.shape[0] == 100 && t.shape[1] == 64, "wte");
    mt_hf_gpt2_tensor(&c, V, 1, &t);
    EXPECT(!strcmp(t.name, "transformer.wpe.weight") && t.shape[0] == 16 && t.shape[1] == 64, "wpe");
    mt_hf_gpt2_tensor(&c, V, 2 + 12 + 2, &t);
    EXPECT(!strcmp(t.name, "transformer.h.1.attn.c_attn.weight") && t.kind == MT_P_QKV_WEIGHT && t.layer == 1 &&
               t.shape[0] == 64 && t.shape[1] == 192, "c_attn: %s", t.name);
    mt_hf_gpt2_tensor(&c, V, 2 + 10, &t);
    EXPECT(!strcmp(t.name, "transformer.h.0.mlp.c_proj.weight") && t.shape[0] == 256 && t.shape[1] == 64, "mlp.c_proj");
    mt_hf_gpt2_tensor(&c, V, 27, &t);
    EXPECT(!strcmp(t.name, "transformer.ln_f.bias") && t.ndim == 1, "ln_f");

    /* the layout, stated independently: our row for (head j, part q/k/v, channel x) is
     * j*3d + part*d + x (dev/ref_gpt.py); transformers' column is part*h + j*d + x; Conv1D [in, out] */
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&c, info);
    int64_t h = c.hidden_size, d = c.kv_channels, f = c.ffn_hidden_size, R = 3 * h;
    for (int layer = 0; layer < 2; layer++) {
        float out[64 * 256];
        mt_hf_gpt2_tensor(&c, V, 2 + 12 * layer + 2, &t);
        mt_hf_gpt2_export_tensor(&c, V, &t, p, out);
        const float* w = p + info[MT_P_QKV_WEIGHT].offset + layer * R * h;
        for (int j = 0; j < c.num_attention_heads; j++)
            for (int part = 0; part < 3; part++)
                for (int x = 0; x < d; x++)
                    for (int i = 0; i < h; i++)
                        EXPECT(out[i * R + part * h + j * d + x] == w[(j * 3 * d + part * d + x) * h + i],
                               "c_attn layer %d head %d part %d channel %d input %d", layer, j, part, x, i);
        mt_hf_gpt2_tensor(&c, V, 2 + 12 * layer + 3, &t);
        mt_hf_gpt2_export_tensor(&c, V, &t, p, out);
        const float* bias = p + info[MT_P_QKV_BIAS].offset + layer * R;
        for (int j = 0; j < c.num_attention_heads; j++)
            for (int part = 0; part < 3; part++)
                for (int x = 0; x < d; x++)
                    EXPECT(out[part * h + j * d + x] == bias[j * 3 * d + part * d + x], "c_attn bias");
        mt_hf_gpt2_tensor(&c, V, 2 + 12 * layer + 8, &t); /* mlp.c_fc [h, f] = fc1 [f, h]^T */
        mt_hf_gpt2_export_tensor(&c, V, &t, p, out);
        const float* fc1 = p + info[MT_P_FC1_WEIGHT].offset + layer * f * h;
        for (int o = 0; o < f; o++)
            for (int i = 0; i < h; i++) EXPECT(out[i * f + o] == fc1[o * h + i], "c_fc");
    }
    /* import zeroes the padded vocabulary rows */
    for (int64_t i = 0; i < n; i++) q[i] = 7.0f;
    mt_hf_gpt2_tensor(&c, V, 0, &t);
    mt_hf_gpt2_import_tensor(&c, V, &t, hf, q);
    for (int64_t i = V * h; i < c.padded_vocab_size * h; i++) EXPECT(q[i] == 0.0f, "padding row element %lld", (long long)i);
    free(p);
    free(q);
    free(hf);
    free(hf2);
    return TEST_PASS;
}

/* GPT-2's forward as transformers computes it, in double: HF tensors in mt_hf_gpt2_tensor order
 * (hf_data[i] points at tensor i), Conv1D y = x W + b with W [in, out], c_attn's output split
 * [q | k | v], heads of d channels each. logits [T, V]. */
static void thf_hf_forward(const mt_config* c, int64_t V, float* const* w, const int32_t* tokens, int T, double* logits) {
    int h = c->hidden_size, f = c->ffn_hidden_size, heads = c->num_attention_heads, d = h / heads;
    double eps = c->norm_epsilon;
    double* x = (double*)calloc((size_t)T * h, sizeof(double));
    double* a = (double*)calloc((size_t)T * h, sizeof(double));
    double* qkv = (double*)calloc((size_t)T * 3 * h, sizeof(double));
    double* o = (double*)calloc((size_t)T * h, sizeof(double));
    double* z = (double*)calloc((size_t)T * f, sizeof(double));
    double* s = (double*)calloc((size_t)T, sizeof(double));
    for (int t = 0; t < T; t++)
        for (int i = 0; i < h; i++) x[t * h + i] = (double)w[0][(int64_t)tokens[t] * h + i] + (double)w[1][t * h + i];
#define THF_LN(src, gain, shift, dst)                                                  \
    for (int t = 0; t < T; t++) {                                                      \
        double mu = 0, var = 0;                                                        \
        for (int i = 0; i < h; i++) mu += src[t * h + i];                              \
        mu /= h;                                                                       \
        for (int i = 0; i < h; i++) var += (src[t * h + i] - mu) * (src[t * h + i] - mu); \
        var /= h;                                                                      \
        for (int i = 0; i < h; i++)                                                    \
            dst[t * h + i] = (src[t * h + i] - mu) / sqrt(var + eps) * gain[i] + shift[i]; \
    }
    for (int l = 0; l < c->num_layers; l++) {
        float* const* lw = w + 2 + 12 * l;
        THF_LN(x, lw[0], lw[1], a)
        for (int t = 0; t < T; t++)
            for (int k = 0; k < 3 * h; k++) {
                double acc = lw[3][k];
                for (int i = 0; i < h; i++) acc += a[t * h + i] * lw[2][(int64_t)i * 3 * h + k];
                qkv[t * 3 * h + k] = acc;
            }
        for (int j = 0; j < heads; j++)
            for (int t = 0; t < T; t++) {
                double mx = -1e300, sum = 0;
                for (int u = 0; u <= t; u++) {
                    double dot = 0;
                    for (int e = 0; e < d; e++) dot += qkv[t * 3 * h + j * d + e] * qkv[u * 3 * h + h + j * d + e];
                    s[u] = dot / sqrt((double)d);
                    if (s[u] > mx) mx = s[u];
                }
                for (int u = 0; u <= t; u++) sum += s[u] = exp(s[u] - mx);
                for (int e = 0; e < d; e++) {
                    double acc = 0;
                    for (int u = 0; u <= t; u++) acc += s[u] / sum * qkv[u * 3 * h + 2 * h + j * d + e];
                    o[t * h + j * d + e] = acc;
                }
            }
        for (int t = 0; t < T; t++)
            for (int k = 0; k < h; k++) {
                double acc = lw[5][k];
                for (int i = 0; i < h; i++) acc += o[t * h + i] * lw[4][(int64_t)i * h + k];
                x[t * h + k] += acc;
            }
        THF_LN(x, lw[6], lw[7], a)
        for (int t = 0; t < T; t++)
            for (int k = 0; k < f; k++) {
                double acc = lw[9][k];
                for (int i = 0; i < h; i++) acc += a[t * h + i] * lw[8][(int64_t)i * f + k];
                z[t * f + k] = 0.5 * acc * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (acc + 0.044715 * acc * acc * acc)));
            }
        for (int t = 0; t < T; t++)
            for (int k = 0; k < h; k++) {
                double acc = lw[11][k];
                for (int i = 0; i < f; i++) acc += z[t * f + i] * lw[10][(int64_t)i * h + k];
                x[t * h + k] += acc;
            }
    }
    float* const* fw = w + 2 + 12 * c->num_layers;
    THF_LN(x, fw[0], fw[1], a)
#undef THF_LN
    for (int t = 0; t < T; t++)
        for (int64_t v = 0; v < V; v++) {
            double acc = 0;
            for (int i = 0; i < h; i++) acc += a[t * h + i] * w[0][v * h + i]; /* lm_head tied to wte */
            logits[t * V + v] = acc;
        }
    free(x); free(a); free(qkv); free(o); free(z); free(s);
}

/* All HF tensors of canonical params, one malloc; ptrs[i] -> tensor i. */
static float* thf_export_all(const mt_config* c, int64_t V, const float* params, float** ptrs) {
    int64_t total = 0;
    for (int i = 0; i < mt_hf_gpt2_num_tensors(c); i++) {
        mt_hf_tensor t;
        mt_hf_gpt2_tensor(c, V, i, &t);
        total += t.numel;
    }
    float* data = (float*)malloc(sizeof(float) * (size_t)total);
    if (!data) return NULL;
    total = 0;
    for (int i = 0; i < mt_hf_gpt2_num_tensors(c); i++) {
        mt_hf_tensor t;
        mt_hf_gpt2_tensor(c, V, i, &t);
        mt_hf_gpt2_export_tensor(c, V, &t, params, data + total);
        ptrs[i] = data + total;
        total += t.numel;
    }
    return data;
}

/* dev/ref_gpt.py's logits for gpt2_tiny (computed in its own layout) from the exported weights
 * through the transformers-style forward: the mapping computes the same function. */
static test_result test_hf_gpt2_matches_reference_logits(void) {
    const char* path = "dev/data/gpt_vectors/gpt2_tiny.bin";
    size_t size = 0;
    char* blob = test_read_file(path, &size);
    if (!blob) SKIP_OR_FAIL_STRICT("%s not found (run from the repository root)", path);
    int32_t hd[256];
    EXPECT(size > 1280, "%s too small", path);
    memcpy(hd, blob, sizeof(hd));
    EXPECT(hd[0] == 20261121 && hd[2] == 0 && hd[14] == hd[5], "%s: not a GPT-2 vector file", path);
    mt_config c;
    mt_config_defaults(&c);
    c.hidden_dropout = c.attention_dropout = 0.0; /* the reference's gradients are dropout-free */
    c.num_layers = hd[3];
    c.hidden_size = hd[4];
    c.num_attention_heads = hd[5];
    c.ffn_hidden_size = hd[6];
    c.vocab_size = hd[7];
    c.max_position_embeddings = hd[8];
    c.seq_length = hd[9];
    c.train_iters = 1;
    float hyper[64];
    memcpy(hyper, blob + 1024, sizeof(hyper));
    c.norm_epsilon = hyper[9];
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    int64_t n = hd[13], Vp = c.padded_vocab_size;
    int T = hd[9], G = hd[10], S = hd[12];
    EXPECT(n == mt_num_parameters(&c) && Vp == hd[7], "parameter count / vocabulary");
    const float* params = (const float*)(blob + 1280);
    const int32_t* tokens = (const int32_t*)(blob + 1280 + 4 * n);
    const float* ref = (const float*)(blob + 1280 + 4 * n + 4 * (size_t)S * G * (T + 1));
    float* ptrs[64];
    EXPECT(mt_hf_gpt2_num_tensors(&c) <= 64, "too many layers for this test");
    float* data = thf_export_all(&c, Vp, params, ptrs); /* V = Vp: every row compared */
    double* logits = (double*)malloc(sizeof(double) * (size_t)T * Vp);
    EXPECT(data && logits, "alloc");
    double num = 0, den = 0;
    for (int g = 0; g < G; g++) {
        thf_hf_forward(&c, Vp, ptrs, tokens + (int64_t)g * (T + 1), T, logits);
        for (int64_t i = 0; i < (int64_t)T * Vp; i++) {
            double r = ref[(int64_t)g * T * Vp + i];
            num += (logits[i] - r) * (logits[i] - r);
            den += r * r;
        }
    }
    free(data);
    free(logits);
    free(blob);
    double rel = sqrt(num / den);
    EXPECT(rel < 1e-6, "transformers-style forward of the exported weights vs ref_gpt.py logits: rel err %.3g", rel);
    return TEST_PASS;
}

/* ---- directories: config.json + model.safetensors <-> checkpoint ------------------------------ */

static int thf_write_text(const char* dir, const char* name, const char* text) {
    char path[600];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return thf_write_bytes(path, text, strlen(text));
}

static test_result test_hf_gpt2_directories(void) {
    char root[256], hf_dir[300], ck_dir[300], out_dir[300], bf_dir[300], path[400];
    thf_path(root, sizeof(root), "dirs");
    thf_remove(root);
    snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
    snprintf(ck_dir, sizeof(ck_dir), "%s/ckpt", root);
    snprintf(out_dir, sizeof(out_dir), "%s/out", root);
    snprintf(bf_dir, sizeof(bf_dir), "%s/bf16", root);
    mt_config c = thf_small_config();
    c.norm_epsilon = 1e-6;
    int64_t n = mt_num_parameters(&c);
    float* p = thf_random_params(&c);
    mt_error err;
    EXPECT(p, "alloc");
    /* save as transformers would: config.json + model.safetensors */
    EXPECT_OK(mt_hf_save(hf_dir, &c, p, c.vocab_size, MT_ST_F32, 0, &err), &err);
    snprintf(path, sizeof(path), "%s/config.json", hf_dir);
    mt_json* cj = NULL;
    EXPECT_OK(mt_json_parse_file(&cj, path, &err), &err);
    const char* want_str[][2] = {{"model_type", "gpt2"}, {"activation_function", "gelu_new"}, {"torch_dtype", "float32"}};
    for (int i = 0; i < 3; i++) {
        const mt_json* v = mt_json_get(cj, want_str[i][0]);
        EXPECT(v && v->type == MT_JSON_STRING && !strcmp(v->string, want_str[i][1]), "config.json %s", want_str[i][0]);
    }
    const char* want_int[] = {"n_layer", "n_embd", "n_head", "n_inner", "n_positions", "n_ctx", "vocab_size", "bos_token_id",
                              "eos_token_id"};
    int64_t want_val[] = {2, 64, 4, 256, 16, 16, 100, 99, 99};
    for (int i = 0; i < 9; i++) {
        const mt_json* v = mt_json_get(cj, want_int[i]);
        EXPECT(v && v->is_integer && v->integer == want_val[i], "config.json %s", want_int[i]);
    }
    const mt_json* arch = mt_json_get(cj, "architectures");
    EXPECT(arch && arch->count == 1 && !strcmp(arch->items[0].string, "GPT2LMHeadModel"), "architectures");
    EXPECT(mt_json_get(cj, "tie_word_embeddings")->type == MT_JSON_TRUE, "tied");
    EXPECT(mt_json_get(cj, "layer_norm_epsilon")->number == 1e-6, "epsilon");
    mt_json_free(cj);

    /* load it back: the same config and bitwise the same parameters */
    mt_config c2;
    float* q = NULL;
    const mt_hf_arch* detected = NULL;
    EXPECT_OK(mt_hf_load(hf_dir, &c2, &q, &detected, &err), &err);
    EXPECT(detected == &mt_hf_gpt2_arch, "detected %s", detected ? detected->name : "nothing");
    EXPECT(c2.num_layers == 2 && c2.hidden_size == 64 && c2.num_attention_heads == 4 && c2.ffn_hidden_size == 256 &&
               c2.seq_length == 16 && c2.max_position_embeddings == 16 && c2.vocab_size == 100 &&
               c2.padded_vocab_size == 128 && c2.norm_epsilon == 1e-6 && c2.num_query_groups == 4 && c2.kv_channels == 16,
           "config from config.json");
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "load(save(p)) != p");
    free(q);

    /* through our checkpoint format and back */
    EXPECT_OK(mt_hf_checkpoint_write(ck_dir, &c2, p, 0, &err), &err);
    snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt", ck_dir);
    char* tracker = test_read_file(path, NULL);
    EXPECT(tracker && !strcmp(tracker, "0"), "tracker");
    free(tracker);
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00/model_optim_rng.bin", ck_dir);
    size_t size = 0;
    char* raw = test_read_file(path, &size);
    EXPECT(raw && size == 512 + 12 * (size_t)n, "checkpoint size %zu", size);
    int64_t hw[64];
    memcpy(hw, raw, sizeof(hw));
    double scale;
    memcpy(&scale, &hw[19], 8);
    int64_t want_h[23] = {0x4b43544d, 1, 2, 64, 4, 4, 16, 256, 128, 16, n, 1, 0, 0, 0, 0, 1234, 0, 2, hw[19], 1, 1, 0};
    for (int i = 0; i < 23; i++) EXPECT(hw[i] == want_h[i], "header word %d: %lld", i, (long long)hw[i]);
    double eps_word;
    memcpy(&eps_word, &hw[MT_CK_NORM_EPS_BITS], 8);
    EXPECT(eps_word == 1e-6 && hw[MT_CK_TRUE_VOCAB] == 100, "epsilon %g, true vocabulary %lld in the header", eps_word,
           (long long)hw[MT_CK_TRUE_VOCAB]);
    for (int i = 23; i < 64; i++) /* the GPT-2 flavour is all zero words; the manifest mark is 1 */
        EXPECT(i == MT_CK_MANIFESTED ? hw[i] == 1 : hw[i] == 0 || i == MT_CK_NORM_EPS_BITS || i == MT_CK_TRUE_VOCAB,
               "header word %d: %lld", i, (long long)hw[i]);
    /* committed with a manifest that verifies (the writer's CRC of what it wrote) */
    snprintf(path, sizeof(path), "%s/iter_0000000", ck_dir);
    EXPECT_OK(mt_checkpoint_manifest_verify(path, &err), &err);
    EXPECT(scale == 1.0, "loss scale");
    EXPECT(!memcmp(raw + 512, p, 4 * (size_t)n), "master weights");
    for (size_t i = 512 + 4 * (size_t)n; i < size; i++) EXPECT(raw[i] == 0, "Adam moments not zero");
    free(raw);
    /* it refuses to overwrite */
    err.message[0] = 0;
    EXPECT(mt_hf_checkpoint_write(ck_dir, &c2, p, 0, &err) == MT_ERR_IO && strstr(err.message, "already holds a checkpoint"),
           "overwrite: %s", err.message);

    mt_config c3;
    int64_t header[64];
    mt_error warning;
    EXPECT_OK(mt_hf_checkpoint_read(ck_dir, -1, 0, &c3, &q, header, &warning, &err), &err);
    EXPECT(!warning.message[0], "warning: %s", warning.message);
    EXPECT(c3.num_layers == 2 && c3.hidden_size == 64 && c3.padded_vocab_size == 128 && c3.max_position_embeddings == 16 &&
               header[12] == 0, "config from the checkpoint");
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "checkpoint read != written");
    EXPECT_OK(mt_hf_save(out_dir, &c3, q, 100, MT_ST_F32, 0, &err), &err);
    free(q);
    /* the exported model.safetensors is byte-identical to the first one */
    char a_path[400], b_path[400];
    snprintf(a_path, sizeof(a_path), "%s/model.safetensors", hf_dir);
    snprintf(b_path, sizeof(b_path), "%s/model.safetensors", out_dir);
    size_t na = 0, nb = 0;
    char* a = test_read_file(a_path, &na);
    char* b = test_read_file(b_path, &nb);
    EXPECT(a && b && na == nb && !memcmp(a, b, na), "exported model.safetensors differs");
    free(a);
    free(b);

    /* bfloat16 export: loads as the bf16-rounded parameters */
    EXPECT_OK(mt_hf_save(bf_dir, &c3, p, 100, MT_ST_BF16, 0, &err), &err);
    EXPECT_OK(mt_hf_load(bf_dir, &c2, &q, NULL, &err), &err);
    for (int64_t i = 0; i < n; i++) EXPECT(q[i] == mt_st_bf16_to_f32(mt_st_f32_to_bf16(p[i])), "bf16 element %lld", (long long)i);
    free(q);

    /* a truncated checkpoint: its manifest says so first; past the rule (--no-verify), the reader's own
     * size check; a bad tracker */
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00/model_optim_rng.bin", ck_dir);
    EXPECT(truncate(path, (off_t)(512 + 12 * n - 4)) == 0, "truncate");
    err.message[0] = 0;
    EXPECT(mt_hf_checkpoint_read(ck_dir, 0, 0, &c3, &q, NULL, NULL, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "mp_rank_00/model_optim_rng.bin has") && strstr(err.message, "(truncated)"),
           "truncated checkpoint: %s", err.message);
    EXPECT(mt_hf_checkpoint_read(ck_dir, 0, 1, &c3, &q, NULL, &warning, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "is truncated") && strstr(warning.message, "(truncated)"),
           "truncated checkpoint, --no-verify: %s (warning %s)", err.message, warning.message);
    EXPECT(mt_hf_checkpoint_read(ck_dir, 5, 0, &c3, &q, NULL, NULL, &err) == MT_ERR_IO && strstr(err.message, "iter_0000005"),
           "missing iteration: %s", err.message);
    EXPECT(thf_write_text(ck_dir, "latest_checkpointed_iteration.txt", "x7") == 0, "tracker");
    EXPECT(mt_hf_checkpoint_read(ck_dir, -1, 0, &c3, &q, NULL, NULL, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "iteration number"), "bad tracker: %s", err.message);
    /* a shape GPT-2 cannot hold */
    mt_config gqa = c2;
    gqa.num_query_groups = 2;
    EXPECT(mt_hf_gpt2_check_shape(&gqa, 100, &err) == MT_ERR_CONFIG && strstr(err.message, "query groups"), "gqa");
    EXPECT(mt_hf_gpt2_check_shape(&c2, 129, &err) == MT_ERR_ARG, "vocab above the padded size");
    free(p);
    thf_remove(root);
    return TEST_PASS;
}

/* config.json and weight files that must be refused, each with its message; and the variants accepted. */
static test_result test_hf_gpt2_rejects(void) {
    char root[256], dir[300];
    thf_path(root, sizeof(root), "rejects");
    thf_remove(root);
    snprintf(dir, sizeof(dir), "%s/hf", root);
    mt_config c = thf_small_config();
    float* p = thf_random_params(&c);
    mt_error err;
    EXPECT(p, "alloc");
    EXPECT_OK(mt_hf_save(dir, &c, p, 100, MT_ST_F32, 0, &err), &err);
    /* config.json = these fields, less the ones a case sets itself, plus the case's */
    const char* base[][2] = {{"model_type", "\"gpt2\""}, {"n_layer", "2"}, {"n_embd", "64"}, {"n_head", "4"},
                             {"n_positions", "16"}, {"vocab_size", "100"}};
    struct { const char* extra; mt_status status; const char* words; } cases[] = {
        {", \"n_inner\": null, \"activation_function\": \"gelu_new\"", MT_OK, ""},
        {", \"activation_function\": \"gelu_pytorch_tanh\", \"layer_norm_epsilon\": 1e-05", MT_OK, ""},
        {", \"activation_function\": \"gelu\"", MT_ERR_CONFIG, "activation_function \"gelu\" is not supported"},
        {", \"scale_attn_by_inverse_layer_idx\": true", MT_ERR_CONFIG, "scale_attn_by_inverse_layer_idx"},
        {", \"scale_attn_weights\": false", MT_ERR_CONFIG, "scale_attn_weights"},
        {", \"add_cross_attention\": true", MT_ERR_CONFIG, "add_cross_attention"},
        {", \"n_inner\": 128", MT_ERR_FORMAT, "tensor transformer.h.0.mlp.c_fc.weight has shape [64, 256] but config.json implies [64, 128]"},
        {", \"n_layer\": 3", MT_ERR_FORMAT, "transformer.h.2.ln_1.weight is missing"},
        {", \"tie_word_embeddings\": false", MT_ERR_CONFIG, "untied output layers are not supported"},
        {", \"n_head\": 5", MT_ERR_CONFIG, "not divisible by n_head"},
        {", \"n_layer\": \"2\"", MT_ERR_FORMAT, "\"n_layer\" is not an integer"},
        /* n_inner's default 4 x n_embd computed in 64 bits (fuzz_hf_config: int overflow at n_embd 2^30) */
        {", \"n_embd\": 1073741824, \"n_head\": 1", MT_ERR_CONFIG, "n_inner (4 x n_embd 1073741824 when absent) = 4294967296"},
        /* at most 2^26 layers: 12 tensors a layer counted in an int (fuzz_hf_config: 12 x 2^30 overflowed) */
        {", \"n_layer\": 1073741824", MT_ERR_FORMAT, "\"n_layer\" is 1073741824, outside [1, 67108864]"},
        {", \"n_layer\": 0", MT_ERR_FORMAT, "\"n_layer\" is 0, outside"},
        {", \"layer_norm_epsilon\": -1", MT_ERR_FORMAT, "layer_norm_epsilon"},
        {", \"model_type\": \"llama\"", MT_ERR_FORMAT, "duplicate object key"},
        {",", MT_ERR_FORMAT, "malformed JSON"},
    };
    char text[1024];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len = (size_t)snprintf(text, sizeof(text), "{\"model_type\": \"gpt2\"");
        for (int k = 1; k < 6; k++) {
            char quoted[64];
            snprintf(quoted, sizeof(quoted), "\"%s\"", base[k][0]);
            if (!strstr(cases[i].extra, quoted))
                len += (size_t)snprintf(text + len, sizeof(text) - len, ", %s: %s", quoted, base[k][1]);
        }
        snprintf(text + len, sizeof(text) - len, "%s}", cases[i].extra);
        EXPECT(thf_write_text(dir, "config.json", text) == 0, "write");
        mt_config c2;
        float* q = NULL;
        err.message[0] = 0;
        mt_status st = mt_hf_load(dir, &c2, &q, NULL, &err);
        EXPECT(st == cases[i].status && strstr(err.message, cases[i].words), "case %zu: %s -> %s: %s", i, cases[i].extra,
               mt_status_name(st), err.message);
        if (st == MT_OK) EXPECT(c2.ffn_hidden_size == 256 && !memcmp(p, q, sizeof(float) * (size_t)mt_num_parameters(&c)), "case %zu", i);
        free(q);
    }
    EXPECT(thf_write_text(dir, "config.json", "{\"model_type\": \"bert\", \"architectures\": [\"BertModel\"]}") == 0, "write");
    mt_config c2;
    float* q = NULL;
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "model_type \"bert\" (architectures[0] \"BertModel\") is not supported"),
           "bert: %s", err.message);
    EXPECT(thf_write_text(dir, "config.json", "{\"model_type\": \"gpt2\", \"architectures\": [\"LlamaForCausalLM\"]}") == 0, "write");
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "disagree"), "mixed: %s", err.message);
    size_t len = (size_t)snprintf(text, sizeof(text), "{");
    for (int k = 0; k < 6; k++) len += (size_t)snprintf(text + len, sizeof(text) - len, "%s\"%s\": %s", k ? ", " : "", base[k][0], base[k][1]);
    snprintf(text + len, sizeof(text) - len, "}");
    EXPECT(thf_write_text(dir, "config.json", text) == 0, "write");

    /* weight files: no transformer. prefix + mask buffers accepted; an extra tensor, an untied head refused */
    char path[400];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    int count = mt_hf_gpt2_num_tensors(&c);
    float* ptrs[64];
    float* data = thf_export_all(&c, 100, p, ptrs);
    mt_st_write_tensor wt[64];
    mt_hf_tensor ht[64];
    memset(wt, 0, sizeof(wt));
    for (int i = 0; i < count; i++) {
        mt_hf_gpt2_tensor(&c, 100, i, &ht[i]);
        wt[i].name = ht[i].name + strlen("transformer."); /* GPT2Model's names */
        wt[i].dtype = MT_ST_F32;
        wt[i].ndim = ht[i].ndim;
        wt[i].shape[0] = ht[i].shape[0];
        wt[i].shape[1] = ht[i].shape[1];
        wt[i].data = ptrs[i];
    }
    float mask[16 * 16], masked = -1e4f;
    for (int i = 0; i < 256; i++) mask[i] = (float)(i % 16 <= i / 16);
    mt_st_write_tensor extra[3];
    memset(extra, 0, sizeof(extra));
    extra[0].name = "h.0.attn.bias"; extra[0].dtype = MT_ST_F32; extra[0].ndim = 2; extra[0].shape[0] = 16;
    extra[0].shape[1] = 16; extra[0].data = mask;
    extra[1].name = "h.1.attn.masked_bias"; extra[1].dtype = MT_ST_F32; extra[1].ndim = 0; extra[1].data = &masked;
    extra[2].name = "lm_head.weight"; extra[2].dtype = MT_ST_F32; extra[2].ndim = 2; extra[2].shape[0] = 100;
    extra[2].shape[1] = 64; extra[2].data = ptrs[0];
    memcpy(wt + count, extra, sizeof(extra));
    EXPECT_OK(mt_safetensors_write(path, wt, count + 3, NULL, &err), &err);
    EXPECT_OK(mt_hf_load(dir, &c2, &q, NULL, &err), &err);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)mt_num_parameters(&c)), "old names: parameters differ");
    free(q);
    /* lm_head.weight that is not the embeddings */
    float* head = (float*)malloc(sizeof(float) * 6400);
    memcpy(head, ptrs[0], sizeof(float) * 6400);
    head[17] += 1.0f;
    wt[count + 2].data = head;
    EXPECT_OK(mt_safetensors_write(path, wt, count + 3, NULL, &err), &err);
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "lm_head.weight differs"),
           "untied head: %s", err.message);
    free(head);
    /* a tensor GPT2LMHeadModel does not have */
    extra[2].name = "score.weight";
    wt[count + 2] = extra[2];
    EXPECT_OK(mt_safetensors_write(path, wt, count + 3, NULL, &err), &err);
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "unexpected tensor score.weight"),
           "extra tensor: %s", err.message);
    /* both spellings of one tensor */
    wt[count + 2].name = "transformer.wte.weight";
    EXPECT_OK(mt_safetensors_write(path, wt, count + 3, NULL, &err), &err);
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "holds both"),
           "both names: %s", err.message);
    /* no weights at all */
    unlink(path);
    EXPECT(mt_hf_load(dir, &c2, &q, NULL, &err) == MT_ERR_IO && strstr(err.message, "neither model.safetensors"),
           "no weights: %s", err.message);
    free(data);
    free(p);
    thf_remove(root);
    return TEST_PASS;
}

/* ---- Llama: directories written here, tensor by tensor, independently of the mapping ----------- */

typedef struct { int L, h, n, g, d, f, V, P, tied; } thf_llama_spec;
/* GQA (4 heads, 2 groups), head_dim 24 != hidden / heads, untied; every dimension distinct */
static const thf_llama_spec thf_llama_gqa = {2, 64, 4, 2, 24, 80, 100, 32, 0};
/* one group per head, head_dim = hidden / heads (both left to config.json's defaults), tied */
static const thf_llama_spec thf_llama_tied = {2, 64, 4, 4, 16, 80, 100, 32, 1};

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2], numel;
    float* data;
} thf_tensor;
typedef struct {
    int count;
    thf_tensor t[80];
} thf_model;

/* LlamaForCausalLM's tensors with random values, in its state-dict order */
static void thf_llama_tensors(const thf_llama_spec* s, thf_model* m) {
    memset(m, 0, sizeof(*m));
    const char* names[9] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"};
    int64_t rows[9] = {s->n * s->d, s->g * s->d, s->g * s->d, s->h, s->f, s->f, s->h, s->h, s->h};
    int64_t cols[9] = {s->h, s->h, s->h, s->n * s->d, s->h, s->h, s->f, 0, 0};
    for (int i = 0; i < 2 + 9 * s->L + !s->tied; i++) {
        thf_tensor* t = &m->t[m->count++];
        t->ndim = 2;
        if (i == 0) {
            snprintf(t->name, sizeof(t->name), "model.embed_tokens.weight");
            t->shape[0] = s->V;
            t->shape[1] = s->h;
        } else if (i <= 9 * s->L) {
            int k = (i - 1) % 9;
            snprintf(t->name, sizeof(t->name), "model.layers.%d.%s.weight", (i - 1) / 9, names[k]);
            t->ndim = cols[k] ? 2 : 1;
            t->shape[0] = rows[k];
            t->shape[1] = cols[k];
        } else if (i == 1 + 9 * s->L) {
            snprintf(t->name, sizeof(t->name), "model.norm.weight");
            t->ndim = 1;
            t->shape[0] = s->h;
        } else {
            snprintf(t->name, sizeof(t->name), "lm_head.weight");
            t->shape[0] = s->V;
            t->shape[1] = s->h;
        }
        t->numel = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1);
        t->data = (float*)malloc(sizeof(float) * (size_t)t->numel);
        for (int64_t e = 0; e < t->numel; e++) t->data[e] = thf_uniform();
    }
}

static void thf_model_free(thf_model* m) {
    for (int i = 0; i < m->count; i++) free(m->t[i].data);
    m->count = 0;
}

static const thf_tensor* thf_model_find(const thf_model* m, const char* name) {
    for (int i = 0; i < m->count; i++)
        if (!strcmp(m->t[i].name, name)) return &m->t[i];
    return NULL;
}

/* dir/model.safetensors: m's tensors (in reverse: the order must not matter) but `skip`, plus `extra` */
static mt_status thf_write_model(const char* dir, const thf_model* m, const char* skip, const mt_st_write_tensor* extra,
                                 mt_error* err) {
    char path[600];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    mt_st_write_tensor wt[82];
    int k = 0;
    memset(wt, 0, sizeof(wt));
    for (int i = m->count - 1; i >= 0; i--) {
        if (skip && !strcmp(m->t[i].name, skip)) continue;
        wt[k].name = m->t[i].name;
        wt[k].dtype = MT_ST_F32;
        wt[k].ndim = m->t[i].ndim;
        wt[k].shape[0] = m->t[i].shape[0];
        wt[k].shape[1] = m->t[i].shape[1];
        wt[k++].data = m->t[i].data;
    }
    if (extra) wt[k++] = *extra;
    static const char* const metadata[] = {"format", "pt", NULL}; /* as transformers writes (4.x requires it) */
    return mt_safetensors_write(path, wt, k, metadata, err);
}

/* config.json as transformers 4 writes it; kv heads and head_dim only when not the defaults */
static void thf_llama_config_text(char* buf, size_t cap, const thf_llama_spec* s, const char* extra) {
    size_t n = (size_t)snprintf(buf, cap,
                                "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": %d, "
                                "\"intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d, "
                                "\"max_position_embeddings\": %d, \"vocab_size\": %d, \"rms_norm_eps\": 1e-05, "
                                "\"tie_word_embeddings\": %s",
                                s->h, s->f, s->L, s->n, s->P, s->V, s->tied ? "true" : "false");
    if (s->g != s->n) n += (size_t)snprintf(buf + n, cap - n, ", \"num_key_value_heads\": %d", s->g);
    if (s->d * s->n != s->h) n += (size_t)snprintf(buf + n, cap - n, ", \"head_dim\": %d", s->d);
    snprintf(buf + n, cap - n, "%s}", extra);
}

static const char* const thf_llama3 =
    ", \"hidden_act\": \"silu\", \"attention_bias\": false, \"mlp_bias\": false, \"rope_theta\": 500000.0, "
    "\"rope_scaling\": {\"factor\": 8.0, \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, "
    "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}, \"torch_dtype\": \"float32\"";

/* Every HF tensor is where Megatron's layout puts it, stated here on its own: per query group j, the
 * q rows of its n/g heads, then its k rows, its v rows; fc1 = [gate; up]; padded vocabulary rows 0. */
static test_result thf_llama_check_params(const thf_llama_spec* s, const thf_model* m, const mt_config* c, const float* p) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    int64_t total = mt_param_layout(c, info);
    int64_t h = s->h, d = s->d, f = s->f, nd = s->n * d, per = s->n / s->g * d + 2 * d, R = (s->n + 2 * s->g) * d;
    int64_t want_total = 128 * h * (s->tied ? 1 : 2) + s->L * (2 * h + R * h + h * nd + 3 * f * h) + h;
    EXPECT(total == want_total && total == mt_num_parameters(c), "parameters %lld, want %lld", (long long)total,
           (long long)want_total);
    int absent[] = {MT_P_POSITION_EMBEDDINGS, MT_P_LN1_BIAS, MT_P_QKV_BIAS, MT_P_PROJ_BIAS, MT_P_LN2_BIAS,
                    MT_P_FC1_BIAS, MT_P_FC2_BIAS, MT_P_FINAL_LN_BIAS};
    for (int k = 0; k < 8; k++) EXPECT(info[absent[k]].numel == 0, "tensor %s present", info[absent[k]].name);
    EXPECT(info[MT_P_OUTPUT_WEIGHT].numel == (s->tied ? 0 : 128 * h), "output weight %lld", (long long)info[MT_P_OUTPUT_WEIGHT].numel);
    char name[96];
    for (int out = 0; out < 2 - s->tied; out++) {
        const thf_tensor* t = thf_model_find(m, out ? "lm_head.weight" : "model.embed_tokens.weight");
        const float* w = p + info[out ? MT_P_OUTPUT_WEIGHT : MT_P_WORD_EMBEDDINGS].offset;
        for (int64_t e = 0; e < 128 * h; e++)
            EXPECT(w[e] == (e < s->V * h ? t->data[e] : 0.0f), "%s element %lld", t->name, (long long)e);
    }
    for (int l = 0; l < s->L; l++) {
        const float* qkv = p + info[MT_P_QKV_WEIGHT].offset + l * R * h;
        const thf_tensor* part[3];
        const char* parts[3] = {"q_proj", "k_proj", "v_proj"};
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.%s.weight", l, parts[k]);
            part[k] = thf_model_find(m, name);
        }
        for (int j = 0; j < s->g; j++)
            for (int64_t w = 0; w < per; w++) {
                int64_t q_rows = s->n / s->g * d;
                const float* src = w < q_rows ? part[0]->data + (j * q_rows + w) * h
                                 : w < q_rows + d ? part[1]->data + (j * d + w - q_rows) * h
                                                  : part[2]->data + (j * d + w - q_rows - d) * h;
                EXPECT(!memcmp(qkv + (j * per + w) * h, src, sizeof(float) * (size_t)h), "layer %d group %d qkv row %lld", l,
                       j, (long long)w);
            }
        struct { const char* hf; int kind; int64_t numel, at; } plain[] = {
            {"self_attn.o_proj", MT_P_PROJ_WEIGHT, h * nd, 0},  {"mlp.gate_proj", MT_P_FC1_WEIGHT, f * h, 0},
            {"mlp.up_proj", MT_P_FC1_WEIGHT, f * h, f * h},     {"mlp.down_proj", MT_P_FC2_WEIGHT, h * f, 0},
            {"input_layernorm", MT_P_LN1_WEIGHT, h, 0},         {"post_attention_layernorm", MT_P_LN2_WEIGHT, h, 0}};
        for (int k = 0; k < 6; k++) {
            snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, plain[k].hf);
            int64_t per_layer = info[plain[k].kind].numel / s->L;
            const float* dst = p + info[plain[k].kind].offset + l * per_layer + plain[k].at;
            EXPECT(!memcmp(dst, thf_model_find(m, name)->data, sizeof(float) * (size_t)plain[k].numel), "%s", name);
        }
    }
    EXPECT(!memcmp(p + info[MT_P_FINAL_LN_WEIGHT].offset, thf_model_find(m, "model.norm.weight")->data, sizeof(float) * (size_t)h),
           "model.norm.weight");
    return TEST_PASS;
}

/* HF_DIR's model.safetensors holds exactly m's tensors, F32, bitwise */
static test_result thf_same_tensors(const char* dir, const thf_model* m) {
    char path[600];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    mt_safetensors* st = NULL;
    mt_error err;
    EXPECT_OK(mt_safetensors_open(&st, path, &err), &err);
    int count = mt_safetensors_count(st);
    test_result r = TEST_PASS;
    for (int i = 0; i < m->count && r == TEST_PASS; i++) {
        const mt_st_tensor* t = mt_safetensors_find(st, m->t[i].name);
        int ok = t && t->dtype == MT_ST_F32 && t->ndim == m->t[i].ndim && t->shape[0] == m->t[i].shape[0] &&
                 (t->ndim == 1 || t->shape[1] == m->t[i].shape[1]) &&
                 !memcmp(mt_safetensors_data(st, t), m->t[i].data, sizeof(float) * (size_t)m->t[i].numel);
        if (!ok) printf("    FAIL exported %s: %s\n", m->t[i].name, t ? "differs" : "missing");
        if (!ok) r = TEST_FAIL;
    }
    mt_safetensors_close(st);
    EXPECT(r == TEST_PASS && count == m->count, "exported %d tensors, the original %d", count, m->count);
    return TEST_PASS;
}

static int thf_json_equal(const mt_json* a, const mt_json* b) {
    if (!a || !b || a->type != b->type) return 0;
    switch (a->type) {
        case MT_JSON_NUMBER: return a->number == b->number;
        case MT_JSON_STRING: return !strcmp(a->string, b->string);
        case MT_JSON_ARRAY:
            if (a->count != b->count) return 0;
            for (int i = 0; i < a->count; i++)
                if (!thf_json_equal(&a->items[i], &b->items[i])) return 0;
            return 1;
        case MT_JSON_OBJECT:
            if (a->count != b->count) return 0;
            for (int i = 0; i < a->count; i++)
                if (!thf_json_equal(&a->items[i], mt_json_get(b, a->keys[i]))) return 0;
            return 1;
        default: return 1;
    }
}

/* Every field of the original config.json has the same value in the exported one. */
static test_result thf_config_roundtrip(const char* original_text, const char* exported_dir, mt_json** exported) {
    char path[600];
    mt_error err;
    mt_json* a = NULL;
    EXPECT_OK(mt_json_parse(&a, original_text, strlen(original_text), "original", &err), &err);
    snprintf(path, sizeof(path), "%s/config.json", exported_dir);
    EXPECT_OK(mt_json_parse_file(exported, path, &err), &err);
    for (int i = 0; i < a->count; i++)
        EXPECT(thf_json_equal(&a->items[i], mt_json_get(*exported, a->keys[i])), "config.json field %s differs", a->keys[i]);
    mt_json_free(a);
    return TEST_PASS;
}

static double thf_word_double(const int64_t* h, int w) {
    double x;
    memcpy(&x, &h[w], sizeof(x));
    return x;
}

/* A tiny GQA Llama with llama3 rope scaling and an untied head: import (every tensor in place, the
 * header's flavour words), checkpoint, export bitwise to the original tensors and config.json; the
 * transformers 5 config.json form, bf16 and sharded exports. */
static test_result test_hf_llama_directories(void) {
    char root[256], hf_dir[300], ck_dir[300], out_dir[300], v5_dir[300], sh_dir[300], path[400], text[2048];
    thf_path(root, sizeof(root), "llama");
    thf_remove(root);
    snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
    snprintf(ck_dir, sizeof(ck_dir), "%s/ckpt", root);
    snprintf(out_dir, sizeof(out_dir), "%s/out", root);
    snprintf(v5_dir, sizeof(v5_dir), "%s/v5", root);
    snprintf(sh_dir, sizeof(sh_dir), "%s/sharded", root);
    const thf_llama_spec* s = &thf_llama_gqa;
    thf_model m;
    thf_llama_tensors(s, &m);
    mt_error err;
    EXPECT(mt_make_directories(hf_dir) == 0, "mkdir");
    thf_llama_config_text(text, sizeof(text), s, thf_llama3);
    EXPECT(thf_write_text(hf_dir, "config.json", text) == 0, "write config");
    EXPECT_OK(thf_write_model(hf_dir, &m, NULL, NULL, &err), &err);

    mt_config c;
    float* p = NULL;
    const mt_hf_arch* arch = NULL;
    EXPECT_OK(mt_hf_load(hf_dir, &c, &p, &arch, &err), &err);
    EXPECT(arch == &mt_hf_llama_arch, "detected %s", arch->name);
    EXPECT(c.num_layers == 2 && c.hidden_size == 64 && c.num_attention_heads == 4 && c.num_query_groups == 2 &&
               c.kv_channels == 24 && c.ffn_hidden_size == 80 && c.max_position_embeddings == 32 && c.vocab_size == 100 &&
               c.padded_vocab_size == 128 && c.norm_epsilon == 1e-5, "shape from config.json");
    EXPECT(c.normalization == MT_NORM_RMSNORM && c.swiglu && c.position_embedding_type == MT_POSITION_ROPE &&
               c.rotary_base == 500000.0 && c.rotary_percent == 1.0 && c.use_rope_scaling && c.rope_scaling_factor == 8.0 &&
               c.untie_embeddings_and_output_weights && !c.add_bias_linear, "flavour from config.json");
    if (thf_llama_check_params(s, &m, &c, p) != TEST_PASS) return TEST_FAIL;
    int64_t n = mt_num_parameters(&c);

    /* the checkpoint: the flavour words, the epsilon, the true vocabulary */
    EXPECT_OK(mt_hf_checkpoint_write(ck_dir, &c, p, 0, &err), &err);
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00/model_optim_rng.bin", ck_dir);
    size_t size = 0;
    char* raw = test_read_file(path, &size);
    EXPECT(raw && size == 512 + 12 * (size_t)n, "checkpoint size %zu", size);
    int64_t hw[64];
    memcpy(hw, raw, sizeof(hw));
    free(raw);
    EXPECT(hw[MT_CK_GROUPS] == 2 && hw[MT_CK_KV] == 24 && hw[MT_CK_FFN] == 80 && hw[MT_CK_VOCAB] == 128 &&
               hw[MT_CK_POSITIONS] == 32 && hw[MT_CK_NUM_PARAMS] == n, "shape words");
    EXPECT(hw[MT_CK_NORMALIZATION] == MT_NORM_RMSNORM && hw[MT_CK_SWIGLU] == 1 && hw[MT_CK_POSITION_TYPE] == MT_POSITION_ROPE &&
               thf_word_double(hw, MT_CK_ROTARY_BASE_BITS) == 500000.0 && thf_word_double(hw, MT_CK_ROTARY_PERCENT_BITS) == 1.0 &&
               thf_word_double(hw, MT_CK_ROPE_SCALING_FACTOR_BITS) == 8.0 && hw[MT_CK_UNTIED] == 1 &&
               hw[MT_CK_NO_BIAS_LINEAR] == 1, "flavour words");
    EXPECT(thf_word_double(hw, MT_CK_NORM_EPS_BITS) == 1e-5 && hw[MT_CK_TRUE_VOCAB] == 100, "epsilon / true vocabulary words");
    mt_config c2;
    float* q = NULL;
    int64_t header[64];
    EXPECT_OK(mt_hf_checkpoint_read(ck_dir, -1, 0, &c2, &q, header, NULL, &err), &err);
    EXPECT(c2.num_query_groups == 2 && c2.kv_channels == 24 && c2.normalization == MT_NORM_RMSNORM && c2.swiglu &&
               c2.position_embedding_type == MT_POSITION_ROPE && c2.rotary_base == 500000.0 && c2.use_rope_scaling &&
               c2.rope_scaling_factor == 8.0 && c2.untie_embeddings_and_output_weights && !c2.add_bias_linear &&
               c2.norm_epsilon == 1e-5 && header[MT_CK_TRUE_VOCAB] == 100, "config from the checkpoint");
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "checkpoint read != written");

    /* export: the original tensors bitwise, config.json's fields */
    EXPECT_OK(mt_hf_save(out_dir, &c2, q, header[MT_CK_TRUE_VOCAB], MT_ST_F32, 0, &err), &err);
    if (thf_same_tensors(out_dir, &m) != TEST_PASS) return TEST_FAIL;
    mt_json* cj = NULL;
    if (thf_config_roundtrip(text, out_dir, &cj) != TEST_PASS) return TEST_FAIL;
    EXPECT(mt_json_get(cj, "pretraining_tp")->integer == 1 && mt_json_get(cj, "rope_scaling")->count == 5, "exported config");
    mt_json_free(cj);
    float* r = NULL;
    EXPECT_OK(mt_hf_load(out_dir, &c2, &r, NULL, &err), &err);
    EXPECT(!memcmp(p, r, sizeof(float) * (size_t)n), "load(export) != import");
    free(r);

    /* transformers 5's config.json: rope_parameters instead of rope_theta + rope_scaling */
    EXPECT(mt_make_directories(v5_dir) == 0, "mkdir");
    thf_llama_config_text(text, sizeof(text), s,
                          ", \"hidden_act\": \"silu\", \"dtype\": \"float32\", \"rope_parameters\": {\"factor\": 8.0, "
                          "\"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192, "
                          "\"rope_theta\": 500000.0, \"rope_type\": \"llama3\"}");
    EXPECT(thf_write_text(v5_dir, "config.json", text) == 0, "write config");
    EXPECT_OK(thf_write_model(v5_dir, &m, NULL, NULL, &err), &err);
    EXPECT_OK(mt_hf_load(v5_dir, &c2, &r, NULL, &err), &err);
    EXPECT(c2.rotary_base == 500000.0 && c2.use_rope_scaling && c2.rope_scaling_factor == 8.0 && !memcmp(p, r, sizeof(float) * (size_t)n),
           "rope_parameters");
    free(r);

    /* bfloat16: loads as the rounded parameters; sharded: the same parameters through the index */
    EXPECT_OK(mt_hf_save(out_dir, &c, p, 100, MT_ST_BF16, 0, &err), &err);
    EXPECT_OK(mt_hf_load(out_dir, &c2, &r, NULL, &err), &err);
    for (int64_t i = 0; i < n; i++) EXPECT(r[i] == mt_st_bf16_to_f32(mt_st_f32_to_bf16(p[i])), "bf16 element %lld", (long long)i);
    free(r);
    EXPECT_OK(mt_hf_save(sh_dir, &c, p, 100, MT_ST_F32, 40000, &err), &err);
    snprintf(path, sizeof(path), "%s/model.safetensors", sh_dir);
    EXPECT(access(path, F_OK) != 0, "sharded export wrote model.safetensors");
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", sh_dir);
    EXPECT_OK(mt_json_parse_file(&cj, path, &err), &err);
    const mt_json* map = mt_json_get(cj, "weight_map");
    EXPECT(map && map->count == m.count && mt_json_get(cj, "metadata") && !strcmp(map->items[0].string, "model-00001-of-00012.safetensors") &&
               !strcmp(map->items[map->count - 1].string, "model-00012-of-00012.safetensors"), "index");
    mt_json_free(cj);
    EXPECT_OK(mt_hf_load(sh_dir, &c2, &r, NULL, &err), &err);
    EXPECT(!memcmp(p, r, sizeof(float) * (size_t)n), "sharded export loads differently");
    free(r);
    /* exporting the single file again over it removes the index */
    EXPECT_OK(mt_hf_save(sh_dir, &c, p, 100, MT_ST_F32, 0, &err), &err);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", sh_dir);
    EXPECT(access(path, F_OK) != 0, "stale index left behind");
    free(p);
    free(q);
    thf_model_free(&m);
    thf_remove(root);
    return TEST_PASS;
}

/* Tied embeddings, MHA, no rope scaling, config.json's defaults for kv heads and head_dim. */
static test_result test_hf_llama_tied(void) {
    char root[256], hf_dir[300], out_dir[300], text[2048];
    thf_path(root, sizeof(root), "llama_tied");
    thf_remove(root);
    snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
    snprintf(out_dir, sizeof(out_dir), "%s/out", root);
    const thf_llama_spec* s = &thf_llama_tied;
    thf_model m;
    thf_llama_tensors(s, &m);
    mt_error err;
    EXPECT(mt_make_directories(hf_dir) == 0, "mkdir");
    thf_llama_config_text(text, sizeof(text), s, ", \"rope_scaling\": null");
    EXPECT(thf_write_text(hf_dir, "config.json", text) == 0, "write config");
    EXPECT_OK(thf_write_model(hf_dir, &m, NULL, NULL, &err), &err);
    mt_config c;
    float *p = NULL, *q = NULL;
    EXPECT_OK(mt_hf_load(hf_dir, &c, &p, NULL, &err), &err);
    EXPECT(c.num_query_groups == 4 && c.kv_channels == 16 && !c.untie_embeddings_and_output_weights && !c.use_rope_scaling &&
               c.rotary_base == 10000.0, "defaults");
    if (thf_llama_check_params(s, &m, &c, p) != TEST_PASS) return TEST_FAIL;
    int64_t n = mt_num_parameters(&c);
    EXPECT_OK(mt_hf_save(out_dir, &c, p, 100, MT_ST_F32, 0, &err), &err);
    if (thf_same_tensors(out_dir, &m) != TEST_PASS) return TEST_FAIL; /* no lm_head.weight */
    mt_json* cj = NULL;
    if (thf_config_roundtrip(text, out_dir, &cj) != TEST_PASS) return TEST_FAIL;
    EXPECT(mt_json_get(cj, "head_dim")->integer == 16 && mt_json_get(cj, "num_key_value_heads")->integer == 4 &&
               mt_json_get(cj, "rope_theta")->number == 10000.0, "exported defaults");
    mt_json_free(cj);
    /* an lm_head.weight equal to the embeddings is accepted; a different one is not */
    const thf_tensor* e = &m.t[0];
    float* head = (float*)malloc(sizeof(float) * (size_t)e->numel);
    memcpy(head, e->data, sizeof(float) * (size_t)e->numel);
    mt_st_write_tensor extra;
    memset(&extra, 0, sizeof(extra));
    extra.name = "lm_head.weight";
    extra.dtype = MT_ST_F32;
    extra.ndim = 2;
    extra.shape[0] = e->shape[0];
    extra.shape[1] = e->shape[1];
    extra.data = head;
    EXPECT_OK(thf_write_model(hf_dir, &m, NULL, &extra, &err), &err);
    EXPECT_OK(mt_hf_load(hf_dir, &c, &q, NULL, &err), &err);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "with a tied lm_head.weight");
    free(q);
    head[5] += 1.0f;
    EXPECT_OK(thf_write_model(hf_dir, &m, NULL, &extra, &err), &err);
    EXPECT(mt_hf_load(hf_dir, &c, &q, NULL, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "lm_head.weight differs from model.embed_tokens.weight"), "differing head: %s", err.message);
    free(head);
    free(p);
    thf_model_free(&m);
    thf_remove(root);
    return TEST_PASS;
}

/* What must be refused, on import and on export, each with one line naming the problem. */
static test_result test_hf_llama_rejects(void) {
    char root[256], dir[300], out[300], text[2048], extra[1024];
    thf_path(root, sizeof(root), "llama_rejects");
    thf_remove(root);
    snprintf(dir, sizeof(dir), "%s/hf", root);
    snprintf(out, sizeof(out), "%s/out", root);
    thf_llama_spec s = thf_llama_gqa;
    thf_model m;
    thf_llama_tensors(&s, &m);
    mt_error err;
    EXPECT(mt_make_directories(dir) == 0, "mkdir");
    float buffer[12] = {0};
    mt_st_write_tensor inv_freq, bias;
    memset(&inv_freq, 0, sizeof(inv_freq));
    inv_freq.name = "model.layers.1.self_attn.rotary_emb.inv_freq";
    inv_freq.dtype = MT_ST_F32;
    inv_freq.ndim = 1;
    inv_freq.shape[0] = 12;
    inv_freq.data = buffer;
    bias = inv_freq;
    bias.name = "model.layers.0.self_attn.q_proj.bias";
    bias.shape[0] = 96;
    float biases[96] = {0};
    bias.data = biases;
    const char* llama3_low2 = ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 2.0, "
                              "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}";
    const char* llama3_4k = ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                            "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 4096}";
    struct {
        const char* extra;           /* config.json fields */
        int groups;                  /* config.json's num_key_value_heads (0: 2, as the tensors) */
        const char* skip;            /* a tensor left out */
        const mt_st_write_tensor* add; /* a tensor added */
        mt_status status;
        const char* words;
    } cases[] = {
        {", \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}", 0, NULL, NULL, MT_ERR_CONFIG,
         "rope_scaling type \"linear\" is not supported: megatron.c's RoPE scaling is Llama 3.1's"},
        {", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}", 0, NULL, NULL, MT_ERR_CONFIG,
         "rope_scaling type \"dynamic\" is not supported"},
        {", \"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 4.0}", 0, NULL, NULL,
         MT_ERR_CONFIG, "rope_parameters type \"yarn\" is not supported"},
        {llama3_low2, 0, NULL, NULL, MT_ERR_CONFIG, "rope_scaling low_freq_factor 2 is not supported"},
        {llama3_4k, 0, NULL, NULL, MT_ERR_CONFIG, "rope_scaling original_max_position_embeddings 4096 is not supported"},
        {", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}", 0, NULL, NULL, MT_ERR_FORMAT,
         "\"low_freq_factor\" is missing"},
        {", \"partial_rotary_factor\": 0.5", 0, NULL, NULL, MT_ERR_CONFIG, "partial_rotary_factor 0.5 is not supported"},
        {", \"attention_bias\": true", 0, NULL, NULL, MT_ERR_CONFIG, "attention_bias true is not supported"},
        {", \"mlp_bias\": true", 0, NULL, NULL, MT_ERR_CONFIG, "mlp_bias true is not supported"},
        {", \"hidden_act\": \"gelu\"", 0, NULL, NULL, MT_ERR_CONFIG, "hidden_act \"gelu\" is not supported"},
        {"", 3, NULL, NULL, MT_ERR_CONFIG, "num_attention_heads 4 is not divisible by num_key_value_heads 3"},
        {"", 4, NULL, NULL, MT_ERR_FORMAT,
         "tensor model.layers.0.self_attn.k_proj.weight has shape [48, 64] but config.json implies [96, 64]"},
        {"", 0, "model.layers.0.self_attn.k_proj.weight", NULL, MT_ERR_FORMAT,
         "tensor model.layers.0.self_attn.k_proj.weight is missing"},
        {"", 0, "lm_head.weight", NULL, MT_ERR_FORMAT, "tensor lm_head.weight is missing"},
        {"", 0, NULL, &bias, MT_ERR_FORMAT,
         "unexpected tensor model.layers.0.self_attn.q_proj.bias (not part of LlamaForCausalLM)"},
        {", \"model_type\": \"mistral\"", 0, NULL, NULL, MT_ERR_FORMAT, "duplicate object key"},
        /* accepted: an old rotary buffer; rope_type "default" */
        {"", 0, NULL, &inv_freq, MT_OK, ""},
        {", \"rope_scaling\": {\"rope_type\": \"default\"}", 0, NULL, NULL, MT_OK, ""},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        s.g = cases[i].groups ? cases[i].groups : thf_llama_gqa.g;
        snprintf(extra, sizeof(extra), "%s", cases[i].extra);
        thf_llama_config_text(text, sizeof(text), &s, extra);
        s.g = thf_llama_gqa.g;
        EXPECT(thf_write_text(dir, "config.json", text) == 0, "write");
        EXPECT_OK(thf_write_model(dir, &m, cases[i].skip, cases[i].add, &err), &err);
        mt_config c;
        float* q = NULL;
        err.message[0] = 0;
        mt_status st = mt_hf_load(dir, &c, &q, NULL, &err);
        EXPECT(st == cases[i].status && strstr(err.message, cases[i].words) && !strchr(err.message, '\n') &&
                   (st == MT_OK) == (q != NULL), "case %zu (%s): %s: %s", i, cases[i].extra, mt_status_name(st), err.message);
        if (st == MT_OK) EXPECT(thf_llama_check_params(&s, &m, &c, q) == TEST_PASS, "case %zu", i);
        free(q);
    }
    /* config.json with architectures alone (no model_type) is a Llama too */
    EXPECT(thf_write_text(dir, "config.json", "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                                              "\"intermediate_size\": 80, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                                              "\"num_key_value_heads\": 2, \"head_dim\": 24, \"vocab_size\": 100}") == 0, "write");
    EXPECT_OK(thf_write_model(dir, &m, NULL, NULL, &err), &err);
    mt_config c;
    float* p = NULL;
    const mt_hf_arch* arch = NULL;
    EXPECT_OK(mt_hf_load(dir, &c, &p, &arch, &err), &err);
    EXPECT(arch == &mt_hf_llama_arch && c.max_position_embeddings == 2048 && c.norm_epsilon == 1e-6, "LlamaConfig defaults");

    /* export: flavours transformers cannot hold */
    mt_config bad = c;
    bad.rotary_percent = 0.5;
    EXPECT(mt_hf_save(out, &bad, p, 100, MT_ST_F32, 0, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "rotary_percent 0.5: transformers' Llama rotates every channel"), "%s", err.message);
    bad = c;
    bad.normalization = MT_NORM_LAYERNORM; /* LayerNorm + rope */
    EXPECT(mt_hf_save(out, &bad, p, 100, MT_ST_F32, 0, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "(LayerNorm, SwiGLU, rope positions, untied output layer, no linear biases) is neither"),
           "%s", err.message);
    mt_config gpt2 = thf_small_config();
    gpt2.untie_embeddings_and_output_weights = 1;
    EXPECT(mt_hf_save(out, &gpt2, p, 100, MT_ST_F32, 0, &err) == MT_ERR_CONFIG && strstr(err.message, "is neither GPT-2"),
           "untied GPT-2: %s", err.message);
    EXPECT(mt_hf_save(out, &c, p, 129, MT_ST_F32, 0, &err) == MT_ERR_ARG, "vocabulary above the padded size");
    EXPECT(access(out, F_OK) != 0, "a refused export wrote %s", out);
    free(p);
    thf_model_free(&m);
    thf_remove(root);
    return TEST_PASS;
}

/* Canonical -> HF -> canonical and HF -> canonical -> HF are the identity, bitwise (GQA, untied). */
static test_result test_hf_llama_mapping_roundtrip(void) {
    mt_config c = test_config_sized(2, 64, 4, 32, 100);
    test_config_attention(&c, 4, 2, 24, 80);
    test_config_llama(&c);
    c.lr = 0; /* as before: this test never trains */
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const mt_hf_arch* arch = NULL;
    EXPECT_OK(mt_hf_arch_for_config(&c, &arch, &err), &err);
    EXPECT(arch == &mt_hf_llama_arch && mt_hf_llama_num_tensors(&c) == 21, "arch / tensor count");
    int64_t n = mt_num_parameters(&c), V = 100;
    float* p = (float*)malloc(sizeof(float) * (size_t)n);
    float* q = (float*)malloc(sizeof(float) * (size_t)n);
    float* hf = (float*)malloc(sizeof(float) * (size_t)n);
    float* hf2 = (float*)malloc(sizeof(float) * (size_t)n);
    EXPECT(p && q && hf && hf2, "alloc");
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&c, info);
    for (int64_t i = 0; i < n; i++) {
        p[i] = thf_uniform();
        q[i] = 12345.0f; /* every element must be overwritten */
    }
    for (int k = 0; k < 2; k++) /* padded rows: zero, as an import leaves them */
        memset(p + info[k ? MT_P_OUTPUT_WEIGHT : MT_P_WORD_EMBEDDINGS].offset + V * 64, 0, sizeof(float) * 28 * 64);
    int64_t total = 0;
    for (int i = 0; i < mt_hf_llama_num_tensors(&c); i++) {
        mt_hf_tensor t;
        mt_hf_llama_tensor(&c, V, i, &t);
        mt_hf_llama_export_tensor(&c, V, &t, p, hf + total);
        mt_hf_llama_import_tensor(&c, V, &t, hf + total, q);
        total += t.numel;
    }
    EXPECT(total == n - 2 * 28 * 64, "HF holds every parameter but the padding: %lld", (long long)total);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "canonical -> HF -> canonical is not bitwise the identity");
    total = 0;
    for (int i = 0; i < mt_hf_llama_num_tensors(&c); i++) {
        mt_hf_tensor t;
        mt_hf_llama_tensor(&c, V, i, &t);
        mt_hf_llama_export_tensor(&c, V, &t, q, hf2 + total);
        total += t.numel;
    }
    EXPECT(!memcmp(hf, hf2, sizeof(float) * (size_t)total), "HF -> canonical -> HF is not bitwise the identity");
    mt_hf_tensor t;
    mt_hf_llama_tensor(&c, V, 1 + 9 + 2, &t);
    EXPECT(!strcmp(t.name, "model.layers.1.self_attn.v_proj.weight") && t.kind == MT_P_QKV_WEIGHT && t.part == 2 &&
               t.layer == 1 && t.shape[0] == 48 && t.shape[1] == 64, "v_proj: %s", t.name);
    mt_hf_llama_tensor(&c, V, 20, &t);
    EXPECT(!strcmp(t.name, "lm_head.weight") && t.kind == MT_P_OUTPUT_WEIGHT && t.shape[0] == 100, "lm_head");
    free(p);
    free(q);
    free(hf);
    free(hf2);
    return TEST_PASS;
}

/* Llama's forward as transformers computes it, in double, on thf_llama_tensors' tensors: RMSNorm,
 * q/k/v with head j reading kv group j / (n/g), rotate_half RoPE (rope_theta `base`, llama3 scaling
 * by `factor` when > 0), SwiGLU, the tied or untied head. logits [T, V]. */
static double thf_llama3_inv_freq(double inv, double factor) {
    const double pi = 3.14159265358979323846, old = 8192.0, low = 1.0, high = 4.0;
    double wavelen = 2.0 * pi / inv;
    if (wavelen < old / high) return inv;
    if (wavelen > old / low) return inv / factor;
    double smooth = (old / wavelen - low) / (high - low);
    return (1.0 - smooth) * inv / factor + smooth * inv;
}

static void thf_llama_forward(const thf_llama_spec* s, const thf_model* m, double base, double factor, double eps,
                              const int32_t* tokens, int T, double* logits) {
    int h = s->h, n = s->n, g = s->g, d = s->d, f = s->f, nd = n * d, gd = g * d;
    double* x = (double*)calloc((size_t)T * h, sizeof(double));
    double* a = (double*)calloc((size_t)T * h, sizeof(double));
    double* q = (double*)calloc((size_t)T * nd, sizeof(double));
    double* k = (double*)calloc((size_t)T * gd, sizeof(double));
    double* v = (double*)calloc((size_t)T * gd, sizeof(double));
    double* o = (double*)calloc((size_t)T * nd, sizeof(double));
    double* z = (double*)calloc((size_t)T * f, sizeof(double));
    double* sc = (double*)calloc((size_t)T, sizeof(double));
    double* inv = (double*)calloc((size_t)d / 2, sizeof(double));
    for (int i = 0; i < d / 2; i++) {
        inv[i] = 1.0 / pow(base, 2.0 * i / d);
        if (factor > 0) inv[i] = thf_llama3_inv_freq(inv[i], factor);
    }
    const float* emb = m->t[0].data;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < h; i++) x[t * h + i] = emb[(int64_t)tokens[t] * h + i];
#define THF_RMS(src, gain, dst)                                                  \
    for (int t = 0; t < T; t++) {                                                \
        double ms = 0;                                                           \
        for (int i = 0; i < h; i++) ms += src[t * h + i] * src[t * h + i];       \
        double r = 1.0 / sqrt(ms / h + eps);                                     \
        for (int i = 0; i < h; i++) dst[t * h + i] = src[t * h + i] * r * gain[i]; \
    }
/* y[t, r] = sum_i in[t, i] W[r, i] (nn.Linear: W [rows, cols]) */
#define THF_LINEAR(in, cols, W, rows, out, acc_op)                               \
    for (int t = 0; t < T; t++)                                                  \
        for (int r = 0; r < rows; r++) {                                         \
            double acc = 0;                                                      \
            for (int i = 0; i < cols; i++) acc += in[t * cols + i] * (double)W[(int64_t)r * cols + i]; \
            out[t * rows + r] acc_op acc;                                        \
        }
    for (int l = 0; l < s->L; l++) {
        const thf_tensor* w = &m->t[1 + 9 * l]; /* q, k, v, o, gate, up, down, input norm, post norm */
        THF_RMS(x, w[7].data, a)
        THF_LINEAR(a, h, w[0].data, nd, q, =)
        THF_LINEAR(a, h, w[1].data, gd, k, =)
        THF_LINEAR(a, h, w[2].data, gd, v, =)
        for (int t = 0; t < T; t++) /* rotate_half: channel i pairs with i + d/2 */
            for (int hd = 0; hd < n + g; hd++) {
                double* r = hd < n ? q + t * nd + hd * d : k + t * gd + (hd - n) * d;
                for (int i = 0; i < d / 2; i++) {
                    double c = cos(t * inv[i]), sn = sin(t * inv[i]), x1 = r[i], x2 = r[i + d / 2];
                    r[i] = x1 * c - x2 * sn;
                    r[i + d / 2] = x2 * c + x1 * sn;
                }
            }
        for (int j = 0; j < n; j++) {
            int kv = j / (n / g);
            for (int t = 0; t < T; t++) {
                double mx = -1e300, sum = 0;
                for (int u = 0; u <= t; u++) {
                    double dot = 0;
                    for (int e = 0; e < d; e++) dot += q[t * nd + j * d + e] * k[u * gd + kv * d + e];
                    sc[u] = dot / sqrt((double)d);
                    if (sc[u] > mx) mx = sc[u];
                }
                for (int u = 0; u <= t; u++) sum += sc[u] = exp(sc[u] - mx);
                for (int e = 0; e < d; e++) {
                    double acc = 0;
                    for (int u = 0; u <= t; u++) acc += sc[u] / sum * v[u * gd + kv * d + e];
                    o[t * nd + j * d + e] = acc;
                }
            }
        }
        THF_LINEAR(o, nd, w[3].data, h, x, +=)
        THF_RMS(x, w[8].data, a)
        THF_LINEAR(a, h, w[4].data, f, z, =)
        for (int t = 0; t < T; t++)
            for (int r = 0; r < f; r++) {
                double gate = z[t * f + r], up = 0;
                for (int i = 0; i < h; i++) up += a[t * h + i] * (double)w[5].data[(int64_t)r * h + i];
                z[t * f + r] = gate / (1.0 + exp(-gate)) * up;
            }
        THF_LINEAR(z, f, w[6].data, h, x, +=)
    }
    THF_RMS(x, m->t[1 + 9 * s->L].data, a)
    const float* head = s->tied ? emb : m->t[2 + 9 * s->L].data;
    int V = s->V;
    THF_LINEAR(a, h, head, V, logits, =)
#undef THF_RMS
#undef THF_LINEAR
    free(x); free(a); free(q); free(k); free(v); free(o); free(z); free(sc); free(inv);
}

/* ---- Mixtral and Qwen3-MoE: directories written here, tensor by tensor, independently of the mapping */

typedef struct {
    int qwen;                   /* Qwen3MoeForCausalLM (q_norm / k_norm, mlp.*) or MixtralForCausalLM */
    int L, h, n, g, d, ffn, fe, E, k, V, P, tied, norm_topk;
    double coef;                /* router_aux_loss_coef */
} thf_moe_spec;
/* Mixtral: GQA, head_dim = hidden / heads, 4 experts of width 48 (= intermediate_size), top-2, untied */
static const thf_moe_spec thf_mixtral = {0, 2, 64, 4, 2, 16, 48, 48, 4, 2, 100, 32, 0, 1, 0.02};
/* Qwen3-MoE: head_dim 24 != hidden / heads, 6 experts of width 40, intermediate_size 96 (the dense MLP's),
 * top-3 of softmax over all experts (norm_topk_prob false), tied */
static const thf_moe_spec thf_qwen3 = {1, 2, 64, 4, 2, 24, 96, 40, 6, 3, 100, 32, 1, 0, 0.001};

/* The class's tensors with random values, in its state-dict order. */
static void thf_moe_tensors(const thf_moe_spec* s, thf_model* m) {
    memset(m, 0, sizeof(*m));
    const int64_t nd = (int64_t)s->n * s->d, gd = (int64_t)s->g * s->d;
    const char* moe = s->qwen ? "mlp" : "block_sparse_moe";
    const char* ex[3] = {s->qwen ? "gate_proj" : "w1", s->qwen ? "up_proj" : "w2", s->qwen ? "down_proj" : "w3"};
#define THF_ADD(rows, cols, ...)                                                    \
    do {                                                                            \
        thf_tensor* t_ = &m->t[m->count++];                                         \
        snprintf(t_->name, sizeof(t_->name), __VA_ARGS__);                          \
        t_->ndim = (cols) ? 2 : 1;                                                  \
        t_->shape[0] = (rows);                                                      \
        t_->shape[1] = (cols);                                                      \
        t_->numel = t_->shape[0] * ((cols) ? (cols) : 1);                           \
        t_->data = (float*)malloc(sizeof(float) * (size_t)t_->numel);               \
        for (int64_t e_ = 0; e_ < t_->numel; e_++) t_->data[e_] = thf_uniform();    \
    } while (0)
    THF_ADD(s->V, s->h, "model.embed_tokens.weight");
    for (int l = 0; l < s->L; l++) {
        THF_ADD(nd, s->h, "model.layers.%d.self_attn.q_proj.weight", l);
        THF_ADD(gd, s->h, "model.layers.%d.self_attn.k_proj.weight", l);
        THF_ADD(gd, s->h, "model.layers.%d.self_attn.v_proj.weight", l);
        THF_ADD(s->h, nd, "model.layers.%d.self_attn.o_proj.weight", l);
        if (s->qwen) {
            THF_ADD(s->d, 0, "model.layers.%d.self_attn.q_norm.weight", l);
            THF_ADD(s->d, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        }
        THF_ADD(s->E, s->h, "model.layers.%d.%s.gate.weight", l, moe);
        for (int e = 0; e < s->E; e++)
            for (int j = 0; j < 3; j++) { /* Mixtral: w1, w2, w3; Qwen3-MoE: gate, up, down */
                int down = s->qwen ? j == 2 : j == 1;
                THF_ADD(down ? s->h : s->fe, down ? s->fe : s->h, "model.layers.%d.%s.experts.%d.%s.weight", l, moe, e, ex[j]);
            }
        THF_ADD(s->h, 0, "model.layers.%d.input_layernorm.weight", l);
        THF_ADD(s->h, 0, "model.layers.%d.post_attention_layernorm.weight", l);
    }
    THF_ADD(s->h, 0, "model.norm.weight");
    if (!s->tied) THF_ADD(s->V, s->h, "lm_head.weight");
#undef THF_ADD
}

/* config.json as transformers 4.51 writes it (the fields the classes read) */
static void thf_moe_config_text(char* buf, size_t cap, const thf_moe_spec* s, const char* extra) {
    size_t n = (size_t)snprintf(buf, cap,
                                "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": %d, "
                                "\"num_hidden_layers\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d, "
                                "\"head_dim\": %d, \"max_position_embeddings\": %d, \"vocab_size\": %d, "
                                "\"tie_word_embeddings\": %s, \"hidden_act\": \"silu\", \"num_experts_per_tok\": %d, "
                                "\"router_aux_loss_coef\": %g, \"output_router_logits\": false, \"rope_scaling\": null, "
                                "\"sliding_window\": null",
                                s->qwen ? "Qwen3MoeForCausalLM" : "MixtralForCausalLM", s->qwen ? "qwen3_moe" : "mixtral",
                                s->h, s->L, s->n, s->g, s->d, s->P, s->V, s->tied ? "true" : "false", s->k, s->coef);
    if (s->qwen)
        n += (size_t)snprintf(buf + n, cap - n,
                              ", \"intermediate_size\": %d, \"moe_intermediate_size\": %d, \"num_experts\": %d, "
                              "\"norm_topk_prob\": %s, \"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
                              "\"use_sliding_window\": false, \"attention_bias\": false, \"rms_norm_eps\": 1e-06, "
                              "\"rope_theta\": 10000.0",
                              s->ffn, s->fe, s->E, s->norm_topk ? "true" : "false");
    else
        n += (size_t)snprintf(buf + n, cap - n,
                              ", \"intermediate_size\": %d, \"num_local_experts\": %d, \"router_jitter_noise\": 0.0, "
                              "\"rms_norm_eps\": 1e-05, \"rope_theta\": 1000000.0",
                              s->fe, s->E);
    snprintf(buf + n, cap - n, "%s}", extra);
}

/* Every HF tensor is where our layout puts it, stated here on its own: Megatron's grouped QKV rows; the
 * router [L, E, h]; expert e's fc1 rows [gate (w1 / gate_proj); up (w3 / up_proj)] of [L, E, 2fe, h];
 * its fc2 [L, E, h, fe] = w2 / down_proj; q_norm / k_norm [L, d]; zero padded vocabulary rows. */
static test_result thf_moe_check_params(const thf_moe_spec* s, const thf_model* m, const mt_config* c, const float* p) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    int64_t total = mt_param_layout(c, info);
    const int64_t h = s->h, d = s->d, fe = s->fe, E = s->E, nd = (int64_t)s->n * d, per = s->n / s->g * d + 2 * d;
    const int64_t R = (int64_t)(s->n + 2 * s->g) * d, Vp = 128;
    int64_t want_total = Vp * h * (s->tied ? 1 : 2) + h +
                         s->L * (2 * h + R * h + h * nd + E * h + E * 3 * fe * h + (s->qwen ? 2 * d : 0));
    EXPECT(total == want_total && total == mt_num_parameters(c), "parameters %lld, want %lld", (long long)total,
           (long long)want_total);
    EXPECT(info[MT_P_FC1_WEIGHT].numel == 0 && info[MT_P_FC2_WEIGHT].numel == 0 && info[MT_P_ROUTER_BIAS].numel == 0 &&
               info[MT_P_SHARED_FC1_WEIGHT].numel == 0, "dense MLP, router bias or shared expert present");
    char name[160];
    const char* moe = s->qwen ? "mlp" : "block_sparse_moe";
    for (int out = 0; out < 2 - s->tied; out++) {
        const thf_tensor* t = thf_model_find(m, out ? "lm_head.weight" : "model.embed_tokens.weight");
        const float* w = p + info[out ? MT_P_OUTPUT_WEIGHT : MT_P_WORD_EMBEDDINGS].offset;
        for (int64_t e = 0; e < Vp * h; e++)
            EXPECT(w[e] == (e < s->V * h ? t->data[e] : 0.0f), "%s element %lld", t->name, (long long)e);
    }
    for (int l = 0; l < s->L; l++) {
        const float* qkv = p + info[MT_P_QKV_WEIGHT].offset + l * R * h;
        const thf_tensor* part[3];
        const char* parts[3] = {"q_proj", "k_proj", "v_proj"};
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.%s.weight", l, parts[k]);
            part[k] = thf_model_find(m, name);
        }
        for (int j = 0; j < s->g; j++)
            for (int64_t w = 0; w < per; w++) {
                int64_t q_rows = s->n / s->g * d;
                const float* src = w < q_rows ? part[0]->data + (j * q_rows + w) * h
                                 : w < q_rows + d ? part[1]->data + (j * d + w - q_rows) * h
                                                  : part[2]->data + (j * d + w - q_rows - d) * h;
                EXPECT(!memcmp(qkv + (j * per + w) * h, src, sizeof(float) * (size_t)h), "layer %d group %d qkv row %lld", l,
                       j, (long long)w);
            }
        struct { char hf[96]; int kind; int64_t numel, at; } plain[6 + 3 * 8];
        int np = 0;
#define THF_PLAIN(kind_, numel_, at_, ...)                                              \
    do {                                                                                \
        snprintf(plain[np].hf, sizeof(plain[np].hf), __VA_ARGS__);                      \
        plain[np].kind = (kind_);                                                       \
        plain[np].numel = (numel_);                                                     \
        plain[np++].at = (at_);                                                         \
    } while (0)
        THF_PLAIN(MT_P_PROJ_WEIGHT, h * nd, l * h * nd, "self_attn.o_proj");
        THF_PLAIN(MT_P_LN1_WEIGHT, h, l * h, "input_layernorm");
        THF_PLAIN(MT_P_LN2_WEIGHT, h, l * h, "post_attention_layernorm");
        THF_PLAIN(MT_P_ROUTER_WEIGHT, E * h, l * E * h, "%s.gate", moe);
        if (s->qwen) {
            THF_PLAIN(MT_P_Q_LAYERNORM_WEIGHT, d, l * d, "self_attn.q_norm");
            THF_PLAIN(MT_P_K_LAYERNORM_WEIGHT, d, l * d, "self_attn.k_norm");
        }
        for (int e = 0; e < E && e < 8; e++) {
            const int64_t fc1 = ((int64_t)l * E + e) * 2 * fe * h, fc2 = ((int64_t)l * E + e) * h * fe;
            THF_PLAIN(MT_P_EXPERT_FC1_WEIGHT, fe * h, fc1, "%s.experts.%d.%s", moe, e, s->qwen ? "gate_proj" : "w1");
            THF_PLAIN(MT_P_EXPERT_FC1_WEIGHT, fe * h, fc1 + fe * h, "%s.experts.%d.%s", moe, e, s->qwen ? "up_proj" : "w3");
            THF_PLAIN(MT_P_EXPERT_FC2_WEIGHT, h * fe, fc2, "%s.experts.%d.%s", moe, e, s->qwen ? "down_proj" : "w2");
        }
#undef THF_PLAIN
        for (int k = 0; k < np; k++) {
            snprintf(name, sizeof(name), "model.layers.%d.%.96s.weight", l, plain[k].hf);
            const thf_tensor* t = thf_model_find(m, name);
            EXPECT(t && t->numel == plain[k].numel, "%s", name);
            EXPECT(!memcmp(p + info[plain[k].kind].offset + plain[k].at, t->data, sizeof(float) * (size_t)plain[k].numel),
                   "%s not in place", name);
        }
    }
    EXPECT(!memcmp(p + info[MT_P_FINAL_LN_WEIGHT].offset, thf_model_find(m, "model.norm.weight")->data, sizeof(float) * (size_t)h),
           "model.norm.weight");
    return TEST_PASS;
}

/* Mixtral (GQA, untied) and Qwen3-MoE (head_dim != hidden / heads, pre-softmax, tied) directories: import
 * (config and every tensor in place), checkpoint (the MoE header words), export with the router's
 * settings given as convert_hf gives them: the original tensors bitwise, config.json's fields, load(export)
 * = import; a bf16 and a sharded export load back. */
static test_result test_hf_moe_directories(void) {
    const thf_moe_spec* specs[2] = {&thf_mixtral, &thf_qwen3};
    for (int k = 0; k < 2; k++) {
        const thf_moe_spec* s = specs[k];
        char root[256], hf_dir[300], ck_dir[300], out_dir[300], sh_dir[300], path[400], text[4096];
        thf_path(root, sizeof(root), k ? "qwen3_moe" : "mixtral");
        thf_remove(root);
        snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
        snprintf(ck_dir, sizeof(ck_dir), "%s/ckpt", root);
        snprintf(out_dir, sizeof(out_dir), "%s/out", root);
        snprintf(sh_dir, sizeof(sh_dir), "%s/sharded", root);
        thf_model m;
        thf_moe_tensors(s, &m);
        mt_error err;
        EXPECT(mt_make_directories(hf_dir) == 0, "mkdir");
        thf_moe_config_text(text, sizeof(text), s, "");
        EXPECT(thf_write_text(hf_dir, "config.json", text) == 0, "write config");
        EXPECT_OK(thf_write_model(hf_dir, &m, NULL, NULL, &err), &err);

        mt_config c;
        float* p = NULL;
        const mt_hf_arch* arch = NULL;
        EXPECT_OK(mt_hf_load(hf_dir, &c, &p, &arch, &err), &err);
        EXPECT(arch == (s->qwen ? &mt_hf_qwen3_moe_arch : &mt_hf_mixtral_arch), "detected %s", arch->name);
        EXPECT(c.num_layers == s->L && c.hidden_size == s->h && c.num_attention_heads == s->n && c.num_query_groups == s->g &&
                   c.kv_channels == s->d && c.ffn_hidden_size == s->ffn && c.max_position_embeddings == s->P &&
                   c.vocab_size == s->V && c.normalization == MT_NORM_RMSNORM && c.swiglu && !c.add_bias_linear &&
                   c.position_embedding_type == MT_POSITION_ROPE && c.untie_embeddings_and_output_weights == !s->tied &&
                   c.rotary_base == (s->qwen ? 10000.0 : 1e6) && c.norm_epsilon == (s->qwen ? 1e-6 : 1e-5),
               "shape and flavour from config.json");
        EXPECT(c.num_experts == s->E && c.moe_router_topk == s->k && mt_moe_ffn(&c) == s->fe &&
                   mt_moe_num_layers(&c) == s->L && c.moe_router_pre_softmax == !s->norm_topk && !c.moe_router_score_sigmoid &&
                   c.qk_layernorm == s->qwen && c.moe_load_balancing == MT_MOE_AUX_LOSS && c.moe_aux_loss_coeff[0] == s->coef &&
                   c.moe_shared_expert_intermediate_size == 0, "MoE settings from config.json");
        if (thf_moe_check_params(s, &m, &c, p) != TEST_PASS) return TEST_FAIL;
        const int64_t n = mt_num_parameters(&c);

        /* the checkpoint: the MoE words; read back, the router's settings are not in it */
        EXPECT_OK(mt_hf_checkpoint_write(ck_dir, &c, p, 0, &err), &err);
        mt_config c2;
        float* q = NULL;
        int64_t header[64];
        EXPECT_OK(mt_hf_checkpoint_read(ck_dir, -1, 0, &c2, &q, header, NULL, &err), &err);
        EXPECT(header[MT_CK_NUM_EXPERTS] == s->E && header[MT_CK_MOE_FFN] == s->fe && header[MT_CK_MOE_LAYERS] == s->L &&
                   header[MT_CK_QK_LAYERNORM] == s->qwen && header[MT_CK_MOE_SHARED] == 0, "MoE header words");
        EXPECT(c2.num_experts == s->E && mt_moe_ffn(&c2) == s->fe && c2.qk_layernorm == s->qwen &&
                   mt_moe_num_layers(&c2) == s->L && !memcmp(p, q, sizeof(float) * (size_t)n), "checkpoint read back");
        /* what convert_hf --export --moe-router-topk K [--moe-router-pre-softmax] --moe-aux-loss-coeff C sets */
        c2.moe_router_topk = s->k;
        c2.moe_router_pre_softmax = !s->norm_topk;
        c2.moe_aux_loss_coeff[0] = s->coef;
        EXPECT_OK(mt_hf_save(out_dir, &c2, q, header[MT_CK_TRUE_VOCAB], MT_ST_F32, 0, &err), &err);
        if (thf_same_tensors(out_dir, &m) != TEST_PASS) return TEST_FAIL;
        mt_json* cj = NULL;
        if (thf_config_roundtrip(text, out_dir, &cj) != TEST_PASS) return TEST_FAIL;
        mt_json_free(cj);
        float* r = NULL;
        EXPECT_OK(mt_hf_load(out_dir, &c2, &r, NULL, &err), &err);
        EXPECT(!memcmp(p, r, sizeof(float) * (size_t)n) && c2.moe_router_topk == s->k, "load(export) != import");
        free(r);
        /* bfloat16: the rounded parameters; sharded: the same parameters through the index */
        EXPECT_OK(mt_hf_save(out_dir, &c, p, s->V, MT_ST_BF16, 0, &err), &err);
        EXPECT_OK(mt_hf_load(out_dir, &c2, &r, NULL, &err), &err);
        for (int64_t i = 0; i < n; i++) EXPECT(r[i] == mt_st_bf16_to_f32(mt_st_f32_to_bf16(p[i])), "bf16 element %lld", (long long)i);
        free(r);
        EXPECT_OK(mt_hf_save(sh_dir, &c, p, s->V, MT_ST_F32, 20000, &err), &err);
        snprintf(path, sizeof(path), "%s/model.safetensors.index.json", sh_dir);
        EXPECT(access(path, F_OK) == 0, "no index");
        EXPECT_OK(mt_hf_load(sh_dir, &c2, &r, NULL, &err), &err);
        EXPECT(!memcmp(p, r, sizeof(float) * (size_t)n), "sharded export loads differently");
        free(r);
        free(p);
        free(q);
        thf_model_free(&m);
        thf_remove(root);
    }
    return TEST_PASS;
}

/* Canonical -> HF -> canonical and HF -> canonical -> HF are the identity, bitwise, for both classes. */
static test_result test_hf_moe_mapping_roundtrip(void) {
    for (int qwen = 0; qwen < 2; qwen++) {
        mt_config c = test_config_sized(3, 64, 4, 32, 100);
        test_config_attention(&c, 4, 2, qwen ? 24 : 16, 80);
        test_config_llama(&c);
        c.lr = 0;
        c.num_experts = 5;
        c.moe_router_topk = 2;
        c.moe_ffn_hidden_size = 24;
        c.qk_layernorm = qwen;
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        const mt_hf_arch* arch = NULL;
        EXPECT_OK(mt_hf_arch_for_config(&c, &arch, &err), &err);
        EXPECT(arch == (qwen ? &mt_hf_qwen3_moe_arch : &mt_hf_mixtral_arch), "arch %s", arch->name);
        const int per = (qwen ? 7 : 5) + 3 * 5 + 2, count = arch->num_tensors(&c);
        EXPECT(count == 3 + 3 * per, "tensor count %d", count);
        int64_t n = mt_num_parameters(&c), V = 100;
        float* p = (float*)malloc(sizeof(float) * (size_t)n);
        float* q = (float*)malloc(sizeof(float) * (size_t)n);
        float* hf = (float*)malloc(sizeof(float) * (size_t)n);
        float* hf2 = (float*)malloc(sizeof(float) * (size_t)n);
        EXPECT(p && q && hf && hf2, "alloc");
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        mt_param_layout(&c, info);
        for (int64_t i = 0; i < n; i++) {
            p[i] = thf_uniform();
            q[i] = 12345.0f; /* every element must be overwritten */
        }
        for (int k = 0; k < 2; k++) /* padded rows: zero, as an import leaves them */
            memset(p + info[k ? MT_P_OUTPUT_WEIGHT : MT_P_WORD_EMBEDDINGS].offset + V * 64, 0, sizeof(float) * 28 * 64);
        int64_t total = 0;
        for (int i = 0; i < count; i++) {
            mt_hf_tensor t;
            arch->tensor(&c, V, i, &t);
            arch->export_tensor(&c, V, &t, p, hf + total);
            arch->import_tensor(&c, V, &t, hf + total, q);
            total += t.numel;
        }
        EXPECT(total == n - 2 * 28 * 64, "HF holds every parameter but the padding: %lld", (long long)total);
        EXPECT(!memcmp(p, q, sizeof(float) * (size_t)n), "canonical -> HF -> canonical is not bitwise the identity");
        total = 0;
        for (int i = 0; i < count; i++) {
            mt_hf_tensor t;
            arch->tensor(&c, V, i, &t);
            arch->export_tensor(&c, V, &t, q, hf2 + total);
            total += t.numel;
        }
        EXPECT(!memcmp(hf, hf2, sizeof(float) * (size_t)total), "HF -> canonical -> HF is not bitwise the identity");
        /* names, shapes, and the last layer's last expert's up rows where they belong */
        mt_hf_tensor t;
        const int up = 1 + 2 * per + (qwen ? 7 : 5) + 3 * 4 + (qwen ? 1 : 2);
        arch->tensor(&c, V, up, &t);
        char want[96];
        snprintf(want, sizeof(want), "model.layers.2.%s.experts.4.%s.weight", qwen ? "mlp" : "block_sparse_moe",
                 qwen ? "up_proj" : "w3");
        EXPECT(!strcmp(t.name, want) && t.kind == MT_P_EXPERT_FC1_WEIGHT && t.part == 1 && t.expert == 4 && t.layer == 2 &&
                   t.shape[0] == 24 && t.shape[1] == 64, "%s: %s", want, t.name);
        float out[24 * 64];
        arch->export_tensor(&c, V, &t, p, out);
        EXPECT(!memcmp(out, p + info[MT_P_EXPERT_FC1_WEIGHT].offset + ((2 * 5 + 4) * 48 + 24) * 64, sizeof(out)),
               "expert 4's up rows of layer 2");
        arch->tensor(&c, V, 1 + per + (qwen ? 6 : 4), &t);
        EXPECT(!strcmp(t.name, qwen ? "model.layers.1.mlp.gate.weight" : "model.layers.1.block_sparse_moe.gate.weight") &&
                   t.kind == MT_P_ROUTER_WEIGHT && t.shape[0] == 5 && t.shape[1] == 64, "router: %s", t.name);
        arch->tensor(&c, V, count - 1, &t);
        EXPECT(!strcmp(t.name, "lm_head.weight") && t.kind == MT_P_OUTPUT_WEIGHT && t.shape[0] == 100, "lm_head: %s", t.name);
        free(p);
        free(q);
        free(hf);
        free(hf2);
    }
    return TEST_PASS;
}

/* What must be refused, on import and on export, each with one line naming the problem. */
static test_result test_hf_moe_rejects(void) {
    char root[256], dir[300], out[300], text[4096];
    thf_path(root, sizeof(root), "moe_rejects");
    thf_remove(root);
    snprintf(dir, sizeof(dir), "%s/hf", root);
    snprintf(out, sizeof(out), "%s/out", root);
    mt_error err;
    EXPECT(mt_make_directories(dir) == 0, "mkdir");
    struct {
        int qwen;
        const char* extra;  /* config.json fields added at the end (a repeated key replaces nothing: keys are new) */
        const char* skip;   /* a tensor left out */
        mt_status status;
        const char* words;
    } cases[] = {
        {0, ", \"max_window_layers\": 28, \"bos_token_id\": 1", NULL, MT_OK, ""},
        {1, ", \"max_window_layers\": 28", NULL, MT_OK, ""},
        {0, ", \"attention_bias\": true", NULL, MT_ERR_CONFIG, "attention_bias true is not supported"},
        {1, ", \"shared_expert_intermediate_size\": 64", NULL, MT_ERR_CONFIG, "Qwen3-MoE has no shared expert"},
        {1, ", \"num_local_experts\": 8", NULL, MT_ERR_FORMAT, "num_experts 6 and num_local_experts 8 disagree"},
        {1, "", "model.layers.1.self_attn.k_norm.weight", MT_ERR_FORMAT, "tensor model.layers.1.self_attn.k_norm.weight is missing"},
        {0, "", "model.layers.0.block_sparse_moe.experts.3.w2.weight", MT_ERR_FORMAT,
         "tensor model.layers.0.block_sparse_moe.experts.3.w2.weight is missing"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const thf_moe_spec* s = cases[i].qwen ? &thf_qwen3 : &thf_mixtral;
        thf_model m;
        thf_moe_tensors(s, &m);
        thf_moe_config_text(text, sizeof(text), s, cases[i].extra);
        EXPECT(thf_write_text(dir, "config.json", text) == 0, "write");
        EXPECT_OK(thf_write_model(dir, &m, cases[i].skip, NULL, &err), &err);
        mt_config c;
        float* q = NULL;
        err.message[0] = 0;
        mt_status st = mt_hf_load(dir, &c, &q, NULL, &err);
        EXPECT(st == cases[i].status && strstr(err.message, cases[i].words) && !strchr(err.message, '\n') &&
                   (st == MT_OK) == (q != NULL), "case %zu (%s): %s: %s", i, cases[i].extra, mt_status_name(st), err.message);
        if (st == MT_OK) EXPECT(thf_moe_check_params(s, &m, &c, q) == TEST_PASS, "case %zu", i);
        free(q);
        thf_model_free(&m);
    }
    /* config.json values that replace the written ones: the writer's text with one field's value changed */
    struct { int qwen; const char* key; const char* value; mt_status status; const char* words; } values[] = {
        {0, "\"sliding_window\": null", "\"sliding_window\": 4096", MT_ERR_CONFIG, "sliding_window set is not supported"},
        {0, "\"router_jitter_noise\": 0.0", "\"router_jitter_noise\": 0.01", MT_ERR_CONFIG,
         "router_jitter_noise 0.01 is not supported"},
        {1, "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 2", MT_ERR_CONFIG,
         "decoder_sparse_step 2 makes the layers l with (l + 1) % 2 != 0 dense"},
        {1, "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 3", MT_ERR_CONFIG, "leaves every layer dense"},
        {1, "\"mlp_only_layers\": []", "\"mlp_only_layers\": [1]", MT_ERR_CONFIG,
         "mlp_only_layers lists 1 layers with a dense MLP: MoE models with dense layers are not built yet"},
        {1, "\"use_sliding_window\": false", "\"use_sliding_window\": true", MT_ERR_CONFIG,
         "use_sliding_window true is not supported"},
        {1, "\"num_experts_per_tok\": 3", "\"num_experts_per_tok\": 7", MT_ERR_CONFIG,
         "num_experts_per_tok 7 is more than the 6 experts"},
        {1, "\"router_aux_loss_coef\": 0.001", "\"router_aux_loss_coef\": -1", MT_ERR_FORMAT,
         "\"router_aux_loss_coef\" is not a non-negative number"},
        {1, "\"moe_intermediate_size\": 40, \"num_experts\": 6",
         "\"moe_intermediate_size\": 1073741824, \"num_experts\": 1048576", MT_ERR_CONFIG, "too large to convert here"},
        {0, "\"num_local_experts\": 4", "\"num_local_experts\": 0", MT_ERR_FORMAT, "\"num_local_experts\" is 0, outside"},
        {0, "\"output_router_logits\": false", "\"output_router_logits\": 1", MT_ERR_FORMAT,
         "\"output_router_logits\" is not true or false"},
        {0, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", MT_ERR_CONFIG, "hidden_act \"gelu\" is not supported"},
    };
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        const thf_moe_spec* s = values[i].qwen ? &thf_qwen3 : &thf_mixtral;
        thf_model m;
        thf_moe_tensors(s, &m);
        thf_moe_config_text(text, sizeof(text), s, "");
        char* at = strstr(text, values[i].key);
        EXPECT(at, "case %zu: %s not in the config", i, values[i].key);
        char changed[8400];
        snprintf(changed, sizeof(changed), "%.*s%s%s", (int)(at - text), text, values[i].value, at + strlen(values[i].key));
        EXPECT(thf_write_text(dir, "config.json", changed) == 0, "write");
        EXPECT_OK(thf_write_model(dir, &m, NULL, NULL, &err), &err);
        mt_config c;
        float* q = NULL;
        err.message[0] = 0;
        mt_status st = mt_hf_load(dir, &c, &q, NULL, &err);
        EXPECT(st == values[i].status && strstr(err.message, values[i].words) && !strchr(err.message, '\n') && !q,
               "value case %zu (%s): %s: %s", i, values[i].value, mt_status_name(st), err.message);
        thf_model_free(&m);
    }

    /* export: what transformers' MoE classes cannot hold */
    thf_model m;
    thf_moe_tensors(&thf_qwen3, &m);
    thf_moe_config_text(text, sizeof(text), &thf_qwen3, "");
    EXPECT(thf_write_text(dir, "config.json", text) == 0, "write");
    EXPECT_OK(thf_write_model(dir, &m, NULL, NULL, &err), &err);
    thf_model_free(&m);
    mt_config c;
    float* p = NULL;
    EXPECT_OK(mt_hf_load(dir, &c, &p, NULL, &err), &err);
    struct { const char* what; void (*change)(mt_config*); const char* words; } bad[] = {
        {"Mixtral pre-softmax", NULL, "--moe-router-pre-softmax (Mixtral always renormalises"},
        {"sigmoid", NULL, "sigmoid router scores"},
        {"groups", NULL, "group-limited routing"},
        {"scaling", NULL, "a top-k scaling factor"},
        {"expert bias", NULL, "the expert bias"},
        {"capacity", NULL, "token dropping"},
        {"seq aux", NULL, "a seq_aux_loss or global_aux_loss coefficient"},
        {"shared", NULL, "a shared expert"},
        {"dense layers", NULL, "dense layers"},
        {"biases", NULL, "is not a Mixtral or Qwen3-MoE"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        mt_config b = c;
        switch (i) {
            case 0: b.qk_layernorm = 0; b.moe_router_pre_softmax = 1; break;
            case 1: b.moe_router_score_sigmoid = 1; break;
            case 2: b.moe_router_num_groups = 2; b.moe_router_group_topk = 1; break;
            case 3: b.moe_router_topk_scaling_factor = 2.5; break;
            case 4: b.moe_router_enable_expert_bias = 1; break;
            case 5: b.moe_expert_capacity_factor = 1.0; break;
            case 6: b.moe_load_balancing |= MT_MOE_SEQ_AUX_LOSS; b.moe_aux_loss_coeff[1] = 1e-3; break;
            case 7: b.moe_shared_expert_intermediate_size = 64; break;
            case 8: b.moe_layer_freq = 2; break;
            default: b.add_bias_linear = 1; break;
        }
        err.message[0] = 0;
        EXPECT(mt_hf_save(out, &b, p, 100, MT_ST_F32, 0, &err) == MT_ERR_CONFIG && strstr(err.message, bad[i].words) &&
                   !strchr(err.message, '\n'), "export %s: %s", bad[i].what, err.message);
    }
    EXPECT(access(out, F_OK) != 0, "a refused export wrote %s", out);
    /* convert_hf --export of an MoE checkpoint needs the router's top-k (exit 2, one line, nothing written) */
    if (access("prepro/convert_hf", X_OK) == 0) {
        char ck[300], cmd[1200], msg[4096];
        snprintf(ck, sizeof(ck), "%s/ckpt", root);
        EXPECT_OK(mt_hf_checkpoint_write(ck, &c, p, 0, &err), &err);
        snprintf(cmd, sizeof(cmd), "prepro/convert_hf --export '%s' --out '%s' 2>&1 >/dev/null", ck, out);
        int code = test_command_output(cmd, msg, sizeof(msg));
        EXPECT(code == 2 && strstr(msg, "give --moe-router-topk K") && strchr(msg, '\n') == msg + strlen(msg) - 1 &&
                   access(out, F_OK) != 0, "export without --moe-router-topk: exit %d, '%s'", code, msg);
        snprintf(cmd, sizeof(cmd), "prepro/convert_hf --export '%s' --out '%s' --moe-router-topk 7 2>&1 >/dev/null", ck, out);
        code = test_command_output(cmd, msg, sizeof(msg));
        EXPECT(code == 2 && strstr(msg, "--moe-router-topk 7 is more than the checkpoint's 6 experts"), "topk 7: %d '%s'",
               code, msg);
        snprintf(cmd, sizeof(cmd), "prepro/convert_hf --export '%s' --out '%s' --moe-router-topk 3 "
                 "--moe-router-pre-softmax --moe-aux-loss-coeff 0.001 >/dev/null 2>&1", ck, out);
        EXPECT(test_command_output(cmd, msg, sizeof(msg)) == 0, "export with the router's settings: '%s'", msg);
        mt_config back;
        float* r = NULL;
        EXPECT_OK(mt_hf_load(out, &back, &r, NULL, &err), &err);
        EXPECT(back.moe_router_topk == 3 && back.moe_router_pre_softmax && back.moe_aux_loss_coeff[0] == 0.001 &&
                   !memcmp(r, p, sizeof(float) * (size_t)mt_num_parameters(&c)), "convert_hf's export");
        free(r);
    }
    free(p);
    thf_remove(root);
    return TEST_PASS;
}

/* ---- GPU: the converter's checkpoint in the trainer ------------------------------------------- */

static test_result test_hf_gpu_load(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        cudaGetLastError();
        SKIP("no GPU visible");
    }
    char root[256];
    thf_path(root, sizeof(root), "gpu_ckpt");
    thf_remove(root);
    mt_config c = thf_small_config();
    c.micro_batch_size = 2;
    c.global_batch_size = 2;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    int64_t n = mt_num_parameters(&c);
    float* p = thf_random_params(&c);
    for (int64_t i = 0; i < n; i++) p[i] *= 0.1f; /* a model with a sane scale */
    EXPECT_OK(mt_hf_checkpoint_write(root, &c, p, 0, &err), &err);
    int32_t tokens[2 * 16];
    for (int i = 0; i < 32; i++) tokens[i] = (i * 37 + 11) % 100;
    float* ptrs[64];
    float* data = thf_export_all(&c, 100, p, ptrs);
    double* want = (double*)malloc(sizeof(double) * 2 * 16 * 100);
    for (int b = 0; b < 2; b++) thf_hf_forward(&c, 100, ptrs, tokens + 16 * b, 16, want + 16 * 100 * b);
    float* q = (float*)malloc(sizeof(float) * (size_t)n);
    float* logits = (float*)malloc(sizeof(float) * 2 * 16 * (size_t)c.padded_vocab_size);
    test_result res = TEST_PASS;
    mt_precision precisions[2] = {MT_FP32, MT_BF16};
    for (int k = 0; k < 2 && res == TEST_PASS; k++) {
        c.precision = precisions[k];
        mt_trainer* t = NULL;
        int64_t it = -1;
        mt_status st = mt_trainer_create(&t, &c, &err);
        if (st == MT_OK) st = mt_trainer_load(t, root, -1, &it, NULL, &err);
        if (st == MT_OK) st = mt_trainer_get_parameters(t, q, &err);
        if (st == MT_OK) st = mt_trainer_logits(t, tokens, logits, &err);
        mt_trainer_free(t);
        if (st != MT_OK) { printf("    FAIL %s: %s\n", k ? "bf16" : "fp32", err.message); res = TEST_FAIL; break; }
        if (it != 0 || memcmp(p, q, sizeof(float) * (size_t)n) != 0) {
            printf("    FAIL the trainer's parameters are not the checkpoint's (iteration %lld)\n", (long long)it);
            res = TEST_FAIL;
            break;
        }
        double num = 0, den = 0;
        for (int b = 0; b < 2; b++)
            for (int s = 0; s < 16; s++)
                for (int v = 0; v < 100; v++) {
                    double d = logits[((int64_t)b * 16 + s) * c.padded_vocab_size + v] - want[(b * 16 + s) * 100 + v];
                    num += d * d;
                    den += want[(b * 16 + s) * 100 + v] * want[(b * 16 + s) * 100 + v];
                }
        double rel = sqrt(num / den), tol = k ? 3e-2 : 1e-5;
        printf("    %s logits vs the transformers-style forward: rel err %.2e (tol %.0e)\n", k ? "bf16" : "fp32", rel, tol);
        if (!(rel < tol)) res = TEST_FAIL;
    }
    free(q);
    free(logits);
    free(want);
    free(data);
    free(p);
    thf_remove(root);
    return res;
}

/* The converter's Llama checkpoints (GQA + llama3 scaling + untied; tied without scaling) in the
 * trainer: the same bytes back, and logits equal to the transformers-style forward above (checked
 * against transformers itself: rel err < 1e-7, transformers' RoPE being fp32). */
static test_result test_hf_gpu_load_llama(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        cudaGetLastError();
        SKIP("no GPU visible");
    }
    const thf_llama_spec* specs[2] = {&thf_llama_gqa, &thf_llama_tied};
    const char* extras[2] = {thf_llama3, ", \"rope_scaling\": null"};
    test_result res = TEST_PASS;
    for (int k = 0; k < 2 && res == TEST_PASS; k++) {
        const thf_llama_spec* s = specs[k];
        char root[256], hf_dir[300], ck_dir[300], text[2048];
        thf_path(root, sizeof(root), k ? "gpu_llama_tied" : "gpu_llama");
        thf_remove(root);
        snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
        snprintf(ck_dir, sizeof(ck_dir), "%s/ckpt", root);
        thf_model m;
        thf_llama_tensors(s, &m);
        for (int i = 0; i < m.count; i++) /* a model with a sane scale */
            for (int64_t e = 0; e < m.t[i].numel; e++) m.t[i].data[e] *= 0.3f;
        mt_error err;
        EXPECT(mt_make_directories(hf_dir) == 0, "mkdir");
        thf_llama_config_text(text, sizeof(text), s, extras[k]);
        EXPECT(thf_write_text(hf_dir, "config.json", text) == 0, "write config");
        EXPECT_OK(thf_write_model(hf_dir, &m, NULL, NULL, &err), &err);
        mt_config c;
        float* p = NULL;
        EXPECT_OK(mt_hf_load(hf_dir, &c, &p, NULL, &err), &err);
        EXPECT_OK(mt_hf_checkpoint_write(ck_dir, &c, p, 0, &err), &err);
        c.seq_length = 16;
        c.micro_batch_size = 2;
        c.global_batch_size = 2;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        int64_t n = mt_num_parameters(&c), V = s->V;
        int32_t tokens[2 * 16];
        for (int i = 0; i < 32; i++) tokens[i] = (i * 37 + 11) % V;
        double* want = (double*)malloc(sizeof(double) * 2 * 16 * V);
        for (int b = 0; b < 2; b++)
            thf_llama_forward(s, &m, k ? 10000.0 : 500000.0, k ? 0.0 : 8.0, 1e-5, tokens + 16 * b, 16, want + 16 * V * b);
        float* q = (float*)malloc(sizeof(float) * (size_t)n);
        float* logits = (float*)malloc(sizeof(float) * 2 * 16 * (size_t)c.padded_vocab_size);
        mt_precision precisions[2] = {MT_FP32, MT_BF16};
        for (int pr = 0; pr < 2 && res == TEST_PASS; pr++) {
            c.precision = precisions[pr];
            mt_trainer* t = NULL;
            int64_t it = -1;
            mt_status st = mt_trainer_create(&t, &c, &err);
            if (st == MT_OK) st = mt_trainer_load(t, ck_dir, -1, &it, NULL, &err);
            if (st == MT_OK) st = mt_trainer_get_parameters(t, q, &err);
            if (st == MT_OK) st = mt_trainer_logits(t, tokens, logits, &err);
            mt_trainer_free(t);
            if (st != MT_OK) {
                printf("    FAIL %s %s: %s\n", root, pr ? "bf16" : "fp32", err.message);
                res = TEST_FAIL;
                break;
            }
            if (it != 0 || memcmp(p, q, sizeof(float) * (size_t)n) != 0) {
                printf("    FAIL the trainer's parameters are not the checkpoint's (iteration %lld)\n", (long long)it);
                res = TEST_FAIL;
                break;
            }
            double num = 0, den = 0;
            for (int bs = 0; bs < 32; bs++)
                for (int64_t v = 0; v < V; v++) {
                    double d = logits[bs * c.padded_vocab_size + v] - want[bs * V + v];
                    num += d * d;
                    den += want[bs * V + v] * want[bs * V + v];
                }
            double rel = sqrt(num / den), tol = pr ? 3e-2 : 1e-5;
            printf("    %s %s logits vs the transformers-style forward: rel err %.2e (tol %.0e)\n",
                   k ? "tied, no scaling" : "GQA, llama3, untied", pr ? "bf16" : "fp32", rel, tol);
            if (!(rel < tol)) res = TEST_FAIL;
        }
        free(q);
        free(logits);
        free(want);
        free(p);
        thf_model_free(&m);
        thf_remove(root);
    }
    return res;
}

/* Relative norm error of logits [BT, Vp] (the first V columns) against want [BT, V] over the tokens, once
 * the `drop` share of the tokens with the largest error is set aside; *worst: the largest token's. */
static double thf_trimmed_rel_err(const float* logits, int64_t Vp, const double* want, int64_t V, int BT, double drop,
                                  double* worst) {
    double* num = (double*)calloc((size_t)BT, sizeof(double));
    double* den = (double*)calloc((size_t)BT, sizeof(double));
    double* rel = (double*)calloc((size_t)BT, sizeof(double));
    for (int i = 0; i < BT; i++) {
        for (int64_t v = 0; v < V; v++) {
            double d = logits[(int64_t)i * Vp + v] - want[(int64_t)i * V + v];
            num[i] += d * d;
            den[i] += want[(int64_t)i * V + v] * want[(int64_t)i * V + v];
        }
        rel[i] = sqrt(num[i] / (den[i] > 0 ? den[i] : 1e-300));
    }
    int skip = (int)(drop * BT);
    double sn = 0, sd = 0;
    *worst = 0;
    for (int i = 0; i < BT; i++) {
        int larger = 0; /* tokens with a larger error (ties: the lower index counts as larger) */
        for (int j = 0; j < BT; j++) larger += rel[j] > rel[i] || (rel[j] == rel[i] && j < i);
        if (larger >= skip) { sn += num[i]; sd += den[i]; }
        if (rel[i] > *worst) *worst = rel[i];
    }
    free(num); free(den); free(rel);
    return sqrt(sn / (sd > 0 ? sd : 1e-300));
}

/* Tiny random MixtralForCausalLM and Qwen3MoeForCausalLM models made by transformers itself
 * (`dev/hf_moe_check.py --write DIR`: Mixtral top-2 of 4 experts, GQA; Qwen3-MoE top-4 of 8 with
 * norm_topk_prob false, head_dim != hidden / heads, q/k norms; Qwen3-MoE top-2 renormalised and tied; the
 * float64 model's logits for 2 x 32 tokens) are imported (mt_hf_load), written as checkpoints, loaded into
 * the trainer (the same bytes back) and their logits compared with transformers': fp32 within 1e-5
 * relative (norm over all tokens; fp32 GEMM rounding ~1e-7, transformers' own float32 RoPE and router
 * softmax ~1e-7), bf16 within 3e-2 once the 10% worst tokens are set aside (bf16 rounding of the router's
 * input may flip a near-tie top-k choice, which changes that token's output entirely; the script's
 * routers have decision gaps ~1e-2 of logits ~1). Skipped without a GPU, and when python ($MT_PYTHON,
 * else python3) has no transformers 4.51+ (the GPU machines have it: dev/hf_moe_check.py runs the whole
 * convert_hf round trip there too). */
static test_result test_hf_gpu_moe_transformers(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        cudaGetLastError();
        SKIP("no GPU visible");
    }
    static char out[8192];
    if (test_command_output("${MT_PYTHON:-python3} -c 'import torch, safetensors; "
                            "from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM' 2>&1", out, sizeof(out)) != 0)
        SKIP("python3 with torch, safetensors and transformers 4.51+ is not available (dev/hf_moe_check.py; MT_PYTHON "
             "names another python)");
    char root[256], cmd[700];
    thf_path(root, sizeof(root), "gpu_moe");
    thf_remove(root);
    snprintf(cmd, sizeof(cmd), "${MT_PYTHON:-python3} dev/hf_moe_check.py --write '%s' 2>&1", root);
    int code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0, "dev/hf_moe_check.py --write: exit %d: %s", code, out);
    printf("%s", out);
    static const char* const names[3] = {"mixtral", "qwen3", "qwen3_tied"};
    test_result res = TEST_PASS;
    for (int k = 0; k < 3 && res == TEST_PASS; k++) {
        char hf_dir[400], ck_dir[400], ref[400];
        snprintf(hf_dir, sizeof(hf_dir), "%s/%s", root, names[k]);
        snprintf(ck_dir, sizeof(ck_dir), "%s/%s_ckpt", root, names[k]);
        snprintf(ref, sizeof(ref), "%s/%s.ref.bin", root, names[k]);
        size_t size = 0;
        char* raw = test_read_file(ref, &size);
        int32_t dims[3] = {0, 0, 0};
        if (raw && size >= 12) memcpy(dims, raw, 12);
        const int B = dims[0], T = dims[1];
        const int64_t V = dims[2];
        EXPECT(raw && B > 0 && T > 0 && V > 0 && size == 12 + 4 * (size_t)B * T + 8 * (size_t)B * T * (size_t)V,
               "%s: %zu bytes", ref, size);
        int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * T);
        double* want = (double*)malloc(sizeof(double) * (size_t)B * T * (size_t)V);
        memcpy(tokens, raw + 12, sizeof(int32_t) * (size_t)B * T);
        memcpy(want, raw + 12 + 4 * (size_t)B * T, sizeof(double) * (size_t)B * T * (size_t)V);
        free(raw);
        mt_error err;
        mt_config c;
        float* p = NULL;
        EXPECT_OK(mt_hf_load(hf_dir, &c, &p, NULL, &err), &err);
        EXPECT_OK(mt_hf_checkpoint_write(ck_dir, &c, p, 0, &err), &err);
        c.seq_length = T;
        c.micro_batch_size = B;
        c.global_batch_size = B;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        const int64_t n = mt_num_parameters(&c);
        float* q = (float*)malloc(sizeof(float) * (size_t)n);
        float* logits = (float*)malloc(sizeof(float) * (size_t)B * T * (size_t)c.padded_vocab_size);
        mt_precision precisions[2] = {MT_FP32, MT_BF16};
        for (int pr = 0; pr < 2 && res == TEST_PASS; pr++) {
            c.precision = precisions[pr];
            mt_trainer* t = NULL;
            int64_t it = -1;
            mt_status st = mt_trainer_create(&t, &c, &err);
            if (st == MT_OK) st = mt_trainer_load(t, ck_dir, -1, &it, NULL, &err);
            if (st == MT_OK) st = mt_trainer_get_parameters(t, q, &err);
            if (st == MT_OK) st = mt_trainer_logits(t, tokens, logits, &err);
            mt_trainer_free(t);
            if (st != MT_OK) {
                printf("    FAIL %s %s: %s\n", names[k], pr ? "bf16" : "fp32", err.message);
                res = TEST_FAIL;
                break;
            }
            if (it != 0 || memcmp(p, q, sizeof(float) * (size_t)n) != 0) {
                printf("    FAIL %s: the trainer's parameters are not the checkpoint's (iteration %lld)\n", names[k],
                       (long long)it);
                res = TEST_FAIL;
                break;
            }
            double worst = 0;
            const double rel = thf_trimmed_rel_err(logits, c.padded_vocab_size, want, V, B * T, pr ? 0.1 : 0.0, &worst);
            const double tol = pr ? 3e-2 : 1e-5;
            printf("    %s %s logits vs transformers (float64): rel err %.2e%s (tol %.0e), worst token %.2e\n", names[k],
                   pr ? "bf16" : "fp32", rel, pr ? " without the 10% worst tokens" : "", tol, worst);
            if (!(rel < tol)) res = TEST_FAIL;
        }
        free(q);
        free(logits);
        free(tokens);
        free(want);
        free(p);
    }
    thf_remove(root);
    return res;
}

/* Writes one element of tensor `name` of dir's model.safetensors as the bit pattern `bits` of the
 * tensor's dtype (4 bytes for F32, else the low 2), in place; 0 on success. */
static int thf_poke(const char* dir, const char* name, int64_t index, uint32_t bits) {
    char path[400];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    mt_safetensors* st = NULL;
    mt_error err;
    if (mt_safetensors_open(&st, path, &err) != MT_OK) return -1;
    const mt_st_tensor* t = mt_safetensors_find(st, name);
    int size = t ? mt_st_dtype_size(t->dtype) : 0;
    long at = t && index < t->numel ? (long)(t->begin + (uint64_t)(index * size)) : -1;
    mt_safetensors_close(st);
    FILE* f = fopen(path, "r+b");
    uint64_t header = 0;
    int ok = f && at >= 0 && fread(&header, 8, 1, f) == 1 && fseek(f, (long)(8 + header) + at, SEEK_SET) == 0 &&
             fwrite(&bits, (size_t)size, 1, f) == 1; /* little-endian: the low bytes first */
    if (f && fclose(f) != 0) ok = 0;
    return ok ? 0 : -1;
}

/* Hugging Face weights holding a NaN or an infinity are refused on import in one line naming the file,
 * the tensor and the element's index in the tensor's own order (prepro/hf_checkpoint.h mt_hf__read, the
 * one place every imported tensor passes), in each dtype the reader takes (F32, BF16, F16): a NaN in the
 * word embeddings, +Inf in a layer's MLP weight (a transposed tensor: its index is the file's, not
 * ours), -Inf in the last norm's bias; the same file with the element restored loads. convert_hf
 * --import refuses it too (exit 1, one line, nothing written) when it is built. */
static test_result test_hf_nonfinite_refused(void) {
    char root[256], hf_dir[300], ck_dir[300];
    thf_path(root, sizeof(root), "nonfinite");
    thf_remove(root);
    snprintf(hf_dir, sizeof(hf_dir), "%s/hf", root);
    snprintf(ck_dir, sizeof(ck_dir), "%s/ck", root);
    mt_config c = thf_small_config();
    float* p = thf_random_params(&c);
    EXPECT(p, "params");
    mt_error err;
    const struct { mt_st_dtype dtype; uint32_t nan, inf, neg_inf; } dtypes[] = {
        {MT_ST_F32, 0x7fc00000u, 0x7f800000u, 0xff800000u},
        {MT_ST_BF16, 0x7fc0u, 0x7f80u, 0xff80u},
        {MT_ST_F16, 0x7e00u, 0x7c00u, 0xfc00u},
    };
    const struct { const char* name; int64_t index; int kind; const char* said; } pokes[] = {
        {"transformer.wte.weight", 5 * 64 + 7, 0, "NaN"},
        {"transformer.h.1.mlp.c_fc.weight", 64 * 256 - 3, 1, "Inf"},
        {"transformer.ln_f.bias", 63, 2, "-Inf"},
    };
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
        thf_remove(hf_dir);
        EXPECT_OK(mt_hf_save(hf_dir, &c, p, c.vocab_size, dtypes[d].dtype, 0, &err), &err);
        for (size_t k = 0; k < sizeof(pokes) / sizeof(pokes[0]); k++) {
            /* the value there before, to restore */
            char path[400];
            snprintf(path, sizeof(path), "%s/model.safetensors", hf_dir);
            size_t n_before = 0;
            char* before = test_read_file(path, &n_before);
            EXPECT(before, "read %s", path);
            const uint32_t bits = pokes[k].kind == 0 ? dtypes[d].nan : pokes[k].kind == 1 ? dtypes[d].inf : dtypes[d].neg_inf;
            EXPECT(thf_poke(hf_dir, pokes[k].name, pokes[k].index, bits) == 0, "poke %s", pokes[k].name);
            char want[300];
            snprintf(want, sizeof(want), "model.safetensors: tensor %s holds %s at index %lld", pokes[k].name,
                     pokes[k].said, (long long)pokes[k].index);
            mt_config got;
            float* q = NULL;
            err.message[0] = 0;
            mt_status st = mt_hf_load(hf_dir, &got, &q, NULL, &err);
            free(q);
            EXPECT(st == MT_ERR_FORMAT && strstr(err.message, want) && !strchr(err.message, '\n'),
                   "%s, %s: status %s, message '%s' (want '...%s')", mt_st_dtype_name(dtypes[d].dtype), pokes[k].name,
                   mt_status_name(st), err.message, want);
            if (d == 0 && k == 0 && access("prepro/convert_hf", X_OK) == 0) {
                char cmd[900], out[4096];
                snprintf(cmd, sizeof(cmd), "prepro/convert_hf --import '%s' --save '%s' 2>&1 >/dev/null", hf_dir, ck_dir);
                int code = test_command_output(cmd, out, sizeof(out));
                EXPECT(code == 1 && !strncmp(out, "convert_hf: error: ", 19) && strstr(out, want) &&
                           strchr(out, '\n') == out + strlen(out) - 1 && access(ck_dir, F_OK) != 0,
                       "convert_hf --import of a NaN: exit %d, '%s'", code, out);
            }
            EXPECT(thf_write_bytes(path, before, n_before) == 0, "restore");
            free(before);
            q = NULL;
            EXPECT_OK(mt_hf_load(hf_dir, &got, &q, NULL, &err), &err);
            free(q);
        }
    }
    free(p);
    thf_remove(root);
    return TEST_PASS;
}

static const test_case hf_tests[] = {
    {"hf_json", test_hf_json},
    {"hf_float_conversions", test_hf_float_conversions},
    {"hf_safetensors_roundtrip", test_hf_safetensors_roundtrip},
    {"hf_safetensors_rejects", test_hf_safetensors_rejects},
    {"hf_safetensors_sharded", test_hf_safetensors_sharded},
    {"hf_gpt2_mapping_roundtrip", test_hf_gpt2_mapping_roundtrip},
    {"hf_gpt2_matches_reference_logits", test_hf_gpt2_matches_reference_logits},
    {"hf_gpt2_directories", test_hf_gpt2_directories},
    {"hf_gpt2_rejects", test_hf_gpt2_rejects},
    {"hf_llama_mapping_roundtrip", test_hf_llama_mapping_roundtrip},
    {"hf_llama_directories", test_hf_llama_directories},
    {"hf_llama_tied", test_hf_llama_tied},
    {"hf_llama_rejects", test_hf_llama_rejects},
    {"hf_nonfinite_refused", test_hf_nonfinite_refused},
    {"hf_moe_mapping_roundtrip", test_hf_moe_mapping_roundtrip},
    {"hf_moe_directories", test_hf_moe_directories},
    {"hf_moe_rejects", test_hf_moe_rejects},
};

static const test_case hf_gpu_tests[] = {
    {"hf_gpu_load", test_hf_gpu_load},
    {"hf_gpu_load_llama", test_hf_gpu_load_llama},
    {"hf_gpu_moe_transformers", test_hf_gpu_moe_transformers},
};

#endif
