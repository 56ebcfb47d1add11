// dev/cuda/grouped_gemm_probe.cu — which type combinations cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx)
// takes on this GPU, and its time against one cublasGemmEx per group, at MoE expert shapes.
//   nvcc -O2 -arch=sm_90 dev/cuda/grouped_gemm_probe.cu -lcublas -o /tmp/probe && /tmp/probe
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

static const char* name(cudaDataType_t t) { return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : "fp32"; }
static size_t bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// groups GEMMs C_g [m_g, n] = A_g [m_g, k] B^T [n, k] (row-major; cuBLAS column-major: C^T = B A^T)
static cublasStatus_t grouped(cublasHandle_t h, int G, const int* m, int n, int k, void** A, void** B, void** C,
                              cudaDataType_t ab, cudaDataType_t c, cublasComputeType_t ct, void** dtab) {
    std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
    std::vector<int> M(G), N(G), K(G), lda(G, k), ldb(G, k), ldc(G, n), gs(G, 1);
    std::vector<float> al(G, 1.0f), be(G, 0.0f);
    for (int g = 0; g < G; g++) M[g] = n, N[g] = m[g], K[g] = k;
    std::vector<void*> tab(3 * G);
    for (int g = 0; g < G; g++) tab[g] = B[g], tab[G + g] = A[g], tab[2 * G + g] = C[g];
    CK(cudaMemcpy(dtab, tab.data(), sizeof(void*) * 3 * G, cudaMemcpyHostToDevice));
    return cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), M.data(), N.data(), K.data(), al.data(),
                                      (const void* const*)dtab, ab, lda.data(), (const void* const*)(dtab + G), ab,
                                      ldb.data(), be.data(), (void* const*)(dtab + 2 * G), c, ldc.data(), G, gs.data(), ct);
}

int main() {
    cublasHandle_t h;
    cublasCreate(&h);
    void** dtab;
    CK(cudaMalloc(&dtab, sizeof(void*) * 3 * 256));
    struct { cudaDataType_t ab, c; cublasComputeType_t ct; const char* cname; } combos[] = {
        {CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, "32F"},
        {CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, "32F"},
        {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, "32F"},
        {CUDA_R_16F, CUDA_R_16F, CUBLAS_COMPUTE_32F, "32F"},
        {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F, "32F"},
        {CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_16BF, "32F_FAST_16BF"},
    };
    // the shapes: Qwen3-30B-A3B's experts (128 x 256 rows, h 2048, 2 fe 1536) and Mixtral's (8 x 1024 rows, 4096, 28672)
    struct { const char* what; int G, rows, n, k; } shapes[] = {{"qwen3 fc1", 128, 256, 1536, 2048},
                                                             {"mixtral fc1", 8, 1024, 28672, 4096},
                                                             {"tiny", 4, 33, 64, 32}};
    for (auto& sh : shapes) {
        for (auto& cb : combos) {
            std::vector<void*> A(sh.G), B(sh.G), C(sh.G);
            std::vector<int> m(sh.G, sh.rows);
            char *a, *b, *c;
            CK(cudaMalloc(&a, bytes(cb.ab) * (size_t)sh.G * sh.rows * sh.k));
            CK(cudaMalloc(&b, bytes(cb.ab) * (size_t)sh.G * sh.n * sh.k));
            CK(cudaMalloc(&c, bytes(cb.c) * (size_t)sh.G * sh.rows * sh.n));
            CK(cudaMemset(a, 0, bytes(cb.ab) * (size_t)sh.G * sh.rows * sh.k));
            CK(cudaMemset(b, 0, bytes(cb.ab) * (size_t)sh.G * sh.n * sh.k));
            for (int g = 0; g < sh.G; g++) {
                A[g] = a + bytes(cb.ab) * (size_t)g * sh.rows * sh.k;
                B[g] = b + bytes(cb.ab) * (size_t)g * sh.n * sh.k;
                C[g] = c + bytes(cb.c) * (size_t)g * sh.rows * sh.n;
            }
            cublasStatus_t st = grouped(h, sh.G, m.data(), sh.n, sh.k, A.data(), B.data(), C.data(), cb.ab, cb.c, cb.ct, dtab);
            CK(cudaDeviceSynchronize());
            float ms_grouped = -1, ms_loop = -1;
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0), cudaEventCreate(&e1);
            if (st == CUBLAS_STATUS_SUCCESS) {
                cudaEventRecord(e0);
                for (int it = 0; it < 10; it++) grouped(h, sh.G, m.data(), sh.n, sh.k, A.data(), B.data(), C.data(), cb.ab, cb.c, cb.ct, dtab);
                cudaEventRecord(e1);
                cudaEventSynchronize(e1);
                cudaEventElapsedTime(&ms_grouped, e0, e1);
                ms_grouped /= 10;
            }
            float al = 1, be = 0;
            cublasStatus_t sl = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, sh.rows, sh.k, &al, B[0], cb.ab, sh.k, A[0], cb.ab, sh.k, &be, C[0], cb.c, sh.n, cb.ct, CUBLAS_GEMM_DEFAULT);
            if (sl == CUBLAS_STATUS_SUCCESS) {
                cudaEventRecord(e0);
                for (int it = 0; it < 10; it++)
                    for (int g = 0; g < sh.G; g++)
                        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, sh.rows, sh.k, &al, B[g], cb.ab, sh.k, A[g], cb.ab, sh.k, &be, C[g], cb.c, sh.n, cb.ct, CUBLAS_GEMM_DEFAULT);
                cudaEventRecord(e1);
                cudaEventSynchronize(e1);
                cudaEventElapsedTime(&ms_loop, e0, e1);
                ms_loop /= 10;
            }
            const double flop = 2.0 * sh.G * sh.rows * (double)sh.n * sh.k;
            printf("%-12s A/B %-4s C %-4s compute %-14s grouped: %-28s %8.3f ms %6.0f TFLOP/s | loop: %s %8.3f ms %6.0f TFLOP/s\n",
                   sh.what, name(cb.ab), name(cb.c), cb.cname, cublasGetStatusString(st), ms_grouped,
                   ms_grouped > 0 ? flop / ms_grouped / 1e9 : 0.0, cublasGetStatusString(sl), ms_loop,
                   ms_loop > 0 ? flop / ms_loop / 1e9 : 0.0);
            cudaFree(a), cudaFree(b), cudaFree(c);
        }
    }
    return 0;
}
