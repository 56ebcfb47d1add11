/*
 * prepro/hf_checkpoint.h — Hugging Face checkpoints <-> megatron.c checkpoints (stb style): what the
 * architectures share. The mappings themselves are prepro/hf_gpt2.h (GPT2LMHeadModel),
 * prepro/hf_llama.h (LlamaForCausalLM) and prepro/hf_moe.h (MixtralForCausalLM, Qwen3MoeForCausalLM);
 * this header includes all three.
 *
 *   1. An architecture (mt_hf_arch) is a table: config.json -> mt_config, mt_config -> config.json,
 *      and its tensors, one HF tensor at a time both ways (mt_hf_tensor: name, shape, the MT_P_*
 *      tensor and layer it maps to). mt_hf_load detects the architecture from config.json
 *      ("model_type", else "architectures"[0]) and reads config.json and model.safetensors (or the
 *      shards of model.safetensors.index.json) strictly: every tensor of the architecture present
 *      with its shape, nothing else but known buffers and a tied lm_head.weight equal to the
 *      embeddings. mt_hf_save picks the architecture from the model's flavour (mt_hf_arch_for_config)
 *      and writes config.json and model.safetensors, or model-0000k-of-0000n.safetensors + the index
 *      when the weights pass shard_bytes. Padded vocabulary rows are dropped on export, zero on import.
 *
 *   2. megatron.c's checkpoint, host side (megatron.cu section 19 writes and reads the same bytes):
 *      <dir>/iter_%07d/mp_rank_00/model_optim_rng.bin = 64 int64 header words (megatron.h, MT_CK_*:
 *      shape, flavour, norm epsilon, true vocabulary), fp32 master weights [N] in canonical order
 *      (mt_param_layout), then Adam m [N] and v [N] unless the optimizer state was sharded
 *      (MT_CK_SHARDED_DP > 0: master weights only); <dir>/iter_%07d/manifest.txt (sizes and CRC-32C);
 *      <dir>/latest_checkpointed_iteration.txt. Reads apply megatron.h's integrity rule first
 *      (mt_checkpoint_check_integrity). Imported weights holding a NaN or an infinity are refused.
 *
 * Use: #define MT_HF_IMPLEMENTATION in exactly one file before including this header (or before
 * including it again after a declarations-only include), after (or together with)
 * MT_SAFETENSORS_IMPLEMENTATION for prepro/safetensors.h; needs megatron.h's implementation linked.
 * It includes "megatron.h" and "safetensors.h": keep them side by side (with hf_gpt2.h,
 * hf_llama.h and hf_moe.h), or put megatron.h's directory on the include path (-I). Like safetensors.h, a strict
 * -std=c99/c11 build of the implementation needs -D_POSIX_C_SOURCE=200809L (fileno). Library code
 * never prints.
 */
#ifndef MT_HF_CHECKPOINT_H
#define MT_HF_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "megatron.h"
#include "safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One HF tensor and where it lives in our canonical parameters. */
typedef struct {
    int kind;          /* the MT_P_* tensor it maps to */
    int layer;         /* 0 outside the layers */
    int part;          /* a piece of a fused tensor of ours: 0 q, 1 k, 2 v of qkv; 0 gate, 1 up of fc1 */
    int expert;        /* the expert of an expert tensor (MT_P_EXPERT_*); 0 otherwise */
    int ndim;
    int64_t shape[2];  /* HF's shape */
    int64_t numel;
    char name[96];     /* HF's name */
} mt_hf_tensor;

typedef struct mt_hf_arch mt_hf_arch;
struct mt_hf_arch {
    const char* name;       /* transformers' class: "GPT2LMHeadModel" */
    const char* model_type; /* "gpt2" */
    const char* title;      /* "GPT-2" */
    /* config.json (parsed; path for messages) -> a finalized cfg; *head_required: the weights must hold
     * an lm_head.weight (equal to the embeddings, since the model is tied) */
    mt_status (*read_config)(const mt_json* root, const char* path, mt_config* cfg, int* head_required, mt_error* err);
    /* whether the architecture holds cfg's model (of its flavour) with vocab_size tokens */
    mt_status (*check)(const mt_config* cfg, int64_t vocab_size, mt_error* err);
    /* writes config.json's text; 0 on a write error */
    int (*write_config)(FILE* f, const mt_config* cfg, int64_t vocab_size, const char* torch_dtype);
    int (*num_tensors)(const mt_config* cfg);
    void (*tensor)(const mt_config* cfg, int64_t vocab_size, int index, mt_hf_tensor* out); /* index 0: embeddings */
    /* HF tensor t from canonical parameters (out: t->numel floats) */
    void (*export_tensor)(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* params, float* out);
    /* canonical parameters of HF tensor t (in: t->numel floats); padded vocabulary rows set to zero */
    void (*import_tensor)(const mt_config* cfg, int64_t vocab_size, const mt_hf_tensor* t, const float* in, float* params);
    const char* optional_prefix;          /* names may come without it (GPT2Model's), or NULL */
    int (*is_buffer)(const char* name);   /* non-parameter tensors older versions saved: skipped */
    const char* tied_note;                /* why a differing lm_head.weight is refused */
};

extern const mt_hf_arch mt_hf_gpt2_arch;      /* prepro/hf_gpt2.h */
extern const mt_hf_arch mt_hf_llama_arch;     /* prepro/hf_llama.h */
extern const mt_hf_arch mt_hf_mixtral_arch;   /* prepro/hf_moe.h */
extern const mt_hf_arch mt_hf_qwen3_moe_arch; /* prepro/hf_moe.h */

/* The architecture of a parsed config.json: "model_type" if present ("gpt2", "llama", "mixtral",
 * "qwen3_moe"), else "architectures"[0] (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM,
 * Qwen3MoeForCausalLM); when both name one, they must agree. */
mt_status mt_hf_detect(const mt_json* root, const char* path, const mt_hf_arch** arch, mt_error* err);
/* The architecture that holds cfg's flavour: GPT-2 (LayerNorm, GELU, learned positions, tied, biases),
 * Llama (RMSNorm, SwiGLU, RoPE, no linear biases, tied or not), and with experts in every layer
 * (--num-experts) the same Llama flavour as Mixtral, or with --qk-layernorm as Qwen3-MoE; any other mix
 * is refused. */
mt_status mt_hf_arch_for_config(const mt_config* cfg, const mt_hf_arch** arch, mt_error* err);

/* Reads HF_DIR: a finalized cfg (vocab_size = the true vocabulary) and malloc'd canonical parameters
 * (mt_num_parameters(cfg) floats). arch may be NULL. */
mt_status mt_hf_load(const char* hf_dir, mt_config* cfg, float** params, const mt_hf_arch** arch, mt_error* err);
/* Writes HF_DIR/config.json and the weights (dtype F32, BF16 or F16) for vocab_size <= padded vocab
 * (mkdir -p HF_DIR): one model.safetensors, or shards of at most shard_bytes (0: 5 GB) each + index.
 * Committed as a set: every file under a temporary name first, then the old config.json removed,
 * the weights renamed into place and config.json last (other files in HF_DIR are kept). */
#define MT_HF_SHARD_BYTES ((int64_t)5000000000)
/* The most transformer layers a Hugging Face checkpoint may have here: at most 16 tensors a layer keeps
 * every tensor count and index an int (config.json's n_layer / num_hidden_layers and exports alike).
 * The MoE architectures, with 3 tensors an expert, bound the count itself (MT_HF_MAX_TENSORS). */
#define MT_HF_MAX_LAYERS ((int64_t)1 << 26)
#define MT_HF_MAX_TENSORS ((int64_t)1 << 30)
mt_status mt_hf_save(const char* hf_dir, const mt_config* cfg, const float* params, int64_t vocab_size,
                     mt_st_dtype dtype, int64_t shard_bytes, mt_error* err);

/* Index into the concatenation [q | k | v] (q: heads * kv rows, head j at j*kv; k, v: groups * kv)
 * of our fused-QKV row r (Megatron's grouped layout: per query group, its heads' q rows, its k rows,
 * its v rows). */
int64_t mt_hf_qkv_index(const mt_config* cfg, int64_t r);
/* Where (kind, layer) starts in the canonical vector: a per-layer tensor is stacked over the layers that
 * have it (mt_param_layer_has: the MoE tensors over the MoE layers), `layer` being the model's layer. */
int64_t mt_hf_param_offset(const mt_config* cfg, int kind, int layer);

/* Writes a fresh checkpoint of cfg's model at `iteration`: the header (mt_checkpoint_header_init: shape,
 * flavour, norm epsilon, true vocabulary; the manifest mark), the master weights, Adam m = v = 0, no
 * progress, loss scale 1, precision word bf16, and its manifest (the file's CRC-32C taken as it is
 * written). The iteration directory is written under a temporary name and renamed, the tracker last.
 * Refuses a directory that already holds a checkpoint (a tracker); an iteration directory without a
 * tracker (an interrupted run's) is not a checkpoint and is replaced. */
mt_status mt_hf_checkpoint_write(const char* dir, const mt_config* cfg, const float* params, int64_t iteration,
                                 mt_error* err);
/* Reads the master weights of the checkpoint at `iteration` (< 0: the tracker's), after megatron.h's
 * integrity rule (mt_checkpoint_select without a fallback: a refused checkpoint is the error; with
 * no_verify a warning, into *warning, which may be NULL; "" when there is nothing to say). cfg gets
 * the model from the header (mt_config_from_checkpoint_header; not finalized: vocab_size =
 * padded_vocab_size, the true one is header[MT_CK_TRUE_VOCAB]); header gets the 64 words if not NULL;
 * params is malloc'd. */
mt_status mt_hf_checkpoint_read(const char* dir, int64_t iteration, int no_verify, mt_config* cfg, float** params,
                                int64_t* header, mt_error* warning, mt_error* err);

#ifdef __cplusplus
}
#endif

#endif /* MT_HF_CHECKPOINT_H */

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
/* Outside the declarations' guard (so the implementation may follow a declarations-only include),
 * with its own guard (so it appears once however often the header is included). */
#if defined(MT_HF_IMPLEMENTATION) && !defined(MT_HF_CHECKPOINT_IMPLEMENTATION_DONE)
#define MT_HF_CHECKPOINT_IMPLEMENTATION_DONE

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

/* config.json fields (used by the mappings too) ------------------------------------------------- */

/* An int field: absent -> def; null allowed only when null_ok (then *out = 0). */
static mt_status mt_hf__int_field(const mt_json* obj, const char* key, int64_t def, int64_t lo, int64_t hi, int null_ok,
                                  int64_t* out, const char* path, mt_error* err) {
    const mt_json* v = mt_json_get(obj, key);
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

/* A positive number field: absent -> def (a def <= 0 means required). */
static mt_status mt_hf__number_field(const mt_json* obj, const char* key, double def, double* out, const char* path,
                                     mt_error* err) {
    const mt_json* v = mt_json_get(obj, key);
    if (!v && def > 0) { *out = def; return MT_OK; }
    if (!v) return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is missing", path, key);
    if (v->type != MT_JSON_NUMBER || !(v->number > 0))
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not a positive number", path, key);
    *out = v->number;
    return MT_OK;
}

/* A boolean field: absent -> def. */
static mt_status mt_hf__bool_field(const mt_json* obj, const char* key, int def, int* out, const char* path, mt_error* err) {
    const mt_json* v = mt_json_get(obj, key);
    if (!v) { *out = def; return MT_OK; }
    if (v->type != MT_JSON_TRUE && v->type != MT_JSON_FALSE)
        return mt_fail(err, MT_ERR_FORMAT, "%s: \"%s\" is not true or false", path, key);
    *out = v->type == MT_JSON_TRUE;
    return MT_OK;
}

/* A string field's text; absent -> def; not a string -> "(not a string)". */
static const char* mt_hf__string_field(const mt_json* obj, const char* key, const char* def) {
    const mt_json* v = mt_json_get(obj, key);
    return !v ? def : v->type == MT_JSON_STRING ? v->string : "(not a string)";
}

/* The shortest decimal that reads back as the same double; json: keep it a float (1 -> 1.0). */
static void mt_hf__double(char* buf, size_t cap, double x, int json) {
    if (json && x == floor(x) && fabs(x) < 1e15) { /* 500000.0, not 5e+05 */
        snprintf(buf, cap, "%.1f", x);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    if (json && !strpbrk(buf, ".eEn")) {
        size_t n = strlen(buf);
        if (n + 2 < cap) memcpy(buf + n, ".0", 3);
    }
}

/* architecture -------------------------------------------------------------------------------- */

mt_status mt_hf_detect(const mt_json* root, const char* path, const mt_hf_arch** out, mt_error* err) {
    static const mt_hf_arch* const archs[] = {&mt_hf_gpt2_arch, &mt_hf_llama_arch, &mt_hf_mixtral_arch,
                                              &mt_hf_qwen3_moe_arch};
    const mt_json* type = mt_json_get(root, "model_type");
    const mt_json* list = mt_json_get(root, "architectures");
    const char* t = type && type->type == MT_JSON_STRING ? type->string : NULL;
    const char* a = list && list->type == MT_JSON_ARRAY && list->count > 0 && list->items[0].type == MT_JSON_STRING
                        ? list->items[0].string : NULL;
    const mt_hf_arch *by_type = NULL, *by_name = NULL;
    for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++) {
        if (t && !strcmp(t, archs[i]->model_type)) by_type = archs[i];
        if (a && !strcmp(a, archs[i]->name)) by_name = archs[i];
    }
    if (type && !t) return mt_fail(err, MT_ERR_FORMAT, "%s: \"model_type\" is not a string", path);
    *out = t ? by_type : by_name; /* model_type decides; architectures[0] when there is none */
    if (*out && by_name && by_name != *out)
        return mt_fail(err, MT_ERR_FORMAT, "%s: model_type \"%s\" and architectures[0] \"%s\" disagree", path, t, a);
    if (*out) return MT_OK;
    return mt_fail(err, MT_ERR_FORMAT, "%s: model_type %s%s%s%s%s%s is not supported: only GPT-2 (GPT2LMHeadModel, "
                   "model_type \"gpt2\"), Llama (LlamaForCausalLM, \"llama\"), Mixtral (MixtralForCausalLM, \"mixtral\") "
                   "and Qwen3-MoE (Qwen3MoeForCausalLM, \"qwen3_moe\") checkpoints convert", path,
                   t ? "\"" : "", t ? t : "missing", t ? "\"" : "", a ? " (architectures[0] \"" : "", a ? a : "",
                   a ? "\")" : "");
}

mt_status mt_hf_arch_for_config(const mt_config* c, const mt_hf_arch** out, mt_error* err) {
    int ln = c->normalization == MT_NORM_LAYERNORM, learned = c->position_embedding_type == MT_POSITION_LEARNED;
    int rope = c->position_embedding_type == MT_POSITION_ROPE; /* NoPE (none) has no Hugging Face counterpart here */
    int bias = c->add_bias_linear != 0, untied = c->untie_embeddings_and_output_weights != 0, glu = c->swiglu != 0;
    *out = NULL;
    if (c->apply_layernorm_1p)
        return mt_fail(err, MT_ERR_CONFIG, "the model stores its norm weights as w - 1 (--apply-layernorm-1p): "
                       "export to Hugging Face is not implemented for it");
    if (c->squared_relu)
        return mt_fail(err, MT_ERR_CONFIG, "the model's MLP uses squared ReLU (--squared-relu): neither GPT-2 nor Llama "
                       "in transformers has that activation, so it cannot be exported to them");
    if (c->num_experts > 0) { /* mixture of experts: Mixtral, or Qwen3-MoE with the query and key norms */
        if (ln || !rope || bias || !glu)
            return mt_fail(err, MT_ERR_CONFIG, "the MoE model (%s, %s, %s positions, %s linear biases) is not a Mixtral "
                           "or Qwen3-MoE (RMSNorm, SwiGLU experts, rope, no biases): transformers has no class to export "
                           "it to", ln ? "LayerNorm" : "RMSNorm", glu ? "SwiGLU" : "GELU",
                           learned ? "learned" : rope ? "rope" : "no", bias ? "with" : "no");
        if (mt_moe_num_layers(c) < c->num_layers)
            return mt_fail(err, MT_ERR_CONFIG, "the MoE model has dense layers (--moe-layer-freq marks %d of %d layers "
                           "MoE): exporting them (Qwen3-MoE's mlp_only_layers) is not built yet", mt_moe_num_layers(c),
                           c->num_layers);
        *out = c->qk_layernorm ? &mt_hf_qwen3_moe_arch : &mt_hf_mixtral_arch;
        return MT_OK;
    }
    if (c->qk_layernorm)
        return mt_fail(err, MT_ERR_CONFIG, "the model normalises its queries and keys (--qk-layernorm): neither GPT-2 "
                       "nor Llama in transformers has those norms, so it cannot be exported to them (with experts it "
                       "would be a Qwen3-MoE)");
    if (ln && learned && bias && !glu && !untied) *out = &mt_hf_gpt2_arch;
    else if (!ln && rope && !bias && glu) *out = &mt_hf_llama_arch;
    else
        return mt_fail(err, MT_ERR_CONFIG, "the model (%s, %s, %s positions, %s output layer, %s linear biases) is neither "
                       "GPT-2 (LayerNorm, GELU, learned positions, tied, biases) nor Llama (RMSNorm, SwiGLU, rope, no "
                       "biases): transformers has no class to export it to", ln ? "LayerNorm" : "RMSNorm",
                       glu ? "SwiGLU" : "GELU", learned ? "learned" : rope ? "rope" : "no", untied ? "untied" : "tied",
                       bias ? "with" : "no");
    return MT_OK;
}

int64_t mt_hf_qkv_index(const mt_config* c, int64_t r) {
    int64_t n = c->num_attention_heads, g = c->num_query_groups, d = c->kv_channels;
    int64_t q_rows = n / g * d, per_group = q_rows + 2 * d;
    int64_t j = r / per_group, w = r % per_group;
    if (w < q_rows) return j * q_rows + w;                   /* q of the heads of group j */
    if (w < q_rows + d) return n * d + j * d + (w - q_rows); /* k of group j */
    return n * d + g * d + j * d + (w - q_rows - d);         /* v of group j */
}

int64_t mt_hf_param_offset(const mt_config* c, int kind, int layer) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, info);
    if (!mt_param_per_layer(kind)) return info[kind].offset;
    int64_t holders = 0, before = 0; /* the layers stacked in the tensor, and those of them before `layer` */
    for (int l = 0; l < c->num_layers; l++)
        if (mt_param_layer_has(c, kind, l)) {
            holders++;
            before += l < layer;
        }
    return info[kind].offset + (holders ? before * (info[kind].numel / holders) : 0);
}

/* word embeddings / output layer: the first V rows; on import the padded rows are zeroed */
static void mt_hf__import_vocab_rows(const mt_config* c, int64_t vocab_size, const float* in, float* p) {
    memcpy(p, in, sizeof(float) * (size_t)(vocab_size * c->hidden_size));
    memset(p + vocab_size * c->hidden_size, 0,
           sizeof(float) * (size_t)((c->padded_vocab_size - vocab_size) * c->hidden_size));
}

/* loading ------------------------------------------------------------------------------------- */

static void mt_hf__shape(char* buf, size_t cap, int ndim, const int64_t* shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++) n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static int mt_hf__file_exists(const char* path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* t's data as floats in *buf (grown as needed): every tensor an import reads comes through here, and
 * a NaN or an infinity in it is refused naming the file, the tensor and the first such element (a
 * model that holds one cannot train or evaluate; it would surface only as a NaN loss later). */
static mt_status mt_hf__read(const mt_safetensors* st, const mt_st_tensor* t, float** buf, int64_t* cap, mt_error* err) {
    if (t->numel > *cap) {
        free(*buf);
        *buf = (float*)malloc(sizeof(float) * (size_t)t->numel);
        *cap = *buf ? t->numel : 0;
        if (!*buf) return mt_fail(err, MT_ERR_OOM, "out of memory reading %s", t->name);
    }
    mt_status s = mt_safetensors_read_f32(st, t, *buf, err);
    for (int64_t i = 0; s == MT_OK && i < t->numel; i++)
        if (!isfinite((*buf)[i]))
            return mt_fail(err, MT_ERR_FORMAT, "%s: tensor %s holds %s at index %lld", mt_safetensors_file_path(st, t),
                           t->name, isnan((*buf)[i]) ? "NaN" : (*buf)[i] > 0 ? "Inf" : "-Inf", (long long)i);
    return s;
}

mt_status mt_hf_load(const char* hf_dir, mt_config* cfg, float** params_out, const mt_hf_arch** arch_out, mt_error* err) {
    *params_out = NULL;
    char path[4200];
    snprintf(path, sizeof(path), "%s/config.json", hf_dir);
    mt_json* root = NULL;
    mt_status s = mt_json_parse_file(&root, path, err);
    if (s != MT_OK) return s;
    const mt_hf_arch* arch = NULL;
    int head_required = 0;
    if (root->type != MT_JSON_OBJECT) s = mt_fail(err, MT_ERR_FORMAT, "%s: not a JSON object", path);
    if (s == MT_OK) s = mt_hf_detect(root, path, &arch, err);
    if (s == MT_OK) s = arch->read_config(root, path, cfg, &head_required, err);
    mt_json_free(root);
    if (s != MT_OK) return s;
    if (arch_out) *arch_out = arch;

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
    size_t prefix = arch->optional_prefix ? strlen(arch->optional_prefix) : 0;
    float* params = (float*)calloc((size_t)n, sizeof(float));
    char* used = (char*)calloc((size_t)count + 1, 1);
    float* buf = NULL;
    int64_t buf_numel = 0;
    mt_hf_tensor ht;
    if (!params || !used) s = mt_fail(err, MT_ERR_OOM, "out of memory for %lld parameters", (long long)n);
    for (int i = 0; s == MT_OK && i < arch->num_tensors(cfg); i++) {
        arch->tensor(cfg, vocab, i, &ht);
        const mt_st_tensor* a = mt_safetensors_find(st, ht.name);
        const mt_st_tensor* b = prefix && !strncmp(ht.name, arch->optional_prefix, prefix)
                                    ? mt_safetensors_find(st, ht.name + prefix) : NULL;
        if (a && b) { s = mt_fail(err, MT_ERR_FORMAT, "%s holds both %s and %s", path, ht.name, b->name); break; }
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
        s = mt_hf__read(st, t, &buf, &buf_numel, err);
        if (s == MT_OK) arch->import_tensor(cfg, vocab, &ht, buf, params);
    }
    /* what else is in the file: buffers, a tied output layer, or something we cannot hold */
    int has_head = 0;
    for (int i = 0; s == MT_OK && i < count; i++) {
        const mt_st_tensor* t = mt_safetensors_at(st, i);
        if (used[i] || (arch->is_buffer && arch->is_buffer(t->name))) continue;
        if (strcmp(t->name, "lm_head.weight") != 0 || cfg->untie_embeddings_and_output_weights) {
            s = mt_fail(err, MT_ERR_FORMAT, "%s: unexpected tensor %s (not part of %s)", mt_safetensors_file_path(st, t),
                        t->name, arch->name);
            break;
        }
        has_head = 1; /* accepted only as a copy of the word embeddings (canonical offset 0) */
        int same = t->ndim == 2 && t->shape[0] == vocab && t->shape[1] == cfg->hidden_size;
        if (same) s = mt_hf__read(st, t, &buf, &buf_numel, err);
        if (s == MT_OK && same) same = memcmp(buf, params, sizeof(float) * (size_t)t->numel) == 0;
        arch->tensor(cfg, vocab, 0, &ht);
        if (s == MT_OK && !same)
            s = mt_fail(err, MT_ERR_FORMAT, "%s: lm_head.weight differs from %s: %s", mt_safetensors_file_path(st, t),
                        ht.name, arch->tied_note);
    }
    if (s == MT_OK && head_required && !has_head)
        s = mt_fail(err, MT_ERR_CONFIG, "%s/config.json: tie_word_embeddings is false and there is no lm_head.weight: %s",
                    hf_dir, arch->tied_note);
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

/* saving -------------------------------------------------------------------------------------- */

static char* mt_hf__strdup(const char* text) {
    char* copy = (char*)malloc(strlen(text) + 1);
    if (copy) strcpy(copy, text);
    return copy;
}

/* The temporaries a dead export left of any shard layout: model-*.safetensors.tmp.<pid>... */
static void mt_hf__remove_stale_shards(const char* hf_dir) {
    DIR* d = opendir(hf_dir);
    if (!d) return;
    struct dirent* e;
    char base[4400];
    while ((e = readdir(d)) != NULL) {
        const char* tmp = strstr(e->d_name, ".safetensors.tmp.");
        if (strncmp(e->d_name, "model-", 6) != 0 || !tmp) continue;
        snprintf(base, sizeof(base), "%s/%.*s", hf_dir, (int)(tmp - e->d_name) + 12, e->d_name);
        mt_remove_stale_temporaries(base); /* removes entries while we read: readdir may skip one, harmless */
    }
    closedir(d);
}

/* Writes a small text file to exactly path (a temporary name; the caller renames it), fsync'ed:
 * arch's config.json, or text. */
static mt_status mt_hf__write_text(const char* path, const mt_hf_arch* arch, const mt_config* c, int64_t vocab_size,
                                   const char* torch_dtype, const char* text, mt_error* err) {
    FILE* f = fopen(path, "w");
    if (!f) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    int ok = arch ? arch->write_config(f, c, vocab_size, torch_dtype) : fputs(text, f) >= 0;
    int e = errno;
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) { ok = 0; e = errno; }
    if (fclose(f) != 0 && ok) { ok = 0; e = errno; }
    if (!ok) {
        unlink(path);
        return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(e));
    }
    return MT_OK;
}

mt_status mt_hf_save(const char* hf_dir, const mt_config* cfg, const float* params, int64_t vocab_size,
                     mt_st_dtype dtype, int64_t shard_bytes, mt_error* err) {
    const mt_hf_arch* arch = NULL;
    mt_status s = mt_hf_arch_for_config(cfg, &arch, err);
    if (s == MT_OK) s = arch->check(cfg, vocab_size, err);
    if (s != MT_OK) return s;
    if (dtype != MT_ST_F32 && dtype != MT_ST_BF16 && dtype != MT_ST_F16)
        return mt_fail(err, MT_ERR_ARG, "export dtype %s: use F32, BF16 or F16", mt_st_dtype_name(dtype));
    if (shard_bytes <= 0) shard_bytes = MT_HF_SHARD_BYTES;
    if (mt_make_directories(hf_dir) != 0) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", hf_dir, strerror(errno));
    int count = arch->num_tensors(cfg);
    mt_hf_tensor* ht = (mt_hf_tensor*)malloc(sizeof(mt_hf_tensor) * (size_t)count);
    mt_st_write_tensor* wt = (mt_st_write_tensor*)calloc((size_t)count, sizeof(mt_st_write_tensor));
    int* shard = (int*)malloc(sizeof(int) * (size_t)count);
    if (!ht || !wt || !shard) {
        free(ht);
        free(wt);
        free(shard);
        return mt_fail(err, MT_ERR_OOM, "out of memory for %d tensor descriptors", count);
    }
    /* shards: the tensors in order, a new shard when the next one would pass shard_bytes */
    int shards = 1;
    int64_t bytes = 0, numel = 0, total_bytes = 0, largest = 1;
    for (int i = 0; i < count; i++) {
        arch->tensor(cfg, vocab_size, i, &ht[i]);
        int64_t b = ht[i].numel * (int64_t)mt_st_dtype_size(dtype);
        if (bytes > 0 && bytes + b > shard_bytes) {
            shards++;
            bytes = numel = 0;
        }
        bytes += b;
        numel += ht[i].numel;
        total_bytes += b;
        if (numel > largest) largest = numel;
        shard[i] = shards - 1;
        wt[i].name = ht[i].name;
        wt[i].dtype = dtype;
        wt[i].ndim = ht[i].ndim;
        wt[i].shape[0] = ht[i].shape[0];
        wt[i].shape[1] = ht[i].shape[1];
    }
    float* data = (float*)malloc(sizeof(float) * (size_t)largest); /* one shard's values at a time */
    size_t index_cap = 256 + (size_t)count * 160, index_len = 0;
    char* index = shards > 1 ? (char*)malloc(index_cap) : NULL;
    if (!data || (shards > 1 && !index))
        s = mt_fail(err, MT_ERR_OOM, "out of memory for %lld exported values", (long long)largest);
    /* Every file is written under its temporary name (<name>.tmp.<pid>) first; then the set is
     * committed: the old config.json removed (without it transformers and mt_hf_load refuse the
     * directory), the other layout's entry point removed, the weights and index renamed into place,
     * config.json last. A crash at any instant leaves the old export, or a directory without
     * config.json; the next export removes the temporaries a killed one left. */
    char config_path[4200], index_path[4200], other[4300];
    snprintf(config_path, sizeof(config_path), "%s/config.json", hf_dir);
    snprintf(index_path, sizeof(index_path), "%s/model.safetensors.index.json", hf_dir);
    snprintf(other, sizeof(other), "%s/%s", hf_dir, shards > 1 ? "model.safetensors" : "model.safetensors.index.json");
    mt_remove_stale_temporaries(other);
    mt_hf__remove_stale_shards(hf_dir);
    char** finals = (char**)calloc((size_t)shards + 2, sizeof(char*)); /* shards, the index, config.json last */
    char** temps = (char**)calloc((size_t)shards + 2, sizeof(char*));
    int nfiles = 0;
    if (s == MT_OK && (!finals || !temps)) s = mt_fail(err, MT_ERR_OOM, "out of memory");
    for (int k = 0; s == MT_OK && k < shards + 2; k++) {
        char file[4300];
        if (k < shards && shards > 1) snprintf(file, sizeof(file), "%s/model-%05d-of-%05d.safetensors", hf_dir, k + 1, shards);
        else if (k < shards) snprintf(file, sizeof(file), "%s/model.safetensors", hf_dir);
        else if (k == shards && shards > 1) snprintf(file, sizeof(file), "%s", index_path);
        else if (k == shards) continue; /* one file: no index */
        else snprintf(file, sizeof(file), "%s", config_path);
        finals[nfiles] = mt_hf__strdup(file);
        temps[nfiles] = mt_temporary_path(file);
        if (!finals[nfiles] || !temps[nfiles]) s = mt_fail(err, MT_ERR_OOM, "out of memory");
        else mt_remove_stale_temporaries(file);
        nfiles++;
    }
    const char* torch_dtype = dtype == MT_ST_F32 ? "float32" : dtype == MT_ST_BF16 ? "bfloat16" : "float16";
    static const char* const metadata[] = {"format", "pt", NULL};
    if (s == MT_OK && index)
        index_len = (size_t)snprintf(index, index_cap, "{\n  \"metadata\": {\n    \"total_size\": %lld\n  },\n"
                                     "  \"weight_map\": {", (long long)total_bytes);
    for (int k = 0, first = 0; s == MT_OK && k < shards; k++) {
        int64_t off = 0;
        int last = first;
        for (; last < count && shard[last] == k; last++) {
            arch->export_tensor(cfg, vocab_size, &ht[last], params, data + off);
            wt[last].data = data + off;
            off += ht[last].numel;
        }
        s = mt_safetensors_write(temps[k], wt + first, last - first, metadata, err);
        const char* file = strrchr(finals[k], '/') + 1;
        for (int i = first; index && i < last; i++)
            index_len += (size_t)snprintf(index + index_len, index_cap - index_len, "%s\n    \"%s\": \"%s\"",
                                          i ? "," : "", ht[i].name, file);
        first = last;
    }
    if (s == MT_OK && index) {
        snprintf(index + index_len, index_cap - index_len, "\n  }\n}\n");
        s = mt_hf__write_text(temps[shards], NULL, NULL, 0, NULL, index, err);
    }
    if (s == MT_OK) s = mt_hf__write_text(temps[nfiles - 1], arch, cfg, vocab_size, torch_dtype, NULL, err);
    /* the commit */
    if (s == MT_OK && unlink(config_path) != 0 && errno != ENOENT)
        s = mt_fail(err, MT_ERR_IO, "cannot replace %s: %s", config_path, strerror(errno));
    if (s == MT_OK && unlink(other) != 0 && errno != ENOENT)
        s = mt_fail(err, MT_ERR_IO, "cannot remove %s: %s", other, strerror(errno));
    for (int k = 0; s == MT_OK && k < nfiles; k++) s = mt_commit_file(temps[k], finals[k], err);
    for (int k = 0; temps && k < nfiles; k++) {
        if (s != MT_OK && temps[k]) unlink(temps[k]);
        free(temps[k]);
        free(finals[k]);
    }
    free(temps);
    free(finals);
    free(index);
    free(data);
    free(shard);
    free(wt);
    free(ht);
    return s;
}

/* megatron.c checkpoints --------------------------------------------------------------------- */

static int mt_hf__write(FILE* f, const void* p, size_t n) { return fwrite(p, 1, n, f) == n ? 0 : -1; }

mt_status mt_hf_checkpoint_write(const char* dir, const mt_config* c, const float* params, int64_t iteration,
                                 mt_error* err) {
    char final_dir[4200], rank_dir[4300], file[4400], tracker[4200];
    snprintf(final_dir, sizeof(final_dir), "%s/iter_%07lld", dir, (long long)iteration);
    snprintf(tracker, sizeof(tracker), "%s/latest_checkpointed_iteration.txt", dir);
    struct stat sb;
    if (stat(tracker, &sb) == 0)
        return mt_fail(err, MT_ERR_IO, "%s already holds a checkpoint (latest_checkpointed_iteration.txt): choose an "
                       "empty directory", dir);
    if (mt_make_directories(dir) != 0) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    /* the iteration is assembled in iter_N.tmp.<pid> (those of killed runs removed first), renamed into
     * place, and only then made visible by the tracker: without a tracker nothing here is a
     * checkpoint, so an interrupted run leaves nothing a reader accepts and never blocks the retry */
    mt_remove_stale_temporaries(final_dir);
    char* tmp_dir = mt_temporary_path(final_dir);
    if (!tmp_dir) return mt_fail(err, MT_ERR_OOM, "out of memory");
    snprintf(rank_dir, sizeof(rank_dir), "%s/mp_rank_00", tmp_dir);
    snprintf(file, sizeof(file), "%s/model_optim_rng.bin", rank_dir);
    if (mkdir(tmp_dir, 0755) != 0 || mkdir(rank_dir, 0755) != 0) {
        int e = errno;
        mt_remove_tree(tmp_dir);
        free(tmp_dir);
        return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", rank_dir, strerror(e));
    }
    int64_t n = mt_param_layout(c, NULL);
    int64_t h[MT_CK_HEADER_WORDS];
    double scale = 1.0;
    mt_checkpoint_header_init(h, c);
    h[MT_CK_PRECISION] = MT_BF16;
    h[MT_CK_ITERATION] = iteration;
    h[MT_CK_HYSTERESIS] = c->hysteresis;
    h[MT_CK_MANIFESTED] = 1; /* committed with its manifest, below */
    memcpy(&h[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
    /* the file's size and CRC-32C as written, for the manifest (nothing is read back) */
    mt_checkpoint_file_crc known = {"mp_rank_00/model_optim_rng.bin", 0, 0};
    FILE* f = fopen(file, "wb");
    int bad = !f;
    int e = errno;
    if (f) {
        bad = mt_hf__write(f, h, sizeof(h)) || mt_hf__write(f, params, sizeof(float) * (size_t)n);
        known.crc = mt_crc32c_extend(mt_crc32c_extend(0, h, sizeof(h)), params, sizeof(float) * (size_t)n);
        known.size = (int64_t)sizeof(h) + (int64_t)sizeof(float) * n;
        enum { ZEROS = 1 << 16 };
        float* zeros = (float*)calloc(ZEROS, sizeof(float));
        bad |= !zeros;
        for (int k = 0; k < 2 && !bad; k++) /* Adam m, then v */
            for (int64_t s = 0; s < n && !bad; s += ZEROS) {
                const size_t bytes = sizeof(float) * (size_t)(n - s < ZEROS ? n - s : (int64_t)ZEROS);
                bad = mt_hf__write(f, zeros, bytes);
                known.crc = mt_crc32c_extend(known.crc, zeros, bytes);
                known.size += (int64_t)bytes;
            }
        free(zeros);
        e = errno;
        if (fflush(f) != 0 || fsync(fileno(f)) != 0) { bad = 1; e = errno; }
        if (fclose(f) != 0 && !bad) { bad = 1; e = errno; }
    }
    if (!bad && (mt_sync_directory_of(file) != 0 || mt_sync_directory_of(rank_dir) != 0)) { bad = 1; e = errno; }
    mt_status st = MT_OK;
    if (bad) st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", file, strerror(e));
    if (st == MT_OK) st = mt_checkpoint_manifest_write_known(tmp_dir, &known, 1, err);
    /* an iter_N without a tracker is what an interrupted run left: not a checkpoint, replaced */
    if (st == MT_OK && mt_remove_tree(final_dir) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot replace %s (left by an interrupted run): %s", final_dir, strerror(errno));
    if (st == MT_OK) st = mt_commit_file(tmp_dir, final_dir, err);
    if (st != MT_OK) mt_remove_tree(tmp_dir);
    free(tmp_dir);
    if (st == MT_OK) st = mt_checkpoint_write_tracker(dir, iteration, err);
    return st;
}

mt_status mt_hf_checkpoint_read(const char* dir, int64_t iteration, int no_verify, mt_config* c, float** params_out,
                                int64_t* header, mt_error* warning, mt_error* err) {
    *params_out = NULL;
    char path[4400], iter_dir[4200];
    mt_status s = mt_checkpoint_select(dir, iteration, no_verify, &iteration, NULL, warning, err);
    if (s != MT_OK) return s;
    mt_checkpoint_iteration_dir(iter_dir, sizeof(iter_dir), dir, iteration);
    snprintf(path, sizeof(path), "%s/mp_rank_00/model_optim_rng.bin", iter_dir);
    struct stat first;
    mt_ckpt layout;
    mt_error why;
    if (stat(path, &first) != 0 && mt_ckpt_open(&layout, dir, iteration, &why) == MT_OK) /* PP or EP > 1: no mp_rank_00 */
        return mt_fail(err, MT_ERR_FORMAT, "%s was saved with tensor/pipeline/expert parallel sizes %d/%d/%d: only 1/1/1 "
                       "converts (checkpoint_tool reshard --target-tp 1 --target-pp 1 first)", iter_dir, layout.tp,
                       layout.pp, layout.ep);
    int fd = mt_open_regular_file(path, err);
    if (fd < 0) return MT_ERR_IO;
    FILE* f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return mt_fail(err, MT_ERR_IO, "cannot open checkpoint %s: %s", path, strerror(errno));
    }
    struct stat sb;
    int64_t h[MT_CK_HEADER_WORDS];
    if (fstat(fileno(f), &sb) != 0 || fread(h, sizeof(int64_t), MT_CK_HEADER_WORDS, f) != MT_CK_HEADER_WORDS) {
        fclose(f);
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated (no header)", path);
    }
    /* every word checked before any is used: shape, flavour, rope and norm doubles, counters */
    s = mt_checkpoint_header_check(h, path, c, err);
    if (s == MT_OK && (h[MT_CK_TP] != 1 || h[MT_CK_PP] != 1 || h[MT_CK_EP] > 1))
        s = mt_fail(err, MT_ERR_FORMAT, "%s was saved with tensor/pipeline/expert parallel sizes %lld/%lld/%lld: only "
                    "1/1/1 converts (checkpoint_tool reshard --target-tp 1 --target-pp 1 first)", path,
                    (long long)h[MT_CK_TP], (long long)h[MT_CK_PP], h[MT_CK_EP] > 1 ? (long long)h[MT_CK_EP] : 1LL);
    if (s == MT_OK && h[MT_CK_ITERATION] != iteration)
        s = mt_fail(err, MT_ERR_FORMAT, "%s holds iteration %lld, not %lld", path, (long long)h[MT_CK_ITERATION],
                    (long long)iteration);
    const int64_t want = s == MT_OK ? mt_checkpoint_file_bytes(h, 0) : 0;
    if (s == MT_OK && (int64_t)sb.st_size != want)
        s = mt_fail(err, MT_ERR_FORMAT, "%s is %s: %lld bytes, expected %lld", path,
                    (int64_t)sb.st_size < want ? "truncated" : "too long", (long long)sb.st_size, (long long)want);
    if (s == MT_OK) c->seq_length = c->max_position_embeddings;
    int64_t n = h[MT_CK_NUM_PARAMS]; /* = mt_param_layout(c), checked */
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

#endif /* MT_HF_IMPLEMENTATION */

/* The architectures, after the shared implementation, whose helpers theirs use. Outside the guard,
 * so that a later include with MT_HF_IMPLEMENTATION brings their implementations too; not while
 * hf_gpt2.h, hf_llama.h or hf_moe.h is including this header (they include it first), so that each of them is
 * read once, in this order, whichever header the program includes. */
#ifndef MT_HF_CHECKPOINT_INCLUDING_ARCHS
#define MT_HF_CHECKPOINT_INCLUDING_ARCHS
#include "hf_gpt2.h"
#include "hf_llama.h"
#include "hf_moe.h"
#undef MT_HF_CHECKPOINT_INCLUDING_ARCHS
#endif
