/* tests/test_hostile.h — hostile input and faults.
 * Host: flag values that lie about their size or range (mt_config_finalize with size products that
 * overflow int or int64; ./train_gpt, prepro/dataset_info and prepro/convert_hf run as subprocesses
 * with hostile flags, which must exit non-zero with exactly one stderr line of their own, "<tool>:
 * ..." naming the flag (lines of OpenMPI or CUDA, which do not start with the tool's name, may come
 * too); these skip when the binaries are not built: `make all`). Files: a FIFO, directory or device where a
 * regular file is meant is refused with one line and never blocks (each case runs in a child that is
 * killed after 10 s); a crash at every step of a dataset commit (a child stops there and exits
 * without cleanup) leaves each dataset old or new, never refused nor a mixed pair, and the next
 * writer puts a moved-aside old pair back and removes what it left; the crash state made on disk,
 * then preprocess_data runs that fail (before and after opening their writer): the old dataset is
 * still found; a failed commit (and preprocess_data with a failing second key) restores every old
 * dataset; stale temporaries of dead processes go, others stay. preprocess_data as a subprocess:
 * SIGTERM/SIGINT end it within a second (a FIFO without a writer, an endless line, one long
 * document being encoded) leaving nothing; /dev/zero stops at --max-line-bytes with bounded memory. Sizes from files: every
 * checkpoint header word (targeted cases and 200k random headers), the tracker, 3000 random .idx
 * corruptions (refused in one line, or read within bounds), safetensors element count x size, GPT
 * sample counts; convert_hf's interrupted import does not block the retry.
 * GPU: a NaN loss stops train_step before the optimizer (--check-for-nan-in-loss-and-grad). */
#ifndef MT_TEST_HOSTILE_H
#define MT_TEST_HOSTILE_H

#include <sys/wait.h>
#include <unistd.h>

#include "../train_gpt_flags.h" /* the fault flags' rows, parsed in-process */

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

/* Exit status != 0 and exactly one stderr line of the program's own: it starts with the program's
 * name and a colon (the basename of cmd's first word: "train_gpt: ...") and contains `needle`.
 * Other stderr lines are allowed only when they do not start with the program's name: train_gpt
 * built with MPI runs as an MPI singleton, and OpenMPI (MPI_Abort's banner, transport warnings) or
 * CUDA may add lines of their own; the program itself must still say it in one line. */
static int hostile_expect_refused(const char* cmd, const char* needle) {
    char out[16384], prog[128];
    size_t word = strcspn(cmd, " "), start = 0;
    for (size_t i = 0; i < word; i++)
        if (cmd[i] == '/') start = i + 1;
    snprintf(prog, sizeof(prog), "%.*s", (int)(word - start), cmd + start);
    size_t prog_len = strlen(prog);
    int code = hostile_run(cmd, out, sizeof(out));
    int own_lines = 0, found = 0;
    for (const char* line = out; *line;) {
        const char* end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        if (n >= prog_len && !strncmp(line, prog, prog_len)) {
            own_lines++;
            char buf[4096];
            snprintf(buf, sizeof(buf), "%.*s", (int)n, line);
            found = buf[prog_len] == ':' && strstr(buf, needle) != NULL;
        }
        line += n + (end ? 1 : 0);
    }
    if (code != 0 && own_lines == 1 && found) return 1;
    size_t len = strlen(out);
    printf("    %s\n      exit %d, want one line '%s: ...%s...' (%d lines start with %s), got: %s%s", cmd, code, prog,
           needle, own_lines, prog, out, len && out[len - 1] == '\n' ? "" : "\n");
    return 0;
}

static test_result test_hostile_train_gpt_flags(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP_OR_FAIL_STRICT("./train_gpt is not built (make all)");
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
        {"--exit-signal-handler=1", "--exit-signal-handler takes no value"},
        {"--exit-duration-in-mins -1", "--exit-duration-in-mins -1: must be between 0 and 1000000000"},
        {"--exit-duration-in-mins 1e3", "--exit-duration-in-mins 1e3: not an integer"},
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
    int code = hostile_run("./train_gpt --num-layers=2 --lr=1e-3 --data-path=x --exit-signal-handler "
                           "--exit-duration-in-mins 30 --no-check-for-nan-in-loss-and-grad --help", out, sizeof(out));
    EXPECT(code == 0, "--flag=value then --help: exit %d, stderr %s", code, out);
    EXPECT(ok, "a hostile flag was not refused with one clear line");
    return TEST_PASS;
}

/* The fault flags land where train_gpt reads them: the NaN check on by default and off with
 * --no-check-for-nan-in-loss-and-grad; the exits as given (0 minutes: none, as Megatron's falsy 0). */
static test_result test_hostile_fault_flags_land(void) {
    static tg_flags v;
    char msg[512] = "";
    char* plain[] = {(char*)"train_gpt"};
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, 1, plain, msg, sizeof(msg)) == 0 && tg_flags_apply(&v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.check_for_nan_in_loss_and_grad == 1 && !v.exit_signal_handler && v.exit_interval < 0 &&
               v.exit_duration_in_mins < 0 && v.max_nan_in_a_row == 1,
           "defaults: nan check %d, handler %d, interval %lld, minutes %lld, nan in a row %lld",
           v.cfg.check_for_nan_in_loss_and_grad, v.exit_signal_handler, (long long)v.exit_interval,
           (long long)v.exit_duration_in_mins, (long long)v.max_nan_in_a_row);
    char* given[] = {(char*)"train_gpt", (char*)"--no-check-for-nan-in-loss-and-grad", (char*)"--exit-signal-handler",
                     (char*)"--exit-interval=5", (char*)"--exit-duration-in-mins", (char*)"0",
                     (char*)"--max-consecutive-nan-iterations", (char*)"3"};
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, 8, given, msg, sizeof(msg)) == 0 && tg_flags_apply(&v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.check_for_nan_in_loss_and_grad == 0 && v.exit_signal_handler == 1 && v.exit_interval == 5 &&
               v.exit_duration_in_mins == 0 && v.max_nan_in_a_row == 3,
           "given: nan check %d, handler %d, interval %lld, minutes %lld, nan in a row %lld",
           v.cfg.check_for_nan_in_loss_and_grad, v.exit_signal_handler, (long long)v.exit_interval,
           (long long)v.exit_duration_in_mins, (long long)v.max_nan_in_a_row);
    const char* bad[] = {"0", "-1", "1.5", "abc", "1000000001"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char* args[] = {(char*)"train_gpt", (char*)"--max-consecutive-nan-iterations", (char*)bad[i]};
        tg_flags_init(&v);
        msg[0] = 0;
        EXPECT(tg_flags_parse(&v, 3, args, msg, sizeof(msg)) != 0 && strstr(msg, "--max-consecutive-nan-iterations"),
               "--max-consecutive-nan-iterations %s was taken (%s)", bad[i], msg);
    }
    return TEST_PASS;
}

static test_result test_hostile_dataset_info_flags(void) {
    if (access("prepro/dataset_info", X_OK) != 0) SKIP_OR_FAIL_STRICT("prepro/dataset_info is not built (make all)");
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
         "--train-iters 4611686018427387904 x --global-batch-size 4 samples overflows"},
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
    if (access("prepro/convert_hf", X_OK) != 0) SKIP_OR_FAIL_STRICT("prepro/convert_hf is not built (make all)");
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

/* ---- files: scratch directories, children, dead processes ------------------------------------- */
/* (test_hf.h's thf_write_bytes, thf_write_raw, thf_small_config and thf_random_params are reused) */

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>

/* A fresh directory /tmp/mt_hostile_<pid>_<name>, emptied first. */
static void hostile_dir(char* out, size_t cap, const char* name) {
    snprintf(out, cap, "/tmp/mt_hostile_%d_%s", (int)getpid(), name);
    mt_remove_tree(out);
    mkdir(out, 0755);
}

/* The pid of a process that has exited (a child that ran and was reaped). */
static long hostile_dead_pid(void) {
    pid_t p = fork();
    if (p == 0) _exit(0);
    int status;
    waitpid(p, &status, 0);
    return (long)p;
}

/* Runs fn(arg) in a child (as a crash would: no cleanup at its exit) and returns its exit status, or
 * -1 when it ran past `seconds` (then it is killed): a test of "never blocks" cannot hang the suite. */
static int hostile_in_child(int (*fn)(void*), void* arg, int seconds) {
    fflush(stdout);
    pid_t p = fork();
    if (p < 0) return -2;
    if (p == 0) {
        int rc = fn(arg);
        fflush(stdout);
        _exit(rc);
    }
    int status = 0;
    for (int ms = 0; ms < seconds * 1000; ms += 10) {
        if (waitpid(p, &status, WNOHANG) == p) return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
        usleep(10000);
    }
    kill(p, SIGKILL);
    waitpid(p, &status, 0);
    return -1;
}

/* How many entries of dir have ".tmp." in their name. */
static int hostile_count_temporaries(const char* dir) {
    DIR* d = opendir(dir);
    int n = 0;
    struct dirent* e;
    while (d && (e = readdir(d)) != NULL) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

static uint64_t hostile_rng = 0x9E3779B97F4A7C15ull;
static uint64_t hostile_next(void) { /* xorshift64 */
    hostile_rng ^= hostile_rng << 13;
    hostile_rng ^= hostile_rng >> 7;
    hostile_rng ^= hostile_rng << 17;
    return hostile_rng;
}

/* A dataset of `docs` documents of lengths 5, 6, 7, ... tokens, token t of document d = (seed + 31d + t)
 * mod 500: two seeds give datasets of the same sizes and different contents. */
static mt_status hostile_dataset_write(const char* prefix, int seed, int docs, mt_indexed_writer** keep_open,
                                       mt_error* err) {
    mt_indexed_writer* w = NULL;
    mt_status st = mt_indexed_writer_open(&w, prefix, MT_DTYPE_UINT16, err);
    int32_t tokens[64];
    for (int d = 0; st == MT_OK && d < docs; d++) {
        int64_t len = 5 + d % 20;
        for (int t = 0; t < len; t++) tokens[t] = (seed + 31 * d + t) % 500;
        st = mt_indexed_writer_add_document(w, tokens, &len, 1, err);
    }
    if (st != MT_OK) { if (w) mt_indexed_writer_abort(w); return st; }
    if (keep_open) { *keep_open = w; return MT_OK; }
    return mt_indexed_writer_finalize(w, err);
}

/* What a reader finds at prefix: 0 refused, else the seed whose dataset it holds exactly (-1: a mix). */
static int hostile_dataset_seed(const char* prefix, const int* seeds, int num_seeds, int docs) {
    mt_indexed_dataset* ds = NULL;
    mt_error err;
    if (mt_indexed_dataset_open(&ds, prefix, &err) != MT_OK) return 0;
    int found = -1;
    for (int k = 0; k < num_seeds && found < 0; k++) {
        int same = mt_indexed_dataset_num_sequences(ds) == docs;
        for (int d = 0; same && d < docs; d++) {
            int32_t got[64];
            int64_t len = mt_indexed_dataset_sequence_length(ds, d);
            same = len == 5 + d % 20 && mt_indexed_dataset_read(ds, d, 0, len, got, &err) == MT_OK;
            for (int t = 0; same && t < len; t++) same = got[t] == (seeds[k] + 31 * d + t) % 500;
        }
        if (same) found = seeds[k];
    }
    mt_indexed_dataset_close(ds);
    return found;
}

/* ---- only regular files where a regular file is meant ------------------------------------------ */

typedef struct { const char* what; const char* path; const char* needle; int kind; const char* path2; } hostile_special_case;

/* In the child: the reader of case->kind must refuse case->path with one line naming its kind. */
static int hostile_special_child(void* arg) {
    const hostile_special_case* k = (const hostile_special_case*)arg;
    mt_error err;
    err.message[0] = 0;
    mt_status st = MT_OK;
    char dir[512];
    snprintf(dir, sizeof(dir), "%s", k->path);
    char* slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    switch (k->kind) {
        case 0: { mt_indexed_dataset* ds = NULL; st = mt_indexed_dataset_open(&ds, k->path, &err); if (ds) mt_indexed_dataset_close(ds); break; }
        case 1: { mt_json* j = NULL; st = mt_json_parse_file(&j, k->path, &err); mt_json_free(j); break; }
        case 2: { mt_tokenizer* t = NULL; st = mt_tokenizer_load_gpt2(&t, k->path, "dev/data/gpt2/gpt2-merges.txt", &err); if (t) mt_tokenizer_free(t); break; }
        case 3: { mt_safetensors* s = NULL; st = mt_safetensors_open(&s, k->path, &err); if (s) mt_safetensors_close(s); break; }
        case 4: { int64_t it; st = mt_checkpoint_read_tracker(dir, &it, &err); break; }
        case 5: { mt_config c; float* p = NULL; st = mt_hf_checkpoint_read(k->path, -1, 0, &c, &p, NULL, NULL, &err); free(p); break; }
        case 6: { mt_config c; float* p = NULL; st = mt_hf_load(dir, &c, &p, NULL, &err); free(p); break; }
        case 7: { mt_indexed_writer* w = NULL; st = mt_indexed_writer_open(&w, k->path, MT_DTYPE_UINT16, &err);
                  if (st == MT_OK) st = mt_indexed_writer_add_index(w, k->path2, &err);
                  if (w) mt_indexed_writer_abort(w); break; }
    }
    if (st != MT_OK && strstr(err.message, k->needle) && !strchr(err.message, '\n')) return 0;
    printf("    %s: status %s, message '%s' (want '...%s...')\n", k->what, mt_status_name(st), err.message, k->needle);
    return 1;
}

static test_result test_hostile_special_files(void) {
    char dir[256], path[700];
    hostile_dir(dir, sizeof(dir), "special");
    mt_error err;
    /* a good dataset, and one whose .idx or .bin is a FIFO, a directory or a device */
    snprintf(path, sizeof(path), "%s/good", dir);
    EXPECT_OK(hostile_dataset_write(path, 1, 4, NULL, &err), &err);
    char fifo_idx[300], fifo_bin[300], dir_idx[300], dev_idx[300], cfg_dir[300], ck_dir[300], merged[300];
    snprintf(path, sizeof(path), "%s/fifo_idx.idx", dir);
    EXPECT(mkfifo(path, 0644) == 0, "mkfifo %s", path);
    snprintf(fifo_idx, sizeof(fifo_idx), "%s/fifo_idx", dir);
    snprintf(path, sizeof(path), "%s/fifo_bin", dir);
    EXPECT_OK(hostile_dataset_write(path, 1, 4, NULL, &err), &err);
    snprintf(path, sizeof(path), "%s/fifo_bin.bin", dir);
    unlink(path);
    EXPECT(mkfifo(path, 0644) == 0, "mkfifo %s", path);
    snprintf(fifo_bin, sizeof(fifo_bin), "%s/fifo_bin", dir);
    snprintf(path, sizeof(path), "%s/dir_idx.idx", dir);
    mkdir(path, 0755);
    snprintf(dir_idx, sizeof(dir_idx), "%s/dir_idx", dir);
    snprintf(path, sizeof(path), "%s/dev_idx.idx", dir);
    EXPECT(symlink("/dev/zero", path) == 0, "symlink");
    snprintf(dev_idx, sizeof(dev_idx), "%s/dev_idx", dir);
    /* config.json, a tokenizer vocabulary, safetensors, tracker, checkpoint file: FIFOs */
    snprintf(cfg_dir, sizeof(cfg_dir), "%s/hf", dir);
    mkdir(cfg_dir, 0755);
    snprintf(path, sizeof(path), "%s/config.json", cfg_dir);
    EXPECT(mkfifo(path, 0644) == 0, "mkfifo");
    char json[400], st_path[400], tracker[400];
    snprintf(json, sizeof(json), "%s/config.json", cfg_dir);
    snprintf(st_path, sizeof(st_path), "%s/model.safetensors", cfg_dir);
    EXPECT(mkfifo(st_path, 0644) == 0, "mkfifo");
    snprintf(ck_dir, sizeof(ck_dir), "%s/ck", dir);
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00", ck_dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir");
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00/model_optim_rng.bin", ck_dir);
    EXPECT(mkfifo(path, 0644) == 0, "mkfifo");
    snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", ck_dir);
    EXPECT(mkfifo(tracker, 0644) == 0, "mkfifo");
    snprintf(merged, sizeof(merged), "%s/merged", dir); /* merge_datasets' add_index of the FIFO dataset */
    hostile_special_case cases[] = {
        {"dataset .idx FIFO", fifo_idx, "fifo_idx.idx is a FIFO, not a regular file", 0, NULL},
        {"dataset .bin FIFO", fifo_bin, "fifo_bin.bin is a FIFO, not a regular file", 0, NULL},
        {"dataset .idx directory", dir_idx, "dir_idx.idx is a directory, not a regular file", 0, NULL},
        {"dataset .idx device", dev_idx, "dev_idx.idx is a character device, not a regular file", 0, NULL},
        {"config.json FIFO", json, "config.json is a FIFO", 1, NULL},
        {"tokenizer vocabulary FIFO", json, "config.json is a FIFO", 2, NULL},
        {"safetensors FIFO", st_path, "model.safetensors is a FIFO", 3, NULL},
        {"tracker FIFO", tracker, "latest_checkpointed_iteration.txt is a FIFO", 4, NULL},
        {"checkpoint tracker FIFO (convert_hf)", ck_dir, "latest_checkpointed_iteration.txt is a FIFO", 5, NULL},
        {"config.json FIFO (convert_hf --import)", json, "config.json is a FIFO", 6, NULL},
        {"merge input FIFO", merged, "fifo_idx.idx is a FIFO", 7, fifo_idx},
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc = hostile_in_child(hostile_special_child, &cases[i], 10);
        if (rc == -1) printf("    %s: blocked (killed after 10 s)\n", cases[i].what);
        ok &= rc == 0;
    }
    /* the checkpoint model file itself, once the tracker is a regular file */
    unlink(tracker);
    EXPECT(thf_write_bytes(tracker, "0", 1) == 0, "tracker");
    hostile_special_case model = {"checkpoint file FIFO", ck_dir, "model_optim_rng.bin is a FIFO", 5, NULL};
    ok &= hostile_in_child(hostile_special_child, &model, 10) == 0;
    /* the good dataset still opens */
    mt_indexed_dataset* ds = NULL;
    snprintf(path, sizeof(path), "%s/good", dir);
    EXPECT_OK(mt_indexed_dataset_open(&ds, path, &err), &err);
    mt_indexed_dataset_close(ds);
    mt_remove_tree(dir);
    EXPECT(ok, "a special file was not refused with one line (or blocked)");
    return TEST_PASS;
}

/* ---- outputs committed as a set ----------------------------------------------------------------- */

typedef struct { const char* dir; int max_ops; int prepare_only; } hostile_commit_case;

/* In the child: a second generation (seed 2) of datasets a and b, committed as far as max_ops
 * file operations, then the process ends without any cleanup: a crash at that instant. */
static int hostile_commit_child(void* arg) {
    const hostile_commit_case* k = (const hostile_commit_case*)arg;
    char a[512], b[512];
    snprintf(a, sizeof(a), "%s/corpus_a_document", k->dir);
    snprintf(b, sizeof(b), "%s/corpus_b_document", k->dir);
    mt_indexed_writer* ws[2] = {NULL, NULL};
    mt_error err;
    if (hostile_dataset_write(a, 2, 12, &ws[0], &err) != MT_OK || hostile_dataset_write(b, 2, 12, &ws[1], &err) != MT_OK)
        return 2;
    if (mt_indexed_writer_prepare(ws[0], &err) != MT_OK || (!k->prepare_only && mt_indexed_writer_prepare(ws[1], &err) != MT_OK))
        return 3;
    if (!k->prepare_only && mt__writers_commit_ops(ws, 2, k->max_ops, &err) != MT_OK) return 4;
    return 0;
}

static test_result test_hostile_dataset_commit_crash(void) {
    char dir[256], a[512], b[512];
    hostile_dir(dir, sizeof(dir), "commit");
    snprintf(a, sizeof(a), "%s/corpus_a_document", dir);
    snprintf(b, sizeof(b), "%s/corpus_b_document", dir);
    const int seeds[2] = {1, 2}; /* old, new: the same sizes, so only the commit protocol tells them apart */
    mt_error err;
    /* a crash after every number of file operations of the commit (4 per dataset), and while preparing */
    for (int ops = -1; ops <= 9; ops++) {
        EXPECT_OK(hostile_dataset_write(a, 1, 12, NULL, &err), &err);
        EXPECT_OK(hostile_dataset_write(b, 1, 12, NULL, &err), &err);
        hostile_commit_case k = {dir, ops < 0 ? 0 : ops, ops < 0};
        EXPECT(hostile_in_child(hostile_commit_child, &k, 30) == 0, "the crashing child failed (ops %d)", ops);
        /* each dataset: the old one until its new .idx is in place (operation 7 for a, 8 for b), the new
         * one after; never refused (the old pair is read where the commit moved it) nor a mixed pair */
        int want_a = ops >= 7 ? 2 : 1, want_b = ops >= 8 ? 2 : 1;
        int got_a = hostile_dataset_seed(a, seeds, 2, 12), got_b = hostile_dataset_seed(b, seeds, 2, 12);
        EXPECT(got_a == want_a && got_b == want_b, "crash after %d operations: a reader found a %d, b %d (want %d, %d; "
               "0 refused, -1 a mixed pair)", ops, got_a, got_b, want_a, want_b);
        EXPECT(hostile_count_temporaries(dir) > 0, "the child left no temporaries (ops %d)", ops);
        /* the next writer of each prefix (here one that fails: it aborts) puts a moved-aside old pair
         * back and removes what the dead child left; the datasets stay as they were */
        mt_indexed_writer* w = NULL;
        EXPECT_OK(mt_indexed_writer_open(&w, a, MT_DTYPE_UINT16, &err), &err);
        mt_indexed_writer_abort(w);
        EXPECT_OK(mt_indexed_writer_open(&w, b, MT_DTYPE_UINT16, &err), &err);
        mt_indexed_writer_abort(w);
        EXPECT(hostile_count_temporaries(dir) == 0, "stale temporaries left after a new writer opened (ops %d)", ops);
        got_a = hostile_dataset_seed(a, seeds, 2, 12);
        got_b = hostile_dataset_seed(b, seeds, 2, 12);
        EXPECT(got_a == want_a && got_b == want_b, "crash after %d operations, then a failed writer: a %d, b %d (want %d, %d)",
               ops, got_a, got_b, want_a, want_b);
    }
    mt_remove_tree(dir);
    return TEST_PASS;
}

static test_result test_hostile_dataset_commit_failure(void) {
    char dir[256], a[512], b[512];
    hostile_dir(dir, sizeof(dir), "commitfail");
    snprintf(a, sizeof(a), "%s/corpus_a_document", dir);
    snprintf(b, sizeof(b), "%s/corpus_b_document", dir);
    const int seeds[2] = {1, 2};
    mt_error err;
    EXPECT_OK(hostile_dataset_write(a, 1, 12, NULL, &err), &err);
    EXPECT_OK(hostile_dataset_write(b, 1, 12, NULL, &err), &err);
    /* the second dataset's .bin vanishes before the commit renames it (a stand-in for any failing
     * rename): the first one's new files are taken back, both old datasets come back */
    mt_indexed_writer* ws[2] = {NULL, NULL};
    EXPECT_OK(hostile_dataset_write(a, 2, 12, &ws[0], &err), &err);
    EXPECT_OK(hostile_dataset_write(b, 2, 12, &ws[1], &err), &err);
    EXPECT_OK(mt_indexed_writer_prepare(ws[0], &err), &err);
    EXPECT_OK(mt_indexed_writer_prepare(ws[1], &err), &err);
    unlink(ws[1]->bin_tmp);
    err.message[0] = 0;
    EXPECT(mt_indexed_writers_commit(ws, 2, &err) == MT_ERR_IO && strstr(err.message, "cannot rename"), "commit: %s",
           err.message);
    EXPECT(hostile_dataset_seed(a, seeds, 2, 12) == 1 && hostile_dataset_seed(b, seeds, 2, 12) == 1,
           "the old datasets did not survive a failed commit");
    EXPECT(hostile_count_temporaries(dir) == 0, "a failed commit left temporaries");
    /* preprocess_data with two keys, the second failing to write its .idx: neither key's old dataset
     * changes (before, the first key was already renamed into place) */
    mt_tokenizer* tok = NULL;
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, "dev/data/gpt2/gpt2-vocab.json", "dev/data/gpt2/gpt2-merges.txt", &err), &err);
    char input[512], prefix[512], blocker[600];
    snprintf(input, sizeof(input), "%s/in.jsonl", dir);
    const char* lines = "{\"a\": \"hello world\", \"b\": \"one two three\"}\n{\"a\": \"again\", \"b\": \"four\"}\n";
    EXPECT(thf_write_bytes(input, lines, strlen(lines)) == 0, "input");
    snprintf(prefix, sizeof(prefix), "%s/corpus", dir);
    snprintf(blocker, sizeof(blocker), "%s.idx.tmp.%ld", b, (long)getpid()); /* b's .idx cannot be created */
    EXPECT(mkdir(blocker, 0755) == 0, "mkdir %s", blocker);
    const char* inputs[1] = {input};
    const char* keys[2] = {"a", "b"};
    mt_preprocess_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.inputs = inputs;
    pc.num_inputs = 1;
    pc.format = MT_INPUT_JSONL;
    pc.output_prefix = prefix;
    pc.json_keys = keys;
    pc.num_json_keys = 2;
    pc.tokenizer = tok;
    pc.workers = 2;
    err.message[0] = 0;
    mt_status st = mt_preprocess(&pc, NULL, &err);
    rmdir(blocker);
    mt_tokenizer_free(tok);
    EXPECT(st == MT_ERR_IO && strstr(err.message, "corpus_b_document.idx.tmp."), "preprocess: %s -> %s",
           mt_status_name(st), err.message);
    EXPECT(hostile_dataset_seed(a, seeds, 2, 12) == 1, "key a's dataset was replaced although key b failed");
    EXPECT(hostile_dataset_seed(b, seeds, 2, 12) == 1, "key b's dataset changed");
    EXPECT(hostile_count_temporaries(dir) == 0, "preprocess left temporaries");
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* stale temporaries: those of dead processes go, a live process's and other names stay, and a
 * symbolic link among them is removed itself, never what it points to */
static test_result test_hostile_stale_temporaries(void) {
    char dir[256], path[600], keep[600];
    hostile_dir(dir, sizeof(dir), "stale");
    long dead = hostile_dead_pid();
    const char* removed[] = {"x.bin.tmp.%ld", "x.bin.tmp.%ld.old", "x.bin.tmp.%ld.tmp.%ld"};
    for (int i = 0; i < 3; i++) {
        char name[128];
        snprintf(name, sizeof(name), removed[i], dead, dead);
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        EXPECT(thf_write_bytes(path, "x", 1) == 0, "write");
    }
    snprintf(path, sizeof(path), "%s/x.bin.tmp.%ld.d", dir, dead); /* a whole tree */
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/x.bin.tmp.%ld.d/inner", dir, dead);
    EXPECT(thf_write_bytes(path, "x", 1) == 0, "write");
    snprintf(keep, sizeof(keep), "%s/target", dir); /* what a stale link points to survives */
    mkdir(keep, 0755);
    snprintf(path, sizeof(path), "%s/target/precious", dir);
    EXPECT(thf_write_bytes(path, "x", 1) == 0, "write");
    snprintf(path, sizeof(path), "%s/x.bin.tmp.%ld.link", dir, dead);
    EXPECT(symlink(keep, path) == 0, "symlink");
    const char* kept[] = {"x.bin.tmp.%ld", "x.bin.tmp.abc", "y.bin.tmp.%ld", "x.bin", "x.binx.tmp.%ld"};
    for (int i = 0; i < 5; i++) {
        char name[128];
        snprintf(name, sizeof(name), kept[i], i == 0 ? (long)getpid() : dead);
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        EXPECT(thf_write_bytes(path, "x", 1) == 0, "write");
    }
    snprintf(path, sizeof(path), "%s/x.bin", dir);
    int n = mt_remove_stale_temporaries(path);
    EXPECT(n == 5, "removed %d, want 5", n);
    for (int i = 0; i < 5; i++) {
        char name[128];
        snprintf(name, sizeof(name), kept[i], i == 0 ? (long)getpid() : dead);
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        EXPECT(access(path, F_OK) == 0, "%s was removed", name);
    }
    snprintf(path, sizeof(path), "%s/target/precious", dir);
    EXPECT(access(path, F_OK) == 0, "the target of a stale symbolic link was removed");
    EXPECT(hostile_count_temporaries(dir) == 4, "%d temporaries remain, want the 4 kept", hostile_count_temporaries(dir));
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ---- a commit that a crash cut short, then a rerun that fails ---------------------------------- */

/* The state a crash leaves between the commit's renames, made on disk for a process that is gone:
 * the old pair of corpus_text_document (seed 1) moved aside to its *.tmp.<pid>.old names, with
 * (stage 1) or without (stage 0) the new .bin already renamed into place; the new .idx still a
 * temporary. Then reruns of preprocess_data that fail: one before it opens its writer (a missing
 * input), one after (a malformed line). A reader finds the old dataset all along; the rerun that
 * opened a writer put it back at its names; a later successful run replaces it and leaves no
 * temporaries. */
static test_result test_hostile_interrupted_commit_rerun(void) {
    char dir[256], prefix[512], ds[512], scratch[512], to[700], input[600], bad[600], missing[600];
    hostile_dir(dir, sizeof(dir), "rerun");
    snprintf(prefix, sizeof(prefix), "%s/corpus", dir);
    snprintf(ds, sizeof(ds), "%s/corpus_text_document", dir);
    snprintf(scratch, sizeof(scratch), "%s/new", dir);
    snprintf(input, sizeof(input), "%s/good.jsonl", dir);
    snprintf(bad, sizeof(bad), "%s/bad.jsonl", dir);
    snprintf(missing, sizeof(missing), "%s/missing.jsonl", dir);
    const char* good_lines = "{\"text\": \"one two three\"}\n{\"text\": \"four five\"}\n";
    const char* bad_lines = "{\"text\": \"one two three\"}\n{\"text\": 5}\n";
    EXPECT(thf_write_bytes(input, good_lines, strlen(good_lines)) == 0 && thf_write_bytes(bad, bad_lines, strlen(bad_lines)) == 0,
           "inputs");
    const int seeds[2] = {1, 2};
    mt_error err;
    mt_tokenizer* tok = NULL;
    EXPECT_OK(mt_tokenizer_load_gpt2(&tok, "dev/data/gpt2/gpt2-vocab.json", "dev/data/gpt2/gpt2-merges.txt", &err), &err);
    mt_preprocess_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.num_inputs = 1;
    pc.format = MT_INPUT_JSONL;
    pc.output_prefix = prefix;
    pc.tokenizer = tok;
    pc.workers = 2;
    int ok = 1;
    for (int stage = 0; stage < 2 && ok; stage++) {
        long dead = hostile_dead_pid();
        EXPECT_OK(hostile_dataset_write(ds, 1, 12, NULL, &err), &err);
        EXPECT_OK(hostile_dataset_write(scratch, 2, 12, NULL, &err), &err); /* the crashed run's new pair */
        /* stage 0: the old .idx moved aside, the new pair still temporaries; stage 1: the old .bin moved
         * aside too and the new .bin in its place */
        char names[4][2][700];
        snprintf(names[0][0], 700, "%s.idx", ds);
        snprintf(names[0][1], 700, "%s.idx.tmp.%ld.old", ds, dead);
        snprintf(names[1][0], 700, "%s.bin", ds);
        snprintf(names[1][1], 700, "%s.bin.tmp.%ld.old", ds, dead);
        snprintf(names[2][0], 700, "%s.bin", scratch);
        if (stage == 0) snprintf(names[2][1], 700, "%s.bin.tmp.%ld", ds, dead);
        else snprintf(names[2][1], 700, "%s.bin", ds);
        snprintf(names[3][0], 700, "%s.idx", scratch);
        snprintf(names[3][1], 700, "%s.idx.tmp.%ld", ds, dead);
        for (int m = 0; m < 4; m++)
            if (stage == 1 || m != 1) EXPECT(rename(names[m][0], names[m][1]) == 0, "rename %s %s", names[m][0], names[m][1]);
        ok &= hostile_dataset_seed(ds, seeds, 2, 12) == 1;
        EXPECT(ok, "stage %d: the crash state does not read as the old dataset", stage);
        const char* in_missing[1] = {missing};
        pc.inputs = in_missing;
        EXPECT(mt_preprocess(&pc, NULL, &err) == MT_ERR_IO && strstr(err.message, "missing.jsonl"), "missing input: %s", err.message);
        EXPECT(hostile_dataset_seed(ds, seeds, 2, 12) == 1, "stage %d: a rerun that failed early lost the old dataset", stage);
        const char* in_bad[1] = {bad};
        pc.inputs = in_bad;
        EXPECT(mt_preprocess(&pc, NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "bad.jsonl:2:"), "bad input: %s", err.message);
        EXPECT(hostile_dataset_seed(ds, seeds, 2, 12) == 1, "stage %d: a rerun that failed lost the old dataset", stage);
        snprintf(to, sizeof(to), "%s.idx", ds);
        EXPECT(access(to, F_OK) == 0, "stage %d: the old .idx is not back at %s", stage, to);
        EXPECT(hostile_count_temporaries(dir) == 0, "stage %d: %d temporaries left", stage, hostile_count_temporaries(dir));
        const char* in_good[1] = {input};
        pc.inputs = in_good;
        EXPECT_OK(mt_preprocess(&pc, NULL, &err), &err);
        mt_indexed_dataset* d = NULL;
        EXPECT_OK(mt_indexed_dataset_open(&d, ds, &err), &err);
        int64_t docs = mt_indexed_dataset_num_documents(d);
        mt_indexed_dataset_close(d);
        EXPECT(docs == 2, "stage %d: the new dataset has %lld documents, want 2", stage, (long long)docs);
        EXPECT(hostile_count_temporaries(dir) == 0, "stage %d: a successful run left temporaries", stage);
    }
    mt_tokenizer_free(tok);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ---- preprocess_data stopped by a signal, and its line limit ----------------------------------- */

/* Starts argv (prepro/preprocess_data ...) with stdout to /dev/null and stderr to err_path. */
static pid_t hostile_spawn(char* const* argv, const char* err_path) {
    fflush(stdout);
    pid_t p = fork();
    if (p == 0) {
        int out = open("/dev/null", O_WRONLY), e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0 || e < 0 || dup2(out, 1) < 0 || dup2(e, 2) < 0) _exit(126);
        execv(argv[0], argv);
        _exit(127);
    }
    return p;
}

/* Waits at most ms for pid: 1 with its status once it has ended, else 0. */
static int hostile_wait_ms(pid_t pid, int ms, int* status) {
    for (int t = 0; t <= ms; t++) {
        if (waitpid(pid, status, WNOHANG) == pid) return 1;
        usleep(1000);
    }
    return 0;
}

/* Entries of dir other than "." and "..". */
static int hostile_count_entries(const char* dir) {
    DIR* d = opendir(dir);
    int n = 0;
    struct dirent* e;
    while (d && (e = readdir(d)) != NULL) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

/* In a child: writes 64 KiB of 'x' (no newline) into the FIFO every 5 ms until the reader is gone. */
static void hostile_feed_forever(const char* fifo) {
    signal(SIGPIPE, SIG_IGN);
    int fd = open(fifo, O_WRONLY);
    static char chunk[65536];
    memset(chunk, 'x', sizeof(chunk));
    while (fd >= 0 && write(fd, chunk, sizeof(chunk)) > 0) usleep(5000);
    _exit(0);
}

/* SIGTERM (or SIGINT) ends preprocess_data within a second wherever it is: opening a FIFO that has
 * no writer, reading an endless line from a FIFO fed without a newline, encoding one long document
 * (an 8 MB word: seconds of merges). The signal comes 0.3 s after the run's temporary output
 * appears; the run must exit with 128 + the signal's number (its handler ran: the default action
 * would kill it) and say so, and leave nothing in its output directory. */
static test_result test_hostile_preprocess_signals(void) {
    if (access("prepro/preprocess_data", X_OK) != 0) SKIP("prepro/preprocess_data is not built (make all)");
    char dir[256], out_dir[300], prefix[400], fifo_idle[300], fifo_fed[300], word[300], err_path[300];
    hostile_dir(dir, sizeof(dir), "signals");
    snprintf(out_dir, sizeof(out_dir), "%s/out", dir);
    snprintf(prefix, sizeof(prefix), "%s/corpus", out_dir);
    snprintf(fifo_idle, sizeof(fifo_idle), "%s/idle.jsonl", dir);
    snprintf(fifo_fed, sizeof(fifo_fed), "%s/endless.jsonl", dir);
    snprintf(word, sizeof(word), "%s/word.txt", dir);
    snprintf(err_path, sizeof(err_path), "%s/stderr.txt", dir);
    EXPECT(mkfifo(fifo_idle, 0644) == 0 && mkfifo(fifo_fed, 0644) == 0, "mkfifo");
    size_t wlen = 8000000;
    char* w = (char*)malloc(wlen);
    uint64_t x = 99;
    for (size_t i = 0; i < wlen; i++) { x = x * 6364136223846793005ull + 1442695040888963407ull; w[i] = (char)('a' + (x >> 33) % 26); }
    EXPECT(thf_write_bytes(word, w, wlen) == 0, "write %s", word);
    free(w);
    struct { const char* what; const char* input; const char* format; int sig; int feed; } cases[] = {
        {"a FIFO with no writer", fifo_idle, "jsonl", SIGTERM, 0},
        {"a FIFO with no writer (SIGINT)", fifo_idle, "jsonl", SIGINT, 0},
        {"an endless line from a FIFO", fifo_fed, "jsonl", SIGTERM, 1},
        {"encoding an 8 MB word", word, "text", SIGTERM, 0},
    };
    int ok = 1;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        mt_remove_tree(out_dir);
        mkdir(out_dir, 0755);
        pid_t feeder = -1;
        if (cases[c].feed) {
            fflush(stdout);
            feeder = fork();
            if (feeder == 0) hostile_feed_forever(cases[c].input);
        }
        char* argv[] = {(char*)"prepro/preprocess_data", (char*)"--input", (char*)cases[c].input, (char*)"--input-format",
                        (char*)cases[c].format, (char*)"--output-prefix", prefix, (char*)"--tokenizer-type",
                        (char*)"GPT2BPETokenizer", (char*)"--vocab-file", (char*)"dev/data/gpt2/gpt2-vocab.json",
                        (char*)"--merge-file", (char*)"dev/data/gpt2/gpt2-merges.txt", (char*)"--workers", (char*)"2",
                        (char*)"--max-line-bytes", (char*)"1099511627776", (char*)"--quiet", NULL};
        pid_t p = hostile_spawn(argv, err_path);
        int status = 0, started = 0, ended = 0;
        for (int t = 0; t < 1000 && !started && !ended; t++) { /* its writer has opened: a temporary is there */
            started = hostile_count_entries(out_dir) > 0;
            ended = !started && hostile_wait_ms(p, 10, &status);
        }
        if (started) {
            usleep(300000);
            ended = hostile_wait_ms(p, 0, &status);
        }
        int in_time = 0;
        if (!ended) {
            kill(p, cases[c].sig);
            in_time = hostile_wait_ms(p, 1000, &status);
            if (!in_time) { kill(p, SIGKILL); waitpid(p, &status, 0); }
        }
        if (feeder > 0) { kill(feeder, SIGKILL); waitpid(feeder, NULL, 0); }
        char* err_text = test_read_file(err_path, NULL);
        char want[64];
        snprintf(want, sizeof(want), "interrupted by signal %d", cases[c].sig);
        int left = hostile_count_entries(out_dir);
        int good = started && !ended && in_time && WIFEXITED(status) && WEXITSTATUS(status) == 128 + cases[c].sig &&
                   err_text && strstr(err_text, want) && left == 0;
        if (!good)
            printf("    %s: started %d, ended before the signal %d, ended within 1 s of it %d, %s %d, %d files left, "
                   "stderr: %s\n", cases[c].what, started, ended, in_time, WIFEXITED(status) ? "exit" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? WTERMSIG(status) : -1, left,
                   err_text ? err_text : "(none)");
        free(err_text);
        ok &= good;
    }
    mt_remove_tree(dir);
    EXPECT(ok, "preprocess_data did not stop cleanly within a second of the signal");
    return TEST_PASS;
}

/* The peak resident memory of a running process (VmHWM of /proc/<pid>/status), in KiB; -1 if unknown. */
static long hostile_peak_kib(pid_t pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE* f = fopen(path, "r");
    long kib = -1;
    while (f && fgets(buf, sizeof(buf), f))
        if (!strncmp(buf, "VmHWM:", 6)) kib = strtol(buf + 6, NULL, 10);
    if (f) fclose(f);
    return kib;
}

/* --max-line-bytes bounds what one line may take. /dev/zero (no newline, ever) with a 64 MiB limit
 * is refused in one line naming the file and the line, and leaves nothing. Fed through a FIFO, a
 * line of 64 MiB + 1 byte is held (the reader waits for more) with a peak resident memory under the
 * limit plus 48 MiB (the tokenizer and the rest; measured on the process itself, as wait4's figure
 * counts the memory of the test before its exec), then refused at its end. A bad limit is refused
 * naming the flag. */
static test_result test_hostile_preprocess_line_limit(void) {
    if (access("prepro/preprocess_data", X_OK) != 0) SKIP("prepro/preprocess_data is not built (make all)");
    char dir[256], prefix[400], err_path[300], out_dir[300], fifo[300];
    hostile_dir(dir, sizeof(dir), "linelimit");
    snprintf(out_dir, sizeof(out_dir), "%s/out", dir);
    snprintf(prefix, sizeof(prefix), "%s/corpus", out_dir);
    snprintf(err_path, sizeof(err_path), "%s/stderr.txt", dir);
    snprintf(fifo, sizeof(fifo), "%s/in.jsonl", dir);
    mkdir(out_dir, 0755);
    EXPECT(mkfifo(fifo, 0644) == 0, "mkfifo");
    for (int fed = 0; fed < 2; fed++) {
        const char* input = fed ? fifo : "/dev/zero";
        char* argv[] = {(char*)"prepro/preprocess_data", (char*)"--input", (char*)input, (char*)"--output-prefix", prefix,
                        (char*)"--tokenizer-type", (char*)"GPT2BPETokenizer", (char*)"--vocab-file",
                        (char*)"dev/data/gpt2/gpt2-vocab.json", (char*)"--merge-file", (char*)"dev/data/gpt2/gpt2-merges.txt",
                        (char*)"--max-line-bytes", (char*)"67108864", (char*)"--quiet", NULL};
        pid_t p = hostile_spawn(argv, err_path);
        long peak = -1;
        if (fed) { /* 64 MiB + 1 of 'x', a pause to read it all and measure, then the end of the input */
            void (*old)(int) = signal(SIGPIPE, SIG_IGN);
            int fd = open(fifo, O_WRONLY);
            static char chunk[1 << 20];
            memset(chunk, 'x', sizeof(chunk));
            int wrote = fd >= 0;
            for (int k = 0; k < 64 && wrote; k++) wrote = write(fd, chunk, sizeof(chunk)) == (ssize_t)sizeof(chunk);
            wrote = wrote && write(fd, chunk, 1) == 1;
            usleep(300000);
            peak = hostile_peak_kib(p);
            if (fd >= 0) close(fd);
            signal(SIGPIPE, old);
            EXPECT(wrote, "could not feed the FIFO");
        }
        int status = 0;
        int ended = hostile_wait_ms(p, 20000, &status);
        if (!ended) { kill(p, SIGKILL); waitpid(p, &status, 0); }
        char* err_text = test_read_file(err_path, NULL);
        char want[500];
        snprintf(want, sizeof(want), "preprocess_data: %s: line 1 is longer than --max-line-bytes (67108864)\n", input);
        int good = err_text && !strcmp(err_text, want);
        int left = hostile_count_entries(out_dir);
        EXPECT(ended, "preprocess_data on %s did not stop at the limit within 20 s", input);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 1 && good, "%s: exit %d, stderr: %s", input,
               WIFEXITED(status) ? WEXITSTATUS(status) : -1, err_text ? err_text : "(none)");
        free(err_text);
        EXPECT(left == 0, "%s: %d files left in the output directory", input, left);
        if (fed) {
            printf("    a 64 MiB line held: peak resident memory %.1f MiB\n", (double)peak / 1024.0);
            EXPECT(peak > 0 && peak < (64 + 48) * 1024, "peak memory %ld KiB holding a line of the 64 MiB limit", peak);
        }
    }
    mt_remove_tree(dir);
    int ok = hostile_expect_refused("prepro/preprocess_data --input /dev/null --output-prefix /tmp/mt_x --max-line-bytes 0",
                                    "--max-line-bytes 0: must be between 1 and 1099511627776");
    ok &= hostile_expect_refused("prepro/preprocess_data --input /dev/null --output-prefix /tmp/mt_x --max-line-bytes 1e9",
                                 "--max-line-bytes 1e9: not an integer");
    EXPECT(ok, "a bad --max-line-bytes was not refused with one line");
    return TEST_PASS;
}

/* ---- sizes from files: checkpoint headers, trackers, .idx, safetensors ------------------------- */

/* A header of small_test_config's model with some progress, as a save writes it. */
static void hostile_header(int64_t* h) {
    mt_config c = hostile_base();
    mt_error err;
    mt_config_finalize(&c, &err);
    mt_checkpoint_header_init(h, &c);
    double scale = 65536.0;
    h[MT_CK_ITERATION] = 7;
    h[MT_CK_CONSUMED] = 56;
    h[MT_CK_ADAM_STEP] = 7;
    memcpy(&h[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
}

static test_result test_hostile_checkpoint_header(void) {
    int64_t good[MT_CK_HEADER_WORDS], h[MT_CK_HEADER_WORDS];
    hostile_header(good);
    mt_config c;
    mt_error err;
    EXPECT_OK(mt_checkpoint_header_check(good, "ck", &c, &err), &err);
    EXPECT(c.num_layers == 2 && c.hidden_size == 64 && mt_param_layout(&c, NULL) == good[MT_CK_NUM_PARAMS], "config");
    EXPECT(mt_checkpoint_file_bytes(good, 0) == 512 + 12 * good[MT_CK_NUM_PARAMS], "file bytes %lld",
           (long long)mt_checkpoint_file_bytes(good, 0));
    struct { int word; int64_t value; const char* needle; } cases[] = {
        {MT_CK_MAGIC, 0, "not a megatron.c checkpoint"},
        {MT_CK_LAYERS, (int64_t)1 << 31, "header word 2 (--num-layers) is 2147483648, outside [1, 2147483647]"},
        {MT_CK_HIDDEN, -64, "(--hidden-size) is -64"},
        {MT_CK_HEADS, 0, "(--num-attention-heads) is 0"},
        {MT_CK_GROUPS, 3, "not a multiple of the query groups"},
        {MT_CK_FFN, INT64_MIN, "(--ffn-hidden-size)"},
        {MT_CK_VOCAB, INT64_MAX, "overflows"},
        {MT_CK_VOCAB, (int64_t)1 << 52, "parameter count overflows"}, /* x hidden x 64 bytes: past int64 */
        {MT_CK_NUM_PARAMS, 12345, "the header says 12345 parameters but its model has"},
        {MT_CK_PRECISION, 7, "(the precision) is 7"},
        {MT_CK_ITERATION, -1, "(the iteration) is -1"},
        {MT_CK_CONSUMED, INT64_MIN, "(the consumed samples)"},
        {MT_CK_GROWTH, (int64_t)1 << 40, "growth tracker"},
        {MT_CK_HYSTERESIS, (int64_t)INT32_MIN - 1, "hysteresis tracker"},
        {MT_CK_TP, 0, "--tensor-model-parallel-size"},
        {MT_CK_TP_RANK, 1, "the tensor-parallel rank is not below"},
        {MT_CK_SHARDED_DP, -1, "sharding"},
        {MT_CK_DP_RANK, 2, "the data-parallel rank is not below"},
        {MT_CK_SHARD_NUMEL, INT64_MAX, "the shard size"},
        {MT_CK_NORMALIZATION, 2, "the normalization"},
        {MT_CK_SWIGLU, -1, "--swiglu"},
        {MT_CK_TRUE_VOCAB, 1 << 20, "the true vocabulary exceeds the padded one"},
        {MT_CK_FP8_TENSORS, 4, "FP8 amax history"},      /* tensors without a history */
        {MT_CK_FP8_HISTORY_LEN, 1 << 20, "FP8 amax history length"},
        {MT_CK_LOSS_SCALE_BITS, 0, "the loss scale 0 is not a finite number > 0"},
        {MT_CK_LOSS_SCALE_BITS, 0x7ff8000000000000LL, "the loss scale nan"},
        {MT_CK_NORM_EPS_BITS, 0x7ff8000000000000LL, "the norm epsilon nan"},
        {MT_CK_POSITION_TYPE, 1, "rope words"},           /* rope with base 0 */
        {MT_CK_PP_RANK, 1, "the pipeline rank is not below"},
        {MT_CK_VP, 2, "the pipeline stage words"},        /* virtual stages without a pipeline */
        {MT_CK_STAGE_NUMEL, -1, "(the stage's parameter count) is -1"},
        {MT_CK_VP, MT_PP_MAX_CHUNKS + 1, "(the virtual pipeline stages) is 65, outside [0, 64]"},
        {MT_CK_POSITION_TYPE, 3, "(the position embedding type) is 3, outside [0, 2]"},
        {MT_CK_LAYERNORM_1P, 2, "(--apply-layernorm-1p) is 2, outside [0, 1]"},
        {MT_CK_SQUARED_RELU, 2, "(--squared-relu) is 2, outside [0, 1]"},
        {MT_CK_QK_LAYERNORM, -1, "(--qk-layernorm) is -1, outside [0, 1]"},
        {MT_CK_QK_LAYERNORM, 1, "the header says"}, /* the query and key norms' tensors are not counted */
        {MT_CK_DDP_OVERLAP, 3, "--overlap-grad-reduce) is 3, outside [0, 2]"},
        {MT_CK_DDP_BUCKET_SIZE, -1, "--ddp-bucket-size) is -1"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        memcpy(h, good, sizeof(h));
        h[cases[i].word] = cases[i].value;
        err.message[0] = 0;
        mt_status st = mt_checkpoint_header_check(h, "ck", NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, cases[i].needle) && !strchr(err.message, '\n'),
               "case %zu (word %d = %lld): %s -> '%s'", i, cases[i].word, (long long)cases[i].value,
               mt_status_name(st), err.message);
    }
    /* the words of the flags that came later are read back: NoPE (type 2, no position table) and
     * --apply-layernorm-1p */
    {
        mt_config nope = hostile_base();
        nope.position_embedding_type = MT_POSITION_NONE;
        nope.apply_layernorm_1p = 1;
        EXPECT_OK(mt_config_finalize(&nope, &err), &err);
        mt_checkpoint_header_init(h, &nope);
        memcpy(&h[MT_CK_LOSS_SCALE_BITS], &good[MT_CK_LOSS_SCALE_BITS], sizeof(double));
        EXPECT_OK(mt_checkpoint_header_check(h, "ck", &c, &err), &err);
        EXPECT(c.position_embedding_type == MT_POSITION_NONE && c.apply_layernorm_1p == 1 &&
                   h[MT_CK_NUM_PARAMS] < good[MT_CK_NUM_PARAMS],
               "NoPE / layernorm-1p header read back as type %d, 1p %d", (int)c.position_embedding_type,
               c.apply_layernorm_1p);
    }
    /* random words: never a crash or an overflow (run under UBSan to see), and an accepted header
     * always describes a model whose sizes fit */
    static const int64_t extremes[] = {0, 1, -1, 2, 3, 64, 128, 1 << 30, INT32_MAX, (int64_t)INT32_MAX + 1,
                                       (int64_t)1 << 40, (int64_t)1 << 62, INT64_MAX, INT64_MIN, 0x7ff0000000000000LL};
    int accepted = 0;
    for (int it = 0; it < 200000; it++) {
        memcpy(h, good, sizeof(h));
        int changes = 1 + (int)(hostile_next() % 3);
        for (int k = 0; k < changes; k++) {
            int w = (int)(hostile_next() % MT_CK_HEADER_WORDS);
            uint64_t r = hostile_next();
            h[w] = r % 3 == 0 ? extremes[r / 3 % (sizeof(extremes) / sizeof(extremes[0]))]
                 : r % 3 == 1 ? (int64_t)((uint64_t)h[w] + r / 3 % 5 - 2) : (int64_t)(r >> 1);
        }
        if (mt_checkpoint_header_check(h, "ck", &c, &err) != MT_OK) continue;
        accepted++;
        int64_t bytes = mt_checkpoint_file_bytes(h, 0), shard = mt_checkpoint_file_bytes(h, 1);
        EXPECT(bytes >= 512 && shard >= 512 && mt_param_layout(&c, NULL) == h[MT_CK_NUM_PARAMS],
               "accepted header with file bytes %lld / %lld", (long long)bytes, (long long)shard);
    }
    EXPECT(accepted > 1000, "only %d random headers were valid: the fuzzing is not reaching past the checks", accepted);
    return TEST_PASS;
}

static test_result test_hostile_tracker(void) {
    char dir[256], path[512];
    hostile_dir(dir, sizeof(dir), "tracker");
    snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt", dir);
    struct { const char* text; size_t n; int64_t want; } cases[] = {
        {"7", 1, 7}, {" 12\n", 4, 12}, {"0\r\n", 3, 0}, {"x7", 2, -1}, {"7x", 2, -1}, {"-1", 2, -1}, {"", 0, -1},
        {"99999999999999999999", 20, -1}, {"release", 7, -1}, {"1\0002", 3, -1}, {"+5", 2, -1}, {"0x10", 4, -1},
    };
    mt_error err;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        EXPECT(thf_write_bytes(path, cases[i].text, cases[i].n) == 0, "write");
        int64_t it = -5;
        err.message[0] = 0;
        mt_status st = mt_checkpoint_read_tracker(dir, &it, &err);
        if (cases[i].want >= 0) EXPECT(st == MT_OK && it == cases[i].want, "case %zu: %s, %lld", i, err.message, (long long)it);
        else EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "does not hold an iteration number") && it == -5,
                    "case %zu: %s -> %s", i, mt_status_name(st), err.message);
    }
    char big[200];
    memset(big, '1', sizeof(big));
    EXPECT(thf_write_bytes(path, big, sizeof(big)) == 0, "write");
    int64_t it;
    EXPECT(mt_checkpoint_read_tracker(dir, &it, &err) == MT_ERR_FORMAT, "a 200-byte tracker was read");
    EXPECT_OK(mt_checkpoint_write_tracker(dir, 123456789012LL, &err), &err);
    EXPECT_OK(mt_checkpoint_read_tracker(dir, &it, &err), &err);
    EXPECT(it == 123456789012LL && hostile_count_temporaries(dir) == 0, "round trip %lld", (long long)it);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* Random corruptions of a valid .idx (and the .bin's length): the reader refuses with one line, or
 * accepts an index whose every sequence then reads within bounds, and whose GPT samples build. */
static test_result test_hostile_idx_fuzz(void) {
    char dir[256], good[512], bad[512], path[600];
    hostile_dir(dir, sizeof(dir), "idxfuzz");
    snprintf(good, sizeof(good), "%s/good", dir);
    snprintf(bad, sizeof(bad), "%s/bad", dir);
    mt_error err;
    EXPECT_OK(hostile_dataset_write(good, 1, 9, NULL, &err), &err);
    size_t idx_n = 0, bin_n = 0;
    snprintf(path, sizeof(path), "%s.idx", good);
    char* idx = test_read_file(path, &idx_n);
    snprintf(path, sizeof(path), "%s.bin", good);
    char* bin = test_read_file(path, &bin_n);
    EXPECT(idx && bin, "read back");
    unsigned char* m = (unsigned char*)malloc(idx_n + 64);
    static const int64_t extremes[] = {0, 1, -1, 8, 9, 10, INT32_MAX, (int64_t)INT32_MAX + 1, (int64_t)1 << 40,
                                       (int64_t)1 << 62, INT64_MAX, INT64_MIN, (int64_t)UINT32_MAX};
    int accepted = 0, refused = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(m, idx, idx_n);
        size_t n = idx_n;
        int changes = 1 + (int)(hostile_next() % 3);
        for (int k = 0; k < changes; k++) {
            uint64_t r = hostile_next();
            if (n == 0) break;
            switch (r % 5) {
                case 0: m[(r >> 8) % n] ^= (unsigned char)(1u << (r >> 3) % 8); break;       /* a bit */
                case 1: { int64_t v = extremes[(r >> 8) % (sizeof(extremes) / sizeof(extremes[0]))];
                          size_t at = (r >> 16) % (n >= 8 ? n - 7 : 1);                        /* a word */
                          if (n >= 8) memcpy(m + at, &v, 8); break; }
                case 2: n = (size_t)((r >> 8) % (n + 1)); break;                               /* truncated */
                case 3: if (n + 16 <= idx_n + 64) { memset(m + n, (int)(r >> 8), 16); n += 16; } break; /* longer */
                case 4: { int64_t v = (int64_t)((r >> 8) % 64) - 8; size_t at = 18 + 8 * ((r >> 20) % 2); /* N, D */
                          if (n >= at + 8) memcpy(m + at, &v, 8); break; }
            }
        }
        snprintf(path, sizeof(path), "%s.idx", bad);
        unlink(path); /* a new file each time: rewriting one in place makes ext4 flush it at close */
        EXPECT(thf_write_bytes(path, m, n) == 0, "write");
        snprintf(path, sizeof(path), "%s.bin", bad);
        unlink(path);
        size_t bn = hostile_next() % 4 == 0 ? (size_t)(hostile_next() % (bin_n + 8)) : bin_n;
        char* bb = (char*)calloc(bn + 1, 1);
        memcpy(bb, bin, bn < bin_n ? bn : bin_n);
        EXPECT(thf_write_bytes(path, bb, bn) == 0, "write");
        free(bb);
        mt_indexed_dataset* ds = NULL;
        err.message[0] = 0;
        if (mt_indexed_dataset_open(&ds, bad, &err) != MT_OK) {
            EXPECT(err.message[0] && !strchr(err.message, '\n'), "iteration %d: refused without one line: '%s'", it,
                   err.message);
            refused++;
            continue;
        }
        accepted++;
        int32_t out[4096];
        int64_t total = 0;
        for (int64_t s = 0; s < mt_indexed_dataset_num_sequences(ds); s++) {
            int64_t len = mt_indexed_dataset_sequence_length(ds, s);
            EXPECT(len >= 0 && len <= 4096, "iteration %d: sequence %lld of %lld tokens", it, (long long)s, (long long)len);
            EXPECT_OK(mt_indexed_dataset_read(ds, s, 0, len, out, &err), &err);
            total += len;
        }
        EXPECT(total == mt_indexed_dataset_num_tokens(ds), "iteration %d: token count", it);
        mt_gpt_dataset* g = NULL;
        if (total >= 2 && mt_gpt_dataset_build(&g, ds, 0, mt_indexed_dataset_num_sequences(ds), 4, 1234, 50, &err) == MT_OK) {
            int32_t sample[5];
            for (int64_t i = 0; i < mt_gpt_dataset_num_samples(g); i++) EXPECT_OK(mt_gpt_dataset_get(g, i, sample, &err), &err);
            mt_gpt_dataset_free(g);
        }
        mt_indexed_dataset_close(ds);
    }
    free(m);
    free(idx);
    free(bin);
    mt_remove_tree(dir);
    EXPECT(accepted > 0 && refused > 1000, "accepted %d, refused %d: the corruptions missed", accepted, refused);
    return TEST_PASS;
}

static test_result test_hostile_safetensors_sizes(void) {
    char dir[256], path[512], msg[800];
    hostile_dir(dir, sizeof(dir), "st");
    snprintf(path, sizeof(path), "%s/x.safetensors", dir);
    /* element count x element size wraps to 0 in 64 bits: 2^61 F64 elements with an empty span */
    struct { const char* header; const char* needle; } cases[] = {
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,0]}}", "impossibly large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", "impossibly large"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", "impossibly large"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4611686018427387905],\"data_offsets\":[0,0]}}", "impossibly large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,18446744073709551615]}}", "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}", "not a non-negative integer"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        EXPECT(thf_write_raw(path, cases[i].header, 8) == 0, "write");
        EXPECT(thf_rejects(path, MT_ERR_FORMAT, cases[i].needle, msg, sizeof(msg)), "case %zu: %s", i, msg);
    }
    /* the writer refuses shapes whose size overflows, and leaves nothing behind */
    float x = 1.0f;
    mt_st_write_tensor t = {"a", MT_ST_F32, 2, {(int64_t)1 << 40, (int64_t)1 << 40}, &x};
    mt_error err;
    err.message[0] = 0;
    EXPECT(mt_safetensors_write(path, &t, 1, NULL, &err) == MT_ERR_ARG && strstr(err.message, "impossibly large"),
           "writer: %s", err.message);
    t.shape[0] = -1;
    EXPECT(mt_safetensors_write(path, &t, 1, NULL, &err) == MT_ERR_ARG, "a negative dimension was written");
    EXPECT(hostile_count_temporaries(dir) == 0, "the writer left a temporary");
    mt_remove_tree(dir);
    return TEST_PASS;
}

static test_result test_hostile_sample_counts(void) {
    int64_t ns[3];
    mt_error err;
    EXPECT_OK(mt_gpt_num_samples(100, 10, 5, 8, ns, &err), &err);
    EXPECT(ns[0] == 800 && ns[1] == 11 * 5 * 8 && ns[2] == 40, "counts");
    err.message[0] = 0;
    EXPECT(mt_gpt_num_samples(INT64_MAX / 2, 0, 1, 4, ns, &err) == MT_ERR_CONFIG &&
           strstr(err.message, "--train-iters 4611686018427387903 x --global-batch-size 4 samples overflows"), "%s",
           err.message);
    EXPECT(mt_gpt_num_samples(10, 1, INT64_MAX / 4, 4, ns, &err) == MT_ERR_CONFIG &&
           strstr(err.message, "the validation samples"), "%s", err.message);
    EXPECT(mt_gpt_num_samples(-1, 1, 1, 4, ns, &err) == MT_ERR_CONFIG, "negative iterations");
    /* a blend of more samples than doubles hold exactly is refused, not rounded into an overflow */
    char dir[256], a[512];
    hostile_dir(dir, sizeof(dir), "blend");
    snprintf(a, sizeof(a), "%s/a", dir);
    EXPECT_OK(hostile_dataset_write(a, 1, 9, NULL, &err), &err);
    const char* prefixes[2] = {a, a};
    double weights[2] = {1, 1};
    int64_t huge[3] = {INT64_MAX / 4, 0, 0};
    mt_gpt_data* d = NULL;
    err.message[0] = 0;
    EXPECT(mt_gpt_data_open(&d, 2, prefixes, weights, "1,0,0", 4, 1234, huge, &err) == MT_ERR_CONFIG &&
           strstr(err.message, "cannot be blended"), "%s", err.message);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* convert_hf --import: an interrupted run (an iteration directory without a tracker, a temporary
 * of a dead process) does not block the retry; a finished one (a tracker) is never overwritten.
 * --export: the temporaries of a dead export are removed, and switching layouts leaves one. */
static test_result test_hostile_convert_hf_retry(void) {
    char dir[256], ck[512], hf[512], path[700];
    hostile_dir(dir, sizeof(dir), "hfretry");
    snprintf(ck, sizeof(ck), "%s/ck", dir);
    snprintf(hf, sizeof(hf), "%s/hf", dir);
    mt_config c = thf_small_config();
    float* p = thf_random_params(&c);
    EXPECT(p, "params");
    long dead = hostile_dead_pid();
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00", ck);
    EXPECT(mt_make_directories(path) == 0, "mkdir");
    snprintf(path, sizeof(path), "%s/iter_0000000/mp_rank_00/model_optim_rng.bin", ck);
    EXPECT(thf_write_bytes(path, "half", 4) == 0, "write");
    snprintf(path, sizeof(path), "%s/iter_0000000.tmp.%ld/mp_rank_00", ck, dead);
    EXPECT(mt_make_directories(path) == 0, "mkdir");
    snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt.tmp.%ld", ck, dead);
    EXPECT(thf_write_bytes(path, "0", 1) == 0, "write");
    mt_error err;
    EXPECT_OK(mt_hf_checkpoint_write(ck, &c, p, 0, &err), &err);
    EXPECT(hostile_count_temporaries(ck) == 0, "the interrupted run's temporaries are still there");
    mt_config c2;
    float* q = NULL;
    EXPECT_OK(mt_hf_checkpoint_read(ck, -1, 0, &c2, &q, NULL, NULL, &err), &err);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)mt_num_parameters(&c)), "the retry's checkpoint differs");
    free(q);
    err.message[0] = 0;
    EXPECT(mt_hf_checkpoint_write(ck, &c, p, 0, &err) == MT_ERR_IO && strstr(err.message, "already holds a checkpoint"),
           "a finished checkpoint was overwritten: %s", err.message);
    /* export: a dead export's temporaries go; sharded then single leaves one consistent layout */
    EXPECT(mt_make_directories(hf) == 0, "mkdir");
    snprintf(path, sizeof(path), "%s/config.json.tmp.%ld", hf, dead);
    EXPECT(thf_write_bytes(path, "{", 1) == 0, "write");
    snprintf(path, sizeof(path), "%s/model.safetensors.tmp.%ld.tmp.%ld", hf, dead, dead);
    EXPECT(thf_write_bytes(path, "x", 1) == 0, "write");
    EXPECT_OK(mt_hf_save(hf, &c, p, c.vocab_size, MT_ST_F32, 20000, &err), &err); /* sharded */
    EXPECT(hostile_count_temporaries(hf) == 0, "the dead export's temporaries are still there");
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", hf);
    EXPECT(access(path, F_OK) == 0, "no index after a sharded export");
    EXPECT_OK(mt_hf_save(hf, &c, p, c.vocab_size, MT_ST_F32, 0, &err), &err); /* one file */
    EXPECT(access(path, F_OK) != 0, "the sharded layout's index survived a single-file export");
    EXPECT_OK(mt_hf_load(hf, &c2, &q, NULL, &err), &err);
    EXPECT(!memcmp(p, q, sizeof(float) * (size_t)mt_num_parameters(&c)), "the export does not load back");
    free(q);
    free(p);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ---- training under faults (GPU) ---------------------------------------------------------------- */

/* A NaN in the weights makes the loss NaN: with --check-for-nan-in-loss-and-grad (the default) the
 * step is an MT_ERR_NAN error naming the rank, and nothing is applied (weights bitwise unchanged, the
 * scheduler not advanced); without it the old behaviour (reported in the result) is kept. */
static test_result test_hostile_nan_stops_the_step(void) {
    REQUIRE_GPU();
    const mt_precision precisions[3] = {MT_FP32, MT_BF16, MT_FP16};
    for (int pi = 0; pi < 3; pi++) {
        for (int check = 1; check >= 0; check--) {
            mt_config c = test_config(TEST_GPT2, precisions[pi]);
            c.check_for_nan_in_loss_and_grad = check;
            mt_error err;
            EXPECT_OK(mt_config_finalize(&c, &err), &err);
            mt_trainer* t = NULL;
            EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
            int64_t n = mt_num_parameters(&c), per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
            float* before = (float*)malloc(sizeof(float) * (size_t)n);
            float* after = (float*)malloc(sizeof(float) * (size_t)n);
            int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)per_step);
            fill_tokens(tokens, per_step, (int)c.vocab_size, 77);
            mt_step_result r;
            mt_status st = mt_trainer_get_parameters(t, before, &err);
            before[5] = NAN; /* a word embedding of token 0: tied, so every logit row sees it */
            if (st == MT_OK) st = mt_trainer_set_parameters(t, before, &err);
            if (st == MT_OK) st = mt_trainer_get_parameters(t, before, &err);
            mt_status step = st == MT_OK ? mt_trainer_train_step(t, tokens, &r, &err) : st;
            if (st == MT_OK) st = mt_trainer_get_parameters(t, after, &err);
            test_result res = TEST_PASS;
            if (st != MT_OK) {
                printf("    FAIL %s\n", err.message);
                res = TEST_FAIL;
            } else if (check) {
                if (step != MT_ERR_NAN || !strstr(err.message, "found NaN in the loss on rank 0") ||
                    strchr(err.message, '\n')) {
                    printf("    FAIL precision %d: step %s, '%s'\n", (int)precisions[pi], mt_status_name(step), err.message);
                    res = TEST_FAIL;
                } else if (memcmp(before, after, sizeof(float) * (size_t)n) != 0) {
                    printf("    FAIL precision %d: the NaN step changed the weights\n", (int)precisions[pi]);
                    res = TEST_FAIL;
                }
                /* the step after it, with finite weights again, is the run's first (the scheduler did not move) */
                before[5] = 0.0f;
                if (res == TEST_PASS && (mt_trainer_set_parameters(t, before, &err) != MT_OK ||
                                         mt_trainer_train_step(t, tokens, &r, &err) != MT_OK ||
                                         r.learning_rate != mt_learning_rate(&c, 0) || !isfinite(r.lm_loss))) {
                    printf("    FAIL precision %d: the step after the refused one: %s, lr %g\n", (int)precisions[pi],
                           err.message, r.learning_rate);
                    res = TEST_FAIL;
                }
            } else if (step != MT_OK || !r.nan) { /* unchecked: reported, as before (fp16's scaler skips it) */
                printf("    FAIL precision %d unchecked: step %s, nan %d\n", (int)precisions[pi], mt_status_name(step), r.nan);
                res = TEST_FAIL;
            }
            free(before);
            free(after);
            free(tokens);
            mt_trainer_free(t);
            if (res != TEST_PASS) return res;
        }
    }
    return TEST_PASS;
}

static const test_case hostile_tests[] = {
    {"hostile_overflow_helpers", test_hostile_overflow_helpers},
    {"hostile_config_size_products", test_hostile_config_size_products},
    {"hostile_config_doubles", test_hostile_config_doubles},
    {"hostile_train_gpt_flags", test_hostile_train_gpt_flags},
    {"hostile_fault_flags_land", test_hostile_fault_flags_land},
    {"hostile_dataset_info_flags", test_hostile_dataset_info_flags},
    {"hostile_convert_hf_flags", test_hostile_convert_hf_flags},
    {"hostile_special_files", test_hostile_special_files},
    {"hostile_dataset_commit_crash", test_hostile_dataset_commit_crash},
    {"hostile_dataset_commit_failure", test_hostile_dataset_commit_failure},
    {"hostile_stale_temporaries", test_hostile_stale_temporaries},
    {"hostile_interrupted_commit_rerun", test_hostile_interrupted_commit_rerun},
    {"hostile_preprocess_signals", test_hostile_preprocess_signals},
    {"hostile_preprocess_line_limit", test_hostile_preprocess_line_limit},
    {"hostile_checkpoint_header", test_hostile_checkpoint_header},
    {"hostile_tracker", test_hostile_tracker},
    {"hostile_idx_fuzz", test_hostile_idx_fuzz},
    {"hostile_safetensors_sizes", test_hostile_safetensors_sizes},
    {"hostile_sample_counts", test_hostile_sample_counts},
    {"hostile_convert_hf_retry", test_hostile_convert_hf_retry},
};

/* A NaN in one gradient (megatron.cu's test hook test_nan_gradients_at: the first parameter's first
 * gradient after the backward of step 3 of 8) is refused as MT_ERR_NAN naming the gradients, nothing
 * applied; train_gpt skips such a step (--max-consecutive-nan-iterations). The run goes on, and its
 * losses and final weights are bit for bit those of a run that never had step 3's batch: the
 * scheduler and Adam's step count did not move, and the gradient buffer is rewritten by the next
 * backward. Both flavours, fp32 and bf16, and FP8 delayed scaling (the refused step's amaxes are
 * dropped with it). */
static test_result nan_gradient_case(test_flavour flavour, mt_precision prec, int fp8) {
    mt_config c = test_config(flavour, prec);
    if (fp8) {
        c.fp8_format = MT_FP8_HYBRID;
        c.fp8_recipe = MT_FP8_DELAYED;
        c.fp8_amax_history_len = 4;
    }
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_trainer *a = NULL, *b = NULL;
    EXPECT_OK(mt_trainer_create(&a, &c, &err), &err);
    if (mt_trainer_create(&b, &c, &err) != MT_OK) {
        mt_trainer_free(a);
        EXPECT_OK(MT_ERR_CUDA, &err);
    }
    const int64_t n = mt_num_parameters(&c), per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    std::vector<int32_t> tokens((size_t)per_step);
    std::vector<float> pa((size_t)n), pb((size_t)n);
    double la[8] = {0}, lb[8] = {0};
    test_result res = TEST_PASS;
    const char* name = flavour == TEST_LLAMA ? "llama" : "gpt2";
    for (int k = 0; k < 8 && res == TEST_PASS; k++) {
        fill_tokens(tokens.data(), per_step, (int)c.vocab_size, 300 + k);
        mt_step_result r;
        if (k == 3) a->debug.test_nan_gradients_at = a->iteration + 1;
        mt_status st = mt_trainer_train_step(a, tokens.data(), &r, &err);
        if (k == 3) {
            if (st != MT_ERR_NAN || !strstr(err.message, "in the gradients") || strchr(err.message, '\n')) {
                printf("    FAIL %s: the poisoned step: %s '%s'\n", name, mt_status_name(st), st == MT_OK ? "" : err.message);
                res = TEST_FAIL;
            }
            continue; /* the other run never sees this batch */
        }
        la[k] = r.lm_loss;
        if (st == MT_OK) st = mt_trainer_train_step(b, tokens.data(), &r, &err);
        lb[k] = r.lm_loss;
        if (st != MT_OK) {
            printf("    FAIL %s step %d: %s\n", name, k, err.message);
            res = TEST_FAIL;
        } else if (memcmp(&la[k], &lb[k], sizeof(double))) {
            printf("    FAIL %s step %d: loss %.9g after the skipped step, %.9g without it\n", name, k, la[k], lb[k]);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && (mt_trainer_get_parameters(a, pa.data(), &err) != MT_OK ||
                             mt_trainer_get_parameters(b, pb.data(), &err) != MT_OK)) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS && memcmp(pa.data(), pb.data(), sizeof(float) * (size_t)n)) {
        printf("    FAIL %s: the final weights differ from the run without the skipped batch\n", name);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS)
        printf("      %s %s%s: step 3 refused; losses %.6f -> %.6f and final weights bitwise those of the run without "
               "its batch\n", name, prec == MT_FP32 ? "fp32" : "bf16", fp8 ? " fp8 delayed" : "", la[0], la[7]);
    mt_trainer_free(a);
    mt_trainer_free(b);
    return res;
}

static test_result test_hostile_nan_gradient_skipped(void) {
    REQUIRE_GPU();
    const test_flavour flavours[2] = {TEST_GPT2, TEST_LLAMA};
    const mt_precision precisions[2] = {MT_FP32, MT_BF16};
    for (int f = 0; f < 2; f++)
        for (int p = 0; p < 2; p++)
            if (nan_gradient_case(flavours[f], precisions[p], 0) != TEST_PASS) return TEST_FAIL;
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    if (major * 10 + minor >= 89 && nan_gradient_case(TEST_GPT2, MT_BF16, 1) != TEST_PASS) return TEST_FAIL;
    return TEST_PASS;
}

static const test_case hostile_gpu_tests[] = {
    {"hostile_nan_stops_the_step", test_hostile_nan_stops_the_step},
    {"hostile_nan_gradient_skipped", test_hostile_nan_gradient_skipped},
};

#endif
