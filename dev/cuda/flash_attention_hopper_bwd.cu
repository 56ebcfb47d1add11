/*
 * dev/cuda/flash_attention_hopper_bwd.cu — the lab of megatron.cu section 13.3, the Hopper (sm_90a,
 * FlashAttention-3 style) causal bf16 attention backward: TMA tile loads, wgmma products, mbarrier
 * pipelines, warp specialisation; a dK/dV kernel and a dQ kernel (deterministic, no atomics).
 *
 * It includes megatron.cu whole and drives the library's launchers: hopper_attention_backward (ours, with
 * hg::options: the watchdog record, 4 s waits) and flash_attention_backward (section 9's FA2 backward, the
 * baseline); the forward that makes O and LSE is section 9's flash_attention_forward. The kernels, their
 * design (products, roles, shared memory, descriptors, numerics) and the probe live in megatron.cu, once.
 *
 * Build from the repository root (sm_90a is required: wgmma and setmaxnreg exist only there):
 *   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o flash_attention_hopper_bwd dev/cuda/flash_attention_hopper_bwd.cu -lcublas -lcublasLt -lnccl
 *   ./flash_attention_hopper_bwd           staged checks, then the benchmark (no benchmark if a check fails; exit 1)
 *   ./flash_attention_hopper_bwd --check   checks only
 *   ./flash_attention_hopper_bwd --bench   benchmark only
 *
 * ---- Stages (each says what a failure points at) ----------------------------------------------------
 *   1 float64 CPU reference of dQ, dK, dV on small shapes (T below, at and across the 64/128-row tiles,
 *     GQA and MHA, d 64 and 128): per element |got - want| <= 2^-4 (|want| + rms(want)) + 2^-20 (see compare:
 *     measured on an H200, FA2's own backward needs it) and norm-wise
 *     ||got - want|| / ||want|| <= 2e-2. Why these: the kernels round P and dS to bf16 (relative 2^-9)
 *     before their products and each gradient to bf16 once (2^-9), and Dsum uses the bf16 O; summed over
 *     up to T terms the rounding stays below 2^-4 of the tensor's scale, while a wrong mask, a missing
 *     tile or a swapped operand is an error of the order of rms itself. 2e-2 norm-wise is section 9's
 *     own check (dev/cuda/flash_attention.cu). The reference takes O and LSE exactly (float64 softmax),
 *     so it also bounds the FA2 forward's rounding that both backwards read.
 *   2 against section 9's FA2 backward on the same O, LSE: T in {1, 100, 128, 1000, 4096}, d in {64, 128},
 *     B 2, H 8 with Hkv 2 (GQA) and 8 (MHA): the same per-element and norm-wise bounds (both are
 *     approximations of one value to bf16 accuracy; their summation orders differ, so not bitwise).
 *   3 bitwise repeat: ours twice on the same inputs gives the same bits (outputs set to NaN before each).
 *   4 layouts: the fused QKV rows [B*T, Hkv*(qpg+2)*d] read and written in place (the model's layout)
 *     give bitwise the packed layout's result (the same kernels, the same sums; only the maps differ).
 *   Outputs are filled with 0xFF (NaN) before every run: an element not written fails every stage.
 *
 * ---- Watchdogs ----------------------------------------------------------------------------------------
 *   The library's bounded mbarrier waits report into an hg::watchdog in mapped pinned host memory (role
 *   0 producer waiting for a free stage, 1 consumer waiting for a full stage; which barrier; the tile;
 *   the iteration) and trap after 4 s; the host also polls the stream with a 60 s limit after each run.
 *
 * ---- Benchmark ------------------------------------------------------------------------------------------
 *   B * T = 32768 tokens, H 32, Hkv 8, T in {4k, 8k, 16k, 32k}, d 64 and 128; CUDA events, median of
 *   20 repeats after 3 warm-ups. Causal FLOPs: forward 4 B H T^2 d / 2, backward 2.5x that. Printed:
 *   backward ms and TFLOP/s for ours and FA2 (Dsum included in both), and fwd+bwd TFLOP/s with the
 *   forward each backward would run beside (FA2's forward; section 13.2's at d = 128 where it runs).
 */
#include <cuda.h> // CUtensorMap and its enums (types only; no -lcuda)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#include <chrono>
#include <thread>

#include "../../megatron.cu"

// ---- Errors and watchdogs --------------------------------------------------------------------------------
static hg::watchdog* g_wd_host = nullptr; // the lab's one piece of global state: read by the error path

static void print_watchdog() {
    if (g_wd_host && g_wd_host->fired)
        fprintf(stderr, "device watchdog fired: block %d thread %d %s, barrier %d (0 K/V or Q/dO full, 1 stage full, "
                        "2 stage empty, 3 stage empty for LSE/Dsum) parity %d tile %d iteration %d\n",
                g_wd_host->block, g_wd_host->thread, g_wd_host->role == 0 ? "producer" : "consumer", g_wd_host->stage,
                g_wd_host->parity, g_wd_host->tile, g_wd_host->kb);
}
static void die_cuda(cudaError_t e, const char* what, int line) {
    fprintf(stderr, "CUDA error %s (%s) at flash_attention_hopper_bwd.cu:%d: %s\n", cudaGetErrorName(e),
            cudaGetErrorString(e), line, what);
    print_watchdog();
    exit(1);
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) die_cuda(e_, #x, __LINE__); } while (0)

static void sync_or_die(const char* what, double limit_s = 60.0) {
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        cudaError_t e = cudaStreamQuery(0);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) die_cuda(e, what, __LINE__);
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s > limit_s) {
            fprintf(stderr, "host watchdog: '%s' still running after %.0f s (deadlock?); exiting\n", what, s);
            print_watchdog();
            exit(3);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

// ---- bf16 on the host ---------------------------------------------------------------------------------
static uint16_t f2bf(float f) { // round to nearest even
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static double bf2d(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float urand() { // uniform in [-1, 1)
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

// ---- One problem: packed tensors on the device, host copies -------------------------------------------
struct Shape {
    int B, H, Hkv, T, d;
};
struct Problem {
    Shape s;
    size_t nq, nk, nl; // elements of Q-like [B,H,T,d], K-like [B,Hkv,T,d], LSE-like [B,H,T]
    std::vector<uint16_t> hq, hk, hv, hdo;
    bf16 *q, *k, *v, *o, *dO, *dq, *dk, *dv;
    float *lse, *dsum;
};
static attn_view qview(bf16* p, const Shape& s) { return packed_heads_view(p, s.H, s.T, s.d, s.H / s.Hkv); }
static attn_view kview(bf16* p, const Shape& s) { return packed_heads_view(p, s.Hkv, s.T, s.d, 1); }

static void fill(std::vector<uint16_t>& v, size_t n, float amp) {
    v.resize(n);
    for (size_t i = 0; i < n; i++) v[i] = f2bf(amp * urand());
}
static Problem make_problem(const Shape& s) {
    Problem p;
    p.s = s;
    p.nq = (size_t)s.B * s.H * s.T * s.d, p.nk = (size_t)s.B * s.Hkv * s.T * s.d, p.nl = (size_t)s.B * s.H * s.T;
    fill(p.hq, p.nq, 1.7f), fill(p.hk, p.nk, 1.7f), fill(p.hv, p.nk, 1.0f), fill(p.hdo, p.nq, 1.0f);
    CK(cudaMalloc(&p.q, p.nq * 2)); CK(cudaMalloc(&p.o, p.nq * 2)); CK(cudaMalloc(&p.dO, p.nq * 2));
    CK(cudaMalloc(&p.dq, p.nq * 2)); CK(cudaMalloc(&p.k, p.nk * 2)); CK(cudaMalloc(&p.v, p.nk * 2));
    CK(cudaMalloc(&p.dk, p.nk * 2)); CK(cudaMalloc(&p.dv, p.nk * 2));
    CK(cudaMalloc(&p.lse, p.nl * 4)); CK(cudaMalloc(&p.dsum, p.nl * 4));
    CK(cudaMemcpy(p.q, p.hq.data(), p.nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.k, p.hk.data(), p.nk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.v, p.hv.data(), p.nk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.dO, p.hdo.data(), p.nq * 2, cudaMemcpyHostToDevice));
    CK(flash_attention_forward(qview(p.o, s), p.lse, cview(qview(p.q, s)), cview(kview(p.k, s)), cview(kview(p.v, s)),
                               s.B, s.H, s.Hkv, s.T, s.d, 0));
    sync_or_die("forward");
    return p;
}
static void free_problem(Problem& p) {
    cudaFree(p.q), cudaFree(p.k), cudaFree(p.v), cudaFree(p.o), cudaFree(p.dO), cudaFree(p.dq), cudaFree(p.dk);
    cudaFree(p.dv), cudaFree(p.lse), cudaFree(p.dsum);
}

static mt_hopper_gemm_state g_probe = {0, 0, NULL, 0, 0};
static hg::options lab_options() {
    hg::options o;
    o.variant = -1;
    o.max_ctas = 0;
    o.wd = nullptr;
    CK(cudaHostGetDevicePointer((void**)&o.wd, g_wd_host, 0));
    o.timeout_ns = 4000000000ull;
    return o;
}
// ours (fa3 true) or section 9's backward into p.dq, p.dk, p.dv (filled with NaN first); results to the host
struct Grads {
    std::vector<uint16_t> dq, dk, dv;
};
static Grads run_backward(Problem& p, bool fa3, int max_ctas = 0) {
    const Shape& s = p.s;
    CK(cudaMemset(p.dq, 0xFF, p.nq * 2)); CK(cudaMemset(p.dk, 0xFF, p.nk * 2)); CK(cudaMemset(p.dv, 0xFF, p.nk * 2));
    const attn_view dq = qview(p.dq, s), dk = kview(p.dk, s), dv = kview(p.dv, s);
    const attn_cview dO = cview(qview(p.dO, s)), q = cview(qview(p.q, s)), k = cview(kview(p.k, s)),
                     v = cview(kview(p.v, s)), o = cview(qview(p.o, s));
    if (fa3) {
        hg::options opt = lab_options();
        opt.max_ctas = max_ctas;
        CK(hopper_attention_backward(&g_probe, dq, dk, dv, p.dsum, dO, q, k, v, o, p.lse, s.B, s.H, s.Hkv, s.T, s.d, 0,
                                     &opt));
    } else {
        CK(flash_attention_backward(dq, dk, dv, p.dsum, dO, q, k, v, o, p.lse, s.B, s.H, s.Hkv, s.T, s.d, 0));
    }
    sync_or_die(fa3 ? "hopper_attention_backward" : "flash_attention_backward");
    Grads g;
    g.dq.resize(p.nq), g.dk.resize(p.nk), g.dv.resize(p.nk);
    CK(cudaMemcpy(g.dq.data(), p.dq, p.nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g.dk.data(), p.dk, p.nk * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(g.dv.data(), p.dv, p.nk * 2, cudaMemcpyDeviceToHost));
    return g;
}

// ---- float64 CPU reference: P = softmax(scale Q K^T) causal, O = P V, dP = dO V^T, dS = P (dP - rowsum(dO O)),
// dQ = scale dS K, dK = scale dS^T Q (summed over the group's heads), dV = P^T dO (likewise) ----
struct Ref {
    std::vector<double> dq, dk, dv;
};
static Ref cpu_reference(const Problem& p) {
    const Shape& s = p.s;
    const int T = s.T, d = s.d, qpg = s.H / s.Hkv;
    const double scale = 1.0 / sqrt((double)d);
    Ref r;
    r.dq.assign(p.nq, 0.0), r.dk.assign(p.nk, 0.0), r.dv.assign(p.nk, 0.0);
    std::vector<double> P((size_t)T * T), dS((size_t)T * T), o(d);
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++) {
            const int hk = h / qpg;
            const uint16_t* Q = p.hq.data() + ((size_t)b * s.H + h) * T * d;
            const uint16_t* dO = p.hdo.data() + ((size_t)b * s.H + h) * T * d;
            const uint16_t* K = p.hk.data() + ((size_t)b * s.Hkv + hk) * T * d;
            const uint16_t* V = p.hv.data() + ((size_t)b * s.Hkv + hk) * T * d;
            for (int i = 0; i < T; i++) {
                double m = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    double x = 0;
                    for (int e = 0; e < d; e++) x += bf2d(Q[(size_t)i * d + e]) * bf2d(K[(size_t)j * d + e]);
                    P[(size_t)i * T + j] = x * scale;
                    m = std::max(m, x * scale);
                }
                double l = 0;
                for (int j = 0; j <= i; j++) l += (P[(size_t)i * T + j] = exp(P[(size_t)i * T + j] - m));
                for (int j = 0; j <= i; j++) P[(size_t)i * T + j] /= l;
                std::fill(o.begin(), o.end(), 0.0);
                for (int j = 0; j <= i; j++)
                    for (int e = 0; e < d; e++) o[e] += P[(size_t)i * T + j] * bf2d(V[(size_t)j * d + e]);
                double D = 0;
                for (int e = 0; e < d; e++) D += bf2d(dO[(size_t)i * d + e]) * o[e];
                for (int j = 0; j <= i; j++) {
                    double dp = 0;
                    for (int e = 0; e < d; e++) dp += bf2d(dO[(size_t)i * d + e]) * bf2d(V[(size_t)j * d + e]);
                    dS[(size_t)i * T + j] = P[(size_t)i * T + j] * (dp - D);
                }
            }
            double* dq = r.dq.data() + ((size_t)b * s.H + h) * T * d;
            double* dk = r.dk.data() + ((size_t)b * s.Hkv + hk) * T * d;
            double* dv = r.dv.data() + ((size_t)b * s.Hkv + hk) * T * d;
            for (int i = 0; i < T; i++)
                for (int j = 0; j <= i; j++) {
                    const double ds = dS[(size_t)i * T + j] * scale, pp = P[(size_t)i * T + j];
                    for (int e = 0; e < d; e++) {
                        dq[(size_t)i * d + e] += ds * bf2d(K[(size_t)j * d + e]);
                        dk[(size_t)j * d + e] += ds * bf2d(Q[(size_t)i * d + e]);
                        dv[(size_t)j * d + e] += pp * bf2d(dO[(size_t)i * d + e]);
                    }
                }
        }
    return r;
}

// ---- Comparisons ------------------------------------------------------------------------------------------
// worst per-element excess over the bound 2^-4 (|want| + rms(want)) + 2^-20 (<= 1 passes; NaN sticks) and the norm-wise
// relative error
struct Err {
    double worst, rel;
};
static Err compare(const std::vector<uint16_t>& got, const double* want, size_t n) {
    double ss = 0, se = 0, worst = 0;
    for (size_t i = 0; i < n; i++) ss += want[i] * want[i];
    const double rms = sqrt(ss / std::max<size_t>(n, 1));
    for (size_t i = 0; i < n; i++) {
        const double x = bf2d(got[i]), y = want[i], e = x - y;
        se += e * e;
        /* 2^-4 (|y| + rms) + 2^-20: on an H200 (tree of 52a3ece) section 9's FA2 backward itself reached 1.54 x
         * 2^-5 (|y| + rms) at B=1 H=4 Hkv=1 T=200 d=128, and at T = 1 the reference is exactly 0 while both
         * kernels leave ~1e-7 (rowsum(dO O) and dO V^T summed in different orders): the floor covers that */
        const double excess = fabs(e) / (0x1p-4 * (fabs(y) + rms) + 0x1p-20);
        if (!(excess <= worst)) worst = excess;
    }
    return {worst, ss > 0 ? sqrt(se / ss) : sqrt(se)};
}
static std::vector<double> to_double(const std::vector<uint16_t>& v) {
    std::vector<double> r(v.size());
    for (size_t i = 0; i < v.size(); i++) r[i] = bf2d(v[i]);
    return r;
}
static bool report(const char* what, const Shape& s, const Err (&e)[3]) {
    const bool ok = e[0].worst <= 1 && e[1].worst <= 1 && e[2].worst <= 1 && e[0].rel <= 2e-2 && e[1].rel <= 2e-2 &&
                    e[2].rel <= 2e-2;
    printf("  %-4s B=%d H=%d Hkv=%d T=%-5d d=%-3d  dQ %.3f/%.1e  dK %.3f/%.1e  dV %.3f/%.1e  (worst of bound / norm-wise)%s\n",
           what, s.B, s.H, s.Hkv, s.T, s.d, e[0].worst, e[0].rel, e[1].worst, e[1].rel, e[2].worst, e[2].rel,
           ok ? "" : "  FAIL");
    return ok;
}

static int g_failures = 0;

static void stage1_cpu_reference() {
    printf("stage 1: float64 CPU reference (a failure: the kernels' math, masks or operand layouts)\n");
    const Shape shapes[] = {{1, 2, 2, 1, 64},   {1, 2, 1, 17, 128}, {2, 4, 2, 100, 64}, {2, 4, 2, 100, 128},
                            {1, 3, 3, 128, 64}, {1, 4, 1, 200, 128}, {1, 2, 1, 300, 64}, {1, 2, 2, 257, 128}};
    for (const Shape& s : shapes) {
        Problem p = make_problem(s);
        const Ref r = cpu_reference(p);
        const Grads g = run_backward(p, true);
        const Err e[3] = {compare(g.dq, r.dq.data(), p.nq), compare(g.dk, r.dk.data(), p.nk),
                          compare(g.dv, r.dv.data(), p.nk)};
        if (!report("ours", s, e)) g_failures++;
        const Grads f = run_backward(p, false); /* the baseline on the same bounds, for scale */
        const Err e2[3] = {compare(f.dq, r.dq.data(), p.nq), compare(f.dk, r.dk.data(), p.nk),
                           compare(f.dv, r.dv.data(), p.nk)};
        report("fa2", s, e2);
        free_problem(p);
    }
}

static void stage2_3_against_fa2() {
    printf("stage 2: against section 9's FA2 backward; stage 3: bitwise repeat, and bitwise the same with 1, 5 and\n"
           "  one-tile-per-CTA persistent grids (a failure of 3 alone: a race, or the tile schedule's barrier phases)\n");
    const int Ts[] = {1, 100, 128, 1000, 4096};
    for (int d : {64, 128})
        for (int hkv : {2, 8})
            for (int T : Ts) {
                const Shape s = {2, 8, hkv, T, d};
                Problem p = make_problem(s);
                const Grads f = run_backward(p, false), g = run_backward(p, true), g2 = run_backward(p, true);
                const std::vector<double> wq = to_double(f.dq), wk = to_double(f.dk), wv = to_double(f.dv);
                const Err e[3] = {compare(g.dq, wq.data(), p.nq), compare(g.dk, wk.data(), p.nk),
                                  compare(g.dv, wv.data(), p.nk)};
                if (!report("vs2", s, e)) g_failures++;
                const bool same = g.dq == g2.dq && g.dk == g2.dk && g.dv == g2.dv;
                if (!same) {
                    printf("    FAIL stage 3: a second run differs bitwise\n");
                    g_failures++;
                }
                /* other grids: every CTA walks many tiles (1 CTA: all of them, both snake directions) or one */
                for (int ctas : {1, 5, 1 << 30}) {
                    if (ctas == 1 && T > 1000) continue; /* one CTA over the whole problem: seconds, not a check */
                    const Grads h = run_backward(p, true, ctas);
                    if (!(h.dq == g.dq && h.dk == g.dk && h.dv == g.dv)) {
                        printf("    FAIL stage 3: %d CTA(s) give other bits than one per SM\n", ctas);
                        g_failures++;
                    }
                }
                free_problem(p);
            }
}

// stage 4: the model's fused QKV rows, read and written in place, against the packed layout bitwise
static void stage4_rows() {
    printf("stage 4: fused QKV rows in place, bitwise the packed result (a failure: the 5-D maps' strides)\n");
    for (int d : {64, 128}) {
        const Shape s = {2, 8, 2, 300, d};
        const int qpg = s.H / s.Hkv, T = s.T, W = s.Hkv * (qpg + 2) * d, C = s.H * d;
        Problem p = make_problem(s);
        const Grads g = run_backward(p, true);
        const size_t BT = (size_t)s.B * T;
        std::vector<uint16_t> rows(BT * W), orow(BT * C), dorow(BT * C), ho(p.nq);
        CK(cudaMemcpy(ho.data(), p.o, p.nq * 2, cudaMemcpyDeviceToHost));
        for (int b = 0; b < s.B; b++)
            for (int t = 0; t < T; t++)
                for (int h = 0; h < s.H; h++)
                    for (int e = 0; e < d; e++) {
                        const size_t r = (size_t)b * T + t, src = (((size_t)b * s.H + h) * T + t) * d + e;
                        const int grp = h / qpg, j = h % qpg;
                        rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)j * d + e] = p.hq[src];
                        orow[r * C + (size_t)h * d + e] = ho[src];
                        dorow[r * C + (size_t)h * d + e] = p.hdo[src];
                        if (j == 0) {
                            const size_t ksrc = (((size_t)b * s.Hkv + grp) * T + t) * d + e;
                            rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)qpg * d + e] = p.hk[ksrc];
                            rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)(qpg + 1) * d + e] = p.hv[ksrc];
                        }
                    }
        bf16 *qkv, *dqkv, *o, *dO;
        CK(cudaMalloc(&qkv, BT * W * 2)); CK(cudaMalloc(&dqkv, BT * W * 2)); CK(cudaMalloc(&o, BT * C * 2));
        CK(cudaMalloc(&dO, BT * C * 2));
        CK(cudaMemcpy(qkv, rows.data(), BT * W * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(o, orow.data(), BT * C * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dO, dorow.data(), BT * C * 2, cudaMemcpyHostToDevice));
        CK(cudaMemset(dqkv, 0xFF, BT * W * 2));
        const hg::options opt = lab_options();
        CK(hopper_attention_backward(&g_probe, qkv_rows_view(dqkv, T, s.Hkv, d, qpg, 0),
                                     qkv_rows_view(dqkv, T, s.Hkv, d, qpg, qpg), qkv_rows_view(dqkv, T, s.Hkv, d, qpg, qpg + 1),
                                     p.dsum, cview(attention_rows_view(dO, T, s.H, d, qpg)),
                                     cview(qkv_rows_view(qkv, T, s.Hkv, d, qpg, 0)),
                                     cview(qkv_rows_view(qkv, T, s.Hkv, d, qpg, qpg)),
                                     cview(qkv_rows_view(qkv, T, s.Hkv, d, qpg, qpg + 1)),
                                     cview(attention_rows_view(o, T, s.H, d, qpg)), p.lse, s.B, s.H, s.Hkv, T, d, 0, &opt));
        sync_or_die("hopper_attention_backward (rows)");
        CK(cudaMemcpy(rows.data(), dqkv, BT * W * 2, cudaMemcpyDeviceToHost));
        size_t diff = 0;
        for (int b = 0; b < s.B; b++)
            for (int t = 0; t < T; t++)
                for (int h = 0; h < s.H; h++)
                    for (int e = 0; e < d; e++) {
                        const size_t r = (size_t)b * T + t, src = (((size_t)b * s.H + h) * T + t) * d + e;
                        const int grp = h / qpg, j = h % qpg;
                        diff += rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)j * d + e] != g.dq[src];
                        if (j == 0) {
                            const size_t ksrc = (((size_t)b * s.Hkv + grp) * T + t) * d + e;
                            diff += rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)qpg * d + e] != g.dk[ksrc];
                            diff += rows[r * W + (size_t)grp * (qpg + 2) * d + (size_t)(qpg + 1) * d + e] != g.dv[ksrc];
                        }
                    }
        printf("  rows B=%d H=%d Hkv=%d T=%d d=%d: %zu elements differ from the packed layout%s\n", s.B, s.H, s.Hkv, T,
               d, diff, diff ? "  FAIL" : "");
        if (diff) g_failures++;
        cudaFree(qkv), cudaFree(dqkv), cudaFree(o), cudaFree(dO);
        free_problem(p);
    }
}

// ---- Benchmark ------------------------------------------------------------------------------------------
template <typename F>
static double time_ms(F&& f, int reps = 20) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) f();
    sync_or_die("warm-up");
    std::vector<float> ms;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        sync_or_die("timed run");
        float x;
        CK(cudaEventElapsedTime(&x, a, b));
        ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    cudaEventDestroy(a), cudaEventDestroy(b);
    return ms[ms.size() / 2];
}
static void bench() {
    printf("benchmark: B*T = 32768, H 32, Hkv 8; median of 20 (ms, TFLOP/s; causal bwd FLOPs = 2.5 x fwd's 2 B H T^2 d)\n");
    printf("  %-6s %-4s | %-9s %-7s | %-9s %-7s | %-8s | %-8s %-8s | %s\n", "T", "d", "fa2 bwd", "TF/s", "ours bwd", "TF/s",
           "speedup", "f+b fa2", "f+b ours", "one tile per CTA: bwd ms TF/s, fwd ms TF/s vs persistent fwd ms TF/s");
    for (int d : {64, 128})
        for (int T : {1024, 4096, 8192, 16384, 32768}) {
            const Shape s = {32768 / T, 32, 8, T, d};
            Problem p = make_problem(s);
            const attn_view dq = qview(p.dq, s), dk = kview(p.dk, s), dv = kview(p.dv, s), ov = qview(p.o, s);
            const attn_cview dO = cview(qview(p.dO, s)), q = cview(qview(p.q, s)), k = cview(kview(p.k, s)),
                             v = cview(kview(p.v, s)), o = cview(ov);
            const hg::options opt = lab_options();
            const double fwd_flops = 2.0 * s.B * s.H * (double)T * T * d, bwd_flops = 2.5 * fwd_flops;
            const double t2 = time_ms([&] {
                CK(flash_attention_backward(dq, dk, dv, p.dsum, dO, q, k, v, o, p.lse, s.B, s.H, s.Hkv, T, d, 0));
            });
            const double t3 = time_ms([&] {
                CK(hopper_attention_backward(&g_probe, dq, dk, dv, p.dsum, dO, q, k, v, o, p.lse, s.B, s.H, s.Hkv, T, d,
                                             0, &opt));
            });
            hg::options one = opt;
            one.max_ctas = 1 << 30;
            const double t1 = time_ms([&] {
                CK(hopper_attention_backward(&g_probe, dq, dk, dv, p.dsum, dO, q, k, v, o, p.lse, s.B, s.H, s.Hkv, T, d,
                                             0, &one));
            });
            const double tf2 = time_ms([&] { CK(flash_attention_forward(ov, p.lse, q, k, v, s.B, s.H, s.Hkv, T, d, 0)); });
            double tf3 = tf2, tf1 = tf2;
            if (hopper_attention_available(&g_probe)) {
                tf3 = time_ms([&] { CK(hopper_attention_forward(&g_probe, ov, p.lse, q, k, v, s.B, s.H, s.Hkv, T, d, 0)); });
                tf1 = time_ms([&] {
                    CK(hopper_attention_forward(&g_probe, ov, p.lse, q, k, v, s.B, s.H, s.Hkv, T, d, 0, NULL, 1 << 30));
                });
            }
            printf("  %-6d %-4d | %-9.3f %-7.0f | %-9.3f %-7.0f | %-8.2f | %-8.0f %-8.0f | %.3f %.0f, %.3f %.0f vs %.3f %.0f\n",
                   T, d, t2, bwd_flops / t2 / 1e9, t3, bwd_flops / t3 / 1e9, t2 / t3, 3.5 * fwd_flops / (tf2 + t2) / 1e9,
                   3.5 * fwd_flops / (tf3 + t3) / 1e9, t1, bwd_flops / t1 / 1e9, tf1, fwd_flops / tf1 / 1e9, tf3,
                   fwd_flops / tf3 / 1e9);
            free_problem(p);
        }
}

int main(int argc, char** argv) {
    bool check = true, run_bench = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--check")) run_bench = false;
        else if (!strcmp(argv[i], "--bench")) check = false;
        else {
            fprintf(stderr, "usage: %s [--check | --bench]\n", argv[0]);
            return 2;
        }
    }
    CK(cudaSetDeviceFlags(cudaDeviceMapHost));
    CK(cudaHostAlloc((void**)&g_wd_host, sizeof(hg::watchdog), cudaHostAllocMapped));
    memset((void*)g_wd_host, 0, sizeof(hg::watchdog));
    if (!hopper_attention_backward_available(&g_probe)) {
        fprintf(stderr, "section 13.3's kernels do not run here (needs compute capability 9.x and an sm_90a build)\n");
        return 1;
    }
    if (check) {
        stage1_cpu_reference();
        stage2_3_against_fa2();
        stage4_rows();
        printf("%s: %d failure(s)\n", g_failures ? "FAIL" : "PASS", g_failures);
        if (g_failures) return 1;
    }
    if (run_bench) bench();
    return 0;
}
