/*
 * prepro/hf_gpt2.h — Hugging Face GPT-2 (transformers' GPT2LMHeadModel) <-> megatron.c: the mapping.
 * Included by prepro/hf_checkpoint.h (loading, saving, checkpoints), whose helpers it uses.
 *
 *   config.json: GPT2Config's fields n_layer, n_embd, n_head, n_inner (null: 4 * n_embd),
 *   n_positions, vocab_size, layer_norm_epsilon; an absent field takes GPT2Config's default, as
 *   transformers does. Models that compute something else are refused: an activation other than the
 *   tanh GELU (gelu_new, or gelu_pytorch_tanh, the same function), unscaled or layer-scaled attention,
 *   cross-attention, an output layer not tied to the embeddings.
 *
 *   Tensors, both ways, exact (only copies and transposes):
 *     transformer.wte.weight        [V, h]     word_embeddings [Vp, h]
 *     transformer.wpe.weight        [P, h]     position_embeddings
 *     transformer.h.{l}.ln_1.{weight,bias}     ln1_{weight,bias}[l]
 *     transformer.h.{l}.attn.c_attn.weight [h, 3h]   qkv_weight[l] [3h, h]: transposed (HF's Conv1D
 *                                              stores [in, out], y = x W) and its output units
 *                                              reordered: HF's columns are [q | k | v], head j of q at
 *                                              j*d .. (j+1)*d; our rows are Megatron's grouped layout
 *                                              (one group per head: [q_j, k_j, v_j] for each head j)
 *     transformer.h.{l}.attn.c_attn.bias   [3h]      qkv_bias[l], the same reordering
 *     transformer.h.{l}.attn.c_proj.{weight [h, h], bias}   proj_{weight,bias}[l] (weight transposed)
 *     transformer.h.{l}.ln_2.{weight,bias}     ln2_{weight,bias}[l]
 *     transformer.h.{l}.mlp.c_fc.{weight [h, f], bias}      fc1_{weight,bias}[l] (transposed)
 *     transformer.h.{l}.mlp.c_proj.{weight [f, h], bias}    fc2_{weight,bias}[l] (transposed)
 *     transformer.ln_f.{weight,bias}           final_ln_{weight,bias}
 *   lm_head.weight is tied to transformer.wte.weight: transformers does not store it and does not miss
 *   it. Reading also accepts the names without "transformer." (GPT2Model checkpoints and the original
 *   "h.0. ..." naming) and skips the attention-mask buffers older transformers saved (".attn.bias",
 *   ".attn.masked_bias").
 */
/* hf_checkpoint.h first, outside this header's guard: it includes this header back (for the
 * declarations and, with MT_HF_IMPLEMENTATION, the implementation), after its own. */
#include "hf_checkpoint.h"

#ifndef MT_HF_GPT2_H
#define MT_HF_GPT2_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_layer, n_embd, n_head, n_inner, n_positions; /* n_inner resolved (null -> 4 * n_embd) */
    int64_t vocab_size;
    double layer_norm_epsilon;
    int tie_word_embeddings;
} mt_hf_gpt2_config;

/* config.json's GPT2Config fields (checked: a model megatron.c computes exactly). */
mt_status mt_hf_gpt2_parse_config(const mt_json* root, const char* path, mt_hf_gpt2_config* hf, mt_error* err);
/* mt_config_defaults, the model shape, seq_length = max_position_embeddings = n_positions,
 * make_vocab_size_divisible_by 128, train_iters 1, lr 1e-4, micro batch 1, then mt_config_finalize. */
mt_status mt_hf_gpt2_to_mt_config(const mt_hf_gpt2_config* hf, mt_config* cfg, mt_error* err);
/* Whether cfg's model is a GPT-2 transformers can hold (one query group per head, kv * heads == hidden). */
mt_status mt_hf_gpt2_check_shape(const mt_config* cfg, int64_t vocab_size, mt_error* err);

/* tensors: index 0 .. mt_hf_gpt2_num_tensors-1 in GPT2LMHeadModel's state-dict order */
int mt_hf_gpt2_num_tensors(const mt_config* cfg);
void mt_hf_gpt2_tensor(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out);
void mt_hf_gpt2_export_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                              float* out);
void mt_hf_gpt2_import_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                              float* params);

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_GPT2_H */

/* Outside the declarations' guard, with its own guard: see hf_checkpoint.h. */
#if defined(MT_HF_IMPLEMENTATION) && !defined(MT_HF_GPT2_IMPLEMENTATION_DONE)
#define MT_HF_GPT2_IMPLEMENTATION_DONE

#ifdef __cplusplus
extern "C" {
#endif

mt_status mt_hf_gpt2_parse_config(const mt_json* root, const char* path, mt_hf_gpt2_config* hf, mt_error* err) {
    memset(hf, 0, sizeof(*hf));
    int64_t v;
    const int64_t big = (int64_t)1 << 30;
    mt_status s = MT_OK;
    /* GPT2Config's defaults for absent fields */
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_layer", 12, 1, MT_HF_MAX_LAYERS, 0, &v, path, err)) == MT_OK)
        hf->n_layer = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_embd", 768, 1, big, 0, &v, path, err)) == MT_OK) hf->n_embd = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_head", 12, 1, big, 0, &v, path, err)) == MT_OK) hf->n_head = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_positions", 1024, 1, big, 0, &v, path, err)) == MT_OK) hf->n_positions = (int)v;
    if (s == MT_OK && (s = mt_hf__int_field(root, "n_inner", 0, 1, big, 1, &v, path, err)) == MT_OK) {
        if (!v) v = 4 * (int64_t)hf->n_embd; /* GPT2Config's default, in 64 bits: n_embd may be up to 2^30 */
        if (v > INT32_MAX)
            s = mt_fail(err, MT_ERR_CONFIG, "%s: n_inner (4 x n_embd %d when absent) = %lld exceeds %d", path, hf->n_embd,
                        (long long)v, INT32_MAX);
        else
            hf->n_inner = (int)v;
    }
    if (s == MT_OK) s = mt_hf__int_field(root, "vocab_size", 50257, 1, (int64_t)1 << 31, 0, &hf->vocab_size, path, err);
    if (s == MT_OK) s = mt_hf__number_field(root, "layer_norm_epsilon", 1e-5, &hf->layer_norm_epsilon, path, err);
    if (s == MT_OK) {
        const char* a = mt_hf__string_field(root, "activation_function", "gelu_new");
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

static mt_status mt_hf_gpt2__read_config(const mt_json* root, const char* path, mt_config* cfg, int* head_required,
                                         mt_error* err) {
    mt_hf_gpt2_config hf;
    mt_status s = mt_hf_gpt2_parse_config(root, path, &hf, err);
    if (s != MT_OK) return s;
    *head_required = !hf.tie_word_embeddings; /* then the file's lm_head.weight must be the embeddings */
    mt_error inner;
    s = mt_hf_gpt2_to_mt_config(&hf, cfg, &inner);
    return s == MT_OK ? s : mt_fail(err, s, "%s: %s", path, inner.message);
}

mt_status mt_hf_gpt2_check_shape(const mt_config* c, int64_t vocab_size, mt_error* err) {
    if (c->num_layers > MT_HF_MAX_LAYERS)
        return mt_fail(err, MT_ERR_CONFIG, "%d layers: a Hugging Face checkpoint here holds at most %lld", c->num_layers,
                       (long long)MT_HF_MAX_LAYERS);
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

static int mt_hf_gpt2__write_config(FILE* f, const mt_config* c, int64_t vocab_size, const char* torch_dtype) {
    char eps[64];
    mt_hf__double(eps, sizeof(eps), c->norm_epsilon, 1);
    /* GPT-2's end-of-text token when the vocabulary has it; otherwise the last id (Megatron's
     * NullTokenizer puts its end-of-document there) */
    long long eos = vocab_size > 50256 ? 50256 : (long long)vocab_size - 1;
    return fprintf(f,
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
}

int mt_hf_gpt2_num_tensors(const mt_config* c) { return 2 + 12 * c->num_layers + 2; }

void mt_hf_gpt2_tensor(const mt_config* c, int64_t vocab_size, int index, mt_hf_tensor* t) {
    static const char* layer_names[12] = {
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
    int64_t h = c->hidden_size, f = c->ffn_hidden_size;
    int64_t qkv = ((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups) * c->kv_channels;
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
        static const int kinds[12] = {MT_P_LN1_WEIGHT,  MT_P_LN1_BIAS,  MT_P_QKV_WEIGHT, MT_P_QKV_BIAS,
                                      MT_P_PROJ_WEIGHT, MT_P_PROJ_BIAS, MT_P_LN2_WEIGHT, MT_P_LN2_BIAS,
                                      MT_P_FC1_WEIGHT,  MT_P_FC1_BIAS,  MT_P_FC2_WEIGHT, MT_P_FC2_BIAS};
        t->kind = kinds[k]; /* HF's per-layer order, which is the MT_P_* order of GPT-2's tensors */
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

void mt_hf_gpt2_export_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                              float* out) {
    const float* p = params + mt_hf_param_offset(c, t->kind, t->layer);
    switch (t->kind) {
        case MT_P_QKV_WEIGHT: { /* ours [R, h] -> HF [h, R], output units reordered */
            int64_t h = t->shape[0], R = t->shape[1];
            for (int64_t r = 0; r < R; r++) {
                int64_t col = mt_hf_qkv_index(c, r);
                for (int64_t i = 0; i < h; i++) out[i * R + col] = p[r * h + i];
            }
            break;
        }
        case MT_P_QKV_BIAS:
            for (int64_t r = 0; r < t->numel; r++) out[mt_hf_qkv_index(c, r)] = p[r];
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
    float* p = params + mt_hf_param_offset(c, t->kind, t->layer);
    switch (t->kind) {
        case MT_P_QKV_WEIGHT: {
            int64_t h = t->shape[0], R = t->shape[1];
            for (int64_t r = 0; r < R; r++) {
                int64_t col = mt_hf_qkv_index(c, r);
                for (int64_t i = 0; i < h; i++) p[r * h + i] = in[i * R + col];
            }
            break;
        }
        case MT_P_QKV_BIAS:
            for (int64_t r = 0; r < t->numel; r++) p[r] = in[mt_hf_qkv_index(c, r)];
            break;
        case MT_P_PROJ_WEIGHT:
        case MT_P_FC1_WEIGHT:
        case MT_P_FC2_WEIGHT: {
            int64_t n_in = t->shape[0], o = t->shape[1];
            for (int64_t r = 0; r < o; r++)
                for (int64_t i = 0; i < n_in; i++) p[r * n_in + i] = in[i * o + r];
            break;
        }
        case MT_P_WORD_EMBEDDINGS: mt_hf__import_vocab_rows(c, vocab_size, in, p); break;
        default: memcpy(p, in, sizeof(float) * (size_t)t->numel);
    }
}

/* The attention-mask buffers older transformers versions saved with the weights. */
static int mt_hf_gpt2__is_buffer(const char* name) {
    size_t n = strlen(name);
    return (n > 10 && !strcmp(name + n - 10, ".attn.bias")) || (n > 17 && !strcmp(name + n - 17, ".attn.masked_bias"));
}

const mt_hf_arch mt_hf_gpt2_arch = {
    "GPT2LMHeadModel", "gpt2", "GPT-2", mt_hf_gpt2__read_config, mt_hf_gpt2_check_shape, mt_hf_gpt2__write_config,
    mt_hf_gpt2_num_tensors, mt_hf_gpt2_tensor, mt_hf_gpt2_export_tensor, mt_hf_gpt2_import_tensor, "transformer.",
    mt_hf_gpt2__is_buffer, "untied output layers are not supported (megatron.c's GPT-2 ties them)"};

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_IMPLEMENTATION */
