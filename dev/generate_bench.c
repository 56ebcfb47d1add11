/* dev/generate_bench.c — decode speed of the generation engine (megatron.h section 15b) on one GPU, random
 * weights, bf16: for each batch size B, B requests of PROMPT random tokens each generating NEW tokens
 * greedily (no stop), all added before the first step. Prints per batch size
 *   the time to first token (the step that prefills the B prompts), the decode rate in tokens/s and
 *   milliseconds a step, and the memory-bandwidth bound: a decode step reads every weight once (the
 *   output layer's [Vp, h] included) and each request's cache of its mean context (prompt + NEW / 2
 *   positions x layers x 2 x groups x head dim x 2 bytes); over the device's measured copy bandwidth
 *   (mt_device_copy_bandwidth) that is the fastest step possible, and the rate's share of it.
 *
 * Every batch size first runs one untimed round (B requests of PROMPT tokens, 4 new tokens each) on the same
 * engine: the first launches of every kernel (CUDA's lazy module loading), cuBLAS's first calls for the
 * prefill's shapes and the capture of the B-row decode step's CUDA graph happen there, not in the timings.
 *
 *   dev/generate_bench [--model gpt2-1.5b|llama-3.2-1b] [--batches 1,8,64] [--prompt 128] [--new 256]
 *   dev/generate_bench --gemv
 * --gemv: the engine's decode GEMV against cuBLAS (mt_decode_gemv_benchmark) for both models' linears at 1, 2,
 * 4, 8 and 16 rows: microseconds a product, GB/s (weights + activations read and written) and the share of the
 * copy bandwidth, for each, and cuBLAS's time over ours; then a layer's four linears summed. Each decode batch
 * also prints a line `RESULT {json}` (dev/bench/generate_bench.sh's table reads them). MT_GEN_GEMV=0 in the
 * environment runs the engine's decode steps on cuBLAS (to compare).
 * Built by `make dev/generate_bench`; dev/bench/generate_bench.sh runs both models. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "megatron.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int model_config(const char* name, mt_config* c) {
    mt_config_defaults(c);
    c->precision = MT_BF16;
    c->micro_batch_size = 1;
    c->global_batch_size = 1;
    c->train_iters = 1;
    c->hidden_dropout = 0.0;
    c->attention_dropout = 0.0;
    if (!strcmp(name, "gpt2-1.5b")) { /* GPT-2 XL */
        c->num_layers = 48, c->hidden_size = 1600, c->num_attention_heads = 25, c->seq_length = 1024;
        c->vocab_size = 50257;
        return 1;
    }
    if (!strcmp(name, "llama-3.2-1b")) { /* Llama-3.2-1B: GQA 32 heads in 8 groups, tied embeddings */
        c->num_layers = 16, c->hidden_size = 2048, c->num_attention_heads = 32, c->num_query_groups = 8;
        c->kv_channels = 64, c->ffn_hidden_size = 8192, c->seq_length = 2048, c->vocab_size = 128256;
        c->normalization = MT_NORM_RMSNORM, c->swiglu = 1, c->position_embedding_type = MT_POSITION_ROPE;
        c->add_bias_linear = 0, c->rotary_base = 500000.0, c->use_rope_scaling = 1, c->rope_scaling_factor = 32.0;
        c->norm_epsilon = 1e-5;
        return 1;
    }
    return 0;
}

/* The decode GEMV against cuBLAS for the linears of both models (y [n, M] = x [n, K] W^T, bf16): a line per
 * shape and row count with both times, their GB/s and share of the copy bandwidth, and cuBLAS's time over
 * ours; then per model and row count a layer's four linears together (the decode step's weight stream). */
static int gemv_table(mt_trainer* t, double bandwidth) {
    static const struct {
        const char* model;
        const char* name;
        int M, K;
    } shapes[] = {{"gpt2-1.5b", "qkv", 4800, 1600},    {"gpt2-1.5b", "proj", 1600, 1600},
                  {"gpt2-1.5b", "fc1", 6400, 1600},    {"gpt2-1.5b", "fc2", 1600, 6400},
                  {"llama-3.2-1b", "qkv", 3072, 2048}, {"llama-3.2-1b", "proj", 2048, 2048},
                  {"llama-3.2-1b", "fc1", 16384, 2048}, {"llama-3.2-1b", "fc2", 2048, 8192}};
    enum { NSHAPES = sizeof(shapes) / sizeof(shapes[0]), NROWS = 5 };
    static const int rows[NROWS] = {1, 2, 4, 8, 16};
    double ours[NSHAPES][NROWS], theirs[NSHAPES][NROWS], moved[NSHAPES][NROWS];
    mt_error err;
    printf("decode GEMV against cuBLAS, bf16, copy bandwidth %.0f GB/s (median of 21 x 10 launches, weights not in L2)\n",
           bandwidth / 1e9);
    printf("%-13s %-5s %6s %6s %3s %9s %8s %6s %9s %8s %6s %7s\n", "model", "layer", "M", "K", "n", "gemv us", "GB/s", "%bw",
           "cublas us", "GB/s", "%bw", "cublas/");
    for (int i = 0; i < NSHAPES; i++)
        for (int k = 0; k < NROWS; k++) {
            const int n = rows[k], M = shapes[i].M, K = shapes[i].K;
            double a = 0.0, b = 0.0;
            if (mt_decode_gemv_benchmark(t, n, M, K, &a, &b, &err) != MT_OK) {
                fprintf(stderr, "%s\n", err.message);
                return 1;
            }
            const double bytes = 2.0 * ((double)M * K + (double)n * K + (double)n * M);
            ours[i][k] = a, theirs[i][k] = b, moved[i][k] = bytes;
            printf("%-13s %-5s %6d %6d %3d %9.2f %8.0f %5.1f%% %9.2f %8.0f %5.1f%% %6.2fx\n", shapes[i].model, shapes[i].name, M,
                   K, n, a * 1e6, bytes / a / 1e9, 100.0 * bytes / a / bandwidth, b * 1e6, bytes / b / 1e9,
                   100.0 * bytes / b / bandwidth, b / a);
            fflush(stdout);
        }
    printf("a layer's four linears (separate launches, no overlap):\n");
    for (int i = 0; i < NSHAPES; i += 4)
        for (int k = 0; k < NROWS; k++) {
            double a = 0.0, b = 0.0, bytes = 0.0;
            for (int j = i; j < i + 4 && j < NSHAPES; j++) a += ours[j][k], b += theirs[j][k], bytes += moved[j][k];
            printf("%-13s %-5s %6s %6s %3d %9.2f %8.0f %5.1f%% %9.2f %8.0f %5.1f%% %6.2fx\n", shapes[i].model, "all", "", "",
                   rows[k], a * 1e6, bytes / a / 1e9, 100.0 * bytes / a / bandwidth, b * 1e6, bytes / b / 1e9,
                   100.0 * bytes / b / bandwidth, b / a);
        }
    return 0;
}

/* B requests of `prompt` random tokens (from the generator state *x), each generating `new_tokens`, added to g;
 * 0 or 1 with the error printed. */
static int add_requests(mt_generator* g, int B, int prompt, int new_tokens, uint64_t* x) {
    int32_t* p = (int32_t*)malloc(sizeof(int32_t) * prompt);
    mt_sampling s;
    memset(&s, 0, sizeof(s));
    s.max_new_tokens = new_tokens;
    mt_error err;
    for (int r = 0; p && r < B; r++) {
        for (int i = 0; i < prompt; i++) *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17, p[i] = (int32_t)(*x % 50000);
        int64_t id;
        if (mt_generator_add(g, p, prompt, &s, &id, &err) != MT_OK) {
            fprintf(stderr, "%s\n", err.message);
            free(p);
            return 1;
        }
    }
    free(p);
    return p ? 0 : 1;
}

int main(int argc, char** argv) {
    const char* model = "gpt2-1.5b";
    char batches[128] = "1,8,64";
    int prompt = 128, new_tokens = 256, gemv = 0;
    for (int i = 1; i < argc; i++) {
        const char* v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--model") && v) model = v, i++;
        else if (!strcmp(argv[i], "--batches") && v) snprintf(batches, sizeof(batches), "%s", v), i++;
        else if (!strcmp(argv[i], "--prompt") && v) prompt = atoi(v), i++;
        else if (!strcmp(argv[i], "--new") && v) new_tokens = atoi(v), i++;
        else if (!strcmp(argv[i], "--gemv")) gemv = 1;
        else {
            fprintf(stderr, "usage: %s [--model gpt2-1.5b|llama-3.2-1b] [--batches 1,8,64] [--prompt N] [--new N] "
                    "[--gemv]\n", argv[0]);
            return 2;
        }
    }
    mt_config c;
    if (!model_config(model, &c)) {
        fprintf(stderr, "unknown model %s (gpt2-1.5b, llama-3.2-1b)\n", model);
        return 2;
    }
    if (prompt < 1 || new_tokens < 2 || prompt + new_tokens > c.seq_length) {
        fprintf(stderr, "--prompt %d --new %d: need prompt >= 1, new >= 2, prompt + new <= %d\n", prompt, new_tokens,
                c.seq_length);
        return 2;
    }
    mt_error err;
    mt_trainer* t = NULL;
    double bandwidth = 0.0;
    if (mt_config_finalize(&c, &err) != MT_OK || mt_trainer_create(&t, &c, &err) != MT_OK ||
        mt_device_copy_bandwidth(&bandwidth, &err) != MT_OK) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    if (gemv) {
        const int rc = gemv_table(t, bandwidth);
        mt_trainer_free(t);
        return rc;
    }
    const double elem = 2.0;
    const int64_t params = mt_num_parameters(&c);
    const int64_t positions = c.position_embedding_type == MT_POSITION_LEARNED ? (int64_t)c.max_position_embeddings * c.hidden_size : 0;
    const double weight_bytes = (double)(params - positions) * elem; /* the position table is read a row a token */
    const double kv_per_position = (double)c.num_layers * 2 * c.num_query_groups * c.kv_channels * elem;
    printf("%s: %.3f B parameters (bf16 %.2f GB read a step), copy bandwidth %.0f GB/s, prompt %d, %d new tokens\n", model,
           params / 1e9, weight_bytes / 1e9, bandwidth / 1e9, prompt, new_tokens);
    printf("%6s %10s %12s %10s %14s %10s\n", "batch", "TTFT ms", "tokens/s", "ms/step", "bound tok/s", "of bound");
    for (char* at = batches; *at;) {
        const int B = atoi(at);
        while (*at && *at != ',') at++;
        if (*at == ',') at++;
        if (B < 1 || B > MT_GEN_MAX_BATCH) continue;
        mt_generator* g = NULL;
        mt_generator_config gc = {B, prompt + new_tokens + 1, 64, 0, 0};
        if (mt_generator_create(&g, t, &gc, &err) != MT_OK) {
            fprintf(stderr, "batch %d: %s\n", B, err.message);
            return 1;
        }
        mt_generated* out = (mt_generated*)malloc(sizeof(mt_generated) * B);
        uint64_t x = 88172645463325252ull;
        int n = 0, steps = 0;
        mt_status st = MT_OK;
        /* the untimed round: first launches, cuBLAS's first calls, the decode step's graph capture */
        if (add_requests(g, B, prompt, 4, &x)) return 1;
        while (st == MT_OK && mt_generator_running(g) > 0) st = mt_generator_step(g, out, B, &n, &err);
        if (st != MT_OK || add_requests(g, B, prompt, new_tokens, &x)) {
            if (st != MT_OK) fprintf(stderr, "%s\n", err.message);
            return 1;
        }
        const double t0 = now_s();
        st = mt_generator_step(g, out, B, &n, &err);
        const double t1 = now_s();
        while (st == MT_OK && mt_generator_running(g) > 0) st = mt_generator_step(g, out, B, &n, &err), steps++;
        const double t2 = now_s();
        if (st != MT_OK) {
            fprintf(stderr, "%s\n", err.message);
            return 1;
        }
        const double step_s = (t2 - t1) / steps;
        const double bytes = weight_bytes + B * (prompt + new_tokens / 2.0) * kv_per_position;
        const double bound = B / (bytes / bandwidth);
        printf("%6d %10.2f %12.1f %10.3f %14.1f %9.1f%%\n", B, (t1 - t0) * 1e3, B / step_s, step_s * 1e3, bound,
               100.0 * (B / step_s) / bound);
        printf("RESULT {\"model\": \"%s\", \"batch\": %d, \"ttft_ms\": %.3f, \"tokens_per_s\": %.2f, \"ms_per_step\": "
               "%.4f, \"bound_tokens_per_s\": %.2f, \"of_bound\": %.2f}\n", model, B, (t1 - t0) * 1e3, B / step_s,
               step_s * 1e3, bound, 100.0 * (B / step_s) / bound);
        fflush(stdout);
        free(out);
        mt_generator_free(g);
    }
    mt_trainer_free(t);
    return 0;
}
