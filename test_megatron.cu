/* test_megatron.cu — the test suite of megatron.c.
 *
 * `make test` builds and runs it. Host tests run on any machine; GPU tests skip when no GPU is
 * visible; multi-GPU tests run under mpirun (`mpirun -np 2 ./test_megatron multigpu`: then only they
 * run, every rank takes part, rank 0 reports, and a test fails if it failed on any rank). It
 * includes megatron.cu whole (one translation unit), so tests can reach the kernels behind the API.
 * Usage: ./test_megatron [substring-filter]. The last line is always `N passed, N failed, N skipped`. */
#include "megatron.cu"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

#include "tests/test_common.h"
#include "tests/test_dataset.h"
#include "tests/test_tokenizer.h"
#include "tests/test_train.h"
#include "tests/test_gpu.h"
#include "tests/test_flash.h"
#include "tests/test_fp8.h"
#include "tests/test_parallel.h"
#include "tests/test_tp.h"
#include "tests/test_hf.h"

typedef struct {
    const char* group;
    const test_case* cases;
    size_t count;
} test_group;

#define GROUP(name, table) {name, table, sizeof(table) / sizeof(table[0])}

int main(int argc, char** argv) {
    const char* filter = argc > 1 ? argv[1] : NULL;
    int world = 1, rank = 0;
#ifdef MT_USE_MPI
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK")) { /* under mpirun / srun */
        MPI_Init(&argc, &argv);
        MPI_Comm_size(MPI_COMM_WORLD, &world);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        if (rank != 0 && !freopen("/dev/null", "w", stdout)) return 1;
    }
#endif
    test_group groups[] = {
        GROUP("dataset", dataset_tests),
        GROUP("tokenizer", tokenizer_tests),
        GROUP("train", train_tests),
        GROUP("parallel", parallel_tests),
        GROUP("tp", tp_host_tests),
        GROUP("hf", hf_tests),
        GROUP("gpu", gpu_tests),
        GROUP("gpu", flash_tests),
        GROUP("gpu", fp8_tests),
        GROUP("gpu", tp_gpu_tests),
        GROUP("multigpu", multigpu_tests),
        GROUP("multigpu", tp_multigpu_tests),
    };
    int passed = 0, failed = 0, skipped = 0;
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++) {
        /* several processes run the multi-GPU tests only */
        if (world > 1 && strcmp(groups[g].group, "multigpu") != 0) continue;
        for (size_t i = 0; i < groups[g].count; i++) {
            const test_case* t = &groups[g].cases[i];
            if (filter && !strstr(t->name, filter) && !strstr(groups[g].group, filter)) continue;
            printf("[%s] %s\n", groups[g].group, t->name);
            fflush(stdout);
            test_result r = t->run();
#ifdef MT_USE_MPI
            if (world > 1) { /* the worst outcome over the ranks: fail > skip > pass */
                int mine = r == TEST_FAIL ? 2 : r == TEST_SKIP ? 1 : 0, worst = 0;
                MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
                if (worst == 2 && r != TEST_FAIL) printf("    FAIL on another rank\n");
                r = worst == 2 ? TEST_FAIL : worst == 1 ? TEST_SKIP : TEST_PASS;
            }
#endif
            if (r == TEST_PASS) passed++;
            else if (r == TEST_FAIL) failed++;
            else skipped++;
        }
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
#ifdef MT_USE_MPI
    if (world > 1) MPI_Finalize();
#endif
    return failed ? 1 : 0;
}
