/*
 * megatron.h — the public C API of megatron.c, plus its host-only code (stb style).
 *
 * megatron.c is Megatron-LM's pretraining system as a small C/CUDA codebase. This header is the
 * one file you copy into another project:
 *
 *   - Declarations are always visible, C99, usable from C and C++ (extern "C"), every public name
 *     prefixed mt_ / MT_.
 *   - Host-only implementation (datasets, sample index, config helpers, FLOP formula ...) sits under
 *     #ifdef MEGATRON_IMPLEMENTATION. Define it in exactly one C or C++ file before including this
 *     header. A plain C program then has the .bin/.idx reader and writer and Megatron's GPT sample
 *     index without CUDA.
 *   - The GPU-side API (mt_trainer_*) is declared here and implemented in megatron.cu, which defines
 *     MEGATRON_IMPLEMENTATION itself; link megatron.o (built by nvcc) to use it.
 *
 * Errors: every fallible function returns an mt_status and, when given a non-NULL mt_error*, a
 * one-line message naming the problem. Library code never exits and never prints.
 *
 * Sections (declarations, then implementation in the same order):
 *   1. Status and errors
 *   2. Indexed datasets (.bin/.idx, Megatron MMIDIDX v1): reader and writer
 *   3. GPT datasets: --split, document/sample/shuffle index, blending (bit-exact with Megatron)
 *   4. .npy writer (Megatron's index cache format)
 *   5. Training configuration, learning-rate schedule, FLOP formula
 *   6. The trainer API (GPU; implemented in megatron.cu)
 */
#ifndef MEGATRON_H
#define MEGATRON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* 1. Status and errors                                                                            */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
    MT_OK = 0,
    MT_ERR_IO,       /* a file could not be opened, read, written or renamed */
    MT_ERR_FORMAT,   /* a file's contents are not what they must be */
    MT_ERR_ARG,      /* a bad argument or flag value */
    MT_ERR_CONFIG,   /* an inconsistent configuration */
    MT_ERR_OOM,      /* host or device memory exhausted */
    MT_ERR_CUDA,     /* a CUDA runtime or cuBLAS call failed */
    MT_ERR_NCCL,     /* an NCCL call failed */
    MT_ERR_RANGE     /* an index out of range */
} mt_status;

/* One clear line describing the last failure of a call that was handed this struct. */
typedef struct {
    char message[512];
} mt_error;

const char* mt_status_name(mt_status status);
/* printf-style: fills err (if not NULL) and returns status, so error paths read
 * `return mt_fail(err, MT_ERR_IO, "cannot open %s", path);` */
mt_status mt_fail(mt_error* err, mt_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* SECTION 2-5 DECLARATIONS: see below */

/* ---------------------------------------------------------------------------------------------- */
/* 5. Training configuration, learning-rate schedule, FLOP formula                                 */
/*    Field names follow Megatron's flags (--hidden-size -> hidden_size). mt_config_defaults()     */
/*    gives Megatron's defaults; mt_config_finalize() derives what Megatron derives (padded vocab, */
/*    ffn size, kv channels, warmup and decay lengths) and rejects inconsistent configurations.    */
/* ---------------------------------------------------------------------------------------------- */

typedef enum { MT_FP32 = 0, MT_BF16 = 1, MT_FP16 = 2 } mt_precision;

typedef enum {
    MT_LR_CONSTANT = 0,
    MT_LR_LINEAR,
    MT_LR_COSINE,
    MT_LR_INVERSE_SQUARE_ROOT,
    MT_LR_WSD
} mt_lr_decay_style;

typedef enum { MT_WSD_EXPONENTIAL = 0, MT_WSD_LINEAR, MT_WSD_COSINE, MT_WSD_MINUS_SQRT } mt_wsd_decay_style;

typedef struct {
    /* model */
    int num_layers;                   /* --num-layers */
    int hidden_size;                  /* --hidden-size */
    int ffn_hidden_size;              /* --ffn-hidden-size (0: 4*hidden_size) */
    int num_attention_heads;          /* --num-attention-heads */
    int num_query_groups;             /* --num-query-groups (0: = heads, i.e. no GQA) */
    int kv_channels;                  /* --kv-channels (0: hidden_size / heads) */
    int seq_length;                   /* --seq-length */
    int max_position_embeddings;      /* --max-position-embeddings (0: seq_length) */
    int64_t vocab_size;               /* the tokenizer's vocabulary */
    int make_vocab_size_divisible_by; /* --make-vocab-size-divisible-by (128) */
    int64_t padded_vocab_size;        /* derived: ceil(vocab / (divisible_by * tp)) * divisible_by * tp */
    double init_method_std;           /* --init-method-std (0.02) */
    double norm_epsilon;              /* --norm-epsilon (1e-5) */
    double hidden_dropout;            /* --hidden-dropout (must be 0 for now) */
    double attention_dropout;         /* --attention-dropout (must be 0 for now) */
    mt_precision precision;           /* --bf16 / --fp16, default fp32 */
    /* fp16 dynamic loss scaler (Megatron's DynamicGradScaler) */
    double loss_scale;                /* --loss-scale: > 0 means a constant scale */
    double initial_loss_scale;        /* --initial-loss-scale (2^32) */
    double min_loss_scale;            /* --min-loss-scale (1) */
    int loss_scale_window;            /* --loss-scale-window (1000) */
    int hysteresis;                   /* --hysteresis (2) */
    /* optimizer and schedule */
    double lr;                        /* --lr */
    double min_lr;                    /* --min-lr (0) */
    double lr_warmup_init;            /* --lr-warmup-init (0) */
    mt_lr_decay_style lr_decay_style; /* --lr-decay-style (linear) */
    int64_t lr_warmup_iters;          /* --lr-warmup-iters (0) */
    double lr_warmup_fraction;        /* --lr-warmup-fraction (< 0: unset) */
    int64_t lr_decay_iters;           /* --lr-decay-iters (0: train_iters) */
    int64_t lr_wsd_decay_iters;       /* --lr-wsd-decay-iters (WSD's annealing tail) */
    mt_wsd_decay_style lr_wsd_decay_style; /* --lr-wsd-decay-style (exponential) */
    double adam_beta1, adam_beta2, adam_eps; /* 0.9, 0.999, 1e-8 */
    double weight_decay;              /* --weight-decay (0.01) */
    double clip_grad;                 /* --clip-grad (1.0; 0 disables) */
    /* batch and length of training */
    int micro_batch_size;             /* --micro-batch-size */
    int global_batch_size;            /* --global-batch-size (0: micro * data-parallel size) */
    int64_t train_iters;              /* --train-iters */
    uint64_t seed;                    /* --seed (1234) */
    /* parallel layout (1 everywhere on one GPU) */
    int tensor_model_parallel_size;
    int pipeline_model_parallel_size;
    int data_parallel_size;           /* derived: world / (tp * pp) */
    int world_size, rank;
} mt_config;

void mt_config_defaults(mt_config* cfg);
/* Derives padded vocab, ffn, kv channels, max positions, global batch; checks consistency. */
mt_status mt_config_finalize(mt_config* cfg, mt_error* err);
int64_t mt_padded_vocab_size(int64_t vocab_size, int divisible_by, int tensor_parallel_size);
/* Number of micro-batches one rank runs per iteration: global / (micro * dp). */
int mt_num_micro_batches(const mt_config* cfg);

/* Megatron's OptimizerParamScheduler, counted in samples: `num_steps` grows by the global batch
 * size after each optimizer step, and the step taken at num_steps uses mt_learning_rate(cfg, num_steps). */
double mt_learning_rate(const mt_config* cfg, int64_t num_steps);

/* Megatron's num_floating_point_operations for one global batch (training.py), and the parameter count. */
double mt_flops_per_iteration(const mt_config* cfg, int64_t global_batch_size);
int64_t mt_num_parameters(const mt_config* cfg);

/* The model's parameter tensors in canonical order (the order of checkpoints and test vectors). */
enum {
    MT_P_WORD_EMBEDDINGS = 0, /* [Vp, h] */
    MT_P_POSITION_EMBEDDINGS, /* [P, h] */
    MT_P_LN1_WEIGHT,          /* [L, h] */
    MT_P_LN1_BIAS,            /* [L, h] */
    MT_P_QKV_WEIGHT,          /* [L, (heads + 2 * groups) * kv, h], Megatron's grouped layout */
    MT_P_QKV_BIAS,            /* [L, (heads + 2 * groups) * kv] */
    MT_P_PROJ_WEIGHT,         /* [L, h, heads * kv] */
    MT_P_PROJ_BIAS,           /* [L, h] */
    MT_P_LN2_WEIGHT,          /* [L, h] */
    MT_P_LN2_BIAS,            /* [L, h] */
    MT_P_FC1_WEIGHT,          /* [L, f, h] */
    MT_P_FC1_BIAS,            /* [L, f] */
    MT_P_FC2_WEIGHT,          /* [L, h, f] */
    MT_P_FC2_BIAS,            /* [L, h] */
    MT_P_FINAL_LN_WEIGHT,     /* [h] */
    MT_P_FINAL_LN_BIAS,       /* [h] */
    MT_NUM_PARAM_TENSORS
};
typedef struct {
    const char* name;
    int64_t numel;
    int64_t offset;        /* in elements, into the one flat parameter buffer */
    int weight_decay;      /* 1 for matrices and embeddings, 0 for biases and norms (Megatron) */
    int init;              /* 0 zeros, 1 ones, 2 normal(std), 3 normal(std / sqrt(2 L)) */
} mt_param_info;
/* Fills info[MT_NUM_PARAM_TENSORS]; returns the total element count. */
int64_t mt_param_layout(const mt_config* cfg, mt_param_info* info);

/* ---------------------------------------------------------------------------------------------- */
/* 6. The trainer (GPU; implemented in megatron.cu)                                                */
/* ---------------------------------------------------------------------------------------------- */

typedef struct mt_trainer mt_trainer;

/* Where every byte of device memory goes, per GPU. */
typedef struct {
    int64_t num_parameters;
    size_t parameter_bytes;   /* model-precision weights */
    size_t master_bytes;      /* fp32 master weights (0 in fp32, where the weights are the master) */
    size_t gradient_bytes;    /* fp32 gradient accumulation buffer */
    size_t optimizer_bytes;   /* Adam moments */
    size_t activation_bytes;  /* the activation arena for one micro-batch */
    size_t workspace_bytes;   /* cuBLAS workspace, reduction scratch, staging */
    size_t total_bytes;
} mt_memory_plan;

typedef struct {
    double lm_loss;           /* mean loss over the global batch */
    double grad_norm;         /* global L2 norm before clipping (0 on a skipped step) */
    double learning_rate;     /* the rate this step used */
    double next_learning_rate;/* the rate after the scheduler step (what Megatron logs) */
    double loss_scale;        /* the scale this step used (1 unless fp16) */
    int skipped;              /* 1 if the step was skipped (fp16 overflow) */
    int nan;                  /* 1 if the loss was nan/inf */
} mt_step_result;

typedef void (*mt_log_fn)(void* user, const char* line);

/* Creates a trainer on the current CUDA device: plans and allocates all memory once, initialises
 * the weights from cfg->seed as Megatron does (normal(std), output projections scaled by 1/sqrt(2L),
 * biases 0, norms 1). cfg must have been finalized. */
mt_status mt_trainer_create(mt_trainer** out, const mt_config* cfg, mt_error* err);
void mt_trainer_free(mt_trainer* t);
mt_memory_plan mt_trainer_memory_plan(const mt_trainer* t);

/* One training iteration over this rank's part of the global batch.
 * tokens: [num_micro_batches, micro_batch_size, seq_length + 1] (inputs are [..., :-1], labels [..., 1:]). */
mt_status mt_trainer_train_step(mt_trainer* t, const int32_t* tokens, mt_step_result* out, mt_error* err);
/* Forward + backward only: fills the fp32 gradients (mean loss over the batch) and returns the loss. */
mt_status mt_trainer_compute_gradients(mt_trainer* t, const int32_t* tokens, int num_micro_batches,
                                       double* loss, mt_error* err);
/* Mean loss over num_micro_batches micro-batches, no gradients. */
mt_status mt_trainer_evaluate(mt_trainer* t, const int32_t* tokens, int num_micro_batches, double* loss,
                              mt_error* err);
/* Logits of one micro-batch: tokens [micro_batch_size, seq_length], logits [micro, seq, padded vocab] (fp32). */
mt_status mt_trainer_logits(mt_trainer* t, const int32_t* tokens, float* logits, mt_error* err);

/* Parameters and gradients in canonical order, fp32 (mt_num_parameters elements). */
mt_status mt_trainer_set_parameters(mt_trainer* t, const float* params, mt_error* err);
mt_status mt_trainer_get_parameters(mt_trainer* t, float* params, mt_error* err);
mt_status mt_trainer_get_gradients(mt_trainer* t, float* grads, mt_error* err);

/* Checkpoints in Megatron's layout: <dir>/iter_0000100/mp_rank_00/model_optim_rng.bin and
 * <dir>/latest_checkpointed_iteration.txt, written under temporary names and renamed, tracker last.
 * The checkpoint holds weights, optimizer state, scheduler, loss scaler and data position. */
mt_status mt_trainer_save(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples,
                          mt_error* err);
/* Loads the latest checkpoint under dir (or iteration `iteration` if >= 0); refuses one of another
 * model shape. Returns the iteration and consumed samples it resumes from. */
mt_status mt_trainer_load(mt_trainer* t, const char* dir, int64_t iteration, int64_t* iteration_out,
                          int64_t* consumed_samples_out, mt_error* err);

#ifdef __cplusplus
}
#endif

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
#ifdef MEGATRON_IMPLEMENTATION

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1. Status and errors ------------------------------------------------------------------------- */

const char* mt_status_name(mt_status status) {
    switch (status) {
        case MT_OK: return "ok";
        case MT_ERR_IO: return "io error";
        case MT_ERR_FORMAT: return "format error";
        case MT_ERR_ARG: return "bad argument";
        case MT_ERR_CONFIG: return "bad configuration";
        case MT_ERR_OOM: return "out of memory";
        case MT_ERR_CUDA: return "cuda error";
        case MT_ERR_NCCL: return "nccl error";
        case MT_ERR_RANGE: return "out of range";
    }
    return "unknown error";
}

mt_status mt_fail(mt_error* err, mt_status status, const char* fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
    }
    return status;
}

/* SECTION 2-5 IMPLEMENTATION: see below */

/* 5. Training configuration, learning-rate schedule, FLOP formula ------------------------------ */

void mt_config_defaults(mt_config* cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->make_vocab_size_divisible_by = 128;
    cfg->init_method_std = 0.02;
    cfg->norm_epsilon = 1e-5;
    cfg->precision = MT_FP32;
    cfg->initial_loss_scale = 4294967296.0; /* 2^32 */
    cfg->min_loss_scale = 1.0;
    cfg->loss_scale_window = 1000;
    cfg->hysteresis = 2;
    cfg->lr_decay_style = MT_LR_LINEAR;
    cfg->lr_warmup_fraction = -1.0;
    cfg->lr_wsd_decay_style = MT_WSD_EXPONENTIAL;
    cfg->adam_beta1 = 0.9;
    cfg->adam_beta2 = 0.999;
    cfg->adam_eps = 1e-8;
    cfg->weight_decay = 0.01;
    cfg->clip_grad = 1.0;
    cfg->micro_batch_size = 1;
    cfg->seed = 1234;
    cfg->tensor_model_parallel_size = 1;
    cfg->pipeline_model_parallel_size = 1;
    cfg->world_size = 1;
}

int64_t mt_padded_vocab_size(int64_t vocab_size, int divisible_by, int tensor_parallel_size) {
    int64_t multiple = (int64_t)divisible_by * tensor_parallel_size;
    if (multiple <= 0) return vocab_size;
    return (vocab_size + multiple - 1) / multiple * multiple;
}

mt_status mt_config_finalize(mt_config* c, mt_error* err) {
    if (c->num_layers <= 0) return mt_fail(err, MT_ERR_CONFIG, "--num-layers must be positive");
    if (c->hidden_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "--hidden-size must be positive");
    if (c->num_attention_heads <= 0) return mt_fail(err, MT_ERR_CONFIG, "--num-attention-heads must be positive");
    if (c->seq_length <= 0) return mt_fail(err, MT_ERR_CONFIG, "--seq-length must be positive");
    if (c->vocab_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "the vocabulary size must be positive");
    if (c->ffn_hidden_size == 0) c->ffn_hidden_size = 4 * c->hidden_size;
    if (c->num_query_groups == 0) c->num_query_groups = c->num_attention_heads;
    if (c->kv_channels == 0) {
        if (c->hidden_size % c->num_attention_heads)
            return mt_fail(err, MT_ERR_CONFIG, "--hidden-size %d is not divisible by --num-attention-heads %d",
                           c->hidden_size, c->num_attention_heads);
        c->kv_channels = c->hidden_size / c->num_attention_heads;
    }
    if (c->num_attention_heads % c->num_query_groups)
        return mt_fail(err, MT_ERR_CONFIG, "--num-attention-heads %d is not divisible by --num-query-groups %d",
                       c->num_attention_heads, c->num_query_groups);
    if (c->max_position_embeddings == 0) c->max_position_embeddings = c->seq_length;
    if (c->seq_length > c->max_position_embeddings)
        return mt_fail(err, MT_ERR_CONFIG, "--seq-length %d exceeds --max-position-embeddings %d", c->seq_length,
                       c->max_position_embeddings);
    if (c->hidden_dropout != 0.0 || c->attention_dropout != 0.0)
        return mt_fail(err, MT_ERR_CONFIG,
                       "dropout is not implemented: pass --hidden-dropout 0 --attention-dropout 0");
    if (c->tensor_model_parallel_size < 1 || c->pipeline_model_parallel_size < 1)
        return mt_fail(err, MT_ERR_CONFIG, "parallel sizes must be >= 1");
    if (c->world_size < 1) c->world_size = 1;
    int model_parallel = c->tensor_model_parallel_size * c->pipeline_model_parallel_size;
    if (c->world_size % model_parallel)
        return mt_fail(err, MT_ERR_CONFIG, "world size %d is not divisible by tensor x pipeline parallel size %d",
                       c->world_size, model_parallel);
    c->data_parallel_size = c->world_size / model_parallel;
    c->padded_vocab_size =
        mt_padded_vocab_size(c->vocab_size, c->make_vocab_size_divisible_by, c->tensor_model_parallel_size);
    if (c->micro_batch_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "--micro-batch-size must be positive");
    if (c->global_batch_size == 0) c->global_batch_size = c->micro_batch_size * c->data_parallel_size;
    if (c->global_batch_size % (c->micro_batch_size * c->data_parallel_size))
        return mt_fail(err, MT_ERR_CONFIG,
                       "--global-batch-size %d is not divisible by --micro-batch-size %d x data-parallel size %d",
                       c->global_batch_size, c->micro_batch_size, c->data_parallel_size);
    if (c->train_iters <= 0) return mt_fail(err, MT_ERR_CONFIG, "--train-iters must be positive");
    if (c->lr < 0 || c->min_lr < 0) return mt_fail(err, MT_ERR_CONFIG, "learning rates must be >= 0");
    if (c->min_lr > c->lr) return mt_fail(err, MT_ERR_CONFIG, "--min-lr %g exceeds --lr %g", c->min_lr, c->lr);
    if (c->lr_decay_iters == 0) c->lr_decay_iters = c->train_iters;
    if (c->lr_warmup_fraction >= 0 && c->lr_warmup_iters > 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive");
    if (c->lr_warmup_fraction > 1.0) return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-fraction must be <= 1");
    if (c->lr_warmup_iters > c->lr_decay_iters)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-iters %lld exceeds --lr-decay-iters %lld",
                       (long long)c->lr_warmup_iters, (long long)c->lr_decay_iters);
    if (c->lr_decay_style == MT_LR_WSD && c->lr_wsd_decay_iters <= 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-decay-style WSD needs --lr-wsd-decay-iters");
    if (c->adam_beta1 < 0 || c->adam_beta1 >= 1 || c->adam_beta2 < 0 || c->adam_beta2 >= 1)
        return mt_fail(err, MT_ERR_CONFIG, "Adam betas must be in [0, 1)");
    if (c->precision == MT_FP16 && c->loss_scale <= 0 && c->initial_loss_scale <= 0)
        return mt_fail(err, MT_ERR_CONFIG, "--initial-loss-scale must be positive");
    return MT_OK;
}

int mt_num_micro_batches(const mt_config* c) {
    return c->global_batch_size / (c->micro_batch_size * c->data_parallel_size);
}

/* Megatron's OptimizerParamScheduler.get_lr: linear warmup from lr_warmup_init, then the decay
 * style down to min_lr at lr_decay_iters, min_lr after. All lengths are in samples. */
double mt_learning_rate(const mt_config* c, int64_t num_steps) {
    const double pi = 3.14159265358979323846;
    int64_t gbs = c->global_batch_size;
    int64_t decay_steps = c->lr_decay_iters * gbs;
    int64_t warmup_steps = c->lr_warmup_fraction >= 0 ? (int64_t)(c->lr_warmup_fraction * (double)decay_steps)
                                                      : c->lr_warmup_iters * gbs;
    double max_lr = c->lr, min_lr = c->min_lr;
    if (warmup_steps > 0 && num_steps <= warmup_steps)
        return c->lr_warmup_init + (max_lr - c->lr_warmup_init) * (double)num_steps / (double)warmup_steps;
    if (c->lr_decay_style == MT_LR_CONSTANT) return max_lr;
    if (num_steps > decay_steps) return min_lr;
    if (c->lr_decay_style == MT_LR_INVERSE_SQUARE_ROOT) {
        double warmup = warmup_steps > 0 ? (double)warmup_steps : 1.0;
        double lr = max_lr * sqrt(warmup) / sqrt(num_steps > 0 ? (double)num_steps : 1.0);
        return lr > min_lr ? lr : min_lr;
    }
    double ratio = (double)(num_steps - warmup_steps) / (double)(decay_steps - warmup_steps);
    double coeff;
    if (c->lr_decay_style == MT_LR_LINEAR) {
        coeff = 1.0 - ratio;
    } else if (c->lr_decay_style == MT_LR_COSINE) {
        coeff = 0.5 * (cos(pi * ratio) + 1.0);
    } else { /* WSD: constant until the annealing tail, then the tail's shape down to min_lr */
        int64_t anneal_steps = c->lr_wsd_decay_iters * gbs;
        int64_t stable_end = decay_steps - anneal_steps;
        if (num_steps <= stable_end) {
            coeff = 1.0;
        } else {
            double r = (double)(num_steps - stable_end) / (double)anneal_steps;
            switch (c->lr_wsd_decay_style) {
                case MT_WSD_LINEAR: coeff = 1.0 - r; break;
                case MT_WSD_COSINE: coeff = 0.5 * (cos(pi * r) + 1.0); break;
                case MT_WSD_MINUS_SQRT: coeff = 1.0 - sqrt(r); break;
                default: coeff = pow(0.5, r); break; /* exponential */
            }
        }
    }
    return min_lr + coeff * (max_lr - min_lr);
}

/* training.py:num_floating_point_operations (dense, no MoE/MTP): 3 passes (forward, dgrad, wgrad)
 * x 2 (multiply-add) over every GEMM, causal attention halved, plus the logits. */
double mt_flops_per_iteration(const mt_config* c, int64_t batch) {
    double s = c->seq_length, h = c->hidden_size, L = c->num_layers, V = (double)c->padded_vocab_size;
    double n = c->num_attention_heads, g = c->num_query_groups, d = c->kv_channels, f = c->ffn_hidden_size;
    double mlp_factor = 2.0; /* 3 with SwiGLU */
    double tokens = (double)batch * s;
    return tokens * (6.0 * h * f * mlp_factor * L + 6.0 * (h * (n * d + 2.0 * g * d) + n * d * h) * L + 6.0 * h * V) +
           (double)batch * s * s * 6.0 * n * d * L;
}

int64_t mt_param_layout(const mt_config* c, mt_param_info* info) {
    int64_t L = c->num_layers, h = c->hidden_size, f = c->ffn_hidden_size;
    int64_t qkv = (int64_t)(c->num_attention_heads + 2 * c->num_query_groups) * c->kv_channels;
    int64_t attn = (int64_t)c->num_attention_heads * c->kv_channels;
    struct { const char* name; int64_t numel; int wd; int init; } t[MT_NUM_PARAM_TENSORS] = {
        {"word_embeddings", c->padded_vocab_size * h, 1, 2},
        {"position_embeddings", (int64_t)c->max_position_embeddings * h, 1, 2},
        {"ln1_weight", L * h, 0, 1},
        {"ln1_bias", L * h, 0, 0},
        {"qkv_weight", L * qkv * h, 1, 2},
        {"qkv_bias", L * qkv, 0, 0},
        {"proj_weight", L * h * attn, 1, 3},
        {"proj_bias", L * h, 0, 0},
        {"ln2_weight", L * h, 0, 1},
        {"ln2_bias", L * h, 0, 0},
        {"fc1_weight", L * f * h, 1, 2},
        {"fc1_bias", L * f, 0, 0},
        {"fc2_weight", L * h * f, 1, 3},
        {"fc2_bias", L * h, 0, 0},
        {"final_ln_weight", h, 0, 1},
        {"final_ln_bias", h, 0, 0},
    };
    int64_t offset = 0;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        if (info) {
            info[i].name = t[i].name;
            info[i].numel = t[i].numel;
            info[i].offset = offset;
            info[i].weight_decay = t[i].wd;
            info[i].init = t[i].init;
        }
        offset += t[i].numel;
    }
    return offset;
}

int64_t mt_num_parameters(const mt_config* c) { return mt_param_layout(c, NULL); }

#ifdef __cplusplus
}
#endif

#endif /* MEGATRON_IMPLEMENTATION */
#endif /* MEGATRON_H */
