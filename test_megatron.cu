/* test_megatron.cu — the test suite of megatron.c.
 *
 * `make test` builds and runs it. Host tests run on any machine; GPU tests skip when no GPU is
 * visible; multi-GPU tests run under mpirun. It includes megatron.cu whole (one translation unit),
 * so tests can reach the kernels behind the API. Usage: ./test_megatron [substring-filter]
 * The last line is always `N passed, N failed, N skipped`. */
#include "megatron.cu"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

#include "tests/test_common.h"
#include "tests/test_dataset.h"
#include "tests/test_tokenizer.h"
#include "tests/test_train.h"
#include "tests/test_gpu.h"

typedef struct {
    const char* group;
    const test_case* cases;
    size_t count;
} test_group;

#define GROUP(name, table) {name, table, sizeof(table) / sizeof(table[0])}

int main(int argc, char** argv) {
    const char* filter = argc > 1 ? argv[1] : NULL;
    test_group groups[] = {
        GROUP("dataset", dataset_tests),
        GROUP("tokenizer", tokenizer_tests),
        GROUP("train", train_tests),
        GROUP("gpu", gpu_tests),
    };
    int passed = 0, failed = 0, skipped = 0;
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++) {
        for (size_t i = 0; i < groups[g].count; i++) {
            const test_case* t = &groups[g].cases[i];
            if (filter && !strstr(t->name, filter) && !strstr(groups[g].group, filter)) continue;
            printf("[%s] %s\n", groups[g].group, t->name);
            fflush(stdout);
            test_result r = t->run();
            if (r == TEST_PASS) passed++;
            else if (r == TEST_FAIL) failed++;
            else skipped++;
        }
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
