/* tests/test_kernels.h — every elementwise, row and reduction kernel of megatron.cu through the launcher
 * the model calls, against a double-precision CPU reference: norms (forward, residual-fused, recompute,
 * backward fused with its column sums and the fallback passes), column sums, bias add / bias+residual /
 * bias+GELU / GELU backward, bias+squared ReLU and its backward, SwiGLU, the exact attention path's
 * QKV split/merge, head permutes, --qk-layernorm's query and key norms (forward, backward) and causal
 * softmax, RoPE on the QKV rows (flash path), cross entropy (plain, 16-byte, vocab-parallel),
 * embeddings forward and backward, the gradient norm, AdamW and the casts. (Flash attention itself:
 * tests/test_attention.h.) Each test skips without a GPU. This is the correctness part of the lab
 * dev/cuda/fused_kernels.cu, which keeps the timings.
 *
 * Rules, for every case:
 *   - the REAL launcher of megatron.cu (the one the model calls, `const mt_exec*` first) picks the
 *     kernel; the vocab-parallel cross entropy's two launchers run once per simulated rank, the
 *     all-gather between them being where each rank writes its statistics; the one launch expression
 *     the test repeats is linear_forward's bias branch (kt_linear_bias_add), which otherwise needs a
 *     GEMM in front of it;
 *   - inputs from a fixed-seed host generator, never zero, both signs, rounded to the storage type on
 *     the host so the reference sees exactly what the GPU sees;
 *   - outputs are poisoned with NaN (0xFF bytes) before the run, so an element the kernel does not
 *     write fails; in-place outputs start from random values the update must change (a skipped update
 *     fails); outputs that accumulate start from random values (accumulate = 1) or NaN (accumulate =
 *     0: "the first micro-batch overwrites", so the old value must never be read);
 *   - every element: |out - ref| <= atol + rtol * |ref|, and norm-wise ||out - ref|| / ||ref|| <=
 *     norm_tol; a failure prints the launcher, the variant its heuristic picked, the type, the shape
 *     and the first element out of bounds as [row, col];
 *   - shapes are chosen so that every variant each launcher's size/alignment heuristic can pick runs
 *     at least once per type; the variant is mirrored from the launcher's predicate next to each call
 *     (ADAPT it if a heuristic changes) and each test fails if its shape table stops reaching one.
 *
 * Tolerances. u_s is the unit roundoff of the stored type (fp32 2^-24 = 6.0e-8, bf16 2^-8 = 3.9e-3,
 * fp16 2^-11 = 4.9e-4): rounding one value to it moves the value by at most u_s relative. Every kernel
 * computes in fp32, u_c = 2^-24, and CUDA's expf, tanhf, logf are within 2 ulp (CUDA C Programming
 * Guide, mathematical functions). Bounds are first-order worst cases, then doubled:
 *   - a result rounded once to T: rtol = 2 u_s, and atol = twice the fp32 error of its formula in
 *     absolute terms (a sum that cancels to ~0 keeps the absolute error of its terms);
 *   - an fp32 sum of n terms in some fixed order (a lane's sequential part, then a tree): its error is
 *     at most depth * u_c * sum |terms| (depth: the longest chain of additions, e.g. C/32 + 5 for a
 *     warp over a row of C), so atol = 2 (depth + the terms' own rounding) u_c sum |terms|, per
 *     element from the data;
 *   - fp16 adds half its subnormal spacing (2^-25) to atol: values under 6.1e-5 lose relative precision;
 *   - norm-wise: 2 u_s plus the compute slack for results rounded once (the rounding of each element
 *     is at most u_s relative, so the norm-wise error is too), and for sums, where the per-element
 *     bound is what binds, the norm of the per-element bounds.
 * Any indexing, masking, stride, alignment or missed-write bug gives errors of order 1 (or NaN),
 * orders of magnitude above these.
 *
 * Runtime (estimated, not yet measured: written without a GPU): the GPU work is milliseconds; the host
 * references, ~300 M element evaluations over the three types, dominate: a few seconds in all. Device
 * memory < 200 MB at any time.
 *
 * Adapting to launcher changes: the execution context comes from kt_exec() alone; a launcher whose
 * parameters change changes its call lines (one or two per test); a heuristic that changes changes its
 * mirror (the variant labels next to each launcher call). */
#ifndef MT_TEST_KERNELS_H
#define MT_TEST_KERNELS_H

#include <stdarg.h>
#include <vector>

/* ============================================================================================== */
/* Formats, host conversions, random inputs                                                        */
/* ============================================================================================== */

#define KT_UC 5.9604644775390625e-08 /* 2^-24: fp32 unit roundoff, the kernels' arithmetic */

template <typename T> struct kt_fmt;
template <> struct kt_fmt<float> {
    static constexpr mt_precision precision = MT_FP32;
    static constexpr double u = KT_UC;
    static constexpr double tiny = 0.0;
    static constexpr const char* name = "fp32";
};
template <> struct kt_fmt<__nv_bfloat16> {
    static constexpr mt_precision precision = MT_BF16;
    static constexpr double u = 3.90625e-3; /* 2^-8 */
    static constexpr double tiny = 0.0;     /* bf16 has fp32's exponent range */
    static constexpr const char* name = "bf16";
};
template <> struct kt_fmt<__half> {
    static constexpr mt_precision precision = MT_FP16;
    static constexpr double u = 4.8828125e-4;        /* 2^-11 */
    static constexpr double tiny = 2.98023223876953125e-08; /* 2^-25: half the subnormal spacing */
    static constexpr const char* name = "fp16";
};

/* host conversions: the same round-to-nearest-even as the kernels' from_float */
template <typename T> static inline T kt_from(float x);
template <> inline float kt_from<float>(float x) { return x; }
template <> inline __nv_bfloat16 kt_from<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> inline __half kt_from<__half>(float x) { return __float2half_rn(x); }
template <typename T> static inline float kt_to(T x);
template <> inline float kt_to<float>(float x) { return x; }
template <> inline float kt_to<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> inline float kt_to<__half>(__half x) { return __half2float(x); }
template <typename T> static inline double kt_round(double x) { return (double)kt_to<T>(kt_from<T>((float)x)); }

typedef struct {
    uint64_t s;
} kt_rng;
static inline uint64_t kt_next(kt_rng* r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double kt_uniform(kt_rng* r) { return (double)(kt_next(r) >> 11) * (1.0 / 9007199254740992.0); }
/* a random sign and a magnitude uniform in [lo, hi): never zero when lo > 0 */
static inline float kt_signed(kt_rng* r, double lo, double hi) {
    double m = lo + (hi - lo) * kt_uniform(r);
    return (float)((kt_next(r) & 1) ? -m : m);
}
static inline uint64_t kt_seed(int a, int b, int c, int d) {
    return 0x5DEECE66Dull ^ ((uint64_t)a << 48) ^ ((uint64_t)b << 32) ^ ((uint64_t)c << 16) ^ (uint64_t)d;
}

/* A host tensor: the stored values (h) and the same values in double (v). */
template <typename T>
struct kt_host {
    std::vector<T> h;
    std::vector<double> v;
    void fill(int64_t n, kt_rng* r, double lo, double hi) { /* +-[lo, hi), rounded to T */
        h.resize((size_t)n);
        v.resize((size_t)n);
        for (int64_t i = 0; i < n; i++) {
            h[i] = kt_from<T>(kt_signed(r, lo, hi));
            v[i] = kt_to<T>(h[i]);
        }
    }
    void fill_positive(int64_t n, kt_rng* r, double lo, double hi) {
        fill(n, r, lo, hi);
        for (int64_t i = 0; i < n; i++)
            if (v[i] < 0) { h[i] = kt_from<T>((float)-v[i]); v[i] = -v[i]; }
    }
    void from_device_copy(const std::vector<T>& x) {
        h = x;
        v.resize(x.size());
        for (size_t i = 0; i < x.size(); i++) v[i] = kt_to<T>(x[i]);
    }
    int64_t n() const { return (int64_t)h.size(); }
};

/* ============================================================================================== */
/* Device context, allocations, copies                                                             */
/* ============================================================================================== */

typedef struct {
    cudaStream_t stream;           /* non-blocking, as the trainer's */
    mt_gpu_error error;            /* what the launchers record */
    mt_exec exec;                  /* built by kt_exec */
    std::vector<void*> allocs;     /* freed by kt_release after each case */
    int alloc_failed;
} kt_ctx;

static int kt_ctx_init(kt_ctx* k) {
    k->alloc_failed = 0;
    memset(&k->error, 0, sizeof(k->error));
    k->error.status = MT_OK;
    memset(&k->exec, 0, sizeof(k->exec));
    cudaError_t e = cudaStreamCreateWithFlags(&k->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        printf("    FAIL cudaStreamCreateWithFlags: %s\n", cudaGetErrorString(e));
        return 0;
    }
    return 1;
}
static void kt_release(kt_ctx* k) {
    cudaStreamSynchronize(k->stream);
    for (void* p : k->allocs) cudaFree(p);
    k->allocs.clear();
    k->alloc_failed = 0;
}
static void kt_ctx_free(kt_ctx* k) {
    kt_release(k);
    cudaStreamDestroy(k->stream);
}

/* n elements of T (+ slack), starting `offset` elements past a 256-byte-aligned address: offset 1
 * makes the pointer misaligned for 16-byte accesses, which sends a launcher to its scalar kernel. */
template <typename T>
static T* kt_alloc(kt_ctx* k, int64_t n, int offset = 0) {
    void* p = NULL;
    cudaError_t e = cudaMalloc(&p, (size_t)(n + offset + 16) * sizeof(T));
    if (e != cudaSuccess) {
        if (!k->alloc_failed) printf("    FAIL cudaMalloc of %lld x %zu bytes: %s\n", (long long)n, sizeof(T), cudaGetErrorString(e));
        k->alloc_failed = 1;
        return NULL;
    }
    k->allocs.push_back(p);
    return (T*)p + offset;
}
#define KT_CUDA(call)                                                                                      \
    do {                                                                                                   \
        cudaError_t e_ = (call);                                                                           \
        if (e_ != cudaSuccess) {                                                                           \
            printf("    FAIL %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));        \
            return 0;                                                                                      \
        }                                                                                                  \
    } while (0)
#define KT_ALLOCATED(k)                        \
    do {                                       \
        if ((k)->alloc_failed) return 0;       \
    } while (0)

template <typename T>
static cudaError_t kt_put(kt_ctx* k, T* dst, const std::vector<T>& src) {
    return cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, k->stream);
}
template <typename T>
static cudaError_t kt_get(kt_ctx* k, std::vector<T>& dst, const T* src, int64_t n) {
    dst.resize((size_t)n);
    cudaError_t e = cudaMemcpyAsync(dst.data(), src, (size_t)n * sizeof(T), cudaMemcpyDeviceToHost, k->stream);
    return e == cudaSuccess ? cudaStreamSynchronize(k->stream) : e;
}
/* NaN in fp32, bf16 and fp16 */
template <typename T>
static cudaError_t kt_poison(kt_ctx* k, T* p, int64_t n) {
    return cudaMemsetAsync(p, 0xFF, (size_t)n * sizeof(T), k->stream);
}

/* After a launcher: launch and execution errors, and what the launcher recorded. */
static int kt_sync(kt_ctx* k, const char* label) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaStreamSynchronize(k->stream);
    if (e != cudaSuccess) {
        printf("    FAIL %s: CUDA error %s\n", label, cudaGetErrorString(e));
        return 0;
    }
    if (k->error.status != MT_OK) {
        printf("    FAIL %s: the launcher recorded: %s\n", label, k->error.error.message);
        return 0;
    }
    return 1;
}

/* ============================================================================================== */
/* Checks                                                                                           */
/* ============================================================================================== */

typedef struct {
    char label[240];
    char line[760];
    int ok;
} kt_report;

static void kt_report_begin(kt_report* r, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->label, sizeof(r->label), fmt, ap);
    va_end(ap);
    snprintf(r->line, sizeof(r->line), "%s:", r->label);
    r->ok = 1;
}
static int kt_report_end(kt_report* r) {
    printf("      %s%s\n", r->line, r->ok ? "" : "   <- FAIL");
    return r->ok;
}

/* One output's comparison, element by element. */
typedef struct {
    const char* name;
    int64_t row_len; /* for [row, col] in messages (0: flat index) */
    double rtol, norm_tol, floor; /* norm_tol < 0: the norm of the per-element bounds */
    double err2, ref2, tol2;
    int64_t n, bad, first, worst;
    double first_got, first_ref, first_tol, worst_ratio;
} kt_check;

static void kt_check_begin(kt_check* c, const char* name, int64_t row_len, double rtol, double norm_tol, double floor) {
    memset(c, 0, sizeof(*c));
    c->name = name;
    c->row_len = row_len;
    c->rtol = rtol;
    c->norm_tol = norm_tol;
    c->floor = floor;
    c->first = c->worst = -1;
}
static inline void kt_check_add(kt_check* c, int64_t i, double got, double ref, double atol) {
    const double tol = atol + c->rtol * fabs(ref) + c->floor, err = fabs(got - ref);
    c->n++;
    if (!(err <= tol)) {
        if (c->bad++ == 0) {
            c->first = i;
            c->first_got = got;
            c->first_ref = ref;
            c->first_tol = tol;
        }
    }
    const double ratio = tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0);
    if (!(ratio <= c->worst_ratio)) {
        c->worst_ratio = ratio;
        c->worst = i;
    }
    c->err2 += err == err ? err * err : INFINITY;
    c->ref2 += ref * ref;
    c->tol2 += tol * tol;
}
static void kt_where(char* buf, size_t cap, const kt_check* c, int64_t i) {
    if (c->row_len > 0) snprintf(buf, cap, "[row %lld, col %lld]", (long long)(i / c->row_len), (long long)(i % c->row_len));
    else snprintf(buf, cap, "[%lld]", (long long)i);
}
static int kt_check_end(kt_check* c, kt_report* r) {
    const double norm = c->ref2 > 0 ? sqrt(c->err2 / c->ref2) : sqrt(c->err2);
    const double ntol = c->norm_tol >= 0 ? c->norm_tol : (c->ref2 > 0 ? sqrt(c->tol2 / c->ref2) : sqrt(c->tol2));
    const int ok = c->n > 0 && c->bad == 0 && norm <= ntol;
    size_t len = strlen(r->line);
    snprintf(r->line + len, sizeof(r->line) - len, " %s %.1e", c->name, norm);
    if (!ok) {
        r->ok = 0;
        char where[80];
        printf("    FAIL %s: %s", r->label, c->name);
        if (c->n == 0) printf(": nothing compared\n");
        else if (c->bad) {
            kt_where(where, sizeof(where), c, c->first);
            printf("%s = %.9g, reference %.9g (|diff| %.3g > tol %.3g)%s; %lld of %lld elements out of bounds",
                   where, c->first_got, c->first_ref, fabs(c->first_got - c->first_ref), c->first_tol,
                   c->first_got != c->first_got ? " (NaN: never written?)" : "", (long long)c->bad, (long long)c->n);
            kt_where(where, sizeof(where), c, c->worst);
            printf(", worst %s at %.3g x its tol; norm-wise %.3g (tol %.3g)\n", where, c->worst_ratio, norm, ntol);
        } else
            printf(": norm-wise error %.3g > tol %.3g (every element within its own bound)\n", norm, ntol);
    }
    return ok;
}

/* The variants a test's shapes must reach (per type). */
typedef struct {
    const char* names[24];
    int seen[24];
    int n;
} kt_cover;
static void kt_cover_init(kt_cover* c, const char* const* names, int n) {
    memset(c, 0, sizeof(*c));
    for (int i = 0; i < n && i < 24; i++) c->names[c->n++] = names[i];
}
static void kt_cover_hit(kt_cover* c, const char* name) {
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->names[i], name)) c->seen[i] = 1;
}
static int kt_cover_check(const kt_cover* c, const char* what, const char* type) {
    int ok = 1;
    for (int i = 0; i < c->n; i++)
        if (!c->seen[i]) {
            printf("    FAIL %s<%s>: no shape of the test reaches the variant \"%s\" any more (the launcher's "
                   "heuristic or the shape table changed)\n", what, type, c->names[i]);
            ok = 0;
        }
    return ok;
}

/* ============================================================================================== */
/* The execution context. Every call below is a launcher of megatron.cu taking `const mt_exec*`:     */
/* ADAPT HERE (kt_exec) if that context changes; kt_linear_bias_add is the one launch expression     */
/* the test repeats (linear_forward's bias branch, which otherwise needs a GEMM in front of it).    */
/* ============================================================================================== */

/* The stream, the error record, no GEMM plans, and the micro-batch mode: accumulate 0 is the step's
 * first micro-batch (gradient writers overwrite), 1 a later one (they add). */
static const mt_exec* kt_exec(kt_ctx* k, int accumulate) {
    memset(&k->exec, 0, sizeof(k->exec));
    k->exec.stream = k->stream;
    k->exec.error = &k->error;
    k->exec.gemm = NULL;
    k->exec.mode.accumulate_gradients = accumulate;
    return &k->exec;
}

/* linear_forward's bias branch, run after its GEMM when cuBLASLt has no bias epilogue for it (the
 * same predicate and launches) */
template <typename T>
static void kt_linear_bias_add(kt_ctx* k, T* y, const T* bias, int N, int out) {
    int64_t n = (int64_t)N * out;
    if (out % vec16<T>::N == 0 && aligned16(y) && aligned16(bias))
        bias_add_vec_kernel<T><<<ceil_div(n / vec16<T>::N, 256), 256, 0, k->stream>>>(y, bias, n / vec16<T>::N, out);
    else
        bias_add_kernel<T><<<ceil_div(n, 256), 256, 0, k->stream>>>(y, bias, N, out);
    LAUNCH_CHECK(&k->error);
}

/* Every test body runs for the three types; a case returns 1 when it passed. */
#define KT_FOR_TYPES(fn)                                                                  \
    do {                                                                                  \
        REQUIRE_GPU();                                                                    \
        kt_ctx k_;                                                                        \
        if (!kt_ctx_init(&k_)) return TEST_FAIL;                                          \
        int ok_ = fn<float>(&k_) && fn<__nv_bfloat16>(&k_) && fn<__half>(&k_);            \
        kt_ctx_free(&k_);                                                                 \
        return ok_ ? TEST_PASS : TEST_FAIL;                                               \
    } while (0)

/* the column-sum scratch as the trainer sizes it, for C columns: [max(COLSUM_MAX_CHUNKS,
 * NORM_BWD_BLOCKS), C] floats each, NaN so that a final sum reading an unwritten partial fails */
static int kt_colsum_scratch(kt_ctx* k, mt_colsum_scratch* s, int C) {
    const int64_t rows = COLSUM_MAX_CHUNKS > NORM_BWD_BLOCKS ? COLSUM_MAX_CHUNKS : NORM_BWD_BLOCKS;
    s->max_chunks = COLSUM_MAX_CHUNKS;
    s->partial_a = kt_alloc<float>(k, rows * C);
    s->partial_b = kt_alloc<float>(k, rows * C);
    s->partial_c = kt_alloc<float>(k, rows * C);
    KT_ALLOCATED(k);
    KT_CUDA(kt_poison(k, s->partial_a, rows * C));
    KT_CUDA(kt_poison(k, s->partial_b, rows * C));
    KT_CUDA(kt_poison(k, s->partial_c, rows * C));
    return 1;
}

/* The longest chain of fp32 additions in a deterministic column sum over N rows, for either path:
 * column_sum / the norm fallback (colsum_chunks: ceil(N/256)-row chunks, then column_final_sums_kernel:
 * 16 lanes of <= 16 chunks, then the 16 lanes) and the fused norm backward (a block's rows: at most
 * ceil(N/256) + 32, tile rows spread over <= 32 row groups added in order, then the same final sums). */
static double kt_sum_depth(int64_t N) { return (double)((N + 255) / 256) + 96.0; }

/* ============================================================================================== */
/* 1. norm_forward: LayerNorm / RMSNorm, one warp per row (vec: 16-byte loads)                     */
/* ============================================================================================== */

/* The reference of one normalised row and the checks of out, mean, rstd; x is what the kernel read
 * (the input, or the residual sum it stored). Bounds: the mean of C values summed by 32 lanes (C/32
 * each) and a 5-level tree has |err| <= (C/32 + 6) u_c mean|x|; the variance is a sum of positive
 * terms, (C/32 + 8) u_c relative (the mean's error enters squared), so rstd = 1/sqrt(var + eps)
 * is within (C/32 + 8)/2 + 4 u_c; out = (x - mean) rstd w + b then carries rstd's relative error,
 * 4 u_c of its own and the mean's error times rstd |w|, and one rounding to T. */
template <typename T>
static void kt_norm_rows_check(kt_report* rep, const double* x, const double* w, const double* b, int N, int C,
                               bool rms, const std::vector<T>& out, const std::vector<float>& mean,
                               const std::vector<float>& rstd) {
    const double us = kt_fmt<T>::u, uc = KT_UC, eps = 1e-5;
    const double rtol_rstd = 2.0 * (0.5 * (C / 32.0 + 8.0) + 4.0) * uc;
    kt_check co, cm, cr;
    kt_check_begin(&co, "out", C, 2 * us, 2 * us + 2 * (rtol_rstd + 8 * uc), kt_fmt<T>::tiny);
    kt_check_begin(&cm, "mean", 0, 0.0, -1.0, 0.0);
    kt_check_begin(&cr, "rstd", 0, rtol_rstd, rtol_rstd, 0.0);
    for (int r = 0; r < N; r++) {
        const double* xr = x + (int64_t)r * C;
        double m = 0.0, var = 0.0, amean = 0.0;
        for (int c = 0; c < C; c++) amean += fabs(xr[c]);
        amean /= C;
        if (!rms) {
            for (int c = 0; c < C; c++) m += xr[c];
            m /= C;
        }
        for (int c = 0; c < C; c++) var += (xr[c] - m) * (xr[c] - m);
        var /= C;
        const double rs = 1.0 / sqrt(var + eps);
        const double atol_mean = rms ? 0.0 : 2.0 * (C / 32.0 + 6.0) * uc * amean;
        kt_check_add(&cm, r, mean[r], m, atol_mean); /* RMSNorm: exactly 0 */
        kt_check_add(&cr, r, rstd[r], rs, 0.0);
        for (int c = 0; c < C; c++) {
            const double xw = (xr[c] - m) * rs * w[c], bc = b ? b[c] : 0.0;
            const double atol = 2.0 * ((fabs(xw) + fabs(bc)) * (rtol_rstd + 4 * uc) + atol_mean * rs * fabs(w[c]));
            kt_check_add(&co, (int64_t)r * C + c, kt_to<T>(out[(int64_t)r * C + c]), xw + bc, atol);
        }
    }
    kt_check_end(&co, rep);
    kt_check_end(&cm, rep);
    kt_check_end(&cr, rep);
}

template <typename T>
static int kt_norm_forward_case(kt_ctx* k, kt_cover* cov, int N, int C, bool rms, int misalign_x) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    kt_rng rng = {kt_seed(1, N, C, rms)};
    kt_host<T> x, w, b;
    x.fill(n, &rng, 0.02, 1.7);
    w.fill(C, &rng, 0.1, 1.5);
    if (!rms) b.fill(C, &rng, 0.01, 0.5);
    T* dx = kt_alloc<T>(k, n, misalign_x);
    T* dw = kt_alloc<T>(k, C);
    T* db = rms ? NULL : kt_alloc<T>(k, C);
    T* dout = kt_alloc<T>(k, n);
    float* dmean = kt_alloc<float>(k, N);
    float* drstd = kt_alloc<float>(k, N);
    KT_ALLOCATED(k);
    const bool vec = C % V == 0 && aligned16(dout) && aligned16(dx) && aligned16(dw) && aligned16(db);
    kt_cover_hit(cov, vec ? "vec" : "scalar");
    kt_report rep;
    kt_report_begin(&rep, "norm_forward<%s> [%s] %s N=%d C=%d%s", kt_fmt<T>::name, vec ? "vec" : "scalar",
                    rms ? "RMSNorm" : "LayerNorm", N, C, misalign_x ? " (x misaligned)" : "");
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, dw, w.h));
    if (db) KT_CUDA(kt_put(k, db, b.h));
    KT_CUDA(kt_poison(k, dout, n));
    KT_CUDA(kt_poison(k, dmean, N));
    KT_CUDA(kt_poison(k, drstd, N));
    norm_forward<T>(kt_exec(k, 0), dout, dmean, drstd, dx, dw, db, N, C, 1e-5f, rms);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out;
    std::vector<float> mean, rstd;
    KT_CUDA(kt_get(k, out, dout, n));
    KT_CUDA(kt_get(k, mean, dmean, N));
    KT_CUDA(kt_get(k, rstd, drstd, N));
    kt_norm_rows_check<T>(&rep, x.v.data(), w.v.data(), rms ? NULL : b.v.data(), N, C, rms, out, mean, rstd);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_norm_forward_all(kt_ctx* k) {
    static const char* const variants[] = {"vec", "scalar"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    /* N, C, rms, misaligned x: one row and a partial last block of 8 rows; C from 64 to 4096; C not
     * a multiple of 8 (bf16/fp16) or of 4 (fp32); a misaligned input */
    const struct { int N, C, rms, mis; } shapes[] = {
        {1, 64, 0, 0}, {1001, 384, 1, 0}, {1001, 768, 0, 0}, {300, 4096, 1, 0}, {257, 4096, 0, 0},
        {1001, 770, 0, 0}, {65, 36, 1, 0}, {257, 768, 1, 1},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_norm_forward_case<T>(k, &cov, s.N, s.C, s.rms, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "norm_forward", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_norm_forward(void) { KT_FOR_TYPES(kt_norm_forward_all); }

/* ============================================================================================== */
/* 2. residual_norm_forward: sum = residual + branch + bias, out = norm(sum): fused (a row in one   */
/*    warp's registers) or bias_residual (vec, or scalar: bias_add + residual_add) + norm_forward     */
/* ============================================================================================== */

template <typename T>
static int kt_residual_norm_case(kt_ctx* k, kt_cover* cov, int N, int C, bool rms, int misalign_res) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(2, N, C, rms)};
    /* GPT-2: the row-parallel linear's bias and the norm's bias; Llama (RMSNorm): neither */
    kt_host<T> res, br, bias, w, nb;
    res.fill(n, &rng, 0.02, 1.7);
    br.fill(n, &rng, 0.02, 1.7);
    w.fill(C, &rng, 0.1, 1.5);
    if (!rms) {
        bias.fill(C, &rng, 0.01, 0.5);
        nb.fill(C, &rng, 0.01, 0.5);
    }
    T* dres = kt_alloc<T>(k, n, misalign_res);
    T* dbr = kt_alloc<T>(k, n);
    T* dbias = rms ? NULL : kt_alloc<T>(k, C);
    T* dw = kt_alloc<T>(k, C);
    T* dnb = rms ? NULL : kt_alloc<T>(k, C);
    T* dsum = kt_alloc<T>(k, n);
    T* dout = kt_alloc<T>(k, n);
    float* dmean = kt_alloc<float>(k, N);
    float* drstd = kt_alloc<float>(k, N);
    KT_ALLOCATED(k);
    /* residual_norm_forward's choice, then bias_residual's and norm_forward's */
    const bool fused = C % V == 0 && C <= 32 * V * RESIDUAL_NORM_MAXV && aligned16(dsum) && aligned16(dout) &&
                       aligned16(dres) && aligned16(dbr) && aligned16(dbias) && aligned16(dw) && aligned16(dnb);
    const bool br_vec = C % V == 0 && aligned16(dsum) && aligned16(dres) && aligned16(dbr) && aligned16(dbias);
    const bool norm_vec = C % V == 0 && aligned16(dout) && aligned16(dsum) && aligned16(dw) && aligned16(dnb);
    char variant[96];
    if (fused) snprintf(variant, sizeof(variant), "fused");
    else snprintf(variant, sizeof(variant), "bias_residual %s + norm_forward %s", br_vec ? "vec" : "scalar",
                  norm_vec ? "vec" : "scalar");
    kt_cover_hit(cov, variant);
    kt_report rep;
    kt_report_begin(&rep, "residual_norm_forward<%s> [%s] %s N=%d C=%d%s", kt_fmt<T>::name, variant,
                    rms ? "RMSNorm, no biases" : "LayerNorm + biases", N, C, misalign_res ? " (residual misaligned)" : "");
    KT_CUDA(kt_put(k, dres, res.h));
    KT_CUDA(kt_put(k, dbr, br.h));
    KT_CUDA(kt_put(k, dw, w.h));
    if (!rms) {
        KT_CUDA(kt_put(k, dbias, bias.h));
        KT_CUDA(kt_put(k, dnb, nb.h));
    }
    KT_CUDA(kt_poison(k, dsum, n));
    KT_CUDA(kt_poison(k, dout, n));
    KT_CUDA(kt_poison(k, dmean, N));
    KT_CUDA(kt_poison(k, drstd, N));
    residual_norm_forward<T>(kt_exec(k, 0), dsum, dout, dmean, drstd, dres, dbr, dbias, dw, dnb, N, C, 1e-5f, rms);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> sum, out;
    std::vector<float> mean, rstd;
    KT_CUDA(kt_get(k, sum, dsum, n));
    KT_CUDA(kt_get(k, out, dout, n));
    KT_CUDA(kt_get(k, mean, dmean, N));
    KT_CUDA(kt_get(k, rstd, drstd, N));
    /* sum: at most two roundings to T (the scalar path rounds branch + bias before the residual add,
     * the others add in fp32 and round once), each <= u_s of values of the sum's magnitude, and two
     * fp32 additions */
    kt_check cs;
    kt_check_begin(&cs, "sum", C, 2 * us, 4 * us + 16 * uc, kt_fmt<T>::tiny);
    std::vector<double> stored((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        const double bc = rms ? 0.0 : bias.v[i % C];
        const double atol = 2.0 * (us * fabs(br.v[i] + bc) + 3 * uc * (fabs(res.v[i]) + fabs(br.v[i]) + fabs(bc)));
        kt_check_add(&cs, i, kt_to<T>(sum[i]), res.v[i] + br.v[i] + bc, atol);
        stored[i] = kt_to<T>(sum[i]);
    }
    kt_check_end(&cs, &rep);
    /* the norm of the stored sum (what every version's norm reads) */
    kt_norm_rows_check<T>(&rep, stored.data(), w.v.data(), rms ? NULL : nb.v.data(), N, C, rms, out, mean, rstd);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_residual_norm_all(kt_ctx* k) {
    static const char* const variants[] = {"fused", "bias_residual vec + norm_forward vec",
                                           "bias_residual scalar + norm_forward scalar",
                                           "bias_residual scalar + norm_forward vec"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 4);
    /* fused up to 32 * 8 vectors per row (bf16/fp16 2048, fp32 1024), two kernels above; C % V != 0;
     * a misaligned residual sends bias_residual to its scalar path while the norm stays vectorised */
    const struct { int N, C, rms, mis; } shapes[] = {
        {1, 64, 0, 0}, {1001, 768, 0, 0}, {1001, 768, 1, 0}, {200, 1024, 0, 0}, {200, 2048, 1, 0},
        {300, 4096, 0, 0}, {1001, 770, 0, 0}, {65, 770, 1, 0}, {257, 768, 0, 1},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_residual_norm_case<T>(k, &cov, s.N, s.C, s.rms, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "residual_norm_forward", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_residual_norm_forward(void) { KT_FOR_TYPES(kt_residual_norm_all); }

/* ============================================================================================== */
/* 3. norm_apply: the norm's output again from the saved statistics (backward recompute)            */
/* ============================================================================================== */

template <typename T>
static int kt_norm_apply_case(kt_ctx* k, kt_cover* cov, int N, int C, bool rms, int misalign_out) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(3, N, C, rms)};
    kt_host<T> x, w, b;
    x.fill(n, &rng, 0.02, 1.7);
    w.fill(C, &rng, 0.1, 1.5);
    if (!rms) b.fill(C, &rng, 0.01, 0.5);
    std::vector<float> mean(N), rstd(N);
    for (int r = 0; r < N; r++) {
        mean[r] = rms ? 0.0f : kt_signed(&rng, 0.001, 0.2);
        rstd[r] = (float)(0.5 + 1.5 * kt_uniform(&rng));
    }
    T* dx = kt_alloc<T>(k, n);
    T* dw = kt_alloc<T>(k, C);
    T* db = rms ? NULL : kt_alloc<T>(k, C);
    T* dout = kt_alloc<T>(k, n, misalign_out);
    float* dmean = kt_alloc<float>(k, N);
    float* drstd = kt_alloc<float>(k, N);
    KT_ALLOCATED(k);
    const bool vec = C % V == 0 && aligned16(dout) && aligned16(dx) && aligned16(dw) && aligned16(db);
    kt_cover_hit(cov, vec ? "V=16 bytes" : "V=1");
    kt_report rep;
    kt_report_begin(&rep, "norm_apply<%s> [%s] %s N=%d C=%d%s", kt_fmt<T>::name, vec ? "V=16 bytes" : "V=1",
                    rms ? "RMSNorm" : "LayerNorm", N, C, misalign_out ? " (out misaligned)" : "");
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, dw, w.h));
    if (db) KT_CUDA(kt_put(k, db, b.h));
    KT_CUDA(kt_put(k, dmean, mean));
    KT_CUDA(kt_put(k, drstd, rstd));
    KT_CUDA(kt_poison(k, dout, n));
    norm_apply<T>(kt_exec(k, 0), dout, dx, dmean, drstd, dw, db, N, C);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out;
    KT_CUDA(kt_get(k, out, dout, n));
    /* (x - m) rs w + b in fp32: 4 roundings on the product's operands' magnitudes, one on the bias add;
     * then one rounding to T */
    kt_check co;
    kt_check_begin(&co, "out", C, 2 * us, 2 * us + 32 * uc, kt_fmt<T>::tiny);
    for (int64_t i = 0; i < n; i++) {
        const int r = (int)(i / C), c = (int)(i % C);
        const double m = mean[r], rs = rstd[r], bc = rms ? 0.0 : b.v[c];
        const double ref = (x.v[i] - m) * rs * w.v[c] + bc;
        const double atol = 2.0 * (4 * uc * (fabs(x.v[i]) + fabs(m)) * rs * fabs(w.v[c]) + 2 * uc * (fabs(ref) + fabs(bc)));
        kt_check_add(&co, i, kt_to<T>(out[i]), ref, atol);
    }
    kt_check_end(&co, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_norm_apply_all(kt_ctx* k) {
    static const char* const variants[] = {"V=16 bytes", "V=1"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    const struct { int N, C, rms, mis; } shapes[] = {
        {1, 64, 0, 0}, {1001, 768, 0, 0}, {300, 4096, 1, 0}, {1001, 770, 0, 0}, {257, 768, 1, 1},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_norm_apply_case<T>(k, &cov, s.N, s.C, s.rms, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "norm_apply", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_norm_apply(void) { KT_FOR_TYPES(kt_norm_apply_all); }

/* ============================================================================================== */
/* 4. norm_backward: dresidual += d norm/dx . dy, the weight and bias gradients, and the column sums  */
/*    of the new dresidual (the preceding row-parallel linear's bias gradient). Fused (NJ = 1, 2, 4  */
/*    groups of 256 vectors per row; tile height and block count from C, N) or the fallback passes:   */
/*    input gradient (vec / scalar), LayerNorm column sums (vec / scalar), column_sum of dresidual.    */
/* ============================================================================================== */

/* Which path norm_backward takes (mirrors its predicates); tiles > blocks means a grid-stride loop. */
template <typename T>
static void kt_norm_backward_variant(char* out, size_t cap, kt_cover* cov, int N, int C, const void* dres,
                                     const void* dy, const void* x, const void* w, bool prev) {
    constexpr int V = vec16<T>::N;
    const int nj = ceil_div(C / V, 256);
    if (C % V == 0 && (nj == 1 || nj == 2 || nj == 4) && aligned16(dres) && aligned16(dy) && aligned16(x) && aligned16(w)) {
        const int rows = norm_backward_tile_rows(C, sizeof(T)), tiles = ceil_div(N, rows);
        const int blocks = tiles < NORM_BWD_BLOCKS ? tiles : NORM_BWD_BLOCKS;
        char name[32];
        snprintf(name, sizeof(name), "fused NJ=%d", nj);
        kt_cover_hit(cov, name);
        kt_cover_hit(cov, tiles > blocks ? "fused, more tiles than blocks" : "fused, a tile per block");
        snprintf(out, cap, "%s, %d-row tiles, %d tiles on %d blocks", name, rows, tiles, blocks);
        return;
    }
    const bool in_vec = C % V == 0 && aligned16(dres) && aligned16(dy) && aligned16(x) && aligned16(w);
    const bool cs_vec = C % V == 0 && C / V >= 1024 && aligned16(dy) && aligned16(x);
    const bool pv_vec = C % V == 0 && aligned16(dres);
    kt_cover_hit(cov, in_vec ? "input vec" : "input scalar");
    kt_cover_hit(cov, cs_vec ? "LN column sums vec" : "LN column sums scalar");
    if (prev) kt_cover_hit(cov, pv_vec ? "prev column_sum vec" : "prev column_sum scalar");
    snprintf(out, cap, "fallback: input %s, LN column sums %s%s", in_vec ? "vec" : "scalar", cs_vec ? "vec" : "scalar",
             prev ? (pv_vec ? ", prev column_sum vec" : ", prev column_sum scalar") : "");
}

template <typename T>
static int kt_norm_backward_case(kt_ctx* k, kt_cover* cov, int N, int C, bool rms, bool prev, int accumulate,
                                 int mis_dres, int mis_w) {
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(4, N, C, rms * 4 + prev * 2 + accumulate)};
    kt_host<T> x, dy, w, d0;
    x.fill(n, &rng, 0.02, 1.7);
    dy.fill(n, &rng, 0.01, 1.0);
    w.fill(C, &rng, 0.1, 1.5);
    d0.fill(n, &rng, 0.01, 1.0);
    /* the forward's statistics, as it saves them (fp32; RMSNorm: mean 0) */
    std::vector<float> mean(N), rstd(N);
    for (int r = 0; r < N; r++) {
        double m = 0.0, var = 0.0;
        if (!rms) {
            for (int c = 0; c < C; c++) m += x.v[(int64_t)r * C + c];
            m /= C;
        }
        for (int c = 0; c < C; c++) var += (x.v[(int64_t)r * C + c] - m) * (x.v[(int64_t)r * C + c] - m);
        mean[r] = (float)m;
        rstd[r] = (float)(1.0 / sqrt(var / C + 1e-5));
    }
    /* accumulate = 1: the gradients already hold a micro-batch's sums */
    std::vector<float> old_w(C), old_b(C), old_p(C);
    for (int c = 0; c < C; c++) {
        old_w[c] = kt_signed(&rng, 0.1, 2.0);
        old_b[c] = kt_signed(&rng, 0.1, 2.0);
        old_p[c] = kt_signed(&rng, 0.1, 2.0);
    }
    T* dx = kt_alloc<T>(k, n);
    T* ddy = kt_alloc<T>(k, n);
    T* dw = kt_alloc<T>(k, C, mis_w);
    T* ddres = kt_alloc<T>(k, n, mis_dres);
    float* dmean = kt_alloc<float>(k, N);
    float* drstd = kt_alloc<float>(k, N);
    float* gw = kt_alloc<float>(k, C);
    float* gb = rms ? NULL : kt_alloc<float>(k, C);
    float* gp = prev ? kt_alloc<float>(k, C) : NULL;
    mt_colsum_scratch scratch;
    if (!kt_colsum_scratch(k, &scratch, C)) return 0;
    KT_ALLOCATED(k);
    char variant[160];
    kt_norm_backward_variant<T>(variant, sizeof(variant), cov, N, C, ddres, ddy, dx, dw, prev);
    kt_report rep;
    kt_report_begin(&rep, "norm_backward<%s> [%s] %s N=%d C=%d%s accumulate=%d%s%s", kt_fmt<T>::name, variant,
                    rms ? "RMSNorm" : "LayerNorm", N, C, prev ? " +prev bias" : "", accumulate,
                    mis_dres ? " (dresidual misaligned)" : "", mis_w ? " (weight misaligned)" : "");
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, ddy, dy.h));
    KT_CUDA(kt_put(k, dw, w.h));
    KT_CUDA(kt_put(k, ddres, d0.h));
    KT_CUDA(kt_put(k, dmean, mean));
    KT_CUDA(kt_put(k, drstd, rstd));
    float* dsts[3] = {gw, gb, gp};
    std::vector<float>* olds[3] = {&old_w, &old_b, &old_p};
    for (int i = 0; i < 3; i++)
        if (dsts[i]) {
            if (accumulate) KT_CUDA(kt_put(k, dsts[i], *olds[i]));
            else KT_CUDA(kt_poison(k, dsts[i], C));
        }
    norm_backward<T>(kt_exec(k, accumulate), &scratch, ddres, gw, gb, gp, ddy, dx, dw, dmean, drstd, N, C, rms);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> dres;
    std::vector<float> got_w, got_b, got_p;
    KT_CUDA(kt_get(k, dres, ddres, n));
    KT_CUDA(kt_get(k, got_w, gw, C));
    if (gb) KT_CUDA(kt_get(k, got_b, gb, C));
    if (gp) KT_CUDA(kt_get(k, got_p, gp, C));

    /* dresidual: d0 + rs (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - m) rs from the saved
     * fp32 statistics. The two means are warp sums over the row ((C/32 + 8) u_c of the mean of the
     * absolute terms); the update adds 6 roundings on its terms' magnitudes; then one rounding to T. */
    kt_check cd;
    kt_check_begin(&cd, "dresidual", C, 2 * us, 2 * us + 2 * (C / 32.0 + 16) * uc, kt_fmt<T>::tiny);
    std::vector<double> sw(C, 0.0), aw(C, 0.0), sb(C, 0.0), ab(C, 0.0), sp(C, 0.0), ap(C, 0.0);
    for (int r = 0; r < N; r++) {
        const int64_t base = (int64_t)r * C;
        const double m = mean[r], rs = rstd[r];
        double sg = 0.0, sgx = 0.0, ag = 0.0, agx = 0.0;
        for (int c = 0; c < C; c++) {
            const double g = dy.v[base + c] * w.v[c], xh = (x.v[base + c] - m) * rs;
            sg += g;
            sgx += g * xh;
            ag += fabs(g);
            agx += fabs(g * xh);
        }
        const double mg = rms ? 0.0 : sg / C, mgx = sgx / C;
        ag /= C;
        agx /= C;
        for (int c = 0; c < C; c++) {
            const double g = dy.v[base + c] * w.v[c], xh = (x.v[base + c] - m) * rs;
            const double ref = d0.v[base + c] + rs * (g - mg - xh * mgx);
            const double atol = 2.0 * (6 * uc * (fabs(d0.v[base + c]) + rs * (fabs(g) + fabs(mg) + fabs(xh * mgx))) +
                                       (C / 32.0 + 8) * uc * rs * (ag + fabs(xh) * agx));
            kt_check_add(&cd, base + c, kt_to<T>(dres[base + c]), ref, atol);
            sw[c] += dy.v[base + c] * xh;
            aw[c] += fabs(dy.v[base + c] * xh);
            sb[c] += dy.v[base + c];
            ab[c] += fabs(dy.v[base + c]);
            const double stored = kt_to<T>(dres[base + c]); /* dprev sums what was stored */
            sp[c] += stored;
            ap[c] += fabs(stored);
        }
    }
    kt_check_end(&cd, &rep);
    /* the column sums: fp32 chains of at most kt_sum_depth(N) additions, plus the terms' own rounding
     * (dy xhat: 3) and the add to the old value */
    const double D = kt_sum_depth(N) + 4;
    const char* names[3] = {"dweight", "dbias", "dprev_bias"};
    std::vector<double>* sums[3] = {&sw, &sb, &sp};
    std::vector<double>* abss[3] = {&aw, &ab, &ap};
    std::vector<float>* gots[3] = {&got_w, &got_b, &got_p};
    for (int i = 0; i < 3; i++) {
        if (!dsts[i]) continue;
        kt_check cc;
        kt_check_begin(&cc, names[i], 0, 0.0, -1.0, 0.0);
        for (int c = 0; c < C; c++) {
            const double old = accumulate ? (*olds[i])[c] : 0.0;
            kt_check_add(&cc, c, (*gots[i])[c], old + (*sums[i])[c], 2.0 * D * uc * ((*abss[i])[c] + fabs(old)));
        }
        kt_check_end(&cc, &rep);
    }
    return kt_report_end(&rep);
}

template <typename T>
static int kt_norm_backward_all(kt_ctx* k) {
    static const char* const variants[] = {
        "fused NJ=1", "fused NJ=2", "fused NJ=4", "fused, a tile per block", "fused, more tiles than blocks",
        "input vec", "input scalar", "LN column sums vec", "LN column sums scalar", "prev column_sum vec",
        "prev column_sum scalar"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 11);
    /* N, C, rms, prev, accumulate, misaligned dresidual, misaligned weight. bf16/fp16 (8 per vector):
     * fused NJ=1 up to C = 2048, NJ=2 to 4096, NJ=3 (6144) falls back, NJ=4 at 8192, 8200 falls back
     * with the 16-byte column sums (>= 1024 vectors); fp32 (4 per vector): NJ=2 at 2048, NJ=4 at 4096,
     * and 6144, 8192, 8200 fall back. Tile heights from 1 (C >= 4096 in fp32) to 32 (C = 64); N from one
     * tile to more tiles than the 256 blocks. */
    const struct { int N, C, rms, prev, acc, mis_dres, mis_w; } shapes[] = {
        {1, 64, 0, 1, 0, 0, 0},     {2000, 64, 1, 1, 1, 0, 0},  {3000, 768, 0, 1, 0, 0, 0},
        {1001, 384, 0, 1, 1, 0, 0}, {500, 2048, 1, 1, 0, 0, 0}, {600, 4096, 0, 1, 1, 0, 0},
        {260, 8192, 0, 0, 0, 0, 0}, {300, 6144, 0, 1, 0, 0, 0}, {64, 8200, 0, 1, 1, 0, 0},
        {1001, 770, 0, 1, 0, 0, 0}, {257, 768, 1, 1, 1, 0, 1}, {257, 768, 0, 1, 0, 1, 0},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_norm_backward_case<T>(k, &cov, s.N, s.C, s.rms, s.prev, s.acc, s.mis_dres, s.mis_w) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "norm_backward", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_norm_backward(void) { KT_FOR_TYPES(kt_norm_backward_all); }

/* The fused kernel's launcher at tile heights and block caps the heuristic does not pick (the lab
 * dev/cuda/fused_kernels.cu times them): 1-row tiles, one block walking every tile, row groups
 * (RG) from 1 to 32. The final sums as norm_backward launches them. bf16 only (the lab's type). */
static int kt_norm_backward_tiles_case(kt_ctx* k, int N, int C, int rows, int max_blocks) {
    typedef __nv_bfloat16 T;
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(5, N, C, rows * 4096 + max_blocks)};
    kt_host<T> x, dy, w, d0;
    x.fill(n, &rng, 0.02, 1.7);
    dy.fill(n, &rng, 0.01, 1.0);
    w.fill(C, &rng, 0.1, 1.5);
    d0.fill(n, &rng, 0.01, 1.0);
    std::vector<float> mean(N), rstd(N);
    for (int r = 0; r < N; r++) {
        double m = 0.0, var = 0.0;
        for (int c = 0; c < C; c++) m += x.v[(int64_t)r * C + c];
        m /= C;
        for (int c = 0; c < C; c++) var += (x.v[(int64_t)r * C + c] - m) * (x.v[(int64_t)r * C + c] - m);
        mean[r] = (float)m;
        rstd[r] = (float)(1.0 / sqrt(var / C + 1e-5));
    }
    T* dx = kt_alloc<T>(k, n);
    T* ddy = kt_alloc<T>(k, n);
    T* dw = kt_alloc<T>(k, C);
    T* ddres = kt_alloc<T>(k, n);
    float* dmean = kt_alloc<float>(k, N);
    float* drstd = kt_alloc<float>(k, N);
    const int tiles = ceil_div(N, rows), nb = tiles < max_blocks ? tiles : max_blocks;
    float* pa = kt_alloc<float>(k, (int64_t)nb * C);
    float* pb = kt_alloc<float>(k, (int64_t)nb * C);
    float* pc = kt_alloc<float>(k, (int64_t)nb * C);
    float* gw = kt_alloc<float>(k, C);
    float* gb = kt_alloc<float>(k, C);
    float* gp = kt_alloc<float>(k, C);
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "norm_backward_fused<bf16> [%d-row tiles, <= %d blocks: %d tiles on %d] LayerNorm N=%d C=%d",
                    rows, max_blocks, tiles, nb, N, C);
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, ddy, dy.h));
    KT_CUDA(kt_put(k, dw, w.h));
    KT_CUDA(kt_put(k, ddres, d0.h));
    KT_CUDA(kt_put(k, dmean, mean));
    KT_CUDA(kt_put(k, drstd, rstd));
    KT_CUDA(kt_poison(k, pa, (int64_t)nb * C));
    KT_CUDA(kt_poison(k, pb, (int64_t)nb * C));
    KT_CUDA(kt_poison(k, pc, (int64_t)nb * C));
    KT_CUDA(kt_poison(k, gw, C));
    KT_CUDA(kt_poison(k, gb, C));
    KT_CUDA(kt_poison(k, gp, C));
    const int blocks = norm_backward_fused<T>(kt_exec(k, 0), ceil_div(C / 8, 256), rows, max_blocks, ddres, pa, pb, pc,
                                              ddy, dx, dw, dmean, drstd, N, C, false);
    column_final_sums(kt_exec(k, 0), 3, blocks, C, gw, pa, gb, pb, gp, pc);
    if (!kt_sync(k, rep.label)) return 0;
    if (blocks != nb) {
        printf("    FAIL %s: the launcher returned %d blocks, expected %d\n", rep.label, blocks, nb);
        return 0;
    }
    std::vector<T> dres;
    std::vector<float> got_w, got_b, got_p;
    KT_CUDA(kt_get(k, dres, ddres, n));
    KT_CUDA(kt_get(k, got_w, gw, C));
    KT_CUDA(kt_get(k, got_b, gb, C));
    KT_CUDA(kt_get(k, got_p, gp, C));
    kt_check cd;
    kt_check_begin(&cd, "dresidual", C, 2 * us, 2 * us + 2 * (C / 32.0 + 16) * uc, kt_fmt<T>::tiny);
    std::vector<double> sw(C, 0.0), aw(C, 0.0), sb(C, 0.0), ab(C, 0.0), sp(C, 0.0), ap(C, 0.0);
    for (int r = 0; r < N; r++) {
        const int64_t base = (int64_t)r * C;
        const double m = mean[r], rs = rstd[r];
        double sg = 0.0, sgx = 0.0, ag = 0.0, agx = 0.0;
        for (int c = 0; c < C; c++) {
            const double g = dy.v[base + c] * w.v[c], xh = (x.v[base + c] - m) * rs;
            sg += g;
            sgx += g * xh;
            ag += fabs(g);
            agx += fabs(g * xh);
        }
        const double mg = sg / C, mgx = sgx / C;
        ag /= C;
        agx /= C;
        for (int c = 0; c < C; c++) {
            const double g = dy.v[base + c] * w.v[c], xh = (x.v[base + c] - m) * rs;
            const double ref = d0.v[base + c] + rs * (g - mg - xh * mgx);
            const double atol = 2.0 * (6 * uc * (fabs(d0.v[base + c]) + rs * (fabs(g) + fabs(mg) + fabs(xh * mgx))) +
                                       (C / 32.0 + 8) * uc * rs * (ag + fabs(xh) * agx));
            kt_check_add(&cd, base + c, kt_to<T>(dres[base + c]), ref, atol);
            sw[c] += dy.v[base + c] * xh;
            aw[c] += fabs(dy.v[base + c] * xh);
            sb[c] += dy.v[base + c];
            ab[c] += fabs(dy.v[base + c]);
            sp[c] += kt_to<T>(dres[base + c]);
            ap[c] += fabs((double)kt_to<T>(dres[base + c]));
        }
    }
    kt_check_end(&cd, &rep);
    /* with one block, a block's chain is N additions long */
    const double D = (double)((tiles + nb - 1) / nb) * rows + 64 + 32 + 4;
    const char* names[3] = {"dweight", "dbias", "dprev_bias"};
    std::vector<double>* sums[3] = {&sw, &sb, &sp};
    std::vector<double>* abss[3] = {&aw, &ab, &ap};
    std::vector<float>* gots[3] = {&got_w, &got_b, &got_p};
    for (int i = 0; i < 3; i++) {
        kt_check cc;
        kt_check_begin(&cc, names[i], 0, 0.0, -1.0, 0.0);
        for (int c = 0; c < C; c++) kt_check_add(&cc, c, (*gots[i])[c], (*sums[i])[c], 2.0 * D * uc * (*abss[i])[c]);
        kt_check_end(&cc, &rep);
    }
    return kt_report_end(&rep);
}
static test_result test_kernels_norm_backward_tiles(void) {
    REQUIRE_GPU();
    kt_ctx k;
    if (!kt_ctx_init(&k)) return TEST_FAIL;
    /* (N, C, tile rows, block cap): C = 256 bf16 is 32 vectors per row, so RG = min(8, rows) row groups */
    const struct { int N, C, rows, cap; } cases[] = {
        {1000, 256, 1, 1}, {1000, 256, 3, 7}, {1000, 256, 32, 1024}, {777, 768, 5, 64}, {100, 2048, 2, 3},
    };
    int ok = 1;
    for (const auto& c : cases) {
        ok = kt_norm_backward_tiles_case(&k, c.N, c.C, c.rows, c.cap) && ok;
        kt_release(&k);
    }
    kt_ctx_free(&k);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* ============================================================================================== */
/* 5. column_sum: bias gradients, db[c] (+)= sum over rows, in ceil(N/256)-row chunks then in order */
/* ============================================================================================== */

template <typename T>
static int kt_column_sum_case(kt_ctx* k, kt_cover* cov, int N, int C, int accumulate, int misalign) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    const double uc = KT_UC;
    kt_rng rng = {kt_seed(6, N, C, accumulate * 2 + misalign)};
    kt_host<T> dy;
    dy.fill(n, &rng, 0.01, 1.0);
    std::vector<float> old(C);
    for (int c = 0; c < C; c++) old[c] = kt_signed(&rng, 0.1, 2.0);
    T* ddy = kt_alloc<T>(k, n, misalign);
    float* dst = kt_alloc<float>(k, C);
    mt_colsum_scratch s;
    if (!kt_colsum_scratch(k, &s, C)) return 0;
    KT_ALLOCATED(k);
    int rows, chunks = colsum_chunks(N, s.max_chunks, &rows);
    const bool vec = C % V == 0 && aligned16(ddy);
    kt_cover_hit(cov, vec ? "vec" : "scalar");
    kt_cover_hit(cov, rows == 1 ? "one row per chunk" : "several rows per chunk");
    kt_report rep;
    kt_report_begin(&rep, "column_sum<%s> [%s, %d chunks of %d rows] N=%d C=%d accumulate=%d%s", kt_fmt<T>::name,
                    vec ? "vec" : "scalar", chunks, rows, N, C, accumulate, misalign ? " (dy misaligned)" : "");
    KT_CUDA(kt_put(k, ddy, dy.h));
    if (accumulate) KT_CUDA(kt_put(k, dst, old));
    else KT_CUDA(kt_poison(k, dst, C));
    column_sum<T>(kt_exec(k, accumulate), &s, dst, ddy, N, C);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> got;
    KT_CUDA(kt_get(k, got, dst, C));
    std::vector<double> sum(C, 0.0), abs_sum(C, 0.0);
    for (int64_t i = 0; i < n; i++) {
        sum[i % C] += dy.v[i];
        abs_sum[i % C] += fabs(dy.v[i]);
    }
    /* exact terms (T -> fp32 is exact): depth ceil(N/256) + 32 additions, and the add to the old value */
    const double D = (double)rows + 32 + 1;
    kt_check cc;
    kt_check_begin(&cc, "dbias", 0, 0.0, -1.0, 0.0);
    for (int c = 0; c < C; c++) {
        const double o = accumulate ? old[c] : 0.0;
        kt_check_add(&cc, c, got[c], o + sum[c], 2.0 * D * uc * (abs_sum[c] + fabs(o)));
    }
    kt_check_end(&cc, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_column_sum_all(kt_ctx* k) {
    static const char* const variants[] = {"vec", "scalar", "one row per chunk", "several rows per chunk"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 4);
    const struct { int N, C, acc, mis; } shapes[] = {
        {1, 64, 0, 0},     {100, 768, 1, 0},  {3001, 3072, 0, 0}, {513, 2304, 1, 0},
        {1001, 770, 0, 0}, {257, 768, 1, 1},  {4096, 64, 1, 0},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_column_sum_case<T>(k, &cov, s.N, s.C, s.acc, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "column_sum", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_column_sum(void) { KT_FOR_TYPES(kt_column_sum_all); }

/* ============================================================================================== */
/* 6. Bias + activation (bias_activation: GELU, squared ReLU), their backward, linear_forward's    */
/*    bias add                                                                                    */
/* ============================================================================================== */

static double kt_gelu(double x) {
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
static double kt_gelu_grad(double x) {
    const double k = 0.7978845608028654, th = tanh(k * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + th) + 0.5 * x * k * (1.0 + 3.0 * 0.044715 * x * x) * (1.0 - th * th);
}
/* Absolute error bounds of the kernels' fp32 GELU and GELU' at x: tanhf within 2 ulp (2 u_c, |th| < 1)
 * of a tanh whose argument a carries 4 roundings (error 4 u_c |a| (1 - th^2) after tanh); then the
 * few products and sums of each formula. (1 - th^2) and 1 + th may cancel: the bounds are absolute. */
static void kt_gelu_bounds(double x, double* e_gelu, double* e_grad) {
    const double k = 0.7978845608028654, uc = KT_UC;
    const double a = k * (x + 0.044715 * x * x * x), th = tanh(a);
    const double eth = 4 * uc * fabs(a) * (1 - th * th) + 2 * uc;
    *e_gelu = 0.5 * fabs(x) * (eth + uc * (1 + fabs(th))) + 2 * uc * fabs(kt_gelu(x));
    const double poly = k * (1 + 3 * 0.044715 * x * x), dt = poly * (1 - th * th);
    const double edt = poly * (2 * fabs(th) * eth + 2 * uc) + 3 * uc * fabs(dt);
    *e_grad = 0.5 * eth + 0.5 * fabs(x) * edt + 4 * uc * (fabs(kt_gelu_grad(x)) + 1);
}

/* The reference activation and its derivative, and the kernels' absolute error bounds at x (fp32):
 * GELU's above; squared ReLU's relu(x)^2 is one fp32 product (uc |ref|) and 2 relu(x) exact. */
static double kt_act(int act, double x) { return act == ACT_SQUARED_RELU ? (x > 0 ? x * x : 0.0) : kt_gelu(x); }
static double kt_act_grad(int act, double x) { return act == ACT_SQUARED_RELU ? (x > 0 ? 2 * x : 0.0) : kt_gelu_grad(x); }
static void kt_act_bounds(int act, double x, double* e_act, double* e_grad) {
    if (act == ACT_SQUARED_RELU) {
        *e_act = KT_UC * kt_act(act, x);
        *e_grad = 0.0;
        return;
    }
    kt_gelu_bounds(x, e_act, e_grad);
}
static const char* kt_act_name(int act) { return act == ACT_SQUARED_RELU ? "squared_relu" : "gelu"; }

template <typename T>
static int kt_bias_gelu_case(kt_ctx* k, kt_cover* cov, int act_kind, int N, int C, bool has_bias, int mis_act) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(7 + 100 * act_kind, N, C, has_bias * 2 + mis_act)};
    kt_host<T> y, b;
    y.fill(n, &rng, 0.01, 4.0);
    if (has_bias) b.fill(C, &rng, 0.01, 0.5);
    T* dpre = kt_alloc<T>(k, n);
    T* dact = kt_alloc<T>(k, n, mis_act);
    T* dbias = has_bias ? kt_alloc<T>(k, C) : NULL;
    KT_ALLOCATED(k);
    const bool vec = C % V == 0 && aligned16(dpre) && aligned16(dact) && aligned16(dbias);
    const char* variant = vec ? "vec" : has_bias ? "scalar: bias_add + activation_forward" : "scalar: activation_forward";
    kt_cover_hit(cov, variant);
    kt_report rep;
    kt_report_begin(&rep, "bias_activation %s<%s> [%s] N=%d C=%d%s%s", kt_act_name(act_kind), kt_fmt<T>::name, variant, N,
                    C, has_bias ? " bias" : " no bias", mis_act ? " (act misaligned)" : "");
    KT_CUDA(kt_put(k, dpre, y.h));
    if (dbias) KT_CUDA(kt_put(k, dbias, b.h));
    KT_CUDA(kt_poison(k, dact, n));
    bias_activation<T>(kt_exec(k, 0), act_kind, dpre, dact, dbias, N, C);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> pre, act;
    KT_CUDA(kt_get(k, pre, dpre, n));
    KT_CUDA(kt_get(k, act, dact, n));
    /* pre = y + b: one fp32 addition, one rounding to T (without a bias: unchanged); act = the activation
     * of the stored pre (what the backward reads), one rounding to T */
    kt_check cp, ca;
    kt_check_begin(&cp, "pre", C, 2 * (us + uc), 2 * (us + uc), kt_fmt<T>::tiny);
    kt_check_begin(&ca, "act", C, 2 * us, 2 * us + 32 * uc, kt_fmt<T>::tiny);
    for (int64_t i = 0; i < n; i++) {
        const double x = kt_to<T>(pre[i]);
        kt_check_add(&cp, i, x, y.v[i] + (has_bias ? b.v[i % C] : 0.0), 0.0);
        double eg, ed;
        kt_act_bounds(act_kind, x, &eg, &ed);
        kt_check_add(&ca, i, kt_to<T>(act[i]), kt_act(act_kind, x), 2 * eg);
    }
    kt_check_end(&cp, &rep);
    kt_check_end(&ca, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_bias_activation_all(kt_ctx* k, int act_kind) {
    static const char* const variants[] = {"vec", "scalar: bias_add + activation_forward", "scalar: activation_forward"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 3);
    const struct { int N, C, bias, mis; } shapes[] = {
        {1, 64, 1, 0}, {1001, 3072, 1, 0}, {257, 3072, 0, 0}, {1001, 770, 1, 0}, {257, 768, 1, 1}, {65, 770, 0, 0},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_bias_gelu_case<T>(k, &cov, act_kind, s.N, s.C, s.bias, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, act_kind == ACT_SQUARED_RELU ? "bias_activation squared_relu" : "bias_activation gelu",
                          kt_fmt<T>::name) && ok;
}
template <typename T>
static int kt_bias_gelu_all(kt_ctx* k) { return kt_bias_activation_all<T>(k, ACT_GELU); }
template <typename T>
static int kt_bias_squared_relu_all(kt_ctx* k) { return kt_bias_activation_all<T>(k, ACT_SQUARED_RELU); }
static test_result test_kernels_bias_gelu(void) { KT_FOR_TYPES(kt_bias_gelu_all); }
static test_result test_kernels_bias_squared_relu(void) { KT_FOR_TYPES(kt_bias_squared_relu_all); }

template <typename T>
static int kt_gelu_backward_case(kt_ctx* k, kt_cover* cov, int act_kind, int64_t n, int mis_d) {
    constexpr int V = vec16<T>::N;
    const double us = kt_fmt<T>::u;
    kt_rng rng = {kt_seed(8 + 100 * act_kind, (int)(n >> 20), (int)(n & 0xFFFFF), mis_d)};
    kt_host<T> d0, x;
    d0.fill(n, &rng, 0.01, 1.0);
    x.fill(n, &rng, 0.01, 4.0);
    T* dd = kt_alloc<T>(k, n, mis_d);
    T* dx = kt_alloc<T>(k, n);
    KT_ALLOCATED(k);
    const bool vec = n % V == 0 && aligned16(dd) && aligned16(dx);
    kt_cover_hit(cov, vec ? "vec" : "scalar");
    kt_report rep;
    kt_report_begin(&rep, "activation_backward %s<%s> [%s] n=%lld%s", kt_act_name(act_kind), kt_fmt<T>::name,
                    vec ? "vec" : "scalar", (long long)n, mis_d ? " (d misaligned)" : "");
    KT_CUDA(kt_put(k, dd, d0.h));
    KT_CUDA(kt_put(k, dx, x.h));
    activation_backward<T>(kt_exec(k, 0), act_kind, dd, dx, n);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> d;
    KT_CUDA(kt_get(k, d, dd, n));
    /* in place: d = d0 * act'(x), act' to its fp32 bound, the product one more rounding, then T */
    kt_check cd;
    kt_check_begin(&cd, "d", 0, 2 * us, 2 * us + 32 * KT_UC, kt_fmt<T>::tiny);
    for (int64_t i = 0; i < n; i++) {
        double eg, ed;
        kt_act_bounds(act_kind, x.v[i], &eg, &ed);
        const double ref = d0.v[i] * kt_act_grad(act_kind, x.v[i]);
        kt_check_add(&cd, i, kt_to<T>(d[i]), ref, 2 * (fabs(d0.v[i]) * ed + KT_UC * fabs(ref)));
    }
    kt_check_end(&cd, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_activation_backward_all(kt_ctx* k, int act_kind) {
    static const char* const variants[] = {"vec", "scalar"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    /* one vector; a [1001, 3072] activation; an odd length; a misaligned gradient */
    const struct { int64_t n; int mis; } shapes[] = {{8, 0}, {1001 * 3072, 0}, {1001 * 770 + 1, 0}, {257 * 768, 1}};
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_gelu_backward_case<T>(k, &cov, act_kind, s.n, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, act_kind == ACT_SQUARED_RELU ? "activation_backward squared_relu"
                                                             : "activation_backward gelu", kt_fmt<T>::name) && ok;
}
template <typename T>
static int kt_gelu_backward_all(kt_ctx* k) { return kt_activation_backward_all<T>(k, ACT_GELU); }
template <typename T>
static int kt_squared_relu_backward_all(kt_ctx* k) { return kt_activation_backward_all<T>(k, ACT_SQUARED_RELU); }
static test_result test_kernels_gelu_backward(void) { KT_FOR_TYPES(kt_gelu_backward_all); }
static test_result test_kernels_squared_relu_backward(void) { KT_FOR_TYPES(kt_squared_relu_backward_all); }

template <typename T>
static int kt_linear_bias_case(kt_ctx* k, kt_cover* cov, int N, int C, int mis_y) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * C;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(9, N, C, mis_y)};
    kt_host<T> y, b;
    y.fill(n, &rng, 0.01, 3.0);
    b.fill(C, &rng, 0.01, 0.5);
    T* dy = kt_alloc<T>(k, n, mis_y);
    T* db = kt_alloc<T>(k, C);
    KT_ALLOCATED(k);
    const bool vec = C % V == 0 && aligned16(dy) && aligned16(db);
    kt_cover_hit(cov, vec ? "vec" : "scalar");
    kt_report rep;
    kt_report_begin(&rep, "linear_forward bias add<%s> [%s] N=%d C=%d%s", kt_fmt<T>::name, vec ? "vec" : "scalar", N, C,
                    mis_y ? " (y misaligned)" : "");
    KT_CUDA(kt_put(k, dy, y.h));
    KT_CUDA(kt_put(k, db, b.h));
    kt_linear_bias_add<T>(k, dy, db, N, C);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out;
    KT_CUDA(kt_get(k, out, dy, n));
    /* one fp32 addition (correctly rounded) and one rounding to T */
    kt_check cy;
    kt_check_begin(&cy, "y", C, 2 * (us + uc), 2 * (us + uc), kt_fmt<T>::tiny);
    for (int64_t i = 0; i < n; i++) kt_check_add(&cy, i, kt_to<T>(out[i]), y.v[i] + b.v[i % C], 0.0);
    kt_check_end(&cy, &rep);
    return kt_report_end(&rep);
}
template <typename T>
static int kt_linear_bias_all(kt_ctx* k) {
    static const char* const variants[] = {"vec", "scalar"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    const struct { int N, C, mis; } shapes[] = {{1, 64, 0}, {1001, 2304, 0}, {1001, 770, 0}, {257, 768, 1}};
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_linear_bias_case<T>(k, &cov, s.N, s.C, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "linear_forward bias add", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_linear_bias_add(void) { KT_FOR_TYPES(kt_linear_bias_all); }

/* ============================================================================================== */
/* 7. SwiGLU: pre [N, 2f] = [gate | up] (+ bias, stored back), act = silu(gate) * up; backward      */
/* ============================================================================================== */

template <typename T>
static int kt_swiglu_case(kt_ctx* k, kt_cover* cov, int N, int f, bool has_bias, int mis) {
    constexpr int V = vec16<T>::N;
    const int64_t n = (int64_t)N * f;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(10, N, f, has_bias * 2 + mis)};
    kt_host<T> pre0, b, dact;
    pre0.fill(2 * n, &rng, 0.01, 4.0);
    if (has_bias) b.fill(2 * f, &rng, 0.01, 0.5);
    dact.fill(n, &rng, 0.01, 1.0);
    T* dpre = kt_alloc<T>(k, 2 * n);
    T* dact_out = kt_alloc<T>(k, n, mis); /* forward output */
    T* dbias = has_bias ? kt_alloc<T>(k, 2 * f) : NULL;
    T* ddact = kt_alloc<T>(k, n);
    T* ddpre = kt_alloc<T>(k, 2 * n, mis); /* backward output */
    KT_ALLOCATED(k);
    const bool fvec = f % V == 0 && aligned16(dpre) && aligned16(dact_out) && aligned16(dbias);
    const bool bvec = f % V == 0 && aligned16(ddpre) && aligned16(ddact) && aligned16(dpre);
    kt_cover_hit(cov, fvec ? "forward vec" : "forward scalar");
    kt_cover_hit(cov, bvec ? "backward vec" : "backward scalar");
    kt_report rep;
    kt_report_begin(&rep, "bias_swiglu + swiglu_backward<%s> [forward %s, backward %s] N=%d f=%d%s%s", kt_fmt<T>::name,
                    fvec ? "vec" : "scalar", bvec ? "vec" : "scalar", N, f, has_bias ? " bias" : " no bias",
                    mis ? " (outputs misaligned)" : "");
    KT_CUDA(kt_put(k, dpre, pre0.h));
    if (dbias) KT_CUDA(kt_put(k, dbias, b.h));
    KT_CUDA(kt_put(k, ddact, dact.h));
    KT_CUDA(kt_poison(k, dact_out, n));
    KT_CUDA(kt_poison(k, ddpre, 2 * n));
    bias_swiglu<T>(kt_exec(k, 0), dpre, dact_out, dbias, N, f);
    swiglu_backward<T>(kt_exec(k, 0), ddpre, ddact, dpre, N, f);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> pre, act, dpre_out;
    KT_CUDA(kt_get(k, pre, dpre, 2 * n));
    KT_CUDA(kt_get(k, act, dact_out, n));
    KT_CUDA(kt_get(k, dpre_out, ddpre, 2 * n));
    /* pre (+ bias): one fp32 add, one rounding. act = silu(g) u from the stored pre: expf (2 ulp), the
     * add, the division and the product, 6 u_c relative with no cancellation, then T. The backward:
     * s = sigmoid(g) to 4 u_c, dgate = d u s (1 + g (1 - s)) whose last factor cancels near
     * g = -1.28 (absolute bound), dup = d g s to 8 u_c relative. */
    kt_check cp, ca, cg, cu;
    kt_check_begin(&cp, "pre", 2 * f, 2 * (us + uc), 2 * (us + uc), kt_fmt<T>::tiny);
    kt_check_begin(&ca, "act", f, 2 * us + 12 * uc, 2 * us + 12 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cg, "dgate", f, 2 * us, 2 * us + 32 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cu, "dup", f, 2 * us + 16 * uc, 2 * us + 16 * uc, kt_fmt<T>::tiny);
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = i / f, col = i % f, gi = row * 2 * f + col, ui = gi + f;
        kt_check_add(&cp, gi, kt_to<T>(pre[gi]), pre0.v[gi] + (has_bias ? b.v[col] : 0.0), 0.0);
        kt_check_add(&cp, ui, kt_to<T>(pre[ui]), pre0.v[ui] + (has_bias ? b.v[f + col] : 0.0), 0.0);
        const double g = kt_to<T>(pre[gi]), u = kt_to<T>(pre[ui]), s = 1.0 / (1.0 + exp(-g)), d = dact.v[i];
        kt_check_add(&ca, i, kt_to<T>(act[i]), g * s * u, 0.0);
        const double dg = d * u * s * (1.0 + g * (1.0 - s));
        const double e_dg = fabs(d * u * s) * (fabs(g) * (4 * uc * s + 3 * uc) + uc * (1 + fabs(g * (1 - s)))) + 8 * uc * fabs(dg);
        kt_check_add(&cg, gi, kt_to<T>(dpre_out[gi]), dg, 2 * e_dg);
        kt_check_add(&cu, ui, kt_to<T>(dpre_out[ui]), d * g * s, 0.0);
    }
    kt_check_end(&cp, &rep);
    kt_check_end(&ca, &rep);
    kt_check_end(&cg, &rep);
    kt_check_end(&cu, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_swiglu_all(kt_ctx* k) {
    static const char* const variants[] = {"forward vec", "forward scalar", "backward vec", "backward scalar"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 4);
    const struct { int N, f, bias, mis; } shapes[] = {
        {1, 64, 0, 0}, {1001, 3072, 0, 0}, {257, 768, 1, 0}, {1001, 770, 1, 0}, {65, 768, 0, 1},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_swiglu_case<T>(k, &cov, s.N, s.f, s.bias, s.mis) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "swiglu", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_swiglu(void) { KT_FOR_TYPES(kt_swiglu_all); }

/* ============================================================================================== */
/* 8. Attention layouts: the QKV split (+ RoPE) and the gradient merge of the exact path, the head    */
/*    permutes, RoPE in place on the QKV rows (flash path). Megatron's grouped QKV row: per group,     */
/*    qpg query heads, then k, then v.                                                              */
/* ============================================================================================== */

typedef struct {
    int B, S, heads, groups, d, rot;
} kt_attn;

static int64_t kt_heads_dest(int slot, int qpg, int g, int b, int t, int e, int S, int heads, int groups, int d) {
    if (slot < qpg) return (((int64_t)b * heads + g * qpg + slot) * S + t) * d + e;
    return (((int64_t)b * groups + g) * S + t) * d + e;
}

/* The launchers' geometry, with RoPE tables [S, rot/2] built as create_rope_tables builds them
 * (without Llama-3.1's scaling): w_i = base^(-2i/rot) in fp32, angle t w_i in fp32, its cos and sin
 * rounded to fp32; the reference uses the same fp32 values. */
static int kt_attention_dims(kt_ctx* k, const kt_attn* a, mt_attention_dims* dims, std::vector<float>& cs,
                             std::vector<float>& sn) {
    memset(dims, 0, sizeof(*dims));
    dims->B = a->B;
    dims->S = a->S;
    dims->heads = a->heads;
    dims->groups = a->groups;
    dims->d = a->d;
    dims->rot = a->rot;
    if (!a->rot) return 1;
    const int half = a->rot / 2;
    const int64_t n = (int64_t)a->S * half;
    cs.resize((size_t)n);
    sn.resize((size_t)n);
    for (int i = 0; i < half; i++) {
        const float w = (float)(1.0 / pow(10000.0, 2.0 * i / a->rot));
        for (int t = 0; t < a->S; t++) {
            const float angle = (float)t * w;
            cs[(size_t)t * half + i] = (float)cos((double)angle);
            sn[(size_t)t * half + i] = (float)sin((double)angle);
        }
    }
    float* dcs = kt_alloc<float>(k, n);
    float* dsn = kt_alloc<float>(k, n);
    KT_ALLOCATED(k);
    KT_CUDA(kt_put(k, dcs, cs));
    KT_CUDA(kt_put(k, dsn, sn));
    dims->rope_cos = dcs;
    dims->rope_sin = dsn;
    return 1;
}

template <typename T>
static int kt_qkv_case(kt_ctx* k, kt_cover* cov, const kt_attn* a) {
    constexpr int V = vec16<T>::N;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    const int qpg = a->heads / a->groups, d = a->d, rot = a->rot, half = rot / 2, S = a->S;
    const int width = a->groups * (qpg + 2) * d;
    const int64_t BT = (int64_t)a->B * S, n = BT * width, nq = (int64_t)a->B * a->heads * S * d,
                  nkv = (int64_t)a->B * a->groups * S * d;
    kt_rng rng = {kt_seed(11, S, a->heads * 256 + a->groups, d * 1024 + rot)};
    kt_host<T> qkv, dq, dk, dv;
    qkv.fill(n, &rng, 0.02, 2.0);
    dq.fill(nq, &rng, 0.02, 2.0);
    dk.fill(nkv, &rng, 0.02, 2.0);
    dv.fill(nkv, &rng, 0.02, 2.0);
    T* dqkv = kt_alloc<T>(k, n);
    T* dgrad = kt_alloc<T>(k, n);
    T* dqq = kt_alloc<T>(k, nq);
    T* dq_out = kt_alloc<T>(k, nq);
    T* dk_out = kt_alloc<T>(k, nkv);
    T* dv_out = kt_alloc<T>(k, nkv);
    T* ddk = kt_alloc<T>(k, nkv);
    T* ddv = kt_alloc<T>(k, nkv);
    KT_ALLOCATED(k);
    std::vector<float> cs, sn;
    mt_attention_dims dims;
    if (!kt_attention_dims(k, a, &dims, cs, sn)) return 0;
    const bool vec = d % V == 0 && (rot == 0 || half % V == 0); /* qkv_permute_vectorised */
    kt_cover_hit(cov, vec ? "split/merge vec" : "split/merge scalar");
    kt_report rep;
    kt_report_begin(&rep, "split_qkv + merge_qkv_grads<%s> [%s] B=%d T=%d heads=%d groups=%d d=%d rot=%d",
                    kt_fmt<T>::name, vec ? "vec" : "scalar", a->B, S, a->heads, a->groups, d, rot);
    KT_CUDA(kt_put(k, dqkv, qkv.h));
    KT_CUDA(kt_put(k, dqq, dq.h));
    KT_CUDA(kt_put(k, ddk, dk.h));
    KT_CUDA(kt_put(k, ddv, dv.h));
    KT_CUDA(kt_poison(k, dq_out, nq));
    KT_CUDA(kt_poison(k, dk_out, nkv));
    KT_CUDA(kt_poison(k, dv_out, nkv));
    KT_CUDA(kt_poison(k, dgrad, n));
    split_qkv<T>(kt_exec(k, 0), dims, dq_out, dk_out, dv_out, dqkv);
    merge_qkv_grads<T>(kt_exec(k, 0), dims, dgrad, dqq, ddk, ddv);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> q, kk, v, grad;
    KT_CUDA(kt_get(k, q, dq_out, nq));
    KT_CUDA(kt_get(k, kk, dk_out, nkv));
    KT_CUDA(kt_get(k, v, dv_out, nkv));
    KT_CUDA(kt_get(k, grad, dgrad, n));
    /* moved channels: bitwise; rotated ones: x c -+ x' s in fp32 (2 roundings on |x c| + |x' s|), one
     * rounding to T. Every q, k, v element is the destination of exactly one qkv element, so walking
     * qkv visits (and checks the poison is gone from) all of them. */
    kt_check cq, cm, cg, cr;
    kt_check_begin(&cq, "split moved", width, 0.0, 0.0, 0.0);
    kt_check_begin(&cr, "split rotated", width, 2 * us, 2 * us + 16 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cm, "merge moved", width, 0.0, 0.0, 0.0);
    kt_check_begin(&cg, "merge rotated", width, 2 * us, 2 * us + 16 * uc, kt_fmt<T>::tiny);
    for (int64_t bt = 0; bt < BT; bt++) {
        const int b = (int)(bt / S), tt = (int)(bt % S);
        for (int col = 0; col < width; col++) {
            const int g = col / ((qpg + 2) * d), slot = (col / d) % (qpg + 2), e = col % d;
            const int64_t i = bt * width + col, at = kt_heads_dest(slot, qpg, g, b, tt, e, S, a->heads, a->groups, d);
            const std::vector<T>& dst = slot < qpg ? q : slot == qpg ? kk : v;
            const kt_host<T>& src = slot < qpg ? dq : slot == qpg ? dk : dv;
            if (slot <= qpg && e < rot) {
                const double c = cs[(int64_t)tt * half + e % half], s = sn[(int64_t)tt * half + e % half];
                const double x = qkv.v[i], p = e < half ? qkv.v[i + half] : qkv.v[i - half];
                const double y = e < half ? x * c - p * s : x * c + p * s;
                kt_check_add(&cr, i, kt_to<T>(dst[at]), y, 4 * uc * (fabs(x * c) + fabs(p * s)));
                const double gx = src.v[at], gp = e < half ? src.v[at + half] : src.v[at - half];
                const double gy = e < half ? gx * c + gp * s : gx * c - gp * s; /* the transpose */
                kt_check_add(&cg, i, kt_to<T>(grad[i]), gy, 4 * uc * (fabs(gx * c) + fabs(gp * s)));
            } else {
                kt_check_add(&cq, i, kt_to<T>(dst[at]), qkv.v[i], 0.0);
                kt_check_add(&cm, i, kt_to<T>(grad[i]), src.v[at], 0.0);
            }
        }
    }
    kt_check_end(&cq, &rep);
    kt_check_end(&cm, &rep);
    if (rot) {
        kt_check_end(&cr, &rep);
        kt_check_end(&cg, &rep);
    }
    return kt_report_end(&rep);
}

template <typename T>
static int kt_permute_case(kt_ctx* k, kt_cover* cov, const kt_attn* a) {
    constexpr int V = vec16<T>::N;
    const int d = a->d, S = a->S, H = a->heads;
    const int64_t n = (int64_t)a->B * H * S * d;
    mt_attention_dims dims;
    std::vector<float> cs, sn;
    kt_attn plain = *a;
    plain.rot = 0;
    if (!kt_attention_dims(k, &plain, &dims, cs, sn)) return 0;
    kt_rng rng = {kt_seed(12, S, H, d)};
    kt_host<T> heads, rows;
    heads.fill(n, &rng, 0.02, 2.0);
    rows.fill(n, &rng, 0.02, 2.0);
    T* dheads = kt_alloc<T>(k, n);
    T* drows = kt_alloc<T>(k, n);
    T* dout_rows = kt_alloc<T>(k, n);
    T* dout_heads = kt_alloc<T>(k, n);
    KT_ALLOCATED(k);
    const bool vec = d % V == 0;
    kt_cover_hit(cov, vec ? "permute vec" : "permute scalar");
    kt_report rep;
    kt_report_begin(&rep, "permute_heads<%s> [%s] both ways, B=%d T=%d heads=%d d=%d", kt_fmt<T>::name,
                    vec ? "vec" : "scalar", a->B, S, H, d);
    KT_CUDA(kt_put(k, dheads, heads.h));
    KT_CUDA(kt_put(k, drows, rows.h));
    KT_CUDA(kt_poison(k, dout_rows, n));
    KT_CUDA(kt_poison(k, dout_heads, n));
    permute_heads<T>(kt_exec(k, 0), dims, dout_rows, dheads, true);
    permute_heads<T>(kt_exec(k, 0), dims, dout_heads, drows, false);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out_rows, out_heads;
    KT_CUDA(kt_get(k, out_rows, dout_rows, n));
    KT_CUDA(kt_get(k, out_heads, dout_heads, n));
    /* pure data movement: bitwise */
    kt_check ct, cf;
    kt_check_begin(&ct, "to rows", (int64_t)H * d, 0.0, 0.0, 0.0);
    kt_check_begin(&cf, "to heads", d, 0.0, 0.0, 0.0);
    for (int64_t i = 0; i < n; i++) { /* i indexes [B*T, H*d] rows */
        const int e = (int)(i % d), h = (int)((i / d) % H);
        const int64_t bt = i / ((int64_t)d * H), b = bt / S, tt = bt % S;
        const int64_t other = ((b * H + h) * S + tt) * d + e;
        kt_check_add(&ct, i, kt_to<T>(out_rows[i]), heads.v[other], 0.0);
        kt_check_add(&cf, other, kt_to<T>(out_heads[other]), rows.v[i], 0.0);
    }
    kt_check_end(&ct, &rep);
    kt_check_end(&cf, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_rope_rows_case(kt_ctx* k, kt_cover* cov, const kt_attn* a, bool backward) {
    constexpr int V = vec16<T>::N;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    const int qpg = a->heads / a->groups, d = a->d, rot = a->rot, half = rot / 2, S = a->S;
    const int width = a->groups * (qpg + 2) * d;
    const int64_t BT = (int64_t)a->B * S, n = BT * width;
    kt_rng rng = {kt_seed(13, S, a->heads * 256 + a->groups, d * 1024 + rot * 2 + backward)};
    kt_host<T> qkv;
    qkv.fill(n, &rng, 0.02, 2.0);
    T* dqkv = kt_alloc<T>(k, n);
    KT_ALLOCATED(k);
    std::vector<float> cs, sn;
    mt_attention_dims dims;
    if (!kt_attention_dims(k, a, &dims, cs, sn)) return 0;
    const bool vec = half % V == 0;
    kt_cover_hit(cov, vec ? "rope rows V=16 bytes" : "rope rows V=1");
    kt_report rep;
    kt_report_begin(&rep, "rope_qkv_rows<%s> [%s] %s B=%d T=%d heads=%d groups=%d d=%d rot=%d", kt_fmt<T>::name,
                    vec ? "V=16 bytes" : "V=1", backward ? "backward" : "forward", a->B, S, a->heads, a->groups, d, rot);
    KT_CUDA(kt_put(k, dqkv, qkv.h));
    rope_qkv_rows<T>(kt_exec(k, 0), dims, dqkv, backward);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out;
    KT_CUDA(kt_get(k, out, dqkv, n));
    /* in place: q and k heads' first rot channels rotated (backward: by the transpose, sin negated), two
     * fp32 roundings and one to T; every other channel (v, channels past rot) bitwise unchanged */
    kt_check cr, cu;
    kt_check_begin(&cr, "rotated", width, 2 * us, 2 * us + 16 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cu, "untouched", width, 0.0, 0.0, 0.0);
    for (int64_t bt = 0; bt < BT; bt++) {
        const int tt = (int)(bt % S);
        for (int col = 0; col < width; col++) {
            const int slot = (col / d) % (qpg + 2), e = col % d;
            const int64_t i = bt * width + col;
            if (slot <= qpg && e < rot) {
                const double c = cs[(int64_t)tt * half + e % half], s0 = sn[(int64_t)tt * half + e % half];
                const double s = backward ? -s0 : s0;
                const double x1 = e < half ? qkv.v[i] : qkv.v[i - half], x2 = e < half ? qkv.v[i + half] : qkv.v[i];
                const double y = e < half ? x1 * c - x2 * s : x2 * c + x1 * s;
                kt_check_add(&cr, i, kt_to<T>(out[i]), y, 4 * uc * (fabs(x1) + fabs(x2)) * (fabs(c) + fabs(s)));
            } else {
                kt_check_add(&cu, i, kt_to<T>(out[i]), qkv.v[i], 0.0);
            }
        }
    }
    kt_check_end(&cr, &rep);
    kt_check_end(&cu, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_attention_layouts_all(kt_ctx* k) {
    static const char* const variants[] = {"split/merge vec", "split/merge scalar", "permute vec", "permute scalar",
                                           "rope rows V=16 bytes", "rope rows V=1"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 6);
    /* B, T, heads, groups, d, rot: GQA and MHA; RoPE on all channels, on a quarter (rot/2 = 8) and
     * on an eighth (rot/2 = 4: scalar in 8-wide types, vectorised in fp32); head dims 64 and 128 at
     * T = 4096; d = 18 (no type's vector width divides it) */
    const kt_attn shapes[] = {
        {2, 64, 4, 2, 64, 0},    {2, 64, 3, 3, 64, 64},   {1, 4096, 4, 2, 64, 64}, {1, 4096, 2, 1, 128, 128},
        {2, 33, 4, 2, 64, 16},   {2, 33, 4, 2, 64, 8},    {2, 33, 4, 1, 18, 18},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_qkv_case<T>(k, &cov, &s) && ok;
        kt_release(k);
        ok = kt_permute_case<T>(k, &cov, &s) && ok;
        kt_release(k);
        if (s.rot)
            for (int bwd = 0; bwd < 2; bwd++) {
                ok = kt_rope_rows_case<T>(k, &cov, &s, bwd) && ok;
                kt_release(k);
            }
    }
    return kt_cover_check(&cov, "attention layouts", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_attention_layouts(void) { KT_FOR_TYPES(kt_attention_layouts_all); }

/* ============================================================================================== */
/* 8b. Query and key norms (--qk-layernorm): qk_norm_forward over the q and k head vectors of the   */
/*     QKV rows (v copied), qk_norm_backward (input gradient in place, weight and bias gradients)     */
/* ============================================================================================== */

/* One case: BT rows of `groups` query groups of qpg query heads, head dim d. Forward: every q and k
 * vector is checked as a normalised row (kt_norm_rows_check's bounds) with its kind's weight (+ w1)
 * and bias, the v vectors bitwise copies, the statistics at their places. Backward (from the
 * kernel's own statistics, as the model runs it): each q/k vector's input gradient against the
 * double formula rstd (g - mean(g) - xhat mean(g xhat)), g = dy (w + w1), with a bound relative to the
 * magnitude of its terms (fp32 sums of d products in a warp: (d/32 + 16) u_c; rstd's relative error;
 * one rounding to T); the v vectors untouched; the weight and bias gradients (written over NaN: the
 * step's first micro-batch) against the double sums over every row's vectors of the kind, bounded by
 * the fp32 chain of the column sums (rows per chunk x vectors per row + the final sums) and x-hat's
 * error. */
template <typename T>
static int kt_qk_norm_case(kt_ctx* k, int BT, int groups, int qpg, int d, bool rms, float w1) {
    const int slots = qpg + 2, width = groups * slots * d, normed = groups * (qpg + 1);
    const int64_t n = (int64_t)BT * width, nstats = (int64_t)BT * normed;
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_rng rng = {kt_seed(40 + (int)rms + 2 * (int)w1, BT * groups, qpg, d)};
    kt_host<T> x, dy, wq, wk, bq, bk;
    x.fill(n, &rng, 0.02, 1.7);
    dy.fill(n, &rng, 0.01, 1.0);
    wq.fill(d, &rng, 0.1, 1.5);
    wk.fill(d, &rng, 0.1, 1.5);
    if (!rms) {
        bq.fill(d, &rng, 0.01, 0.5);
        bk.fill(d, &rng, 0.01, 0.5);
    }
    T* dx = kt_alloc<T>(k, n);
    T* dout = kt_alloc<T>(k, n);
    T* ddy = kt_alloc<T>(k, n);
    T* dwq = kt_alloc<T>(k, d);
    T* dwk = kt_alloc<T>(k, d);
    T* dbq = rms ? NULL : kt_alloc<T>(k, d);
    T* dbk = rms ? NULL : kt_alloc<T>(k, d);
    float* stats = kt_alloc<float>(k, 2 * nstats);
    float* gw = kt_alloc<float>(k, 4 * (int64_t)d); /* dwq, dbq, dwk, dbk */
    float* pq = kt_alloc<float>(k, 2 * (int64_t)COLSUM_MAX_CHUNKS * d);
    float* pk = kt_alloc<float>(k, 2 * (int64_t)COLSUM_MAX_CHUNKS * d);
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "qk_norm<%s> %s%s BT=%d groups=%d qpg=%d d=%d", kt_fmt<T>::name, rms ? "RMSNorm" : "LayerNorm",
                    w1 != 0.0f ? " 1p" : "", BT, groups, qpg, d);
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, ddy, dy.h));
    KT_CUDA(kt_put(k, dwq, wq.h));
    KT_CUDA(kt_put(k, dwk, wk.h));
    if (!rms) {
        KT_CUDA(kt_put(k, dbq, bq.h));
        KT_CUDA(kt_put(k, dbk, bk.h));
    }
    KT_CUDA(kt_poison(k, dout, n));
    KT_CUDA(kt_poison(k, stats, 2 * nstats));
    KT_CUDA(kt_poison(k, gw, 4 * (int64_t)d));
    KT_CUDA(kt_poison(k, pq, 2 * (int64_t)COLSUM_MAX_CHUNKS * d));
    KT_CUDA(kt_poison(k, pk, 2 * (int64_t)COLSUM_MAX_CHUNKS * d));
    const mt_attention_dims dims = {1, BT, groups * qpg, groups, d, 0, NULL, NULL};
    qk_norm_forward<T>(kt_exec(k, 0), dims, dout, stats, dx, dwq, dbq, dwk, dbk, 1e-5f, rms, w1);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out;
    std::vector<float> st;
    KT_CUDA(kt_get(k, out, dout, n));
    KT_CUDA(kt_get(k, st, stats, 2 * nstats));
    /* forward: the q vectors, then the k vectors, as rows of d (their outputs, statistics, weights) */
    int copies_ok = 1;
    for (int kind = 0; kind < 2; kind++) {
        const int per_row = kind ? groups : groups * qpg;
        std::vector<double> rows((size_t)BT * per_row * d), wv(d), bv(d);
        std::vector<T> got((size_t)BT * per_row * d);
        std::vector<float> mean((size_t)BT * per_row), rstd((size_t)BT * per_row);
        const kt_host<T>& w = kind ? wk : wq;
        for (int c = 0; c < d; c++) wv[c] = w.v[c] + w1, bv[c] = rms ? 0.0 : (kind ? bk : bq).v[c];
        int64_t r = 0;
        for (int b = 0; b < BT; b++)
            for (int g = 0; g < groups; g++)
                for (int slot = kind ? qpg : 0; slot <= (kind ? qpg : qpg - 1); slot++, r++) {
                    const int64_t u = ((int64_t)b * groups + g) * slots + slot, at = ((int64_t)b * groups + g) * (qpg + 1) + slot;
                    for (int c = 0; c < d; c++) {
                        rows[(size_t)(r * d + c)] = x.v[(size_t)(u * d + c)];
                        got[(size_t)(r * d + c)] = out[(size_t)(u * d + c)];
                    }
                    mean[(size_t)r] = st[(size_t)at];
                    rstd[(size_t)r] = st[(size_t)(nstats + at)];
                }
        kt_norm_rows_check<T>(&rep, rows.data(), wv.data(), rms ? NULL : bv.data(), (int)r, d, rms, got, mean, rstd);
    }
    for (int b = 0; b < BT && copies_ok; b++)
        for (int g = 0; g < groups; g++) {
            const int64_t u = ((int64_t)b * groups + g) * slots + qpg + 1;
            if (memcmp(&out[(size_t)(u * d)], &x.h[(size_t)(u * d)], sizeof(T) * (size_t)d)) copies_ok = 0;
        }
    if (!copies_ok) {
        printf("    FAIL %s: a value head was not copied unchanged\n", rep.label);
        rep.ok = 0;
    }
    /* backward */
    qk_norm_backward<T>(kt_exec(k, 0), dims, ddy, dx, stats, dwq, dwk, gw, rms ? NULL : gw + d, gw + 2 * d,
                        rms ? NULL : gw + 3 * d, pq, pk, COLSUM_MAX_CHUNKS, rms, w1);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> ddx;
    std::vector<float> gwv;
    KT_CUDA(kt_get(k, ddx, ddy, n));
    KT_CUDA(kt_get(k, gwv, gw, 4 * (int64_t)d));
    int rows_per_chunk = 0;
    colsum_chunks(BT, COLSUM_MAX_CHUNKS, &rows_per_chunk);
    const double depth = (double)rows_per_chunk * groups * qpg + 48.0;
    const double rtol_rstd = 2.0 * (0.5 * (d / 32.0 + 8.0) + 4.0) * uc;
    kt_check cdx, cw[4];
    kt_check_begin(&cdx, "dx", width, 0.0, -1.0, kt_fmt<T>::tiny);
    static const char* names[4] = {"dw_q", "db_q", "dw_k", "db_k"};
    for (int j = 0; j < 4; j++) kt_check_begin(&cw[j], names[j], 0, 0.0, -1.0, 0.0);
    std::vector<double> sw(4 * (size_t)d, 0.0), bound(4 * (size_t)d, 0.0);
    int v_ok = 1;
    for (int b = 0; b < BT; b++)
        for (int g = 0; g < groups; g++)
            for (int slot = 0; slot < slots; slot++) {
                const int64_t u = ((int64_t)b * groups + g) * slots + slot;
                const double* xv = &x.v[(size_t)(u * d)];
                const double* gy = &dy.v[(size_t)(u * d)];
                if (slot == qpg + 1) {
                    if (memcmp(&ddx[(size_t)(u * d)], &dy.h[(size_t)(u * d)], sizeof(T) * (size_t)d)) v_ok = 0;
                    continue;
                }
                const int key = slot == qpg;
                const kt_host<T>& w = key ? wk : wq;
                double m = 0.0, var = 0.0, amean = 0.0;
                for (int c = 0; c < d; c++) amean += fabs(xv[c]);
                amean /= d;
                if (!rms) {
                    for (int c = 0; c < d; c++) m += xv[c];
                    m /= d;
                }
                for (int c = 0; c < d; c++) var += (xv[c] - m) * (xv[c] - m);
                var /= d;
                const double rs = 1.0 / sqrt(var + 1e-5), atol_mean = rms ? 0.0 : 2.0 * (d / 32.0 + 6.0) * uc * amean;
                double mg = 0.0, mgx = 0.0, amg = 0.0, amgx = 0.0;
                for (int c = 0; c < d; c++) {
                    const double gc = gy[c] * (w.v[c] + w1), xh = (xv[c] - m) * rs;
                    mg += gc, mgx += gc * xh, amg += fabs(gc), amgx += fabs(gc * xh);
                }
                mg = rms ? 0.0 : mg / d, mgx /= d, amg /= d, amgx /= d;
                for (int c = 0; c < d; c++) {
                    const double gc = gy[c] * (w.v[c] + w1), xh = (xv[c] - m) * rs;
                    const double ref = rs * (gc - mg - xh * mgx);
                    const double scale = rs * (fabs(gc) + fabs(mg) + fabs(xh * mgx) + (d / 32.0 + 16.0) * (amg + amgx));
                    const double atol = 2.0 * ((2.0 * us + 8.0 * uc + 2.0 * rtol_rstd) * scale +
                                               atol_mean * rs * rs * fabs(mgx) + (d / 32.0 + 16.0) * uc * scale);
                    kt_check_add(&cdx, u * d + c, kt_to<T>(ddx[(size_t)(u * d + c)]), ref, atol);
                    /* the weight and bias gradients: sums of dy x-hat and dy over the kind's vectors */
                    const double xh_err = fabs(xh) * rtol_rstd + atol_mean * rs;
                    sw[(size_t)(2 * key * d + c)] += gy[c] * xh;
                    bound[(size_t)(2 * key * d + c)] += fabs(gy[c] * xh) * depth * uc + fabs(gy[c]) * xh_err;
                    sw[(size_t)((2 * key + 1) * d + c)] += gy[c];
                    bound[(size_t)((2 * key + 1) * d + c)] += fabs(gy[c]) * depth * uc;
                }
            }
    kt_check_end(&cdx, &rep);
    for (int j = 0; j < 4; j++) {
        if (rms && j % 2 == 1) continue; /* no biases: not written */
        for (int c = 0; c < d; c++) kt_check_add(&cw[j], c, gwv[(size_t)(j * d + c)], sw[(size_t)(j * d + c)], 2.0 * bound[(size_t)(j * d + c)]);
        kt_check_end(&cw[j], &rep);
    }
    if (!v_ok) {
        printf("    FAIL %s: the backward changed a value head's gradient\n", rep.label);
        rep.ok = 0;
    }
    return kt_report_end(&rep);
}

template <typename T>
static int kt_qk_norm_all(kt_ctx* k) {
    /* BT, groups, q heads per group, head dim, RMSNorm, w1: a head dim below a warp (16), 64 and 128,
     * one not a multiple of 32 (100); one group (MQA) and several; many rows (several rows per chunk) */
    const struct { int BT, groups, qpg, d, rms; float w1; } shapes[] = {
        {64, 2, 2, 16, 0, 0.0f}, {64, 2, 2, 16, 1, 1.0f}, {300, 1, 4, 64, 0, 1.0f}, {300, 1, 4, 64, 1, 0.0f},
        {33, 3, 1, 100, 0, 0.0f}, {600, 2, 1, 128, 1, 0.0f},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_qk_norm_case<T>(k, s.BT, s.groups, s.qpg, s.d, s.rms, s.w1) && ok;
        kt_release(k);
    }
    return ok;
}
static test_result test_kernels_qk_norm(void) { KT_FOR_TYPES(kt_qk_norm_all); }

/* ============================================================================================== */
/* 9. Causal softmax forward and backward (exact attention path), in place, one warp per row        */
/* ============================================================================================== */

/* heads > 0: document masks (--reset-attention-mask) over BH = B * heads rows of heads per sample,
 * doc_start from mt_document_boundaries: sample b ends a document after every input (b % 3) + 2 (runs of
 * 2, 3, 4: boundaries inside warps and on lane 32's edge), the last sample also after input 0 and the
 * next to last. Each row's reference covers keys doc_start[q] .. q only; the others must come out 0. */
template <typename T>
static int kt_softmax_case(kt_ctx* k, int BH, int S, int heads = 0) {
    const double us = kt_fmt<T>::u, uc = KT_UC;
    const int rows = BH * S, B = heads > 0 ? BH / heads : 0;
    std::vector<int32_t> doc(B > 0 ? (size_t)B * S : 1, 0), in(doc.size(), 7);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < S; i++)
            if (i % ((b % 3) + 2) == (b % 3) + 1 || (b == B - 1 && (i == 0 || i == S - 2))) in[(size_t)b * S + i] = 1;
    if (B > 0) mt_document_boundaries(in.data(), B, S, 1, doc.data(), NULL);
    auto lo_of = [&](int r) { return B > 0 ? doc[(size_t)(r / (heads * S)) * S + r % S] : 0; };
    const int64_t n = (int64_t)rows * S;
    const float scale = 0.125f; /* 1/sqrt(64) */
    kt_rng rng = {kt_seed(14, BH, S, 0)};
    kt_host<T> s0, dp0, p;
    s0.fill(n, &rng, 0.01, 24.0); /* scaled scores within +-3 */
    dp0.fill(n, &rng, 0.01, 1.0);
    /* probabilities for the backward: a softmax-like row (positive, summing to ~1) at or below the
     * diagonal, and nonzero garbage above it (the kernel must not use it) */
    p.fill(n, &rng, 0.01, 1.0);
    for (int r = 0; r < rows; r++) {
        const int q = r % S, lo = lo_of(r);
        std::vector<double> e(q + 1);
        double sum = 0.0;
        for (int j = lo; j <= q; j++) sum += (e[j] = exp(4.0 * kt_uniform(&rng)));
        for (int j = lo; j <= q; j++) {
            const int64_t i = (int64_t)r * S + j;
            p.h[i] = kt_from<T>((float)(e[j] / sum));
            p.v[i] = kt_to<T>(p.h[i]);
        }
    }
    T* ds = kt_alloc<T>(k, n);
    T* ddp = kt_alloc<T>(k, n);
    T* dprob = kt_alloc<T>(k, n);
    int32_t* ddoc = B > 0 ? kt_alloc<int32_t>(k, (int64_t)B * S) : NULL;
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "causal_softmax forward + backward<%s> rows=%d (B*heads=%d) T=%d%s", kt_fmt<T>::name, rows, BH, S,
                    B > 0 ? " with documents" : "");
    KT_CUDA(kt_put(k, ds, s0.h));
    KT_CUDA(kt_put(k, ddp, dp0.h));
    KT_CUDA(kt_put(k, dprob, p.h));
    if (ddoc) KT_CUDA(cudaMemcpy(ddoc, doc.data(), sizeof(int32_t) * doc.size(), cudaMemcpyHostToDevice));
    causal_softmax_forward<T>(kt_exec(k, 0), ds, rows, S, scale, ddoc, heads > 0 ? heads : 1);
    causal_softmax_backward<T>(kt_exec(k, 0), ddp, dprob, rows, S, scale, mt_dropout(), heads > 0 ? heads : 1, ddoc);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> out, dsc;
    KT_CUDA(kt_get(k, out, ds, n));
    KT_CUDA(kt_get(k, dsc, ddp, n));
    /* forward: p = exp(scale s - max) / sum; the argument carries 2 roundings on |scale s| + |max|,
     * expf 2 ulp, the sum of q+1 positive terms by 32 lanes and a tree ((q+1)/32 + 6), the division
     * and product; exactly 0 above the diagonal. backward: dot = sum dp p (q+1 terms, same depth) in
     * dS = scale p (dp - dot), which cancels: absolute bound; exactly 0 above the diagonal. */
    kt_check cf, cb, cz;
    kt_check_begin(&cf, "probs", S, 2 * us, 2 * us + 64 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cb, "dscores", S, 2 * us, 2 * us + 64 * uc, kt_fmt<T>::tiny);
    kt_check_begin(&cz, B > 0 ? "zero above the diagonal and before the document" : "zero above the diagonal", S, 0.0,
                   0.0, 0.0);
    std::vector<double> z(S);
    for (int r = 0; r < rows; r++) {
        const int q = r % S, lo = lo_of(r);
        const int64_t base = (int64_t)r * S;
        double mx = -INFINITY, amax = 0.0, sum = 0.0, dot = 0.0, adot = 0.0;
        for (int j = lo; j <= q; j++) {
            z[j] = scale * s0.v[base + j];
            mx = z[j] > mx ? z[j] : mx;
            amax = fabs(z[j]) > amax ? fabs(z[j]) : amax;
        }
        for (int j = lo; j <= q; j++) sum += exp(z[j] - mx);
        for (int j = lo; j <= q; j++) {
            dot += dp0.v[base + j] * p.v[base + j];
            adot += fabs(dp0.v[base + j] * p.v[base + j]);
        }
        const double rel = 2 * uc * (2 * (amax + fabs(mx)) + (q + 1) / 32.0 + 14);
        for (int j = 0; j < S; j++) {
            const int64_t i = base + j;
            if (j > q || j < lo) {
                kt_check_add(&cz, i, kt_to<T>(out[i]), 0.0, 0.0);
                kt_check_add(&cz, i, kt_to<T>(dsc[i]), 0.0, 0.0);
                continue;
            }
            const double pr = exp(z[j] - mx) / sum;
            kt_check_add(&cf, i, kt_to<T>(out[i]), pr, rel * pr);
            const double ref = scale * p.v[i] * (dp0.v[i] - dot);
            const double atol = 2 * scale * p.v[i] * (((q + 1) / 32.0 + 8) * uc * adot + uc * (fabs(dp0.v[i]) + fabs(dot))) +
                                4 * uc * fabs(ref);
            kt_check_add(&cb, i, kt_to<T>(dsc[i]), ref, atol);
        }
    }
    kt_check_end(&cf, &rep);
    kt_check_end(&cb, &rep);
    if (S > 1 || B > 0) kt_check_end(&cz, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_softmax_all(kt_ctx* k) {
    /* B*heads, T: one key; a partial last warp's lanes; 8 rows per block with a partial last block;
     * long rows (bf16, the model's exact path at 4096, too) */
    const struct { int BH, S; } shapes[] = {{3, 1}, {6, 33}, {2, 1024}, {1, 2048}};
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_softmax_case<T>(k, s.BH, s.S) && ok;
        kt_release(k);
    }
    if (std::is_same<T, __nv_bfloat16>::value) {
        ok = kt_softmax_case<T>(k, 1, 4096) && ok;
        kt_release(k);
    }
    /* documents: 3 samples of 2 heads (the heads of a sample share its documents), and one long row */
    ok = kt_softmax_case<T>(k, 6, 70, 2) && ok;
    kt_release(k);
    ok = kt_softmax_case<T>(k, 2, 1024, 1) && ok;
    kt_release(k);
    return ok;
}
static test_result test_kernels_causal_softmax(void) { KT_FOR_TYPES(kt_softmax_all); }

/* ============================================================================================== */
/* 10. Cross entropy: the fused loss + in-place gradient (plain 3-pass, 16-byte online softmax) and   */
/*     the vocab-parallel pair (per-rank statistics, then the combine) at tp = 2, 4                  */
/* ============================================================================================== */

/* grad_scale as the model passes it: 1/BT in fp32 and bf16; with fp16 the loss scale multiplies it
 * (p/BT of a 50k vocabulary is far below fp16's normal range), here 4096 */
template <typename T>
static float kt_ce_grad_scale(int BT) { return std::is_same<T, __half>::value ? 4096.0f : 1.0f / (float)BT; }

/* Checks losses [BT] and (grad_scale != 0) the gradient [BT, Vr] of columns [v0, v0 + Vr) against a
 * double log-sum-exp over the whole rows z [BT, Vfull]. Bounds: the row sum of exp is fp32 over V/512
 * terms per thread, the online rescales (3 u_c each, <= V/512 of them) and a 10-level block tree:
 * (3 V/512 + 16 + 3 tp) u_c relative (tp merged statistics 3 u_c each); then logf and the subtraction.
 * The gradient (exp(z - lse) - onehot) * grad_scale inherits lse's absolute error as relative. */
template <typename T>
static void kt_ce_check(kt_report* rep, const kt_host<T>& z, int64_t Vfull, int BT, const std::vector<int32_t>& tg,
                        const std::vector<float>& loss, const std::vector<T>* grad, int64_t v0, int64_t Vr, float gs,
                        int tp, const std::vector<T>* untouched) {
    const double us = kt_fmt<T>::u, uc = KT_UC;
    kt_check cl, cg, cu;
    kt_check_begin(&cl, "loss", 0, 0.0, -1.0, 0.0);
    kt_check_begin(&cg, "dlogits", Vr, 2 * us, -1.0, kt_fmt<T>::tiny);
    kt_check_begin(&cu, "logits untouched", Vr, 0.0, 0.0, 0.0);
    for (int r = 0; r < BT; r++) {
        const double* zr = z.v.data() + (int64_t)r * Vfull;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t i = 0; i < Vfull; i++) mx = zr[i] > mx ? zr[i] : mx;
        for (int64_t i = 0; i < Vfull; i++) sum += exp(zr[i] - mx);
        const double lse = mx + log(sum), ref_loss = lse - zr[tg[r]];
        const double e_lse = (3.0 * Vfull / 512.0 + 16 + 3 * tp) * uc + uc * (fabs(log(sum)) + 2 * fabs(lse));
        kt_check_add(&cl, r, loss[r], ref_loss, 2 * (e_lse + uc * (fabs(ref_loss) + fabs(zr[tg[r]]))));
        for (int64_t c = 0; c < Vr; c++) {
            const int64_t col = v0 + c, i = (int64_t)r * Vr + c;
            if (grad) {
                const double p = exp(zr[col] - lse), oh = col == tg[r] ? 1.0 : 0.0;
                const double atol = 2 * fabs(gs) * (p * (e_lse + uc * (fabs(zr[col]) + fabs(lse)) + 3 * uc) + 2 * uc * oh);
                kt_check_add(&cg, i, kt_to<T>((*grad)[i]), (p - oh) * gs, atol);
            } else {
                kt_check_add(&cu, i, kt_to<T>((*untouched)[i]), zr[col], 0.0);
            }
        }
    }
    kt_check_end(&cl, rep);
    if (grad) kt_check_end(&cg, rep);
    else kt_check_end(&cu, rep);
}

template <typename T>
static int kt_cross_entropy_case(kt_ctx* k, kt_cover* cov, int BT, int V, bool with_grad) {
    constexpr int W = vec16<T>::N;
    kt_rng rng = {kt_seed(15, BT, V, with_grad)};
    kt_host<T> z;
    z.fill((int64_t)BT * V, &rng, 0.01, 4.0);
    std::vector<int32_t> tg(BT);
    for (int r = 0; r < BT; r++) tg[r] = (int32_t)(kt_next(&rng) % (uint64_t)V);
    tg[0] = 0;
    if (BT > 1) tg[BT - 1] = V - 1;
    T* dz = kt_alloc<T>(k, (int64_t)BT * V);
    float* dloss = kt_alloc<float>(k, BT);
    int32_t* dtg = kt_alloc<int32_t>(k, BT);
    KT_ALLOCATED(k);
    const bool vec = V % W == 0; /* cross_entropy_fused */
    kt_cover_hit(cov, vec ? "vec (online softmax)" : "plain (3 passes)");
    const float gs = with_grad ? kt_ce_grad_scale<T>(BT) : 0.0f;
    kt_report rep;
    kt_report_begin(&rep, "cross_entropy<%s> [%s] BT=%d V=%d grad_scale=%g", kt_fmt<T>::name,
                    vec ? "vec (online softmax)" : "plain (3 passes)", BT, V, gs);
    KT_CUDA(kt_put(k, dz, z.h));
    KT_CUDA(kt_put(k, dtg, tg));
    KT_CUDA(kt_poison(k, dloss, BT));
    cross_entropy_fused<T>(kt_exec(k, 0), dz, dloss, dtg, BT, V, gs);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> loss;
    std::vector<T> out;
    KT_CUDA(kt_get(k, loss, dloss, BT));
    KT_CUDA(kt_get(k, out, dz, (int64_t)BT * V));
    kt_ce_check<T>(&rep, z, V, BT, tg, loss, with_grad ? &out : NULL, 0, V, gs, 1, with_grad ? NULL : &out);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_ce_vocab_parallel_case(kt_ctx* k, int BT, int Vr, int tp) {
    const int64_t Vfull = (int64_t)Vr * tp;
    kt_rng rng = {kt_seed(16, BT, Vr, tp)};
    kt_host<T> z;
    z.fill((int64_t)BT * Vfull, &rng, 0.01, 4.0);
    std::vector<int32_t> tg(BT);
    for (int r = 0; r < BT; r++) tg[r] = (int32_t)(kt_next(&rng) % (uint64_t)Vfull);
    tg[0] = 0;
    tg[BT - 1] = (int32_t)(Vfull - 1);
    if (BT > 2) tg[1] = Vr; /* the first column of rank 1 */
    std::vector<T*> dz(tp);
    std::vector<float*> dloss(tp);
    for (int r = 0; r < tp; r++) {
        dz[r] = kt_alloc<T>(k, (int64_t)BT * Vr);
        dloss[r] = kt_alloc<float>(k, BT);
    }
    float* stats = kt_alloc<float>(k, (int64_t)tp * BT * 3);
    int32_t* dtg = kt_alloc<int32_t>(k, BT);
    KT_ALLOCATED(k);
    const float gs = kt_ce_grad_scale<T>(BT);
    kt_report rep;
    kt_report_begin(&rep, "cross_entropy_partial + combine<%s> [vocab-parallel tp=%d] BT=%d V=%d per rank", kt_fmt<T>::name,
                    tp, BT, Vr);
    KT_CUDA(kt_put(k, dtg, tg));
    KT_CUDA(kt_poison(k, stats, (int64_t)tp * BT * 3));
    std::vector<T> block((size_t)BT * Vr);
    for (int r = 0; r < tp; r++) {
        for (int row = 0; row < BT; row++)
            memcpy(&block[(size_t)row * Vr], &z.h[(size_t)row * Vfull + (size_t)r * Vr], sizeof(T) * Vr);
        KT_CUDA(cudaMemcpyAsync(dz[r], block.data(), block.size() * sizeof(T), cudaMemcpyHostToDevice, k->stream));
        KT_CUDA(cudaStreamSynchronize(k->stream)); /* block is reused */
        KT_CUDA(kt_poison(k, dloss[r], BT));
    }
    /* each rank's statistics into its slot of [tp, BT, 3] (where the all-gather puts them), then each
     * rank combines all of them */
    for (int r = 0; r < tp; r++)
        cross_entropy_partial<T>(kt_exec(k, 0), stats + (int64_t)r * BT * 3, dz[r], dtg, BT, Vr, (int64_t)r * Vr);
    for (int r = 0; r < tp; r++)
        cross_entropy_combine<T>(kt_exec(k, 0), dz[r], dloss[r], stats, tp, BT, dtg, Vr, (int64_t)r * Vr, gs);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> loss0;
    KT_CUDA(kt_get(k, loss0, dloss[0], BT));
    for (int r = 0; r < tp; r++) {
        std::vector<float> loss;
        std::vector<T> grad;
        KT_CUDA(kt_get(k, loss, dloss[r], BT));
        KT_CUDA(kt_get(k, grad, dz[r], (int64_t)BT * Vr));
        if (memcmp(loss.data(), loss0.data(), sizeof(float) * BT)) {
            printf("    FAIL %s: rank %d's losses differ from rank 0's\n", rep.label, r);
            rep.ok = 0;
        }
        size_t len = strlen(rep.line);
        snprintf(rep.line + len, sizeof(rep.line) - len, " [rank %d]", r);
        kt_ce_check<T>(&rep, z, Vfull, BT, tg, loss, &grad, (int64_t)r * Vr, Vr, gs, tp, NULL);
    }
    return kt_report_end(&rep);
}

template <typename T>
static int kt_cross_entropy_all(kt_ctx* k) {
    static const char* const variants[] = {"vec (online softmax)", "plain (3 passes)"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    /* BT, V, gradient: GPT-2's padded vocabulary; Llama 3's 128256; V not a multiple of any vector width;
     * V = 1004 (a multiple of 4, not of 8); loss only (the logits must stay as they are); one row */
    const struct { int BT, V, grad; } shapes[] = {
        {7, 50304, 1}, {3, 128256, 1}, {5, 1001, 1}, {3, 1004, 1}, {64, 2048, 0}, {1, 128, 1}, {4, 1001, 0},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_cross_entropy_case<T>(k, &cov, s.BT, s.V, s.grad) && ok;
        kt_release(k);
    }
    for (int tp : {2, 4}) {
        ok = kt_ce_vocab_parallel_case<T>(k, 7, 384, tp) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "cross_entropy", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_cross_entropy(void) { KT_FOR_TYPES(kt_cross_entropy_all); }

/* ============================================================================================== */
/* 11. Embeddings: forward (word + position, vocab-parallel rows), position and word gradients       */
/* ============================================================================================== */

template <typename T>
static int kt_embedding_case(kt_ctx* k, int B, int S, int C, int64_t vocab_start, int64_t V, int64_t Vtotal,
                             bool positions, int accumulate) {
    const double us = kt_fmt<T>::u, uc = KT_UC;
    const int BT = B * S;
    kt_rng rng = {kt_seed(17, BT, C, (int)vocab_start * 2 + positions)};
    kt_host<T> wte, wpe, dout;
    wte.fill(V * C, &rng, 0.01, 1.0);
    if (positions) wpe.fill((int64_t)S * C, &rng, 0.01, 1.0);
    dout.fill((int64_t)BT * C, &rng, 0.01, 1.0);
    std::vector<int32_t> tok(BT);
    for (int i = 0; i < BT; i++) tok[i] = (int32_t)(kt_next(&rng) % (uint64_t)Vtotal);
    std::vector<float> old_pos((size_t)S * C), old_wte((size_t)V * C);
    for (auto& x : old_pos) x = kt_signed(&rng, 0.1, 2.0);
    for (auto& x : old_wte) x = kt_signed(&rng, 0.1, 2.0);
    /* the word-gradient index, built by the model's own host function */
    std::vector<int32_t> index((size_t)3 * BT + 2, -1), counts((size_t)V);
    const int unique = build_embedding_index(index.data(), tok.data(), BT, vocab_start, V, counts.data());
    T* dwte = kt_alloc<T>(k, V * C);
    T* dwpe = positions ? kt_alloc<T>(k, (int64_t)S * C) : NULL;
    T* dxo = kt_alloc<T>(k, (int64_t)BT * C);
    T* ddout = kt_alloc<T>(k, (int64_t)BT * C);
    int32_t* dtok = kt_alloc<int32_t>(k, BT);
    int32_t* didx = kt_alloc<int32_t>(k, (int64_t)index.size());
    float* gpos = kt_alloc<float>(k, (int64_t)S * C);
    float* gwte = kt_alloc<float>(k, V * C);
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "embedding forward + backward<%s> B=%d T=%d C=%d vocabulary rows [%lld, %lld) of %lld, %s, "
                    "%d distinct tokens, position grad accumulate=%d", kt_fmt<T>::name, B, S, C, (long long)vocab_start,
                    (long long)(vocab_start + V), (long long)Vtotal, positions ? "learned positions" : "no position table",
                    unique, accumulate);
    KT_CUDA(kt_put(k, dwte, wte.h));
    if (dwpe) KT_CUDA(kt_put(k, dwpe, wpe.h));
    KT_CUDA(kt_put(k, ddout, dout.h));
    KT_CUDA(kt_put(k, dtok, tok));
    KT_CUDA(kt_put(k, didx, index));
    KT_CUDA(kt_put(k, gwte, old_wte));
    if (accumulate) KT_CUDA(kt_put(k, gpos, old_pos));
    else KT_CUDA(kt_poison(k, gpos, (int64_t)S * C));
    KT_CUDA(kt_poison(k, dxo, (int64_t)BT * C));
    embedding_forward<T>(kt_exec(k, 0), dxo, dtok, dwte, dwpe, BT, S, C, vocab_start, V);
    if (positions) position_embedding_backward<T>(kt_exec(k, accumulate), gpos, ddout, B, S, C);
    word_embedding_backward<T>(kt_exec(k, accumulate), gwte, ddout, didx, unique, BT, C, vocab_start);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> xo;
    std::vector<float> got_pos, got_wte;
    KT_CUDA(kt_get(k, xo, dxo, (int64_t)BT * C));
    KT_CUDA(kt_get(k, got_pos, gpos, (int64_t)S * C));
    KT_CUDA(kt_get(k, got_wte, gwte, V * C));
    /* forward: word (0 outside this rank's rows) + position, one fp32 addition and one rounding */
    kt_check cf;
    kt_check_begin(&cf, "x", C, 2 * (us + uc), 2 * (us + uc), kt_fmt<T>::tiny);
    for (int i = 0; i < BT; i++) {
        const int64_t row = tok[i] - vocab_start;
        for (int c = 0; c < C; c++) {
            const double w = row >= 0 && row < V ? wte.v[row * C + c] : 0.0;
            const double p = positions ? wpe.v[(int64_t)(i % S) * C + c] : 0.0;
            kt_check_add(&cf, (int64_t)i * C + c, kt_to<T>(xo[(int64_t)i * C + c]), w + p, 0.0);
        }
    }
    kt_check_end(&cf, &rep);
    /* position gradient: B terms in batch order (+ the old value): depth B + 1 */
    if (positions) {
        kt_check cp;
        kt_check_begin(&cp, "dwpe", C, 0.0, -1.0, 0.0);
        for (int64_t j = 0; j < (int64_t)S * C; j++) {
            double s = accumulate ? old_pos[j] : 0.0, a = fabs(s);
            for (int b = 0; b < B; b++) {
                s += dout.v[(int64_t)b * S * C + j];
                a += fabs(dout.v[(int64_t)b * S * C + j]);
            }
            kt_check_add(&cp, j, got_pos[j], s, 2 * (B + 2) * uc * a);
        }
        kt_check_end(&cp, &rep);
    }
    /* word gradient: each of this rank's tokens adds its positions in order to the old value (depth:
     * its count + 1); rows of tokens that did not occur are bitwise untouched */
    std::vector<double> s((size_t)V * C), a((size_t)V * C);
    std::vector<int> cnt((size_t)V, 0);
    for (int64_t j = 0; j < V * C; j++) a[j] = fabs(s[j] = old_wte[j]);
    for (int i = 0; i < BT; i++) {
        const int64_t row = tok[i] - vocab_start;
        if (row < 0 || row >= V) continue;
        cnt[row]++;
        for (int c = 0; c < C; c++) {
            s[row * C + c] += dout.v[(int64_t)i * C + c];
            a[row * C + c] += fabs(dout.v[(int64_t)i * C + c]);
        }
    }
    kt_check cw;
    kt_check_begin(&cw, "dwte", C, 0.0, -1.0, 0.0);
    for (int64_t j = 0; j < V * C; j++) kt_check_add(&cw, j, got_wte[j], s[j], 2 * (cnt[j / C] + 2) * uc * a[j]);
    kt_check_end(&cw, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_embedding_all(kt_ctx* k) {
    /* B, T, C, this rank's vocabulary rows [start, start + V) of Vtotal, positions, accumulate: repeated
     * tokens (each ~6 times); a vocab-parallel slice with tokens outside it and no position table
     * (RoPE); one token */
    const struct { int B, S, C; int64_t start, V, total; int pos, acc; } shapes[] = {
        {2, 150, 768, 0, 50, 50, 1, 0}, {1, 257, 770, 25, 25, 60, 0, 0}, {4, 33, 64, 0, 1000, 1000, 1, 1},
        {1, 1, 64, 0, 10, 10, 1, 0},
    };
    int ok = 1;
    for (const auto& s : shapes) {
        ok = kt_embedding_case<T>(k, s.B, s.S, s.C, s.start, s.V, s.total, s.pos, s.acc) && ok;
        kt_release(k);
    }
    return ok;
}
static test_result test_kernels_embeddings(void) { KT_FOR_TYPES(kt_embedding_all); }

/* ============================================================================================== */
/* 12. Gradient norm (chunk sums of squares in double, then their sum) and AdamW                     */
/* ============================================================================================== */

/* A chunk list like plan_optimizer_shard's: tensors cut into OPT_CHUNK_ELEMENTS pieces, with gaps,
 * offsets that are and are not multiples of 4 elements (the 16-byte path and the scalar one), lengths
 * with a tail of 1-3 elements, weight decay on and off, one chunk not counted in the norm (a TP
 * replica's copy), and more than 256 chunks (the final sum loops). */
static std::vector<mt_opt_chunk> kt_chunks(bool alias, int64_t* buffer_size, int64_t* master_size) {
    std::vector<mt_opt_chunk> v;
    int64_t b = 0, m = 0;
    /* the next offset past a gap of >= 1 element that is `r` mod 4 */
    auto at = [](int64_t x, int r) { x += 1; return x + ((r - (int)(x % 4)) + 4) % 4; };
    /* a tensor of len elements whose buffer offset is rb mod 4 and master offset rm mod 4 (alias: the
     * master is the buffer) */
    auto add = [&](int64_t len, int rb, int rm, int wd, int counted) {
        b = at(b, rb);
        m = alias ? b : at(m, rm);
        while (len > 0) {
            mt_opt_chunk c;
            memset(&c, 0, sizeof(c));
            c.buffer = b;
            c.master = m;
            c.length = (int32_t)(len < OPT_CHUNK_ELEMENTS ? len : OPT_CHUNK_ELEMENTS);
            c.weight_decay = wd;
            c.count_in_norm = counted;
            v.push_back(c);
            b += c.length;
            m += c.length;
            len -= c.length;
        }
    };
    add(70000, 0, 0, 1, 1); /* 32768, 32768, 4464: 16-byte */
    add(1003, 0, 0, 0, 1);  /* 16-byte with a tail of 3 */
    add(517, 1, 3, 1, 1);   /* buffer offset 1 mod 4: scalar */
    add(64, 0, 2, 0, 1);    /* master offset 2 mod 4: scalar (fp32 alias: 16-byte) */
    add(4, 0, 0, 1, 0);     /* one vector, not counted in the norm */
    for (int i = 0; i < 300; i++) add(1 + i % 9, i % 4, (i / 4) % 4, i & 1, 1);
    for (size_t i = 0; i < v.size(); i += 3) v[i].decoupled = 1; /* every third at --decoupled-lr's rate */
    *buffer_size = b + 8;
    *master_size = (alias ? b : m) + 8;
    return v;
}

static int kt_gradient_norm_case(kt_ctx* k) {
    int64_t nb = 0, nm = 0;
    std::vector<mt_opt_chunk> chunks = kt_chunks(false, &nb, &nm);
    const int nc = (int)chunks.size();
    kt_rng rng = {kt_seed(18, nc, 0, 0)};
    std::vector<float> g((size_t)nb);
    for (auto& x : g) x = kt_signed(&rng, 0.01, 1.0);
    for (int i = 0; i < 50; i++) g[kt_next(&rng) % (uint64_t)nb] = kt_signed(&rng, 50.0, 100.0);
    float* dg = kt_alloc<float>(k, nb);
    mt_opt_chunk* dchunks = kt_alloc<mt_opt_chunk>(k, nc);
    double* dpart = kt_alloc<double>(k, nc + 1);
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "gradient_sum_squares: %d chunks over %lld gradient elements", nc, (long long)nb);
    KT_CUDA(kt_put(k, dg, g));
    KT_CUDA(kt_put(k, dchunks, chunks));
    KT_CUDA(kt_poison(k, dpart, nc + 1));
    gradient_sum_squares(kt_exec(k, 0), dpart, dchunks, nc, dg);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<double> part;
    KT_CUDA(kt_get(k, part, dpart, nc + 1));
    const double got = part[nc];
    /* fp32 squares are exact in double (24 x 24 bits < 53); the sums carry (length/256 + 16) double
     * roundings of 2^-53 relative, at most 1e-14: 1e-12. An uncounted chunk's partial is exactly 0. */
    kt_check cp, ct;
    kt_check_begin(&cp, "chunk partials", 0, 1e-12, 1e-12, 0.0);
    kt_check_begin(&ct, "total", 0, 1e-12, 1e-12, 0.0);
    double total = 0.0;
    for (int c = 0; c < nc; c++) {
        double s = 0.0;
        if (chunks[c].count_in_norm)
            for (int i = 0; i < chunks[c].length; i++) s += (double)g[chunks[c].buffer + i] * g[chunks[c].buffer + i];
        kt_check_add(&cp, c, part[c], s, 0.0);
        total += s;
    }
    kt_check_add(&ct, 0, got, total, 0.0);
    kt_check_end(&cp, &rep);
    kt_check_end(&ct, &rep);
    return kt_report_end(&rep);
}
static test_result test_kernels_gradient_norm(void) {
    REQUIRE_GPU();
    kt_ctx k;
    if (!kt_ctx_init(&k)) return TEST_FAIL;
    int ok = kt_gradient_norm_case(&k);
    kt_ctx_free(&k);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* AdamW over the chunk list: m, v, the fp32 master per element against a double step from the same
 * fp32 inputs and the fp32 hyperparameters the kernel gets, the model copy bitwise the
 * master rounded to T, m, v and the master bitwise those of the host's mt_adamw_cpu_scalar (what
 * --optimizer-cpu-offload runs), and every element outside the chunks bitwise untouched. With fp32 and no
 * distributed optimizer the model IS the master (alias): the copy is skipped. lr = 1e-2 moves every
 * weight by ~1e-2, far outside the tolerances, so a skipped element fails. */
template <typename T>
static int kt_adamw_case(kt_ctx* k, kt_cover* cov, bool alias) {
    const double uc = KT_UC;
    int64_t nb = 0, nm = 0;
    std::vector<mt_opt_chunk> chunks = kt_chunks(alias, &nb, &nm);
    const int nc = (int)chunks.size();
    /* the 10th step's hyperparameters, converted as adamw_step converts them */
    mt_adamw_step h;
    h.lr = 1e-2f;
    h.lr_decoupled = 4e-3f; /* the chunks marked decoupled */
    h.beta1 = (float)0.9;
    h.beta2 = (float)0.95;
    h.bias_correction1 = (float)(1.0 - pow(0.9, 10.0));
    h.bias_correction2 = (float)(1.0 - pow(0.95, 10.0));
    h.eps = (float)1e-8;
    h.weight_decay = (float)0.1;
    h.grad_scale = 0.5f;
    kt_rng rng = {kt_seed(19, nc, alias, (int)sizeof(T))};
    std::vector<float> g((size_t)nb), p((size_t)nm), m((size_t)nm), v((size_t)nm);
    for (auto& x : g) x = kt_signed(&rng, 0.1, 1.0);
    for (auto& x : p) x = kt_signed(&rng, 0.05, 0.5);
    for (auto& x : m) x = kt_signed(&rng, 0.001, 0.05);
    for (auto& x : v) x = (float)(1e-4 + 1e-2 * kt_uniform(&rng));
    kt_host<T> model;
    model.fill(nb, &rng, 0.01, 1.0);
    float* dg = kt_alloc<float>(k, nb);
    float* dp = kt_alloc<float>(k, nm);
    float* dm = kt_alloc<float>(k, nm);
    float* dv = kt_alloc<float>(k, nm);
    T* dmodel = alias ? (T*)(void*)dp : kt_alloc<T>(k, nb);
    mt_opt_chunk* dchunks = kt_alloc<mt_opt_chunk>(k, nc);
    KT_ALLOCATED(k);
    kt_cover_hit(cov, alias ? "fp32 model = master" : "model copy");
    kt_report rep;
    kt_report_begin(&rep, "adamw_update<%s> [%s; 16-byte and scalar chunks] %d chunks, %lld buffer / %lld master elements",
                    kt_fmt<T>::name, alias ? "fp32 model = master" : "model copy", nc, (long long)nb, (long long)nm);
    KT_CUDA(kt_put(k, dg, g));
    KT_CUDA(kt_put(k, dp, p));
    KT_CUDA(kt_put(k, dm, m));
    KT_CUDA(kt_put(k, dv, v));
    if (!alias) KT_CUDA(kt_put(k, dmodel, model.h));
    KT_CUDA(kt_put(k, dchunks, chunks));
    adamw_update<T>(kt_exec(k, 0), &h, dchunks, nc, dp, dmodel, dg, dm, dv);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> p1, m1, v1;
    std::vector<T> model1;
    KT_CUDA(kt_get(k, p1, dp, nm));
    KT_CUDA(kt_get(k, m1, dm, nm));
    KT_CUDA(kt_get(k, v1, dv, nm));
    if (!alias) KT_CUDA(kt_get(k, model1, dmodel, nb));
    const float b1 = h.beta1, b2 = h.beta2, eps = h.eps, wdf = h.weight_decay, gs = h.grad_scale;
    const double omb1 = (double)(1.0f - b1), omb2 = (double)(1.0f - b2);
    const double bc1 = h.bias_correction1, bc2 = h.bias_correction2;
    kt_check cm, cv, cp, cc, cu, cb;
    kt_check_begin(&cb, "= mt_adamw_cpu_scalar", 0, 0.0, 0.0, 0.0);
    kt_check_begin(&cm, "m", 0, 0.0, -1.0, 0.0);
    kt_check_begin(&cv, "v", 0, 6 * uc, 6 * uc, 0.0);
    kt_check_begin(&cp, "master", 0, 0.0, -1.0, 0.0);
    kt_check_begin(&cc, "model = round(master)", 0, 0.0, 0.0, 0.0);
    kt_check_begin(&cu, "outside the chunks", 0, 0.0, 0.0, 0.0);
    std::vector<char> in_b((size_t)nb, 0), in_m((size_t)nm, 0);
    for (const mt_opt_chunk& c : chunks) {
        const bool vec = ((c.master | c.buffer) & 3) == 0;
        kt_cover_hit(cov, vec ? "16-byte chunk" : "scalar chunk");
        if (vec && c.length % 4) kt_cover_hit(cov, "16-byte chunk with a tail");
        const double wd = c.weight_decay ? (double)wdf : 0.0;
        const float lr = c.decoupled ? h.lr_decoupled : h.lr;
        kt_cover_hit(cov, c.decoupled ? "decoupled-lr chunk" : "main-lr chunk");
        for (int j = 0; j < c.length; j++) {
            const int64_t kk = c.master + j, bb = c.buffer + j;
            in_b[bb] = 1;
            in_m[kk] = 1;
            /* raw first-order bounds: m' = b1 m + (1-b1) g (2 roundings on the terms, may cancel);
             * v' a sum of positive terms (3 u_c); then sqrt, the ratio, the decay and the step */
            const double gg = (double)g[bb] * gs;
            const double mr = b1 * (double)m[kk] + omb1 * gg, vr = b2 * (double)v[kk] + omb2 * gg * gg;
            const double den = sqrt(vr / bc2) + eps, adam = (mr / bc1) / den, upd = adam + wd * p[kk];
            const double pr = p[kk] - (double)lr * upd;
            const double em = 2 * uc * (fabs(b1 * (double)m[kk]) + fabs(omb1 * gg));
            const double e_adam = fabs(adam) * (1.5 * uc + 5 * uc) + em / (bc1 * den);
            const double e_upd = e_adam + 2 * uc * wd * fabs(p[kk]) + uc * fabs(upd);
            const double ep = lr * e_upd + uc * fabs(lr * upd) + uc * (fabs(p[kk]) + fabs(lr * upd));
            kt_check_add(&cm, kk, m1[kk], mr, 2 * em);
            kt_check_add(&cv, kk, v1[kk], vr, 0.0);
            kt_check_add(&cp, kk, p1[kk], pr, 2 * ep);
            /* the CPU AdamW of --optimizer-cpu-offload, bit for bit (the same roundings in the same order) */
            mt_adamw_step hc = h;
            hc.lr = lr;
            float cp1 = p[kk], cm1 = m[kk], cv1 = v[kk];
            mt_adamw_cpu_scalar(&hc, c.weight_decay, &g[bb], &cp1, &cm1, &cv1, 1);
            kt_check_add(&cb, kk, p1[kk], cp1, 0.0);
            kt_check_add(&cb, kk, m1[kk], cm1, 0.0);
            kt_check_add(&cb, kk, v1[kk], cv1, 0.0);
            if (!alias) kt_check_add(&cc, bb, kt_to<T>(model1[bb]), kt_round<T>(p1[kk]), 0.0);
        }
    }
    for (int64_t i = 0; i < nm; i++)
        if (!in_m[i]) {
            kt_check_add(&cu, i, p1[i], p[i], 0.0);
            kt_check_add(&cu, i, m1[i], m[i], 0.0);
            kt_check_add(&cu, i, v1[i], v[i], 0.0);
        }
    if (!alias)
        for (int64_t i = 0; i < nb; i++)
            if (!in_b[i]) kt_check_add(&cu, i, kt_to<T>(model1[i]), model.v[i], 0.0);
    kt_check_end(&cm, &rep);
    kt_check_end(&cv, &rep);
    kt_check_end(&cp, &rep);
    kt_check_end(&cb, &rep);
    if (!alias) kt_check_end(&cc, &rep);
    kt_check_end(&cu, &rep);
    return kt_report_end(&rep);
}

template <typename T>
static int kt_adamw_all(kt_ctx* k) {
    static const char* const variants[] = {"16-byte chunk", "scalar chunk", "16-byte chunk with a tail", "model copy",
                                           "main-lr chunk", "decoupled-lr chunk"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 6);
    int ok = kt_adamw_case<T>(k, &cov, false);
    kt_release(k);
    if (std::is_same<T, float>::value) {
        ok = kt_adamw_case<T>(k, &cov, true) && ok;
        kt_release(k);
    }
    return kt_cover_check(&cov, "adamw_update", kt_fmt<T>::name) && ok;
}
static test_result test_kernels_adamw(void) { KT_FOR_TYPES(kt_adamw_all); }

/* ============================================================================================== */
/* 13. Casts between fp32 and the model type (checkpoints, logits, parameter uploads): bitwise       */
/* ============================================================================================== */

template <typename T>
static int kt_cast_all(kt_ctx* k) {
    const int64_t n = 1000003; /* not a multiple of the block */
    kt_rng rng = {kt_seed(20, 0, 0, (int)sizeof(T))};
    std::vector<float> f((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        const int kind = (int)(i % 7);
        f[i] = kind == 0 ? kt_signed(&rng, 1e-30, 1e-20)       /* underflows fp16 */
             : kind == 1 ? kt_signed(&rng, 7e4, 1e5)            /* overflows fp16 */
                         : kt_signed(&rng, 1e-3, 1e3);
    }
    kt_host<T> x;
    x.fill(n, &rng, 1e-3, 1e3);
    float* df = kt_alloc<float>(k, n);
    T* dt = kt_alloc<T>(k, n);
    T* dx = kt_alloc<T>(k, n);
    float* dback = kt_alloc<float>(k, n);
    KT_ALLOCATED(k);
    kt_report rep;
    kt_report_begin(&rep, "cast_from_float + cast_to_float<%s> n=%lld", kt_fmt<T>::name, (long long)n);
    KT_CUDA(kt_put(k, df, f));
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_poison(k, dt, n));
    KT_CUDA(kt_poison(k, dback, n));
    cast_from_float(kt_exec(k, 0), kt_fmt<T>::precision, dt, df, n);
    cast_to_float(kt_exec(k, 0), kt_fmt<T>::precision, dback, dx, n);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> got;
    std::vector<float> back;
    KT_CUDA(kt_get(k, got, dt, n));
    KT_CUDA(kt_get(k, back, dback, n));
    /* round to nearest even, infinities included: the same bits as the host's conversion */
    int64_t bad_from = -1, bad_to = -1;
    for (int64_t i = 0; i < n && bad_from < 0; i++) {
        T want = kt_from<T>(f[i]);
        if (memcmp(&want, &got[i], sizeof(T))) bad_from = i;
    }
    for (int64_t i = 0; i < n && bad_to < 0; i++)
        if (back[i] != (float)x.v[i]) bad_to = i;
    if (bad_from >= 0) {
        printf("    FAIL %s: cast_from_float[%lld] of %.9g gave %.9g, expected %.9g\n", rep.label, (long long)bad_from,
               f[bad_from], kt_to<T>(got[bad_from]), kt_to<T>(kt_from<T>(f[bad_from])));
        rep.ok = 0;
    }
    if (bad_to >= 0) {
        printf("    FAIL %s: cast_to_float[%lld] gave %.9g, expected %.9g\n", rep.label, (long long)bad_to, back[bad_to],
               x.v[bad_to]);
        rep.ok = 0;
    }
    size_t len = strlen(rep.line);
    snprintf(rep.line + len, sizeof(rep.line) - len, " bitwise %s", rep.ok ? "equal" : "DIFFERENT");
    return kt_report_end(&rep);
}
static test_result test_kernels_casts(void) { KT_FOR_TYPES(kt_cast_all); }

static const test_case kernels_gpu_tests[] = {
    {"kernels_norm_forward", test_kernels_norm_forward},
    {"kernels_residual_norm_forward", test_kernels_residual_norm_forward},
    {"kernels_norm_apply", test_kernels_norm_apply},
    {"kernels_norm_backward", test_kernels_norm_backward},
    {"kernels_norm_backward_tile_heights", test_kernels_norm_backward_tiles},
    {"kernels_column_sum", test_kernels_column_sum},
    {"kernels_bias_gelu", test_kernels_bias_gelu},
    {"kernels_gelu_backward", test_kernels_gelu_backward},
    {"kernels_bias_squared_relu", test_kernels_bias_squared_relu},
    {"kernels_qk_norm", test_kernels_qk_norm},
    {"kernels_squared_relu_backward", test_kernels_squared_relu_backward},
    {"kernels_linear_bias_add", test_kernels_linear_bias_add},
    {"kernels_swiglu", test_kernels_swiglu},
    {"kernels_attention_layouts_and_rope", test_kernels_attention_layouts},
    {"kernels_causal_softmax", test_kernels_causal_softmax},
    {"kernels_cross_entropy", test_kernels_cross_entropy},
    {"kernels_embeddings", test_kernels_embeddings},
    {"kernels_gradient_norm", test_kernels_gradient_norm},
    {"kernels_adamw", test_kernels_adamw},
    {"kernels_casts", test_kernels_casts},
};

#endif
