/* tests/test_faults.h — faults every rank must agree on, saves that fail or are killed, and a resumed run
 * that must be bitwise the one that never stopped (issue #38).
 *
 * Host: a full disk (RLIMIT_FSIZE) under the commit's host writes (the tracker, the manifest, a file
 * through mt_write_file): each fails in one line and leaves the previous checkpoint as it was, no
 * temporaries; every patch under dev/mutations/ is well formed and applies to the tree
 * (dev/mutation_check.sh check).
 * GPU: a process SIGKILLed during an async save (this binary run again as the child: stopped and killed
 * right after the save was staged, while its file was half written, once it was written but not
 * committed): the tracker names the previous checkpoint, whose manifest verifies; it loads bitwise; the
 * next save tidies the killed one away. train_gpt stopped by --exit-interval and resumed with --load
 * (and --async-save): its log lines after the stop and its final checkpoint equal the run that never
 * stopped, byte for byte.
 * Several GPUs (mpirun -np 2 or 4): a NaN in one rank's gradients or in one rank's copy of a weight
 * under DP, DP with the distributed optimizer, TP + SP and PP: every rank refuses the step (bf16, fp16
 * with a NaN loss) or skips it (fp16 overflow), the weights are untouched everywhere, the run goes on
 * bitwise as the run that never had that batch, and with fp16's dynamic scaler every rank halves the
 * scale alike; an async save one of whose ranks cannot write (rank 1, then rank 0, which commits):
 * every rank reports it, nothing is committed, the previous checkpoint loads bitwise and the next
 * save succeeds. */
#ifndef MT_TEST_FAULTS_H
#define MT_TEST_FAULTS_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_common.h"
#include "test_configs.h"

/* ---- host ------------------------------------------------------------------------------------- */

/* Temporaries ("*.tmp.*") anywhere under dir. */
static int faults_count_temporaries(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent* e;
    char path[4096];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n += strstr(e->d_name, ".tmp.") != NULL;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        struct stat sb;
        if (lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) n += faults_count_temporaries(path);
    }
    closedir(d);
    return n;
}

/* The disk fills (RLIMIT_FSIZE 0: every write of a byte fails with EFBIG, SIGXFSZ ignored) while a
 * checkpoint's host files are committed: the tracker, the manifest and a file through mt_write_file
 * each fail with MT_ERR_IO in one line, and the checkpoint before stays whole (the old tracker and
 * manifest, which still verifies and is still what a load selects), with no temporary left. */
static test_result test_faults_full_disk_commit(void) {
    char dir[] = "/tmp/mt_faults_disk_XXXXXX";
    EXPECT(mkdtemp(dir) != NULL, "mkdtemp");
    char iter[256], rank_dir[300], file[400];
    snprintf(iter, sizeof(iter), "%s/iter_0000002", dir);
    snprintf(rank_dir, sizeof(rank_dir), "%s/mp_rank_00", iter);
    snprintf(file, sizeof(file), "%s/model_optim_rng.bin", rank_dir);
    EXPECT(mkdir(iter, 0755) == 0 && mkdir(rank_dir, 0755) == 0, "mkdir %s", rank_dir);
    static char old_bytes[100000], new_bytes[100000];
    for (size_t i = 0; i < sizeof(old_bytes); i++) {
        old_bytes[i] = (char)(i * 7 + 3);
        new_bytes[i] = (char)(i * 11 + 5);
    }
    mt_error err;
    const void* chunk = old_bytes;
    size_t size = sizeof(old_bytes);
    EXPECT_OK(mt_write_file(file, 1, &chunk, &size, &err), &err);
    EXPECT_OK(mt_checkpoint_manifest_write(iter, &err), &err);
    EXPECT_OK(mt_checkpoint_write_tracker(dir, 2, &err), &err);
    char manifest[400];
    snprintf(manifest, sizeof(manifest), "%s/%s", iter, MT_CKPT_MANIFEST);
    size_t manifest_size = 0;
    char* manifest_before = test_read_file(manifest, &manifest_size);
    EXPECT(manifest_before != NULL, "no manifest written");

    struct rlimit old_limit, none;
    EXPECT(getrlimit(RLIMIT_FSIZE, &old_limit) == 0, "getrlimit");
    none = old_limit;
    none.rlim_cur = 0;
    fflush(stdout); /* nothing of this process is written while the limit holds */
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    mt_error e_tracker, e_manifest, e_file;
    e_tracker.message[0] = e_manifest.message[0] = e_file.message[0] = 0;
    mt_status st_tracker = MT_OK, st_manifest = MT_OK, st_file = MT_OK;
    int limited = setrlimit(RLIMIT_FSIZE, &none) == 0;
    if (limited) {
        st_tracker = mt_checkpoint_write_tracker(dir, 3, &e_tracker);
        st_manifest = mt_checkpoint_manifest_write(iter, &e_manifest);
        chunk = new_bytes;
        st_file = mt_write_file(file, 1, &chunk, &size, &e_file);
        setrlimit(RLIMIT_FSIZE, &old_limit);
    }
    signal(SIGXFSZ, old_handler);
    if (!limited) {
        free(manifest_before);
        mt_remove_tree(dir);
        SKIP("setrlimit(RLIMIT_FSIZE) refused");
    }
    printf("      full disk: tracker '%s'; manifest '%s'; file '%s'\n", e_tracker.message, e_manifest.message, e_file.message);
    int64_t tracked = -1, chosen = -1;
    int fell_back = -1;
    size_t n_manifest = 0, n_file = 0;
    char* manifest_after = test_read_file(manifest, &n_manifest);
    char* file_after = test_read_file(file, &n_file);
    const int manifest_same = manifest_after && n_manifest == manifest_size && !memcmp(manifest_after, manifest_before, n_manifest);
    const int file_same = file_after && n_file == sizeof(old_bytes) && !memcmp(file_after, old_bytes, n_file);
    const int temporaries = faults_count_temporaries(dir);
    free(manifest_before);
    free(manifest_after);
    free(file_after);
    const mt_status verify = mt_checkpoint_manifest_verify(iter, &err);
    const mt_status select = mt_checkpoint_select(dir, -1, 0, &chosen, &fell_back, NULL, &err);
    const mt_status read = mt_checkpoint_read_tracker(dir, &tracked, &err);
    mt_remove_tree(dir);
    const mt_status sts[3] = {st_tracker, st_manifest, st_file};
    const mt_error* errs[3] = {&e_tracker, &e_manifest, &e_file};
    const char* what[3] = {"the tracker", "the manifest", "mt_write_file"};
    for (int i = 0; i < 3; i++)
        EXPECT(sts[i] == MT_ERR_IO && errs[i]->message[0] && !strchr(errs[i]->message, '\n'),
               "%s on a full disk: %s '%s'", what[i], mt_status_name(sts[i]), errs[i]->message);
    EXPECT(read == MT_OK && tracked == 2, "the tracker says %lld after the failed write", (long long)tracked);
    EXPECT(manifest_same && verify == MT_OK, "the manifest changed or no longer verifies: %s", err.message);
    EXPECT(file_same, "the file was changed by a write that failed");
    EXPECT(select == MT_OK && chosen == 2 && fell_back == 0, "a load now selects %lld (fell back %d)", (long long)chosen,
           fell_back);
    EXPECT(temporaries == 0, "%d temporaries left", temporaries);
    return TEST_PASS;
}

/* Every mutation patch (issue #38's planted bugs) is well formed, names tests that exist and applies to
 * this tree: a patch that stopped applying (the code moved under it) is found here, not on a GPU
 * machine. */
static test_result test_faults_mutation_patches_apply(void) {
    if (access("dev/mutation_check.sh", X_OK) != 0) SKIP("run from the repository root");
    if (system("command -v git >/dev/null 2>&1") != 0) SKIP("git is not installed");
    static char out[65536];
    int code = test_command_output("dev/mutation_check.sh check 2>&1", out, sizeof(out));
    const char* last = out;
    for (const char* p = out; *p; p++)
        if (p[0] == '\n' && p[1]) last = p + 1;
    printf("      %s", last);
    EXPECT(code == 0, "dev/mutation_check.sh check: exit %d\n%s", code, out);
    return TEST_PASS;
}

static const test_case faults_tests[] = {
    {"faults_full_disk_commit", test_faults_full_disk_commit},
    {"faults_mutation_patches_apply", test_faults_mutation_patches_apply},
};

/* ---- GPU: a process killed during an async save ----------------------------------------------- */

/* The killed trainer: 4 layers of 512, vocabulary 8000 (16.8M parameters), so that its model file
 * (master, m, v: 200 MB) is written in several of the writer's 64 MiB pieces and a kill can land
 * between them. */
static mt_config faults_kill_config(void) {
    mt_config c = test_config(TEST_GPT2, MT_BF16);
    c.num_layers = 4;
    c.hidden_size = 512;
    c.vocab_size = 8000;
    test_config_attention(&c, 8, 8, 64, 0);
    return c;
}
static void faults_kill_tokens(const mt_config* c, int32_t* tokens, int64_t n, int step) {
    fill_tokens(tokens, n, (int)c->vocab_size, 5300 + 97 * (uint64_t)step);
}

#define FAULTS_CHILD_ENV "MT_FAULTS_CHILD"

/* The child (this binary run again with MT_FAULTS_CHILD=<mode>:<dir>, the parent's test its filter):
 * 2 steps, an async save of iteration 2 committed, a step, the async save of iteration 3; then it
 * stops itself (SIGSTOP, every thread) at the moment mode names, says so on stdout, and waits for the
 * parent's SIGKILL: "staged" (the save call returned: the writer thread is starting), "writing" (the
 * file is in the temporary directory, part written), "written" (the file is whole, not committed).
 * Never returns. */
static void faults_kill_child(const char* spec) {
    setvbuf(stdout, NULL, _IONBF, 0);
    char mode[16] = {0};
    const char* colon = strchr(spec, ':');
    if (!colon || colon - spec >= (long)sizeof(mode)) {
        printf("CHILD FAILED: %s=%s is not <mode>:<dir>\n", FAULTS_CHILD_ENV, spec);
        _exit(1);
    }
    memcpy(mode, spec, (size_t)(colon - spec));
    const char* dir = colon + 1;
    mt_config c = faults_kill_config();
    mt_error err;
    mt_trainer* t = NULL;
    mt_status st = mt_config_finalize(&c, &err);
    if (st == MT_OK) st = mt_trainer_create(&t, &c, &err);
    const int64_t per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)per_step);
    mt_step_result r;
    int64_t committed = -1;
    for (int k = 0; k < 3 && st == MT_OK; k++) {
        faults_kill_tokens(&c, tokens, per_step, k);
        st = mt_trainer_train_step(t, tokens, &r, &err);
        if (st == MT_OK && k == 1) st = mt_trainer_save_async(t, dir, 2, 2 * c.global_batch_size, &err);
        if (st == MT_OK && k == 1) st = mt_trainer_save_wait(t, 1, &committed, &err);
        if (st == MT_OK && k == 1 && committed != 2) st = mt_fail(&err, MT_ERR_IO, "committed %lld", (long long)committed);
    }
    const size_t full = st == MT_OK ? rank_checkpoint_bytes(t) : 0;
    if (st == MT_OK) st = mt_trainer_save_async(t, dir, 3, 3 * c.global_batch_size, &err);
    if (st != MT_OK) {
        printf("CHILD FAILED: %s\n", err.message);
        _exit(1);
    }
    char path[4400];
    snprintf(path, sizeof(path), "%s/.tmp_iter_0000003/mp_rank_00/model_optim_rng.bin", dir);
    const char* state = "staged";
    if (strcmp(mode, "staged") != 0) {
        state = NULL;
        for (long i = 0; i < 60L * 20000 && !state; i++) { /* 60 s */
            struct stat sb;
            const size_t size = stat(path, &sb) == 0 ? (size_t)sb.st_size : 0;
            if (size == full) state = "written";
            else if (size > 0 && !strcmp(mode, "writing")) state = "writing";
            else usleep(50);
        }
        if (!state) {
            printf("CHILD FAILED: %s did not grow to %zu bytes in 60 s\n", path, full);
            _exit(1);
        }
    }
    printf("CHILD STOP %s (asked for %s)\n", state, mode);
    raise(SIGSTOP);
    sleep(120); /* the parent kills it before this ends */
    printf("CHILD FAILED: not killed\n");
    _exit(3);
}

/* Runs exe with argv {exe, filter} and the environment of this process less what would make it a
 * shard or an MPI rank (MT_TEST_SHARD, OMPI_*, PMIX_*, PMI_*) plus extra; its stdout and stderr come
 * to *fd. Returns the child's pid, or -1. (fork then execve at once: the child touches nothing of this
 * process's CUDA state.) */
static pid_t faults_spawn(const char* exe, const char* filter, const char* extra, int* fd) {
    int n = 0;
    while (environ[n]) n++;
    char** env = (char**)calloc((size_t)n + 2, sizeof(char*));
    if (!env) return -1;
    int m = 0;
    for (int i = 0; i < n; i++) {
        const char* e = environ[i];
        if (!strncmp(e, "MT_TEST_SHARD=", 14) || !strncmp(e, "OMPI_", 5) || !strncmp(e, "PMIX_", 5) ||
            !strncmp(e, "PMI_", 4) || !strncmp(e, FAULTS_CHILD_ENV "=", strlen(FAULTS_CHILD_ENV) + 1))
            continue;
        env[m++] = environ[i];
    }
    env[m++] = (char*)extra;
    env[m] = NULL;
    char* argv[3] = {(char*)exe, (char*)filter, NULL};
    int p[2];
    if (pipe(p) != 0) {
        free(env);
        return -1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        close(p[1]);
        execve(exe, argv, env);
        _exit(127);
    }
    close(p[1]);
    free(env);
    if (pid < 0) {
        close(p[0]);
        return -1;
    }
    *fd = p[0];
    return pid;
}

static double faults_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

/* Reads fd into out (cap bytes, NUL-terminated) until it holds `until` (or "CHILD FAILED"), the end
 * of the stream, or `seconds`; returns 1 when `until` came. */
static int faults_read_until(int fd, char* out, size_t cap, size_t* len, const char* until, double seconds) {
    const double end = faults_now() + seconds;
    while (faults_now() < end) {
        if (strstr(out, until)) return 1;
        if (strstr(out, "CHILD FAILED")) return 0;
        struct pollfd pfd = {fd, POLLIN, 0};
        int ready = poll(&pfd, 1, 200);
        if (ready < 0 && errno != EINTR) return 0;
        if (ready <= 0) continue;
        char buf[4096];
        ssize_t got = read(fd, buf, sizeof(buf));
        if (got <= 0) return strstr(out, until) != NULL;
        size_t take = (size_t)got < cap - 1 - *len ? (size_t)got : cap - 1 - *len;
        memcpy(out + *len, buf, take);
        *len += take;
        out[*len] = 0;
    }
    return strstr(out, until) != NULL;
}

/* A process SIGKILLed during an async save, at three moments of it (faults_kill_child): afterwards the
 * directory holds the previous checkpoint or nothing of the new one, never a torn one: the tracker
 * names iteration 2, whose manifest verifies and which a load selects (no fallback); no iter_0000003;
 * a trainer that loads it has bit for bit the weights of 2 steps (trained here, the same batches); and
 * its next save (iteration 3 again) succeeds, tidies the killed save's temporary directory away and
 * verifies. */
static test_result test_faults_async_save_killed(void) {
    const char* spec = getenv(FAULTS_CHILD_ENV);
    if (spec) faults_kill_child(spec); /* this process is the child: never returns */
    REQUIRE_GPU();
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len <= 0) SKIP("no /proc/self/exe to run the child from");
    exe[len] = 0;
    mt_config c = faults_kill_config();
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int64_t n = mt_num_parameters(&c), per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    std::vector<float> w2((size_t)n), loaded((size_t)n);
    std::vector<int32_t> tokens((size_t)per_step);
    mt_step_result r;
    {
        mt_trainer* t = NULL;
        EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
        mt_status st = MT_OK;
        for (int k = 0; k < 2 && st == MT_OK; k++) {
            faults_kill_tokens(&c, tokens.data(), per_step, k);
            st = mt_trainer_train_step(t, tokens.data(), &r, &err);
        }
        if (st == MT_OK) st = mt_trainer_get_parameters(t, w2.data(), &err);
        mt_trainer_free(t);
        EXPECT_OK(st, &err);
    }
    char root[] = "/tmp/mt_faults_kill_XXXXXX";
    EXPECT(mkdtemp(root) != NULL, "mkdtemp");
    const char* modes[3] = {"staged", "writing", "written"};
    test_result res = TEST_PASS;
    static char out[65536];
    for (int m = 0; m < 3 && res == TEST_PASS; m++) {
        char dir[256], extra[400], path[600];
        snprintf(dir, sizeof(dir), "%s/%s", root, modes[m]);
        snprintf(extra, sizeof(extra), "%s=%s:%s", FAULTS_CHILD_ENV, modes[m], dir);
        int fd = -1;
        pid_t pid = faults_spawn(exe, "faults_async_save_killed", extra, &fd);
        if (pid <= 0) {
            printf("    FAIL cannot start the child %s\n", exe);
            res = TEST_FAIL;
            break;
        }
        size_t got = 0;
        out[0] = 0;
        const int stopped_line = faults_read_until(fd, out, sizeof(out), &got, "CHILD STOP", 300.0);
        int status = 0, stopped = 0;
        if (stopped_line) { /* the line comes just before the stop */
            for (int i = 0; i < 1000 && !stopped; i++) {
                pid_t w = waitpid(pid, &status, WUNTRACED | WNOHANG);
                if (w == pid && WIFSTOPPED(status)) stopped = 1;
                else if (w == pid) break; /* it ended */
                else usleep(10000);
            }
        }
        /* what the kill finds on disk */
        snprintf(path, sizeof(path), "%s/.tmp_iter_0000003/mp_rank_00/model_optim_rng.bin", dir);
        struct stat sb;
        const long long on_disk = stat(path, &sb) == 0 ? (long long)sb.st_size : -1;
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        close(fd);
        if (!stopped) {
            printf("    FAIL %s: the child did not stop as asked; its output:\n%s\n", modes[m], out);
            res = TEST_FAIL;
            break;
        }
        const char* line = strstr(out, "CHILD STOP");
        printf("      killed %.*s; the temporary model file then had %lld bytes\n", (int)strcspn(line + 11, "\n"),
               line + 11, on_disk);
        /* the directory: the previous checkpoint, whole and tracked */
        int64_t tracked = -1, chosen = -1, it = -1, consumed = -1;
        int fell_back = -1;
        char iter2[300], iter3[300];
        snprintf(iter2, sizeof(iter2), "%s/iter_0000002", dir);
        snprintf(iter3, sizeof(iter3), "%s/iter_0000003", dir);
        mt_status st = mt_checkpoint_read_tracker(dir, &tracked, &err);
        if (st != MT_OK || tracked != 2) {
            printf("    FAIL %s: the tracker: %s, iteration %lld (want 2)\n", modes[m], err.message, (long long)tracked);
            res = TEST_FAIL;
        } else if ((st = mt_checkpoint_manifest_verify(iter2, &err)) != MT_OK) {
            printf("    FAIL %s: iteration 2's manifest: %s\n", modes[m], err.message);
            res = TEST_FAIL;
        } else if ((st = mt_checkpoint_select(dir, -1, 0, &chosen, &fell_back, NULL, &err)) != MT_OK || chosen != 2 || fell_back) {
            printf("    FAIL %s: a load selects %lld (fell back %d): %s\n", modes[m], (long long)chosen, fell_back,
                   st == MT_OK ? "" : err.message);
            res = TEST_FAIL;
        } else if (access(iter3, F_OK) == 0) {
            printf("    FAIL %s: %s exists though its save was killed before the commit\n", modes[m], iter3);
            res = TEST_FAIL;
        }
        /* it loads bitwise, and the next save tidies the killed one away */
        mt_trainer* t = NULL;
        if (res == TEST_PASS) st = mt_trainer_create(&t, &c, &err);
        if (res == TEST_PASS && st == MT_OK) st = mt_trainer_load(t, dir, -1, &it, &consumed, &err);
        if (res == TEST_PASS && st == MT_OK) st = mt_trainer_get_parameters(t, loaded.data(), &err);
        if (res == TEST_PASS && st == MT_OK) {
            faults_kill_tokens(&c, tokens.data(), per_step, 2);
            st = mt_trainer_train_step(t, tokens.data(), &r, &err);
        }
        if (res == TEST_PASS && st == MT_OK) st = mt_trainer_save(t, dir, 3, 3 * c.global_batch_size, &err);
        if (t) mt_trainer_free(t);
        if (res == TEST_PASS && st != MT_OK) {
            printf("    FAIL %s: resuming: %s\n", modes[m], err.message);
            res = TEST_FAIL;
        }
        if (res == TEST_PASS && (it != 2 || consumed != 2 * c.global_batch_size ||
                                 memcmp(loaded.data(), w2.data(), sizeof(float) * (size_t)n))) {
            printf("    FAIL %s: loaded iteration %lld, %lld samples; weights %s those of 2 steps\n", modes[m],
                   (long long)it, (long long)consumed,
                   memcmp(loaded.data(), w2.data(), sizeof(float) * (size_t)n) ? "differ from" : "equal");
            res = TEST_FAIL;
        }
        if (res == TEST_PASS) {
            snprintf(path, sizeof(path), "%s/.tmp_iter_0000003", dir);
            const int left = access(path, F_OK) == 0;
            if (left || mt_checkpoint_manifest_verify(iter3, &err) != MT_OK ||
                mt_checkpoint_read_tracker(dir, &tracked, &err) != MT_OK || tracked != 3) {
                printf("    FAIL %s: after the next save: temporary directory %s, tracker %lld, %s\n", modes[m],
                       left ? "left" : "gone", (long long)tracked, err.message);
                res = TEST_FAIL;
            }
        }
    }
    mt_remove_tree(root);
    return res;
}

/* ---- GPU: train_gpt stopped and resumed --------------------------------------------------------- */

/* Of the log line of `iteration` in a train_gpt log: the consumed samples, and the fields from the
 * learning rate to the nan count (losses, scale, grad norm as printed), without the times. */
static int faults_log_fields(const char* log, int iteration, char* out, size_t cap) {
    char key[64];
    snprintf(key, sizeof(key), "iteration %8d/", iteration);
    const char* line = strstr(log, key);
    if (!line) return 0;
    const char* eol = strchr(line, '\n');
    const char* consumed = strstr(line, "consumed samples:");
    const char* from = strstr(line, "learning rate:");
    const char* to = from ? strstr(from, "number of nan iterations:") : NULL;
    if (!consumed || !from || !to || (eol && to > eol)) return 0;
    const char* consumed_end = strchr(consumed, '|');
    const char* to_end = strchr(to, '|');
    if (!consumed_end || !to_end) return 0;
    snprintf(out, cap, "%.*s %.*s", (int)(consumed_end - consumed), consumed, (int)(to_end - from), from);
    return 1;
}

/* Whole files a and b hold the same bytes. */
static int faults_same_file(const char* a, const char* b) {
    size_t na = 0, nb = 0;
    char* x = test_read_file(a, &na);
    char* y = test_read_file(b, &nb);
    const int same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

/* train_gpt (mock data, dropout 0.1 as Megatron's default, bf16) for 8 iterations straight, saving at
 * 4 and 8; and the same job stopped by --exit-interval 4 (its checkpoint), then resumed with --load
 * and --async-save to the end. The resumed run's log lines of iterations 5..8 (consumed samples,
 * learning rate, loss, loss scale, grad norm, skip and nan counts, as printed) equal the straight
 * run's, and both checkpoints (iterations 4 and 8: model files and manifests) are byte for byte the
 * same: bitwise, not within a tolerance. */
static test_result test_faults_train_gpt_resume_bitwise(void) {
    REQUIRE_GPU();
    if (access("./train_gpt", X_OK) != 0) SKIP("./train_gpt is not built (make all)");
    char root[] = "/tmp/mt_faults_resume_XXXXXX";
    EXPECT(mkdtemp(root) != NULL, "mkdtemp");
    const char* job = "./train_gpt --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 2 "
                      "--hidden-size 64 --num-attention-heads 2 --seq-length 64 --micro-batch-size 4 "
                      "--global-batch-size 8 --train-iters 8 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 "
                      "--lr-decay-style cosine --bf16 --log-interval 1 --eval-iters 0 --sample-tokens 0 --seed 1234";
    static char straight[131072], stopped[131072], resumed[131072];
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s --save %s/straight --save-interval 4 2>&1", job, root);
    const int code_straight = test_command_output(cmd, straight, sizeof(straight));
    snprintf(cmd, sizeof(cmd), "%s --save %s/resumed --exit-interval 4 2>&1", job, root);
    const int code_stopped = test_command_output(cmd, stopped, sizeof(stopped));
    snprintf(cmd, sizeof(cmd), "%s --load %s/resumed --save %s/resumed --async-save 2>&1", job, root, root);
    const int code_resumed = test_command_output(cmd, resumed, sizeof(resumed));
    char loaded[400], a[400], b[400], fa[512], fb[512];
    snprintf(loaded, sizeof(loaded), "loaded checkpoint from %s/resumed at iteration 4 ", root);
    test_result res = TEST_PASS;
    if (code_straight != 0 || code_stopped != 0 || code_resumed != 0) {
        printf("    FAIL exit codes: straight %d, stopped %d, resumed %d\n%s\n%s\n%s\n", code_straight, code_stopped,
               code_resumed, straight, stopped, resumed);
        res = TEST_FAIL;
    } else if (!strstr(stopped, "exiting program at iteration 4 (--exit-interval)") || strstr(stopped, "iteration        5/")) {
        printf("    FAIL the stopped run did not stop at iteration 4:\n%s\n", stopped);
        res = TEST_FAIL;
    } else if (!strstr(resumed, loaded) || strstr(resumed, "iteration        4/")) {
        printf("    FAIL the resumed run did not start from iteration 4:\n%s\n", resumed);
        res = TEST_FAIL;
    }
    for (int it = 5; it <= 8 && res == TEST_PASS; it++) {
        if (!faults_log_fields(straight, it, a, sizeof(a)) || !faults_log_fields(resumed, it, b, sizeof(b))) {
            printf("    FAIL no log line of iteration %d:\n%s\n%s\n", it, straight, resumed);
            res = TEST_FAIL;
        } else if (strcmp(a, b) != 0) {
            printf("    FAIL iteration %d:\n      straight %s\n      resumed  %s\n", it, a, b);
            res = TEST_FAIL;
        } else if (it == 8) {
            printf("      iteration 8 straight and resumed: %s\n", a);
        }
    }
    const char* files[2] = {"mp_rank_00/model_optim_rng.bin", "manifest.txt"};
    for (int it = 4; it <= 8 && res == TEST_PASS; it += 4)
        for (int f = 0; f < 2 && res == TEST_PASS; f++) {
            snprintf(fa, sizeof(fa), "%s/straight/iter_%07d/%s", root, it, files[f]);
            snprintf(fb, sizeof(fb), "%s/resumed/iter_%07d/%s", root, it, files[f]);
            if (!faults_same_file(fa, fb)) {
                printf("    FAIL %s and %s differ (or one is missing)\n", fa, fb);
                res = TEST_FAIL;
            }
        }
    mt_remove_tree(root);
    return res;
}

static const test_case faults_gpu_tests[] = {
    {"faults_async_save_killed", test_faults_async_save_killed},
    {"faults_train_gpt_resume_bitwise", test_faults_train_gpt_resume_bitwise},
};

/* ---- several GPUs: a NaN or an overflow on one rank -------------------------------------------- */

typedef struct {
    const char* name;
    int tp, pp, distributed; /* DP is the rest of the processes */
} faults_layout;

enum { FAULT_NONE = 0, FAULT_GRADIENT = 1, FAULT_WEIGHT = 2 };
#define FAULT_STEPS 8
#define FAULT_AT 3 /* the step (0-based) that carries the fault */

/* 4 layers (2 a stage at PP 2), micro-batch 2 of 4 micro-batches a data-parallel rank. fp16: a scale of
 * 1024, static (scale 1) or dynamic (scale 2: hysteresis 1, so one overflow halves it, and no growth
 * within the run). */
static mt_config faults_config(const faults_layout* L, mt_precision prec, int scale) {
    const int world = mpi_world(), dp = world / (L->tp * L->pp);
    mt_config c = test_config(TEST_GPT2, prec);
    c.num_layers = 4;
    c.pipeline_model_parallel_size = L->pp;
    test_config_parallel(&c, L->tp, world, L->tp > 1);
    test_config_ddp(&c, L->distributed, 0, 0, 0);
    test_config_batch(&c, 2, 8 * dp);
    if (prec == MT_FP16 && scale == 1) c.loss_scale = 1024.0;
    if (prec == MT_FP16 && scale == 2) {
        c.initial_loss_scale = 1024.0;
        c.hysteresis = 1;
        c.loss_scale_window = 1000;
    }
    test_config_this_rank(&c);
    return c;
}

/* Where a fault lands, as it would. A gradient fault (megatron.cu's test_nan_gradients_at: the first
 * parameter of the rank's buffer, written after the data-parallel reduction; the buffer runs in
 * reverse model order, so on the last stage that is the final norm's bias, which every TP rank holds
 * and the norm counts on TP rank 0 only) on every rank of the last pipeline stage: a replicated
 * tensor's gradient is the same on each TP rank, and the reduced gradients of a replica are every
 * replica's (with the distributed optimizer only the shard that owns the element counts it). So TP
 * ranks other than 0, the other stages and, with the distributed optimizer, the other shards refuse
 * only through the norm's reductions. A weight fault (a NaN in this rank's model-precision copy of a
 * weight) on the last rank alone: it is before every reduction, and its loss and gradients carry it
 * to the others. */
static int faults_lands_here(const mt_config* c, const faults_layout* L, int kind) {
    if (kind == FAULT_WEIGHT) return c->rank == c->world_size - 1;
    return kind == FAULT_GRADIENT && mt_rank_coordinates(c, c->rank).pp == L->pp - 1;
}

/* The byte offset in t->params of a weight this rank holds: the first layer norm's weight of its first
 * layer (its first element: every token's normalised row, so the loss, sees it). */
static int64_t faults_weight_byte(mt_trainer* t) {
    for (int l = 0; l < t->cfg.num_layers; l++)
        if (mt_pp_holds(&t->buffer.stage, MT_P_LN1_WEIGHT, l)) return param_storage(t, MT_P_LN1_WEIGHT, l);
    return -1;
}

typedef struct {
    double loss[FAULT_STEPS], scale[FAULT_STEPS];
    int status[FAULT_STEPS], skipped[FAULT_STEPS];
    char message[512];                 /* the faulted step's (as mt_error's) */
    std::vector<float> before, after;  /* the weights (this rank's view) around the faulted step */
    std::vector<float> last;           /* at the end */
} faults_run;

/* FAULT_STEPS steps of c (a fresh NCCL id) on fixed batches per step and data-parallel rank, `kind`
 * landing at step FAULT_AT (faults_lands_here); with drop the batch of step FAULT_AT is never seen
 * instead. Every rank makes every call (a step one rank refuses, the others refuse too, or the test
 * would hang there: the suite's timeout then names it). PASS unless something other than the steps
 * failed. */
static test_result faults_train(mt_config c, const faults_layout* L, int kind, int drop, faults_run* out) {
    mt_error err;
    EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
    const int64_t n = mt_num_parameters(&c);
    const int64_t per_step = (int64_t)mt_num_micro_batches(&c) * c.micro_batch_size * (c.seq_length + 1);
    const int dp_rank = mt_rank_coordinates(&c, c.rank).dp;
    std::vector<int32_t> tokens((size_t)per_step);
    out->before.assign((size_t)n, 0.0f);
    out->after.assign((size_t)n, 0.0f);
    out->last.assign((size_t)n, 0.0f);
    out->message[0] = 0;
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    const int here = kind != FAULT_NONE && faults_lands_here(&c, L, kind);
    const int64_t at = kind == FAULT_WEIGHT && here ? faults_weight_byte(t) : -1;
    unsigned char saved[4] = {0}, nan_bytes[4] = {0xff, 0xff, 0xff, 0xff}; /* all ones: a NaN in fp32, bf16, fp16 */
    test_result res = TEST_PASS;
    if (kind == FAULT_WEIGHT && here && at < 0) {
        printf("    FAIL rank %d holds no first layer norm\n", c.rank);
        res = TEST_FAIL;
    }
    for (int k = 0; k < FAULT_STEPS; k++) {
        out->status[k] = MT_OK;
        out->skipped[k] = 0;
        out->loss[k] = out->scale[k] = 0.0;
        if (drop && k == FAULT_AT) continue;
        fill_tokens(tokens.data(), per_step, (int)c.vocab_size, 9100 + 97 * k + 13 * (uint64_t)dp_rank);
        const int faulted = kind != FAULT_NONE && k == FAULT_AT;
        if (faulted && mt_trainer_get_parameters(t, out->before.data(), &err) != MT_OK) res = TEST_FAIL;
        if (faulted && here && kind == FAULT_GRADIENT) t->debug.test_nan_gradients_at = t->iteration + 1;
        if (faulted && here && at >= 0) { /* the trainer's streams are idle between its calls */
            cudaDeviceSynchronize();
            cudaMemcpy(saved, (char*)t->params + at, t->elem, cudaMemcpyDeviceToHost);
            cudaMemcpy((char*)t->params + at, nan_bytes, t->elem, cudaMemcpyHostToDevice);
        }
        mt_step_result r;
        err.message[0] = 0;
        const mt_status st = mt_trainer_train_step(t, tokens.data(), &r, &err);
        out->status[k] = (int)st;
        out->skipped[k] = r.skipped;
        out->loss[k] = r.lm_loss;
        out->scale[k] = r.loss_scale;
        if (faulted) snprintf(out->message, sizeof(out->message), "%s", st == MT_OK ? "" : err.message);
        else if (st != MT_OK) printf("    rank %d step %d: %s\n", c.rank, k, err.message);
        if (faulted && here && at >= 0) {
            cudaDeviceSynchronize();
            cudaMemcpy((char*)t->params + at, saved, t->elem, cudaMemcpyHostToDevice);
        }
        if (faulted && mt_trainer_get_parameters(t, out->after.data(), &err) != MT_OK) res = TEST_FAIL;
    }
    if (mt_trainer_get_parameters(t, out->last.data(), &err) != MT_OK) res = TEST_FAIL;
    if (res != TEST_PASS) printf("    FAIL rank %d: %s\n", c.rank, err.message);
    mt_trainer_free(t);
    return res;
}

/* 1 if this rank's values equal every other rank's (tp_same_on_all_ranks; collective). */
static int faults_same(const void* data, size_t bytes) { return tp_same_on_all_ranks(data, bytes); }

/* One layout and precision: with each fault (scale 2: the gradient fault only) against the run that
 * never had the faulted step's batch:
 * - at the faulted step every rank returns MT_ERR_NAN naming the loss (weight fault) or the gradients
 *   (gradient fault, bf16), or, fp16's overflow, MT_OK with the step skipped; every other step is
 *   MT_OK and not skipped; the weights after the faulted step are bitwise those before it;
 * - the losses of every other step and the final weights are bitwise the run's without that batch
 *   (nothing of the faulted step stayed: no update, no Adam step, no scheduler step); with the dynamic
 *   scaler (scale 2) instead: the scale halves at the faulted step and not before;
 * - every rank agrees: the same statuses, skips, losses and scales, and without PP the same model. */
static test_result faults_nan_case(const faults_layout* L, mt_precision prec, int scale) {
    mt_config c = faults_config(L, prec, scale);
    mt_error err;
    test_result res = mt_config_finalize(&c, &err) == MT_OK ? TEST_PASS : TEST_FAIL;
    if (res != TEST_PASS) printf("    FAIL %s: %s\n", L->name, err.message);
    if (tp_agree(res) != TEST_PASS) return TEST_FAIL;
    const char* pname = prec == MT_FP16 ? (scale == 2 ? "fp16 dynamic scale" : "fp16 static scale") : "bf16";
    faults_run clean, run;
    if (scale != 2) res = tp_agree(faults_train(c, L, FAULT_NONE, 1, &clean));
    for (int kind = FAULT_GRADIENT; kind <= FAULT_WEIGHT && res == TEST_PASS; kind++) {
        if (scale == 2 && kind == FAULT_WEIGHT) break;
        if (tp_agree(faults_train(c, L, kind, 0, &run)) != TEST_PASS) return TEST_FAIL;
        const char* kname = kind == FAULT_GRADIENT ? "NaN gradient" : "NaN weight";
        const int overflow = prec == MT_FP16 && kind == FAULT_GRADIENT; /* fp16 skips an overflow, refuses a NaN loss */
        test_result mine = TEST_PASS;
        const int st = run.status[FAULT_AT];
        if (overflow ? (st != MT_OK || !run.skipped[FAULT_AT])
                     : (st != MT_ERR_NAN || !strstr(run.message, kind == FAULT_GRADIENT ? "in the gradients" : "in the loss"))) {
            printf("    FAIL %s %s %s rank %d: the faulted step returned %s, skipped %d: '%s'\n", L->name, pname, kname,
                   c.rank, mt_status_name((mt_status)st), run.skipped[FAULT_AT], run.message);
            mine = TEST_FAIL;
        }
        for (int k = 0; k < FAULT_STEPS; k++)
            if (k != FAULT_AT && (run.status[k] != MT_OK || run.skipped[k])) {
                printf("    FAIL %s %s %s rank %d: step %d returned %s, skipped %d\n", L->name, pname, kname, c.rank, k,
                       mt_status_name((mt_status)run.status[k]), run.skipped[k]);
                mine = TEST_FAIL;
            }
        if (run.before != run.after) {
            printf("    FAIL %s %s %s rank %d: the faulted step changed the weights\n", L->name, pname, kname, c.rank);
            mine = TEST_FAIL;
        }
        if (kind == FAULT_WEIGHT && isfinite(run.loss[FAULT_AT])) {
            printf("    FAIL %s %s %s rank %d: the faulted step's loss is finite (%.9g)\n", L->name, pname, kname,
                   c.rank, run.loss[FAULT_AT]);
            mine = TEST_FAIL;
        }
        if (scale != 2) {
            for (int k = 0; k < FAULT_STEPS; k++)
                if (k != FAULT_AT && memcmp(&run.loss[k], &clean.loss[k], sizeof(double))) {
                    printf("    FAIL %s %s %s rank %d: step %d loss %.9g, without the faulted batch %.9g\n", L->name,
                           pname, kname, c.rank, k, run.loss[k], clean.loss[k]);
                    mine = TEST_FAIL;
                    break;
                }
            if (run.last != clean.last) {
                printf("    FAIL %s %s %s rank %d: the final weights differ from the run without the faulted batch\n",
                       L->name, pname, kname, c.rank);
                mine = TEST_FAIL;
            }
        } else {
            const double s0 = run.scale[0];
            int halved = s0 == 1024.0 && run.scale[FAULT_AT + 1] == s0 / 2 && run.scale[FAULT_STEPS - 1] == s0 / 2;
            for (int k = 0; k <= FAULT_AT; k++) halved &= run.scale[k] == s0;
            if (!halved) {
                printf("    FAIL %s %s rank %d: loss scales", L->name, pname, c.rank);
                for (int k = 0; k < FAULT_STEPS; k++) printf(" %g", run.scale[k]);
                printf(" (want 1024 up to the overflow at step %d, 512 after)\n", FAULT_AT);
                mine = TEST_FAIL;
            }
        }
        /* every rank the same (the faulted step's loss aside: a NaN's bits need not agree) */
        double losses[FAULT_STEPS];
        memcpy(losses, run.loss, sizeof(losses));
        losses[FAULT_AT] = 0.0;
        int same = faults_same(run.status, sizeof(run.status)) & faults_same(run.skipped, sizeof(run.skipped)) &
                   faults_same(losses, sizeof(losses)) & faults_same(run.scale, sizeof(run.scale));
        if (L->pp == 1) same &= faults_same(run.last.data(), sizeof(float) * run.last.size());
        if (!same) {
            printf("    FAIL %s %s %s: the ranks disagree (statuses, skips, losses, scales or weights)\n", L->name,
                   pname, kname);
            mine = TEST_FAIL;
        }
        if (mine == TEST_PASS && c.rank == 0)
            printf("      %s %s %s: step %d %s on every rank (%s); %s\n", L->name, pname, kname, FAULT_AT,
                   overflow ? "skipped" : "refused", overflow ? "loss scale" : run.message,
                   scale == 2 ? "the scale halved on every rank" : "the run goes on bitwise as without that batch");
        res = tp_agree(mine);
    }
    return res;
}

static test_result faults_nan_layout(const faults_layout* L) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() % (L->tp * L->pp) != 0) SKIP("%s needs a multiple of %d processes", L->name, L->tp * L->pp);
    test_result r = faults_nan_case(L, MT_BF16, 0);
    if (r == TEST_PASS) r = faults_nan_case(L, MT_FP16, 1);
    if (r == TEST_PASS) r = faults_nan_case(L, MT_FP16, 2);
    return r;
}
static const faults_layout faults_dp = {"DP", 1, 1, 0};
static const faults_layout faults_dp_distributed = {"DP distributed optimizer", 1, 1, 1};
static const faults_layout faults_tp = {"TP 2 + SP", 2, 1, 0};
static const faults_layout faults_pp = {"PP 2", 1, 2, 0};
static test_result test_faults_nan_dp(void) { return faults_nan_layout(&faults_dp); }
static test_result test_faults_nan_dp_distributed(void) { return faults_nan_layout(&faults_dp_distributed); }
static test_result test_faults_nan_tp(void) { return faults_nan_layout(&faults_tp); }
static test_result test_faults_nan_pp(void) { return faults_nan_layout(&faults_pp); }

/* ---- several GPUs: an async save one rank cannot write ----------------------------------------- */

/* One case: 2 steps, a save (iteration 2), a step, then an async save (iteration 3) during which rank
 * `failing` cannot write (RLIMIT_FSIZE 1 MiB: its files are 5 MB and more; SIGXFSZ ignored, so the
 * write fails with EFBIG as on a full disk). Every rank's wait reports the failure (the failing rank's
 * own "cannot write" line, the others "failed on another rank"), nothing is committed (no
 * iter_0000003, no temporary directory, the tracker still 2, whose manifest verifies and which a load
 * selects); a new trainer loads iteration 2 bitwise (the weights as saved); and the same trainer's next
 * async save of iteration 3 commits. Every rank makes every collective call; the checks are made after. */
static test_result faults_save_case(const faults_layout* L, int failing, const char* dir) {
    mt_config c = faults_config(L, MT_BF16, 0);
    mt_error err;
    test_result res = mt_config_finalize(&c, &err) == MT_OK ? TEST_PASS : TEST_FAIL;
    if (res == TEST_PASS) res = fresh_comm_id(&c.comm_id, &err) == MT_OK ? TEST_PASS : TEST_FAIL;
    mt_trainer* t = NULL;
    if (res == TEST_PASS && mt_trainer_create(&t, &c, &err) != MT_OK) res = TEST_FAIL;
    if (res != TEST_PASS) printf("    FAIL %s rank %d: %s\n", L->name, c.rank, err.message);
    if (tp_agree(res) != TEST_PASS) {
        if (t) mt_trainer_free(t);
        return TEST_FAIL;
    }
    const int64_t n = mt_num_parameters(&c), per_step = (int64_t)mt_num_micro_batches(&c) * c.micro_batch_size * (c.seq_length + 1);
    const int dp_rank = mt_rank_coordinates(&c, c.rank).dp;
    std::vector<int32_t> tokens((size_t)per_step);
    std::vector<float> saved((size_t)n, 0.0f), loaded((size_t)n, 0.0f);
    mt_step_result r;
    mt_status st = MT_OK;
    for (int k = 0; k < 3 && st == MT_OK; k++) {
        fill_tokens(tokens.data(), per_step, (int)c.vocab_size, 6100 + 97 * k + 13 * (uint64_t)dp_rank);
        st = mt_trainer_train_step(t, tokens.data(), &r, &err);
        if (st == MT_OK && k == 1) st = mt_trainer_save(t, dir, 2, 2 * c.global_batch_size, &err);
        if (st == MT_OK && k == 1) st = mt_trainer_get_parameters(t, saved.data(), &err);
    }
    if (st != MT_OK) printf("    FAIL %s rank %d before the failing save: %s\n", L->name, c.rank, err.message);
    if (tp_agree(st == MT_OK ? TEST_PASS : TEST_FAIL) != TEST_PASS) {
        mt_trainer_free(t);
        return TEST_FAIL;
    }
    /* the failing save */
    const size_t limit_bytes = (size_t)1 << 20, mine = rank_checkpoint_bytes(t);
    struct rlimit old_limit, small;
    getrlimit(RLIMIT_FSIZE, &old_limit);
    small = old_limit;
    small.rlim_cur = limit_bytes;
    const int is_failing = c.rank == failing;
    fflush(stdout);
    void (*old_handler)(int) = is_failing ? signal(SIGXFSZ, SIG_IGN) : SIG_DFL;
    const int limited = is_failing && setrlimit(RLIMIT_FSIZE, &small) == 0;
    mt_error save_err;
    save_err.message[0] = 0;
    int64_t committed = -2;
    const mt_status st_save = mt_trainer_save_async(t, dir, 3, 3 * c.global_batch_size, &save_err);
    const mt_status st_wait = st_save == MT_OK ? mt_trainer_save_wait(t, 1, &committed, &save_err) : st_save;
    if (limited) setrlimit(RLIMIT_FSIZE, &old_limit);
    if (is_failing) signal(SIGXFSZ, old_handler);
    test_result local = TEST_PASS;
    if (is_failing && (!limited || mine <= limit_bytes)) {
        printf("    FAIL %s rank %d: the fault was not set up (limit %d, %zu bytes to write)\n", L->name, c.rank, limited, mine);
        local = TEST_FAIL;
    }
    const char* want = is_failing ? "cannot write" : "failed on another rank";
    if (st_save != MT_OK || st_wait == MT_OK || committed != -1 || !strstr(save_err.message, want) ||
        strchr(save_err.message, '\n')) {
        printf("    FAIL %s rank %d (rank %d failing): save %s, wait %s, committed %lld: '%s' (want '%s')\n", L->name,
               c.rank, failing, mt_status_name(st_save), mt_status_name(st_wait), (long long)committed, save_err.message,
               want);
        local = TEST_FAIL;
    }
    if (tp_agree(TEST_PASS) != TEST_PASS) local = TEST_FAIL; /* a barrier: every rank is past the save */
    if (c.rank == 0) {
        char path[600], tmp[600];
        snprintf(path, sizeof(path), "%s/iter_0000003", dir);
        snprintf(tmp, sizeof(tmp), "%s/.tmp_iter_0000003", dir);
        int64_t tracked = -1, chosen = -1;
        int fell_back = -1;
        char iter2[600];
        snprintf(iter2, sizeof(iter2), "%s/iter_0000002", dir);
        err.message[0] = 0;
        if (access(path, F_OK) == 0 || access(tmp, F_OK) == 0 || mt_checkpoint_read_tracker(dir, &tracked, &err) != MT_OK ||
            tracked != 2 || mt_checkpoint_manifest_verify(iter2, &err) != MT_OK ||
            mt_checkpoint_select(dir, -1, 0, &chosen, &fell_back, NULL, &err) != MT_OK || chosen != 2 || fell_back) {
            printf("    FAIL %s (rank %d failing): after the failed save: iter_0000003 %s, its temporary %s, tracker "
                   "%lld, selected %lld: %s\n", L->name, failing, access(path, F_OK) == 0 ? "exists" : "absent",
                   access(tmp, F_OK) == 0 ? "left" : "gone", (long long)tracked, (long long)chosen, err.message);
            local = TEST_FAIL;
        }
    }
    /* the previous checkpoint loads bitwise in a new trainer */
    mt_config c2 = c;
    mt_trainer* t2 = NULL;
    int64_t it = -1, consumed = -1;
    st = fresh_comm_id(&c2.comm_id, &err);
    if (st == MT_OK) st = mt_trainer_create(&t2, &c2, &err);
    if (st == MT_OK) st = mt_trainer_load(t2, dir, -1, &it, &consumed, &err);
    if (st == MT_OK) st = mt_trainer_get_parameters(t2, loaded.data(), &err);
    if (t2) mt_trainer_free(t2);
    if (st != MT_OK || it != 2 || loaded != saved) {
        printf("    FAIL %s rank %d (rank %d failing): loading the previous checkpoint: %s, iteration %lld, weights %s\n",
               L->name, c.rank, failing, st == MT_OK ? "ok" : err.message, (long long)it,
               loaded == saved ? "as saved" : "NOT as saved");
        local = TEST_FAIL;
    }
    /* the trainer whose save failed saves again */
    committed = -2;
    st = mt_trainer_save_async(t, dir, 3, 3 * c.global_batch_size, &err);
    if (st == MT_OK) st = mt_trainer_save_wait(t, 1, &committed, &err);
    mt_trainer_free(t);
    if (st != MT_OK || committed != 3) {
        printf("    FAIL %s rank %d: the save after the failed one: %s, committed %lld\n", L->name, c.rank,
               st == MT_OK ? "ok" : err.message, (long long)committed);
        local = TEST_FAIL;
    }
    if (tp_agree(TEST_PASS) != TEST_PASS) local = TEST_FAIL; /* every rank is past the commit */
    if (c.rank == 0) {
        char iter3[600];
        int64_t tracked = -1;
        snprintf(iter3, sizeof(iter3), "%s/iter_0000003", dir);
        if (mt_checkpoint_manifest_verify(iter3, &err) != MT_OK || mt_checkpoint_read_tracker(dir, &tracked, &err) != MT_OK ||
            tracked != 3) {
            printf("    FAIL %s: the save after the failed one: tracker %lld, %s\n", L->name, (long long)tracked, err.message);
            local = TEST_FAIL;
        }
    }
    if (local == TEST_PASS && c.rank == 0)
        printf("      %s, rank %d cannot write: every rank reports it, nothing committed, iteration 2 loads as saved, "
               "the next save commits\n", L->name, failing);
    return tp_agree(local);
}

static test_result test_faults_async_save_one_rank_fails(void) {
    REQUIRE_MPI_GPUS();
    const faults_layout layouts[2] = {faults_dp_distributed, faults_tp};
    test_result res = TEST_PASS;
    for (int i = 0; i < 2 && res == TEST_PASS; i++) {
        if (mpi_world() % (layouts[i].tp * layouts[i].pp) != 0) continue;
        /* a rank that writes, then rank 0, which also commits: without the distributed optimizer only
         * DP rank 0 writes, the first tp x pp ranks in Megatron's order (TP fastest); with it every rank */
        const int writer = layouts[i].distributed ? mpi_world() - 1 : layouts[i].tp * layouts[i].pp - 1;
        const int failing[2] = {writer, 0};
        for (int f = 0; f < 2 && res == TEST_PASS; f++) {
            char dir[128];
            if (!memory_shared_dir(dir, sizeof(dir), "faults_save")) SKIP("mkdtemp failed on rank 0");
            res = faults_save_case(&layouts[i], failing[f], dir);
            memory_shared_dir_remove(dir);
        }
    }
    return res;
}

static const test_case faults_multigpu_tests[] = {
    {"faults_nan_skipped_on_every_rank_dp", test_faults_nan_dp},
    {"faults_nan_skipped_on_every_rank_dp_distributed", test_faults_nan_dp_distributed},
    {"faults_nan_skipped_on_every_rank_tp", test_faults_nan_tp},
    {"faults_nan_skipped_on_every_rank_pp", test_faults_nan_pp},
    {"faults_async_save_one_rank_fails", test_faults_async_save_one_rank_fails},
};

#endif
