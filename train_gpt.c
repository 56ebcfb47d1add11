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
#include <signal.h>
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
    int exit_signal_handler;        /* --exit-signal-handler: SIGTERM/SIGINT -> finish the step, save, exit 0 */
    int64_t exit_duration_in_mins;  /* --exit-duration-in-mins (0: none) */
    int sample_tokens;
    double peak_tflops;
    int builtin; /* no --data-path: the built-in job */
    int mock_data; /* --mock-data: random tokens, no files (benchmarks) */
    /* watching and judging a run: TensorBoard events, the wandb pointer, evaluation without training */
    const char* tensorboard_dir;
    int64_t tensorboard_log_interval; /* 0: not given (1) */
    int tensorboard_queue_size;       /* 0: not given (1000) */
    int log_timers_to_tensorboard, log_memory_to_tensorboard, log_validation_ppl_to_tensorboard;
    int log_world_size_to_tensorboard, no_log_loss_scale_to_tensorboard;
    const char *wandb_project, *wandb_exp_name, *wandb_save_dir;
    int skip_train, full_validation;
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
    int no_nan_check = 0;
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
        {"--num-layers-per-virtual-pipeline-stage", F_INT, &c->num_layers_per_virtual_pipeline_stage, IR(1, I32MAX)},
        {"--num-virtual-stages-per-pipeline-rank", F_INT, &c->virtual_pipeline_size, IR(1, MT_PP_MAX_CHUNKS)},
        {"--microbatch-group-size-per-virtual-pipeline-stage", F_INT, &c->microbatch_group_size_per_vp_stage,
         IR(1, I32MAX)},
        {"--decoder-first-pipeline-num-layers", F_INT, &c->decoder_first_pipeline_num_layers, IR(0, I32MAX)},
        {"--decoder-last-pipeline-num-layers", F_INT, &c->decoder_last_pipeline_num_layers, IR(0, I32MAX)},
        {"--account-for-embedding-in-pipeline-split", F_TRUE, &c->account_for_embedding_in_pipeline_split, NR},
        {"--account-for-loss-in-pipeline-split", F_TRUE, &c->account_for_loss_in_pipeline_split, NR},
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
        /* faults (Megatron's): preemption and NaN */
        {"--exit-signal-handler", F_TRUE, &o->exit_signal_handler, NR},
        {"--exit-duration-in-mins", F_INT64, &o->exit_duration_in_mins, IR(0, 1000000000)},
        {"--no-check-for-nan-in-loss-and-grad", F_TRUE, &no_nan_check, NR},
        {"--sample-tokens", F_INT, &o->sample_tokens, IR(0, I32MAX)},
        {"--peak-tflops", F_DOUBLE, &o->peak_tflops, DR(0, INFINITY, 0)},
        /* watching and judging a run (run_options says what each holds) */
        {"--tensorboard-dir", F_STRING, &o->tensorboard_dir, NR},
        {"--tensorboard-log-interval", F_INT64, &o->tensorboard_log_interval, IR(1, I64MAX)},
        {"--tensorboard-queue-size", F_INT, &o->tensorboard_queue_size, IR(1, I32MAX)},
        {"--log-timers-to-tensorboard", F_TRUE, &o->log_timers_to_tensorboard, NR},
        {"--log-memory-to-tensorboard", F_TRUE, &o->log_memory_to_tensorboard, NR},
        {"--log-validation-ppl-to-tensorboard", F_TRUE, &o->log_validation_ppl_to_tensorboard, NR},
        {"--log-world-size-to-tensorboard", F_TRUE, &o->log_world_size_to_tensorboard, NR},
        {"--no-log-loss-scale-to-tensorboard", F_TRUE, &o->no_log_loss_scale_to_tensorboard, NR},
        {"--wandb-project", F_STRING, &o->wandb_project, NR},
        {"--wandb-exp-name", F_STRING, &o->wandb_exp_name, NR},
        {"--wandb-save-dir", F_STRING, &o->wandb_save_dir, NR},
        {"--skip-train", F_TRUE, &o->skip_train, NR},
        {"--full-validation", F_TRUE, &o->full_validation, NR},
        /* accepted for launch-script compatibility; they do not change what this build computes */
        {"--log-throughput", F_IGNORED_SWITCH, NULL, NR},
        {"--use-mcore-models", F_IGNORED_SWITCH, NULL, NR},
        {"--use-flash-attn", F_IGNORED_SWITCH, NULL, NR},
        {"--no-masked-softmax-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--no-bias-gelu-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--no-gradient-accumulation-fusion", F_IGNORED_SWITCH, NULL, NR},
        {"--distributed-backend", F_IGNORED_VALUE, NULL, NR},
        {"--attention-softmax-in-fp32", F_IGNORED_SWITCH, NULL, NR},
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
                                     {"--train-iters", (const char*)(iters < 0 && !o->skip_train ? "" : NULL)},
                                     {"--lr", (const char*)(lr < 0 && !o->skip_train ? "" : NULL)}};
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
    c->check_for_nan_in_loss_and_grad = !no_nan_check;
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
    if (o->skip_train && iters < 0) c->train_iters = 1; /* nothing trains; the config only needs a count */
    if (o->full_validation && o->mock_data) die(2, "--full-validation needs a dataset: --mock-data has no end");
    if (!o->tensorboard_log_interval) o->tensorboard_log_interval = 1;
    if (!o->tensorboard_queue_size) o->tensorboard_queue_size = 1000;
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
    mt_error err;
    char* text = NULL;
    size_t text_bytes = 0;
    if (mt_read_file(text_path, (size_t)1 << 30, &text, &text_bytes, &err) != MT_OK)
        die(1, "%s (the built-in corpus: run from the repository root)", err.message);
    long size = (long)text_bytes;
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

/* ---- TensorBoard ------------------------------------------------------------------------------ */
/* Megatron's TensorBoard habits (training.py): the rank that prints the log writes the events; every
 * --tensorboard-log-interval iterations learning-rate, batch-size, lm loss (this iteration's),
 * loss-scale, grad-norm (none for a skipped step), world-size and memory when asked, each with its
 * "vs samples" twin where Megatron has one; at each log line iteration-time (s) and throughput
 * (TFLOP/s/GPU) with --log-timers-to-tensorboard; each evaluation's loss (and ppl); the command
 * line's arguments as texts. Events are flushed at every log line (and when the queue fills). */

static mt_tb_writer* tensorboard_open(const run_options* o, int argc, char** argv, int64_t iteration) {
    if (o->wandb_project || o->wandb_exp_name || o->wandb_save_dir)
        printf("wandb: this build does not talk to wandb; --wandb-* are not used. Upload the TensorBoard events "
               "with `wandb sync --sync-tensorboard %s`%s\n", o->tensorboard_dir ? o->tensorboard_dir : "<dir>",
               o->tensorboard_dir ? "" : " after a run with --tensorboard-dir <dir>");
    if (!o->tensorboard_dir || o->cfg.rank != 0) return NULL;
    mt_error err;
    mt_tb_writer* tb = NULL;
    if (mt_tb_open(&tb, o->tensorboard_dir, o->tensorboard_queue_size, &err) != MT_OK) die(1, "%s", err.message);
    /* the arguments as Megatron writes them (one text per argument, named as argparse's dest): here
     * the ones given on the command line, with their values as given */
    char name[128], value[4096];
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0) continue;
        const char* eq = strchr(argv[i], '=');
        size_t n = eq ? (size_t)(eq - argv[i] - 2) : strlen(argv[i] + 2);
        if (n >= sizeof(name)) n = sizeof(name) - 1;
        for (size_t k = 0; k < n; k++) name[k] = argv[i][2 + k] == '-' ? '_' : argv[i][2 + k];
        name[n] = 0;
        size_t len = (size_t)snprintf(value, sizeof(value), "%s", eq ? eq + 1 : "");
        for (int j = i + 1; !eq && j < argc && strncmp(argv[j], "--", 2) != 0 && len < sizeof(value); j++)
            len += (size_t)snprintf(value + len, sizeof(value) - len, "%s%s", len ? " " : "", argv[j]);
        if (mt_tb_text(tb, name, value[0] ? value : "True", iteration, &err) != MT_OK) die(1, "%s", err.message);
    }
    if (mt_tb_flush(tb, &err) != MT_OK) die(1, "%s", err.message);
    printf("tensorboard: writing events to %s\n", mt_tb_path(tb));
    return tb;
}

static void tensorboard_check(mt_status st, const mt_error* err) {
    if (st != MT_OK) die(1, "%s", err->message);
}

static void tensorboard_iteration(mt_tb_writer* tb, const run_options* o, mt_trainer* t, const mt_step_result* r,
                                  int64_t iteration, int64_t consumed) {
    const mt_config* c = &o->cfg;
    mt_error err;
    tensorboard_check(mt_tb_scalar_pair(tb, "learning-rate", r->next_learning_rate, iteration, consumed, &err), &err);
    tensorboard_check(mt_tb_scalar_pair(tb, "batch-size", c->global_batch_size, iteration, consumed, &err), &err);
    tensorboard_check(mt_tb_scalar_pair(tb, "lm loss", r->lm_loss, iteration, consumed, &err), &err);
    if (!o->no_log_loss_scale_to_tensorboard)
        tensorboard_check(mt_tb_scalar_pair(tb, "loss-scale", r->loss_scale, iteration, consumed, &err), &err);
    if (o->log_world_size_to_tensorboard)
        tensorboard_check(mt_tb_scalar_pair(tb, "world-size", c->world_size, iteration, consumed, &err), &err);
    if (!r->skipped)
        tensorboard_check(mt_tb_scalar_pair(tb, "grad-norm", r->grad_norm, iteration, consumed, &err), &err);
    if (o->log_memory_to_tensorboard) {
        /* no caching allocator here: everything is allocated at creation (the plan); "reserved" is
         * what the device reports in use (the CUDA context, cuBLAS and NCCL included) */
        char name[256];
        size_t free_bytes = 0, total_bytes = 0;
        tensorboard_check(mt_device_info(name, sizeof(name), &free_bytes, &total_bytes, &err), &err);
        double planned = (double)mt_trainer_memory_plan(t).total_bytes;
        tensorboard_check(mt_tb_scalar(tb, "mem-reserved-bytes", (double)(total_bytes - free_bytes), iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "mem-allocated-bytes", planned, iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "mem-max-allocated-bytes", planned, iteration, &err), &err);
    }
}

static void tensorboard_log_line(mt_tb_writer* tb, const run_options* o, int64_t iteration, double seconds_per_iteration,
                                 double tflops) {
    mt_error err;
    if (o->log_timers_to_tensorboard) {
        tensorboard_check(mt_tb_scalar(tb, "iteration-time", seconds_per_iteration, iteration, &err), &err);
        tensorboard_check(mt_tb_scalar(tb, "throughput", tflops, iteration, &err), &err);
    }
    tensorboard_check(mt_tb_flush(tb, &err), &err);
}

/* split_tag: "validation" or "test" (Megatron writes the test loss under the validation tag too;
 * here it has its own, lm loss test, so the two do not share steps) */
static void tensorboard_evaluation(mt_tb_writer* tb, const run_options* o, const char* split_tag, double loss,
                                   int64_t iteration, int64_t consumed) {
    mt_error err;
    char tag[64];
    snprintf(tag, sizeof(tag), "lm loss %s", split_tag);
    tensorboard_check(mt_tb_scalar_pair(tb, tag, loss, iteration, consumed, &err), &err);
    if (o->log_validation_ppl_to_tensorboard) {
        snprintf(tag, sizeof(tag), "lm loss %s ppl", split_tag);
        tensorboard_check(mt_tb_scalar_pair(tb, tag, exp(loss < 20 ? loss : 20), iteration, consumed, &err), &err);
    }
    tensorboard_check(mt_tb_flush(tb, &err), &err);
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

static void fetch_batch(const mt_gpt_data* data, int split, int64_t consumed, const mt_config* c, int micro,
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
 * validation iterator carries on across evaluations). verbose: Megatron's progress lines (the
 * evaluations after training). */
static double evaluate(mt_trainer* t, const mt_gpt_data* data, int split, int64_t* consumed, int64_t eval_iters,
                       const mt_config* c, int32_t* tokens, int verbose) {
    mt_error err;
    double total = 0.0;
    int micro = mt_num_micro_batches(c);
    if (verbose) printf("Evaluating on %lld samples\n", (long long)(eval_iters * c->global_batch_size));
    for (int64_t k = 0; k < eval_iters; k++) {
        if (verbose) printf("Evaluating iter %lld/%lld\n", (long long)k + 1, (long long)eval_iters);
        fetch_batch(data, split, *consumed, c, micro, tokens);
        *consumed += c->global_batch_size;
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, micro, &loss, &err) != MT_OK) die(1, "%s", err.message);
        total += loss;
    }
    return total / (double)eval_iters;
}

/* --full-validation: the mean loss per token over every sample of the split, each once, from its
 * first (Megatron's full validation). Whole rounds of micro-batch x data-parallel samples go through
 * mt_trainer_evaluate, up to a global batch at a time (each rank its micro-batches, reduced over DP);
 * the last, partial round is run by every rank alike through mt_trainer_token_losses, its rows past
 * the split's end repeating its first sample and left out of the sum. */
static double evaluate_full(mt_trainer* t, const mt_gpt_data* data, int split, const mt_config* c, int32_t* tokens) {
    mt_error err;
    int64_t n = split_samples(data, split), S = c->seq_length, mbs = c->micro_batch_size;
    int64_t round = mbs * c->data_parallel_size, rounds = n / round;
    int micro = mt_num_micro_batches(c);
    double sum = 0.0;
    printf("Evaluating on %lld samples (the whole %s split)\n", (long long)n, mt_split_name(split));
    for (int64_t r = 0; r < rounds; r += micro) {
        int k = rounds - r < micro ? (int)(rounds - r) : micro;
        fetch_batch(data, split, r * round, c, k, tokens);
        double loss = 0.0;
        if (mt_trainer_evaluate(t, tokens, k, &loss, &err) != MT_OK) die(1, "%s", err.message);
        sum += loss * (double)(k * round * S);
    }
    float* losses = (float*)malloc(sizeof(float) * (size_t)(mbs * S));
    if (!losses) die(1, "cannot allocate %lld token losses", (long long)(mbs * S));
    for (int64_t first = rounds * round; first < n; first += mbs) {
        for (int64_t b = 0; b < mbs; b++) {
            int64_t index = first + b < n ? first + b : rounds * round;
            if (mt_gpt_data_get(data, split, index, tokens + b * (S + 1), &err) != MT_OK) die(1, "%s", err.message);
        }
        if (mt_trainer_token_losses(t, tokens, losses, &err) != MT_OK) die(1, "%s", err.message);
        for (int64_t i = 0; i < (n - first < mbs ? n - first : mbs) * S; i++) sum += losses[i];
    }
    free(losses);
    return sum / ((double)n * (double)S);
}

/* Megatron's evaluation line; prefix "iteration N" during training, "iteration N on validation set"
 * and "... on test set" after it. */
static void print_validation(const char* prefix, double loss) {
    char line[256];
    int n = snprintf(line, sizeof(line), " validation loss at %s | lm loss value: %.6E | lm loss PPL: %.6E | ", prefix,
                     loss, exp(loss < 20 ? loss : 20));
    char dashes[256];
    memset(dashes, '-', (size_t)n + 1);
    dashes[n + 1] = 0;
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

/* ---- faults: Megatron's exit conditions ------------------------------------------------------- */

/* Saves a checkpoint (every rank takes part) and returns the iteration saved. */
static int64_t save_checkpoint(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed) {
    mt_error err;
    if (mt_trainer_save(t, dir, iteration, consumed, &err) != MT_OK) die(1, "%s", err.message);
    printf("saved checkpoint at iteration %lld to %s\n", (long long)iteration, dir);
    fflush(stdout);
    return iteration;
}

/* --exit-signal-handler: SIGTERM (Slurm's preemption notice, Megatron's default signal) or SIGINT
 * asks the run to stop after the current step; a second one takes the default action at once. */
static volatile sig_atomic_t g_exit_signal = 0;

static void on_exit_signal(int sig) {
    if (g_exit_signal) {
        signal(sig, SIG_DFL);
        raise(sig);
    }
    g_exit_signal = sig;
}

static void install_exit_signal_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_exit_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* reads and writes in flight (data, a save) go on */
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
        die(1, "cannot install the signal handler: %s", strerror(errno));
}

/* Why the run stops after this iteration (Megatron's checkpoint_and_decide_exit: a signal, the
 * duration, the exit interval), or NULL. Every rank sees the same answer: the signal and the clock
 * are combined over the ranks (as Megatron's all-reduce), the interval is the same everywhere. */
static const char* exit_reason(const run_options* o, int64_t iteration, double t_start, char* buf, size_t cap) {
    int why = 0; /* bit 1: a signal, bit 2: the duration */
    double minutes = (now_seconds() - t_start) / 60.0;
    if (o->exit_signal_handler && g_exit_signal) why |= 1;
    if (o->exit_duration_in_mins > 0 && minutes > (double)o->exit_duration_in_mins) why |= 2;
#ifdef MT_USE_MPI
    if (g_world > 1 && (o->exit_signal_handler || o->exit_duration_in_mins > 0))
        MPI_Allreduce(MPI_IN_PLACE, &why, 1, MPI_INT, MPI_BOR, MPI_COMM_WORLD);
#endif
    if (why & 1) snprintf(buf, cap, "after receiving %s", g_exit_signal == SIGINT ? "SIGINT" : "SIGTERM");
    else if (why & 2) snprintf(buf, cap, "after %.1f minutes (--exit-duration-in-mins %lld)", minutes,
                               (long long)o->exit_duration_in_mins);
    else if (o->exit_interval > 0 && iteration % o->exit_interval == 0)
        snprintf(buf, cap, "at iteration %lld (--exit-interval)", (long long)iteration);
    else return NULL;
    return buf;
}

/* ---- main ------------------------------------------------------------------------------------- */

int main(int argc, char** argv) {
    const double t_launch = now_seconds(); /* --exit-duration-in-mins counts from here, as Megatron's */
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
    parse_args(&o, argc, argv);
    mt_config* c = &o.cfg;
    c->world_size = world;
    c->rank = rank;
    c->local_rank = local_rank;
    c->comm_id = comm_id;

    mt_tokenizer* tok = load_tokenizer(&o);
    c->vocab_size = tok ? mt_tokenizer_vocab_size(tok) : o.null_vocab_size;
    mt_error err;
    if (mt_config_finalize(c, &err) != MT_OK) die(2, "%s", err.message);
    /* data: Megatron's sample counts (refused when they overflow); --skip-train: one evaluation's
     * worth (Megatron) */
    int64_t num_samples[3];
    if (mt_gpt_num_samples(c->train_iters, o.skip_train ? 0 : o.eval_interval, o.eval_iters, c->global_batch_size,
                           num_samples, &err) != MT_OK)
        die(2, "%s", err.message);
    if (o.full_validation) num_samples[MT_SPLIT_VALID] = -1; /* one epoch of the split */
    if (o.builtin) {
        static const char* builtin_prefix = "dev/data/tinyshakespeare_text_document";
        if (rank == 0) prepare_builtin_corpus(tok, builtin_prefix);
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD); /* the others read what rank 0 wrote */
#endif
        o.data_paths[0] = builtin_prefix;
        o.num_data_paths = 1;
    }

    /* data: Megatron's sample indices */
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
    char vp_note[64] = "";
    if (c->virtual_pipeline_size > 1) snprintf(vp_note, sizeof(vp_note), " x %d virtual stages", c->virtual_pipeline_size);
    printf("parallel: %d GPU(s), data-parallel %d, tensor-parallel %d%s, pipeline-parallel %d%s%s%s%s\n", c->world_size,
           c->data_parallel_size, c->tensor_model_parallel_size, c->sequence_parallel ? " (sequence parallel)" : "",
           c->pipeline_model_parallel_size, vp_note,
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
            if (mt_trainer_load(t, o.load, -1, &iteration, &consumed, &err) != MT_OK) die(1, "%s", err.message);
            printf("loaded checkpoint from %s at iteration %lld (%lld samples consumed)\n", o.load, (long long)iteration,
                   (long long)consumed);
            /* the checkpoint's counters are range-checked (>= 0); those of a run past this one's end clamp
             * to it, so the products below stay within the sample counts checked above */
            if (consumed > num_samples[0] && iteration < c->train_iters)
                die(1, "%s: %lld samples consumed, but this run trains on %lld", o.load, (long long)consumed,
                    (long long)num_samples[0]);
            int64_t evaluated = (iteration < c->train_iters ? iteration : c->train_iters);
            if (o.eval_interval > 0) consumed_valid = (evaluated / o.eval_interval) * o.eval_iters * c->global_batch_size;
        } else {
            printf("no checkpoint found in %s: %s\n", o.load,
                   o.skip_train ? "evaluating the initial weights" : "training from scratch");
        }
    }
    if (o.skip_train) consumed_valid = 0; /* Megatron evaluates from the split's first sample */
    mt_tb_writer* tb = tensorboard_open(&o, argc, argv, iteration);

    double peak = o.peak_tflops > 0 ? o.peak_tflops : mt_device_peak_tflops(c->precision);
    double flops_per_iter = mt_flops_per_iteration(c, c->global_batch_size);
    size_t rank_samples = (size_t)mt_num_micro_batches(c) * c->micro_batch_size; /* this rank's share */
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * rank_samples * (c->seq_length + 1));
    if (!tokens) die(1, "cannot allocate the batch");
    double interval_loss = 0.0, interval_time = 0.0;
    int interval_steps = 0, interval_skipped = 0, interval_nan = 0;
    double t_start = now_seconds();
    int64_t saved_at = -1; /* the iteration of the last save */
    char why_buf[128];
    const char* why = NULL; /* why the run stopped early (Megatron's exit conditions) */
    if (o.exit_signal_handler) install_exit_signal_handler();
    if (o.skip_train) printf("skipping training (--skip-train is on) ...\n");
    while (!o.skip_train && iteration < c->train_iters) {
        fetch_batch(data, MT_SPLIT_TRAIN, consumed, c, mt_num_micro_batches(c), tokens);
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
        if (tb && iteration % o.tensorboard_log_interval == 0) tensorboard_iteration(tb, &o, t, &r, iteration, consumed);

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
            if (tb) tensorboard_log_line(tb, &o, iteration, ms / 1000.0, tflops);
            interval_loss = interval_time = 0.0;
            interval_steps = interval_skipped = interval_nan = 0;
        }
        if (o.eval_interval > 0 && iteration % o.eval_interval == 0 && (o.eval_iters > 0 || o.full_validation) &&
            split_samples(data, MT_SPLIT_VALID) > 0) {
            char prefix[64];
            snprintf(prefix, sizeof(prefix), "iteration %lld", (long long)iteration);
            double loss = o.full_validation ? evaluate_full(t, data, MT_SPLIT_VALID, c, tokens)
                                            : evaluate(t, data, MT_SPLIT_VALID, &consumed_valid, o.eval_iters, c, tokens, 0);
            print_validation(prefix, loss);
            if (tb) tensorboard_evaluation(tb, &o, "validation", loss, iteration, consumed);
        }
        if (o.save && o.save_interval > 0 && iteration % o.save_interval == 0)
            saved_at = save_checkpoint(t, o.save, iteration, consumed);
        /* Megatron's exit conditions: save (unless just saved) and stop, without the final evaluations */
        if ((why = exit_reason(&o, iteration, t_launch, why_buf, sizeof(why_buf))) != NULL) {
            if (o.save && saved_at != iteration) saved_at = save_checkpoint(t, o.save, iteration, consumed);
            printf("exiting program %s\n", why);
            break;
        }
    }
    if (!o.skip_train) printf("training took %.1f s\n", now_seconds() - t_start);
    /* as Megatron: validation and test losses at the end of training, or instead of it with
     * --skip-train (then nothing goes to TensorBoard, as in Megatron); none after an exit condition */
    char prefix[96];
    if (!why && o.full_validation && split_samples(data, MT_SPLIT_VALID) > 0) {
        double loss = evaluate_full(t, data, MT_SPLIT_VALID, c, tokens);
        snprintf(prefix, sizeof(prefix), "iteration %lld on validation set", (long long)iteration);
        print_validation(prefix, loss);
        if (tb && !o.skip_train) tensorboard_evaluation(tb, &o, "validation", loss, iteration, consumed);
    } else if (!why && o.eval_iters > 0 &&
               split_samples(data, MT_SPLIT_VALID) >= consumed_valid + o.eval_iters * c->global_batch_size) {
        double loss = evaluate(t, data, MT_SPLIT_VALID, &consumed_valid, o.eval_iters, c, tokens, 1);
        snprintf(prefix, sizeof(prefix), "iteration %lld on validation set", (long long)iteration);
        print_validation(prefix, loss);
        if (tb && !o.skip_train) tensorboard_evaluation(tb, &o, "validation", loss, iteration, consumed);
    }
    if (!why && o.eval_iters > 0 && split_samples(data, MT_SPLIT_TEST) >= o.eval_iters * c->global_batch_size) {
        int64_t consumed_test = 0;
        double loss = evaluate(t, data, MT_SPLIT_TEST, &consumed_test, o.eval_iters, c, tokens, 1);
        snprintf(prefix, sizeof(prefix), "iteration %lld on test set", (long long)iteration);
        print_validation(prefix, loss);
        if (tb && !o.skip_train) tensorboard_evaluation(tb, &o, "test", loss, iteration, consumed);
    }
    if (tb && mt_tb_close(tb, &err) != MT_OK) die(1, "%s", err.message);
    if (o.save && !o.skip_train && saved_at != iteration) saved_at = save_checkpoint(t, o.save, iteration, consumed);
    /* every rank samples (the same tokens: same seed; with tensor parallelism the forward needs the
     * whole TP group); only rank 0's stdout is open */
    if (why) {
        /* Megatron's exit conditions end the run without a sample */
    } else if (c->pipeline_model_parallel_size > 1 && o.sample_tokens > 0)
        printf("sample: skipped (generation needs the whole model on one stage: --pipeline-model-parallel-size 1)\n");
    else
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
