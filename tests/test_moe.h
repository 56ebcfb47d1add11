/* tests/test_moe.h — mixture of experts in the whole model (GPU tests; each skips when no GPU is visible):
 * parity with the float64 PyTorch reference dev/ref_moe.py (-> dev/data/moe_vectors/NAME.bin): the first
 * micro-batch's routing (final probabilities and map, capacity and dropping included), the evaluation
 * logits, the loss and every gradient of one step (aux losses, z-loss and the expert bias included), then S
 * AdamW steps with each step's loss, gradient norm, logged MoE losses per layer, tokens per expert and
 * expert bias, and the final weights, per tensor and per element; and a rerun bitwise equal. MoE
 * checkpoints (issue #34): a resume bitwise with the expert bias, a save right after a load byte-identical,
 * the refusals (test_moe_checkpoint_resume_bitwise; the format's host side: tests/test_checkpoint_tool.h
 * moe_expert_bias_checkpoint). The MoE kernels alone: tests/test_moe_kernels.h.
 *
 * Tolerances (fp32). Every GEMM is true fp32, so, as in tests/test_model.h, results carry a few fp32 ulps
 * amplified by depth: 1e-5 norm-wise on logits, losses and gradients, per tensor. Per element: |ours - ref|
 * <= 1e-4 (|ref| + rms(ref tensor)): an element's error is ~1e-6 of its tensor's scale; 1e-4 leaves 100x for
 * long sums and cancellation, and any indexing or routing error (a wrong expert, a dropped row, a missing
 * probability factor) moves elements by O(1) of that scale. Routing decisions are discrete: they match
 * exactly when the reference's closest decision gap (ref_moe.py prints it: 1e-5 of the score spread for
 * these files) is far above fp32's error in the logits (~1e-6 relative), so the map, the tokens per expert
 * and the expert bias (a sum of +-rate steps) are compared exactly; probabilities per element within 1e-5
 * relative to their row's largest. Logged MoE losses (a loss over a coefficient, an O(1) number): 1e-5
 * relative. After S steps: the weights within 1e-5 per tensor and, per tensor, within 0.5 of the
 * reference's own movement (a lost update gives 1).
 * bf16: the weights and activations carry 8 mantissa bits, so routing decisions whose gap is below ~1e-2
 * of the score spread can flip (then one token's expert changes: an O(1) change of that token's output):
 * logits 5e-2, losses 2e-2, gradients 1e-1 norm-wise (flips move whole rows of the expert gradients), the
 * step losses 2e-2, weights after S steps 5e-3; the tokens per expert within 10% of the micro-batch's
 * routed pairs; the first micro-batch's map within 2% of its routed pairs (a flip changes two entries), the
 * probabilities of the tokens whose choice agrees within 5e-2 of their row's largest. The router's and the
 * experts' tensors are where flips weigh most: a flipped token moves its whole contribution (its input row
 * in the experts' weight gradients, its term dprobs x the probabilities' Jacobian in the router's) from one
 * expert to another, on a micro-batch of 64 tokens: 3e-1 on their gradients, 1e-1 on their weights after S
 * steps (measured on an H200: router gradient 1.5e-1 and experts' fc1 gradient 1.2e-1 (deepseek_tiny_all, 8
 * flipped entries of 512), weights 1.5e-2 and 1.7e-2 (mixtral_tiny), experts' fc2 weights 5.5e-2
 * (deepseek_tiny_all, whose 16 experts see 16 tokens each)); the dense tensors keep the tolerances
 * above. A router that does not learn, or an expert that gets the wrong rows, is O(1) off. */
#ifndef MT_TEST_MOE_H
#define MT_TEST_MOE_H

#define MOE_VECTORS_MAGIC 20261134
#define MT_MAX_MOE_PATTERN_TEST 192 /* ref_moe.py's files: L <= 192 (header words 64 + l) */
/* The MoE vector files are not in the repository (they would take the tree past what travels to the GPU
 * machine): `make moe-vectors` (python3 dev/ref_moe.py, with torch) writes them, dev/gpu_check.sh first of all.
 * A missing file skips, and fails under MT_TEST_STRICT=1. */
#define MOE_VECTORS_MISSING "no MoE test vectors %s: `make moe-vectors` writes them (python3 dev/ref_moe.py, torch)"

typedef struct {
    gpt_vectors g;          /* the dense file's part (header words 0..26, hyper 0..14, the arrays) */
    int E, topk, fe, Lm, N0;
    float* moe_losses;      /* [S, 4, Lm] */
    int32_t* tokens_per_expert; /* [S, Lm, E] */
    float* expert_bias;     /* [S + 1, Lm, E] */
    float* route_probs0;    /* [Lm, N0, E] token order n = t * mb + b */
    int32_t* route_map0;    /* [Lm, N0, E] */
} moe_vectors;

static int load_moe_vectors(moe_vectors* v, const char* path) {
    size_t size = 0;
    memset(v, 0, sizeof(*v));
    gpt_vectors* g = &v->g;
    char* p = read_gpt_vectors(g, path, MOE_VECTORS_MAGIC, &size); /* the dense file's part */
    if (!p) return 0;
    v->E = g->header[32]; v->topk = g->header[33]; v->fe = g->header[34]; v->Lm = g->header[45]; v->N0 = g->header[46];
    v->moe_losses = (float*)p; p += 4 * (size_t)g->S * 4 * v->Lm;
    v->tokens_per_expert = (int32_t*)p; p += 4 * (size_t)g->S * v->Lm * v->E;
    v->expert_bias = (float*)p; p += 4 * (size_t)(g->S + 1) * v->Lm * v->E;
    v->route_probs0 = (float*)p; p += 4 * (size_t)v->Lm * v->N0 * v->E;
    v->route_map0 = (int32_t*)p; p += 4 * (size_t)v->Lm * v->N0 * v->E;
    return (size_t)(p - g->blob) == size;
}

/* The file's model and its MoE settings (header [32..46], [64 + l]; hyper [16..22]: ref_moe.py's docstring). */
static mt_config moe_config_from_vectors(const moe_vectors* v, mt_precision precision) {
    const gpt_vectors* g = &v->g;
    mt_config c = config_from_vectors(g, precision);
    const int32_t* hd = g->header;
    const float* hp = g->hyper;
    c.num_experts = hd[32];
    c.moe_router_topk = hd[33];
    c.moe_ffn_hidden_size = hd[34];
    c.moe_router_score_sigmoid = hd[35];
    c.moe_router_pre_softmax = hd[36];
    c.moe_router_num_groups = hd[37];
    c.moe_router_group_topk = hd[38];
    c.moe_load_balancing = hd[39];
    c.moe_router_enable_expert_bias = hd[40];
    c.moe_token_drop_position = hd[41];
    c.moe_pad_expert_input_to_capacity = hd[42];
    c.moe_shared_expert_intermediate_size = hd[43];
    c.moe_shared_expert_gate = hd[44];
    c.moe_router_topk_scaling_factor = hp[16];
    c.moe_aux_loss_coeff[0] = hp[17];
    c.moe_aux_loss_coeff[1] = hp[18];
    c.moe_aux_loss_coeff[2] = hp[19];
    c.moe_z_loss_coeff = hp[20];
    c.moe_router_bias_update_rate = hp[21];
    c.moe_expert_capacity_factor = hp[22];
    /* the layers: header [64 + l] is 1 for an MoE layer (every layer: --moe-layer-freq 1, else the pattern) */
    int every = 1;
    for (int l = 0; l < c.num_layers && l < MT_MAX_MOE_PATTERN_TEST; l++) every &= hd[64 + l] == 1;
    if (!every) {
        c.moe_layer_pattern_len = c.num_layers;
        for (int l = 0; l < c.num_layers; l++) c.moe_layer_pattern[l] = (unsigned char)hd[64 + l];
    }
    /* the reference computes the router in float64 from the model's values: ours in fp32 */
    c.moe_router_dtype_fp32 = 1;
    return c;
}

/* Per-element agreement of a tensor: |a - ref| <= tol (|ref| + rms(ref)); returns the worst ratio of the
 * error to its bound (<= 1 passes) and its index in *where. */
static double moe_element_ratio(const float* a, const float* ref, int64_t n, double tol, int64_t* where) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)ref[i] * ref[i];
    const double rms = n > 0 ? sqrt(ss / n) : 0.0;
    double worst = 0.0;
    *where = -1;
    for (int64_t i = 0; i < n; i++) {
        const double bound = tol * (fabs((double)ref[i]) + rms) + 1e-30;
        const double r = fabs((double)a[i] - (double)ref[i]) / bound;
        if (!(r <= worst)) worst = r, *where = i;
    }
    return worst;
}

/* Per tensor (norm-wise) and per element against the reference; prints each tensor; returns 0 on a failure
 * (the first failing tensor named in why). */
static int moe_compare_tensors(const char* what, const mt_config* c, const float* ours, const float* ref,
                               double tol_tensor, double tol_element, double tol_router, char* why, size_t cap) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, info);
    /* the key biases (models with linear biases) are left out of the per-tensor errors, as tests/test_model.h
     * does: softmax ignores a constant per query, so their gradient is 0 up to rounding and Adam moves them
     * by the sign of that noise (the GPT flavour's qkv_bias weights part by 2e-5 otherwise) */
    unsigned char* skip = key_bias_mask(c);
    int ok = 1;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        if (info[i].numel == 0) continue;
        const double e = rel_error(ours + info[i].offset, ref + info[i].offset, info[i].numel,
                                   skip ? skip + info[i].offset : NULL);
        const double tol_this = i >= MT_P_ROUTER_WEIGHT && i <= MT_P_EXPERT_FC2_BIAS ? tol_router : tol_tensor;
        int64_t where = -1;
        const double r = moe_element_ratio(ours + info[i].offset, ref + info[i].offset, info[i].numel, tol_element,
                                           &where);
        printf("      %-8s %-20s rel err %.3e, worst element %.3f of its bound\n", what, info[i].name, e, r);
        if (ok && !(e <= tol_this && r <= 1.0)) {
            snprintf(why, cap, "%s %s: rel err %.3e (tol %.1e), element %lld: %.7g vs %.7g (%.2f x its bound)", what,
                     info[i].name, e, tol_this, (long long)where, where >= 0 ? ours[info[i].offset + where] : 0.0,
                     where >= 0 ? ref[info[i].offset + where] : 0.0, r);
            ok = 0;
        }
    }
    free(skip);
    return ok;
}

typedef struct {
    double logits, loss, grads, grads_element, probs, steps_loss, params, moe_loss;
    double router_grads, router_params; /* the router's and the experts' tensors (see the bf16 note above) */
    int exact_routing;  /* fp32: the map, tokens per expert and expert bias exactly */
} moe_tolerances;

static test_result check_moe_against_reference(const char* path, mt_precision precision, const moe_tolerances* tol) {
    REQUIRE_GPU();
    moe_vectors mv;
    if (access(path, R_OK) != 0) SKIP_OR_FAIL_STRICT(MOE_VECTORS_MISSING, path);
    if (!load_moe_vectors(&mv, path)) {
        free(mv.g.blob);
        printf("    FAIL cannot read test vectors %s (run dev/ref_moe.py)\n", path);
        return TEST_FAIL;
    }
    const gpt_vectors* v = &mv.g;
    mt_config c = moe_config_from_vectors(&mv, precision);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.padded_vocab_size == v->Vp && mt_num_parameters(&c) == v->n, "shape mismatch with %s (%lld vs %lld params)",
           path, (long long)mt_num_parameters(&c), (long long)v->n);
    const int E = mv.E, Lm = mv.Lm, T = v->T, mb = v->mb, N0 = mv.N0;
    EXPECT(Lm == mt_moe_num_layers(&c) && N0 == mb * T, "%s: %d MoE layers, the config has %d", path, Lm,
           mt_moe_num_layers(&c));
    /* header [47]: the reference's GELU (1: the tanh one, ours; 0: torch's erf GELU, which this build has not) */
    EXPECT(c.swiglu || c.squared_relu || v->header[47] == 1, "%s: its GELU is the erf one (header [47] 0): ours is the "
           "tanh approximation (Megatron's --use-te-activation-func)", path);
    int moe_layer_of[MT_MAX_MOE_PATTERN_TEST]; /* the model layer of the file's MoE layer i */
    for (int l = 0, i = 0; l < c.num_layers; l++)
        if (mt_moe_layer(&c, l) && i < MT_MAX_MOE_PATTERN_TEST) moe_layer_of[i++] = l;
    int64_t big = v->n > (int64_t)v->G * T * v->Vp ? v->n : (int64_t)v->G * T * v->Vp;
    float* buf = (float*)malloc(sizeof(float) * (size_t)big);
    float* stats = (float*)malloc(sizeof(float) * (size_t)Lm * (4 + 2 * E) + 64);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)Lm * E);
    float* probs = (float*)malloc(sizeof(float) * (size_t)N0 * E);
    int32_t* rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)N0 * E);
    test_result result = TEST_PASS;
    mt_trainer* t = NULL;
    char why[512] = "";
#define CHECK_OR_FAIL(cond, ...)                                            \
    do {                                                                    \
        if (!(cond)) {                                                      \
            printf("    FAIL %s:%d: ", __FILE__, __LINE__);                 \
            printf(__VA_ARGS__);                                            \
            printf("\n");                                                   \
            result = TEST_FAIL;                                             \
            goto done;                                                      \
        }                                                                   \
    } while (0)
#define OK_OR_FAIL(call)                                                                              \
    do {                                                                                              \
        mt_status st_ = (call);                                                                       \
        CHECK_OR_FAIL(st_ == MT_OK, "%s -> %s: %s", #call, mt_status_name(st_), err.message);        \
    } while (0)
    {
        OK_OR_FAIL(mt_trainer_create(&t, &c, &err));
        OK_OR_FAIL(mt_trainer_set_parameters(t, v->params0, &err));

        /* 1. the first micro-batch's routing: one training micro-batch, its saved probabilities and map (the
         * reference's token order n = t * mb + b; ours rows r = b * T + t) */
        double loss = 0.0;
        OK_OR_FAIL(mt_trainer_compute_gradients(t, v->tokens, 1, &loss, &err));
        {
            int64_t map_mismatch = 0;
            double worst_prob = 0.0;
            for (int l = 0; l < Lm; l++) {
                const layer_view<float> lv = layer_activations<float>(&t->act, model_shape(t), &t->cfg.recompute,
                                                                     c.num_layers, moe_layer_of[l]);
                OK_OR_FAIL(copy_sync(t, probs, lv.moe_probs, sizeof(float) * (size_t)N0 * E, cudaMemcpyDeviceToHost, &err));
                OK_OR_FAIL(copy_sync(t, rows, lv.moe_row, sizeof(int32_t) * (size_t)N0 * E, cudaMemcpyDeviceToHost, &err));
                for (int n = 0; n < N0; n++) {
                    const int r = (n % mb) * T + n / mb;
                    const float* ref = mv.route_probs0 + ((size_t)l * N0 + n) * E;
                    float top = 0.0f;
                    int64_t row_mismatch = 0;
                    for (int e = 0; e < E; e++) {
                        top = fabsf(ref[e]) > top ? fabsf(ref[e]) : top;
                        const int in_map = rows[(size_t)r * E + e] >= 0;
                        row_mismatch += in_map != (mv.route_map0[((size_t)l * N0 + n) * E + e] != 0);
                    }
                    map_mismatch += row_mismatch;
                    if (row_mismatch) continue; /* a flipped decision renormalises the token's probabilities */
                    for (int e = 0; e < E; e++) {
                        const double d = fabs((double)probs[(size_t)r * E + e] - ref[e]) / (top > 0 ? top : 1.0f);
                        if (d > worst_prob) worst_prob = d;
                    }
                }
            }
            printf("      first micro-batch's routing: %lld map entries differ, probabilities worst %.3e of the row's "
                   "largest (tol %.1e)\n", (long long)map_mismatch, worst_prob, tol->probs);
            /* bf16: a flip moves one token's choice (two entries of its row); at most 2% of the routed pairs */
            const int64_t pairs = (int64_t)Lm * N0 * mv.topk;
            CHECK_OR_FAIL(tol->exact_routing ? map_mismatch == 0 : map_mismatch * 50 <= 2 * pairs,
                          "%lld routing map entries differ (%lld pairs routed)", (long long)map_mismatch, (long long)pairs);
            CHECK_OR_FAIL(worst_prob <= tol->probs, "routing probabilities off by %.3e", worst_prob);
        }

        /* 2. evaluation logits of step 0's batch, one micro-batch at a time (capacity applies, no aux losses) */
        int32_t* in = (int32_t*)malloc(sizeof(int32_t) * (size_t)mb * T);
        double worst_logits = 0.0;
        for (int m = 0; m < v->G / mb; m++) {
            for (int b = 0; b < mb; b++)
                memcpy(in + (size_t)b * T, v->tokens + ((size_t)m * mb + b) * (T + 1), sizeof(int32_t) * T);
            mt_status st = mt_trainer_logits(t, in, buf, &err);
            if (st != MT_OK) { free(in); OK_OR_FAIL(st); }
            double e = rel_error(buf, v->logits + (size_t)m * mb * T * v->Vp, (int64_t)mb * T * v->Vp, NULL);
            if (e > worst_logits) worst_logits = e;
        }
        free(in);
        printf("      logits rel err %.3e (tol %.1e)\n", worst_logits, tol->logits);
        CHECK_OR_FAIL(worst_logits <= tol->logits, "logits rel err %.3e > %.1e", worst_logits, tol->logits);

        /* 3. the loss and every gradient of step 0's batch */
        OK_OR_FAIL(mt_trainer_compute_gradients(t, v->tokens, v->G / mb, &loss, &err));
        const double loss_err = fabs(loss - v->loss0) / fabs(v->loss0);
        printf("      loss %.7f ref %.7f rel err %.3e (tol %.1e)\n", loss, v->loss0, loss_err, tol->loss);
        CHECK_OR_FAIL(loss_err <= tol->loss, "loss %.7f vs %.7f", loss, v->loss0);
        OK_OR_FAIL(mt_trainer_get_gradients(t, buf, &err));
        CHECK_OR_FAIL(moe_compare_tensors("grad", &c, buf, v->grads0, tol->grads, tol->grads_element, tol->router_grads,
                                          why, sizeof(why)),
                      "%s", why);
        mt_trainer_free(t);
        t = NULL;

        /* 4. S optimizer steps from params0: losses, norms, rates, the MoE statistics of each step */
        OK_OR_FAIL(mt_trainer_create(&t, &c, &err));
        OK_OR_FAIL(mt_trainer_set_parameters(t, v->params0, &err));
        int64_t token_diff_worst = 0;
        for (int k = 0; k < v->S; k++) {
            mt_step_result r;
            OK_OR_FAIL(mt_trainer_train_step(t, v->tokens + (size_t)k * v->G * (T + 1), &r, &err));
            const double le = fabs(r.lm_loss - v->losses[k]) / fabs(v->losses[k]);
            const double ne = fabs(r.grad_norm - v->grad_norms[k]) / fabs(v->grad_norms[k]);
            const double lre = fabs(r.learning_rate - v->lrs[k]);
            OK_OR_FAIL(mt_trainer_moe_stats(t, stats, tokens, stats + (size_t)Lm * 4, &err));
            double worst_moe = 0.0;
            for (int l = 0; l < Lm; l++)
                for (int kind = 0; kind < 4; kind++) {
                    const double ref = mv.moe_losses[((size_t)k * 4 + kind) * Lm + l];
                    const double d = fabs(stats[l * 4 + kind] - ref) / (fabs(ref) > 1e-30 ? fabs(ref) : 1.0);
                    if (d > worst_moe) worst_moe = d;
                }
            int64_t token_diff = 0, bias_diff = 0;
            for (int i = 0; i < Lm * E; i++) {
                token_diff += llabs((long long)tokens[i] - mv.tokens_per_expert[(size_t)k * Lm * E + i]);
                bias_diff += stats[(size_t)Lm * 4 + i] != mv.expert_bias[(size_t)(k + 1) * Lm * E + i];
            }
            if (token_diff > token_diff_worst) token_diff_worst = token_diff;
            printf("      step %2d loss %.6f ref %.6f | norm %.5f ref %.5f | moe losses worst %.2e | tokens per expert "
                   "off by %lld | expert bias entries off %lld\n", k, r.lm_loss, v->losses[k], r.grad_norm,
                   v->grad_norms[k], worst_moe, (long long)token_diff, (long long)bias_diff);
            CHECK_OR_FAIL(le <= tol->steps_loss, "step %d loss rel err %.3e", k, le);
            CHECK_OR_FAIL(ne <= 10 * tol->grads, "step %d grad norm rel err %.3e", k, ne);
            CHECK_OR_FAIL(lre <= 1e-9 + 1e-6 * v->lrs[k], "step %d lr %.9g vs %.9g", k, r.learning_rate, v->lrs[k]);
            CHECK_OR_FAIL(worst_moe <= tol->moe_loss, "step %d logged MoE losses off by %.3e", k, worst_moe);
            if (tol->exact_routing) {
                CHECK_OR_FAIL(token_diff == 0, "step %d: tokens per expert differ by %lld", k, (long long)token_diff);
                CHECK_OR_FAIL(bias_diff == 0, "step %d: %lld expert bias entries differ", k, (long long)bias_diff);
            } else {
                const int64_t pairs = (int64_t)v->G * T * mv.topk * Lm;
                CHECK_OR_FAIL(token_diff * 10 <= pairs, "step %d: tokens per expert differ by %lld of %lld", k,
                              (long long)token_diff, (long long)pairs);
            }
        }
        OK_OR_FAIL(mt_trainer_get_parameters(t, buf, &err));
        CHECK_OR_FAIL(moe_compare_tensors("weights", &c, buf, v->params_final, tol->params, 1e30, tol->router_params,
                                          why, sizeof(why)),
                      "%s", why);
        /* per tensor against the reference's own movement (tests/test_model.h says why) */
        mt_param_info info[MT_NUM_PARAM_TENSORS];
        mt_param_layout(&c, info);
        for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
            double num = 0.0, den = 0.0;
            for (int64_t j = info[i].offset; j < info[i].offset + info[i].numel; j++) {
                const double d = (double)buf[j] - v->params_final[j], m = (double)v->params_final[j] - v->params0[j];
                num += d * d;
                den += m * m;
            }
            if (info[i].numel == 0) continue;
            const double ratio = den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
            CHECK_OR_FAIL(ratio <= 0.5, "%s ended %.3e of its movement away from the reference", info[i].name, ratio);
        }

        /* 5. bitwise repeatable: the same S steps again give the same weights */
        if (tol->exact_routing) {
            float* again = (float*)malloc(sizeof(float) * (size_t)v->n);
            mt_trainer_free(t);
            t = NULL;
            mt_status st = mt_trainer_create(&t, &c, &err);
            if (st == MT_OK) st = mt_trainer_set_parameters(t, v->params0, &err);
            for (int k = 0; k < v->S && st == MT_OK; k++) {
                mt_step_result r;
                st = mt_trainer_train_step(t, v->tokens + (size_t)k * v->G * (T + 1), &r, &err);
            }
            if (st == MT_OK) st = mt_trainer_get_parameters(t, again, &err);
            const int same = st == MT_OK && !memcmp(again, buf, sizeof(float) * (size_t)v->n);
            free(again);
            OK_OR_FAIL(st);
            printf("      rerun: weights bitwise %s\n", same ? "equal" : "DIFFERENT");
            CHECK_OR_FAIL(same, "a rerun of the %d steps gave other weights", v->S);
        }
    }
done:
#undef CHECK_OR_FAIL
#undef OK_OR_FAIL
    if (t) mt_trainer_free(t);
    free(buf);
    free(stats);
    free(tokens);
    free(probs);
    free(rows);
    free(mv.g.blob);
    return result;
}

static const moe_tolerances moe_fp32 = {1e-5, 1e-5, 1e-5, 1e-4, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1};
static const moe_tolerances moe_bf16 = {5e-2, 2e-2, 1e-1, 1e30, 5e-2, 2e-2, 5e-3, 5e-2, 3e-1, 1e-1, 0};

static test_result test_moe_mixtral_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/mixtral_tiny.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_mixtral_bf16(void) {
    return check_moe_against_reference("dev/data/moe_vectors/mixtral_tiny.bin", MT_BF16, &moe_bf16);
}
static test_result test_moe_deepseek_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/deepseek_tiny_all.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_qwen3_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/qwen3_tiny.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_capacity_probs_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/moe_cap_probs.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_capacity_position_pad_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/moe_cap_position_pad.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_shared_gate_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/moe_shared_gate.bin", MT_FP32, &moe_fp32);
}
/* DeepSeek-style with a dense first layer (--moe-layer-freq pattern [0, 1, 1]): the dense layer's MLP beside
 * MoE layers with a shared expert */
static test_result test_moe_deepseek_dense_first_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/deepseek_tiny.bin", MT_FP32, &moe_fp32);
}
/* GPT flavour (issue #34): LayerNorm, learned positions, linear biases everywhere (the router's; each expert's fc1
 * bias before its GELU and its fc2 bias times the row's probability, as Megatron's experts), GELU experts of width
 * 48 (fc1 as wide as the expert), top-2 softmax, MoE layers 0 and 2 beside a dense GELU layer, aux and z losses */
static test_result test_moe_gpt_gelu_biases_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/gpt_moe_tiny.bin", MT_FP32, &moe_fp32);
}
/* squared-ReLU experts (--squared-relu, issue #34): the experts' and the dense layer's activation relu(z)^2, Llama
 * flavour, MoE layers 0 and 2 beside a dense layer, top-2 softmax, the aux loss */
static test_result test_moe_squared_relu_fp32(void) {
    return check_moe_against_reference("dev/data/moe_vectors/sqrelu_moe_tiny.bin", MT_FP32, &moe_fp32);
}
static test_result test_moe_deepseek_bf16(void) {
    return check_moe_against_reference("dev/data/moe_vectors/deepseek_tiny_all.bin", MT_BF16, &moe_bf16);
}

/* Issue #34: MoE checkpoints resume bitwise. deepseek_tiny_all's model (sigmoid routing in groups with the
 * expert bias, the sequence aux loss, a gated shared expert; fp32, where runs are deterministic: test 5
 * above) from its random weights: K steps, save, K more (the straight run); a fresh trainer loads the save
 * (its expert bias bitwise the saved one, which moved away from 0), saves it again at once (every file of
 * the iteration byte-identical: model file and manifest) and trains the same K steps: each step's loss,
 * logged MoE losses (the step's and each layer's), tokens per expert and expert bias, and the final
 * weights, bitwise the straight run's. --no-load-optim (mt_trainer_load_weights) takes the bias too (model
 * state, as Megatron's persistent buffer). Refused in one line naming the flag: a dense checkpoint of the
 * same transformer into this MoE run, and this checkpoint into a run without --moe-router-enable-expert-bias. */
static test_result test_moe_checkpoint_resume_bitwise(void) {
    REQUIRE_GPU();
    enum { K = 4 };
    moe_vectors mv;
    if (access("dev/data/moe_vectors/deepseek_tiny_all.bin", R_OK) != 0)
        SKIP_OR_FAIL_STRICT(MOE_VECTORS_MISSING, "dev/data/moe_vectors/deepseek_tiny_all.bin");
    if (!load_moe_vectors(&mv, "dev/data/moe_vectors/deepseek_tiny_all.bin")) {
        free(mv.g.blob);
        printf("    FAIL cannot read dev/data/moe_vectors/deepseek_tiny_all.bin (run dev/ref_moe.py)\n");
        return TEST_FAIL;
    }
    const gpt_vectors* v = &mv.g;
    mt_config c = moe_config_from_vectors(&mv, MT_FP32);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.moe_router_enable_expert_bias && c.moe_router_score_sigmoid && c.moe_router_num_groups > 0 &&
               (c.moe_load_balancing & MT_MOE_SEQ_AUX_LOSS) && c.moe_shared_expert_intermediate_size > 0,
           "deepseek_tiny_all is not the configuration this test needs");
    const int Lm = mv.Lm, E = mv.E;
    const int64_t n = v->n, per_step = (int64_t)c.global_batch_size * (c.seq_length + 1), LE = (int64_t)Lm * E;
    char dir[3][256];
    for (int i = 0; i < 3; i++) {
        snprintf(dir[i], sizeof(dir[i]), "/tmp/mt_test_moe_ckpt_%d_%d", (int)getpid(), i);
        mt_remove_tree(dir[i]);
    }
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)per_step);
    float* pa = (float*)malloc(sizeof(float) * (size_t)n);
    float* pb = (float*)malloc(sizeof(float) * (size_t)n);
    /* per step of the second K: [0] the loss and r.moe_losses as doubles; per layer stats, tokens, bias */
    double steps[2][K][5];
    float* layer_losses = (float*)malloc(sizeof(float) * 2 * K * Lm * 4);
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * 2 * K * LE);
    float* bias = (float*)malloc(sizeof(float) * (2 * K + 2) * LE); /* [2][K] after each step, saved, loaded */
    float* saved_bias = bias + 2 * K * LE;
    float* loaded_bias = saved_bias + LE;
    test_result result = TEST_PASS;
    mt_trainer* t = NULL;
#define CHECK_OR_FAIL(cond, ...)                            \
    do {                                                    \
        if (!(cond)) {                                      \
            printf("    FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                            \
            printf("\n");                                   \
            result = TEST_FAIL;                             \
            goto done;                                      \
        }                                                   \
    } while (0)
#define OK_OR_FAIL(call)                                                                       \
    do {                                                                                       \
        mt_status st_ = (call);                                                                \
        CHECK_OR_FAIL(st_ == MT_OK, "%s -> %s: %s", #call, mt_status_name(st_), err.message); \
    } while (0)
    for (int run = 0; run < 2; run++) {
        /* run 0: the straight run from the file's weights, saving after K steps; run 1: loads that save */
        OK_OR_FAIL(mt_trainer_create(&t, &c, &err));
        if (run == 0) {
            OK_OR_FAIL(mt_trainer_set_parameters(t, v->params0, &err));
            for (int k = 0; k < K; k++) {
                mt_step_result r;
                fill_tokens(tokens, per_step, (int)c.vocab_size, 4000 + k);
                OK_OR_FAIL(mt_trainer_train_step(t, tokens, &r, &err));
            }
            OK_OR_FAIL(mt_trainer_save(t, dir[0], K, (int64_t)K * c.global_batch_size, &err));
            OK_OR_FAIL(mt_trainer_moe_stats(t, NULL, NULL, saved_bias, &err));
            int64_t moved = 0;
            for (int64_t i = 0; i < LE; i++) moved += saved_bias[i] != 0.0f;
            printf("      after %d steps %lld of %lld expert bias entries moved from 0\n", K, (long long)moved, (long long)LE);
            CHECK_OR_FAIL(moved > 0, "the expert bias did not move (a load that dropped it would pass)");
        } else {
            int64_t it = -1, consumed = -1;
            OK_OR_FAIL(mt_trainer_load(t, dir[0], -1, &it, &consumed, &err));
            CHECK_OR_FAIL(it == K && consumed == (int64_t)K * c.global_batch_size, "resumed at %lld (%lld samples)",
                          (long long)it, (long long)consumed);
            OK_OR_FAIL(mt_trainer_moe_stats(t, NULL, NULL, loaded_bias, &err));
            CHECK_OR_FAIL(!memcmp(loaded_bias, saved_bias, sizeof(float) * (size_t)LE), "the loaded expert bias differs");
            /* saved again at once: the same files */
            OK_OR_FAIL(mt_trainer_save(t, dir[1], K, (int64_t)K * c.global_batch_size, &err));
            const char* files[] = {"mp_rank_00/model_optim_rng.bin", "manifest.txt"};
            for (int f = 0; f < 2; f++) {
                char p1[512], p2[512];
                size_t n1 = 0, n2 = 0;
                snprintf(p1, sizeof(p1), "%s/iter_%07d/%s", dir[0], K, files[f]);
                snprintf(p2, sizeof(p2), "%s/iter_%07d/%s", dir[1], K, files[f]);
                char* x = test_read_file(p1, &n1);
                char* y = test_read_file(p2, &n2);
                const int same = x && y && n1 == n2 && !memcmp(x, y, n1);
                free(x);
                free(y);
                CHECK_OR_FAIL(same, "saved again after the load, %s differs (%zu vs %zu bytes)", files[f], n1, n2);
            }
            printf("      loaded: expert bias bitwise the saved one; saved again: the same files\n");
        }
        for (int k = 0; k < K; k++) {
            mt_step_result r;
            fill_tokens(tokens, per_step, (int)c.vocab_size, 4000 + K + k);
            OK_OR_FAIL(mt_trainer_train_step(t, tokens, &r, &err));
            steps[run][k][0] = r.lm_loss;
            for (int q = 0; q < 4; q++) steps[run][k][1 + q] = r.moe_losses[q];
            OK_OR_FAIL(mt_trainer_moe_stats(t, layer_losses + ((size_t)run * K + k) * Lm * 4,
                                            tok + ((size_t)run * K + k) * LE, bias + ((size_t)run * K + k) * LE, &err));
        }
        OK_OR_FAIL(mt_trainer_get_parameters(t, run ? pb : pa, &err));
        mt_trainer_free(t);
        t = NULL;
    }
    for (int k = 0; k < K; k++) {
        const size_t at = (size_t)K + k;
        printf("      step %d loss %.9g / %.9g, seq aux loss %.9g / %.9g\n", K + k, steps[0][k][0], steps[1][k][0],
               steps[0][k][2], steps[1][k][2]);
        CHECK_OR_FAIL(!memcmp(steps[0][k], steps[1][k], sizeof(steps[0][k])), "step %d: the loss or the logged MoE "
                      "losses differ after the resume", K + k);
        CHECK_OR_FAIL(!memcmp(layer_losses + (size_t)k * Lm * 4, layer_losses + at * Lm * 4, sizeof(float) * Lm * 4),
                      "step %d: a layer's logged MoE losses differ", K + k);
        CHECK_OR_FAIL(!memcmp(tok + (size_t)k * LE, tok + at * LE, sizeof(int32_t) * (size_t)LE),
                      "step %d: the tokens per expert differ", K + k);
        CHECK_OR_FAIL(!memcmp(bias + (size_t)k * LE, bias + at * LE, sizeof(float) * (size_t)LE),
                      "step %d: the expert bias differs", K + k);
    }
    CHECK_OR_FAIL(!memcmp(pa, pb, sizeof(float) * (size_t)n), "the final weights differ after the resume");
    CHECK_OR_FAIL(steps[0][0][2] > 0.0, "no sequence aux loss was logged");
    printf("      resumed: %d steps' losses, MoE losses, tokens per expert, expert bias and weights bitwise equal\n", K);

    /* --no-load-optim: the bias is model state, it loads with the weights */
    OK_OR_FAIL(mt_trainer_create(&t, &c, &err));
    OK_OR_FAIL(mt_trainer_load_weights(t, dir[0], -1, NULL, NULL, &err));
    OK_OR_FAIL(mt_trainer_moe_stats(t, NULL, NULL, loaded_bias, &err));
    CHECK_OR_FAIL(!memcmp(loaded_bias, saved_bias, sizeof(float) * (size_t)LE),
                  "mt_trainer_load_weights (--no-load-optim) did not take the expert bias");
    mt_trainer_free(t);
    t = NULL;
    {
        /* refusals, one line naming the flag: a dense checkpoint into this run; this one into a run without the bias */
        mt_config dense = config_from_vectors(v, MT_FP32), nob = moe_config_from_vectors(&mv, MT_FP32);
        nob.moe_router_enable_expert_bias = 0;
        OK_OR_FAIL(mt_config_finalize(&dense, &err));
        OK_OR_FAIL(mt_config_finalize(&nob, &err));
        OK_OR_FAIL(mt_trainer_create(&t, &dense, &err));
        OK_OR_FAIL(mt_trainer_save(t, dir[2], 3, 3 * (int64_t)dense.global_batch_size, &err));
        mt_trainer_free(t);
        t = NULL;
        struct { const mt_config* run; const char* from; const char* needle; } cases[] = {
            {&c, dir[2], "has --num-experts (0: a dense model) 0 but this run has"},
            {&nob, dir[0], "has --moe-router-enable-expert-bias (the routers' expert bias) 1 but this run has 0"},
        };
        for (int i = 0; i < 2; i++) {
            OK_OR_FAIL(mt_trainer_create(&t, cases[i].run, &err));
            err.message[0] = 0;
            mt_status st = mt_trainer_load(t, cases[i].from, -1, NULL, NULL, &err);
            mt_trainer_free(t);
            t = NULL;
            CHECK_OR_FAIL(st == MT_ERR_CONFIG && strstr(err.message, cases[i].needle) && !strchr(err.message, '\n'),
                          "case %d: %s '%s'", i, mt_status_name(st), err.message);
        }
        printf("      refused: a dense checkpoint into the MoE run, the expert bias into a run without it\n");
    }
done:
#undef CHECK_OR_FAIL
#undef OK_OR_FAIL
    if (t) mt_trainer_free(t);
    for (int i = 0; i < 3; i++) mt_remove_tree(dir[i]);
    free(tokens);
    free(pa);
    free(pb);
    free(layer_losses);
    free(tok);
    free(bias);
    free(mv.g.blob);
    return result;
}

static const test_case moe_gpu_tests[] = {
    {"mixtral_fp32_matches_reference", test_moe_mixtral_fp32},
    {"deepseek_fp32_matches_reference", test_moe_deepseek_fp32},
    {"deepseek_dense_first_layer_fp32_matches_reference", test_moe_deepseek_dense_first_fp32},
    {"qwen3_fp32_matches_reference", test_moe_qwen3_fp32},
    {"capacity_probs_fp32_matches_reference", test_moe_capacity_probs_fp32},
    {"capacity_position_pad_fp32_matches_reference", test_moe_capacity_position_pad_fp32},
    {"shared_gate_fp32_matches_reference", test_moe_shared_gate_fp32},
    {"gpt_gelu_biases_fp32_matches_reference", test_moe_gpt_gelu_biases_fp32},
    {"squared_relu_fp32_matches_reference", test_moe_squared_relu_fp32},
    {"mixtral_bf16_matches_reference", test_moe_mixtral_bf16},
    {"deepseek_bf16_matches_reference", test_moe_deepseek_bf16},
    {"checkpoint_resume_bitwise", test_moe_checkpoint_resume_bitwise},
};

#endif /* MT_TEST_MOE_H */
