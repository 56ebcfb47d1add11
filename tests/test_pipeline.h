/* tests/test_pipeline.h — pipeline parallelism: the layer split, a stage's part of the model, the
 * engine's transfers, and training at PP > 1 against one stage.
 *
 * Host tests (everywhere):
 *   - the layer split (mt_pp_stage_of): even, interleaved (the spec's example: 16 layers, PP 4,
 *     VP 2, rank 0 holds layers 0-1 and 8-9), --decoder-first/last-pipeline-num-layers,
 *     --account-for-embedding/loss-in-pipeline-split, and the splits Megatron refuses;
 *   - a stage's buffer layout: over the PP ranks every canonical element of the model is held exactly
 *     once (the tied word embeddings twice: first and last stage), the stage's canonical numbering
 *     is dense, and mt_pp_stage_copy round-trips;
 *   - the engine's transfers (run_micro_batches posts the previous step's send and this step's
 *     receive as one NCCL group): a simulation where a group completes once each of its sends and
 *     receives meets its partner in the partner's current group (NCCL point-to-point rendezvous, in
 *     posting order per pair) finishes for every (PP <= 8, VP <= 4, M <= 16, group size) Megatron
 *     accepts, training and forward-only; and the activation slots the engine allocates equal the
 *     schedule's in-flight count (1 at PP = 1, min(PP - rank, M) for 1F1B);
 *   - mt_pp_tp_part_to_full: each PP x TP rank's part (its stage's tensors of its TP shard) lands on
 *     exactly its full-model elements, and all ranks' parts give the model back;
 *   - the refusals of what is not built: --decoder-first/last-pipeline-num-layers
 *     with virtual stages (checked by their key words).
 * Multi-GPU tests (mpirun -np 2 or 4), each layout against PP = 1 on the same data through the layout
 * comparison (tests/test_data_parallel.h: initial weights bitwise, the first step's gradients per
 * tensor and element, 20 steps' losses and grad norms, the final weights per tensor and element
 * against PP = 1's movement; the stages' tensors merged, TP shards gathered, every holder agreeing,
 * the tied embeddings' two copies included), plus the evaluation and per-token losses of the first
 * batch; GPT-2 (tied embeddings, biases) and Llama (untied), fp32 and bf16:
 *   - PP = world, PP = 2 x VP = 2 interleaved (x DP = 2 at 4 processes), and with 4 processes
 *     PP = 2 x TP = 2 with SP and PP = 2 x DP = 2 with the distributed optimizer; fp32 with dropout;
 *   - other splits: at 2 processes --decoder-first-pipeline-num-layers (1 | 3) and
 *     --account-for-embedding/loss-in-pipeline-split at PP = 2 x VP = 3 (empty first and last virtual
 *     stages); at 4, 8 layers, PP = 4 x VP = 2 and --decoder-first/last-pipeline-num-layers (1 3 3 1);
 *   - bitwise repeatable and save / resume bitwise at PP = 2, one mp_rank_<tp>_<pp> directory per rank. */
#ifndef MT_TEST_PIPELINE_H
#define MT_TEST_PIPELINE_H

/* ---- host ---- */

static test_result test_pp_layer_split(void) {
    mt_error err;
    mt_config c = test_config(TEST_GPT2, MT_FP32);
    mt_pp_stage st;
    /* the spec's example */
    c.num_layers = 16;
    c.pipeline_model_parallel_size = 4;
    c.virtual_pipeline_size = 2;
    EXPECT_OK(mt_pp_stage_of(&c, 0, &st, &err), &err);
    EXPECT(st.num_chunks == 2 && st.first_layer[0] == 0 && st.num_layers[0] == 2 && st.first_layer[1] == 8 &&
           st.num_layers[1] == 2 && st.embedding && !st.head, "PP 4 VP 2 rank 0: chunks at %d (+%d), %d (+%d)",
           st.first_layer[0], st.num_layers[0], st.first_layer[1], st.num_layers[1]);
    EXPECT_OK(mt_pp_stage_of(&c, 3, &st, &err), &err);
    EXPECT(st.first_layer[0] == 6 && st.first_layer[1] == 14 && st.head && !st.embedding, "PP 4 VP 2 rank 3");
    /* uneven: first 1, last 1, the middle two share 14 */
    c.virtual_pipeline_size = 1;
    c.decoder_first_pipeline_num_layers = 1;
    c.decoder_last_pipeline_num_layers = 1;
    int want_first[4] = {0, 1, 8, 15}, want_n[4] = {1, 7, 7, 1};
    for (int r = 0; r < 4; r++) {
        EXPECT_OK(mt_pp_stage_of(&c, r, &st, &err), &err);
        EXPECT(st.first_layer[0] == want_first[r] && st.num_layers[0] == want_n[r], "uneven rank %d: %d +%d", r,
               st.first_layer[0], st.num_layers[0]);
    }
    c.decoder_last_pipeline_num_layers = 2; /* 13 over two middle stages */
    EXPECT(mt_pp_stage_of(&c, 0, NULL, &err) == MT_ERR_CONFIG, "an uneven middle split was accepted");
    /* account for embedding and loss: 16 + 2 = 18 over 2 stages x 3 virtual = 3 each; first and last
     * virtual stage build 2 */
    c.decoder_first_pipeline_num_layers = c.decoder_last_pipeline_num_layers = -1;
    c.pipeline_model_parallel_size = 2;
    c.virtual_pipeline_size = 3;
    c.account_for_embedding_in_pipeline_split = c.account_for_loss_in_pipeline_split = 1;
    EXPECT_OK(mt_pp_stage_of(&c, 0, &st, &err), &err);
    EXPECT(st.num_layers[0] == 2 && st.first_layer[1] == 5 && st.num_layers[1] == 3, "account-for rank 0: %d, %d +%d",
           st.num_layers[0], st.first_layer[1], st.num_layers[1]);
    EXPECT_OK(mt_pp_stage_of(&c, 1, &st, &err), &err);
    EXPECT(st.first_layer[0] == 2 && st.num_layers[2] == 2 && st.first_layer[2] == 14, "account-for rank 1");
    c.num_layers = 15; /* 17 over 6 */
    EXPECT(mt_pp_stage_of(&c, 0, NULL, &err) == MT_ERR_CONFIG, "15 + 2 layers over 6 virtual stages was accepted");
    c.num_layers = 16;
    c.decoder_first_pipeline_num_layers = 2;
    EXPECT(mt_pp_stage_of(&c, 0, NULL, &err) == MT_ERR_CONFIG, "uneven with virtual stages and account-for accepted");
    /* hostile sizes: refused, no overflow (flags reach 2^31 - 1) */
    mt_config h = test_config(TEST_GPT2, MT_FP32);
    h.num_layers = 8;
    h.pipeline_model_parallel_size = 4;
    h.decoder_first_pipeline_num_layers = 2147483647;
    h.decoder_last_pipeline_num_layers = 2147483647;
    EXPECT(mt_pp_stage_of(&h, 0, NULL, &err) == MT_ERR_CONFIG, "first/last of 2^31 - 1 layers accepted");
    h.decoder_first_pipeline_num_layers = h.decoder_last_pipeline_num_layers = -1;
    h.pipeline_model_parallel_size = 2147483647;
    h.virtual_pipeline_size = 64;
    EXPECT(mt_pp_stage_of(&h, 0, NULL, &err) == MT_ERR_CONFIG, "2^31 - 1 stages x 64 virtual accepted");
    /* the flags through finalize */
    mt_config f = test_config(TEST_GPT2, MT_FP32);
    f.num_layers = 8;
    f.pipeline_model_parallel_size = 2;
    f.world_size = 2;
    f.num_layers_per_virtual_pipeline_stage = 2;
    test_config_batch(&f, 1, 4);
    EXPECT_OK(mt_config_finalize(&f, &err), &err);
    EXPECT(f.virtual_pipeline_size == 2, "--num-layers-per-virtual-pipeline-stage 2 at 8 layers PP 2: VP %d",
           f.virtual_pipeline_size);
    mt_config g = test_config(TEST_GPT2, MT_FP32);
    g.num_layers = 8;
    g.pipeline_model_parallel_size = 2;
    g.world_size = 2;
    g.virtual_pipeline_size = 2;
    test_config_batch(&g, 1, 3); /* M = 3: a last group of 1 < PP */
    g.microbatch_group_size_per_vp_stage = 2;
    EXPECT(mt_config_finalize(&g, &err) == MT_ERR_CONFIG, "an interleaved schedule with M %% group < PP was accepted");
    return TEST_PASS;
}

/* Every canonical element held once over the stages (the tied word embeddings on the first and the
 * last), dense stage numbering, and mt_pp_stage_copy round trips. moe: 4 experts in every other layer
 * (--moe-layer-freq 2, issue #34): the MoE tensors stacked over the MoE layers, the dense MLP's over the
 * others, so a stage's slice of one is not at layer x its size. */
static test_result pp_check_layout(int llama, int pp, int vp, int layers, int moe) {
    mt_error err;
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    c.num_layers = layers;
    if (moe) {
        c.num_experts = 4;
        c.moe_router_topk = 2;
        c.moe_ffn_hidden_size = 32;
        c.moe_layer_freq = 2;
        c.moe_shared_expert_intermediate_size = llama ? 32 : 0; /* GPT-2's biases: no shared expert (Megatron's) */
    }
    c.pipeline_model_parallel_size = pp;
    c.virtual_pipeline_size = vp;
    c.world_size = pp;
    test_config_batch(&c, 1, 2 * pp);
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    int64_t n = mt_param_layout(&c, info);
    int* held = (int*)calloc((size_t)n, sizeof(int));
    float* full = (float*)malloc(sizeof(float) * n);
    float* back = (float*)malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) full[i] = (float)i, back[i] = -1.0f;
    test_result res = TEST_PASS;
    int64_t total = 0;
    for (int r = 0; r < pp && res == TEST_PASS; r++) {
        mt_config cr = c;
        cr.rank = r; /* TP = DP = 1: rank = pipeline rank */
        mt_buffer_layout b;
        EXPECT_OK(mt_buffer_layout_build(&b, &cr, &err), &err);
        float* part = (float*)malloc(sizeof(float) * (size_t)b.canonical_size);
        mt_pp_stage_copy(&cr, &b.stage, full, part, 1);
        char* seen = (char*)calloc((size_t)b.canonical_size, 1);
        for (int k = 0; k < b.num_params; k++) {
            const mt_buffer_param* p = &b.params[k];
            int64_t row = 0; /* the slice's place in its tensor's stack: the layers before it that have it */
            for (int l = 0; mt_param_per_layer(p->tensor) && l < p->layer; l++) row += mt_param_layer_has(&c, p->tensor, l);
            int64_t at = info[p->tensor].offset + row * p->numel;
            for (int64_t i = 0; i < p->numel; i++) {
                held[at + i]++;
                seen[p->canonical + i]++;
                if (part[p->canonical + i] != (float)(at + i)) res = TEST_FAIL;
            }
        }
        for (int64_t i = 0; i < b.canonical_size; i++)
            if (seen[i] != 1) res = TEST_FAIL;
        if (res != TEST_PASS) printf("    FAIL PP %d VP %d%s rank %d: stage numbering or copy wrong\n", pp, vp, moe ? " MoE" : "", r);
        mt_pp_stage_copy(&cr, &b.stage, back, part, 0);
        total += b.canonical_size;
        free(part);
        free(seen);
        mt_buffer_layout_free(&b);
    }
    int tied = info[MT_P_OUTPUT_WEIGHT].numel == 0 && pp > 1;
    for (int64_t i = 0; i < n && res == TEST_PASS; i++) {
        int want = tied && i < info[MT_P_WORD_EMBEDDINGS].numel ? 2 : 1;
        if (held[i] != want || back[i] != full[i]) {
            printf("    FAIL PP %d VP %d %s%s: element %lld held %d times (want %d), copied back %g\n", pp, vp,
                   llama ? "Llama" : "GPT-2", moe ? " MoE" : "", (long long)i, held[i], want, back[i]);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && total != n + (tied ? info[MT_P_WORD_EMBEDDINGS].numel : 0)) res = TEST_FAIL;
    free(held);
    free(full);
    free(back);
    return res;
}

static test_result test_pp_stage_layout(void) {
    int cases[][3] = {{1, 1, 2}, {2, 1, 4}, {4, 1, 4}, {2, 2, 4}, {4, 2, 8}, {3, 1, 6}, {2, 3, 6}};
    for (int moe = 0; moe <= 1; moe++)
        for (int llama = 0; llama <= 1; llama++)
            for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++)
                if (pp_check_layout(llama, cases[k][0], cases[k][1], cases[k][2], moe) != TEST_PASS) return TEST_FAIL;
    return TEST_PASS;
}

/* The engine's posting order, simulated: rank r posts one group before each unit of its schedule
 * (pipeline_unit_end) holding the previous unit's sends and this unit's receives, and one after the
 * last. Activations and gradients travel on two communicators, and on each NCCL matches the
 * point-to-point operations between two ranks in posting order: the i-th activation (gradient) send
 * from a to b must be the message b's i-th activation (gradient) receive from a expects (micro-batch,
 * virtual stage), and the two complete together once both ranks have reached the groups holding
 * them. Returns 1 when every rank gets through every group. (One communicator for both does not
 * work: at PP 2 x VP 2 rank 0's gradient sends to rank 1 interleave with its activation sends in
 * another order than rank 1 posts the receives.) */
typedef struct { int peer, is_send, grad, mb, vstage, group, seq; } pp_p2p;
static int pp_engine_finishes(int pp, int vp, int m, int g, int train, char* why, size_t why_size) {
    mt_error err;
    int max_ops = 4 * (2 * m * vp + 1);
    pp_p2p* list[TPP_MAX_PP];
    int count[TPP_MAX_PP] = {0}, groups[TPP_MAX_PP] = {0}, pos[TPP_MAX_PP] = {0};
    int sent[TPP_MAX_PP][TPP_MAX_PP][2] = {{{0}}}, got[TPP_MAX_PP][TPP_MAX_PP][2] = {{{0}}};
    for (int r = 0; r < pp; r++) {
        int n = 0, warmup = 0;
        list[r] = (pp_p2p*)calloc((size_t)max_ops, sizeof(pp_p2p));
        mt_pp_op* ops = pipeline_steps(pp, vp, r, g, m, train, &n, &warmup, &err);
        if (!ops) { snprintf(why, why_size, "no schedule: %s", err.message); return 0; }
        pp_p2p sends[2];
        int num_sends = 0;
        for (int u = 0; u <= n;) {
            int end = u < n ? pipeline_unit_end(ops, n, warmup, vp, u) : n + 1, before = count[r];
            for (int i = 0; i < num_sends; i++) list[r][count[r]++] = sends[i];
            num_sends = 0;
            for (int k = u; k < end && k < n; k++) {
                const mt_pp_op* op = &ops[k];
                int fwd = op->kind == MT_PP_FORWARD, v = op->chunk * pp + r;
                if (op->recv_rank >= 0) {
                    pp_p2p rv = {op->recv_rank, 0, !fwd, op->micro_batch, v, 0, 0};
                    list[r][count[r]++] = rv;
                }
            }
            for (int k = u; k < end && k < n; k++) {
                const mt_pp_op* op = &ops[k];
                int fwd = op->kind == MT_PP_FORWARD, v = op->chunk * pp + r;
                if (op->send_rank >= 0) {
                    pp_p2p sd = {op->send_rank, 1, !fwd, op->micro_batch, fwd ? v + 1 : v - 1, 0, 0};
                    sends[num_sends++] = sd;
                }
            }
            for (int i = before; i < count[r]; i++) {
                list[r][i].group = groups[r];
                pp_p2p* o = &list[r][i];
                o->seq = o->is_send ? sent[r][o->peer][o->grad]++ : got[r][o->peer][o->grad]++;
            }
            if (count[r] > before) groups[r]++;
            u = end;
        }
        free(ops);
    }
    int ok = 1;
    /* static: the i-th message each way is the one expected */
    for (int r = 0; r < pp && ok; r++)
        for (int i = 0; i < count[r] && ok; i++) {
            pp_p2p* o = &list[r][i];
            if (!o->is_send) continue;
            int q = o->peer, found = 0;
            for (int j = 0; j < count[q] && !found; j++) {
                pp_p2p* p = &list[q][j];
                if (p->is_send || p->peer != r || p->grad != o->grad || p->seq != o->seq) continue;
                found = 1;
                if (p->grad != o->grad || p->mb != o->mb || p->vstage != o->vstage) {
                    snprintf(why, why_size, "rank %d's send #%d (%s, micro-batch %d) meets rank %d's receive of %s, "
                             "micro-batch %d", r, o->seq, o->grad ? "gradient" : "activation", o->mb, q,
                             p->grad ? "gradient" : "activation", p->mb);
                    ok = 0;
                }
            }
            if (!found) { snprintf(why, why_size, "rank %d's send #%d to %d is never received", r, o->seq, q); ok = 0; }
        }
    /* dynamic: a group completes when each of its operations' partners sits in the partner's current group */
    int finished = 0;
    for (int progress = 1; ok && progress;) {
        progress = 0;
        finished = 1;
        for (int r = 0; r < pp; r++) {
            if (pos[r] >= groups[r]) continue;
            finished = 0;
            int all = 1;
            for (int i = 0; i < count[r] && all; i++) {
                pp_p2p* o = &list[r][i];
                if (o->group != pos[r]) continue;
                int q = o->peer, met = 0;
                for (int j = 0; j < count[q] && !met; j++) {
                    pp_p2p* p = &list[q][j];
                    met = p->peer == r && p->is_send != o->is_send && p->grad == o->grad && p->seq == o->seq &&
                          p->group <= pos[q];
                }
                all &= met;
            }
            if (all) pos[r]++, progress = 1;
        }
    }
    if (ok && !finished) {
        snprintf(why, why_size, "deadlock: rank 0 at group %d of %d", pos[0], groups[0]);
        ok = 0;
    }
    for (int r = 0; r < pp; r++) free(list[r]);
    return ok && finished;
}

static test_result test_pp_engine_transfers(void) {
    char why[640];
    int checked = 0, stuck = 0;
    for (int pp = 1; pp <= TPP_MAX_PP; pp++)
        for (int vp = 1; vp <= TPP_MAX_VP; vp++)
            for (int m = 1; m <= 16; m++) {
                int sizes[3] = {pp, pp + 1, m};
                for (int gi = 0; gi < (vp > 1 ? 3 : 1); gi++) {
                    int g = sizes[gi];
                    mt_error err;
                    if (mt_pp_schedule_check(pp, vp, m, g, &err) != MT_OK) continue;
                    for (int train = 0; train <= 1; train++) {
                        int finishes = pp_engine_finishes(pp, vp, m, g, train, why, sizeof(why));
                        /* a group larger than PP leaves sends waiting for receives posted several units
                         * later: Megatron relies on NCCL buffering them; this build refuses it */
                        if (vp > 1 && g > pp && train) { stuck += !finishes; continue; }
                        if (!finishes) {
                            printf("    FAIL PP %d VP %d M %d group %d %s: %s\n", pp, vp, m, g,
                                   train ? "training" : "forward-only", why);
                            return TEST_FAIL;
                        }
                        checked++;
                    }
                    /* activation slots: the in-flight pairs of the training schedule */
                    for (int r = 0; r < pp; r++) {
                        int n = 0, warmup = 0;
                        mt_pp_op* ops = pipeline_steps(pp, vp, r, g, m, 1, &n, &warmup, &err);
                        int slots = mt_pp_slots_needed(ops, n), planned = 0;
                        free(ops);
                        int want = vp == 1 ? (pp - r < m ? pp - r : m) : slots;
                        EXPECT(slots == want && slots >= 1 && slots <= m * vp, "PP %d M %d rank %d: %d slots, want %d",
                               pp, m, r, slots, want);
                        /* the memory plan's count (megatron.h) is the engine's */
                        EXPECT(mt_pp_activation_slots(pp, vp, m, g, r, &planned, &err) == MT_OK && planned == slots,
                               "PP %d VP %d M %d rank %d: the plan counts %d slots, the schedule %d", pp, vp, m, r,
                               planned, slots);
                    }
                }
            }
    EXPECT(stuck > 0, "no setting with a group larger than PP waits on an unbuffered send: the refusal is needless");
    mt_config c = test_config(TEST_GPT2, MT_FP32);
    c.num_layers = 8;
    c.pipeline_model_parallel_size = 2;
    c.virtual_pipeline_size = 2;
    c.world_size = 2;
    test_config_batch(&c, 1, 4);
    c.microbatch_group_size_per_vp_stage = 3;
    mt_error err;
    EXPECT(mt_config_finalize(&c, &err) == MT_ERR_CONFIG && strstr(err.message, "group"),
           "a micro-batch group larger than PP was accepted");
    printf("      %d (PP, VP, M, group = PP, training / forward-only) settings finish; %d with a larger group would "
           "wait on unbuffered sends (refused)\n", checked, stuck);
    return TEST_PASS;
}

/* PP x TP: what each rank (pp, tp) holds, its stage's tensors of its TP shard, put back into a full
 * canonical array by mt_pp_tp_part_to_full (mt_trainer_get_parameters/_gradients at PP x TP): one
 * rank's call writes exactly its elements (full element = canonical index, so each must land on its
 * own index) and leaves the rest alone; all ranks together give the full model back bitwise. */
static test_result pp_check_tp_parts(int llama, int pp, int vp, int tp) {
    mt_error err;
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    c.num_layers = 4;
    c.pipeline_model_parallel_size = pp;
    c.virtual_pipeline_size = vp;
    c.tensor_model_parallel_size = tp;
    c.world_size = pp * tp;
    test_config_batch(&c, 1, 2 * pp);
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    const int64_t n = mt_num_parameters(&c), shard = mt_param_layout_shard(&c, NULL);
    float* full = (float*)malloc(sizeof(float) * n);
    float* back = (float*)malloc(sizeof(float) * n);
    float* one = (float*)malloc(sizeof(float) * n);
    float* scratch = (float*)malloc(sizeof(float) * shard);
    for (int64_t i = 0; i < n; i++) full[i] = (float)i, back[i] = -1.0f;
    test_result res = TEST_PASS;
    for (int r = 0; r < pp * tp && res == TEST_PASS; r++) {
        mt_config cr = c;
        cr.rank = r;
        const mt_rank_coords at = mt_rank_coordinates(&cr, r);
        mt_buffer_layout b;
        EXPECT_OK(mt_buffer_layout_build(&b, &cr, &err), &err);
        float* part = (float*)malloc(sizeof(float) * (size_t)b.canonical_size);
        mt_tp_shard_copy(&cr, at.tp, full, scratch, 1);
        mt_pp_stage_copy(&cr, &b.stage, scratch, part, 1);
        for (int64_t i = 0; i < n; i++) one[i] = -1.0f;
        mt_pp_tp_part_to_full(&cr, &b.stage, at.tp, part, one, scratch);
        mt_pp_tp_part_to_full(&cr, &b.stage, at.tp, part, back, scratch);
        int64_t written = 0;
        for (int64_t i = 0; i < n; i++) {
            if (one[i] == -1.0f) continue;
            written++;
            if (one[i] != full[i]) {
                printf("    FAIL %s PP %d VP %d TP %d rank %d: full element %lld got %.0f\n", llama ? "Llama" : "GPT-2",
                       pp, vp, tp, r, (long long)i, one[i]);
                res = TEST_FAIL;
                break;
            }
        }
        if (res == TEST_PASS && written != b.canonical_size) {
            printf("    FAIL %s PP %d VP %d TP %d rank %d: %lld elements written, the rank holds %lld\n",
                   llama ? "Llama" : "GPT-2", pp, vp, tp, r, (long long)written, (long long)b.canonical_size);
            res = TEST_FAIL;
        }
        free(part);
        mt_buffer_layout_free(&b);
    }
    if (res == TEST_PASS && memcmp(full, back, sizeof(float) * n)) {
        printf("    FAIL %s PP %d VP %d TP %d: the ranks' parts do not give the full model back\n", llama ? "Llama" : "GPT-2",
               pp, vp, tp);
        res = TEST_FAIL;
    }
    free(full);
    free(back);
    free(one);
    free(scratch);
    return res;
}
static test_result test_pp_tp_parts(void) {
    const int cases[][3] = {{2, 1, 2}, {2, 2, 2}, {4, 1, 2}, {1, 1, 2}}; /* PP, VP, TP */
    for (int llama = 0; llama <= 1; llama++)
        for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++)
            if (pp_check_tp_parts(llama, cases[k][0], cases[k][1], cases[k][2]) != TEST_PASS) return TEST_FAIL;
    return TEST_PASS;
}

/* 1 if `text` holds `word` in any case. */
static int pp_names(const char* text, const char* word) {
    for (const char* at = text; *at; at++) {
        size_t i = 0;
        while (word[i] && at[i] && tolower((unsigned char)at[i]) == tolower((unsigned char)word[i])) i++;
        if (!word[i]) return 1;
    }
    return 0;
}

/* c refused as not built, with one line holding `words` (any case): by mt_config_finalize, or else by
 * the trainer's creation, whose checks of the config come before it touches a device (local_rank -1:
 * no device is chosen). */
static test_result pp_expect_refused(mt_config c, const char* what, const char* const* words, int num_words) {
    mt_error err;
    memset(&err, 0, sizeof(err));
    mt_status st = mt_config_finalize(&c, &err);
    if (st == MT_OK) {
        c.local_rank = -1;
        mt_trainer* t = NULL;
        st = mt_trainer_create(&t, &c, &err);
        mt_trainer_free(t);
        EXPECT(st != MT_OK, "%s: accepted", what);
    }
    EXPECT(st == MT_ERR_CONFIG, "%s: refused as %s, not as a configuration: %s", what, mt_status_name(st), err.message);
    for (int i = 0; i < num_words; i++)
        EXPECT(pp_names(err.message, words[i]), "%s: the refusal does not say '%s': %s", what, words[i], err.message);
    printf("      %s: %s\n", what, err.message);
    return TEST_PASS;
}

/* The pipeline refusals of what is not built: --decoder-first/last-pipeline-num-layers with virtual
 * stages (VP given directly or through --num-layers-per-virtual-pipeline-stage). Each config without
 * its one conflicting setting finalizes, so each refusal is the combination's. FP8 at PP = 2 (every
 * recipe) is built and finalizes. */
static test_result test_pp_refusals(void) {
    mt_error err;
    static const char* const split_words[] = {"decoder", "virtual"};
    for (int recipe = 0; recipe < 3; recipe++) {
        mt_config c = test_config(TEST_GPT2, MT_BF16); /* 2 layers */
        c.pipeline_model_parallel_size = 2;
        c.world_size = 2;
        c.fp8_format = recipe == 1 ? MT_FP8_E4M3 : MT_FP8_HYBRID;
        c.fp8_recipe = recipe == 0 ? MT_FP8_DELAYED : recipe == 1 ? MT_FP8_TENSORWISE : MT_FP8_BLOCKWISE;
        if (recipe == 2) c.hidden_size = 128, c.ffn_hidden_size = 512, c.micro_batch_size = 2;
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
    }
    for (int k = 0; k < 3; k++) {
        mt_config c = test_config(TEST_GPT2, MT_FP32);
        c.num_layers = 8;
        c.pipeline_model_parallel_size = 2;
        c.world_size = 2;
        test_config_batch(&c, 1, 4);
        mt_config even = c, uneven = c;
        if (k < 2) c.decoder_first_pipeline_num_layers = uneven.decoder_first_pipeline_num_layers = 3;
        else c.decoder_last_pipeline_num_layers = uneven.decoder_last_pipeline_num_layers = 3;
        if (k == 1) c.num_layers_per_virtual_pipeline_stage = even.num_layers_per_virtual_pipeline_stage = 2;
        else c.virtual_pipeline_size = even.virtual_pipeline_size = 2;
        EXPECT_OK(mt_config_finalize(&even, &err), &err);
        EXPECT(even.virtual_pipeline_size == 2, "the even split has VP %d", even.virtual_pipeline_size);
        EXPECT_OK(mt_config_finalize(&uneven, &err), &err);
        static const char* what[3] = {"--decoder-first-pipeline-num-layers 3 at PP=2 x VP=2",
                                      "--decoder-first-pipeline-num-layers 3 with --num-layers-per-virtual-pipeline-stage 2",
                                      "--decoder-last-pipeline-num-layers 3 at PP=2 x VP=2"};
        if (pp_expect_refused(c, what[k], split_words, 2) != TEST_PASS) return TEST_FAIL;
    }
    return TEST_PASS;
}

static const test_case pipeline_tests[] = {
    {"pp_layer_split", test_pp_layer_split},
    {"pp_stage_holds_each_element_once", test_pp_stage_layout},
    {"pp_engine_transfers_finish", test_pp_engine_transfers},
    {"pp_tp_parts_give_the_full_model", test_pp_tp_parts},
    {"pp_refuses_interleaved_uneven_splits_builds_fp8", test_pp_refusals},
};

/* ---- multi-GPU ---- */

/* The PP tests' model: 4 layers (the splits tests: 8 at 4 processes), hidden 256, 4 heads (Llama: 8 in
 * 4 groups), seq 64, micro-batch 2 of a global batch 16 (8 micro-batches at DP 1). */
static mt_config pp_config(mt_precision precision, int pp, int vp, int tp, int dp, int llama) {
    mt_config c = tp_config(precision, tp, dp, tp > 1, llama);
    c.num_layers = 4;
    c.pipeline_model_parallel_size = pp;
    c.virtual_pipeline_size = vp;
    c.world_size = tp * dp * pp;
    test_config_this_rank(&c);
    return c;
}

/* Each rank's part of a full canonical array (its stage's tensors; TP = 1) merged over the world:
 * element = mean of the ranks that hold it (the tied word embeddings: the first and last stage,
 * which must hold the same bits; *copies_equal says whether they do). */
static void pp_merge(const mt_config* c, float* values, int64_t n, int* copies_equal) {
    mt_config f = *c;
    mt_error err;
    mt_config_finalize(&f, &err);
    mt_buffer_layout b;
    *copies_equal = 1;
    if (mt_buffer_layout_build(&b, &f, &err) != MT_OK) { *copies_equal = 0; return; }
    float* part = (float*)malloc(sizeof(float) * (size_t)b.canonical_size);
    float* mask = (float*)calloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < b.canonical_size; i++) part[i] = 1.0f;
    mt_pp_stage_copy(&f, &b.stage, mask, part, 0);
    for (int64_t i = 0; i < n; i++) values[i] *= mask[i];
#ifdef MT_USE_MPI
    float* hi = (float*)malloc(sizeof(float) * n);
    float* lo = (float*)malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) lo[i] = mask[i] ? values[i] : INFINITY, hi[i] = mask[i] ? values[i] : -INFINITY;
    MPI_Allreduce(MPI_IN_PLACE, values, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, mask, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, lo, (int)n, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, hi, (int)n, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&lo[i], &hi[i], sizeof(float))) *copies_equal = 0;
        values[i] = lo[i]; /* every holder has the same bits (checked) */
    }
    free(hi);
    free(lo);
#endif
    free(part);
    free(mask);
    mt_buffer_layout_free(&b);
}

/* The PP tests' probe (tests/test_data_parallel.h's layout comparison): before the first step, an
 * evaluation of the step's micro-batches (forward only: every stage runs all of them before the last
 * has any back, so each slot is reused at once) and the per-token losses of the global batch's first
 * micro-batch (the last stage's, shared with every rank; the global batch's, not this DP rank's
 * slice, so they are the same on all ranks and comparable with PP = 1's). */
typedef struct {
    double eval;
    float* token_losses;
} pp_probe_out;
static test_result pp_probe(mt_trainer* t, const mt_config* c, const int32_t* global, const int32_t* mine, void* out) {
    pp_probe_out* o = (pp_probe_out*)out;
    mt_error err;
    mt_status st = mt_trainer_evaluate(t, mine, mt_num_micro_batches(c), &o->eval, &err);
    if (st == MT_OK) st = mt_trainer_token_losses(t, global, o->token_losses, &err);
    if (st != MT_OK) printf("    FAIL evaluation: %s\n", err.message);
    return st == MT_OK ? TEST_PASS : TEST_FAIL;
}

#define REQUIRE_PP_WORLD()                                                                                      \
    do {                                                                                                        \
        if (mpi_world() != 2 && mpi_world() != 4) SKIP("the PP tests run under mpirun -np 2 or -np 4, not %d", mpi_world()); \
    } while (0)

/* One PP = 1 model (a config of pp_config's at PP = TP = DP = 1) against layouts of it: the layout
 * comparison, and the probe's evaluation and per-token losses within the loss bound (per position,
 * relative to max(|loss|, 1)), the same on every rank. */
typedef struct {
    layout_reference ref;
    pp_probe_out probe;
    int64_t positions;
    layout_tolerance tol;
} pp_reference;
static test_result pp_reference_train(pp_reference* r, mt_config one_gpu) {
    r->positions = (int64_t)one_gpu.micro_batch_size * one_gpu.seq_length;
    r->probe.token_losses = (float*)calloc((size_t)r->positions, sizeof(float));
    r->tol = layout_tolerance_of(one_gpu.precision);
    return layout_reference_train(&r->ref, one_gpu, 20, pp_probe, &r->probe);
}
static void pp_reference_free(pp_reference* r) {
    layout_reference_free(&r->ref);
    free(r->probe.token_losses);
}
static test_result pp_against_reference(const char* name, mt_config c, const pp_reference* r) {
    pp_probe_out p = {0, (float*)calloc((size_t)r->positions, sizeof(float))};
    test_result res = layout_check(name, c, &r->ref, &r->tol, pp_probe, &p);
    if (res == TEST_PASS) {
        double de = fabs(p.eval - r->probe.eval) / fabs(r->probe.eval), dt = 0;
        for (int64_t i = 0; i < r->positions; i++) {
            double d = fabs((double)p.token_losses[i] - r->probe.token_losses[i]) / fmax(fabs((double)r->probe.token_losses[i]), 1.0);
            if (!(d <= dt)) dt = d;
        }
        if (!tp_same_on_all_ranks(&p.eval, sizeof(p.eval)) ||
            !tp_same_on_all_ranks(p.token_losses, sizeof(float) * (size_t)r->positions)) {
            printf("    FAIL %s: ranks report different evaluation or per-token losses\n", name);
            res = TEST_FAIL;
        }
        printf("      %s: evaluation %.2e, per-token losses %.2e\n", name, de, dt);
        if (!(de <= r->tol.loss) || !(dt <= r->tol.loss)) {
            printf("    FAIL %s: evaluation or per-token losses differ from PP=1's\n", name);
            res = TEST_FAIL;
        }
    }
    free(p.token_losses);
    return tp_agree(res);
}

/* Every layout of the world size against PP = 1, both flavours: PP = world, PP = 2 x VP = 2
 * interleaved (x DP = 2 at 4 processes, all-reduced gradients), and with 4 processes PP = 2 x TP = 2
 * with SP and PP = 2 x DP = 2 with the distributed optimizer (overlapped). Tolerances: the layout
 * comparison's (tests/test_data_parallel.h); PP at TP = 1 runs the same arithmetic as PP = 1 but for
 * the last layer's fc2 bias gradient of a stage that is not the last (summed by a column-sum kernel
 * on the receiving stage instead of inside the final norm's backward: another order) and the tied
 * embedding's gradient (its two halves added by NCCL). */
static test_result pp_matches_single(mt_precision precision) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    int world = mpi_world();
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        const char* fl = llama ? "Llama" : "GPT-2";
        const char* pr = precision == MT_FP32 ? "fp32" : "bf16";
        pp_reference ref;
        res = pp_reference_train(&ref, pp_config(precision, 1, 1, 1, 1, llama));
        char name[128];
        snprintf(name, sizeof(name), "%s %s PP=%d", fl, pr, world);
        if (res == TEST_PASS) res = pp_against_reference(name, pp_config(precision, world, 1, 1, 1, llama), &ref);
        if (res == TEST_PASS) { /* at 4 GPUs beside DP = 2 (all-reduced gradients, no distributed optimizer) */
            snprintf(name, sizeof(name), "%s %s PP=2 x VP=2 interleaved%s", fl, pr, world == 4 ? " x DP=2" : "");
            res = pp_against_reference(name, pp_config(precision, 2, 2, 1, world / 2, llama), &ref);
        }
        if (res == TEST_PASS && world == 4) { /* a stage that is not the last reduces its fc2 bias over TP */
            snprintf(name, sizeof(name), "%s %s PP=2 x TP=2 SP", fl, pr);
            res = pp_against_reference(name, pp_config(precision, 2, 1, 2, 1, llama), &ref);
        }
        if (res == TEST_PASS && world == 4) {
            mt_config c = pp_config(precision, 2, 1, 1, 2, llama);
            test_config_ddp(&c, 1, 1, 1, 20000);
            snprintf(name, sizeof(name), "%s %s PP=2 x DP=2 distributed optimizer", fl, pr);
            res = pp_against_reference(name, c, &ref);
        }
        pp_reference_free(&ref);
    }
    return res;
}
static test_result test_pp_matches_single_fp32(void) { return pp_matches_single(MT_FP32); }
/* With dropout (tests/test_dropout.h) the masks are keyed by the global layer number, so every stage
 * draws PP=1's masks for its layers (and the first stage the embeddings'). */
static test_result test_pp_matches_single_dropout_fp32(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        mt_config one = pp_config(MT_FP32, 1, 1, 1, 1, llama), c = pp_config(MT_FP32, mpi_world(), 1, 1, 1, llama);
        one.hidden_dropout = one.attention_dropout = c.hidden_dropout = c.attention_dropout = 0.1;
        char name[96];
        snprintf(name, sizeof(name), "%s fp32 PP=%d, dropout 0.1", llama ? "Llama" : "GPT-2", mpi_world());
        pp_reference ref;
        res = pp_reference_train(&ref, one);
        if (res == TEST_PASS) res = pp_against_reference(name, c, &ref);
        pp_reference_free(&ref);
    }
    return res;
}
static test_result test_pp_matches_single_bf16(void) { return pp_matches_single(MT_BF16); }

/* FP8 linears at PP = world (and PP = 2 x VP = 2: a rank's layers in two chunks, each chunk's first
 * forward after a step casting its own layers' weights) against FP8 at PP = 1, GPT-2, each recipe.
 * Each stage holds its own layers' scaling slots; delayed scaling reduces the amaxes over the
 * stage's TP x DP ranks (here none: each stage's own). At TP = 1 a stage computes PP = 1's
 * arithmetic (the layout comparison's bf16 notes), the casts included: the same amaxes (a maximum in
 * any order), so the same scales and the same FP8 bytes; the bf16 bounds hold. */
static test_result test_pp_matches_single_fp8(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    const int world = mpi_world();
    test_result res = TEST_PASS;
    const char* recipes[3] = {"delayed", "tensorwise", "blockwise"};
    for (int r = 0; r < 3 && res == TEST_PASS; r++) {
        mt_config one = pp_config(MT_BF16, 1, 1, 1, 1, 0);
        one.fp8_format = r == 1 ? MT_FP8_E4M3 : MT_FP8_HYBRID;
        one.fp8_recipe = r == 0 ? MT_FP8_DELAYED : r == 1 ? MT_FP8_TENSORWISE : MT_FP8_BLOCKWISE;
        pp_reference ref;
        res = pp_reference_train(&ref, one);
        mt_config layouts[2] = {pp_config(MT_BF16, world, 1, 1, 1, 0), pp_config(MT_BF16, 2, 2, 1, world / 2, 0)};
        for (int k = 0; k < 2 && res == TEST_PASS; k++) {
            layouts[k].fp8_format = one.fp8_format;
            layouts[k].fp8_recipe = one.fp8_recipe;
            char name[128];
            if (k == 0) snprintf(name, sizeof(name), "GPT-2 FP8 %s PP=%d", recipes[r], world);
            else snprintf(name, sizeof(name), "GPT-2 FP8 %s PP=2 x VP=2 interleaved%s", recipes[r], world == 4 ? " x DP=2" : "");
            res = pp_against_reference(name, layouts[k], &ref);
        }
        pp_reference_free(&ref);
    }
    return res;
}

/* Layer splits other than the even one, against PP = 1, both flavours. 2 processes, the PP tests'
 * 4 layers: --decoder-first-pipeline-num-layers 1 (stages of 1 and 3 layers), and
 * --account-for-embedding-in-pipeline-split with --account-for-loss-in-pipeline-split at PP = 2 x
 * VP = 3 (4 + 2 over 6 virtual stages: the first holds the embeddings alone, the last the head alone,
 * rank 0 layers 1 and 3, rank 1 layers 0 and 2). 4 processes, 8 layers: PP = 4 x VP = 2 interleaved
 * (one layer per virtual stage) and --decoder-first/last-pipeline-num-layers 1 (1, 3, 3, 1). */
static test_result pp_splits_match_single(mt_precision precision) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    const int world = mpi_world(), layers = world == 4 ? 8 : 4;
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        const char* fl = llama ? "Llama" : "GPT-2";
        const char* pr = precision == MT_FP32 ? "fp32" : "bf16";
        mt_config one = pp_config(precision, 1, 1, 1, 1, llama);
        one.num_layers = layers;
        pp_reference ref;
        res = pp_reference_train(&ref, one);
        mt_config split[2];
        char names[2][128];
        if (world == 2) {
            split[0] = pp_config(precision, 2, 1, 1, 1, llama);
            split[0].decoder_first_pipeline_num_layers = 1;
            snprintf(names[0], sizeof(names[0]), "%s %s PP=2, --decoder-first-pipeline-num-layers 1 (1 | 3)", fl, pr);
            split[1] = pp_config(precision, 2, 3, 1, 1, llama);
            split[1].account_for_embedding_in_pipeline_split = split[1].account_for_loss_in_pipeline_split = 1;
            snprintf(names[1], sizeof(names[1]), "%s %s PP=2 x VP=3, --account-for-embedding/loss-in-pipeline-split "
                     "(0 1 1 | 1 1 0)", fl, pr);
        } else {
            split[0] = pp_config(precision, 4, 2, 1, 1, llama);
            snprintf(names[0], sizeof(names[0]), "%s %s PP=4 x VP=2 interleaved, 8 layers", fl, pr);
            split[1] = pp_config(precision, 4, 1, 1, 1, llama);
            split[1].decoder_first_pipeline_num_layers = split[1].decoder_last_pipeline_num_layers = 1;
            snprintf(names[1], sizeof(names[1]), "%s %s PP=4, --decoder-first/last-pipeline-num-layers 1 (1 3 3 1)", fl, pr);
        }
        for (int k = 0; k < 2 && res == TEST_PASS; k++) {
            split[k].num_layers = layers;
            res = pp_against_reference(names[k], split[k], &ref);
        }
        pp_reference_free(&ref);
    }
    return res;
}
static test_result test_pp_splits_match_single_fp32(void) { return pp_splits_match_single(MT_FP32); }
static test_result test_pp_splits_match_single_bf16(void) { return pp_splits_match_single(MT_BF16); }

/* Every pipeline layout of the world size, both flavours, bf16: two runs bitwise equal, and 10 +
 * save + load + 10 bitwise equal to 20 straight; every mp_rank_<tp>_<pp> model file written. 2
 * processes: PP = 2, PP = 2 x VP = 2; 4: PP = 2 x DP = 2 (distributed optimizer), PP = 4,
 * PP = 2 x VP = 2 x DP = 2 (distributed optimizer), PP = 2 x TP = 2 with SP. */
typedef struct {
    int pp, vp, tp, distributed;
} pp_layout;
static test_result test_pp_repeat_resume(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    int world = mpi_world(), tag = (int)getpid();
#ifdef MT_USE_MPI
    MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    static const pp_layout two[] = {{2, 1, 1, 0}, {2, 2, 1, 0}};
    static const pp_layout four[] = {{2, 1, 1, 1}, {4, 1, 1, 0}, {2, 2, 1, 1}, {2, 1, 2, 0}};
    const pp_layout* layouts = world == 4 ? four : two;
    const int num_layouts = world == 4 ? 4 : 2;
    test_result res = TEST_PASS;
    for (int i = 0; i < num_layouts && res == TEST_PASS; i++) {
        const pp_layout* L = &layouts[i];
        const int dp = world / (L->pp * L->tp);
        for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
            mt_config c = pp_config(MT_BF16, L->pp, L->vp, L->tp, dp, llama);
            if (L->distributed) test_config_ddp(&c, 1, 1, 1, 20000);
            char name[128];
            snprintf(name, sizeof(name), "%s PP=%d%s%s%s%s", llama ? "Llama" : "GPT-2", L->pp, L->vp > 1 ? " x VP=2" : "",
                     L->tp > 1 ? " x TP=2 SP" : "", dp > 1 ? " x DP=2" : "", L->distributed ? " distributed optimizer" : "");
            double a[20], b[20], r[20];
            char dir[256];
            snprintf(dir, sizeof(dir), "/tmp/mt_test_pp_ckpt_%d_%d_%d", tag, i, llama);
            res = tp_agree(dp_run(c, NULL, NULL, 0, 20, a, NULL));
            if (res == TEST_PASS) res = tp_agree(dp_run(c, NULL, NULL, 0, 20, b, NULL));
            if (res == TEST_PASS) res = tp_agree(dp_run(c, NULL, dir, 0, 10, r, NULL));
            if (res == TEST_PASS) res = tp_agree(dp_run(c, dir, NULL, 10, 10, r, NULL));
            for (int k = 0; k < 20 && res == TEST_PASS; k++) {
                if (memcmp(&a[k], &b[k], sizeof(double))) { printf("    FAIL %s step %d: runs differ %.9g vs %.9g\n", name, k, a[k], b[k]); res = TEST_FAIL; }
                else if (memcmp(&a[k], &r[k], sizeof(double))) { printf("    FAIL %s step %d: resumed %.9g vs %.9g\n", name, k, r[k], a[k]); res = TEST_FAIL; }
            }
#ifdef MT_USE_MPI
            MPI_Barrier(MPI_COMM_WORLD);
#endif
            for (int m = 0; m < L->tp * L->pp && res == TEST_PASS; m++) {
                char path[512];
                snprintf(path, sizeof(path), "%s/iter_0000010/mp_rank_%02d_%03d/model_optim_rng.bin", dir, m % L->tp, m / L->tp);
                if (access(path, R_OK) != 0) { printf("    FAIL missing %s\n", path); res = TEST_FAIL; }
            }
            if (res == TEST_PASS)
                printf("      %s: losses %.6f -> %.6f, bitwise equal across runs and across save/load\n", name, a[0], a[19]);
#ifdef MT_USE_MPI
            MPI_Barrier(MPI_COMM_WORLD);
#endif
            if (mpi_rank() == 0) mt_remove_tree(dir);
            res = tp_agree(res);
        }
    }
    return res;
}

/* --log-params-norm and --log-num-zeros-in-grad on several GPUs against the model alone on one GPU
 * (every rank runs both; same initial weights and batches, 3 steps, the batches from the first half
 * of the vocabulary): TP = world with SP (the norms, row-parallel biases and position embeddings are
 * whole on every TP rank: counted once), DP = world with the distributed optimizer (each rank sums its
 * shard of the master weights and of the gradients, then the DP sum), PP = world (the stages' sums
 * added; GPT-2's tied word embeddings live on the first and the last stage and count once). Each
 * step's params norm within 1e-6 relative of one GPU's (fp32: the layouts' weights differ by reordered
 * sums, ~1e-7 relative after 3 steps, tests/test_tensor_parallel.h; a tensor counted twice or missed
 * moves the norm by 1e-3 or more) and its zero count within 16 of one GPU's (the structural zeros are
 * the untied word embeddings' rows no token of the batch uses and the padding's, the same in every
 * layout; besides them a few elements come out exactly 0 by cancellation, and which ones depends on
 * the order of the sums: on 4 H200s GPT-2 at TP=4 with SP counted 2 where one GPU counted 3; a
 * layout counting a replica twice or skipping a shard would differ by thousands); every rank reports
 * the same values. GPT-2 (tied) and Llama (untied; its count at least the unused rows' elements). */
static test_result pn_steps(mt_config c, double* norms, int64_t* zeros) {
    mt_error err;
    mt_trainer* t = NULL;
    c.log_params_norm = c.log_num_zeros_in_grad = 1;
    if (dp_create(&c, &t) != TEST_PASS) return TEST_FAIL;
    test_result res = TEST_PASS;
    const int64_t row = c.seq_length + 1;
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    for (int k = 0; k < 3 && res == TEST_PASS; k++) {
        fill_tokens(global, c.global_batch_size * row, (int)(c.vocab_size / 2), 2000 + k);
        dp_slice(&c, global, mine);
        mt_step_result r;
        if (mt_trainer_train_step(t, mine, &r, &err) != MT_OK) { printf("    FAIL step %d: %s\n", k, err.message); res = TEST_FAIL; }
        norms[k] = r.params_norm;
        zeros[k] = r.num_zeros_in_grad;
    }
    free(global);
    free(mine);
    mt_trainer_free(t);
    return res;
}
static test_result test_params_norm_zeros_layouts(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    const int world = mpi_world();
    const char* names[3] = {"TP SP", "DP distributed optimizer", "PP"};
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        double ref_norms[3], norms[3];
        int64_t ref_zeros[3], zeros[3];
        mt_config ref = pp_config(MT_FP32, 1, 1, 1, 1, llama);
        res = tp_agree(pn_steps(ref, ref_norms, ref_zeros));
        const int64_t unused = llama ? (ref.vocab_size + 127) / 128 * 128 - ref.vocab_size / 2 : 0;
        for (int v = 0; v < 3 && res == TEST_PASS; v++) {
            mt_config c = v == 0 ? pp_config(MT_FP32, 1, 1, world, 1, llama)
                        : v == 1 ? pp_config(MT_FP32, 1, 1, 1, world, llama) : pp_config(MT_FP32, world, 1, 1, 1, llama);
            if (v == 1) c.use_distributed_optimizer = 1;
            res = tp_agree(pn_steps(c, norms, zeros));
            if (res != TEST_PASS) break;
            if (!tp_same_on_all_ranks(norms, sizeof(norms)) || !tp_same_on_all_ranks(zeros, sizeof(zeros))) {
                printf("    FAIL %s %s: the ranks report different norms or counts\n", llama ? "Llama" : "GPT-2", names[v]);
                res = TEST_FAIL;
            }
            for (int k = 0; k < 3; k++) {
                const double rel = fabs(norms[k] - ref_norms[k]) / ref_norms[k];
                if (!(rel <= 1e-6) || llabs(zeros[k] - ref_zeros[k]) > 16 || zeros[k] < unused * ref.hidden_size) {
                    printf("    FAIL %s %s step %d: params norm %.9f (one GPU %.9f), num zeros %lld (one GPU %lld)\n",
                           llama ? "Llama" : "GPT-2", names[v], k, norms[k], ref_norms[k], (long long)zeros[k],
                           (long long)ref_zeros[k]);
                    res = TEST_FAIL;
                }
            }
            printf("      %s %s=%d: params norm %.6f -> %.6f, num zeros %lld (one GPU: %.6f -> %.6f, %lld)\n",
                   llama ? "Llama" : "GPT-2", names[v], world, norms[0], norms[2], (long long)zeros[2], ref_norms[0],
                   ref_norms[2], (long long)ref_zeros[2]);
            res = tp_agree(res);
        }
    }
    return res;
}

/* Documents over the pipeline (--reset-position-ids, --reset-attention-mask; one GPU's model against
 * dev/ref_gpt.py's documents in tests/test_flags.h): every stage stages the micro-batch's documents with
 * its forward into the micro-batch's activation slot, where its backward, and the recompute of full
 * recompute (on the pipeline side only), read them again. A vocabulary of 16 with eod 0 puts ~2 document
 * ends in each micro-batch of 2 x 16 tokens, so a stage holding another micro-batch's documents, or none,
 * moves the losses far past the layouts' tolerances. GPT-2 (learned positions, exact attention in fp32)
 * and Llama in bf16 (RoPE, the flash kernels' document masks). */
static test_result test_pp_matches_single_documents(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        const mt_precision prec = llama ? MT_BF16 : MT_FP32;
        mt_config one = pp_config(prec, 1, 1, 1, 1, llama), c = pp_config(prec, mpi_world(), 1, 1, 1, llama);
        mt_config* both[2] = {&one, &c};
        for (int k = 0; k < 2; k++) {
            both[k]->vocab_size = 16;
            both[k]->eod_token = 0;
            both[k]->reset_position_ids = both[k]->reset_attention_mask = 1;
        }
        c.recompute.granularity = MT_RECOMPUTE_FULL;
        c.recompute.method = MT_RECOMPUTE_UNIFORM;
        c.recompute.num_layers = 1;
        char name[96];
        snprintf(name, sizeof(name), "%s %s PP=%d, documents, full recompute", llama ? "Llama" : "GPT-2",
                 llama ? "bf16" : "fp32", mpi_world());
        pp_reference ref;
        res = pp_reference_train(&ref, one);
        if (res == TEST_PASS) res = pp_against_reference(name, c, &ref);
        pp_reference_free(&ref);
    }
    return res;
}

/* Issue #34: mixture of experts under pipeline parallelism, against the same model on one GPU, fp32, both
 * flavours. The model: pp_config's 4 layers with --moe-layer-freq 2 (layers 0 and 2 MoE, 1 and 3 dense: at
 * PP = 2 each stage holds one of each, at PP = 2 x VP = 2 rank 0 holds both MoE layers and rank 1 none), 4
 * experts of width 128, top-2 sigmoid scores with the expert bias (--moe-router-enable-expert-bias, rate
 * 1e-3), the aux loss (1e-2) and the z-loss (1e-3); GPT-2: GELU experts with biases (router, fc1, fc2),
 * Llama: SwiGLU experts and a shared expert of 128. The layout comparison (tests/test_data_parallel.h:
 * 20 steps' losses and grad norms, the first step's gradients, the final weights, each tensor and element,
 * the router's and experts' included; the aux losses' gradients reach the router on the stage that holds
 * its layer) within the fp32 layout bounds, which the dense PP tests use too (PP runs one GPU's kernels on
 * each layer; the gradient norm's and the tied embedding's sums are ordered otherwise, so not bitwise).
 * Then the MoE statistics of 4 steps, every rank's (each stage routes its own layers; the pass end sums
 * the tokens per expert and the logged losses over the pipeline as Megatron's tracker does): the step's
 * logged load_balancing_loss and z_loss (mean over the MoE layers) within 1e-5 of one GPU's, the first
 * step's tokens per expert and the expert bias after it bitwise (the same weights route the same: every
 * layer's row, a stage that lost another stage's counts would report 0 there), later steps' tokens within
 * 2% of the routed pairs (the weights then differ by ulps: a near tie may route otherwise), the same
 * values on every rank. */
static test_result pp_moe_config(mt_config* c, int llama) {
    c->num_experts = 4;
    c->moe_router_topk = 2;
    c->moe_ffn_hidden_size = 128;
    c->moe_layer_freq = 2;
    c->moe_router_score_sigmoid = 1;
    c->moe_router_enable_expert_bias = 1;
    c->moe_router_bias_update_rate = 1e-3;
    c->moe_load_balancing = MT_MOE_AUX_LOSS;
    c->moe_aux_loss_coeff[0] = 1e-2;
    c->moe_z_loss_coeff = 1e-3;
    c->moe_router_dtype_fp32 = 1;
    if (llama) c->moe_shared_expert_intermediate_size = 128;
    EXPECT(llama ? c->swiglu && !c->add_bias_linear : !c->swiglu && c->add_bias_linear, "pp_config's flavour changed");
    return TEST_PASS;
}
enum { PP_MOE_STEPS = 4, PP_MOE_LAYERS = 2, PP_MOE_E = 4 };
typedef struct {
    double losses[PP_MOE_STEPS][4];
    int32_t tokens[PP_MOE_STEPS][PP_MOE_LAYERS * PP_MOE_E];
    float bias[PP_MOE_STEPS][PP_MOE_LAYERS * PP_MOE_E];
} pp_moe_stats;
static test_result pp_moe_stats_run(mt_config c, pp_moe_stats* out) {
    memset(out, 0, sizeof(*out));
    mt_trainer* t = NULL;
    mt_error err;
    if (dp_create(&c, &t) != TEST_PASS) return tp_agree(TEST_FAIL);
    test_result res = mt_moe_num_layers(&c) == PP_MOE_LAYERS && c.num_experts == PP_MOE_E ? TEST_PASS : TEST_FAIL;
    const int64_t count = (int64_t)c.global_batch_size * (c.seq_length + 1);
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * (size_t)count);
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * (size_t)count);
    for (int k = 0; k < PP_MOE_STEPS && res == TEST_PASS; k++) {
        fill_tokens(global, count, (int)c.vocab_size, 3000 + k);
        dp_slice(&c, global, mine);
        mt_step_result r;
        mt_status st = mt_trainer_train_step(t, mine, &r, &err);
        if (st == MT_OK) st = mt_trainer_moe_stats(t, NULL, out->tokens[k], out->bias[k], &err);
        if (st != MT_OK) {
            printf("    FAIL step %d: %s\n", k, err.message);
            res = TEST_FAIL;
        } else {
            for (int q = 0; q < 4; q++) out->losses[k][q] = r.moe_losses[q];
        }
    }
    free(global);
    free(mine);
    mt_trainer_free(t);
    return tp_agree(res);
}
static test_result test_pp_moe_matches_single(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    const int world = mpi_world();
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        mt_config one = pp_config(MT_FP32, 1, 1, 1, 1, llama);
        mt_config layouts[2] = {pp_config(MT_FP32, world, 1, 1, 1, llama), pp_config(MT_FP32, 2, 2, 1, world / 2, llama)};
        res = pp_moe_config(&one, llama);
        for (int k = 0; k < 2 && res == TEST_PASS; k++) res = pp_moe_config(&layouts[k], llama);
        if (res != TEST_PASS) return res;
        const char* fl = llama ? "Llama MoE (SwiGLU, shared expert)" : "GPT-2 MoE (GELU experts, biases)";
        pp_reference ref;
        res = pp_reference_train(&ref, one);
        static pp_moe_stats single, ours;
        if (res == TEST_PASS) res = pp_moe_stats_run(one, &single);
        for (int k = 0; k < 2 && res == TEST_PASS; k++) {
            char name[160];
            if (k == 0) snprintf(name, sizeof(name), "%s fp32 PP=%d", fl, world);
            else snprintf(name, sizeof(name), "%s fp32 PP=2 x VP=2 interleaved%s", fl, world == 4 ? " x DP=2" : "");
            res = pp_against_reference(name, layouts[k], &ref);
            if (res == TEST_PASS) res = pp_moe_stats_run(layouts[k], &ours);
            if (res != TEST_PASS) break;
            double worst = 0.0;
            int64_t token_diff = 0;
            for (int s = 0; s < PP_MOE_STEPS; s++) {
                for (int q = 0; q < 4; q++) {
                    const double d = fabs(ours.losses[s][q] - single.losses[s][q]) / fmax(fabs(single.losses[s][q]), 1e-30);
                    if (single.losses[s][q] != 0.0 || ours.losses[s][q] != 0.0) worst = d > worst ? d : worst;
                }
                for (int i = 0; s > 0 && i < PP_MOE_LAYERS * PP_MOE_E; i++)
                    token_diff += llabs((long long)ours.tokens[s][i] - single.tokens[s][i]);
            }
            const int64_t pairs = (int64_t)one.global_batch_size * one.seq_length * one.moe_router_topk * PP_MOE_LAYERS;
            const int first_tokens = !memcmp(ours.tokens[0], single.tokens[0], sizeof(ours.tokens[0]));
            const int first_bias = !memcmp(ours.bias[0], single.bias[0], sizeof(ours.bias[0]));
            int moved = 0;
            for (int i = 0; i < PP_MOE_LAYERS * PP_MOE_E; i++) moved += single.bias[0][i] != 0.0f;
            printf("      %s: load_balancing_loss %.6f (one GPU %.6f), z_loss %.6f (%.6f) at step 0; logged MoE losses "
                   "worst %.2e; step 0's tokens per expert %s, expert bias %s (%d of %d entries moved); later tokens "
                   "off by %lld of %lld pairs\n", name, ours.losses[0][0], single.losses[0][0], ours.losses[0][3],
                   single.losses[0][3], worst, first_tokens ? "bitwise" : "DIFFER", first_bias ? "bitwise" : "DIFFERS",
                   moved, PP_MOE_LAYERS * PP_MOE_E, (long long)token_diff, (long long)(PP_MOE_STEPS - 1) * pairs);
            if (!tp_same_on_all_ranks(&ours, sizeof(ours))) {
                printf("    FAIL %s: the ranks report different MoE statistics\n", name);
                res = TEST_FAIL;
            }
            if (!(worst <= 1e-5) || !(single.losses[0][0] > 0.1) || !(single.losses[0][3] > 0.0) || !first_tokens ||
                !first_bias || moved == 0 || token_diff * 50 > (int64_t)(PP_MOE_STEPS - 1) * pairs) {
                printf("    FAIL %s: the MoE statistics differ from one GPU's\n", name);
                res = TEST_FAIL;
            }
            res = tp_agree(res);
        }
        pp_reference_free(&ref);
    }
    return res;
}

static const test_case pipeline_multigpu_tests[] = {
    {"pp_moe_matches_single_gpu_fp32", test_pp_moe_matches_single},
    {"pp_matches_single_gpu_documents", test_pp_matches_single_documents},
    {"pp_matches_single_gpu_fp32", test_pp_matches_single_fp32},
    {"pp_matches_single_gpu_bf16", test_pp_matches_single_bf16},
    {"pp_matches_single_gpu_fp8", test_pp_matches_single_fp8},
    {"pp_matches_single_gpu_dropout_fp32", test_pp_matches_single_dropout_fp32},
    {"pp_splits_match_single_gpu_fp32", test_pp_splits_match_single_fp32},
    {"pp_splits_match_single_gpu_bf16", test_pp_splits_match_single_bf16},
    {"pp_repeatable_and_resumes_bf16", test_pp_repeat_resume},
    {"params_norm_and_num_zeros_tp_dp_pp_match_single_gpu", test_params_norm_zeros_layouts},
};

#endif
