/*
 * prepro/hf_llama.h — Hugging Face Llama (transformers' LlamaForCausalLM) <-> megatron.c: the mapping.
 * Included by prepro/hf_checkpoint.h (loading, saving, checkpoints), whose helpers it uses.
 *
 *   config.json: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
 *   num_key_value_heads (absent or null: the heads), head_dim (absent or null: hidden / heads),
 *   rms_norm_eps, max_position_embeddings, vocab_size, tie_word_embeddings (default false), and RoPE:
 *   rope_theta + rope_scaling (transformers 4) or rope_parameters {rope_theta, rope_type, ...}
 *   (transformers 5). An absent field takes LlamaConfig's default. Our model: RMSNorm, SwiGLU, rope
 *   (every channel), num_query_groups = kv heads, kv_channels = head_dim, no linear biases, output
 *   layer untied unless tie_word_embeddings. Refused, each with one line naming the value: rope
 *   scaling other than "default" or "llama3" with low_freq_factor 1, high_freq_factor 4 and
 *   original_max_position_embeddings 8192 (megatron.c's --use-rope-scaling; any factor >= 1), a
 *   partial_rotary_factor, attention_bias or mlp_bias true, hidden_act other than "silu".
 *
 *   Tensors (HF's nn.Linear weights are [out, in], as ours: nothing is transposed):
 *     model.embed_tokens.weight                [V, h]    word_embeddings [Vp, h]
 *     model.layers.{l}.self_attn.q_proj.weight [n*d, h]  qkv_weight[l] [(n + 2g) d, h], Megatron's grouped
 *     model.layers.{l}.self_attn.k_proj.weight [g*d, h]  layout: for group j, the (n/g) d q rows of heads
 *     model.layers.{l}.self_attn.v_proj.weight [g*d, h]  j(n/g) .. (j+1)(n/g)-1, then its d k rows, its d v rows
 *     model.layers.{l}.self_attn.o_proj.weight [h, n*d]  proj_weight[l]
 *     model.layers.{l}.mlp.gate_proj.weight    [f, h]    fc1_weight[l] [2f, h] = [gate; up]
 *     model.layers.{l}.mlp.up_proj.weight      [f, h]
 *     model.layers.{l}.mlp.down_proj.weight    [h, f]    fc2_weight[l]
 *     model.layers.{l}.input_layernorm.weight  [h]       ln1_weight[l]
 *     model.layers.{l}.post_attention_layernorm.weight   ln2_weight[l]
 *     model.norm.weight                        [h]       final_ln_weight
 *     lm_head.weight                           [V, h]    output_weight [Vp, h] (untied; tied: not
 *                                                        stored, or equal to the embeddings)
 *   HF's rotary embedding is rotate_half, Megatron's default (non-interleaved): q and k rows are not
 *   permuted. Older checkpoints' self_attn.rotary_emb.inv_freq buffers are skipped.
 */
/* hf_checkpoint.h first, outside this header's guard: it includes this header back (for the
 * declarations and, with MT_HF_IMPLEMENTATION, the implementation), after its own. */
#include "hf_checkpoint.h"

#ifndef MT_HF_LLAMA_H
#define MT_HF_LLAMA_H

#ifdef __cplusplus
extern "C" {
#endif

/* Whether cfg's model (of the Llama flavour) is one transformers' Llama holds: every channel rotates. */
mt_status mt_hf_llama_check(const mt_config* cfg, int64_t vocab_size, mt_error* err);
/* tensors: index 0 .. mt_hf_llama_num_tensors-1 in LlamaForCausalLM's state-dict order */
int mt_hf_llama_num_tensors(const mt_config* cfg);
void mt_hf_llama_tensor(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out);
void mt_hf_llama_export_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                               float* out);
void mt_hf_llama_import_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                               float* params);

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_LLAMA_H */

/* Outside the declarations' guard, with its own guard: see hf_checkpoint.h. */
#if defined(MT_HF_IMPLEMENTATION) && !defined(MT_HF_LLAMA_IMPLEMENTATION_DONE)
#define MT_HF_LLAMA_IMPLEMENTATION_DONE

#ifdef __cplusplus
extern "C" {
#endif

/* rope_theta (absent: theta, the class's default) and the scaling: rope_parameters (transformers 5) or
 * rope_theta + rope_scaling (4). */
static mt_status mt_hf_llama__rope(const mt_json* root, const char* path, double theta, mt_config* c, mt_error* err) {
    const mt_json* obj = mt_json_get(root, "rope_parameters");
    const char* what = "rope_parameters";
    int modern = obj && obj->type != MT_JSON_NULL;
    if (!modern) {
        what = "rope_scaling";
        obj = mt_json_get(root, what);
        if (obj && obj->type == MT_JSON_NULL) obj = NULL;
    }
    if (obj && obj->type != MT_JSON_OBJECT) return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not an object", path, what);
    double partial = 1.0;
    mt_status s = mt_hf__number_field(root, "rope_theta", theta, &c->rotary_base, path, err);
    if (s == MT_OK && modern) s = mt_hf__number_field(obj, "rope_theta", c->rotary_base, &c->rotary_base, path, err);
    if (s == MT_OK) s = mt_hf__number_field(root, "partial_rotary_factor", 1.0, &partial, path, err);
    if (s == MT_OK && obj) s = mt_hf__number_field(obj, "partial_rotary_factor", partial, &partial, path, err);
    if (s == MT_OK && partial != 1.0)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: partial_rotary_factor %g is not supported: LlamaForCausalLM rotates every "
                    "channel", path, partial);
    if (s != MT_OK || !obj) return s;
    const char* type = mt_hf__string_field(obj, "rope_type", NULL);
    if (!type) type = mt_hf__string_field(obj, "type", modern ? "default" : NULL);
    if (!type) return mt_fail(err, MT_ERR_FORMAT, "%s: rope_scaling has no \"rope_type\"", path);
    if (!strcmp(type, "default")) return MT_OK;
    static const char* const llama3 = "megatron.c's RoPE scaling is Llama 3.1's (\"llama3\" with low_freq_factor 1, "
                                      "high_freq_factor 4, original_max_position_embeddings 8192)";
    if (strcmp(type, "llama3") != 0)
        return mt_fail(err, MT_ERR_CONFIG, "%s: %s type \"%s\" is not supported: %s", path, what, type, llama3);
    static const char* const keys[4] = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
    static const double want[4] = {0.0, 1.0, 4.0, 8192.0}; /* factor: any >= 1 */
    double v[4];
    for (int k = 0; k < 4; k++) {
        if ((s = mt_hf__number_field(obj, keys[k], 0.0, &v[k], path, err)) != MT_OK) return s;
        if (k ? v[k] != want[k] : v[k] < 1.0)
            return mt_fail(err, MT_ERR_CONFIG, "%s: %s %s %g is not supported: %s", path, what, keys[k], v[k], llama3);
    }
    c->use_rope_scaling = 1;
    c->rope_scaling_factor = v[0];
    return MT_OK;
}

/* The fields the Llama family shares (LlamaForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM), an
 * absent one taking the class's default (def): shape, hidden_act "silu", no attention or MLP biases, the
 * tied head, rms_norm_eps, RoPE. Fills c (from mt_config_defaults) with the Llama flavour: RMSNorm, SwiGLU,
 * rope, GQA, no linear biases; ffn_hidden_size = intermediate_size. Not finalized. */
typedef struct {
    int64_t layers, hidden, intermediate, heads, kv_heads /* 0: = heads */, positions, vocab;
    double eps, theta;
} mt_hf_llama_defaults;

static mt_status mt_hf_llama__read_common(const mt_json* root, const char* path, const mt_hf_llama_defaults* def,
                                          mt_config* c, mt_error* err) {
    int64_t L, h, f, n, g, d, P, V;
    struct { const char* key; int64_t def; int null_ok; int64_t* out; } ints[8] = {
        {"num_hidden_layers", def->layers, 0, &L}, {"hidden_size", def->hidden, 0, &h},
        {"intermediate_size", def->intermediate, 0, &f}, {"num_attention_heads", def->heads, 0, &n},
        {"num_key_value_heads", def->kv_heads, 1, &g}, {"head_dim", 0, 1, &d},
        {"max_position_embeddings", def->positions, 0, &P}, {"vocab_size", def->vocab, 0, &V}};
    mt_status s = MT_OK;
    for (int i = 0; s == MT_OK && i < 8; i++)
        s = mt_hf__int_field(root, ints[i].key, ints[i].def, 1, i == 0 ? MT_HF_MAX_LAYERS : (int64_t)1 << (i == 7 ? 31 : 30),
                             ints[i].null_ok,
                             ints[i].out, path, err);
    if (s != MT_OK) return s;
    if (!g) g = n;
    if (!d && h % n)
        return mt_fail(err, MT_ERR_CONFIG, "%s: hidden_size %lld is not divisible by num_attention_heads %lld (and there is "
                       "no head_dim)", path, (long long)h, (long long)n);
    if (!d) d = h / n;
    if (n % g)
        return mt_fail(err, MT_ERR_CONFIG, "%s: num_attention_heads %lld is not divisible by num_key_value_heads %lld", path,
                       (long long)n, (long long)g);
    const char* act = mt_hf__string_field(root, "hidden_act", "silu");
    if (strcmp(act, "silu") != 0)
        return mt_fail(err, MT_ERR_CONFIG, "%s: hidden_act \"%s\" is not supported: megatron.c's Llama-family MLP is "
                       "SwiGLU (\"silu\")", path, act);
    static const char* const biases[2] = {"attention_bias", "mlp_bias"};
    int flag = 0, tie = 0;
    for (int k = 0; k < 2; k++) {
        if ((s = mt_hf__bool_field(root, biases[k], 0, &flag, path, err)) != MT_OK) return s;
        if (flag)
            return mt_fail(err, MT_ERR_CONFIG, "%s: %s true is not supported: megatron.c's Llama family has no linear "
                           "biases", path, biases[k]);
    }
    if ((s = mt_hf__bool_field(root, "tie_word_embeddings", 0, &tie, path, err)) != MT_OK) return s;
    mt_config_defaults(c);
    if ((s = mt_hf__number_field(root, "rms_norm_eps", def->eps, &c->norm_epsilon, path, err)) != MT_OK) return s;
    if ((s = mt_hf_llama__rope(root, path, def->theta, c, err)) != MT_OK) return s;
    c->num_layers = (int)L;
    c->hidden_size = (int)h;
    c->num_attention_heads = (int)n;
    c->num_query_groups = (int)g;
    c->kv_channels = (int)d;
    c->ffn_hidden_size = (int)f;
    c->seq_length = c->max_position_embeddings = (int)P;
    c->vocab_size = V;
    c->normalization = MT_NORM_RMSNORM;
    c->swiglu = 1;
    c->position_embedding_type = MT_POSITION_ROPE;
    c->untie_embeddings_and_output_weights = !tie;
    c->add_bias_linear = 0;
    c->make_vocab_size_divisible_by = 128;
    c->train_iters = 1;
    c->lr = 1e-4;
    c->micro_batch_size = 1;
    return MT_OK;
}

/* mt_config_finalize of an imported config, its message prefixed with config.json's path. */
static mt_status mt_hf_llama__finalize(const char* path, mt_config* c, mt_error* err) {
    mt_error inner;
    mt_status s = mt_config_finalize(c, &inner);
    return s == MT_OK ? s : mt_fail(err, s, "%s: %s", path, inner.message);
}

static mt_status mt_hf_llama__read_config(const mt_json* root, const char* path, mt_config* c, int* head_required,
                                          mt_error* err) {
    static const mt_hf_llama_defaults llama = {32, 4096, 11008, 32, 0, 2048, 32000, 1e-6, 10000.0}; /* LlamaConfig's */
    *head_required = 0;
    mt_status s = mt_hf_llama__read_common(root, path, &llama, c, err);
    return s == MT_OK ? mt_hf_llama__finalize(path, c, err) : s;
}

mt_status mt_hf_llama_check(const mt_config* c, int64_t vocab_size, mt_error* err) {
    if (c->num_layers > MT_HF_MAX_LAYERS)
        return mt_fail(err, MT_ERR_CONFIG, "%d layers: a Hugging Face checkpoint here holds at most %lld", c->num_layers,
                       (long long)MT_HF_MAX_LAYERS);
    if (c->rotary_percent != 1.0)
        return mt_fail(err, MT_ERR_CONFIG, "rotary_percent %g: transformers' Llama rotates every channel (rotary_percent 1)",
                       c->rotary_percent);
    if (vocab_size <= 0 || vocab_size > c->padded_vocab_size)
        return mt_fail(err, MT_ERR_ARG, "vocabulary size %lld outside [1, padded vocabulary %lld]", (long long)vocab_size,
                       (long long)c->padded_vocab_size);
    return MT_OK;
}

/* config.json's rms_norm_eps, rope_theta and rope_scaling values (transformers 4's form, which 5 reads too). */
static void mt_hf_llama__norm_rope_text(const mt_config* c, char eps[64], char theta[64], char scaling[400]) {
    char factor[64];
    mt_hf__double(eps, 64, c->norm_epsilon, 1);
    mt_hf__double(theta, 64, c->rotary_base, 1);
    mt_hf__double(factor, sizeof(factor), c->rope_scaling_factor, 1);
    if (c->use_rope_scaling)
        snprintf(scaling, 400,
                 "{\n    \"factor\": %s,\n    \"high_freq_factor\": 4.0,\n    \"low_freq_factor\": 1.0,\n"
                 "    \"original_max_position_embeddings\": 8192,\n    \"rope_type\": \"llama3\"\n  }", factor);
    else snprintf(scaling, 400, "null");
}

static int mt_hf_llama__write_config(FILE* f, const mt_config* c, int64_t vocab_size, const char* torch_dtype) {
    char eps[64], theta[64], scaling[400];
    mt_hf_llama__norm_rope_text(c, eps, theta, scaling);
    return fprintf(f,
                   "{\n"
                   "  \"architectures\": [\n    \"LlamaForCausalLM\"\n  ],\n"
                   "  \"attention_bias\": false,\n"
                   "  \"attention_dropout\": 0.0,\n"
                   "  \"head_dim\": %d,\n"
                   "  \"hidden_act\": \"silu\",\n"
                   "  \"hidden_size\": %d,\n"
                   "  \"initializer_range\": 0.02,\n"
                   "  \"intermediate_size\": %d,\n"
                   "  \"max_position_embeddings\": %d,\n"
                   "  \"mlp_bias\": false,\n"
                   "  \"model_type\": \"llama\",\n"
                   "  \"num_attention_heads\": %d,\n"
                   "  \"num_hidden_layers\": %d,\n"
                   "  \"num_key_value_heads\": %d,\n"
                   "  \"pretraining_tp\": 1,\n"
                   "  \"rms_norm_eps\": %s,\n"
                   "  \"rope_scaling\": %s,\n"
                   "  \"rope_theta\": %s,\n"
                   "  \"tie_word_embeddings\": %s,\n"
                   "  \"torch_dtype\": \"%s\",\n"
                   "  \"use_cache\": true,\n"
                   "  \"vocab_size\": %lld\n"
                   "}\n",
                   c->kv_channels, c->hidden_size, c->ffn_hidden_size, c->max_position_embeddings, c->num_attention_heads,
                   c->num_layers, c->num_query_groups, eps, scaling, theta,
                   c->untie_embeddings_and_output_weights ? "false" : "true", torch_dtype, (long long)vocab_size) > 0;
}

int mt_hf_llama_num_tensors(const mt_config* c) {
    return 2 + 9 * c->num_layers + (c->untie_embeddings_and_output_weights ? 1 : 0);
}

void mt_hf_llama_tensor(const mt_config* c, int64_t vocab_size, int index, mt_hf_tensor* t) {
    static const struct { const char* name; int kind, part; } layer[9] = {
        {"self_attn.q_proj.weight", MT_P_QKV_WEIGHT, 0}, {"self_attn.k_proj.weight", MT_P_QKV_WEIGHT, 1},
        {"self_attn.v_proj.weight", MT_P_QKV_WEIGHT, 2}, {"self_attn.o_proj.weight", MT_P_PROJ_WEIGHT, 0},
        {"mlp.gate_proj.weight", MT_P_FC1_WEIGHT, 0},    {"mlp.up_proj.weight", MT_P_FC1_WEIGHT, 1},
        {"mlp.down_proj.weight", MT_P_FC2_WEIGHT, 0},    {"input_layernorm.weight", MT_P_LN1_WEIGHT, 0},
        {"post_attention_layernorm.weight", MT_P_LN2_WEIGHT, 0}};
    int64_t h = c->hidden_size, f = c->ffn_hidden_size;
    int64_t nd = (int64_t)c->num_attention_heads * c->kv_channels, gd = (int64_t)c->num_query_groups * c->kv_channels;
    int L = c->num_layers;
    memset(t, 0, sizeof(*t));
    t->ndim = 2;
    t->shape[1] = h;
    if (index == 0) {
        t->kind = MT_P_WORD_EMBEDDINGS;
        snprintf(t->name, sizeof(t->name), "model.embed_tokens.weight");
        t->shape[0] = vocab_size;
    } else if (index < 1 + 9 * L) {
        int k = (index - 1) % 9;
        const int64_t rows[9] = {nd, gd, gd, h, f, f, h, h, h}, cols[9] = {h, h, h, nd, h, h, f, 0, 0};
        t->layer = (index - 1) / 9;
        t->kind = layer[k].kind;
        t->part = layer[k].part;
        snprintf(t->name, sizeof(t->name), "model.layers.%d.%s", t->layer, layer[k].name);
        t->ndim = cols[k] ? 2 : 1;
        t->shape[0] = rows[k];
        t->shape[1] = cols[k];
    } else if (index == 1 + 9 * L) {
        t->kind = MT_P_FINAL_LN_WEIGHT;
        snprintf(t->name, sizeof(t->name), "model.norm.weight");
        t->ndim = 1;
        t->shape[0] = h;
        t->shape[1] = 0;
    } else {
        t->kind = MT_P_OUTPUT_WEIGHT;
        snprintf(t->name, sizeof(t->name), "lm_head.weight");
        t->shape[0] = vocab_size;
    }
    t->numel = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1);
}

/* q, k or v: the first row of the part in [q | k | v] */
static int64_t mt_hf_llama__qkv_base(const mt_config* c, int part) {
    int64_t nd = (int64_t)c->num_attention_heads * c->kv_channels, gd = (int64_t)c->num_query_groups * c->kv_channels;
    return part == 0 ? 0 : part == 1 ? nd : nd + gd;
}

void mt_hf_llama_export_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                               float* out) {
    const float* p = params + mt_hf_param_offset(c, t->kind, t->layer);
    int64_t h = c->hidden_size;
    if (t->kind == MT_P_QKV_WEIGHT) { /* our grouped rows -> the rows of q_proj, k_proj or v_proj */
        int64_t R = ((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups) * c->kv_channels;
        int64_t base = mt_hf_llama__qkv_base(c, t->part);
        for (int64_t r = 0; r < R; r++) {
            int64_t i = mt_hf_qkv_index(c, r) - base;
            if (i >= 0 && i < t->shape[0]) memcpy(out + i * h, p + r * h, sizeof(float) * (size_t)h);
        }
    } else if (t->kind == MT_P_FC1_WEIGHT) { /* [gate; up] */
        memcpy(out, p + t->part * t->numel, sizeof(float) * (size_t)t->numel);
    } else { /* embeddings and output layer: the first V rows */
        memcpy(out, p, sizeof(float) * (size_t)t->numel);
    }
    (void)vocab_size;
}

void mt_hf_llama_import_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                               float* params) {
    float* p = params + mt_hf_param_offset(c, t->kind, t->layer);
    int64_t h = c->hidden_size;
    if (t->kind == MT_P_QKV_WEIGHT) {
        int64_t R = ((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups) * c->kv_channels;
        int64_t base = mt_hf_llama__qkv_base(c, t->part);
        for (int64_t r = 0; r < R; r++) {
            int64_t i = mt_hf_qkv_index(c, r) - base;
            if (i >= 0 && i < t->shape[0]) memcpy(p + r * h, in + i * h, sizeof(float) * (size_t)h);
        }
    } else if (t->kind == MT_P_FC1_WEIGHT) {
        memcpy(p + t->part * t->numel, in, sizeof(float) * (size_t)t->numel);
    } else if (t->kind == MT_P_WORD_EMBEDDINGS || t->kind == MT_P_OUTPUT_WEIGHT) {
        mt_hf__import_vocab_rows(c, vocab_size, in, p);
    } else {
        memcpy(p, in, sizeof(float) * (size_t)t->numel);
    }
}

/* The rotary inverse frequencies some older checkpoints saved with the weights. */
static int mt_hf_llama__is_buffer(const char* name) {
    static const char suffix[] = ".rotary_emb.inv_freq";
    size_t n = strlen(name), k = sizeof(suffix) - 1;
    return n > k && !strcmp(name + n - k, suffix);
}

const mt_hf_arch mt_hf_llama_arch = {
    "LlamaForCausalLM", "llama", "Llama", mt_hf_llama__read_config, mt_hf_llama_check, mt_hf_llama__write_config,
    mt_hf_llama_num_tensors, mt_hf_llama_tensor, mt_hf_llama_export_tensor, mt_hf_llama_import_tensor, NULL,
    mt_hf_llama__is_buffer, "config.json ties the output layer to the embeddings (tie_word_embeddings true)"};

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_IMPLEMENTATION */
