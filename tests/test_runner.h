/* tests/test_runner.h — the runner's summary and strict mode (test_megatron.cu, tests/test_common.h).
 *
 * Host test: test_megatron runs itself as a subprocess from an empty temporary directory, where the
 * pipeline schedule vector files (dev/data/pipeline_vectors/) are absent, filtered to the two tests
 * that read them:
 *   - without MT_TEST_STRICT both skip, the summary names each (`skipped: host.pipeline/<name>
 *     (<reason>)`) before the last line `0 passed, 0 failed, 2 skipped`, exit status 0;
 *   - with MT_TEST_STRICT=1 both fail (`failed: <name>`, `0 passed, 2 failed, 0 skipped`), exit 1;
 *   - sharded (MT_TEST_SHARD=1/2) the one test of shard 1 is the one named;
 *   - the multi-GPU tests run in one process skip with TEST_SKIP_NO_MPI, folded into one count line
 *     and named nowhere. */
#ifndef MT_TEST_RUNNER_H
#define MT_TEST_RUNNER_H

#include <unistd.h>

/* Runs `cd dir && env <env> <this binary> <filter>`; returns the exit status, output in out. */
static int trn_run(const char* dir, const char* env, const char* filter, char* out, size_t cap) {
    char exe[1024], cmd[2600];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return -2;
    exe[n] = 0;
    snprintf(cmd, sizeof(cmd), "cd '%s' && env -u MT_TEST_SHARD -u MT_TEST_STRICT %s '%s' '%s' 2>&1", dir, env, exe, filter);
    return test_command_output(cmd, out, cap);
}

/* The last line of out (its trailing newline dropped), copied into line. */
static void trn_last_line(const char* out, char* line, size_t cap) {
    size_t n = strlen(out);
    while (n > 0 && out[n - 1] == '\n') n--;
    size_t start = n;
    while (start > 0 && out[start - 1] != '\n') start--;
    snprintf(line, cap, "%.*s", (int)(n - start), out + start);
}

static test_result test_runner_lists_skips_and_strict_fails(void) {
    char dir[64];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_runner_XXXXXX");
    EXPECT(mkdtemp(dir) != NULL, "mkdtemp");
    const size_t cap = 1 << 16;
    char* out = (char*)malloc(cap);
    char last[256];
    test_result res = TEST_FAIL;
    do {
        /* plain: two skips, each named with its reason, the count line last */
        int st = trn_run(dir, "", "pipeline_schedule_vectors", out, cap);
        trn_last_line(out, last, sizeof(last));
        printf("    plain:  exit %d, %s\n", st, last);
        if (st != 0 || strcmp(last, "0 passed, 0 failed, 2 skipped") != 0 ||
            !strstr(out, "\nskipped: host.pipeline/pipeline_schedule_vectors (dev/data/pipeline_vectors/schedules.txt missing") ||
            !strstr(out, "\nskipped: host.pipeline/pipeline_schedule_vectors_mcore (dev/data/pipeline_vectors/schedules_mcore.txt missing")) {
            printf("    FAIL the plain run's summary:\n%s\n", out);
            break;
        }
        /* strict: the same two fail */
        st = trn_run(dir, "MT_TEST_STRICT=1", "pipeline_schedule_vectors", out, cap);
        trn_last_line(out, last, sizeof(last));
        printf("    strict: exit %d, %s\n", st, last);
        if (st != 1 || strcmp(last, "0 passed, 2 failed, 0 skipped") != 0 || strstr(out, "\nskipped") ||
            !strstr(out, "\nfailed: pipeline_schedule_vectors\n") || !strstr(out, "\nfailed: pipeline_schedule_vectors_mcore\n") ||
            !strstr(out, "MT_TEST_STRICT=1")) {
            printf("    FAIL the strict run's summary:\n%s\n", out);
            break;
        }
        /* a shard: its one test is named */
        st = trn_run(dir, "MT_TEST_SHARD=1/2", "pipeline_schedule_vectors", out, cap);
        trn_last_line(out, last, sizeof(last));
        printf("    shard 1/2: exit %d, %s\n", st, last);
        if (st != 0 || strcmp(last, "0 passed, 0 failed, 1 skipped") != 0 ||
            !strstr(out, "\nskipped: host.pipeline/pipeline_schedule_vectors_mcore (") ||
            strstr(out, "\nskipped: host.pipeline/pipeline_schedule_vectors (")) {
            printf("    FAIL the shard's summary:\n%s\n", out);
            break;
        }
        /* folded: the multi-GPU tests in one process, one count line, no names */
        st = trn_run(dir, "", "multigpu.recompute", out, cap);
        trn_last_line(out, last, sizeof(last));
        printf("    folded: exit %d, %s\n", st, last);
        if (st != 0 || strcmp(last, "0 passed, 0 failed, 2 skipped") != 0 || strstr(out, "\nskipped: ") ||
            !strstr(out, "\nskipped (" TEST_SKIP_NO_MPI "): 2 tests\n")) {
            printf("    FAIL the folded summary:\n%s\n", out);
            break;
        }
        res = TEST_PASS;
    } while (0);
    free(out);
    rmdir(dir);
    return res;
}

static const test_case runner_tests[] = {
    {"runner_lists_skips_and_strict_fails", test_runner_lists_skips_and_strict_fails},
};

#endif
