/* tests/test_moe_kernels.h — megatron.cu section 14, the mixture-of-experts kernels.
 *
 * Host: Megatron's token order (n = t*B + j) against rows (r = j*T + t), both ways; the scratch size
 * rule; when capacity dropping applies.
 */
#ifndef MT_TEST_MOE_KERNELS_H
#define MT_TEST_MOE_KERNELS_H

#include <vector>

/* ============================================================================================== */
/* Host tests                                                                                       */
/* ============================================================================================== */

/* n = t*B + j for row r = j*T + t: a bijection, both ways, on every shape (B = 1 is the identity). */
static test_result test_moe_token_order(void) {
    const int shapes[][2] = {{1, 1}, {1, 7}, {2, 3}, {4, 16}, {3, 5}, {8, 1}};
    for (const auto& s : shapes) {
        const int B = s[0], T = s[1], N = B * T;
        std::vector<int> seen((size_t)N, 0);
        for (int j = 0; j < B; j++)
            for (int t = 0; t < T; t++) {
                const int r = j * T + t, n = t * B + j;
                EXPECT(moe_row_of_token(n, B, T) == r, "B %d T %d: row of token %d is %d, expected %d", B, T, n,
                       moe_row_of_token(n, B, T), r);
                EXPECT(moe_token_of_row(r, B, T) == n, "B %d T %d: token of row %d is %d, expected %d", B, T, r,
                       moe_token_of_row(r, B, T), n);
                seen[(size_t)n]++;
            }
        for (int n = 0; n < N; n++) EXPECT(seen[(size_t)n] == 1, "B %d T %d: token %d seen %d times", B, T, n, seen[(size_t)n]);
    }
    /* a worked example: B = 2, T = 3: rows 0..2 are sequence 0, tokens 0, 2, 4; rows 3..5 tokens 1, 3, 5 */
    const int want[6] = {0, 2, 4, 1, 3, 5};
    for (int r = 0; r < 6; r++) EXPECT(moe_token_of_row(r, 2, 3) == want[r], "row %d", r);
    return TEST_PASS;
}

/* The scratch the launchers use fits moe_work_words: moe_route's map and keys (2 N E words), moe_aux_stats'
 * scores (N E) and per-token lse^2 (N); and dropping applies exactly when 0 < C < N. */
static test_result test_moe_work_and_capacity_rules(void) {
    const int sizes[][3] = {{64, 8, 1}, {8192, 256, 4}, {65536, 128, 1}, {1, 1, 1}};
    for (const auto& s : sizes) {
        const int N = s[0], E = s[1], B = s[2];
        const int64_t w = moe_work_words(N, E, B);
        EXPECT(w >= 2LL * N * E && w >= (int64_t)N * E + N, "N %d E %d: %lld words", N, E, (long long)w);
    }
    moe_routing r;
    memset(&r, 0, sizeof(r));
    r.N = 100;
    const int caps[][2] = {{0, 0}, {1, 1}, {99, 1}, {100, 0}, {250, 0}};
    for (const auto& c : caps) {
        r.capacity = c[0];
        EXPECT((int)moe_drops(r) == c[1], "C %d N %d: drops %d", c[0], r.N, (int)moe_drops(r));
    }
    return TEST_PASS;
}

static const test_case moe_kernels_host_tests[] = {
    {"moe_token_order", test_moe_token_order},
    {"moe_work_and_capacity_rules", test_moe_work_and_capacity_rules},
};

#endif
