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

#define MAX_DATA_PATHS 64

/* Everything the command line sets besides the model/optimizer config. */
typedef struct {
    mt_config cfg;
    int num_data_paths;
    const char* data_paths[MAX_DATA_PATHS];
    double data_weights[MAX_DATA_PATHS];
    int weighted;
    const char* split;
    const char* tokenizer_type;
    const char* vocab_file;
    const char* merge_file;
    const char* tokenizer_model;
    int64_t null_vocab_size;
    int64_t log_interval, eval_interval, eval_iters, save_interval;
    const char* save;
    const char* load;
    int64_t exit_interval;
    int sample_tokens;
    double peak_tflops;
    int builtin; /* no --data-path: the built-in job */
    int mock_data; /* --mock-data: random tokens, no files (benchmarks) */
    /* the memory plan without a GPU: --plan (this layout), --plan-layouts (every layout of the world) */
    int plan, plan_layouts;
    int64_t plan_world_size; /* --world-size (-1: not given) */
    double gpu_memory_gib;   /* --gpu-memory-gib (80) */
} run_options;

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

/* ---- flags ------------------------------------------------------------------------------------ */

typedef enum { F_INT, F_INT64, F_DOUBLE, F_STRING, F_TRUE, F_IGNORED_VALUE, F_IGNORED_SWITCH } flag_kind;
/* Every numeric flag carries the range it accepts: integers are checked against the type they land
 * in (int: at most 2147483647) and what the value means (sizes >= 1), doubles against what Megatron's
 * optimizer and model accept (betas in [0, 1), eps > 0, ...), and non-finite doubles are refused.
 * The locals that collect flag values start at -1 ("not given"); every range excludes -1, so a
 * value the user gives is never mistaken for "not given" (the old --adam-beta1 -0.5 bug). */
enum { D_LO_OPEN = 1, D_HI_OPEN = 2 };
typedef struct {
    const char* name;
    flag_kind kind;
    void* target;
    int64_t imin, imax;     /* F_INT, F_INT64: the accepted range */
    double dmin, dmax;      /* F_DOUBLE: the accepted range (dmax INFINITY: no upper bound) */
    int dopen;              /* F_DOUBLE: D_LO_OPEN / D_HI_OPEN */
} flag_spec;
#define IR(lo, hi) (int64_t)(lo), (int64_t)(hi), 0.0, 0.0, 0
#define DR(lo, hi, open) 0, 0, (double)(lo), (double)(hi), (open)
#define NR 0, 0, 0.0, 0.0, 0 /* flags without a number */
#define I32MAX 2147483647
#define I64MAX INT64_MAX

/* 1: parsed; 0: not an integer; -1: an integer outside int64 */
static int parse_int64(const char* s, int64_t* out) {
    char* end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end) return 0;
    if (errno == ERANGE) return -1;
    if (errno) return 0;
    *out = v;
    return 1;
}
/* 1: parsed, finite; 0: not a number; -1: not finite (nan, inf, or beyond the double range) */
static int parse_double(const char* s, double* out) {
    char* end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end) return 0;
    if (!isfinite(v) || (errno == ERANGE && fabs(v) > 1.0)) return -1;
    *out = v; /* an underflow (1e-400) reads as 0 or a denormal, as Python's float() does */
    return 1;
}
static void die_double_range(const char* name, const char* val, const flag_spec* f) {
    char lo[64], hi[64];
    snprintf(lo, sizeof(lo), "%g", f->dmin);
    snprintf(hi, sizeof(hi), "%g", f->dmax);
    if (isinf(f->dmax)) die(2, "%s %s: must be %s %s", name, val, f->dopen & D_LO_OPEN ? ">" : ">=", lo);
    die(2, "%s %s: must be in %c%s, %s%c", name, val, f->dopen & D_LO_OPEN ? '(' : '[', lo, hi,
        f->dopen & D_HI_OPEN ? ')' : ']');
}

static void set_builtin_defaults(run_options* o) {
    mt_config* c = &o->cfg;
    c->num_layers = 6;
    c->hidden_size = 384;
    c->num_attention_heads = 6;
    c->seq_length = 256;
    c->micro_batch_size = 32;
    c->global_batch_size = 32;
    c->train_iters = 600;
    c->lr = 6e-4;
    c->min_lr = 6e-5;
    c->lr_warmup_iters = 30;
    c->lr_decay_style = MT_LR_COSINE;
    c->weight_decay = 0.1;
    c->adam_beta2 = 0.95;
    c->precision = MT_BF16;
    if (o->log_interval < 0) o->log_interval = 20;
    if (o->eval_interval < 0) o->eval_interval = 100;
    if (o->eval_iters < 0) o->eval_iters = 5;
    if (o->save_interval < 0) o->save_interval = 0;
    if (!o->save) o->save = "checkpoints/builtin";
    if (o->sample_tokens < 0) o->sample_tokens = 128;
}

static void parse_args(run_options* o, int argc, char** argv) {
    mt_config* c = &o->cfg;
    int64_t v64;
    double vd;
    int bf16 = 0, fp16 = 0;
    const char* decay_style = NULL;
    const char* wsd_style = NULL;
    const char* normalization = NULL;
    const char* position_type = NULL;
    int64_t num_layers = -1, hidden = -1, ffn = -1, heads = -1, groups = -1, kv = -1, seq = -1, maxpos = -1;
    int64_t divisible = -1, mbs = -1, gbs = -1, iters = -1, warmup = -1, decay_iters = -1, wsd_iters = -1, tp = -1,
            pp = -1, window = -1, hysteresis = -1, seed = -1;
    double lr = -1, min_lr = -1, warmup_fraction = -1, warmup_init = -1, b1 = -1, b2 = -1, eps = -1, wd = -1,
           clip = -1, std = -1, norm_eps = -1, hidden_dropout = -1, attention_dropout = -1, loss_scale = -1,
           initial_loss_scale = -1, min_loss_scale = -1;
    int untie = 0, swiglu = 0, no_bias = 0, gqa = 0, rope_scaling = 0;
    double rotary_base = -1, rotary_percent = -1, rope_factor = -1;
    const char* fp8_format = NULL;
    const char* fp8_recipe = NULL;
    const char* fp8_algo = NULL;
    int fp8_margin = -1, fp8_history = -1, no_fp8_wgrad = 0, first_last_bf16 = 0, bf16_start = -1, bf16_end = -1;
    int fp8_param_gather = 0;
    flag_spec flags[] = {
        {"--num-layers", F_INT64, &num_layers, IR(1, I32MAX)},
        {"--hidden-size", F_INT64, &hidden, IR(1, I32MAX)},
        {"--ffn-hidden-size", F_INT64, &ffn, IR(1, I32MAX)},
        {"--num-attention-heads", F_INT64, &heads, IR(1, I32MAX)},
        {"--num-query-groups", F_INT64, &groups, IR(1, I32MAX)},
        {"--group-query-attention", F_TRUE, &gqa, NR},
        {"--kv-channels", F_INT64, &kv, IR(1, I32MAX)},
        {"--seq-length", F_INT64, &seq, IR(1, I32MAX)},
        {"--max-position-embeddings", F_INT64, &maxpos, IR(1, I32MAX)},
        {"--make-vocab-size-divisible-by", F_INT64, &divisible, IR(1, I32MAX)},
        {"--init-method-std", F_DOUBLE, &std, DR(0, INFINITY, 0)},
        {"--norm-epsilon", F_DOUBLE, &norm_eps, DR(0, INFINITY, D_LO_OPEN)},
        {"--layernorm-epsilon", F_DOUBLE, &norm_eps, DR(0, INFINITY, D_LO_OPEN)},
        {"--normalization", F_STRING, &normalization, NR},
        {"--position-embedding-type", F_STRING, &position_type, NR},
        {"--untie-embeddings-and-output-weights", F_TRUE, &untie, NR},
        {"--swiglu", F_TRUE, &swiglu, NR},
        {"--rotary-base", F_DOUBLE, &rotary_base, DR(0, INFINITY, D_LO_OPEN)},
        {"--rotary-percent", F_DOUBLE, &rotary_percent, DR(0, 1, D_LO_OPEN)},
        {"--use-rope-scaling", F_TRUE, &rope_scaling, NR},
        {"--rope-scaling-factor", F_DOUBLE, &rope_factor, DR(1, INFINITY, 0)},
        {"--disable-bias-linear", F_TRUE, &no_bias, NR},
        {"--hidden-dropout", F_DOUBLE, &hidden_dropout, DR(0, 1, D_HI_OPEN)},
        {"--attention-dropout", F_DOUBLE, &attention_dropout, DR(0, 1, D_HI_OPEN)},
        {"--bf16", F_TRUE, &bf16, NR},
        {"--fp16", F_TRUE, &fp16, NR},
        {"--fp8-format", F_STRING, &fp8_format, NR},
        {"--fp8-recipe", F_STRING, &fp8_recipe, NR},
        {"--fp8-margin", F_INT, &fp8_margin, IR(0, 30)},
        {"--fp8-amax-history-len", F_INT, &fp8_history, IR(1, 65536)},
        {"--fp8-amax-compute-algo", F_STRING, &fp8_algo, NR},
        {"--no-fp8-wgrad", F_TRUE, &no_fp8_wgrad, NR},
        {"--first-last-layers-bf16", F_TRUE, &first_last_bf16, NR},
        {"--num-layers-at-start-in-bf16", F_INT, &bf16_start, IR(0, I32MAX)},
        {"--num-layers-at-end-in-bf16", F_INT, &bf16_end, IR(0, I32MAX)},
        {"--fp8-param-gather", F_TRUE, &fp8_param_gather, NR},
        {"--loss-scale", F_DOUBLE, &loss_scale, DR(0, INFINITY, 0)},
        {"--initial-loss-scale", F_DOUBLE, &initial_loss_scale, DR(0, INFINITY, D_LO_OPEN)},
        {"--min-loss-scale", F_DOUBLE, &min_loss_scale, DR(0, INFINITY, D_LO_OPEN)},
        {"--loss-scale-window", F_INT64, &window, IR(1, I32MAX)},
        {"--hysteresis", F_INT64, &hysteresis, IR(1, I32MAX)},
        {"--lr", F_DOUBLE, &lr, DR(0, INFINITY, 0)},
        {"--min-lr", F_DOUBLE, &min_lr, DR(0, INFINITY, 0)},
        {"--lr-decay-style", F_STRING, &decay_style, NR},
        {"--lr-warmup-iters", F_INT64, &warmup, IR(0, I64MAX)},
        {"--lr-warmup-fraction", F_DOUBLE, &warmup_fraction, DR(0, 1, 0)},
        {"--lr-warmup-init", F_DOUBLE, &warmup_init, DR(0, INFINITY, 0)},
        {"--lr-decay-iters", F_INT64, &decay_iters, IR(0, I64MAX)},
        {"--lr-wsd-decay-iters", F_INT64, &wsd_iters, IR(0, I64MAX)},
        {"--lr-wsd-decay-style", F_STRING, &wsd_style, NR},
        {"--adam-beta1", F_DOUBLE, &b1, DR(0, 1, D_HI_OPEN)},
        {"--adam-beta2", F_DOUBLE, &b2, DR(0, 1, D_HI_OPEN)},
        {"--adam-eps", F_DOUBLE, &eps, DR(0, INFINITY, D_LO_OPEN)},
        {"--weight-decay", F_DOUBLE, &wd, DR(0, INFINITY, 0)},
        {"--clip-grad", F_DOUBLE, &clip, DR(0, INFINITY, 0)},
        {"--micro-batch-size", F_INT64, &mbs, IR(1, I32MAX)},
        {"--global-batch-size", F_INT64, &gbs, IR(1, I32MAX)},
        {"--train-iters", F_INT64, &iters, IR(1, I64MAX)},
        {"--seed", F_INT64, &seed, IR(0, 4294967295LL)}, /* numpy RandomState: < 2^32 */
        {"--tensor-model-parallel-size", F_INT64, &tp, IR(1, I32MAX)},
        {"--sequence-parallel", F_TRUE, &c->sequence_parallel, NR},
        {"--pipeline-model-parallel-size", F_INT64, &pp, IR(1, I32MAX)},
        {"--use-distributed-optimizer", F_TRUE, &c->use_distributed_optimizer, NR},
        {"--overlap-grad-reduce", F_TRUE, &c->overlap_grad_reduce, NR},
        {"--overlap-param-gather", F_TRUE, &c->overlap_param_gather, NR},
        {"--ddp-bucket-size", F_INT64, &c->ddp_bucket_size, IR(0, I64MAX)},
        {"--mock-data", F_TRUE, &o->mock_data, NR},
        {"--split", F_STRING, &o->split, NR},
        {"--tokenizer-type", F_STRING, &o->tokenizer_type, NR},
        {"--vocab-file", F_STRING, &o->vocab_file, NR},
        {"--merge-file", F_STRING, &o->merge_file, NR},
        {"--tokenizer-model", F_STRING, &o->tokenizer_model, NR},
        {"--vocab-size", F_INT64, &o->null_vocab_size, IR(1, I64MAX)},
        {"--log-interval", F_INT64, &o->log_interval, IR(1, I64MAX)},
        {"--eval-interval", F_INT64, &o->eval_interval, IR(0, I64MAX)},
        {"--eval-iters", F_INT64, &o->eval_iters, IR(0, I64MAX)},
        {"--save", F_STRING, &o->save, NR},
        {"--save-interval", F_INT64, &o->save_interval, IR(0, I64MAX)},
        {"--load", F_STRING, &o->load, NR},
        {"--exit-interval", F_INT64, &o->exit_interval, IR(0, I64MAX)},
        {"--sample-tokens", F_INT, &o->sample_tokens, IR(0, I32MAX)},
        {"--peak-tflops", F_DOUBLE, &o->peak_tflops, DR(0, INFINITY, 0)},
        /* memory: the plan without a GPU, and optimizer offload */
        {"--plan", F_TRUE, &o->plan, NR},
        {"--plan-layouts", F_TRUE, &o->plan_layouts, NR},
        {"--world-size", F_INT64, &o->plan_world_size, IR(1, 1 << 20)},
        {"--gpu-memory-gib", F_DOUBLE, &o->gpu_memory_gib, DR(0, 1e6, D_LO_OPEN)},
        {"--optimizer-cpu-offload", F_TRUE, &c->optimizer_cpu_offload, NR},
        {"--optimizer-offload-fraction", F_DOUBLE, &c->optimizer_offload_fraction, DR(0, 1, 0)},
        /* accepted for launch-script compatibility; they do not change what this build computes */
        {"--log-throughput", F_IGNORED_SWITCH, NULL, NR},
        {"--use-mcore-models", F_IGNORED_SWITCH, NULL, NR},
        {"--use-flash-attn", F_IGNORED_SWITCH, NULL, NR},
        {"--no-masked-softmax-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--no-bias-gelu-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--no-gradient-accumulation-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--distributed-backend", F_IGNORED_VALUE, NULL, NR},
        {"--attention-softmax-in-fp32", F_IGNORED_SWITCH, NULL, NR},
        {"--tensorboard-dir", F_IGNORED_VALUE, NULL, NR},
        {"--wandb-project", F_IGNORED_VALUE, NULL, NR},
        {"--wandb-exp-name", F_IGNORED_VALUE, NULL, NR},
        {"--data-cache-path", F_IGNORED_VALUE, NULL, NR},
    };
    size_t nflags = sizeof(flags) / sizeof(flags[0]);
    char name_buf[128];
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        const char* inline_val = NULL; /* --flag=value, as argparse accepts */
        const char* eq = strncmp(a, "--", 2) == 0 ? strchr(a, '=') : NULL;
        if (eq) {
            if ((size_t)(eq - a) >= sizeof(name_buf)) die(2, "unknown flag %.40s... (see --help)", a);
            memcpy(name_buf, a, (size_t)(eq - a));
            name_buf[eq - a] = 0;
            a = name_buf;
            inline_val = eq + 1;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: train_gpt [Megatron pretrain_gpt.py flags]\n"
                   "  With no --data-path, trains the built-in small GPT on tiny shakespeare.\n"
                   "  --data-path [w1] p1 [w2 p2 ...]   Megatron .bin/.idx prefixes (with weights)\n"
                   "  Supported flags:");
            for (size_t k = 0; k < nflags; k++) printf("%s %s", k % 4 ? "" : "\n   ", flags[k].name);
            printf("\n");
            exit(0);
        }
        if (!strcmp(a, "--data-path") && inline_val) { /* argparse: --data-path=P is a list of one */
            mt_error err;
            if (mt_data_path_parse(1, &inline_val, o->data_paths, o->data_weights, &o->num_data_paths, &o->weighted,
                                   &err) != MT_OK)
                die(2, "%s", err.message);
            continue;
        }
        if (!strcmp(a, "--data-path")) {
            int start = i + 1, end = start;
            while (end < argc && strncmp(argv[end], "--", 2) != 0) end++;
            if (end - start > MAX_DATA_PATHS) die(2, "--data-path: at most %d entries", MAX_DATA_PATHS);
            mt_error err;
            if (mt_data_path_parse(end - start, (const char* const*)argv + start, o->data_paths, o->data_weights,
                                   &o->num_data_paths, &o->weighted, &err) != MT_OK)
                die(2, "%s", err.message);
            i = end - 1;
            continue;
        }
        size_t k = 0;
        while (k < nflags && strcmp(a, flags[k].name) != 0) k++;
        if (k == nflags) die(2, "unknown flag %s (see --help)", a);
        flag_spec* f = &flags[k];
        if ((f->kind == F_TRUE || f->kind == F_IGNORED_SWITCH) && inline_val)
            die(2, "%s takes no value (got '%s')", a, inline_val);
        if (f->kind == F_TRUE) { *(int*)f->target = 1; continue; }
        if (f->kind == F_IGNORED_SWITCH) continue;
        if (!inline_val && i + 1 >= argc) die(2, "%s needs a value", a);
        const char* val = inline_val ? inline_val : argv[++i];
        switch (f->kind) {
            case F_INT:
            case F_INT64: {
                int r = parse_int64(val, &v64);
                if (r == 0) die(2, "%s %s: not an integer", a, val);
                if (r < 0 || v64 < f->imin || v64 > f->imax)
                    die(2, "%s %s: must be between %lld and %lld", a, val, (long long)f->imin, (long long)f->imax);
                if (f->kind == F_INT) *(int*)f->target = (int)v64;
                else *(int64_t*)f->target = v64;
                break;
            }
            case F_DOUBLE: {
                int r = parse_double(val, &vd);
                if (r == 0) die(2, "%s %s: not a number", a, val);
                if (r < 0) die(2, "%s %s: must be a finite number", a, val);
                if (vd < f->dmin || vd > f->dmax || (f->dopen & D_LO_OPEN && vd == f->dmin) ||
                    (f->dopen & D_HI_OPEN && vd == f->dmax))
                    die_double_range(a, val, f);
                *(double*)f->target = vd;
                break;
            }
            case F_STRING: *(const char**)f->target = val; break;
            default: break;
        }
    }

    o->builtin = o->num_data_paths == 0 && !o->mock_data;
    if (o->builtin) set_builtin_defaults(o);
    else {
        if (o->log_interval < 0) o->log_interval = 100;
        if (o->eval_interval < 0) o->eval_interval = 1000;
        if (o->eval_iters < 0) o->eval_iters = 100;
        if (o->save_interval < 0) o->save_interval = 0;
        if (!o->split) o->split = "969, 30, 1"; /* Megatron's legacy default with --data-path */
        const char* required[][2] = {{"--num-layers", (const char*)(num_layers < 0 ? "" : NULL)},
                                     {"--hidden-size", (const char*)(hidden < 0 ? "" : NULL)},
                                     {"--num-attention-heads", (const char*)(heads < 0 ? "" : NULL)},
                                     {"--seq-length", (const char*)(seq < 0 ? "" : NULL)},
                                     {"--micro-batch-size", (const char*)(mbs < 0 ? "" : NULL)},
                                     {"--train-iters", (const char*)(iters < 0 ? "" : NULL)},
                                     {"--lr", (const char*)(lr < 0 ? "" : NULL)}};
        for (size_t k = 0; k < sizeof(required) / sizeof(required[0]); k++)
            if (required[k][1]) die(2, "%s is required with --data-path", required[k][0]);
    }
    if (!o->split) o->split = "969, 30, 1";

    /* FP8 (ranges and combinations are checked by mt_config_finalize) */
    if (fp8_format) {
        if (!strcmp(fp8_format, "e4m3")) c->fp8_format = MT_FP8_E4M3;
        else if (!strcmp(fp8_format, "hybrid")) c->fp8_format = MT_FP8_HYBRID;
        else die(2, "--fp8-format %s: expected e4m3 or hybrid", fp8_format);
    }
    if (fp8_recipe) {
        if (!strcmp(fp8_recipe, "delayed")) c->fp8_recipe = MT_FP8_DELAYED;
        else if (!strcmp(fp8_recipe, "tensorwise")) c->fp8_recipe = MT_FP8_TENSORWISE;
        else if (!strcmp(fp8_recipe, "blockwise")) c->fp8_recipe = MT_FP8_BLOCKWISE;
        else die(2, "--fp8-recipe %s: expected delayed, tensorwise or blockwise", fp8_recipe);
    }
    if (fp8_algo) {
        if (!strcmp(fp8_algo, "max")) c->fp8_amax_compute_algo = MT_FP8_AMAX_MAX;
        else if (!strcmp(fp8_algo, "most_recent")) c->fp8_amax_compute_algo = MT_FP8_AMAX_MOST_RECENT;
        else die(2, "--fp8-amax-compute-algo %s: expected max or most_recent", fp8_algo);
    }
    if (fp8_margin != -1) c->fp8_margin = fp8_margin;
    if (fp8_history != -1) c->fp8_amax_history_len = fp8_history;
    if (no_fp8_wgrad) c->fp8_wgrad = 0;
    c->first_last_layers_bf16 = first_last_bf16;
    if (bf16_start != -1) c->num_layers_at_start_in_bf16 = bf16_start;
    if (bf16_end != -1) c->num_layers_at_end_in_bf16 = bf16_end;
    c->fp8_param_gather = fp8_param_gather;
    if (!fp8_format && (fp8_recipe || fp8_algo || fp8_margin != -1 || fp8_history != -1 || no_fp8_wgrad ||
                        first_last_bf16 || fp8_param_gather))
        die(2, "the --fp8-* flags need --fp8-format e4m3|hybrid");

    /* the model flavour (GPT-2 by default; Llama: RMSNorm, SwiGLU, rope, GQA, untied, no biases) */
    if (normalization) {
        if (!strcmp(normalization, "LayerNorm")) c->normalization = MT_NORM_LAYERNORM;
        else if (!strcmp(normalization, "RMSNorm")) c->normalization = MT_NORM_RMSNORM;
        else die(2, "--normalization %s: expected LayerNorm or RMSNorm", normalization);
    }
    if (position_type) {
        if (!strcmp(position_type, "learned_absolute")) c->position_embedding_type = MT_POSITION_LEARNED;
        else if (!strcmp(position_type, "rope")) c->position_embedding_type = MT_POSITION_ROPE;
        else die(2, "--position-embedding-type %s: expected learned_absolute or rope", position_type);
    }
    if (rotary_base >= 0) c->rotary_base = rotary_base;
    if (rotary_percent >= 0) c->rotary_percent = rotary_percent;
    if (rope_factor >= 0) c->rope_scaling_factor = rope_factor;
    c->use_rope_scaling = rope_scaling;
    c->swiglu = swiglu;
    c->untie_embeddings_and_output_weights = untie;
    c->add_bias_linear = !no_bias;

    if (num_layers >= 0) c->num_layers = (int)num_layers;
    if (hidden >= 0) c->hidden_size = (int)hidden;
    if (ffn >= 0) c->ffn_hidden_size = (int)ffn;
    if (heads >= 0) c->num_attention_heads = (int)heads;
    if (groups >= 0) {
        if (!gqa) die(2, "--num-query-groups needs --group-query-attention");
        c->num_query_groups = (int)groups;
    }
    if (kv >= 0) c->kv_channels = (int)kv;
    if (seq >= 0) c->seq_length = (int)seq;
    if (maxpos >= 0) c->max_position_embeddings = (int)maxpos;
    if (divisible >= 0) c->make_vocab_size_divisible_by = (int)divisible;
    if (std >= 0) c->init_method_std = std;
    if (norm_eps >= 0) c->norm_epsilon = norm_eps;
    if (hidden_dropout >= 0) c->hidden_dropout = hidden_dropout;
    if (attention_dropout >= 0) c->attention_dropout = attention_dropout;
    if (bf16 && fp16) die(2, "--bf16 and --fp16 are mutually exclusive");
    if (bf16) c->precision = MT_BF16;
    if (fp16) c->precision = MT_FP16;
    if (loss_scale >= 0) c->loss_scale = loss_scale;
    if (initial_loss_scale >= 0) c->initial_loss_scale = initial_loss_scale;
    if (min_loss_scale >= 0) c->min_loss_scale = min_loss_scale;
    if (window >= 0) c->loss_scale_window = (int)window;
    if (hysteresis >= 0) c->hysteresis = (int)hysteresis;
    if (lr >= 0) c->lr = lr;
    if (min_lr >= 0) c->min_lr = min_lr;
    if (warmup >= 0) c->lr_warmup_iters = warmup;
    if (warmup_fraction >= 0) { c->lr_warmup_fraction = warmup_fraction; if (warmup < 0) c->lr_warmup_iters = 0; }
    if (warmup_init >= 0) c->lr_warmup_init = warmup_init;
    if (decay_iters >= 0) c->lr_decay_iters = decay_iters;
    if (wsd_iters >= 0) c->lr_wsd_decay_iters = wsd_iters;
    if (b1 >= 0) c->adam_beta1 = b1;
    if (b2 >= 0) c->adam_beta2 = b2;
    if (eps >= 0) c->adam_eps = eps;
    if (wd >= 0) c->weight_decay = wd;
    if (clip >= 0) c->clip_grad = clip;
    if (mbs >= 0) c->micro_batch_size = (int)mbs;
    if (gbs >= 0) c->global_batch_size = (int)gbs;
    if (iters >= 0) c->train_iters = iters;
    if (seed >= 0) c->seed = (uint64_t)seed;
    if (tp >= 0) c->tensor_model_parallel_size = (int)tp;
    if (pp >= 0) c->pipeline_model_parallel_size = (int)pp;
    if (decay_style) {
        const char* names[] = {"constant", "linear", "cosine", "inverse-square-root", "WSD"};
        int found = -1;
        for (int k = 0; k < 5; k++) if (!strcmp(decay_style, names[k])) found = k;
        if (found < 0) die(2, "--lr-decay-style %s: expected constant, linear, cosine, inverse-square-root or WSD", decay_style);
        c->lr_decay_style = (mt_lr_decay_style)found;
    }
    if (wsd_style) {
        const char* names[] = {"exponential", "linear", "cosine", "minus_sqrt"};
        int found = -1;
        for (int k = 0; k < 4; k++) if (!strcmp(wsd_style, names[k])) found = k;
        if (found < 0) die(2, "--lr-wsd-decay-style %s: expected exponential, linear, cosine or minus_sqrt", wsd_style);
        c->lr_wsd_decay_style = (mt_wsd_decay_style)found;
    }
    if (o->log_interval <= 0) die(2, "--log-interval must be positive");
}

/* ---- tokenizer and the built-in corpus ------------------------------------------------------- */

static mt_tokenizer* load_tokenizer(run_options* o) {
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

/* ---- memory plan ------------------------------------------------------------------------------ */

static const char* precision_name(mt_precision p) { return p == MT_FP32 ? "fp32" : p == MT_BF16 ? "bf16" : "fp16"; }

/* The plan of one GPU, by category (the same block at startup, for --plan, and before a refusal). */
static void print_plan(const mt_memory_plan* p, const mt_config* c, const mt_plan_options* opts) {
    const double gib = 1024.0 * 1024.0 * 1024.0, mib = 1024.0 * 1024.0;
    static const char* recompute[] = {"none", "selective", "full"};
    printf("memory plan per GPU (pipeline rank %d of %d, %lld parameters on this GPU, %s%s): TP %d, PP %d, VP %d, DP %d%s%s%s, "
           "recompute %s, micro-batch %d x %d tokens, %d of %d micro-batches' activations in flight\n",
           p->pp_rank, c->pipeline_model_parallel_size, (long long)p->num_parameters, precision_name(c->precision),
           c->fp8_format != MT_FP8_NONE ? " + FP8" : "", c->tensor_model_parallel_size, c->pipeline_model_parallel_size,
           opts->virtual_pipeline_size, c->data_parallel_size, c->sequence_parallel ? ", SP" : "",
           c->use_distributed_optimizer ? ", distributed optimizer" : "",
           p->offload_elements ? ", optimizer offload" : "", recompute[opts->recompute.granularity],
           c->micro_batch_size, c->seq_length, p->in_flight, p->num_micro_batches);
    printf("  parameters   %8.3f GiB  (%s, %lld elements with padding)\n", p->parameter_bytes / gib,
           precision_name(c->precision), (long long)p->buffer_elements);
    printf("  master fp32  %8.3f GiB\n", p->master_bytes / gib);
    printf("  gradients    %8.3f GiB  (fp32)\n", p->gradient_bytes / gib);
    printf("  Adam m, v    %8.3f GiB  (fp32, %lld of %lld optimizer elements on the GPU)\n", p->optimizer_bytes / gib,
           (long long)(p->shard_elements - p->offload_elements), (long long)p->shard_elements);
    printf("  activations  %8.3f GiB  (%.3f GiB saved per micro-batch x %d in flight, the rest scratch)\n",
           p->activation_bytes / gib, p->activation_saved_bytes / gib, p->in_flight);
    if (p->fp8_bytes) printf("  fp8          %8.3f GiB  (the weights' FP8 copies, scaling state, cast scratch)\n", p->fp8_bytes / gib);
    printf("  workspace    %8.3f GiB  (cuBLAS %.0f MiB, column sums, AdamW chunk table, RoPE tables%s)\n",
           p->workspace_bytes / gib, MT_CUBLAS_WORKSPACE_BYTES / mib,
           c->pipeline_model_parallel_size > 1 ? ", pipeline receive buffers" : "");
    if (p->offload_elements)
        printf("  offload      %8.3f GiB  (device staging; host: %.3f GiB pinned for %lld offloaded elements)\n",
               p->offload_bytes / gib, p->host_pinned_bytes / gib, (long long)p->offload_elements);
    printf("  allocated    %8.3f GiB  (%.2f bytes of model state per parameter)\n", p->total_bytes / gib,
           (double)(p->parameter_bytes + p->master_bytes + p->gradient_bytes + p->optimizer_bytes) /
               (double)(p->num_parameters ? p->num_parameters : 1));
    printf("  overheads    %8.3f GiB  (stated constants: CUDA context %.0f MiB, cuBLAS %.0f MiB, NCCL %.0f MiB per "
           "communicator)\n", p->overhead_bytes / gib, MT_PLAN_CONTEXT_BYTES / mib, MT_PLAN_CUBLAS_BYTES / mib,
           MT_PLAN_NCCL_BYTES / mib);
    printf("  in use       %8.3f GiB  expected per GPU\n", p->device_bytes / gib);
}

static void print_memory_plan(mt_trainer* t, const mt_config* c) {
    mt_memory_plan p = mt_trainer_memory_plan(t);
    mt_plan_options opts;
    mt_plan_options_defaults(&opts);
    print_plan(&p, c, &opts);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    char name[256];
    size_t free_bytes = 0, total_bytes = 0;
    mt_error err;
    if (mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err) != MT_OK) snprintf(name, sizeof(name), "?");
    printf("  total        %8.3f GiB planned; device reports %.3f GiB in use of %.3f GiB (%s; the model state took "
           "%.3f GiB as it counts)\n", p.device_bytes / gib, (total_bytes - free_bytes) / gib, total_bytes / gib, name,
           p.state_bytes_measured / gib);
}

/* --plan: this layout's plan and whether it fits; --plan-layouts: every layout of the world size
 * that fits, fastest first. No GPU, no data. Returns the exit status (1: nothing fits). */
static int run_plan(const run_options* o, const mt_config* c, int sequence_parallel, int global_batch) {
    const double gib = 1024.0 * 1024.0 * 1024.0, budget = o->gpu_memory_gib * gib;
    mt_plan_options opts;
    mt_plan_options_defaults(&opts);
    mt_error err;
    if (!o->plan_layouts) {
        mt_memory_plan p;
        if (mt_memory_plan_compute(c, &opts, &p, &err) != MT_OK) die(2, "%s", err.message);
        print_plan(&p, c, &opts);
        if ((double)p.device_bytes <= budget) {
            printf("  fits in %.1f GiB per GPU with %.3f GiB to spare\n", o->gpu_memory_gib, (budget - p.device_bytes) / gib);
            return 0;
        }
        printf("  does NOT fit in %.1f GiB per GPU: %.3f GiB short\n", o->gpu_memory_gib, (p.device_bytes - budget) / gib);
        return 1;
    }
    enum { MAX_LAYOUTS = 4096 };
    mt_layout_candidate* k = (mt_layout_candidate*)malloc(sizeof(mt_layout_candidate) * MAX_LAYOUTS);
    if (!k) die(1, "cannot allocate the layout table");
    mt_config base = *c;
    base.sequence_parallel = sequence_parallel;
    base.global_batch_size = global_batch;
    const int world = o->plan_world_size > 0 ? (int)o->plan_world_size : 1;
    int n = 0, fits = 0;
    if (mt_plan_layouts(&base, &opts, world, k, MAX_LAYOUTS, &n, &err) != MT_OK) die(2, "%s", err.message);
    char batch[64];
    if (global_batch) snprintf(batch, sizeof(batch), "global batch %d", global_batch);
    else snprintf(batch, sizeof(batch), "global batch = micro-batch x DP");
    printf("layouts of %d GPUs that fit in %.1f GiB per GPU (%s, micro-batch %d%s%s), fastest first by the cost model "
           "of DESIGN.md:\n", world, o->gpu_memory_gib, batch, c->micro_batch_size,
           sequence_parallel ? ", SP where TP > 1" : "", c->use_distributed_optimizer ? ", distributed optimizer" : "");
    printf("    TP   PP   VP     DP   global batch   model step (ms)   tokens/s/GPU   GiB per GPU (pipeline rank)   "
           "activations in flight\n");
    for (int i = 0; i < n; i++) {
        if ((double)k[i].plan.device_bytes > budget) continue;
        fits++;
        printf("  %4d %4d %4d %6d %14d %17.1f %14.0f %21.2f (%d) %26d\n", k[i].tp, k[i].pp, k[i].vp, k[i].dp,
               k[i].global_batch_size, 1e3 * k[i].step_seconds, k[i].tokens_per_second, k[i].plan.device_bytes / gib,
               k[i].plan.pp_rank, k[i].plan.in_flight);
    }
    printf("  %d of %d layouts fit%s\n", fits, n, n ? "" : " (no TP x PP divides the model and the batch)");
    free(k);
    return fits ? 0 : 1;
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

static void fetch_batch(const mt_gpt_data* data, int split, int64_t consumed, const mt_config* c, int32_t* tokens) {
    mt_error err;
    int64_t n = split_samples(data, split);
    int mbs = c->micro_batch_size, dp = c->data_parallel_size, dp_rank = mt_rank_coordinates(c, c->rank).dp;
    int micro = mt_num_micro_batches(c);
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
 * validation iterator carries on across evaluations). */
static double evaluate(mt_trainer* t, const mt_gpt_data* data, int split, int64_t* consumed, int64_t eval_iters,
                       const mt_config* c, int32_t* tokens) {
    mt_error err;
    double total = 0.0;
    int micro = mt_num_micro_batches(c);
    for (int64_t k = 0; k < eval_iters; k++) {
        fetch_batch(data, split, *consumed, c, tokens);
        *consumed += c->global_batch_size;
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, micro, &loss, &err) != MT_OK) die(1, "%s", err.message);
        total += loss;
    }
    return total / (double)eval_iters;
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
    run_options o;
    memset(&o, 0, sizeof(o));
    mt_config_defaults(&o.cfg);
    o.log_interval = o.eval_interval = o.eval_iters = o.save_interval = -1; /* unset */
    o.sample_tokens = -1;
    o.plan_world_size = -1;
    o.gpu_memory_gib = 80.0;
    parse_args(&o, argc, argv);
    mt_config* c = &o.cfg;
    c->world_size = world;
    c->rank = rank;
    c->local_rank = local_rank;
    c->comm_id = comm_id;
    const int planning = o.plan || o.plan_layouts, sequence_parallel = c->sequence_parallel;
    const int global_batch = c->global_batch_size; /* 0: micro-batch x DP of each layout */
    if (planning) { /* the layout of --world-size GPUs, on none (--plan-layouts: the model checked on one) */
        c->world_size = o.plan_world_size > 0 && !o.plan_layouts ? (int)o.plan_world_size : 1;
        c->rank = 0;
        c->local_rank = -1;
    } else if (o.plan_world_size > 0 || o.gpu_memory_gib != 80.0) {
        die(2, "--world-size and --gpu-memory-gib go with --plan or --plan-layouts (a run's world is its processes)");
    }

    mt_tokenizer* tok = load_tokenizer(&o);
    c->vocab_size = tok ? mt_tokenizer_vocab_size(tok) : o.null_vocab_size;
    mt_error err;
    if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
    if (planning) {
        int status = run_plan(&o, c, sequence_parallel, global_batch);
        if (tok) mt_tokenizer_free(tok);
#ifdef MT_USE_MPI
        MPI_Finalize();
#endif
        return status;
    }
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
    mt_status created = mt_trainer_create(&t, c, &err);
    if (created == MT_ERR_OOM) { /* the plan that does not fit, then the shortfall */
        mt_plan_options opts;
        mt_plan_options_defaults(&opts);
        opts.pp_rank = mt_rank_coordinates(c, c->rank).pp;
        mt_memory_plan p;
        mt_error plan_err;
        if (mt_memory_plan_compute(c, &opts, &p, &plan_err) == MT_OK) print_plan(&p, c, &opts);
    }
    if (created != MT_OK) die(1, "%s", err.message);
    print_memory_plan(t, c);

    int64_t iteration = 0, consumed = 0, consumed_valid = 0;
    if (o.load) {
        char tracker[4096];
        snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", o.load);
        if (access(tracker, R_OK) == 0) {
            if (mt_trainer_load(t, o.load, -1, &iteration, &consumed, &err) != MT_OK) die(1, "%s", err.message);
            printf("loaded checkpoint from %s at iteration %lld (%lld samples consumed)\n", o.load, (long long)iteration,
                   (long long)consumed);
            if (o.eval_interval > 0) consumed_valid = (iteration / o.eval_interval) * o.eval_iters * c->global_batch_size;
        } else {
            printf("no checkpoint found in %s: training from scratch\n", o.load);
        }
    }

    double peak = o.peak_tflops > 0 ? o.peak_tflops : mt_device_peak_tflops(c->precision);
    double flops_per_iter = mt_flops_per_iteration(c, c->global_batch_size);
    size_t rank_samples = (size_t)mt_num_micro_batches(c) * c->micro_batch_size; /* this rank's share */
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * rank_samples * (c->seq_length + 1));
    if (!tokens) die(1, "cannot allocate the batch");
    double interval_loss = 0.0, interval_time = 0.0;
    int interval_steps = 0, interval_skipped = 0, interval_nan = 0;
    double t_start = now_seconds();
    while (iteration < c->train_iters) {
        fetch_batch(data, MT_SPLIT_TRAIN, consumed, c, tokens);
        double t0 = now_seconds();
        mt_step_result r;
        if (mt_trainer_train_step(t, tokens, &r, &err) != MT_OK) die(1, "iteration %lld: %s", (long long)iteration + 1, err.message);
        interval_time += now_seconds() - t0;
        iteration++;
        consumed += c->global_batch_size;
        if (r.skipped) interval_skipped++;
        else interval_loss += r.lm_loss;
        if (r.nan) interval_nan++;
        interval_steps++;

        if (iteration % o.log_interval == 0 || iteration == c->train_iters) {
            double ms = 1000.0 * interval_time / interval_steps;
            double tflops = flops_per_iter / (ms / 1000.0) / 1e12 / c->world_size;
            int good = interval_steps - interval_skipped;
            char ts[64];
            timestamp(ts, sizeof(ts));
            printf(" [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                   "throughput per GPU (TFLOP/s/GPU): %.1f | learning rate: %.6E | global batch size: %5d | "
                   "lm loss: %.6E | loss scale: %.1f | grad norm: %.3f | number of skipped iterations: %3d | "
                   "number of nan iterations: %3d | MFU: %.1f%% |\n",
                   ts, (long long)iteration, (long long)c->train_iters, (long long)consumed, ms, tflops,
                   r.next_learning_rate, c->global_batch_size, good ? interval_loss / good : 0.0, r.loss_scale,
                   r.grad_norm, interval_skipped, interval_nan, peak > 0 ? 100.0 * tflops / peak : 0.0);
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
        }
        if (o.exit_interval > 0 && iteration % o.exit_interval == 0) break;
    }
    printf("training took %.1f s\n", now_seconds() - t_start);
    {   /* the plan against what the device reports once training has run (dev/memory_check.sh) */
        mt_memory_plan p = mt_trainer_memory_plan(t);
        char name[256];
        size_t free_bytes = 0, total_bytes = 0;
        if (mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err) == MT_OK) {
            const double gib = 1024.0 * 1024.0 * 1024.0, used = (double)(total_bytes - free_bytes);
            printf("memory after %lld iterations: device reports %.3f GiB in use, the plan %.3f GiB (%+.1f%%)\n",
                   (long long)iteration, used / gib, p.device_bytes / gib, 100.0 * (used - p.device_bytes) / p.device_bytes);
        }
    }
    /* as Megatron: validation and test losses at the end of training */
    if (o.eval_iters > 0 && split_samples(data, MT_SPLIT_VALID) >= consumed_valid + o.eval_iters * c->global_batch_size)
        print_validation("validation", iteration, evaluate(t, data, MT_SPLIT_VALID, &consumed_valid, o.eval_iters, c, tokens));
    if (o.eval_iters > 0 && split_samples(data, MT_SPLIT_TEST) >= o.eval_iters * c->global_batch_size) {
        int64_t consumed_test = 0;
        double test_loss = evaluate(t, data, MT_SPLIT_TEST, &consumed_test, o.eval_iters, c, tokens);
        print_validation("test", iteration, test_loss);
    }
    if (o.save && (o.save_interval <= 0 || iteration % o.save_interval != 0)) {
        if (mt_trainer_save(t, o.save, iteration, consumed, &err) != MT_OK) die(1, "%s", err.message);
        printf("saved checkpoint at iteration %lld to %s\n", (long long)iteration, o.save);
    }
    /* every rank samples (the same tokens: same seed; with tensor parallelism the forward needs the
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
