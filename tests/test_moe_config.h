/* tests/test_moe_config.h — mixture of experts' configuration (issue #34, phase 1; host tests): the
 * --num-experts / --moe-* flags in every form with Megatron's defaults, Megatron's refusals and what
 * this build does not have yet (one line each), the capacity and the permuted rows' bound, the MoE
 * parameter tensors against dev/ref_moe.py's count, the dense model's layouts unchanged by MoE's
 * existence, the memory plan counting the MoE regions and state, Megatron's FLOP formula with MoE, the
 * checkpoint header's MoE words, Megatron's Mixtral script. dev/moe_semantics.md states the semantics. */
#ifndef MT_TEST_MOE_CONFIG_H
#define MT_TEST_MOE_CONFIG_H

#include "../train_gpt_flags.h"

/* The mt_config of one of dev/ref_moe.py's CONFIGS (its model fields; derived sizes set by hand so the
 * count needs no finalize): flavour llama = RMSNorm, SwiGLU, rope, untied, no biases; gpt2 = LayerNorm,
 * GELU, learned positions, tied, biases. */
typedef struct {
    const char* name;
    int llama, L, h, n, g, kv, f, qk;
    int E, k, fe, shared, gate, pre_softmax;
    const char* freq; /* --moe-layer-freq */
    int64_t num_params; /* ref_moe.num_params(cfg) */
} moe_ref_case;

/* The counts: /usr/bin/python3 -c "import ref_moe as R; [print(n, R.num_params(c)) for n, c in
 * R.CONFIGS.items()]" in dev/ (dev/ref_moe.py at this commit; Vp 256, T 32 everywhere). */
static const moe_ref_case moe_ref_cases[] = {
    {"mixtral_tiny", 1, 2, 64, 4, 2, 16, 96, 0, 8, 2, 32, 0, 0, 0, "1", 156992},
    {"deepseek_tiny", 1, 3, 64, 4, 2, 16, 96, 0, 16, 4, 24, 48, 0, 0, "[0,1,1]", 256448},
    {"qwen3_tiny", 1, 2, 64, 4, 2, 16, 96, 1, 128, 8, 16, 0, 0, 0, "1", 860544},
    {"moe_cap_probs", 1, 2, 64, 4, 2, 16, 96, 0, 8, 2, 32, 0, 0, 0, "1", 156992},
    {"moe_cap_position_pad", 1, 2, 64, 4, 2, 16, 96, 0, 8, 2, 32, 0, 0, 1, "1", 156992},
    {"gpt2_moe", 0, 2, 64, 4, 4, 16, 128, 0, 4, 1, 64, 0, 0, 1, "2", 102468},
    {"moe_shared_gate", 1, 2, 64, 4, 2, 16, 96, 0, 8, 2, 32, 64, 1, 0, "1", 181696},
};

static mt_config moe_ref_config(const moe_ref_case* r) {
    mt_config c = test_config_sized(r->L, r->h, r->n, 32, 256);
    test_config_batch(&c, 2, 4);
    test_config_attention(&c, r->n, r->g, r->kv, r->f);
    if (r->llama) test_config_llama(&c);
    c.qk_layernorm = r->qk;
    c.num_experts = r->E;
    c.moe_router_topk = r->k;
    c.moe_ffn_hidden_size = r->fe;
    c.moe_shared_expert_intermediate_size = r->shared;
    c.moe_shared_expert_gate = r->gate;
    c.moe_router_pre_softmax = r->pre_softmax;
    mt_error err;
    if (mt_moe_layer_freq_parse(r->freq, &c, &err) != MT_OK) c.num_layers = -1; /* the test fails on it */
    c.padded_vocab_size = 256;
    c.max_position_embeddings = 32;
    return c;
}

/* Every parameter count of dev/ref_moe.py's configurations, tensor by tensor in its canonical order. */
static test_result test_moe_num_parameters_match_reference(void) {
    for (size_t i = 0; i < sizeof(moe_ref_cases) / sizeof(moe_ref_cases[0]); i++) {
        const moe_ref_case* r = &moe_ref_cases[i];
        mt_config c = moe_ref_config(r);
        EXPECT(c.num_layers == r->L, "%s: --moe-layer-freq %s", r->name, r->freq);
        EXPECT(mt_num_parameters(&c) == r->num_params, "%s: %lld parameters, dev/ref_moe.py counts %lld", r->name,
               (long long)mt_num_parameters(&c), (long long)r->num_params);
        /* the MoE tensors by hand: Lm MoE layers, Ld dense ones */
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        mt_param_layout(&c, info);
        const int64_t Lm = mt_moe_num_layers(&c), Ld = r->L - Lm, glu = r->llama ? 2 : 1, bias = !r->llama;
        const int64_t want[][2] = {
            {MT_P_FC1_WEIGHT, Ld * glu * r->f * r->h}, {MT_P_FC2_BIAS, bias * Ld * r->h},
            {MT_P_ROUTER_WEIGHT, Lm * r->E * r->h}, {MT_P_ROUTER_BIAS, bias * Lm * r->E},
            {MT_P_EXPERT_FC1_WEIGHT, Lm * r->E * glu * r->fe * r->h}, {MT_P_EXPERT_FC1_BIAS, bias * Lm * r->E * glu * r->fe},
            {MT_P_EXPERT_FC2_WEIGHT, Lm * r->E * r->h * r->fe}, {MT_P_EXPERT_FC2_BIAS, bias * Lm * r->E * r->h},
            {MT_P_SHARED_FC1_WEIGHT, Lm * glu * r->shared * r->h}, {MT_P_SHARED_FC2_WEIGHT, Lm * r->h * r->shared},
            {MT_P_SHARED_GATE_WEIGHT, r->gate * Lm * r->h}};
        for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++)
            EXPECT(info[want[k][0]].numel == want[k][1], "%s: %s has %lld elements, by hand %lld", r->name,
                   info[want[k][0]].name, (long long)info[want[k][0]].numel, (long long)want[k][1]);
        /* canonical order: the MoE tensors between fc2's bias and the final norm */
        EXPECT(info[MT_P_ROUTER_WEIGHT].offset == info[MT_P_FC2_BIAS].offset + info[MT_P_FC2_BIAS].numel &&
               info[MT_P_FINAL_LN_WEIGHT].offset == info[MT_P_SHARED_GATE_WEIGHT].offset + info[MT_P_SHARED_GATE_WEIGHT].numel,
               "%s: the MoE tensors are not where ref_moe.py puts them", r->name);
        EXPECT(Lm == (!strcmp(r->freq, "1") ? r->L : r->L - 1), "%s: %lld MoE layers", r->name, (long long)Lm);
    }
    /* which layer has which tensors, the predicates every per-layer walk uses */
    mt_config d = moe_ref_config(&moe_ref_cases[1]); /* deepseek_tiny: layer 0 dense */
    EXPECT(!mt_moe_layer(&d, 0) && mt_moe_layer(&d, 1) && mt_moe_layer(&d, 2) && !mt_moe_layer(&d, 3), "layers");
    EXPECT(mt_param_layer_has(&d, MT_P_FC1_WEIGHT, 0) && !mt_param_layer_has(&d, MT_P_FC1_WEIGHT, 1) &&
           !mt_param_layer_has(&d, MT_P_ROUTER_WEIGHT, 0) && mt_param_layer_has(&d, MT_P_EXPERT_FC2_WEIGHT, 2) &&
           mt_param_layer_has(&d, MT_P_QKV_WEIGHT, 1) && !mt_param_layer_has(&d, MT_P_FINAL_LN_WEIGHT, 0), "layer_has");
    for (int t = 0; t < MT_NUM_PARAM_TENSORS; t++)
        EXPECT(mt_param_per_layer(t) == (t >= MT_P_LN1_WEIGHT && t <= MT_P_SHARED_GATE_WEIGHT) &&
               mt_param_moe(t) == (t >= MT_P_ROUTER_WEIGHT && t <= MT_P_SHARED_GATE_WEIGHT), "tensor %d", t);
    /* the init streams: a dense model's tensors keep the numbers they had before the MoE tensors */
    EXPECT(mt_param_init_stream(MT_P_FC2_BIAS) == 17 && mt_param_init_stream(MT_P_FINAL_LN_WEIGHT) == 18 &&
           mt_param_init_stream(MT_P_OUTPUT_WEIGHT) == 20 && mt_param_init_stream(MT_P_ROUTER_WEIGHT) == 21 &&
           mt_param_init_stream(MT_P_SHARED_GATE_WEIGHT) == 29, "init streams");
    /* the supported one (every layer MoE, SwiGLU, no biases) finalizes; its shard split is ETP's */
    mt_config m = moe_ref_config(&moe_ref_cases[0]);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&m, &err), &err);
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&m, info);
    EXPECT(info[MT_P_EXPERT_FC1_WEIGHT].tp_split && info[MT_P_EXPERT_FC1_WEIGHT].split_outer == 16 &&
           info[MT_P_EXPERT_FC1_WEIGHT].split_rows == 32 && info[MT_P_EXPERT_FC2_WEIGHT].split_outer == 8 * 64 &&
           !info[MT_P_ROUTER_WEIGHT].tp_split && info[MT_P_ROUTER_WEIGHT].weight_decay &&
           info[MT_P_EXPERT_FC2_WEIGHT].init == 3 && info[MT_P_ROUTER_WEIGHT].init == 2, "MoE tensor table");
    return TEST_PASS;
}

/* ---- a dense model's layouts, as before MoE existed ------------------------------------------ */
/* DIGEST BEGIN (this block compiles against the megatron.h of before MoE too: see below) */
static uint64_t moe_digest_add(uint64_t x, const void* p, size_t n) {
    const unsigned char* b = (const unsigned char*)p;
    for (size_t i = 0; i < n; i++) x = (x ^ b[i]) * 1099511628211ULL;
    return x;
}
#define MOE_DIGEST(x, v) (x) = moe_digest_add((x), &(v), sizeof(v))
/* Everything a finalized dense config lays out: the parameter tensors (full and shard, by name), the DDP
 * buffer, the activation arena's regions of before MoE, the memory plan, the checkpoint header, the
 * parameter count and the FLOPs. */
static uint64_t moe_dense_digest(const mt_config* c) {
    static const int regions[] = {
        MT_ACT_LN1, MT_ACT_Q, MT_ACT_K, MT_ACT_V, MT_ACT_O, MT_ACT_DK, MT_ACT_DV, MT_ACT_DSCORES, MT_ACT_DSUM,
        MT_ACT_LOGITS_ROW, MT_ACT_BRANCH, MT_ACT_BRANCH2, MT_ACT_DRESIDUAL, MT_ACT_GATHERED, MT_ACT_GATHERED_GRAD,
        MT_ACT_ROWS, MT_ACT_CE_STATS, MT_ACT_INPUTS, MT_ACT_TARGETS, MT_ACT_LOSSES, MT_ACT_EMBED_INDEX,
        MT_ACT_QK_NORM, MT_ACT_QK_STATS, MT_ACT_RESIDUAL, MT_ACT_LN1_MEAN, MT_ACT_LN1_RSTD, MT_ACT_QKV,
        MT_ACT_PROBS, MT_ACT_LSE, MT_ACT_ATTN_OUT, MT_ACT_RESIDUAL_MID, MT_ACT_LN2, MT_ACT_LN2_MEAN,
        MT_ACT_LN2_RSTD, MT_ACT_FC1, MT_ACT_ACT, MT_ACT_LNF, MT_ACT_LNF_MEAN, MT_ACT_LNF_RSTD, MT_ACT_LOGITS};
    static const int tensors[] = {
        MT_P_WORD_EMBEDDINGS, MT_P_POSITION_EMBEDDINGS, MT_P_LN1_WEIGHT, MT_P_LN1_BIAS, MT_P_QKV_WEIGHT, MT_P_QKV_BIAS,
        MT_P_Q_LAYERNORM_WEIGHT, MT_P_Q_LAYERNORM_BIAS, MT_P_K_LAYERNORM_WEIGHT, MT_P_K_LAYERNORM_BIAS,
        MT_P_PROJ_WEIGHT, MT_P_PROJ_BIAS, MT_P_LN2_WEIGHT, MT_P_LN2_BIAS, MT_P_FC1_WEIGHT, MT_P_FC1_BIAS,
        MT_P_FC2_WEIGHT, MT_P_FC2_BIAS, MT_P_FINAL_LN_WEIGHT, MT_P_FINAL_LN_BIAS, MT_P_OUTPUT_WEIGHT};
    uint64_t x = 14695981039346656037ULL;
    mt_param_info full[MT_NUM_PARAM_TENSORS], shard[MT_NUM_PARAM_TENSORS];
    int64_t n = mt_param_layout(c, full), ns = mt_param_layout_shard(c, shard);
    MOE_DIGEST(x, n);
    MOE_DIGEST(x, ns);
    for (size_t k = 0; k < sizeof(tensors) / sizeof(tensors[0]); k++) {
        const mt_param_info* t[2] = {&full[tensors[k]], &shard[tensors[k]]};
        for (int j = 0; j < 2; j++) {
            x = moe_digest_add(x, t[j]->name, strlen(t[j]->name));
            MOE_DIGEST(x, t[j]->numel);
            MOE_DIGEST(x, t[j]->offset);
            MOE_DIGEST(x, t[j]->weight_decay);
            MOE_DIGEST(x, t[j]->init);
            MOE_DIGEST(x, t[j]->tp_split);
            MOE_DIGEST(x, t[j]->split_outer);
            MOE_DIGEST(x, t[j]->split_rows);
            MOE_DIGEST(x, t[j]->split_inner);
        }
    }
    mt_buffer_layout B;
    if (mt_buffer_layout_build(&B, c, NULL) != MT_OK) return 0;
    MOE_DIGEST(x, B.size);
    MOE_DIGEST(x, B.num_buckets);
    MOE_DIGEST(x, B.canonical_size);
    MOE_DIGEST(x, B.storage_bytes);
    for (int i = 0; i < B.num_params; i++) {
        const mt_buffer_param* p = &B.params[i];
        x = moe_digest_add(x, full[p->tensor].name, strlen(full[p->tensor].name));
        MOE_DIGEST(x, p->layer);
        MOE_DIGEST(x, p->numel);
        MOE_DIGEST(x, p->canonical);
        MOE_DIGEST(x, p->offset);
        MOE_DIGEST(x, p->bucket);
        MOE_DIGEST(x, p->storage);
    }
    for (int b = 0; b < B.num_buckets; b++) {
        MOE_DIGEST(x, B.buckets[b].start);
        MOE_DIGEST(x, B.buckets[b].end);
        MOE_DIGEST(x, B.buckets[b].ready_layer);
    }
    mt_buffer_layout_free(&B);
    mt_activation_layout a;
    mt_activation_layout_compute(c, c->num_layers / c->pipeline_model_parallel_size, 1, 2, &c->recompute, &a);
    for (size_t k = 0; k < sizeof(regions) / sizeof(regions[0]); k++) {
        MOE_DIGEST(x, a.offset[regions[k]]);
        MOE_DIGEST(x, a.bytes[regions[k]]);
        MOE_DIGEST(x, a.kept_layers[regions[k]]);
    }
    MOE_DIGEST(x, a.scratch_bytes);
    MOE_DIGEST(x, a.saved_bytes);
    MOE_DIGEST(x, a.total);
    mt_memory_plan p;
    if (mt_memory_plan_compute(c, NULL, &p, NULL) != MT_OK) return 0;
    const size_t plan[] = {p.parameter_bytes, p.master_bytes, p.gradient_bytes, p.optimizer_bytes, p.activation_bytes,
                           p.activation_saved_bytes, p.workspace_bytes, p.fp8_bytes, p.offload_bytes, p.total_bytes,
                           p.overhead_bytes, p.device_bytes, p.host_pinned_bytes};
    x = moe_digest_add(x, plan, sizeof(plan));
    int64_t h[MT_CK_HEADER_WORDS];
    mt_checkpoint_header_init(h, c);
    x = moe_digest_add(x, h, sizeof(h));
    const double flops = mt_flops_per_iteration(c, c->global_batch_size);
    MOE_DIGEST(x, flops);
    return x;
}
/* The tests' configurations (tests/test_configs.h) and their variants in the other tests: precisions,
 * flavours, qk-layernorm, TP with SP and the distributed optimizer's buckets, PP with virtual stages,
 * FP8 with --fp8-param-gather, recompute. Returns 0 past the last. */
static int moe_dense_configs(int i, mt_config* c) {
    switch (i) {
        case 0: *c = small_test_config(); break;
        case 1: *c = test_config(TEST_GPT2, MT_FP32); break;
        case 2: *c = test_config(TEST_GPT2, MT_BF16); break;
        case 3: *c = test_config(TEST_LLAMA, MT_BF16); break;
        case 4: *c = test_config(TEST_LLAMA, MT_FP16); c->qk_layernorm = 1; break;
        case 5:
            *c = test_config(TEST_LLAMA, MT_BF16);
            test_config_parallel(c, 2, 4, 1);
            test_config_ddp(c, 1, 1, 1, 20000);
            break;
        case 6:
            *c = test_config_sized(8, 64, 4, 32, 500);
            test_config_batch(c, 1, 8);
            c->pipeline_model_parallel_size = 2;
            c->virtual_pipeline_size = 2;
            c->world_size = 4;
            test_config_ddp(c, 1, 0, 0, 0);
            break;
        case 7:
            *c = test_config(TEST_LLAMA, MT_BF16);
            c->fp8_format = MT_FP8_HYBRID;
            c->world_size = 2;
            test_config_ddp(c, 1, 1, 1, 0);
            c->fp8_param_gather = 1;
            break;
        case 8:
            *c = test_config(TEST_GPT2, MT_BF16);
            c->recompute.granularity = MT_RECOMPUTE_FULL;
            c->recompute.method = MT_RECOMPUTE_UNIFORM;
            c->recompute.num_layers = 1;
            c->optimizer_cpu_offload = 1;
            c->optimizer_offload_fraction = 0.5;
            break;
        default: return 0;
    }
    return 1;
}
/* DIGEST END */

/* The digests of moe_dense_configs(0..8) as the megatron.h of commit 6f0096f (the last before MoE)
 * lays them out: the block between the DIGEST markers, with tests/test_common.h and test_configs.h,
 * compiled in a small C program against that commit's megatron.h, printing moe_dense_digest of each
 * finalized config. A dense model's parameter files, buffers, arenas, plan, header and FLOPs are
 * unchanged to the byte. */
static const uint64_t moe_dense_digests_before_moe[] = {
    0x9fc573302b9205e9ULL, 0xab94f471a719baf1ULL, 0xee64b29650c71390ULL, 0xfe3dd73cb7a01c24ULL, 0xae30e163d75c94d5ULL,
    0x2bfa16b637b24893ULL, 0xa4355aa6f66df9acULL, 0x4b61c9058d39ac16ULL, 0x9214b1a0953c16caULL};

static test_result test_moe_dense_layouts_unchanged(void) {
    mt_config c;
    int i = 0;
    for (; moe_dense_configs(i, &c); i++) {
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        const uint64_t d = moe_dense_digest(&c);
        EXPECT(d == moe_dense_digests_before_moe[i], "config %d: digest 0x%016llxULL, before MoE 0x%016llxULL", i,
               (unsigned long long)d, (unsigned long long)moe_dense_digests_before_moe[i]);
    }
    EXPECT(i == (int)(sizeof(moe_dense_digests_before_moe) / sizeof(moe_dense_digests_before_moe[0])), "%d configs", i);
    return TEST_PASS;
}

/* ---- capacity and the permuted rows' bound ---------------------------------------------------- */

static test_result test_moe_capacity_and_rows(void) {
    mt_config c = moe_ref_config(&moe_ref_cases[0]);
    /* dropless: no capacity, every (token, expert) pair a row */
    EXPECT(mt_moe_capacity(&c, 64) == 0 && mt_moe_max_rows(&c, 64) == 128, "dropless");
    /* ceil((N k / E) x f32(factor)), by hand; dev/ref_moe.py capacity_of gives the same (the first two
     * are where the factor's float rounding counts: 10 x f32(0.1) = 1.0000000149 -> 2, in double 1) */
    struct { int64_t N; int k, E; double f; int64_t C; } cap[] = {
        {100, 1, 10, 0.1, 2}, {40, 2, 8, 0.1, 2}, {64, 2, 8, 1.0, 16}, {64, 2, 8, 1.1, 18}, {4096, 2, 8, 1.25, 1280},
        {7, 3, 5, 0.5, 3}, {64, 2, 8, 0.1, 2}};
    for (size_t i = 0; i < sizeof(cap) / sizeof(cap[0]); i++) {
        c.moe_router_topk = cap[i].k;
        c.num_experts = cap[i].E;
        c.moe_expert_capacity_factor = cap[i].f;
        EXPECT(mt_moe_capacity(&c, cap[i].N) == cap[i].C, "N %lld k %d E %d factor %g: capacity %lld, by hand %lld",
               (long long)cap[i].N, cap[i].k, cap[i].E, cap[i].f, (long long)mt_moe_capacity(&c, cap[i].N),
               (long long)cap[i].C);
    }
    /* the rows bound: min(N k, E C); all of N k when C >= N; E C when padded (E N past N: refused anyway) */
    c.num_experts = 8;
    c.moe_router_topk = 2;
    struct { double f; int pad; int64_t N, rows; } rows[] = {
        {1.0, 0, 64, 128}, {0.5, 0, 64, 64}, {0.5, 1, 64, 64}, {0.25, 1, 64, 32}, {5.0, 0, 64, 128}, {0.1, 0, 40, 16},
        {5.0, 1, 64, 512}};
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        c.moe_expert_capacity_factor = rows[i].f;
        c.moe_pad_expert_input_to_capacity = rows[i].pad;
        EXPECT(mt_moe_max_rows(&c, rows[i].N) == rows[i].rows, "factor %g pad %d N %lld: %lld rows, by hand %lld",
               rows[i].f, rows[i].pad, (long long)rows[i].N, (long long)mt_moe_max_rows(&c, rows[i].N),
               (long long)rows[i].rows);
    }
    c.num_experts = 0; /* a dense model has none */
    EXPECT(mt_moe_capacity(&c, 64) == 0 && mt_moe_max_rows(&c, 64) == 0 && mt_moe_num_layers(&c) == 0, "dense");
    return TEST_PASS;
}

/* ---- refusals: Megatron's, and what phase 1 does not build -------------------------------------- */

/* mixtral_tiny in a world of `world`, the supported start of the refusal tests */
static mt_config moe_base(int world) {
    mt_config c = moe_ref_config(&moe_ref_cases[0]);
    c.kv_channels = 0;
    c.padded_vocab_size = 0;
    c.max_position_embeddings = 0;
    c.world_size = world;
    c.global_batch_size = 2 * world;
    c.moe_aux_loss_coeff[0] = 1e-2;
    c.moe_z_loss_coeff = 1e-3;
    return c;
}

typedef struct {
    const char* what;
    void (*set)(mt_config*);
    const char* says; /* a substring of the one line */
} moe_refusal;

#define MOE_SET(name, body) static void moe_set_##name(mt_config* c) { body; }
MOE_SET(topk0, c->moe_router_topk = 0)
MOE_SET(topk9, c->moe_router_topk = 9)
MOE_SET(ep3, c->expert_model_parallel_size = 3; c->world_size = 3; c->global_batch_size = 6)
MOE_SET(negative_capacity, c->moe_expert_capacity_factor = -1)
MOE_SET(pad_no_capacity, c->moe_pad_expert_input_to_capacity = 1)
MOE_SET(pad_past_tokens, c->moe_pad_expert_input_to_capacity = 1; c->moe_expert_capacity_factor = 4.0)
MOE_SET(flags_no_experts, c->num_experts = 0; c->moe_aux_loss_coeff[0] = 0; c->moe_z_loss_coeff = 0;
        c->moe_ffn_hidden_size = 0; c->moe_router_topk = 4)
MOE_SET(ep_no_experts, c->num_experts = 0; c->moe_aux_loss_coeff[0] = 0; c->moe_z_loss_coeff = 0; c->moe_ffn_hidden_size = 0;
        c->expert_model_parallel_size = 2; c->world_size = 2; c->global_batch_size = 4)
MOE_SET(ffn_no_experts, c->num_experts = 0; c->moe_aux_loss_coeff[0] = 0; c->moe_z_loss_coeff = 0)
MOE_SET(bias_softmax, c->moe_router_enable_expert_bias = 1)
MOE_SET(groups_divide, c->moe_router_num_groups = 3; c->moe_router_group_topk = 1)
MOE_SET(group_topk_above, c->moe_router_num_groups = 2; c->moe_router_group_topk = 3)
MOE_SET(k_below_group_topk, c->moe_router_num_groups = 4; c->moe_router_group_topk = 3)
MOE_SET(k_above_groups, c->moe_router_num_groups = 4; c->moe_router_group_topk = 1; c->moe_router_topk = 3)
MOE_SET(group_topk_alone, c->moe_router_group_topk = 1)
MOE_SET(k1_softmax, c->moe_router_topk = 1)
MOE_SET(shared_bias, c->moe_shared_expert_intermediate_size = 64; c->add_bias_linear = 1)
MOE_SET(gate_alone, c->moe_shared_expert_gate = 1)
MOE_SET(coeff_unselected, c->moe_aux_loss_coeff[1] = 1e-3)
MOE_SET(pattern_length, c->moe_layer_pattern_len = 3; c->moe_layer_pattern[0] = c->moe_layer_pattern[1] =
        c->moe_layer_pattern[2] = 1)
MOE_SET(pattern_empty, c->moe_layer_pattern_len = 2; c->moe_layer_pattern[0] = c->moe_layer_pattern[1] = 0)
MOE_SET(negative_experts, c->num_experts = -8)
MOE_SET(tp_no_sp, c->tensor_model_parallel_size = 2; c->world_size = 2)
MOE_SET(bias_etp, c->add_bias_linear = 1; c->expert_tensor_parallel_size = 2)
/* not built yet (mt_config_check_supported) */
MOE_SET(tp, c->tensor_model_parallel_size = 2; c->sequence_parallel = 1; c->world_size = 2)
MOE_SET(pp_ep, c->pipeline_model_parallel_size = 2; c->expert_model_parallel_size = 2; c->world_size = 4;
        c->global_batch_size = 8; c->moe_token_dispatcher_alltoall = 1)
MOE_SET(ep, c->expert_model_parallel_size = 2; c->world_size = 2; c->global_batch_size = 4)
MOE_SET(ep_over_dp, c->expert_model_parallel_size = 4; c->world_size = 2; c->global_batch_size = 4;
        c->moe_token_dispatcher_alltoall = 1)
MOE_SET(etp, c->expert_tensor_parallel_size = 2)
MOE_SET(fp8, c->precision = MT_BF16; c->fp8_format = MT_FP8_HYBRID)
MOE_SET(recompute, c->recompute.granularity = MT_RECOMPUTE_SELECTIVE)
MOE_SET(biases_ep, c->add_bias_linear = 1; c->expert_model_parallel_size = 2; c->world_size = 2;
        c->global_batch_size = 4; c->moe_token_dispatcher_alltoall = 1)
/* built (issue #34): GELU or squared-ReLU experts (the model's activation without --swiglu) and linear biases on
 * the router and the experts */
MOE_SET(squared_relu, c->swiglu = 0; c->squared_relu = 1)
MOE_SET(gelu_biases, c->swiglu = 0; c->add_bias_linear = 1)
MOE_SET(dense_layers, c->moe_layer_freq = 2)
MOE_SET(dense_pattern, c->moe_layer_pattern_len = 2; c->moe_layer_pattern[0] = 0; c->moe_layer_pattern[1] = 1)
MOE_SET(per_token_loss, c->calculate_per_token_loss = 1)

static test_result test_moe_refusals(void) {
    const moe_refusal megatron[] = {
        {"topk 0", moe_set_topk0, "--moe-router-topk 0 must be in [1, --num-experts 8]"},
        {"topk above E", moe_set_topk9, "--moe-router-topk 9 must be in [1, --num-experts 8]"},
        {"E % EP", moe_set_ep3, "Number of experts should be a multiple of expert model parallel_size."},
        {"capacity < 0", moe_set_negative_capacity, "--moe-expert-capacity-factor"},
        {"pad without capacity", moe_set_pad_no_capacity,
         "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"},
        {"pad with C >= N", moe_set_pad_past_tokens, "padded to all tokens"},
        {"MoE flags without --num-experts", moe_set_flags_no_experts, "--moe-router-topk needs --num-experts"},
        {"EP without --num-experts", moe_set_ep_no_experts, "num_experts must be non None to use expert model parallelism"},
        {"--moe-ffn-hidden-size without --num-experts", moe_set_ffn_no_experts, "--moe-ffn-hidden-size needs --num-experts"},
        {"expert bias with softmax", moe_set_bias_softmax, "Expert bias for aux-loss-free routing only supports"},
        {"groups that do not divide E", moe_set_groups_divide, "num_moe_experts (8) should be divisible by moe_router_num_groups (3)."},
        {"group_topk > groups", moe_set_group_topk_above, "moe_router_group_topk (3) should be smaller than moe_router_num_groups (2)."},
        {"k < group_topk", moe_set_k_below_group_topk, "group-limited routing needs --moe-router-group-topk <= --moe-router-topk"},
        {"k > group_topk x E/G", moe_set_k_above_groups, "(1 <= 3 <= 2)"},
        {"group_topk without groups", moe_set_group_topk_alone,
         "When using group limited routing, moe_router_num_groups must be specified."},
        {"k = 1 softmax", moe_set_k1_softmax, "Please use --moe-router-pre-softmax when topk is 1."},
        {"shared expert with biases", moe_set_shared_bias, "bias is not supported in the shared experts, please set '--disable-bias-linear' instead."},
        {"gate without a shared expert", moe_set_gate_alone, "--moe-shared-expert-gate needs a shared expert"},
        {"a coefficient for a type not selected", moe_set_coeff_unselected,
         "moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type"},
        {"pattern length", moe_set_pattern_length, "Invalid length of moe_layer_pattern: 3, expected 2"},
        {"pattern of no MoE layer", moe_set_pattern_empty, "marks no layer as MoE"},
        {"negative experts", moe_set_negative_experts, "num_moe_experts must be non-negative."},
        {"TP without SP", moe_set_tp_no_sp, "without also enabling sequence parallelism"},
        {"biases with ETP 2", moe_set_bias_etp, "Bias in Moe is only supported when ETP==1"},
    };
    for (size_t i = 0; i < sizeof(megatron) / sizeof(megatron[0]); i++) {
        mt_config c = moe_base(1);
        megatron[i].set(&c);
        mt_error err;
        EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, megatron[i].says) &&
                   !strchr(err.message, '\n'),
               "%s: '%s'", megatron[i].what, err.message);
    }
    /* not built yet: one line naming what to do instead, from finalize and from mt_config_check_supported
     * alike (the planner's and the trainer's answer) */
    const moe_refusal later[] = {
        {"TP", moe_set_tp, "MoE with tensor parallelism (--tensor-model-parallel-size 2) is not built yet: use 1"},
        {"PP with EP", moe_set_pp_ep, "MoE with pipeline parallelism (--pipeline-model-parallel-size 2) and expert "
                                      "parallelism (--expert-model-parallel-size 2) together is not built yet"},
        {"EP allgather", moe_set_ep, "--moe-token-dispatcher-type allgather with expert parallelism is not built: give "
                                     "--moe-token-dispatcher-type alltoall"},
        {"EP above DP", moe_set_ep_over_dp, "--expert-model-parallel-size 4 must divide the data-parallel size 2"},
        {"ETP", moe_set_etp, "--expert-tensor-parallel-size 2: expert tensor parallelism is not built yet (use 1)"},
        {"FP8", moe_set_fp8, "MoE with FP8 is not built yet: drop --fp8-format"},
        {"linear biases with EP", moe_set_biases_ep, "MoE linear biases with expert parallelism "
                                                     "(--expert-model-parallel-size 2) are not built yet"},
        {"per-token loss", moe_set_per_token_loss, "MoE with --calculate-per-token-loss is not built yet"},
    };
    for (size_t i = 0; i < sizeof(later) / sizeof(later[0]); i++) {
        mt_config c = moe_base(1);
        later[i].set(&c);
        mt_error err, direct;
        EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, later[i].says) &&
                   !strchr(err.message, '\n'),
               "%s: '%s'", later[i].what, err.message);
        EXPECT(mt_config_check_supported(&c, &direct) == MT_ERR_CONFIG && !strcmp(direct.message, err.message),
               "%s: check_supported says '%s'", later[i].what, direct.message);
    }
    /* what stays allowed with MoE: data parallelism with the distributed optimizer and its overlap, bf16, fp16,
     * dropout, optimizer offload; capacity with position dropping and padding below the tokens */
    mt_config ok = moe_base(2);
    test_config_ddp(&ok, 1, 1, 1, 0);
    ok.precision = MT_BF16;
    ok.hidden_dropout = ok.attention_dropout = 0.1;
    ok.optimizer_cpu_offload = 1;
    ok.moe_expert_capacity_factor = 1.0;
    ok.moe_token_drop_position = 1;
    ok.moe_pad_expert_input_to_capacity = 1;
    ok.moe_router_score_sigmoid = 1;
    ok.moe_router_enable_expert_bias = 1;
    ok.moe_router_num_groups = 4;
    ok.moe_router_group_topk = 2;
    ok.moe_shared_expert_intermediate_size = 64;
    ok.moe_shared_expert_gate = 1;
    ok.moe_load_balancing = MT_MOE_AUX_LOSS | MT_MOE_SEQ_AUX_LOSS | MT_MOE_GLOBAL_AUX_LOSS;
    ok.moe_aux_loss_coeff[1] = ok.moe_aux_loss_coeff[2] = 1e-3;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&ok, &err), &err);
    EXPECT(ok.moe_ffn_hidden_size == 32, "expert width");
    /* activation recompute (issue #34): selective, and full with PP = 2 at EP = 1: accepted */
    {
        mt_config r = moe_base(1);
        moe_set_recompute(&r);
        EXPECT_OK(mt_config_finalize(&r, &err), &err);
        mt_config f = moe_base(2);
        f.pipeline_model_parallel_size = 2;
        f.recompute.granularity = MT_RECOMPUTE_FULL;
        f.recompute.method = MT_RECOMPUTE_UNIFORM;
        f.recompute.num_layers = 1;
        EXPECT_OK(mt_config_finalize(&f, &err), &err);
        EXPECT_OK(mt_config_check_supported(&f, &err), &err);
    }
    /* squared-ReLU experts (the model's activation with --squared-relu, as Megatron's experts): accepted, and
     * fc1 as wide as the expert (no gate half) */
    {
        mt_config q = moe_base(1);
        moe_set_squared_relu(&q);
        EXPECT_OK(mt_config_finalize(&q, &err), &err);
        EXPECT_OK(mt_config_check_supported(&q, &err), &err);
    }
    /* GELU experts with biases (no shared expert: Megatron refuses biases there): accepted, and the layout has the
     * router's bias [E] and each expert's fc1 bias [fe] (GELU: fc1 as wide as the expert) and fc2 bias [h] */
    {
        mt_config g = moe_base(1);
        moe_set_gelu_biases(&g);
        EXPECT_OK(mt_config_finalize(&g, &err), &err);
        EXPECT_OK(mt_config_check_supported(&g, &err), &err);
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        mt_param_layout(&g, info);
        const int64_t Lm = mt_moe_num_layers(&g), E = g.num_experts, fe = mt_moe_ffn(&g), h = g.hidden_size;
        EXPECT(info[MT_P_ROUTER_BIAS].numel == Lm * E && info[MT_P_EXPERT_FC1_BIAS].numel == Lm * E * fe &&
                   info[MT_P_EXPERT_FC2_BIAS].numel == Lm * E * h && info[MT_P_EXPERT_FC1_WEIGHT].numel == Lm * E * fe * h,
               "GELU experts with biases: router bias %lld, fc1 bias %lld, fc2 bias %lld, fc1 %lld elements",
               (long long)info[MT_P_ROUTER_BIAS].numel, (long long)info[MT_P_EXPERT_FC1_BIAS].numel,
               (long long)info[MT_P_EXPERT_FC2_BIAS].numel, (long long)info[MT_P_EXPERT_FC1_WEIGHT].numel);
        EXPECT(info[MT_P_ROUTER_BIAS].init == 2 && !info[MT_P_ROUTER_BIAS].weight_decay &&
                   info[MT_P_EXPERT_FC1_BIAS].init == 0 && info[MT_P_EXPERT_FC2_BIAS].init == 0,
               "the router's bias starts normal(std) as Megatron's router initialises it, the experts' at 0; no decay");
    }
    /* dense layers beside MoE ones (--moe-layer-freq 2, or a pattern): accepted, and the buffer stacks the dense
     * MLP's tensors over the dense layers and the MoE tensors over the MoE ones: every element once, each
     * (tensor, layer) slice where its layer has it */
    void (*mixed[2])(mt_config*) = {moe_set_dense_layers, moe_set_dense_pattern};
    for (int m = 0; m < 2; m++) {
        mt_config x = moe_base(1);
        mixed[m](&x);
        EXPECT_OK(mt_config_finalize(&x, &err), &err);
        mt_buffer_layout B;
        EXPECT_OK(mt_buffer_layout_build(&B, &x, &err), &err);
        int64_t sum = 0;
        int misplaced = 0;
        for (int i = 0; i < B.num_params; i++) {
            sum += B.params[i].numel;
            misplaced += mt_param_per_layer(B.params[i].tensor) &&
                         !mt_param_layer_has(&x, B.params[i].tensor, B.params[i].layer);
        }
        const int Lm = mt_moe_num_layers(&x);
        EXPECT(Lm > 0 && Lm < x.num_layers && sum == mt_num_parameters(&x) && B.canonical_size == sum && !misplaced &&
                   mt_buffer_offset(&B, MT_P_FC1_WEIGHT, mt_moe_layer(&x, 0) ? 0 : 1) < 0,
               "mixed layers %d: %lld of %lld elements, %d misplaced", m, (long long)sum,
               (long long)mt_num_parameters(&x), misplaced);
        mt_buffer_layout_free(&B);
    }
    /* expert parallelism with the all-to-all dispatcher: EP = DP, and EP below DP (EDP = 2) */
    for (int world = 2; world <= 4; world += 2) {
        mt_config e = moe_base(world);
        e.expert_model_parallel_size = 2;
        e.moe_token_dispatcher_alltoall = 1;
        test_config_ddp(&e, 1, 1, 1, 0);
        EXPECT_OK(mt_config_finalize(&e, &err), &err);
        const mt_rank_coords last = mt_rank_coordinates(&e, world - 1);
        EXPECT(last.dp == world - 1 && last.ep == 1 && last.edp == world / 2 - 1, "rank %d: ep %d edp %d", world - 1,
               last.ep, last.edp);
    }
    mt_config fp16 = moe_base(1);
    fp16.precision = MT_FP16;
    fp16.moe_ffn_hidden_size = 0; /* Megatron's default: --ffn-hidden-size */
    EXPECT_OK(mt_config_finalize(&fp16, &err), &err);
    EXPECT(fp16.moe_ffn_hidden_size == 96 && mt_moe_ffn(&fp16) == 96, "derived expert width %d", fp16.moe_ffn_hidden_size);
    /* --plan-layouts lists a layout this build lacks as refused with the same line */
    mt_config two = moe_base(2); /* global batch 4, checked on one GPU as train_gpt --plan-layouts does */
    two.world_size = 1;
    EXPECT_OK(mt_config_finalize(&two, &err), &err);
    mt_layout_candidate k[16];
    int n = 0;
    EXPECT_OK(mt_plan_layouts(&two, NULL, 2, k, 16, &n, &err), &err);
    int dp_ok = 0, pp_ok = 0;
    for (int i = 0; i < n; i++) {
        if (k[i].tp == 1 && k[i].pp == 1) dp_ok = !k[i].refused;
        if (k[i].pp == 2) pp_ok = !k[i].refused; /* MoE with PP (issue #34) */
    }
    EXPECT(dp_ok && pp_ok, "%d layouts: DP 2 planned %d, PP 2 planned %d", n, dp_ok, pp_ok);
    return TEST_PASS;
}

/* ---- flags ------------------------------------------------------------------------------------ */

/* a small mock-data job with extra flags (NULL-ended), parsed and applied; 0 or -1 with msg */
static int moe_flags(tg_flags* v, const char* const* extra, char* msg, size_t size) {
    const char* base[] = {"train_gpt", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                          "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                          "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--swiglu",
                          "--disable-bias-linear"};
    char* argv[96];
    int n = flags_argv_with(base, (int)(sizeof(base) / sizeof(base[0])), extra, argv);
    tg_flags_init(v);
    if (tg_flags_parse(v, n, argv, msg, size) != 0 || tg_flags_apply(v, msg, size) != 0) return -1;
    return 0;
}

static test_result test_moe_flags(void) {
    static tg_flags v;
    char msg[512] = "";
    /* Megatron's defaults: --num-experts alone */
    const char* only[] = {"--num-experts", "8", NULL};
    EXPECT(moe_flags(&v, only, msg, sizeof(msg)) == 0, "%s", msg);
    const mt_config* c = &v.cfg;
    EXPECT(c->num_experts == 8 && c->moe_layer_freq == 1 && c->moe_layer_pattern_len == 0 && c->moe_ffn_hidden_size == 0 &&
           c->moe_router_topk == 2 && !c->moe_router_score_sigmoid && !c->moe_router_pre_softmax &&
           c->moe_router_topk_scaling_factor == 0 && c->moe_router_num_groups == 0 && c->moe_router_group_topk == 0 &&
           c->moe_load_balancing == MT_MOE_AUX_LOSS && c->moe_aux_loss_coeff[0] == 0 && c->moe_z_loss_coeff == 0 &&
           !c->moe_router_enable_expert_bias && c->moe_router_bias_update_rate == 1e-3 && !c->moe_router_dtype_fp32 &&
           c->moe_expert_capacity_factor == 0 && !c->moe_token_drop_position && !c->moe_pad_expert_input_to_capacity &&
           c->moe_shared_expert_intermediate_size == 0 && !c->moe_shared_expert_gate && !c->moe_grouped_gemm &&
           !c->moe_token_dispatcher_alltoall && c->expert_model_parallel_size == 1 &&
           c->expert_tensor_parallel_size == 0 && !c->moe_per_layer_logging, "defaults");
    /* every flag, --flag=value where argparse takes it, the lists */
    const char* all[] = {"--num-experts=16", "--moe-layer-freq", "([1]*2)", "--moe-ffn-hidden-size", "48",
                         "--moe-router-topk=4", "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
                         "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4",
                         "--moe-router-group-topk=2", "--moe-router-load-balancing-type", "seq_aux_loss", "aux_loss",
                         "--moe-aux-loss-coeff", "1e-3", "1e-2", "--moe-z-loss-coeff", "1e-4",
                         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate=2e-3", "--moe-router-dtype",
                         "fp32", "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
                         "--moe-pad-expert-input-to-capacity", "--moe-shared-expert-intermediate-size", "64",
                         "--moe-shared-expert-gate", "--moe-grouped-gemm", "--moe-token-dispatcher-type=alltoall",
                         "--moe-shared-expert-overlap", "--expert-model-parallel-size", "1",
                         "--expert-tensor-parallel-size", "1", "--moe-per-layer-logging", "--moe-permute-fusion",
                         "--moe-router-fusion", NULL};
    EXPECT(moe_flags(&v, all, msg, sizeof(msg)) == 0, "%s", msg);
    EXPECT(c->num_experts == 16 && c->moe_layer_pattern_len == 2 && c->moe_layer_pattern[0] == 1 &&
           c->moe_layer_pattern[1] == 1 && c->moe_ffn_hidden_size == 48 && c->moe_router_topk == 4 &&
           c->moe_router_score_sigmoid && c->moe_router_pre_softmax && c->moe_router_topk_scaling_factor == 2.5 &&
           c->moe_router_num_groups == 4 && c->moe_router_group_topk == 2 &&
           c->moe_load_balancing == (MT_MOE_AUX_LOSS | MT_MOE_SEQ_AUX_LOSS) && c->moe_aux_loss_coeff[1] == 1e-3 &&
           c->moe_aux_loss_coeff[0] == 1e-2 && c->moe_aux_loss_coeff[2] == 0 && c->moe_z_loss_coeff == 1e-4 &&
           c->moe_router_enable_expert_bias && c->moe_router_bias_update_rate == 2e-3 && c->moe_router_dtype_fp32 &&
           c->moe_expert_capacity_factor == 1.5 && c->moe_token_drop_position && c->moe_pad_expert_input_to_capacity &&
           c->moe_shared_expert_intermediate_size == 64 && c->moe_shared_expert_gate && c->moe_grouped_gemm &&
           c->moe_token_dispatcher_alltoall && c->expert_model_parallel_size == 1 &&
           c->expert_tensor_parallel_size == 1 && c->moe_per_layer_logging, "every flag landed");
    char line[1024];
    tg_flags_info_line(&v, line, sizeof(line));
    EXPECT(strstr(line, "--moe-permute-fusion") && strstr(line, "--moe-router-fusion") &&
           strstr(line, "--moe-shared-expert-overlap"), "the startup line: %s", line);
    mt_config f = v.cfg;
    f.vocab_size = 256;
    mt_error err;
    /* capacity 1.5 of 64 tokens x 4 / 16 = 24 < 64: padding allowed; no shared expert with biases here */
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    /* "none" alone: no aux loss */
    const char* none[] = {"--num-experts", "8", "--moe-router-load-balancing-type", "none", NULL};
    EXPECT(moe_flags(&v, none, msg, sizeof(msg)) == 0 && c->moe_load_balancing == 0, "none: %s", msg);
    /* --moe-layer-freq's forms */
    struct { const char* text; int len, freq; const char* pattern; } forms[] = {
        {"4", 0, 4, ""}, {"[1,0,1]", 3, 1, "101"}, {"([0]*3+[1]*5)", 8, 1, "00011111"},
        {"([1]*3+[0]*1)*3", 12, 1, "111011101110"}, {"2*[1]+[0, 1]", 4, 1, "1101"}, {" [ 1 , 1 ] ", 2, 1, "11"},
        {"([0]+[1]*23)", 24, 1, "011111111111111111111111"}};
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        mt_config p;
        mt_config_defaults(&p);
        EXPECT_OK(mt_moe_layer_freq_parse(forms[i].text, &p, &err), &err);
        EXPECT(p.moe_layer_pattern_len == forms[i].len && p.moe_layer_freq == forms[i].freq, "%s: %d entries, freq %d",
               forms[i].text, p.moe_layer_pattern_len, p.moe_layer_freq);
        for (int l = 0; l < forms[i].len; l++)
            EXPECT(p.moe_layer_pattern[l] == forms[i].pattern[l] - '0', "%s: entry %d", forms[i].text, l);
    }
    const char* bad_forms[] = {"0", "-1", "abc", "[2]", "([1]*3", "[1,0]x", "[1]*", "[]", "1.5", "[1]*100000"};
    for (size_t i = 0; i < sizeof(bad_forms) / sizeof(bad_forms[0]); i++) {
        mt_config p;
        mt_config_defaults(&p);
        EXPECT(mt_moe_layer_freq_parse(bad_forms[i], &p, &err) == MT_ERR_ARG && strstr(err.message, "--moe-layer-freq") &&
                   !strchr(err.message, '\n'),
               "%s: '%s'", bad_forms[i], err.message);
    }
    char deep[200]; /* nesting is bounded (a recursive reader): 70 parentheses are refused, 60 are read */
    for (int depth = 60; depth <= 70; depth += 10) {
        int at = 0;
        for (int i = 0; i < depth; i++) deep[at++] = '(';
        at += snprintf(deep + at, sizeof(deep) - at, "[1]");
        for (int i = 0; i < depth; i++) deep[at++] = ')';
        deep[at] = 0;
        mt_config p;
        mt_config_defaults(&p);
        const mt_status st = mt_moe_layer_freq_parse(deep, &p, &err);
        EXPECT(depth == 60 ? st == MT_OK && p.moe_layer_pattern_len == 1
                           : st == MT_ERR_ARG && strstr(err.message, "nested more than 64 deep"),
               "%d deep: '%s'", depth, err.message);
    }
    /* the flags' refusals: not built, argparse's, Megatron's list rule; each one line naming the flag */
    struct { const char* a[9]; const char* says; } bad[] = {
        {{"--num-experts", "8", "--moe-router-score-function", "sqrtsoftplus"}, "sqrtsoftplus is not built here"},
        {{"--num-experts", "8", "--moe-router-dtype", "fp64"}, "--moe-router-dtype fp64 is not built here"},
        {{"--num-experts", "8", "--moe-token-dispatcher-type", "flex"}, "flex (DeepEP / HybridEP) is not built here"},
        {{"--num-experts", "8", "--moe-router-load-balancing-type", "sinkhorn"}, "sinkhorn is not built here"},
        {{"--num-experts", "8", "--moe-router-load-balancing-type", "quantile_balancing"}, "quantile_balancing is not built"},
        {{"--num-experts", "8", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"},
         "moe_aux_loss_coeff must be a list of the same length"}, /* 2 types, the default single coefficient */
        {{"--num-experts", "8", "--moe-aux-loss-coeff", "1e-2", "1e-3"}, "(2 coefficients for 1 types)"},
        {{"--num-experts", "8", "--moe-router-load-balancing-type", "aux_loss", "aux_loss", "--moe-aux-loss-coeff", "0",
          "0"}, "aux_loss given twice"},
        {{"--num-experts", "8", "--moe-router-load-balancing-type", "switch"}, "expected one of"},
        {{"--num-experts", "8", "--moe-expert-capacity-factor", "0"}, "--moe-expert-capacity-factor 0: must be > 0"},
        {{"--num-experts", "8", "--moe-expert-capacity-factor", "-1"}, "must be > 0"},
        {{"--num-experts", "8", "--moe-router-topk", "0"}, "--moe-router-topk 0: must be between 1"},
        {{"--num-experts", "-1"}, "--num-experts -1: must be between 0"},
        {{"--num-experts", "8", "--moe-shared-expert-overlap"}, "moe_shared_expert_overlap only works with alltoall"},
        {{"--num-experts", "8", "--moe-layer-freq", "[1,2]"}, "--moe-layer-freq [1,2]: an entry other than 0 or 1"},
        {{"--moe-apply-probs-on-input"}, "--moe-apply-probs-on-input: the probabilities on the experts' input is not built"},
        {{"--moe-input-jitter-eps", "0.1"}, "--moe-input-jitter-eps: input jitter is not built"},
        {{"--moe-router-force-load-balancing"}, "forced balanced routing is not built"},
        {{"--moe-latent-size", "64"}, "latent expert projections is not built"},
        {{"--moe-use-upcycling"}, "upcycling a dense checkpoint is not built"},
        {{"--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"}, "Do not set --moe-layer-recompute with full recompute granularity."},
        {{"--moe-router-padding-for-fp8"}, "padding the routing map is not built"},
        {{"--moe-router-padding-for-quantization"}, "padding the routing map is not built"},
        {{"--moe-aux-loss-coeff", "x"}, "--moe-aux-loss-coeff x: not a number"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        EXPECT(moe_flags(&v, bad[i].a, msg, sizeof(msg)) != 0 && strstr(msg, bad[i].says) && !strchr(msg, '\n'),
               "%s %s: '%s'", bad[i].a[0], bad[i].a[1] ? bad[i].a[1] : "", msg);
    }
    /* MoE flags without --num-experts: refused once the config is finalized (a dense model has no experts) */
    const char* orphan[] = {"--moe-ffn-hidden-size", "64", NULL};
    EXPECT(moe_flags(&v, orphan, msg, sizeof(msg)) == 0, "%s", msg);
    f = v.cfg;
    f.vocab_size = 256;
    EXPECT(mt_config_finalize(&f, &err) == MT_ERR_CONFIG && strstr(err.message, "--moe-ffn-hidden-size needs --num-experts"),
           "'%s'", err.message);
    /* recompute (issue #34): --moe-layer-recompute is Megatron's selective with "moe" appended to the modules
     * (core_attn by default, or the ones given); moe_act needs --moe-grouped-gemm (Megatron's check) */
    const char* layer_rc[] = {"--num-experts", "8", "--moe-layer-recompute", NULL};
    EXPECT(moe_flags(&v, layer_rc, msg, sizeof(msg)) == 0 && v.cfg.recompute.granularity == MT_RECOMPUTE_SELECTIVE &&
               v.cfg.recompute.modules == (MT_RECOMPUTE_CORE_ATTN | MT_RECOMPUTE_MOE),
           "--moe-layer-recompute: '%s', granularity %d modules %d", msg, (int)v.cfg.recompute.granularity,
           v.cfg.recompute.modules);
    const char* layer_rc_mlp[] = {"--num-experts", "8", "--moe-layer-recompute", "--recompute-activations",
                                  "--recompute-modules", "mlp", NULL};
    EXPECT(moe_flags(&v, layer_rc_mlp, msg, sizeof(msg)) == 0 &&
               v.cfg.recompute.modules == (MT_RECOMPUTE_MLP | MT_RECOMPUTE_MOE), "with mlp: '%s', modules %d", msg,
           v.cfg.recompute.modules);
    const char* moe_act[] = {"--num-experts", "8", "--recompute-activations", "--recompute-modules", "moe_act", NULL};
    EXPECT(moe_flags(&v, moe_act, msg, sizeof(msg)) == 0 && v.cfg.recompute.modules == MT_RECOMPUTE_MOE_ACT, "moe_act: '%s'",
           msg);
    f = v.cfg;
    f.vocab_size = 256;
    EXPECT(mt_config_finalize(&f, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "moe_act in recompute_modules is only supported with moe_grouped_gemm."),
           "moe_act without --moe-grouped-gemm: '%s'", err.message);
    f.moe_grouped_gemm = 1;
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    return TEST_PASS;
}

/* Megatron's Mixtral 8x7B script parses whole; its layout (EP 8, PP 4) is refused as not built yet, and
 * shrunk to one GPU it is a model this build trains. */
static test_result test_moe_mixtral_script(void) {
    static flags_script s;
    if (!flags_script_read("mixtral_8x7b.txt", &s)) SKIP_OR_FAIL_STRICT("dev/data/megatron_scripts/ not found");
    static tg_flags v;
    char msg[512] = "";
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, s.argc, s.argv, msg, sizeof(msg)) == 0 && tg_flags_apply(&v, msg, sizeof(msg)) == 0, "%s",
           msg);
    mt_config c = v.cfg;
    EXPECT(c.num_experts == 8 && c.moe_router_topk == 2 && c.moe_load_balancing == MT_MOE_AUX_LOSS &&
           c.moe_aux_loss_coeff[0] == 1e-2 && c.moe_grouped_gemm && c.moe_token_dispatcher_alltoall &&
           c.expert_model_parallel_size == 8 && c.pipeline_model_parallel_size == 4 && c.swiglu && !c.add_bias_linear,
           "the script's MoE");
    c.vocab_size = 32000;
    c.world_size = 32;
    mt_error err;
    EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, "MoE with pipeline parallelism"),
           "EP 8 / PP 4: '%s'", err.message);
    /* shrunk: dev/megatron_scripts_check.py's sizes, one GPU */
    static char* argv[600];
    int n = 0;
    for (int i = 0; i < s.argc; i++) argv[n++] = s.argv[i];
    const char* small[] = {"--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704",
                           "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "256",
                           "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "8",
                           "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1"};
    for (size_t i = 0; i < sizeof(small) / sizeof(small[0]); i++) argv[n++] = (char*)small[i];
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, n, argv, msg, sizeof(msg)) == 0 && tg_flags_apply(&v, msg, sizeof(msg)) == 0, "%s", msg);
    c = v.cfg;
    c.vocab_size = 32000;
    c.world_size = 1;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT_OK(mt_config_check_supported(&c, &err), &err);
    EXPECT(mt_moe_num_layers(&c) == 4 && c.moe_ffn_hidden_size == 704, "shrunk: %d MoE layers", mt_moe_num_layers(&c));
    return TEST_PASS;
}

/* ---- the memory plan, FLOPs, the checkpoint header ---------------------------------------------- */

/* An MoE model against the dense one whose MLP is its shared expert: the activation arena grows by
 * exactly the MoE regions (sizes by hand), the workspace by the MoE state and the optimizer's extra pieces. */
static test_result test_moe_plan_counts_regions(void) {
    mt_config m = moe_base(1), d;
    m.precision = MT_BF16;
    m.ffn_hidden_size = 96;
    m.moe_shared_expert_intermediate_size = 96;
    m.moe_shared_expert_gate = 1;
    d = m;
    d.num_experts = 0;
    d.moe_ffn_hidden_size = d.moe_shared_expert_intermediate_size = d.moe_shared_expert_gate = 0;
    d.moe_aux_loss_coeff[0] = d.moe_z_loss_coeff = 0;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&m, &err), &err);
    EXPECT_OK(mt_config_finalize(&d, &err), &err);
    mt_activation_layout am, ad;
    mt_activation_layout_compute(&m, 2, 1, 1, NULL, &am);
    mt_activation_layout_compute(&d, 2, 1, 1, NULL, &ad);
    /* by hand: N = 2 x 32 tokens, E 8, k 2 (Rmax = 128), h 64, fe 32 (f1e 64), B 2, bf16, 2 layers */
    const int64_t N = 64, E = 8, R = 128, h = 64, fe = 32, f1e = 64, B = 2, L = 2;
    const struct { int region; int64_t bytes; } want[] = {
        {MT_ACT_MOE_XPERM, R * h * 2}, {MT_ACT_MOE_Y, R * h * 2}, {MT_ACT_MOE_DZ, R * f1e * 2},
        {MT_ACT_MOE_DACT, R * fe * 2}, {MT_ACT_MOE_DLOGITS, N * E * 4}, {MT_ACT_MOE_DPROBS, N * E * 4},
        {MT_ACT_MOE_X32, N * h * 4}, {MT_ACT_MOE_W32, E * h * 4},
        {MT_ACT_MOE_WORK, (2 * N * E + 4 * B * E + 16 * E + 256) * 4}, {MT_ACT_MOE_STATS, (2 * (B + 1) * E + 64) * 4},
        {MT_ACT_MOE_LOGITS, L * N * E * 4}, {MT_ACT_MOE_PROBS, L * N * E * 4}, {MT_ACT_MOE_ROW, L * N * E * 4},
        {MT_ACT_MOE_TOKEN, L * R * 4}, {MT_ACT_MOE_ROW_PROB, L * R * 4}, {MT_ACT_MOE_COUNTS, L * (2 * E + 1) * 4},
        {MT_ACT_MOE_AUXW, L * B * E * 4}, {MT_ACT_MOE_FC1, L * R * f1e * 2}, {MT_ACT_MOE_ACT, L * R * fe * 2},
        {MT_ACT_MOE_SHARED, L * N * h * 2}, {MT_ACT_MOE_GATE, L * N * 4}};
    int64_t moe_bytes = 0;
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        EXPECT((int64_t)am.bytes[want[i].region] == want[i].bytes && ad.bytes[want[i].region] == 0,
               "region %d: %zu bytes, by hand %lld (dense %zu)", want[i].region, am.bytes[want[i].region],
               (long long)want[i].bytes, ad.bytes[want[i].region]);
        moe_bytes += (want[i].bytes + 255) / 256 * 256;
    }
    EXPECT(MT_ACT_MOE_STATS < MT_ACT_RESIDUAL && MT_ACT_MOE_LOGITS > MT_ACT_ACT && MT_ACT_MOE_GATE < MT_ACT_LNF,
           "scratch first, the per-layer regions together");
    for (int r = 0; r < MT_ACT_REGIONS; r++) /* every other region as the dense model's (its MLP = the shared expert) */
        if (!(r >= MT_ACT_MOE_XPERM && r <= MT_ACT_MOE_STATS) && !(r >= MT_ACT_MOE_LOGITS && r <= MT_ACT_MOE_GATE))
            EXPECT(am.bytes[r] == ad.bytes[r], "region %d: %zu vs %zu", r, am.bytes[r], ad.bytes[r]);
    EXPECT((int64_t)(am.total - ad.total) == moe_bytes, "arena grows by %lld, the MoE regions %lld",
           (long long)(am.total - ad.total), (long long)moe_bytes);
    /* the plan counts the arena and the MoE state */
    mt_memory_plan pm, pd;
    EXPECT_OK(mt_memory_plan_compute(&m, NULL, &pm, &err), &err);
    EXPECT_OK(mt_memory_plan_compute(&d, NULL, &pd, &err), &err);
    EXPECT((int64_t)(pm.activation_bytes - pd.activation_bytes) == moe_bytes, "plan's arena");
    const int64_t chunks = pm.optimizer_chunks - pd.optimizer_chunks;
    /* (L, E) = (2, 8): bias and tokens 64 B each, sums + average 96 B, losses 32 B, pointer table 6 x 3 x 8 x 8 =
     * 1152 B, each rounded up to 256: 4 x 256 + 1280; (3, 128): 2 x 1536 + 2048 + 256 + 18432; both with the 4 side
     * streams' cuBLAS workspaces of 32 MiB each */
    const size_t side = (size_t)4 * (32 << 20);
    EXPECT(MT_MOE_STATE_BYTES(2, 8) == 4 * 256 + 1280 + side &&
               MT_MOE_STATE_BYTES(3, 128) == 2 * 1536 + 2048 + 256 + 18432 + side && MT_MOE_STATE_BYTES(0, 8) == 0,
           "MT_MOE_STATE_BYTES");
    EXPECT((int64_t)(pm.workspace_bytes - pd.workspace_bytes) ==
               (int64_t)MT_MOE_STATE_BYTES(2, 8) + chunks * (8 + MT_OPT_CHUNK_BYTES),
           "workspace grows by %lld (%lld more optimizer pieces)", (long long)(pm.workspace_bytes - pd.workspace_bytes),
           (long long)chunks);
    EXPECT(pm.num_parameters == mt_num_parameters(&m) && pm.total_bytes > pd.total_bytes, "parameters");
    return TEST_PASS;
}

/* Megatron's num_floating_point_operations with MoE, by hand for two configurations: 3 (fwd, dgrad, wgrad)
 * x 2 (FMA) x tokens x [h (f x 3 x dense layers + fe x k x 3 x MoE layers + fs x 3 x MoE layers)
 * + attention (h (n d + 2 g d) + n d h) per layer + h V] + batch s^2 x 6 n d per layer (SwiGLU: 3). */
static test_result test_moe_flops(void) {
    mt_config m = moe_ref_config(&moe_ref_cases[0]); /* 2 MoE layers, h 64, 4 heads of 16 in 2 groups, fe 32, k 2, V 256 */
    /* per token: 6 x 64 x (32 x 2 x 3 x 2) = 147456 (experts) + 2 x 6 x (64 x 128 + 64 x 64) = 147456
     * (attention) + 6 x 64 x 256 = 98304 (logits): 393216 x 128 tokens, + 4 x 32^2 x 6 x 64 x 2 */
    EXPECT(mt_flops_per_iteration(&m, 4) == 393216.0 * 128 + 3145728.0, "mixtral_tiny %.0f",
           mt_flops_per_iteration(&m, 4));
    mt_config d = moe_ref_config(&moe_ref_cases[1]); /* 3 layers: 1 dense (f 96), 2 MoE (fe 24, k 4, shared 48) */
    /* per token: 6 x 64 x (96 x 3 + 24 x 4 x 3 x 2 + 48 x 3 x 2) = 442368, attention 3 x 73728, logits 98304 */
    EXPECT(mt_flops_per_iteration(&d, 4) == (442368.0 + 221184.0 + 98304.0) * 128 + 4718592.0, "deepseek_tiny %.0f",
           mt_flops_per_iteration(&d, 4));
    mt_config dense = d;
    dense.num_experts = 0; /* without experts: the dense formula of before, 3 layers of f 96 */
    EXPECT(mt_flops_per_iteration(&dense, 4) == (6.0 * 64 * 96 * 3 * 3 + 221184.0 + 98304.0) * 128 + 4718592.0,
           "dense %.0f", mt_flops_per_iteration(&dense, 4));
    return TEST_PASS;
}

/* The header's MoE words: an MoE checkpoint round-trips (its parameter count from the header), a dense one
 * does not load into an MoE run nor the reverse (one line naming both), inconsistent words are refused. */
static test_result test_moe_checkpoint_header(void) {
    mt_config m = moe_base(1), d = moe_base(1);
    d.num_experts = 0;
    d.moe_ffn_hidden_size = 0;
    d.moe_aux_loss_coeff[0] = d.moe_z_loss_coeff = 0;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&m, &err), &err);
    EXPECT_OK(mt_config_finalize(&d, &err), &err);
    int64_t hm[MT_CK_HEADER_WORDS], hd[MT_CK_HEADER_WORDS];
    const double scale = 1.0;
    mt_checkpoint_header_init(hm, &m);
    mt_checkpoint_header_init(hd, &d);
    memcpy(&hm[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
    memcpy(&hd[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
    EXPECT(hm[MT_CK_NUM_EXPERTS] == 8 && hm[MT_CK_MOE_FFN] == 32 && hm[MT_CK_MOE_LAYERS] == 2 &&
           hm[MT_CK_MOE_LAYER_FREQ] == 1 && hd[MT_CK_NUM_EXPERTS] == 0 && hd[MT_CK_MOE_LAYER_FREQ] == 0, "MoE words");
    /* the layers' word: the smallest N giving them, whichever form named them; else a negative hash */
    mt_config w = moe_ref_config(&moe_ref_cases[1]); /* [0,1,1]: no N's */
    const int64_t pattern_word = mt_moe_layers_word(&w);
    EXPECT(pattern_word < 0, "[0,1,1]: %lld", (long long)pattern_word);
    w.num_layers = 4;
    const struct { const char* freq; int64_t word; } words[] = {
        {"1", 1}, {"[1,1,1,1]", 1}, {"2", 2}, {"[1,0,1,0]", 2}, {"3", 3}, {"[1,0,0,1]", 3}, {"4", 4}, {"9", 4},
        {"[1,0,0,0]", 4}};
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++) {
        EXPECT_OK(mt_moe_layer_freq_parse(words[i].freq, &w, &err), &err);
        EXPECT(mt_moe_layers_word(&w) == words[i].word, "%s: %lld", words[i].freq, (long long)mt_moe_layers_word(&w));
    }
    EXPECT_OK(mt_moe_layer_freq_parse("[1,1,0,1]", &w, &err), &err);
    EXPECT(mt_moe_layers_word(&w) < 0 && mt_moe_layers_word(&w) != pattern_word, "[1,1,0,1]");
    mt_config back;
    EXPECT_OK(mt_checkpoint_header_check(hm, "moe", &back, &err), &err);
    EXPECT(mt_num_parameters(&back) == mt_num_parameters(&m) && back.num_experts == 8 && mt_moe_num_layers(&back) == 2,
           "the model from the header");
    EXPECT_OK(mt_checkpoint_header_check_model(hm, "moe", &m, 0, &err), &err);
    EXPECT(mt_checkpoint_header_check_model(hd, "dense", &m, 1, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "--num-experts (0: a dense model) 0 but this run has 8"),
           "dense into MoE: '%s'", err.message);
    EXPECT(mt_checkpoint_header_check_model(hm, "moe", &d, 1, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "--num-experts (0: a dense model) 8 but this run has 0"),
           "MoE into dense: '%s'", err.message);
    mt_config other = m; /* another expert width */
    other.moe_ffn_hidden_size = 64;
    EXPECT(mt_checkpoint_header_check_model(hm, "moe", &other, 1, &err) == MT_ERR_CONFIG &&
               strstr(err.message, "expert width (--moe-ffn-hidden-size) 32 but this run has 64"), "'%s'", err.message);
    int64_t bad[MT_CK_HEADER_WORDS];
    memcpy(bad, hm, sizeof(bad));
    bad[MT_CK_MOE_LAYERS] = 0;
    EXPECT(mt_checkpoint_header_check(bad, "bad", NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "MoE words"),
           "'%s'", err.message);
    memcpy(bad, hm, sizeof(bad));
    bad[MT_CK_MOE_LAYER_FREQ] = 2; /* 1 of 2 layers, not the 2 the header says */
    EXPECT(mt_checkpoint_header_check(bad, "bad", NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "MoE layers"),
           "'%s'", err.message);
    memcpy(bad, hd, sizeof(bad));
    bad[MT_CK_MOE_SHARED] = 64;
    EXPECT(mt_checkpoint_header_check(bad, "bad", NULL, &err) == MT_ERR_FORMAT, "shared expert without experts");
    /* Hugging Face export: an MoE model of Llama's flavour is a Mixtral (a Qwen3-MoE with --qk-layernorm), any
     * other is refused in one line (prepro/hf_checkpoint.h) */
    const mt_hf_arch* arch = NULL;
    const mt_status hs = mt_hf_arch_for_config(&m, &arch, &err);
    EXPECT(hs == MT_OK ? arch == (m.qk_layernorm ? &mt_hf_qwen3_moe_arch : &mt_hf_mixtral_arch)
                       : (hs == MT_ERR_CONFIG && !arch && strstr(err.message, "MoE model") && !strchr(err.message, '\n')),
           "'%s'", err.message);
    EXPECT_OK(mt_hf_arch_for_config(&d, &arch, &err), &err);
    return TEST_PASS;
}

/* Expert parallelism's layouts (megatron.h sections 6-8): an EP rank's shard holds E / EP experts of each
 * expert tensor (and every other tensor whole); the EP ranks' shards put back together are the full model,
 * element for element; shard 1's first expert is the full model's expert E / EP; the buffer puts the experts'
 * tensors last in buckets of their own (ep = EP), which shard over the expert-data-parallel group; the plan
 * reserves the received rows' bound and the EP regions, which an EP = 1 run does not have. */
static test_result test_moe_ep_layout(void) {
    mt_config c = moe_base(4);
    c.expert_model_parallel_size = 2;
    c.moe_token_dispatcher_alltoall = 1;
    test_config_ddp(&c, 1, 1, 1, 0);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_config one = c;
    one.expert_model_parallel_size = 1;
    mt_param_info full[MT_NUM_PARAM_TENSORS], shard[MT_NUM_PARAM_TENSORS], shard1[MT_NUM_PARAM_TENSORS];
    const int64_t n = mt_param_layout(&c, full), ns = mt_param_layout_shard(&c, shard);
    EXPECT(mt_param_layout_shard(&one, shard1) == n, "EP = 1: the shard is the model");
    const int E = c.num_experts, El = E / 2;
    int64_t expert_elems = 0;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        const int cut = i >= MT_P_EXPERT_FC1_WEIGHT && i <= MT_P_EXPERT_FC2_BIAS;
        EXPECT(shard[i].ep_split == cut && shard[i].numel == (cut ? full[i].numel / 2 : full[i].numel),
               "%s: %lld of %lld", full[i].name, (long long)shard[i].numel, (long long)full[i].numel);
        if (cut) expert_elems += full[i].numel;
    }
    EXPECT(expert_elems > 0 && ns == n - expert_elems / 2, "shard %lld of %lld", (long long)ns, (long long)n);
    float* model = (float*)malloc(sizeof(float) * (size_t)n);
    float* back = (float*)calloc((size_t)n, sizeof(float));
    float* part = (float*)malloc(sizeof(float) * (size_t)ns);
    if (!model || !back || !part) {
        free(model), free(back), free(part);
        return TEST_FAIL;
    }
    for (int64_t i = 0; i < n; i++) model[i] = (float)(i + 1);
    for (int r = 0; r < 2; r++) {
        mt_tp_shard_copy(&c, r, model, part, 1);
        if (r == 1) { /* its first expert's fc1 row block is the model's expert El */
            const mt_param_info* f = &full[MT_P_EXPERT_FC1_WEIGHT];
            const int64_t per_expert = f->split_outer / E * f->split_rows * f->split_inner;
            EXPECT(part[shard[MT_P_EXPERT_FC1_WEIGHT].offset] == model[f->offset + El * per_expert],
                   "EP rank 1 holds experts %d..%d", El, E - 1);
        }
        mt_tp_shard_copy(&c, r, back, part, 0);
    }
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += back[i] != model[i];
    EXPECT(wrong == 0, "%lld elements not put back", (long long)wrong);
    free(model), free(back), free(part);
    /* the buffer of DP rank 3 (EP rank 1, EDP rank 1) */
    c.rank = 3;
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
    int first_expert_bucket = -1;
    for (int i = 0; i < B.num_params; i++) {
        const mt_buffer_param* p = &B.params[i];
        const int expert = shard[p->tensor].ep_split;
        const mt_buffer_bucket* k = &B.buckets[p->bucket];
        EXPECT(k->ep == (expert ? 2 : 0), "%s of layer %d in bucket %d (ep %d)", full[p->tensor].name, p->layer,
               p->bucket, k->ep);
        if (expert && first_expert_bucket < 0) first_expert_bucket = p->bucket;
        EXPECT(!expert || i >= B.num_params - 4 * c.num_layers || !shard[MT_P_EXPERT_FC1_BIAS].numel,
               "the experts' tensors come last");
    }
    EXPECT(first_expert_bucket > 0, "dense buckets first");
    const mt_buffer_bucket* k = &B.buckets[first_expert_bucket];
    int64_t begin, end, dense_begin, dense_end;
    mt_bucket_shard(k, 4, 3, &begin, &end);
    mt_bucket_shard(&B.buckets[0], 4, 3, &dense_begin, &dense_end);
    EXPECT(end - begin == (k->end - k->start) / 2 && begin == k->start + (end - begin) &&
               dense_end - dense_begin == (B.buckets[0].end - B.buckets[0].start) / 4,
           "expert bucket sharded over EDP = 2: [%lld, %lld) of [%lld, %lld)", (long long)begin, (long long)end,
           (long long)k->start, (long long)k->end);
    mt_buffer_layout_free(&B);
    /* the received rows' bound and the plan's EP regions */
    const int64_t N = (int64_t)c.micro_batch_size * c.seq_length;
    EXPECT(mt_moe_expert_rows(&c, N) == 2 * mt_moe_max_rows(&c, N) && mt_moe_expert_rows(&one, N) ==
                                                                          mt_moe_max_rows(&one, N),
           "dropless: every EP rank's rows");
    mt_config cap = c;
    cap.moe_expert_capacity_factor = 1.0;
    const int64_t C = mt_moe_capacity(&cap, N);
    EXPECT(C > 0 && mt_moe_expert_rows(&cap, N) == 2 * (El * C < N * c.moe_router_topk ? El * C : N * c.moe_router_topk),
           "capacity: EP x min(N k, El C)");
    mt_activation_layout a, a1;
    mt_activation_layout_compute(&c, c.num_layers, 1, 1, &c.recompute, &a);
    mt_activation_layout_compute(&one, one.num_layers, 1, 1, &one.recompute, &a1);
    const int64_t Rexp = mt_moe_expert_rows(&c, N);
    EXPECT(a.bytes[MT_ACT_MOE_EP_IN] == (size_t)(c.num_layers * Rexp * c.hidden_size * 4) &&
               a.bytes[MT_ACT_MOE_EP_COUNTS] == (size_t)(c.num_layers * E * 4) && a.bytes[MT_ACT_MOE_EP_INDEX] > 0 &&
               a1.bytes[MT_ACT_MOE_EP_IN] == 0 && a1.bytes[MT_ACT_MOE_EP_INDEX] == 0 && a1.bytes[MT_ACT_MOE_EP_DROW] == 0,
           "EP regions: %zu, %zu", a.bytes[MT_ACT_MOE_EP_IN], a1.bytes[MT_ACT_MOE_EP_IN]);
    return TEST_PASS;
}

static const test_case moe_config_tests[] = {
    {"moe_ep_layout", test_moe_ep_layout},
    {"moe_capacity_and_rows", test_moe_capacity_and_rows},
    {"moe_refusals", test_moe_refusals},
    {"moe_flags", test_moe_flags},
    {"moe_mixtral_script", test_moe_mixtral_script},
    {"moe_plan_counts_regions", test_moe_plan_counts_regions},
    {"moe_flops", test_moe_flops},
    {"moe_checkpoint_header", test_moe_checkpoint_header},
    {"moe_num_parameters_match_reference", test_moe_num_parameters_match_reference},
    {"moe_dense_layouts_unchanged", test_moe_dense_layouts_unchanged},
};

#endif
