/* tests/test_config.h — the configuration (host tests): what mt_config_finalize derives and what it
 * refuses, Megatron's rank layout over TP, DP and PP, the learning-rate schedules and Megatron's
 * FLOP formula. Pure functions: these run everywhere, CI included. */
#ifndef MT_TEST_CONFIG_H
#define MT_TEST_CONFIG_H


static test_result test_config_derives_megatron_values(void) {
    mt_config c = small_test_config();
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.ffn_hidden_size == 256, "ffn %d", c.ffn_hidden_size);
    EXPECT(c.kv_channels == 16, "kv %d", c.kv_channels);
    EXPECT(c.num_query_groups == 4, "groups %d", c.num_query_groups);
    EXPECT(c.padded_vocab_size == 512, "padded %lld", (long long)c.padded_vocab_size);
    EXPECT(c.max_position_embeddings == 32, "positions %d", c.max_position_embeddings);
    EXPECT(mt_num_micro_batches(&c) == 4, "micro batches %d", mt_num_micro_batches(&c));
    EXPECT(c.lr_decay_iters == 100, "decay iters %lld", (long long)c.lr_decay_iters);
    /* Megatron's padding examples: GPT-2 50257 -> 50304 at TP=1, 50688 at TP=4 (multiple of 512) */
    EXPECT(mt_padded_vocab_size(50257, 128, 1) == 50304, "tp1");
    EXPECT(mt_padded_vocab_size(50257, 128, 4) == 50688, "tp4 %lld", (long long)mt_padded_vocab_size(50257, 128, 4));
    EXPECT(mt_padded_vocab_size(128256, 128, 1) == 128256, "llama3");
    return TEST_PASS;
}

/* A resume keeps the checkpoint's padded vocabulary where it covers the vocabulary and divides by the
 * new TP (the model and its loss curve continue), and pads as Megatron does only where it must. */
static test_result test_config_resume_keeps_padding(void) {
    EXPECT(mt_padded_vocab_size_resumed(50257, 512, 2, 50688) == 50688, "50688 saved at TP=1 kept at TP=2");
    EXPECT(mt_padded_vocab_size_resumed(50257, 512, 4, 50688) == 50688, "kept at TP=4");
    EXPECT(mt_padded_vocab_size_resumed(50257, 512, 1, 51200) == 51200, "51200 saved at TP=2 kept at TP=1");
    EXPECT(mt_padded_vocab_size_resumed(50257, 128, 8, 50260) == 51200, "50260 / 8 is not whole: re-padded to 51200");
    EXPECT(mt_padded_vocab_size_resumed(1101, 1, 2, 1101) == 1102, "odd padding re-padded at TP=2");
    EXPECT(mt_padded_vocab_size_resumed(60000, 128, 1, 50304) == 60032, "a saved padding below the vocabulary is not kept");
    EXPECT(mt_padded_vocab_size_resumed(50257, 128, 2, 0) == 50432, "no checkpoint: Megatron's padding");
    mt_config c = small_test_config(); /* vocabulary 500: 512 at TP=1 */
    c.resumed_padded_vocab_size = 640;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.padded_vocab_size == 640, "finalize keeps the resumed padding: %lld", (long long)c.padded_vocab_size);
    c = small_test_config();
    c.resumed_padded_vocab_size = -1;
    EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG, "a negative resumed padding is refused");
    return TEST_PASS;
}

static test_result test_config_rejects_inconsistent(void) {
    struct { const char* what; int field; int value; const char* needle; } cases[] = {
        {"heads", 0, 5, "divisible by --num-attention-heads"},
        {"global batch", 1, 7, "--global-batch-size"},
        {"dropout", 2, 1, "--hidden-dropout 1 and --attention-dropout 0 must be in [0, 1)"},
        {"seq > positions", 3, 64, "--max-position-embeddings"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = small_test_config();
        if (cases[i].field == 0) c.num_attention_heads = cases[i].value;
        if (cases[i].field == 1) c.global_batch_size = cases[i].value;
        if (cases[i].field == 2) c.hidden_dropout = 1.0;
        if (cases[i].field == 3) { c.seq_length = cases[i].value; c.max_position_embeddings = 32; }
        mt_error err;
        err.message[0] = 0;
        mt_status st = mt_config_finalize(&c, &err);
        EXPECT(st == MT_ERR_CONFIG, "%s: status %d", cases[i].what, (int)st);
        EXPECT(strstr(err.message, cases[i].needle) != NULL, "%s: message '%s'", cases[i].what, err.message);
    }
    return TEST_PASS;
}

/* Megatron's rank layout: TP fastest, then DP, then PP; data_parallel_size derived from the world. */
static test_result test_rank_layout(void) {
    mt_config c = test_config_sized(2, 64, 4, 8, 100);
    test_config_parallel(&c, 2, 16, 0);
    c.pipeline_model_parallel_size = 2;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.data_parallel_size == 4, "dp %d", c.data_parallel_size);
    for (int r = 0; r < 16; r++) {
        mt_rank_coords x = mt_rank_coordinates(&c, r);
        /* Megatron: rank = tp + TP * (dp + DP * pp) */
        EXPECT(x.tp == r % 2 && x.dp == (r / 2) % 4 && x.pp == r / 8, "rank %d -> tp %d dp %d pp %d", r, x.tp, x.dp, x.pp);
        EXPECT(mt_rank_of(&c, x) == r, "round trip of rank %d", r);
    }
    return TEST_PASS;
}

static int close_to(double a, double b, double tol) { return fabs(a - b) <= tol * (fabs(b) > 1 ? fabs(b) : 1); }

/* Values worked out by hand from Megatron's OptimizerParamScheduler (lengths in samples). */
static test_result test_learning_rate_schedules(void) {
    mt_config c = small_test_config(); /* gbs 8, train 100 iters */
    c.lr = 1.0;
    c.min_lr = 0.1;
    c.lr_warmup_iters = 10;
    mt_error err;
    c.lr_decay_style = MT_LR_COSINE;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(close_to(mt_learning_rate(&c, 0), 0.0, 1e-12), "warmup starts at 0");
    EXPECT(close_to(mt_learning_rate(&c, 40), 0.5, 1e-12), "half warmup");
    EXPECT(close_to(mt_learning_rate(&c, 80), 1.0, 1e-12), "end of warmup");
    /* halfway through decay: ratio 0.5 -> 0.1 + 0.9 * 0.5 */
    EXPECT(close_to(mt_learning_rate(&c, 80 + 360), 0.55, 1e-12), "cosine middle %.17g", mt_learning_rate(&c, 440));
    EXPECT(close_to(mt_learning_rate(&c, 800), 0.1, 1e-12), "end of decay");
    EXPECT(close_to(mt_learning_rate(&c, 10000), 0.1, 1e-12), "after decay");
    c.lr_decay_style = MT_LR_LINEAR;
    EXPECT(close_to(mt_learning_rate(&c, 80 + 180), 0.1 + 0.9 * 0.75, 1e-12), "linear quarter");
    c.lr_decay_style = MT_LR_CONSTANT;
    EXPECT(close_to(mt_learning_rate(&c, 500), 1.0, 1e-12), "constant");
    c.lr_decay_style = MT_LR_INVERSE_SQUARE_ROOT;
    EXPECT(close_to(mt_learning_rate(&c, 320), sqrt(80.0) / sqrt(320.0), 1e-12), "inverse sqrt");
    c.lr_decay_style = MT_LR_WSD;
    c.lr_wsd_decay_iters = 20; /* anneal over the last 160 samples: 640..800 */
    c.lr_wsd_decay_style = MT_WSD_LINEAR;
    EXPECT(close_to(mt_learning_rate(&c, 600), 1.0, 1e-12), "wsd stable");
    EXPECT(close_to(mt_learning_rate(&c, 720), 0.55, 1e-12), "wsd anneal middle %.17g", mt_learning_rate(&c, 720));
    c.lr_decay_style = MT_LR_COSINE;
    c.lr_warmup_iters = 0;
    c.lr_warmup_fraction = 0.25; /* of 800 decay samples -> 200 */
    EXPECT(close_to(mt_learning_rate(&c, 100), 0.5, 1e-12), "warmup fraction");
    return TEST_PASS;
}

static test_result test_flops_formula(void) {
    /* GPT-2 124M shape: the formula reduces to B*s*(72 L h^2 + 6 s h L + 6 h V) */
    mt_config c = test_config_sized(12, 768, 12, 1024, 50257);
    test_config_batch(&c, 8, 0);
    c.lr = 1e-4;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    double B = 8, s = 1024, L = 12, h = 768, V = 50304;
    double expected = B * s * (72 * L * h * h + 6 * s * h * L + 6 * h * V);
    double got = mt_flops_per_iteration(&c, 8);
    EXPECT(fabs(got - expected) / expected < 1e-12, "flops %.6e vs %.6e", got, expected);
    /* parameters: 124M GPT-2 with padded vocab and 1024 positions = 124,475,904 */
    EXPECT(mt_num_parameters(&c) == 124475904LL, "params %lld", (long long)mt_num_parameters(&c));
    return TEST_PASS;
}

/* FP8 flags: the combinations and shapes Megatron (and Hopper's FP8 GEMMs) refuse, each with one
 * line naming the problem; the layers that stay bf16; and the delayed-scaling rule itself. */
static test_result test_config_fp8(void) {
    struct { const char* what; int field; int value; const char* needle; } cases[] = {
        {"fp16", 0, 0, "--bf16"},
        {"fp32", 1, 0, "--bf16"},
        {"delayed + first/last bf16", 2, 0, "--first-last-layers-bf16"},
        {"margin", 3, -1, "--fp8-margin"},
        {"history", 4, 0, "--fp8-amax-history-len"},
        {"hidden not a multiple of 16", 5, 72, "multiple of 16"},
        {"tokens not a multiple of 16", 6, 0, "tokens of a micro-batch"},
        {"blockwise needs 128", 7, 0, "multiple of 128"},
        {"too many bf16 layers", 8, 0, "--num-layers-at-start-in-bf16"},
        {"param gather without the distributed optimizer", 9, 0, "--use-distributed-optimizer"},
        {"param gather with blockwise", 10, 0, "--fp8-param-gather with --fp8-recipe blockwise"},
        {"param gather with optimizer offload", 11, 0, "--fp8-param-gather with --optimizer-cpu-offload"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = small_test_config();
        c.precision = MT_BF16;
        c.fp8_format = MT_FP8_HYBRID;
        switch (cases[i].field) {
            case 0: c.precision = MT_FP16; break;
            case 1: c.precision = MT_FP32; break;
            case 2: c.first_last_layers_bf16 = 1; break;
            case 3: c.fp8_margin = cases[i].value; break;
            case 4: c.fp8_amax_history_len = cases[i].value; break;
            case 5: c.hidden_size = cases[i].value; c.num_attention_heads = 4; break;
            case 6: c.seq_length = 30; c.micro_batch_size = 1; c.max_position_embeddings = 32; break;
            case 7: c.fp8_recipe = MT_FP8_BLOCKWISE; break;
            case 8: c.fp8_recipe = MT_FP8_TENSORWISE; c.first_last_layers_bf16 = 1;
                    c.num_layers_at_start_in_bf16 = 2; c.num_layers_at_end_in_bf16 = 1; break;
            case 9: c.fp8_param_gather = 1; break;
            case 10: c.fp8_param_gather = 1; c.use_distributed_optimizer = 1; c.fp8_recipe = MT_FP8_BLOCKWISE; break;
            case 11: c.fp8_param_gather = 1; c.use_distributed_optimizer = 1; c.optimizer_cpu_offload = 1; break;
        }
        mt_error err;
        err.message[0] = 0;
        mt_status st = mt_config_finalize(&c, &err);
        EXPECT(st == MT_ERR_CONFIG, "%s: status %d", cases[i].what, (int)st);
        EXPECT(strstr(err.message, cases[i].needle) != NULL, "%s: message '%s'", cases[i].what, err.message);
    }
    /* accepted: hybrid, tensorwise, the first and last layer in bf16 */
    mt_config c = small_test_config();
    c.precision = MT_BF16;
    c.num_layers = 4;
    c.fp8_format = MT_FP8_HYBRID;
    c.fp8_recipe = MT_FP8_TENSORWISE;
    c.first_last_layers_bf16 = 1;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(!mt_fp8_layer(&c, 0) && mt_fp8_layer(&c, 1) && mt_fp8_layer(&c, 2) && !mt_fp8_layer(&c, 3), "bf16 layers");
    c.first_last_layers_bf16 = 0;
    EXPECT(mt_fp8_layer(&c, 0) && mt_fp8_layer(&c, 3), "all FP8");
    c.fp8_format = MT_FP8_NONE;
    EXPECT(!mt_fp8_layer(&c, 1), "no FP8");

    /* delayed scaling: 448 / amax / 2^margin from the newest entry or the history's max; the old
     * scale when that amax is 0, inf or NaN */
    float h[4] = {2.0f, 7.0f, 0.5f, 3.5f};
    EXPECT(mt_fp8_delayed_scale(h, 4, 3, MT_FP8_AMAX_MOST_RECENT, 448.0f, 0, 9.0f) == 448.0f / 3.5f, "most recent");
    EXPECT(mt_fp8_delayed_scale(h, 4, 3, MT_FP8_AMAX_MAX, 448.0f, 0, 9.0f) == 448.0f / 7.0f, "max");
    EXPECT(mt_fp8_delayed_scale(h, 4, 0, MT_FP8_AMAX_MAX, 57344.0f, 2, 9.0f) == 57344.0f / 7.0f / 4.0f, "margin");
    float z[2] = {0.0f, 0.0f};
    EXPECT(mt_fp8_delayed_scale(z, 2, 1, MT_FP8_AMAX_MAX, 448.0f, 0, 9.0f) == 9.0f, "zero amax keeps the scale");
    float n[2] = {1.0f, NAN};
    EXPECT(mt_fp8_delayed_scale(n, 2, 1, MT_FP8_AMAX_MOST_RECENT, 448.0f, 0, 9.0f) == 9.0f, "nan keeps the scale");
    float inf[1] = {INFINITY};
    EXPECT(mt_fp8_delayed_scale(inf, 1, 0, MT_FP8_AMAX_MOST_RECENT, 448.0f, 0, 9.0f) == 9.0f, "inf keeps the scale");
    return TEST_PASS;
}

/* mt_config_check_supported is the one list of what this build lacks: each rule refuses its
 * combination with one line, mt_config_finalize refuses it with that same line, and so does
 * mt_trainer_create on a config finalized without the check (it asks before touching a GPU, so this
 * runs anywhere); the planner (--plan-layouts) asks the same function (tests/test_memory.h). A
 * config with none of them passes all three. */
static test_result test_config_check_supported(void) {
    struct { const char* what; const char* needle; } cases[] = {
        {"FP8 in fp16", "FP8 training needs --bf16 (FP8 with --fp16 is not supported)"},
        {"FP8 in fp32", "FP8 training needs --bf16 (FP8 with fp32 is not supported)"},
        {"FP8 with a hidden size off 16", "FP8 GEMMs need --hidden-size (72) to be a multiple of 16"},
        {"FP8 blockwise with a width off 128", "to be a multiple of 128"},
        {"--fp8-param-gather blockwise", "--fp8-param-gather with --fp8-recipe blockwise is not built"},
        {"--fp8-param-gather with offload", "--fp8-param-gather with --optimizer-cpu-offload is not built"},
        {"uneven split with virtual stages", "--decoder-first/last-pipeline-num-layers with virtual pipeline stages is "
                                             "not built"},
        {"micro-batch group above PP", "--microbatch-group-size-per-virtual-pipeline-stage 4 > PP 2 is not built"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = small_test_config();
        c.num_layers = 8;
        c.precision = MT_BF16;
        switch (i) {
            case 0: c.fp8_format = MT_FP8_E4M3; c.precision = MT_FP16; break;
            case 1: c.fp8_format = MT_FP8_E4M3; c.precision = MT_FP32; break;
            case 2: c.fp8_format = MT_FP8_HYBRID; c.hidden_size = 72; c.num_attention_heads = 4; break;
            case 3: c.fp8_format = MT_FP8_HYBRID; c.fp8_recipe = MT_FP8_BLOCKWISE; break;
            case 4: c.fp8_format = MT_FP8_HYBRID; c.hidden_size = 128; c.fp8_recipe = MT_FP8_BLOCKWISE;
                    c.micro_batch_size = 4; c.global_batch_size = 8; c.fp8_param_gather = 1;
                    c.use_distributed_optimizer = 1; c.ffn_hidden_size = 512; break;
            case 5: c.fp8_format = MT_FP8_HYBRID; c.fp8_param_gather = 1; c.use_distributed_optimizer = 1;
                    c.optimizer_cpu_offload = 1; break;
            case 6: c.pipeline_model_parallel_size = 2; c.world_size = 2; c.virtual_pipeline_size = 2;
                    c.decoder_first_pipeline_num_layers = 2; break;
            case 7: c.pipeline_model_parallel_size = 2; c.world_size = 2; c.virtual_pipeline_size = 2;
                    c.microbatch_group_size_per_vp_stage = 4; break;
        }
        mt_config finalized = c, derived = c;
        mt_error direct, final_err, create_err;
        direct.message[0] = final_err.message[0] = create_err.message[0] = 0;
        /* the sizes derived, nothing refused for what is missing here: then the one function (an uneven
         * split with virtual stages has no layer split to derive: its derivation stops there, the sizes
         * the trainer looks at derived) */
        mt_status derived_st = mt__config_finalize(&derived, 0, &direct);
        EXPECT(derived_st == MT_OK || i == 6, "%s: not a consistent config: %s", cases[i].what, direct.message);
        EXPECT(mt_config_check_supported(&derived, &direct) == MT_ERR_CONFIG, "%s: accepted", cases[i].what);
        EXPECT(strstr(direct.message, cases[i].needle) && !strchr(direct.message, '\n'), "%s: '%s'", cases[i].what,
               direct.message);
        EXPECT(mt_config_finalize(&finalized, &final_err) == MT_ERR_CONFIG && !strcmp(final_err.message, direct.message),
               "%s: mt_config_finalize says '%s'", cases[i].what, final_err.message);
        mt_trainer* t = NULL;
        derived.local_rank = -1;
        EXPECT(mt_trainer_create(&t, &derived, &create_err) == MT_ERR_CONFIG && !t &&
                   !strcmp(create_err.message, direct.message),
               "%s: mt_trainer_create says '%s'", cases[i].what, create_err.message);
        /* without the combination's ingredient the same config is supported */
        mt_config plain = c;
        plain.fp8_format = MT_FP8_NONE;
        plain.fp8_param_gather = 0;
        plain.virtual_pipeline_size = 1;
        mt_error ok;
        EXPECT(mt_config_finalize(&plain, &ok) == MT_OK && mt_config_check_supported(&plain, &ok) == MT_OK,
               "%s without FP8 or virtual stages: %s", cases[i].what, ok.message);
    }
    return TEST_PASS;
}

static const test_case config_tests[] = {
    {"config_derives_megatron_values", test_config_derives_megatron_values},
    {"config_rejects_inconsistent", test_config_rejects_inconsistent},
    {"config_resume_keeps_padding", test_config_resume_keeps_padding},
    {"rank_layout_tp_dp_pp", test_rank_layout},
    {"learning_rate_schedules", test_learning_rate_schedules},
    {"flops_formula", test_flops_formula},
    {"config_fp8_flags_and_delayed_scaling", test_config_fp8},
    {"config_check_supported_one_list", test_config_check_supported},
};

#endif
