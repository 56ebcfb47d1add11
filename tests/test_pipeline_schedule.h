/* tests/test_pipeline_schedule.h — pipeline schedules as data (mt_pp_schedule).
 *
 * Host tests (everywhere), over every valid (PP 1..8, VP 1..4, M 1..32, group size default, PP,
 * PP + 1, 2 PP, M):
 *   - on every rank, each (micro-batch, chunk) has exactly one forward and one backward, the backward
 *     after the forward; the list is warm-up forwards, forward/backward pairs, cool-down backwards;
 *     the warm-up count is Megatron's formula; the k-th forward and backward run entry k of the
 *     group-by-chunk table (rebuilt here independently), the backward's chunk mirrored;
 *   - the whole pipeline, simulated step by step (each rank runs its list in order; an op that
 *     receives runs only once its input was sent; sends are buffered), finishes with every op run
 *     (no deadlock); every receive takes the oldest message of its channel (sender, receiver,
 *     activation or gradient) and that message is the one it expects (same micro-batch, the
 *     receiver's virtual stage): sends and receives match in the order both sides post them; a
 *     forward of virtual stage v runs after the forward of v - 1 of the same micro-batch, a backward
 *     after its own forward and after the backward of v + 1; every channel ends empty;
 *   - PP = 1 is F0 B0 F1 B1 ... with no transfers;
 *   - the settings Megatron refuses are refused with one line, and some of them (a group smaller
 *     than PP; a last group smaller than PP) do deadlock the simulated pipeline;
 *   - the order equals both files of dev/data/pipeline_vectors/ (20 settings, every rank):
 *     schedules.txt from dev/gen_pipeline_schedule_vectors.py, a separate Python rendering of
 *     schedules.py's three loops (same reading of Megatron, written again: it guards the C against
 *     slips, not against a misreading of Megatron), and schedules_mcore.txt from
 *     dev/gen_pipeline_schedule_vectors_mcore.py, which runs Megatron-Core's own schedule functions
 *     (pinned version in its docstring) as rank r of a pretend pipeline, the forward and backward
 *     steps and the p2p calls replaced by recorders: Megatron's control flow is the authority. */
#ifndef MT_TEST_PIPELINE_SCHEDULE_H
#define MT_TEST_PIPELINE_SCHEDULE_H

#define TPP_MAX_PP 8
#define TPP_MAX_VP 4
#define TPP_MAX_M 32

/* Megatron's warm-up counts, written out again. */
static int tpp_warmup(int pp, int vp, int m, int g, int rank) {
    if (vp == 1) return pp - rank - 1 < m ? pp - rank - 1 : m;
    int w = (pp - rank - 1) * 2 + (vp - 1) * g;
    return w < m * vp ? w : m * vp;
}

/* The table of (micro-batch, chunk) the forwards walk: groups of g micro-batches (the last one:
 * what is left), each over chunks 0 .. VP-1. Fills mb[M VP], chunk[M VP]. */
static void tpp_table(int vp, int m, int g, int* mb, int* chunk) {
    int n = 0;
    for (int g0 = 0; g0 < m; g0 += g) {
        int g1 = g0 + g >= m ? m : g0 + g;
        for (int c = 0; c < vp; c++)
            for (int i = g0; i < g1; i++) mb[n] = i, chunk[n] = c, n++;
    }
}

/* Runs the whole pipeline: ops[r] is rank r's list (2 M VP ops). Returns 0, or 1 with why[]. */
typedef struct { int mb, stage; } tpp_msg;
static int tpp_simulate(int pp, int vp, int m, mt_pp_op** ops, char* why, size_t why_size) {
    int n = 2 * m * vp, last = pp * vp - 1, cap = m * vp;
    int nch = pp * pp * 2; /* channel (src, dst, 0 activation / 1 gradient) */
    tpp_msg* q = (tpp_msg*)malloc(sizeof(tpp_msg) * (size_t)nch * (size_t)cap);
    int* head = (int*)calloc((size_t)nch, sizeof(int));
    int* tail = (int*)calloc((size_t)nch, sizeof(int));
    char* fdone = (char*)calloc((size_t)(pp * vp * m), 1); /* [virtual stage, micro-batch] */
    char* bdone = (char*)calloc((size_t)(pp * vp * m), 1);
    int pos[TPP_MAX_PP] = {0}, bad = 0, remaining = pp * n;
    why[0] = 0;
    while (remaining > 0 && !bad) {
        int progress = 0;
        for (int r = 0; r < pp && !bad; r++) {
            if (pos[r] == n) continue;
            const mt_pp_op* op = &ops[r][pos[r]];
            int fwd = op->kind == MT_PP_FORWARD, v = op->chunk * pp + r, mb = op->micro_batch;
            int want_recv = fwd ? v > 0 : v < last, want_send = fwd ? v < last : v > 0;
            int peer_in = fwd ? (r + pp - 1) % pp : (r + 1) % pp, peer_out = fwd ? (r + 1) % pp : (r + pp - 1) % pp;
            if ((want_recv ? peer_in : -1) != op->recv_rank || (want_send ? peer_out : -1) != op->send_rank) {
                snprintf(why, why_size, "rank %d op %d: transfers recv %d send %d, want %d %d", r, pos[r], op->recv_rank,
                         op->send_rank, want_recv ? peer_in : -1, want_send ? peer_out : -1);
                bad = 1;
                break;
            }
            if (op->recv_rank >= 0) {
                int c = (op->recv_rank * pp + r) * 2 + !fwd;
                if (head[c] == tail[c]) continue; /* its input is not sent yet: wait */
                tpp_msg msg = q[(size_t)c * cap + head[c]++];
                if (msg.mb != mb || msg.stage != v) {
                    snprintf(why, why_size, "rank %d op %d (%c mb %d stage %d) received mb %d for stage %d", r, pos[r],
                             fwd ? 'F' : 'B', mb, v, msg.mb, msg.stage);
                    bad = 1;
                    break;
                }
            }
            size_t at = (size_t)v * m + mb;
            int deps = fwd ? (v == 0 || fdone[at - m]) : (fdone[at] && (v == last || bdone[at + m]));
            if (!deps || (fwd ? fdone[at] : bdone[at])) {
                snprintf(why, why_size, "rank %d op %d (%c mb %d stage %d) runs before its inputs or twice", r, pos[r],
                         fwd ? 'F' : 'B', mb, v);
                bad = 1;
                break;
            }
            (fwd ? fdone : bdone)[at] = 1;
            if (op->send_rank >= 0) {
                int c = (r * pp + op->send_rank) * 2 + !fwd;
                if (tail[c] == cap) { snprintf(why, why_size, "channel %d overflows", c); bad = 1; break; }
                tpp_msg msg = {mb, fwd ? v + 1 : v - 1};
                q[(size_t)c * cap + tail[c]++] = msg;
            }
            pos[r]++, remaining--, progress = 1;
        }
        if (!progress && !bad) {
            int o = snprintf(why, why_size, "deadlock with %d ops left; next:", remaining);
            for (int r = 0; r < pp && o < (int)why_size; r++)
                if (pos[r] < n)
                    o += snprintf(why + o, why_size - (size_t)o, " r%d %c%d.%d", r,
                                  ops[r][pos[r]].kind == MT_PP_FORWARD ? 'F' : 'B', ops[r][pos[r]].micro_batch,
                                  ops[r][pos[r]].chunk);
            bad = 1;
        }
    }
    for (int c = 0; c < nch && !bad; c++)
        if (head[c] != tail[c]) snprintf(why, why_size, "channel %d ends with %d messages", c, tail[c] - head[c]), bad = 1;
    free(q), free(head), free(tail), free(fdone), free(bdone);
    return bad;
}

/* One rank's list: counts, order within the rank, structure, warm-up, table. */
static test_result tpp_check_rank(int pp, int vp, int m, int g, int rank, const mt_pp_op* ops, int warmup) {
    int n = 2 * m * vp, total = m * vp;
    int want_w = tpp_warmup(pp, vp, m, vp == 1 ? 1 : g, rank);
    EXPECT(warmup == want_w, "PP %d VP %d M %d G %d rank %d: warm-up %d, want %d", pp, vp, m, g, rank, warmup, want_w);
    int seen_f[TPP_MAX_VP * TPP_MAX_M] = {0}, seen_b[TPP_MAX_VP * TPP_MAX_M] = {0};
    int tmb[TPP_MAX_VP * TPP_MAX_M], tch[TPP_MAX_VP * TPP_MAX_M];
    tpp_table(vp, m, vp == 1 ? 1 : g, tmb, tch);
    int f = 0, b = 0;
    for (int i = 0; i < n; i++) {
        const mt_pp_op* op = &ops[i];
        EXPECT(op->micro_batch >= 0 && op->micro_batch < m && op->chunk >= 0 && op->chunk < vp,
               "PP %d VP %d M %d G %d rank %d op %d: mb %d chunk %d", pp, vp, m, g, rank, i, op->micro_batch, op->chunk);
        int at = op->chunk * m + op->micro_batch, fwd = op->kind == MT_PP_FORWARD;
        /* structure: warm-up forwards, then F B pairs, then backwards */
        int want_fwd = i < warmup || (i < warmup + 2 * (total - warmup) && (i - warmup) % 2 == 0);
        EXPECT(fwd == want_fwd && (fwd || op->kind == MT_PP_BACKWARD), "PP %d VP %d M %d G %d rank %d op %d: kind %d",
               pp, vp, m, g, rank, i, op->kind);
        if (fwd) {
            EXPECT(!seen_f[at]++, "PP %d VP %d M %d G %d rank %d: forward mb %d chunk %d twice", pp, vp, m, g, rank,
                   op->micro_batch, op->chunk);
            EXPECT(op->micro_batch == tmb[f] && op->chunk == tch[f], "rank %d forward %d: mb %d chunk %d, want %d %d", rank,
                   f, op->micro_batch, op->chunk, tmb[f], tch[f]);
            f++;
        } else {
            EXPECT(seen_f[at], "PP %d VP %d M %d G %d rank %d: backward mb %d chunk %d before its forward", pp, vp, m, g,
                   rank, op->micro_batch, op->chunk);
            EXPECT(!seen_b[at]++, "PP %d VP %d M %d G %d rank %d: backward mb %d chunk %d twice", pp, vp, m, g, rank,
                   op->micro_batch, op->chunk);
            EXPECT(op->micro_batch == tmb[b] && op->chunk == vp - 1 - tch[b], "rank %d backward %d: mb %d chunk %d", rank,
                   b, op->micro_batch, op->chunk);
            b++;
        }
    }
    EXPECT(f == total && b == total, "rank %d: %d forwards, %d backwards, want %d each", rank, f, b, total);
    return TEST_PASS;
}

/* The group sizes tried: 0 (default PP), PP, PP + 1, 2 PP, M. */
static int tpp_group(int which, int pp, int m) {
    switch (which) {
    case 0: return 0;
    case 1: return pp;
    case 2: return pp + 1;
    case 3: return 2 * pp;
    default: return m;
    }
}

static test_result test_pipeline_schedule_all(void) {
    mt_pp_op* ops[TPP_MAX_PP];
    for (int r = 0; r < TPP_MAX_PP; r++) ops[r] = (mt_pp_op*)malloc(sizeof(mt_pp_op) * 2 * TPP_MAX_VP * TPP_MAX_M);
    int settings = 0, total_ops = 0;
    char why[512];
    test_result res = TEST_PASS;
    for (int pp = 1; pp <= TPP_MAX_PP && res == TEST_PASS; pp++)
        for (int vp = 1; vp <= TPP_MAX_VP && res == TEST_PASS; vp++)
            for (int m = 1; m <= TPP_MAX_M && res == TEST_PASS; m++)
                for (int which = 0; which < (vp == 1 ? 1 : 5) && res == TEST_PASS; which++) {
                    int g = tpp_group(which, pp, m), geff = g <= 0 ? pp : g;
                    if (which > 0 && g == pp) continue; /* same as the default */
                    mt_error err;
                    int valid = vp == 1 || (pp > 1 && geff >= pp && geff <= m && (m % geff == 0 || m % geff >= pp));
                    mt_status st = mt_pp_schedule_check(pp, vp, m, g, &err);
                    if (!valid) {
                        if (st != MT_ERR_CONFIG) {
                            printf("    FAIL PP %d VP %d M %d G %d accepted\n", pp, vp, m, g);
                            res = TEST_FAIL;
                        }
                        continue;
                    }
                    if (st != MT_OK) {
                        printf("    FAIL PP %d VP %d M %d G %d refused: %s\n", pp, vp, m, g, err.message);
                        res = TEST_FAIL;
                        continue;
                    }
                    for (int r = 0; r < pp && res == TEST_PASS; r++) {
                        int w = -1;
                        st = mt_pp_schedule(pp, vp, m, g, r, ops[r], &w, &err);
                        if (st != MT_OK) {
                            printf("    FAIL PP %d VP %d M %d G %d rank %d: %s\n", pp, vp, m, g, r, err.message);
                            res = TEST_FAIL;
                        } else {
                            res = tpp_check_rank(pp, vp, m, geff, r, ops[r], w);
                            if (w != mt_pp_num_warmup(pp, vp, m, g, r)) res = TEST_FAIL;
                        }
                        total_ops += 2 * m * vp;
                    }
                    if (res == TEST_PASS && tpp_simulate(pp, vp, m, ops, why, sizeof why)) {
                        printf("    FAIL PP %d VP %d M %d G %d: %s\n", pp, vp, m, g, why);
                        res = TEST_FAIL;
                    }
                    settings++;
                }
    for (int r = 0; r < TPP_MAX_PP; r++) free(ops[r]);
    if (res == TEST_PASS) printf("    %d settings, %d ops, each pipeline simulated to the end\n", settings, total_ops);
    return res;
}

static test_result test_pipeline_schedule_pp1(void) {
    mt_pp_op ops[2 * TPP_MAX_M];
    mt_error err;
    for (int m = 1; m <= TPP_MAX_M; m++) {
        int w = -1;
        EXPECT_OK(mt_pp_schedule(1, 1, m, 0, 0, ops, &w, &err), &err);
        EXPECT(w == 0, "M %d: warm-up %d", m, w);
        for (int i = 0; i < 2 * m; i++)
            EXPECT(ops[i].kind == (i % 2 ? MT_PP_BACKWARD : MT_PP_FORWARD) && ops[i].micro_batch == i / 2 &&
                       ops[i].chunk == 0 && ops[i].recv_rank == -1 && ops[i].send_rank == -1,
                   "M %d op %d: kind %d mb %d chunk %d recv %d send %d", m, i, ops[i].kind, ops[i].micro_batch,
                   ops[i].chunk, ops[i].recv_rank, ops[i].send_rank);
    }
    return TEST_PASS;
}

/* A hand-checked case: PP 2, VP 2, M 4 (group 2). Virtual stages: rank 0 holds 0 and 2, rank 1 holds
 * 1 and 3. Rank 0 warms up with 2 (PP - 0 - 1) + 1 * 2 = 4 forwards, rank 1 with 2. */
static test_result test_pipeline_schedule_example(void) {
    static const char* want[2] = {
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    };
    mt_pp_op ops[16];
    mt_error err;
    for (int r = 0; r < 2; r++) {
        int w = 0;
        EXPECT_OK(mt_pp_schedule(2, 2, 4, 0, r, ops, &w, &err), &err);
        EXPECT(w == (r == 0 ? 4 : 2), "rank %d warm-up %d", r, w);
        char got[256];
        int o = 0;
        for (int i = 0; i < 16; i++)
            o += snprintf(got + o, sizeof got - (size_t)o, "%s%c%d.%d", i ? " " : "",
                          ops[i].kind == MT_PP_FORWARD ? 'F' : 'B', ops[i].micro_batch, ops[i].chunk);
        EXPECT(strcmp(got, want[r]) == 0, "rank %d:\n      got  %s\n      want %s", r, got, want[r]);
    }
    /* the table of schedules.py's own example, PP 2, VP 2, M 5, group 3: the forwards run
     * micro-batches 0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1 */
    {
        static const int mb[10] = {0, 1, 2, 0, 1, 2, 3, 4, 3, 4}, ch[10] = {0, 0, 0, 1, 1, 1, 0, 0, 1, 1};
        mt_pp_op o5[20];
        EXPECT_OK(mt_pp_schedule(2, 2, 5, 3, 1, o5, NULL, &err), &err);
        for (int i = 0, k = 0; i < 20; i++)
            if (o5[i].kind == MT_PP_FORWARD) {
                EXPECT(o5[i].micro_batch == mb[k] && o5[i].chunk == ch[k], "forward %d: mb %d chunk %d, want %d %d", k,
                       o5[i].micro_batch, o5[i].chunk, mb[k], ch[k]);
                k++;
            }
    }
    /* rank 0: F0.0 (stage 0) receives nothing, sends to rank 1; F0.1 (stage 2) receives from rank 1;
     * B0.1 (stage 2) receives the gradient from rank 1 and sends it back to rank 1; B0.0 sends none */
    EXPECT_OK(mt_pp_schedule(2, 2, 4, 0, 0, ops, NULL, &err), &err);
    EXPECT(ops[0].recv_rank == -1 && ops[0].send_rank == 1, "F0.0: %d %d", ops[0].recv_rank, ops[0].send_rank);
    EXPECT(ops[2].recv_rank == 1 && ops[2].send_rank == 1, "F0.1: %d %d", ops[2].recv_rank, ops[2].send_rank);
    EXPECT(ops[5].recv_rank == 1 && ops[5].send_rank == 1, "B0.1: %d %d", ops[5].recv_rank, ops[5].send_rank);
    EXPECT(ops[9].recv_rank == 1 && ops[9].send_rank == -1, "B0.0: %d %d", ops[9].recv_rank, ops[9].send_rank);
    /* rank 1: F0.1 is the last stage (3): no send; B0.1 receives no gradient */
    EXPECT_OK(mt_pp_schedule(2, 2, 4, 0, 1, ops, NULL, &err), &err);
    EXPECT(ops[2].recv_rank == 0 && ops[2].send_rank == -1, "F0.1: %d %d", ops[2].recv_rank, ops[2].send_rank);
    EXPECT(ops[3].recv_rank == -1 && ops[3].send_rank == 0, "B0.1: %d %d", ops[3].recv_rank, ops[3].send_rank);
    return TEST_PASS;
}

static test_result test_pipeline_schedule_refused(void) {
    static const struct { int pp, vp, m, g, rank; mt_status st; } bad[] = {
        {0, 1, 4, 0, 0, MT_ERR_CONFIG}, {2, 0, 4, 0, 0, MT_ERR_CONFIG}, {2, 1, 0, 0, 0, MT_ERR_CONFIG},
        {1, 2, 4, 0, 0, MT_ERR_CONFIG},  /* interleaving needs PP > 1 */
        {4, 2, 3, 0, 0, MT_ERR_CONFIG},  /* group 4 > M */
        {4, 2, 6, 0, 0, MT_ERR_CONFIG},  /* last group 2 < PP */
        {4, 2, 8, 2, 0, MT_ERR_CONFIG},  /* group < PP */
        {4, 2, 8, 0, 4, MT_ERR_RANGE},   /* rank out of range */
        {4, 1, 8, 0, -1, MT_ERR_RANGE},
    };
    mt_pp_op ops[64];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mt_error err;
        err.message[0] = 0;
        mt_status st = mt_pp_schedule(bad[i].pp, bad[i].vp, bad[i].m, bad[i].g, bad[i].rank, ops, NULL, &err);
        EXPECT(st == bad[i].st, "case %zu: %s", i, mt_status_name(st));
        EXPECT(err.message[0] && !strchr(err.message, '\n'), "case %zu: message '%s'", i, err.message);
        printf("    refused: %s\n", err.message);
    }
    /* accepted: M a multiple of the group, or a last group of at least PP; VP = 1 takes any M */
    mt_error err;
    EXPECT_OK(mt_pp_schedule_check(4, 2, 8, 0, &err), &err);
    EXPECT_OK(mt_pp_schedule_check(4, 2, 12, 8, &err), &err);
    EXPECT_OK(mt_pp_schedule_check(4, 3, 9, 5, &err), &err);
    EXPECT_OK(mt_pp_schedule_check(8, 1, 3, 0, &err), &err);
    /* why: some refused interleavings do break the pipeline (unchecked schedules, simulated): a
     * group smaller than PP, a last group smaller than PP. (Not all of them: with buffered sends many
     * refused settings still run, e.g. PP 4 VP 2 M 6; Megatron refuses them all the same.) */
    static const int broken[][4] = {{3, 2, 3, 1}, {4, 3, 5, 4}, {4, 4, 9, 4}};
    mt_pp_op* all[TPP_MAX_PP];
    for (size_t i = 0; i < sizeof broken / sizeof broken[0]; i++) {
        int pp = broken[i][0], vp = broken[i][1], m = broken[i][2], g = broken[i][3];
        for (int r = 0; r < pp; r++) {
            all[r] = (mt_pp_op*)malloc(sizeof(mt_pp_op) * 2 * (size_t)(m * vp));
            mt__pp_fill(pp, vp, m, g, r, all[r]);
        }
        char why[512];
        int failed = tpp_simulate(pp, vp, m, all, why, sizeof why);
        for (int r = 0; r < pp; r++) free(all[r]);
        EXPECT(failed, "PP %d VP %d M %d G %d (refused) simulates fine", pp, vp, m, g);
        printf("    PP %d VP %d M %d G %d: %s\n", pp, vp, m, g, why);
    }
    return TEST_PASS;
}

/* A file of dev/data/pipeline_vectors/: one line per (PP, VP, M, G, rank):
 * `pp vp m g rank warmup op...`, op = F<mb>.<chunk> or B<mb>.<chunk>; every line must equal
 * mt_pp_schedule's list for that rank. Its absence is a failure under MT_TEST_STRICT=1 (the files are
 * committed). */
static test_result tpp_check_vector_file(const char* path, const char* generator) {
    FILE* f = fopen(path, "r");
    if (!f) SKIP_OR_FAIL_STRICT("%s missing (%s)", path, generator);
    int pp, vp, m, g, rank, w, lines = 0;
    mt_pp_op ops[2 * TPP_MAX_VP * TPP_MAX_M];
    test_result res = TEST_PASS;
    while (res == TEST_PASS && fscanf(f, "%d %d %d %d %d %d", &pp, &vp, &m, &g, &rank, &w) == 6) {
        mt_error err;
        int got_w = -1;
        if (2 * m * vp > (int)(sizeof ops / sizeof ops[0]) || mt_pp_schedule(pp, vp, m, g, rank, ops, &got_w, &err) != MT_OK) {
            printf("    FAIL line %d: PP %d VP %d M %d G %d rank %d not scheduled\n", lines + 1, pp, vp, m, g, rank);
            res = TEST_FAIL;
            break;
        }
        if (got_w != w) {
            printf("    FAIL line %d: warm-up %d, want %d\n", lines + 1, got_w, w);
            res = TEST_FAIL;
        }
        for (int i = 0; i < 2 * m * vp && res == TEST_PASS; i++) {
            char k;
            int mb, c;
            if (fscanf(f, " %c%d.%d", &k, &mb, &c) != 3) {
                printf("    FAIL line %d: short\n", lines + 1);
                res = TEST_FAIL;
            } else if ((k == 'F') != (ops[i].kind == MT_PP_FORWARD) || mb != ops[i].micro_batch || c != ops[i].chunk) {
                printf("    FAIL PP %d VP %d M %d G %d rank %d op %d: got %c%d.%d, want %c%d.%d\n", pp, vp, m, g, rank, i,
                       ops[i].kind == MT_PP_FORWARD ? 'F' : 'B', ops[i].micro_batch, ops[i].chunk, k, mb, c);
                res = TEST_FAIL;
            }
        }
        lines++;
    }
    fclose(f);
    if (res == TEST_PASS) {
        EXPECT(lines > 0, "%s: no schedules", path);
        printf("    %d rank schedules equal %s\n", lines, path);
    }
    return res;
}

/* schedules.txt: dev/gen_pipeline_schedule_vectors.py, our own Python reading of schedules.py's loops
 * (guards the C against slips, not against a misreading of Megatron). */
static test_result test_pipeline_schedule_vectors(void) {
    return tpp_check_vector_file("dev/data/pipeline_vectors/schedules.txt", "python3 dev/gen_pipeline_schedule_vectors.py");
}
/* schedules_mcore.txt: dev/gen_pipeline_schedule_vectors_mcore.py, Megatron-Core's own
 * forward_backward_pipelining_without_interleaving / _with_interleaving run with recording stubs for
 * the forward and backward steps and the p2p communication (Megatron's control flow, not a reading). */
static test_result test_pipeline_schedule_vectors_mcore(void) {
    return tpp_check_vector_file("dev/data/pipeline_vectors/schedules_mcore.txt",
                                 "python3 dev/gen_pipeline_schedule_vectors_mcore.py, megatron-core installed");
}

/* Activation slots of a step of millions of micro-batches are counted, not simulated (fuzz_flags: the
 * plan of --global-batch-size 644696784 walked a 160M-unit schedule past the fuzzer's timeout), and a
 * schedule whose 2 M VP units do not fit an int is refused rather than overflowed. */
static test_result test_pipeline_slots_huge_m(void) {
    mt_error err;
    int slots = 0;
    EXPECT(mt_pp_activation_slots(4, 1, 80000000, 0, 1, &slots, &err) == MT_OK && slots == 3, "PP 4 rank 1: %d slots", slots);
    EXPECT(mt_pp_activation_slots(4, 2, 80000000, 4, 0, &slots, &err) == MT_OK && slots == 2 * 3 + 4 + 1,
           "PP 4 VP 2 rank 0: %d slots", slots);
    EXPECT(mt_pp_activation_slots(1, 1, 1 << 30, 0, 0, &slots, &err) == MT_ERR_CONFIG && strstr(err.message, "too long"),
           "2^30 micro-batches: %s", err.message);
    EXPECT(mt_pp_activation_slots(2, 1, 4, 0, 2, &slots, &err) == MT_ERR_RANGE, "rank 2 of PP 2");
    return TEST_PASS;
}

static const test_case pipeline_schedule_tests[] = {
    {"pipeline_slots_counted_for_huge_m", test_pipeline_slots_huge_m},
    {"pipeline_schedule_pp1", test_pipeline_schedule_pp1},
    {"pipeline_schedule_example", test_pipeline_schedule_example},
    {"pipeline_schedule_all", test_pipeline_schedule_all},
    {"pipeline_schedule_refused", test_pipeline_schedule_refused},
    {"pipeline_schedule_vectors", test_pipeline_schedule_vectors},
    {"pipeline_schedule_vectors_mcore", test_pipeline_schedule_vectors_mcore},
};

#endif
