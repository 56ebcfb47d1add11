/*
 * fuzz_safetensors — the safetensors reader: mt_safetensors_open on one file (its 8-byte header
 * length, the JSON header, dtypes, shapes, data offsets, __metadata__) or on a sharded checkpoint
 * through model.safetensors.index.json, then every tensor looked up by name, its bytes touched and,
 * for float dtypes of at most 2^20 elements, converted with mt_safetensors_read_f32.
 *
 * Input: either one .safetensors file, or (when it holds FZ_SEP) model.safetensors.index.json,
 * FZ_SEP, then the shards, written as model-00001-of-0000N.safetensors, model-00002-... in order.
 */
#include "fuzz_common.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "prepro/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_parts p;
    fz_split(data, size, &p);
    fz_reset();
    char path[4200], open_path[4200];
    size_t n;
    const uint8_t* part;
    if (p.count == 1) {
        fz_write("model.safetensors", data, size, open_path, sizeof(open_path));
    } else {
        part = fz_part(&p, 0, &n);
        fz_write("model.safetensors.index.json", part, n, open_path, sizeof(open_path));
        for (int k = 1; k < p.count; k++) {
            char name[64];
            snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", k, p.count - 1);
            part = fz_part(&p, k, &n);
            fz_write(name, part, n, path, sizeof(path));
        }
    }
    mt_safetensors* st = NULL;
    mt_error err;
    if (mt_safetensors_open(&st, open_path, &err) != MT_OK) {
        FZ_ASSERT(st == NULL, "a failed open left a handle");
        fz_check_error(&err);
        return 0;
    }
    const int count = mt_safetensors_count(st);
    FZ_ASSERT(count >= 0, "%d tensors", count);
    for (int i = 0; i < count; i++) {
        const mt_st_tensor* t = mt_safetensors_at(st, i);
        FZ_ASSERT(t && t->name, "tensor %d", i);
        FZ_ASSERT(mt_safetensors_find(st, t->name) == t, "find(%s) is not tensor %d", t->name, i);
        FZ_ASSERT(t->ndim >= 0 && t->ndim <= MT_ST_MAX_DIMS && t->numel >= 0, "%s: ndim %d numel %lld", t->name, t->ndim,
                  (long long)t->numel);
        FZ_ASSERT(t->end >= t->begin && t->end - t->begin == (uint64_t)t->numel * mt_st_dtype_size(t->dtype),
                  "%s: %llu bytes for %lld elements of %zu", t->name, (unsigned long long)(t->end - t->begin),
                  (long long)t->numel, mt_st_dtype_size(t->dtype));
        fz_touch(mt_safetensors_data(st, t), (size_t)(t->end - t->begin));
        fz_touch(mt_safetensors_file_path(st, t), 1);
        if (t->numel <= (1 << 20)) {
            float* out = (float*)malloc(sizeof(float) * (size_t)(t->numel ? t->numel : 1));
            if (mt_safetensors_read_f32(st, t, out, &err) != MT_OK) fz_check_error(&err);
            free(out);
        }
    }
    FZ_ASSERT(mt_safetensors_at(st, -1) == NULL && mt_safetensors_at(st, count) == NULL, "at() out of range");
    const char* v = mt_safetensors_metadata(st, "format");
    if (v) fz_touch(v, strlen(v));
    mt_safetensors_close(st);
    return 0;
}
