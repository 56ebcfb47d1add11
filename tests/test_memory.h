/* tests/test_memory.h — the memory plan (megatron.h mt_memory_plan_compute) and optimizer offload.
 *
 * Host: the plan's counts agree with the parallel geometry it is built from (buffer layout, TP shard,
 * DP shard, the pipeline's split, stage buffers, activation slots and communicators, recompute,
 * offload, FP8), the activation arena is the engine's (shared scratch, then the slots), the layouts of a
 * world size come sorted by the cost model, the CPU AdamW equals its scalar reference bit for bit
 * (vectorised and threaded) and AdamW computed in double within fp32 rounding, and train_gpt --plan
 * answers with no GPU. GPU: what mt_trainer_create allocates, category by category, is the plan's to
 * the byte (and the device's own count agrees); a plan that cannot fit is refused before anything is
 * allocated; training with the optimizer offloaded gives the GPU optimizer's losses and weights
 * exactly (the bound is 0: the CPU AdamW performs the GPU kernel's IEEE operations, fused
 * multiply-adds included, in its order; sm_90 SASS checked), also across a save and resume, and with
 * the distributed optimizer on several GPUs; after training steps, an evaluation and a save (sync and
 * async) the device still holds no more than the plan allows (one GPU, and each rank under DP with
 * the distributed optimizer, TP and PP). Several GPUs with pipeline parallelism: each stage's
 * allocation is its plan (1F1B, interleaved, offload), and the offloaded optimizer is the GPU's. */
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

/* Megatron's pipeline as main's engine builds it: each rank's stage from mt_pp_stage_of's split (even,
 * --decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split) and its buffer from
 * mt_buffer_layout_build (the embeddings on the first, the head and, tied, a copy of the word
 * embeddings on the last); the activation slots of its training schedule (min(PP - rank, M) for 1F1B;
 * interleaved, Megatron's warm-up forwards + 1); the pipeline's communicators in the overhead. */
static int plan_pp_rank(const mt_config* c, int pp_rank, mt_memory_plan* p, mt_error* err) {
    mt_plan_options o;
    mt_plan_options_defaults(&o);
    o.pp_rank = pp_rank;
    return mt_memory_plan_compute(c, &o, p, err) == MT_OK;
}

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
        for (int k = MT_P_LN1_WEIGHT; k <= MT_P_LAST_LAYER_TENSOR; k++) layers += info[k].numel;
        int64_t sum = 0;
        size_t worst = 0;
        for (int r = 0; r < 4; r++) {
            mt_memory_plan p;
            EXPECT(plan_pp_rank(&c, r, &p, &err), "rank %d: %s", r, err.message);
            sum += p.num_parameters;
            if (p.device_bytes > worst) worst = p.device_bytes;
            EXPECT(p.num_layers == 2 && p.in_flight == 4 - r, "rank %d: %d layers, %d slots (want 2, %d)", r,
                   p.num_layers, p.in_flight, 4 - r);
            if (r == 1 || r == 2) /* a middle stage: two layers, nothing else */
                EXPECT(p.num_parameters == layers / 4, "rank %d holds %lld parameters, 2 layers are %lld", r,
                       (long long)p.num_parameters, (long long)(layers / 4));
            /* the buffer a trainer of this stage builds */
            mt_config at = c;
            mt_rank_coords rc = {0, 0, r};
            at.rank = mt_rank_of(&c, rc);
            mt_buffer_layout B;
            EXPECT_OK(mt_buffer_layout_build(&B, &at, &err), &err);
            const int64_t size = B.size, canonical = B.canonical_size;
            mt_buffer_layout_free(&B);
            EXPECT(p.buffer_elements == size && p.num_parameters == canonical, "rank %d: buffer %lld (layout %lld), "
                   "parameters %lld (%lld)", r, (long long)p.buffer_elements, (long long)size,
                   (long long)p.num_parameters, (long long)canonical);
            /* the head alone keeps the final norm's output and the logits in each slot */
            mt_activation_layout a;
            mt_activation_layout_compute(&c, 2, r == 3, p.in_flight, NULL, &a);
            EXPECT(p.activation_bytes == a.total && (a.bytes[MT_ACT_LOGITS] > 0) == (r == 3) &&
                       (a.bytes[MT_ACT_LNF] > 0) == (r == 3),
                   "rank %d: activations %zu, the layout's %zu (logits %zu bytes a slot)", r, p.activation_bytes,
                   a.total, a.bytes[MT_ACT_LOGITS]);
            /* world, the pipeline's two communicators, and on the ends the embedding group */
            const int comms = 1 + 2 + (r == 0 || r == 3);
            EXPECT(p.overhead_bytes == MT_PLAN_CONTEXT_BYTES + MT_PLAN_CUBLAS_BYTES + comms * MT_PLAN_NCCL_BYTES,
                   "rank %d: overhead %zu bytes, want %d communicators'", r, p.overhead_bytes, comms);
        }
        /* the stages hold the model once, plus the last stage's copy of tied word embeddings */
        EXPECT(sum == full + (untied ? 0 : word), "untied %d: stages hold %lld, the model %lld (word embeddings %lld)",
               untied, (long long)sum, (long long)full, (long long)word);
        mt_memory_plan any;
        EXPECT_OK(mt_memory_plan_compute(&c, NULL, &any, &err), &err);
        EXPECT(any.device_bytes == worst, "the default plan is not the largest stage's");
        /* interleaved: 2 chunks of 1 layer; rank r warms up 2 (PP - r - 1) + (VP - 1) PP forwards */
        mt_config v = c;
        v.virtual_pipeline_size = 2;
        EXPECT_OK(mt_config_finalize(&v, &err), &err);
        for (int r = 0; r < 4; r++) {
            mt_memory_plan p;
            EXPECT(plan_pp_rank(&v, r, &p, &err), "VP 2 rank %d: %s", r, err.message);
            int want = 2 * (4 - r - 1) + 4 + 1;
            EXPECT(p.num_layers == 2 && p.in_flight == want, "VP 2 rank %d: %d layers, %d slots (want 2, %d)", r,
                   p.num_layers, p.in_flight, want);
        }
    }
    /* uneven splits: the first and last stage's own counts; the embedding and loss as a layer each */
    mt_config u = test_config(TEST_GPT2, MT_BF16);
    u.num_layers = 8;
    u.pipeline_model_parallel_size = 4;
    test_config_parallel(&u, 1, 4, 0);
    test_config_batch(&u, 1, 8);
    u.decoder_first_pipeline_num_layers = 1;
    u.decoder_last_pipeline_num_layers = 1;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&u, &err), &err);
    const int uneven[4] = {1, 3, 3, 1};
    for (int r = 0; r < 4; r++) {
        mt_memory_plan p;
        EXPECT(plan_pp_rank(&u, r, &p, &err) && p.num_layers == uneven[r], "first/last 1: rank %d has %d layers, want %d",
               r, p.num_layers, uneven[r]);
    }
    mt_config e = u;
    e.num_layers = 6;
    e.decoder_first_pipeline_num_layers = e.decoder_last_pipeline_num_layers = -1;
    e.account_for_embedding_in_pipeline_split = e.account_for_loss_in_pipeline_split = 1;
    EXPECT_OK(mt_config_finalize(&e, &err), &err);
    const int accounted[4] = {1, 2, 2, 1};
    for (int r = 0; r < 4; r++) {
        mt_memory_plan p;
        EXPECT(plan_pp_rank(&e, r, &p, &err) && p.num_layers == accounted[r], "account-for: rank %d has %d layers, "
               "want %d", r, p.num_layers, accounted[r]);
    }
    mt_memory_plan p;
    EXPECT(!plan_pp_rank(&e, 4, &p, &err) && strstr(err.message, "pipeline rank"), "pipeline rank 4 of 4: '%s'",
           err.message);
    mt_plan_options o;
    mt_plan_options_defaults(&o);
    o.dp_rank = 1;
    EXPECT(mt_memory_plan_compute(&e, &o, &p, &err) == MT_ERR_RANGE, "data-parallel rank 1 of 1 was planned");
    return TEST_PASS;
}

/* The activation arena is the engine's: the shared scratch, then num_slots copies of the saved
 * regions one after another, every region 256-byte aligned and inside its slot. */
static test_result test_plan_activation_slots(void) {
    const mt_precision precisions[2] = {MT_FP32, MT_BF16}; /* the exact and the flash attention path */
    for (int k = 0; k < 2; k++) {
        mt_config c = test_config(TEST_GPT2, precisions[k]);
        test_config_parallel(&c, 2, 2, 1);
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        for (int head = 0; head <= 1; head++) {
            mt_activation_layout one, three;
            mt_activation_layout_compute(&c, 3, head, 1, NULL, &one);
            mt_activation_layout_compute(&c, 3, head, 3, NULL, &three);
            EXPECT(three.total == three.scratch_bytes + 3 * three.saved_bytes && one.saved_bytes == three.saved_bytes &&
                       one.scratch_bytes == three.scratch_bytes && three.total - one.total == 2 * one.saved_bytes,
                   "head %d: %zu bytes in 3 slots (scratch %zu, a slot %zu)", head, three.total, three.scratch_bytes,
                   three.saved_bytes);
            size_t end = 0;
            for (int r = 0; r < MT_ACT_REGIONS; r++) {
                const int saved = r >= MT_ACT_RESIDUAL;
                EXPECT(three.offset[r] % 256 == 0 && three.offset[r] >= end, "region %d at %zu, after %zu", r,
                       three.offset[r], end);
                end = three.offset[r] + three.bytes[r];
                EXPECT(saved ? end <= three.scratch_bytes + three.saved_bytes : end <= three.scratch_bytes,
                       "region %d ends at %zu, outside its part", r, end);
            }
            /* the residual stream keeps each layer's input and the chunk's output; the head's regions */
            EXPECT(three.kept_layers[MT_ACT_RESIDUAL] == 4 && three.kept_layers[MT_ACT_QKV] == 3 &&
                       (three.bytes[MT_ACT_LOGITS] > 0) == head && (three.bytes[MT_ACT_LNF_RSTD] > 0) == head &&
                       (three.bytes[MT_ACT_PROBS] > 0) == (precisions[k] == MT_FP32) &&
                       three.bytes[MT_ACT_GATHERED] > 0 && three.bytes[MT_ACT_CE_STATS] > 0,
                   "precision %d head %d: the regions do not follow the config", (int)precisions[k], head);
        }
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
    c.recompute.granularity = MT_RECOMPUTE_SELECTIVE;
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &selective, &err), &err);
    c.recompute.granularity = MT_RECOMPUTE_FULL;
    c.recompute.method = MT_RECOMPUTE_UNIFORM;
    c.recompute.num_layers = 1;
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &full, &err), &err);
    c.recompute.method = MT_RECOMPUTE_BLOCK;
    c.recompute.num_layers = 0; /* every layer */
    EXPECT_OK(mt_memory_plan_compute(&c, &o, &block, &err), &err);
    c.recompute = mt_recompute();
    mt_activation_layout a;
    mt_activation_layout_compute(&c, 4, 1, 1, NULL, &a);
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
    /* --fp8-param-gather (DP=2, distributed optimizer): the FP8 linears' weights are one byte an
     * element in the parameter storage and have no FP8 W copy in the arena (W^T only); the chunk
     * table of the publish adds 16 bytes a chunk to the workspace */
    f.use_distributed_optimizer = 1;
    test_config_parallel(&f, 1, 2, 0);
    mt_memory_plan without, with;
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    EXPECT_OK(mt_memory_plan_compute(&f, NULL, &without, &err), &err);
    f.fp8_param_gather = 1;
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    EXPECT_OK(mt_memory_plan_compute(&f, NULL, &with, &err), &err);
    mt_fp8_arena_layout fg;
    mt_fp8_arena_layout_compute(&f, f.num_layers, &fg);
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &f, &err), &err);
    int64_t fp8_elements = 0;
    for (int i = 0; i < B.num_params; i++) fp8_elements += B.params[i].fp8 ? B.params[i].numel : 0;
    const size_t storage = (size_t)B.storage_bytes;
    mt_buffer_layout_free(&B);
    printf("      --fp8-param-gather: parameters %zu -> %zu bytes, fp8 arena %zu -> %zu, total %zu -> %zu "
           "(%lld FP8 weight elements: 2 bytes each saved)\n", without.parameter_bytes, with.parameter_bytes,
           without.fp8_bytes, with.fp8_bytes, without.total_bytes, with.total_bytes, (long long)fp8_elements);
    EXPECT(fp8_elements == (int64_t)f.num_layers * fa.weights_per_layer / 2 && fg.weights_per_layer * 2 == fa.weights_per_layer,
           "FP8 weights: %lld elements, arena %lld bytes a layer (without the flag %lld)", (long long)fp8_elements,
           (long long)fg.weights_per_layer, (long long)fa.weights_per_layer);
    EXPECT(with.parameter_bytes == storage && without.parameter_bytes - with.parameter_bytes <= (size_t)fp8_elements &&
               without.parameter_bytes - with.parameter_bytes + 256 * (size_t)f.num_layers * 16 >= (size_t)fp8_elements,
           "parameters: %zu bytes with the flag, %zu without, storage %zu", with.parameter_bytes,
           without.parameter_bytes, storage);
    EXPECT(with.fp8_bytes == fg.total && with.workspace_bytes - without.workspace_bytes ==
               (size_t)with.optimizer_chunks * MT_PUBLISH_CHUNK_BYTES && with.optimizer_chunks == without.optimizer_chunks,
           "fp8 %zu (arena %zu), workspace %zu vs %zu", with.fp8_bytes, fg.total, with.workspace_bytes,
           without.workspace_bytes);
    EXPECT(with.total_bytes == with.parameter_bytes + with.master_bytes + with.gradient_bytes + with.optimizer_bytes +
               with.activation_bytes + with.workspace_bytes + with.fp8_bytes + with.offload_bytes &&
               without.total_bytes - with.total_bytes + (size_t)with.optimizer_chunks * MT_PUBLISH_CHUNK_BYTES + 4096 >=
               2 * (size_t)fp8_elements,
           "total %zu with the flag, %zu without", with.total_bytes, without.total_bytes);
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

/* Megatron's Llama-3-8B FP8 script (dev/data/megatron_scripts/llama3_8b_fp8_mock.txt) as a config:
 * 32 layers of 4096, GQA 32/8 heads of 128, SwiGLU ffn 14336, RMSNorm, RoPE, untied, no biases, seq 8192,
 * vocabulary 128256, bf16 + FP8 hybrid, micro-batch 1 of 128, distributed optimizer, SP, FP8 param gather. */
static mt_config memory_llama3_8b_fp8(void) {
    mt_config c = test_config_sized(32, 4096, 32, 8192, 128256);
    test_config_attention(&c, 32, 8, 128, 14336);
    test_config_llama(&c);
    c.precision = MT_BF16;
    c.fp8_format = MT_FP8_HYBRID;
    c.fp8_amax_history_len = 1024;
    c.fp8_amax_compute_algo = MT_FP8_AMAX_MAX;
    c.fp8_param_gather = 1;
    c.sequence_parallel = 1;
    test_config_batch(&c, 1, 128);
    test_config_ddp(&c, 1, 1, 1, 0);
    return c;
}

/* --plan-layouts asks mt_config_check_supported of every layout, as mt_trainer_create does: the
 * Llama-3-8B FP8 script on 8 GPUs with --ffn-hidden-size 14400 (64 x 225: a multiple of 16 per rank
 * at TP 1, 2, 4, not at TP 8, where it is 1800): every TP 8 layout comes back refused with the
 * trainer's own line (mt_trainer_create on that layout, which refuses before touching a GPU), every
 * other layout (PP > 1 ones included: FP8 with pipeline parallelism is built) is not refused. */
static test_result test_plan_layouts_refuse_what_the_trainer_refuses(void) {
    mt_config c = memory_llama3_8b_fp8();
    c.ffn_hidden_size = 14400;
    static mt_layout_candidate k[256];
    int n = 0, refused = 0, checked = 0, pp_planned = 0;
    mt_error err;
    EXPECT_OK(mt_plan_layouts(&c, NULL, 8, k, 256, &n, &err), &err);
    for (int i = 0; i < n; i++) {
        EXPECT(k[i].refused == (k[i].tp == 8), "TP %d PP %d VP %d: refused %d", k[i].tp, k[i].pp, k[i].vp, k[i].refused);
        pp_planned += k[i].pp > 1 && !k[i].refused;
        if (!k[i].refused) continue;
        refused++;
        EXPECT(strstr(k[i].reason, "--ffn-hidden-size per tensor-parallel rank (1800) to be a multiple of 16"),
               "reason '%s'", k[i].reason);
        /* the same layout handed to the trainer: the same line */
        mt_config x = c;
        x.tensor_model_parallel_size = k[i].tp;
        x.pipeline_model_parallel_size = k[i].pp;
        x.virtual_pipeline_size = k[i].vp;
        x.world_size = 8;
        x.local_rank = -1;
        mt_error derive_err, create_err;
        EXPECT(mt__config_finalize(&x, 0, &derive_err) == MT_OK, "TP %d PP %d VP %d: %s", k[i].tp, k[i].pp, k[i].vp,
               derive_err.message);
        mt_trainer* t = NULL;
        EXPECT(mt_trainer_create(&t, &x, &create_err) == MT_ERR_CONFIG && !t && !strcmp(create_err.message, k[i].reason),
               "TP %d PP %d: the trainer says '%s', the planner '%s'", k[i].tp, k[i].pp, create_err.message, k[i].reason);
        checked++;
    }
    printf("      %d layouts of 8 GPUs, %d refused (TP 8), each with the trainer's line; %d with PP > 1 planned\n", n,
           refused, pp_planned);
    EXPECT(n >= 18 && refused >= 1 && checked == refused && pp_planned >= 10, "%d layouts, %d refused, %d PP > 1",
           n, refused, pp_planned);
    return TEST_PASS;
}

/* --grad-reduce-in-bf16's worth: the fp32 gradient buffer's bytes less a bf16 one's, from the plan's
 * buffer (4 and 2 bytes per buffer element); for the Llama-3-8B FP8 script at TP 1 x DP 8 about 15 GiB
 * (8.03e9 parameters, their buffer padded), less at TP 2 (half the buffer). */
static test_result test_plan_bf16_gradient_savings(void) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    for (int tp = 1; tp <= 2; tp++) {
        mt_config c = memory_llama3_8b_fp8();
        c.fp8_format = MT_FP8_NONE; /* the buffer is the same with or without FP8 */
        c.fp8_param_gather = 0;
        c.world_size = 8;
        c.tensor_model_parallel_size = tp;
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        mt_memory_plan p;
        EXPECT_OK(mt_memory_plan_compute(&c, NULL, &p, &err), &err);
        const size_t saved = mt_memory_plan_bf16_grad_savings(&p);
        EXPECT(p.gradient_bytes == (size_t)p.buffer_elements * 4, "the plan's gradients %zu bytes for %lld elements",
               p.gradient_bytes, (long long)p.buffer_elements);
        EXPECT(saved == p.gradient_bytes - (size_t)p.buffer_elements * 2 && saved == (size_t)p.buffer_elements * 2,
               "TP %d: %zu bytes saved", tp, saved);
        EXPECT(p.buffer_elements >= mt_num_parameters(&c) / tp, "the buffer holds this GPU's parameters");
        printf("      TP %d x DP %d: %.2f GiB of fp32 gradients, bf16 would save %.2f GiB\n", tp, 8 / tp,
               p.gradient_bytes / gib, saved / gib);
        if (tp == 1) EXPECT(saved / gib > 14.5 && saved / gib < 15.5, "TP 1: %.2f GiB, not about 15", saved / gib);
    }
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
    mt_adamw_segment seg[3] = {{0, 40000, 1, 0}, {40000, 7, 0, 0}, {40007, n - 40007, 1, 0}};
    mt_thread_pool* pool = NULL;
    mt_error err;
    EXPECT_OK(mt_thread_pool_create(&pool, 4, &err), &err);
    double worst = 0.0, moved = 0.0;
    test_result res = TEST_PASS;
    for (int step = 1; step <= 5 && res == TEST_PASS; step++) {
        for (int64_t i = 0; i < n; i++) g[i] = memory_uniform(&seed) * (i % 97 == 0 ? 1e-30f : 1.0f); /* some tiny */
        mt_adamw_step h = {1e-3f, 0.9f, 0.95f, (float)(1 - pow(0.9, step)), (float)(1 - pow(0.95, step)), 1e-8f, 0.1f,
                           0.5f, 1e-3f};
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
    if (access("./train_gpt", X_OK) != 0) SKIP_OR_FAIL_STRICT("./train_gpt is not built (make all)");
    static char out[65536];
    const char* model = "./train_gpt --tokenizer-type NullTokenizer --vocab-size 50257 --mock-data --train-iters 10 "
                        "--lr 1e-4 --bf16 --seq-length 1024 --num-layers 24 --hidden-size 1024 --num-attention-heads 16";
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 4 --plan --world-size 8 --tensor-model-parallel-size 2 "
             "--sequence-parallel --use-distributed-optimizer 2>&1", model);
    int code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0 && strstr(out, "TP 2, PP 1, VP 1, DP 4, SP, distributed optimizer") && strstr(out, "fits in 80.0"),
           "--plan: exit %d\n%s", code, out);
    /* the pipeline's flags: the rank that needs the most is the last (its slots hold the logits, 5 of them:
     * Megatron's 4 warm-up forwards + 1; the first rank has 8 slots without logits) */
    snprintf(cmd, sizeof(cmd), "%s --micro-batch-size 4 --global-batch-size 32 --plan --world-size 8 "
             "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 2>&1", model);
    code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0 && strstr(out, "pipeline rank 3 of 4") && strstr(out, "TP 1, PP 4, VP 2, DP 2") &&
               strstr(out, "5 activation slots for 4 micro-batches"),
           "--plan with PP 4 x VP 2: exit %d\n%s", code, out);
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

/* The command line of a dev/data/megatron_scripts/ list, each word quoted for the shell. */
static void memory_script_command(const flags_script* s, char* cmd, size_t cap) {
    size_t used = (size_t)snprintf(cmd, cap, "./train_gpt");
    for (int i = 1; i < s->argc && used < cap; i++) {
        used += (size_t)snprintf(cmd + used, cap - used, " '");
        for (const char* p = s->argv[i]; *p && used < cap; p++)
            used += (size_t)snprintf(cmd + used, cap - used, *p == '\'' ? "'\\''" : "%c", *p);
        if (used < cap) used += (size_t)snprintf(cmd + used, cap - used, "'");
    }
}

/* ./train_gpt --plan-layouts --world-size 8 with Megatron's Llama-3-8B FP8 script: FP8 with pipeline
 * parallelism is built, so no layout is refused and layouts with PP > 1 are among those that fit (at
 * 80 GiB the script's own TP 1 x DP 8 does not: 8.03e9 parameters' state on each GPU's DP shard).
 * --plan of the script's own layout names what Megatron's bf16 gradient buffer (--grad-reduce-in-bf16, whose
 * reduction in bf16 is built, not its buffer) would save there. */
static test_result test_train_gpt_plan_layouts_llama_fp8(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP("./train_gpt is not built (make all)");
    static flags_script s;
    if (!flags_script_read("llama3_8b_fp8_mock.txt", &s)) SKIP("dev/data/megatron_scripts/ not found");
    static char cmd[16384], line_cmd[17000], out[1 << 16];
    memory_script_command(&s, cmd, sizeof(cmd));
    snprintf(line_cmd, sizeof(line_cmd), "%s --plan-layouts --world-size 8 2>&1", cmd);
    int code = test_command_output(line_cmd, out, sizeof(out));
    EXPECT(code == 0, "exit %d\n%s", code, out);
    EXPECT(!strstr(out, "layouts this build refuses") && !strstr(out, "refused: "), "a layout is refused:\n%s", out);
    int fit_rows = 0, pp_rows = 0;
    for (const char* line = strstr(out, "activation slots\n"); line; line = strchr(line, '\n')) {
        line++;
        int tp, pp, vp, dp, gbs;
        if (sscanf(line, "%d %d %d %d %d", &tp, &pp, &vp, &dp, &gbs) != 5) continue;
        fit_rows++;
        pp_rows += pp > 1;
    }
    printf("      %d layouts fit, %d of them with PP > 1\n", fit_rows, pp_rows);
    EXPECT(fit_rows >= 10 && pp_rows >= 5, "%d fit, %d with PP > 1:\n%s", fit_rows, pp_rows, out);
    /* --plan of the script's layout (TP 1, DP 8): the bf16 gradient buffer's saving, the plan's figure */
    snprintf(line_cmd, sizeof(line_cmd), "%s --plan --world-size 8 2>&1", cmd); /* exit 1: it does not fit 80 GiB */
    code = test_command_output(line_cmd, out, sizeof(out));
    mt_config c = memory_llama3_8b_fp8();
    c.world_size = 8;
    c.lr_warmup_iters = 0;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_memory_plan p;
    EXPECT_OK(mt_memory_plan_compute(&c, NULL, &p, &err), &err);
    char want[160];
    snprintf(want, sizeof(want), "bf16 gradient buffer would save %.2f GiB more per GPU",
             mt_memory_plan_bf16_grad_savings(&p) / (1024.0 * 1024.0 * 1024.0));
    EXPECT((code == 0 || code == 1) && strstr(out, "--grad-reduce-in-bf16: gradients are reduced in bf16") && strstr(out, want),
           "--plan: exit %d, want '%s':\n%s", code, want, out);
    return TEST_PASS;
}

/* A config whose activations do not fit 64 bits (found by dev/fuzz/fuzz_flags: 4 x 10241024 tokens, 752
 * layers, whose attention scores times layers wrapped int64) is refused by the plan in one line, never
 * planned with a wrapped size; the layouts themselves saturate instead of wrapping. */
static test_result test_plan_refuses_sizes_beyond_64_bits(void) {
    mt_config c = test_config(TEST_GPT2, MT_FP32); /* fp32: no flash attention, the scores are S^2 per layer */
    c.num_layers = 10000;
    c.seq_length = 10241024;
    c.max_position_embeddings = 10241024;
    c.micro_batch_size = 4;
    mt_error err;
    EXPECT_OK(memory_finalized(&c, 1, 1, 0, 0, &err), &err);
    mt_memory_plan p;
    EXPECT(mt_memory_plan_compute(&c, NULL, &p, &err) == MT_ERR_CONFIG && strstr(err.message, "2^62 bytes"),
           "plan: %s", err.message);
    mt_activation_layout a;
    mt_activation_layout_compute(&c, c.num_layers, 1, 4, NULL, &a);
    EXPECT(a.total == (size_t)INT64_MAX, "the arena saturates: %zu bytes", a.total);
    return TEST_PASS;
}

/* mt_optimizer_pieces counts without a table (arithmetic: a model of 10^14 parameters took minutes to
 * walk, found by dev/fuzz/fuzz_flags with --hidden-size 3888648 --plan) exactly as many pieces as it
 * writes with one, wherever the GPU's part of the shard ends. */
static test_result test_optimizer_pieces_counted(void) {
    for (int llama = 0; llama < 2; llama++)
        for (int dist = 0; dist < 2; dist++) {
            mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
            c.hidden_size = 512; /* tensors of several 32768-element pieces */
            c.ffn_hidden_size = 0;
            c.kv_channels = 0;
            mt_error err;
            EXPECT_OK(memory_finalized(&c, dist ? 2 : 1, 1, 0, dist, &err), &err);
            mt_buffer_layout B;
            EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
            const int dp = dist ? 2 : 1;
            for (int r = 0; r < dp; r++) {
                int64_t begin, end, shard = 0;
                for (int b = 0; b < B.num_buckets; b++) {
                    mt_bucket_shard(&B.buckets[b], dp, r, &begin, &end);
                    shard += end - begin;
                }
                const int64_t gpu[] = {shard, 0, shard / 3, 32768 * 5 + 17, shard - 1};
                for (size_t g = 0; g < sizeof(gpu) / sizeof(gpu[0]); g++) {
                    const int64_t n = mt_optimizer_pieces(&B, dp, r, gpu[g], NULL);
                    mt_optimizer_piece* pieces = (mt_optimizer_piece*)malloc(sizeof(mt_optimizer_piece) * (size_t)(n + 1));
                    const int64_t written = mt_optimizer_pieces(&B, dp, r, gpu[g], pieces);
                    int64_t covered = 0, straddles = 0;
                    for (int64_t k = 0; k < written; k++) {
                        covered += pieces[k].length;
                        straddles += pieces[k].master < gpu[g] && pieces[k].master + pieces[k].length > gpu[g];
                    }
                    free(pieces);
                    EXPECT(written == n && covered == shard && straddles == 0,
                           "llama %d dist %d rank %d GPU part %lld: counted %lld, wrote %lld covering %lld of %lld", llama,
                           dist, r, (long long)gpu[g], (long long)n, (long long)written, (long long)covered, (long long)shard);
                }
            }
            mt_buffer_layout_free(&B);
        }
    return TEST_PASS;
}

static const test_case memory_tests[] = {
    {"optimizer_pieces_counted_as_written", test_optimizer_pieces_counted},
    {"plan_refuses_sizes_beyond_64_bits", test_plan_refuses_sizes_beyond_64_bits},
    {"plan_counts_follow_the_geometry", test_plan_counts},
    {"plan_pipeline_stages_and_slots", test_plan_pipeline},
    {"plan_activation_slots_are_the_engines", test_plan_activation_slots},
    {"plan_recompute_offload_fp8", test_plan_recompute_offload_fp8},
    {"plan_layouts_fastest_first", test_plan_layouts},
    {"plan_layouts_refuse_what_the_trainer_refuses", test_plan_layouts_refuse_what_the_trainer_refuses},
    {"plan_bf16_gradient_savings", test_plan_bf16_gradient_savings},
    {"train_gpt_plan_layouts_llama_fp8", test_train_gpt_plan_layouts_llama_fp8},
    {"cpu_adamw_bitwise_vectorised_threaded", test_cpu_adamw},
    {"train_gpt_plan_without_gpu", test_train_gpt_plan},
};

/* ---- GPU: the plan is what is allocated ------------------------------------------------------------ */

/* The plan of this process's pipeline and data-parallel rank (what its trainer allocates). */
static mt_status plan_of_this_rank(const mt_config* c, mt_memory_plan* plan, mt_error* err) {
    mt_plan_options o;
    mt_plan_options_defaults(&o);
    o.pp_rank = mt_rank_coordinates(c, c->rank).pp;
    o.dp_rank = mt_rank_coordinates(c, c->rank).dp;
    return mt_memory_plan_compute(c, &o, plan, err);
}

/* The plan's categories against what a trainer allocated (a) and the plan it keeps (q), to the byte. */
static test_result plan_matches_allocation(const char* name, const mt_memory_plan* plan, const mt_memory_plan* a,
                                           const mt_memory_plan* q) {
    const size_t pp[9] = {plan->parameter_bytes, plan->master_bytes, plan->gradient_bytes, plan->optimizer_bytes,
                          plan->activation_bytes, plan->workspace_bytes, plan->fp8_bytes, plan->offload_bytes,
                          plan->total_bytes};
    const size_t aa[9] = {a->parameter_bytes, a->master_bytes, a->gradient_bytes, a->optimizer_bytes,
                          a->activation_bytes, a->workspace_bytes, a->fp8_bytes, a->offload_bytes, a->total_bytes};
    const char* names[9] = {"parameters", "master", "gradients", "optimizer", "activations", "workspace", "fp8",
                            "offload", "total"};
    for (int k = 0; k < 9; k++) EXPECT(pp[k] == aa[k], "%s: %s planned %zu bytes, allocated %zu", name, names[k], pp[k], aa[k]);
    EXPECT(q->total_bytes == plan->total_bytes && q->device_bytes == plan->device_bytes,
           "%s: the trainer's plan is not mt_memory_plan_compute's", name);
    return TEST_PASS;
}

/* Finalizes c and creates its trainer (left in *t, NULL if creation failed); passes when the trainer
 * allocated this rank's plan to the byte. */
static test_result create_as_planned(mt_config* c, const char* name, mt_trainer** t) {
    mt_error err;
    *t = NULL;
    EXPECT_OK(mt_config_finalize(c, &err), &err);
    mt_memory_plan plan;
    EXPECT_OK(plan_of_this_rank(c, &plan, &err), &err);
    EXPECT_OK(mt_trainer_create(t, c, &err), &err);
    mt_memory_plan a = mt_trainer_memory_allocated(*t), q = mt_trainer_memory_plan(*t);
    return plan_matches_allocation(name, &plan, &a, &q);
}

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
        {"llama fp32 offload 1.0", 1, MT_FP32, 0, 1.0}, {"gpt2 bf16 FP8 param gather", 0, MT_BF16, 3, 0},
        {"llama bf16 FP8 tensorwise param gather", 1, MT_BF16, 4, 0},
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
            c.fp8_recipe = cases[i].fp8 == 2 ? MT_FP8_BLOCKWISE : cases[i].fp8 == 4 ? MT_FP8_TENSORWISE : MT_FP8_DELAYED;
            c.fp8_param_gather = c.use_distributed_optimizer = cases[i].fp8 >= 3; /* DP = 1: no gather, the storage */
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
        if (plan_matches_allocation(cases[i].name, &plan, &a, &q) != TEST_PASS) return TEST_FAIL;
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

/* ---- GPU: the plan still holds after training, evaluation and saves ------------------------------ */

/* mt_trainer_create checks the device against the plan as it allocates. These tests measure the
 * device again once the trainer has trained, evaluated and saved (sync and async): a buffer allocated
 * on first use and kept, which the plan does not count, would break --plan's "fits" unseen.
 *
 * The shape: a small model (4 layers of 256, 11.6M parameters) with wide activations, micro-batch 16 x
 * 1024 tokens and a vocabulary of 32000, 2 micro-batches per data-parallel rank, so that a buffer the
 * size of one micro-batch's logits (16384 x 32000 fp32 per TP rank: 2000 MiB, 1000 MiB at TP 2) is
 * well beyond every allowance below. */
static mt_config memory_steady_config(int tp, int pp, int distributed) {
    const int world = mpi_world(), dp = world / (tp * pp);
    mt_config c = test_config(TEST_GPT2, MT_BF16);
    c.num_layers = 4;
    c.hidden_size = 256;
    c.seq_length = 1024;
    c.vocab_size = 32000;
    test_config_attention(&c, 4, 4, 64, 0);
    c.pipeline_model_parallel_size = pp;
    test_config_parallel(&c, tp, world, tp > 1);
    test_config_ddp(&c, distributed, 0, 0, 0);
    test_config_batch(&c, 16, 32 * dp);
    test_config_this_rank(&c);
    return c;
}

/* The points of a trainer's life at which the device is measured (memory_lifecycle). */
enum { MEM_CREATED, MEM_TRAINED, MEM_EVALUATED, MEM_SAVED, MEM_SAVED_ASYNC, MEM_TRAINED_AGAIN, MEM_POINTS };
static const char* const memory_point_names[MEM_POINTS] = {"created", "3 steps", "an evaluation", "a save",
                                                           "an async save", "a step after it"};

static size_t memory_device_free(void) {
    size_t free_bytes = 0, total = 0;
    cudaDeviceSynchronize();
    cudaMemGetInfo(&free_bytes, &total);
    return free_bytes;
}

/* A directory every rank names alike: rank 0 makes it (mkdtemp of /tmp/mt_<tag>_XXXXXX) and sends
 * its name to the others. Collective. Returns 0 when rank 0 could not make it (on every rank). */
static int memory_shared_dir(char* dir, size_t cap, const char* tag) {
    char name[128] = {0};
    if (mpi_rank() == 0) {
        snprintf(name, sizeof(name), "/tmp/mt_%s_XXXXXX", tag);
        if (!mkdtemp(name)) name[0] = 0;
    }
#ifdef MT_USE_MPI
    if (mpi_world() > 1) MPI_Bcast(name, (int)sizeof(name), MPI_CHAR, 0, MPI_COMM_WORLD);
#endif
    snprintf(dir, cap, "%s", name);
    return name[0] != 0;
}
/* Every rank is done with dir; rank 0 removes it. Collective. */
static void memory_shared_dir_remove(const char* dir) {
#ifdef MT_USE_MPI
    if (mpi_world() > 1) MPI_Barrier(MPI_COMM_WORLD);
#endif
    if (mpi_rank() == 0 && dir[0]) mt_remove_tree(dir);
}

/* One trainer's life: created, 3 training steps, an evaluation of a step's micro-batches, a save, an
 * async save (committed), one more step. The device's free bytes before creation (*before) and at each
 * point (at[MEM_*]); the trainer's plan into *plan. The trainer is freed; its checkpoints go to dir. */
static mt_status memory_lifecycle(const mt_config* base, const char* dir, size_t* before, size_t* at,
                                  mt_memory_plan* plan, mt_error* err) {
    mt_config c = *base;
    if (c.local_rank >= 0) cudaSetDevice(c.local_rank); /* measure this rank's GPU, before the trainer sets it */
    mt_status st = fresh_comm_id(&c.comm_id, err);
    if (st != MT_OK) return st;
    const int M = mt_num_micro_batches(&c), dp_rank = mt_rank_coordinates(&c, c.rank).dp;
    const int64_t per_step = (int64_t)M * c.micro_batch_size * (c.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)per_step);
    if (!tokens) return mt_fail(err, MT_ERR_OOM, "cannot allocate the tokens");
    *before = memory_device_free();
    mt_trainer* t = NULL;
    st = mt_trainer_create(&t, &c, err);
    if (st != MT_OK) {
        free(tokens);
        return st;
    }
    *plan = mt_trainer_memory_plan(t);
    at[MEM_CREATED] = memory_device_free();
    mt_step_result r;
    for (int k = 0; k < 4 && st == MT_OK; k++) {
        fill_tokens(tokens, per_step, (int)c.vocab_size, 4100 + 97 * k + 13 * (uint64_t)dp_rank);
        if (k == 3) { /* after the evaluation and the saves */
            double loss = 0.0;
            int64_t committed = -1;
            st = mt_trainer_evaluate(t, tokens, M, &loss, err);
            if (st == MT_OK) at[MEM_EVALUATED] = memory_device_free();
            if (st == MT_OK) st = mt_trainer_save(t, dir, 3, 3 * c.global_batch_size, err);
            if (st == MT_OK) at[MEM_SAVED] = memory_device_free();
            if (st == MT_OK) st = mt_trainer_save_async(t, dir, 4, 3 * c.global_batch_size, err);
            if (st == MT_OK) st = mt_trainer_save_wait(t, 1, &committed, err);
            if (st == MT_OK && committed != 4) st = mt_fail(err, MT_ERR_IO, "the async save committed %lld", (long long)committed);
            if (st == MT_OK) at[MEM_SAVED_ASYNC] = memory_device_free();
        }
        if (st == MT_OK) st = mt_trainer_train_step(t, tokens, &r, err);
        if (st == MT_OK && k == 2) at[MEM_TRAINED] = memory_device_free();
    }
    if (st == MT_OK) at[MEM_TRAINED_AGAIN] = memory_device_free();
    mt_trainer_free(t);
    free(tokens);
    return st;
}

/* The device against the plan at every point of memory_lifecycle. The measured life comes after a
 * first one of the same config (not measured), so the CUDA context's lazy parts (kernels loaded on
 * first launch, the local-memory reserve, cuBLAS's kernels), which MT_PLAN_CONTEXT_BYTES counts, are in
 * the baseline already. Against that baseline a trainer holds its allocations (plan.total_bytes, equal
 * to the byte: plan_equals_allocation), its cuBLAS handles and NCCL communicators (with NCCL's
 * buffers, connected at the first collective of each kind), for which the plan allows
 * overhead_bytes - MT_PLAN_CONTEXT_BYTES (64 MiB, and 640 MiB a communicator), and the driver's 2 MiB
 * granularity over its ~20 allocations: 48 MiB. So at every point the device may hold at most
 * total + overhead - context + 48 MiB. On one GPU (no NCCL) also: nothing comes after creation (the
 * trainer allocates nothing in its step loop, evaluation or saves; the async save's staging is pinned
 * host memory), so the device may not fall by more than 32 MiB (the driver's own small pools) from
 * the point right after creation. And the measurement must see the allocations (at least the plan's
 * total less 4 MiB at creation), or the test could not fail. */
static test_result memory_holds(const mt_config* c, const char* name, const char* dir) {
    size_t before = 0, at[MEM_POINTS] = {0};
    mt_memory_plan plan;
    memset(&plan, 0, sizeof(plan));
    mt_error err;
    mt_status st = memory_lifecycle(c, dir, &before, at, &plan, &err); /* the warm-up life */
    if (st == MT_OK) st = memory_lifecycle(c, dir, &before, at, &plan, &err);
    if (st != MT_OK) {
        printf("    FAIL %s: %s\n", name, err.message);
        return TEST_FAIL;
    }
    const double mib = 1048576.0, total = (double)plan.total_bytes;
    const double allowed = total + (double)(plan.overhead_bytes - MT_PLAN_CONTEXT_BYTES) + 48.0 * mib;
    double used[MEM_POINTS];
    printf("      %s: plan %.1f MiB + %.0f MiB for cuBLAS and NCCL; in use after", name, total / mib,
           (double)(plan.overhead_bytes - MT_PLAN_CONTEXT_BYTES) / mib);
    for (int k = 0; k < MEM_POINTS; k++) {
        used[k] = (double)before - (double)at[k];
        printf("%s %s %.1f", k ? "," : "", memory_point_names[k], used[k] / mib);
    }
    double most = used[0];
    for (int k = 1; k < MEM_POINTS; k++) most = used[k] > most ? used[k] : most;
    printf(" MiB; beyond the allocations at most %.1f MiB (allowed %.1f)\n", (most - total) / mib, (allowed - total) / mib);
    EXPECT(used[MEM_CREATED] >= total - 4.0 * mib, "%s: the device fell %.1f MiB at creation, the plan allocates %.1f MiB",
           name, used[MEM_CREATED] / mib, total / mib);
    for (int k = 0; k < MEM_POINTS; k++)
        EXPECT(used[k] <= allowed, "%s: after %s the device holds %.1f MiB, the plan allows %.1f MiB (%.1f MiB over: a "
               "buffer the plan does not count, or the libraries beyond MT_PLAN_CUBLAS_BYTES / MT_PLAN_NCCL_BYTES)", name,
               memory_point_names[k], used[k] / mib, allowed / mib, (used[k] - allowed) / mib);
    if (mpi_world() == 1)
        for (int k = MEM_TRAINED; k < MEM_POINTS; k++)
            EXPECT(used[k] - used[MEM_CREATED] <= 32.0 * mib, "%s: after %s the device holds %.1f MiB more than right "
                   "after creation (allocated after mt_trainer_create, not in the plan)", name, memory_point_names[k],
                   (used[k] - used[MEM_CREATED]) / mib);
    return TEST_PASS;
}

static test_result test_plan_holds_after_training_one_gpu(void) {
    REQUIRE_GPU();
    mt_config c = memory_steady_config(1, 1, 0);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    char dir[128];
    EXPECT(memory_shared_dir(dir, sizeof(dir), "plan_holds"), "mkdtemp");
    test_result r = memory_holds(&c, "one GPU bf16", dir);
    memory_shared_dir_remove(dir);
    return r;
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
        /* each data-parallel rank's part of one global batch (a pipeline's stages share theirs) */
        fill_tokens(tokens, per_step, (int)c.vocab_size, 7000 + 97 * k + 13 * (uint64_t)mt_rank_coordinates(&c, c.rank).dp);
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
    {"plan_holds_after_training_one_gpu", test_plan_holds_after_training_one_gpu},
};

/* ---- several GPUs: offload with the distributed optimizer ------------------------------------------ */

/* Six steps of base with the GPU optimizer and with 0.6 of each rank's optimizer shard offloaded, on
 * several processes: the losses and this rank's weights (with PP, its stage's) equal bit for bit. */
static test_result offload_matches_multigpu(const mt_config* base, const char* layout) {
    mt_error err;
    mt_config probe = *base;
    EXPECT_OK(mt_config_finalize(&probe, &err), &err);
    const int64_t n = mt_num_parameters(&probe);
    float* w[2] = {(float*)calloc((size_t)n, sizeof(float)), (float*)calloc((size_t)n, sizeof(float))};
    double losses[2][6];
    test_result res = TEST_PASS;
    for (int v = 0; v < 2 && res == TEST_PASS; v++) {
        mt_config c = *base;
        EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
        c.optimizer_cpu_offload = v;
        c.optimizer_offload_fraction = 0.6;
        res = tp_agree(offload_train(c, 6, 0, losses[v], w[v]));
    }
    if (res == TEST_PASS) {
        printf("      %s %s: loss %.6f -> %.6f\n", layout, base->precision == MT_FP32 ? "fp32" : "bf16", losses[0][0],
               losses[0][5]);
        for (int k = 0; k < 6; k++)
            if (losses[1][k] != losses[0][k]) {
                printf("    FAIL step %d: offloaded %.9f, GPU %.9f\n", k, losses[1][k], losses[0][k]);
                res = TEST_FAIL;
            }
        if (res == TEST_PASS && memcmp(w[0], w[1], sizeof(float) * n) != 0) {
            printf("    FAIL rank %d: the final weights differ\n", base->rank);
            res = TEST_FAIL;
        }
    }
    free(w[0]);
    free(w[1]);
    return tp_agree(res);
}

/* DP = the process count, distributed optimizer: each rank offloads the end of its own shard. */
static test_result offload_distributed(mt_precision prec) {
    REQUIRE_MPI_GPUS();
    int world = mpi_world();
    mt_config base = test_config(TEST_GPT2, prec);
    base.lr = 1e-2;
    test_config_parallel(&base, 1, world, 0);
    test_config_ddp(&base, 1, 1, 1, 0);
    test_config_batch(&base, 4, 4 * world);
    test_config_this_rank(&base);
    char layout[32];
    snprintf(layout, sizeof(layout), "DP=%d", world);
    return offload_matches_multigpu(&base, layout);
}
static test_result test_offload_distributed_fp32(void) { return offload_distributed(MT_FP32); }
static test_result test_offload_distributed_bf16(void) { return offload_distributed(MT_BF16); }

/* The pipeline layouts of these tests: PP 2 on 2 processes, PP 2 x DP 2 with the distributed optimizer
 * on 4; 4 layers (VP 2: a layer per chunk), micro-batch 2, 4 micro-batches per rank. */
static mt_config memory_pp_config(mt_precision prec, int vp) {
    const int world = mpi_world(), dp = world / 2;
    mt_config c = test_config(TEST_GPT2, prec);
    c.num_layers = 4;
    c.pipeline_model_parallel_size = 2;
    c.virtual_pipeline_size = vp;
    test_config_parallel(&c, 1, world, 0);
    test_config_ddp(&c, dp > 1, 0, 0, 0);
    test_config_batch(&c, 2, 8 * dp);
    test_config_this_rank(&c);
    return c;
}
#define REQUIRE_PP_PROCESSES()                                                                                    \
    do {                                                                                                          \
        REQUIRE_MPI_GPUS();                                                                                       \
        if (mpi_world() != 2 && mpi_world() != 4) SKIP("runs under mpirun -np 2 or -np 4, not %d", mpi_world()); \
    } while (0)

/* Each pipeline rank's trainer allocates its stage's plan to the byte (the slots of its schedule, the
 * head's logits, the send buffer), 1F1B and interleaved, bf16 and fp32 with offload. */
static test_result plan_allocation_pipeline(mt_precision prec, int vp, int offload) {
    mt_config c = memory_pp_config(prec, vp);
    c.optimizer_cpu_offload = offload;
    c.optimizer_offload_fraction = 0.5;
    mt_error err;
    EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
    char name[96];
    snprintf(name, sizeof(name), "rank %d %s VP %d%s", c.rank, prec == MT_FP32 ? "fp32" : "bf16", vp,
             offload ? " offload 0.5" : "");
    mt_trainer* t = NULL;
    test_result r = create_as_planned(&c, name, &t);
    if (!t) return r;
    const mt_memory_plan plan = mt_trainer_memory_plan(t);
    mt_trainer_free(t);
    printf("      %s (pipeline %d): %.2f MiB planned and allocated, %d activation slots\n", name, plan.pp_rank,
           plan.total_bytes / 1048576.0, plan.in_flight);
    return r;
}
static test_result test_plan_equals_allocation_pipeline(void) {
    REQUIRE_PP_PROCESSES();
    test_result r = tp_agree(plan_allocation_pipeline(MT_BF16, 1, 0));
    if (r == TEST_PASS) r = tp_agree(plan_allocation_pipeline(MT_BF16, 2, 0));
    if (r == TEST_PASS) r = tp_agree(plan_allocation_pipeline(MT_FP32, 1, 1));
    return r;
}

/* The optimizer offloaded under the pipeline's optimizer step (the gradient norm summed over the
 * stages, the tied word embeddings' gradients summed over the first and last stage, with DP 2 the
 * distributed optimizer's shards). */
static test_result offload_pipeline(mt_precision prec) {
    REQUIRE_PP_PROCESSES();
    mt_config base = memory_pp_config(prec, 1);
    base.lr = 1e-2;
    char layout[32];
    snprintf(layout, sizeof(layout), "PP 2 x DP %d", base.world_size / 2);
    return offload_matches_multigpu(&base, layout);
}
static test_result test_offload_pipeline_fp32(void) { return offload_pipeline(MT_FP32); }
static test_result test_offload_pipeline_bf16(void) { return offload_pipeline(MT_BF16); }

/* Each rank's device against its plan through memory_lifecycle (np 2 or 4): DP = the processes with the
 * distributed optimizer, TP 2 + SP (x DP), PP 2 (x DP), one layout after the other. */
static test_result test_plan_holds_after_training_each_rank(void) {
    REQUIRE_MPI_GPUS();
    const int world = mpi_world();
    struct { const char* name; int tp, pp, distributed; } layouts[] = {
        {"distributed optimizer", 1, 1, 1}, {"TP 2 + SP", 2, 1, 0}, {"PP 2", 1, 2, 0}};
    char dir[128];
    if (!memory_shared_dir(dir, sizeof(dir), "plan_holds")) SKIP("mkdtemp failed on rank 0");
    test_result res = TEST_PASS;
    for (size_t i = 0; i < sizeof(layouts) / sizeof(layouts[0]); i++) {
        if (world % (layouts[i].tp * layouts[i].pp) != 0) continue;
        mt_config c = memory_steady_config(layouts[i].tp, layouts[i].pp, layouts[i].distributed);
        mt_error err;
        test_result r = mt_config_finalize(&c, &err) == MT_OK ? TEST_PASS : TEST_FAIL;
        if (r != TEST_PASS) printf("    FAIL %s: %s\n", layouts[i].name, err.message);
        r = tp_agree(r);
        char name[96];
        snprintf(name, sizeof(name), "rank %d of %d, %s", c.rank, world, layouts[i].name);
        if (r == TEST_PASS) r = tp_agree(memory_holds(&c, name, dir));
        if (r != TEST_PASS) res = r;
    }
    memory_shared_dir_remove(dir);
    return res;
}

static const test_case memory_multigpu_tests[] = {
    {"offload_distributed_optimizer_fp32", test_offload_distributed_fp32},
    {"offload_distributed_optimizer_bf16", test_offload_distributed_bf16},
    {"plan_equals_allocation_pipeline", test_plan_equals_allocation_pipeline},
    {"offload_pipeline_fp32", test_offload_pipeline_fp32},
    {"offload_pipeline_bf16", test_offload_pipeline_bf16},
    {"plan_holds_after_training_each_rank", test_plan_holds_after_training_each_rank},
};

#endif
