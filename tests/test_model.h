/* tests/test_model.h — the GPT model, GPT-2 and Llama flavours (GPU tests; each skips when no GPU
 * is visible): parity with the float64 PyTorch reference (dev/ref_gpt.py ->
 * dev/data/gpt_vectors/NAME.bin: logits, loss, every gradient, S AdamW steps) in fp32 and bf16,
 * Megatron's initialisation, and gradients written (not zeroed, then accumulated) by the first
 * micro-batch. Also the helpers other files compare models with: rel_error, key_bias_mask.
 *
 * Tolerances. Errors are measured per tensor as ||ours - ref|| / ||ref|| (norm-wise relative), which
 * is what rounding error bounds speak of; elementwise ratios explode on entries near zero.
 *   fp32: every GEMM runs in true fp32 (no TF32), so errors are a few fp32 ulps amplified by depth:
 *         1e-5 on logits, loss and gradients. After S Adam steps: 1e-5 on the weights, because Adam's
 *         update m/sqrt(v) is scale-free, so a gradient error of e moves a weight by about lr*e.
 *   bf16: (gpt2_small, head dim 64, runs the flash-attention kernels; gpt2_tiny, head dim 16, the
 *         exact path) weights and activations carry 8 mantissa bits (relative rounding 2^-9 = 2e-3 per value),
 *         accumulated over ~10 roundings per layer on the forward path: 3e-2 on logits and gradients
 *         of this 2-layer model, 1e-2 relative on losses; weights after S steps within 3e-3 (the fp32
 *         master moves by lr-sized steps, so errors stay a small fraction of the update).
 * Excluded by design: the key-bias entries of qkv_bias. Their exact gradient is 0 (softmax is
 * invariant to a constant added to every score), so both sides hold rounding noise there and Adam
 * normalises noise into lr-sized steps; the test instead checks that those gradients are ~0. */
#ifndef MT_TEST_MODEL_H
#define MT_TEST_MODEL_H

/* ---- reading dev/ref_gpt.py's vector files ---- */

typedef struct {
    int32_t header[256];
    float hyper[64];
    int L, h, heads, f, Vp, P, T, G, mb, S, groups;
    int64_t n;           /* parameter floats */
    float* params0;      /* [n] */
    int32_t* tokens;     /* [S, G, T+1] */
    float* logits;       /* [G, T, Vp] */
    float loss0;
    float* grads0;       /* [n] */
    float* losses;       /* [S] */
    float* grad_norms;   /* [S] */
    float* lrs;          /* [S] */
    float* params_final; /* [n] */
    char* blob;
} gpt_vectors;

/* Reads the file whole into v->blob and points v's arrays into it, after checking its magic and version
 * (dev/ref_gpt.py's, or a file that extends its layout: dev/ref_moe.py's). Returns the end of the dense
 * arrays in the blob (the extension's arrays follow), or NULL; *size gets the file's size. */
static char* read_gpt_vectors(gpt_vectors* v, const char* path, int32_t magic, size_t* size) {
    memset(v, 0, sizeof(*v));
    v->blob = test_read_file(path, size);
    if (!v->blob || *size < 1024 + 256) return NULL;
    memcpy(v->header, v->blob, 1024);
    memcpy(v->hyper, v->blob + 1024, 256);
    if (v->header[0] != magic || v->header[1] != 1) return NULL;
    v->L = v->header[3]; v->h = v->header[4]; v->heads = v->header[5]; v->f = v->header[6]; v->Vp = v->header[7];
    v->P = v->header[8]; v->T = v->header[9]; v->G = v->header[10]; v->mb = v->header[11]; v->S = v->header[12];
    v->n = v->header[13]; v->groups = v->header[14];
    char* p = v->blob + 1280;
    v->params0 = (float*)p; p += 4 * v->n;
    v->tokens = (int32_t*)p; p += 4 * (size_t)v->S * v->G * (v->T + 1);
    v->logits = (float*)p; p += 4 * (size_t)v->G * v->T * v->Vp;
    memcpy(&v->loss0, p, 4); p += 4;
    v->grads0 = (float*)p; p += 4 * v->n;
    v->losses = (float*)p; p += 4 * v->S;
    v->grad_norms = (float*)p; p += 4 * v->S;
    v->lrs = (float*)p; p += 4 * v->S;
    v->params_final = (float*)p; p += 4 * v->n;
    return p;
}

static int load_gpt_vectors(gpt_vectors* v, const char* path) {
    size_t size = 0;
    const char* end = read_gpt_vectors(v, path, 20261121, &size);
    return end && (size_t)(end - v->blob) == size;
}

static mt_config config_from_vectors(const gpt_vectors* v, mt_precision precision) {
    mt_config c;
    mt_config_defaults(&c);
    c.num_layers = v->L;
    c.hidden_size = v->h;
    c.num_attention_heads = v->heads;
    c.num_query_groups = v->groups;
    c.ffn_hidden_size = v->f;
    c.vocab_size = v->Vp;
    c.seq_length = v->T;
    c.max_position_embeddings = v->P;
    c.micro_batch_size = v->mb;
    c.global_batch_size = v->G;
    c.train_iters = v->S;
    c.lr = v->hyper[0];
    c.min_lr = v->hyper[1];
    c.lr_warmup_iters = (int64_t)v->hyper[2];
    c.lr_decay_iters = (int64_t)v->hyper[3];
    c.lr_decay_style = MT_LR_COSINE;
    c.adam_beta1 = v->hyper[4];
    c.adam_beta2 = v->hyper[5];
    c.adam_eps = v->hyper[6];
    c.weight_decay = v->hyper[7];
    c.clip_grad = v->hyper[8];
    c.norm_epsilon = v->hyper[9];
    /* the flavour (all 0 in GPT-2 files): header [15] kv channels, [16] RMSNorm, [17] SwiGLU, [18] rope,
     * [19] untied, [20] no linear biases, [21] Llama-3.1 rope scaling; hyper [10] rotary base,
     * [11] rotary percent, [12] rope scaling factor */
    c.kv_channels = v->header[15];
    c.normalization = v->header[16] ? MT_NORM_RMSNORM : MT_NORM_LAYERNORM;
    c.swiglu = v->header[17];
    c.position_embedding_type = (mt_position_embedding)v->header[18]; /* 0 learned, 1 rope, 2 none */
    c.untie_embeddings_and_output_weights = v->header[19];
    c.add_bias_linear = !v->header[20];
    c.use_rope_scaling = v->header[21];
    c.hidden_dropout = v->hyper[13]; /* hyper [13], [14] the dropout probabilities, header [24] its seed (0:
                                        none, files without dropout) */
    c.attention_dropout = v->hyper[14];
    if (v->header[24]) c.seed = v->header[24];
    c.apply_layernorm_1p = v->header[22];      /* [22] norm weights hold w - 1 */
    c.squared_relu = v->header[25];            /* [25] --squared-relu, [26] --qk-layernorm (0 in older files) */
    c.qk_layernorm = v->header[26];
    c.eod_mask_loss = v->header[23] > 0;        /* [23] the end-of-document id + 1 (0: no loss mask) */
    c.eod_token = v->header[23] - 1;
    c.reset_position_ids = v->header[27];       /* [27] --reset-position-ids, [28] --reset-attention-mask, */
    c.reset_attention_mask = v->header[28];     /* [29] the documents' end-of-document id + 1 (0 in older files) */
    if (v->header[29] > 0) c.eod_token = v->header[29] - 1;
    if (v->header[18] == MT_POSITION_ROPE) {
        c.rotary_base = v->hyper[10];
        c.rotary_percent = v->hyper[11];
        c.rope_scaling_factor = v->hyper[12];
    }
    c.precision = precision;
    return c;
}

static double rel_error(const float* a, const float* ref, int64_t n, const unsigned char* skip) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (skip && skip[i]) continue;
        double d = (double)a[i] - (double)ref[i];
        if (d != d) return INFINITY;
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Marks, in a parameter-sized mask, the bias that is added to every key alike: its gradient is 0 in
 * exact arithmetic (a query's scores all move by q.b, which the softmax ignores), so both sides hold
 * rounding noise there, and Adam turns noise into O(lr) moves. Without --qk-layernorm that is the key
 * part of qkv_bias; with it the key norm's bias (the key norm's statistics depend on qkv_bias, whose
 * gradient is then a real one). Neither with rotary positions, which rotate the bias per position. */
static unsigned char* key_bias_mask(const mt_config* c) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    int64_t n = mt_param_layout(c, info);
    unsigned char* mask = (unsigned char*)calloc((size_t)n, 1);
    if (c->qk_layernorm) {
        if (c->position_embedding_type != MT_POSITION_ROPE)
            memset(mask + info[MT_P_K_LAYERNORM_BIAS].offset, 1, (size_t)info[MT_P_K_LAYERNORM_BIAS].numel);
        return mask;
    }
    if (info[MT_P_QKV_BIAS].numel == 0) return mask; /* no biases */
    int qpg = c->num_attention_heads / c->num_query_groups, d = c->kv_channels;
    int width = (c->num_attention_heads + 2 * c->num_query_groups) * d;
    for (int l = 0; l < c->num_layers; l++)
        for (int g = 0; g < c->num_query_groups; g++)
            for (int e = 0; e < d; e++)
                mask[info[MT_P_QKV_BIAS].offset + (int64_t)l * width + (int64_t)g * (qpg + 2) * d + qpg * d + e] = 1;
    return mask;
}

/* Compares ours vs ref tensor by tensor; prints every tensor's error; returns the worst. */
static double compare_params(const char* what, const mt_config* c, const float* ours, const float* ref,
                             const unsigned char* skip, int verbose) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, info);
    double worst = 0.0;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        double e = rel_error(ours + info[i].offset, ref + info[i].offset, info[i].numel,
                             skip ? skip + info[i].offset : NULL);
        if (verbose) printf("      %-8s %-20s rel err %.3e\n", what, info[i].name, e);
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

/* The vector check for one file and precision; adjust (may be NULL) changes the config first (FP8). */
static test_result check_against_reference_adjusted(const char* path, mt_precision precision,
                                                    void (*adjust)(mt_config*), double tol_logits, double tol_loss,
                                                    double tol_grads, double tol_steps_loss, double tol_params) {
    REQUIRE_GPU();
    gpt_vectors v;
    if (!load_gpt_vectors(&v, path)) {
        free(v.blob);
        printf("    FAIL cannot read test vectors %s (run dev/ref_gpt.py)\n", path);
        return TEST_FAIL;
    }
    mt_config c = config_from_vectors(&v, precision);
    if (adjust) adjust(&c);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.padded_vocab_size == v.Vp && mt_num_parameters(&c) == v.n, "shape mismatch with %s", path);
    unsigned char* mask = key_bias_mask(&c);
    float* buf = (float*)malloc(sizeof(float) * (size_t)(v.n > (int64_t)v.G * v.T * v.Vp ? v.n : (int64_t)v.G * v.T * v.Vp));
    test_result result = TEST_PASS;
    mt_trainer* t = NULL;
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
        OK_OR_FAIL(mt_trainer_set_parameters(t, v.params0, &err));

        /* 1. logits of step 0's batch, one micro-batch at a time */
        int32_t* rows = (int32_t*)malloc(sizeof(int32_t) * (size_t)v.mb * v.T);
        double worst_logits = 0.0;
        for (int m = 0; m < v.G / v.mb; m++) {
            for (int b = 0; b < v.mb; b++)
                memcpy(rows + (size_t)b * v.T, v.tokens + ((size_t)m * v.mb + b) * (v.T + 1), sizeof(int32_t) * v.T);
            mt_status st = mt_trainer_logits(t, rows, buf, &err);
            if (st != MT_OK) { free(rows); OK_OR_FAIL(st); }
            double e = rel_error(buf, v.logits + (size_t)m * v.mb * v.T * v.Vp, (int64_t)v.mb * v.T * v.Vp, NULL);
            if (e > worst_logits) worst_logits = e;
        }
        free(rows);
        printf("      logits rel err %.3e (tol %.1e)\n", worst_logits, tol_logits);
        CHECK_OR_FAIL(worst_logits <= tol_logits, "logits rel err %.3e > %.1e", worst_logits, tol_logits);

        /* 2. loss and every gradient of step 0's batch (G/mb micro-batches accumulated) */
        double loss = 0.0;
        OK_OR_FAIL(mt_trainer_compute_gradients(t, v.tokens, v.G / v.mb, &loss, &err));
        double loss_err = fabs(loss - v.loss0) / fabs(v.loss0);
        printf("      loss %.7f ref %.7f rel err %.3e (tol %.1e)\n", loss, v.loss0, loss_err, tol_loss);
        CHECK_OR_FAIL(loss_err <= tol_loss, "loss %.7f vs %.7f", loss, v.loss0);
        OK_OR_FAIL(mt_trainer_get_gradients(t, buf, &err));
        double worst_grad = compare_params("grad", &c, buf, v.grads0, mask, 1);
        CHECK_OR_FAIL(worst_grad <= tol_grads, "gradient rel err %.3e > %.1e", worst_grad, tol_grads);
        double key_bias_max = 0.0;
        for (int64_t i = 0; i < v.n; i++)
            if (mask[i] && fabs(buf[i]) > key_bias_max) key_bias_max = fabs(buf[i]);
        printf("      key-bias gradient max |g| %.3e (exactly 0 in exact arithmetic)\n", key_bias_max);
        CHECK_OR_FAIL(key_bias_max < 1e-4, "key-bias gradient %.3e is not ~0", key_bias_max);
        mt_trainer_free(t);
        t = NULL;

        /* 3. S optimizer steps from params0 */
        OK_OR_FAIL(mt_trainer_create(&t, &c, &err));
        OK_OR_FAIL(mt_trainer_set_parameters(t, v.params0, &err));
        for (int k = 0; k < v.S; k++) {
            mt_step_result r;
            OK_OR_FAIL(mt_trainer_train_step(t, v.tokens + (size_t)k * v.G * (v.T + 1), &r, &err));
            double le = fabs(r.lm_loss - v.losses[k]) / fabs(v.losses[k]);
            double ne = fabs(r.grad_norm - v.grad_norms[k]) / fabs(v.grad_norms[k]);
            double lre = fabs(r.learning_rate - v.lrs[k]);
            printf("      step %2d loss %.6f ref %.6f | norm %.5f ref %.5f | lr %.4e ref %.4e\n", k, r.lm_loss,
                   v.losses[k], r.grad_norm, v.grad_norms[k], r.learning_rate, v.lrs[k]);
            CHECK_OR_FAIL(le <= tol_steps_loss, "step %d loss rel err %.3e", k, le);
            /* FP8: 2e-2. The global norm's error is second order in the gradients' (||g||^2 = ||g_ref||^2 +
             * 2 <g_ref, e> + ||e||^2, the cross term averaging out over independent rounding errors): an
             * emulation of these runs (dev/fp8_calibration.py --file .../gpt2_small.bin, llama_small.bin)
             * measured at most 4.9e-3 (delayed hybrid) and 2.6e-3 (tensorwise --format e4m3) while the
             * gradients were 10-20% off */
            const double tol_norm = c.fp8_format != MT_FP8_NONE ? 2e-2 : 10 * tol_grads;
            CHECK_OR_FAIL(ne <= tol_norm, "step %d grad norm rel err %.3e > %.1e", k, ne, tol_norm);
            CHECK_OR_FAIL(lre <= 1e-9 + 1e-6 * v.lrs[k], "step %d lr %.9g vs %.9g", k, r.learning_rate, v.lrs[k]);
        }
        OK_OR_FAIL(mt_trainer_get_parameters(t, buf, &err));
        double worst_params = compare_params("weights", &c, buf, v.params_final, mask, 1);
        CHECK_OR_FAIL(worst_params <= tol_params, "weights after %d steps rel err %.3e > %.1e", v.S, worst_params,
                      tol_params);
        /* and per tensor against the reference's own movement ||w_ref - w0||: the norms' unit weights
         * move ~1e-2 of their size in these few steps, so the error relative to ||w|| above would
         * hardly see one that never moved (a lost update gives exactly 1 here). Without FP8 (whose
         * own tests bound this, tests/test_fp8.h) at most 0.5: measured bf16 differences are a few
         * 1e-2 of the movement (Adam's near-sign steps turn bf16 rounding into that), fp32's ~1e-5. */
        if (c.fp8_format == MT_FP8_NONE) {
            mt_param_info info[MT_NUM_PARAM_TENSORS];
            mt_param_layout(&c, info);
            double worst_moved = 0.0;
            const char* worst_name = "-";
            for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
                double num = 0.0, den = 0.0;
                for (int64_t k = info[i].offset; k < info[i].offset + info[i].numel; k++) {
                    if (mask[k]) continue;
                    const double d = (double)buf[k] - v.params_final[k], m = (double)v.params_final[k] - v.params0[k];
                    num += d * d;
                    den += m * m;
                }
                const double ratio = den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
                if (!(ratio <= worst_moved)) worst_moved = ratio, worst_name = info[i].name;
            }
            printf("      weights' distance from the reference, per tensor, of its movement: worst %.3e (%s)\n",
                   worst_moved, worst_name);
            CHECK_OR_FAIL(worst_moved <= 0.5, "%s ended %.3e of its movement away from the reference", worst_name,
                          worst_moved);
        }
    }
done:
#undef CHECK_OR_FAIL
#undef OK_OR_FAIL
    if (t) mt_trainer_free(t);
    free(mask);
    free(buf);
    free(v.blob);
    return result;
}

static test_result check_against_reference(const char* path, mt_precision precision, double tol_logits,
                                           double tol_loss, double tol_grads, double tol_steps_loss,
                                           double tol_params) {
    return check_against_reference_adjusted(path, precision, NULL, tol_logits, tol_loss, tol_grads, tol_steps_loss,
                                            tol_params);
}

static test_result test_gpt2_tiny_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_tiny.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_gpt2_small_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_small.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_gpt2_tiny_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_tiny.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 3e-3);
}
static test_result test_gpt2_small_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_small.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 3e-3);
}
/* The Llama flavour (RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases), same tolerances except
 * the bf16 weights after S steps, 5e-3: untied word-embedding rows only see the sparse gradient of
 * their own tokens (no dense output-layer gradient as when tied), and Adam normalises each row's
 * update, so those rows carry the whole bf16 gradient error (~5e-3 measured) into the update
 * instead of a fraction of it (llama_tiny: 3.3e-3 on word_embeddings, every other tensor <= 2e-3).
 * llama_tiny (head dim 16, 4 heads in 2 groups, Llama-3.1 rope scaling, exact attention path),
 * llama_small (head dim 64 = kv channels with hidden 64, 2 heads sharing 1 group, half the channels
 * rotary, base 500000; bf16 runs the flash kernels with grouped K/V). */
static test_result test_llama_tiny_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_tiny.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_llama_small_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_small.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_llama_tiny_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_tiny.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 5e-3);
}
static test_result test_llama_small_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_small.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 5e-3);
}

/* Megatron's functional-test switches (issue #32), each against its own vectors at its flavour's
 * tolerances above. --squared-relu (gpt2_sqrelu: GPT-2 with biases; every precision takes the bias +
 * relu(x)^2 kernels, cuBLASLt has no such epilogue): relu(x)^2 and its derivative 2 relu(x) are one
 * or two fp32 operations per element, fewer roundings than GELU's tanh path, so GELU's bounds hold.
 * --qk-layernorm, GPT-2 (gpt2_qkln: LayerNorm with biases on two heads of 64, learned positions;
 * bf16 runs the flash kernels from the normalised rows) and Llama (llama_qkln: RMSNorm with
 * --apply-layernorm-1p, MQA, half the channels rotary after the norms; bf16 flash): each q and k
 * head vector passes through one more norm, computed as the row norms are (fp32 statistics, one
 * rounding to T of each output), which adds ~2 roundings to T per layer in bf16 to the ~10 the
 * bounds were set for; the normalised heads make the scores O(1), whose bf16 error, ~sqrt(d) 2^-9
 * |q_e| |k_e| / sqrt(d) ~ 3e-3 absolute, stays within the probabilities' bf16 budget. The key-bias
 * gradient is a real gradient under a key norm; the key norm's bias has the zero gradient instead
 * (key_bias_mask). */
static test_result test_gpt2_sqrelu_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_sqrelu.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_gpt2_sqrelu_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_sqrelu.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 3e-3);
}
static test_result test_gpt2_qkln_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_qkln.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
/* The qk-layernorm configs' weights after 6 bf16 steps: 8.3e-3 (gpt2_qkln, qkv_weight) and 9.9e-3
 * (llama_qkln, word_embeddings) of the weights' size on an H200, against 0.5-3.5e-3 for the other
 * configs: their learning rate (llama_qkln 3e-3) and the normalised scores (O(1), so softmax
 * gradients are larger) move the weights further, and Adam's near-sign steps turn bf16 rounding into
 * differences proportional to the movement. 2e-2 here; the movement-relative check bounds them too. */
static test_result test_gpt2_qkln_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/gpt2_qkln.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 2e-2);
}
static test_result test_llama_qkln_fp32(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_qkln.bin", MT_FP32, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5);
}
static test_result test_llama_qkln_bf16(void) {
    return check_against_reference("dev/data/gpt_vectors/llama_qkln.bin", MT_BF16, 3e-2, 1e-2, 3e-2, 1e-2, 2e-2);
}

/* ---- FP8 (--fp8-format) against the same float64 reference ----
 * Tolerances, from the formats. E4M3 keeps 3 mantissa bits: round-to-nearest leaves a relative error
 * of at most 2^-4 per value, about 2^-4/sqrt(3) = 3.6% rms for values spread over a binade; a product
 * of two such operands carries ~5% rms, and a K-term dot product with random signs keeps that 5% as
 * its norm-wise error (the errors are independent of one another). E5M2 (hybrid's gradients) keeps 2
 * bits: 7% rms per value, ~8% per dgrad/wgrad product. Through this 2-layer model the FP8 GEMMs'
 * outputs are diluted by everything that stays bf16 (embeddings, residual stream, output layer), so
 * we allow 0.1 on logits and 0.3 on gradients norm-wise (a wrong or missing scale is off by factors,
 * or NaN), 2e-2 on losses, 0.5 on every gradient norm, and 3e-2 on the weights after S steps: Adam's
 * update is lr-sized whatever the gradient error, so the weights stay close while the gradients
 * differ by format noise. The key-bias gradients (exactly 0) are checked at < 1e-4 as always.
 * Delayed scaling's first step casts with scale 1 (no history yet, as Transformer Engine starts):
 * weights of std 0.02 then sit in E4M3's subnormal range (below 2^-6, spacing 2^-9), with relative
 * errors up to 10% for that step; an H100 measured 4.0e-2 on the QKV weights after 6 steps (8e-3
 * with tensorwise scaling), so the delayed runs allow 6e-2 on the weights. */
static void fp8_delayed_hybrid(mt_config* c) {
    c->fp8_format = MT_FP8_HYBRID;
    c->fp8_recipe = MT_FP8_DELAYED;
    c->fp8_amax_history_len = 4;
    c->fp8_amax_compute_algo = MT_FP8_AMAX_MAX;
}
static void fp8_tensorwise_e4m3(mt_config* c) {
    c->fp8_format = MT_FP8_E4M3;
    c->fp8_recipe = MT_FP8_TENSORWISE;
}
static test_result test_gpt2_small_fp8_delayed(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/gpt2_small.bin", MT_BF16, fp8_delayed_hybrid, 0.1,
                                            2e-2, 0.3, 2e-2, 6e-2);
}
static test_result test_gpt2_small_fp8_tensorwise(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/gpt2_small.bin", MT_BF16, fp8_tensorwise_e4m3, 0.1,
                                            2e-2, 0.3, 2e-2, 3e-2);
}
static test_result test_llama_small_fp8_delayed(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/llama_small.bin", MT_BF16, fp8_delayed_hybrid, 0.1,
                                            2e-2, 0.3, 2e-2, 6e-2);
}
static test_result test_llama_small_fp8_tensorwise(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/llama_small.bin", MT_BF16, fp8_tensorwise_e4m3, 0.1,
                                            2e-2, 0.3, 2e-2, 3e-2);
}

/* The switches under FP8, at the FP8 tolerances above: squared ReLU after the FP8 fc1 GEMM (the
 * kernel, where GELU takes the FP8 GEMM's epilogue) and its derivative after the FP8 input-gradient
 * GEMM (tensorwise, e4m3); the query and key norms on the FP8 QKV linear's bf16 output (delayed,
 * hybrid: 6e-2 on the weights, as above). */
static test_result test_gpt2_sqrelu_fp8_tensorwise(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/gpt2_sqrelu.bin", MT_BF16, fp8_tensorwise_e4m3, 0.1,
                                            2e-2, 0.3, 2e-2, 3e-2);
}
static test_result test_llama_qkln_fp8_delayed(void) {
    return check_against_reference_adjusted("dev/data/gpt_vectors/llama_qkln.bin", MT_BF16, fp8_delayed_hybrid, 0.1,
                                            2e-2, 0.3, 2e-2, 6e-2);
}

/* Every recipe (delayed, tensorwise, blockwise) against bf16 from the same initial weights and
 * batches, 20 steps, GPT-2 and Llama flavours (the blockwise recipe needs multiples of 128, which the
 * reference vectors' 64-token micro-batches are not): each step's loss within 2% of bf16's (the
 * format noise of the previous tests, through a model whose loss moves ~1.5% over these steps), the
 * loss falling. */
static test_result fp8_recipes_track_bf16(int llama) {
    REQUIRE_GPU();
    const int steps = 20;
    double losses[4][20];
    const char* names[4] = {"bf16", "delayed", "tensorwise", "blockwise"};
    for (int r = 0; r < 4; r++) {
        mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
        if (llama) c.ffn_hidden_size = 384; /* SwiGLU's [2f, h] then 768 wide: blockwise needs multiples of 128 */
        if (r > 0) {
            c.fp8_format = MT_FP8_HYBRID;
            c.fp8_recipe = (mt_fp8_recipe)(r - 1);
        }
        mt_error err;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        mt_trainer* t = NULL;
        EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
        int64_t per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
        int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
        mt_status st = MT_OK;
        for (int k = 0; k < steps && st == MT_OK; k++) {
            fill_tokens(tokens, per_step, (int)c.vocab_size, 500 + k);
            mt_step_result res;
            st = mt_trainer_train_step(t, tokens, &res, &err);
            losses[r][k] = res.lm_loss;
        }
        free(tokens);
        mt_trainer_free(t);
        EXPECT_OK(st, &err);
        printf("      %-10s loss %.5f -> %.5f\n", names[r], losses[r][0], losses[r][steps - 1]);
        EXPECT(losses[r][steps - 1] < losses[r][0], "%s: the loss did not fall", names[r]);
        for (int k = 0; r > 0 && k < steps; k++)
            EXPECT(fabs(losses[r][k] - losses[0][k]) <= 2e-2 * losses[0][k], "%s step %d: loss %.6f, bf16 %.6f",
                   names[r], k, losses[r][k], losses[0][k]);
    }
    return TEST_PASS; /* --fp8-param-gather: tests/test_fp8.h and tests/test_data_parallel.h */
}
static test_result test_fp8_recipes_track_bf16(void) { return fp8_recipes_track_bf16(0); }
static test_result test_fp8_recipes_track_bf16_llama(void) { return fp8_recipes_track_bf16(1); }

/* ---- initialisation, the gradient buffer never zeroed ---- */

/* Megatron's initialisation: normal(std) weights and embeddings, output projections std/sqrt(2L),
 * biases 0, norm weights 1; different seeds give different weights, the same seed the same. */
static test_result initialisation(int llama) {
    REQUIRE_GPU();
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    c.num_layers = 4;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    int64_t n = mt_param_layout(&c, info);
    float* p = (float*)malloc(sizeof(float) * n);
    float* q = (float*)malloc(sizeof(float) * n);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    mt_trainer_get_parameters(t, p, &err);
    mt_trainer_free(t);
    c.seed = 4321;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    mt_trainer_get_parameters(t, q, &err);
    mt_trainer_free(t);
    test_result res = TEST_PASS;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS && res == TEST_PASS; i++) {
        if (info[i].numel == 0) continue; /* not in this flavour */
        double sum = 0, sq = 0;
        for (int64_t j = 0; j < info[i].numel; j++) {
            sum += p[info[i].offset + j];
            sq += (double)p[info[i].offset + j] * p[info[i].offset + j];
        }
        double mean = sum / info[i].numel, std = sqrt(sq / info[i].numel - mean * mean);
        double want_std = info[i].init == 2 ? 0.02 : info[i].init == 3 ? 0.02 / sqrt(8.0) : 0.0;
        double want_mean = info[i].init == 1 ? 1.0 : 0.0;
        double tol = want_std > 0 ? 4 * want_std / sqrt((double)info[i].numel) + 0.02 * want_std : 0.0;
        if (fabs(mean - want_mean) > (want_std > 0 ? 4 * want_std / sqrt((double)info[i].numel) : 0) ||
            fabs(std - want_std) > tol) {
            printf("    FAIL %s: mean %.5f std %.5f, expected %.5f / %.5f\n", info[i].name, mean, std, want_mean, want_std);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && memcmp(p, q, sizeof(float) * info[MT_P_WORD_EMBEDDINGS].numel) == 0) {
        printf("    FAIL seeds 1234 and 4321 gave the same embeddings\n");
        res = TEST_FAIL;
    }
    free(p);
    free(q);
    return res;
}
static test_result test_initialisation(void) { return initialisation(0); }
static test_result test_initialisation_llama(void) { return initialisation(1); }

/* The gradient buffer is never zeroed: the first micro-batch of a step writes every gradient (weight
 * GEMMs with beta 0, column sums and embeddings overwriting) and later ones add. Poisoning every
 * tensor's gradient with NaN (0xFF bytes) after another batch's step must not change the gradients
 * of the next batch by a single bit (two micro-batches: the overwrite and the accumulation both
 * run). GPT-2 (tied embeddings, biases) and Llama (untied output, no biases) flavours. */
static test_result gradients_overwrite(int llama) {
    REQUIRE_GPU();
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int count = (int)(c.global_batch_size / c.micro_batch_size);
    EXPECT(count == 2, "the test wants two micro-batches, config gives %d", count);
    int64_t per_step = (int64_t)c.global_batch_size * (c.seq_length + 1), n = mt_num_parameters(&c);
    int32_t* batch_a = (int32_t*)malloc(sizeof(int32_t) * per_step);
    int32_t* batch_b = (int32_t*)malloc(sizeof(int32_t) * per_step);
    float* clean = (float*)malloc(sizeof(float) * n);
    float* after = (float*)malloc(sizeof(float) * n);
    fill_tokens(batch_a, per_step, (int)c.vocab_size, 11);
    fill_tokens(batch_b, per_step, (int)c.vocab_size, 12);
    test_result result = TEST_PASS;
    double loss_clean = 0.0, loss_after = 0.0;
    mt_trainer* t = NULL;
    mt_status st = mt_trainer_create(&t, &c, &err);
    if (st == MT_OK) st = mt_trainer_compute_gradients(t, batch_a, count, &loss_clean, &err);
    if (st == MT_OK) st = mt_trainer_get_gradients(t, clean, &err);
    /* another batch, then NaN in every tensor's gradient (not the alignment gaps between them,
     * which stay zero from creation on and which the global norm reads) */
    if (st == MT_OK) st = mt_trainer_compute_gradients(t, batch_b, count, &loss_after, &err);
    for (int k = 0; st == MT_OK && k < t->buffer.num_params; k++) {
        const mt_buffer_param* p = &t->buffer.params[k];
        if (cudaMemset(t->grads + p->offset, 0xFF, sizeof(float) * (size_t)p->numel) != cudaSuccess) st = MT_ERR_CUDA;
    }
    if (st == MT_OK) st = mt_trainer_compute_gradients(t, batch_a, count, &loss_after, &err);
    if (st == MT_OK) st = mt_trainer_get_gradients(t, after, &err);
    if (t) mt_trainer_free(t);
    if (st != MT_OK) {
        printf("    FAIL %s: %s\n", mt_status_name(st), err.message);
        result = TEST_FAIL;
    } else {
        int64_t differ = 0, first = -1;
        for (int64_t i = 0; i < n; i++)
            if (memcmp(&clean[i], &after[i], sizeof(float)) != 0) {
                if (first < 0) first = i;
                differ++;
            }
        printf("      loss %.7f / %.7f; %lld of %lld gradients differ after poisoning\n", loss_clean, loss_after,
               (long long)differ, (long long)n);
        if (differ || loss_clean != loss_after) {
            printf("    FAIL first differing gradient %lld: %g vs %g\n", (long long)first,
                   first >= 0 ? clean[first] : 0.0, first >= 0 ? after[first] : 0.0);
            result = TEST_FAIL;
        }
    }
    free(batch_a);
    free(batch_b);
    free(clean);
    free(after);
    return result;
}
static test_result test_gradients_overwrite(void) { return gradients_overwrite(0); }
static test_result test_gradients_overwrite_llama(void) { return gradients_overwrite(1); }

/* ---- --log-params-norm and --log-num-zeros-in-grad against the host ----
 * After every train step the reported params_norm must equal the L2 norm of the fp32 master weights
 * read back (mt_trainer_get_parameters, every parameter once), and num_zeros_in_grad the exact zeros
 * of the step's gradients read back (mt_trainer_get_gradients: AdamW leaves them as they were; the
 * step's scale g * clip / loss-scale makes no new zero at these magnitudes). The norm within 1e-9
 * relative: both sides sum squares in double, in other orders (~1e-16 per term), while a tensor
 * missing or counted twice moves it by 1e-3 or more here; the count exactly. The batches draw only
 * from the first half of the vocabulary, so in the Llama flavour (untied output layer) the word
 * embeddings' other rows and the padding get exactly zero gradient: the count must be at least
 * those rows' elements, and below the whole model. fp32 (the weights are their own master), bf16
 * (a separate master), and bf16 with half the optimizer shard offloaded to the CPU (its master on
 * the host). The offloaded run's gradients do not stay on the device after its step (the buffer
 * stages the host optimizer's results), so there the count of step 0, whose gradients are those of
 * the same weights and batch, must equal the bf16 run's, and later counts lie in the range above.
 * Without the flags both fields are -1. */
static test_result params_norm_zeros_case(mt_precision precision, int offload, int64_t* first_zeros) {
    mt_config c = test_config(TEST_LLAMA, precision);
    c.log_params_norm = 1;
    c.log_num_zeros_in_grad = 1;
    c.optimizer_cpu_offload = offload;
    c.optimizer_offload_fraction = 0.5;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int64_t n = mt_num_parameters(&c), per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    const int half = (int)(c.vocab_size / 2);
    const int64_t unused_rows = (c.padded_vocab_size - half) * (int64_t)c.hidden_size;
    float* p = (float*)malloc(sizeof(float) * (size_t)n);
    float* g = (float*)malloc(sizeof(float) * (size_t)n);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)per_step);
    mt_trainer* t = NULL;
    test_result res = TEST_PASS;
    if (mt_trainer_create(&t, &c, &err) != MT_OK) { printf("    FAIL create: %s\n", err.message); res = TEST_FAIL; }
    for (int k = 0; k < 3 && res == TEST_PASS; k++) {
        fill_tokens(tokens, per_step, half, 900 + k);
        mt_step_result r;
        if (mt_trainer_train_step(t, tokens, &r, &err) != MT_OK || mt_trainer_get_parameters(t, p, &err) != MT_OK ||
            mt_trainer_get_gradients(t, g, &err) != MT_OK) {
            printf("    FAIL step %d: %s\n", k, err.message);
            res = TEST_FAIL;
            break;
        }
        double sq = 0.0;
        int64_t zeros = 0;
        for (int64_t i = 0; i < n; i++) {
            sq += (double)p[i] * p[i];
            zeros += g[i] == 0.0f;
        }
        const double norm = sqrt(sq), rel = fabs(r.params_norm - norm) / norm;
        printf("      %s%s step %d: params norm %.9f (host %.9f, rel %.1e), num zeros %lld (host %lld; unused "
               "vocabulary rows %lld)\n", precision == MT_FP32 ? "fp32" : "bf16", offload ? " offload 0.5" : "", k,
               r.params_norm, norm, rel, (long long)r.num_zeros_in_grad, (long long)zeros, (long long)unused_rows);
        if (!(rel <= 1e-9)) { printf("    FAIL step %d: params norm %.12g, host %.12g\n", k, r.params_norm, norm); res = TEST_FAIL; }
        if (offload) zeros = k == 0 ? *first_zeros : r.num_zeros_in_grad; /* see above */
        if (!offload && k == 0) *first_zeros = zeros;
        if (r.num_zeros_in_grad != zeros || zeros < unused_rows || zeros >= n) {
            printf("    FAIL step %d: num zeros %lld, %s %lld (at least %lld, below %lld)\n", k,
                   (long long)r.num_zeros_in_grad, offload ? "the run without offload" : "host", (long long)zeros,
                   (long long)unused_rows, (long long)n);
            res = TEST_FAIL;
        }
    }
    if (t) mt_trainer_free(t);
    /* the fields without the flags */
    c.log_params_norm = c.log_num_zeros_in_grad = 0;
    t = NULL;
    if (res == TEST_PASS && mt_trainer_create(&t, &c, &err) == MT_OK) {
        mt_step_result r;
        fill_tokens(tokens, per_step, half, 900);
        if (mt_trainer_train_step(t, tokens, &r, &err) != MT_OK || r.params_norm != -1.0 || r.num_zeros_in_grad != -1) {
            printf("    FAIL without the flags: params norm %g, num zeros %lld (%s)\n", r.params_norm,
                   (long long)r.num_zeros_in_grad, err.message);
            res = TEST_FAIL;
        }
    }
    if (t) mt_trainer_free(t);
    free(p);
    free(g);
    free(tokens);
    return res;
}
static test_result test_params_norm_and_zeros(void) {
    REQUIRE_GPU();
    int64_t first_zeros = -1;
    if (params_norm_zeros_case(MT_FP32, 0, &first_zeros) != TEST_PASS) return TEST_FAIL;
    if (params_norm_zeros_case(MT_BF16, 0, &first_zeros) != TEST_PASS) return TEST_FAIL;
    return params_norm_zeros_case(MT_BF16, 1, &first_zeros);
}

static const test_case model_gpu_tests[] = {
    {"gpt2_tiny_fp32_matches_reference", test_gpt2_tiny_fp32},
    {"gpt2_small_fp32_matches_reference", test_gpt2_small_fp32},
    {"gpt2_tiny_bf16_matches_reference", test_gpt2_tiny_bf16},
    {"gpt2_small_bf16_matches_reference", test_gpt2_small_bf16},
    {"llama_tiny_fp32_matches_reference", test_llama_tiny_fp32},
    {"llama_small_fp32_matches_reference", test_llama_small_fp32},
    {"llama_tiny_bf16_matches_reference", test_llama_tiny_bf16},
    {"llama_small_bf16_matches_reference", test_llama_small_bf16},
    {"gpt2_squared_relu_fp32_matches_reference", test_gpt2_sqrelu_fp32},
    {"gpt2_squared_relu_bf16_matches_reference", test_gpt2_sqrelu_bf16},
    {"gpt2_qk_layernorm_fp32_matches_reference", test_gpt2_qkln_fp32},
    {"gpt2_qk_layernorm_bf16_matches_reference", test_gpt2_qkln_bf16},
    {"llama_qk_layernorm_fp32_matches_reference", test_llama_qkln_fp32},
    {"llama_qk_layernorm_bf16_matches_reference", test_llama_qkln_bf16},
    {"gpt2_small_fp8_delayed_hybrid_matches_reference", test_gpt2_small_fp8_delayed},
    {"gpt2_small_fp8_tensorwise_e4m3_matches_reference", test_gpt2_small_fp8_tensorwise},
    {"llama_small_fp8_delayed_hybrid_matches_reference", test_llama_small_fp8_delayed},
    {"llama_small_fp8_tensorwise_e4m3_matches_reference", test_llama_small_fp8_tensorwise},
    {"gpt2_squared_relu_fp8_tensorwise_e4m3_matches_reference", test_gpt2_sqrelu_fp8_tensorwise},
    {"llama_qk_layernorm_fp8_delayed_hybrid_matches_reference", test_llama_qkln_fp8_delayed},
    {"fp8_recipes_track_bf16", test_fp8_recipes_track_bf16},
    {"fp8_recipes_track_bf16_llama", test_fp8_recipes_track_bf16_llama},
    {"initialisation_llama", test_initialisation_llama},
    {"initialisation", test_initialisation},
    {"gradients_overwrite_no_zeroing", test_gradients_overwrite},
    {"gradients_overwrite_no_zeroing_llama", test_gradients_overwrite_llama},
    {"params_norm_and_num_zeros_match_the_host", test_params_norm_and_zeros},
};

#endif
