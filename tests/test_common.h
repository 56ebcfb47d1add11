/* tests/test_common.h — the tiny test harness shared by every test file of test_megatron.
 *
 * A test is `static test_result test_name(void)`; it returns TEST_PASS, or fails/skips through the
 * macros below, which print one line saying where and why. Each file under tests/ ends with a table of
 * its tests (test_case[]), which test_megatron.cu runs in order. */
#ifndef MT_TEST_COMMON_H
#define MT_TEST_COMMON_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#define SKIP(...)                     \
    do {                              \
        printf("    skip: ");         \
        printf(__VA_ARGS__);          \
        printf("\n");                 \
        return TEST_SKIP;             \
    } while (0)

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

#endif
