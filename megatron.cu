/*
 * megatron.cu — everything of megatron.c that touches the GPU: kernels, GEMMs, the transformer's
 * forward and backward, the parallel collectives, the optimizer, checkpoints, and the trainer API
 * declared in megatron.h. DESIGN.md is the map; this file reads top to bottom in this order.
 *
 * Two parts, one translation unit, and a seam between them:
 *   Part I, kernels and launchers (sections 1-14): each operation's kernels with the host launchers
 *     that queue them. What they may use: pointers, sizes, `const mt_exec* ex` (taken first: the
 *     stream, the error record, the GEMM plans and the micro-batch's mode, built by whoever decides
 *     the work), the enums and structs of Part I, and megatron.h's plain types, constants and
 *     element rules (mt_status, mt_precision, mt_tp_full_index, mt_adamw_step). Never mt_trainer,
 *     mt_config or anything of Part II. (Flash attention's launchers take a bare stream: the lab in
 *     dev/cuda/ calls them without an mt_exec.)
 *   Part II, the model and the trainer (sections 15-21): process groups, layers, the model, the
 *     micro-batch loop, the optimizer, checkpoints and the trainer API. They may use Part I,
 *     mt_trainer and mt_config; their device work goes through Part I's launchers with an mt_exec
 *     (trainer_exec(t), with the micro-batch's mode in run_micro_batches): Part II defines and
 *     launches no kernel. Streams, events, copies and memsets, NCCL and the library handles are
 *     Part II's.
 * Each section's banner says what it does and why, and ends with "defines:", what it gives to the
 * sections after it. tests/test_layout.h checks this list against the banners.
 *
 * Contents:
 *   Part I: kernels and launchers
 *    1. Checks, utilities and the execution context
 *    2. Initialisation and casts
 *    3. Column sums
 *    4. Embedding
 *    5. Bias, residual, dropout and activations
 *    6. LayerNorm and RMSNorm
 *    7. Attention layout and RoPE
 *    8. Exact attention
 *    9. Flash attention (bf16)
 *       9.1 Device helpers
 *       9.2 Forward
 *       9.3 Backward
 *       9.4 Host launchers
 *       9.5 Context-parallel ring attention
 *   10. Cross entropy
 *   11. Gradient norm and AdamW
 *   12. FP8: formats, scaling, casts and transposes
 *   13. GEMM
 *       13.1 Hopper grouped GEMM (wgmma, TMA)
 *       13.2 Hopper attention forward (FlashAttention-3 style: TMA, wgmma, warp specialisation)
 *       13.3 Hopper attention backward (FlashAttention-3 style: TMA, wgmma, warp specialisation)
 *       13.4 Context-parallel ring steps on the Hopper kernels
 *   14. Mixture of experts: routing, permutation, the experts' activation
 *   22. Generation kernels: the KV cache, decode attention and sampling
 *   Part II: the model and the trainer
 *   15. Process groups
 *   16. Parallel layers
 *   17. The model
 *   18. The micro-batch loop
 *   19. Optimizer
 *   20. Checkpoints
 *   21. The trainer API
 *   23. Generation: the engine
 *
 * Precision: the model runs in a type T (float, bf16 or fp16) chosen at run time; every kernel is a
 * template over T and does its arithmetic in fp32. Weight gradients are accumulated in fp32 by the
 * GEMMs themselves (Megatron's gradient-accumulation fusion); fp32 master weights and Adam moments.
 *
 * Determinism: no floating-point atomics anywhere. Column sums (bias, norm and position-embedding
 * gradients) reduce fixed row chunks, then the chunks in order; the word-embedding gradient sums each
 * token's positions in order from a host-built index; reductions use fixed trees; NCCL's sums are
 * the same from run to run on the same layout. (FP8 amaxes use integer atomicMax on the bits of
 * |x|: a maximum is exact in any order.)
 */
#define MEGATRON_IMPLEMENTATION
#include "megatron.h"

#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda.h> /* CUtensorMap and its enums, types only (section 13.1; no -lcuda) */
#include <nccl.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cuda_profiler_api.h>
#include <errno.h>
#include <stdarg.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <type_traits>

/* ############################################################################################## */
/* PART I: KERNELS AND LAUNCHERS (sections 1-14)                                                  */
/*    Each operation's kernels and the launchers that queue them. They may use pointers, sizes,   */
/*    a const mt_exec* (stream, error record, GEMM plans, micro-batch mode), the types of Part I  */
/*    and megatron.h's plain types and element rules; never mt_trainer, mt_config or anything of  */
/*    Part II.                                                                                    */
/* ############################################################################################## */

/* ============================================================================================== */
/* 1. Checks, utilities and the execution context                                                 */
/*    Library code never exits: the first failing CUDA/cuBLAS/NCCL call is recorded in an         */
/*    mt_gpu_error owned by the trainer, later work is skipped, and the API call returns it.      */
/*    Every launcher and layer takes an mt_exec: the stream, that error record, the GEMM plans    */
/*    and the micro-batch's mode. Then the fp32 <-> storage conversions, warp/block reductions    */
/*    in a fixed order, 16-byte vector access and asynchronous global -> shared copies that the   */
/*    kernels below share.                                                                        */
/*    defines: mt_gpu_error with CUDA_CHECK / CUBLAS_CHECK / NCCL_CHECK / LAUNCH_CHECK,           */
/*    mt_gpu_fail, mt_exec, mt_micro_batch_mode, ceil_div, to_float / from_float, warp_sum,       */
/*    block_sum / block_max, vec16 / load16 / store16, cp_async_16.                               */
/* ============================================================================================== */

typedef struct {
    mt_status status;
    mt_error error;
    const char* last_nccl_call; /* the last NCCL call issued through NCCL_CHECK (the watchdog names it) */
} mt_gpu_error;

static bool mt_cuda_ok(mt_gpu_error* e, cudaError_t code, const char* what, const char* file, int line) {
    if (code == cudaSuccess) return true;
    if (e->status == MT_OK) {
        e->status = code == cudaErrorMemoryAllocation ? MT_ERR_OOM : MT_ERR_CUDA;
        snprintf(e->error.message, sizeof(e->error.message), "CUDA error %s (%s) in %s at %s:%d",
                 cudaGetErrorName(code), cudaGetErrorString(code), what, file, line);
    }
    return false;
}

static bool mt_cublas_ok(mt_gpu_error* e, cublasStatus_t code, const char* what, const char* file, int line) {
    if (code == CUBLAS_STATUS_SUCCESS) return true;
    if (e->status == MT_OK) {
        e->status = MT_ERR_CUDA;
        snprintf(e->error.message, sizeof(e->error.message), "cuBLAS error %s (%s) in %s at %s:%d",
                 cublasGetStatusName(code), cublasGetStatusString(code), what, file, line);
    }
    return false;
}

/* NCCL failures name the rank: with N processes, the one line that reaches the user must say which. */
static bool mt_nccl_ok(mt_gpu_error* e, ncclResult_t code, const char* what, int rank, const char* file, int line) {
    __atomic_store_n(&e->last_nccl_call, what, __ATOMIC_RELAXED); /* read by the watchdog's thread */
    if (code == ncclSuccess || code == ncclInProgress) return true;
    if (e->status == MT_OK) {
        e->status = MT_ERR_NCCL;
        snprintf(e->error.message, sizeof(e->error.message), "rank %d: NCCL error %s (%s) in %s at %s:%d", rank,
                 ncclGetErrorString(code), ncclGetLastError(NULL), what, file, line);
    }
    return false;
}

/* Records a call refused before any work was queued (a shape or an argument the operation does not
 * take) as the first error; returns false, so a launcher reads `return mt_gpu_fail(...)`. */
static bool mt_gpu_fail(mt_gpu_error* e, mt_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static bool mt_gpu_fail(mt_gpu_error* e, mt_status status, const char* fmt, ...) {
    if (e->status == MT_OK) {
        e->status = status;
        va_list args;
        va_start(args, fmt);
        vsnprintf(e->error.message, sizeof(e->error.message), fmt, args);
        va_end(args);
    }
    return false;
}

#define CUDA_CHECK(e, call) mt_cuda_ok((e), (call), #call, __FILE__, __LINE__)
#define NCCL_CHECK(e, rank, call) mt_nccl_ok((e), (call), #call, (rank), __FILE__, __LINE__)
#define CUBLAS_CHECK(e, call) mt_cublas_ok((e), (call), #call, __FILE__, __LINE__)
#define LAUNCH_CHECK(e) mt_cuda_ok((e), cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

/* Hands a recorded error to the caller's mt_error. */
static mt_status mt_gpu_error_return(const mt_gpu_error* e, mt_error* err) {
    if (e->status != MT_OK && err) *err = e->error;
    return e->status;
}

/* The execution context every launcher and layer takes: the stream its work goes to, the error
 * record its first failure lands in, the GEMM plans, and the mode of the micro-batch it belongs to.
 * It is built where that work is decided (run_micro_batches for training; a plain one for
 * evaluation, the optimizer, tests) and passed down explicitly, never read from a field set elsewhere. */
typedef struct {
    /* 0 while the first micro-batch of a step runs its backward: every gradient writer (weight
     * GEMMs with beta 0, column sums, embeddings) then overwrites its tensor, so the fp32 gradient
     * buffer is never zeroed (6 GB of writes per step at 1.5B); 1 afterwards: writers accumulate */
    int accumulate_gradients;
    int last;               /* the step's last micro-batch: after its backward the gradients are final */
    int reduce_in_backward; /* buckets start their DP reduction from this backward (--overlap-grad-reduce) */
    int training;           /* a backward follows: FP8's delayed scaling records this micro-batch's amaxes, and
                               dropout is on */
    int64_t first_sample;   /* the number of this micro-batch's first sample in the step's global batch
                               (Megatron's sampler order): keys its dropout masks (section 5) */
    int micro_batch;        /* its number in the step (0-based): the MoE global aux loss averages over 0..it */
    float moe_loss_scale;   /* the backward scale of a loss that is a mean over this micro-batch (the MoE aux
                               losses): loss scale / (micro-batches x DP), as its language-model loss's mean */
} mt_micro_batch_mode;

typedef struct mt_gemm_plans mt_gemm_plans; /* section 13 */
typedef struct {
    cudaStream_t stream;
    mt_gpu_error* error;
    mt_gemm_plans* gemm;    /* NULL where no GEMM is issued */
    mt_micro_batch_mode mode;
} mt_exec;

static inline int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

/* fp32 <-> storage type conversions; all arithmetic happens in fp32. */
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename T> static cudaDataType_t cuda_type();
template <> cudaDataType_t cuda_type<float>() { return CUDA_R_32F; }
template <> cudaDataType_t cuda_type<__nv_bfloat16>() { return CUDA_R_16BF; }
template <> cudaDataType_t cuda_type<__half>() { return CUDA_R_16F; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Block-wide sum/max with a fixed tree (deterministic). blockDim.x must be a multiple of 32, <= 1024. */
__device__ float block_sum(float v) {
    __shared__ float shared[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}
__device__ float block_max(float v) {
    __shared__ float shared[32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : -INFINITY;
    return warp_max(v);
}

/* 16-byte vector access: 8 bf16/fp16 or 4 fp32 values per load or store, converted to fp32. The
 * vectorised kernels need rows of a multiple of 16 bytes and 16-byte-aligned pointers; their
 * launchers fall back to the scalar kernels otherwise. */
template <typename T>
struct vec16 {
    static constexpr int N = 16 / sizeof(T);
};
template <typename T>
__device__ __forceinline__ void load16(float* out, const T* p) {
    int4 raw = *reinterpret_cast<const int4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < vec16<T>::N; i++) out[i] = to_float(e[i]);
}
template <typename T>
__device__ __forceinline__ void store16(T* p, const float* in) {
    int4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < vec16<T>::N; i++) e[i] = from_float<T>(in[i]);
    *reinterpret_cast<int4*>(p) = raw;
}
static inline bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* Asynchronous global -> shared copies (sm_80+): the loads of a whole tile go out at once without
 * passing through registers; a thread waits for its own groups, then a barrier publishes them. */
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
/* 16-byte global -> shared copy that bypasses registers; valid == false writes 16 zero bytes. */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* Wait until at most N of this thread's committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* ============================================================================================== */
/* 2. Initialisation and casts                                                                    */
/*    A counter-based normal generator, so every element's initial value depends only on (seed,   */
/*    tensor, global index): the same model at any parallel layout. Casts between the fp32        */
/*    master and the model type.                                                                  */
/*    defines: init_param, cast_from_float, cast_to_float.                                        */
/* ============================================================================================== */

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* out[j] = the value of element i of tensor tensor_id (0, 1, or normal(0, std)), where element j of
 * this tensor-parallel rank's slice is element i = first + mt_tp_full_index(j, ...) of the full
 * tensor (megatron.h): the slice holds rows [row0, row0 + rows) of rows_full, each of `inner`. */
__global__ void init_param_kernel(float* out, int64_t n, int64_t first, int64_t rows, int64_t inner, int64_t rows_full,
                                  int64_t row0, int mode, float std, uint64_t seed, uint64_t tensor_id) {
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    out += j;
    int64_t i = first + mt_tp_full_index(j, rows, inner, rows_full, row0);
    if (mode == 0) { out[0] = 0.0f; return; }
    if (mode == 1) { out[0] = 1.0f; return; }
    uint64_t r1 = splitmix64(seed ^ splitmix64((tensor_id << 48) ^ (uint64_t)(2 * i)));
    uint64_t r2 = splitmix64(seed ^ splitmix64((tensor_id << 48) ^ (uint64_t)(2 * i + 1)));
    double u1 = ((double)(r1 >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
    double u2 = (double)(r2 >> 11) * (1.0 / 9007199254740992.0);         /* [0, 1) */
    double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    out[0] = (float)(z * std);
}

template <typename T>
__global__ void cast_from_float_kernel(T* dst, const float* src, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = from_float<T>(src[i]);
}
template <typename T>
__global__ void cast_to_float_kernel(float* dst, const T* src, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = to_float<T>(src[i]);
}

/* n elements of one tensor (see init_param_kernel), written as fp32 into out */
static void init_param(const mt_exec* ex, float* out, int64_t n, int64_t first, int64_t rows, int64_t inner,
                       int64_t rows_full, int64_t row0, int mode, float std, uint64_t seed, uint64_t tensor_id) {
    init_param_kernel<<<ceil_div(n, 256), 256, 0, ex->stream>>>(out, n, first, rows, inner, rows_full, row0, mode, std,
                                                                 seed, tensor_id);
    LAUNCH_CHECK(ex->error);
}
/* dst[n] (model type of `precision`) = src[n] (fp32), and back */
static void cast_from_float(const mt_exec* ex, mt_precision precision, void* dst, const float* src, int64_t n) {
    switch (precision) {
        case MT_FP32: cast_from_float_kernel<float><<<ceil_div(n, 256), 256, 0, ex->stream>>>((float*)dst, src, n); break;
        case MT_BF16:
            cast_from_float_kernel<__nv_bfloat16><<<ceil_div(n, 256), 256, 0, ex->stream>>>((__nv_bfloat16*)dst, src, n);
            break;
        case MT_FP16: cast_from_float_kernel<__half><<<ceil_div(n, 256), 256, 0, ex->stream>>>((__half*)dst, src, n); break;
    }
    LAUNCH_CHECK(ex->error);
}
static void cast_to_float(const mt_exec* ex, mt_precision precision, float* dst, const void* src, int64_t n) {
    switch (precision) {
        case MT_FP32:
            CUDA_CHECK(ex->error, cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, ex->stream));
            return;
        case MT_BF16:
            cast_to_float_kernel<__nv_bfloat16><<<ceil_div(n, 256), 256, 0, ex->stream>>>(dst, (const __nv_bfloat16*)src, n);
            break;
        case MT_FP16: cast_to_float_kernel<__half><<<ceil_div(n, 256), 256, 0, ex->stream>>>(dst, (const __half*)src, n); break;
    }
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 3. Column sums                                                                                 */
/*    Deterministic column sums for bias gradients and norm-weight gradients, no atomics. Pass    */
/*    1: block (x, chunk) sums rows [chunk*rows_per_chunk, ...) of its columns into a partial     */
/*    row. Pass 2 (column_final_sums): dst[c] (+)= the partial rows in order; the step's first    */
/*    micro-batch overwrites (the gradient buffer is never zeroed). Fused kernels (the norm       */
/*    backward, flash attention's backward) write the same partial rows and finish with pass 2.   */
/*    defines: mt_colsum_scratch, colsum_chunks, column_sum, column_final_sums.                   */
/* ============================================================================================== */

enum { COLSUM_PLAIN = 0, COLSUM_LAYERNORM = 1 };

template <typename T, int MODE>
__global__ void column_partial_sum_kernel(float* partial_a, float* partial_b, const T* dy, const T* x,
                                          const float* mean, const float* rstd, int N, int C, int rows_per_chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (c >= C) return;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float a = 0.0f, b = 0.0f;
    for (int r = r0; r < r1; r++) {
        float g = to_float(dy[(int64_t)r * C + c]);
        if (MODE == COLSUM_LAYERNORM) {
            float xhat = (to_float(x[(int64_t)r * C + c]) - mean[r]) * rstd[r];
            a += g * xhat; /* d weight */
            b += g;        /* d bias */
        } else {
            a += g;
        }
    }
    partial_a[(int64_t)chunk * C + c] = a;
    if (MODE == COLSUM_LAYERNORM) partial_b[(int64_t)chunk * C + c] = b;
}

/* The same with 16-byte loads: each thread owns V adjacent columns (C % V == 0), so a warp reads
 * 512 contiguous bytes of a row instead of 64. Every column is still summed over the same rows in
 * the same order, so the results are bitwise those of the scalar kernel. */
template <typename T, int MODE>
__global__ void column_partial_sum_vec_kernel(float* partial_a, float* partial_b, const T* dy, const T* x,
                                              const float* mean, const float* rstd, int N, int C, int rows_per_chunk) {
    constexpr int V = vec16<T>::N;
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    int chunk = blockIdx.y;
    if (c >= C) return;
    int r0 = chunk * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float a[V], b[V], g[V], xv[V];
#pragma unroll
    for (int i = 0; i < V; i++) a[i] = b[i] = 0.0f;
#pragma unroll 4
    for (int r = r0; r < r1; r++) {
        load16(g, dy + (int64_t)r * C + c);
        if (MODE == COLSUM_LAYERNORM) {
            load16(xv, x + (int64_t)r * C + c);
            float m = mean[r], rs = rstd[r];
#pragma unroll
            for (int i = 0; i < V; i++) {
                a[i] += g[i] * ((xv[i] - m) * rs);
                b[i] += g[i];
            }
        } else {
#pragma unroll
            for (int i = 0; i < V; i++) a[i] += g[i];
        }
    }
#pragma unroll
    for (int i = 0; i < V; i++) {
        partial_a[(int64_t)chunk * C + c + i] = a[i];
        if (MODE == COLSUM_LAYERNORM) partial_b[(int64_t)chunk * C + c + i] = b[i];
    }
}

/* Up to three column sums finished in one launch (blockIdx.y picks one; a NULL dst is skipped):
 * dst[c] (+)= the sum of partial[k, c] over the chunks k; `accumulate` 0 overwrites dst (the first
 * micro-batch of a step: the gradient buffer is not zeroed). A block [32 columns x 16 lanes of
 * chunks]: lane y sums chunks y, y+16, ..., then lane 0 adds the 16 in order (a fixed order:
 * deterministic). */
__global__ void __launch_bounds__(512) column_final_sums_kernel(float* dst0, const float* p0, float* dst1,
                                                                const float* p1, float* dst2, const float* p2,
                                                                int chunks, int C, int accumulate) {
    __shared__ float part[16][33];
    float* dst = blockIdx.y == 0 ? dst0 : blockIdx.y == 1 ? dst1 : dst2;
    const float* partial = blockIdx.y == 0 ? p0 : blockIdx.y == 1 ? p1 : p2;
    if (!dst) return;
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < C)
        for (int k = threadIdx.y; k < chunks; k += 16) s += partial[(int64_t)k * C + c];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.0f;
#pragma unroll
        for (int y = 0; y < 16; y++) total += part[y][threadIdx.x];
        dst[c] = accumulate ? dst[c] + total : total;
    }
}

/* dst_i[C] (+)= the sums over `chunks` partial rows of part_i [chunks, C], i < count (a NULL dst_i is
 * skipped); the step's first micro-batch overwrites (ex->mode.accumulate_gradients == 0) */
static void column_final_sums(const mt_exec* ex, int count, int chunks, int C, float* dst0, const float* p0,
                              float* dst1 = NULL, const float* p1 = NULL, float* dst2 = NULL, const float* p2 = NULL) {
    column_final_sums_kernel<<<dim3(ceil_div(C, 32), count), dim3(32, 16), 0, ex->stream>>>(
        dst0, p0, dst1, p1, dst2, p2, chunks, C, ex->mode.accumulate_gradients);
    LAUNCH_CHECK(ex->error);
}

typedef struct {
    float* partial_a; /* [chunks, max_columns] fp32 scratch for column sums */
    float* partial_b;
    float* partial_c;
    int max_chunks;
} mt_colsum_scratch;

static int colsum_chunks(int N, int max_chunks, int* rows_per_chunk) {
    int rows = ceil_div(N, max_chunks);
    if (rows < 1) rows = 1;
    *rows_per_chunk = rows;
    return ceil_div(N, rows);
}

/* dst[c] += sum_r dy[r, c] (= when ex->mode.accumulate_gradients is 0) */
template <typename T>
static void column_sum(const mt_exec* ex, mt_colsum_scratch* s, float* dst, const T* dy, int N, int C) {
    int rows, chunks = colsum_chunks(N, s->max_chunks, &rows);
    if (C % vec16<T>::N == 0 && aligned16(dy))
        column_partial_sum_vec_kernel<T, COLSUM_PLAIN><<<dim3(ceil_div(C / vec16<T>::N, 256), chunks), 256, 0,
                                                         ex->stream>>>(s->partial_a, NULL, dy, NULL, NULL, NULL, N, C,
                                                                      rows);
    else
        column_partial_sum_kernel<T, COLSUM_PLAIN><<<dim3(ceil_div(C, 256), chunks), 256, 0, ex->stream>>>(
            s->partial_a, NULL, dy, NULL, NULL, NULL, N, C, rows);
    column_final_sums_kernel<<<dim3(ceil_div(C, 32), 1), dim3(32, 16), 0, ex->stream>>>(
        dst, s->partial_a, NULL, NULL, NULL, NULL, chunks, C, ex->mode.accumulate_gradients);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 4. Embedding                                                                                   */
/*    x[b,t,:] = word[token] + position[p] (no position table with RoPE: wpe NULL), p = t or a     */
/*    row's own position (--reset-position-ids: mt_document_boundaries; generation). Vocab-       */
/*    parallel: wte holds rows [vocab_start, vocab_start + vocab_rows); a token outside them      */
/*    contributes zeros, and the sum over the tensor-parallel ranks completes the lookup. The     */
/*    backward sums each token's positions in order from a host-built index (no atomics); with    */
/*    reset positions the position table's gradient likewise (mt_position_index).                */
/*    defines: embedding_forward, position_embedding_backward, word_embedding_backward.           */
/* ============================================================================================== */

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe,
                                         const int32_t* positions, int BT, int seq, int C, int64_t vocab_start,
                                         int64_t vocab_rows) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)BT * C) return;
    int bt = (int)(idx / C), c = (int)(idx % C);
    int t = positions ? positions[bt] : bt % seq;
    int64_t tok = tokens[bt] - vocab_start;
    float word = tok >= 0 && tok < vocab_rows ? to_float(wte[tok * C + c]) : 0.0f;
    out[idx] = from_float<T>(word + (wpe ? to_float(wpe[(int64_t)t * C + c]) : 0.0f));
}

/* Position-embedding gradient: dwpe[t,c] (+)= sum over the batch, in batch order (accumulate 0: the
 * step's first micro-batch overwrites). */
template <typename T>
__global__ void position_embedding_backward_kernel(float* dwpe, const T* dout, int B, int seq, int C,
                                                   int accumulate) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)seq * C) return;
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += to_float(dout[(int64_t)b * seq * C + idx]);
    dwpe[idx] = accumulate ? dwpe[idx] + s : s;
}

/* The same with reset positions: one block per position p, summing the rows of that position in
 * increasing order from the host-built index (offsets [seq + 1], rows [BT]); a position no row has
 * gets 0 (or keeps its sum when accumulating). */
template <typename T>
__global__ void position_embedding_backward_indexed_kernel(float* dwpe, const T* dout, const int32_t* offsets,
                                                           const int32_t* rows, int C, int accumulate) {
    const int p = blockIdx.x, begin = offsets[p], end = offsets[p + 1];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (int r = begin; r < end; r++) s += to_float(dout[(int64_t)rows[r] * C + c]);
        float* w = dwpe + (int64_t)p * C + c;
        *w = accumulate ? *w + s : s;
    }
}

/* Word-embedding gradient: one block per distinct token of the micro-batch; it sums that token's
 * positions in increasing order (index built on the host), so no atomics are needed. */
template <typename T>
__global__ void word_embedding_backward_kernel(float* dwte, const T* dout, const int32_t* unique_tokens,
                                               const int32_t* offsets, const int32_t* positions, int C,
                                               int64_t vocab_start) {
    int u = blockIdx.x;
    int64_t tok = unique_tokens[u] - vocab_start;
    int begin = offsets[u], end = offsets[u + 1];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (int p = begin; p < end; p++) s += to_float(dout[(int64_t)positions[p] * C + c]);
        dwte[tok * C + c] += s;
    }
}

/* out [BT, C] = the embedding of tokens [BT] (this rank's vocabulary rows; wpe NULL: none) at
 * positions [BT] (NULL: t of each row; --reset-position-ids' or generation's positions otherwise) */
template <typename T>
static void embedding_forward(const mt_exec* ex, T* out, const int32_t* tokens, const T* wte, const T* wpe, int BT,
                              int seq, int C, int64_t vocab_start, int64_t vocab_rows,
                              const int32_t* positions = NULL) {
    embedding_forward_kernel<T><<<ceil_div((int64_t)BT * C, 256), 256, 0, ex->stream>>>(
        out, tokens, wte, wpe, positions, BT, seq, C, vocab_start, vocab_rows);
    LAUNCH_CHECK(ex->error);
}
/* dwpe [seq, C] (+)= the batch sum of dout [B, seq, C] (overwritten in the step's first micro-batch);
 * with index (mt_position_index's offsets [seq + 1] then rows [BT]; NULL: positions are t) the sum of
 * each position's rows */
template <typename T>
static void position_embedding_backward(const mt_exec* ex, float* dwpe, const T* dout, int B, int seq, int C,
                                        const int32_t* index = NULL) {
    if (index)
        position_embedding_backward_indexed_kernel<T><<<seq, 256, 0, ex->stream>>>(
            dwpe, dout, index, index + seq + 1, C, ex->mode.accumulate_gradients);
    else
        position_embedding_backward_kernel<T><<<ceil_div((int64_t)seq * C, 256), 256, 0, ex->stream>>>(
            dwpe, dout, B, seq, C, ex->mode.accumulate_gradients);
    LAUNCH_CHECK(ex->error);
}
/* dwte += the scatter of dout [BT, C] by token; index = [unique (BT+1)][offsets (BT+1)][positions (BT)]
 * as built by build_embedding_index (section 18) for `unique_tokens` distinct tokens */
template <typename T>
static void word_embedding_backward(const mt_exec* ex, float* dwte, const T* dout, const int32_t* index,
                                    int unique_tokens, int BT, int C, int64_t vocab_start) {
    if (unique_tokens <= 0) return;
    word_embedding_backward_kernel<T><<<unique_tokens, 256, 0, ex->stream>>>(
        dwte, dout, index, index + BT + 1, index + 2 * (BT + 1), C, vocab_start);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 5. Bias, residual, dropout and activations                                                     */
/*    Bias add, the residual add, GELU (tanh approximation), squared ReLU (--squared-relu) and    */
/*    SwiGLU (Megatron's --swiglu), each as a scalar kernel and a 16-byte one that the launcher    */
/*    picks when rows are a multiple                                                              */
/*    of the vector width and pointers aligned. A NULL bias means the model has none (--disable-  */
/*    bias-linear). Dropout (Megatron's hidden and attention dropout) draws its masks from a      */
/*    counter-based generator: nothing is stored, the backward regenerates them.                  */
/*    defines: mt_dropout, dropout_apply, bias_add, bias_residual, bias_activation, bias_swiglu,  */
/*    activation_backward, swiglu_backward, fp8_out (the activations' and norms' FP8 outputs).    */
/* ============================================================================================== */

/* ---- Dropout masks. A dropout site (one tensor of one micro-batch: the embeddings' output, a layer's
 *      attention probabilities, its attention or MLP branch) has a 64-bit stream key made from (seed,
 *      iteration, layer, site) on the host (dropout_stream, section 17). Element number `counter` of
 *      the site takes the 64 bits splitmix64(key + counter * golden), i.e. output counter + 1 of
 *      SplitMix64 seeded with the key; elements 2c and 2c+1 of a row share counter c (low 32 bits for
 *      the even column, high for the odd), so a thread holding a column pair hashes once. An element
 *      is dropped when its 32 bits are below threshold = round(p * 2^32); kept ones are scaled by
 *      1 / (1 - p) in fp32. Counters are global coordinates, so a mask does not depend on the
 *      parallel layout or the micro-batch size:
 *        hidden   [rows, C]: counter = row * ceil(C / 2) + column / 2, row = the token's row among the
 *                 step's global batch (sample * seq + position);
 *        attention [T, T] per (sample, head): counter = ((sample * heads + head) * T + query) *
 *                 ceil(T / 2) + key / 2, with the model's head number.
 *      With context parallelism a rank's rows are two chunks of each sequence: a hidden site maps its
 *      local row to (sample, position) through the chunks (cp_len > 0), and attention passes the
 *      sequence positions of its queries and keys, so the masks are CP = 1's.
 *      dev/ref_gpt.py computes the same bits in numpy. ---- */
typedef struct {
    int on;             /* 0: no dropout at this site (evaluation, p = 0) */
    uint32_t threshold; /* dropped when the element's 32 bits < threshold */
    float scale;        /* 1 / (1 - p) */
    uint64_t key;       /* the site's stream */
    int64_t row0;       /* hidden: the global row of local row 0 (with cp_len > 0: the global sample of local
                           sample 0); attention: the global sample of batch 0 */
    int head0, heads;   /* attention: the model's number of local head 0, and its number of heads */
    /* hidden sites under context parallelism (cp_len 0: none): local row r (+ cp_row0, the sequence-parallel
     * block's first row) is local sample r / (2 cp_len), row i = r % (2 cp_len) of its two chunks, which
     * hold positions cp_start[0] + i (i < cp_len) and cp_start[1] + i - cp_len of seq positions */
    int cp_len, cp_start[2], seq;
    int64_t cp_row0;
} mt_dropout;

__host__ __device__ __forceinline__ uint64_t dropout_bits(uint64_t key, uint64_t counter) {
    return splitmix64(key + counter * 0x9E3779B97F4A7C15ull);
}
/* element `column` of the pair whose bits are `bits` is kept */
__host__ __device__ __forceinline__ bool dropout_keeps(const mt_dropout& d, uint64_t bits, int column) {
    return (uint32_t)(bits >> (32 * (column & 1))) >= d.threshold;
}
/* the counter of element (row, column) of a hidden site [rows, C], row local */
__host__ __device__ __forceinline__ uint64_t dropout_hidden_counter(const mt_dropout& d, int64_t row, int64_t column,
                                                                    int64_t C) {
    int64_t global = d.row0 + row;
    if (d.cp_len > 0) { /* context parallelism: the local row's sample and sequence position */
        const int64_t r = d.cp_row0 + row, b = r / (2 * d.cp_len);
        const int i = (int)(r % (2 * d.cp_len));
        global = (d.row0 + b) * d.seq + (i < d.cp_len ? d.cp_start[0] + i : d.cp_start[1] + i - d.cp_len);
    }
    return (uint64_t)global * (uint64_t)((C + 1) / 2) + (uint64_t)(column / 2);
}
/* the counter of (local batch b, local head h, query, key) of an attention site with sequence T */
__host__ __device__ __forceinline__ uint64_t dropout_attention_counter(const mt_dropout& d, int b, int h, int query,
                                                                       int key, int T) {
    const uint64_t head = (uint64_t)(d.row0 + b) * (uint64_t)d.heads + (uint64_t)(d.head0 + h);
    return (head * (uint64_t)T + (uint64_t)query) * (uint64_t)((T + 1) / 2) + (uint64_t)(key / 2);
}
__host__ __device__ __forceinline__ float dropout_value(const mt_dropout& d, uint64_t bits, int column, float v) {
    return dropout_keeps(d, bits, column) ? v * d.scale : 0.0f;
}

/* out[N, C] = dropout(in) with the site's mask (in place allowed): the embeddings' dropout, and the
 * backward of every hidden dropout (the gradient takes the same mask and scale). */
template <typename T>
__global__ void dropout_kernel(T* out, const T* in, mt_dropout d, int64_t N, int C) {
    const int64_t pairs_per_row = (C + 1) / 2;
    const int64_t pair = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= N * pairs_per_row) return;
    const int64_t row = pair / pairs_per_row;
    const int c0 = (int)(pair % pairs_per_row) * 2;
    const uint64_t bits = dropout_bits(d.key, dropout_hidden_counter(d, row, c0, C));
    for (int c = c0; c < c0 + 2 && c < C; c++)
        out[row * C + c] = from_float<T>(dropout_value(d, bits, c, to_float(in[row * C + c])));
}
template <typename T>
static void dropout_apply(const mt_exec* ex, T* out, const T* in, const mt_dropout& d, int N, int C) {
    const int64_t pairs = (int64_t)N * ((C + 1) / 2);
    dropout_kernel<T><<<ceil_div(pairs, 256), 256, 0, ex->stream>>>(out, in, d, N, C);
    LAUNCH_CHECK(ex->error);
}

template <typename T>
__global__ void bias_add_kernel(T* y, const T* bias, int64_t N, int C) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= N * C) return;
    y[idx] = from_float<T>(to_float(y[idx]) + to_float(bias[idx % C]));
}

template <typename T>
__global__ void residual_add_kernel(T* out, const T* a, const T* b, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

/* ---- FP8 outputs of producer kernels (section 12 defines the device functions). Under delayed
 *      scaling a tensor's scale is known before the tensor is made, so a kernel whose output is an
 *      FP8 linear's input (a norm, an MLP activation) can also write that input's E4M3 bytes and fold
 *      its amax into the slot: the linear then skips its cast and its read of the bf16 tensor. ---- */
struct fp8_out {
    uint8_t* q;         /* [N, C] row-major, the output's layout; NULL: no FP8 output */
    const float* scale; /* the linear's input slot: scale (device, one float) */
    float* amax;        /* and amax, max-ed into; NULL: not recorded (evaluation, recasts) */
};
template <typename T, int V>
__device__ __forceinline__ void fp8_out_store(const fp8_out& o, int64_t at, const float* v, uint32_t& largest);
__device__ __forceinline__ void fp8_out_amax(const fp8_out& o, uint32_t largest);

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
/* The MLP's elementwise activations (SwiGLU, which pairs columns, is below): GELU's tanh
 * approximation (Megatron's default) and squared ReLU (--squared-relu: relu(x)^2, derivative
 * 2 relu(x)). A NaN input gives a NaN (relu keeps it, as torch's does), so the NaN checks see it. */
enum { ACT_GELU = 0, ACT_SQUARED_RELU = 1 };
template <int ACT>
__device__ __forceinline__ float activation(float x) {
    if (ACT == ACT_SQUARED_RELU) {
        const float r = x < 0.0f ? 0.0f : x;
        return r * r;
    }
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}
template <int ACT>
__device__ __forceinline__ float activation_derivative(float x) {
    if (ACT == ACT_SQUARED_RELU) return x < 0.0f ? 0.0f : 2.0f * x;
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float dtanh = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x) * (1.0f - th * th);
    return 0.5f * (1.0f + th) + 0.5f * x * dtanh;
}
template <typename T, int ACT>
__global__ void activation_forward_kernel(T* out, const T* in, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = from_float<T>(activation<ACT>(to_float(in[i])));
}
/* In place: d <- d * act'(x). */
template <typename T, int ACT>
__global__ void activation_backward_kernel(T* d, const T* in, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    d[i] = from_float<T>(to_float(d[i]) * activation_derivative<ACT>(to_float(in[i])));
}

/* The activation's backward and the bias add with 16-byte vectors (i indexes vectors; C % V == 0 for
 * the bias). */
template <typename T, int ACT>
__global__ void activation_backward_vec_kernel(T* d, const T* in, int64_t vectors) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    float g[V], x[V];
    load16(g, d + i * V);
    load16(x, in + i * V);
#pragma unroll
    for (int k = 0; k < V; k++) g[k] *= activation_derivative<ACT>(x[k]);
    store16(d + i * V, g);
}
template <typename T>
__global__ void bias_add_vec_kernel(T* y, const T* bias, int64_t vectors, int C) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    float a[V], b[V];
    load16(a, y + i * V);
    load16(b, bias + (i * V) % C);
#pragma unroll
    for (int k = 0; k < V; k++) a[k] += b[k];
    store16(y + i * V, a);
}

/* Fused epilogues of the linears, 16-byte vectors, i indexes vectors of [N, C] (C % V == 0):
 * out = residual + branch + bias (a row-parallel linear's bias folded into the residual add), and
 * pre = y + bias, act = gelu(pre) or relu(pre)^2 (the first MLP linear; pre is kept for the backward). */
template <typename T>
__global__ void bias_residual_vec_kernel(T* out, const T* residual, const T* branch, const T* bias, int64_t vectors,
                                         int C, mt_dropout d) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    int64_t e = i * V;
    float r[V], y[V], b[V];
    load16(r, residual + e);
    load16(y, branch + e);
    if (bias) load16(b, bias + e % C);
    if (d.on) { /* residual + dropout(branch + bias): V is even, so column pairs stay in one vector */
        const int64_t row = e / C;
        const int c0 = (int)(e % C);
#pragma unroll
        for (int k = 0; k < V; k += 2) {
            const uint64_t bits = dropout_bits(d.key, dropout_hidden_counter(d, row, c0 + k, C));
#pragma unroll
            for (int j = k; j < k + 2; j++) r[j] += dropout_value(d, bits, c0 + j, y[j] + (bias ? b[j] : 0.0f));
        }
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) r[k] += y[k] + (bias ? b[k] : 0.0f);
    }
    store16(out + e, r);
}
/* The same, one element per thread (any C): out = residual + dropout(branch + bias). */
template <typename T>
__global__ void bias_dropout_residual_kernel(T* out, const T* residual, const T* branch, const T* bias, int64_t N,
                                             int C, mt_dropout d) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) return;
    const int64_t row = i / C;
    const int c = (int)(i % C);
    const float v = to_float(branch[i]) + (bias ? to_float(bias[c]) : 0.0f);
    const uint64_t bits = dropout_bits(d.key, dropout_hidden_counter(d, row, c, C));
    out[i] = from_float<T>(to_float(residual[i]) + dropout_value(d, bits, c, v));
}

template <typename T, int ACT>
__global__ void bias_activation_vec_kernel(T* pre, T* act, const T* bias, int64_t vectors, int C, fp8_out f8) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors && !f8.q) return; /* with f8 every lane reaches the warp's amax */
    uint32_t largest = 0;
    if (i < vectors) {
        int64_t e = i * V;
        float y[V], b[V], a[V];
        load16(y, pre + e);
        if (bias) load16(b, bias + e % C);
#pragma unroll
        for (int k = 0; k < V; k++) {
            /* round the pre-activation to T first: the backward recomputes act' from the stored value */
            float x = to_float(from_float<T>(y[k] + (bias ? b[k] : 0.0f)));
            y[k] = x;
            a[k] = activation<ACT>(x);
        }
        store16(pre + e, y);
        store16(act + e, a);
        if (f8.q) fp8_out_store<T, V>(f8, e, a, largest);
    }
    if (f8.q) fp8_out_amax(f8, largest);
}

/* SwiGLU (Megatron's --swiglu): the first MLP linear gives pre [N, 2f] = [gate | up] per row;
 * act [N, f] = silu(gate) * up. The bias, if any, is added into pre first (rounded to T, as the
 * backward reads it back). i indexes elements (scalar) or vectors (vec) of act. */
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

template <typename T>
__global__ void swiglu_forward_kernel(T* pre, T* act, const T* bias, int64_t N, int f) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * f) return;
    int64_t row = i / f;
    int col = (int)(i % f);
    T* g = pre + row * 2 * f + col;
    float gate = to_float(*g), up = to_float(g[f]);
    if (bias) {
        gate = to_float(from_float<T>(gate + to_float(bias[col])));
        up = to_float(from_float<T>(up + to_float(bias[f + col])));
        g[0] = from_float<T>(gate);
        g[f] = from_float<T>(up);
    }
    act[i] = from_float<T>(silu(gate) * up);
}

/* dpre [N, 2f] from dact [N, f]: dgate = dact * up * silu'(gate), dup = dact * silu(gate), with
 * silu'(x) = s (1 + x (1 - s)), s = sigmoid(x). */
template <typename T>
__global__ void swiglu_backward_kernel(T* dpre, const T* dact, const T* pre, int64_t N, int f) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * f) return;
    int64_t row = i / f;
    int col = (int)(i % f);
    float gate = to_float(pre[row * 2 * f + col]), up = to_float(pre[row * 2 * f + f + col]);
    float s = 1.0f / (1.0f + expf(-gate)), d = to_float(dact[i]);
    dpre[row * 2 * f + col] = from_float<T>(d * up * s * (1.0f + gate * (1.0f - s)));
    dpre[row * 2 * f + f + col] = from_float<T>(d * gate * s);
}

template <typename T>
__global__ void swiglu_forward_vec_kernel(T* pre, T* act, const T* bias, int64_t vectors, int f, fp8_out f8) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors && !f8.q) return; /* with f8 every lane reaches the warp's amax */
    uint32_t largest = 0;
    if (i < vectors) {
        int64_t row = i * V / f;
        int col = (int)(i * V % f);
        T* g = pre + row * 2 * f + col;
        float gate[V], up[V], b[V], a[V];
        load16(gate, g);
        load16(up, g + f);
        if (bias) {
            load16(b, bias + col);
#pragma unroll
            for (int k = 0; k < V; k++) gate[k] = to_float(from_float<T>(gate[k] + b[k]));
            load16(b, bias + f + col);
#pragma unroll
            for (int k = 0; k < V; k++) up[k] = to_float(from_float<T>(up[k] + b[k]));
            store16(g, gate);
            store16(g + f, up);
        }
#pragma unroll
        for (int k = 0; k < V; k++) a[k] = silu(gate[k]) * up[k];
        store16(act + i * V, a);
        if (f8.q) fp8_out_store<T, V>(f8, i * V, a, largest);
    }
    if (f8.q) fp8_out_amax(f8, largest);
}

template <typename T>
__global__ void swiglu_backward_vec_kernel(T* dpre, const T* dact, const T* pre, int64_t vectors, int f) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    int64_t row = i * V / f;
    int col = (int)(i * V % f);
    float gate[V], up[V], d[V], dg[V];
    load16(gate, pre + row * 2 * f + col);
    load16(up, pre + row * 2 * f + f + col);
    load16(d, dact + i * V);
#pragma unroll
    for (int k = 0; k < V; k++) {
        float s = 1.0f / (1.0f + expf(-gate[k]));
        dg[k] = d[k] * up[k] * s * (1.0f + gate[k] * (1.0f - s));
        up[k] = d[k] * gate[k] * s;
    }
    store16(dpre + row * 2 * f + col, dg);
    store16(dpre + row * 2 * f + f + col, up);
}

/* y[N, C] += bias[C] */
template <typename T>
static void bias_add(const mt_exec* ex, T* y, const T* bias, int N, int C) {
    int64_t n = (int64_t)N * C;
    if (C % vec16<T>::N == 0 && aligned16(y) && aligned16(bias))
        bias_add_vec_kernel<T><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(y, bias, n / vec16<T>::N, C);
    else
        bias_add_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(y, bias, N, C);
    LAUNCH_CHECK(ex->error);
}

/* out[N, C] = residual + branch + bias[C] (bias may be NULL); with a dropout site (Megatron's
 * bias-dropout-add) out = residual + dropout(branch + bias) */
template <typename T>
static void bias_residual(const mt_exec* ex, T* out, const T* residual, T* branch, const T* bias, int N, int C,
                          const mt_dropout& d = mt_dropout()) {
    int64_t n = (int64_t)N * C;
    if (C % vec16<T>::N == 0 && aligned16(out) && aligned16(residual) && aligned16(branch) && aligned16(bias)) {
        int64_t vectors = n / vec16<T>::N;
        bias_residual_vec_kernel<T><<<ceil_div(vectors, 256), 256, 0, ex->stream>>>(out, residual, branch, bias, vectors, C,
                                                                                 d);
    } else if (d.on) {
        bias_dropout_residual_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(out, residual, branch, bias, N, C, d);
    } else {
        if (bias) bias_add_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(branch, bias, N, C);
        residual_add_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(out, residual, branch, n);
    }
    LAUNCH_CHECK(ex->error);
}

/* pre[N, C] += bias (may be NULL); act = gelu(pre) or relu(pre)^2 (kind: ACT_GELU, ACT_SQUARED_RELU);
 * with f8.q also act's FP8 bytes and amax (fp8_out; the 16-byte kernel only). Returns whether f8 was
 * written (false: the caller casts act itself). */
template <typename T, int ACT>
static bool bias_activation_as(const mt_exec* ex, T* pre, T* act, const T* bias, int N, int C, const fp8_out& f8) {
    int64_t n = (int64_t)N * C;
    const bool vec = C % vec16<T>::N == 0 && aligned16(pre) && aligned16(act) && aligned16(bias);
    if (vec) {
        int64_t vectors = n / vec16<T>::N;
        bias_activation_vec_kernel<T, ACT><<<ceil_div(vectors, 256), 256, 0, ex->stream>>>(pre, act, bias, vectors, C,
                                                                                          f8);
    } else {
        if (bias) bias_add_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(pre, bias, N, C);
        activation_forward_kernel<T, ACT><<<ceil_div(n, 256), 256, 0, ex->stream>>>(act, pre, n);
    }
    LAUNCH_CHECK(ex->error);
    return vec && f8.q;
}
template <typename T>
static bool bias_activation(const mt_exec* ex, int kind, T* pre, T* act, const T* bias, int N, int C,
                            const fp8_out& f8 = fp8_out()) {
    if (kind == ACT_SQUARED_RELU) return bias_activation_as<T, ACT_SQUARED_RELU>(ex, pre, act, bias, N, C, f8);
    return bias_activation_as<T, ACT_GELU>(ex, pre, act, bias, N, C, f8);
}

/* pre[N, 2f] += bias (may be NULL); act[N, f] = silu(gate) * up; f8 as bias_activation's */
template <typename T>
static bool bias_swiglu(const mt_exec* ex, T* pre, T* act, const T* bias, int N, int f, const fp8_out& f8 = fp8_out()) {
    int64_t n = (int64_t)N * f;
    const bool vec = f % vec16<T>::N == 0 && aligned16(pre) && aligned16(act) && aligned16(bias);
    if (vec)
        swiglu_forward_vec_kernel<T><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(pre, act, bias,
                                                                                           n / vec16<T>::N, f, f8);
    else
        swiglu_forward_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(pre, act, bias, N, f);
    LAUNCH_CHECK(ex->error);
    return vec && f8.q;
}

/* d <- d * act'(pre), in place over [n] (kind: ACT_GELU, ACT_SQUARED_RELU) */
template <typename T, int ACT>
static void activation_backward_as(const mt_exec* ex, T* d, const T* pre, int64_t n) {
    if (n % vec16<T>::N == 0 && aligned16(d) && aligned16(pre))
        activation_backward_vec_kernel<T, ACT><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(d, pre,
                                                                                                     n / vec16<T>::N);
    else
        activation_backward_kernel<T, ACT><<<ceil_div(n, 256), 256, 0, ex->stream>>>(d, pre, n);
    LAUNCH_CHECK(ex->error);
}
template <typename T>
static void activation_backward(const mt_exec* ex, int kind, T* d, const T* pre, int64_t n) {
    if (kind == ACT_SQUARED_RELU) activation_backward_as<T, ACT_SQUARED_RELU>(ex, d, pre, n);
    else activation_backward_as<T, ACT_GELU>(ex, d, pre, n);
}

/* dpre[N, 2f] from dact[N, f] and pre[N, 2f] */
template <typename T>
static void swiglu_backward(const mt_exec* ex, T* dpre, const T* dact, const T* pre, int N, int f) {
    int64_t n = (int64_t)N * f;
    if (f % vec16<T>::N == 0 && aligned16(dpre) && aligned16(dact) && aligned16(pre))
        swiglu_backward_vec_kernel<T><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(dpre, dact, pre,
                                                                                            n / vec16<T>::N, f);
    else
        swiglu_backward_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(dpre, dact, pre, N, f);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 6. LayerNorm and RMSNorm                                                                       */
/*    One warp per row, statistics in fp32, mean and 1/std saved for the backward. RMSNorm is     */
/*    the same kernel with the mean fixed at 0 (saved as 0, so the backward's x-hat is x * rstd)  */
/*    and no bias: y = x / sqrt(mean(x^2) + eps) * w. The forward is fused with the residual add  */
/*    before it (residual_norm_forward); norm_apply recomputes a norm's output from its saved     */
/*    statistics (the backward does so for the first norm instead of keeping it per layer). The   */
/*    backward is one fused kernel (input gradient and the weight, bias and preceding row-        */
/*    parallel bias column sums), staged through shared memory, with the two-kernel path as the   */
/*    fallback. With --apply-layernorm-1p the stored weight is w - 1: every kernel takes w1 (1, else */
/*    0) and uses weight + w1, in fp32 as Transformer Engine's zero-centred gamma does; the weight's  */
/*    gradient is the same either way.                                                            */
/*    defines: norm_forward, residual_norm_forward, norm_apply, norm_backward.                    */
/* ============================================================================================== */

/* One normalized output element, (x - mean) * rstd * (w + w1) + b, rounded the same way in every
 * kernel that makes it (the forwards and norm_apply): explicit round-to-nearest intrinsics, so the
 * compiler cannot fuse a multiply-add in one kernel and not in another, and a recomputed norm output
 * is the forward's bit for bit. b = 0 without a bias (fma(a, w, 0) rounds as a * w). */
__device__ __forceinline__ float norm_output(float x, float mean, float rstd, float w, float w1, float b) {
    return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), rstd), __fadd_rn(w, w1), b);
}

template <typename T>
__global__ void layernorm_forward_kernel(T* out, float* mean_out, float* rstd_out, const T* x, const T* weight,
                                         const T* bias, int N, int C, float eps, bool rms, float w1) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T* xr = x + (int64_t)row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) sum += to_float(xr[c]);
    float mean = rms ? 0.0f : warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float d = to_float(xr[c]) - mean;
        var += d * d;
    }
    var = warp_sum(var) / C;
    float rstd = 1.0f / sqrtf(var + eps);
    T* o = out + (int64_t)row * C;
    for (int c = lane; c < C; c += 32)
        o[c] = from_float<T>(norm_output(to_float(xr[c]), mean, rstd, to_float(weight[c]), w1,
                                         bias ? to_float(bias[c]) : 0.0f));
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

/* Input gradient, added into the residual gradient: dres += rstd * (g - mean(g) - xhat * mean(g*xhat)),
 * g = dy * weight (RMSNorm: without the mean(g) term). */
template <typename T>
__global__ void layernorm_backward_input_kernel(T* dresidual, const T* dy, const T* x, const T* weight,
                                                const float* mean, const float* rstd, int N, int C, bool rms,
                                                float w1) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T* dyr = dy + (int64_t)row * C;
    const T* xr = x + (int64_t)row * C;
    float m = mean[row], rs = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float g = to_float(dyr[c]) * (to_float(weight[c]) + w1);
        sum_g += g;
        sum_gx += g * (to_float(xr[c]) - m) * rs;
    }
    float mean_g = rms ? 0.0f : warp_sum(sum_g) / C, mean_gx = warp_sum(sum_gx) / C;
    T* dr = dresidual + (int64_t)row * C;
    for (int c = lane; c < C; c += 32) {
        float xhat = (to_float(xr[c]) - m) * rs;
        float g = to_float(dyr[c]) * (to_float(weight[c]) + w1);
        dr[c] = from_float<T>(to_float(dr[c]) + rs * (g - mean_g - xhat * mean_gx));
    }
}

/* The same two kernels with 16-byte loads (one warp per row; C a multiple of the vector width).
 * Statistics are summed in the same per-lane-then-warp pattern, so results are deterministic. */
/* With f8.q the row's FP8 bytes too (fp8_out), and out may be NULL (no bf16 output). */
template <typename T>
__global__ void layernorm_forward_vec_kernel(T* out, float* mean_out, float* rstd_out, const T* x, const T* weight,
                                             const T* bias, int N, int C, float eps, bool rms, float w1, fp8_out f8) {
    constexpr int V = vec16<T>::N;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T* xr = x + (int64_t)row * C;
    float v[V], w[V], b[V];
    float sum = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load16(v, xr + c);
#pragma unroll
        for (int i = 0; i < V; i++) sum += v[i];
    }
    float mean = rms ? 0.0f : warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load16(v, xr + c);
#pragma unroll
        for (int i = 0; i < V; i++) var += (v[i] - mean) * (v[i] - mean);
    }
    float rstd = 1.0f / sqrtf(warp_sum(var) / C + eps);
    uint32_t largest = 0;
    for (int c = lane * V; c < C; c += 32 * V) {
        load16(v, xr + c);
        load16(w, weight + c);
        if (bias) load16(b, bias + c);
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = norm_output(v[i], mean, rstd, w[i], w1, bias ? b[i] : 0.0f);
        if (out) store16(out + (int64_t)row * C + c, v);
        if (f8.q) fp8_out_store<T, V>(f8, (int64_t)row * C + c, v, largest);
    }
    if (f8.q) fp8_out_amax(f8, largest); /* whole warps: a warp's lanes share the row */
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

/* A warp's statistics of one row for the norm backward: (mean of g, mean of g * xhat), g = dy * w,
 * 16-byte loads, lanes striding the row (RMSNorm: mean of g is 0). Every lane gets both. */
template <typename T>
__device__ __forceinline__ float2 norm_backward_row_means(const T* dyr, const T* xr, const T* weight, float m, float rs,
                                                          int C, int lane, bool rms, float w1) {
    constexpr int V = vec16<T>::N;
    float g[V], xv[V], w[V];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load16(g, dyr + c);
        load16(xv, xr + c);
        load16(w, weight + c);
#pragma unroll
        for (int i = 0; i < V; i++) {
            float gi = g[i] * (w[i] + w1);
            sum_g += gi;
            sum_gx += gi * (xv[i] - m) * rs;
        }
    }
    return make_float2(rms ? 0.0f : warp_sum(sum_g) / C, warp_sum(sum_gx) / C);
}

template <typename T>
__global__ void layernorm_backward_input_vec_kernel(T* dresidual, const T* dy, const T* x, const T* weight,
                                                    const float* mean, const float* rstd, int N, int C, bool rms,
                                                    float w1) {
    constexpr int V = vec16<T>::N;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T* dyr = dy + (int64_t)row * C;
    const T* xr = x + (int64_t)row * C;
    float m = mean[row], rs = rstd[row];
    float g[V], xv[V], w[V], d[V];
    const float2 means = norm_backward_row_means(dyr, xr, weight, m, rs, C, lane, rms, w1);
    const float mean_g = means.x, mean_gx = means.y;
    T* dr = dresidual + (int64_t)row * C;
    for (int c = lane * V; c < C; c += 32 * V) {
        load16(g, dyr + c);
        load16(xv, xr + c);
        load16(w, weight + c);
        load16(d, dr + c);
#pragma unroll
        for (int i = 0; i < V; i++) d[i] += rs * (g[i] * (w[i] + w1) - mean_g - (xv[i] - m) * rs * mean_gx);
        store16(dr + c, d);
    }
}

/* The residual add fused with the next norm: sum = residual + branch (+ bias), stored (it is the
 * residual stream and the norm's saved input), then y = norm(sum). The row stays in registers
 * between the two (at most 32 * MAXV vectors per row; the launcher checks), so the sum is read
 * back from no memory at all. The stored sum is rounded to T before the statistics, exactly as if
 * the norm had read it back. f8, out NULL: as layernorm_forward_vec_kernel's. */
template <typename T, int MAXV>
__global__ void residual_norm_forward_vec_kernel(T* sum_out, T* out, float* mean_out, float* rstd_out,
                                                 const T* residual, const T* branch, const T* bias, const T* weight,
                                                 const T* norm_bias, int N, int C, float eps, bool rms, float w1,
                                                 mt_dropout d, fp8_out f8) {
    constexpr int V = vec16<T>::N;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    int64_t base = (int64_t)row * C;
    float r[MAXV][V], y[V], w[V];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int c = (lane + 32 * j) * V;
        if (c >= C) break;
        load16(r[j], residual + base + c);
        load16(y, branch + base + c);
        if (bias) load16(w, bias + c);
        if (d.on) { /* residual + dropout(branch + bias) (see bias_residual_vec_kernel) */
#pragma unroll
            for (int i = 0; i < V; i += 2) {
                const uint64_t bits = dropout_bits(d.key, dropout_hidden_counter(d, row, c + i, C));
#pragma unroll
                for (int k = i; k < i + 2; k++)
                    y[k] = dropout_value(d, bits, c + k, y[k] + (bias ? w[k] : 0.0f)), r[j][k] += y[k];
            }
#pragma unroll
            for (int i = 0; i < V; i++) r[j][i] = to_float(from_float<T>(r[j][i])), sum += r[j][i];
        } else {
#pragma unroll
            for (int i = 0; i < V; i++) {
                r[j][i] = to_float(from_float<T>(r[j][i] + y[i] + (bias ? w[i] : 0.0f)));
                sum += r[j][i];
            }
        }
        store16(sum_out + base + c, r[j]);
    }
    float mean = rms ? 0.0f : warp_sum(sum) / C;
    float var = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        if ((lane + 32 * j) * V >= C) break;
#pragma unroll
        for (int i = 0; i < V; i++) var += (r[j][i] - mean) * (r[j][i] - mean);
    }
    float rstd = 1.0f / sqrtf(warp_sum(var) / C + eps);
    uint32_t largest = 0;
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int c = (lane + 32 * j) * V;
        if (c >= C) break;
        load16(w, weight + c);
        if (norm_bias) load16(y, norm_bias + c);
#pragma unroll
        for (int i = 0; i < V; i++) y[i] = norm_output(r[j][i], mean, rstd, w[i], w1, norm_bias ? y[i] : 0.0f);
        if (out) store16(out + base + c, y);
        if (f8.q) fp8_out_store<T, V>(f8, base + c, y, largest);
    }
    if (f8.q) fp8_out_amax(f8, largest);
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

/* V elements from / to memory: 16-byte accesses when V is the vector width, else one by one.     */
template <typename T, int V>
__device__ __forceinline__ void load_n(float* out, const T* p) {
    if constexpr (V == vec16<T>::N) load16(out, p);
    else
        for (int j = 0; j < V; j++) out[j] = to_float(p[j]);
}
template <typename T, int V>
__device__ __forceinline__ void store_n(T* p, const float* in) {
    if constexpr (V == vec16<T>::N) store16(p, in);
    else
        for (int j = 0; j < V; j++) p[j] = from_float<T>(in[j]);
}

/* A norm's output again from its saved input and statistics: y = (x - mean) * rstd * w (+ b), the
 * forward kernels' own expression, so the backward recomputes what the forward produced (the first
 * norm's output is not kept per layer). One thread per V elements (V = 1 when C is not a multiple
 * of the vector width). */
template <typename T, int V>
__global__ void norm_apply_kernel(T* out, const T* x, const float* mean, const float* rstd, const T* w, const T* b,
                                  int64_t N, int C, float w1, fp8_out f8) {
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= N * C) return;
    int64_t row = i / C;
    int c = (int)(i % C);
    float v[V], wv[V], bv[V];
    load_n<T, V>(v, x + i);
    load_n<T, V>(wv, w + c);
    if (b) load_n<T, V>(bv, b + c);
    const float m = mean[row], rs = rstd[row];
#pragma unroll
    for (int k = 0; k < V; k++) v[k] = norm_output(v[k], m, rs, wv[k], w1, b ? bv[k] : 0.0f);
    if (out) store_n<T, V>(out + i, v);
    if constexpr (V % 4 == 0) { /* the 16-byte kernel: FP8 bytes without amax (a recast, fp8_out) */
        uint32_t largest = 0;
        if (f8.q) fp8_out_store<T, V>(f8, i, v, largest);
    }
}

/* ---- The norm backward fused with every column sum that reads the same rows. A block walks tiles of
 *      `rows` rows (grid-strided over at most NORM_BWD_BLOCKS blocks: counts fixed by N and C alone,
 *      so the sums do not depend on the device), two tiles in shared memory at a time:
 *      1. cp.async copies the next tile's dy, x and dres rows into the other buffer (every byte is
 *         read from memory once, and a whole tile's loads are in flight while this one computes);
 *      2. a warp per row: the row's statistics mean(g), mean(g * xhat), g = dy * w;
 *      3. each thread owns V adjacent columns (NJ groups of them when C > 256 V; with fewer than 256
 *         vectors per row the spare threads take every RG-th row) and walks the tile's rows:
 *         dres += dx (stored), and in registers d weight += dy * xhat, d bias += dy, and (prev !=
 *         NULL) the new dres itself: the gradient of the residual stream here, i.e. the bias
 *         gradient of the row-parallel linear whose output was added to it (proj before the second
 *         norm, fc2 before the next layer's first).
 *      Each block writes its partial sums once; column_final_sums_kernel adds them in block order, so
 *      every sum is deterministic. The previous version (dev/cuda/fused_kernels.cu keeps it) re-read
 *      dy and x from L2 for step 3, which at 8192 x 1600 spilled to memory: 90 us against ~45. ---- */
#define NORM_BWD_BLOCKS 256       /* at most; partial sums are blocks x C x 3 floats */
#define NORM_BWD_STAGE_BYTES 49152 /* one tile of dy, x, dres in shared memory (two are kept) */
#define NORM_BWD_MAX_ROWS 32
/* Rows per tile and blocks for [N, C] rows of `elem`-byte values; the kernel's dynamic shared memory
 * is 2 * 3 * rows * C * elem bytes. */
static inline int norm_backward_tile_rows(int C, int elem) {
    int rows = NORM_BWD_STAGE_BYTES / (3 * C * elem);
    return rows < 1 ? 1 : rows > NORM_BWD_MAX_ROWS ? NORM_BWD_MAX_ROWS : rows;
}
/* The end of a norm-backward kernel: the row groups' column sums added in group order through s_red
 * ([RG][3][C] floats; NJ == 1 whenever RG > 1), then row group 0 writes the block's partial sums
 * part_*[blockIdx.x, C] (part_b, part_prev may be NULL). Every thread of the block calls it. */
template <int V, int NJ>
__device__ __forceinline__ void norm_backward_block_partials(float (&aw)[NJ][V], float (&ab)[NJ][V],
                                                             float (&ar)[NJ][V], float* s_red, int RG, int rg, int cv0,
                                                             int nvec, int C, float* part_w, float* part_b,
                                                             float* part_prev) {
    if (RG > 1) {
        __syncthreads(); /* s_red may alias memory the block was still reading */
        if (rg < RG)
#pragma unroll
            for (int i = 0; i < V; i++) {
                s_red[(rg * 3 + 0) * C + cv0 * V + i] = aw[0][i];
                s_red[(rg * 3 + 1) * C + cv0 * V + i] = ab[0][i];
                s_red[(rg * 3 + 2) * C + cv0 * V + i] = ar[0][i];
            }
        __syncthreads();
        if (rg == 0)
#pragma unroll
            for (int i = 0; i < V; i++) {
                float sw = 0.0f, sb = 0.0f, sr = 0.0f;
                for (int k = 0; k < RG; k++) {
                    sw += s_red[(k * 3 + 0) * C + cv0 * V + i];
                    sb += s_red[(k * 3 + 1) * C + cv0 * V + i];
                    sr += s_red[(k * 3 + 2) * C + cv0 * V + i];
                }
                aw[0][i] = sw;
                ab[0][i] = sb;
                ar[0][i] = sr;
            }
    }
    if (rg != 0) return;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = (cv0 + 256 * j) * V;
        if (c >= nvec * V) continue;
        const int64_t at = (int64_t)blockIdx.x * C + c;
#pragma unroll
        for (int i = 0; i < V; i++) {
            part_w[at + i] = aw[j][i];
            if (part_b) part_b[at + i] = ab[j][i];
            if (part_prev) part_prev[at + i] = ar[j][i];
        }
    }
}

template <typename T, int NJ>
__global__ void __launch_bounds__(256)
    norm_backward_fused_kernel(T* dres, float* part_w, float* part_b, float* part_prev, const T* dy, const T* x,
                               const T* w, const float* mean, const float* rstd, int N, int C, int rows, bool rms,
                               float w1) {
    constexpr int V = vec16<T>::N, WARPS = 8;
    extern __shared__ int4 norm_tiles[]; /* [2 buffers][3: dy, x, dres][rows][C / V] 16-byte vectors */
    __shared__ float s_mg[NORM_BWD_MAX_ROWS], s_mgx[NORM_BWD_MAX_ROWS], s_m[NORM_BWD_MAX_ROWS], s_rs[NORM_BWD_MAX_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nvec = C / V;
    const int tile_vecs = rows * nvec, tiles = (N + rows - 1) / rows;
    /* step 3 threads: column vector cv0 of row group rg; with fewer than 256 vectors per row the
     * spare threads take other rows of the tile (RG groups, at most what the final reduction's
     * shared memory holds: RG * 3 * C floats in the two buffers) */
    const int width = nvec < 256 ? nvec : 256;
    const int RG = min(256 / width, rows * (int)sizeof(T) / 2);
    const int cv0 = threadIdx.x % width, rg = threadIdx.x / width;
    /* one tile's copy: 3 * rows * nvec vectors spread over the block; rows past N are not copied */
    auto issue = [&](int tile, int buf) {
        const int r0 = tile * rows, n = min(rows, N - r0) * nvec;
        int4* s = norm_tiles + (size_t)buf * 3 * tile_vecs;
        const int64_t base = (int64_t)r0 * nvec;
        for (int k = threadIdx.x; k < n; k += 256) {
            cp_async_16(smem_u32(s + k), reinterpret_cast<const int4*>(dy) + base + k, true);
            cp_async_16(smem_u32(s + tile_vecs + k), reinterpret_cast<const int4*>(x) + base + k, true);
            cp_async_16(smem_u32(s + 2 * tile_vecs + k), reinterpret_cast<const int4*>(dres) + base + k, true);
        }
    };
    float aw[NJ][V], ab[NJ][V], ar[NJ][V];
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int i = 0; i < V; i++) aw[j][i] = ab[j][i] = ar[j][i] = 0.0f;

    if (blockIdx.x < tiles) issue(blockIdx.x, 0);
    cp_async_commit();
    int buf = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1) {
        if (tile + gridDim.x < tiles) issue(tile + gridDim.x, buf ^ 1); /* step 1 for the next tile */
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T* s_dy = reinterpret_cast<const T*>(norm_tiles + (size_t)buf * 3 * tile_vecs);
        const T* s_x = s_dy + (size_t)tile_vecs * V;
        const T* s_d = s_x + (size_t)tile_vecs * V;
        const int r0 = tile * rows, n = min(rows, N - r0);
        for (int rr = warp; rr < n; rr += WARPS) { /* step 2 */
            const float m = mean[r0 + rr], rs = rstd[r0 + rr];
            const float2 means =
                norm_backward_row_means(s_dy + (size_t)rr * C, s_x + (size_t)rr * C, w, m, rs, C, lane, rms, w1);
            if (lane == 0) {
                s_mg[rr] = means.x;
                s_mgx[rr] = means.y;
                s_m[rr] = m;
                s_rs[rr] = rs;
            }
        }
        __syncthreads();
        if (rg < RG) {
#pragma unroll
            for (int j = 0; j < NJ; j++) { /* step 3 */
                const int c = (cv0 + 256 * j) * V;
                if (c >= nvec * V) continue;
                float wv[V], g[V], xv[V], d[V];
                load16(wv, w + c);
#pragma unroll
                for (int i = 0; i < V; i++) wv[i] += w1;
                for (int rr = rg; rr < n; rr += RG) {
                    const int64_t at = (int64_t)rr * C + c;
                    const float m = s_m[rr], rs = s_rs[rr], mg = s_mg[rr], mgx = s_mgx[rr];
                    load16(g, s_dy + at);
                    load16(xv, s_x + at);
                    load16(d, s_d + at);
#pragma unroll
                    for (int i = 0; i < V; i++) {
                        const float xhat = (xv[i] - m) * rs;
                        d[i] = to_float(from_float<T>(d[i] + rs * (g[i] * wv[i] - mg - xhat * mgx)));
                        aw[j][i] += g[i] * xhat;
                        ab[j][i] += g[i];
                        ar[j][i] += d[i];
                    }
                    store16(dres + (int64_t)r0 * C + at, d);
                }
            }
        }
        __syncthreads(); /* this buffer is refilled two tiles on; the statistics by the next tile */
    }
    cp_async_wait<0>();
    norm_backward_block_partials<V, NJ>(aw, ab, ar, reinterpret_cast<float*>(norm_tiles), RG, rg, cv0, nvec, C, part_w,
                                        part_b, part_prev);
}

/* The norms' FP8 outputs (fp8_out) come from their 16-byte kernels only: where those do not apply
 * (C not a multiple of the vector width, a misaligned pointer) a launcher given f8.q writes none and
 * says so (returns false; the caller casts), and one given out = NULL as well records an error. */
static bool norm_fp8_fallback(const mt_exec* ex, const void* out, const char* what) {
    if (!out) mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: no bf16 output asked for, and the FP8 one needs the 16-byte kernel", what);
    return false;
}

/* out = (x - mean) * rstd * w (+ b) over rows of [N, C], from the statistics the forward saved. With
 * f8.q also its FP8 bytes, without amax (a recast: f8.amax is not read), and out may be NULL; returns
 * whether f8 was written. */
template <typename T>
static bool norm_apply(const mt_exec* ex, T* out, const T* x, const float* mean, const float* rstd, const T* w,
                       const T* b, int N, int C, float w1 = 0.0f, const fp8_out& f8 = fp8_out()) {
    constexpr int V = vec16<T>::N;
    int64_t n = (int64_t)N * C;
    if (C % V == 0 && aligned16(out) && aligned16(x) && aligned16(w) && aligned16(b)) {
        norm_apply_kernel<T, V><<<ceil_div(n / V, 256), 256, 0, ex->stream>>>(out, x, mean, rstd, w, b, N, C, w1, f8);
        LAUNCH_CHECK(ex->error);
        return f8.q != NULL;
    }
    if (f8.q && !out) return norm_fp8_fallback(ex, out, "norm_apply");
    norm_apply_kernel<T, 1><<<ceil_div(n, 256), 256, 0, ex->stream>>>(out, x, mean, rstd, w, b, N, C, w1, fp8_out());
    LAUNCH_CHECK(ex->error);
    return false;
}

/* out = norm(x): LayerNorm (w, b) or RMSNorm (w; b NULL, rms) over rows of [N, C]. With f8.q also its
 * FP8 bytes and amax (fp8_out), and out may be NULL; returns whether f8 was written. */
template <typename T>
static bool norm_forward(const mt_exec* ex, T* out, float* mean, float* rstd, const T* x, const T* w, const T* b,
                         int N, int C, float eps, bool rms, float w1 = 0.0f, const fp8_out& f8 = fp8_out()) {
    if (C % vec16<T>::N == 0 && aligned16(out) && aligned16(x) && aligned16(w) && aligned16(b)) {
        layernorm_forward_vec_kernel<T><<<ceil_div(N, 8), 256, 0, ex->stream>>>(out, mean, rstd, x, w, b, N, C, eps, rms,
                                                                                w1, f8);
        LAUNCH_CHECK(ex->error);
        return f8.q != NULL;
    }
    if (f8.q && !out) return norm_fp8_fallback(ex, out, "norm_forward");
    layernorm_forward_kernel<T><<<ceil_div(N, 8), 256, 0, ex->stream>>>(out, mean, rstd, x, w, b, N, C, eps, rms, w1);
    LAUNCH_CHECK(ex->error);
    return false;
}

/* sum = residual + branch + bias (the residual stream), then out = norm(sum): one kernel when a
 * row fits the registers of one warp (C <= 32 * 8 vectors: hidden 2048 in bf16), else two. f8, out
 * NULL and the result: as norm_forward's. */
#define RESIDUAL_NORM_MAXV 8
template <typename T>
static bool residual_norm_forward(const mt_exec* ex, T* sum, T* out, float* mean, float* rstd, const T* residual,
                                  T* branch, const T* bias, const T* w, const T* b, int N, int C, float eps, bool rms,
                                  float w1 = 0.0f, const mt_dropout& d = mt_dropout(), const fp8_out& f8 = fp8_out()) {
    constexpr int V = vec16<T>::N;
    if (C % V == 0 && C <= 32 * V * RESIDUAL_NORM_MAXV && aligned16(sum) && aligned16(out) && aligned16(residual) &&
        aligned16(branch) && aligned16(bias) && aligned16(w) && aligned16(b)) {
        residual_norm_forward_vec_kernel<T, RESIDUAL_NORM_MAXV><<<ceil_div(N, 8), 256, 0, ex->stream>>>(
            sum, out, mean, rstd, residual, branch, bias, w, b, N, C, eps, rms, w1, d, f8);
        LAUNCH_CHECK(ex->error);
        return f8.q != NULL;
    }
    bias_residual<T>(ex, sum, residual, branch, bias, N, C, d);
    return norm_forward<T>(ex, out, mean, rstd, sum, w, b, N, C, eps, rms, w1, f8);
}

/* Launches norm_backward_fused_kernel with `rows`-row tiles over at most max_blocks blocks (NJ = nj:
 * 1, 2 or 4 groups of 256 vectors per row); returns the block count, i.e. the partial sums written. */
template <typename T>
static int norm_backward_fused(const mt_exec* ex, int nj, int rows, int max_blocks, T* dres,
                               float* part_w, float* part_b, float* part_prev, const T* dy, const T* x, const T* w,
                               const float* mean, const float* rstd, int N, int C, bool rms, float w1 = 0.0f) {
    const int tiles = ceil_div(N, rows), blocks = tiles < max_blocks ? tiles : max_blocks;
    const size_t smem = (size_t)2 * 3 * rows * C * sizeof(T);
    auto kernel = nj == 1 ? norm_backward_fused_kernel<T, 1>
                  : nj == 2 ? norm_backward_fused_kernel<T, 2>
                            : norm_backward_fused_kernel<T, 4>;
    /* each instantiation's shared-memory limit is raised only when a launch needs more than before
     * (once per process in training: rows * C is fixed by the model), not on every call */
    static size_t limit[3] = {0, 0, 0};
    size_t& set = limit[nj == 1 ? 0 : nj == 2 ? 1 : 2];
    if (smem > set && CUDA_CHECK(ex->error, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)))
        set = smem;
    kernel<<<blocks, 256, smem, ex->stream>>>(dres, part_w, part_b, part_prev, dy, x, w, mean, rstd, N, C, rows, rms,
                                              w1);
    LAUNCH_CHECK(ex->error);
    return blocks;
}

/* dresidual += d norm(x)/dx . dy ; dweight (and dbias, LayerNorm only) += their column sums (= when
 * ex->mode.accumulate_gradients is 0); and
 * dprev_bias (may be NULL) += the column sums of the updated dresidual: the bias gradient of the
 * row-parallel linear whose output this residual stream received (see norm_backward_fused_kernel). */
template <typename T>
static void norm_backward(const mt_exec* ex, mt_colsum_scratch* s, T* dresidual, float* dweight, float* dbias,
                          float* dprev_bias, const T* dy, const T* x, const T* w, const float* mean,
                          const float* rstd, int N, int C, bool rms, float w1 = 0.0f) {
    constexpr int V = vec16<T>::N;
    const int nj = ceil_div(C / V, 256);
    if (C % V == 0 && (nj == 1 || nj == 2 || nj == 4) && aligned16(dresidual) && aligned16(dy) && aligned16(x) &&
        aligned16(w)) {
        const int rows = norm_backward_tile_rows(C, sizeof(T));
        const int blocks = norm_backward_fused<T>(ex, nj, rows, NORM_BWD_BLOCKS, dresidual, s->partial_a,
                                                  dbias ? s->partial_b : NULL, dprev_bias ? s->partial_c : NULL, dy,
                                                  x, w, mean, rstd, N, C, rms, w1);
        column_final_sums_kernel<<<dim3(ceil_div(C, 32), 3), dim3(32, 16), 0, ex->stream>>>(
            dweight, s->partial_a, dbias, s->partial_b, dprev_bias, s->partial_c, blocks, C, ex->mode.accumulate_gradients);
        LAUNCH_CHECK(ex->error);
        return;
    }
    if (C % vec16<T>::N == 0 && aligned16(dresidual) && aligned16(dy) && aligned16(x) && aligned16(w))
        layernorm_backward_input_vec_kernel<T><<<ceil_div(N, 8), 256, 0, ex->stream>>>(dresidual, dy, x, w, mean, rstd,
                                                                                      N, C, rms, w1);
    else
        layernorm_backward_input_kernel<T><<<ceil_div(N, 8), 256, 0, ex->stream>>>(dresidual, dy, x, w, mean, rstd, N,
                                                                                  C, rms, w1);
    int rows, chunks = colsum_chunks(N, s->max_chunks, &rows);
    /* the 16-byte kernel gives each thread 8 columns (x2 sums), so at hidden sizes up to a few
     * thousand it leaves most of the GPU idle: dev/cuda/fused_kernels.cu measured it at 91 us
     * against the scalar kernel's 57 us (bitwise the same sums) at 16384 x 768 on an H100 */
    if (C % vec16<T>::N == 0 && C / vec16<T>::N >= 1024 && aligned16(dy) && aligned16(x))
        column_partial_sum_vec_kernel<T, COLSUM_LAYERNORM><<<dim3(ceil_div(C / vec16<T>::N, 256), chunks), 256, 0,
                                                             ex->stream>>>(s->partial_a, s->partial_b, dy, x, mean, rstd,
                                                                          N, C, rows);
    else
        column_partial_sum_kernel<T, COLSUM_LAYERNORM><<<dim3(ceil_div(C, 256), chunks), 256, 0, ex->stream>>>(
            s->partial_a, s->partial_b, dy, x, mean, rstd, N, C, rows);
    column_final_sums_kernel<<<dim3(ceil_div(C, 32), 2), dim3(32, 16), 0, ex->stream>>>(
        dweight, s->partial_a, dbias, s->partial_b, NULL, NULL, chunks, C, ex->mode.accumulate_gradients);
    LAUNCH_CHECK(ex->error);
    if (dprev_bias) column_sum<T>(ex, s, dprev_bias, dresidual, N, C);
}

/* ============================================================================================== */
/* 7. Attention layout and RoPE                                                                   */
/*    The fused QKV row of one token is Megatron's grouped layout [groups, (q_per_group + 2),     */
/*    d]: q_1 .. q_{q_per_group}, k, v for each query group. Heads of one group share K and V,    */
/*    which are kept once per group (never repeated per head). RoPE (Megatron's non-interleaved   */
/*    form) rotates the first `rot` channels of every q and k head at position t: with half =     */
/*    rot/2, c = cos(t w_i), s = sin(t w_i), i = e mod half,                                      */
/*      y[e] = x[e] c - x[e + half] s   (e < half),                                               */
/*      y[e] = x[e] c + x[e - half] s   (half <= e < rot).                                        */
/*    The exact path splits the rows into head layouts with RoPE fused (and merges the gradients  */
/*    with its transpose); the flash path rotates q and k in place in the rows. cos/sin tables    */
/*    [T, half] fp32, read at row (b, t)'s position: t, or with --reset-position-ids its reset    */
/*    position (positions [B*T], mt_document_boundaries).                                        */
/*    defines: mt_attention_dims, split_qkv, merge_qkv_grads, permute_heads, rope_qkv_rows,       */
/*    qk_norm_forward, qk_norm_backward.                                                          */
/* ============================================================================================== */

/* Where channel e of QKV-row slot `slot` of group g goes: q [B, heads, T, d], k and v [B, groups, T, d]. */
__device__ __forceinline__ int64_t qkv_destination(int slot, int qpg, int g, int b, int t, int e, int seq, int heads,
                                                   int groups, int d) {
    if (slot < qpg) return (((int64_t)b * heads + g * qpg + slot) * seq + t) * d + e;
    return (((int64_t)b * groups + g) * seq + t) * d + e;
}

/* qkv [B, T, groups*(qpg+2)*d] (the QKV linear's output, bias included) -> q, k, v; q and k
 * rotated. One thread per element of qkv. */
template <typename T>
__global__ void attention_split_heads_kernel(T* q, T* k, T* v, const T* qkv, const float* cos_table,
                                             const float* sin_table, const int32_t* positions, int B, int seq,
                                             int heads, int groups, int d, int rot) {
    int qpg = heads / groups;
    int width = groups * (qpg + 2) * d;
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)B * seq * width) return;
    int col = (int)(idx % width);
    int64_t bt = idx / width;
    int b = (int)(bt / seq), t = (int)(bt % seq);
    int g = col / ((qpg + 2) * d), slot = (col / d) % (qpg + 2), e = col % d;
    float x = to_float(qkv[idx]);
    if (slot <= qpg && e < rot) {
        int half = rot / 2, i = e % half, pos = positions ? positions[bt] : t;
        float c = cos_table[(int64_t)pos * half + i], s = sin_table[(int64_t)pos * half + i];
        x = e < half ? x * c - to_float(qkv[idx + half]) * s : x * c + to_float(qkv[idx - half]) * s;
    }
    T* dst = slot < qpg ? q : (slot == qpg ? k : v);
    dst[qkv_destination(slot, qpg, g, b, t, e, seq, heads, groups, d)] = from_float<T>(x);
}

/* Backward of the split: dqkv from dq [B, heads, T, d], dk, dv [B, groups, T, d], un-rotating
 * (the transpose of the rotation: dx[e] = dy[e] c + dy[e + half] s, dx[e + half] = dy[e + half] c - dy[e] s). */
template <typename T>
__global__ void attention_merge_head_grads_kernel(T* dqkv, const T* dq, const T* dk, const T* dv,
                                                  const float* cos_table, const float* sin_table,
                                                  const int32_t* positions, int B, int seq, int heads, int groups,
                                                  int d, int rot) {
    int qpg = heads / groups;
    int width = groups * (qpg + 2) * d;
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)B * seq * width) return;
    int col = (int)(idx % width);
    int64_t bt = idx / width;
    int b = (int)(bt / seq), t = (int)(bt % seq);
    int g = col / ((qpg + 2) * d), slot = (col / d) % (qpg + 2), e = col % d;
    const T* src = slot < qpg ? dq : (slot == qpg ? dk : dv);
    int64_t at = qkv_destination(slot, qpg, g, b, t, e, seq, heads, groups, d);
    float x = to_float(src[at]);
    if (slot <= qpg && e < rot) {
        int half = rot / 2, i = e % half, pos = positions ? positions[bt] : t;
        float c = cos_table[(int64_t)pos * half + i], s = sin_table[(int64_t)pos * half + i];
        x = e < half ? x * c + to_float(src[at + half]) * s : x * c - to_float(src[at - half]) * s;
    }
    dqkv[idx] = from_float<T>(x);
}

/* The same two with 16-byte vectors (d and, with RoPE, half a multiple of the vector width, so a
 * vector never straddles a head, the rotary halves or the rotary end). i indexes vectors of qkv. */
template <typename T, bool BACKWARD>
__global__ void attention_qkv_permute_vec_kernel(T* qkv, T* q, T* k, T* v, const float* cos_table,
                                                 const float* sin_table, const int32_t* positions, int B, int seq,
                                                 int heads, int groups, int d, int rot) {
    constexpr int V = vec16<T>::N;
    int qpg = heads / groups;
    int width = groups * (qpg + 2) * d;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)B * seq * (width / V)) return;
    int col = (int)(i % (width / V)) * V;
    int64_t bt = i / (width / V);
    int b = (int)(bt / seq), t = (int)(bt % seq);
    int g = col / ((qpg + 2) * d), slot = (col / d) % (qpg + 2), e = col % d;
    T* heads_side = slot < qpg ? q : (slot == qpg ? k : v);
    int64_t at = qkv_destination(slot, qpg, g, b, t, e, seq, heads, groups, d);
    const T* src = BACKWARD ? heads_side + at : qkv + i * V;
    T* dst = BACKWARD ? qkv + i * V : heads_side + at;
    bool rotate = slot <= qpg && e < rot;
    if (!rotate) {
        *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
        return;
    }
    int half = rot / 2, first = e < half, partner = first ? half : -half, pos = positions ? positions[bt] : t;
    float x[V], p[V];
    load16(x, src);
    load16(p, src + partner);
    const float* cs = cos_table + (int64_t)pos * half + e % half;
    const float* sn = sin_table + (int64_t)pos * half + e % half;
    /* forward: first half x c - p s, second x c + p s; backward (transpose): the signs swap */
    float sign = (first != BACKWARD) ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < V; j++) x[j] = x[j] * cs[j] + sign * p[j] * sn[j];
    store16(dst, x);
}

/* RoPE in place on the fused QKV rows [B*T, groups*(qpg+2)*d] (the flash path, whose kernels read q,
 * k and v straight from those rows): every q and k head of row (b, t) rotated at position t, or
 * (BACKWARD) a gradient un-rotated by the transpose. One thread per V channels of a head's first
 * rotary half; it also owns the matching channels of the second half, so the update is in place. */
template <typename T, int V, bool BACKWARD>
__global__ void rope_qkv_rows_kernel(T* qkv, const float* cos_table, const float* sin_table,
                                     const int32_t* positions, int64_t BT, int seq, int groups, int qpg, int d,
                                     int rot) {
    const int half = rot / 2, pieces = half / V, rotated = groups * (qpg + 1); /* q and k heads per row */
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= BT * rotated * pieces) return;
    const int piece = (int)(i % pieces), head = (int)((i / pieces) % rotated);
    const int64_t bt = i / ((int64_t)pieces * rotated);
    const int g = head / (qpg + 1), slot = head % (qpg + 1), t = positions ? positions[bt] : (int)(bt % seq);
    T* x1 = qkv + bt * groups * (qpg + 2) * d + ((int64_t)g * (qpg + 2) + slot) * d + piece * V;
    T* x2 = x1 + half;
    float a[V], b[V], y1[V], y2[V];
    load_n<T, V>(a, x1);
    load_n<T, V>(b, x2);
    const float* cs = cos_table + (int64_t)t * half + piece * V;
    const float* sn = sin_table + (int64_t)t * half + piece * V;
#pragma unroll
    for (int j = 0; j < V; j++) {
        /* forward: (a c - b s, b c + a s); backward, the transpose: (a c + b s, b c - a s) */
        const float s = BACKWARD ? -sn[j] : sn[j];
        y1[j] = a[j] * cs[j] - b[j] * s;
        y2[j] = b[j] * cs[j] + a[j] * s;
    }
    store_n<T, V>(x1, y1);
    store_n<T, V>(x2, y2);
}

/* [B, heads, T, d] <-> [B, T, heads*d]: the attention output into rows (TO_ROWS), or a gradient in
 * rows back into heads. One thread per element of the rows layout (scalar) or per 16-byte vector
 * (vec: d a multiple of the vector width); reads or writes of the heads side are the strided ones. */
__device__ __forceinline__ int64_t heads_index(int64_t rows_index, int B, int seq, int heads, int d) {
    int e = (int)(rows_index % d);
    int h = (int)((rows_index / d) % heads);
    int64_t bt = rows_index / ((int64_t)d * heads);
    int b = (int)(bt / seq), t = (int)(bt % seq);
    return (((int64_t)b * heads + h) * seq + t) * d + e;
}
template <typename T, bool TO_ROWS>
__global__ void attention_heads_permute_kernel(T* out, const T* in, int B, int seq, int heads, int d) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)B * heads * seq * d) return;
    int64_t other = heads_index(idx, B, seq, heads, d);
    if (TO_ROWS) out[idx] = in[other];
    else out[other] = in[idx];
}
template <typename T, bool TO_ROWS>
__global__ void attention_heads_permute_vec_kernel(T* out, const T* in, int B, int seq, int heads, int d) {
    constexpr int V = vec16<T>::N;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)B * heads * seq * (d / V)) return;
    int64_t rows = i * V, other = heads_index(rows, B, seq, heads, d);
    *reinterpret_cast<int4*>(out + (TO_ROWS ? rows : other)) = *reinterpret_cast<const int4*>(in + (TO_ROWS ? other : rows));
}

/* Where a slice's rows sit in the full sequence (context parallelism): rows [0, len) are sequence
 * positions start[0] + i, rows [len, 2*len) are start[1] + i. len == 0: rows are positions 0, 1, ... */
typedef struct { int len; int start[2]; } mt_seq_span;

/* The attention geometry one tensor-parallel rank sees. */
typedef struct {
    int B, S, heads, groups, d; /* this rank's query heads and K/V groups (heads % groups == 0), head dim */
    int rot;                    /* rotary channels per head (0: no RoPE) */
    const float* rope_cos;      /* [S, rot/2] (NULL without RoPE) */
    const float* rope_sin;
    const int32_t* positions;   /* [B*S] RoPE's position of each row (NULL: t; --reset-position-ids, CP) */
    const int32_t* doc_start;   /* [B*S] each query's document start, a sequence position (NULL: none;
                                   --reset-attention-mask) */
    mt_seq_span q_span, kv_span;/* context parallelism: the query rows' and the key rows' sequence positions */
    int S_kv;                   /* key rows per sample when they differ from the query rows (0: S) */
} mt_attention_dims;

/* Sequence position of row i of a span (mt_seq_span). */
__host__ __device__ __forceinline__ int seq_span_position(const mt_seq_span& sp, int i) {
    return sp.len == 0 ? i : i < sp.len ? sp.start[0] + i : sp.start[1] + i - sp.len;
}

/* Head permutes between [B, T, heads*d] rows and the attention kernels' layouts; the vectorised
 * kernels when d (and, with RoPE, half the rotary channels) is a multiple of the vector width. */
template <typename T>
static bool qkv_permute_vectorised(const mt_attention_dims& a) {
    constexpr int V = vec16<T>::N;
    return a.d % V == 0 && (a.rot == 0 || (a.rot / 2) % V == 0);
}
/* qkv [BT, qkv_width] -> q [B, heads, T, d], k, v [B, groups, T, d], RoPE applied to q and k     */
template <typename T>
static void split_qkv(const mt_exec* ex, const mt_attention_dims& a, T* q, T* k, T* v, const T* qkv) {
    int64_t n = (int64_t)a.B * a.S * (a.heads + 2 * a.groups) * a.d;
    if (qkv_permute_vectorised<T>(a))
        attention_qkv_permute_vec_kernel<T, false><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(
            (T*)qkv, q, k, v, a.rope_cos, a.rope_sin, a.positions, a.B, a.S, a.heads, a.groups, a.d, a.rot);
    else
        attention_split_heads_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(
            q, k, v, qkv, a.rope_cos, a.rope_sin, a.positions, a.B, a.S, a.heads, a.groups, a.d, a.rot);
    LAUNCH_CHECK(ex->error);
}
/* dq [B, heads, T, d], dk, dv [B, groups, T, d] -> dqkv [BT, qkv_width], RoPE's transpose applied to dq and dk */
template <typename T>
static void merge_qkv_grads(const mt_exec* ex, const mt_attention_dims& a, T* dqkv, T* dq, T* dk, T* dv) {
    int64_t n = (int64_t)a.B * a.S * (a.heads + 2 * a.groups) * a.d;
    if (qkv_permute_vectorised<T>(a))
        attention_qkv_permute_vec_kernel<T, true><<<ceil_div(n / vec16<T>::N, 256), 256, 0, ex->stream>>>(
            dqkv, dq, dk, dv, a.rope_cos, a.rope_sin, a.positions, a.B, a.S, a.heads, a.groups, a.d, a.rot);
    else
        attention_merge_head_grads_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(
            dqkv, dq, dk, dv, a.rope_cos, a.rope_sin, a.positions, a.B, a.S, a.heads, a.groups, a.d, a.rot);
    LAUNCH_CHECK(ex->error);
}
/* [B, heads, T, d] <-> [BT, heads*d] (to_rows: the first into the second) */
template <typename T>
static void permute_heads(const mt_exec* ex, const mt_attention_dims& a, T* out, const T* in, bool to_rows) {
    int64_t n = (int64_t)a.B * a.heads * a.S * a.d;
    bool vec = a.d % vec16<T>::N == 0;
    int blocks = ceil_div(vec ? n / vec16<T>::N : n, 256);
    if (vec && to_rows) attention_heads_permute_vec_kernel<T, true><<<blocks, 256, 0, ex->stream>>>(out, in, a.B, a.S, a.heads, a.d);
    else if (vec) attention_heads_permute_vec_kernel<T, false><<<blocks, 256, 0, ex->stream>>>(out, in, a.B, a.S, a.heads, a.d);
    else if (to_rows) attention_heads_permute_kernel<T, true><<<blocks, 256, 0, ex->stream>>>(out, in, a.B, a.S, a.heads, a.d);
    else attention_heads_permute_kernel<T, false><<<blocks, 256, 0, ex->stream>>>(out, in, a.B, a.S, a.heads, a.d);
    LAUNCH_CHECK(ex->error);
}

/* Flash path (bf16, head dim 64 or 128): the kernels read q, k, v straight from the fused QKV rows
 * and write the output straight into the attention output rows; the backward reads dO and O from
 * rows and writes dq, dk, dv into the gradient's QKV rows. No split, no head permutes. RoPE rotates
 * q and k in place in the saved QKV rows (forward) and un-rotates their gradient (backward).
 * Each row at its own position a.positions (--reset-position-ids; generation's rows, section 23), else
 * (NULL) row bt at bt mod S. */
template <typename T>
static void rope_qkv_rows(const mt_exec* ex, const mt_attention_dims& a, T* qkv, bool backward) {
    if (a.rot == 0) return;
    int half = a.rot / 2, qpg = a.heads / a.groups;
    constexpr int V = vec16<T>::N;
    bool vec = half % V == 0;
    int64_t BT = (int64_t)a.B * a.S;
    int64_t threads = BT * a.groups * (qpg + 1) * (vec ? half / V : half);
    unsigned blocks = ceil_div(threads, 256);
    auto kernel = vec ? (backward ? rope_qkv_rows_kernel<T, V, true> : rope_qkv_rows_kernel<T, V, false>)
                      : (backward ? rope_qkv_rows_kernel<T, 1, true> : rope_qkv_rows_kernel<T, 1, false>);
    kernel<<<blocks, 256, 0, ex->stream>>>(qkv, a.rope_cos, a.rope_sin, a.positions, BT, a.S, a.groups, qpg, a.d,
                                           a.rot);
    LAUNCH_CHECK(ex->error);
}

/* ---- Query and key norms (--qk-layernorm; Megatron-Core's q_layernorm and k_layernorm, built with
 *      the model's normalization, epsilon and --apply-layernorm-1p): after the QKV linear each q head
 *      and each k head of a row, a vector [d], is normalised on its own, all query heads by one
 *      weight (and bias) [d] and all key heads by another; then RoPE rotates them. The statistics
 *      and the rounding of each output element are the row norms' (section 6: fp32, two passes,
 *      warp sums, norm_output). Working units: the rows' head vectors in the QKV layout, vector u =
 *      (row * groups + g) * (qpg + 2) + slot at element u * d (slot < qpg a query head, qpg the key,
 *      qpg + 1 the value); the statistics of a q or k vector at (row * groups + g) * (qpg + 1) + slot
 *      of stats [2, BT * groups * (qpg + 1)] (mean, then 1/std; RMSNorm's mean is 0). ---- */

/* out [BT, width] = qkv with its q and k vectors normalised and v copied; one warp per vector. */
template <typename T>
__global__ void qk_norm_forward_kernel(T* out, float* stats, const T* qkv, const T* wq, const T* bq, const T* wk,
                                       const T* bk, int64_t BT, int groups, int qpg, int d, float eps, bool rms,
                                       float w1) {
    const int slots = qpg + 2, lane = threadIdx.x % 32;
    const int64_t u = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (u >= BT * groups * slots) return;
    const int slot = (int)(u % slots);
    const T* x = qkv + u * d;
    T* o = out + u * d;
    if (slot == qpg + 1) { /* the value head: unchanged */
        for (int c = lane; c < d; c += 32) o[c] = x[c];
        return;
    }
    const T* w = slot < qpg ? wq : wk;
    const T* b = slot < qpg ? bq : bk;
    float sum = 0.0f;
    for (int c = lane; c < d; c += 32) sum += to_float(x[c]);
    const float mean = rms ? 0.0f : warp_sum(sum) / d;
    float var = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float e = to_float(x[c]) - mean;
        var += e * e;
    }
    var = warp_sum(var) / d;
    const float rstd = 1.0f / sqrtf(var + eps);
    for (int c = lane; c < d; c += 32)
        o[c] = from_float<T>(norm_output(to_float(x[c]), mean, rstd, to_float(w[c]), w1, b ? to_float(b[c]) : 0.0f));
    if (lane == 0) {
        const int64_t at = (u / slots) * (qpg + 1) + slot;
        stats[at] = mean;
        stats[BT * groups * (qpg + 1) + at] = rstd;
    }
}

/* The weight and bias gradients' partial column sums: partial_q [2, chunks, d] = (dw_q, db_q) over
 * the q vectors (blockIdx.z 0), partial_k the same over the k vectors (1); chunk k sums rows
 * [k rows_per_chunk, ...), in each row its vectors of the kind in group order: dw += dy * xhat,
 * db += dy. dy is the gradient of the normalised vectors (in the QKV layout), x the vectors before the
 * norm. One thread per column c of one kind. */
template <typename T>
__global__ void qk_norm_weight_grad_partial_kernel(float* partial_q, float* partial_k, const T* dy, const T* x,
                                                   const float* stats, int64_t BT, int groups, int qpg, int d,
                                                   int rows_per_chunk, int chunks) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y, key = blockIdx.z;
    if (c >= d) return;
    const int slots = qpg + 2, first = key ? qpg : 0, last = key ? qpg : qpg - 1;
    const int64_t r0 = (int64_t)chunk * rows_per_chunk, r1 = r0 + rows_per_chunk < BT ? r0 + rows_per_chunk : BT;
    const float* rstd = stats + BT * groups * (qpg + 1);
    float sw = 0.0f, sb = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int g = 0; g < groups; g++)
            for (int slot = first; slot <= last; slot++) {
                const int64_t u = (r * groups + g) * slots + slot, at = (r * groups + g) * (qpg + 1) + slot;
                const float gy = to_float(dy[u * d + c]);
                sw += gy * ((to_float(x[u * d + c]) - stats[at]) * rstd[at]);
                sb += gy;
            }
    float* partial = key ? partial_k : partial_q;
    partial[(int64_t)chunk * d + c] = sw;
    partial[((int64_t)chunks + chunk) * d + c] = sb;
}

/* In place on the q and k vectors of dqkv [BT, width]: the gradient of the normalised vectors becomes
 * that of the vectors before the norm, rstd (g - mean(g) - xhat mean(g xhat)) with g = dy (w + w1)
 * (RMSNorm: without the mean(g) term); the v vectors are left alone. One warp per q or k vector. */
template <typename T>
__global__ void qk_norm_backward_input_kernel(T* dqkv, const T* qkv, const float* stats, const T* wq, const T* wk,
                                              int64_t BT, int groups, int qpg, int d, bool rms, float w1) {
    const int normed = qpg + 1, lane = threadIdx.x % 32;
    const int64_t v = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; /* the q/k vectors in order */
    if (v >= BT * groups * normed) return;
    const int slot = (int)(v % normed);
    const int64_t u = (v / normed) * (qpg + 2) + slot;
    const T* w = slot < qpg ? wq : wk;
    T* dy = dqkv + u * d;
    const T* x = qkv + u * d;
    const float m = stats[v], rs = stats[BT * groups * normed + v];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float g = to_float(dy[c]) * (to_float(w[c]) + w1);
        sum_g += g;
        sum_gx += g * ((to_float(x[c]) - m) * rs);
    }
    const float mean_g = rms ? 0.0f : warp_sum(sum_g) / d, mean_gx = warp_sum(sum_gx) / d;
    for (int c = lane; c < d; c += 32) { /* each lane rewrites only the elements it read */
        const float g = to_float(dy[c]) * (to_float(w[c]) + w1);
        const float xhat = (to_float(x[c]) - m) * rs;
        dy[c] = from_float<T>(rs * (g - mean_g - xhat * mean_gx));
    }
}

/* Their launchers, over this rank's a.heads query heads in a.groups groups of BT = a.B * a.S rows. */
template <typename T>
static void qk_norm_forward(const mt_exec* ex, const mt_attention_dims& a, T* out, float* stats, const T* qkv,
                            const T* wq, const T* bq, const T* wk, const T* bk, float eps, bool rms, float w1) {
    const int qpg = a.heads / a.groups;
    const int64_t BT = (int64_t)a.B * a.S, vectors = BT * a.groups * (qpg + 2);
    qk_norm_forward_kernel<T><<<ceil_div(vectors, 8), 256, 0, ex->stream>>>(out, stats, qkv, wq, bq, wk, bk, BT,
                                                                           a.groups, qpg, a.d, eps, rms, w1);
    LAUNCH_CHECK(ex->error);
}
/* dqkv's q and k vectors from the normalised ones' gradient to the inputs' (in place), and the
 * weights' and biases' gradients (dwq, dbq, dwk, dbk; a NULL bias skipped) written or, after the
 * step's first micro-batch, added (column_final_sums); partial_q, partial_k: column-sum scratch of at
 * least 2 x chunks x d floats each (chunks: BT rows cut into at most max_chunks). */
template <typename T>
static void qk_norm_backward(const mt_exec* ex, const mt_attention_dims& a, T* dqkv, const T* qkv, const float* stats,
                             const T* wq, const T* wk, float* dwq, float* dbq, float* dwk, float* dbk, float* partial_q,
                             float* partial_k, int max_chunks, bool rms, float w1) {
    const int qpg = a.heads / a.groups;
    const int64_t BT = (int64_t)a.B * a.S;
    int rows, chunks = colsum_chunks((int)BT, max_chunks, &rows);
    qk_norm_weight_grad_partial_kernel<T><<<dim3(ceil_div(a.d, 64), chunks, 2), 64, 0, ex->stream>>>(
        partial_q, partial_k, dqkv, qkv, stats, BT, a.groups, qpg, a.d, rows, chunks);
    LAUNCH_CHECK(ex->error);
    const int64_t part = (int64_t)chunks * a.d;
    column_final_sums(ex, 2, chunks, a.d, dwq, partial_q, dbq, partial_q + part);
    column_final_sums(ex, 2, chunks, a.d, dwk, partial_k, dbk, partial_k + part);
    const int64_t vectors = BT * a.groups * (qpg + 1);
    qk_norm_backward_input_kernel<T><<<ceil_div(vectors, 8), 256, 0, ex->stream>>>(dqkv, qkv, stats, wq, wk, BT,
                                                                                  a.groups, qpg, a.d, rms, w1);
    LAUNCH_CHECK(ex->error);
}

/* ---- Context parallelism's layouts (megatron.h mt_cp_position; section 17 exchanges them over the CP
 *      group). A rank's Sl rows of a sample are chunks r and 2 CP - 1 - r of the sequence (C = Sl / 2
 *      rows each). Two permutations, each one thread per element:
 *        chunked [CP, B, Sl, W] (block r: CP rank r's rows of every sample) <-> full [B, CP Sl, W] (the
 *        samples' rows in sequence order);
 *        rows [N, CP W] (a rank's rows, every column block) <-> blocks [CP, N, W] (block j: columns
 *        j W .. (j + 1) W - 1 of every row). ---- */
template <typename T, bool TO_FULL>
__global__ void cp_chunks_full_kernel(T* full, T* chunked, int B, int Sl, int W, int cp) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)cp * B * Sl * W) return;
    const int c = (int)(idx % W), i = (int)((idx / W) % Sl);
    const int64_t rb = idx / ((int64_t)W * Sl);
    const int b = (int)(rb % B), r = (int)(rb / B), C = Sl / 2;
    const int pos = i < C ? r * C + i : (2 * cp - 1 - r) * C + (i - C);
    const int64_t f = ((int64_t)b * Sl * cp + pos) * W + c;
    if (TO_FULL) full[f] = chunked[idx];
    else chunked[idx] = full[f];
}
template <typename T, bool TO_BLOCKS>
__global__ void cp_rows_blocks_kernel(T* rows, T* blocks, int64_t N, int W, int cp) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)cp * N * W) return;
    const int c = (int)(idx % W);
    const int64_t r = (idx / W) % N;
    const int j = (int)(idx / ((int64_t)W * N));
    const int64_t at = r * ((int64_t)cp * W) + (int64_t)j * W + c;
    if (TO_BLOCKS) blocks[idx] = rows[at];
    else rows[at] = blocks[idx];
}
/* full [B, CP Sl, W] <-> chunked [CP, B, Sl, W] (to_full: the second into the first) */
template <typename T>
static void cp_chunks_full(const mt_exec* ex, T* full, T* chunked, int B, int Sl, int W, int cp, bool to_full) {
    const int64_t n = (int64_t)cp * B * Sl * W;
    if (to_full) cp_chunks_full_kernel<T, true><<<ceil_div(n, 256), 256, 0, ex->stream>>>(full, chunked, B, Sl, W, cp);
    else cp_chunks_full_kernel<T, false><<<ceil_div(n, 256), 256, 0, ex->stream>>>(full, chunked, B, Sl, W, cp);
    LAUNCH_CHECK(ex->error);
}
/* rows [N, CP W] <-> blocks [CP, N, W] (to_blocks: the first into the second) */
template <typename T>
static void cp_rows_blocks(const mt_exec* ex, T* rows, T* blocks, int64_t N, int W, int cp, bool to_blocks) {
    const int64_t n = (int64_t)cp * N * W;
    if (to_blocks) cp_rows_blocks_kernel<T, true><<<ceil_div(n, 256), 256, 0, ex->stream>>>(rows, blocks, N, W, cp);
    else cp_rows_blocks_kernel<T, false><<<ceil_div(n, 256), 256, 0, ex->stream>>>(rows, blocks, N, W, cp);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 8. Exact attention                                                                             */
/*    The simple path (fp32, fp16, and bf16 head dims other than 64/128): the scores are          */
/*    materialised per layer, softmax(scale * Q K^T) with the causal mask in place, and its       */
/*    backward dS = scale * P * (dP - rowsum(dP * P)). With --reset-attention-mask (doc_start     */
/*    [B, T], mt_document_boundaries) query q sees keys doc_start[q] <= k <= q only; the others   */
/*    get probability 0 like the causal ones. The GEMMs around it are in the model (section 17).  */
/*    defines: causal_softmax_forward, causal_softmax_backward, attention_dropout.                */
/* ============================================================================================== */

/* Causal softmax in place over rows of scores [B*heads, Sq, Sk] (query rows of Sk keys in sequence
 * order): p = softmax(scale * s) over lo <= k <= pos, pos = the query row's sequence position (its row
 * q, or with context parallelism seq_span_position(qs, q)), lo = doc_start[b, q] (a sequence position)
 * or 0 without document masks; exactly 0 elsewhere. One warp per row. */
template <typename T>
__global__ void causal_softmax_forward_kernel(T* scores, int rows, int Sq, int Sk, float scale,
                                              const int32_t* doc_start, int heads, mt_seq_span qs) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int q = row % Sq, pos = seq_span_position(qs, q);
    const int lo = doc_start ? doc_start[(int64_t)(row / (heads * Sq)) * Sq + q] : 0;
    T* s = scores + (int64_t)row * Sk;
    float mx = -INFINITY;
    for (int k = lo + lane; k <= pos; k += 32) mx = fmaxf(mx, scale * to_float(s[k]));
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int k = lo + lane; k <= pos; k += 32) sum += expf(scale * to_float(s[k]) - mx);
    sum = warp_sum(sum);
    float inv = 1.0f / sum;
    for (int k = lane; k < Sk; k += 32)
        s[k] = from_float<T>(k >= lo && k <= pos ? expf(scale * to_float(s[k]) - mx) * inv : 0.0f);
}

/* In place over dP: dS = scale * P * (dP - sum_k dP*P). With attention dropout dscores holds the
 * gradient of the dropped probabilities P_d, and dP = dropout(that) with the forward's mask (drawn at
 * the query's and keys' sequence positions in a sequence of Sk). */
template <typename T>
__global__ void causal_softmax_backward_kernel(T* dscores, const T* probs, int rows, int Sq, int Sk, float scale,
                                               mt_dropout d, int heads, const int32_t* doc_start, mt_seq_span qs) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int q = row % Sq, pos = seq_span_position(qs, q);
    const int lo = doc_start ? doc_start[(int64_t)(row / (heads * Sq)) * Sq + q] : 0;
    T* ds = dscores + (int64_t)row * Sk;
    const T* p = probs + (int64_t)row * Sk;
    const int b = row / (heads * Sq), h = (row / Sq) % heads;
    auto dprob = [&](int k) {
        const float g = to_float(ds[k]);
        if (!d.on) return g;
        return dropout_value(d, dropout_bits(d.key, dropout_attention_counter(d, b, h, pos, k, Sk)), k, g);
    };
    float dot = 0.0f;
    for (int k = lo + lane; k <= pos; k += 32) dot += dprob(k) * to_float(p[k]);
    dot = warp_sum(dot);
    for (int k = lane; k < Sk; k += 32)
        ds[k] = from_float<T>(k >= lo && k <= pos ? scale * to_float(p[k]) * (dprob(k) - dot) : 0.0f);
}

/* out = dropout(probs) over [B*heads, Sq, Sk] rows (row and position as above): the probabilities that
 * multiply V. */
template <typename T>
__global__ void attention_dropout_kernel(T* out, const T* probs, int rows, int Sq, int Sk, mt_dropout d, int heads,
                                         mt_seq_span qs) {
    const int64_t pairs_per_row = (Sk + 1) / 2;
    const int64_t pair = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (pair >= (int64_t)rows * pairs_per_row) return;
    const int row = (int)(pair / pairs_per_row), k0 = (int)(pair % pairs_per_row) * 2;
    const int q = row % Sq, b = row / (heads * Sq), h = (row / Sq) % heads;
    const uint64_t bits = dropout_bits(d.key, dropout_attention_counter(d, b, h, seq_span_position(qs, q), k0, Sk));
    for (int k = k0; k < k0 + 2 && k < Sk; k++) {
        const int64_t i = (int64_t)row * Sk + k;
        out[i] = from_float<T>(dropout_value(d, bits, k, to_float(probs[i])));
    }
}

/* probs [rows, S, Sk] (rows = B*heads query rows of Sk keys; Sk 0: S): softmax(scale * scores), causal,
 * in place; with doc_start [B, S] (heads: query heads per sample) also masked before each query's
 * document; qs: the query rows' sequence positions (context parallelism; default: row t is t) */
template <typename T>
static void causal_softmax_forward(const mt_exec* ex, T* probs, int rows, int S, float scale,
                                   const int32_t* doc_start = NULL, int heads = 1, int Sk = 0,
                                   mt_seq_span qs = mt_seq_span()) {
    causal_softmax_forward_kernel<T><<<ceil_div(rows, 8), 256, 0, ex->stream>>>(probs, rows, S, Sk > 0 ? Sk : S, scale,
                                                                               doc_start, heads, qs);
    LAUNCH_CHECK(ex->error);
}
/* dscores [rows, S, Sk]: dP -> dS in place, from the forward's probs (rows = B*heads*S; with a
 * dropout site, dscores is the gradient of the dropped probabilities) */
template <typename T>
static void causal_softmax_backward(const mt_exec* ex, T* dscores, const T* probs, int rows, int S, float scale,
                                    const mt_dropout& d = mt_dropout(), int heads = 1,
                                    const int32_t* doc_start = NULL, int Sk = 0, mt_seq_span qs = mt_seq_span()) {
    causal_softmax_backward_kernel<T><<<ceil_div(rows, 8), 256, 0, ex->stream>>>(dscores, probs, rows, S,
                                                                                Sk > 0 ? Sk : S, scale, d, heads,
                                                                                doc_start, qs);
    LAUNCH_CHECK(ex->error);
}
/* out [rows, S, Sk] = dropout(probs) with the site's mask (rows = B*heads*S) */
template <typename T>
static void attention_dropout(const mt_exec* ex, T* out, const T* probs, int rows, int S, const mt_dropout& d,
                              int heads, int Sk = 0, mt_seq_span qs = mt_seq_span()) {
    const int keys = Sk > 0 ? Sk : S;
    const int64_t pairs = (int64_t)rows * ((keys + 1) / 2);
    attention_dropout_kernel<T><<<ceil_div(pairs, 256), 256, 0, ex->stream>>>(out, probs, rows, S, keys, d, heads, qs);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 9. Flash attention (bf16)                                                                      */
/*    Causal flash attention on tensor cores for head dims 64 and 128, deterministic (no          */
/*    atomics), with optional document masks (doc_start: tiles outside a tile's documents are     */
/*    skipped, the work saved on packed short documents): device helpers, forward, backward       */
/*    (dK/dV and dQ kernels), launchers. The lab dev/cuda/flash_attention.cu checks it against    */
/*    a CPU reference, times it and explains the design.                                          */
/*    Queries and keys may be slices of a sequence at two-chunk positions (context parallelism).  */
/*    defines: namespace fa (9.1-9.3), then attn_view, flash_attention_forward,                   */
/*    flash_attention_backward, flash_colsum_chunks, flash_attention_forward_span,                */
/*    flash_attention_backward_span (9.4), the ring attention of context parallelism (9.5).       */
/* ============================================================================================== */

typedef __nv_bfloat16 bf16;

namespace fa {

constexpr int THREADS = 128; /* 4 warps per CTA in every tiled kernel */
constexpr int BN = 64;       /* keys per K/V tile (forward, dQ) and keys per CTA (dK/dV) */
constexpr int COLSUM_TILE = 64; /* rows per chunk of the backward's column sums (dQ and dK/dV tiles) */
constexpr float LOG2E = 1.4426950408889634f;

/* ============================================================================================== */
/* 9.1 Device helpers                                                                             */
/*    defines: fa::heads_view, the ldmatrix / mma.sync wrappers, tile loads, fa::geom (sequence   */
/*    positions), the in-register GEMMs.                                                          */
/* ============================================================================================== */

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators. */
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats -> one register of two bf16 (lo in the low half, the element of the lower column). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

/* 2^x on the special-function unit; 2^-inf = 0, which is how masked scores vanish. */
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ---- Where a head's [T, d] rows live. Row t of query head h in batch b starts at
 *        p + b*batch + t*row + (h / qpg)*group + (h % qpg)*head
 *      (qpg = query heads per kv head; K and V views are indexed by kv head with qpg = 1). One view
 *      covers the packed [B, H, T, d] layout and the model's own rows without copies: the fused QKV
 *      rows [B*T, groups*(qpg+2)*d] (q_1..q_qpg, k, v per group) and the attention output rows
 *      [B*T, H*d]. Strides are in elements, multiples of 8 (16-byte rows for cp.async). ---- */
template <typename E>
struct heads_view {
    E* p;
    int64_t batch, row, group, head;
    __host__ __device__ E* at(int b, int h, int qpg) const {
        return p + b * batch + (int64_t)(h / qpg) * group + (int64_t)(h % qpg) * head;
    }
    /* head h's first element relative to p within a row (add p's own column for the model's rows) */
    __host__ __device__ int64_t column(int h, int qpg) const { return (int64_t)(h / qpg) * group + (int64_t)(h % qpg) * head; }
};

/* ---- Column sums of a gradient tile, for the bias of the linear that produced Q, K, V (the QKV
 *      bias gradient): each warp's 16 rows (fragment rows g and g+8 of each m16 block, values as
 *      stored: rounded to bf16, rows at or past T left out) are summed per column over the 8 lanes
 *      sharing a column, then the warps' sums in warp order through shared memory (`red`, WARPS * D
 *      floats), and written to partial[chunk * ld + column0 + c], c < D. Fixed order: deterministic. */
template <int D, int WARPS, int MT>
__device__ __forceinline__ void tile_column_sums(float* __restrict__ partial, int64_t ld, int64_t chunk, int64_t column0,
                                                 const float (&acc)[MT][D / 8][4], float scale, int row0, int T,
                                                 float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float s = 0.0f;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    if (row0 + mt * 16 + g + r * 8 < T) s += __bfloat162float(__float2bfloat16(acc[mt][dt][2 * r + e] * scale));
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            if (g == 0) red[warp * D + dt * 8 + 2 * t + e] = s;
        }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += 32 * WARPS) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) s += red[w * D + c];
        partial[chunk * ld + column0 + c] = s;
    }
}

/* ---- Tile movement: global rows (stride `ld` elements) -> shared [ROWS][D+8], 16 bytes per
 *      cp.async. Rows at or past T are zero-filled (the source address is clamped to row 0 so it
 *      stays valid). ---- */
template <int ROWS, int D, int NTH = THREADS>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t ld, int row0, int T) {
    constexpr int CHUNKS = D / 8, STRIDE = D + 8, N = ROWS * CHUNKS;
    static_assert(N % NTH == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int k = 0; k < N / NTH; k++) {
        int i = k * NTH + threadIdx.x;
        int r = i / CHUNKS, c = i % CHUNKS;
        int row = row0 + r;
        bool valid = row < T;
        cp_async_16(smem_u32(s + r * STRIDE + c * 8), g + (valid ? row : 0) * ld + c * 8, valid);
    }
}
/* ROWS fp32 values g[row0 ..] -> s[0 .. ROWS), zero past T. */
template <int ROWS, int NTH = THREADS>
__device__ __forceinline__ void load_vec(float* s, const float* g, int row0, int T) {
    static_assert(ROWS <= NTH, "one element per thread");
    int i = threadIdx.x;
    if (i < ROWS) {
        int row = row0 + i;
        bool valid = row < T;
        cp_async_4(smem_u32(s + i), g + (valid ? row : 0), valid);
    }
}

/* ---- The K/V loop step of the forward and dQ kernels: K and V tiles of BN keys double-buffered in
 *      sK, sV [2][BN][D+8]. Step kt prefetches tile kt+1 into the other stage (freed by the barrier
 *      that ended the previous step; an empty group keeps the count uniform), waits for tile kt and
 *      returns its stage. ---- */
template <int D, int NTH>
__device__ __forceinline__ void kv_stage_step(bf16* sK, bf16* sV, const bf16* Kh, const bf16* Vh, int64_t k_ld,
                                              int64_t v_ld, int kt, int n_kt, int T, const bf16** sKs,
                                              const bf16** sVs) {
    constexpr int S = D + 8;
    *sKs = sK + (kt & 1) * BN * S;
    *sVs = sV + (kt & 1) * BN * S;
    if (kt + 1 < n_kt) {
        load_tile<BN, D, NTH>(sK + ((kt + 1) & 1) * BN * S, Kh, k_ld, (kt + 1) * BN, T);
        load_tile<BN, D, NTH>(sV + ((kt + 1) & 1) * BN * S, Vh, v_ld, (kt + 1) * BN, T);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
}

/* ---- Fragment loads from padded shared tiles (stride S elements per row) ---- */

/* A fragment of the 16x16 block at (row0, col0) of a row-major tile. Lanes 0-15 address rows
 * row0+0..15 at col0, lanes 16-31 the same rows at col0+8: matrices (rows 0-7, cols 0-7),
 * (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a0, a1, a2, a3. */
__device__ __forceinline__ void load_a(uint32_t a[4], const bf16* s, int S, int row0, int col0, int lane) {
    ldmatrix_x4(a, smem_u32(s + (row0 + (lane & 15)) * S + col0 + (lane >> 4) * 8));
}
/* B fragments of two adjacent n8 tiles when the tile is stored [n][k] (a row per n: K for Q K^T).
 * Rows n0..n0+15, cols k0..k0+15: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
 * (n 8-15, k 8-15); without .trans lane 4g+t gets M[g][2t..], i.e. B[k=2t..][n=g].
 * b[0], b[1] -> n-tile n0..n0+7;  b[2], b[3] -> n-tile n0+8..n0+15. */
__device__ __forceinline__ void load_b_nk(uint32_t b[4], const bf16* s, int S, int n0, int k0, int lane) {
    ldmatrix_x4(b, smem_u32(s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * S + k0 + ((lane >> 3) & 1) * 8));
}
/* B fragments of two adjacent n8 tiles when the tile is stored [k][n] (a row per k: V for P V).
 * Rows k0..k0+15, cols n0..n0+15: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
 * (k 8-15, n 8-15); with .trans lane 4g+t gets M[2t..2t+1][g], i.e. B[k=2t..][n=g].
 * b[0], b[1] -> n-tile n0..n0+7;  b[2], b[3] -> n-tile n0+8..n0+15. */
__device__ __forceinline__ void load_b_kn(uint32_t b[4], const bf16* s, int S, int k0, int n0, int lane) {
    ldmatrix_x4_trans(b, smem_u32(s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + n0 + (lane >> 4) * 8));
}
/* Two adjacent n8 accumulators (a 16x16 fp32 block) -> one bf16 A fragment of the same block. */
__device__ __forceinline__ void c_to_a(uint32_t a[4], const float c0[4], const float c1[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

/* ---- Sequence positions (context parallelism, section 9.5). The kernels take Tq query rows and Tk key
 *      rows, each a slice of the sequence described by an mt_seq_span (section 7), and mask by position:
 *      key k is visible to query q iff pos(k) <= pos(q) (and doc[q] <= pos(k)). A span's two chunks hold
 *      whole tiles (len a multiple of span_tile_rows, checked on the host), so a tile's rows are
 *      consecutive positions and a tile is mapped by one offset; positions grow with the row (start[0] +
 *      len <= start[1]), so the keys a query tile sees are one range of key tiles. `seq` is the full
 *      sequence length: attention dropout counts its elements by global (query, key) positions in a
 *      seq x seq matrix, so a context-parallel run draws the masks of the whole sequence. The default
 *      geometry (len 0, Tq = Tk = seq = T) is the kernels' plain causal attention, bit for bit. ---- */
struct geom {
    int Tq, Tk;          /* query rows, key rows of this call */
    mt_seq_span qs, ks;  /* where they sit in the sequence */
    int seq;             /* the full sequence length (dropout counters) */
};
__host__ __device__ __forceinline__ geom plain_geom(int T) { return {T, T, {0, {0, 0}}, {0, {0, 0}}, T}; }
/* the sequence position of row i of a slice */
__host__ __device__ __forceinline__ int span_pos(const mt_seq_span& s, int i) {
    return s.len == 0 ? i : i < s.len ? s.start[0] + i : s.start[1] + (i - s.len);
}
/* how many of the slice's T rows sit at positions below pos (they are its first rows) */
__host__ __device__ __forceinline__ int span_rows_below(const mt_seq_span& s, int T, int pos) {
    if (s.len == 0) return min(max(pos, 0), T);
    return min(max(pos - s.start[0], 0), s.len) + min(max(pos - s.start[1], 0), s.len);
}
/* The kernels' MODE: 0 plain causal attention (rows are positions: the geometry's spans are not read,
 * so the plain kernels are compiled as they were before slices existed), 1 sequence slices, 2 slices
 * whose results are merged into (accumulated onto) a running result (section 9.5). */
template <bool POS>
__device__ __forceinline__ int pos_of(const mt_seq_span& s, int i) { return POS ? span_pos(s, i) : i; }
template <bool POS>
__device__ __forceinline__ int rows_below(const mt_seq_span& s, int T, int pos) {
    return POS ? span_rows_below(s, T, pos) : min(max(pos, 0), T);
}

/* ---- Document masks (--reset-attention-mask): doc [B, T] holds each query's document start, which
 *      never decreases along t; key k is visible to query q iff doc[q] <= k <= q. For the rows of a
 *      query tile from q0 (a warp's [wq_first, wq_last]): tile_first, the first row's start, is the
 *      tile's smallest (key tiles ending before it are skipped whole); warp_first and warp_last the
 *      warp's smallest and largest; row[mt][r] this thread's rows' (rows past T read row T-1's: they
 *      are never stored). Without doc everything is 0, which masks nothing. ---- */
template <int MT>
struct doc_rows {
    int tile_first, warp_first, warp_last;
    int row[MT][2];
    __device__ __forceinline__ doc_rows(const int32_t* __restrict__ doc, int b, int T, int q0, int wq_first,
                                        int wq_last, int g) {
        const int32_t* d = doc ? doc + (int64_t)b * T : NULL;
        tile_first = d ? d[q0] : 0;
        warp_first = d ? d[min(wq_first, T - 1)] : 0;
        warp_last = d ? d[min(wq_last, T - 1)] : 0;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) row[mt][r] = d ? d[min(wq_first + mt * 16 + g + r * 8, T - 1)] : 0;
    }
};

/* ---- Attention dropout on a warp's tile of scores laid out as the forward's and dQ's (queries as
 *      rows): x[mt][nt][2r], [2r+1] are query wq_first+mt*16+g+8r and keys k0+nt*8+2t, +1, one
 *      counter for the pair. Each element becomes dropout(x) with the site's mask (section 5). ---- */
template <int MT, int NT>
__device__ __forceinline__ void dropout_rows_tile(float (&x)[MT][NT][4], const mt_dropout& drop, int b, int h,
                                                  int wq_first, int k0, int T, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int row = wq_first + mt * 16 + g + r * 8, key = k0 + nt * 8 + 2 * t;
                const uint64_t bits = dropout_bits(drop.key, dropout_attention_counter(drop, b, h, row, key, T));
                x[mt][nt][2 * r] = dropout_value(drop, bits, key, x[mt][nt][2 * r]);
                x[mt][nt][2 * r + 1] = dropout_value(drop, bits, key + 1, x[mt][nt][2 * r + 1]);
            }
}

/* ---- Warp-level tile products. A warp owns 16*MT rows; every loop is unrolled so fragment
 *      arrays are indexed by constants and stay in registers. ---- */

/* acc[16*MT x N] += A[rows a_row0.., 0..D) * B^T, A row-major in shared memory, B stored [n][k]
 * ([N][D] in shared memory). Used for S = Q K^T, dP = dO V^T and their transposes. */
template <int MT, int N, int D>
__device__ __forceinline__ void gemm_abt(float (&acc)[MT][N / 8][4], const bf16* sA, int a_row0, const bf16* sB,
                                         int lane) {
    constexpr int S = D + 8;
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) load_a(a[mt], sA, S, a_row0 + mt * 16, kd * 16, lane);
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t b[4];
            load_b_nk(b, sB, S, np * 16, kd * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}
/* Same, with A already in registers as fragments a[MT][D/16][4] (the forward keeps Q there).     */
template <int MT, int N, int D>
__device__ __forceinline__ void gemm_abt_rega(float (&acc)[MT][N / 8][4], const uint32_t (&a)[MT][D / 16][4],
                                              const bf16* sB, int lane) {
    constexpr int S = D + 8;
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++) {
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t b[4];
            load_b_nk(b, sB, S, np * 16, kd * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(acc[mt][2 * np], a[mt][kd], b[0], b[1]);
                mma_16816(acc[mt][2 * np + 1], a[mt][kd], b[2], b[3]);
            }
        }
    }
}
/* acc[16*MT x D] += P[16*MT x K] * B, P given as fp32 accumulators (rounded to bf16 here), B stored
 * [k][n] ([K][D] in shared memory). Used for O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
 * MASKED (MT = 1, K <= 64): P's element [nt][j] enters as P * dscale where bit nt*4 + j of keep is
 * set, else as 0 (attention dropout's P_d in dV += P_d^T dO, with P itself kept for dS). */
template <int MT, int K, int D, bool MASKED = false>
__device__ __forceinline__ void gemm_pb(float (&acc)[MT][D / 8][4], const float (&p)[MT][K / 8][4], const bf16* sB,
                                        int lane, uint32_t keep = 0, float dscale = 1.0f) {
    constexpr int S = D + 8;
    static_assert(!MASKED || (MT == 1 && K / 8 * 4 <= 32), "one keep bit per element of one m16 block");
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if constexpr (MASKED) {
                float c[2][4];
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        c[n][j] = (keep >> ((2 * kk + n) * 4 + j)) & 1u ? p[mt][2 * kk + n][j] * dscale : 0.0f;
                c_to_a(a[mt], c[0], c[1]);
            } else {
                c_to_a(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
            }
        }
#pragma unroll
        for (int np = 0; np < D / 16; np++) {
            uint32_t b[4];
            load_b_kn(b, sB, S, kk * 16, np * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

/* ============================================================================================== */
/* 9.2 Forward                                                                                    */
/*    defines: fa::fwd_merge, fa::flash_fwd_kernel.                                               */
/* ============================================================================================== */

/* Shared memory: sQ [BM][D+8], sK [2][BN][D+8], sV [2][BN][D+8] (two stages each). */
template <int D, int BM>
constexpr size_t fwd_smem_bytes() {
    return (size_t)(BM + 4 * BN) * (D + 8) * sizeof(bf16);
}

/* The forward's partial results (context parallelism's ring, section 9.5): in MODE 2 the kernel's block
 * result (O_blk, LSE_blk over this call's keys) is merged by log-sum-exp into the running result of
 * the earlier blocks: lse = log(e^lse_run + e^lse_blk), acc = acc * e^(lse_run - lse) + O_blk *
 * e^(lse_blk - lse), in fp32, acc [B, H, Tq, D] packed. first: there is no running result yet; last:
 * the merged O is rounded to bf16 into the O view (once) instead of written to acc. LSE [B, H, Tq]
 * holds the running log-sum-exp throughout. A row that sees no key of the block has LSE_blk = -inf
 * and O_blk = 0, which the merge ignores. Each CTA owns its rows: no atomics, deterministic. */
struct fwd_merge {
    float* acc;
    int first, last;
};

template <int D, int BM, int WARPS, bool DROP, int MODE = 0>
__global__ void __launch_bounds__(32 * WARPS)
    flash_fwd_kernel(heads_view<bf16> O, float* __restrict__ LSE, heads_view<const bf16> Q, heads_view<const bf16> K,
                     heads_view<const bf16> V, int H, int Hkv, geom gm, float scale, mt_dropout drop,
                     const int32_t* __restrict__ doc, fwd_merge mo) {
    constexpr int NTH = 32 * WARPS, MT = BM / (16 * WARPS); /* m16 row blocks per warp: a warp owns 16*MT rows */
    constexpr int S = D + 8, NT = BN / 8, DT = D / 8;
    static_assert(BM % (16 * WARPS) == 0 && (D == 64 || D == 128), "tile shape");
    constexpr bool POS = MODE != 0, MERGE = MODE == 2;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = reinterpret_cast<bf16*>(smem);
    bf16* sK = sQ + BM * S;
    bf16* sV = sK + 2 * BN * S;

    const int Tq = gm.Tq, Tk = POS ? gm.Tk : gm.Tq;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int qpg = H / Hkv, hkv = h / qpg;             /* GQA: the kv head this query head reads */
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;   /* heaviest (last) query tiles launch first */
    const int wrow = warp * 16 * MT;                    /* this warp's first row inside the tile */
    const int wq_first = q0 + wrow, wq_last = wq_first + 16 * MT - 1;
    const int qoff = pos_of<POS>(gm.qs, q0) - q0;       /* row -> sequence position in this tile */
    const int wp_first = wq_first + qoff, wp_last = wq_last + qoff;
    const bf16* Qh = Q.at(b, h, qpg);                   /* row 0 of (b, h); rows Q.row apart */
    const bf16* Kh = K.at(b, hkv, 1);
    const bf16* Vh = V.at(b, hkv, 1);
    const float c = scale * LOG2E;                      /* softmax in base 2: exp(x*scale) = 2^(x*c) */
    /* causal: key tiles up to the last key at or before the tile's last row's position */
    const int n_kt = (rows_below<POS>(gm.ks, Tk, pos_of<POS>(gm.qs, min(q0 + BM, Tq) - 1) + 1) + BN - 1) / BN;
    const doc_rows<MT> dr(doc, b, Tq, q0, wq_first, wq_last, g);
    const int kt0 = rows_below<POS>(gm.ks, Tk, dr.tile_first) / BN; /* key tiles before every row's document: skipped */
    /* a merge step whose block no row of this tile sees leaves the running result as it is */
    if (MERGE && !mo.first && !mo.last && kt0 >= n_kt) return;

    /* prologue: Q tile and the first K/V tile in one cp.async group (in the stage kv_stage_step expects) */
    if (!POS || kt0 < n_kt) {
        load_tile<BM, D, NTH>(sQ, Qh, Q.row, q0, Tq);
        load_tile<BN, D, NTH>(sK + (kt0 & 1) * BN * S, Kh, K.row, kt0 * BN, Tk);
        load_tile<BN, D, NTH>(sV + (kt0 & 1) * BN * S, Vh, V.row, kt0 * BN, Tk);
        cp_async_commit();
    }

    uint32_t qf[MT][D / 16][4]; /* this warp's Q rows as A fragments, loaded once */
    float o[MT][DT][4];         /* O accumulator (unnormalised), rows g and g+8 of each m16 block */
    float m[MT][2], l[MT][2];   /* running max of the raw scores and this thread's partial row sum */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (int kt = kt0; kt < n_kt; kt++) {
        const int k0 = kt * BN;
        const int kp0 = pos_of<POS>(gm.ks, k0); /* the tile's first key's position; its keys are consecutive */
        const bf16 *sKs, *sVs;
        kv_stage_step<D, NTH>(sK, sV, Kh, Vh, K.row, V.row, kt, n_kt, Tk, &sKs, &sVs);

        if (kt == kt0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kd = 0; kd < D / 16; kd++) load_a(qf[mt][kd], sQ, S, wrow + mt * 16, kd * 16, lane);
        }

        /* else every key of this tile comes after every row of this warp, or before their documents */
        if (kp0 <= wp_last && kp0 + BN - 1 >= dr.warp_first) {
            /* S = Q K^T for this warp's rows: s[mt][nt] holds rows (g, g+8) x keys k0+nt*8+2t+(0,1) */
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
            gemm_abt_rega<MT, BN, D>(s, qf, sKs, lane);

            /* causal (and document) mask, only on tiles that cross this warp's diagonal (or a
             * document start of its rows); rows and keys as positions */
            if (kp0 + BN - 1 > wp_first || kp0 < dr.warp_last) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            int row = wp_first + mt * 16 + g + (j >> 1) * 8;
                            int key = kp0 + nt * 8 + 2 * t + (j & 1);
                            if (key > row || key < dr.row[mt][j >> 1]) s[mt][nt][j] = -INFINITY;
                        }
            }

            /* online softmax: new row max, rescale the old sum and accumulator by 2^((m_old-m_new)c),
             * P = 2^(s*c - m_new*c). A row is spread over the 4 lanes of a quad (same g). */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) { /* r = 0: row g, r = 1: row g+8 */
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(m[mt][r], mx);
                    /* a row with no unmasked key yet keeps m = -inf; use 0 so that -inf - -inf is not NaN */
                    const float base = m_new == -INFINITY ? 0.0f : m_new * c;
                    const float alpha = exp2_approx(m[mt][r] * c - base);
                    m[mt][r] = m_new;
                    float rowsum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            float p = exp2_approx(fmaf(s[mt][nt][2 * r + j], c, -base));
                            s[mt][nt][2 * r + j] = p;
                            rowsum += p;
                        }
                    l[mt][r] = l[mt][r] * alpha + rowsum; /* partial per lane; the quad is summed at the end */
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[mt][dt][2 * r] *= alpha;
                        o[mt][dt][2 * r + 1] *= alpha;
                    }
                }

            /* attention dropout: O accumulates P_d V with P_d = dropout(P); the row sums above (and so
             * LSE) are P's own. Counted by (query, key) positions in the whole sequence. */
            if constexpr (DROP) dropout_rows_tile<MT, NT>(s, drop, b, h, wp_first, kp0, gm.seq, g, t);

            /* O += P V, P straight from registers (bf16) */
            gemm_pb<MT, BN, D>(o, s, sVs, lane);
        }
        __syncthreads(); /* everyone is done with this stage before it is refilled */
    }

    /* epilogue: O = o / l, LSE = m*scale + log(l); rows past Tq are not stored. A row that saw no key
     * (only where the keys are another slice of the sequence) has l = 0: O = 0, LSE = -inf. */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float lsum = l[mt][r];
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
            const int row = wq_first + mt * 16 + g + r * 8;
            const float inv = !POS || lsum > 0.0f ? 1.0f / lsum : 0.0f;
            const float lse = !POS || lsum > 0.0f ? m[mt][r] * scale + logf(lsum) : -INFINITY;
            if constexpr (!MERGE) {
                if (row < Tq) {
                    bf16* orow = O.at(b, h, qpg) + (int64_t)row * O.row;
#pragma unroll
                    for (int dt = 0; dt < DT; dt++)
                        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) =
                            pack_bf16(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
                    if (t == 0) LSE[(size_t)bh * Tq + row] = lse;
                }
            } else { /* every row is valid here (Tq is a multiple of BM, checked on the host) */
                const size_t li = (size_t)bh * Tq + row;
                const float run = mo.first ? -INFINITY : LSE[li];
                __syncwarp(); /* the quad read LSE before its lane t = 0 rewrites it */
                const float mx = fmaxf(run, lse);
                const float merged = mx == -INFINITY ? -INFINITY : mx + logf(expf(run - mx) + expf(lse - mx));
                const float w_run = mx == -INFINITY ? 0.0f : expf(run - merged);
                const float w_blk = mx == -INFINITY ? 0.0f : expf(lse - merged) * inv;
                float* arow = mo.acc + li * D;
                bf16* orow = O.at(b, h, qpg) + (int64_t)row * O.row;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    float2 a = make_float2(0.0f, 0.0f);
                    if (!mo.first) a = *reinterpret_cast<const float2*>(arow + dt * 8 + 2 * t);
                    const float v0 = w_run * a.x + w_blk * o[mt][dt][2 * r];
                    const float v1 = w_run * a.y + w_blk * o[mt][dt][2 * r + 1];
                    if (mo.last) *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pack_bf16(v0, v1);
                    else *reinterpret_cast<float2*>(arow + dt * 8 + 2 * t) = make_float2(v0, v1);
                }
                if (t == 0) LSE[li] = merged;
            }
        }
}

/* ============================================================================================== */
/* 9.3 Backward                                                                                   */
/*    defines: fa::flash_bwd_dot_kernel, fa::bwd_acc, fa::flash_bwd_dkdv_kernel,                  */
/*    fa::flash_bwd_dq_kernel.                                                                    */
/* ============================================================================================== */

/* Dsum[(b*H + h)*T + t] = sum_e dO[b,h,t][e] * O[b,h,t][e], D/8 threads per row, 16-byte loads. */
template <int D>
__global__ void flash_bwd_dot_kernel(float* __restrict__ Dsum, heads_view<const bf16> dO, heads_view<const bf16> O,
                                     int H, int qpg, int T, size_t rows) {
    constexpr int TPR = D / 8; /* threads per row (8 or 16, a power of two dividing the warp) */
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t row = idx / TPR;
    const int part = (int)(idx % TPR);
    float acc = 0.0f;
    if (row < rows) {
        const int t = (int)(row % T), bh = (int)(row / T), b = bh / H, h = bh % H;
        uint4 a = *reinterpret_cast<const uint4*>(dO.at(b, h, qpg) + (int64_t)t * dO.row + part * 8);
        uint4 o = *reinterpret_cast<const uint4*>(O.at(b, h, qpg) + (int64_t)t * O.row + part * 8);
        const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 fa = __bfloat1622float2(a2[i]), fo = __bfloat1622float2(o2[i]);
            acc += fa.x * fo.x + fa.y * fo.y;
        }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && part == 0) Dsum[row] = acc;
}

/* Shared memory of dK/dV: sK, sV [KEYS][D+8]; sQ, sdO [2][BMQ][D+8]; sL, sD [2][BMQ] fp32; sDoc [2][BMQ]
 * int32 (the queries' document starts). */
template <int D, int BMQ, int KEYS>
constexpr size_t dkdv_smem_bytes() {
    return (size_t)(2 * KEYS + 4 * BMQ) * (D + 8) * sizeof(bf16) + 4 * BMQ * sizeof(float) + 2 * BMQ * sizeof(int32_t);
}

/* Document masks in dK/dV: the first query row after key position k's document, i.e. the first row q
 * from lo (the first row past position k) whose document starts after k (doc non-decreasing: a binary
 * search; T when k's document runs to the end). */
__device__ __forceinline__ int doc_query_end(const int32_t* __restrict__ d, int k, int lo, int T) {
    int hi = T;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (d[mid] > k) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* The backward's partial results (context parallelism's ring, section 9.5). dQ in MODE 2: dQ of this
 * call's keys is added in fp32 to acc [B, H, Tq, D] packed (first: nothing there yet; last: the sum is
 * rounded to bf16 into the dQ view instead). dK/dV in MODE 2: this call's dK (scaled) and dV are added
 * to dk_in / dv_in (NULL: nothing yet) and written to dk_out / dv_out, fp32 [B, Hkv, Tk, D] packed,
 * the buffers that travel around the ring to the keys' owner. */
struct bwd_acc {
    float* dq;
    int first, last;
    const float *dk_in, *dv_in;
    float *dk_out, *dv_out;
};

/* One CTA per (b, kv head, tile of KEYS = 16*WARPS keys); warp w owns keys k0+16w .. k0+16w+15. Everything
 * is computed transposed (keys as rows), so each warp's dK and dV rows stay in its registers:
 *   S^T = K Q^T,  P^T = exp(scale*S^T - LSE[q]),  dV += P^T dO,
 *   dP^T = V dO^T,  dS^T = P^T * (dP^T - Dsum[q]),  dK += dS^T Q,   finally dK *= scale.
 * The loop runs over the H/Hkv query heads of this kv head, and for each over the query tiles of
 * BMQ rows from the one holding the first query at or after key k0's position (earlier queries see
 * none of these keys) to the end, or with document masks (doc) to the tile holding the last query of
 * the last key's document (later queries see none of these keys either); a query sees key k iff
 * doc[q] <= pos(k) <= pos(q) (positions: section 9.1's geom). */
template <int D, int BMQ, int WARPS, bool DROP, int MODE = 0>
__global__ void __launch_bounds__(32 * WARPS)
    flash_bwd_dkdv_kernel(heads_view<bf16> dK, heads_view<bf16> dV, heads_view<const bf16> Q,
                          heads_view<const bf16> K, heads_view<const bf16> V, heads_view<const bf16> dO,
                          const float* __restrict__ LSE, const float* __restrict__ Dsum, int H, int Hkv, geom gm,
                          float scale, float* __restrict__ colsum, int64_t k_column, int64_t v_column,
                          mt_dropout drop, const int32_t* __restrict__ doc, bwd_acc acc) {
    constexpr int S = D + 8, NQ = BMQ / 8, DT = D / 8, NTH = 32 * WARPS, KEYS = 16 * WARPS;
    static_assert(BMQ % 16 == 0 && (D == 64 || D == 128), "tile shape");
    constexpr bool POS = MODE != 0, ACC = MODE == 2;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sK = reinterpret_cast<bf16*>(smem);
    bf16* sV = sK + KEYS * S;
    bf16* sQ = sV + KEYS * S;     /* [2][BMQ][S] */
    bf16* sdO = sQ + 2 * BMQ * S; /* [2][BMQ][S] */
    float* sL = reinterpret_cast<float*>(sdO + 2 * BMQ * S); /* [2][BMQ] */
    float* sD = sL + 2 * BMQ;                                /* [2][BMQ] */
    int32_t* sDoc = reinterpret_cast<int32_t*>(sD + 2 * BMQ); /* [2][BMQ] */

    const int Tq = gm.Tq, Tk = POS ? gm.Tk : gm.Tq;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int bkv = blockIdx.x, b = bkv / Hkv, hkv = bkv % Hkv;
    const int k0 = blockIdx.y * KEYS; /* low key tiles have the most work and launch first */
    const int qpg = H / Hkv;        /* query heads per kv head: heads hkv*qpg .. hkv*qpg+qpg-1 */
    const int wk_first = k0 + warp * 16;
    const int koff = pos_of<POS>(gm.ks, k0) - k0; /* key row -> sequence position in this tile */
    const int wkp_first = wk_first + koff, wkp_last = wkp_first + 15;
    const float c = scale * LOG2E;

    const int32_t* docb = doc ? doc + (int64_t)b * Tq : NULL;
    const int kp_last = pos_of<POS>(gm.ks, min(k0 + KEYS, Tk) - 1); /* the tile's last key's position */
    const int q_lo = rows_below<POS>(gm.qs, Tq, kp_last + 1);    /* the first query row past it */
    const int q_end = docb ? doc_query_end(docb, kp_last, q_lo, Tq) : Tq; /* queries past it see no key here */
    const int qt_first = rows_below<POS>(gm.qs, Tq, k0 + koff) / BMQ;
    const int per_head = (q_end + BMQ - 1) / BMQ - qt_first; /* query tiles visited per head */
    const int n_it = qpg * per_head;

    /* iteration it -> (query head, query tile); loads its Q, dO, LSE, Dsum tiles into stage st */
    auto load_q_tiles = [&](int it, int st) {
        const int h = hkv * qpg + it / per_head;
        const int q0 = (qt_first + it % per_head) * BMQ;
        const size_t bh = (size_t)b * H + h;
        load_tile<BMQ, D, NTH>(sQ + st * BMQ * S, Q.at(b, h, qpg), Q.row, q0, Tq);
        load_tile<BMQ, D, NTH>(sdO + st * BMQ * S, dO.at(b, h, qpg), dO.row, q0, Tq);
        load_vec<BMQ, NTH>(sL + st * BMQ, LSE + bh * Tq, q0, Tq);
        load_vec<BMQ, NTH>(sD + st * BMQ, Dsum + bh * Tq, q0, Tq);
        if (docb) /* 4-byte copies: the int32 starts travel as the floats do (0 past Tq) */
            load_vec<BMQ, NTH>(reinterpret_cast<float*>(sDoc + st * BMQ), reinterpret_cast<const float*>(docb), q0, Tq);
    };

    if (!POS || n_it > 0) { /* else no query sees these keys: their gradient (contribution) is 0 */
        load_tile<KEYS, D, NTH>(sK, K.at(b, hkv, 1), K.row, k0, Tk);
        load_tile<KEYS, D, NTH>(sV, V.at(b, hkv, 1), V.row, k0, Tk);
        load_q_tiles(0, 0);
        cp_async_commit();
    }

    float dk[1][DT][4], dv[1][DT][4]; /* this warp's 16 key rows: rows g and g+8, cols dt*8+2t+(0,1) */
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int j = 0; j < 4; j++) dk[0][dt][j] = dv[0][dt][j] = 0.0f;

    for (int it = 0; it < n_it; it++) {
        const int st = it & 1;
        const int q0 = (qt_first + it % per_head) * BMQ;
        const int qp0 = pos_of<POS>(gm.qs, q0); /* the tile's first query's position; its rows are consecutive */
        if (it + 1 < n_it) load_q_tiles(it + 1, st ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const bf16* sQs = sQ + st * BMQ * S;
        const bf16* sdOs = sdO + st * BMQ * S;
        const float* sLs = sL + st * BMQ;
        const float* sDs = sD + st * BMQ;
        const int32_t* sDocs = sDoc + st * BMQ;
        /* the tile's smallest and largest document start (its first row's and its last valid row's) */
        const int tdoc_first = docb ? docb[q0] : 0, tdoc_last = docb ? docb[min(q0 + BMQ, Tq) - 1] : 0;

        /* else all of this warp's keys come after every query here, or before all their documents */
        if (wkp_first <= qp0 + BMQ - 1 && wkp_last >= tdoc_first) {
            /* S^T = K Q^T: p[0][nq] holds keys (g, g+8) x queries q0+nq*8+2t+(0,1) */
            float p[1][NQ][4];
#pragma unroll
            for (int nq = 0; nq < NQ; nq++) p[0][nq][0] = p[0][nq][1] = p[0][nq][2] = p[0][nq][3] = 0.0f;
            gemm_abt<1, BMQ, D>(p, sK, warp * 16, sQs, lane);

            /* P^T = 2^(S^T*c - LSE*log2e), zero where key > query or before the query's document */
            const bool need_mask = wkp_last > qp0, need_doc = wkp_first < tdoc_last;
#pragma unroll
            for (int nq = 0; nq < NQ; nq++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int qi = nq * 8 + 2 * t + (j & 1);
                    const int key = wkp_first + g + (j >> 1) * 8;
                    float v = exp2_approx(fmaf(p[0][nq][j], c, -sLs[qi] * LOG2E));
                    p[0][nq][j] = ((need_mask && key > qp0 + qi) || (need_doc && key < sDocs[qi])) ? 0.0f : v;
                }

            /* attention dropout: the forward's mask of this tile, one bit per element (bit nq*4 + j);
             * dV += P_d^T dO, and the gradient reaching P is dropout(dP_d) */
            uint32_t keep = 0;
            if constexpr (DROP) {
                const int h = hkv * qpg + it / per_head;
#pragma unroll
                for (int nq = 0; nq < NQ; nq++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int query = qp0 + nq * 8 + 2 * t + (j & 1), key = wkp_first + g + (j >> 1) * 8;
                        const uint64_t bits =
                            dropout_bits(drop.key, dropout_attention_counter(drop, b, h, query, key, gm.seq));
                        keep |= (uint32_t)dropout_keeps(drop, bits, key) << (nq * 4 + j);
                    }
                gemm_pb<1, BMQ, D, true>(dv, p, sdOs, lane, keep, drop.scale);
            } else {
                /* dV += P^T dO */
                gemm_pb<1, BMQ, D>(dv, p, sdOs, lane);
            }

            /* dP^T = V dO^T */
            float dp[1][NQ][4];
#pragma unroll
            for (int nq = 0; nq < NQ; nq++) dp[0][nq][0] = dp[0][nq][1] = dp[0][nq][2] = dp[0][nq][3] = 0.0f;
            gemm_abt<1, BMQ, D>(dp, sV, warp * 16, sdOs, lane);

            /* dS^T = P^T * (dP^T - Dsum[query]), written over dp */
#pragma unroll
            for (int nq = 0; nq < NQ; nq++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float g_p = dp[0][nq][j];
                    if constexpr (DROP) g_p = (keep >> (nq * 4 + j)) & 1u ? g_p * drop.scale : 0.0f;
                    dp[0][nq][j] = p[0][nq][j] * (g_p - sDs[nq * 8 + 2 * t + (j & 1)]);
                }

            /* dK += dS^T Q (the scale is applied once, at the end) */
            gemm_pb<1, BMQ, D>(dk, dp, sQs, lane);
        }
        __syncthreads(); /* this stage is free to be refilled */
    }

    /* epilogue: rows past Tk are not stored */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = wk_first + g + r * 8;
        if (key < Tk) {
            if constexpr (ACC) {
                const size_t off = (((size_t)b * Hkv + hkv) * Tk + key) * D;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    const int e = dt * 8 + 2 * t;
                    float2 k2 = make_float2(dk[0][dt][2 * r] * scale, dk[0][dt][2 * r + 1] * scale);
                    float2 v2 = make_float2(dv[0][dt][2 * r], dv[0][dt][2 * r + 1]);
                    if (acc.dk_in) {
                        const float2 a = *reinterpret_cast<const float2*>(acc.dk_in + off + e);
                        const float2 w = *reinterpret_cast<const float2*>(acc.dv_in + off + e);
                        k2 = make_float2(a.x + k2.x, a.y + k2.y);
                        v2 = make_float2(w.x + v2.x, w.y + v2.y);
                    }
                    *reinterpret_cast<float2*>(acc.dk_out + off + e) = k2;
                    *reinterpret_cast<float2*>(acc.dv_out + off + e) = v2;
                }
            } else {
                bf16* dk_row = dK.at(b, hkv, 1) + (int64_t)key * dK.row;
                bf16* dv_row = dV.at(b, hkv, 1) + (int64_t)key * dV.row;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    *reinterpret_cast<uint32_t*>(dk_row + dt * 8 + 2 * t) =
                        pack_bf16(dk[0][dt][2 * r] * scale, dk[0][dt][2 * r + 1] * scale);
                    *reinterpret_cast<uint32_t*>(dv_row + dt * 8 + 2 * t) =
                        pack_bf16(dv[0][dt][2 * r], dv[0][dt][2 * r + 1]);
                }
            }
        }
    }
    /* with colsum: this tile's column sums of dK and dV, chunk (b, key tile); k_column and v_column
     * are where dK's and dV's heads start in the rows (the loop's last barrier freed shared memory) */
    if (!ACC && colsum) {
        float* red = reinterpret_cast<float*>(smem);
        const int64_t chunk = (int64_t)b * gridDim.y + blockIdx.y;
        tile_column_sums<D, WARPS, 1>(colsum, dK.row, chunk, k_column + dK.column(hkv, 1), dk, scale, k0 + warp * 16,
                                      Tk, red);
        __syncthreads();
        tile_column_sums<D, WARPS, 1>(colsum, dV.row, chunk, v_column + dV.column(hkv, 1), dv, 1.0f, k0 + warp * 16,
                                      Tk, red);
    }
}

/* Shared memory of dQ: sQ, sdO [BM][D+8]; sK, sV [2][BN][D+8]. */
template <int D, int BM>
constexpr size_t dq_smem_bytes() {
    return (size_t)(2 * BM + 4 * BN) * (D + 8) * sizeof(bf16);
}

/* One CTA per (b, h, tile of BM query rows), warps own 16*MT rows, loop over key tiles as in the
 * forward:  S = Q K^T,  P = exp(scale*S - LSE),  dP = dO V^T,  dS = P * (dP - Dsum),  dQ += dS K;
 * finally dQ *= scale. */
template <int D, int BM, int WARPS, bool DROP, int MODE = 0>
__global__ void __launch_bounds__(32 * WARPS)
    flash_bwd_dq_kernel(heads_view<bf16> dQ, heads_view<const bf16> Q, heads_view<const bf16> K,
                        heads_view<const bf16> V, heads_view<const bf16> dO, const float* __restrict__ LSE,
                        const float* __restrict__ Dsum, int H, int Hkv, geom gm, float scale,
                        float* __restrict__ colsum, mt_dropout drop, const int32_t* __restrict__ doc, bwd_acc acc) {
    constexpr int NTH = 32 * WARPS, MT = BM / (16 * WARPS);
    constexpr int S = D + 8, NT = BN / 8, DT = D / 8;
    static_assert(BM % (16 * WARPS) == 0 && (D == 64 || D == 128), "tile shape");
    constexpr bool POS = MODE != 0, ACC = MODE == 2;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* sQ = reinterpret_cast<bf16*>(smem);
    bf16* sdO = sQ + BM * S;
    bf16* sK = sdO + BM * S; /* [2][BN][S] */
    bf16* sV = sK + 2 * BN * S;

    const int Tq = gm.Tq, Tk = POS ? gm.Tk : gm.Tq;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int qpg = H / Hkv, hkv = h / qpg;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const int wrow = warp * 16 * MT;
    const int wq_first = q0 + wrow, wq_last = wq_first + 16 * MT - 1;
    const int qoff = pos_of<POS>(gm.qs, q0) - q0; /* row -> sequence position in this tile */
    const int wp_first = wq_first + qoff, wp_last = wq_last + qoff;
    const bf16* Kh = K.at(b, hkv, 1);
    const bf16* Vh = V.at(b, hkv, 1);
    const float c = scale * LOG2E;
    const int n_kt = (rows_below<POS>(gm.ks, Tk, pos_of<POS>(gm.qs, min(q0 + BM, Tq) - 1) + 1) + BN - 1) / BN;
    const doc_rows<MT> dr(doc, b, Tq, q0, wq_first, wq_last, g);
    const int kt0 = rows_below<POS>(gm.ks, Tk, dr.tile_first) / BN; /* key tiles before every row's document: skipped */
    /* an accumulating step whose block no row of this tile sees leaves the running dQ as it is */
    if (ACC && !acc.first && !acc.last && kt0 >= n_kt) return;

    if (!POS || kt0 < n_kt) { /* else no key here is visible to these rows: their dQ (contribution) is 0 */
        load_tile<BM, D, NTH>(sQ, Q.at(b, h, qpg), Q.row, q0, Tq);
        load_tile<BM, D, NTH>(sdO, dO.at(b, h, qpg), dO.row, q0, Tq);
        load_tile<BN, D, NTH>(sK + (kt0 & 1) * BN * (D + 8), Kh, K.row, kt0 * BN, Tk);
        load_tile<BN, D, NTH>(sV + (kt0 & 1) * BN * (D + 8), Vh, V.row, kt0 * BN, Tk);
        cp_async_commit();
    }

    /* per-row constants of this thread's rows (g, g+8 of each m16 block); padded rows get 0 */
    float lse2[MT][2], dsum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = wq_first + mt * 16 + g + r * 8;
            lse2[mt][r] = row < Tq ? LSE[(size_t)bh * Tq + row] * LOG2E : 0.0f;
            dsum[mt][r] = row < Tq ? Dsum[(size_t)bh * Tq + row] : 0.0f;
        }

    float dq[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int dt = 0; dt < DT; dt++) dq[mt][dt][0] = dq[mt][dt][1] = dq[mt][dt][2] = dq[mt][dt][3] = 0.0f;

    for (int kt = kt0; kt < n_kt; kt++) {
        const int k0 = kt * BN;
        const int kp0 = pos_of<POS>(gm.ks, k0); /* the tile's first key's position; its keys are consecutive */
        const bf16 *sKs, *sVs;
        kv_stage_step<D, NTH>(sK, sV, Kh, Vh, K.row, V.row, kt, n_kt, Tk, &sKs, &sVs);

        if (kp0 <= wp_last && kp0 + BN - 1 >= dr.warp_first) {
            /* S = Q K^T */
            float p[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) p[mt][nt][0] = p[mt][nt][1] = p[mt][nt][2] = p[mt][nt][3] = 0.0f;
            gemm_abt<MT, BN, D>(p, sQ, wrow, sKs, lane);

            /* P = 2^(S*c - LSE*log2e), zero where key > query or before the query's document */
            const bool need_mask = kp0 + BN - 1 > wp_first || kp0 < dr.warp_last;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int row = wp_first + mt * 16 + g + (j >> 1) * 8;
                        const int key = kp0 + nt * 8 + 2 * t + (j & 1);
                        float v = exp2_approx(fmaf(p[mt][nt][j], c, -lse2[mt][j >> 1]));
                        p[mt][nt][j] = (need_mask && (key > row || key < dr.row[mt][j >> 1])) ? 0.0f : v;
                    }

            /* dP = dO V^T */
            float ds[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) ds[mt][nt][0] = ds[mt][nt][1] = ds[mt][nt][2] = ds[mt][nt][3] = 0.0f;
            gemm_abt<MT, BN, D>(ds, sdO, wrow, sVs, lane);

            /* attention dropout: the gradient reaching P is dropout(dP_d), the forward's mask */
            if constexpr (DROP) dropout_rows_tile<MT, NT>(ds, drop, b, h, wp_first, kp0, gm.seq, g, t);

            /* dS = P * (dP - Dsum[row]) */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int j = 0; j < 4; j++) ds[mt][nt][j] = p[mt][nt][j] * (ds[mt][nt][j] - dsum[mt][j >> 1]);

            /* dQ += dS K  (K stored [key][d] is the [k][n] operand here) */
            gemm_pb<MT, BN, D>(dq, ds, sKs, lane);
        }
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = wq_first + mt * 16 + g + r * 8;
            if (row < Tq) {
                bf16* drow = dQ.at(b, h, qpg) + (int64_t)row * dQ.row;
                if constexpr (ACC) {
                    float* arow = acc.dq + ((size_t)bh * Tq + row) * D;
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        float2 v = make_float2(dq[mt][dt][2 * r] * scale, dq[mt][dt][2 * r + 1] * scale);
                        if (!acc.first) {
                            const float2 a = *reinterpret_cast<const float2*>(arow + dt * 8 + 2 * t);
                            v = make_float2(a.x + v.x, a.y + v.y);
                        }
                        if (acc.last) *reinterpret_cast<uint32_t*>(drow + dt * 8 + 2 * t) = pack_bf16(v.x, v.y);
                        else *reinterpret_cast<float2*>(arow + dt * 8 + 2 * t) = v;
                    }
                } else {
#pragma unroll
                    for (int dt = 0; dt < DT; dt++)
                        *reinterpret_cast<uint32_t*>(drow + dt * 8 + 2 * t) =
                            pack_bf16(dq[mt][dt][2 * r] * scale, dq[mt][dt][2 * r + 1] * scale);
                }
            }
        }
    /* with colsum: this tile's column sums of dQ, chunk (b, query tile) (dQ's rows start at dQ.p) */
    if (!ACC && colsum)
        tile_column_sums<D, WARPS, MT>(colsum, dQ.row, (int64_t)b * gridDim.y + q0 / BM, dQ.column(h, qpg), dq, scale,
                                       wq_first, Tq, reinterpret_cast<float*>(smem));
}

/* ============================================================================================== */
/* 9.4 Host launchers                                                                             */
/*    defines: fa::forward_tiles / backward_tiles (the lab's), fa::geom_ok, attn_view,            */
/*    flash_attention_forward, flash_attention_backward, flash_colsum_chunks,                     */
/*    flash_attention_forward_span, flash_attention_backward_span.                                */
/* ============================================================================================== */

/* Tile choices (rows of queries per CTA, warps per CTA). The forward keeps Q fragments in registers,
 * so 32 rows per warp fit for d = 64 but not for d = 128. dQ and dK/dV use 16 rows per warp.
 * Measured on an H200 against the alternatives: a 64-row forward for d = 64 was 7-13% slower;
 * query tiles of 32 or 128 in dK/dV were within 2% either way; a 128-row dQ for d = 64 spills. */
template <int D>
struct Tiles {
    static constexpr int FWD_BM = D == 64 ? 128 : 64, FWD_WARPS = 4;
    static constexpr int DQ_BM = 64, DQ_WARPS = 4;
    static constexpr int DKDV_BMQ = 64, DKDV_WARPS = 4;
};

/* Each kernel instantiation gets its shared-memory limit once (one GPU per process, as in megatron.cu). */
template <typename K>
static cudaError_t set_smem_limit(K kernel, size_t bytes, bool* done) {
    if (*done) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    *done = e == cudaSuccess;
    return e;
}

static bool view_ok(const void* p, int64_t batch, int64_t row, int64_t group, int64_t head) {
    return (uintptr_t)p % 16 == 0 && batch % 8 == 0 && row % 8 == 0 && group % 8 == 0 && head % 8 == 0;
}
template <typename E>
static bool view_ok(const heads_view<E>& v) { return view_ok(v.p, v.batch, v.row, v.group, v.head); }

static bool shape_ok(int B, int H, int Hkv, int T, int d) {
    return B >= 1 && H >= 1 && Hkv >= 1 && H % Hkv == 0 && T >= 1 && (d == 64 || d == 128) &&
           (T + 63) / 64 <= 65535;
}

/* Launchers for any tile choice (the lab compares them); forward_d / backward_d use Tiles<D>. gm: the
 * rows' geometry (section 9.1; NULL: plain causal attention over T rows), checked by the caller. */
template <int D, int BM, int WARPS, bool DROP = false, int MODE = 0>
static cudaError_t forward_tiles(heads_view<bf16> O, float* LSE, heads_view<const bf16> Q, heads_view<const bf16> K,
                                 heads_view<const bf16> V, int B, int H, int Hkv, int T, cudaStream_t st,
                                 const mt_dropout& drop = mt_dropout(), const int32_t* doc = NULL,
                                 const geom* gm = NULL, fwd_merge mo = fwd_merge()) {
    static bool ready = false;
    cudaError_t e = set_smem_limit(flash_fwd_kernel<D, BM, WARPS, DROP, MODE>, fwd_smem_bytes<D, BM>(), &ready);
    if (e != cudaSuccess) return e;
    const geom g = gm ? *gm : plain_geom(T);
    dim3 grid(B * H, (g.Tq + BM - 1) / BM);
    flash_fwd_kernel<D, BM, WARPS, DROP, MODE><<<grid, 32 * WARPS, fwd_smem_bytes<D, BM>(), st>>>(
        O, LSE, Q, K, V, H, Hkv, g, 1.0f / sqrtf((float)D), drop, doc, mo);
    return cudaGetLastError();
}

/* Dsum = rowsum(dO * O) over the Tq query rows [B, H, Tq]. */
template <int D>
static cudaError_t backward_dot(float* Dsum, heads_view<const bf16> dO, heads_view<const bf16> O, int B, int H, int Hkv,
                                int Tq, cudaStream_t st) {
    const size_t rows = (size_t)B * H * Tq;
    flash_bwd_dot_kernel<D><<<(unsigned)((rows * (D / 8) + 255) / 256), 256, 0, st>>>(Dsum, dO, O, H, H / Hkv, Tq,
                                                                                      rows);
    return cudaGetLastError();
}

/* The dK/dV kernel (which & 1) and the dQ kernel (which & 2), in that order, from a computed Dsum. */
template <int D, int BMQ, int KV_WARPS, int BM, int Q_WARPS, bool DROP = false, int MODE = 0>
static cudaError_t backward_kernels(int which, heads_view<bf16> dQ, heads_view<bf16> dK, heads_view<bf16> dV,
                                    const float* Dsum, heads_view<const bf16> dO, heads_view<const bf16> Q,
                                    heads_view<const bf16> K, heads_view<const bf16> V, const float* LSE, int B, int H,
                                    int Hkv, const geom& g, cudaStream_t st, float* colsum, const mt_dropout& drop,
                                    const int32_t* doc, bwd_acc acc = bwd_acc()) {
    constexpr int KEYS = 16 * KV_WARPS;
    /* one chunk of column sums per (b, 64-row tile) in both kernels */
    if (colsum && (KEYS != COLSUM_TILE || BM != COLSUM_TILE || MODE == 2)) return cudaErrorInvalidValue;
    static bool ready_kv = false, ready_q = false;
    const float scale = 1.0f / sqrtf((float)D);
    cudaError_t e =
        set_smem_limit(flash_bwd_dkdv_kernel<D, BMQ, KV_WARPS, DROP, MODE>, dkdv_smem_bytes<D, BMQ, KEYS>(), &ready_kv);
    if (e == cudaSuccess)
        e = set_smem_limit(flash_bwd_dq_kernel<D, BM, Q_WARPS, DROP, MODE>, dq_smem_bytes<D, BM>(), &ready_q);
    if (e != cudaSuccess) return e;
    if (which & 1) {
        dim3 grid_kv(B * Hkv, (g.Tk + KEYS - 1) / KEYS);
        flash_bwd_dkdv_kernel<D, BMQ, KV_WARPS, DROP, MODE><<<grid_kv, 32 * KV_WARPS, dkdv_smem_bytes<D, BMQ, KEYS>(), st>>>(
            dK, dV, Q, K, V, dO, LSE, Dsum, H, Hkv, g, scale, colsum, dK.p - dQ.p, dV.p - dQ.p, drop, doc, acc);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (which & 2) {
        dim3 grid_q(B * H, (g.Tq + BM - 1) / BM);
        flash_bwd_dq_kernel<D, BM, Q_WARPS, DROP, MODE><<<grid_q, 32 * Q_WARPS, dq_smem_bytes<D, BM>(), st>>>(
            dQ, Q, K, V, dO, LSE, Dsum, H, Hkv, g, scale, colsum, drop, doc, acc);
        e = cudaGetLastError();
    }
    return e;
}

template <int D, int BMQ, int KV_WARPS, int BM, int Q_WARPS, bool DROP = false>
static cudaError_t backward_tiles(heads_view<bf16> dQ, heads_view<bf16> dK, heads_view<bf16> dV, float* Dsum,
                                  heads_view<const bf16> dO, heads_view<const bf16> Q, heads_view<const bf16> K,
                                  heads_view<const bf16> V, heads_view<const bf16> O, const float* LSE, int B, int H,
                                  int Hkv, int T, cudaStream_t st, float* colsum = NULL,
                                  const mt_dropout& drop = mt_dropout(), const int32_t* doc = NULL,
                                  const geom* gm = NULL) {
    const geom g = gm ? *gm : plain_geom(T);
    cudaError_t e = backward_dot<D>(Dsum, dO, O, B, H, Hkv, g.Tq, st);
    if (e != cudaSuccess) return e;
    if (gm) /* slices (MODE 1) */
        return backward_kernels<D, BMQ, KV_WARPS, BM, Q_WARPS, DROP, 1>(3, dQ, dK, dV, Dsum, dO, Q, K, V, LSE, B, H, Hkv,
                                                                         g, st, colsum, drop, doc);
    return backward_kernels<D, BMQ, KV_WARPS, BM, Q_WARPS, DROP>(3, dQ, dK, dV, Dsum, dO, Q, K, V, LSE, B, H, Hkv, g,
                                                                  st, colsum, drop, doc);
}

template <int D, int MODE = 0>
static cudaError_t forward_d(heads_view<bf16> O, float* LSE, heads_view<const bf16> Q, heads_view<const bf16> K,
                             heads_view<const bf16> V, int B, int H, int Hkv, int T, cudaStream_t st,
                             const mt_dropout& drop, const int32_t* doc, const geom* gm = NULL,
                             fwd_merge mo = fwd_merge()) {
    if (drop.on)
        return forward_tiles<D, Tiles<D>::FWD_BM, Tiles<D>::FWD_WARPS, true, MODE>(O, LSE, Q, K, V, B, H, Hkv, T, st,
                                                                                   drop, doc, gm, mo);
    return forward_tiles<D, Tiles<D>::FWD_BM, Tiles<D>::FWD_WARPS, false, MODE>(O, LSE, Q, K, V, B, H, Hkv, T, st, drop,
                                                                                doc, gm, mo);
}

template <int D>
static cudaError_t backward_d(heads_view<bf16> dQ, heads_view<bf16> dK, heads_view<bf16> dV, float* Dsum,
                              heads_view<const bf16> dO, heads_view<const bf16> Q, heads_view<const bf16> K,
                              heads_view<const bf16> V, heads_view<const bf16> O, const float* LSE, int B, int H,
                              int Hkv, int T, cudaStream_t st, float* colsum, const mt_dropout& drop,
                              const int32_t* doc, const geom* gm = NULL) {
    if (drop.on)
        return backward_tiles<D, Tiles<D>::DKDV_BMQ, Tiles<D>::DKDV_WARPS, Tiles<D>::DQ_BM, Tiles<D>::DQ_WARPS, true>(
            dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, st, colsum, drop, doc, gm);
    return backward_tiles<D, Tiles<D>::DKDV_BMQ, Tiles<D>::DKDV_WARPS, Tiles<D>::DQ_BM, Tiles<D>::DQ_WARPS>(
        dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, st, colsum, drop, doc, gm);
}

/* The ring's per-block backward (section 9.5): Dsum computed once, partial results in bwd_acc. */
template <int D>
static cudaError_t backward_block_d(int which, heads_view<bf16> dQ, heads_view<const bf16> dO, heads_view<const bf16> Q,
                                    heads_view<const bf16> K, heads_view<const bf16> V, const float* LSE,
                                    const float* Dsum, int B, int H, int Hkv, const geom& g, cudaStream_t st,
                                    const mt_dropout& drop, const int32_t* doc, bwd_acc acc) {
    const heads_view<bf16> none = {NULL, 0, 0, 0, 0}; /* dK, dV go to acc's fp32 buffers */
    if (drop.on)
        return backward_kernels<D, Tiles<D>::DKDV_BMQ, Tiles<D>::DKDV_WARPS, Tiles<D>::DQ_BM, Tiles<D>::DQ_WARPS, true,
                                2>(which, dQ, none, none, Dsum, dO, Q, K, V, LSE, B, H, Hkv, g, st, NULL, drop, doc,
                                      acc);
    return backward_kernels<D, Tiles<D>::DKDV_BMQ, Tiles<D>::DKDV_WARPS, Tiles<D>::DQ_BM, Tiles<D>::DQ_WARPS, false,
                            2>(which, dQ, none, none, Dsum, dO, Q, K, V, LSE, B, H, Hkv, g, st, NULL, drop, doc, acc);
}

/* Rows of whole tiles: a span's chunks and its slices hold multiples of this many rows (the largest
 * query tile of head dim d; key tiles are 64). */
static int span_tile_rows(int d) { return d == 64 ? Tiles<64>::FWD_BM : Tiles<128>::FWD_BM; }

/* A geometry the kernels take: the plain one, or slices of whole tiles whose positions grow with the
 * row and lie inside the sequence (int64 sums: no overflow on hostile values). */
static bool geom_ok(const geom& g, int d) {
    if (g.Tq == g.Tk && g.qs.len == 0 && g.ks.len == 0 && g.seq == g.Tq) return true; /* shape_ok checks T */
    const int64_t tile = span_tile_rows(d);
    auto slice_ok = [&](const mt_seq_span& s, int T) {
        if (T < tile || T % tile != 0 || (T + 63) / 64 > 65535) return false;
        if (s.len == 0) return T <= g.seq;
        return (int64_t)T == 2 * (int64_t)s.len && s.start[0] >= 0 && s.start[0] % tile == 0 &&
               s.start[1] % tile == 0 && (int64_t)s.start[0] + s.len <= s.start[1] &&
               (int64_t)s.start[1] + s.len <= g.seq;
    };
    return g.seq >= 1 && slice_ok(g.qs, g.Tq) && slice_ok(g.ks, g.Tk);
}

} // namespace fa

typedef fa::heads_view<bf16> attn_view;
typedef fa::heads_view<const bf16> attn_cview;

/* Views of the common layouts (see fa::heads_view). Packed [B, H, T, d] (H kv heads for K/V, with
 * qpg = 1): */
[[maybe_unused]] static attn_view packed_heads_view(bf16* p, int H, int T, int d, int qpg) {
    return {p, (int64_t)H * T * d, d, (int64_t)qpg * T * d, (int64_t)T * d};
}
/* The model's rows [B*T, width]: the attention output / its gradient (width H*d, head h at column
 * h*d), or slot `slot` of the fused QKV rows (width groups*(qpg+2)*d; slot 0 the query heads, qpg
 * the key, qpg+1 the value of each group). */
static attn_view attention_rows_view(bf16* p, int T, int H, int d, int qpg) {
    return {p, (int64_t)T * H * d, (int64_t)H * d, (int64_t)qpg * d, d};
}
static attn_view qkv_rows_view(bf16* qkv, int T, int groups, int d, int qpg, int slot) {
    int64_t width = (int64_t)groups * (qpg + 2) * d;
    return {qkv + (int64_t)slot * d, T * width, width, (int64_t)(qpg + 2) * d, d};
}
static attn_cview cview(attn_view v) { return {v.p, v.batch, v.row, v.group, v.head}; }

/* Causal attention forward: O and LSE [B, H, T] (fp32, packed) from Q (H heads), K, V (Hkv heads),
 * each a view (any of the layouts above). With a dropout site, O = dropout(P) V (LSE is P's). With
 * doc [B, T] (NULL: none; --reset-attention-mask, mt_document_boundaries) query q sees only keys
 * doc[q] <= k <= q, and key tiles wholly before a query tile's documents are not visited. */
static cudaError_t flash_attention_forward(attn_view O, float* LSE, attn_cview Q, attn_cview K, attn_cview V, int B,
                                           int H, int Hkv, int T, int d, cudaStream_t st,
                                           const mt_dropout& drop = mt_dropout(), const int32_t* doc = NULL) {
    if (!fa::shape_ok(B, H, Hkv, T, d) || !fa::view_ok(O) || !fa::view_ok(Q) || !fa::view_ok(K) || !fa::view_ok(V))
        return cudaErrorInvalidValue;
    return d == 64 ? fa::forward_d<64>(O, LSE, Q, K, V, B, H, Hkv, T, st, drop, doc)
                   : fa::forward_d<128>(O, LSE, Q, K, V, B, H, Hkv, T, st, drop, doc);
}

/* Causal attention backward: dQ (H heads), dK, dV (Hkv heads) from dO and the forward's Q, K, V, O,
 * LSE. Dsum [B, H, T] fp32 is scratch. Deterministic: no atomics, fixed summation order. With colsum
 * (may be NULL): the column sums of the gradient as stored, per chunk: colsum[chunk, column] for
 * chunk = b * ceil(T / 64) + (64-row tile), column = the element's column in the gradient's rows:
 * dQ, dK, dV are views of one set of rows (the QKV rows) that starts at dQ.p; every column of their
 * heads is written for every chunk, and the sum over chunks is the QKV bias gradient. doc: the forward's
 * document starts (NULL: none); query tiles after a key tile's documents are not visited. */
static int flash_colsum_chunks(int B, int T) { return B * ((T + fa::COLSUM_TILE - 1) / fa::COLSUM_TILE); }
static cudaError_t flash_attention_backward(attn_view dQ, attn_view dK, attn_view dV, float* Dsum, attn_cview dO,
                                            attn_cview Q, attn_cview K, attn_cview V, attn_cview O, const float* LSE,
                                            int B, int H, int Hkv, int T, int d, cudaStream_t st,
                                            float* colsum = NULL, const mt_dropout& drop = mt_dropout(),
                                            const int32_t* doc = NULL) {
    attn_cview views[] = {cview(dQ), cview(dK), cview(dV), dO, Q, K, V, O};
    bool ok = fa::shape_ok(B, H, Hkv, T, d);
    for (const attn_cview& v : views) ok = ok && fa::view_ok(v);
    if (colsum) /* one set of rows, starting at dQ.p */
        ok = ok && dK.row == dQ.row && dV.row == dQ.row && dK.batch == dQ.batch && dV.batch == dQ.batch &&
             dK.p - dQ.p >= 0 && dK.p - dQ.p < dQ.row && dV.p - dQ.p >= 0 && dV.p - dQ.p < dQ.row;
    if (!ok) return cudaErrorInvalidValue;
    return d == 64 ? fa::backward_d<64>(dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, st, colsum, drop, doc)
                   : fa::backward_d<128>(dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, st, colsum, drop, doc);
}

/* Attention of Tq query rows against Tk key rows that are slices of one sequence (context parallelism):
 * q_span / kv_span say where the rows sit (section 7's mt_seq_span; len 0: positions 0, 1, ...), seq is
 * the whole sequence's length (attention dropout's masks are those of the seq x seq matrix, so a slice
 * draws exactly the whole sequence's bits); key k is visible to query q iff pos(k) <= pos(q) (and with
 * doc [B, Tq], given per query row as a sequence position, doc[q] <= pos(k)); key tiles wholly masked
 * are skipped. Slices must hold whole tiles (Tq, Tk and the spans' len and starts multiples of
 * fa::span_tile_rows(d): 128 rows for d = 64, 64 for d = 128), else cudaErrorInvalidValue. E.g.
 * --cp-comm-type all_gather: the local two chunks (Tq = S/CP) against the whole gathered sequence (Tk
 * = S, kv_span len 0); dK, dV are then this rank's partial gradients of all S keys (bf16), which the
 * caller reduce-scatters. A query row that sees no key gets O = 0, LSE = -inf. LSE, Dsum [B, H, Tq]. */
[[maybe_unused]]
static cudaError_t flash_attention_forward_span(attn_view O, float* LSE, attn_cview Q, attn_cview K, attn_cview V,
                                                int B, int H, int Hkv, int Tq, int Tk, mt_seq_span q_span,
                                                mt_seq_span kv_span, int seq, int d, cudaStream_t st,
                                                const mt_dropout& drop = mt_dropout(), const int32_t* doc = NULL) {
    const fa::geom g = {Tq, Tk, q_span, kv_span, seq};
    if (!fa::shape_ok(B, H, Hkv, Tq, d) || !fa::shape_ok(B, H, Hkv, Tk, d) || !fa::geom_ok(g, d) || !fa::view_ok(O) ||
        !fa::view_ok(Q) || !fa::view_ok(K) || !fa::view_ok(V))
        return cudaErrorInvalidValue;
    return d == 64 ? fa::forward_d<64, 1>(O, LSE, Q, K, V, B, H, Hkv, Tq, st, drop, doc, &g)
                   : fa::forward_d<128, 1>(O, LSE, Q, K, V, B, H, Hkv, Tq, st, drop, doc, &g);
}
[[maybe_unused]]
static cudaError_t flash_attention_backward_span(attn_view dQ, attn_view dK, attn_view dV, float* Dsum, attn_cview dO,
                                                 attn_cview Q, attn_cview K, attn_cview V, attn_cview O,
                                                 const float* LSE, int B, int H, int Hkv, int Tq, int Tk,
                                                 mt_seq_span q_span, mt_seq_span kv_span, int seq, int d,
                                                 cudaStream_t st, const mt_dropout& drop = mt_dropout(),
                                                 const int32_t* doc = NULL) {
    const fa::geom g = {Tq, Tk, q_span, kv_span, seq};
    attn_cview views[] = {cview(dQ), cview(dK), cview(dV), dO, Q, K, V, O};
    bool ok = fa::shape_ok(B, H, Hkv, Tq, d) && fa::shape_ok(B, H, Hkv, Tk, d) && fa::geom_ok(g, d);
    for (const attn_cview& v : views) ok = ok && fa::view_ok(v);
    if (!ok) return cudaErrorInvalidValue;
    return d == 64 ? fa::backward_d<64>(dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, Tq, st, NULL, drop, doc, &g)
                   : fa::backward_d<128>(dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, Tq, st, NULL, drop, doc, &g);
}

/* ============================================================================================== */
/* 9.5 Context-parallel ring attention                                                            */
/*    --cp-comm-type p2p, as Transformer Engine's context-parallel attention does it: the S       */
/*    tokens are cut into 2*CP chunks of C = S/(2CP) rows and CP rank r holds chunks r and        */
/*    2CP-1-r (its T = 2C local rows, cp_chunk_span), so every rank has the same causal work.     */
/*    K/V blocks travel around the ring (rank r sends to r+1 and receives from r-1; ring step i   */
/*    works on rank (r-i)'s block) on a second stream while the flash kernels work on the block   */
/*    in hand (two buffers, events between the streams). Against its own block a rank's work is   */
/*    causal; against an earlier rank's block (j < r) all its queries see the block's first       */
/*    chunk only; against a later one (j > r) only its second chunk sees anything: the kernels'   */
/*    tile skipping makes those steps cost half (section 9.1's positions).                        */
/*    Forward: each step's O_blk, LSE_blk merged by log-sum-exp into the running (O, LSE), O in   */
/*    an fp32 accumulator, rounded to bf16 once by the last step (the forward kernel's MERGE      */
/*    epilogue). Backward with the final O and LSE (Dsum = rowsum(dO*O) once): dQ accumulates     */
/*    over the steps in fp32 (rounded once by the last step); the dK/dV of the block in hand are  */
/*    added, in fp32, to the partial sums that arrived with it and the sums travel on with it:   */
/*    after CP steps they have seen every rank's queries and one more hop takes them home, where  */
/*    they are rounded to bf16. fp32 for the travelling sums: bf16 would round CP-1 times more   */
/*    than one GPU's kernel does (its sums stay in fp32 registers), and the transfer is as fast   */
/*    next to the step's work. Fixed ring order everywhere: deterministic.                        */
/*    Dropout masks are drawn by global (sample, head, query, key) positions (section 9.1), the   */
/*    masks of CP = 1. The QKV bias column sums (flash_attention_backward's colsum) are not       */
/*    taken here: the caller sums the columns. On Hopper, without dropout or documents, each      */
/*    step runs on sections 13.2 / 13.3's kernels instead (section 13.4; the drivers below choose */
/*    per call, the transfers and their order unchanged).                                         */
/*    defines: mt_cp_ring, cp_ring_create, cp_ring_destroy, cp_chunk_span, */
/*    cp_attention_forward_block, cp_attention_dsum, cp_attention_backward_block,                 */
/*    cp_pack_kv, cp_store_kv_grads, cp_ring_attention_forward, cp_ring_attention_backward.       */
/* ============================================================================================== */

/* The CP group's ring: its communicator, this rank in it, the transfers' stream and the events that
 * order the two streams (made by cp_ring_create). */
typedef struct {
    ncclComm_t comm;
    int rank, size;     /* CP rank and CP */
    int global_rank;    /* named in NCCL errors */
    cudaStream_t stream; /* the transfers */
    cudaEvent_t ready[2], freed[2]; /* K/V buffer i: its block arrived / the kernels are done with it */
    cudaEvent_t grad_done, grad_ready; /* the travelling dK/dV sums: written / arrived */
} mt_cp_ring;

static void cp_ring_destroy(mt_cp_ring* r) {
    cudaEvent_t* evs[] = {&r->ready[0], &r->ready[1], &r->freed[0], &r->freed[1], &r->grad_done, &r->grad_ready};
    for (cudaEvent_t* e : evs)
        if (*e) cudaEventDestroy(*e), *e = NULL;
    if (r->stream) cudaStreamDestroy(r->stream), r->stream = NULL;
}
/* comm: the CP group's communicator (not owned); rank, size: this rank's place in it. */
[[maybe_unused]]
static bool cp_ring_create(mt_cp_ring* r, ncclComm_t comm, int rank, int size, int global_rank, mt_gpu_error* e) {
    memset(r, 0, sizeof(*r));
    if (size < 1 || rank < 0 || rank >= size)
        return mt_gpu_fail(e, MT_ERR_ARG, "context-parallel ring: rank %d of %d", rank, size);
    r->comm = comm, r->rank = rank, r->size = size, r->global_rank = global_rank;
    bool ok = CUDA_CHECK(e, cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
    cudaEvent_t* evs[] = {&r->ready[0], &r->ready[1], &r->freed[0], &r->freed[1], &r->grad_done, &r->grad_ready};
    for (cudaEvent_t* ev : evs) ok = ok && CUDA_CHECK(e, cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    if (!ok) cp_ring_destroy(r);
    return ok;
}

/* The rows CP rank `rank` of `cp` holds: chunks rank and 2cp-1-rank of C rows. */
static mt_seq_span cp_chunk_span(int rank, int cp, int C) {
    mt_seq_span s;
    s.len = C;
    s.start[0] = rank * C;
    s.start[1] = (2 * cp - 1 - rank) * C;
    return s;
}
/* The geometry of rank q_rank's T local query rows against rank kv_rank's T key rows. */
static fa::geom cp_block_geom(int q_rank, int kv_rank, int cp, int T) {
    return {T, T, cp_chunk_span(q_rank, cp, T / 2), cp_chunk_span(kv_rank, cp, T / 2), cp * T};
}

/* The ring's scratch, 256-byte aligned pieces: two K/V blocks (bf16 [2][B][Hkv][T][d]: K then V,
 * packed), the fp32 accumulator [B][H][T][d] (the forward's O, the backward's dQ), two travelling
 * dK/dV sums (fp32 [2][B][Hkv][T][d]); then the step outputs of section 13.4's Hopper steps: O or dQ
 * (bf16 [B][H][T][d]), the step's LSE (fp32 [B][H][T]) and dK/dV (bf16 [2][B][Hkv][T][d]). T: local rows. */
typedef struct {
    bf16* kv[2];
    float* acc;
    float* dkv[2];
    bf16* step_o;    /* a Hopper step's O (forward) or dQ (backward) */
    float* step_lse; /* a Hopper step's LSE */
    bf16* step_dkv;  /* a Hopper step's dK then dV */
} cp_ring_scratch;
static size_t cp_align(size_t n) { return (n + 255) & ~(size_t)255; }
static cp_ring_scratch cp_scratch_layout(void* scratch, int B, int H, int Hkv, int T, int d) {
    const size_t kv = 2 * (size_t)B * Hkv * T * d;
    char* p = (char*)scratch;
    cp_ring_scratch s;
    for (int i = 0; i < 2; i++) s.kv[i] = (bf16*)p, p += cp_align(kv * sizeof(bf16));
    s.acc = (float*)p, p += cp_align((size_t)B * H * T * d * sizeof(float));
    for (int i = 0; i < 2; i++) s.dkv[i] = (float*)p, p += cp_align(kv * sizeof(float));
    s.step_o = (bf16*)p, p += cp_align((size_t)B * H * T * d * sizeof(bf16));
    s.step_lse = (float*)p, p += cp_align((size_t)B * H * T * sizeof(float));
    s.step_dkv = (bf16*)p;
    return s;
}

/* Section 13.4's ring steps on the Hopper kernels (declared here, defined after sections 13.2 and 13.3):
 * whether a call takes them, a step's forward (into O's fp32 accumulator and the running LSE), a step's
 * backward kernels and its dQ (into the accumulator), and its dK/dV added to the travelling sums. */
struct mt_hopper_gemm_state;
static bool cp_fast_wanted(mt_hopper_gemm_state* hs, bool backward, int d, const mt_dropout& drop, const int32_t* doc);
static cudaError_t cp_fast_forward_step(mt_hopper_gemm_state* hs, attn_view O, float* LSE, const cp_ring_scratch& s,
                                        int first, int last, attn_cview Q, attn_cview K, attn_cview V, int B, int H,
                                        int Hkv, int T, int q_rank, int kv_rank, int d, cudaStream_t st);
static cudaError_t cp_fast_backward_step(mt_hopper_gemm_state* hs, attn_view dQ, const cp_ring_scratch& s, int first,
                                         int last, attn_cview dO, attn_cview Q, attn_cview K, attn_cview V,
                                         const float* LSE, const float* Dsum, int B, int H, int Hkv, int T, int q_rank,
                                         int kv_rank, int d, cudaStream_t st);
static cudaError_t cp_fast_backward_add(const cp_ring_scratch& s, const float* dkv_in, float* dkv_out, int B, int Hkv,
                                        int T, int q_rank, int kv_rank, int d, cudaStream_t st);

/* One ring step's forward: rank q_rank's queries against rank kv_rank's K/V block, merged into the
 * running (acc, LSE) (first: the first block; last: O rounded into the O view). T: local rows. */
static cudaError_t cp_attention_forward_block(attn_view O, float* LSE, float* acc, int first, int last, attn_cview Q,
                                              attn_cview K, attn_cview V, int B, int H, int Hkv, int T, int q_rank,
                                              int kv_rank, int cp, int d, cudaStream_t st,
                                              const mt_dropout& drop = mt_dropout(), const int32_t* doc = NULL) {
    const fa::geom g = cp_block_geom(q_rank, kv_rank, cp, T);
    if (cp < 1 || q_rank < 0 || q_rank >= cp || kv_rank < 0 || kv_rank >= cp || T % 2 != 0 ||
        !fa::shape_ok(B, H, Hkv, T, d) || !fa::geom_ok(g, d) || !fa::view_ok(O) || !fa::view_ok(Q) ||
        !fa::view_ok(K) || !fa::view_ok(V) || !acc)
        return cudaErrorInvalidValue;
    const fa::fwd_merge mo = {acc, first, last};
    return d == 64 ? fa::forward_d<64, 2>(O, LSE, Q, K, V, B, H, Hkv, T, st, drop, doc, &g, mo)
                   : fa::forward_d<128, 2>(O, LSE, Q, K, V, B, H, Hkv, T, st, drop, doc, &g, mo);
}
/* Dsum [B, H, T] = rowsum(dO * O), once per backward, from the final O. */
static cudaError_t cp_attention_dsum(float* Dsum, attn_cview dO, attn_cview O, int B, int H, int Hkv, int T, int d,
                                     cudaStream_t st) {
    if (!fa::shape_ok(B, H, Hkv, T, d) || !fa::view_ok(dO) || !fa::view_ok(O)) return cudaErrorInvalidValue;
    return d == 64 ? fa::backward_dot<64>(Dsum, dO, O, B, H, Hkv, T, st)
                   : fa::backward_dot<128>(Dsum, dO, O, B, H, Hkv, T, st);
}
/* One ring step's backward with the final LSE and Dsum: which & 2: dQ += this block's, in dq_acc
 * (first / last as the forward's); which & 1: the block's dK/dV added to dkv_in (NULL: none yet)
 * into dkv_out, fp32 [2][B][Hkv][T][d] (dK then dV). */
static cudaError_t cp_attention_backward_block(int which, attn_view dQ, float* dq_acc, int first, int last,
                                               const float* dkv_in, float* dkv_out, attn_cview dO, attn_cview Q,
                                               attn_cview K, attn_cview V, const float* LSE, const float* Dsum, int B,
                                               int H, int Hkv, int T, int q_rank, int kv_rank, int cp, int d,
                                               cudaStream_t st, const mt_dropout& drop = mt_dropout(),
                                               const int32_t* doc = NULL) {
    const fa::geom g = cp_block_geom(q_rank, kv_rank, cp, T);
    if (cp < 1 || q_rank < 0 || q_rank >= cp || kv_rank < 0 || kv_rank >= cp || T % 2 != 0 ||
        !fa::shape_ok(B, H, Hkv, T, d) || !fa::geom_ok(g, d) || !fa::view_ok(dO) || !fa::view_ok(Q) ||
        !fa::view_ok(K) || !fa::view_ok(V) || ((which & 2) && (!dq_acc || !fa::view_ok(dQ))) || ((which & 1) && !dkv_out))
        return cudaErrorInvalidValue;
    const size_t half = (size_t)B * Hkv * T * d;
    const fa::bwd_acc acc = {dq_acc, first, last, dkv_in, dkv_in ? dkv_in + half : NULL, dkv_out,
                             dkv_out ? dkv_out + half : NULL};
    return d == 64 ? fa::backward_block_d<64>(which, dQ, dO, Q, K, V, LSE, Dsum, B, H, Hkv, g, st, drop, doc, acc)
                   : fa::backward_block_d<128>(which, dQ, dO, Q, K, V, LSE, Dsum, B, H, Hkv, g, st, drop, doc, acc);
}

/* K and V views -> one packed block [2][B][Hkv][T][d] (what travels); dK/dV sums (fp32, packed as the
 * block) -> bf16 into the gradient views. 8 elements per thread. */
__global__ void cp_pack_kv_kernel(bf16* __restrict__ out, attn_cview K, attn_cview V, int Hkv, int T, int d,
                                  size_t vecs) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * vecs) return;
    const size_t j = i % vecs, e8 = j % (d / 8), row = j / (d / 8);
    const int t = (int)(row % T), bh = (int)(row / T), b = bh / Hkv, h = bh % Hkv;
    const attn_cview& src = i < vecs ? K : V;
    *reinterpret_cast<uint4*>(out + i * 8) =
        *reinterpret_cast<const uint4*>(src.at(b, h, 1) + (int64_t)t * src.row + e8 * 8);
}
__global__ void cp_store_kv_grads_kernel(attn_view dK, attn_view dV, const float* __restrict__ in, int Hkv, int T, int d,
                                         size_t vecs) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * vecs) return;
    const size_t j = i % vecs, e8 = j % (d / 8), row = j / (d / 8);
    const int t = (int)(row % T), bh = (int)(row / T), b = bh / Hkv, h = bh % Hkv;
    const attn_view& dst = i < vecs ? dK : dV;
    const float4 a = *reinterpret_cast<const float4*>(in + i * 8), c = *reinterpret_cast<const float4*>(in + i * 8 + 4);
    uint4 v;
    v.x = fa::pack_bf16(a.x, a.y), v.y = fa::pack_bf16(a.z, a.w);
    v.z = fa::pack_bf16(c.x, c.y), v.w = fa::pack_bf16(c.z, c.w);
    *reinterpret_cast<uint4*>(dst.at(b, h, 1) + (int64_t)t * dst.row + e8 * 8) = v;
}
static cudaError_t cp_pack_kv(bf16* out, attn_cview K, attn_cview V, int B, int Hkv, int T, int d, cudaStream_t st) {
    const size_t vecs = (size_t)B * Hkv * T * (d / 8);
    cp_pack_kv_kernel<<<(unsigned)((2 * vecs + 255) / 256), 256, 0, st>>>(out, K, V, Hkv, T, d, vecs);
    return cudaGetLastError();
}
static cudaError_t cp_store_kv_grads(attn_view dK, attn_view dV, const float* in, int B, int Hkv, int T, int d,
                                     cudaStream_t st) {
    const size_t vecs = (size_t)B * Hkv * T * (d / 8);
    cp_store_kv_grads_kernel<<<(unsigned)((2 * vecs + 255) / 256), 256, 0, st>>>(dK, dV, in, Hkv, T, d, vecs);
    return cudaGetLastError();
}

/* One hop around the ring on the transfers' stream: `send` to rank+1, `recv` from rank-1. */
static bool cp_ring_shift(mt_gpu_error* e, const mt_cp_ring* r, const void* send, void* recv, size_t bytes) {
    const int next = (r->rank + 1) % r->size, prev = (r->rank + r->size - 1) % r->size;
    if (!NCCL_CHECK(e, r->global_rank, ncclGroupStart())) return false;
    bool ok = NCCL_CHECK(e, r->global_rank, ncclSend(send, bytes, ncclInt8, next, r->comm, r->stream));
    ok = ok && NCCL_CHECK(e, r->global_rank, ncclRecv(recv, bytes, ncclInt8, prev, r->comm, r->stream));
    return NCCL_CHECK(e, r->global_rank, ncclGroupEnd()) && ok;
}

/* The arguments both directions check: shapes, views, whole tiles per chunk, the scratch. */
static bool cp_ring_args_ok(const mt_exec* ex, const mt_cp_ring* r, const attn_cview* views, int n, int B, int H,
                            int Hkv, int T, int d, const void* scratch, size_t scratch_bytes, const char* what) {
    bool ok = r && r->size >= 1 && r->rank >= 0 && r->rank < r->size && T % 2 == 0 && fa::shape_ok(B, H, Hkv, T, d) &&
              fa::geom_ok(cp_block_geom(0, 0, r->size, T), d);
    for (int i = 0; i < n; i++) ok = ok && fa::view_ok(views[i]);
    if (!ok)
        return mt_gpu_fail(ex->error, MT_ERR_ARG,
                           "context-parallel attention %s: B %d H %d Hkv %d local rows %d d %d at CP %d: each of the "
                           "2*CP chunks must be a multiple of %d rows (head dim 64 or 128, 16-byte rows)",
                           what, B, H, Hkv, T, d, r ? r->size : 0, fa::span_tile_rows(d == 64 ? 64 : 128));
    if (!scratch || scratch_bytes < (size_t)mt_cp_ring_scratch_bytes(B, H, Hkv, T, d))
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "context-parallel attention %s: scratch of %zu bytes, %zu needed",
                           what, scratch_bytes, (size_t)mt_cp_ring_scratch_bytes(B, H, Hkv, T, d));
    return true;
}

/* The ring's K/V transfer of step i (of its K/V buffers): buffer cur (its block) goes to rank+1 while
 * buffer nxt receives the next block, once the kernels of step i-1 are done with it. */
static bool cp_ring_kv_step(const mt_exec* ex, const mt_cp_ring* r, cp_ring_scratch& s, int i, size_t kv_bytes) {
    const int cur = i & 1, nxt = cur ^ 1;
    mt_gpu_error* e = ex->error;
    return CUDA_CHECK(e, cudaStreamWaitEvent(r->stream, r->ready[cur], 0)) &&
           (i == 0 || CUDA_CHECK(e, cudaStreamWaitEvent(r->stream, r->freed[nxt], 0))) &&
           cp_ring_shift(e, r, s.kv[cur], s.kv[nxt], kv_bytes) &&
           CUDA_CHECK(e, cudaEventRecord(r->ready[nxt], r->stream));
}

/* Ring attention forward on ex->stream: O (H heads, T = 2C local rows, any view) and LSE [B, H, T]
 * fp32 from the local Q, K, V (section 17's row views), the rows' positions those of cp_chunk_span
 * (ring->rank); doc [B, T]: the local rows' document starts as sequence positions (NULL: none); drop:
 * the layer's attention dropout site (its masks indexed by global positions in the S = CP*T sequence).
 * hopper: section 13.1's probe state; not NULL, the steps run on the Hopper kernels where they run and
 * take the call (section 13.4: no dropout, no documents), else on section 9's. Errors go to ex->error
 * (false returned). Scratch: (size_t)mt_cp_ring_scratch_bytes(B, H, Hkv, T, d). */
[[maybe_unused]]
static bool cp_ring_attention_forward(const mt_exec* ex, const mt_cp_ring* ring, attn_view O, float* LSE, attn_cview Q,
                                      attn_cview K, attn_cview V, int B, int H, int Hkv, int T, int d,
                                      const mt_dropout& drop, const int32_t* doc, void* scratch, size_t scratch_bytes,
                                      mt_hopper_gemm_state* hopper = NULL) {
    const attn_cview views[] = {cview(O), Q, K, V};
    if (!cp_ring_args_ok(ex, ring, views, 4, B, H, Hkv, T, d, scratch, scratch_bytes, "forward")) return false;
    const bool fast = cp_fast_wanted(hopper, false, d, drop, doc);
    mt_gpu_error* e = ex->error;
    const int P = ring->size, r = ring->rank;
    cudaStream_t st = ex->stream;
    cp_ring_scratch s = cp_scratch_layout(scratch, B, H, Hkv, T, d);
    const size_t kv_elems = (size_t)B * Hkv * T * d, kv_bytes = 2 * kv_elems * sizeof(bf16);
    if (!CUDA_CHECK(e, cp_pack_kv(s.kv[0], K, V, B, Hkv, T, d, st))) return false;
    if (P > 1 && !CUDA_CHECK(e, cudaEventRecord(ring->ready[0], st))) return false;
    for (int i = 0; i < P; i++) {
        const int cur = i & 1, j = (r - i + P) % P; /* step i: rank j's block */
        if (i + 1 < P && !cp_ring_kv_step(ex, ring, s, i, kv_bytes)) return false;
        if (i > 0 && !CUDA_CHECK(e, cudaStreamWaitEvent(st, ring->ready[cur], 0))) return false;
        const attn_cview k = cview(packed_heads_view(s.kv[cur], Hkv, T, d, 1)),
                         v = cview(packed_heads_view(s.kv[cur] + kv_elems, Hkv, T, d, 1));
        if (!CUDA_CHECK(e, fast ? cp_fast_forward_step(hopper, O, LSE, s, i == 0, i == P - 1, Q, k, v, B, H, Hkv, T, r,
                                                       j, d, st)
                                : cp_attention_forward_block(O, LSE, s.acc, i == 0, i == P - 1, Q, k, v, B, H, Hkv, T, r,
                                                             j, P, d, st, drop, doc)))
            return false;
        if (P > 1 && !CUDA_CHECK(e, cudaEventRecord(ring->freed[cur], st))) return false;
    }
    return true;
}

/* Ring attention backward on ex->stream: dQ (H heads), dK, dV (Hkv heads; views of the local rows) from
 * the local dO, Q, K, V and the forward's final O and LSE; Dsum [B, H, T] fp32 is scratch (as
 * flash_attention_backward's). Other arguments as the forward's (hopper: the backward kernels' probe). */
[[maybe_unused]]
static bool cp_ring_attention_backward(const mt_exec* ex, const mt_cp_ring* ring, attn_view dQ, attn_view dK,
                                       attn_view dV, float* Dsum, attn_cview dO, attn_cview Q, attn_cview K,
                                       attn_cview V, attn_cview O, const float* LSE, int B, int H, int Hkv, int T,
                                       int d, const mt_dropout& drop, const int32_t* doc, void* scratch,
                                       size_t scratch_bytes, mt_hopper_gemm_state* hopper = NULL) {
    const attn_cview views[] = {cview(dQ), cview(dK), cview(dV), dO, Q, K, V, O};
    if (!cp_ring_args_ok(ex, ring, views, 8, B, H, Hkv, T, d, scratch, scratch_bytes, "backward")) return false;
    const bool fast = cp_fast_wanted(hopper, true, d, drop, doc);
    mt_gpu_error* e = ex->error;
    const int P = ring->size, r = ring->rank;
    cudaStream_t st = ex->stream;
    cp_ring_scratch s = cp_scratch_layout(scratch, B, H, Hkv, T, d);
    const size_t kv_elems = (size_t)B * Hkv * T * d, kv_bytes = 2 * kv_elems * sizeof(bf16),
                 grad_bytes = 2 * kv_elems * sizeof(float);
    if (!CUDA_CHECK(e, cp_attention_dsum(Dsum, dO, O, B, H, Hkv, T, d, st)) ||
        !CUDA_CHECK(e, cp_pack_kv(s.kv[0], K, V, B, Hkv, T, d, st)))
        return false;
    if (P > 1 && !CUDA_CHECK(e, cudaEventRecord(ring->ready[0], st))) return false;
    for (int i = 0; i < P; i++) {
        const int cur = i & 1, j = (r - i + P) % P;
        if (i + 1 < P && !cp_ring_kv_step(ex, ring, s, i, kv_bytes)) return false;
        if (i > 0 && !CUDA_CHECK(e, cudaStreamWaitEvent(st, ring->ready[cur], 0))) return false;
        const attn_cview k = cview(packed_heads_view(s.kv[cur], Hkv, T, d, 1)),
                         v = cview(packed_heads_view(s.kv[cur] + kv_elems, Hkv, T, d, 1));
        /* dQ first: it needs no travelling sums, so it overlaps their arrival (the Hopper step: both kernels
         * into the step's scratch, dQ added) */
        if (!CUDA_CHECK(e, fast ? cp_fast_backward_step(hopper, dQ, s, i == 0, i == P - 1, dO, Q, k, v, LSE, Dsum, B, H,
                                                        Hkv, T, r, j, d, st)
                                : cp_attention_backward_block(2, dQ, s.acc, i == 0, i == P - 1, NULL, NULL, dO, Q, k, v,
                                                              LSE, Dsum, B, H, Hkv, T, r, j, P, d, st, drop, doc)))
            return false;
        /* the sums for rank j's block arrived in dkv[1] (from rank r-1's step i-1); this step's go to dkv[0] */
        if (i > 0 && !CUDA_CHECK(e, cudaStreamWaitEvent(st, ring->grad_ready, 0))) return false;
        if (!CUDA_CHECK(e, fast ? cp_fast_backward_add(s, i > 0 ? s.dkv[1] : NULL, s.dkv[0], B, Hkv, T, r, j, d, st)
                                : cp_attention_backward_block(1, dQ, s.acc, i == 0, i == P - 1, i > 0 ? s.dkv[1] : NULL,
                                                              s.dkv[0], dO, Q, k, v, LSE, Dsum, B, H, Hkv, T, r, j, P,
                                                              d, st, drop, doc)))
            return false;
        if (P > 1) { /* the sums move on with the block (after the last step: home to their owner) */
            if (!CUDA_CHECK(e, cudaEventRecord(ring->freed[cur], st)) ||
                !CUDA_CHECK(e, cudaEventRecord(ring->grad_done, st)) ||
                !CUDA_CHECK(e, cudaStreamWaitEvent(ring->stream, ring->grad_done, 0)) ||
                !cp_ring_shift(e, ring, s.dkv[0], s.dkv[1], grad_bytes) ||
                !CUDA_CHECK(e, cudaEventRecord(ring->grad_ready, ring->stream)))
                return false;
        }
    }
    if (P > 1 && !CUDA_CHECK(e, cudaStreamWaitEvent(st, ring->grad_ready, 0))) return false;
    return CUDA_CHECK(e, cp_store_kv_grads(dK, dV, P > 1 ? s.dkv[1] : s.dkv[0], B, Hkv, T, d, st));
}

/* ============================================================================================== */
/* 10. Cross entropy                                                                              */
/*    Fused with the softmax: one block per token, the loss in fp32 over all padded vocabulary    */
/*    columns (as Megatron); when grad_scale != 0 the logits are overwritten in place by d loss   */
/*    / d logits = (softmax - onehot) * grad_scale, so probabilities are never stored. With       */
/*    tensor parallelism (Megatron's VocabParallelCrossEntropy) each rank computes its columns'   */
/*    (max, sum, target logit), the ranks exchange them, and every rank combines them in rank     */
/*    order.                                                                                      */
/*    defines: cross_entropy_fused, cross_entropy_partial, cross_entropy_combine.                 */
/* ============================================================================================== */

template <typename T>
__global__ void cross_entropy_kernel(T* logits, float* losses, const int32_t* targets, int V, float grad_scale) {
    int64_t row = blockIdx.x;
    T* x = logits + row * V;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, to_float(x[i]));
    mx = block_max(mx);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) sum += expf(to_float(x[i]) - mx);
    sum = block_sum(sum);
    float lse = mx + logf(sum);
    int target = targets[row];
    float target_logit = to_float(x[target]);
    if (threadIdx.x == 0) losses[row] = lse - target_logit;
    __syncthreads(); /* every read of x precedes the in-place writes */
    if (grad_scale != 0.0f) {
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            float p = expf(to_float(x[i]) - lse);
            x[i] = from_float<T>((p - (i == target ? 1.0f : 0.0f)) * grad_scale);
        }
    }
}

/* One row's online softmax with 16-byte loads: each thread keeps a running max and its rescaled sum
 * of exponentials, the block combines them in a fixed order. Returns (max, sum of exp(x - max)). */
template <typename T>
__device__ __forceinline__ float2 row_softmax_stats(const T* x, int V) {
    constexpr int W = vec16<T>::N;
    float v[W];
    float mx = -INFINITY, sum = 0.0f;
    if (V % W == 0) { /* 16-byte loads: the row starts 16-byte aligned (the logits' base is) */
        for (int i = threadIdx.x * W; i < V; i += blockDim.x * W) {
            load16(v, x + i);
            float local = v[0];
#pragma unroll
            for (int k = 1; k < W; k++) local = fmaxf(local, v[k]);
            if (local > mx) {
                sum *= expf(mx - local);
                mx = local;
            }
#pragma unroll
            for (int k = 0; k < W; k++) sum += expf(v[k] - mx);
        }
    } else { /* a tensor-parallel rank's share of a vocabulary padded to no multiple of W x TP
              * (--make-vocab-size-divisible-by 1, or a resumed checkpoint's padding) */
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float e = to_float(x[i]);
            if (e > mx) {
                sum *= expf(mx - e);
                mx = e;
            }
            sum += expf(e - mx);
        }
    }
    float block_mx = block_max(mx);
    sum = mx == -INFINITY ? 0.0f : sum * expf(mx - block_mx);
    return make_float2(block_mx, block_sum(sum));
}

/* The same with 16-byte loads and an online softmax: one pass for the statistics, a second pass
 * writes the gradient (two reads of the logits instead of three). V must be a multiple of the
 * vector width. */
template <typename T>
__global__ void cross_entropy_vec_kernel(T* logits, float* losses, const int32_t* targets, int V, float grad_scale) {
    constexpr int W = vec16<T>::N;
    int64_t row = blockIdx.x;
    T* x = logits + row * V;
    float v[W];
    float2 stats = row_softmax_stats(x, V);
    float lse = stats.x + logf(stats.y);
    int target = targets[row];
    float target_logit = to_float(x[target]);
    if (threadIdx.x == 0) losses[row] = lse - target_logit;
    __syncthreads(); /* every read of x precedes the in-place writes */
    if (grad_scale != 0.0f) {
        for (int i = threadIdx.x * W; i < V; i += blockDim.x * W) {
            load16(v, x + i);
#pragma unroll
            for (int k = 0; k < W; k++) v[k] = (expf(v[k] - lse) - (i + k == target ? 1.0f : 0.0f)) * grad_scale;
            store16(x + i, v);
        }
    }
}

/* Vocab-parallel cross entropy (Megatron's VocabParallelCrossEntropy, in fp32): each tensor-parallel
 * rank holds the logits of vocabulary columns [vocab_start, vocab_start + V). Pass 1 writes its
 * partial statistics per row: (max, sum of exp(x - max), the target's logit if it is one of this
 * rank's columns, else 0), stats [BT, 3]. The ranks all-gather them; pass 2 combines the TP ranks'
 * statistics in rank order (the same on every rank), writes the loss and the gradient in place. */
template <typename T>
__global__ void cross_entropy_partial_kernel(float* stats, const T* logits, const int32_t* targets, int V,
                                             int64_t vocab_start) {
    int64_t row = blockIdx.x;
    const T* x = logits + row * V;
    float2 st = row_softmax_stats(x, V);
    if (threadIdx.x == 0) {
        int64_t target = targets[row] - vocab_start;
        stats[row * 3 + 0] = st.x;
        stats[row * 3 + 1] = st.y;
        stats[row * 3 + 2] = target >= 0 && target < V ? to_float(x[target]) : 0.0f;
    }
}
/* stats: [tp, BT, 3] (every rank's pass-1 output). */
template <typename T>
__global__ void cross_entropy_combine_kernel(T* logits, float* losses, const float* stats, int tp, int BT,
                                             const int32_t* targets, int V, int64_t vocab_start, float grad_scale) {
    constexpr int W = vec16<T>::N;
    int64_t row = blockIdx.x;
    /* the ranks' (max, sum) pairs merged one by one, as the online softmax merges its pieces. (Not
     * unrolled: nvcc 13.0 at -O3 miscompiled the unrolled-by-4 form of a two-loop version of this,
     * giving inf at tp = 4; tests/test_tensor_parallel.h checks every tp from 1 to 8 against a CPU reference.) */
    float mx = -INFINITY, sum = 0.0f, target_logit = 0.0f;
#pragma unroll 1
    for (int r = 0; r < tp; r++) {
        const float* p = stats + ((int64_t)r * BT + row) * 3;
        float m = p[0], s = p[1];
        if (m > mx) {
            sum *= expf(mx - m);
            mx = m;
        }
        sum += s * expf(m - mx);
        target_logit += p[2];
    }
    float lse = mx + logf(sum);
    if (threadIdx.x == 0) losses[row] = lse - target_logit;
    if (grad_scale == 0.0f) return;
    T* x = logits + row * V;
    int64_t target = targets[row] - vocab_start;
    float v[W];
    if (V % W != 0) { /* no 16-byte rows (row_softmax_stats) */
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            x[i] = from_float<T>((expf(to_float(x[i]) - lse) - (i == target ? 1.0f : 0.0f)) * grad_scale);
        return;
    }
    for (int i = threadIdx.x * W; i < V; i += blockDim.x * W) {
        load16(v, x + i);
#pragma unroll
        for (int k = 0; k < W; k++) v[k] = (expf(v[k] - lse) - (i + k == target ? 1.0f : 0.0f)) * grad_scale;
        store16(x + i, v);
    }
}

/* One rank's whole vocabulary (TP = 1): losses [BT] from logits [BT, V], which become their gradient
 * (times grad_scale) when grad_scale != 0. */
template <typename T>
static void cross_entropy_fused(const mt_exec* ex, T* logits, float* losses, const int32_t* targets, int BT, int V,
                                float grad_scale) {
    if (V % vec16<T>::N == 0)
        cross_entropy_vec_kernel<T><<<BT, 512, 0, ex->stream>>>(logits, losses, targets, V, grad_scale);
    else
        cross_entropy_kernel<T><<<BT, 512, 0, ex->stream>>>(logits, losses, targets, V, grad_scale);
    LAUNCH_CHECK(ex->error);
}
/* Vocab-parallel pass 1: this rank's statistics stats [BT, 3] of its columns [vocab_start, + V) */
template <typename T>
static void cross_entropy_partial(const mt_exec* ex, float* stats, const T* logits, const int32_t* targets, int BT,
                                  int V, int64_t vocab_start) {
    cross_entropy_partial_kernel<T><<<BT, 512, 0, ex->stream>>>(stats, logits, targets, V, vocab_start);
    LAUNCH_CHECK(ex->error);
}
/* Vocab-parallel pass 2: every rank's statistics [tp, BT, 3] -> losses [BT] and, when grad_scale != 0,
 * this rank's logits' gradient in place */
template <typename T>
static void cross_entropy_combine(const mt_exec* ex, T* logits, float* losses, const float* stats, int tp, int BT,
                                  const int32_t* targets, int V, int64_t vocab_start, float grad_scale) {
    cross_entropy_combine_kernel<T><<<BT, 512, 0, ex->stream>>>(logits, losses, stats, tp, BT, targets, V, vocab_start,
                                                                grad_scale);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 11. Gradient norm and AdamW                                                                    */
/*    The optimizer's work comes in chunks (mt_opt_chunk) of the owned parameter elements. The    */
/*    global gradient norm: a fixed grid of partial sums in double, then one block in fixed       */
/*    order. AdamW (apex/ TE FusedAdam, adam_w_mode): the fp32 master is updated and the model    */
/*    copy (bf16/fp16) rewritten from it, one launch for every chunk; grad_scale folds clipping   */
/*    and the fp16 loss-scale unscaling.                                                          */
/*    defines: mt_opt_chunk, gradient_sum_squares, gradient_count_zeros, adamw_update.            */
/* ============================================================================================== */

/* A piece of the optimizer's work: `length` elements of one parameter, at `buffer` in the
 * parameter/gradient buffers and at `master` in the optimizer's shard. */
typedef struct {
    int64_t buffer;
    int64_t master;
    int32_t length;
    int32_t weight_decay;
    int32_t count_in_norm; /* 0 for a tensor-parallel replica's copy of a whole tensor (counted on TP rank 0) */
    int32_t decoupled;     /* 1: the word embeddings or the output layer, at lr_decoupled (--decoupled-lr) */
} mt_opt_chunk;
#define OPT_CHUNK_ELEMENTS MT_OPT_CHUNK_ELEMENTS
static_assert(sizeof(mt_opt_chunk) == MT_OPT_CHUNK_BYTES, "the memory plan counts mt_opt_chunk's bytes");

/* partial[c] = sum of squares of chunk c of the gradient buffer (MASTER: of the optimizer's fp32
 * master weights, --log-params-norm). */
template <bool MASTER>
__global__ void chunk_sum_squares_kernel(double* partial, const mt_opt_chunk* chunks, const float* x) {
    __shared__ double shared[256];
    mt_opt_chunk c = chunks[blockIdx.x];
    const int64_t at = MASTER ? c.master : c.buffer;
    double s = 0.0;
    if (!c.count_in_norm) c.length = 0;
    int done = 0;
    if ((at & 3) == 0) { /* 16 bytes per load where the chunk is aligned (as AdamW) */
        const int n4 = c.length / 4;
        for (int j = threadIdx.x; j < n4; j += blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(x + at + 4 * (int64_t)j);
            s += (double)v.x * v.x + (double)v.y * v.y + (double)v.z * v.z + (double)v.w * v.w;
        }
        done = n4 * 4;
    }
    for (int i = done + threadIdx.x; i < c.length; i += blockDim.x) {
        double v = x[at + i];
        s += v * v;
    }
    shared[threadIdx.x] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}
__global__ void sum_partials_kernel(double* out, const double* partial, int count) {
    __shared__ double shared[256];
    double s = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
    shared[threadIdx.x] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = shared[0];
}

/* partial[c] = the number of elements of chunk c of the gradient buffer whose step gradient
 * g * grad_scale (AdamW's: unscaled and clipped) is exactly 0 (--log-num-zeros-in-grad; counted
 * chunks only). Counts are integers, exact in double up to 2^53. */
__global__ void chunk_count_zeros_kernel(double* partial, const mt_opt_chunk* chunks, const float* g, float grad_scale) {
    __shared__ double shared[256];
    const mt_opt_chunk c = chunks[blockIdx.x];
    int zeros = 0;
    for (int i = threadIdx.x; c.count_in_norm && i < c.length; i += blockDim.x)
        zeros += __fmul_rn(g[c.buffer + i], grad_scale) == 0.0f;
    shared[threadIdx.x] = (double)zeros;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}

/* partial[num_chunks] = the sum of squares of the chunks' gradients (MASTER: master weights; counted
 * chunks only), in a fixed order; partial [num_chunks + 1] on the device */
template <bool MASTER = false>
static void gradient_sum_squares(const mt_exec* ex, double* partial, const mt_opt_chunk* chunks, int num_chunks,
                                 const float* x) {
    if (num_chunks > 0) chunk_sum_squares_kernel<MASTER><<<num_chunks, 256, 0, ex->stream>>>(partial, chunks, x);
    sum_partials_kernel<<<1, 256, 0, ex->stream>>>(partial + num_chunks, partial, num_chunks);
    LAUNCH_CHECK(ex->error);
}
/* partial[num_chunks] = the zeros of the chunks' step gradients (chunk_count_zeros_kernel), in a fixed order */
static void gradient_count_zeros(const mt_exec* ex, double* partial, const mt_opt_chunk* chunks, int num_chunks,
                                 const float* grads, float grad_scale) {
    if (num_chunks > 0)
        chunk_count_zeros_kernel<<<num_chunks, 256, 0, ex->stream>>>(partial, chunks, grads, grad_scale);
    sum_partials_kernel<<<1, 256, 0, ex->stream>>>(partial + num_chunks, partial, num_chunks);
    LAUNCH_CHECK(ex->error);
}

/* One element's step: g is the (scaled) gradient; m, v, p (the fp32 master) are updated in place.
 * Every rounding is spelled out (the _rn intrinsics: ptxas neither fuses nor splits them), in the
 * order of megatron.h's mt_adamw_cpu_scalar, so the offloaded CPU AdamW equals this bit for bit. Left
 * to the compiler, `p -= lr * update` was fused into one FFMA in some lanes and not in others, and
 * which changed with unrelated edits to this kernel (seen: 3 of 4 unrolled lanes as FMUL + FADD). */
__device__ __forceinline__ void adamw_element(float g, float& m, float& v, float& p, float lr, float beta1, float beta2,
                                              float bias_correction1, float bias_correction2, float eps, float wd) {
    m = __fmaf_rn(m, beta1, __fmul_rn(__fsub_rn(1.0f, beta1), g));
    v = __fmaf_rn(v, beta2, __fmul_rn(g, __fmul_rn(__fsub_rn(1.0f, beta2), g)));
    const float update = __fmaf_rn(p, wd, __fdiv_rn(__fdiv_rn(m, bias_correction1),
                                                    __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bias_correction2)), eps)));
    p = __fmaf_rn(-update, lr, p);
}
/* A block per chunk. Chunks whose buffer and master offsets are multiples of 4 elements (every chunk
 * of the distributed optimizer's 64-element-aligned layout, most of the others) go 16 bytes per
 * load (4 elements: the model copy 8 bytes for bf16/fp16); the rest, and the last length % 4, one
 * element at a time. Per element the same arithmetic either way. (dev/cuda/fused_kernels.cu: the
 * one-element-per-load version reached 88% of the copy ceiling on an H100.) */
template <typename T>
__global__ void adamw_kernel(const mt_opt_chunk* chunks, float* master, T* model, const float* grad, float* m,
                             float* v, float lr_main, float lr_decoupled, float beta1, float beta2,
                             float bias_correction1, float bias_correction2, float eps, float weight_decay,
                             float grad_scale) {
    const mt_opt_chunk c = chunks[blockIdx.x];
    const float wd = c.weight_decay ? weight_decay : 0.0f;
    const float lr = c.decoupled ? lr_decoupled : lr_main;
    const bool copy = model && (void*)model != (void*)master; /* NULL: --fp8-param-gather publishes it after */
    int done = 0;
    if (((c.master | c.buffer) & 3) == 0) {
        const int n4 = c.length / 4;
        for (int j = threadIdx.x; j < n4; j += blockDim.x) {
            const int64_t k = c.master + 4 * (int64_t)j, b = c.buffer + 4 * (int64_t)j;
            const float4 g = *reinterpret_cast<const float4*>(grad + b);
            float4 mi = *reinterpret_cast<const float4*>(m + k), vi = *reinterpret_cast<const float4*>(v + k);
            float4 p = *reinterpret_cast<const float4*>(master + k);
            adamw_element(__fmul_rn(g.x, grad_scale), mi.x, vi.x, p.x, lr, beta1, beta2, bias_correction1,
                          bias_correction2, eps, wd);
            adamw_element(__fmul_rn(g.y, grad_scale), mi.y, vi.y, p.y, lr, beta1, beta2, bias_correction1,
                          bias_correction2, eps, wd);
            adamw_element(__fmul_rn(g.z, grad_scale), mi.z, vi.z, p.z, lr, beta1, beta2, bias_correction1,
                          bias_correction2, eps, wd);
            adamw_element(__fmul_rn(g.w, grad_scale), mi.w, vi.w, p.w, lr, beta1, beta2, bias_correction1,
                          bias_correction2, eps, wd);
            *reinterpret_cast<float4*>(m + k) = mi;
            *reinterpret_cast<float4*>(v + k) = vi;
            *reinterpret_cast<float4*>(master + k) = p;
            if (copy) {
                struct alignas(4 * sizeof(T)) four { T e[4]; } out;
                out.e[0] = from_float<T>(p.x);
                out.e[1] = from_float<T>(p.y);
                out.e[2] = from_float<T>(p.z);
                out.e[3] = from_float<T>(p.w);
                *reinterpret_cast<four*>(model + b) = out;
            }
        }
        done = n4 * 4;
    }
    for (int i = done + threadIdx.x; i < c.length; i += blockDim.x) {
        const int64_t k = c.master + i, b = c.buffer + i;
        float mi = m[k], vi = v[k], p = master[k];
        adamw_element(__fmul_rn(grad[b], grad_scale), mi, vi, p, lr, beta1, beta2, bias_correction1, bias_correction2,
                      eps, wd);
        m[k] = mi;
        v[k] = vi;
        master[k] = p;
        if (copy) model[b] = from_float<T>(p);
    }
}

/* One AdamW step over every chunk (a multi-tensor AdamW, one launch; mt_adamw_step: megatron.h, whose
 * mt_adamw_cpu is this kernel's arithmetic on the host). */
template <typename T>
static void adamw_update(const mt_exec* ex, const mt_adamw_step* h, const mt_opt_chunk* chunks, int num_chunks,
                         float* master, T* model, const float* grads, float* m, float* v) {
    adamw_kernel<T><<<num_chunks, 256, 0, ex->stream>>>(chunks, master, model, grads, m, v, h->lr, h->lr_decoupled,
                                                        h->beta1, h->beta2,
                                                        h->bias_correction1, h->bias_correction2, h->eps,
                                                        h->weight_decay, h->grad_scale);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 12. FP8: formats, scaling, casts and transposes                                                */
/*    Transformer Engine style FP8 for Hopper's tensor cores (sm_89 and later). A tensor x is     */
/*    stored as bytes q = fp8(x * scale), rounded to nearest even and saturating at the format's  */
/*    largest value (NaN stays NaN), and read back as q * scale_inv with scale_inv = 1 / scale,   */
/*    which the FP8 GEMM applies to its fp32 product. E4M3 (3 mantissa bits, largest 448) carries */
/*    activations and weights; E5M2 (2 mantissa bits, largest 57344) carries the gradients in the */
/*    hybrid format. The scale of a tensor is delayed (from the amaxes of the last steps, kept in */
/*    a ring on the device and updated for every tensor by one kernel after the step) or current  */
/*    (from the tensor's own amax, taken just before the cast); or one scale per block: 1x128 for */
/*    activations and gradients, 128x128 for weights, in the layouts cuBLASLt's block-scaled      */
/*    GEMMs read. Hopper's FP8 MMA takes only operands whose rows run along K, and each tensor of */
/*    a linear layer is the operand of one GEMM as stored and of another transposed (x: [N, in]   */
/*    in the forward, [in, N] in the weight gradient), so the casts write both layouts from one   */
/*    read of x, through a shared-memory tile so that both writes are coalesced. An amax is the   */
/*    integer maximum of the bit patterns of |x|: non-negative floats order like their bits, with */
/*    NaN above infinity, so it is exact and order-free (deterministic even through atomicMax)    */
/*    and a NaN anywhere makes the amax NaN.                                                      */
/*    defines: mt_fp8_dtype, mt_fp8_scaling_mode, mt_fp8_scaling, fp8_amax, fp8_scale_update,     */
/*    fp8_scale_from_amax, fp8_cast_transpose, fp8_quantize_tensorwise, fp8_transpose,            */
/*    fp8_cast_blockwise, fp8_publish_chunk, fp8_publish_amax, fp8_strided_scales_from_amax,      */
/*    fp8_publish, fp8x4_scaled, fp8_out_store, fp8_out_amax.                                     */
/* ============================================================================================== */

typedef enum { FP8_E4M3 = 0, FP8_E5M2 = 1 } mt_fp8_dtype;

/* How an FP8 operand is scaled, and how its scale_inv is laid out (the casts write it, gemm_fp8
 * reads it; cuBLASLt's names in brackets). For a tensor stored row-major [rows, cols]:
 *   FP8_PER_TENSOR      one float [SCALAR_32F];
 *   FP8_BLOCKS_1x128    one per 128 consecutive elements of a row (a row's last block may be
 *                       shorter): [ceil(cols/128)][rows], the row index fastest [VEC128_32F];
 *   FP8_BLOCKS_128x128  one per 128x128 block (edge blocks may be smaller): [ceil(rows/128)][ld]
 *                       with ld = ceil(cols/128) rounded up to a multiple of 4 (16 bytes); the
 *                       padding is neither written nor read [BLK128x128_32F]. */
typedef enum { FP8_PER_TENSOR = 0, FP8_BLOCKS_1x128 = 1, FP8_BLOCKS_128x128 = 2 } mt_fp8_scaling_mode;

/* Delayed scaling's reduction of an amax history: mt_fp8_amax_algo (megatron.h, --fp8-amax-compute-algo). */

/* cuBLASLt refuses a scale pointer that is not 16-byte aligned: cublasLtMatmul returns
 * CUBLAS_STATUS_NOT_SUPPORTED although the heuristic found an algorithm (seen on an H100 with cuBLAS
 * 13.0; dev/cuda/fp8_probe.cu shows it). Per-tensor scale_invs that GEMMs read therefore sit
 * FP8_SCALE_INV_STRIDE floats apart. */
#define FP8_SCALE_INV_STRIDE 4

/* The per-tensor scaling state of one FP8 operand: device pointers to one float each. The cast
 * multiplies by scale and, for delayed scaling, writes the tensor's amax (which fp8_scale_update then
 * enters into the history kept beside, batched over tensors); current scaling computes amax, then
 * scale, just before the cast (fp8_quantize_tensorwise). The GEMM reads scale_inv. */
typedef struct {
    float* scale;     /* [1] */
    float* scale_inv; /* [1] 1 / scale */
    float* amax;      /* [1] max |x| of the tensor last cast */
} mt_fp8_scaling;

/* The largest finite value: E4M3 has no infinities (S.1111.111 is NaN), so 1.75 * 2^8 = 448; E5M2 is
 * IEEE-like (exponent 11111 is inf/NaN), so 1.75 * 2^15 = 57344. */
[[maybe_unused]] static __host__ __device__ inline float fp8_max_value(mt_fp8_dtype f) {
    return f == FP8_E4M3 ? 448.0f : 57344.0f;
}
[[maybe_unused]] static cudaDataType_t fp8_cuda_type(mt_fp8_dtype f) {
    return f == FP8_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}
[[maybe_unused]] static const char* fp8_format_name(mt_fp8_dtype f) { return f == FP8_E4M3 ? "e4m3" : "e5m2"; }
[[maybe_unused]] static const char* fp8_scaling_mode_name(mt_fp8_scaling_mode m) {
    return m == FP8_PER_TENSOR ? "per-tensor" : m == FP8_BLOCKS_1x128 ? "1x128 blocks" : "128x128 blocks";
}
/* The number of floats of the scale_inv of a tensor [rows, cols] (the 128x128 padding included). */
[[maybe_unused]] static int64_t fp8_scale_inv_count(mt_fp8_scaling_mode m, int rows, int cols) {
    if (m == FP8_BLOCKS_1x128) return (int64_t)ceil_div(cols, 128) * rows;
    if (m == FP8_BLOCKS_128x128) return (int64_t)ceil_div(rows, 128) * (ceil_div(ceil_div(cols, 128), 4) * 4);
    return 1;
}

/* x -> the fp8 byte of format F, rounded to nearest even; |x| beyond the largest value (infinity
 * included) becomes +-largest, NaN stays NaN (cvt.rn.satfinite on sm_89+; Transformer Engine's
 * saturating cast). Two at a time: a in the low byte, b in the high byte, one instruction. */
template <mt_fp8_dtype F>
__device__ __forceinline__ uint8_t fp8_from_float(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, F == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}
template <mt_fp8_dtype F>
__device__ __forceinline__ uint32_t fp8x2_from_float(float a, float b) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}
/* One element of a bf16, fp16 or fp32 tensor, scaled and cast: fp8(x * scale), the product in fp32. */
template <mt_fp8_dtype F, typename T>
__device__ __forceinline__ uint8_t fp8_quantize(T x, float scale) {
    return fp8_from_float<F>(to_float(x) * scale);
}

/* |x| as bits that order like the value: for a float with the sign bit cleared, integer order is
 * numeric order, and every NaN lies above +infinity. */
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

/* Four values scaled and cast, a in the low byte: the per-tensor casts' one rule (fp8_cast_transpose and
 * the producers' fp8_out). */
template <mt_fp8_dtype F>
__device__ __forceinline__ uint32_t fp8x4_scaled(float a, float b, float c, float d, float scale) {
    return fp8x2_from_float<F>(a * scale, b * scale) | fp8x2_from_float<F>(c * scale, d * scale) << 16;
}

/* ---- FP8 outputs of producer kernels (fp8_out, declared in section 5) ----
 * A norm or MLP activation that makes an FP8 linear's input x under delayed scaling writes x's E4M3
 * bytes itself: each value rounded to the model type T first (the x fp8_cast_transpose would read
 * back), then cast with fp8x4_scaled as that cast does, its |x| bits max-ed into the slot's amax. So
 * the bytes and the amax are bitwise the cast's, and the cast's read of x is saved. */
template <typename T, int V>
__device__ __forceinline__ void fp8_out_store(const fp8_out& o, int64_t at, const float* v, uint32_t& largest) {
    static_assert(V % 4 == 0, "whole 4-byte words of FP8");
    const float scale = *o.scale;
    uint32_t packed[V / 4];
#pragma unroll
    for (int i = 0; i < V; i += 4) {
        float x[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            x[k] = to_float(from_float<T>(v[i + k]));
            largest = max(largest, abs_bits(x[k]));
        }
        packed[i / 4] = fp8x4_scaled<FP8_E4M3>(x[0], x[1], x[2], x[3], scale);
    }
    uint8_t* dst = o.q + at; /* at a multiple of V: 4 * (V / 4) aligned bytes */
    if constexpr (V == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
    else
#pragma unroll
        for (int i = 0; i < V / 4; i++) reinterpret_cast<uint32_t*>(dst)[i] = packed[i];
}
/* The warp's largest |x| into o.amax (every lane of a whole warp calls it). The atomic only where it
 * would raise the slot: amax only grows within a step, so skipping a smaller value is exact. */
__device__ __forceinline__ void fp8_out_amax(const fp8_out& o, uint32_t largest) {
    largest = __reduce_max_sync(0xffffffffu, largest);
    if (o.amax && threadIdx.x % 32 == 0 && largest > *reinterpret_cast<volatile uint32_t*>(o.amax))
        atomicMax(reinterpret_cast<unsigned int*>(o.amax), largest);
}
/* Block-wide maximum of unsigned values (exact, so any order gives the same result). */
__device__ uint32_t block_max_u32(uint32_t v) {
    __shared__ uint32_t shared[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = __reduce_max_sync(0xffffffffu, v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0u;
    return __reduce_max_sync(0xffffffffu, v);
}

/* The scale that maps amax onto the format's largest value with `margin` powers of two of headroom:
 * fp8_max / amax / 2^margin. An amax of 0 (nothing to scale) or not finite (an overflow upstream)
 * gives `fallback`: the previous scale for delayed scaling, 1 for current scaling and for blocks. A
 * quotient beyond fp32 (amax below fp8_max / FLT_MAX) is FLT_MAX. IEEE division and an exact ldexp:
 * the host computes bitwise the same. */
static __host__ __device__ inline float fp8_scale_from_amax_value(float amax, float fp8_max, int margin, float fallback) {
    if (!(amax > 0.0f) || !(amax <= FLT_MAX)) return fallback; /* 0, NaN, infinity */
    const float scale = ldexpf(fp8_max / amax, -margin);
    return scale <= FLT_MAX ? scale : FLT_MAX;
}
/* The largest power of two not above a scale (for power-of-2 block scales, whose dequantisation is
 * exact): the exponent of a normal float with its mantissa cleared. */
static __host__ __device__ inline float fp8_scale_power_of_2_below(float scale) {
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    if (!(scale >= FLT_MIN) || !(scale <= FLT_MAX)) return scale;
    bits &= 0xFF800000u;
    float down;
    memcpy(&down, &bits, 4);
    return down;
}

/* ---- amax ---- */

/* atomicMax of the bits of a block's max |x| into *amax (zeroed by the launcher). Threads stride
 * over 16-byte vectors [0, vectors), then over the scalar tail [vectors * V, n). */
template <typename T>
__global__ void __launch_bounds__(256) fp8_amax_kernel(float* amax, const T* x, int64_t n, int64_t vectors) {
    constexpr int V = vec16<T>::N;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t largest = 0;
    for (int64_t i = first; i < vectors; i += stride) {
        float v[V];
        load16(v, x + i * V);
#pragma unroll
        for (int j = 0; j < V; j++) largest = max(largest, abs_bits(v[j]));
    }
    for (int64_t i = vectors * V + first; i < n; i += stride) largest = max(largest, abs_bits(to_float(x[i])));
    largest = block_max_u32(largest);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), largest);
}

/* *amax (device) = max |x| over x[n] (bf16, fp16, fp32); NaN if any element is NaN, 0 for n = 0.
 * 16-byte loads when x is 16-byte aligned. */
template <typename T>
static void fp8_amax(const mt_exec* ex, float* amax, const T* x, int64_t n) {
    constexpr int V = vec16<T>::N;
    if (!CUDA_CHECK(ex->error, cudaMemsetAsync(amax, 0, sizeof(float), ex->stream)) || n <= 0) return;
    const int64_t vectors = aligned16(x) ? n / V : 0, work = vectors > 0 ? vectors : n;
    const int blocks = (int)(work / 256 + 1 < 1024 ? work / 256 + 1 : 1024);
    fp8_amax_kernel<T><<<blocks, 256, 0, ex->stream>>>(amax, x, n, vectors);
    LAUNCH_CHECK(ex->error);
}

/* ---- per-tensor scales ---- */

/* One warp per tensor t: slot `position` of its history row [history_len] takes this step's amax;
 * the row reduces (max: the largest slot, NaN if any slot is NaN; most recent: this step's amax);
 * scale becomes fp8_max[t] / amax / 2^margin, or stays where that amax is 0 or not finite. */
__global__ void fp8_scale_update_kernel(float* amax_history, float* scale, float* scale_inv, const float* amax,
                                        const float* fp8_max, int n_tensors, int history_len, int position,
                                        int margin, int algo, int scale_inv_stride) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= n_tensors) return; /* whole warps */
    const float current = amax[t];
    float* history = amax_history + (int64_t)t * history_len;
    uint32_t largest = 0;
    for (int h = lane; h < history_len; h += 32) {
        const float v = h == position ? current : history[h];
        if (h == position) history[h] = current;
        largest = max(largest, abs_bits(v));
    }
    largest = __reduce_max_sync(0xffffffffu, largest);
    if (lane == 0) {
        const float reduced = algo == MT_FP8_AMAX_MAX ? __uint_as_float(largest) : current;
        const float s = fp8_scale_from_amax_value(reduced, fp8_max[t], margin, scale[t]);
        scale[t] = s;
        scale_inv[(int64_t)t * scale_inv_stride] = 1.0f / s;
    }
}

/* Delayed scaling after a step, every tensor in one launch (no host round trip):
 *   amax_history [n_tensors, history_len]  a ring per tensor, zeros before the first step;
 *   position                               this step's slot (step % history_len, kept by the caller);
 *   amax [n_tensors]                       the amaxes of this step's casts;
 *   fp8_max [n_tensors]                    the largest value of each tensor's format;
 *   scale, scale_inv [n_tensors]           updated in place (the first step starts from scale 1);
 *                                          scale_inv of tensor t at scale_inv[t * scale_inv_stride]
 *                                          (FP8_SCALE_INV_STRIDE for scale_invs the GEMMs read: see there).
 * The slot's old entry (the oldest) leaves the ring and this step's amax enters it; then
 * amax = the max over the ring (MT_FP8_AMAX_MAX) or this step's (MT_FP8_AMAX_MOST_RECENT), and
 * scale = fp8_max / amax / 2^margin, kept as it was when that amax is 0 or not finite. */
[[maybe_unused]] static bool fp8_scale_update(const mt_exec* ex, float* amax_history, float* scale, float* scale_inv,
                                              const float* amax, const float* fp8_max, int n_tensors, int history_len,
                                              int position, int margin, mt_fp8_amax_algo algo,
                                              int scale_inv_stride = 1) {
    if (n_tensors < 0 || history_len < 1 || position < 0 || position >= history_len || margin < 0)
        return mt_gpu_fail(ex->error, MT_ERR_ARG,
                           "fp8_scale_update: %d tensors, history of %d, position %d, margin %d: need a history of at "
                           "least 1, a position inside it and a margin >= 0",
                           n_tensors, history_len, position, margin);
    if (n_tensors == 0) return true;
    fp8_scale_update_kernel<<<ceil_div(n_tensors, 4), 128, 0, ex->stream>>>(
        amax_history, scale, scale_inv, amax, fp8_max, n_tensors, history_len, position, margin, (int)algo, scale_inv_stride);
    return LAUNCH_CHECK(ex->error);
}

__global__ void fp8_scale_from_amax_kernel(float* scale, float* scale_inv, const float* amax, float fp8_max, int margin) {
    const float s = fp8_scale_from_amax_value(*amax, fp8_max, margin, 1.0f);
    *scale = s;
    *scale_inv = 1.0f / s;
}
/* Current (tensorwise) scaling: *scale = fp8_max / *amax / 2^margin (1 when the amax is 0 or not
 * finite), *scale_inv = 1 / *scale; all three on the device. */
[[maybe_unused]] static void fp8_scale_from_amax(const mt_exec* ex, float* scale, float* scale_inv, const float* amax,
                                                 float fp8_max, int margin) {
    fp8_scale_from_amax_kernel<<<1, 1, 0, ex->stream>>>(scale, scale_inv, amax, fp8_max, margin);
    LAUNCH_CHECK(ex->error);
}

/* ---- per-tensor cast and transpose ---- */

/* The arguments both casts share: rows and cols multiples of 16 (whole 16-byte rows of fp8, the
 * GEMM's K alignment), 16-byte aligned pointers (vector loads and stores). */
[[maybe_unused]] static bool fp8_cast_arguments_ok(const mt_exec* ex, const char* what, const void* x,
                                                   const void* out, const void* out_t, int rows, int cols) {
    if (rows < 0 || cols < 0 || rows % 16 || cols % 16)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: x [%d, %d]: rows and columns must be multiples of 16", what,
                           rows, cols);
    if (!aligned16(x) || !aligned16(out) || !aligned16(out_t))
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: x [%d, %d]: x, out and out_t must be 16-byte aligned", what,
                           rows, cols);
    return true;
}

#define FP8_TILE 64
/* A block casts one 64 x 64 tile of x [rows, cols]: each thread loads 16 bytes of a row, writes its
 * fp8 bytes to out (8 or 4 bytes, a warp covering whole row segments) and to a shared tile; then
 * each thread gathers 8 bytes of a tile column (8 rows) and writes them as 8 bytes of a row of
 * out_t [cols, rows]. The 4-byte row padding of the shared tile turns that gather's 8-way bank
 * conflicts into 2-way ones. amax: the block's largest |x| bits, one atomicMax per block. */
template <mt_fp8_dtype F, typename T>
__global__ void __launch_bounds__(256) fp8_cast_transpose_kernel(uint8_t* out, uint8_t* out_t, float* amax,
                                                                 const T* x, int rows, int cols,
                                                                 const float* scale_ptr) {
    constexpr int V = vec16<T>::N;                        /* elements per 16-byte load: 8 bf16, 4 fp32 */
    constexpr int THREADS_PER_ROW = FP8_TILE / V;         /* 8 or 16 */
    constexpr int ROWS_PER_PASS = 256 / THREADS_PER_ROW;  /* 32 or 16 */
    constexpr int PITCH = FP8_TILE + 4;                   /* bytes per tile row in shared memory */
    __shared__ __align__(16) uint8_t tile[FP8_TILE * PITCH];
    const int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    const int tile_rows = min(FP8_TILE, rows - r0), tile_cols = min(FP8_TILE, cols - c0); /* multiples of 16 */
    const float scale = scale_ptr ? *scale_ptr : 1.0f;
    uint32_t largest = 0;
    const int c = (threadIdx.x % THREADS_PER_ROW) * V;
    if (c < tile_cols)
        for (int r = threadIdx.x / THREADS_PER_ROW; r < tile_rows; r += ROWS_PER_PASS) {
            float v[V];
            load16(v, x + (int64_t)(r0 + r) * cols + c0 + c);
            uint32_t packed[V / 4]; /* 4 fp8 bytes per word, in column order */
#pragma unroll
            for (int i = 0; i < V; i += 4) {
                largest = max(max(largest, max(abs_bits(v[i]), abs_bits(v[i + 1]))),
                              max(abs_bits(v[i + 2]), abs_bits(v[i + 3])));
                packed[i / 4] = fp8x4_scaled<F>(v[i], v[i + 1], v[i + 2], v[i + 3], scale);
            }
#pragma unroll
            for (int i = 0; i < V / 4; i++) *reinterpret_cast<uint32_t*>(&tile[r * PITCH + c + 4 * i]) = packed[i];
            if (out) {
                uint8_t* dst = out + (int64_t)(r0 + r) * cols + c0 + c;
                if constexpr (V == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
                else *reinterpret_cast<uint32_t*>(dst) = packed[0];
            }
        }
    if (amax) {
        largest = block_max_u32(largest);
        if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), largest);
    }
    if (!out_t) return;
    __syncthreads();
    for (int task = threadIdx.x; task < FP8_TILE * (FP8_TILE / 8); task += 256) {
        const int j = task / 8, g = task % 8; /* tile column j, tile rows [8g, 8g + 8) */
        if (j >= tile_cols || 8 * g >= tile_rows) continue;
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo |= (uint32_t)tile[(8 * g + i) * PITCH + j] << (8 * i);
            hi |= (uint32_t)tile[(8 * g + 4 + i) * PITCH + j] << (8 * i);
        }
        *reinterpret_cast<uint2*>(out_t + (int64_t)(c0 + j) * rows + r0 + 8 * g) = make_uint2(lo, hi);
    }
}

/* x [rows, cols] (bf16, fp16, fp32) -> out [rows, cols] = fp8(x * *scale) and out_t [cols, rows] its
 * transpose, in one read of x; either output may be NULL. amax (may be NULL) = max |x| of this
 * tensor, or with accumulate_amax max(amax, max |x|) (delayed scaling: the step's largest over its
 * micro-batches, entered into the history after the step). rows and cols must be
 * multiples of 16 and the pointers 16-byte aligned, else an MT_ERR_ARG error is recorded and false
 * returned, nothing queued. scale, amax: device, one float each. */
template <typename T>
static bool fp8_cast_transpose(const mt_exec* ex, mt_fp8_dtype fmt, uint8_t* out, uint8_t* out_t, const T* x,
                               int rows, int cols, const float* scale, float* amax, bool accumulate_amax = false) {
    if (!fp8_cast_arguments_ok(ex, "fp8_cast_transpose", x, out, out_t, rows, cols)) return false;
    if ((out || out_t) && !scale) return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_cast_transpose: no scale");
    if (amax && !accumulate_amax && !CUDA_CHECK(ex->error, cudaMemsetAsync(amax, 0, sizeof(float), ex->stream)))
        return false;
    if (rows == 0 || cols == 0 || (!out && !out_t && !amax)) return true;
    const dim3 grid(ceil_div(cols, FP8_TILE), ceil_div(rows, FP8_TILE));
    if (grid.y > 65535) return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_cast_transpose: %d rows are too many", rows);
    if (fmt == FP8_E4M3)
        fp8_cast_transpose_kernel<FP8_E4M3, T><<<grid, 256, 0, ex->stream>>>(out, out_t, amax, x, rows, cols, scale);
    else
        fp8_cast_transpose_kernel<FP8_E5M2, T><<<grid, 256, 0, ex->stream>>>(out, out_t, amax, x, rows, cols, scale);
    return LAUNCH_CHECK(ex->error);
}

/* Current (tensorwise) scaling of one tensor, Megatron's --fp8-recipe tensorwise: s->amax = max |x|,
 * s->scale = fp8_max / amax / 2^margin (1 for an all-zero or non-finite x), s->scale_inv, then the
 * cast of x [rows, cols] into out and out_t (either may be NULL) with that scale: two reads of x. */
template <typename T>
static bool fp8_quantize_tensorwise(const mt_exec* ex, mt_fp8_dtype fmt, const mt_fp8_scaling* s, int margin,
                                    uint8_t* out, uint8_t* out_t, const T* x, int rows, int cols) {
    if (!fp8_cast_arguments_ok(ex, "fp8_quantize_tensorwise", x, out, out_t, rows, cols)) return false;
    fp8_amax(ex, s->amax, x, (int64_t)rows * cols);
    fp8_scale_from_amax(ex, s->scale, s->scale_inv, s->amax, fp8_max_value(fmt), margin);
    return fp8_cast_transpose(ex, fmt, out, out_t, x, rows, cols, s->scale, NULL);
}

/* ---- transpose of FP8 bytes ---- */

/* A block moves one 32 x 32 tile of in [rows, cols] through shared memory (a padded row against
 * bank conflicts) to out [cols, rows]; both reads and writes run along rows. */
__global__ void fp8_transpose_kernel(uint8_t* out, const uint8_t* in, int rows, int cols) {
    __shared__ uint8_t tile[32][33];
    const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
    for (int j = threadIdx.y; j < 32; j += blockDim.y)
        if (r0 + j < rows && c0 + (int)threadIdx.x < cols)
            tile[j][threadIdx.x] = in[(int64_t)(r0 + j) * cols + c0 + threadIdx.x];
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y)
        if (c0 + j < cols && r0 + (int)threadIdx.x < rows)
            out[(int64_t)(c0 + j) * rows + r0 + threadIdx.x] = tile[threadIdx.x][j];
}

/* out [cols, rows] = the bytes of in [rows, cols] transposed: with a per-tensor scale the transpose
 * of an FP8 tensor is its bytes moved, bit for bit what casting the transposed tensor gives. */
static bool fp8_transpose(const mt_exec* ex, uint8_t* out, const uint8_t* in, int rows, int cols) {
    if (rows < 0 || cols < 0 || (rows + 31) / 32 > 65535)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_transpose: [%d, %d] is not a shape it takes", rows, cols);
    if (rows == 0 || cols == 0) return true;
    fp8_transpose_kernel<<<dim3(ceil_div(cols, 32), ceil_div(rows, 32)), dim3(32, 8), 0, ex->stream>>>(out, in, rows, cols);
    return LAUNCH_CHECK(ex->error);
}

/* ---- blockwise cast ---- */

#define FP8_BLOCK 128
/* The scale of one block: fp8_max / amax (1 for an all-zero or non-finite block), optionally rounded
 * down to a power of two. */
__device__ __forceinline__ float fp8_block_scale(uint32_t amax_bits, float fp8_max, int power_of_2) {
    const float s = fp8_scale_from_amax_value(__uint_as_float(amax_bits), fp8_max, 0, 1.0f);
    return power_of_2 ? fp8_scale_power_of_2_below(s) : s;
}

/* A block takes one 128 x 128 block of x [rows, cols] (smaller at the edges) into shared memory
 * (row pitch 128 + 4 bytes' worth of elements: the column reads below are free of bank conflicts).
 * Rows: warp w casts rows w, w + 8, ...; lane l columns [4l, 4l + 4), written as 4 bytes of out; in
 * 1x128 mode the row's scale comes from a warp max. Columns (out_t): warp w casts tile columns w, w +
 * 8, ...; lane l rows l, l + 32, l + 64, l + 96, one byte each of a row of out_t [cols, rows]; in
 * 1x128 mode the column's scale (a 1x128 block of x^T) from a warp max. In 128x128 mode one scale
 * for the whole block, from a block max, and out_t holds exactly the transposed bytes of out. */
template <mt_fp8_dtype F, typename T, bool BLOCKS_128x128>
__global__ void __launch_bounds__(256) fp8_cast_blockwise_kernel(uint8_t* out, uint8_t* out_t, float* scale_inv,
                                                                 float* scale_inv_t, const T* x, int rows, int cols,
                                                                 int power_of_2) {
    constexpr int V = vec16<T>::N, PITCH = FP8_BLOCK + 4 / (int)sizeof(T);
    constexpr float FP8_MAX = F == FP8_E4M3 ? 448.0f : 57344.0f;
    extern __shared__ __align__(16) unsigned char fp8_blockwise_shared[];
    T* tile = reinterpret_cast<T*>(fp8_blockwise_shared); /* [128][PITCH] */
    __shared__ float tile_scale;
    const int rb = blockIdx.y, cb = blockIdx.x, r0 = rb * FP8_BLOCK, c0 = cb * FP8_BLOCK;
    const int tile_rows = min(FP8_BLOCK, rows - r0), tile_cols = min(FP8_BLOCK, cols - c0); /* multiples of 16 */
    uint32_t largest = 0;
    const int c = (threadIdx.x % (FP8_BLOCK / V)) * V;
    if (c < tile_cols)
        for (int r = threadIdx.x / (FP8_BLOCK / V); r < tile_rows; r += 256 / (FP8_BLOCK / V)) {
            const int4 raw = *reinterpret_cast<const int4*>(x + (int64_t)(r0 + r) * cols + c0 + c);
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < V; i++) {
                tile[r * PITCH + c + i] = e[i];
                largest = max(largest, abs_bits(to_float(e[i])));
            }
        }
    if (BLOCKS_128x128) {
        largest = block_max_u32(largest);
        if (threadIdx.x == 0) {
            const float s = fp8_block_scale(largest, FP8_MAX, power_of_2);
            tile_scale = s;
            /* the 128x128 layouts' leading dimensions: block counts rounded up to multiples of 4 */
            const int ld = (cols + 4 * FP8_BLOCK - 1) / (4 * FP8_BLOCK) * 4;
            const int ld_t = (rows + 4 * FP8_BLOCK - 1) / (4 * FP8_BLOCK) * 4;
            if (scale_inv) scale_inv[(int64_t)rb * ld + cb] = 1.0f / s;
            if (scale_inv_t) scale_inv_t[(int64_t)cb * ld_t + rb] = 1.0f / s;
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (out)
        for (int r = warp; r < tile_rows; r += 8) {
            const bool mine = 4 * lane < tile_cols;
            float v[4];
            uint32_t row_largest = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[i] = mine ? to_float(tile[r * PITCH + 4 * lane + i]) : 0.0f;
                row_largest = max(row_largest, abs_bits(v[i]));
            }
            float s;
            if (BLOCKS_128x128) {
                s = tile_scale;
            } else {
                s = fp8_block_scale(__reduce_max_sync(0xffffffffu, row_largest), FP8_MAX, power_of_2);
                if (lane == 0) scale_inv[(int64_t)cb * rows + r0 + r] = 1.0f / s;
            }
            if (mine)
                *reinterpret_cast<uint32_t*>(out + (int64_t)(r0 + r) * cols + c0 + 4 * lane) =
                    fp8x2_from_float<F>(v[0] * s, v[1] * s) | fp8x2_from_float<F>(v[2] * s, v[3] * s) << 16;
        }
    if (out_t)
        for (int cc = warp; cc < tile_cols; cc += 8) {
            float v[4];
            uint32_t column_largest = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int r = lane + 32 * k;
                v[k] = r < tile_rows ? to_float(tile[r * PITCH + cc]) : 0.0f;
                column_largest = max(column_largest, abs_bits(v[k]));
            }
            float s;
            if (BLOCKS_128x128) {
                s = tile_scale;
            } else {
                s = fp8_block_scale(__reduce_max_sync(0xffffffffu, column_largest), FP8_MAX, power_of_2);
                if (lane == 0) scale_inv_t[(int64_t)rb * cols + c0 + cc] = 1.0f / s;
            }
            uint8_t* column = out_t + (int64_t)(c0 + cc) * rows + r0; /* the row of out_t [cols, rows] */
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (lane + 32 * k < tile_rows) column[lane + 32 * k] = fp8_from_float<F>(v[k] * s);
        }
}

/* Blockwise scaling (Megatron's --fp8-recipe blockwise): x [rows, cols] (bf16, fp16, fp32) ->
 *   out [rows, cols] with scale_inv in `blocks`' layout for a tensor [rows, cols] (mt_fp8_scaling_mode;
 *     fp8_scale_inv_count floats);
 *   out_t [cols, rows] with scale_inv_t in that layout for a tensor [cols, rows]: with 1x128 blocks
 *     out_t is x^T cast in 1x128 blocks of its own rows (128 rows of x per block), the operand of
 *     the weight-gradient GEMM; with 128x128 blocks it is out transposed (W^T for the input gradient).
 * Each block's scale is fp8_max / its amax (1 for an all-zero or non-finite block), rounded down to a
 * power of two when power_of_2_scales; scale_inv = 1 / scale. Either (out, scale_inv) or
 * (out_t, scale_inv_t) may be (NULL, NULL). rows and cols multiples of 16, pointers 16-byte aligned. */
template <typename T>
static bool fp8_cast_blockwise(const mt_exec* ex, mt_fp8_dtype fmt, uint8_t* out, uint8_t* out_t, float* scale_inv,
                               float* scale_inv_t, const T* x, int rows, int cols, mt_fp8_scaling_mode blocks,
                               bool power_of_2_scales) {
    if (!fp8_cast_arguments_ok(ex, "fp8_cast_blockwise", x, out, out_t, rows, cols)) return false;
    if (blocks != FP8_BLOCKS_1x128 && blocks != FP8_BLOCKS_128x128)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_cast_blockwise: blocks must be 1x128 or 128x128");
    if (!out != !scale_inv || !out_t != !scale_inv_t)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_cast_blockwise: each output needs its scale_inv and vice versa");
    if (rows == 0 || cols == 0 || (!out && !out_t)) return true;
    const dim3 grid(ceil_div(cols, FP8_BLOCK), ceil_div(rows, FP8_BLOCK));
    if (grid.y > 65535) return mt_gpu_fail(ex->error, MT_ERR_ARG, "fp8_cast_blockwise: %d rows are too many", rows);
    typedef void (*kernel_t)(uint8_t*, uint8_t*, float*, float*, const T*, int, int, int);
    const bool e4m3 = fmt == FP8_E4M3, square = blocks == FP8_BLOCKS_128x128;
    const kernel_t kernel = e4m3 ? (square ? fp8_cast_blockwise_kernel<FP8_E4M3, T, true>
                                          : fp8_cast_blockwise_kernel<FP8_E4M3, T, false>)
                                 : (square ? fp8_cast_blockwise_kernel<FP8_E5M2, T, true>
                                           : fp8_cast_blockwise_kernel<FP8_E5M2, T, false>);
    const int shared_bytes = FP8_BLOCK * (FP8_BLOCK + 4 / (int)sizeof(T)) * (int)sizeof(T); /* 33 KB bf16, 66 KB fp32 */
    if (!CUDA_CHECK(ex->error, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes)))
        return false;
    kernel<<<grid, 256, shared_bytes, ex->stream>>>(out, out_t, scale_inv, scale_inv_t, x, rows, cols, power_of_2_scales);
    return LAUNCH_CHECK(ex->error);
}

/* ---- the parameter storage's FP8 weights (--fp8-param-gather) ----
 * After a step each DP rank writes its shard of the parameter storage from its fp32 master weights
 * (section 19, fp8_publish_parameters, says why and gathers them): a block per optimizer chunk
 * (mt_opt_chunk), a bf16 parameter as bf16(master), an FP8 weight as e4m3(float(bf16(master)) x
 * scale[weight]), bitwise the cast the run without the flag makes from the bf16 copy. */
typedef struct fp8_publish_chunk {
    int64_t storage; /* byte offset of the optimizer chunk's first element in the parameter storage */
    int32_t weight;  /* an FP8 weight's scaling slot (FP8_W of its linear), -1 for a bf16 parameter */
    int32_t unused;
} fp8_publish_chunk;
static_assert(sizeof(fp8_publish_chunk) == MT_PUBLISH_CHUNK_BYTES, "the memory plan counts fp8_publish_chunk's bytes");

/* The bf16 rounding of a master weight: what the model copy holds and the FP8 cast starts from. */
__device__ __forceinline__ float fp8_publish_value(float master) {
    return to_float(from_float<__nv_bfloat16>(master));
}

/* Tensorwise: amax[weight] = max(amax[weight], the chunk's largest |bf16(master)|) per FP8 chunk. */
__global__ void __launch_bounds__(256) fp8_publish_amax_kernel(float* amax, const mt_opt_chunk* chunks,
                                                               const fp8_publish_chunk* publish, const float* master) {
    const mt_opt_chunk c = chunks[blockIdx.x];
    const int weight = publish[blockIdx.x].weight;
    if (weight < 0) return; /* the whole block */
    uint32_t largest = 0;
    for (int i = threadIdx.x; i < c.length; i += blockDim.x)
        largest = max(largest, abs_bits(fp8_publish_value(master[c.master + i])));
    largest = block_max_u32(largest);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax + weight), largest);
}

/* amax [num_tensors] zeroed, then each FP8 weight slot's amax = the largest |bf16(master)| of its
 * chunks among chunks [num_chunks] (num_chunks >= 1; publish [num_chunks] places them). */
static void fp8_publish_amax(const mt_exec* ex, float* amax, int num_tensors, const mt_opt_chunk* chunks,
                             const fp8_publish_chunk* publish, int num_chunks, const float* master) {
    CUDA_CHECK(ex->error, cudaMemsetAsync(amax, 0, sizeof(float) * (size_t)num_tensors, ex->stream));
    fp8_publish_amax_kernel<<<num_chunks, 256, 0, ex->stream>>>(amax, chunks, publish, master);
    LAUNCH_CHECK(ex->error);
}

/* Tensorwise: the scale and scale_inv of slots FIRST, FIRST + STRIDE, ... below num_tensors from
 * their amaxes (fp8_scale_from_amax's rule). */
template <int STRIDE, int FIRST>
__global__ void fp8_strided_scales_kernel(float* scale, float* scale_inv, const float* amax, const float* fp8_max,
                                          int num_tensors, int margin) {
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) * STRIDE + FIRST;
    if (t >= num_tensors) return;
    const float s = fp8_scale_from_amax_value(amax[t], fp8_max[t], margin, 1.0f);
    scale[t] = s;
    scale_inv[(int64_t)t * FP8_SCALE_INV_STRIDE] = 1.0f / s;
}

/* Current (tensorwise) scaling of every STRIDE-th slot from FIRST (section 19: every linear's weight
 * slot) of the per-tensor arrays [num_tensors] (num_tensors >= 1): scale = fp8_max / amax / 2^margin
 * (1 when the amax is 0 or not finite), scale_inv (FP8_SCALE_INV_STRIDE floats apart) = 1 / scale. */
template <int STRIDE, int FIRST>
static void fp8_strided_scales_from_amax(const mt_exec* ex, float* scale, float* scale_inv, const float* amax,
                                         const float* fp8_max, int num_tensors, int margin) {
    const int slots = num_tensors / STRIDE;
    fp8_strided_scales_kernel<STRIDE, FIRST><<<ceil_div(slots, 128), 128, 0, ex->stream>>>(scale, scale_inv, amax,
                                                                                           fp8_max, num_tensors, margin);
    LAUNCH_CHECK(ex->error);
}

/* A block per optimizer chunk: its elements into the storage, bf16(master) or for an FP8 weight
 * e4m3(float(bf16(master)) x scale[weight]); delayed scaling records the chunk's amax. */
__global__ void __launch_bounds__(256) fp8_publish_kernel(uint8_t* storage, const mt_opt_chunk* chunks,
                                                          const fp8_publish_chunk* publish, const float* master,
                                                          const float* scale, float* amax, int record_amax) {
    const mt_opt_chunk c = chunks[blockIdx.x];
    const fp8_publish_chunk p = publish[blockIdx.x];
    if (p.weight < 0) {
        __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(storage + p.storage);
        for (int i = threadIdx.x; i < c.length; i += blockDim.x) out[i] = from_float<__nv_bfloat16>(master[c.master + i]);
        return;
    }
    const float s = scale[p.weight];
    uint8_t* out = storage + p.storage;
    uint32_t largest = 0;
    for (int i = threadIdx.x; i < c.length; i += blockDim.x) {
        const float v = fp8_publish_value(master[c.master + i]);
        largest = max(largest, abs_bits(v));
        out[i] = fp8_from_float<FP8_E4M3>(v * s);
    }
    if (!record_amax) return;
    largest = block_max_u32(largest);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax + p.weight), largest);
}

/* The chunks [num_chunks] (num_chunks >= 1) of master written into storage at publish's places;
 * record_amax (delayed scaling): amax[weight] also takes each FP8 chunk's largest |bf16(master)|. */
static void fp8_publish(const mt_exec* ex, uint8_t* storage, const mt_opt_chunk* chunks,
                        const fp8_publish_chunk* publish, int num_chunks, const float* master, const float* scale,
                        float* amax, int record_amax) {
    fp8_publish_kernel<<<num_chunks, 256, 0, ex->stream>>>(storage, chunks, publish, master, scale, amax, record_amax);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 13. GEMM                                                                                       */
/*    Row-major C[M,N] = op(A) op(B) through cuBLASLt (column-major underneath), A and B in the   */
/*    model type, C in the model type or fp32 (weight gradients accumulate straight into the fp32 */
/*    gradient buffer with beta = 1), always fp32 accumulation, batched by strides. Each distinct */
/*    GEMM (shapes, types, pointer alignment, epilogue, FP8 scaling) gets a plan once:            */
/*    descriptors, layouts and the heuristic's algorithm, cached for the trainer's life           */
/*    (mt_gemm_plans). Epilogues fuse bias + GELU into the first MLP GEMM (keeping the pre-       */
/*    activation as cuBLASLt's aux output) and GELU's derivative into the second MLP GEMM's input */
/*    gradient. FP8 (gemm_fp8): both operands stored with rows along K, the only layout Hopper's  */
/*    FP8 tensor cores take ("TN" in cuBLASLt's column-major terms), E4M3 x E4M3 or E4M3 x E5M2,  */
/*    their scale_inv (per tensor, or per 1x128 or 128x128 block, section 12) applied by cuBLASLt */
/*    to the fp32-accumulated product, C in bf16 or fp32. gemm_uncached: the plain GEMM without a */
/*    plan (cuBLAS's own), for shapes that change every step (the experts' row counts);           */
/*    gemm_grouped: many such GEMMs in one cuBLAS grouped call.                                    */
/*    defines: mt_gemm_plans, mt_gemm_epilogue, gemm, gemm_uncached, gemm_grouped, gemm_epilogue, */
/*    gemm_fp8, gemm_plans_free.                                                                  */
/* ============================================================================================== */

typedef enum {
    GEMM_PLAIN = 0,
    GEMM_BIAS,          /* D = AB + bias */
    GEMM_GELU_AUX_BIAS, /* D = gelu(AB + bias), aux = AB + bias (bias may be absent) */
    GEMM_DGELU,         /* D = AB * gelu'(aux) */
    GEMM_DGELU_BGRAD,   /* D = AB * gelu'(aux), and bias = the column sums of D (fp32, [N], before D's
                           rounding): GELU's input gradient and the bias gradient of the linear before it */
    GEMM_BGRADB,        /* D = AB (+ beta C), and bias = the sums of B over k (fp32): a weight gradient and
                           the bias gradient from the same read of the output gradient */
} mt_gemm_epilogue;

/* What makes two GEMMs the same plan (memset to 0 before filling, compared with memcmp). */
typedef struct {
    int transA, transB, M, N, K, lda, ldb, ldc, batch;
    int epilogue, has_bias, alignment;
    int a_type, b_type, c_type; /* cudaDataType_t of our A, our B and C */
    int fp8;                    /* gemm_fp8: operands scaled as below, fast_accumulate as asked */
    int a_scaling, b_scaling;   /* mt_fp8_scaling_mode of our A and our B */
    int fast_accumulate;
    int64_t strideA, strideB, strideC;
} mt_gemm_key;

typedef struct {
    mt_gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    int supported; /* the heuristic found an algorithm */
    cublasStatus_t heuristic_status; /* what the heuristic said, and how many algorithms it found */
    int algorithms_found;
} mt_gemm_plan;

#define GEMM_MAX_PLANS 256
/* Section 13.1's probe of this GPU, made once (hopper_gemm_available): state 0 not yet, 1 the Hopper grouped
 * GEMM runs here, -1 it does not; then the SM count and the driver's cuTensorMapEncodeTiled. */
typedef struct mt_hopper_gemm_state {
    int state;
    int sms;
    void* encode;
    int attn; /* section 13.2's attention forward: 0 not yet probed, 1 it runs here, -1 it does not */
    int attn_bwd; /* section 13.3's attention backward, likewise */
} mt_hopper_gemm_state;

/* The handles, the workspace and the plan cache (mt_exec.gemm points here; the stream and the
 * error record come with the mt_exec of each call). */
struct mt_gemm_plans {
    cublasLtHandle_t lt;
    cublasHandle_t handle;   /* plain cuBLAS, for a GEMM cuBLASLt has no algorithm for */
    void* workspace;
    size_t workspace_bytes;
    mt_gemm_plan* plans;     /* [GEMM_MAX_PLANS] */
    int num_plans;
    mt_hopper_gemm_state hopper; /* section 13.1 */
};

/* The largest power of two (<= 256) that divides the address. */
static int pointer_alignment(const void* p) {
    uintptr_t x = (uintptr_t)p;
    int a = 256;
    while (a > 1 && (x % a)) a >>= 1;
    return a;
}

/* cuBLASLt's name for an FP8 operand's scaling */
static int32_t fp8_cublaslt_scale_mode(int scaling) {
    return scaling == FP8_BLOCKS_1x128     ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
           : scaling == FP8_BLOCKS_128x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                           : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

/* Builds the plan of a key: the row-major problem is the column-major C^T[N,M] = op(B)^T op(A)^T,
 * so cuBLASLt's "A" is our B and its "B" our A (FP8: its A scale is our B's, its B scale our A's;
 * the scale pointers are set before the heuristic, which may look at them, and again at each call).
 * A failing descriptor call records its status and leaves the plan unsupported. */
static void gemm_plan_build(mt_gemm_plans* g, mt_gpu_error* e, mt_gemm_plan* p, const float* fp8_a_scale_inv = NULL,
                            const float* fp8_b_scale_inv = NULL) {
    const mt_gemm_key* k = &p->key;
    cudaDataType_t at = (cudaDataType_t)k->a_type, bt = (cudaDataType_t)k->b_type, ct = (cudaDataType_t)k->c_type;
    cublasOperation_t opA = k->transB ? CUBLAS_OP_T : CUBLAS_OP_N, opB = k->transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (!CUBLAS_CHECK(e, cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F))) return;
    CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
    CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
    if (k->fp8) {
        const int32_t lt_a_mode = fp8_cublaslt_scale_mode(k->b_scaling); /* cuBLASLt's A is our B */
        const int32_t lt_b_mode = fp8_cublaslt_scale_mode(k->a_scaling);
        if (k->b_scaling != FP8_PER_TENSOR)
            CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &lt_a_mode,
                                                           sizeof(lt_a_mode)));
        if (k->a_scaling != FP8_PER_TENSOR)
            CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &lt_b_mode,
                                                           sizeof(lt_b_mode)));
        CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &fp8_b_scale_inv,
                                                       sizeof(fp8_b_scale_inv)));
        CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &fp8_a_scale_inv,
                                                       sizeof(fp8_a_scale_inv)));
        const int8_t fast = (int8_t)k->fast_accumulate;
        CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
        if (k->has_bias) { /* FP8 GEMMs with a bf16 or fp32 output take a bf16 bias */
            const cudaDataType_t bias_type = CUDA_R_16BF;
            CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                           sizeof(bias_type)));
        }
    }
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    if (k->epilogue == GEMM_GELU_AUX_BIAS) epi = k->has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    if (k->epilogue == GEMM_DGELU) epi = CUBLASLT_EPILOGUE_DGELU;
    if (k->epilogue == GEMM_DGELU_BGRAD) epi = CUBLASLT_EPILOGUE_DGELU_BGRAD;
    if (k->epilogue == GEMM_BIAS) epi = CUBLASLT_EPILOGUE_BIAS;
    /* our A is cuBLASLt's B (see above): the sums of our A over k */
    if (k->epilogue == GEMM_BGRADB) epi = CUBLASLT_EPILOGUE_BGRADB;
    CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    if (k->epilogue == GEMM_BGRADB || k->epilogue == GEMM_DGELU_BGRAD) {
        cudaDataType_t bias_type = CUDA_R_32F;
        CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                       sizeof(bias_type)));
    }
    if (k->epilogue == GEMM_GELU_AUX_BIAS || k->epilogue == GEMM_DGELU || k->epilogue == GEMM_DGELU_BGRAD) {
        int64_t aux_ld = k->ldc;
        CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                                       sizeof(aux_ld)));
        if (k->fp8) { /* FP8 operands: the aux (GELU's input) is bf16, like C */
            const cudaDataType_t aux_type = CUDA_R_16BF;
            CUBLAS_CHECK(e, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type,
                                                           sizeof(aux_type)));
        }
    }
    /* stored shapes (column-major rows x cols) */
    uint64_t a_rows = k->transB ? k->K : k->N, a_cols = k->transB ? k->N : k->K;
    uint64_t b_rows = k->transA ? k->M : k->K, b_cols = k->transA ? k->K : k->M;
    CUBLAS_CHECK(e, cublasLtMatrixLayoutCreate(&p->a, bt, a_rows, a_cols, k->ldb));
    CUBLAS_CHECK(e, cublasLtMatrixLayoutCreate(&p->b, at, b_rows, b_cols, k->lda));
    CUBLAS_CHECK(e, cublasLtMatrixLayoutCreate(&p->c, ct, k->N, k->M, k->ldc));
    if (k->batch > 1) {
        struct { cublasLtMatrixLayout_t l; int64_t stride; } batched[3] = {{p->a, k->strideB}, {p->b, k->strideA}, {p->c, k->strideC}};
        for (int i = 0; i < 3; i++) {
            int32_t count = k->batch;
            CUBLAS_CHECK(e, cublasLtMatrixLayoutSetAttribute(batched[i].l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                             sizeof(count)));
            CUBLAS_CHECK(e, cublasLtMatrixLayoutSetAttribute(batched[i].l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                             &batched[i].stride, sizeof(int64_t)));
        }
    }
    if (e->status != MT_OK) return; /* a descriptor or layout call above failed (recorded) */
    cublasLtMatmulPreference_t pref;
    if (!CUBLAS_CHECK(e, cublasLtMatmulPreferenceCreate(&pref))) return;
    uint64_t ws = g->workspace_bytes;
    uint32_t align = (uint32_t)k->alignment;
    CUBLAS_CHECK(e, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulPreferenceAttributes_t aligns[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++) CUBLAS_CHECK(e, cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof(align)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
    CUBLAS_CHECK(e, cublasLtMatmulPreferenceDestroy(pref));
    p->heuristic_status = st; /* not an error here: the caller decides (a fallback, or gemm_fp8's message) */
    p->algorithms_found = found;
    p->supported = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (p->supported) p->algo = result.algo;
}

static void gemm_plans_free(mt_gemm_plans* g) {
    for (int i = 0; g->plans && i < g->num_plans; i++) {
        mt_gemm_plan* p = &g->plans[i];
        if (p->desc) cublasLtMatmulDescDestroy(p->desc);
        if (p->a) cublasLtMatrixLayoutDestroy(p->a);
        if (p->b) cublasLtMatrixLayoutDestroy(p->b);
        if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    }
    free(g->plans);
    g->plans = NULL;
    g->num_plans = 0;
}

/* The plan of a GEMM whose key is filled in but for its alignment: that becomes the largest power of
 * two (<= 256) dividing A and every other pointer given (B, C, bias, aux; NULL: none), then the cached
 * plan of the key, or a new one built and cached (FP8: with the scale_inv pointers the heuristic may
 * look at). NULL when the cache is full (GEMM_MAX_PLANS). */
static mt_gemm_plan* gemm_plan_lookup(const mt_exec* ex, mt_gemm_key* key, const void* A, const void* B, const void* C,
                                      const void* bias, const void* aux, const float* fp8_a_scale_inv = NULL,
                                      const float* fp8_b_scale_inv = NULL) {
    mt_gemm_plans* g = ex->gemm;
    int align = pointer_alignment(A);
    const void* others[4] = {B, C, bias, aux};
    for (int i = 0; i < 4; i++)
        if (others[i] && pointer_alignment(others[i]) < align) align = pointer_alignment(others[i]);
    key->alignment = align;
    for (int i = 0; i < g->num_plans; i++)
        if (!memcmp(&g->plans[i].key, key, sizeof(*key))) return &g->plans[i];
    if (g->num_plans >= GEMM_MAX_PLANS) return NULL;
    mt_gemm_plan* plan = &g->plans[g->num_plans++];
    memset(plan, 0, sizeof(*plan));
    plan->key = *key;
    gemm_plan_build(g, ex->error, plan, fp8_a_scale_inv, fp8_b_scale_inv);
    return plan;
}

/* The plain GEMM of gemm() below (same arguments, row-major) through cuBLAS's own cublasGemmStridedBatchedEx,
 * without a cuBLASLt plan: where gemm_epilogue has none, and for the experts' GEMMs of a mixture of experts
 * (section 14), whose row counts change with every routing and would fill the plan cache. */
template <typename T, typename TC>
static void gemm_uncached(const mt_exec* ex, bool transA, bool transB, int M, int N, int K, const T* A, int lda,
                          const T* B, int ldb, TC* C, int ldc, float alpha, float beta, int batch = 1,
                          int64_t strideA = 0, int64_t strideB = 0, int64_t strideC = 0) {
    mt_gemm_plans* g = ex->gemm;
    if (ex->error->status != MT_OK) return;
    CUBLAS_CHECK(ex->error, cublasSetStream(g->handle, ex->stream));
    cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(ex->error, cublasGemmStridedBatchedEx(g->handle, opB, opA, N, M, K, &alpha, B, cuda_type<T>(), ldb,
                                                      strideB, A, cuda_type<T>(), lda, strideA, &beta, C,
                                                      cuda_type<TC>(), ldc, strideC, batch, CUBLAS_COMPUTE_32F,
                                                      CUBLAS_GEMM_DEFAULT));
}

/* A group of independent row-major GEMMs C_g[M_g, N_g] = op(A_g) op(B_g) + beta C_g (shared transposes,
 * alpha 1) in one cuBLAS call, cublasGemmGroupedBatchedEx: the experts' GEMMs of a mixture of experts, whose
 * row counts differ per expert and per step. The shapes are host arrays read during the call; the matrix
 * pointers must be in device memory: they are staged through `staging` (pinned host, 3 x groups pointers)
 * into `table` (device, the same), whose previous contents must no longer be in use by the stream (the
 * caller synchronises between reuses). Groups of 0 rows must be left out by the caller. */
template <typename T, typename TC>
static void gemm_grouped(const mt_exec* ex, int groups, bool transA, bool transB, const int* M, const int* N,
                         const int* K, const T* const* A, const int* lda, const T* const* B, const int* ldb,
                         TC* const* C, const int* ldc, float beta, const void** staging, const void** table) {
    mt_gemm_plans* g = ex->gemm;
    if (ex->error->status != MT_OK || groups <= 0) return;
    /* cuBLAS is column-major: the row-major C = op(A) op(B) is C^T = op(B)^T op(A)^T, B first */
    for (int i = 0; i < groups; i++) staging[i] = B[i], staging[groups + i] = A[i], staging[2 * groups + i] = C[i];
    if (!CUDA_CHECK(ex->error, cudaMemcpyAsync((void*)table, (const void*)staging, sizeof(void*) * 3 * (size_t)groups,
                                               cudaMemcpyHostToDevice, ex->stream)))
        return;
    int* dims = (int*)malloc(sizeof(int) * 7 * (size_t)groups);
    float* scalars = (float*)malloc(sizeof(float) * 2 * (size_t)groups);
    cublasOperation_t* ops = (cublasOperation_t*)malloc(sizeof(cublasOperation_t) * 2 * (size_t)groups);
    if (!dims || !scalars || !ops) {
        free(dims), free(scalars), free(ops);
        mt_gpu_fail(ex->error, MT_ERR_OOM, "grouped GEMM: cannot allocate the shape arrays of %d groups", groups);
        return;
    }
    for (int i = 0; i < groups; i++) {
        dims[i] = N[i], dims[groups + i] = M[i], dims[2 * groups + i] = K[i];
        dims[3 * groups + i] = ldb[i], dims[4 * groups + i] = lda[i], dims[5 * groups + i] = ldc[i];
        dims[6 * groups + i] = 1; /* one GEMM per group */
        scalars[i] = 1.0f, scalars[groups + i] = beta;
        ops[i] = transB ? CUBLAS_OP_T : CUBLAS_OP_N, ops[groups + i] = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    }
    CUBLAS_CHECK(ex->error, cublasSetStream(g->handle, ex->stream));
    CUBLAS_CHECK(ex->error, cublasGemmGroupedBatchedEx(g->handle, ops, ops + groups, dims, dims + groups, dims + 2 * groups,
                                                      scalars, table, cuda_type<T>(), dims + 3 * groups, table + groups,
                                                      cuda_type<T>(), dims + 4 * groups, scalars + groups,
                                                      (void* const*)(table + 2 * groups), cuda_type<TC>(),
                                                      dims + 5 * groups, groups, dims + 6 * groups, CUBLAS_COMPUTE_32F));
    free(dims), free(scalars), free(ops);
}

/* A cuBLAS handle as every handle of the trainer is set up (the compute stream's, gemm_context_create, and the
 * experts' side streams', section 17): on `stream`, default math (fp32 stays fp32: no TF32, Megatron's fp32
 * default, so parity with a float64 reference holds), `workspace` (workspace_bytes, its own: two handles never
 * share one) as its workspace. The same set-up on every handle gives cuBLAS's heuristic the same inputs, so a
 * GEMM picks the same algorithm whichever handle and stream it runs on. */
static void gemm_handle_create(mt_gpu_error* e, cublasHandle_t* handle, cudaStream_t stream, void* workspace,
                               size_t workspace_bytes) {
    if (!CUBLAS_CHECK(e, cublasCreate(handle))) return;
    CUBLAS_CHECK(e, cublasSetStream(*handle, stream));
    CUBLAS_CHECK(e, cublasSetMathMode(*handle, CUBLAS_DEFAULT_MATH));
    if (workspace) CUBLAS_CHECK(e, cublasSetWorkspace(*handle, workspace, workspace_bytes));
}

/* Row-major: C[M,N] (ldc) = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, where op(A) = A ([M,K], lda)
 * or A^T (A stored [K,M]); likewise B; with an epilogue (bias [N] of type T, or with GEMM_BGRADB the
 * fp32 output [M]: sums of op(A) over k, with GEMM_DGELU_BGRAD the fp32 output [N]: sums of C's
 * columns; aux [M,N] with ld ldc). Returns
 * false, doing nothing, when cuBLASLt has no algorithm for an epilogue (the caller then runs the
 * plain GEMM and its own kernels); a plain GEMM without one goes to cublasGemmEx. */
template <typename T, typename TC>
static bool gemm_epilogue(const mt_exec* ex, mt_gemm_epilogue epilogue, bool transA, bool transB, int M, int N,
                          int K, const T* A, int lda, const T* B, int ldb, TC* C, int ldc, float alpha, float beta,
                          const void* bias, T* aux, int batch = 1, int64_t strideA = 0, int64_t strideB = 0,
                          int64_t strideC = 0) {
    mt_gemm_plans* g = ex->gemm;
    if (ex->error->status != MT_OK) return true;
    mt_gemm_key key;
    memset(&key, 0, sizeof(key));
    key.transA = transA; key.transB = transB; key.M = M; key.N = N; key.K = K;
    key.lda = lda; key.ldb = ldb; key.ldc = ldc; key.batch = batch;
    key.strideA = strideA; key.strideB = strideB; key.strideC = strideC;
    key.epilogue = epilogue; key.has_bias = bias != NULL;
    key.a_type = key.b_type = cuda_type<T>(); key.c_type = cuda_type<TC>();
    mt_gemm_plan* plan = gemm_plan_lookup(ex, &key, A, B, C, bias, aux);
    if (plan && plan->supported) {
        if (bias) CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                        &bias, sizeof(bias)));
        if (aux) CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                                       &aux, sizeof(aux)));
        CUBLAS_CHECK(ex->error, cublasLtMatmul(g->lt, plan->desc, &alpha, B, plan->a, A, plan->b, &beta, C, plan->c, C,
                                              plan->c, &plan->algo, g->workspace, g->workspace_bytes, ex->stream));
        return true;
    }
    if (epilogue != GEMM_PLAIN) return false;
    /* no cuBLASLt algorithm (or the plan cache is full): cuBLAS's own GEMM */
    gemm_uncached<T, TC>(ex, transA, transB, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, batch, strideA, strideB,
                         strideC);
    return true;
}

template <typename T, typename TC>
static void gemm(const mt_exec* ex, bool transA, bool transB, int M, int N, int K, const T* A, int lda, const T* B,
                 int ldb, TC* C, int ldc, float alpha, float beta, int batch = 1, int64_t strideA = 0,
                 int64_t strideB = 0, int64_t strideC = 0) {
    gemm_epilogue<T, TC>(ex, GEMM_PLAIN, transA, transB, M, N, K, A, lda, B, ldb, C, ldc, alpha, beta, NULL, (T*)NULL,
                         batch, strideA, strideB, strideC);
}

/* FP8 GEMM, row-major, both operands stored with rows along K:
 *   C[M,N] (ldc) = alpha * (A[M,K] . B[N,K]^T) * a_scale_inv * b_scale_inv + beta * C (+ bias[N])
 * with fp32 accumulation; A, B fp8 bytes of the given formats (E4M3 x E4M3, E4M3 x E5M2 or
 * E5M2 x E4M3); a_scale_inv, b_scale_inv device scale_invs in the operands' scaling modes
 * (mt_fp8_scaling_mode: one float, or 1x128 / 128x128 block layouts of A [M,K] and B [N,K]);
 * C bf16 (forward, input gradient; beta 0) or fp32 (weight gradient: beta 0 writes, beta 1
 * accumulates into the fp32 gradient buffer); bias [N] bf16 or NULL. For a linear y = x W^T with
 * x [N, in], W [out, in], dy [N, out], the roles are
 *   forward        y  [N, out]  = x [N, in]     . (W [out, in])^T      M = N,   N = out, K = in
 *   input grad     dx [N, in]   = dy [N, out]   . (W^T [in, out])^T    M = N,   N = in,  K = out
 *   weight grad    dW [out, in] = dy^T [out, N] . (x^T [in, N])^T      M = out, N = in,  K = N
 * where W^T, dy^T and x^T are the casts' transposed outputs. fast_accumulate lets the tensor cores
 * accumulate without promoting partial sums to fp32 (faster, less exact; Transformer Engine uses it
 * for the forward only). Returns false, with an error recorded (MT_ERR_ARG before anything runs;
 * MT_ERR_CUDA naming cuBLASLt's status and the problem when it has no algorithm or refuses the call),
 * when the GEMM did not run: K not a positive multiple of 16, ldc < N, A or B not 16-byte aligned,
 * E5M2 x E5M2, or an earlier error. With gelu_aux (bf16 C; the forward of a GELU MLP's fc1):
 * C = gelu(product + bias) and gelu_aux [M,N] (ld ldc) = product + bias, cuBLASLt's GELU_AUX_BIAS
 * epilogue (the tanh form the bf16 path's epilogues and kernels compute); when cuBLASLt has no
 * algorithm for it, false is returned with no error recorded, nothing run: the caller runs the GEMM
 * without it and its kernel. (No DGELU for the input gradient: cuBLASLt 13.0 on an H100 has one for
 * FP8 operands, but runs it as a separate generic kernel after the GEMM, cublasLt::globalKernel,
 * 0.55 ms a call at the 1.5B shape's fc2 where the gelu_backward kernel takes 0.10 ms: measured with
 * dev/bench/profile_kernels.sh.) */
template <typename TC>
static bool gemm_fp8(const mt_exec* ex, int M, int N, int K, const uint8_t* A, mt_fp8_dtype a_format,
                     const float* a_scale_inv, const uint8_t* B, mt_fp8_dtype b_format, const float* b_scale_inv,
                     TC* C, int ldc, float alpha, float beta, const __nv_bfloat16* bias = NULL,
                     mt_fp8_scaling_mode a_scaling = FP8_PER_TENSOR, mt_fp8_scaling_mode b_scaling = FP8_PER_TENSOR,
                     bool fast_accumulate = false, __nv_bfloat16* gelu_aux = NULL) {
    static_assert(std::is_same<TC, __nv_bfloat16>::value || std::is_same<TC, float>::value,
                  "FP8 GEMM output: bf16 or fp32");
    mt_gemm_plans* g = ex->gemm;
    if (ex->error->status != MT_OK) return false;
    /* the problem in words, for an error line only (formatted on the failure paths, not per call) */
    char description[256];
    auto what = [&]() -> const char* {
        snprintf(description, sizeof(description),
                 "M=%d N=%d K=%d, A %s %s [M,K], B %s %s [N,K], C %s ldc=%d (%d-byte aligned), alpha %g beta %g%s%s", M,
                 N, K, fp8_format_name(a_format), fp8_scaling_mode_name(a_scaling), fp8_format_name(b_format),
                 fp8_scaling_mode_name(b_scaling), std::is_same<TC, float>::value ? "fp32" : "bf16", ldc,
                 pointer_alignment(C), alpha, beta, bias ? ", bf16 bias" : "",
                 fast_accumulate ? ", fast accumulation" : "");
        return description;
    };
    if (a_format == FP8_E5M2 && b_format == FP8_E5M2)
        return mt_gpu_fail(ex->error, MT_ERR_ARG,
                           "gemm_fp8: E5M2 x E5M2 is not an FP8 GEMM of Hopper's (pair E4M3 with E4M3 or E5M2): %s", what());
    if (M < 0 || N < 0 || K <= 0 || K % 16)
        return mt_gpu_fail(ex->error, MT_ERR_ARG,
                           "gemm_fp8: K must be a positive multiple of 16 (FP8 rows of whole 16 bytes): %s", what());
    if (ldc < N) return mt_gpu_fail(ex->error, MT_ERR_ARG, "gemm_fp8: ldc < N: %s", what());
    if (!aligned16(A) || !aligned16(B) || !a_scale_inv || !b_scale_inv || !aligned16(a_scale_inv) ||
        !aligned16(b_scale_inv))
        return mt_gpu_fail(ex->error, MT_ERR_ARG,
                           "gemm_fp8: A, B and both scale_invs must be given and 16-byte aligned (cuBLASLt refuses "
                           "other scale pointers): %s", what());
    const bool with_gelu = gelu_aux != NULL;
    if (with_gelu && !std::is_same<TC, __nv_bfloat16>::value)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "gemm_fp8: the GELU epilogue needs a bf16 C: %s", what());
    if (M == 0 || N == 0) return true;
    mt_gemm_key key;
    memset(&key, 0, sizeof(key));
    key.transA = 0; key.transB = 1; key.M = M; key.N = N; key.K = K;
    key.lda = K; key.ldb = K; key.ldc = ldc; key.batch = 1;
    key.epilogue = with_gelu ? GEMM_GELU_AUX_BIAS : bias ? GEMM_BIAS : GEMM_PLAIN; key.has_bias = bias != NULL;
    key.a_type = fp8_cuda_type(a_format); key.b_type = fp8_cuda_type(b_format); key.c_type = cuda_type<TC>();
    key.fp8 = 1; key.a_scaling = a_scaling; key.b_scaling = b_scaling; key.fast_accumulate = fast_accumulate;
    mt_gemm_plan* plan = gemm_plan_lookup(ex, &key, A, B, C, bias, gelu_aux, a_scale_inv, b_scale_inv);
    /* a GELU epilogue cuBLASLt has no algorithm for: false with no error, the caller runs the GEMM
     * without it and its own kernel */
    if (with_gelu && ex->error->status == MT_OK && (!plan || !plan->supported)) return false;
    if (!plan)
        return mt_gpu_fail(ex->error, MT_ERR_CUDA, "gemm_fp8: the plan cache is full (%d plans): %s", GEMM_MAX_PLANS, what());
    if (!plan->supported) {
        if (ex->error->status != MT_OK) return false; /* a descriptor call failed: its status is recorded */
        return mt_gpu_fail(ex->error, MT_ERR_CUDA,
                           "gemm_fp8: cuBLASLt status %s (%s) from cublasLtMatmulAlgoGetHeuristic, %d algorithms, for %s",
                           cublasGetStatusName(plan->heuristic_status), cublasGetStatusString(plan->heuristic_status),
                           plan->algorithms_found, what());
    }
    if (!CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                               &b_scale_inv, sizeof(b_scale_inv))) ||
        !CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                               &a_scale_inv, sizeof(a_scale_inv))))
        return false;
    if (bias && !CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                                       &bias, sizeof(bias))))
        return false;
    if (gelu_aux && !CUBLAS_CHECK(ex->error, cublasLtMatmulDescSetAttribute(plan->desc,
                                                                           CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                                           &gelu_aux, sizeof(gelu_aux))))
        return false;
    const cublasStatus_t st = cublasLtMatmul(g->lt, plan->desc, &alpha, B, plan->a, A, plan->b, &beta, C, plan->c, C,
                                             plan->c, &plan->algo, g->workspace, g->workspace_bytes, ex->stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        return mt_gpu_fail(ex->error, MT_ERR_CUDA, "gemm_fp8: cuBLASLt status %s (%s) from cublasLtMatmul for %s",
                           cublasGetStatusName(st), cublasGetStatusString(st), what());
    return true;
}

/* The global aux loss's running average over a step (Megatron's router keeps the sum of the step's
 * DP-summed counts and divides by the micro-batches so far): sums [E] += counts [E]; average [E] = sums / m. */
__global__ void moe_global_aux_average_kernel(float* sums, float* average, const int32_t* counts, int E, float m) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const float sum = sums[e] + (float)counts[e];
    sums[e] = sum;
    average[e] = sum / m;
}
static void moe_global_aux_average(const mt_exec* ex, float* sums, float* average, const int32_t* counts, int E,
                                   int m) {
    if (ex->error->status != MT_OK) return;
    moe_global_aux_average_kernel<<<ceil_div(E, 256), 256, 0, ex->stream>>>(sums, average, counts, E, (float)m);
    LAUNCH_CHECK(ex->error);
}

/* Aux-loss-free balancing after a step (Megatron's expert-bias update): for each of L layers, bias[e] += rate *
 * sign(mean - count[e]), mean = sum(count) / E in fp32 (an integer sum, exact below 2^24), fp32 throughout as
 * Megatron's fp32 buffer; one block a layer. bias, counts [L, E]. */
__global__ void moe_expert_bias_update_kernel(float* bias, const int32_t* counts, int E, float rate) {
    const int64_t row = (int64_t)blockIdx.x * E;
    __shared__ float mean;
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int e = 0; e < E; e++) sum += (float)counts[row + e];
        mean = sum / (float)E;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float d = mean - (float)counts[row + e];
        bias[row + e] += (d > 0.0f ? 1.0f : d < 0.0f ? -1.0f : 0.0f) * rate;
    }
}
static void moe_expert_bias_update(const mt_exec* ex, float* bias, const int32_t* counts, int L, int E, float rate) {
    if (ex->error->status != MT_OK || L <= 0) return;
    moe_expert_bias_update_kernel<<<L, 128, 0, ex->stream>>>(bias, counts, E, rate);
    LAUNCH_CHECK(ex->error);
}


/* ============================================================================================== */
/* 13.1 Hopper grouped GEMM (wgmma, TMA)                                                          */
/*    The experts' GEMMs of a mixture of experts on Hopper (issue #34): cuBLAS's grouped GEMM     */
/*    (cublasGemmGroupedBatchedEx) reaches ~35% of a dense GEMM's TFLOP/s on an H200 at MoE       */
/*    shapes; this kernel, written for sm_90a (TMA loads, mbarrier pipeline, wgmma), reaches      */
/*    ~70-100% (its lab dev/cuda/hopper_gemm.cu measures and checks it). One launch computes for  */
/*    every group g: C_g [m_g, N] = A_g [m_g, K] B_g [N, K]^T (the forward) or A_g B_g with B_g   */
/*    [K, N] (the input gradient), bf16 in and out, fp32 accumulation, the row counts m_g read on */
/*    the device (no host synchronisation). Built only for sm_90a                                 */
/*    (GPU_ARCH 90, the Makefile's default there); every other target compiles a stub that traps */
/*    and hopper_gemm_available() says no, so callers keep their cuBLAS path.                     */
/*    The experts' weight gradient, fp32 dW_g (+)= dY_g^T X_g, is a variant of it (both operands  */
/*    MN-major; "The experts' weight gradient" below).                                            */
/*    defines: namespace hg (the kernel, its schedule, hg::options, hg::watchdog),               */
/*    mt_hopper_gemm_state's probe hopper_gemm_available, hopper_gemm_fits, hopper_grouped_gemm,  */
/*    hopper_wgrad_fits, hopper_grouped_wgrad.                                                    */
/* ============================================================================================== */
/*
 * ---- The operation ----------------------------------------------------------------------------------
 *   Row-major, K contiguous for A and B ("TN": both operands K-major), N contiguous for C:
 *     A  [a_rows, K]   the groups' rows concatenated in group order (group g from row_start[g] =
 *                      m_0 + ... + m_{g-1}); a_rows >= sum m_g is the buffer's row capacity
 *     B  [G, N, K]     one weight matrix per group (the experts' W [E, out, in]): C_g = A_g B_g^T (B_NK);
 *        or [G, K, N]  (B_KN: C_g = A_g B_g; dx = dy W with W [E, out, in], K = out, N = in)
 *     C  [a_rows, N]   concatenated like A; rows from sum m_g on are never written
 *     m  [G] int32     rows per group on the device (zeros allowed)
 *   Limits: N % 8 == K % 8 == 0 (TMA needs 16-byte row strides), 1 <= G <= hg::MAX_GROUPS,
 *   16-byte aligned A, B, C; G * N < 2^31 (hopper_gemm_fits says all of it).
 *
 * ---- Tiles and the schedule ----------------------------------------------------------------------
 *   CTA tile BM x BN x BK = 128 x BN x 64 (BN = 256 with 3 pipeline stages, or 128 with 5). A tile
 *   never straddles groups: group g has ceil(m_g / 128) row tiles times ceil(N / BN) column tiles,
 *   tile_start[g] their prefix sum. Every CTA builds tile_start and row_start in shared memory from
 *   the device counts (one warp, shuffle scans), then takes tiles t = blockIdx.x, + gridDim.x, ...
 *   (persistent CTAs, one per SM). Tile t's group is found by binary search of tile_start; inside a
 *   group tiles run in bands of BAND = 8 row tiles, column by column inside a band, so the CTAs at
 *   work at one time share a few A row blocks and B column blocks in L2.
 *   Rows past a group's end: ONE tensor map over all of A and ONE over B viewed as [G * N, K]. A row
 *   tile running past its group's last row loads the next group's first rows (or TMA's zero fill
 *   past a_rows); they only feed output rows the epilogue does not store (it masks rows >=
 *   row_start[g + 1] and columns >= N), and each output row depends only on its own A row. Likewise
 *   a column tile past N reads the next group's B rows or zeros, and K past its end reads zeros on
 *   both sides. No per-group tensor maps. B_KN: B viewed as [G * K, N]; the last k-block's rows past
 *   K are the next group's first rows (or zeros), met by A's zero fill past K (weights are finite, so
 *   they add exact zeros); columns past N are TMA's zeros.
 *
 * ---- Roles (384 threads = 3 warpgroups, one CTA per SM) ------------------------------------------
 *   warpgroup 0     producer: setmaxnreg.dec to 40 registers; one thread waits for a free stage (its
 *                   "empty" mbarrier), arms the stage's "full" mbarrier with the stage's byte count
 *                   (mbarrier.arrive.expect_tx) and issues the two TMA loads (cp.async.bulk.tensor.2d).
 *   warpgroups 1, 2 consumers: setmaxnreg.inc to 232 (40 + 2 * 232 = 3 * 168: the register file);
 *                   consumer c computes rows 64c..64c+63 of the tile: per k-block it waits on "full",
 *                   issues BK/16 = 4 wgmma.mma_async.m64nBNk16 (operands from shared memory through
 *                   descriptors), commits, waits until at most one group is in flight (wait_group 1)
 *                   and releases the PREVIOUS stage (lane 0 of each consumer warp arrives on "empty",
 *                   count 8). After the last k-block: wait_group 0, release, and the epilogue: fp32 ->
 *                   bf16 (round to nearest) into the warpgroup's padded shared buffer, then 16-byte
 *                   coalesced global stores (masked). The producer meanwhile loads the next tile.
 *   Phases: stage s holds the (i * STAGES + s)-th k-block of the CTA's sequence; its barriers' phase
 *   parity flips each time the stage index wraps; the producer's first wait on "empty" uses parity 1,
 *   which a fresh mbarrier reports complete.
 *
 * ---- Shared memory and the descriptors (PTX ISA "Matrix Descriptor Format") ------------------------
 *   TMA with CU_TENSOR_MAP_SWIZZLE_128B writes a box of 64 bf16 (128 bytes) x R rows as R rows of 128
 *   bytes in which 16-byte chunk c of row r sits at chunk c ^ (r % 8) (address bits: every tile starts
 *   1024-byte aligned). The wgmma descriptor of such a K-major operand: start address >> 4 (bits
 *   0-13), leading byte offset 1 (unused: a 16-wide k slice lies inside one 128-byte row), stride
 *   byte offset 1024 >> 4 (one 8-row group to the next, bits 32-45), base offset 0, swizzle mode 1
 *   (128 bytes, bits 62-63). The k-th 16-wide slice starts 32 k bytes into the row: the hardware
 *   applies the XOR to the final address, so the start address just advances by 32 k.
 *   B_KN (N-major B, wgmma's imm-trans-b = 1): a stage holds BN / 64 boxes of [64 k rows][64 columns =
 *   128 bytes], each 8 KiB; the canonical N-major 128-byte-swizzle layout ((8 chunks of 8 columns, m
 *   blocks), (8 rows, k groups)) takes leading byte offset 8192 (the next 64 columns) and stride byte
 *   offset 1024 (the next 8 k rows); the k-th 16-row slice starts 16 x 128 bytes further.
 *
 * ---- Accumulators (wgmma m64nNk16, fp32 D; PTX ISA "Register Fragments") ---------------------------
 *   thread 32 w + lane of a warpgroup, j in 0..N/8-1: d[4j], d[4j+1] -> row 16w + lane/4, columns
 *   8j + 2 (lane % 4) + {0, 1}; d[4j+2], d[4j+3] -> row 16w + lane/4 + 8, the same columns.
 *
 * ---- Watchdog ------------------------------------------------------------------------------------
 *   Every mbarrier wait is a bounded spin: past timeout_ns (hg::options; 20 s by default, a healthy
 *   wait lasts microseconds) the thread records where it was (role, stage, parity, tile, k-block) in
 *   an hg::watchdog if one was given (the lab's, in mapped host memory) and traps, so a deadlock ends
 *   the kernel with an error instead of hanging the trainer. It costs one clock read per wait that
 *   does not succeed at once (the lab measured no difference).
 *
 * ---- Determinism ---------------------------------------------------------------------------------
 *   Each output element is one thread's fp32 sum over k in a fixed order (k-block by k-block, 16 at a
 *   time in wgmma): bitwise the same from run to run, whatever the grid. It differs from cuBLAS's
 *   summation order, so results agree with cuBLAS to fp32 rounding before the one bf16 rounding.
 */

namespace hg {
constexpr int BM = 128;          /* rows per CTA tile: two consumer warpgroups of 64 */
constexpr int BK = 64;           /* k per stage: 64 bf16 = one 128-byte swizzle row */
constexpr int BAND = 8;          /* row tiles per raster band */
constexpr int MAX_GROUPS = 1024; /* the schedule tables live in shared memory */
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
/* B's layout: B_NK, B_g [N, K] with K contiguous (y = x W^T: the forward); B_KN, B_g [K, N] with N contiguous
 * (dx = dy W: the input gradient), wgmma's transposed B */
enum { B_NK = 0, B_KN = 1, B_LAYOUTS = 2 };

/* Written by a device thread whose wait timed out (the lab passes one in mapped pinned memory). */
struct watchdog {
    volatile int fired;                                        /* 1 once written */
    volatile int block, thread, role, stage, parity, tile, kb; /* role 0: producer waiting on "empty", 1: consumer on "full",
                                                                  2: section 13.2's consumer on its ping-pong turn */
    volatile int clamped;                                      /* the schedule clamped rows: sum m_g > a_rows */
};
/* The lab's and the tests' knobs; the model passes none (NULL: the defaults). */
struct options {
    int variant;                   /* -1: chosen from N; 0: 128 x 256 tiles, 3 stages; 1: 128 x 128, 5 stages */
    int max_ctas;                  /* > 0: this many CTAs, at most one per tile (the labs' and tests' "many tiles
                                    * per CTA" checks; section 13.3's lab also times one tile per CTA) */
    watchdog* wd;                  /* where a timed-out wait reports (NULL: it just traps) */
    unsigned long long timeout_ns; /* 0: 20 s */
};

/* Shared memory of one configuration: the stages, both warpgroups' epilogue buffers, the barriers and
 * the schedule tables. */
template <int BN, int STAGES>
struct cfg {
    static constexpr int A_BYTES = BM * BK * 2; /* 16 KiB */
    static constexpr int B_BYTES = BN * BK * 2; /* 32 or 16 KiB */
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int EPI_LD = BN + 8; /* elements per staged output row: conflict-free */
    static constexpr int EPI_BYTES = BM * EPI_LD * 2;
    static constexpr int SMEM = 1024 /* alignment slack */ + STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 +
                                2 * (MAX_GROUPS + 1) * 4;
    static_assert(SMEM <= 227 * 1024, "shared memory");
};

/* One tile of the schedule: its group, first row (global), the group's end row, first column. */
struct tile_coord {
    int g, m0, m_end, n0;
};
__host__ __device__ inline tile_coord decode_tile(int t, const int* tile_start, const int* row_start, int G, int ntn,
                                                  int bn) {
    int lo = 0, hi = G; /* tile_start[lo] <= t < tile_start[hi]; skips groups without tiles */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_start[mid] <= t) lo = mid;
        else hi = mid;
    }
    tile_coord c;
    c.g = lo;
    const int local = t - tile_start[lo];
    const int rows = row_start[lo + 1] - row_start[lo];
    const int mt = (rows + BM - 1) / BM;
    const int band = local / (BAND * ntn);
    int bh = mt - band * BAND;
    if (bh > BAND) bh = BAND;
    const int in = local - band * BAND * ntn;
    const int nt = in / bh, mi = band * BAND + in % bh;
    c.m0 = row_start[lo] + mi * BM;
    c.m_end = row_start[lo + 1];
    c.n0 = nt * bn;
    return c;
}

/* Persistent CTAs' static schedule over a list of `tiles` work tiles sorted heaviest first (the attention
 * kernels of sections 13.2 and 13.3): in round k CTA c takes tile k * grid + c when k is even and
 * k * grid + grid - 1 - c when it is odd, -1 once that is past the list (then every later round is too). The
 * snake order pairs a round's heaviest tile with the next round's lightest, so every CTA's sum comes out
 * near the mean (simulated for GPT-2 124M's and a 32k-token causal backward: within 1.2% of the longest
 * CTA a dynamic queue would give; striding c, c + grid, ... is 6-25% over), without a shared counter to reset. */
__device__ __forceinline__ int snake_tile(int k, int tiles) {
    const int grid = (int)gridDim.x, c = (int)blockIdx.x;
    const int64_t at = (int64_t)k * grid + (k & 1 ? grid - 1 - c : c);
    return at < tiles ? (int)at : -1;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* ---- PTX wrappers (sm_90a) ---- */
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
/* arrive once and add `bytes` to the transaction count the current phase waits for */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* The watchdog: where this thread was stuck, then trap (the kernel ends with an error). Plain volatile
 * stores (atomics on host memory over PCIe are not guaranteed). */
__device__ __noinline__ void watchdog_fire(watchdog* wd, int role, int stage, int parity, int tile, int kb) {
    if (wd) {
        wd->block = blockIdx.x;
        wd->thread = threadIdx.x;
        wd->role = role;
        wd->stage = stage;
        wd->parity = parity;
        wd->tile = tile;
        wd->kb = kb;
        __threadfence_system();
        wd->fired = 1;
        __threadfence_system();
    }
    __trap();
}
/* wait until the phase with this parity has completed; bounded by timeout_ns */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, watchdog* wd, unsigned long long timeout_ns,
                                          int role, int stage, int tile, int kb) {
    if (mbar_try_wait(bar, parity)) return;
    const unsigned long long t0 = globaltimer_ns();
    while (!mbar_try_wait(bar, parity))
        if (globaltimer_ns() - t0 > timeout_ns) watchdog_fire(wd, role, stage, (int)parity, tile, kb);
}
/* 2-D TMA load of one box into shared memory, completion signalled on `bar` as transaction bytes;
 * c0 = the inner (K) coordinate in elements, c1 = the row */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
/* 5-D TMA load (section 13.2's attention: c0 = column, c1 = sequence row, c2 = head in its group, c3 = group,
 * c4 = batch), likewise */
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
/* keeps the compiler from moving accumulator reads and writes across the asynchronous wgmma boundaries */
template <int R>
__device__ __forceinline__ void reg_fence(float* r) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int R>
__device__ __forceinline__ void reg_fence(uint32_t* r) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+r"(r[i])::"memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R)); }
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R)); }

/* the descriptor of a K-major, 128-byte-swizzled operand at shared address `addr` (see above) */
__device__ __forceinline__ uint64_t make_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
/* the descriptor of an N-major B (B_KN, see above): 64-column blocks of [64 k rows][128 bytes] 8 KiB apart (leading
 * byte offset: the next 64 columns), 8-row groups 1024 bytes apart (stride byte offset: the next 8 k). lbo: the
 * step between 64-column blocks where they hold more k rows (section 13.2's V tiles: 128 keys, 16 KiB). */
__device__ __forceinline__ uint64_t make_desc_n_major(uint32_t addr, uint32_t lbo = 8192) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* D[64 x 256] (+)= A[64 x 16] B[256 x 16]^T, operands in shared memory, A K-major, B K-major (TB 0) or N-major
 * (TB 1: wgmma's transpose of B); scale_d = 0 ignores D's old value. 128 fp32 accumulators per thread. */
template <int TB, int TA = 0> /* TA 1: an M-major A (wgmma's transpose of A; the weight gradient's dy^T) */
__device__ __forceinline__ void wgmma_m64n256k16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %132, %131;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TB), "n"(TA));
}
/* D[64 x 128] (+)= A[64 x 16] B[128 x 16]^T, likewise; 64 fp32 accumulators per thread. */
template <int TB, int TA = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %68, %67;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TB), "n"(TA));
}
/* D[64 x 128] (+)= A[64 x 16] B[16 x 128], A from registers (4 bf16x2 per thread: the accumulator layout of two
 * adjacent 8-column blocks, PTX ISA "Register Fragments"), B N-major in shared memory (imm-trans-b = 1);
 * section 13.2's O += P V. */
__device__ __forceinline__ void wgmma_m64n128k16_rs(float* d, const uint32_t* a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
template <int BN, int TB, int TA = 0>
__device__ __forceinline__ void wgmma_bn(float* d, uint64_t da, uint64_t db, int scale_d) {
    if constexpr (BN == 256) wgmma_m64n256k16<TB, TA>(d, da, db, scale_d);
    else wgmma_m64n128k16<TB, TA>(d, da, db, scale_d);
}

/* The schedule tables, built by one warp of every CTA from the device counts: row_start[g] = m_0 + ... +
 * m_{g-1} (clamped to a_rows), tile_start[g] the prefix sum of the tile counts. */
__device__ void build_schedule(const int* __restrict__ m_g, int G, int ntn, int a_rows, int* tile_start, int* row_start,
                               watchdog* wd) {
    const int lane = threadIdx.x & 31;
    long long rows_carry = 0;
    int tiles_carry = 0;
    if (lane == 0) row_start[0] = 0, tile_start[0] = 0;
    for (int base = 0; base < G; base += 32) {
        const int g = base + lane;
        const long long m = g < G ? (long long)max(m_g[g], 0) : 0;
        long long end = m; /* inclusive scan of m over the lanes */
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long v = __shfl_up_sync(0xffffffffu, end, o);
            if (lane >= o) end += v;
        }
        end += rows_carry;
        const long long begin = end - m;
        const int cb = (int)min(begin, (long long)a_rows), ce = (int)min(end, (long long)a_rows);
        if (wd && g < G && ce != end) wd->clamped = 1;
        int tiles = ((ce - cb + BM - 1) / BM) * ntn;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, tiles, o);
            if (lane >= o) tiles += v;
        }
        tiles += tiles_carry;
        if (g < G) row_start[g + 1] = ce, tile_start[g + 1] = tiles;
        rows_carry = __shfl_sync(0xffffffffu, end, 31);
        tiles_carry = __shfl_sync(0xffffffffu, tiles, 31);
    }
}

/* The epilogue of one warpgroup's 64 x BN block: fp32 -> bf16 into its padded shared buffer buf [64][BN + 8]
 * (named barrier bar_id), then 16-byte coalesced stores; rows >= m_end and columns >= N are not stored. */
template <int BN>
__device__ __forceinline__ void store_block64(const float* acc, __nv_bfloat16* __restrict__ C, int N, int row0, int m_end,
                                              int n0, __nv_bfloat16* buf, int wq, int lane, int t128, int bar_id) {
    constexpr int LD = BN + 8;
    asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory"); /* the previous copy-out from buf is finished */
    {
        __nv_bfloat16* q0 = buf + (wq * 16 + (lane >> 2)) * LD + 2 * (lane & 3);
        __nv_bfloat16* q1 = q0 + 8 * LD;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            *reinterpret_cast<__nv_bfloat162*>(q0 + 8 * j) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
            *reinterpret_cast<__nv_bfloat162*>(q1 + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
        }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
    constexpr int CPR = BN / 8, RPP = 128 / CPR; /* 16-byte chunks per row; rows per pass of 128 threads */
    const int ch = t128 % CPR, rr = t128 / CPR;
    const int col = n0 + ch * 8;
#pragma unroll 4
    for (int r = rr; r < 64; r += RPP) {
        const uint4 v = *reinterpret_cast<const uint4*>(buf + r * LD + ch * 8);
        if (row0 + r < m_end && col < N) *reinterpret_cast<uint4*>(C + (size_t)(row0 + r) * N + col) = v;
    }
}
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

/* The kernel. tmA: A as [a_rows, K], box 64 x 128; tmB: B as [G * N, K] with boxes 64 x BN (B_NK), or as
 * [G * K, N] with boxes 64 x 64 (B_KN); C [a_rows, N]. */
template <int BN, int STAGES, int BL>
__global__ void __launch_bounds__(THREADS, 1)
grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                    __nv_bfloat16* __restrict__ C, const int* __restrict__ m_g, int G, int N, int K, int a_rows,
                    watchdog* wd, unsigned long long timeout_ns) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cf = cfg<BN, STAGES>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023); /* 1024-byte aligned (swizzle atoms) */
    uint8_t* sA = smem;                                      /* [STAGES][128 rows][128 bytes] */
    uint8_t* sB = smem + STAGES * Cf::A_BYTES;               /* [STAGES][BN rows][128 bytes] */
    __nv_bfloat16* sC = (__nv_bfloat16*)(sB + STAGES * Cf::B_BYTES); /* [2 warpgroups][64 rows][EPI_LD] */
    uint64_t* full = (uint64_t*)(sB + STAGES * Cf::B_BYTES + Cf::EPI_BYTES);
    uint64_t* empty = full + STAGES;
    int* tile_start = (int*)(empty + STAGES); /* [G + 1] */
    int* row_start = tile_start + MAX_GROUPS + 1;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int ntn = (N + BN - 1) / BN, nk = (K + BK - 1) / BK;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(smem_u32(&full[s]), 1);  /* the producer's arrive.expect_tx (+ the TMA bytes) */
            mbar_init(smem_u32(&empty[s]), 8); /* lane 0 of each consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        tma_prefetch_desc(&tmA);
        tma_prefetch_desc(&tmB);
    }
    if (warp == 1) build_schedule(m_g, G, ntn, a_rows, tile_start, row_start, wd);
    __syncthreads();
    const int total = tile_start[G];

    if (tid < 128) {
        /* ---- producer warpgroup: one thread issues every TMA load ---- */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const tile_coord tc = decode_tile(t, tile_start, row_start, G, ntn, BN);
                const int brow = BL == B_NK ? tc.g * N + tc.n0 : tc.g * K; /* B_g's first row */
                for (int kb = 0; kb < nk; kb++) {
                    mbar_wait(smem_u32(&empty[stage]), phase ^ 1, wd, timeout_ns, 0, stage, t, kb);
                    const uint32_t fb = smem_u32(&full[stage]);
                    mbar_arrive_expect_tx(fb, Cf::STAGE_BYTES); /* full boxes: out-of-bounds parts are zero-filled and counted */
                    tma_load_2d(smem_u32(sA + stage * Cf::A_BYTES), &tmA, fb, kb * BK, tc.m0);
                    if constexpr (BL == B_NK) {
                        tma_load_2d(smem_u32(sB + stage * Cf::B_BYTES), &tmB, fb, kb * BK, brow);
                    } else { /* BN / 64 boxes of [64 k rows][64 columns]; k rows past K belong to the next group (or
                                zeros): they meet A's zero fill past K */
#pragma unroll
                        for (int j = 0; j < BN / 64; j++)
                            tma_load_2d(smem_u32(sB + stage * Cf::B_BYTES + j * 8192), &tmB, fb, tc.n0 + 64 * j, brow + kb * BK);
                    }
                    if (++stage == STAGES) stage = 0, phase ^= 1;
                }
            }
        }
    } else {
        /* ---- consumer warpgroups: both work on every tile, 64 rows each ---- */
        setmaxnreg_inc<CONSUMER_REGS>();
        const int cw = (tid >> 7) - 1; /* rows 64 cw .. 64 cw + 63 of the tile */
        const int wq = warp & 3;       /* the warp inside the warpgroup: rows 16 wq .. 16 wq + 15 of those */
        float acc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
        const uint32_t a_base = smem_u32(sA) + cw * 64 * 128;
        const uint32_t b_base = smem_u32(sB);
        int stage = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
            const tile_coord tc = decode_tile(t, tile_start, row_start, G, ntn, BN);
            int prev = 0;
            for (int kb = 0; kb < nk; kb++) {
                mbar_wait(smem_u32(&full[stage]), phase, wd, timeout_ns, 1, stage, t, kb);
                reg_fence<BN / 2>(acc);
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < BK / 16; k++) {
                    const uint64_t da = make_desc(a_base + stage * Cf::A_BYTES + k * 32);
                    const uint64_t db = BL == B_NK ? make_desc(b_base + stage * Cf::B_BYTES + k * 32)
                                                   : make_desc_n_major(b_base + stage * Cf::B_BYTES + k * 16 * 128);
                    wgmma_bn<BN, BL>(acc, da, db, (kb > 0 || k > 0) ? 1 : 0);
                }
                wgmma_commit();
                reg_fence<BN / 2>(acc);
                if (kb > 0) {
                    wgmma_wait<1>(); /* the previous k-block's group is done: its stage may be refilled */
                    if (lane == 0) mbar_arrive(smem_u32(&empty[prev]));
                }
                prev = stage;
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            wgmma_wait<0>();
            reg_fence<BN / 2>(acc);
            if (lane == 0) mbar_arrive(smem_u32(&empty[prev]));
            store_block64<BN>(acc, C, N, tc.m0 + cw * 64, tc.m_end, tc.n0, sC + cw * 64 * Cf::EPI_LD, wq, lane, tid & 127,
                              1 + cw);
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap(); /* built without sm_90a: never launched (hopper_gemm_available says no) */
#endif
}

/* ---- The experts' weight gradient (hopper_grouped_wgrad) ----------------------------------------------
 *   dW_g [M, N] (fp32) = beta dW_g + dY_g^T [M, m_g] X_g [m_g, N] for every group g, where dY [a_rows, M] and
 *   X [a_rows, N] (bf16) hold the groups' rows concatenated as above (MoE: dW_e [out, in] from dy_e and x_e).
 *   Tiles: BM x BN over (M, N) of each group, G * ceil(M / BM) * ceil(N / BN) of them whatever the m_g
 *   (decode_wtile: group, then row tile, then column tile), taken by the persistent CTAs as above. The
 *   contraction runs over the group's own rows: k-block kb of group g is rows row_start[g] + 64 kb .. + 63 of
 *   both dY and X, so both operands are MN-major (wgmma's imm-trans-a = imm-trans-b = 1, both described like
 *   B_KN's B above): A = dY^T as 2 boxes of [64 k rows][64 columns of M], B = X as BN / 64 such boxes. In a
 *   group's last, partial k-block the rows past its end (the next group's, or X's and dY's rows past the sum,
 *   which may be stale or not finite) are zeroed in shared memory by the two consumer warpgroups (whole
 *   128-byte rows: the swizzle only moves chunks inside a row), then fence.proxy.async (the wgmma reads through
 *   the async proxy) and a 256-thread named barrier (both read all of B). A group without rows runs no k-block:
 *   its accumulators are zero, stored where beta == 0 and nothing stored otherwise (dW_g left as it is).
 *   Epilogue: straight from the accumulators, each thread's two adjacent columns as one float2, read-add-write
 *   where beta != 0; each element is one thread's (deterministic, as above).
 */
__host__ __device__ inline tile_coord decode_wtile(int t, int mtn, int ntn, int bn) {
    const int per = mtn * ntn, g = t / per, local = t - g * per;
    tile_coord c;
    c.g = g;
    c.m0 = (local / ntn) * BM;
    c.m_end = 0; /* unused: the rows of the output are M's */
    c.n0 = (local % ntn) * bn;
    return c;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* One warpgroup's 64 x BN fp32 block of dW_g (D), rows from `row` (this thread's first), columns from col0
 * (its first); rows >= M and columns >= N not stored; beta != 0 adds beta times the old value; ZERO: zeros. */
template <int BN, bool ZERO>
__device__ __forceinline__ void store_wgrad(const float* acc, float* __restrict__ D, int M, int N, int row, int col0,
                                            float beta) {
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int col = col0 + 8 * j; /* even, and N % 8 == 0: col < N means col + 1 < N */
        if (col >= N) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = row + 8 * h;
            if (r >= M) continue;
            float2* q = reinterpret_cast<float2*>(D + (size_t)r * N + col);
            float2 v = ZERO ? make_float2(0.0f, 0.0f) : make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (!ZERO && beta != 0.0f) {
                const float2 o = *q;
                v.x += beta * o.x, v.y += beta * o.y;
            }
            *q = v;
        }
    }
}
#endif

/* tmDY: dY as [a_rows, M], tmX: X as [a_rows, N], both boxes 64 x 64; dW [G, M, N] fp32. The shared memory is
 * grouped_gemm_kernel's (its epilogue buffer unused). */
template <int BN, int STAGES>
__global__ void __launch_bounds__(THREADS, 1)
grouped_wgrad_kernel(const __grid_constant__ CUtensorMap tmDY, const __grid_constant__ CUtensorMap tmX,
                     float* __restrict__ dW, const int* __restrict__ m_g, int G, int M, int N, int a_rows, float beta,
                     watchdog* wd, unsigned long long timeout_ns) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Cf = cfg<BN, STAGES>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint8_t* sA = smem;                        /* [STAGES][2 boxes][64 k rows][128 bytes] */
    uint8_t* sB = smem + STAGES * Cf::A_BYTES; /* [STAGES][BN / 64 boxes][64 k rows][128 bytes] */
    uint64_t* full = (uint64_t*)(sB + STAGES * Cf::B_BYTES + Cf::EPI_BYTES);
    uint64_t* empty = full + STAGES;
    int* tile_start = (int*)(empty + STAGES); /* [G + 1], unused here */
    int* row_start = tile_start + MAX_GROUPS + 1;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int mtn = (M + BM - 1) / BM, ntn = (N + BN - 1) / BN, total = G * mtn * ntn;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        tma_prefetch_desc(&tmDY);
        tma_prefetch_desc(&tmX);
    }
    if (warp == 1) build_schedule(m_g, G, 1, a_rows, tile_start, row_start, wd);
    __syncthreads();

    if (tid < 128) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const tile_coord tc = decode_wtile(t, mtn, ntn, BN);
                const int r0 = row_start[tc.g], nk = (row_start[tc.g + 1] - r0 + BK - 1) / BK;
                for (int kb = 0; kb < nk; kb++) {
                    mbar_wait(smem_u32(&empty[stage]), phase ^ 1, wd, timeout_ns, 0, stage, t, kb);
                    const uint32_t fb = smem_u32(&full[stage]);
                    mbar_arrive_expect_tx(fb, Cf::STAGE_BYTES);
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        tma_load_2d(smem_u32(sA + stage * Cf::A_BYTES + j * 8192), &tmDY, fb, tc.m0 + 64 * j, r0 + kb * BK);
#pragma unroll
                    for (int j = 0; j < BN / 64; j++)
                        tma_load_2d(smem_u32(sB + stage * Cf::B_BYTES + j * 8192), &tmX, fb, tc.n0 + 64 * j, r0 + kb * BK);
                    if (++stage == STAGES) stage = 0, phase ^= 1;
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int cw = (tid >> 7) - 1, wq = warp & 3, t256 = tid - 128;
        float acc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
        const uint32_t a_base = smem_u32(sA) + cw * 8192; /* this warpgroup's 64 columns of M */
        const uint32_t b_base = smem_u32(sB);
        int stage = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
            const tile_coord tc = decode_wtile(t, mtn, ntn, BN);
            const int r0 = row_start[tc.g], r_end = row_start[tc.g + 1], nk = (r_end - r0 + BK - 1) / BK;
            int prev = 0;
            for (int kb = 0; kb < nk; kb++) {
                mbar_wait(smem_u32(&full[stage]), phase, wd, timeout_ns, 1, stage, t, kb);
                const int valid = r_end - (r0 + kb * BK); /* rows of this k-block inside the group: 1 .. */
                if (valid < BK) {
                    constexpr int NBOX = 2 + BN / 64;
                    const int per_box = (BK - valid) * 8; /* 16-byte chunks from row `valid` on */
                    for (int i = t256; i < NBOX * per_box; i += 256) {
                        const int b = i / per_box, c = i - b * per_box;
                        uint8_t* box = b < 2 ? sA + stage * Cf::A_BYTES + b * 8192 : sB + stage * Cf::B_BYTES + (b - 2) * 8192;
                        *reinterpret_cast<uint4*>(box + valid * 128 + c * 16) = make_uint4(0u, 0u, 0u, 0u);
                    }
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    asm volatile("bar.sync 3, 256;" ::: "memory"); /* ids 1, 2: the epilogues' */
                }
                reg_fence<BN / 2>(acc);
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < BK / 16; k++) {
                    const uint64_t da = make_desc_n_major(a_base + stage * Cf::A_BYTES + k * 16 * 128);
                    const uint64_t db = make_desc_n_major(b_base + stage * Cf::B_BYTES + k * 16 * 128);
                    wgmma_bn<BN, 1, 1>(acc, da, db, (kb > 0 || k > 0) ? 1 : 0);
                }
                wgmma_commit();
                reg_fence<BN / 2>(acc);
                if (kb > 0) {
                    wgmma_wait<1>();
                    if (lane == 0) mbar_arrive(smem_u32(&empty[prev]));
                }
                prev = stage;
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            float* D = dW + (size_t)tc.g * M * N;
            const int row = tc.m0 + cw * 64 + wq * 16 + (lane >> 2), col0 = tc.n0 + 2 * (lane & 3);
            wgmma_wait<0>(); /* unconditional: ptxas then sees no path to the accumulators past an unwaited wgmma */
            reg_fence<BN / 2>(acc);
            if (nk > 0) {
                if (lane == 0) mbar_arrive(smem_u32(&empty[prev]));
                store_wgrad<BN, false>(acc, D, M, N, row, col0, beta);
            } else if (beta == 0.0f) { /* an empty group: zeros (acc untouched, so ptxas keeps the wgmma pipelined) */
                store_wgrad<BN, true>(acc, D, M, N, row, col0, 0.0f);
            }
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

/* The configurations: variant 0 (128 x 256, 3 stages) and 1 (128 x 128, 5 stages), the two best of the lab
 * (H200: 128 x 256 ahead at Qwen3/Mixtral shapes, 128 x 128 where N's last 256-wide tile would be half empty). */
constexpr int VARIANTS = 2;
template <int V> struct variant;
template <> struct variant<0> { static constexpr int BN = 256, STAGES = 3; };
template <> struct variant<1> { static constexpr int BN = 128, STAGES = 5; };
} /* namespace hg */

/* cuTensorMapEncodeTiled's signature (CUDA 12.0's), reached through cudaGetDriverEntryPointByVersion, so the
 * build needs no -lcuda */
typedef CUresult (*hg_encode_tiled_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The kernel of a variant and B layout (or hg::B_LAYOUTS: the weight gradient's), as a plain function pointer
 * (the attributes and launch below). */
static const void* hg_kernel_of(int v, int bl) {
    using namespace hg;
    if (bl == B_LAYOUTS)
        return v == 0 ? (const void*)grouped_wgrad_kernel<variant<0>::BN, variant<0>::STAGES>
                      : (const void*)grouped_wgrad_kernel<variant<1>::BN, variant<1>::STAGES>;
    if (v == 0)
        return bl == B_NK ? (const void*)grouped_gemm_kernel<variant<0>::BN, variant<0>::STAGES, B_NK>
                          : (const void*)grouped_gemm_kernel<variant<0>::BN, variant<0>::STAGES, B_KN>;
    return bl == B_NK ? (const void*)grouped_gemm_kernel<variant<1>::BN, variant<1>::STAGES, B_NK>
                      : (const void*)grouped_gemm_kernel<variant<1>::BN, variant<1>::STAGES, B_KN>;
}
static int hg_smem_of(int v) {
    return v == 0 ? hg::cfg<hg::variant<0>::BN, hg::variant<0>::STAGES>::SMEM
                  : hg::cfg<hg::variant<1>::BN, hg::variant<1>::STAGES>::SMEM;
}

/* Whether this process's GPU runs the Hopper GEMM: compute capability 9.x, the kernels built for sm_90a
 * (a stub built for another target has far fewer registers than setmaxnreg's 40/232 split needs: the
 * consumers' increase would wait forever unless the launch allocation covers 40 x 128 + 232 x 256), their
 * shared memory allowed, and the driver's cuTensorMapEncodeTiled found. Probed once into *s (state 1 yes,
 * -1 no); a failed probe leaves no CUDA error behind (later launch checks must not see it). */
static bool hopper_gemm_available(mt_hopper_gemm_state* s) {
    if (s->state) return s->state > 0;
    s->state = -1;
    int dev = 0, major = 0, sms = 0, optin = 0;
    bool ok = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && major == 9;
    for (int i = 0; ok && i < hg::VARIANTS * (hg::B_LAYOUTS + 1); i++) { /* + 1: the weight gradient's kernel */
        const int v = i / (hg::B_LAYOUTS + 1), bl = i % (hg::B_LAYOUTS + 1);
        cudaFuncAttributes a;
        ok = cudaFuncGetAttributes(&a, hg_kernel_of(v, bl)) == cudaSuccess &&
             a.numRegs * hg::THREADS >= hg::PRODUCER_REGS * 128 + hg::CONSUMER_REGS * 256 && hg_smem_of(v) <= optin &&
             cudaFuncSetAttribute(hg_kernel_of(v, bl), cudaFuncAttributeMaxDynamicSharedMemorySize, hg_smem_of(v)) == cudaSuccess;
    }
    void* fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    ok = ok && cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
         q == cudaDriverEntryPointSuccess && fn;
    (void)cudaGetLastError(); /* a failed query is an answer here, not an error for the next launch check */
    if (!ok) return false;
    s->state = 1;
    s->sms = sms;
    s->encode = fn;
    return true;
}

/* The shapes and pointers the kernel takes (see the section's banner); the launcher refuses others. */
static bool hopper_gemm_fits(const void* A, const void* B, const void* C, int G, int N, int K, int64_t a_rows) {
    return N > 0 && K > 0 && N % 8 == 0 && K % 8 == 0 && G >= 1 && G <= hg::MAX_GROUPS && a_rows >= 0 &&
           a_rows < ((int64_t)1 << 31) && (int64_t)G * N < ((int64_t)1 << 31) && (int64_t)G * K < ((int64_t)1 << 31) &&
           ((uintptr_t)A % 16 | (uintptr_t)B % 16 | (uintptr_t)C % 16) == 0;
}

/* A row-major bf16 tensor [rows, K] as a TMA map: boxes of 64 (K) x box_rows, 128-byte swizzle, zero fill. */
static bool hg_tensor_map(const mt_exec* ex, hg_encode_tiled_fn encode, CUtensorMap* m, const void* p, int64_t rows, int K,
                          int box_rows) {
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {(cuuint32_t)hg::BK, (cuuint32_t)box_rows};
    const cuuint32_t estr[2] = {1, 1};
    const CUresult r = encode(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)p, dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_SUCCESS) return true;
    return mt_gpu_fail(ex->error, MT_ERR_CUDA, "hopper_grouped_gemm: cuTensorMapEncodeTiled failed (CUresult %d) for [%lld, %d] box %d",
                       (int)r, (long long)rows, K, box_rows);
}

template <int V, int BL>
static void hg_launch(const mt_exec* ex, const CUtensorMap& ta, const CUtensorMap& tb, __nv_bfloat16* C, const int32_t* counts,
                      int G, int N, int K, int a_rows, int grid, hg::watchdog* wd, unsigned long long timeout_ns) {
    constexpr int BN = hg::variant<V>::BN, STAGES = hg::variant<V>::STAGES;
    hg::grouped_gemm_kernel<BN, STAGES, BL><<<grid, hg::THREADS, hg::cfg<BN, STAGES>::SMEM, ex->stream>>>(
        ta, tb, C, counts, G, N, K, a_rows, wd, timeout_ns);
    LAUNCH_CHECK(ex->error);
}

/* C [a_rows, N] = for each group g: A_g [m_g, K] times B_g, which is [N, K] (b_layout hg::B_NK: C_g = A_g B_g^T)
 * or [K, N] (hg::B_KN: C_g = A_g B_g), bf16 (shapes in the section's banner); counts = m [G] int32 on the
 * device, read by the kernel (no synchronisation). Rows of C from sum m_g on are left as they are. Refuses
 * (recorded, nothing queued) a GPU or build without the kernel and shapes it does not take. opt: the lab's and
 * tests' knobs (NULL: the defaults). */
static void hopper_grouped_gemm(const mt_exec* ex, __nv_bfloat16* C, const __nv_bfloat16* A, int64_t a_rows,
                                const __nv_bfloat16* B, int b_layout, const int32_t* counts, int G, int N, int K,
                                const hg::options* opt = NULL) {
    if (ex->error->status != MT_OK) return;
    mt_hopper_gemm_state local = {0, 0, NULL};
    mt_hopper_gemm_state* st = ex->gemm ? &ex->gemm->hopper : &local;
    if (!hopper_gemm_available(st)) {
        mt_gpu_fail(ex->error, MT_ERR_ARG, "hopper_grouped_gemm: this GPU or build has no sm_90a kernel (needs compute "
                                           "capability 9.x and GPU_ARCH=90, which builds sm_90a)");
        return;
    }
    if (!hopper_gemm_fits(A, B, C, G, N, K, a_rows) || (b_layout != hg::B_NK && b_layout != hg::B_KN)) {
        mt_gpu_fail(ex->error, MT_ERR_ARG, "hopper_grouped_gemm: G %d N %d K %d rows %lld B layout %d not taken (N %% 8 == K %% 8 "
                                           "== 0, 1 <= G <= %d, 16-byte aligned pointers)", G, N, K, (long long)a_rows, b_layout,
                    hg::MAX_GROUPS);
        return;
    }
    if (a_rows == 0) return;
    int v = opt && opt->variant >= 0 && opt->variant < hg::VARIANTS ? opt->variant : -1;
    if (v < 0) /* 128-wide column tiles where the last 256-wide one would be at most half used */
        v = N % 256 != 0 && N % 256 <= 128 ? 1 : 0;
    const int BN = v == 0 ? hg::variant<0>::BN : hg::variant<1>::BN;
    CUtensorMap ta, tb;
    const hg_encode_tiled_fn encode = (hg_encode_tiled_fn)st->encode;
    const bool ok = hg_tensor_map(ex, encode, &ta, A, a_rows, K, hg::BM) &&
                    (b_layout == hg::B_NK ? hg_tensor_map(ex, encode, &tb, B, (int64_t)G * N, K, BN)
                                          : hg_tensor_map(ex, encode, &tb, B, (int64_t)G * K, N, hg::BK));
    if (!ok) return;
    const int64_t ntn = (N + BN - 1) / BN;
    const int64_t upper = ((a_rows + hg::BM - 1) / hg::BM + G) * ntn; /* >= the tile count, whatever the m_g */
    int64_t grid = upper < st->sms ? upper : st->sms;
    if (opt && opt->max_ctas > 0 && grid > opt->max_ctas) grid = opt->max_ctas;
    hg::watchdog* wd = opt ? opt->wd : NULL;
    const unsigned long long timeout = opt && opt->timeout_ns ? opt->timeout_ns : 20000000000ull;
    if (b_layout == hg::B_NK) {
        if (v == 0) hg_launch<0, hg::B_NK>(ex, ta, tb, C, counts, G, N, K, (int)a_rows, (int)grid, wd, timeout);
        else hg_launch<1, hg::B_NK>(ex, ta, tb, C, counts, G, N, K, (int)a_rows, (int)grid, wd, timeout);
    } else {
        if (v == 0) hg_launch<0, hg::B_KN>(ex, ta, tb, C, counts, G, N, K, (int)a_rows, (int)grid, wd, timeout);
        else hg_launch<1, hg::B_KN>(ex, ta, tb, C, counts, G, N, K, (int)a_rows, (int)grid, wd, timeout);
    }
}

/* The shapes and pointers the weight-gradient kernel takes (see hg's "The experts' weight gradient"). */
static bool hopper_wgrad_fits(const void* dW, const void* dY, const void* X, int G, int M, int N, int64_t a_rows) {
    return M > 0 && N > 0 && M % 8 == 0 && N % 8 == 0 && G >= 1 && G <= hg::MAX_GROUPS && a_rows >= 0 &&
           a_rows < ((int64_t)1 << 31) &&
           (int64_t)G * ((M + hg::BM - 1) / hg::BM) * ((N + 127) / 128) < ((int64_t)1 << 31) &&
           ((uintptr_t)dW % 16 | (uintptr_t)dY % 16 | (uintptr_t)X % 16) == 0;
}

template <int V>
static void hg_wgrad_launch(const mt_exec* ex, const CUtensorMap& tdy, const CUtensorMap& tx, float* dW, const int32_t* counts,
                            int G, int M, int N, int a_rows, float beta, int grid, hg::watchdog* wd,
                            unsigned long long timeout_ns) {
    constexpr int BN = hg::variant<V>::BN, STAGES = hg::variant<V>::STAGES;
    hg::grouped_wgrad_kernel<BN, STAGES><<<grid, hg::THREADS, hg::cfg<BN, STAGES>::SMEM, ex->stream>>>(
        tdy, tx, dW, counts, G, M, N, a_rows, beta, wd, timeout_ns);
    LAUNCH_CHECK(ex->error);
}

/* The experts' weight gradient: for each group g, dW_g [M, N] (fp32) = beta dW_g + dY_g^T X_g, dY [a_rows, M] and
 * X [a_rows, N] bf16 with the groups' rows concatenated (counts = m [G] int32 on the device, read by the kernel;
 * rows from sum m_g on are never used). A group without rows: dW_g zeroed where beta == 0, else left as it is.
 * beta: 0 or 1 in the model (accumulation over micro-batches); any finite value works. Refuses (recorded,
 * nothing queued) what hopper_grouped_gemm refuses and shapes hopper_wgrad_fits does not take. */
static void hopper_grouped_wgrad(const mt_exec* ex, float* dW, const __nv_bfloat16* dY, const __nv_bfloat16* X,
                                 int64_t a_rows, const int32_t* counts, int G, int M, int N, float beta,
                                 const hg::options* opt = NULL) {
    if (ex->error->status != MT_OK) return;
    mt_hopper_gemm_state local = {0, 0, NULL};
    mt_hopper_gemm_state* st = ex->gemm ? &ex->gemm->hopper : &local;
    if (!hopper_gemm_available(st)) {
        mt_gpu_fail(ex->error, MT_ERR_ARG, "hopper_grouped_wgrad: this GPU or build has no sm_90a kernel (needs compute "
                                           "capability 9.x and GPU_ARCH=90, which builds sm_90a)");
        return;
    }
    if (!hopper_wgrad_fits(dW, dY, X, G, M, N, a_rows)) {
        mt_gpu_fail(ex->error, MT_ERR_ARG, "hopper_grouped_wgrad: G %d M %d N %d rows %lld not taken (M %% 8 == N %% 8 == 0, "
                                           "1 <= G <= %d, 16-byte aligned pointers)", G, M, N, (long long)a_rows, hg::MAX_GROUPS);
        return;
    }
    if (a_rows == 0) { /* no rows at all (a TMA map needs one): every group is empty */
        if (beta == 0.0f)
            CUDA_CHECK(ex->error, cudaMemsetAsync(dW, 0, sizeof(float) * (size_t)G * M * N, ex->stream));
        return;
    }
    int v = opt && opt->variant >= 0 && opt->variant < hg::VARIANTS ? opt->variant : -1;
    if (v < 0) v = N % 256 != 0 && N % 256 <= 128 ? 1 : 0; /* hopper_grouped_gemm's rule, on dW's columns */
    CUtensorMap tdy, tx;
    const hg_encode_tiled_fn encode = (hg_encode_tiled_fn)st->encode;
    if (!hg_tensor_map(ex, encode, &tdy, dY, a_rows, M, hg::BK) || !hg_tensor_map(ex, encode, &tx, X, a_rows, N, hg::BK))
        return;
    const int BN = v == 0 ? hg::variant<0>::BN : hg::variant<1>::BN;
    const int64_t tiles = (int64_t)G * ((M + hg::BM - 1) / hg::BM) * ((N + BN - 1) / BN);
    int64_t grid = tiles < st->sms ? tiles : st->sms;
    if (opt && opt->max_ctas > 0 && grid > opt->max_ctas) grid = opt->max_ctas;
    hg::watchdog* wd = opt ? opt->wd : NULL;
    const unsigned long long timeout = opt && opt->timeout_ns ? opt->timeout_ns : 20000000000ull;
    if (v == 0) hg_wgrad_launch<0>(ex, tdy, tx, dW, counts, G, M, N, (int)a_rows, beta, (int)grid, wd, timeout);
    else hg_wgrad_launch<1>(ex, tdy, tx, dW, counts, G, M, N, (int)a_rows, beta, (int)grid, wd, timeout);
}

/* ============================================================================================== */
/* 13.2 Hopper attention forward (FlashAttention-3 style: TMA, wgmma, warp specialisation)       */
/*    The causal bf16 attention forward at head dims 64 and 128 on Hopper, an alternative to      */
/*    section 9's FA2 forward (mma.sync): on an H200 its lab dev/cuda/flash_attention_hopper.cu   */
/*    measured 507-611 TFLOP/s at d = 128 causal against ~264 for section 9's kernel, and 277-435 */
/*    at d = 64 (GPT-2's heads). It writes the same O (through the same fa::heads_view) and the   */
/*    same LSE [B, H, T] (fp32, natural log) that section 9's backward reads, so only the forward */
/*    changes. PTX wrappers: section 13.1's (hg), and fa3's own m64n64k16 for P V at d = 64.      */
/*    Selection (attention_forward_fast): this kernel where it runs (sm_90a build, compute 9.x,   */
/*    probed once into mt_hopper_gemm_state.attn), d = 64 or 128 (fa3::head_dim_ok), no dropout,  */
/*    no document mask; MT_ATTN_FWD=fa2 forces section 9's forward. Also without the causal mask  */
/*    on a window of Tq query rows against Tk keys with a strided LSE (hopper_attention_forward_  */
/*    rect): the context-parallel ring's steps against another rank's block (section 13.4).       */
/*    defines: namespace fa3 (the kernel, a template on d and CAUSAL), hopper_attention_available,*/
/*    hopper_attention_forward_rect, hopper_attention_forward, attn_choice_parse, attn_fwd_parse,  */
/*    attention_forward_fast.                                                                     */
/* ============================================================================================== */
/*
 * ---- The CTA: 384 threads, persistent over work tiles of 128 query rows of one (b, h) ---------------
 *   Grid min(tiles, SMs), 1-D; the work tiles (m_block, h, b), ceil(T / 128) * H * B of them, numbered
 *   longest first (fa3::tile_of: the last m_block, with the most key tiles under the causal mask, first;
 *   h fastest), taken in section 13.1's snake order (hg::snake_tile: static, every CTA's sum near the mean).
 *   One CTA per SM runs the whole grid, so the next tile's Q and first K/V loads overlap this tile's last
 *   P V and epilogue (with one short CTA per tile, ~1536 at GPT-2 124M's shape, each CTA's prologue and
 *   epilogue left the tensor cores idle). Each tile is computed exactly as a one-tile CTA would, so the
 *   outputs do not depend on the grid.
 *   One shape at both head dims d, the lab's (its d = 64 numbers above are this shape): 128 query rows x
 *   128-key tiles, 2 K/V stages, overlap and ping-pong; only the d-wide parts (the Q, K, V tiles, O, the
 *   N of P V) follow d.
 *   warpgroup 0 producer (setmaxnreg.dec 24): one thread, per work tile, loads the Q tile once the
 *     consumers are past the previous tile's last S ("Q empty", 8 consumer-warp arrivals), then for key
 *     tile n the K tile and the V tile into the ring's next stage (a CTA-wide count, across tiles), each
 *     after that stage's "empty" mbarrier (8 consumer-warp arrivals) says the consumers are done with it.
 *     K and V have their own full/empty barriers.
 *   warpgroups 1, 2 consumers (setmaxnreg.inc 240), 64 query rows each: S_n = Q K_n^T (wgmma m64n128k16,
 *     both K-major in shared memory, d / 16 of them), the online softmax in registers (running max m,
 *     sum l; exp2 of scale*log2(e)-scaled scores), O += P V (wgmma m64n{d}k16, P from registers as
 *     bf16, V read N-major: wgmma's transposed B). Intra-warpgroup overlap: S_n and P_{n-1} V_{n-1}
 *     are issued back to back and the softmax of S_n runs while the second is in flight. Ping-pong: the
 *     two consumers take turns to issue (two "turn" mbarriers, 4 arrivals each), so one's softmax
 *     overlaps the other's products.
 *   Causal: a work tile stops at its diagonal key tile; the longest tiles are taken first (above).
 *
 * ---- Tensor maps over the strided views (built per call on the host) --------------------------------
 *   A view (fa::heads_view) puts element c of row t of head h of batch b at
 *   p + b*batch + t*row + (h / qpg)*group + (h % qpg)*head + c. The map is 5-D: (c: d, t: T,
 *   h % qpg: qpg, h / qpg: groups, b: B) with those strides in bytes (multiples of 16: fa::view_ok), so
 *   the fused QKV rows are read in place. Boxes [1][1][1][128 rows][64 columns] with the 128-byte swizzle
 *   (a box row of 64 bf16 is exactly one 128-byte swizzle span): a [128 x d] tile takes d / 64 loads,
 *   stored as d / 64 [128][64] column halves; a box past T is zero-filled by TMA within its own head.
 *   Keys >= T are masked to -inf; rows >= T are not stored.
 *
 * ---- Descriptors (section 13.1's make_desc / make_desc_n_major) -------------------------------------
 *   Q, K (K-major): k-slice kk of d starts in column half kk / 4, byte (kk % 4) * 32 of the row (d = 64:
 *   one half, kk < 4).
 *   V (N-major, B of O = P V): the next 64 columns of d are the next column half, 128 keys x 128 bytes
 *   = 16 KiB on (leading byte offset; at d = 64 wgmma's N is one 64-column span and never steps to it),
 *   8 keys are 1024 bytes (stride byte offset); k-slice kk (keys 16kk..16kk+15) starts 2048 kk bytes on.
 *   P as wgmma's register A: the accumulator layout of a k16 slice equals that of two adjacent n8 column
 *   blocks, so P's slice kk is pack(s[8kk..8kk+7]) in pairs, no data movement.
 *
 * ---- Numerics and determinism ---------------------------------------------------------------------
 *   fp32 scores and sums, P rounded to bf16 for the P V product, O = (sum P V) / l rounded to bf16 once;
 *   LSE = scale * m + log(l). Each output is one thread's sums in a fixed order (key tiles ascending):
 *   bitwise the same from run to run. Section 9's forward sums in 64-key tiles in another order, so the
 *   two agree to rounding, not bitwise (bf16 runs change in their last bits with this kernel).
 *
 * ---- Resources ------------------------------------------------------------------------------------
 *   Shared memory Q + 2 x (K + V) = 160 KiB at d = 128, 80 KiB at d = 64 (+ barriers, alignment slack);
 *   one CTA per SM either way (384 threads x 168 registers fill the register file). Consumer registers
 *   per thread: o d/2 + s 64 + P 32 (the lab's kernel used 184 at d = 128, 152 at d = 64, of
 *   setmaxnreg's 240); ptxas (nvcc 13) reports no spills for either instantiation here.
 *
 * ---- Watchdog -------------------------------------------------------------------------------------
 *   Every mbarrier wait is section 13.1's bounded wait (hg::mbar_wait: 20 s, then trap), so a deadlock
 *   ends the kernel with an error instead of hanging the trainer.
 */
namespace fa3 {
constexpr int BM = 128;      /* query rows per CTA: 2 consumer warpgroups x 64 */
constexpr int BN = 128;      /* keys per tile */
constexpr int STAGES = 2;    /* K/V pipeline stages */
constexpr int THREADS = 384; /* producer warpgroup + 2 consumer warpgroups */
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240; /* 24*128 + 240*256 = 168*384: the register file */
constexpr unsigned long long TIMEOUT_NS = 20000000000ull;
/* the head dims the kernel is built for (the launcher's and the selection's one rule) */
constexpr bool head_dim_ok(int d) { return d == 64 || d == 128; }

/* Shared memory at head dim D (byte offsets from the 1024-aligned base): Q, STAGES K and STAGES V tiles
 * (each d / 64 column halves of [128][64] bf16), then the mbarriers. */
template <int D>
struct layout {
    static_assert(head_dim_ok(D), "head dim 64 or 128");
    static constexpr int TILE_Q = BM * D * 2, TILE_KV = BN * D * 2; /* 32 KiB each at d = 128, 16 at d = 64 */
    static constexpr int OFF_Q = 0, OFF_K = TILE_Q, OFF_V = OFF_K + STAGES * TILE_KV;
    static constexpr int OFF_BAR = OFF_V + STAGES * TILE_KV;
    static constexpr int NBAR = 1 + 4 * STAGES + 2 + 1; /* Q full; K full, V full, K empty, V empty per stage; 2 turns;
                                                           Q empty */
    static constexpr int SMEM = OFF_BAR + NBAR * 8 + 1024; /* + slack to align the base: 160 / 80 KiB + */
    static_assert(SMEM <= 227 * 1024, "shared memory");
    static_assert(TILE_Q % 1024 == 0 && TILE_KV % 1024 == 0, "tiles on 1024-byte swizzle atoms");
};

/* What the kernel takes besides the tensor maps: O's view (written with plain stores), LSE (row t of head h of
 * batch b at LSE[(b H + h) lse_stride + t]). T query rows, Tk keys (causal: Tk == T, lse_stride == T). */
struct params {
    fa::heads_view<bf16> O;
    float* LSE;
    int B, H, Hkv, T;
    int Tk;           /* keys */
    int lse_stride;   /* LSE's row count per (b, h) */
    int m_blocks;     /* ceil(T / BM): query tiles per (b, h) */
    int tiles;        /* work tiles m_blocks * H * B (tile_of's numbering); the grid strides over them */
    float scale;      /* 1/sqrt(d) */
    float scale_log2; /* scale * log2(e): exp(scale x) = exp2(scale_log2 x) */
    hg::watchdog* wd; /* NULL: a timed-out wait just traps */
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* s[BN/2]: this thread's scores of key tile n (rows row0 = 16w+g, row1 = row0+8); keys >= Tk and, CAUSAL, keys
 * after the row become -inf */
template <bool CAUSAL>
__device__ __forceinline__ void mask_tile(float (&s)[BN / 2], int n, int row0, int row1, int Tk, int t) {
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int col = n * BN + 8 * j + 2 * t + (e & 1);
            const int row = e < 2 ? row0 : row1;
            if (col >= Tk || (CAUSAL && col > row)) s[4 * j + e] = -INFINITY;
        }
}

/* Online softmax over one tile for the thread's two rows: m (raw q.k units) and l (this thread's partial
 * sum; the row's 4 threads are summed at the end) updated; c0, c1 = the factors for O's rows; s becomes
 * exp(scale (s - m)). A row whose max is still -inf uses 0 as its base (zeros, no NaN). */
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 2], float& m0, float& m1, float& l0, float& l1, float& c0,
                                             float& c1, float scale_log2) {
    float x0 = m0, x1 = m1;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        x0 = fmaxf(x0, fmaxf(s[4 * j], s[4 * j + 1]));
        x1 = fmaxf(x1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    const float b0 = x0 == -INFINITY ? 0.0f : x0 * scale_log2;
    const float b1 = x1 == -INFINITY ? 0.0f : x1 * scale_log2;
    c0 = fa::exp2_approx(m0 * scale_log2 - b0); /* m0 = -inf: 0 */
    c1 = fa::exp2_approx(m1 * scale_log2 - b1);
    m0 = x0;
    m1 = x1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        s[4 * j] = fa::exp2_approx(fmaf(s[4 * j], scale_log2, -b0));
        s[4 * j + 1] = fa::exp2_approx(fmaf(s[4 * j + 1], scale_log2, -b0));
        s[4 * j + 2] = fa::exp2_approx(fmaf(s[4 * j + 2], scale_log2, -b1));
        s[4 * j + 3] = fa::exp2_approx(fmaf(s[4 * j + 3], scale_log2, -b1));
        sum0 += s[4 * j] + s[4 * j + 1];
        sum1 += s[4 * j + 2] + s[4 * j + 3];
    }
    l0 = l0 * c0 + sum0;
    l1 = l1 * c1 + sum1;
}

template <int D>
__device__ __forceinline__ void rescale_o(float (&o)[D / 2], float c0, float c1) {
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        o[4 * j] *= c0;
        o[4 * j + 1] *= c0;
        o[4 * j + 2] *= c1;
        o[4 * j + 3] *= c1;
    }
}

/* P (fp32, accumulator layout) -> bf16 register-A fragments, one per k16 slice of keys */
__device__ __forceinline__ void convert_p(const float (&s)[BN / 2], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        pa[kk][0] = fa::pack_bf16(s[8 * kk], s[8 * kk + 1]);
        pa[kk][1] = fa::pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = fa::pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = fa::pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

/* S[64 x BN] = Q_w K^T over d; q_base = the warpgroup's first Q row in column half 0 */
template <int D>
__device__ __forceinline__ void gemm_qk(float (&s)[BN / 2], uint32_t q_base, uint32_t k_base) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const uint32_t off_q = (kk / 4) * (BM * 128) + (kk % 4) * 32;
        const uint32_t off_k = (kk / 4) * (BN * 128) + (kk % 4) * 32;
        hg::wgmma_m64n128k16<0>(s, hg::make_desc(q_base + off_q), hg::make_desc(k_base + off_k), kk > 0);
    }
}

/* D[64 x 64] (+)= A[64 x 16] B[16 x 64]: section 13.1's wgmma_m64n128k16_rs at N = 64 (P V at d = 64), A from
 * registers, B N-major in shared memory (imm-trans-b = 1); 32 fp32 accumulators per thread. */
__device__ __forceinline__ void wgmma_m64n64k16_rs(float* d, const uint32_t* a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

/* O[64 x D] += P[64 x BN] V[BN x D], V N-major: column halves BN*128 bytes apart (d = 64: one half) */
template <int D>
__device__ __forceinline__ void gemm_pv(float (&o)[D / 2], uint32_t (&pa)[BN / 16][4], uint32_t v_base) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        const uint64_t desc = hg::make_desc_n_major(v_base + kk * 16 * 128, BN * 128);
        if constexpr (D == 128) hg::wgmma_m64n128k16_rs(o, pa[kk], desc, 1);
        else wgmma_m64n64k16_rs(o, pa[kk], desc, 1);
    }
}

/* consumers' wait: the wgmma that follows is .sync.aligned, so the warp reconverges after the spin */
__device__ __forceinline__ void wait_warp(uint32_t bar, uint32_t parity, hg::watchdog* wd, int role, int what, int tile,
                                          int n) {
    hg::mbar_wait(bar, parity, wd, TIMEOUT_NS, role, what, tile, n);
    __syncwarp();
}

/* Work tile i (0 <= i < p.tiles) of the persistent grid: 128 query rows m_block of head h of batch b, and its
 * key tile count (under the causal mask; without it every tile has all ceil(Tk / BN)). Longest first (LPT): i / (H B) counts m_blocks down from the last, whose
 * rows see the most keys, so with the snake order (hg::snake_tile) every CTA's sum of key tiles is near
 * equal and the short tiles fill the tail. Within an m_block h runs fastest: the CTAs running
 * at once take the heads of one sequence, so under GQA the qpg heads of a group read the same K/V tiles
 * from L2. */
struct work {
    int m_block, h, b, n_tiles;
};
template <bool CAUSAL>
__device__ __forceinline__ work tile_of(int i, const params& p) {
    const int hb = p.H * p.B;
    work w;
    w.m_block = p.m_blocks - 1 - i / hb;
    w.h = (i % hb) % p.H;
    w.b = (i % hb) / p.H;
    w.n_tiles = CAUSAL ? (min(p.T, (w.m_block + 1) * BM) + BN - 1) / BN : (p.Tk + BN - 1) / BN;
    return w;
}
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

/* watchdog "stage" field: which barrier was waited for */
enum { WAIT_Q_FULL = 0, WAIT_K_FULL, WAIT_V_FULL, WAIT_K_EMPTY, WAIT_V_EMPTY, WAIT_TURN, WAIT_Q_EMPTY };

/* D: the head dim, 64 or 128 (layout's static_assert); CAUSAL: the causal mask (Tk == T), else every query
 * sees all Tk keys (section 9.5's ring steps against another rank's block) */
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, 1)
    fa3_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                   const __grid_constant__ CUtensorMap tm_v, params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hg;
    using L = layout<D>;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = hg::smem_u32(smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    const uint32_t sQ = sbase + L::OFF_Q, sK = sbase + L::OFF_K, sV = sbase + L::OFF_V, bars = sbase + L::OFF_BAR;
    const uint32_t q_full = bars, q_empty = bars + 8u * (1 + 4 * STAGES + 2); /* after the turns */
    auto k_full = [&](int s) { return bars + 8u * (1 + s); };
    auto v_full = [&](int s) { return bars + 8u * (1 + STAGES + s); };
    auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * STAGES + s); };
    auto turn = [&](int w) { return bars + 8u * (1 + 4 * STAGES + w); }; /* consumer w may issue its GEMMs */

    const int qpg = p.H / p.Hkv;
    const int T = p.T, Tk = p.Tk;
    /* warp-uniform by construction (a broadcast from lane 0): ptxas then gives each role's branch the
     * register budget its setmaxnreg sets */
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0), lane = threadIdx.x % 32, wg = warp / 4;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 8); /* lane 0 of each of the 8 consumer warps, after its tile's last S = Q K^T */
        for (int s = 0; s < STAGES; s++) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 8); /* lane 0 of each of the 8 consumer warps */
            mbar_init(v_empty(s), 8);
        }
        mbar_init(turn(0), 4); /* lane 0 of each warp of the other consumer warpgroup */
        mbar_init(turn(1), 4);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    /* Persistence: this CTA takes work tiles in section 13.1's snake order (hg::snake_tile; tile_of); j counts them. The
     * phases run on CTA-wide counters, never restarted per tile, so every barrier sees one unbroken sequence:
     *   Q: tile j fills q_full's phase j (consumers wait parity j & 1); the producer reloads Q only after
     *     q_empty's phase j - 1 (all 8 consumer warps past tile j-1's last S; wait parity (j & 1) ^ 1, which
     *     passes at once for j = 0), so q_full is never a phase ahead of a consumer still on tile j - 1.
     *   K/V: key tile n of a work tile is this CTA's ring entry g = kv + n (kv: the entries of its earlier
     *     tiles): stage g % STAGES, phase (g / STAGES) & 1, as the one-tile kernel's n.
     *   turn: issue slots are numbered across tiles (slot: the earlier tiles' n_tiles + 1 each), and both
     *     warpgroups work the same tile, so the ping-pong alternates without a break (turn_wait's comment).
     * The next tile's Q and first K/V stages load while the consumers finish this tile's last P V and
     * epilogue; a CTA with no tile (the grid never exceeds p.tiles) skips both loops. */
    if (wg == 0) {
        /* ---- producer ---- */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp == 0 && lane == 0) {
            tma_prefetch_desc(&tm_q);
            tma_prefetch_desc(&tm_k);
            tma_prefetch_desc(&tm_v);
            int kv = 0, j = 0;
            for (int i; (i = hg::snake_tile(j, p.tiles)) >= 0; j++) {
                const work wk = tile_of<CAUSAL>(i, p);
                const int hkv = wk.h / qpg;
                mbar_wait(q_empty, (j & 1) ^ 1, p.wd, TIMEOUT_NS, 0, WAIT_Q_EMPTY, i, 0);
                mbar_arrive_expect_tx(q_full, L::TILE_Q);
#pragma unroll
                for (int c = 0; c < D / 64; c++)
                    tma_load_5d(sQ + c * BM * 128, &tm_q, q_full, 64 * c, wk.m_block * BM, wk.h % qpg, wk.h / qpg, wk.b);
                for (int n = 0; n < wk.n_tiles; n++) {
                    const int g = kv + n, s = g % STAGES;
                    const uint32_t ph = (g / STAGES) & 1;
                    mbar_wait(k_empty(s), ph ^ 1, p.wd, TIMEOUT_NS, 0, WAIT_K_EMPTY, i, n);
                    mbar_arrive_expect_tx(k_full(s), L::TILE_KV);
#pragma unroll
                    for (int c = 0; c < D / 64; c++)
                        tma_load_5d(sK + s * L::TILE_KV + c * BN * 128, &tm_k, k_full(s), 64 * c, n * BN, 0, hkv, wk.b);
                    mbar_wait(v_empty(s), ph ^ 1, p.wd, TIMEOUT_NS, 0, WAIT_V_EMPTY, i, n);
                    mbar_arrive_expect_tx(v_full(s), L::TILE_KV);
#pragma unroll
                    for (int c = 0; c < D / 64; c++)
                        tma_load_5d(sV + s * L::TILE_KV + c * BN * 128, &tm_v, v_full(s), 64 * c, n * BN, 0, hkv, wk.b);
                }
                kv += wk.n_tiles;
            }
        }
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1;                              /* consumer warpgroup 0 or 1 */
    const int w = warp % 4, g = lane / 4, t = lane % 4; /* warp in the warpgroup, row group, column pair */
    const uint32_t q_base = sQ + cw * 64 * 128;
    const float sl2 = p.scale_log2;

    float o[D / 2];
    float s[BN / 2];
    uint32_t pa[BN / 16][4];
    /* Ping-pong: issue slot k (per tile 0: S_0; 1 .. n_tiles-1: S_k and P_{k-1} V_{k-1}; n_tiles: the last
     * P V), numbered across this CTA's tiles, of warpgroup 0 waits for warpgroup 1's slot k-1, that of
     * warpgroup 1 for warpgroup 0's slot k; each arrives on the other's turn barrier once it has issued.
     * turn(0) completes a phase per slot of warpgroup 1, turn(1) one per slot of warpgroup 0. When
     * warpgroup 0 waits for slot k, warpgroup 1 has issued k-1 slots (it needed ours of k-1) and at most k
     * (its slot k needs ours): turn(0) has completed k-1 or k phases, parity (k-1) & 1 passes at k only;
     * likewise warpgroup 1 at slot k finds turn(1) at k or k+1 phases and waits for parity k & 1. A barrier
     * is thus never more than one phase ahead of its waiter, so the parity names the phase; both warpgroups
     * take the same tiles with the same n_tiles, so the counts agree at every tile boundary. tile: the work
     * tile (the watchdog's record). */
    auto turn_wait = [&](int k, int tile, int n) {
        if (cw == 0 && k > 0) wait_warp(turn(0), (k - 1) & 1, p.wd, 2, WAIT_TURN, tile, n);
        if (cw == 1) wait_warp(turn(1), k & 1, p.wd, 2, WAIT_TURN, tile, n);
    };
    auto turn_pass = [&]() {
        __syncwarp();
        if (lane == 0) mbar_arrive(turn(1 - cw));
    };

    int kv = 0, slot = 0, j = 0; /* this CTA's K/V ring entries, issue slots and work tiles so far */
    for (int i; (i = hg::snake_tile(j, p.tiles)) >= 0; j++) {
        const work wk = tile_of<CAUSAL>(i, p);
        const int m_block = wk.m_block, h = wk.h, b = wk.b, n_tiles = wk.n_tiles;
        const int wg_row0 = m_block * BM + cw * 64; /* the warpgroup's first query row */
        const int row0 = wg_row0 + 16 * w + g, row1 = row0 + 8;
        /* a tile needs masking when it reaches past Tk or (causal) its last key is after the warpgroup's first row */
        auto needs_mask = [&](int n) { return (n + 1) * BN > Tk || (CAUSAL && (n + 1) * BN - 1 > wg_row0); };
        /* after S_n is read: K stage st is free, and after the tile's last S so is Q */
        auto k_done = [&](int st, int n) {
            if (lane == 0) {
                mbar_arrive(k_empty(st));
                if (n == n_tiles - 1) mbar_arrive(q_empty);
            }
        };

#pragma unroll
        for (int e = 0; e < D / 2; e++) o[e] = 0.0f;
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f, c0, c1;

        wait_warp(q_full, j & 1, p.wd, 1, WAIT_Q_FULL, i, 0);
        /* key tile 0: S_0 and its softmax (O is zero: no rescale) */
        {
            const int st = kv % STAGES;
            const uint32_t ph = (kv / STAGES) & 1;
            wait_warp(k_full(st), ph, p.wd, 1, WAIT_K_FULL, i, 0);
            turn_wait(slot, i, 0);
            wgmma_fence();
            gemm_qk<D>(s, q_base, sK + st * L::TILE_KV);
            wgmma_commit();
            turn_pass();
            wgmma_wait<0>();
            reg_fence<BN / 2>(s);
            k_done(st, 0);
        }
        if (needs_mask(0)) mask_tile<CAUSAL>(s, 0, row0, row1, Tk, t);
        softmax_tile(s, m0, m1, l0, l1, c0, c1, sl2);
        convert_p(s, pa);
        for (int n = 1; n < n_tiles; n++) {
            const int gn = kv + n, st = gn % STAGES, pst = (gn - 1) % STAGES;
            const uint32_t ph = (gn / STAGES) & 1, pph = ((gn - 1) / STAGES) & 1;
            wait_warp(k_full(st), ph, p.wd, 1, WAIT_K_FULL, i, n);
            wait_warp(v_full(pst), pph, p.wd, 1, WAIT_V_FULL, i, n - 1);
            turn_wait(slot + n, i, n);
            reg_fence<D / 2>(o);
            reg_fence<BN / 4>(&pa[0][0]);
            wgmma_fence();
            gemm_qk<D>(s, q_base, sK + st * L::TILE_KV); /* S_n */
            wgmma_commit();
            gemm_pv<D>(o, pa, sV + pst * L::TILE_KV); /* O += P_{n-1} V_{n-1}, in flight during the softmax */
            wgmma_commit();
            turn_pass();
            wgmma_wait<1>(); /* S_n done */
            reg_fence<BN / 2>(s);
            k_done(st, n);
            if (needs_mask(n)) mask_tile<CAUSAL>(s, n, row0, row1, Tk, t);
            softmax_tile(s, m0, m1, l0, l1, c0, c1, sl2);
            wgmma_wait<0>(); /* P_{n-1} V_{n-1} done: O and pa are free */
            reg_fence<D / 2>(o);
            reg_fence<BN / 4>(&pa[0][0]);
            if (lane == 0) mbar_arrive(v_empty(pst));
            rescale_o<D>(o, c0, c1);
            convert_p(s, pa);
        }
        {
            const int gn = kv + n_tiles - 1, st = gn % STAGES;
            const uint32_t ph = (gn / STAGES) & 1;
            wait_warp(v_full(st), ph, p.wd, 1, WAIT_V_FULL, i, n_tiles - 1);
            turn_wait(slot + n_tiles, i, n_tiles);
            reg_fence<D / 2>(o);
            reg_fence<BN / 4>(&pa[0][0]);
            wgmma_fence();
            gemm_pv<D>(o, pa, sV + st * L::TILE_KV);
            wgmma_commit();
            turn_pass();
            wgmma_wait<0>();
            reg_fence<D / 2>(o);
            if (lane == 0) mbar_arrive(v_empty(st));
        }
        kv += n_tiles;
        slot += n_tiles + 1;

        /* ---- epilogue: O / l into O's view, LSE = scale * m + log(l); straight from registers, so the
         * producer's loads of the next tile run under it ---- */
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        const size_t bh = (size_t)b * p.H + h;
        bf16* oh = p.O.at(b, h, qpg) + 2 * t;
        if (row0 < T) {
            bf16* out = oh + (int64_t)row0 * p.O.row;
#pragma unroll
            for (int jj = 0; jj < D / 8; jj++)
                *reinterpret_cast<uint32_t*>(out + 8 * jj) = fa::pack_bf16(o[4 * jj] * inv0, o[4 * jj + 1] * inv0);
            if (t == 0) p.LSE[bh * p.lse_stride + row0] = m0 * p.scale + logf(l0);
        }
        if (row1 < T) {
            bf16* out = oh + (int64_t)row1 * p.O.row;
#pragma unroll
            for (int jj = 0; jj < D / 8; jj++)
                *reinterpret_cast<uint32_t*>(out + 8 * jj) = fa::pack_bf16(o[4 * jj + 2] * inv1, o[4 * jj + 3] * inv1);
            if (t == 0) p.LSE[bh * p.lse_stride + row1] = m1 * p.scale + logf(l1);
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap(); /* built without sm_90a: never launched (hopper_attention_available says no) */
#endif
}
} /* namespace fa3 */

/* One head dim's kernel (causal or not) built for sm_90a with the registers setmaxnreg's 24/240 split needs,
 * and its shared memory allowed (the opt-in limit optin) and set. */
template <int D, bool CAUSAL>
static bool fa3_kernel_ready(int optin) {
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, fa3::fa3_fwd_kernel<D, CAUSAL>) == cudaSuccess &&
           a.numRegs * fa3::THREADS >= fa3::PRODUCER_REGS * 128 + fa3::CONSUMER_REGS * 256 &&
           fa3::layout<D>::SMEM <= optin &&
           cudaFuncSetAttribute(fa3::fa3_fwd_kernel<D, CAUSAL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                fa3::layout<D>::SMEM) == cudaSuccess;
}

/* Whether this process's GPU runs section 13.2's kernel: section 13.1's probe (compute 9.x, the driver's
 * cuTensorMapEncodeTiled) and both head dims' kernels ready (fa3_kernel_ready). Probed once into s->attn; a
 * failed probe leaves no CUDA error behind. */
static bool hopper_attention_available(mt_hopper_gemm_state* s) {
    if (s->attn) return s->attn > 0;
    if (!hopper_gemm_available(s)) {
        s->attn = -1;
        return false;
    }
    int dev = 0, optin = 0;
    const bool ok = cudaGetDevice(&dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
                    fa3_kernel_ready<128, true>(optin) && fa3_kernel_ready<64, true>(optin) &&
                    fa3_kernel_ready<128, false>(optin) && fa3_kernel_ready<64, false>(optin);
    (void)cudaGetLastError();
    s->attn = ok ? 1 : -1;
    return ok;
}

/* A view of H heads (qpg per group) of d columns as a 5-D TMA map (see the section's banner): boxes of 64
 * columns x box_rows rows (the forward's 128; section 13.3 takes 64 too). A dimension of size 1 takes a stride that
 * is always valid (its coordinate is always 0). */
static bool fa3_tensor_map(hg_encode_tiled_fn encode, CUtensorMap* m, attn_cview v, int B, int H, int qpg, int T,
                           int d, int box_rows = fa3::BM) {
    const int64_t big = (int64_t)T * v.row * 2;
    const cuuint64_t dims[5] = {(cuuint64_t)d, (cuuint64_t)T, (cuuint64_t)qpg, (cuuint64_t)(H / qpg), (cuuint64_t)B};
    const cuuint64_t strides[4] = {(cuuint64_t)v.row * 2, (cuuint64_t)(qpg > 1 ? v.head * 2 : big),
                                   (cuuint64_t)(H / qpg > 1 ? v.group * 2 : big), (cuuint64_t)(B > 1 ? v.batch * 2 : big)};
    const cuuint32_t box[5] = {64, (cuuint32_t)box_rows, 1, 1, 1};
    const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < 4; i++)
        if (strides[i] == 0 || strides[i] % 16 != 0 || strides[i] >= ((cuuint64_t)1 << 40)) return false;
    return encode(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, (void*)v.p, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Attention forward on section 13.2's kernel, without dropout or documents: O (H heads, Tq rows), LSE (row t of
 * head h of batch b at LSE[(b H + h) lse_stride + t], fp32) from Q (H heads, Tq rows), K, V (Hkv heads, Tk
 * rows), views of any layout fa::view_ok takes, d = 64 or 128. causal: the causal mask (Tq == Tk needed), else
 * every query sees every key (section 9.5's ring steps against another rank's block). cudaErrorInvalidValue
 * (nothing queued) for what it does not take; cudaErrorNotSupported where the kernel does not run
 * (hopper_attention_available). wd: the tests' watchdog record (NULL: trap only); max_ctas > 0: that many
 * CTAs, at most one per tile (the test's many-tiles-per-CTA run, the lab's one-tile-per-CTA timing; the
 * outputs do not depend on it). */
static cudaError_t hopper_attention_forward_rect(mt_hopper_gemm_state* st, attn_view O, float* LSE, int lse_stride,
                                                 attn_cview Q, attn_cview K, attn_cview V, int B, int H, int Hkv, int Tq,
                                                 int Tk, int d, bool causal, cudaStream_t stream,
                                                 hg::watchdog* wd = NULL, int max_ctas = 0) {
    const int m_blocks = (Tq + fa3::BM - 1) / fa3::BM;
    const int64_t tiles = (int64_t)m_blocks * H * B; /* B, H >= 1 once shape_ok says yes */
    if (!fa3::head_dim_ok(d) || !fa::shape_ok(B, H, Hkv, Tq, d) || !fa::shape_ok(B, H, Hkv, Tk, d) ||
        (causal && Tq != Tk) || lse_stride < Tq || !fa::view_ok(O) || !fa::view_ok(Q) || !fa::view_ok(K) ||
        !fa::view_ok(V) || tiles > INT_MAX / 2) /* a tile index stays an int */
        return cudaErrorInvalidValue;
    if (!hopper_attention_available(st)) return cudaErrorNotSupported;
    const hg_encode_tiled_fn encode = (hg_encode_tiled_fn)st->encode;
    CUtensorMap mq, mk, mv;
    if (!fa3_tensor_map(encode, &mq, Q, B, H, H / Hkv, Tq, d) || !fa3_tensor_map(encode, &mk, K, B, Hkv, 1, Tk, d) ||
        !fa3_tensor_map(encode, &mv, V, B, Hkv, 1, Tk, d))
        return cudaErrorInvalidValue;
    fa3::params p;
    p.O = O;
    p.LSE = LSE;
    p.B = B;
    p.H = H;
    p.Hkv = Hkv;
    p.T = Tq;
    p.Tk = Tk;
    p.lse_stride = lse_stride;
    p.m_blocks = m_blocks;
    p.tiles = (int)tiles;
    p.scale = 1.0f / sqrtf((float)d); /* as section 9's forward */
    p.scale_log2 = p.scale * 1.4426950408889634f;
    p.wd = wd;
    /* persistent: one CTA per SM (fewer where there are fewer tiles, so none is idle), each walking the work
     * tiles (fa3::tile_of) in hg::snake_tile's order */
    int64_t ctas = st->sms > 0 ? st->sms : 1;
    if (max_ctas > 0) ctas = max_ctas;
    const unsigned grid = (unsigned)(tiles < ctas ? tiles : ctas);
    constexpr int S64 = fa3::layout<64>::SMEM, S128 = fa3::layout<128>::SMEM;
    if (d == 64 && causal) fa3::fa3_fwd_kernel<64, true><<<grid, fa3::THREADS, S64, stream>>>(mq, mk, mv, p);
    else if (d == 64) fa3::fa3_fwd_kernel<64, false><<<grid, fa3::THREADS, S64, stream>>>(mq, mk, mv, p);
    else if (causal) fa3::fa3_fwd_kernel<128, true><<<grid, fa3::THREADS, S128, stream>>>(mq, mk, mv, p);
    else fa3::fa3_fwd_kernel<128, false><<<grid, fa3::THREADS, S128, stream>>>(mq, mk, mv, p);
    return cudaGetLastError();
}

/* Causal attention forward on section 13.2's kernel, as flash_attention_forward without dropout or documents:
 * O (H heads), LSE [B, H, T] fp32 from Q (H heads), K, V (Hkv heads); the rest as
 * hopper_attention_forward_rect's. */
static cudaError_t hopper_attention_forward(mt_hopper_gemm_state* st, attn_view O, float* LSE, attn_cview Q, attn_cview K,
                                            attn_cview V, int B, int H, int Hkv, int T, int d, cudaStream_t stream,
                                            hg::watchdog* wd = NULL, int max_ctas = 0) {
    return hopper_attention_forward_rect(st, O, LSE, T, Q, K, V, B, H, Hkv, T, T, d, true, stream, wd, max_ctas);
}

/* MT_ATTN_FWD's and MT_ATTN_BWD's values (attn_choice_parse, the one rule for both): unset or empty, the rule
 * (sections 13.2 / 13.3's kernels where they run and the call fits, else section 9's); fa2, section 9's always;
 * fa3, the rule, and an error where the GPU or build has no kernel (checked when the trainer is made). Anything
 * else refused in one line (MT_ERR_ARG) naming the variable. */
enum { MT_ATTN_DEFAULT = 0, MT_ATTN_FA2 = 1, MT_ATTN_FA3 = 2 };
static mt_status attn_choice_parse(const char* var, const char* value, int* mode, mt_error* err) {
    *mode = MT_ATTN_DEFAULT;
    if (!value || !*value) return MT_OK;
    if (!strcmp(value, "fa2")) *mode = MT_ATTN_FA2;
    else if (!strcmp(value, "fa3")) *mode = MT_ATTN_FA3;
    else return mt_fail(err, MT_ERR_ARG, "%s=%.64s: expected fa2 or fa3 (unset: fa3 where it runs)", var, value);
    return MT_OK;
}
enum { MT_ATTN_FWD_DEFAULT = MT_ATTN_DEFAULT, MT_ATTN_FWD_FA2 = MT_ATTN_FA2, MT_ATTN_FWD_FA3 = MT_ATTN_FA3 };
static mt_status attn_fwd_parse(const char* value, int* mode, mt_error* err) {
    return attn_choice_parse("MT_ATTN_FWD", value, mode, err);
}

/* The causal flash forward of one call: section 13.2's kernel where mode allows it, it runs here and the call
 * is one it takes (d = 64 or 128, no dropout, no documents), else section 9's flash_attention_forward. st: the
 * probe's state (NULL: section 9's). */
static cudaError_t attention_forward_fast(mt_hopper_gemm_state* st, int mode, attn_view O, float* LSE, attn_cview Q,
                                          attn_cview K, attn_cview V, int B, int H, int Hkv, int T, int d,
                                          cudaStream_t stream, const mt_dropout& drop, const int32_t* doc) {
    if (st && mode != MT_ATTN_FWD_FA2 && fa3::head_dim_ok(d) && !drop.on && !doc && hopper_attention_available(st)) {
        const cudaError_t e = hopper_attention_forward(st, O, LSE, Q, K, V, B, H, Hkv, T, d, stream);
        if (e != cudaErrorInvalidValue) return e; /* a view it does not take falls through to section 9's */
    }
    return flash_attention_forward(O, LSE, Q, K, V, B, H, Hkv, T, d, stream, drop, doc);
}

/* ============================================================================================== */
/* 13.3 Hopper attention backward (FlashAttention-3 style: TMA, wgmma, warp specialisation)       */
/*    The causal bf16 attention backward at head dims 64 and 128 on Hopper, an alternative to     */
/*    section 9's FA2 backward (mma.sync; 196 TFLOP/s fwd+bwd at d = 128, T = 32k on an H200).    */
/*    The same split as section 9.3, deterministic by construction: Dsum = rowsum(dO * O)         */
/*    (section 9's kernel), a dK/dV kernel per (key tile, kv head, batch) and a dQ kernel per     */
/*    (query tile, head, batch); every gradient element is one thread's fp32 sum in a fixed       */
/*    order, no atomics. Same arguments and outputs as flash_attention_backward (views read and   */
/*    written in place), without dropout, document masks or the QKV-bias column sums. Its lab:    */
/*    dev/cuda/flash_attention_hopper_bwd.cu. PTX wrappers: section 13.1's (hg), plus the m64n64  */
/*    shapes below. Selection (attention_backward_fast): this path where it runs and the call     */
/*    fits, else section 9's; MT_ATTN_BWD=fa2 forces section 9's (attn_bwd_parse). Like 13.2's,   */
/*    also unmasked on a window of Tq query rows against Tk keys with a given Dsum and strided     */
/*    LSE (hopper_attention_backward_rect: section 13.4's ring steps).                            */
/*    defines: namespace fa3b (the kernels, templates on d and CAUSAL),                           */
/*    hopper_attention_backward_available, hopper_attention_backward_rect,                        */
/*    hopper_attention_backward, attn_bwd_parse, hopper_backward_wanted,                          */
/*    attention_backward_fast.                                                                    */
/* ============================================================================================== */
/*
 * ---- The products, and why no P or dS goes through shared memory ------------------------------------
 *   dK/dV works transposed (keys as the M rows), as section 9.3's kernel does:
 *     S^T = K Q^T, dP^T = V dO^T      wgmma SS m64n64k16: A = K (or V) rows, B = Q (or dO) rows, both
 *                                      K-major (d contiguous) in shared memory;
 *     P^T = exp(scale S^T - LSE[q]) (0 where key > query or query >= T), dS^T = P^T (dP^T - Dsum[q]);
 *     dV += P^T dO, dK += dS^T Q       wgmma RS m64n{d}k16: A = P^T (dS^T) from registers (the
 *                                      accumulator layout of a k16 slice is the register-A layout, as
 *                                      section 13.2's P), B = dO (Q) read N-major (imm-trans-b = 1).
 *   dQ works untransposed (queries as rows): S = Q K^T, dP = dO V^T (SS, K-major both), P, dS as above
 *   with LSE and Dsum of the thread's two rows, dQ += dS K (RS, K read N-major).
 *   So every MN-major operand is a TMA-loaded tile (dO, Q, K), never P or dS: the one layout wgmma's
 *   A cannot take from shared memory (MN-major) is never needed, and P, dS stay in registers.
 *
 * ---- Persistent CTAs ----------------------------------------------------------------------------------
 *   Each kernel runs one CTA per SM (its registers allow no second) over a list of tiles in longest-first
 *   order: the dK/dV kernel's tile i is key tile i / (Hkv B) (key tile 0 sees every query tile), the dQ
 *   kernel's is query tile ceil(T / 128) - 1 - i / (H B); CTAs take them in section 13.1's snake order
 *   (hg::snake_tile: static, and every CTA's sum near the mean). The
 *   stage ring's index and phase run on a count over all of the CTA's tiles, and a tile's fixed operands
 *   (K, V; Q, dO) have an "empty" mbarrier the consumers arrive on after the tile's last product: the
 *   producer loads the next tile's operands while the consumers store this tile's gradients, so no SM
 *   idles through a CTA's prologue and epilogue (at GPT-2 124M's T = 1024 about 1500 CTAs of ~8 us).
 *   Each tile's arithmetic is the non-persistent kernel's: the gradients are bitwise the same.
 *
 * ---- The dK/dV tile: 384 threads, 128 keys of one (b, kv head) --------------------------------------
 *   warpgroup 0 producer (setmaxnreg.dec 40): warp 0's lane 0 loads the K and V tiles once, then for
 *     iteration it = (query head j of the group, query tile q0 from the key tile's diagonal on) the Q and
 *     dO tiles [64 rows x d] into stage it % 2 after its "empty" mbarrier; warp 1's 32 lanes copy that
 *     tile's LSE (times log2 e; +inf past T) and Dsum (0 past T) into the stage and arrive on the same
 *     "full" mbarrier (1 + 32 arrivals and the TMA bytes complete a phase).
 *   warpgroups 1, 2 consumers (setmaxnreg.inc 232), keys 64 cw .. 64 cw + 63 each: the five products
 *     above per iteration; dK, dV (d/2 fp32 each per thread) stay in registers over all iterations. A
 *     query tile wholly before the warpgroup's first key adds nothing: skipped (still released).
 *     Epilogue: dK * scale and dV as bf16 into the views, rows >= T not stored.
 *
 * ---- The dQ tile: 384 threads, 128 query rows of one (b, h) ------------------------------------------
 *   producer: Q and dO tiles [128 x d] once, then key tiles n = 0 .. of 64 keys (K and V) into stage
 *   n % 2 up to the CTA's diagonal. Consumers: rows 64 cw .. 64 cw + 63; LSE and Dsum of the thread's two
 *   rows read once; a key tile wholly after the warpgroup's last row is skipped.
 *
 * ---- Tensor maps and descriptors ----------------------------------------------------------------
 *   5-D maps over the strided views as section 13.2's (c, t, h % qpg, h / qpg, b), boxes [rows][64
 *   columns] with the 128-byte swizzle (section 13.2's fa3_tensor_map, the box rows a parameter); a box
 *   past T is zero-filled inside its own head. A tile of R rows is d/64 column halves of R x 128 bytes.
 *   K-major (section 13.1's make_desc): k-slice kk of d at half kk / 4, byte (kk % 4) * 32; a
 *   warpgroup's 64 rows start 64 * 128 bytes on. N-major B (make_desc_n_major): k-slice kk (rows 16 kk
 *   ..) 2048 kk bytes on, leading byte offset R * 128 (the next column half), stride 1024 (8 rows).
 *
 * ---- Numerics and determinism ----------------------------------------------------------------------
 *   fp32 S, dP; P = 2^(S scale log2e - LSE log2e) (section 9.3's formula); P and dS rounded to bf16
 *   for their products (as section 9.3); dK scaled once at the end, dQ likewise. Each output is one
 *   thread's sum in a fixed order (heads, then query tiles ascending; key tiles ascending): bitwise
 *   the same from run to run. Section 9.3 sums in other tile orders: the two agree to rounding.
 *
 * ---- Watchdog ---------------------------------------------------------------------------------------
 *   Every mbarrier wait is section 13.1's bounded wait (hg::mbar_wait; 20 s unless hg::options says
 *   otherwise), then trap: a deadlock ends the kernel with an error instead of hanging.
 */
namespace fa3b {
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232; /* 40*128 + 232*256 = 168*384: the register file */
constexpr int STAGES = 2;
constexpr int KV_KEYS = 128, KV_QB = 64; /* dK/dV: keys per CTA, query rows per iteration */
constexpr int Q_ROWS = 128, Q_KB = 64;   /* dQ: query rows per CTA, keys per iteration */
constexpr unsigned long long TIMEOUT_NS = 20000000000ull;
/* watchdog "stage" field: which barrier was waited for */
enum { WAIT_KV_FULL = 0, WAIT_FULL, WAIT_EMPTY, WAIT_STATS_EMPTY, WAIT_KV_EMPTY, WAIT_Q_EMPTY };

/* Shared memory of the dK/dV kernel: K, V [128 x D]; per stage Q, dO [64 x D], LSE, Dsum [64] fp32; barriers. */
template <int D>
struct kv_smem {
    static constexpr int TILE_KV = KV_KEYS * D * 2, TILE_Q = KV_QB * D * 2;
    static constexpr int OFF_K = 0, OFF_V = TILE_KV, OFF_Q = 2 * TILE_KV, OFF_DO = OFF_Q + STAGES * TILE_Q;
    static constexpr int OFF_L = OFF_DO + STAGES * TILE_Q, OFF_D = OFF_L + STAGES * KV_QB * 4;
    static constexpr int OFF_BAR = OFF_D + STAGES * KV_QB * 4;
    static constexpr int NBAR = 2 + 2 * STAGES; /* K/V full; full, empty per stage; K/V empty */
    static constexpr int SMEM = OFF_BAR + NBAR * 8 + 1024;
    static_assert(SMEM <= 227 * 1024, "shared memory");
};
/* Shared memory of the dQ kernel: Q, dO [128 x D]; per stage K, V [64 x D]; barriers. */
template <int D>
struct q_smem {
    static constexpr int TILE_Q = Q_ROWS * D * 2, TILE_KV = Q_KB * D * 2;
    static constexpr int OFF_Q = 0, OFF_DO = TILE_Q, OFF_K = 2 * TILE_Q, OFF_V = OFF_K + STAGES * TILE_KV;
    static constexpr int OFF_BAR = OFF_V + STAGES * TILE_KV;
    static constexpr int NBAR = 2 + 2 * STAGES; /* Q/dO full; full, empty per stage; Q/dO empty */
    static constexpr int SMEM = OFF_BAR + NBAR * 8 + 1024;
    static_assert(SMEM <= 227 * 1024, "shared memory");
};

/* What the kernels take besides the tensor maps. */
struct params {
    fa::heads_view<bf16> dQ, dK, dV;
    const float* LSE;  /* row t of head h of batch b at (b H + h) lse_stride + t */
    const float* Dsum; /* likewise */
    int H, Hkv, T, B;  /* T: query rows */
    int Tk;            /* keys (causal: T) */
    int lse_stride;    /* LSE's and Dsum's rows per (b, h) (causal: T) */
    float scale;      /* 1/sqrt(D) */
    float scale_log2; /* scale * log2(e) */
    hg::watchdog* wd; /* NULL: a timed-out wait just traps */
    unsigned long long timeout_ns;
};

/* The persistent CTAs' work lists (see the banner): tile i of the dK/dV kernel's ceil(Tk / 128) * Hkv * B, and
 * of the dQ kernel's ceil(T / 128) * H * B, in longest-first order (without the causal mask all are equal). */
__device__ __forceinline__ void kv_tile_of(int i, const params& p, int& kt, int& hkv, int& b) {
    const int heads = p.Hkv * p.B;
    kt = i / heads; /* key tile 0 sees every query tile: the most work */
    hkv = (i % heads) % p.Hkv;
    b = (i % heads) / p.Hkv;
}
__device__ __forceinline__ void q_tile_of(int i, const params& p, int& m_block, int& h, int& b) {
    const int heads = p.H * p.B;
    m_block = (p.T + Q_ROWS - 1) / Q_ROWS - 1 - i / heads; /* the last query tile sees every key tile */
    h = (i % heads) % p.H;
    b = (i % heads) / p.H;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* D[64 x 64] (+)= A[64 x 16] B[64 x 16]^T, both K-major in shared memory; 32 fp32 accumulators per thread. */
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/* X[64 x 64] = A[64 x D] B[64 x D]^T: A = a warpgroup's 64 rows of a tile of RA rows (column halves RA * 128
 * bytes apart), B = a tile of 64 rows; both K-major, d contiguous. */
template <int D, int RA>
__device__ __forceinline__ void gemm_abt(float (&x)[32], uint32_t a_base, uint32_t b_base) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wgmma_m64n64k16_ss(x, hg::make_desc(a_base + (kk / 4) * (RA * 128) + (kk % 4) * 32),
                           hg::make_desc(b_base + (kk / 4) * (64 * 128) + (kk % 4) * 32), kk > 0);
}
/* acc[64 x D] += A[64 x 64] B[64 x D]: A as bf16 register fragments (4 k16 slices), B a tile of 64 rows read
 * N-major (column halves 64 * 128 bytes apart). */
template <int D>
__device__ __forceinline__ void gemm_rs(float (&acc)[D / 2], const uint32_t (&a)[4][4], uint32_t b_base) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint64_t db = hg::make_desc_n_major(b_base + kk * 16 * 128, 64 * 128);
        if constexpr (D == 128) hg::wgmma_m64n128k16_rs(acc, a[kk], db, 1);
        else fa3::wgmma_m64n64k16_rs(acc, a[kk], db, 1); /* section 13.2's P V shape */
    }
}
/* fp32 accumulators of a 64 x 64 block -> bf16 register-A fragments, one per k16 slice */
__device__ __forceinline__ void to_frags(const float (&x)[32], uint32_t (&a)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        a[kk][0] = fa::pack_bf16(x[8 * kk], x[8 * kk + 1]);
        a[kk][1] = fa::pack_bf16(x[8 * kk + 2], x[8 * kk + 3]);
        a[kk][2] = fa::pack_bf16(x[8 * kk + 4], x[8 * kk + 5]);
        a[kk][3] = fa::pack_bf16(x[8 * kk + 6], x[8 * kk + 7]);
    }
}
/* consumers' wait: the wgmma that follows is .sync.aligned, so the warp reconverges after the spin */
__device__ __forceinline__ void wait_warp(uint32_t bar, uint32_t parity, const params& p, int role, int what, int tile,
                                          int n) {
    hg::mbar_wait(bar, parity, p.wd, p.timeout_ns, role, what, tile, n);
    __syncwarp();
}
#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

/* dK, dV of 128 keys (see the section's banner). Maps: Q, dO boxes 64 rows; K, V boxes 128 rows. CAUSAL: the
 * causal mask (Tk == T), else every query sees every key (section 9.5's ring steps). */
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v, params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hg;
    using L = kv_smem<D>;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = hg::smem_u32(smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    uint8_t* sgen = smem_raw + (sbase - raw); /* the same bytes through a generic pointer */
    const uint32_t sK = sbase + L::OFF_K, sV = sbase + L::OFF_V, sQ = sbase + L::OFF_Q, sdO = sbase + L::OFF_DO;
    float* sL = reinterpret_cast<float*>(sgen + L::OFF_L); /* [STAGES][64]: LSE * log2(e), +inf past T */
    float* sD = reinterpret_cast<float*>(sgen + L::OFF_D); /* [STAGES][64]: Dsum, 0 past T */
    const uint32_t bars = sbase + L::OFF_BAR;
    const uint32_t kv_full = bars;
    auto full = [&](int s) { return bars + 8u * (1 + s); };
    auto empty = [&](int s) { return bars + 8u * (1 + STAGES + s); };
    const uint32_t kv_empty = bars + 8u * (1 + 2 * STAGES);

    const int T = p.T, Tk = p.Tk, qpg = p.H / p.Hkv;
    const int tiles = (Tk + KV_KEYS - 1) / KV_KEYS * p.Hkv * p.B;
    const int q_tiles = (T + KV_QB - 1) / KV_QB;
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0), lane = threadIdx.x % 32, wg = warp / 4;

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        mbar_init(kv_empty, 8); /* lane 0 of each of the 8 consumer warps, after a tile's last product */
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full(s), 1 + 32); /* the TMA thread's arrive.expect_tx and warp 1's 32 lanes */
            mbar_init(empty(s), 8);     /* lane 0 of each of the 8 consumer warps */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        /* ---- producer ---- */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp == 0 && lane == 0) {
            tma_prefetch_desc(&tm_q);
            tma_prefetch_desc(&tm_do);
            tma_prefetch_desc(&tm_k);
            tma_prefetch_desc(&tm_v);
            int gi = 0; /* the stage ring's iteration count, over all of this CTA's tiles */
            for (int lt = 0, tile; (tile = hg::snake_tile(lt, tiles)) >= 0; lt++) {
                int kt, hkv, b;
                kv_tile_of(tile, p, kt, hkv, b);
                const int qt_first = CAUSAL ? kt * KV_KEYS / KV_QB : 0, per_head = q_tiles - qt_first, n_it = qpg * per_head;
                /* K, V of this tile once the consumers' last product of the previous one is done */
                mbar_wait(kv_empty, (lt & 1) ^ 1, p.wd, p.timeout_ns, 0, WAIT_KV_EMPTY, tile, 0);
                mbar_arrive_expect_tx(kv_full, 2 * L::TILE_KV);
#pragma unroll
                for (int c = 0; c < D / 64; c++) {
                    tma_load_5d(sK + c * KV_KEYS * 128, &tm_k, kv_full, 64 * c, kt * KV_KEYS, 0, hkv, b);
                    tma_load_5d(sV + c * KV_KEYS * 128, &tm_v, kv_full, 64 * c, kt * KV_KEYS, 0, hkv, b);
                }
                for (int it = 0; it < n_it; it++, gi++) {
                    const int s = gi % STAGES, j = it / per_head, q0 = (qt_first + it % per_head) * KV_QB;
                    mbar_wait(empty(s), ((gi / STAGES) & 1) ^ 1, p.wd, p.timeout_ns, 0, WAIT_EMPTY, tile, it);
                    mbar_arrive_expect_tx(full(s), 2 * L::TILE_Q);
#pragma unroll
                    for (int c = 0; c < D / 64; c++) {
                        tma_load_5d(sQ + s * L::TILE_Q + c * KV_QB * 128, &tm_q, full(s), 64 * c, q0, j, hkv, b);
                        tma_load_5d(sdO + s * L::TILE_Q + c * KV_QB * 128, &tm_do, full(s), 64 * c, q0, j, hkv, b);
                    }
                }
            }
        } else if (warp == 1) {
            int gi = 0;
            for (int lt = 0, tile; (tile = hg::snake_tile(lt, tiles)) >= 0; lt++) {
                int kt, hkv, b;
                kv_tile_of(tile, p, kt, hkv, b);
                const int qt_first = CAUSAL ? kt * KV_KEYS / KV_QB : 0, per_head = q_tiles - qt_first, n_it = qpg * per_head;
                for (int it = 0; it < n_it; it++, gi++) {
                    const int s = gi % STAGES, h = hkv * qpg + it / per_head, q0 = (qt_first + it % per_head) * KV_QB;
                    mbar_wait(empty(s), ((gi / STAGES) & 1) ^ 1, p.wd, p.timeout_ns, 0, WAIT_STATS_EMPTY, tile, it);
                    const size_t row = ((size_t)b * p.H + h) * p.lse_stride;
#pragma unroll
                    for (int i = lane; i < KV_QB; i += 32) {
                        const int q = q0 + i;
                        sL[s * KV_QB + i] = q < T ? p.LSE[row + q] * fa::LOG2E : INFINITY;
                        sD[s * KV_QB + i] = q < T ? p.Dsum[row + q] : 0.0f;
                    }
                    mbar_arrive(full(s)); /* release: the stores above are seen by whoever waits on the phase */
                }
            }
        }
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1;
    const int w = warp % 4, g = lane / 4, t = lane % 4;
    const uint32_t a_k = sK + cw * 64 * 128, a_v = sV + cw * 64 * 128;
    const float sl2 = p.scale_log2;
    int gi = 0; /* as the producer's */
    for (int lt = 0, tile; (tile = hg::snake_tile(lt, tiles)) >= 0; lt++) {
        int kt, hkv, b;
        kv_tile_of(tile, p, kt, hkv, b);
        const int qt_first = CAUSAL ? kt * KV_KEYS / KV_QB : 0, per_head = q_tiles - qt_first, n_it = qpg * per_head;
        const int wk0 = kt * KV_KEYS + 64 * cw;             /* the warpgroup's first key */
        const int key0 = wk0 + 16 * w + g, key1 = key0 + 8; /* this thread's two key rows */

        float dk[D / 2], dv[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; i++) dk[i] = dv[i] = 0.0f;

        wait_warp(kv_full, lt & 1, p, 1, WAIT_KV_FULL, tile, 0);
        for (int it = 0; it < n_it; it++, gi++) {
            const int s = gi % STAGES, q0 = (qt_first + it % per_head) * KV_QB;
            wait_warp(full(s), (gi / STAGES) & 1, p, 1, WAIT_FULL, tile, it);
            if (!CAUSAL || q0 + KV_QB - 1 >= wk0) { /* else every query here is before every key of this warpgroup */
                const uint32_t q_s = sQ + s * L::TILE_Q, do_s = sdO + s * L::TILE_Q;
                float x[32], dp[32]; /* S^T then P^T; dP^T then dS^T: keys (rows) x 64 queries */
                /* d = 64: four commit groups (S^T, dP^T, dV += P^T dO, dK += dS^T Q); P^T is computed while dP^T
                 * runs and dS^T while the dV product runs. d = 128: S^T and dP^T in one group, then dV and dK in
                 * one (the overlap would keep P^T, its fragments and dP^T live beside dK and dV: ptxas then runs
                 * out of the 232 registers and serialises the wgmmas) */
                constexpr bool OVERLAP = D == 64;
                wgmma_fence();
                gemm_abt<D, KV_KEYS>(x, a_k, q_s);
                if constexpr (OVERLAP) wgmma_commit();
                gemm_abt<D, KV_KEYS>(dp, a_v, do_s);
                wgmma_commit();
                if constexpr (OVERLAP) wgmma_wait<1>(); /* S^T done */
                else wgmma_wait<0>();
                reg_fence<32>(x);
                const float* l = sL + s * KV_QB;
                const float* dd = sD + s * KV_QB;
                const bool mask = (CAUSAL && q0 < wk0 + 64) || q0 + KV_QB > T;
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int col = 8 * j + 2 * t + (e & 1), key = e < 2 ? key0 : key1;
                        const float pv = fa::exp2_approx(fmaf(x[4 * j + e], sl2, -l[col]));
                        x[4 * j + e] = mask && ((CAUSAL && q0 + col < key) || q0 + col >= T) ? 0.0f : pv;
                    }
                uint32_t pa[4][4], da[4][4];
                if constexpr (OVERLAP) {
                    to_frags(x, pa);
                    reg_fence<D / 2>(dv);
                    reg_fence<16>(&pa[0][0]);
                    wgmma_fence();
                    gemm_rs<D>(dv, pa, do_s); /* dV += P^T dO */
                    wgmma_commit();
                    wgmma_wait<1>(); /* dP^T done (the dV product may still run) */
                }
                reg_fence<32>(dp);
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) dp[4 * j + e] = x[4 * j + e] * (dp[4 * j + e] - dd[8 * j + 2 * t + (e & 1)]);
                if constexpr (!OVERLAP) to_frags(x, pa);
                to_frags(dp, da);
                reg_fence<D / 2>(dk);
                reg_fence<16>(&da[0][0]);
                if constexpr (!OVERLAP) {
                    reg_fence<D / 2>(dv);
                    reg_fence<16>(&pa[0][0]);
                }
                wgmma_fence();
                if constexpr (!OVERLAP) gemm_rs<D>(dv, pa, do_s); /* dV += P^T dO */
                gemm_rs<D>(dk, da, q_s);                          /* dK += dS^T Q */
                wgmma_commit();
                wgmma_wait<0>();
                reg_fence<D / 2>(dk);
                reg_fence<D / 2>(dv);
                reg_fence<16>(&pa[0][0]);
                reg_fence<16>(&da[0][0]); /* the A fragments stay allocated until their products are done */
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty(s));
        }
        /* every product of this tile is done (wgmma_wait<0> above): K and V may be replaced while we store */
        __syncwarp();
        if (lane == 0) mbar_arrive(kv_empty);

        /* ---- epilogue: dK * scale and dV into the views (kv head hkv, qpg 1), rows >= Tk not stored ---- */
        bf16* kh = p.dK.at(b, hkv, 1) + 2 * t;
        bf16* vh = p.dV.at(b, hkv, 1) + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int key = r == 0 ? key0 : key1;
            if (key >= Tk) continue;
            bf16* ko = kh + (int64_t)key * p.dK.row;
            bf16* vo = vh + (int64_t)key * p.dV.row;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                *reinterpret_cast<uint32_t*>(ko + 8 * j) =
                    fa::pack_bf16(dk[4 * j + 2 * r] * p.scale, dk[4 * j + 2 * r + 1] * p.scale);
                *reinterpret_cast<uint32_t*>(vo + 8 * j) = fa::pack_bf16(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
            }
        }
    } /* tile */
#elif defined(__CUDA_ARCH__)
    __trap(); /* built without sm_90a: never launched (hopper_attention_backward_available says no) */
#endif
}

/* dQ of 128 query rows (see the section's banner). Maps: Q, dO boxes 128 rows; K, V boxes 64 rows. CAUSAL as
 * dkdv_kernel's. */
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(THREADS, 1)
    dq_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
              const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v, params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace hg;
    using L = q_smem<D>;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = hg::smem_u32(smem_raw);
    const uint32_t sbase = (raw + 1023u) & ~1023u;
    const uint32_t sQ = sbase + L::OFF_Q, sdO = sbase + L::OFF_DO, sK = sbase + L::OFF_K, sV = sbase + L::OFF_V;
    const uint32_t bars = sbase + L::OFF_BAR;
    const uint32_t q_full = bars;
    auto full = [&](int s) { return bars + 8u * (1 + s); };
    auto empty = [&](int s) { return bars + 8u * (1 + STAGES + s); };
    const uint32_t q_empty = bars + 8u * (1 + 2 * STAGES);

    const int T = p.T, Tk = p.Tk, qpg = p.H / p.Hkv;
    const int tiles = (T + Q_ROWS - 1) / Q_ROWS * p.H * p.B;
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0), lane = threadIdx.x % 32, wg = warp / 4;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 8); /* lane 0 of each of the 8 consumer warps, after a tile's last product */
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        /* ---- producer ---- */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp == 0 && lane == 0) {
            tma_prefetch_desc(&tm_q);
            tma_prefetch_desc(&tm_do);
            tma_prefetch_desc(&tm_k);
            tma_prefetch_desc(&tm_v);
            int gi = 0; /* the stage ring's key-tile count, over all of this CTA's tiles */
            for (int lt = 0, tile; (tile = hg::snake_tile(lt, tiles)) >= 0; lt++) {
                int m_block, h, b;
                q_tile_of(tile, p, m_block, h, b);
                const int hkv = h / qpg,
                          n_tiles = CAUSAL ? (min(T, (m_block + 1) * Q_ROWS) + Q_KB - 1) / Q_KB : (Tk + Q_KB - 1) / Q_KB;
                /* Q, dO of this tile once the consumers' last product of the previous one is done */
                mbar_wait(q_empty, (lt & 1) ^ 1, p.wd, p.timeout_ns, 0, WAIT_Q_EMPTY, tile, 0);
                mbar_arrive_expect_tx(q_full, 2 * L::TILE_Q);
#pragma unroll
                for (int c = 0; c < D / 64; c++) {
                    tma_load_5d(sQ + c * Q_ROWS * 128, &tm_q, q_full, 64 * c, m_block * Q_ROWS, h % qpg, hkv, b);
                    tma_load_5d(sdO + c * Q_ROWS * 128, &tm_do, q_full, 64 * c, m_block * Q_ROWS, h % qpg, hkv, b);
                }
                for (int n = 0; n < n_tiles; n++, gi++) {
                    const int s = gi % STAGES;
                    mbar_wait(empty(s), ((gi / STAGES) & 1) ^ 1, p.wd, p.timeout_ns, 0, WAIT_EMPTY, tile, n);
                    mbar_arrive_expect_tx(full(s), 2 * L::TILE_KV);
#pragma unroll
                    for (int c = 0; c < D / 64; c++) {
                        tma_load_5d(sK + s * L::TILE_KV + c * Q_KB * 128, &tm_k, full(s), 64 * c, n * Q_KB, 0, hkv, b);
                        tma_load_5d(sV + s * L::TILE_KV + c * Q_KB * 128, &tm_v, full(s), 64 * c, n * Q_KB, 0, hkv, b);
                    }
                }
            }
        }
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1;
    const int w = warp % 4, g = lane / 4, t = lane % 4;
    const uint32_t a_q = sQ + cw * 64 * 128, a_do = sdO + cw * 64 * 128;
    const float sl2 = p.scale_log2;
    int gi = 0; /* as the producer's */
    for (int lt = 0, tile; (tile = hg::snake_tile(lt, tiles)) >= 0; lt++) {
        int m_block, h, b;
        q_tile_of(tile, p, m_block, h, b);
        const int n_tiles = CAUSAL ? (min(T, (m_block + 1) * Q_ROWS) + Q_KB - 1) / Q_KB : (Tk + Q_KB - 1) / Q_KB;
        const int wq0 = m_block * Q_ROWS + 64 * cw; /* the warpgroup's first query row */
        const int row0 = wq0 + 16 * w + g, row1 = row0 + 8;
        const size_t bh = (size_t)b * p.H + h;
        const size_t rs = (size_t)p.lse_stride;
        const float l0 = row0 < T ? p.LSE[bh * rs + row0] * fa::LOG2E : INFINITY;
        const float l1 = row1 < T ? p.LSE[bh * rs + row1] * fa::LOG2E : INFINITY;
        const float d0 = row0 < T ? p.Dsum[bh * rs + row0] : 0.0f;
        const float d1 = row1 < T ? p.Dsum[bh * rs + row1] : 0.0f;

        float dq[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; i++) dq[i] = 0.0f;

        wait_warp(q_full, lt & 1, p, 1, WAIT_KV_FULL, tile, 0);
        for (int n = 0; n < n_tiles; n++, gi++) {
            const int s = gi % STAGES, n0 = n * Q_KB;
            wait_warp(full(s), (gi / STAGES) & 1, p, 1, WAIT_FULL, tile, n);
            if (!CAUSAL || n0 <= wq0 + 63) { /* else every key here is after every row of this warpgroup */
                const uint32_t k_s = sK + s * L::TILE_KV, v_s = sV + s * L::TILE_KV;
                float x[32], dp[32]; /* S then P; dP then dS: 64 rows x 64 keys */
                wgmma_fence();
                gemm_abt<D, Q_ROWS>(x, a_q, k_s);
                wgmma_commit();
                gemm_abt<D, Q_ROWS>(dp, a_do, v_s);
                wgmma_commit();
                wgmma_wait<1>(); /* S done: P is computed while dP runs */
                reg_fence<32>(x);
                const bool mask = n0 + Q_KB > Tk || (CAUSAL && n0 + Q_KB - 1 > wq0);
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int col = n0 + 8 * j + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
                        const float pv = fa::exp2_approx(fmaf(x[4 * j + e], sl2, -(e < 2 ? l0 : l1)));
                        x[4 * j + e] = mask && ((CAUSAL && col > row) || col >= Tk) ? 0.0f : pv;
                    }
                wgmma_wait<0>();
                reg_fence<32>(dp);
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) dp[4 * j + e] = x[4 * j + e] * (dp[4 * j + e] - (e < 2 ? d0 : d1));
                uint32_t da[4][4];
                to_frags(dp, da);
                reg_fence<D / 2>(dq);
                reg_fence<16>(&da[0][0]);
                wgmma_fence();
                gemm_rs<D>(dq, da, k_s); /* dQ += dS K */
                wgmma_commit();
                wgmma_wait<0>();
                reg_fence<D / 2>(dq);
                reg_fence<16>(&da[0][0]); /* the A fragments stay allocated until the product is done */
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty(s));
        }
        /* every product of this tile is done (wgmma_wait<0> above): Q and dO may be replaced while we store */
        __syncwarp();
        if (lane == 0) mbar_arrive(q_empty);

        /* ---- epilogue: dQ * scale into the view, rows >= T not stored ---- */
        bf16* qh = p.dQ.at(b, h, qpg) + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = r == 0 ? row0 : row1;
            if (row >= T) continue;
            bf16* qo = qh + (int64_t)row * p.dQ.row;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *reinterpret_cast<uint32_t*>(qo + 8 * j) =
                    fa::pack_bf16(dq[4 * j + 2 * r] * p.scale, dq[4 * j + 2 * r + 1] * p.scale);
        }
    } /* tile */
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}
} /* namespace fa3b */

/* Whether this process's GPU runs section 13.3's kernels: section 13.1's probe (compute 9.x, the driver's
 * cuTensorMapEncodeTiled) and the eight kernels (two head dims, causal or not) built for sm_90a with the registers setmaxnreg's 40/232 split
 * needs and their shared memory allowed. Probed once into s->attn_bwd; a failed probe leaves no CUDA error. */
static bool hopper_attention_backward_available(mt_hopper_gemm_state* s) {
    if (s->attn_bwd) return s->attn_bwd > 0;
    if (!hopper_gemm_available(s)) {
        s->attn_bwd = -1;
        return false;
    }
    int dev = 0, optin = 0;
    bool ok = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess;
    const void* kernels[8] = {(const void*)fa3b::dkdv_kernel<64, true>,  (const void*)fa3b::dkdv_kernel<128, true>,
                              (const void*)fa3b::dq_kernel<64, true>,    (const void*)fa3b::dq_kernel<128, true>,
                              (const void*)fa3b::dkdv_kernel<64, false>, (const void*)fa3b::dkdv_kernel<128, false>,
                              (const void*)fa3b::dq_kernel<64, false>,   (const void*)fa3b::dq_kernel<128, false>};
    const int smem[4] = {fa3b::kv_smem<64>::SMEM, fa3b::kv_smem<128>::SMEM, fa3b::q_smem<64>::SMEM,
                         fa3b::q_smem<128>::SMEM};
    for (int i = 0; ok && i < 8; i++) {
        cudaFuncAttributes a;
        ok = cudaFuncGetAttributes(&a, kernels[i]) == cudaSuccess &&
             a.numRegs * fa3b::THREADS >= fa3b::PRODUCER_REGS * 128 + fa3b::CONSUMER_REGS * 256 && smem[i % 4] <= optin &&
             cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, smem[i % 4]) == cudaSuccess;
    }
    (void)cudaGetLastError();
    s->attn_bwd = ok ? 1 : -1;
    return ok;
}

template <int D, bool CAUSAL>
static cudaError_t fa3b_launch(const CUtensorMap* maps, const fa3b::params& p, int B, int H, int Hkv, int Tq, int Tk,
                               int sms, cudaStream_t stream) {
    /* persistent: sms CTAs (one per SM: the kernels' registers allow no more), each walking the tile list; a
     * cap >= the tile count gives one tile per CTA */
    const int kv_tiles = (Tk + fa3b::KV_KEYS - 1) / fa3b::KV_KEYS * Hkv * B,
              q_tiles = (Tq + fa3b::Q_ROWS - 1) / fa3b::Q_ROWS * H * B;
    const dim3 grid_kv(kv_tiles < sms ? kv_tiles : sms);
    fa3b::dkdv_kernel<D, CAUSAL>
        <<<grid_kv, fa3b::THREADS, fa3b::kv_smem<D>::SMEM, stream>>>(maps[0], maps[1], maps[2], maps[3], p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const dim3 grid_q(q_tiles < sms ? q_tiles : sms);
    fa3b::dq_kernel<D, CAUSAL>
        <<<grid_q, fa3b::THREADS, fa3b::q_smem<D>::SMEM, stream>>>(maps[4], maps[5], maps[6], maps[7], p);
    return cudaGetLastError();
}

/* Attention backward on section 13.3's kernels without dropout, documents or column sums, from a Dsum already
 * made: dQ (H heads, Tq rows), dK, dV (Hkv heads, Tk rows) from dO, Q (Tq rows), K, V (Tk rows) and the
 * forward's LSE, with Dsum = rowsum(dO * O) (both: row t of head h of batch b at (b H + h) lse_stride + t).
 * causal: the causal mask (Tq == Tk), else every query sees every key (section 9.5's ring steps). d = 64 or
 * 128; views of any layout fa::view_ok takes. cudaErrorInvalidValue (nothing queued) for what it does not
 * take; cudaErrorNotSupported where the kernels do not run (hopper_attention_backward_available). opt: the
 * lab's and tests' watchdog record and wait limit (NULL: trap only, 20 s), and max_ctas (0: one CTA per SM). */
static cudaError_t hopper_attention_backward_rect(mt_hopper_gemm_state* st, attn_view dQ, attn_view dK, attn_view dV,
                                                  const float* Dsum, int lse_stride, attn_cview dO, attn_cview Q,
                                                  attn_cview K, attn_cview V, const float* LSE, int B, int H, int Hkv,
                                                  int Tq, int Tk, int d, bool causal, cudaStream_t stream,
                                                  const hg::options* opt = NULL) {
    attn_cview views[] = {cview(dQ), cview(dK), cview(dV), dO, Q, K, V};
    bool ok = fa3::head_dim_ok(d) && fa::shape_ok(B, H, Hkv, Tq, d) && fa::shape_ok(B, H, Hkv, Tk, d) &&
              (!causal || Tq == Tk) && lse_stride >= Tq && (int64_t)((Tq + 63) / 64) * H * B < INT_MAX &&
              (int64_t)((Tk + 63) / 64) * H * B < INT_MAX; /* the tile lists */
    for (const attn_cview& v : views) ok = ok && fa::view_ok(v);
    if (!ok) return cudaErrorInvalidValue;
    if (!hopper_attention_backward_available(st)) return cudaErrorNotSupported;
    const hg_encode_tiled_fn encode = (hg_encode_tiled_fn)st->encode;
    const int qpg = H / Hkv;
    CUtensorMap maps[8]; /* dK/dV's Q, dO, K, V; dQ's Q, dO, K, V */
    if (!fa3_tensor_map(encode, &maps[0], Q, B, H, qpg, Tq, d, fa3b::KV_QB) ||
        !fa3_tensor_map(encode, &maps[1], dO, B, H, qpg, Tq, d, fa3b::KV_QB) ||
        !fa3_tensor_map(encode, &maps[2], K, B, Hkv, 1, Tk, d, fa3b::KV_KEYS) ||
        !fa3_tensor_map(encode, &maps[3], V, B, Hkv, 1, Tk, d, fa3b::KV_KEYS) ||
        !fa3_tensor_map(encode, &maps[4], Q, B, H, qpg, Tq, d, fa3b::Q_ROWS) ||
        !fa3_tensor_map(encode, &maps[5], dO, B, H, qpg, Tq, d, fa3b::Q_ROWS) ||
        !fa3_tensor_map(encode, &maps[6], K, B, Hkv, 1, Tk, d, fa3b::Q_KB) ||
        !fa3_tensor_map(encode, &maps[7], V, B, Hkv, 1, Tk, d, fa3b::Q_KB))
        return cudaErrorInvalidValue;
    fa3b::params p;
    p.dQ = dQ;
    p.dK = dK;
    p.dV = dV;
    p.LSE = LSE;
    p.Dsum = Dsum;
    p.H = H;
    p.Hkv = Hkv;
    p.T = Tq;
    p.Tk = Tk;
    p.lse_stride = lse_stride;
    p.B = B;
    p.scale = 1.0f / sqrtf((float)d); /* as section 9 */
    p.scale_log2 = p.scale * fa::LOG2E;
    p.wd = opt ? opt->wd : NULL;
    p.timeout_ns = opt && opt->timeout_ns ? opt->timeout_ns : fa3b::TIMEOUT_NS;
    const int ctas = opt && opt->max_ctas > 0 ? opt->max_ctas : st->sms; /* the lab tries others */
    if (d == 64)
        return causal ? fa3b_launch<64, true>(maps, p, B, H, Hkv, Tq, Tk, ctas, stream)
                      : fa3b_launch<64, false>(maps, p, B, H, Hkv, Tq, Tk, ctas, stream);
    return causal ? fa3b_launch<128, true>(maps, p, B, H, Hkv, Tq, Tk, ctas, stream)
                  : fa3b_launch<128, false>(maps, p, B, H, Hkv, Tq, Tk, ctas, stream);
}

/* Causal attention backward on section 13.3's kernels, as flash_attention_backward without dropout, documents
 * or column sums: dQ (H heads), dK, dV (Hkv heads) from dO and the forward's Q, K, V, O, LSE; Dsum [B, H, T]
 * fp32 scratch (made here: rowsum(dO * O), section 9.3's kernel); the rest as hopper_attention_backward_rect's. */
static cudaError_t hopper_attention_backward(mt_hopper_gemm_state* st, attn_view dQ, attn_view dK, attn_view dV,
                                             float* Dsum, attn_cview dO, attn_cview Q, attn_cview K, attn_cview V,
                                             attn_cview O, const float* LSE, int B, int H, int Hkv, int T, int d,
                                             cudaStream_t stream, const hg::options* opt = NULL) {
    attn_cview views[] = {cview(dQ), cview(dK), cview(dV), dO, Q, K, V, O};
    bool ok = fa3::head_dim_ok(d) && fa::shape_ok(B, H, Hkv, T, d) && (int64_t)((T + 63) / 64) * H * B < INT_MAX;
    for (const attn_cview& v : views) ok = ok && fa::view_ok(v);
    if (!ok) return cudaErrorInvalidValue;
    if (!hopper_attention_backward_available(st)) return cudaErrorNotSupported;
    cudaError_t e = d == 64 ? fa::backward_dot<64>(Dsum, dO, O, B, H, Hkv, T, stream)
                            : fa::backward_dot<128>(Dsum, dO, O, B, H, Hkv, T, stream);
    if (e != cudaSuccess) return e;
    return hopper_attention_backward_rect(st, dQ, dK, dV, Dsum, T, dO, Q, K, V, LSE, B, H, Hkv, T, T, d, true, stream,
                                          opt);
}

/* MT_ATTN_BWD's value: section 13.2's attn_choice_parse (its rule: unset, section 13.3's kernels where they run
 * and the call fits, else section 9's; fa2, section 9's backward always; fa3, an error where they cannot run). */
enum { MT_ATTN_BWD_DEFAULT = MT_ATTN_DEFAULT, MT_ATTN_BWD_FA2 = MT_ATTN_FA2, MT_ATTN_BWD_FA3 = MT_ATTN_FA3 };
static mt_status attn_bwd_parse(const char* value, int* mode, mt_error* err) {
    return attn_choice_parse("MT_ATTN_BWD", value, mode, err);
}

/* Whether a backward call with these settings goes to section 13.3's kernels (a view they do not take still
 * falls back to section 9's inside attention_backward_fast). The trainer asks first: this path has no column
 * sums, so the QKV bias gradient is then summed by the caller. st NULL: never. */
static bool hopper_backward_wanted(mt_hopper_gemm_state* st, int mode, int d, const mt_dropout& drop, const int32_t* doc) {
    return st && mode != MT_ATTN_BWD_FA2 && (d == 64 || d == 128) && !drop.on && !doc &&
           hopper_attention_backward_available(st);
}

/* The causal flash backward of one call: section 13.3's kernels where hopper_backward_wanted says so and no
 * column sums are asked for, else section 9's flash_attention_backward (same arguments). */
static cudaError_t attention_backward_fast(mt_hopper_gemm_state* st, int mode, attn_view dQ, attn_view dK, attn_view dV,
                                           float* Dsum, attn_cview dO, attn_cview Q, attn_cview K, attn_cview V,
                                           attn_cview O, const float* LSE, int B, int H, int Hkv, int T, int d,
                                           cudaStream_t stream, float* colsum, const mt_dropout& drop,
                                           const int32_t* doc) {
    if (!colsum && hopper_backward_wanted(st, mode, d, drop, doc)) {
        const cudaError_t e = hopper_attention_backward(st, dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, d, stream);
        if (e != cudaErrorInvalidValue) return e; /* a view it does not take falls through to section 9's */
    }
    return flash_attention_backward(dQ, dK, dV, Dsum, dO, Q, K, V, O, LSE, B, H, Hkv, T, d, stream, colsum, drop, doc);
}

/* ============================================================================================== */
/* 13.4 Context-parallel ring steps on the Hopper kernels                                         */
/*    Section 9.5's ring (--cp-comm-type p2p) with each step on sections 13.2 / 13.3's kernels    */
/*    instead of section 9's: at CP = 2 the ring on section 9's kernels reached 0.64-0.72 of      */
/*    CP = 1's TFLOP/s per GPU at 16k-32k tokens (dev/bench/results/cp_ep_h200x2.md), CP = 1      */
/*    running on these kernels. A step of rank r (local rows T = 2C: chunks r and 2CP-1-r)        */
/*    against rank j's K/V block (its chunks j and 2CP-1-j) is one plain attention call:          */
/*      j == r: causal over the T local rows (both chunks' positions grow with the row, so the    */
/*              local causal mask is the global one);                                             */
/*      j <  r: all T queries against the block's first chunk (keys 0 .. C), no mask;             */
/*      j >  r: the queries' second chunk (rows C .. T) against the whole block, no mask          */
/*    (cp_step_of; section 9.1's positions give the same, tile by tile). The kernels write the    */
/*    step's O (bf16) and LSE into the ring's scratch; cp_merge_step_kernel folds them into the   */
/*    fp32 accumulator and the running LSE by log-sum-exp (last step: O rounded into its view).   */
/*    Backward with the final LSE and Dsum: the step's dQ (bf16) is added to the fp32 accumulator */
/*    and its dK/dV (bf16) to the travelling fp32 sums (cp_add_step_kernel), which section 9.5    */
/*    moves on as before. Numerics: each step's O, dQ, dK, dV are rounded to bf16 once before     */
/*    they are summed in fp32 (section 9's steps add in registers), so the ring's outputs differ  */
/*    from one GPU's by a few bf16 ulps, not one (tests/test_cp_attention.h's bounds). Fixed      */
/*    order, no atomics: bitwise repeatable. No dropout or documents (their masks are section     */
/*    9's): cp_fast_wanted sends those calls to section 9's steps.                                */
/*    defines: cp_step, cp_step_of, cp_rows, cp_merge_step_kernel, cp_add_step_kernel,           */
/*    cp_fast_wanted, cp_fast_forward_step, cp_fast_backward_step, cp_fast_backward_add.          */
/* ============================================================================================== */

/* The rows of a ring step: queries q0 .. q0 + tq of the local rows against keys k0 .. k0 + tk of the block. */
typedef struct {
    int q0, tq, k0, tk;
    bool causal;
} cp_step;
static cp_step cp_step_of(int q_rank, int kv_rank, int T) {
    const int C = T / 2;
    if (q_rank == kv_rank) return {0, T, 0, T, true};
    if (kv_rank < q_rank) return {0, T, 0, C, false};
    return {C, C, 0, T, false};
}
/* A view (attn_view or attn_cview) starting r0 rows further down. */
template <typename View>
static View cp_rows(View v, int r0) {
    v.p += (int64_t)r0 * v.row;
    return v;
}

/* One warp per (b, h, t) row of the local rows, rows = B H T: rows t in [q0, q1) take the step's O (step_o,
 * packed [B][H][T][d]) and LSE (step_lse [B][H][T]) into the running ones (first: they are the running ones):
 * LSE' = log(e^LSE + e^LSE_step), acc' = e^(LSE - LSE') acc + e^(LSE_step - LSE') O_step. last: the result
 * (other rows: the accumulator as it is) rounded into O's view, the accumulator not written. Each lane owns
 * d / 32 columns (pairs, 64 columns apart); the LSE is read by every lane before lane 0 writes it. */
__global__ void cp_merge_step_kernel(attn_view O, float* __restrict__ LSE, float* __restrict__ acc,
                                     const bf16* __restrict__ step_o, const float* __restrict__ step_lse, int H, int qpg,
                                     int T, int d, int q0, int q1, int first, int last, int64_t rows) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int t = (int)(row % T), bh = (int)(row / T), b = bh / H, h = bh % H;
    const bool in = t >= q0 && t < q1;
    if (!in && !last && !first) return; /* nothing of this row changes */
    float wa = 0.0f, wb = 0.0f, lse = -INFINITY;
    if (in) {
        const float lb = step_lse[row], la = first ? -INFINITY : LSE[row], m = fmaxf(la, lb);
        if (m != -INFINITY) {
            lse = m + logf(expf(la - m) + expf(lb - m));
            wa = expf(la - lse), wb = expf(lb - lse);
        }
    } else if (!first) {
        lse = LSE[row], wa = 1.0f; /* the running values pass through */
    }
    __syncwarp();
    if (lane == 0 && (in || first)) LSE[row] = lse;
    float* a = acc + row * d;
    const bf16* x = step_o + row * d;
    bf16* out = O.at(b, h, qpg) + (int64_t)t * O.row;
    for (int c = 2 * lane; c < d; c += 64) {
        float v0 = 0.0f, v1 = 0.0f;
        if (wa != 0.0f) v0 = wa * a[c], v1 = wa * a[c + 1];
        if (wb != 0.0f) {
            const __nv_bfloat162 xb = *reinterpret_cast<const __nv_bfloat162*>(x + c);
            v0 += wb * __bfloat162float(xb.x), v1 += wb * __bfloat162float(xb.y);
        }
        if (last) *reinterpret_cast<uint32_t*>(out + c) = fa::pack_bf16(v0, v1);
        else a[c] = v0, a[c + 1] = v1;
    }
}

/* 8 elements per thread over rows = (heads) x T rows of d: out = in (NULL: 0) + the step's bf16 values where
 * the row t is in [r0, r1). final.p != NULL: the sum rounded into that view (H heads, qpg per group) instead
 * of out. in == out is allowed (each element read and written by one thread). */
__global__ void cp_add_step_kernel(float* out, const float* in, const bf16* __restrict__ step, attn_view final,
                                   int H, int qpg, int T, int d, int r0, int r1, size_t vecs) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vecs) return;
    const size_t row = i / (d / 8);
    const int e8 = (int)(i % (d / 8)), t = (int)(row % T);
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (in) {
        const float4 a = *reinterpret_cast<const float4*>(in + i * 8), c = *reinterpret_cast<const float4*>(in + i * 8 + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    }
    if (t >= r0 && t < r1) {
        const uint4 u = *reinterpret_cast<const uint4*>(step + i * 8);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
        for (int k = 0; k < 4; k++) {
            const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&w[k]);
            v[2 * k] += __bfloat162float(x.x), v[2 * k + 1] += __bfloat162float(x.y);
        }
    }
    if (final.p) {
        const int bh = (int)(row / T), b = bh / H, h = bh % H;
        uint4 u;
        u.x = fa::pack_bf16(v[0], v[1]), u.y = fa::pack_bf16(v[2], v[3]);
        u.z = fa::pack_bf16(v[4], v[5]), u.w = fa::pack_bf16(v[6], v[7]);
        *reinterpret_cast<uint4*>(final.at(b, h, qpg) + (int64_t)t * final.row + e8 * 8) = u;
    } else {
        *reinterpret_cast<float4*>(out + i * 8) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(out + i * 8 + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
}
static cudaError_t cp_add_step(float* out, const float* in, const bf16* step, attn_view final, int B, int H, int qpg,
                               int T, int d, int r0, int r1, cudaStream_t st) {
    const size_t vecs = (size_t)B * H * T * (d / 8);
    cp_add_step_kernel<<<(unsigned)((vecs + 255) / 256), 256, 0, st>>>(out, in, step, final, H, qpg, T, d, r0, r1, vecs);
    return cudaGetLastError();
}

/* Whether a ring call takes the Hopper steps: a probe state, the kernels running here (forward, or with
 * backward the backward's too), head dim 64 or 128, no dropout, no documents. */
static bool cp_fast_wanted(mt_hopper_gemm_state* hs, bool backward, int d, const mt_dropout& drop, const int32_t* doc) {
    return hs && fa3::head_dim_ok(d) && !drop.on && !doc && hopper_attention_available(hs) &&
           (!backward || hopper_attention_backward_available(hs));
}

/* One ring step's forward (rank q_rank's queries against rank kv_rank's block K, V of T rows) merged into
 * the accumulator s.acc and the running LSE [B, H, T]; first: the first step; last: O written. */
static cudaError_t cp_fast_forward_step(mt_hopper_gemm_state* hs, attn_view O, float* LSE, const cp_ring_scratch& s,
                                        int first, int last, attn_cview Q, attn_cview K, attn_cview V, int B, int H,
                                        int Hkv, int T, int q_rank, int kv_rank, int d, cudaStream_t st) {
    const cp_step g = cp_step_of(q_rank, kv_rank, T);
    const int qpg = H / Hkv;
    const attn_view step_o = cp_rows(packed_heads_view(s.step_o, H, T, d, qpg), g.q0);
    cudaError_t e = hopper_attention_forward_rect(hs, step_o, s.step_lse + g.q0, T, cp_rows(Q, g.q0), cp_rows(K, g.k0),
                                                  cp_rows(V, g.k0), B, H, Hkv, g.tq, g.tk, d, g.causal, st);
    if (e != cudaSuccess) return e;
    const int64_t rows = (int64_t)B * H * T;
    cp_merge_step_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, st>>>(O, LSE, s.acc, s.step_o, s.step_lse, H, qpg, T, d,
                                                                      g.q0, g.q0 + g.tq, first, last, rows);
    return cudaGetLastError();
}

/* One ring step's backward kernels with the final LSE and Dsum [B, H, T]: the block's dK/dV into s.step_dkv
 * (for cp_fast_backward_add), dQ added to the accumulator s.acc (first / last as the forward's; last: dQ
 * written). */
static cudaError_t cp_fast_backward_step(mt_hopper_gemm_state* hs, attn_view dQ, const cp_ring_scratch& s, int first,
                                         int last, attn_cview dO, attn_cview Q, attn_cview K, attn_cview V,
                                         const float* LSE, const float* Dsum, int B, int H, int Hkv, int T, int q_rank,
                                         int kv_rank, int d, cudaStream_t st) {
    const cp_step g = cp_step_of(q_rank, kv_rank, T);
    const int qpg = H / Hkv;
    const size_t kv_elems = (size_t)B * Hkv * T * d;
    const attn_view step_dq = cp_rows(packed_heads_view(s.step_o, H, T, d, qpg), g.q0),
                    step_dk = cp_rows(packed_heads_view(s.step_dkv, Hkv, T, d, 1), g.k0),
                    step_dv = cp_rows(packed_heads_view(s.step_dkv + kv_elems, Hkv, T, d, 1), g.k0);
    cudaError_t e = hopper_attention_backward_rect(hs, step_dq, step_dk, step_dv, Dsum + g.q0, T, cp_rows(dO, g.q0),
                                                   cp_rows(Q, g.q0), cp_rows(K, g.k0), cp_rows(V, g.k0), LSE + g.q0, B,
                                                   H, Hkv, g.tq, g.tk, d, g.causal, st);
    if (e != cudaSuccess) return e;
    return cp_add_step(s.acc, first ? NULL : s.acc, s.step_o, last ? dQ : attn_view{}, B, H, qpg, T, d, g.q0,
                       g.q0 + g.tq, st);
}

/* The step's dK/dV (s.step_dkv, from cp_fast_backward_step) added to the travelling sums dkv_in (NULL: none
 * yet) into dkv_out, fp32 [2][B][Hkv][T][d]; in place allowed. */
static cudaError_t cp_fast_backward_add(const cp_ring_scratch& s, const float* dkv_in, float* dkv_out, int B, int Hkv,
                                        int T, int q_rank, int kv_rank, int d, cudaStream_t st) {
    const cp_step g = cp_step_of(q_rank, kv_rank, T);
    return cp_add_step(dkv_out, dkv_in, s.step_dkv, attn_view{}, 2 * B, Hkv, 1, T, d, g.k0, g.k0 + g.tk, st);
}

/* ============================================================================================== */
/* 14. Mixture of experts: routing, permutation, the experts' activation                          */
/*    Megatron-Core's MoE layer (dev/moe_semantics.md, dev/ref_moe.py) without its atomics. The  */
/*    router: a warp per token ranks the experts (softmax, pre-softmax or sigmoid scores, the     */
/*    expert bias, group-limited routing), takes the top k (ties: the lower expert) and makes the */
/*    probabilities; one device function does that selection for the forward and the backward,  */
/*    so the backward's choice is the forward's. Capacity: a block per expert column radix-      */
/*    selects its C tokens (integer histograms; ties to the lower token number). Tokens are      */
/*    ordered as Megatron orders them, n = t*B + j (sequence-major), while arrays stay in rows    */
/*    r = j*T + t: counts, offsets and each expert's rows (tokens ascending in n) come from block */
/*    scans per expert, no atomics. Unpermute sums a token's rows in ascending expert order.     */
/*    The aux-loss statistics reduce fixed row groups in order. Then the experts' activation      */
/*    (SwiGLU or GELU) times the row's probability, the experts' and the router's biases, the     */
/*    shared expert's gate, casts for the fp32 router GEMM, and the                               */
/*    step's bookkeeping: the global aux loss's running average and the expert-bias update.      */
/*    defines: moe_routing, moe_work_words, moe_row_of_token / moe_token_of_row, moe_route,      */
/*    moe_aux_stats, moe_aux_finish, moe_route_backward, moe_permute, moe_unpermute,             */
/*    moe_act_prob(_backward) (moe_swiglu_prob: its SwiGLU), moe_rows_bias(_grad),                */
/*    moe_router_bias, moe_row_prob_scatter (expert parallelism), moe_gate_forward /              */
/*    moe_gate_backward, moe_add_f32, moe_to_f32, moe_global_aux_average, moe_expert_bias_update.  */
/* ============================================================================================== */

/* One MoE layer's routing settings (host, by value). */
typedef struct {
    int N, B, T, E, k;          /* tokens (N = B*T), sequences, positions, experts, top-k */
    int sigmoid;                /* 0: softmax scores, 1: sigmoid scores */
    int pre_softmax;            /* softmax over all experts, then top-k (softmax only) */
    float scaling;              /* --moe-router-topk-scaling-factor (0: none) */
    int num_groups, group_topk; /* group-limited routing (0: none) */
    int round_bf16;             /* Megatron's default router dtype in bf16 training: the logits are rounded to
                                   bf16 (in place, first), and the final probabilities too */
    int capacity;               /* C (0: dropless) */
    int drop_position;          /* the "position" drop policy (else "probs") */
    int pad;                    /* --moe-pad-expert-input-to-capacity: exactly C rows per expert */
} moe_routing;

#define MOE_MAX_EXPERTS MT_MOE_MAX_EXPERTS /* the per-token kernels keep a token's E scores in shared memory */
#define MOE_MAX_TOPK MT_MOE_MAX_TOPK         /* selected experts per token (a warp's lanes) */
#define MOE_SIGMOID_EPS 1e-20f /* Megatron's guard of the sigmoid top-k normalisation */

/* Words of int32 scratch the routing launchers need (the caller allocates at least this). */
inline __host__ __device__ int64_t moe_work_words(int N, int E, int B) { return MT_MOE_WORK_WORDS(N, E, B); }

/* Megatron's token number n = t*B + j of row r = j*T + t, and back. */
static __host__ __device__ int moe_row_of_token(int n, int B, int T) { return (n % B) * T + n / B; }
static __host__ __device__ int moe_token_of_row(int r, int B, int T) { return (r % T) * B + r / T; }

/* Capacity dropping applies when 0 < C < N (C >= N: nothing dropped, no padding). */
static __host__ __device__ bool moe_drops(const moe_routing& r) { return r.capacity > 0 && r.capacity < r.N; }

/* ---- the per-token selection (forward and backward) ---- */

/* A warp's shared memory for one token: the ranking values, the score values, group scores and the
 * group choice, the selected experts (descending) and their probabilities. */
struct moe_warp_smem {
    float* rank;      /* [E] what the top-k ranks (NaN taken as -inf) */
    float* val;       /* [E] logits (softmax), softmax over all (pre-softmax) or sigmoid scores */
    float* gscore;    /* [E] group scores (G <= E) */
    uint8_t* gsel;    /* [E] 1 for a selected group */
    int* sel;         /* [MOE_MAX_TOPK] the selected experts, best first */
    float* selp;      /* [MOE_MAX_TOPK] their probabilities */
};
static __host__ __device__ int moe_warp_smem_bytes(int E) {
    return ((E * 12 + E + 15) / 16) * 16 + MOE_MAX_TOPK * 8;
}
static __host__ int moe_warps_per_block(int E) { return E <= 256 ? 4 : 1; }
__device__ moe_warp_smem moe_warp_smem_at(unsigned char* base, int E, int warp) {
    unsigned char* p = base + (int64_t)warp * moe_warp_smem_bytes(E);
    moe_warp_smem s;
    s.rank = (float*)p;
    s.val = s.rank + E;
    s.gscore = s.val + E;
    s.gsel = (uint8_t*)(s.gscore + E);
    s.sel = (int*)(p + ((E * 12 + E + 15) / 16) * 16);
    s.selp = (float*)(s.sel + MOE_MAX_TOPK);
    return s;
}

/* The selection order: (v, i) comes before (w, j) when v > w, or v == w and i < j (a stable sort's
 * order, ties to the lower index). */
__device__ __forceinline__ bool moe_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

/* The warp's best (value, index) over the lanes' candidates (index INT_MAX: none), in a fixed tree. */
__device__ __forceinline__ void moe_warp_best(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        int j = __shfl_xor_sync(0xffffffffu, i, o);
        if (j != INT_MAX && (i == INT_MAX || moe_before(w, j, v, i))) { v = w; i = j; }
    }
}

/* The k experts of a token, best first, into s.sel: the top k of s.rank over the experts of the
 * group_topk groups whose score (the sum of their top k/group_topk ranks, summed best first) is
 * largest (all experts without groups). Each pick is the best element after the previous one in
 * the selection order, so no element is marked. Called by a whole warp. */
__device__ void moe_select(const moe_routing& r, const moe_warp_smem& s, int k, bool groups, int lane) {
    const int E = r.E;
    if (groups) {
        const int G = r.num_groups, per = E / G, m = r.k / r.group_topk;
        for (int g = lane; g < G; g += 32) {
            const float* x = s.rank + g * per;
            float pv = INFINITY, sum = 0.0f;
            int pi = -1;
            for (int t = 0; t < m; t++) { /* the next best of the group, after (pv, pi) */
                float bv = 0.0f;
                int bi = INT_MAX;
                for (int e = 0; e < per; e++)
                    if (moe_before(pv, pi, x[e], e) && (bi == INT_MAX || moe_before(x[e], e, bv, bi))) { bv = x[e]; bi = e; }
                sum += bv;
                pv = bv; pi = bi;
            }
            s.gscore[g] = sum;
            s.gsel[g] = 0;
        }
        __syncwarp();
        float pv = INFINITY;
        int pi = -1;
        for (int t = 0; t < r.group_topk; t++) {
            float bv = 0.0f;
            int bi = INT_MAX;
            for (int g = lane; g < G; g += 32) {
                float x = s.gscore[g];
                if (x != x) x = -INFINITY;
                if (moe_before(pv, pi, x, g) && (bi == INT_MAX || moe_before(x, g, bv, bi))) { bv = x; bi = g; }
            }
            moe_warp_best(bv, bi);
            if (lane == 0 && bi != INT_MAX) s.gsel[bi] = 1;
            pv = bv; pi = bi;
        }
        __syncwarp();
    }
    const int per = groups ? E / r.num_groups : E;
    float pv = INFINITY;
    int pi = -1;
    for (int t = 0; t < k; t++) {
        float bv = 0.0f;
        int bi = INT_MAX;
        for (int e = lane; e < E; e += 32) {
            if (groups && !s.gsel[e / per]) continue;
            const float x = s.rank[e];
            if (moe_before(pv, pi, x, e) && (bi == INT_MAX || moe_before(x, e, bv, bi))) { bv = x; bi = e; }
        }
        moe_warp_best(bv, bi);
        if (lane == 0) s.sel[t] = bi == INT_MAX ? 0 : bi; /* none: only with groups the launcher refuses */
        pv = bv; pi = bi;
    }
    __syncwarp();
}

__device__ __forceinline__ float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float moe_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/* Loads token row `row`'s logits (rounded to bf16 in place first when `round_in_place`), fills s.val
 * and s.rank as the routing ranks them, selects the k experts into s.sel, and returns the row's max
 * logit and sum of exp(logit - max) (the full softmax's, for pre-softmax). */
__device__ void moe_token_select(const moe_routing& r, const moe_warp_smem& s, float* logits_row,
                                 const float* expert_bias, bool round_in_place, int lane, float* max_out,
                                 float* sum_out) {
    const int E = r.E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        float l = logits_row[e];
        if (round_in_place) {
            l = moe_round_bf16(l);
            logits_row[e] = l;
        }
        s.val[e] = l;
        mx = fmaxf(mx, l);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    if (!r.sigmoid && r.pre_softmax) {
        for (int e = lane; e < E; e += 32) sum += expf(s.val[e] - mx);
        sum = warp_sum(sum);
    }
    for (int e = lane; e < E; e += 32) {
        float v = s.val[e], rk;
        if (r.sigmoid) {
            v = moe_sigmoid(v);
            rk = expert_bias ? v + expert_bias[e] : v;
        } else if (r.pre_softmax) {
            v = expf(v - mx) / sum;
            rk = v;
        } else {
            rk = v;
        }
        s.val[e] = v;
        s.rank[e] = rk != rk ? -INFINITY : rk;
    }
    __syncwarp();
    moe_select(r, s, r.k, r.group_topk > 0, lane);
    *max_out = mx;
    *sum_out = sum;
}

/* The probabilities of the selected experts before scaling (lane 0, serially: k is small):
 * softmax over the selected logits (max first, then the sum in selection order), the pre-softmax
 * scores as they are, or the sigmoid scores normalised by their sum (k > 1). */
__device__ void moe_selected_probs(const moe_routing& r, const moe_warp_smem& s, float* q) {
    const int k = r.k;
    if (r.sigmoid) {
        float sum = 0.0f;
        for (int i = 0; i < k; i++) { q[i] = s.val[s.sel[i]]; sum += q[i]; }
        if (k > 1)
            for (int i = 0; i < k; i++) q[i] = q[i] / (sum + MOE_SIGMOID_EPS);
    } else if (r.pre_softmax) {
        for (int i = 0; i < k; i++) q[i] = s.val[s.sel[i]];
    } else {
        float m = s.val[s.sel[0]], sum = 0.0f;
        for (int i = 1; i < k; i++) m = fmaxf(m, s.val[s.sel[i]]);
        for (int i = 0; i < k; i++) { q[i] = expf(s.val[s.sel[i]] - m); sum += q[i]; }
        for (int i = 0; i < k; i++) q[i] = q[i] / sum;
    }
}

/* The order-preserving unsigned key of a probability (+0 for both zeros). */
__device__ __forceinline__ uint32_t moe_prob_key(float p) {
    uint32_t u = __float_as_uint(p == 0.0f ? 0.0f : p);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Routing, step 1, a warp per token: probs [N, E] (the routed probabilities, 0 elsewhere), the map
 * column-major by token number (map [E][N], 1 routed), and with capacity the drop keys [E][N]. */
__global__ void moe_topk_kernel(moe_routing r, float* logits, const float* expert_bias, float* probs,
                                int32_t* map, uint32_t* keys) {
    extern __shared__ __align__(16) unsigned char moe_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + warp;
    if (row >= r.N) return;
    const int E = r.E;
    moe_warp_smem s = moe_warp_smem_at(moe_smem, E, warp);
    float mx, sum;
    moe_token_select(r, s, logits + (int64_t)row * E, r.sigmoid ? expert_bias : NULL, r.round_bf16 != 0, lane, &mx,
                     &sum);
    if (lane == 0) {
        float q[MOE_MAX_TOPK];
        moe_selected_probs(r, s, q);
        for (int i = 0; i < r.k; i++) {
            float p = r.scaling != 0.0f ? q[i] * r.scaling : q[i];
            s.selp[i] = r.round_bf16 ? moe_round_bf16(p) : p;
        }
    }
    __syncwarp();
    const int n = moe_token_of_row(row, r.B, r.T);
    for (int e = lane; e < E; e += 32) {
        float p = 0.0f;
        int routed = 0;
        for (int i = 0; i < r.k; i++)
            if (s.sel[i] == e) { p = s.selp[i]; routed = 1; }
        probs[(int64_t)row * E + e] = p;
        map[(int64_t)e * r.N + n] = routed;
        if (keys) keys[(int64_t)e * r.N + n] = r.drop_position ? (uint32_t)routed : moe_prob_key(p);
    }
}

/* Block-wide exclusive scan of 0/1 flags in thread order; returns this thread's prefix and puts the
 * block's total in *total. blockDim.x a multiple of 32, <= 1024. */
__device__ int moe_block_scan(int flag, int* total) {
    __shared__ int warp_counts[33];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned bits = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(bits & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) warp_counts[warp] = __popc(bits);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int w = 0; w < warps; w++) { int c = warp_counts[w]; warp_counts[w] = acc; acc += c; }
        warp_counts[32] = acc;
    }
    __syncthreads();
    *total = warp_counts[32];
    return warp_counts[warp] + in_warp;
}

/* Routing, step 2 (capacity 0 < C < N), a block per expert column: the C tokens with the largest
 * keys (ties: the lower token number), by a 4-pass radix select on 8-bit digits (integer
 * histograms), then a scan over the tied tokens in token order. The map becomes the kept routed
 * tokens, or with pad the kept tokens; a routed pair that is dropped gets probability 0. */
__global__ void moe_capacity_kernel(moe_routing r, float* probs, int32_t* map, const uint32_t* keys) {
    __shared__ int hist[256];
    __shared__ uint32_t sh_prefix;
    __shared__ int sh_need;
    const int e = blockIdx.x, N = r.N;
    const uint32_t* key = keys + (int64_t)e * N;
    int32_t* col = map + (int64_t)e * N;
    if (threadIdx.x == 0) { sh_prefix = 0; sh_need = r.capacity; }
    uint32_t mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const uint32_t prefix = sh_prefix;
        for (int n = threadIdx.x; n < N; n += blockDim.x) {
            const uint32_t k = key[n];
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1); /* a count: any order */
        }
        __syncthreads();
        if (threadIdx.x == 0) { /* the digit holding the need-th largest key among those matching */
            int need = sh_need, above = 0, d = 255;
            for (; d > 0; d--) {
                if (above + hist[d] >= need) break;
                above += hist[d];
            }
            sh_need = need - above;
            sh_prefix = prefix | ((uint32_t)d << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    const uint32_t v = sh_prefix; /* the C-th largest key; take sh_need of the tokens equal to it */
    const int need = sh_need;
    int base = 0;
    for (int n0 = 0; n0 < N; n0 += blockDim.x) {
        const int n = n0 + threadIdx.x;
        const uint32_t k = n < N ? key[n] : 0;
        int total;
        const int rank = moe_block_scan(n < N && k == v, &total);
        if (n < N) {
            const bool keep = k > v || (k == v && base + rank < need);
            const int routed = col[n];
            col[n] = r.pad ? (int)keep : (int)(routed && keep);
            if (routed && !keep) probs[(int64_t)moe_row_of_token(n, r.B, r.T) * r.E + e] = 0.0f;
        }
        base += total;
    }
}

/* Integer block sum (blockDim.x a multiple of 32). */
__device__ int moe_block_sum_int(int v) {
    __shared__ int part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Routing, step 3, a block per expert: counts[e] = its rows. */
__global__ void moe_count_kernel(const int32_t* map, int N, int32_t* counts) {
    const int32_t* col = map + (int64_t)blockIdx.x * N;
    int c = 0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) c += col[n];
    c = moe_block_sum_int(c);
    if (threadIdx.x == 0) counts[blockIdx.x] = c;
}

/* Routing, step 4, one thread: offsets = the exclusive prefix sum (counts[E..2E]); step_counts += counts. */
__global__ void moe_offsets_kernel(int32_t* counts, int E, int32_t* step_counts) {
    int acc = 0;
    for (int e = 0; e < E; e++) {
        counts[E + e] = acc;
        acc += counts[e];
        if (step_counts) atomicAdd(&step_counts[e], counts[e]); /* integer: any order */
    }
    counts[2 * E] = acc;
}

/* Routing, step 5, a block per expert: its rows in token order (a scan of the map column), writing
 * token_of, row_prob and the column of row_of (-1 off the map). */
__global__ void moe_scatter_kernel(moe_routing r, const float* probs, const int32_t* map, const int32_t* counts,
                                   int32_t* row_of, int32_t* token_of, float* row_prob) {
    const int e = blockIdx.x, N = r.N, E = r.E;
    const int32_t* col = map + (int64_t)e * N;
    int base = counts[E + e];
    for (int n0 = 0; n0 < N; n0 += blockDim.x) {
        const int n = n0 + threadIdx.x;
        const int flag = n < N ? col[n] : 0;
        int total;
        const int rank = moe_block_scan(flag, &total);
        if (n < N) {
            const int row = moe_row_of_token(n, r.B, r.T);
            const int64_t at = (int64_t)row * E + e;
            if (flag) {
                const int p = base + rank;
                token_of[p] = row;
                row_prob[p] = probs[at];
                row_of[at] = p;
            } else {
                row_of[at] = -1;
            }
        }
        base += total;
    }
}

/* The refusals every routing launcher shares (one line each, recorded in the error record). */
static bool moe_routing_ok(const mt_exec* ex, const moe_routing& r, const char* who) {
    if (r.N <= 0 || r.B <= 0 || r.T <= 0 || (int64_t)r.B * r.T != r.N)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: N = %d must be B * T = %d * %d", who, r.N, r.B, r.T);
    if (r.E < 1 || r.E > MOE_MAX_EXPERTS)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: %d experts, must be in [1, %d]", who, r.E, MOE_MAX_EXPERTS);
    if (r.k < 1 || r.k > r.E || r.k > MOE_MAX_TOPK)
        return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: top-k %d must be in [1, min(E = %d, %d)]", who, r.k, r.E,
                           MOE_MAX_TOPK);
    if (r.group_topk) {
        const int G = r.num_groups, g = r.group_topk;
        if (G < 1 || r.E % G || g > G || r.k < g || r.k > g * (r.E / G))
            return mt_gpu_fail(ex->error, MT_ERR_ARG,
                               "%s: group-limited routing needs E %% G == 0, group_topk <= G and group_topk <= k <= "
                               "group_topk * E / G (E %d, G %d, group_topk %d, k %d)", who, r.E, G, g, r.k);
    }
    if (r.capacity < 0) return mt_gpu_fail(ex->error, MT_ERR_ARG, "%s: capacity %d < 0", who, r.capacity);
    return true;
}

void moe_route(const mt_exec* ex, const moe_routing& r, float* logits, const float* expert_bias, float* probs,
                      int32_t* row_of, int32_t* token_of, float* row_prob, int32_t* counts, int32_t* step_counts,
                      int32_t* work) {
    if (!moe_routing_ok(ex, r, "moe_route")) return;
    const int64_t NE = (int64_t)r.N * r.E;
    int32_t* map = work;                                    /* [E][N] */
    uint32_t* keys = moe_drops(r) ? (uint32_t*)(work + NE) : NULL; /* [E][N] */
    const int warps = moe_warps_per_block(r.E);
    moe_topk_kernel<<<ceil_div(r.N, warps), warps * 32, warps * moe_warp_smem_bytes(r.E), ex->stream>>>(
        r, logits, expert_bias, probs, map, keys);
    if (!LAUNCH_CHECK(ex->error)) return;
    if (keys) {
        moe_capacity_kernel<<<r.E, 1024, 0, ex->stream>>>(r, probs, map, keys);
        if (!LAUNCH_CHECK(ex->error)) return;
    }
    moe_count_kernel<<<r.E, 256, 0, ex->stream>>>(map, r.N, counts);
    if (!LAUNCH_CHECK(ex->error)) return;
    moe_offsets_kernel<<<1, 1, 0, ex->stream>>>(counts, r.E, step_counts);
    if (!LAUNCH_CHECK(ex->error)) return;
    moe_scatter_kernel<<<r.E, 1024, 0, ex->stream>>>(r, probs, map, counts, row_of, token_of, row_prob);
    LAUNCH_CHECK(ex->error);
}

/* ---- the auxiliary losses' statistics ---- */

/* The aux scores of a token row into s.val (softmax over all E, or the sigmoid normalised by its sum
 * + 1e-20), and the row's logsumexp. Called by a whole warp. */
__device__ float moe_aux_scores(const moe_routing& r, const moe_warp_smem& s, const float* logits_row, int lane) {
    const int E = r.E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, logits_row[e]);
    mx = warp_max(mx);
    float se = 0.0f, ss = 0.0f;
    for (int e = lane; e < E; e += 32) {
        const float l = logits_row[e];
        se += expf(l - mx);
        if (r.sigmoid) ss += moe_sigmoid(l);
    }
    se = warp_sum(se);
    ss = warp_sum(ss);
    for (int e = lane; e < E; e += 32) {
        const float l = logits_row[e];
        const float v = r.sigmoid ? moe_sigmoid(l) / (ss + MOE_SIGMOID_EPS) : expf(l - mx) / se;
        s.val[e] = v;
        s.rank[e] = v != v ? -INFINITY : v;
    }
    __syncwarp();
    return mx + logf(se);
}

/* Aux stats, step 1, a warp per token: S with the sign bit set where A (the plain top-k of S) holds,
 * as fp32 bits in sa [N, E]; lse^2 into lse2 [N]. */
__global__ void moe_aux_rows_kernel(moe_routing r, const float* logits, float* sa, float* lse2) {
    extern __shared__ __align__(16) unsigned char moe_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + warp;
    if (row >= r.N) return;
    const int E = r.E;
    moe_warp_smem s = moe_warp_smem_at(moe_smem, E, warp);
    const float lse = moe_aux_scores(r, s, logits + (int64_t)row * E, lane);
    moe_select(r, s, r.k, false, lane);
    for (int e = lane; e < E; e += 32) {
        bool chosen = false;
        for (int i = 0; i < r.k; i++) chosen |= s.sel[i] == e;
        const float v = s.val[e];
        sa[(int64_t)row * E + e] = chosen ? -v : v; /* S >= 0: the sign carries A (-0 for a chosen 0) */
    }
    if (lane == 0) lse2[row] = lse * lse;
}

/* Aux stats, step 2, block (32 columns, sequence j): each of 8 row groups sums its positions in
 * order, then the 8 in order: rows 1 + j of score_sums and aux_counts. */
__global__ void moe_aux_columns_kernel(moe_routing r, const float* sa, int32_t* aux_counts, float* score_sums) {
    __shared__ float part_s[8][32];
    __shared__ int part_c[8][32];
    const int c = threadIdx.x, g = threadIdx.y, e = blockIdx.x * 32 + c, j = blockIdx.y;
    float sum = 0.0f;
    int cnt = 0;
    if (e < r.E)
        for (int t = g; t < r.T; t += 8) {
            const float v = sa[((int64_t)j * r.T + t) * r.E + e];
            sum += fabsf(v);
            cnt += signbit(v) ? 1 : 0;
        }
    part_s[g][c] = sum;
    part_c[g][c] = cnt;
    __syncthreads();
    if (g == 0 && e < r.E) {
        float a = 0.0f;
        int b = 0;
        for (int i = 0; i < 8; i++) { a += part_s[i][c]; b += part_c[i][c]; }
        score_sums[(int64_t)(1 + j) * r.E + e] = a;
        aux_counts[(int64_t)(1 + j) * r.E + e] = b;
    }
}

/* Aux stats, step 3, one block: row 0 = the sequences' rows in order; lse_sq_sum = the fixed-order sum. */
__global__ void moe_aux_total_kernel(moe_routing r, const float* lse2, int32_t* aux_counts, float* score_sums,
                                     float* lse_sq_sum) {
    for (int e = threadIdx.x; e < r.E; e += blockDim.x) {
        float a = 0.0f;
        int b = 0;
        for (int j = 0; j < r.B; j++) { a += score_sums[(int64_t)(1 + j) * r.E + e]; b += aux_counts[(int64_t)(1 + j) * r.E + e]; }
        score_sums[e] = a;
        aux_counts[e] = b;
    }
    float z = 0.0f;
    for (int i = threadIdx.x; i < r.N; i += blockDim.x) z += lse2[i];
    z = block_sum(z);
    if (threadIdx.x == 0) lse_sq_sum[0] = z;
}

void moe_aux_stats(const mt_exec* ex, const moe_routing& r, const float* logits, int32_t* aux_counts,
                          float* score_sums, float* lse_sq_sum, int32_t* work) {
    if (!moe_routing_ok(ex, r, "moe_aux_stats")) return;
    float* sa = (float*)work;                          /* [N, E] */
    float* lse2 = (float*)(work + (int64_t)r.N * r.E); /* [N] */
    const int warps = moe_warps_per_block(r.E);
    moe_aux_rows_kernel<<<ceil_div(r.N, warps), warps * 32, warps * moe_warp_smem_bytes(r.E), ex->stream>>>(
        r, logits, sa, lse2);
    if (!LAUNCH_CHECK(ex->error)) return;
    moe_aux_columns_kernel<<<dim3(ceil_div(r.E, 32), r.B), dim3(32, 8), 0, ex->stream>>>(r, sa, aux_counts, score_sums);
    if (!LAUNCH_CHECK(ex->error)) return;
    moe_aux_total_kernel<<<1, 1024, 0, ex->stream>>>(r, lse2, aux_counts, score_sums, lse_sq_sum);
    LAUNCH_CHECK(ex->error);
}

/* The aux losses from the stats: one block; scale factors come from the host in double. */
__global__ void moe_aux_finish_kernel(moe_routing r, const int32_t* aux_counts, const float* score_sums,
                                      const float* lse_sq_sum, const float* global_avg, float f_aux, float f_seq,
                                      float f_global, float coef_aux, float coef_seq, float coef_global, float coef_z,
                                      float* grad_w, float* log) {
    const int E = r.E, B = r.B;
    float a = 0.0f, q = 0.0f, g = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (coef_aux != 0.0f) a += score_sums[e] * (float)aux_counts[e];
        if (coef_seq != 0.0f)
            for (int j = 0; j < B; j++) q += score_sums[(int64_t)(1 + j) * E + e] * (float)aux_counts[(int64_t)(1 + j) * E + e];
        if (coef_global != 0.0f) g += score_sums[e] * global_avg[e];
    }
    a = block_sum(a);
    q = block_sum(q);
    g = block_sum(g);
    /* grad_w[j, e] = d(total)/dS[row of sequence j, e] */
    for (int i = threadIdx.x; i < B * E; i += blockDim.x) {
        const int j = i / E, e = i % E;
        float v = 0.0f;
        if (coef_aux != 0.0f) v += (float)aux_counts[e] * (f_aux * coef_aux);
        if (coef_seq != 0.0f) v += (float)aux_counts[(int64_t)(1 + j) * E + e] * (f_seq * coef_seq);
        if (coef_global != 0.0f) v += global_avg[e] * (f_global * coef_global);
        grad_w[i] = v;
    }
    if (threadIdx.x == 0) {
        if (coef_aux != 0.0f) log[0] += a * f_aux;
        if (coef_seq != 0.0f) log[1] += q * f_seq;
        if (coef_global != 0.0f) log[2] += g * f_global;
        if (coef_z != 0.0f) log[3] += lse_sq_sum[0] / (float)r.N;
    }
}

void moe_aux_finish(const mt_exec* ex, const moe_routing& r, const int32_t* aux_counts, const float* score_sums,
                           const float* lse_sq_sum, const float* global_avg, double n_global, float coef_aux,
                           float coef_seq, float coef_global, float coef_z, float* grad_w, float* log) {
    if (!moe_routing_ok(ex, r, "moe_aux_finish")) return;
    if (coef_global != 0.0f && (!global_avg || !(n_global > 0)))
        return (void)mt_gpu_fail(ex->error, MT_ERR_ARG, "moe_aux_finish: the global aux loss needs global_avg and n_global > 0");
    /* the logged value of each term (loss / coef) per unit of sum_i S_i c_i: E / (k n^2), seq / B */
    const double E = r.E, k = r.k;
    const float f_aux = (float)(E / (k * (double)r.N * (double)r.N));
    const float f_seq = (float)(E / (k * (double)r.T * (double)r.T) / (double)r.B);
    const float f_global = coef_global != 0.0f ? (float)(E / (k * n_global * n_global)) : 0.0f;
    moe_aux_finish_kernel<<<1, 256, 0, ex->stream>>>(r, aux_counts, score_sums, lse_sq_sum, global_avg, f_aux, f_seq,
                                                     f_global, coef_aux, coef_seq, coef_global, coef_z, grad_w, log);
    LAUNCH_CHECK(ex->error);
}

/* ---- the router's backward, a warp per token ---- */

__global__ void moe_route_backward_kernel(moe_routing r, const float* logits, const float* expert_bias,
                                          const float* dprobs, const float* grad_w, float aux_scale, float z_scale,
                                          float* dlogits) {
    extern __shared__ __align__(16) unsigned char moe_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + warp;
    if (row >= r.N) return;
    const int E = r.E, k = r.k;
    moe_warp_smem s = moe_warp_smem_at(moe_smem, E, warp);
    const float* lrow = logits + (int64_t)row * E;
    float* drow = dlogits + (int64_t)row * E;
    float mx, sum;
    moe_token_select(r, s, (float*)lrow, r.sigmoid ? expert_bias : NULL, false, lane, &mx, &sum);
    /* the routed probabilities' gradient: dq_i = c dprobs (c: the scaling), then back through the
     * normalisation over the k and the score function; selp holds dq, gscore the per-expert result */
    if (lane == 0) {
        float q[MOE_MAX_TOPK];
        moe_selected_probs(r, s, q);
        const float c = r.scaling != 0.0f ? r.scaling : 1.0f;
        float dot = 0.0f;
        for (int i = 0; i < k; i++) { s.selp[i] = c * dprobs[(int64_t)row * E + s.sel[i]]; }
        if (r.sigmoid) {
            float ssum = 0.0f, t = 0.0f;
            for (int i = 0; i < k; i++) { ssum += s.val[s.sel[i]]; t += s.selp[i] * s.val[s.sel[i]]; }
            const float D = ssum + MOE_SIGMOID_EPS;
            for (int i = 0; i < k; i++) { /* ds_i, then times sigmoid' = s(x) s(-x) (no 1 - s cancellation) */
                const float sv = s.val[s.sel[i]];
                const float ds = k > 1 ? s.selp[i] / D - t / (D * D) : s.selp[i];
                s.selp[i] = ds * sv * moe_sigmoid(-lrow[s.sel[i]]);
            }
        } else if (r.pre_softmax) {
            for (int i = 0; i < k; i++) dot += q[i] * s.selp[i];
            s.gscore[0] = dot; /* dl_e = S_e (dS_e - dot) over all e */
        } else {
            for (int i = 0; i < k; i++) dot += q[i] * s.selp[i];
            for (int i = 0; i < k; i++) s.selp[i] = q[i] * (s.selp[i] - dot);
        }
    }
    __syncwarp();
    const float pre_dot = (!r.sigmoid && r.pre_softmax) ? s.gscore[0] : 0.0f;
    __syncwarp();
    /* the aux terms' scores (softmax over all, or normalised sigmoid) and the z-loss's softmax */
    float zmx = -INFINITY;
    for (int e = lane; e < E; e += 32) zmx = fmaxf(zmx, lrow[e]);
    zmx = warp_max(zmx);
    float zse = 0.0f, sig = 0.0f;
    for (int e = lane; e < E; e += 32) {
        zse += expf(lrow[e] - zmx);
        if (r.sigmoid) sig += moe_sigmoid(lrow[e]);
    }
    zse = warp_sum(zse);
    sig = warp_sum(sig);
    const float lse = zmx + logf(zse), D = sig + MOE_SIGMOID_EPS;
    const float* gw = grad_w ? grad_w + (int64_t)(row / r.T) * E : NULL;
    float adot = 0.0f; /* softmax: sum_e S_e dS_e; sigmoid: sum_e dS_e sigma_e */
    if (gw) {
        for (int e = lane; e < E; e += 32) {
            const float ds = aux_scale * gw[e];
            adot += r.sigmoid ? ds * moe_sigmoid(lrow[e]) : ds * (expf(lrow[e] - zmx) / zse);
        }
        adot = warp_sum(adot);
    }
    for (int e = lane; e < E; e += 32) {
        const float l = lrow[e], sm = expf(l - zmx) / zse;
        float d = 0.0f;
        if (!r.sigmoid && r.pre_softmax) {
            float dq = 0.0f;
            for (int i = 0; i < k; i++)
                if (s.sel[i] == e) dq = s.selp[i];
            d = s.val[e] * (dq - pre_dot);
        } else {
            for (int i = 0; i < k; i++)
                if (s.sel[i] == e) d = s.selp[i];
        }
        if (gw) {
            const float ds = aux_scale * gw[e];
            if (r.sigmoid) {
                d += (ds / D - adot / (D * D)) * moe_sigmoid(l) * moe_sigmoid(-l);
            } else {
                d += sm * (ds - adot);
            }
        }
        if (z_scale != 0.0f) d += z_scale * 2.0f * lse * sm / (float)r.N;
        drow[e] = d;
    }
}

void moe_route_backward(const mt_exec* ex, const moe_routing& r, const float* logits, const float* expert_bias,
                               const float* dprobs, const float* grad_w, float aux_scale, float z_scale,
                               float* dlogits, int32_t* work) {
    if (!moe_routing_ok(ex, r, "moe_route_backward")) return;
    const int warps = moe_warps_per_block(r.E);
    moe_route_backward_kernel<<<ceil_div(r.N, warps), warps * 32, warps * moe_warp_smem_bytes(r.E), ex->stream>>>(
        r, logits, expert_bias, dprobs, grad_w, aux_scale, z_scale, dlogits);
    LAUNCH_CHECK(ex->error);
}

/* ---- permutation ---- */

/* out [R, h] row p = x row token_of[p]; a thread per element (scalar) or per 16 bytes (vec). */
template <typename T>
__global__ void moe_permute_kernel(T* out, const T* x, const int32_t* token_of, int R, int h) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)R * h) return;
    const int64_t p = i / h, c = i % h;
    out[i] = x[(int64_t)token_of[p] * h + c];
}
template <typename T>
__global__ void moe_permute_vec_kernel(T* out, const T* x, const int32_t* token_of, int R, int h) {
    constexpr int V = vec16<T>::N;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int hv = h / V;
    if (i >= (int64_t)R * hv) return;
    const int64_t p = i / hv, c = (i % hv) * V;
    *reinterpret_cast<int4*>(out + p * h + c) = *reinterpret_cast<const int4*>(x + (int64_t)token_of[p] * h + c);
}

template <typename T>
static void moe_permute(const mt_exec* ex, T* out, const T* x, const int32_t* token_of, int R, int h) {
    if (R <= 0 || h <= 0) return;
    constexpr int V = vec16<T>::N;
    if (h % V == 0 && aligned16(out) && aligned16(x))
        moe_permute_vec_kernel<T><<<ceil_div((int64_t)R * (h / V), 256), 256, 0, ex->stream>>>(out, x, token_of, R, h);
    else
        moe_permute_kernel<T><<<ceil_div((int64_t)R * h, 256), 256, 0, ex->stream>>>(out, x, token_of, R, h);
    LAUNCH_CHECK(ex->error);
}

/* Combine, a block per token row: the row's permuted rows listed in ascending expert order (warp 0,
 * by ballots), then each thread sums its columns over that list in order. */
template <typename T>
__global__ void moe_unpermute_kernel(T* out, const T* rows, const int32_t* row_of, const T* shared, const float* gate,
                                     int E, int h, int accumulate) {
    extern __shared__ int moe_rows[]; /* [E] the row's permuted rows, then the count */
    const int r = blockIdx.x;
    if (threadIdx.x < 32) {
        int count = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + (int)threadIdx.x;
            const int p = e < E ? row_of[(int64_t)r * E + e] : -1;
            const unsigned bits = __ballot_sync(0xffffffffu, p >= 0);
            if (p >= 0) moe_rows[count + __popc(bits & ((1u << threadIdx.x) - 1u))] = p;
            count += __popc(bits);
        }
        if (threadIdx.x == 0) moe_rows[E] = count;
    }
    __syncthreads();
    const int count = moe_rows[E];
    const float gv = shared ? (gate ? gate[r] : 1.0f) : 0.0f;
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < count; i++) acc += to_float(rows[(int64_t)moe_rows[i] * h + c]);
        if (shared) acc += gv * to_float(shared[(int64_t)r * h + c]);
        T* o = out + (int64_t)r * h + c;
        *o = from_float<T>(accumulate ? to_float(*o) + acc : acc);
    }
}

template <typename T>
static void moe_unpermute(const mt_exec* ex, T* out, const T* rows, const int32_t* row_of, const T* shared,
                          const float* gate, int N, int E, int h, bool accumulate) {
    if (N <= 0 || h <= 0) return;
    if (E < 1 || E > MOE_MAX_EXPERTS)
        return (void)mt_gpu_fail(ex->error, MT_ERR_ARG, "moe_unpermute: %d experts, must be in [1, %d]", E, MOE_MAX_EXPERTS);
    const int threads = h >= 1024 ? 256 : 128;
    moe_unpermute_kernel<T><<<N, threads, (E + 1) * sizeof(int), ex->stream>>>(out, rows, row_of, shared, gate, E, h,
                                                                               accumulate ? 1 : 0);
    LAUNCH_CHECK(ex->error);
}

/* ---- the experts' activation times the row's probability, and the experts' biases ---- */

/* The expert of permuted row p: e with offsets[e] <= p < offsets[e + 1] (offsets [E + 1], ascending). */
static __device__ int moe_expert_of_row(const int32_t* offsets, int E, int p) {
    int lo = 0, hi = E;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (offsets[mid] <= p) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The experts' activation (Megatron's experts follow the model's): MOE_ACT_SWIGLU, z [R, 2 fe] with each
 * row's gate columns then its up columns; or the dense MLP's elementwise one (ACT_GELU, ACT_SQUARED_RELU),
 * z [R, fe]. */
enum { MOE_ACT_SWIGLU = 2 };
static_assert((int)MOE_ACT_SWIGLU != (int)ACT_GELU && (int)MOE_ACT_SWIGLU != (int)ACT_SQUARED_RELU, "distinct kinds");

template <typename T, int KIND>
__global__ void moe_act_prob_kernel(T* act, const T* z, const float* row_prob, int R, int fe) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)R * fe) return;
    const int64_t p = i / fe, c = i % fe;
    float y;
    if (KIND == MOE_ACT_SWIGLU) {
        const float gate = to_float(z[p * 2 * fe + c]), up = to_float(z[p * 2 * fe + fe + c]);
        y = silu(gate) * up;
    } else {
        y = activation<KIND == MOE_ACT_SWIGLU ? ACT_GELU : KIND>(to_float(z[i]));
    }
    act[i] = from_float<T>(y * row_prob[p]);
}

/* act [R, fe] = act(z) times the row's probability (Megatron applies it there, before fc2). */
template <typename T>
static void moe_act_prob(const mt_exec* ex, T* act, const T* z, const float* row_prob, int R, int fe, int kind) {
    if (R <= 0 || fe <= 0) return;
    const unsigned blocks = ceil_div((int64_t)R * fe, 256);
    if (kind == MOE_ACT_SWIGLU)
        moe_act_prob_kernel<T, MOE_ACT_SWIGLU><<<blocks, 256, 0, ex->stream>>>(act, z, row_prob, R, fe);
    else if (kind == ACT_SQUARED_RELU)
        moe_act_prob_kernel<T, ACT_SQUARED_RELU><<<blocks, 256, 0, ex->stream>>>(act, z, row_prob, R, fe);
    else
        moe_act_prob_kernel<T, ACT_GELU><<<blocks, 256, 0, ex->stream>>>(act, z, row_prob, R, fe);
    LAUNCH_CHECK(ex->error);
}
template <typename T>
static void moe_swiglu_prob(const mt_exec* ex, T* act, const T* z, const float* row_prob, int R, int fe) {
    moe_act_prob<T>(ex, act, z, row_prob, R, fe, MOE_ACT_SWIGLU);
}

/* A block per permuted row: dz, and dp = sum_j act(z)_j dact_j (each thread's columns in order, then
 * block_sum's fixed tree), plus, with the experts' fc2 bias (fc2_bias [E, h], the row's output gradient dy
 * [R, h]), dy . b2 of the row's expert (the bias is weighted by the probability: p (fc2(a) + b2)), into
 * dprobs at (token, expert of the row); without token_of (expert parallelism: the rows are another rank's
 * tokens) into dprobs [R] at the row. */
template <typename T, int KIND>
__global__ void moe_act_prob_backward_kernel(T* dz, float* dprobs, const T* dact, const T* z, const float* row_prob,
                                             const int32_t* token_of, const int32_t* offsets, int fe, int E,
                                             const T* dy, const T* fc2_bias, int h) {
    const int64_t p = blockIdx.x;
    const float prob = row_prob[p];
    float dp = 0.0f;
    for (int c = threadIdx.x; c < fe; c += blockDim.x) {
        if (KIND == MOE_ACT_SWIGLU) {
            const float gate = to_float(z[p * 2 * fe + c]), up = to_float(z[p * 2 * fe + fe + c]);
            const float d = to_float(dact[p * fe + c]);
            const float s = 1.0f / (1.0f + expf(-gate)), sl = gate * s;
            dz[p * 2 * fe + c] = from_float<T>(d * prob * up * s * (1.0f + gate * (1.0f - s)));
            dz[p * 2 * fe + fe + c] = from_float<T>(d * prob * sl);
            dp += sl * up * d;
        } else {
            constexpr int A = KIND == MOE_ACT_SWIGLU ? ACT_GELU : KIND;
            const float x = to_float(z[p * fe + c]), d = to_float(dact[p * fe + c]);
            dz[p * fe + c] = from_float<T>(d * prob * activation_derivative<A>(x));
            dp += activation<A>(x) * d;
        }
    }
    __shared__ int expert;
    if (offsets) {
        if (threadIdx.x == 0) expert = moe_expert_of_row(offsets, E, (int)p);
        __syncthreads();
        if (fc2_bias)
            for (int j = threadIdx.x; j < h; j += blockDim.x)
                dp += to_float(dy[p * h + j]) * to_float(fc2_bias[(int64_t)expert * h + j]);
    }
    dp = block_sum(dp);
    if (threadIdx.x == 0 && !token_of) { /* expert parallelism: the row's own gradient, dprobs [R] */
        dprobs[p] = dp;
        return;
    }
    if (threadIdx.x == 0) dprobs[(int64_t)token_of[p] * E + expert] = dp;
}

/* dy and fc2_bias: the experts' fc2 bias and the rows' output gradient (NULL: no fc2 bias; needs offsets). */
template <typename T>
static void moe_act_prob_backward(const mt_exec* ex, T* dz, float* dprobs, const T* dact, const T* z,
                                  const float* row_prob, const int32_t* token_of, const int32_t* offsets, int R,
                                  int fe, int E, int kind, const T* dy = NULL, const T* fc2_bias = NULL, int h = 0) {
    if (R <= 0 || fe <= 0) return;
    if (fc2_bias && !offsets) {
        mt_gpu_fail(ex->error, MT_ERR_CONFIG, "moe_act_prob_backward: the fc2 bias needs the rows' experts");
        return;
    }
    const int threads = fe >= 512 ? 256 : fe >= 128 ? 128 : 32;
    if (kind == MOE_ACT_SWIGLU)
        moe_act_prob_backward_kernel<T, MOE_ACT_SWIGLU><<<R, threads, 0, ex->stream>>>(
            dz, dprobs, dact, z, row_prob, token_of, offsets, fe, E, dy, fc2_bias, h);
    else if (kind == ACT_SQUARED_RELU)
        moe_act_prob_backward_kernel<T, ACT_SQUARED_RELU><<<R, threads, 0, ex->stream>>>(
            dz, dprobs, dact, z, row_prob, token_of, offsets, fe, E, dy, fc2_bias, h);
    else
        moe_act_prob_backward_kernel<T, ACT_GELU><<<R, threads, 0, ex->stream>>>(
            dz, dprobs, dact, z, row_prob, token_of, offsets, fe, E, dy, fc2_bias, h);
    LAUNCH_CHECK(ex->error);
}
template <typename T>
static void moe_swiglu_prob_backward(const mt_exec* ex, T* dz, float* dprobs, const T* dact, const T* z,
                                     const float* row_prob, const int32_t* token_of, const int32_t* offsets, int R,
                                     int fe, int E) {
    moe_act_prob_backward<T>(ex, dz, dprobs, dact, z, row_prob, token_of, offsets, R, fe, E, MOE_ACT_SWIGLU);
}

/* The experts' biases on their rows (--add-bias-linear; Megatron's grouped experts): y [R, C] += b[e] of the
 * row's expert e (offsets [E + 1]), times the row's probability when row_prob is given (the fc2 bias: the
 * expert's output is p (fc2(a) + b2)); a block per row. */
template <typename T>
__global__ void moe_rows_bias_kernel(T* y, const T* bias, const float* row_prob, const int32_t* offsets, int C, int E) {
    const int64_t p = blockIdx.x;
    __shared__ int expert;
    if (threadIdx.x == 0) expert = moe_expert_of_row(offsets, E, (int)p);
    __syncthreads();
    const float scale = row_prob ? row_prob[p] : 1.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        y[p * C + c] = from_float<T>(to_float(y[p * C + c]) + to_float(bias[(int64_t)expert * C + c]) * scale);
}
template <typename T>
static void moe_rows_bias(const mt_exec* ex, T* y, const T* bias, const float* row_prob, const int32_t* offsets, int R,
                          int C, int E) {
    if (R <= 0 || C <= 0) return;
    moe_rows_bias_kernel<T><<<R, C >= 256 ? 256 : 128, 0, ex->stream>>>(y, bias, row_prob, offsets, C, E);
    LAUNCH_CHECK(ex->error);
}

/* Its gradient: db [E, C] (fp32) = sum over expert e's rows of dy [R, C] (times the row's probability when
 * row_prob is given), rows in order, a thread per column (no atomics); added to db when accumulating, else
 * written (an expert without rows: 0). */
template <typename T>
__global__ void moe_rows_bias_grad_kernel(float* db, const T* dy, const float* row_prob, const int32_t* offsets, int C,
                                          int accumulate) {
    const int e = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sum = 0.0f;
    for (int p = offsets[e]; p < offsets[e + 1]; p++)
        sum += to_float(dy[(int64_t)p * C + c]) * (row_prob ? row_prob[p] : 1.0f);
    float* out = db + (int64_t)e * C + c;
    *out = accumulate ? *out + sum : sum;
}
template <typename T>
static void moe_rows_bias_grad(const mt_exec* ex, float* db, const T* dy, const float* row_prob, const int32_t* offsets,
                               int C, int E, bool accumulate) {
    if (C <= 0 || E <= 0) return;
    const dim3 grid((unsigned)E, (unsigned)ceil_div(C, 128));
    moe_rows_bias_grad_kernel<T><<<grid, 128, 0, ex->stream>>>(db, dy, row_prob, offsets, C, accumulate ? 1 : 0);
    LAUNCH_CHECK(ex->error);
}

/* The router's bias (--add-bias-linear, Megatron's router): logits [N, E] += b (widened to fp32). */
template <typename T>
__global__ void moe_router_bias_kernel(float* logits, const T* bias, int64_t n, int E) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) logits[i] += to_float(bias[i % E]);
}
template <typename T>
static void moe_router_bias(const mt_exec* ex, float* logits, const T* bias, int N, int E) {
    const int64_t n = (int64_t)N * E;
    if (n <= 0) return;
    moe_router_bias_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(logits, bias, n, E);
    LAUNCH_CHECK(ex->error);
}

/* Expert parallelism: the rows' probability gradients, come back from the experts' ranks, into dprobs
 * [N, E] at (token, expert of the row); a thread per row (each (token, expert) has one row: no races). */
__global__ void moe_row_prob_scatter_kernel(float* dprobs, const float* drow, const int32_t* token_of,
                                            const int32_t* offsets, int R, int E) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= R) return;
    dprobs[(int64_t)token_of[p] * E + moe_expert_of_row(offsets, E, p)] = drow[p];
}
static void moe_row_prob_scatter(const mt_exec* ex, float* dprobs, const float* drow, const int32_t* token_of,
                                 const int32_t* offsets, int R, int E) {
    if (R <= 0) return;
    moe_row_prob_scatter_kernel<<<ceil_div(R, 256), 256, 0, ex->stream>>>(dprobs, drow, token_of, offsets, R, E);
    LAUNCH_CHECK(ex->error);
}

/* ---- the shared expert's gate ---- */

/* A warp per row: gate[r] = sigmoid(x[r] . w), lanes over columns in order, then the warp's tree. */
template <typename T>
__global__ void moe_gate_forward_kernel(float* gate, const T* x, const T* w, int N, int h) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    float d = 0.0f;
    for (int c = lane; c < h; c += 32) d += to_float(x[(int64_t)row * h + c]) * to_float(w[c]);
    d = warp_sum(d);
    if (lane == 0) gate[row] = moe_sigmoid(d);
}

template <typename T>
static void moe_gate_forward(const mt_exec* ex, float* gate, const T* x, const T* w, int N, int h) {
    if (N <= 0) return;
    moe_gate_forward_kernel<T><<<ceil_div(N, 8), 256, 0, ex->stream>>>(gate, x, w, N, h);
    LAUNCH_CHECK(ex->error);
}

/* Gate backward, a block per row: the dot dout . shared (each thread's columns in order, then
 * block_sum), dgate_logit, dshared = gate * dout (after the dot: dshared may be dout), dx += dgl * w. */
template <typename T>
__global__ void moe_gate_backward_rows_kernel(T* dshared, float* dgate_logit, T* dx, const T* dout, const T* shared,
                                              const float* gate, const T* w, int h) {
    const int64_t r = blockIdx.x;
    float d = 0.0f;
    for (int c = threadIdx.x; c < h; c += blockDim.x) d += to_float(dout[r * h + c]) * to_float(shared[r * h + c]);
    d = block_sum(d);
    const float g = gate[r], dgl = g * (1.0f - g) * d;
    if (threadIdx.x == 0) dgate_logit[r] = dgl;
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        dshared[r * h + c] = from_float<T>(g * to_float(dout[r * h + c]));
        dx[r * h + c] = from_float<T>(to_float(dx[r * h + c]) + dgl * to_float(w[c]));
    }
}

/* dw [h] (+)= sum_r dgl[r] x[r]: block of 32 columns x 32 row groups, each group's rows in order,
 * then the 32 groups in order. */
template <typename T>
__global__ void moe_gate_dw_kernel(float* dw, const float* dgl, const T* x, int N, int h, int accumulate) {
    __shared__ float part[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x, g = threadIdx.y;
    float a = 0.0f;
    if (c < h)
        for (int r = g; r < N; r += 32) a += dgl[r] * to_float(x[(int64_t)r * h + c]);
    part[g][threadIdx.x] = a;
    __syncthreads();
    if (g == 0 && c < h) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += part[i][threadIdx.x];
        dw[c] = accumulate ? dw[c] + s : s;
    }
}

template <typename T>
static void moe_gate_backward(const mt_exec* ex, T* dshared, float* dgate_logit, float* dw, T* dx, const T* dout,
                              const T* shared, const float* gate, const T* x, const T* w, int N, int h,
                              bool accumulate) {
    if (N <= 0 || h <= 0) return;
    moe_gate_backward_rows_kernel<T><<<N, h >= 1024 ? 256 : 128, 0, ex->stream>>>(dshared, dgate_logit, dx, dout,
                                                                                  shared, gate, w, h);
    if (!LAUNCH_CHECK(ex->error)) return;
    moe_gate_dw_kernel<T><<<ceil_div(h, 32), dim3(32, 32), 0, ex->stream>>>(dw, dgate_logit, x, N, h, accumulate ? 1 : 0);
    LAUNCH_CHECK(ex->error);
}

/* ---- fp32 <-> T for the fp32 router ---- */

template <typename T>
__global__ void moe_add_f32_kernel(T* dst, const float* src, int64_t n, int accumulate) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = from_float<T>(accumulate ? to_float(dst[i]) + src[i] : src[i]);
}

template <typename T>
static void moe_add_f32(const mt_exec* ex, T* dst, const float* src, int64_t n, bool accumulate) {
    if (n <= 0) return;
    moe_add_f32_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(dst, src, n, accumulate ? 1 : 0);
    LAUNCH_CHECK(ex->error);
}
template <typename T>
static void moe_to_f32(const mt_exec* ex, float* dst, const T* src, int64_t n) {
    if (n <= 0) return;
    cast_to_float_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(dst, src, n);
    LAUNCH_CHECK(ex->error);
}

/* ============================================================================================== */
/* 22. Generation kernels: the KV cache, decode attention and sampling                            */
/*    What decoding needs beyond the forward's kernels (section 23 runs the engine on them). The  */
/*    cache is a pool of fixed-size blocks, [num_blocks, L, 2, groups, block_tokens, d] in the    */
/*    model type (k then v; a block holds block_tokens consecutive positions of one request for   */
/*    every layer); a request's block table [max_blocks] lists its blocks in position order, so   */
/*    position p lives in block table[p / block_tokens] at offset p mod block_tokens. The engine  */
/*    runs a step as rows: every prompt token of a request being prefilled and one token of each  */
/*    decoding request, row r being request slot slots[r] at position positions[r]. Attention of  */
/*    row r (flash-decoding): its query heads against its request's cached positions 0 .. p (its  */
/*    own K/V included, stored first), cut into splits of GEN_SPLIT_TOKENS positions; one block   */
/*    per (split, K/V group, row) copies the split's keys and values to shared memory at once and */
/*    computes every query head of the group against them (GQA); a row of one split writes its    */
/*    output, else the last block of the row's splits merges them by log-sum-exp in split order.  */
/*    The split count of a row depends on its position alone, so its result never depends on the */
/*    other rows of the step. Sampling: every row's log-sum-exp (untempered) and argmax (ties to  */
/*    the lowest id) from many blocks per row merged in a fixed order (sample_stats_kernel: the    */
/*    greedy and scored rows end there); a row with a temperature then gets one block: the kept    */
/*    set of top-k and top-p as thresholds on the logits' order-preserving bit patterns (a        */
/*    16-ary search, 4 bits a pass over the row; ties at a threshold are kept), then one draw     */
/*    u = counter-hash(seed, token index) inverted through the kept weights' cumulative sum in    */
/*    vocabulary order (fixed per-thread ranges, their sums scanned in a fixed order:             */
/*    deterministic). The decode steps' linears                                                   */
/*    and norms of few rows have their own kernels here (gemv_rows, norm_rows: see there).        */
/*    defines: GEN_SPLIT_TOKENS, GEN_MAX_QPG, gen_sample_params, gen_uniform, kv_cache_store,     */
/*    decode_attention, sample_rows, gather_rows, GEN_GEMV_MAX_ROWS, GEN_GEMV_ENGINE_ROWS,       */
/*    gen_gemv_plan, gemv_rows,                                                                   */
/*    gemv_rows_supported, gen_gemv_rope, gemv_rope_supported, norm_rows.                         */
/* ============================================================================================== */

#define GEN_SPLIT_TOKENS 64 /* cached positions per split of the decode attention */
#define GEN_MAX_QPG 8       /* query heads per K/V group the decode attention takes */

/* pool element (block, layer, k/v, group, offset, e) */
__device__ __forceinline__ int64_t kv_cache_index(int64_t block, int layer, int kv, int g, int off, int e, int L,
                                                  int groups, int block_tokens, int d) {
    return ((((block * L + layer) * 2 + kv) * groups + g) * (int64_t)block_tokens + off) * d + e;
}

/* Programmatic dependent launch (sm_90) for the decode kernels (gen_launch with pdl): such a kernel may start
 * while the stream's previous kernel is still running (its blocks scheduled once every block of that kernel
 * has started and called gen_pdl_trigger), so it can issue what does not depend on that kernel (weights, the
 * cache of earlier steps) first; gen_pdl_wait() returns once the previous kernel has finished and its writes
 * are visible, and every block calls it before touching any output of an earlier kernel of the step (so the
 * chain stays ordered: a kernel finishes only after its own wait). Without the launch attribute both are
 * no-ops. Between two launches of a decode step this hides the launch latency (~1 us a kernel) and the
 * first round trip to memory. */
__device__ __forceinline__ void gen_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void gen_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
template <typename... KArgs, typename... Args>
static void gen_launch(const mt_exec* ex, bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t shared,
                       Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = shared, cfg.stream = ex->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr, cfg.numAttrs = pdl ? 1 : 0;
    CUDA_CHECK(ex->error, cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...));
}

/* The rows' k and v heads (from the QKV rows [N, qkv_width], k already rotated) into their cache positions.
 * One thread per element of the rows' k and v heads. */
template <typename T>
__global__ void kv_cache_store_kernel(T* pool, const T* qkv, const int32_t* slots, const int32_t* positions,
                                      const int32_t* tables, int table_stride, int N, int groups, int qpg, int d,
                                      int layer, int L, int block_tokens) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)N * groups * 2 * d) return;
    const int e = (int)(i % d), kv = (int)((i / d) % 2), g = (int)((i / (2 * d)) % groups);
    const int r = (int)(i / ((int64_t)2 * d * groups));
    const int p = positions[r];
    const int64_t block = tables[(int64_t)slots[r] * table_stride + p / block_tokens];
    const T x = qkv[(int64_t)r * groups * (qpg + 2) * d + ((int64_t)g * (qpg + 2) + qpg + kv) * d + e];
    pool[kv_cache_index(block, layer, kv, g, p % block_tokens, e, L, groups, block_tokens, d)] = x;
}

/* A row's sampling settings (section 23 fills them from mt_sampling). */
typedef struct {
    float temperature; /* 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 0 or >= 1: off */
    int target;        /* >= 0: no draw, the log-probability of this token (a prompt's next token) */
    uint64_t seed;
    int64_t index;     /* the token's number among the request's generated tokens (0: the first) */
} gen_sample_params;

/* The draw of token `index` of a request with this seed: uniform in [0, 1), 24 bits. */
__host__ __device__ __forceinline__ float gen_uniform(uint64_t seed, int64_t index) {
    const uint64_t x = splitmix64(seed ^ splitmix64(0x73616D706C652121ull ^ (uint64_t)index)); /* "sample!!" */
    return (float)(x >> 40) * (1.0f / 16777216.0f);
}

/* A float's bits made order-preserving as an unsigned integer (larger float, larger key). */
__device__ __forceinline__ uint32_t gen_order_key(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define GEN_SAMPLE_THREADS 1024

/* f(i, x[i]) for this thread's share of a row of V logits: 16-byte loads when vec (the row 16-byte aligned). */
template <typename F>
__device__ __forceinline__ void gen_row_each(const float* x, int V, bool vec, F f) {
    int i0 = 0;
    if (vec) {
        const int n4 = V / 4;
        for (int q = threadIdx.x; q < n4; q += blockDim.x) {
            const float4 v = reinterpret_cast<const float4*>(x)[q];
            f(4 * q, v.x), f(4 * q + 1, v.y), f(4 * q + 2, v.z), f(4 * q + 3, v.w);
        }
        i0 = 4 * n4;
    }
    for (int i = i0 + threadIdx.x; i < V; i += blockDim.x) f(i, x[i]);
}

/* The largest order key K whose set {i : key_i >= K} has weight(x_i) summed >= goal, over a row of V logits:
 * 16-ary search, 4 bits of K a pass (8 passes; the binary search's answer, as S(K) falls with K), each pass
 * the sums for the 15 candidates at once (every thread its fixed share in order, then fixed trees). */
template <typename W>
__device__ uint32_t gen_threshold(const float* x, int V, bool vec, float goal, W weight) {
    __shared__ float s_part[GEN_SAMPLE_THREADS / 32][16];
    __shared__ uint32_t s_prefix;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads(); /* s_prefix and s_part free (a previous call's readers are done) */
    if (threadIdx.x == 0) s_prefix = 0;
    for (int shift = 28; shift >= 0; shift -= 4) {
        __syncthreads();
        const uint32_t prefix = s_prefix;
        float acc[16];
#pragma unroll
        for (int t = 1; t < 16; t++) acc[t] = 0.0f;
        gen_row_each(x, V, vec, [&](int, float v) {
            const uint32_t key = gen_order_key(v);
            if (key < prefix) return;
            const uint32_t d = (key - prefix) >> shift; /* candidates prefix + t 2^shift at or below key: t <= d */
            const float w = weight(v, key);
#pragma unroll
            for (int t = 1; t < 16; t++) acc[t] += (uint32_t)t <= d ? w : 0.0f;
        });
#pragma unroll
        for (int t = 1; t < 16; t++) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) s_part[warp][t] = s;
        }
        __syncthreads();
        if (warp == 0) {
            float s = 0.0f; /* lane t: candidate t's sum, warps in order */
            if (lane >= 1 && lane < 16)
                for (int w = 0; w < (int)blockDim.x / 32; w++) s += s_part[w][lane];
            const unsigned ok = __ballot_sync(0xffffffffu, lane >= 1 && lane < 16 && s >= goal);
            if (lane == 0) s_prefix = prefix + ((uint32_t)(ok ? 31 - __clz(ok) : 0) << shift); /* the largest t */
        }
    }
    __syncthreads();
    return s_prefix;
}

/* One block per row of logits [n, ld] (fp32, the first V columns the real vocabulary) that has a
 * temperature (the others are sample_stats_kernel's, which also left every row's max, log-sum-exp and
 * argmax in row_stat [n] (max, lse, argmax's bits)): token[r] and logprob[r] (log p(token) under softmax
 * over the V real logits, untempered). */
__global__ void __launch_bounds__(GEN_SAMPLE_THREADS) sample_rows_kernel(int32_t* token_out, float* logprob_out,
                                                                         const float* logits, int64_t ld, int V,
                                                                         const gen_sample_params* params,
                                                                         const float4* row_stat) {
    __shared__ float s_warp[GEN_SAMPLE_THREADS / 32], s_total;
    __shared__ int s_pick, s_last;
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float* x = logits + (int64_t)r * ld;
    const gen_sample_params P = params[r];
    if (P.target >= 0 || !(P.temperature > 0.0f)) return; /* sample_stats_kernel's (the whole block leaves) */
    const bool vec = (ld % 4) == 0 && ((uintptr_t)logits & 15) == 0;
    const float4 st = row_stat[r];
    const float m = st.x, lse = st.y;
    const int argmax = __float_as_int(st.z);
    int chosen = argmax;
    {
        /* top-k: the largest key K with at least k logits at or above it (the k-th largest logit) */
        uint32_t kmin = 0;
        if (P.top_k > 0 && P.top_k < V)
            kmin = gen_threshold(x, V, vec, (float)P.top_k, [](float, uint32_t) { return 1.0f; });
        /* top-p over the tempered weights of the top-k set: the largest K whose set reaches top_p of its mass */
        if (P.top_p > 0.0f && P.top_p < 1.0f) {
            float w = 0.0f;
            gen_row_each(x, V, vec, [&](int, float v) {
                if (gen_order_key(v) >= kmin) w += expf((v - m) / P.temperature);
            });
            const float goal = P.top_p * block_sum(w);
            const float T = P.temperature;
            const uint32_t pmin = gen_threshold(x, V, vec, goal, [=](float v, uint32_t key) {
                return key >= kmin ? expf((v - m) / T) : 0.0f;
            });
            kmin = pmin > kmin ? pmin : kmin; /* >= kmin but where rounding made the whole set fall short */
        }
        /* the draw: contiguous ranges per thread, their sums scanned in a fixed order, the range holding u * total
         * walked */
        const int chunk = (V + blockDim.x - 1) / blockDim.x, b = tid * chunk, e = min(b + chunk, V);
        float mine = 0.0f;
        int last_kept = -1;
        for (int i = b; i < e; i++)
            if (gen_order_key(x[i]) >= kmin) mine += expf((x[i] - m) / P.temperature), last_kept = i;
        if (tid == 0) s_pick = INT_MAX, s_last = -1;
        /* the ranges' sums scanned: within each warp by shuffles, then the warps' totals serially; a range is
         * [before, after), the next one's before being this one's after, bit for bit */
        float incl = mine;
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        float excl = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) excl = 0.0f;
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        if (last_kept >= 0) atomicMax(&s_last, last_kept);
        if (tid == 0) {
            float run = 0.0f;
            for (int w = 0; w < (int)blockDim.x / 32; w++) {
                const float t = s_warp[w];
                s_warp[w] = run;
                run += t;
            }
            s_total = run;
        }
        __syncthreads();
        const float before = s_warp[warp] + excl, after = s_warp[warp] + incl;
        const float target = gen_uniform(P.seed, P.index) * s_total;
        if (mine > 0.0f && before <= target && target < after) { /* the range holding the target */
            float acc = before;
            int pick = last_kept;
            for (int i = b; i < e; i++) {
                if (gen_order_key(x[i]) < kmin) continue;
                acc += expf((x[i] - m) / P.temperature);
                if (acc > target) { pick = i; break; }
            }
            atomicMin(&s_pick, pick);
        }
        __syncthreads();
        chosen = s_pick != INT_MAX ? s_pick : s_last >= 0 ? s_last : argmax; /* u * total rounded up to total */
    }
    if (tid == 0) {
        token_out[r] = chosen;
        logprob_out[r] = chosen >= 0 && chosen < V ? x[chosen] - lse : -INFINITY;
    }
}

/* out [n, C] = rows index[0 .. n-1] of in [*, C]. */
template <typename T>
__global__ void gather_rows_kernel(T* out, const T* in, const int32_t* index, int n, int C) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * C) return;
    const int r = (int)(i / C), c = (int)(i % C);
    out[i] = in[(int64_t)index[r] * C + c];
}

/* Launchers. */
template <typename T>
static void gather_rows(const mt_exec* ex, T* out, const T* in, const int32_t* index, int n, int C) {
    if (n == 0) return;
    gather_rows_kernel<T><<<ceil_div((int64_t)n * C, 256), 256, 0, ex->stream>>>(out, in, index, n, C);
    LAUNCH_CHECK(ex->error);
}
template <typename T>
static void kv_cache_store(const mt_exec* ex, T* pool, const T* qkv, const int32_t* slots, const int32_t* positions,
                           const int32_t* tables, int table_stride, int N, int groups, int qpg, int d, int layer, int L,
                           int block_tokens) {
    const int64_t n = (int64_t)N * groups * 2 * d;
    if (n == 0) return;
    kv_cache_store_kernel<T><<<ceil_div(n, 256), 256, 0, ex->stream>>>(pool, qkv, slots, positions, tables, table_stride, N,
                                                                       groups, qpg, d, layer, L, block_tokens);
    LAUNCH_CHECK(ex->error);
}

/* decode_attention_tile_kernel: one block per (split, K/V group, row); the split's keys and values (at most GEN_SPLIT_TOKENS positions) go to shared memory with
 * 16-byte asynchronous copies issued all at once (one round trip for the whole tile, instead of one per
 * key and warp), then: every thread a key's scores for the group's query heads (K rows padded by one
 * vector so the lanes' 16-byte reads fall in distinct banks), a warp per head the split's max, weights and
 * sum (fixed order), every thread output elements (its head and column over the split's keys in order).
 * A row of one split writes its attention output directly; with more, each split stores its normalised
 * output and log-sum-exp, and the block that finishes last (a counter per (row, group), reset by that
 * block) merges the splits in split order by their log-sum-exp: no second launch,
 * the same sums whichever block merges. counters [rows, groups] start at 0. A row's own position is read
 * from its QKV row (the same values kv_cache_store copies), and with store_own the block holding it also
 * stores it into the cache: a step in which no row reads another row's keys (one row per request: a
 * decode step) needs no kv_cache_store. */
#define GEN_ATTN_THREADS 128
template <typename T>
__global__ void __launch_bounds__(GEN_ATTN_THREADS) decode_attention_tile_kernel(
    T* out, float* part_o, float* part_lse, int* counters, const T* qkv, T* pool, const int32_t* slots,
    const int32_t* positions, const int32_t* tables, int table_stride, int groups, int qpg, int d, int layer, int L,
    int block_tokens, int max_splits, float scale, int store_own) {
    constexpr int V = vec16<T>::N;
    const int split = blockIdx.x, g = blockIdx.y, r = blockIdx.z, tid = threadIdx.x;
    gen_pdl_trigger();
    /* positions, slots and tables come from the step's upload, before every kernel of the step */
    const int p = positions[r];
    const int splits = p / GEN_SPLIT_TOKENS + 1;
    if (split >= splits) { /* the whole block leaves: no barrier is skipped by part of it */
        gen_pdl_wait();
        return;
    }
    const int first = split * GEN_SPLIT_TOKENS, cnt = min(GEN_SPLIT_TOKENS, p + 1 - first);
    const bool vec = d % V == 0;
    const int dp = d + V; /* padded K row */
    extern __shared__ __align__(16) unsigned char gen_tile[];
    T* kt = reinterpret_cast<T*>(gen_tile);                     /* [GEN_SPLIT_TOKENS][dp] */
    T* vt = kt + GEN_SPLIT_TOKENS * dp;                          /* [GEN_SPLIT_TOKENS][d] */
    float* qs = reinterpret_cast<float*>(vt + GEN_SPLIT_TOKENS * d); /* [qpg][d] */
    float* ps = qs + qpg * d;                                   /* [qpg][GEN_SPLIT_TOKENS] */
    float* stat = ps + qpg * GEN_SPLIT_TOKENS;                  /* [qpg][2] max, sum */
    __shared__ int s_last;
    const int32_t* table = tables + (int64_t)slots[r] * table_stride;
    const T* qrow = qkv + (int64_t)r * groups * (qpg + 2) * d + (int64_t)g * (qpg + 2) * d; /* q heads, k, v */
    if (vec) {
        /* store_own (a decode step): the cache of earlier positions was written by earlier steps, so it is copied
         * before the wait, overlapping the previous kernel; the row's own k/v (its QKV row) after it */
        const int cv = d / V;
        for (int pass = store_own ? 0 : 1; pass < 2; pass++) {
            if (pass == 1) gen_pdl_wait();
            for (int i = tid; i < 2 * cnt * cv; i += GEN_ATTN_THREADS) {
                const int kv = i / (cnt * cv), j = (i / cv) % cnt, ch = i % cv, pos = first + j;
                if (store_own && (pos == p) != (pass == 1)) continue;
                const T* src = pos == p ? qrow + (qpg + kv) * d + ch * V /* the row's own k/v: its QKV row */
                                        : pool + kv_cache_index(table[pos / block_tokens], layer, kv, g,
                                                                pos % block_tokens, ch * V, L, groups, block_tokens, d);
                T* dst = kv ? vt + j * d + ch * V : kt + j * dp + ch * V;
                cp_async_16(smem_u32(dst), src, true);
            }
        }
        cp_async_commit();
    } else {
        gen_pdl_wait();
        for (int i = tid; i < 2 * cnt * d; i += GEN_ATTN_THREADS) {
            const int kv = i / (cnt * d), j = (i / d) % cnt, e = i % d, pos = first + j;
            const T x = pos == p ? qrow[(qpg + kv) * d + e]
                                 : pool[kv_cache_index(table[pos / block_tokens], layer, kv, g, pos % block_tokens, e, L,
                                                       groups, block_tokens, d)];
            (kv ? vt[j * d + e] : kt[j * dp + e]) = x;
        }
    }
    if (store_own && split == splits - 1) /* the row's own k/v into its cache position (kv_cache_store's job) */
        for (int i = tid; i < 2 * d; i += GEN_ATTN_THREADS)
            pool[kv_cache_index(table[p / block_tokens], layer, i / d, g, p % block_tokens, i % d, L, groups, block_tokens,
                                d)] = qrow[qpg * d + i];
    for (int i = tid; i < qpg * d; i += GEN_ATTN_THREADS) qs[i] = to_float(qrow[i]) * scale;
    if (vec) cp_async_wait<0>();
    __syncthreads();
    /* scores: thread j, key j, every head */
    for (int j = tid; j < cnt; j += GEN_ATTN_THREADS) {
        float s[GEN_MAX_QPG];
#pragma unroll
        for (int h = 0; h < GEN_MAX_QPG; h++) s[h] = 0.0f;
        const T* kr = kt + j * dp;
        for (int e0 = 0; e0 < d; e0 += V) {
            float k[V];
            if (vec) {
                const int4 raw = *reinterpret_cast<const int4*>(kr + e0);
                const T* ke = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int i = 0; i < V; i++) k[i] = to_float(ke[i]);
            } else {
#pragma unroll
                for (int i = 0; i < V; i++) k[i] = e0 + i < d ? to_float(kr[e0 + i]) : 0.0f;
            }
#pragma unroll
            for (int h = 0; h < GEN_MAX_QPG; h++) {
                if (h >= qpg) break;
#pragma unroll
                for (int i = 0; i < V; i++)
                    if (vec || e0 + i < d) s[h] = __fmaf_rn(qs[h * d + e0 + i], k[i], s[h]);
            }
        }
#pragma unroll
        for (int h = 0; h < GEN_MAX_QPG; h++)
            if (h < qpg) ps[h * GEN_SPLIT_TOKENS + j] = s[h];
    }
    __syncthreads();
    /* per head: the split's max, the weights exp(s - max) and their sum */
    const int lane = tid % 32, warp = tid / 32;
    for (int h = warp; h < qpg; h += GEN_ATTN_THREADS / 32) {
        float m = -INFINITY;
        for (int j = lane; j < cnt; j += 32) m = fmaxf(m, ps[h * GEN_SPLIT_TOKENS + j]);
        m = warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < cnt; j += 32) {
            const float w = expf(ps[h * GEN_SPLIT_TOKENS + j] - m);
            ps[h * GEN_SPLIT_TOKENS + j] = w;
            l += w;
        }
        l = warp_sum(l);
        if (lane == 0) stat[2 * h] = m, stat[2 * h + 1] = l;
    }
    __syncthreads();
    const int heads = groups * qpg;
    for (int i = tid; i < qpg * d; i += GEN_ATTN_THREADS) {
        const int h = i / d, e = i % d;
        float o = 0.0f;
        for (int j = 0; j < cnt; j++) o = __fmaf_rn(ps[h * GEN_SPLIT_TOKENS + j], to_float(vt[j * d + e]), o);
        o /= stat[2 * h + 1]; /* >= 1: the split's largest score has weight 1 */
        if (splits == 1) {
            out[((int64_t)r * heads + g * qpg + h) * d + e] = from_float<T>(o);
        } else {
            const int64_t at = ((int64_t)r * heads + g * qpg + h) * max_splits + split;
            part_o[at * d + e] = o;
            if (e == 0) part_lse[at] = stat[2 * h] + logf(stat[2 * h + 1]);
        }
    }
    if (splits == 1) return;
    /* the last block of this (row, group) merges */
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(&counters[r * groups + g], 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = tid; i < qpg * d; i += GEN_ATTN_THREADS) {
        const int h = i / d, e = i % d;
        const int64_t at = ((int64_t)r * heads + g * qpg + h) * max_splits;
        float M = -INFINITY;
        for (int s = 0; s < splits; s++) M = fmaxf(M, __ldcg(part_lse + at + s));
        float sum = 0.0f, o = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float w = expf(__ldcg(part_lse + at + s) - M);
            sum += w;
            o += w * __ldcg(part_o + (at + s) * d + e);
        }
        out[((int64_t)r * heads + g * qpg + h) * d + e] = from_float<T>(o / sum);
    }
    if (tid == 0) counters[r * groups + g] = 0;
}

/* Bytes of decode_attention_tile_kernel's dynamic shared memory. */
template <typename T>
static size_t decode_attention_tile_bytes(int qpg, int d) {
    return sizeof(T) * (size_t)GEN_SPLIT_TOKENS * (2 * d + vec16<T>::N) +
           sizeof(float) * (size_t)qpg * (d + GEN_SPLIT_TOKENS + 2);
}

/* sample_stats: the greedy and scored rows' sampling without sort or bisection. Grid (parts, rows): block
 * (part, r) takes GEN_STATS_SPAN consecutive logits of row r (16-byte loads, four per thread in flight),
 * its max, the lowest index of the max, and the sum of exp(x - its max); the block that finishes last
 * merges the parts in part order (a counter per row, reset by it): lse = M + log(sum_p s_p exp(m_p - M)),
 * and a greedy or scored row's token and log-probability; every row's (max, lse, argmax's bits) into
 * row_stat [rows]. Rows with a temperature are left to sample_rows_kernel, which leaves the others alone.
 * part [rows, parts] (max, sum), part_i [rows, parts]. */
#define GEN_STATS_THREADS 256
#define GEN_STATS_SPAN (GEN_STATS_THREADS * 16)
struct gen_stat {
    float m, s;
    int i;
};
__device__ __forceinline__ gen_stat gen_stat_merge(gen_stat a, gen_stat b) {
    gen_stat o;
    o.m = fmaxf(a.m, b.m);
    o.i = a.m > b.m ? a.i : b.m > a.m ? b.i : min(a.i, b.i);
    o.s = (a.m == -INFINITY ? 0.0f : a.s * expf(a.m - o.m)) + (b.m == -INFINITY ? 0.0f : b.s * expf(b.m - o.m));
    return o;
}
__global__ void __launch_bounds__(GEN_STATS_THREADS) sample_stats_kernel(int32_t* token_out, float* logprob_out,
                                                                         float4* row_stat, float2* part, int* part_i,
                                                                         int* counters,
                                                                         const float* logits, int64_t ld, int V,
                                                                         const gen_sample_params* params) {
    const int pi = blockIdx.x, parts = gridDim.x, r = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float* x = logits + (int64_t)r * ld;
    const bool vec = (ld % 4) == 0 && ((uintptr_t)logits & 15) == 0;
    float v[16];
    const int base = pi * GEN_STATS_SPAN;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = base + (k * GEN_STATS_THREADS + tid) * 4;
        if (vec && i + 3 < V) {
            const float4 f = __ldcs(reinterpret_cast<const float4*>(x + i));
            v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) v[4 * k + e] = i + e < V ? x[i + e] : -INFINITY;
        }
    }
    gen_stat st = {-INFINITY, 0.0f, INT_MAX};
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = base + (k * GEN_STATS_THREADS + tid) * 4 + e;
            if (i < V && v[4 * k + e] > st.m) st.m = v[4 * k + e], st.i = i;
        }
#pragma unroll
    for (int k = 0; k < 16; k++)
        if (st.m != -INFINITY) st.s += expf(v[k] - st.m); /* -inf (past V) adds 0 */
    for (int o = 16; o > 0; o >>= 1) {
        gen_stat b;
        b.m = __shfl_xor_sync(0xffffffffu, st.m, o), b.s = __shfl_xor_sync(0xffffffffu, st.s, o);
        b.i = __shfl_xor_sync(0xffffffffu, st.i, o);
        st = gen_stat_merge(st, b);
    }
    __shared__ gen_stat s_w[GEN_STATS_THREADS / 32];
    __shared__ int s_last;
    if (lane == 0) s_w[warp] = st;
    __syncthreads();
    if (tid == 0) {
        gen_stat a = s_w[0];
        for (int w = 1; w < GEN_STATS_THREADS / 32; w++) a = gen_stat_merge(a, s_w[w]);
        part[(int64_t)r * parts + pi] = make_float2(a.m, a.s);
        part_i[(int64_t)r * parts + pi] = a.i;
        __threadfence();
        s_last = atomicAdd(&counters[r], 1) == parts - 1;
    }
    __syncthreads();
    if (!s_last || tid != 0) return;
    __threadfence();
    gen_stat a = {-INFINITY, 0.0f, INT_MAX};
    for (int q = 0; q < parts; q++) {
        const float2 f = __ldcg(part + (int64_t)r * parts + q);
        gen_stat b = {f.x, f.y, __ldcg(part_i + (int64_t)r * parts + q)};
        a = gen_stat_merge(a, b);
    }
    counters[r] = 0;
    const float lse = a.m + logf(a.s);
    row_stat[r] = make_float4(a.m, lse, __int_as_float(a.i), 0.0f);
    const gen_sample_params P = params[r];
    if (P.target < 0 && P.temperature > 0.0f) return; /* sample_rows_kernel draws it */
    const int chosen = P.target >= 0 ? P.target : a.i;
    token_out[r] = chosen;
    logprob_out[r] = chosen >= 0 && chosen < V ? x[chosen] - lse : -INFINITY;
}

/* attn [N, groups qpg d] = each row's attention against its cached positions 0 .. positions[r] (layer's
 * part of the pool); part_o [N, heads, max_splits, d] and part_lse [N, heads, max_splits] scratch,
 * max_splits >= the rows' largest position / GEN_SPLIT_TOKENS + 1; counters [N, groups] zero (left zero).
 * store_own: each row's own k/v stored into the pool too (see the kernel); pdl: a programmatic dependent
 * launch (gen_launch). qpg <= GEN_MAX_QPG, d <= 256. */
template <typename T>
static void decode_attention(const mt_exec* ex, T* attn, float* part_o, float* part_lse, int* counters, const T* qkv,
                             T* pool, bool store_own, bool pdl, const int32_t* slots, const int32_t* positions, const int32_t* tables,
                             int table_stride, int N, int groups, int qpg, int d, int layer, int L, int block_tokens,
                             int max_splits) {
    if (N == 0) return;
    if (qpg > GEN_MAX_QPG || d > 256 || d < 1) {
        mt_gpu_fail(ex->error, MT_ERR_CONFIG, "decode attention: %d query heads per group (at most %d), head dim %d "
                    "(at most 256)", qpg, GEN_MAX_QPG, d);
        return;
    }
    const size_t shared = decode_attention_tile_bytes<T>(qpg, d);
    if (shared > 48 * 1024 &&
        !CUDA_CHECK(ex->error, cudaFuncSetAttribute(decode_attention_tile_kernel<T>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared)))
        return;
    gen_launch(ex, pdl, decode_attention_tile_kernel<T>, dim3(max_splits, groups, N), dim3(GEN_ATTN_THREADS), shared,
               attn, part_o, part_lse, counters, qkv, pool, slots, positions, tables, table_stride, groups, qpg, d, layer,
               L, block_tokens, max_splits, 1.0f / sqrtf((float)d), store_own ? 1 : 0);
}

/* Parts of sample_stats_kernel for a vocabulary of V. */
static int sample_stats_parts(int V) { return ceil_div(V, GEN_STATS_SPAN); }

/* token[n], logprob[n] from logits [n, ld] fp32 over the real vocabulary V (params [n] on the device):
 * sample_stats_kernel for every row (the greedy and scored rows done there), then sample_rows_kernel for
 * the rows with a temperature. row_stat [n] float4, part [n, parts] float2, part_i [n, parts] scratch,
 * counters [n] zero (left zero). */
static void sample_rows(const mt_exec* ex, int32_t* token, float* logprob, float4* row_stat, float2* part, int* part_i,
                        int* counters, const float* logits, int64_t ld, int V, const gen_sample_params* params, int n) {
    if (n == 0) return;
    sample_stats_kernel<<<dim3(sample_stats_parts(V), n), GEN_STATS_THREADS, 0, ex->stream>>>(
        token, logprob, row_stat, part, part_i, counters, logits, ld, V, params);
    LAUNCH_CHECK(ex->error);
    sample_rows_kernel<<<n, GEN_SAMPLE_THREADS, 0, ex->stream>>>(token, logprob, logits, ld, V, params, row_stat);
    LAUNCH_CHECK(ex->error);
}

/* ---- Decode kernels for few rows ------------------------------------------------------------------
 * A decode step of a few requests is a chain of matrix-vector products, row norms and attentions over
 * a short cache; the forward's kernels are made for thousands of rows and leave HBM idle there (one
 * warp per norm row walking it serially, one key at a time per warp in the attention, one block per row
 * of logits). These kernels keep many independent 16-byte loads in flight instead.
 *
 * gemv_rows: out [n, M] = x [n, K] W[M, K]^T for n <= GEN_GEMV_MAX_ROWS rows (the engine's linears up to
 * GEN_GEMV_ENGINE_ROWS rows; cuBLAS above that). The weights are read once a step and nothing else in it is: the kernel is a copy of W
 * into registers at the bandwidth of HBM, which needs some 32-64 KB in flight on every SM the whole
 * time. A warp takes GEN_GEMV_COLS output columns (weight rows) over one slice of K's 16-byte vectors:
 * each lane loads its vectors lane, lane + 32, ... of the slice, GEN_GEMV_UNROLL of them per weight row
 * at once (streaming loads, not kept in L1), all before its first product, so a slice of up to
 * 32 x GEN_GEMV_UNROLL vectors is one round trip to memory (8 KB a warp in flight). K is cut into 1, 2
 * or 4 slices (gen_gemv_plan, from the output width and K alone): as many as one round trip a warp
 * needs, and more while the launch has fewer than GEN_GEMV_TARGET_WARPS warps (a narrow output such as
 * a 1600-wide projection would leave SMs idle otherwise). The slices of a column pair are consecutive
 * warps of one block: each sums its products per lane in K order with explicit FMAs, then the warp's
 * butterfly; the block's first slice adds the others' sums in slice order (shared memory, no second
 * launch). Every output element is that same sum of the same products whatever n is and whichever rows
 * share the launch: bitwise repeatable, a request's results independent of the batch beside it. As a
 * programmatic dependent launch (gen_launch) the first round of weight loads goes out before the wait
 * for the previous kernel (the weights depend on nothing in the step): the previous kernel's tail hides
 * the first round trip. The epilogue is the engine's next elementwise step, rounded as the separate
 * kernels round: the GEMM's output to T, then + bias (to T), then GELU / squared ReLU (to T), or SwiGLU
 * (the warp computes the gate column j and the up column f + j of the [2f, K] weight: act = silu(gate)
 * * up), or RoPE of the QKV rows (GEMV_ROPE, gen_gemv_rope; rope_qkv_rows' arithmetic). Needs K and the x
 * row stride multiples of the 16-byte vector and 16-byte-aligned x and W (gemv_rows_supported); the engine
 * falls back to cuBLAS and the separate kernels otherwise. */
#define GEN_GEMV_MAX_ROWS 8 /* rows gemv_rows takes (gemv_rows_supported) */
/* Decode rows up to which the engine's linears run on gemv_rows, cuBLAS above (gen_linear, gen_forward). On an H200
 * (dev/bench/results/cp_hopper_steps_h200.md, MT_GEN_GEMV=0 against the default in one call) gemv_rows gave
 * more tokens/s than cuBLAS at 1 row (Llama-3.2-1B 908 against 820, GPT-2 1.5B 458 against 394) and as many or
 * more at 2 (1642 / 1637, 838 / 784), but far fewer at 4 (2474 / 3213) and 8 (2711 / 6308): each row's
 * products cost it as much as the weights' one read, where cuBLAS's tensor cores keep the step at ~1.25 ms. */
#define GEN_GEMV_ENGINE_ROWS 2
#define GEN_GEMV_WARPS 4    /* warps a block: the K slices of a column pair, or column pairs (slices = 1, 2, 4) */
#define GEN_GEMV_COLS 2     /* output columns per warp (sharing the x loads) */
#define GEN_GEMV_UNROLL 8   /* 16-byte weight vectors per lane and column in flight (SwiGLU: half, for two rows) */
#define GEN_GEMV_TARGET_WARPS 2048 /* warps a launch aims at: some 16 per SM of a 132-SM GPU (a constant, so */
                                   /* that the sums' order never depends on the device) */
enum { GEMV_PLAIN = 0, GEMV_GELU = 1, GEMV_SQUARED_RELU = 2, GEMV_SWIGLU = 3, GEMV_ROPE = 4 };

/* GEMV_ROPE: the QKV linear with RoPE fused (the rows' q and k heads rotated at their positions, as
 * rope_qkv_rows does after it otherwise; no kernel of its own in a decode step). The output is the fused
 * QKV row [groups (qpg + 2) d]; a warp's column pair is then the two columns a rotation mixes, (e, e + rot/2)
 * of a q or k head for e < rot/2, else two neighbours (the head's unrotated channels, the v head), so both
 * values of a rotation are in one warp's sums. cos, sin [positions, rot/2], positions [n] of the rows. */
typedef struct {
    const float* cos;
    const float* sin;
    const int32_t* positions;
    int d, rot, qpg;
} gen_gemv_rope;

/* The two output columns of column pair p under GEMV_ROPE (see there); the pair's rotation channel in *e
 * (-1: not rotated). A bijection of the pairs onto the columns (d and rot even). */
__host__ __device__ static inline void gen_gemv_rope_pair(const gen_gemv_rope& rp, int p, int* ja, int* jb, int* e) {
    const int per = rp.d / 2, head = p / per, t = p % per, half = rp.rot / 2, base = head * rp.d;
    const bool rotated_head = head % (rp.qpg + 2) <= rp.qpg; /* q heads and the k head; the v head is not */
    if (rotated_head && t < half) {
        *ja = base + t, *jb = base + t + half, *e = t;
    } else {
        const int c = rotated_head ? rp.rot + 2 * (t - half) : 2 * t;
        *ja = base + c, *jb = base + c + 1, *e = -1;
    }
}

/* A launch's cut of K: slices of `span` vectors (a multiple of 8: whole 128-byte lines), slice s of column
 * pair p being warp s of the pair's GEN_GEMV_WARPS / slices in block p / (GEN_GEMV_WARPS / slices);
 * `passes` rounds of loads a warp (1 unless K exceeds 4 slices of 32 GEN_GEMV_UNROLL / R vectors). */
typedef struct {
    int slices, span, passes, blocks;
} gen_gemv_split;

/* The cut for `cols` output columns over K = Kv vectors, R weight rows per column (2 for SwiGLU): a function
 * of these alone, never of the row count (the sums' order must not depend on the batch). */
__host__ __device__ static inline gen_gemv_split gen_gemv_plan(int cols, int Kv, int R) {
    const int pass = 32 * (GEN_GEMV_UNROLL / R), pairs = (cols + GEN_GEMV_COLS - 1) / GEN_GEMV_COLS;
    int s = 1;
    while (s < GEN_GEMV_WARPS && (Kv + s - 1) / s > pass) s *= 2; /* one round trip a warp where 4 slices give it */
    while (s < GEN_GEMV_WARPS && (int64_t)pairs * s < GEN_GEMV_TARGET_WARPS && Kv / (2 * s) >= 64) s *= 2;
    gen_gemv_split p;
    p.slices = s;
    p.span = ((Kv + s - 1) / s + 7) / 8 * 8;
    p.passes = (p.span + pass - 1) / pass;
    p.blocks = (pairs + GEN_GEMV_WARPS / s - 1) / (GEN_GEMV_WARPS / s);
    return p;
}

/* Warp `warp` of block `block` under cut p: its first column j0 and its slice's vectors [kb, ke) (empty past
 * Kv); the kernel and the host test of the cut (every weight vector read by exactly one warp) share it. */
__host__ __device__ static inline void gen_gemv_warp(const gen_gemv_split& p, int block, int warp, int Kv, int* j0,
                                                     int* kb, int* ke) {
    const int slice = warp % p.slices;
    *j0 = (block * (GEN_GEMV_WARPS / p.slices) + warp / p.slices) * GEN_GEMV_COLS;
    *kb = slice * p.span < Kv ? slice * p.span : Kv;
    *ke = *kb + p.span < Kv ? *kb + p.span : Kv;
}

/* A 16-byte weight vector, streamed: the read-only path, not allocated in L1 (read once), 256-byte L2 fetches. */
__device__ __forceinline__ int4 gen_load_stream(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <typename T, int NR, int EPI>
__global__ void __launch_bounds__(32 * GEN_GEMV_WARPS) gemv_rows_kernel(T* out, int ldo, const T* x, int ldx,
                                                                        const T* W, const T* bias, int n, int cols,
                                                                        int K, gen_gemv_split p, gen_gemv_rope rp) {
    constexpr int V = vec16<T>::N;
    constexpr int C = GEN_GEMV_COLS;
    constexpr int R = EPI == GEMV_SWIGLU ? 2 : 1;
    constexpr int U = GEN_GEMV_UNROLL / R; /* the same bytes in flight, SwiGLU's two rows in the registers of one */
    __shared__ float s_part[GEN_GEMV_WARPS][R][C][NR];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, Kv = K / V;
    int j0, kb, ke;
    gen_gemv_warp(p, blockIdx.x, warp, Kv, &j0, &kb, &ke);
    gen_pdl_trigger();
    static_assert(EPI != GEMV_ROPE || C == 2, "a rotation's two columns in one warp");
    int jc[C], rot_e = -1; /* the warp's output columns; GEMV_ROPE: the pair's rotation channel */
#pragma unroll
    for (int c = 0; c < C; c++) jc[c] = j0 + c;
    if (EPI == GEMV_ROPE && j0 < cols) gen_gemv_rope_pair(rp, j0 / 2, &jc[0], &jc[C - 1], &rot_e);
    const int4* wr[R][C];
    bool has[C];
#pragma unroll
    for (int c = 0; c < C; c++) {
        has[c] = j0 + c < cols;
        const int64_t j = has[c] ? jc[c] : 0; /* a missing column loads nothing (its loads predicated off) */
        wr[0][c] = reinterpret_cast<const int4*>(W) + j * Kv;
        if (R == 2) wr[R - 1][c] = reinterpret_cast<const int4*>(W) + (j + cols) * Kv; /* SwiGLU: the up row f + j */
    }
    int4 w[R][C][U];
    auto load_round = [&](int base) { /* the round's vectors base + 32 u + lane of every row, all at once */
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = base + u * 32 + lane;
#pragma unroll
            for (int c = 0; c < C; c++)
#pragma unroll
                for (int q = 0; q < R; q++)
                    w[q][c][u] = has[c] && k < ke ? gen_load_stream(wr[q][c] + k) : make_int4(0, 0, 0, 0);
        }
    };
    load_round(kb); /* before the wait: the weights depend on nothing earlier in the step */
    gen_pdl_wait();
    float acc[R][C][NR];
#pragma unroll
    for (int q = 0; q < R; q++)
#pragma unroll
        for (int c = 0; c < C; c++)
#pragma unroll
            for (int r = 0; r < NR; r++) acc[q][c][r] = 0.0f;
    const int4* xr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) /* rows past n: row n - 1 again, discarded */
        xr[r] = reinterpret_cast<const int4*>(x + (int64_t)(r < n ? r : n - 1) * ldx);
    for (int base = kb; base < ke; base += 32 * U) {
        if (base != kb) load_round(base);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = base + u * 32 + lane;
            if (k >= ke) break;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const int4 raw = __ldg(xr[r] + k);
                const T* xe = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int q = 0; q < R; q++)
#pragma unroll
                    for (int c = 0; c < C; c++) {
                        const T* we = reinterpret_cast<const T*>(&w[q][c][u]);
#pragma unroll
                        for (int i = 0; i < V; i++) acc[q][c][r] = __fmaf_rn(to_float(we[i]), to_float(xe[i]), acc[q][c][r]);
                    }
            }
        }
    }
#pragma unroll
    for (int q = 0; q < R; q++)
#pragma unroll
        for (int c = 0; c < C; c++)
#pragma unroll
            for (int r = 0; r < NR; r++) acc[q][c][r] = warp_sum(acc[q][c][r]);
    if (p.slices > 1) { /* the pair's slices: the first adds the others' sums in slice order */
        if (lane == 0)
#pragma unroll
            for (int q = 0; q < R; q++)
#pragma unroll
                for (int c = 0; c < C; c++)
#pragma unroll
                    for (int r = 0; r < NR; r++) s_part[warp][q][c][r] = acc[q][c][r];
        __syncthreads();
        if (warp % p.slices != 0) return; /* after the block's only barrier */
#pragma unroll
        for (int q = 0; q < R; q++)
#pragma unroll
            for (int c = 0; c < C; c++)
#pragma unroll
                for (int r = 0; r < NR; r++)
                    for (int s = 1; s < p.slices; s++) acc[q][c][r] += s_part[warp + s][q][c][r];
    }
    /* lane (c, r) stores element (r, jc[c]) */
#pragma unroll
    for (int c = 0; c < C; c++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (lane != c * NR + r || r >= n || !has[c]) continue;
            const int j = jc[c];
            float y = to_float(from_float<T>(acc[0][c][r])); /* the GEMM's output in T */
            if (bias) y = to_float(from_float<T>(y + to_float(bias[j])));
            if (EPI == GEMV_ROPE && rot_e >= 0) { /* rope_qkv_rows_kernel's rotation of (x[e], x[e + half]), in T */
                const int o = C - 1 - c, jo = jc[o];
                float y2 = to_float(from_float<T>(acc[0][o][r]));
                if (bias) y2 = to_float(from_float<T>(y2 + to_float(bias[jo])));
                const float a = c == 0 ? y : y2, b = c == 0 ? y2 : y;
                const int64_t at = (int64_t)rp.positions[r] * (rp.rot / 2) + rot_e;
                const float cs = rp.cos[at], sn = rp.sin[at];
                y = c == 0 ? a * cs - b * sn : b * cs + a * sn;
            }
            if (EPI == GEMV_GELU) y = activation<ACT_GELU>(y);
            if (EPI == GEMV_SQUARED_RELU) y = activation<ACT_SQUARED_RELU>(y);
            if (EPI == GEMV_SWIGLU) {
                float up = to_float(from_float<T>(acc[R - 1][c][r]));
                if (bias) up = to_float(from_float<T>(up + to_float(bias[cols + j])));
                y = silu(y) * up;
            }
            out[(int64_t)r * ldo + j] = from_float<T>(y);
        }
}

/* gemv_rows can take these operands (16-byte vectors along K, aligned rows, few rows). */
template <typename T>
static bool gemv_rows_supported(int n, int K, const T* x, int ldx, const T* W) {
    constexpr int V = vec16<T>::N;
    static_assert(GEN_GEMV_COLS * GEN_GEMV_MAX_ROWS <= 32, "one lane per stored element of a warp");
    return n >= 1 && n <= GEN_GEMV_MAX_ROWS && K >= V && K % V == 0 && ldx % V == 0 && aligned16(x) && aligned16(W);
}

/* GEMV_ROPE takes this QKV geometry: whole heads of d channels (d, rot even, rot <= d), qpg + 2 heads a group. */
static bool gemv_rope_supported(int d, int rot, int qpg, int cols) {
    return d >= 2 && d % 2 == 0 && rot >= 2 && rot % 2 == 0 && rot <= d && qpg >= 1 && cols % (d * (qpg + 2)) == 0;
}

/* out [n, ldo] (columns 0 .. cols-1) = epilogue(x [n, ldx] W^T + bias): W [cols, K] (SwiGLU: [2 cols, K],
 * the gate rows then the up rows, bias [2 cols]); bias may be NULL. Needs gemv_rows_supported (and for
 * GEMV_ROPE, rope with gemv_rope_supported). pdl: a programmatic dependent launch (gen_launch). */
template <typename T>
static void gemv_rows(const mt_exec* ex, int epi, T* out, int ldo, const T* x, int ldx, const T* W, const T* bias, int n,
                      int cols, int K, bool pdl = false, const gen_gemv_rope* rope = NULL) {
    if (n == 0) return;
    if (!gemv_rows_supported<T>(n, K, x, ldx, W)) {
        mt_gpu_fail(ex->error, MT_ERR_CONFIG, "gemv_rows: %d rows of K %d (ldx %d) it does not take", n, K, ldx);
        return;
    }
    gen_gemv_rope rp;
    memset(&rp, 0, sizeof(rp));
    if (epi == GEMV_ROPE) {
        if (!rope || !gemv_rope_supported(rope->d, rope->rot, rope->qpg, cols)) {
            mt_gpu_fail(ex->error, MT_ERR_CONFIG, "gemv_rows: RoPE over %d columns it does not take", cols);
            return;
        }
        rp = *rope;
    }
    const gen_gemv_split p = gen_gemv_plan(cols, K / vec16<T>::N, epi == GEMV_SWIGLU ? 2 : 1);
    const dim3 grid(p.blocks), block(32 * GEN_GEMV_WARPS);
#define GEN_GEMV_LAUNCH(NR, E) \
    gen_launch(ex, pdl, gemv_rows_kernel<T, NR, E>, grid, block, 0, out, ldo, x, ldx, W, bias, n, cols, K, p, rp)
#define GEN_GEMV_EPI(NR)                                                  \
    switch (epi) {                                                        \
        case GEMV_GELU: GEN_GEMV_LAUNCH(NR, GEMV_GELU); break;            \
        case GEMV_SQUARED_RELU: GEN_GEMV_LAUNCH(NR, GEMV_SQUARED_RELU); break; \
        case GEMV_SWIGLU: GEN_GEMV_LAUNCH(NR, GEMV_SWIGLU); break;        \
        case GEMV_ROPE: GEN_GEMV_LAUNCH(NR, GEMV_ROPE); break;            \
        default: GEN_GEMV_LAUNCH(NR, GEMV_PLAIN); break;                  \
    }
    if (n == 1) GEN_GEMV_EPI(1)
    else if (n == 2) GEN_GEMV_EPI(2)
    else if (n <= 4) GEN_GEMV_EPI(4)
    else GEN_GEMV_EPI(8)
#undef GEN_GEMV_EPI
#undef GEN_GEMV_LAUNCH
    LAUNCH_CHECK(ex->error);
}

/* norm_rows: sum = residual + branch + bias (rounded to T; stored when sum_out), out = norm(sum), one block
 * of GEN_NORM_THREADS threads per row: every thread loads its (at most GEN_NORM_MAXV) 16-byte vectors of
 * the row, its weights and biases at once, then two block reductions (fixed trees) for the mean and the
 * variance. residual NULL: out = norm(branch) (the first norm). The forward's warp-per-row kernel takes a
 * row's vectors one after another (some 14 round trips to memory for a row of 1600: ~11 us); here it is
 * one. Rounding as residual_norm_forward's (the sum rounded to T before its statistics, norm_output). The
 * statistics are not stored. Needs C % V == 0, C <= GEN_NORM_THREADS GEN_NORM_MAXV V, aligned rows
 * (norm_rows_supported); residual_norm_forward otherwise. */
#define GEN_NORM_THREADS 256
#define GEN_NORM_MAXV 4
template <typename T>
__global__ void __launch_bounds__(GEN_NORM_THREADS) norm_rows_kernel(T* sum_out, T* out, const T* residual,
                                                                     const T* branch, const T* bias, const T* weight,
                                                                     const T* norm_bias, int C, float eps, bool rms,
                                                                     float w1) {
    constexpr int V = vec16<T>::N;
    const int64_t base = (int64_t)blockIdx.x * C;
    const int nv = C / V;
    float r[GEN_NORM_MAXV][V], y[GEN_NORM_MAXV][V], w[GEN_NORM_MAXV][V], b[GEN_NORM_MAXV][V], nb[GEN_NORM_MAXV][V];
    gen_pdl_trigger();
#pragma unroll
    for (int j = 0; j < GEN_NORM_MAXV; j++) { /* the parameters: no kernel of the step writes them */
        const int v = threadIdx.x + GEN_NORM_THREADS * j;
        if (v >= nv) continue;
        const int c = v * V;
        if (bias) load16(b[j], bias + c);
        load16(w[j], weight + c);
        if (norm_bias) load16(nb[j], norm_bias + c);
    }
    gen_pdl_wait();
#pragma unroll
    for (int j = 0; j < GEN_NORM_MAXV; j++) {
        const int v = threadIdx.x + GEN_NORM_THREADS * j;
        if (v >= nv) continue;
        const int c = v * V;
        load16(y[j], branch + base + c);
        if (residual) load16(r[j], residual + base + c);
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < GEN_NORM_MAXV; j++) {
        const int v = threadIdx.x + GEN_NORM_THREADS * j;
        if (v >= nv) continue;
#pragma unroll
        for (int i = 0; i < V; i++) {
            r[j][i] = residual ? to_float(from_float<T>(r[j][i] + y[j][i] + (bias ? b[j][i] : 0.0f))) : y[j][i];
            sum += r[j][i];
        }
        if (sum_out) store16(sum_out + base + v * V, r[j]);
    }
    const float mean = rms ? 0.0f : block_sum(sum) / C;
    float var = 0.0f;
#pragma unroll
    for (int j = 0; j < GEN_NORM_MAXV; j++) {
        if ((int)threadIdx.x + GEN_NORM_THREADS * j >= nv) continue;
#pragma unroll
        for (int i = 0; i < V; i++) var += (r[j][i] - mean) * (r[j][i] - mean);
    }
    const float rstd = 1.0f / sqrtf(block_sum(var) / C + eps);
#pragma unroll
    for (int j = 0; j < GEN_NORM_MAXV; j++) {
        const int v = threadIdx.x + GEN_NORM_THREADS * j;
        if (v >= nv) continue;
#pragma unroll
        for (int i = 0; i < V; i++) y[j][i] = norm_output(r[j][i], mean, rstd, w[j][i], w1, norm_bias ? nb[j][i] : 0.0f);
        store16(out + base + v * V, y[j]);
    }
}

template <typename T>
static bool norm_rows_supported(int C, const void* a, const void* b, const void* c, const void* d, const void* e,
                                const void* f, const void* g) {
    constexpr int V = vec16<T>::N;
    return C % V == 0 && C <= GEN_NORM_THREADS * GEN_NORM_MAXV * V && aligned16(a) && aligned16(b) && aligned16(c) &&
           aligned16(d) && aligned16(e) && aligned16(f) && aligned16(g);
}

/* sum [N, C] = residual + branch + bias, out = norm(sum) (residual NULL: out = norm(branch), sum not
 * written); norm_rows_kernel where it can (pdl: a programmatic dependent launch, gen_launch), else the
 * forward's kernels (mean, rstd [N] scratch). */
template <typename T>
static void norm_rows(const mt_exec* ex, T* sum, T* out, float* mean, float* rstd, const T* residual, T* branch,
                      const T* bias, const T* w, const T* b, int N, int C, float eps, bool rms, float w1, bool pdl) {
    if (N == 0) return;
    if (norm_rows_supported<T>(C, sum, out, residual, branch, bias, w, b)) {
        gen_launch(ex, pdl, norm_rows_kernel<T>, dim3(N), dim3(GEN_NORM_THREADS), 0, residual ? sum : (T*)NULL, out,
                   residual, (const T*)branch, bias, w, b, C, eps, rms, w1);
    } else if (residual) {
        residual_norm_forward<T>(ex, sum, out, mean, rstd, residual, branch, bias, w, b, N, C, eps, rms, w1);
    } else {
        norm_forward<T>(ex, out, mean, rstd, branch, w, b, N, C, eps, rms, w1);
    }
}

/* ############################################################################################## */
/* PART II: THE MODEL AND THE TRAINER (sections 15-21)                                            */
/*    Process groups, parallel layers, the model, the micro-batch loop, the optimizer,            */
/*    checkpoints and the trainer API, on mt_trainer and mt_config. All device work through Part  */
/*    I's launchers (trainer_exec(t) makes their mt_exec): no kernel is defined or launched       */
/*    here.                                                                                       */
/* ############################################################################################## */

/* ============================================================================================== */
/* 15. Process groups                                                                             */
/*    Megatron's rank layout (megatron.h: tp-cp-ep-dp-pp) gives each rank its coordinates. One    */
/*    NCCL communicator spans the job; it is split into the tensor-parallel group (the TP ranks   */
/*    of one model replica, contiguous ranks), the data-parallel group (the ranks that hold the   */
/*    same shard, stride TP), the pipeline group (one rank per stage, stride TP x DP) and the     */
/*    embedding group (its first and last stage). Each group's collectives run on a stream of     */
/*    their own (pipeline transfers on the compute stream: the schedule orders them): TP          */
/*    collectives sit on the model's critical path, DP reductions overlap the backward.           */
/*    mt_process_groups is the one place a rank's parallel sizes and coordinates live once the    */
/*    trainer exists.                                                                             */
/*    defines: mt_process_groups, mt_tp_group with tp_all_reduce / tp_reduce_scatter /            */
/*    tp_all_gather / tp_broadcast, process_groups_create / process_groups_free,                  */
/*    mt_comm_id_create, mt_watchdog.                                                             */
/* ============================================================================================== */

/* The tensor-parallel group as the model uses it: collectives of activations in the model type, on
 * the TP stream after the compute stream's work so far; the compute stream waits for them with
 * tp_join (everything issued) or tp_join_mark (up to the last tp_mark). */
typedef struct {
    int size, rank;           /* the one copy of this rank's TP size and rank (from --tensor-model-parallel-size
                                 and the rank layout) */
    int sp;                   /* sequence parallelism (--sequence-parallel with size > 1) */
    ncclComm_t comm;          /* NULL when size == 1 */
    ncclDataType_t type;      /* the model type: activations travel in it */
    cudaStream_t compute, stream;
    cudaEvent_t issued, marked, done;
    int world_rank;
    mt_gpu_error* error;
} mt_tp_group;

static void tp_after_compute(mt_tp_group* tp) {
    CUDA_CHECK(tp->error, cudaEventRecord(tp->issued, tp->compute));
    CUDA_CHECK(tp->error, cudaStreamWaitEvent(tp->stream, tp->issued, 0));
}
/* x [n] summed over the group in place; `type` is the model type (tp->type) for activations */
static void tp_all_reduce(mt_tp_group* tp, void* x, size_t n, ncclDataType_t type) {
    tp_after_compute(tp);
    NCCL_CHECK(tp->error, tp->world_rank, ncclAllReduce(x, x, n, type, ncclSum, tp->comm, tp->stream));
}
/* shard [n_shard] = this rank's part of the sum of full [size * n_shard] over the group */
static void tp_reduce_scatter(mt_tp_group* tp, void* shard, const void* full, size_t n_shard, ncclDataType_t type) {
    tp_after_compute(tp);
    NCCL_CHECK(tp->error, tp->world_rank, ncclReduceScatter(full, shard, n_shard, type, ncclSum, tp->comm, tp->stream));
}
/* full [size * n_shard] = every rank's shard [n_shard], in rank order (in place when shard is
 * full + rank * n_shard) */
static void tp_all_gather(mt_tp_group* tp, void* full, const void* shard, size_t n_shard, ncclDataType_t type) {
    tp_after_compute(tp);
    NCCL_CHECK(tp->error, tp->world_rank, ncclAllGather(shard, full, n_shard, type, tp->comm, tp->stream));
}
/* dst [n] = root's src [n] on every rank of the group */
static void tp_broadcast(mt_tp_group* tp, void* dst, const void* src, size_t n, ncclDataType_t type, int root) {
    tp_after_compute(tp);
    NCCL_CHECK(tp->error, tp->world_rank, ncclBroadcast(src, dst, n, type, root, tp->comm, tp->stream));
}
static void tp_mark(mt_tp_group* tp) { CUDA_CHECK(tp->error, cudaEventRecord(tp->marked, tp->stream)); }
static void tp_join_mark(mt_tp_group* tp) { CUDA_CHECK(tp->error, cudaStreamWaitEvent(tp->compute, tp->marked, 0)); }
static void tp_join(mt_tp_group* tp) {
    CUDA_CHECK(tp->error, cudaEventRecord(tp->done, tp->stream));
    CUDA_CHECK(tp->error, cudaStreamWaitEvent(tp->compute, tp->done, 0));
}

/* This rank's groups: the one place its parallel sizes and coordinates live once the trainer exists
 * (mt_config holds the flags they come from). */
typedef struct {
    mt_tp_group tp;             /* the tensor-parallel group, on a stream of its own */
    int pp_size, pp_rank;
    int dp_size, dp_rank;       /* the gradient-reduction group: DP x CP ranks (Megatron's data-parallel group
                                   with context parallelism), rank dpcp = cp + CP dp; DP without CP */
    int data_size, data_rank;   /* the data-parallel size and rank alone: which micro-batches a rank reads */
    int cp_size, cp_rank;       /* context parallelism: 1, 0 without */
    ncclComm_t world;           /* every rank; NULL in a one-process job */
    ncclComm_t dp;              /* the gradient-reduction group (DP x CP); NULL when dp_size == 1 */
    ncclComm_t cp;              /* the context-parallel group (stride TP): attention's K/V exchange, on the compute
                                   stream; NULL when cp_size == 1 */
    mt_cp_ring cp_ring;         /* --cp-comm-type p2p: the ring over cp (section 9.5; its own transfer stream) */
    ncclComm_t pp;              /* the pipeline group (one rank per stage, rank = stage): activations */
    ncclComm_t pp_grad;         /* the same ranks again for the gradients, so that each kind is matched in its
                                   own posting order (NULL when pp_size == 1) */
    cudaStream_t pp_streams[2]; /* the activations' and the gradients' transfers: each communicator on a
                                   stream of its own, so that one waiting does not hold the other back */
    cudaEvent_t pp_ready, pp_done[2];
    ncclComm_t embedding;       /* Megatron's embedding group: the first and last stage (PP > 1, else NULL);
                                   they hold the tied word embeddings and add their gradients */
    cudaStream_t comm_stream;   /* DP collectives (and the world's) */
    /* expert parallelism (MoE with EP > 1): the DP ranks folded into EP x EDP (megatron.h mt_rank_coords) */
    int ep_size, ep_rank;       /* 1, 0 without expert parallelism */
    int edp_size, edp_rank;     /* expert-data-parallel: dp_size / ep_size ranks hold the same experts */
    ncclComm_t ep;              /* the expert-parallel group: the tokens' all-to-all (on the compute stream);
                                   NULL when ep_size == 1 */
    ncclComm_t edp;             /* the expert-data-parallel group: the experts' gradient reduction and parameter
                                   gather (on the DP stream); NULL when edp_size == 1 */
} mt_process_groups;

mt_status mt_comm_id_create(mt_comm_id* id, mt_error* err) {
    static_assert(sizeof(mt_comm_id) == sizeof(ncclUniqueId), "mt_comm_id must hold an ncclUniqueId");
    ncclUniqueId unique;
    ncclResult_t r = ncclGetUniqueId(&unique);
    if (r != ncclSuccess) return mt_fail(err, MT_ERR_NCCL, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
    memcpy(id->internal, &unique, sizeof(unique));
    return MT_OK;
}

/* NCCL connects two ranks for point-to-point on their first send/receive, a handshake in which both
 * hosts take part. The pipeline's first exchanges are one-sided (a stage receives from a neighbour
 * that has nothing to receive from it yet), so a rank could sit in that handshake for a connection
 * its neighbour will only use later while the neighbour waits on the stream: connect every
 * neighbour pair on both pipeline communicators once, symmetrically, at creation. */
static void pipeline_connect(mt_process_groups* g, const mt_config* c, cudaStream_t stream, mt_gpu_error* e) {
    /* messages of the real size [R, h] (NCCL may set up channels by size) */
    const int tp = c->tensor_model_parallel_size, sp = c->sequence_parallel && tp > 1;
    const int cp = c->context_parallel_size > 1 ? c->context_parallel_size : 1; /* a rank's rows: S / CP a sample */
    const size_t n = (size_t)c->micro_batch_size * (c->seq_length / cp) / (sp ? tp : 1) * c->hidden_size;
    void* buf = NULL;
    if (!CUDA_CHECK(e, cudaMalloc(&buf, 3 * n * 4))) return;
    float* f = (float*)buf;
    const int prev = (g->pp_rank + g->pp_size - 1) % g->pp_size, next = (g->pp_rank + 1) % g->pp_size;
    ncclComm_t comms[2] = {g->pp, g->pp_grad};
    for (int i = 0; i < 2; i++) {
        NCCL_CHECK(e, c->rank, ncclGroupStart());
        NCCL_CHECK(e, c->rank, ncclSend(f, n, g->tp.type, next, comms[i], stream));
        NCCL_CHECK(e, c->rank, ncclSend(f, n, g->tp.type, prev, comms[i], stream));
        NCCL_CHECK(e, c->rank, ncclRecv(f + n, n, g->tp.type, prev, comms[i], stream));
        NCCL_CHECK(e, c->rank, ncclRecv(f + 2 * n, n, g->tp.type, next, comms[i], stream));
        NCCL_CHECK(e, c->rank, ncclGroupEnd());
    }
    CUDA_CHECK(e, cudaStreamSynchronize(stream));
    cudaFree(buf);
}

/* Joins the job's communicators (blocks until every rank has joined). `compute` is the stream the
 * model runs on (TP collectives start after its work and hand back to it). */
static void process_groups_create(mt_process_groups* g, const mt_config* c, cudaStream_t compute, mt_gpu_error* e) {
    mt_rank_coords me = mt_rank_coordinates(c, c->rank);
    mt_tp_group* tp = &g->tp;
    tp->size = c->tensor_model_parallel_size;
    tp->rank = me.tp;
    tp->sp = c->sequence_parallel && tp->size > 1;
    tp->type = c->precision == MT_FP32 ? ncclFloat : c->precision == MT_BF16 ? ncclBfloat16 : ncclHalf;
    tp->compute = compute;
    tp->world_rank = c->rank;
    tp->error = e;
    g->pp_size = c->pipeline_model_parallel_size;
    g->cp_size = c->context_parallel_size > 1 ? c->context_parallel_size : 1;
    g->cp_rank = me.cp;
    g->data_size = c->data_parallel_size;
    g->data_rank = me.dp;
    g->dp_size = mt_grad_dp_size(c);
    g->pp_rank = me.pp;
    g->dp_rank = me.dpcp;
    g->ep_size = c->num_experts > 0 && c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 1;
    g->ep_rank = me.ep;
    g->edp_size = g->dp_size / g->ep_size;
    g->edp_rank = me.edp;
    if (!CUDA_CHECK(e, cudaStreamCreateWithFlags(&g->comm_stream, cudaStreamNonBlocking)) ||
        !CUDA_CHECK(e, cudaStreamCreateWithFlags(&tp->stream, cudaStreamNonBlocking)) ||
        !CUDA_CHECK(e, cudaEventCreateWithFlags(&tp->issued, cudaEventDisableTiming)) ||
        !CUDA_CHECK(e, cudaEventCreateWithFlags(&tp->marked, cudaEventDisableTiming)) ||
        !CUDA_CHECK(e, cudaEventCreateWithFlags(&tp->done, cudaEventDisableTiming)))
        return;
    if (c->world_size == 1) return;
    ncclUniqueId id;
    memcpy(&id, c->comm_id.internal, sizeof(id));
    if (!NCCL_CHECK(e, c->rank, ncclCommInitRank(&g->world, c->world_size, id, c->rank))) return;
    /* the split is collective over the world: every rank takes part in both (sizes are uniform);
     * colour = the coordinates the group's members share, key = the coordinate that orders them */
    if (tp->size > 1)
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, me.dpcp + g->dp_size * me.pp, me.tp, &tp->comm, NULL));
    if (g->dp_size > 1) /* DP x CP, ordered by dpcp */
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, me.tp + tp->size * me.pp, me.dpcp, &g->dp, NULL));
    if (g->cp_size > 1) /* colour: tp, dp and pp */
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, me.tp + tp->size * (me.dp + g->data_size * me.pp), me.cp, &g->cp,
                                             NULL));
    if (g->cp && c->cp_comm_type == MT_CP_P2P) cp_ring_create(&g->cp_ring, g->cp, g->cp_rank, g->cp_size, c->rank, e);
    if (g->ep_size > 1) { /* colour: the coordinates outside the group (tp, pp and the other fold coordinate) */
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, me.tp + tp->size * (me.edp + g->edp_size * me.pp), me.ep, &g->ep,
                                             NULL));
        if (g->edp_size > 1)
            NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, me.tp + tp->size * (me.ep + g->ep_size * me.pp), me.edp,
                                                 &g->edp, NULL));
    }
    if (g->pp_size > 1) {
        int replica = me.tp + tp->size * me.dpcp; /* the (tp, cp, dp) coordinates the stages of a pipeline share */
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, replica, me.pp, &g->pp, NULL));
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, replica, me.pp, &g->pp_grad, NULL));
        int ends = me.pp == 0 || me.pp == g->pp_size - 1;
        NCCL_CHECK(e, c->rank, ncclCommSplit(g->world, ends ? replica : NCCL_SPLIT_NOCOLOR, me.pp, &g->embedding, NULL));
        for (int i = 0; i < 2; i++)
            if (!CUDA_CHECK(e, cudaStreamCreateWithFlags(&g->pp_streams[i], cudaStreamNonBlocking)) ||
                !CUDA_CHECK(e, cudaEventCreateWithFlags(&g->pp_done[i], cudaEventDisableTiming)))
                return;
        if (!CUDA_CHECK(e, cudaEventCreateWithFlags(&g->pp_ready, cudaEventDisableTiming))) return;
        pipeline_connect(g, c, compute, e);
    }
}

/* The watchdog (mt_trainer_on_collective_timeout): two threads.
 * - The prober watches the progress of the streams collectives run on: it records an event on each
 *   and, at later periods, asks whether the event has completed (all work queued before it done); a
 *   new event is recorded only once the last one completed, so a stream stuck on a collective whose
 *   peer never joins keeps one event pending, and the prober flags it once it has waited the timeout.
 *   Recording an event from this thread adds no dependency between streams and changes no result.
 * - The reporter polls NCCL's asynchronous errors on the communicators and reads what the prober
 *   found, touching no stream itself. It also times the prober's CUDA calls: when a collective never
 *   completes, the training thread goes on queueing work behind it until the GPU's queue is full and
 *   its next launch waits, holding the queue, and then the prober's event record waits too (seen on a
 *   DP = 2 run with a stopped peer: no event stayed pending, the record itself never returned). A
 *   prober call that has not returned within the timeout is reported the same way.
 * The handler is called once, by the reporter; then both threads end (the prober when its call
 * returns). */
#define MT_WATCH_MAX_STREAMS 6
#define MT_WATCH_MAX_COMMS 9
typedef struct mt_watchdog {
    pthread_t thread, prober;
    int running, reporter_running, prober_running, stop, fired; /* running: the lock and condition exist */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int device, rank;
    double timeout_s, period_s;
    int num_streams;
    cudaStream_t stream[MT_WATCH_MAX_STREAMS];
    const char* stream_name[MT_WATCH_MAX_STREAMS];
    cudaEvent_t mark[MT_WATCH_MAX_STREAMS];
    double marked_at[MT_WATCH_MAX_STREAMS];
    int pending[MT_WATCH_MAX_STREAMS];
    int num_comms;
    ncclComm_t comm[MT_WATCH_MAX_COMMS];
    const char* comm_name[MT_WATCH_MAX_COMMS];
    const mt_gpu_error* error; /* its last_nccl_call names the operation */
    mt_collective_timeout_handler handler;
    void* user;
    /* the prober's findings, read by the reporter (atomics) */
    int64_t probe_call_since_ns; /* when its current CUDA call began; 0 outside one */
    int probe_call_stream;       /* the stream that call is about */
    int stuck_stream;            /* 1 + the stream found without progress for the timeout; 0: none */
    int64_t stuck_for_ns;        /* how long it had waited then */
} mt_watchdog;

static double watchdog_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Waits one period on w's condition (the lock held); returns 1 when the watchdog is stopping. */
static int watchdog_sleep(mt_watchdog* w) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double at = (double)until.tv_nsec * 1e-9 + w->period_s;
    until.tv_sec += (time_t)at;
    until.tv_nsec = (long)((at - floor(at)) * 1e9);
    pthread_cond_timedwait(&w->wake, &w->lock, &until);
    return w->stop || w->fired;
}

/* The prober's look at the streams at time `now` (see above); returns 1 once it flagged a stream or
 * the watchdog is stopping. */
static int watchdog_probe(mt_watchdog* w, double now) {
    for (int i = 0; i < w->num_streams; i++) {
        if (__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE) || __atomic_load_n(&w->fired, __ATOMIC_ACQUIRE)) return 1;
        __atomic_store_n(&w->probe_call_stream, i, __ATOMIC_RELAXED);
        __atomic_store_n(&w->probe_call_since_ns, (int64_t)(now * 1e9), __ATOMIC_RELEASE);
        int flagged = 0;
        if (w->pending[i]) {
            cudaError_t q = cudaEventQuery(w->mark[i]);
            if (q == cudaSuccess) w->pending[i] = 0;
            else if (q == cudaErrorNotReady && now - w->marked_at[i] >= w->timeout_s) flagged = 1;
            /* another CUDA error: the trainer's own checks report it */
        }
        if (!flagged && !w->pending[i] && cudaEventRecord(w->mark[i], w->stream[i]) == cudaSuccess) {
            w->pending[i] = 1;
            w->marked_at[i] = now;
        }
        __atomic_store_n(&w->probe_call_since_ns, (int64_t)0, __ATOMIC_RELEASE);
        if (flagged) {
            __atomic_store_n(&w->stuck_for_ns, (int64_t)((now - w->marked_at[i]) * 1e9), __ATOMIC_RELAXED);
            __atomic_store_n(&w->stuck_stream, i + 1, __ATOMIC_RELEASE);
            return 1;
        }
    }
    return 0;
}

/* The reporter's look at time `now`; returns 1 and writes the line when the job cannot go on. */
static int watchdog_check(mt_watchdog* w, double now, char* line, size_t size) {
    const char* last = w->error ? __atomic_load_n(&w->error->last_nccl_call, __ATOMIC_RELAXED) : NULL;
    if (!last) last = "none yet";
    for (int i = 0; i < w->num_comms; i++) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(w->comm[i], &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress) {
            snprintf(line, size, "rank %d: NCCL reports %s on the %s communicator (%s); the last NCCL operation "
                     "issued: %s", w->rank, ncclGetErrorString(state), w->comm_name[i], ncclGetLastError(NULL), last);
            return 1;
        }
    }
    const int stuck = __atomic_load_n(&w->stuck_stream, __ATOMIC_ACQUIRE);
    const int64_t since = __atomic_load_n(&w->probe_call_since_ns, __ATOMIC_ACQUIRE);
    double waited = 0.0;
    const char* name = NULL;
    if (stuck > 0) {
        name = w->stream_name[stuck - 1];
        waited = 1e-9 * (double)__atomic_load_n(&w->stuck_for_ns, __ATOMIC_RELAXED);
    } else if (since > 0 && now - 1e-9 * (double)since >= w->timeout_s) {
        name = w->stream_name[__atomic_load_n(&w->probe_call_stream, __ATOMIC_RELAXED)];
        waited = now - 1e-9 * (double)since;
    }
    if (!name) return 0;
    snprintf(line, size, "rank %d: the %s stream has made no progress for %.2f minutes (--distributed-timeout-minutes "
             "%g): a rank died or hangs; the last NCCL operation issued here: %s", w->rank, name, waited / 60.0,
             w->timeout_s / 60.0, last);
    return 1;
}

static void* watchdog_probe_main(void* arg) {
    mt_watchdog* w = (mt_watchdog*)arg;
    cudaSetDevice(w->device);
    pthread_mutex_lock(&w->lock);
    while (!watchdog_sleep(w)) {
        pthread_mutex_unlock(&w->lock); /* CUDA calls may wait: never with the lock held */
        const int flagged = watchdog_probe(w, watchdog_now());
        pthread_mutex_lock(&w->lock);
        if (flagged) break;
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void* watchdog_main(void* arg) {
    mt_watchdog* w = (mt_watchdog*)arg;
    char line[sizeof(((mt_error*)0)->message)];
    pthread_mutex_lock(&w->lock);
    while (!watchdog_sleep(w)) {
        if (watchdog_check(w, watchdog_now(), line, sizeof(line))) {
            __atomic_store_n(&w->fired, 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&w->wake);
            pthread_mutex_unlock(&w->lock);
            w->handler(line, w->user);
            return NULL;
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Starts watching (w filled with streams, communicators, rank, device, timeout, handler). */
static mt_status watchdog_start(mt_watchdog* w, mt_error* err) {
    w->period_s = w->timeout_s / 4 < 1.0 ? w->timeout_s / 4 : 1.0;
    for (int i = 0; i < w->num_streams; i++)
        if (cudaEventCreateWithFlags(&w->mark[i], cudaEventDisableTiming) != cudaSuccess)
            return mt_fail(err, MT_ERR_CUDA, "cannot create the watchdog's events");
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    w->running = 1;
    if (pthread_create(&w->thread, NULL, watchdog_main, w) != 0)
        return mt_fail(err, MT_ERR_CUDA, "cannot start the watchdog thread");
    w->reporter_running = 1;
    if (pthread_create(&w->prober, NULL, watchdog_probe_main, w) != 0)
        return mt_fail(err, MT_ERR_CUDA, "cannot start the watchdog's prober thread");
    w->prober_running = 1;
    return MT_OK;
}

/* Stops both threads and frees w. A prober still inside a CUDA call after a report (the GPU's queue
 * stuck for good) is left to itself with w: waiting for it could take forever. */
static void watchdog_stop(mt_watchdog* w) {
    if (!w) return;
    if (w->running) {
        pthread_mutex_lock(&w->lock);
        __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&w->wake);
        pthread_mutex_unlock(&w->lock);
        if (w->reporter_running) pthread_join(w->thread, NULL);
        if (w->prober_running) {
            if (w->fired && __atomic_load_n(&w->probe_call_since_ns, __ATOMIC_ACQUIRE) != 0) {
                pthread_detach(w->prober);
                return;
            }
            pthread_join(w->prober, NULL);
        }
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->wake);
    }
    for (int i = 0; i < w->num_streams; i++)
        if (w->mark[i]) cudaEventDestroy(w->mark[i]);
    free(w);
}

static void process_groups_free(mt_process_groups* g) {
    if (g->tp.comm) ncclCommDestroy(g->tp.comm);
    if (g->dp) ncclCommDestroy(g->dp);
    cp_ring_destroy(&g->cp_ring);
    if (g->cp) ncclCommDestroy(g->cp);
    if (g->pp) ncclCommDestroy(g->pp);
    if (g->pp_grad) ncclCommDestroy(g->pp_grad);
    for (int i = 0; i < 2; i++) {
        if (g->pp_streams[i]) cudaStreamDestroy(g->pp_streams[i]);
        if (g->pp_done[i]) cudaEventDestroy(g->pp_done[i]);
    }
    if (g->pp_ready) cudaEventDestroy(g->pp_ready);
    if (g->embedding) ncclCommDestroy(g->embedding);
    if (g->ep) ncclCommDestroy(g->ep);
    if (g->edp) ncclCommDestroy(g->edp);
    if (g->world) ncclCommDestroy(g->world);
    if (g->comm_stream) cudaStreamDestroy(g->comm_stream);
    if (g->tp.stream) cudaStreamDestroy(g->tp.stream);
    if (g->tp.issued) cudaEventDestroy(g->tp.issued);
    if (g->tp.marked) cudaEventDestroy(g->tp.marked);
    if (g->tp.done) cudaEventDestroy(g->tp.done);
    memset(g, 0, sizeof(*g));
}

/* ============================================================================================== */
/* 16. Parallel layers                                                                            */
/*    linear_forward/backward: y = x W^T + b, W stored [out, in], weight and bias gradients in    */
/*    fp32. Megatron's tensor parallelism around them: a column-parallel linear holds rows of W   */
/*    (its output columns) and needs the whole input; a row-parallel linear holds columns of W    */
/*    and produces partial sums, added over the TP group. Without sequence parallelism the input  */
/*    is whole on every rank and the sums are all-reduced; with it, the regions between (norms,   */
/*    residuals) hold R = BT/TP rows per rank: an all-gather before each column-parallel linear   */
/*    and a reduce-scatter after each row-parallel one replace the all-reduce (and swap roles in  */
/*    the backward). At TP = 1 every collective vanishes and these are the plain linears.         */
/*    defines: linear_forward, linear_backward, column_parallel_input, row_parallel_output,       */
/*    parallel_backward_ctx, column_parallel_backward, row_parallel_backward, mt_fp8_state,       */
/*    fp8_linear, fp8_fused_parse, fp8_input_out.                                                 */
/* ============================================================================================== */


/* dW[out, in] += dy^T x (fp32) and, when dbias != NULL, dbias[out] += column sums of dy [N, out] (both
 * overwrite when ex->mode.accumulate_gradients is 0: beta = 0). The
 * GEMM and then the column-sum kernels: cuBLASLt's BGRADB epilogue (GEMM_BGRADB) would take the sums
 * from the GEMM's own read of dy, but dev/cuda/fused_kernels.cu measured it no faster at GPT-2 124M
 * and 18% slower at 1.5B's fc1 on an H100 (it drops the split-K algorithm). */
template <typename T>
static void weight_gradient(const mt_exec* ex, mt_colsum_scratch* s, float* dweight, float* dbias, const T* dy,
                            const T* x, int N, int in, int out) {
    gemm<T, float>(ex, true, false, out, in, N, dy, out, x, in, dweight, in, 1.0f, (float)ex->mode.accumulate_gradients);
    if (dbias) column_sum<T>(ex, s, dbias, dy, N, out);
}

/* ---- FP8 linears (--fp8-format) ----
 * In an FP8 layer the four linears run their three GEMMs in FP8 (section 12): the forward
 * y = x W^T from x8 [N, in] and W's FP8 copy [out, in]; the input gradient dx = dy W from dy8 [N, out]
 * and W^T's copy [in, out]; the weight gradient dW = dy^T x from dy8^T [out, N] and x8^T [in, N]
 * (recast in the backward from the saved bf16 input with the forward's scale: the same bytes, no
 * FP8 activations kept). Weights and inputs are E4M3; output gradients E4M3 or, with hybrid, E5M2.
 * Each operand has a scaling slot in the trainer's FP8 state: delayed scaling casts with the slot's
 * scale and records the amax (the step's largest) for the update after the step; tensorwise takes
 * the scale from the tensor's own amax at each cast. Biases, GELU/SwiGLU and their gradients stay
 * in bf16 around the GEMMs. Delayed scaling knows the scale before the input exists, so the kernel
 * that makes a forward input writes its FP8 bytes into x8 (fp8_out, section 12; MT_FP8_FUSED=0 turns
 * this off): the norms for QKV and fc1 (not with sequence parallelism: the all-gather wants bf16),
 * the activation for fc2; ln1's bf16 copy is then not written at all (the backward remakes it), and
 * the backward's norm_apply of ln1 writes its FP8 bytes, whose byte transpose is QKV's wgrad operand. */
enum { FP8_QKV = 0, FP8_PROJ, FP8_FC1, FP8_FC2, FP8_LINEARS };
enum { FP8_X = 0, FP8_W, FP8_G, FP8_ROLES }; /* a linear's input, weight and output gradient */

/* The FP8 state shared by every FP8 linear: formats, recipe, the scaling slots of every operand
 * (device arrays, one entry per tensor: ((fp8 layer * FP8_LINEARS + linear) * FP8_ROLES + role)),
 * the weights' FP8 copies and the cast scratch of the one linear running. */
typedef struct {
    int enabled;
    mt_fp8_dtype fwd, bwd;      /* E4M3; the gradients E5M2 with hybrid */
    mt_fp8_recipe recipe;
    int margin, wgrad;
    int fused;                  /* delayed scaling and MT_FP8_FUSED not 0: producers write x8 (fp8_input_out) */
    int64_t fused_casts;        /* host: forward and wgrad casts the producers made instead (the tests read it) */
    mt_fp8_amax_algo algo;
    int history_len, history_pos;
    int num_layers;             /* FP8 layers */
    int* slot_of_layer;         /* host [L]: the layer's index among the FP8 layers, -1 in bf16 */
    int num_tensors;            /* num_layers * FP8_LINEARS * FP8_ROLES */
    float* scale;               /* [num_tensors] x_fp8 = x * scale */
    float* scale_inv;           /* [num_tensors * FP8_SCALE_INV_STRIDE] what the GEMMs multiply by */
    float* amax;                /* [num_tensors] delayed: the largest amax of this step's casts */
    float* fp8_max;             /* [num_tensors] the operand's format's largest value */
    float* history;             /* [num_tensors, history_len] delayed scaling's amax rings */
    uint8_t* weights;           /* per FP8 layer, per linear: W [out, in] then W^T [in, out] */
    int64_t weights_per_layer;  /* bytes */
    uint8_t* stale;             /* host [L]: 1 where a layer's FP8 weight copies predate the parameters (its
                                   first forward after a change casts them: per layer, since with virtual
                                   pipeline stages a rank's layers run in several chunks) */
    /* --fp8-param-gather (section 19, fp8_publish_parameters): W of every FP8 linear lives in the
     * parameter storage as FP8 bytes, all-gathered after each step; `weights` holds W^T only */
    int param_gather;
    int unpublished;            /* the parameter storage predates the master weights */
    struct fp8_publish_chunk* publish; /* device [num_chunks]: where each optimizer chunk goes */
    uint8_t *x8, *x8t, *g8, *g8t; /* [BT * widest] each: the running linear's cast operands */
    /* blockwise: the block scale_invs (fp8_scale_inv_count floats each) of those operands, and of the
     * weights' copies: per FP8 layer, per linear, W's 128x128 blocks then W^T's */
    float *x8_blocks, *x8t_blocks, *g8_blocks, *g8t_blocks;
    float* weight_blocks;
    int64_t weight_blocks_per_layer; /* floats */
} mt_fp8_state;

/* The parameters changed (an optimizer step, a load, a skipped step's lost amaxes): every layer's FP8
 * weight copies are made again at its next forward. num_layers: the model's (the table is indexed by
 * the global layer number). Without FP8 (no table) nothing to do. */
static void fp8_weights_changed(mt_fp8_state* f, int num_layers) {
    if (f->stale) memset(f->stale, 1, (size_t)num_layers);
}

/* One linear's view of that state: its three scaling slots and its weight copies. */
typedef struct {
    const mt_fp8_state* f;
    int tensor;                 /* the slot of its input; the weight's is + FP8_W, the gradient's + FP8_G */
    const uint8_t* w8;          /* [out, in] */
    const uint8_t* w8t;         /* [in, out] */
    const float* w8_blocks;     /* blockwise: W's 128x128 block scale_invs */
    const float* w8t_blocks;    /* blockwise: W^T's */
    int record_amax;            /* training: delayed scaling records the amaxes */
    int fresh_backward_input;   /* tensorwise at PP > 1: the backward casts its input afresh (its own amax and
                                   scale), since the slot holds the scale of the stage's latest forward, which
                                   the pipeline's schedule may have run on another micro-batch */
    int x8_ready;               /* x8 holds the forward's input bytes, by the kernel that made x: no cast */
    int x8t_ready;              /* x8t holds the weight gradient's x^T bytes already: no cast */
} fp8_linear;

static mt_fp8_scaling fp8_slot(const fp8_linear* L, int role) {
    const int i = L->tensor + role;
    mt_fp8_scaling s = {L->f->scale + i, L->f->scale_inv + (int64_t)i * FP8_SCALE_INV_STRIDE, L->f->amax + i};
    return s;
}
static const float* fp8_scale_inv(const fp8_linear* L, int role) { return fp8_slot(L, role).scale_inv; }

/* MT_FP8_FUSED's value (read once, at trainer creation): unset, empty or 1, the producers write the
 * FP8 inputs under delayed scaling (fp8_input_out); 0, every input is cast by its linear (to compare:
 * the same bits, one more read of each input); anything else refused in one line. */
static mt_status fp8_fused_parse(const char* value, int* on, mt_error* err) {
    *on = 1;
    if (!value || !*value || !strcmp(value, "1")) return MT_OK;
    if (!strcmp(value, "0")) *on = 0;
    else return mt_fail(err, MT_ERR_ARG, "MT_FP8_FUSED=%.64s: expected 0 or 1 (unset: 1)", value);
    return MT_OK;
}

/* The FP8 output a producer kernel writes for L's forward input (section 12, fp8_out): x8 with the
 * input slot's scale, the amax recorded as the forward's cast records it; none (q NULL) without L
 * or unless the state's fused is set (delayed scaling, MT_FP8_FUSED). record: false for a recast
 * (the backward's). */
static fp8_out fp8_input_out(const fp8_linear* L, bool record = true) {
    fp8_out o = {NULL, NULL, NULL};
    if (!L || !L->f->fused) return o;
    const mt_fp8_scaling s = fp8_slot(L, FP8_X);
    o.q = L->f->x8;
    o.scale = s.scale;
    o.amax = record && L->record_amax ? s.amax : NULL;
    return o;
}

/* x [rows, cols] -> out [rows, cols] and/or out_t [cols, rows] in `dtype`, scaled by the slot of
 * `role`. fresh: the tensor's first cast in this micro-batch (tensorwise takes its amax and scale
 * now; delayed records its amax); otherwise a recast with the scale already set. The input's cast
 * into x8 (x8t) alone is skipped where x8_ready (x8t_ready) says the producer wrote it. */
template <typename T>
static void fp8_cast_operand(const mt_exec* ex, const fp8_linear* L, int role, mt_fp8_dtype dtype, uint8_t* out,
                             uint8_t* out_t, const T* x, int rows, int cols, bool fresh) {
    if (role == FP8_X && ((L->x8_ready && out == L->f->x8 && !out_t) || (L->x8t_ready && !out && out_t == L->f->x8t)))
        return;
    mt_fp8_scaling s = fp8_slot(L, role);
    if (L->f->recipe == MT_FP8_TENSORWISE && fresh)
        fp8_quantize_tensorwise(ex, dtype, &s, L->f->margin, out, out_t, x, rows, cols);
    else
        fp8_cast_transpose(ex, dtype, out, out_t, x, rows, cols, s.scale,
                           fresh && L->record_amax && L->f->recipe == MT_FP8_DELAYED ? s.amax : (float*)NULL, true);
}

/* y [N, out] = x [N, in] W^T (+ bias) through the FP8 GEMM, with fast accumulation as Transformer
 * Engine's forward (its dgrad and wgrad promote: the gradients' GEMMs below don't use it). With
 * gelu_pre: y = gelu(x W^T + bias) and gelu_pre = x W^T + bias from the GEMM's epilogue (per-tensor
 * recipes, where cuBLASLt has such an algorithm); where it has none (or blockwise), the plain GEMM on
 * the same cast writes gelu_pre = x W^T without the bias and y is left alone. Returns whether the
 * activation was applied (true without gelu_pre, and on an error). */
template <typename T>
static bool fp8_linear_forward(const mt_exec* ex, const fp8_linear* L, T* y, const T* x, const T* bias, int N, int in,
                               int out, T* gelu_pre = NULL) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const mt_fp8_state* f = L->f;
        if (f->recipe == MT_FP8_BLOCKWISE) { /* x in 1x128 blocks, W in 128x128 */
            fp8_cast_blockwise<T>(ex, f->fwd, f->x8, NULL, f->x8_blocks, NULL, x, N, in, FP8_BLOCKS_1x128, true);
            gemm_fp8<T>(ex, N, out, in, f->x8, f->fwd, f->x8_blocks, L->w8, f->fwd, L->w8_blocks, gelu_pre ? gelu_pre : y,
                        out, 1.0f, 0.0f, gelu_pre ? (const T*)NULL : bias, FP8_BLOCKS_1x128, FP8_BLOCKS_128x128);
            return !gelu_pre || ex->error->status != MT_OK;
        }
        fp8_cast_operand<T>(ex, L, FP8_X, f->fwd, f->x8, NULL, x, N, in, true);
        const float* x_inv = fp8_scale_inv(L, FP8_X);
        const float* w_inv = fp8_scale_inv(L, FP8_W);
        if (gemm_fp8<T>(ex, N, out, in, f->x8, f->fwd, x_inv, L->w8, f->fwd, w_inv, y, out, 1.0f, 0.0f, bias,
                        FP8_PER_TENSOR, FP8_PER_TENSOR, true, gelu_pre) ||
            !gelu_pre || ex->error->status != MT_OK)
            return true;
        gemm_fp8<T>(ex, N, out, in, f->x8, f->fwd, x_inv, L->w8, f->fwd, w_inv, gelu_pre, out, 1.0f, 0.0f,
                    (const T*)NULL, FP8_PER_TENSOR, FP8_PER_TENSOR, true);
        return ex->error->status != MT_OK;
    } else {
        mt_gpu_fail(ex->error, MT_ERR_CONFIG, "FP8 linears need the bf16 model type");
        return true;
    }
}

/* dx [N, in] = dy [N, out] W through the FP8 GEMM; dy is cast in both layouts (dy8^T is the weight
 * gradient's operand, used next by fp8_linear_weight_gradient). */
template <typename T>
static void fp8_linear_input_gradient(const mt_exec* ex, const fp8_linear* L, T* dx, const T* dy, int N, int in,
                                      int out) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const mt_fp8_state* f = L->f;
        if (f->recipe == MT_FP8_BLOCKWISE) { /* dy and dy^T each in 1x128 blocks of their rows, W^T in 128x128 */
            fp8_cast_blockwise<T>(ex, f->bwd, f->g8, f->g8t, f->g8_blocks, f->g8t_blocks, dy, N, out, FP8_BLOCKS_1x128,
                                  true);
            gemm_fp8<T>(ex, N, in, out, f->g8, f->bwd, f->g8_blocks, L->w8t, f->fwd, L->w8t_blocks, dx, in, 1.0f, 0.0f,
                        (const __nv_bfloat16*)NULL, FP8_BLOCKS_1x128, FP8_BLOCKS_128x128);
            return;
        }
        fp8_cast_operand<T>(ex, L, FP8_G, f->bwd, f->g8, f->g8t, dy, N, out, true);
        gemm_fp8<T>(ex, N, in, out, f->g8, f->bwd, fp8_scale_inv(L, FP8_G), L->w8t, f->fwd, fp8_scale_inv(L, FP8_W), dx,
                    in, 1.0f, 0.0f);
    } else {
        mt_gpu_fail(ex->error, MT_ERR_CONFIG, "FP8 linears need the bf16 model type");
    }
}

/* dW [out, in] (+)= dy^T x through the FP8 GEMM from dy8^T (cast by fp8_linear_input_gradient) and x
 * recast transposed; dbias from dy in bf16 as always. With --no-fp8-wgrad, the model-type GEMM. */
template <typename T>
static void fp8_linear_weight_gradient(const mt_exec* ex, const fp8_linear* L, mt_colsum_scratch* s, float* dweight,
                                       float* dbias, const T* dy, const T* x, int N, int in, int out) {
    const mt_fp8_state* f = L->f;
    if (!f->wgrad) {
        weight_gradient<T>(ex, s, dweight, dbias, dy, x, N, in, out);
        return;
    }
    if (f->recipe == MT_FP8_BLOCKWISE) { /* dy^T and x^T in 1x128 blocks of their own rows (along the tokens) */
        if constexpr (std::is_same<T, __nv_bfloat16>::value) {
            fp8_cast_blockwise<T>(ex, f->fwd, NULL, f->x8t, NULL, f->x8t_blocks, x, N, in, FP8_BLOCKS_1x128, true);
            gemm_fp8<float>(ex, out, in, N, f->g8t, f->bwd, f->g8t_blocks, f->x8t, f->fwd, f->x8t_blocks, dweight, in,
                            1.0f, (float)ex->mode.accumulate_gradients, (const __nv_bfloat16*)NULL, FP8_BLOCKS_1x128,
                            FP8_BLOCKS_1x128);
        }
    } else {
        fp8_cast_operand<T>(ex, L, FP8_X, f->fwd, NULL, f->x8t, x, N, in, L->fresh_backward_input != 0);
        gemm_fp8<float>(ex, out, in, N, f->g8t, f->bwd, fp8_scale_inv(L, FP8_G), f->x8t, f->fwd, fp8_scale_inv(L, FP8_X),
                        dweight, in, 1.0f, (float)ex->mode.accumulate_gradients);
    }
    if (dbias) column_sum<T>(ex, s, dbias, dy, N, out);
}

/* y[N, out] = x[N, in] W[out, in]^T (+ bias, in the GEMM's epilogue where cuBLASLt has one); with f8,
 * through the FP8 GEMM from the weight's FP8 copy */
template <typename T>
static void linear_forward(const mt_exec* ex, T* y, const T* x, const T* weight, const T* bias, int N, int in,
                           int out, const fp8_linear* f8 = NULL) {
    if (f8) {
        fp8_linear_forward<T>(ex, f8, y, x, bias, N, in, out);
        return;
    }
    if (bias && gemm_epilogue<T, T>(ex, GEMM_BIAS, false, true, N, out, in, x, in, weight, in, y, out, 1.0f, 0.0f, bias,
                                    (T*)NULL))
        return;
    gemm<T, T>(ex, false, true, N, out, in, x, in, weight, in, y, out, 1.0f, 0.0f);
    if (bias) bias_add<T>(ex, y, bias, N, out);
}

/* dx[N, in] = dy W;  dW[out, in] += dy^T x;  db[out] += column sums of dy. With gelu_pre (the
 * GELU's input [N, in] that produced x), dx is instead the gradient of gelu_pre: dy W * gelu'(pre),
 * through cuBLASLt's DGELU epilogue (or the GEMM and then the kernel). (DGELU_BGRAD, which would
 * also take the column sums of dx for the bias before the GELU, has no algorithm with fp32 sums and
 * bf16 dx in cuBLAS 13.0 on an H100: dev/cuda/fused_kernels.cu asks.) */
template <typename T>
static void linear_backward(const mt_exec* ex, mt_colsum_scratch* s, T* dx, float* dweight, float* dbias, const T* dy,
                            const T* x, const T* weight, int N, int in, int out, const T* gelu_pre = NULL,
                            const fp8_linear* f8 = NULL) {
    if (f8) { /* the FP8 GEMMs; GELU's derivative by the kernel (gemm_fp8 says why not cuBLASLt's FP8 DGELU) */
        fp8_linear_input_gradient<T>(ex, f8, dx, dy, N, in, out);
        if (gelu_pre) activation_backward<T>(ex, ACT_GELU, dx, gelu_pre, (int64_t)N * in);
        fp8_linear_weight_gradient<T>(ex, f8, s, dweight, dbias, dy, x, N, in, out);
        return;
    }
    if (dx && gelu_pre) {
        if (!gemm_epilogue<T, T>(ex, GEMM_DGELU, false, false, N, in, out, dy, out, weight, in, dx, in, 1.0f, 0.0f,
                                 (const T*)NULL, (T*)gelu_pre)) {
            gemm<T, T>(ex, false, false, N, in, out, dy, out, weight, in, dx, in, 1.0f, 0.0f);
            activation_backward<T>(ex, ACT_GELU, dx, gelu_pre, (int64_t)N * in);
        }
    } else if (dx) {
        gemm<T, T>(ex, false, false, N, in, out, dy, out, weight, in, dx, in, 1.0f, 0.0f);
    }
    weight_gradient<T>(ex, s, dweight, dbias, dy, x, N, in, out);
}

/* The whole input [BT, C] of a column-parallel linear: with sequence parallelism this rank's R rows
 * x [R, C] all-gathered into `gathered`; otherwise x itself. */
template <typename T>
static const T* column_parallel_input(mt_tp_group* tp, T* gathered, const T* x, int R, int C) {
    if (!tp->sp) return x;
    tp_all_gather(tp, gathered, x, (size_t)R * C, tp->type);
    tp_join(tp);
    return gathered;
}

/* The output of a row-parallel linear, y [BT, C] partial over TP: all-reduced in place (returns y),
 * or with sequence parallelism reduce-scattered into this rank's rows [R, C] (returns rows). */
template <typename T>
static T* row_parallel_output(mt_tp_group* tp, T* y, T* rows, int BT, int R, int C) {
    if (tp->size == 1) return y;
    if (tp->sp) tp_reduce_scatter(tp, rows, y, (size_t)R * C, tp->type);
    else tp_all_reduce(tp, y, (size_t)BT * C, tp->type);
    tp_join(tp);
    return tp->sp ? rows : y;
}

/* What the backward of every parallel linear of one micro-batch shares: the execution context, the
 * column-sum scratch, the TP group, the row counts (BT whole, R in the norm/residual regions) and
 * the sequence-parallel staging buffers. */
template <typename T>
struct parallel_backward_ctx {
    const mt_exec* ex;
    mt_colsum_scratch* cs;
    mt_tp_group* tp;
    int BT, R;
    T* gathered;      /* [BT, h]: a linear's input gathered again (SP) */
    T* gathered_grad; /* [BT, h]: a row-parallel output's gradient gathered (SP) */
    T* rows;          /* [R, h]: an input gradient reduce-scattered to this rank's rows (SP) */
};

/* Backward of a column-parallel linear y [BT, out] = x W^T (+ b), W this rank's [out, in], whose
 * input came from x_saved (with sequence parallelism its R rows, gathered again here into
 * pc.gathered). d x is partial over TP: its all-reduce (or reduce-scatter into pc.rows) runs while
 * the weight gradient is computed. Returns d x: dx [BT, in] whole, or pc.rows [R, in]. */
template <typename T>
static T* column_parallel_backward(const parallel_backward_ctx<T>& pc, T* dx, float* dweight, float* dbias,
                                   const T* dy, const T* x_saved, const T* weight, int in, int out,
                                   const fp8_linear* f8 = NULL) {
    const mt_exec* ex = pc.ex;
    mt_tp_group* tp = pc.tp;
    const int BT = pc.BT, R = pc.R;
    const T* x = x_saved;
    if (tp->sp) { /* issued first: it overlaps the dgrad GEMM */
        tp_all_gather(tp, pc.gathered, x_saved, (size_t)R * in, tp->type);
        tp_mark(tp);
        x = pc.gathered;
    }
    if (f8) fp8_linear_input_gradient<T>(ex, f8, dx, dy, BT, in, out);
    else gemm<T, T>(ex, false, false, BT, in, out, dy, out, weight, in, dx, in, 1.0f, 0.0f);
    if (tp->size > 1) {
        if (tp->sp) tp_reduce_scatter(tp, pc.rows, dx, (size_t)R * in, tp->type);
        else tp_all_reduce(tp, dx, (size_t)BT * in, tp->type);
    }
    if (tp->sp) tp_join_mark(tp); /* the input is gathered; the reduction may still run */
    if (f8) fp8_linear_weight_gradient<T>(ex, f8, pc.cs, dweight, dbias, dy, x, BT, in, out);
    else weight_gradient<T>(ex, pc.cs, dweight, dbias, dy, x, BT, in, out);
    if (tp->size > 1) tp_join(tp);
    return tp->sp ? pc.rows : dx;
}

/* Backward of a row-parallel linear y = x W^T (+ b), W this rank's [out, in], x [BT, in], whose
 * output (after the reduction and the whole bias) fed the region that holds dy_rows [R, out]: with
 * sequence parallelism gathered to [BT, out] into pc.gathered_grad first. Its bias gradient (the
 * column sums of dy_rows: with sequence parallelism a partial sum, completed over TP with the
 * norms') is taken by the norm backward that produced dy_rows (norm_backward's dprev_bias). With
 * gelu_pre, dx is the gradient of the GELU's input (see linear_backward). */
template <typename T>
static void row_parallel_backward(const parallel_backward_ctx<T>& pc, T* dx, float* dweight, const T* dy_rows,
                                  const T* x, const T* weight, int in, int out, const T* gelu_pre = NULL,
                                  const fp8_linear* f8 = NULL) {
    const T* dy = column_parallel_input(pc.tp, pc.gathered_grad, dy_rows, pc.R, out);
    linear_backward<T>(pc.ex, pc.cs, dx, dweight, (float*)NULL, dy, x, weight, pc.BT, in, out, gelu_pre, f8);
}

/* ============================================================================================== */
/* 17. The model                                                                                  */
/*    Parameters: one buffer in Megatron's DDP layout (megatron.h mt_buffer_layout: reverse       */
/*    model order, buckets) of this tensor-parallel rank's shard; layer_params / layer_grads      */
/*    name one layer's tensors in it. Activations: one arena for one micro-batch, sized at        */
/*    creation; layer_activations names one layer's. Shapes below are a rank's: heads, groups, f  */
/*    and V are the full model's divided by TP; the norm and residual regions hold R rows (BT,    */
/*    or BT/TP with sequence parallelism: the micro-batch's [B*T] rows cut into TP consecutive    */
/*    blocks, Megatron's [s/tp, b, h] in this codebase's row order). Then the attention layer     */
/*    (exact or flash), the forward and the backward of one stage, and activation recompute       */
/*    (recompute_layer: what the forward did not keep, made again before a layer's backward).     */
/*    defines: mt_trainer and its parts (mt_loop_state, mt_ddp_state, mt_optimizer_state,         */
/*    mt_loss_scaler, mt_checkpoint_state, mt_memory_state, mt_debug_hooks), trainer_exec,        */
/*    mt_shape, layer_params / layer_grads / layer_activations, attention_forward /               */
/*    attention_backward, model_forward, model_backward, recompute_layer.                         */
/* ============================================================================================== */

typedef struct {
    /* saved for backward, per layer l (pointers to layer 0; layer l is + l * stride) */
    void* residual;      /* [L+1, R, h]: input of layer l; [L] is the input of the final norm */
    void* ln1;           /* [R, h] the first norm's output, one layer at a time: the forward's, then the
                            backward recomputes it from residual, ln1_mean and ln1_rstd */
    float* ln1_mean;     /* [L, R] */
    float* ln1_rstd;     /* [L, R] */
    void* qkv;           /* [L, BT, qkv_width], bias included; flash path: q and k rotated (RoPE) */
    void* probs;         /* [L, B*heads, T, T] attention probabilities (exact path only) */
    float* lse;          /* [L, B*heads, T] softmax log-sum-exp (flash path only) */
    void* attn_out;      /* [L, BT, heads*d] */
    void* residual_mid;  /* [L, R, h]: after the attention residual */
    void* ln2;           /* [L, R, h] */
    float* ln2_mean;     /* [L, R] */
    float* ln2_rstd;     /* [L, R] */
    void* fc1;           /* [L, BT, f1]: before the activation (f1 = 2f with SwiGLU: gate | up) */
    void* act;           /* [L, BT, f]: GELU or SwiGLU output */
    void* lnf;           /* [R, h] */
    float* lnf_mean;     /* [R] */
    float* lnf_rstd;     /* [R] */
    void* logits;        /* [BT, V] (this rank's vocabulary columns), overwritten by its gradient */
    /* scratch, reused by every layer */
    /* the exact path's head layouts (the flash path reads and writes the rows in place) */
    void* q;             /* [B, heads, T, d] (q, then dq), rotated with RoPE */
    void* k;             /* [B, groups, T, d] rotated with RoPE */
    void* v;             /* [B, groups, T, d] */
    void* o;             /* [B, heads, T, d] attention output before merging heads, then d out */
    void* dk;            /* [B, groups, T, d] */
    void* dv;            /* [B, groups, T, d] */
    void* dscores;       /* [B*heads, T, T] */
    float* dsum;         /* [B*heads*T] rowsum(dO * O) (flash path) */
    float* logits_row;   /* [Vp] fp32 staging of one row of logits (the whole vocabulary) */
    void* branch;        /* [BT, max(h, qkv_width, heads*d, f1)]: a sublayer's output / gradient */
    void* branch2;       /* [BT, same] */
    void* dresidual;     /* [R, h] gradient of the residual stream */
    /* tensor and sequence parallelism */
    void* gathered;      /* [BT, h]: a norm's output gathered for a column-parallel linear (SP) */
    void* gathered_grad; /* [BT, h]: the residual gradient gathered for a row-parallel backward (SP) */
    void* rows;          /* [R, h]: a row-parallel output or input gradient reduce-scattered (SP) */
    float* ce_stats;     /* [TP, BT, 3]: every rank's vocab-parallel cross-entropy statistics (TP > 1) */
    int32_t* inputs;     /* [BT] */
    int32_t* targets;    /* [BT] */
    float* losses;       /* [BT] */
    int32_t* embed_index;/* word-embedding backward index: unique tokens, offsets, positions; with
                            --reset-position-ids then mt_position_index's offsets [S+1] and rows [BT] */
    /* --qk-layernorm (NULL without): the layer's QKV rows as attention reads them, q and k normalised
     * (v copied; the flash path rotates q and k here, the kept qkv stays as the linear made it), and
     * each row's head statistics, made again from the kept qkv before the layer's attention backward */
    void* qk_norm;       /* [BT, qkv_width] */
    float* qk_stats;     /* [2, BT, heads + groups]: mean, then 1/std, of every q and k head vector */
    /* mixture of experts (NULL in a dense model; megatron.h MT_ACT_MOE_*). N = BT tokens, E experts, fe an
     * expert's width (f1e = 2 fe: SwiGLU), Rmax the permuted rows' bound (mt_moe_max_rows), Rx = max(Rmax, N).
     * Scratch: */
    void* moe_xperm;     /* [Rx, h] the layer input's rows in expert order (forward; again in the backward) */
    void* moe_y;         /* [Rx, h] the experts' output rows; in the backward their gradient, then the input
                            rows' gradient, then the shared expert's output gradient (gated) */
    void* moe_dz;        /* [Rmax, f1e] d(expert fc1 output) */
    void* moe_dact;      /* [Rmax, fe] d(expert activation) */
    float* moe_dlogits;  /* [N, E] */
    float* moe_dprobs;   /* [N, E] d(final probabilities); the shared gate's logit gradient [N] after the router */
    float* moe_x32;      /* [N, h] the router's input in fp32 (bf16/fp16 models), then its gradient */
    float* moe_w32;      /* [E, h] the router weight in fp32 (bf16/fp16 models) */
    int32_t* moe_work;   /* moe_work_words(N, E, B): the routing kernels' scratch */
    int32_t* moe_stats;  /* one micro-batch's aux statistics: aux_counts int [(B+1), E], score_sums float
                            [(B+1), E], lse_sq_sum float [1] (moe_aux_stats) */
    /* saved per layer (layer 0's; layer l at + l * its per-layer size): */
    float* moe_logits;   /* [L, N, E] router logits */
    float* moe_probs;    /* [L, N, E] final probabilities (0 off the final map) */
    int32_t* moe_row;    /* [L, N, E] permuted row of (token, expert), -1 off the map */
    int32_t* moe_token;  /* [L, Rmax] token row of each permuted row */
    float* moe_row_prob; /* [L, Rmax] probability of each permuted row */
    int32_t* moe_counts; /* [L, 2E + 1] rows per expert, then the offsets */
    float* moe_auxw;     /* [L, B, E] the aux losses' gradient weights (training with aux losses) */
    void* moe_fc1;       /* [L, Rexp, f1e] the experts' fc1 output (Rexp = Rmax at EP = 1) */
    void* moe_act;       /* [L, Rexp, fe] the experts' activation times the probability */
    void* moe_shared;    /* [L, N, h] the shared expert's output before its gate (--moe-shared-expert-gate) */
    float* moe_gate;     /* [L, N] the shared expert's gate, sigmoid(x . w) */
    /* expert parallelism (NULL at EP = 1): Rexp = mt_moe_expert_rows, El = E / EP local experts.
     * Scratch: */
    int32_t* moe_ep_index; /* [2, Rexp] the received rows in local-expert order (gather index), then its inverse */
    float* moe_ep_drow;    /* [2 Rexp + Rmax] the probability gradient of the local experts' rows, the same in
                              the received order, and the rows' of this rank's tokens as they come back */
    /* context parallelism (NULL at CP = 1): attention's buffers (megatron.h mt_cp_scratch_bytes, cp_scratch) */
    void* cp;
    size_t cp_bytes;     /* their size, mt_cp_scratch_bytes as the layout carved it (0 at CP = 1) */
    /* saved per layer: */
    void* moe_ep_in;       /* [L, Rexp, h] the local experts' input rows, in local-expert order */
    float* moe_ep_prob;    /* [L, Rexp] their probabilities */
    int32_t* moe_ep_counts;/* [L, EP, El] rows received from each EP rank for each local expert */
    /* saved once per slot: the micro-batch's documents (mt_document_boundaries; NULL without
     * --reset-position-ids / --reset-attention-mask and context parallelism), staged with every forward of
     * the micro-batch, so every pipeline stage has them and the backward (and recompute) reads the forward's */
    int32_t* docs;       /* [2, BT] doc_start, then positions, of this rank's rows (sequence positions); with
                            CP then [2, B S_full] the whole samples' (a2a reads them) */
} mt_activations;

/* ---- The trainer and its parts ----
 * mt_trainer holds what sections 15-21 all read (the config, the error record, the process groups,
 * the stream and GEMM plans, the model's buffers and running activations, the FP8 state), then one
 * part for each section that keeps state of its own from call to call. A part's type sits here,
 * before the trainer (C++ needs it whole), and names its section: that section's functions read and
 * write it, and one that needs nothing else takes the part alone (loss_scaler_update, offloaded_part,
 * offload_free, release_save; ddp_create with the buffer layout it sizes the part by). */

/* Section 18, the micro-batch loop: the activation slots a step's schedule hands out, the host
 * staging of one micro-batch's tokens, the pipeline's pending send, and the last loss's count. */
typedef struct {
    mt_activations* slots;    /* [num_slots]: saved activations of the micro-batches in flight (their own
                                 memory each; the scratch regions shared), carved from mem.arena */
    int num_slots;            /* the most (chunk, micro-batch) pairs a step's schedule holds at once */
    void* pp_send;            /* [R, h]: an input gradient waiting to be sent to the previous stage */
    int pp_unique;            /* PP = 1: the word-embedding index's size, from the forward to its backward */
    int32_t* host_tokens;     /* pinned staging: [micro, T] inputs, targets and the embedding index */
    float* host_losses;       /* pinned [BT] */
    int32_t* host_index;      /* pinned embedding backward index for one micro-batch */
    int64_t last_loss_tokens; /* positions the last train step or evaluation counted (over DP) */
} mt_loop_state;

/* Section 19, the data-parallel reduction and gathering (Megatron's DistributedDataParallel): the
 * buckets' progress through a step, the parameter all-gather's events, the handover between the
 * compute and communication streams, and the device scratch of host values reduced over a group. */
typedef struct {
    int next_bucket;          /* next bucket to reduce in this step */
    int gather_pending;       /* parameter all-gathers of the last step still in flight */
    int64_t param_gather_bytes; /* bytes the last parameter all-gather assembled on each rank (every shard) */
    cudaEvent_t compute_done, comm_done;
    cudaEvent_t* gathered;    /* [num_buckets]: bucket b's parameters all-gathered */
    int* first_bucket_of_layer; /* [L + 2]: see first_bucket_of_layers */
    double* reduce_scratch;   /* [2 + world * MT_GATHER_DOUBLES]: values all-reduced, then all_gather_world's */
    __nv_bfloat16* bf16_grads; /* [mt_grad_reduce_scratch]: a bucket's gradients in bf16 (--grad-reduce-in-bf16) */
} mt_ddp_state;

/* Section 19, the optimizer: each bucket's owned range (its DP shard, or all of it without the
 * distributed optimizer), concatenated in bucket order, with its fp32 master weights and Adam
 * moments, the chunks AdamW and the norms walk, the offloaded end, and the step counters. */
typedef struct {
    float* master;            /* [shard_numel] fp32 (with offload the first shard_numel - offload elements) */
    float* adam_m;            /* [shard_numel] (the same) */
    float* adam_v;            /* [shard_numel] (the same) */
    int64_t shard_numel;
    int64_t* shard_offset;    /* [num_buckets]: where bucket b's owned range starts in master */
    int sharded;              /* distributed optimizer with dp > 1 */
    mt_opt_chunk* chunks;     /* device [num_chunks]: the owned parameter elements in pieces */
    int num_chunks;
    double* norm_partial;     /* [num_chunks + 1] */
    struct mt_offload* offload; /* NULL without --optimizer-cpu-offload (or with nothing to offload) */
    int64_t scheduler_steps;  /* samples seen by the LR scheduler (Megatron's num_steps) */
    int64_t adam_step;        /* optimizer steps taken */
} mt_optimizer_state;

/* Section 19, Megatron's fp16 DynamicGradScaler (a loss scale of 1 otherwise). */
typedef struct {
    double loss_scale;
    int growth_tracker;
    int hysteresis_tracker;
} mt_loss_scaler;

/* Section 20, checkpoints: the writer of the last save and what loads are told. */
struct mt_async_save; /* a save between staging and commit (section 20) */
typedef struct {
    struct mt_async_save* async_save; /* the checkpoint writer, from the first save */
    int no_verify_checkpoint;   /* --no-verify-checkpoint: loads warn where the integrity rule refuses */
    mt_error load_warning;      /* what the last load's integrity check had to say (rank 0), "" if nothing */
} mt_checkpoint_state;

/* Section 21, the memory: the plan computed on the host before any allocation, what was allocated by
 * its categories, and the two arenas carved from its layouts. */
typedef struct {
    mt_memory_plan plan;        /* computed on the host before any allocation */
    mt_memory_plan allocated;   /* what device_alloc handed out at creation, by the plan's categories */
    size_t state_bytes_measured; /* device memory taken by params, grads, master, Adam (cudaMemGetInfo) */
    void* arena;                /* activations + scratch, one allocation (loop.slots) */
    size_t arena_bytes;
    void* fp8_arena;            /* the FP8 state's device memory, one allocation */
    size_t fp8_arena_bytes;
} mt_memory_state;

/* Section 17, the experts' GEMMs of a MoE layer (moe_experts_gemm): the paths one call's GEMMs can take, and the
 * side streams of the third. MT_MOE_GEMM in the environment (read once, when the MoE state is created) forces one
 * path for every call; unset, moe_gemm_choose's rule picks per call. */
typedef enum {
    MOE_PATH_DEFAULT = 0, /* moe_gemm_choose's rule */
    MOE_PATH_GROUPED,     /* one cuBLAS grouped call (gemm_grouped) */
    MOE_PATH_LOOP,        /* one cuBLAS GEMM per expert on the compute stream (gemm_uncached) */
    MOE_PATH_STREAMS,     /* the loop's GEMMs spread over side streams, forked from and joined to the compute stream */
    MOE_PATH_HOPPER,      /* MT_MOE_GEMM=hopper: section 13.1's grouped GEMM for every forward and input-gradient
                             GEMM (the weight gradients, which it does not compute, by the default rule) */
} moe_gemm_path;
#define MOE_SIDE_STREAMS MT_MOE_GEMM_STREAMS
typedef struct {
    int forced;               /* MT_MOE_GEMM (moe_gemm_path_parse): MOE_PATH_DEFAULT, or the path of every call */
    int streams;              /* side streams created: MOE_SIDE_STREAMS (0 before, or after a failure) */
    cudaStream_t side[MOE_SIDE_STREAMS];
    mt_gemm_plans plans[MOE_SIDE_STREAMS]; /* each side stream's own cuBLAS handle (only .handle is used, by
                                 gemm_uncached), set up as the compute stream's (gemm_handle_create) ... */
    void* workspace[MOE_SIDE_STREAMS];     /* ... with its own workspace of MT_CUBLAS_WORKSPACE_BYTES */
    cudaEvent_t fork;         /* recorded on the compute stream before a call's GEMMs; the side streams wait on it */
    cudaEvent_t joined[MOE_SIDE_STREAMS]; /* recorded on each side stream after them; the compute stream waits */
    const void** staging;     /* pinned [MOE_GEMM_SLOTS, 3, E]: the grouped calls' matrix pointers ... */
    const void** table;       /* device [MOE_GEMM_SLOTS, 3, E]: ... where cuBLAS reads them (the Hopper kernel: a
                                 slot's rows per expert, int32, staged the same way) */
    int hopper;               /* the bf16 forward and input-gradient GEMMs through hopper_grouped_gemm (13.1): 1
                                 where it runs and they are small (moe_experts_hopper), 2 always (MT_MOE_GEMM=hopper),
                                 0 never (no sm_90a, not bf16, or MT_MOE_GEMM names a cuBLAS path); set at creation */
} mt_moe_gemm;

/* Section 17, mixture of experts: what the routers carry between micro-batches and steps (Megatron's
 * router buffers and finalize_model_grads' MoE part), per MoE layer l (indexed by model layer; every layer
 * is MoE in this build), and the last training pass's statistics on the host (mt_trainer_moe_stats). */
typedef struct {
    int enabled;              /* the model has MoE layers */
    float* expert_bias;       /* [L, E] fp32: --moe-router-enable-expert-bias's bias (a buffer: no gradient,
                                 checkpointed), updated after each step's backward; 0 without the flag */
    int32_t* step_tokens;     /* [L, E]: tokens per expert of the final routing maps, summed over this pass */
    float* global_sums;       /* [L, E]: --global_aux_loss: the step's DP-summed aux counts so far; then [E]
                                 more: the running average of the layer being routed */
    float* log;               /* [L, 4]: the pass's logged loss sums (load balancing, seq, global, z) */
    int32_t* host_counts;     /* pinned [2E + 1]: one layer's rows per expert and offsets, for the expert GEMMs */
    mt_moe_gemm gemm;         /* the experts' GEMMs: the path forced, the side streams, the grouped calls' tables */
    float* last_log;          /* host [L, 4]: the last training pass's logged values, averaged over micro-batches */
    int32_t* last_tokens;     /* host [L, E]: its tokens per expert */
    int micro_batches;        /* micro-batches of the running pass (the global aux loss's running average) */
    /* expert parallelism (EP > 1; NULL else): one layer's dispatch plan on the host (moe_ep_plan) */
    int32_t* ep_host;         /* pinned: the received counts [EP, El], then the gather index and its inverse
                                 [2, Rexp] staged for the device */
    int64_t* ep_offsets;      /* host [2, EP + 1]: the rows sent to and received from each EP rank, as offsets */
    int32_t* ep_local;        /* host [2 El + 1]: rows per local expert, offsets, total (the experts' GEMMs') */
} mt_moe_state;

/* Hooks for debugging and tests, off in a normal run. */
typedef struct {
    int64_t test_nan_gradients_at; /* tests only (section 21): 1 + the iteration one of whose gradients (the first
                                      parameter's first) is made NaN after its backward (0: never) */
    int pp_trace;             /* section 18: MT_PP_TRACE=1 in the environment at PP > 1: each pipeline unit's
                                 transfers and steps on stderr, the stream synchronised after each (a hang then
                                 names the unit it stopped in); read once, at creation */
} mt_debug_hooks;

struct mt_trainer {
    mt_config cfg;
    mt_gpu_error error;
    mt_process_groups groups;
    mt_watchdog* watchdog;    /* mt_trainer_on_collective_timeout's thread (NULL: none; section 15) */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void* cublas_workspace;
    mt_gemm_plans gemm;
    mt_colsum_scratch colsum;
    /* the model (this section) */
    mt_param_info params_info[MT_NUM_PARAM_TENSORS];      /* this TP rank's shard (mt_param_layout_shard) */
    mt_param_info params_info_full[MT_NUM_PARAM_TENSORS]; /* the full model (mt_param_layout) */
    int64_t num_params;       /* this rank's parameters: its TP shard of its pipeline stage's tensors (no padding) */
    size_t elem;              /* bytes per model element */
    int flash;                /* attention by the flash kernels (bf16, head dim 64/128), else exact */
    int attn_fwd;             /* MT_ATTN_FWD (attn_fwd_parse, read once at creation): which flash forward */
    int attn_bwd;             /* MT_ATTN_BWD (attn_bwd_parse, read once at creation): which flash backward */
    float* rope_cos;          /* [T, rot/2] RoPE tables (NULL without RoPE) */
    float* rope_sin;
    /* parameters and gradients share one buffer layout (megatron.h, mt_buffer_layout): reverse model
     * order, cut into data-parallel buckets */
    mt_buffer_layout buffer;
    void* params;             /* [buffer.size] model type; aliases opt.master in fp32 without the distributed
                                 optimizer */
    float* grads;             /* [buffer.size] fp32 */
    mt_activations act;       /* the activations of the (chunk, micro-batch) running: one of loop.slots[] */
    mt_fp8_state fp8;         /* FP8 linears (section 16); enabled = 0 without --fp8-format */
    int64_t iteration;        /* train steps taken, skipped ones too (after a load: the checkpoint's
                                 iteration): keys the dropout masks (dropout_site) */
    /* the sections' parts */
    mt_loop_state loop;       /* section 18 */
    mt_ddp_state ddp;         /* section 19 */
    mt_optimizer_state opt;   /* section 19 */
    mt_loss_scaler scaler;    /* section 19 */
    mt_checkpoint_state ckpt; /* section 20 */
    mt_memory_state mem;      /* section 21 */
    mt_debug_hooks debug;     /* sections 18 and 21: tracing and a test hook */
    mt_moe_state moe;         /* section 17: the MoE routers' state (enabled = 0 in a dense model) */
    /* Room for the parts still to come, empty by design until they land: expert parallelism (the
     * expert-parallel group's token dispatch and its buffers) and context
     * parallelism (the sequence's split over the CP group and attention's ring exchange) each add
     * a part here, its type beside the others above and owned by the section that brings it. */
};

/* Element offset of layer l in a stacked per-layer tensor of `per_layer` elements. */
#define LAYER(ptr, T, l, per_layer) ((T*)(ptr) + (int64_t)(l) * (per_layer))

/* Parameter `which` of layer l (l ignored outside the layers) in the model-type and gradient buffers. */
/* NULL for a tensor the flavour does not have (a bias with --disable-bias-linear, ...). */
/* The parameter storage holds them at byte offsets (mt_buffer_param.storage: elem bytes an element,
 * one for the FP8 bytes of --fp8-param-gather's weights); -1 for a tensor the flavour lacks. */
static int64_t param_storage(const mt_trainer* t, int which, int l) {
    const int i = t->buffer.index[which * t->buffer.num_layers + l];
    return i < 0 ? -1 : t->buffer.params[i].storage;
}
template <typename T>
static T* param_ptr(mt_trainer* t, int which, int l = 0) {
    int64_t offset = param_storage(t, which, l);
    return offset < 0 ? NULL : (T*)((char*)t->params + offset);
}
static float* grad_ptr(mt_trainer* t, int which, int l = 0) {
    int64_t offset = mt_buffer_offset(&t->buffer, which, l);
    return offset < 0 ? NULL : t->grads + offset;
}

/* The execution context of work on the trainer's stream (mode: the micro-batch's, or all zero
 * outside the micro-batch loop). */
static mt_exec trainer_exec(mt_trainer* t, mt_micro_batch_mode mode = mt_micro_batch_mode()) {
    mt_exec ex;
    ex.stream = t->stream;
    ex.error = &t->error;
    ex.gemm = &t->gemm;
    ex.mode = mode;
    return ex;
}

/* Host <-> device copies, ordered on the trainer's stream and finished on return. (The stream is
 * non-blocking, so a plain cudaMemcpy on the legacy stream would not be ordered with its kernels.) */
static mt_status copy_sync(mt_trainer* t, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                           mt_error* err) {
    CUDA_CHECK(&t->error, cudaMemcpyAsync(dst, src, bytes, kind, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* Shapes used everywhere below. */
/* One tensor-parallel rank's shapes: heads, groups, widths, f and V are its shares. With context
 * parallelism S is the rank's rows of a sample (two chunks, S_full / CP) and BT = B S its rows. */
typedef struct {
    int B, S, BT, h, heads, groups, d, qkv_width, attn_width, f, L;
    int cp, cp_rank;    /* context parallelism (1, 0 without) */
    int S_full;         /* the sequence length (S at CP = 1) */
    mt_cp_comm_type cp_comm;
    int f1;        /* first MLP linear's width: 2f with SwiGLU */
    int rot;       /* rotary channels per head (0 without RoPE) */
    bool rms;      /* RMSNorm, else LayerNorm */
    float norm_w1; /* 1 with --apply-layernorm-1p (the norm weights hold w - 1), else 0 */
    bool swiglu;
    int act;       /* without SwiGLU, the MLP's activation: ACT_GELU, or ACT_SQUARED_RELU (--squared-relu) */
    bool qk_norm;  /* --qk-layernorm: q and k heads normalised after the QKV split (before RoPE) */
    int tp, tp_rank;
    bool sp;       /* sequence parallelism */
    int R;         /* rows of the norm/residual regions: BT, or BT / tp with sequence parallelism */
    int64_t V;          /* this rank's vocabulary columns: Vp / tp */
    int64_t V_full;     /* the padded vocabulary Vp */
    int64_t vocab_start;/* the first of this rank's columns */
    /* mixture of experts (moe false: a dense model). Every layer's MLP is then the MoE layer and its dense
     * MLP tensors and regions (f, f1, fc1, act) are the shared expert's (f = 0 without one). */
    bool moe;
    int E, k;      /* experts, top-k */
    int fe, f1e;   /* an expert's width and its fc1's (2 fe with SwiGLU) */
    int64_t Rmax;  /* the permuted rows' bound of a micro-batch (mt_moe_max_rows) */
    int ep, ep_rank; /* expert parallelism: EP ranks, this one's (1, 0 without) */
    int El;        /* local experts: E / EP, experts ep_rank El .. (ep_rank + 1) El - 1 */
    int64_t Rexp;  /* the rows the local experts may receive (mt_moe_expert_rows; Rmax at EP = 1) */
    int f_room, f1_room; /* the per-layer MLP activation regions' widths (MT_ACT_ACT, MT_ACT_FC1): f and f1, or in
                            an MoE model with dense layers the wider of the dense MLP's and the shared expert's */
} mt_shape;

static mt_shape model_shape(const mt_trainer* t) {
    const mt_config* c = &t->cfg;
    mt_shape s;
    s.tp = t->groups.tp.size;
    s.tp_rank = t->groups.tp.rank;
    s.sp = t->groups.tp.sp != 0;
    s.B = c->micro_batch_size;
    s.cp = t->groups.cp_size > 0 ? t->groups.cp_size : 1;
    s.cp_rank = t->groups.cp_rank;
    s.cp_comm = c->cp_comm_type;
    s.S_full = c->seq_length;
    s.S = c->seq_length / s.cp;
    s.BT = s.B * s.S;
    s.R = s.sp ? s.BT / s.tp : s.BT;
    s.h = c->hidden_size;
    s.heads = c->num_attention_heads / s.tp;
    s.groups = c->num_query_groups / s.tp;
    s.d = c->kv_channels;
    s.qkv_width = (s.heads + 2 * s.groups) * s.d;
    s.attn_width = s.heads * s.d;
    s.moe = c->num_experts > 0;
    s.f = (s.moe ? c->moe_shared_expert_intermediate_size : c->ffn_hidden_size) / s.tp;
    s.swiglu = c->swiglu != 0;
    s.act = c->squared_relu ? ACT_SQUARED_RELU : ACT_GELU;
    s.qk_norm = c->qk_layernorm != 0;
    s.f1 = s.swiglu ? 2 * s.f : s.f;
    s.rot = c->position_embedding_type == MT_POSITION_ROPE ? (int)(c->kv_channels * c->rotary_percent) : 0;
    s.rms = c->normalization == MT_NORM_RMSNORM;
    s.norm_w1 = c->apply_layernorm_1p ? 1.0f : 0.0f;
    s.L = c->num_layers;
    s.V_full = c->padded_vocab_size;
    s.V = s.V_full / s.tp;
    s.vocab_start = s.V * s.tp_rank;
    s.E = c->num_experts;
    s.k = c->moe_router_topk;
    s.fe = s.moe ? (int)mt_moe_ffn(c) : 0;
    s.f1e = s.swiglu ? 2 * s.fe : s.fe;
    s.Rmax = s.moe ? mt_moe_max_rows(c, s.BT) : 0;
    s.ep = t->groups.ep_size > 0 ? t->groups.ep_size : 1;
    s.ep_rank = t->groups.ep_rank;
    s.El = s.moe ? s.E / s.ep : 0;
    s.Rexp = s.moe ? mt_moe_expert_rows(c, s.BT) : 0;
    s.f_room = s.f, s.f1_room = s.f1;
    if (s.moe && mt_moe_num_layers(c) < c->num_layers) { /* the memory plan's mlp_f / mlp_f1 */
        const int dense_f = c->ffn_hidden_size / s.tp, dense_f1 = s.swiglu ? 2 * dense_f : dense_f;
        s.f_room = dense_f > s.f ? dense_f : s.f;
        s.f1_room = dense_f1 > s.f1 ? dense_f1 : s.f1;
    }
    return s;
}

/* Layer l's shape: the model's, except that a dense layer of an MoE model (--moe-layer-freq) is not MoE and
 * its MLP is --ffn-hidden-size wide (model_shape's f is the shared expert's). */
static mt_shape layer_shape(const mt_trainer* t, int l) {
    mt_shape s = model_shape(t);
    if (s.moe && !mt_moe_layer(&t->cfg, l)) {
        s.moe = false;
        s.f = t->cfg.ffn_hidden_size / s.tp;
        s.f1 = s.swiglu ? 2 * s.f : s.f;
    }
    return s;
}

/* One layer's saved activations, as pointers into the arena (R rows in the norm/residual regions,
 * BT elsewhere; see mt_activations): layer i (0-based) of a chunk of `count` layers, in the rooms
 * the recompute setting gives it (megatron.h mt_recompute_position: room i of each region without
 * recompute; the plan counts the same rooms). */
template <typename T>
struct layer_view {
    T *x;                       /* [R, h] layer input (the residual stream) */
    T *ln1;                     /* [R, h] norm1(x): not kept per layer, recomputed in the backward */
    float *ln1_mean, *ln1_rstd; /* [R] */
    T *qkv;                     /* [BT, qkv_width] */
    T *probs;                   /* [B*heads, T, T] exact path, else NULL */
    float *lse;                 /* [B*heads, T] flash path, else NULL */
    T *attn;                    /* [BT, heads*d] */
    T *mid;                     /* [R, h] x + attention branch */
    T *ln2;                     /* [R, h] norm2(mid) */
    float *ln2_mean, *ln2_rstd; /* [R] */
    T *fc1;                     /* [BT, f1] pre-activation */
    T *act;                     /* [BT, f] */
    T *out;                     /* [R, h] layer output = the next layer's input */
    /* an MoE layer's (mt_activations names them) */
    float *moe_logits, *moe_probs, *moe_row_prob, *moe_auxw, *moe_gate;
    int32_t *moe_row, *moe_token, *moe_counts;
    T *moe_fc1, *moe_act, *moe_shared;
    T *moe_ep_in;               /* EP > 1 (else NULL): [Rexp, h] the local experts' input rows */
    float *moe_ep_prob;         /* [Rexp] their probabilities */
    int32_t *moe_ep_counts;     /* [EP, El] rows received per EP rank and local expert */
};
template <typename T>
static layer_view<T> layer_activations(const mt_activations* a, const mt_shape& s, const mt_recompute* rc, int count,
                                       int i) {
    const int64_t Rh = (int64_t)s.R * s.h;
    auto room = [&](int region, int layer) { return mt_recompute_position(rc, region, count, layer); };
    layer_view<T> v;
    v.x = LAYER(a->residual, T, room(MT_ACT_RESIDUAL, i), Rh);
    v.ln1 = (T*)a->ln1;
    v.ln1_mean = a->ln1_mean + room(MT_ACT_LN1_MEAN, i) * s.R;
    v.ln1_rstd = a->ln1_rstd + room(MT_ACT_LN1_RSTD, i) * s.R;
    v.qkv = LAYER(a->qkv, T, room(MT_ACT_QKV, i), (int64_t)s.BT * s.qkv_width);
    v.probs = a->probs ? LAYER(a->probs, T, room(MT_ACT_PROBS, i), (int64_t)s.B * s.heads * s.S * s.S_full) : NULL;
    v.lse = a->lse ? a->lse + room(MT_ACT_LSE, i) * s.B * s.heads * s.S : NULL;
    v.attn = LAYER(a->attn_out, T, room(MT_ACT_ATTN_OUT, i), (int64_t)s.BT * s.attn_width);
    v.mid = LAYER(a->residual_mid, T, room(MT_ACT_RESIDUAL_MID, i), Rh);
    v.ln2 = LAYER(a->ln2, T, room(MT_ACT_LN2, i), Rh);
    v.ln2_mean = a->ln2_mean + room(MT_ACT_LN2_MEAN, i) * s.R;
    v.ln2_rstd = a->ln2_rstd + room(MT_ACT_LN2_RSTD, i) * s.R;
    v.fc1 = LAYER(a->fc1, T, room(MT_ACT_FC1, i), (int64_t)s.BT * s.f1_room);
    v.act = LAYER(a->act, T, room(MT_ACT_ACT, i), (int64_t)s.BT * s.f_room);
    v.out = LAYER(a->residual, T, room(MT_ACT_RESIDUAL, i + 1), Rh);
    const int64_t NE = (int64_t)s.BT * s.E;
    v.moe_logits = a->moe_logits ? a->moe_logits + room(MT_ACT_MOE_LOGITS, i) * NE : NULL;
    v.moe_probs = a->moe_probs ? a->moe_probs + room(MT_ACT_MOE_PROBS, i) * NE : NULL;
    v.moe_row = a->moe_row ? a->moe_row + room(MT_ACT_MOE_ROW, i) * NE : NULL;
    v.moe_token = a->moe_token ? a->moe_token + room(MT_ACT_MOE_TOKEN, i) * s.Rmax : NULL;
    v.moe_row_prob = a->moe_row_prob ? a->moe_row_prob + room(MT_ACT_MOE_ROW_PROB, i) * s.Rmax : NULL;
    v.moe_counts = a->moe_counts ? a->moe_counts + room(MT_ACT_MOE_COUNTS, i) * (2 * s.E + 1) : NULL;
    v.moe_auxw = a->moe_auxw ? a->moe_auxw + room(MT_ACT_MOE_AUXW, i) * s.B * s.E : NULL;
    v.moe_fc1 = a->moe_fc1 ? LAYER(a->moe_fc1, T, room(MT_ACT_MOE_FC1, i), s.Rexp * s.f1e) : NULL;
    v.moe_act = a->moe_act ? LAYER(a->moe_act, T, room(MT_ACT_MOE_ACT, i), s.Rexp * s.fe) : NULL;
    v.moe_ep_in = a->moe_ep_in ? LAYER(a->moe_ep_in, T, room(MT_ACT_MOE_EP_IN, i), s.Rexp * s.h) : NULL;
    v.moe_ep_prob = a->moe_ep_prob ? a->moe_ep_prob + room(MT_ACT_MOE_EP_PROB, i) * s.Rexp : NULL;
    v.moe_ep_counts = a->moe_ep_counts ? a->moe_ep_counts + room(MT_ACT_MOE_EP_COUNTS, i) * s.E : NULL;
    v.moe_shared = a->moe_shared ? LAYER(a->moe_shared, T, room(MT_ACT_MOE_SHARED, i), (int64_t)s.BT * s.h) : NULL;
    v.moe_gate = a->moe_gate ? a->moe_gate + room(MT_ACT_MOE_GATE, i) * s.BT : NULL;
    return v;
}

/* One layer's parameters (E = the model type, in t->params) or gradients (E = float, in t->grads),
 * by name; NULL for a tensor the flavour does not have (biases with --disable-bias-linear, the norm
 * biases with RMSNorm, the query and key norms without --qk-layernorm). Shapes are this TP rank's:
 * qkv_w [qkv_width, h], proj_w [h, heads*d], fc1_w [f1, h], fc2_w [h, f]; norms and row-parallel
 * biases [h]; the query and key norms [d] (whole on every TP rank). */
template <typename E>
struct layer_tensors {
    E *ln1_w, *ln1_b, *qkv_w, *qkv_b, *q_ln_w, *q_ln_b, *k_ln_w, *k_ln_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc1_w,
        *fc1_b, *fc2_w, *fc2_b;
    /* an MoE layer: router [E, h], experts' fc1 [E, f1e, h] and fc2 [E, h, fe], the shared expert's gate [h];
     * its fc1_w / fc2_w above are the shared expert's [f1, h] and [h, f] (NULL without one), the dense MLP
     * that runs beside the experts */
    E *router_w, *router_b, *expert_fc1_w, *expert_fc1_b, *expert_fc2_w, *expert_fc2_b, *shared_gate_w;
};
template <typename E>
static layer_tensors<E> layer_tensors_in(const mt_trainer* t, E* base, int l, bool storage = false) {
    auto at = [&](int which) { /* storage: base is the parameter storage, else a buffer-layout array */
        int64_t offset = storage ? param_storage(t, which, l) : mt_buffer_offset(&t->buffer, which, l);
        return offset < 0 ? (E*)NULL : storage ? (E*)((char*)base + offset) : base + offset;
    };
    const bool moe = mt_moe_layer(&t->cfg, l) != 0;
    return {at(MT_P_LN1_WEIGHT), at(MT_P_LN1_BIAS), at(MT_P_QKV_WEIGHT),  at(MT_P_QKV_BIAS),
            at(MT_P_Q_LAYERNORM_WEIGHT), at(MT_P_Q_LAYERNORM_BIAS), at(MT_P_K_LAYERNORM_WEIGHT),
            at(MT_P_K_LAYERNORM_BIAS),
            at(MT_P_PROJ_WEIGHT), at(MT_P_PROJ_BIAS), at(MT_P_LN2_WEIGHT), at(MT_P_LN2_BIAS),
            at(moe ? MT_P_SHARED_FC1_WEIGHT : MT_P_FC1_WEIGHT), moe ? (E*)NULL : at(MT_P_FC1_BIAS),
            at(moe ? MT_P_SHARED_FC2_WEIGHT : MT_P_FC2_WEIGHT), moe ? (E*)NULL : at(MT_P_FC2_BIAS),
            at(MT_P_ROUTER_WEIGHT), at(MT_P_ROUTER_BIAS), at(MT_P_EXPERT_FC1_WEIGHT), at(MT_P_EXPERT_FC1_BIAS),
            at(MT_P_EXPERT_FC2_WEIGHT), at(MT_P_EXPERT_FC2_BIAS), at(MT_P_SHARED_GATE_WEIGHT)};
}
template <typename T>
static layer_tensors<T> layer_params(const mt_trainer* t, int l) { return layer_tensors_in<T>(t, (T*)t->params, l, true); }
static layer_tensors<float> layer_grads(const mt_trainer* t, int l) { return layer_tensors_in<float>(t, t->grads, l); }

/* One model chunk of this pipeline rank (megatron.h mt_pp_stage): layers [first, first + count),
 * the embeddings when it is virtual stage 0, the final norm, output layer and loss when it is the
 * last. PP = 1: one chunk, the whole model. Its activations are a slot's (layer_activations index
 * l - first). */
typedef struct {
    int first, count;
    bool embedding, head;
} model_chunk;
static model_chunk chunk_of(const mt_trainer* t, int c) {
    const mt_pp_stage* st = &t->buffer.stage;
    const int vp = st->num_chunks;
    model_chunk ch = {st->first_layer[c], st->num_layers[c], st->embedding && c == 0, st->head && c == vp - 1};
    return ch;
}
/* Model layer l of chunk ch in the running slot's activations (the rooms of the recompute setting). */
template <typename T>
static layer_view<T> chunk_layer(const mt_trainer* t, const model_chunk& ch, int l) {
    return layer_activations<T>(&t->act, model_shape(t), &t->cfg.recompute, ch.count, l - ch.first);
}
/* The chunk's output in the running slot: its last layer's output (the final norm's input, or what
 * goes to the next stage), or its input when it has no layers. */
static void* chunk_output(const mt_trainer* t, const model_chunk& ch) {
    const mt_shape s = model_shape(t);
    return LAYER(t->act.residual, char, mt_recompute_position(&t->cfg.recompute, MT_ACT_RESIDUAL, ch.count, ch.count),
                 (int64_t)s.R * s.h * t->elem);
}

/* Context parallelism: the sequence positions of this rank's rows of a sample (megatron.h mt_cp_position):
 * chunks cp_rank and 2 CP - 1 - cp_rank of C = S / 2 rows each; len 0 (row i is position i) at CP = 1. */
static mt_seq_span cp_query_span(const mt_shape& s) {
    mt_seq_span span = {0, {0, 0}};
    if (s.cp == 1) return span;
    span.len = s.S / 2;
    span.start[0] = s.cp_rank * span.len;
    span.start[1] = (2 * s.cp - 1 - s.cp_rank) * span.len;
    return span;
}

/* Dropout sites (section 5): Megatron's embedding dropout (the embeddings' output, --hidden-dropout),
 * attention dropout (the probabilities, --attention-dropout) and hidden dropout of the attention and
 * MLP branches before their residual adds (bias-dropout-add). Only in training (evaluation and
 * inference run without). A site's stream is keyed by (seed, iteration, layer, site): every layer,
 * step and site draws its own mask, and micro-batches differ by their samples' global numbers. Masks
 * are functions of global coordinates, so they are the same at any TP, SP, PP, DP and micro-batch
 * size (Megatron instead seeds TP regions per TP rank: its masks change with the layout; ours do not,
 * so a run at TP 2 matches TP 1 as it does without dropout). */
enum { DROPOUT_EMBEDDING = 0, DROPOUT_ATTENTION = 1, DROPOUT_PROJ = 2, DROPOUT_FC2 = 3 };
static uint64_t dropout_stream(uint64_t seed, int64_t iteration, int layer, int site) {
    uint64_t k = splitmix64(seed ^ 0x64726F706F757421ull); /* "dropout!": apart from the initialisation's */
    k = splitmix64(k ^ (uint64_t)iteration);
    return splitmix64(k ^ (uint64_t)((int64_t)(layer + 1) * 4 + site));
}
/* p -> the 32-bit threshold below which an element is dropped (p < 1, so at most 2^32 - 1) */
static uint32_t dropout_threshold(double p) {
    const double x = floor(p * 4294967296.0 + 0.5);
    return x >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)x;
}
static mt_dropout dropout_site(const mt_trainer* t, const mt_exec* ex, int layer, int site) {
    mt_dropout d = mt_dropout();
    const double p = site == DROPOUT_ATTENTION ? t->cfg.attention_dropout : t->cfg.hidden_dropout;
    if (!ex->mode.training || !(p > 0.0)) return d;
    const mt_shape s = model_shape(t);
    d.on = 1;
    d.threshold = dropout_threshold(p);
    d.scale = (float)(1.0 / (1.0 - p));
    d.key = dropout_stream((uint64_t)t->cfg.seed, t->iteration, layer, site);
    if (site == DROPOUT_ATTENTION) { /* the queries' and keys' sequence positions come with the attention call */
        d.row0 = ex->mode.first_sample;
        d.head0 = s.tp_rank * s.heads; /* whole query groups per rank: its heads are consecutive */
        if (s.cp > 1 && s.cp_comm == MT_CP_A2A) d.head0 += s.cp_rank * (s.heads / s.cp); /* its block of them */
        d.heads = t->cfg.num_attention_heads;
    } else if (s.cp > 1) { /* the rank's rows are two chunks of each sample (with SP, this TP rank's block) */
        const mt_seq_span span = cp_query_span(s);
        d.row0 = ex->mode.first_sample;
        d.cp_len = span.len;
        d.cp_start[0] = span.start[0], d.cp_start[1] = span.start[1];
        d.seq = s.S_full;
        d.cp_row0 = s.sp ? (int64_t)s.tp_rank * s.R : 0;
    } else { /* the norm/residual rows: with SP this rank's block of the micro-batch's B*T rows */
        d.row0 = ex->mode.first_sample * s.S + (s.sp ? (int64_t)s.tp_rank * s.R : 0);
    }
    return d;
}

/* The attention geometry of this rank's rows (section 7), from its shapes, the RoPE tables and the
 * running micro-batch's documents (--reset-position-ids: RoPE's positions; --reset-attention-mask:
 * doc_start). With context parallelism the rows are the rank's two chunks of each sample: their
 * positions are always given (act.docs), the queries' span says where they sit, and the keys are the
 * whole sequence (S_kv, all_gather). */
static mt_attention_dims attention_dims(const mt_trainer* t, const mt_shape& s) {
    const int32_t* docs = t->act.docs;
    mt_attention_dims a = {s.B, s.S, s.heads, s.groups, s.d, s.rot, t->rope_cos, t->rope_sin,
                           mt_explicit_positions(&t->cfg) ? docs + s.BT : (const int32_t*)NULL,
                           t->cfg.reset_attention_mask ? docs : (const int32_t*)NULL};
    if (s.cp > 1) {
        a.q_span = cp_query_span(s);
        a.S_kv = s.S_full;
    }
    return a;
}

/* Context parallelism with a2a (Ulysses): attention runs on the whole sequence of this rank's block of
 * heads / CP query heads (groups / CP K/V groups), rows in sequence order; its shape and geometry, with
 * the whole samples' positions and doc_start (act.docs after the local rows' [2, BT]). */
static mt_shape a2a_shape(const mt_shape& s) {
    mt_shape a = s;
    a.S = s.S_full;
    a.BT = s.B * s.S_full;
    a.heads = s.heads / s.cp;
    a.groups = s.groups / s.cp;
    a.qkv_width = s.qkv_width / s.cp;
    a.attn_width = s.attn_width / s.cp;
    return a;
}
static mt_attention_dims a2a_dims(const mt_trainer* t, const mt_shape& s) {
    const int32_t* whole = t->act.docs + 2 * (int64_t)s.BT; /* [2, B S_full]: doc_start, positions */
    const int64_t BS = (int64_t)s.B * s.S_full;
    return {s.B, s.S_full, s.heads / s.cp, s.groups / s.cp, s.d, s.rot, t->rope_cos, t->rope_sin,
            t->cfg.reset_position_ids ? whole + BS : (const int32_t*)NULL,
            t->cfg.reset_attention_mask ? whole : (const int32_t*)NULL};
}
static bool cp_a2a(const mt_shape& s) { return s.cp > 1 && s.cp_comm == MT_CP_A2A; }
static bool cp_p2p(const mt_shape& s) { return s.cp > 1 && s.cp_comm == MT_CP_P2P; }

/* The row views of one layer's fused QKV rows (query heads, keys, values) and of [BT, heads*d] rows. */
struct qkv_views {
    attn_view q, k, v;
};
static qkv_views qkv_rows_views(const mt_shape& s, void* qkv) {
    int qpg = s.heads / s.groups;
    return {qkv_rows_view((bf16*)qkv, s.S, s.groups, s.d, qpg, 0), qkv_rows_view((bf16*)qkv, s.S, s.groups, s.d, qpg, qpg),
            qkv_rows_view((bf16*)qkv, s.S, s.groups, s.d, qpg, qpg + 1)};
}
static attn_view heads_rows_view(const mt_shape& s, void* rows) {
    return attention_rows_view((bf16*)rows, s.S, s.heads, s.d, s.heads / s.groups);
}

/* ---- Context parallelism's exchanges (the CP group, on the compute stream: attention waits for them).
 * act.cp holds, by --cp-comm-type (megatron.h mt_cp_scratch_bytes):
 *   all_gather: kfull, vfull [B, groups, S_full, d], dkfull, dvfull (the same), xfer [2, CP, B, groups, S, d];
 *   a2a: qkv [B S_full, qkv_width / CP] (the whole sequence of this rank's head block), dqkv (the same),
 *        o, dO [B S_full, attn_width / CP], xfer [B S, qkv_width] (as many elements as qkv).
 * all_gather: every rank's K and V (after RoPE) gathered and put in sequence order; the keys' and values'
 * gradients of the whole sequence put back in rank order and reduce-scattered, each rank keeping the sum
 * over the group of its own rows'. a2a: this rank's rows of every head block out, the whole sequence of its
 * own head block in (and back), by NCCL send/receive pairs in one group. ---- */
template <typename T>
struct cp_buffers {
    T *kfull, *vfull, *dkfull, *dvfull;    /* all_gather */
    T *qkv, *dqkv, *o, *dout;              /* a2a */
    T* xfer;
};
template <typename T>
static cp_buffers<T> cp_scratch(const mt_trainer* t, const mt_shape& s) {
    cp_buffers<T> b = {};
    T* base = (T*)t->act.cp;
    if (s.cp_comm == MT_CP_ALL_GATHER) {
        const int64_t n = (int64_t)s.B * s.groups * s.S_full * s.d;
        b.kfull = base, b.vfull = base + n, b.dkfull = base + 2 * n, b.dvfull = base + 3 * n, b.xfer = base + 4 * n;
    } else if (s.cp_comm == MT_CP_A2A) {
        const int64_t W = (int64_t)s.BT * s.qkv_width, A = (int64_t)s.BT * s.attn_width;
        b.qkv = base, b.dqkv = base + W, b.o = base + 2 * W, b.dout = base + 2 * W + A, b.xfer = base + 2 * W + 2 * A;
    }
    return b;
}

/* all_gather: k, v [B, groups, S, d] of every CP rank -> kfull, vfull [B, groups, S_full, d] in sequence order */
template <typename T>
static void cp_gather_kv(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const T* k, const T* v, T* kfull,
                         T* vfull, T* xfer) {
    const size_t n = (size_t)s.B * s.groups * s.S * s.d;
    mt_process_groups* g = &t->groups;
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupStart());
    NCCL_CHECK(ex->error, t->cfg.rank, ncclAllGather(k, xfer, n, g->tp.type, g->cp, ex->stream));
    NCCL_CHECK(ex->error, t->cfg.rank, ncclAllGather(v, xfer + s.cp * n, n, g->tp.type, g->cp, ex->stream));
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupEnd());
    cp_chunks_full<T>(ex, kfull, xfer, s.B * s.groups, s.S, s.d, s.cp, true);
    cp_chunks_full<T>(ex, vfull, xfer + s.cp * n, s.B * s.groups, s.S, s.d, s.cp, true);
}
/* all_gather's backward: dk, dv [B, groups, S, d] = the sum over the CP group of every rank's dkfull, dvfull
 * rows of this rank's chunks */
template <typename T>
static void cp_reduce_scatter_kv(mt_trainer* t, const mt_exec* ex, const mt_shape& s, T* dk, T* dv, T* dkfull,
                                 T* dvfull, T* xfer) {
    const size_t n = (size_t)s.B * s.groups * s.S * s.d;
    mt_process_groups* g = &t->groups;
    cp_chunks_full<T>(ex, dkfull, xfer, s.B * s.groups, s.S, s.d, s.cp, false);
    cp_chunks_full<T>(ex, dvfull, xfer + s.cp * n, s.B * s.groups, s.S, s.d, s.cp, false);
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupStart());
    NCCL_CHECK(ex->error, t->cfg.rank, ncclReduceScatter(xfer, dk, n, g->tp.type, ncclSum, g->cp, ex->stream));
    NCCL_CHECK(ex->error, t->cfg.rank,
               ncclReduceScatter(xfer + s.cp * n, dv, n, g->tp.type, ncclSum, g->cp, ex->stream));
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupEnd());
}
/* send [CP, n] -> recv [CP, n]: block j to CP rank j, block r from CP rank r */
template <typename T>
static void cp_all_to_all(mt_trainer* t, const mt_exec* ex, const T* send, T* recv, size_t n) {
    mt_process_groups* g = &t->groups;
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupStart());
    for (int j = 0; j < g->cp_size; j++) {
        NCCL_CHECK(ex->error, t->cfg.rank, ncclSend(send + j * n, n, g->tp.type, j, g->cp, ex->stream));
        NCCL_CHECK(ex->error, t->cfg.rank, ncclRecv(recv + j * n, n, g->tp.type, j, g->cp, ex->stream));
    }
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupEnd());
}
/* a2a: rows [BT, CP Wj] (this rank's rows, every head block) -> full [B, S_full, Wj] (every row of head block
 * cp_rank); send and recv: [CP, BT, Wj] each */
template <typename T>
static void cp_a2a_to_full(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const T* rows, T* full, int Wj, T* send,
                           T* recv) {
    cp_rows_blocks<T>(ex, (T*)rows, send, s.BT, Wj, s.cp, true);
    cp_all_to_all<T>(t, ex, send, recv, (size_t)s.BT * Wj);
    cp_chunks_full<T>(ex, full, recv, s.B, s.S, Wj, s.cp, true);
}
/* the reverse: full [B, S_full, Wj] (head block cp_rank) -> rows [BT, CP Wj] */
template <typename T>
static void cp_a2a_to_rows(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const T* full, T* rows, int Wj, T* send,
                           T* recv) {
    cp_chunks_full<T>(ex, (T*)full, send, s.B, s.S, Wj, s.cp, false);
    cp_all_to_all<T>(t, ex, send, recv, (size_t)s.BT * Wj);
    cp_rows_blocks<T>(ex, rows, recv, s.BT, Wj, s.cp, false);
}

/* Exact path with grouped K/V: the heads of one group are adjacent in q [B, heads, T, d], so per
 * (batch, group) Q is one [qpg*T, d] matrix against that group's K [Tk, d]. Every GEMM is batched
 * over B*groups with M = qpg*T; the scores [B*groups, qpg*T, Tk] are the same memory as
 * [B*heads, T, Tk], so the softmax kernels see one row per (head, query). dK and dV come out summed
 * over the group's heads by the GEMMs themselves. The probabilities are kept in probs [B*heads, T, Tk].
 * Tk = T, except with context parallelism's all_gather: the T local queries against the whole
 * sequence's Tk = S_full keys. */

/* The QKV rows layer l's attention reads: the kept qkv itself, or with --qk-layernorm its q and k
 * heads normalised into act.qk_norm (v copied) and their statistics into act.qk_stats (section 7).
 * The kept qkv stays the QKV linear's output; the backward makes the normalised rows again. */
template <typename T>
static T* attention_input(mt_trainer* t, const mt_exec* ex, T* qkv, int layer) {
    const mt_shape s = model_shape(t);
    if (!s.qk_norm) return qkv;
    const layer_tensors<T> p = layer_params<T>(t, layer);
    qk_norm_forward<T>(ex, attention_dims(t, s), (T*)t->act.qk_norm, t->act.qk_stats, qkv, p.q_ln_w, p.q_ln_b, p.k_ln_w,
                       p.k_ln_b, (float)t->cfg.norm_epsilon, s.rms, s.norm_w1);
    return (T*)t->act.qk_norm;
}

/* The exact path's q, k, v of rows [B*S, qkv_width] at geometry (s, dims) in the scratch (RoPE applied);
 * with all_gather (dims.S_kv > 0) K and V of the whole sequence gathered into the CP buffers. Returns the
 * keys' rows per sample and points *K, *V at the keys and values the scores use. */
template <typename T>
static int exact_qkv(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const mt_attention_dims& dims, const T* rows,
                     T** K, T** V) {
    mt_activations* a = &t->act;
    split_qkv<T>(ex, dims, (T*)a->q, (T*)a->k, (T*)a->v, rows);
    *K = (T*)a->k, *V = (T*)a->v;
    if (dims.S_kv == 0) return s.S;
    const cp_buffers<T> cb = cp_scratch<T>(t, s);
    cp_gather_kv<T>(t, ex, s, (T*)a->k, (T*)a->v, cb.kfull, cb.vfull, cb.xfer);
    *K = cb.kfull, *V = cb.vfull;
    return dims.S_kv;
}

/* Exact path at geometry (s, dims): q, k, v from rows and probs = the causal softmax of Q K^T / sqrt(d) per
 * (batch, group); returns the keys per sample and their K, V (exact_qkv). */
template <typename T>
static int exact_probabilities(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const mt_attention_dims& dims,
                               const T* rows, T* probs, T** K, T** V) {
    const int Sk = exact_qkv<T>(t, ex, s, dims, rows, K, V);
    int batch = s.B * s.groups, M = (s.heads / s.groups) * s.S;
    int64_t qd = (int64_t)M * s.d, kd = (int64_t)Sk * s.d, qs = (int64_t)M * Sk;
    gemm<T, T>(ex, false, true, M, Sk, s.d, (T*)t->act.q, s.d, *K, s.d, probs, Sk, 1.0f, 0.0f, batch, qd, kd, qs);
    causal_softmax_forward<T>(ex, probs, s.B * s.heads * s.S, s.S, 1.0f / sqrtf((float)s.d), dims.doc_start, s.heads, Sk,
                              dims.q_span);
    return Sk;
}

/* Exact path: layer l's probabilities (its q and k normalised first with --qk-layernorm) at this rank's
 * geometry: the forward's first half, and what selective recompute of core_attn replays before the
 * backward. With a2a the rows go out first (the whole sequence of this rank's head block). */
template <typename T>
static void attention_probabilities(mt_trainer* t, const mt_exec* ex, T* qkv, T* probs, int layer) {
    mt_shape s = model_shape(t);
    T* rows = attention_input<T>(t, ex, qkv, layer);
    T *K, *V;
    if (cp_a2a(s)) {
        const cp_buffers<T> cb = cp_scratch<T>(t, s);
        const mt_shape sa = a2a_shape(s);
        cp_a2a_to_full<T>(t, ex, s, rows, cb.qkv, sa.qkv_width, cb.dqkv, cb.xfer);
        exact_probabilities<T>(t, ex, sa, a2a_dims(t, s), cb.qkv, probs, &K, &V);
    } else {
        exact_probabilities<T>(t, ex, s, attention_dims(t, s), rows, probs, &K, &V);
    }
}

/* Exact path's second half at geometry (s, dims): out rows [B*S, heads*d] = dropout(P) V (the dropped
 * probabilities in the dscores scratch; P is kept) */
template <typename T>
static void exact_output(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const mt_attention_dims& dims,
                         const T* probs, const T* V, int Sk, const mt_dropout& drop, T* out) {
    mt_activations* a = &t->act;
    int batch = s.B * s.groups, M = (s.heads / s.groups) * s.S;
    int64_t qd = (int64_t)M * s.d, kd = (int64_t)Sk * s.d, qs = (int64_t)M * Sk;
    const T* pv = probs;
    if (drop.on)
        attention_dropout<T>(ex, (T*)a->dscores, probs, s.B * s.heads * s.S, s.S, drop, s.heads, Sk, dims.q_span),
            pv = (T*)a->dscores;
    gemm<T, T>(ex, false, false, M, s.d, Sk, pv, Sk, V, s.d, (T*)a->o, s.d, 1.0f, 0.0f, batch, qs, kd, qd);
    permute_heads<T>(ex, dims, out, (T*)a->o, true);
}

/* Exact path's backward at geometry (s, dims): dqkv rows from dout rows [B*S, heads*d], the rows, and the
 * probabilities (q, k, v and with all_gather the whole K and V made again; their gradients reduce-scattered). */
template <typename T>
static void exact_backward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const mt_attention_dims& dims, T* dqkv,
                           const T* dout, const T* rows, T* probs, const mt_dropout& drop) {
    mt_activations* a = &t->act;
    permute_heads<T>(ex, dims, (T*)a->o, dout, false);
    T *K, *V;
    const int Sk = exact_qkv<T>(t, ex, s, dims, rows, &K, &V);
    const cp_buffers<T> cb = cp_scratch<T>(t, s);
    T* dK = dims.S_kv > 0 ? cb.dkfull : (T*)a->dk;
    T* dV = dims.S_kv > 0 ? cb.dvfull : (T*)a->dv;
    int batch = s.B * s.groups, M = (s.heads / s.groups) * s.S;
    int64_t qd = (int64_t)M * s.d, kd = (int64_t)Sk * s.d, qs = (int64_t)M * Sk;
    /* dV = P^T dO (with attention dropout P_d^T dO, P_d regenerated into dscores first);  dP = dO V^T */
    if (drop.on) attention_dropout<T>(ex, (T*)a->dscores, probs, s.B * s.heads * s.S, s.S, drop, s.heads, Sk, dims.q_span);
    gemm<T, T>(ex, true, false, Sk, s.d, M, drop.on ? (T*)a->dscores : probs, Sk, (T*)a->o, s.d, dV, s.d, 1.0f, 0.0f,
               batch, qs, qd, kd);
    gemm<T, T>(ex, false, true, M, Sk, s.d, (T*)a->o, s.d, V, s.d, (T*)a->dscores, Sk, 1.0f, 0.0f, batch, qd, kd, qs);
    causal_softmax_backward<T>(ex, (T*)a->dscores, probs, s.B * s.heads * s.S, s.S, 1.0f / sqrtf((float)s.d), drop,
                               s.heads, dims.doc_start, Sk, dims.q_span);
    /* dK = dS^T Q (before dQ overwrites q);  dQ = dS K */
    gemm<T, T>(ex, true, false, Sk, s.d, M, (T*)a->dscores, Sk, (T*)a->q, s.d, dK, s.d, 1.0f, 0.0f, batch, qs, qd, kd);
    gemm<T, T>(ex, false, false, M, s.d, Sk, (T*)a->dscores, Sk, K, s.d, (T*)a->q, s.d, 1.0f, 0.0f, batch, qs, kd, qd);
    if (dims.S_kv > 0) cp_reduce_scatter_kv<T>(t, ex, s, (T*)a->dk, (T*)a->dv, dK, dV, cb.xfer);
    merge_qkv_grads<T>(ex, dims, dqkv, (T*)a->q, (T*)a->dk, (T*)a->dv);
}

/* One layer's attention: qkv [BT, qkv_width] (the QKV linear's output) -> attn [BT, heads*d].
 * Flash path: only the log-sum-exp lse [B*heads, T] is kept; exact path: the probabilities. The flash
 * path rotates q and k in place in the rows it reads: the kept qkv, or with --qk-layernorm the
 * normalised rows in the scratch. Context parallelism: all_gather on the exact path (the keys and
 * values gathered inside); a2a moves the rows to the whole sequence of this rank's head block, runs
 * the attention of CP = 1 there (flash: rotating that copy, the kept qkv stays unrotated) and moves
 * the output back. */
template <typename T>
static void attention_forward(mt_trainer* t, const mt_exec* ex, T* qkv, T* probs, float* lse, T* attn, int layer) {
    mt_shape s = model_shape(t);
    mt_attention_dims dims = attention_dims(t, s);
    const mt_dropout drop = dropout_site(t, ex, layer, DROPOUT_ATTENTION);
    const bool a2a = cp_a2a(s);
    const cp_buffers<T> cb = cp_scratch<T>(t, s);
    const mt_shape sa = a2a ? a2a_shape(s) : s;
    const mt_attention_dims da = a2a ? a2a_dims(t, s) : dims;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        if (t->flash) {
            T* rows = attention_input<T>(t, ex, qkv, layer);
            T* out = attn;
            if (a2a) {
                cp_a2a_to_full<T>(t, ex, s, rows, cb.qkv, sa.qkv_width, cb.dqkv, cb.xfer);
                rows = cb.qkv, out = cb.o;
            }
            rope_qkv_rows<T>(ex, da, rows, false);
            qkv_views in = qkv_rows_views(sa, rows);
            if (cp_p2p(s)) /* the ring over the CP group (section 9.5); its scratch is act.cp */
                cp_ring_attention_forward(ex, &t->groups.cp_ring, heads_rows_view(s, out), lse, cview(in.q),
                                          cview(in.k), cview(in.v), s.B, s.heads, s.groups, s.S, s.d, drop,
                                          dims.doc_start, t->act.cp, t->act.cp_bytes,
                                          t->attn_fwd == MT_ATTN_FWD_FA2 ? NULL : &t->gemm.hopper);
            else /* section 13.2's forward where it runs and fits, else section 9's (a2a: the whole sequence of this
                  * rank's heads, a plain causal call) */
                CUDA_CHECK(ex->error, attention_forward_fast(&t->gemm.hopper, t->attn_fwd,
                                                             heads_rows_view(sa, out), lse, cview(in.q), cview(in.k),
                                                             cview(in.v), sa.B, sa.heads, sa.groups, sa.S, sa.d,
                                                             ex->stream, drop, da.doc_start));
            if (a2a) cp_a2a_to_rows<T>(t, ex, s, cb.o, attn, sa.attn_width, cb.dout, cb.xfer);
            return;
        }
    }
    T *K, *V;
    T* rows = attention_input<T>(t, ex, qkv, layer);
    if (a2a) {
        cp_a2a_to_full<T>(t, ex, s, rows, cb.qkv, sa.qkv_width, cb.dqkv, cb.xfer);
        const int Sk = exact_probabilities<T>(t, ex, sa, da, cb.qkv, probs, &K, &V);
        exact_output<T>(t, ex, sa, da, probs, V, Sk, drop, cb.o);
        cp_a2a_to_rows<T>(t, ex, s, cb.o, attn, sa.attn_width, cb.dout, cb.xfer);
        return;
    }
    const int Sk = exact_probabilities<T>(t, ex, s, dims, rows, probs, &K, &V);
    exact_output<T>(t, ex, s, dims, probs, V, Sk, drop, attn);
}

/* Backward of one layer's attention: dattn [BT, heads*d] -> dqkv [BT, qkv_width], from the saved qkv,
 * probs or lse, and attn (the flash backward needs O). With dbias (the QKV bias gradient; may be
 * NULL), the flash path without RoPE, without --qk-layernorm and without a2a also takes dbias += the
 * column sums of dqkv from the kernels' own registers (one read of [BT, qkv_width] less than a column
 * sum) and returns true; otherwise the caller sums them. With --qk-layernorm the normalised rows are
 * made again from the kept qkv (the forward's kernels on the same inputs: its bits), attention's
 * gradient reaches them, and the norms' backward takes it to the QKV linear's output, writing the
 * norms' weight and bias gradients. a2a: the rows, O and dO go out again, the gradient comes back. */
template <typename T>
static bool attention_backward(mt_trainer* t, const mt_exec* ex, T* dqkv, const T* dattn, T* qkv, T* probs,
                               const float* lse, const T* attn, float* dbias, int layer) {
    mt_shape s = model_shape(t);
    mt_attention_dims dims = attention_dims(t, s);
    mt_activations* a = &t->act;
    const mt_dropout drop = dropout_site(t, ex, layer, DROPOUT_ATTENTION);
    const bool a2a = cp_a2a(s);
    const cp_buffers<T> cb = cp_scratch<T>(t, s);
    const mt_shape sa = a2a ? a2a_shape(s) : s;
    const mt_attention_dims da = a2a ? a2a_dims(t, s) : dims;
    T* rows = attention_input<T>(t, ex, qkv, layer); /* qkv, or its normalised q and k (v copied) */
    bool sums = false;
    bool done = false;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        if (t->flash) {
            const int chunks = flash_colsum_chunks(s.B, s.S);
            /* section 13.3's backward where it runs and fits (the p2p ring chooses its own steps, section 13.4);
             * it has no column sums, so the QKV bias gradient is then summed by the caller */
            mt_hopper_gemm_state* hopper = cp_p2p(s) ? NULL : &t->gemm.hopper;
            const bool fa3_bwd = hopper_backward_wanted(hopper, t->attn_bwd, sa.d, drop, da.doc_start);
            sums = dbias && s.rot == 0 && !s.qk_norm && !a2a && !cp_p2p(s) && !fa3_bwd && chunks <= t->colsum.max_chunks;
            T *in_rows = rows, *out_rows = dqkv;
            const T *o_rows = attn, *do_rows = dattn;
            if (a2a) { /* the forward's rows (unrotated: it rotated its copy), O and dO of the whole sequence */
                cp_a2a_to_full<T>(t, ex, s, rows, cb.qkv, sa.qkv_width, cb.dqkv, cb.xfer);
                cp_a2a_to_full<T>(t, ex, s, attn, cb.o, sa.attn_width, cb.dout, cb.xfer);
                cp_a2a_to_full<T>(t, ex, s, dattn, cb.dout, sa.attn_width, cb.dqkv, cb.xfer);
                in_rows = cb.qkv, out_rows = cb.dqkv, o_rows = cb.o, do_rows = cb.dout;
            }
            if (s.qk_norm || a2a) rope_qkv_rows<T>(ex, da, in_rows, false); /* as the forward read them */
            qkv_views in = qkv_rows_views(sa, in_rows), out = qkv_rows_views(sa, out_rows);
            if (cp_p2p(s))
                cp_ring_attention_backward(ex, &t->groups.cp_ring, out.q, out.k, out.v, a->dsum,
                                           cview(heads_rows_view(s, (void*)do_rows)), cview(in.q), cview(in.k),
                                           cview(in.v), cview(heads_rows_view(s, (void*)o_rows)), lse, s.B, s.heads,
                                           s.groups, s.S, s.d, drop, dims.doc_start, t->act.cp,
                                           t->act.cp_bytes, t->attn_bwd == MT_ATTN_BWD_FA2 ? NULL : &t->gemm.hopper);
            else
                CUDA_CHECK(ex->error, attention_backward_fast(hopper, t->attn_bwd, out.q, out.k, out.v, a->dsum,
                                                              cview(heads_rows_view(sa, (void*)do_rows)), cview(in.q),
                                                              cview(in.k), cview(in.v),
                                                              cview(heads_rows_view(sa, (void*)o_rows)), lse, sa.B,
                                                              sa.heads, sa.groups, sa.S, sa.d, ex->stream,
                                                              sums ? t->colsum.partial_a : (float*)NULL, drop,
                                                              da.doc_start));
            rope_qkv_rows<T>(ex, da, out_rows, true);
            if (a2a) cp_a2a_to_rows<T>(t, ex, s, cb.dqkv, dqkv, sa.qkv_width, cb.qkv, cb.xfer);
            if (sums) column_final_sums(ex, 1, chunks, s.qkv_width, dbias, t->colsum.partial_a);
            done = true;
        }
    }
    if (!done) {
        if (a2a) {
            cp_a2a_to_full<T>(t, ex, s, rows, cb.qkv, sa.qkv_width, cb.dqkv, cb.xfer);
            cp_a2a_to_full<T>(t, ex, s, dattn, cb.dout, sa.attn_width, cb.dqkv, cb.xfer);
            exact_backward<T>(t, ex, sa, da, cb.dqkv, cb.dout, cb.qkv, probs, drop);
            cp_a2a_to_rows<T>(t, ex, s, cb.dqkv, dqkv, sa.qkv_width, cb.qkv, cb.xfer);
        } else {
            exact_backward<T>(t, ex, s, dims, dqkv, dattn, rows, probs, drop);
        }
    }
    if (s.qk_norm) { /* dqkv holds the normalised q and k's gradient: through the norms */
        const layer_tensors<T> p = layer_params<T>(t, layer);
        const layer_tensors<float> dp = layer_grads(t, layer);
        qk_norm_backward<T>(ex, dims, dqkv, qkv, a->qk_stats, p.q_ln_w, p.k_ln_w, dp.q_ln_w, dp.q_ln_b, dp.k_ln_w,
                            dp.k_ln_b, t->colsum.partial_a, t->colsum.partial_b, t->colsum.max_chunks, s.rms,
                            s.norm_w1);
    }
    return sums;
}

/* The data-parallel hooks the model calls (section 19): the forward waits for each layer's
 * parameters when the last step's all-gather still runs; the backward reports each layer whose
 * gradients are final, so full buckets can start their reduction (when the micro-batch's mode says
 * so). Layer -1 is the embeddings, layer L the final norm and output layer. */
static void wait_for_parameters(mt_trainer* t, int layer);
static void fp8_publish_parameters(mt_trainer* t); /* section 19: --fp8-param-gather's cast and all-gather */
static void gradients_ready(mt_trainer* t, const mt_exec* ex, int layer);

/* FP8 (--fp8-format): layer l's four linears as FP8 operands (false for a bf16 layer), with their
 * weights' FP8 copies made first when the parameters changed since the last cast (once per
 * optimizer step: the forward of the step's first micro-batch, after the layer's parameters are
 * all-gathered; with --fp8-param-gather W is the gathered FP8 parameter itself and only W^T is
 * made, from its bytes). Weight shapes are this TP rank's: qkv [qkv_width, h], proj [h, heads*d],
 * fc1 [f1, h], fc2 [h, f]. */
/* Floats of a block-scale array of a tensor [rows, cols], rounded up to 16 bytes (the next array
 * stays aligned for cuBLASLt). */
static int64_t fp8_block_scales(mt_fp8_scaling_mode m, int rows, int cols) {
    return (fp8_scale_inv_count(m, rows, cols) + 3) / 4 * 4;
}
static void fp8_linear_dims(const mt_shape& s, int linear, int* out, int* in) {
    const int dims[FP8_LINEARS][2] = {{s.qkv_width, s.h}, {s.h, s.attn_width}, {s.f1, s.h}, {s.h, s.f}};
    *out = dims[linear][0];
    *in = dims[linear][1];
}
template <typename T>
static bool fp8_layer_linears(mt_trainer* t, const mt_exec* ex, int l, bool cast_weights, fp8_linear* L) {
    mt_fp8_state* f = &t->fp8;
    if (!f->enabled || f->slot_of_layer[l] < 0) return false;
    const mt_shape s = model_shape(t);
    const int slot = f->slot_of_layer[l];
    const layer_tensors<T> p = layer_params<T>(t, l);
    const T* weights[FP8_LINEARS] = {p.qkv_w, p.proj_w, p.fc1_w, p.fc2_w}; /* FP8 bytes with param_gather */
    uint8_t* w8 = f->weights + (int64_t)slot * f->weights_per_layer;
    float* wb = f->weight_blocks ? f->weight_blocks + (int64_t)slot * f->weight_blocks_per_layer : NULL;
    for (int k = 0; k < FP8_LINEARS; k++) {
        int out, in;
        fp8_linear_dims(s, k, &out, &in);
        L[k] = fp8_linear(); /* x8_ready, x8t_ready 0 */
        L[k].f = f;
        L[k].tensor = (slot * FP8_LINEARS + k) * FP8_ROLES;
        L[k].w8 = f->param_gather ? (const uint8_t*)weights[k] : w8;
        L[k].w8t = f->param_gather ? w8 : w8 + (int64_t)out * in;
        L[k].w8_blocks = wb;
        L[k].w8t_blocks = wb ? wb + fp8_block_scales(FP8_BLOCKS_128x128, out, in) : NULL;
        L[k].record_amax = ex->mode.training;
        L[k].fresh_backward_input = f->recipe == MT_FP8_TENSORWISE && t->groups.pp_size > 1;
        if (cast_weights && f->param_gather) { /* W gathered in FP8 (fp8_publish_parameters): W^T from its bytes */
            fp8_transpose(ex, (uint8_t*)L[k].w8t, L[k].w8, out, in);
        } else if (cast_weights) {
            if (f->recipe == MT_FP8_BLOCKWISE) {
                fp8_cast_blockwise<T>(ex, f->fwd, (uint8_t*)L[k].w8, (uint8_t*)L[k].w8t, (float*)L[k].w8_blocks,
                                      (float*)L[k].w8t_blocks, weights[k], out, in, FP8_BLOCKS_128x128, true);
            } else if (f->recipe == MT_FP8_TENSORWISE) {
                mt_fp8_scaling ws = fp8_slot(&L[k], FP8_W);
                fp8_quantize_tensorwise<T>(ex, f->fwd, &ws, f->margin, (uint8_t*)L[k].w8, (uint8_t*)L[k].w8t,
                                           weights[k], out, in);
            } else { /* delayed: the weights' amax is recorded whenever they are cast */
                mt_fp8_scaling ws = fp8_slot(&L[k], FP8_W);
                fp8_cast_transpose<T>(ex, f->fwd, (uint8_t*)L[k].w8, (uint8_t*)L[k].w8t, weights[k], out, in, ws.scale,
                                      ws.amax, true);
            }
        }
        w8 += (f->param_gather ? 1 : 2) * (int64_t)out * in;
        if (wb) wb += fp8_block_scales(FP8_BLOCKS_128x128, out, in) + fp8_block_scales(FP8_BLOCKS_128x128, in, out);
    }
    return true;
}

/* The output layer's weight: the word embeddings (tied, GPT-2's default) or its own (untied). */
template <typename T>
static T* output_weight(mt_trainer* t) {
    T* w = param_ptr<T>(t, MT_P_OUTPUT_WEIGHT);
    return w ? w : param_ptr<T>(t, MT_P_WORD_EMBEDDINGS);
}
static float* output_weight_grad(mt_trainer* t) {
    float* w = grad_ptr(t, MT_P_OUTPUT_WEIGHT);
    return w ? w : grad_ptr(t, MT_P_WORD_EMBEDDINGS);
}

/* GELU through cuBLASLt's epilogues: in bf16/fp16, where the epilogue's own GELU is within the
 * storage type's rounding; fp32 keeps the kernels (its parity with the float64 reference is 1e-7).
 * cuBLASLt has no squared ReLU epilogue: --squared-relu takes the kernels in every precision. */
template <typename T>
static bool gelu_fused(const mt_shape& s) {
    return !s.swiglu && s.act == ACT_GELU && sizeof(T) == 2;
}

/* Vocab-parallel cross entropy over this rank's logits [BT, V] (section 10); at TP = 1 the one
 * fused kernel. Per-token losses (the same on every TP rank) go to act.losses; when grad_scale != 0
 * the logits are overwritten by their gradient. */
template <typename T>
static void cross_entropy(mt_trainer* t, const mt_exec* ex, float grad_scale) {
    mt_shape s = model_shape(t);
    mt_activations* a = &t->act;
    if (s.tp == 1) {
        cross_entropy_fused<T>(ex, (T*)a->logits, a->losses, a->targets, s.BT, (int)s.V, grad_scale);
        return;
    }
    /* V = Vp / tp is a multiple of 128, so the 16-byte kernels always apply */
    float* mine = a->ce_stats + (int64_t)s.tp_rank * s.BT * 3;
    cross_entropy_partial<T>(ex, mine, (const T*)a->logits, a->targets, s.BT, (int)s.V, s.vocab_start);
    tp_all_gather(&t->groups.tp, a->ce_stats, mine, (size_t)s.BT * 3, ncclFloat);
    tp_join(&t->groups.tp);
    cross_entropy_combine<T>(ex, (T*)a->logits, a->losses, a->ce_stats, s.tp, s.BT, a->targets, (int)s.V,
                             s.vocab_start, grad_scale);
}

/* The MLP's activation: act = GELU, squared ReLU or SwiGLU of the pre-activation fc1, the bias (may
 * be NULL) added into fc1 first; with act8.q also act's FP8 bytes for fc2 (returns whether written). */
template <typename T>
static bool mlp_activation(const mt_exec* ex, const mt_shape& s, const layer_view<T>& v, const T* bias,
                           const fp8_out& act8 = fp8_out()) {
    if (s.swiglu) return bias_swiglu<T>(ex, v.fc1, v.act, bias, s.BT, s.f, act8);
    return bias_activation<T>(ex, s.act, v.fc1, v.act, bias, s.BT, s.f, act8);
}
/* The MLP's first linear and its activation: fc1 = ln2_in W1^T + b, act = its GELU, squared ReLU or
 * SwiGLU (bf16 and fp16 GELU: one cuBLASLt GEMM whose epilogue applies GELU and keeps fc1 as its aux
 * output; FP8 the same, the FP8 GEMM's epilogue, where cuBLASLt has it; squared ReLU and SwiGLU: the
 * GEMM (FP8 or not), then the kernel). act8: FP8 bytes of act for fc2 where the kernel makes act
 * (returns whether they were written; never from a GEMM's epilogue). */
template <typename T>
static bool mlp_up_forward(const mt_exec* ex, const mt_shape& s, const layer_view<T>& v, const layer_tensors<T>& p,
                           const T* ln2_in, const fp8_linear* f8, const fp8_out& act8 = fp8_out()) {
    if (!f8 && gelu_fused<T>(s) &&
        gemm_epilogue<T, T>(ex, GEMM_GELU_AUX_BIAS, false, true, s.BT, s.f, s.h, ln2_in, s.h, p.fc1_w, s.h, v.act, s.f,
                            1.0f, 0.0f, p.fc1_b, v.fc1))
        return false;
    if (f8 && gelu_fused<T>(s)) { /* the epilogue, else fc1 without the bias from the same cast */
        if (!fp8_linear_forward<T>(ex, f8, v.act, ln2_in, p.fc1_b, s.BT, s.h, s.f, v.fc1))
            return mlp_activation<T>(ex, s, v, p.fc1_b, act8);
        return false;
    }
    linear_forward<T>(ex, v.fc1, ln2_in, p.fc1_w, (const T*)NULL, s.BT, s.h, s.f1, f8);
    return mlp_activation<T>(ex, s, v, p.fc1_b, act8);
}

/* ---- Mixture of experts (Megatron-Core's MoELayer; dev/moe_semantics.md states it, dev/ref_moe.py computes
 * it) ----
 * An MoE layer's MLP block on its input x = norm2(mid) [N, h], N = BT tokens: the router's logits in fp32
 * (x and the weight widened to fp32: Megatron's --moe-router-dtype fp32; with the default router dtype of a
 * bf16 model the logits are then rounded to bf16 as Megatron computes them), top-k routing with capacity
 * and dropping (section 14's moe_route), the aux losses' statistics, the layer's rows permuted into expert
 * order, each expert's two GEMMs on its rows (the row counts read back to the host once per layer and pass,
 * as Megatron's dropless dispatcher does), the activation (SwiGLU, or the model's GELU) times the row's
 * probability (with --add-bias-linear: the router's bias on the logits, each expert's fc1 bias before the
 * activation and its fc2 bias times the row's probability, as Megatron's experts), the rows summed back per
 * token (ascending expert: no atomics), plus the shared expert (this layer's dense MLP, run by the dense
 * code on fc1_w / fc2_w) under its optional sigmoid gate. The aux losses enter the backward as gradients
 * of the router's logits scaled like the micro-batch's loss (ex->mode.moe_loss_scale). */

/* The experts' activation: the model's (SwiGLU, else the dense MLP's GELU or squared ReLU). */
static int moe_act_kind(const mt_shape& s) { return s.swiglu ? MOE_ACT_SWIGLU : s.act; }

/* The routing settings of the config, for a micro-batch of s.BT tokens. */
static moe_routing moe_routing_of(const mt_trainer* t, const mt_shape& s) {
    const mt_config* c = &t->cfg;
    moe_routing r;
    memset(&r, 0, sizeof(r));
    r.N = s.BT, r.B = s.B, r.T = s.S, r.E = s.E, r.k = s.k;
    r.sigmoid = c->moe_router_score_sigmoid != 0;
    r.pre_softmax = c->moe_router_pre_softmax != 0;
    r.scaling = (float)c->moe_router_topk_scaling_factor;
    r.num_groups = c->moe_router_num_groups;
    r.group_topk = c->moe_router_group_topk;
    r.round_bf16 = c->precision == MT_BF16 && !c->moe_router_dtype_fp32;
    r.capacity = (int)mt_moe_capacity(c, s.BT);
    r.drop_position = c->moe_token_drop_position != 0;
    r.pad = c->moe_pad_expert_input_to_capacity != 0;
    return r;
}

/* The aux losses' coefficients that are on (0: off). */
static float moe_aux_coef(const mt_config* c, int bit) {
    const int index = bit == MT_MOE_AUX_LOSS ? 0 : bit == MT_MOE_SEQ_AUX_LOSS ? 1 : 2;
    return (c->moe_load_balancing & bit) ? (float)c->moe_aux_loss_coeff[index] : 0.0f;
}

/* One layer's rows per expert and offsets, read back to the host (pinned; the stream synchronised). */
static const int32_t* moe_host_counts(mt_trainer* t, const int32_t* device_counts, int E) {
    CUDA_CHECK(&t->error, cudaMemcpyAsync(t->moe.host_counts, device_counts, sizeof(int32_t) * (2 * (size_t)E + 1),
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return t->moe.host_counts;
}

/* The experts' GEMMs of one layer, the experts without rows left out, by one of three paths (moe_gemm_path):
 * - grouped: one cuBLAS grouped call (gemm_grouped), where cuBLAS has the types (C in the inputs' type: its
 *   grouped GEMM refuses bf16 x bf16 -> fp32, so the bf16 weight gradients, accumulated in fp32, never take it);
 * - loop: one cuBLAS GEMM per expert (gemm_uncached) on the compute stream;
 * - streams: the loop's GEMMs, each the same gemm_uncached call, spread over MOE_SIDE_STREAMS side streams (in
 *   expert order, each to the stream with the least work so far) forked from the compute stream by one event
 *   and joined back by one event per stream, so that small experts' GEMMs, each filling a fraction of the SMs,
 *   run side by side. Each side stream has its own cuBLAS handle and workspace, set up as the compute stream's
 *   (gemm_handle_create): cuBLAS's heuristic sees the same shape, types, math mode and workspace size, so each
 *   GEMM runs the loop's algorithm, and each writes its own expert's rows or weights, so the results are the
 *   loop's bit for bit in any interleaving (cuBLAS's reproducibility holds per handle and stream; concurrent
 *   streams sharing one handle's workspace is what it excludes). Fork and join are events: legal under CUDA
 *   graph capture (the side streams join the capture through the fork event).
 * Measured on an H200 (dev/cuda/grouped_gemm_probe.cu, bf16): 128 experts of [256 x 2048] x [2048 x 1536]
 * grouped 0.65 ms (317 TFLOP/s), one by one 0.98 ms (211); 8 experts of [1024 x 4096] x [4096 x 28672]
 * grouped 5.99 ms (321 TFLOP/s), one by one 2.18 ms (884): cuBLAS's grouped kernel stays near 320 TFLOP/s.
 * The rule (moe_gemm_choose), from dev/cuda/grouped_gemm_probe.cu on an H200 (dev/bench/results/
 * hopper_decode_cp_h200.md): grouped where it has the types and the GEMMs average under MOE_GROUPED_MAX_FLOP
 * (Qwen3's experts: the host issues a cuBLAS GEMM in 8-12 us, longer than each takes, so neither the loop nor
 * side streams keep the GPU busy); the bf16 weight gradients with fp32 output, which the grouped call refuses,
 * on side streams (Qwen3 fc1 1.85 -> 1.21 ms, Mixtral fc1 4.62 -> 4.34); big GEMMs with the types one by one
 * on the compute stream (Mixtral fc2's forward: loop 1.16 ms, streams 4 1.36); a lone GEMM on the compute stream.
 * Each call of a layer's pass has its own slot of pointer staging (forward: fc1, fc2; backward: fc2's input and
 * weight gradients, fc1's): a layer reads its row counts back (synchronising the stream) before it reuses them. */
#define MOE_GROUPED_MAX_FLOP 8e9
enum { MOE_GEMM_FC1, MOE_GEMM_FC2, MOE_GEMM_FC2_DX, MOE_GEMM_FC2_DW, MOE_GEMM_FC1_DX, MOE_GEMM_FC1_DW, MOE_GEMM_SLOTS };
static_assert(MOE_GEMM_SLOTS * 3 == (int)MT_MOE_GEMM_POINTERS(1), "the plan counts every slot's pointers");

/* MT_MOE_GEMM's value: unset or empty, the rule (MOE_PATH_DEFAULT); grouped, loop or streams, that path for every
 * call; anything else refused in one line (MT_ERR_ARG). */
static mt_status moe_gemm_path_parse(const char* value, int* path, mt_error* err) {
    static const char* const names[] = {"grouped", "loop", "streams", "hopper"};
    static_assert(MOE_PATH_GROUPED == 1 && MOE_PATH_LOOP == 2 && MOE_PATH_STREAMS == 3 && MOE_PATH_HOPPER == 4,
                  "names[] in path order");
    *path = MOE_PATH_DEFAULT;
    if (!value || !*value) return MT_OK;
    for (int i = 0; i < 4; i++)
        if (!strcmp(value, names[i])) {
            *path = MOE_PATH_GROUPED + i;
            return MT_OK;
        }
    return mt_fail(err, MT_ERR_ARG, "MT_MOE_GEMM=%.64s: expected grouped, loop, streams or hopper (unset: the default rule)",
                   value);
}

/* The path of one call's GEMMs: `forced` (MT_MOE_GEMM) where set, else grouped where cuBLAS's grouped GEMM has the
 * types (grouped_types) and the with_rows GEMMs of `flop` in all average under MOE_GROUPED_MAX_FLOP, else
 * streams. Grouped without the types runs the loop; streams without side streams (side_streams 0) or with one
 * GEMM runs the loop (one GEMM gains nothing from a fork). */
static int moe_gemm_choose(int forced, bool grouped_types, double flop, int with_rows, int side_streams) {
    int path = forced == MOE_PATH_HOPPER ? MOE_PATH_DEFAULT : forced; /* what the Hopper kernel leaves: the rule */
    if (path == MOE_PATH_DEFAULT)
        path = !grouped_types ? MOE_PATH_STREAMS
               : flop < MOE_GROUPED_MAX_FLOP * with_rows ? MOE_PATH_GROUPED : MOE_PATH_LOOP;
    if (path == MOE_PATH_GROUPED && !grouped_types) path = MOE_PATH_LOOP;
    if (path == MOE_PATH_STREAMS && (side_streams < 1 || with_rows < 2)) path = MOE_PATH_LOOP;
    return path;
}

/* The side stream of each GEMM in expert order: the one with the least work (FLOPs) so far, ties to the lowest
 * (load [streams], from 0). */
static int moe_side_stream_pick(double* load, int streams, double work) {
    int best = 0;
    for (int s = 1; s < streams; s++)
        if (load[s] < load[best]) best = s;
    load[best] += work;
    return best;
}

/* The side streams, their handles and events (mt_trainer_create through moe_state_create; the tests create their
 * own). The workspaces are the caller's, in m->workspace (MT_CUBLAS_WORKSPACE_BYTES each; NULL: none set, cuBLAS's
 * own), freed by the caller after moe_gemm_free. forced: MT_MOE_GEMM's path. */
static void moe_gemm_create(mt_moe_gemm* m, mt_gpu_error* e, int forced) {
    m->forced = forced;
    m->streams = 0;
    if (!CUDA_CHECK(e, cudaEventCreateWithFlags(&m->fork, cudaEventDisableTiming))) return;
    for (int s = 0; s < MOE_SIDE_STREAMS; s++) {
        if (!CUDA_CHECK(e, cudaStreamCreateWithFlags(&m->side[s], cudaStreamNonBlocking))) return;
        if (!CUDA_CHECK(e, cudaEventCreateWithFlags(&m->joined[s], cudaEventDisableTiming))) return;
        gemm_handle_create(e, &m->plans[s].handle, m->side[s], m->workspace[s], MT_CUBLAS_WORKSPACE_BYTES);
        m->plans[s].workspace = m->workspace[s];
        m->plans[s].workspace_bytes = m->workspace[s] ? MT_CUBLAS_WORKSPACE_BYTES : 0;
        if (e->status != MT_OK) return;
        m->streams = s + 1;
    }
}
/* Frees what moe_gemm_create made (not the workspaces, nor the grouped calls' tables: their allocator's). */
static void moe_gemm_free(mt_moe_gemm* m) {
    for (int s = 0; s < MOE_SIDE_STREAMS; s++) {
        if (m->side[s]) cudaStreamSynchronize(m->side[s]);
        if (m->plans[s].handle) cublasDestroy(m->plans[s].handle);
        if (m->joined[s]) cudaEventDestroy(m->joined[s]);
        if (m->side[s]) cudaStreamDestroy(m->side[s]);
        m->plans[s].handle = NULL, m->joined[s] = NULL, m->side[s] = NULL;
    }
    if (m->fork) cudaEventDestroy(m->fork);
    m->fork = NULL;
    m->streams = 0;
}

/* One call's GEMMs over the experts with rows: C_e = op(A_e) op(B_e) + beta C_e for each expert e with n_e > 0
 * rows at row offset o_e: A_e = A + o_e a_row + e a_expert (likewise B and C); M, N or K of -1 is n_e. */
typedef struct {
    bool transA, transB;
    int M, N, K;
    int64_t a_row, a_expert, b_row, b_expert, c_row, c_expert; /* element steps per row offset and per expert */
    int lda, ldb, ldc;
} moe_gemm_shape;
template <typename T, typename TC>
static void moe_experts_gemm(mt_moe_gemm* m, const mt_exec* ex, int slot, const moe_gemm_shape& g, const T* A,
                             const T* B, TC* C, float beta, const int32_t* counts, int E) {
    if (ex->error->status != MT_OK) return;
    int groups = 0, with_rows = 0;
    double flop = 0.0;
    for (int e = 0; e < E; e++)
        if (counts[e] > 0)
            with_rows++, flop += 2.0 * (g.M < 0 ? counts[e] : g.M) * (double)(g.N < 0 ? counts[e] : g.N) *
                                (g.K < 0 ? counts[e] : g.K);
    const int path = moe_gemm_choose(m->forced, sizeof(TC) == sizeof(T), flop, with_rows, m->streams);
    int* dims = (int*)malloc(sizeof(int) * 6 * (size_t)E);
    const T** ab = (const T**)malloc(sizeof(T*) * 2 * (size_t)E);
    TC** cs = (TC**)malloc(sizeof(TC*) * (size_t)E);
    if (!dims || !ab || !cs) {
        free(dims), free(ab), free(cs);
        mt_gpu_fail(ex->error, MT_ERR_OOM, "MoE: cannot allocate the experts' GEMM table");
        return;
    }
    /* streams: each side stream's execution context, forked from the compute stream */
    const int S = path == MOE_PATH_STREAMS ? (with_rows < m->streams ? with_rows : m->streams) : 0;
    mt_exec side[MOE_SIDE_STREAMS];
    double load[MOE_SIDE_STREAMS];
    if (S > 0) CUDA_CHECK(ex->error, cudaEventRecord(m->fork, ex->stream));
    for (int s = 0; s < S; s++) {
        side[s] = *ex, side[s].stream = m->side[s], side[s].gemm = &m->plans[s], load[s] = 0.0;
        CUDA_CHECK(ex->error, cudaStreamWaitEvent(m->side[s], m->fork, 0));
    }
    for (int e = 0; e < E; e++) {
        const int n = counts[e], at = counts[E + e];
        if (n == 0) continue;
        const int M = g.M < 0 ? n : g.M, N = g.N < 0 ? n : g.N, K = g.K < 0 ? n : g.K;
        const T* a = A + at * g.a_row + e * g.a_expert;
        const T* b = B + at * g.b_row + e * g.b_expert;
        TC* c = C + at * g.c_row + e * g.c_expert;
        if (path != MOE_PATH_GROUPED) {
            const mt_exec* on = S > 0 ? &side[moe_side_stream_pick(load, S, 2.0 * M * (double)N * K)] : ex;
            gemm_uncached<T, TC>(on, g.transA, g.transB, M, N, K, a, g.lda, b, g.ldb, c, g.ldc, 1.0f, beta);
            continue;
        }
        dims[groups] = M, dims[E + groups] = N, dims[2 * E + groups] = K;
        dims[3 * E + groups] = g.lda, dims[4 * E + groups] = g.ldb, dims[5 * E + groups] = g.ldc;
        ab[groups] = a, ab[E + groups] = b, cs[groups] = c;
        groups++;
    }
    for (int s = 0; s < S; s++) { /* joined even after an error: no side stream's work is left unjoined */
        CUDA_CHECK(ex->error, cudaEventRecord(m->joined[s], m->side[s]));
        CUDA_CHECK(ex->error, cudaStreamWaitEvent(ex->stream, m->joined[s], 0));
    }
    const size_t at = (size_t)slot * 3 * (size_t)E;
    gemm_grouped<T, TC>(ex, groups, g.transA, g.transB, dims, dims + E, dims + 2 * E, ab, dims + 3 * E, ab + E,
                        dims + 4 * E, cs, dims + 5 * E, beta, m->staging + at, m->table + at);
    free(dims), free(ab), free(cs);
}

/* An experts' GEMM on Hopper (section 13.1): C_e [n_e, N] = A_e [n_e, K] times W_e ([N, K] with hg::B_NK, the
 * forward; [K, N] with hg::B_KN, the input gradient), where moe_state_create chose it, the shapes fit and (unless
 * MT_MOE_GEMM=hopper) cuBLAS would take its grouped kernel: the experts' GEMMs are small (moe_experts_gemm's
 * MOE_GROUPED_MAX_FLOP on average; H200, the lab: ours ~500-580 TFLOP/s at Qwen3's experts against cuBLAS
 * grouped ~280, while large ones one by one through cuBLAS reach ~800-880, ahead of ours at Mixtral's fc2);
 * false: not taken. The kernel reads the rows per expert on the device: they go there through this slot's part
 * of the grouped GEMM's pointer staging and table (pinned, then device; unused by this call otherwise, and
 * reused under the same rule as there). */
/* Whether an experts' GEMM of 2 sum(n_e) N K flops goes to Hopper (the rule above, one place for the forward, the
 * input gradient and the weight gradient); then its rows per expert copied to the device through this slot's
 * staging and table (*device; NULL after a recorded error). */
static bool moe_hopper_take(mt_moe_gemm* m, const mt_exec* ex, int slot, const int32_t* counts, int E, int N, int K,
                            const int32_t** device) {
    int with_rows = 0;
    for (int e = 0; e < E; e++) with_rows += counts[e] > 0;
    if (m->hopper == 1 && 2.0 * counts[2 * E] * N * (double)K > MOE_GROUPED_MAX_FLOP * with_rows) return false;
    const size_t at = (size_t)slot * 3 * (size_t)E;
    int32_t* staged = (int32_t*)(m->staging + at);
    int32_t* dev = (int32_t*)(m->table + at);
    memcpy(staged, counts, sizeof(int32_t) * (size_t)E);
    const bool ok = CUDA_CHECK(ex->error, cudaMemcpyAsync(dev, staged, sizeof(int32_t) * (size_t)E, cudaMemcpyHostToDevice,
                                                          ex->stream));
    *device = ok ? dev : NULL;
    return true;
}
template <typename T>
static bool moe_experts_hopper(mt_moe_gemm* m, const mt_exec* ex, int slot, T* C, const T* A, const T* W, int w_layout,
                               const int32_t* counts, int E, int N, int K) {
    const int32_t* device = NULL;
    if (!std::is_same<T, __nv_bfloat16>::value || !m->hopper || !hopper_gemm_fits(A, W, C, E, N, K, counts[2 * E]) ||
        !moe_hopper_take(m, ex, slot, counts, E, N, K, &device))
        return false;
    if (device)
        hopper_grouped_gemm(ex, (__nv_bfloat16*)C, (const __nv_bfloat16*)A, counts[2 * E], (const __nv_bfloat16*)W, w_layout,
                            device, E, N, K);
    return true;
}
/* The weight gradient on Hopper: dW_e [out, in] = beta dW_e + dy_e^T x_e (hopper_grouped_wgrad; an expert without
 * rows zeroed where beta == 0), under moe_experts_hopper's rule; false: not taken. */
template <typename T>
static bool moe_experts_hopper_wgrad(mt_moe_gemm* m, const mt_exec* ex, int slot, float* dW, const T* dy, const T* x,
                                     float beta, const int32_t* counts, int E, int in, int out) {
    const int32_t* device = NULL;
    if (!std::is_same<T, __nv_bfloat16>::value || !m->hopper || !hopper_wgrad_fits(dW, dy, x, E, out, in, counts[2 * E]) ||
        !moe_hopper_take(m, ex, slot, counts, E, in, out, &device))
        return false;
    if (device)
        hopper_grouped_wgrad(ex, dW, (const __nv_bfloat16*)dy, (const __nv_bfloat16*)x, counts[2 * E], device, E, out, in,
                             beta);
    return true;
}

/* The experts' linear on their permuted rows: y_e [n_e, out] = x_e [n_e, in] W_e^T for each expert e with rows
 * (W [E, out, in]); counts: the host's rows per expert then offsets (counts[2E]: the total). */
template <typename T>
static void moe_experts_forward(mt_moe_gemm* m, const mt_exec* ex, int slot, T* y, const T* x, const T* W,
                                const int32_t* counts, int E, int in, int out) {
    if (moe_experts_hopper<T>(m, ex, slot, y, x, W, hg::B_NK, counts, E, out, in)) return;
    const moe_gemm_shape g = {false, true, -1, out, in, in, 0, 0, (int64_t)out * in, out, 0, in, in, out};
    moe_experts_gemm<T, T>(m, ex, slot, g, x, W, y, 0.0f, counts, E);
}
/* Its backward: dx_e = dy_e W_e; dW_e (+)= dy_e^T x_e (an expert without rows: its gradient 0 on the first
 * micro-batch, unchanged after). slot: the input gradient's staging slot (the weight gradient's is the next). */
template <typename T>
static void moe_experts_backward(mt_moe_gemm* m, const mt_exec* ex, int slot, T* dx, float* dW, const T* dy,
                                 const T* x, const T* W, const int32_t* counts, int E, int in, int out) {
    const float beta = ex->mode.accumulate_gradients ? 1.0f : 0.0f;
    const moe_gemm_shape gx = {false, false, -1, in, out, out, 0, 0, (int64_t)out * in, in, 0, out, in, in};
    if (!moe_experts_hopper<T>(m, ex, slot, dx, dy, W, hg::B_KN, counts, E, in, out))
        moe_experts_gemm<T, T>(m, ex, slot, gx, dy, W, dx, 0.0f, counts, E);
    if (moe_experts_hopper_wgrad<T>(m, ex, slot + 1, dW, dy, x, beta, counts, E, in, out)) return;
    for (int e = 0; e < E && beta == 0.0f; e++)
        if (counts[e] == 0)
            CUDA_CHECK(ex->error, cudaMemsetAsync(dW + (int64_t)e * out * in, 0, sizeof(float) * (size_t)out * in,
                                                  ex->stream));
    const moe_gemm_shape gw = {true, false, out, in, -1, out, 0, in, 0, 0, (int64_t)out * in, out, in, in};
    moe_experts_gemm<T, float>(m, ex, slot + 1, gw, dy, x, dW, beta, counts, E);
}

/* The router's fp32 operands: x and W themselves in an fp32 model, else widened into the scratch. */
template <typename T>
static void moe_router_operands(const mt_exec* ex, const mt_activations* a, const mt_shape& s, const T* x, const T* W,
                                const float** x32, const float** W32) {
    if (sizeof(T) == 4) {
        *x32 = (const float*)x, *W32 = (const float*)W;
        return;
    }
    moe_to_f32<T>(ex, a->moe_x32, x, (int64_t)s.BT * s.h);
    moe_to_f32<T>(ex, a->moe_w32, W, (int64_t)s.E * s.h);
    *x32 = a->moe_x32, *W32 = a->moe_w32;
}

/* ---- Expert parallelism: the all-to-all dispatch (Megatron's MoEAlltoAllTokenDispatcher) ----
 * With EP > 1 each rank routes its own tokens over all E experts and permutes them by global expert as
 * at EP = 1, so the rows for EP rank r's experts (r El .. (r + 1) El - 1) are one contiguous run. The ranks
 * swap their rows per expert (an int32 all-to-all, saved per layer for the backward), read those counts
 * back with the layer's own (the one host synchronisation per layer and pass, as at EP = 1), and send each
 * run to its rank (NCCL send/receive pairs in one group, on the compute stream: the experts wait for it).
 * A rank receives, from each rank in turn, its rows for each local expert; a gather (moe_permute with a
 * host-made index) puts them in local-expert order [expert j: rank 0's rows, rank 1's, ...], the order the
 * experts' GEMMs take. The probabilities travel with the rows; the experts' outputs go back the same way
 * in reverse, then unpermute sums each token's rows as at EP = 1. The backward mirrors it: the rows'
 * output gradients out, the input and probability gradients back. Every transfer moves whole rows into
 * fixed places, so the results are bitwise those of the same ranks at any timing. */

/* One layer's dispatch plan on the host, from this rank's rows per global expert (counts [E] then its
 * offsets, the host copy) and the rows received [EP, El] (ep_counts, device; read back here): the rows
 * sent to and received from each rank (offsets), the rows per local expert (ep_local: counts, offsets,
 * total) and the gather index into local-expert order with its inverse, copied to a->moe_ep_index. With
 * exchange (the forward) the counts are first swapped over the EP group into ep_counts. Returns the
 * received rows, or -1 on an error (recorded). */
static int64_t moe_ep_plan(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const int32_t* device_counts,
                           int32_t* ep_counts, bool exchange) {
    mt_process_groups* g = &t->groups;
    mt_moe_state* m = &t->moe;
    const int EP = s.ep, El = s.El;
    if (exchange) {
        NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupStart());
        for (int r = 0; r < EP; r++) {
            NCCL_CHECK(ex->error, t->cfg.rank, ncclSend(device_counts + (int64_t)r * El, (size_t)El, ncclInt32, r, g->ep,
                                                        ex->stream));
            NCCL_CHECK(ex->error, t->cfg.rank, ncclRecv(ep_counts + (int64_t)r * El, (size_t)El, ncclInt32, r, g->ep,
                                                        ex->stream));
        }
        NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupEnd());
    }
    CUDA_CHECK(ex->error, cudaMemcpyAsync(m->host_counts, device_counts, sizeof(int32_t) * (2 * (size_t)s.E + 1),
                                          cudaMemcpyDeviceToHost, ex->stream));
    CUDA_CHECK(ex->error, cudaMemcpyAsync(m->ep_host, ep_counts, sizeof(int32_t) * (size_t)s.E, cudaMemcpyDeviceToHost,
                                          ex->stream));
    if (!CUDA_CHECK(ex->error, cudaStreamSynchronize(ex->stream))) return -1;
    const int32_t* counts = m->host_counts; /* [E] this rank's rows per global expert, [E + 1] their offsets */
    const int32_t* received = m->ep_host;   /* [EP, El] */
    int64_t* send = m->ep_offsets;          /* [EP + 1] */
    int64_t* recv = m->ep_offsets + EP + 1; /* [EP + 1] */
    send[0] = recv[0] = 0;
    for (int r = 0; r < EP; r++) {
        send[r + 1] = counts[s.E + (r + 1) * El];
        int64_t n = 0;
        for (int j = 0; j < El; j++) n += received[r * El + j];
        recv[r + 1] = recv[r] + n;
    }
    const int64_t total = recv[EP];
    if (total > s.Rexp) {
        mt_gpu_fail(ex->error, MT_ERR_RANGE, "MoE expert parallelism: %lld rows received, above the plan's bound %lld",
                    (long long)total, (long long)s.Rexp);
        return -1;
    }
    int32_t* local = m->ep_local; /* counts [El], offsets [El + 1] */
    local[El] = 0;
    for (int j = 0; j < El; j++) {
        int64_t n = 0;
        for (int r = 0; r < EP; r++) n += received[r * El + j];
        local[j] = (int32_t)n;
        local[El + j + 1] = local[El + j] + (int32_t)n;
    }
    int32_t* order = m->ep_host + s.E;  /* [Rexp]: sorted row p <- received row order[p] */
    int32_t* inverse = order + s.Rexp; /* [Rexp]: received row q -> sorted row inverse[q] */
    int64_t p = 0;
    for (int j = 0; j < El; j++)
        for (int r = 0; r < EP; r++) {
            int64_t q = recv[r];
            for (int i = 0; i < j; i++) q += received[r * El + i];
            for (int i = 0; i < received[r * El + j]; i++, p++, q++) order[p] = (int32_t)q, inverse[q] = (int32_t)p;
        }
    mt_activations* a = &t->act;
    CUDA_CHECK(ex->error, cudaMemcpyAsync(a->moe_ep_index, order, sizeof(int32_t) * (size_t)total, cudaMemcpyHostToDevice,
                                          ex->stream));
    CUDA_CHECK(ex->error, cudaMemcpyAsync(a->moe_ep_index + s.Rexp, inverse, sizeof(int32_t) * (size_t)total,
                                          cudaMemcpyHostToDevice, ex->stream));
    return total;
}

/* recv [recv_off[EP], width] = from each EP rank r its rows; send [send_off[EP], width]: rows
 * [send_off[r], send_off[r + 1]) go to rank r. One NCCL group on the compute stream. */
static void moe_all_to_all(mt_trainer* t, const mt_exec* ex, void* recv, const int64_t* recv_off, const void* send,
                           const int64_t* send_off, int64_t width, ncclDataType_t type, size_t elem) {
    mt_process_groups* g = &t->groups;
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupStart());
    for (int r = 0; r < g->ep_size; r++) {
        const int64_t ns = send_off[r + 1] - send_off[r], nr = recv_off[r + 1] - recv_off[r];
        if (ns > 0)
            NCCL_CHECK(ex->error, t->cfg.rank, ncclSend((const char*)send + send_off[r] * width * elem,
                                                        (size_t)(ns * width), type, r, g->ep, ex->stream));
        if (nr > 0)
            NCCL_CHECK(ex->error, t->cfg.rank, ncclRecv((char*)recv + recv_off[r] * width * elem, (size_t)(nr * width),
                                                        type, r, g->ep, ex->stream));
    }
    NCCL_CHECK(ex->error, t->cfg.rank, ncclGroupEnd());
}

/* The rows of this rank's tokens (x [N, h] permuted into global expert order, their probabilities
 * v.moe_row_prob [R]) through the experts of their EP ranks, back into y [R, h] in that order (EP > 1; layer
 * view v keeps what the backward needs). Scratch: a->moe_y and a->moe_xperm ([max(Rmax, Rexp), h] each),
 * a->moe_ep_drow for the received probabilities. */
template <typename T>
static void moe_ep_forward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const layer_view<T>& v,
                           const layer_tensors<T>& p, const T* x, T* y) {
    mt_activations* a = &t->act;
    const ncclDataType_t type = t->groups.tp.type;
    const int64_t received = moe_ep_plan(t, ex, s, v.moe_counts, v.moe_ep_counts, true);
    if (received < 0) return;
    const int64_t* send = t->moe.ep_offsets;
    const int64_t* recv = t->moe.ep_offsets + s.ep + 1;
    const int Rr = (int)received;
    moe_permute<T>(ex, (T*)a->moe_xperm, x, v.moe_token, (int)send[s.ep], s.h);
    moe_all_to_all(t, ex, a->moe_y, recv, a->moe_xperm, send, s.h, type, sizeof(T));
    moe_all_to_all(t, ex, a->moe_ep_drow, recv, v.moe_row_prob, send, 1, ncclFloat, sizeof(float));
    moe_permute<T>(ex, v.moe_ep_in, (const T*)a->moe_y, a->moe_ep_index, Rr, s.h);
    moe_permute<float>(ex, v.moe_ep_prob, a->moe_ep_drow, a->moe_ep_index, Rr, 1);
    const int32_t* local = t->moe.ep_local;
    moe_experts_forward<T>(&t->moe.gemm, ex, MOE_GEMM_FC1, v.moe_fc1, (const T*)v.moe_ep_in, p.expert_fc1_w, local, s.El, s.h,
                           s.f1e);
    moe_act_prob<T>(ex, v.moe_act, v.moe_fc1, v.moe_ep_prob, Rr, s.fe, moe_act_kind(s));
    moe_experts_forward<T>(&t->moe.gemm, ex, MOE_GEMM_FC2, (T*)a->moe_y, v.moe_act, p.expert_fc2_w, local, s.El, s.fe, s.h);
    moe_permute<T>(ex, (T*)a->moe_xperm, (const T*)a->moe_y, a->moe_ep_index + s.Rexp, Rr, s.h); /* received order */
    moe_all_to_all(t, ex, y, send, a->moe_xperm, recv, s.h, type, sizeof(T));
}

/* Its backward: the output gradient dout [N, h] at this rank's rows (global expert order, into dx_rows) out
 * to the experts, their weight gradients, and back: the rows' input gradient into dx_rows [R, h] (a->moe_y)
 * and their probabilities' gradient into dprobs [N, E] (zeroed first); a->moe_xperm is scratch. */
template <typename T>
static void moe_ep_backward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const layer_view<T>& v,
                            const layer_tensors<T>& p, const layer_tensors<float>& dp, const T* dout, T* dx_rows,
                            float* dprobs) {
    mt_activations* a = &t->act;
    const ncclDataType_t type = t->groups.tp.type;
    const int64_t received = moe_ep_plan(t, ex, s, v.moe_counts, v.moe_ep_counts, false);
    if (received < 0) return;
    const int64_t* send = t->moe.ep_offsets;
    const int64_t* recv = t->moe.ep_offsets + s.ep + 1;
    const int Rr = (int)received, R = (int)send[s.ep];
    T* drows = dx_rows;
    moe_permute<T>(ex, drows, dout, v.moe_token, R, s.h);
    const int32_t* local = t->moe.ep_local;
    float* drow_local = a->moe_ep_drow;                      /* [Rexp] local-expert order */
    float* drow_received = a->moe_ep_drow + s.Rexp;          /* [Rexp] received order */
    float* drow_mine = a->moe_ep_drow + 2 * s.Rexp;          /* [Rmax] this rank's rows */
    T* sorted = (T*)a->moe_y;
    moe_all_to_all(t, ex, a->moe_xperm, recv, drows, send, s.h, type, sizeof(T));
    moe_permute<T>(ex, sorted, (const T*)a->moe_xperm, a->moe_ep_index, Rr, s.h);
    moe_experts_backward<T>(&t->moe.gemm, ex, MOE_GEMM_FC2_DX, (T*)a->moe_dact, dp.expert_fc2_w, sorted, v.moe_act,
                            p.expert_fc2_w, local, s.El, s.fe, s.h);
    moe_act_prob_backward<T>(ex, (T*)a->moe_dz, drow_local, (const T*)a->moe_dact, v.moe_fc1, v.moe_ep_prob,
                             (const int32_t*)NULL, (const int32_t*)NULL, Rr, s.fe, s.El, moe_act_kind(s));
    moe_experts_backward<T>(&t->moe.gemm, ex, MOE_GEMM_FC1_DX, sorted, dp.expert_fc1_w, (const T*)a->moe_dz,
                            (const T*)v.moe_ep_in, p.expert_fc1_w, local, s.El, s.h, s.f1e);
    moe_permute<T>(ex, (T*)a->moe_xperm, (const T*)sorted, a->moe_ep_index + s.Rexp, Rr, s.h);
    moe_permute<float>(ex, drow_received, drow_local, a->moe_ep_index + s.Rexp, Rr, 1);
    moe_all_to_all(t, ex, dx_rows, send, a->moe_xperm, recv, s.h, type, sizeof(T));
    moe_all_to_all(t, ex, drow_mine, send, drow_received, recv, 1, ncclFloat, sizeof(float));
    CUDA_CHECK(ex->error, cudaMemsetAsync(dprobs, 0, sizeof(float) * (size_t)s.BT * s.E, ex->stream));
    moe_row_prob_scatter(ex, dprobs, drow_mine, v.moe_token, v.moe_counts + s.E, R, s.E);
}

static void comm_after_compute(mt_trainer* t); /* section 19: the communication stream waits for the compute's work */
static void* device_alloc(mt_trainer* t, size_t bytes, size_t* counter); /* section 21 */
static void compute_after_comm(mt_trainer* t); /* section 19: and the compute stream for the communication's */
/* All-reduce (sum) of a device array over the data-parallel group, ordered after the compute stream's work
 * and before its next (a no-op with one DP rank). */
static void dp_all_reduce_device(mt_trainer* t, void* buffer, size_t count, ncclDataType_t type) {
    if (!t->groups.dp) return;
    comm_after_compute(t);
    NCCL_CHECK(&t->error, t->cfg.rank,
               ncclAllReduce(buffer, buffer, count, type, ncclSum, t->groups.dp, t->groups.comm_stream));
    compute_after_comm(t);
}

/* The aux losses of layer l's routing of this micro-batch (training): their statistics, the global aux
 * loss's counts summed over DP and averaged over the step's micro-batches so far, then the logged values
 * (added to moe.log) and the gradient weights the backward applies (v.moe_auxw). */
template <typename T>
static void moe_aux_forward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const moe_routing& r,
                            const layer_view<T>& v, int l) {
    const mt_config* c = &t->cfg;
    const float coef_aux = moe_aux_coef(c, MT_MOE_AUX_LOSS), coef_seq = moe_aux_coef(c, MT_MOE_SEQ_AUX_LOSS);
    const float coef_global = moe_aux_coef(c, MT_MOE_GLOBAL_AUX_LOSS), coef_z = (float)c->moe_z_loss_coeff;
    if (coef_aux == 0.0f && coef_seq == 0.0f && coef_global == 0.0f && coef_z == 0.0f) return;
    const int E = s.E;
    int32_t* aux_counts = t->act.moe_stats;                        /* [(B + 1), E] */
    float* score_sums = (float*)(aux_counts + (size_t)(s.B + 1) * E); /* [(B + 1), E] */
    float* lse_sq_sum = score_sums + (size_t)(s.B + 1) * E;         /* [1] */
    moe_aux_stats(ex, r, v.moe_logits, aux_counts, score_sums, lse_sq_sum, t->act.moe_work);
    float* average = NULL;
    if (coef_global != 0.0f) {
        dp_all_reduce_device(t, aux_counts, (size_t)E, ncclInt32); /* row 0: the micro-batch's counts */
        average = t->moe.global_sums + (int64_t)s.L * E;
        moe_global_aux_average(ex, t->moe.global_sums + (int64_t)l * E, average, aux_counts, E,
                               ex->mode.micro_batch + 1);
    }
    moe_aux_finish(ex, r, aux_counts, score_sums, lse_sq_sum, average, (double)s.BT * t->groups.dp_size, coef_aux,
                   coef_seq, coef_global, coef_z, v.moe_auxw, t->moe.log + (int64_t)l * 4);
}

/* Forward of layer l's MoE block: out [N, h] (the branch before the residual add) from x = ln2 [N, h].
 * replay (full recompute, in the backward): the routing is the forward's, kept per layer (megatron.h
 * mt_recompute_position), so neither the router nor its bookkeeping (tokens per expert, aux losses' sums)
 * runs again; the experts and the shared expert recompute from it bit for bit. */
template <typename T>
static void moe_forward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const layer_view<T>& v,
                        const layer_tensors<T>& p, int l, const T* x, T* out, bool replay = false) {
    const mt_config* c = &t->cfg;
    mt_activations* a = &t->act;
    const moe_routing r = moe_routing_of(t, s);
    const bool training = ex->mode.training != 0;
    const int E = s.E, N = s.BT;
    /* router: logits [N, E] = x W_r^T in fp32; routing; the aux losses' statistics */
    if (!replay) {
        const float *x32, *W32;
        moe_router_operands<T>(ex, a, s, x, p.router_w, &x32, &W32);
        gemm<float, float>(ex, false, true, N, E, s.h, x32, s.h, W32, s.h, v.moe_logits, E, 1.0f, 0.0f);
        if (p.router_b) moe_router_bias<T>(ex, v.moe_logits, p.router_b, N, E);
        const float* bias = c->moe_router_enable_expert_bias ? t->moe.expert_bias + (int64_t)l * E : (const float*)NULL;
        moe_route(ex, r, v.moe_logits, bias, v.moe_probs, v.moe_row, v.moe_token, v.moe_row_prob, v.moe_counts,
                  training ? t->moe.step_tokens + (int64_t)l * E : (int32_t*)NULL, a->moe_work);
        if (training) moe_aux_forward(t, ex, s, r, v, l);
    }
    /* the experts on their rows (with expert parallelism, on the rows' EP ranks: moe_ep_forward reads the
     * counts back itself) */
    if (s.ep > 1) {
        moe_ep_forward<T>(t, ex, s, v, p, x, (T*)a->moe_y);
    } else {
        const int32_t* counts = moe_host_counts(t, v.moe_counts, E);
        const int R = counts[2 * E];
        moe_permute<T>(ex, (T*)a->moe_xperm, x, v.moe_token, R, s.h);
        moe_experts_forward<T>(&t->moe.gemm, ex, MOE_GEMM_FC1, v.moe_fc1, (const T*)a->moe_xperm, p.expert_fc1_w, counts, E, s.h,
                               s.f1e);
        const int32_t* offsets = v.moe_counts + E; /* the device's, for the biases' row -> expert */
        if (p.expert_fc1_b) moe_rows_bias<T>(ex, v.moe_fc1, p.expert_fc1_b, (const float*)NULL, offsets, R, s.f1e, E);
        moe_act_prob<T>(ex, v.moe_act, v.moe_fc1, v.moe_row_prob, R, s.fe, moe_act_kind(s));
        moe_experts_forward<T>(&t->moe.gemm, ex, MOE_GEMM_FC2, (T*)a->moe_y, v.moe_act, p.expert_fc2_w, counts, E, s.fe, s.h);
        if (p.expert_fc2_b) moe_rows_bias<T>(ex, (T*)a->moe_y, p.expert_fc2_b, v.moe_row_prob, offsets, R, s.h, E);
    }
    /* the shared expert (the dense MLP code on this layer's shared weights), its output kept when gated */
    T* shared = NULL;
    if (p.fc1_w) {
        mlp_up_forward<T>(ex, s, v, p, x, (const fp8_linear*)NULL);
        shared = v.moe_shared ? v.moe_shared : (T*)a->branch2;
        linear_forward<T>(ex, shared, v.act, p.fc2_w, (const T*)NULL, N, s.f, s.h);
        if (v.moe_gate) moe_gate_forward<T>(ex, v.moe_gate, x, p.shared_gate_w, N, s.h);
    }
    moe_unpermute<T>(ex, out, (const T*)a->moe_y, v.moe_row, shared, v.moe_gate, N, E, s.h, false);
}

/* Selective moe_act: the experts' activation times the probability again from the kept fc1 output, over the
 * rows the local experts hold (their count read back: this layer's rows, or with expert parallelism the
 * rows received, from the kept counts). */
template <typename T>
static void moe_recompute_act(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const layer_view<T>& v) {
    int rows = 0;
    if (s.ep > 1) {
        int32_t* received = t->moe.ep_host; /* [EP, El] */
        CUDA_CHECK(ex->error, cudaMemcpyAsync(received, v.moe_ep_counts, sizeof(int32_t) * (size_t)s.E,
                                              cudaMemcpyDeviceToHost, ex->stream));
        if (!CUDA_CHECK(ex->error, cudaStreamSynchronize(ex->stream))) return;
        for (int i = 0; i < s.E; i++) rows += received[i];
        moe_act_prob<T>(ex, v.moe_act, v.moe_fc1, v.moe_ep_prob, rows, s.fe, moe_act_kind(s));
    } else {
        rows = moe_host_counts(t, v.moe_counts, s.E)[2 * s.E];
        moe_act_prob<T>(ex, v.moe_act, v.moe_fc1, v.moe_row_prob, rows, s.fe, moe_act_kind(s));
    }
}

/* Backward of layer l's MoE block from dout [N, h] (the branch's gradient): the layer input's gradient into
 * dx [N, h] (written), the router's, experts' and shared expert's weight gradients. Order: the experts
 * (their probabilities' gradient into moe_dprobs), the router (the routing's and the aux losses' gradients
 * of the logits), then the shared expert, each adding into dx. */
template <typename T>
static void moe_backward(mt_trainer* t, const mt_exec* ex, const mt_shape& s, const layer_view<T>& v,
                         const layer_tensors<T>& p, const layer_tensors<float>& dp, int l, const T* dout, const T* x,
                         T* dx) {
    const mt_config* c = &t->cfg;
    mt_activations* a = &t->act;
    const moe_routing r = moe_routing_of(t, s);
    const int E = s.E, N = s.BT;
    /* experts: d(rows) = dout at each row's token; fc2, the probability-weighted SwiGLU, fc1 (with expert
     * parallelism on the rows' EP ranks) */
    T* drows = (T*)a->moe_y;
    if (s.ep > 1) {
        moe_ep_backward<T>(t, ex, s, v, p, dp, dout, drows, a->moe_dprobs);
    } else {
        const int32_t* counts = moe_host_counts(t, v.moe_counts, E);
        const int R = counts[2 * E];
        moe_permute<T>(ex, drows, dout, v.moe_token, R, s.h);
        const int32_t* offsets = v.moe_counts + E;
        const bool accumulate = ex->mode.accumulate_gradients != 0;
        moe_experts_backward<T>(&t->moe.gemm, ex, MOE_GEMM_FC2_DX, (T*)a->moe_dact, dp.expert_fc2_w, drows, v.moe_act,
                                p.expert_fc2_w, counts, E, s.fe, s.h);
        if (dp.expert_fc2_b) moe_rows_bias_grad<T>(ex, dp.expert_fc2_b, drows, v.moe_row_prob, offsets, s.h, E, accumulate);
        CUDA_CHECK(ex->error, cudaMemsetAsync(a->moe_dprobs, 0, sizeof(float) * (size_t)N * E, ex->stream));
        moe_act_prob_backward<T>(ex, (T*)a->moe_dz, a->moe_dprobs, (const T*)a->moe_dact, v.moe_fc1, v.moe_row_prob,
                                 v.moe_token, offsets, R, s.fe, E, moe_act_kind(s), p.expert_fc2_b ? drows : (const T*)NULL,
                                 p.expert_fc2_b, s.h);
        if (dp.expert_fc1_b) moe_rows_bias_grad<T>(ex, dp.expert_fc1_b, (const T*)a->moe_dz, (const float*)NULL, offsets,
                                                   s.f1e, E, accumulate);
        moe_permute<T>(ex, (T*)a->moe_xperm, x, v.moe_token, R, s.h); /* the rows the forward's fc1 read */
        moe_experts_backward<T>(&t->moe.gemm, ex, MOE_GEMM_FC1_DX, drows, dp.expert_fc1_w, (const T*)a->moe_dz,
                                (const T*)a->moe_xperm, p.expert_fc1_w, counts, E, s.h, s.f1e);
    }
    moe_unpermute<T>(ex, dx, (const T*)drows, v.moe_row, (const T*)NULL, (const float*)NULL, N, E, s.h, false);
    /* router: dlogits from the probabilities' gradient and the aux losses; dW_r (+)= dlogits^T x, dx += dlogits W_r */
    const float scale = ex->mode.moe_loss_scale;
    const float z_scale = (float)c->moe_z_loss_coeff * scale;
    moe_route_backward(ex, r, v.moe_logits,
                       c->moe_router_enable_expert_bias ? t->moe.expert_bias + (int64_t)l * E : (const float*)NULL,
                       a->moe_dprobs, v.moe_auxw, scale, z_scale, a->moe_dlogits, a->moe_work);
    const float *x32, *W32;
    moe_router_operands<T>(ex, a, s, x, p.router_w, &x32, &W32);
    weight_gradient<float>(ex, &t->colsum, dp.router_w, dp.router_b, a->moe_dlogits, x32, N, s.h, E);
    if (sizeof(T) == 4) { /* fp32: straight into dx */
        gemm<float, float>(ex, false, false, N, s.h, E, a->moe_dlogits, E, W32, s.h, (float*)dx, s.h, 1.0f, 1.0f);
    } else {
        /* the fp32 input is no longer needed: its scratch takes the fp32 input gradient */
        gemm<float, float>(ex, false, false, N, s.h, E, a->moe_dlogits, E, W32, s.h, a->moe_x32, s.h, 1.0f, 0.0f);
        moe_add_f32<T>(ex, dx, a->moe_x32, (int64_t)N * s.h, true);
    }
    if (!p.fc1_w) return;
    /* the shared expert: through its gate, then its fc2, SwiGLU (or its activation) and fc1 (dx += its input
     * gradient) */
    const T* dshared = dout;
    if (v.moe_gate) {
        T* gated = (T*)a->moe_y;
        moe_gate_backward<T>(ex, gated, a->moe_dprobs, dp.shared_gate_w, dx, dout, v.moe_shared, v.moe_gate, x,
                             p.shared_gate_w, N, s.h, ex->mode.accumulate_gradients != 0);
        dshared = gated;
    }
    linear_backward<T>(ex, &t->colsum, (T*)a->branch2, dp.fc2_w, (float*)NULL, dshared, v.act, p.fc2_w, N, s.f, s.h);
    T* dfc1 = (T*)a->branch2;
    if (s.swiglu) {
        swiglu_backward<T>(ex, (T*)a->branch, (T*)a->branch2, v.fc1, N, s.f);
        dfc1 = (T*)a->branch;
    } else {
        activation_backward<T>(ex, s.act, (T*)a->branch2, v.fc1, (int64_t)N * s.f);
    }
    gemm<T, T>(ex, false, false, N, s.h, s.f1, dfc1, s.f1, p.fc1_w, s.h, dx, s.h, 1.0f, 1.0f);
    weight_gradient<T>(ex, &t->colsum, dp.fc1_w, (float*)NULL, dfc1, x, N, s.h, s.f1);
}

/* ---- The MoE routers' state over a pass and a step ---- */

/* Its device arrays and host mirrors (mt_trainer_create; a dense model has none). The plan counts the device
 * arrays as workspace (megatron.h MT_MOE_STATE_BYTES). */
static void moe_state_create(mt_trainer* t) {
    const mt_config* c = &t->cfg;
    mt_moe_state* m = &t->moe;
    if (c->num_experts <= 0) return;
    const size_t L = (size_t)c->num_layers, E = (size_t)c->num_experts;
    size_t* counter = &t->mem.allocated.workspace_bytes;
    m->enabled = 1;
    m->expert_bias = (float*)device_alloc(t, MT__MOE_ALIGN256(L * E * 4), counter); /* MT_MOE_STATE_BYTES' four */
    m->step_tokens = (int32_t*)device_alloc(t, MT__MOE_ALIGN256(L * E * 4), counter);
    m->global_sums = (float*)device_alloc(t, MT__MOE_ALIGN256((L + 1) * E * 4), counter);
    m->log = (float*)device_alloc(t, MT__MOE_ALIGN256(L * 4 * 4), counter);
    m->gemm.table = (const void**)device_alloc(t, MT__MOE_ALIGN256(MT_MOE_GEMM_POINTERS(E) * sizeof(void*)), counter);
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&m->gemm.staging, MT_MOE_GEMM_POINTERS(E) * sizeof(void*)));
    int forced = MOE_PATH_DEFAULT; /* MT_MOE_GEMM, read once here */
    mt_error path_error;
    if (moe_gemm_path_parse(getenv("MT_MOE_GEMM"), &forced, &path_error) != MT_OK)
        mt_gpu_fail(&t->error, MT_ERR_ARG, "%s", path_error.message);
    for (int i = 0; i < MOE_SIDE_STREAMS; i++) /* MT_MOE_STATE_BYTES' side-stream workspaces */
        m->gemm.workspace[i] = device_alloc(t, MT_CUBLAS_WORKSPACE_BYTES, counter);
    if (t->error.status == MT_OK) moe_gemm_create(&m->gemm, &t->error, forced);
    /* bf16 experts on Hopper: section 13.1's grouped GEMM for the forward and input-gradient GEMMs where cuBLAS
     * would take its grouped kernel (the default rule), for every size with MT_MOE_GEMM=hopper (an error where it
     * cannot run); never where MT_MOE_GEMM names a cuBLAS path */
    const bool hopper_forced = forced == MOE_PATH_HOPPER;
    m->gemm.hopper = (forced == MOE_PATH_DEFAULT || hopper_forced) && c->precision == MT_BF16 &&
                             hopper_gemm_available(&t->gemm.hopper)
                         ? 1 + hopper_forced
                         : 0;
    if (hopper_forced && !m->gemm.hopper)
        mt_gpu_fail(&t->error, MT_ERR_ARG, "MT_MOE_GEMM=hopper: the Hopper grouped GEMM needs --bf16, a compute capability "
                                           "9.x GPU and a build for it (GPU_ARCH=90 builds sm_90a)");
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&m->host_counts, sizeof(int32_t) * (2 * E + 1)));
    m->last_log = (float*)calloc(L * 4, sizeof(float));
    m->last_tokens = (int32_t*)calloc(L * E, sizeof(int32_t));
    if (!m->last_log || !m->last_tokens) mt_gpu_fail(&t->error, MT_ERR_OOM, "cannot allocate the MoE statistics");
    if (t->groups.ep_size > 1) { /* the dispatch plan's host side (moe_ep_plan) */
        const mt_shape s = model_shape(t);
        CUDA_CHECK(&t->error, cudaMallocHost((void**)&m->ep_host, sizeof(int32_t) * (E + 2 * (size_t)s.Rexp)));
        m->ep_offsets = (int64_t*)calloc(2 * ((size_t)s.ep + 1), sizeof(int64_t));
        m->ep_local = (int32_t*)calloc(2 * (size_t)s.El + 1, sizeof(int32_t));
        if (!m->ep_offsets || !m->ep_local) mt_gpu_fail(&t->error, MT_ERR_OOM, "cannot allocate the MoE dispatch plan");
    }
    if (m->expert_bias) CUDA_CHECK(&t->error, cudaMemsetAsync(m->expert_bias, 0, L * E * 4, t->stream));
}
static void moe_state_free(mt_moe_state* m) {
    cudaFree(m->expert_bias);
    cudaFree(m->step_tokens);
    cudaFree(m->global_sums);
    cudaFree(m->log);
    cudaFreeHost(m->host_counts);
    moe_gemm_free(&m->gemm);
    for (int i = 0; i < MOE_SIDE_STREAMS; i++) cudaFree(m->gemm.workspace[i]);
    cudaFree((void*)m->gemm.table);
    cudaFreeHost((void*)m->gemm.staging);
    free(m->last_log);
    free(m->last_tokens);
    cudaFreeHost(m->ep_host);
    free(m->ep_offsets);
    free(m->ep_local);
    memset(m, 0, sizeof(*m));
}

/* A training pass starts: the step's tokens per expert, global aux sums and logged losses from 0. */
static void moe_pass_begin(mt_trainer* t) {
    const mt_moe_state* m = &t->moe;
    if (!m->enabled) return;
    const size_t L = (size_t)t->cfg.num_layers, E = (size_t)t->cfg.num_experts;
    CUDA_CHECK(&t->error, cudaMemsetAsync(m->step_tokens, 0, L * E * 4, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(m->global_sums, 0, (L + 1) * E * 4, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(m->log, 0, L * 4 * 4, t->stream));
}

/* A training pass of `count` micro-batches ended: the tokens per expert summed over DP (what the expert bias
 * balances), the logged losses averaged over DP and the micro-batches (Megatron's reduction of its MoE
 * tracker), both kept on the host for mt_trainer_moe_stats and the step's result. With pipeline parallelism
 * each stage filled its own layers' rows (the others are 0) and both are summed over the pipeline as well
 * (Megatron's tracker reduces across the pipeline for its log line): every rank then holds every layer's
 * (x + 0: exact), and the expert-bias update moves every layer's row alike on every rank. */
static void moe_pass_end(mt_trainer* t, int count) {
    mt_moe_state* m = &t->moe;
    if (!m->enabled) return;
    const size_t L = (size_t)t->cfg.num_layers, E = (size_t)t->cfg.num_experts;
    dp_all_reduce_device(t, m->step_tokens, L * E, ncclInt32);
    dp_all_reduce_device(t, m->log, L * 4, ncclFloat);
    if (t->groups.pp_size > 1 && t->groups.pp) {
        comm_after_compute(t);
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupStart());
        NCCL_CHECK(&t->error, t->cfg.rank, ncclAllReduce(m->step_tokens, m->step_tokens, L * E, ncclInt32, ncclSum,
                                                         t->groups.pp, t->groups.comm_stream));
        NCCL_CHECK(&t->error, t->cfg.rank, ncclAllReduce(m->log, m->log, L * 4, ncclFloat, ncclSum, t->groups.pp,
                                                         t->groups.comm_stream));
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupEnd());
        compute_after_comm(t);
    }
    CUDA_CHECK(&t->error, cudaMemcpyAsync(m->last_tokens, m->step_tokens, L * E * 4, cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(m->last_log, m->log, L * 4 * 4, cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    const float scale = 1.0f / ((float)count * (float)t->groups.dp_size);
    for (size_t i = 0; i < L * 4; i++) m->last_log[i] *= scale;
}

/* After a step's backward, before the optimizer (Megatron's finalize_model_grads): the aux-loss-free
 * balancing moves each layer's expert bias against its load. */
static void moe_after_backward(mt_trainer* t) {
    const mt_config* c = &t->cfg;
    if (!t->moe.enabled || !c->moe_router_enable_expert_bias) return;
    const mt_exec ex = trainer_exec(t);
    moe_expert_bias_update(&ex, t->moe.expert_bias, t->moe.step_tokens, c->num_layers, c->num_experts,
                           (float)c->moe_router_bias_update_rate);
}

/* The step's logged MoE losses (Megatron's log line): each kind's value averaged over the MoE layers. */
static void moe_step_losses(const mt_trainer* t, double* out) {
    const mt_config* c = &t->cfg;
    for (int k = 0; k < 4; k++) out[k] = 0.0;
    if (!t->moe.enabled) return;
    const int layers = mt_moe_num_layers(c);
    for (int l = 0; l < c->num_layers; l++)
        if (mt_moe_layer(c, l))
            for (int k = 0; k < 4; k++) out[k] += t->moe.last_log[l * 4 + k] / layers;
}

/* Layer l's forward (of chunk ch, in the running slot) from its input x and ln1 = norm1(x) already
 * in the scratch: attention, MLP, then the residual add fused with the norm that follows it (layer
 * l+1's first, the final norm, or none before the next stage), which also writes the next layer's
 * ln1. Full recompute replays it in the backward (replay: no FP8 weight casts, no parameter waits)
 * with the same kernels and arguments on the kept input, so it writes the forward's bits again;
 * the last layer it replays stops before fc2 (output false): its output is kept. ln1_fp8: ln1's FP8
 * bytes are in x8 (the norm before wrote them, fp8_input_out) and ln1 itself was not written;
 * returns whether this layer left the next one's so (section 16, FP8 linears). */
template <typename T>
static bool layer_forward(mt_trainer* t, const mt_exec* ex, const model_chunk& ch, int l, bool replay, bool output,
                          bool ln1_fp8) {
    mt_shape s = layer_shape(t, l);
    mt_activations* a = &t->act;
    mt_tp_group* tp = &t->groups.tp;
    const float eps = (float)t->cfg.norm_epsilon;
    T* gathered = (T*)a->gathered;
    const int last = ch.first + ch.count - 1;
    const layer_view<T> v = chunk_layer<T>(t, ch, l);
    const layer_tensors<T> p = layer_params<T>(t, l);
    fp8_linear f8[FP8_LINEARS];
    const bool fp8 = fp8_layer_linears<T>(t, ex, l, !replay && t->fp8.stale && t->fp8.stale[l], f8);
    const bool fuse_norms = t->fp8.fused && !tp->sp; /* the norms' FP8 outputs (not through an all-gather) */
    if (fp8 && ln1_fp8) f8[FP8_QKV].x8_ready = 1;

    /* attention block: ln1 = norm1(x) is already there (or only its FP8 bytes, ln1_fp8) */
    const T* ln1_in = column_parallel_input<T>(tp, gathered, v.ln1, s.R, s.h);
    linear_forward<T>(ex, v.qkv, ln1_in, p.qkv_w, p.qkv_b, s.BT, s.h, s.qkv_width, fp8 ? &f8[FP8_QKV] : NULL);
    attention_forward<T>(t, ex, v.qkv, v.probs, v.lse, v.attn, l);
    linear_forward<T>(ex, (T*)a->branch, v.attn, p.proj_w, (const T*)NULL, s.BT, s.attn_width, s.h,
                      fp8 ? &f8[FP8_PROJ] : NULL);
    T* proj = row_parallel_output<T>(tp, (T*)a->branch, (T*)a->rows, s.BT, s.R, s.h);
    /* mid = x + dropout(proj + bias); ln2 = norm2(mid) */
    const fp8_out ln2_8 = fp8 && fuse_norms && !s.moe ? fp8_input_out(&f8[FP8_FC1]) : fp8_out();
    if (residual_norm_forward<T>(ex, v.mid, v.ln2, v.ln2_mean, v.ln2_rstd, v.x, proj, p.proj_b, p.ln2_w, p.ln2_b, s.R,
                                 s.h, eps, s.rms, s.norm_w1, dropout_site(t, ex, l, DROPOUT_PROJ), ln2_8))
        f8[FP8_FC1].x8_ready = 1, t->fp8.fused_casts++;

    /* MLP block (an MoE layer's: router, experts and shared expert, moe_forward; a replay takes the kept
     * routing and recomputes the experts and the shared expert, its output too when !output: the gated
     * shared expert's backward reads it) */
    const T* ln2_in = column_parallel_input<T>(tp, gathered, v.ln2, s.R, s.h);
    T* fc2 = (T*)a->branch;
    if (s.moe) {
        moe_forward<T>(t, ex, s, v, p, l, ln2_in, fc2, replay);
        if (!output) return false;
    } else {
        const fp8_out act8 = fp8 && output ? fp8_input_out(&f8[FP8_FC2]) : fp8_out();
        if (mlp_up_forward<T>(ex, s, v, p, ln2_in, fp8 ? &f8[FP8_FC1] : NULL, act8))
            f8[FP8_FC2].x8_ready = 1, t->fp8.fused_casts++;
        if (!output) return false;
        linear_forward<T>(ex, (T*)a->branch, v.act, p.fc2_w, (const T*)NULL, s.BT, s.f, s.h, fp8 ? &f8[FP8_FC2] : NULL);
        fc2 = row_parallel_output<T>(tp, (T*)a->branch, (T*)a->rows, s.BT, s.R, s.h);
    }
    /* out = mid + dropout(fc2 + bias); then the next norm: layer l+1's first, or the final norm */
    if (!replay) wait_for_parameters(t, l + 1);
    const mt_dropout fc2_drop = dropout_site(t, ex, l, DROPOUT_FC2);
    if (l < last) { /* next.ln1 only as FP8 bytes where layer l+1's QKV takes them (fp8_input_out) */
        const layer_view<T> next = chunk_layer<T>(t, ch, l + 1);
        const layer_tensors<T> np = layer_params<T>(t, l + 1);
        fp8_linear nf8[FP8_LINEARS];
        const bool next8 = fuse_norms && fp8_layer_linears<T>(t, ex, l + 1, false, nf8);
        const bool wrote = residual_norm_forward<T>(ex, v.out, next8 ? (T*)NULL : next.ln1, next.ln1_mean, next.ln1_rstd,
                                                    v.mid, fc2, p.fc2_b, np.ln1_w, np.ln1_b, s.R, s.h, eps, s.rms,
                                                    s.norm_w1, fc2_drop, next8 ? fp8_input_out(&nf8[FP8_QKV]) : fp8_out());
        if (wrote) t->fp8.fused_casts++;
        return wrote;
    } else if (ch.head) {
        residual_norm_forward<T>(ex, v.out, (T*)a->lnf, a->lnf_mean, a->lnf_rstd, v.mid, fc2, p.fc2_b,
                                 param_ptr<T>(t, MT_P_FINAL_LN_WEIGHT), param_ptr<T>(t, MT_P_FINAL_LN_BIAS), s.R, s.h,
                                 eps, s.rms, s.norm_w1, fc2_drop);
    } else { /* the chunk's output, for the next pipeline stage */
        bias_residual<T>(ex, v.out, v.mid, fc2, p.fc2_b, s.R, s.h, fc2_drop);
    }
    return false;
}

/* Forward of one model chunk of one micro-batch. The first chunk embeds the inputs already on the
 * device; any other finds the previous stage's output in its residual[0]. The last chunk leaves
 * the logits (or, when grad_scale != 0, their gradient) in act.logits and per-token losses in
 * act.losses; any other leaves its output in chunk_output for the next stage.
 * Each residual add is fused with the norm that follows it: the attention residual with the MLP's
 * norm, the MLP residual with the next layer's first norm (or the final norm). With tensor
 * parallelism: QKV and fc1 are column-parallel, proj and fc2 row-parallel, the embedding and the
 * output layer vocab-parallel (section 16). */
template <typename T>
static void model_forward(mt_trainer* t, const mt_exec* ex, float grad_scale, model_chunk ch) {
    mt_shape s = model_shape(t);
    mt_activations* a = &t->act;
    mt_tp_group* tp = &t->groups.tp;
    float eps = (float)t->cfg.norm_epsilon;
    T* gathered = (T*)a->gathered;
    const int last = ch.first + ch.count - 1;
    if (t->fp8.unpublished) fp8_publish_parameters(t); /* --fp8-param-gather: the step's new weights */

    /* embedding: this rank's vocabulary rows (position embeddings added on TP rank 0), summed over TP */
    if (ch.embedding) {
        wait_for_parameters(t, -1);
        T* embedded = s.sp ? (T*)a->branch : (T*)a->residual;
        embedding_forward<T>(ex, embedded, a->inputs, param_ptr<T>(t, MT_P_WORD_EMBEDDINGS),
                             s.tp_rank == 0 ? param_ptr<T>(t, MT_P_POSITION_EMBEDDINGS) : (const T*)NULL, s.BT, s.S,
                             s.h, s.vocab_start, s.V, mt_explicit_positions(&t->cfg) ? a->docs + s.BT : (const int32_t*)NULL);
        row_parallel_output<T>(tp, embedded, (T*)a->residual, s.BT, s.R, s.h); /* the sum lands in a->residual */
        const mt_dropout drop = dropout_site(t, ex, -1, DROPOUT_EMBEDDING); /* Megatron's embedding dropout */
        if (drop.on) dropout_apply<T>(ex, (T*)a->residual, (const T*)a->residual, drop, s.R, s.h);
    }
    bool ln1_fp8 = false; /* the first norm writes only the FP8 bytes where QKV takes them (layer_forward) */
    if (ch.count > 0) {
        wait_for_parameters(t, ch.first);
        const layer_tensors<T> p = layer_params<T>(t, ch.first);
        const layer_view<T> v = chunk_layer<T>(t, ch, ch.first);
        fp8_linear f8[FP8_LINEARS];
        const bool fp8 = t->fp8.fused && !tp->sp && fp8_layer_linears<T>(t, ex, ch.first, false, f8);
        ln1_fp8 = norm_forward<T>(ex, fp8 ? (T*)NULL : v.ln1, v.ln1_mean, v.ln1_rstd, v.x, p.ln1_w, p.ln1_b, s.R, s.h,
                                  eps, s.rms, s.norm_w1, fp8 ? fp8_input_out(&f8[FP8_QKV]) : fp8_out());
        if (ln1_fp8) t->fp8.fused_casts++;
    }
    for (int l = ch.first; l <= last; l++) ln1_fp8 = layer_forward<T>(t, ex, ch, l, false, true, ln1_fp8);

    if (t->fp8.stale) memset(t->fp8.stale + ch.first, 0, (size_t)ch.count);
    if (!ch.head) return;
    if (ch.count == 0) /* a head without layers: the final norm of the received stream (bucket 0: wait for it) */
        wait_for_parameters(t, s.L), norm_forward<T>(ex, (T*)a->lnf, a->lnf_mean, a->lnf_rstd, (const T*)a->residual,
                        param_ptr<T>(t, MT_P_FINAL_LN_WEIGHT), param_ptr<T>(t, MT_P_FINAL_LN_BIAS), s.R, s.h, eps, s.rms,
                        s.norm_w1);

    /* output layer (tied to the word embeddings, or untied; vocab-parallel), cross entropy */
    const T* lnf_in = column_parallel_input<T>(tp, gathered, (const T*)a->lnf, s.R, s.h);
    linear_forward<T>(ex, (T*)a->logits, lnf_in, output_weight<T>(t), (const T*)NULL, s.BT, s.h, (int)s.V);
    cross_entropy<T>(t, ex, grad_scale);
}

/* With sequence parallelism the norms' weights and biases and the row-parallel biases see only
 * this rank's rows: once a layer's gradients are final (the step's last micro-batch), they are
 * summed over TP (Megatron's sequence-parallel gradient all-reduce), before any DP reduction. The
 * query and key norms (--qk-layernorm), whole on every TP rank, see only this rank's heads: theirs
 * are summed over TP with or without SP (Megatron's _allreduce_non_tensor_model_parallel_grads does
 * so for every q_layernorm / k_layernorm parameter). */
static void reduce_sequence_parallel_gradients(mt_trainer* t, const mt_exec* ex, int layer) {
    mt_shape s = model_shape(t);
    const bool qk = s.qk_norm && s.tp > 1 && layer < s.L;
    if ((!s.sp && !qk) || !ex->mode.last) return;
    static const int per_layer[] = {MT_P_LN1_WEIGHT, MT_P_LN1_BIAS, MT_P_PROJ_BIAS, MT_P_LN2_WEIGHT, MT_P_LN2_BIAS,
                                    MT_P_FC2_BIAS};
    static const int final_norm[] = {MT_P_FINAL_LN_WEIGHT, MT_P_FINAL_LN_BIAS};
    static const int qk_norms[] = {MT_P_Q_LAYERNORM_WEIGHT, MT_P_Q_LAYERNORM_BIAS, MT_P_K_LAYERNORM_WEIGHT,
                                   MT_P_K_LAYERNORM_BIAS};
    int list[10], count = 0;
    for (int i = 0; s.sp && i < (layer == s.L ? 2 : 6); i++) list[count++] = layer == s.L ? final_norm[i] : per_layer[i];
    for (int i = 0; qk && i < 4; i++) list[count++] = qk_norms[i];
    mt_tp_group* tp = &t->groups.tp;
    tp_after_compute(tp);
    NCCL_CHECK(ex->error, tp->world_rank, ncclGroupStart());
    for (int i = 0; i < count; i++) {
        float* grad = grad_ptr(t, list[i], layer == s.L ? 0 : layer);
        const size_t n = list[i] >= MT_P_Q_LAYERNORM_WEIGHT && list[i] <= MT_P_K_LAYERNORM_BIAS ? (size_t)s.d : (size_t)s.h;
        if (grad)
            NCCL_CHECK(ex->error, tp->world_rank, ncclAllReduce(grad, grad, n, ncclFloat, ncclSum, tp->comm, tp->stream));
    }
    NCCL_CHECK(ex->error, tp->world_rank, ncclGroupEnd());
    tp_join(tp);
}

/* The gradient reaching a row-parallel linear's output (proj or fc2 of layer l) from the residual
 * stream's gradient dres [R, h]: dres itself, or with hidden dropout dropout(dres) with the forward's
 * mask, into act.branch (free until the linear's backward has read it), whose column sums are then
 * the bias gradient (bias_grad may be NULL: no bias). */
template <typename T>
static const T* hidden_dropout_backward(mt_trainer* t, const mt_exec* ex, const T* dres, float* bias_grad, int l,
                                        int site) {
    const mt_dropout drop = dropout_site(t, ex, l, site);
    if (!drop.on) return dres;
    const mt_shape s = model_shape(t);
    T* out = (T*)t->act.branch;
    dropout_apply<T>(ex, out, dres, drop, s.R, s.h);
    if (bias_grad) column_sum<T>(ex, &t->colsum, bias_grad, out, s.R, s.h);
    return out;
}

/* Activation recompute (megatron.h mt_recompute), before layer l's backward: what the forward did
 * not keep, made again by the forward's own kernels from what it kept, so bit for bit what the
 * forward made (the same inputs, kernels and arguments; counter-based dropout masks would come out
 * the same too). Full: mt_recompute_replay's layers replayed from the kept input of the first
 * (its ln1 from the kept statistics, as the backward makes it anyway). Selective: the second norm's
 * output from its statistics (layernorm); fc1 and the activation (mlp), or the activation alone
 * from the kept pre-activation, whose bias is already in it (act; the bf16 GELU epilogue only
 * comes from its GEMM); the attention probabilities (core_attn, exact path). */
template <typename T>
static void recompute_layer(mt_trainer* t, const mt_exec* ex, const model_chunk& ch, int l) {
    const mt_recompute* rc = &t->cfg.recompute;
    const mt_shape s = model_shape(t);
    int64_t from = 0;
    if (mt_recompute_replay(rc, ch.count, l - ch.first, &from)) {
        const int first = ch.first + (int)from;
        const layer_view<T> g = chunk_layer<T>(t, ch, first);
        const layer_tensors<T> gp = layer_params<T>(t, first);
        norm_apply<T>(ex, g.ln1, g.x, g.ln1_mean, g.ln1_rstd, gp.ln1_w, gp.ln1_b, s.R, s.h, s.norm_w1);
        bool ln1_fp8 = false; /* g.ln1 in bf16 above; the replayed norms as the forward's */
        for (int k = first; k <= l; k++) ln1_fp8 = layer_forward<T>(t, ex, ch, k, true, k < l, ln1_fp8);
        return;
    }
    if (rc->granularity != MT_RECOMPUTE_SELECTIVE) return;
    const int modules = rc->modules ? rc->modules : MT_RECOMPUTE_CORE_ATTN;
    const mt_shape ls = layer_shape(t, l); /* an MoE layer's MLP regions are its shared expert's (none: nothing) */
    const bool mlp_regions = !ls.moe || ls.f > 0;
    const layer_view<T> v = chunk_layer<T>(t, ch, l);
    const layer_tensors<T> p = layer_params<T>(t, l);
    fp8_linear f8[FP8_LINEARS];
    const bool fp8 = fp8_layer_linears<T>(t, ex, l, false, f8);
    if (modules & MT_RECOMPUTE_LAYERNORM)
        norm_apply<T>(ex, v.ln2, v.mid, v.ln2_mean, v.ln2_rstd, p.ln2_w, p.ln2_b, s.R, s.h, s.norm_w1);
    /* GELU: the forward's act came from the fc1 GEMM's epilogue (bf16 or FP8), so its bits come back
     * only through that GEMM again */
    if (!mlp_regions) {
    } else if ((modules & MT_RECOMPUTE_MLP) || ((modules & MT_RECOMPUTE_ACT) && gelu_fused<T>(ls))) {
        const T* ln2_in = column_parallel_input<T>(&t->groups.tp, (T*)t->act.gathered, v.ln2, s.R, s.h);
        mlp_up_forward<T>(ex, ls, v, p, ln2_in, fp8 ? &f8[FP8_FC1] : NULL);
    } else if (modules & MT_RECOMPUTE_ACT) {
        mlp_activation<T>(ex, ls, v, (const T*)NULL);
    }
    if ((modules & MT_RECOMPUTE_CORE_ATTN) && v.probs) attention_probabilities<T>(t, ex, v.qkv, v.probs, l);
    /* an MoE layer (after ln2 above): its experts and shared expert from the kept routing (moe), or the
     * experts' activation alone from their kept fc1 output (moe_act) */
    if (ls.moe && (modules & MT_RECOMPUTE_MOE)) {
        const T* ln2_in = column_parallel_input<T>(&t->groups.tp, (T*)t->act.gathered, v.ln2, s.R, s.h);
        moe_forward<T>(t, ex, ls, v, p, l, ln2_in, (T*)t->act.branch, true);
    } else if (ls.moe && (modules & MT_RECOMPUTE_MOE_ACT)) {
        moe_recompute_act<T>(t, ex, ls, v);
    }
}

/* Backward of one model chunk of a micro-batch whose forward ran with grad_scale != 0: accumulates
 * the chunk's parameter gradients into t->grads (fp32), or writes them when
 * ex->mode.accumulate_gradients is 0 (the chunk's first micro-batch: every tensor it holds is
 * written below). The last chunk starts from the logits' gradient; any other from the gradient of
 * its output, received into act.dresidual. The first chunk ends in the embeddings (`unique_tokens`
 * describes the word-embedding index: this rank's vocabulary rows only); any other leaves the
 * gradient of its input in act.dresidual for the previous stage. */
template <typename T>
static void model_backward(mt_trainer* t, const mt_exec* ex, int unique_tokens, model_chunk ch) {
    mt_shape s = model_shape(t);
    mt_activations* a = &t->act;
    mt_colsum_scratch* cs = &t->colsum;
    mt_tp_group* tp = &t->groups.tp;
    int64_t Rh = (int64_t)s.R * s.h;
    T* dres = (T*)a->dresidual;
    T* gathered_grad = (T*)a->gathered_grad;
    const parallel_backward_ctx<T> pc = {ex, cs, tp, s.BT, s.R, (T*)a->gathered, gathered_grad, (T*)a->rows};

    const int last = ch.first + ch.count - 1;
    /* with hidden dropout the branches' gradients are dropout(dres), not dres: the row-parallel bias
     * gradients are then their column sums (hidden_dropout_backward), not the norm backward's of dres */
    const bool hidden_drop = dropout_site(t, ex, 0, DROPOUT_FC2).on;
    if (ch.head) {
        /* output layer and final norm: dlnf = dlogits W (summed over TP); dW_out += dlogits^T lnf */
        CUDA_CHECK(ex->error, cudaMemsetAsync(dres, 0, Rh * sizeof(T), ex->stream));
        T* dlnf = column_parallel_backward<T>(pc, (T*)a->branch, output_weight_grad(t), (float*)NULL, (T*)a->logits,
                                              (T*)a->lnf, output_weight<T>(t), s.h, (int)s.V);
        norm_backward<T>(ex, cs, dres, grad_ptr(t, MT_P_FINAL_LN_WEIGHT), grad_ptr(t, MT_P_FINAL_LN_BIAS),
                         ch.count > 0 && !hidden_drop ? layer_grads(t, last).fc2_b : (float*)NULL, dlnf,
                         (T*)chunk_output(t, ch), param_ptr<T>(t, MT_P_FINAL_LN_WEIGHT), a->lnf_mean,
                         a->lnf_rstd, s.R, s.h, s.rms, s.norm_w1);
        reduce_sequence_parallel_gradients(t, ex, s.L);
        gradients_ready(t, ex, s.L);
    } else if (ch.count > 0 && layer_grads(t, last).fc2_b && !hidden_drop) {
        /* dres is d(output) from the next stage; the last fc2's bias gradient is its column sum */
        column_sum<T>(ex, cs, layer_grads(t, last).fc2_b, dres, s.R, s.h);
    }

    for (int l = last; l >= ch.first; l--) {
        s = layer_shape(t, l); /* an MoE model's dense layers: their own MLP */
        recompute_layer<T>(t, ex, ch, l);
        const layer_view<T> v = chunk_layer<T>(t, ch, l);
        const layer_tensors<T> p = layer_params<T>(t, l);
        const layer_tensors<float> dp = layer_grads(t, l);
        fp8_linear f8[FP8_LINEARS];
        const bool fp8 = fp8_layer_linears<T>(t, ex, l, false, f8);

        /* MLP block: dres is d(out); the branch sees the same gradient. d(act) -> branch2, then
         * d(fc1 output) in place (GELU, squared ReLU) or into branch (SwiGLU: twice as wide) */
        bool fused = gelu_fused<T>(s); /* d(act) and GELU's derivative in one GEMM (DGELU epilogue), or
                                          with FP8 after it by the kernel (linear_backward) */
        const T* dfc2 = hidden_dropout_backward<T>(t, ex, dres, dp.fc2_b, l, DROPOUT_FC2);
        T* dln2 = (T*)a->branch;
        if (s.moe) { /* d(ln2) into the first norm's scratch, free until the attention block remakes ln1 */
            dln2 = (T*)a->ln1;
            moe_backward<T>(t, ex, s, v, p, dp, l, dfc2, v.ln2, dln2);
        } else {
            row_parallel_backward<T>(pc, (T*)a->branch2, dp.fc2_w, dfc2, v.act, p.fc2_w, s.f, s.h,
                                     fused ? v.fc1 : (const T*)NULL, fp8 ? &f8[FP8_FC2] : NULL);
            T* dfc1 = (T*)a->branch2;
            if (s.swiglu) {
                swiglu_backward<T>(ex, (T*)a->branch, (T*)a->branch2, v.fc1, s.BT, s.f);
                dfc1 = (T*)a->branch;
                dln2 = (T*)a->branch2;
            } else if (!fused) {
                activation_backward<T>(ex, s.act, (T*)a->branch2, v.fc1, (int64_t)s.BT * s.f);
            }
            dln2 = column_parallel_backward<T>(pc, dln2, dp.fc1_w, dp.fc1_b, dfc1, v.ln2, p.fc1_w, s.h, s.f1,
                                               fp8 ? &f8[FP8_FC1] : NULL);
        }
        norm_backward<T>(ex, cs, dres, dp.ln2_w, dp.ln2_b, hidden_drop ? (float*)NULL : dp.proj_b, dln2, v.mid, p.ln2_w,
                         v.ln2_mean, v.ln2_rstd, s.R, s.h, s.rms, s.norm_w1);

        /* attention block: dres is now d(mid) */
        const T* dproj = hidden_dropout_backward<T>(t, ex, dres, dp.proj_b, l, DROPOUT_PROJ);
        row_parallel_backward<T>(pc, (T*)a->branch2, dp.proj_w, dproj, v.attn, p.proj_w, s.attn_width, s.h,
                                 (const T*)NULL, fp8 ? &f8[FP8_PROJ] : NULL);
        float* dqkv_bias = dp.qkv_b;
        if (attention_backward<T>(t, ex, (T*)a->branch, (T*)a->branch2, v.qkv, v.probs, v.lse, v.attn, dqkv_bias, l))
            dqkv_bias = NULL; /* taken from the attention kernels */
        /* ln1 again; where QKV's weight gradient is FP8 and takes it as is (no all-gather), only its FP8
         * bytes (x8, the forward's scale) and their transpose, its operand: bitwise the recast's */
        const bool ln1_8 = fp8 && t->fp8.fused && t->fp8.wgrad && !tp->sp;
        if (norm_apply<T>(ex, ln1_8 ? (T*)NULL : v.ln1, v.x, v.ln1_mean, v.ln1_rstd, p.ln1_w, p.ln1_b, s.R, s.h,
                          s.norm_w1, ln1_8 ? fp8_input_out(&f8[FP8_QKV], false) : fp8_out()) &&
            fp8_transpose(ex, t->fp8.x8t, t->fp8.x8, s.R, s.h))
            f8[FP8_QKV].x8t_ready = 1, t->fp8.fused_casts++;
        T* dln1 = column_parallel_backward<T>(pc, (T*)a->branch2, dp.qkv_w, dqkv_bias, (T*)a->branch, v.ln1, p.qkv_w,
                                              s.h, s.qkv_width, fp8 ? &f8[FP8_QKV] : NULL);
        norm_backward<T>(ex, cs, dres, dp.ln1_w, dp.ln1_b,
                         l > ch.first && !hidden_drop ? layer_grads(t, l - 1).fc2_b : (float*)NULL, dln1,
                         v.x, p.ln1_w, v.ln1_mean, v.ln1_rstd, s.R, s.h, s.rms, s.norm_w1);
        reduce_sequence_parallel_gradients(t, ex, l);
        gradients_ready(t, ex, l);
    }

    if (!ch.embedding) return; /* dres: the gradient of the chunk's input, for the previous stage */
    const mt_dropout emb_drop = dropout_site(t, ex, -1, DROPOUT_EMBEDDING); /* through the embedding dropout */
    if (emb_drop.on) dropout_apply<T>(ex, dres, (const T*)dres, emb_drop, s.R, s.h);
    /* embeddings: dres is d(embedding output) (gathered to every row with sequence parallelism, so
     * the position embeddings' gradient is whole on every TP rank) */
    const T* demb = column_parallel_input<T>(tp, gathered_grad, dres, s.R, s.h);
    float* dwpe = grad_ptr(t, MT_P_POSITION_EMBEDDINGS);
    if (dwpe) /* with reset positions: by the index stage_micro_batch built after the word index */
        position_embedding_backward<T>(ex, dwpe, demb, s.B, s.S_full, s.h,
                                       mt_explicit_positions(&t->cfg) ? a->embed_index + 3 * s.BT + 2 : (const int32_t*)NULL);
    /* the word embeddings' gradient is a scatter-add over the micro-batch's tokens: tied on one stage,
     * the output layer's weight GEMM wrote the whole tensor above; else the first micro-batch zeroes it */
    float* dwte = grad_ptr(t, MT_P_WORD_EMBEDDINGS);
    if (!ex->mode.accumulate_gradients && !(ch.head && dwte == output_weight_grad(t)))
        CUDA_CHECK(ex->error, cudaMemsetAsync(dwte, 0, sizeof(float) * (size_t)s.V * s.h, ex->stream));
    word_embedding_backward<T>(ex, dwte, demb, a->embed_index, unique_tokens, s.BT, s.h, s.vocab_start);
    gradients_ready(t, ex, -1);
}

/* ============================================================================================== */
/* 18. The micro-batch loop                                                                       */
/*    One stage, the micro-batches in order, forward then backward for each (pipeline schedules   */
/*    are not built yet). Stages one micro-batch's tokens onto the device, builds its mode        */
/*    (first micro-batch overwrites gradients, the last one's backward starts the DP reductions)  */
/*    and runs it.                                                                                */
/*    defines: stage_micro_batch, run_step, run_micro_batches.                                    */
/* ============================================================================================== */

/* Builds the word-embedding backward index of one micro-batch on the host: the distinct tokens of
 * this rank's vocabulary rows [first, first + V) in increasing order, offsets into a position list,
 * and each token's positions in increasing order (counting sort). Layout: [unique (BT+1)]
 * [offsets (BT+1)] [positions (BT)]. Returns #unique. */
static int build_embedding_index(int32_t* index, const int32_t* inputs, int BT, int64_t first, int64_t V,
                                 int32_t* counts) {
    int32_t* unique = index;
    int32_t* offsets = index + BT + 1;
    int32_t* positions = index + 2 * (BT + 1);
    memset(counts, 0, sizeof(int32_t) * (size_t)V);
    for (int i = 0; i < BT; i++)
        if (inputs[i] >= first && inputs[i] < first + V) counts[inputs[i] - first]++;
    int n = 0, running = 0;
    for (int64_t v = 0; v < V; v++) {
        if (!counts[v]) continue;
        unique[n] = (int32_t)(first + v);
        offsets[n] = running;
        int c = counts[v];
        counts[v] = running; /* becomes the write cursor */
        running += c;
        n++;
    }
    offsets[n] = running;
    for (int i = 0; i < BT; i++)
        if (inputs[i] >= first && inputs[i] < first + V) positions[counts[inputs[i] - first]++] = i;
    return n;
}

/* The word embedding's backward index of the inputs stage_micro_batch just staged (its host rows; with
 * explicit positions the position index after it, from the staged positions) built on the host and copied
 * to act.embed_index on the stream; *unique_out: the distinct token count. At PP = 1 the trainer calls it
 * after launching the forward (the counting sort, ~0.3 ms at 16k tokens, then runs while the GPU works:
 * it left the GPU idle at the start of every GPT-2 124M step, dev/bench/trace_step.sh); the backward,
 * which reads it, is queued after the copy. */
static void stage_embedding_index(mt_trainer* t, int* unique_out) {
    const mt_shape s = model_shape(t);
    const int32_t* inputs = t->loop.host_tokens;
    int32_t* counts = t->loop.host_tokens + 2 * s.BT;
    const int32_t* docs = t->loop.host_tokens + 2 * s.BT + s.V_full; /* stage_micro_batch's doc_start, positions */
    *unique_out = build_embedding_index(t->loop.host_index, inputs, s.BT, s.vocab_start, s.V, counts);
    size_t words = 3 * (size_t)s.BT + 2;
    if (mt_explicit_positions(&t->cfg)) { /* the position index after the word index (MT_ACT_EMBED_INDEX) */
        int32_t* pos_index = t->loop.host_index + words;
        mt_position_index(docs + s.BT, s.BT, s.S_full, pos_index, pos_index + s.S_full + 1);
        words += (size_t)s.S_full + 1 + s.BT;
    }
    CUDA_CHECK(&t->error, cudaMemcpyAsync(t->act.embed_index, t->loop.host_index, sizeof(int32_t) * words,
                                          cudaMemcpyHostToDevice, t->stream));
}

/* Copies micro-batch `mb` of tokens [*, B, S+1] to the device as inputs/targets (+ backward index);
 * with --reset-position-ids / --reset-attention-mask also its documents into the running slot's
 * act.docs (mt_document_boundaries), and with reset positions the position index after the word index.
 * With context parallelism every CP rank holds the whole micro-batch and stages its own rows (chunks
 * cp_rank and 2 CP - 1 - cp_rank of each sample): their inputs, targets, positions (the reset ones, or
 * their sequence positions) and doc_start, the position index, and for a2a the whole samples' doc_start
 * and positions. */
static mt_status stage_micro_batch(mt_trainer* t, const int32_t* tokens, int mb, int with_index, int* unique_out,
                                   mt_error* err) {
    mt_shape s = model_shape(t);
    const mt_config* c = &t->cfg;
    const mt_seq_span span = cp_query_span(s);
    const int64_t BS = (int64_t)s.B * s.S_full; /* the whole micro-batch's rows */
    const int32_t* src = tokens + (int64_t)mb * s.B * (s.S_full + 1);
    int32_t* inputs = t->loop.host_tokens;
    int32_t* targets = t->loop.host_tokens + s.BT;
    for (int b = 0; b < s.B; b++) { /* ids range-checked by run_micro_batches, on every rank */
        for (int i = 0; i < s.S; i++) {
            const int p = seq_span_position(span, i);
            inputs[b * s.S + i] = src[(int64_t)b * (s.S_full + 1) + p];
            targets[b * s.S + i] = src[(int64_t)b * (s.S_full + 1) + p + 1];
        }
    }
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream)); /* the staging buffers are about to be reused */
    CUDA_CHECK(&t->error, cudaMemcpyAsync(t->act.inputs, inputs, sizeof(int32_t) * s.BT, cudaMemcpyHostToDevice,
                                          t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(t->act.targets, targets, sizeof(int32_t) * s.BT, cudaMemcpyHostToDevice,
                                          t->stream));
    int32_t* docs = t->loop.host_tokens + 2 * s.BT + s.V_full; /* [2, BT]: doc_start, positions (CP: then [2, BS]) */
    if (s.cp > 1) { /* the whole samples' documents (positions 0.. without resets), then this rank's rows' */
        int32_t* whole_inputs = docs + 2 * s.BT + 2 * BS;
        int32_t *whole_start = docs + 2 * s.BT, *whole_pos = whole_start + BS;
        for (int b = 0; b < s.B; b++)
            memcpy(whole_inputs + (int64_t)b * s.S_full, src + (int64_t)b * (s.S_full + 1), sizeof(int32_t) * s.S_full);
        mt_document_boundaries(whole_inputs, s.B, s.S_full, c->eod_token, whole_start, whole_pos);
        for (int b = 0; b < s.B; b++)
            for (int i = 0; i < s.S; i++) {
                const int64_t at = (int64_t)b * s.S_full + seq_span_position(span, i);
                docs[b * s.S + i] = c->reset_attention_mask ? whole_start[at] : 0;
                docs[s.BT + b * s.S + i] = c->reset_position_ids ? whole_pos[at] : seq_span_position(span, i);
            }
        if (!c->reset_position_ids)
            for (int64_t r = 0; r < BS; r++) whole_pos[r] = (int32_t)(r % s.S_full);
        CUDA_CHECK(&t->error, cudaMemcpyAsync(t->act.docs, docs, sizeof(int32_t) * (2 * s.BT + 2 * BS),
                                              cudaMemcpyHostToDevice, t->stream));
    } else if (c->reset_position_ids || c->reset_attention_mask) {
        mt_document_boundaries(inputs, s.B, s.S, c->eod_token, docs, docs + s.BT);
        CUDA_CHECK(&t->error, cudaMemcpyAsync(t->act.docs, docs, sizeof(int32_t) * 2 * s.BT, cudaMemcpyHostToDevice,
                                              t->stream));
    }
    if (with_index) stage_embedding_index(t, unique_out);
    return mt_gpu_error_return(&t->error, err);
}

/* --eod-mask-loss (Megatron's loss mask): a position counts in the loss unless its *input* token
 * is the end-of-document token. Whether this rank's row i (its sample i / S, sequence position
 * cp_query_span's) of micro-batch mb of tokens [*, B, S_full+1] counts. */
static int position_counts(const mt_config* c, const mt_shape& s, const int32_t* tokens, int mb, int i) {
    if (!c->eod_mask_loss) return 1;
    const int32_t* row = tokens + ((int64_t)mb * s.B + i / s.S) * (s.S_full + 1);
    return row[seq_span_position(cp_query_span(s), i % s.S)] != c->eod_token;
}

/* The counted positions of the whole micro-batch (every CP rank's rows). */
static int64_t micro_batch_counted(const mt_config* c, const mt_shape& s, const int32_t* tokens, int mb) {
    if (!c->eod_mask_loss) return (int64_t)s.B * s.S_full;
    int64_t n = 0;
    for (int b = 0; b < s.B; b++) {
        const int32_t* row = tokens + ((int64_t)mb * s.B + b) * (s.S_full + 1);
        for (int p = 0; p < s.S_full; p++) n += row[p] != c->eod_token;
    }
    return n;
}

/* The masked positions' loss gradient (their rows of act.logits, which the cross entropy has just
 * overwritten with the gradient) set to zero: what multiplying the per-token losses by the mask does. */
static void zero_masked_gradients(mt_trainer* t, const int32_t* tokens, int mb) {
    mt_shape s = model_shape(t);
    size_t row_bytes = (size_t)s.V * t->elem;
    for (int i = 0; i < s.BT; i++)
        if (!position_counts(&t->cfg, s, tokens, mb, i))
            CUDA_CHECK(&t->error, cudaMemsetAsync((char*)t->act.logits + (size_t)i * row_bytes, 0, row_bytes, t->stream));
}

/* Sum of the counted per-token losses of micro-batch mb, just run (host, double, in order). */
static double micro_batch_loss_sum(mt_trainer* t, const int32_t* tokens, int mb) {
    const mt_shape s = model_shape(t);
    CUDA_CHECK(&t->error, cudaMemcpyAsync(t->loop.host_losses, t->act.losses, sizeof(float) * s.BT,
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    double sum = 0.0;
    for (int i = 0; i < s.BT; i++)
        if (position_counts(&t->cfg, s, tokens, mb, i)) sum += t->loop.host_losses[i];
    return sum;
}

static void finish_gradient_reduction(mt_trainer* t);
typedef enum { GROUP_DP, GROUP_TP, GROUP_PP, GROUP_WORLD, GROUP_CP } mt_group_kind;
static mt_status all_reduce_sum(mt_trainer* t, double* value, mt_group_kind group, mt_error* err);

/* Pipeline rank `rank`'s steps for `count` micro-batches: a training step's schedule (megatron.h
 * mt_pp_schedule: 1F1B, interleaved with virtual stages; PP = 1: F0 B0 F1 B1 ...), or for evaluation
 * the forwards alone, micro-batch by micro-batch through the chunks. Returns a malloc'd [*num_ops]. */
static mt_pp_op* pipeline_steps(int pp, int vp, int rank, int group_size, int count, int train, int* num_ops,
                                int* num_warmup, mt_error* err) {
    mt_pp_op* ops = (mt_pp_op*)malloc(sizeof(mt_pp_op) * 2 * (size_t)count * vp);
    if (!ops) {
        mt_fail(err, MT_ERR_OOM, "cannot allocate the pipeline schedule");
        return NULL;
    }
    if (train) {
        if (mt_pp_schedule(pp, vp, count, group_size, rank, ops, num_warmup, err) != MT_OK) {
            free(ops);
            return NULL;
        }
        *num_ops = 2 * count * vp;
        return ops;
    }
    int n = 0;
    for (int mb = 0; mb < count; mb++)
        for (int c = 0; c < vp; c++) {
            int v = c * pp + rank;
            mt_pp_op op = {MT_PP_FORWARD, mb, c, v > 0 ? (rank + pp - 1) % pp : -1, v < pp * vp - 1 ? (rank + 1) % pp : -1};
            ops[n++] = op;
        }
    *num_ops = *num_warmup = n;
    return ops;
}
static mt_pp_op* trainer_steps(const mt_trainer* t, int count, int train, int* num_ops, int* num_warmup,
                               mt_error* err) {
    return pipeline_steps(t->groups.pp_size, t->buffer.stage.num_chunks, t->groups.pp_rank,
                          t->cfg.microbatch_group_size_per_vp_stage, count, train, num_ops, num_warmup, err);
}

/* The engine runs a schedule in units, Megatron's way, and before each unit one exchange sends what
 * the previous unit produced and receives what this unit needs. Non-interleaved (VP = 1) a unit is
 * one step, as schedules.py's 1F1B exchanges after every step (send_forward_recv_backward between a
 * steady forward and its backward, send_backward_recv_forward after the backward): a stage's output
 * leaves as soon as it exists, and the next stage computes while this one runs its backward (one
 * exchange per forward-backward pair held each output back a whole backward and ran the two stages
 * of a PP 2 pipeline mostly in turn: 0.9x the time of one GPU, measured). Interleaved (VP > 1) a
 * steady forward and the backward after it form one unit with one exchange after both
 * (send_forward_backward_recv_forward_backward); warm-up forwards and cool-down backwards are units
 * alone. Pairs of neighbours that send to each other then never wait on each other
 * (tests/test_pipeline.h simulates every setting). Returns one past the last op of the unit that
 * starts at op k. */
static int pipeline_unit_end(const mt_pp_op* ops, int num_ops, int num_warmup, int vp, int k) {
    if (vp > 1 && k >= num_warmup && ops[k].kind == MT_PP_FORWARD && k + 1 < num_ops &&
        ops[k + 1].kind == MT_PP_BACKWARD)
        return k + 2;
    return k + 1;
}

/* One batched exchange between pipeline stages: the tensors the previous unit produced and those
 * this unit needs (each [R, h] in the model type; at most two of each). Activations and gradients
 * go over two communicators, each matched in its own posting order, which both neighbours share
 * (with one, PP 2 x VP 2 would pair a gradient with an activation); each kind is one NCCL group on
 * its own stream, so a receive still waiting cannot hold back a send of the other kind (on one
 * stream NCCL ran the two communicators' kernels one after the other and the pair deadlocked). The
 * streams start after the compute so far; the compute waits for a kind when a step needs it
 * (pipeline_wait). */
typedef struct {
    const void* send[2];
    int send_rank[2], send_grad[2], num_send;
    void* recv[2];
    int recv_rank[2], recv_grad[2], num_recv;
} pipeline_transfers;
static void pipeline_exchange(mt_trainer* t, const pipeline_transfers* x) {
    if (x->num_send + x->num_recv == 0) return;
    mt_shape s = model_shape(t);
    const size_t n = (size_t)s.R * s.h;
    mt_process_groups* g = &t->groups;
    /* each communicator's operations on its own stream, after the compute so far; compute waits for both
     * (on one stream NCCL would run the two communicators' kernels one after the other) */
    CUDA_CHECK(&t->error, cudaEventRecord(g->pp_ready, t->stream));
    for (int i = 0; i < 2; i++) CUDA_CHECK(&t->error, cudaStreamWaitEvent(g->pp_streams[i], g->pp_ready, 0));
    for (int kind = 0; kind < 2; kind++) { /* one group per communicator: no group spans both */
        ncclComm_t comm = kind ? g->pp_grad : g->pp;
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupStart());
        for (int i = 0; i < x->num_send; i++)
            if (x->send_grad[i] == kind)
                NCCL_CHECK(&t->error, t->cfg.rank,
                           ncclSend(x->send[i], n, g->tp.type, x->send_rank[i], comm, g->pp_streams[kind]));
        for (int i = 0; i < x->num_recv; i++)
            if (x->recv_grad[i] == kind)
                NCCL_CHECK(&t->error, t->cfg.rank,
                           ncclRecv(x->recv[i], n, g->tp.type, x->recv_rank[i], comm, g->pp_streams[kind]));
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupEnd());
    }
    for (int i = 0; i < 2; i++) CUDA_CHECK(&t->error, cudaEventRecord(g->pp_done[i], g->pp_streams[i]));
}
/* The compute stream waits for the last exchange's transfers of one kind (0 activations, 1 gradients):
 * a forward needs its input, a backward its gradient, and each kind's group also holds that kind's
 * sends, whose buffers the step may overwrite. (A forward does not wait for the gradient a backward
 * later in its unit receives: Megatron's 1F1B runs the forward first too.) */
static void pipeline_wait(mt_trainer* t, int kind) {
    if (t->groups.pp_size > 1) CUDA_CHECK(&t->error, cudaStreamWaitEvent(t->stream, t->groups.pp_done[kind], 0));
}

template <typename T>
static void run_step(mt_trainer* t, const mt_exec* ex, const mt_pp_op* op, float grad_scale, int unique) {
    if (op->kind == MT_PP_FORWARD) model_forward<T>(t, ex, grad_scale, chunk_of(t, op->chunk));
    else model_backward<T>(t, ex, unique, chunk_of(t, op->chunk));
}

/* One pass of run_micro_batches through this rank's schedule: what its steps share. */
typedef struct {
    const int32_t* tokens;  /* [count, B, S+1]: this rank's micro-batches */
    int count, train;
    double loss_scale;
    double* counted;        /* [count]: each micro-batch's counted positions */
    double tokens_counted;  /* their sum */
    double global_counted;  /* --calculate-per-token-loss in training: the global batch's (over DP) */
    int* slot_of;           /* [count * vp]: the activation slot of (micro-batch, chunk), from its forward on */
    int* free_slots;        /* [loop.num_slots]: the free slots, a stack */
    int num_free;
    pipeline_transfers x;   /* the previous unit's sends, then this unit's receives */
    double total;           /* the loss summed over the counted positions (on the last stage) */
} micro_batch_pass;

/* Each micro-batch's counted positions and their sum; in training with --calculate-per-token-loss,
 * the global batch's count (their sum over DP: collective). */
static mt_status count_loss_positions(mt_trainer* t, micro_batch_pass* p, mt_error* err) {
    const mt_config* c = &t->cfg;
    const mt_shape s = model_shape(t);
    for (int mb = 0; mb < p->count; mb++)
        p->tokens_counted += p->counted[mb] = (double)micro_batch_counted(c, s, p->tokens, mb);
    if (p->train && c->calculate_per_token_loss) {
        p->global_counted = p->tokens_counted;
        if (t->groups.dp_size > 1) { /* over DP x CP, whose CP ranks all counted the same micro-batches */
            mt_status st = all_reduce_sum(t, &p->global_counted, GROUP_DP, err);
            p->global_counted /= t->groups.cp_size;
            return st;
        }
    }
    return MT_OK;
}

/* Every pipeline rank refuses alike (one rank leaving alone would strand the others in NCCL) when
 * any rank's slots fall short of its schedule: each rank's are computed here from the tables (PP = 1
 * needs one slot and has it; a forward-only pass frees each slot at once and needs one too). */
static mt_status check_activation_slots(const mt_trainer* t, int count, int train, mt_error* err) {
    const mt_config* c = &t->cfg;
    const int pp = t->groups.pp_size, vp = t->buffer.stage.num_chunks;
    for (int r = 0; r < pp && pp > 1 && train; r++) {
        int made = 0, need = 0, n = 0, w = 0;
        mt_pp_op* theirs = pipeline_steps(pp, vp, r, c->microbatch_group_size_per_vp_stage, count, train, &n, &w, err);
        if (!theirs || mt_pp_activation_slots(pp, vp, mt_num_micro_batches(c), c->microbatch_group_size_per_vp_stage,
                                              r, &made, err) != MT_OK) {
            free(theirs);
            return MT_ERR_CONFIG;
        }
        need = mt_pp_slots_needed(theirs, n);
        free(theirs);
        if (need > made)
            return mt_fail(err, MT_ERR_CONFIG, "%d micro-batches need %d activation slots on pipeline rank %d; the "
                           "trainer has %d (made for %d micro-batches a step)", count, need, r, made,
                           mt_num_micro_batches(c));
    }
    return MT_OK;
}

/* Slots and receive buffers of the steps of the unit [u, end): a forward takes a free slot and
 * receives its input into the slot; a backward receives its output's gradient. */
static void unit_receives(mt_trainer* t, micro_batch_pass* p, const mt_pp_op* ops, int u, int end) {
    const int vp = t->buffer.stage.num_chunks;
    pipeline_transfers* x = &p->x;
    for (int k = u; k < end; k++) {
        const mt_pp_op* op = &ops[k];
        const int key = op->micro_batch * vp + op->chunk;
        if (op->kind == MT_PP_FORWARD) p->slot_of[key] = p->free_slots[--p->num_free];
        if (op->recv_rank < 0) continue;
        x->recv[x->num_recv] = op->kind == MT_PP_FORWARD ? t->loop.slots[p->slot_of[key]].residual : t->act.dresidual;
        x->recv_grad[x->num_recv] = op->kind == MT_PP_BACKWARD;
        x->recv_rank[x->num_recv++] = op->recv_rank;
    }
}

/* MT_PP_TRACE: the unit's transfers and steps, before its exchange. */
static void trace_unit(const mt_trainer* t, const pipeline_transfers* x, const mt_pp_op* ops, int u, int end) {
    fprintf(stderr, "pp rank %d unit %d:", t->groups.pp_rank, u);
    for (int i = 0; i < x->num_send; i++) fprintf(stderr, " send%s->%d", x->send_grad[i] ? "G" : "A", x->send_rank[i]);
    for (int i = 0; i < x->num_recv; i++) fprintf(stderr, " recv%s<-%d", x->recv_grad[i] ? "G" : "A", x->recv_rank[i]);
    for (int k = u; k < end; k++)
        fprintf(stderr, " %c(mb %d, chunk %d)", ops[k].kind == MT_PP_FORWARD ? 'F' : 'B', ops[k].micro_batch,
                ops[k].chunk);
    fprintf(stderr, "\n");
}

/* One step of the schedule: its slot becomes the running activations, its micro-batch is staged
 * where the step reads tokens, its mode is built and the forward or backward runs; the last stage
 * adds up the loss, what goes to a neighbour waits for the next exchange, and a slot whose work is
 * done is freed. */
static mt_status run_schedule_step(mt_trainer* t, micro_batch_pass* p, const mt_pp_op* op, mt_error* err) {
    const mt_config* c = &t->cfg;
    const mt_shape s = model_shape(t);
    /* dp: the data-parallel size (CP ranks share micro-batches; their gradients add over DP x CP) */
    const int dp = t->groups.data_size, pp = t->groups.pp_size, vp = t->buffer.stage.num_chunks;
    const int train = p->train, count = p->count;
    const bool forward = op->kind == MT_PP_FORWARD;
    const model_chunk ch = chunk_of(t, op->chunk);
    const int key = op->micro_batch * vp + op->chunk;
    t->act = t->loop.slots[p->slot_of[key]];
    /* the first chunk reads the inputs, the last the targets; the first chunk's backward builds
     * the word-embedding index (at PP = 1 with the forward: nothing runs between them) */
    int unique = 0;
    const bool index_now = ch.embedding && train && (forward ? pp == 1 : pp > 1);
    const bool docs = mt_explicit_positions(c) || c->reset_attention_mask; /* every forward stages the slot's */
    if ((forward && (ch.embedding || ch.head || docs)) || index_now) {
        /* at PP = 1 the index is built once the forward is queued (stage_embedding_index) */
        mt_status st = stage_micro_batch(t, p->tokens, op->micro_batch, index_now && !forward, &unique, err);
        if (st != MT_OK) return st;
    }
    if (!forward && pp == 1) unique = t->loop.pp_unique;
    /* Megatron pre-scales each rank's gradients by 1/dp and sums them; a zero scale still runs the
     * backward (the first micro-batch writes every gradient) */
    double denominator = c->calculate_per_token_loss ? p->global_counted : p->counted[op->micro_batch] * count * dp;
    float grad_scale = train && denominator > 0 ? (float)(p->loss_scale / denominator) : 0.0f;
    if (train && grad_scale == 0.0f) grad_scale = FLT_MIN;
    /* this step's mode; --overlap-grad-reduce (PP = 1): buckets go out during the last backward */
    mt_micro_batch_mode mode;
    mode.accumulate_gradients = op->micro_batch > 0;
    mode.last = train && op->micro_batch == count - 1;
    mode.reduce_in_backward = mode.last && t->groups.dp_size > 1 && t->cfg.overlap_grad_reduce && pp == 1;
    mode.training = train;
    mode.first_sample = ((int64_t)op->micro_batch * dp + t->groups.data_rank) * s.B;
    mode.micro_batch = op->micro_batch;
    mode.moe_loss_scale = train ? (float)(p->loss_scale / ((double)count * dp)) : 0.0f;
    const mt_exec ex = trainer_exec(t, mode);
    pipeline_wait(t, forward ? 0 : 1);
    switch (t->cfg.precision) {
        case MT_FP32: run_step<float>(t, &ex, op, grad_scale, unique); break;
        case MT_BF16: run_step<__nv_bfloat16>(t, &ex, op, grad_scale, unique); break;
        case MT_FP16: run_step<__half>(t, &ex, op, grad_scale, unique); break;
    }
    if (forward && index_now) { /* PP = 1: for this micro-batch's backward, which follows */
        stage_embedding_index(t, &unique);
        t->loop.pp_unique = unique;
    }
    if (forward && ch.head && train) zero_masked_gradients(t, p->tokens, op->micro_batch);
    if (forward && ch.head) p->total += micro_batch_loss_sum(t, p->tokens, op->micro_batch);
    if (op->send_rank >= 0) {
        pipeline_transfers* x = &p->x;
        const void* out = chunk_output(t, ch);
        /* the scratch is the next step's: keep the input gradient aside; so too the output of a
         * layerless chunk in evaluation (its slot's residual[0] may receive the next input) */
        if (!forward || (!train && ch.count == 0)) {
            CUDA_CHECK(&t->error, cudaMemcpyAsync(t->loop.pp_send, forward ? out : t->act.dresidual,
                                                  (size_t)s.R * s.h * t->elem, cudaMemcpyDeviceToDevice, t->stream));
            out = t->loop.pp_send;
        }
        x->send[x->num_send] = out;
        x->send_grad[x->num_send] = !forward;
        x->send_rank[x->num_send++] = op->send_rank;
    }
    if (!forward || !train) p->free_slots[p->num_free++] = p->slot_of[key];
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    return MT_OK;
}

/* The pass's mean loss: the last stage's sum shared over the pipeline, and with across_dp the sums
 * and the counts over DP (collective). With context parallelism each rank summed its own rows' losses
 * and counted the whole micro-batches: the sums add over CP (within DP x CP when across_dp), the counts
 * are each CP rank's. */
static mt_status mean_loss_over_ranks(mt_trainer* t, double total, double tokens_counted, int across_dp,
                                      double* mean_loss, mt_error* err) {
    mt_status st = MT_OK;
    if (t->groups.pp_size > 1) { /* the loss is the last stage's */
        st = all_reduce_sum(t, &total, GROUP_PP, err);
        if (st != MT_OK) return st;
    }
    if (across_dp && t->groups.dp_size > 1) {
        st = all_reduce_sum(t, &total, GROUP_DP, err);
        if (st == MT_OK) st = all_reduce_sum(t, &tokens_counted, GROUP_DP, err);
        if (st != MT_OK) return st;
        tokens_counted /= t->groups.cp_size;
    } else if (t->groups.cp_size > 1) {
        st = all_reduce_sum(t, &total, GROUP_CP, err);
        if (st != MT_OK) return st;
    }
    t->loop.last_loss_tokens = (int64_t)tokens_counted;
    *mean_loss = total / tokens_counted;
    return mt_gpu_error_return(&t->error, err);
}

/* Forward (+ backward when training) of micro-batches [0, count) of this rank's tokens, in this
 * pipeline rank's schedule; returns the mean loss (computed on the last stage, shared over the
 * pipeline), over all data-parallel ranks when `across_dp`. Training leaves in t->grads the gradient
 * of the mean loss over the global batch (times loss_scale), reduced over DP: summed by all-reduce,
 * or with the distributed optimizer by reduce-scatter (then only this rank's shards hold sums).
 * Each step takes a free activation slot at its forward and gives it back after its backward. */
static mt_status run_micro_batches(mt_trainer* t, const int32_t* tokens, int count, int train, double loss_scale,
                                   int across_dp, double* mean_loss, mt_error* err) {
    const mt_shape s = model_shape(t);
    const int vp = t->buffer.stage.num_chunks;
    for (int64_t i = 0; i < (int64_t)count * s.B * (s.S_full + 1); i++) /* every rank refuses alike */
        if (tokens[i] < 0 || tokens[i] >= s.V_full)
            return mt_fail(err, MT_ERR_RANGE, "token id %d outside the padded vocabulary of %lld", tokens[i],
                           (long long)s.V_full);
    micro_batch_pass p;
    memset(&p, 0, sizeof(p));
    p.tokens = tokens;
    p.count = count;
    p.train = train;
    p.loss_scale = loss_scale;
    p.counted = (double*)malloc(sizeof(double) * (size_t)count);
    if (!p.counted) return mt_fail(err, MT_ERR_OOM, "cannot allocate %d counts", count);
    mt_status st = count_loss_positions(t, &p, err);
    if (st != MT_OK) return free(p.counted), st;
    if (train) t->ddp.next_bucket = 0; /* no zeroing: each chunk's first backward writes its gradients */
    if (train) moe_pass_begin(t);
    int num_ops = 0, num_warmup = 0;
    mt_pp_op* ops = trainer_steps(t, count, train, &num_ops, &num_warmup, err);
    if (!ops) return free(p.counted), MT_ERR_CONFIG;
    st = check_activation_slots(t, count, train, err);
    if (st != MT_OK) return free(ops), free(p.counted), st;
    p.slot_of = (int*)malloc(sizeof(int) * (size_t)count * vp);
    p.free_slots = (int*)malloc(sizeof(int) * (size_t)t->loop.num_slots);
    if (!p.slot_of || !p.free_slots) {
        free(ops), free(p.slot_of), free(p.free_slots), free(p.counted);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the pipeline slot table");
    }
    p.num_free = t->loop.num_slots;
    for (int i = 0; i < p.num_free; i++) p.free_slots[i] = p.num_free - 1 - i;
    const bool trace = t->debug.pp_trace;
    for (int u = 0; u < num_ops && st == MT_OK;) { /* unit by unit: its exchange, then its steps */
        const int end = pipeline_unit_end(ops, num_ops, num_warmup, vp, u);
        unit_receives(t, &p, ops, u, end);
        if (trace) trace_unit(t, &p.x, ops, u, end);
        pipeline_exchange(t, &p.x);
        memset(&p.x, 0, sizeof(p.x));
        if (trace) {
            for (int i = 0; i < 2; i++) CUDA_CHECK(&t->error, cudaEventSynchronize(t->groups.pp_done[i]));
            fprintf(stderr, "pp rank %d unit %d: transfers done\n", t->groups.pp_rank, u);
        }
        for (int k = u; k < end && st == MT_OK; k++) st = run_schedule_step(t, &p, &ops[k], err);
        if (trace) {
            CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
            fprintf(stderr, "pp rank %d unit %d: steps done\n", t->groups.pp_rank, u);
        }
        u = end;
    }
    if (st == MT_OK) pipeline_exchange(t, &p.x);
    pipeline_wait(t, 0), pipeline_wait(t, 1); /* the step's last sends, before anything reuses their buffers */
    free(ops), free(p.slot_of), free(p.free_slots), free(p.counted);
    if (st != MT_OK) return st;
    if (train) finish_gradient_reduction(t);
    if (train) moe_pass_end(t, count);
    return mean_loss_over_ranks(t, p.total, p.tokens_counted, across_dp, mean_loss, err);
}

/* ============================================================================================== */
/* 19. Optimizer                                                                                  */
/*    Data-parallel buckets, the global gradient norm, clipping, Megatron's fp16                  */
/*    DynamicGradScaler, AdamW over this rank's shard, and the all-gather of the new parameters.  */
/*    Every DP collective runs on the communication stream, in the same order on every rank; the  */
/*    compute stream and the communication stream hand over with events.                          */
/*    defines: reduce_bucket, finish_gradient_reduction, gather_parameters, wait_for_parameters,  */
/*    fp8_publish_parameters, gradient_norm_squared, loss_scaler_update, mt_offload, adamw_step.  */
/* ============================================================================================== */

/* The communication stream starts after everything issued so far on the compute stream. */
static void comm_after_compute(mt_trainer* t) {
    CUDA_CHECK(&t->error, cudaEventRecord(t->ddp.compute_done, t->stream));
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(t->groups.comm_stream, t->ddp.compute_done, 0));
}
/* The compute stream continues after everything issued so far on the communication stream. */
static void compute_after_comm(mt_trainer* t) {
    CUDA_CHECK(&t->error, cudaEventRecord(t->ddp.comm_done, t->groups.comm_stream));
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(t->stream, t->ddp.comm_done, 0));
}

/* [begin, end) of bucket b that this rank's optimizer owns: its DP shard, or all of it. */
static void owned_range(const mt_trainer* t, int b, int64_t* begin, int64_t* end) {
    if (t->opt.sharded) mt_bucket_shard(&t->buffer.buckets[b], t->groups.dp_size, t->groups.dp_rank, begin, end);
    else mt_bucket_shard(&t->buffer.buckets[b], 1, 0, begin, end);
}

/* The group bucket b is reduced and gathered over: DP, or for an expert bucket (EP > 1) the
 * expert-data-parallel group (Megatron's expert buffers); NULL when that group is one rank. */
static ncclComm_t bucket_group(const mt_trainer* t, int b, int* size) {
    const bool expert = t->buffer.buckets[b].ep > 1;
    *size = expert ? t->groups.edp_size : t->groups.dp_size;
    return expert ? t->groups.edp : t->groups.dp;
}

/* Starts the DP reduction of bucket b's gradients (already pre-scaled by 1/dp): an all-reduce, or
 * with the distributed optimizer a reduce-scatter leaving this rank the sum over its own shard. An
 * expert bucket's gradients already hold every EP rank's tokens (the all-to-all brought them): they add
 * over the expert-data-parallel group only (nothing to do when it is one rank). */
static void reduce_bucket(mt_trainer* t, int b) {
    const mt_buffer_bucket* k = &t->buffer.buckets[b];
    mt_process_groups* g = &t->groups;
    int size;
    ncclComm_t comm = bucket_group(t, b, &size);
    if (!comm) return;
    float* base = t->grads + k->start;
    comm_after_compute(t);
    if (t->ddp.bf16_grads) { /* --grad-reduce-in-bf16: round, reduce in bf16, widen what this rank keeps */
        mt_exec ex = trainer_exec(t);
        ex.stream = g->comm_stream;
        __nv_bfloat16* half = t->ddp.bf16_grads;
        cast_from_float(&ex, MT_BF16, half, base, k->end - k->start);
        int64_t begin = k->start, end = k->end;
        if (t->opt.sharded) {
            owned_range(t, b, &begin, &end);
            NCCL_CHECK(&t->error, t->cfg.rank,
                       ncclReduceScatter(half, half + (begin - k->start), (size_t)(end - begin), ncclBfloat16, ncclSum,
                                         comm, g->comm_stream));
        } else {
            NCCL_CHECK(&t->error, t->cfg.rank,
                       ncclAllReduce(half, half, (size_t)(end - begin), ncclBfloat16, ncclSum, comm, g->comm_stream));
        }
        cast_to_float(&ex, MT_BF16, t->grads + begin, half + (begin - k->start), end - begin);
        return;
    }
    if (t->opt.sharded) {
        int64_t begin, end;
        owned_range(t, b, &begin, &end);
        NCCL_CHECK(&t->error, t->cfg.rank,
                   ncclReduceScatter(base, t->grads + begin, (size_t)(end - begin), ncclFloat, ncclSum, comm,
                                     g->comm_stream));
    } else {
        NCCL_CHECK(&t->error, t->cfg.rank,
                   ncclAllReduce(base, base, (size_t)(k->end - k->start), ncclFloat, ncclSum, comm, g->comm_stream));
    }
}

static void gradients_ready(mt_trainer* t, const mt_exec* ex, int layer) {
    if (!ex->mode.reduce_in_backward) return;
    /* buckets run in buffer order = backprop order; bucket b is final once its lowest layer is done */
    while (t->ddp.next_bucket < t->buffer.num_buckets && t->buffer.buckets[t->ddp.next_bucket].ready_layer >= layer)
        reduce_bucket(t, t->ddp.next_bucket++);
}

/* With PP > 1 and tied embeddings the first stage's word embeddings and the last stage's copy
 * (its output layer) are one parameter: their gradients are added over the embedding group
 * (Megatron's _allreduce_word_embedding_grads) before any DP reduction, so both copies take the same
 * step. Their fp32 gradient in full, on the communication stream. */
static int reduce_embedding_gradients(mt_trainer* t) {
    mt_process_groups* g = &t->groups;
    float* dwte = grad_ptr(t, MT_P_WORD_EMBEDDINGS);
    if (!g->embedding || !dwte || t->params_info[MT_P_OUTPUT_WEIGHT].numel > 0) return 0; /* untied: nothing shared */
    comm_after_compute(t);
    const size_t n = (size_t)t->params_info[MT_P_WORD_EMBEDDINGS].numel;
    NCCL_CHECK(&t->error, t->cfg.rank, ncclAllReduce(dwte, dwte, n, ncclFloat, ncclSum, g->embedding, g->comm_stream));
    return 1;
}

/* After the last micro-batch: the embedding group's sum, then the buckets the backward has not
 * reduced over DP; then compute waits. */
static void finish_gradient_reduction(mt_trainer* t) {
    int issued = reduce_embedding_gradients(t);
    if (t->groups.dp_size > 1) {
        while (t->ddp.next_bucket < t->buffer.num_buckets) reduce_bucket(t, t->ddp.next_bucket++);
        issued = 1;
    }
    if (issued) compute_after_comm(t);
}

/* Sum of a host double over a group (the loss over PP and DP, the squared gradient norm over TP, PP and DP,
 * the world's agreement before files are renamed). TP's on its stream, the others on the DP one. */
static mt_status all_reduce_sum(mt_trainer* t, double* value, mt_group_kind group, mt_error* err) {
    mt_process_groups* g = &t->groups;
    ncclComm_t comm = group == GROUP_DP ? g->dp : group == GROUP_TP ? g->tp.comm : group == GROUP_PP ? g->pp
                      : group == GROUP_CP ? g->cp : g->world;
    if (!comm) return MT_OK; /* a group of one */
    CUDA_CHECK(&t->error,
               cudaMemcpyAsync(t->ddp.reduce_scratch, value, sizeof(double), cudaMemcpyHostToDevice, t->stream));
    if (group == GROUP_TP) {
        tp_all_reduce(&t->groups.tp, t->ddp.reduce_scratch, 1, ncclDouble);
        tp_join(&t->groups.tp);
    } else {
        comm_after_compute(t);
        NCCL_CHECK(&t->error, t->cfg.rank,
                   ncclAllReduce(t->ddp.reduce_scratch, t->ddp.reduce_scratch, 1, ncclDouble, ncclSum, comm,
                                 g->comm_stream));
        compute_after_comm(t);
    }
    CUDA_CHECK(&t->error,
               cudaMemcpyAsync(value, t->ddp.reduce_scratch, sizeof(double), cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* 1 on every rank if `ok` holds on every rank (a barrier too); used where files are shared. */
static int all_ranks_ok(mt_trainer* t, int ok) {
    double bad = ok ? 0.0 : 1.0;
    if (all_reduce_sum(t, &bad, GROUP_WORLD, NULL) != MT_OK) return 0;
    return bad == 0.0;
}

/* After the optimizer step with the distributed optimizer: each rank has written its shard of the
 * model-type parameters; all-gather every bucket, in forward order (last bucket first). Without
 * --overlap-param-gather the compute stream waits here; with it, the next forward waits per layer. */
static void gather_parameters(mt_trainer* t) {
    if (!t->opt.sharded) return;
    mt_process_groups* g = &t->groups;
    ncclDataType_t type = t->cfg.precision == MT_FP32 ? ncclFloat : t->cfg.precision == MT_BF16 ? ncclBfloat16 : ncclHalf;
    comm_after_compute(t);
    t->ddp.param_gather_bytes = 0;
    for (int b = t->buffer.num_buckets - 1; b >= 0; b--) {
        int64_t begin, end;
        owned_range(t, b, &begin, &end);
        char* base = (char*)t->params;
        int size;
        ncclComm_t comm = bucket_group(t, b, &size); /* an expert bucket over EDP: none when it is one rank */
        if (comm)
            NCCL_CHECK(&t->error, t->cfg.rank,
                       ncclAllGather(base + begin * t->elem, base + t->buffer.buckets[b].start * t->elem,
                                     (size_t)(end - begin), type, comm, g->comm_stream));
        CUDA_CHECK(&t->error, cudaEventRecord(t->ddp.gathered[b], g->comm_stream));
        t->ddp.param_gather_bytes += (end - begin) * t->elem * size;
    }
    if (t->cfg.overlap_param_gather) t->ddp.gather_pending = 1;
    else compute_after_comm(t);
}

static void wait_for_parameters(mt_trainer* t, int layer) {
    if (!t->ddp.gather_pending) return;
    int b = t->ddp.first_bucket_of_layer[layer + 1];
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(t->stream, t->ddp.gathered[b], 0));
    if (b == 0) t->ddp.gather_pending = 0;
}

/* For wait_for_parameters, computed once: the lowest bucket holding a parameter of each layer
 * (gathers are issued from the last bucket down, so waiting for it covers the whole layer). Index
 * layer + 1: 0 the embeddings, L + 1 the final norm and output layer (always bucket 0). */
static int* first_bucket_of_layers(const mt_buffer_layout* B) {
    int L = B->num_layers;
    int* first = (int*)malloc(sizeof(int) * (size_t)(L + 2));
    if (!first) return NULL;
    for (int l = 0; l <= L; l++) first[l] = B->num_buckets - 1;
    first[L + 1] = 0;
    for (int k = 0; k < B->num_params; k++) {
        const mt_buffer_param* p = &B->params[k];
        if (p->tensor >= MT_P_FINAL_LN_WEIGHT) continue;
        int slot = p->tensor <= MT_P_POSITION_EMBEDDINGS ? 0 : p->layer + 1;
        if (p->bucket < first[slot]) first[slot] = p->bucket;
    }
    return first;
}

static void wait_for_all_parameters(mt_trainer* t) {
    if (t->ddp.gather_pending) wait_for_parameters(t, t->buffer.num_layers);
}

/* ---- FP8 parameter all-gather (--fp8-param-gather, Transformer Engine's FP8 parameters) ----
 * The weights of the FP8 linears (QKV, proj, fc1, fc2 of every FP8 layer) have no bf16 copy: the
 * parameter storage holds them as E4M3 bytes (megatron.h mt_buffer_layout: one byte an element),
 * and after each optimizer step every DP rank writes its own shard of the storage from its fp32
 * master weights, then the shards are all-gathered: one byte per FP8 weight element instead of
 * two. The FP8 bytes are the cast the run without the flag makes from the bf16 copy,
 * fp8(float(bf16(master)) x scale) with the weight's scale, so both runs are bitwise the same:
 *   delayed     the scale from the amax history (the same on every rank: amaxes are reduced over
 *               TP x DP after each step); the shard's amax is recorded for that update (the max
 *               over the ranks' shards is the tensor's);
 *   tensorwise  each shard's amax, reduced with max over DP, is the tensor's (this TP rank's part of
 *               it: each TP rank scales its shard of a weight by its own amax, as without the flag),
 *               and the scale follows before the cast.
 * The other parameters are written as bf16 and gathered with them. A rank's shard of a bucket is a
 * byte range of the storage whose length differs between ranks (FP8 and bf16 elements mixed), so
 * the all-gather is one in-place broadcast per rank, grouped: the bytes an all-gather would move.
 * W^T, the input-gradient GEMM's operand, is the transpose of the gathered bytes (fp8_layer_linears).
 * Done at the next forward, after the step's delayed scale update: collective over DP, and with
 * --overlap-param-gather overlapped with that forward like the bf16 gather (per-bucket events).
 * The casts' kernels and the publish table (fp8_publish_chunk) are in section 12. */

/* Writes this rank's shard of the parameter storage from the master weights and all-gathers it
 * (see above); the next forward's layers wait for their buckets as after gather_parameters. */
static void fp8_publish_parameters(mt_trainer* t) {
    mt_fp8_state* f = &t->fp8;
    mt_process_groups* g = &t->groups;
    const mt_exec ex = trainer_exec(t);
    f->unpublished = 0;
    wait_for_all_parameters(t); /* no gather may still be writing the storage */
    if (t->opt.num_chunks > 0 && f->recipe == MT_FP8_TENSORWISE)
        fp8_publish_amax(&ex, f->amax, f->num_tensors, t->opt.chunks, f->publish, t->opt.num_chunks, t->opt.master);
    if (f->recipe == MT_FP8_TENSORWISE && t->opt.sharded) { /* the shards' amaxes: the tensors' */
        comm_after_compute(t);
        NCCL_CHECK(&t->error, t->cfg.rank,
                   ncclAllReduce(f->amax, f->amax, (size_t)f->num_tensors, ncclFloat, ncclMax, g->dp, g->comm_stream));
        compute_after_comm(t);
    }
    if (f->recipe == MT_FP8_TENSORWISE && f->num_tensors > 0) /* every linear's weight slot */
        fp8_strided_scales_from_amax<FP8_ROLES, FP8_W>(&ex, f->scale, f->scale_inv, f->amax, f->fp8_max, f->num_tensors,
                                                       f->margin);
    if (t->opt.num_chunks > 0)
        fp8_publish(&ex, (uint8_t*)t->params, t->opt.chunks, f->publish, t->opt.num_chunks, t->opt.master, f->scale, f->amax,
                    f->recipe == MT_FP8_DELAYED);
    if (!t->opt.sharded) return;
    comm_after_compute(t);
    t->ddp.param_gather_bytes = 0;
    for (int b = t->buffer.num_buckets - 1; b >= 0; b--) {
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupStart());
        for (int r = 0; r < g->dp_size; r++) {
            int64_t begin, end;
            mt_bucket_shard(&t->buffer.buckets[b], g->dp_size, r, &begin, &end);
            const int64_t lo = mt_buffer_storage_byte(&t->buffer, begin), hi = mt_buffer_storage_byte(&t->buffer, end);
            char* at = (char*)t->params + lo;
            NCCL_CHECK(&t->error, t->cfg.rank, ncclBroadcast(at, at, (size_t)(hi - lo), ncclUint8, r, g->dp, g->comm_stream));
            t->ddp.param_gather_bytes += hi - lo;
        }
        NCCL_CHECK(&t->error, t->cfg.rank, ncclGroupEnd());
        CUDA_CHECK(&t->error, cudaEventRecord(t->ddp.gathered[b], g->comm_stream));
    }
    if (t->cfg.overlap_param_gather) t->ddp.gather_pending = 1;
    else compute_after_comm(t);
}

/* Squared L2 norm of the gradients, over the whole model (deterministic): each rank sums its owned
 * elements in fixed chunks; the TP ranks' sums are added (a whole tensor that every TP rank holds
 * is counted on TP rank 0 only), then the pipeline stages' (the last stage's copy of tied word
 * embeddings is not counted), and with the distributed optimizer the shards' sums over DP. */
/* Whether a norm's (or zero count's) partial sums add over DP: with the distributed optimizer (each rank
 * owns a shard), and with expert parallelism (each EP rank holds other experts; plan_optimizer_shard then
 * counts a replicated element on one rank of its group only). */
static bool norm_over_dp(const mt_trainer* t) { return t->opt.sharded || t->groups.ep_size > 1; }

static double gradient_norm_squared(mt_trainer* t) {
    const mt_exec ex = trainer_exec(t);
    gradient_sum_squares(&ex, t->opt.norm_partial, t->opt.chunks, t->opt.num_chunks, t->grads);
    double result = 0.0;
    CUDA_CHECK(&t->error, cudaMemcpyAsync(&result, t->opt.norm_partial + t->opt.num_chunks, sizeof(double),
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    all_reduce_sum(t, &result, GROUP_TP, NULL);
    all_reduce_sum(t, &result, GROUP_PP, NULL);
    if (norm_over_dp(t)) all_reduce_sum(t, &result, GROUP_DP, NULL);
    return result;
}

/* Megatron's DynamicGradScaler.update. */
static void loss_scaler_update(mt_loss_scaler* s, const mt_config* c, int found_inf) {
    if (c->precision != MT_FP16 || c->loss_scale > 0) return;
    if (found_inf) {
        s->growth_tracker = 0;
        s->hysteresis_tracker--;
        if (s->hysteresis_tracker <= 0) {
            s->loss_scale = s->loss_scale * 0.5;
            if (s->loss_scale < c->min_loss_scale) s->loss_scale = c->min_loss_scale;
        }
    } else {
        s->growth_tracker++;
        if (s->growth_tracker == c->loss_scale_window) {
            s->growth_tracker = 0;
            s->hysteresis_tracker = c->hysteresis;
            s->loss_scale *= 2.0;
        }
    }
}
/* A new scaler: --loss-scale when given, else --initial-loss-scale (fp16; 1 otherwise), hysteresis full. */
static void loss_scaler_reset(mt_loss_scaler* s, const mt_config* c) {
    s->growth_tracker = 0;
    s->hysteresis_tracker = c->hysteresis;
    s->loss_scale = c->precision != MT_FP16 ? 1.0 : c->loss_scale > 0 ? c->loss_scale : c->initial_loss_scale;
}

/* ---- Optimizer offload (Megatron's --optimizer-cpu-offload, --optimizer-offload-fraction) ----
 * The last `numel` elements of this rank's optimizer shard (mt_offload_elements: the end of the
 * buffer, which runs in reverse model order, so the embeddings' end of the model first, as Megatron
 * walks its parameters from the embeddings; here cut at an element, not a whole tensor) keep their
 * fp32 master weights and Adam moments in pinned host memory. Each step, in pieces of
 * MT_OFFLOAD_PIECE_ELEMENTS: the piece's gradients go device -> host on the d2h stream (up to
 * MT_OFFLOAD_SLOTS pieces ahead), the CPU AdamW (megatron.h mt_adamw_cpu_parallel, the GPU kernel's
 * arithmetic, bit for bit) updates it on the pool's threads, and its new fp32 weights go host ->
 * device on the h2d stream, straight into the fp32 parameters or, for bf16/fp16, through a staging
 * buffer and the GPU's cast (the same rounding as the GPU AdamW's model copy). The GPU AdamW of the
 * rest runs meanwhile on the compute stream, which waits for the last piece before the next use of
 * the parameters. With the distributed optimizer each rank offloads the end of its own shard. */
typedef struct {
    int64_t buffer;  /* first element in the parameter/gradient buffers */
    int64_t host;    /* first element in the host arrays (shard index - gpu_numel) */
    int64_t length;
    int decay, decoupled;
    int counted;     /* its chunks' count_in_norm (--log-params-norm sums the host master of counted runs) */
} mt_offload_run;
struct mt_offload {
    int64_t numel;          /* offloaded elements: the shard's [gpu_numel, shard_numel) */
    int64_t gpu_numel;      /* the device's part of master, m and v */
    int num_gpu_chunks;     /* AdamW chunks on the GPU: the first ones (the norm walks them all) */
    int64_t piece;          /* elements per copy and update piece */
    float *master, *m, *v;  /* pinned [numel] */
    float* grads;           /* pinned [MT_OFFLOAD_SLOTS, piece]: gradient staging */
    float* staging;         /* device [piece]: updated fp32 weights on their way to a bf16/fp16 model copy */
    mt_offload_run* runs;   /* the offloaded elements as runs contiguous in both the buffer and the host arrays */
    int num_runs;
    mt_adamw_segment* segments; /* [num_runs]: one piece's runs, for the CPU AdamW */
    cudaStream_t d2h, h2d;
    cudaEvent_t grads_final, updated, slot_ready[MT_OFFLOAD_SLOTS];
    mt_thread_pool* pool;
};

static void* device_alloc(mt_trainer* t, size_t bytes, size_t* counter);

static void offload_free(mt_optimizer_state* opt) {
    struct mt_offload* o = opt->offload;
    if (!o) return;
    if (o->d2h) cudaStreamSynchronize(o->d2h);
    if (o->h2d) cudaStreamSynchronize(o->h2d);
    cudaFreeHost(o->master);
    cudaFreeHost(o->m);
    cudaFreeHost(o->v);
    cudaFreeHost(o->grads);
    cudaFree(o->staging);
    if (o->d2h) cudaStreamDestroy(o->d2h);
    if (o->h2d) cudaStreamDestroy(o->h2d);
    if (o->grads_final) cudaEventDestroy(o->grads_final);
    if (o->updated) cudaEventDestroy(o->updated);
    for (int i = 0; i < MT_OFFLOAD_SLOTS; i++)
        if (o->slot_ready[i]) cudaEventDestroy(o->slot_ready[i]);
    mt_thread_pool_free(o->pool);
    free(o->runs);
    free(o->segments);
    free(o);
    opt->offload = NULL;
}

/* From the optimizer's chunk table (host copy, in shard order): the runs of the offloaded part,
 * the host arrays (m and v zero; the master is set with the parameters), streams, events, threads. */
static mt_status offload_create(mt_trainer* t, const mt_opt_chunk* chunks, int num_chunks, mt_error* err) {
    const int64_t numel = mt_offload_elements(&t->cfg, t->opt.shard_numel);
    if (numel == 0) return MT_OK;
    struct mt_offload* o = (struct mt_offload*)calloc(1, sizeof(struct mt_offload));
    if (!o) return mt_fail(err, MT_ERR_OOM, "cannot allocate the optimizer offload's state");
    t->opt.offload = o;
    o->numel = numel;
    o->gpu_numel = t->opt.shard_numel - numel;
    o->piece = numel < MT_OFFLOAD_PIECE_ELEMENTS ? numel : MT_OFFLOAD_PIECE_ELEMENTS;
    o->runs = (mt_offload_run*)malloc(sizeof(mt_offload_run) * (size_t)(num_chunks > 0 ? num_chunks : 1));
    if (!o->runs) return mt_fail(err, MT_ERR_OOM, "cannot allocate the optimizer offload's runs");
    for (int k = 0; k < num_chunks; k++) {
        const mt_opt_chunk* c = &chunks[k];
        if (c->master < o->gpu_numel) {
            o->num_gpu_chunks = k + 1;
            continue;
        }
        mt_offload_run* last = o->num_runs ? &o->runs[o->num_runs - 1] : NULL;
        const int64_t host = c->master - o->gpu_numel;
        if (last && last->buffer + last->length == c->buffer && last->host + last->length == host &&
            last->decay == c->weight_decay && last->decoupled == c->decoupled && last->counted == c->count_in_norm) {
            last->length += c->length;
        } else {
            mt_offload_run* r = &o->runs[o->num_runs++];
            r->buffer = c->buffer;
            r->host = host;
            r->length = c->length;
            r->decay = c->weight_decay;
            r->decoupled = c->decoupled;
            r->counted = c->count_in_norm;
        }
    }
    o->segments = (mt_adamw_segment*)malloc(sizeof(mt_adamw_segment) * (size_t)(o->num_runs > 0 ? o->num_runs : 1));
    if (!o->segments) return mt_fail(err, MT_ERR_OOM, "cannot allocate the optimizer offload's segments");
    const size_t bytes = sizeof(float) * (size_t)numel;
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&o->master, bytes));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&o->m, bytes));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&o->v, bytes));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&o->grads, sizeof(float) * (size_t)(MT_OFFLOAD_SLOTS * o->piece)));
    if (t->cfg.precision != MT_FP32) o->staging = (float*)device_alloc(t, sizeof(float) * (size_t)o->piece,
                                                                       &t->mem.allocated.offload_bytes);
    CUDA_CHECK(&t->error, cudaStreamCreateWithFlags(&o->d2h, cudaStreamNonBlocking));
    CUDA_CHECK(&t->error, cudaStreamCreateWithFlags(&o->h2d, cudaStreamNonBlocking));
    CUDA_CHECK(&t->error, cudaEventCreateWithFlags(&o->grads_final, cudaEventDisableTiming));
    CUDA_CHECK(&t->error, cudaEventCreateWithFlags(&o->updated, cudaEventDisableTiming));
    for (int i = 0; i < MT_OFFLOAD_SLOTS; i++)
        CUDA_CHECK(&t->error, cudaEventCreateWithFlags(&o->slot_ready[i], cudaEventDisableTiming));
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    memset(o->m, 0, bytes);
    memset(o->v, 0, bytes);
    /* the node's cores shared among its GPUs' processes */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int devices = 1;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) devices = 1;
    long threads = cpus > 0 ? cpus / devices : 1;
    return mt_thread_pool_create(&o->pool, (int)(threads < 1 ? 1 : threads > 256 ? 256 : threads), err);
}

/* The host array that holds the offloaded end of a device optimizer array (master, m, v), or NULL. */
static float* offloaded_part(const mt_optimizer_state* opt, const float* device_array) {
    const struct mt_offload* o = opt->offload;
    if (!o) return NULL;
    return device_array == opt->master ? o->master : device_array == opt->adam_m ? o->m
                                                   : device_array == opt->adam_v ? o->v : NULL;
}

/* Adam's moments zeroed, on the device and, offloaded, on the host (a new optimizer's state). */
static void zero_adam_moments(mt_trainer* t) {
    const size_t on_device = (size_t)(t->opt.offload ? t->opt.offload->gpu_numel : t->opt.shard_numel);
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->opt.adam_m, 0, sizeof(float) * on_device, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->opt.adam_v, 0, sizeof(float) * on_device, t->stream));
    if (t->opt.offload) {
        memset(t->opt.offload->m, 0, sizeof(float) * (size_t)t->opt.offload->numel);
        memset(t->opt.offload->v, 0, sizeof(float) * (size_t)t->opt.offload->numel);
    }
}

/* The host elements [*a, *b) of a run that fall in a piece's [lo, hi); false when none do. */
static bool run_in_piece(const mt_offload_run* run, int64_t lo, int64_t hi, int64_t* a, int64_t* b) {
    *a = run->host > lo ? run->host : lo;
    *b = run->host + run->length < hi ? run->host + run->length : hi;
    return *a < *b;
}

/* Copies the gradients of piece p (host elements [p piece, ...)) into staging slot p % SLOTS, on d2h. */
static void offload_fetch_piece(mt_trainer* t, int64_t p) {
    struct mt_offload* o = t->opt.offload;
    const int64_t lo = p * o->piece, hi = lo + o->piece < o->numel ? lo + o->piece : o->numel;
    float* slot = o->grads + (p % MT_OFFLOAD_SLOTS) * o->piece;
    for (int r = 0; r < o->num_runs; r++) {
        const mt_offload_run* run = &o->runs[r];
        int64_t a, b;
        if (!run_in_piece(run, lo, hi, &a, &b)) continue;
        CUDA_CHECK(&t->error, cudaMemcpyAsync(slot + (a - lo), t->grads + run->buffer + (a - run->host),
                                              sizeof(float) * (size_t)(b - a), cudaMemcpyDeviceToHost, o->d2h));
    }
    CUDA_CHECK(&t->error, cudaEventRecord(o->slot_ready[p % MT_OFFLOAD_SLOTS], o->d2h));
}

/* The CPU's AdamW step over the offloaded part, overlapped with its copies (see above). The compute
 * stream has just been given the GPU's AdamW; it waits here for the updated parameters. */
static void offload_update(mt_trainer* t, const mt_adamw_step* h) {
    struct mt_offload* o = t->opt.offload;
    if (!o || t->error.status != MT_OK) return;
    const int64_t pieces = (o->numel + o->piece - 1) / o->piece;
    CUDA_CHECK(&t->error, cudaEventRecord(o->grads_final, t->stream)); /* after every gradient of the step */
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(o->d2h, o->grads_final, 0));
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(o->h2d, o->grads_final, 0));
    for (int64_t p = 0; p < pieces && p < MT_OFFLOAD_SLOTS; p++) offload_fetch_piece(t, p);
    mt_exec ex = trainer_exec(t);
    ex.stream = o->h2d;
    for (int64_t p = 0; p < pieces && t->error.status == MT_OK; p++) {
        const int64_t lo = p * o->piece, hi = lo + o->piece < o->numel ? lo + o->piece : o->numel;
        CUDA_CHECK(&t->error, cudaEventSynchronize(o->slot_ready[p % MT_OFFLOAD_SLOTS]));
        int n = 0;
        for (int r = 0; r < o->num_runs; r++) {
            const mt_offload_run* run = &o->runs[r];
            int64_t a, b;
            if (!run_in_piece(run, lo, hi, &a, &b)) continue;
            o->segments[n].offset = a - lo;
            o->segments[n].length = b - a;
            o->segments[n].decay = run->decay;
            o->segments[n].decoupled = run->decoupled;
            n++;
        }
        mt_adamw_cpu_parallel(o->pool, h, o->segments, n, o->grads + (p % MT_OFFLOAD_SLOTS) * o->piece,
                              o->master + lo, o->m + lo, o->v + lo);
        if (p + MT_OFFLOAD_SLOTS < pieces) offload_fetch_piece(t, p + MT_OFFLOAD_SLOTS); /* the slot is free again */
        /* the piece's new weights to the device: fp32 into the parameters, else staged and cast */
        for (int r = 0; r < o->num_runs; r++) {
            const mt_offload_run* run = &o->runs[r];
            int64_t a, b;
            if (!run_in_piece(run, lo, hi, &a, &b)) continue;
            const int64_t at = run->buffer + (a - run->host);
            float* dst = o->staging ? o->staging + (a - lo) : (float*)t->params + at;
            CUDA_CHECK(&t->error, cudaMemcpyAsync(dst, o->master + a, sizeof(float) * (size_t)(b - a),
                                                  cudaMemcpyHostToDevice, o->h2d));
            if (o->staging) cast_from_float(&ex, t->cfg.precision, (char*)t->params + at * (int64_t)t->elem, dst, b - a);
        }
    }
    CUDA_CHECK(&t->error, cudaEventRecord(o->updated, o->h2d));
    CUDA_CHECK(&t->error, cudaStreamWaitEvent(t->stream, o->updated, 0));
}

/* --log-params-norm (Megatron's calc_params_l2_norm): the squared L2 norm of the fp32 master weights,
 * every parameter once as the gradient norm counts it (the same chunks: a tensor every TP rank holds
 * whole on TP rank 0, the last stage's copy of tied word embeddings not at all), the offloaded end
 * of the shard from its host copy, then summed over TP and PP and, with the distributed optimizer,
 * over DP. Called after the optimizer step (the CPU AdamW's part is done when adamw_step returns). */
static double params_norm_squared(mt_trainer* t) {
    const mt_exec ex = trainer_exec(t);
    const int gpu_chunks = t->opt.offload ? t->opt.offload->num_gpu_chunks : t->opt.num_chunks;
    gradient_sum_squares<true>(&ex, t->opt.norm_partial, t->opt.chunks, gpu_chunks, t->opt.master);
    double result = 0.0;
    CUDA_CHECK(&t->error, cudaMemcpyAsync(&result, t->opt.norm_partial + gpu_chunks, sizeof(double),
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    for (int r = 0; t->opt.offload && r < t->opt.offload->num_runs; r++) {
        const mt_offload_run* run = &t->opt.offload->runs[r];
        for (int64_t i = 0; run->counted && i < run->length; i++) {
            const double v = t->opt.offload->master[run->host + i];
            result += v * v;
        }
    }
    all_reduce_sum(t, &result, GROUP_TP, NULL);
    all_reduce_sum(t, &result, GROUP_PP, NULL);
    if (norm_over_dp(t)) all_reduce_sum(t, &result, GROUP_DP, NULL);
    return result;
}

/* --log-num-zeros-in-grad (Megatron's count_zeros_fp32): the gradient elements that the step sees as
 * exactly 0 (g * grad_scale: unscaled and clipped), counted and reduced as the gradient norm. */
static int64_t gradient_zeros(mt_trainer* t, float grad_scale) {
    const mt_exec ex = trainer_exec(t);
    gradient_count_zeros(&ex, t->opt.norm_partial, t->opt.chunks, t->opt.num_chunks, t->grads, grad_scale);
    double result = 0.0;
    CUDA_CHECK(&t->error, cudaMemcpyAsync(&result, t->opt.norm_partial + t->opt.num_chunks, sizeof(double),
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    all_reduce_sum(t, &result, GROUP_TP, NULL);
    all_reduce_sum(t, &result, GROUP_PP, NULL);
    if (norm_over_dp(t)) all_reduce_sum(t, &result, GROUP_DP, NULL);
    return (int64_t)result;
}

/* One AdamW step over this rank's shard (GPU and offloaded part), then the new weights' all-gather;
 * params_norm (not NULL: --log-params-norm) gets the new master weights' norm, taken before the
 * all-gather is issued, so that its reductions do not wait for it. */
template <typename T>
static void adamw_step(mt_trainer* t, float lr, float lr_decoupled, float grad_scale, double* params_norm) {
    const mt_config* c = &t->cfg;
    t->opt.adam_step++;
    mt_adamw_step h;
    h.lr = lr;
    h.lr_decoupled = lr_decoupled;
    h.beta1 = (float)c->adam_beta1;
    h.beta2 = (float)c->adam_beta2;
    h.bias_correction1 = (float)(1.0 - pow(c->adam_beta1, (double)t->opt.adam_step));
    h.bias_correction2 = (float)(1.0 - pow(c->adam_beta2, (double)t->opt.adam_step));
    h.eps = (float)c->adam_eps;
    h.weight_decay = (float)c->weight_decay;
    h.grad_scale = grad_scale;
    const mt_exec ex = trainer_exec(t);
    const int gpu_chunks = t->opt.offload ? t->opt.offload->num_gpu_chunks : t->opt.num_chunks;
    T* model = t->fp8.param_gather ? (T*)NULL : (T*)t->params; /* fp8_publish_parameters writes it then */
    if (gpu_chunks > 0)
        adamw_update<T>(&ex, &h, t->opt.chunks, gpu_chunks, t->opt.master, model, t->grads, t->opt.adam_m,
                        t->opt.adam_v);
    offload_update(t, &h); /* the CPU's part, while the GPU's runs */
    if (params_norm) *params_norm = sqrt(params_norm_squared(t));
    fp8_weights_changed(&t->fp8, model_shape(t).L);
    if (t->fp8.param_gather) t->fp8.unpublished = 1; /* at the next forward, after the FP8 scale update */
    else gather_parameters(t);
}

/* ============================================================================================== */
/* 20. Checkpoints                                                                                */
/*    The format on disk and the rules every writer and reader applies (the header and its        */
/*    checks, each rank's file names, the tracker, a save's temporary directory and commit, the   */
/*    manifest) are megatron.h section 13's; this section stages a rank's files from the device   */
/*    and loads them back. A save copies each rank's fp32 master weights, Adam m and v in         */
/*    canonical order (or its distributed-optimizer shard; a model file then ends with the FP8    */
/*    state and the routers' expert bias, whole at PP > 1 too) into host memory and writes them   */
/*    (--async-save: in a writer thread while training goes on) into the temporary directory      */
/*    that rank 0 commits once every rank has written (every file fsync'ed first). A load at the  */
/*    same layout reads each rank's own files, checked word by word                               */
/*    (mt_checkpoint_header_check_rank) and for its exact size; at another layout each rank cuts  */
/*    its part from the saved files (load_other_layout, megatron.h mt_ckpt_read_part). Ranks      */
/*    share the file system; one job saves into a checkpoint directory at a time. With expert     */
/*    parallelism each EP rank's experts are in its own mp_rank_<tp>_<ep>/ (the first DP rank     */
/*    holding them writes the model file; every DP rank its optimizer shard there), and a load    */
/*    at another EP size is a load at another layout.                                             */
/*    defines: mt_trainer_save, mt_trainer_save_async / mt_trainer_save_wait, mt_trainer_load,    */
/*    mt_trainer_load_weights.                                                                    */
/* ============================================================================================== */

/* the header words: megatron.h, MT_CK_* */

static mt_status write_all(FILE* f, const void* data, size_t bytes, const char* path, mt_error* err) {
    if (fwrite(data, 1, bytes, f) != bytes) return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return MT_OK;
}

/* fopen(path, "rb") of a regular file only (a FIFO or a directory is refused without blocking) */
static FILE* open_checkpoint_file(const char* path, mt_error* err) {
    int fd = mt_open_regular_file(path, err);
    FILE* f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (fd >= 0 && !f) {
        mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

/* ---- fp32 arrays between the optimizer shard, the full buffer layout, and canonical order ---- */

/* Copies every bucket's owned range between a full buffer-layout array and an optimizer-shard array
 * (with optimizer offload, the shard's end is in host memory: section 19's offloaded_part). */
static void copy_owned(mt_trainer* t, float* shard, float* full, int to_shard) {
    float* host = offloaded_part(&t->opt, shard);
    const int64_t split = host ? t->opt.offload->gpu_numel : INT64_MAX;
    for (int b = 0; b < t->buffer.num_buckets; b++) {
        int64_t begin, end;
        owned_range(t, b, &begin, &end);
        const int64_t k0 = t->opt.shard_offset[b], k1 = k0 + (end - begin);
        for (int part = 0; part < 2; part++) { /* the device's elements, then the host's */
            const int64_t lo = part ? (k0 > split ? k0 : split) : k0, hi = part ? k1 : (k1 < split ? k1 : split);
            if (lo >= hi) continue;
            float* s = part ? host + (lo - split) : shard + lo;
            float* f = full + begin + (lo - k0);
            CUDA_CHECK(&t->error, cudaMemcpyAsync(to_shard ? s : f, to_shard ? f : s, sizeof(float) * (hi - lo),
                                                  cudaMemcpyDefault, t->stream));
        }
    }
}

/* The full fp32 master weights in buffer layout: the master itself, or with the distributed
 * optimizer the shards all-gathered into the gradient buffer (free between steps). Collective. */
/* Every rank's owned ranges of a full fp32 buffer-layout array, all-gathered in place. Collective. */
static void gather_owned_fp32(mt_trainer* t, float* full) {
    comm_after_compute(t);
    for (int b = 0; b < t->buffer.num_buckets; b++) {
        int64_t begin, end, size;
        owned_range(t, b, &begin, &end);
        int group_size;
        ncclComm_t comm = bucket_group(t, b, &group_size);
        size = end - begin;
        if (comm)
            NCCL_CHECK(&t->error, t->cfg.rank,
                       ncclAllGather(full + begin, full + t->buffer.buckets[b].start, (size_t)size, ncclFloat, comm,
                                     t->groups.comm_stream));
    }
    compute_after_comm(t);
}

static float* full_master(mt_trainer* t) {
    /* unsharded fp32 weights are the master, the offloaded part included (the CPU AdamW copies it back) */
    if (!t->opt.sharded && (!t->opt.offload || t->params == (void*)t->opt.master)) return t->opt.master;
    copy_owned(t, t->opt.master, t->grads, 0);
    if (t->opt.sharded) gather_owned_fp32(t, t->grads);
    return t->grads;
}

/* An unsharded optimizer array (m or v) whole in buffer layout: itself, or assembled with its
 * offloaded end in the gradient buffer (free between steps). */
static float* full_optimizer_array(mt_trainer* t, float* array) {
    if (!t->opt.offload) return array;
    copy_owned(t, array, t->grads, 0);
    return t->grads;
}

/* Master weights (this rank's part) and the model-type copy from a full fp32 buffer-layout array. */
static void set_master_from_full(mt_trainer* t, float* full) {
    fp8_weights_changed(&t->fp8, model_shape(t).L); /* the FP8 weight copies are made again from the new parameters */
    t->fp8.unpublished = t->fp8.param_gather; /* --fp8-param-gather: the storage is written from the master */
    if (full != t->opt.master) copy_owned(t, t->opt.master, full, 1);
    if (t->params == (void*)t->opt.master) {
        /* the offloaded part's weights too (copy_owned put its master on the host) */
        if (t->opt.offload && full != t->opt.master)
            CUDA_CHECK(&t->error, cudaMemcpyAsync(t->opt.master + t->opt.offload->gpu_numel,
                                                  full + t->opt.offload->gpu_numel,
                                                  sizeof(float) * (size_t)t->opt.offload->numel,
                                                  cudaMemcpyDeviceToDevice, t->stream));
        return;
    }
    if (t->fp8.param_gather) return;
    const mt_exec ex = trainer_exec(t);
    cast_from_float(&ex, t->cfg.precision, t->params, full, t->buffer.size);
}

/* Canonical host array <-> full buffer-layout device array (padding zeroed on upload). */
static mt_status canonical_transfer(mt_trainer* t, float* device_full, float* host, int upload, mt_error* err) {
    if (upload) CUDA_CHECK(&t->error, cudaMemsetAsync(device_full, 0, sizeof(float) * t->buffer.size, t->stream));
    for (int i = 0; i < t->buffer.num_params; i++) {
        const mt_buffer_param* p = &t->buffer.params[i];
        float* d = device_full + p->offset;
        float* h = host + p->canonical;
        CUDA_CHECK(&t->error, cudaMemcpyAsync(upload ? d : h, upload ? h : d, sizeof(float) * p->numel,
                                              upload ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, t->stream));
    }
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* A host copy of a shard-layout optimizer array (n elements; with offload its end is in host memory). */
static mt_status stage_device_array(mt_trainer* t, const float* device, int64_t n, float* host, mt_error* err) {
    const float* tail = offloaded_part(&t->opt, device);
    const int64_t on_device = tail ? t->opt.offload->gpu_numel : n;
    mt_status st = copy_sync(t, host, device, sizeof(float) * on_device, cudaMemcpyDeviceToHost, err);
    if (tail) memcpy(host + on_device, tail, sizeof(float) * (size_t)(n - on_device));
    return st;
}

static mt_status read_device_array(mt_trainer* t, FILE* f, float* device, int64_t n, float* host, const char* path,
                                   mt_error* err) {
    if (fread(host, sizeof(float), (size_t)n, f) != (size_t)n) return mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    float* tail = offloaded_part(&t->opt, device);
    const int64_t on_device = tail ? t->opt.offload->gpu_numel : n;
    if (tail) memcpy(tail, host + on_device, sizeof(float) * (size_t)(n - on_device));
    return copy_sync(t, device, host, sizeof(float) * on_device, cudaMemcpyHostToDevice, err);
}

static mt_status read_canonical(mt_trainer* t, FILE* f, float* device_full, float* host, const char* path,
                                mt_error* err) {
    if (fread(host, sizeof(float), (size_t)t->num_params, f) != (size_t)t->num_params)
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    return canonical_transfer(t, device_full, host, 1, err);
}

/* Steps over `count` canonical arrays of the model file (the Adam moments, when they are not loaded). */
static mt_status skip_canonical(mt_trainer* t, FILE* f, int count, const char* path, mt_error* err) {
    if (fseeko(f, (off_t)count * (off_t)t->num_params * (off_t)sizeof(float), SEEK_CUR) != 0)
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    return MT_OK;
}

/* This rank's place in its checkpoint files (megatron.h mt_ckpt_rank: their names, the rank words). */
static mt_ckpt_rank checkpoint_rank(const mt_trainer* t) {
    mt_ckpt_rank r;
    memset(&r, 0, sizeof(r));
    r.tp_rank = t->groups.tp.rank;
    r.pp_rank = t->groups.pp_rank;
    r.dp_rank = t->groups.dp_rank;
    r.pp = t->groups.pp_size;
    r.vp = t->buffer.stage.num_chunks;
    r.stage_numel = t->num_params;
    r.dp = t->groups.dp_size;
    r.sharded = t->opt.sharded;
    r.shard_numel = t->opt.shard_numel;
    r.ddp.overlap_grad_reduce = t->cfg.overlap_grad_reduce;
    r.ddp.ddp_bucket_size = t->cfg.ddp_bucket_size;
    r.ep = t->groups.ep_size; /* its EP rank: dp_rank % ep */
    return r;
}

static void fill_header(const mt_trainer* t, int64_t* header, int64_t iteration, int64_t consumed_samples) {
    const mt_ckpt_rank rank = checkpoint_rank(t);
    mt_checkpoint_header_init(header, &t->cfg);
    mt_checkpoint_header_set_rank(header, &rank);
    header[MT_CK_ITERATION] = iteration;
    header[MT_CK_CONSUMED] = consumed_samples;
    header[MT_CK_SCHED_STEPS] = t->opt.scheduler_steps;
    header[MT_CK_ADAM_STEP] = t->opt.adam_step;
    header[MT_CK_GROWTH] = t->scaler.growth_tracker;
    header[MT_CK_HYSTERESIS] = t->scaler.hysteresis_tracker;
    memcpy(&header[MT_CK_LOSS_SCALE_BITS], &t->scaler.loss_scale, sizeof(double));
    const int delayed = t->fp8.enabled && t->fp8.recipe == MT_FP8_DELAYED;
    header[MT_CK_FP8_TENSORS] = delayed ? t->fp8.num_tensors : 0;
    header[MT_CK_FP8_HISTORY_LEN] = delayed ? t->fp8.history_len : 0;
    header[MT_CK_FP8_HISTORY_POS] = delayed ? t->fp8.history_pos : 0;
    header[MT_CK_MANIFESTED] = 1; /* commit_save writes the manifest */
}

/* The FP8 delayed-scaling state after the model file's arrays (see MT_CK_FP8_TENSORS): scale,
 * scale_inv, history; copied from the device into a save's host copy (staged), or read from f into the device. */
static mt_status fp8_state_transfer(mt_trainer* t, FILE* f, float* staged, const char* path, mt_error* err) {
    mt_fp8_state* s = &t->fp8;
    const int64_t nt = s->num_tensors, n = nt * (1 + FP8_SCALE_INV_STRIDE + (int64_t)s->history_len);
    const int write = staged != NULL; /* into staged (a save's host copy), else read from f */
    float* host = write ? staged : (float*)malloc(sizeof(float) * (size_t)n);
    if (!host) return mt_fail(err, MT_ERR_OOM, "cannot allocate the FP8 state's staging");
    float* device[3] = {s->scale, s->scale_inv, s->history};
    const int64_t count[3] = {nt, nt * FP8_SCALE_INV_STRIDE, nt * s->history_len};
    mt_status st = MT_OK;
    if (write) {
        int64_t at = 0;
        for (int i = 0; i < 3; at += count[i], i++)
            CUDA_CHECK(&t->error, cudaMemcpyAsync(host + at, device[i], count[i] * 4, cudaMemcpyDeviceToHost, t->stream));
        CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
        st = mt_gpu_error_return(&t->error, err);
    } else {
        if (fread(host, sizeof(float), (size_t)n, f) != (size_t)n)
            st = mt_fail(err, MT_ERR_FORMAT, "%s: the FP8 scaling state is cut short", path);
        /* what the file says before it reaches the GEMMs: every scale and scale_inv finite and > 0,
         * every amax in the histories >= 0 (NaN, a step that overflowed, stays as Transformer Engine keeps it) */
        for (int64_t i = 0; st == MT_OK && i < nt; i++) {
            const float scale = host[i], scale_inv = host[nt + i * FP8_SCALE_INV_STRIDE];
            if (!(scale > 0.0f) || !isfinite(scale) || !(scale_inv > 0.0f) || !isfinite(scale_inv))
                st = mt_fail(err, MT_ERR_FORMAT, "%s: FP8 tensor %lld has scale %g and scale_inv %g (must be finite "
                             "and > 0)", path, (long long)i, scale, scale_inv);
        }
        for (int64_t i = 0; st == MT_OK && i < nt * s->history_len; i++)
            if (host[nt * (1 + FP8_SCALE_INV_STRIDE) + i] < 0.0f)
                st = mt_fail(err, MT_ERR_FORMAT, "%s: FP8 amax history entry %lld is negative (%g)", path,
                             (long long)i, host[nt * (1 + FP8_SCALE_INV_STRIDE) + i]);
        int64_t at = 0;
        for (int i = 0; st == MT_OK && i < 3; at += count[i], i++)
            CUDA_CHECK(&t->error, cudaMemcpyAsync(device[i], host + at, count[i] * 4, cudaMemcpyHostToDevice, t->stream));
        CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
        if (st == MT_OK) st = mt_gpu_error_return(&t->error, err);
    }
    if (!write) free(host);
    return st;
}

/* The routers' expert bias (megatron.h MT_CK_MOE_EXPERT_BIAS: [MoE layers, E] fp32 at the end of every model
 * file, the size rule mt_checkpoint_expert_bias_numel's) between the device's [L, E] (rows by model layer) and
 * a host array of the MoE layers' rows in model order: copied into a save's host copy (upload 0), or onto
 * the device from a checked read of the file (upload 1). */
static mt_status expert_bias_transfer(mt_trainer* t, float* host, int upload, mt_error* err) {
    const mt_config* c = &t->cfg;
    const int64_t E = c->num_experts;
    int64_t row = 0;
    for (int l = 0; l < c->num_layers; l++) {
        if (!mt_moe_layer(c, l)) continue;
        float* device = t->moe.expert_bias + (int64_t)l * E;
        float* h = host + row++ * E;
        CUDA_CHECK(&t->error, cudaMemcpyAsync(upload ? device : h, upload ? h : device, sizeof(float) * (size_t)E,
                                              upload ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, t->stream));
    }
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* Before a save at PP > 1: every rank assembles the whole bias. The rows a rank holds (mt_pp_holds) are
 * kept on its TP 0 / DP 0 copy, every other row zeroed, and the world sums them: each row then comes from
 * its one owner (x + 0 is exact; the bias is never -0: it starts at +0 and moves by +-rate). Every model
 * file then holds the same whole copy. Collective (a no-op without the bias or at PP = 1, where every rank
 * holds it whole). */
static void expert_bias_assemble(mt_trainer* t) {
    const mt_config* c = &t->cfg;
    if (!t->moe.enabled || !c->moe_router_enable_expert_bias || t->groups.pp_size == 1 || !t->groups.world) return;
    const int64_t E = c->num_experts, L = c->num_layers;
    const int keep = t->groups.tp.rank == 0 && t->groups.dp_rank == 0;
    for (int l = 0; l < L; l++)
        if (!keep || !mt_pp_holds(&t->buffer.stage, MT_P_ROUTER_WEIGHT, l))
            CUDA_CHECK(&t->error, cudaMemsetAsync(t->moe.expert_bias + l * E, 0, sizeof(float) * (size_t)E, t->stream));
    comm_after_compute(t);
    NCCL_CHECK(&t->error, t->cfg.rank,
               ncclAllReduce(t->moe.expert_bias, t->moe.expert_bias, (size_t)(L * E), ncclFloat, ncclSum,
                             t->groups.world, t->groups.comm_stream));
    compute_after_comm(t);
}

/* A load's expert bias (the header says there is one; mt_checkpoint_header_check_model made sure this run
 * has it, of the same MoE layers and experts): from ck's first model file when ck is not NULL (another
 * layout), else from the model file fd this rank reads; checked (megatron.h: finite values) and put on the
 * device. Model state: it loads with the weights, under --no-load-optim and --finetune too. */
static mt_status load_expert_bias(mt_trainer* t, const mt_ckpt* ck, int fd, const char* path, const int64_t* h,
                                  mt_error* err) {
    const int64_t n = mt_checkpoint_expert_bias_numel(h, NULL);
    float* host = (float*)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!host) return mt_fail(err, MT_ERR_OOM, "cannot allocate the expert bias' staging");
    mt_status st = ck ? mt_ckpt_read_expert_bias(ck, 0, host, err) : mt_checkpoint_read_expert_bias(fd, path, h, host, err);
    if (st == MT_OK) st = expert_bias_transfer(t, host, 1, err);
    free(host);
    return st;
}

/* ---- saving: each rank's files staged in host memory, then written (in the background with
 * --async-save), then committed by rank 0 once every rank's are complete ---- */

/* One file of a save, whole in host memory as it goes to disk: the header, then the arrays. */
typedef struct {
    char path[4300];
    char* bytes;
    size_t size;
    uint32_t crc; /* CRC-32C of the bytes, computed by the writer as it writes them (for the manifest) */
} staged_file;

/* A save between its staging and its commit. The writer thread (async) touches only the staged
 * files and its own status; the step loop does not touch them until the save is committed. */
struct mt_async_save {
    int pending;              /* staged, not yet committed (or given up) */
    int thread_started;
    pthread_t thread;
    int done;                 /* set by the writer (atomic) once every file is written or one failed */
    mt_status status;         /* the writer's result, its message in error */
    mt_error error;
    staged_file files[2];
    int num_files;
    char* pinned;             /* the async staging: pinned host memory, kept for the next save */
    size_t pinned_bytes;
    char dir[4096], tmp_dir[4096], final_dir[4096];
    int64_t iteration;
};

/* The bytes of a rank's file: header + canonical full-model arrays (model file) or its shards. */
static mt_status stage_checkpoint_file(mt_trainer* t, const int64_t* header, int shard_file, float* master_full,
                                       char* out, mt_error* err) {
    memcpy(out, header, sizeof(int64_t) * MT_CK_HEADER_WORDS);
    float* at = (float*)(out + sizeof(int64_t) * MT_CK_HEADER_WORDS);
    mt_status st = MT_OK;
    if (shard_file) {
        const float* arrays[3] = {t->opt.master, t->opt.adam_m, t->opt.adam_v};
        for (int i = 0; i < 3 && st == MT_OK; i++, at += t->opt.shard_numel)
            st = stage_device_array(t, arrays[i], t->opt.shard_numel, at, err);
        return st;
    }
    st = canonical_transfer(t, master_full, at, 0, err);
    at += t->num_params;
    /* without sharding, m and v are full buffer-layout arrays like the master */
    for (int i = 0; i < 2 && !t->opt.sharded && st == MT_OK; i++, at += t->num_params)
        st = canonical_transfer(t, full_optimizer_array(t, i ? t->opt.adam_v : t->opt.adam_m), at, 0, err);
    if (header[MT_CK_FP8_TENSORS] > 0 && st == MT_OK) st = fp8_state_transfer(t, NULL, at, NULL, err);
    int64_t bias_at = 0;
    if (mt_checkpoint_expert_bias_numel(header, &bias_at) > 0 && st == MT_OK)
        st = expert_bias_transfer(t, (float*)(out + sizeof(int64_t) * MT_CK_HEADER_WORDS) + bias_at, 0, err);
    return st;
}

/* Writes a staged file to its path, fsync'ed with its directory, and its CRC-32C from the bytes as
 * they go (64 MiB pieces, each checksummed while it is in the cache, then written). */
static mt_status write_staged_file(staged_file* sf, mt_error* err) {
    FILE* f = fopen(sf->path, "wb");
    if (!f) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", sf->path, strerror(errno));
    mt_status st = MT_OK;
    uint32_t crc = 0;
    const size_t piece = (size_t)64 << 20;
    for (size_t at = 0; at < sf->size && st == MT_OK; at += piece) {
        size_t n = sf->size - at < piece ? sf->size - at : piece;
        crc = mt_crc32c_extend(crc, sf->bytes + at, n);
        st = write_all(f, sf->bytes + at, n, sf->path, err);
    }
    sf->crc = crc;
    if (st == MT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", sf->path, strerror(errno));
    if (fclose(f) != 0 && st == MT_OK) st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", sf->path, strerror(errno));
    if (st == MT_OK && mt_sync_directory_of(sf->path) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", sf->path, strerror(errno));
    return st;
}

/* The writer: every staged file of this rank, in order; the first failure stops it. */
static void* async_save_writer(void* arg) {
    struct mt_async_save* a = (struct mt_async_save*)arg;
    mt_status st = MT_OK;
    for (int i = 0; i < a->num_files && st == MT_OK; i++) st = write_staged_file(&a->files[i], &a->error);
    a->status = st;
    __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A failure somewhere else: every rank returns an error, the failing one its own message. */
static mt_status other_rank_failed(mt_status st, mt_error* err, const char* what, const char* path) {
    if (st != MT_OK) return st;
    return mt_fail(err, MT_ERR_IO, "%s %s failed on another rank", what, path);
}

/* Every rank's `n` (at most MT_GATHER_DOUBLES) host doubles, all-gathered over the world in rank
 * order into out [world * n]. Collective. */
static mt_status all_gather_world(mt_trainer* t, const double* mine, int n, double* out, mt_error* err) {
    mt_process_groups* g = &t->groups;
    if (n > MT_GATHER_DOUBLES) return mt_fail(err, MT_ERR_ARG, "all_gather_world: %d values, at most %d", n, MT_GATHER_DOUBLES);
    if (!g->world) {
        memcpy(out, mine, sizeof(double) * (size_t)n);
        return MT_OK;
    }
    double* gathered = t->ddp.reduce_scratch + 2; /* [world * MT_GATHER_DOUBLES] after the two reduced values */
    const int world = t->cfg.world_size, rank = t->cfg.rank;
    CUDA_CHECK(&t->error, cudaMemcpyAsync(gathered + (size_t)rank * n, mine, sizeof(double) * (size_t)n,
                                          cudaMemcpyHostToDevice, t->stream));
    comm_after_compute(t);
    NCCL_CHECK(&t->error, t->cfg.rank,
               ncclAllGather(gathered + (size_t)rank * n, gathered, (size_t)n, ncclDouble, g->world, g->comm_stream));
    compute_after_comm(t);
    CUDA_CHECK(&t->error, cudaMemcpyAsync(out, gathered, sizeof(double) * (size_t)world * n, cudaMemcpyDeviceToHost,
                                          t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* The writers' checksums, gathered to rank 0 for the manifest (so the commit, which runs in the step
 * loop, does not read the checkpoint back): every rank's (CRC, size) of its files in one all-gather
 * over the world, and rank 0 names each rank's files with mt_ckpt_rank_files as begin_save does.
 * Collective. */
static mt_status gather_file_checksums(mt_trainer* t, const struct mt_async_save* a, mt_checkpoint_file_crc** known,
                                       int* num_known, mt_error* err) {
    const int world = t->cfg.world_size;
    double mine[MT_GATHER_DOUBLES] = {0}; /* [2 files][crc, size] */
    for (int f = 0; f < a->num_files && f < 2; f++) {
        mine[2 * f] = (double)a->files[f].crc;
        mine[2 * f + 1] = (double)a->files[f].size;
    }
    double* all = (double*)malloc(sizeof(double) * MT_GATHER_DOUBLES * (size_t)world);
    mt_checkpoint_file_crc* k = NULL;
    if (!all || (t->cfg.rank == 0 && !(k = (mt_checkpoint_file_crc*)calloc((size_t)world * 2, sizeof(*k))))) {
        free(all);
        return mt_fail(err, MT_ERR_OOM, "out of memory gathering the checkpoint's checksums");
    }
    mt_status st = all_gather_world(t, mine, MT_GATHER_DOUBLES, all, err);
    int n = 0;
    for (int r = 0; r < world && st == MT_OK && k; r++) {
        mt_rank_coords rc = mt_rank_coordinates(&t->cfg, r);
        mt_ckpt_rank other = checkpoint_rank(t);
        other.tp_rank = rc.tp;
        other.pp_rank = rc.pp;
        other.dp_rank = rc.dp;
        mt_ckpt_file files[2];
        const int count = mt_ckpt_rank_files(&other, files);
        for (int f = 0; f < count; f++, n++) {
            snprintf(k[n].path, sizeof(k[n].path), "%s", files[f].path);
            k[n].crc = (uint32_t)all[(size_t)r * MT_GATHER_DOUBLES + 2 * f];
            k[n].size = (int64_t)all[(size_t)r * MT_GATHER_DOUBLES + 2 * f + 1];
        }
    }
    free(all);
    if (st != MT_OK) {
        free(k);
        return st;
    }
    *known = k;
    *num_known = n;
    return MT_OK;
}

/* Rank 0 commits a save whose files every rank has written (megatron.h mt_checkpoint_commit: the
 * manifest of every rank's files with their checksums, the rename into place replacing an older copy
 * of the same iteration, then the tracker). Collective. */
static mt_status commit_save(mt_trainer* t, struct mt_async_save* a, mt_error* err) {
    mt_checkpoint_file_crc* known = NULL;
    int num_known = 0;
    mt_status st = gather_file_checksums(t, a, &known, &num_known, err);
    if (!all_ranks_ok(t, st == MT_OK)) {
        free(known);
        return other_rank_failed(st, err, "saving", a->final_dir);
    }
    if (t->cfg.rank == 0) st = mt_checkpoint_commit(a->dir, a->iteration, a->tmp_dir, known, num_known, err);
    free(known);
    if (!all_ranks_ok(t, st == MT_OK)) return other_rank_failed(st, err, "saving", a->final_dir);
    return mt_gpu_error_return(&t->error, err);
}

/* Ends the pending save: waits for this rank's writer (blocking), or returns with *committed = -1
 * when any rank's is still writing; once all are done, every rank agrees they succeeded and rank 0
 * commits (else the temporary directory goes and the first failure is the error). Collective. */
static mt_status finish_save(mt_trainer* t, int blocking, int64_t* committed, mt_error* err) {
    struct mt_async_save* a = t->ckpt.async_save;
    if (committed) *committed = -1;
    if (!a || !a->pending) return MT_OK;
    if (!blocking) {
        double busy = __atomic_load_n(&a->done, __ATOMIC_ACQUIRE) ? 0.0 : 1.0;
        if (all_reduce_sum(t, &busy, GROUP_WORLD, err) != MT_OK) return mt_gpu_error_return(&t->error, err);
        if (busy > 0.0) return MT_OK;
    }
    if (a->thread_started) pthread_join(a->thread, NULL);
    a->thread_started = 0;
    a->pending = 0;
    mt_status st = a->status;
    if (st != MT_OK) *err = a->error;
    if (!all_ranks_ok(t, st == MT_OK)) {
        if (t->cfg.rank == 0) mt_remove_tree(a->tmp_dir);
        return other_rank_failed(st, err, "saving", a->final_dir);
    }
    st = commit_save(t, a, err);
    if (st == MT_OK && committed) *committed = a->iteration;
    return st;
}

/* The async staging: pinned host memory (the copies run at the link's speed), grown to `total` bytes
 * and kept for the next save. Not while a save is pending (its writer reads it). */
static mt_status reserve_pinned_staging(struct mt_async_save* a, size_t total, mt_error* err) {
    if (total <= a->pinned_bytes) return MT_OK;
    if (a->pending) return mt_fail(err, MT_ERR_ARG, "the async save's staging cannot grow while a save is pending");
    if (a->pinned) cudaFreeHost(a->pinned);
    a->pinned = NULL;
    a->pinned_bytes = 0;
    if (cudaMallocHost((void**)&a->pinned, total) != cudaSuccess) {
        cudaGetLastError(); /* a failed allocation leaves no sticky error; clear it */
        return mt_fail(err, MT_ERR_OOM, "cannot allocate %zu bytes of pinned host memory for --async-save", total);
    }
    a->pinned_bytes = total;
    return MT_OK;
}

/* This rank's checkpoint bytes (its files: mt_ckpt_rank_files). */
static size_t rank_checkpoint_bytes(mt_trainer* t) {
    int64_t header[MT_CK_HEADER_WORDS];
    fill_header(t, header, 0, 0);
    const mt_ckpt_rank rank = checkpoint_rank(t);
    mt_ckpt_file files[2];
    const int count = mt_ckpt_rank_files(&rank, files);
    size_t total = 0;
    for (int f = 0; f < count; f++) total += (size_t)mt_checkpoint_file_bytes(header, files[f].shard);
    return total;
}

mt_status mt_trainer_reserve_async_save(mt_trainer* t, mt_error* err) {
    if (!t->ckpt.async_save && !(t->ckpt.async_save = (struct mt_async_save*)calloc(1, sizeof(struct mt_async_save))))
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the checkpoint writer's state");
    return reserve_pinned_staging(t->ckpt.async_save, rank_checkpoint_bytes(t), err);
}

/* A save: rank 0 makes the temporary directory; every rank stages its files in host memory (the
 * device-to-host copies; all ranks take part in gathering a sharded master); then the files are
 * written, here or (async) by a writer thread, and committed by finish_save. */
static mt_status begin_save(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples, int async,
                            mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    mt_status st = finish_save(t, 1, NULL, err); /* a save still in flight completes first */
    if (st != MT_OK) return st;
    if (!t->ckpt.async_save) {
        t->ckpt.async_save = (struct mt_async_save*)calloc(1, sizeof(struct mt_async_save));
        if (!t->ckpt.async_save) st = mt_fail(err, MT_ERR_OOM, "cannot allocate the checkpoint writer's state");
    }
    if (!all_ranks_ok(t, st == MT_OK)) return other_rank_failed(st, err, "saving", dir);
    struct mt_async_save* a = t->ckpt.async_save;
    char rank_dir[4160];
    int leader = t->cfg.rank == 0;       /* makes and renames the directories */
    snprintf(a->dir, sizeof(a->dir), "%s", dir);
    mt_checkpoint_save_dirs(dir, iteration, a->final_dir, sizeof(a->final_dir), a->tmp_dir, sizeof(a->tmp_dir));
    a->iteration = iteration;
    wait_for_all_parameters(t);

    /* 1. rank 0 makes the temporary directory, one mp_rank_<tp>[_<pp>][_<ep>] per model-parallel rank */
    if (leader) {
        if (mt_make_directories(dir) != 0)
            st = mt_fail(err, MT_ERR_IO, "cannot create checkpoint directory %s: %s", dir, strerror(errno));
        mt_checkpoint_tidy(dir);
        if (st == MT_OK && mkdir(a->tmp_dir, 0755) != 0)
            st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", a->tmp_dir, strerror(errno));
        const int tp = t->groups.tp.size, pp = t->groups.pp_size, ep = t->groups.ep_size;
        for (int r = 0; r < tp * pp * ep && st == MT_OK; r++) {
            mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), a->tmp_dir, pp, ep, r % tp, r / tp % pp, r / (tp * pp));
            if (mkdir(rank_dir, 0755) != 0) st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", rank_dir, strerror(errno));
        }
    }
    if (!all_ranks_ok(t, st == MT_OK)) return other_rank_failed(st, err, "saving", a->final_dir);

    /* 2. every rank stages its files (mt_ckpt_rank_files: the shard file, the model file on DP rank 0, with
     *    EP > 1 on the first DP rank of each EP rank's experts) */
    int64_t header[MT_CK_HEADER_WORDS];
    fill_header(t, header, iteration, consumed_samples);
    const mt_ckpt_rank rank = checkpoint_rank(t);
    mt_ckpt_file files[2];
    a->num_files = mt_ckpt_rank_files(&rank, files);
    size_t total = 0;
    for (int i = 0; i < a->num_files; i++) {
        snprintf(a->files[i].path, sizeof(a->files[0].path), "%s/%s", a->tmp_dir, files[i].path);
        a->files[i].size = (size_t)mt_checkpoint_file_bytes(header, files[i].shard);
        total += a->files[i].size;
    }
    char* stage = NULL;
    if (async) st = reserve_pinned_staging(a, total, err);
    if (async) stage = a->pinned;
    else if (total > 0 && !(stage = (char*)malloc(total)))
        st = mt_fail(err, MT_ERR_OOM, "cannot allocate %zu bytes to save a checkpoint", total);
    float* master_full = full_master(t); /* collective with the distributed optimizer */
    expert_bias_assemble(t);             /* collective at PP > 1 */
    for (int i = 0; i < a->num_files && st == MT_OK; i++) {
        a->files[i].bytes = stage + (i ? a->files[0].size : 0);
        st = stage_checkpoint_file(t, header, files[i].shard, master_full, a->files[i].bytes, err);
    }
    if (!all_ranks_ok(t, st == MT_OK)) {
        if (!async) free(stage);
        if (leader) mt_remove_tree(a->tmp_dir);
        return other_rank_failed(st, err, "saving", a->final_dir);
    }

    /* 3. the files written: here, or by the writer thread while training goes on */
    a->pending = 1;
    a->status = MT_OK;
    a->done = 0;
    if (async) {
        if (pthread_create(&a->thread, NULL, async_save_writer, a) == 0) {
            a->thread_started = 1;
            return MT_OK;
        }
        /* no thread: this rank writes now (the save stays whole either way) */
    }
    async_save_writer(a);
    st = finish_save(t, 1, NULL, err);
    if (!async) free(stage);
    return st;
}

/* At mt_trainer_free: the writer joined (not committed), the staging freed. */
static void release_save(mt_checkpoint_state* ck) {
    struct mt_async_save* a = ck->async_save;
    if (!a) return;
    if (a->thread_started) pthread_join(a->thread, NULL);
    if (a->pinned) cudaFreeHost(a->pinned);
    free(a);
    ck->async_save = NULL;
}

mt_status mt_trainer_save(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples, mt_error* err) {
    return begin_save(t, dir, iteration, consumed_samples, 0, err);
}

mt_status mt_trainer_save_async(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples,
                                mt_error* err) {
    return begin_save(t, dir, iteration, consumed_samples, 1, err);
}

mt_status mt_trainer_save_wait(mt_trainer* t, int blocking, int64_t* committed_iteration, mt_error* err) {
    return finish_save(t, blocking, committed_iteration, err);
}

/* Reads a checkpoint header and checks it as megatron.h's mt_checkpoint_header_check_rank does: every
 * word in range, the iteration the one asked for, the file's exact size, the model and layout this
 * run's, a shard file this rank's. f is NULL when the open failed (err already says why). */
static mt_status read_header(const mt_trainer* t, FILE* f, const char* path, int64_t iteration, int shard_file,
                             int64_t* h, mt_error* err) {
    if (!f) return MT_ERR_IO;
    if (fread(h, sizeof(int64_t), MT_CK_HEADER_WORDS, f) != MT_CK_HEADER_WORDS)
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated (no header)", path);
    struct stat sb;
    const mt_ckpt_rank rank = checkpoint_rank(t);
    return mt_checkpoint_header_check_rank(h, fstat(fileno(f), &sb) == 0 ? (int64_t)sb.st_size : -1, path, &t->cfg,
                                           &rank, iteration, shard_file, err);
}

/* A checkpoint saved at another layout (TP, PP, VP, the distributed optimizer's DP size, the
 * vocabulary's padding): the model must be this run's (one line names the first difference); this
 * rank's part of the master weights, and with load_optim of Adam's m and v, is cut from the saved
 * files slice by slice (megatron.h mt_ckpt_read_part: no rank reads more than one saved tensor slice
 * at a time beyond its own part) and put in place as a load at the same layout does. A
 * distributed-optimizer checkpoint's buckets are its header's (MT_CK_DDP_*), or for an older file
 * without them this run's --overlap-grad-reduce and --ddp-bucket-size (other ones are refused
 * naming them). FP8 delayed-scaling state is per-layout
 * and is not carried over (the scales start afresh). h gets the header (progress, scheduler, scaler). */
static mt_status load_other_layout(mt_trainer* t, const mt_ckpt* ck, int load_optim, float* host, int64_t* h,
                                   mt_error* err) {
    memcpy(h, ck->header, sizeof(int64_t) * MT_CK_HEADER_WORDS);
    mt_status st = mt_checkpoint_header_check_model(h, ck->iter_dir, &t->cfg, 1, err);
    const mt_ckpt_ddp ddp = {t->cfg.overlap_grad_reduce, t->cfg.ddp_bucket_size};
    float* moments[2] = {t->opt.adam_m, t->opt.adam_v};
    for (int a = MT_CKPT_MASTER; a <= (load_optim ? MT_CKPT_V : MT_CKPT_MASTER) && st == MT_OK; a++) {
        st = mt_ckpt_read_part(ck, &ddp, &t->cfg, a, host, err);
        if (st == MT_OK) st = canonical_transfer(t, t->grads, host, 1, err);
        if (st != MT_OK) break;
        if (a == MT_CKPT_MASTER) set_master_from_full(t, t->grads);
        else copy_owned(t, moments[a - MT_CKPT_M], t->grads, 1);
    }
    /* the expert bias: layout-free, whole from the first model file */
    if (st == MT_OK && h[MT_CK_MOE_EXPERT_BIAS]) st = load_expert_bias(t, ck, -1, ck->iter_dir, h, err);
    return st;
}

/* Loads a checkpoint: the weights, and with load_optim the optimizer's state too (Adam moments and
 * step, the scheduler's samples, the loss scaler). Without it (--no-load-optim, --finetune) only the
 * model file's master weights (and FP8 scaling state and the routers' expert bias, part of the model in
 * Megatron) are read, and
 * Adam, the schedule and the loss scale start as a new trainer's do. */
static mt_status load_checkpoint(mt_trainer* t, const char* dir, int64_t iteration, int load_optim,
                                 int64_t* iteration_out, int64_t* consumed_out, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    char path[4400], iter_dir[4200], rank_dir[4300];
    /* rank 0 picks the iteration and applies the integrity rule (megatron.h mt_checkpoint_select: a
     * tracked one that is refused gives way to the newest older one that verifies; what it has to say
     * is kept for mt_trainer_load_warning); every rank then loads the iteration it chose */
    mt_status st = MT_OK;
    double chosen = 0.0; /* rank 0's iteration + 1; 0: it failed (a fallback: the caller sees an iteration below the tracker's) */
    t->ckpt.load_warning.message[0] = 0;
    if (t->cfg.rank == 0) {
        int fell_back = 0;
        st = mt_checkpoint_select(dir, iteration, t->ckpt.no_verify_checkpoint, &iteration, &fell_back,
                                  &t->ckpt.load_warning, err);
        if (st == MT_OK) chosen = (double)iteration + 1.0;
    }
    if (all_reduce_sum(t, &chosen, GROUP_WORLD, err) != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (chosen < 1.0) return other_rank_failed(st, err, "loading from", dir);
    iteration = (int64_t)chosen - 1;
    mt_checkpoint_iteration_dir(iter_dir, sizeof(iter_dir), dir, iteration);
    wait_for_all_parameters(t);
    int64_t h[MT_CK_HEADER_WORDS];
    float* host = (float*)malloc(sizeof(float) *
                                 (size_t)(t->num_params > t->opt.shard_numel ? t->num_params : t->opt.shard_numel));
    if (!host && st == MT_OK) st = mt_fail(err, MT_ERR_OOM, "cannot allocate host memory to load a checkpoint");
    /* the saved layout: this run's (each rank reads its own files, below) or another one */
    mt_ckpt ck;
    int other_layout = 0;
    if (st == MT_OK) st = mt_ckpt_open(&ck, dir, iteration, err);
    if (st == MT_OK)
        other_layout = ck.tp != t->groups.tp.size || ck.pp != t->groups.pp_size ||
                       (ck.pp > 1 && ck.vp != t->buffer.stage.num_chunks) ||
                       ck.header[MT_CK_VOCAB] != t->cfg.padded_vocab_size ||
                       (ck.sharded_dp > 0 && (!t->opt.sharded || ck.sharded_dp != t->groups.dp_size)) ||
                       ck.ep != t->groups.ep_size;
    if (st == MT_OK && other_layout) st = load_other_layout(t, &ck, load_optim, host, h, err);
    if (st == MT_OK && !other_layout) {
        /* the model file: master weights (then m and v unless sharded), through the gradient buffer */
        mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), iter_dir, t->groups.pp_size, t->groups.ep_size, t->groups.tp.rank,
                            t->groups.pp_rank, t->groups.ep_rank);
        mt_ckpt_file_path(path, sizeof(path), rank_dir, -1);
        FILE* f = open_checkpoint_file(path, err);
        st = read_header(t, f, path, iteration, 0, h, err);
        if (st == MT_OK) st = read_canonical(t, f, t->grads, host, path, err);
        if (st == MT_OK) set_master_from_full(t, t->grads);
        if (st == MT_OK && load_optim && h[MT_CK_SHARDED_DP] == 0) {
            float* moments[2] = {t->opt.adam_m, t->opt.adam_v};
            for (int i = 0; i < 2 && st == MT_OK; i++) {
                st = read_canonical(t, f, t->grads, host, path, err);
                if (st == MT_OK) copy_owned(t, moments[i], t->grads, 1);
            }
        }
        /* FP8 delayed scaling's state: taken when this run has the same tensors and history length; a
         * checkpoint without it starts the scales afresh; another layout of it is refused */
        const int delayed = t->fp8.enabled && t->fp8.recipe == MT_FP8_DELAYED;
        if (st == MT_OK && delayed && h[MT_CK_FP8_TENSORS] > 0 && !load_optim && h[MT_CK_SHARDED_DP] == 0)
            st = skip_canonical(t, f, 2, path, err); /* the moments sit between the weights and the FP8 state */
        if (st == MT_OK && delayed && h[MT_CK_FP8_TENSORS] > 0) {
            if (h[MT_CK_FP8_TENSORS] != t->fp8.num_tensors || h[MT_CK_FP8_HISTORY_LEN] != t->fp8.history_len ||
                h[MT_CK_FP8_HISTORY_POS] < 0 || h[MT_CK_FP8_HISTORY_POS] >= h[MT_CK_FP8_HISTORY_LEN])
                st = mt_fail(err, MT_ERR_FORMAT,
                             "%s holds FP8 scaling for %lld tensors with an amax history of %lld (slot %lld); this run "
                             "has %d with a history of %d", path, (long long)h[MT_CK_FP8_TENSORS],
                             (long long)h[MT_CK_FP8_HISTORY_LEN], (long long)h[MT_CK_FP8_HISTORY_POS],
                             t->fp8.num_tensors, t->fp8.history_len);
            if (st == MT_OK) st = fp8_state_transfer(t, f, NULL, path, err);
            if (st == MT_OK) t->fp8.history_pos = (int)h[MT_CK_FP8_HISTORY_POS];
        }
        /* the expert bias at the file's end, read at its offset (whatever was read or skipped before it) */
        if (st == MT_OK && h[MT_CK_MOE_EXPERT_BIAS]) st = load_expert_bias(t, NULL, fileno(f), path, h, err);
        if (f) fclose(f);
    }
    if (st == MT_OK && !other_layout && load_optim && h[MT_CK_SHARDED_DP] != 0) {
        /* this rank's shard of master, m and v */
        mt_ckpt_file_path(path, sizeof(path), rank_dir, t->groups.dp_rank);
        FILE* f = open_checkpoint_file(path, err);
        int64_t hs[MT_CK_HEADER_WORDS];
        st = read_header(t, f, path, iteration, 1, hs, err); /* its DP rank and shard size too */
        float* arrays[3] = {t->opt.master, t->opt.adam_m, t->opt.adam_v};
        for (int i = 0; i < 3 && st == MT_OK; i++) st = read_device_array(t, f, arrays[i], t->opt.shard_numel, host, path, err);
        if (f) fclose(f);
    }
    free(host);
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    if (st == MT_OK) st = mt_gpu_error_return(&t->error, err);
    if (!all_ranks_ok(t, st == MT_OK)) return other_rank_failed(st, err, "loading from", dir);
    if (iteration_out) *iteration_out = h[MT_CK_ITERATION];
    if (consumed_out) *consumed_out = h[MT_CK_CONSUMED];
    t->iteration = h[MT_CK_ITERATION]; /* the dropout masks continue from the saved iteration */
    if (!load_optim) { /* a new trainer's optimizer state */
        const mt_config* c = &t->cfg;
        zero_adam_moments(t);
        CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
        t->opt.scheduler_steps = 0;
        t->opt.adam_step = 0;
        loss_scaler_reset(&t->scaler, c);
        return mt_gpu_error_return(&t->error, err);
    }
    t->opt.scheduler_steps = h[MT_CK_SCHED_STEPS];
    t->opt.adam_step = h[MT_CK_ADAM_STEP];
    t->scaler.growth_tracker = (int)h[MT_CK_GROWTH];
    t->scaler.hysteresis_tracker = (int)h[MT_CK_HYSTERESIS];
    memcpy(&t->scaler.loss_scale, &h[MT_CK_LOSS_SCALE_BITS], sizeof(double));
    return MT_OK;
}

mt_status mt_trainer_load(mt_trainer* t, const char* dir, int64_t iteration, int64_t* iteration_out,
                          int64_t* consumed_out, mt_error* err) {
    return load_checkpoint(t, dir, iteration, 1, iteration_out, consumed_out, err);
}

mt_status mt_trainer_load_weights(mt_trainer* t, const char* dir, int64_t iteration, int64_t* iteration_out,
                                  int64_t* consumed_out, mt_error* err) {
    return load_checkpoint(t, dir, iteration, 0, iteration_out, consumed_out, err);
}

void mt_trainer_set_no_verify_checkpoint(mt_trainer* t, int no_verify) {
    t->ckpt.no_verify_checkpoint = no_verify != 0;
}

const char* mt_trainer_load_warning(const mt_trainer* t) { return t->ckpt.load_warning.message; }

/* ============================================================================================== */
/* 21. The trainer API                                                                            */
/*    defines: mt_trainer_create / mt_trainer_free, mt_trainer_train_step(_n),                    */
/*    mt_trainer_evaluate, mt_trainer_logits, mt_trainer_get_parameters /                         */
/*    mt_trainer_set_parameters, mt_device_info: the API megatron.h declares.                     */
/* ============================================================================================== */

/* Carves the activation arena from its host layout (megatron.h mt_activation_layout_compute, the one
 * the memory plan counts): the scratch every step shares, then L->num_slots slots of the saved
 * activations (a slot holds one micro-batch's pass through the largest chunk of this pipeline rank;
 * the final norm's output and the logits only on the last stage). slots[k] gets slot k's saved
 * regions and the shared scratch; NULL where the config has no such region. */
static void layout_activations(mt_activations* slots, const mt_activation_layout* L, char* base) {
    for (int k = 0; k < L->num_slots; k++) {
        mt_activations* a = &slots[k];
        void** regions[MT_ACT_REGIONS] = {
            (void**)&a->ln1, (void**)&a->q, (void**)&a->k, (void**)&a->v, (void**)&a->o, (void**)&a->dk, (void**)&a->dv,
            (void**)&a->dscores, (void**)&a->dsum, (void**)&a->logits_row, (void**)&a->branch, (void**)&a->branch2,
            (void**)&a->dresidual, (void**)&a->gathered, (void**)&a->gathered_grad, (void**)&a->rows,
            (void**)&a->ce_stats, (void**)&a->inputs, (void**)&a->targets, (void**)&a->losses, (void**)&a->embed_index,
            (void**)&a->qk_norm, (void**)&a->qk_stats, (void**)&a->moe_xperm, (void**)&a->moe_y, (void**)&a->moe_dz,
            (void**)&a->moe_dact, (void**)&a->moe_dlogits, (void**)&a->moe_dprobs, (void**)&a->moe_x32,
            (void**)&a->moe_w32, (void**)&a->moe_work, (void**)&a->moe_stats, (void**)&a->moe_ep_index,
            (void**)&a->moe_ep_drow, (void**)&a->cp, (void**)&a->residual, (void**)&a->ln1_mean, (void**)&a->ln1_rstd, (void**)&a->qkv, (void**)&a->probs,
            (void**)&a->lse, (void**)&a->attn_out, (void**)&a->residual_mid, (void**)&a->ln2, (void**)&a->ln2_mean,
            (void**)&a->ln2_rstd, (void**)&a->fc1, (void**)&a->act, (void**)&a->moe_logits, (void**)&a->moe_probs,
            (void**)&a->moe_row, (void**)&a->moe_token, (void**)&a->moe_row_prob, (void**)&a->moe_counts,
            (void**)&a->moe_auxw, (void**)&a->moe_fc1, (void**)&a->moe_act, (void**)&a->moe_shared,
            (void**)&a->moe_gate, (void**)&a->moe_ep_in, (void**)&a->moe_ep_prob, (void**)&a->moe_ep_counts,
            (void**)&a->docs, (void**)&a->lnf, (void**)&a->lnf_mean,
            (void**)&a->lnf_rstd, (void**)&a->logits};
        for (int r = 0; r < MT_ACT_REGIONS; r++) {
            const size_t at = L->offset[r] + (r >= MT_ACT_RESIDUAL ? (size_t)k * L->saved_bytes : 0);
            *regions[r] = L->bytes[r] ? base + at : NULL;
        }
        a->cp_bytes = L->bytes[MT_ACT_CP];
        static_assert(MT_ACT_REGIONS == 68, "every activation region has its pointer above");
    }
}

#define COLSUM_MAX_CHUNKS MT_COLSUM_MAX_CHUNKS
#define CUBLAS_WORKSPACE_BYTES MT_CUBLAS_WORKSPACE_BYTES
static_assert(NORM_BWD_BLOCKS == MT_NORM_BWD_BLOCKS, "the memory plan counts the fused norm backward's blocks");
static_assert(FP8_SCALE_INV_STRIDE == MT_FP8_SCALE_INV_STRIDE, "the FP8 arena's layout is the plan's");

static size_t max_columns(const mt_trainer* t) {
    mt_shape s = model_shape(t);
    size_t w = (size_t)s.h;
    if ((size_t)s.qkv_width > w) w = s.qkv_width;
    if ((size_t)s.f1 > w) w = s.f1; /* an MoE model's: the shared expert's */
    const size_t dense_f1 = (size_t)t->cfg.ffn_hidden_size / s.tp * (s.swiglu ? 2 : 1); /* the plan's (megatron.h) */
    if (dense_f1 > w) w = dense_f1;
    return w;
}
/* floats of each column-sum scratch: [chunks, columns] of column_sum, [blocks, h] of the fused norm backward */
static size_t colsum_scratch_floats(const mt_trainer* t) {
    size_t a = COLSUM_MAX_CHUNKS * max_columns(t), b = (size_t)NORM_BWD_BLOCKS * model_shape(t).h;
    return a > b ? a : b;
}

mt_memory_plan mt_trainer_memory_plan(const mt_trainer* t) {
    mt_memory_plan p = t->mem.plan;
    p.state_bytes_measured = t->mem.state_bytes_measured;
    return p;
}

mt_memory_plan mt_trainer_memory_allocated(const mt_trainer* t) { return t->mem.allocated; }

/* Every device allocation of the trainer's life goes through here; `counter` (a field of
 * t->mem.allocated, NULL for a transient buffer) adds what was asked for, for comparison with the plan. */
static void* device_alloc(mt_trainer* t, size_t bytes, size_t* counter) {
    void* p = NULL;
    if (!CUDA_CHECK(&t->error, cudaMalloc(&p, bytes ? bytes : 1))) return NULL;
    if (counter) {
        *counter += bytes;
        t->mem.allocated.total_bytes += bytes;
    }
    return p;
}

/* RoPE's cos/sin tables [T, rot/2], as Megatron builds them: w_i = base^(-2i/rot) (fp32), with
 * Llama-3.1's scaling (low/high frequency factors 1 and 4, original context 8192): wavelengths
 * 2 pi / w above 8192 are stretched by the factor, those below 2048 kept, those between blended;
 * angle = t * w_i in fp32, its cos and sin rounded to fp32. */
/* The values: cos_out, sin_out [positions, rot/2] (generation's tables, section 23, are the same values
 * for more positions). */
static void rope_table_values(const mt_config* c, int rot, int positions, float* cos_out, float* sin_out) {
    const double pi = 3.14159265358979323846, original = 8192.0, low = 1.0, high = 4.0;
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        double w = 1.0 / pow(c->rotary_base, 2.0 * i / rot);
        if (c->use_rope_scaling) {
            double factor = c->rope_scaling_factor, wavelen = 2.0 * pi / w;
            if (wavelen > original / low) {
                w /= factor;
            } else if (wavelen >= original / high) {
                double smooth = (original / wavelen - low) / (high - low);
                w = (1.0 - smooth) * w / factor + smooth * w;
            }
        }
        float wf = (float)w;
        for (int pos = 0; pos < positions; pos++) {
            float angle = (float)pos * wf;
            cos_out[(size_t)pos * half + i] = (float)cos((double)angle);
            sin_out[(size_t)pos * half + i] = (float)sin((double)angle);
        }
    }
}
static void create_rope_tables(mt_trainer* t) {
    mt_shape s = model_shape(t);
    if (s.rot == 0) return;
    int half = s.rot / 2;
    size_t n = (size_t)s.S_full * half; /* every position of the sequence (context parallelism: not only this rank's) */
    float* host = (float*)malloc(2 * n * sizeof(float));
    if (!host) {
        t->error.status = mt_fail(&t->error.error, MT_ERR_OOM, "cannot allocate the RoPE tables");
        return;
    }
    rope_table_values(&t->cfg, s.rot, s.S_full, host, host + n);
    t->rope_cos = (float*)device_alloc(t, 2 * n * sizeof(float), &t->mem.allocated.workspace_bytes);
    if (t->rope_cos) {
        t->rope_sin = t->rope_cos + n;
        CUDA_CHECK(&t->error, cudaMemcpy(t->rope_cos, host, 2 * n * sizeof(float), cudaMemcpyHostToDevice));
    }
    free(host);
}

/* Initialises the weights as Megatron does into a full fp32 buffer-layout array (the gradient
 * buffer, free at this point), then the master and the model copy from it. Each element's value
 * depends only on (seed, tensor, its index in the full model's tensor): the same at any layout and
 * any tensor-parallel size, each TP rank computing the elements of its shard. */
static void initialise_parameters(mt_trainer* t) {
    const mt_config* c = &t->cfg;
    const mt_shape s = model_shape(t);
    const mt_exec ex = trainer_exec(t);
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->grads, 0, sizeof(float) * t->buffer.size, t->stream));
    for (int k = 0; k < t->buffer.num_params; k++) {
        const mt_buffer_param* p = &t->buffer.params[k];
        const mt_param_info* full = &t->params_info_full[p->tensor];
        float std = (float)c->init_method_std;
        if (full->init == 3) std = (float)(c->init_method_std / sqrt(2.0 * s.L));
        int mode = full->init == 3 ? 2 : full->init;
        int64_t per_layer_full = full->split_outer * full->split_rows * full->split_inner;
        int64_t rows, row0, outer, outer0;
        mt_tp_rows(full, t->groups.tp.size, t->groups.tp.rank, &rows, &row0);
        mt_ep_outer(full, t->groups.ep_size, t->groups.ep_rank, &outer, &outer0); /* an EP rank's experts */
        const int64_t first = (int64_t)p->layer * per_layer_full + outer0 * full->split_rows * full->split_inner;
        init_param(&ex, t->grads + p->offset, p->numel, first, rows, full->split_inner,
                   full->split_rows, row0, mode, std, c->seed, (uint64_t)mt_param_init_stream(p->tensor));
    }
    set_master_from_full(t, t->grads);
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->grads, 0, sizeof(float) * t->buffer.size, t->stream));
}

/* The optimizer's shard: each bucket's owned range, and the chunks AdamW and the norm walk (cut where
 * the GPU's part ends when the end of the shard is offloaded: the GPU's chunks come first); then the
 * offload's host state (section 19). The plan counts the same chunks (megatron.h). */
static mt_status plan_optimizer_shard(mt_trainer* t, mt_error* err) {
    const mt_buffer_layout* B = &t->buffer;
    const int dp = t->opt.sharded ? t->groups.dp_size : 1, dp_rank = t->opt.sharded ? t->groups.dp_rank : 0;
    t->opt.shard_offset = (int64_t*)calloc((size_t)B->num_buckets, sizeof(int64_t));
    int64_t shard = 0;
    for (int b = 0; b < B->num_buckets; b++) {
        int64_t begin, end;
        owned_range(t, b, &begin, &end);
        t->opt.shard_offset[b] = shard;
        shard += end - begin;
    }
    t->opt.shard_numel = shard;
    const int64_t gpu_shard = shard - mt_offload_elements(&t->cfg, shard);
    const int64_t n = mt_optimizer_pieces(B, dp, dp_rank, gpu_shard, NULL);
    mt_optimizer_piece* pieces = (mt_optimizer_piece*)malloc(sizeof(mt_optimizer_piece) * (size_t)(n > 0 ? n : 1));
    mt_opt_chunk* chunks = (mt_opt_chunk*)malloc(sizeof(mt_opt_chunk) * (size_t)(n > 0 ? n : 1));
    if (!t->opt.shard_offset || !pieces || !chunks || n > INT32_MAX) {
        free(pieces);
        free(chunks);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the optimizer plan (%lld chunks)", (long long)n);
    }
    mt_optimizer_pieces(B, dp, dp_rank, gpu_shard, pieces);
    const int c_cfg_decoupled = t->cfg.decoupled_lr >= 0;
    for (int64_t k = 0; k < n; k++) {
        mt_opt_chunk* c = &chunks[k];
        c->buffer = pieces[k].buffer;
        c->master = pieces[k].master;
        c->length = (int32_t)pieces[k].length;
        c->weight_decay = t->params_info[pieces[k].tensor].weight_decay;
        /* a TP replica's copy of a whole tensor counts on TP rank 0; the last stage's copy of tied word
         * embeddings not at all (the first stage's counts) */
        c->count_in_norm = (t->params_info[pieces[k].tensor].tp_split || t->groups.tp.rank == 0) &&
                           !(pieces[k].tensor == MT_P_WORD_EMBEDDINGS && !B->stage.embedding);
        /* expert parallelism without the distributed optimizer: the norms add over DP (norm_over_dp), so a
         * dense element counts on DP rank 0 only, an expert's on its expert-data-parallel rank 0 */
        if (t->groups.ep_size > 1 && !t->opt.sharded)
            c->count_in_norm &= t->params_info[pieces[k].tensor].ep_split ? t->groups.edp_rank == 0
                                                                          : t->groups.dp_rank == 0;
        c->decoupled = c_cfg_decoupled && mt_param_lr_decoupled(pieces[k].tensor);
    }
    free(pieces);
    t->opt.num_chunks = (int)n;
    t->opt.chunks = (mt_opt_chunk*)device_alloc(t, sizeof(mt_opt_chunk) * (size_t)(n > 0 ? n : 1),
                                            &t->mem.allocated.workspace_bytes);
    if (t->opt.chunks)
        CUDA_CHECK(&t->error,
                   cudaMemcpy(t->opt.chunks, chunks, sizeof(mt_opt_chunk) * (size_t)n, cudaMemcpyHostToDevice));
    mt_status st = t->error.status == MT_OK ? offload_create(t, chunks, (int)n, err) : MT_OK;
    free(chunks);
    return st != MT_OK ? st : mt_gpu_error_return(&t->error, err);
}

/* --fp8-param-gather: where each optimizer chunk (plan_optimizer_shard's, the same pieces) goes in
 * the parameter storage, and the scaling slot of the FP8 weight it belongs to (section 19). */
static mt_status fp8_publish_create(mt_trainer* t, mt_error* err) {
    const mt_buffer_layout* B = &t->buffer;
    const int dp = t->opt.sharded ? t->groups.dp_size : 1, dp_rank = t->opt.sharded ? t->groups.dp_rank : 0;
    const int64_t n = mt_optimizer_pieces(B, dp, dp_rank, t->opt.shard_numel, NULL);
    if (n != t->opt.num_chunks)
        return mt_fail(err, MT_ERR_CONFIG, "internal: %lld FP8 publish chunks for %d optimizer chunks", (long long)n,
                       t->opt.num_chunks);
    mt_optimizer_piece* pieces = (mt_optimizer_piece*)malloc(sizeof(mt_optimizer_piece) * (size_t)(n > 0 ? n : 1));
    fp8_publish_chunk* table = (fp8_publish_chunk*)calloc((size_t)(n > 0 ? n : 1), sizeof(fp8_publish_chunk));
    if (!pieces || !table) {
        free(pieces);
        free(table);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the FP8 publish table (%lld chunks)", (long long)n);
    }
    mt_optimizer_pieces(B, dp, dp_rank, t->opt.shard_numel, pieces);
    int i = 0; /* pieces and parameters both run in buffer order within a bucket; buckets in order */
    for (int64_t k = 0; k < n; k++) {
        while (i > 0 && B->params[i].offset > pieces[k].buffer) i--;
        while (B->params[i].offset + B->params[i].numel <= pieces[k].buffer) i++;
        const mt_buffer_param* p = &B->params[i];
        const int linear = p->tensor == MT_P_QKV_WEIGHT ? FP8_QKV : p->tensor == MT_P_PROJ_WEIGHT ? FP8_PROJ
                           : p->tensor == MT_P_FC1_WEIGHT ? FP8_FC1 : FP8_FC2;
        table[k].storage = p->storage + (pieces[k].buffer - p->offset) * (p->fp8 ? 1 : B->elem);
        table[k].weight = p->fp8 ? (t->fp8.slot_of_layer[p->layer] * FP8_LINEARS + linear) * FP8_ROLES + FP8_W : -1;
    }
    free(pieces);
    t->fp8.publish = (fp8_publish_chunk*)device_alloc(t, sizeof(fp8_publish_chunk) * (size_t)(n > 0 ? n : 1),
                                                      &t->mem.allocated.workspace_bytes);
    if (t->fp8.publish)
        CUDA_CHECK(&t->error, cudaMemcpy(t->fp8.publish, table, sizeof(fp8_publish_chunk) * (size_t)n,
                                         cudaMemcpyHostToDevice));
    free(table);
    return mt_gpu_error_return(&t->error, err);
}

/* The FP8 state (section 16), one device allocation: the scaling arrays (every scale 1, every
 * history 0 at the start, as Transformer Engine), the weights' FP8 copies in both layouts for every
 * FP8 layer, and the cast scratch of one linear ([BT, widest] four times). */
static mt_status fp8_state_create(mt_trainer* t, mt_error* err) {
    const mt_config* c = &t->cfg;
    mt_fp8_state* f = &t->fp8;
    memset(f, 0, sizeof(*f));
    if (c->fp8_format == MT_FP8_NONE) return MT_OK;
    int device = 0;
    cudaDeviceProp prop;
    if (!CUDA_CHECK(&t->error, cudaGetDevice(&device)) || !CUDA_CHECK(&t->error, cudaGetDeviceProperties(&prop, device)))
        return mt_gpu_error_return(&t->error, err);
    if (prop.major * 10 + prop.minor < 89)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-format needs a GPU with FP8 tensor cores (compute capability 8.9 or "
                       "newer); %s is %d.%d", prop.name, prop.major, prop.minor);
    const mt_shape s = model_shape(t);
    f->enabled = 1;
    f->fwd = FP8_E4M3;
    f->bwd = c->fp8_format == MT_FP8_HYBRID ? FP8_E5M2 : FP8_E4M3;
    f->recipe = c->fp8_recipe;
    f->margin = c->fp8_margin;
    f->wgrad = c->fp8_wgrad;
    if (fp8_fused_parse(getenv("MT_FP8_FUSED"), &f->fused, err) != MT_OK) return MT_ERR_ARG;
    f->fused = f->fused && f->recipe == MT_FP8_DELAYED; /* the other recipes' scales need the tensor first */
    f->algo = c->fp8_amax_compute_algo;
    f->history_len = c->fp8_recipe == MT_FP8_DELAYED ? c->fp8_amax_history_len : 1;
    f->slot_of_layer = (int*)malloc(sizeof(int) * (size_t)s.L);
    if (!f->slot_of_layer) return mt_fail(err, MT_ERR_OOM, "cannot allocate the FP8 layer table");
    for (int l = 0; l < s.L; l++) /* this pipeline rank's layers (the memory plan's count, megatron.h) */
        f->slot_of_layer[l] = mt_pp_holds(&t->buffer.stage, MT_P_LN1_WEIGHT, l) && mt_fp8_layer(c, l) ? f->num_layers++ : -1;
    f->num_tensors = f->num_layers * FP8_LINEARS * FP8_ROLES;
    for (int k = 0; k < FP8_LINEARS; k++) {
        int out, in;
        fp8_linear_dims(s, k, &out, &in);
        f->weights_per_layer += (c->fp8_param_gather ? 1 : 2) * (int64_t)out * in; /* W^T only: W is the storage's */
        f->weight_blocks_per_layer +=
            fp8_block_scales(FP8_BLOCKS_128x128, out, in) + fp8_block_scales(FP8_BLOCKS_128x128, in, out);
    }
    /* the arena as the plan lays it out (megatron.h), checked against this section's own geometry */
    const int blockwise = f->recipe == MT_FP8_BLOCKWISE;
    mt_fp8_arena_layout A;
    mt_fp8_arena_layout_compute(c, f->num_layers, &A);
    if (A.num_tensors != f->num_tensors || A.history_len != f->history_len ||
        A.weights_per_layer != f->weights_per_layer || A.weight_blocks_per_layer != f->weight_blocks_per_layer)
        return mt_fail(err, MT_ERR_CONFIG, "internal: the FP8 arena's plan (%lld weight bytes, %lld block scales per "
                       "layer) is not the FP8 layers' (%lld, %lld)", (long long)A.weights_per_layer,
                       (long long)A.weight_blocks_per_layer, (long long)f->weights_per_layer,
                       (long long)f->weight_blocks_per_layer);
    const int64_t nt = f->num_tensors;
    t->mem.fp8_arena_bytes = A.total;
    char* base = (char*)device_alloc(t, A.total, &t->mem.allocated.fp8_bytes);
    if (!base) return mt_gpu_error_return(&t->error, err);
    t->mem.fp8_arena = base;
    f->scale = (float*)(base + A.offset[MT_FP8A_SCALE]);
    f->scale_inv = (float*)(base + A.offset[MT_FP8A_SCALE_INV]);
    f->amax = (float*)(base + A.offset[MT_FP8A_AMAX]);
    f->fp8_max = (float*)(base + A.offset[MT_FP8A_MAX]);
    f->history = (float*)(base + A.offset[MT_FP8A_HISTORY]);
    f->weights = (uint8_t*)(base + A.offset[MT_FP8A_WEIGHTS]);
    f->x8 = (uint8_t*)(base + A.offset[MT_FP8A_X8]);
    f->x8t = (uint8_t*)(base + A.offset[MT_FP8A_X8T]);
    f->g8 = (uint8_t*)(base + A.offset[MT_FP8A_G8]);
    f->g8t = (uint8_t*)(base + A.offset[MT_FP8A_G8T]);
    if (blockwise) {
        f->x8_blocks = (float*)(base + A.offset[MT_FP8A_X_BLOCKS]);
        f->x8t_blocks = (float*)(base + A.offset[MT_FP8A_XT_BLOCKS]);
        f->g8_blocks = (float*)(base + A.offset[MT_FP8A_G_BLOCKS]);
        f->g8t_blocks = (float*)(base + A.offset[MT_FP8A_GT_BLOCKS]);
        f->weight_blocks = (float*)(base + A.offset[MT_FP8A_W_BLOCKS]);
    }
    const int64_t ones = nt * FP8_SCALE_INV_STRIDE;
    float* host = (float*)malloc(sizeof(float) * (size_t)(ones + nt + 1));
    if (!host) return mt_fail(err, MT_ERR_OOM, "cannot allocate the FP8 scales");
    for (int64_t i = 0; i < ones; i++) host[i] = 1.0f;
    for (int64_t i = 0; i < nt; i++) host[ones + i] = fp8_max_value(i % FP8_ROLES == FP8_G ? f->bwd : f->fwd);
    CUDA_CHECK(&t->error, cudaMemcpyAsync(f->scale, host, nt * 4, cudaMemcpyHostToDevice, t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(f->scale_inv, host, ones * 4, cudaMemcpyHostToDevice, t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(f->fp8_max, host + ones, nt * 4, cudaMemcpyHostToDevice, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(f->amax, 0, nt * 4, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(f->history, 0, nt * f->history_len * 4, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream)); /* before the host buffer goes */
    free(host);
    f->stale = (uint8_t*)malloc((size_t)s.L);
    if (!f->stale) return mt_fail(err, MT_ERR_OOM, "cannot allocate the FP8 layer table");
    fp8_weights_changed(&t->fp8, model_shape(t).L);
    f->param_gather = c->fp8_param_gather;
    f->unpublished = c->fp8_param_gather;
    if (f->param_gather && t->error.status == MT_OK) return fp8_publish_create(t, err);
    return mt_gpu_error_return(&t->error, err);
}

/* The plan first: a layout that cannot fit is refused before anything is allocated (this rank's
 * plan against the GPU's free memory). */
static mt_status plan_trainer_memory(const mt_config* cfg, mt_memory_plan* plan, mt_error* err) {
    mt_plan_options plan_options;
    mt_plan_options_defaults(&plan_options);
    plan_options.pp_rank = mt_rank_coordinates(cfg, cfg->rank).pp;
    plan_options.dp_rank = mt_rank_coordinates(cfg, cfg->rank).dp;
    plan_options.cp_rank = mt_rank_coordinates(cfg, cfg->rank).cp;
    mt_status plan_status = mt_memory_plan_compute(cfg, &plan_options, plan, err);
    if (plan_status != MT_OK) return plan_status;
    size_t free_bytes = 0, total_bytes = 0;
    cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (e != cudaSuccess)
        return mt_fail(err, MT_ERR_CUDA, "rank %d: cannot read the GPU's free memory: %s", cfg->rank,
                       cudaGetErrorString(e));
    /* the context exists by now: what is still to come is the allocations, cuBLAS and NCCL */
    const size_t need = plan->total_bytes + plan->overhead_bytes - MT_PLAN_CONTEXT_BYTES;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    if (need > free_bytes)
        return mt_fail(err, MT_ERR_OOM, "rank %d: the memory plan needs %.2f GiB on this GPU (%.2f GiB allocated, "
                       "%.2f GiB for cuBLAS and NCCL) but %.2f GiB of %.2f GiB are free: %.2f GiB short",
                       cfg->rank, need / gib, plan->total_bytes / gib, (need - plan->total_bytes) / gib,
                       free_bytes / gib, total_bytes / gib, (need - free_bytes) / gib);
    return MT_OK;
}

/* The data-parallel part (section 19): the events of the compute and communication streams'
 * handover, one event per bucket's parameter all-gather, and the first bucket of every layer. */
static mt_status ddp_create(mt_ddp_state* d, const mt_buffer_layout* B, mt_gpu_error* e, mt_error* err) {
    CUDA_CHECK(e, cudaEventCreateWithFlags(&d->compute_done, cudaEventDisableTiming));
    CUDA_CHECK(e, cudaEventCreateWithFlags(&d->comm_done, cudaEventDisableTiming));
    d->gathered = (cudaEvent_t*)calloc((size_t)B->num_buckets, sizeof(cudaEvent_t));
    d->first_bucket_of_layer = first_bucket_of_layers(B);
    if (!d->first_bucket_of_layer || !d->gathered)
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the trainer's bucket tables");
    for (int b = 0; d->gathered && b < B->num_buckets; b++)
        CUDA_CHECK(e, cudaEventCreateWithFlags(&d->gathered[b], cudaEventDisableTiming));
    return MT_OK;
}

/* cuBLAS on the trainer's stream, its workspace, and the GEMM plan cache (section 13) sharing it. */
static void gemm_context_create(mt_trainer* t) {
    t->cublas_workspace = device_alloc(t, CUBLAS_WORKSPACE_BYTES, &t->mem.allocated.workspace_bytes);
    gemm_handle_create(&t->error, &t->cublas, t->stream, t->cublas_workspace, CUBLAS_WORKSPACE_BYTES);
    t->gemm.handle = t->cublas;
    CUBLAS_CHECK(&t->error, cublasLtCreate(&t->gemm.lt));
    t->gemm.workspace = t->cublas_workspace;
    t->gemm.workspace_bytes = CUBLAS_WORKSPACE_BYTES;
    t->gemm.plans = (mt_gemm_plan*)calloc(GEMM_MAX_PLANS, sizeof(mt_gemm_plan));
    if (!t->gemm.plans && t->error.status == MT_OK)
        t->error.status = mt_fail(&t->error.error, MT_ERR_OOM, "cannot allocate the GEMM plan cache");
}

/* The model state, measured as the device sees it: gradients, master weights, the parameters (the
 * master itself when `alias`: fp32 weights are their own master, all buffer.size of them), Adam's
 * moments; `shard` elements of master, m and v on the device (with offload the first ones of the
 * optimizer's shard, section 19). */
static void allocate_model_state(mt_trainer* t, size_t shard, int alias) {
    size_t free_before = 0, free_after = 0, total = 0;
    CUDA_CHECK(&t->error, cudaDeviceSynchronize());
    CUDA_CHECK(&t->error, cudaMemGetInfo(&free_before, &total));
    const size_t n = (size_t)t->buffer.size;
    mt_memory_plan* a = &t->mem.allocated;
    t->grads = (float*)device_alloc(t, n * 4, &a->gradient_bytes);
    t->opt.master = (float*)device_alloc(t, alias ? n * 4 : shard * 4, alias ? &a->parameter_bytes : &a->master_bytes);
    t->params = alias ? (void*)t->opt.master : device_alloc(t, (size_t)t->buffer.storage_bytes, &a->parameter_bytes);
    t->opt.adam_m = (float*)device_alloc(t, shard * 4, &a->optimizer_bytes);
    t->opt.adam_v = (float*)device_alloc(t, shard * 4, &a->optimizer_bytes);
    CUDA_CHECK(&t->error, cudaMemGetInfo(&free_after, &total));
    t->mem.state_bytes_measured = free_before - free_after;
}

/* The activation arena: as many slots as a training step's schedule holds at once (1 at PP = 1),
 * each for this rank's largest chunk (the plan's layout); the running activations start as slot 0. */
static mt_status allocate_activation_slots(mt_trainer* t, mt_error* err) {
    const mt_config* cfg = &t->cfg;
    mt_activation_layout arena;
    {
        const mt_pp_stage* stage = &t->buffer.stage;
        int largest = 0;
        for (int k = 0; k < stage->num_chunks; k++) largest = stage->num_layers[k] > largest ? stage->num_layers[k] : largest;
        mt_status slots_status = mt_pp_activation_slots(t->groups.pp_size, stage->num_chunks, mt_num_micro_batches(cfg),
                                                        cfg->microbatch_group_size_per_vp_stage, t->groups.pp_rank,
                                                        &t->loop.num_slots, err);
        if (slots_status != MT_OK) return slots_status;
        mt_activation_layout_compute(cfg, largest, stage->head, t->loop.num_slots, &cfg->recompute, &arena);
    }
    t->loop.slots = (mt_activations*)calloc((size_t)t->loop.num_slots, sizeof(mt_activations));
    if (!t->loop.slots) return mt_fail(err, MT_ERR_OOM, "cannot allocate the activation slots");
    t->mem.arena_bytes = arena.total;
    t->mem.arena = device_alloc(t, t->mem.arena_bytes, &t->mem.allocated.activation_bytes);
    if (t->mem.arena) layout_activations(t->loop.slots, &arena, (char*)t->mem.arena);
    t->act = t->loop.slots[0];
    return MT_OK;
}

/* The new trainer's starting state: Adam's moments (their `shard` elements on the device) and the
 * parameter storage zeroed (the storage is the master when `alias`), then the parameters
 * initialised, finished before create returns. */
static void initialise_model_state(mt_trainer* t, size_t shard, int alias) {
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->opt.adam_m, 0, shard * 4, t->stream));
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->opt.adam_v, 0, shard * 4, t->stream));
    if (!alias) CUDA_CHECK(&t->error, cudaMemsetAsync(t->params, 0, (size_t)t->buffer.storage_bytes, t->stream));
    initialise_parameters(t);
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
}

mt_status mt_trainer_create(mt_trainer** out, const mt_config* cfg, mt_error* err) {
    *out = NULL;
    if (cfg->padded_vocab_size <= 0 || cfg->kv_channels <= 0 || cfg->ffn_hidden_size <= 0 || cfg->data_parallel_size <= 0)
        return mt_fail(err, MT_ERR_CONFIG, "mt_trainer_create needs a finalized config (mt_config_finalize)");
    /* what this build lacks: the one list the planner uses too (megatron.h) */
    if (mt_config_check_supported(cfg, err) != MT_OK) return MT_ERR_CONFIG;
    if (cfg->local_rank >= 0) {
        cudaError_t e = cudaSetDevice(cfg->local_rank);
        if (e != cudaSuccess)
            return mt_fail(err, MT_ERR_CUDA, "rank %d: cannot use GPU %d: %s", cfg->rank, cfg->local_rank,
                           cudaGetErrorString(e));
    }
    mt_memory_plan plan;
    mt_status plan_status = plan_trainer_memory(cfg, &plan, err);
    if (plan_status != MT_OK) return plan_status;
    mt_trainer* t = (mt_trainer*)calloc(1, sizeof(mt_trainer));
    if (!t) return mt_fail(err, MT_ERR_OOM, "cannot allocate the trainer");
    t->cfg = *cfg;
    t->mem.plan = plan;
    t->elem = cfg->precision == MT_FP32 ? 4 : 2;
    /* bf16 attention runs on the flash kernels; fp32/fp16 keep the exact path (fp32 parity is 1e-5) */
    t->flash = mt_flash_attention(cfg);
    { /* MT_ATTN_FWD, read once here (section 13.2) */
        mt_error attn_error;
        if (attn_fwd_parse(getenv("MT_ATTN_FWD"), &t->attn_fwd, &attn_error) != MT_OK)
            mt_gpu_fail(&t->error, MT_ERR_ARG, "%s", attn_error.message);
        else if (t->attn_fwd == MT_ATTN_FWD_FA3 && !(t->flash && hopper_attention_available(&t->gemm.hopper)))
            mt_gpu_fail(&t->error, MT_ERR_ARG,
                        "MT_ATTN_FWD=fa3: the Hopper attention forward needs --bf16 flash attention (head dim 64 or "
                        "128), a compute capability 9.x GPU and a build for it (GPU_ARCH=90 builds sm_90a)");
    }
    { /* MT_ATTN_BWD, read once here (section 13.3) */
        mt_error attn_error;
        if (attn_bwd_parse(getenv("MT_ATTN_BWD"), &t->attn_bwd, &attn_error) != MT_OK)
            mt_gpu_fail(&t->error, MT_ERR_ARG, "%s", attn_error.message);
        else if (t->attn_bwd == MT_ATTN_BWD_FA3 && !(t->flash && hopper_attention_backward_available(&t->gemm.hopper)))
            mt_gpu_fail(&t->error, MT_ERR_ARG, "MT_ATTN_BWD=fa3: the Hopper attention backward needs --bf16 flash attention, "
                                               "a compute capability 9.x GPU and a build for it (GPU_ARCH=90 builds sm_90a)");
    }
    mt_param_layout_shard(cfg, t->params_info);
    mt_param_layout(cfg, t->params_info_full);
    loss_scaler_reset(&t->scaler, cfg);
    mt_status st = mt_buffer_layout_build(&t->buffer, cfg, err);
    if (st != MT_OK) {
        mt_trainer_free(t);
        return st;
    }
    t->num_params = t->buffer.canonical_size; /* this TP rank's shard of this pipeline stage */

    CUDA_CHECK(&t->error, cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking));
    process_groups_create(&t->groups, cfg, t->stream, &t->error);
    const char* trace = getenv("MT_PP_TRACE");
    t->debug.pp_trace = t->groups.pp_size > 1 && trace && trace[0] == '1';
    mt_shape s = model_shape(t); /* after the groups: it holds this rank's TP coordinate */
    t->opt.sharded = cfg->use_distributed_optimizer && t->groups.dp_size > 1;
    st = ddp_create(&t->ddp, &t->buffer, &t->error, err);
    if (st != MT_OK) {
        mt_trainer_free(t);
        return st;
    }
    gemm_context_create(t);
    if (t->error.status == MT_OK) {
        mt_status shard_status = plan_optimizer_shard(t, err);
        if (shard_status != MT_OK && t->error.status == MT_OK) {
            mt_trainer_free(t);
            return shard_status;
        }
    }

    /* with offload the device holds the first `shard` elements of master, m and v (section 19) */
    const size_t shard = (size_t)(t->opt.offload ? t->opt.offload->gpu_numel : t->opt.shard_numel);
    const int alias = cfg->precision == MT_FP32 && !t->opt.sharded; /* fp32 weights are their own master */
    allocate_model_state(t, shard, alias);
    mt_memory_plan* a = &t->mem.allocated;
    t->opt.norm_partial = (double*)device_alloc(t, ((size_t)t->opt.num_chunks + 1) * sizeof(double),
                                                &a->workspace_bytes);
    t->ddp.reduce_scratch = (double*)device_alloc(t, MT_REDUCE_SCRATCH_BYTES(t->cfg.world_size), &a->workspace_bytes);
    if (mt_grad_reduce_scratch(&t->cfg, &t->buffer) > 0)
        t->ddp.bf16_grads = (__nv_bfloat16*)device_alloc(t, (size_t)mt_grad_reduce_scratch(&t->cfg, &t->buffer) * 2,
                                                         &a->workspace_bytes);
    t->colsum.max_chunks = COLSUM_MAX_CHUNKS;
    t->colsum.partial_a = (float*)device_alloc(t, colsum_scratch_floats(t) * 4, &a->workspace_bytes);
    t->colsum.partial_b = (float*)device_alloc(t, colsum_scratch_floats(t) * 4, &a->workspace_bytes);
    t->colsum.partial_c = (float*)device_alloc(t, colsum_scratch_floats(t) * 4, &a->workspace_bytes);
    st = allocate_activation_slots(t, err);
    if (st != MT_OK) {
        mt_trainer_free(t);
        return st;
    }
    if (t->groups.pp_size > 1) t->loop.pp_send = device_alloc(t, (size_t)s.R * s.h * t->elem, &a->workspace_bytes);
    if (t->error.status == MT_OK) moe_state_create(t);
    if (t->error.status == MT_OK) create_rope_tables(t);
    if (t->error.status == MT_OK) {
        mt_status fst = fp8_state_create(t, err);
        if (fst != MT_OK) {
            mt_trainer_free(t);
            return fst;
        }
    }
    /* host staging: inputs, targets, a V-sized counting buffer, the documents [2, BT]; the embedding index
     * (with the position index's room); losses */
    const size_t whole = s.cp > 1 ? 5 * (size_t)s.B * s.S_full : 0; /* CP: the whole samples' documents, inputs */
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&t->loop.host_tokens,
                                         sizeof(int32_t) * (4 * (size_t)s.BT + (size_t)s.V_full + whole)));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&t->loop.host_index,
                                         sizeof(int32_t) * (4 * (size_t)s.BT + 3 + (size_t)s.S_full)));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&t->loop.host_losses, sizeof(float) * (size_t)s.BT));
    if (t->error.status == MT_OK) initialise_model_state(t, shard, alias);
    if (t->error.status != MT_OK) {
        mt_status st2 = mt_gpu_error_return(&t->error, err);
        mt_trainer_free(t);
        return st2;
    }
    *out = t;
    return MT_OK;
}

mt_status mt_trainer_on_collective_timeout(mt_trainer* t, mt_collective_timeout_handler handler, void* user,
                                           mt_error* err) {
    if (!handler) return mt_fail(err, MT_ERR_ARG, "the collective timeout needs a handler");
    if (t->watchdog || t->cfg.world_size == 1) return MT_OK; /* one process: no collectives to wait on */
    mt_watchdog* w = (mt_watchdog*)calloc(1, sizeof(mt_watchdog));
    if (!w) return mt_fail(err, MT_ERR_OOM, "cannot allocate the watchdog");
    mt_process_groups* g = &t->groups;
    const cudaStream_t streams[] = {t->stream, g->comm_stream, g->tp.stream, g->pp_streams[0], g->pp_streams[1]};
    const char* stream_names[] = {"compute", "data-parallel", "tensor-parallel", "pipeline activation",
                                  "pipeline gradient"};
    for (int i = 0; i < 5; i++)
        if (streams[i] && (i != 2 || g->tp.size > 1))
            w->stream[w->num_streams] = streams[i], w->stream_name[w->num_streams++] = stream_names[i];
    const ncclComm_t comms[] = {g->world, g->tp.comm, g->dp, g->pp, g->pp_grad, g->embedding, g->ep, g->edp, g->cp};
    const char* comm_names[] = {"world", "tensor-parallel", "data-parallel", "pipeline", "pipeline gradient",
                                "embedding", "expert-parallel", "expert-data-parallel", "context-parallel"};
    static_assert(MT_WATCH_MAX_COMMS >= 9, "the watchdog watches every communicator");
    for (int i = 0; i < 9; i++)
        if (comms[i]) w->comm[w->num_comms] = comms[i], w->comm_name[w->num_comms++] = comm_names[i];
    w->rank = t->cfg.rank;
    if (cudaGetDevice(&w->device) != cudaSuccess) w->device = t->cfg.local_rank >= 0 ? t->cfg.local_rank : 0;
    w->timeout_s = 60.0 * t->cfg.distributed_timeout_minutes;
    w->error = &t->error;
    w->handler = handler;
    w->user = user;
    mt_status st = watchdog_start(w, err);
    if (st != MT_OK) {
        watchdog_stop(w);
        return st;
    }
    t->watchdog = w;
    return MT_OK;
}

void mt_trainer_free(mt_trainer* t) {
    if (!t) return;
    watchdog_stop(t->watchdog); /* before the streams and communicators it watches go */
    release_save(&t->ckpt); /* a save never committed stays a temporary directory, removed by the next save */
    if (t->stream) cudaStreamSynchronize(t->stream);
    if (t->groups.comm_stream) cudaStreamSynchronize(t->groups.comm_stream);
    if (t->groups.tp.stream) cudaStreamSynchronize(t->groups.tp.stream);
    if (t->params != (void*)t->opt.master) cudaFree(t->params);
    cudaFree(t->opt.master);
    cudaFree(t->grads);
    cudaFree(t->opt.adam_m);
    cudaFree(t->opt.adam_v);
    cudaFree(t->opt.chunks);
    cudaFree(t->fp8.publish);
    cudaFree(t->opt.norm_partial);
    cudaFree(t->ddp.reduce_scratch);
    cudaFree(t->ddp.bf16_grads);
    cudaFree(t->colsum.partial_a);
    cudaFree(t->colsum.partial_b);
    cudaFree(t->colsum.partial_c);
    cudaFree(t->mem.arena);
    moe_state_free(&t->moe);
    free(t->loop.slots);
    cudaFree(t->loop.pp_send);
    cudaFree(t->mem.fp8_arena);
    offload_free(&t->opt);
    free(t->fp8.stale);
    free(t->fp8.slot_of_layer);
    cudaFree(t->rope_cos); /* the sin table shares its allocation */
    cudaFree(t->cublas_workspace);
    cudaFreeHost(t->loop.host_tokens);
    cudaFreeHost(t->loop.host_index);
    cudaFreeHost(t->loop.host_losses);
    if (t->cublas) cublasDestroy(t->cublas);
    gemm_plans_free(&t->gemm);
    if (t->gemm.lt) cublasLtDestroy(t->gemm.lt);
    for (int b = 0; t->ddp.gathered && b < t->buffer.num_buckets; b++)
        if (t->ddp.gathered[b]) cudaEventDestroy(t->ddp.gathered[b]);
    free(t->ddp.gathered);
    free(t->ddp.first_bucket_of_layer);
    if (t->ddp.compute_done) cudaEventDestroy(t->ddp.compute_done);
    if (t->ddp.comm_done) cudaEventDestroy(t->ddp.comm_done);
    process_groups_free(&t->groups);
    if (t->stream) cudaStreamDestroy(t->stream);
    free(t->opt.shard_offset);
    mt_buffer_layout_free(&t->buffer);
    free(t);
}

mt_status mt_trainer_compute_gradients(mt_trainer* t, const int32_t* tokens, int num_micro_batches, double* loss,
                                       mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    return run_micro_batches(t, tokens, num_micro_batches, 1, 1.0, 1, loss, err);
}

mt_status mt_trainer_evaluate(mt_trainer* t, const int32_t* tokens, int num_micro_batches, double* loss,
                              mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    return run_micro_batches(t, tokens, num_micro_batches, 0, 1.0, 1, loss, err);
}

static int whole_sequence_here(const mt_trainer* t, const char* what, mt_error* err);
mt_status mt_trainer_token_losses(mt_trainer* t, const int32_t* tokens, float* losses, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (!whole_sequence_here(t, "mt_trainer_token_losses", err)) return MT_ERR_CONFIG;
    double mean; /* run_micro_batches leaves the micro-batch's per-token losses in act.losses (last stage) */
    mt_status st = run_micro_batches(t, tokens, 1, 0, 1.0, 0, &mean, err);
    if (st != MT_OK) return st;
    const size_t BT = (size_t)model_shape(t).BT;
    if (t->groups.pp_size > 1) /* every stage gets the last stage's */
        NCCL_CHECK(&t->error, t->cfg.rank, ncclBroadcast(t->act.losses, t->act.losses, BT, ncclFloat,
                                                         t->groups.pp_size - 1, t->groups.pp, t->stream));
    return copy_sync(t, losses, t->act.losses, sizeof(float) * BT, cudaMemcpyDeviceToHost, err);
}

/* FP8 delayed scaling after an optimizer step: this step's amaxes (the largest over its micro-batches
 * and, reduced with max over Megatron's amax-reduction group, TP x DP, the same on all its ranks)
 * enter each tensor's history, the scales follow (fp8_scale_update), the amaxes restart at 0. At
 * PP = 1 that group is every rank (one all-reduce over the world); with pipeline parallelism each
 * stage holds other layers' slots, so the stage's ranks reduce over TP, then over DP (a maximum of
 * maxima is the same bits in any order). */
static void fp8_after_step(mt_trainer* t) {
    mt_fp8_state* f = &t->fp8;
    if (!f->enabled || f->recipe != MT_FP8_DELAYED || f->num_tensors == 0) return;
    const mt_exec ex = trainer_exec(t);
    mt_process_groups* g = &t->groups;
    ncclComm_t groups[2] = {g->pp_size > 1 ? g->tp.comm : g->world, g->pp_size > 1 ? g->dp : NULL};
    if (groups[0] || groups[1]) comm_after_compute(t);
    for (int k = 0; k < 2; k++)
        if (groups[k])
            NCCL_CHECK(&t->error, t->cfg.rank,
                       ncclAllReduce(f->amax, f->amax, (size_t)f->num_tensors, ncclFloat, ncclMax, groups[k],
                                     g->comm_stream));
    if (groups[0] || groups[1]) compute_after_comm(t);
    fp8_scale_update(&ex, f->history, f->scale, f->scale_inv, f->amax, f->fp8_max, f->num_tensors, f->history_len,
                     f->history_pos, f->margin, f->algo, FP8_SCALE_INV_STRIDE);
    f->history_pos = (f->history_pos + 1) % f->history_len;
    CUDA_CHECK(&t->error, cudaMemsetAsync(f->amax, 0, sizeof(float) * (size_t)f->num_tensors, t->stream));
}

mt_status mt_trainer_train_step(mt_trainer* t, const int32_t* tokens, mt_step_result* out, mt_error* err) {
    return mt_trainer_train_step_n(t, tokens, mt_num_micro_batches(&t->cfg), out, err);
}

/* One iteration of num_micro_batches micro-batches per rank (a batch-size ramp changes it from step
 * to step; Megatron's get_num_microbatches): the scheduler advances by the samples this global
 * batch had. */
mt_status mt_trainer_train_step_n(mt_trainer* t, const int32_t* tokens, int num_micro_batches, mt_step_result* out,
                                  mt_error* err) {
    const mt_config* c = &t->cfg;
    memset(out, 0, sizeof(*out));
    out->params_norm = -1.0; /* not computed (unless asked for, below) */
    out->num_zeros_in_grad = -1;
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (num_micro_batches < 1)
        return mt_fail(err, MT_ERR_ARG, "train step: %d micro-batches (at least 1)", num_micro_batches);
    double loss = 0.0, scale = t->scaler.loss_scale;
    mt_status st = run_micro_batches(t, tokens, num_micro_batches, 1, scale, 1, &loss, err);
    if (st != MT_OK) return st;
    if (t->debug.test_nan_gradients_at == t->iteration + 1 && t->buffer.num_params > 0) /* bytes 0xff: a NaN */
        CUDA_CHECK(&t->error, cudaMemsetAsync(t->grads + t->buffer.params[0].offset, 0xff, sizeof(float), t->stream));
    t->iteration++; /* the next step draws new dropout masks, applied or skipped */
    moe_after_backward(t);
    moe_step_losses(t, out->moe_losses);
    out->lm_loss = loss;
    out->loss_scale = scale;
    out->nan = !isfinite(loss);

    /* unscale, look for overflow (fp16), clip on the global norm */
    double norm = sqrt(gradient_norm_squared(t)) / scale;
    int found_inf = !isfinite(norm);
    double lr = mt_learning_rate(c, t->opt.scheduler_steps);
    double lr_decoupled = mt_learning_rate_decoupled(c, t->opt.scheduler_steps);
    out->learning_rate = lr;
    /* Megatron's --check-for-nan-in-loss-and-grad: the loss and the norm are the same on every rank
     * (both reduced), so every rank stops here together, before the optimizer touches anything */
    if (c->check_for_nan_in_loss_and_grad && (!isfinite(loss) || (found_inf && c->precision != MT_FP16))) {
        /* nothing of the step stays: its FP8 amaxes are dropped, as the update is (the gradient buffer
         * is overwritten by the next step's first backward) */
        if (t->fp8.enabled && t->fp8.recipe == MT_FP8_DELAYED && t->fp8.num_tensors > 0)
            CUDA_CHECK(&t->error, cudaMemsetAsync(t->fp8.amax, 0, sizeof(float) * (size_t)t->fp8.num_tensors, t->stream));
        /* the weights' amaxes went with them: they are recorded where the weights are cast (once per
         * step), so the next step casts them again, from the same weights at the same scales (the same
         * bytes); without this its history would get 0 for every weight */
        if (t->fp8.enabled) {
            fp8_weights_changed(&t->fp8, model_shape(t).L);
            if (t->fp8.param_gather) t->fp8.unpublished = 1;
        }
        out->next_learning_rate = lr; /* the scheduler did not move (a skipping caller logs these) */
        out->next_decoupled_learning_rate = lr_decoupled;
        return mt_fail(err, MT_ERR_NAN, "found %s in the %s on rank %d (lm loss %g, grad norm %g): the step is not "
                       "applied (--check-for-nan-in-loss-and-grad)", isnan(loss) || isnan(norm) ? "NaN" : "Inf",
                       !isfinite(loss) ? "loss" : "gradients", c->rank, loss, norm);
    }
    if (c->precision == MT_FP16 && found_inf) {
        loss_scaler_update(&t->scaler, c, 1);
        out->skipped = 1;
        out->next_learning_rate = lr; /* a skipped step does not advance the scheduler */
        out->next_decoupled_learning_rate = lr_decoupled;
        if (c->log_params_norm) out->params_norm = sqrt(params_norm_squared(t)); /* Megatron logs it still */
        return mt_gpu_error_return(&t->error, err);
    }
    loss_scaler_update(&t->scaler, c, 0);
    out->grad_norm = norm;
    double clip = 1.0;
    if (c->clip_grad > 0) {
        double coeff = c->clip_grad / (norm + 1e-6);
        if (coeff < 1.0) clip = coeff;
    }
    float grad_scale = (float)(clip / scale);
    if (c->log_num_zeros_in_grad) out->num_zeros_in_grad = gradient_zeros(t, grad_scale); /* after clipping, as Megatron */
    double* params_norm = c->log_params_norm ? &out->params_norm : NULL; /* of the weights after the step */
    switch (c->precision) {
        case MT_FP32: adamw_step<float>(t, (float)lr, (float)lr_decoupled, grad_scale, params_norm); break;
        case MT_BF16: adamw_step<__nv_bfloat16>(t, (float)lr, (float)lr_decoupled, grad_scale, params_norm); break;
        case MT_FP16: adamw_step<__half>(t, (float)lr, (float)lr_decoupled, grad_scale, params_norm); break;
    }
    fp8_after_step(t);
    t->opt.scheduler_steps += (int64_t)num_micro_batches * model_shape(t).B * t->groups.data_size;
    out->next_learning_rate = mt_learning_rate(c, t->opt.scheduler_steps);
    out->next_decoupled_learning_rate = mt_learning_rate_decoupled(c, t->opt.scheduler_steps);
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

int64_t mt_trainer_last_loss_tokens(const mt_trainer* t) { return t->loop.last_loss_tokens; }

mt_status mt_trainer_moe_stats(mt_trainer* t, float* losses, int32_t* tokens, float* expert_bias, mt_error* err) {
    const mt_config* c = &t->cfg;
    if (!t->moe.enabled) return mt_fail(err, MT_ERR_CONFIG, "MoE statistics: the model has no MoE layers");
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    const int E = c->num_experts;
    float* bias = NULL;
    if (expert_bias) {
        bias = (float*)malloc(sizeof(float) * (size_t)c->num_layers * E);
        if (!bias) return mt_fail(err, MT_ERR_OOM, "out of memory");
        mt_status st = copy_sync(t, bias, t->moe.expert_bias, sizeof(float) * (size_t)c->num_layers * E,
                                 cudaMemcpyDeviceToHost, err);
        if (st != MT_OK) return free(bias), st;
    }
    int i = 0;
    for (int l = 0; l < c->num_layers; l++) {
        if (!mt_moe_layer(c, l)) continue;
        if (losses) memcpy(losses + (size_t)i * 4, t->moe.last_log + (size_t)l * 4, sizeof(float) * 4);
        if (tokens) memcpy(tokens + (size_t)i * E, t->moe.last_tokens + (size_t)l * E, sizeof(int32_t) * E);
        if (bias) memcpy(expert_bias + (size_t)i * E, bias + (size_t)l * E, sizeof(float) * E);
        i++;
    }
    free(bias);
    return MT_OK;
}

mt_status mt_trainer_set_iteration(mt_trainer* t, int64_t iteration, mt_error* err) {
    if (iteration < 0) return mt_fail(err, MT_ERR_ARG, "iteration %lld: must be >= 0", (long long)iteration);
    t->iteration = iteration;
    return MT_OK;
}

mt_status mt_device_profiler(int start, mt_error* err) {
    cudaError_t e = start ? cudaProfilerStart() : cudaProfilerStop();
    if (e != cudaSuccess)
        return mt_fail(err, MT_ERR_CUDA, "cudaProfiler%s: %s", start ? "Start" : "Stop", cudaGetErrorString(e));
    return MT_OK;
}

/* Calls that need the whole model on one rank's pipeline stage (logits, text generation). */
static int whole_model_here(const mt_trainer* t, const char* what, mt_error* err) {
    if (!whole_sequence_here(t, what, err)) return 0;
    if (t->groups.pp_size == 1) return 1;
    mt_fail(err, MT_ERR_CONFIG, "%s needs the whole model on one pipeline stage (--pipeline-model-parallel-size 1)", what);
    return 0;
}
/* Per-position results (logits, per-token losses) need every position on this rank: not with context
 * parallelism (each rank holds two chunks of each sequence). */
static int whole_sequence_here(const mt_trainer* t, const char* what, mt_error* err) {
    if (t->groups.cp_size == 1) return 1;
    mt_fail(err, MT_ERR_CONFIG, "%s needs whole sequences on one rank (--context-parallel-size 1)", what);
    return 0;
}

mt_status mt_trainer_logits(mt_trainer* t, const int32_t* tokens, float* logits, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (!whole_model_here(t, "mt_trainer_logits", err)) return MT_ERR_CONFIG;
    mt_shape s = model_shape(t);
    /* tokens come as [B, S]; make [B, S+1] rows with a dummy label so the usual staging applies */
    int32_t* rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)s.B * (s.S + 1));
    if (!rows) return mt_fail(err, MT_ERR_OOM, "cannot allocate token staging");
    for (int b = 0; b < s.B; b++) {
        memcpy(rows + (int64_t)b * (s.S + 1), tokens + (int64_t)b * s.S, sizeof(int32_t) * s.S);
        rows[(int64_t)b * (s.S + 1) + s.S] = 0;
    }
    double loss;
    mt_status st = run_micro_batches(t, rows, 1, 0, 1.0, 0, &loss, err);
    free(rows);
    if (st != MT_OK) return st;
    int64_t n = (int64_t)s.BT * s.V;
    if (s.tp > 1) {
        /* every rank's columns in turn: cast to fp32, broadcast over TP, placed at the rank's columns */
        float* mine = (float*)device_alloc(t, sizeof(float) * (size_t)n, NULL);
        float* staging = (float*)device_alloc(t, sizeof(float) * (size_t)n, NULL);
        const mt_exec ex = trainer_exec(t);
        if (t->error.status == MT_OK) cast_to_float(&ex, t->cfg.precision, mine, t->act.logits, n);
        for (int r = 0; r < s.tp && t->error.status == MT_OK; r++) {
            tp_broadcast(&t->groups.tp, staging, mine, (size_t)n, ncclFloat, r);
            tp_join(&t->groups.tp);
            CUDA_CHECK(&t->error, cudaMemcpy2DAsync(logits + (int64_t)r * s.V, (size_t)s.V_full * 4, staging,
                                                    (size_t)s.V * 4, (size_t)s.V * 4, (size_t)s.BT,
                                                    cudaMemcpyDeviceToHost, t->stream));
            CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
        }
        cudaFree(mine);
        cudaFree(staging);
    } else if (t->cfg.precision == MT_FP32) {
        copy_sync(t, logits, t->act.logits, n * 4, cudaMemcpyDeviceToHost, err);
    } else {
        /* convert to fp32 in chunks through the sublayer scratch (unused after the forward) */
        int64_t wide = (int64_t)max_columns(t);
        int64_t chunk = (int64_t)s.BT * wide * (int64_t)t->elem / 4;
        for (int64_t off = 0; off < n && t->error.status == MT_OK; off += chunk) {
            int64_t m = n - off < chunk ? n - off : chunk;
            float* stage = (float*)t->act.branch;
            const mt_exec ex = trainer_exec(t);
            cast_to_float(&ex, t->cfg.precision, stage, (const char*)t->act.logits + off * (int64_t)t->elem, m);
            CUDA_CHECK(&t->error, cudaMemcpyAsync(logits + off, stage, m * 4, cudaMemcpyDeviceToHost, t->stream));
            CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
        }
    }
    return mt_gpu_error_return(&t->error, err);
}

/* gather_full_model with expert parallelism (TP = PP = 1 in this build): each EP rank's buffer in turn is
 * broadcast over the EP group, downloaded and put in place (mt_tp_shard_copy of shard ep_rank: its
 * experts; the dense tensors, the same on every rank, come from each). Collective over EP. */
static mt_status gather_expert_shards(mt_trainer* t, float* device_full, float* host_full, mt_error* err) {
    mt_process_groups* g = &t->groups;
    float* part = (float*)malloc(sizeof(float) * (size_t)t->num_params);
    if (!part) return mt_fail(err, MT_ERR_OOM, "cannot allocate a host shard of %lld floats", (long long)t->num_params);
    float* staging = (float*)device_alloc(t, sizeof(float) * (size_t)t->buffer.size, NULL);
    for (int r = 0; r < g->ep_size && t->error.status == MT_OK; r++) {
        NCCL_CHECK(&t->error, t->cfg.rank, ncclBroadcast(device_full, staging, (size_t)t->buffer.size, ncclFloat, r, g->ep,
                                                         t->stream));
        if (canonical_transfer(t, staging, part, 0, err) != MT_OK) break;
        mt_tp_shard_copy(&t->cfg, r, host_full, part, 0);
    }
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    cudaFree(staging);
    free(part);
    return mt_gpu_error_return(&t->error, err);
}

/* The full model's canonical array from a full buffer-layout array of every TP rank: each rank's
 * shard in turn is broadcast over the TP group, downloaded and put in place (mt_tp_shard_copy; with
 * pipeline parallelism only this stage's tensors, the rest of host_full left alone:
 * mt_pp_tp_part_to_full). Collective over TP; allocates a staging copy for the call (not in the
 * training loop). */
static mt_status gather_full_model(mt_trainer* t, float* device_full, float* host_full, mt_error* err) {
    const int staged = t->groups.pp_size > 1; /* this stage's tensors only */
    if (t->groups.ep_size > 1) return gather_expert_shards(t, device_full, host_full, err);
    if (t->groups.tp.size == 1 && !staged) return canonical_transfer(t, device_full, host_full, 0, err);
    const int64_t shard_numel = mt_param_layout_shard(&t->cfg, NULL);
    float* part = (float*)malloc(sizeof(float) * (size_t)t->num_params); /* this stage's part of one shard */
    float* scratch = staged ? (float*)malloc(sizeof(float) * (size_t)shard_numel) : NULL;
    if (!part || (staged && !scratch)) {
        free(part);
        free(scratch);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate a host shard of %lld floats", (long long)shard_numel);
    }
    if (t->groups.tp.size == 1) { /* one shard: this rank's own */
        mt_status st = canonical_transfer(t, device_full, part, 0, err);
        if (st == MT_OK) mt_pp_tp_part_to_full(&t->cfg, &t->buffer.stage, 0, part, host_full, scratch);
        free(part);
        free(scratch);
        return st;
    }
    float* staging = (float*)device_alloc(t, sizeof(float) * (size_t)t->buffer.size, NULL);
    for (int r = 0; r < t->groups.tp.size && t->error.status == MT_OK; r++) {
        tp_broadcast(&t->groups.tp, staging, device_full, (size_t)t->buffer.size, ncclFloat, r);
        tp_join(&t->groups.tp);
        if (canonical_transfer(t, staging, part, 0, err) != MT_OK) break;
        if (staged) mt_pp_tp_part_to_full(&t->cfg, &t->buffer.stage, r, part, host_full, scratch);
        else mt_tp_shard_copy(&t->cfg, r, host_full, part, 0); /* at PP = 1 the part is the shard */
    }
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    cudaFree(staging);
    free(part);
    free(scratch);
    return mt_gpu_error_return(&t->error, err);
}

/* Parameters in canonical order (the full model; each TP rank keeps its shard, each EP rank its
 * experts), through the gradient buffer (free between steps). */
mt_status mt_trainer_set_parameters(mt_trainer* t, const float* params, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    wait_for_all_parameters(t);
    float* shard = (float*)params;
    if (t->groups.tp.size > 1 && t->groups.pp_size > 1)
        return mt_fail(err, MT_ERR_CONFIG, "parameters of a pipeline stage are set at TP = 1 only");
    if (t->groups.tp.size > 1 || t->groups.pp_size > 1) {
        shard = (float*)malloc(sizeof(float) * (size_t)t->num_params);
        if (!shard) return mt_fail(err, MT_ERR_OOM, "cannot allocate a host shard of %lld floats", (long long)t->num_params);
        if (t->groups.pp_size > 1) mt_pp_stage_copy(&t->cfg, &t->buffer.stage, (float*)params, shard, 1);
        else mt_tp_shard_copy(&t->cfg, t->groups.tp.rank, (float*)params, shard, 1);
    } else if (t->groups.ep_size > 1) { /* this EP rank's experts (TP = PP = 1 with experts here) */
        shard = (float*)malloc(sizeof(float) * (size_t)t->num_params);
        if (!shard) return mt_fail(err, MT_ERR_OOM, "cannot allocate a host shard of %lld floats", (long long)t->num_params);
        mt_tp_shard_copy(&t->cfg, t->groups.ep_rank, (float*)params, shard, 1);
    }
    mt_status st = canonical_transfer(t, t->grads, shard, 1, err);
    if (shard != params) free(shard);
    if (st != MT_OK) return st;
    set_master_from_full(t, t->grads);
    CUDA_CHECK(&t->error, cudaMemsetAsync(t->grads, 0, sizeof(float) * t->buffer.size, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

mt_status mt_trainer_get_parameters(mt_trainer* t, float* params, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    wait_for_all_parameters(t);
    return gather_full_model(t, full_master(t), params, err);
}

mt_status mt_trainer_get_gradients(mt_trainer* t, float* grads, mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (t->opt.sharded) gather_owned_fp32(t, t->grads); /* each rank holds the sums of its shards */
    return gather_full_model(t, t->grads, grads, err);
}

mt_status mt_trainer_next_token_logits(mt_trainer* t, const int32_t* context, int length, float* logits,
                                       mt_error* err) {
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    if (!whole_model_here(t, "mt_trainer_next_token_logits", err)) return MT_ERR_CONFIG;
    mt_shape s = model_shape(t);
    if (length < 1 || length > s.S) return mt_fail(err, MT_ERR_ARG, "context length %d not in [1, %d]", length, s.S);
    /* row 0 holds the context; causal attention makes the rest irrelevant to position length-1 */
    size_t count = (size_t)s.B * (s.S + 1);
    int32_t* rows = (int32_t*)calloc(count, sizeof(int32_t));
    if (!rows) return mt_fail(err, MT_ERR_OOM, "cannot allocate token staging");
    memcpy(rows, context, sizeof(int32_t) * length);
    double loss;
    mt_status st = run_micro_batches(t, rows, 1, 0, 1.0, 0, &loss, err);
    free(rows);
    if (st != MT_OK) return st;
    /* this rank's columns of the row, in fp32 at their place in the whole vocabulary, then gathered */
    float* stage = t->act.logits_row + s.vocab_start;
    const char* row = (const char*)t->act.logits + (size_t)(length - 1) * s.V * t->elem;
    const mt_exec ex = trainer_exec(t);
    cast_to_float(&ex, t->cfg.precision, stage, row, s.V);
    if (s.tp > 1) {
        tp_all_gather(&t->groups.tp, t->act.logits_row, stage, (size_t)s.V, ncclFloat);
        tp_join(&t->groups.tp);
    }
    CUDA_CHECK(&t->error, cudaMemcpyAsync(logits, t->act.logits_row, (size_t)s.V_full * 4, cudaMemcpyDeviceToHost,
                                          t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    return mt_gpu_error_return(&t->error, err);
}

/* Dense tensor-core peaks from NVIDIA's datasheets (SXM parts), for Megatron-style MFU. */
double mt_device_peak_tflops(mt_precision precision) {
    cudaDeviceProp prop;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        cudaGetLastError();
        return 0.0;
    }
    struct { const char* name; double half, single; } table[] = {
        {"H200", 989.0, 67.0}, {"H100", 989.0, 67.0}, {"H800", 989.0, 67.0}, {"GH200", 989.0, 67.0},
        {"A100", 312.0, 19.5}, {"A800", 312.0, 19.5}, {"L40S", 362.0, 91.6}, {"B200", 2250.0, 80.0},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strstr(prop.name, table[i].name)) return precision == MT_FP32 ? table[i].single : table[i].half;
    return 0.0;
}

mt_status mt_device_check(int* count, mt_error* err) {
    *count = 0;
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver); /* 0 when no driver is installed */
    cudaRuntimeGetVersion(&runtime);
    cudaError_t e = cudaGetDeviceCount(count);
    if (e == cudaSuccess && *count > 0) return MT_OK;
    cudaGetLastError(); /* not sticky: clear it for whoever asks next */
    *count = 0;
    const char* visible = getenv("CUDA_VISIBLE_DEVICES");
    char devices[160] = "";
    if (visible) snprintf(devices, sizeof(devices), " (CUDA_VISIBLE_DEVICES='%.100s')", visible);
    const char* without = "; without a GPU, --plan and --plan-layouts plan a layout and `./test_megatron host` runs the "
                          "host tests";
    if (driver == 0) /* CUDA's own words here ("driver version is insufficient") would mislead */
        return mt_fail(err, MT_ERR_CUDA, "no NVIDIA GPU or driver was found (no NVIDIA driver is loaded): training needs an "
                       "NVIDIA GPU with its driver installed (nvidia-smi must list it)%s", without);
    if (e == cudaErrorInsufficientDriver)
        return mt_fail(err, MT_ERR_CUDA, "the NVIDIA driver supports CUDA %d.%d, older than this build's CUDA runtime "
                       "%d.%d: update the driver, or build with a CUDA toolkit the driver supports", driver / 1000,
                       driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
    return mt_fail(err, MT_ERR_CUDA, "no NVIDIA GPU was found: the NVIDIA driver (CUDA %d.%d) sees none%s (CUDA: %s); "
                   "nvidia-smi must list one%s", driver / 1000, driver % 1000 / 10, devices,
                   cudaGetErrorString(e == cudaSuccess ? cudaErrorNoDevice : e), without);
}

mt_status mt_device_info(char* name, size_t name_size, size_t* free_bytes, size_t* total_bytes, mt_error* err) {
    cudaDeviceProp prop;
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) return mt_fail(err, MT_ERR_CUDA, "no usable CUDA device: %s", cudaGetErrorString(e));
    snprintf(name, name_size, "%s", prop.name);
    return MT_OK;
}

/* ============================================================================================== */
/* 23. Generation: the engine                                                                     */
/*    megatron.h section 15b's mt_generator over a trainer's weights (one GPU, TP = PP = 1): the  */
/*    KV-cache block pool and its free list, the requests (each in a slot: a row of the block     */
/*    tables, its blocks taken at mt_generator_add for every position it can ever cache, so a     */
/*    running request never waits for memory), and the step: the rows of the prompts prefilled    */
/*    now and of one token per decoding request go through the layers together (the forward's    */
/*    launchers: embedding at the rows' positions, norms, GEMMs, RoPE at the rows' positions (in  */
/*    the QKV GEMV's epilogue where the step's linears run there),                                */
/*    activations) with the K/V of every row stored into its request's blocks before the         */
/*    attention of section 22 reads them; the final norm's rows that need logits (the last of a  */
/*    prompt, each decoding row, a prompt's every row for its log-probabilities) are gathered,    */
/*    the output layer makes their fp32 logits in chunks, and sample_rows draws or scores them.   */
/*    The GEMMs go to cuBLAS without a cuBLASLt plan (gemm_uncached): the row count changes with  */
/*    every step and would fill the trainer's plan cache. All device work on the trainer's        */
/*    stream with its error record; one host-to-device copy of the step's rows and one copy back. */
/*    A decode step of n rows runs as a CUDA graph captured at its first occurrence.              */
/*    defines: the mt_generator API of megatron.h section 15b.                                    */
/* ============================================================================================== */

/* One request: its tokens (the prompt, then those generated), its sampling settings and its blocks. */
typedef struct {
    int active;               /* the slot holds a request (added, not finished) */
    int64_t id;
    int32_t* tokens;          /* [max_context] host */
    int prompt_len, len;      /* the prompt's tokens; all tokens so far */
    int generated;            /* tokens generated so far */
    int prefilled;            /* its prompt went through a step */
    mt_sampling s;            /* stop_tokens points at stop */
    int32_t stop[MT_GEN_MAX_STOP_TOKENS];
    int64_t num_blocks;       /* its blocks: the slot's row of the block tables */
    float* prompt_logprobs;   /* [prompt_len - 1] when asked for */
} gen_request;

/* A finished request's prompt log-probabilities, readable until the next step. */
typedef struct {
    int64_t id;
    int count;
    float* values;
} gen_retired;

struct mt_generator {
    mt_trainer* t;
    mt_generator_config gc;   /* with its defaults filled */
    mt_shape s;               /* the model's shapes (TP = 1); B, S, BT, R set per pass */
    int qpg, V;               /* query heads per group; the real vocabulary */
    int max_blocks;           /* blocks of one request at most: ceil(max_context / block_tokens) */
    int cap;                  /* rows of one step: max_step_tokens */
    int logit_rows;           /* rows of logits made at once */
    int part_rows;            /* rows of one decode-attention launch (its split scratch) */
    int max_splits;           /* splits of the longest row: ceil(max_context / GEN_SPLIT_TOKENS) */
    /* device */
    void* pool;               /* [num_blocks, L, 2, groups, block_tokens, d] model type */
    int32_t* tables;          /* [max_batch, max_blocks] the slots' block tables */
    void *x, *mid, *ln, *qkv, *qk_rows, *attn, *branch, *fc1, *act, *lnf_rows; /* [cap, width] activations */
    float *mean, *rstd;       /* [cap] the norms' statistics (unused) */
    float* qk_stats;          /* [2, cap * groups * (qpg + 1)] --qk-layernorm's */
    float *part_o, *part_lse; /* [part_rows, heads, max_splits, d], [part_rows, heads, max_splits] */
    int* attn_counters;       /* [part_rows, groups] the attention's merge counters (zero between launches) */
    float2* sample_part;      /* [logit_rows, parts] sample_stats_kernel's (max, sum) per part */
    int* sample_part_i;       /* [logit_rows, parts] its argmax per part */
    int* sample_counters;     /* [logit_rows] (zero between launches) */
    float4* sample_row;       /* [logit_rows] each row's max, log-sum-exp, argmax */
    float *rope_cos, *rope_sin; /* [max_context, rot / 2] */
    float* logits;            /* [logit_rows, Vp] fp32 */
    int32_t* rows;            /* [4, cap]: tokens, positions, slots, the rows gathered for logits */
    gen_sample_params* params;/* [cap] */
    int32_t* out_token;       /* [cap] */
    float* out_logprob;       /* [cap] */
    size_t device_bytes;
    /* host */
    int32_t* h_rows;          /* pinned [4, cap] */
    gen_sample_params* h_params; /* pinned [cap] */
    int32_t* h_out_token;     /* pinned [cap] */
    float* h_out_logprob;     /* pinned [cap] */
    int32_t* h_tables;        /* [max_batch, max_blocks] */
    int tables_dirty;
    int32_t* free_list;       /* [num_blocks] */
    int64_t num_free;
    gen_request* req;         /* [max_batch] */
    int64_t next_id;
    gen_retired* retired;     /* [max_batch] */
    int num_retired;
    int* row_request;         /* [cap] the slot of each logits row; -1 none */
    /* decode steps as CUDA graphs: the launches of a step of n decoding rows (1 .. max_batch) captured once and
     * replayed (a step is some 10 launches a layer, whose CPU cost would exceed the GPU's at small batches);
     * off with MT_GEN_GRAPHS=0 in the environment, or after a capture that failed (then eager launches) */
    cudaGraphExec_t* graphs;  /* [max_batch + 1], NULL where not captured yet */
    int use_graphs;
    /* the linears of steps of at most GEN_GEMV_ENGINE_ROWS rows through gemv_rows (else cuBLAS); off with
     * MT_GEN_GEMV=0 in the environment (to compare) */
    int use_gemv;
    /* the decode kernels as programmatic dependent launches (gen_launch); off with MT_GEN_PDL=0 */
    int use_pdl;
};

static void gen_release_blocks(mt_generator* g, gen_request* r, int slot) {
    for (int64_t b = 0; b < r->num_blocks; b++) g->free_list[g->num_free++] = g->h_tables[(int64_t)slot * g->max_blocks + b];
    r->num_blocks = 0;
}

/* Ends the request in `slot`: its blocks back to the pool; its prompt log-probabilities kept until the next
 * step when `keep` (a request that finished; a cancelled one is forgotten at once). */
static void gen_finish(mt_generator* g, int slot, int keep) {
    gen_request* r = &g->req[slot];
    gen_release_blocks(g, r, slot);
    if (keep && r->prompt_logprobs && r->prefilled && g->num_retired < g->gc.max_batch) {
        gen_retired* k = &g->retired[g->num_retired++];
        k->id = r->id, k->count = r->prompt_len - 1, k->values = r->prompt_logprobs;
    } else {
        free(r->prompt_logprobs);
    }
    r->prompt_logprobs = NULL;
    r->active = 0;
}

static void gen_forget_retired(mt_generator* g) {
    for (int i = 0; i < g->num_retired; i++) free(g->retired[i].values);
    g->num_retired = 0;
}

void mt_generator_free(mt_generator* g) {
    if (!g) return;
    if (g->t && g->t->stream) cudaStreamSynchronize(g->t->stream);
    void* device[] = {g->pool, g->tables, g->x, g->mid, g->ln, g->qkv, g->qk_rows, g->attn, g->branch, g->fc1, g->act,
                      g->lnf_rows, g->mean, g->rstd, g->qk_stats, g->part_o, g->part_lse, g->rope_cos, g->logits,
                      g->rows, g->params, g->out_token, g->out_logprob, g->attn_counters, g->sample_part,
                      g->sample_part_i, g->sample_counters, g->sample_row};
    for (size_t i = 0; i < sizeof(device) / sizeof(device[0]); i++) cudaFree(device[i]);
    for (int n = 0; g->graphs && n <= g->gc.max_batch; n++)
        if (g->graphs[n]) cudaGraphExecDestroy(g->graphs[n]);
    free(g->graphs);
    cudaFreeHost(g->h_rows);
    cudaFreeHost(g->h_params);
    cudaFreeHost(g->h_out_token);
    cudaFreeHost(g->h_out_logprob);
    for (int i = 0; g->req && i < g->gc.max_batch; i++) {
        free(g->req[i].tokens);
        free(g->req[i].prompt_logprobs);
    }
    gen_forget_retired(g);
    free(g->req);
    free(g->retired);
    free(g->h_tables);
    free(g->free_list);
    free(g->row_request);
    free(g);
}

/* The RoPE tables for positions 0 .. max_context - 1 (the trainer's only reach seq_length). */
static mt_status gen_rope_tables(mt_generator* g, mt_error* err) {
    const int half = g->s.rot / 2, n = g->gc.max_context * half;
    float* host = (float*)malloc(sizeof(float) * 2 * (size_t)n);
    if (!host) return mt_fail(err, MT_ERR_OOM, "cannot allocate the RoPE tables");
    rope_table_values(&g->t->cfg, g->s.rot, g->gc.max_context, host, host + n);
    CUDA_CHECK(&g->t->error, cudaMemcpy(g->rope_cos, host, sizeof(float) * 2 * (size_t)n, cudaMemcpyHostToDevice));
    g->rope_sin = g->rope_cos + n;
    free(host);
    return mt_gpu_error_return(&g->t->error, err);
}

mt_status mt_generator_create(mt_generator** out, mt_trainer* t, const mt_generator_config* gc, mt_error* err) {
    *out = NULL;
    if (!t || !gc) return mt_fail(err, MT_ERR_ARG, "mt_generator_create needs a trainer and a config");
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    const mt_config* c = &t->cfg;
    mt_status st = mt_generator_supported(c, err);
    if (st != MT_OK) return st;
    if (t->groups.pp_size != 1 || t->groups.tp.size != 1 || t->moe.enabled)
        return mt_fail(err, MT_ERR_CONFIG, "generation runs on one GPU holding the whole dense model");
    mt_generator_config r;
    st = mt_generator_config_check(gc, c, &r, err);
    if (st != MT_OK) return st;
    static_assert(GEN_MAX_QPG == MT_GEN_MAX_QPG, "the host check's bound is the kernel's");
    mt_generator* g = (mt_generator*)calloc(1, sizeof(mt_generator));
    if (!g) return mt_fail(err, MT_ERR_OOM, "cannot allocate the generator");
    g->t = t;
    g->gc = r;
    g->s = model_shape(t);
    g->qpg = g->s.heads / g->s.groups;
    g->V = (int)(c->vocab_size < c->padded_vocab_size ? c->vocab_size : c->padded_vocab_size);
    g->max_blocks = ceil_div(r.max_context, r.block_tokens);
    g->cap = r.max_step_tokens;
    g->logit_rows = r.max_batch > 256 ? r.max_batch : 256;
    if (g->logit_rows > g->cap) g->logit_rows = g->cap;
    g->max_splits = ceil_div(r.max_context, GEN_SPLIT_TOKENS);
    g->part_rows = r.max_batch > 64 ? r.max_batch : 64;
    if (g->part_rows > g->cap) g->part_rows = g->cap;
    const mt_shape& s = g->s;
    const size_t e = t->elem, cap = (size_t)g->cap;
    const size_t pool_bytes = (size_t)r.num_blocks * s.L * 2 * s.groups * r.block_tokens * s.d * e;
    const size_t sizes[] = {
        pool_bytes,                                                       /* pool */
        sizeof(int32_t) * (size_t)r.max_batch * g->max_blocks,            /* tables */
        cap * s.h * e, cap * s.h * e, cap * s.h * e,                       /* x, mid, ln */
        cap * s.qkv_width * e, s.qk_norm ? cap * s.qkv_width * e : 0,     /* qkv, qk_rows */
        cap * s.attn_width * e, cap * s.h * e, cap * s.f1 * e, cap * s.f * e, /* attn, branch, fc1, act */
        (size_t)g->logit_rows * s.h * e,                                  /* lnf_rows */
        cap * 4, cap * 4,                                                 /* mean, rstd */
        s.qk_norm ? 2 * cap * s.groups * (g->qpg + 1) * 4 : 0,             /* qk_stats */
        (size_t)g->part_rows * s.heads * g->max_splits * s.d * 4,          /* part_o */
        (size_t)g->part_rows * s.heads * g->max_splits * 4,                /* part_lse */
        s.rot ? 2 * (size_t)r.max_context * (s.rot / 2) * 4 : 0,          /* rope tables */
        (size_t)g->logit_rows * s.V_full * 4,                              /* logits */
        4 * cap * 4, cap * sizeof(gen_sample_params), cap * 4, cap * 4,   /* rows, params, out_token, out_logprob */
        (size_t)g->part_rows * s.groups * 4,                               /* attn_counters */
        (size_t)g->logit_rows * sample_stats_parts(g->V) * 8,              /* sample_part */
        (size_t)g->logit_rows * sample_stats_parts(g->V) * 4,              /* sample_part_i */
        (size_t)g->logit_rows * 4,                                         /* sample_counters */
        (size_t)g->logit_rows * 16};                                       /* sample_row */
    void** where[] = {&g->pool, (void**)&g->tables, &g->x, &g->mid, &g->ln, &g->qkv, &g->qk_rows, &g->attn, &g->branch,
                      &g->fc1, &g->act, &g->lnf_rows, (void**)&g->mean, (void**)&g->rstd, (void**)&g->qk_stats,
                      (void**)&g->part_o, (void**)&g->part_lse, (void**)&g->rope_cos, (void**)&g->logits,
                      (void**)&g->rows, (void**)&g->params, (void**)&g->out_token, (void**)&g->out_logprob,
                      (void**)&g->attn_counters, (void**)&g->sample_part, (void**)&g->sample_part_i,
                      (void**)&g->sample_counters, (void**)&g->sample_row};
    static_assert(sizeof(sizes) / sizeof(sizes[0]) == sizeof(where) / sizeof(where[0]), "one size per allocation");
    size_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += (sizes[i] + 255) / 256 * 256;
    g->device_bytes = total;
    size_t free_bytes = 0, total_bytes = 0;
    if (!CUDA_CHECK(&t->error, cudaMemGetInfo(&free_bytes, &total_bytes))) {
        mt_generator_free(g);
        return mt_gpu_error_return(&t->error, err);
    }
    if (total > free_bytes) {
        mt_generator_free(g);
        return mt_fail(err, MT_ERR_OOM, "the generator needs %.3f GB (KV cache %.3f GB: %lld blocks of %d tokens) but the "
                       "GPU has %.3f GB free: fewer blocks, a smaller max_batch or max_context", total / 1e9,
                       pool_bytes / 1e9, (long long)r.num_blocks, r.block_tokens, free_bytes / 1e9);
    }
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && t->error.status == MT_OK; i++)
        if (sizes[i]) *where[i] = device_alloc(t, sizes[i], NULL);
    if (t->error.status == MT_OK) { /* the counters start at zero (their kernels leave them so) */
        CUDA_CHECK(&t->error, cudaMemset(g->attn_counters, 0, (size_t)g->part_rows * s.groups * 4));
        CUDA_CHECK(&t->error, cudaMemset(g->sample_counters, 0, (size_t)g->logit_rows * 4));
    }
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&g->h_rows, 4 * cap * 4));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&g->h_params, cap * sizeof(gen_sample_params)));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&g->h_out_token, cap * 4));
    CUDA_CHECK(&t->error, cudaMallocHost((void**)&g->h_out_logprob, cap * 4));
    if (t->error.status != MT_OK) {
        st = mt_gpu_error_return(&t->error, err);
        t->error.status = MT_OK; /* the trainer itself is intact: only the generator's allocations failed */
        mt_generator_free(g);
        return st;
    }
    g->h_tables = (int32_t*)calloc((size_t)r.max_batch * g->max_blocks, sizeof(int32_t));
    g->free_list = (int32_t*)malloc(sizeof(int32_t) * (size_t)r.num_blocks);
    g->req = (gen_request*)calloc((size_t)r.max_batch, sizeof(gen_request));
    g->retired = (gen_retired*)calloc((size_t)r.max_batch, sizeof(gen_retired));
    g->row_request = (int*)malloc(sizeof(int) * cap);
    g->graphs = (cudaGraphExec_t*)calloc((size_t)r.max_batch + 1, sizeof(cudaGraphExec_t));
    const char* graphs = getenv("MT_GEN_GRAPHS");
    g->use_graphs = !(graphs && !strcmp(graphs, "0"));
    const char* gemv = getenv("MT_GEN_GEMV");
    g->use_gemv = !(gemv && !strcmp(gemv, "0"));
    const char* pdl = getenv("MT_GEN_PDL");
    g->use_pdl = !(pdl && !strcmp(pdl, "0"));
    int ok = g->h_tables && g->free_list && g->req && g->retired && g->row_request && g->graphs;
    for (int i = 0; ok && i < r.max_batch; i++) ok = (g->req[i].tokens = (int32_t*)malloc(4 * (size_t)r.max_context)) != NULL;
    if (!ok) {
        mt_generator_free(g);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the generator's host state");
    }
    for (int64_t b = 0; b < r.num_blocks; b++) g->free_list[b] = (int32_t)(r.num_blocks - 1 - b); /* block 0 first */
    g->num_free = r.num_blocks;
    g->tables_dirty = 1;
    if (s.rot) {
        st = gen_rope_tables(g, err);
        if (st != MT_OK) {
            mt_generator_free(g);
            return st;
        }
    }
    wait_for_all_parameters(t); /* a data-parallel trainer's last parameter gather, if one is in flight */
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    if (t->error.status != MT_OK) {
        st = mt_gpu_error_return(&t->error, err);
        mt_generator_free(g);
        return st;
    }
    *out = g;
    return MT_OK;
}

int mt_generator_running(const mt_generator* g) {
    int n = 0;
    for (int i = 0; i < g->gc.max_batch; i++) n += g->req[i].active;
    return n;
}

int64_t mt_generator_free_blocks(const mt_generator* g) { return g->num_free; }

mt_status mt_generator_add(mt_generator* g, const int32_t* prompt, int prompt_len, const mt_sampling* s, int64_t* id,
                           mt_error* err) {
    mt_status st = mt_generator_request_check(prompt, prompt_len, s, g->gc.max_context, g->V, err);
    if (st != MT_OK) return st;
    int slot = -1;
    for (int i = 0; i < g->gc.max_batch && slot < 0; i++)
        if (!g->req[i].active) slot = i;
    if (slot < 0)
        return mt_fail(err, MT_ERR_RANGE, "the generator runs %d requests already (max_batch): retry after a step",
                       g->gc.max_batch);
    const int64_t need = mt_generator_request_blocks(prompt_len, s->max_new_tokens, g->gc.max_context, g->gc.block_tokens);
    if (need > g->num_free)
        return mt_fail(err, MT_ERR_RANGE, "the KV cache has %lld free blocks, the request needs %lld: retry after a step",
                       (long long)g->num_free, (long long)need);
    float* lp = NULL;
    if (s->prompt_logprobs && prompt_len > 1 && !(lp = (float*)malloc(sizeof(float) * (size_t)(prompt_len - 1))))
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the prompt's log-probabilities");
    gen_request* r = &g->req[slot];
    int32_t* tokens = r->tokens;
    memset(r, 0, sizeof(*r));
    r->tokens = tokens;
    r->active = 1;
    r->id = g->next_id++;
    memcpy(r->tokens, prompt, sizeof(int32_t) * (size_t)prompt_len);
    r->prompt_len = r->len = prompt_len;
    r->s = *s;
    memcpy(r->stop, s->stop_tokens ? s->stop_tokens : r->stop, sizeof(int32_t) * (size_t)s->num_stop_tokens);
    r->s.stop_tokens = r->stop;
    r->prompt_logprobs = lp;
    r->num_blocks = need;
    for (int64_t b = 0; b < need; b++) g->h_tables[(int64_t)slot * g->max_blocks + b] = g->free_list[--g->num_free];
    g->tables_dirty = 1;
    *id = r->id;
    return MT_OK;
}

static int gen_slot_of(const mt_generator* g, int64_t id) {
    for (int i = 0; i < g->gc.max_batch; i++)
        if (g->req[i].active && g->req[i].id == id) return i;
    return -1;
}

mt_status mt_generator_cancel(mt_generator* g, int64_t id, mt_error* err) {
    const int slot = gen_slot_of(g, id);
    if (slot < 0) return mt_fail(err, MT_ERR_ARG, "no running request %lld", (long long)id);
    gen_finish(g, slot, 0);
    return MT_OK;
}

mt_status mt_generator_prompt_logprobs(mt_generator* g, int64_t id, float* out, mt_error* err) {
    const int slot = gen_slot_of(g, id);
    const float* values = NULL;
    int count = 0;
    if (slot >= 0 && g->req[slot].prefilled && g->req[slot].prompt_logprobs)
        values = g->req[slot].prompt_logprobs, count = g->req[slot].prompt_len - 1;
    for (int i = 0; !values && i < g->num_retired; i++)
        if (g->retired[i].id == id) values = g->retired[i].values, count = g->retired[i].count;
    if (slot >= 0 && g->req[slot].prompt_len == 1 && g->req[slot].s.prompt_logprobs && g->req[slot].prefilled)
        return MT_OK; /* a one-token prompt has none */
    if (!values)
        return mt_fail(err, MT_ERR_ARG, "request %lld: no prompt log-probabilities (unknown, not asked for, or not "
                       "prefilled yet)", (long long)id);
    memcpy(out, values, sizeof(float) * (size_t)count);
    return MT_OK;
}

/* One linear of the step: out [n, cols] = epilogue(in [n, K] W^T + bias) (epi: GEMV_PLAIN, GEMV_GELU,
 * GEMV_SQUARED_RELU, GEMV_SWIGLU; W [cols, K], for SwiGLU [2 cols, K]; bias may be NULL). Up to
 * GEN_GEMV_ENGINE_ROWS rows through gemv_rows (the epilogue fused); more rows (a prefill, a larger batch), or
 * operands gemv_rows does not take, through cuBLAS into pre ([n, cols] or for SwiGLU [n, 2 cols]; out itself
 * for GEMV_PLAIN) and the forward's elementwise kernel. */
template <typename T>
static void gen_linear(const mt_generator* g, const mt_exec* ex, int epi, T* out, T* pre, const T* in, int K, const T* W,
                       const T* bias, int n, int cols) {
    if (g->use_gemv && n <= GEN_GEMV_ENGINE_ROWS && gemv_rows_supported<T>(n, K, in, K, W)) {
        gemv_rows<T>(ex, epi, out, cols, in, K, W, bias, n, cols, K, g->use_pdl);
        return;
    }
    const int width = epi == GEMV_SWIGLU ? 2 * cols : cols;
    T* y = epi == GEMV_PLAIN ? out : pre;
    gemm_uncached<T, T>(ex, false, true, n, width, K, in, K, W, K, y, width, 1.0f, 0.0f);
    if (epi == GEMV_PLAIN && bias) bias_add<T>(ex, out, bias, n, cols);
    else if (epi == GEMV_SWIGLU) bias_swiglu<T>(ex, pre, out, bias, n, cols);
    else if (epi != GEMV_PLAIN) bias_activation<T>(ex, epi == GEMV_GELU ? ACT_GELU : ACT_SQUARED_RELU, pre, out, bias, n, cols);
}

/* One pass of n rows (g->h_rows uploaded: tokens, positions, slots, then n_sel gathered rows) through the
 * model; the fp32 logits of the gathered rows in chunks of logit_rows, each sampled or scored right away
 * (params on the device): out_token / out_logprob [n_sel]. decode_only: one row per request, the rows
 * gathered being 0 .. n-1 in order (a decode step): no row reads another's keys, so the attention stores
 * each row's own k/v (no kv_cache_store), and the final norm's rows are the logits' rows (no gather). */
template <typename T>
static void gen_forward(mt_generator* g, int n, int n_sel, bool decode_only) {
    mt_trainer* t = g->t;
    const mt_exec ex = trainer_exec(t);
    mt_shape s = g->s;
    s.B = 1, s.S = n, s.BT = n, s.R = n;
    const float eps = (float)t->cfg.norm_epsilon;
    const int32_t* tokens = g->rows;
    const int32_t* positions = g->rows + g->cap;
    const int32_t* slots = g->rows + 2 * g->cap;
    const int32_t* gathered = g->rows + 3 * g->cap;
    T *x = (T*)g->x, *mid = (T*)g->mid, *ln = (T*)g->ln, *qkv = (T*)g->qkv, *attn = (T*)g->attn, *branch = (T*)g->branch;
    const mt_attention_dims dims = {1, n, s.heads, s.groups, s.d, s.rot, g->rope_cos, g->rope_sin, positions, NULL};
    const T* wpe = t->cfg.position_embedding_type == MT_POSITION_LEARNED ? param_ptr<T>(t, MT_P_POSITION_EMBEDDINGS) : NULL;
    embedding_forward<T>(&ex, x, tokens, param_ptr<T>(t, MT_P_WORD_EMBEDDINGS), wpe, n, n, s.h, 0, s.V, positions);
    const layer_tensors<T> p0 = layer_params<T>(t, 0);
    const bool pdl = g->use_pdl;
    norm_rows<T>(&ex, NULL, ln, g->mean, g->rstd, NULL, x, NULL, p0.ln1_w, p0.ln1_b, n, s.h, eps, s.rms, s.norm_w1, pdl);
    const int epi = s.swiglu ? GEMV_SWIGLU : s.act == ACT_SQUARED_RELU ? GEMV_SQUARED_RELU : GEMV_GELU;
    for (int l = 0; l < s.L; l++) {
        const layer_tensors<T> p = layer_params<T>(t, l);
        /* RoPE in the QKV GEMV's epilogue where it takes the step (no --qk-layernorm between them) */
        const gen_gemv_rope rope = {g->rope_cos, g->rope_sin, positions, s.d, s.rot, g->qpg};
        const bool fused_rope = s.rot > 0 && !s.qk_norm && g->use_gemv && n <= GEN_GEMV_ENGINE_ROWS &&
                                gemv_rows_supported<T>(n, s.h, ln, s.h, p.qkv_w) &&
                                gemv_rope_supported(s.d, s.rot, g->qpg, s.qkv_width);
        if (fused_rope)
            gemv_rows<T>(&ex, GEMV_ROPE, qkv, s.qkv_width, ln, s.h, p.qkv_w, p.qkv_b, n, s.qkv_width, s.h, pdl, &rope);
        else
            gen_linear<T>(g, &ex, GEMV_PLAIN, qkv, NULL, ln, s.h, p.qkv_w, p.qkv_b, n, s.qkv_width);
        T* rows = qkv;
        if (s.qk_norm) {
            qk_norm_forward<T>(&ex, dims, (T*)g->qk_rows, g->qk_stats, qkv, p.q_ln_w, p.q_ln_b, p.k_ln_w, p.k_ln_b, eps,
                               s.rms, s.norm_w1);
            rows = (T*)g->qk_rows;
        }
        if (!fused_rope) rope_qkv_rows<T>(&ex, dims, rows, false); /* at each row's position (dims.positions) */
        if (!decode_only)
            kv_cache_store<T>(&ex, (T*)g->pool, rows, slots, positions, g->tables, g->max_blocks, n, s.groups, g->qpg, s.d,
                              l, s.L, g->gc.block_tokens);
        for (int r0 = 0; r0 < n; r0 += g->part_rows) {
            const int m = n - r0 < g->part_rows ? n - r0 : g->part_rows;
            decode_attention<T>(&ex, attn + (int64_t)r0 * s.attn_width, g->part_o, g->part_lse, g->attn_counters,
                                rows + (int64_t)r0 * s.qkv_width, (T*)g->pool, decode_only, pdl, slots + r0, positions + r0,
                                g->tables, g->max_blocks, m, s.groups, g->qpg, s.d, l, s.L, g->gc.block_tokens,
                                g->max_splits);
        }
        gen_linear<T>(g, &ex, GEMV_PLAIN, branch, NULL, attn, s.attn_width, p.proj_w, NULL, n, s.h);
        norm_rows<T>(&ex, mid, ln, g->mean, g->rstd, x, branch, p.proj_b, p.ln2_w, p.ln2_b, n, s.h, eps, s.rms, s.norm_w1,
                     pdl);
        gen_linear<T>(g, &ex, epi, (T*)g->act, (T*)g->fc1, ln, s.h, p.fc1_w, p.fc1_b, n, s.f);
        gen_linear<T>(g, &ex, GEMV_PLAIN, branch, NULL, (T*)g->act, s.f, p.fc2_w, NULL, n, s.h);
        const bool last = l == s.L - 1;
        const layer_tensors<T> np = layer_params<T>(t, last ? l : l + 1);
        norm_rows<T>(&ex, x, ln, g->mean, g->rstd, mid, branch, p.fc2_b, last ? param_ptr<T>(t, MT_P_FINAL_LN_WEIGHT) : np.ln1_w,
                     last ? param_ptr<T>(t, MT_P_FINAL_LN_BIAS) : np.ln1_b, n, s.h, eps, s.rms, s.norm_w1, pdl);
    }
    /* ln holds the final norm of every row: the gathered rows' logits, chunk by chunk, sampled or scored */
    for (int k0 = 0; k0 < n_sel; k0 += g->logit_rows) {
        const int m = n_sel - k0 < g->logit_rows ? n_sel - k0 : g->logit_rows;
        const T* rows = ln + (int64_t)k0 * s.h; /* a decode step's rows are gathered already */
        if (!decode_only) {
            gather_rows<T>(&ex, (T*)g->lnf_rows, ln, gathered + k0, m, s.h);
            rows = (const T*)g->lnf_rows;
        }
        gemm_uncached<T, float>(&ex, false, true, m, (int)s.V_full, s.h, rows, s.h, output_weight<T>(t), s.h, g->logits,
                                (int)s.V_full, 1.0f, 0.0f);
        sample_rows(&ex, g->out_token + k0, g->out_logprob + k0, g->sample_row, g->sample_part, g->sample_part_i,
                    g->sample_counters, g->logits, s.V_full, g->V, g->params + k0, m);
    }
}

template <typename T>
static void gen_forward_eager_or_graph(mt_generator* g, int n, int n_sel, bool decode_only) {
    mt_trainer* t = g->t;
    if (!decode_only || !g->use_graphs || n > g->gc.max_batch || n_sel != n) {
        gen_forward<T>(g, n, n_sel, decode_only && n_sel == n);
        return;
    }
    if (!g->graphs[n]) { /* capture this row count's step once */
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        cudaError_t e = cudaStreamBeginCapture(t->stream, cudaStreamCaptureModeThreadLocal);
        if (e == cudaSuccess) {
            gen_forward<T>(g, n, n_sel, true);
            e = cudaStreamEndCapture(t->stream, &graph);
        }
        if (e == cudaSuccess && t->error.status == MT_OK) e = cudaGraphInstantiate(&exec, graph, 0);
        if (graph) cudaGraphDestroy(graph);
        if (e != cudaSuccess || t->error.status != MT_OK) { /* no graphs here: eager launches from now on */
            cudaGetLastError();
            if (exec) cudaGraphExecDestroy(exec);
            t->error.status = MT_OK; /* the capture's failure only: nothing ran */
            g->use_graphs = 0;
            gen_forward<T>(g, n, n_sel, true);
            return;
        }
        g->graphs[n] = exec;
    }
    CUDA_CHECK(&t->error, cudaGraphLaunch(g->graphs[n], t->stream));
}

static int gen_is_stop(const gen_request* r, int32_t token) {
    for (int i = 0; i < r->s.num_stop_tokens; i++)
        if (r->stop[i] == token) return 1;
    return 0;
}

mt_status mt_generator_step(mt_generator* g, mt_generated* out, int max_out, int* n_out, mt_error* err) {
    mt_trainer* t = g->t;
    *n_out = 0;
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    const int running = mt_generator_running(g);
    if (max_out < running)
        return mt_fail(err, MT_ERR_ARG, "mt_generator_step: room for %d results, %d requests are running", max_out, running);
    gen_forget_retired(g);
    if (running == 0) return MT_OK;
    const int cap = g->cap, B = g->gc.max_batch;
    int32_t *tok = g->h_rows, *pos = g->h_rows + cap, *slot = g->h_rows + 2 * cap, *sel = g->h_rows + 3 * cap;
    int n = 0, n_sel = 0;
    /* the decoding rows: each running request's last token at its position */
    int in_step[MT_GEN_MAX_BATCH];
    int count = 0;
    for (int i = 0; i < B; i++) {
        gen_request* r = &g->req[i];
        if (!r->active || !r->prefilled) continue;
        tok[n] = r->tokens[r->len - 1], pos[n] = r->len - 1, slot[n] = i;
        gen_sample_params* P = &g->h_params[n_sel];
        *P = gen_sample_params{r->s.temperature, r->s.top_k, r->s.top_p, -1, r->s.seed, (int64_t)r->generated};
        g->row_request[n_sel] = i;
        sel[n_sel++] = n++;
        in_step[count++] = i;
    }
    const int decode_rows = n;
    /* the prompts, in the order they were added, while they fit */
    for (;;) {
        int next = -1;
        for (int i = 0; i < B; i++)
            if (g->req[i].active && !g->req[i].prefilled && (next < 0 || g->req[i].id < g->req[next].id)) next = i;
        if (next < 0 || n + g->req[next].prompt_len > cap) break;
        gen_request* r = &g->req[next];
        for (int k = 0; k < r->prompt_len; k++) {
            tok[n + k] = r->tokens[k], pos[n + k] = k, slot[n + k] = next;
            const int scored = r->s.prompt_logprobs && k < r->prompt_len - 1;
            const int sampled = k == r->prompt_len - 1 && r->s.max_new_tokens > 0;
            if (scored || sampled) {
                g->h_params[n_sel] = gen_sample_params{r->s.temperature, r->s.top_k, r->s.top_p,
                                                       scored ? r->tokens[k + 1] : -1, r->s.seed, 0};
                g->row_request[n_sel] = next;
                sel[n_sel++] = n + k;
            }
        }
        n += r->prompt_len;
        r->prefilled = 1; /* marks it as taken by this step (and makes the loop move on) */
        in_step[count++] = next;
    }
    /* one copy up: the rows (tokens, positions, slots, gathered), the draws' settings, the tables if they changed */
    CUDA_CHECK(&t->error, cudaMemcpyAsync(g->rows, g->h_rows, sizeof(int32_t) * 4 * (size_t)cap, cudaMemcpyHostToDevice,
                                          t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(g->params, g->h_params, sizeof(gen_sample_params) * (size_t)n_sel,
                                          cudaMemcpyHostToDevice, t->stream));
    if (g->tables_dirty) {
        CUDA_CHECK(&t->error, cudaMemcpyAsync(g->tables, g->h_tables, sizeof(int32_t) * (size_t)B * g->max_blocks,
                                              cudaMemcpyHostToDevice, t->stream));
        g->tables_dirty = 0;
    }
    const bool decode_only = n > 0 && decode_rows == n; /* no prompt in this step: a graph's shape */
    switch (t->cfg.precision) {
        case MT_FP32: gen_forward_eager_or_graph<float>(g, n, n_sel, decode_only); break;
        case MT_BF16: gen_forward_eager_or_graph<__nv_bfloat16>(g, n, n_sel, decode_only); break;
        case MT_FP16: gen_forward_eager_or_graph<__half>(g, n, n_sel, decode_only); break;
    }
    CUDA_CHECK(&t->error, cudaMemcpyAsync(g->h_out_token, g->out_token, sizeof(int32_t) * (size_t)n_sel,
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaMemcpyAsync(g->h_out_logprob, g->out_logprob, sizeof(float) * (size_t)n_sel,
                                          cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(&t->error, cudaStreamSynchronize(t->stream));
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    /* the results, per request of the step (its logits rows are consecutive, in the step's order): the prompt's
     * log-probabilities, then the new token */
    int k = 0;
    for (int c = 0; c < count; c++) {
        const int i = in_step[c];
        gen_request* r = &g->req[i];
        mt_generated* o = &out[(*n_out)++];
        o->id = r->id, o->token = -1, o->logprob = 0.0f, o->finished = 0;
        int scored = 0, sampled = 0;
        for (; k < n_sel && g->row_request[k] == i; k++) {
            if (g->h_params[k].target >= 0) {
                r->prompt_logprobs[scored++] = g->h_out_logprob[k];
            } else {
                o->token = g->h_out_token[k], o->logprob = g->h_out_logprob[k];
                sampled = 1;
            }
        }
        if (sampled) {
            r->tokens[r->len++] = o->token;
            r->generated++;
        }
        o->finished = !sampled || gen_is_stop(r, o->token) || r->generated >= r->s.max_new_tokens ||
                      r->len >= g->gc.max_context;
        if (o->finished) gen_finish(g, i, 1);
    }
    return MT_OK;
}

mt_status mt_device_copy_bandwidth(double* bytes_per_second, mt_error* err) {
    const size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    mt_gpu_error e;
    memset(&e, 0, sizeof(e));
    (void)(CUDA_CHECK(&e, cudaMalloc(&a, bytes)) && CUDA_CHECK(&e, cudaMalloc(&b, bytes)) &&
           CUDA_CHECK(&e, cudaEventCreate(&start)) && CUDA_CHECK(&e, cudaEventCreate(&stop)) &&
           CUDA_CHECK(&e, cudaMemset(a, 1, bytes)) && CUDA_CHECK(&e, cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice)));
    float best = 0.0f;
    for (int i = 0; i < 5 && e.status == MT_OK; i++) {
        float ms = 0.0f;
        (void)(CUDA_CHECK(&e, cudaEventRecord(start)) &&
               CUDA_CHECK(&e, cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice)) && CUDA_CHECK(&e, cudaEventRecord(stop)) &&
               CUDA_CHECK(&e, cudaEventSynchronize(stop)) && CUDA_CHECK(&e, cudaEventElapsedTime(&ms, start, stop)));
        if (e.status == MT_OK && (best == 0.0f || ms < best)) best = ms;
    }
    cudaFree(a), cudaFree(b);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (e.status == MT_OK && best > 0.0f) *bytes_per_second = 2.0 * (double)bytes / (best * 1e-3);
    return mt_gpu_error_return(&e, err);
}

/* Copies of W cycled so that a launch never finds its weights in L2 (mt_decode_gemv_benchmark). */
#define GEN_BENCH_BYTES ((size_t)256 << 20)

mt_status mt_decode_gemv_benchmark(mt_trainer* t, int n, int M, int K, double* gemv_s, double* cublas_s, mt_error* err) {
    if (n < 1 || n > 64 || M < 1 || M > 65536 || K < 8 || K > 65536 || K % 8)
        return mt_fail(err, MT_ERR_ARG, "mt_decode_gemv_benchmark: n %d (1 .. 64), M %d, K %d (1 .. 65536, K a multiple "
                       "of 8)", n, M, K);
    if (t->error.status != MT_OK) return mt_gpu_error_return(&t->error, err);
    typedef __nv_bfloat16 T;
    const size_t wbytes = (size_t)M * K * sizeof(T);
    const int copies = (int)((GEN_BENCH_BYTES + wbytes - 1) / wbytes);
    T *w = NULL, *x = NULL, *y = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    const mt_exec ex = trainer_exec(t);
    mt_gpu_error* e = &t->error;
    (void)(CUDA_CHECK(e, cudaMalloc(&w, wbytes * copies)) && CUDA_CHECK(e, cudaMalloc(&x, (size_t)n * K * sizeof(T))) &&
           CUDA_CHECK(e, cudaMalloc(&y, (size_t)n * M * sizeof(T))) && CUDA_CHECK(e, cudaEventCreate(&start)) &&
           CUDA_CHECK(e, cudaEventCreate(&stop)));
    if (e->status == MT_OK) { /* small values of both signs, no NaN: bf16 0x3c3c, 0xbc3c (+-0.0115) */
        CUDA_CHECK(e, cudaMemset(w, 0x3c, wbytes * copies));
        CUDA_CHECK(e, cudaMemset(x, 0xbc, (size_t)n * K * sizeof(T)));
    }
    for (int which = 0; which < 2 && e->status == MT_OK; which++) {
        float ms[21];
        int at = 0;
        for (int rep = -1; rep < 21 && e->status == MT_OK; rep++) {
            if (rep >= 0) CUDA_CHECK(e, cudaEventRecord(start, t->stream));
            for (int i = 0; i < (rep < 0 ? 5 : 10); i++) {
                const T* wi = w + (size_t)(at++ % copies) * M * K;
                if (which == 0)
                    for (int r0 = 0; r0 < n; r0 += GEN_GEMV_MAX_ROWS)
                        gemv_rows<T>(&ex, GEMV_PLAIN, y + (size_t)r0 * M, M, x + (size_t)r0 * K, K, wi, NULL,
                                     n - r0 < GEN_GEMV_MAX_ROWS ? n - r0 : GEN_GEMV_MAX_ROWS, M, K);
                else
                    gemm_uncached<T, T>(&ex, false, true, n, M, K, x, K, wi, K, y, M, 1.0f, 0.0f);
            }
            if (rep >= 0 && CUDA_CHECK(e, cudaEventRecord(stop, t->stream)) && CUDA_CHECK(e, cudaEventSynchronize(stop)))
                CUDA_CHECK(e, cudaEventElapsedTime(&ms[rep], start, stop));
        }
        if (e->status != MT_OK) break;
        for (int i = 1; i < 21; i++) /* sorted: the median at 10 */
            for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
                const float s = ms[j];
                ms[j] = ms[j - 1], ms[j - 1] = s;
            }
        *(which == 0 ? gemv_s : cublas_s) = ms[10] * 1e-3 / 10;
    }
    cudaStreamSynchronize(t->stream);
    cudaFree(w), cudaFree(x), cudaFree(y);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    return mt_gpu_error_return(&t->error, err);
}
