/* prepro/convert_hf.c — Hugging Face GPT-2, Llama, Mixtral and Qwen3-MoE checkpoints <-> megatron.c
 * checkpoints.
 *
 *   convert_hf --import HF_DIR --save CKPT_DIR
 *       reads HF_DIR/config.json (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM or
 *       Qwen3MoeForCausalLM, told apart by model_type or architectures) and HF_DIR/model.safetensors (or the shards of model.safetensors.index.json;
 *       F32, F16 or BF16), writes CKPT_DIR/iter_0000000/ (fp32 master weights, Adam moments zero; the
 *       header records the flavour, the norm epsilon and the true vocabulary; its manifest.txt) and
 *       CKPT_DIR/latest_checkpointed_iteration.txt, and prints the train_gpt flags of the model (load
 *       it with --load CKPT_DIR). A weight that holds a NaN or an infinity is refused (file, tensor, index).
 *
 *   convert_hf --export CKPT_DIR --out HF_DIR [--iteration N] [--vocab-size V] [--norm-epsilon E]
 *              [--dtype float32|bfloat16] [--no-verify]
 *              [--moe-router-topk K [--moe-router-pre-softmax] [--moe-aux-loss-coeff C]]
 *       applies the integrity rule (megatron.h mt_checkpoint_check_integrity: the manifest verified, or
 *       without one the header's manifest mark; a refusal names the file; --no-verify reads it anyway,
 *       with a warning), reads the checkpoint's master weights (the tracker's iteration unless --iteration) and writes
 *       HF_DIR/config.json and HF_DIR/model.safetensors (shards + index past 5 GB), loadable with
 *       GPT2LMHeadModel / LlamaForCausalLM.from_pretrained(HF_DIR): the class follows the checkpoint's
 *       flavour (a flavour transformers has no class for is refused). The padded vocabulary is cut back
 *       to V and the norm epsilon is E: by default the ones the header records (checkpoints from before
 *       those words: 50257, or the padded size if smaller, and 1e-5). A mixture-of-experts checkpoint
 *       (MixtralForCausalLM, or Qwen3MoeForCausalLM with --qk-layernorm) needs the router's top-k, which
 *       the header does not record: --moe-router-topk K as trained, and --moe-router-pre-softmax (Qwen3-MoE's
 *       norm_topk_prob false) and --moe-aux-loss-coeff C (router_aux_loss_coef; default 0) when trained so.
 *
 * The mappings are prepro/hf_gpt2.h, prepro/hf_llama.h and prepro/hf_moe.h, what they share (loading, saving,
 * checkpoints) prepro/hf_checkpoint.h, the safetensors reader/writer prepro/safetensors.h. Errors: one
 * line on stderr and exit 1 (bad usage: exit 2); nothing is left half-written.
 */
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#include "args.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "safetensors.h"
#define MT_HF_IMPLEMENTATION
#include "hf_checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(void) {
    fprintf(stderr,
            "usage: convert_hf --import HF_DIR --save CKPT_DIR\n"
            "       convert_hf --export CKPT_DIR --out HF_DIR [--iteration N] [--vocab-size V] [--norm-epsilon E]\n"
            "                  [--dtype float32|bfloat16] [--no-verify]\n"
            "                  [--moe-router-topk K [--moe-router-pre-softmax] [--moe-aux-loss-coeff C]]\n"
            "  --import HF_DIR     a transformers GPT-2, Llama, Mixtral or Qwen3-MoE directory: config.json +\n"
            "                      model.safetensors\n"
            "                      (or model.safetensors.index.json and its shards)\n"
            "  --save CKPT_DIR     where to write the megatron.c checkpoint (iteration 0); must not hold one\n"
            "  --export CKPT_DIR   a megatron.c checkpoint directory (train_gpt --save)\n"
            "  --out HF_DIR        where to write config.json and model.safetensors\n"
            "  --iteration N       the checkpoint's iteration (default: latest_checkpointed_iteration.txt)\n"
            "  --vocab-size V      the tokenizer's vocabulary (default: the checkpoint's; else 50257, or the\n"
            "                      padded size if smaller)\n"
            "  --norm-epsilon E    the norm epsilon the model was trained with (default: the checkpoint's; else 1e-5)\n"
            "  --dtype T           float32 (default) or bfloat16 weights in model.safetensors\n"
            "  --no-verify         export a checkpoint whose manifest check fails (or that lost the manifest it\n"
            "                      was saved with) anyway, with a warning\n"
            "  --moe-router-topk K          a mixture of experts' top-k (required for one: the checkpoint does not\n"
            "                               record it); exported as num_experts_per_tok\n"
            "  --moe-router-pre-softmax     its router took the top-k of softmax over all experts, not renormalised\n"
            "                               (Qwen3-MoE's norm_topk_prob false; Mixtral has no such router)\n"
            "  --moe-aux-loss-coeff C       its aux_loss coefficient, exported as router_aux_loss_coef (default 0)\n");
}

static int fail(const mt_error* err) {
    fprintf(stderr, "convert_hf: error: %s\n", err->message);
    return 1;
}

static int bad_usage(const char* what, const char* arg) {
    fprintf(stderr, "convert_hf: %s%s%s (convert_hf --help for usage)\n", what, arg ? " " : "", arg ? arg : "");
    return 2;
}

static int parse_int64(const char* s, int64_t* out) {
    char* end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < 0) return -1; /* errno: beyond int64 (ERANGE), not LLONG_MAX */
    *out = v;
    return 0;
}

static const char* shortest(char* buf, size_t cap, double x) { /* the shortest text that reads back as x */
    if (x == (double)(int64_t)x && x < 1e15 && x > -1e15) { /* 500000, not 5e+05 */
        snprintf(buf, cap, "%lld", (long long)x);
        return buf;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    return buf;
}

static int do_import(const char* hf_dir, const char* ckpt_dir) {
    mt_error err;
    mt_config c;
    const mt_hf_arch* arch = NULL;
    float* params = NULL;
    if (mt_hf_load(hf_dir, &c, &params, &arch, &err) != MT_OK) return fail(&err);
    mt_status st = mt_hf_checkpoint_write(ckpt_dir, &c, params, 0, &err);
    free(params);
    if (st != MT_OK) return fail(&err);
    int llama = arch != &mt_hf_gpt2_arch; /* the Llama family: Llama, Mixtral, Qwen3-MoE */
    char eps[64], base[64], factor[64];
    shortest(eps, sizeof(eps), c.norm_epsilon);
    printf("imported %s: %s, %d layers, hidden %d, %d heads", hf_dir, arch->title, c.num_layers, c.hidden_size,
           c.num_attention_heads);
    if (llama) printf(", %d query groups, head dim %d", c.num_query_groups, c.kv_channels);
    printf(", ffn %d", c.ffn_hidden_size);
    if (c.num_experts > 0)
        printf(", %d experts of ffn %lld (top-%d%s)%s", c.num_experts, (long long)mt_moe_ffn(&c), c.moe_router_topk,
               c.moe_router_pre_softmax ? ", not renormalised" : "", c.qk_layernorm ? ", query and key norms" : "");
    printf(", %d positions, vocab %lld (padded %lld), %lld parameters\n", c.max_position_embeddings,
           (long long)c.vocab_size, (long long)c.padded_vocab_size, (long long)mt_num_parameters(&c));
    printf("wrote %s/iter_0000000/mp_rank_00/model_optim_rng.bin (iteration 0, Adam state zero) and its manifest\n",
           ckpt_dir);
    printf("train_gpt flags for this model:\n");
    printf("  --num-layers %d --hidden-size %d --num-attention-heads %d", c.num_layers, c.hidden_size,
           c.num_attention_heads);
    if (c.num_query_groups != c.num_attention_heads) printf(" --group-query-attention --num-query-groups %d", c.num_query_groups);
    if ((int64_t)c.kv_channels * c.num_attention_heads != c.hidden_size) printf(" --kv-channels %d", c.kv_channels);
    printf(" --ffn-hidden-size %d \\\n"
           "  --seq-length %d --max-position-embeddings %d --norm-epsilon %s --make-vocab-size-divisible-by %d \\\n",
           c.ffn_hidden_size, c.seq_length, c.max_position_embeddings, eps, c.make_vocab_size_divisible_by);
    if (llama) {
        printf("  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope --rotary-base %s",
               shortest(base, sizeof(base), c.rotary_base));
        if (c.use_rope_scaling) printf(" --use-rope-scaling --rope-scaling-factor %s", shortest(factor, sizeof(factor), c.rope_scaling_factor));
        printf(c.untie_embeddings_and_output_weights ? " \\\n  --untie-embeddings-and-output-weights \\\n" : " \\\n");
    }
    if (c.num_experts > 0) {
        char coef[64];
        printf("  --num-experts %d --moe-router-topk %d --moe-ffn-hidden-size %lld%s%s \\\n"
               "  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff %s \\\n",
               c.num_experts, c.moe_router_topk, (long long)mt_moe_ffn(&c), c.moe_router_pre_softmax ? " --moe-router-pre-softmax" : "",
               c.qk_layernorm ? " --qk-layernorm" : "", shortest(coef, sizeof(coef), c.moe_aux_loss_coeff[0]));
    }
    if (!llama && c.vocab_size == 50257)
        printf("  --tokenizer-type GPT2BPETokenizer --vocab-file dev/data/gpt2/gpt2-vocab.json "
               "--merge-file dev/data/gpt2/gpt2-merges.txt \\\n");
    else
        printf("  --tokenizer-type NullTokenizer --vocab-size %lld \\\n", (long long)c.vocab_size);
    printf("  --load %s\n", ckpt_dir);
    printf("(--seq-length may be lowered; the other flags must stay as printed for the checkpoint to load)\n");
    return 0;
}

/* The router settings an MoE export takes from the command line (the header does not record them). */
typedef struct {
    int64_t topk;     /* --moe-router-topk (-1: not given) */
    int pre_softmax;  /* --moe-router-pre-softmax */
    double coeff;     /* --moe-aux-loss-coeff (-1: not given) */
} moe_flags;

static int do_export(const char* ckpt_dir, const char* hf_dir, int64_t iteration, int64_t vocab, double eps,
                     mt_st_dtype dtype, int no_verify, const moe_flags* moe) {
    mt_error err, warning;
    mt_config cfg;
    float* params = NULL;
    int64_t header[MT_CK_HEADER_WORDS];
    mt_status read = mt_hf_checkpoint_read(ckpt_dir, iteration, no_verify, &cfg, &params, header, &warning, &err);
    if (warning.message[0]) fprintf(stderr, "convert_hf: warning: %s\n", warning.message);
    if (read != MT_OK) return fail(&err);
    if (vocab < 0) vocab = header[MT_CK_TRUE_VOCAB] > 0 ? header[MT_CK_TRUE_VOCAB]
                         : cfg.padded_vocab_size < 50257 ? cfg.padded_vocab_size : 50257;
    if (eps > 0) cfg.norm_epsilon = eps; /* else the header's (or 1e-5 when it has none) */
    const int given = moe->topk >= 0 || moe->pre_softmax || moe->coeff >= 0;
    if (cfg.num_experts > 0 && moe->topk < 0) {
        free(params);
        fprintf(stderr, "convert_hf: %s holds a mixture of experts (%d experts) and its header does not record the "
                "router's top-k: give --moe-router-topk K as trained (and --moe-router-pre-softmax, --moe-aux-loss-coeff "
                "if it was trained with them)\n", ckpt_dir, cfg.num_experts);
        return 2;
    }
    if (cfg.num_experts == 0 && given) {
        free(params);
        fprintf(stderr, "convert_hf: --moe-router-topk, --moe-router-pre-softmax and --moe-aux-loss-coeff go with a mixture "
                "of experts, and %s holds a dense model\n", ckpt_dir);
        return 2;
    }
    if (cfg.num_experts > 0 && moe->topk > cfg.num_experts) {
        free(params);
        fprintf(stderr, "convert_hf: --moe-router-topk %lld is more than the checkpoint's %d experts\n", (long long)moe->topk,
                cfg.num_experts);
        return 2;
    }
    if (cfg.num_experts > 0) {
        cfg.moe_router_topk = (int)moe->topk;
        cfg.moe_router_pre_softmax = moe->pre_softmax;
        cfg.moe_load_balancing = MT_MOE_AUX_LOSS;
        cfg.moe_aux_loss_coeff[0] = moe->coeff >= 0 ? moe->coeff : 0.0;
    }
    const mt_hf_arch* arch = NULL;
    mt_status st = mt_hf_arch_for_config(&cfg, &arch, &err);
    if (st == MT_OK) st = mt_hf_save(hf_dir, &cfg, params, vocab, dtype, 0, &err);
    free(params);
    if (st != MT_OK) {
        char where[600];
        snprintf(where, sizeof(where), "%s", err.message);
        mt_fail(&err, st, "exporting %s: %s", ckpt_dir, where);
        return fail(&err);
    }
    char index[4200];
    snprintf(index, sizeof(index), "%s/model.safetensors.index.json", hf_dir);
    struct stat sb;
    int sharded = stat(index, &sb) == 0; /* the export wrote an index */
    char experts[128] = "";
    if (cfg.num_experts > 0)
        snprintf(experts, sizeof(experts), ", %d experts of ffn %lld, top-%d", cfg.num_experts, (long long)mt_moe_ffn(&cfg),
                 cfg.moe_router_topk);
    printf("exported %s iteration %lld (%s: %d layers, hidden %d, %d heads, ffn %d%s, %d positions, vocab %lld of %lld "
           "padded) to %s/config.json and %s/%s (%s)\n",
           ckpt_dir, (long long)header[MT_CK_ITERATION], arch->name, cfg.num_layers, cfg.hidden_size,
           cfg.num_attention_heads, cfg.ffn_hidden_size, experts, cfg.max_position_embeddings, (long long)vocab,
           (long long)cfg.padded_vocab_size, hf_dir, hf_dir, sharded ? "model.safetensors.index.json + shards" : "model.safetensors",
           mt_st_dtype_name(dtype));
    return 0;
}

int main(int argc, char** argv) {
    argv = mt_args_split_equals(argc, argv, &argc); /* --flag=value is --flag value, as argparse */
    if (!argv) return 1;
    const char *import_dir = NULL, *save_dir = NULL, *export_dir = NULL, *out_dir = NULL;
    int64_t iteration = -1, vocab = -1;
    double eps = -1.0;
    mt_st_dtype dtype = MT_ST_F32;
    int no_verify = 0;
    moe_flags moe = {-1, 0, -1.0};
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (!strcmp(a, "--no-verify")) {
            no_verify = 1;
            continue;
        }
        if (!strcmp(a, "--moe-router-pre-softmax")) {
            moe.pre_softmax = 1;
            continue;
        }
        /* the flags below, each with a value: an unknown one is named as such, not as missing its value */
        static const char* const known[] = {"--import", "--save", "--export", "--out", "--iteration", "--vocab-size",
                                            "--norm-epsilon", "--dtype", "--moe-router-topk", "--moe-aux-loss-coeff"};
        int is_known = 0;
        for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++) is_known |= !strcmp(a, known[k]);
        if (!is_known) return bad_usage(a[0] == '-' ? "unknown flag" : "unexpected argument", a);
        if (i + 1 >= argc) return bad_usage("missing value for", a);
        const char* v = argv[++i];
        if (!strcmp(a, "--import")) import_dir = v;
        else if (!strcmp(a, "--save")) save_dir = v;
        else if (!strcmp(a, "--export")) export_dir = v;
        else if (!strcmp(a, "--out")) out_dir = v;
        else if (!strcmp(a, "--iteration")) {
            if (parse_int64(v, &iteration)) return bad_usage("--iteration needs a non-negative integer, not", v);
        } else if (!strcmp(a, "--vocab-size")) {
            if (parse_int64(v, &vocab) || vocab == 0) return bad_usage("--vocab-size needs a positive integer, not", v);
        } else if (!strcmp(a, "--norm-epsilon")) {
            char* end = NULL;
            eps = strtod(v, &end);
            if (!*v || *end || !(eps > 0 && eps < 1)) return bad_usage("--norm-epsilon needs a number in (0, 1), not", v);
        } else if (!strcmp(a, "--moe-router-topk")) {
            if (parse_int64(v, &moe.topk) || moe.topk < 1 || moe.topk > (1 << 20))
                return bad_usage("--moe-router-topk needs an integer in [1, 1048576], not", v);
        } else if (!strcmp(a, "--moe-aux-loss-coeff")) {
            char* end = NULL;
            moe.coeff = strtod(v, &end);
            if (!*v || *end || !(moe.coeff >= 0 && moe.coeff < 1e6))
                return bad_usage("--moe-aux-loss-coeff needs a number in [0, 1e6), not", v);
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "float32") || !strcmp(v, "fp32")) dtype = MT_ST_F32;
            else if (!strcmp(v, "bfloat16") || !strcmp(v, "bf16")) dtype = MT_ST_BF16;
            else return bad_usage("--dtype must be float32 or bfloat16, not", v);
        }
    }
    if (import_dir && export_dir) return bad_usage("give one of --import and --export", NULL);
    if (import_dir) {
        if (!save_dir) return bad_usage("--import needs --save CKPT_DIR", NULL);
        if (out_dir || iteration >= 0 || vocab >= 0 || eps > 0 || dtype != MT_ST_F32 || no_verify || moe.topk >= 0 ||
            moe.pre_softmax || moe.coeff >= 0)
            return bad_usage("--out, --iteration, --vocab-size, --norm-epsilon, --dtype, --no-verify and the --moe-* flags "
                             "go with --export (an import takes them from config.json)", NULL);
        return do_import(import_dir, save_dir);
    }
    if (export_dir) {
        if (!out_dir) return bad_usage("--export needs --out HF_DIR", NULL);
        if (save_dir) return bad_usage("--save goes with --import", NULL);
        return do_export(export_dir, out_dir, iteration, vocab, eps, dtype, no_verify, &moe);
    }
    return bad_usage("give --import HF_DIR --save CKPT_DIR or --export CKPT_DIR --out HF_DIR", NULL);
}
