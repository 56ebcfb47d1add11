/* tests/test_recompute.h — activation recompute (megatron.h mt_recompute, mt_recompute_position,
 * mt_recompute_replay; megatron.cu layer_forward and recompute_layer).
 *
 * Host: the rooms a slot gives each layer hold what the backward reads: a simulation of the trainer's
 * order (the forward, then per layer going down the replay or the selective recomputes, then the
 * layer's reads) tags every room with the layer whose value it holds, for every setting and every
 * chunk size up to the slot's; the plan's kept layers for given settings; the --recompute-* flags land
 * or are refused with Megatron's rules; train_gpt --plan names the setting and plans less.
 * GPU: the norm output recompute makes from saved statistics is the forward's bit for bit; a few
 * training steps with every recompute setting give the losses, the gradients and the final
 * weights of no recompute bit for bit (the recomputed forward is the forward's own kernels on the same
 * inputs), GPT-2 and Llama, fp32 and bf16, two micro-batches a step, and FP8 (three recipes); each trainer allocates
 * its setting's plan to the byte. Several GPUs (mpirun -np 2): the same under TP 2 with sequence
 * parallelism, DP 2 with the distributed optimizer, PP 2 (1F1B and interleaved). */
#ifndef MT_TEST_RECOMPUTE_H
#define MT_TEST_RECOMPUTE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "test_common.h"
#include "test_configs.h"

/* ---- host: the rooms ------------------------------------------------------------------------------ */

/* The per-layer regions; the first three are a layer's input (the residual stream, the first norm's
 * statistics), which a layer's forward writes for the next layer. */
enum { RC_REGIONS = 13, RC_MAX_LAYERS = 8 };
static const int rc_regions[RC_REGIONS] = {MT_ACT_RESIDUAL, MT_ACT_LN1_MEAN, MT_ACT_LN1_RSTD, MT_ACT_QKV,
                                           MT_ACT_PROBS,    MT_ACT_LSE,      MT_ACT_ATTN_OUT, MT_ACT_RESIDUAL_MID,
                                           MT_ACT_LN2,      MT_ACT_LN2_MEAN, MT_ACT_LN2_RSTD, MT_ACT_FC1,
                                           MT_ACT_ACT};
enum { RC_X = 0, RC_QKV = 3, RC_PROBS = 4, RC_MID = 7, RC_LN2 = 8, RC_FC1 = 11, RC_ACT = 12 };

typedef struct {
    const mt_recompute* rc;
    int count;
    int64_t kept[RC_REGIONS];               /* the slot's rooms (0: the config has no such region) */
    int tag[RC_REGIONS][2 * RC_MAX_LAYERS]; /* the layer whose value a room holds, -1: none */
    int bad;
    char what[256];
} rc_sim;

static void rc_room(rc_sim* m, int k, int layer, int write) {
    if (m->bad || m->kept[k] == 0) return;
    const int64_t room = mt_recompute_position(m->rc, rc_regions[k], m->count, layer);
    if (room < 0 || room >= m->kept[k]) {
        m->bad = 1;
        snprintf(m->what, sizeof(m->what), "region %d of layer %d: room %lld outside the slot's %lld", rc_regions[k],
                 layer, (long long)room, (long long)m->kept[k]);
    } else if (write) {
        m->tag[k][room] = layer;
    } else if (m->tag[k][room] != layer) {
        m->bad = 1;
        snprintf(m->what, sizeof(m->what), "region %d of layer %d: room %lld holds layer %d's", rc_regions[k], layer,
                 (long long)room, m->tag[k][room]);
    }
}

/* layer_forward: reads its input, writes its regions; with its output, the next layer's input (the
 * chunk's output: the residual stream only). */
static void rc_layer_forward(rc_sim* m, int l, int output) {
    for (int k = 0; k < 3; k++) rc_room(m, k, l, 0);
    for (int k = 3; k < RC_REGIONS; k++) rc_room(m, k, l, 1);
    if (!output) return;
    rc_room(m, RC_X, l + 1, 1);
    if (l + 1 < m->count) rc_room(m, 1, l + 1, 1), rc_room(m, 2, l + 1, 1);
}

/* The trainer's order for one chunk of `count` layers; 0 and m->what when a read finds the wrong layer. */
static int rc_simulate(rc_sim* m) {
    memset(m->tag, -1, sizeof(m->tag));
    m->bad = 0;
    for (int k = 0; k < 3; k++) rc_room(m, k, 0, 1); /* the embedding or the received input, the first norm */
    for (int l = 0; l < m->count; l++) rc_layer_forward(m, l, 1);
    rc_room(m, RC_X, m->count, 0); /* the output: the final norm's backward, or the send */
    const int modules = m->rc->modules ? m->rc->modules : MT_RECOMPUTE_CORE_ATTN;
    const int selective = m->rc->granularity == MT_RECOMPUTE_SELECTIVE;
    for (int l = m->count - 1; l >= 0; l--) {
        int64_t first = -1;
        if (mt_recompute_replay(m->rc, m->count, l, &first)) {
            if (first < 0 || first > l) {
                snprintf(m->what, sizeof(m->what), "layer %d replays from layer %lld", l, (long long)first);
                return 0;
            }
            for (int k = (int)first; k <= l; k++) rc_layer_forward(m, k, k < l);
        } else if (selective) {
            if (modules & MT_RECOMPUTE_LAYERNORM) rc_room(m, RC_MID, l, 0), rc_room(m, RC_LN2, l, 1);
            if (modules & MT_RECOMPUTE_MLP) rc_room(m, RC_LN2, l, 0), rc_room(m, RC_FC1, l, 1), rc_room(m, RC_ACT, l, 1);
            else if (modules & MT_RECOMPUTE_ACT) rc_room(m, RC_FC1, l, 0), rc_room(m, RC_ACT, l, 1);
            if (modules & MT_RECOMPUTE_CORE_ATTN) rc_room(m, RC_QKV, l, 0), rc_room(m, RC_PROBS, l, 1);
        }
        for (int k = 0; k < RC_REGIONS; k++) rc_room(m, k, l, 0); /* the layer's backward */
    }
    return !m->bad;
}

/* Every setting, every slot of 1..6 layers and every chunk of 0..slot layers: the rooms are inside the
 * slot the plan counts, and each read finds its own layer's value. Both attention paths (the exact
 * path keeps probabilities, flash the log-sum-exp). */
static test_result test_recompute_rooms(void) {
    mt_recompute settings[64];
    int n = 0;
    settings[n++] = mt_recompute();
    for (int m = 0; m < 16; m++) settings[n++] = {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, m};
    for (int k = 0; k <= 7; k++) {
        settings[n++] = {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, k, 0};
        settings[n++] = {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, k, 0};
    }
    const mt_precision precisions[2] = {MT_FP32, MT_BF16};
    int checked = 0;
    for (int p = 0; p < 2; p++) {
        mt_config c = test_config(TEST_GPT2, precisions[p]);
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        for (int i = 0; i < n; i++)
            for (int L = 1; L <= 6; L++) {
                mt_activation_layout a;
                mt_activation_layout_compute(&c, L, 1, 1, &settings[i], &a);
                for (int count = 0; count <= L; count++) {
                    rc_sim m;
                    m.rc = &settings[i];
                    m.count = count;
                    for (int k = 0; k < RC_REGIONS; k++) m.kept[k] = a.bytes[rc_regions[k]] ? a.kept_layers[rc_regions[k]] : 0;
                    char setting[128];
                    mt_recompute_describe(&settings[i], setting, sizeof(setting));
                    EXPECT(rc_simulate(&m), "%s, %s, slot of %d layers, chunk of %d: %s", precisions[p] == MT_FP32 ? "fp32" : "bf16",
                           setting, L, count, m.what);
                    checked++;
                }
            }
    }
    printf("      %d (setting, slot, chunk) cases\n", checked);
    return TEST_PASS;
}

/* The plan's kept layers for given settings, counted by hand (4 and 5 layers). */
static test_result test_recompute_plan_rooms(void) {
    mt_config c = test_config(TEST_GPT2, MT_FP32);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    struct { mt_recompute rc; int L; int64_t residual, stats, qkv, probs, ln2, fc1, act; } cases[] = {
        {{MT_RECOMPUTE_NONE, MT_RECOMPUTE_UNIFORM, 0, 0}, 4, 5, 4, 4, 4, 4, 4, 4},
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 0}, 4, 5, 4, 4, 1, 4, 4, 4},
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_LAYERNORM | MT_RECOMPUTE_ACT}, 4, 5, 4, 4, 4, 1, 4, 1},
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MLP}, 4, 5, 4, 4, 4, 4, 1, 1},
        /* uniform 2 of 4: inputs of groups 0, 1 + a replayed group's second input + the output */
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0}, 4, 4, 3, 2, 2, 2, 2, 2},
        /* uniform 2 of 5: 3 groups (the last of one layer) */
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0}, 5, 5, 4, 2, 2, 2, 2, 2},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 1, 0}, 4, 5, 4, 1, 1, 1, 1, 1},
        /* uniform 4 of 4: one group, all of it while it is replayed */
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 4, 0}, 4, 5, 4, 4, 4, 4, 4, 4},
        /* block: inputs all kept; the first n layers share one room */
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 1, 0}, 4, 5, 4, 4, 4, 4, 4, 4},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0}, 4, 5, 4, 2, 2, 2, 2, 2},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 0, 0}, 4, 5, 4, 1, 1, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_activation_layout a;
        mt_activation_layout_compute(&c, cases[i].L, 1, 1, &cases[i].rc, &a);
        const int64_t* k = a.kept_layers;
        char setting[128];
        mt_recompute_describe(&cases[i].rc, setting, sizeof(setting));
        EXPECT(k[MT_ACT_RESIDUAL] == cases[i].residual && k[MT_ACT_LN1_MEAN] == cases[i].stats &&
                   k[MT_ACT_LN1_RSTD] == cases[i].stats && k[MT_ACT_QKV] == cases[i].qkv &&
                   k[MT_ACT_PROBS] == cases[i].probs && k[MT_ACT_LN2] == cases[i].ln2 && k[MT_ACT_FC1] == cases[i].fc1 &&
                   k[MT_ACT_ACT] == cases[i].act && k[MT_ACT_RESIDUAL_MID] == cases[i].qkv,
               "%s of %d layers: residual %lld, stats %lld, qkv %lld, probs %lld, ln2 %lld, fc1 %lld, act %lld", setting,
               cases[i].L, (long long)k[MT_ACT_RESIDUAL], (long long)k[MT_ACT_LN1_MEAN], (long long)k[MT_ACT_QKV],
               (long long)k[MT_ACT_PROBS], (long long)k[MT_ACT_LN2], (long long)k[MT_ACT_FC1], (long long)k[MT_ACT_ACT]);
    }
    /* the plan is the config's setting: the pipeline rank's slots follow it */
    c.num_layers = 4;
    c.recompute = {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0};
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_memory_plan p;
    EXPECT_OK(mt_memory_plan_compute(&c, NULL, &p, &err), &err);
    mt_activation_layout a;
    mt_activation_layout_compute(&c, 4, 1, p.in_flight, &c.recompute, &a);
    EXPECT(p.activation_bytes == a.total && p.activation_saved_bytes == a.saved_bytes, "the plan's arena %zu, the layout's %zu",
           p.activation_bytes, a.total);
    return TEST_PASS;
}

/* Mixture of experts (issue #34): full recompute keeps an MoE layer's routing per layer (the router's
 * logits, probabilities, map, permutation, row counts, aux-loss weights) and shares the experts' rooms
 * (fc1, activation) like the dense MLP's; selective keeps the routing too, and the experts' regions unless
 * moe (fc1 and activation: one room) or moe_act (the activation) recomputes them. A 4-layer MoE model's
 * slot: routing L rooms, experts n (uniform n) or 1 + L - n (block n). */
static test_result test_recompute_moe_rooms(void) {
    mt_config c = test_config(TEST_LLAMA, MT_FP32);
    c.num_layers = 4;
    c.num_experts = 4;
    c.moe_router_topk = 2;
    c.moe_ffn_hidden_size = 64;
    c.moe_aux_loss_coeff[0] = 1e-2;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int routing[] = {MT_ACT_MOE_LOGITS, MT_ACT_MOE_PROBS, MT_ACT_MOE_ROW, MT_ACT_MOE_TOKEN, MT_ACT_MOE_ROW_PROB,
                           MT_ACT_MOE_COUNTS, MT_ACT_MOE_AUXW};
    struct { mt_recompute rc; int64_t fc1, act; } cases[] = {
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15}, 4, 4},
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MOE_ACT}, 4, 1},
        {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MOE}, 1, 1},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 1, 0}, 1, 1},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0}, 2, 2},
        {{MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0}, 2, 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_activation_layout a;
        mt_activation_layout_compute(&c, 4, 1, 1, &cases[i].rc, &a);
        char setting[128];
        mt_recompute_describe(&cases[i].rc, setting, sizeof(setting));
        for (size_t r = 0; r < sizeof(routing) / sizeof(routing[0]); r++) {
            EXPECT(a.kept_layers[routing[r]] == 4, "%s: MoE routing region %d keeps %lld layers, not 4", setting,
                   routing[r], (long long)a.kept_layers[routing[r]]);
            for (int l = 0; l < 4; l++)
                EXPECT(mt_recompute_position(&cases[i].rc, routing[r], 4, l) == l, "%s: layer %d's routing room", setting, l);
        }
        EXPECT(a.kept_layers[MT_ACT_MOE_FC1] == cases[i].fc1 && a.kept_layers[MT_ACT_MOE_ACT] == cases[i].act,
               "%s: the experts' fc1 / activation keep %lld / %lld layers, not %lld / %lld", setting,
               (long long)a.kept_layers[MT_ACT_MOE_FC1], (long long)a.kept_layers[MT_ACT_MOE_ACT],
               (long long)cases[i].fc1, (long long)cases[i].act);
    }
    return TEST_PASS;
}

/* The flags: what lands in cfg.recompute, and what is refused (Megatron's rules: full needs a method
 * and a layer count of 1 to the layers per pipeline rank; method and count only with full; modules
 * only with selective). */
static test_result test_recompute_flags(void) {
    const char* base[] = {"train_gpt", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                          "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                          "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3"};
    const int nb = (int)(sizeof(base) / sizeof(base[0]));
    struct { const char* extra[10]; int world; mt_recompute want; const char* refusal; } cases[] = {
        {{NULL}, 1, {MT_RECOMPUTE_NONE, MT_RECOMPUTE_UNIFORM, 0, 0}, NULL},
        {{"--recompute-activations", NULL}, 1, {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 0}, NULL},
        {{"--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp", NULL}, 1,
         {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_LAYERNORM | MT_RECOMPUTE_MLP}, NULL},
        {{"--recompute-activations", "--recompute-modules=act", NULL}, 1,
         {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_ACT}, NULL},
        {{"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3", NULL}, 1,
         {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0}, NULL},
        {{"--recompute-granularity=full", "--recompute-method=uniform", "--recompute-num-layers=2", NULL}, 1,
         {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0}, NULL},
        {{"--recompute-granularity", "full", NULL}, 1, {}, "needs --recompute-method"},
        {{"--recompute-granularity", "full", "--recompute-method", "uniform", NULL}, 1, {}, "needs --recompute-num-layers"},
        {{"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5", NULL}, 1, {},
         "between 1 and the layers per pipeline rank (4)"},
        {{"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3",
          "--pipeline-model-parallel-size", "2", NULL}, 2, {}, "(2)"},
        {{"--recompute-num-layers", "0", NULL}, 1, {}, "between 1 and"},
        {{"--recompute-method", "block", NULL}, 1, {}, "--recompute-method goes with --recompute-granularity full"},
        {{"--recompute-activations", "--recompute-num-layers", "2", NULL}, 1, {}, "goes with --recompute-granularity full"},
        {{"--recompute-activations", "--recompute-granularity", "full", NULL}, 1, {}, "contradicts"},
        {{"--recompute-granularity", "partial", NULL}, 1, {}, "expected one of full|selective"},
        {{"--recompute-activations", "--recompute-modules", "softmax", NULL}, 1, {}, "expected one of"},
        {{"--recompute-activations", "--recompute-modules", NULL}, 1, {}, "needs at least one"},
        {{"--recompute-modules", "mlp", NULL}, 1, {}, "goes with --recompute-granularity selective"},
        {{"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
          "--recompute-modules", "mlp", NULL}, 1, {}, "goes with --recompute-granularity selective"},
    };
    static tg_flags v;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char msg[512] = "";
        char* argv[64];
        int n = flags_argv_with(base, nb, cases[i].extra, argv);
        int r = flags_configure(argv, n, 1000, cases[i].world, &v, msg, sizeof(msg));
        if (cases[i].refusal) {
            EXPECT(r != 0 && strstr(msg, cases[i].refusal), "case %zu: expected '%s', got %d '%s'", i, cases[i].refusal,
                   r, msg);
            continue;
        }
        const mt_recompute* g = &v.cfg.recompute;
        EXPECT(r == 0, "case %zu: %s", i, msg);
        EXPECT(g->granularity == cases[i].want.granularity && g->method == cases[i].want.method &&
                   g->num_layers == cases[i].want.num_layers && g->modules == cases[i].want.modules,
               "case %zu: granularity %d method %d layers %d modules %d", i, (int)g->granularity, (int)g->method,
               g->num_layers, g->modules);
    }
    return TEST_PASS;
}

/* train_gpt --plan names the setting and plans fewer activation bytes: none > selective (mlp) >
 * full uniform 1 on the 1.5B shape. */
static test_result test_recompute_train_gpt_plan(void) {
    if (access("./train_gpt", X_OK) != 0) SKIP_OR_FAIL_STRICT("./train_gpt is not built (make all)");
    static char out[65536];
    const char* model = "./train_gpt --tokenizer-type NullTokenizer --vocab-size 50257 --mock-data --train-iters 10 "
                        "--lr 1e-4 --bf16 --seq-length 1024 --num-layers 48 --hidden-size 1600 --num-attention-heads 25 "
                        "--micro-batch-size 4 --plan";
    const char* settings[3][2] = {{"", "recompute none"},
                                  {"--recompute-activations --recompute-modules mlp layernorm",
                                   "recompute selective (layernorm, mlp)"},
                                  {"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                                   "recompute full uniform 1"}};
    double gib[3];
    for (int i = 0; i < 3; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof(cmd), "%s %s 2>&1", model, settings[i][0]);
        int code = test_command_output(cmd, out, sizeof(out));
        const char* line = strstr(out, "  activations ");
        EXPECT(code == 0 && strstr(out, settings[i][1]) && line && sscanf(line, "  activations %lf", &gib[i]) == 1,
               "%s: exit %d\n%s", settings[i][1], code, out);
    }
    printf("      activations: none %.3f GiB, selective (layernorm, mlp) %.3f GiB, full uniform 1 %.3f GiB\n", gib[0],
           gib[1], gib[2]);
    EXPECT(gib[0] > gib[1] && gib[1] > gib[2], "activations %.3f, %.3f, %.3f GiB", gib[0], gib[1], gib[2]);
    return TEST_PASS;
}

static const test_case recompute_tests[] = {
    {"recompute_rooms_hold_what_the_backward_reads", test_recompute_rooms},
    {"recompute_plan_rooms", test_recompute_plan_rooms},
    {"recompute_moe_rooms", test_recompute_moe_rooms},
    {"recompute_flags", test_recompute_flags},
    {"recompute_train_gpt_plan", test_recompute_train_gpt_plan},
};

/* ---- GPU: bit for bit the training without recompute ------------------------------------------------ */

/* What a run leaves to compare: each step's loss, then the gradients of one more batch and the weights. */
enum { RC_STEPS = 3, RC_MOE_MAX = 64 };
typedef struct {
    double losses[4];
    float* grads;
    float* weights;
    size_t activation_bytes;
    /* an MoE model's (num_experts > 0): each step's logged MoE losses, and after the last step every MoE
     * layer's logged losses, tokens per expert and expert bias (mt_trainer_moe_stats; Lm x E <= RC_MOE_MAX) */
    double moe_losses[RC_STEPS][4];
    float moe_layer_losses[4 * RC_MOE_MAX];
    int32_t moe_tokens[RC_MOE_MAX];
    float moe_bias[RC_MOE_MAX];
} rc_run;

/* RC_STEPS training steps at lr 1e-2 from the config's initial weights on fixed batches (each
 * data-parallel rank its own), then the gradients of one more batch (single GPU: grads != NULL); the
 * trainer's allocation is checked against the plan of its setting. */
static test_result rc_train(mt_config c, rc_run* out) {
    mt_error err;
    if (c.world_size > 1) EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
    char setting[128];
    mt_recompute_describe(&c.recompute, setting, sizeof(setting));
    mt_trainer* t = NULL;
    const test_result planned = create_as_planned(&c, setting, &t);
    if (!t) return planned;
    test_result res = TEST_PASS; /* every rank trains even when its allocation was off (the others wait on it) */
    out->activation_bytes = mt_trainer_memory_allocated(t).activation_bytes;
    const int64_t per_step = (int64_t)mt_num_micro_batches(&c) * c.micro_batch_size * (c.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
    const uint64_t dp_rank = (uint64_t)mt_rank_coordinates(&c, c.rank).dp;
    for (int k = 0; k <= RC_STEPS && res == TEST_PASS; k++) {
        fill_tokens(tokens, per_step, (int)c.vocab_size, 4100 + 31 * k + 7 * dp_rank);
        mt_status st = MT_OK;
        if (k < RC_STEPS) {
            mt_step_result r;
            st = mt_trainer_train_step(t, tokens, &r, &err);
            out->losses[k] = r.lm_loss;
            memcpy(out->moe_losses[k], r.moe_losses, sizeof(out->moe_losses[k]));
            if (st == MT_OK && k == RC_STEPS - 1 && c.num_experts > 0) {
                if ((int64_t)mt_moe_num_layers(&c) * c.num_experts > RC_MOE_MAX) {
                    printf("    FAIL %s: more MoE layers x experts than RC_MOE_MAX\n", setting);
                    res = TEST_FAIL;
                } else {
                    st = mt_trainer_moe_stats(t, out->moe_layer_losses, out->moe_tokens, out->moe_bias, &err);
                }
            }
        } else if (out->grads) {
            double loss = 0.0;
            st = mt_trainer_compute_gradients(t, tokens, mt_num_micro_batches(&c), &loss, &err);
            out->losses[k] = loss;
            if (st == MT_OK) st = mt_trainer_get_gradients(t, out->grads, &err);
        }
        if (st == MT_OK && k == RC_STEPS) st = mt_trainer_get_parameters(t, out->weights, &err);
        if (st != MT_OK) {
            printf("    FAIL %s, step %d: %s\n", setting, k, err.message);
            res = TEST_FAIL;
        }
    }
    free(tokens);
    mt_trainer_free(t);
    return planned != TEST_PASS ? planned : res;
}

/* The first difference between two float arrays, or -1. */
static int64_t rc_first_difference(const float* a, const float* b, int64_t n) {
    if (memcmp(a, b, sizeof(float) * (size_t)n) == 0) return -1;
    int64_t i = 0;
    while (i < n && memcmp(&a[i], &b[i], sizeof(float)) == 0) i++;
    return i;
}

/* Each setting against none: losses, gradients (when taken) and weights equal bit for bit. */
static test_result rc_compare(const mt_config* base, const mt_recompute* settings, int count, int with_grads,
                              const char* label) {
    mt_config probe = *base;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&probe, &err), &err);
    const int64_t n = mt_num_parameters(&probe);
    rc_run ref, run;
    ref.grads = with_grads ? (float*)calloc((size_t)n, sizeof(float)) : NULL;
    ref.weights = (float*)calloc((size_t)n, sizeof(float));
    run.grads = with_grads ? (float*)calloc((size_t)n, sizeof(float)) : NULL;
    run.weights = (float*)calloc((size_t)n, sizeof(float));
    memset(ref.losses, 0, sizeof(ref.losses));
    memset(run.losses, 0, sizeof(run.losses));
    rc_run* both[2] = {&ref, &run};
    for (int i = 0; i < 2; i++) {
        memset(both[i]->moe_losses, 0, sizeof(both[i]->moe_losses));
        memset(both[i]->moe_layer_losses, 0, sizeof(both[i]->moe_layer_losses));
        memset(both[i]->moe_tokens, 0, sizeof(both[i]->moe_tokens));
        memset(both[i]->moe_bias, 0, sizeof(both[i]->moe_bias));
    }
    mt_config c = *base;
    c.recompute = mt_recompute();
    test_result res = tp_agree(rc_train(c, &ref));
    if (res == TEST_PASS)
        printf("      %s none: loss %.6f -> %.6f, activations %.2f MiB\n", label, ref.losses[0], ref.losses[RC_STEPS - 1],
               ref.activation_bytes / 1048576.0);
    for (int i = 0; i < count && res == TEST_PASS; i++) {
        c.recompute = settings[i];
        char setting[128];
        mt_recompute_describe(&settings[i], setting, sizeof(setting));
        res = tp_agree(rc_train(c, &run));
        if (res != TEST_PASS) break;
        for (int k = 0; k <= RC_STEPS && res == TEST_PASS; k++)
            if (run.losses[k] != ref.losses[k] && (k < RC_STEPS || with_grads)) {
                printf("    FAIL %s %s: step %d loss %.9f, without recompute %.9f\n", label, setting, k, run.losses[k],
                       ref.losses[k]);
                res = TEST_FAIL;
            }
        int64_t at = res == TEST_PASS && with_grads ? rc_first_difference(run.grads, ref.grads, n) : -1;
        if (at >= 0) {
            printf("    FAIL %s %s: gradient %lld is %.9g, without recompute %.9g\n", label, setting, (long long)at,
                   run.grads[at], ref.grads[at]);
            res = TEST_FAIL;
        }
        /* MoE: the routers' bookkeeping is the forward's alone (a replay that counted its tokens or aux losses
         * again would change these) */
        if (res == TEST_PASS && base->num_experts > 0 &&
            (memcmp(run.moe_losses, ref.moe_losses, sizeof(ref.moe_losses)) ||
             memcmp(run.moe_layer_losses, ref.moe_layer_losses, sizeof(ref.moe_layer_losses)) ||
             memcmp(run.moe_tokens, ref.moe_tokens, sizeof(ref.moe_tokens)) ||
             memcmp(run.moe_bias, ref.moe_bias, sizeof(ref.moe_bias)))) {
            printf("    FAIL %s %s: the MoE statistics differ (load balancing %.9g vs %.9g at the last step)\n", label,
                   setting, run.moe_losses[RC_STEPS - 1][0], ref.moe_losses[RC_STEPS - 1][0]);
            res = TEST_FAIL;
        }
        at = res == TEST_PASS ? rc_first_difference(run.weights, ref.weights, n) : -1;
        if (at >= 0) {
            printf("    FAIL %s %s: weight %lld is %.9g, without recompute %.9g\n", label, setting, (long long)at,
                   run.weights[at], ref.weights[at]);
            res = TEST_FAIL;
        }
        if (res == TEST_PASS)
            printf("      %s %-32s bit for bit; activations %.2f MiB\n", label, setting, run.activation_bytes / 1048576.0);
        res = tp_agree(res);
    }
    free(ref.grads), free(ref.weights), free(run.grads), free(run.weights);
    return res;
}

/* The single-GPU settings (5 layers): every selective module alone and together; full uniform 1, 2
 * and 3 (groups [0, 3) [3, 5): a short last group); full block 2 and all 5. Each full setting
 * replays some layers (not only the ones the forward left in place). */
static const mt_recompute rc_single_gpu_settings[] = {
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 0},
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_LAYERNORM},
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_ACT},
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MLP | MT_RECOMPUTE_LAYERNORM},
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 1, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 3, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 2, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 5, 0},
};

/* 5 layers, two micro-batches a step; lr 1e-2 so that every step moves every weight. */
static mt_config rc_config(test_flavour flavour, mt_precision prec) {
    mt_config c = test_config(flavour, prec);
    c.num_layers = 5;
    c.lr = 1e-2;
    c.lr_warmup_iters = 1;
    c.weight_decay = 0.1;
    return c;
}

static test_result rc_single(test_flavour flavour, mt_precision prec) {
    REQUIRE_GPU();
    mt_config c = rc_config(flavour, prec);
    char label[32];
    snprintf(label, sizeof(label), "%s %s", flavour == TEST_LLAMA ? "llama" : "gpt2", prec == MT_FP32 ? "fp32" : "bf16");
    return rc_compare(&c, rc_single_gpu_settings, (int)(sizeof(rc_single_gpu_settings) / sizeof(rc_single_gpu_settings[0])),
                      1, label);
}
static test_result test_recompute_gpt2_fp32(void) { return rc_single(TEST_GPT2, MT_FP32); }
static test_result test_recompute_gpt2_bf16(void) { return rc_single(TEST_GPT2, MT_BF16); }
static test_result test_recompute_llama_fp32(void) { return rc_single(TEST_LLAMA, MT_FP32); }
static test_result test_recompute_llama_bf16(void) { return rc_single(TEST_LLAMA, MT_BF16); }

/* Dropout 0.1 at every site (the masks are counter-based, never stored): a full replay and the selective
 * modules regenerate the forward's masks, so recompute stays bitwise equal to none. GPT-2 bf16 runs the
 * flash kernels' attention dropout, Llama fp32 the exact path's. */
static test_result test_recompute_dropout(void) {
    REQUIRE_GPU();
    const mt_recompute settings[] = {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15},
                                     {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0},
                                     {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0}};
    const struct { test_flavour flavour; mt_precision prec; const char* name; } runs[2] = {
        {TEST_GPT2, MT_BF16, "gpt2 bf16 dropout 0.1"}, {TEST_LLAMA, MT_FP32, "llama fp32 dropout 0.1"}};
    for (int r = 0; r < 2; r++) {
        mt_config c = rc_config(runs[r].flavour, runs[r].prec);
        c.hidden_dropout = 0.1;
        c.attention_dropout = 0.1;
        test_result res = rc_compare(&c, settings, 3, 1, runs[r].name);
        if (res != TEST_PASS) return res;
    }
    return TEST_PASS;
}

/* --squared-relu and --qk-layernorm under every single-GPU setting: selective act recomputes
 * relu(fc1)^2 from the kept pre-activation by the forward's kernel (no cuBLASLt epilogue to go
 * through), core_attn and every replay normalise q and k again from the kept QKV rows, and the
 * backward always makes the normalised rows again. GPT-2 bf16 with both switches (flash attention
 * from the normalised rows), Llama fp32 with the query and key RMSNorms (the exact path's split), and
 * GPT-2 FP8 (tensorwise) with squared ReLU after the FP8 fc1 when the GPU has FP8. */
static test_result test_recompute_squared_relu_qk_layernorm(void) {
    REQUIRE_GPU();
    const int count = (int)(sizeof(rc_single_gpu_settings) / sizeof(rc_single_gpu_settings[0]));
    mt_config c = rc_config(TEST_GPT2, MT_BF16);
    c.squared_relu = 1;
    c.qk_layernorm = 1;
    test_result res = rc_compare(&c, rc_single_gpu_settings, count, 1, "gpt2 bf16 squared-relu qk-layernorm");
    if (res != TEST_PASS) return res;
    c = rc_config(TEST_LLAMA, MT_FP32);
    c.qk_layernorm = 1;
    res = rc_compare(&c, rc_single_gpu_settings, count, 1, "llama fp32 qk-layernorm");
    if (res != TEST_PASS || fp8t_compute_capability() < 89) return res;
    const mt_recompute settings[] = {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_ACT},
                                     {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15},
                                     {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0}};
    c = rc_config(TEST_GPT2, MT_BF16);
    c.squared_relu = 1;
    c.qk_layernorm = 1;
    c.fp8_format = MT_FP8_E4M3;
    c.fp8_recipe = MT_FP8_TENSORWISE;
    return rc_compare(&c, settings, 3, 1, "gpt2 fp8 e4m3 tensorwise squared-relu qk-layernorm");
}

/* FP8 (delayed, tensorwise and blockwise scaling): the replayed linears cast with the forward's scales. */
static test_result test_recompute_fp8(void) {
    REQUIRE_FP8_GPU();
    const mt_recompute settings[] = {{MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15},
                                     {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0},
                                     {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0}};
    const struct { mt_fp8_format format; mt_fp8_recipe recipe; const char* name; } recipes[3] = {
        {MT_FP8_HYBRID, MT_FP8_DELAYED, "gpt2 fp8 hybrid delayed"},
        {MT_FP8_E4M3, MT_FP8_TENSORWISE, "gpt2 fp8 e4m3 tensorwise"},
        {MT_FP8_HYBRID, MT_FP8_BLOCKWISE, "gpt2 fp8 hybrid blockwise"}};
    for (int r = 0; r < 3; r++) {
        mt_config c = rc_config(TEST_GPT2, MT_BF16);
        c.fp8_format = recipes[r].format;
        c.fp8_recipe = recipes[r].recipe;
        test_result res = rc_compare(&c, settings, 3, 1, recipes[r].name);
        if (res != TEST_PASS) return res;
    }
    return TEST_PASS;
}

/* What recompute rests on for the norms: the output norm_apply makes from a norm's saved input and
 * statistics is the forward's output bit for bit (the first norm of a chunk: norm_forward; every other
 * norm: residual_norm_forward, one fused kernel up to 2048 bf16 / 1024 fp32 columns, else two).
 * Selective layernorm recomputes the second norm's output this way, and a full-recompute replay starts
 * its group from the first norm's output made this way. LayerNorm and RMSNorm, with and without the
 * 1p weights, fp32 and bf16, random rows. */
template <typename T>
static test_result rc_norm_apply_case(mt_precision prec, int N, int C, bool rms, float w1) {
    const int64_t n = (int64_t)N * C;
    std::vector<float> h((size_t)(3 * n + 2 * C));
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)(N * 131 + C * 7 + rms * 3 + (int)w1);
    for (float& v : h) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        v = (float)((double)(x >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    }
    float* staging = NULL;
    T *dev = NULL, *out = NULL, *again = NULL, *sum = NULL;
    float *mean = NULL, *rstd = NULL;
    mt_gpu_error e;
    memset(&e, 0, sizeof(e));
    mt_exec ex;
    ex.stream = 0;
    ex.error = &e;
    ex.gemm = NULL;
    ex.mode = mt_micro_batch_mode();
    test_result res = TEST_PASS;
    if (cudaMalloc(&staging, sizeof(float) * h.size()) != cudaSuccess || cudaMalloc(&dev, sizeof(T) * h.size()) != cudaSuccess ||
        cudaMalloc(&out, sizeof(T) * n) != cudaSuccess || cudaMalloc(&again, sizeof(T) * n) != cudaSuccess ||
        cudaMalloc(&sum, sizeof(T) * n) != cudaSuccess || cudaMalloc(&mean, sizeof(float) * N) != cudaSuccess ||
        cudaMalloc(&rstd, sizeof(float) * N) != cudaSuccess) {
        printf("    FAIL cudaMalloc\n");
        res = TEST_FAIL;
    }
    if (res == TEST_PASS) {
        cudaMemcpy(staging, h.data(), sizeof(float) * h.size(), cudaMemcpyHostToDevice);
        cast_from_float(&ex, prec, dev, staging, (int64_t)h.size());
        const T *residual = dev, *branch = dev + n, *bias = dev + 2 * n, *w = dev + 3 * n, *b = rms ? NULL : dev + 3 * n + C;
        std::vector<T> first((size_t)n), second((size_t)n);
        for (int fused = 0; fused < 2 && res == TEST_PASS; fused++) {
            if (fused)
                residual_norm_forward<T>(&ex, sum, out, mean, rstd, residual, (T*)branch, bias, w, b, N, C, 1e-5f, rms, w1);
            else
                norm_forward<T>(&ex, out, mean, rstd, residual, w, b, N, C, 1e-5f, rms, w1);
            norm_apply<T>(&ex, again, fused ? sum : residual, mean, rstd, w, b, N, C, w1);
            cudaMemcpy(first.data(), out, sizeof(T) * n, cudaMemcpyDeviceToHost);
            cudaMemcpy(second.data(), again, sizeof(T) * n, cudaMemcpyDeviceToHost);
            if (e.status != MT_OK || cudaDeviceSynchronize() != cudaSuccess) {
                printf("    FAIL %s\n", e.status != MT_OK ? e.error.message : "a CUDA error");
                res = TEST_FAIL;
            } else if (memcmp(first.data(), second.data(), sizeof(T) * n) != 0) {
                int64_t i = 0;
                while (memcmp(&first[i], &second[i], sizeof(T)) == 0) i++;
                printf("    FAIL %s %s N=%d C=%d w1=%g: %s's output and norm_apply's differ at element %lld\n",
                       prec == MT_FP32 ? "fp32" : "bf16", rms ? "RMSNorm" : "LayerNorm", N, C, w1,
                       fused ? "residual_norm_forward" : "norm_forward", (long long)i);
                res = TEST_FAIL;
            }
        }
    }
    cudaFree(staging), cudaFree(dev), cudaFree(out), cudaFree(again), cudaFree(sum), cudaFree(mean), cudaFree(rstd);
    return res;
}
static test_result test_recompute_norm_apply_is_the_forward(void) {
    REQUIRE_GPU();
    const struct { int N, C; } shapes[] = {{257, 128}, {1024, 1600}, {512, 2048}, {300, 4096}, {64, 770}};
    int cases = 0;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        for (int rms = 0; rms < 2; rms++)
            for (int one_p = 0; one_p < 2; one_p++) {
                const int N = shapes[i].N, C = shapes[i].C;
                const float w1 = one_p ? 1.0f : 0.0f;
                if (rc_norm_apply_case<float>(MT_FP32, N, C, rms, w1) != TEST_PASS) return TEST_FAIL;
                if (rc_norm_apply_case<__nv_bfloat16>(MT_BF16, N, C, rms, w1) != TEST_PASS) return TEST_FAIL;
                cases += 2;
            }
    printf("      %d cases: norm_apply equals norm_forward and residual_norm_forward bit for bit\n", cases);
    return TEST_PASS;
}

/* Mixture of experts (issue #34) under every single-GPU setting, GPT-2 and Llama, fp32 and bf16: layers 0, 2
 * and 4 MoE (--moe-layer-freq 2) beside dense ones, 4 experts of width 64, top-2 sigmoid scores with the
 * expert bias, the aux loss, the global-batch aux loss (a running average over the step's micro-batches: a
 * replay that added to it again would change the gradients) and the z-loss; GPT-2's GELU experts with
 * biases, Llama's SwiGLU experts with a gated shared expert. Full recompute keeps each MoE layer's routing
 * and replays its experts and shared expert from it; selective recomputes the shared expert as the dense
 * MLP (mlp, act), the norm before the router (layernorm), the experts and shared expert from the kept
 * routing (moe) or the experts' activation (moe_act), alone and together. Besides the losses, gradients and weights,
 * the logged MoE losses of every step and the last step's tokens per expert and expert bias bit for bit. */
static test_result rc_moe(test_flavour flavour, mt_precision prec) {
    REQUIRE_GPU();
    mt_config c = rc_config(flavour, prec);
    c.num_experts = 4;
    c.moe_router_topk = 2;
    c.moe_ffn_hidden_size = 64;
    c.moe_layer_freq = 2;
    c.moe_router_score_sigmoid = 1;
    c.moe_router_enable_expert_bias = 1;
    c.moe_load_balancing = MT_MOE_AUX_LOSS | MT_MOE_GLOBAL_AUX_LOSS;
    c.moe_aux_loss_coeff[0] = 1e-2;
    c.moe_aux_loss_coeff[2] = 1e-2;
    c.moe_z_loss_coeff = 1e-3;
    c.moe_grouped_gemm = 1; /* Megatron's condition for moe_act */
    if (flavour == TEST_LLAMA) c.moe_shared_expert_intermediate_size = 64, c.moe_shared_expert_gate = 1;
    char label[48];
    snprintf(label, sizeof(label), "moe %s %s", flavour == TEST_LLAMA ? "llama" : "gpt2", prec == MT_FP32 ? "fp32" : "bf16");
    enum { SINGLE = sizeof(rc_single_gpu_settings) / sizeof(rc_single_gpu_settings[0]) };
    mt_recompute settings[SINGLE + 4];
    memcpy(settings, rc_single_gpu_settings, sizeof(rc_single_gpu_settings));
    settings[SINGLE] = {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MOE};
    settings[SINGLE + 1] = {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MOE_ACT};
    settings[SINGLE + 2] = {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, MT_RECOMPUTE_MOE | MT_RECOMPUTE_LAYERNORM};
    settings[SINGLE + 3] = {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 63};
    return rc_compare(&c, settings, SINGLE + 4, 1, label);
}
static test_result test_recompute_moe(void) {
    const test_flavour flavours[2] = {TEST_GPT2, TEST_LLAMA};
    const mt_precision precs[2] = {MT_FP32, MT_BF16};
    for (int f = 0; f < 2; f++)
        for (int p = 0; p < 2; p++) {
            const test_result r = rc_moe(flavours[f], precs[p]);
            if (r != TEST_PASS) return r;
        }
    return TEST_PASS;
}

static const test_case recompute_gpu_tests[] = {
    {"recompute_bitwise_moe", test_recompute_moe},
    {"recompute_norm_apply_is_the_forward", test_recompute_norm_apply_is_the_forward},
    {"recompute_bitwise_gpt2_fp32", test_recompute_gpt2_fp32},
    {"recompute_bitwise_gpt2_bf16", test_recompute_gpt2_bf16},
    {"recompute_bitwise_llama_fp32", test_recompute_llama_fp32},
    {"recompute_bitwise_llama_bf16", test_recompute_llama_bf16},
    {"recompute_bitwise_fp8", test_recompute_fp8},
    {"recompute_bitwise_dropout", test_recompute_dropout},
    {"recompute_bitwise_squared_relu_qk_layernorm", test_recompute_squared_relu_qk_layernorm},
};

/* ---- several GPUs (mpirun -np 2) --------------------------------------------------------------------- */

/* The multi-GPU settings (8 layers; 4 per pipeline rank, 2 per chunk with VP 2): selective with every
 * module; full uniform 1 and 2, full block 3, each replaying layers in every layout (uniform 2 under
 * VP 2 only keeps the chunk's one group in place). */
static const mt_recompute rc_multigpu_settings[] = {
    {MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_UNIFORM, 0, 15},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 1, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_UNIFORM, 2, 0},
    {MT_RECOMPUTE_FULL, MT_RECOMPUTE_BLOCK, 3, 0},
};

/* layout: 0 TP 2 + SP, 1 DP 2 with the distributed optimizer, 2 PP 2 (1F1B), 3 PP 2 x VP 2. */
static test_result rc_multigpu(test_flavour flavour, mt_precision prec) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() != 2) SKIP("runs under mpirun -np 2, not %d", mpi_world());
    const char* names[4] = {"TP 2 + SP", "DP 2 distributed", "PP 2", "PP 2 x VP 2"};
    for (int layout = 0; layout < 4; layout++) {
        mt_config c = rc_config(flavour, prec);
        c.num_layers = 8;
        if (layout == 0) {
            test_config_parallel(&c, 2, 2, 1);
        } else if (layout == 1) {
            test_config_parallel(&c, 1, 2, 0);
            test_config_ddp(&c, 1, 0, 0, 0);
            test_config_batch(&c, 2, 8);
        } else {
            c.pipeline_model_parallel_size = 2;
            c.virtual_pipeline_size = layout == 3 ? 2 : 1;
            test_config_parallel(&c, 1, 2, 0);
            test_config_batch(&c, 2, 8);
        }
        test_config_this_rank(&c);
        const int count = (int)(sizeof(rc_multigpu_settings) / sizeof(rc_multigpu_settings[0]));
        char label[64];
        snprintf(label, sizeof(label), "%s %s %s", names[layout], flavour == TEST_LLAMA ? "llama" : "gpt2",
                 prec == MT_FP32 ? "fp32" : "bf16");
        test_result res = rc_compare(&c, rc_multigpu_settings, count, 0, label);
        if (res != TEST_PASS) return res;
    }
    return TEST_PASS;
}
static test_result test_recompute_multigpu_gpt2_bf16(void) { return rc_multigpu(TEST_GPT2, MT_BF16); }
static test_result test_recompute_multigpu_llama_fp32(void) { return rc_multigpu(TEST_LLAMA, MT_FP32); }

static const test_case recompute_multigpu_tests[] = {
    {"recompute_bitwise_tp_dp_pp_gpt2_bf16", test_recompute_multigpu_gpt2_bf16},
    {"recompute_bitwise_tp_dp_pp_llama_fp32", test_recompute_multigpu_llama_fp32},
};

#endif
