/*
 * prepro/hf_gpt2.h — Hugging Face GPT-2 (transformers' GPT2LMHeadModel) <-> megatron.c (stb style).
 *
 * Three pieces, used by prepro/convert_hf.c and tests/test_hf.h:
 *
 *   1. config.json <-> mt_config. GPT2Config's fields n_layer, n_embd, n_head, n_inner (null:
 *      4 * n_embd), n_positions, vocab_size, layer_norm_epsilon; an absent field takes GPT2Config's
 *      default, as transformers does. Models that compute something else are refused: an activation
 *      other than the tanh GELU (gelu_new, or gelu_pytorch_tanh, the same function), unscaled or
 *      layer-scaled attention, cross-attention, an output layer not tied to the embeddings.
 *
 *   2. The tensor mapping, one HF tensor at a time, both ways, exact (only copies and transposes):
 *        transformer.wte.weight        [V, h]     word_embeddings [Vp, h]: rows >= V dropped on export,
 *                                                 zero on import
 *        transformer.wpe.weight        [P, h]     position_embeddings
 *        transformer.h.{l}.ln_1.{weight,bias}     ln1_{weight,bias}[l]
 *        transformer.h.{l}.attn.c_attn.weight [h, 3h]   qkv_weight[l] [3h, h]: transposed (HF's Conv1D
 *                                                 stores [in, out], y = x W) and its output units
 *                                                 reordered: HF's columns are [q | k | v], head j of q
 *                                                 at j*d .. (j+1)*d; our rows are Megatron's grouped
 *                                                 layout, per query group g: the q rows of its heads,
 *                                                 then its k rows, then its v rows (with one group per
 *                                                 head: [q_j, k_j, v_j] for each head j)
 *        transformer.h.{l}.attn.c_attn.bias   [3h]      qkv_bias[l], the same reordering
 *        transformer.h.{l}.attn.c_proj.{weight [h, h], bias}   proj_{weight,bias}[l] (weight transposed)
 *        transformer.h.{l}.ln_2.{weight,bias}     ln2_{weight,bias}[l]
 *        transformer.h.{l}.mlp.c_fc.{weight [h, f], bias}      fc1_{weight,bias}[l] (transposed)
 *        transformer.h.{l}.mlp.c_proj.{weight [f, h], bias}    fc2_{weight,bias}[l] (transposed)
 *        transformer.ln_f.{weight,bias}           final_ln_{weight,bias}
 *      lm_head.weight is tied to transformer.wte.weight: transformers does not store it and does not
 *      miss it. Reading also accepts the names without "transformer." (GPT2Model checkpoints and the
 *      original "h.0. ..." naming) and skips the attention-mask buffers older transformers saved
 *      (".attn.bias", ".attn.masked_bias"); any other tensor is refused.
 *
 *   3. megatron.c's checkpoint, host side (megatron.cu section 9 writes and reads the same bytes):
 *      <dir>/iter_%07d/mp_rank_00/model_optim_rng.bin = 64 int64 header words, fp32 master weights
 *      [N] in canonical order (mt_param_layout), then Adam m [N] and v [N] unless the optimizer state
 *      was sharded (header word 22 > 0: master weights only); <dir>/latest_checkpointed_iteration.txt.
 *
 * Use: #define MT_HF_GPT2_IMPLEMENTATION in exactly one file, after (or together with)
 * MT_SAFETENSORS_IMPLEMENTATION for prepro/safetensors.h; needs megatron.h's implementation linked.
 */
#ifndef MT_HF_GPT2_H
#define MT_HF_GPT2_H

#include <stddef.h>
#include <stdint.h>

#include "../megatron.h"
#include "safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1. config.json */
typedef struct {
    int n_layer, n_embd, n_head, n_inner, n_positions; /* n_inner resolved (null -> 4 * n_embd) */
    int64_t vocab_size;
    double layer_norm_epsilon;
    int tie_word_embeddings;
} mt_hf_gpt2_config;

/* Reads and checks HF_DIR/config.json (model_type "gpt2", a model megatron.c computes exactly). */
mt_status mt_hf_gpt2_read_config(const char* path, mt_hf_gpt2_config* hf, mt_error* err);
/* mt_config_defaults, the model shape, seq_length = max_position_embeddings = n_positions,
 * make_vocab_size_divisible_by 128, train_iters 1, lr 1e-4, micro batch 1, then mt_config_finalize. */
mt_status mt_hf_gpt2_to_mt_config(const mt_hf_gpt2_config* hf, mt_config* cfg, mt_error* err);
/* Whether cfg's model is a GPT-2 transformers can hold (one query group per head, kv * heads == hidden). */
mt_status mt_hf_gpt2_check_shape(const mt_config* cfg, int64_t vocab_size, mt_error* err);
/* Writes a GPT2Config config.json (to path.tmp.<pid>, renamed into place). torch_dtype: "float32" ... */
mt_status mt_hf_gpt2_write_config(const char* path, const mt_config* cfg, int64_t vocab_size, const char* torch_dtype,
                                  mt_error* err);

/* 2. tensors: index 0 .. mt_hf_gpt2_num_tensors-1 in GPT2LMHeadModel's state-dict order */
typedef struct {
    int kind;          /* the MT_P_* tensor it maps to */
    int layer;         /* 0 outside the layers */
    int ndim;
    int64_t shape[2];  /* HF's shape */
    int64_t numel;
    char name[96];     /* HF's name, with the "transformer." prefix */
} mt_hf_tensor;

int mt_hf_gpt2_num_tensors(const mt_config* cfg);
void mt_hf_gpt2_tensor(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out);
/* HF tensor t from canonical parameters (out: t->numel floats). */
void mt_hf_gpt2_export_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                              float* out);
/* Canonical parameters of HF tensor t from its data (in: t->numel floats); word embeddings' rows
 * >= vocab_size are set to zero. */
void mt_hf_gpt2_import_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                              float* params);
/* The HF output column of our fused-QKV row r (Megatron's grouped layout -> [q | k | v]). */
int64_t mt_hf_gpt2_qkv_column(const mt_config* cfg, int64_t r);

/* Reads HF_DIR (config.json, then model.safetensors or model.safetensors.index.json): a finalized
 * cfg and malloc'd canonical parameters (mt_num_parameters(cfg) floats). hf may be NULL. */
mt_status mt_hf_gpt2_load(const char* hf_dir, mt_config* cfg, float** params, mt_hf_gpt2_config* hf, mt_error* err);
/* Writes HF_DIR/config.json and HF_DIR/model.safetensors (dtype F32, BF16 or F16) for vocab_size
 * <= padded vocab (mkdir -p HF_DIR). */
mt_status mt_hf_gpt2_save(const char* hf_dir, const mt_config* cfg, const float* params, int64_t vocab_size,
                          mt_st_dtype dtype, mt_error* err);

/* 3. megatron.c checkpoints (the format: megatron.h, MT_CK_*) */

/* Writes a fresh checkpoint of cfg's model at `iteration`: the master weights, Adam m = v = 0, no
 * progress (consumed samples, scheduler and Adam steps 0), loss scale 1, precision word bf16. The
 * iteration directory is written under a temporary name and renamed, the tracker last. Refuses a
 * directory that already holds a checkpoint (a tracker or this iteration). */
mt_status mt_hf_checkpoint_write(const char* dir, const mt_config* cfg, const float* params, int64_t iteration,
                                 mt_error* err);
/* Reads the master weights of the checkpoint at `iteration` (< 0: the tracker's). cfg gets the
 * model shape from the header (not finalized: vocab_size = padded_vocab_size); header gets the 64
 * words if not NULL; params is malloc'd. */
mt_status mt_hf_checkpoint_read(const char* dir, int64_t iteration, mt_config* cfg, float** params, int64_t* header,
                                mt_error* err);

#ifdef __cplusplus
}
#endif

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
#ifdef MT_HF_GPT2_IMPLEMENTATION

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1. config.json ------------------------------------------------------------------------------- */

/* An int field of config.json: absent -> def; null allowed only when null_ok (then *out = 0). */
static mt_status mt_hf__int_field(const mt_json* root, const char* key, int64_t def, int64_t lo, int64_t hi, int null_ok,
                                  int64_t* out, const char* path, mt_error* err) {
    const mt_json* v = mt_json_get(root, key);
    if (!v) { *out = def; return MT_OK; }
    if (v->type == MT_JSON_NULL && null_ok) { *out = 0; return MT_OK; }
    if (v->type != MT_JSON_NUMBER || !v->is_integer)
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not an integer", path, key);
    if (v->integer < lo || v->integer > hi)
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is %lld, outside [%lld, %lld]", path, key, (long long)v->integer,
                       (long long)lo, (long long)hi);
    *out = v->integer;
    return MT_OK;
}

/* A boolean field: absent -> def. */
static mt_status mt_hf__bool_field(const mt_json* root, const char* key, int def, int* out, const char* path, mt_error* err) {
    const mt_json* v = mt_json_get(root, key);
    if (!v) { *out = def; return MT_OK; }
    if (v->type != MT_JSON_TRUE && v->type != MT_JSON_FALSE)
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not true or false", path, key);
    *out = v->type == MT_JSON_TRUE;
    return MT_OK;
}

mt_status mt_hf_gpt2_read_config(const char* path, mt_hf_gpt2_config* hf, mt_error* err) {
    memset(hf, 0, sizeof(*hf));
    mt_json* root = NULL;
    mt_status s = mt_json_parse_file(&root, path, err);
    if (s != MT_OK) return s;
    if (root->type != MT_JSON_OBJECT) {
        mt_json_free(root);
        return mt_fail(err, MT_ERR_FORMAT, "%s: not a JSON object", path);
    }
    const mt_json* type = mt_json_get(root, "model_type");
    if (!type || type->type != MT_JSON_STRING || strcmp(type->string, "gpt2") != 0)
        s = mt_fail(err, MT_ERR_FORMAT, "%s: model_type is %s%s%s, not \"gpt2\": only GPT-2 checkpoints convert", path,
                    type && type->type == MT_JSON_STRING ? "\"" : "", type && type->type == MT_JSON_STRING ? type->string : "missing",
                    type && type->type == MT_JSON_STRING ? "\"" : "");
    int64_t v;
    const int64_t big = (int64_t)1 << 30;
    /* GPT2Config's defaults for absent fields */
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_layer", 12, 1, big, 0, &v, path, err)) == MT_OK) hf->n_layer = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_embd", 768, 1, big, 0, &v, path, err)) == MT_OK) hf->n_embd = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_head", 12, 1, big, 0, &v, path, err)) == MT_OK) hf->n_head = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_positions", 1024, 1, big, 0, &v, path, err)) == MT_OK) hf->n_positions = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_inner", 0, 1, big, 1, &v, path, err)) == MT_OK)
        hf->n_inner = v ? (int)v : 4 * hf->n_embd;
    if (s == MT_OK) s = mt_hf__int_field(root, "vocab_size", 50257, 1, (int64_t)1 << 31, 0, &hf->vocab_size, path, err);
    if (s == MT_OK) {
        const mt_json* eps = mt_json_get(root, "layer_norm_epsilon");
        hf->layer_norm_epsilon = 1e-5;
        if (eps && (eps->type != MT_JSON_NUMBER || !(eps->number > 0)))
            s = mt_fail(err, MT_ERR_FORMAT, "%s: \"layer_norm_epsilon\" is not a positive number", path);
        else if (eps) hf->layer_norm_epsilon = eps->number;
    }
    if (s == MT_OK) {
        const mt_json* act = mt_json_get(root, "activation_function");
        const char* a = act && act->type == MT_JSON_STRING ? act->string : act ? "(not a string)" : "gelu_new";
        /* gelu_new and gelu_pytorch_tanh are both 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), ours */
        if (strcmp(a, "gelu_new") != 0 && strcmp(a, "gelu_pytorch_tanh") != 0)
            s = mt_fail(err, MT_ERR_CONFIG, "%s: activation_function \"%s\" is not supported: megatron.c's GPT-2 uses the tanh "
                        "GELU (gelu_new)", path, a);
    }
    int flag = 0;
    if (s == MT_OK && (s = mt_hf__bool_field(root, "scale_attn_weights", 1, &flag, path, err)) == MT_OK && !flag)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: scale_attn_weights false is not supported (attention scores are scaled by 1/sqrt(d))", path);
    if (s == MT_OK && (s = mt_hf__bool_field(root, "scale_attn_by_inverse_layer_idx", 0, &flag, path, err)) == MT_OK && flag)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: scale_attn_by_inverse_layer_idx is not supported", path);
    if (s == MT_OK && (s = mt_hf__bool_field(root, "add_cross_attention", 0, &flag, path, err)) == MT_OK && flag)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: add_cross_attention is not supported", path);
    if (s == MT_OK) s = mt_hf__bool_field(root, "tie_word_embeddings", 1, &hf->tie_word_embeddings, path, err);
    if (s == MT_OK && hf->n_embd % hf->n_head)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: n_embd %d is not divisible by n_head %d", path, hf->n_embd, hf->n_head);
    mt_json_free(root);
    return s;
}

mt_status mt_hf_gpt2_to_mt_config(const mt_hf_gpt2_config* hf, mt_config* cfg, mt_error* err) {
    mt_config_defaults(cfg);
    cfg->num_layers = hf->n_layer;
    cfg->hidden_size = hf->n_embd;
    cfg->num_attention_heads = hf->n_head;
    cfg->ffn_hidden_size = hf->n_inner;
    cfg->seq_length = hf->n_positions;
    cfg->max_position_embeddings = hf->n_positions;
    cfg->vocab_size = hf->vocab_size;
    cfg->norm_epsilon = hf->layer_norm_epsilon;
    cfg->make_vocab_size_divisible_by = 128;
    cfg->train_iters = 1;
    cfg->lr = 1e-4;
    cfg->micro_batch_size = 1;
    return mt_config_finalize(cfg, err);
}

mt_status mt_hf_gpt2_check_shape(const mt_config* c, int64_t vocab_size, mt_error* err) {
    if (c->num_query_groups != c->num_attention_heads)
        return mt_fail(err, MT_ERR_CONFIG, "the model has %d query groups for %d heads: GPT-2 has one per head",
                       c->num_query_groups, c->num_attention_heads);
    if ((int64_t)c->kv_channels * c->num_attention_heads != c->hidden_size)
        return mt_fail(err, MT_ERR_CONFIG, "kv channels %d x %d heads != hidden size %d: GPT-2 needs them equal",
                       c->kv_channels, c->num_attention_heads, c->hidden_size);
    if (vocab_size <= 0 || vocab_size > c->padded_vocab_size)
        return mt_fail(err, MT_ERR_ARG, "vocabulary size %lld outside [1, padded vocabulary %lld]", (long long)vocab_size,
                       (long long)c->padded_vocab_size);
    return MT_OK;
}

/* The shortest decimal that reads back as the same double. */
static void mt_hf__double(char* buf, size_t cap, double x) {
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    if (!strpbrk(buf, ".eEn")) { /* keep it a float in JSON readers that care: 1 -> 1.0 */
        size_t n = strlen(buf);
        if (n + 2 < cap) memcpy(buf + n, ".0", 3);
    }
}

mt_status mt_hf_gpt2_write_config(const char* path, const mt_config* c, int64_t vocab_size, const char* torch_dtype,
                                  mt_error* err) {
    char tmp[4200], eps[64];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    FILE* f = fopen(tmp, "w");
    if (!f) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    mt_hf__double(eps, sizeof(eps), c->norm_epsilon);
    /* GPT-2's end-of-text token when the vocabulary has it; otherwise the last id (Megatron's
     * NullTokenizer puts its end-of-document there) */
    long long eos = vocab_size > 50256 ? 50256 : (long long)vocab_size - 1;
    int ok = fprintf(f,
                     "{\n"
                     "  \"activation_function\": \"gelu_new\",\n"
                     "  \"add_cross_attention\": false,\n"
                     "  \"architectures\": [\n    \"GPT2LMHeadModel\"\n  ],\n"
                     "  \"attn_pdrop\": 0.0,\n"
                     "  \"bos_token_id\": %lld,\n"
                     "  \"embd_pdrop\": 0.0,\n"
                     "  \"eos_token_id\": %lld,\n"
                     "  \"initializer_range\": 0.02,\n"
                     "  \"layer_norm_epsilon\": %s,\n"
                     "  \"model_type\": \"gpt2\",\n"
                     "  \"n_ctx\": %d,\n"
                     "  \"n_embd\": %d,\n"
                     "  \"n_head\": %d,\n"
                     "  \"n_inner\": %d,\n"
                     "  \"n_layer\": %d,\n"
                     "  \"n_positions\": %d,\n"
                     "  \"reorder_and_upcast_attn\": false,\n"
                     "  \"resid_pdrop\": 0.0,\n"
                     "  \"scale_attn_by_inverse_layer_idx\": false,\n"
                     "  \"scale_attn_weights\": true,\n"
                     "  \"summary_activation\": null,\n"
                     "  \"summary_first_dropout\": 0.1,\n"
                     "  \"summary_proj_to_labels\": true,\n"
                     "  \"summary_type\": \"cls_index\",\n"
                     "  \"summary_use_proj\": true,\n"
                     "  \"tie_word_embeddings\": true,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"use_cache\": true,\n"
                     "  \"vocab_size\": %lld\n"
                     "}\n",
                     eos, eos, eps, c->max_position_embeddings, c->hidden_size, c->num_attention_heads, c->ffn_hidden_size,
                     c->num_layers, c->max_position_embeddings, torch_dtype, (long long)vocab_size) > 0;
    int e = errno;
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) { ok = 0; e = errno; }
    if (fclose(f) != 0 && ok) { ok = 0; e = errno; }
    if (ok && rename(tmp, path) != 0) { ok = 0; e = errno; }
    if (!ok) {
        unlink(tmp);
        return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(e));
    }
    return MT_OK;
}

/* 2. tensors ----------------------------------------------------------------------------------- */

int mt_hf_gpt2_num_tensors(const mt_config* c) { return 2 + 12 * c->num_layers + 2; }

void mt_hf_gpt2_tensor(const mt_config* c, int64_t vocab_size, int index, mt_hf_tensor* t) {
    static const char* layer_names[12] = {
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
    int64_t h = c->hidden_size, f = c->ffn_hidden_size;
    int64_t qkv = (int64_t)(c->num_attention_heads + 2 * c->num_query_groups) * c->kv_channels;
    int64_t attn = (int64_t)c->num_attention_heads * c->kv_channels;
    int L = c->num_layers;
    memset(t, 0, sizeof(*t));
    if (index < 2) {
        t->kind = index == 0 ? MT_P_WORD_EMBEDDINGS : MT_P_POSITION_EMBEDDINGS;
        snprintf(t->name, sizeof(t->name), "transformer.%s.weight", index == 0 ? "wte" : "wpe");
        t->ndim = 2;
        t->shape[0] = index == 0 ? vocab_size : c->max_position_embeddings;
        t->shape[1] = h;
    } else if (index < 2 + 12 * L) {
        int k = (index - 2) % 12;
        t->layer = (index - 2) / 12;
        t->kind = MT_P_LN1_WEIGHT + k; /* HF's per-layer order is the MT_P_* order */
        snprintf(t->name, sizeof(t->name), "transformer.h.%d.%s", t->layer, layer_names[k]);
        /* Conv1D weights are [in, out] */
        int64_t shapes[12][2] = {{h, 0}, {h, 0}, {h, qkv}, {qkv, 0}, {attn, h}, {h, 0},
                                 {h, 0}, {h, 0}, {h, f},   {f, 0},   {f, h},    {h, 0}};
        t->ndim = shapes[k][1] ? 2 : 1;
        t->shape[0] = shapes[k][0];
        t->shape[1] = shapes[k][1];
    } else {
        int k = index - 2 - 12 * L;
        t->kind = k == 0 ? MT_P_FINAL_LN_WEIGHT : MT_P_FINAL_LN_BIAS;
        snprintf(t->name, sizeof(t->name), "transformer.ln_f.%s", k == 0 ? "weight" : "bias");
        t->ndim = 1;
        t->shape[0] = h;
    }
    t->numel = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1);
}

int64_t mt_hf_gpt2_qkv_column(const mt_config* c, int64_t r) {
    int64_t n = c->num_attention_heads, g = c->num_query_groups, d = c->kv_channels;
    int64_t q_rows = n / g * d, per_group = q_rows + 2 * d;
    int64_t j = r / per_group, w = r % per_group;
    if (w < q_rows) return j * q_rows + w;               /* q of the heads of group j */
    if (w < q_rows + d) return n * d + j * d + (w - q_rows); /* k of group j */
    return n * d + g * d + j * d + (w - q_rows - d);      /* v of group j */
}

/* Where (kind, layer) starts in the canonical vector, and its per-layer element count. */
static int64_t mt_hf__offset(const mt_config* c, int kind, int layer) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, info);
    int per_layer = kind >= MT_P_LN1_WEIGHT && kind <= MT_P_FC2_BIAS;
    return info[kind].offset + (per_layer ? (int64_t)layer * (info[kind].numel / c->num_layers) : 0);
}

void mt_hf_gpt2_export_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                              float* out) {
    const float* p = params + mt_hf__offset(c, t->kind, t->layer);
    switch (t->kind) {
        case MT_P_QKV_WEIGHT: { /* ours [R, h] -> HF [h, R], output units reordered */
            int64_t h = t->shape[0], R = t->shape[1];
            for (int64_t r = 0; r < R; r++) {
                int64_t col = mt_hf_gpt2_qkv_column(c, r);
                for (int64_t i = 0; i < h; i++) out[i * R + col] = p[r * h + i];
            }
            break;
        }
        case MT_P_QKV_BIAS:
            for (int64_t r = 0; r < t->numel; r++) out[mt_hf_gpt2_qkv_column(c, r)] = p[r];
            break;
        case MT_P_PROJ_WEIGHT:
        case MT_P_FC1_WEIGHT:
        case MT_P_FC2_WEIGHT: { /* ours [out, in] -> HF [in, out] */
            int64_t in = t->shape[0], o = t->shape[1];
            for (int64_t r = 0; r < o; r++)
                for (int64_t i = 0; i < in; i++) out[i * o + r] = p[r * in + i];
            break;
        }
        default: memcpy(out, p, sizeof(float) * (size_t)t->numel); /* wte: the first V rows */
    }
    (void)vocab_size;
}

void mt_hf_gpt2_import_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                              float* params) {
    float* p = params + mt_hf__offset(c, t->kind, t->layer);
    switch (t->kind) {
        case MT_P_QKV_WEIGHT: {
            int64_t h = t->shape[0], R = t->shape[1];
            for (int64_t r = 0; r < R; r++) {
                int64_t col = mt_hf_gpt2_qkv_column(c, r);
                for (int64_t i = 0; i < h; i++) p[r * h + i] = in[i * R + col];
            }
            break;
        }
        case MT_P_QKV_BIAS:
            for (int64_t r = 0; r < t->numel; r++) p[r] = in[mt_hf_gpt2_qkv_column(c, r)];
            break;
        case MT_P_PROJ_WEIGHT:
        case MT_P_FC1_WEIGHT:
        case MT_P_FC2_WEIGHT: {
            int64_t n_in = t->shape[0], o = t->shape[1];
            for (int64_t r = 0; r < o; r++)
                for (int64_t i = 0; i < n_in; i++) p[r * n_in + i] = in[i * o + r];
            break;
        }
        case MT_P_WORD_EMBEDDINGS:
            memcpy(p, in, sizeof(float) * (size_t)t->numel);
            memset(p + vocab_size * c->hidden_size, 0,
                   sizeof(float) * (size_t)((c->padded_vocab_size - vocab_size) * c->hidden_size));
            break;
        default: memcpy(p, in, sizeof(float) * (size_t)t->numel);
    }
}

/* The attention-mask buffers older transformers versions saved with the weights. */
static int mt_hf__is_mask_buffer(const char* name) {
    size_t n = strlen(name);
    return (n > 10 && !strcmp(name + n - 10, ".attn.bias")) || (n > 17 && !strcmp(name + n - 17, ".attn.masked_bias"));
}

static void mt_hf__shape(char* buf, size_t cap, int ndim, const int64_t* shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static int mt_hf__file_exists(const char* path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

mt_status mt_hf_gpt2_load(const char* hf_dir, mt_config* cfg, float** params_out, mt_hf_gpt2_config* hf_out, mt_error* err) {
    *params_out = NULL;
    char path[4200];
    mt_hf_gpt2_config hf;
    snprintf(path, sizeof(path), "%s/config.json", hf_dir);
    mt_status s = mt_hf_gpt2_read_config(path, &hf, err);
    if (s != MT_OK) return s;
    if (hf_out) *hf_out = hf;
    mt_error inner;
    s = mt_hf_gpt2_to_mt_config(&hf, cfg, &inner);
    if (s != MT_OK) return mt_fail(err, s, "%s: %s", path, inner.message);

    snprintf(path, sizeof(path), "%s/model.safetensors", hf_dir);
    if (!mt_hf__file_exists(path)) {
        snprintf(path, sizeof(path), "%s/model.safetensors.index.json", hf_dir);
        if (!mt_hf__file_exists(path))
            return mt_fail(err, MT_ERR_IO, "%s holds neither model.safetensors nor model.safetensors.index.json "
                           "(PyTorch .bin weights are not read: save with safe_serialization=True)", hf_dir);
    }
    mt_safetensors* st = NULL;
    s = mt_safetensors_open(&st, path, err);
    if (s != MT_OK) return s;

    int64_t n = mt_num_parameters(cfg), vocab = cfg->vocab_size;
    int count = mt_safetensors_count(st);
    float* params = (float*)calloc((size_t)n, sizeof(float));
    char* used = (char*)calloc((size_t)count + 1, 1);
    float* buf = NULL;
    int64_t buf_numel = 0;
    if (!params || !used) s = mt_fail(err, MT_ERR_OOM, "out of memory for %lld parameters", (long long)n);
    for (int i = 0; s == MT_OK && i < mt_hf_gpt2_num_tensors(cfg); i++) {
        mt_hf_tensor ht;
        mt_hf_gpt2_tensor(cfg, vocab, i, &ht);
        const char* bare = ht.name + strlen("transformer.");
        const mt_st_tensor* a = mt_safetensors_find(st, ht.name);
        const mt_st_tensor* b = mt_safetensors_find(st, bare);
        if (a && b) { s = mt_fail(err, MT_ERR_FORMAT, "%s holds both %s and %s", path, ht.name, bare); break; }
        const mt_st_tensor* t = a ? a : b;
        if (!t) { s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor %s is missing", path, ht.name); break; }
        used[t - mt_safetensors_at(st, 0)] = 1;
        int same = t->ndim == ht.ndim;
        for (int d = 0; same && d < ht.ndim; d++) same = t->shape[d] == ht.shape[d];
        if (!same) {
            char have[128], want[128];
            mt_hf__shape(have, sizeof(have), t->ndim, t->shape);
            mt_hf__shape(want, sizeof(want), ht.ndim, ht.shape);
            s = mt_fail(err, MT_ERR_FORMAT, "%s: tensor %s has shape %s but config.json implies %s",
                        mt_safetensors_file_path(st, t), t->name, have, want);
            break;
        }
        if (ht.numel > buf_numel) {
            free(buf);
            buf = (float*)malloc(sizeof(float) * (size_t)ht.numel);
            buf_numel = buf ? ht.numel : 0;
            if (!buf) { s = mt_fail(err, MT_ERR_OOM, "out of memory reading %s", t->name); break; }
        }
        s = mt_safetensors_read_f32(st, t, buf, err);
        if (s == MT_OK) mt_hf_gpt2_import_tensor(cfg, vocab, &ht, buf, params);
    }
    /* what else is in the file: the tied output layer, old mask buffers, or something we cannot hold */
    int has_head = 0;
    for (int i = 0; s == MT_OK && i < count; i++) {
        const mt_st_tensor* t = mt_safetensors_at(st, i);
        if (used[i] || mt_hf__is_mask_buffer(t->name)) continue;
        if (strcmp(t->name, "lm_head.weight") != 0) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: unexpected tensor %s (not part of GPT2LMHeadModel)",
                        mt_safetensors_file_path(st, t), t->name);
            break;
        }
        has_head = 1;
        /* accepted only as a copy of the word embeddings */
        int same = t->ndim == 2 && t->shape[0] == vocab && t->shape[1] == cfg->hidden_size;
        if (same && buf_numel < t->numel) {
            free(buf);
            buf = (float*)malloc(sizeof(float) * (size_t)t->numel);
            buf_numel = buf ? t->numel : 0;
            if (!buf) { s = mt_fail(err, MT_ERR_OOM, "out of memory reading %s", t->name); break; }
        }
        if (same) s = mt_safetensors_read_f32(st, t, buf, err);
        if (s == MT_OK && same) same = memcmp(buf, params, sizeof(float) * (size_t)t->numel) == 0;
        if (s == MT_OK && !same)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: lm_head.weight differs from transformer.wte.weight: untied output layers "
                        "are not supported (megatron.c's GPT-2 ties them)", mt_safetensors_file_path(st, t));
    }
    if (s == MT_OK && !hf.tie_word_embeddings && !has_head)
        s = mt_fail(err, MT_ERR_CONFIG, "%s/config.json: tie_word_embeddings is false and there is no lm_head.weight: "
                    "untied output layers are not supported", hf_dir);
    free(buf);
    free(used);
    mt_safetensors_close(st);
    if (s != MT_OK) {
        free(params);
        return s;
    }
    *params_out = params;
    return MT_OK;
}

mt_status mt_hf_gpt2_save(const char* hf_dir, const mt_config* cfg, const float* params, int64_t vocab_size,
                          mt_st_dtype dtype, mt_error* err) {
    mt_status s = mt_hf_gpt2_check_shape(cfg, vocab_size, err);
    if (s != MT_OK) return s;
    if (dtype != MT_ST_F32 && dtype != MT_ST_BF16 && dtype != MT_ST_F16)
        return mt_fail(err, MT_ERR_ARG, "export dtype %s: use F32, BF16 or F16", mt_st_dtype_name(dtype));
    if (mt_make_directories(hf_dir) != 0) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", hf_dir, strerror(errno));
    int count = mt_hf_gpt2_num_tensors(cfg);
    mt_hf_tensor* ht = (mt_hf_tensor*)malloc(sizeof(mt_hf_tensor) * (size_t)count);
    mt_st_write_tensor* wt = (mt_st_write_tensor*)calloc((size_t)count, sizeof(mt_st_write_tensor));
    int64_t total = 0;
    for (int i = 0; ht && i < count; i++) {
        mt_hf_gpt2_tensor(cfg, vocab_size, i, &ht[i]);
        total += ht[i].numel;
    }
    float* data = ht && wt ? (float*)malloc(sizeof(float) * (size_t)total) : NULL;
    if (!data) {
        free(ht);
        free(wt);
        return mt_fail(err, MT_ERR_OOM, "out of memory for %lld exported values", (long long)total);
    }
    int64_t off = 0;
    for (int i = 0; i < count; i++) {
        mt_hf_gpt2_export_tensor(cfg, vocab_size, &ht[i], params, data + off);
        wt[i].name = ht[i].name;
        wt[i].dtype = dtype;
        wt[i].ndim = ht[i].ndim;
        wt[i].shape[0] = ht[i].shape[0];
        wt[i].shape[1] = ht[i].shape[1];
        wt[i].data = data + off;
        off += ht[i].numel;
    }
    /* config.json under a temporary name first, the weights renamed into place, then the config */
    char config_path[4200], config_tmp[4300], model_path[4200];
    snprintf(config_path, sizeof(config_path), "%s/config.json", hf_dir);
    snprintf(config_tmp, sizeof(config_tmp), "%s/config.json.partial.%d", hf_dir, (int)getpid());
    snprintf(model_path, sizeof(model_path), "%s/model.safetensors", hf_dir);
    const char* torch_dtype = dtype == MT_ST_F32 ? "float32" : dtype == MT_ST_BF16 ? "bfloat16" : "float16";
    s = mt_hf_gpt2_write_config(config_tmp, cfg, vocab_size, torch_dtype, err);
    static const char* const metadata[] = {"format", "pt", NULL};
    if (s == MT_OK) s = mt_safetensors_write(model_path, wt, count, metadata, err);
    if (s == MT_OK && rename(config_tmp, config_path) != 0)
        s = mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", config_tmp, config_path, strerror(errno));
    if (s != MT_OK) unlink(config_tmp);
    free(data);
    free(wt);
    free(ht);
    return s;
}

/* 3. megatron.c checkpoints --------------------------------------------------------------------- */

static int mt_hf__write(FILE* f, const void* p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }

mt_status mt_hf_checkpoint_write(const char* dir, const mt_config* c, const float* params, int64_t iteration,
                                 mt_error* err) {
    char final_dir[4200], tmp_dir[4200], rank_dir[4300], file[4400], tracker[4200], tracker_tmp[4300];
    snprintf(final_dir, sizeof(final_dir), "%s/iter_%07lld", dir, (long long)iteration);
    snprintf(tmp_dir, sizeof(tmp_dir), "%s/.tmp_iter_%07lld.%d", dir, (long long)iteration, (int)getpid());
    snprintf(rank_dir, sizeof(rank_dir), "%s/mp_rank_00", tmp_dir);
    snprintf(file, sizeof(file), "%s/model_optim_rng.bin", rank_dir);
    snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", dir);
    snprintf(tracker_tmp, sizeof(tracker_tmp), "%s.tmp.%d", tracker, (int)getpid());
    struct stat sb;
    if (stat(tracker, &sb) == 0 || stat(final_dir, &sb) == 0)
        return mt_fail(err, MT_ERR_IO, "%s already holds a checkpoint (%s): choose an empty directory", dir,
                       stat(tracker, &sb) == 0 ? "latest_checkpointed_iteration.txt" : final_dir);
    if (mt_make_directories(dir) != 0) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    if (mkdir(tmp_dir, 0755) != 0 || mkdir(rank_dir, 0755) != 0) {
        int e = errno;
        rmdir(rank_dir);
        rmdir(tmp_dir);
        return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", rank_dir, strerror(e));
    }
    int64_t n = mt_param_layout(c, NULL);
    int64_t h[MT_CK_HEADER_WORDS];
    double scale = 1.0;
    mt_checkpoint_header_init(h, c);
    h[MT_CK_PRECISION] = MT_BF16;
    h[MT_CK_ITERATION] = iteration;
    h[MT_CK_HYSTERESIS] = c->hysteresis;
    memcpy(&h[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
    FILE* f = fopen(file, "wb");
    int bad = !f;
    int e = errno;
    if (f) {
        bad = mt_hf__write(f, h, sizeof(h)) || mt_hf__write(f, params, sizeof(float) * (size_t)n);
        enum { ZEROS = 1 << 16 };
        float* zeros = (float*)calloc(ZEROS, sizeof(float));
        bad |= !zeros;
        for (int k = 0; k < 2 && !bad; k++) /* Adam m, then v */
            for (int64_t s = 0; s < n && !bad; s += ZEROS)
                bad = mt_hf__write(f, zeros, sizeof(float) * (size_t)(n - s < ZEROS ? n - s : ZEROS));
        free(zeros);
        e = errno;
        if (fflush(f) != 0 || fsync(fileno(f)) != 0) { bad = 1; e = errno; }
        if (fclose(f) != 0 && !bad) { bad = 1; e = errno; }
    }
    if (!bad && rename(tmp_dir, final_dir) != 0) {
        e = errno;
        unlink(file);
        rmdir(rank_dir);
        rmdir(tmp_dir);
        return mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", tmp_dir, final_dir, strerror(e));
    }
    if (bad) {
        unlink(file);
        rmdir(rank_dir);
        rmdir(tmp_dir);
        return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", file, strerror(e));
    }
    FILE* tf = fopen(tracker_tmp, "w");
    bad = !tf || fprintf(tf, "%lld", (long long)iteration) < 0;
    if (tf && fclose(tf) != 0) bad = 1;
    if (bad || rename(tracker_tmp, tracker) != 0) {
        e = errno;
        unlink(tracker_tmp);
        return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", tracker, strerror(e));
    }
    return MT_OK;
}

mt_status mt_hf_checkpoint_read(const char* dir, int64_t iteration, mt_config* c, float** params_out, int64_t* header,
                                mt_error* err) {
    *params_out = NULL;
    char path[4200];
    if (iteration < 0) {
        snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt", dir);
        FILE* tf = fopen(path, "r");
        if (!tf) return mt_fail(err, MT_ERR_IO, "no checkpoint in %s (cannot open %s: %s)", dir, path, strerror(errno));
        char text[64] = {0};
        size_t k = fread(text, 1, sizeof(text) - 1, tf);
        fclose(tf);
        text[k] = 0;
        char* end = NULL;
        long long it = strtoll(text, &end, 10);
        while (end && (*end == '\n' || *end == '\r' || *end == ' ')) end++;
        if (end == text || !end || *end || it < 0)
            return mt_fail(err, MT_ERR_FORMAT, "%s does not hold an iteration number", path);
        iteration = it;
    }
    snprintf(path, sizeof(path), "%s/iter_%07lld/mp_rank_00/model_optim_rng.bin", dir, (long long)iteration);
    FILE* f = fopen(path, "rb");
    if (!f) return mt_fail(err, MT_ERR_IO, "cannot open checkpoint %s: %s", path, strerror(errno));
    struct stat sb;
    int64_t h[MT_CK_HEADER_WORDS];
    if (fstat(fileno(f), &sb) != 0 || fread(h, sizeof(int64_t), MT_CK_HEADER_WORDS, f) != MT_CK_HEADER_WORDS) {
        fclose(f);
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated (no header)", path);
    }
    mt_status s = MT_OK;
    if (h[MT_CK_MAGIC] != MT_CKPT_MAGIC || h[MT_CK_VERSION] != MT_CKPT_VERSION)
        s = mt_fail(err, MT_ERR_FORMAT, "%s is not a megatron.c checkpoint (bad magic or version)", path);
    for (int w = MT_CK_LAYERS; s == MT_OK && w <= MT_CK_POSITIONS; w++)
        if (h[w] <= 0 || h[w] > ((int64_t)1 << 31))
            s = mt_fail(err, MT_ERR_FORMAT, "%s: header word %d (model shape) is %lld", path, w, (long long)h[w]);
    if (s == MT_OK && (h[MT_CK_TP] != 1 || h[MT_CK_PP] != 1))
        s = mt_fail(err, MT_ERR_FORMAT, "%s was saved with tensor/pipeline parallel sizes %lld/%lld: only 1/1 converts",
                    path, (long long)h[MT_CK_TP], (long long)h[MT_CK_PP]);
    mt_config_defaults(c);
    c->num_layers = (int)h[MT_CK_LAYERS];
    c->hidden_size = (int)h[MT_CK_HIDDEN];
    c->num_attention_heads = (int)h[MT_CK_HEADS];
    c->num_query_groups = (int)h[MT_CK_GROUPS];
    c->kv_channels = (int)h[MT_CK_KV];
    c->ffn_hidden_size = (int)h[MT_CK_FFN];
    c->padded_vocab_size = c->vocab_size = h[MT_CK_VOCAB];
    c->max_position_embeddings = c->seq_length = (int)h[MT_CK_POSITIONS];
    int64_t n = s == MT_OK ? mt_param_layout(c, NULL) : 0;
    if (s == MT_OK && h[MT_CK_NUM_PARAMS] != n)
        s = mt_fail(err, MT_ERR_FORMAT, "%s: header says %lld parameters but its model shape has %lld", path,
                    (long long)h[MT_CK_NUM_PARAMS], (long long)n);
    int arrays = h[MT_CK_SHARDED_DP] > 0 ? 1 : 3; /* sharded optimizer state: master weights only */
    uint64_t want = sizeof(h) + (uint64_t)arrays * sizeof(float) * (uint64_t)n;
    if (s == MT_OK && h[MT_CK_SHARDED_DP] < 0)
        s = mt_fail(err, MT_ERR_FORMAT, "%s: bad sharding word %lld", path, (long long)h[MT_CK_SHARDED_DP]);
    if (s == MT_OK && (uint64_t)sb.st_size != want)
        s = mt_fail(err, MT_ERR_FORMAT, "%s is %s: %lld bytes, expected %llu", path,
                    (uint64_t)sb.st_size < want ? "truncated" : "too long", (long long)sb.st_size, (unsigned long long)want);
    float* params = NULL;
    if (s == MT_OK) {
        params = (float*)malloc(sizeof(float) * (size_t)n);
        if (!params) s = mt_fail(err, MT_ERR_OOM, "out of memory for %lld parameters", (long long)n);
        else if (fread(params, sizeof(float), (size_t)n, f) != (size_t)n)
            s = mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    }
    fclose(f);
    if (s != MT_OK) {
        free(params);
        return s;
    }
    if (header) memcpy(header, h, sizeof(h));
    *params_out = params;
    return MT_OK;
}

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_GPT2_IMPLEMENTATION */
#endif /* MT_HF_GPT2_H */
