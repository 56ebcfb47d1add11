/*
 * train_gpt.c — the command-line trainer: Megatron's pretrain_gpt.py flags -> mt_config, the data
 * pipeline (Megatron's .bin/.idx datasets and sample index), the training loop through the trainer
 * API, Megatron's log line, evaluation, checkpoints and a text sample at the end.
 *
 *   ./train_gpt                                  the built-in job: a small GPT on tiny shakespeare
 *   ./train_gpt --num-layers 12 --hidden-size 768 ... --data-path my_text_document
 *
 * Without --data-path every flag defaults to the built-in job (the corpus is tokenized on first use
 * into dev/data/tinyshakespeare_text_document.{bin,idx}). With --data-path, Megatron's defaults and
 * required flags apply. An unknown flag or an inconsistent configuration is one line and exit 2.
 */
#include <errno.h>
#include <stdint.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#ifdef MT_USE_MPI
#include <mpi.h>
#endif

#include "megatron.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

#include "train_gpt_flags.h"

static int g_rank = 0, g_world = 1; /* for error lines only: which of the N processes failed */

static void die(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (g_world > 1) fprintf(stderr, "train_gpt: rank %d: ", g_rank);
    else fprintf(stderr, "train_gpt: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
#ifdef MT_USE_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    exit(code);
}

/* ---- flags (the table, the parser and --help are in train_gpt_flags.h) ------------------------ */

static void parse_args(tg_flags* o, int argc, char** argv) {
    char msg[512];
    tg_flags_init(o);
    int r = tg_flags_parse(o, argc, argv, msg, sizeof(msg));
    if (r == 1) {
        tg_flags_help(stdout);
        exit(0);
    }
    if (r < 0 || tg_flags_apply(o, msg, sizeof(msg)) != 0) die(2, "%s", msg);
    if (o->builtin) o->log_throughput = 1; /* the built-in job shows its speed */
}

/* ---- tokenizer and the built-in corpus ------------------------------------------------------- */

static mt_tokenizer* load_tokenizer(tg_flags* o) {
    mt_error err;
    mt_tokenizer* tok = NULL;
    const char* type = o->tokenizer_type ? o->tokenizer_type : "GPT2BPETokenizer";
    if (o->builtin && !o->vocab_file) {
        o->vocab_file = "dev/data/gpt2/gpt2-vocab.json";
        o->merge_file = "dev/data/gpt2/gpt2-merges.txt";
    }
    if (!strcmp(type, "GPT2BPETokenizer")) {
        if (!o->vocab_file || !o->merge_file) die(2, "GPT2BPETokenizer needs --vocab-file and --merge-file");
        if (mt_tokenizer_load_gpt2(&tok, o->vocab_file, o->merge_file, &err) != MT_OK) die(1, "%s", err.message);
    } else if (!strcmp(type, "TikTokenizer") || !strcmp(type, "Llama3Tokenizer")) {
        if (!o->tokenizer_model) die(2, "--tokenizer-type %s needs --tokenizer-model", type);
        mt_tokenizer_kind kind = MT_TOKENIZER_CL100K;
        if (!strcmp(type, "Llama3Tokenizer") || strstr(o->tokenizer_model, "tokenizer.model")) kind = MT_TOKENIZER_LLAMA3;
        else if (strstr(o->tokenizer_model, "o200k")) kind = MT_TOKENIZER_O200K;
        else if (strstr(o->tokenizer_model, "r50k")) kind = MT_TOKENIZER_GPT2;
        if (mt_tokenizer_load_tiktoken(&tok, o->tokenizer_model, kind, &err) != MT_OK) die(1, "%s", err.message);
    } else if (!strcmp(type, "NullTokenizer")) {
        if (o->null_vocab_size <= 0) die(2, "NullTokenizer needs --vocab-size");
        return NULL;
    } else {
        die(2, "--tokenizer-type %s: expected GPT2BPETokenizer, TikTokenizer, Llama3Tokenizer or NullTokenizer", type);
    }
    return tok;
}

/* Tokenizes dev/data/tinyshakespeare.txt into Megatron's format, one document per blank-line
 * separated passage with the end-of-document token appended (preprocess_data --append-eod). */
static void prepare_builtin_corpus(const mt_tokenizer* tok, const char* prefix) {
    char path[512];
    snprintf(path, sizeof(path), "%s.idx", prefix);
    if (access(path, R_OK) == 0) return;
    const char* text_path = "dev/data/tinyshakespeare.txt";
    FILE* f = fopen(text_path, "rb");
    if (!f) die(1, "cannot open the built-in corpus %s (run from the repository root)", text_path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* text = (char*)malloc((size_t)size + 1);
    if (!text || fread(text, 1, (size_t)size, f) != (size_t)size) die(1, "cannot read %s", text_path);
    fclose(f);
    text[size] = 0;
    mt_error err;
    mt_indexed_writer* w = NULL;
    if (mt_indexed_writer_open(&w, prefix, mt_indexed_dtype_for_vocab(mt_tokenizer_vocab_size(tok)), &err) != MT_OK)
        die(1, "%s", err.message);
    int32_t* tokens = NULL;
    size_t count = 0, cap = 0;
    long start = 0;
    int64_t docs = 0;
    while (start < size) {
        char* sep = strstr(text + start, "\n\n");
        long end = sep ? (long)(sep - text) + 2 : size;
        count = 0;
        if (mt_tokenizer_encode(tok, text + start, (size_t)(end - start), &tokens, &count, &cap) < 0)
            die(1, "cannot tokenize the built-in corpus");
        if (count > 0) {
            if (count == cap) {
                cap = cap * 2 + 16;
                tokens = (int32_t*)realloc(tokens, cap * sizeof(int32_t));
            }
            tokens[count++] = mt_tokenizer_eod(tok);
            int64_t len = (int64_t)count;
            if (mt_indexed_writer_add_document(w, tokens, &len, 1, &err) != MT_OK) {
                mt_indexed_writer_abort(w);
                die(1, "%s", err.message);
            }
            docs++;
        }
        start = end;
    }
    if (mt_indexed_writer_finalize(w, &err) != MT_OK) die(1, "%s", err.message);
    free(tokens);
    free(text);
    printf("prepared the built-in corpus: %lld documents -> %s.{bin,idx}\n", (long long)docs, prefix);
}

/* ---- logging ---------------------------------------------------------------------------------- */

static double now_seconds(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

static void timestamp(char* buf, size_t n) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    localtime_r(&tv.tv_sec, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(buf, n, "%s.%06ld", base, (long)tv.tv_usec);
}

static void print_memory_plan(mt_trainer* t, const mt_config* c) {
    mt_memory_plan p = mt_trainer_memory_plan(t);
    double gib = 1024.0 * 1024.0 * 1024.0;
    char name[256];
    size_t free_bytes = 0, total_bytes = 0;
    mt_error err;
    mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err);
    printf("memory plan per GPU (%s, %lld parameters%s, %s):\n", name, (long long)p.num_parameters,
           c->tensor_model_parallel_size > 1 ? " of this tensor-parallel rank" : "",
           c->precision == MT_FP32 ? "fp32" : c->precision == MT_BF16 ? "bf16" : "fp16");
    printf("  parameters   %8.3f GiB  (%zu bytes/param)\n", p.parameter_bytes / gib,
           p.num_parameters ? p.parameter_bytes / (size_t)p.num_parameters : 0);
    printf("  master fp32  %8.3f GiB\n", p.master_bytes / gib);
    printf("  gradients    %8.3f GiB  (fp32)\n", p.gradient_bytes / gib);
    printf("  optimizer    %8.3f GiB  (Adam m, v fp32)\n", p.optimizer_bytes / gib);
    printf("  activations  %8.3f GiB  (micro-batch %d x %d tokens)\n", p.activation_bytes / gib, c->micro_batch_size,
           c->seq_length);
    printf("  workspace    %8.3f GiB\n", p.workspace_bytes / gib);
    if (c->fp8_format != MT_FP8_NONE)
        printf("  fp8          %8.3f GiB  (weights' FP8 copies, scaling state, cast scratch)\n", p.fp8_bytes / gib);
    size_t state = p.parameter_bytes + p.master_bytes + p.gradient_bytes + p.optimizer_bytes;
    printf("  model state  %8.3f GiB  (%.2f bytes/param; the device reported %.3f GiB)\n", state / gib,
           (double)state / (double)p.num_parameters, p.state_bytes_measured / gib);
    printf("  total        %8.3f GiB planned; device reports %.3f GiB in use of %.3f GiB\n", p.total_bytes / gib,
           (total_bytes - free_bytes) / gib, total_bytes / gib);
}

/* ---- data ------------------------------------------------------------------------------------- */

/* Fills tokens [micro-batches, mbs, S+1] with this data-parallel rank's part of the global batch
 * that starts at sample `consumed` (Megatron's MegatronPretrainingSampler: micro-batch j of every
 * rank comes from the chunk of mbs * dp samples at consumed + j * mbs * dp; rank r takes the r-th mbs). */
static uint64_t mock_token(uint64_t seed, int split, int64_t sample, int position) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)split << 60) ^ ((uint64_t)sample << 20) ^ (uint64_t)position;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return x;
}

/* Samples in a split; --mock-data has no end. */
static int64_t split_samples(const mt_gpt_data* data, int split) {
    return data ? mt_gpt_data_num_samples(data, split) : INT64_MAX;
}

static void fetch_batch(const mt_gpt_data* data, int split, int64_t consumed, int micro, const mt_config* c,
                        int32_t* tokens) {
    mt_error err;
    int64_t n = split_samples(data, split);
    int mbs = c->micro_batch_size, dp = c->data_parallel_size, dp_rank = mt_rank_coordinates(c, c->rank).dp;
    for (int j = 0; j < micro; j++) {
        for (int k = 0; k < mbs; k++) {
            int64_t index = mt_sampler_index(consumed + (int64_t)j * mbs * dp, mbs, dp_rank, k);
            if (index >= n)
                die(1, "the %s split ran out of samples at %lld of %lld", mt_split_name(split), (long long)index, (long long)n);
            int32_t* row = tokens + ((int64_t)j * mbs + k) * (c->seq_length + 1);
            if (!data) { /* --mock-data: a fixed function of (seed, split, sample, position) */
                for (int i = 0; i <= c->seq_length; i++)
                    row[i] = (int32_t)(mock_token(c->seed, split, index, i) % (uint64_t)c->vocab_size);
            } else if (mt_gpt_data_get(data, split, index, row, &err) != MT_OK) {
                die(1, "%s", err.message);
            }
        }
    }
}

/* Mean loss over eval_iters global batches of a split, continuing from *consumed (Megatron's
 * validation iterator carries on across evaluations); with --eod-mask-loss, the loss sum over the
 * counted positions of all of them, as Megatron's evaluate totals numerator and denominator. */
static double evaluate(mt_trainer* t, const mt_gpt_data* data, int split, int64_t* consumed, int64_t eval_iters,
                       const mt_config* c, int32_t* tokens) {
    mt_error err;
    double total = 0.0, counted = 0.0;
    int micro = mt_num_micro_batches(c);
    for (int64_t k = 0; k < eval_iters; k++) {
        fetch_batch(data, split, *consumed, micro, c, tokens);
        *consumed += c->global_batch_size;
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, micro, &loss, &err) != MT_OK) die(1, "%s", err.message);
        double n = c->eod_mask_loss ? (double)mt_trainer_last_loss_tokens(t) : 1.0;
        total += loss * n;
        counted += n;
    }
    return total / counted;
}

/* The most micro-batches an iteration of this run has (a step schedule's sizes need not grow). */
static int max_micro_batches(const mt_config* c) {
    int most = mt_num_micro_batches(c);
    for (int i = 0; i < c->num_batch_size_steps; i++) {
        int m = c->batch_size_step_size[i] / (c->micro_batch_size * c->data_parallel_size);
        if (m > most) most = m;
    }
    return most;
}

/* --data-cache-path: rank 0 writes the index arrays of every dataset and split there as .npy files
 * in Megatron's dtypes (document, sample and shuffle index; a blend's dataset and sample index),
 * named after the dataset and what it was built for. The run itself always builds them afresh. */
static void write_index_cache(const mt_gpt_data* data, const char* dir, const mt_config* c) {
    mt_error err;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) die(1, "--data-cache-path %s: cannot create it: %s", dir, strerror(errno));
    int files = 0;
    for (int split = 0; split < 3; split++) {
        for (int k = 0; k < mt_gpt_data_num_datasets(data); k++) {
            const mt_gpt_dataset* g = mt_gpt_data_dataset(data, split, k);
            if (!g) continue;
            const char* prefix = mt_indexed_dataset_prefix(mt_gpt_data_indexed(data, k));
            const char* base = strrchr(prefix, '/') ? strrchr(prefix, '/') + 1 : prefix;
            char name[512];
            snprintf(name, sizeof(name), "%s-GPTDataset-%s-seq%d-seed%llu-samples%lld-", base, mt_split_name(split),
                     c->seq_length, (unsigned long long)c->seed, (long long)mt_gpt_dataset_num_samples(g));
            if (mt_gpt_dataset_save_indices(g, dir, name, &err) != MT_OK) die(1, "%s", err.message);
            files += 3;
        }
        if (mt_gpt_data_is_blended(data) && mt_gpt_data_num_samples(data, split) > 0) {
            int64_t n = mt_gpt_data_num_samples(data, split);
            char path[1024];
            snprintf(path, sizeof(path), "%s/BlendedDataset-%s-seed%llu-dataset_index.npy", dir, mt_split_name(split),
                     (unsigned long long)c->seed);
            if (mt_npy_write(path, "<i2", 1, &n, mt_gpt_data_blend_dataset_index(data, split), &err) != MT_OK)
                die(1, "%s", err.message);
            snprintf(path, sizeof(path), "%s/BlendedDataset-%s-seed%llu-dataset_sample_index.npy", dir,
                     mt_split_name(split), (unsigned long long)c->seed);
            if (mt_npy_write(path, "<i8", 1, &n, mt_gpt_data_blend_sample_index(data, split), &err) != MT_OK)
                die(1, "%s", err.message);
            files += 2;
        }
    }
    printf("data: wrote %d index arrays to %s\n", files, dir);
}

static void print_validation(const char* what, int64_t iteration, double loss) {
    char line[256];
    int n = snprintf(line, sizeof(line), " %s loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E | ",
                     what, (long long)iteration, loss, exp(loss < 20 ? loss : 20));
    char dashes[256];
    memset(dashes, '-', (size_t)n);
    dashes[n] = 0;
    printf("%s\n%s\n%s\n", dashes, line, dashes);
}

/* ---- sampling --------------------------------------------------------------------------------- */

static void print_sample(mt_trainer* t, const mt_tokenizer* tok, const mt_config* c, int num_tokens, uint64_t seed) {
    if (!tok || num_tokens <= 0) return;
    mt_error err;
    int S = c->seq_length;
    int32_t* context = (int32_t*)malloc(sizeof(int32_t) * (size_t)S);
    float* logits = (float*)malloc(sizeof(float) * (size_t)c->padded_vocab_size);
    double* probs = (double*)malloc(sizeof(double) * (size_t)c->vocab_size);
    int len = 1;
    context[0] = mt_tokenizer_eod(tok);
    uint64_t rng = seed * 2862933555777941757ull + 3037000493ull;
    printf("sample (temperature 0.8, %d tokens):\n---\n", num_tokens);
    for (int i = 0; i < num_tokens; i++) {
        int start = len > S ? len - S : 0;
        if (mt_trainer_next_token_logits(t, context + start, len - start, logits, &err) != MT_OK) die(1, "%s", err.message);
        double mx = -1e30, sum = 0.0;
        for (int64_t v = 0; v < c->vocab_size; v++) if (logits[v] > mx) mx = logits[v];
        for (int64_t v = 0; v < c->vocab_size; v++) sum += probs[v] = exp((logits[v] - mx) / 0.8);
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        double u = (double)(rng >> 11) / 9007199254740992.0 * sum, acc = 0.0;
        int32_t next = (int32_t)(c->vocab_size - 1);
        for (int64_t v = 0; v < c->vocab_size; v++) { acc += probs[v]; if (acc > u) { next = (int32_t)v; break; } }
        if (next == mt_tokenizer_eod(tok)) break;
        const char* bytes = NULL;
        size_t n = mt_tokenizer_token_bytes(tok, next, &bytes);
        fwrite(bytes, 1, n, stdout);
        if (len == S) { memmove(context, context + 1, sizeof(int32_t) * (size_t)(S - 1)); len--; }
        context[len++] = next;
    }
    printf("\n---\n");
    free(context);
    free(logits);
    free(probs);
}

/* ---- main ------------------------------------------------------------------------------------- */

int main(int argc, char** argv) {
    /* launch: one process per GPU, started by mpirun or srun. MPI gives each its rank and its GPU
     * on the node (the rank among the processes that share the node's memory); rank 0 makes the
     * NCCL id and MPI sends it to everyone. Only rank 0 writes the log. */
    int rank = 0, world = 1, local_rank = -1;
    mt_comm_id comm_id;
    memset(&comm_id, 0, sizeof(comm_id));
#ifdef MT_USE_MPI
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    g_rank = rank;
    g_world = world;
    if (world > 1) {
        MPI_Comm node;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &local_rank);
        MPI_Comm_free(&node);
        mt_error id_err;
        int ok = rank != 0 || mt_comm_id_create(&comm_id, &id_err) == MT_OK;
        if (!ok) die(1, "%s", id_err.message);
        MPI_Bcast(&comm_id, (int)sizeof(comm_id), MPI_BYTE, 0, MPI_COMM_WORLD);
        if (rank != 0 && !freopen("/dev/null", "w", stdout)) die(1, "cannot silence stdout: %s", strerror(errno));
    }
#endif
    tg_flags o;
    parse_args(&o, argc, argv);
    double t_launch = now_seconds(); /* --exit-duration-in-mins counts from here, as Megatron from its start */
    {
        char info[4096];
        tg_flags_info_line(&o, info, sizeof(info));
        if (info[0]) printf("%s\n", info);
    }
    mt_config* c = &o.cfg;
    c->world_size = world;
    c->rank = rank;
    c->local_rank = local_rank;
    c->comm_id = comm_id;

    mt_tokenizer* tok = load_tokenizer(&o);
    c->vocab_size = tok ? mt_tokenizer_vocab_size(tok) : o.null_vocab_size;
    c->eod_token = tok ? mt_tokenizer_eod(tok) : o.null_vocab_size - 1; /* NullTokenizer: the last id */
    mt_error err;
    if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
    {   /* the validation samples Megatron asks for: (train_iters / eval_interval + 1) x eval_iters x gbs */
        int64_t evals = (o.eval_interval > 0 ? c->train_iters / o.eval_interval : 0) + 1, t;
        if (mt_mul_overflows_i64(evals, o.eval_iters, &t) || mt_mul_overflows_i64(t, c->global_batch_size, &t) ||
            mt_mul_overflows_i64(t, (int64_t)c->seq_length + 1, &t))
            die(2, "--eval-iters %lld: the validation samples (%lld evaluations x --eval-iters x --global-batch-size "
                "%d) x --seq-length %d tokens overflows", (long long)o.eval_iters, (long long)evals,
                c->global_batch_size, c->seq_length);
    }
    if (o.builtin) {
        static const char* builtin_prefix = "dev/data/tinyshakespeare_text_document";
        if (rank == 0) prepare_builtin_corpus(tok, builtin_prefix);
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD); /* the others read what rank 0 wrote */
#endif
        o.data_paths[0] = builtin_prefix;
        o.num_data_paths = 1;
    }

    /* data: Megatron's sample counts and indices */
    int64_t num_samples[3];
    mt_gpt_num_samples(c->train_iters, o.eval_interval, o.eval_iters, c->global_batch_size, num_samples);
    if (c->train_samples > 0) num_samples[0] = c->train_samples;
    mt_gpt_data* data = NULL;
    if (o.mock_data) {
        printf("data: --mock-data, random tokens\n");
    } else {
        if (mt_gpt_data_open(&data, o.num_data_paths, o.data_paths, o.weighted ? o.data_weights : NULL, o.split,
                             c->seq_length, (uint32_t)c->seed, num_samples, &err) != MT_OK)
            die(1, "%s", err.message);
        printf("data: %d dataset(s), split '%s': train %lld, valid %lld, test %lld samples of %d tokens\n",
               o.num_data_paths, o.split, (long long)mt_gpt_data_num_samples(data, MT_SPLIT_TRAIN),
               (long long)mt_gpt_data_num_samples(data, MT_SPLIT_VALID),
               (long long)mt_gpt_data_num_samples(data, MT_SPLIT_TEST), c->seq_length);
        if (o.data_cache_path && rank == 0) write_index_cache(data, o.data_cache_path, c);
    }

    printf("model: %d layers, hidden %d, %d heads, ffn %d, seq %d, vocab %lld (padded %lld), micro-batch %d, "
           "global batch %d, %lld iterations\n",
           c->num_layers, c->hidden_size, c->num_attention_heads, c->ffn_hidden_size, c->seq_length,
           (long long)c->vocab_size, (long long)c->padded_vocab_size, c->micro_batch_size, c->global_batch_size,
           (long long)c->train_iters);
    printf("parallel: %d GPU(s), data-parallel %d, tensor-parallel %d%s, pipeline-parallel %d%s%s%s\n", c->world_size,
           c->data_parallel_size, c->tensor_model_parallel_size, c->sequence_parallel ? " (sequence parallel)" : "",
           c->pipeline_model_parallel_size,
           c->use_distributed_optimizer ? ", distributed optimizer" : "",
           c->overlap_grad_reduce ? ", overlapped grad reduce" : "", c->overlap_param_gather ? ", overlapped param gather" : "");
    mt_trainer* t = NULL;
    if (mt_trainer_create(&t, c, &err) != MT_OK) die(1, "%s", err.message);
    print_memory_plan(t, c);

    int64_t iteration = 0, consumed = 0, consumed_valid = 0;
    if (o.load) {
        char tracker[4096];
        snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", o.load);
        if (access(tracker, R_OK) == 0) {
            /* --no-load-optim / --finetune: the weights only; --finetune also starts at iteration 0 */
            mt_status st = o.no_load_optim || o.finetune
                               ? mt_trainer_load_weights(t, o.load, -1, &iteration, &consumed, &err)
                               : mt_trainer_load(t, o.load, -1, &iteration, &consumed, &err);
            if (st != MT_OK) die(1, "%s", err.message);
            printf("loaded checkpoint from %s at iteration %lld (%lld samples consumed)%s\n", o.load,
                   (long long)iteration, (long long)consumed,
                   o.finetune ? ": weights only, starting at iteration 0 (--finetune)"
                   : o.no_load_optim ? ": weights only (--no-load-optim)" : "");
            if (o.finetune) iteration = consumed = 0;
            if (o.eval_interval > 0) consumed_valid = (iteration / o.eval_interval) * o.eval_iters * c->global_batch_size;
        } else {
            printf("no checkpoint found in %s: training from scratch\n", o.load);
        }
    }

    double peak = o.peak_tflops > 0 ? o.peak_tflops : mt_device_peak_tflops(c->precision);
    size_t rank_samples = (size_t)max_micro_batches(c) * c->micro_batch_size; /* this rank's largest share */
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * rank_samples * (c->seq_length + 1));
    if (!tokens) die(1, "cannot allocate the batch");
    double interval_loss = 0.0, interval_time = 0.0;
    int interval_steps = 0, interval_skipped = 0, interval_nan = 0, exiting = 0;
    int saved = o.save_interval > 0 && iteration > 0 && iteration % o.save_interval == 0; /* this iteration is on disk */
    double t_start = now_seconds();
    while (iteration < c->train_iters) {
        /* this iteration's global batch (a --rampup-batch-size / --step-batch-size-schedule grows it) */
        int micro = mt_num_micro_batches_at(c, consumed);
        int batch = micro * c->micro_batch_size * c->data_parallel_size;
        fetch_batch(data, MT_SPLIT_TRAIN, consumed, micro, c, tokens);
        if (o.profile && rank == 0 && iteration == o.profile_step_start && mt_device_profiler(1, &err) != MT_OK)
            die(1, "--profile: %s", err.message);
        double t0 = now_seconds();
        mt_step_result r;
        if (mt_trainer_train_step_n(t, tokens, micro, &r, &err) != MT_OK)
            die(1, "iteration %lld: %s", (long long)iteration + 1, err.message);
        interval_time += now_seconds() - t0;
        iteration++;
        consumed += batch;
        saved = 0;
        if (o.profile && rank == 0 && iteration == o.profile_step_end && mt_device_profiler(0, &err) != MT_OK)
            die(1, "--profile: %s", err.message);
        if (r.skipped) interval_skipped++;
        else interval_loss += r.lm_loss;
        if (r.nan) interval_nan++;
        interval_steps++;

        if (iteration % o.log_interval == 0 || iteration == c->train_iters) {
            double ms = 1000.0 * interval_time / interval_steps;
            double tflops = mt_flops_per_iteration(c, batch) / (ms / 1000.0) / 1e12 / c->world_size;
            int good = interval_steps - interval_skipped;
            char ts[64], throughput[128] = "", mfu[64] = "";
            timestamp(ts, sizeof(ts));
            if (o.log_throughput) { /* Megatron prints the field only with --log-throughput; MFU is this build's */
                snprintf(throughput, sizeof(throughput), " throughput per GPU (TFLOP/s/GPU): %.1f |", tflops);
                snprintf(mfu, sizeof(mfu), " MFU: %.1f%% |", peak > 0 ? 100.0 * tflops / peak : 0.0);
            }
            printf(" [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f |%s"
                   " learning rate: %.6E | global batch size: %5d | lm loss: %.6E | loss scale: %.1f | grad norm: %.3f | "
                   "number of skipped iterations: %3d | number of nan iterations: %3d |%s\n",
                   ts, (long long)iteration, (long long)c->train_iters, (long long)consumed, ms, throughput,
                   r.next_learning_rate, batch, good ? interval_loss / good : 0.0, r.loss_scale, r.grad_norm,
                   interval_skipped, interval_nan, mfu);
            fflush(stdout);
            interval_loss = interval_time = 0.0;
            interval_steps = interval_skipped = interval_nan = 0;
        }
        if (o.eval_interval > 0 && iteration % o.eval_interval == 0 && o.eval_iters > 0 &&
            split_samples(data, MT_SPLIT_VALID) > 0) {
            print_validation("validation", iteration, evaluate(t, data, MT_SPLIT_VALID, &consumed_valid, o.eval_iters, c, tokens));
        }
        if (o.save && o.save_interval > 0 && iteration % o.save_interval == 0) {
            if (mt_trainer_save(t, o.save, iteration, consumed, &err) != MT_OK) die(1, "%s", err.message);
            printf("saved checkpoint at iteration %lld to %s\n", (long long)iteration, o.save);
            saved = 1;
        }
        if (o.exit_duration_in_mins > 0) { /* every rank stops together: the longest-running one decides */
            int over = (now_seconds() - t_launch) / 60.0 > (double)o.exit_duration_in_mins;
#ifdef MT_USE_MPI
            if (world > 1) MPI_Allreduce(MPI_IN_PLACE, &over, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
#endif
            if (over) { exiting = 1; break; }
        }
        if (o.exit_interval > 0 && iteration % o.exit_interval == 0) break;
    }
    if (!exiting) { /* --exit-duration-in-mins stops as Megatron does: a checkpoint, no final evaluation */
        printf("training took %.1f s\n", now_seconds() - t_start);
        /* as Megatron: validation and test losses at the end of training */
        if (o.eval_iters > 0 && split_samples(data, MT_SPLIT_VALID) >= consumed_valid + o.eval_iters * c->global_batch_size)
            print_validation("validation", iteration, evaluate(t, data, MT_SPLIT_VALID, &consumed_valid, o.eval_iters, c, tokens));
        if (o.eval_iters > 0 && split_samples(data, MT_SPLIT_TEST) >= o.eval_iters * c->global_batch_size) {
            int64_t consumed_test = 0;
            double test_loss = evaluate(t, data, MT_SPLIT_TEST, &consumed_test, o.eval_iters, c, tokens);
            print_validation("test", iteration, test_loss);
        }
    }
    if (o.save && !saved) { /* unless the last iteration's --save-interval just saved */
        if (mt_trainer_save(t, o.save, iteration, consumed, &err) != MT_OK) die(1, "%s", err.message);
        printf("saved checkpoint at iteration %lld to %s\n", (long long)iteration, o.save);
    }
    if (exiting)
        printf("exiting program after %.2f minutes (--exit-duration-in-mins %lld)\n", (now_seconds() - t_launch) / 60.0,
               (long long)o.exit_duration_in_mins);
    else /* every rank samples (the same tokens: same seed; with tensor parallelism the forward needs the
          * whole TP group); only rank 0's stdout is open */
        print_sample(t, tok, c, o.sample_tokens, c->seed);

    free(tokens);
    mt_trainer_free(t);
    if (data) mt_gpt_data_close(data);
    if (tok) mt_tokenizer_free(tok);
#ifdef MT_USE_MPI
    MPI_Finalize();
#endif
    return 0;
}
