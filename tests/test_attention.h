/* tests/test_attention.h — attention (GPU test; skips when no GPU is visible): the flash-attention
 * kernels (megatron.cu section 9) on the layouts the model hands them: q, k, v read straight from
 * the fused QKV rows [B*T, groups*(qpg+2)*d], the output written into the attention rows [B*T, H*d],
 * dq, dk, dv written into the gradient's QKV rows.
 *
 * Each shape: random bf16 inputs (never zero), forward and backward on the row views, against a
 * double-precision CPU reference of causal attention computed from the same bf16 values; the same
 * inputs packed into [B, H, T, d] and run again must give bitwise the same results (one kernel, only
 * the addresses differ), and a second backward must be bitwise the same as the first (no atomics).
 * The second backward also takes the column sums of the gradient rows per 64-row chunk (the QKV bias
 * gradient, megatron.cu's attention_backward): summed over the chunks they must equal the column
 * sums of the stored gradient (fp32 sums of the same bf16 values in another order: 1e-5 norm-wise),
 * every column of every chunk written (the buffer starts as NaN), the gradient itself unchanged.
 *
 * Tolerances (norm-wise, ||out - ref|| / ||ref||): outputs are rounded to bf16 (2^-9 relative per
 * element, ~2e-3 norm-wise) and P, dS are rounded to bf16 before their tensor-core products (the
 * same order, largely averaging out over the keys); accumulation is fp32. Measured errors are a few
 * 1e-3; 2e-2 leaves a margin while any indexing, masking, stride or GQA mistake gives errors of
 * order 1. LSE is fp32 throughout: 1e-4. */
#ifndef MT_TEST_ATTENTION_H
#define MT_TEST_ATTENTION_H

#include <algorithm>

typedef struct {
    int B, H, Hkv, T, d;
    const int32_t* doc; /* [B, T] each query's document start (--reset-attention-mask); NULL: causal only */
} flash_shape;

static uint16_t flash_f2bf(float f) { return test_bf16_from_float(f); }
static double flash_bf2d(uint16_t b) { return test_bf16_to_float(b); }
/* random bf16 in +-[0.02, amp) */
static void flash_fill(uint16_t* x, size_t n, float amp, uint64_t* state) {
    for (size_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(*state >> 11) / 9007199254740992.0;
        double mag = 0.02 + (amp - 0.02) * fmod(u * 2.0, 1.0);
        x[i] = flash_f2bf((float)(u < 0.5 ? -mag : mag));
    }
}

/* The column of head hh's first channel in a row: kind 0 a query head, 1 a key, 2 a value (fused QKV
 * rows, width groups*(qpg+2)*d), 3 a head of the attention output rows (width H*d). */
static size_t flash_head_column(int kind, int hh, int qpg, int d) {
    switch (kind) {
        case 0: return (size_t)(hh / qpg) * (qpg + 2) * d + (size_t)(hh % qpg) * d;
        case 1: return (size_t)hh * (qpg + 2) * d + (size_t)qpg * d;
        case 2: return (size_t)hh * (qpg + 2) * d + (size_t)(qpg + 1) * d;
        default: return (size_t)hh * d;
    }
}

static double flash_rel(const double* out, const double* ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        num += (out[i] - ref[i]) * (out[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* Host reference on the row layouts: o [B*T, H*d], lse [B*H, T], dqkv [B*T, W] from qkv and dout. */
static void flash_reference(const flash_shape* s, const uint16_t* qkv, const uint16_t* dout, double* o, double* lse,
                            double* dqkv) {
    int qpg = s->H / s->Hkv, d = s->d, T = s->T, W = s->Hkv * (qpg + 2) * d, C = s->H * d;
    double scale = 1.0 / sqrt((double)d);
    double* p = (double*)malloc(sizeof(double) * T);
    double* ds = (double*)malloc(sizeof(double) * T);
    memset(dqkv, 0, sizeof(double) * (size_t)s->B * T * W);
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++) {
            int g = h / qpg;
            size_t qoff = flash_head_column(0, h, qpg, d), koff = flash_head_column(1, g, qpg, d),
                   voff = flash_head_column(2, g, qpg, d);
            for (int i = 0; i < T; i++) {
                const uint16_t* q = qkv + ((size_t)b * T + i) * W + qoff;
                double mx = -INFINITY;
                const int lo = s->doc ? s->doc[(size_t)b * T + i] : 0; /* keys lo..i: the query's document */
                for (int j = lo; j <= i; j++) {
                    const uint16_t* k = qkv + ((size_t)b * T + j) * W + koff;
                    double acc = 0.0;
                    for (int e = 0; e < d; e++) acc += flash_bf2d(q[e]) * flash_bf2d(k[e]);
                    p[j] = acc * scale;
                    if (p[j] > mx) mx = p[j];
                }
                double sum = 0.0;
                for (int j = lo; j <= i; j++) sum += exp(p[j] - mx);
                for (int j = lo; j <= i; j++) p[j] = exp(p[j] - mx) / sum;
                lse[((size_t)b * s->H + h) * T + i] = mx + log(sum);
                double* orow = o + ((size_t)b * T + i) * C + (size_t)h * d;
                const uint16_t* go = dout + ((size_t)b * T + i) * C + (size_t)h * d;
                for (int e = 0; e < d; e++) {
                    double acc = 0.0;
                    for (int j = lo; j <= i; j++) acc += p[j] * flash_bf2d(qkv[((size_t)b * T + j) * W + voff + e]);
                    orow[e] = acc;
                }
                double dsum = 0.0;
                for (int e = 0; e < d; e++) dsum += flash_bf2d(go[e]) * orow[e];
                for (int j = lo; j <= i; j++) {
                    const uint16_t* v = qkv + ((size_t)b * T + j) * W + voff;
                    double dp = 0.0;
                    for (int e = 0; e < d; e++) dp += flash_bf2d(go[e]) * flash_bf2d(v[e]);
                    ds[j] = p[j] * (dp - dsum);
                }
                double* dq = dqkv + ((size_t)b * T + i) * W + qoff;
                for (int j = lo; j <= i; j++) {
                    const uint16_t* k = qkv + ((size_t)b * T + j) * W + koff;
                    double* dk = dqkv + ((size_t)b * T + j) * W + koff;
                    double* dv = dqkv + ((size_t)b * T + j) * W + voff;
                    for (int e = 0; e < d; e++) {
                        dq[e] += scale * ds[j] * flash_bf2d(k[e]);
                        dk[e] += scale * ds[j] * flash_bf2d(q[e]);
                        dv[e] += p[j] * flash_bf2d(go[e]);
                    }
                }
            }
        }
    free(p);
    free(ds);
}

/* Per element (document-mask shapes): the worst |out - ref| / (2e-2 |ref| + 5e-2 rms(ref)) over a tensor,
 * which must stay <= 1. An element carries its bf16 rounding (2^-9 |ref|) and the bf16 rounding of the P
 * and dS terms it sums (random-signed, ~2^-9 of the tensor's scale); norm-wise those are a few 1e-3, so
 * the largest of ~1e5 elements sits near 1e-2 rms. A key seen across a document boundary is of the
 * order of the values themselves in the first rows of a document (few keys), far past 5e-2 rms. */
static double flash_elementwise(const double* out, const double* ref, size_t n) {
    double sq = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) sq += ref[i] * ref[i];
    const double rms = sqrt(sq / (double)(n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        const double r = fabs(out[i] - ref[i]) / (2e-2 * fabs(ref[i]) + 5e-2 * rms);
        if (!(r <= worst)) worst = r; /* NaN too */
    }
    return worst;
}

#define FLASH_CUDA(call)                                                                                 \
    do {                                                                                                 \
        cudaError_t e_ = (call);                                                                         \
        if (e_ != cudaSuccess) {                                                                         \
            printf("    FAIL %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));      \
            ok = 0;                                                                                      \
            goto done;                                                                                   \
        }                                                                                                \
    } while (0)

static int flash_check_shape(const flash_shape* s) {
    int ok = 1;
    const int qpg = s->H / s->Hkv, d = s->d, T = s->T, W = s->Hkv * (qpg + 2) * d, C = s->H * d;
    const size_t BT = (size_t)s->B * T, n_qkv = BT * W, n_rows = BT * C, n_lse = (size_t)s->B * s->H * T;
    const size_t n_kv = (size_t)s->B * s->Hkv * T * d;
    uint16_t *h_qkv = (uint16_t*)malloc(n_qkv * 2), *h_dout = (uint16_t*)malloc(n_rows * 2);
    uint16_t *h_out = (uint16_t*)malloc(n_rows * 2), *h_dqkv = (uint16_t*)malloc(n_qkv * 2);
    uint16_t *h_dqkv2 = (uint16_t*)malloc(n_qkv * 2), *h_packed = (uint16_t*)malloc(n_rows * 2);
    float* h_lse = (float*)malloc(n_lse * 4);
    double *r_o = (double*)malloc(n_rows * 8), *r_lse = (double*)malloc(n_lse * 8), *r_dqkv = (double*)malloc(n_qkv * 8);
    double *got = (double*)malloc(n_qkv * 8), *want = (double*)malloc(n_qkv * 8);
    bf16 *qkv = NULL, *dout = NULL, *out = NULL, *dqkv = NULL, *pq = NULL, *pk = NULL, *pv = NULL, *po = NULL,
         *pdo = NULL, *pdq = NULL, *pdk = NULL, *pdv = NULL;
    float *lse = NULL, *dsum = NULL, *colsum = NULL;
    int32_t* doc = NULL; /* the document starts on the device (NULL: causal only) */
    double e_elem = 0.0;
    const int chunks = flash_colsum_chunks(s->B, T);
    float* h_colsum = (float*)malloc((size_t)chunks * W * 4);
    uint64_t rng = 0x5DEECE66Dull + (uint64_t)T * 131 + d;
    flash_fill(h_qkv, n_qkv, 1.7f, &rng); /* |q.k| * scale spreads the softmax without saturating it */
    flash_fill(h_dout, n_rows, 1.0f, &rng);
    flash_reference(s, h_qkv, h_dout, r_o, r_lse, r_dqkv);

    FLASH_CUDA(cudaMalloc(&qkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dqkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dout, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&out, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&lse, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&dsum, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&colsum, (size_t)chunks * W * 4));
    FLASH_CUDA(cudaMemset(colsum, 0xFF, (size_t)chunks * W * 4));
    if (s->doc) {
        FLASH_CUDA(cudaMalloc(&doc, BT * 4));
        FLASH_CUDA(cudaMemcpy(doc, s->doc, BT * 4, cudaMemcpyHostToDevice));
    }
    FLASH_CUDA(cudaMemcpy(qkv, h_qkv, n_qkv * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dout, h_dout, n_rows * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemset(out, 0xFF, n_rows * 2)); /* poisoned: NaN wherever nothing is written */
    FLASH_CUDA(cudaMemset(dqkv, 0xFF, n_qkv * 2));
    {
        attn_view q = qkv_rows_view(qkv, T, s->Hkv, d, qpg, 0), k = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view dq = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, 0), dk = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg),
                  dv = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view o = attention_rows_view(out, T, s->H, d, qpg), go = attention_rows_view(dout, T, s->H, d, qpg);
        FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0,
                                           mt_dropout(), doc));
        for (int run = 0; run < 2; run++) {
            FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v), cview(o),
                                                lse, s->B, s->H, s->Hkv, T, d, 0, run ? colsum : (float*)NULL,
                                                mt_dropout(), doc));
            FLASH_CUDA(cudaMemcpy(run ? h_dqkv2 : h_dqkv, dqkv, n_qkv * 2, cudaMemcpyDeviceToHost));
            FLASH_CUDA(cudaMemset(dqkv, 0xFF, n_qkv * 2));
        }
    }
    FLASH_CUDA(cudaMemcpy(h_out, out, n_rows * 2, cudaMemcpyDeviceToHost));
    FLASH_CUDA(cudaMemcpy(h_lse, lse, n_lse * 4, cudaMemcpyDeviceToHost));
    {
        for (size_t i = 0; i < n_rows; i++) got[i] = flash_bf2d(h_out[i]);
        double e_o = flash_rel(got, r_o, n_rows);
        e_elem = flash_elementwise(got, r_o, n_rows);
        for (size_t i = 0; i < n_lse; i++) got[i] = h_lse[i];
        double e_lse = flash_rel(got, r_lse, n_lse);
        /* the q, k and v columns of the gradient rows, each against its own norm */
        double e_part[3];
        for (int part = 0; part < 3; part++) {
            size_t n = 0;
            for (size_t r = 0; r < BT; r++)
                for (int c = 0; c < W; c++) {
                    int slot = (c / d) % (qpg + 2);
                    int which = slot < qpg ? 0 : slot == qpg ? 1 : 2;
                    if (which != part) continue;
                    got[n] = flash_bf2d(h_dqkv[r * W + c]);
                    want[n++] = r_dqkv[r * W + c];
                }
            e_part[part] = flash_rel(got, want, n);
            const double el = flash_elementwise(got, want, n);
            if (!(el <= e_elem)) e_elem = el;
        }
        int same = memcmp(h_dqkv, h_dqkv2, n_qkv * 2) == 0;
        /* the column sums: chunks added in double against the stored gradient's column sums */
        FLASH_CUDA(cudaMemcpy(h_colsum, colsum, (size_t)chunks * W * 4, cudaMemcpyDeviceToHost));
        for (int c = 0; c < W; c++) got[c] = want[c] = 0.0;
        for (int k = 0; k < chunks; k++)
            for (int c = 0; c < W; c++) got[c] += h_colsum[(size_t)k * W + c];
        for (size_t r = 0; r < BT; r++)
            for (int c = 0; c < W; c++) want[c] += flash_bf2d(h_dqkv2[r * W + c]);
        double e_sums = flash_rel(got, want, W);
        printf("      column sums (QKV bias gradient) over %d chunks: %.2e\n", chunks, e_sums);
        if (!(e_sums < 1e-5)) {
            printf("    FAIL the backward's column sums are not those of its gradient\n");
            ok = 0;
            goto done;
        }
        printf("      B=%d H=%d Hkv=%d T=%d d=%d%s: O %.2e LSE %.2e dq %.2e dk %.2e dv %.2e%s", s->B, s->H, s->Hkv, T, d,
               s->doc ? " (documents)" : "", e_o, e_lse, e_part[0], e_part[1], e_part[2],
               same ? "" : " (backward NOT deterministic)");
        if (s->doc) printf("; worst element %.2f of its bound", e_elem);
        printf("\n");
        if (!(e_o < 2e-2 && e_lse < 1e-4 && e_part[0] < 2e-2 && e_part[1] < 2e-2 && e_part[2] < 2e-2 && same &&
              (!s->doc || e_elem <= 1.0))) {
            printf("    FAIL flash attention on the row layouts is off the reference\n");
            ok = 0;
            goto done;
        }
    }

    /* the same inputs packed [B, H, T, d] (K, V [B, Hkv, T, d]): bitwise the same results */
    FLASH_CUDA(cudaMalloc(&pq, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&po, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&pdo, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&pdq, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&pk, n_kv * 2));
    FLASH_CUDA(cudaMalloc(&pv, n_kv * 2));
    FLASH_CUDA(cudaMalloc(&pdk, n_kv * 2));
    FLASH_CUDA(cudaMalloc(&pdv, n_kv * 2));
    {
        /* host packing: element (b, head, t, e) of a packed tensor from the rows */
        uint16_t* hp = (uint16_t*)malloc(n_rows * 2);
        struct { bf16* dst; const uint16_t* src; int heads, width, slot_of_head; } packs[4] = {
            {pq, h_qkv, s->H, W, 0}, {pk, h_qkv, s->Hkv, W, 1}, {pv, h_qkv, s->Hkv, W, 2}, {pdo, h_dout, s->H, C, 3}};
        for (int k = 0; k < 4; k++) {
            for (int b = 0; b < s->B; b++)
                for (int hh = 0; hh < packs[k].heads; hh++)
                    for (int t = 0; t < T; t++)
                        for (int e = 0; e < d; e++) {
                            size_t col = flash_head_column(packs[k].slot_of_head, hh, qpg, d);
                            hp[(((size_t)b * packs[k].heads + hh) * T + t) * d + e] =
                                packs[k].src[((size_t)b * T + t) * packs[k].width + col + e];
                        }
            cudaError_t e = cudaMemcpy(packs[k].dst, hp, (size_t)s->B * packs[k].heads * T * d * 2, cudaMemcpyHostToDevice);
            if (e != cudaSuccess) {
                printf("    FAIL packing: %s\n", cudaGetErrorString(e));
                free(hp);
                ok = 0;
                goto done;
            }
        }
        free(hp);
        attn_view q = packed_heads_view(pq, s->H, T, d, qpg), k = packed_heads_view(pk, s->Hkv, T, d, 1),
                  v = packed_heads_view(pv, s->Hkv, T, d, 1), o = packed_heads_view(po, s->H, T, d, qpg),
                  go = packed_heads_view(pdo, s->H, T, d, qpg), dq = packed_heads_view(pdq, s->H, T, d, qpg),
                  dk = packed_heads_view(pdk, s->Hkv, T, d, 1), dv = packed_heads_view(pdv, s->Hkv, T, d, 1);
        FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0,
                                           mt_dropout(), doc));
        FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v), cview(o), lse,
                                            s->B, s->H, s->Hkv, T, d, 0, NULL, mt_dropout(), doc));
        /* compare the packed output and gradients with the row results, element by element */
        struct { bf16* src; const uint16_t* rows; int heads, width, slot_of_head; } outs[4] = {
            {po, h_out, s->H, C, 3}, {pdq, h_dqkv, s->H, W, 0}, {pdk, h_dqkv, s->Hkv, W, 1}, {pdv, h_dqkv, s->Hkv, W, 2}};
        const char* names[4] = {"O", "dQ", "dK", "dV"};
        for (int k2 = 0; k2 < 4; k2++) {
            size_t n = (size_t)s->B * outs[k2].heads * T * d;
            FLASH_CUDA(cudaMemcpy(h_packed, outs[k2].src, n * 2, cudaMemcpyDeviceToHost));
            for (int b = 0; b < s->B && ok; b++)
                for (int hh = 0; hh < outs[k2].heads && ok; hh++)
                    for (int t = 0; t < T && ok; t++)
                        for (int e = 0; e < d && ok; e++) {
                            size_t col = flash_head_column(outs[k2].slot_of_head, hh, qpg, d);
                            if (h_packed[(((size_t)b * outs[k2].heads + hh) * T + t) * d + e] !=
                                outs[k2].rows[((size_t)b * T + t) * outs[k2].width + col + e]) {
                                printf("    FAIL packed and row layouts differ: %s at b %d head %d t %d e %d\n",
                                       names[k2], b, hh, t, e);
                                ok = 0;
                            }
                        }
        }
    }
done:
    cudaFree(qkv); cudaFree(dqkv); cudaFree(dout); cudaFree(out); cudaFree(lse); cudaFree(dsum); cudaFree(colsum);
    cudaFree(pq); cudaFree(pk); cudaFree(pv); cudaFree(po); cudaFree(pdo); cudaFree(pdq); cudaFree(pdk); cudaFree(pdv);
    cudaFree(doc);
    free(h_qkv); free(h_dout); free(h_out); free(h_dqkv); free(h_dqkv2); free(h_packed); free(h_lse); free(h_colsum);
    free(r_o); free(r_lse); free(r_dqkv); free(got); free(want);
    return ok;
}

static test_result test_flash_attention_row_layouts(void) {
    REQUIRE_GPU();
    const flash_shape shapes[] = {
        {2, 4, 2, 80, 64},  /* grouped K/V, T not a multiple of a tile */
        {2, 3, 3, 64, 64},  /* multi-head (GPT-2's layout: q, k, v of each head side by side) */
        {1, 2, 1, 130, 128}, /* head dim 128 */
        {1, 4, 1, 17, 64},  /* four query heads per kv head, T below one tile */
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        if (!flash_check_shape(&shapes[i])) return TEST_FAIL;
    /* a misaligned view is refused, not launched */
    attn_view bad = {(bf16*)NULL, 8, 12, 8, 8};
    EXPECT(flash_attention_forward(bad, NULL, cview(bad), cview(bad), cview(bad), 1, 1, 1, 8, 64, 0) ==
               cudaErrorInvalidValue,
           "a row stride of 12 elements was accepted");
    return TEST_PASS;
}

/* Long sequences, the same checks: T = 4096 (64 query and key tiles per head) at d = 64, T = 2048 at
 * d = 128. One head each: the CPU reference is O(T^2 d) (measured on one core: 4.7 s for the first,
 * ~3 s for the second; 11.6 s for d = 128 at T = 4096, hence 2048 there). */
static test_result test_flash_attention_long_sequences(void) {
    REQUIRE_GPU();
    const flash_shape shapes[] = {
        {1, 1, 1, 4096, 64},
        {1, 1, 1, 2048, 128},
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        if (!flash_check_shape(&shapes[i])) return TEST_FAIL;
    return TEST_PASS;
}

/* Document starts of B rows of T inputs (mt_document_boundaries) with the end-of-document token at the
 * given input positions of each row (eods[b], terminated by -1). */
static void flash_docs(int32_t* doc, int B, int T, const int* const* eods) {
    int32_t* in = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * T);
    for (int b = 0; b < B; b++) {
        for (int i = 0; i < T; i++) in[(size_t)b * T + i] = 2;
        for (const int* e = eods[b]; *e >= 0; e++) in[(size_t)b * T + *e] = 1;
    }
    mt_document_boundaries(in, B, T, 1, doc, NULL);
    free(in);
}

/* --reset-attention-mask in the flash kernels: each shape's document starts against the reference with
 * the same documents (flash_check_shape: norm-wise as the causal shapes, and per element, see
 * flash_elementwise), the packed layout bitwise the rows', the backward deterministic. The documents
 * exercise the kernels' block variants and skips: documents shorter than a tile (a one-token document at
 * position 0, two in a row, runs of 7), longer than one (130 and more), boundaries inside tiles and on the
 * 64-key and 128-query tile edges (eod at 63 and 127: documents starting at 64 and 128), a document of
 * one token at the last position, a row without any eod (causal), T not a multiple of a tile, GQA and
 * head dims 64 and 128. Then a single document given as doc_start = 0 everywhere runs bitwise as the
 * causal kernels without doc (the same arithmetic, every mask and skip test false). */
static test_result test_flash_attention_document_masks(void) {
    REQUIRE_GPU();
    static int32_t doc1[2 * 300], doc2[260], doc3[2 * 80], doc4[17];
    const int e1a[] = {0, 63, 64, 127, 199, 262, 298, -1};
    int e1b[64], n = 0;
    for (int i = 5; i < 300 && n < 63; i += 7) e1b[n++] = i; /* documents of 7 */
    e1b[n] = -1;
    const int* eods1[] = {e1a, e1b};
    flash_docs(doc1, 2, 300, eods1);
    const int e2[] = {129, 130, 199, -1};
    const int* eods2[] = {e2};
    flash_docs(doc2, 1, 260, eods2);
    const int e3a[] = {-1}, e3b[] = {0, 78, 79, -1};
    const int* eods3[] = {e3a, e3b};
    flash_docs(doc3, 2, 80, eods3);
    const int e4[] = {3, 9, 10, -1};
    const int* eods4[] = {e4};
    flash_docs(doc4, 1, 17, eods4);
    const flash_shape shapes[] = {
        {2, 4, 2, 300, 64, doc1},  /* tile-edge boundaries; many documents of 7 */
        {1, 2, 1, 260, 128, doc2}, /* documents longer than a tile, head dim 128 */
        {2, 4, 1, 80, 64, doc3},   /* one document; eods at 0 and at the last two inputs */
        {1, 4, 1, 17, 64, doc4},   /* below one tile */
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        if (!flash_check_shape(&shapes[i])) return TEST_FAIL;

    /* one document written out (doc_start 0) == no documents, bitwise */
    const int B = 2, H = 4, Hkv = 2, T = 200, d = 64, qpg = H / Hkv, W = Hkv * (qpg + 2) * d, C = H * d;
    const size_t n_qkv = (size_t)B * T * W, n_rows = (size_t)B * T * C, n_lse = (size_t)B * H * T;
    uint16_t* hq = (uint16_t*)malloc(n_qkv * 2);
    uint16_t* hg = (uint16_t*)malloc(n_rows * 2);
    uint16_t* res[2] = {(uint16_t*)malloc((n_rows + n_qkv) * 2), (uint16_t*)malloc((n_rows + n_qkv) * 2)};
    float* lses[2] = {(float*)malloc(n_lse * 4), (float*)malloc(n_lse * 4)};
    uint64_t rng = 77;
    flash_fill(hq, n_qkv, 1.7f, &rng);
    flash_fill(hg, n_rows, 1.0f, &rng);
    bf16 *qkv = NULL, *dqkv = NULL, *out = NULL, *dout = NULL;
    float *lse = NULL, *dsum = NULL;
    int32_t* zeros = NULL;
    int ok = 1;
    FLASH_CUDA(cudaMalloc(&qkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dqkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&out, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&dout, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&lse, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&dsum, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&zeros, (size_t)B * T * 4));
    FLASH_CUDA(cudaMemset(zeros, 0, (size_t)B * T * 4));
    FLASH_CUDA(cudaMemcpy(qkv, hq, n_qkv * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dout, hg, n_rows * 2, cudaMemcpyHostToDevice));
    for (int run = 0; run < 2; run++) {
        attn_view q = qkv_rows_view(qkv, T, Hkv, d, qpg, 0), k = qkv_rows_view(qkv, T, Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, T, Hkv, d, qpg, qpg + 1);
        attn_view dq = qkv_rows_view(dqkv, T, Hkv, d, qpg, 0), dk = qkv_rows_view(dqkv, T, Hkv, d, qpg, qpg),
                  dv = qkv_rows_view(dqkv, T, Hkv, d, qpg, qpg + 1);
        attn_view o = attention_rows_view(out, T, H, d, qpg), go = attention_rows_view(dout, T, H, d, qpg);
        const int32_t* docs = run ? zeros : NULL;
        FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(k), cview(v), B, H, Hkv, T, d, 0, mt_dropout(), docs));
        FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v), cview(o), lse, B,
                                            H, Hkv, T, d, 0, NULL, mt_dropout(), docs));
        FLASH_CUDA(cudaMemcpy(res[run], out, n_rows * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(res[run] + n_rows, dqkv, n_qkv * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(lses[run], lse, n_lse * 4, cudaMemcpyDeviceToHost));
    }
    if (memcmp(res[0], res[1], (n_rows + n_qkv) * 2) != 0 || memcmp(lses[0], lses[1], n_lse * 4) != 0) {
        printf("    FAIL one document given as doc_start 0 differs from the causal kernels\n");
        ok = 0;
    } else {
        printf("      one document (doc_start 0) == causal, bitwise (O, LSE, dQ, dK, dV)\n");
    }
done:
    cudaFree(qkv); cudaFree(dqkv); cudaFree(out); cudaFree(dout); cudaFree(lse); cudaFree(dsum); cudaFree(zeros);
    free(hq); free(hg); free(res[0]); free(res[1]); free(lses[0]); free(lses[1]);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* The work the document skips save (the lead's micro-benchmark): flash forward + backward at T = 4096,
 * B = 2, 16 query heads over 8 kv heads, d = 128, with one document (doc NULL) and with documents of
 * 1024, 256 and 64 tokens; milliseconds per forward + backward (median of 7 after a warm-up). Causal
 * attention over one document does ~T^2/2 work per head; n documents of T/n about 1/n of it, plus the
 * tiles that straddle a boundary. Fails unless documents of 256 run at least 2x faster than one document
 * (16 documents: ~8x less work even counting whole 64-key tiles). */
static test_result test_flash_attention_document_speed(void) {
    REQUIRE_GPU();
    const int B = 2, H = 16, Hkv = 8, T = 4096, d = 128, qpg = H / Hkv, W = Hkv * (qpg + 2) * d, C = H * d;
    const size_t n_qkv = (size_t)B * T * W, n_rows = (size_t)B * T * C, n_lse = (size_t)B * H * T;
    uint16_t* hq = (uint16_t*)malloc(n_qkv * 2);
    uint16_t* hg = (uint16_t*)malloc(n_rows * 2);
    int32_t* hdoc = (int32_t*)malloc(sizeof(int32_t) * 3 * B * T);
    uint64_t rng = 99;
    flash_fill(hq, n_qkv, 1.7f, &rng);
    flash_fill(hg, n_rows, 1.0f, &rng);
    const int lengths[3] = {1024, 256, 64};
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++) hdoc[((size_t)k * B + b) * T + i] = i / lengths[k] * lengths[k];
    bf16 *qkv = NULL, *dqkv = NULL, *out = NULL, *dout = NULL;
    float *lse = NULL, *dsum = NULL;
    int32_t* doc = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double ms[4] = {0, 0, 0, 0};
    int ok = 1;
    FLASH_CUDA(cudaMalloc(&qkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dqkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&out, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&dout, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&lse, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&dsum, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&doc, sizeof(int32_t) * 3 * B * T));
    FLASH_CUDA(cudaMemcpy(qkv, hq, n_qkv * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dout, hg, n_rows * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(doc, hdoc, sizeof(int32_t) * 3 * B * T, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaEventCreate(&e0));
    FLASH_CUDA(cudaEventCreate(&e1));
    for (int k = 0; k < 4; k++) {
        attn_view q = qkv_rows_view(qkv, T, Hkv, d, qpg, 0), kk = qkv_rows_view(qkv, T, Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, T, Hkv, d, qpg, qpg + 1);
        attn_view dq = qkv_rows_view(dqkv, T, Hkv, d, qpg, 0), dk = qkv_rows_view(dqkv, T, Hkv, d, qpg, qpg),
                  dv = qkv_rows_view(dqkv, T, Hkv, d, qpg, qpg + 1);
        attn_view o = attention_rows_view(out, T, H, d, qpg), go = attention_rows_view(dout, T, H, d, qpg);
        const int32_t* docs = k == 0 ? NULL : doc + (size_t)(k - 1) * B * T;
        float times[8];
        for (int rep = 0; rep < 8; rep++) { /* rep 0 warms up */
            FLASH_CUDA(cudaEventRecord(e0, 0));
            FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(kk), cview(v), B, H, Hkv, T, d, 0, mt_dropout(),
                                               docs));
            FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(kk), cview(v), cview(o), lse,
                                                B, H, Hkv, T, d, 0, NULL, mt_dropout(), docs));
            FLASH_CUDA(cudaEventRecord(e1, 0));
            FLASH_CUDA(cudaEventSynchronize(e1));
            FLASH_CUDA(cudaEventElapsedTime(&times[rep], e0, e1));
        }
        std::sort(times + 1, times + 8);
        ms[k] = times[4];
    }
    printf("      flash fwd+bwd, T=%d B=%d H=%d Hkv=%d d=%d: one document %.3f ms | documents of 1024 %.3f ms (%.2fx) | "
           "256 %.3f ms (%.2fx) | 64 %.3f ms (%.2fx)\n", T, B, H, Hkv, d, ms[0], ms[1], ms[0] / ms[1], ms[2],
           ms[0] / ms[2], ms[3], ms[0] / ms[3]);
    if (!(ms[0] >= 2.0 * ms[2])) {
        printf("    FAIL documents of 256 are not 2x faster than one document: the skips do not show\n");
        ok = 0;
    }
done:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(qkv); cudaFree(dqkv); cudaFree(out); cudaFree(dout); cudaFree(lse); cudaFree(dsum); cudaFree(doc);
    free(hq); free(hg); free(hdoc);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* Section 13.2's Hopper attention forward against section 9's FA2 forward, on the model's layouts: q, k, v
 * read in place from the fused QKV rows, O written into the attention rows (poisoned with NaN first: a row
 * not written fails), causal, head dims 64 and 128, GQA and MHA, B > 1, T not a multiple of the 128-row
 * tile, T below one tile and T = 1, and shapes with more work tiles than an H200's 132 SMs (the persistent
 * grid's CTAs take several tiles each). Then the Hopper forward again on only 3 CTAs (each strides over many
 * tiles, so the barrier phases run across tile boundaries many times): bitwise the same O and LSE (each tile
 * is summed in a fixed order whatever CTA takes it). Then section 9's backward from the Hopper forward's O and LSE must match the backward
 * from FA2's to bf16 tolerance (what the trainer runs: the new forward feeding the unchanged backward).
 * Then the selection (attention_forward_fast): by default bitwise the Hopper forward's O and LSE, under
 * MT_ATTN_FWD=fa2 bitwise FA2's (a shape where the two differ proves which one ran).
 * Tolerances. O: both kernels sum fp32 scores and round P to bf16 before P V, but in other tile orders
 * (128 keys vs 64), so P's roundings differ (2^-9 relative each, averaging over the keys) and the two
 * bf16 results may round apart by one unit (2^-8 relative at most); per element |a - b| <= 2^-7 |b| +
 * 2^-7 rms(row of b) allows one unit plus the P differences (the row's rms covers entries near zero
 * from cancellation); norm-wise 2^-8. Any indexing, stride, masking or GQA mistake gives O(1) errors.
 * LSE: fp32 throughout, m * scale + log(l) in both with l summed in another order: 1e-5 relative (of
 * max(1, |LSE|): LSE near zero has no relative scale). Gradients: 2e-2 norm-wise, as the reference
 * checks above (the backward is the same kernel; only O and LSE differ, by the tolerances above).
 * *apart: set when the two forwards' outputs differ (the selection check then tells which one ran). */
static int fa3_check_shape(const flash_shape* s, mt_hopper_gemm_state* st, int* apart) {
    int ok = 1;
    const int qpg = s->H / s->Hkv, d = s->d, T = s->T, W = s->Hkv * (qpg + 2) * d, C = s->H * d;
    const size_t BT = (size_t)s->B * T, n_qkv = BT * W, n_rows = BT * C, n_lse = (size_t)s->B * s->H * T;
    uint16_t *h_qkv = (uint16_t*)malloc(n_qkv * 2), *h_dout = (uint16_t*)malloc(n_rows * 2);
    uint16_t *h_o2 = (uint16_t*)malloc(n_rows * 2), *h_o3 = (uint16_t*)malloc(n_rows * 2), *h_o3b = (uint16_t*)malloc(n_rows * 2);
    uint16_t *h_g2 = (uint16_t*)malloc(n_qkv * 2), *h_g3 = (uint16_t*)malloc(n_qkv * 2);
    float *h_l2 = (float*)malloc(n_lse * 4), *h_l3 = (float*)malloc(n_lse * 4), *h_l3b = (float*)malloc(n_lse * 4);
    uint16_t* h_os = (uint16_t*)malloc(n_rows * 2); /* the selection's O and LSE (passes 3, 4) */
    float* h_ls = (float*)malloc(n_lse * 4);
    bool sel_default = false, sel_fa2 = false;
    double *got = (double*)malloc(n_qkv * 8), *want = (double*)malloc(n_qkv * 8);
    bf16 *qkv = NULL, *dout = NULL, *out = NULL, *dqkv = NULL;
    float *lse = NULL, *dsum = NULL;
    double worst = 0.0, worst_lse = 0.0;
    uint64_t rng = 0xFA3ull + (uint64_t)T * 131 + s->H;
    flash_fill(h_qkv, n_qkv, 1.7f, &rng);
    flash_fill(h_dout, n_rows, 1.0f, &rng);
    FLASH_CUDA(cudaMalloc(&qkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dqkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dout, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&out, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&lse, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&dsum, n_lse * 4));
    FLASH_CUDA(cudaMemcpy(qkv, h_qkv, n_qkv * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dout, h_dout, n_rows * 2, cudaMemcpyHostToDevice));
    {
        attn_view q = qkv_rows_view(qkv, T, s->Hkv, d, qpg, 0), k = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view dq = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, 0), dk = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg),
                  dv = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view o = attention_rows_view(out, T, s->H, d, qpg), go = attention_rows_view(dout, T, s->H, d, qpg);
        /* 0: FA2, 1: Hopper, 2: Hopper again, 3: attention_forward_fast by default, 4: it under MT_ATTN_FWD=fa2 */
        for (int pass = 0; pass < 5; pass++) {
            FLASH_CUDA(cudaMemset(out, 0xFF, n_rows * 2));
            FLASH_CUDA(cudaMemset(lse, 0xFF, n_lse * 4));
            FLASH_CUDA(cudaMemset(dqkv, 0xFF, n_qkv * 2));
            if (pass == 0)
                FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0));
            else if (pass <= 2) /* the second run on 3 CTAs: each strides over many work tiles */
                FLASH_CUDA(hopper_attention_forward(st, o, lse, cview(q), cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0,
                                                    NULL, pass == 2 ? 3 : 0));
            else
                FLASH_CUDA(attention_forward_fast(st, pass == 3 ? MT_ATTN_FWD_DEFAULT : MT_ATTN_FWD_FA2, o, lse, cview(q),
                                                  cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0, mt_dropout(), NULL));
            FLASH_CUDA(cudaDeviceSynchronize());
            uint16_t* ho = pass == 0 ? h_o2 : pass == 1 ? h_o3 : pass == 2 ? h_o3b : h_os;
            float* hl = pass == 0 ? h_l2 : pass == 1 ? h_l3 : pass == 2 ? h_l3b : h_ls;
            FLASH_CUDA(cudaMemcpy(ho, out, n_rows * 2, cudaMemcpyDeviceToHost));
            FLASH_CUDA(cudaMemcpy(hl, lse, n_lse * 4, cudaMemcpyDeviceToHost));
            if (pass == 3) sel_default = !memcmp(h_os, h_o3, n_rows * 2) && !memcmp(h_ls, h_l3, n_lse * 4);
            if (pass == 4) sel_fa2 = !memcmp(h_os, h_o2, n_rows * 2) && !memcmp(h_ls, h_l2, n_lse * 4);
            if (pass >= 2) continue;
            FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v), cview(o), lse,
                                                s->B, s->H, s->Hkv, T, d, 0));
            FLASH_CUDA(cudaMemcpy(pass == 0 ? h_g2 : h_g3, dqkv, n_qkv * 2, cudaMemcpyDeviceToHost));
        }
    }
    for (size_t r = 0; r < BT; r++) /* O per element, row by row of each head */
        for (int h = 0; h < s->H; h++) {
            const uint16_t *a = h_o3 + r * C + (size_t)h * d, *b = h_o2 + r * C + (size_t)h * d;
            double ss = 0.0;
            for (int e = 0; e < d; e++) ss += flash_bf2d(b[e]) * flash_bf2d(b[e]);
            const double rms = sqrt(ss / d);
            for (int e = 0; e < d; e++) {
                const double x = flash_bf2d(a[e]), y = flash_bf2d(b[e]);
                const double excess = fabs(x - y) / (0x1p-7 * fabs(y) + 0x1p-7 * rms);
                if (!(excess <= worst)) worst = excess; /* NaN (an unwritten element) sticks */
            }
        }
    double e_o;
    for (size_t i = 0; i < n_rows; i++) got[i] = flash_bf2d(h_o3[i]), want[i] = flash_bf2d(h_o2[i]);
    e_o = flash_rel(got, want, n_rows);
    for (size_t i = 0; i < n_lse; i++) {
        const double x = h_l3[i], y = h_l2[i], e = fabs(x - y) / std::max(1.0, fabs(y));
        if (!(e <= worst_lse)) worst_lse = e;
    }
    for (size_t i = 0; i < n_qkv; i++) got[i] = flash_bf2d(h_g3[i]), want[i] = flash_bf2d(h_g2[i]);
    {
        const double e_g = flash_rel(got, want, n_qkv);
        const bool same = !memcmp(h_o3, h_o3b, n_rows * 2) && !memcmp(h_l3, h_l3b, n_lse * 4);
        const bool differ = memcmp(h_o3, h_o2, n_rows * 2) || memcmp(h_l3, h_l2, n_lse * 4);
        const char* sel = !(sel_default && sel_fa2) ? "WRONG" : differ ? "fa3 / fa2 as set" : "ok (outputs equal)";
        *apart = differ;
        printf("      B=%d H=%d Hkv=%d T=%d d=%d: O worst %.3f of its per-element bound, %.2e norm-wise; LSE %.2e; "
               "backward from it %.2e; repeat %s; selection %s\n", s->B, s->H, s->Hkv, T, d, worst, e_o, worst_lse,
               e_g, same ? "bitwise" : "DIFFERS", sel);
        if (!(worst <= 1.0) || !(e_o <= 0x1p-8) || !(worst_lse <= 1e-5) || !(e_g <= 2e-2) || !same) {
            printf("    FAIL the Hopper attention forward is off section 9's\n");
            ok = 0;
        }
        if (!sel_default || !sel_fa2) {
            printf("    FAIL attention_forward_fast: by default %s the Hopper forward's output, under fa2 %s FA2's\n",
                   sel_default ? "gives" : "does not give", sel_fa2 ? "gives" : "does not give");
            ok = 0;
        }
    }
done:
    cudaFree(qkv); cudaFree(dqkv); cudaFree(dout); cudaFree(out); cudaFree(lse); cudaFree(dsum);
    free(h_qkv); free(h_dout); free(h_o2); free(h_o3); free(h_o3b); free(h_g2); free(h_g3); free(h_l2); free(h_l3);
    free(h_l3b); free(h_os); free(h_ls); free(got); free(want);
    return ok;
}

static test_result test_hopper_attention_forward(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_attention_available, &probe, "the Hopper attention forward");
    int apart[2] = {0, 0}; /* d = 64, 128: a shape where FA2's and the Hopper forward's outputs differ */
    const flash_shape shapes[] = {
        {2, 4, 2, 200, 128, NULL},  /* GQA, T = 1.56 tiles */
        {1, 8, 2, 1000, 128, NULL}, /* four query heads per kv head, 8 tiles, the last partial */
        {2, 3, 3, 256, 128, NULL},  /* multi-head, whole tiles */
        {1, 2, 1, 17, 128, NULL},   /* T below one tile */
        {2, 2, 2, 1, 128, NULL},    /* T = 1 */
        {2, 12, 12, 300, 64, NULL}, /* head dim 64: GPT-2 124M's 12 heads, B = 2, T = 2.34 tiles */
        {1, 25, 25, 129, 64, NULL}, /* GPT-2 1.5B's 25 heads, one row past a tile */
        {2, 8, 2, 200, 64, NULL},   /* GQA */
        {1, 8, 2, 1000, 64, NULL},  /* four query heads per kv head, 8 tiles, the last partial */
        {2, 3, 3, 256, 64, NULL},   /* multi-head, whole tiles */
        {1, 2, 1, 17, 64, NULL},    /* T below one tile */
        {3, 4, 2, 1, 64, NULL},     /* T = 1 */
        {4, 12, 12, 1024, 64, NULL}, /* GPT-2 124M's heads at T = 1024: 384 work tiles, more than the SMs */
        {2, 8, 2, 2000, 128, NULL},  /* GQA, 16 m_blocks (the last partial) x 16 (b, h): 256 work tiles */
        {40, 4, 2, 1, 64, NULL},     /* T = 1, 160 work tiles of one key tile each */
        {1, 4, 2, 4500, 128, NULL},  /* 36 m_blocks: two bands of the tile list (32 and 4; hg::banded_tile) */
        {2, 3, 1, 9000, 64, NULL},   /* 71 m_blocks: three bands, B = 2 */
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        int differ = 0;
        if (!fa3_check_shape(&shapes[i], &probe, &differ)) return TEST_FAIL;
        apart[shapes[i].d == 128] |= differ;
    }
    EXPECT(apart[0] && apart[1], "FA2 and the Hopper forward agreed bitwise on every shape of a head dim: the selection "
                                 "check could not tell which ran");
    /* what it does not take is refused, not launched: head dim 96, a row stride of 12 elements */
    attn_view bad = {(bf16*)NULL, 8, 12, 8, 8};
    EXPECT(hopper_attention_forward(&probe, bad, NULL, cview(bad), cview(bad), cview(bad), 1, 1, 1, 8, 128, 0) ==
               cudaErrorInvalidValue,
           "a row stride of 12 elements was accepted");
    attn_view d96 = {(bf16*)NULL, 96, 96, 96, 96};
    EXPECT(hopper_attention_forward(&probe, d96, NULL, cview(d96), cview(d96), cview(d96), 1, 1, 1, 8, 96, 0) ==
               cudaErrorInvalidValue,
           "head dim 96 was accepted");
    return TEST_PASS;
}

/* Section 13.3's Hopper backward against section 9's FA2 backward on the model's row layouts (q, k, v read in
 * place from the fused QKV rows, dq, dk, dv written into the gradient's QKV rows), from the same forward (FA2's
 * O and LSE), and a second run of it bitwise the same (no atomics; the gradient rows start as NaN each run, so
 * an element not written fails). Per element |x - y| <= 2^-5 (|y| + rms), rms over that gradient (dQ, dK or
 * dV) as a whole: both kernels round P and dS to bf16 (2^-9 relative) before their products and the result
 * once, in different summation orders, so they differ by a few bf16 ulps of the tensor's scale, while a wrong
 * mask, tile, stride or head gives errors of the order of rms. Per tensor 1e-2 norm-wise (the FA2 tests'
 * reference bound is 2e-2; the two kernels are closer to each other than either is to float64). */
static int fa3b_check_shape(const flash_shape* s, mt_hopper_gemm_state* st) {
    int ok = 1;
    const int qpg = s->H / s->Hkv, d = s->d, T = s->T, W = s->Hkv * (qpg + 2) * d, C = s->H * d;
    const size_t BT = (size_t)s->B * T, n_qkv = BT * W, n_rows = BT * C, n_lse = (size_t)s->B * s->H * T;
    uint16_t *h_qkv = (uint16_t*)malloc(n_qkv * 2), *h_dout = (uint16_t*)malloc(n_rows * 2);
    uint16_t *h_g2 = (uint16_t*)malloc(n_qkv * 2), *h_g3 = (uint16_t*)malloc(n_qkv * 2), *h_g3b = (uint16_t*)malloc(n_qkv * 2);
    bf16 *qkv = NULL, *dout = NULL, *out = NULL, *dqkv = NULL;
    float *lse = NULL, *dsum = NULL;
    uint64_t rng = 0xFA3B0ull + (uint64_t)T * 131 + s->H * 7 + d;
    flash_fill(h_qkv, n_qkv, 1.7f, &rng);
    flash_fill(h_dout, n_rows, 1.0f, &rng);
    FLASH_CUDA(cudaMalloc(&qkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dqkv, n_qkv * 2));
    FLASH_CUDA(cudaMalloc(&dout, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&out, n_rows * 2));
    FLASH_CUDA(cudaMalloc(&lse, n_lse * 4));
    FLASH_CUDA(cudaMalloc(&dsum, n_lse * 4));
    FLASH_CUDA(cudaMemcpy(qkv, h_qkv, n_qkv * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dout, h_dout, n_rows * 2, cudaMemcpyHostToDevice));
    {
        attn_view q = qkv_rows_view(qkv, T, s->Hkv, d, qpg, 0), k = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view dq = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, 0), dk = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg),
                  dv = qkv_rows_view(dqkv, T, s->Hkv, d, qpg, qpg + 1);
        attn_view o = attention_rows_view(out, T, s->H, d, qpg), go = attention_rows_view(dout, T, s->H, d, qpg);
        FLASH_CUDA(flash_attention_forward(o, lse, cview(q), cview(k), cview(v), s->B, s->H, s->Hkv, T, d, 0));
        /* 0: FA2, 1: Hopper, 2: Hopper again on 3 CTAs (each walks many tiles: the persistent schedule's barrier
         * phases across tile boundaries, both snake directions; the bits must not change) */
        hg::options three = {-1, 3, NULL, 0};
        for (int pass = 0; pass < 3; pass++) {
            FLASH_CUDA(cudaMemset(dqkv, 0xFF, n_qkv * 2));
            FLASH_CUDA(cudaMemset(dsum, 0xFF, n_lse * 4));
            if (pass == 0)
                FLASH_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v), cview(o),
                                                    lse, s->B, s->H, s->Hkv, T, d, 0));
            else
                FLASH_CUDA(hopper_attention_backward(st, dq, dk, dv, dsum, cview(go), cview(q), cview(k), cview(v),
                                                     cview(o), lse, s->B, s->H, s->Hkv, T, d, 0,
                                                     pass == 2 ? &three : NULL));
            FLASH_CUDA(cudaDeviceSynchronize());
            FLASH_CUDA(cudaMemcpy(pass == 0 ? h_g2 : pass == 1 ? h_g3 : h_g3b, dqkv, n_qkv * 2, cudaMemcpyDeviceToHost));
        }
    }
    {
        /* per gradient (kind 0 dQ, 1 dK, 2 dV): its rms, then the per-element excess and the norm-wise error */
        double worst[3] = {0, 0, 0}, rel[3];
        for (int kind = 0; kind < 3; kind++) {
            const int heads = kind == 0 ? s->H : s->Hkv;
            double ss = 0.0, se = 0.0;
            for (size_t r = 0; r < BT; r++)
                for (int hh = 0; hh < heads; hh++)
                    for (int e = 0; e < d; e++) {
                        const double y = flash_bf2d(h_g2[r * W + flash_head_column(kind, hh, qpg, d) + e]);
                        ss += y * y;
                    }
            const double rms = sqrt(ss / ((double)BT * heads * d));
            for (size_t r = 0; r < BT; r++)
                for (int hh = 0; hh < heads; hh++)
                    for (int e = 0; e < d; e++) {
                        const size_t i = r * W + flash_head_column(kind, hh, qpg, d) + e;
                        const double x = flash_bf2d(h_g3[i]), y = flash_bf2d(h_g2[i]);
                        se += (x - y) * (x - y);
                        const double excess = fabs(x - y) / (0x1p-5 * (fabs(y) + rms) + 1e-30);
                        if (!(excess <= worst[kind])) worst[kind] = excess; /* NaN (an unwritten element) sticks */
                    }
            rel[kind] = ss > 0.0 ? sqrt(se / ss) : sqrt(se);
        }
        const bool same = !memcmp(h_g3, h_g3b, n_qkv * 2);
        printf("      B=%d H=%d Hkv=%d T=%d d=%d: dQ %.3f / %.2e, dK %.3f / %.2e, dV %.3f / %.2e (worst of the per-element "
               "bound / norm-wise); repeat %s\n", s->B, s->H, s->Hkv, T, d, worst[0], rel[0], worst[1], rel[1], worst[2],
               rel[2], same ? "bitwise on 3 CTAs" : "DIFFERS on 3 CTAs");
        for (int kind = 0; kind < 3; kind++)
            if (!(worst[kind] <= 1.0) || !(rel[kind] <= 1e-2)) ok = 0;
        if (!same) ok = 0;
        if (!ok) printf("    FAIL the Hopper attention backward is off section 9's\n");
    }
done:
    cudaFree(qkv); cudaFree(dqkv); cudaFree(dout); cudaFree(out); cudaFree(lse); cudaFree(dsum);
    free(h_qkv); free(h_dout); free(h_g2); free(h_g3); free(h_g3b);
    return ok;
}

static test_result test_hopper_attention_backward(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_attention_backward_available, &probe, "the Hopper attention backward");
    const flash_shape shapes[] = {
        {2, 4, 2, 200, 64, NULL},   /* GQA, d 64, T = 1.56 key tiles of 128 */
        {2, 4, 2, 200, 128, NULL},  /* the same at d 128 */
        {1, 8, 2, 1000, 128, NULL}, /* four query heads per kv head, the last tiles partial */
        {2, 3, 3, 256, 64, NULL},   /* multi-head, whole tiles */
        {1, 2, 1, 17, 128, NULL},   /* T below one 64-row tile */
        {1, 4, 4, 1, 64, NULL},     /* one position */
        {1, 4, 1, 129, 64, NULL},   /* one row past a tile */
        {4, 12, 12, 1024, 64, NULL}, /* GPT-2's heads: 384 tiles a kernel, more than one per SM */
        {8, 8, 2, 1500, 128, NULL},  /* GQA, 192 dK/dV and 768 dQ tiles, the last partial */
        {1, 4, 2, 4500, 128, NULL},  /* 36 key and query tiles a head: two bands of the tile lists (hg::banded_tile) */
        {2, 3, 1, 9000, 64, NULL},   /* 71: three bands, B = 2 */
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        if (!fa3b_check_shape(&shapes[i], &probe)) return TEST_FAIL;
    /* what it does not take is refused, not launched: head dim 96, a row stride of 12 elements */
    attn_view bad = {(bf16*)NULL, 8, 12, 8, 8};
    EXPECT(hopper_attention_backward(&probe, bad, bad, bad, NULL, cview(bad), cview(bad), cview(bad), cview(bad),
                                     cview(bad), NULL, 1, 1, 1, 8, 128, 0) == cudaErrorInvalidValue,
           "a row stride of 12 elements was accepted");
    attn_view d96 = {(bf16*)NULL, 96, 96, 96, 96};
    EXPECT(hopper_attention_backward(&probe, d96, d96, d96, NULL, cview(d96), cview(d96), cview(d96), cview(d96),
                                     cview(d96), NULL, 1, 1, 1, 8, 96, 0) == cudaErrorInvalidValue,
           "head dim 96 was accepted");
    return TEST_PASS;
}

/* Sections 13.2 / 13.3's kernels on a window of rows (hopper_attention_forward_rect / _backward_rect, what
 * section 13.4's ring steps call): queries q0 .. q0 + tq of a [B, H, TQ, d] tensor against keys k0 .. k0 + tk
 * of [B, Hkv, TK, d], LSE and Dsum read and written at a row stride of TQ, with no mask (every query sees
 * every key: a ring step against another rank's block) or causal; against a double-precision CPU reference
 * from the same bf16 values (the backward from the reference's LSE and Dsum, rounded to fp32 as the ring
 * hands them over). Shapes: tq, tk not multiples of the tiles, below one tile and 1, GQA and MHA, both
 * head dims, more work tiles than SMs. Every output row outside the window must keep its NaN poison (the
 * views write only their rows), and a second run on 3 CTAs must be bitwise the same.
 * Tolerances (per output tensor O, dQ, dK, dV): norm-wise 1e-2 and per element |x - y| <= 2^-5 (|y| + rms):
 * P and dS are rounded to bf16 (2^-9 relative) before their products and the outputs once, summed in fp32,
 * which the norm-wise bound covers with a margin of ~5 (the FA2 tests measure a few 1e-3 for the same
 * roundings); the per-element bound allows a few bf16 ulps of the element or of the tensor's scale (dS's
 * cancellation leaves elements near zero), while a missing key tile, a wrong mask, a window offset or a
 * stride mistake is off by the order of rms. LSE: fp32 throughout, 1e-4 of max(1, |LSE|). */
typedef struct {
    int B, H, Hkv, d, TQ, q0, tq, TK, k0, tk;
    bool causal;
} rect_case;

static int rect_check(const rect_case* c, mt_hopper_gemm_state* st) {
    int ok = 1;
    const int B = c->B, H = c->H, Hkv = c->Hkv, d = c->d, qpg = H / Hkv, TQ = c->TQ, TK = c->TK;
    const size_t nq = (size_t)B * H * TQ * d, nk = (size_t)B * Hkv * TK * d, nl = (size_t)B * H * TQ;
    uint16_t *hq = (uint16_t*)malloc(nq * 2), *hdo = (uint16_t*)malloc(nq * 2), *hk = (uint16_t*)malloc(nk * 2),
             *hv = (uint16_t*)malloc(nk * 2);
    uint16_t *ho[2] = {(uint16_t*)malloc(nq * 2), (uint16_t*)malloc(nq * 2)},
             *hdq[2] = {(uint16_t*)malloc(nq * 2), (uint16_t*)malloc(nq * 2)},
             *hdk[2] = {(uint16_t*)malloc(nk * 2), (uint16_t*)malloc(nk * 2)},
             *hdv[2] = {(uint16_t*)malloc(nk * 2), (uint16_t*)malloc(nk * 2)};
    float *hl[2] = {(float*)malloc(nl * 4), (float*)malloc(nl * 4)}, *hls = (float*)malloc(nl * 4),
          *hds = (float*)malloc(nl * 4);
    double *ro = (double*)calloc(nq, 8), *rdq = (double*)calloc(nq, 8), *rdk = (double*)calloc(nk, 8),
           *rdv = (double*)calloc(nk, 8), *rl = (double*)calloc(nl, 8), *pr = (double*)malloc(sizeof(double) * TK);
    bf16 *q = NULL, *k = NULL, *v = NULL, *go = NULL, *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    float *lse = NULL, *lse_in = NULL, *dsum = NULL;
    const double scale = 1.0 / sqrt((double)d);
    uint64_t rng = 0x5EC7ull + (uint64_t)c->tq * 7919 + c->tk * 31 + d + c->causal;
    if (!hq || !hdo || !hk || !hv || !ho[1] || !hdq[1] || !hdk[1] || !hdv[1] || !hl[1] || !hls || !hds || !ro ||
        !rdq || !rdk || !rdv || !rl || !pr) {
        printf("    FAIL out of host memory\n");
        ok = 0;
        goto done;
    }
    flash_fill(hq, nq, 1.7f, &rng);
    flash_fill(hk, nk, 1.7f, &rng);
    flash_fill(hv, nk, 1.0f, &rng);
    flash_fill(hdo, nq, 1.0f, &rng);
    /* the reference over the window */
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const size_t qb = ((size_t)b * H + h) * TQ, kb = ((size_t)b * Hkv + h / qpg) * TK;
            for (int i = c->q0; i < c->q0 + c->tq; i++) {
                const int keys = c->causal ? i - c->q0 + 1 : c->tk; /* causal: the window's own diagonal */
                double m = -INFINITY, l = 0.0, dsum = 0.0;
                for (int j = 0; j < keys; j++) {
                    double x = 0.0;
                    for (int e = 0; e < d; e++)
                        x += flash_bf2d(hq[(qb + i) * d + e]) * flash_bf2d(hk[(kb + c->k0 + j) * d + e]);
                    pr[j] = x * scale;
                    m = std::max(m, pr[j]);
                }
                for (int j = 0; j < keys; j++) l += exp(pr[j] - m);
                const double L = m + log(l);
                rl[qb + i] = L;
                for (int j = 0; j < keys; j++) pr[j] = exp(pr[j] - L);
                for (int e = 0; e < d; e++) {
                    double y = 0.0;
                    for (int j = 0; j < keys; j++) y += pr[j] * flash_bf2d(hv[(kb + c->k0 + j) * d + e]);
                    ro[(qb + i) * d + e] = y;
                    dsum += y * flash_bf2d(hdo[(qb + i) * d + e]);
                }
                hls[qb + i] = (float)L, hds[qb + i] = (float)dsum;
                for (int j = 0; j < keys; j++) {
                    const size_t kr = (kb + c->k0 + j) * d;
                    double dp = 0.0;
                    for (int e = 0; e < d; e++) dp += flash_bf2d(hdo[(qb + i) * d + e]) * flash_bf2d(hv[kr + e]);
                    const double ds = pr[j] * (dp - dsum);
                    for (int e = 0; e < d; e++) {
                        rdq[(qb + i) * d + e] += scale * ds * flash_bf2d(hk[kr + e]);
                        rdk[kr + e] += scale * ds * flash_bf2d(hq[(qb + i) * d + e]);
                        rdv[kr + e] += pr[j] * flash_bf2d(hdo[(qb + i) * d + e]);
                    }
                }
            }
        }
    FLASH_CUDA(cudaMalloc(&q, nq * 2));
    FLASH_CUDA(cudaMalloc(&go, nq * 2));
    FLASH_CUDA(cudaMalloc(&o, nq * 2));
    FLASH_CUDA(cudaMalloc(&dq, nq * 2));
    FLASH_CUDA(cudaMalloc(&k, nk * 2));
    FLASH_CUDA(cudaMalloc(&v, nk * 2));
    FLASH_CUDA(cudaMalloc(&dk, nk * 2));
    FLASH_CUDA(cudaMalloc(&dv, nk * 2));
    FLASH_CUDA(cudaMalloc(&lse, nl * 4));
    FLASH_CUDA(cudaMalloc(&lse_in, nl * 4));
    FLASH_CUDA(cudaMalloc(&dsum, nl * 4));
    FLASH_CUDA(cudaMemcpy(q, hq, nq * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(go, hdo, nq * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(k, hk, nk * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(v, hv, nk * 2, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(lse_in, hls, nl * 4, cudaMemcpyHostToDevice));
    FLASH_CUDA(cudaMemcpy(dsum, hds, nl * 4, cudaMemcpyHostToDevice));
    for (int run = 0; run < 2; run++) {
        const attn_view vq = cp_rows(packed_heads_view(q, H, TQ, d, qpg), c->q0),
                        vgo = cp_rows(packed_heads_view(go, H, TQ, d, qpg), c->q0),
                        vo = cp_rows(packed_heads_view(o, H, TQ, d, qpg), c->q0),
                        vdq = cp_rows(packed_heads_view(dq, H, TQ, d, qpg), c->q0),
                        vk = cp_rows(packed_heads_view(k, Hkv, TK, d, 1), c->k0),
                        vv = cp_rows(packed_heads_view(v, Hkv, TK, d, 1), c->k0),
                        vdk = cp_rows(packed_heads_view(dk, Hkv, TK, d, 1), c->k0),
                        vdv = cp_rows(packed_heads_view(dv, Hkv, TK, d, 1), c->k0);
        hg::options three = {-1, 3, NULL, 0};
        FLASH_CUDA(cudaMemset(o, 0xFF, nq * 2));
        FLASH_CUDA(cudaMemset(dq, 0xFF, nq * 2));
        FLASH_CUDA(cudaMemset(dk, 0xFF, nk * 2));
        FLASH_CUDA(cudaMemset(dv, 0xFF, nk * 2));
        FLASH_CUDA(cudaMemset(lse, 0xFF, nl * 4));
        FLASH_CUDA(hopper_attention_forward_rect(st, vo, lse + c->q0, TQ, cview(vq), cview(vk), cview(vv), B, H, Hkv,
                                                 c->tq, c->tk, d, c->causal, 0, NULL, run ? 3 : 0));
        FLASH_CUDA(hopper_attention_backward_rect(st, vdq, vdk, vdv, dsum + c->q0, TQ, cview(vgo), cview(vq), cview(vk),
                                                  cview(vv), lse_in + c->q0, B, H, Hkv, c->tq, c->tk, d, c->causal, 0,
                                                  run ? &three : NULL));
        FLASH_CUDA(cudaDeviceSynchronize());
        FLASH_CUDA(cudaMemcpy(ho[run], o, nq * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(hdq[run], dq, nq * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(hdk[run], dk, nk * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(hdv[run], dv, nk * 2, cudaMemcpyDeviceToHost));
        FLASH_CUDA(cudaMemcpy(hl[run], lse, nl * 4, cudaMemcpyDeviceToHost));
    }
    {
        /* per tensor: rms of the reference over the window, worst per-element excess, norm-wise error; rows
         * outside the window must still be poison (0xFFFF: a NaN) */
        const uint16_t* got[4] = {ho[0], hdq[0], hdk[0], hdv[0]};
        const double* ref[4] = {ro, rdq, rdk, rdv};
        const char* name[4] = {"O", "dQ", "dK", "dV"};
        double worst[4], rel[4], lse_worst = 0.0;
        size_t outside = 0;
        for (int t = 0; t < 4; t++) {
            const bool isq = t < 2;
            const int heads = isq ? H : Hkv, rows = isq ? TQ : TK, r0 = isq ? c->q0 : c->k0, r1 = r0 + (isq ? c->tq : c->tk);
            double ss = 0.0, se = 0.0, n = 0.0;
            worst[t] = 0.0;
            for (int pass = 0; pass < 2; pass++)
                for (size_t bh = 0; bh < (size_t)B * heads; bh++)
                    for (int r = 0; r < rows; r++)
                        for (int e = 0; e < d; e++) {
                            const size_t i = (bh * rows + r) * d + e;
                            if (r < r0 || r >= r1) {
                                if (pass == 0) outside += got[t][i] != 0xFFFF;
                                continue;
                            }
                            const double y = ref[t][i], x = flash_bf2d(got[t][i]);
                            if (pass == 0) ss += y * y, se += (x - y) * (x - y), n += 1.0;
                            else {
                                const double rms = sqrt(ss / n), ex = fabs(x - y) / (0x1p-5 * (fabs(y) + rms) + 1e-30);
                                if (!(ex <= worst[t])) worst[t] = ex;
                            }
                        }
            rel[t] = ss > 0.0 ? sqrt(se / ss) : sqrt(se);
        }
        for (size_t bh = 0; bh < (size_t)B * H; bh++)
            for (int r = 0; r < TQ; r++) {
                const size_t i = bh * TQ + r;
                uint32_t bits;
                memcpy(&bits, &hl[0][i], 4);
                if (r < c->q0 || r >= c->q0 + c->tq) outside += bits != 0xFFFFFFFFu;
                else {
                    const double e = fabs(hl[0][i] - rl[i]) / std::max(1.0, fabs(rl[i]));
                    if (!(e <= lse_worst)) lse_worst = e;
                }
            }
        const bool same = !memcmp(ho[0], ho[1], nq * 2) && !memcmp(hdq[0], hdq[1], nq * 2) &&
                          !memcmp(hdk[0], hdk[1], nk * 2) && !memcmp(hdv[0], hdv[1], nk * 2) &&
                          !memcmp(hl[0], hl[1], nl * 4);
        printf("      B=%d H=%d Hkv=%d d=%d rows %d+%d of %d x keys %d+%d of %d%s:", B, H, Hkv, d, c->q0, c->tq, TQ, c->k0,
               c->tk, TK, c->causal ? " causal" : "");
        for (int t = 0; t < 4; t++) printf(" %s %.2e (%.2f)", name[t], rel[t], worst[t]);
        printf(" LSE %.1e; outside %zu; repeat %s\n", lse_worst, outside, same ? "bitwise on 3 CTAs" : "DIFFERS");
        for (int t = 0; t < 4; t++)
            if (!(rel[t] <= 1e-2) || !(worst[t] <= 1.0)) {
                printf("    FAIL %s off the reference\n", name[t]);
                ok = 0;
            }
        if (!(lse_worst <= 1e-4) || outside || !same) {
            printf("    FAIL LSE %.2e, %zu elements outside the window written, repeat %s\n", lse_worst, outside,
                   same ? "bitwise" : "differs");
            ok = 0;
        }
    }
done:
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(go), cudaFree(o), cudaFree(dq), cudaFree(dk), cudaFree(dv);
    cudaFree(lse), cudaFree(lse_in), cudaFree(dsum);
    free(hq), free(hdo), free(hk), free(hv), free(hls), free(hds), free(ro), free(rdq), free(rdk), free(rdv), free(rl);
    free(pr);
    for (int i = 0; i < 2; i++) free(ho[i]), free(hdq[i]), free(hdk[i]), free(hdv[i]), free(hl[i]);
    return ok;
}

static test_result test_hopper_attention_rectangles(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_attention_backward_available, &probe, "the Hopper attention kernels");
    EXPECT(hopper_attention_available(&probe), "the Hopper backward runs here but not the forward");
    const rect_case cases[] = {
        {2, 4, 2, 64, 384, 128, 256, 320, 64, 200, false},  /* GQA, d 64, keys 1.56 tiles */
        {1, 8, 2, 128, 300, 40, 260, 128, 0, 128, false},   /* d 128, one whole key tile, the rows start mid-tile */
        {2, 4, 4, 128, 128, 64, 64, 128, 0, 128, false},     /* a ring step of C = 64 rows against its block (j > r) */
        {1, 2, 1, 128, 128, 0, 128, 128, 0, 64, false},      /* ... all rows against a 64-row chunk (j < r) */
        {1, 2, 2, 64, 8, 3, 1, 8, 5, 1, false},              /* one query, one key */
        {2, 4, 4, 128, 400, 100, 250, 400, 100, 250, true},  /* causal on a window, LSE stride 400 */
        {2, 12, 12, 64, 1300, 20, 1280, 300, 0, 300, false}, /* 240 work tiles: more than the SMs */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        if (!rect_check(&cases[i], &probe)) return TEST_FAIL;
    /* what it does not take is refused: causal with Tq != Tk, an LSE stride below the rows */
    attn_view pk = packed_heads_view(NULL, 1, 64, 64, 1);
    EXPECT(hopper_attention_forward_rect(&probe, pk, NULL, 64, cview(pk), cview(pk), cview(pk), 1, 1, 1, 64, 32, 64,
                                         true, 0) == cudaErrorInvalidValue,
           "causal with 64 queries and 32 keys was accepted");
    EXPECT(hopper_attention_backward_rect(&probe, pk, pk, pk, NULL, 32, cview(pk), cview(pk), cview(pk), cview(pk), NULL,
                                          1, 1, 1, 64, 64, 64, false, 0) == cudaErrorInvalidValue,
           "an LSE stride of 32 for 64 rows was accepted");
    return TEST_PASS;
}

/* MT_ATTN_BWD's parser, as MT_ATTN_FWD's: unset or empty the default, fa2 / fa3 their modes, anything else
 * refused in one line naming the value. */
static test_result test_attention_backward_choice(void) {
    int mode = -1;
    mt_error err;
    memset(&err, 0, sizeof(err));
    EXPECT(attn_bwd_parse(NULL, &mode, &err) == MT_OK && mode == MT_ATTN_BWD_DEFAULT, "unset is not the default");
    EXPECT(attn_bwd_parse("", &mode, &err) == MT_OK && mode == MT_ATTN_BWD_DEFAULT, "empty is not the default");
    EXPECT(attn_bwd_parse("fa2", &mode, &err) == MT_OK && mode == MT_ATTN_BWD_FA2, "fa2 is not FA2");
    EXPECT(attn_bwd_parse("fa3", &mode, &err) == MT_OK && mode == MT_ATTN_BWD_FA3, "fa3 is not FA3");
    EXPECT(attn_bwd_parse("fa4", &mode, &err) == MT_ERR_ARG && strstr(err.message, "MT_ATTN_BWD=fa4") &&
               !strchr(err.message, '\n'),
           "an unknown value was not refused in one line");
    /* the selection: never without a probe state, with MT_ATTN_BWD=fa2, dropout or documents */
    const mt_dropout none = mt_dropout();
    EXPECT(!hopper_backward_wanted(NULL, MT_ATTN_BWD_DEFAULT, 128, none, NULL), "no probe state, yet wanted");
    mt_hopper_gemm_state yes = {1, 1, NULL, 1, 1}; /* probed: runs here */
    EXPECT(hopper_backward_wanted(&yes, MT_ATTN_BWD_DEFAULT, 64, none, NULL) &&
               hopper_backward_wanted(&yes, MT_ATTN_BWD_FA3, 128, none, NULL),
           "not wanted where it runs");
    EXPECT(!hopper_backward_wanted(&yes, MT_ATTN_BWD_FA2, 128, none, NULL), "MT_ATTN_BWD=fa2 not honoured");
    mt_dropout drop = mt_dropout();
    drop.on = 1;
    const int32_t doc[1] = {0};
    EXPECT(!hopper_backward_wanted(&yes, MT_ATTN_BWD_DEFAULT, 128, drop, NULL) &&
               !hopper_backward_wanted(&yes, MT_ATTN_BWD_DEFAULT, 128, none, doc),
           "wanted with dropout or documents");
    mt_hopper_gemm_state no = {-1, 0, NULL, -1, -1}; /* probed: does not run here */
    EXPECT(!hopper_backward_wanted(&no, MT_ATTN_BWD_FA3, 128, none, NULL), "wanted where it does not run");
    return TEST_PASS;
}

/* MT_ATTN_FWD's parser: unset or empty the default, fa2 / fa3 their modes, anything else refused in one line
 * naming the value. */
static test_result test_attention_forward_choice(void) {
    int mode = -1;
    mt_error err;
    memset(&err, 0, sizeof(err));
    EXPECT(attn_fwd_parse(NULL, &mode, &err) == MT_OK && mode == MT_ATTN_FWD_DEFAULT, "unset is not the default");
    EXPECT(attn_fwd_parse("", &mode, &err) == MT_OK && mode == MT_ATTN_FWD_DEFAULT, "empty is not the default");
    EXPECT(attn_fwd_parse("fa2", &mode, &err) == MT_OK && mode == MT_ATTN_FWD_FA2, "fa2 is not FA2");
    EXPECT(attn_fwd_parse("fa3", &mode, &err) == MT_OK && mode == MT_ATTN_FWD_FA3, "fa3 is not FA3");
    EXPECT(attn_fwd_parse("FA2", &mode, &err) == MT_ERR_ARG && strstr(err.message, "MT_ATTN_FWD=FA2") &&
               !strchr(err.message, '\n'),
           "an unknown value was not refused in one line");
    return TEST_PASS;
}

static const test_case attention_host_tests[] = {
    {"attention_forward_choice_parses", test_attention_forward_choice},
    {"attention_backward_choice_parses", test_attention_backward_choice},
};

static const test_case attention_gpu_tests[] = {
    {"hopper_attention_forward_matches_fa2", test_hopper_attention_forward},
    {"hopper_attention_backward_matches_fa2", test_hopper_attention_backward},
    {"hopper_attention_rectangles_match_reference", test_hopper_attention_rectangles},
    {"flash_attention_document_masks_match_reference", test_flash_attention_document_masks},
    {"flash_attention_document_speed", test_flash_attention_document_speed},
    {"flash_attention_row_layouts_match_reference", test_flash_attention_row_layouts},
    {"flash_attention_long_sequences_match_reference", test_flash_attention_long_sequences},
};

#endif
