/* prepro/convert_hf.c — Hugging Face GPT-2 checkpoints <-> megatron.c checkpoints.
 *
 *   convert_hf --import HF_DIR --save CKPT_DIR
 *       reads HF_DIR/config.json (GPT2LMHeadModel) and HF_DIR/model.safetensors (or the shards of
 *       model.safetensors.index.json; F32, F16 or BF16), writes CKPT_DIR/iter_0000000/ (fp32 master
 *       weights, Adam moments zero) and CKPT_DIR/latest_checkpointed_iteration.txt, and prints the
 *       train_gpt flags of the model (load it with --load CKPT_DIR).
 *
 *   convert_hf --export CKPT_DIR --out HF_DIR [--iteration N] [--vocab-size V] [--norm-epsilon E]
 *              [--dtype float32|bfloat16]
 *       reads the checkpoint's master weights (the tracker's iteration unless --iteration) and writes
 *       HF_DIR/config.json and HF_DIR/model.safetensors, loadable with
 *       GPT2LMHeadModel.from_pretrained(HF_DIR). The padded vocabulary is cut back to V (default: 50257,
 *       or the padded size if smaller). The checkpoint does not record the LayerNorm epsilon: pass the
 *       --norm-epsilon the model was trained with (default 1e-5, train_gpt's and GPT-2's).
 *
 * The mapping (Conv1D transposes, Megatron's grouped QKV rows <-> HF's [q | k | v] columns) is in
 * prepro/hf_gpt2.h, the safetensors reader/writer in prepro/safetensors.h. Errors: one line on
 * stderr and exit 1 (bad usage: exit 2); nothing is left half-written.
 */
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "safetensors.h"
#define MT_HF_GPT2_IMPLEMENTATION
#include "hf_gpt2.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void) {
    fprintf(stderr,
            "usage: convert_hf --import HF_DIR --save CKPT_DIR\n"
            "       convert_hf --export CKPT_DIR --out HF_DIR [--iteration N] [--vocab-size V] [--norm-epsilon E]\n"
            "                  [--dtype float32|bfloat16]\n"
            "  --import HF_DIR     a transformers GPT-2 directory: config.json + model.safetensors\n"
            "                      (or model.safetensors.index.json and its shards)\n"
            "  --save CKPT_DIR     where to write the megatron.c checkpoint (iteration 0); must not hold one\n"
            "  --export CKPT_DIR   a megatron.c checkpoint directory (train_gpt --save)\n"
            "  --out HF_DIR        where to write config.json and model.safetensors\n"
            "  --iteration N       the checkpoint's iteration (default: latest_checkpointed_iteration.txt)\n"
            "  --vocab-size V      the tokenizer's vocabulary (default 50257, or the padded size if smaller)\n"
            "  --norm-epsilon E    the LayerNorm epsilon the model was trained with (default 1e-5)\n"
            "  --dtype T           float32 (default) or bfloat16 weights in model.safetensors\n");
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
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < 0) return -1;
    *out = v;
    return 0;
}

static int do_import(const char* hf_dir, const char* ckpt_dir) {
    mt_error err;
    mt_config cfg;
    mt_hf_gpt2_config hf;
    float* params = NULL;
    if (mt_hf_gpt2_load(hf_dir, &cfg, &params, &hf, &err) != MT_OK) return fail(&err);
    mt_status st = mt_hf_checkpoint_write(ckpt_dir, &cfg, params, 0, &err);
    free(params);
    if (st != MT_OK) return fail(&err);
    char eps[64];
    for (int prec = 1; prec <= 17; prec++) { /* the shortest text that reads back as the same double */
        snprintf(eps, sizeof(eps), "%.*g", prec, cfg.norm_epsilon);
        if (strtod(eps, NULL) == cfg.norm_epsilon) break;
    }
    printf("imported %s: GPT-2, %d layers, hidden %d, %d heads, ffn %d, %d positions, vocab %lld (padded %lld), "
           "%lld parameters\n",
           hf_dir, cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size,
           cfg.max_position_embeddings, (long long)cfg.vocab_size, (long long)cfg.padded_vocab_size,
           (long long)mt_num_parameters(&cfg));
    printf("wrote %s/iter_0000000/mp_rank_00/model_optim_rng.bin (iteration 0, Adam state zero)\n", ckpt_dir);
    printf("train_gpt flags for this model:\n");
    printf("  --num-layers %d --hidden-size %d --num-attention-heads %d --ffn-hidden-size %d \\\n"
           "  --seq-length %d --max-position-embeddings %d --norm-epsilon %s --make-vocab-size-divisible-by %d \\\n",
           cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.seq_length,
           cfg.max_position_embeddings, eps, cfg.make_vocab_size_divisible_by);
    if (cfg.vocab_size == 50257)
        printf("  --tokenizer-type GPT2BPETokenizer --vocab-file dev/data/gpt2/gpt2-vocab.json "
               "--merge-file dev/data/gpt2/gpt2-merges.txt \\\n");
    else
        printf("  --tokenizer-type NullTokenizer --vocab-size %lld \\\n", (long long)cfg.vocab_size);
    printf("  --load %s\n", ckpt_dir);
    printf("(--seq-length may be lowered; the other flags must stay as printed for the checkpoint to load)\n");
    return 0;
}

static int do_export(const char* ckpt_dir, const char* hf_dir, int64_t iteration, int64_t vocab, double eps,
                     mt_st_dtype dtype) {
    mt_error err;
    mt_config cfg;
    float* params = NULL;
    int64_t header[MT_CK_HEADER_WORDS];
    if (mt_hf_checkpoint_read(ckpt_dir, iteration, &cfg, &params, header, &err) != MT_OK) return fail(&err);
    if (vocab < 0) vocab = cfg.padded_vocab_size < 50257 ? cfg.padded_vocab_size : 50257;
    mt_status st = mt_hf_gpt2_check_shape(&cfg, vocab, &err);
    cfg.norm_epsilon = eps; /* not in the checkpoint */
    if (st == MT_OK) st = mt_hf_gpt2_save(hf_dir, &cfg, params, vocab, dtype, &err);
    free(params);
    if (st != MT_OK) {
        char where[600];
        snprintf(where, sizeof(where), "%s", err.message);
        mt_fail(&err, st, "exporting %s: %s", ckpt_dir, where);
        return fail(&err);
    }
    printf("exported %s iteration %lld (%d layers, hidden %d, %d heads, ffn %d, %d positions, vocab %lld of %lld "
           "padded) to %s/config.json and %s/model.safetensors (%s)\n",
           ckpt_dir, (long long)header[MT_CK_ITERATION], cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads,
           cfg.ffn_hidden_size, cfg.max_position_embeddings, (long long)vocab, (long long)cfg.padded_vocab_size, hf_dir,
           hf_dir, mt_st_dtype_name(dtype));
    return 0;
}

int main(int argc, char** argv) {
    const char *import_dir = NULL, *save_dir = NULL, *export_dir = NULL, *out_dir = NULL;
    int64_t iteration = -1, vocab = -1;
    double eps = -1.0;
    mt_st_dtype dtype = MT_ST_F32;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (i + 1 >= argc) return bad_usage(a[0] == '-' ? "missing value for" : "unexpected argument", a);
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
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "float32") || !strcmp(v, "fp32")) dtype = MT_ST_F32;
            else if (!strcmp(v, "bfloat16") || !strcmp(v, "bf16")) dtype = MT_ST_BF16;
            else return bad_usage("--dtype must be float32 or bfloat16, not", v);
        } else {
            return bad_usage("unknown flag", a);
        }
    }
    if (import_dir && export_dir) return bad_usage("give one of --import and --export", NULL);
    if (import_dir) {
        if (!save_dir) return bad_usage("--import needs --save CKPT_DIR", NULL);
        if (out_dir || iteration >= 0 || vocab >= 0 || eps > 0 || dtype != MT_ST_F32)
            return bad_usage("--out, --iteration, --vocab-size, --norm-epsilon and --dtype go with --export", NULL);
        return do_import(import_dir, save_dir);
    }
    if (export_dir) {
        if (!out_dir) return bad_usage("--export needs --out HF_DIR", NULL);
        if (save_dir) return bad_usage("--save goes with --import", NULL);
        return do_export(export_dir, out_dir, iteration, vocab, eps > 0 ? eps : 1e-5, dtype);
    }
    return bad_usage("give --import HF_DIR --save CKPT_DIR or --export CKPT_DIR --out HF_DIR", NULL);
}
