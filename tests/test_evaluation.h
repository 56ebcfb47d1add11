/* tests/test_evaluation.h — judging a run: per-token losses (mt_trainer_token_losses), train_gpt's
 * --skip-train, --full-validation and --tensorboard-dir end to end, eval_hellaswag.
 *
 * host: the flags of this feature that must be refused, through train_gpt and eval_hellaswag as
 *       subprocesses (skipped when not built).
 * gpu:  per-token losses against the mean mt_trainer_evaluate gives (bitwise: the same floats summed
 *       in the same order) and against -log softmax of mt_trainer_logits in double (fp32);
 *       train_gpt (built-in job, 4 iterations) writing a checkpoint and TensorBoard events, read back
 *       with tests/test_tensorboard.h's reader and compared with its log lines; --skip-train --load
 *       of that checkpoint giving the very test loss the training run printed, training nothing,
 *       saving nothing, writing no scalar; --full-validation equal to evaluating every validation
 *       sample one by one; eval_hellaswag scoring a few items of that checkpoint.
 * The subprocess tests run from the repository root (they skip elsewhere) and need `make all`. */
#ifndef MT_TEST_EVALUATION_H
#define MT_TEST_EVALUATION_H

#include <sys/wait.h>
#include <unistd.h>

#include "test_common.h"
#include "test_configs.h"
#include "test_hostile.h"     /* hostile_expect_refused */
#include "test_tensorboard.h" /* the event file reader */

/* ---- subprocesses ----------------------------------------------------------------------------- */

/* Runs cmd with its stdout, then its stderr, into out (malloc'd); returns the exit status (-1: did
 * not exit). stderr goes to a file of its own: lines that OpenMPI or CUDA write to stderr (train_gpt
 * built with MPI) then cannot land inside a stdout line that the pipe's buffering split. */
static int tev_run(const char* cmd, char** out) {
    char err_path[] = "/tmp/mt_tev_stderr_XXXXXX", full[4200];
    *out = NULL;
    int fd = mkstemp(err_path);
    if (fd < 0) return -1;
    close(fd);
    snprintf(full, sizeof(full), "%s 2>%s", cmd, err_path);
    FILE* p = popen(full, "r");
    if (!p) {
        unlink(err_path);
        return -1;
    }
    size_t cap = 1 << 16, n = 0;
    char* buf = (char*)malloc(cap);
    size_t k;
    while (buf && (k = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += k;
        if (cap - n < 4096) buf = (char*)realloc(buf, cap *= 2);
    }
    int st = pclose(p);
    size_t err_size = 0;
    char* err_text = test_read_file(err_path, &err_size);
    unlink(err_path);
    char* joined = buf && err_text ? (char*)realloc(buf, n + err_size + 1) : NULL;
    if (joined) {
        memcpy(joined + n, err_text, err_size);
        n += err_size;
        buf = joined;
    }
    free(err_text);
    if (buf) buf[n] = 0;
    *out = buf;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The number after `key` on the first line containing `line_has` (and key), or NAN. */
static double tev_value(const char* text, const char* line_has, const char* key) {
    for (const char* line = text; line && *line;) {
        const char* end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        char buf[1024];
        snprintf(buf, sizeof(buf), "%.*s", (int)(n < sizeof(buf) ? n : sizeof(buf) - 1), line);
        const char* k = strstr(buf, key);
        if (strstr(buf, line_has) && k) return strtod(k + strlen(key), NULL);
        line = end ? end + 1 : NULL;
    }
    return NAN;
}

static int tev_repository_root(void) {
    return access("./train_gpt", X_OK) == 0 && access("dev/data/tinyshakespeare.txt", R_OK) == 0;
}

/* ---- host: refusals --------------------------------------------------------------------------- */

static test_result test_evaluation_flags_refused(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP_OR_FAIL_STRICT("./train_gpt is not built (make all)");
    int ok = 1;
    ok &= hostile_expect_refused("./train_gpt --mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 2 "
                                 "--seq-length 32 --micro-batch-size 1 --train-iters 1 --lr 1e-4 --full-validation",
                                 "--full-validation needs a dataset");
    ok &= hostile_expect_refused("./train_gpt --tensorboard-queue-size 0", "--tensorboard-queue-size 0: must be between 1");
    ok &= hostile_expect_refused("./train_gpt --tensorboard-log-interval -3", "--tensorboard-log-interval -3: must be between 1");
    ok &= hostile_expect_refused("./train_gpt --skip-train=1", "--skip-train takes no value");
    ok &= hostile_expect_refused("./train_gpt --tensorboard-dir", "--tensorboard-dir needs a value");
    if (access("./eval_hellaswag", X_OK) == 0) {
        ok &= hostile_expect_refused("./eval_hellaswag", "--load CKPT_DIR is required");
        ok &= hostile_expect_refused("./eval_hellaswag --load x --num-examples 0", "--num-examples 0: must be in");
        ok &= hostile_expect_refused("./eval_hellaswag --load x --examples-per-batch 1000", "--examples-per-batch 1000");
        ok &= hostile_expect_refused("./eval_hellaswag --load /nonexistent_ckpt", "no checkpoint in /nonexistent_ckpt");
        ok &= hostile_expect_refused("./eval_hellaswag --load x --bogus 1", "unknown flag --bogus");
    } else {
        EXPECT(!test_strict(), "MT_TEST_STRICT=1: ./eval_hellaswag is not built (make all)");
        printf("    note: ./eval_hellaswag is not built: its refusals not checked\n");
    }
    EXPECT(ok, "a flag was not refused with one line (above)");
    return TEST_PASS;
}

/* ---- gpu: per-token losses -------------------------------------------------------------------- */

static test_result test_evaluation_token_losses(void) {
    REQUIRE_GPU();
    mt_config c = test_config(TEST_GPT2, MT_FP32);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    int B = c.micro_batch_size, S = c.seq_length;
    int64_t Vp = c.padded_vocab_size;
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * (S + 1));
    int32_t* inputs = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * S);
    float* losses = (float*)malloc(sizeof(float) * (size_t)B * S);
    float* logits = (float*)malloc(sizeof(float) * (size_t)B * S * (size_t)Vp);
    EXPECT(tokens && inputs && losses && logits, "malloc");
    fill_tokens(tokens, (int64_t)B * (S + 1), (int)c.vocab_size, 77);
    for (int b = 0; b < B; b++) memcpy(inputs + (size_t)b * S, tokens + (size_t)b * (S + 1), sizeof(int32_t) * S);
    EXPECT_OK(mt_trainer_token_losses(t, tokens, losses, &err), &err);
    double mean = 0.0, sum = 0.0;
    EXPECT_OK(mt_trainer_evaluate(t, tokens, 1, &mean, &err), &err);
    for (int i = 0; i < B * S; i++) sum += losses[i];
    EXPECT(sum / (B * S) == mean, "per-token losses average to %.17g, evaluate gives %.17g", sum / (B * S), mean);
    EXPECT_OK(mt_trainer_logits(t, inputs, logits, &err), &err);
    double worst = 0.0;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < S; i++) {
            const float* x = logits + ((size_t)b * S + i) * (size_t)Vp;
            double mx = -INFINITY, z = 0.0;
            for (int64_t v = 0; v < Vp; v++) if (x[v] > mx) mx = x[v];
            for (int64_t v = 0; v < Vp; v++) z += exp((double)x[v] - mx);
            double ref = mx + log(z) - x[tokens[(size_t)b * (S + 1) + i + 1]];
            double d = fabs(ref - losses[(size_t)b * S + i]);
            if (d > worst) worst = d;
            /* fp32 softmax (expf, logf) over ~1000 columns against double: ~1e-6 relative */
            EXPECT(d <= 1e-5 + 1e-5 * ref, "row %d position %d: loss %.7g, -log softmax in double %.7g", b, i,
                   losses[(size_t)b * S + i], ref);
        }
    printf("    %d tokens: mean equals evaluate's; worst |loss - double reference| %.2e\n", B * S, worst);
    free(tokens);
    free(inputs);
    free(losses);
    free(logits);
    mt_trainer_free(t);
    return TEST_PASS;
}

/* ---- gpu: train_gpt end to end ---------------------------------------------------------------- */

/* The scalars of an event directory's one file with tag at step (the first), or NAN. */
static double tev_event(const ttb_event* e, int n, const char* tag, int64_t step) {
    for (int i = 0; i < n; i++)
        if (e[i].has_value && e[i].step == step && !strcmp(e[i].tag, tag)) return e[i].value;
    return NAN;
}
static int tev_count(const ttb_event* e, int n, const char* tag) {
    int k = 0;
    for (int i = 0; i < n; i++) k += !strcmp(e[i].tag, tag);
    return k;
}
/* Reads the one event file of dir into events (up to max): the count, or -1. */
static int tev_events(const char* dir, ttb_event* events, int max) {
    char names[4][512], why[256];
    if (ttb_list(dir, names, 4) != 1) return -1;
    int n = ttb_read_file(names[0], events, max, why, sizeof(why));
    if (n < 0) printf("    %s: %s\n", names[0], why);
    return n;
}

static test_result test_evaluation_train_gpt(void) {
    REQUIRE_GPU();
    if (!tev_repository_root()) SKIP_OR_FAIL_STRICT("run from the repository root after make all");
    char dir[256], cmd[2048];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_evaluation_XXXXXX");
    EXPECT(mkdtemp(dir) != NULL, "mkdtemp");
    char* out = NULL;
    snprintf(cmd, sizeof(cmd),
             "./train_gpt --train-iters 4 --lr-warmup-iters 1 --log-interval 2 --eval-interval 2 --eval-iters 1 --sample-tokens 0 "
             "--save %s/ck --tensorboard-dir %s/tb --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard "
             "--log-memory-to-tensorboard --wandb-project p",
             dir, dir);
    int code = tev_run(cmd, &out);
    EXPECT(code == 0 && out, "%s: exit %d\n%s", cmd, code, out ? out : "");
    double val2 = tev_value(out, "validation loss at iteration 2 |", "lm loss value: ");
    double val4 = tev_value(out, "validation loss at iteration 4 on validation set |", "lm loss value: ");
    double test4 = tev_value(out, "validation loss at iteration 4 on test set |", "lm loss value: ");
    double loss4 = tev_value(out, "iteration        4/", "lm loss: ");
    double lr4 = tev_value(out, "iteration        4/", "learning rate: ");
    EXPECT(isfinite(val2) && isfinite(val4) && isfinite(test4) && isfinite(loss4) && isfinite(lr4),
           "the log lacks a line:\n%s", out);
    EXPECT(strstr(out, "wandb sync --sync-tensorboard") != NULL, "no wandb pointer line");
    free(out);

    /* the events: Megatron's tags at their steps, equal to the log (float32; the log's %.6E) */
    char tb[320];
    snprintf(tb, sizeof(tb), "%s/tb", dir);
    static ttb_event ev[1024];
    int n = tev_events(tb, ev, 1024);
    EXPECT(n > 0, "no readable event file in %s", tb);
    const char* each_step[] = {"learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm",
                               "learning-rate vs samples", "lm loss vs samples", "mem-allocated-bytes"};
    for (size_t k = 0; k < sizeof(each_step) / sizeof(each_step[0]); k++)
        EXPECT(tev_count(ev, n, each_step[k]) == 4, "%s: %d events, want one per iteration", each_step[k],
               tev_count(ev, n, each_step[k]));
    EXPECT(tev_count(ev, n, "iteration-time") == 2 && tev_count(ev, n, "throughput") == 2, "timers at the 2 log lines");
    double mean = (tev_event(ev, n, "lm loss", 3) + tev_event(ev, n, "lm loss", 4)) / 2;
    EXPECT(fabs(mean - loss4) <= 1e-6 * loss4, "lm loss over 3..4 %.7g, log line %.7g", mean, loss4);
    EXPECT(fabs(tev_event(ev, n, "learning-rate", 4) - lr4) <= 1e-6 * lr4, "learning-rate at 4");
    EXPECT(tev_event(ev, n, "batch-size vs samples", 4 * 32) == 32.0f, "batch-size vs samples at 128 samples");
    EXPECT(fabs(tev_event(ev, n, "lm loss validation", 2) - val2) <= 1e-6 * val2, "validation at 2");
    EXPECT(fabs(tev_event(ev, n, "lm loss validation ppl", 2) - exp(val2)) <= 1e-5 * exp(val2), "validation ppl at 2");
    EXPECT(fabs(tev_event(ev, n, "lm loss test", 4) - test4) <= 1e-6 * test4, "test at 4");
    int found = 0;
    for (int i = 0; i < n; i++) found |= !strcmp(ev[i].tag, "train_iters/text_summary") && !strcmp(ev[i].text, "4");
    EXPECT(found, "no text train_iters = 4");

    /* --skip-train --load: the same test loss, nothing trained, saved or written as a scalar */
    snprintf(cmd, sizeof(cmd),
             "./train_gpt --skip-train --load %s/ck --eval-iters 1 --sample-tokens 0 --save %s/ck2 "
             "--tensorboard-dir %s/tb2",
             dir, dir, dir);
    code = tev_run(cmd, &out);
    EXPECT(code == 0 && out, "%s: exit %d\n%s", cmd, code, out ? out : "");
    EXPECT(strstr(out, "skipping training (--skip-train is on) ...") && !strstr(out, "consumed samples:") &&
               strstr(out, "loaded checkpoint from"),
           "skip-train output:\n%s", out);
    double skip_test = tev_value(out, "validation loss at iteration 4 on test set |", "lm loss value: ");
    double skip_val = tev_value(out, "validation loss at iteration 4 on validation set |", "lm loss value: ");
    EXPECT(skip_test == test4, "--skip-train test loss %.7g, the training run's %.7g", skip_test, test4);
    EXPECT(isfinite(skip_val), "no validation line:\n%s", out);
    free(out);
    snprintf(cmd, sizeof(cmd), "%s/ck2", dir);
    EXPECT(access(cmd, F_OK) != 0, "--skip-train saved a checkpoint to %s", cmd);
    snprintf(tb, sizeof(tb), "%s/tb2", dir);
    n = tev_events(tb, ev, 1024);
    EXPECT(n > 1, "no readable event file in %s", tb);
    for (int i = 0; i < n; i++) EXPECT(!ev[i].has_value, "--skip-train wrote the scalar %s", ev[i].tag);

    /* --full-validation: every validation sample once (micro-batch 5, global 10: whole rounds, a
     * partial one at the end) against one sample per iteration over all of them. The runs differ in
     * GEMM shapes only; bf16 rounding of per-element results (2^-8) averages out over thousands of
     * tokens: 2e-3 relative. */
    snprintf(cmd, sizeof(cmd),
             "./train_gpt --skip-train --load %s/ck --full-validation --micro-batch-size 5 --global-batch-size 10 "
             "--eval-iters 0 --sample-tokens 0 --save ''", dir);
    code = tev_run(cmd, &out);
    EXPECT(code == 0 && out, "%s: exit %d\n%s", cmd, code, out ? out : "");
    double full = tev_value(out, "on validation set |", "lm loss value: ");
    double samples = tev_value(out, "data: ", "valid ");
    EXPECT(isfinite(full) && samples > 0, "full validation output:\n%s", out);
    free(out);
    long long N = (long long)samples;
    snprintf(cmd, sizeof(cmd),
             "./train_gpt --skip-train --load %s/ck --micro-batch-size 1 --global-batch-size 1 --eval-iters %lld "
             "--sample-tokens 0 --save ''", dir, N);
    code = tev_run(cmd, &out);
    EXPECT(code == 0 && out, "%s: exit %d\n%s", cmd, code, out ? out : "");
    double one_by_one = tev_value(out, "on validation set |", "lm loss value: ");
    free(out);
    EXPECT(fabs(full - one_by_one) <= 2e-3 * one_by_one, "full validation %.7g, %lld samples one by one %.7g", full, N,
           one_by_one);
    printf("    full validation over %lld samples (%lld in the last, partial round): %.6f, one by one %.6f\n", N, N % 5,
           full, one_by_one);

    /* eval_hellaswag on the same checkpoint: a few items, an accuracy line and a per-item file */
    if (access("./eval_hellaswag", X_OK) == 0 && access("dev/data/hellaswag_val_full.txt", R_OK) == 0) {
        snprintf(cmd, sizeof(cmd), "./eval_hellaswag --load %s/ck --num-examples 12 --per-example %s/h.tsv", dir, dir);
        code = tev_run(cmd, &out);
        EXPECT(code == 0 && out && strstr(out, "hellaswag: 12 items | acc "), "%s: exit %d\n%s", cmd, code, out ? out : "");
        free(out);
        snprintf(cmd, sizeof(cmd), "%s/h.tsv", dir);
        size_t size = 0;
        char* tsv = test_read_file(cmd, &size);
        int lines = 0;
        for (size_t i = 0; tsv && i < size; i++) lines += tsv[i] == '\n';
        free(tsv);
        EXPECT(lines == 13, "%s: %d lines, want a header and 12 items", cmd, lines);
    } else {
        EXPECT(!test_strict(), "MT_TEST_STRICT=1: eval_hellaswag or dev/data/hellaswag_val_full.txt missing (make all)");
        printf("    note: eval_hellaswag or dev/data/hellaswag_val_full.txt missing (make all "
               "dev/data/hellaswag_val_full.txt): not run\n");
    }
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("    note: could not remove %s\n", dir);
    return TEST_PASS;
}

static const test_case evaluation_tests[] = {
    {"evaluation_flags_refused", test_evaluation_flags_refused},
};
static const test_case evaluation_gpu_tests[] = {
    {"evaluation_token_losses", test_evaluation_token_losses},
    {"evaluation_train_gpt", test_evaluation_train_gpt},
};

#endif
