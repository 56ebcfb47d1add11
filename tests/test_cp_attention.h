/* tests/test_cp_attention.h — context-parallel ring attention (issue #36, --cp-comm-type p2p; megatron.cu
 * sections 9.1-9.5): the flash kernels over two-chunk slices of a sequence and the ring built from them.
 *
 * The sequence of S = 2*CP*C tokens is cut into 2*CP chunks of C rows; CP rank r holds chunks r and
 * 2CP-1-r (its T = 2C local rows, cp_chunk_span). Inputs are random bf16 (never zero) for the whole
 * sequence; each rank's local rows are laid out as the model hands them to attention (q, k, v in the fused
 * QKV rows [B*T, Hkv*(qpg+2)*d], O and dO in the attention rows [B*T, H*d]).
 *   gpu.cp_attention (one GPU): the ring SIMULATED: for CP = 2 and 4 virtual ranks, every step of every
 *     rank's ring in the ring's order (cp_attention_forward_block / _backward_block on each K/V block, the
 *     travelling dK/dV sums added in the ring's order), against the flash kernels of section 9 run on the
 *     whole sequence (flash_attention_forward / _backward): O, LSE, dQ, dK, dV per element and per
 *     tensor; with and without document masks (documents cross chunk boundaries), GQA, d = 64 and 128,
 *     B = 2, and with attention dropout (the same site: the whole sequence's masks must be drawn). Also
 *     the all-gather case (flash_attention_forward_span / _backward_span: the local two chunks against the
 *     whole sequence's K/V, Tq != Tk) against the full kernel's rows (O, LSE, dQ bitwise: the same tiles
 *     in the same order), dK/dV as the sum of the ranks' partial gradients; a slice of chunks that are not whole tiles is refused; and bitwise repeatability.
 *   multigpu.cp_attention (mpirun -np 2 or 4): the real ring over NCCL at CP = 2 and CP = the world
 *     (cp_ring_attention_forward / _backward, K/V and the dK/dV sums moving on the ring's stream) against
 *     the simulation on each rank's GPU: bitwise the same (the same kernels in the same order; the
 *     transfers move bits), and against the whole-sequence kernels as above; then a timing line at B = 1,
 *     H = 32, Hkv = 8, d = 128, S = 16384: the ring's forward + backward per rank against one GPU's whole
 *     attention, as per-GPU efficiency t_1 / (CP * t_CP) (the issue asks >= 90%; printed, not failed: it
 *     is a measurement of a shared machine).
 * No PyTorch reference here: the whole-sequence flash kernels are themselves checked against a double
 * reference (tests/test_attention.h) and against PyTorch through the model's vectors; the ring must
 * reproduce them.
 *
 * Tolerances. The ring and the whole-sequence kernel compute the same sums in fp32 in another order and
 * round P (and dS) to bf16 against another running maximum (each block's own, then merged by log-sum-exp,
 * against the online maximum over the whole row): relative differences ~1e-6 before the outputs' one
 * rounding to bf16, so most elements are bitwise equal and the rest differ by one bf16 ulp (2^-8 of the
 * element at most). Per tensor ||ring - full|| / ||full|| <= 5e-3 (every element one ulp off would be
 * ~3e-3; measured ~1e-3 and below); per element |ring - full| <= 2^-6 (|full| + rms(full)): four ulps at
 * the element's own magnitude, or at the tensor's where cancellation (dS = P (dP - Dsum)) leaves an
 * element small. A missing or doubled block, a wrong mask, a wrong chunk position or another dropout
 * mask is off by tens of percent. LSE is fp32 throughout: |ring - full| <= 1e-4 (values ~log S). The
 * all-gather dK/dV are sums of CP partial gradients each rounded to bf16 (the caller's reduce-scatter
 * adds them): 1e-2 per tensor, 2^-5 (|full| + rms) per element. */
#ifndef MT_TEST_CP_ATTENTION_H
#define MT_TEST_CP_ATTENTION_H

typedef struct {
    int B, H, Hkv, d, C, cp; /* S = 2 * cp * C */
    int docs;                /* document masks: documents of random lengths across the chunk boundaries */
    double p_drop;           /* attention dropout (0: none) */
} cpa_case;

#define CPA_CUDA(call)                                                                                 \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            printf("    FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
            ok = 0;                                                                                    \
            goto done;                                                                                 \
        }                                                                                              \
    } while (0)

static uint16_t cpa_rand_bf16(uint64_t* state, float amp) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (double)(*state >> 11) / 9007199254740992.0;
    const double mag = 0.02 + (amp - 0.02) * fmod(u * 2.0, 1.0);
    return test_bf16_from_float((float)(u < 0.5 ? -mag : mag));
}

static mt_dropout cpa_dropout(double p, int H) {
    mt_dropout d = mt_dropout();
    if (!(p > 0.0)) return d;
    d.on = 1;
    d.threshold = dropout_threshold(p);
    d.scale = (float)(1.0 / (1.0 - p));
    d.key = dropout_stream(4321, 7, 2, DROPOUT_ATTENTION);
    d.row0 = 0, d.head0 = 0, d.heads = H;
    return d;
}

/* The whole sequence on the host (packed: q, dout [B, H, S, d]; k, v [B, Hkv, S, d]; doc [B, S] or NULL)
 * and the whole-sequence kernels' results (packed likewise; lse [B, H, S]). */
typedef struct {
    cpa_case c;
    int S, T, qpg, W;
    uint16_t *q, *k, *v, *dout;
    int32_t* doc;
    uint16_t *o, *dq, *dk, *dv;
    float* lse;
} cpa_full;

static void cpa_full_free(cpa_full* f) {
    free(f->q), free(f->k), free(f->v), free(f->dout), free(f->doc);
    free(f->o), free(f->dq), free(f->dk), free(f->dv), free(f->lse);
    memset(f, 0, sizeof(*f));
}

/* Random inputs (the same on every rank: a fixed seed per case) and the whole-sequence flash kernels. */
static int cpa_full_make(const cpa_case* c, uint64_t seed, cpa_full* f) {
    memset(f, 0, sizeof(*f));
    f->c = *c;
    f->S = 2 * c->cp * c->C, f->T = 2 * c->C, f->qpg = c->H / c->Hkv, f->W = c->Hkv * (f->qpg + 2) * c->d;
    const int B = c->B, H = c->H, Hkv = c->Hkv, S = f->S, d = c->d;
    const size_t nq = (size_t)B * H * S * d, nk = (size_t)B * Hkv * S * d, nl = (size_t)B * H * S;
    f->q = (uint16_t*)malloc(nq * 2), f->dout = (uint16_t*)malloc(nq * 2), f->o = (uint16_t*)malloc(nq * 2);
    f->dq = (uint16_t*)malloc(nq * 2), f->k = (uint16_t*)malloc(nk * 2), f->v = (uint16_t*)malloc(nk * 2);
    f->dk = (uint16_t*)malloc(nk * 2), f->dv = (uint16_t*)malloc(nk * 2), f->lse = (float*)malloc(nl * 4);
    if (c->docs) f->doc = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * S);
    int ok = f->q && f->dout && f->o && f->dq && f->k && f->v && f->dk && f->dv && f->lse && (!c->docs || f->doc);
    bf16 *q = NULL, *k = NULL, *v = NULL, *go = NULL, *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    float *lse = NULL, *dsum = NULL;
    int32_t* doc = NULL;
    const mt_dropout drop = cpa_dropout(c->p_drop, H);
    if (!ok) {
        printf("    FAIL out of host memory\n");
        goto done;
    }
    {
        uint64_t st = seed;
        for (size_t i = 0; i < nq; i++) f->q[i] = cpa_rand_bf16(&st, 1.7f);
        for (size_t i = 0; i < nk; i++) f->k[i] = cpa_rand_bf16(&st, 1.7f);
        for (size_t i = 0; i < nk; i++) f->v[i] = cpa_rand_bf16(&st, 1.0f);
        for (size_t i = 0; i < nq; i++) f->dout[i] = cpa_rand_bf16(&st, 1.0f);
        if (f->doc) /* documents of 1 .. 1.5 C tokens: most cross a chunk boundary somewhere */
            for (int b = 0; b < B; b++) {
                int start = 0, left = 0;
                for (int s = 0; s < S; s++) {
                    if (left == 0) {
                        st = st * 6364136223846793005ull + 1442695040888963407ull;
                        left = 1 + (int)((st >> 33) % (uint64_t)(3 * c->C / 2));
                        start = s;
                    }
                    f->doc[(size_t)b * S + s] = start;
                    left--;
                }
            }
    }
    CPA_CUDA(cudaMalloc(&q, nq * 2));
    CPA_CUDA(cudaMalloc(&go, nq * 2));
    CPA_CUDA(cudaMalloc(&o, nq * 2));
    CPA_CUDA(cudaMalloc(&dq, nq * 2));
    CPA_CUDA(cudaMalloc(&k, nk * 2));
    CPA_CUDA(cudaMalloc(&v, nk * 2));
    CPA_CUDA(cudaMalloc(&dk, nk * 2));
    CPA_CUDA(cudaMalloc(&dv, nk * 2));
    CPA_CUDA(cudaMalloc(&lse, nl * 4));
    CPA_CUDA(cudaMalloc(&dsum, nl * 4));
    if (f->doc) {
        CPA_CUDA(cudaMalloc(&doc, sizeof(int32_t) * (size_t)B * S));
        CPA_CUDA(cudaMemcpy(doc, f->doc, sizeof(int32_t) * (size_t)B * S, cudaMemcpyHostToDevice));
    }
    CPA_CUDA(cudaMemcpy(q, f->q, nq * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemcpy(go, f->dout, nq * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemcpy(k, f->k, nk * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemcpy(v, f->v, nk * 2, cudaMemcpyHostToDevice));
    {
        const int qpg = f->qpg;
        attn_view vq = packed_heads_view(q, H, S, d, qpg), vk = packed_heads_view(k, Hkv, S, d, 1),
                  vv = packed_heads_view(v, Hkv, S, d, 1), vo = packed_heads_view(o, H, S, d, qpg),
                  vgo = packed_heads_view(go, H, S, d, qpg), vdq = packed_heads_view(dq, H, S, d, qpg),
                  vdk = packed_heads_view(dk, Hkv, S, d, 1), vdv = packed_heads_view(dv, Hkv, S, d, 1);
        CPA_CUDA(flash_attention_forward(vo, lse, cview(vq), cview(vk), cview(vv), B, H, Hkv, S, d, 0, drop, doc));
        CPA_CUDA(flash_attention_backward(vdq, vdk, vdv, dsum, cview(vgo), cview(vq), cview(vk), cview(vv), cview(vo),
                                          lse, B, H, Hkv, S, d, 0, NULL, drop, doc));
    }
    CPA_CUDA(cudaMemcpy(f->o, o, nq * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(f->dq, dq, nq * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(f->dk, dk, nk * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(f->dv, dv, nk * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(f->lse, lse, nl * 4, cudaMemcpyDeviceToHost));
done:
    cudaFree(q), cudaFree(go), cudaFree(o), cudaFree(dq), cudaFree(k), cudaFree(v), cudaFree(dk), cudaFree(dv);
    cudaFree(lse), cudaFree(dsum), cudaFree(doc);
    return ok;
}

/* One rank's local rows on the device, laid out as the model's: qkv and dqkv [B*T, W], dout and o
 * [B*T, H*d], lse and dsum [B, H, T], doc [B, T] (sequence positions; NULL without documents). */
typedef struct {
    bf16 *qkv, *dqkv, *dout, *o;
    float *lse, *dsum;
    int32_t* doc;
} cpa_local;

static void cpa_local_free(cpa_local* l) {
    cudaFree(l->qkv), cudaFree(l->dqkv), cudaFree(l->dout), cudaFree(l->o), cudaFree(l->lse), cudaFree(l->dsum);
    cudaFree(l->doc);
    memset(l, 0, sizeof(*l));
}

/* The column of head hh's first channel in a local row: kind 0 a query head, 1 a key, 2 a value (QKV
 * rows), 3 a head of the attention rows. */
static size_t cpa_column(const cpa_full* f, int kind, int hh) {
    const int qpg = f->qpg, d = f->c.d;
    switch (kind) {
        case 0: return (size_t)(hh / qpg) * (qpg + 2) * d + (size_t)(hh % qpg) * d;
        case 1: return (size_t)hh * (qpg + 2) * d + (size_t)qpg * d;
        case 2: return (size_t)hh * (qpg + 2) * d + (size_t)(qpg + 1) * d;
        default: return (size_t)hh * d;
    }
}

/* rank r's local rows from the whole sequence */
static int cpa_local_make(const cpa_full* f, int r, cpa_local* l) {
    memset(l, 0, sizeof(*l));
    const int B = f->c.B, H = f->c.H, Hkv = f->c.Hkv, S = f->S, T = f->T, d = f->c.d, W = f->W, CW = H * d;
    const mt_seq_span sp = cp_chunk_span(r, f->c.cp, f->c.C);
    uint16_t* hq = (uint16_t*)malloc((size_t)B * T * W * 2);
    uint16_t* hg = (uint16_t*)malloc((size_t)B * T * CW * 2);
    int32_t* hd = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * T);
    int ok = hq && hg && hd;
    if (!ok) {
        printf("    FAIL out of host memory\n");
        goto done;
    }
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int pos = fa::span_pos(sp, t);
            const size_t row = (size_t)b * T + t;
            for (int hh = 0; hh < H; hh++)
                for (int e = 0; e < d; e++) {
                    const size_t src = (((size_t)b * H + hh) * S + pos) * d + e;
                    hq[row * W + cpa_column(f, 0, hh) + e] = f->q[src];
                    hg[row * CW + cpa_column(f, 3, hh) + e] = f->dout[src];
                }
            for (int hh = 0; hh < Hkv; hh++)
                for (int e = 0; e < d; e++) {
                    const size_t src = (((size_t)b * Hkv + hh) * S + pos) * d + e;
                    hq[row * W + cpa_column(f, 1, hh) + e] = f->k[src];
                    hq[row * W + cpa_column(f, 2, hh) + e] = f->v[src];
                }
            if (f->doc) hd[row] = f->doc[(size_t)b * S + pos];
        }
    CPA_CUDA(cudaMalloc(&l->qkv, (size_t)B * T * W * 2));
    CPA_CUDA(cudaMalloc(&l->dqkv, (size_t)B * T * W * 2));
    CPA_CUDA(cudaMalloc(&l->dout, (size_t)B * T * CW * 2));
    CPA_CUDA(cudaMalloc(&l->o, (size_t)B * T * CW * 2));
    CPA_CUDA(cudaMalloc(&l->lse, (size_t)B * H * T * 4));
    CPA_CUDA(cudaMalloc(&l->dsum, (size_t)B * H * T * 4));
    CPA_CUDA(cudaMemcpy(l->qkv, hq, (size_t)B * T * W * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemcpy(l->dout, hg, (size_t)B * T * CW * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemset(l->dqkv, 0xFF, (size_t)B * T * W * 2)); /* NaN: every element must be written */
    CPA_CUDA(cudaMemset(l->o, 0xFF, (size_t)B * T * CW * 2));
    if (f->doc) {
        CPA_CUDA(cudaMalloc(&l->doc, sizeof(int32_t) * (size_t)B * T));
        CPA_CUDA(cudaMemcpy(l->doc, hd, sizeof(int32_t) * (size_t)B * T, cudaMemcpyHostToDevice));
    }
done:
    free(hq), free(hg), free(hd);
    if (!ok) cpa_local_free(l);
    return ok;
}

/* The views of a rank's local rows */
typedef struct {
    attn_view q, k, v, dq, dk, dv, o, go;
} cpa_views;
static cpa_views cpa_local_views(const cpa_full* f, const cpa_local* l) {
    const int T = f->T, H = f->c.H, Hkv = f->c.Hkv, d = f->c.d, qpg = f->qpg;
    cpa_views v;
    v.q = qkv_rows_view(l->qkv, T, Hkv, d, qpg, 0), v.k = qkv_rows_view(l->qkv, T, Hkv, d, qpg, qpg);
    v.v = qkv_rows_view(l->qkv, T, Hkv, d, qpg, qpg + 1), v.dq = qkv_rows_view(l->dqkv, T, Hkv, d, qpg, 0);
    v.dk = qkv_rows_view(l->dqkv, T, Hkv, d, qpg, qpg), v.dv = qkv_rows_view(l->dqkv, T, Hkv, d, qpg, qpg + 1);
    v.o = attention_rows_view(l->o, T, H, d, qpg), v.go = attention_rows_view(l->dout, T, H, d, qpg);
    return v;
}

/* The ring simulated on one GPU: every virtual rank's steps in the ring's order (step i: rank r works on
 * rank (r - i)'s K/V block; the dK/dV sums of block j are added rank j, j+1, ... as they travel), the same
 * block calls as cp_ring_attention_forward / _backward make. scratch: mt_cp_ring_scratch_bytes per rank.
 * hs: not NULL, section 13.4's Hopper steps (the case has no dropout or documents). */
static int cpa_simulate(const cpa_full* f, cpa_local* L, void** scratch, mt_hopper_gemm_state* hs = NULL) {
    const int B = f->c.B, H = f->c.H, Hkv = f->c.Hkv, T = f->T, d = f->c.d, P = f->c.cp;
    const mt_dropout drop = cpa_dropout(f->c.p_drop, H);
    const size_t kv_elems = (size_t)B * Hkv * T * d;
    int ok = 1;
    cp_ring_scratch s[8];
    for (int r = 0; r < P; r++) {
        s[r] = cp_scratch_layout(scratch[r], B, H, Hkv, T, d);
        const cpa_views v = cpa_local_views(f, &L[r]);
        CPA_CUDA(cp_pack_kv(s[r].kv[0], cview(v.k), cview(v.v), B, Hkv, T, d, 0));
    }
    for (int i = 0; i < P; i++)
        for (int r = 0; r < P; r++) {
            const int j = (r - i + P) % P;
            const cpa_views v = cpa_local_views(f, &L[r]);
            const attn_cview k = cview(packed_heads_view(s[j].kv[0], Hkv, T, d, 1)),
                             vv = cview(packed_heads_view(s[j].kv[0] + kv_elems, Hkv, T, d, 1));
            if (hs)
                CPA_CUDA(cp_fast_forward_step(hs, v.o, L[r].lse, s[r], i == 0, i == P - 1, cview(v.q), k, vv, B, H, Hkv,
                                              T, r, j, d, 0));
            else
                CPA_CUDA(cp_attention_forward_block(v.o, L[r].lse, s[r].acc, i == 0, i == P - 1, cview(v.q), k, vv, B,
                                                    H, Hkv, T, r, j, P, d, 0, drop, L[r].doc));
        }
    for (int r = 0; r < P; r++) {
        const cpa_views v = cpa_local_views(f, &L[r]);
        CPA_CUDA(cp_attention_dsum(L[r].dsum, cview(v.go), cview(v.o), B, H, Hkv, T, d, 0));
    }
    for (int i = 0; i < P; i++)
        for (int r = 0; r < P; r++) {
            const int j = (r - i + P) % P;
            const cpa_views v = cpa_local_views(f, &L[r]);
            const attn_cview k = cview(packed_heads_view(s[j].kv[0], Hkv, T, d, 1)),
                             vv = cview(packed_heads_view(s[j].kv[0] + kv_elems, Hkv, T, d, 1));
            if (hs) { /* the step's kernels and dQ, then its dK/dV into block j's sums (rank j's dkv[0]) */
                CPA_CUDA(cp_fast_backward_step(hs, v.dq, s[r], i == 0, i == P - 1, cview(v.go), cview(v.q), k, vv,
                                               L[r].lse, L[r].dsum, B, H, Hkv, T, r, j, d, 0));
                CPA_CUDA(cp_fast_backward_add(s[r], i > 0 ? s[j].dkv[0] : NULL, s[j].dkv[0], B, Hkv, T, r, j, d, 0));
                continue;
            }
            CPA_CUDA(cp_attention_backward_block(2, v.dq, s[r].acc, i == 0, i == P - 1, NULL, NULL, cview(v.go),
                                                 cview(v.q), k, vv, L[r].lse, L[r].dsum, B, H, Hkv, T, r, j, P, d, 0,
                                                 drop, L[r].doc));
            /* block j's sums live in rank j's dkv[0] here (in place: read and written by one thread) */
            CPA_CUDA(cp_attention_backward_block(1, v.dq, s[r].acc, i == 0, i == P - 1, i > 0 ? s[j].dkv[0] : NULL,
                                                 s[j].dkv[0], cview(v.go), cview(v.q), k, vv, L[r].lse, L[r].dsum, B, H,
                                                 Hkv, T, r, j, P, d, 0, drop, L[r].doc));
        }
    for (int r = 0; r < P; r++) {
        const cpa_views v = cpa_local_views(f, &L[r]);
        CPA_CUDA(cp_store_kv_grads(v.dk, v.dv, s[r].dkv[0], B, Hkv, T, d, 0));
    }
    CPA_CUDA(cudaDeviceSynchronize());
done:
    return ok;
}

/* A rank's results on the host: o [B*T, H*d], dqkv [B*T, W], lse [B, H, T]. */
typedef struct {
    uint16_t *o, *dqkv;
    float* lse;
} cpa_host;
static void cpa_host_free(cpa_host* h) {
    free(h->o), free(h->dqkv), free(h->lse);
    memset(h, 0, sizeof(*h));
}
static int cpa_fetch(const cpa_full* f, const cpa_local* l, cpa_host* h) {
    const size_t no = (size_t)f->c.B * f->T * f->c.H * f->c.d, nq = (size_t)f->c.B * f->T * f->W,
                 nl = (size_t)f->c.B * f->c.H * f->T;
    h->o = (uint16_t*)malloc(no * 2), h->dqkv = (uint16_t*)malloc(nq * 2), h->lse = (float*)malloc(nl * 4);
    int ok = h->o && h->dqkv && h->lse;
    if (!ok) goto done;
    CPA_CUDA(cudaMemcpy(h->o, l->o, no * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(h->dqkv, l->dqkv, nq * 2, cudaMemcpyDeviceToHost));
    CPA_CUDA(cudaMemcpy(h->lse, l->lse, nl * 4, cudaMemcpyDeviceToHost));
done:
    if (!ok) cpa_host_free(h);
    return ok;
}
static int cpa_host_equal(const cpa_full* f, const cpa_host* a, const cpa_host* b) {
    const size_t no = (size_t)f->c.B * f->T * f->c.H * f->c.d, nq = (size_t)f->c.B * f->T * f->W,
                 nl = (size_t)f->c.B * f->c.H * f->T;
    return memcmp(a->o, b->o, no * 2) == 0 && memcmp(a->dqkv, b->dqkv, nq * 2) == 0 &&
           memcmp(a->lse, b->lse, nl * 4) == 0;
}

/* Errors of one tensor: got/ref pairs accumulated, then the norm-wise error and the worst element
 * against its bound elem_tol * (|ref| + rms(ref)) (as a fraction of the bound). */
typedef struct {
    double *got, *ref;
    size_t n, cap;
} cpa_pairs;
static void cpa_add(cpa_pairs* p, double got, double ref) {
    if (p->n < p->cap) p->got[p->n] = got, p->ref[p->n] = ref, p->n++;
}
static int cpa_judge(const char* name, const cpa_pairs* p, double tensor_tol, double elem_tol, int quiet) {
    double num = 0.0, den = 0.0, worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = 0; i < p->n; i++) {
        num += (p->got[i] - p->ref[i]) * (p->got[i] - p->ref[i]);
        den += p->ref[i] * p->ref[i];
    }
    const double rms = p->n ? sqrt(den / (double)p->n) : 0.0, rel = den > 0.0 ? sqrt(num / den) : sqrt(num);
    for (size_t i = 0; i < p->n; i++) {
        const double x = fabs(p->got[i] - p->ref[i]) / (elem_tol * (fabs(p->ref[i]) + rms));
        if (!(x <= worst)) worst = x, worst_i = i; /* NaN counts as the worst */
    }
    if (!quiet) printf(" %s %.1e (%.2f)", name, rel, worst);
    if (!(rel <= tensor_tol) || !(worst <= 1.0)) {
        printf("\n    FAIL %s: %.3e of the norm (bound %.0e), worst element %zu: %g against %g (%.2f of its bound)\n",
               name, rel, tensor_tol, worst_i, p->n ? p->got[worst_i] : 0.0, p->n ? p->ref[worst_i] : 0.0, worst);
        return 0;
    }
    return 1;
}
static int cpa_lse_judge(const double* got, const double* ref, size_t n, int quiet) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double x = fabs(got[i] - ref[i]);
        if (!(x <= worst)) worst = x;
    }
    if (!quiet) printf(" LSE %.1e", worst);
    if (!(worst <= 1e-4)) {
        printf("\n    FAIL LSE off the whole-sequence kernel's by %.3e (bound 1e-4)\n", worst);
        return 0;
    }
    return 1;
}

/* Every rank's local results (O, LSE, dQ, dK, dV) against the whole-sequence kernels' rows. kv_partial:
 * dK/dV are not in the ranks' rows but given as [P][B, Hkv, S, d] partial gradients (the all-gather
 * case), summed here. */
static int cpa_compare(const cpa_full* f, const cpa_host* h, const uint16_t* const* kv_partial, const char* label,
                       bool hopper = false) {
    const int B = f->c.B, H = f->c.H, Hkv = f->c.Hkv, S = f->S, T = f->T, d = f->c.d, W = f->W, CW = H * d;
    const int P = f->c.cp;
    const size_t nq = (size_t)B * H * S * d, nk = (size_t)B * Hkv * S * d, nl = (size_t)B * H * S;
    cpa_pairs po = {0}, pq = {0}, pk = {0}, pv = {0};
    double *lg = (double*)malloc(nl * 8), *lr = (double*)malloc(nl * 8);
    double* buf = (double*)malloc(sizeof(double) * 2 * (2 * nq + 2 * nk));
    size_t differ = 0; /* O, LSE, dQ elements not bitwise the whole-sequence kernel's */
    int ok = lg && lr && buf;
    if (ok) {
        double* p = buf;
        po = {p, p + nq, 0, nq}, p += 2 * nq;
        pq = {p, p + nq, 0, nq}, p += 2 * nq;
        pk = {p, p + nk, 0, nk}, p += 2 * nk;
        pv = {p, p + nk, 0, nk};
        size_t nlse = 0;
        for (int r = 0; r < P; r++) {
            const mt_seq_span sp = cp_chunk_span(r, P, f->c.C);
            for (int b = 0; b < B; b++)
                for (int t = 0; t < T; t++) {
                    const int pos = fa::span_pos(sp, t);
                    const size_t row = (size_t)b * T + t;
                    for (int hh = 0; hh < H; hh++) {
                        lg[nlse] = h[r].lse[((size_t)b * H + hh) * T + t];
                        lr[nlse++] = f->lse[((size_t)b * H + hh) * S + pos];
                        differ += memcmp(&h[r].lse[((size_t)b * H + hh) * T + t],
                                         &f->lse[((size_t)b * H + hh) * S + pos], 4) != 0;
                        for (int e = 0; e < d; e++) {
                            const size_t full = (((size_t)b * H + hh) * S + pos) * d + e;
                            cpa_add(&po, test_bf16_to_float(h[r].o[row * CW + cpa_column(f, 3, hh) + e]),
                                    test_bf16_to_float(f->o[full]));
                            cpa_add(&pq, test_bf16_to_float(h[r].dqkv[row * W + cpa_column(f, 0, hh) + e]),
                                    test_bf16_to_float(f->dq[full]));
                            differ += h[r].o[row * CW + cpa_column(f, 3, hh) + e] != f->o[full];
                            differ += h[r].dqkv[row * W + cpa_column(f, 0, hh) + e] != f->dq[full];
                        }
                    }
                    if (!kv_partial)
                        for (int hh = 0; hh < Hkv; hh++)
                            for (int e = 0; e < d; e++) {
                                const size_t full = (((size_t)b * Hkv + hh) * S + pos) * d + e;
                                cpa_add(&pk, test_bf16_to_float(h[r].dqkv[row * W + cpa_column(f, 1, hh) + e]),
                                        test_bf16_to_float(f->dk[full]));
                                cpa_add(&pv, test_bf16_to_float(h[r].dqkv[row * W + cpa_column(f, 2, hh) + e]),
                                        test_bf16_to_float(f->dv[full]));
                            }
                }
        }
        if (kv_partial)
            for (size_t i = 0; i < nk; i++) {
                double sk = 0.0, sv = 0.0;
                for (int r = 0; r < P; r++)
                    sk += test_bf16_to_float(kv_partial[r][i]), sv += test_bf16_to_float(kv_partial[r][nk + i]);
                cpa_add(&pk, sk, test_bf16_to_float(f->dk[i]));
                cpa_add(&pv, sv, test_bf16_to_float(f->dv[i]));
            }
        /* the Hopper steps round each step's O, dQ, dK, dV to bf16 before the fp32 sums (section 13.4), and run
         * another kernel than the whole sequence's: the all-gather's bounds (see the banner) */
        const double kv_tensor = kv_partial || hopper ? 1e-2 : 5e-3, kv_elem = kv_partial || hopper ? 1.0 / 32 : 1.0 / 64;
        const double q_tensor = hopper ? 1e-2 : 5e-3, q_elem = hopper ? 1.0 / 32 : 1.0 / 64;
        printf("      %s B=%d H=%d Hkv=%d d=%d C=%d CP=%d%s%s:", label, B, H, Hkv, d, f->c.C, P,
               f->c.docs ? " documents" : "", f->c.p_drop > 0 ? " dropout" : "");
        ok = cpa_judge("O", &po, q_tensor, q_elem, 0) && cpa_lse_judge(lg, lr, nlse, 0) &&
             cpa_judge("dQ", &pq, q_tensor, q_elem, 0) && cpa_judge("dK", &pk, kv_tensor, kv_elem, 0) &&
             cpa_judge("dV", &pv, kv_tensor, kv_elem, 0);
        if (ok) printf("; %zu of O, LSE, dQ not bitwise the whole sequence's\n", differ);
        /* the all-gather slices run the whole-sequence kernels' very tiles in their order (the chunks
         * are whole query tiles; the key tiles are the whole sequence's): O, LSE, dQ bit for bit */
        if (ok && kv_partial && differ) {
            printf("    FAIL the all-gather slices' O, LSE, dQ are not bitwise the whole-sequence kernel's\n");
            ok = 0;
        }
    } else {
        printf("    FAIL out of host memory\n");
    }
    free(lg), free(lr), free(buf);
    return ok;
}

/* The simulated ring for one case: against the whole sequence, run twice for bitwise repeatability.
 * out (may be NULL): the first run's results per rank, for the multi-GPU test. hs: section 13.4's steps. */
static int cpa_simulated_case(const cpa_full* f, cpa_host* out, mt_hopper_gemm_state* hs = NULL) {
    const int P = f->c.cp;
    cpa_local L[8];
    void* scratch[8] = {0};
    cpa_host h[2][8];
    memset(L, 0, sizeof(L)), memset(h, 0, sizeof(h));
    const size_t bytes = (size_t)mt_cp_ring_scratch_bytes(f->c.B, f->c.H, f->c.Hkv, f->T, f->c.d);
    int ok = P <= 8;
    for (int run = 0; run < 2 && ok; run++) {
        for (int r = 0; r < P && ok; r++) {
            ok = cpa_local_make(f, r, &L[r]);
            if (ok && !scratch[r]) CPA_CUDA(cudaMalloc(&scratch[r], bytes));
        }
        ok = ok && cpa_simulate(f, L, scratch, hs);
        for (int r = 0; r < P && ok; r++) ok = cpa_fetch(f, &L[r], &h[run][r]);
        for (int r = 0; r < P; r++) cpa_local_free(&L[r]);
    }
    ok = ok && cpa_compare(f, h[0], NULL, hs ? "ring on the Hopper steps (simulated)" : "ring (simulated)", hs != NULL);
    for (int r = 0; r < P && ok; r++)
        if (!cpa_host_equal(f, &h[0][r], &h[1][r])) {
            printf("    FAIL the simulated ring is not bitwise repeatable (rank %d)\n", r);
            ok = 0;
        }
done:
    for (int r = 0; r < P && r < 8; r++) {
        cpa_local_free(&L[r]);
        cudaFree(scratch[r]);
        cpa_host_free(&h[1][r]);
        if (out && ok) out[r] = h[0][r];
        else cpa_host_free(&h[0][r]);
    }
    return ok;
}

/* The all-gather case: each rank's two chunks (Tq = T) against the whole sequence's K/V (Tk = S). */
static int cpa_allgather_case(const cpa_full* f) {
    const int B = f->c.B, H = f->c.H, Hkv = f->c.Hkv, S = f->S, T = f->T, d = f->c.d, P = f->c.cp;
    const mt_dropout drop = cpa_dropout(f->c.p_drop, H);
    const size_t nk = (size_t)B * Hkv * S * d;
    bf16 *k = NULL, *v = NULL, *dkv = NULL;
    uint16_t* part[8] = {0};
    cpa_host h[8];
    cpa_local L;
    memset(h, 0, sizeof(h)), memset(&L, 0, sizeof(L));
    int ok = P <= 8;
    CPA_CUDA(cudaMalloc(&k, nk * 2));
    CPA_CUDA(cudaMalloc(&v, nk * 2));
    CPA_CUDA(cudaMalloc(&dkv, 2 * nk * 2));
    CPA_CUDA(cudaMemcpy(k, f->k, nk * 2, cudaMemcpyHostToDevice));
    CPA_CUDA(cudaMemcpy(v, f->v, nk * 2, cudaMemcpyHostToDevice));
    for (int r = 0; r < P && ok; r++) {
        ok = cpa_local_make(f, r, &L);
        if (!ok) break;
        const cpa_views lv = cpa_local_views(f, &L);
        const mt_seq_span qs = cp_chunk_span(r, P, f->c.C), all = {0, {0, 0}};
        attn_view vk = packed_heads_view(k, Hkv, S, d, 1), vv = packed_heads_view(v, Hkv, S, d, 1),
                  vdk = packed_heads_view(dkv, Hkv, S, d, 1), vdv = packed_heads_view(dkv + nk, Hkv, S, d, 1);
        CPA_CUDA(flash_attention_forward_span(lv.o, L.lse, cview(lv.q), cview(vk), cview(vv), B, H, Hkv, T, S, qs, all,
                                              S, d, 0, drop, L.doc));
        CPA_CUDA(flash_attention_backward_span(lv.dq, vdk, vdv, L.dsum, cview(lv.go), cview(lv.q), cview(vk),
                                               cview(vv), cview(lv.o), L.lse, B, H, Hkv, T, S, qs, all, S, d, 0, drop,
                                               L.doc));
        ok = cpa_fetch(f, &L, &h[r]);
        part[r] = (uint16_t*)malloc(2 * nk * 2);
        ok = ok && part[r];
        if (ok) CPA_CUDA(cudaMemcpy(part[r], dkv, 2 * nk * 2, cudaMemcpyDeviceToHost));
        cpa_local_free(&L);
    }
    ok = ok && cpa_compare(f, h, (const uint16_t* const*)part, "all-gather");
done:
    cpa_local_free(&L);
    cudaFree(k), cudaFree(v), cudaFree(dkv);
    for (int r = 0; r < 8; r++) cpa_host_free(&h[r]), free(part[r]);
    return ok;
}

static const cpa_case cpa_cases[] = {
    {2, 4, 2, 64, 128, 2, 0, 0.0},  /* GQA, d 64 (tiles of 128 rows), B 2 */
    {1, 4, 1, 128, 64, 4, 0, 0.0},  /* d 128, CP 4 (eight chunks of one tile) */
    {2, 4, 2, 64, 128, 4, 1, 0.0},  /* documents across the chunk boundaries */
    {1, 2, 2, 128, 128, 2, 1, 0.0}, /* documents, d 128, no GQA */
    {2, 4, 2, 64, 128, 2, 0, 0.2},  /* attention dropout: the whole sequence's masks */
    {1, 4, 2, 128, 64, 4, 1, 0.1},  /* dropout and documents at CP 4 */
};

static test_result test_cp_ring_simulated(void) {
    REQUIRE_GPU();
    for (size_t i = 0; i < sizeof(cpa_cases) / sizeof(cpa_cases[0]); i++) {
        cpa_full f;
        int ok = cpa_full_make(&cpa_cases[i], 1000 + i, &f) && cpa_simulated_case(&f, NULL);
        cpa_full_free(&f);
        if (!ok) return TEST_FAIL;
    }
    printf("      every case bitwise repeatable\n");
    return TEST_PASS;
}

/* The ring's compute on one GPU (no transfers): every rank's steps of CP = 2 at the Llama-3-8B attention shape
 * (B 1, H 32, Hkv 8, d 128), forward + backward, on section 9's steps and on section 13.4's, against one GPU's
 * whole attention on sections 13.2 / 13.3 (what CP = 1 runs). The ranks' work summed over t_1 is the ring's
 * per-GPU efficiency before communication (the bound the two-GPU ring can reach). Printed, a measurement;
 * inputs are a constant pattern (timing only: every tile is computed whatever the values). */
static int cpa_step_timing(mt_hopper_gemm_state* hs, int S) {
    const int B = 1, H = 32, Hkv = 8, d = 128, P = 2, T = S / P, qpg = H / Hkv;
    const size_t nq = (size_t)B * H * S * d, nk = (size_t)B * Hkv * S * d, nl = (size_t)B * H * S;
    const size_t bytes = (size_t)mt_cp_ring_scratch_bytes(B, H, Hkv, T, d);
    bf16 *q = NULL, *k = NULL, *v = NULL, *o = NULL, *go = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    float *lse = NULL, *dsum = NULL;
    void* scratch[2] = {NULL, NULL};
    cudaEvent_t e0 = NULL, e1 = NULL;
    double ms[3] = {0, 0, 0};
    int ok = 1;
    CPA_CUDA(cudaMalloc(&q, nq * 2));
    CPA_CUDA(cudaMalloc(&o, nq * 2));
    CPA_CUDA(cudaMalloc(&go, nq * 2));
    CPA_CUDA(cudaMalloc(&dq, nq * 2));
    CPA_CUDA(cudaMalloc(&k, nk * 2));
    CPA_CUDA(cudaMalloc(&v, nk * 2));
    CPA_CUDA(cudaMalloc(&dk, nk * 2));
    CPA_CUDA(cudaMalloc(&dv, nk * 2));
    CPA_CUDA(cudaMalloc(&lse, nl * 4));
    CPA_CUDA(cudaMalloc(&dsum, nl * 4));
    for (int r = 0; r < P; r++) CPA_CUDA(cudaMalloc(&scratch[r], bytes));
    CPA_CUDA(cudaMemset(q, 0x3C, nq * 2));
    CPA_CUDA(cudaMemset(go, 0x3C, nq * 2));
    CPA_CUDA(cudaMemset(k, 0x3D, nk * 2));
    CPA_CUDA(cudaMemset(v, 0x3C, nk * 2));
    CPA_CUDA(cudaEventCreate(&e0));
    CPA_CUDA(cudaEventCreate(&e1));
    for (int which = 0; which < 3; which++) { /* 0: one GPU, 1: ring on section 9's steps, 2: on the Hopper steps */
        float times[6];
        for (int it = 0; it < 6; it++) {
            CPA_CUDA(cudaEventRecord(e0, 0));
            if (which == 0) {
                const attn_view vq = packed_heads_view(q, H, S, d, qpg), vo = packed_heads_view(o, H, S, d, qpg),
                                vg = packed_heads_view(go, H, S, d, qpg), vdq = packed_heads_view(dq, H, S, d, qpg),
                                vk = packed_heads_view(k, Hkv, S, d, 1), vv = packed_heads_view(v, Hkv, S, d, 1),
                                vdk = packed_heads_view(dk, Hkv, S, d, 1), vdv = packed_heads_view(dv, Hkv, S, d, 1);
                CPA_CUDA(hopper_attention_forward(hs, vo, lse, cview(vq), cview(vk), cview(vv), B, H, Hkv, S, d, 0));
                CPA_CUDA(hopper_attention_backward(hs, vdq, vdk, vdv, dsum, cview(vg), cview(vq), cview(vk), cview(vv),
                                                   cview(vo), lse, B, H, Hkv, S, d, 0));
            } else {
                /* rank r's rows are rows r T .. (r + 1) T of each head; its K/V block is its own rows; its LSE
                 * and Dsum [B, H, T] the r-th half of the buffers */
                cp_ring_scratch sc[2];
                for (int r = 0; r < P; r++) sc[r] = cp_scratch_layout(scratch[r], B, H, Hkv, T, d);
                auto rows = [&](bf16* p, int heads, int r) {
                    return cp_rows(packed_heads_view(p, heads, S, d, heads == H ? qpg : 1), r * T);
                };
                for (int pass = 0; pass < 2; pass++) /* forward steps, then backward steps */
                    for (int i = 0; i < P; i++)
                        for (int r = 0; r < P; r++) {
                            const int j = (r - i + P) % P, first = i == 0, last = i == P - 1;
                            const attn_view vq = rows(q, H, r), vo = rows(o, H, r), vg = rows(go, H, r),
                                            vdq = rows(dq, H, r), vk = rows(k, Hkv, j), vv = rows(v, Hkv, j);
                            if (pass == 0 && which == 2)
                                CPA_CUDA(cp_fast_forward_step(hs, vo, lse + (size_t)r * H * T, sc[r], first, last,
                                                              cview(vq), cview(vk), cview(vv), B, H, Hkv, T, r, j, d, 0));
                            else if (pass == 0)
                                CPA_CUDA(cp_attention_forward_block(vo, lse + (size_t)r * H * T, sc[r].acc, first, last,
                                                                    cview(vq), cview(vk), cview(vv), B, H, Hkv, T, r, j,
                                                                    P, d, 0));
                            else if (which == 2) {
                                CPA_CUDA(cp_fast_backward_step(hs, vdq, sc[r], first, last, cview(vg), cview(vq),
                                                               cview(vk), cview(vv), lse + (size_t)r * H * T,
                                                               dsum + (size_t)r * H * T, B, H, Hkv, T, r, j, d, 0));
                                CPA_CUDA(cp_fast_backward_add(sc[r], first ? NULL : sc[j].dkv[0], sc[j].dkv[0], B, Hkv,
                                                              T, r, j, d, 0));
                            } else {
                                CPA_CUDA(cp_attention_backward_block(2, vdq, sc[r].acc, first, last, NULL, NULL,
                                                                     cview(vg), cview(vq), cview(vk), cview(vv),
                                                                     lse + (size_t)r * H * T, dsum + (size_t)r * H * T,
                                                                     B, H, Hkv, T, r, j, P, d, 0));
                                CPA_CUDA(cp_attention_backward_block(1, vdq, sc[r].acc, first, last,
                                                                     first ? NULL : sc[j].dkv[0], sc[j].dkv[0],
                                                                     cview(vg), cview(vq), cview(vk), cview(vv),
                                                                     lse + (size_t)r * H * T, dsum + (size_t)r * H * T,
                                                                     B, H, Hkv, T, r, j, P, d, 0));
                            }
                        }
            }
            CPA_CUDA(cudaEventRecord(e1, 0));
            CPA_CUDA(cudaEventSynchronize(e1));
            CPA_CUDA(cudaEventElapsedTime(&times[it], e0, e1));
        }
        std::sort(times + 1, times + 6);
        ms[which] = times[3];
    }
    printf("      compute of CP=2 on one GPU, B=1 H=32 Hkv=8 d=128 S=%d: one GPU %.2f ms fwd+bwd; both ranks' steps "
           "%.2f ms on section 9's kernels (efficiency %.0f%%), %.2f ms on the Hopper steps (%.0f%%)\n",
           S, ms[0], ms[1], 100.0 * ms[0] / ms[1], ms[2], 100.0 * ms[0] / ms[2]);
done:
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(go), cudaFree(dq), cudaFree(dk), cudaFree(dv);
    cudaFree(lse), cudaFree(dsum), cudaFree(scratch[0]), cudaFree(scratch[1]);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    return ok;
}

/* The same on section 13.4's Hopper steps: the cases without dropout or documents (those stay on section 9's
 * steps), and a larger one where the rows are several 128-row tiles (C = 320 at d = 128: partial tiles). Then
 * the compute-only timing above at 16k and 32k tokens. */
static test_result test_cp_ring_simulated_hopper(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_attention_backward_available, &probe, "the Hopper attention kernels");
    EXPECT(cp_fast_wanted(&probe, true, 128, mt_dropout(), NULL) && cp_fast_wanted(&probe, false, 64, mt_dropout(), NULL),
           "the Hopper steps are not wanted where they run");
    const cpa_case cases[] = {
        cpa_cases[0],
        cpa_cases[1],
        {1, 8, 2, 128, 320, 2, 0, 0.0}, /* GQA 4, C = 2.5 tiles of 128 */
        {2, 2, 1, 64, 256, 4, 0, 0.0},  /* d 64, CP 4, MQA */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cpa_full f;
        int ok = cpa_full_make(&cases[i], 3000 + i, &f) && cpa_simulated_case(&f, NULL, &probe);
        cpa_full_free(&f);
        if (!ok) return TEST_FAIL;
    }
    printf("      every case bitwise repeatable\n");
    if (!cpa_step_timing(&probe, 16384) || !cpa_step_timing(&probe, 32768)) return TEST_FAIL;
    return TEST_PASS;
}

/* Dropout must be on in the dropout cases (the whole-sequence kernel's O with and without it differs),
 * else the dropout cases above prove nothing. */
static test_result test_cp_dropout_is_drawn(void) {
    REQUIRE_GPU();
    cpa_case c = cpa_cases[4];
    cpa_full a, b;
    memset(&b, 0, sizeof(b));
    int ok = cpa_full_make(&c, 77, &a);
    c.p_drop = 0.0;
    ok = ok && cpa_full_make(&c, 77, &b);
    size_t differ = 0, n = (size_t)c.B * c.H * a.S * c.d;
    for (size_t i = 0; ok && i < n; i++) differ += a.o[i] != b.o[i];
    cpa_full_free(&a), cpa_full_free(&b);
    EXPECT(ok, "the whole-sequence kernels");
    EXPECT(differ > n / 2, "attention dropout changed only %zu of %zu outputs", differ, n);
    return TEST_PASS;
}

static test_result test_cp_allgather_span(void) {
    REQUIRE_GPU();
    for (size_t i = 0; i < sizeof(cpa_cases) / sizeof(cpa_cases[0]); i++) {
        cpa_full f;
        int ok = cpa_full_make(&cpa_cases[i], 2000 + i, &f) && cpa_allgather_case(&f);
        cpa_full_free(&f);
        if (!ok) return TEST_FAIL;
    }
    return TEST_PASS;
}

/* Slices that are not whole tiles are refused (the caller falls back or refuses), as are spans whose
 * positions leave the sequence. */
static test_result test_cp_refuses_partial_tiles(void) {
    REQUIRE_GPU();
    bf16* p = NULL;
    float* l = NULL;
    EXPECT(cudaMalloc(&p, (size_t)4 << 20) == cudaSuccess && cudaMalloc(&l, (size_t)1 << 20) == cudaSuccess, "alloc");
    const attn_view v = packed_heads_view(p, 1, 1024, 64, 1);
    const mt_seq_span all = {0, {0, 0}};
    struct {
        int Tq, Tk, d, seq;
        mt_seq_span qs, ks;
        bool ok;
    } cases[] = {
        {256, 512, 64, 512, {128, {0, 384}}, all, true},    /* chunks of one 128-row tile */
        {128, 512, 64, 512, {64, {0, 448}}, all, false},    /* 64-row chunks at d = 64 */
        {128, 512, 128, 512, {64, {0, 448}}, all, true},    /* ... are whole tiles at d = 128 */
        {256, 256, 64, 512, {128, {0, 448}}, all, false},   /* chunk 2 runs past the sequence */
        {256, 256, 64, 512, {128, {256, 128}}, all, false}, /* positions must grow with the row */
        {200, 200, 64, 400, all, all, false},               /* a slice that is not whole tiles */
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cudaError_t e = flash_attention_forward_span(v, l, cview(v), cview(v), cview(v), 1, 1, 1, cases[i].Tq,
                                                     cases[i].Tk, cases[i].qs, cases[i].ks, cases[i].seq, cases[i].d,
                                                     0);
        if ((e == cudaSuccess) != cases[i].ok) {
            printf("    FAIL case %zu: %s\n", i, cudaGetErrorString(e));
            ok = 0;
        }
    }
    cudaError_t sync = cudaDeviceSynchronize();
    cudaFree(p), cudaFree(l);
    EXPECT(ok && sync == cudaSuccess, "span checks");
    return TEST_PASS;
}

/* ---- multi-GPU: the real ring over NCCL ---- */
#ifdef MT_USE_MPI

/* One CP group of cp consecutive ranks: its MPI communicator, NCCL communicator and ring. */
typedef struct {
    MPI_Comm mpi;
    ncclComm_t nccl;
    mt_cp_ring ring;
} cpa_group;

static int cpa_group_make(int cp, cpa_group* g) {
    memset(g, 0, sizeof(*g));
    const int rank = mpi_rank();
    MPI_Comm_split(MPI_COMM_WORLD, rank / cp, rank % cp, &g->mpi);
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (rank % cp == 0 && ncclGetUniqueId(&id) != ncclSuccess) printf("    ncclGetUniqueId failed\n");
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, g->mpi);
    ncclResult_t nr = ncclCommInitRank(&g->nccl, cp, id, rank % cp);
    if (nr != ncclSuccess) {
        printf("    FAIL ncclCommInitRank: %s\n", ncclGetErrorString(nr));
        return 0;
    }
    mt_gpu_error e;
    memset(&e, 0, sizeof(e));
    if (!cp_ring_create(&g->ring, g->nccl, rank % cp, cp, rank, &e)) {
        printf("    FAIL cp_ring_create: %s\n", e.error.message);
        return 0;
    }
    return 1;
}
static void cpa_group_free(cpa_group* g) {
    cp_ring_destroy(&g->ring);
    if (g->nccl) ncclCommDestroy(g->nccl);
    if (g->mpi != MPI_COMM_NULL && g->mpi) MPI_Comm_free(&g->mpi);
    memset(g, 0, sizeof(*g));
}

/* The real ring on this rank against the simulation of every rank (on this GPU) and the whole sequence.
 * hs: both on section 13.4's Hopper steps. */
static int cpa_ring_case(const cpa_case* c, cpa_group* g, uint64_t seed, mt_hopper_gemm_state* hs = NULL) {
    cpa_full f;
    cpa_host sim[8], mine;
    cpa_local L;
    memset(sim, 0, sizeof(sim)), memset(&mine, 0, sizeof(mine)), memset(&L, 0, sizeof(L));
    void* scratch = NULL;
    cudaStream_t st = NULL;
    const int r = g->ring.rank;
    int ok = cpa_full_make(c, seed, &f) && cpa_simulated_case(&f, sim, hs);
    const size_t bytes = ok ? (size_t)mt_cp_ring_scratch_bytes(c->B, c->H, c->Hkv, f.T, c->d) : 0;
    ok = ok && cpa_local_make(&f, r, &L);
    if (!ok) goto done;
    CPA_CUDA(cudaMalloc(&scratch, bytes));
    CPA_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int run = 0; run < 2 && ok; run++) {
        mt_gpu_error err;
        memset(&err, 0, sizeof(err));
        mt_exec ex;
        memset(&ex, 0, sizeof(ex));
        ex.stream = st, ex.error = &err;
        const cpa_views v = cpa_local_views(&f, &L);
        const mt_dropout drop = cpa_dropout(c->p_drop, c->H);
        CPA_CUDA(cudaMemset(L.o, 0xFF, (size_t)c->B * f.T * c->H * c->d * 2));
        CPA_CUDA(cudaMemset(L.dqkv, 0xFF, (size_t)c->B * f.T * f.W * 2));
        if (!cp_ring_attention_forward(&ex, &g->ring, v.o, L.lse, cview(v.q), cview(v.k), cview(v.v), c->B, c->H,
                                       c->Hkv, f.T, c->d, drop, L.doc, scratch, bytes, hs) ||
            !cp_ring_attention_backward(&ex, &g->ring, v.dq, v.dk, v.dv, L.dsum, cview(v.go), cview(v.q), cview(v.k),
                                        cview(v.v), cview(v.o), L.lse, c->B, c->H, c->Hkv, f.T, c->d, drop, L.doc,
                                        scratch, bytes, hs)) {
            printf("    FAIL the ring: %s\n", err.error.message);
            ok = 0;
            break;
        }
        CPA_CUDA(cudaStreamSynchronize(st));
        cpa_host_free(&mine);
        ok = cpa_fetch(&f, &L, &mine);
        if (ok && !cpa_host_equal(&f, &mine, &sim[r])) {
            printf("    FAIL CP rank %d: the ring over NCCL differs from its simulation on one GPU (run %d)\n", r, run);
            ok = 0;
        }
    }
    if (ok)
        printf("      CP=%d rank %d: the ring over NCCL == the simulated ring, bitwise, twice (B=%d H=%d Hkv=%d d=%d "
               "C=%d%s%s%s)\n",
               c->cp, r, c->B, c->H, c->Hkv, c->d, c->C, c->docs ? " documents" : "", c->p_drop > 0 ? " dropout" : "",
               hs ? ", Hopper steps" : "");
done:
    if (st) cudaStreamDestroy(st);
    cudaFree(scratch);
    cpa_local_free(&L);
    cpa_host_free(&mine);
    for (int i = 0; i < 8; i++) cpa_host_free(&sim[i]);
    cpa_full_free(&f);
    return ok;
}

/* Forward + backward milliseconds (median of 5 after a warm-up): the ring at this group's CP over S/CP
 * local rows, and one GPU's whole attention over S rows; hs: both on the Hopper kernels (the ring's steps
 * of section 13.4, one GPU's sections 13.2 / 13.3), else on section 9's. */
static int cpa_timing(cpa_group* g, mt_hopper_gemm_state* hs = NULL) {
    const int B = 1, H = 32, Hkv = 8, d = 128, S = 16384, cp = g->ring.size, T = S / cp, qpg = H / Hkv;
    const int W = Hkv * (qpg + 2) * d;
    bf16 *qkv = NULL, *dqkv = NULL, *o = NULL, *go = NULL;
    float *lse = NULL, *dsum = NULL;
    void* scratch = NULL;
    cudaStream_t st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    uint16_t* h = NULL;
    const size_t bytes = (size_t)mt_cp_ring_scratch_bytes(B, H, Hkv, T, d);
    double ms[2] = {0, 0};
    int ok = 1;
    CPA_CUDA(cudaMalloc(&qkv, (size_t)S * W * 2));
    CPA_CUDA(cudaMalloc(&dqkv, (size_t)S * W * 2));
    CPA_CUDA(cudaMalloc(&o, (size_t)S * H * d * 2));
    CPA_CUDA(cudaMalloc(&go, (size_t)S * H * d * 2));
    CPA_CUDA(cudaMalloc(&lse, (size_t)H * S * 4));
    CPA_CUDA(cudaMalloc(&dsum, (size_t)H * S * 4));
    CPA_CUDA(cudaMalloc(&scratch, bytes));
    CPA_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CPA_CUDA(cudaEventCreate(&e0));
    CPA_CUDA(cudaEventCreate(&e1));
    h = (uint16_t*)malloc((size_t)S * W * 2);
    if (!h) {
        ok = 0;
        goto done;
    }
    {
        uint64_t s = 99 + (uint64_t)mpi_rank();
        for (size_t i = 0; i < (size_t)S * W; i++) h[i] = cpa_rand_bf16(&s, 1.0f);
        CPA_CUDA(cudaMemcpy(qkv, h, (size_t)S * W * 2, cudaMemcpyHostToDevice));
        CPA_CUDA(cudaMemcpy(go, h, (size_t)S * H * d * 2, cudaMemcpyHostToDevice));
    }
    for (int which = 0; which < 2; which++) { /* 0: the ring at T rows per rank; 1: one GPU, S rows */
        const int rows = which ? S : T;
        attn_view q = qkv_rows_view(qkv, rows, Hkv, d, qpg, 0), k = qkv_rows_view(qkv, rows, Hkv, d, qpg, qpg),
                  v = qkv_rows_view(qkv, rows, Hkv, d, qpg, qpg + 1), dq = qkv_rows_view(dqkv, rows, Hkv, d, qpg, 0),
                  dk = qkv_rows_view(dqkv, rows, Hkv, d, qpg, qpg), dv = qkv_rows_view(dqkv, rows, Hkv, d, qpg, qpg + 1),
                  vo = attention_rows_view(o, rows, H, d, qpg), vgo = attention_rows_view(go, rows, H, d, qpg);
        float times[6];
        for (int it = 0; it < 6; it++) {
            mt_gpu_error err;
            memset(&err, 0, sizeof(err));
            mt_exec ex;
            memset(&ex, 0, sizeof(ex));
            ex.stream = st, ex.error = &err;
            CPA_CUDA(cudaStreamSynchronize(st));
            MPI_Barrier(g->mpi);
            CPA_CUDA(cudaEventRecord(e0, st));
            if (which == 0) {
                if (!cp_ring_attention_forward(&ex, &g->ring, vo, lse, cview(q), cview(k), cview(v), B, H, Hkv, T, d,
                                               mt_dropout(), NULL, scratch, bytes, hs) ||
                    !cp_ring_attention_backward(&ex, &g->ring, dq, dk, dv, dsum, cview(vgo), cview(q), cview(k),
                                                cview(v), cview(vo), lse, B, H, Hkv, T, d, mt_dropout(), NULL, scratch,
                                                bytes, hs)) {
                    printf("    FAIL the ring: %s\n", err.error.message);
                    ok = 0;
                    goto done;
                }
            } else if (hs) {
                CPA_CUDA(hopper_attention_forward(hs, vo, lse, cview(q), cview(k), cview(v), B, H, Hkv, S, d, st));
                CPA_CUDA(hopper_attention_backward(hs, dq, dk, dv, dsum, cview(vgo), cview(q), cview(k), cview(v),
                                                   cview(vo), lse, B, H, Hkv, S, d, st));
            } else {
                CPA_CUDA(flash_attention_forward(vo, lse, cview(q), cview(k), cview(v), B, H, Hkv, S, d, st));
                CPA_CUDA(flash_attention_backward(dq, dk, dv, dsum, cview(vgo), cview(q), cview(k), cview(v),
                                                  cview(vo), lse, B, H, Hkv, S, d, st));
            }
            CPA_CUDA(cudaEventRecord(e1, st));
            CPA_CUDA(cudaEventSynchronize(e1));
            CPA_CUDA(cudaEventElapsedTime(&times[it], e0, e1));
        }
        std::sort(times + 1, times + 6);
        double t = times[3], worst = 0.0;
        MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, g->mpi); /* the ring is as fast as its slowest rank */
        ms[which] = worst;
    }
    printf("      timing B=%d H=%d Hkv=%d d=%d S=%d (%s): ring at CP=%d %.2f ms fwd+bwd per rank, one GPU %.2f ms: "
           "per-GPU efficiency %.0f%% (the issue's target >= 90%%)\n",
           B, H, Hkv, d, S, hs ? "Hopper kernels" : "section 9's kernels", cp, ms[0], ms[1], 100.0 * ms[1] / (cp * ms[0]));
done:
    if (st) cudaStreamDestroy(st);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(qkv), cudaFree(dqkv), cudaFree(o), cudaFree(go), cudaFree(lse), cudaFree(dsum), cudaFree(scratch);
    free(h);
    return ok;
}
#endif

static test_result test_cp_ring_nccl(void) {
    REQUIRE_MPI_GPUS();
#ifndef MT_USE_MPI
    SKIP(TEST_SKIP_NO_MPI);
#else
    int ngpu = 0;
    cudaGetDeviceCount(&ngpu);
    cudaSetDevice(mpi_local_rank() % (ngpu > 0 ? ngpu : 1));
    const int world = mpi_world();
    const int cps[2] = {2, world};
    int ok = 1;
    for (int n = 0; n < 2 && ok; n++) {
        const int cp = cps[n];
        if ((n == 1 && cp == 2) || world % cp != 0 || cp > 8) continue;
        cpa_group g;
        ok = cpa_group_make(cp, &g);
        for (size_t i = 0; ok && i < sizeof(cpa_cases) / sizeof(cpa_cases[0]); i++) {
            cpa_case c = cpa_cases[i];
            c.cp = cp;
            ok = cpa_ring_case(&c, &g, 3000 + i);
        }
        ok = ok && cpa_timing(&g);
        /* the Hopper steps where they run: cases without dropout or documents, and their timing */
        mt_hopper_gemm_state probe;
        memset(&probe, 0, sizeof(probe));
        if (ok && cp_fast_wanted(&probe, true, 128, mt_dropout(), NULL)) {
            for (size_t i = 0; ok && i < sizeof(cpa_cases) / sizeof(cpa_cases[0]); i++) {
                cpa_case c = cpa_cases[i];
                if (c.docs || c.p_drop > 0) continue;
                c.cp = cp;
                ok = cpa_ring_case(&c, &g, 4000 + i, &probe);
            }
            ok = ok && cpa_timing(&g, &probe);
        }
        cpa_group_free(&g);
    }
    return ok ? TEST_PASS : TEST_FAIL;
#endif
}

static const test_case cp_attention_gpu_tests[] = {
    {"cp_ring_simulated_matches_full_attention", test_cp_ring_simulated},
    {"cp_ring_simulated_hopper_matches_full_attention", test_cp_ring_simulated_hopper},
    {"cp_dropout_is_drawn", test_cp_dropout_is_drawn},
    {"cp_allgather_span_matches_full_attention", test_cp_allgather_span},
    {"cp_refuses_partial_tiles", test_cp_refuses_partial_tiles},
};
static const test_case cp_attention_multigpu_tests[] = {
    {"cp_ring_nccl_matches_simulation_and_full", test_cp_ring_nccl},
};

#endif
