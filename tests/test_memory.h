/* tests/test_memory.h — the memory plan (megatron.h mt_memory_plan_compute) and optimizer offload.
 *
 * Host: the plan's counts agree with the parallel geometry it is built from (buffer layout, TP shard,
 * DP shard, pipeline stages and in-flight micro-batches, recompute, offload, FP8), the layouts of a
 * world size come sorted by the cost model, the CPU AdamW equals its scalar reference bit for bit
 * (vectorised and threaded) and AdamW computed in double within fp32 rounding, and train_gpt --plan
 * answers with no GPU. GPU: what mt_trainer_create allocates, category by category, is the plan's to
 * the byte (and the device's own count agrees); a plan that cannot fit is refused before anything is
 * allocated; training with the optimizer offloaded gives the GPU optimizer's losses and weights
 * exactly (the bound is 0: the CPU AdamW performs the GPU kernel's IEEE operations, fused
 * multiply-adds included, in its order; sm_90 SASS checked), also across a save and resume, and with
 * the distributed optimizer on several GPUs. */
#ifndef MT_TEST_MEMORY_H
#define MT_TEST_MEMORY_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_common.h"
#include "test_configs.h"

/* ---- host: the plan ------------------------------------------------------------------------------ */

static mt_status memory_finalized(mt_config* c, int world, int tp, int sp, int dist, mt_error* err) {
    test_config_parallel(c, tp, world, sp);
    test_config_ddp(c, dist, 0, 0, 0);
    c->global_batch_size = 0;
    return mt_config_finalize(c, err);
}

/* Buffer, parameters, shard and bytes per parameter are the geometry's; the total is the categories' sum. */
static test_result test_plan_counts(void) {
    struct { const char* name; int llama; mt_precision prec; int world, tp, sp, dist; double bytes_per_param; } cases[] = {
        {"gpt2 fp32", 0, MT_FP32, 1, 1, 0, 0, 16.0},          /* weights are the master: 4 + 4 + 8 */
        {"gpt2 bf16", 0, MT_BF16, 1, 1, 0, 0, 18.0},          /* 2 + 4 + 4 + 8 */
        {"llama bf16", 1, MT_BF16, 1, 1, 0, 0, 18.0},
        {"gpt2 bf16 TP2 SP", 0, MT_BF16, 2, 2, 1, 0, 18.0},
        {"llama bf16 DP4 distributed", 1, MT_BF16, 4, 1, 0, 1, 6.0 + 12.0 / 4},
        {"gpt2 fp32 DP2 distributed", 0, MT_FP32, 2, 1, 0, 1, 8.0 + 12.0 / 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = test_config(cases[i].llama ? TEST_LLAMA : TEST_GPT2, cases[i].prec);
        mt_error err;
        EXPECT_OK(memory_finalized(&c, cases[i].world, cases[i].tp, cases[i].sp, cases[i].dist, &err), &err);
        mt_memory_plan p;
        EXPECT_OK(mt_memory_plan_compute(&c, NULL, &p, &err), &err);
        mt_buffer_layout B;
        EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
        int64_t size = B.size;
        mt_buffer_layout_free(&B);
        const int64_t params = mt_param_layout_shard(&c, NULL);
        const int64_t shard = c.use_distributed_optimizer && c.data_parallel_size > 1 ? size / c.data_parallel_size : size;
        const size_t state = p.parameter_bytes + p.master_bytes + p.gradient_bytes + p.optimizer_bytes;
        const double per_param = (double)state / (double)p.num_parameters;
        printf("      %-28s %lld parameters, buffer %lld, shard %lld, %.3f bytes/param, activations %.2f MiB\n",
               cases[i].name, (long long)p.num_parameters, (long long)p.buffer_elements, (long long)p.shard_elements,
               per_param, p.activation_bytes / 1048576.0);
        EXPECT(p.buffer_elements == size && p.num_parameters == params && p.shard_elements == shard,
               "%s: buffer %lld (layout %lld), parameters %lld (%lld), shard %lld (%lld)", cases[i].name,
               (long long)p.buffer_elements, (long long)size, (long long)p.num_parameters, (long long)params,
               (long long)p.shard_elements, (long long)shard);
        /* padding (64 elements per tensor, buckets to lcm(dp, 128)) is < 1% at this size */
        EXPECT(fabs(per_param - cases[i].bytes_per_param) < 0.01 * cases[i].bytes_per_param, "%s: %.4f bytes per "
               "parameter, Megatron's table says %.4f", cases[i].name, per_param, cases[i].bytes_per_param);
        EXPECT(p.total_bytes == state + p.activation_bytes + p.workspace_bytes + p.fp8_bytes + p.offload_bytes &&
               p.device_bytes == p.total_bytes + p.overhead_bytes && p.in_flight == 1 && p.offload_elements == 0,
               "%s: the totals are not the categories' sum", cases[i].name);
    }
    /* sequence parallelism cuts the norm and residual rows by TP */
    mt_config a = test_config(TEST_GPT2, MT_BF16), b = a;
    mt_error err;
    EXPECT_OK(memory_finalized(&a, 2, 2, 0, 0, &err), &err);
    EXPECT_OK(memory_finalized(&b, 2, 2, 1, 0, &err), &err);
    mt_memory_plan pa, pb;
    EXPECT_OK(mt_memory_plan_compute(&a, NULL, &pa, &err), &err);
    EXPECT_OK(mt_memory_plan_compute(&b, NULL, &pb, &err), &err);
    EXPECT(pb.activation_saved_bytes < pa.activation_saved_bytes, "SP: %zu saved bytes, without %zu",
           pb.activation_saved_bytes, pa.activation_saved_bytes);
    return TEST_PASS;
}

/* Megatron's pipeline: L / PP layers per rank, embeddings on the first, head (and, tied, a copy of the
 * word embeddings) on the last, min(PP - rank, M) micro-batches in flight; VP chunks interleave. */
static test_result test_plan_pipeline(void) {
    for (int untied = 0; untied <= 1; untied++) {
        mt_config c = test_config(TEST_GPT2, MT_BF16);
        c.num_layers = 8;
        c.untie_embeddings_and_output_weights = untied;
        c.pipeline_model_parallel_size = 4;
        test_config_parallel(&c, 1, 4, 0);
        test_config_batch(&c, 1, 8); /* M = 8 */
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        const int64_t full = mt_param_layout(&c, info), word = info[MT_P_WORD_EMBEDDINGS].numel;
        int64_t layers = 0; /* every transformer layer's parameters */
        for (int k = MT_P_LN1_WEIGHT; k <= MT_P_FC2_BIAS; k++) layers += info[k].numel;
        int64_t sum = 0;
        size_t worst = 0;
        for (int r = 0; r < 4; r++) {
            mt_plan_options o;
            mt_plan_options_defaults(&o);
            o.pp_rank = r;
            mt_memory_plan p;
            EXPECT_OK(mt_memory_plan_compute(&c, &o, &p, &err), &err);
            sum += p.num_parameters;
            if (p.device_bytes > worst) worst = p.device_bytes;
            EXPECT(p.num_layers == 2 && p.in_flight == 4 - r, "rank %d: %d layers, %d in flight (want 2, %d)", r,
                   p.num_layers, p.in_flight, 4 - r);
            if (r == 1 || r == 2) /* a middle stage: two layers, nothing else */
                EXPECT(p.num_parameters == layers / 4, "rank %d holds %lld parameters, 2 layers are %lld", r,
                       (long long)p.num_parameters, (long long)(layers / 4));
        }
        /* the stages hold the model once, plus the last stage's copy of tied word embeddings */
        EXPECT(sum == full + (untied ? 0 : word), "untied %d: stages hold %lld, the model %lld (word embeddings %lld)",
               untied, (long long)sum, (long long)full, (long long)word);
        mt_memory_plan any;
        EXPECT_OK(mt_memory_plan_compute(&c, NULL, &any, &err), &err);
        EXPECT(any.device_bytes == worst, "the default plan is not the largest stage's");
        /* interleaved: 2 chunks of 1 layer; rank r warms up 2 (PP - r - 1) + (VP - 1) PP forwards */
        mt_plan_options o;
        mt_plan_options_defaults(&o);
        o.virtual_pipeline_size = 2;
        for (int r = 0; r < 4; r++) {
            o.pp_rank = r;
            mt_memory_plan p;
            EXPECT_OK(mt_memory_plan_compute(&c, &o, &p, &err), &err);
            int want = 2 * (4 - r - 1) + 4 + 1;
            EXPECT(p.num_layers == 2 && p.in_flight == want, "VP 2 rank %d: %d layers, %d in flight (want 2, %d)", r,
                   p.num_layers, p.in_flight, want);
        }
        o.virtual_pipeline_size = 3; /* 8 layers do not split into 4 x 3 chunks */
        o.pp_rank = -1;
        mt_memory_plan p;
        EXPECT(mt_memory_plan_compute(&c, &o, &p, &err) == MT_ERR_CONFIG && strstr(err.message, "divisible"),
               "VP 3 of 8 layers on PP 4: '%s'", err.message);
    }
    return TEST_PASS;
}

/* Recompute keeps less, offload moves the optimizer's end to the host, FP8 adds its arena. */
static test_result test_plan_recompute_offload_fp8(void) {
    mt_config c = test_config(TEST_GPT2, MT_FP32); /* the exact attention path: probabilities are kept */
    c.num_layers = 4;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_plan_options o;
    mt_plan_options_defaults(&o);
    mt_memory_plan none, selective, full, block;
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &none, &err), &err);
    o.recompute.granularity = MT_RECOMPUTE_SELECTIVE;
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &selective, &err), &err);
    o.recompute.granularity = MT_RECOMPUTE_FULL;
    o.recompute.method = MT_RECOMPUTE_UNIFORM;
    o.recompute.num_layers = 1;
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &full, &err), &err);
    o.recompute.method = MT_RECOMPUTE_BLOCK;
    o.recompute.num_layers = 0; /* every layer */
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &block, &err), &err);
    mt_activation_layout a;
    mt_activation_layout_compute(&c, 4, 1, 1, 1, NULL, &a);
    const size_t probs = a.bytes[MT_ACT_PROBS] / 4; /* one layer's attention probabilities */
    printf("      activations: none %zu, selective %zu, full uniform 1 %zu, full block all %zu bytes\n",
           none.activation_bytes, selective.activation_bytes, full.activation_bytes, block.activation_bytes);
    EXPECT(none.activation_bytes - selective.activation_bytes >= 3 * probs, "selective kept the probabilities");
    EXPECT(full.activation_bytes < selective.activation_bytes && block.activation_bytes == full.activation_bytes,
           "full recompute: uniform %zu, block %zu, selective %zu", full.activation_bytes, block.activation_bytes,
           selective.activation_bytes);
    /* offload: the last fraction of the shard, rounded down to 16 elements */
    mt_config b = test_config(TEST_GPT2, MT_BF16);
    b.optimizer_cpu_offload = 1;
    b.optimizer_offload_fraction = 0.37;
    EXPECT_OK(mt_config_finalize(&b, &err), &err);
    mt_memory_plan p;
    EXPECT_OK(mt_memory_plan_compute(&b, NULL, &p, &err), &err);
    const int64_t off = (int64_t)(0.37 * (double)p.shard_elements) / 16 * 16, gpu = p.shard_elements - off;
    EXPECT(p.offload_elements == off && p.optimizer_bytes == (size_t)gpu * 8 && p.master_bytes == (size_t)gpu * 4 &&
               p.offload_bytes == (size_t)off * 4 &&
               p.host_pinned_bytes == (size_t)off * 12 + (size_t)MT_OFFLOAD_SLOTS * (size_t)off * 4,
           "offload 0.37: %lld of %lld elements, optimizer %zu, master %zu, staging %zu, host %zu bytes",
           (long long)p.offload_elements, (long long)p.shard_elements, p.optimizer_bytes, p.master_bytes,
           p.offload_bytes, p.host_pinned_bytes);
    b.optimizer_offload_fraction = 1.0;
    EXPECT_OK(mt_memory_plan_compute(&b, NULL, &p, &err), &err);
    EXPECT(p.offload_elements == p.shard_elements && p.optimizer_bytes == 0 && p.master_bytes == 0,
           "offload 1.0 leaves %zu optimizer bytes on the GPU", p.optimizer_bytes + p.master_bytes);
    b.optimizer_offload_fraction = 1.5;
    EXPECT(mt_config_finalize(&b, &err) == MT_ERR_CONFIG && strstr(err.message, "offload-fraction"),
           "fraction 1.5: '%s'", err.message);
    /* FP8: the arena of every FP8 layer */
    mt_config f = test_config(TEST_GPT2, MT_BF16);
    f.fp8_format = MT_FP8_HYBRID;
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    EXPECT_OK(mt_memory_plan_compute(&f, NULL, &p, &err), &err);
    mt_fp8_arena_layout fa;
    mt_fp8_arena_layout_compute(&f, f.num_layers, &fa);
    EXPECT(p.fp8_bytes == fa.total && fa.total > (size_t)(f.num_layers * fa.weights_per_layer),
           "FP8: plan %zu bytes, arena %zu", p.fp8_bytes, fa.total);
    return TEST_PASS;
}

/* --plan-layouts: every (TP, PP, VP) of 8 GPUs the model divides into, each world-sized, fastest first. */
static test_result test_plan_layouts(void) {
    mt_config c = test_config_sized(24, 1024, 16, 1024, 50257); /* GPT-2 350M */
    c.precision = MT_BF16;
    test_config_batch(&c, 4, 64);
    test_config_ddp(&c, 1, 1, 0, 0);
    mt_layout_candidate k[256];
    int n = 0;
    mt_error err;
    EXPECT_OK(mt_plan_layouts(&c, NULL, 8, k, 256, &n, &err), &err);
    printf("      %d layouts; fastest TP %d PP %d VP %d DP %d (%.1f ms), slowest TP %d PP %d VP %d DP %d (%.1f ms)\n", n,
           k[0].tp, k[0].pp, k[0].vp, k[0].dp, 1e3 * k[0].step_seconds, k[n - 1].tp, k[n - 1].pp, k[n - 1].vp,
           k[n - 1].dp, 1e3 * k[n - 1].step_seconds);
    EXPECT(n >= 8, "only %d layouts", n);
    for (int i = 0; i < n; i++) {
        EXPECT(k[i].tp * k[i].pp * k[i].dp == 8 && k[i].plan.device_bytes > 0, "layout %d: %d x %d x %d", i, k[i].tp,
               k[i].pp, k[i].dp);
        EXPECT(i == 0 || k[i].tokens_per_second <= k[i - 1].tokens_per_second, "layout %d is out of order", i);
    }
    EXPECT(k[0].tp == 1 && k[0].pp == 1 && k[0].dp == 8, "the fastest is TP %d PP %d DP %d, not pure DP", k[0].tp,
           k[0].pp, k[0].dp);
    return TEST_PASS;
}

/* ---- host: the CPU AdamW ------------------------------------------------------------------------- */

static float memory_uniform(uint64_t* s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (float)((*s >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* mt_adamw_cpu (AVX2 where the CPU has it) and mt_adamw_cpu_parallel (4 threads, segments of both
 * weight-decay classes) equal the scalar loop bit for bit, over 5 steps; and the scalar loop is AdamW:
 * each step's update computed in double from the same inputs is within 2 ulp-scale (1e-6 relative
 * of the weight plus 1e-9) of it. The weights move by ~lr per step, so a missing update fails. */
static test_result test_cpu_adamw(void) {
    const int64_t n = 100003; /* not a multiple of 8 or 16 */
    float* g = (float*)malloc(sizeof(float) * n);
    float* st[3][3]; /* [scalar, simd, threads][p, m, v] */
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) st[a][b] = (float*)malloc(sizeof(float) * n);
    uint64_t seed = 88172645463325252ull;
    for (int64_t i = 0; i < n; i++) st[0][0][i] = memory_uniform(&seed) * 0.1f;
    for (int a = 0; a < 3; a++) {
        memcpy(st[a][0], st[0][0], sizeof(float) * n);
        memset(st[a][1], 0, sizeof(float) * n);
        memset(st[a][2], 0, sizeof(float) * n);
    }
    mt_adamw_segment seg[3] = {{0, 40000, 1}, {40000, 7, 0}, {40007, n - 40007, 1}};
    mt_thread_pool* pool = NULL;
    mt_error err;
    EXPECT_OK(mt_thread_pool_create(&pool, 4, &err), &err);
    double worst = 0.0, moved = 0.0;
    test_result res = TEST_PASS;
    for (int step = 1; step <= 5 && res == TEST_PASS; step++) {
        for (int64_t i = 0; i < n; i++) g[i] = memory_uniform(&seed) * (i % 97 == 0 ? 1e-30f : 1.0f); /* some tiny */
        mt_adamw_step h = {1e-3f, 0.9f, 0.95f, (float)(1 - pow(0.9, step)), (float)(1 - pow(0.95, step)), 1e-8f, 0.1f,
                           0.5f};
        /* the update in double from this step's inputs, for the decayed elements of segment 0 */
        for (int64_t i = 0; i < 40000; i++) {
            double gd = (double)g[i] * h.grad_scale, m = 0.9 * st[0][1][i] + 0.1 * gd;
            double v = 0.95 * st[0][2][i] + 0.05 * gd * gd, p = st[0][0][i];
            double want = p - 1e-3 * ((m / h.bias_correction1) / (sqrt(v / h.bias_correction2) + 1e-8) + 0.1 * p);
            float got_p = p, got_m = st[0][1][i], got_v = st[0][2][i];
            mt_adamw_cpu_scalar(&h, 1, g + i, &got_p, &got_m, &got_v, 1);
            double e = fabs(got_p - want) / (fabs(want) * 1e-6 + 1e-9);
            if (e > worst) worst = e;
            moved += fabs(got_p - p);
        }
        for (int s = 0; s < 3; s++) {
            mt_adamw_cpu_scalar(&h, seg[s].decay, g + seg[s].offset, st[0][0] + seg[s].offset, st[0][1] + seg[s].offset,
                                st[0][2] + seg[s].offset, seg[s].length);
            mt_adamw_cpu(&h, seg[s].decay, g + seg[s].offset, st[1][0] + seg[s].offset, st[1][1] + seg[s].offset,
                         st[1][2] + seg[s].offset, seg[s].length);
        }
        mt_adamw_cpu_parallel(pool, &h, seg, 3, g, st[2][0], st[2][1], st[2][2]);
        for (int a = 1; a < 3 && res == TEST_PASS; a++)
            for (int b = 0; b < 3 && res == TEST_PASS; b++)
                if (memcmp(st[a][b], st[0][b], sizeof(float) * n) != 0) {
                    int64_t i = 0;
                    while (memcmp(&st[a][b][i], &st[0][b][i], sizeof(float)) == 0) i++;
                    printf("    FAIL step %d: %s %s element %lld is %.9g, the scalar loop's %.9g\n", step,
                           a == 1 ? "mt_adamw_cpu" : "mt_adamw_cpu_parallel", b == 0 ? "master" : b == 1 ? "m" : "v",
                           (long long)i, st[a][b][i], st[0][b][i]);
                    res = TEST_FAIL;
                }
    }
    printf("      5 steps: vectorised and threaded bit-equal to scalar; against double: worst %.3f (of 1), mean move "
           "%.2e\n", worst, moved / (5 * 40000.0));
    mt_thread_pool_free(pool);
    free(g);
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) free(st[a][b]);
    EXPECT(res == TEST_PASS, "the CPU AdamW paths differ");
    EXPECT(worst <= 1.0, "the update is %.3f x (1e-6 relative + 1e-9) away from AdamW in double", worst);
    EXPECT(moved / (5 * 40000.0) > 1e-4, "the weights barely moved (%.3g per step)", moved / (5 * 40000.0));
    return TEST_PASS;
}

/* ---- host: train_gpt --plan ------------------------------------------------------------------------ */

static test_result test_train_gpt_plan(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP("./train_gpt is not built (make all)");
    static char out[65536];
    const char* model = "./train_gpt --tokenizer-type NullTokenizer --vocab-size 50257 --mock-data --train-iters 10 "
                        "--lr 1e-4 --bf16 --seq-length 1024 --num-layers 24 --hidden-size 1024 --num-attention-heads 16";
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 4 --plan --world-size 8 --tensor-model-parallel-size 2 "
             "--sequence-parallel --use-distributed-optimizer 2>&1", model);
    int code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0 && strstr(out, "TP 2, PP 1, VP 1, DP 4, SP, distributed optimizer") && strstr(out, "fits in 80.0"),
           "--plan: exit %d\n%s", code, out);
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 64 --plan --gpu-memory-gib 20 2>&1", model);
    code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 1 && strstr(out, "does NOT fit in 20.0 GiB") && strstr(out, "short"), "too big: exit %d\n%s", code, out);
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 4 --global-batch-size 64 --plan-layouts --world-size 8 2>&1", model);
    code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0 && strstr(out, "layouts of 8 GPUs") && strstr(out, "layouts fit"), "--plan-layouts: exit %d\n%s",
           code, out);
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 4 --world-size 8 2>&1", model);
    code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 2 && strstr(out, "--plan"), "--world-size without --plan: exit %d\n%s", code, out);
    return TEST_PASS;
}

static const test_case memory_tests[] = {
    {"plan_counts_follow_the_geometry", test_plan_counts},
    {"plan_pipeline_stages_and_in_flight", test_plan_pipeline},
    {"plan_recompute_offload_fp8", test_plan_recompute_offload_fp8},
    {"plan_layouts_fastest_first", test_plan_layouts},
    {"cpu_adamw_bitwise_vectorised_threaded", test_cpu_adamw},
    {"train_gpt_plan_without_gpu", test_train_gpt_plan},
};

/* ---- GPU: the plan is what is allocated ------------------------------------------------------------ */

/* Every category mt_trainer_create counts as it allocates equals the plan's, to the byte; and the
 * device's free memory falls by the plan's total (less 4 MiB: a small buffer may land in a page already
 * mapped) and by at most 5% (or 96 MiB) more: cudaMalloc's
 * 2 MiB pages, the cuBLAS and cuBLASLt handles. A model of 4 x 512 at 8 x 512 tokens, so the
 * allocations (~1 GiB) dwarf those. */
static test_result test_plan_equals_allocation(void) {
    REQUIRE_GPU();
    struct { const char* name; int llama; mt_precision prec; int fp8; double offload; } cases[] = {
        {"gpt2 fp32", 0, MT_FP32, 0, 0}, {"gpt2 bf16", 0, MT_BF16, 0, 0}, {"llama bf16", 1, MT_BF16, 0, 0},
        {"llama fp32", 1, MT_FP32, 0, 0}, {"gpt2 fp16", 0, MT_FP16, 0, 0}, {"gpt2 bf16 FP8", 0, MT_BF16, 1, 0},
        {"llama bf16 FP8 blockwise", 1, MT_BF16, 2, 0}, {"gpt2 bf16 offload 0.5", 0, MT_BF16, 0, 0.5},
        {"llama fp32 offload 1.0", 1, MT_FP32, 0, 1.0},
    };
    int device = 0;
    cudaDeviceProp prop;
    cudaGetDevice(&device);
    cudaGetDeviceProperties(&prop, device);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (cases[i].fp8 && prop.major * 10 + prop.minor < 89) {
            printf("      %s: skipped (FP8 needs compute capability 8.9)\n", cases[i].name);
            continue;
        }
        mt_config c = test_config(cases[i].llama ? TEST_LLAMA : TEST_GPT2, cases[i].prec);
        c.num_layers = 4;
        c.hidden_size = 512;
        c.seq_length = 512;
        test_config_batch(&c, 8, 16);
        test_config_attention(&c, 8, cases[i].llama ? 4 : 8, 64, cases[i].llama ? 1024 : 0);
        if (cases[i].fp8) {
            c.fp8_format = MT_FP8_HYBRID;
            c.fp8_recipe = cases[i].fp8 == 2 ? MT_FP8_BLOCKWISE : MT_FP8_DELAYED;
        }
        c.optimizer_cpu_offload = cases[i].offload > 0;
        c.optimizer_offload_fraction = cases[i].offload > 0 ? cases[i].offload : 1.0;
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        mt_memory_plan plan;
        EXPECT_OK(mt_memory_plan_compute(&c, NULL, &plan, &err), &err);
        cudaDeviceSynchronize();
        size_t free_before = 0, free_after = 0, total = 0;
        cudaMemGetInfo(&free_before, &total);
        mt_trainer* t = NULL;
        EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
        cudaDeviceSynchronize();
        cudaMemGetInfo(&free_after, &total);
        mt_memory_plan a = mt_trainer_memory_allocated(t), q = mt_trainer_memory_plan(t);
        mt_trainer_free(t);
        const double used = (double)(free_before - free_after), want = (double)plan.total_bytes;
        printf("      %-26s planned %.2f MiB, allocated %.2f MiB, the device's free memory fell %.2f MiB (%+.2f MiB)\n",
               cases[i].name, want / 1048576.0, a.total_bytes / 1048576.0, used / 1048576.0, (used - want) / 1048576.0);
        const size_t pp[9] = {plan.parameter_bytes, plan.master_bytes, plan.gradient_bytes, plan.optimizer_bytes,
                              plan.activation_bytes, plan.workspace_bytes, plan.fp8_bytes, plan.offload_bytes,
                              plan.total_bytes};
        const size_t aa[9] = {a.parameter_bytes, a.master_bytes, a.gradient_bytes, a.optimizer_bytes,
                              a.activation_bytes, a.workspace_bytes, a.fp8_bytes, a.offload_bytes, a.total_bytes};
        const char* names[9] = {"parameters", "master", "gradients", "optimizer", "activations", "workspace", "fp8",
                                "offload", "total"};
        for (int k = 0; k < 9; k++)
            EXPECT(pp[k] == aa[k], "%s: %s planned %zu bytes, allocated %zu", cases[i].name, names[k], pp[k], aa[k]);
        EXPECT(q.total_bytes == plan.total_bytes && q.device_bytes == plan.device_bytes,
               "%s: the trainer's plan is not mt_memory_plan_compute's", cases[i].name);
        EXPECT(used >= want - 4.0 * 1048576.0 && used - want <= fmax(0.05 * want, 96.0 * 1048576.0),
               "%s: the device's count %.1f MiB, planned %.1f MiB", cases[i].name, used / 1048576.0, want / 1048576.0);
    }
    return TEST_PASS;
}

/* A plan that cannot fit is refused with its shortfall before anything is allocated. */
static test_result test_plan_refused_before_allocation(void) {
    REQUIRE_GPU();
    mt_config c = test_config_sized(96, 8192, 64, 4096, 128256); /* ~78B parameters: 1.4 TB of model state */
    c.precision = MT_BF16;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    cudaDeviceSynchronize();
    size_t free_before = 0, free_after = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    mt_trainer* t = NULL;
    err.message[0] = 0;
    mt_status st = mt_trainer_create(&t, &c, &err);
    cudaMemGetInfo(&free_after, &total);
    if (t) mt_trainer_free(t);
    printf("      %s\n", err.message);
    EXPECT(st == MT_ERR_OOM && !t && strstr(err.message, "memory plan needs") && strstr(err.message, "short"),
           "status %s, '%s'", mt_status_name(st), err.message);
    EXPECT(free_after + ((size_t)4 << 20) >= free_before, "%.1f MiB were taken before the refusal",
           ((double)free_before - (double)free_after) / 1048576.0);
    return TEST_PASS;
}

/* ---- GPU: optimizer offload -------------------------------------------------------------------- */

/* Trains `steps` steps from the config's initial weights on fixed random batches; fills losses and
 * (if not NULL) the final weights. With resume_at > 0, saves there, frees, and resumes in a new trainer. */
static test_result offload_train(mt_config c, int steps, int resume_at, double* losses, float* weights) {
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    const int64_t per_step = (int64_t)mt_num_micro_batches(&c) * c.micro_batch_size * (c.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
    char dir[] = "/tmp/mt_offload_XXXXXX";
    test_result res = TEST_PASS;
    for (int k = 0; k < steps && res == TEST_PASS; k++) {
        if (resume_at > 0 && k == resume_at) {
            if (!mkdtemp(dir)) { printf("    FAIL mkdtemp\n"); res = TEST_FAIL; break; }
            mt_status st = mt_trainer_save(t, dir, k, 0, &err);
            mt_trainer_free(t);
            t = NULL;
            if (st == MT_OK) st = mt_trainer_create(&t, &c, &err);
            if (st == MT_OK) st = mt_trainer_load(t, dir, -1, NULL, NULL, &err);
            char cmd[256];
            snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
            if (system(cmd) != 0) printf("      note: could not remove %s\n", dir);
            if (st != MT_OK) { printf("    FAIL resume: %s\n", err.message); res = TEST_FAIL; break; }
        }
        /* each rank's part of one global batch (the DP ranks' parts differ) */
        fill_tokens(tokens, per_step, (int)c.vocab_size, 7000 + 97 * k + 13 * (uint64_t)c.rank);
        mt_step_result r;
        mt_status st = mt_trainer_train_step(t, tokens, &r, &err);
        if (st != MT_OK) { printf("    FAIL step %d: %s\n", k, err.message); res = TEST_FAIL; }
        losses[k] = r.lm_loss;
    }
    if (res == TEST_PASS && weights && mt_trainer_get_parameters(t, weights, &err) != MT_OK) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    free(tokens);
    if (t) mt_trainer_free(t);
    return res;
}

/* The losses and final weights of the GPU optimizer, with the optimizer offloaded (all of it, or a
 * fraction that cuts tensors), and offloaded across a save and resume: equal bit for bit. lr 1e-2 for
 * 8 steps moves every weight (a missing or partial CPU update changes the losses from step 2 on);
 * the offloaded end of the buffer holds the embeddings, which the check also sees move. */
static test_result offload_matches(mt_precision prec, int llama) {
    REQUIRE_GPU();
    const int steps = 8;
    mt_config base = test_config(llama ? TEST_LLAMA : TEST_GPT2, prec);
    base.lr = 1e-2;
    base.min_lr = 1e-3;
    base.lr_warmup_iters = 1;
    base.weight_decay = 0.1;
    mt_config probe = base;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&probe, &err), &err);
    const int64_t n = mt_num_parameters(&probe);
    float* w0 = (float*)malloc(sizeof(float) * n);
    float* w[4];
    for (int i = 0; i < 4; i++) w[i] = (float*)malloc(sizeof(float) * n);
    double losses[4][8];
    const char* names[4] = {"GPU optimizer", "offload 1.0", "offload 0.37", "offload 0.37, resumed at 3"};
    test_result res = offload_train(base, 0, 0, losses[0], w0); /* the initial weights */
    for (int v = 0; v < 4 && res == TEST_PASS; v++) {
        mt_config c = base;
        c.optimizer_cpu_offload = v > 0;
        c.optimizer_offload_fraction = v == 1 ? 1.0 : 0.37;
        res = offload_train(c, steps, v == 3 ? 3 : 0, losses[v], w[v]);
    }
    if (res == TEST_PASS) {
        double moved = 0.0;
        const int64_t word = probe.padded_vocab_size * probe.hidden_size; /* canonical order starts with them */
        for (int64_t i = 0; i < word; i++) moved += fabs((double)w[1][i] - w0[i]);
        printf("      %s: loss %.6f -> %.6f; word embeddings moved %.3e on average\n", prec == MT_FP32 ? "fp32" : "bf16",
               losses[0][0], losses[0][steps - 1], moved / (double)word);
        if (!(moved / (double)word > 1e-4)) { printf("    FAIL the offloaded weights did not move\n"); res = TEST_FAIL; }
        for (int v = 1; v < 4 && res == TEST_PASS; v++) {
            for (int k = 0; k < steps; k++)
                if (losses[v][k] != losses[0][k]) {
                    printf("    FAIL %s: step %d loss %.9f, the GPU optimizer's %.9f\n", names[v], k, losses[v][k],
                           losses[0][k]);
                    res = TEST_FAIL;
                    break;
                }
            if (res == TEST_PASS && memcmp(w[v], w[0], sizeof(float) * n) != 0) {
                int64_t i = 0;
                while (w[v][i] == w[0][i]) i++;
                printf("    FAIL %s: weight %lld is %.9g, the GPU optimizer's %.9g\n", names[v], (long long)i, w[v][i],
                       w[0][i]);
                res = TEST_FAIL;
            }
        }
    }
    free(w0);
    for (int i = 0; i < 4; i++) free(w[i]);
    return res;
}
static test_result test_offload_fp32(void) { return offload_matches(MT_FP32, 0); }
static test_result test_offload_bf16(void) { return offload_matches(MT_BF16, 0); }
static test_result test_offload_llama_bf16(void) { return offload_matches(MT_BF16, 1); }

static const test_case memory_gpu_tests[] = {
    {"plan_equals_allocation", test_plan_equals_allocation},
    {"plan_refused_before_allocation", test_plan_refused_before_allocation},
    {"offload_matches_gpu_optimizer_fp32", test_offload_fp32},
    {"offload_matches_gpu_optimizer_bf16", test_offload_bf16},
    {"offload_matches_gpu_optimizer_llama_bf16", test_offload_llama_bf16},
};

/* ---- several GPUs: offload with the distributed optimizer ------------------------------------------ */

/* DP = the process count, distributed optimizer: each rank offloads the end of its own shard; losses
 * and weights equal the GPU optimizer's bit for bit, fp32 and bf16. */
static test_result offload_distributed(mt_precision prec) {
    REQUIRE_MPI_GPUS();
    int world = mpi_world();
    mt_config base = test_config(TEST_GPT2, prec);
    base.lr = 1e-2;
    test_config_parallel(&base, 1, world, 0);
    test_config_ddp(&base, 1, 1, 1, 0);
    test_config_batch(&base, 4, 4 * world);
    test_config_this_rank(&base);
    mt_error err;
    mt_config probe = base;
    EXPECT_OK(mt_config_finalize(&probe, &err), &err);
    const int64_t n = mt_num_parameters(&probe);
    float* w[2] = {(float*)malloc(sizeof(float) * n), (float*)malloc(sizeof(float) * n)};
    double losses[2][6];
    test_result res = TEST_PASS;
    for (int v = 0; v < 2 && res == TEST_PASS; v++) {
        mt_config c = base;
        EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
        c.optimizer_cpu_offload = v;
        c.optimizer_offload_fraction = 0.6;
        res = offload_train(c, 6, 0, losses[v], w[v]);
    }
    if (res == TEST_PASS) {
        printf("      DP=%d %s: loss %.6f -> %.6f\n", world, prec == MT_FP32 ? "fp32" : "bf16", losses[0][0], losses[0][5]);
        for (int k = 0; k < 6; k++)
            if (losses[1][k] != losses[0][k]) {
                printf("    FAIL step %d: offloaded %.9f, GPU %.9f\n", k, losses[1][k], losses[0][k]);
                res = TEST_FAIL;
            }
        if (res == TEST_PASS && memcmp(w[0], w[1], sizeof(float) * n) != 0) {
            printf("    FAIL the final weights differ\n");
            res = TEST_FAIL;
        }
    }
    free(w[0]);
    free(w[1]);
    return res;
}
static test_result test_offload_distributed_fp32(void) { return offload_distributed(MT_FP32); }
static test_result test_offload_distributed_bf16(void) { return offload_distributed(MT_BF16); }

static const test_case memory_multigpu_tests[] = {
    {"offload_distributed_optimizer_fp32", test_offload_distributed_fp32},
    {"offload_distributed_optimizer_bf16", test_offload_distributed_bf16},
};

#endif
