/*
 * fuzz_hf_config — a Hugging Face checkpoint directory as convert_hf --import reads it: config.json
 * (mt_json_parse, mt_hf_detect, the architecture's read_config into a finalized mt_config, its
 * tensor list), then, for models of at most 2^20 parameters, mt_hf_load of the directory with the
 * input's model.safetensors, and for those it accepts, an export (mt_hf_save, F32) read back to the
 * same parameters bit for bit.
 *
 * Input: config.json, FZ_SEP, model.safetensors.
 */
#include "fuzz_common.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "prepro/safetensors.h"
#define MT_HF_IMPLEMENTATION
#include "prepro/hf_checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_parts p;
    fz_split(data, size, &p);
    size_t nc, nw;
    const uint8_t* config = fz_part(&p, 0, &nc);
    const uint8_t* weights = fz_part(&p, 1, &nw);
    mt_json* root = NULL;
    mt_error err;
    char* text = fz_cstr(config, nc); /* the parser takes a length; the copy only bounds reads past it for ASan */
    mt_status st = mt_json_parse(&root, text, nc, "config.json", &err);
    free(text);
    if (st != MT_OK) {
        fz_check_error(&err);
        return 0;
    }
    const mt_hf_arch* arch = NULL;
    mt_config cfg;
    int head_required = 0;
    st = root->type == MT_JSON_OBJECT ? mt_hf_detect(root, "config.json", &arch, &err) : MT_ERR_FORMAT;
    if (st == MT_OK) st = arch->read_config(root, "config.json", &cfg, &head_required, &err);
    mt_json_free(root);
    if (st != MT_OK) {
        if (st != MT_ERR_FORMAT || arch) fz_check_error(&err);
        return 0;
    }
    const int64_t n = mt_num_parameters(&cfg);
    FZ_ASSERT(n > 0, "%lld parameters", (long long)n);
    if (arch->check(&cfg, cfg.vocab_size, &err) != MT_OK) fz_check_error(&err);
    int64_t listed = 0;
    const int count = arch->num_tensors(&cfg);
    FZ_ASSERT(count > 0, "%d tensors", count);
    for (int i = 0; i < count && i < 100000; i++) {
        mt_hf_tensor t;
        arch->tensor(&cfg, cfg.vocab_size, i, &t);
        int64_t numel = 1;
        for (int d = 0; d < t.ndim; d++) FZ_ASSERT(!mt_mul_overflows_i64(numel, t.shape[d], &numel), "tensor %d's size", i);
        FZ_ASSERT(numel == t.numel, "tensor %d: %lld elements, shape says %lld", i, (long long)t.numel, (long long)numel);
        listed += t.numel;
    }
    if (n > (1 << 20)) return 0;
    fz_reset();
    char path[4200], dir[4200], out_dir[4200];
    fz_write("hf/config.json", config, nc, path, sizeof(path));
    fz_write("hf/model.safetensors", weights, nw, path, sizeof(path));
    fz_path("hf", dir, sizeof(dir));
    mt_config loaded;
    float* params = NULL;
    const mt_hf_arch* arch2 = NULL;
    if (mt_hf_load(dir, &loaded, &params, &arch2, &err) != MT_OK) {
        FZ_ASSERT(params == NULL, "a failed load left parameters");
        fz_check_error(&err);
        return 0;
    }
    FZ_ASSERT(arch2 == arch && mt_num_parameters(&loaded) == n, "the load's model differs from config.json's");
    fz_touch(params, sizeof(float) * (size_t)n);
    fz_path("export", out_dir, sizeof(out_dir));
    if (mt_hf_save(out_dir, &loaded, params, loaded.vocab_size, MT_ST_F32, 0, &err) == MT_OK) {
        mt_config again;
        float* back = NULL;
        FZ_ASSERT(mt_hf_load(out_dir, &again, &back, NULL, &err) == MT_OK, "the export does not load: %s", err.message);
        FZ_ASSERT(mt_num_parameters(&again) == n && !memcmp(back, params, sizeof(float) * (size_t)n),
                  "export and import are not the same parameters");
        free(back);
    } else {
        fz_check_error(&err);
    }
    free(params);
    return 0;
}
