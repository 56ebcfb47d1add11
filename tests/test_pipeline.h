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
 *     schedule's in-flight count (1 at PP = 1, min(PP - rank, M) for 1F1B).
 * Multi-GPU tests (mpirun -np 2 or 4):
 *   - PP = world (and PP = 2 x VP = 2 interleaved; with 4 processes also PP = 2 x TP = 2 with SP and
 *     PP = 2 x DP = 2 with the distributed optimizer, overlapped) against PP = 1 on the same data:
 *     the initial weights equal (same seed, each stage's elements), the first step's gradients and
 *     20 steps' losses and final weights agree (fp32 1e-5, bf16 1e-3 on losses); GPT-2 (tied
 *     embeddings: the first and last stage's copies stay bitwise equal) and Llama (untied);
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
 * last), dense stage numbering, and mt_pp_stage_copy round trips. */
static test_result pp_check_layout(int llama, int pp, int vp, int layers) {
    mt_error err;
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    c.num_layers = layers;
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
            int64_t at = info[p->tensor].offset + (mt__param_in_layers(p->tensor) ? (int64_t)p->layer * p->numel : 0);
            for (int64_t i = 0; i < p->numel; i++) {
                held[at + i]++;
                seen[p->canonical + i]++;
                if (part[p->canonical + i] != (float)(at + i)) res = TEST_FAIL;
            }
        }
        for (int64_t i = 0; i < b.canonical_size; i++)
            if (seen[i] != 1) res = TEST_FAIL;
        if (res != TEST_PASS) printf("    FAIL PP %d VP %d rank %d: stage numbering or copy wrong\n", pp, vp, r);
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
            printf("    FAIL PP %d VP %d %s: element %lld held %d times (want %d), copied back %g\n", pp, vp,
                   llama ? "Llama" : "GPT-2", (long long)i, held[i], want, back[i]);
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
    for (int llama = 0; llama <= 1; llama++)
        for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++)
            if (pp_check_layout(llama, cases[k][0], cases[k][1], cases[k][2]) != TEST_PASS) return TEST_FAIL;
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

static const test_case pipeline_tests[] = {
    {"pp_layer_split", test_pp_layer_split},
    {"pp_stage_holds_each_element_once", test_pp_stage_layout},
    {"pp_engine_transfers_finish", test_pp_engine_transfers},
};

/* ---- multi-GPU ---- */

/* The PP tests' model: 4 layers (8 with VP 2 at PP 4 is not run), hidden 256, 4 heads (Llama: 8 in
 * 4 groups), seq 16, micro-batch 2 of a global batch 16 (8 micro-batches at DP 1). */
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

/* A fresh trainer: initial weights, one compute_gradients' gradients and loss (TP = 1 layouts), and
 * before it an evaluation of the same micro-batches (forward only: every stage runs all of them
 * before the last has any back, so each slot is reused at once) and the first micro-batch's
 * per-token losses (the last stage's, shared with every rank). */
static test_result pp_first_step(mt_config c, const int32_t* tokens, float* params, float* grads, double* loss,
                                 double* eval_loss, float* token_losses) {
    mt_error err;
    if (c.world_size > 1) EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    int64_t row = c.seq_length + 1;
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    dp_slice(&c, tokens, mine);
    mt_status st = mt_trainer_get_parameters(t, params, &err);
    if (st == MT_OK) st = mt_trainer_evaluate(t, mine, mt_num_micro_batches(&c), eval_loss, &err);
    /* the global batch's first micro-batch on every rank (not this DP rank's slice): the per-token
     * losses are then the same on all ranks and comparable with PP = 1's */
    if (st == MT_OK) st = mt_trainer_token_losses(t, tokens, token_losses, &err);
    if (st == MT_OK) st = mt_trainer_compute_gradients(t, mine, mt_num_micro_batches(&c), loss, &err);
    if (st == MT_OK) st = mt_trainer_get_gradients(t, grads, &err);
    if (st != MT_OK) printf("    FAIL first step: %s\n", err.message);
    free(mine);
    mt_trainer_free(t);
    return st == MT_OK ? TEST_PASS : TEST_FAIL;
}

#define REQUIRE_PP_WORLD()                                                                                      \
    do {                                                                                                        \
        if (mpi_world() != 2 && mpi_world() != 4) SKIP("the PP tests run under mpirun -np 2 or -np 4, not %d", mpi_world()); \
    } while (0)

/* One layout against PP = 1: first-step weights/gradients/loss (TP = 1), 20 steps' losses, final weights. */
static test_result pp_against_single(const char* name, mt_config c, mt_config ref, double grad_tol, double loss_tol,
                                     double weight_tol) {
    mt_error err;
    mt_config fin = ref;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err);
    int64_t n = mt_num_parameters(&fin), row = fin.seq_length + 1;
    float *p0 = (float*)calloc(n, 4), *g0 = (float*)calloc(n, 4), *w0 = (float*)calloc(n, 4);
    float *p = (float*)calloc(n, 4), *g = (float*)calloc(n, 4), *w = (float*)calloc(n, 4);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * fin.global_batch_size * row);
    fill_tokens(tokens, fin.global_batch_size * row, (int)fin.vocab_size, 77);
    unsigned char* mask = key_bias_mask(&fin);
    double ref_losses[20], losses[20], loss0 = 0, loss = 0, eval0 = 0, eval = 0;
    const int64_t positions = (int64_t)fin.micro_batch_size * fin.seq_length;
    float *tl0 = (float*)calloc(positions, 4), *tl = (float*)calloc(positions, 4);
    const int tp1 = c.tensor_model_parallel_size == 1;
    test_result res = tp_agree(pp_first_step(ref, tokens, p0, g0, &loss0, &eval0, tl0));
    if (res == TEST_PASS) res = tp_agree(dp_run(ref, NULL, NULL, 0, 20, ref_losses, w0));
    if (res == TEST_PASS && tp1) res = tp_agree(pp_first_step(c, tokens, p, g, &loss, &eval, tl));
    if (res == TEST_PASS) res = tp_agree(dp_run(c, NULL, NULL, 0, 20, losses, tp1 ? w : NULL));
    if (res != TEST_PASS) goto done;
    {
        int copies_p = 1, copies_g = 1, copies_w = 1;
        double dg = 0, dw = 0, dl0 = 0, de = 0, dt = 0;
        const char* worst_name = "-";
        if (tp1) {
            pp_merge(&c, p, n, &copies_p);
            pp_merge(&c, g, n, &copies_g);
            pp_merge(&c, w, n, &copies_w);
            if (memcmp(p, p0, sizeof(float) * n)) { printf("    FAIL %s: initial weights differ from PP=1\n", name); res = TEST_FAIL; }
            if (!copies_p || !copies_w) { printf("    FAIL %s: the stages' copies of the word embeddings differ\n", name); res = TEST_FAIL; }
            dg = tp_worst_tensor(&fin, g, g0, mask, &worst_name);
            dw = rel_error(w, w0, n, mask);
            dl0 = fabs(loss - loss0) / fabs(loss0);
            de = fabs(eval - eval0) / fabs(eval0);
            for (int64_t i = 0; i < positions; i++) { /* per position: relative to the loss's size */
                double d = fabs((double)tl[i] - tl0[i]) / fmax(fabs((double)tl0[i]), 1.0);
                if (!(d <= dt)) dt = d;
            }
            if (!tp_same_on_all_ranks(&eval, sizeof(eval)) || !tp_same_on_all_ranks(tl, sizeof(float) * positions)) {
                printf("    FAIL %s: ranks report different evaluation or per-token losses\n", name);
                res = TEST_FAIL;
            }
        }
        double worst = 0;
        int worst_k = 0;
        for (int k = 0; k < 20; k++) {
            double rel = fabs(losses[k] - ref_losses[k]) / fabs(ref_losses[k]);
            if (!(rel <= worst)) { worst = rel; worst_k = k; }
        }
        if (!tp_same_on_all_ranks(losses, sizeof(losses))) { printf("    FAIL %s: ranks report different losses\n", name); res = TEST_FAIL; }
        printf("      %s: first loss %.2e, evaluation %.2e, per-token losses %.2e, gradients %.2e (worst %s), losses "
               "%.6f -> %.6f, worst relative difference to PP=1 %.2e (step %d), weights %.2e\n", name, dl0, de, dt, dg,
               worst_name, losses[0], losses[19], worst, worst_k, dw);
        if (!(dl0 <= loss_tol) || !(de <= loss_tol) || !(dt <= loss_tol) || !(dg <= grad_tol) || !(worst <= loss_tol) ||
            !(dw <= weight_tol))
            res = TEST_FAIL;
    }
done:
    free(p0), free(g0), free(w0), free(p), free(g), free(w), free(tokens), free(mask), free(tl0), free(tl);
    return tp_agree(res);
}

/* Tolerances: fp32 runs the same arithmetic as PP = 1 but for the last layer's fc2 bias gradient
 * (summed by a column-sum kernel on the receiving stage instead of inside the final norm's
 * backward: another order) and the tied embedding's gradient (its two halves added by NCCL):
 * 1e-5, the fp32 TP tests' bound. bf16: the same reorderings, rounded to bf16 where they feed
 * activations: losses 1e-3 (the bound), gradients and weights 1e-2 as the TP tests. */
static test_result pp_matches_single(mt_precision precision) {
    REQUIRE_MPI_GPUS();
    REQUIRE_PP_WORLD();
    int world = mpi_world();
    const double gt = precision == MT_FP32 ? 1e-5 : 1e-2, lt = precision == MT_FP32 ? 1e-5 : 1e-3, wt = gt;
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        const char* fl = llama ? "Llama" : "GPT-2";
        mt_config ref = pp_config(precision, 1, 1, 1, 1, llama);
        char name[96];
        snprintf(name, sizeof(name), "%s PP=%d", fl, world);
        res = pp_against_single(name, pp_config(precision, world, 1, 1, 1, llama), ref, gt, lt, wt);
        if (res == TEST_PASS) { /* at 4 GPUs beside DP = 2 (all-reduced gradients, no distributed optimizer) */
            snprintf(name, sizeof(name), "%s PP=2 x VP=2 interleaved%s", fl, world == 4 ? " x DP=2" : "");
            res = pp_against_single(name, pp_config(precision, 2, 2, 1, world / 2, llama), ref, gt, lt, wt);
        }
        if (res == TEST_PASS && world == 4 && precision == MT_BF16) {
            snprintf(name, sizeof(name), "%s PP=2 x TP=2 SP", fl);
            res = pp_against_single(name, pp_config(precision, 2, 1, 2, 1, llama), ref, gt, lt, wt);
        }
        if (res == TEST_PASS && world == 4 && precision == MT_BF16) {
            mt_config c = pp_config(precision, 2, 1, 1, 2, llama);
            test_config_ddp(&c, 1, 1, 1, 20000);
            snprintf(name, sizeof(name), "%s PP=2 x DP=2 distributed optimizer", fl);
            res = pp_against_single(name, c, ref, gt, lt, wt);
        }
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
        mt_config ref = pp_config(MT_FP32, 1, 1, 1, 1, llama), c = pp_config(MT_FP32, mpi_world(), 1, 1, 1, llama);
        ref.hidden_dropout = ref.attention_dropout = c.hidden_dropout = c.attention_dropout = 0.1;
        char name[96];
        snprintf(name, sizeof(name), "%s PP=%d, dropout 0.1", llama ? "Llama" : "GPT-2", mpi_world());
        res = pp_against_single(name, c, ref, 1e-5, 1e-5, 1e-5);
    }
    return res;
}
static test_result test_pp_matches_single_bf16(void) { return pp_matches_single(MT_BF16); }

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
 * moves the norm by 1e-3 or more) and its zero count equal (the exact zeros are the untied word
 * embeddings' rows no token of the batch uses and the padding's, the same in every layout; a layout
 * counting a replica twice or skipping a shard would differ by thousands); every rank reports the
 * same values. GPT-2 (tied) and Llama (untied; its count at least the unused rows' elements). */
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
                if (!(rel <= 1e-6) || zeros[k] != ref_zeros[k] || zeros[k] < unused * ref.hidden_size) {
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

static const test_case pipeline_multigpu_tests[] = {
    {"pp_matches_single_gpu_fp32", test_pp_matches_single_fp32},
    {"pp_matches_single_gpu_bf16", test_pp_matches_single_bf16},
    {"pp_matches_single_gpu_dropout_fp32", test_pp_matches_single_dropout_fp32},
    {"pp_repeatable_and_resumes_bf16", test_pp_repeat_resume},
    {"params_norm_and_num_zeros_tp_dp_pp_match_single_gpu", test_params_norm_zeros_layouts},
};

#endif
