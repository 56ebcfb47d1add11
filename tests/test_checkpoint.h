/* tests/test_checkpoint.h — checkpoints on one GPU (GPU tests; each skips when no GPU is visible).
 *
 * Save and resume are bitwise: 10 steps, save, load, 10 steps give exactly the losses and weights of
 * 20 straight steps, and two runs of the same 20 steps are bitwise equal (determinism, which that
 * comparison needs), for GPT-2 in bf16 and fp32 and Llama in bf16; the directory has Megatron's
 * layout (latest_checkpointed_iteration.txt, iter_NNNNNNN/mp_rank_00/); a checkpoint of another
 * shape or flavour is refused with a message naming the flag. The sharded (distributed optimizer,
 * tensor-parallel) checkpoints are tested with data and tensor parallelism. */
#ifndef MT_TEST_CHECKPOINT_H
#define MT_TEST_CHECKPOINT_H

static test_result run_steps(mt_config* c, const char* load_dir, const char* save_dir, int first, int count,
                             double* losses, float* params_out) {
    mt_error err;
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, c, &err), &err);
    if (load_dir) {
        int64_t it = 0, consumed = 0;
        mt_status st = mt_trainer_load(t, load_dir, -1, &it, &consumed, &err);
        if (st != MT_OK) { mt_trainer_free(t); EXPECT_OK(st, &err); }
        EXPECT(it == first && consumed == (int64_t)first * c->global_batch_size, "resumed at %lld", (long long)it);
    }
    int64_t per_step = (int64_t)c->global_batch_size * (c->seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
    for (int k = first; k < first + count; k++) {
        fill_tokens(tokens, per_step, (int)c->vocab_size, 1000 + k);
        mt_step_result r;
        mt_status st = mt_trainer_train_step(t, tokens, &r, &err);
        if (st != MT_OK) { free(tokens); mt_trainer_free(t); EXPECT_OK(st, &err); }
        losses[k] = r.lm_loss;
    }
    free(tokens);
    if (save_dir) {
        mt_status st = mt_trainer_save(t, save_dir, first + count, (int64_t)(first + count) * c->global_batch_size, &err);
        if (st != MT_OK) { mt_trainer_free(t); EXPECT_OK(st, &err); }
    }
    if (params_out) {
        mt_status st = mt_trainer_get_parameters(t, params_out, &err);
        if (st != MT_OK) { mt_trainer_free(t); EXPECT_OK(st, &err); }
    }
    mt_trainer_free(t);
    return TEST_PASS;
}

static test_result determinism_and_resume_fp8(mt_precision precision, int llama, int fp8_recipe /* -1: none */) {
    REQUIRE_GPU();
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, precision);
    if (fp8_recipe >= 0) { /* FP8: hybrid, a history of 4 with max, so the resumed run needs the saved rings */
        c.fp8_format = MT_FP8_HYBRID;
        c.fp8_recipe = (mt_fp8_recipe)fp8_recipe;
        c.fp8_amax_history_len = 4;
        c.fp8_amax_compute_algo = MT_FP8_AMAX_MAX;
        c.fp8_margin = 1;
    }
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    int64_t n = mt_num_parameters(&c);
    double a[20], b[20], r[20];
    float* pa = (float*)malloc(sizeof(float) * n);
    float* pb = (float*)malloc(sizeof(float) * n);
    float* pr = (float*)malloc(sizeof(float) * n);
    char dir[256];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_ckpt_%d_%d_%d_%d", (int)getpid(), (int)precision, llama, (int)fp8_recipe);
    mt_remove_tree(dir);
    test_result res = TEST_PASS;
    if (run_steps(&c, NULL, NULL, 0, 20, a, pa) != TEST_PASS || run_steps(&c, NULL, NULL, 0, 20, b, pb) != TEST_PASS ||
        run_steps(&c, NULL, dir, 0, 10, r, NULL) != TEST_PASS || run_steps(&c, dir, NULL, 10, 10, r, pr) != TEST_PASS) {
        res = TEST_FAIL;
    } else {
        for (int k = 0; k < 20 && res == TEST_PASS; k++) {
            if (memcmp(&a[k], &b[k], sizeof(double)) != 0) {
                printf("    FAIL step %d: two runs differ (%.9g vs %.9g)\n", k, a[k], b[k]);
                res = TEST_FAIL;
            } else if (memcmp(&a[k], &r[k], sizeof(double)) != 0) {
                printf("    FAIL step %d: 10 + save + load + 10 differs from 20 straight (%.9g vs %.9g)\n", k, r[k], a[k]);
                res = TEST_FAIL;
            }
        }
        if (res == TEST_PASS && memcmp(pa, pb, sizeof(float) * n) != 0) {
            printf("    FAIL final weights of two runs differ\n");
            res = TEST_FAIL;
        }
        if (res == TEST_PASS && memcmp(pa, pr, sizeof(float) * n) != 0) {
            printf("    FAIL final weights after resume differ\n");
            res = TEST_FAIL;
        }
        if (res == TEST_PASS && !(a[19] < a[0])) {
            printf("    FAIL loss did not fall: %.5f -> %.5f\n", a[0], a[19]);
            res = TEST_FAIL;
        }
        printf("      losses %.6f -> %.6f, bitwise equal across runs and across save/load\n", a[0], a[19]);
    }
    mt_remove_tree(dir);
    free(pa);
    free(pb);
    free(pr);
    return res;
}
static test_result determinism_and_resume(mt_precision precision, int llama) {
    return determinism_and_resume_fp8(precision, llama, -1);
}
static test_result test_determinism_and_resume_bf16(void) { return determinism_and_resume(MT_BF16, 0); }
static test_result test_determinism_and_resume_fp8_delayed(void) {
    return determinism_and_resume_fp8(MT_BF16, 0, MT_FP8_DELAYED);
}
static test_result test_determinism_and_resume_fp8_blockwise(void) {
    return determinism_and_resume_fp8(MT_BF16, 0, MT_FP8_BLOCKWISE);
}
static test_result test_determinism_and_resume_fp8_tensorwise_llama(void) {
    return determinism_and_resume_fp8(MT_BF16, 1, MT_FP8_TENSORWISE);
}
static test_result test_determinism_and_resume_fp32(void) { return determinism_and_resume(MT_FP32, 0); }
static test_result test_determinism_and_resume_llama_bf16(void) { return determinism_and_resume(MT_BF16, 1); }

static test_result test_checkpoint_refuses_other_shape(void) {
    REQUIRE_GPU();
    mt_config c = test_config(TEST_GPT2, MT_BF16);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    char dir[256];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_shape_%d", (int)getpid());
    mt_remove_tree(dir);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    mt_status st = mt_trainer_save(t, dir, 7, 56, &err);
    mt_trainer_free(t);
    EXPECT_OK(st, &err);
    /* the layout Megatron users expect */
    char path[512];
    snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt", dir);
    char* tracker = test_read_file(path, NULL);
    EXPECT(tracker && !strcmp(tracker, "7"), "tracker holds '%s'", tracker ? tracker : "(missing)");
    free(tracker);
    snprintf(path, sizeof(path), "%s/iter_0000007/mp_rank_00/model_optim_rng.bin", dir);
    EXPECT(access(path, R_OK) == 0, "missing %s", path);
    mt_config other = test_config(TEST_GPT2, MT_BF16);
    other.hidden_size = 256;
    EXPECT_OK(mt_config_finalize(&other, &err), &err);
    EXPECT_OK(mt_trainer_create(&t, &other, &err), &err);
    err.message[0] = 0;
    st = mt_trainer_load(t, dir, -1, NULL, NULL, &err);
    mt_trainer_free(t);
    mt_remove_tree(dir);
    EXPECT(st == MT_ERR_CONFIG, "status %d", (int)st);
    EXPECT(strstr(err.message, "--hidden-size 128 but this run has 256") != NULL, "message: %s", err.message);
    /* same shape, other flavour: an RMSNorm model refuses a LayerNorm checkpoint, naming the flag */
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    st = mt_trainer_save(t, dir, 7, 56, &err);
    mt_trainer_free(t);
    EXPECT_OK(st, &err);
    other = test_config(TEST_GPT2, MT_BF16);
    other.normalization = MT_NORM_RMSNORM;
    EXPECT_OK(mt_config_finalize(&other, &err), &err);
    EXPECT_OK(mt_trainer_create(&t, &other, &err), &err);
    st = mt_trainer_load(t, dir, -1, NULL, NULL, &err);
    mt_trainer_free(t);
    mt_remove_tree(dir);
    EXPECT(st == MT_ERR_CONFIG && strstr(err.message, "--normalization") != NULL, "status %d, message: %s", (int)st,
           err.message);
    return TEST_PASS;
}

static const test_case checkpoint_gpu_tests[] = {
    {"determinism_and_resume_bf16", test_determinism_and_resume_bf16},
    {"determinism_and_resume_fp32", test_determinism_and_resume_fp32},
    {"determinism_and_resume_llama_bf16", test_determinism_and_resume_llama_bf16},
    {"determinism_and_resume_fp8_delayed_hybrid", test_determinism_and_resume_fp8_delayed},
    {"determinism_and_resume_fp8_tensorwise_llama", test_determinism_and_resume_fp8_tensorwise_llama},
    {"determinism_and_resume_fp8_blockwise", test_determinism_and_resume_fp8_blockwise},
    {"checkpoint_refuses_other_shape", test_checkpoint_refuses_other_shape},
};

#endif
