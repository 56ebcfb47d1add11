/*
 * train_gpt_flags.h — train_gpt's command line as data: one table row per flag (its name, its
 * Megatron argument group, what it takes, its default, one line of meaning, where it lands), and
 * the three things made from that one table: the parser, --help, and the startup line that lists
 * the flags this build accepts without their changing anything.
 *
 * Every flag has one of three answers:
 *   - implemented: Megatron's name, default and meaning (the value lands in tg_flags, then
 *     tg_flags_apply turns it into mt_config and the run's options);
 *   - informational (F_INFO_*): Megatron's flag for something this build does one way by design
 *     (fused kernels, no data-loader workers, mmapped files ...); accepted and named in one line
 *     at startup, never silently;
 *   - refused (F_REFUSED_*): one line saying why and what to do instead.
 * A flag not in the table is unknown. `--flag=value` works wherever argparse accepts it.
 *
 * Adding a flag is one row in tg_flag_table (plus a field in tg_flags and, for an implemented
 * flag, its use in the tg_apply_* step of tg_flags_apply it belongs to). Included by train_gpt.c and by tests/test_flags.h; no exits,
 * no printing besides tg_flags_help: errors come back as text.
 */
#ifndef TRAIN_GPT_FLAGS_H
#define TRAIN_GPT_FLAGS_H

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megatron.h"

#define TG_MAX_DATA_PATHS 64
#define TG_MAX_INFO 64
#define TG_MAX_SPECIAL_TOKENS 1024

/* Everything the command line sets. Numeric fields start at -1 ("not given"; every range below
 * excludes -1), strings at NULL, switches at 0; tg_flags_apply fills cfg and the run options. */
typedef struct {
    mt_config cfg;
    /* data */
    int num_data_paths;
    const char* data_paths[TG_MAX_DATA_PATHS];
    double data_weights[TG_MAX_DATA_PATHS];
    int weighted;
    const char* split;
    const char* data_cache_path;
    int mock_data;
    int eod_mask_loss;
    int reset_position_ids, reset_attention_mask;
    double mid_level_surplus;
    /* tokenizer */
    const char* tokenizer_type;
    const char* vocab_file;
    const char* merge_file;
    const char* tokenizer_model;
    const char* tiktoken_pattern;
    int64_t tiktoken_num_special_tokens;
    const char* special_tokens[TG_MAX_SPECIAL_TOKENS]; /* --tokenizer-special-tokens */
    int num_special_tokens;
    int hf_no_include_special_tokens;
    const char* tiktoken_encoding;
    int64_t null_vocab_size;
    /* logging, evaluation, checkpoints, exits, profiling */
    int64_t log_interval, eval_interval, eval_iters, save_interval, exit_interval, exit_duration_in_mins;
    int64_t max_nan_in_a_row; /* --max-consecutive-nan-iterations */
    int exit_signal_handler;  /* SIGTERM/SIGINT: finish the step, save, exit 0 */
    int no_check_for_nan;     /* --no-check-for-nan-in-loss-and-grad */
    int log_throughput;
    const char* save;
    int64_t save_retain_interval; /* --save-retain-interval (-1: keep every checkpoint) */
    int64_t eval_global_batch_size; /* --eval-global-batch-size (-1: not given; else must be the global batch) */
    int64_t dist_opt_instances;     /* --num-distributed-optimizer-instances (-1: not given; only 1 here) */
    const char* load;
    int no_load_optim, no_load_rng, finetune;
    int async_save;           /* --async-save: files written in the background */
    int no_verify_checkpoint; /* --no-verify-checkpoint: --load warns where the integrity rule refuses */
    int profile;
    int64_t profile_step_start, profile_step_end;
    /* watching and judging a run: TensorBoard events, the wandb pointer, evaluation without training */
    const char* tensorboard_dir;
    int64_t tensorboard_log_interval; /* -1: not given (1) */
    int tensorboard_queue_size;       /* -1: not given (1000) */
    int log_timers_to_tensorboard, log_memory_to_tensorboard, log_validation_ppl_to_tensorboard;
    int log_world_size_to_tensorboard, no_log_loss_scale_to_tensorboard;
    const char* wandb_project;
    const char* wandb_exp_name;
    const char* wandb_save_dir;
    const char* wandb_entity;         /* --wandb-entity: named in the startup line's wandb sync command */
    int skip_train, full_validation;
    /* this build's own */
    int sample_tokens;
    double peak_tflops;
    /* the memory plan without a GPU: --plan (this layout), --plan-layouts (every layout of the world) */
    int plan, plan_layouts;
    int64_t plan_world_size; /* --world-size (-1: not given) */
    double gpu_memory_gib;   /* --gpu-memory-gib (-1: not given; 80) */
    int builtin;   /* no --data-path and no --mock-data: the built-in job */
    /* raw values that tg_flags_apply maps into cfg */
    int64_t num_layers, hidden, ffn, heads, groups, kv, seq, maxpos, divisible, mbs, gbs, iters, train_samples;
    int64_t warmup, decay_iters, wsd_iters, warmup_samples, decay_samples, wsd_samples, tp, pp, cp, ep;
    int64_t window, hysteresis, seed, rampup[3];
    double lr, min_lr, decoupled_lr, decoupled_min_lr, warmup_fraction, warmup_init, b1, b2, eps, wd, clip, std,
        norm_eps, hidden_dropout, attention_dropout, loss_scale, initial_loss_scale, min_loss_scale, rotary_base,
        rotary_percent, rope_factor;
    int bf16, fp16, untie, swiglu, no_bias, gqa, rope_scaling, layernorm_1p, no_position_embedding;
    int per_token_loss;
    const char* decay_style;
    const char* wsd_style;
    const char* normalization;
    const char* position_type;
    const char* batch_schedule;
    char batch_schedule_words[1024]; /* the schedule's words rejoined when the shell split them */
    const char* optimizer;
    const char* distributed_backend;
    const char* cp_comm_type;         /* --cp-comm-type */
    const char* fp8_format;
    const char* fp8_recipe;
    const char* fp8_algo;
    int fp8_margin, fp8_history, no_fp8_wgrad, first_last_bf16, bf16_start, bf16_end, fp8_param_gather;
    int sequence_parallel, distributed_optimizer, overlap_grad_reduce, overlap_param_gather, grad_reduce_bf16;
    /* activation recompute: --recompute-activations, -granularity, -method, -num-layers (-1: not
     * given), -modules (MT_RECOMPUTE_* bits; 0: not given) */
    int recompute_activations;
    int moe_layer_recompute; /* --moe-layer-recompute: selective with the moe module (Megatron's mapping) */
    const char* recompute_granularity;
    const char* recompute_method;
    int recompute_num_layers;
    int recompute_modules;
    int64_t ddp_bucket_size;
    /* mixture of experts: the flags that tg_apply_moe turns into cfg's MoE fields (the rest land there
     * directly); the two lists (argparse nargs='+') in the order given */
    const char* moe_layer_freq;
    const char* moe_score_function;
    const char* moe_router_dtype;
    const char* moe_drop_policy;
    const char* moe_dispatcher;
    int moe_shared_overlap;
    int moe_lb_count;             /* --moe-router-load-balancing-type: indices into TG_MOE_LB_TYPES */
    int moe_lb[8];
    int moe_coeff_count;          /* --moe-aux-loss-coeff */
    double moe_coeff[8];
    /* the informational flags given, for the startup line: "--name" or "--name value" */
    int num_info;
    char info[TG_MAX_INFO][160];
} tg_flags;

typedef enum {
    F_INT,            /* int */
    F_INT64,          /* int64_t */
    F_INT64_3,        /* three int64_t (argparse nargs=3) */
    F_DOUBLE,
    F_STRING,         /* with an optional list of choices */
    F_TRUE,           /* a switch: sets an int to 1 */
    F_INFO_SWITCH,    /* accepted; changes nothing here by design */
    F_INFO_VALUE,     /* accepted with its value; changes nothing here by design */
    F_REFUSED_SWITCH, /* refused: the help text says why and what instead */
    F_REFUSED_VALUE
} tg_flag_kind;

enum { D_LO_OPEN = 1, D_HI_OPEN = 2 };

typedef struct {
    const char* name;
    const char* group;    /* Megatron's argument group */
    tg_flag_kind kind;
    size_t target;        /* offsetof(tg_flags, ...) (unused by informational and refused flags) */
    int64_t imin, imax;   /* integers: the accepted range */
    double dmin, dmax;    /* doubles: the accepted range (dmax INFINITY: no upper bound) */
    int dopen;            /* doubles: D_LO_OPEN / D_HI_OPEN */
    const char* choices;  /* strings: "a|b|c" or NULL */
    const char* def;      /* the default, as --help prints it */
    const char* help;     /* one line: the meaning; for informational and refused flags, why */
} tg_flag;

#define TG_AT(field) offsetof(tg_flags, field)
#define IR(lo, hi) (int64_t)(lo), (int64_t)(hi), 0.0, 0.0, 0, NULL
#define DR(lo, hi, open) 0, 0, (double)(lo), (double)(hi), (open), NULL
#define CH(choices) 0, 0, 0.0, 0.0, 0, (choices)
#define NR 0, 0, 0.0, 0.0, 0, NULL
#define TG_I32MAX 2147483647
#define TG_I64MAX INT64_MAX

#define G_MODEL "model (network size, transformer configuration)"
#define G_REG "regularization"
#define G_TRAIN "training"
#define G_INIT "RNG and initialization"
#define G_LR "learning rate and weight decay"
#define G_CKPT "checkpointing"
#define G_MIXED "mixed precision"
#define G_DIST "distributed"
#define G_VALID "validation"
#define G_DATA "data and dataloader"
#define G_TOK "tokenizer"
#define G_LOG "logging"
#define G_PROF "profiling"
#define G_MOE "moe"
#define G_HERE "this build"

#define MOE_NOT_BUILT "is not built here (dev/moe_semantics.md): drop the flag"
#define TG_MOE_LB_TYPES "aux_loss|seq_aux_loss|global_aux_loss|sinkhorn|quantile_balancing|none"
#define MLA_REFUSED "multi-latent attention is not implemented: drop the MLA flags (--multi-latent-attention, " \
                    "--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim)"
#define ATTENTION_VARIANT_REFUSED "attention variants (gated delta net, linear attention, DeepSeek sparse attention) " \
                                  "are not implemented, only softmax attention: drop the flag"
#define MUP_REFUSED "muP (maximal update parametrization) is not implemented: drop --use-mup and --mup-*"
#define MODELOPT_REFUSED "ModelOpt export and knowledge distillation are not implemented: drop the flag"
#define HCP_REFUSED "hierarchical context parallelism (a2a+p2p) is not built: give --cp-comm-type a2a or all_gather"
#define FSDP_REFUSED "FSDP is not implemented: --use-distributed-optimizer shards the optimizer state over data parallelism"
#define FIM_REFUSED "fill-in-the-middle datasets are not implemented: drop the --fim-* flags"

static const tg_flag tg_flag_table[] = {
    /* model */
    {"--num-layers", G_MODEL, F_INT64, TG_AT(num_layers), IR(1, TG_I32MAX), "required", "transformer layers"},
    {"--hidden-size", G_MODEL, F_INT64, TG_AT(hidden), IR(1, TG_I32MAX), "required", "transformer hidden size"},
    {"--ffn-hidden-size", G_MODEL, F_INT64, TG_AT(ffn), IR(1, TG_I32MAX), "4 x hidden (SwiGLU: 2/3 of it, down to 64)",
     "MLP hidden size"},
    {"--num-attention-heads", G_MODEL, F_INT64, TG_AT(heads), IR(1, TG_I32MAX), "required", "attention heads"},
    {"--group-query-attention", G_MODEL, F_TRUE, TG_AT(gqa), NR, "off", "grouped-query attention (with --num-query-groups)"},
    {"--num-query-groups", G_MODEL, F_INT64, TG_AT(groups), IR(1, TG_I32MAX), "heads", "key/value groups for GQA"},
    {"--kv-channels", G_MODEL, F_INT64, TG_AT(kv), IR(1, TG_I32MAX), "hidden / heads", "channels per attention head"},
    {"--seq-length", G_MODEL, F_INT64, TG_AT(seq), IR(1, TG_I32MAX), "required", "tokens per sample"},
    {"--max-position-embeddings", G_MODEL, F_INT64, TG_AT(maxpos), IR(1, TG_I32MAX), "seq-length",
     "rows of the position embedding (the longest sequence)"},
    {"--make-vocab-size-divisible-by", G_MODEL, F_INT64, TG_AT(divisible), IR(1, TG_I32MAX), "128",
     "pad the vocabulary to a multiple of this (times TP)"},
    {"--normalization", G_MODEL, F_STRING, TG_AT(normalization), CH("LayerNorm|RMSNorm"), "LayerNorm", "norm type"},
    {"--norm-epsilon", G_MODEL, F_DOUBLE, TG_AT(norm_eps), DR(0, INFINITY, D_LO_OPEN), "1e-5", "norm epsilon"},
    {"--layernorm-epsilon", G_MODEL, F_DOUBLE, TG_AT(norm_eps), DR(0, INFINITY, D_LO_OPEN), "1e-5",
     "Megatron's older name of --norm-epsilon"},
    {"--apply-layernorm-1p", G_MODEL, F_TRUE, TG_AT(layernorm_1p), NR, "off",
     "norm weights stored as w - 1: y = (1 + w) * norm(x) (+ b); they start at 0"},
    {"--position-embedding-type", G_MODEL, F_STRING, TG_AT(position_type), CH("learned_absolute|rope|none"),
     "learned_absolute", "learned position embeddings, rotary, or none (NoPE)"},
    {"--no-position-embedding", G_MODEL, F_TRUE, TG_AT(no_position_embedding), NR, "off",
     "no learned position embedding; deprecated in Megatron: only with rope (else --position-embedding-type none)"},
    {"--rotary-base", G_MODEL, F_DOUBLE, TG_AT(rotary_base), DR(0, INFINITY, D_LO_OPEN), "10000", "RoPE base"},
    {"--rotary-percent", G_MODEL, F_DOUBLE, TG_AT(rotary_percent), DR(0, 1, D_LO_OPEN), "1.0",
     "fraction of each head's channels that rotate"},
    {"--use-rope-scaling", G_MODEL, F_TRUE, TG_AT(rope_scaling), NR, "off", "Llama-3.1 RoPE frequency scaling"},
    {"--rope-scaling-factor", G_MODEL, F_DOUBLE, TG_AT(rope_factor), DR(1, INFINITY, 0), "8.0",
     "Llama-3.1 RoPE scaling factor"},
    {"--swiglu", G_MODEL, F_TRUE, TG_AT(swiglu), NR, "off", "SwiGLU MLP instead of GELU"},
    {"--squared-relu", G_MODEL, F_TRUE, TG_AT(cfg.squared_relu), NR, "off",
     "squared ReLU MLP activation, relu(x)^2, instead of GELU (not with --swiglu)"},
    {"--qk-layernorm", G_MODEL, F_TRUE, TG_AT(cfg.qk_layernorm), NR, "off",
     "normalise each query and key head (the model's norm, one weight per kind shared by the heads) before RoPE"},
    {"--untie-embeddings-and-output-weights", G_MODEL, F_TRUE, TG_AT(untie), NR, "off",
     "a separate output layer instead of the word embeddings"},
    {"--disable-bias-linear", G_MODEL, F_TRUE, TG_AT(no_bias), NR, "off", "no biases in the linear layers"},
    {"--use-mcore-models", G_MODEL, F_INFO_SWITCH, 0, NR, "on", "Megatron Core's GPT is the only model here"},
    {"--transformer-impl", G_MODEL, F_INFO_VALUE, 0, CH("local|transformer_engine|inference_optimized"),
     "transformer_engine", "one implementation here: this build's kernels"},
    {"--attention-backend", G_MODEL, F_INFO_VALUE, 0, CH("auto|flash|fused|unfused|local"), "auto",
     "the attention path follows the precision and head size (flash for bf16, exact otherwise)"},
    {"--use-flash-attn", G_MODEL, F_INFO_SWITCH, 0, NR, "off", "flash attention is used wherever it applies"},
    {"--no-masked-softmax-fusion", G_MODEL, F_INFO_SWITCH, 0, NR, "fused", "the softmax is always fused here"},
    {"--no-bias-gelu-fusion", G_MODEL, F_INFO_SWITCH, 0, NR, "fused", "bias + GELU is always fused here"},
    {"--no-bias-swiglu-fusion", G_MODEL, F_INFO_SWITCH, 0, NR, "fused", "SwiGLU is always fused here"},
    {"--no-bias-dropout-fusion", G_MODEL, F_INFO_SWITCH, 0, NR, "fused", "bias + residual is always fused here"},
    {"--no-rope-fusion", G_MODEL, F_INFO_SWITCH, 0, NR, "fused", "RoPE is always fused here"},
    {"--no-persist-layer-norm", G_MODEL, F_INFO_SWITCH, 0, NR, "off", "one LayerNorm kernel family here"},
    {"--attention-softmax-in-fp32", G_MODEL, F_INFO_SWITCH, 0, NR, "off", "the softmax always runs in fp32 here"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--apply-query-key-layer-scaling", G_MODEL, F_INFO_SWITCH, 0, NR, "off",
     "the softmax runs in fp32 here, so this fp16 guard (scores / layer, undone in the softmax) would not change them"},
    {"--rotary-interleaved", G_MODEL, F_REFUSED_SWITCH, 0, NR, "off",
     "interleaved (RoFormer) RoPE is not implemented; RoPE here rotates the two halves of each head (Llama's): drop "
     "the flag"},
    {"--multi-latent-attention", G_MODEL, F_REFUSED_SWITCH, 0, NR, "off", MLA_REFUSED},
    {"--q-lora-rank", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", MLA_REFUSED},
    {"--kv-lora-rank", G_MODEL, F_REFUSED_VALUE, 0, NR, "32", MLA_REFUSED},
    {"--qk-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "128", MLA_REFUSED},
    {"--qk-pos-emb-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "64", MLA_REFUSED},
    {"--v-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "128", MLA_REFUSED},
    {"--experimental-attention-variant", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--linear-attention-freq", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--linear-conv-kernel-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "4", ATTENTION_VARIANT_REFUSED},
    {"--linear-key-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "128", ATTENTION_VARIANT_REFUSED},
    {"--linear-value-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "128", ATTENTION_VARIANT_REFUSED},
    {"--linear-num-key-heads", G_MODEL, F_REFUSED_VALUE, 0, NR, "16", ATTENTION_VARIANT_REFUSED},
    {"--linear-num-value-heads", G_MODEL, F_REFUSED_VALUE, 0, NR, "32", ATTENTION_VARIANT_REFUSED},
    {"--dsa-indexer-n-heads", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--dsa-indexer-head-dim", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--dsa-indexer-topk", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--dsa-indexer-loss-coeff", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", ATTENTION_VARIANT_REFUSED},
    {"--attention-output-gate", G_MODEL, F_REFUSED_SWITCH, 0, NR, "off",
     "a gate on the attention output is not implemented: drop the flag"},
    {"--apply-wd-to-qk-layernorm", G_MODEL, F_REFUSED_SWITCH, 0, NR, "off",
     "norm weights never take weight decay here: drop the flag"},
    {"--use-mup", G_MODEL, F_REFUSED_SWITCH, 0, NR, "off", MUP_REFUSED},
    {"--mup-base-hidden-size", G_MODEL, F_REFUSED_VALUE, 0, NR, "none", MUP_REFUSED},
    /* regularization */
    {"--hidden-dropout", G_REG, F_DOUBLE, TG_AT(hidden_dropout), DR(0, 1, D_HI_OPEN), "0.1 (built-in job: 0)",
     "dropout on the embeddings and after attention and MLP"},
    {"--attention-dropout", G_REG, F_DOUBLE, TG_AT(attention_dropout), DR(0, 1, D_HI_OPEN), "0.1 (built-in job: 0)",
     "dropout on the attention probabilities"},
    {"--weight-decay", G_REG, F_DOUBLE, TG_AT(wd), DR(0, INFINITY, 0), "0.01", "AdamW weight decay"},
    {"--clip-grad", G_REG, F_DOUBLE, TG_AT(clip), DR(0, INFINITY, 0), "1.0", "global gradient-norm clip (0: off)"},
    {"--adam-beta1", G_REG, F_DOUBLE, TG_AT(b1), DR(0, 1, D_HI_OPEN), "0.9", "Adam beta1"},
    {"--adam-beta2", G_REG, F_DOUBLE, TG_AT(b2), DR(0, 1, D_HI_OPEN), "0.999", "Adam beta2"},
    {"--adam-eps", G_REG, F_DOUBLE, TG_AT(eps), DR(0, INFINITY, D_LO_OPEN), "1e-8", "Adam epsilon"},
    /* training */
    {"--micro-batch-size", G_TRAIN, F_INT64, TG_AT(mbs), IR(1, TG_I32MAX), "required", "samples per micro-batch"},
    {"--global-batch-size", G_TRAIN, F_INT64, TG_AT(gbs), IR(1, TG_I32MAX), "micro x data-parallel",
     "samples per iteration (micro-batches accumulate)"},
    {"--rampup-batch-size", G_TRAIN, F_INT64_3, TG_AT(rampup), IR(1, TG_I64MAX), "none",
     "START INCR SAMPLES: the global batch grows from START by INCR over SAMPLES samples (needs --train-samples)"},
    {"--step-batch-size-schedule", G_TRAIN, F_STRING, TG_AT(batch_schedule), NR, "none",
     "\"TOKENS:BATCH ...\": the global batch from each token threshold on (K/M/B/T suffixes; the words up to the "
     "next flag, so an unquoted expansion works too)"},
    {"--train-iters", G_TRAIN, F_INT64, TG_AT(iters), IR(1, TG_I64MAX), "required (or --train-samples)",
     "iterations to train"},
    {"--train-samples", G_TRAIN, F_INT64, TG_AT(train_samples), IR(1, TG_I64MAX), "none",
     "samples to train (the iterations follow from the batch sizes)"},
    {"--exit-interval", G_TRAIN, F_INT64, TG_AT(exit_interval), IR(0, TG_I64MAX), "none",
     "after an iteration divisible by this: save (with --save) and stop, without the final evaluation"},
    {"--skip-train", G_TRAIN, F_TRUE, TG_AT(skip_train), NR, "off",
     "no training: the end-of-run evaluations only, of the loaded (or initial) weights; nothing is saved"},
    {"--exit-duration-in-mins", G_TRAIN, F_INT64, TG_AT(exit_duration_in_mins), IR(0, 1000000000), "none",
     "once the run has lasted this many minutes: save (with --save) and stop, without the final evaluation (0: none)"},
    {"--exit-signal-handler", G_TRAIN, F_TRUE, TG_AT(exit_signal_handler), NR, "off",
     "SIGTERM or SIGINT: finish the step, save (with --save) and exit 0, every rank at the same iteration"},
    {"--no-check-for-nan-in-loss-and-grad", G_TRAIN, F_TRUE, TG_AT(no_check_for_nan), NR, "check",
     "a NaN/Inf loss or gradient norm no longer stops the run (fp16 still skips an overflowing step)"},
    {"--max-consecutive-nan-iterations", G_TRAIN, F_INT64, TG_AT(max_nan_in_a_row), IR(1, 1000000000), "1",
     "(this build's) a step refused for a NaN/Inf loss or gradient norm is skipped (nothing applied, counted "
     "as a nan iteration); this many in a row stop the run (1: the first does, as Megatron's check)"},
    {"--optimizer", G_TRAIN, F_STRING, TG_AT(optimizer), CH("adam|sgd|muon|dist_muon|lion|soap"), "adam",
     "the optimizer (this build has AdamW, Megatron's adam)"},
    {"--calculate-per-token-loss", G_TRAIN, F_TRUE, TG_AT(per_token_loss), NR, "off",
     "the loss gradient over the global batch's counted tokens, not the mean of micro-batch means"},
    {"--cross-entropy-loss-fusion", G_TRAIN, F_INFO_SWITCH, 0, NR, "off", "the cross entropy is always fused here"},
    {"--cross-entropy-fusion-impl", G_TRAIN, F_INFO_VALUE, 0, CH("native|te"), "native",
     "one fused cross entropy here"},
    {"--no-gradient-accumulation-fusion", G_TRAIN, F_INFO_SWITCH, 0, NR, "fused",
     "weight-gradient GEMMs always accumulate into the fp32 buffer here"},
    {"--manual-gc", G_TRAIN, F_INFO_SWITCH, 0, NR, "off", "no Python garbage collector here"},
    {"--manual-gc-interval", G_TRAIN, F_INFO_VALUE, 0, NR, "0", "no Python garbage collector here"},
    {"--empty-unused-memory-level", G_TRAIN, F_INFO_VALUE, 0, CH("0|1|2"), "0",
     "memory is planned once at start; there is no allocator cache to empty"},
    {"--use-cpu-initialization", G_TRAIN, F_INFO_SWITCH, 0, NR, "off",
     "initial weights are a function of the seed only, wherever they are made"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--deterministic-mode", G_TRAIN, F_INFO_SWITCH, 0, NR, "off",
     "runs here are always bitwise deterministic (the same flags and seed give the same bits)"},
    {"--rerun-mode", G_TRAIN, F_INFO_VALUE, 0, CH("disabled|validate_results|report_stats"), "validate_results",
     "no rerun engine here: a NaN/Inf loss or gradient norm is handled by --max-consecutive-nan-iterations, and a "
     "deterministic rerun would repeat the same bits"},
    {"--error-injection-rate", G_TRAIN, F_REFUSED_VALUE, 0, NR, "0",
     "fault injection belongs to Megatron's rerun engine, which is not built here: drop the flag"},
    {"--error-injection-type", G_TRAIN, F_REFUSED_VALUE, 0, NR, "transient_error",
     "fault injection belongs to Megatron's rerun engine, which is not built here: drop the flag"},
    {"--check-weight-hash-across-dp-replicas-interval", G_TRAIN, F_INFO_VALUE, 0, NR, "none",
     "not checked here: every data-parallel replica applies the same reduced gradients with the same update"},
    {"--test-mode", G_TRAIN, F_INFO_SWITCH, 0, NR, "off", "Megatron's in-training self-checks; this build's are its test suite"},
    {"--eval-global-batch-size", G_TRAIN, F_INT64, TG_AT(eval_global_batch_size), IR(1, TG_I32MAX), "global-batch-size",
     "samples per evaluation iteration: only --global-batch-size's here (another size is refused)"},
    {"--tp-comm-overlap", G_TRAIN, F_REFUSED_SWITCH, 0, NR, "off",
     "overlapping tensor-parallel communication with GEMMs is not implemented: drop the flag"},
    {"--tp-comm-overlap-cfg", G_TRAIN, F_REFUSED_VALUE, 0, NR, "none",
     "overlapping tensor-parallel communication with GEMMs is not implemented: drop the flag"},
    {"--optimizer-cpu-offload", G_TRAIN, F_TRUE, TG_AT(cfg.optimizer_cpu_offload), NR, "off",
     "the fp32 master weights and Adam moments of the optimizer shard's end in pinned host memory, updated by a "
     "CPU AdamW (bit for bit the GPU's)"},
    {"--optimizer-offload-fraction", G_TRAIN, F_DOUBLE, TG_AT(cfg.optimizer_offload_fraction), DR(0, 1, 0), "1.0",
     "the part of the optimizer shard --optimizer-cpu-offload puts on the host"},
    {"--recompute-activations", G_TRAIN, F_TRUE, TG_AT(recompute_activations), NR, "off",
     "selective activation recompute (as --recompute-granularity selective)"},
    {"--recompute-granularity", G_TRAIN, F_STRING, TG_AT(recompute_granularity), CH("full|selective"), "none",
     "full: layers keep only their inputs and replay their forward in the backward; selective: the "
     "--recompute-modules are recomputed (bit for bit the forward's either way)"},
    {"--recompute-method", G_TRAIN, F_STRING, TG_AT(recompute_method), CH("uniform|block"), "none",
     "full: uniform keeps the input of every group of --recompute-num-layers layers; block recomputes the first "
     "--recompute-num-layers layers of each model chunk"},
    {"--recompute-num-layers", G_TRAIN, F_INT, TG_AT(recompute_num_layers), IR(1, TG_I32MAX), "none",
     "full: the group size (uniform) or the recomputed layers per model chunk (block), at most the layers per "
     "pipeline rank"},
    {"--recompute-modules", G_TRAIN, F_STRING, 0, CH("core_attn|layernorm|act|mlp|moe_act|moe"), "core_attn",
     "selective: a list of core_attn (the attention probabilities; flash attention keeps none), layernorm (the "
     "second norm's output), act (the MLP activation's output), mlp (fc1 and the activation), moe_act (the "
     "experts' activation output; needs --moe-grouped-gemm), moe (an MoE layer's experts and shared expert, "
     "from its kept routing)"},
    /* initialization */
    {"--seed", G_INIT, F_INT64, TG_AT(seed), IR(0, 4294967295LL), "1234", "seed of the weights and the data order"},
    {"--init-method-std", G_INIT, F_DOUBLE, TG_AT(std), DR(0, INFINITY, 0), "0.02", "std of the normal initialisation"},
    /* learning rate */
    {"--lr", G_LR, F_DOUBLE, TG_AT(lr), DR(0, INFINITY, 0), "required", "peak learning rate"},
    {"--min-lr", G_LR, F_DOUBLE, TG_AT(min_lr), DR(0, INFINITY, 0), "0", "learning rate after the decay"},
    {"--lr-decay-style", G_LR, F_STRING, TG_AT(decay_style), CH("constant|linear|cosine|inverse-square-root|WSD"),
     "linear", "decay shape"},
    {"--lr-warmup-iters", G_LR, F_INT64, TG_AT(warmup), IR(0, TG_I64MAX), "0", "linear warmup iterations"},
    {"--lr-warmup-samples", G_LR, F_INT64, TG_AT(warmup_samples), IR(0, TG_I64MAX), "0",
     "linear warmup samples (with --train-samples)"},
    {"--lr-warmup-fraction", G_LR, F_DOUBLE, TG_AT(warmup_fraction), DR(0, 1, 0), "none",
     "warmup as a fraction of the decay length"},
    {"--lr-warmup-init", G_LR, F_DOUBLE, TG_AT(warmup_init), DR(0, INFINITY, 0), "0", "learning rate at step 0"},
    {"--lr-decay-iters", G_LR, F_INT64, TG_AT(decay_iters), IR(0, TG_I64MAX), "train-iters", "decay length in iterations"},
    {"--lr-decay-samples", G_LR, F_INT64, TG_AT(decay_samples), IR(0, TG_I64MAX), "train-samples",
     "decay length in samples (with --train-samples)"},
    {"--lr-wsd-decay-style", G_LR, F_STRING, TG_AT(wsd_style), CH("exponential|linear|cosine|minus_sqrt"),
     "exponential", "shape of WSD's annealing tail"},
    {"--lr-wsd-decay-iters", G_LR, F_INT64, TG_AT(wsd_iters), IR(0, TG_I64MAX), "none", "WSD's annealing iterations"},
    {"--lr-wsd-decay-samples", G_LR, F_INT64, TG_AT(wsd_samples), IR(0, TG_I64MAX), "none",
     "WSD's annealing samples (with --train-samples)"},
    {"--decoupled-lr", G_LR, F_DOUBLE, TG_AT(decoupled_lr), DR(0, INFINITY, 0), "none",
     "peak learning rate of the word embeddings and the output layer, on the same schedule (else --lr)"},
    {"--decoupled-min-lr", G_LR, F_DOUBLE, TG_AT(decoupled_min_lr), DR(0, INFINITY, 0), "--min-lr",
     "minimum learning rate of the word embeddings and the output layer (with --decoupled-lr)"},
    /* checkpointing */
    {"--save", G_CKPT, F_STRING, TG_AT(save), NR, "none", "directory to save checkpoints to"},
    {"--save-interval", G_CKPT, F_INT64, TG_AT(save_interval), IR(0, TG_I64MAX), "none (at the end only)",
     "iterations between checkpoints"},
    {"--load", G_CKPT, F_STRING, TG_AT(load), NR, "none",
     "directory to resume from (its latest checkpoint, saved at any TP / PP / VP / DP layout)"},
    {"--async-save", G_CKPT, F_TRUE, TG_AT(async_save), NR, "off",
     "the step loop waits only for the device-to-host copy; files are written in the background and committed "
     "once every rank's are complete"},
    {"--no-load-optim", G_CKPT, F_TRUE, TG_AT(no_load_optim), NR, "off",
     "load the weights only: Adam state, learning-rate schedule and loss scale start afresh"},
    {"--no-load-rng", G_CKPT, F_TRUE, TG_AT(no_load_rng), NR, "off",
     "checkpoints here hold no RNG state (random streams follow --seed): accepted, changes nothing"},
    {"--finetune", G_CKPT, F_TRUE, TG_AT(finetune), NR, "off",
     "load the weights only and start at iteration 0 with 0 samples consumed"},
    {"--no-verify-checkpoint", G_CKPT, F_TRUE, TG_AT(no_verify_checkpoint), NR, "off",
     "--load reads a checkpoint whose manifest check fails (or that lacks the manifest it was saved with) "
     "with a warning instead of refusing it (not a Megatron flag)"},
    {"--save-retain-interval", G_CKPT, F_INT64, TG_AT(save_retain_interval), IR(1, TG_I64MAX), "none (keep all)",
     "after each save, the previously tracked checkpoint is deleted unless its iteration is a multiple of this (a "
     "multiple of --save-interval); the newest is always kept"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--use-checkpoint-opt_param-scheduler", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "a checkpoint here holds the scheduler's step count only: the schedule's values always come from the flags"},
    {"--use-checkpoint-opt-param-scheduler", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "a checkpoint here holds the scheduler's step count only: the schedule's values always come from the flags"},
    {"--override-opt_param-scheduler", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "the schedule's values always come from the flags here (a checkpoint holds its step count only)"},
    {"--override-opt-param-scheduler", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "the schedule's values always come from the flags here (a checkpoint holds its step count only)"},
    {"--dist-ckpt-strictness", G_CKPT, F_INFO_VALUE, 0,
     CH("assume_ok_unexpected|log_unexpected|log_all|raise_unexpected|raise_all|return_unexpected|return_all|ignore_all"),
     "assume_ok_unexpected", "a checkpoint here is loaded whole or refused with one line: it has no keys to be missing "
     "or unexpected"},
    {"--dist-ckpt-optim-fully-reshardable", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "every checkpoint here loads at any TP / PP / VP / DP layout, the optimizer state included"},
    {"--ckpt-fully-parallel-save", G_CKPT, F_INFO_SWITCH, 0, NR, "on", "every rank writes its own files here"},
    {"--no-ckpt-fully-parallel-save", G_CKPT, F_INFO_SWITCH, 0, NR, "on", "every rank writes its own files here"},
    {"--ckpt-fully-parallel-load", G_CKPT, F_INFO_SWITCH, 0, NR, "off", "every rank reads its own part here"},
    {"--ckpt-assume-constant-structure", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "a checkpoint's structure here follows from the model: nothing to cache between saves"},
    {"--auto-detect-ckpt-format", G_CKPT, F_INFO_SWITCH, 0, NR, "off", "there is one checkpoint format here"},
    {"--verify-integrity", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "every checkpoint here gets a manifest of its files' checksums at save, checked at load"},
    {"--use-persistent-ckpt-worker", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "--async-save writes from a thread of the training process here"},
    {"--async-strategy", G_CKPT, F_INFO_VALUE, 0, CH("nvrx|mcore"), "nvrx",
     "--async-save has one strategy here: a writer thread per rank, committed by rank 0"},
    {"--async-ckpt-use-cpu-shm", G_CKPT, F_INFO_SWITCH, 0, NR, "off",
     "--async-save stages in pinned host memory of the training process; there is no worker process"},
    {"--export-te-mcore-model", G_CKPT, F_REFUSED_SWITCH, 0, NR, "off", MODELOPT_REFUSED},
    {"--export-kd-teacher-load", G_CKPT, F_REFUSED_VALUE, 0, NR, "none", MODELOPT_REFUSED},
    {"--export-kd-cfg", G_CKPT, F_REFUSED_VALUE, 0, NR, "none", MODELOPT_REFUSED},
    {"--ckpt-format", G_CKPT, F_INFO_VALUE, 0, CH("torch|torch_dist|torch_dcp|fsdp_dtensor"), "torch_dist",
     "checkpoints are this build's binary files in Megatron's directory layout"},
    /* mixed precision */
    {"--bf16", G_MIXED, F_TRUE, TG_AT(bf16), NR, "fp32", "bf16 weights and activations, fp32 master"},
    {"--fp16", G_MIXED, F_TRUE, TG_AT(fp16), NR, "fp32", "fp16 with a dynamic loss scale"},
    {"--loss-scale", G_MIXED, F_DOUBLE, TG_AT(loss_scale), DR(0, INFINITY, 0), "dynamic", "a constant loss scale"},
    {"--initial-loss-scale", G_MIXED, F_DOUBLE, TG_AT(initial_loss_scale), DR(0, INFINITY, D_LO_OPEN), "2^32",
     "the dynamic scale's start"},
    {"--min-loss-scale", G_MIXED, F_DOUBLE, TG_AT(min_loss_scale), DR(0, INFINITY, D_LO_OPEN), "1",
     "the dynamic scale's floor"},
    {"--loss-scale-window", G_MIXED, F_INT64, TG_AT(window), IR(1, TG_I32MAX), "1000", "steps between scale raises"},
    {"--hysteresis", G_MIXED, F_INT64, TG_AT(hysteresis), IR(1, TG_I32MAX), "2", "overflows tolerated before a cut"},
    {"--fp8-format", G_MIXED, F_STRING, TG_AT(fp8_format), CH("e4m3|hybrid"), "none", "FP8 linears (bf16 model)"},
    {"--fp8-recipe", G_MIXED, F_STRING, TG_AT(fp8_recipe), CH("delayed|tensorwise|blockwise"), "delayed",
     "FP8 scaling recipe"},
    {"--fp8-margin", G_MIXED, F_INT, TG_AT(fp8_margin), IR(0, 30), "0", "scale = fp8_max / amax / 2^margin"},
    {"--fp8-amax-history-len", G_MIXED, F_INT, TG_AT(fp8_history), IR(1, 65536), "1", "delayed scaling's history"},
    {"--fp8-amax-compute-algo", G_MIXED, F_STRING, TG_AT(fp8_algo), CH("max|most_recent"), "most_recent",
     "amax from the history's max or its newest entry"},
    {"--no-fp8-wgrad", G_MIXED, F_TRUE, TG_AT(no_fp8_wgrad), NR, "off", "weight gradients in bf16"},
    {"--first-last-layers-bf16", G_MIXED, F_TRUE, TG_AT(first_last_bf16), NR, "off", "keep the outer layers bf16"},
    {"--num-layers-at-start-in-bf16", G_MIXED, F_INT, TG_AT(bf16_start), IR(0, TG_I32MAX), "1", "bf16 layers at the start"},
    {"--num-layers-at-end-in-bf16", G_MIXED, F_INT, TG_AT(bf16_end), IR(0, TG_I32MAX), "1", "bf16 layers at the end"},
    {"--fp8-param-gather", G_MIXED, F_TRUE, TG_AT(fp8_param_gather), NR, "off", "all-gather parameters in FP8"},
    {"--grad-reduce-in-bf16", G_MIXED, F_TRUE, TG_AT(grad_reduce_bf16), NR, "off",
     "reduce the gradients over data parallelism in bf16 (half the bytes); they still accumulate in fp32 here, so "
     "Megatron's memory saving is not taken (--plan says how much it would be)"},
    /* distributed */
    {"--tensor-model-parallel-size", G_DIST, F_INT64, TG_AT(tp), IR(1, TG_I32MAX), "1", "tensor-parallel GPUs"},
    {"--sequence-parallel", G_DIST, F_TRUE, TG_AT(sequence_parallel), NR, "off", "sequence parallelism (TP > 1)"},
    {"--pipeline-model-parallel-size", G_DIST, F_INT64, TG_AT(pp), IR(1, TG_I32MAX), "1",
     "pipeline stages (the layers split over them; 1F1B schedule)"},
    /* the pipeline's layout flags land in cfg directly (its defaults mean "not given") */
    {"--num-layers-per-virtual-pipeline-stage", G_DIST, F_INT, TG_AT(cfg.num_layers_per_virtual_pipeline_stage),
     IR(1, TG_I32MAX), "none", "layers per virtual stage: L / (PP x this) virtual stages per rank (interleaved 1F1B)"},
    {"--num-virtual-stages-per-pipeline-rank", G_DIST, F_INT, TG_AT(cfg.virtual_pipeline_size),
     IR(1, MT_PP_MAX_CHUNKS), "1", "model chunks per pipeline rank (> 1: the interleaved schedule)"},
    {"--microbatch-group-size-per-virtual-pipeline-stage", G_DIST, F_INT, TG_AT(cfg.microbatch_group_size_per_vp_stage),
     IR(1, TG_I32MAX), "pipeline-model-parallel-size", "micro-batches run per virtual stage before the next"},
    {"--decoder-first-pipeline-num-layers", G_DIST, F_INT, TG_AT(cfg.decoder_first_pipeline_num_layers),
     IR(0, TG_I32MAX), "none (even split)", "layers of the first pipeline stage (the rest split evenly)"},
    {"--decoder-last-pipeline-num-layers", G_DIST, F_INT, TG_AT(cfg.decoder_last_pipeline_num_layers),
     IR(0, TG_I32MAX), "none (even split)", "layers of the last pipeline stage (the rest split evenly)"},
    {"--account-for-embedding-in-pipeline-split", G_DIST, F_TRUE, TG_AT(cfg.account_for_embedding_in_pipeline_split),
     NR, "off", "the embedding counts as a layer of the first stage in the split"},
    {"--account-for-loss-in-pipeline-split", G_DIST, F_TRUE, TG_AT(cfg.account_for_loss_in_pipeline_split), NR, "off",
     "the output layer and loss count as a layer of the last stage in the split"},
    {"--context-parallel-size", G_DIST, F_INT64, TG_AT(cp), IR(1, TG_I32MAX), "1",
     "each sequence cut into 2 x this many chunks over as many ranks (rank r keeps chunks r and 2 CP - 1 - r)"},
    {"--expert-model-parallel-size", G_DIST, F_INT64, TG_AT(ep), IR(1, TG_I32MAX), "1",
     "experts split over this many ranks (expert parallelism: not built yet, 1 only)"},
    {"--use-distributed-optimizer", G_DIST, F_TRUE, TG_AT(distributed_optimizer), NR, "off",
     "shard master weights and Adam state over data parallelism"},
    {"--overlap-grad-reduce", G_DIST, F_TRUE, TG_AT(overlap_grad_reduce), NR, "off",
     "reduce gradient buckets during the backward"},
    {"--overlap-param-gather", G_DIST, F_TRUE, TG_AT(overlap_param_gather), NR, "off",
     "all-gather parameters behind the next forward"},
    {"--ddp-bucket-size", G_DIST, F_INT64, TG_AT(ddp_bucket_size), IR(0, TG_I64MAX), "max(40M, 1M x dp)",
     "gradient bucket size in elements"},
    {"--distributed-backend", G_DIST, F_STRING, TG_AT(distributed_backend), CH("nccl|gloo"), "nccl",
     "collectives backend (NCCL only here)"},
    {"--distributed-timeout-minutes", G_DIST, F_DOUBLE, TG_AT(cfg.distributed_timeout_minutes),
     DR(0, 1e6, D_LO_OPEN), "10", "a collective or pipeline transfer stuck this long ends the job with one line"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--num-distributed-optimizer-instances", G_DIST, F_INT64, TG_AT(dist_opt_instances), IR(1, TG_I32MAX), "1",
     "distributed-optimizer copies across data parallelism: only 1 here (partial sharding is not implemented)"},
    {"--ddp-average-in-collective", G_DIST, F_INFO_SWITCH, 0, NR, "off",
     "gradients are scaled by 1/DP before they are summed here (Megatron's default); averaging inside the collective "
     "differs only in rounding"},
    {"--overlap-param-gather-with-optimizer-step", G_DIST, F_INFO_SWITCH, 0, NR, "off",
     "the parameter all-gather overlaps the next forward here (--overlap-param-gather), not the optimizer step"},
    {"--use-tp-pp-dp-mapping", G_DIST, F_INFO_SWITCH, 0, NR, "off",
     "ranks are ordered TP, DP, PP here (Megatron's default): the order places the groups on GPUs, the numbers are "
     "the same"},
    {"--overlap-p2p-communication-warmup-flush", G_DIST, F_INFO_SWITCH, 0, NR, "off",
     "the pipeline's sends and receives are scheduled one way here"},
    {"--defer-embedding-wgrad-compute", G_DIST, F_INFO_SWITCH, 0, NR, "off",
     "the embedding's weight gradient is computed in the backward here, not deferred to the pipeline flush"},
    {"--wgrad-deferral-limit", G_DIST, F_INFO_VALUE, 0, NR, "0",
     "the embedding's weight gradient is computed in the backward here, not deferred to the pipeline flush"},
    {"--disable-gloo-process-groups", G_DIST, F_INFO_SWITCH, 0, NR, "off", "there are no gloo process groups here (NCCL only)"},
    {"--cp-comm-type", G_DIST, F_STRING, TG_AT(cp_comm_type), CH("p2p|a2a|all_gather|a2a+p2p"), "p2p",
     "context parallelism's exchange in attention: p2p (K/V ring), a2a (all-to-all over heads), all_gather"},
    {"--hierarchical-context-parallel-sizes", G_DIST, F_REFUSED_VALUE, 0, NR, "none", HCP_REFUSED},
    {"--use-torch-fsdp2", G_DIST, F_REFUSED_SWITCH, 0, NR, "off", FSDP_REFUSED},
    {"--use-megatron-fsdp", G_DIST, F_REFUSED_SWITCH, 0, NR, "off", FSDP_REFUSED},
    {"--data-parallel-sharding-strategy", G_DIST, F_REFUSED_VALUE, 0, NR, "no_shard", FSDP_REFUSED},
    {"--megatron-fsdp-main-params-dtype", G_DIST, F_REFUSED_VALUE, 0, NR, "fp32", FSDP_REFUSED},
    {"--megatron-fsdp-main-grads-dtype", G_DIST, F_REFUSED_VALUE, 0, NR, "auto", FSDP_REFUSED},
    {"--megatron-fsdp-grad-comm-dtype", G_DIST, F_REFUSED_VALUE, 0, NR, "auto", FSDP_REFUSED},
    /* validation */
    {"--eval-interval", G_VALID, F_INT64, TG_AT(eval_interval), IR(0, TG_I64MAX), "1000",
     "iterations between validations (0: none during training)"},
    {"--eval-iters", G_VALID, F_INT64, TG_AT(eval_iters), IR(0, TG_I64MAX), "100", "global batches per evaluation"},
    {"--full-validation", G_VALID, F_TRUE, TG_AT(full_validation), NR, "off",
     "each validation covers the whole validation split once (needs a dataset, not --mock-data)"},
    /* data */
    {"--data-path", G_DATA, F_STRING, 0, NR, "none (the built-in job)",
     "[W1] PREFIX1 [W2 PREFIX2 ...]: Megatron .bin/.idx datasets, optionally weighted"},
    {"--split", G_DATA, F_STRING, TG_AT(split), NR, "969, 30, 1", "train, valid, test proportions"},
    {"--mock-data", G_DATA, F_TRUE, TG_AT(mock_data), NR, "off", "random tokens instead of files"},
    {"--data-cache-path", G_DATA, F_STRING, TG_AT(data_cache_path), NR, "none",
     "where the dataset index arrays (.npy, Megatron's cache files) are written"},
    {"--eod-mask-loss", G_DATA, F_TRUE, TG_AT(eod_mask_loss), NR, "off",
     "positions whose input is the end-of-document token do not count in the loss"},
    {"--mid-level-dataset-surplus", G_DATA, F_DOUBLE, TG_AT(mid_level_surplus), DR(0, INFINITY, 0), "0.005",
     "extra samples each blended dataset builds (0.005 only here)"},
    {"--reset-position-ids", G_DATA, F_TRUE, TG_AT(reset_position_ids), NR, "off",
     "positions restart at 0 after each end-of-document token (the eod belongs to the document it ends)"},
    {"--reset-attention-mask", G_DATA, F_TRUE, TG_AT(reset_attention_mask), NR, "off",
     "a position attends only to earlier positions of its own document (eod-separated)"},
    {"--no-create-attention-mask-in-dataloader", G_DATA, F_INFO_SWITCH, 0, NR, "off",
     "no attention mask is ever materialised here (causal inside the kernels)"},
    {"--no-mmap-bin-files", G_DATA, F_INFO_SWITCH, 0, NR, "off", "datasets are always memory-mapped here"},
    {"--num-workers", G_DATA, F_INFO_VALUE, 0, NR, "2", "samples are read in the training process (no workers)"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--fim-data", G_DATA, F_REFUSED_SWITCH, 0, NR, "off", FIM_REFUSED},
    {"--fim-rate", G_DATA, F_REFUSED_VALUE, 0, NR, "0.5", FIM_REFUSED},
    {"--fim-spm-rate", G_DATA, F_REFUSED_VALUE, 0, NR, "0.5", FIM_REFUSED},
    /* tokenizer */
    {"--tokenizer-type", G_TOK, F_STRING, TG_AT(tokenizer_type), NR, "GPT2BPETokenizer",
     "GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer; this build's TiktokenFileTokenizer, "
     "Llama3Tokenizer (prepro/tokenizer.h)"},
    {"--vocab-file", G_TOK, F_STRING, TG_AT(vocab_file), NR, "none", "GPT-2 vocab.json"},
    {"--merge-file", G_TOK, F_STRING, TG_AT(merge_file), NR, "none", "GPT-2 merges.txt"},
    {"--tokenizer-model", G_TOK, F_STRING, TG_AT(tokenizer_model), NR, "none",
     "a tokenizer.json or its directory (HuggingFaceTokenizer), Megatron's JSON vocabulary (TikTokenizer), "
     "a tiktoken rank file (TiktokenFileTokenizer, Llama3Tokenizer)"},
    {"--tiktoken-pattern", G_TOK, F_STRING, TG_AT(tiktoken_pattern), CH("v1|v2"), "v2",
     "TikTokenizer's split pattern (no effect on other tokenizers)"},
    {"--tiktoken-num-special-tokens", G_TOK, F_INT64, TG_AT(tiktoken_num_special_tokens), IR(1, TG_I32MAX), "1000",
     "TikTokenizer: ids below this are special tokens"},
    {"--tokenizer-special-tokens", G_TOK, F_STRING, 0, NR, "<unk> <s> </s> <mask> <pad> <cls> <sep>",
     "TikTokenizer's special tokens (a list)"},
    {"--tokenizer-hf-no-include-special-tokens", G_TOK, F_TRUE, TG_AT(hf_no_include_special_tokens), NR, "off",
     "HuggingFaceTokenizer: text to ids without the template's BOS/EOS"},
    {"--tiktoken-encoding", G_TOK, F_STRING, TG_AT(tiktoken_encoding), CH("r50k_base|gpt2|cl100k_base|o200k_base|llama3"),
     "from the file name", "TiktokenFileTokenizer's encoding (this build's flag)"},
    {"--vocab-size", G_TOK, F_INT64, TG_AT(null_vocab_size), IR(1, TG_I64MAX), "none",
     "NullTokenizer's vocabulary; TikTokenizer's, specials included (131072 when not given)"},
    /* logging */
    {"--log-interval", G_LOG, F_INT64, TG_AT(log_interval), IR(1, TG_I64MAX), "100", "iterations between log lines"},
    {"--log-throughput", G_LOG, F_TRUE, TG_AT(log_throughput), NR, "off",
     "add the throughput per GPU (TFLOP/s/GPU) to the log line"},
    {"--log-params-norm", G_LOG, F_TRUE, TG_AT(cfg.log_params_norm), NR, "off",
     "the L2 norm of the fp32 master weights after each step: log line and TensorBoard params-norm"},
    {"--log-num-zeros-in-grad", G_LOG, F_TRUE, TG_AT(cfg.log_num_zeros_in_grad), NR, "off",
     "the gradient elements that are exactly zero each step: log line and TensorBoard num-zeros"},
    {"--tensorboard-dir", G_LOG, F_STRING, TG_AT(tensorboard_dir), NR, "none",
     "write TensorBoard event files there (rank 0; Megatron's scalars and the command line's arguments)"},
    {"--tensorboard-log-interval", G_LOG, F_INT64, TG_AT(tensorboard_log_interval), IR(1, TG_I64MAX), "1",
     "iterations between TensorBoard scalars"},
    {"--tensorboard-queue-size", G_LOG, F_INT, TG_AT(tensorboard_queue_size), IR(1, TG_I32MAX), "1000",
     "TensorBoard events held before a flush (they are also flushed at every log line)"},
    {"--log-timers-to-tensorboard", G_LOG, F_TRUE, TG_AT(log_timers_to_tensorboard), NR, "off",
     "iteration-time and throughput to TensorBoard at each log line"},
    {"--log-memory-to-tensorboard", G_LOG, F_TRUE, TG_AT(log_memory_to_tensorboard), NR, "off",
     "device memory in use and the planned bytes to TensorBoard"},
    {"--log-validation-ppl-to-tensorboard", G_LOG, F_TRUE, TG_AT(log_validation_ppl_to_tensorboard), NR, "off",
     "each evaluation's perplexity to TensorBoard next to its loss"},
    {"--log-world-size-to-tensorboard", G_LOG, F_TRUE, TG_AT(log_world_size_to_tensorboard), NR, "off",
     "the world size to TensorBoard"},
    {"--no-log-loss-scale-to-tensorboard", G_LOG, F_TRUE, TG_AT(no_log_loss_scale_to_tensorboard), NR, "off",
     "leave the loss scale out of TensorBoard"},
    {"--wandb-project", G_LOG, F_STRING, TG_AT(wandb_project), NR, "none",
     "nothing is sent to wandb here: a startup line names `wandb sync --sync-tensorboard DIR` for the events"},
    {"--wandb-exp-name", G_LOG, F_STRING, TG_AT(wandb_exp_name), NR, "none",
     "nothing is sent to wandb here: a startup line names `wandb sync --sync-tensorboard DIR` for the events"},
    {"--wandb-save-dir", G_LOG, F_STRING, TG_AT(wandb_save_dir), NR, "none",
     "nothing is sent to wandb here: a startup line names `wandb sync --sync-tensorboard DIR` for the events"},
    /* Megatron's functional-test flags (dev/data/megatron_scripts/functional_test_flags.txt) */
    {"--wandb-entity", G_LOG, F_STRING, TG_AT(wandb_entity), NR, "none",
     "nothing is sent to wandb here: the startup line's `wandb sync` command names it"},
    {"--timing-log-level", G_LOG, F_INFO_VALUE, 0, CH("0|1|2"), "0",
     "one timer here: the log line's time per iteration (level 0's); no per-operation timers"},
    /* profiling */
    {"--profile", G_PROF, F_TRUE, TG_AT(profile), NR, "off",
     "cudaProfilerStart/Stop around the steps below on rank 0 (run under nsys --capture-range=cudaProfilerApi)"},
    {"--profile-step-start", G_PROF, F_INT64, TG_AT(profile_step_start), IR(0, TG_I64MAX), "10",
     "the iteration profiling starts at"},
    {"--profile-step-end", G_PROF, F_INT64, TG_AT(profile_step_end), IR(0, TG_I64MAX), "12",
     "the iteration profiling stops at"},
    {"--use-pytorch-profiler", G_PROF, F_REFUSED_SWITCH, 0, NR, "off",
     "there is no PyTorch here: use --profile under nsys"},
    /* moe (Megatron-Core's mixture of experts; dev/moe_semantics.md) */
    {"--num-experts", G_MOE, F_INT, TG_AT(cfg.num_experts), IR(0, TG_I32MAX), "none",
     "experts of each MoE layer's MLP (0 or none: a dense model)"},
    {"--moe-layer-freq", G_MOE, F_STRING, TG_AT(moe_layer_freq), NR, "1",
     "N: layer l is MoE when l % N == 0; or a Python list of 0/1 per layer, e.g. \"([0]*3+[1]*29)\""},
    {"--moe-ffn-hidden-size", G_MOE, F_INT, TG_AT(cfg.moe_ffn_hidden_size), IR(1, TG_I32MAX), "ffn-hidden-size",
     "each expert's MLP width"},
    {"--moe-router-topk", G_MOE, F_INT, TG_AT(cfg.moe_router_topk), IR(1, TG_I32MAX), "2", "experts per token"},
    {"--moe-router-score-function", G_MOE, F_STRING, TG_AT(moe_score_function), CH("softmax|sigmoid|sqrtsoftplus"),
     "softmax", "the router's scores (sqrtsoftplus is not built)"},
    {"--moe-router-pre-softmax", G_MOE, F_TRUE, TG_AT(cfg.moe_router_pre_softmax), NR, "off",
     "softmax over all experts before the top-k (not renormalised over the k)"},
    {"--moe-router-topk-scaling-factor", G_MOE, F_DOUBLE, TG_AT(cfg.moe_router_topk_scaling_factor),
     DR(0, INFINITY, D_LO_OPEN), "none", "multiplies the routing probabilities"},
    {"--moe-router-num-groups", G_MOE, F_INT, TG_AT(cfg.moe_router_num_groups), IR(1, TG_I32MAX), "none",
     "expert groups of group-limited routing (DeepSeek's)"},
    {"--moe-router-group-topk", G_MOE, F_INT, TG_AT(cfg.moe_router_group_topk), IR(1, TG_I32MAX), "none",
     "groups each token may route to (group-limited routing)"},
    {"--moe-router-load-balancing-type", G_MOE, F_STRING, 0, CH(TG_MOE_LB_TYPES), "aux_loss",
     "one or more auxiliary losses (a list; sinkhorn and quantile_balancing are not built)"},
    {"--moe-aux-loss-coeff", G_MOE, F_DOUBLE, 0, DR(0, INFINITY, 0), "0",
     "one coefficient per load-balancing type (a list); 0 turns that loss off"},
    {"--moe-z-loss-coeff", G_MOE, F_DOUBLE, TG_AT(cfg.moe_z_loss_coeff), DR(0, INFINITY, 0), "none",
     "coefficient of the router's z-loss"},
    {"--moe-router-enable-expert-bias", G_MOE, F_TRUE, TG_AT(cfg.moe_router_enable_expert_bias), NR, "off",
     "aux-loss-free balancing: a per-expert bias moves the selection (sigmoid scores)"},
    {"--moe-router-bias-update-rate", G_MOE, F_DOUBLE, TG_AT(cfg.moe_router_bias_update_rate), DR(0, INFINITY, 0),
     "1e-3", "the expert bias's step after each iteration"},
    {"--moe-router-dtype", G_MOE, F_STRING, TG_AT(moe_router_dtype), CH("fp32|fp64"), "none",
     "the router's logits in fp32 (default: the activations' type; fp64 is not built)"},
    {"--moe-expert-capacity-factor", G_MOE, F_DOUBLE, TG_AT(cfg.moe_expert_capacity_factor), DR(0, INFINITY, D_LO_OPEN),
     "none (dropless)", "tokens an expert takes: ceil(tokens x topk / experts x factor); the rest are dropped"},
    {"--moe-token-drop-policy", G_MOE, F_STRING, TG_AT(moe_drop_policy), CH("probs|position"), "probs",
     "which tokens an expert over capacity keeps: the most probable, or the first"},
    {"--moe-pad-expert-input-to-capacity", G_MOE, F_TRUE, TG_AT(cfg.moe_pad_expert_input_to_capacity), NR, "off",
     "every expert gets exactly its capacity of rows (with --moe-expert-capacity-factor)"},
    {"--moe-shared-expert-intermediate-size", G_MOE, F_INT, TG_AT(cfg.moe_shared_expert_intermediate_size),
     IR(1, TG_I32MAX), "none", "width of the shared expert every token goes through"},
    {"--moe-shared-expert-gate", G_MOE, F_TRUE, TG_AT(cfg.moe_shared_expert_gate), NR, "off",
     "a per-token sigmoid gate on the shared expert's output"},
    {"--moe-shared-expert-overlap", G_MOE, F_TRUE, TG_AT(moe_shared_overlap), NR, "off",
     "the shared expert beside the dispatch (same values; with the alltoall dispatcher, as Megatron)"},
    {"--moe-grouped-gemm", G_MOE, F_TRUE, TG_AT(cfg.moe_grouped_gemm), NR, "off",
     "one grouped GEMM for the experts (the same math; this build's experts always run grouped)"},
    {"--moe-token-dispatcher-type", G_MOE, F_STRING, TG_AT(moe_dispatcher), CH("allgather|alltoall|flex"), "allgather",
     "how tokens reach the experts' ranks (the same values; flex is not built)"},
    {"--expert-tensor-parallel-size", G_MOE, F_INT, TG_AT(cfg.expert_tensor_parallel_size), IR(1, TG_I32MAX),
     "tensor-model-parallel-size", "each expert split over this many ranks (not built yet: 1 only)"},
    {"--moe-per-layer-logging", G_MOE, F_TRUE, TG_AT(cfg.moe_per_layer_logging), NR, "off",
     "the auxiliary losses of every layer to TensorBoard"},
    {"--moe-permute-fusion", G_MOE, F_INFO_SWITCH, 0, NR, "off", "the permutation is always one fused kernel here"},
    {"--moe-router-fusion", G_MOE, F_INFO_SWITCH, 0, NR, "off", "the router's top-k and scores are always fused here"},
    {"--moe-router-padding-for-quantization", G_MOE, F_REFUSED_SWITCH, 0, NR, "off", "padding the routing map " MOE_NOT_BUILT},
    {"--moe-router-padding-for-fp8", G_MOE, F_REFUSED_SWITCH, 0, NR, "off", "padding the routing map " MOE_NOT_BUILT},
    {"--moe-apply-probs-on-input", G_MOE, F_REFUSED_SWITCH, 0, NR, "off",
     "the probabilities on the experts' input " MOE_NOT_BUILT},
    {"--moe-input-jitter-eps", G_MOE, F_REFUSED_VALUE, 0, NR, "none", "input jitter " MOE_NOT_BUILT},
    {"--moe-router-force-load-balancing", G_MOE, F_REFUSED_SWITCH, 0, NR, "off", "forced balanced routing " MOE_NOT_BUILT},
    {"--moe-latent-size", G_MOE, F_REFUSED_VALUE, 0, NR, "none", "latent expert projections " MOE_NOT_BUILT},
    {"--moe-use-upcycling", G_MOE, F_REFUSED_SWITCH, 0, NR, "off", "upcycling a dense checkpoint " MOE_NOT_BUILT},
    {"--moe-layer-recompute", G_MOE, F_TRUE, TG_AT(moe_layer_recompute), NR, "off",
     "recompute the MoE layers' experts (deprecated in Megatron: --recompute-granularity selective "
     "--recompute-modules moe, which it sets)"},
    /* this build */
    {"--sample-tokens", G_HERE, F_INT, TG_AT(sample_tokens), IR(0, TG_I32MAX), "0 (built-in job: 128)",
     "tokens of text sampled at the end"},
    {"--peak-tflops", G_HERE, F_DOUBLE, TG_AT(peak_tflops), DR(0, INFINITY, 0), "the device's",
     "peak TFLOP/s for the MFU field"},
    {"--plan", G_HERE, F_TRUE, TG_AT(plan), NR, "off",
     "print the memory plan per GPU of this layout and whether it fits (no GPU, no data; exit 1 if not)"},
    {"--plan-layouts", G_HERE, F_TRUE, TG_AT(plan_layouts), NR, "off",
     "the TP x PP x VP layouts of --world-size GPUs that fit, fastest first by DESIGN.md's cost model"},
    {"--world-size", G_HERE, F_INT64, TG_AT(plan_world_size), IR(1, 1 << 20), "1",
     "the GPUs --plan and --plan-layouts plan for"},
    {"--gpu-memory-gib", G_HERE, F_DOUBLE, TG_AT(gpu_memory_gib), DR(0, 1e6, D_LO_OPEN), "80",
     "the memory per GPU --plan and --plan-layouts must fit in"},
};
#define TG_NUM_FLAGS (sizeof(tg_flag_table) / sizeof(tg_flag_table[0]))

static const tg_flag* tg_flag_find(const char* name) {
    for (size_t k = 0; k < TG_NUM_FLAGS; k++)
        if (!strcmp(tg_flag_table[k].name, name)) return &tg_flag_table[k];
    return NULL;
}

static int tg_fail(char* msg, size_t size, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static int tg_fail(char* msg, size_t size, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, size, fmt, ap);
    va_end(ap);
    return -1;
}

/* 1: parsed; 0: not an integer; -1: an integer outside int64 */
static int tg_parse_int64(const char* s, int64_t* out) {
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
static int tg_parse_double(const char* s, double* out) {
    char* end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end) return 0;
    if (!isfinite(v) || (errno == ERANGE && fabs(v) > 1.0)) return -1;
    *out = v; /* an underflow (1e-400) reads as 0 or a denormal, as Python's float() does */
    return 1;
}
static int tg_choice_ok(const char* choices, const char* v) {
    size_t n = strlen(v);
    for (const char* p = choices; *p;) {
        const char* bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return 1;
        p += len + (bar ? 1 : 0);
    }
    return 0;
}

/* One value into its target, range-checked; 0 or -1 with the message. */
static int tg_store(tg_flags* v, const tg_flag* f, const char* name, const char* val, int slot, char* msg,
                    size_t size) {
    char* base = (char*)v + f->target;
    if (f->kind == F_INT || f->kind == F_INT64 || f->kind == F_INT64_3) {
        int64_t x;
        int r = tg_parse_int64(val, &x);
        if (r == 0) return tg_fail(msg, size, "%s %s: not an integer", name, val);
        if (r < 0 || x < f->imin || x > f->imax)
            return tg_fail(msg, size, "%s %s: must be between %lld and %lld", name, val, (long long)f->imin,
                           (long long)f->imax);
        if (f->kind == F_INT) *(int*)base = (int)x;
        else ((int64_t*)base)[slot] = x;
    } else if (f->kind == F_DOUBLE) {
        double x;
        int r = tg_parse_double(val, &x);
        if (r == 0) return tg_fail(msg, size, "%s %s: not a number", name, val);
        if (r < 0) return tg_fail(msg, size, "%s %s: must be a finite number", name, val);
        if (x < f->dmin || x > f->dmax || ((f->dopen & D_LO_OPEN) && x == f->dmin) ||
            ((f->dopen & D_HI_OPEN) && x == f->dmax)) {
            if (isinf(f->dmax))
                return tg_fail(msg, size, "%s %s: must be %s %g", name, val, (f->dopen & D_LO_OPEN) ? ">" : ">=", f->dmin);
            return tg_fail(msg, size, "%s %s: must be in %c%g, %g%c", name, val, (f->dopen & D_LO_OPEN) ? '(' : '[',
                           f->dmin, f->dmax, (f->dopen & D_HI_OPEN) ? ')' : ']');
        }
        *(double*)base = x;
    } else if (f->kind == F_STRING) {
        if (f->choices && !tg_choice_ok(f->choices, val))
            return tg_fail(msg, size, "%s %s: expected one of %s", name, val, f->choices);
        *(const char**)base = val;
    }
    return 0;
}

static int tg_lookup(const char* name, const char* const* names, int n) {
    for (int k = 0; k < n; k++) if (!strcmp(name, names[k])) return k;
    return -1;
}

static void tg_note_info(tg_flags* v, const char* name, const char* val) {
    if (v->num_info >= TG_MAX_INFO) return;
    snprintf(v->info[v->num_info++], sizeof(v->info[0]), "%.64s%s%.80s", name, val ? " " : "", val ? val : "");
}

/* The values of tg_flags before any flag: "not given" everywhere. */
static void tg_flags_init(tg_flags* v) {
    memset(v, 0, sizeof(*v));
    mt_config_defaults(&v->cfg);
    int64_t* i64[] = {&v->num_layers, &v->hidden, &v->ffn, &v->heads, &v->groups, &v->kv, &v->seq, &v->maxpos,
                      &v->divisible, &v->mbs, &v->gbs, &v->iters, &v->train_samples, &v->warmup, &v->decay_iters,
                      &v->wsd_iters, &v->warmup_samples, &v->decay_samples, &v->wsd_samples, &v->tp, &v->pp, &v->cp,
                      &v->ep, &v->window, &v->hysteresis, &v->seed, &v->log_interval, &v->eval_interval,
                      &v->eval_iters, &v->save_interval, &v->exit_interval, &v->exit_duration_in_mins,
                      &v->max_nan_in_a_row,
                      &v->profile_step_start, &v->profile_step_end, &v->ddp_bucket_size, &v->null_vocab_size,
                      &v->tiktoken_num_special_tokens, &v->rampup[0], &v->rampup[1], &v->rampup[2],
                      &v->tensorboard_log_interval, &v->plan_world_size, &v->save_retain_interval,
                      &v->eval_global_batch_size, &v->dist_opt_instances};
    for (size_t k = 0; k < sizeof(i64) / sizeof(i64[0]); k++) *i64[k] = -1;
    double* d[] = {&v->lr, &v->min_lr, &v->decoupled_lr, &v->decoupled_min_lr, &v->warmup_fraction, &v->warmup_init,
                   &v->b1, &v->b2, &v->eps, &v->wd,
                   &v->clip, &v->std, &v->norm_eps, &v->hidden_dropout, &v->attention_dropout, &v->loss_scale,
                   &v->initial_loss_scale, &v->min_loss_scale, &v->rotary_base, &v->rotary_percent, &v->rope_factor,
                   &v->peak_tflops, &v->mid_level_surplus, &v->gpu_memory_gib};
    for (size_t k = 0; k < sizeof(d) / sizeof(d[0]); k++) *d[k] = -1;
    v->fp8_margin = v->fp8_history = v->bf16_start = v->bf16_end = v->sample_tokens = v->tensorboard_queue_size = -1;
    v->recompute_num_layers = -1;
}

/* Edit distance (insertions, deletions, substitutions of bytes) between two flag names, each cut
 * to 127 bytes; for "did you mean". */
static int tg_edit_distance(const char* a, const char* b) {
    int n = (int)strlen(a), m = (int)strlen(b);
    if (n > 127) n = 127;
    if (m > 127) m = 127;
    int row[128], prev[128];
    for (int j = 0; j <= m; j++) prev[j] = j;
    for (int i = 1; i <= n; i++) {
        row[0] = i;
        for (int j = 1; j <= m; j++) {
            int best = prev[j - 1] + (a[i - 1] != b[j - 1]);
            if (prev[j] + 1 < best) best = prev[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
        }
        memcpy(prev, row, sizeof(int) * (size_t)(m + 1));
    }
    return prev[m];
}

/* The table's name nearest an unknown one, when near enough to be a slip (at most a third of its
 * length, and at least 2, edits away: --num_layers, --hiden-size, --tensor-parallel-size); else NULL. */
static const char* tg_flag_nearest(const char* name) {
    const char* best = NULL;
    int best_d = 1 << 30, len = (int)strlen(name), limit = len / 3 > 2 ? len / 3 : 2;
    for (size_t k = 0; k < TG_NUM_FLAGS; k++) {
        int d = tg_edit_distance(name, tg_flag_table[k].name);
        if (d < best_d) best_d = d, best = tg_flag_table[k].name;
    }
    return best_d <= limit ? best : NULL;
}

/* The unknown flags of a command line, reported together at the end as argparse does. */
#define TG_MAX_UNKNOWN 32
typedef struct {
    int count;
    char names[TG_MAX_UNKNOWN][64];
} tg_unknown_flags;

static void tg_unknown_add(tg_unknown_flags* u, const char* name, size_t len) {
    if (u->count < TG_MAX_UNKNOWN)
        snprintf(u->names[u->count], sizeof(u->names[0]), "%.*s%s", (int)(len < 60 ? len : 56), name, len < 60 ? "" : "...");
    u->count++;
}

/* One line: "unknown flag --x (did you mean --y?) (see --help)", or "unknown flags: --a (did you mean
 * --b?), --c (see --help)" for several. */
static int tg_unknown_fail(const tg_unknown_flags* u, char* msg, size_t size) {
    size_t used = (size_t)snprintf(msg, size, "unknown flag%s", u->count > 1 ? "s:" : "");
    int shown = u->count < TG_MAX_UNKNOWN ? u->count : TG_MAX_UNKNOWN;
    for (int k = 0; k < shown && used < size; k++) {
        const char* near = tg_flag_nearest(u->names[k]);
        used += (size_t)snprintf(msg + used, size - used, "%s %s", k ? "," : "", u->names[k]);
        if (near && used < size) used += (size_t)snprintf(msg + used, size - used, " (did you mean %s?)", near);
    }
    if (u->count > shown && used < size) used += (size_t)snprintf(msg + used, size - used, ", and %d more", u->count - shown);
    if (used < size) snprintf(msg + used, size - used, " (see --help)");
    return -1;
}

/* A list flag's values (argparse's nargs): the words after argv[i] up to the next --flag, or the one
 * value of --flag=value (*inline_val). Returns how many; *list points at the first. */
static int tg_list_values(int argc, char** argv, int i, const char* const* inline_val, const char* const** list) {
    if (*inline_val) {
        *list = inline_val;
        return 1;
    }
    int end = i + 1;
    while (end < argc && strncmp(argv[end], "--", 2) != 0) end++;
    *list = (const char* const*)argv + i + 1;
    return end - (i + 1);
}

/* argv -> v. Returns 0, 1 for --help, or -1 with one line in msg (a refused flag, a bad or missing
 * value: the first; unknown flags: all of them, once the rest parsed). */
static int tg_flags_parse(tg_flags* v, int argc, char** argv, char* msg, size_t size) {
    char name_buf[128];
    tg_unknown_flags unknown;
    unknown.count = 0;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        const char* inline_val = NULL; /* --flag=value, as argparse accepts */
        const char* eq = strncmp(a, "--", 2) == 0 ? strchr(a, '=') : NULL;
        if (eq && (size_t)(eq - a) >= sizeof(name_buf)) { /* no flag is that long */
            tg_unknown_add(&unknown, a, (size_t)(eq - a));
            continue;
        }
        if (eq) {
            memcpy(name_buf, a, (size_t)(eq - a));
            name_buf[eq - a] = 0;
            a = name_buf;
            inline_val = eq + 1;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return 1;
        const tg_flag* f = tg_flag_find(a);
        if (!f) { /* noted with its values (the words up to the next --flag), reported at the end */
            tg_unknown_add(&unknown, a, strlen(a));
            while (!inline_val && !strncmp(a, "--", 2) && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) i++;
            continue;
        }
        if (!strcmp(a, "--data-path")) { /* a list: up to the next --flag; --data-path=P is a list of one */
            const char* const* list;
            const int n = tg_list_values(argc, argv, i, &inline_val, &list);
            if (n > TG_MAX_DATA_PATHS) return tg_fail(msg, size, "--data-path: at most %d entries", TG_MAX_DATA_PATHS);
            mt_error err;
            if (mt_data_path_parse(n, list, v->data_paths, v->data_weights, &v->num_data_paths, &v->weighted,
                                   &err) != MT_OK)
                return tg_fail(msg, size, "%s", err.message);
            if (!inline_val) i += n;
            continue;
        }
        if (!strcmp(a, "--tokenizer-special-tokens")) { /* a list (argparse nargs='+'): up to the next --flag */
            const char* const* list;
            const int n = tg_list_values(argc, argv, i, &inline_val, &list);
            if (n == 0) return tg_fail(msg, size, "%s needs a value", a);
            if (v->num_special_tokens + n > TG_MAX_SPECIAL_TOKENS)
                return tg_fail(msg, size, "%s: at most %d tokens", a, TG_MAX_SPECIAL_TOKENS);
            for (int k = 0; k < n; k++) v->special_tokens[v->num_special_tokens++] = list[k];
            if (!inline_val) i += n;
            continue;
        }
        if (!strcmp(a, "--recompute-modules")) { /* a list (argparse nargs='*'): up to the next --flag */
            const char* const* list;
            const int n = tg_list_values(argc, argv, i, &inline_val, &list);
            if (n == 0) return tg_fail(msg, size, "%s needs at least one of %s", a, f->choices);
            static const char* const modules[] = {"core_attn", "layernorm", "act", "mlp", "moe_act", "moe"};
            for (int k = 0; k < n; k++) {
                const int m = tg_lookup(list[k], modules, 6);
                if (m < 0) return tg_fail(msg, size, "%s %s: expected one of %s", a, list[k], f->choices);
                v->recompute_modules |= 1 << m; /* MT_RECOMPUTE_CORE_ATTN, _LAYERNORM, _ACT, _MLP, _MOE_ACT, _MOE */
            }
            if (!inline_val) i += n;
            continue;
        }
        if (!strcmp(a, "--moe-router-load-balancing-type")) { /* a list (argparse nargs='+'): up to the next --flag */
            const char* const* list;
            const int n = tg_list_values(argc, argv, i, &inline_val, &list);
            if (n == 0) return tg_fail(msg, size, "%s needs at least one of %s", a, f->choices);
            if (n > 8) return tg_fail(msg, size, "%s: at most 8 types", a);
            static const char* const types[] = {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                "quantile_balancing", "none"};
            for (int k = 0; k < n; k++) {
                const int t = tg_lookup(list[k], types, 6);
                if (t < 0) return tg_fail(msg, size, "%s %s: expected one of %s", a, list[k], f->choices);
                v->moe_lb[k] = t;
            }
            v->moe_lb_count = n;
            if (!inline_val) i += n;
            continue;
        }
        if (!strcmp(a, "--moe-aux-loss-coeff")) { /* a list of numbers (argparse nargs='+') */
            const char* const* list;
            const int n = tg_list_values(argc, argv, i, &inline_val, &list);
            if (n == 0) return tg_fail(msg, size, "%s needs a value", a);
            if (n > 8) return tg_fail(msg, size, "%s: at most 8 coefficients", a);
            for (int k = 0; k < n; k++) {
                const int r = tg_parse_double(list[k], &v->moe_coeff[k]);
                if (r == 0) return tg_fail(msg, size, "%s %s: not a number", a, list[k]);
                if (r < 0 || v->moe_coeff[k] < 0) return tg_fail(msg, size, "%s %s: must be a finite number >= 0", a, list[k]);
            }
            v->moe_coeff_count = n;
            if (!inline_val) i += n;
            continue;
        }
        if (!strcmp(a, "--step-batch-size-schedule") && !inline_val) { /* one string, or the shell's words of it */
            size_t used = 0;
            int start = i + 1;
            v->batch_schedule_words[0] = 0;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                const char* w = argv[++i];
                if (used + strlen(w) + 2 > sizeof(v->batch_schedule_words))
                    return tg_fail(msg, size, "%s: longer than %zu characters", a, sizeof(v->batch_schedule_words) - 1);
                used += (size_t)snprintf(v->batch_schedule_words + used, sizeof(v->batch_schedule_words) - used, "%s%s",
                                         used ? " " : "", w);
            }
            if (i < start) return tg_fail(msg, size, "%s needs a value", a);
            v->batch_schedule = v->batch_schedule_words;
            continue;
        }
        int is_switch = f->kind == F_TRUE || f->kind == F_INFO_SWITCH || f->kind == F_REFUSED_SWITCH;
        if (is_switch && inline_val) return tg_fail(msg, size, "%s takes no value (got '%s')", a, inline_val);
        if (f->kind == F_REFUSED_SWITCH || f->kind == F_REFUSED_VALUE) return tg_fail(msg, size, "%s: %s", a, f->help);
        if (f->kind == F_TRUE) { *(int*)((char*)v + f->target) = 1; continue; }
        if (f->kind == F_INFO_SWITCH) { tg_note_info(v, a, NULL); continue; }
        int count = f->kind == F_INT64_3 ? 3 : 1;
        if (inline_val && count > 1) return tg_fail(msg, size, "%s takes %d values: %s A B C", a, count, a);
        if (!inline_val && i + count >= argc) {
            if (count > 1) return tg_fail(msg, size, "%s needs %d values", a, count);
            return tg_fail(msg, size, "%s needs a value", a);
        }
        for (int k = 0; k < count; k++) {
            const char* val = inline_val ? inline_val : argv[++i];
            if (f->kind == F_INFO_VALUE) {
                if (f->choices && !tg_choice_ok(f->choices, val))
                    return tg_fail(msg, size, "%s %s: expected one of %s", a, val, f->choices);
                tg_note_info(v, a, val);
            } else if (tg_store(v, f, a, val, k, msg, size) != 0) {
                return -1;
            }
        }
    }
    if (unknown.count) return tg_unknown_fail(&unknown, msg, size);
    return 0;
}

/* The built-in job (no --data-path, no --mock-data): a small GPT on tiny shakespeare. */
static void tg_builtin_defaults(tg_flags* v) {
    mt_config* c = &v->cfg;
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
    c->hidden_dropout = 0; /* the built-in job trains without dropout unless the flags ask (its numbers */
    c->attention_dropout = 0; /* predate dropout and stay bitwise the same) */
    if (v->log_interval < 0) v->log_interval = 20;
    if (v->eval_interval < 0) v->eval_interval = 100;
    if (v->eval_iters < 0) v->eval_iters = 5;
    if (v->save_interval < 0) v->save_interval = 0;
    if (!v->save) v->save = "checkpoints/builtin";
    if (v->sample_tokens < 0) v->sample_tokens = 128;
}

/* The defaults: the built-in job's (no --data-path, no --mock-data), or Megatron's, which then
 * require the model's sizes, the micro-batch, the learning rate and the run's length; the run
 * options' own defaults, and the flags that only go together. */
static int tg_apply_defaults(tg_flags* v, char* msg, size_t size) {
    v->builtin = v->num_data_paths == 0 && !v->mock_data;
    if (v->builtin) {
        tg_builtin_defaults(v);
    } else {
        if (v->log_interval < 0) v->log_interval = 100;
        if (v->eval_interval < 0) v->eval_interval = 1000;
        if (v->eval_iters < 0) v->eval_iters = 100;
        if (v->save_interval < 0) v->save_interval = 0;
        /* --skip-train trains nothing: no learning rate or length needed */
        const char* missing = v->num_layers < 0 ? "--num-layers" : v->hidden < 0 ? "--hidden-size"
                              : v->heads < 0 ? "--num-attention-heads" : v->seq < 0 ? "--seq-length"
                              : v->mbs < 0 ? "--micro-batch-size" : v->lr < 0 && !v->skip_train ? "--lr" : NULL;
        if (!missing && v->iters < 0 && v->train_samples < 0 && !v->skip_train)
            missing = "--train-iters (or --train-samples)";
        if (missing) return tg_fail(msg, size, "%s is required with --data-path or --mock-data", missing);
    }
    if (!v->split) v->split = "969, 30, 1"; /* Megatron's legacy default with --data-path */
    if (v->sample_tokens < 0) v->sample_tokens = 0;
    if (v->peak_tflops < 0) v->peak_tflops = 0;
    if (v->tensorboard_log_interval < 0) v->tensorboard_log_interval = 1;
    if (v->max_nan_in_a_row < 0) v->max_nan_in_a_row = 1;
    if (v->tensorboard_queue_size < 0) v->tensorboard_queue_size = 1000;
    if (v->full_validation && v->cp > 1)
        return tg_fail(msg, size, "--full-validation with --context-parallel-size %lld is not built (its last partial round "
                       "needs every position's loss on one rank): drop one", (long long)v->cp);
    if (v->full_validation && v->mock_data)
        return tg_fail(msg, size, "--full-validation needs a dataset: --mock-data has no end");
    if (!v->plan && !v->plan_layouts && (v->plan_world_size > 0 || v->gpu_memory_gib > 0))
        return tg_fail(msg, size, "--world-size and --gpu-memory-gib go with --plan or --plan-layouts (a run's world "
                       "is its processes)");
    if (v->gpu_memory_gib < 0) v->gpu_memory_gib = 80.0;
    return 0;
}

/* flags whose value decides whether this build can honour them */
static int tg_apply_build_limits(tg_flags* v, char* msg, size_t size) {
    if (v->cp_comm_type && !strcmp(v->cp_comm_type, "a2a+p2p"))
        return tg_fail(msg, size, "--cp-comm-type a2a+p2p: %s", HCP_REFUSED);
    if (v->optimizer && strcmp(v->optimizer, "adam"))
        return tg_fail(msg, size, "--optimizer %s: only adam (AdamW) is implemented", v->optimizer);
    if (v->dist_opt_instances > 1)
        return tg_fail(msg, size, "--num-distributed-optimizer-instances %lld: several distributed-optimizer instances "
                       "across data parallelism are not implemented (use 1)", (long long)v->dist_opt_instances);
    if (v->distributed_backend && strcmp(v->distributed_backend, "nccl"))
        return tg_fail(msg, size, "--distributed-backend %s: only nccl is implemented", v->distributed_backend);
    if (v->mid_level_surplus >= 0 && v->mid_level_surplus != MT_MID_LEVEL_DATASET_SURPLUS)
        return tg_fail(msg, size, "--mid-level-dataset-surplus %g: only the default %g is implemented",
                       v->mid_level_surplus, MT_MID_LEVEL_DATASET_SURPLUS);
    if (v->tiktoken_pattern && !(v->tokenizer_type && !strcmp(v->tokenizer_type, "TikTokenizer")))
        tg_note_info(v, "--tiktoken-pattern", v->tiktoken_pattern); /* used by TikTokenizer only, as in Megatron */
    if (v->no_load_rng) tg_note_info(v, "--no-load-rng", NULL);
    if (v->data_cache_path && v->mock_data) tg_note_info(v, "--data-cache-path (--mock-data reads no dataset)", NULL);
    return 0;
}

/* FP8 (ranges and combinations are checked by mt_config_finalize) */
static int tg_apply_fp8(tg_flags* v, char* msg, size_t size) {
    mt_config* c = &v->cfg;
    if (v->fp8_format) c->fp8_format = !strcmp(v->fp8_format, "e4m3") ? MT_FP8_E4M3 : MT_FP8_HYBRID;
    if (v->fp8_recipe) {
        const char* names[] = {"delayed", "tensorwise", "blockwise"};
        c->fp8_recipe = (mt_fp8_recipe)tg_lookup(v->fp8_recipe, names, 3);
    }
    if (v->fp8_algo) c->fp8_amax_compute_algo = !strcmp(v->fp8_algo, "max") ? MT_FP8_AMAX_MAX : MT_FP8_AMAX_MOST_RECENT;
    if (v->fp8_margin != -1) c->fp8_margin = v->fp8_margin;
    if (v->fp8_history != -1) c->fp8_amax_history_len = v->fp8_history;
    if (v->no_fp8_wgrad) c->fp8_wgrad = 0;
    c->first_last_layers_bf16 = v->first_last_bf16;
    if (v->bf16_start != -1) c->num_layers_at_start_in_bf16 = v->bf16_start;
    if (v->bf16_end != -1) c->num_layers_at_end_in_bf16 = v->bf16_end;
    c->fp8_param_gather = v->fp8_param_gather;
    if (!v->fp8_format && (v->fp8_recipe || v->fp8_algo || v->fp8_margin != -1 || v->fp8_history != -1 ||
                           v->no_fp8_wgrad || v->first_last_bf16 || v->fp8_param_gather))
        return tg_fail(msg, size, "the --fp8-* flags need --fp8-format e4m3|hybrid");
    return 0;
}

/* activation recompute, with Megatron's checks (the layer count against the layers per pipeline
 * rank: mt_config_finalize) */
static int tg_apply_recompute(tg_flags* v, char* msg, size_t size) {
    mt_config* c = &v->cfg;
    mt_recompute* rc = &c->recompute;
    if (v->recompute_activations && v->recompute_granularity && strcmp(v->recompute_granularity, "selective"))
        return tg_fail(msg, size, "--recompute-activations is selective recompute: it contradicts "
                       "--recompute-granularity %s", v->recompute_granularity);
    if (v->recompute_activations || v->recompute_granularity)
        rc->granularity = v->recompute_granularity && !strcmp(v->recompute_granularity, "full") ? MT_RECOMPUTE_FULL
                                                                                                 : MT_RECOMPUTE_SELECTIVE;
    if (v->moe_layer_recompute) { /* Megatron: selective, "moe" appended to the modules (core_attn by default) */
        if (rc->granularity == MT_RECOMPUTE_FULL)
            return tg_fail(msg, size, "Do not set --moe-layer-recompute with full recompute granularity. ");
        rc->granularity = MT_RECOMPUTE_SELECTIVE;
        v->recompute_modules = (v->recompute_modules ? v->recompute_modules : MT_RECOMPUTE_CORE_ATTN) | MT_RECOMPUTE_MOE;
    }
    if (rc->granularity == MT_RECOMPUTE_FULL) {
        if (!v->recompute_method)
            return tg_fail(msg, size, "--recompute-granularity full needs --recompute-method uniform|block");
        if (v->recompute_num_layers < 0)
            return tg_fail(msg, size, "--recompute-granularity full needs --recompute-num-layers (1 to the layers per "
                           "pipeline rank)");
        rc->method = !strcmp(v->recompute_method, "block") ? MT_RECOMPUTE_BLOCK : MT_RECOMPUTE_UNIFORM;
        rc->num_layers = v->recompute_num_layers;
    } else if (v->recompute_method || v->recompute_num_layers >= 0) {
        return tg_fail(msg, size, "%s goes with --recompute-granularity full",
                       v->recompute_method ? "--recompute-method" : "--recompute-num-layers");
    }
    if (v->recompute_modules && rc->granularity != MT_RECOMPUTE_SELECTIVE)
        return tg_fail(msg, size, "--recompute-modules goes with --recompute-granularity selective (or "
                       "--recompute-activations)");
    rc->modules = v->recompute_modules;
    return 0;
}

/* the model flavour (GPT-2 by default; Llama: RMSNorm, SwiGLU, rope, GQA, untied, no biases) */
static int tg_apply_model(tg_flags* v, char* msg, size_t size) {
    mt_config* c = &v->cfg;
    if (v->normalization) c->normalization = !strcmp(v->normalization, "RMSNorm") ? MT_NORM_RMSNORM : MT_NORM_LAYERNORM;
    if (v->position_type) {
        const char* names[] = {"learned_absolute", "rope", "none"};
        c->position_embedding_type = (mt_position_embedding)tg_lookup(v->position_type, names, 3);
    }
    if (v->no_position_embedding && c->position_embedding_type == MT_POSITION_LEARNED)
        return tg_fail(msg, size, "--no-position-embedding is deprecated in Megatron and taken only with rope: use "
                       "--position-embedding-type none (or rope)");
    if (v->rotary_base >= 0) c->rotary_base = v->rotary_base;
    if (v->rotary_percent >= 0) c->rotary_percent = v->rotary_percent;
    if (v->rope_factor >= 0) c->rope_scaling_factor = v->rope_factor;
    c->use_rope_scaling = v->rope_scaling;
    c->swiglu = v->swiglu;
    c->untie_embeddings_and_output_weights = v->untie;
    c->add_bias_linear = !v->no_bias;
    c->apply_layernorm_1p = v->layernorm_1p;
    if (v->num_layers >= 0) c->num_layers = (int)v->num_layers;
    if (v->hidden >= 0) c->hidden_size = (int)v->hidden;
    if (v->ffn >= 0) c->ffn_hidden_size = (int)v->ffn;
    if (v->heads >= 0) c->num_attention_heads = (int)v->heads;
    if (v->groups >= 0) {
        if (!v->gqa) return tg_fail(msg, size, "--num-query-groups needs --group-query-attention");
        c->num_query_groups = (int)v->groups;
    }
    if (v->kv >= 0) c->kv_channels = (int)v->kv;
    if (v->seq >= 0) c->seq_length = (int)v->seq;
    if (v->maxpos >= 0) c->max_position_embeddings = (int)v->maxpos;
    if (v->divisible >= 0) c->make_vocab_size_divisible_by = (int)v->divisible;
    if (v->std >= 0) c->init_method_std = v->std;
    if (v->norm_eps >= 0) c->norm_epsilon = v->norm_eps;
    if (v->hidden_dropout >= 0) c->hidden_dropout = v->hidden_dropout;
    if (v->attention_dropout >= 0) c->attention_dropout = v->attention_dropout;
    if (v->bf16 && v->fp16) return tg_fail(msg, size, "--bf16 and --fp16 are mutually exclusive");
    if (v->bf16) c->precision = MT_BF16;
    if (v->fp16) c->precision = MT_FP16;
    if (v->loss_scale >= 0) c->loss_scale = v->loss_scale;
    if (v->initial_loss_scale >= 0) c->initial_loss_scale = v->initial_loss_scale;
    if (v->min_loss_scale >= 0) c->min_loss_scale = v->min_loss_scale;
    if (v->window >= 0) c->loss_scale_window = (int)v->window;
    if (v->hysteresis >= 0) c->hysteresis = (int)v->hysteresis;
    return 0;
}

/* schedule and length of training */
static int tg_apply_schedule(tg_flags* v, char* msg, size_t size) {
    mt_config* c = &v->cfg;
    if (v->lr >= 0) c->lr = v->lr;
    if (v->min_lr >= 0) c->min_lr = v->min_lr;
    c->decoupled_lr = v->decoupled_lr; /* < 0: not given */
    c->decoupled_min_lr = v->decoupled_min_lr;
    if (v->warmup >= 0) c->lr_warmup_iters = v->warmup;
    if (v->warmup_fraction >= 0) {
        c->lr_warmup_fraction = v->warmup_fraction;
        if (v->warmup < 0) c->lr_warmup_iters = 0; /* the built-in job's warmup gives way */
    }
    if (v->warmup_init >= 0) c->lr_warmup_init = v->warmup_init;
    if (v->decay_iters >= 0) c->lr_decay_iters = v->decay_iters;
    if (v->wsd_iters >= 0) c->lr_wsd_decay_iters = v->wsd_iters;
    if (v->warmup_samples >= 0) c->lr_warmup_samples = v->warmup_samples;
    if (v->decay_samples >= 0) c->lr_decay_samples = v->decay_samples;
    if (v->wsd_samples >= 0) c->lr_wsd_decay_samples = v->wsd_samples;
    if (v->decay_style) {
        const char* names[] = {"constant", "linear", "cosine", "inverse-square-root", "WSD"};
        c->lr_decay_style = (mt_lr_decay_style)tg_lookup(v->decay_style, names, 5);
    }
    if (v->wsd_style) {
        const char* names[] = {"exponential", "linear", "cosine", "minus_sqrt"};
        c->lr_wsd_decay_style = (mt_wsd_decay_style)tg_lookup(v->wsd_style, names, 4);
    }
    if (v->b1 >= 0) c->adam_beta1 = v->b1;
    if (v->b2 >= 0) c->adam_beta2 = v->b2;
    if (v->eps >= 0) c->adam_eps = v->eps;
    if (v->wd >= 0) c->weight_decay = v->wd;
    if (v->clip >= 0) c->clip_grad = v->clip;
    if (v->mbs >= 0) c->micro_batch_size = (int)v->mbs;
    if (v->gbs >= 0) c->global_batch_size = (int)v->gbs;
    if (v->train_samples >= 0) { /* the built-in job's --train-iters gives way to --train-samples */
        c->train_samples = v->train_samples;
        c->train_iters = v->iters >= 0 ? v->iters : 0;
        if (v->warmup < 0) c->lr_warmup_iters = 0;
    } else if (v->iters >= 0) {
        c->train_iters = v->iters;
    } else if (v->skip_train) {
        c->train_iters = 1; /* nothing trains; the config only needs a length */
        if (v->warmup < 0) c->lr_warmup_iters = 0; /* the built-in job's warmup gives way */
    }
    if (v->rampup[0] >= 0) for (int k = 0; k < 3; k++) c->rampup_batch_size[k] = v->rampup[k];
    if (v->batch_schedule) {
        mt_error err;
        if (mt_batch_size_schedule_parse(v->batch_schedule, c->seq_length, c, &err) != MT_OK)
            return tg_fail(msg, size, "%s", err.message);
        if (v->gbs < 0 && v->builtin) c->global_batch_size = 0; /* the schedule's last size */
    }
    if (v->seed >= 0) c->seed = (uint64_t)v->seed;
    c->eod_mask_loss = v->eod_mask_loss;
    c->reset_position_ids = v->reset_position_ids;
    c->reset_attention_mask = v->reset_attention_mask;
    c->calculate_per_token_loss = v->per_token_loss;
    c->check_for_nan_in_loss_and_grad = !v->no_check_for_nan;
    return 0;
}

/* mixture of experts: the flags that need turning into cfg's fields (Megatron's refusals and what is not
 * built yet: mt_config_finalize), and the kinds of Megatron this build does not have */
static int tg_apply_moe(tg_flags* v, char* msg, size_t size) {
    mt_config* c = &v->cfg;
    if (v->moe_layer_freq) {
        mt_error err;
        if (mt_moe_layer_freq_parse(v->moe_layer_freq, c, &err) != MT_OK) return tg_fail(msg, size, "%s", err.message);
    }
    if (v->moe_score_function) {
        if (!strcmp(v->moe_score_function, "sqrtsoftplus"))
            return tg_fail(msg, size, "--moe-router-score-function sqrtsoftplus is not built here: use softmax or sigmoid");
        c->moe_router_score_sigmoid = !strcmp(v->moe_score_function, "sigmoid");
    }
    if (v->moe_router_dtype) {
        if (!strcmp(v->moe_router_dtype, "fp64"))
            return tg_fail(msg, size, "--moe-router-dtype fp64 is not built here: use fp32");
        c->moe_router_dtype_fp32 = 1;
    }
    if (v->moe_drop_policy) c->moe_token_drop_position = !strcmp(v->moe_drop_policy, "position");
    if (v->moe_dispatcher) {
        if (!strcmp(v->moe_dispatcher, "flex"))
            return tg_fail(msg, size, "--moe-token-dispatcher-type flex (DeepEP / HybridEP) is not built here: use "
                           "allgather or alltoall");
        c->moe_token_dispatcher_alltoall = !strcmp(v->moe_dispatcher, "alltoall");
    }
    if (v->moe_shared_overlap) {
        if (!c->moe_token_dispatcher_alltoall)
            return tg_fail(msg, size, "moe_shared_expert_overlap only works with alltoall or flex token dispatcher. "
                           "(--moe-shared-expert-overlap)");
        tg_note_info(v, "--moe-shared-expert-overlap", NULL); /* the same values either way */
    }
    /* the load-balancing types (default aux_loss) and one coefficient each (default 0: off) */
    static const int bits[] = {MT_MOE_AUX_LOSS, MT_MOE_SEQ_AUX_LOSS, MT_MOE_GLOBAL_AUX_LOSS};
    static const char* const names[] = {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing",
                                        "none"};
    const int types = v->moe_lb_count > 0 ? v->moe_lb_count : 1;
    if ((v->moe_coeff_count > 0 || types > 1) && v->moe_coeff_count != types)
        return tg_fail(msg, size, "moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type "
                       "(%d coefficients for %d types)", v->moe_coeff_count, types);
    if (v->moe_lb_count > 0) c->moe_load_balancing = 0;
    for (int k = 0; k < types; k++) {
        const int t = v->moe_lb_count > 0 ? v->moe_lb[k] : 0;
        if (t == 3 || t == 4)
            return tg_fail(msg, size, "--moe-router-load-balancing-type %s is not built here: use aux_loss, seq_aux_loss, "
                           "global_aux_loss or none", names[t]);
        if (t == 5) continue; /* none */
        if (c->moe_load_balancing & bits[t] && v->moe_lb_count > 0)
            return tg_fail(msg, size, "--moe-router-load-balancing-type: %s given twice", names[t]);
        c->moe_load_balancing |= bits[t];
        c->moe_aux_loss_coeff[t] = v->moe_coeff_count > 0 ? v->moe_coeff[k] : 0.0;
    }
    if (v->ep >= 0) c->expert_model_parallel_size = (int)v->ep;
    return 0;
}

/* parallelism */
static void tg_apply_parallelism(tg_flags* v) {
    mt_config* c = &v->cfg;
    if (v->tp >= 0) c->tensor_model_parallel_size = (int)v->tp;
    if (v->pp >= 0) c->pipeline_model_parallel_size = (int)v->pp;
    if (v->cp >= 0) c->context_parallel_size = (int)v->cp;
    if (v->cp_comm_type)
        c->cp_comm_type = !strcmp(v->cp_comm_type, "a2a") ? MT_CP_A2A
                          : !strcmp(v->cp_comm_type, "all_gather") ? MT_CP_ALL_GATHER : MT_CP_P2P;
    c->sequence_parallel = v->sequence_parallel;
    c->use_distributed_optimizer = v->distributed_optimizer;
    c->overlap_grad_reduce = v->overlap_grad_reduce;
    c->overlap_param_gather = v->overlap_param_gather;
    c->grad_reduce_in_bf16 = v->grad_reduce_bf16;
    if (v->ddp_bucket_size >= 0) c->ddp_bucket_size = v->ddp_bucket_size;
}

/* exits, checkpoints, profiling */
static int tg_apply_exits(tg_flags* v, char* msg, size_t size) {
    if (v->finetune && v->no_load_optim) tg_note_info(v, "--no-load-optim (implied by --finetune)", NULL);
    if (v->save_retain_interval > 0 && v->save) { /* Megatron's checks, with --save */
        if (v->save_interval <= 0)
            return tg_fail(msg, size, "--save-retain-interval %lld needs --save-interval (the checkpoints it thins out)",
                           (long long)v->save_retain_interval);
        if (v->save_retain_interval % v->save_interval)
            return tg_fail(msg, size, "--save-retain-interval %lld must be a multiple of --save-interval %lld",
                           (long long)v->save_retain_interval, (long long)v->save_interval);
    }
    if (v->profile_step_start < 0) v->profile_step_start = 10;
    if (v->profile_step_end < 0) v->profile_step_end = 12;
    if (v->profile && v->profile_step_end <= v->profile_step_start)
        return tg_fail(msg, size, "--profile-step-end %lld must come after --profile-step-start %lld",
                       (long long)v->profile_step_end, (long long)v->profile_step_start);
    return 0;
}

/* The parsed values -> cfg and the run's options: the built-in job's defaults or Megatron's
 * (required flags), choices, combinations. 0, or -1 with one line in msg. mt_config_finalize
 * checks the rest once the vocabulary and the world are known. */
static int tg_flags_apply(tg_flags* v, char* msg, size_t size) {
    if (tg_apply_defaults(v, msg, size) != 0 || tg_apply_build_limits(v, msg, size) != 0 ||
        tg_apply_fp8(v, msg, size) != 0 || tg_apply_recompute(v, msg, size) != 0 ||
        tg_apply_model(v, msg, size) != 0 || tg_apply_schedule(v, msg, size) != 0 || tg_apply_moe(v, msg, size) != 0)
        return -1;
    tg_apply_parallelism(v);
    return tg_apply_exits(v, msg, size);
}

/* The one startup line naming the informational flags given ("" when none). */
static void tg_flags_info_line(const tg_flags* v, char* out, size_t size) {
    out[0] = 0;
    if (v->num_info == 0) return;
    size_t used = (size_t)snprintf(out, size, "accepted, no effect in this build (see --help):");
    for (int k = 0; k < v->num_info && used < size; k++)
        used += (size_t)snprintf(out + used, size - used, "%s %s", k ? "," : "", v->info[k]);
}

/* --help: every flag with its value, default and meaning, in Megatron's argument groups. */
static void tg_flags_help(FILE* out) {
    fprintf(out, "usage: train_gpt [Megatron pretrain_gpt.py flags]   (--flag value or --flag=value)\n"
                 "  With neither --data-path nor --mock-data, trains the built-in small GPT on tiny shakespeare\n"
                 "  (its own sizes and schedule; flags still override). Informational flags are accepted and\n"
                 "  named at startup; refused flags stop with the reason.\n");
    for (size_t k = 0; k < TG_NUM_FLAGS; k++) {
        const tg_flag* f = &tg_flag_table[k];
        int first = 1;
        for (size_t j = 0; j < k; j++) if (!strcmp(tg_flag_table[j].group, f->group)) { first = 0; break; }
        if (!first) continue;
        fprintf(out, "\n%s:\n", f->group);
        for (size_t j = k; j < TG_NUM_FLAGS; j++) {
            const tg_flag* g = &tg_flag_table[j];
            if (strcmp(g->group, f->group)) continue;
            const char* arg = "";
            switch (g->kind) {
                case F_INT: case F_INT64: arg = " INT"; break;
                case F_INT64_3: arg = " START INCR SAMPLES"; break;
                case F_DOUBLE: arg = " FLOAT"; break;
                case F_STRING: case F_INFO_VALUE: case F_REFUSED_VALUE: arg = g->choices ? "" : " STR"; break;
                default: break;
            }
            char head[160];
            if (g->choices) snprintf(head, sizeof(head), "%s {%s}", g->name, g->choices);
            else snprintf(head, sizeof(head), "%s%s", g->name, arg);
            const char* tag = g->kind == F_INFO_SWITCH || g->kind == F_INFO_VALUE ? "[no effect here] "
                              : g->kind == F_REFUSED_SWITCH || g->kind == F_REFUSED_VALUE ? "[refused] " : "";
            fprintf(out, "  %-44s %s%s (default: %s)\n", head, tag, g->help, g->def);
        }
    }
}

/* The tokenizer flags -> prepro/tokenizer.h's mt_tokenizer_args (Megatron's --tokenizer-type names;
 * the built-in job's GPT-2 files when it names none). Shared by train_gpt and serve_gpt; only where
 * the file including this one included prepro/tokenizer.h first. */
#ifdef MT_TOKENIZER_H
static void tg_tokenizer_args(tg_flags* o, mt_tokenizer_args* args) {
    mt_tokenizer_args_init(args);
    args->type = o->tokenizer_type ? o->tokenizer_type : "GPT2BPETokenizer";
    if (o->builtin && !o->vocab_file && !strcmp(args->type, "GPT2BPETokenizer")) {
        o->vocab_file = "dev/data/gpt2/gpt2-vocab.json";
        o->merge_file = "dev/data/gpt2/gpt2-merges.txt";
    }
    args->vocab_file = o->vocab_file;
    args->merge_file = o->merge_file;
    args->model = o->tokenizer_model;
    args->vocab_size = o->null_vocab_size > 0 ? o->null_vocab_size : 0;
    args->tiktoken_pattern = o->tiktoken_pattern;
    if (o->tiktoken_num_special_tokens > 0) args->tiktoken_num_special_tokens = o->tiktoken_num_special_tokens;
    args->special_tokens = o->num_special_tokens ? o->special_tokens : NULL;
    args->num_special_tokens = o->num_special_tokens;
    args->hf_no_include_special_tokens = o->hf_no_include_special_tokens;
    args->tiktoken_encoding = o->tiktoken_encoding;
}
#endif

#endif /* TRAIN_GPT_FLAGS_H */
