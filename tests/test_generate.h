/* tests/test_generate.h — the generation engine (megatron.h section 15b, megatron.cu sections 22-23):
 * continuous batching over a block KV cache, decode attention, GPU sampling.
 *
 * host: the settings the engine refuses (mt_generator_supported, mt_generator_config_check,
 *       mt_generator_request_check: each bad value named), the blocks a request takes, and the draw's
 *       counter-based uniform (gen_uniform, the same function the sampling kernel calls): in [0, 1),
 *       a function of (seed, index) alone, and uniform (chi-square over 64 bins); the decode GEMV's cut of K
 *       into slices (every weight vector read once, slices in order, one round of loads a warp).
 * gpu:  on small random GPT-2 and Llama models (fp32; weights scaled up so that attention is peaked
 *       and the logits spread, which makes a wrong position, a wrong cached key or a wrong head show):
 *       KV-cache decoding against a full recompute (mt_trainer_logits of the finished sequence: every
 *       greedy token its argmax, every log-probability and prompt log-probability within 1e-4) with
 *       requests that reach max_context and cross decode-attention splits and cache blocks; batch
 *       independence (requests alone and together, joining at different steps: the same tokens; eager
 *       launches against the decode steps' CUDA graphs);
 *       sampling (same seed same tokens, other seeds differ, top_k 1 = greedy, the frequencies of 4096
 *       draws against the softmax by chi-square, with and without temperature, top-k and top-p, and
 *       never a token outside the kept set); stop tokens, max_new_tokens and max_new_tokens 0; blocks
 *       reused after requests finish and are cancelled
 *       (the reused blocks' stale contents change nothing); greedy tokens equal to Hugging Face
 *       transformers' greedy generate on a tiny GPT-2 and Llama (dev/hf_generate_check.py; skipped
 *       without transformers) and, in bf16, the log-probabilities of transformers' tokens within a
 *       stated tolerance; the decode GEMV (gemv_rows) against a float64 reference per element, every
 *       epilogue, tails in both dimensions, fp32 and bf16, bitwise repeatable and independent of the rows
 *       beside a row. */
#ifndef MT_TEST_GENERATE_H
#define MT_TEST_GENERATE_H

#include <vector>

#include "test_common.h"
#include "test_configs.h"
#include "../prepro/hf_checkpoint.h"

/* ---- host ------------------------------------------------------------------------------------- */

static test_result test_generate_settings_refused(void) {
    mt_error err;
    mt_config c = test_config(TEST_LLAMA, MT_FP32);
    c.seq_length = 128;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT_OK(mt_generator_supported(&c, &err), &err);
    struct {
        void (*edit)(mt_config*);
        const char* says;
    } models[] = {
        {[](mt_config* m) { m->pipeline_model_parallel_size = 2; }, "pipeline parallelism"},
        {[](mt_config* m) { m->tensor_model_parallel_size = 2; }, "tensor parallelism"},
        {[](mt_config* m) { m->num_experts = 4; }, "mixture-of-experts"},
        {[](mt_config* m) { m->fp8_param_gather = 1; }, "--fp8-param-gather"},
        {[](mt_config* m) { m->num_attention_heads = 32, m->num_query_groups = 2; }, "query heads per group"},
        {[](mt_config* m) { m->kv_channels = 512; }, "head dims"},
    };
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
        mt_config m = c;
        models[i].edit(&m);
        EXPECT(mt_generator_supported(&m, &err) == MT_ERR_CONFIG && strstr(err.message, models[i].says), "model %zu: %s",
               i, err.message);
    }
    mt_generator_config gc = {4, 128, 0, 0, 0}, r = {0, 0, 0, 0, 0};
    EXPECT_OK(mt_generator_config_check(&gc, &c, &r, &err), &err);
    EXPECT(r.block_tokens == 64 && r.num_blocks == 4 * 2 && r.max_step_tokens == 8192,
           "defaults: %d tokens a block, %lld blocks, %d rows a step", r.block_tokens, (long long)r.num_blocks,
           r.max_step_tokens);
    struct {
        mt_generator_config gc;
        const char* says;
    } bad[] = {
        {{0, 128, 0, 0}, "max_batch 0"},       {{MT_GEN_MAX_BATCH + 1, 128, 0, 0}, "max_batch"},
        {{4, 1, 0, 0}, "max_context 1"},       {{4, 129, 0, 0}, "max_context 129"},
        {{4, 128, 48, 0}, "block_tokens 48"},  {{4, 128, 8, 0}, "block_tokens 8"},
        {{4, 128, 2048, 0}, "block_tokens 2048"}, {{4, 128, 16, 7}, "num_blocks 7"},
        {{4, 128, 16, -1}, "num_blocks -1"},   {{4, 128, 16, 0, 131}, "max_step_tokens 131"},
        {{4, 128, 16, 0, (1 << 20) + 1}, "max_step_tokens"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        EXPECT(mt_generator_config_check(&bad[i].gc, &c, &r, &err) == MT_ERR_ARG && strstr(err.message, bad[i].says),
               "config %zu: %s", i, err.message);

    const int32_t prompt[4] = {1, 2, 3, 999};
    const int32_t stops[17] = {5};
    mt_sampling s;
    memset(&s, 0, sizeof(s));
    s.max_new_tokens = 4;
    EXPECT_OK(mt_generator_request_check(prompt, 4, &s, 128, 1000, &err), &err);
    EXPECT(mt_generator_request_check(prompt, 0, &s, 128, 1000, &err) == MT_ERR_ARG && strstr(err.message, "0 tokens"),
           "%s", err.message);
    EXPECT(mt_generator_request_check(prompt, 4, &s, 4, 1000, &err) == MT_ERR_ARG && strstr(err.message, "4 tokens"),
           "prompt of max_context: %s", err.message);
    EXPECT(mt_generator_request_check(NULL, 4, &s, 128, 1000, &err) == MT_ERR_ARG, "NULL prompt accepted");
    EXPECT(mt_generator_request_check(prompt, 4, &s, 128, 999, &err) == MT_ERR_ARG && strstr(err.message, "999 (at 3)"),
           "%s", err.message);
    EXPECT(mt_generator_request_check(prompt, 4, NULL, 128, 1000, &err) == MT_ERR_ARG, "no settings accepted");
    struct {
        void (*edit)(mt_sampling*);
        const char* says;
    } settings[] = {
        {[](mt_sampling* x) { x->temperature = -1.0f; }, "temperature -1"},
        {[](mt_sampling* x) { x->temperature = NAN; }, "temperature nan"},
        {[](mt_sampling* x) { x->temperature = INFINITY; }, "temperature inf"},
        {[](mt_sampling* x) { x->top_k = -2; }, "top_k -2"},
        {[](mt_sampling* x) { x->top_p = 1.5f; }, "top_p 1.5"},
        {[](mt_sampling* x) { x->top_p = NAN; }, "top_p nan"},
        {[](mt_sampling* x) { x->max_new_tokens = -1; }, "max_new_tokens -1"},
        {[](mt_sampling* x) { x->num_stop_tokens = 17; }, "17 stop tokens"},
        {[](mt_sampling* x) { x->num_stop_tokens = 1, x->stop_tokens = NULL; }, "1 stop tokens"},
        {[](mt_sampling* x) { x->prompt_logprobs = 2; }, "prompt_logprobs 2"},
    };
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++) {
        mt_sampling x = s;
        x.stop_tokens = stops;
        settings[i].edit(&x);
        EXPECT(mt_generator_request_check(prompt, 4, &x, 128, 1000, &err) == MT_ERR_ARG &&
                   strstr(err.message, settings[i].says),
               "setting %zu: %s", i, err.message);
    }
    const int32_t bad_stop[1] = {1000};
    s.stop_tokens = bad_stop, s.num_stop_tokens = 1;
    EXPECT(mt_generator_request_check(prompt, 4, &s, 128, 1000, &err) == MT_ERR_ARG && strstr(err.message, "stop token 1000"),
           "%s", err.message);
    /* blocks: positions cached = max(prompt, min(prompt + new, context) - 1) */
    EXPECT(mt_generator_request_blocks(10, 40, 64, 16) == 4, "10 + 40 tokens: 49 positions, 4 blocks");
    EXPECT(mt_generator_request_blocks(20, 20, 64, 16) == 3, "20 + 20: 39 positions, 3 blocks");
    EXPECT(mt_generator_request_blocks(5, 1000, 64, 16) == 4, "capped by the context: 63 positions, 4 blocks");
    EXPECT(mt_generator_request_blocks(33, 0, 64, 16) == 3, "prompt only: 33 positions, 3 blocks");
    EXPECT(mt_generator_request_blocks(16, 1, 64, 16) == 1, "16 + 1: 16 positions, 1 block");
    return TEST_PASS;
}

/* The draw's uniform: [0, 1), repeatable, keyed by seed and index, uniform over 64 bins (chi-square with
 * 63 degrees of freedom below 130: p < 1e-6 for a uniform source). */
static test_result test_generate_uniform(void) {
    EXPECT(gen_uniform(7, 3) == gen_uniform(7, 3), "not repeatable");
    EXPECT(gen_uniform(7, 3) != gen_uniform(8, 3) && gen_uniform(7, 3) != gen_uniform(7, 4), "seed or index ignored");
    static int bins[64];
    memset(bins, 0, sizeof(bins));
    const int n = 1 << 18;
    for (int i = 0; i < n; i++) {
        const float u = gen_uniform(1234 + (uint64_t)(i & 7), i >> 3);
        EXPECT(u >= 0.0f && u < 1.0f, "draw %d: %g", i, (double)u);
        bins[(int)(u * 64)]++;
    }
    double chi = 0.0, e = n / 64.0;
    for (int b = 0; b < 64; b++) chi += (bins[b] - e) * (bins[b] - e) / e;
    EXPECT(chi < 130.0, "chi-square %.1f over 64 bins", chi);
    printf("    chi-square of 2^18 draws over 64 bins: %.1f (63 degrees of freedom)\n", chi);
    return TEST_PASS;
}

/* The decode GEMV's cut of K (megatron.cu, gen_gemv_plan and gen_gemv_warp, which gemv_rows_kernel runs): on
 * both models' linears, shapes with tails (columns not a multiple of a block's, K not of a slice or of a
 * round of loads) and K past 4 slices of one round, walking every warp's lanes, rounds and loads as the
 * kernel does: every weight vector of every column read by exactly one load; a column pair's slices the
 * consecutive warps of one block, in K order (the order the block adds them); one round of loads a warp
 * wherever 4 slices of 32 GEN_GEMV_UNROLL / R vectors hold K, as the cut promises; the launch cut further
 * while it has fewer than GEN_GEMV_TARGET_WARPS warps (the 1600-wide projections). A lost tail, a vector
 * read twice or slices summed out of order fail here without a GPU. */
static test_result test_generate_gemv_plan(void) {
    struct {
        int cols, K, V, R, slices;  /* slices: the cut expected (0: not checked) */
    } shapes[] = {{4800, 1600, 8, 1, 1},  {1600, 1600, 8, 1, 2},  {6400, 1600, 8, 1, 1},  {1600, 6400, 8, 1, 4},
                  {3072, 2048, 8, 1, 2},  {2048, 2048, 8, 1, 2},  {8192, 2048, 8, 2, 2},  {2048, 8192, 8, 1, 4},
                  {257, 1608, 8, 1, 2},   {100, 2056, 8, 2, 4},   {37, 8200, 8, 1, 4},    {3, 8, 8, 1, 1},
                  {1, 4, 4, 1, 1},        {67, 2052, 4, 2, 4},    {9, 6400, 4, 1, 4},     {130, 1604, 4, 1, 4},
                  {5, 1000, 4, 1, 0},     {33, 6400, 8, 1, 4},    {515, 2048, 8, 2, 4},   {1, 128, 8, 1, 1}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        const int cols = shapes[i].cols, Kv = shapes[i].K / shapes[i].V, R = shapes[i].R;
        const int round = 32 * (GEN_GEMV_UNROLL / R), pairs = (cols + GEN_GEMV_COLS - 1) / GEN_GEMV_COLS;
        const gen_gemv_split p = gen_gemv_plan(cols, Kv, R);
        EXPECT(p.slices >= 1 && GEN_GEMV_WARPS % p.slices == 0, "shape %zu: %d slices", i, p.slices);
        EXPECT(!shapes[i].slices || p.slices == shapes[i].slices, "shape %zu (%d x %d): %d slices, expected %d", i, cols,
               shapes[i].K, p.slices, shapes[i].slices);
        EXPECT(p.blocks * (GEN_GEMV_WARPS / p.slices) >= pairs && (p.blocks - 1) * (GEN_GEMV_WARPS / p.slices) < pairs,
               "shape %zu: %d blocks for %d column pairs", i, p.blocks, pairs);
        EXPECT(p.slices * round >= Kv ? p.passes == 1 : p.slices == GEN_GEMV_WARPS, "shape %zu: %d slices, %d passes", i,
               p.slices, p.passes);
        if (p.slices < GEN_GEMV_WARPS && Kv / (2 * p.slices) >= 64)
            EXPECT((int64_t)pairs * p.slices >= GEN_GEMV_TARGET_WARPS, "shape %zu: %d warps, could be cut further", i,
                   pairs * p.slices);
        std::vector<unsigned char> seen((size_t)cols * Kv, 0);
        for (int b = 0; b < p.blocks; b++)
            for (int w = 0; w < GEN_GEMV_WARPS; w++) {
                int j0, kb, ke;
                gen_gemv_warp(p, b, w, Kv, &j0, &kb, &ke);
                if (w % p.slices) { /* the next slice of the previous warp's pair, right after it in K */
                    int j1, kb1, ke1;
                    gen_gemv_warp(p, b, w - 1, Kv, &j1, &kb1, &ke1);
                    EXPECT(j1 == j0 && kb == ke1, "shape %zu block %d warp %d: columns %d / %d, K from %d after %d", i, b,
                           w, j0, j1, kb, ke1);
                } else {
                    EXPECT(kb == 0, "shape %zu block %d warp %d: the first slice starts at %d", i, b, w, kb);
                }
                if (w % p.slices == p.slices - 1)
                    EXPECT(ke == Kv, "shape %zu block %d warp %d: the last slice ends at %d of %d", i, b, w, ke, Kv);
                int rounds = 0;
                for (int base = kb; base < ke; base += round, rounds++)
                    for (int u = 0; u < GEN_GEMV_UNROLL / R; u++)
                        for (int lane = 0; lane < 32; lane++) {
                            const int k = base + u * 32 + lane;
                            for (int c = 0; c < GEN_GEMV_COLS && k < ke; c++)
                                if (j0 + c < cols) seen[(size_t)(j0 + c) * Kv + k]++;
                        }
                EXPECT(rounds <= p.passes, "shape %zu block %d warp %d: %d rounds of loads, the cut says %d", i, b, w,
                       rounds, p.passes);
            }
        for (size_t e = 0; e < seen.size(); e++)
            EXPECT(seen[e] == 1, "shape %zu (%d x %d): column %zu vector %zu read %d times", i, cols, shapes[i].K,
                   e / Kv, e % Kv, seen[e]);
    }
    /* GEMV_ROPE's column pairs (gen_gemv_rope_pair): every QKV column once; a rotated pair (e, e + rot/2) of a q
     * or k head with e < rot/2; the v heads and the unrotated channels in neighbouring pairs */
    const struct {
        int groups, qpg, d, rot;
    } heads[] = {{8, 4, 64, 64}, {3, 2, 16, 8}, {1, 1, 2, 2}, {2, 3, 128, 32}, {4, 1, 64, 62}};
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        const gen_gemv_rope rp = {NULL, NULL, NULL, heads[i].d, heads[i].rot, heads[i].qpg};
        const int d = rp.d, half = rp.rot / 2, cols = heads[i].groups * (rp.qpg + 2) * d;
        EXPECT(gemv_rope_supported(d, rp.rot, rp.qpg, cols), "RoPE geometry %zu refused", i);
        std::vector<int> seen(cols, 0);
        for (int p = 0; p < cols / 2; p++) {
            int ja, jb, e;
            gen_gemv_rope_pair(rp, p, &ja, &jb, &e);
            EXPECT(ja >= 0 && jb < cols && ja / d == jb / d, "RoPE %zu pair %d: columns %d, %d", i, p, ja, jb);
            const int slot = (ja / d) % (rp.qpg + 2), ea = ja % d;
            if (slot <= rp.qpg && ea < half)
                EXPECT(e == ea && jb == ja + half, "RoPE %zu pair %d: (%d, %d) rotation %d", i, p, ja, jb, e);
            else
                EXPECT(e == -1 && jb == ja + 1 && (slot > rp.qpg || ea >= rp.rot), "RoPE %zu pair %d: (%d, %d) rotation %d",
                       i, p, ja, jb, e);
            seen[ja]++, seen[jb]++;
        }
        for (int j = 0; j < cols; j++) EXPECT(seen[j] == 1, "RoPE %zu: column %d in %d pairs", i, j, seen[j]);
    }
    EXPECT(!gemv_rope_supported(64, 64, 4, 64 * 6 + 2) && !gemv_rope_supported(63, 62, 1, 63 * 3) &&
               !gemv_rope_supported(64, 66, 1, 64 * 3),
           "a RoPE geometry with a partial head, an odd head or rot > d taken");
    return TEST_PASS;
}

/* ---- GPU helpers --------------------------------------------------------------------------------- */

/* A small fp32 model (tests/test_configs.h's, seq_length `seq`, micro-batch 1) with its initial weights
 * times `scale`. */
static mt_status tgen_trainer(test_flavour flavour, mt_precision precision, int seq, float scale, mt_trainer** t,
                              mt_config* out, mt_error* err) {
    mt_config c = test_config(flavour, precision);
    c.seq_length = seq;
    test_config_batch(&c, 1, 1);
    mt_status st = mt_config_finalize(&c, err);
    if (st == MT_OK) st = mt_trainer_create(t, &c, err);
    if (st != MT_OK) return st;
    const int64_t n = mt_num_parameters(&c);
    float* p = (float*)malloc(sizeof(float) * (size_t)n);
    if (!p) return mt_fail(err, MT_ERR_OOM, "out of memory");
    st = mt_trainer_get_parameters(*t, p, err);
    for (int64_t i = 0; i < n; i++) p[i] *= scale;
    if (st == MT_OK) st = mt_trainer_set_parameters(*t, p, err);
    free(p);
    if (out) *out = c;
    return st;
}

/* What one request produced. */
typedef struct {
    int64_t id;
    int32_t tokens[512];
    float logprobs[512];
    int n;
    int finished;
} tgen_result;

/* Steps g until every request of ids[0..count) finished, each added at step join[i] (0: before the first);
 * prompts[i] [len[i]], settings s[i]. res[i] gets each one's tokens. */
static mt_status tgen_run(mt_generator* g, int count, const int32_t* const* prompts, const int* len, const mt_sampling* s,
                          const int* join, tgen_result* res, mt_error* err) {
    for (int i = 0; i < count; i++) res[i].id = -1, res[i].n = 0, res[i].finished = 0;
    mt_generated out[64];
    for (int step = 0; step < 10000; step++) {
        for (int i = 0; i < count; i++)
            if (join[i] == step) {
                mt_status st = mt_generator_add(g, prompts[i], len[i], &s[i], &res[i].id, err);
                if (st != MT_OK) return st;
            }
        int n = 0;
        mt_status st = mt_generator_step(g, out, 64, &n, err);
        if (st != MT_OK) return st;
        for (int k = 0; k < n; k++)
            for (int i = 0; i < count; i++)
                if (res[i].id == out[k].id) {
                    if (res[i].finished) return mt_fail(err, MT_ERR_ARG, "request %d: a result after it finished", i);
                    if (out[k].token >= 0 && res[i].n < 512)
                        res[i].tokens[res[i].n] = out[k].token, res[i].logprobs[res[i].n++] = out[k].logprob;
                    res[i].finished = out[k].finished;
                }
        int done = 1;
        for (int i = 0; i < count; i++) done &= res[i].finished;
        if (done) return MT_OK;
    }
    return mt_fail(err, MT_ERR_ARG, "the requests did not finish in 10000 steps");
}

/* log softmax over the first V of row x, at token k */
static double tgen_logprob(const float* x, int V, int k) {
    double m = -INFINITY, s = 0.0;
    for (int i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    for (int i = 0; i < V; i++) s += exp((double)x[i] - m);
    return (double)x[k] - m - log(s);
}
/* argmax (ties to the lowest id) and the gap to the runner-up */
static int tgen_argmax(const float* x, int V, double* gap) {
    int a = 0;
    for (int i = 1; i < V; i++) a = x[i] > x[a] ? i : a;
    double second = -INFINITY;
    for (int i = 0; i < V; i++)
        if (i != a && x[i] > second) second = x[i];
    *gap = (double)x[a] - second;
    return a;
}

/* KV-cache decoding against the full recompute of the finished sequence: the trainer's logits of
 * prompt + generated tokens (one forward, causal). Every generated token must be the recompute's
 * argmax at the position before it (unless the recompute's top two are within 1e-4 there: a near-tie
 * either side may take; the comparison of that request stops, the text after it being another's), and
 * every log-probability (generated and prompt) within 1e-4 of the recompute's: both are fp32 sums of
 * the same products in another order and GEMM shape (relative ~1e-6 of logits of a few units). */
static test_result tgen_check_recompute(mt_trainer* t, const mt_config* c, const int32_t* prompt, int plen,
                                        const tgen_result* r, const float* prompt_lp, const char* what) {
    mt_error err;
    const int S = c->seq_length, V = (int)c->vocab_size;
    const int64_t Vp = c->padded_vocab_size;
    int32_t* seq = (int32_t*)calloc((size_t)S, sizeof(int32_t));
    float* logits = (float*)malloc(sizeof(float) * (size_t)S * Vp);
    const int total = plen + r->n;
    EXPECT(total <= S, "%s: %d tokens, seq_length %d", what, total, S);
    memcpy(seq, prompt, sizeof(int32_t) * plen);
    memcpy(seq + plen, r->tokens, sizeof(int32_t) * r->n);
    EXPECT_OK(mt_trainer_logits(t, seq, logits, &err), &err);
    double worst = 0.0;
    for (int i = 1; prompt_lp && i < plen; i++) {
        const double want = tgen_logprob(logits + (int64_t)(i - 1) * Vp, V, seq[i]);
        const double d = fabs(want - prompt_lp[i - 1]);
        worst = d > worst ? d : worst;
        EXPECT(d < 1e-4, "%s: prompt log-probability %d: %.6f, recompute %.6f", what, i, (double)prompt_lp[i - 1], want);
    }
    for (int j = 0; j < r->n; j++) {
        const float* row = logits + (int64_t)(plen + j - 1) * Vp;
        double gap;
        const int want = tgen_argmax(row, V, &gap);
        if (want != r->tokens[j] && gap < 1e-4) {
            printf("    %s: near-tie at token %d (gap %.2g): compared up to there\n", what, j, gap);
            break;
        }
        EXPECT(want == r->tokens[j], "%s: token %d: %d, recompute's argmax %d (gap %.3g)", what, j, r->tokens[j], want, gap);
        const double lp = tgen_logprob(row, V, r->tokens[j]);
        const double d = fabs(lp - r->logprobs[j]);
        worst = d > worst ? d : worst;
        EXPECT(d < 1e-4, "%s: token %d log-probability %.6f, recompute %.6f", what, j, (double)r->logprobs[j], lp);
    }
    printf("    %s: %d prompt + %d generated tokens, log-probabilities within %.2g of the recompute\n", what, plen, r->n,
           worst);
    free(seq);
    free(logits);
    return TEST_PASS;
}

static void tgen_prompt(int32_t* p, int n, int vocab, uint64_t seed) { fill_tokens(p, n, vocab, seed); }

static test_result tgen_recompute_case(test_flavour flavour) {
    REQUIRE_GPU();
    mt_error err;
    mt_trainer* t = NULL;
    mt_config c;
    EXPECT_OK(tgen_trainer(flavour, MT_FP32, 160, 4.0f, &t, &c, &err), &err);
    mt_generator* g = NULL;
    mt_generator_config gc = {4, 160, 16, 0};
    EXPECT_OK(mt_generator_create(&g, t, &gc, &err), &err);
    /* A: 7 tokens to max_context (153 generated: three decode-attention splits, ten blocks); B: 40 tokens, 30 new,
     * its prompt log-probabilities; C: one token, 5 new */
    int32_t pa[7], pb[40], pc[1];
    tgen_prompt(pa, 7, 1000, 1), tgen_prompt(pb, 40, 1000, 2), tgen_prompt(pc, 1, 1000, 3);
    const int32_t* prompts[3] = {pa, pb, pc};
    const int len[3] = {7, 40, 1}, join[3] = {0, 0, 2};
    mt_sampling s[3];
    memset(s, 0, sizeof(s));
    s[0].max_new_tokens = 1000, s[1].max_new_tokens = 30, s[2].max_new_tokens = 5;
    s[1].prompt_logprobs = 1;
    static tgen_result res[3];
    EXPECT_OK(tgen_run(g, 3, prompts, len, s, join, res, &err), &err);
    EXPECT(res[0].n == 160 - 7 && res[1].n == 30 && res[2].n == 5, "tokens: %d %d %d", res[0].n, res[1].n, res[2].n);
    EXPECT(mt_generator_running(g) == 0 && mt_generator_free_blocks(g) == gc.max_batch * 10, "blocks not all free");
    /* B's prompt log-probabilities: B again, read after its prefill step (a finished request's are forgotten at
     * the next step, and B finished steps before A) */
    float blp[39];
    int64_t id;
    mt_generated out[4];
    int n;
    EXPECT_OK(mt_generator_add(g, pb, 40, &s[1], &id, &err), &err);
    EXPECT(mt_generator_prompt_logprobs(g, id, blp, &err) == MT_ERR_ARG, "prompt log-probabilities before the prefill");
    EXPECT_OK(mt_generator_step(g, out, 4, &n, &err), &err);
    EXPECT_OK(mt_generator_prompt_logprobs(g, id, blp, &err), &err);
    EXPECT(n == 1 && out[0].token == res[1].tokens[0], "B's first token again: %d, was %d", out[0].token, res[1].tokens[0]);
    EXPECT_OK(mt_generator_cancel(g, id, &err), &err);
    EXPECT(mt_generator_prompt_logprobs(g, id, blp, &err) == MT_ERR_ARG, "a cancelled request's log-probabilities");
    test_result tr = tgen_check_recompute(t, &c, pa, 7, &res[0], NULL, "A (to max_context)");
    if (tr == TEST_PASS) tr = tgen_check_recompute(t, &c, pb, 40, &res[1], blp, "B (prompt log-probabilities)");
    if (tr == TEST_PASS) tr = tgen_check_recompute(t, &c, pc, 1, &res[2], NULL, "C (one-token prompt, joined at step 2)");
    mt_generator_free(g);
    mt_trainer_free(t);
    return tr;
}
static test_result test_generate_gpu_recompute_gpt2(void) { return tgen_recompute_case(TEST_GPT2); }
static test_result test_generate_gpu_recompute_llama(void) { return tgen_recompute_case(TEST_LLAMA); }

/* The same requests alone and together, joining at different steps: identical tokens, log-probabilities
 * within 1e-4 (the GEMMs over another number of rows may round otherwise; attention and sampling of a
 * request read only its own rows). Greedy, sampled at temperature 1, and top-p 0.9 at temperature 0.8.
 * Alone with eager launches, together through the decode steps' CUDA graphs. */
static test_result test_generate_gpu_batch_independent(void) {
    REQUIRE_GPU();
    mt_error err;
    mt_trainer* t = NULL;
    mt_config c;
    EXPECT_OK(tgen_trainer(TEST_LLAMA, MT_FP32, 128, 4.0f, &t, &c, &err), &err);
    mt_generator* g = NULL;
    mt_generator_config gc = {4, 128, 16, 0};
    EXPECT_OK(mt_generator_create(&g, t, &gc, &err), &err);
    int32_t p[3][50];
    const int len[3] = {5, 50, 17};
    for (int i = 0; i < 3; i++) tgen_prompt(p[i], len[i], 1000, 10 + i);
    const int32_t* prompts[3] = {p[0], p[1], p[2]};
    mt_sampling s[3];
    memset(s, 0, sizeof(s));
    s[0].max_new_tokens = 60;
    s[1].max_new_tokens = 40, s[1].temperature = 1.0f, s[1].seed = 99;
    s[2].max_new_tokens = 70, s[2].temperature = 0.8f, s[2].top_p = 0.9f, s[2].seed = 5;
    static tgen_result alone[3], together[3];
    const int zero[1] = {0};
    g->use_graphs = 0; /* alone: eager launches; together: the decode steps' CUDA graphs (section 23) */
    for (int i = 0; i < 3; i++) EXPECT_OK(tgen_run(g, 1, &prompts[i], &len[i], &s[i], zero, &alone[i], &err), &err);
    g->use_graphs = 1;
    const int join[3] = {0, 3, 10};
    EXPECT_OK(tgen_run(g, 3, prompts, len, s, join, together, &err), &err);
    double worst = 0.0;
    for (int i = 0; i < 3; i++) {
        EXPECT(alone[i].n == together[i].n, "request %d: %d tokens alone, %d together", i, alone[i].n, together[i].n);
        for (int j = 0; j < alone[i].n; j++) {
            EXPECT(alone[i].tokens[j] == together[i].tokens[j], "request %d token %d: %d alone, %d together", i, j,
                   alone[i].tokens[j], together[i].tokens[j]);
            const double d = fabs((double)alone[i].logprobs[j] - together[i].logprobs[j]);
            worst = d > worst ? d : worst;
            EXPECT(d < 1e-4, "request %d token %d: log-probability %.7f alone, %.7f together", i, j,
                   (double)alone[i].logprobs[j], (double)together[i].logprobs[j]);
        }
    }
    printf("    3 requests (greedy, temperature 1, top-p 0.9): the same tokens alone and together, log-probabilities "
           "within %.2g\n", worst);
    mt_generator_free(g);
    mt_trainer_free(t);
    return TEST_PASS;
}

/* The kept set of a row of logits as the sampler defines it (megatron.cu section 22): temperature T,
 * then the tokens at or above the k-th largest logit, then those at or above the largest logit whose
 * set holds top_p of the (tempered, renormalised) mass; probabilities into prob (0 off the set). */
static void tgen_kept(const float* x, int V, float T, int k, float top_p, double* prob) {
    double m = -INFINITY;
    for (int i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    float* sorted = (float*)malloc(sizeof(float) * V);
    memcpy(sorted, x, sizeof(float) * V);
    qsort(sorted, V, sizeof(float), [](const void* a, const void* b) {
        const float u = *(const float*)a, v = *(const float*)b;
        return u < v ? 1 : u > v ? -1 : 0;
    });
    float threshold = (k > 0 && k < V) ? sorted[k - 1] : -INFINITY;
    double total = 0.0;
    for (int i = 0; i < V; i++) total += x[i] >= threshold ? exp((x[i] - m) / T) : 0.0;
    if (top_p > 0.0f && top_p < 1.0f) {
        double mass = 0.0;
        for (int j = 0; j < V && sorted[j] >= threshold; j++) {
            mass += exp((sorted[j] - m) / T);
            if (mass >= top_p * total && (j + 1 == V || sorted[j + 1] < sorted[j])) {
                threshold = sorted[j];
                break;
            }
        }
    }
    double kept = 0.0;
    for (int i = 0; i < V; i++) kept += (prob[i] = x[i] >= threshold ? exp((x[i] - m) / T) : 0.0);
    for (int i = 0; i < V; i++) prob[i] /= kept;
    free(sorted);
}

/* 4096 first tokens of one prompt, each its own request with its own seed, against the expected
 * distribution: chi-square over the tokens expected at least 5 times, the rest pooled; its threshold
 * df + 6 sqrt(2 df) + 10 (p < 1e-6 for a correct sampler). No token off the kept set. */
static test_result tgen_frequencies(mt_generator* g, mt_trainer* t, const mt_config* c, float T, int k, float top_p) {
    mt_error err;
    const int V = (int)c->vocab_size;
    const int64_t Vp = c->padded_vocab_size;
    int32_t prompt[8];
    tgen_prompt(prompt, 8, V, 77);
    float* logits = (float*)malloc(sizeof(float) * Vp);
    EXPECT_OK(mt_trainer_next_token_logits(t, prompt, 8, logits, &err), &err);
    double* prob = (double*)malloc(sizeof(double) * V);
    tgen_kept(logits, V, T, k, top_p, prob);
    int* count = (int*)calloc(V, sizeof(int));
    const int draws = 4096;
    mt_sampling s;
    memset(&s, 0, sizeof(s));
    s.temperature = T, s.top_k = k, s.top_p = top_p, s.max_new_tokens = 1;
    mt_generated out[64];
    for (int done = 0, added = 0; done < draws;) {
        int64_t id;
        while (added < draws && mt_generator_running(g) < 64) { /* a step prefills the prompts its rows hold */
            s.seed = 1000 + (uint64_t)added++;
            EXPECT_OK(mt_generator_add(g, prompt, 8, &s, &id, &err), &err);
        }
        int n = 0;
        EXPECT_OK(mt_generator_step(g, out, 64, &n, &err), &err);
        EXPECT(n >= 1, "a step with %d requests running returned nothing", mt_generator_running(g));
        for (int j = 0; j < n; j++) {
            EXPECT(out[j].finished && out[j].token >= 0 && out[j].token < V, "result %d", j);
            EXPECT(prob[out[j].token] > 0.0, "token %d drawn outside the kept set", out[j].token);
            const double lp = tgen_logprob(logits, V, out[j].token);
            EXPECT(fabs(lp - out[j].logprob) < 1e-4, "log-probability %.6f, want %.6f", (double)out[j].logprob, lp);
            count[out[j].token]++;
        }
        done += n;
    }
    double chi = 0.0, pooled_e = 0.0;
    int pooled_n = 0, bins = 0, kept = 0;
    for (int i = 0; i < V; i++) {
        kept += prob[i] > 0.0;
        const double e = prob[i] * draws;
        if (e >= 5.0) chi += (count[i] - e) * (count[i] - e) / e, bins++;
        else pooled_e += e, pooled_n += count[i];
    }
    if (pooled_e >= 5.0) chi += (pooled_n - pooled_e) * (pooled_n - pooled_e) / pooled_e, bins++;
    const int df = bins - 1;
    const double limit = df + 6.0 * sqrt(2.0 * df) + 10.0;
    printf("    T %.2f top_k %d top_p %.2f: %d tokens kept, chi-square %.1f over %d bins (limit %.1f)\n", (double)T, k,
           (double)top_p, kept, chi, bins, limit);
    EXPECT(df >= 1 && chi < limit, "chi-square %.1f over %d bins, limit %.1f", chi, bins, limit);
    free(logits), free(prob), free(count);
    return TEST_PASS;
}

static test_result test_generate_gpu_sampling(void) {
    REQUIRE_GPU();
    mt_error err;
    mt_trainer* t = NULL;
    mt_config c;
    EXPECT_OK(tgen_trainer(TEST_GPT2, MT_FP32, 64, 2.0f, &t, &c, &err), &err);
    mt_generator* g = NULL;
    mt_generator_config gc = {64, 64, 16, 0};
    EXPECT_OK(mt_generator_create(&g, t, &gc, &err), &err);
    int32_t p[6];
    tgen_prompt(p, 6, 1000, 42);
    const int32_t* prompts[6] = {p, p, p, p, p, p};
    const int len[6] = {6, 6, 6, 6, 6, 6}, join[6] = {0, 0, 0, 0, 0, 0};
    mt_sampling s[6];
    memset(s, 0, sizeof(s));
    for (int i = 0; i < 6; i++) s[i].max_new_tokens = 20, s[i].temperature = 2.0f, s[i].seed = 7;
    s[2].seed = 8, s[3].seed = 9, s[4].seed = 10;
    s[5].temperature = 1.0f, s[5].top_k = 1; /* top_k 1: greedy */
    static tgen_result r[6], greedy[1];
    EXPECT_OK(tgen_run(g, 6, prompts, len, s, join, r, &err), &err);
    EXPECT(r[0].n == 20 && !memcmp(r[0].tokens, r[1].tokens, sizeof(int32_t) * 20), "the same seed gave other tokens");
    int differ = 0;
    for (int i = 2; i < 5; i++) differ += memcmp(r[0].tokens, r[i].tokens, sizeof(int32_t) * 20) != 0;
    EXPECT(differ == 3, "only %d of 3 other seeds gave other tokens at temperature 2", differ);
    mt_sampling gs;
    memset(&gs, 0, sizeof(gs));
    gs.max_new_tokens = 20;
    EXPECT_OK(tgen_run(g, 1, prompts, len, &gs, join, greedy, &err), &err);
    EXPECT(!memcmp(greedy[0].tokens, r[5].tokens, sizeof(int32_t) * 20), "top_k 1 is not greedy");
    test_result tr = tgen_frequencies(g, t, &c, 1.0f, 0, 0.0f);
    if (tr == TEST_PASS) tr = tgen_frequencies(g, t, &c, 0.7f, 50, 0.9f);
    if (tr == TEST_PASS) tr = tgen_frequencies(g, t, &c, 1.5f, 0, 0.5f);
    mt_generator_free(g);
    mt_trainer_free(t);
    return tr;
}

/* Blocks come back when requests finish and are cancelled, and a request in reused blocks (holding an
 * earlier request's keys) decodes exactly as in fresh ones; full slots and blocks are MT_ERR_RANGE. */
static test_result test_generate_gpu_block_reuse(void) {
    REQUIRE_GPU();
    mt_error err;
    mt_trainer* t = NULL;
    mt_config c;
    EXPECT_OK(tgen_trainer(TEST_LLAMA, MT_FP32, 64, 4.0f, &t, &c, &err), &err);
    int32_t pa[10], pb[20], pc[5];
    tgen_prompt(pa, 10, 1000, 21), tgen_prompt(pb, 20, 1000, 22), tgen_prompt(pc, 5, 1000, 23);
    mt_sampling sa, sb, sc;
    memset(&sa, 0, sizeof(sa));
    sb = sc = sa;
    sa.max_new_tokens = 40, sb.max_new_tokens = 20, sc.max_new_tokens = 3;
    /* B alone in a fresh generator: the reference */
    mt_generator* g = NULL;
    mt_generator_config fresh = {2, 64, 16, 0};
    static tgen_result ref[1], got[1];
    const int32_t* pbs[1] = {pb};
    const int lb[1] = {20}, zero[1] = {0};
    EXPECT_OK(mt_generator_create(&g, t, &fresh, &err), &err);
    EXPECT_OK(tgen_run(g, 1, pbs, lb, &sb, zero, ref, &err), &err);
    mt_generator_free(g);
    mt_generator_config small = {2, 64, 16, 6};
    EXPECT_OK(mt_generator_create(&g, t, &small, &err), &err);
    int64_t a, b, cid, d;
    mt_generated out[2];
    int n;
    EXPECT_OK(mt_generator_add(g, pa, 10, &sa, &a, &err), &err); /* 49 positions: 4 blocks */
    EXPECT(mt_generator_free_blocks(g) == 2, "%lld free", (long long)mt_generator_free_blocks(g));
    for (int i = 0; i < 12; i++) EXPECT_OK(mt_generator_step(g, out, 2, &n, &err), &err); /* A fills its blocks */
    EXPECT(mt_generator_add(g, pb, 20, &sb, &b, &err) == MT_ERR_RANGE && strstr(err.message, "2 free blocks"), "%s",
           err.message);
    EXPECT(mt_generator_cancel(g, 12345, &err) == MT_ERR_ARG, "an unknown id cancelled");
    EXPECT_OK(mt_generator_cancel(g, a, &err), &err);
    EXPECT(mt_generator_running(g) == 0 && mt_generator_free_blocks(g) == 6, "after the cancel");
    EXPECT_OK(mt_generator_add(g, pb, 20, &sb, &b, &err), &err); /* 39 positions: 3 blocks, A's among them */
    EXPECT_OK(mt_generator_add(g, pc, 5, &sc, &cid, &err), &err); /* 7 positions: 1 block */
    EXPECT(mt_generator_add(g, pc, 5, &sc, &d, &err) == MT_ERR_RANGE && strstr(err.message, "max_batch"), "%s",
           err.message);
    EXPECT(mt_generator_free_blocks(g) == 2, "%lld free", (long long)mt_generator_free_blocks(g));
    got[0].n = 0;
    int c_done = 0;
    while (mt_generator_running(g) > 0) {
        if (mt_generator_running(g) >= 2)
            EXPECT(mt_generator_step(g, out, 1, &n, &err) == MT_ERR_ARG, "room for 1 result with 2 running accepted");
        EXPECT_OK(mt_generator_step(g, out, 2, &n, &err), &err);
        for (int k = 0; k < n; k++) {
            if (out[k].id == b) got[0].tokens[got[0].n++] = out[k].token;
            if (out[k].id == cid && out[k].finished) {
                c_done = 1;
                EXPECT(mt_generator_free_blocks(g) == 3, "C's block not back: %lld free",
                       (long long)mt_generator_free_blocks(g));
                EXPECT_OK(mt_generator_add(g, pb, 20, &sb, &d, &err), &err); /* D: C's slot and blocks */
            }
        }
    }
    EXPECT(c_done && mt_generator_free_blocks(g) == 6, "the end: %lld free", (long long)mt_generator_free_blocks(g));
    EXPECT(got[0].n == ref[0].n && !memcmp(got[0].tokens, ref[0].tokens, sizeof(int32_t) * ref[0].n),
           "B in reused blocks decoded otherwise");
    mt_generator_free(g);
    mt_trainer_free(t);
    printf("    cancel, finish and reuse: B's %d tokens as in a fresh cache\n", ref[0].n);
    return TEST_PASS;
}

/* How requests end: a stop token (returned, finished, at its first occurrence), max_new_tokens, and
 * max_new_tokens 0 (one entry from the prefill step: token -1, finished; its prompt log-probabilities
 * readable after that step and forgotten at the next). */
static test_result test_generate_gpu_endings(void) {
    REQUIRE_GPU();
    mt_error err;
    mt_trainer* t = NULL;
    mt_config c;
    EXPECT_OK(tgen_trainer(TEST_GPT2, MT_FP32, 64, 4.0f, &t, &c, &err), &err);
    mt_generator* g = NULL;
    mt_generator_config gc = {2, 64, 16, 0, 0};
    EXPECT_OK(mt_generator_create(&g, t, &gc, &err), &err);
    int32_t p[9];
    tgen_prompt(p, 9, 1000, 31);
    const int32_t* prompts[1] = {p};
    const int len[1] = {9}, zero[1] = {0};
    mt_sampling s;
    memset(&s, 0, sizeof(s));
    s.max_new_tokens = 12;
    static tgen_result free_run[1], stopped[1];
    EXPECT_OK(tgen_run(g, 1, prompts, len, &s, zero, free_run, &err), &err);
    EXPECT(free_run[0].n == 12, "max_new_tokens 12: %d tokens", free_run[0].n);
    int first = 0; /* the stop token: the 6th generated token, ending at its first occurrence */
    while (free_run[0].tokens[first] != free_run[0].tokens[5]) first++;
    s.stop_tokens = &free_run[0].tokens[5], s.num_stop_tokens = 1;
    EXPECT_OK(tgen_run(g, 1, prompts, len, &s, zero, stopped, &err), &err);
    EXPECT(stopped[0].n == first + 1 && !memcmp(stopped[0].tokens, free_run[0].tokens, sizeof(int32_t) * (first + 1)),
           "stop token %d: %d tokens, want %d", free_run[0].tokens[5], stopped[0].n, first + 1);
    mt_sampling z;
    memset(&z, 0, sizeof(z));
    z.prompt_logprobs = 1;
    int64_t id;
    mt_generated out[2];
    int n = 0;
    float lp[8];
    EXPECT_OK(mt_generator_add(g, p, 9, &z, &id, &err), &err);
    EXPECT_OK(mt_generator_step(g, out, 2, &n, &err), &err);
    EXPECT(n == 1 && out[0].id == id && out[0].token == -1 && out[0].finished, "max_new_tokens 0: %d entries, token %d",
           n, n ? out[0].token : 0);
    EXPECT(mt_generator_running(g) == 0 && mt_generator_free_blocks(g) == gc.max_batch * 4, "blocks after the prefill");
    EXPECT_OK(mt_generator_prompt_logprobs(g, id, lp, &err), &err);
    for (int i = 0; i < 8; i++) EXPECT(lp[i] < 0.0f && lp[i] > -50.0f, "prompt log-probability %d: %g", i, (double)lp[i]);
    EXPECT_OK(mt_generator_step(g, out, 2, &n, &err), &err);
    EXPECT(n == 0 && mt_generator_prompt_logprobs(g, id, lp, &err) == MT_ERR_ARG, "kept past the next step");
    mt_generator_free(g);
    mt_trainer_free(t);
    printf("    max_new_tokens 12, a stop token after %d, max_new_tokens 0 with prompt log-probabilities\n", first + 1);
    return TEST_PASS;
}

/* Hugging Face transformers' greedy generate (dev/hf_generate_check.py --write DIR: a tiny random GPT-2 and
 * Llama saved by save_pretrained, greedy generate in float64 on prompts of 3 to 24 tokens, the tokens, their
 * log-probabilities and transformers' top-two gap per step) against this engine on the imported weights:
 * fp32: the same tokens (a mismatch where transformers' gap is below 1e-4 is a near-tie: that prompt is
 * compared up to there) and log-probabilities within 1e-4 (fp32 against float64); bf16: transformers'
 * tokens fed as the prompt with prompt_logprobs, their log-probabilities within 0.15 each and 3e-2 RMS
 * (the 3e-2 relative logits tolerance of the bf16 model elsewhere in tests/test_hf.h on logits of a few
 * units). Skipped without a GPU or without python's torch and transformers. */
static test_result test_generate_gpu_transformers(void) {
    REQUIRE_GPU();
    static char out[8192];
    if (test_command_output("${MT_PYTHON:-python3} -c 'import torch, safetensors; "
                            "from transformers import GPT2LMHeadModel, LlamaForCausalLM' 2>&1", out, sizeof(out)) != 0)
        SKIP("python3 with torch, safetensors and transformers is not available (dev/hf_generate_check.py; MT_PYTHON "
             "names another python)");
    const char* root = "/tmp/mt_test_generate_hf";
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s' && ${MT_PYTHON:-python3} dev/hf_generate_check.py --write '%s' 2>&1", root, root);
    int code = test_command_output(cmd, out, sizeof(out));
    EXPECT(code == 0, "dev/hf_generate_check.py --write: exit %d: %s", code, out);
    static const char* const names[2] = {"gpt2", "llama"};
    for (int k = 0; k < 2; k++) {
        char dir[300], ref[300];
        snprintf(dir, sizeof(dir), "%s/%s", root, names[k]);
        snprintf(ref, sizeof(ref), "%s/%s.gen.bin", root, names[k]);
        size_t size = 0;
        char* raw = test_read_file(ref, &size);
        EXPECT(raw && size >= 8, "%s", ref);
        int32_t num = 0, steps = 0;
        memcpy(&num, raw, 4), memcpy(&steps, raw + 4, 4);
        mt_error err;
        mt_config c;
        float* p = NULL;
        EXPECT_OK(mt_hf_load(dir, &c, &p, NULL, &err), &err);
        c.seq_length = 64, c.micro_batch_size = 1, c.global_batch_size = 1;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        for (int pr = 0; pr < 2; pr++) {
            c.precision = pr ? MT_BF16 : MT_FP32;
            mt_trainer* t = NULL;
            EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
            EXPECT_OK(mt_trainer_set_parameters(t, p, &err), &err);
            mt_generator* g = NULL;
            mt_generator_config gc = {4, 64, 16, 0};
            EXPECT_OK(mt_generator_create(&g, t, &gc, &err), &err);
            const char* at = raw + 8;
            int compared = 0, ties = 0;
            double worst = 0.0, sq = 0.0;
            int nsq = 0;
            for (int q = 0; q < num; q++) {
                int32_t plen;
                memcpy(&plen, at, 4);
                const int32_t* prompt = (const int32_t*)(at + 4);
                const int32_t* want = prompt + plen;
                const float* want_lp = (const float*)(want + steps);
                const float* gap = want_lp + steps;
                at += 4 + 4 * (size_t)plen + 12 * (size_t)steps;
                EXPECT(at <= raw + size, "%s: truncated", ref);
                mt_sampling s;
                memset(&s, 0, sizeof(s));
                static tgen_result r[1];
                const int zero[1] = {0};
                if (pr == 0) {
                    s.max_new_tokens = steps;
                    EXPECT_OK(tgen_run(g, 1, &prompt, &plen, &s, zero, r, &err), &err);
                    for (int j = 0; j < steps; j++) {
                        if (r[0].tokens[j] != want[j] && gap[j] < 1e-4) {
                            ties++;
                            break;
                        }
                        EXPECT(r[0].tokens[j] == want[j], "%s fp32 prompt %d token %d: %d, transformers %d (gap %.3g)",
                               names[k], q, j, r[0].tokens[j], want[j], (double)gap[j]);
                        const double d = fabs((double)r[0].logprobs[j] - want_lp[j]);
                        worst = d > worst ? d : worst;
                        EXPECT(d < 1e-4, "%s fp32 prompt %d token %d: log-probability %.6f, transformers %.6f", names[k], q,
                               j, (double)r[0].logprobs[j], (double)want_lp[j]);
                        compared++;
                    }
                } else { /* transformers' text as the prompt: the log-probabilities of its tokens */
                    int32_t full[64];
                    memcpy(full, prompt, 4 * (size_t)plen), memcpy(full + plen, want, 4 * (size_t)steps);
                    float lp[63];
                    int64_t id;
                    mt_generated o[4];
                    int n;
                    s.prompt_logprobs = 1;
                    EXPECT_OK(mt_generator_add(g, full, plen + steps, &s, &id, &err), &err);
                    EXPECT_OK(mt_generator_step(g, o, 4, &n, &err), &err);
                    EXPECT_OK(mt_generator_prompt_logprobs(g, id, lp, &err), &err);
                    for (int j = 0; j < steps; j++) {
                        const double d = fabs((double)lp[plen - 1 + j] - want_lp[j]);
                        worst = d > worst ? d : worst;
                        sq += d * d, nsq++;
                        EXPECT(d < 0.15, "%s bf16 prompt %d token %d: log-probability %.4f, transformers %.4f", names[k],
                               q, j, (double)lp[plen - 1 + j], (double)want_lp[j]);
                        compared++;
                    }
                }
            }
            if (pr == 1) {
                const double rms = sqrt(sq / (nsq ? nsq : 1));
                EXPECT(rms < 3e-2, "%s bf16: RMS log-probability difference %.3g", names[k], rms);
            }
            printf("    %s %s: %d tokens of %d prompts as transformers' greedy generate (%d near-ties), "
                   "log-probabilities within %.2g\n", names[k], pr ? "bf16" : "fp32", compared, num, ties, worst);
            mt_generator_free(g);
            mt_trainer_free(t);
        }
        free(p);
        free(raw);
    }
    return TEST_PASS;
}

/* The decode GEMV (megatron.cu section 22, gemv_rows) against a float64 host reference on random operands,
 * per element, fp32 and bf16, every epilogue (+ bias, GELU, squared ReLU, SwiGLU), shapes with tails: K not
 * a multiple of the 32-lane x 8-vector round (a lane's last vectors predicated off), output columns not a
 * multiple of a block's, rows 1 .. 8 (row counts between the kernels' 1, 2, 4, 8), and every cut of K
 * (gen_gemv_plan: 1, 2 and 4 slices summed in the block, with SwiGLU too, and slices of two rounds of loads:
 * K 8200 in bf16, 6400 and 2052 in fp32; test_generate_gemv_plan checks the cut itself on the host). The reference rounds
 * where the kernel rounds (the product to T, + bias to T, the activation to T); the tolerance follows each
 * step: the fp32 sum of K products differs from the exact one by at most K 2^-24 sum|w x| (fp32's
 * accumulation bound), a rounding to T may then land one unit (2^-7 relative in bf16, 2^-23 in fp32) away,
 * and the activation's slope is at most 1.2 (GELU 1.13; SwiGLU's product scaled by |up| and |silu(gate)|).
 * A lost tail vector or a wrong row moves an element by some (8 / K) sum|w x|: far outside in fp32, and in
 * bf16 on most elements. Bitwise: two runs equal, and each row equal to that row run alone (the batch
 * beside a request changes none of its bits), the second run a programmatic dependent launch as in the
 * engine. Shapes gemv_rows does not take (K not a multiple of the
 * vector, more than GEN_GEMV_MAX_ROWS rows) are refused by gemv_rows_supported. */
template <typename T>
static test_result tgen_gemv_case(int n, int cols, int K, int epi, bool with_bias, uint64_t seed) {
    const bool bf = sizeof(T) == 2;
    const int wrows = epi == GEMV_SWIGLU ? 2 * cols : cols;
    const size_t nx = (size_t)n * K, nw = (size_t)wrows * K, nb = (size_t)wrows, ny = (size_t)n * cols;
    std::vector<double> x(nx), w(nw), b(nb, 0.0);
    std::vector<T> hx(nx), hw(nw), hb(nb), hy(ny), hy2(ny), h1(cols);
    uint64_t s = seed;
    auto next = [&s]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return (double)(s >> 11) / 9007199254740992.0; };
    auto put = [&](double v, T* to) -> double { /* v rounded to T, stored; the rounded value */
        if (bf) {
            const uint16_t u = test_bf16_from_float((float)v);
            memcpy((void*)to, &u, 2);
            return test_bf16_to_float(u);
        }
        const float f = (float)v;
        memcpy((void*)to, &f, 4);
        return f;
    };
    auto get = [&](const T* from) -> double {
        if (bf) {
            uint16_t u;
            memcpy(&u, from, 2);
            return test_bf16_to_float(u);
        }
        float f;
        memcpy(&f, from, 4);
        return f;
    };
    const double unit = bf ? 1.0 / 128 : 1.0 / 8388608;
    auto round_t = [&](double v) { T tmp; return put(v, &tmp); };
    for (size_t i = 0; i < nx; i++) x[i] = put(2.0 * next() - 1.0, &hx[i]);
    for (size_t i = 0; i < nw; i++) w[i] = put(2.0 * next() - 1.0, &hw[i]);
    for (size_t i = 0; i < nb; i++) b[i] = put(next() - 0.5, &hb[i]);
    T *dx = NULL, *dw = NULL, *db = NULL, *dy = NULL;
    EXPECT(cudaMalloc(&dx, nx * sizeof(T)) == cudaSuccess && cudaMalloc(&dw, nw * sizeof(T)) == cudaSuccess &&
               cudaMalloc(&db, nb * sizeof(T)) == cudaSuccess && cudaMalloc(&dy, ny * sizeof(T)) == cudaSuccess,
           "cudaMalloc");
    cudaMemcpy(dx, hx.data(), nx * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(dw, hw.data(), nw * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb.data(), nb * sizeof(T), cudaMemcpyHostToDevice);
    mt_gpu_error err;
    memset(&err, 0, sizeof(err));
    mt_exec ex;
    memset(&ex, 0, sizeof(ex));
    ex.error = &err;
    EXPECT(gemv_rows_supported<T>(n, K, dx, K, dw), "gemv_rows refuses %d rows of K %d", n, K);
    gemv_rows<T>(&ex, epi, dy, cols, dx, K, dw, with_bias ? db : NULL, n, cols, K);
    cudaMemcpy(hy.data(), dy, ny * sizeof(T), cudaMemcpyDeviceToHost);
    gemv_rows<T>(&ex, epi, dy, cols, dx, K, dw, with_bias ? db : NULL, n, cols, K, true); /* as the engine launches it */
    cudaMemcpy(hy2.data(), dy, ny * sizeof(T), cudaMemcpyDeviceToHost);
    EXPECT(cudaDeviceSynchronize() == cudaSuccess && err.status == MT_OK, "gemv_rows: %s", err.error.message);
    EXPECT(!memcmp(hy.data(), hy2.data(), ny * sizeof(T)), "two runs differ");
    for (int r = 0; n > 1 && r < n; r++) { /* row r alone */
        gemv_rows<T>(&ex, epi, dy, cols, dx + (size_t)r * K, K, dw, with_bias ? db : NULL, 1, cols, K);
        cudaMemcpy(h1.data(), dy, cols * sizeof(T), cudaMemcpyDeviceToHost);
        EXPECT(!memcmp(h1.data(), hy.data() + (size_t)r * cols, cols * sizeof(T)), "row %d of %d alone differs", r, n);
    }
    double worst = 0.0;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < cols; j++) {
            double stage[2], err_stage[2];
            for (int q = 0; q < (epi == GEMV_SWIGLU ? 2 : 1); q++) {
                const int row = j + q * cols;
                double acc = 0.0, S = 0.0;
                for (int k = 0; k < K; k++) {
                    acc += w[(size_t)row * K + k] * x[(size_t)r * K + k];
                    S += fabs(w[(size_t)row * K + k] * x[(size_t)r * K + k]);
                }
                double e = K * S / 16777216.0;
                double y = round_t(acc);
                e += unit * (fabs(acc) + e);
                if (with_bias) {
                    const double z = round_t(y + b[row]);
                    e += unit * (fabs(y + b[row]) + e);
                    y = z;
                }
                stage[q] = y, err_stage[q] = e;
            }
            double want, tol;
            const double g = stage[0], eg = err_stage[0];
            if (epi == GEMV_PLAIN) want = g, tol = eg;
            else if (epi == GEMV_GELU) want = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))), tol = 1.2 * eg;
            else if (epi == GEMV_SQUARED_RELU) want = g > 0 ? g * g : 0.0, tol = 2.0 * (fabs(g) + eg) * eg;
            else {
                const double sg = g / (1.0 + exp(-g)), up = stage[1];
                want = sg * up, tol = 1.2 * eg * (fabs(up) + err_stage[1]) + (fabs(sg) + 1.2 * eg) * err_stage[1];
            }
            tol += unit * (fabs(want) + tol) + 1e-30; /* the output's rounding */
            const double got = get(&hy[(size_t)r * cols + j]), d = fabs(got - want);
            worst = d / tol > worst ? d / tol : worst;
            EXPECT(d <= tol, "%s n %d cols %d K %d epilogue %d: (%d, %d) %.8g, reference %.8g (tolerance %.3g)",
                   bf ? "bf16" : "fp32", n, cols, K, epi, r, j, got, want, tol);
        }
    printf("    %s n %d cols %d K %d epilogue %d%s: within %.2f of the tolerance, bitwise repeatable and batch-free\n",
           bf ? "bf16" : "fp32", n, cols, K, epi, with_bias ? " + bias" : "", worst);
    cudaFree(dx), cudaFree(dw), cudaFree(db), cudaFree(dy);
    return TEST_PASS;
}

/* GEMV_ROPE (the QKV linear with RoPE in its epilogue, as the engine's decode steps run it) against the two
 * kernels it replaces, gemv_rows GEMV_PLAIN then rope_qkv_rows at the rows' positions: bitwise equal (the same
 * roundings: the product to T, + bias to T, the rotation from those T values to T, the same expression), every
 * row equal to that row alone; heads of full and partial rotation, random tables and positions. */
template <typename T>
static test_result tgen_gemv_rope_case(int n, int groups, int qpg, int d, int rot, int K, uint64_t seed) {
    const int cols = groups * (qpg + 2) * d, half = rot / 2, P = 37;
    const size_t nx = (size_t)n * K, nw = (size_t)cols * K, ny = (size_t)n * cols;
    std::vector<T> hx(nx), hw(nw), hb(cols), hy(ny), hz(ny), h1(cols);
    std::vector<float> tab(2 * (size_t)P * half);
    std::vector<int32_t> pos(n);
    uint64_t s = seed;
    auto next = [&s]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return (double)(s >> 11) / 9007199254740992.0; };
    auto put = [](double v, T* to) {
        if (sizeof(T) == 2) {
            const uint16_t u = test_bf16_from_float((float)v);
            memcpy((void*)to, &u, 2);
        } else {
            const float f = (float)v;
            memcpy((void*)to, &f, 4);
        }
    };
    for (size_t i = 0; i < nx; i++) put(2.0 * next() - 1.0, &hx[i]);
    for (size_t i = 0; i < nw; i++) put(2.0 * next() - 1.0, &hw[i]);
    for (int i = 0; i < cols; i++) put(next() - 0.5, &hb[i]);
    for (size_t i = 0; i < (size_t)P * half; i++) {
        const double a = 6.283185307179586 * next();
        tab[i] = (float)cos(a), tab[(size_t)P * half + i] = (float)sin(a);
    }
    for (int r = 0; r < n; r++) pos[r] = (int32_t)(next() * P);
    T *dx = NULL, *dw = NULL, *db = NULL, *dy = NULL, *dz = NULL;
    float* dtab = NULL;
    int32_t* dpos = NULL;
    EXPECT(cudaMalloc(&dx, nx * sizeof(T)) == cudaSuccess && cudaMalloc(&dw, nw * sizeof(T)) == cudaSuccess &&
               cudaMalloc(&db, cols * sizeof(T)) == cudaSuccess && cudaMalloc(&dy, ny * sizeof(T)) == cudaSuccess &&
               cudaMalloc(&dz, ny * sizeof(T)) == cudaSuccess && cudaMalloc(&dtab, tab.size() * sizeof(float)) == cudaSuccess &&
               cudaMalloc(&dpos, n * sizeof(int32_t)) == cudaSuccess,
           "cudaMalloc");
    cudaMemcpy(dx, hx.data(), nx * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(dw, hw.data(), nw * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb.data(), cols * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(dtab, tab.data(), tab.size() * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(dpos, pos.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice);
    mt_gpu_error err;
    memset(&err, 0, sizeof(err));
    mt_exec ex;
    memset(&ex, 0, sizeof(ex));
    ex.error = &err;
    const gen_gemv_rope rope = {dtab, dtab + (size_t)P * half, dpos, d, rot, qpg};
    EXPECT(gemv_rows_supported<T>(n, K, dx, K, dw) && gemv_rope_supported(d, rot, qpg, cols), "RoPE GEMV refused");
    gemv_rows<T>(&ex, GEMV_ROPE, dy, cols, dx, K, dw, db, n, cols, K, true, &rope);
    gemv_rows<T>(&ex, GEMV_PLAIN, dz, cols, dx, K, dw, db, n, cols, K);
    mt_attention_dims dims;
    memset(&dims, 0, sizeof(dims));
    dims.B = 1, dims.S = n, dims.heads = groups * qpg, dims.groups = groups, dims.d = d, dims.rot = rot;
    dims.rope_cos = rope.cos, dims.rope_sin = rope.sin, dims.positions = dpos;
    rope_qkv_rows<T>(&ex, dims, dz, false);
    cudaMemcpy(hy.data(), dy, ny * sizeof(T), cudaMemcpyDeviceToHost);
    cudaMemcpy(hz.data(), dz, ny * sizeof(T), cudaMemcpyDeviceToHost);
    EXPECT(cudaDeviceSynchronize() == cudaSuccess && err.status == MT_OK, "gemv_rows: %s", err.error.message);
    /* bf16: bitwise. fp32: within 2^-17 of the output's RMS: measured on an H200, the fused epilogue and
     * rope_qkv_rows contract the rotation's multiply-adds differently in fp32 (partial rotary, rot 62:
     * 0.452572256 vs 0.452572554, 6.6e-7 relative: x cos - y sin with cancellation, each product's rounding
     * kept or not); rounded to bf16 they agree bitwise. A wrong pairing, angle or sign is off by O(RMS). */
    double sq = 0.0;
    for (size_t i = 0; i < ny; i++) sq += (double)(float)hz[i] * (double)(float)hz[i];
    const double rms = sqrt(sq / (double)ny);
    for (size_t i = 0; i < ny; i++) {
        const double a = (double)(float)hy[i], b = (double)(float)hz[i];
        const bool same = sizeof(T) == 2 ? !memcmp(&hy[i], &hz[i], sizeof(T)) : fabs(a - b) <= ldexp(rms, -17);
        EXPECT(same, "%s n %d groups %d qpg %d d %d rot %d: row %zu column %zu differs from gemv_rows + rope_qkv_rows "
               "(%.9g vs %.9g)", sizeof(T) == 2 ? "bf16" : "fp32", n, groups, qpg, d, rot, i / cols, i % cols, a, b);
    }
    for (int r = 0; n > 1 && r < n; r++) { /* row r alone */
        const gen_gemv_rope one = {rope.cos, rope.sin, dpos + r, d, rot, qpg};
        gemv_rows<T>(&ex, GEMV_ROPE, dy, cols, dx + (size_t)r * K, K, dw, db, 1, cols, K, false, &one);
        cudaMemcpy(h1.data(), dy, cols * sizeof(T), cudaMemcpyDeviceToHost);
        EXPECT(!memcmp(h1.data(), hy.data() + (size_t)r * cols, cols * sizeof(T)), "RoPE GEMV: row %d of %d alone differs", r, n);
    }
    printf("    %s n %d, %d groups of %d + 2 heads of %d (rot %d), K %d: RoPE GEMV equal to GEMV + RoPE (bf16 bitwise, fp32 within 2^-17 of the RMS), batch-free\n",
           sizeof(T) == 2 ? "bf16" : "fp32", n, groups, qpg, d, rot, K);
    cudaFree(dx), cudaFree(dw), cudaFree(db), cudaFree(dy), cudaFree(dz), cudaFree(dtab), cudaFree(dpos);
    return TEST_PASS;
}

static test_result test_generate_gpu_gemv(void) {
    REQUIRE_GPU();
    struct {
        int n, cols, K, epi, bias;
    } f32[] = {{1, 37, 28, GEMV_PLAIN, 1}, {3, 130, 1604, GEMV_GELU, 1}, {8, 67, 2052, GEMV_SWIGLU, 1},
               {5, 9, 6400, GEMV_PLAIN, 0}, {2, 1, 4, GEMV_SQUARED_RELU, 1}, {6, 250, 1024, GEMV_SWIGLU, 0}},
      b16[] = {{1, 4800, 1600, GEMV_PLAIN, 1}, {4, 257, 1608, GEMV_GELU, 1}, {8, 100, 2056, GEMV_SWIGLU, 0},
               {7, 33, 6400, GEMV_SQUARED_RELU, 1}, {1, 3, 8, GEMV_PLAIN, 0}, {2, 515, 2048, GEMV_SWIGLU, 1},
               {3, 37, 8200, GEMV_GELU, 1}, {1, 1600, 1600, GEMV_PLAIN, 1}, {2, 1600, 6400, GEMV_GELU, 0},
               {5, 1024, 2048, GEMV_SWIGLU, 1}};
    for (size_t i = 0; i < sizeof(f32) / sizeof(f32[0]); i++) {
        test_result r = tgen_gemv_case<float>(f32[i].n, f32[i].cols, f32[i].K, f32[i].epi, f32[i].bias, 100 + i);
        if (r != TEST_PASS) return r;
    }
    for (size_t i = 0; i < sizeof(b16) / sizeof(b16[0]); i++) {
        test_result r = tgen_gemv_case<__nv_bfloat16>(b16[i].n, b16[i].cols, b16[i].K, b16[i].epi, b16[i].bias, 200 + i);
        if (r != TEST_PASS) return r;
    }
    {
        test_result r = tgen_gemv_rope_case<__nv_bfloat16>(1, 8, 4, 64, 64, 2048, 300); /* Llama-3.2-1B's QKV */
        if (r == TEST_PASS) r = tgen_gemv_rope_case<__nv_bfloat16>(5, 3, 2, 16, 8, 1608, 301);
        if (r == TEST_PASS) r = tgen_gemv_rope_case<float>(8, 2, 3, 32, 32, 260, 302);
        if (r == TEST_PASS) r = tgen_gemv_rope_case<float>(3, 4, 1, 64, 62, 6400, 303);
        if (r != TEST_PASS) return r;
    }
    const __nv_bfloat16* aligned = (const __nv_bfloat16*)(uintptr_t)256;
    EXPECT(!gemv_rows_supported<__nv_bfloat16>(1, 12, aligned, 12, aligned), "K 12 in bf16 (not a multiple of 8) taken");
    EXPECT(!gemv_rows_supported<__nv_bfloat16>(GEN_GEMV_MAX_ROWS + 1, 64, aligned, 64, aligned), "9 rows taken");
    EXPECT(!gemv_rows_supported<__nv_bfloat16>(1, 64, aligned + 1, 64, aligned), "an unaligned x taken");
    return TEST_PASS;
}

static const test_case generate_tests[] = {
    {"generate_settings_refused", test_generate_settings_refused},
    {"generate_uniform", test_generate_uniform},
    {"generate_gemv_plan", test_generate_gemv_plan},
};

static const test_case generate_gpu_tests[] = {
    {"generate_recompute_gpt2", test_generate_gpu_recompute_gpt2},
    {"generate_recompute_llama", test_generate_gpu_recompute_llama},
    {"generate_batch_independent", test_generate_gpu_batch_independent},
    {"generate_sampling", test_generate_gpu_sampling},
    {"generate_block_reuse", test_generate_gpu_block_reuse},
    {"generate_endings", test_generate_gpu_endings},
    {"generate_transformers", test_generate_gpu_transformers},
    {"generate_gemv", test_generate_gpu_gemv},
};

#endif
