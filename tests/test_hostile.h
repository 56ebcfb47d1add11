/* tests/test_hostile.h — hostile input (host tests): flag values that lie about their size or range.
 * mt_config_finalize with size products that overflow int or int64; ./train_gpt and
 * prepro/dataset_info run as subprocesses with hostile flags, which must exit non-zero with exactly
 * one line on stderr naming the flag. The subprocess tests skip when the binaries are not built
 * (`make test` builds test_megatron only; `make all` builds them). */
#ifndef MT_TEST_HOSTILE_H
#define MT_TEST_HOSTILE_H

#include <sys/wait.h>
#include <unistd.h>

/* ---- mt_config_finalize with size products that overflow ---------------------------------------- */

static mt_config hostile_base(void) { return small_test_config(); }

static test_result test_hostile_overflow_helpers(void) {
    int64_t r = 7;
    EXPECT(!mt_mul_overflows_i64(3037000499LL, 3037000499LL, &r) && r == 9223372030926249001LL, "sqrt(max)^2");
    EXPECT(mt_mul_overflows_i64(3037000500LL, 3037000500LL, &r), "just over");
    EXPECT(mt_mul_overflows_i64(INT64_MAX, 2, &r) && mt_mul_overflows_i64(-2, INT64_MAX, &r), "x2");
    EXPECT(mt_mul_overflows_i64(INT64_MIN, -1, &r), "min x -1");
    EXPECT(!mt_mul_overflows_i64(INT64_MIN, 1, &r) && r == INT64_MIN, "min x 1");
    EXPECT(!mt_mul_overflows_i64(0, INT64_MAX, &r) && r == 0, "zero");
    EXPECT(mt_add_overflows_i64(INT64_MAX, 1, &r) && mt_add_overflows_i64(INT64_MIN, -1, &r), "add");
    EXPECT(!mt_add_overflows_i64(INT64_MAX - 1, 1, &r) && r == INT64_MAX, "add max");
    return TEST_PASS;
}

static test_result test_hostile_config_size_products(void) {
    struct { const char* what; const char* needle; } cases[] = {
        {"4 x hidden wraps int", "--hidden-size 777777768: the derived --ffn-hidden-size 3111111072 exceeds"},
        {"swiglu 2/3 x 4 x hidden", "the derived --ffn-hidden-size"},
        {"padding a huge vocabulary", "--vocab-size"},
        {"padded vocabulary x hidden", "the padded vocabulary"},
        {"parameter count", "parameter count overflows"},
        {"train samples", "--train-iters 4611686018427387904 x --global-batch-size 8 samples overflows"},
        {"train tokens", "--seq-length 32 tokens overflows"},
        {"decay samples", "--lr-decay-iters"},
        {"tp x pp wraps to 0", "exceeds the world size"},
        {"micro x dp", "--micro-batch-size 1073741824 x data-parallel size 4"},
        {"qkv width", "the QKV width"},
        {"attention scores", "attention scores"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = hostile_base();
        switch (i) {
            case 0: c.hidden_size = 777777768; c.num_attention_heads = 8; c.ffn_hidden_size = 0; break;
            case 1: c.hidden_size = 805306368; c.num_attention_heads = 8; c.ffn_hidden_size = 0; c.swiglu = 1; break;
            case 2: c.vocab_size = INT64_MAX - 5; break;
            case 3: c.vocab_size = (int64_t)1 << 40; c.hidden_size = 1 << 24; c.ffn_hidden_size = 64; break;
            case 4: c.num_layers = INT32_MAX; c.hidden_size = 65536; c.ffn_hidden_size = 262144; break;
            case 5: c.train_iters = (int64_t)1 << 62; break;
            case 6: c.train_iters = (int64_t)1 << 58; break;
            case 7: c.lr_decay_iters = (int64_t)1 << 62; break;
            case 8: c.tensor_model_parallel_size = 65536; c.pipeline_model_parallel_size = 65536; break;
            case 9: c.world_size = 4; c.micro_batch_size = 1 << 30; c.global_batch_size = 0; break;
            case 10: c.num_attention_heads = 1 << 30; c.num_query_groups = 1 << 30; c.kv_channels = 4; break;
            case 11: c.micro_batch_size = 1 << 20; c.seq_length = 1 << 20; c.max_position_embeddings = 1 << 20;
                     c.num_attention_heads = 1 << 10; c.hidden_size = 1 << 10; c.ffn_hidden_size = 64;
                     c.global_batch_size = 1 << 20; break;
        }
        mt_error err;
        err.message[0] = 0;
        mt_status st = mt_config_finalize(&c, &err);
        EXPECT(st == MT_ERR_CONFIG, "%s: status %d", cases[i].what, (int)st);
        EXPECT(strstr(err.message, cases[i].needle) != NULL, "%s: message '%s'", cases[i].what, err.message);
        EXPECT(strchr(err.message, '\n') == NULL, "%s: one line", cases[i].what);
    }
    /* the largest values that fit still pass */
    mt_config c = hostile_base();
    c.train_iters = INT64_MAX / 8 / 33;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    /* 4h = 2147483392 fits int: the derivation passes, the parameter count (~5.7e18) is refused */
    c = hostile_base();
    c.hidden_size = 536870848;
    c.num_attention_heads = 8;
    err.message[0] = 0;
    EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG, "a 5.7e18-parameter model");
    EXPECT(c.ffn_hidden_size == 2147483392, "ffn %d", c.ffn_hidden_size);
    EXPECT(strstr(err.message, "parameter count overflows") != NULL, "message '%s'", err.message);
    return TEST_PASS;
}

/* The C API refuses what train_gpt's flags refuse: a NaN passes every `x < 0` test, so each double is
 * checked finite first, then against its range. */
static test_result test_hostile_config_doubles(void) {
    struct { const char* what; int field; double v; const char* needle; } cases[] = {
        {"nan lr", 0, NAN, "--lr nan: must be a finite number"},
        {"inf lr", 0, INFINITY, "--lr inf: must be a finite number"},
        {"nan beta1", 1, NAN, "--adam-beta1 nan: must be a finite number"},
        {"zero eps", 2, 0.0, "--adam-eps 0: must be > 0"},
        {"negative eps", 2, -1e-8, "--adam-eps -1e-08: must be > 0"},
        {"negative weight decay", 3, -0.5, "--weight-decay -0.5: must be >= 0"},
        {"negative clip", 4, -1.0, "--clip-grad -1: must be >= 0"},
        {"negative dropout", 5, -0.5, "must be in [0, 1)"},
        {"nan clip", 4, NAN, "--clip-grad nan: must be a finite number"},
        {"negative std", 6, -0.02, "--init-method-std -0.02: must be >= 0"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_config c = hostile_base();
        double v = cases[i].v;
        switch (cases[i].field) {
            case 0: c.lr = v; break;
            case 1: c.adam_beta1 = v; break;
            case 2: c.adam_eps = v; break;
            case 3: c.weight_decay = v; break;
            case 4: c.clip_grad = v; break;
            case 5: c.hidden_dropout = v; break;
            case 6: c.init_method_std = v; break;
        }
        mt_error err;
        err.message[0] = 0;
        mt_status st = mt_config_finalize(&c, &err);
        EXPECT(st == MT_ERR_CONFIG, "%s: status %d", cases[i].what, (int)st);
        EXPECT(strstr(err.message, cases[i].needle) != NULL, "%s: message '%s'", cases[i].what, err.message);
    }
    return TEST_PASS;
}

/* ---- the binaries as subprocesses ------------------------------------------------------------- */

/* Runs `cmd` with stderr captured (stdout dropped); returns the exit status (-1: did not exit). */
static int hostile_run(const char* cmd, char* err_out, size_t cap) {
    char full[2048];
    snprintf(full, sizeof(full), "%s 2>&1 >/dev/null", cmd);
    return test_command_output(full, err_out, cap);
}

/* exit status != 0 and exactly one line on stderr, containing `needle` */
static int hostile_expect_refused(const char* cmd, const char* needle) {
    char out[8192];
    int code = hostile_run(cmd, out, sizeof(out));
    size_t len = strlen(out);
    const char* nl = strchr(out, '\n');
    int one_line = len > 0 && nl == out + len - 1;
    if (code != 0 && one_line && strstr(out, needle)) return 1;
    printf("    %s\n      exit %d, want the one line '...%s...', got: %s%s", cmd, code, needle, out,
           len && out[len - 1] == '\n' ? "" : "\n");
    return 0;
}

static test_result test_hostile_train_gpt_flags(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP("./train_gpt is not built (make all)");
    /* the tail that reaches mt_config_finalize without files or a GPU: mock data, NullTokenizer */
    const char* mock = "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-attention-heads 8 "
                       "--seq-length 16 --micro-batch-size 1 --train-iters 1 --lr 1e-3 --num-layers 2";
    struct { const char* args; const char* needle; } cases[] = {
        {"--num-layers 4294967297", "--num-layers 4294967297: must be between 1 and 2147483647"},
        {"--num-layers=4294967297", "--num-layers 4294967297: must be between 1 and 2147483647"},
        {"--global-batch-size 2147483648", "--global-batch-size 2147483648: must be between 1 and 2147483647"},
        {"--hidden-size -5", "--hidden-size -5: must be between 1 and 2147483647"},
        {"--train-iters 99999999999999999999", "--train-iters 99999999999999999999: must be between 1 and "
                                               "9223372036854775807"},
        {"--seq-length abc", "--seq-length abc: not an integer"},
        {"--seq-length 12x", "--seq-length 12x: not an integer"},
        {"--adam-beta1 -0.5", "--adam-beta1 -0.5: must be in [0, 1)"},
        {"--adam-beta2 1", "--adam-beta2 1: must be in [0, 1)"},
        {"--adam-eps 0", "--adam-eps 0: must be > 0"},
        {"--weight-decay -0.5", "--weight-decay -0.5: must be >= 0"},
        {"--hidden-dropout -0.5", "--hidden-dropout -0.5: must be in [0, 1)"},
        {"--attention-dropout 1.5", "--attention-dropout 1.5: must be in [0, 1)"},
        {"--clip-grad -1", "--clip-grad -1: must be >= 0"},
        {"--lr -1", "--lr -1: must be >= 0"},
        {"--lr nan", "--lr nan: must be a finite number"},
        {"--lr inf", "--lr inf: must be a finite number"},
        {"--lr=-inf", "--lr -inf: must be a finite number"},
        {"--min-lr 1e999", "--min-lr 1e999: must be a finite number"},
        {"--init-method-std NaN", "--init-method-std NaN: must be a finite number"},
        {"--lr-warmup-fraction 2", "--lr-warmup-fraction 2: must be in [0, 1]"},
        {"--fp8-margin -1", "--fp8-margin -1: must be between 0 and 30"},
        {"--seed -1", "--seed -1: must be between 0 and 4294967295"},
        {"--seed 4294967297", "--seed 4294967297: must be between 0 and 4294967295"}, /* was seed 1 for the data */
        {"--bf16=1", "--bf16 takes no value"},
        {"--lr", "--lr needs a value"},
        {"--hidden-size 777777768", "--hidden-size 777777768: the derived --ffn-hidden-size 3111111072 exceeds"},
        {"--hidden-size 64 --vocab-size 9223372036854775800", "is too large to pad"},
        {"--hidden-size 64 --train-iters 4611686018427387904 --global-batch-size 8",
         "--train-iters 4611686018427387904 x --global-batch-size 8 samples overflows"},
        {"--hidden-size 64 --eval-iters 4611686018427387904 --eval-interval 1", "--eval-iters 4611686018427387904"},
    };
    int ok = 1;
    char cmd[1024];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(cmd, sizeof(cmd), "./train_gpt %s %s", mock, cases[i].args); /* later flags win */
        ok &= hostile_expect_refused(cmd, cases[i].needle);
    }
    /* --flag=value is accepted where argparse accepts it: parsed, then --help exits 0 */
    char out[8192];
    int code = hostile_run("./train_gpt --num-layers=2 --lr=1e-3 --data-path=x --help", out, sizeof(out));
    EXPECT(code == 0, "--flag=value then --help: exit %d, stderr %s", code, out);
    EXPECT(ok, "a hostile flag was not refused with one clear line");
    return TEST_PASS;
}

static test_result test_hostile_dataset_info_flags(void) {
    if (access("prepro/dataset_info", X_OK) != 0) SKIP("prepro/dataset_info is not built (make all)");
    /* a tiny dataset, so the sample-count checks behind the dataset open are reached */
    char prefix[] = "/tmp/mt_hostile_XXXXXX";
    int fd = mkstemp(prefix);
    if (fd < 0) SKIP("no temporary file");
    close(fd);
    unlink(prefix);
    mt_error err;
    mt_indexed_writer* w = NULL;
    EXPECT_OK(mt_indexed_writer_open(&w, prefix, mt_indexed_dtype_for_vocab(1000), &err), &err);
    int32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = i;
    int64_t len = 64;
    EXPECT_OK(mt_indexed_writer_add_document(w, tokens, &len, 1, &err), &err);
    EXPECT_OK(mt_indexed_writer_finalize(w, &err), &err);
    struct { const char* args; const char* needle; } cases[] = {
        {"--seq-length abc", "--seq-length abc: not an integer"},
        {"--seq-length 0", "--seq-length 0: must be between 1 and 2147483647"},
        {"--seq-length 4294967297", "--seq-length 4294967297: must be between 1 and 2147483647"},
        {"--seq-length 8 --seed -1", "--seed -1: must be between 0 and 4294967295"},
        {"--seq-length 8 --samples 3x", "--samples 3x: not an integer"},
        {"--seq-length 8 --num-samples 99999999999999999999", "--num-samples 99999999999999999999: must be between"},
        {"--seq-length 8 --train-iters 1e3 --global-batch-size 4", "--train-iters 1e3: not an integer"},
        {"--seq-length 8 --train-iters 10 --global-batch-size -4", "--global-batch-size -4: must be between 1 and"},
        {"--seq-length 8 --train-iters 4611686018427387904 --global-batch-size 4",
         "--train-iters x --global-batch-size samples overflows"},
        {"--seq-length 8 --train-iters 10 --global-batch-size 4 --eval-iters 4611686018427387904",
         "the validation samples"},
    };
    int ok = 1;
    char cmd[1024];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(cmd, sizeof(cmd), "prepro/dataset_info --data-path %s %s", prefix, cases[i].args);
        ok &= hostile_expect_refused(cmd, cases[i].needle);
    }
    char path[64];
    snprintf(path, sizeof(path), "%s.bin", prefix);
    unlink(path);
    snprintf(path, sizeof(path), "%s.idx", prefix);
    unlink(path);
    EXPECT(ok, "a hostile flag was not refused with one clear line");
    return TEST_PASS;
}

static test_result test_hostile_convert_hf_flags(void) {
    if (access("prepro/convert_hf", X_OK) != 0) SKIP("prepro/convert_hf is not built (make all)");
    int ok = 1;
    /* strtoll saturates at LLONG_MAX with ERANGE: that is not the iteration the user asked for */
    ok &= hostile_expect_refused("prepro/convert_hf --iteration 99999999999999999999",
                                 "--iteration needs a non-negative integer, not 99999999999999999999");
    ok &= hostile_expect_refused("prepro/convert_hf --vocab-size 99999999999999999999",
                                 "--vocab-size needs a positive integer, not 99999999999999999999");
    ok &= hostile_expect_refused("prepro/convert_hf --norm-epsilon nan", "--norm-epsilon needs a number in (0, 1)");
    EXPECT(ok, "a hostile flag was not refused with one clear line");
    return TEST_PASS;
}

static const test_case hostile_tests[] = {
    {"hostile_overflow_helpers", test_hostile_overflow_helpers},
    {"hostile_config_size_products", test_hostile_config_size_products},
    {"hostile_config_doubles", test_hostile_config_doubles},
    {"hostile_train_gpt_flags", test_hostile_train_gpt_flags},
    {"hostile_dataset_info_flags", test_hostile_dataset_info_flags},
    {"hostile_convert_hf_flags", test_hostile_convert_hf_flags},
};

#endif
