/*
 * prepro/hf_moe.h — Hugging Face mixtures of experts (transformers' MixtralForCausalLM and
 * Qwen3MoeForCausalLM) <-> megatron.c: the mapping. Included by prepro/hf_checkpoint.h (loading, saving,
 * checkpoints), whose helpers it uses, after prepro/hf_llama.h, whose attention, norms, embeddings and
 * config.json fields (mt_hf_llama__read_common, mt_hf_llama__rope) these share.
 *
 *   Both are Llama's model (RMSNorm, rope, GQA, no linear biases, tied or untied head: see hf_llama.h)
 *   with every MLP a mixture of E experts of width fe (dev/moe_semantics.md): router [E, h], top-k of
 *   softmax(logits), each expert a SwiGLU MLP, no shared expert. Our config: --num-experts E,
 *   --moe-router-topk k, --moe-ffn-hidden-size fe, every layer MoE (--moe-layer-freq 1), the softmax
 *   router (Megatron's default: top-k of the logits, softmax over the k = HF's softmax over all experts,
 *   top-k, renormalised), --moe-router-load-balancing-type aux_loss with --moe-aux-loss-coeff =
 *   router_aux_loss_coef (the coefficient carried as is: HF's loss pools every layer's tokens and is k
 *   times Megatron's per-layer switch loss, so the two objectives are not the same function).
 *
 *   Mixtral (model_type "mixtral"): num_local_experts, num_experts_per_tok, intermediate_size = fe
 *   (our ffn_hidden_size too), rope_theta (default 1e6), rms_norm_eps; the top-k probabilities are
 *   always renormalised. Refused: a sliding_window, router_jitter_noise != 0, and on export
 *   --moe-router-pre-softmax (Mixtral has no such router).
 *   Qwen3-MoE (model_type "qwen3_moe"): num_experts (or num_local_experts, transformers 5's attribute
 *   name), num_experts_per_tok, moe_intermediate_size = fe, intermediate_size = our ffn_hidden_size
 *   (the dense MLP's width, unused when every layer is MoE), head_dim, q_norm / k_norm = our
 *   --qk-layernorm (RMSNorm over each head's head_dim, before rope); norm_topk_prob true is our softmax
 *   router, false --moe-router-pre-softmax (softmax over all experts, top-k, not renormalised).
 *   Refused: decoder_sparse_step other than 1 or a non-empty mlp_only_layers (dense layers: not built
 *   yet), use_sliding_window true.
 *   Both refuse attention or MLP biases, a shared expert (shared_expert_intermediate_size, Qwen2-MoE's),
 *   and on export what HF's routers cannot hold: sigmoid scores, group-limited routing, a top-k scaling
 *   factor, the expert bias, a capacity factor, seq / global aux losses, dense layers.
 *
 *   Tensors, per layer l and expert e (nn.Linear [out, in], as ours: nothing is transposed), after
 *   Llama's attention and norm tensors (the same names and mapping; Qwen3-MoE adds q_norm / k_norm):
 *     Mixtral                                        Qwen3-MoE                            ours
 *     block_sparse_moe.gate.weight [E, h]            mlp.gate.weight                      router_weight[l]
 *     block_sparse_moe.experts.{e}.w1.weight [fe, h] mlp.experts.{e}.gate_proj.weight     expert_fc1[l, e] rows 0..fe-1
 *     block_sparse_moe.experts.{e}.w3.weight [fe, h] mlp.experts.{e}.up_proj.weight       expert_fc1[l, e] rows fe..2fe-1
 *     block_sparse_moe.experts.{e}.w2.weight [h, fe] mlp.experts.{e}.down_proj.weight     expert_fc2[l, e]
 *     -                                              self_attn.q_norm.weight [d]          q_layernorm_weight[l]
 *     -                                              self_attn.k_norm.weight [d]          k_layernorm_weight[l]
 *   (each under model.layers.{l}.) This is the per-expert form transformers saves (save_pretrained, also
 *   in transformers 5 with its default save_original_format); 5's fused in-memory form (mlp.experts.
 *   gate_up_proj [E, 2fe, h]) is not read. The export writes these tensors in the classes' state-dict
 *   order and config.json with every field the class reads.
 *
 *   The checkpoint header records E, fe and the layers (MT_CK_NUM_EXPERTS ...), not the router's top-k,
 *   pre-softmax or aux coefficient: an export takes them from its caller's cfg (prepro/convert_hf's
 *   --moe-router-topk, --moe-router-pre-softmax, --moe-aux-loss-coeff).
 */
/* hf_checkpoint.h first, outside this header's guard: it includes this header back (for the
 * declarations and, with MT_HF_IMPLEMENTATION, the implementation), after its own. */
#include "hf_checkpoint.h"

#ifndef MT_HF_MOE_H
#define MT_HF_MOE_H

#ifdef __cplusplus
extern "C" {
#endif

/* Whether cfg's model (of the MoE Llama flavour) is one transformers' Mixtral / Qwen3-MoE holds. */
mt_status mt_hf_mixtral_check(const mt_config* cfg, int64_t vocab_size, mt_error* err);
mt_status mt_hf_qwen3_moe_check(const mt_config* cfg, int64_t vocab_size, mt_error* err);
/* tensors: index 0 .. num_tensors-1 in the class's state-dict order */
int mt_hf_mixtral_num_tensors(const mt_config* cfg);
int mt_hf_qwen3_moe_num_tensors(const mt_config* cfg);
void mt_hf_mixtral_tensor(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out);
void mt_hf_qwen3_moe_tensor(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out);
/* both architectures' tensors (the expert tensors; the others as Llama's) */
void mt_hf_moe_export_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                             float* out);
void mt_hf_moe_import_tensor(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                             float* params);

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_MOE_H */

/* Outside the declarations' guard, with its own guard: see hf_checkpoint.h. */
#if defined(MT_HF_IMPLEMENTATION) && !defined(MT_HF_MOE_IMPLEMENTATION_DONE)
#define MT_HF_MOE_IMPLEMENTATION_DONE

#ifdef __cplusplus
extern "C" {
#endif

/* What tells the two classes apart: the MoE module's name, the expert tensors' names (in the class's
 * order) and where they go in our fc1 (part 0 gate, 1 up) or fc2, the query and key norms. */
typedef struct {
    const char* title;
    const char* moe;         /* "block_sparse_moe" / "mlp" */
    struct { const char* name; int kind, part; } expert[3];
    int qk_norm;             /* self_attn.q_norm / k_norm */
} mt_hf_moe__kind;

static const mt_hf_moe__kind mt_hf_moe__mixtral = {
    "Mixtral", "block_sparse_moe",
    {{"w1", MT_P_EXPERT_FC1_WEIGHT, 0}, {"w2", MT_P_EXPERT_FC2_WEIGHT, 0}, {"w3", MT_P_EXPERT_FC1_WEIGHT, 1}}, 0};
static const mt_hf_moe__kind mt_hf_moe__qwen3 = {
    "Qwen3-MoE", "mlp",
    {{"gate_proj", MT_P_EXPERT_FC1_WEIGHT, 0}, {"up_proj", MT_P_EXPERT_FC1_WEIGHT, 1},
     {"down_proj", MT_P_EXPERT_FC2_WEIGHT, 0}}, 1};

/* Per layer: q, k, v, o, [q_norm, k_norm,] the router, then 3 tensors per expert, then the two norms. */
static int64_t mt_hf_moe__head(const mt_hf_moe__kind* a) { return 5 + 2 * a->qk_norm; }
static int64_t mt_hf_moe__per_layer(const mt_hf_moe__kind* a, int64_t experts) { return mt_hf_moe__head(a) + 3 * experts + 2; }
static int64_t mt_hf_moe__count(const mt_hf_moe__kind* a, int64_t layers, int64_t experts, int untied) {
    return 2 + layers * mt_hf_moe__per_layer(a, experts) + (untied ? 1 : 0);
}

/* The shape of one of our per-layer pieces as HF stores it. */
static void mt_hf_moe__shape(const mt_config* c, int kind, int part, mt_hf_tensor* t) {
    int64_t h = c->hidden_size, fe = mt_moe_ffn(c), d = c->kv_channels;
    int64_t nd = (int64_t)c->num_attention_heads * d, gd = (int64_t)c->num_query_groups * d;
    t->ndim = 2;
    t->shape[1] = h;
    switch (kind) {
        case MT_P_QKV_WEIGHT: t->shape[0] = part ? gd : nd; break;
        case MT_P_PROJ_WEIGHT: t->shape[0] = h; t->shape[1] = nd; break;
        case MT_P_ROUTER_WEIGHT: t->shape[0] = c->num_experts; break;
        case MT_P_EXPERT_FC1_WEIGHT: t->shape[0] = fe; break;
        case MT_P_EXPERT_FC2_WEIGHT: t->shape[0] = h; t->shape[1] = fe; break;
        case MT_P_Q_LAYERNORM_WEIGHT: case MT_P_K_LAYERNORM_WEIGHT: t->ndim = 1; t->shape[0] = d; t->shape[1] = 0; break;
        default: t->ndim = 1; t->shape[0] = h; t->shape[1] = 0; break; /* the two norms */
    }
}

static void mt_hf_moe__tensor(const mt_hf_moe__kind* a, const mt_config* c, int64_t vocab_size, int index,
                              mt_hf_tensor* t) {
    static const struct { const char* name; int kind, part; } head[7] = {
        {"self_attn.q_proj.weight", MT_P_QKV_WEIGHT, 0}, {"self_attn.k_proj.weight", MT_P_QKV_WEIGHT, 1},
        {"self_attn.v_proj.weight", MT_P_QKV_WEIGHT, 2}, {"self_attn.o_proj.weight", MT_P_PROJ_WEIGHT, 0},
        {"self_attn.q_norm.weight", MT_P_Q_LAYERNORM_WEIGHT, 0}, {"self_attn.k_norm.weight", MT_P_K_LAYERNORM_WEIGHT, 0},
        {NULL, MT_P_ROUTER_WEIGHT, 0}};
    static const struct { const char* name; int kind; } tail[2] = {
        {"input_layernorm.weight", MT_P_LN1_WEIGHT}, {"post_attention_layernorm.weight", MT_P_LN2_WEIGHT}};
    const int64_t E = c->num_experts, per = mt_hf_moe__per_layer(a, E), L = c->num_layers;
    memset(t, 0, sizeof(*t));
    if (index == 0 || index >= 1 + L * per) { /* embeddings, final norm, output layer: Llama's */
        int llama_index = index == 0 ? 0 : 1 + 9 * c->num_layers + (int)(index - (1 + L * per));
        mt_hf_llama_tensor(c, vocab_size, llama_index, t);
        return;
    }
    const int64_t j = (index - 1) % per, nh = mt_hf_moe__head(a);
    t->layer = (int)((index - 1) / per);
    char what[64];
    if (j < nh) {
        int k = (int)j < 4 || a->qk_norm ? (int)j : (int)j + 2; /* Mixtral skips q_norm, k_norm */
        t->kind = head[k].kind;
        t->part = head[k].part;
        if (head[k].name) snprintf(what, sizeof(what), "%s", head[k].name);
        else snprintf(what, sizeof(what), "%s.gate.weight", a->moe);
    } else if (j < nh + 3 * E) {
        int slot = (int)((j - nh) % 3);
        t->expert = (int)((j - nh) / 3);
        t->kind = a->expert[slot].kind;
        t->part = a->expert[slot].part;
        snprintf(what, sizeof(what), "%s.experts.%d.%s.weight", a->moe, t->expert, a->expert[slot].name);
    } else {
        int k = (int)(j - nh - 3 * E);
        t->kind = tail[k].kind;
        snprintf(what, sizeof(what), "%s", tail[k].name);
    }
    snprintf(t->name, sizeof(t->name), "model.layers.%d.%s", t->layer, what);
    mt_hf_moe__shape(c, t->kind, t->part, t);
    t->numel = t->shape[0] * (t->ndim == 2 ? t->shape[1] : 1);
}

int mt_hf_mixtral_num_tensors(const mt_config* c) {
    return (int)mt_hf_moe__count(&mt_hf_moe__mixtral, c->num_layers, c->num_experts, c->untie_embeddings_and_output_weights);
}
int mt_hf_qwen3_moe_num_tensors(const mt_config* c) {
    return (int)mt_hf_moe__count(&mt_hf_moe__qwen3, c->num_layers, c->num_experts, c->untie_embeddings_and_output_weights);
}
void mt_hf_mixtral_tensor(const mt_config* c, int64_t vocab_size, int index, mt_hf_tensor* t) {
    mt_hf_moe__tensor(&mt_hf_moe__mixtral, c, vocab_size, index, t);
}
void mt_hf_qwen3_moe_tensor(const mt_config* c, int64_t vocab_size, int index, mt_hf_tensor* t) {
    mt_hf_moe__tensor(&mt_hf_moe__qwen3, c, vocab_size, index, t);
}

/* Where expert tensor t's rows start in the canonical vector: expert e's [gate; up] rows of fc1
 * [E, 2fe, h] (part 1: the up rows), or its fc2 [E, h, fe]. */
static int64_t mt_hf_moe__expert_offset(const mt_config* c, const mt_hf_tensor* t) {
    const int64_t h = c->hidden_size, fe = mt_moe_ffn(c);
    const int64_t within = t->kind == MT_P_EXPERT_FC1_WEIGHT ? ((int64_t)t->expert * 2 + t->part) * fe * h
                                                             : (int64_t)t->expert * h * fe;
    return mt_hf_param_offset(c, t->kind, t->layer) + within;
}

void mt_hf_moe_export_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* params,
                             float* out) {
    if (t->kind == MT_P_EXPERT_FC1_WEIGHT || t->kind == MT_P_EXPERT_FC2_WEIGHT)
        memcpy(out, params + mt_hf_moe__expert_offset(c, t), sizeof(float) * (size_t)t->numel);
    else /* attention, norms, router (a plain copy), embeddings and output layer */
        mt_hf_llama_export_tensor(c, vocab_size, t, params, out);
}

void mt_hf_moe_import_tensor(const mt_config* c, int64_t vocab_size, const mt_hf_tensor* t, const float* in,
                             float* params) {
    if (t->kind == MT_P_EXPERT_FC1_WEIGHT || t->kind == MT_P_EXPERT_FC2_WEIGHT)
        memcpy(params + mt_hf_moe__expert_offset(c, t), in, sizeof(float) * (size_t)t->numel);
    else
        mt_hf_llama_import_tensor(c, vocab_size, t, in, params);
}

/* A non-negative number field (the aux coefficient, router_jitter_noise): absent -> def. */
static mt_status mt_hf_moe__nonneg_field(const mt_json* obj, const char* key, double def, double* out, const char* path,
                                         mt_error* err) {
    const mt_json* v = mt_json_get(obj, key);
    if (!v) { *out = def; return MT_OK; }
    if (v->type != MT_JSON_NUMBER || !(v->number >= 0) || !isfinite(v->number))
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not a non-negative number", path, key);
    *out = v->number;
    return MT_OK;
}

/* The largest expert weights a Hugging Face MoE checkpoint may have here (E * 3 fe * h * L elements):
 * keeps every size computed from config.json well inside int64. */
#define MT_HF_MOE_MAX_EXPERT_PARAMS ((int64_t)1 << 42)

/* Whether the expert sizes and the tensor count of (a, L, E, fe, h) are within bounds. */
static mt_status mt_hf_moe__sizes(const mt_hf_moe__kind* a, const char* where, int64_t L, int64_t E, int64_t fe, int64_t h,
                                  mt_error* err) {
    int64_t x = 0;
    int big = mt_mul_overflows_i64(E, 3 * fe, &x) || mt_mul_overflows_i64(x, h, &x) || mt_mul_overflows_i64(x, L, &x) ||
              x > MT_HF_MOE_MAX_EXPERT_PARAMS;
    if (big)
        return mt_fail(err, MT_ERR_CONFIG, "%s: %lld layers of %lld experts of width %lld at hidden %lld hold more than "
                       "%lld expert weights: too large to convert here", where, (long long)L, (long long)E, (long long)fe,
                       (long long)h, (long long)MT_HF_MOE_MAX_EXPERT_PARAMS);
    if (mt_hf_moe__count(a, L, E, 1) > MT_HF_MAX_TENSORS)
        return mt_fail(err, MT_ERR_CONFIG, "%s: %lld layers of %lld experts are %lld tensors: a %s checkpoint here holds "
                       "at most %lld", where, (long long)L, (long long)E, (long long)mt_hf_moe__count(a, L, E, 1), a->title,
                       (long long)MT_HF_MAX_TENSORS);
    return MT_OK;
}

/* config.json -> cfg, for either class (qwen3: Qwen3-MoE's fields and defaults, else Mixtral's). */
static mt_status mt_hf_moe__read_config(const mt_hf_moe__kind* a, const mt_json* root, const char* path, mt_config* c,
                                        int* head_required, mt_error* err) {
    static const mt_hf_llama_defaults mixtral = {32, 4096, 14336, 32, 8, 131072, 32000, 1e-5, 1e6};  /* MixtralConfig's */
    static const mt_hf_llama_defaults qwen3 = {24, 2048, 6144, 32, 4, 32768, 151936, 1e-6, 10000.0}; /* Qwen3MoeConfig's */
    const int q = a->qk_norm;
    *head_required = 0;
    mt_status s = mt_hf_llama__read_common(root, path, q ? &qwen3 : &mixtral, c, err);
    if (s != MT_OK) return s;
    int64_t E = 0, k = 0, fe = 0, other = 0, shared = 0;
    const int64_t max_experts = (int64_t)1 << 20;
    if (q) { /* Qwen3MoeConfig's num_experts; transformers 5 maps it to num_local_experts */
        const int has_a = mt_json_get(root, "num_experts") != NULL, has_b = mt_json_get(root, "num_local_experts") != NULL;
        s = mt_hf__int_field(root, "num_experts", 128, 1, max_experts, 0, &E, path, err);
        if (s == MT_OK) s = mt_hf__int_field(root, "num_local_experts", E, 1, max_experts, 0, &other, path, err);
        if (s == MT_OK && has_a && has_b && E != other)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: num_experts %lld and num_local_experts %lld disagree", path, (long long)E,
                        (long long)other);
        if (s == MT_OK && !has_a) E = other;
        if (s == MT_OK) s = mt_hf__int_field(root, "moe_intermediate_size", 768, 1, (int64_t)1 << 30, 0, &fe, path, err);
    } else {
        s = mt_hf__int_field(root, "num_local_experts", 8, 1, max_experts, 0, &E, path, err);
        fe = c->ffn_hidden_size; /* intermediate_size */
    }
    if (s == MT_OK) s = mt_hf__int_field(root, "num_experts_per_tok", q ? 8 : 2, 1, max_experts, 0, &k, path, err);
    if (s == MT_OK && k > E)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: num_experts_per_tok %lld is more than the %lld experts", path, (long long)k,
                    (long long)E);
    if (s == MT_OK) s = mt_hf__int_field(root, "shared_expert_intermediate_size", 0, 0, (int64_t)1 << 30, 1, &shared, path, err);
    if (s == MT_OK && shared > 0)
        s = mt_fail(err, MT_ERR_CONFIG, "%s: shared_expert_intermediate_size %lld: %s has no shared expert (a Qwen2-MoE "
                    "checkpoint is not supported)", path, (long long)shared, a->title);
    double coef = 0.0, jitter = 0.0;
    int flag = 0, norm_topk = 1;
    if (s == MT_OK) s = mt_hf_moe__nonneg_field(root, "router_aux_loss_coef", 0.001, &coef, path, err);
    if (s == MT_OK) s = mt_hf__bool_field(root, "output_router_logits", 0, &flag, path, err); /* HF's forward only */
    if (s != MT_OK) return s;
    /* attention over a window, and dense layers: megatron.c computes neither */
    const mt_json* window = mt_json_get(root, "sliding_window");
    if (q) {
        if ((s = mt_hf__bool_field(root, "use_sliding_window", 0, &flag, path, err)) != MT_OK) return s;
        if (flag)
            return mt_fail(err, MT_ERR_CONFIG, "%s: use_sliding_window true is not supported: megatron.c's attention is "
                           "full causal attention", path);
        int64_t step = 1;
        if ((s = mt_hf__int_field(root, "decoder_sparse_step", 1, 1, MT_HF_MAX_LAYERS, 0, &step, path, err)) != MT_OK) return s;
        if (step != 1 && step <= c->num_layers)
            return mt_fail(err, MT_ERR_CONFIG, "%s: decoder_sparse_step %lld makes the layers l with (l + 1) %% %lld != 0 "
                           "dense (Qwen3MoeMLP): MoE models with dense layers are not built yet", path, (long long)step,
                           (long long)step);
        if (step != 1)
            return mt_fail(err, MT_ERR_CONFIG, "%s: decoder_sparse_step %lld leaves every layer dense: a dense Qwen3 model "
                           "is not a Qwen3-MoE", path, (long long)step);
        const mt_json* only = mt_json_get(root, "mlp_only_layers");
        if (only && only->type != MT_JSON_NULL && only->type != MT_JSON_ARRAY)
            return mt_fail(err, MT_ERR_FORMAT, "%s: \"mlp_only_layers\" is not a list", path);
        if (only && only->type == MT_JSON_ARRAY && only->count > 0)
            return mt_fail(err, MT_ERR_CONFIG, "%s: mlp_only_layers lists %d layers with a dense MLP: MoE models with "
                           "dense layers are not built yet", path, only->count);
        if ((s = mt_hf__bool_field(root, "norm_topk_prob", 0, &norm_topk, path, err)) != MT_OK) return s;
    } else {
        if (window && window->type != MT_JSON_NULL)
            return mt_fail(err, MT_ERR_CONFIG, "%s: sliding_window %s is not supported: megatron.c's attention is full "
                           "causal attention (Mixtral's config.json has \"sliding_window\": null)", path,
                           window->type == MT_JSON_NUMBER ? "set" : "(not null)");
        if ((s = mt_hf_moe__nonneg_field(root, "router_jitter_noise", 0.0, &jitter, path, err)) != MT_OK) return s;
        if (jitter != 0.0)
            return mt_fail(err, MT_ERR_CONFIG, "%s: router_jitter_noise %g is not supported: megatron.c's router has no "
                           "jitter (Megatron's --moe-input-jitter-eps is not built)", path, jitter);
    }
    if ((s = mt_hf_moe__sizes(a, path, c->num_layers, E, fe, c->hidden_size, err)) != MT_OK) return s;
    c->num_experts = (int)E;
    c->moe_router_topk = (int)k;
    c->moe_ffn_hidden_size = (int)fe;
    c->moe_layer_freq = 1;
    c->moe_router_pre_softmax = !norm_topk;
    c->moe_load_balancing = MT_MOE_AUX_LOSS;
    c->moe_aux_loss_coeff[0] = coef;
    c->qk_layernorm = q;
    return mt_hf_llama__finalize(path, c, err);
}

static mt_status mt_hf_mixtral__read_config(const mt_json* root, const char* path, mt_config* c, int* head_required,
                                            mt_error* err) {
    return mt_hf_moe__read_config(&mt_hf_moe__mixtral, root, path, c, head_required, err);
}
static mt_status mt_hf_qwen3_moe__read_config(const mt_json* root, const char* path, mt_config* c, int* head_required,
                                              mt_error* err) {
    return mt_hf_moe__read_config(&mt_hf_moe__qwen3, root, path, c, head_required, err);
}

/* What HF's MoE block cannot compute, one line each. */
static mt_status mt_hf_moe__check(const mt_hf_moe__kind* a, const mt_config* c, int64_t vocab_size, mt_error* err) {
    mt_status s = mt_hf_llama_check(c, vocab_size, err);
    if (s != MT_OK) return s;
    const char* no = NULL;
    if (mt_moe_num_layers(c) != c->num_layers) no = "dense layers (a --moe-layer-freq that leaves some layers dense)";
    else if (c->moe_shared_expert_intermediate_size > 0) no = "a shared expert (--moe-shared-expert-intermediate-size)";
    else if (c->moe_router_score_sigmoid) no = "sigmoid router scores (--moe-router-score-function sigmoid)";
    else if (c->moe_router_num_groups > 0 || c->moe_router_group_topk > 0) no = "group-limited routing (--moe-router-num-groups)";
    else if (c->moe_router_topk_scaling_factor != 0) no = "a top-k scaling factor (--moe-router-topk-scaling-factor)";
    else if (c->moe_router_enable_expert_bias) no = "the expert bias (--moe-router-enable-expert-bias)";
    else if (c->moe_expert_capacity_factor > 0) no = "token dropping (--moe-expert-capacity-factor)";
    else if (c->moe_aux_loss_coeff[1] != 0 || c->moe_aux_loss_coeff[2] != 0)
        no = "a seq_aux_loss or global_aux_loss coefficient (its only aux loss is router_aux_loss_coef's)";
    else if (c->moe_router_pre_softmax && !a->qk_norm)
        no = "--moe-router-pre-softmax (Mixtral always renormalises the top-k probabilities; Qwen3-MoE's "
             "norm_topk_prob false is that router)";
    if (no) return mt_fail(err, MT_ERR_CONFIG, "the MoE model has %s: transformers' %s cannot hold it", no, a->title);
    return mt_hf_moe__sizes(a, "the model", c->num_layers, c->num_experts, mt_moe_ffn(c), c->hidden_size, err);
}

mt_status mt_hf_mixtral_check(const mt_config* c, int64_t vocab_size, mt_error* err) {
    return mt_hf_moe__check(&mt_hf_moe__mixtral, c, vocab_size, err);
}
mt_status mt_hf_qwen3_moe_check(const mt_config* c, int64_t vocab_size, mt_error* err) {
    return mt_hf_moe__check(&mt_hf_moe__qwen3, c, vocab_size, err);
}

/* config.json: the fields the class reads, in the order transformers writes them (sorted). */
static int mt_hf_moe__write_config(const mt_hf_moe__kind* a, FILE* f, const mt_config* c, int64_t vocab_size,
                                   const char* torch_dtype) {
    char eps[64], theta[64], scaling[400], coef[64];
    mt_hf_llama__norm_rope_text(c, eps, theta, scaling);
    mt_hf__double(coef, sizeof(coef), c->moe_load_balancing & MT_MOE_AUX_LOSS ? c->moe_aux_loss_coeff[0] : 0.0, 1);
    const char* tied = c->untie_embeddings_and_output_weights ? "false" : "true";
    const long long V = (long long)vocab_size, fe = (long long)mt_moe_ffn(c);
    if (!a->qk_norm)
        return fprintf(f,
                       "{\n"
                       "  \"architectures\": [\n    \"MixtralForCausalLM\"\n  ],\n"
                       "  \"attention_dropout\": 0.0,\n"
                       "  \"head_dim\": %d,\n"
                       "  \"hidden_act\": \"silu\",\n"
                       "  \"hidden_size\": %d,\n"
                       "  \"initializer_range\": 0.02,\n"
                       "  \"intermediate_size\": %lld,\n"
                       "  \"max_position_embeddings\": %d,\n"
                       "  \"model_type\": \"mixtral\",\n"
                       "  \"num_attention_heads\": %d,\n"
                       "  \"num_experts_per_tok\": %d,\n"
                       "  \"num_hidden_layers\": %d,\n"
                       "  \"num_key_value_heads\": %d,\n"
                       "  \"num_local_experts\": %d,\n"
                       "  \"output_router_logits\": false,\n"
                       "  \"rms_norm_eps\": %s,\n"
                       "  \"rope_scaling\": %s,\n"
                       "  \"rope_theta\": %s,\n"
                       "  \"router_aux_loss_coef\": %s,\n"
                       "  \"router_jitter_noise\": 0.0,\n"
                       "  \"sliding_window\": null,\n"
                       "  \"tie_word_embeddings\": %s,\n"
                       "  \"torch_dtype\": \"%s\",\n"
                       "  \"use_cache\": true,\n"
                       "  \"vocab_size\": %lld\n"
                       "}\n",
                       c->kv_channels, c->hidden_size, fe, c->max_position_embeddings, c->num_attention_heads,
                       c->moe_router_topk, c->num_layers, c->num_query_groups, c->num_experts, eps, scaling, theta, coef,
                       tied, torch_dtype, V) > 0;
    return fprintf(f,
                   "{\n"
                   "  \"architectures\": [\n    \"Qwen3MoeForCausalLM\"\n  ],\n"
                   "  \"attention_bias\": false,\n"
                   "  \"attention_dropout\": 0.0,\n"
                   "  \"decoder_sparse_step\": 1,\n"
                   "  \"head_dim\": %d,\n"
                   "  \"hidden_act\": \"silu\",\n"
                   "  \"hidden_size\": %d,\n"
                   "  \"initializer_range\": 0.02,\n"
                   "  \"intermediate_size\": %d,\n"
                   "  \"max_position_embeddings\": %d,\n"
                   "  \"mlp_only_layers\": [],\n"
                   "  \"model_type\": \"qwen3_moe\",\n"
                   "  \"moe_intermediate_size\": %lld,\n"
                   "  \"norm_topk_prob\": %s,\n"
                   "  \"num_attention_heads\": %d,\n"
                   "  \"num_experts\": %d,\n"
                   "  \"num_experts_per_tok\": %d,\n"
                   "  \"num_hidden_layers\": %d,\n"
                   "  \"num_key_value_heads\": %d,\n"
                   "  \"output_router_logits\": false,\n"
                   "  \"rms_norm_eps\": %s,\n"
                   "  \"rope_scaling\": %s,\n"
                   "  \"rope_theta\": %s,\n"
                   "  \"router_aux_loss_coef\": %s,\n"
                   "  \"sliding_window\": null,\n"
                   "  \"tie_word_embeddings\": %s,\n"
                   "  \"torch_dtype\": \"%s\",\n"
                   "  \"use_cache\": true,\n"
                   "  \"use_sliding_window\": false,\n"
                   "  \"vocab_size\": %lld\n"
                   "}\n",
                   c->kv_channels, c->hidden_size, c->ffn_hidden_size, c->max_position_embeddings, fe,
                   c->moe_router_pre_softmax ? "false" : "true", c->num_attention_heads, c->num_experts, c->moe_router_topk,
                   c->num_layers, c->num_query_groups, eps, scaling, theta, coef, tied, torch_dtype, V) > 0;
}

static int mt_hf_mixtral__write_config(FILE* f, const mt_config* c, int64_t vocab_size, const char* torch_dtype) {
    return mt_hf_moe__write_config(&mt_hf_moe__mixtral, f, c, vocab_size, torch_dtype);
}
static int mt_hf_qwen3_moe__write_config(FILE* f, const mt_config* c, int64_t vocab_size, const char* torch_dtype) {
    return mt_hf_moe__write_config(&mt_hf_moe__qwen3, f, c, vocab_size, torch_dtype);
}

const mt_hf_arch mt_hf_mixtral_arch = {
    "MixtralForCausalLM", "mixtral", "Mixtral", mt_hf_mixtral__read_config, mt_hf_mixtral_check,
    mt_hf_mixtral__write_config, mt_hf_mixtral_num_tensors, mt_hf_mixtral_tensor, mt_hf_moe_export_tensor,
    mt_hf_moe_import_tensor, NULL, mt_hf_llama__is_buffer,
    "config.json ties the output layer to the embeddings (tie_word_embeddings true)"};
const mt_hf_arch mt_hf_qwen3_moe_arch = {
    "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE", mt_hf_qwen3_moe__read_config, mt_hf_qwen3_moe_check,
    mt_hf_qwen3_moe__write_config, mt_hf_qwen3_moe_num_tensors, mt_hf_qwen3_moe_tensor, mt_hf_moe_export_tensor,
    mt_hf_moe_import_tensor, NULL, mt_hf_llama__is_buffer,
    "config.json ties the output layer to the embeddings (tie_word_embeddings true)"};

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_IMPLEMENTATION */
