/* tests/test_dropout.h — dropout (--hidden-dropout, --attention-dropout; megatron.cu sections 5, 8, 9, 16).
 *
 * host: the mask generator is the one dev/ref_gpt.py implements in numpy (a stream key, one element's
 *       bits, the threshold, and the count and index sum of the dropped elements of a hidden and an
 *       attention mask, numbers printed by ref_gpt.py's functions); the masks' statistics (dropped
 *       fraction ~p; different per iteration, layer, site and micro-batch; the same for the same
 *       coordinates); the flags (Megatron's default 0.1, the built-in job's 0, [0, 1), NaN refused).
 * gpu:  the hidden-dropout kernels (dropout_apply, bias_residual's 16-byte and scalar paths,
 *       residual_norm_forward) drop exactly the host's mask and scale the rest; the flash attention
 *       kernels with attention dropout (head dims 64 and 128, GQA, a sequence that is no multiple of the
 *       tiles, a site whose sample and head numbers are offset as on a TP rank) against a double
 *       reference with the same masks; GPT-2 and Llama with dropout 0.1 at all four sites against
 *       dev/ref_gpt.py's vectors (gpt2_dropout: one head of dim 128 and an odd sequence; llama_dropout:
 *       GQA heads of dim 64), fp32 (the exact attention path) and bf16 (the flash kernels); bitwise
 *       repeatability and save/load resume with dropout on; evaluation without dropout. */
#ifndef MT_TEST_DROPOUT_H
#define MT_TEST_DROPOUT_H

/* a site as dropout_site makes it, from explicit coordinates */
static mt_dropout test_dropout_site(double p, int64_t iteration, int layer, int site, int64_t row0, int head0, int heads) {
    mt_dropout d = mt_dropout();
    d.on = 1;
    d.threshold = dropout_threshold(p);
    d.scale = (float)(1.0 / (1.0 - p));
    d.key = dropout_stream(1234, iteration, layer, site);
    d.row0 = row0;
    d.head0 = head0;
    d.heads = heads;
    return d;
}
static bool test_hidden_keeps(const mt_dropout& d, int64_t row, int c, int C) {
    return dropout_keeps(d, dropout_bits(d.key, dropout_hidden_counter(d, row, c, C)), c);
}
static bool test_attention_keeps(const mt_dropout& d, int b, int h, int q, int k, int T) {
    return dropout_keeps(d, dropout_bits(d.key, dropout_attention_counter(d, b, h, q, k, T)), k);
}

/* ---- host ------------------------------------------------------------------------------------- */

/* The numbers come from dev/ref_gpt.py (seed 1234): dropout_stream(1234, 7, 1, SITE_ATTENTION),
 * dropout_stream(1234, 0, -1, SITE_EMBEDDING), splitmix64(key + 123456789 * golden),
 * dropout_threshold(float32(0.1)) and of 0.5; Dropout(cfg, 3).hidden_mask(4, 33, 130, 1, SITE_FC2)
 * and Dropout(cfg, 5).attention_mask(2, 3, 33, 0) with p = float32(0.1): dropped count, index sum. */
static test_result test_dropout_hash_matches_reference(void) {
    const uint64_t key = dropout_stream(1234, 7, 1, DROPOUT_ATTENTION);
    EXPECT(key == 0xeab02bcd7f7a44d7ull, "stream key %llx", (unsigned long long)key);
    EXPECT(dropout_stream(1234, 0, -1, DROPOUT_EMBEDDING) == 0x7a62634b1e37a011ull, "embedding stream");
    EXPECT(dropout_bits(key, 123456789) == 0x8bb800567f999ff3ull, "bits %llx",
           (unsigned long long)dropout_bits(key, 123456789));
    const double p = (double)0.1f; /* the float32 the vector files hold */
    EXPECT(dropout_threshold(p) == 429496736u && dropout_threshold(0.5) == 2147483648u, "thresholds");
    EXPECT(dropout_threshold(0.9999999999999) == 0xFFFFFFFFu && dropout_threshold(0.0) == 0, "threshold ends");
    mt_dropout h = test_dropout_site(p, 3, 1, DROPOUT_FC2, 0, 0, 0);
    int64_t count = 0, sum = 0;
    for (int64_t r = 0; r < 4 * 33; r++)
        for (int c = 0; c < 130; c++)
            if (!test_hidden_keeps(h, r, c, 130)) count++, sum += r * 130 + c;
    EXPECT(count == 1645 && sum == 13988551, "hidden mask: %lld dropped, index sum %lld", (long long)count,
           (long long)sum);
    mt_dropout a = test_dropout_site(p, 5, 0, DROPOUT_ATTENTION, 0, 0, 3);
    count = sum = 0;
    for (int b = 0; b < 2; b++)
        for (int hh = 0; hh < 3; hh++)
            for (int q = 0; q < 33; q++)
                for (int k = 0; k < 33; k++)
                    if (!test_attention_keeps(a, b, hh, q, k, 33)) count++, sum += ((b * 3 + hh) * 33 + q) * 33 + k;
    EXPECT(count == 657 && sum == 2127097, "attention mask: %lld dropped, index sum %lld", (long long)count,
           (long long)sum);
    return TEST_PASS;
}

/* Fraction dropped over 2^20 elements: within 5 binomial sigmas (sqrt(p(1-p)/n) = 2.9e-4 at p = 0.1)
 * of p. Two masks that differ in one coordinate (iteration, layer, site, micro-batch = first row)
 * agree on an element with probability 1 - 2p(1-p) = 0.82 when independent; the same coordinates
 * give the same mask (nothing else enters). */
static test_result test_dropout_mask_statistics(void) {
    const int N = 1024, C = 1024;
    const double p = 0.1;
    const mt_dropout base = test_dropout_site(p, 4, 2, DROPOUT_PROJ, 0, 0, 0);
    const mt_dropout others[] = {
        test_dropout_site(p, 5, 2, DROPOUT_PROJ, 0, 0, 0), /* next iteration */
        test_dropout_site(p, 4, 3, DROPOUT_PROJ, 0, 0, 0), /* next layer */
        test_dropout_site(p, 4, 2, DROPOUT_FC2, 0, 0, 0),  /* other site */
        test_dropout_site(p, 4, 2, DROPOUT_PROJ, N, 0, 0), /* next micro-batch: its rows follow */
    };
    const char* what[] = {"iteration", "layer", "site", "micro-batch"};
    int64_t dropped = 0, agree[4] = {0, 0, 0, 0};
    for (int r = 0; r < N; r++)
        for (int c = 0; c < C; c++) {
            const bool k = test_hidden_keeps(base, r, c, C);
            dropped += !k;
            for (int o = 0; o < 4; o++) agree[o] += k == test_hidden_keeps(others[o], r, c, C);
        }
    const double n = (double)N * C, frac = dropped / n, sigma = sqrt(p * (1 - p) / n);
    EXPECT(fabs(frac - p) < 5 * sigma, "dropped fraction %.5f, p %.2f", frac, p);
    for (int o = 0; o < 4; o++) {
        const double rate = agree[o] / n, expect = 1 - 2 * p * (1 - p);
        EXPECT(fabs(rate - expect) < 0.01, "another %s: masks agree on %.4f (independent: %.4f)", what[o], rate, expect);
    }
    const mt_dropout same = test_dropout_site(p, 4, 2, DROPOUT_PROJ, 0, 0, 0);
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < C; c++)
            EXPECT(test_hidden_keeps(same, r, c, C) == test_hidden_keeps(base, r, c, C), "repeat differs at %d %d", r, c);
    /* attention: the fraction over a causal-free [T, T] grid, and heads differ */
    const int T = 512;
    const mt_dropout att = test_dropout_site(p, 4, 2, DROPOUT_ATTENTION, 0, 0, 4);
    int64_t adrop = 0, head_agree = 0;
    for (int q = 0; q < T; q++)
        for (int k = 0; k < T; k++) {
            const bool k0 = test_attention_keeps(att, 0, 0, q, k, T);
            adrop += !k0;
            head_agree += k0 == test_attention_keeps(att, 0, 1, q, k, T);
        }
    const double an = (double)T * T, afrac = adrop / an;
    EXPECT(fabs(afrac - p) < 5 * sqrt(p * (1 - p) / an), "attention dropped fraction %.5f", afrac);
    EXPECT(fabs(head_agree / an - (1 - 2 * p * (1 - p))) < 0.01, "heads agree on %.4f", head_agree / an);
    return TEST_PASS;
}

/* The flags: Megatron's default 0.1 (any job with data), the built-in job's 0, a value in [0, 1)
 * lands in the config, 1, negative, NaN and Inf are refused (the parser and mt_config_finalize). */
static test_result test_dropout_flags(void) {
    const char* base[] = {"train_gpt", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                          "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                          "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3"};
    const int nb = (int)(sizeof(base) / sizeof(base[0]));
    static tg_flags v;
    char msg[512] = "";
    char* argv[64];
    const char* none[] = {NULL};
    int n = flags_argv_with(base, nb, none, argv);
    EXPECT(flags_configure(argv, n, 1000, 1, &v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.hidden_dropout == 0.1 && v.cfg.attention_dropout == 0.1, "Megatron's defaults: %g %g",
           v.cfg.hidden_dropout, v.cfg.attention_dropout);
    const char* set[] = {"--hidden-dropout", "0.25", "--attention-dropout=0", NULL};
    n = flags_argv_with(base, nb, set, argv);
    EXPECT(flags_configure(argv, n, 1000, 1, &v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.hidden_dropout == 0.25 && v.cfg.attention_dropout == 0.0, "set: %g %g", v.cfg.hidden_dropout,
           v.cfg.attention_dropout);
    /* the built-in job: no --data-path, no --mock-data */
    const char* builtin[] = {"train_gpt"};
    EXPECT(flags_configure((char**)builtin, 1, 50257, 1, &v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.builtin && v.cfg.hidden_dropout == 0.0 && v.cfg.attention_dropout == 0.0, "built-in job: %g %g",
           v.cfg.hidden_dropout, v.cfg.attention_dropout);
    const char* builtin_set[] = {"train_gpt", "--attention-dropout", "0.1"};
    EXPECT(flags_configure((char**)builtin_set, 3, 50257, 1, &v, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(v.cfg.hidden_dropout == 0.0 && v.cfg.attention_dropout == 0.1, "built-in job with the flag");
    struct { const char* args[3]; const char* needle; } bad[] = {
        {{"--hidden-dropout", "1"}, "--hidden-dropout"},
        {{"--attention-dropout", "-0.1"}, "--attention-dropout"},
        {{"--hidden-dropout", "nan"}, "--hidden-dropout"},
        {{"--attention-dropout=inf"}, "--attention-dropout"},
        {{"--hidden-dropout", "0.1x"}, "--hidden-dropout"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        n = flags_argv_with(base, nb, bad[i].args, argv);
        EXPECT(flags_configure(argv, n, 1000, 1, &v, msg, sizeof(msg)) != 0 && strstr(msg, bad[i].needle),
               "case %zu: %s", i, msg);
    }
    /* the library's own check, for callers that fill mt_config themselves */
    const double values[] = {1.0, -0.01, NAN, INFINITY};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++)
        for (int which = 0; which < 2; which++) {
            mt_config c = small_test_config();
            if (which) c.attention_dropout = values[i];
            else c.hidden_dropout = values[i];
            mt_error err;
            err.message[0] = 0;
            EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, "dropout"),
                   "value %g: %s", values[i], err.message);
        }
    mt_config c = small_test_config();
    c.hidden_dropout = c.attention_dropout = 0.999;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_config d;
    mt_config_defaults(&d);
    EXPECT(d.hidden_dropout == 0.1 && d.attention_dropout == 0.1, "mt_config_defaults: Megatron's 0.1");
    return TEST_PASS;
}

/* ---- gpu: the hidden-dropout kernels ----------------------------------------------------------- */

#define DROP_CUDA(call)                                                                         \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) {                                                                \
            printf("    FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            ok = false;                                                                         \
            goto done;                                                                          \
        }                                                                                       \
    } while (0)

static float drop_random(uint64_t* s) { /* +-[0.1, 1.1): never 0, so a 0 output is a dropped element */
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (double)(*s >> 11) / 9007199254740992.0;
    const double mag = 0.1 + fmod(u * 2.0, 1.0);
    return (float)(u < 0.5 ? -mag : mag);
}

/* One shape: out = dropout(in) (exact: a product by the scale or 0), bias_residual and
 * residual_norm_forward's sums = residual + dropout(branch + bias) (1e-6 relative: the device may
 * fuse the scale's product into the add), zeros exactly where the host's mask drops. */
static bool dropout_kernels_case(int N, int C, int row0) {
    bool ok = true;
    const size_t n = (size_t)N * C;
    float *h_in = (float*)malloc(n * 4), *h_res = (float*)malloc(n * 4), *h_bias = (float*)malloc((size_t)C * 4);
    float *h_out = (float*)malloc(n * 4), *h_w = (float*)malloc((size_t)C * 4);
    float *in = NULL, *out = NULL, *res = NULL, *bias = NULL, *w = NULL, *normed = NULL, *stats = NULL;
    uint64_t s = 77 + (uint64_t)C;
    for (size_t i = 0; i < n; i++) h_in[i] = drop_random(&s), h_res[i] = drop_random(&s);
    for (int c = 0; c < C; c++) h_bias[c] = 0.01f * drop_random(&s), h_w[c] = 1.0f;
    const mt_dropout d = test_dropout_site(0.3, 2, 1, DROPOUT_FC2, row0, 0, 0);
    mt_gpu_error gerr = {};
    mt_exec ex = {};
    ex.stream = 0;
    ex.error = &gerr;
    DROP_CUDA(cudaMalloc(&in, n * 4));
    DROP_CUDA(cudaMalloc(&out, n * 4));
    DROP_CUDA(cudaMalloc(&res, n * 4));
    DROP_CUDA(cudaMalloc(&normed, n * 4));
    DROP_CUDA(cudaMalloc(&stats, (size_t)N * 8));
    DROP_CUDA(cudaMalloc(&bias, (size_t)C * 4));
    DROP_CUDA(cudaMalloc(&w, (size_t)C * 4));
    DROP_CUDA(cudaMemcpy(in, h_in, n * 4, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(res, h_res, n * 4, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(bias, h_bias, (size_t)C * 4, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(w, h_w, (size_t)C * 4, cudaMemcpyHostToDevice));
    for (int kernel = 0; kernel < 4 && ok; kernel++) {
        /* 0 dropout_apply, 1 bias_residual (16-byte when C % 4 == 0), 2 its scalar path (bias at an
         * address no multiple of 16), 3 residual_norm_forward */
        DROP_CUDA(cudaMemset(out, 0xFF, n * 4));
        const float* b = kernel == 2 ? bias + 1 : bias;
        const float* hb = kernel == 2 ? h_bias + 1 : h_bias;
        const int Cb = kernel == 2 ? C - 1 : C; /* columns the shifted bias covers */
        if (kernel == 2 && C < 2) continue;
        if (kernel == 0) dropout_apply<float>(&ex, out, in, d, N, C);
        if (kernel == 1) bias_residual<float>(&ex, out, res, in, bias, N, C, d);
        if (kernel == 2) bias_residual<float>(&ex, out, res, in, b, N, Cb, d);
        if (kernel == 3)
            residual_norm_forward<float>(&ex, out, normed, stats, stats + N, res, in, bias, w, (const float*)NULL, N, C,
                                         1e-5f, false, 0.0f, d);
        DROP_CUDA(cudaDeviceSynchronize());
        if (gerr.status != MT_OK) {
            printf("    FAIL kernel %d: %s\n", kernel, gerr.error.message);
            ok = false;
            goto done;
        }
        DROP_CUDA(cudaMemcpy(h_out, out, n * 4, cudaMemcpyDeviceToHost));
        const int cols = kernel == 2 ? Cb : C;
        int64_t bad = 0, dropped = 0;
        for (int r = 0; r < N; r++)
            for (int c = 0; c < cols; c++) {
                const size_t i = (size_t)r * cols + c;
                const bool keep = test_hidden_keeps(d, r, c, cols);
                dropped += !keep;
                if (kernel == 0) {
                    bad += h_out[i] != (keep ? h_in[i] * d.scale : 0.0f);
                } else {
                    const float branch = h_in[i] + hb[c];
                    const double want = (double)h_res[i] + (keep ? (double)(branch * d.scale) : 0.0);
                    bad += !(fabs(h_out[i] - want) <= 1e-6 * (fabs(want) + 1.0));
                }
            }
        if (bad) {
            printf("    FAIL kernel %d, %d x %d (row0 %d): %lld of %lld elements differ from the host's mask\n", kernel,
                   N, cols, row0, (long long)bad, (long long)N * cols);
            ok = false;
        }
        if (!(dropped > 0 && dropped < (int64_t)N * cols)) {
            printf("    FAIL kernel %d: %lld dropped of %lld\n", kernel, (long long)dropped, (long long)N * cols);
            ok = false;
        }
    }
done:
    cudaFree(in), cudaFree(out), cudaFree(res), cudaFree(bias), cudaFree(w), cudaFree(normed), cudaFree(stats);
    free(h_in), free(h_res), free(h_bias), free(h_out), free(h_w);
    return ok;
}

static test_result test_dropout_hidden_kernels(void) {
    REQUIRE_GPU();
    bool ok = true;
    ok &= dropout_kernels_case(67, 128, 0);   /* 16-byte paths, fused residual + norm */
    ok &= dropout_kernels_case(33, 130, 200); /* rows of a later micro-batch */
    ok &= dropout_kernels_case(9, 7, 5);      /* odd columns: the last pair half empty, scalar paths */
    return ok ? TEST_PASS : TEST_FAIL;
}

/* ---- gpu: flash attention with dropout ----------------------------------------------------------- */

/* Double reference on packed [B, H, T, d] (K, V [B, Hkv, T, d]) with the site's masks: P = softmax,
 * P_d = P * keep * scale, O = P_d V, dV = P_d^T dO, dP = (dO V^T) * keep * scale,
 * dS = P * (dP - rowsum(dP * P)), dQ = scale_attn dS K, dK = scale_attn dS^T Q. */
static void dropout_attention_reference(const flash_shape* s, const mt_dropout& drop, const uint16_t* q,
                                        const uint16_t* k, const uint16_t* v, const uint16_t* dout, double* o,
                                        double* dq, double* dk, double* dv, bool with_dropout) {
    const int T = s->T, d = s->d, qpg = s->H / s->Hkv;
    const double sc = 1.0 / sqrt((double)d);
    double* P = (double*)malloc(sizeof(double) * T);
    double* dP = (double*)malloc(sizeof(double) * T);
    double* M = (double*)malloc(sizeof(double) * T);
    memset(dk, 0, sizeof(double) * (size_t)s->B * s->Hkv * T * d);
    memset(dv, 0, sizeof(double) * (size_t)s->B * s->Hkv * T * d);
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++) {
            const size_t qo = ((size_t)b * s->H + h) * T * d, ko = ((size_t)b * s->Hkv + h / qpg) * T * d;
            for (int i = 0; i < T; i++) {
                double mx = -INFINITY, sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    double x = 0.0;
                    for (int e = 0; e < d; e++) x += flash_bf2d(q[qo + (size_t)i * d + e]) * flash_bf2d(k[ko + (size_t)j * d + e]);
                    P[j] = x * sc;
                    if (P[j] > mx) mx = P[j];
                }
                for (int j = 0; j <= i; j++) P[j] = exp(P[j] - mx), sum += P[j];
                for (int j = 0; j <= i; j++) {
                    P[j] /= sum;
                    M[j] = !with_dropout ? 1.0 : test_attention_keeps(drop, b, h, i, j, T) ? (double)drop.scale : 0.0;
                }
                double dot = 0.0;
                for (int e = 0; e < d; e++) {
                    double acc = 0.0;
                    for (int j = 0; j <= i; j++) acc += P[j] * M[j] * flash_bf2d(v[ko + (size_t)j * d + e]);
                    o[qo + (size_t)i * d + e] = acc;
                }
                for (int j = 0; j <= i; j++) {
                    double g = 0.0;
                    for (int e = 0; e < d; e++) g += flash_bf2d(dout[qo + (size_t)i * d + e]) * flash_bf2d(v[ko + (size_t)j * d + e]);
                    for (int e = 0; e < d; e++) dv[ko + (size_t)j * d + e] += P[j] * M[j] * flash_bf2d(dout[qo + (size_t)i * d + e]);
                    dP[j] = g * M[j];
                    dot += dP[j] * P[j];
                }
                for (int e = 0; e < d; e++) dq[qo + (size_t)i * d + e] = 0.0;
                for (int j = 0; j <= i; j++) {
                    const double ds = P[j] * (dP[j] - dot) * sc;
                    for (int e = 0; e < d; e++) {
                        dq[qo + (size_t)i * d + e] += ds * flash_bf2d(k[ko + (size_t)j * d + e]);
                        dk[ko + (size_t)j * d + e] += ds * flash_bf2d(q[qo + (size_t)i * d + e]);
                    }
                }
            }
        }
    free(P), free(dP), free(M);
}

/* Tolerances as tests/test_attention.h's (2e-2 norm-wise: bf16 outputs, P_d and dS rounded to bf16
 * before their tensor-core products); the same run without the masks must be far off (> 0.1 at
 * p = 0.2), so a kernel that ignored or misplaced the mask fails; a second backward is bitwise equal. */
static bool dropout_flash_case(const flash_shape* s) {
    bool ok = true;
    const int T = s->T, d = s->d, qpg = s->H / s->Hkv;
    const size_t nq = (size_t)s->B * s->H * T * d, nk = (size_t)s->B * s->Hkv * T * d, nl = (size_t)s->B * s->H * T;
    uint16_t *hq = (uint16_t*)malloc(nq * 2), *hk = (uint16_t*)malloc(nk * 2), *hv = (uint16_t*)malloc(nk * 2);
    uint16_t *hdo = (uint16_t*)malloc(nq * 2), *hbuf = (uint16_t*)malloc(nq * 2), *hbuf2 = (uint16_t*)malloc(nq * 2);
    double *ro = (double*)malloc(nq * 8), *rdq = (double*)malloc(nq * 8), *rdk = (double*)malloc(nk * 8),
           *rdv = (double*)malloc(nk * 8), *got = (double*)malloc(nq * 8);
    double *no = (double*)malloc(nq * 8), *ndq = (double*)malloc(nq * 8), *ndk = (double*)malloc(nk * 8),
           *ndv = (double*)malloc(nk * 8);
    bf16 *q = NULL, *k = NULL, *v = NULL, *o = NULL, *dout = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    float *lse = NULL, *dsum = NULL;
    uint64_t rng = 0xD50Full + (uint64_t)T * 7 + d;
    flash_fill(hq, nq, 1.7f, &rng);
    flash_fill(hk, nk, 1.7f, &rng);
    flash_fill(hv, nk, 1.0f, &rng);
    flash_fill(hdo, nq, 1.0f, &rng);
    /* as on TP rank 1 of 2 (heads numbered from H of 2H), for micro-batch samples from 3 on */
    const mt_dropout drop = test_dropout_site(0.2, 6, 1, DROPOUT_ATTENTION, 3, s->H, 2 * s->H);
    dropout_attention_reference(s, drop, hq, hk, hv, hdo, ro, rdq, rdk, rdv, true);
    dropout_attention_reference(s, drop, hq, hk, hv, hdo, no, ndq, ndk, ndv, false);
    DROP_CUDA(cudaMalloc(&q, nq * 2));
    DROP_CUDA(cudaMalloc(&o, nq * 2));
    DROP_CUDA(cudaMalloc(&dout, nq * 2));
    DROP_CUDA(cudaMalloc(&dq, nq * 2));
    DROP_CUDA(cudaMalloc(&k, nk * 2));
    DROP_CUDA(cudaMalloc(&v, nk * 2));
    DROP_CUDA(cudaMalloc(&dk, nk * 2));
    DROP_CUDA(cudaMalloc(&dv, nk * 2));
    DROP_CUDA(cudaMalloc(&lse, nl * 4));
    DROP_CUDA(cudaMalloc(&dsum, nl * 4));
    DROP_CUDA(cudaMemcpy(q, hq, nq * 2, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(k, hk, nk * 2, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(v, hv, nk * 2, cudaMemcpyHostToDevice));
    DROP_CUDA(cudaMemcpy(dout, hdo, nq * 2, cudaMemcpyHostToDevice));
    {
        attn_view vq = packed_heads_view(q, s->H, T, d, qpg), vo = packed_heads_view(o, s->H, T, d, qpg),
                  vdo = packed_heads_view(dout, s->H, T, d, qpg), vdq = packed_heads_view(dq, s->H, T, d, qpg);
        attn_view vk = packed_heads_view(k, s->Hkv, T, d, 1), vv = packed_heads_view(v, s->Hkv, T, d, 1),
                  vdk = packed_heads_view(dk, s->Hkv, T, d, 1), vdv = packed_heads_view(dv, s->Hkv, T, d, 1);
        DROP_CUDA(flash_attention_forward(vo, lse, cview(vq), cview(vk), cview(vv), s->B, s->H, s->Hkv, T, d, 0, drop));
        struct { const char* name; double* want; double* none; size_t n; bf16* dev; } outs[] = {
            {"O", ro, no, nq, o}, {"dQ", rdq, ndq, nq, dq}, {"dK", rdk, ndk, nk, dk}, {"dV", rdv, ndv, nk, dv}};
        for (int run = 0; run < 2 && ok; run++) {
            DROP_CUDA(flash_attention_backward(vdq, vdk, vdv, dsum, cview(vdo), cview(vq), cview(vk), cview(vv),
                                               cview(vo), lse, s->B, s->H, s->Hkv, T, d, 0, (float*)NULL, drop));
            DROP_CUDA(cudaDeviceSynchronize());
            DROP_CUDA(cudaMemcpy(run ? hbuf2 : hbuf, dq, nq * 2, cudaMemcpyDeviceToHost));
        }
        if (memcmp(hbuf, hbuf2, nq * 2) != 0) {
            printf("    FAIL d=%d T=%d: two backwards differ\n", d, T);
            ok = false;
        }
        for (int i = 0; i < 4; i++) {
            DROP_CUDA(cudaMemcpy(hbuf, outs[i].dev, outs[i].n * 2, cudaMemcpyDeviceToHost));
            for (size_t e = 0; e < outs[i].n; e++) got[e] = flash_bf2d(hbuf[e]);
            const double err = flash_rel(got, outs[i].want, outs[i].n), off = flash_rel(got, outs[i].none, outs[i].n);
            printf("      B=%d H=%d Hkv=%d T=%d d=%d %-2s rel err %.2e (tol 2e-2; without the masks %.2e)\n", s->B, s->H,
                   s->Hkv, T, d, outs[i].name, err, off);
            if (!(err <= 2e-2) || !(off > 0.1)) ok = false;
        }
    }
done:
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(dout), cudaFree(dq), cudaFree(dk), cudaFree(dv);
    cudaFree(lse), cudaFree(dsum);
    free(hq), free(hk), free(hv), free(hdo), free(hbuf), free(hbuf2), free(ro), free(rdq), free(rdk), free(rdv);
    free(got), free(no), free(ndq), free(ndk), free(ndv);
    return ok;
}

static test_result test_dropout_flash_attention(void) {
    REQUIRE_GPU();
    const flash_shape shapes[] = {
        {2, 4, 2, 100, 64}, /* GQA, the last query and key tiles partial */
        {1, 2, 1, 130, 128},
        {2, 2, 2, 64, 64},
    };
    bool ok = true;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) ok &= dropout_flash_case(&shapes[i]);
    return ok ? TEST_PASS : TEST_FAIL;
}
#undef DROP_CUDA

/* ---- gpu: the model against dev/ref_gpt.py with the same masks ------------------------------------ */

/* Tolerances: those of tests/test_model.h's runs without dropout (fp32 1e-5 everywhere; bf16 3e-2 on
 * logits and gradients, 1e-2 on losses, 3e-3 / 5e-3 on the weights after the steps): the masks are
 * the reference's exactly, so dropout adds only a product by 1/(1-p) per kept element (rounded once
 * in fp32, then to the model type like any activation). The logits are evaluation's (no dropout); the
 * loss, gradients and steps training's, masks drawn per iteration. */
static test_result test_dropout_gpt2_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_dropout.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_dropout_gpt2_bf16(void) { /* flash, head dim 128 */
    return check_against_reference("dev/data/gpt_vectors/gpt2_dropout.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 3e-3);
}
static test_result test_dropout_llama_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_dropout.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_dropout_llama_bf16(void) { /* flash, head dim 64, GQA */
    return check_against_reference("dev/data/gpt_vectors/llama_dropout.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 5e-3);
}

/* ---- gpu: repeatability, resume, evaluation ------------------------------------------------------- */

/* Two runs of 12 steps are bitwise equal, and 6 + save + load + 6 gives the same losses and weights
 * (the load restores the iteration that keys the masks: a resumed run that started its masks from
 * iteration 0 would differ). */
static test_result dropout_resume(test_flavour flavour, mt_precision precision) {
    REQUIRE_GPU();
    mt_config c = test_config(flavour, precision);
    c.hidden_dropout = c.attention_dropout = 0.1;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int64_t n = mt_num_parameters(&c);
    double a[12], b[12], r[12];
    float *pa = (float*)malloc(sizeof(float) * n), *pb = (float*)malloc(sizeof(float) * n),
          *pr = (float*)malloc(sizeof(float) * n);
    char dir[256];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_dropout_%d_%d_%d", (int)getpid(), (int)flavour, (int)precision);
    mt_remove_tree(dir);
    test_result res = TEST_PASS;
    if (run_steps(&c, NULL, NULL, 0, 12, a, pa) != TEST_PASS || run_steps(&c, NULL, NULL, 0, 12, b, pb) != TEST_PASS ||
        run_steps(&c, NULL, dir, 0, 6, r, NULL) != TEST_PASS || run_steps(&c, dir, NULL, 6, 6, r, pr) != TEST_PASS)
        res = TEST_FAIL;
    for (int k = 0; k < 12 && res == TEST_PASS; k++)
        if (memcmp(&a[k], &b[k], sizeof(double)) || memcmp(&a[k], &r[k], sizeof(double))) {
            printf("    FAIL step %d: %.9g, again %.9g, resumed %.9g\n", k, a[k], b[k], r[k]);
            res = TEST_FAIL;
        }
    if (res == TEST_PASS && (memcmp(pa, pb, sizeof(float) * n) || memcmp(pa, pr, sizeof(float) * n))) {
        printf("    FAIL the final weights differ (again or resumed)\n");
        res = TEST_FAIL;
    }
    mt_remove_tree(dir);
    free(pa), free(pb), free(pr);
    return res;
}
static test_result test_dropout_resume_gpt2_bf16(void) { return dropout_resume(TEST_GPT2, MT_BF16); }
static test_result test_dropout_resume_gpt2_fp32(void) { return dropout_resume(TEST_GPT2, MT_FP32); }
static test_result test_dropout_resume_llama_bf16(void) { return dropout_resume(TEST_LLAMA, MT_BF16); }

/* The same weights with and without dropout: evaluation gives bitwise the same loss (no dropout
 * there); a training pass does not (dropout on), and two training passes of the same iteration do
 * (compute_gradients does not advance the iteration: the same masks). */
static test_result test_dropout_evaluation_without(void) {
    REQUIRE_GPU();
    mt_config with = test_config(TEST_GPT2, MT_BF16), without = with;
    with.hidden_dropout = with.attention_dropout = 0.1;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&with, &err), &err);
    EXPECT_OK(mt_config_finalize(&without, &err), &err);
    const int micro = mt_num_micro_batches(&with);
    const int64_t n_tok = (int64_t)micro * with.micro_batch_size * (with.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * n_tok);
    fill_tokens(tokens, n_tok, (int)with.vocab_size, 99);
    mt_trainer *tw = NULL, *tn = NULL;
    double ew = 0, en = 0, gw1 = 0, gw2 = 0, gn = 0;
    test_result res = TEST_FAIL;
    if (mt_trainer_create(&tw, &with, &err) == MT_OK && mt_trainer_create(&tn, &without, &err) == MT_OK &&
        mt_trainer_evaluate(tw, tokens, micro, &ew, &err) == MT_OK &&
        mt_trainer_evaluate(tn, tokens, micro, &en, &err) == MT_OK &&
        mt_trainer_compute_gradients(tw, tokens, micro, &gw1, &err) == MT_OK &&
        mt_trainer_compute_gradients(tw, tokens, micro, &gw2, &err) == MT_OK &&
        mt_trainer_compute_gradients(tn, tokens, micro, &gn, &err) == MT_OK) {
        printf("      evaluation %.9g / %.9g; training pass with dropout %.9g (again %.9g), without %.9g\n", ew, en, gw1,
               gw2, gn);
        res = memcmp(&ew, &en, sizeof(double)) == 0 && memcmp(&gw1, &gw2, sizeof(double)) == 0 && gw1 != gn
                  ? TEST_PASS
                  : TEST_FAIL;
    } else {
        printf("    FAIL %s\n", err.message);
    }
    if (tw) mt_trainer_free(tw);
    if (tn) mt_trainer_free(tn);
    free(tokens);
    return res;
}

static const test_case dropout_tests[] = {
    {"dropout_hash_matches_reference", test_dropout_hash_matches_reference},
    {"dropout_mask_statistics", test_dropout_mask_statistics},
    {"dropout_flags", test_dropout_flags},
};
static const test_case dropout_gpu_tests[] = {
    {"dropout_hidden_kernels", test_dropout_hidden_kernels},
    {"dropout_flash_attention", test_dropout_flash_attention},
    {"dropout_gpt2_fp32", test_dropout_gpt2_fp32},
    {"dropout_gpt2_bf16", test_dropout_gpt2_bf16},
    {"dropout_llama_fp32", test_dropout_llama_fp32},
    {"dropout_llama_bf16", test_dropout_llama_bf16},
    {"dropout_resume_gpt2_bf16", test_dropout_resume_gpt2_bf16},
    {"dropout_resume_gpt2_fp32", test_dropout_resume_gpt2_fp32},
    {"dropout_resume_llama_bf16", test_dropout_resume_llama_bf16},
    {"dropout_evaluation_without", test_dropout_evaluation_without},
};

#endif
