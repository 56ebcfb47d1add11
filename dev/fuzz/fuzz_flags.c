/*
 * fuzz_flags — train_gpt's command line: tg_flags_parse, tg_flags_apply and mt_config_finalize, as
 * train_gpt's main runs them (no GPU needed), then what the trainer computes from the config first:
 * the parameter count, the sample counts, the learning-rate schedule, the batch ramp, the FLOPs and
 * (for models of at most 4096 layers) the memory plan of every pipeline stage.
 *
 * Input: 4 bytes (world size 1..4096 from the first two, the vocabulary from the next two, scaled),
 * then the arguments separated by NUL bytes (argv[0] is supplied).
 */
#include "fuzz_common.h"
#include "train_gpt_flags.h"

#include <math.h>

static void fz_after_finalize(const tg_flags* v) {
    const mt_config* c = &v->cfg;
    int64_t params = mt_num_parameters(c);
    FZ_ASSERT(params > 0, "a finalized config with %lld parameters", (long long)params);
    FZ_ASSERT(mt_num_micro_batches(c) >= 1, "%d micro-batches", mt_num_micro_batches(c));
    mt_error err;
    int64_t samples[3];
    if (mt_gpt_num_samples(c->train_iters, v->eval_interval, v->eval_iters, c->global_batch_size, samples, &err) != MT_OK)
        fz_check_error(&err);
    const int64_t steps[] = {0, 1, c->lr_warmup_iters, c->lr_decay_iters, c->train_iters, INT64_MAX / 4};
    for (size_t k = 0; k < sizeof(steps) / sizeof(steps[0]); k++) {
        double lr = mt_learning_rate(c, steps[k] < 0 ? 0 : steps[k]);
        FZ_ASSERT(isfinite(lr) && lr >= 0, "learning rate %g at step %lld", lr, (long long)steps[k]);
    }
    FZ_ASSERT(mt_global_batch_size_at(c, 0) >= 1, "global batch %d at sample 0", mt_global_batch_size_at(c, 0));
    double flops = mt_flops_per_iteration(c, c->global_batch_size);
    FZ_ASSERT(flops >= 0, "%g FLOPs per iteration", flops);
    if (c->num_layers <= 4096 && c->pipeline_model_parallel_size <= 64) {
        mt_plan_options opts;
        mt_plan_options_defaults(&opts);
        mt_memory_plan plan;
        if (mt_memory_plan_compute(c, &opts, &plan, &err) != MT_OK) fz_check_error(&err);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_bytes b = {data, size < 4 ? size : 4};
    const int world = 1 + (int)(fz_take(&b, 2) % 4096);
    const uint64_t v16 = fz_take(&b, 2);
    const int64_t vocab = v16 == 0 ? 50257 : (int64_t)v16 * (v16 & 1 ? 3 : 1);
    data += b.p - data;
    size -= size < 4 ? size : 4;
    /* argv: the NUL-separated words (a copy each: the parser keeps pointers into argv) */
    char* text = fz_cstr(data, size);
    int argc = 1;
    for (size_t i = 0; i < size; i++) argc += text[i] == 0;
    argc += 1;
    char** argv = (char**)calloc((size_t)argc + 1, sizeof(char*));
    argv[0] = (char*)"train_gpt";
    int n = 1;
    for (size_t i = 0; i <= size; n++) {
        argv[n] = text + i;
        i += strlen(text + i) + 1;
    }
    argv[n] = NULL;
    tg_flags v;
    char msg[512];
    tg_flags_init(&v);
    int r = tg_flags_parse(&v, n, argv, msg, sizeof(msg));
    if (r < 0) {
        FZ_ASSERT(msg[0], "parse failed without a message");
    } else if (r == 0) {
        if (tg_flags_apply(&v, msg, sizeof(msg)) != 0) {
            FZ_ASSERT(msg[0], "apply failed without a message");
        } else {
            char info[4096];
            tg_flags_info_line(&v, info, sizeof(info));
            v.cfg.vocab_size = v.null_vocab_size > 0 && !v.tokenizer_type ? v.null_vocab_size : vocab;
            v.cfg.eod_token = (int)(v.cfg.vocab_size - 1 < INT32_MAX ? v.cfg.vocab_size - 1 : 0);
            v.cfg.world_size = world;
            v.cfg.rank = 0;
            mt_error err;
            if (mt_config_finalize(&v.cfg, &err) == MT_OK) fz_after_finalize(&v);
            else fz_check_error(&err);
        }
    }
    free(argv);
    free(text);
    return 0;
}
