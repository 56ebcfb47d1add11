// dev/cuda/fp8_probe.cu — which per-tensor FP8 cuBLASLt configurations this GPU and cuBLAS accept:
// heuristic and matmul status for each variant of the descriptor (a diagnostic; prints a table).
//   nvcc -O2 -arch=sm_90 dev/cuda/fp8_probe.cu -o /tmp/fp8_probe -lcublasLt && /tmp/fp8_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdint.h>
int main() {
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) { printf("cublasLtCreate failed\n"); return 1; }
    const int M = 256, N = 256, K = 256;
    void *A, *B, *D, *ws, *bias; float* s;
    cudaMalloc(&A, M * K); cudaMalloc(&B, N * K); cudaMalloc(&D, M * N * 4); cudaMalloc(&ws, 32 << 20);
    cudaMalloc(&s, 64); cudaMalloc(&bias, N * 2);
    cudaMemset(A, 0x38, M * K); cudaMemset(B, 0x38, N * K); cudaMemset(bias, 0, N * 2);
    float one[4] = {1, 1, 1, 1}; cudaMemcpy(s, one, 16, cudaMemcpyHostToDevice);
    for (int v = 0; v < 64; v++) {
        int scale_ptrs = v & 1, fast_attr = (v >> 1) & 1, explicit_mode = (v >> 2) & 1, dfp32 = (v >> 3) & 1;
        int scale_offset = (v >> 4) & 1, align_prefs = (v >> 5) & 1;
        if (!scale_ptrs && scale_offset) continue;
        float* sp = s + scale_offset; /* a scale inside an array: 4-byte aligned */
        cublasLtMatmulDesc_t desc; cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
        if (scale_ptrs) {
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sp, sizeof(sp));
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sp, sizeof(sp));
        }
        if (fast_attr) { int8_t f = 0; cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof(f)); }
        if (explicit_mode) {
            int32_t m = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &m, sizeof(m));
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &m, sizeof(m));
        }
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
        cudaDataType_t dt = dfp32 ? CUDA_R_32F : CUDA_R_16BF;
        cublasLtMatrixLayout_t la, lb, lc;
        cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K);
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K);
        cublasLtMatrixLayoutCreate(&lc, dt, N, M, N);
        cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
        uint64_t wsb = 32 << 20;
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
        if (align_prefs) {
            uint32_t al = 256;
            cublasLtMatmulPreferenceAttributes_t w[] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
            for (int i = 0; i < 4; i++) cublasLtMatmulPreferenceSetAttribute(pref, w[i], &al, sizeof(al));
        }
        cublasLtMatmulHeuristicResult_t r; int found = 0;
        cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found);
        cublasStatus_t ms = CUBLAS_STATUS_NOT_INITIALIZED;
        float alpha = 1, beta = 0;
        if (hs == CUBLAS_STATUS_SUCCESS && found)
            ms = cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &r.algo, ws, wsb, 0);
        cudaError_t ce = cudaDeviceSynchronize();
        printf("scale_ptrs %d (+4 bytes %d) fast_attr %d explicit_scalar_mode %d align_prefs %d D %s: heuristic %s (%d), matmul %s, cuda %s\n",
               scale_ptrs, scale_offset, fast_attr, explicit_mode, align_prefs, dfp32 ? "fp32" : "bf16", cublasGetStatusName(hs), found,
               cublasGetStatusName(ms), cudaGetErrorName(ce));
        cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc); cublasLtMatmulDescDestroy(desc);
    }
    return 0;
}
