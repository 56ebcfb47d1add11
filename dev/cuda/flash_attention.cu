/*
 * dev/cuda/flash_attention.cu — causal flash attention, forward and backward, on tensor cores.
 *
 * The lab of megatron.cu section 9: it includes megatron.cu whole and drives its flash kernels (bf16
 * inputs, fp32 accumulation, the T x T score matrix never written to memory) through their host
 * launchers; main() below is the harness: a correctness check against a naive fp32 reference for
 * several shapes, a determinism check, and a benchmark.
 *
 * Build and run (on an sm_90 GPU):
 *   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90,code=sm_90 -o flash_attention dev/cuda/flash_attention.cu -lcublas -lcublasLt
 *   ./flash_attention
 * Add -Xptxas -v to read each kernel's registers, shared memory and spills.
 *   ./flash_attention --bench B,H,Hkv,T,d [--bench ...]
 * times only the given shapes (no reference, no checks: tests/test_flash.h and the default run check
 * the kernels), forward and backward separately, and prints one "BENCH ..." line per shape
 * (dev/bench/cp_bench.sh reads it; its PyTorch counterpart is dev/bench/attention_sdpa.py).
 *
 * ---- Layout (the same as megatron.cu's attention) -----------------------------------------------
 *   (the lab's layout; the kernels take any strided view of it, megatron.cu's fa::heads_view, so the
 *   model passes its fused QKV rows and attention output rows as they are)
 *   Q, O, dO, dQ   [B, H,   T, d]  bf16
 *   K, V, dK, dV   [B, Hkv, T, d]  bf16   grouped-query attention: query head h reads kv head
 *                                         h / (H / Hkv); K and V are never repeated in memory
 *   LSE            [B, H, T]       fp32   log-sum-exp of each query row's scaled scores (natural log),
 *                                         saved by the forward for the backward
 *   Dsum           [B, H, T]       fp32   scratch of the backward: rowsum(dO * O)
 *   d = 64 or 128 (a template parameter); any T >= 1 (tiles are zero-filled past T, see below);
 *   H % Hkv == 0; scale = 1/sqrt(d).
 *
 * ---- Math ---------------------------------------------------------------------------------------
 *   forward   S = scale * Q K^T, keeping key j <= query i (causal);  P = softmax_row(S);  O = P V;
 *             LSE_i = log sum_j exp(S_ij), so that P_ij = exp(S_ij - LSE_i).
 *   backward  dV = P^T dO;  dP = dO V^T;  dS = P * (dP - Dsum)  with  Dsum_i = sum_j P_ij dP_ij
 *             = rowsum(dO_i * O_i);  dQ = scale * dS K;  dK = scale * dS^T Q.
 *             With GQA, dK and dV of one kv head sum over the H/Hkv query heads that read it.
 *
 * ---- Kernels (FlashAttention-2) -----------------------------------------------------------------
 *   flash_fwd_kernel       one CTA per (b, h, tile of BM query rows), 4 warps, each warp owns 16*MT
 *                          rows. Loops over the K/V tiles of 64 keys that the causal mask leaves
 *                          (skipping those after the diagonal), double-buffered through shared
 *                          memory with cp.async; S and P stay in registers; online softmax keeps a
 *                          running row max m and row sum l and rescales the O accumulator.
 *   flash_bwd_dot_kernel   Dsum = rowsum(dO * O).
 *   flash_bwd_dkdv_kernel  one CTA per (b, kv head, tile of 64 keys), each warp owns 16 keys. Loops
 *                          over the query heads of the group and, for each, over the query tiles at
 *                          or after the diagonal, recomputing P^T = exp(S^T - LSE); dK and dV are
 *                          accumulated in registers and written once.
 *   flash_bwd_dq_kernel    one CTA per (b, h, tile of 64 query rows); loops over key tiles like the
 *                          forward, recomputing P and dP; dQ accumulated in registers, written once.
 *   No floating-point atomics anywhere: every output element is summed by one thread in a fixed
 *   order, so the backward is bitwise deterministic. The price of the separate dQ kernel is that S and
 *   dP are computed twice (7 tile products instead of FlashAttention-2's 5 with atomic dQ).
 *
 * ---- Tensor cores: mma.sync.m16n8k16 bf16 -> fp32 (PTX ISA "Matrix fragments for mma.m16n8k16") -
 *   lane = 4*g + t  (g = lane/4 in 0..7, t = lane%4)
 *   A 16x16 (row-major), 4 regs of 2 bf16:  a0 = A[g][2t..2t+1]    a1 = A[g+8][2t..2t+1]
 *                                           a2 = A[g][2t+8..+9]    a3 = A[g+8][2t+8..+9]
 *   B 16x8  ("col": B[k][n]), 2 regs:       b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
 *   C 16x8 fp32, 4 regs:                    c0,c1 = C[g][2t..2t+1] c2,c3 = C[g+8][2t..2t+1]
 *   Two n8 accumulators side by side (16x16) hold exactly an A fragment's elements, so P = softmax(S)
 *   feeds the next product straight from registers (c_to_a). Fragments come from shared memory with
 *   ldmatrix (x4: four 8x8 matrices, lanes 8i..8i+7 give the row addresses of matrix i); .trans
 *   hands out the transpose, which turns a row-major [k][n] tile (V, dO, K, Q as B of P V-like
 *   products) into B fragments. Shared tiles are padded to D+8 bf16 per row (16 bytes) so the 8 rows
 *   one ldmatrix phase reads fall in 8 different bank groups.
 *
 * ---- Tails and masking --------------------------------------------------------------------------
 *   T need not be a multiple of any tile: rows past T are zero-filled by cp.async (src-size 0) and
 *   never stored. Keys past T are always masked for valid queries (key >= T > query), and a padded
 *   query row (>= T) has zero Q and dO, so its contributions to dK and dV are exactly zero.
 *   Masking is by tile: a tile entirely below the diagonal needs none, a tile crossing it gets the
 *   element test key > query, tiles entirely above it are not visited; a warp whose own rows all lie
 *   before the tile's first key skips the tile (warp-uniform branch).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>


#define LAB_CHECK(call)                                                                                   \
    do {                                                                                                   \
        cudaError_t err_ = (call);                                                                         \
        if (err_ != cudaSuccess) {                                                                         \
            fprintf(stderr, "CUDA error %s (%s) at %s:%d: %s\n", cudaGetErrorName(err_),                  \
                    cudaGetErrorString(err_), __FILE__, __LINE__, #call);                                  \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

/* ============================================================================================== */
/* 1-4. The kernels and launchers live in megatron.cu (section 9); this lab includes it whole and */
/*      keeps the reference, the checks and the benchmark.                                        */
/* ============================================================================================== */
#include "../../megatron.cu"

/* ============================================================================================== */
/* 5. Naive fp32 reference (scores materialised as [B, H, T, T]; one thread per output element)     */
/* ============================================================================================== */

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
/* kv-head row base for (b, h) */
__device__ __forceinline__ size_t kv_base(size_t bh, int H, int Hkv, int T, int d) {
    size_t b = bh / H, h = bh % H;
    return ((b * Hkv + h / (H / Hkv)) * T) * d;
}

/* S[bh, i, j] = scale * q_i . k_j for j <= i, else -inf */
__global__ void ref_scores_kernel(float* S, const bf16* Q, const bf16* K, int B, int H, int Hkv, int T, int d,
                                  float scale) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * H * T * T) return;
    int j = (int)(idx % T), i = (int)((idx / T) % T);
    size_t bh = idx / ((size_t)T * T);
    if (j > i) {
        S[idx] = -INFINITY;
        return;
    }
    const bf16* q = Q + (bh * T + i) * d;
    const bf16* k = K + kv_base(bh, H, Hkv, T, d) + (size_t)j * d;
    float acc = 0.0f;
    for (int e = 0; e < d; e++) acc += bf(q[e]) * bf(k[e]);
    S[idx] = acc * scale;
}
/* in place: P = softmax over j <= i; LSE = max + log(sum). One warp per row. */
__global__ void ref_softmax_kernel(float* P, float* LSE, size_t rows, int T) {
    size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* p = P + row * T;
    int i = (int)(row % T);
    float mx = -INFINITY, sum = 0.0f;
    for (int j = lane; j <= i; j += 32) mx = fmaxf(mx, p[j]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int j = lane; j <= i; j += 32) sum += expf(p[j] - mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int j = lane; j < T; j += 32) p[j] = j <= i ? expf(p[j] - mx) / sum : 0.0f;
    if (lane == 0) LSE[row] = mx + logf(sum);
}
/* O[bh, i, e] = sum_j P[bh, i, j] v_j[e] */
__global__ void ref_pv_kernel(float* O, const float* P, const bf16* V, int B, int H, int Hkv, int T, int d) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * H * T * d) return;
    int e = (int)(idx % d), i = (int)((idx / d) % T);
    size_t bh = idx / ((size_t)d * T);
    const float* p = P + (bh * T + i) * T;
    const bf16* v = V + kv_base(bh, H, Hkv, T, d) + e;
    float acc = 0.0f;
    for (int j = 0; j <= i; j++) acc += p[j] * bf(v[(size_t)j * d]);
    O[idx] = acc;
}
/* Dsum[row] = dO_row . O_row (O in fp32) */
__global__ void ref_dsum_kernel(float* Dsum, const bf16* dO, const float* O, size_t rows, int d) {
    size_t row = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    float acc = 0.0f;
    for (int e = 0; e < d; e++) acc += bf(dO[row * d + e]) * O[row * d + e];
    Dsum[row] = acc;
}
/* dS[bh, i, j] = P (dO_i . v_j - Dsum_i) */
__global__ void ref_ds_kernel(float* dS, const float* P, const bf16* dO, const bf16* V, const float* Dsum, int B, int H,
                              int Hkv, int T, int d) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * H * T * T) return;
    int j = (int)(idx % T), i = (int)((idx / T) % T);
    size_t bh = idx / ((size_t)T * T);
    if (j > i) {
        dS[idx] = 0.0f;
        return;
    }
    const bf16* g = dO + (bh * T + i) * d;
    const bf16* v = V + kv_base(bh, H, Hkv, T, d) + (size_t)j * d;
    float acc = 0.0f;
    for (int e = 0; e < d; e++) acc += bf(g[e]) * bf(v[e]);
    dS[idx] = P[idx] * (acc - Dsum[bh * T + i]);
}
/* dQ[bh, i, e] = scale * sum_j dS[bh, i, j] k_j[e] */
__global__ void ref_dq_kernel(float* dQ, const float* dS, const bf16* K, int B, int H, int Hkv, int T, int d,
                              float scale) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * H * T * d) return;
    int e = (int)(idx % d), i = (int)((idx / d) % T);
    size_t bh = idx / ((size_t)d * T);
    const float* ds = dS + (bh * T + i) * T;
    const bf16* k = K + kv_base(bh, H, Hkv, T, d) + e;
    float acc = 0.0f;
    for (int j = 0; j <= i; j++) acc += ds[j] * bf(k[(size_t)j * d]);
    dQ[idx] = acc * scale;
}
/* dK[b, hkv, j, e] = scale * sum_{h of the group} sum_i dS[bh, i, j] q_i[e];  dV likewise with P and dO */
__global__ void ref_dkdv_kernel(float* dK, float* dV, const float* dS, const float* P, const bf16* Q, const bf16* dO,
                                int B, int H, int Hkv, int T, int d, float scale) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * Hkv * T * d) return;
    int e = (int)(idx % d), j = (int)((idx / d) % T);
    size_t bkv = idx / ((size_t)d * T);
    int b = (int)(bkv / Hkv), hkv = (int)(bkv % Hkv), qpg = H / Hkv;
    float dk = 0.0f, dv = 0.0f;
    for (int s = 0; s < qpg; s++) {
        size_t bh = (size_t)b * H + hkv * qpg + s;
        for (int i = j; i < T; i++) {
            size_t pij = (bh * T + i) * T + j;
            dk += dS[pij] * bf(Q[(bh * T + i) * d + e]);
            dv += P[pij] * bf(dO[(bh * T + i) * d + e]);
        }
    }
    dK[idx] = dk * scale;
    dV[idx] = dv;
}

/* ============================================================================================== */
/* 6. Harness: buffers, checks, benchmark                                                           */
/* ============================================================================================== */

struct Shape {
    int B, H, Hkv, T, d;
};

struct Buffers {
    Shape s;
    size_t nq, nkv, nrow, nss; /* elements of Q-like, K-like, row vectors, score matrices */
    bf16 *Q, *K, *V, *dO, *O, *dQ, *dK, *dV;
    float *LSE, *Dsum;
    /* reference */
    float *P, *dS, *Or, *LSEr, *Dr, *dQr, *dKr, *dVr;
};

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float rng_uniform() { /* xorshift64*, uniform in [0, 1) */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (float)((rng_state * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f;
}
static uint16_t f2bf_bits(float f) { /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf_bits2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* random bf16 in +-[0.02, amp), never zero */
static void fill_random(bf16* dst, size_t n, float amp) {
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; i++) {
        float mag = 0.02f + (amp - 0.02f) * rng_uniform();
        h[i] = f2bf_bits(rng_uniform() < 0.5f ? -mag : mag);
    }
    LAB_CHECK(cudaMemcpy(dst, h.data(), n * 2, cudaMemcpyHostToDevice));
}

/* the same distribution made on the device (splitmix64 of the index and a seed), for the benchmark's
 * long sequences, where the host loop above would take seconds per buffer */
__global__ void fill_random_kernel(bf16* dst, size_t n, float amp, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) / 16777216.0f, mag = 0.02f + (amp - 0.02f) * u;
        dst[i] = __float2bfloat16((z & 1) ? -mag : mag);
    }
}
static void fill_random_device(bf16* dst, size_t n, float amp, uint64_t seed) {
    fill_random_kernel<<<1024, 256>>>(dst, n, amp, seed);
    LAB_CHECK(cudaGetLastError());
}

static void alloc_buffers(Buffers* x, Shape s, bool with_ref, bool device_fill = false) {
    memset(x, 0, sizeof(*x));
    x->s = s;
    x->nq = (size_t)s.B * s.H * s.T * s.d;
    x->nkv = (size_t)s.B * s.Hkv * s.T * s.d;
    x->nrow = (size_t)s.B * s.H * s.T;
    x->nss = (size_t)s.B * s.H * s.T * s.T;
    LAB_CHECK(cudaMalloc(&x->Q, x->nq * 2));
    LAB_CHECK(cudaMalloc(&x->dO, x->nq * 2));
    LAB_CHECK(cudaMalloc(&x->O, x->nq * 2));
    LAB_CHECK(cudaMalloc(&x->dQ, x->nq * 2));
    LAB_CHECK(cudaMalloc(&x->K, x->nkv * 2));
    LAB_CHECK(cudaMalloc(&x->V, x->nkv * 2));
    LAB_CHECK(cudaMalloc(&x->dK, x->nkv * 2));
    LAB_CHECK(cudaMalloc(&x->dV, x->nkv * 2));
    LAB_CHECK(cudaMalloc(&x->LSE, x->nrow * 4));
    LAB_CHECK(cudaMalloc(&x->Dsum, x->nrow * 4));
    if (with_ref) {
        LAB_CHECK(cudaMalloc(&x->P, x->nss * 4));
        LAB_CHECK(cudaMalloc(&x->dS, x->nss * 4));
        LAB_CHECK(cudaMalloc(&x->Or, x->nq * 4));
        LAB_CHECK(cudaMalloc(&x->dQr, x->nq * 4));
        LAB_CHECK(cudaMalloc(&x->dKr, x->nkv * 4));
        LAB_CHECK(cudaMalloc(&x->dVr, x->nkv * 4));
        LAB_CHECK(cudaMalloc(&x->LSEr, x->nrow * 4));
        LAB_CHECK(cudaMalloc(&x->Dr, x->nrow * 4));
    }
    /* Q, K with |x| < 1.7 (so scale * q.k has a spread of about 1 and the softmax is not flat),
     * V and dO with |x| < 1 */
    if (device_fill) {
        fill_random_device(x->Q, x->nq, 1.7f, 1);
        fill_random_device(x->K, x->nkv, 1.7f, 2);
        fill_random_device(x->V, x->nkv, 1.0f, 3);
        fill_random_device(x->dO, x->nq, 1.0f, 4);
        return;
    }
    fill_random(x->Q, x->nq, 1.7f);
    fill_random(x->K, x->nkv, 1.7f);
    fill_random(x->V, x->nkv, 1.0f);
    fill_random(x->dO, x->nq, 1.0f);
}
static void free_buffers(Buffers* x) {
    void* ps[] = {x->Q, x->K, x->V, x->dO, x->O, x->dQ, x->dK, x->dV, x->LSE, x->Dsum,
                  x->P, x->dS, x->Or, x->LSEr, x->Dr, x->dQr, x->dKr, x->dVr};
    for (void* p : ps)
        if (p) LAB_CHECK(cudaFree(p));
}

static unsigned blocks_for(size_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

static void ref_forward(Buffers* x) {
    Shape s = x->s;
    float scale = 1.0f / sqrtf((float)s.d);
    ref_scores_kernel<<<blocks_for(x->nss, 256), 256>>>(x->P, x->Q, x->K, s.B, s.H, s.Hkv, s.T, s.d, scale);
    LAB_CHECK(cudaGetLastError());
    ref_softmax_kernel<<<blocks_for(x->nrow * 32, 256), 256>>>(x->P, x->LSEr, x->nrow, s.T);
    LAB_CHECK(cudaGetLastError());
    ref_pv_kernel<<<blocks_for(x->nq, 256), 256>>>(x->Or, x->P, x->V, s.B, s.H, s.Hkv, s.T, s.d);
    LAB_CHECK(cudaGetLastError());
}
static void ref_backward(Buffers* x) {
    Shape s = x->s;
    float scale = 1.0f / sqrtf((float)s.d);
    ref_dsum_kernel<<<blocks_for(x->nrow, 256), 256>>>(x->Dr, x->dO, x->Or, x->nrow, s.d);
    LAB_CHECK(cudaGetLastError());
    ref_ds_kernel<<<blocks_for(x->nss, 256), 256>>>(x->dS, x->P, x->dO, x->V, x->Dr, s.B, s.H, s.Hkv, s.T, s.d);
    LAB_CHECK(cudaGetLastError());
    ref_dq_kernel<<<blocks_for(x->nq, 256), 256>>>(x->dQr, x->dS, x->K, s.B, s.H, s.Hkv, s.T, s.d, scale);
    LAB_CHECK(cudaGetLastError());
    ref_dkdv_kernel<<<blocks_for(x->nkv, 256), 256>>>(x->dKr, x->dVr, x->dS, x->P, x->Q, x->dO, s.B, s.H, s.Hkv, s.T,
                                                      s.d, scale);
    LAB_CHECK(cudaGetLastError());
}

/* The lab keeps the packed layout [B, H, T, d]; the model's row layouts go through the same kernels
 * by other strides (tests/test_flash.h checks those against a reference, and bitwise against this). */
static attn_view qv(bf16* p, Shape s) { return packed_heads_view(p, s.H, s.T, s.d, s.H / s.Hkv); }
static attn_view kv(bf16* p, Shape s) { return packed_heads_view(p, s.Hkv, s.T, s.d, 1); }
static void flash_forward(Buffers* x) {
    Shape s = x->s;
    LAB_CHECK(flash_attention_forward(qv(x->O, s), x->LSE, cview(qv(x->Q, s)), cview(kv(x->K, s)), cview(kv(x->V, s)),
                                      s.B, s.H, s.Hkv, s.T, s.d, 0));
}
static void flash_backward(Buffers* x) {
    Shape s = x->s;
    LAB_CHECK(flash_attention_backward(qv(x->dQ, s), kv(x->dK, s), kv(x->dV, s), x->Dsum, cview(qv(x->dO, s)),
                                       cview(qv(x->Q, s)), cview(kv(x->K, s)), cview(kv(x->V, s)), cview(qv(x->O, s)),
                                       x->LSE, s.B, s.H, s.Hkv, s.T, s.d, 0));
}

/* ||out - ref|| / ||ref|| over all elements, in double on the host; NaN anywhere gives NaN. Where the
 * reference is exactly zero (T = 1: one key, so P = 1 and dS = P (dP - Dsum) = 0), the absolute
 * norm ||out|| is returned instead. */
static double rel_err(const void* d_out, bool out_is_bf16, const float* d_ref, size_t n) {
    std::vector<float> ref(n), out(n);
    LAB_CHECK(cudaMemcpy(ref.data(), d_ref, n * 4, cudaMemcpyDeviceToHost));
    if (out_is_bf16) {
        std::vector<uint16_t> raw(n);
        LAB_CHECK(cudaMemcpy(raw.data(), d_out, n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) out[i] = bf_bits2f(raw[i]);
    } else {
        LAB_CHECK(cudaMemcpy(out.data(), d_out, n * 4, cudaMemcpyDeviceToHost));
    }
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double diff = (double)out[i] - (double)ref[i];
        num += diff * diff;
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static std::vector<uint8_t> to_host(const void* d, size_t bytes) {
    std::vector<uint8_t> h(bytes);
    LAB_CHECK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* Tolerance for bf16 outputs, norm-wise. Sources of error against the fp32 reference: the outputs
 * are rounded to bf16 (relative 2^-9 per element, ~2e-3 norm-wise), and P and dS are rounded to
 * bf16 before their tensor-core products (also 2^-9 relative per element, largely averaging out
 * over the sum over keys); all accumulation is fp32, and exp2.approx adds ~1e-7. Expected errors are
 * a few 1e-3; 2e-2 leaves a margin of several times while any indexing, masking or GQA mistake
 * produces errors of order 1. LSE is fp32 throughout and gets a tighter bound. */
static const double TOL = 2e-2, TOL_LSE = 1e-4;

static bool check_shape(Shape s) {
    Buffers x;
    alloc_buffers(&x, s, true);
    ref_forward(&x);
    ref_backward(&x);

    /* forward, on poisoned outputs (0xFF bytes: NaN in bf16 and fp32) */
    LAB_CHECK(cudaMemset(x.O, 0xFF, x.nq * 2));
    LAB_CHECK(cudaMemset(x.LSE, 0xFF, x.nrow * 4));
    flash_forward(&x);
    LAB_CHECK(cudaDeviceSynchronize());
    double eO = rel_err(x.O, true, x.Or, x.nq);
    double eL = rel_err(x.LSE, false, x.LSEr, x.nrow);

    /* backward twice on poisoned outputs; the two results must be bitwise identical */
    std::vector<uint8_t> first[3];
    bool same = true;
    for (int run = 0; run < 2; run++) {
        LAB_CHECK(cudaMemset(x.dQ, 0xFF, x.nq * 2));
        LAB_CHECK(cudaMemset(x.dK, 0xFF, x.nkv * 2));
        LAB_CHECK(cudaMemset(x.dV, 0xFF, x.nkv * 2));
        LAB_CHECK(cudaMemset(x.Dsum, 0xFF, x.nrow * 4));
        flash_backward(&x);
        LAB_CHECK(cudaDeviceSynchronize());
        std::vector<uint8_t> cur[3] = {to_host(x.dQ, x.nq * 2), to_host(x.dK, x.nkv * 2), to_host(x.dV, x.nkv * 2)};
        for (int i = 0; i < 3; i++) {
            if (run == 0) first[i] = cur[i];
            else same = same && first[i] == cur[i];
        }
    }
    double edQ = rel_err(x.dQ, true, x.dQr, x.nq);
    double edK = rel_err(x.dK, true, x.dKr, x.nkv);
    double edV = rel_err(x.dV, true, x.dVr, x.nkv);

    bool ok = eO < TOL && eL < TOL_LSE && edQ < TOL && edK < TOL && edV < TOL && same;
    printf("  (B=%d H=%2d Hkv=%2d T=%4d d=%3d)  O %.2e  LSE %.2e  dQ %.2e  dK %.2e  dV %.2e  %s  %s\n", s.B, s.H,
           s.Hkv, s.T, s.d, eO, eL, edQ, edK, edV, same ? "deterministic" : "NOT DETERMINISTIC", ok ? "ok" : "FAIL");
    free_buffers(&x);
    return ok;
}

template <typename F>
static float median_ms(F fn, int warmup, int reps) {
    cudaEvent_t a, b;
    LAB_CHECK(cudaEventCreate(&a));
    LAB_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < warmup; i++) fn();
    std::vector<float> ms(reps);
    for (int i = 0; i < reps; i++) {
        LAB_CHECK(cudaEventRecord(a));
        fn();
        LAB_CHECK(cudaEventRecord(b));
        LAB_CHECK(cudaEventSynchronize(b));
        LAB_CHECK(cudaEventElapsedTime(&ms[i], a, b));
    }
    LAB_CHECK(cudaEventDestroy(a));
    LAB_CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms[reps / 2];
}

static void bench_shape(Shape s) {
    Buffers x;
    alloc_buffers(&x, s, true);
    /* causal FLOPs: forward = two T x T x d products, half of them masked: 2 * 2*B*H*T*T*d / 2;
     * backward = 2.5x forward (FlashAttention's convention: 5 products instead of 2) */
    const double fwd_flop = 2.0 * 2.0 * s.B * s.H * (double)s.T * s.T * s.d / 2.0;
    const double bwd_flop = 2.5 * fwd_flop;
    flash_forward(&x); /* the backward needs O and LSE */
    float f_ms = median_ms([&] { flash_forward(&x); }, 3, 20);
    float b_ms = median_ms([&] { flash_backward(&x); }, 3, 20);
    float rf_ms = median_ms([&] { ref_forward(&x); }, 1, 5);
    float rb_ms = median_ms([&] { ref_backward(&x); }, 1, 5);
    printf("  %d x %2d/%-2d x %4d x %3d | %8.3f  %6.1f | %8.3f  %6.1f | %9.2f  %9.2f\n", s.B, s.H, s.Hkv, s.T, s.d, f_ms,
           fwd_flop / f_ms * 1e-9, b_ms, bwd_flop / b_ms * 1e-9, rf_ms, rb_ms);
    free_buffers(&x);
}

/* --bench B,H,Hkv,T,d: one shape timed alone, without the reference's buffers (its T x T score matrices
 * would not fit at long T), through the kernels the trainer would take (attention_forward_fast and
 * attention_backward_fast: the Hopper ones where they run; MT_ATTN_FWD=fa2 / MT_ATTN_BWD=fa2 force section 9's). The same causal FLOP count as bench_shape (and as attention_sdpa.py):
 * forward 2*B*H*T^2*d, backward 2.5x that. CUDA events around each call, WARMUP calls first, the median
 * of REPS; the backward reads the forward's O and LSE, made once before it. */
static int bench_one(const char* spec) {
    Shape s;
    char tail;
    if (sscanf(spec, "%d,%d,%d,%d,%d%c", &s.B, &s.H, &s.Hkv, &s.T, &s.d, &tail) != 5 || s.B < 1 || s.B > 1024 ||
        s.H < 1 || s.H > 1024 || s.Hkv < 1 || s.Hkv > s.H || s.H % s.Hkv != 0 || s.T < 1 || s.T > (1 << 22) ||
        (s.d != 64 && s.d != 128)) {
        fprintf(stderr, "flash_attention: --bench wants B,H,Hkv,T,d (H a multiple of Hkv, d 64 or 128), not '%s'\n",
                spec);
        return 2;
    }
    const double q_bytes = 2.0 * s.B * s.H * (double)s.T * s.d, kv_bytes = 2.0 * s.B * s.Hkv * (double)s.T * s.d;
    size_t free_b = 0, total_b = 0;
    LAB_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double need = 4 * q_bytes + 4 * kv_bytes + 8.0 * s.B * s.H * s.T; /* Q O dO dQ, K V dK dV, LSE Dsum */
    if (need > 0.95 * (double)free_b) {
        fprintf(stderr, "flash_attention: --bench %s needs %.1f GiB, %.1f GiB free\n", spec, need / (1 << 30),
                free_b / (double)(1 << 30));
        return 1;
    }
    /* the trainer's choice of kernels (MT_ATTN_FWD / MT_ATTN_BWD as it reads them): sections 13.2 / 13.3 on
     * Hopper where they take the call, else section 9's */
    int fwd_mode = 0, bwd_mode = 0;
    mt_error why;
    if (attn_fwd_parse(getenv("MT_ATTN_FWD"), &fwd_mode, &why) != MT_OK ||
        attn_bwd_parse(getenv("MT_ATTN_BWD"), &bwd_mode, &why) != MT_OK) {
        fprintf(stderr, "flash_attention: %s\n", why.message);
        return 2;
    }
    mt_hopper_gemm_state st;
    memset(&st, 0, sizeof(st));
    const mt_dropout no_dropout = mt_dropout();
    const bool fa3_fwd = fwd_mode != MT_ATTN_FWD_FA2 && fa3::head_dim_ok(s.d) && hopper_attention_available(&st);
    const bool fa3_bwd = hopper_backward_wanted(&st, bwd_mode, s.d, no_dropout, NULL);
    Buffers x;
    alloc_buffers(&x, s, false, true);
    auto forward = [&] {
        LAB_CHECK(attention_forward_fast(&st, fwd_mode, qv(x.O, s), x.LSE, cview(qv(x.Q, s)), cview(kv(x.K, s)),
                                         cview(kv(x.V, s)), s.B, s.H, s.Hkv, s.T, s.d, 0, no_dropout, NULL));
    };
    auto backward = [&] {
        LAB_CHECK(attention_backward_fast(&st, bwd_mode, qv(x.dQ, s), kv(x.dK, s), kv(x.dV, s), x.Dsum,
                                          cview(qv(x.dO, s)), cview(qv(x.Q, s)), cview(kv(x.K, s)), cview(kv(x.V, s)),
                                          cview(qv(x.O, s)), x.LSE, s.B, s.H, s.Hkv, s.T, s.d, 0, NULL, no_dropout,
                                          NULL));
    };
    const double fwd_flop = 2.0 * 2.0 * s.B * s.H * (double)s.T * s.T * s.d / 2.0, bwd_flop = 2.5 * fwd_flop;
    const int WARMUP = 2, REPS = 7;
    forward();
    LAB_CHECK(cudaDeviceSynchronize());
    float f_ms = median_ms(forward, WARMUP, REPS);
    float b_ms = median_ms(backward, WARMUP, REPS);
    LAB_CHECK(cudaGetLastError());
    printf("BENCH B=%d H=%d Hkv=%d T=%d d=%d causal bf16 fwd_ms=%.3f fwd_tflops=%.1f bwd_ms=%.3f bwd_tflops=%.1f "
           "fwdbwd_tflops=%.1f fwd=%s bwd=%s\n",
           s.B, s.H, s.Hkv, s.T, s.d, f_ms, fwd_flop / f_ms * 1e-9, b_ms, bwd_flop / b_ms * 1e-9,
           (fwd_flop + bwd_flop) / (f_ms + b_ms) * 1e-9, fa3_fwd ? "fa3" : "fa2", fa3_bwd ? "fa3" : "fa2");
    fflush(stdout);
    free_buffers(&x);
    return 0;
}

/* Tile variants (d = 64): each checked against the reference, then timed like bench_shape. */
template <int BM, int W>
static void variant_fwd(Buffers* x, const char* name, double flop) {
    Shape s = x->s;
    auto run = [&] {
        LAB_CHECK((fa::forward_tiles<64, BM, W>(qv(x->O, s), x->LSE, cview(qv(x->Q, s)), cview(kv(x->K, s)),
                                                cview(kv(x->V, s)), s.B, s.H, s.Hkv, s.T, 0)));
    };
    LAB_CHECK(cudaMemset(x->O, 0xFF, x->nq * 2));
    run();
    LAB_CHECK(cudaDeviceSynchronize());
    double e = rel_err(x->O, true, x->Or, x->nq);
    float ms = median_ms(run, 3, 20);
    printf("    fwd %-28s %8.3f ms %6.1f TFLOP/s  O err %.1e %s\n", name, ms, flop / ms * 1e-9, e, e < TOL ? "" : "FAIL");
}
template <int BMQ, int KVW, int BM, int QW>
static void variant_bwd(Buffers* x, const char* name, double flop) {
    Shape s = x->s;
    auto run = [&] {
        LAB_CHECK((fa::backward_tiles<64, BMQ, KVW, BM, QW>(qv(x->dQ, s), kv(x->dK, s), kv(x->dV, s), x->Dsum,
                                                            cview(qv(x->dO, s)), cview(qv(x->Q, s)), cview(kv(x->K, s)),
                                                            cview(kv(x->V, s)), cview(qv(x->O, s)), x->LSE, s.B, s.H,
                                                            s.Hkv, s.T, 0)));
    };
    LAB_CHECK(cudaMemset(x->dQ, 0xFF, x->nq * 2));
    LAB_CHECK(cudaMemset(x->dK, 0xFF, x->nkv * 2));
    run();
    LAB_CHECK(cudaDeviceSynchronize());
    double eq = rel_err(x->dQ, true, x->dQr, x->nq), ek = rel_err(x->dK, true, x->dKr, x->nkv);
    float ms = median_ms(run, 3, 20);
    printf("    bwd %-28s %8.3f ms %6.1f TFLOP/s  dQ %.1e dK %.1e %s\n", name, ms, flop / ms * 1e-9, eq, ek,
           eq < TOL && ek < TOL ? "" : "FAIL");
}
static void bench_variants(Shape s) {
    Buffers x;
    alloc_buffers(&x, s, true);
    ref_forward(&x);
    ref_backward(&x);
    flash_forward(&x);
    const double fwd_flop = 2.0 * 2.0 * s.B * s.H * (double)s.T * s.T * s.d / 2.0, bwd_flop = 2.5 * fwd_flop;
    printf("  variants at %d x %d/%d x %d x %d:\n", s.B, s.H, s.Hkv, s.T, s.d);
    variant_fwd<128, 4>(&x, "BM 128, 4 warps (current)", fwd_flop);
    variant_fwd<128, 8>(&x, "BM 128, 8 warps", fwd_flop);
    variant_fwd<64, 4>(&x, "BM 64, 4 warps", fwd_flop);
    variant_bwd<64, 4, 64, 4>(&x, "kv 64q/4w, dq 64/4w (current)", bwd_flop);
    variant_bwd<64, 8, 64, 4>(&x, "kv 64q/8w, dq 64/4w", bwd_flop);
    variant_bwd<128, 8, 64, 4>(&x, "kv 128q/8w, dq 64/4w", bwd_flop);
    variant_bwd<64, 4, 128, 8>(&x, "kv 64q/4w, dq 128/8w", bwd_flop);
    variant_bwd<64, 8, 128, 8>(&x, "kv 64q/8w, dq 128/8w", bwd_flop);
    variant_bwd<32, 8, 64, 2>(&x, "kv 32q/8w, dq 64/2w", bwd_flop);
    free_buffers(&x);
}

int main(int argc, char** argv) {
    int dev;
    cudaDeviceProp prop;
    LAB_CHECK(cudaGetDevice(&dev));
    LAB_CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("flash attention lab: %s, %d SMs, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);

    /* ---- --bench B,H,Hkv,T,d ...: the given shapes timed, nothing else ---- */
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
        int rc = 0;
        for (int i = 1; i < argc; i += 2) {
            if (strcmp(argv[i], "--bench") != 0 || i + 1 >= argc) {
                fprintf(stderr, "flash_attention: usage: %s --bench B,H,Hkv,T,d [--bench B,H,Hkv,T,d ...]\n", argv[0]);
                return 2;
            }
        }
        for (int i = 2; i < argc; i += 2) {
            const int r = bench_one(argv[i]);
            if (r == 2) return 2;
            rc |= r;
        }
        return rc;
    }

    /* ---- correctness: norm-wise relative error against the naive fp32 reference ---- */
    printf("correctness (||out - ref|| / ||ref||, tolerance %.0e; LSE %.0e):\n", TOL, TOL_LSE);
    const Shape checks[] = {
        {2, 4, 4, 256, 64},    {1, 8, 2, 512, 128},  {2, 12, 12, 1024, 64},
        {1, 25, 25, 1024, 64}, /* GPT-2 1.5B: 25 heads of 64 */
        {1, 32, 8, 2048, 64},  /* Llama-3.2-1B: 32 query heads over 8 kv heads */
        /* T that is no multiple of any tile, and tiny T */
        {1, 4, 2, 300, 64},    {2, 2, 1, 77, 128},   {1, 3, 1, 17, 64},  {1, 3, 1, 1, 64},
    };
    int failed = 0;
    for (const Shape& s : checks) failed += !check_shape(s);
    /* invalid shapes are refused, not launched */
    attn_view none = {nullptr, 0, 0, 0, 0};
    if (flash_attention_forward(none, nullptr, cview(none), cview(none), cview(none), 1, 6, 4, 128, 64, 0) !=
            cudaErrorInvalidValue ||
        flash_attention_forward(none, nullptr, cview(none), cview(none), cview(none), 1, 4, 4, 128, 96, 0) !=
            cudaErrorInvalidValue) {
        printf("  invalid shape was not refused: FAIL\n");
        failed++;
    }
    if (failed) {
        printf("%d check(s) FAILED\n", failed);
        return 1;
    }
    printf("all checks passed\n");
    if (argc > 1 && strcmp(argv[1], "--check") == 0) return 0;

    /* ---- benchmark: median of 20 (flash) / 5 (naive reference) CUDA-event timings ---- */
    printf("benchmark (causal; TFLOP/s counts forward 2*B*H*T^2*d, backward 2.5x that):\n");
    printf("  B x  H/Hkv x    T x   d |  fwd ms  TFLOP/s |  bwd ms  TFLOP/s | naive fwd  naive bwd (ms)\n");
    const Shape benches[] = {{8, 12, 12, 1024, 64}, {4, 25, 25, 1024, 64}, {4, 32, 8, 2048, 64}, {4, 16, 16, 2048, 128}};
    for (const Shape& s : benches) bench_shape(s);
    if (argc > 1 && strcmp(argv[1], "--variants") == 0) {
        bench_variants({8, 12, 12, 1024, 64});
        bench_variants({4, 25, 25, 1024, 64});
        bench_variants({4, 32, 8, 2048, 64});
    }
    return 0;
}
