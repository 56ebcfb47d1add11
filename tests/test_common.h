/* tests/test_common.h — the tiny test harness shared by every test file of test_megatron.
 *
 * A test is `static test_result test_name(void)`; it returns TEST_PASS, or fails/skips through the
 * macros below, which print one line saying where and why (a skip's reason is also kept for the
 * runner's summary; SKIP_OR_FAIL_STRICT is a skip that fails under MT_TEST_STRICT=1). Each file under tests/ tests one feature
 * and ends with a table of its tests (test_case[]) per kind (host, GPU, multi-GPU), which
 * test_megatron.cu runs in order. Also here: whether a GPU or several MPI processes are there
 * (REQUIRE_GPU, REQUIRE_MPI_GPUS, the rank helpers) and the tests' token generator; the tiny model
 * configurations every test builds on are in tests/test_configs.h. */
#ifndef MT_TEST_COMMON_H
#define MT_TEST_COMMON_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#ifdef MT_USE_MPI
#include <mpi.h>
#endif

typedef enum { TEST_PASS = 0, TEST_FAIL = 1, TEST_SKIP = 2 } test_result;

typedef struct {
    const char* name;
    test_result (*run)(void);
} test_case;

/* Fail the current test with a message unless cond holds. */
#define EXPECT(cond, ...)                                                    \
    do {                                                                     \
        if (!(cond)) {                                                       \
            printf("    FAIL %s:%d: (%s) ", __FILE__, __LINE__, #cond);      \
            printf(__VA_ARGS__);                                             \
            printf("\n");                                                    \
            return TEST_FAIL;                                                \
        }                                                                    \
    } while (0)

static inline const char* test_error_message(const mt_error* e) { return e ? e->message : ""; }

/* Fail unless an mt_status is MT_OK, printing the library's message. */
#define EXPECT_OK(call, errp)                                                              \
    do {                                                                                   \
        mt_status st_ = (call);                                                            \
        if (st_ != MT_OK) {                                                                \
            printf("    FAIL %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,            \
                   mt_status_name(st_), test_error_message(errp));                         \
            return TEST_FAIL;                                                              \
        }                                                                                  \
    } while (0)

/* The runner's state that the macros write: why the current test skipped (the summary lists it). */
typedef struct {
    char skip_reason[240];
} test_harness;
static test_harness test_state;

/* Keeps a skip's reason (cut to the buffer) and prints it. */
static void test_note_skip(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void test_note_skip(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(test_state.skip_reason, sizeof(test_state.skip_reason), fmt, ap);
    va_end(ap);
    printf("    skip: %s\n", test_state.skip_reason);
}

/* Skip the current test with a reason (one line; the runner names it in the summary). */
#define SKIP(...)                        \
    do {                                 \
        test_note_skip(__VA_ARGS__);     \
        return TEST_SKIP;                \
    } while (0)

/* MT_TEST_STRICT=1 (dev/gpu_check.sh sets it on the GPU machine): a skip that must not happen there
 * fails instead. SKIP_OR_FAIL_STRICT is for those sites: a data or vector file the repository ships
 * (dev/data/...; not ../shared, which the GPU machine lacks), a binary `make all` builds, a GPU
 * feature an H100/H200 has (FP8, cuBLASLt's blockwise GEMMs). Elsewhere it is SKIP. */
static int test_strict(void) {
    const char* s = getenv("MT_TEST_STRICT");
    return s && s[0] && strcmp(s, "0") != 0;
}
#define SKIP_OR_FAIL_STRICT(...)                                           \
    do {                                                                   \
        if (test_strict()) {                                               \
            printf("    FAIL %s:%d: (MT_TEST_STRICT=1, no skip) ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                                           \
            printf("\n");                                                  \
            return TEST_FAIL;                                              \
        }                                                                  \
        SKIP(__VA_ARGS__);                                                 \
    } while (0)

/* The skip reasons the summary folds into one count each (on a machine without a GPU nearly every
 * GPU test gives the first; the multi-GPU tests run in one process give the second). Any other
 * reason is listed by test name. */
#define TEST_SKIP_NO_GPU "no GPU visible"
#define TEST_SKIP_NO_MPI "needs several processes: mpirun -np 2 ./test_megatron multigpu"

/* Runs a shell command, its stdout captured into out (NUL-terminated, at most cap - 1 bytes); returns
 * the exit status (-1: it did not exit). */
static inline int test_command_output(const char* cmd, char* out, size_t cap) {
    FILE* p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Reads a whole file into a malloc'd buffer (NUL-terminated); NULL if it cannot. */
static inline char* test_read_file(const char* path, size_t* size_out) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* buf = (char*)malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); buf = NULL; }
    fclose(f);
    if (buf) { buf[n] = 0; if (size_out) *size_out = (size_t)n; }
    return buf;
}

/* ---- where a test runs: a GPU, several MPI processes ---- */

static int gpu_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n > 0;
}
#define REQUIRE_GPU() \
    do { if (!gpu_available()) SKIP(TEST_SKIP_NO_GPU); } while (0)

/* A test of one of section 13's Hopper (sm_90a) kernels, `available` its probe (hopper_gemm_available,
 * hopper_attention_available, ...) run into *state (zeroed first; the test may pass it on): skips without a
 * GPU or on another compute capability; on a Hopper GPU whose build lacks the sm_90a code it fails under
 * MT_TEST_STRICT (GPU_ARCH=90 builds it), else skips. */
#define REQUIRE_HOPPER(available, state, what)                                                             \
    do {                                                                                                   \
        REQUIRE_GPU();                                                                                     \
        memset((state), 0, sizeof *(state));                                                               \
        if (!available(state)) {                                                                           \
            int dev_ = 0, major_ = 0;                                                                      \
            cudaGetDevice(&dev_);                                                                          \
            cudaDeviceGetAttribute(&major_, cudaDevAttrComputeCapabilityMajor, dev_);                      \
            cudaGetLastError();                                                                            \
            if (major_ == 9) SKIP_OR_FAIL_STRICT("a Hopper GPU, but no sm_90a kernel in this build (GPU_ARCH=90 builds it)"); \
            SKIP("%s needs a compute capability 9.x GPU", what);                                           \
        }                                                                                                  \
    } while (0)

static int mpi_rank(void) {
    int r = 0;
#ifdef MT_USE_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Comm_rank(MPI_COMM_WORLD, &r);
#endif
    return r;
}
static int mpi_world(void) {
    int w = 1;
#ifdef MT_USE_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Comm_size(MPI_COMM_WORLD, &w);
#endif
    return w;
}
static int mpi_local_rank(void) {
    int r = 0;
#ifdef MT_USE_MPI
    if (mpi_world() > 1) {
        MPI_Comm node;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, mpi_rank(), MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &r);
        MPI_Comm_free(&node);
    }
#endif
    return r;
}
/* A new NCCL id for every data-parallel trainer (an id serves one communicator). */
static mt_status fresh_comm_id(mt_comm_id* id, mt_error* err) {
    memset(id, 0, sizeof(*id));
    mt_status st = MT_OK;
    if (mpi_rank() == 0) st = mt_comm_id_create(id, err);
#ifdef MT_USE_MPI
    if (mpi_world() > 1) MPI_Bcast(id, (int)sizeof(*id), MPI_BYTE, 0, MPI_COMM_WORLD); /* not in a process alone */
#endif
    return st;
}
#define REQUIRE_MPI_GPUS()                                                                     \
    do {                                                                                       \
        if (mpi_world() < 2) SKIP(TEST_SKIP_NO_MPI);                                            \
        if (!gpu_available()) SKIP(TEST_SKIP_NO_GPU);                                          \
    } while (0)

/* ---- data ---- */

/* Random tokens with a little structure (so the loss can fall), from a fixed LCG. */
static void fill_tokens(int32_t* tokens, int64_t n, int vocab, uint64_t seed) {
    uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int r = (int)((x >> 33) % (uint64_t)vocab);
        tokens[i] = (i % 3 == 2) ? (tokens[i - 1] * 7 + 3) % vocab : r;
    }
}

/* bf16 on the host: round to nearest even (finite values), and back. The GPU tests' references. */
static inline uint16_t test_bf16_from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float test_bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
