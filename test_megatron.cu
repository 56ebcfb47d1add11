/* test_megatron.cu — the test suite of megatron.c.
 *
 * `make test` builds and runs it. Each file under tests/ tests one feature; its tests are of three
 * kinds, and each group below is named kind.feature: host tests run on any machine; gpu tests skip
 * when no GPU is visible; multigpu tests run under mpirun (`mpirun -np 2 ./test_megatron multigpu`:
 * then only they run, every rank takes part, rank 0 reports, and a test fails if it failed on any
 * rank). It includes megatron.cu whole (one translation unit), so tests can reach the kernels
 * behind the API.
 * Usage: ./test_megatron [filter]: only the tests whose name, group or group.name contains the filter, e.g.
 * `gpu` (every GPU test), `host`, `gpu.model`, `tensor_parallel` (that feature, every kind);
 * `./test_megatron --list` prints every test's full name.
 * MT_TEST_SHARD=k/n (one process) runs every n-th selected test from the k-th (0-based), so that n
 * processes, one per GPU, share the suite (dev/gpu_check.sh does this on machines with several GPUs).
 * The summary at the end names each skipped test with its reason (`skipped: group/name (reason)`; the
 * reasons every GPU or multi-GPU test gives on a machine without them are folded into one count
 * line each, `skipped (reason): N tests`), then the failed tests; its last line is always
 * `N passed, N failed, N skipped`. MT_TEST_STRICT=1 (dev/gpu_check.sh) turns the skips that must not
 * happen on the GPU machine into failures (SKIP_OR_FAIL_STRICT in tests/test_common.h). */
#include "megatron.cu"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

#include "tests/test_common.h"
#include "tests/test_configs.h"
#include "tests/test_dataset.h"
#include "tests/test_tokenizer.h"
#include "tests/test_config.h"
#include "tests/test_model.h"
#include "tests/test_moe.h"
#include "tests/test_precision.h"
#include "tests/test_checkpoint.h"
#include "tests/test_attention.h"
#include "tests/test_kernels.h"
#include "tests/test_cp_attention.h"
#include "tests/test_moe_kernels.h"
#include "tests/test_fp8.h"
#include "tests/test_data_parallel.h"
#include "tests/test_expert_parallel.h"
#include "tests/test_tensor_parallel.h"
#include "tests/test_pipeline_schedule.h"
#include "tests/test_pipeline.h"
#include "tests/test_hf.h"
#include "tests/test_header.h"
#include "tests/test_layout.h"
#include "tests/test_hostile.h"
#include "tests/test_tensorboard.h"
#include "tests/test_evaluation.h"
#include "tests/test_flags.h"
#include "tests/test_moe_config.h"
#include "tests/test_memory.h"
#include "tests/test_context_parallel.h"
#include "tests/test_recompute.h"
#include "tests/test_checkpoint_tool.h"
#include "tests/test_watchdog.h"
#include "tests/test_dropout.h"
#include "tests/test_faults.h"
#include "tests/test_generate.h"
#include "tests/test_serve.h"
#include "tests/test_runner.h"

typedef struct {
    const char* group; /* kind.feature: kind is host, gpu or multigpu */
    const test_case* cases;
    size_t count;
} test_group;

#define GROUP(name, table) {name, table, sizeof(table) / sizeof(table[0])}

/* A skipped test, for the summary. */
typedef struct {
    const char* group;
    const char* name;
    char reason[sizeof(test_state.skip_reason)];
} test_skipped;

/* The summary's skips: each by name with its reason, except TEST_SKIP_NO_GPU and TEST_SKIP_NO_MPI,
 * counted in one line each (the lines dev/gpu_check.sh compares with dev/gpu_expected_skips.txt). */
static void print_skipped(const test_skipped* skips, int n) {
    static const char* const folded[2] = {TEST_SKIP_NO_GPU, TEST_SKIP_NO_MPI};
    int counts[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        int k = 0;
        while (k < 2 && strcmp(skips[i].reason, folded[k]) != 0) k++;
        if (k < 2) counts[k]++;
        else printf("skipped: %s/%s (%s)\n", skips[i].group, skips[i].name, skips[i].reason);
    }
    for (int k = 0; k < 2; k++)
        if (counts[k]) printf("skipped (%s): %d test%s\n", folded[k], counts[k], counts[k] == 1 ? "" : "s");
}

/* A test runs when the filter is part of its name, of its group, or of its full name
 * "<group>.<name>" (e.g. gpu.fp8.fp8_blockwise_tracks_reference: that test alone). */
static int test_selected(const char* filter, const char* group, const char* name) {
    if (strstr(name, filter) || strstr(group, filter)) return 1;
    char full[256];
    snprintf(full, sizeof(full), "%s.%s", group, name);
    return strstr(full, filter) != NULL;
}

/* the multi-GPU groups: "multigpu" or "multigpu.<feature>" */
static int group_is_multigpu(const char* group) {
    return strncmp(group, "multigpu", 8) == 0 && (group[8] == 0 || group[8] == '.');
}

int main(int argc, char** argv) {
    const char* filter = argc > 1 ? argv[1] : NULL;
    int world = 1;
#ifdef MT_USE_MPI
    int rank = 0;
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK")) { /* under mpirun / srun */
        MPI_Init(&argc, &argv);
        MPI_Comm_size(MPI_COMM_WORLD, &world);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        /* rank 0 reports; the others' output goes to <MT_TEST_LOG_DIR, default /tmp>/mt_test_rank<r>.log
         * (a failure seen on one rank alone says why there; dev/gpu_check.sh prints those lines) */
        char rank_log[4200];
        const char* log_dir = getenv("MT_TEST_LOG_DIR"); /* two jobs at once on one machine: one each */
        snprintf(rank_log, sizeof(rank_log), "%s/mt_test_rank%d.log", log_dir && *log_dir ? log_dir : "/tmp", rank);
        if (rank != 0 && !freopen(rank_log, "w", stdout) && !freopen("/dev/null", "w", stdout)) return 1;
        setvbuf(stdout, NULL, _IOLBF, 0); /* every line out, also when MPI aborts the job */
    }
#endif
    test_group groups[] = {
        GROUP("host.dataset", dataset_tests),
        GROUP("host.tokenizer", tokenizer_tests),
        GROUP("host.config", config_tests),
        GROUP("host.flags", flags_tests),
        GROUP("host.moe_config", moe_config_tests),
        GROUP("host.data_parallel", data_parallel_tests),
        GROUP("host.tensor_parallel", tensor_parallel_tests),
        GROUP("host.pipeline", pipeline_schedule_tests),
        GROUP("host.pipeline", pipeline_tests),
        GROUP("host.hf", hf_tests),
        GROUP("host.header", header_tests),
        GROUP("host.layout", layout_tests),
        GROUP("host.hostile", hostile_tests),
        GROUP("host.tensorboard", tensorboard_tests),
        GROUP("host.evaluation", evaluation_tests),
        GROUP("host.memory", memory_tests),
        GROUP("host.recompute", recompute_tests),
        GROUP("host.checkpoint_tool", checkpoint_tool_tests),
        GROUP("host.watchdog", watchdog_tests),
        GROUP("host.dropout", dropout_tests),
        GROUP("host.faults", faults_tests),
        GROUP("host.serve", serve_tests),
        GROUP("host.runner", runner_tests),
        GROUP("host.moe_kernels", moe_kernels_host_tests),
        GROUP("host.generate", generate_tests),
        GROUP("host.context_parallel", context_parallel_tests),
        GROUP("host.attention", attention_host_tests),
        GROUP("host.fp8", fp8_host_tests),
        GROUP("gpu.model", model_gpu_tests),
        GROUP("gpu.moe", moe_gpu_tests),
        GROUP("gpu.flags", flags_gpu_tests),
        GROUP("gpu.precision", precision_gpu_tests),
        GROUP("gpu.checkpoint", checkpoint_gpu_tests),
        GROUP("gpu.checkpoint_tool", checkpoint_tool_gpu_tests),
        GROUP("gpu.attention", attention_gpu_tests),
        GROUP("gpu.kernels", kernels_gpu_tests),
        GROUP("gpu.cp_attention", cp_attention_gpu_tests),
        GROUP("gpu.moe_kernels", moe_kernels_gpu_tests),
        GROUP("gpu.fp8", fp8_tests),
        GROUP("gpu.data_parallel", data_parallel_gpu_tests),
        GROUP("gpu.tensor_parallel", tensor_parallel_gpu_tests),
        GROUP("gpu.hf", hf_gpu_tests),
        GROUP("gpu.evaluation", evaluation_gpu_tests),
        GROUP("gpu.memory", memory_gpu_tests),
        GROUP("gpu.recompute", recompute_gpu_tests),
        GROUP("gpu.hostile", hostile_gpu_tests),
        GROUP("gpu.watchdog", watchdog_gpu_tests),
        GROUP("gpu.dropout", dropout_gpu_tests),
        GROUP("gpu.faults", faults_gpu_tests),
        GROUP("gpu.generate", generate_gpu_tests),
        GROUP("gpu.context_parallel", context_parallel_gpu_tests),
        GROUP("multigpu.data_parallel", data_parallel_multigpu_tests),
        GROUP("multigpu.expert_parallel", expert_parallel_multigpu_tests),
        GROUP("multigpu.context_parallel", context_parallel_multigpu_tests),
        GROUP("multigpu.tensor_parallel", tensor_parallel_multigpu_tests),
        GROUP("multigpu.pipeline", pipeline_multigpu_tests),
        GROUP("multigpu.memory", memory_multigpu_tests),
        GROUP("multigpu.checkpoint_tool", checkpoint_tool_multigpu_tests),
        GROUP("multigpu.recompute", recompute_multigpu_tests),
        GROUP("multigpu.faults", faults_multigpu_tests),
        GROUP("multigpu.cp_attention", cp_attention_multigpu_tests),
    };
    int passed = 0, failed = 0, skipped = 0;
    const char* failed_names[64];
    size_t num_tests = 0;
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++) num_tests += groups[g].count;
    test_skipped* skips = (test_skipped*)calloc(num_tests, sizeof(test_skipped));
    if (!skips) return 1;
    int shard = 0, shards = 1, selected = 0;
    const char* shard_env = getenv("MT_TEST_SHARD");
    if (shard_env && world == 1) {
        char tail = 0;
        if (sscanf(shard_env, "%d/%d%c", &shard, &shards, &tail) != 2 || shards < 1 || shards > 1024 ||
            shard < 0 || shard >= shards) {
            printf("MT_TEST_SHARD=%s: expected k/n with 0 <= k < n <= 1024\n", shard_env);
            return 2;
        }
    }
    if (filter && !strcmp(filter, "--list")) { /* every test's full name, one a line (dev/mutation_check.sh) */
        for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++)
            for (size_t i = 0; i < groups[g].count; i++) printf("%s.%s\n", groups[g].group, groups[g].cases[i].name);
        free(skips);
        return 0;
    }
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++) {
        /* several processes run the multi-GPU tests only */
        if (world > 1 && !group_is_multigpu(groups[g].group)) continue;
        for (size_t i = 0; i < groups[g].count; i++) {
            const test_case* t = &groups[g].cases[i];
            if (filter && !test_selected(filter, groups[g].group, t->name)) continue;
            if (selected++ % shards != shard) continue;
            printf("[%s] %s\n", groups[g].group, t->name);
            fflush(stdout);
            test_state.skip_reason[0] = 0;
            test_result r = t->run();
#ifdef MT_USE_MPI
            if (world > 1) { /* the worst outcome over the ranks: fail > skip > pass */
                int mine = r == TEST_FAIL ? 2 : r == TEST_SKIP ? 1 : 0, worst = 0;
                MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
                if (worst == 2 && r != TEST_FAIL) printf("    FAIL on another rank\n");
                if (worst == 1) { /* the reason of the lowest rank that gave one, for the summary */
                    int me = mine == 1 && test_state.skip_reason[0] ? rank : world, first = world;
                    MPI_Allreduce(&me, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
                    if (first < world)
                        MPI_Bcast(test_state.skip_reason, (int)sizeof(test_state.skip_reason), MPI_CHAR, first, MPI_COMM_WORLD);
                }
                r = worst == 2 ? TEST_FAIL : worst == 1 ? TEST_SKIP : TEST_PASS;
            }
#endif
            if (r == TEST_PASS) passed++;
            else if (r == TEST_FAIL) {
                printf("    => %s failed\n", t->name);
                if (failed < 64) failed_names[failed] = t->name;
                failed++;
            } else {
                test_skipped* k = &skips[skipped++];
                k->group = groups[g].group;
                k->name = t->name;
                snprintf(k->reason, sizeof(k->reason), "%s", test_state.skip_reason[0] ? test_state.skip_reason : "no reason given");
                for (char* c = k->reason; *c; c++)
                    if (*c == '\n') *c = ' ';
            }
        }
    }
    print_skipped(skips, skipped);
    for (int i = 0; i < failed && i < 64; i++) printf("failed: %s\n", failed_names[i]);
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    free(skips);
#ifdef MT_USE_MPI
    if (world > 1) MPI_Finalize();
#endif
    return failed ? 1 : 0;
}
