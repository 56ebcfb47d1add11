/* tests/test_expert_parallel.h — expert parallelism (issue #34; multi-GPU, under mpirun with an even number of
 * ranks, each skipping otherwise): the same MoE model trained on the same global batches at EP = 2 (the
 * all-to-all dispatcher, megatron.cu section 17) and at EP = 1, both at DP = the world (so the data, the
 * dense layers and the aux losses are the same on both sides; only where the experts run changes):
 *   - each step's loss and gradient norm, the logged MoE losses, the tokens per expert and the expert bias;
 *   - the final weights gathered whole (mt_trainer_get_parameters: each EP rank's experts put in place);
 *   - the initial weights (each EP rank draws its experts' values of the full model): compared at step 0;
 *   - EP = 2 run twice: bitwise the same (the dispatch moves whole rows to fixed places).
 * Both with the distributed optimizer (expert buckets sharded over the expert-data-parallel group) and
 * without (the gradient norm then counts an expert on one rank of its EDP group only: a double count
 * shows as a sqrt(2)-scale error in the norm).
 * Tolerances. fp32: each expert's rows are the same rows at EP = 1 and 2, but its GEMMs see them in another
 * grouping and order (received rank by rank), so cuBLAS may pick other kernels: fp32 rounding, amplified by
 * 20 steps of AdamW, stays ~1e-6 relative; 1e-5 on losses and norms, 1e-5 per tensor on the weights, and per
 * element 1e-4 (|ref| + rms): tests/test_moe.h's fp32 bounds, which a wrong expert or a lost row (O(1))
 * cannot meet. Routing decisions of these models have gaps far above fp32 error (ref_moe.py prints them),
 * so tokens per expert and the expert bias are compared exactly. bf16: the 1e-3 on the losses over
 * 20 steps; the weights within test_moe.h's bf16 bounds after S steps (dense 5e-3, router/experts 1e-1). */
#ifndef MT_TEST_EXPERT_PARALLEL_H
#define MT_TEST_EXPERT_PARALLEL_H

#define EP_STEPS 20

typedef struct {
    double loss[EP_STEPS], norm[EP_STEPS], moe[EP_STEPS][4];
    int32_t* tokens;    /* [Lm, E] after the last step */
    float* bias;        /* [Lm, E] */
    float* init;        /* [n] weights at creation */
    float* params;      /* [n] weights after the last step */
} ep_run_result;

static void ep_result_free(ep_run_result* r) {
    free(r->tokens), free(r->bias), free(r->init), free(r->params);
    memset(r, 0, sizeof(*r));
}

/* EP_STEPS steps of config c (DP = the world, ep as given) on the same global batches as every other run. */
static test_result ep_run(mt_config c, int ep, int distributed, ep_run_result* out) {
    memset(out, 0, sizeof(*out));
    const int world = mpi_world();
    test_config_parallel(&c, 1, world, 0);
    test_config_ddp(&c, distributed, 0, 0, 0);
    test_config_this_rank(&c);
    c.expert_model_parallel_size = ep;
    c.moe_token_dispatcher_alltoall = 1;
    c.global_batch_size = 2 * c.micro_batch_size * world; /* two micro-batches per rank */
    mt_trainer* t = NULL;
    if (dp_create(&c, &t) != TEST_PASS) return TEST_FAIL;
    mt_error err;
    const int64_t n = mt_num_parameters(&c), row = c.seq_length + 1;
    const int Lm = mt_moe_num_layers(&c), E = c.num_experts;
    out->tokens = (int32_t*)calloc((size_t)Lm * E, sizeof(int32_t));
    out->bias = (float*)calloc((size_t)Lm * E, sizeof(float));
    out->init = (float*)malloc(sizeof(float) * (size_t)n);
    out->params = (float*)malloc(sizeof(float) * (size_t)n);
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * (size_t)(c.global_batch_size * row));
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * (size_t)(c.global_batch_size * row));
    test_result res = out->tokens && out->bias && out->init && out->params && global && mine ? TEST_PASS : TEST_FAIL;
    if (res == TEST_PASS && mt_trainer_get_parameters(t, out->init, &err) != MT_OK) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    for (int k = 0; k < EP_STEPS && res == TEST_PASS; k++) {
        fill_tokens(global, c.global_batch_size * row, (int)c.vocab_size, 3000 + k);
        dp_slice(&c, global, mine);
        mt_step_result r;
        if (mt_trainer_train_step(t, mine, &r, &err) != MT_OK) {
            printf("    FAIL EP=%d step %d: %s\n", ep, k, err.message);
            res = TEST_FAIL;
            break;
        }
        out->loss[k] = r.lm_loss;
        out->norm[k] = r.grad_norm;
        for (int j = 0; j < 4; j++) out->moe[k][j] = r.moe_losses[j];
    }
    if (res == TEST_PASS && (mt_trainer_moe_stats(t, NULL, out->tokens, out->bias, &err) != MT_OK ||
                             mt_trainer_get_parameters(t, out->params, &err) != MT_OK)) {
        printf("    FAIL EP=%d statistics or parameters: %s\n", ep, err.message);
        res = TEST_FAIL;
    }
    free(global);
    free(mine);
    mt_trainer_free(t);
    return res;
}

static double ep_rel(double a, double b) { return fabs(a - b) / (fabs(b) + 1e-30); }

/* EP = 2 against EP = 1 on the model of a dev/ref_moe.py vectors file (its weights drawn from the config's
 * seed, not the file's: only the model and its MoE settings are taken). */
static test_result ep_matches_ep1(const char* vectors, mt_precision precision, int distributed) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() % 2) SKIP("expert parallelism at EP = 2 needs an even number of ranks");
    moe_vectors mv;
    if (access(vectors, R_OK) != 0) SKIP_OR_FAIL_STRICT(MOE_VECTORS_MISSING, vectors);
    if (!load_moe_vectors(&mv, vectors)) {
        free(mv.g.blob);
        printf("    FAIL cannot read test vectors %s (run dev/ref_moe.py)\n", vectors);
        return TEST_FAIL;
    }
    const mt_config base = moe_config_from_vectors(&mv, precision);
    free(mv.g.blob);
    ep_run_result one, two, again;
    test_result res = ep_run(base, 1, distributed, &one);
    if (tp_agree(res) == TEST_PASS) res = ep_run(base, 2, distributed, &two);
    if (tp_agree(res) == TEST_PASS) res = ep_run(base, 2, distributed, &again);
    res = tp_agree(res);
    const int fp32 = precision == MT_FP32;
    const double tol_loss = fp32 ? 1e-5 : 1e-3, tol_norm = fp32 ? 1e-5 : 2e-2;
    if (res == TEST_PASS) {
        mt_config c = base;
        mt_error err;
        c.moe_token_dispatcher_alltoall = 1;
        EXPECT_OK(mt_config_finalize(&c, &err), &err); /* the full model's layout, for the comparisons */
        const int64_t n = mt_num_parameters(&c);
        const int Lm = mt_moe_num_layers(&c), E = c.num_experts;
        double worst_loss = 0, worst_norm = 0, worst_moe = 0;
        for (int k = 0; k < EP_STEPS; k++) {
            worst_loss = fmax(worst_loss, ep_rel(two.loss[k], one.loss[k]));
            worst_norm = fmax(worst_norm, ep_rel(two.norm[k], one.norm[k]));
            for (int j = 0; j < 4; j++)
                if (one.moe[k][j] != 0) worst_moe = fmax(worst_moe, ep_rel(two.moe[k][j], one.moe[k][j]));
        }
        printf("    %s %s%s: over %d steps loss rel %.2e, grad norm rel %.2e, MoE losses rel %.2e; last loss %.6f vs "
               "%.6f\n", vectors, fp32 ? "fp32" : "bf16", distributed ? " (distributed optimizer)" : "", EP_STEPS,
               worst_loss, worst_norm, worst_moe, two.loss[EP_STEPS - 1], one.loss[EP_STEPS - 1]);
        EXPECT(worst_loss <= tol_loss, "EP=2 losses off EP=1's by %.2e (tol %.0e)", worst_loss, tol_loss);
        EXPECT(worst_norm <= tol_norm, "EP=2 gradient norms off EP=1's by %.2e (tol %.0e)", worst_norm, tol_norm);
        EXPECT(worst_moe <= tol_loss, "EP=2 logged MoE losses off EP=1's by %.2e", worst_moe);
        int64_t init_diff = 0, token_diff = 0, bias_diff = 0, repeat_diff = 0;
        for (int64_t i = 0; i < n; i++) init_diff += two.init[i] != one.init[i];
        for (int64_t i = 0; i < (int64_t)Lm * E; i++) token_diff += two.tokens[i] != one.tokens[i];
        for (int64_t i = 0; i < (int64_t)Lm * E; i++) bias_diff += two.bias[i] != one.bias[i];
        for (int64_t i = 0; i < n; i++) repeat_diff += memcmp(&two.params[i], &again.params[i], 4) != 0;
        for (int k = 0; k < EP_STEPS; k++) repeat_diff += two.loss[k] != again.loss[k] || two.norm[k] != again.norm[k];
        EXPECT(init_diff == 0, "%lld initial weights differ between EP = 2 and EP = 1", (long long)init_diff);
        EXPECT(!fp32 || (token_diff == 0 && bias_diff == 0), "tokens per expert (%lld) or expert bias (%lld) differ",
               (long long)token_diff, (long long)bias_diff);
        EXPECT(repeat_diff == 0, "EP = 2 twice: %lld values differ (not bitwise repeatable)", (long long)repeat_diff);
        char why[512] = "";
        const int ok = moe_compare_tensors("weights", &c, two.params, one.params, fp32 ? 1e-5 : 5e-3, fp32 ? 1e-4 : 1e30,
                                           fp32 ? 1e-5 : 1e-1, why, sizeof(why));
        EXPECT(ok, "%s", why);
        /* the comparison can fail: the weights moved (a lost update would leave them at init) */
        double moved = 0, scale = 0;
        for (int64_t i = 0; i < n; i++) moved += fabs((double)one.params[i] - one.init[i]), scale += fabs(one.init[i]);
        EXPECT(moved > 1e-3 * scale, "the weights hardly moved (%.3e of %.3e)", moved, scale);
    }
    ep_result_free(&one), ep_result_free(&two), ep_result_free(&again);
    return res;
}

static test_result test_ep_mixtral_fp32(void) { return ep_matches_ep1("dev/data/moe_vectors/mixtral_tiny.bin", MT_FP32, 0); }
static test_result test_ep_mixtral_fp32_distributed(void) {
    return ep_matches_ep1("dev/data/moe_vectors/mixtral_tiny.bin", MT_FP32, 1);
}
static test_result test_ep_deepseek_fp32_distributed(void) {
    return ep_matches_ep1("dev/data/moe_vectors/deepseek_tiny_all.bin", MT_FP32, 1);
}
static test_result test_ep_capacity_fp32(void) {
    return ep_matches_ep1("dev/data/moe_vectors/moe_cap_position_pad.bin", MT_FP32, 0);
}
static test_result test_ep_qwen3_bf16_distributed(void) {
    return ep_matches_ep1("dev/data/moe_vectors/qwen3_tiny.bin", MT_BF16, 1);
}
static test_result test_ep_mixtral_bf16(void) { return ep_matches_ep1("dev/data/moe_vectors/mixtral_tiny.bin", MT_BF16, 0); }

static const test_case expert_parallel_multigpu_tests[] = {
    {"ep2_matches_ep1_mixtral_fp32", test_ep_mixtral_fp32},
    {"ep2_matches_ep1_mixtral_fp32_distributed_optimizer", test_ep_mixtral_fp32_distributed},
    {"ep2_matches_ep1_deepseek_fp32_distributed_optimizer", test_ep_deepseek_fp32_distributed},
    {"ep2_matches_ep1_capacity_position_pad_fp32", test_ep_capacity_fp32},
    {"ep2_matches_ep1_mixtral_bf16", test_ep_mixtral_bf16},
    {"ep2_matches_ep1_qwen3_bf16_distributed_optimizer", test_ep_qwen3_bf16_distributed},
};

#endif
