// dev/cuda/grouped_gemm_probe.cu — the experts' GEMMs of a MoE layer (issue #34) by each way megatron.cu can run
// them (section 17, moe_experts_gemm), at Qwen3-30B-A3B's and Mixtral 8x7B's expert shapes, against one dense
// GEMM of the same FLOPs (the issue's goal: the experts' GEMMs at >= 75% of it).
//   nvcc -O2 -std=c++17 -arch=sm_90 dev/cuda/grouped_gemm_probe.cu -lcublas -o /tmp/probe && /tmp/probe
// Per layer shape (E experts, R rows in all, the linear in -> out), with balanced rows (R / E each) and uneven rows
// (a shuffled ramp from 0 to twice the mean: max / mean ~2, the first experts of the ramp with no rows), for
//   fwd:   y_e [n_e, out] = x_e [n_e, in] W_e [out, in]^T, bf16 in and out (the forward; the input gradients'
//          shapes are the same kind with in and out swapped)
//   wgrad: dW_e [out, in] += dy_e [n_e, out]^T x_e [n_e, in], bf16 in, fp32 out with beta 1 (the weight gradients)
// it times (mean of 10 after 2 warm-ups, events on the compute stream around the whole call):
//   grouped   cublasGemmGroupedBatchedEx over the experts with rows (its status where cuBLAS refuses the types)
//   loop      one cublasGemmStridedBatchedEx (batch 1) per expert on the compute stream: megatron.cu's gemm_uncached
//   streams S the loop's calls spread over S side streams (S = 2, 4, 8), each with its own handle and 32 MiB
//             workspace, each GEMM to the stream with the least work so far, forked from and joined to the compute
//             stream by events: megatron.cu's MOE_PATH_STREAMS (it builds MT_MOE_GEMM_STREAMS = 4 of them)
//   threads 4 streams 4 with each side stream's GEMMs queued by its own host thread (not in megatron.cu)
//   dense     one GEMM of the same FLOPs: [R, in] x [in, out] (fwd), [out, R] x [R, in] (wgrad)
// and prints each one's ms, TFLOP/s, its share of dense, and the host's issue time per GEMM (the CPU time of
// queueing the calls; streams cannot beat the issue rate). Streams S = 4 are checked bit for bit against the loop
// (uneven rows). The last column names the fastest path of the row.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", cudaGetErrorString(e_), __LINE__, #x); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS %s at %d: %s\n", cublasGetStatusName(s_), __LINE__, #x); exit(1); } } while (0)

static const int MAX_S = 8;
static const size_t WORKSPACE = (size_t)32 << 20; // megatron.h MT_CUBLAS_WORKSPACE_BYTES

__global__ void fill_kernel(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = __float2bfloat16((float)(h & 0xFFFF) / 32768.0f - 1.0f + 1e-3f);
    }
}

struct Ctx {
    cudaStream_t main;
    cublasHandle_t h_main;
    cudaStream_t side[MAX_S];
    cublasHandle_t h_side[MAX_S];
    void* ws[MAX_S + 1];
    cudaEvent_t fork, joined[MAX_S], t0, t1;
    void** dtab;         // device pointer table of the grouped call
    void** htab;         // pinned staging
};

// megatron.cu gemm_handle_create: stream, default math, own workspace
static void handle_create(cublasHandle_t* h, cudaStream_t s, void* ws) {
    CB(cublasCreate(h));
    CB(cublasSetStream(*h, s));
    CB(cublasSetMathMode(*h, CUBLAS_DEFAULT_MATH));
    CB(cublasSetWorkspace(*h, ws, WORKSPACE));
}

// One experts' GEMM family: per expert e with n_e rows at offset o_e.
struct Family {
    const char* name;
    bool wgrad;  // else fwd
    int E, in, out;
    const int* n; const int* off;
    __nv_bfloat16 *x, *W, *dy, *y;  // x [R, in], W [E, out, in], dy [R, out], y [R, out]
    float* dW;                      // [E, out, in]
};

// megatron.cu gemm_uncached for expert e (row-major C = op(A) op(B) as cuBLAS's C^T = op(B)^T op(A)^T)
static cublasStatus_t one_gemm(cublasHandle_t h, cudaStream_t s, const Family& f, int e) {
    const float one = 1.0f, zero = 0.0f;
    CB(cublasSetStream(h, s));
    const int n = f.n[e];
    if (!f.wgrad) // y_e [n, out] = x_e [n, in] W_e^T: M n, N out, K in, transB
        return cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, f.out, n, f.in, &one,
                                          f.W + (size_t)e * f.out * f.in, CUDA_R_16BF, f.in, 0,
                                          f.x + (size_t)f.off[e] * f.in, CUDA_R_16BF, f.in, 0, &zero,
                                          f.y + (size_t)f.off[e] * f.out, CUDA_R_16BF, f.out, 0, 1, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT);
    // dW_e [out, in] += dy_e^T [out, n] x_e [n, in]: M out, N in, K n, transA
    return cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, f.in, f.out, n, &one,
                                      f.x + (size_t)f.off[e] * f.in, CUDA_R_16BF, f.in, 0,
                                      f.dy + (size_t)f.off[e] * f.out, CUDA_R_16BF, f.out, 0, &one,
                                      f.dW + (size_t)e * f.out * f.in, CUDA_R_32F, f.in, 0, 1, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT);
}

static void run_loop(Ctx& c, const Family& f) {
    for (int e = 0; e < f.E; e++)
        if (f.n[e] > 0) CB(one_gemm(c.h_main, c.main, f, e));
}

static void run_streams(Ctx& c, const Family& f, int S) {
    double load[MAX_S] = {0};
    CK(cudaEventRecord(c.fork, c.main));
    for (int s = 0; s < S; s++) CK(cudaStreamWaitEvent(c.side[s], c.fork, 0));
    for (int e = 0; e < f.E; e++) {
        if (f.n[e] == 0) continue;
        int best = 0;
        for (int s = 1; s < S; s++)
            if (load[s] < load[best]) best = s;
        load[best] += (double)f.n[e];
        CB(one_gemm(c.h_side[best], c.side[best], f, e));
    }
    for (int s = 0; s < S; s++) {
        CK(cudaEventRecord(c.joined[s], c.side[s]));
        CK(cudaStreamWaitEvent(c.main, c.joined[s], 0));
    }
}

// Not in megatron.cu (yet): streams 4 with each side stream's GEMMs queued by its own host thread (a persistent pool;
// the calling thread forks, wakes the workers, waits for them, joins), to see how much of streams' time is the
// single thread's issue rate.
struct Pool {
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable go, done;
    int generation = 0, finished = 0, S = 0;
    bool quit = false;
    Ctx* c = nullptr;
    const Family* f = nullptr;
    std::vector<int> owner; // expert -> side stream
    void work(int s) {
        int seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> l(mu);
                go.wait(l, [&] { return quit || generation != seen; });
                if (quit) return;
                seen = generation;
            }
            for (int e = 0; e < f->E; e++)
                if (f->n[e] > 0 && owner[e] == s) CB(one_gemm(c->h_side[s], c->side[s], *f, e));
            std::lock_guard<std::mutex> l(mu);
            if (++finished == S) done.notify_one();
        }
    }
    void start(Ctx* ctx, int streams) {
        c = ctx, S = streams;
        for (int s = 0; s < S; s++) threads.emplace_back([this, s] { work(s); });
    }
    void run(const Family& fam) {
        double load[MAX_S] = {0};
        owner.assign(fam.E, -1);
        for (int e = 0; e < fam.E; e++) {
            if (fam.n[e] == 0) continue;
            int best = 0;
            for (int s = 1; s < S; s++)
                if (load[s] < load[best]) best = s;
            load[best] += (double)fam.n[e], owner[e] = best;
        }
        CK(cudaEventRecord(c->fork, c->main));
        for (int s = 0; s < S; s++) CK(cudaStreamWaitEvent(c->side[s], c->fork, 0));
        {
            std::lock_guard<std::mutex> l(mu);
            f = &fam, finished = 0, generation++;
        }
        go.notify_all();
        {
            std::unique_lock<std::mutex> l(mu);
            done.wait(l, [&] { return finished == S; });
        }
        for (int s = 0; s < S; s++) {
            CK(cudaEventRecord(c->joined[s], c->side[s]));
            CK(cudaStreamWaitEvent(c->main, c->joined[s], 0));
        }
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> l(mu);
            quit = true;
        }
        go.notify_all();
        for (auto& t : threads) t.join();
    }
};

// megatron.cu gemm_grouped: the experts with rows in one call (fwd only: cuBLAS refuses bf16 x bf16 -> fp32)
static cublasStatus_t run_grouped(Ctx& c, const Family& f) {
    std::vector<cublasOperation_t> ta, tb;
    std::vector<int> M, N, K, lda, ldb, ldc, gs;
    std::vector<float> al, be;
    int G = 0;
    for (int e = 0; e < f.E; e++) {
        if (f.n[e] == 0) continue;
        if (!f.wgrad) {
            ta.push_back(CUBLAS_OP_T), tb.push_back(CUBLAS_OP_N), M.push_back(f.out), N.push_back(f.n[e]);
            K.push_back(f.in), lda.push_back(f.in), ldb.push_back(f.in), ldc.push_back(f.out), be.push_back(0.0f);
            c.htab[G] = f.W + (size_t)e * f.out * f.in, c.htab[f.E + G] = f.x + (size_t)f.off[e] * f.in;
            c.htab[2 * f.E + G] = f.y + (size_t)f.off[e] * f.out;
        } else {
            ta.push_back(CUBLAS_OP_N), tb.push_back(CUBLAS_OP_T), M.push_back(f.in), N.push_back(f.out);
            K.push_back(f.n[e]), lda.push_back(f.in), ldb.push_back(f.out), ldc.push_back(f.in), be.push_back(1.0f);
            c.htab[G] = f.x + (size_t)f.off[e] * f.in, c.htab[f.E + G] = f.dy + (size_t)f.off[e] * f.out;
            c.htab[2 * f.E + G] = f.dW + (size_t)e * f.out * f.in;
        }
        al.push_back(1.0f), gs.push_back(1);
        G++;
    }
    // the table as one block [3, G] (B, A, C), as gemm_grouped stages it
    std::vector<void*> t(3 * (size_t)G);
    for (int g = 0; g < G; g++) t[g] = c.htab[g], t[G + g] = c.htab[f.E + g], t[2 * G + g] = c.htab[2 * f.E + g];
    memcpy(c.htab, t.data(), sizeof(void*) * 3 * G);
    CK(cudaMemcpyAsync(c.dtab, c.htab, sizeof(void*) * 3 * G, cudaMemcpyHostToDevice, c.main));
    CB(cublasSetStream(c.h_main, c.main));
    cublasStatus_t st = cublasGemmGroupedBatchedEx(
        c.h_main, ta.data(), tb.data(), M.data(), N.data(), K.data(), al.data(), (const void* const*)c.dtab,
        CUDA_R_16BF, lda.data(), (const void* const*)(c.dtab + G), CUDA_R_16BF, ldb.data(), be.data(),
        (void* const*)(c.dtab + 2 * G), f.wgrad ? CUDA_R_32F : CUDA_R_16BF, ldc.data(), G, gs.data(), CUBLAS_COMPUTE_32F);
    return st; // the next call rewrites the staging with the same pointers while this copy may be pending: benign

}

// one GEMM of the same FLOPs
static void run_dense(Ctx& c, const Family& f, int R) {
    const float one = 1.0f, zero = 0.0f;
    CB(cublasSetStream(c.h_main, c.main));
    if (!f.wgrad)
        CB(cublasGemmStridedBatchedEx(c.h_main, CUBLAS_OP_T, CUBLAS_OP_N, f.out, R, f.in, &one, f.W, CUDA_R_16BF, f.in, 0,
                                      f.x, CUDA_R_16BF, f.in, 0, &zero, f.y, CUDA_R_16BF, f.out, 0, 1,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
        CB(cublasGemmStridedBatchedEx(c.h_main, CUBLAS_OP_N, CUBLAS_OP_T, f.in, f.out, R, &one, f.x, CUDA_R_16BF, f.in, 0,
                                      f.dy, CUDA_R_16BF, f.out, 0, &one, f.dW, CUDA_R_32F, f.in, 0, 1,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct Timing { float ms; double host_us; };
template <typename Fn>
static Timing time_it(Ctx& c, Fn fn) {
    for (int i = 0; i < 2; i++) fn();
    CK(cudaStreamSynchronize(c.main));
    const int iters = 10;
    double host = 0;
    CK(cudaEventRecord(c.t0, c.main));
    for (int i = 0; i < iters; i++) {
        auto a = std::chrono::steady_clock::now();
        fn();
        host += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
    }
    CK(cudaEventRecord(c.t1, c.main));
    CK(cudaEventSynchronize(c.t1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, c.t0, c.t1));
    return {ms / iters, host / iters};
}

int main() {
    Ctx c;
    CK(cudaStreamCreateWithFlags(&c.main, cudaStreamNonBlocking));
    for (int s = 0; s <= MAX_S; s++) CK(cudaMalloc(&c.ws[s], WORKSPACE));
    handle_create(&c.h_main, c.main, c.ws[MAX_S]);
    for (int s = 0; s < MAX_S; s++) {
        CK(cudaStreamCreateWithFlags(&c.side[s], cudaStreamNonBlocking));
        handle_create(&c.h_side[s], c.side[s], c.ws[s]);
        CK(cudaEventCreateWithFlags(&c.joined[s], cudaEventDisableTiming));
    }
    CK(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming));
    CK(cudaEventCreate(&c.t0));
    CK(cudaEventCreate(&c.t1));
    CK(cudaMalloc(&c.dtab, sizeof(void*) * 3 * 256));
    CK(cudaMallocHost(&c.htab, sizeof(void*) * 3 * 256));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int cublas_version = 0;
    cublasGetVersion(c.h_main, &cublas_version);
    printf("%s, %d SMs, cuBLAS %d; bf16 in, fp32 accumulation; ms per call (mean of 10), TFLOP/s, %% of dense, host us per GEMM queued\n",
           prop.name, prop.multiProcessorCount, cublas_version);

    // Qwen3-30B-A3B: 4096 tokens top-8 over 128 experts, h 2048, fc1 2 x 768; Mixtral 8x7B: 4096 tokens top-2 over 8
    // experts, h 4096, fc1 2 x 14336
    struct { const char* name; int E, R, in, out; } shapes[] = {{"qwen3 fc1", 128, 32768, 2048, 1536},
                                                                {"qwen3 fc2", 128, 32768, 768, 2048},
                                                                {"mixtral fc1", 8, 8192, 4096, 28672},
                                                                {"mixtral fc2", 8, 8192, 14336, 4096}};
    printf("%-12s %-5s %-8s %7s | %-24s | %-24s | %-24s | %-24s | %-24s | %-24s | %-17s | %s\n", "shape", "gemm",
           "rows", "max/mean", "grouped", "loop", "streams 2", "streams 4", "streams 8", "threads 4", "dense",
           "fastest, bitwise");
    Pool pool;
    pool.start(&c, 4);
    for (auto& sh : shapes) {
        const size_t nx = (size_t)sh.R * sh.in, ny = (size_t)sh.R * sh.out, nw = (size_t)sh.E * sh.out * sh.in;
        __nv_bfloat16 *x, *W, *dy, *y;
        float* dW;
        CK(cudaMalloc(&x, nx * 2));
        CK(cudaMalloc(&W, nw * 2));
        CK(cudaMalloc(&dy, ny * 2));
        CK(cudaMalloc(&y, ny * 2));
        CK(cudaMalloc(&dW, nw * 4));
        fill_kernel<<<1024, 256, 0, c.main>>>(x, nx, 1u);
        fill_kernel<<<1024, 256, 0, c.main>>>(W, nw, 2u);
        fill_kernel<<<1024, 256, 0, c.main>>>(dy, ny, 3u);
        CK(cudaMemsetAsync(dW, 0, nw * 4, c.main));
        for (int uneven = 0; uneven < 2; uneven++) {
            std::vector<int> n(sh.E), off(sh.E);
            if (!uneven) {
                for (int e = 0; e < sh.E; e++) n[e] = sh.R / sh.E;
            } else { // a ramp 0 .. 2 x mean, shuffled by a fixed permutation (odd multiplier mod E), rest to the largest
                int given = 0, largest = 0;
                for (int i = 0; i < sh.E; i++) {
                    const int e = (int)((i * 37u + 11u) % (unsigned)sh.E);
                    n[e] = (int)(2.0 * sh.R / sh.E * i / (sh.E - 1));
                    given += n[e];
                    if (n[e] > n[largest]) largest = e;
                }
                n[largest] += sh.R - given;
            }
            int most = 0, zero = 0;
            for (int e = 0, at = 0; e < sh.E; at += n[e], e++) off[e] = at, most = n[e] > most ? n[e] : most, zero += n[e] == 0;
            for (int w = 0; w < 2; w++) {
                Family f = {sh.name, w == 1, sh.E, sh.in, sh.out, n.data(), off.data(), x, W, dy, y, dW};
                const double flop = 2.0 * sh.R * (double)sh.in * sh.out;
                int with_rows = sh.E - zero;
                Timing t[7];
                const char* labels[7] = {"grouped", "loop", "streams 2", "streams 4", "streams 8", "threads 4", "dense"};
                cublasStatus_t gst = run_grouped(c, f);
                t[0] = gst == CUBLAS_STATUS_SUCCESS ? time_it(c, [&] { run_grouped(c, f); }) : Timing{-1, 0};
                t[1] = time_it(c, [&] { run_loop(c, f); });
                const int S[3] = {2, 4, 8};
                for (int i = 0; i < 3; i++) t[2 + i] = time_it(c, [&] { run_streams(c, f, S[i]); });
                t[5] = time_it(c, [&] { pool.run(f); });
                t[6] = time_it(c, [&] { run_dense(c, f, sh.R); });
                // bit for bit: streams 4 against the loop (wgrad from a zeroed dW, beta 1 as the model's)
                const char* bitwise = "";
                if (uneven) {
                    const size_t bytes = w ? nw * 4 : ny * 2;
                    void* out = w ? (void*)dW : (void*)y;
                    std::vector<unsigned char> a(bytes), b(bytes);
                    if (w) CK(cudaMemsetAsync(dW, 0, nw * 4, c.main));
                    run_loop(c, f);
                    CK(cudaMemcpyAsync(a.data(), out, bytes, cudaMemcpyDeviceToHost, c.main));
                    if (w) CK(cudaMemsetAsync(dW, 0, nw * 4, c.main));
                    run_streams(c, f, 4);
                    CK(cudaMemcpyAsync(b.data(), out, bytes, cudaMemcpyDeviceToHost, c.main));
                    CK(cudaStreamSynchronize(c.main));
                    bitwise = memcmp(a.data(), b.data(), bytes) ? ", streams 4 != loop: NOT BITWISE" : ", streams 4 == loop";
                }
                int best = 1;
                for (int i = 0; i < 6; i++)
                    if (t[i].ms > 0 && t[i].ms < t[best].ms) best = i;
                char rows[32];
                snprintf(rows, sizeof(rows), "%s", uneven ? "uneven" : "balanced");
                printf("%-12s %-5s %-8s %7.2f", sh.name, w ? "wgrad" : "fwd", rows, (double)most * sh.E / sh.R);
                for (int i = 0; i < 7; i++) {
                    char cell[64];
                    if (t[i].ms < 0)
                        snprintf(cell, sizeof(cell), "%s", cublasGetStatusName(gst));
                    else if (i == 6)
                        snprintf(cell, sizeof(cell), "%.3f ms %4.0f TF", t[i].ms, flop / t[i].ms / 1e9);
                    else
                        snprintf(cell, sizeof(cell), "%.3f ms %4.0f TF %3.0f%% %4.1f", t[i].ms, flop / t[i].ms / 1e9,
                                 100.0 * t[6].ms / t[i].ms, t[i].host_us / (i == 0 ? 1 : with_rows));
                    printf(" | %-*s", i == 6 ? 17 : 24, cell);
                }
                printf(" | %s%s\n", labels[best], bitwise);
                fflush(stdout);
            }
        }
        cudaFree(x), cudaFree(W), cudaFree(dy), cudaFree(y), cudaFree(dW);
    }
    printf("host us: grouped per call, the others per GEMM (threads 4: the calling thread's); the 75%% goal: a path's "
           "share of dense >= 75%%\n");
    return 0;
}
