/*
 * fuzz_checkpoint — a checkpoint directory as train_gpt --load, checkpoint_tool and convert_hf --export
 * read it: the tracker (mt_checkpoint_read_tracker), the model file's header words
 * (mt_checkpoint_header_check, mt_checkpoint_file_bytes, mt_config_from_checkpoint_header), the
 * whole layout (checkpoint_tool.h's mt_ckpt_open, mt_ckpt_verify, an MoE checkpoint's expert bias in
 * every model file by mt_ckpt_read_expert_bias, and for models of at most 2^20 parameters mt_ckpt_read
 * of every array), mt_checkpoint_select, and mt_hf_checkpoint_read.
 *
 * Input: the tracker text, then the checkpoint's files joined by FZ_SEP, each as its path relative to
 * the checkpoint directory, a newline, and its bytes (a path with a ".." part, a leading '/' or over
 * 200 characters is skipped): e.g. "iter_0000002/mp_rank_00/model_optim_rng.bin\n<bytes>",
 * "iter_0000002/manifest.txt\n<text>". The first model_optim_rng.bin's header words are also checked
 * on their own.
 */
#include "fuzz_common.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "prepro/safetensors.h"
#define MT_HF_IMPLEMENTATION
#include "prepro/hf_checkpoint.h"
#include "prepro/checkpoint_tool.h"

/* A part's path, if it is one this target writes (inside the checkpoint directory). */
static int fz_rel_ok(const char* rel) {
    if (!*rel || *rel == '/' || strlen(rel) > 200) return 0;
    for (const char* q = rel; (q = strstr(q, "..")) != NULL; q += 2)
        if ((q == rel || q[-1] == '/') && (q[2] == 0 || q[2] == '/')) return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_parts p;
    fz_split(data, size, &p);
    fz_reset();
    char path[4200], dir[4200];
    size_t n;
    const uint8_t* part = fz_part(&p, 0, &n);
    fz_write("ckpt/latest_checkpointed_iteration.txt", part, n, path, sizeof(path));
    fz_path("ckpt", dir, sizeof(dir));
    mt_error err;
    const uint8_t* model = NULL;
    size_t model_n = 0;
    for (int k = 1; k < p.count; k++) {
        part = fz_part(&p, k, &n);
        const uint8_t* nl = (const uint8_t*)memchr(part, '\n', n);
        if (!nl) continue;
        char rel[256], name[300];
        size_t len = (size_t)(nl - part);
        if (len >= sizeof(rel) || memchr(part, 0, len)) continue;
        memcpy(rel, part, len);
        rel[len] = 0;
        if (!fz_rel_ok(rel)) continue;
        snprintf(name, sizeof(name), "ckpt/%s", rel);
        if (fz_try_write(name, nl + 1, n - len - 1, path, sizeof(path)) != 0) continue;
        if (!model && len >= 19 && !strcmp(rel + len - 19, "model_optim_rng.bin")) {
            model = nl + 1;
            model_n = n - len - 1;
        }
    }
    /* the tracker, once every file is written (a part may replace it) */
    int64_t iteration = -1;
    if (mt_checkpoint_read_tracker(dir, &iteration, &err) != MT_OK) fz_check_error(&err);
    else FZ_ASSERT(iteration >= 0, "tracker iteration %lld", (long long)iteration);
    /* the header words alone */
    int64_t h[MT_CK_HEADER_WORDS];
    n = model_n;
    if (model && n >= sizeof(h)) {
        memcpy(h, model, sizeof(h));
        mt_config c;
        mt_config_defaults(&c);
        if (mt_checkpoint_header_check(h, "header", &c, &err) == MT_OK) {
            FZ_ASSERT(mt_checkpoint_file_bytes(h, 0) >= (int64_t)sizeof(h) && mt_checkpoint_file_bytes(h, 1) >= (int64_t)sizeof(h),
                      "file sizes %lld, %lld", (long long)mt_checkpoint_file_bytes(h, 0), (long long)mt_checkpoint_file_bytes(h, 1));
            mt_config d;
            mt_config_defaults(&d);
            mt_config_from_checkpoint_header(&d, h);
            FZ_ASSERT(mt_num_parameters(&c) > 0, "a checked header's model has %lld parameters", (long long)mt_num_parameters(&c));
        } else {
            fz_check_error(&err);
        }
    }
    /* the tools' reader */
    mt_ckpt ck;
    mt_ckpt_ddp ddp = {0, 0};
    if (mt_ckpt_open(&ck, dir, -1, &err) == MT_OK) {
        if (mt_ckpt_verify(&ck, &ddp, &err) != MT_OK) fz_check_error(&err);
        /* the routers' expert bias of every model file, past the integrity rule (a load's read at another layout) */
        const int64_t bias = mt_checkpoint_expert_bias_numel(ck.header, NULL);
        if (bias > 0 && bias <= (1 << 20)) {
            float* b = (float*)malloc(sizeof(float) * (size_t)bias);
            if (mt_ckpt_read_expert_bias(&ck, 1, b, &err) != MT_OK) fz_check_error(&err);
            else for (int64_t i = 0; i < bias; i++) FZ_ASSERT(isfinite(b[i]), "expert bias %lld is %g", (long long)i, b[i]);
            free(b);
        }
        mt_config full = ck.cfg;
        full.tensor_model_parallel_size = 1;
        full.pipeline_model_parallel_size = 1;
        full.virtual_pipeline_size = 1;
        const int64_t params = mt_num_parameters(&full);
        if (params > 0 && params <= (1 << 20)) {
            float* arrays[MT_CKPT_ARRAYS];
            for (int a = 0; a < MT_CKPT_ARRAYS; a++) arrays[a] = (float*)calloc((size_t)params, sizeof(float));
            if (mt_ckpt_read(&ck, &ddp, arrays, &err) != MT_OK) fz_check_error(&err);
            for (int a = 0; a < MT_CKPT_ARRAYS; a++) free(arrays[a]);
        }
    } else {
        fz_check_error(&err);
    }
    int64_t chosen = -1;
    int fell_back = 0;
    mt_error warning;
    if (mt_checkpoint_select(dir, -1, 0, &chosen, &fell_back, &warning, &err) == MT_OK)
        FZ_ASSERT(chosen >= 0 && chosen <= iteration, "select chose %lld of %lld", (long long)chosen, (long long)iteration);
    else
        fz_check_error(&err);
    /* convert_hf --export's reader (TP = PP = 1 only), for models of at most 2^20 parameters */
    if (model && n >= sizeof(h) && h[MT_CK_NUM_PARAMS] > 0 && h[MT_CK_NUM_PARAMS] <= (1 << 20)) {
        mt_config c;
        float* params = NULL;
        /* --no-verify: past the integrity rule, so that damaged files reach the header and size checks */
        if (mt_hf_checkpoint_read(dir, -1, 1, &c, &params, NULL, &warning, &err) == MT_OK)
            fz_touch(params, 4 * (size_t)h[MT_CK_NUM_PARAMS]);
        else fz_check_error(&err);
        free(params);
    }
    return 0;
}
