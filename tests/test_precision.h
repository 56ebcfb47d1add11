/* tests/test_precision.h — mixed precision: fp16's dynamic loss scaler (GPU test; skips when no GPU
 * is visible). bf16 and fp32 numerics are checked against the reference in tests/test_model.h. */
#ifndef MT_TEST_PRECISION_H
#define MT_TEST_PRECISION_H

/* fp16 with Megatron's initial scale 2^32 overflows at first: those steps are skipped (weights
 * untouched, scheduler not advanced) and the scale backs off per the hysteresis rule until steps
 * go through. */
static test_result test_fp16_loss_scaler(void) {
    REQUIRE_GPU();
    mt_config c = test_config(TEST_GPT2, MT_FP16);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    int64_t n = mt_num_parameters(&c), per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    float* before = (float*)malloc(sizeof(float) * n);
    float* after = (float*)malloc(sizeof(float) * n);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
    double scale = c.initial_loss_scale, first_loss = 0, last_loss = 0;
    int hysteresis = c.hysteresis, skipped = 0, taken = 0;
    test_result res = TEST_PASS;
    for (int k = 0; k < 40 && res == TEST_PASS; k++) {
        fill_tokens(tokens, per_step, (int)c.vocab_size, 1000 + (taken % 20));
        mt_step_result r;
        mt_trainer_get_parameters(t, before, &err);
        if (mt_trainer_train_step(t, tokens, &r, &err) != MT_OK) { printf("    FAIL %s\n", err.message); res = TEST_FAIL; break; }
        mt_trainer_get_parameters(t, after, &err);
        if (r.loss_scale != scale) { printf("    FAIL step %d scale %g, expected %g\n", k, r.loss_scale, scale); res = TEST_FAIL; }
        if (r.skipped) {
            skipped++;
            if (memcmp(before, after, sizeof(float) * n) != 0) { printf("    FAIL skipped step %d changed weights\n", k); res = TEST_FAIL; }
            if (--hysteresis <= 0) scale = scale * 0.5 < 1 ? 1 : scale * 0.5;
        } else {
            if (taken == 0) first_loss = r.lm_loss;
            last_loss = r.lm_loss;
            taken++;
            /* Megatron's warmup starts at lr 0: that first step moves nothing, later ones must */
            if (r.learning_rate > 0 && memcmp(before, after, sizeof(float) * n) == 0) { printf("    FAIL step %d changed nothing\n", k); res = TEST_FAIL; }
        }
    }
    printf("      %d skipped, %d taken, final scale %g, loss %.4f -> %.4f\n", skipped, taken, scale, first_loss, last_loss);
    if (res == TEST_PASS && (skipped == 0 || taken < 10)) { printf("    FAIL expected early skips then progress\n"); res = TEST_FAIL; }
    if (res == TEST_PASS && !(last_loss < first_loss)) { printf("    FAIL loss did not fall\n"); res = TEST_FAIL; }
    free(before);
    free(after);
    free(tokens);
    mt_trainer_free(t);
    return res;
}

static const test_case precision_gpu_tests[] = {
    {"fp16_loss_scaler", test_fp16_loss_scaler},
};

#endif
