/*
 * dev/cuda/hopper_gemm.cu — the lab of megatron.cu section 13.1, the Hopper (sm_90a) grouped bf16 GEMM:
 * TMA + mbarrier pipeline + wgmma, warp-specialised, persistent; dense (G = 1) and grouped (the MoE
 * experts' forward, issue #34) in one kernel; B as [N, K] (C = A B^T, the forward) or [K, N] (C = A B,
 * the input gradient dx = dy W: stage 8 of the checks and the "dgrad" rows of the benchmark).
 *
 * It includes megatron.cu whole and drives the library's launcher, hopper_grouped_gemm (with its
 * hg::options: the variant, a CTA limit, the watchdog, a 4 s wait limit); the kernel, its design (the
 * operation, tiles and schedule, roles, shared memory and descriptors, accumulators, watchdog) and the
 * probe live there, once. This file keeps the staged checks against cuBLAS, the watchdog's report, the
 * benchmark against cuBLAS (dense, and grouped through cublasGemmGroupedBatchedEx) and a host
 * self-test of the tile schedule. Written from the PTX ISA (wgmma.mma_async, matrix descriptors,
 * cp.async.bulk.tensor, mbarrier, setmaxnreg) and the CUDA driver API docs (cuTensorMapEncodeTiled).
 *
 * Build (sm_90a is required: wgmma and setmaxnreg exist only in the "a" target; GPU_ARCH=90 in the
 * Makefile builds the same), from the repository root:
 *   nvcc -O3 -std=c++17 -I. -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o hopper_gemm dev/cuda/hopper_gemm.cu -lcublas -lcublasLt -lnccl
 * Stage 9 and the "wgrad" benchmark rows: the experts' weight gradient, hopper_grouped_wgrad (fp32 dW, beta).
 *   ./hopper_gemm --check     staged correctness checks only (each stage says what a failure points at)
 *   ./hopper_gemm             checks, then the benchmark (exits 1 if any check fails; no benchmark then)
 *   ./hopper_gemm --bench     benchmark only (every benchmarked result is still checked against cuBLAS)
 *   ./hopper_gemm --host-selftest   the tile schedule's coverage test on the CPU (no GPU needed)
 *   --variant N               only the library's variant N
 * No -lcuda: cuTensorMapEncodeTiled comes through cudaGetDriverEntryPointByVersion.
 *
 * ---- Variants (the library's hg::variant<V>; the launcher picks 1 where N % 256 is in (0, 128], else 0) --
 *   0 coop 128x256 3 stages, staged epilogue     1 coop 128x128 5 stages, staged epilogue
 *   "staged": through a padded shared buffer, then 16-byte coalesced global stores. The lab's first
 *   version also had register epilogues (128x256 4 stages, 128x128 6 stages: all checks passed, a few %
 *   slower) and ping-pong consumers (128x128, each warpgroup its own tiles: one hung at stage 6 with
 *   the consumer waiting for TMA bytes; not pursued): left out of the library.
 *
 * ---- Watchdogs -----------------------------------------------------------------------------------
 *   The library's bounded mbarrier waits report into an hg::watchdog in mapped pinned host memory here
 *   (role, stage, parity, tile, k-block) before trapping; the host prints it with the error. The host
 *   also polls cudaStreamQuery with a time limit after every checked launch.
 *
 * ---- Measured (H200, median of 25, TFLOP/s; the lab's own copy of the kernel before the move) -------
 *   variant 0 (then "2"): dense 4096^3 779 (cuBLAS 795); Qwen3-30B-A3B fc1 (128 groups, K 2048, N 1536,
 *   avg 256 rows) balanced 575 / uneven 549 vs cuBLAS grouped ~280; Qwen3 fc2 (K 768, N 2048) 540 / 506
 *   vs ~265; Mixtral fc1 (8 groups, K 4096, N 28672) 793 / 667; fc2 543 / 714.
 *   variant 1 (then "3"): Qwen3 fc1 579 / 538, fc2 520 / 477.
 *   Predictions written before the first run: dense 4096^3 ~600, Qwen3 fc1 ~550 / ~470, fc2 ~450,
 *   Mixtral ~650 (the staged 128x256 variant beat them everywhere but Mixtral fc2 balanced).
 */
#include <cuda.h>          // CUtensorMap and its enums (types only; no -lcuda)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#include <chrono>
#include <thread>

typedef __nv_bfloat16 bf16;

// ---- The library: megatron.cu whole (its section 13.1 holds the kernel, its launcher and the probe) ----
#include "../../megatron.cu"

// ---- Error checks: every CUDA / cuBLAS call goes through these; a failure prints one line, the
// device watchdog's report if it fired, and exits 1. ------------------------------------------------
static hg::watchdog* g_wd_host = nullptr;  // the lab's one piece of global state: read by the error path

static void print_watchdog() {
    if (g_wd_host && g_wd_host->fired)
        fprintf(stderr, "device watchdog fired: block %d thread %d %s stage %d parity %d tile %d k-block %d\n",
                g_wd_host->block, g_wd_host->thread,
                g_wd_host->role == 0 ? "(producer waiting for a free stage: consumers never released it)"
                                     : "(consumer waiting for a full stage: TMA bytes never arrived)",
                g_wd_host->stage, g_wd_host->parity, g_wd_host->tile, g_wd_host->kb);
}
static void die_cuda(cudaError_t e, const char* what, int line) {
    fprintf(stderr, "CUDA error %s (%s) at hopper_gemm.cu:%d: %s\n", cudaGetErrorName(e), cudaGetErrorString(e), line, what);
    print_watchdog();
    exit(1);
}
static void die_cublas(cublasStatus_t s, const char* what, int line) {
    fprintf(stderr, "cuBLAS error %s at hopper_gemm.cu:%d: %s\n", cublasGetStatusString(s), line, what);
    exit(1);
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) die_cuda(e_, #x, __LINE__); } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) die_cublas(s_, #x, __LINE__); } while (0)

// ---- Stage-0 probe: one TMA box loaded into shared memory and copied out as it lies there ----------
// (the library's PTX wrappers, sm_90a only)
__global__ void tma_probe_kernel(const __grid_constant__ CUtensorMap tm, int c0, int c1, uint4* out, hg::watchdog* wd,
                                 unsigned long long timeout_ns) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    uint8_t* buf = smem_raw + ((1024 - (hg::smem_u32(smem_raw) & 1023)) & 1023);
    __shared__ uint64_t bar;
    if (threadIdx.x == 0) {
        hg::mbar_init(hg::smem_u32(&bar), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        hg::mbar_arrive_expect_tx(hg::smem_u32(&bar), hg::BM * hg::BK * 2);
        hg::tma_load_2d(hg::smem_u32(buf), &tm, hg::smem_u32(&bar), c0, c1);
    }
    hg::mbar_wait(hg::smem_u32(&bar), 0, wd, timeout_ns, 1, 0, -1, 0);
    for (int i = threadIdx.x; i < hg::BM * hg::BK * 2 / 16; i += blockDim.x) out[i] = reinterpret_cast<const uint4*>(buf)[i];
#endif
}

// ---- Host side: the lab context, launches ----------------------------------------------------------
struct Lab {
    cublasHandle_t cublas = nullptr;
    cudaStream_t stream = nullptr;
    int sms = 0;
    hg::watchdog* wd_dev = nullptr;  // device view of g_wd_host
    unsigned long long timeout_ns = 4000000000ull;
    int failures = 0;
    bool skip[8] = {};  // variants not selected (--variant) or failed a check: left out of the benchmark
    mt_gpu_error error;      // the library launcher's error record ...
    mt_gemm_plans plans;     // ... and its probe's cache (hopper), zeroed
    mt_exec ex;
};

// host watchdog: wait for the stream with a time limit (a deadlocked kernel would otherwise hang here)
static void sync_or_die(Lab& L, const char* what, double limit_s = 60.0) {
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        cudaError_t e = cudaStreamQuery(L.stream);
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

// One grouped (or dense: G = 1) problem: C = per group A_g B_g^T. a_rows = rows the A and C buffers hold.
struct Problem {
    const bf16* A; int a_rows;  // [a_rows, K]
    const bf16* B;              // [G, N, K] (b_layout hg::B_NK: C_g = A_g B_g^T) or [G, K, N] (hg::B_KN: C_g = A_g B_g)
    bf16* C;                    // [a_rows, N]
    const int* m_dev;           // [G] on the device
    int G, N, K;
    int b_layout;
};

// The library's configurations (hg::variant<V>), by number
struct Variant {
    const char* name;
    int bn, stages, smem;
};
static Variant g_variants[] = {
    {"coop 128x256 3st smem", hg::variant<0>::BN, hg::variant<0>::STAGES, hg::cfg<hg::variant<0>::BN, hg::variant<0>::STAGES>::SMEM},
    {"coop 128x128 5st smem", hg::variant<1>::BN, hg::variant<1>::STAGES, hg::cfg<hg::variant<1>::BN, hg::variant<1>::STAGES>::SMEM},
};
constexpr int NVAR = sizeof(g_variants) / sizeof(g_variants[0]);
static_assert(NVAR == hg::VARIANTS, "one row per library variant");

// the library's launcher with the lab's knobs: this variant, the watchdog, 4 s waits, at most max_ctas CTAs
static void run_ours(Lab& L, const Problem& p, int variant, int max_ctas = 0) {
    hg::options o;
    o.variant = variant;
    o.max_ctas = max_ctas;
    o.wd = L.wd_dev;
    o.timeout_ns = L.timeout_ns;
    hopper_grouped_gemm(&L.ex, p.C, p.A, p.a_rows, p.B, p.b_layout, p.m_dev, p.G, p.N, p.K, &o);
    if (L.error.status != MT_OK) {
        fprintf(stderr, "hopper_grouped_gemm refused: %s\n", L.error.error.message);
        exit(2);
    }
}
// the library's tensor map builder (stage 0 reads one box through it)
static bool make_map(Lab& L, CUtensorMap* m, const bf16* p, long long rows, int K, int box_rows) {
    if (!hg_tensor_map(&L.ex, (hg_encode_tiled_fn)L.plans.hopper.encode, m, p, rows, K, box_rows)) {
        fprintf(stderr, "%s\n", L.error.error.message);
        return false;
    }
    return true;
}

// ---- cuBLAS (column-major): row-major C[M,N] = A[M,K] B[N,K]^T  <=>  C^T = B A^T with op(B) = T ----
// (B_KN: B [K, N] row-major is B^T column-major [N, K] with ld N: op N)
static void cublas_dense(Lab& L, const bf16* A, const bf16* B, bf16* C, int M, int N, int K, int layout) {
    if (M == 0) return;
    const float one = 1.f, zero = 0.f;
    const bool kn = layout == hg::B_KN;
    CB(cublasGemmEx(L.cublas, kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, kn ? N : K, A,
                    CUDA_R_16BF, K, &zero, C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
// the reference for grouped problems: one cublasGemmEx per non-empty group
static void cublas_group_loop(Lab& L, const bf16* A, const bf16* B, bf16* C, const std::vector<int>& m, int N, int K, int layout) {
    long long row = 0;
    for (size_t g = 0; g < m.size(); g++) {
        cublas_dense(L, A + row * K, B + (size_t)g * N * K, C + row * N, m[g], N, K, layout);
        row += m[g];
    }
}
// cublasGemmGroupedBatchedEx over the non-empty groups (one GEMM per group); ptr_dev holds 3 * G pointers
struct CublasGrouped {
    std::vector<cublasOperation_t> ta, tb;
    std::vector<int> M, Nn, Kk, lda, ldb, ldc, gs;
    std::vector<float> al, be;
    void** ptr_dev = nullptr;
    int count = 0;
};
static void cublas_grouped_setup(CublasGrouped& cg, const bf16* A, const bf16* B, bf16* C, const std::vector<int>& m, int N, int K,
                                 int layout) {
    std::vector<void*> a, b, c;
    long long row = 0;
    for (size_t g = 0; g < m.size(); g++) {
        if (m[g] > 0) {
            b.push_back((void*)(B + (size_t)g * N * K));  // cuBLAS's "A" (column-major C^T = B A^T)
            a.push_back((void*)(A + row * K));
            c.push_back((void*)(C + row * N));
            cg.M.push_back(N), cg.Nn.push_back(m[g]), cg.Kk.push_back(K);
        }
        row += m[g];
    }
    cg.count = (int)a.size();
    const bool kn = layout == hg::B_KN;
    cg.ta.assign(cg.count, kn ? CUBLAS_OP_N : CUBLAS_OP_T), cg.tb.assign(cg.count, CUBLAS_OP_N);
    cg.lda.assign(cg.count, kn ? N : K), cg.ldb.assign(cg.count, K), cg.ldc.assign(cg.count, N), cg.gs.assign(cg.count, 1);
    cg.al.assign(cg.count, 1.f), cg.be.assign(cg.count, 0.f);
    std::vector<void*> tab;
    tab.insert(tab.end(), b.begin(), b.end());
    tab.insert(tab.end(), a.begin(), a.end());
    tab.insert(tab.end(), c.begin(), c.end());
    CK(cudaMalloc(&cg.ptr_dev, sizeof(void*) * std::max<size_t>(tab.size(), 1)));
    CK(cudaMemcpy(cg.ptr_dev, tab.data(), sizeof(void*) * tab.size(), cudaMemcpyHostToDevice));
}
static cublasStatus_t cublas_grouped_run(Lab& L, CublasGrouped& cg) {
    if (cg.count == 0) return CUBLAS_STATUS_SUCCESS;
    void** t = cg.ptr_dev;
    return cublasGemmGroupedBatchedEx(L.cublas, cg.ta.data(), cg.tb.data(), cg.M.data(), cg.Nn.data(), cg.Kk.data(), cg.al.data(),
                                      (const void* const*)t, CUDA_R_16BF, cg.lda.data(), (const void* const*)(t + cg.count),
                                      CUDA_R_16BF, cg.ldb.data(), cg.be.data(), (void* const*)(t + 2 * cg.count), CUDA_R_16BF,
                                      cg.ldc.data(), cg.count, cg.gs.data(), CUBLAS_COMPUTE_32F);
}

// ---- Inputs and comparisons (on the GPU) -----------------------------------------------------------
__global__ void fill_uniform_kernel(bf16* p, size_t n, uint32_t seed) {  // uniform in [-1, 1), never all zero
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 0x9E3779B1u ^ (uint32_t)(i >> 32) * 0x85EBCA77u ^ seed * 0xC2B2AE3Du;
        x ^= x >> 15, x *= 0x2C1B3C6Du, x ^= x >> 12, x *= 0x297A2D39u, x ^= x >> 15;
        p[i] = __float2bfloat16((float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f);
    }
}
__global__ void fill_u16_kernel(uint16_t* p, size_t n, uint16_t v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}
static void fill_uniform(Lab& L, bf16* p, size_t n, uint32_t seed) {
    if (n) {
        fill_uniform_kernel<<<1024, 256, 0, L.stream>>>(p, n, seed);
        CK(cudaGetLastError());
    }
}
static const uint16_t SENTINEL = 0xFFFF;  // a bf16 NaN: an element the kernel never wrote fails every check
static void fill_sentinel(Lab& L, bf16* p, size_t n) {
    if (n) {
        fill_u16_kernel<<<1024, 256, 0, L.stream>>>((uint16_t*)p, n, SENTINEL);
        CK(cudaGetLastError());
    }
}

// Tolerance, per element: |ours - ref| <= 2 ulp_bf16(|ref|) + 2^-16 * K  (inputs in [-1, 1]).
// Why: both sides form exact bf16 x bf16 products (exact in fp32) and add them in fp32 in different
// orders; that difference is ~sqrt(K) * 2^-24 * sum|a b| (sum|a b| ~ K/4) typically, e.g. ~0.03 at
// K = 14336, and 2^-16 * K (0.22 there, 0.001 at K = 64) bounds it with margin; each side then rounds
// to bf16 once, so results straddling a rounding boundary differ by 1 ulp (2 allows one more for the
// fp32 difference). A real bug (a lost or repeated 16-wide k slice, a wrong row or column) moves an
// element by ~sqrt(16)/3 ~ 1.3 or more, many times the tolerance at typical magnitudes ~sqrt(K)/3.
__host__ __device__ inline float tol_of(float ref, float abs_floor) {
    float a = fabsf(ref), ulp = 0.f;
    if (a > 0.f && a < 3.0e38f) {
        int e;
        frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1): bf16's 8 significant bits give ulp = 2^(e-8)
        ulp = ldexpf(1.f, e - 8);
    }
    return 2.f * ulp + abs_floor;
}
struct CmpStats {
    unsigned long long bad, first_bad, nan_count;
    double sum_d2, sum_r2;
    float max_err;
};
__global__ void compare_kernel(const bf16* got, const bf16* ref, size_t n, float abs_floor, CmpStats* st) {
    double d2 = 0, r2 = 0;
    unsigned long long bad = 0, nans = 0, first = ~0ull;
    float mx = 0.f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = __bfloat162float(got[i]), r = __bfloat162float(ref[i]);
        float d = fabsf(g - r);
        if (isnan(g)) nans++;
        if (!(d <= tol_of(r, abs_floor))) { bad++; if (i < first) first = i; }
        if (d == d) { mx = fmaxf(mx, d); d2 += (double)d * d; }
        r2 += (double)r * r;
    }
    for (int o = 16; o; o >>= 1) {
        d2 += __shfl_xor_sync(~0u, d2, o), r2 += __shfl_xor_sync(~0u, r2, o);
        bad += __shfl_xor_sync(~0u, bad, o), nans += __shfl_xor_sync(~0u, nans, o);
        first = min(first, (unsigned long long)__shfl_xor_sync(~0u, first, o));
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&st->sum_d2, d2), atomicAdd(&st->sum_r2, r2), atomicAdd(&st->bad, bad), atomicAdd(&st->nan_count, nans);
        atomicMin(&st->first_bad, first);
        atomicMax((int*)&st->max_err, __float_as_int(mx));  // non-negative floats order like ints
    }
}
// count elements != v (the guard rows past the output must keep the sentinel); differing u16 between two buffers
__global__ void count_ne_kernel(const uint16_t* a, const uint16_t* b, uint16_t v, size_t n, unsigned long long* cnt) {
    unsigned long long c = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        c += (b ? a[i] != b[i] : a[i] != v);
    for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(~0u, c, o);
    if ((threadIdx.x & 31) == 0 && c) atomicAdd(cnt, c);
}

// ---- Test cases ----------------------------------------------------------------------------------------
static const int GUARD_ROWS = 256;  // rows of sentinel after each output: a store past the end shows up there

struct Case {
    std::vector<int> m;     // rows per group (host copy)
    int G = 0, N = 0, K = 0;
    long long rows = 0;     // sum m_g
    int a_rows = 0;         // rows the A buffer holds (>= rows: a capacity, as an MoE buffer would have)
    bf16 *A = nullptr, *B = nullptr, *C = nullptr, *Cref = nullptr;
    int* m_dev = nullptr;
    int layout = hg::B_NK;  // B [G, N, K]; hg::B_KN: [G, K, N]
    Problem problem() const { return Problem{A, a_rows, B, C, m_dev, G, N, K, layout}; }
};
static Case make_case(Lab& L, const std::vector<int>& m, int N, int K, uint32_t seed, int extra_a_rows = 0, int layout = hg::B_NK) {
    Case c;
    c.m = m, c.G = (int)m.size(), c.N = N, c.K = K, c.layout = layout;
    for (int x : m) c.rows += x;
    c.a_rows = (int)c.rows + extra_a_rows;
    CK(cudaMalloc(&c.A, sizeof(bf16) * std::max<size_t>((size_t)std::max(c.a_rows, 1) * K, 8)));
    CK(cudaMalloc(&c.B, sizeof(bf16) * (size_t)c.G * N * K));
    CK(cudaMalloc(&c.C, sizeof(bf16) * (size_t)(c.a_rows + GUARD_ROWS) * N));
    CK(cudaMalloc(&c.Cref, sizeof(bf16) * std::max<size_t>((size_t)c.rows * N, 8)));
    CK(cudaMalloc(&c.m_dev, sizeof(int) * c.G));
    CK(cudaMemcpy(c.m_dev, m.data(), sizeof(int) * c.G, cudaMemcpyHostToDevice));
    fill_uniform(L, c.A, (size_t)c.a_rows * K, seed);
    fill_uniform(L, c.B, (size_t)c.G * N * K, seed + 1);
    cublas_group_loop(L, c.A, c.B, c.Cref, m, N, K, layout);
    sync_or_die(L, "cuBLAS reference");
    return c;
}
static void free_case(Case& c) {
    CK(cudaFree(c.A));
    CK(cudaFree(c.B));
    CK(cudaFree(c.C));
    CK(cudaFree(c.Cref));
    CK(cudaFree(c.m_dev));
    c = Case();
}

// Uneven counts with mean `avg`: exponential weights (a skewed router), every 7th group empty, rounded,
// the remainder given to group 1 so the total is exactly G * avg.
static std::vector<int> uneven_counts(int G, int avg, uint32_t seed) {
    std::vector<double> w(G);
    uint64_t s = 0x9E3779B97F4A7C15ull ^ seed;
    double sum = 0;
    for (int g = 0; g < G; g++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u = ((s >> 11) + 0.5) / 9007199254740992.0;
        w[g] = (g % 7 == 3) ? 0.0 : -log(u);
        sum += w[g];
    }
    std::vector<int> m(G);
    long long total = 0;
    for (int g = 0; g < G; g++) m[g] = (int)floor((double)G * avg * w[g] / sum), total += m[g];
    m[G > 1 ? 1 : 0] += (int)((long long)G * avg - total);
    return m;
}

// Host-side look at a failed small case: where the bad elements are.
static void diagnose(const Case& c, int bn) {
    const size_t n = (size_t)c.rows * c.N;
    if (n == 0 || n > ((size_t)1 << 23)) return;
    std::vector<bf16> got(n), ref(n);
    CK(cudaMemcpy(got.data(), c.C, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ref.data(), c.Cref, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    const float floor_ = ldexpf(1.f, -16) * c.K;
    long long warpq[4] = {0}, half[2] = {0}, colpos[8] = {0}, nans = 0, zeros = 0, bad = 0;
    int shown = 0;
    std::vector<int> row_group(c.rows);
    for (int g = 0, r = 0; g < c.G; g++)
        for (int i = 0; i < c.m[g]; i++) row_group[r++] = g;
    for (long long r = 0; r < c.rows; r++)
        for (int col = 0; col < c.N; col++) {
            size_t i = (size_t)r * c.N + col;
            float gv = __bfloat162float(got[i]), rv = __bfloat162float(ref[i]);
            if (fabsf(gv - rv) <= tol_of(rv, floor_)) continue;
            bad++;
            if (gv != gv) nans++;
            if (gv == 0.f) zeros++;
            long long lr = r;  // row inside its group's tile
            int g = row_group[r];
            long long gs = 0;
            for (int h = 0; h < g; h++) gs += c.m[h];
            lr = (r - gs) % hg::BM;
            warpq[(lr % 64) / 16]++, half[(lr % 16) / 8]++, colpos[col % 8]++;
            if (shown < 6) {
                // where does the wrong value belong? search the reference over this tile's rows and all columns:
                // a hit means a layout/permutation bug (rows or columns in the wrong place), none means the
                // operands were read wrongly (descriptor, swizzle, k offsets)
                long long tr0 = r - lr, hr = -1;
                int hc = -1;
                for (long long rr = tr0; rr < std::min<long long>(tr0 + hg::BM, c.rows) && hr < 0; rr++)
                    for (int cc = 0; cc < c.N; cc++)
                        if (__bfloat162float(ref[(size_t)rr * c.N + cc]) == gv && gv != 0.f) { hr = rr, hc = cc; break; }
                fprintf(stderr, "      bad C[%lld][%d] (group %d, row %lld of its tile, col %d of its tile): got %g want %g", r, col,
                        g, lr, col % bn, gv, rv);
                if (hr >= 0) fprintf(stderr, "; got equals ref C[%lld][%d] (tile row %lld, col %d)\n", hr, hc, hr - tr0, hc % bn);
                else fprintf(stderr, "; got matches no reference element of the tile's rows\n");
                shown++;
            }
        }
    fprintf(stderr, "      %lld bad of %zu; never written (NaN sentinel) %lld; zero %lld\n", bad, n, nans, zeros);
    fprintf(stderr, "      bad by warp of the warpgroup (tile row %% 64 / 16): %lld %lld %lld %lld; by row half (row %% 16 / 8): %lld %lld\n",
            warpq[0], warpq[1], warpq[2], warpq[3], half[0], half[1]);
    fprintf(stderr, "      bad by column %% 8: %lld %lld %lld %lld %lld %lld %lld %lld\n", colpos[0], colpos[1], colpos[2], colpos[3],
            colpos[4], colpos[5], colpos[6], colpos[7]);
}

// Runs our kernel on the case, compares with the cuBLAS reference, checks the guard rows. true = pass.
static bool check_case(Lab& L, Case& c, const Variant& v, const char* what, int max_ctas = 0) {
    fill_sentinel(L, c.C, (size_t)(c.a_rows + GUARD_ROWS) * c.N);
    g_wd_host->clamped = 0;
    run_ours(L, c.problem(), (int)(&v - g_variants), max_ctas);
    sync_or_die(L, what, 20.0);
    // counters in device memory, initialised and read back through the stream
    CmpStats init;
    memset(&init, 0, sizeof init);
    init.first_bad = ~0ull;
    CmpStats* st_d;
    unsigned long long* guard_d;
    CK(cudaMalloc(&st_d, sizeof(CmpStats)));
    CK(cudaMalloc(&guard_d, sizeof(unsigned long long)));
    CK(cudaMemcpyAsync(st_d, &init, sizeof init, cudaMemcpyHostToDevice, L.stream));
    CK(cudaMemsetAsync(guard_d, 0, sizeof(unsigned long long), L.stream));
    const size_t n = (size_t)c.rows * c.N;
    const float floor_ = ldexpf(1.f, -16) * c.K;
    if (n) {
        compare_kernel<<<512, 256, 0, L.stream>>>(c.C, c.Cref, n, floor_, st_d);
        CK(cudaGetLastError());
    }
    // guard: every row from sum m_g on (the A capacity's rows and the guard rows) must be untouched
    const size_t gn = (size_t)(c.a_rows + GUARD_ROWS - c.rows) * c.N;
    count_ne_kernel<<<512, 256, 0, L.stream>>>((const uint16_t*)(c.C + n), nullptr, SENTINEL, gn, guard_d);
    CK(cudaGetLastError());
    CmpStats stv;
    unsigned long long guardv;
    CK(cudaMemcpyAsync(&stv, st_d, sizeof stv, cudaMemcpyDeviceToHost, L.stream));
    CK(cudaMemcpyAsync(&guardv, guard_d, sizeof guardv, cudaMemcpyDeviceToHost, L.stream));
    sync_or_die(L, "compare");
    CK(cudaFree(st_d));
    CK(cudaFree(guard_d));
    const CmpStats* st = &stv;
    const unsigned long long* guard = &guardv;
    const double rel = st->sum_r2 > 0 ? sqrt(st->sum_d2 / st->sum_r2) : 0.0;
    const bool ok = st->bad == 0 && *guard == 0 && rel < 1.0 / 256 && !g_wd_host->clamped;
    printf("    %-4s %-22s %-52s bad %llu/%zu  max|d| %.3g  rel %.2e  guard %llu\n", ok ? "PASS" : "FAIL", v.name, what, st->bad, n,
           st->max_err, rel, *guard);
    if (!ok) {
        if (st->bad) {
            size_t i = st->first_bad;
            fprintf(stderr, "      first bad element C[%zu][%zu]; NaN (never written) %llu\n", i / c.N, i % c.N, st->nan_count);
        }
        if (*guard) fprintf(stderr, "      %llu elements written past the last row (masking of rows past the end is broken)\n", *guard);
        if (g_wd_host->clamped) fprintf(stderr, "      the schedule clamped rows: sum m_g > a_rows\n");
        diagnose(c, v.bn);
        L.failures++;
    }
    return ok;
}

// two runs, bitwise equal
static bool check_repeat(Lab& L, Case& c, const Variant& v, const char* what) {
    const size_t n = (size_t)c.rows * c.N;
    bf16* first;
    CK(cudaMalloc(&first, sizeof(bf16) * std::max<size_t>(n, 1)));
    run_ours(L, c.problem(), (int)(&v - g_variants));
    sync_or_die(L, what);
    CK(cudaMemcpyAsync(first, c.C, sizeof(bf16) * n, cudaMemcpyDeviceToDevice, L.stream));
    fill_sentinel(L, c.C, n);
    unsigned long long* cnt_d;
    CK(cudaMalloc(&cnt_d, sizeof(unsigned long long)));
    CK(cudaMemsetAsync(cnt_d, 0, sizeof(unsigned long long), L.stream));
    run_ours(L, c.problem(), (int)(&v - g_variants));
    count_ne_kernel<<<512, 256, 0, L.stream>>>((const uint16_t*)c.C, (const uint16_t*)first, 0, n, cnt_d);
    CK(cudaGetLastError());
    unsigned long long cntv;
    CK(cudaMemcpyAsync(&cntv, cnt_d, sizeof cntv, cudaMemcpyDeviceToHost, L.stream));
    sync_or_die(L, what);
    CK(cudaFree(cnt_d));
    const unsigned long long* cnt = &cntv;
    const bool ok = *cnt == 0;
    printf("    %-4s %-22s %-52s %llu of %zu elements differ between two runs\n", ok ? "PASS" : "FAIL", v.name, what, *cnt, n);
    if (!ok) L.failures++;
    CK(cudaFree(first));
    return ok;
}

// Stage 0: TMA alone. Loads a 64 x 128 box at (c0, c1) of A [rows, K] and checks every element's place
// in shared memory against the 128-byte swizzle: element (r, k) at byte r*128 + ((k/8) ^ (r%8))*16 + (k%8)*2,
// zero where the box lies past the tensor.
static bool check_tma(Lab& L) {
    const int rows = 200, K = 128, c0 = 64, c1 = 100;  // rows 100..227 of which 200..227 are out of bounds
    bf16* A;
    uint4* out;
    CK(cudaMalloc(&A, sizeof(bf16) * rows * K));
    CK(cudaMalloc(&out, hg::BM * hg::BK * 2));
    fill_uniform(L, A, (size_t)rows * K, 7);
    CUtensorMap tm;
    if (!make_map(L, &tm, A, rows, K, hg::BM)) exit(1);
    CK(cudaFuncSetAttribute(tma_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hg::BM * hg::BK * 2 + 1024));
    tma_probe_kernel<<<1, 128, hg::BM * hg::BK * 2 + 1024, L.stream>>>(tm, c0, c1, out, L.wd_dev, L.timeout_ns);
    CK(cudaGetLastError());
    sync_or_die(L, "TMA probe", 20.0);
    std::vector<uint16_t> a((size_t)rows * K), s(hg::BM * hg::BK);
    CK(cudaMemcpy(a.data(), A, a.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(s.data(), out, s.size() * 2, cudaMemcpyDeviceToHost));
    long long bad_swz = 0, bad_plain = 0;
    for (int r = 0; r < hg::BM; r++)
        for (int k = 0; k < hg::BK; k++) {
            uint16_t want = (c1 + r < rows) ? a[(size_t)(c1 + r) * K + c0 + k] : 0;
            bad_swz += s[(r * 128 + ((k / 8) ^ (r % 8)) * 16 + (k % 8) * 2) / 2] != want;
            bad_plain += s[r * 64 + k] != want;
        }
    const bool ok = bad_swz == 0;
    printf("    %-4s TMA box 64x128, 128-byte swizzle, rows past the end zero-filled: %lld of %d elements misplaced%s\n",
           ok ? "PASS" : "FAIL", bad_swz, hg::BM * hg::BK,
           ok ? "" : (bad_plain == 0 ? " (the data is there UNSWIZZLED: the map's swizzle mode is not applied)" : ""));
    if (!ok) L.failures++;
    CK(cudaFree(A));
    CK(cudaFree(out));
    return ok;
}

// ---- Stage 9: the experts' weight gradient, hopper_grouped_wgrad ----------------------------------------
// dW_g [M, N] (fp32) = beta dW_g + dY_g^T X_g, dY [a_rows, M] and X [a_rows, N] with the groups' rows
// concatenated. Reference: cuBLAS, one cublasGemmEx per group (fp32 out, the same beta), empty groups by
// hand (zeroed where beta == 0, else untouched). Rows of dY and X past the groups' sum are NaN: a partial
// last k-block that let them in (the shared-memory zeroing failing) turns the last group's dW into NaN.
// With beta 0 dW starts as NaN (every element, empty groups' too, must be written); with beta 1 it starts
// random (and the reference starts from the same values).
// Tolerance, per element: |ours - ref| <= 2^-16 n_max + 2^-22 |ref|. Why: both sides add the same exact
// bf16 x bf16 products (exact in fp32) in fp32 in different orders, ~sqrt(n) 2^-24 sum|a b| apart (sum|a b|
// ~ n / 4 for inputs in [-1, 1]), e.g. ~1e-4 at n = 1500, and the lab's 2^-16 n floor (0.023 there) bounds
// it with margin; beta 1 adds one fp32 rounding of the sum on each side (2^-22 |ref| covers both). A lost,
// repeated or foreign 16-row k slice moves an element by ~sqrt(16) / 3 ~ 1.3: far above it.
__global__ void fill_f32_kernel(float* p, size_t n, uint32_t seed, int nan) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 0x9E3779B1u ^ (uint32_t)(i >> 32) * 0x85EBCA77u ^ seed * 0xC2B2AE3Du;
        x ^= x >> 15, x *= 0x2C1B3C6Du, x ^= x >> 12, x *= 0x297A2D39u, x ^= x >> 15;
        p[i] = nan ? __int_as_float(0x7FFFFFFF) : (float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
}
__global__ void compare_f32_kernel(const float* got, const float* ref, size_t n, float abs_floor, unsigned long long* bad_nan_diff) {
    unsigned long long bad = 0, nans = 0, diff = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = got[i], r = ref[i];
        nans += isnan(g);
        bad += !(fabsf(g - r) <= abs_floor + ldexpf(fabsf(r), -22));
        diff += __float_as_uint(g) != __float_as_uint(r);
    }
    for (int o = 16; o; o >>= 1) {
        bad += __shfl_xor_sync(~0u, bad, o), nans += __shfl_xor_sync(~0u, nans, o), diff += __shfl_xor_sync(~0u, diff, o);
    }
    if ((threadIdx.x & 31) == 0) atomicAdd(&bad_nan_diff[0], bad), atomicAdd(&bad_nan_diff[1], nans), atomicAdd(&bad_nan_diff[2], diff);
}
struct WCase {
    std::vector<int> m;
    int G = 0, M = 0, N = 0, a_rows = 0, n_max = 0;
    long long rows = 0;
    bf16 *dY = nullptr, *X = nullptr;
    float *dW = nullptr, *ref = nullptr, *first = nullptr;
    int* m_dev = nullptr;
    size_t out() const { return (size_t)G * M * N; }
};
static WCase make_wcase(Lab& L, const std::vector<int>& m, int M, int N, uint32_t seed, int extra_rows) {
    WCase c;
    c.m = m, c.G = (int)m.size(), c.M = M, c.N = N;
    for (int x : m) c.rows += x, c.n_max = std::max(c.n_max, x);
    c.a_rows = (int)c.rows + extra_rows;
    const size_t ar = std::max<size_t>(c.a_rows, 1);
    CK(cudaMalloc(&c.dY, sizeof(bf16) * ar * M));
    CK(cudaMalloc(&c.X, sizeof(bf16) * ar * N));
    CK(cudaMalloc(&c.dW, sizeof(float) * c.out()));
    CK(cudaMalloc(&c.ref, sizeof(float) * c.out()));
    CK(cudaMalloc(&c.first, sizeof(float) * c.out()));
    CK(cudaMalloc(&c.m_dev, sizeof(int) * c.G));
    fill_uniform(L, c.dY, (size_t)c.rows * M, seed);
    fill_uniform(L, c.X, (size_t)c.rows * N, seed + 1000);
    fill_sentinel(L, c.dY + (size_t)c.rows * M, (size_t)extra_rows * M);  // NaN rows past the sum
    fill_sentinel(L, c.X + (size_t)c.rows * N, (size_t)extra_rows * N);
    CK(cudaMemcpyAsync(c.m_dev, m.data(), sizeof(int) * c.G, cudaMemcpyHostToDevice, L.stream));
    sync_or_die(L, "make_wcase");
    return c;
}
static void free_wcase(WCase& c) {
    CK(cudaFree(c.dY));
    CK(cudaFree(c.X));
    CK(cudaFree(c.dW));
    CK(cudaFree(c.ref));
    CK(cudaFree(c.first));
    CK(cudaFree(c.m_dev));
}
static void run_wgrad(Lab& L, const WCase& c, int variant, float beta, int max_ctas = 0) {
    hg::options o;
    o.variant = variant, o.max_ctas = max_ctas, o.wd = L.wd_dev, o.timeout_ns = L.timeout_ns;
    hopper_grouped_wgrad(&L.ex, c.dW, c.dY, c.X, c.a_rows, c.m_dev, c.G, c.M, c.N, beta, &o);
    if (L.error.status != MT_OK) {
        fprintf(stderr, "hopper_grouped_wgrad refused: %s\n", L.error.error.message);
        exit(2);
    }
}
// the reference (and today's library path): row-major dW_g [M, N] = dY_g^T X_g is column-major dW_g^T [N, M] =
// X_g^T (col-major [N, n], op N) times dY_g (col-major [M, n], op T)
static void cublas_wgrad(Lab& L, const WCase& c, float* dW, float beta) {
    long long r0 = 0;
    const float one = 1.f;
    for (int g = 0; g < c.G; r0 += c.m[g], g++) {
        float* D = dW + (size_t)g * c.M * c.N;
        if (c.m[g] == 0) {
            if (beta == 0.f) CK(cudaMemsetAsync(D, 0, sizeof(float) * (size_t)c.M * c.N, L.stream));
            continue;
        }
        CB(cublasGemmEx(L.cublas, CUBLAS_OP_N, CUBLAS_OP_T, c.N, c.M, c.m[g], &one, c.X + (size_t)r0 * c.N, CUDA_R_16BF, c.N,
                        c.dY + (size_t)r0 * c.M, CUDA_R_16BF, c.M, &beta, D, CUDA_R_32F, c.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}
// dW's start: NaN (beta 0: every element must be written) or random values (beta 1)
static void wgrad_start(Lab& L, WCase& c, float* p, float beta) {
    fill_f32_kernel<<<1024, 256, 0, L.stream>>>(p, c.out(), 77u + (uint32_t)c.G, beta == 0.f);
    CK(cudaGetLastError());
}
// counts on the device: [0] elements out of tolerance, [1] NaNs in got, [2] elements not bitwise equal
static void wgrad_compare(Lab& L, const WCase& c, const float* got, const float* ref, unsigned long long cnt[3], const char* what) {
    unsigned long long* cnt_d;
    CK(cudaMalloc(&cnt_d, 3 * sizeof(unsigned long long)));
    CK(cudaMemsetAsync(cnt_d, 0, 3 * sizeof(unsigned long long), L.stream));
    compare_f32_kernel<<<512, 256, 0, L.stream>>>(got, ref, c.out(), ldexpf((float)std::max(c.n_max, 1), -16), cnt_d);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(cnt, cnt_d, 3 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, L.stream));
    sync_or_die(L, what);
    CK(cudaFree(cnt_d));
}
// per element against cuBLAS from the same start
static bool check_wgrad(Lab& L, WCase& c, int vi, float beta, const char* what, int max_ctas = 0) {
    wgrad_start(L, c, c.dW, beta);
    wgrad_start(L, c, c.ref, beta);
    cublas_wgrad(L, c, c.ref, beta);
    run_wgrad(L, c, vi, beta, max_ctas);
    unsigned long long cnt[3];
    wgrad_compare(L, c, c.dW, c.ref, cnt, what);
    const bool ok = cnt[0] == 0 && cnt[1] == 0;
    printf("    %-4s %-22s %-46s beta %g: %llu of %zu elements off (%llu NaN)\n", ok ? "PASS" : "FAIL", g_variants[vi].name, what,
           (double)beta, cnt[0], c.out(), cnt[1]);
    if (!ok) L.failures++;
    return ok;
}
// two runs from the same start: bitwise the same (all SMs, then 3 CTAs: another tile order per CTA)
static bool check_wgrad_repeat(Lab& L, WCase& c, int vi, float beta, const char* what) {
    wgrad_start(L, c, c.dW, beta);
    run_wgrad(L, c, vi, beta);
    CK(cudaMemcpyAsync(c.first, c.dW, sizeof(float) * c.out(), cudaMemcpyDeviceToDevice, L.stream));
    wgrad_start(L, c, c.dW, beta);
    run_wgrad(L, c, vi, beta, 3);
    unsigned long long cnt[3];
    wgrad_compare(L, c, c.dW, c.first, cnt, what);
    const bool ok = cnt[2] == 0;
    printf("    %-4s %-22s %-46s beta %g: %llu of %zu elements differ between two runs (all SMs, 3 CTAs)\n", ok ? "PASS" : "FAIL",
           g_variants[vi].name, what, (double)beta, cnt[2], c.out());
    if (!ok) L.failures++;
    return ok;
}
static void run_wgrad_checks(Lab& L, int vi) {
    const int bn = g_variants[vi].bn;
    char what[128];
    { WCase c = make_wcase(L, {64}, 128, bn, 41, 0); snprintf(what, sizeof what, "G 1 n 64 M 128 N %d (one tile, one k-block)", bn);
      check_wgrad(L, c, vi, 0.f, what); free_wcase(c); }
    { WCase c = make_wcase(L, {1000}, 256, 512, 42, 64); check_wgrad(L, c, vi, 0.f, "G 1 n 1000 (partial k-block) M 256 N 512, +64 NaN rows");
      check_wgrad(L, c, vi, 1.f, "  the same"); check_wgrad(L, c, vi, 0.f, "  the same on 3 CTAs", 3); free_wcase(c); }
    { WCase c = make_wcase(L, {0, 1, 300, 129, 0}, 264, 200, 43, 77);
      check_wgrad(L, c, vi, 0.f, "G 5 n {0,1,300,129,0} M 264 N 200, +77 NaN rows"); check_wgrad(L, c, vi, 1.f, "  the same"); free_wcase(c); }
    { WCase c = make_wcase(L, {0, 0, 0}, 128, 256, 44, 5); check_wgrad(L, c, vi, 0.f, "G 3 n {0,0,0} (zeros only)");
      check_wgrad(L, c, vi, 1.f, "  the same (untouched)"); free_wcase(c); }
    { WCase c = make_wcase(L, uneven_counts(16, 200, 45), 768, 384, 45, 33);
      check_wgrad(L, c, vi, 1.f, "G 16 uneven avg 200 M 768 N 384"); check_wgrad(L, c, vi, 1.f, "  the same on 5 CTAs", 5); free_wcase(c); }
    { WCase c = make_wcase(L, uneven_counts(128, 256, 46), 1536, 2048, 46, 0);
      check_wgrad(L, c, vi, 0.f, "G 128 uneven avg 256 M 1536 N 2048 (Qwen3 fc1)"); check_wgrad(L, c, vi, 1.f, "  the same");
      check_wgrad_repeat(L, c, vi, 1.f, "  the same"); free_wcase(c); }
}
static void stage(const char* title, const char* if_fails) {
    printf("\n  %s\n    (a failure here, with the stages above passing, points at: %s)\n", title, if_fails);
}

static void run_checks(Lab& L) {
    printf("== checks (vs cuBLAS cublasGemmEx bf16 in/out, fp32 compute; tolerance 2 bf16 ulp + 2^-16*K per element) ==\n");
    stage("stage 0: TMA load into swizzled shared memory", "the tensor map (cuTensorMapEncodeTiled arguments), cp.async.bulk.tensor or mbarrier tx counting");
    if (!check_tma(L))
        for (int vi = 0; vi < NVAR; vi++) L.skip[vi] = true;  // nothing built on TMA can work
    for (int vi = 0; vi < NVAR; vi++) {
        if (L.skip[vi]) continue;
        const int failures_before = L.failures;
        const Variant& v = g_variants[vi];
        const int bn = v.bn;
        printf("\n -- variant %d: %s --\n", vi, v.name);
        char what[128];
        stage("stage 1: one tile, one k-block", "wgmma descriptors (swizzle mode, SBO), the k-slice advance, the accumulator -> (row, col) map or the epilogue");
        { Case c = make_case(L, {128}, bn, 64, 11); snprintf(what, sizeof what, "M 128 N %d K 64", bn); check_case(L, c, v, what); free_case(c); }
        stage("stage 2: one tile, many k-blocks (the stage ring wraps several times)", "mbarrier phases, stage release (empty barrier counts), wgmma.wait_group");
        { Case c = make_case(L, {128}, bn, 1024, 12); snprintf(what, sizeof what, "M 128 N %d K 1024", bn); check_case(L, c, v, what); free_case(c); }
        stage("stage 3: many tiles, at most one per CTA", "the tile decode, the raster order, the epilogue's row/column offsets");
        { Case c = make_case(L, {512}, 1024, 512, 13); check_case(L, c, v, "M 512 N 1024 K 512"); free_case(c); }
        stage("stage 4: persistent CTAs, many tiles per CTA", "phases carried across tiles, the producer running ahead into the next tile");
        { Case c = make_case(L, {2048}, 1024, 256, 14); check_case(L, c, v, "M 2048 N 1024 K 256 on 5 CTAs", 5); check_case(L, c, v, "M 2048 N 1024 K 256 all SMs"); free_case(c); }
        { Case c = make_case(L, {4096}, 2048, 128, 15); check_case(L, c, v, "M 4096 N 2048 K 128"); free_case(c); }
        stage("stage 5: edges (M, N, K not multiples of the tile)", "masking of rows/columns, zero fill past K");
        { Case c = make_case(L, {1000}, 1000, 200, 16); check_case(L, c, v, "M 1000 N 1000 K 200"); free_case(c); }
        { Case c = make_case(L, {129}, 264, 72, 17); check_case(L, c, v, "M 129 N 264 K 72"); free_case(c); }
        { Case c = make_case(L, {1}, 8, 8, 18); check_case(L, c, v, "M 1 N 8 K 8"); free_case(c); }
        stage("stage 6: grouped, small (uneven m_g, zeros)", "the device-side schedule (prefix sums), group offsets of A/B/C, masking at group ends");
        { Case c = make_case(L, {0, 1, 300, 129}, 512, 256, 19); check_case(L, c, v, "G 4 m {0,1,300,129} N 512 K 256"); free_case(c); }
        { Case c = make_case(L, {0, 0, 0}, 256, 64, 20); check_case(L, c, v, "G 3 m {0,0,0} (nothing to do)"); free_case(c); }
        { Case c = make_case(L, uneven_counts(16, 200, 21), 768, 384, 21, 77);
          check_case(L, c, v, "G 16 uneven N 768 K 384, A capacity +77 rows"); check_case(L, c, v, "  the same on 3 CTAs", 3); free_case(c); }
        { Case c = make_case(L, uneven_counts(40, 37, 22), 136, 4104, 22); check_case(L, c, v, "G 40 uneven avg 37 N 136 K 4104"); free_case(c); }
        stage("stage 7: grouped at an MoE shape, and bitwise repeatability", "(if only repeatability fails) a race in the pipeline");
        { Case c = make_case(L, uneven_counts(128, 256, 23), 1536, 2048, 23); check_case(L, c, v, "G 128 uneven avg 256 N 1536 K 2048");
          check_repeat(L, c, v, "G 128 uneven avg 256 N 1536 K 2048"); free_case(c); }
        { Case c = make_case(L, {2048}, 2048, 2048, 24); check_case(L, c, v, "M 2048 N 2048 K 2048");
          check_repeat(L, c, v, "M 2048 N 2048 K 2048"); free_case(c); }
        stage("stage 8: B [K, N] (the input gradient's dx = dy W: N-major B, wgmma's transposed B)",
              "the N-major descriptor (leading byte offset 8 KiB between 64-column boxes, stride 1024 between 8-row groups), "
              "the B boxes' coordinates, the transpose bit");
        { Case c = make_case(L, {128}, bn, 64, 31, 0, hg::B_KN); snprintf(what, sizeof what, "B[K,N] M 128 N %d K 64", bn); check_case(L, c, v, what); free_case(c); }
        { Case c = make_case(L, {128}, bn, 1024, 32, 0, hg::B_KN); snprintf(what, sizeof what, "B[K,N] M 128 N %d K 1024", bn); check_case(L, c, v, what); free_case(c); }
        { Case c = make_case(L, {1000}, 1000, 200, 33, 0, hg::B_KN); check_case(L, c, v, "B[K,N] M 1000 N 1000 K 200"); free_case(c); }
        { Case c = make_case(L, {0, 1, 300, 129}, 512, 264, 34, 0, hg::B_KN); check_case(L, c, v, "B[K,N] G 4 m {0,1,300,129} N 512 K 264"); free_case(c); }
        { Case c = make_case(L, uneven_counts(16, 200, 35), 768, 384, 35, 77, hg::B_KN);
          check_case(L, c, v, "B[K,N] G 16 uneven N 768 K 384, +77 rows"); check_case(L, c, v, "  the same on 3 CTAs", 3); free_case(c); }
        { Case c = make_case(L, uneven_counts(128, 256, 36), 2048, 1536, 36, 0, hg::B_KN); check_case(L, c, v, "B[K,N] G 128 uneven N 2048 K 1536");
          check_repeat(L, c, v, "B[K,N] G 128 uneven N 2048 K 1536"); free_case(c); }
        stage("stage 9: the experts' weight gradient dW_g = beta dW_g + dY_g^T X_g (hopper_grouped_wgrad: both operands MN-major)",
              "(one tile) wgmma's transposed A (imm-trans-a) or the A boxes' coordinates; (partial k-block) the shared-memory "
              "zeroing of rows past the group, its proxy fence or named barrier; (empty groups) the beta 0 zero store; "
              "(beta 1) the fp32 read-add-write");
        run_wgrad_checks(L, vi);
        if (L.failures > failures_before) {
            printf(" -- variant %d FAILED: left out of the benchmark --\n", vi);
            L.skip[vi] = true;
        }
    }
    printf("\n== checks: %s (%d failed) ==\n", L.failures ? "FAILED" : "all passed", L.failures);
}

// ---- Benchmark -------------------------------------------------------------------------------------------
// median of `iters` CUDA-event timings of f() after `warm` warm-up calls (back-to-back launches; the
// operands here are larger than L2 or reused as a training step would reuse them, so no L2 flush)
template <class F>
static double median_ms(Lab& L, F f, int warm = 5, int iters = 25) {
    for (int i = 0; i < warm; i++) f();
    sync_or_die(L, "warm-up");
    std::vector<cudaEvent_t> ev(2 * iters);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (int i = 0; i < iters; i++) {
        CK(cudaEventRecord(ev[2 * i], L.stream));
        f();
        CK(cudaEventRecord(ev[2 * i + 1], L.stream));
    }
    sync_or_die(L, "timing");
    std::vector<float> t(iters);
    for (int i = 0; i < iters; i++) CK(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
    for (auto& e : ev) CK(cudaEventDestroy(e));
    std::sort(t.begin(), t.end());
    return t[iters / 2];
}

struct BenchRow {
    char name[64];
    double flop;
    double ours_ms[NVAR];
    bool ours_ok[NVAR];
    double dense_ms, grouped_ms;  // cuBLAS: one GEMM of the same total FLOPs; cublasGemmGroupedBatchedEx (< 0: none)
};

static BenchRow bench_case(Lab& L, const char* name, const std::vector<int>& m, int N, int K, uint32_t seed, int layout = hg::B_NK) {
    BenchRow row;
    snprintf(row.name, sizeof row.name, "%s", name);
    printf("  %s: G %zu, rows %lld, N %d, K %d\n", name, m.size(), [&] { long long s = 0; for (int x : m) s += x; return s; }(), N, K);
    fflush(stdout);
    Case c = make_case(L, m, N, K, seed, 0, layout);
    row.flop = 2.0 * (double)c.rows * N * K;
    for (int vi = 0; vi < NVAR; vi++) {
        row.ours_ok[vi] = false, row.ours_ms[vi] = -1;
        if (L.skip[vi]) continue;
        row.ours_ok[vi] = check_case(L, c, g_variants[vi], name);
        row.ours_ms[vi] = median_ms(L, [&] { run_ours(L, c.problem(), vi); });
    }
    bf16* Cd;
    CK(cudaMalloc(&Cd, sizeof(bf16) * std::max<size_t>((size_t)c.rows * N, 8)));
    row.dense_ms = median_ms(L, [&] { cublas_dense(L, c.A, c.B, Cd, (int)c.rows, N, K, layout); });
    row.grouped_ms = -1;
    if (c.G > 1) {
        CublasGrouped cg;
        cublas_grouped_setup(cg, c.A, c.B, Cd, m, N, K, layout);
        cublasStatus_t s = cublas_grouped_run(L, cg);
        if (s == CUBLAS_STATUS_SUCCESS) {
            row.grouped_ms = median_ms(L, [&] { cublas_grouped_run(L, cg); });
        } else {
            printf("    cublasGemmGroupedBatchedEx: %s\n", cublasGetStatusString(s));
        }
        CK(cudaFree(cg.ptr_dev));
    }
    CK(cudaFree(Cd));
    free_case(c);
    // the row right away (a later case that dies would otherwise take the table with it)
    printf("    TFLOP/s:");
    for (int vi = 0; vi < NVAR; vi++)
        if (row.ours_ms[vi] > 0) printf(" [%d] %.0f%s", vi, row.flop / (row.ours_ms[vi] * 1e9), row.ours_ok[vi] ? "" : " (WRONG)");
    printf(" | cuBLAS dense %.0f", row.flop / (row.dense_ms * 1e9));
    if (row.grouped_ms > 0) printf(" | cuBLAS grouped %.0f", row.flop / (row.grouped_ms * 1e9));
    printf("\n");
    return row;
}

// benchmark rows: ours against cuBLAS one GEMM per expert (the library's path before this kernel)
static void bench_wgrad(Lab& L, const char* name, const std::vector<int>& m, int M, int N, uint32_t seed) {
    WCase c = make_wcase(L, m, M, N, seed, 0);
    const double flop = 2.0 * (double)c.rows * M * N;
    printf("  %s: G %d, rows %lld, dW [%d, %d] fp32, beta 1\n    TFLOP/s:", name, c.G, c.rows, M, N);
    for (int vi = 0; vi < NVAR; vi++) {
        if (L.skip[vi]) continue;
        const bool ok = check_wgrad(L, c, vi, 1.f, name);
        const double ms = median_ms(L, [&] { run_wgrad(L, c, vi, 1.f); });
        printf("    [%d] %.0f%s", vi, flop / (ms * 1e9), ok ? "" : " (WRONG)");
    }
    const double ms = median_ms(L, [&] { cublas_wgrad(L, c, c.ref, 1.f); });
    printf(" | cuBLAS per expert %.0f\n", flop / (ms * 1e9));
    free_wcase(c);
}
static void run_bench(Lab& L) {
    printf("\n== benchmark (median of 25 CUDA-event timings after 5 warm-ups) ==\n");
    std::vector<BenchRow> rows;
    rows.push_back(bench_case(L, "dense 4096^3", {4096}, 4096, 4096, 101));
    rows.push_back(bench_case(L, "dense 8192^3", {8192}, 8192, 8192, 102));
    rows.push_back(bench_case(L, "qwen3 fc1 balanced", std::vector<int>(128, 256), 1536, 2048, 103));
    rows.push_back(bench_case(L, "qwen3 fc1 uneven", uneven_counts(128, 256, 104), 1536, 2048, 104));
    rows.push_back(bench_case(L, "qwen3 fc2 balanced", std::vector<int>(128, 256), 2048, 768, 105));
    rows.push_back(bench_case(L, "qwen3 fc2 uneven", uneven_counts(128, 256, 106), 2048, 768, 106));
    rows.push_back(bench_case(L, "mixtral fc1 balanced", std::vector<int>(8, 1024), 28672, 4096, 107));
    rows.push_back(bench_case(L, "mixtral fc1 uneven", uneven_counts(8, 1024, 108), 28672, 4096, 108));
    rows.push_back(bench_case(L, "mixtral fc2 balanced", std::vector<int>(8, 1024), 4096, 14336, 109));
    rows.push_back(bench_case(L, "mixtral fc2 uneven", uneven_counts(8, 1024, 110), 4096, 14336, 110));
    // the input gradients dx = dy W (B [K, N]): fc1's dx [rows, h] from dz [rows, 2 fe], fc2's from dy [rows, h]
    rows.push_back(bench_case(L, "qwen3 fc1 dgrad uneven", uneven_counts(128, 256, 111), 2048, 1536, 111, hg::B_KN));
    rows.push_back(bench_case(L, "qwen3 fc2 dgrad uneven", uneven_counts(128, 256, 112), 768, 2048, 112, hg::B_KN));
    rows.push_back(bench_case(L, "mixtral fc1 dgrad uneven", uneven_counts(8, 1024, 113), 4096, 28672, 113, hg::B_KN));
    rows.push_back(bench_case(L, "mixtral fc2 dgrad uneven", uneven_counts(8, 1024, 114), 14336, 4096, 114, hg::B_KN));

    // the experts' weight gradients dW_e = dy_e^T x_e: fc1's [2 fe, h] from dz and x, fc2's [h, fe] from dy and act
    bench_wgrad(L, "qwen3 fc1 wgrad uneven", uneven_counts(128, 256, 115), 1536, 2048, 115);
    bench_wgrad(L, "qwen3 fc2 wgrad uneven", uneven_counts(128, 256, 116), 2048, 768, 116);
    bench_wgrad(L, "qwen3 fc1 wgrad balanced", std::vector<int>(128, 256), 1536, 2048, 117);
    bench_wgrad(L, "mixtral fc2 wgrad uneven", uneven_counts(8, 1024, 118), 4096, 14336, 118);
    printf("\n| case | GFLOP |");
    for (int vi = 0; vi < NVAR; vi++) printf(" %s TFLOP/s |", g_variants[vi].name);
    printf(" cuBLAS dense same FLOPs | cuBLAS grouped | best ours / cuBLAS dense |\n|---|---|");
    for (int vi = 0; vi < NVAR; vi++) printf("---|");
    printf("---|---|---|\n");
    for (auto& r : rows) {
        printf("| %s | %.0f |", r.name, r.flop / 1e9);
        double best = 0;
        for (int vi = 0; vi < NVAR; vi++) {
            if (r.ours_ms[vi] < 0) {
                printf(" - |");
                continue;
            }
            double tf = r.flop / (r.ours_ms[vi] * 1e9);
            printf(" %.0f%s |", tf, r.ours_ok[vi] ? "" : " (WRONG)");
            if (r.ours_ok[vi]) best = std::max(best, tf);
        }
        double dense = r.flop / (r.dense_ms * 1e9);
        printf(" %.0f |", dense);
        if (r.grouped_ms > 0) printf(" %.0f |", r.flop / (r.grouped_ms * 1e9)); else printf(" - |");
        printf(" %.0f%% |\n", 100.0 * best / dense);
    }
}

// ---- Host self-test of the schedule (no GPU): every output (row, column tile) covered exactly once, no
// tile straddling a group. Mirrors build_schedule's arithmetic on the CPU. ---------------------------------
static int host_selftest() {
    struct T { std::vector<int> m; int N, bn, a_rows_extra; };
    std::vector<T> tests = {{{128}, 256, 256, 0},          {{1000}, 1000, 256, 0},       {{0, 1, 300, 129}, 512, 128, 0},
                            {{0, 0, 0}, 256, 256, 0},      {uneven_counts(16, 200, 21), 768, 256, 77},
                            {uneven_counts(128, 256, 23), 1536, 256, 0}, {uneven_counts(128, 256, 23), 1536, 128, 0},
                            {std::vector<int>(8, 1024), 28672, 256, 0},  {uneven_counts(40, 37, 22), 136, 128, 0},
                            {{5, 0, 4000, 1, 0, 127, 128, 129}, 2048, 256, 0}};
    int fails = 0;
    for (auto& t : tests) {
        const int G = (int)t.m.size(), ntn = (t.N + t.bn - 1) / t.bn;
        std::vector<int> ts(G + 1, 0), rs(G + 1, 0);
        long long rows = 0;
        for (int g = 0; g < G; g++) {
            rows += t.m[g];
            rs[g + 1] = (int)rows;
            ts[g + 1] = ts[g] + ((t.m[g] + hg::BM - 1) / hg::BM) * ntn;
        }
        std::vector<int> cover((size_t)rows * ntn, 0);
        bool ok = true;
        for (int tile = 0; tile < ts[G]; tile++) {
            hg::tile_coord c = hg::decode_tile(tile, ts.data(), rs.data(), G, ntn, t.bn);
            if (c.g < 0 || c.g >= G || c.m0 < rs[c.g] || c.m0 >= rs[c.g + 1] || c.m_end != rs[c.g + 1] || c.n0 % t.bn || c.n0 >= t.N ||
                (c.m0 - rs[c.g]) % hg::BM) {
                fprintf(stderr, "tile %d decodes to group %d rows %d.. n0 %d: outside its group\n", tile, c.g, c.m0, c.n0);
                ok = false;
                break;
            }
            for (int r = c.m0; r < std::min(c.m0 + hg::BM, c.m_end); r++) cover[(size_t)r * ntn + c.n0 / t.bn]++;
        }
        for (size_t i = 0; ok && i < cover.size(); i++)
            if (cover[i] != 1) {
                fprintf(stderr, "row %zu column tile %zu covered %d times\n", i / ntn, i % ntn, cover[i]);
                ok = false;
            }
        printf("%s schedule G %d rows %lld N %d BN %d: %d tiles\n", ok ? "PASS" : "FAIL", G, rows, t.N, t.bn, ts[G]);
        fails += !ok;
    }
    printf("host self-test: %s\n", fails ? "FAILED" : "all passed");
    return fails ? 1 : 0;
}

int main(int argc, char** argv) {
    bool do_check = true, do_bench = true;
    int only = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--check")) do_bench = false;
        else if (!strcmp(argv[i], "--variant") && i + 1 < argc) {
            char* end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v >= NVAR) {
                fprintf(stderr, "--variant takes 0..%d\n", NVAR - 1);
                return 2;
            }
            only = (int)v;
        }
        else if (!strcmp(argv[i], "--bench")) do_check = false;
        else if (!strcmp(argv[i], "--host-selftest")) return host_selftest();
        else {
            fprintf(stderr, "usage: %s [--check | --bench | --host-selftest] [--variant N]\n", argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, nullptr, _IOLBF, 0);
    Lab L;
    int dev = 0;
    CK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s, sm_%d%d, %d SMs, %zu KiB shared memory per block (opt-in)\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, prop.sharedMemPerBlockOptin / 1024);
    if (prop.major != 9) {
        fprintf(stderr, "this lab needs an sm_90 (Hopper) GPU: wgmma/setmaxnreg are sm_90a instructions\n");
        return 1;
    }
    L.sms = prop.multiProcessorCount;
    for (int vi = 0; vi < NVAR; vi++) L.skip[vi] = only >= 0 && vi != only;
    CK(cudaStreamCreateWithFlags(&L.stream, cudaStreamNonBlocking));
    CB(cublasCreate(&L.cublas));
    CB(cublasSetStream(L.cublas, L.stream));
    CK(cudaHostAlloc((void**)&g_wd_host, sizeof(hg::watchdog), cudaHostAllocMapped));
    memset((void*)g_wd_host, 0, sizeof(hg::watchdog));
    CK(cudaHostGetDevicePointer((void**)&L.wd_dev, (void*)g_wd_host, 0));
    memset(&L.error, 0, sizeof L.error);
    memset(&L.plans, 0, sizeof L.plans);
    memset(&L.ex, 0, sizeof L.ex);
    L.ex.stream = L.stream;
    L.ex.error = &L.error;
    L.ex.gemm = &L.plans;
    // the library's probe: sm_90a kernels present with registers enough for setmaxnreg 40/232 (the consumers'
    // increase waits forever unless the launch allocation covers 40*128 + 232*256), shared memory, the driver's
    // cuTensorMapEncodeTiled
    if (!hopper_gemm_available(&L.plans.hopper)) {
        fprintf(stderr, "hopper_gemm_available: no (a build without sm_90a? nvcc needs -gencode=arch=compute_90a,code=sm_90a)\n");
        return 1;
    }
    for (int vi = 0; vi < NVAR; vi++)  // what ptxas gave each kernel
        for (int bl = 0; bl < hg::B_LAYOUTS; bl++) {
            cudaFuncAttributes a;
            CK(cudaFuncGetAttributes(&a, hg_kernel_of(vi, bl)));
            printf("kernel %d %s, B %s: %d registers, %zu bytes local, %d bytes dynamic shared\n", vi, g_variants[vi].name,
                   bl == hg::B_KN ? "[K, N]" : "[N, K]", a.numRegs, a.localSizeBytes, g_variants[vi].smem);
        }
    if (do_check) {
        run_checks(L);
        bool any = false;
        for (int vi = 0; vi < NVAR; vi++) any |= !L.skip[vi];
        if (!any) {
            printf("no variant passed the checks: no benchmark\n");
            return 1;
        }
    }
    if (do_bench) run_bench(L);
    CB(cublasDestroy(L.cublas));
    CK(cudaStreamDestroy(L.stream));
    return L.failures ? 1 : 0;
}
