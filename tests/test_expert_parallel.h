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
    float* bias_start;  /* [Lm, E] before the first step (after a load) */
    float* init;        /* [n] weights at creation (after a load) */
    float* params;      /* [n] weights after the last step */
} ep_run_result;

static void ep_result_free(ep_run_result* r) {
    free(r->tokens), free(r->bias), free(r->bias_start), free(r->init), free(r->params);
    memset(r, 0, sizeof(*r));
}

static test_result ep_run_span(mt_config c, int ep, int distributed, const char* load_dir, const char* save_dir, int first,
                               int count, ep_run_result* out);

/* EP_STEPS steps of config c (DP = the world, ep as given) on the same global batches as every other run. */
static test_result ep_run(mt_config c, int ep, int distributed, ep_run_result* out) {
    return ep_run_span(c, ep, distributed, NULL, NULL, 0, EP_STEPS, out);
}

/* Steps [first, first + count) of ep_run's: loaded from load_dir first (its iteration must be `first`), saved
 * into save_dir after the last (as iteration first + count); the results of those steps only. */
static test_result ep_run_span(mt_config c, int ep, int distributed, const char* load_dir, const char* save_dir, int first,
                               int count, ep_run_result* out) {
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
    out->bias_start = (float*)calloc((size_t)Lm * E, sizeof(float));
    out->init = (float*)malloc(sizeof(float) * (size_t)n);
    out->params = (float*)malloc(sizeof(float) * (size_t)n);
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * (size_t)(c.global_batch_size * row));
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * (size_t)(c.global_batch_size * row));
    test_result res = out->tokens && out->bias && out->bias_start && out->init && out->params && global && mine
                          ? TEST_PASS : TEST_FAIL;
    if (res == TEST_PASS && load_dir) {
        int64_t it = -1, consumed = 0;
        if (mt_trainer_load(t, load_dir, -1, &it, &consumed, &err) != MT_OK || it != first) {
            printf("    FAIL EP=%d load: %s (iteration %lld, want %d)\n", ep, err.message, (long long)it, first);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && (mt_trainer_get_parameters(t, out->init, &err) != MT_OK ||
                             mt_trainer_moe_stats(t, NULL, NULL, out->bias_start, &err) != MT_OK)) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    for (int k = first; k < first + count && res == TEST_PASS; k++) {
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
    if (res == TEST_PASS && save_dir &&
        mt_trainer_save(t, save_dir, first + count, (int64_t)(first + count) * c.global_batch_size, &err) != MT_OK) {
        printf("    FAIL EP=%d save: %s\n", ep, err.message);
        res = TEST_FAIL;
    }
    free(global);
    free(mine);
    mt_trainer_free(t);
    return res;
}

static double ep_rel(double a, double b) { return fabs(a - b) / (fabs(b) + 1e-30); }

/* The EP tests' set-up: an even number of MPI ranks with GPUs, and the model of a dev/ref_moe.py vectors file
 * (its weights drawn from the config's seed, not the file's: only the model and its MoE settings are taken) in
 * *base. Anything but TEST_PASS is the test's result (a skip, or a failure to read the file). */
static test_result ep_base_config(const char* vectors, mt_precision precision, mt_config* base) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() % 2) SKIP("expert parallelism at EP = 2 needs an even number of ranks");
    moe_vectors mv;
    if (access(vectors, R_OK) != 0) SKIP_OR_FAIL_STRICT(MOE_VECTORS_MISSING, vectors);
    if (!load_moe_vectors(&mv, vectors)) {
        free(mv.g.blob);
        printf("    FAIL cannot read test vectors %s (run dev/ref_moe.py)\n", vectors);
        return TEST_FAIL;
    }
    *base = moe_config_from_vectors(&mv, precision);
    free(mv.g.blob);
    return TEST_PASS;
}

/* EP = 2 against EP = 1 on the model of a dev/ref_moe.py vectors file. */
static test_result ep_matches_ep1(const char* vectors, mt_precision precision, int distributed) {
    mt_config base;
    const test_result setup = ep_base_config(vectors, precision, &base);
    if (setup != TEST_PASS) return setup;
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


/* ---- checkpoints at EP > 1 (issue #34): saved at one EP size, loaded at the same or another ---------------- */

#define EP_SAVED_AT 10 /* the save after step 10 of EP_STEPS; the load runs the rest */

/* The deepseek vectors' model (sigmoid routing with the expert bias, a gated shared expert, the seq aux loss: the
 * bias travels, and every kind of MoE tensor is cut or whole as it should be) trained EP_SAVED_AT steps at
 * (save_ep, save_dist: the distributed optimizer or not) and saved; a trainer at (load_ep, load_dist) loads it and
 * runs the remaining steps, against a run at the load's layout straight through:
 *   - the weights right after the load are the saved run's last ones bitwise (mt_trainer_get_parameters: the
 *     experts put whole from each EP rank; a reshard is copies of fp32 values), and so is the expert bias;
 *   - at the same layout the continued losses, gradient norms, expert bias and final weights equal the straight
 *     run's bitwise (Adam's moments, step, the scheduler: everything a resume needs, or a step would differ);
 *   - at another EP size (or optimizer sharding) within the EP = 2 / EP = 1 comparison's fp32 bounds (this file's
 *     header: 1e-5 on losses and norms, the weights per tensor 1e-5 and per element 1e-4 (|ref| + rms), the
 *     expert bias exactly): the saved weights are the save-layout run's, which differ from the straight run's
 *     only by that rounding; a lost Adam moment or a misplaced expert is far outside it (Adam's first steps
 *     after a reset move every weight by ~lr);
 * and a trainer with another expert count refuses the checkpoint in one line naming --num-experts. */
static test_result ep_checkpoint_case(int save_ep, int save_dist, int load_ep, int load_dist) {
    const char* vectors = "dev/data/moe_vectors/deepseek_tiny_all.bin";
    mt_config base;
    const test_result setup = ep_base_config(vectors, MT_FP32, &base);
    if (setup != TEST_PASS) return setup;
    /* one directory for all ranks (they share this node's /tmp), named by rank 0 */
    int tag = (int)getpid();
#ifdef MT_USE_MPI
    MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    char dir[256], path[512];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_ep_ckpt_%d_%d%d%d%d", tag, save_ep, save_dist, load_ep, load_dist);
    ep_run_result straight, saved, resumed;
    memset(&saved, 0, sizeof(saved));
    memset(&resumed, 0, sizeof(resumed));
    test_result res = ep_run_span(base, load_ep, load_dist, NULL, NULL, 0, EP_STEPS, &straight);
    if (tp_agree(res) == TEST_PASS) res = ep_run_span(base, save_ep, save_dist, NULL, dir, 0, EP_SAVED_AT, &saved);
    if (tp_agree(res) == TEST_PASS)
        res = ep_run_span(base, load_ep, load_dist, dir, NULL, EP_SAVED_AT, EP_STEPS - EP_SAVED_AT, &resumed);
    res = tp_agree(res);
    const int same = save_ep == load_ep && save_dist == load_dist;
    if (res == TEST_PASS) {
        mt_config c = base;
        mt_error err;
        c.moe_token_dispatcher_alltoall = 1;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        const int64_t n = mt_num_parameters(&c), nb = (int64_t)mt_moe_num_layers(&c) * c.num_experts;
        /* the files: each EP rank's directory; with the distributed optimizer DP rank 1's shard in EP rank 1's */
        if (save_ep > 1) {
            snprintf(path, sizeof(path), "%s/iter_%07d/mp_rank_00_001/%s", dir, EP_SAVED_AT,
                     save_dist ? "distrib_optim_dp001.bin" : "model_optim_rng.bin");
            EXPECT(access(path, R_OK) == 0, "no %s", path);
        }
        int64_t weights_diff = 0, bias_diff = 0, bias_moved = 0;
        for (int64_t i = 0; i < n; i++) weights_diff += memcmp(&resumed.init[i], &saved.params[i], 4) != 0;
        for (int64_t i = 0; i < nb; i++) bias_diff += memcmp(&resumed.bias_start[i], &saved.bias[i], 4) != 0;
        for (int64_t i = 0; i < nb; i++) bias_moved += saved.bias[i] != 0.0f;
        EXPECT(weights_diff == 0, "%lld weights differ right after the load from the saved ones", (long long)weights_diff);
        EXPECT(bias_diff == 0 && bias_moved > 0, "the expert bias: %lld values differ after the load (%lld moved "
               "from 0 before the save)", (long long)bias_diff, (long long)bias_moved);
        double worst_loss = 0, worst_norm = 0;
        int64_t exact_diff = 0;
        for (int k = EP_SAVED_AT; k < EP_STEPS; k++) {
            worst_loss = fmax(worst_loss, ep_rel(resumed.loss[k], straight.loss[k]));
            worst_norm = fmax(worst_norm, ep_rel(resumed.norm[k], straight.norm[k]));
            exact_diff += resumed.loss[k] != straight.loss[k] || resumed.norm[k] != straight.norm[k];
        }
        for (int64_t i = 0; i < nb; i++) exact_diff += resumed.bias[i] != straight.bias[i];
        printf("    EP=%d%s save -> EP=%d%s load: steps %d..%d loss rel %.2e, grad norm rel %.2e; last loss %.6f vs %.6f\n",
               save_ep, save_dist ? " (distributed optimizer)" : "", load_ep, load_dist ? " (distributed optimizer)" : "",
               EP_SAVED_AT, EP_STEPS - 1, worst_loss, worst_norm, resumed.loss[EP_STEPS - 1], straight.loss[EP_STEPS - 1]);
        if (same) {
            int64_t final_diff = 0;
            for (int64_t i = 0; i < n; i++) final_diff += memcmp(&resumed.params[i], &straight.params[i], 4) != 0;
            EXPECT(exact_diff == 0 && final_diff == 0, "resumed at the same layout: %lld losses, norms or bias values and "
                   "%lld weights differ from the uninterrupted run (bitwise)", (long long)exact_diff, (long long)final_diff);
        } else {
            EXPECT(worst_loss <= 1e-5 && worst_norm <= 1e-5, "resumed at another layout: losses off by %.2e, norms by "
                   "%.2e (tol 1e-5)", worst_loss, worst_norm);
            int64_t bias_off = 0;
            for (int64_t i = 0; i < nb; i++) bias_off += resumed.bias[i] != straight.bias[i];
            EXPECT(bias_off == 0, "the expert bias: %lld values differ from the uninterrupted run", (long long)bias_off);
            char why[512] = "";
            EXPECT(moe_compare_tensors("weights", &c, resumed.params, straight.params, 1e-5, 1e-4, 1e-5, why, sizeof(why)),
                   "%s", why);
        }
        /* the comparisons can fail: the weights moved after the load */
        double moved = 0, scale = 0;
        for (int64_t i = 0; i < n; i++) moved += fabs((double)resumed.params[i] - resumed.init[i]), scale += fabs(resumed.init[i]);
        EXPECT(moved > 1e-4 * scale, "the weights hardly moved after the load (%.3e of %.3e)", moved, scale);
    }
    /* another model: twice the experts, refused in one line (every rank) */
    if (res == TEST_PASS && same) {
        mt_config other = base;
        other.num_experts *= 2;
        test_config_parallel(&other, 1, mpi_world(), 0);
        test_config_ddp(&other, load_dist, 0, 0, 0);
        test_config_this_rank(&other);
        other.expert_model_parallel_size = load_ep;
        other.moe_token_dispatcher_alltoall = 1;
        other.global_batch_size = 2 * other.micro_batch_size * mpi_world();
        mt_trainer* t = NULL;
        res = dp_create(&other, &t);
        if (res == TEST_PASS) {
            mt_error err;
            int64_t it = 0, consumed = 0;
            mt_status st = mt_trainer_load(t, dir, -1, &it, &consumed, &err);
            char want[96];
            snprintf(want, sizeof(want), "has --num-experts (0: a dense model) %d but this run has %d", base.num_experts,
                     other.num_experts);
            if (!(st == MT_ERR_CONFIG && strstr(err.message, want) && !strchr(err.message, '\n'))) {
                printf("    FAIL another expert count: %s, '%s'\n", mt_status_name(st), st != MT_OK ? err.message : "");
                res = TEST_FAIL;
            }
        }
        mt_trainer_free(t);
        res = tp_agree(res);
    }
#ifdef MT_USE_MPI
    MPI_Barrier(MPI_COMM_WORLD);
#endif
    if (mpi_rank() == 0) mt_remove_tree(dir);
    ep_result_free(&straight), ep_result_free(&saved), ep_result_free(&resumed);
    return res;
}

static test_result test_ep_ckpt_ep2_resume(void) { return ep_checkpoint_case(2, 0, 2, 0); }
static test_result test_ep_ckpt_ep2_resume_distributed(void) { return ep_checkpoint_case(2, 1, 2, 1); }
static test_result test_ep_ckpt_ep2_to_ep1(void) { return ep_checkpoint_case(2, 0, 1, 0); }
static test_result test_ep_ckpt_ep2_to_ep1_distributed(void) { return ep_checkpoint_case(2, 1, 1, 1); }
static test_result test_ep_ckpt_ep1_to_ep2(void) { return ep_checkpoint_case(1, 0, 2, 0); }
static test_result test_ep_ckpt_ep1_to_ep2_distributed(void) { return ep_checkpoint_case(1, 1, 2, 1); }
static test_result test_ep_ckpt_ep2_distributed_to_ep1_plain(void) { return ep_checkpoint_case(2, 1, 1, 0); }

static const test_case expert_parallel_multigpu_tests[] = {
    {"ep2_matches_ep1_mixtral_fp32", test_ep_mixtral_fp32},
    {"ep2_matches_ep1_mixtral_fp32_distributed_optimizer", test_ep_mixtral_fp32_distributed},
    {"ep2_matches_ep1_deepseek_fp32_distributed_optimizer", test_ep_deepseek_fp32_distributed},
    {"ep2_matches_ep1_capacity_position_pad_fp32", test_ep_capacity_fp32},
    {"ep2_matches_ep1_mixtral_bf16", test_ep_mixtral_bf16},
    {"ep2_matches_ep1_qwen3_bf16_distributed_optimizer", test_ep_qwen3_bf16_distributed},
    {"checkpoint_ep2_save_ep2_load_bitwise", test_ep_ckpt_ep2_resume},
    {"checkpoint_ep2_save_ep2_load_bitwise_distributed_optimizer", test_ep_ckpt_ep2_resume_distributed},
    {"checkpoint_ep2_save_ep1_load", test_ep_ckpt_ep2_to_ep1},
    {"checkpoint_ep2_save_ep1_load_distributed_optimizer", test_ep_ckpt_ep2_to_ep1_distributed},
    {"checkpoint_ep1_save_ep2_load", test_ep_ckpt_ep1_to_ep2},
    {"checkpoint_ep1_save_ep2_load_distributed_optimizer", test_ep_ckpt_ep1_to_ep2_distributed},
    {"checkpoint_ep2_distributed_optimizer_save_ep1_plain_load", test_ep_ckpt_ep2_distributed_to_ep1_plain},
};

#endif
