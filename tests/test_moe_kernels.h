/* tests/test_moe_kernels.h — megatron.cu section 14, the mixture-of-experts kernels, through the launchers
 * the model calls.
 *
 * Host: Megatron's token order (n = t*B + j) against rows (r = j*T + t), both ways; the scratch size
 * rule; when capacity dropping applies; the routing launchers' refusals (before any device work).
 * GPU (skip without one): every routing variant (softmax, pre-softmax, sigmoid with and without the
 * expert bias, group-limited, scaling, bf16 rounding, capacity by probs or position with and without
 * pad, C >= N; E 8..512, k 1..16, N 64..8192, B 1..4) against a float64 C++ reference that mirrors
 * dev/ref_moe.py's route(), drop(), permute() and aux_scores() (checked against ref_moe.py itself on
 * the CPU while it was written): counts, offsets, row_of, token_of, aux counts and step counts exact,
 * probabilities, score sums, lse^2, the aux losses and grad_w within fp32 bounds; two runs bitwise
 * equal; the router's backward (routing term alone, then with the aux and z terms) against the
 * reference's analytic gradient, which itself is checked against central differences in double.
 * Then permute / unpermute, SwiGLU x probability and its backward, GELU x probability with the experts' and
 * the router's biases (issue #34), the shared expert's gate and the router's casts in fp32, bf16 and fp16,
 * at shapes reaching each launcher's variants (kt_cover).
 * The helpers (kt_*) are tests/test_kernels.h's: outputs poisoned with NaN before each run, inputs
 * never zero, per-element and norm-wise bounds.
 * Section 13.1, the Hopper grouped GEMM (the experts' forward and input gradient): its tile schedule and its refusals on the
 * host; on an sm_90a build and GPU, Qwen3- and Mixtral-like grouped shapes (uneven counts, zeros, single
 * rows, spare rows) and edges against a float64 reference, nothing written past the groups' rows, two runs
 * bitwise equal. Run: ./test_megatron moe_kernels
 */
#ifndef MT_TEST_MOE_KERNELS_H
#define MT_TEST_MOE_KERNELS_H

#include <algorithm>
#include <vector>

/* ============================================================================================== */
/* Host tests                                                                                       */
/* ============================================================================================== */

/* n = t*B + j for row r = j*T + t: a bijection, both ways, on every shape (B = 1 is the identity). */
static test_result test_moe_token_order(void) {
    const int shapes[][2] = {{1, 1}, {1, 7}, {2, 3}, {4, 16}, {3, 5}, {8, 1}};
    for (const auto& s : shapes) {
        const int B = s[0], T = s[1], N = B * T;
        std::vector<int> seen((size_t)N, 0);
        for (int j = 0; j < B; j++)
            for (int t = 0; t < T; t++) {
                const int r = j * T + t, n = t * B + j;
                EXPECT(moe_row_of_token(n, B, T) == r, "B %d T %d: row of token %d is %d, expected %d", B, T, n,
                       moe_row_of_token(n, B, T), r);
                EXPECT(moe_token_of_row(r, B, T) == n, "B %d T %d: token of row %d is %d, expected %d", B, T, r,
                       moe_token_of_row(r, B, T), n);
                seen[(size_t)n]++;
            }
        for (int n = 0; n < N; n++) EXPECT(seen[(size_t)n] == 1, "B %d T %d: token %d seen %d times", B, T, n, seen[(size_t)n]);
    }
    /* a worked example: B = 2, T = 3: rows 0..2 are sequence 0, tokens 0, 2, 4; rows 3..5 tokens 1, 3, 5 */
    const int want[6] = {0, 2, 4, 1, 3, 5};
    for (int r = 0; r < 6; r++) EXPECT(moe_token_of_row(r, 2, 3) == want[r], "row %d", r);
    return TEST_PASS;
}

/* The scratch the launchers use fits moe_work_words: moe_route's map and keys (2 N E words), moe_aux_stats'
 * scores (N E) and per-token lse^2 (N); and dropping applies exactly when 0 < C < N. */
static test_result test_moe_work_and_capacity_rules(void) {
    const int sizes[][3] = {{64, 8, 1}, {8192, 256, 4}, {65536, 128, 1}, {1, 1, 1}};
    for (const auto& s : sizes) {
        const int N = s[0], E = s[1], B = s[2];
        const int64_t w = moe_work_words(N, E, B);
        EXPECT(w >= 2LL * N * E && w >= (int64_t)N * E + N, "N %d E %d: %lld words", N, E, (long long)w);
    }
    moe_routing r;
    memset(&r, 0, sizeof(r));
    r.N = 100;
    const int caps[][2] = {{0, 0}, {1, 1}, {99, 1}, {100, 0}, {250, 0}};
    for (const auto& c : caps) {
        r.capacity = c[0];
        EXPECT((int)moe_drops(r) == c[1], "C %d N %d: drops %d", c[0], r.N, (int)moe_drops(r));
    }
    return TEST_PASS;
}

/* The routing launchers refuse what they cannot route, in one line, before any device work (so this
 * runs without a GPU: no pointer is touched). */
static test_result test_moe_routing_refusals(void) {
    moe_routing good;
    memset(&good, 0, sizeof(good));
    good.N = 64; good.B = 2; good.T = 32; good.E = 16; good.k = 4;
    struct { const char* what; int field; int value; } bad[] = {
        {"N != B*T", 0, 63}, {"E = 0", 1, 0}, {"E too large", 1, MOE_MAX_EXPERTS + 1}, {"k = 0", 2, 0},
        {"k > E", 2, 17}, {"k > 32", 3, 0}, {"groups: E % G", 4, 3}, {"groups: k < group_topk", 5, 0},
        {"capacity < 0", 6, -1}};
    for (const auto& b : bad) {
        moe_routing r = good;
        switch (b.field) {
            case 0: r.N = b.value; break;
            case 1: r.E = b.value; break;
            case 2: r.k = b.value; break;
            case 3: r.E = 64; r.k = 33; break;
            case 4: r.num_groups = b.value; r.group_topk = 1; break;
            case 5: r.num_groups = 4; r.group_topk = 4; r.k = 2; break;
            case 6: r.capacity = b.value; break;
        }
        mt_gpu_error err;
        memset(&err, 0, sizeof(err));
        mt_exec ex;
        memset(&ex, 0, sizeof(ex));
        ex.error = &err;
        moe_route(&ex, r, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
        EXPECT(err.status == MT_ERR_ARG, "%s: moe_route recorded status %d", b.what, (int)err.status);
        EXPECT(strncmp(err.error.message, "moe_route: ", 11) == 0 && !strchr(err.error.message, '\n'),
               "%s: message \"%s\"", b.what, err.error.message);
        memset(&err, 0, sizeof(err));
        moe_route_backward(&ex, r, NULL, NULL, NULL, NULL, 1.0f, 0.0f, NULL, NULL);
        EXPECT(err.status == MT_ERR_ARG, "%s: moe_route_backward recorded status %d", b.what, (int)err.status);
        memset(&err, 0, sizeof(err));
        moe_aux_stats(&ex, r, NULL, NULL, NULL, NULL, NULL);
        EXPECT(err.status == MT_ERR_ARG, "%s: moe_aux_stats recorded status %d", b.what, (int)err.status);
        printf("    %s: %s\n", b.what, err.error.message);
    }
    return TEST_PASS;
}

/* ============================================================================================== */
/* The float64 reference (dev/ref_moe.py's route(), drop(), aux_scores(), switch_loss(), z_loss()    */
/* and the permutation, in C++), with the decision gaps that fp32 could flip                         */
/* ============================================================================================== */

/* Two decisions closer than this (relative) are near-ties: fp32 may take them either way, so the
 * generator draws that token's logits again. Exact ties are no risk: the GPU and the reference break
 * them the same way (lower expert, lower token) and compute equal values from equal inputs. The GPU's
 * scores carry at most a few tens of fp32 roundings (< 4e-6 relative): 1e-5 keeps a margin. */
#define MR_NEAR 1e-5

static bool mr_near(double a, double b) {
    return a != b && fabs(a - b) <= MR_NEAR * fmax(fabs(a), fabs(b));
}
static double mr_bf16(double x) { return (double)test_bf16_to_float(test_bf16_from_float((float)x)); }
static double mr_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* One routing configuration of the test. */
typedef struct {
    const char* name;
    int B, T, E, k;
    int sigmoid, pre, groups, gtopk;
    float scaling;
    int bias, round_bf16;
    double cap_factor; /* 0 dropless; > 0 Megatron's ceil(N k / E * factor); < 0: C = N + 5 (nothing dropped) */
    int position, pad;
    int grid; /* logits on a grid of 1/16 (exact ties between experts and tokens) */
} mr_case;

static moe_routing mr_routing(const mr_case& c) {
    moe_routing r;
    memset(&r, 0, sizeof(r));
    r.B = c.B; r.T = c.T; r.N = c.B * c.T; r.E = c.E; r.k = c.k;
    r.sigmoid = c.sigmoid; r.pre_softmax = c.pre; r.scaling = c.scaling;
    r.num_groups = c.groups; r.group_topk = c.gtopk; r.round_bf16 = c.round_bf16;
    if (c.cap_factor > 0) r.capacity = (int)ceil((double)r.N * c.k / c.E * (double)(float)c.cap_factor);
    else if (c.cap_factor < 0) r.capacity = r.N + 5;
    r.drop_position = c.position; r.pad = c.pad;
    return r;
}

/* The reference's routing of one micro-batch. */
struct mr_ref {
    std::vector<int> sel;           /* [N, k] selected experts, best first */
    std::vector<double> probs;      /* [N, E] final */
    std::vector<int> routed, fmap;  /* [N, E] selection, final map */
    std::vector<int> row_of, token_of, counts;
    std::vector<double> row_prob;
    std::vector<double> S;          /* [N, E] aux scores */
    std::vector<int> A;             /* [N, E] their plain top-k */
    std::vector<double> lse;        /* [N] */
    std::vector<int> near;          /* rows with a near-tie (to draw again) */
};

/* indices of x (n values) in the selection order: value descending, ties to the lower index */
static std::vector<int> mr_order(const double* x, int n, const std::vector<int>* allowed = NULL) {
    std::vector<int> idx;
    for (int i = 0; i < n; i++)
        if (!allowed || (*allowed)[i]) idx.push_back(i);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return x[a] > x[b]; });
    return idx;
}

/* Scores and the top-k of one row: val (what the probabilities come from), rank (what is ranked);
 * returns the selected experts; flags a near-tie. */
static std::vector<int> mr_select_row(const mr_case& c, const double* l, const float* bias, std::vector<double>& val,
                                      bool* near) {
    const int E = c.E, k = c.k;
    std::vector<double> rank((size_t)E);
    val.assign((size_t)E, 0.0);
    double mx = -INFINITY, sum = 0.0;
    for (int e = 0; e < E; e++) mx = fmax(mx, l[e]);
    for (int e = 0; e < E; e++) sum += exp(l[e] - mx);
    for (int e = 0; e < E; e++) {
        if (c.sigmoid) {
            val[e] = mr_sigmoid(l[e]);
            rank[e] = c.bias ? val[e] + (double)bias[e] : val[e];
        } else if (c.pre) {
            val[e] = exp(l[e] - mx) / sum;
            rank[e] = val[e];
        } else {
            val[e] = rank[e] = l[e];
        }
    }
    std::vector<int> allowed((size_t)E, 1);
    if (c.gtopk) {
        const int G = c.groups, per = E / G, m = k / c.gtopk;
        std::vector<double> gs((size_t)G);
        for (int g = 0; g < G; g++) {
            std::vector<int> o = mr_order(rank.data() + g * per, per);
            double s = 0.0;
            for (int i = 0; i < m; i++) s += rank[g * per + o[i]];
            gs[g] = s;
        }
        std::vector<int> go = mr_order(gs.data(), G);
        if (G > c.gtopk && mr_near(gs[go[c.gtopk - 1]], gs[go[c.gtopk]])) *near = true;
        for (int e = 0; e < E; e++) allowed[e] = 0;
        for (int i = 0; i < c.gtopk; i++)
            for (int e = 0; e < per; e++) allowed[go[i] * per + e] = 1;
    }
    std::vector<int> o = mr_order(rank.data(), E, &allowed);
    if ((int)o.size() > k && mr_near(rank[o[k - 1]], rank[o[k]])) *near = true;
    o.resize((size_t)k);
    return o;
}

/* The probabilities of the selected experts before scaling */
static void mr_selected_probs(const mr_case& c, const double* l, const std::vector<double>& val, const int* sel,
                              double* q) {
    const int k = c.k;
    if (c.sigmoid) {
        double s = 0.0;
        for (int i = 0; i < k; i++) { q[i] = val[sel[i]]; s += q[i]; }
        if (k > 1)
            for (int i = 0; i < k; i++) q[i] /= s + 1e-20;
    } else if (c.pre) {
        for (int i = 0; i < k; i++) q[i] = val[sel[i]];
    } else {
        double m = -INFINITY, s = 0.0;
        for (int i = 0; i < k; i++) m = fmax(m, l[sel[i]]);
        for (int i = 0; i < k; i++) { q[i] = exp(l[sel[i]] - m); s += q[i]; }
        for (int i = 0; i < k; i++) q[i] /= s;
    }
}

/* route(), drop(), the permutation and aux_scores() of ref_moe.py; l: the logits as the kernels see
 * them (rounded to bf16 already with round_bf16). */
static void mr_reference(const mr_case& c, const moe_routing& r, const std::vector<double>& l,
                         const std::vector<float>& bias, mr_ref* o) {
    const int N = r.N, E = c.E, k = c.k, B = c.B, T = c.T;
    o->sel.assign((size_t)N * k, 0);
    o->probs.assign((size_t)N * E, 0.0);
    o->routed.assign((size_t)N * E, 0);
    o->near.clear();
    std::vector<double> val;
    for (int row = 0; row < N; row++) {
        bool near = false;
        std::vector<int> s = mr_select_row(c, &l[(size_t)row * E], bias.data(), val, &near);
        double q[MOE_MAX_TOPK];
        mr_selected_probs(c, &l[(size_t)row * E], val, s.data(), q);
        for (int i = 0; i < k; i++) {
            double p = c.scaling != 0.0f ? q[i] * (double)c.scaling : q[i];
            if (c.round_bf16) {
                if (mr_bf16(p * (1 + MR_NEAR)) != mr_bf16(p * (1 - MR_NEAR))) near = true; /* near a rounding midpoint */
                p = mr_bf16(p);
            }
            o->sel[(size_t)row * k + i] = s[i];
            o->probs[(size_t)row * E + s[i]] = p;
            o->routed[(size_t)row * E + s[i]] = 1;
        }
        if (near) o->near.push_back(row);
    }
    o->fmap = o->routed;
    if (r.capacity > 0 && r.capacity < N) {
        const int C = r.capacity;
        for (int e = 0; e < E; e++) {
            std::vector<double> key((size_t)N); /* by token number n */
            for (int n = 0; n < N; n++) {
                const size_t at = (size_t)moe_row_of_token(n, B, T) * E + e;
                key[n] = c.position ? (double)o->routed[at] : o->probs[at];
            }
            std::vector<int> ord = mr_order(key.data(), N);
            if (!c.position && mr_near(key[ord[C - 1]], key[ord[C]])) {
                o->near.push_back(moe_row_of_token(ord[C - 1], B, T));
                o->near.push_back(moe_row_of_token(ord[C], B, T));
            }
            std::vector<int> keep((size_t)N, 0);
            for (int i = 0; i < C; i++) keep[ord[i]] = 1;
            for (int n = 0; n < N; n++) {
                const size_t at = (size_t)moe_row_of_token(n, B, T) * E + e;
                o->fmap[at] = c.pad ? keep[n] : (o->routed[at] && keep[n]);
                if (!o->fmap[at]) o->probs[at] = 0.0;
            }
        }
    }
    o->row_of.assign((size_t)N * E, -1);
    o->token_of.clear();
    o->row_prob.clear();
    o->counts.assign((size_t)2 * E + 1, 0);
    for (int e = 0; e < E; e++) {
        o->counts[E + e] = (int)o->token_of.size();
        for (int n = 0; n < N; n++) {
            const int row = moe_row_of_token(n, B, T);
            const size_t at = (size_t)row * E + e;
            if (!o->fmap[at]) continue;
            o->row_of[at] = (int)o->token_of.size();
            o->token_of.push_back(row);
            o->row_prob.push_back(o->probs[at]);
        }
        o->counts[e] = (int)o->token_of.size() - o->counts[E + e];
    }
    o->counts[2 * E] = (int)o->token_of.size();
    /* aux_scores(): softmax over all, or the sigmoid normalised; A = their plain top-k */
    o->S.assign((size_t)N * E, 0.0);
    o->A.assign((size_t)N * E, 0);
    o->lse.assign((size_t)N, 0.0);
    for (int row = 0; row < N; row++) {
        const double* lr = &l[(size_t)row * E];
        double* S = &o->S[(size_t)row * E];
        double mx = -INFINITY, se = 0.0, ss = 0.0;
        for (int e = 0; e < E; e++) mx = fmax(mx, lr[e]);
        for (int e = 0; e < E; e++) { se += exp(lr[e] - mx); ss += mr_sigmoid(lr[e]); }
        for (int e = 0; e < E; e++) S[e] = c.sigmoid ? mr_sigmoid(lr[e]) / (ss + 1e-20) : exp(lr[e] - mx) / se;
        o->lse[row] = mx + log(se);
        std::vector<int> ord = mr_order(S, E);
        if (E > k && mr_near(S[ord[k - 1]], S[ord[k]])) o->near.push_back(row);
        for (int i = 0; i < k; i++) o->A[(size_t)row * E + ord[i]] = 1;
    }
}

/* Logits never zero: uniform in +-[0.05, 4) or, on the grid, multiples of 1/16 in +-[1/16, 4]; the
 * expert bias (sigmoid) in +-[0.001, 0.05) (on the grid: multiples of 1/256). */
static void mr_draw_row(const mr_case& c, kt_rng* rng, float* row) {
    for (int e = 0; e < c.E; e++) {
        if (c.grid) {
            const int m = 1 + (int)(kt_next(rng) % 64);
            row[e] = (kt_next(rng) & 1) ? -m / 16.0f : m / 16.0f;
        } else {
            row[e] = kt_signed(rng, 0.05, 4.0);
        }
    }
}

/* Logits (and the bias) with no near-tie anywhere: rows with one are drawn again until none is left. */
static bool mr_make_inputs(const mr_case& c, const moe_routing& r, uint64_t seed, std::vector<float>& logits,
                           std::vector<float>& bias, std::vector<double>& lv, mr_ref* ref) {
    kt_rng rng = {seed};
    const int N = r.N, E = c.E;
    logits.resize((size_t)N * E);
    bias.assign((size_t)E, 0.0f);
    if (c.bias)
        for (int e = 0; e < E; e++)
            bias[e] = c.grid ? (float)((1 + (int)(kt_next(&rng) % 12)) / 256.0) * ((kt_next(&rng) & 1) ? -1 : 1)
                             : kt_signed(&rng, 0.001, 0.05);
    for (int row = 0; row < N; row++) mr_draw_row(c, &rng, &logits[(size_t)row * E]);
    for (int round = 0; round < 200; round++) {
        lv.resize(logits.size());
        for (size_t i = 0; i < logits.size(); i++)
            lv[i] = c.round_bf16 ? (double)test_bf16_to_float(test_bf16_from_float(logits[i])) : (double)logits[i];
        mr_reference(c, r, lv, bias, ref);
        if (ref->near.empty()) return true;
        for (int row : ref->near) mr_draw_row(c, &rng, &logits[(size_t)row * E]);
    }
    printf("    FAIL %s: near-ties remain after 200 redraws\n", c.name);
    return false;
}

/* The router's backward on one row in double, with the forward's selection sel: the analytic
 * gradient (dl) and, per element, the sum of the magnitudes its fp32 evaluation rounds (scale). */
struct mr_bwd_in {
    const double* dprobs; /* [E] */
    const double* gw;     /* [E] or NULL */
    double aux_scale, z_scale;
    int N;
};
static void mr_backward_row(const mr_case& c, const double* l, const float* bias, const int* sel, const mr_bwd_in& in,
                            double* dl, double* scale) {
    const int E = c.E, k = c.k;
    std::vector<double> val;
    bool near = false;
    std::vector<int> s2 = mr_select_row(c, l, bias, val, &near); /* val only; the selection is sel */
    for (int e = 0; e < E; e++) dl[e] = scale[e] = 0.0;
    double q[MOE_MAX_TOPK], dq[MOE_MAX_TOPK];
    mr_selected_probs(c, l, val, sel, q);
    const double cs = c.scaling != 0.0f ? (double)c.scaling : 1.0;
    for (int i = 0; i < k; i++) dq[i] = cs * in.dprobs[sel[i]];
    double mx = -INFINITY, se = 0.0;
    for (int e = 0; e < E; e++) mx = fmax(mx, l[e]);
    for (int e = 0; e < E; e++) se += exp(l[e] - mx);
    const double lse = mx + log(se);
    if (c.sigmoid) {
        double D = 1e-20, t = 0.0, ta = 0.0;
        for (int i = 0; i < k; i++) { D += val[sel[i]]; t += dq[i] * val[sel[i]]; ta += fabs(dq[i] * val[sel[i]]); }
        for (int i = 0; i < k; i++) {
            const double sv = val[sel[i]], d = k > 1 ? dq[i] / D - t / (D * D) : dq[i];
            const double a = k > 1 ? fabs(dq[i]) / D + ta / (D * D) : fabs(dq[i]);
            dl[sel[i]] += d * sv * (1 - sv);
            scale[sel[i]] += a * sv * (1 - sv);
        }
    } else {
        double dot = 0.0, adot = 0.0;
        for (int i = 0; i < k; i++) { dot += q[i] * dq[i]; adot += fabs(q[i] * dq[i]); }
        if (c.pre) {
            for (int e = 0; e < E; e++) {
                double g = 0.0;
                for (int i = 0; i < k; i++)
                    if (sel[i] == e) g = dq[i];
                dl[e] += val[e] * (g - dot);
                scale[e] += val[e] * (fabs(g) + adot);
            }
        } else {
            for (int i = 0; i < k; i++) {
                dl[sel[i]] += q[i] * (dq[i] - dot);
                scale[sel[i]] += q[i] * (fabs(dq[i]) + adot);
            }
        }
    }
    if (in.gw) {
        std::vector<double> S((size_t)E), sg((size_t)E);
        double D = 1e-20;
        for (int e = 0; e < E; e++) { sg[e] = mr_sigmoid(l[e]); D += sg[e]; }
        double dot = 0.0, adot = 0.0;
        for (int e = 0; e < E; e++) {
            const double ds = in.aux_scale * in.gw[e];
            S[e] = exp(l[e] - mx) / se;
            dot += c.sigmoid ? ds * sg[e] : ds * S[e];
            adot += c.sigmoid ? fabs(ds * sg[e]) : fabs(ds * S[e]);
        }
        for (int e = 0; e < E; e++) {
            const double ds = in.aux_scale * in.gw[e];
            if (c.sigmoid) {
                dl[e] += (ds / D - dot / (D * D)) * sg[e] * (1 - sg[e]);
                scale[e] += (fabs(ds) / D + adot / (D * D)) * sg[e] * (1 - sg[e]);
            } else {
                dl[e] += S[e] * (ds - dot);
                scale[e] += S[e] * (fabs(ds) + adot);
            }
        }
    }
    if (in.z_scale != 0.0)
        for (int e = 0; e < E; e++) {
            const double t = in.z_scale * 2.0 * lse * (exp(l[e] - mx) / se) / in.N;
            dl[e] += t;
            scale[e] += fabs(t) + fabs(in.z_scale * 2.0 * (exp(l[e] - mx) / se) / in.N) * (E / 32.0 + 8);
        }
}

/* The objective whose gradient mr_backward_row gives, for finite differences (the selection fixed). */
static double mr_objective_row(const mr_case& c, const double* l, const float* bias, const int* sel,
                               const mr_bwd_in& in) {
    const int E = c.E, k = c.k;
    std::vector<double> val;
    bool near = false;
    mr_select_row(c, l, bias, val, &near);
    double q[MOE_MAX_TOPK];
    mr_selected_probs(c, l, val, sel, q);
    const double cs = c.scaling != 0.0f ? (double)c.scaling : 1.0;
    double f = 0.0;
    for (int i = 0; i < k; i++) f += in.dprobs[sel[i]] * cs * q[i];
    double mx = -INFINITY, se = 0.0, D = 1e-20;
    for (int e = 0; e < E; e++) mx = fmax(mx, l[e]);
    for (int e = 0; e < E; e++) { se += exp(l[e] - mx); D += mr_sigmoid(l[e]); }
    if (in.gw)
        for (int e = 0; e < E; e++)
            f += in.aux_scale * in.gw[e] * (c.sigmoid ? mr_sigmoid(l[e]) / D : exp(l[e] - mx) / se);
    const double lse = mx + log(se);
    return f + in.z_scale * lse * lse / in.N;
}

/* ============================================================================================== */
/* GPU: the routing launchers on every variant                                                       */
/* ============================================================================================== */

/* Tolerances (u_c = 2^-24, the kernels' fp32 arithmetic; bounds first-order, then doubled):
 *   - integers (counts, offsets, the map's rows, token_of, aux counts, step counts): exact;
 *   - probabilities: a softmax or sigmoid score over E (a warp's sum: E/32 + 5 additions), the
 *     normalisation over k (k additions), expf/logf within 2 ulp, the scaling: at most
 *     (E/32 + k + 24) u_c relative, doubled; with round_bf16 the roundings agree exactly (no value
 *     within 1e-5 of a bf16 midpoint: the generator draws such tokens again), so do the decisions
 *     (no selection, group or capacity gap below 1e-5 relative, MR_NEAR);
 *   - score sums: S (E/32 + 12) u_c relative, summed in chains of T/8 + 8 (+ B for row 0): that many
 *     u_c times the sum of the (positive) terms, doubled; lse^2: the lse of a row is within
 *     (E/32 + 10)(1 + |lse|) u_c, squared, then a chain of N/1024 + 10;
 *   - the aux losses and grad_w from given stats: chains of E/256 + 12 (+ B E/256 for the sequence
 *     term) times the sum of |terms|; grad_w a few products: 8 u_c;
 *   - dlogits: each term of the router's backward is a few products and a dot of E or k terms: per
 *     element 2 (E/32 + k + 40) u_c times the sum of the magnitudes it is made of (mr_backward_row's
 *     scale), the cancellation in S (dS - dot) included;
 *   - the reference's own analytic gradient against central differences (h = 1e-5, double): the
 *     truncation is h^2 |f'''| ~ 1e-10 and the rounding 1e-16 / h: 1e-7 + 1e-6 x the row's scale.
 * Any indexing, ordering, tie or missed-write bug gives errors of order 1, or wrong integers. */
static double mr_prob_rtol(const mr_case& c) { return 2.0 * (c.E / 32.0 + c.k + 24) * KT_UC; }

static int mr_check_ints(kt_report* rep, const char* what, const int32_t* got, const int* want, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i]) {
            printf("    FAIL %s: %s[%lld] = %d, reference %d\n", rep->label, what, (long long)i, got[i], want[i]);
            rep->ok = 0;
            return 0;
        }
    size_t len = strlen(rep->line);
    snprintf(rep->line + len, sizeof(rep->line) - len, " %s exact", what);
    return 1;
}
template <typename T>
static int mr_same_bits(kt_report* rep, const char* what, const std::vector<T>& a, const std::vector<T>& b, int64_t n) {
    if (memcmp(a.data(), b.data(), (size_t)n * sizeof(T)) != 0) {
        printf("    FAIL %s: %s differs between two identical runs\n", rep->label, what);
        rep->ok = 0;
        return 0;
    }
    return 1;
}

static int mr_run_case(kt_ctx* k, const mr_case& c, int index) {
    const moe_routing r = mr_routing(c);
    const int N = r.N, E = c.E, K = c.k, B = c.B, T = c.T, C = r.capacity;
    kt_report rep;
    kt_report_begin(&rep, "%s (B %d T %d E %d k %d C %d)", c.name, B, T, E, K, C);
    std::vector<float> logits, bias;
    std::vector<double> lv;
    mr_ref ref;
    if (!mr_make_inputs(c, r, kt_seed(50, index, E, K), logits, bias, lv, &ref)) return 0;
    const int64_t NE = (int64_t)N * E;
    const int Rmax = N * K > E * C ? N * K : E * C, R = ref.counts[2 * E];
    float* dl = kt_alloc<float>(k, NE);
    float* dbias = kt_alloc<float>(k, E);
    float* dprobs = kt_alloc<float>(k, NE);
    int32_t* drow_of = kt_alloc<int32_t>(k, NE);
    int32_t* dtoken = kt_alloc<int32_t>(k, Rmax);
    float* drow_prob = kt_alloc<float>(k, Rmax);
    int32_t* dcounts = kt_alloc<int32_t>(k, 2 * E + 1);
    int32_t* dstep = kt_alloc<int32_t>(k, E);
    int32_t* dwork = kt_alloc<int32_t>(k, moe_work_words(N, E, B));
    int32_t* daux_counts = kt_alloc<int32_t>(k, (int64_t)(B + 1) * E);
    float* dscore_sums = kt_alloc<float>(k, (int64_t)(B + 1) * E);
    float* dlse = kt_alloc<float>(k, 1);
    float* dglobal = kt_alloc<float>(k, E);
    float* dgrad_w = kt_alloc<float>(k, (int64_t)B * E);
    float* dlog = kt_alloc<float>(k, 4);
    float* ddprobs = kt_alloc<float>(k, NE);
    float* ddlogits = kt_alloc<float>(k, NE);
    KT_ALLOCATED(k);
    kt_rng rng = {kt_seed(51, index, E, K)};
    std::vector<int32_t> step0((size_t)E);
    for (int e = 0; e < E; e++) step0[e] = (int32_t)(kt_next(&rng) % 1000);
    KT_CUDA(kt_put(k, dbias, bias));
    KT_CUDA(kt_put(k, dstep, step0));

    /* ---- moe_route, twice ---- */
    std::vector<float> probs[2], row_prob[2], lafter;
    std::vector<int32_t> row_of[2], token[2], counts[2], step;
    for (int run = 0; run < 2; run++) {
        KT_CUDA(kt_put(k, dl, logits));
        KT_CUDA(kt_poison(k, dprobs, NE));
        KT_CUDA(kt_poison(k, drow_of, NE));
        KT_CUDA(kt_poison(k, dtoken, Rmax));
        KT_CUDA(kt_poison(k, drow_prob, Rmax));
        KT_CUDA(kt_poison(k, dcounts, 2 * E + 1));
        KT_CUDA(kt_poison(k, dwork, moe_work_words(N, E, B)));
        moe_route(kt_exec(k, 0), r, dl, c.bias ? dbias : NULL, dprobs, drow_of, dtoken, drow_prob, dcounts, dstep, dwork);
        if (!kt_sync(k, rep.label)) return 0;
        KT_CUDA(kt_get(k, probs[run], dprobs, NE));
        KT_CUDA(kt_get(k, row_of[run], drow_of, NE));
        KT_CUDA(kt_get(k, counts[run], dcounts, 2 * E + 1));
        KT_CUDA(kt_get(k, token[run], dtoken, R));
        KT_CUDA(kt_get(k, row_prob[run], drow_prob, R));
    }
    KT_CUDA(kt_get(k, lafter, dl, NE));
    KT_CUDA(kt_get(k, step, dstep, E));
    if (!mr_check_ints(&rep, "counts", counts[0].data(), ref.counts.data(), 2 * E + 1)) return kt_report_end(&rep);
    mr_check_ints(&rep, "row_of", row_of[0].data(), ref.row_of.data(), NE);
    mr_check_ints(&rep, "token_of", token[0].data(), ref.token_of.data(), R);
    for (int e = 0; e < E; e++)
        if (step[e] != step0[e] + 2 * ref.counts[e]) {
            printf("    FAIL %s: step_counts[%d] = %d, expected %d + 2 x %d\n", rep.label, e, step[e], step0[e], ref.counts[e]);
            rep.ok = 0;
            break;
        }
    for (int64_t i = 0; i < NE; i++)
        if (lafter[i] != (float)lv[i]) {
            printf("    FAIL %s: logits[%lld] = %.9g after routing, expected %.9g (%s)\n", rep.label, (long long)i, lafter[i],
                   lv[i], c.round_bf16 ? "rounded to bf16" : "unchanged");
            rep.ok = 0;
            break;
        }
    {
        kt_check cp, crp;
        kt_check_begin(&cp, "probs", E, mr_prob_rtol(c), -1.0, 0.0);
        kt_check_begin(&crp, "row_prob", 0, mr_prob_rtol(c), -1.0, 0.0);
        for (int64_t i = 0; i < NE; i++) kt_check_add(&cp, i, probs[0][i], ref.probs[i], 0.0);
        for (int p = 0; p < R; p++) {
            kt_check_add(&crp, p, row_prob[0][p], ref.row_prob[p], 0.0);
            int e = 0;
            while (e + 1 < E && ref.counts[E + e + 1] <= p) e++;
            if (p < (int)token[0].size() && token[0][p] >= 0 && token[0][p] < N &&
                row_prob[0][p] != probs[0][(int64_t)token[0][p] * E + e]) {
                printf("    FAIL %s: row_prob[%d] = %.9g is not probs at its pair (%.9g)\n", rep.label, p, row_prob[0][p],
                       probs[0][(int64_t)token[0][p] * E + e]);
                rep.ok = 0;
                break;
            }
        }
        kt_check_end(&cp, &rep);
        if (R > 0) kt_check_end(&crp, &rep);
    }
    mr_same_bits(&rep, "probs", probs[0], probs[1], NE);
    mr_same_bits(&rep, "row_of", row_of[0], row_of[1], NE);
    mr_same_bits(&rep, "counts", counts[0], counts[1], 2 * E + 1);
    mr_same_bits(&rep, "token_of", token[0], token[1], R);
    mr_same_bits(&rep, "row_prob", row_prob[0], row_prob[1], R);

    /* ---- moe_aux_stats, twice (on the logits as routed: rounded in place with round_bf16) ---- */
    std::vector<int32_t> ac[2];
    std::vector<float> ss[2], lse[2];
    for (int run = 0; run < 2; run++) {
        KT_CUDA(kt_poison(k, daux_counts, (int64_t)(B + 1) * E));
        KT_CUDA(kt_poison(k, dscore_sums, (int64_t)(B + 1) * E));
        KT_CUDA(kt_poison(k, dlse, 1));
        KT_CUDA(kt_poison(k, dwork, moe_work_words(N, E, B)));
        moe_aux_stats(kt_exec(k, 0), r, dl, daux_counts, dscore_sums, dlse, dwork);
        if (!kt_sync(k, rep.label)) return 0;
        KT_CUDA(kt_get(k, ac[run], daux_counts, (int64_t)(B + 1) * E));
        KT_CUDA(kt_get(k, ss[run], dscore_sums, (int64_t)(B + 1) * E));
        KT_CUDA(kt_get(k, lse[run], dlse, 1));
    }
    {
        std::vector<int> want_c((size_t)(B + 1) * E, 0);
        std::vector<double> want_s((size_t)(B + 1) * E, 0.0);
        double lse2 = 0.0, lse_tol = 0.0;
        for (int row = 0; row < N; row++) {
            const int j = row / T;
            for (int e = 0; e < E; e++) {
                want_c[(size_t)(1 + j) * E + e] += ref.A[(size_t)row * E + e];
                want_c[e] += ref.A[(size_t)row * E + e];
                want_s[(size_t)(1 + j) * E + e] += ref.S[(size_t)row * E + e];
                want_s[e] += ref.S[(size_t)row * E + e];
            }
            const double L = ref.lse[row];
            lse2 += L * L;
            lse_tol += 2 * fabs(L) * (E / 32.0 + 10) * (1 + fabs(L)) * KT_UC + KT_UC * L * L;
        }
        lse_tol = 2 * (lse_tol + (N / 1024.0 + 10) * KT_UC * lse2);
        mr_check_ints(&rep, "aux_counts", ac[0].data(), want_c.data(), (int64_t)(B + 1) * E);
        kt_check cs, cl;
        kt_check_begin(&cs, "score_sums", E, 2.0 * ((E / 32.0 + 12) + T / 8.0 + 8 + B) * KT_UC, -1.0, 0.0);
        for (int64_t i = 0; i < (int64_t)(B + 1) * E; i++) kt_check_add(&cs, i, ss[0][i], want_s[i], 0.0);
        kt_check_end(&cs, &rep);
        kt_check_begin(&cl, "lse_sq_sum", 0, 0.0, -1.0, 0.0);
        kt_check_add(&cl, 0, lse[0][0], lse2, lse_tol);
        kt_check_end(&cl, &rep);
        mr_same_bits(&rep, "aux_counts", ac[0], ac[1], (int64_t)(B + 1) * E);
        mr_same_bits(&rep, "score_sums", ss[0], ss[1], (int64_t)(B + 1) * E);
        mr_same_bits(&rep, "lse_sq_sum", lse[0], lse[1], 1);
    }

    /* ---- moe_aux_finish from those stats: every term on, then the aux loss alone ---- */
    std::vector<float> gavg((size_t)E), log0(4), gw;
    for (int e = 0; e < E; e++) gavg[e] = (float)(1 + kt_next(&rng) % (2 * N * K / E + 2)) * 0.5f;
    for (int i = 0; i < 4; i++) log0[i] = kt_signed(&rng, 0.1, 2.0);
    const double n_global = 3.0 * N;
    const float coef[2][4] = {{1e-2f, 3e-3f, 2e-3f, 1e-3f}, {1e-2f, 0.0f, 0.0f, 0.0f}};
    for (int variant = 0; variant < 2; variant++) {
        KT_CUDA(kt_put(k, dglobal, gavg));
        KT_CUDA(kt_put(k, dlog, log0));
        KT_CUDA(kt_poison(k, dgrad_w, (int64_t)B * E));
        moe_aux_finish(kt_exec(k, 0), r, daux_counts, dscore_sums, dlse, variant ? NULL : dglobal, n_global, coef[variant][0],
                       coef[variant][1], coef[variant][2], coef[variant][3], dgrad_w, dlog);
        if (!kt_sync(k, rep.label)) return 0;
        std::vector<float> lg, g;
        KT_CUDA(kt_get(k, lg, dlog, 4));
        KT_CUDA(kt_get(k, g, dgrad_w, (int64_t)B * E));
        const double fa = (double)E / ((double)K * N * N), fs = (double)E / ((double)K * T * T) / B,
                     fg = (double)E / ((double)K * n_global * n_global);
        double want[4] = {0, 0, 0, 0}, mag[4] = {0, 0, 0, 0};
        for (int e = 0; e < E; e++) {
            want[0] += (double)ss[0][e] * ac[0][e];
            for (int j = 0; j < B; j++) want[1] += (double)ss[0][(size_t)(1 + j) * E + e] * ac[0][(size_t)(1 + j) * E + e];
            want[2] += (double)ss[0][e] * gavg[e];
        }
        mag[0] = want[0] * fa; mag[1] = want[1] * fs; mag[2] = want[2] * fg; /* terms are >= 0 */
        want[0] *= fa; want[1] *= fs; want[2] *= fg;
        want[3] = (double)lse[0][0] / N;
        mag[3] = want[3];
        kt_check cl, cg;
        kt_check_begin(&cl, variant ? "log(aux only)" : "log", 0, 0.0, -1.0, 0.0);
        for (int i = 0; i < 4; i++) {
            const bool on = coef[variant][i] != 0.0f;
            const double depth = E / 256.0 + 12 + (i == 1 ? B * E / 256.0 + B : 0);
            kt_check_add(&cl, i, lg[i], (double)log0[i] + (on ? want[i] : 0.0),
                         2 * (depth * mag[i] + fabs(log0[i])) * KT_UC * (on ? 1 : 0));
        }
        kt_check_end(&cl, &rep);
        kt_check_begin(&cg, variant ? "grad_w(aux only)" : "grad_w", E, 0.0, -1.0, 0.0);
        for (int j = 0; j < B; j++)
            for (int e = 0; e < E; e++) {
                const double a = ac[0][e] * fa * coef[variant][0], b = ac[0][(size_t)(1 + j) * E + e] * fs * coef[variant][1],
                             c2 = coef[variant][2] != 0.0f ? gavg[e] * fg * coef[variant][2] : 0.0;
                kt_check_add(&cg, (int64_t)j * E + e, g[(size_t)j * E + e], a + b + c2, 8 * KT_UC * (a + b + c2));
            }
        kt_check_end(&cg, &rep);
        if (variant == 0) gw = g;
    }

    /* ---- moe_route_backward: the routing term alone, then with the aux and z terms; twice ---- */
    std::vector<float> dp((size_t)NE);
    std::vector<double> dpv((size_t)NE);
    for (int64_t i = 0; i < NE; i++) {
        /* random everywhere (the kernel must read only the selected pairs) but 0 at dropped pairs */
        const bool dropped = ref.routed[i] && !ref.fmap[i];
        dp[i] = dropped ? 0.0f : kt_signed(&rng, 0.1, 1.0);
        dpv[i] = dp[i];
    }
    KT_CUDA(kt_put(k, ddprobs, dp));
    KT_CUDA(kt_put(k, dgrad_w, gw));
    std::vector<double> gwv(gw.begin(), gw.end());
    const float aux_scale = 0.75f, z_scale = 7e-4f;
    for (int variant = 0; variant < 2; variant++) {
        std::vector<float> got[2];
        for (int run = 0; run < 2; run++) {
            KT_CUDA(kt_poison(k, ddlogits, NE));
            moe_route_backward(kt_exec(k, 0), r, dl, c.bias ? dbias : NULL, ddprobs, variant ? dgrad_w : NULL,
                               variant ? aux_scale : 0.0f, variant ? z_scale : 0.0f, ddlogits, dwork);
            if (!kt_sync(k, rep.label)) return 0;
            KT_CUDA(kt_get(k, got[run], ddlogits, NE));
        }
        mr_same_bits(&rep, "dlogits", got[0], got[1], NE);
        kt_check cd;
        kt_check_begin(&cd, variant ? "dlogits(+aux+z)" : "dlogits", E, 0.0, -1.0, 1e-30);
        std::vector<double> an((size_t)E), sc((size_t)E);
        double fd_worst = 0.0;
        int fd_bad = 0;
        const int fd_rows = N < 6 ? N : 6;
        for (int row = 0; row < N; row++) {
            mr_bwd_in in;
            in.dprobs = &dpv[(size_t)row * E];
            in.gw = variant ? &gwv[(size_t)(row / T) * E] : NULL;
            in.aux_scale = variant ? aux_scale : 0.0;
            in.z_scale = variant ? z_scale : 0.0;
            in.N = N;
            const int* sel = &ref.sel[(size_t)row * K];
            mr_backward_row(c, &lv[(size_t)row * E], bias.data(), sel, in, an.data(), sc.data());
            for (int e = 0; e < E; e++)
                kt_check_add(&cd, (int64_t)row * E + e, got[0][(size_t)row * E + e], an[e],
                             2.0 * (E / 32.0 + K + 40) * KT_UC * sc[e]);
            if (row % (N / fd_rows) == 0) { /* the reference's analytic gradient against central differences */
                std::vector<double> lp(lv.begin() + (size_t)row * E, lv.begin() + (size_t)(row + 1) * E);
                double smax = 0.0;
                for (int e = 0; e < E; e++) smax = fmax(smax, sc[e]);
                for (int e = 0; e < E; e++) {
                    const double h = 1e-5, x0 = lp[e];
                    lp[e] = x0 + h;
                    const double fp = mr_objective_row(c, lp.data(), bias.data(), sel, in);
                    lp[e] = x0 - h;
                    const double fm = mr_objective_row(c, lp.data(), bias.data(), sel, in);
                    lp[e] = x0;
                    const double fd = (fp - fm) / (2 * h), err = fabs(fd - an[e]), tol = 1e-7 + 1e-6 * smax;
                    fd_worst = fmax(fd_worst, err / tol);
                    if (!(err <= tol) && fd_bad++ == 0)
                        printf("    FAIL %s: the reference's analytic dlogits[%d, %d] = %.12g, central difference %.12g\n",
                               rep.label, row, e, an[e], fd);
                }
            }
        }
        kt_check_end(&cd, &rep);
        if (fd_bad) rep.ok = 0;
        size_t len = strlen(rep.line);
        snprintf(rep.line + len, sizeof(rep.line) - len, " fd %.2f", fd_worst);
    }
    size_t len = strlen(rep.line);
    snprintf(rep.line + len, sizeof(rep.line) - len, " R %d", R);
    kt_release(k);
    return kt_report_end(&rep);
}

/* Every routing variant (and each kernel variant: 4 warps a block for E <= 256, 1 above; the
 * capacity kernel's radix select on probabilities and on the 0/1 map, with and without pad). */
static const mr_case mr_cases[] = {
    /* name                        B  T     E    k  sig pre G  g  scale  bias rnd cap    pos pad grid */
    {"softmax_top2",               2, 32,   8,   2, 0,  0,  0, 0, 0.0f,  0,   0,  0.0,   0,  0,  0},
    {"softmax_top2_grid_ties",     4, 64,   8,   2, 0,  0,  0, 0, 0.0f,  0,   0,  0.0,   0,  0,  1},
    {"pre_softmax_top1",           4, 64,   16,  1, 0,  1,  0, 0, 0.0f,  0,   0,  0.0,   0,  0,  0},
    {"pre_softmax_top4_grid",      2, 100,  16,  4, 0,  1,  0, 0, 0.0f,  0,   0,  0.0,   0,  0,  1},
    {"sigmoid_top2",               2, 64,   8,   2, 1,  0,  0, 0, 0.0f,  0,   0,  0.0,   0,  0,  0},
    {"sigmoid_top1_bias",          1, 128,  8,   1, 1,  0,  0, 0, 0.0f,  1,   0,  0.0,   0,  0,  0},
    {"sigmoid_bias_groups_scale",  2, 128,  16,  4, 1,  0,  4, 2, 2.5f,  1,   0,  0.0,   0,  0,  0},
    {"softmax_groups",             2, 64,   16,  4, 0,  0,  4, 2, 0.0f,  0,   0,  0.0,   0,  0,  0},
    {"softmax_top8_e128_bf16",     4, 2048, 128, 8, 0,  0,  0, 0, 0.0f,  0,   1,  0.0,   0,  0,  0},
    {"sigmoid_e256_bias_groups",   1, 4096, 256, 8, 1,  0,  8, 4, 2.5f,  1,   0,  0.0,   0,  0,  0},
    {"sigmoid_e256_grid_bf16",     2, 512,  256, 8, 1,  0,  0, 0, 0.0f,  1,   1,  0.0,   0,  0,  1},
    {"pre_softmax_e512_top16",     1, 256,  512, 16,0,  1,  0, 0, 1.5f,  0,   0,  0.0,   0,  0,  0},
    {"capacity_probs",             2, 512,  8,   2, 0,  0,  0, 0, 0.0f,  0,   0,  1.0,   0,  0,  0},
    {"capacity_probs_pad",         2, 512,  8,   2, 0,  0,  0, 0, 0.0f,  0,   0,  1.0,   0,  1,  0},
    {"capacity_probs_pad_grid",    4, 64,   16,  4, 0,  0,  0, 0, 0.0f,  0,   0,  0.5,   0,  1,  1},
    {"capacity_position",          2, 256,  16,  4, 0,  0,  0, 0, 0.0f,  0,   0,  1.0,   1,  0,  0},
    {"capacity_position_pad_pre",  2, 32,   8,   2, 0,  1,  0, 0, 0.0f,  0,   0,  1.0,   1,  1,  0},
    {"capacity_probs_bf16_pad",    4, 256,  16,  2, 1,  0,  0, 0, 0.0f,  1,   1,  0.75,  0,  1,  0},
    {"capacity_e128_position",     4, 2048, 128, 8, 0,  0,  0, 0, 0.0f,  0,   0,  1.25,  1,  0,  0},
    {"capacity_at_least_N",        2, 64,   8,   2, 0,  0,  0, 0, 0.0f,  0,   0,  -1.0,  0,  0,  0},
};

static test_result test_moe_routing(void) {
    REQUIRE_GPU();
    kt_ctx k_;
    if (!kt_ctx_init(&k_)) return TEST_FAIL;
    int ok = 1;
    for (int i = 0; i < (int)(sizeof(mr_cases) / sizeof(mr_cases[0])); i++) ok &= mr_run_case(&k_, mr_cases[i], i);
    kt_ctx_free(&k_);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* ============================================================================================== */
/* GPU: the templated kernels, in fp32, bf16 and fp16                                                */
/* ============================================================================================== */

/* A reference routing to permute with: rows from tokens with several experts, none (dropped), or
 * padded ones. */
static bool mr_routing_for(const mr_case& c, int seed, mr_ref* ref) {
    std::vector<float> logits, bias;
    std::vector<double> lv;
    return mr_make_inputs(c, mr_routing(c), kt_seed(60, seed, c.E, c.k), logits, bias, lv, ref);
}

typedef struct {
    mr_case routing;
    int h;
    int misalign; /* offset the data by one element: the scalar path */
} mp_shape;

/* Tolerance of a combine: an fp32 sum of count + 1 terms, rounded once to T: 2 u_s relative, and
 * 2 (count + 3) u_c times the sum of |terms|. */
template <typename T>
static int mp_permute_case(kt_ctx* k, kt_cover* cov, const mp_shape& s, int index) {
    mr_ref ref;
    if (!mr_routing_for(s.routing, index, &ref)) return 0;
    const moe_routing r = mr_routing(s.routing);
    const int N = r.N, E = s.routing.E, h = s.h, R = ref.counts[2 * E];
    constexpr int V = vec16<T>::N;
    kt_report rep;
    kt_report_begin(&rep, "moe_permute / moe_unpermute<%s> N %d E %d R %d h %d%s", kt_fmt<T>::name, N, E, R, h,
                    s.misalign ? " misaligned" : "");
    kt_rng rng = {kt_seed(61, index, h, (int)sizeof(T))};
    kt_host<T> x, rows, shared, init;
    x.fill((int64_t)N * h, &rng, 0.01, 2.0);
    rows.fill((int64_t)R * h, &rng, 0.01, 2.0);
    shared.fill((int64_t)N * h, &rng, 0.01, 2.0);
    init.fill((int64_t)N * h, &rng, 0.01, 2.0);
    std::vector<float> gate((size_t)N);
    for (int i = 0; i < N; i++) gate[i] = (float)(0.05 + 0.9 * kt_uniform(&rng));
    T* dx = kt_alloc<T>(k, (int64_t)N * h, s.misalign);
    T* dperm = kt_alloc<T>(k, (int64_t)R * h + 1, s.misalign);
    T* drows = kt_alloc<T>(k, (int64_t)R * h + 1, s.misalign);
    T* dshared = kt_alloc<T>(k, (int64_t)N * h, s.misalign);
    T* dout = kt_alloc<T>(k, (int64_t)N * h, s.misalign);
    float* dgate = kt_alloc<float>(k, N);
    int32_t* dtoken = kt_alloc<int32_t>(k, R + 1);
    int32_t* drow_of = kt_alloc<int32_t>(k, (int64_t)N * E);
    KT_ALLOCATED(k);
    std::vector<int32_t> tok(ref.token_of.begin(), ref.token_of.end()), rof(ref.row_of.begin(), ref.row_of.end());
    KT_CUDA(kt_put(k, dx, x.h));
    KT_CUDA(kt_put(k, drows, rows.h));
    KT_CUDA(kt_put(k, dshared, shared.h));
    KT_CUDA(kt_put(k, dgate, gate));
    KT_CUDA(kt_put(k, dtoken, tok));
    KT_CUDA(kt_put(k, drow_of, rof));
    /* the launchers' predicates */
    const bool vec = h % V == 0 && aligned16(dperm) && aligned16(dx);
    kt_cover_hit(cov, vec ? "permute vec" : "permute scalar");
    kt_cover_hit(cov, h >= 1024 ? "unpermute 256" : "unpermute 128");
    /* gather: bitwise */
    KT_CUDA(kt_poison(k, dperm, (int64_t)R * h));
    moe_permute<T>(kt_exec(k, 0), dperm, dx, dtoken, R, h);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> perm;
    KT_CUDA(kt_get(k, perm, dperm, (int64_t)R * h));
    for (int p = 0; p < R; p++)
        if (memcmp(&perm[(size_t)p * h], &x.h[(size_t)ref.token_of[p] * h], (size_t)h * sizeof(T))) {
            printf("    FAIL %s: permuted row %d is not token row %d\n", rep.label, p, ref.token_of[p]);
            rep.ok = 0;
            break;
        }
    /* combine: (no shared, overwrite), (gated shared, overwrite), (shared without gate, accumulate) */
    for (int variant = 0; variant < 3; variant++) {
        if (variant == 2) KT_CUDA(kt_put(k, dout, init.h));
        else KT_CUDA(kt_poison(k, dout, (int64_t)N * h));
        moe_unpermute<T>(kt_exec(k, 0), dout, drows, drow_of, variant ? dshared : NULL, variant == 1 ? dgate : NULL, N, E,
                         h, variant == 2);
        if (!kt_sync(k, rep.label)) return 0;
        std::vector<T> out;
        KT_CUDA(kt_get(k, out, dout, (int64_t)N * h));
        kt_check co;
        static const char* names[3] = {"combine", "combine+gated shared", "combine+shared, accumulate"};
        kt_check_begin(&co, names[variant], h, 2 * kt_fmt<T>::u, -1.0, kt_fmt<T>::tiny);
        for (int row = 0; row < N; row++) {
            int count = 0;
            for (int e = 0; e < E; e++) count += ref.row_of[(size_t)row * E + e] >= 0;
            for (int c = 0; c < h; c++) {
                double want = 0.0, mag = 0.0;
                for (int e = 0; e < E; e++) {
                    const int p = ref.row_of[(size_t)row * E + e];
                    if (p < 0) continue;
                    want += rows.v[(size_t)p * h + c];
                    mag += fabs(rows.v[(size_t)p * h + c]);
                }
                if (variant) {
                    const double g = variant == 1 ? (double)gate[row] : 1.0, sh = shared.v[(size_t)row * h + c];
                    want += g * sh;
                    mag += fabs(g * sh);
                }
                if (variant == 2) {
                    want += init.v[(size_t)row * h + c];
                    mag += fabs(init.v[(size_t)row * h + c]);
                }
                kt_check_add(&co, (int64_t)row * h + c, kt_to<T>(out[(size_t)row * h + c]), want,
                             2.0 * (count + 3) * KT_UC * mag);
            }
        }
        kt_check_end(&co, &rep);
    }
    kt_release(k);
    return kt_report_end(&rep);
}

static const mp_shape mp_shapes[] = {
    /* padded: exactly C rows per expert, tokens with many rows */
    {{"pad", 2, 32, 8, 2, 0, 0, 0, 0, 0.0f, 0, 0, 1.0, 0, 1, 0}, 64, 0},
    /* dropping: tokens with no row (combine writes 0, or the shared expert alone) */
    {{"drop", 1, 100, 16, 4, 0, 0, 0, 0, 0.0f, 0, 0, 0.5, 0, 0, 0}, 37, 0},
    /* dropless, many experts, a wide row */
    {{"dropless", 4, 64, 128, 8, 0, 0, 0, 0, 0.0f, 0, 0, 0.0, 0, 0, 0}, 1024, 0},
    /* 16-byte rows but misaligned data: the scalar gather */
    {{"misaligned", 2, 48, 8, 2, 0, 0, 0, 0, 0.0f, 0, 0, 0.0, 0, 0, 0}, 128, 1},
};

template <typename T>
static int mp_permute_all(kt_ctx* k) {
    static const char* variants[] = {"permute vec", "permute scalar", "unpermute 128", "unpermute 256"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 4);
    int ok = 1;
    for (int i = 0; i < (int)(sizeof(mp_shapes) / sizeof(mp_shapes[0])); i++) ok &= mp_permute_case<T>(k, &cov, mp_shapes[i], i);
    return kt_cover_check(&cov, "moe_permute / moe_unpermute", kt_fmt<T>::name) && ok;
}
static test_result test_moe_permute_unpermute(void) { KT_FOR_TYPES(mp_permute_all); }

/* SwiGLU times the row's probability, and its backward. act: silu(gate) up p in fp32 (expf within 2
 * ulp, a division and two products: 8 u_c), rounded once (2 u_s); dz likewise (10 u_c; dz_gate with
 * the absolute bound of test_kernels.h's SwiGLU near silu's minimum, where its factor cancels); dp a sum of
 * fe products, each thread's columns in order then block_sum's tree: 2 (fe / threads + 14) u_c times
 * the sum of |terms|. dprobs: only (token, expert) of each row is written, the rest keeps its values. */
template <typename T>
static int ms_case(kt_ctx* k, kt_cover* cov, const mr_case& rc, int fe, int index) {
    mr_ref ref;
    if (!mr_routing_for(rc, 100 + index, &ref)) return 0;
    const moe_routing r = mr_routing(rc);
    const int N = r.N, E = rc.E, R = ref.counts[2 * E];
    kt_report rep;
    kt_report_begin(&rep, "moe_swiglu_prob(+backward)<%s> R %d fe %d E %d", kt_fmt<T>::name, R, fe, E);
    kt_rng rng = {kt_seed(62, index, fe, (int)sizeof(T))};
    kt_host<T> z, dact;
    z.fill((int64_t)R * 2 * fe, &rng, 0.05, 3.0);
    dact.fill((int64_t)R * fe, &rng, 0.05, 1.0);
    std::vector<float> prob(ref.row_prob.begin(), ref.row_prob.end()); /* 0 on padded rows */
    std::vector<float> dprobs0((size_t)N * E);
    for (auto& v : dprobs0) v = kt_signed(&rng, 0.5, 1.0);
    T* dz = kt_alloc<T>(k, (int64_t)R * 2 * fe);
    T* dact_d = kt_alloc<T>(k, (int64_t)R * fe);
    T* dact_out = kt_alloc<T>(k, (int64_t)R * fe);
    T* ddz = kt_alloc<T>(k, (int64_t)R * 2 * fe);
    float* dprob = kt_alloc<float>(k, R + 1);
    float* ddprobs = kt_alloc<float>(k, (int64_t)N * E);
    int32_t* dtoken = kt_alloc<int32_t>(k, R + 1);
    int32_t* dcounts = kt_alloc<int32_t>(k, 2 * E + 1);
    KT_ALLOCATED(k);
    std::vector<int32_t> tok(ref.token_of.begin(), ref.token_of.end()), cnt(ref.counts.begin(), ref.counts.end());
    KT_CUDA(kt_put(k, dz, z.h));
    KT_CUDA(kt_put(k, dact_d, dact.h));
    KT_CUDA(kt_put(k, dprob, prob));
    KT_CUDA(kt_put(k, ddprobs, dprobs0));
    KT_CUDA(kt_put(k, dtoken, tok));
    KT_CUDA(kt_put(k, dcounts, cnt));
    KT_CUDA(kt_poison(k, dact_out, (int64_t)R * fe));
    KT_CUDA(kt_poison(k, ddz, (int64_t)R * 2 * fe));
    kt_cover_hit(cov, fe >= 512 ? "backward 256" : fe >= 128 ? "backward 128" : "backward 32");
    moe_swiglu_prob<T>(kt_exec(k, 0), dact_out, dz, dprob, R, fe);
    moe_swiglu_prob_backward<T>(kt_exec(k, 0), ddz, ddprobs, dact_d, dz, dprob, dtoken, dcounts + E, R, fe, E);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> act, gz;
    std::vector<float> gdp;
    KT_CUDA(kt_get(k, act, dact_out, (int64_t)R * fe));
    KT_CUDA(kt_get(k, gz, ddz, (int64_t)R * 2 * fe));
    KT_CUDA(kt_get(k, gdp, ddprobs, (int64_t)N * E));
    const double us = kt_fmt<T>::u, tiny = kt_fmt<T>::tiny;
    kt_check ca, cz, cp;
    kt_check_begin(&ca, "act", fe, 2 * us, -1.0, tiny);
    kt_check_begin(&cz, "dz", 2 * fe, 2 * us, -1.0, tiny);
    kt_check_begin(&cp, "dprobs", E, 0.0, -1.0, 0.0);
    const int threads = fe >= 512 ? 256 : fe >= 128 ? 128 : 32;
    std::vector<int> written((size_t)N * E, 0);
    for (int p = 0; p < R; p++) {
        int e = 0;
        while (e + 1 < E && ref.counts[E + e + 1] <= p) e++;
        const double pr = prob[p];
        double dpv = 0.0, mag = 0.0;
        for (int c = 0; c < fe; c++) {
            const double g = z.v[(size_t)p * 2 * fe + c], u = z.v[(size_t)p * 2 * fe + fe + c], d = dact.v[(size_t)p * fe + c];
            const double sg = 1.0 / (1.0 + exp(-g)), silu = g * sg;
            const double a = silu * u * pr;
            kt_check_add(&ca, (int64_t)p * fe + c, kt_to<T>(act[(size_t)p * fe + c]), a, 2 * 8 * KT_UC * fabs(a));
            const double dg = d * pr * u * sg * (1 + g * (1 - sg)), du = d * pr * silu;
            /* dz_gate's last factor cancels near g = -1.28: an absolute bound there (test_kernels.h's) */
            const double e_dg = fabs(d * pr * u * sg) * (fabs(g) * (4 * KT_UC * sg + 3 * KT_UC) + KT_UC * (1 + fabs(g * (1 - sg)))) +
                                10 * KT_UC * fabs(dg);
            kt_check_add(&cz, (int64_t)p * 2 * fe + c, kt_to<T>(gz[(size_t)p * 2 * fe + c]), dg, 2 * e_dg);
            kt_check_add(&cz, (int64_t)p * 2 * fe + fe + c, kt_to<T>(gz[(size_t)p * 2 * fe + fe + c]), du,
                         2 * 10 * KT_UC * fabs(du));
            dpv += silu * u * d;
            mag += fabs(silu * u * d);
        }
        const size_t at = (size_t)ref.token_of[p] * E + e;
        written[at] = 1;
        kt_check_add(&cp, p, gdp[at], dpv, 2 * ((double)fe / threads + 14) * KT_UC * mag);
    }
    for (size_t i = 0; i < written.size(); i++)
        if (!written[i] && memcmp(&gdp[i], &dprobs0[i], sizeof(float))) {
            printf("    FAIL %s: dprobs[%zu] (no permuted row) changed: %.9g, was %.9g\n", rep.label, i, gdp[i], dprobs0[i]);
            rep.ok = 0;
            break;
        }
    kt_check_end(&ca, &rep);
    kt_check_end(&cz, &rep);
    kt_check_end(&cp, &rep);
    kt_release(k);
    return kt_report_end(&rep);
}

template <typename T>
static int ms_all(kt_ctx* k) {
    static const char* variants[] = {"backward 32", "backward 128", "backward 256"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 3);
    const mr_case pad = {"pad", 2, 32, 8, 2, 0, 0, 0, 0, 0.0f, 0, 0, 1.0, 0, 1, 0};
    const mr_case dropless = {"dropless", 2, 64, 16, 4, 0, 0, 0, 0, 0.0f, 0, 0, 0.0, 0, 0, 0};
    int ok = ms_case<T>(k, &cov, pad, 48, 0);
    ok &= ms_case<T>(k, &cov, dropless, 200, 1);
    ok &= ms_case<T>(k, &cov, pad, 512, 2);
    return kt_cover_check(&cov, "moe_swiglu_prob_backward", kt_fmt<T>::name) && ok;
}
static test_result test_moe_swiglu_prob(void) { KT_FOR_TYPES(ms_all); }

/* GELU experts and the experts' biases (issue #34): moe_act_prob's GELU times the probability and its
 * backward, whose probability gradient takes the fc2 bias's term dy . b2 of the row's expert; moe_rows_bias
 * (fc1's bias; fc2's times the probability), moe_rows_bias_grad (each expert's rows summed, plain and times
 * the probability; written, then accumulated) and moe_router_bias, against double references. Bounds: the
 * fp32 GELU and its derivative within tests/test_kernels.h's kt_gelu_bounds (absolute: 1 + tanh cancels),
 * times the probability, plus one rounding to T (2 u_s); dp a sum of fe + h products, each thread's in order
 * then block_sum's tree: 2 ((fe + h) / threads + 14) u_c of the sum of |terms| plus the GELU's own error per
 * term; a bias add one fp32 add and product rounded to T; a bias gradient a serial sum over the expert's n
 * rows: 2 (n + 2) u_c of its |terms|; the router bias one fp32 add. dprobs off the rows keeps its values. */
template <typename T>
static int mgb_case(kt_ctx* k, const mr_case& rc, int fe, int h, int index) {
    mr_ref ref;
    if (!mr_routing_for(rc, 200 + index, &ref)) return 0;
    const moe_routing r = mr_routing(rc);
    const int N = r.N, E = rc.E, R = ref.counts[2 * E];
    kt_report rep;
    kt_report_begin(&rep, "moe GELU x probability, expert and router biases<%s> R %d fe %d h %d E %d", kt_fmt<T>::name,
                    R, fe, h, E);
    kt_rng rng = {kt_seed(63, index, fe, (int)sizeof(T))};
    kt_host<T> z, dact, dy, b1, b2, y0, rb;
    z.fill((int64_t)R * fe, &rng, 0.05, 3.0);
    dact.fill((int64_t)R * fe, &rng, 0.05, 1.0);
    dy.fill((int64_t)R * h, &rng, 0.05, 1.0);
    b1.fill((int64_t)E * fe, &rng, 0.05, 1.0);
    b2.fill((int64_t)E * h, &rng, 0.05, 1.0);
    y0.fill((int64_t)R * h, &rng, 0.05, 1.0);
    rb.fill(E, &rng, 0.05, 1.0);
    std::vector<float> prob(ref.row_prob.begin(), ref.row_prob.end()); /* 0 on padded rows */
    std::vector<float> dprobs0((size_t)N * E), logits0((size_t)N * E);
    for (auto& v : dprobs0) v = kt_signed(&rng, 0.5, 1.0);
    for (auto& v : logits0) v = kt_signed(&rng, 0.05, 2.0);
    T* dz = kt_alloc<T>(k, (int64_t)R * fe);
    T* dzb = kt_alloc<T>(k, (int64_t)R * fe);
    T* dact_d = kt_alloc<T>(k, (int64_t)R * fe);
    T* dact_out = kt_alloc<T>(k, (int64_t)R * fe);
    T* ddz = kt_alloc<T>(k, (int64_t)R * fe);
    T* ddy = kt_alloc<T>(k, (int64_t)R * h);
    T* dy0 = kt_alloc<T>(k, (int64_t)R * h);
    T* db1 = kt_alloc<T>(k, (int64_t)E * fe);
    T* db2 = kt_alloc<T>(k, (int64_t)E * h);
    T* drb = kt_alloc<T>(k, E);
    float* dprob = kt_alloc<float>(k, R + 1);
    float* ddprobs = kt_alloc<float>(k, (int64_t)N * E);
    float* dlogits = kt_alloc<float>(k, (int64_t)N * E);
    float* gb1 = kt_alloc<float>(k, (int64_t)E * fe);
    float* gb2 = kt_alloc<float>(k, (int64_t)E * h);
    int32_t* dtoken = kt_alloc<int32_t>(k, R + 1);
    int32_t* dcounts = kt_alloc<int32_t>(k, 2 * E + 1);
    KT_ALLOCATED(k);
    std::vector<int32_t> tok(ref.token_of.begin(), ref.token_of.end()), cnt(ref.counts.begin(), ref.counts.end());
    KT_CUDA(kt_put(k, dz, z.h));
    KT_CUDA(kt_put(k, dzb, z.h));
    KT_CUDA(kt_put(k, dact_d, dact.h));
    KT_CUDA(kt_put(k, ddy, dy.h));
    KT_CUDA(kt_put(k, dy0, y0.h));
    KT_CUDA(kt_put(k, db1, b1.h));
    KT_CUDA(kt_put(k, db2, b2.h));
    KT_CUDA(kt_put(k, drb, rb.h));
    KT_CUDA(kt_put(k, dprob, prob));
    KT_CUDA(kt_put(k, ddprobs, dprobs0));
    KT_CUDA(kt_put(k, dlogits, logits0));
    KT_CUDA(kt_put(k, dtoken, tok));
    KT_CUDA(kt_put(k, dcounts, cnt));
    KT_CUDA(kt_poison(k, dact_out, (int64_t)R * fe));
    KT_CUDA(kt_poison(k, ddz, (int64_t)R * fe));
    KT_CUDA(kt_poison(k, gb1, (int64_t)E * fe));
    KT_CUDA(kt_poison(k, gb2, (int64_t)E * h));
    const mt_exec* ex = kt_exec(k, 0);
    const int32_t* offsets = dcounts + E;
    moe_act_prob<T>(ex, dact_out, dz, dprob, R, fe, ACT_GELU);
    moe_act_prob_backward<T>(ex, ddz, ddprobs, dact_d, dz, dprob, dtoken, offsets, R, fe, E, ACT_GELU, ddy, db2, h);
    moe_rows_bias<T>(ex, dzb, db1, (const float*)NULL, offsets, R, fe, E);
    moe_rows_bias<T>(ex, dy0, db2, dprob, offsets, R, h, E);
    moe_rows_bias_grad<T>(ex, gb1, dz, (const float*)NULL, offsets, fe, E, false);
    moe_rows_bias_grad<T>(ex, gb2, ddy, dprob, offsets, h, E, false);
    moe_rows_bias_grad<T>(ex, gb2, ddy, dprob, offsets, h, E, true); /* accumulated: twice the sums */
    moe_router_bias<T>(ex, dlogits, drb, N, E);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> act, gz, zb, yb;
    std::vector<float> gdp, g1, g2, lg;
    KT_CUDA(kt_get(k, act, dact_out, (int64_t)R * fe));
    KT_CUDA(kt_get(k, gz, ddz, (int64_t)R * fe));
    KT_CUDA(kt_get(k, zb, dzb, (int64_t)R * fe));
    KT_CUDA(kt_get(k, yb, dy0, (int64_t)R * h));
    KT_CUDA(kt_get(k, gdp, ddprobs, (int64_t)N * E));
    KT_CUDA(kt_get(k, g1, gb1, (int64_t)E * fe));
    KT_CUDA(kt_get(k, g2, gb2, (int64_t)E * h));
    KT_CUDA(kt_get(k, lg, dlogits, (int64_t)N * E));
    const double us = kt_fmt<T>::u, tiny = kt_fmt<T>::tiny, uc = KT_UC;
    const int threads = fe >= 512 ? 256 : fe >= 128 ? 128 : 32;
    kt_check ca, cz, cp, c1, c2, cg1, cg2, cl;
    kt_check_begin(&ca, "act", fe, 2 * us, -1.0, tiny);
    kt_check_begin(&cz, "dz", fe, 2 * us, -1.0, tiny);
    kt_check_begin(&cp, "dprobs", E, 0.0, -1.0, 0.0);
    kt_check_begin(&c1, "fc1 + b1", fe, 2 * us, -1.0, tiny);
    kt_check_begin(&c2, "y + p b2", h, 2 * us, -1.0, tiny);
    kt_check_begin(&cg1, "db1", fe, 0.0, -1.0, 0.0);
    kt_check_begin(&cg2, "db2 (accumulated)", h, 0.0, -1.0, 0.0);
    kt_check_begin(&cl, "logits + b", E, 0.0, -1.0, 0.0);
    std::vector<int> written((size_t)N * E, 0);
    std::vector<double> s1((size_t)E * fe, 0.0), m1((size_t)E * fe, 0.0), s2((size_t)E * h, 0.0), m2((size_t)E * h, 0.0);
    for (int p = 0; p < R; p++) {
        int e = 0;
        while (e + 1 < E && ref.counts[E + e + 1] <= p) e++;
        const double pr = prob[p];
        double dpv = 0.0, mag = 0.0, eval = 0.0;
        for (int c = 0; c < fe; c++) {
            const size_t i = (size_t)p * fe + c;
            const double x = z.v[i], d = dact.v[i];
            double e_gelu, e_grad;
            kt_gelu_bounds(x, &e_gelu, &e_grad);
            const double a = kt_gelu(x) * pr;
            kt_check_add(&ca, (int64_t)i, kt_to<T>(act[i]), a, 2 * (e_gelu * fabs(pr) + uc * fabs(a)));
            const double g = d * pr * kt_gelu_grad(x);
            kt_check_add(&cz, (int64_t)i, kt_to<T>(gz[i]), g, 2 * (e_grad * fabs(d * pr) + 2 * uc * fabs(g)));
            dpv += kt_gelu(x) * d;
            mag += fabs(kt_gelu(x) * d);
            eval += e_gelu * fabs(d);
            const double zb_ref = x + b1.v[(size_t)e * fe + c];
            kt_check_add(&c1, (int64_t)i, kt_to<T>(zb[i]), zb_ref, 2 * uc * (fabs(x) + fabs(b1.v[(size_t)e * fe + c])));
            s1[(size_t)e * fe + c] += x;
            m1[(size_t)e * fe + c] += fabs(x);
        }
        for (int j = 0; j < h; j++) {
            const size_t i = (size_t)p * h + j;
            const double b = b2.v[(size_t)e * h + j];
            dpv += dy.v[i] * b;
            mag += fabs(dy.v[i] * b);
            const double y_ref = y0.v[i] + b * pr;
            kt_check_add(&c2, (int64_t)i, kt_to<T>(yb[i]), y_ref, 2 * uc * (fabs(y0.v[i]) + 2 * fabs(b * pr)));
            s2[(size_t)e * h + j] += dy.v[i] * pr;
            m2[(size_t)e * h + j] += fabs(dy.v[i] * pr);
        }
        const size_t at = (size_t)ref.token_of[p] * E + e;
        written[at] = 1;
        kt_check_add(&cp, p, gdp[at], dpv, 2 * ((double)(fe + h) / threads + 14) * uc * mag + 2 * eval);
    }
    for (int e = 0; e < E; e++) {
        const double n = ref.counts[e];
        for (int c = 0; c < fe; c++)
            kt_check_add(&cg1, (int64_t)e * fe + c, g1[(size_t)e * fe + c], s1[(size_t)e * fe + c],
                         2 * (n + 2) * uc * m1[(size_t)e * fe + c]);
        for (int j = 0; j < h; j++)
            kt_check_add(&cg2, (int64_t)e * h + j, g2[(size_t)e * h + j], 2 * s2[(size_t)e * h + j],
                         4 * (n + 3) * uc * m2[(size_t)e * h + j]);
    }
    for (int64_t i = 0; i < (int64_t)N * E; i++) {
        const double want = (double)logits0[(size_t)i] + rb.v[(size_t)(i % E)];
        kt_check_add(&cl, i, lg[(size_t)i], want, uc * fabs(want));
    }
    for (size_t i = 0; i < written.size(); i++)
        if (!written[i] && memcmp(&gdp[i], &dprobs0[i], sizeof(float))) {
            printf("    FAIL %s: dprobs[%zu] (no permuted row) changed: %.9g, was %.9g\n", rep.label, i, gdp[i], dprobs0[i]);
            rep.ok = 0;
            break;
        }
    kt_check_end(&ca, &rep);
    kt_check_end(&cz, &rep);
    kt_check_end(&cp, &rep);
    kt_check_end(&c1, &rep);
    kt_check_end(&c2, &rep);
    kt_check_end(&cg1, &rep);
    kt_check_end(&cg2, &rep);
    kt_check_end(&cl, &rep);
    kt_release(k);
    return kt_report_end(&rep);
}

template <typename T>
static int mgb_all(kt_ctx* k) {
    const mr_case pad = {"pad", 2, 32, 8, 2, 0, 0, 0, 0, 0.0f, 0, 0, 1.0, 0, 1, 0};
    const mr_case dropless = {"dropless", 2, 64, 16, 4, 0, 0, 0, 0, 0.0f, 0, 0, 0.0, 0, 0, 0};
    int ok = mgb_case<T>(k, pad, 48, 64, 0);
    ok &= mgb_case<T>(k, dropless, 200, 96, 1);
    ok &= mgb_case<T>(k, pad, 512, 32, 2);
    return ok;
}
static test_result test_moe_gelu_biases(void) { KT_FOR_TYPES(mgb_all); }

/* The shared expert's gate. Forward: a dot of h products (lanes: h/32 in order, then 5 levels):
 * 2 (h/32 + 6) u_c sum|x w|, times sigmoid's slope <= 1/4, plus 4 u_c. Backward: dgate_logit from a
 * dot in a block (h / threads + 8 + 4 levels, times g (1 - g)); dshared one product rounded to T;
 * dx = dx0 + dgl w with the kernel's own dgl (checked above), one fma-like update rounded to T; dw a
 * column sum of N products (32 groups of N/32 in order, then the 32): 2 (N/32 + 34) u_c sum|terms|. */
template <typename T>
static int mg_case(kt_ctx* k, kt_cover* cov, int N, int h, int accumulate, int index) {
    kt_report rep;
    kt_report_begin(&rep, "moe_gate_forward/backward<%s> N %d h %d%s", kt_fmt<T>::name, N, h, accumulate ? " accumulate" : "");
    kt_rng rng = {kt_seed(63, N, h, (int)sizeof(T) * 2 + accumulate)};
    const double amp = 2.0 / sqrt((double)h);
    kt_host<T> x, w, dout, shared, dx0;
    x.fill((int64_t)N * h, &rng, 0.01, 1.0);
    w.fill(h, &rng, 0.01 * amp, amp);
    dout.fill((int64_t)N * h, &rng, 0.01, 1.0);
    shared.fill((int64_t)N * h, &rng, 0.01, 1.0);
    dx0.fill((int64_t)N * h, &rng, 0.01, 1.0);
    std::vector<float> dw0((size_t)h);
    for (auto& v : dw0) v = kt_signed(&rng, 0.1, 1.0);
    T* d_x = kt_alloc<T>(k, (int64_t)N * h);
    T* d_w = kt_alloc<T>(k, h);
    T* d_dout = kt_alloc<T>(k, (int64_t)N * h);
    T* d_shared = kt_alloc<T>(k, (int64_t)N * h);
    T* d_dshared = kt_alloc<T>(k, (int64_t)N * h);
    T* d_dx = kt_alloc<T>(k, (int64_t)N * h);
    float* d_gate = kt_alloc<float>(k, N);
    float* d_dgl = kt_alloc<float>(k, N);
    float* d_dw = kt_alloc<float>(k, h);
    KT_ALLOCATED(k);
    KT_CUDA(kt_put(k, d_x, x.h));
    KT_CUDA(kt_put(k, d_w, w.h));
    KT_CUDA(kt_put(k, d_dout, dout.h));
    KT_CUDA(kt_put(k, d_shared, shared.h));
    KT_CUDA(kt_put(k, d_dx, dx0.h));
    if (accumulate) KT_CUDA(kt_put(k, d_dw, dw0));
    else KT_CUDA(kt_poison(k, d_dw, h));
    KT_CUDA(kt_poison(k, d_gate, N));
    KT_CUDA(kt_poison(k, d_dgl, N));
    KT_CUDA(kt_poison(k, d_dshared, (int64_t)N * h));
    kt_cover_hit(cov, h >= 1024 ? "rows 256" : "rows 128");
    moe_gate_forward<T>(kt_exec(k, 0), d_gate, d_x, d_w, N, h);
    moe_gate_backward<T>(kt_exec(k, 0), d_dshared, d_dgl, d_dw, d_dx, d_dout, d_shared, d_gate, d_x, d_w, N, h,
                         accumulate != 0);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> gate, dgl, dw;
    std::vector<T> dshared, dx;
    KT_CUDA(kt_get(k, gate, d_gate, N));
    KT_CUDA(kt_get(k, dgl, d_dgl, N));
    KT_CUDA(kt_get(k, dw, d_dw, h));
    KT_CUDA(kt_get(k, dshared, d_dshared, (int64_t)N * h));
    KT_CUDA(kt_get(k, dx, d_dx, (int64_t)N * h));
    const double us = kt_fmt<T>::u, tiny = kt_fmt<T>::tiny;
    const int threads = h >= 1024 ? 256 : 128;
    kt_check cg, cl, cs, cx, cw;
    kt_check_begin(&cg, "gate", 0, 0.0, -1.0, 0.0);
    kt_check_begin(&cl, "dgate_logit", 0, 0.0, -1.0, 1e-30);
    kt_check_begin(&cs, "dshared", h, 2 * us, -1.0, tiny);
    kt_check_begin(&cx, "dx", h, 2 * us, -1.0, tiny);
    kt_check_begin(&cw, "dw", 0, 0.0, -1.0, 1e-30);
    for (int r = 0; r < N; r++) {
        double d = 0.0, mag = 0.0, o = 0.0, omag = 0.0;
        for (int c = 0; c < h; c++) {
            d += x.v[(size_t)r * h + c] * w.v[c];
            mag += fabs(x.v[(size_t)r * h + c] * w.v[c]);
            o += dout.v[(size_t)r * h + c] * shared.v[(size_t)r * h + c];
            omag += fabs(dout.v[(size_t)r * h + c] * shared.v[(size_t)r * h + c]);
        }
        const double g = 1.0 / (1.0 + exp(-d));
        kt_check_add(&cg, r, gate[r], g, 0.25 * 2 * (h / 32.0 + 6) * KT_UC * mag + 4 * KT_UC);
        const double gk = gate[r], want = gk * (1 - gk) * o; /* from the kernel's own gate */
        kt_check_add(&cl, r, dgl[r], want, 2 * ((double)h / threads + 12) * KT_UC * gk * (1 - gk) * omag + 4 * KT_UC * fabs(want));
        for (int c = 0; c < h; c++) {
            const size_t i = (size_t)r * h + c;
            const double ds = gk * dout.v[i];
            kt_check_add(&cs, (int64_t)i, kt_to<T>(dshared[i]), ds, 4 * KT_UC * fabs(ds));
            const double xv = dx0.v[i] + (double)dgl[r] * w.v[c];
            kt_check_add(&cx, (int64_t)i, kt_to<T>(dx[i]), xv, 2 * 3 * KT_UC * (fabs(dx0.v[i]) + fabs((double)dgl[r] * w.v[c])));
        }
    }
    for (int c = 0; c < h; c++) {
        double s = accumulate ? (double)dw0[c] : 0.0, mag = fabs(s);
        for (int r = 0; r < N; r++) {
            s += (double)dgl[r] * x.v[(size_t)r * h + c];
            mag += fabs((double)dgl[r] * x.v[(size_t)r * h + c]);
        }
        kt_check_add(&cw, c, dw[c], s, 2 * (N / 32.0 + 34) * KT_UC * mag);
    }
    kt_check_end(&cg, &rep);
    kt_check_end(&cl, &rep);
    kt_check_end(&cs, &rep);
    kt_check_end(&cx, &rep);
    kt_check_end(&cw, &rep);
    (void)index;
    kt_release(k);
    return kt_report_end(&rep);
}

template <typename T>
static int mg_all(kt_ctx* k) {
    static const char* variants[] = {"rows 128", "rows 256"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    int ok = mg_case<T>(k, &cov, 64, 64, 0, 0);
    ok &= mg_case<T>(k, &cov, 300, 1000, 1, 1);
    ok &= mg_case<T>(k, &cov, 128, 2048, 0, 2);
    return kt_cover_check(&cov, "moe_gate_backward", kt_fmt<T>::name) && ok;
}
static test_result test_moe_shared_gate(void) { KT_FOR_TYPES(mg_all); }

/* The router's casts: bitwise (one fp32 add, or none, then the same rounding as the host's). */
template <typename T>
static int mc_all(kt_ctx* k) {
    const int64_t n = 4099;
    kt_report rep;
    kt_report_begin(&rep, "moe_add_f32 / moe_to_f32<%s> n %lld", kt_fmt<T>::name, (long long)n);
    kt_rng rng = {kt_seed(64, (int)sizeof(T), 0, 0)};
    kt_host<T> dst0;
    dst0.fill(n, &rng, 0.01, 3.0);
    std::vector<float> src((size_t)n);
    for (auto& v : src) v = kt_signed(&rng, 0.01, 3.0);
    T* d_dst = kt_alloc<T>(k, n);
    float* d_src = kt_alloc<float>(k, n);
    float* d_f = kt_alloc<float>(k, n);
    KT_ALLOCATED(k);
    KT_CUDA(kt_put(k, d_src, src));
    for (int acc = 0; acc < 2; acc++) {
        if (acc) KT_CUDA(kt_put(k, d_dst, dst0.h));
        else KT_CUDA(kt_poison(k, d_dst, n));
        moe_add_f32<T>(kt_exec(k, 0), d_dst, d_src, n, acc != 0);
        if (!kt_sync(k, rep.label)) return 0;
        std::vector<T> got;
        KT_CUDA(kt_get(k, got, d_dst, n));
        for (int64_t i = 0; i < n; i++) {
            const T want = kt_from<T>(acc ? kt_to<T>(dst0.h[i]) + src[i] : src[i]);
            if (memcmp(&want, &got[i], sizeof(T))) {
                printf("    FAIL %s: moe_add_f32 (accumulate %d)[%lld] = %.9g, expected %.9g\n", rep.label, acc, (long long)i,
                       kt_to<T>(got[i]), kt_to<T>(want));
                rep.ok = 0;
                break;
            }
        }
    }
    KT_CUDA(kt_put(k, d_dst, dst0.h));
    KT_CUDA(kt_poison(k, d_f, n));
    moe_to_f32<T>(kt_exec(k, 0), d_f, d_dst, n);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> f;
    KT_CUDA(kt_get(k, f, d_f, n));
    for (int64_t i = 0; i < n; i++)
        if (f[i] != (float)dst0.v[i]) {
            printf("    FAIL %s: moe_to_f32[%lld] = %.9g, expected %.9g\n", rep.label, (long long)i, f[i], dst0.v[i]);
            rep.ok = 0;
            break;
        }
    size_t len = strlen(rep.line);
    snprintf(rep.line + len, sizeof(rep.line) - len, " bitwise %s", rep.ok ? "equal" : "DIFFERENT");
    kt_release(k);
    return kt_report_end(&rep);
}
static test_result test_moe_casts(void) { KT_FOR_TYPES(mc_all); }

/* ---- The experts' GEMMs by their three paths (megatron.cu section 17, moe_experts_gemm) ---- */

/* MT_MOE_GEMM's parsing (the three names and unset; anything else refused in one line naming the variable), the
 * default rule per call, and the side streams' assignment, on the host. */
static test_result test_moe_gemm_path_rule(void) {
    mt_error err;
    int path = -1;
    const struct { const char* value; int path; } good[] = {{NULL, MOE_PATH_DEFAULT},     {"", MOE_PATH_DEFAULT},
                                                            {"grouped", MOE_PATH_GROUPED}, {"loop", MOE_PATH_LOOP},
                                                            {"streams", MOE_PATH_STREAMS}, {"hopper", MOE_PATH_HOPPER}};
    for (const auto& g : good) {
        EXPECT_OK(moe_gemm_path_parse(g.value, &path, &err), &err);
        EXPECT(path == g.path, "MT_MOE_GEMM=%s: path %d, expected %d", g.value ? g.value : "(unset)", path, g.path);
    }
    const char* bad[] = {"Loop", "stream", "grouped ", "1", "auto", "loops", "streams=4", "cublas", "Hopper"};
    for (const char* b : bad) {
        err.message[0] = 0;
        path = -1;
        EXPECT(moe_gemm_path_parse(b, &path, &err) == MT_ERR_ARG, "MT_MOE_GEMM=%s accepted", b);
        EXPECT(strstr(err.message, "MT_MOE_GEMM=") && strstr(err.message, "grouped, loop, streams or hopper") &&
                   !strchr(err.message, '\n'),
               "MT_MOE_GEMM=%s: message '%s'", b, err.message);
        EXPECT(path == MOE_PATH_DEFAULT, "MT_MOE_GEMM=%s: path left at %d", b, path);
    }
    /* the rule: (forced, grouped has the types, FLOPs per GEMM, GEMMs with rows, side streams) -> path */
    const double small = MOE_GROUPED_MAX_FLOP / 4, big = 2 * MOE_GROUPED_MAX_FLOP;
    const struct { const char* what; int forced; bool types; double each; int n, streams, want; } rule[] = {
        {"small, the types (Qwen3's forward, input gradients)", MOE_PATH_DEFAULT, true, small, 128, 4, MOE_PATH_GROUPED},
        {"small, bf16 -> fp32 (weight gradients)", MOE_PATH_DEFAULT, false, small, 128, 4, MOE_PATH_STREAMS},
        {"big (Mixtral's forward, input gradients)", MOE_PATH_DEFAULT, true, big, 8, 4, MOE_PATH_LOOP},
        {"big, bf16 -> fp32 (Mixtral's weight gradients)", MOE_PATH_DEFAULT, false, big, 8, 4, MOE_PATH_STREAMS},
        {"big, one expert with rows", MOE_PATH_DEFAULT, true, big, 1, 4, MOE_PATH_LOOP},
        {"no side streams", MOE_PATH_DEFAULT, false, small, 128, 0, MOE_PATH_LOOP},
        {"forced grouped without the types", MOE_PATH_GROUPED, false, small, 128, 4, MOE_PATH_LOOP},
        {"forced grouped, big", MOE_PATH_GROUPED, true, big, 8, 4, MOE_PATH_GROUPED},
        {"forced hopper: what it leaves (weight gradients) by the rule", MOE_PATH_HOPPER, false, small, 128, 4,
         MOE_PATH_STREAMS},
        {"forced hopper: what it leaves (big, the types) by the rule", MOE_PATH_HOPPER, true, big, 8, 4, MOE_PATH_LOOP},
        {"forced loop", MOE_PATH_LOOP, true, small, 128, 4, MOE_PATH_LOOP},
        {"forced streams, small", MOE_PATH_STREAMS, true, small, 128, 4, MOE_PATH_STREAMS},
        {"forced streams, one GEMM", MOE_PATH_STREAMS, true, small, 1, 4, MOE_PATH_LOOP},
    };
    for (const auto& r : rule) {
        const int got = moe_gemm_choose(r.forced, r.types, r.each * r.n, r.n, r.streams);
        EXPECT(got == r.want, "%s: path %d, expected %d", r.what, got, r.want);
    }
    /* the assignment: each GEMM to the side stream with the least work so far, ties to the lowest */
    double load[4] = {0, 0, 0, 0};
    const double work[] = {5, 1, 1, 1, 1, 3, 2};
    const int want[] = {0, 1, 2, 3, 1, 2, 3};
    for (int i = 0; i < 7; i++) {
        const int s = moe_side_stream_pick(load, 4, work[i]);
        EXPECT(s == want[i], "GEMM %d of work %g: stream %d, expected %d", i, work[i], s, want[i]);
    }
    EXPECT(load[0] == 5 && load[1] == 2 && load[2] == 4 && load[3] == 3, "loads %g %g %g %g", load[0], load[1], load[2],
           load[3]);
    return TEST_PASS;
}

/* A layer's shape for the paths' test: E experts over R rows in all, the linear in -> out, experts without rows. */
typedef struct {
    const char* name;
    int E, R, in, out;
    int zero[3]; /* experts given no rows (-1: none) */
} mgp_shape;

/* Rows per expert, skewed (weights exp(0.35 g), g about normal: the largest about twice the mean at E = 128) with
 * the shape's experts at 0; counts then offsets then the total, as moe_host_counts returns them. */
static std::vector<int32_t> mgp_counts(const mgp_shape& s, kt_rng* r) {
    std::vector<double> w((size_t)s.E);
    double sum = 0.0;
    for (int e = 0; e < s.E; e++) {
        double g = 0.0;
        for (int i = 0; i < 4; i++) g += kt_uniform(r);
        w[e] = exp(0.35 * (g - 2.0) * 1.7320508075688772);
        for (int z : s.zero)
            if (z == e) w[e] = 0.0;
        sum += w[e];
    }
    std::vector<int32_t> c(2 * (size_t)s.E + 1, 0);
    int given = 0;
    for (int e = 0; e < s.E; e++) given += c[e] = (int32_t)floor(s.R * w[e] / sum);
    for (int e = 0; given < s.R; e = (e + 1) % s.E)
        if (w[e] > 0.0) c[e]++, given++;
    for (int e = 0, at = 0; e < s.E; at += c[e], e++) c[s.E + e] = at;
    c[2 * s.E] = s.R;
    return c;
}

/* The device tensors of one case: inputs x [R, in], W [E, out, in], dy, dy2 [R, out]; outputs y [R, out],
 * dx, dx2 [R, in], dW [E, out, in] fp32. */
template <typename T>
struct mgp_tensors {
    T *x, *W, *dy, *dy2, *y, *dx, *dx2;
    float* dW;
};
template <typename T>
struct mgp_outputs {
    std::vector<T> y, dx, dx2;
    std::vector<float> dW;
};

/* One path over the layer: y = the forward; dx, dW = the backward of dy (a first micro-batch: dW written, the
 * experts without rows zeroed); dx2, dW += the backward of dy2 (accumulating), every output NaN before. */
template <typename T>
static int mgp_run(kt_ctx* k, mt_exec* ex, mt_moe_gemm* m, int path, const mgp_shape& s, const int32_t* counts,
                   const mgp_tensors<T>& d, mgp_outputs<T>* o) {
    const int64_t ny = (int64_t)s.R * s.out, nx = (int64_t)s.R * s.in, nw = (int64_t)s.E * s.out * s.in;
    KT_CUDA(kt_poison(k, d.y, ny));
    KT_CUDA(kt_poison(k, d.dx, nx));
    KT_CUDA(kt_poison(k, d.dx2, nx));
    KT_CUDA(kt_poison(k, d.dW, nw));
    m->forced = path;
    ex->mode.accumulate_gradients = 0;
    moe_experts_forward<T>(m, ex, MOE_GEMM_FC1, d.y, d.x, d.W, counts, s.E, s.in, s.out);
    moe_experts_backward<T>(m, ex, MOE_GEMM_FC2_DX, d.dx, d.dW, d.dy, d.x, d.W, counts, s.E, s.in, s.out);
    ex->mode.accumulate_gradients = 1;
    moe_experts_backward<T>(m, ex, MOE_GEMM_FC1_DX, d.dx2, d.dW, d.dy2, d.x, d.W, counts, s.E, s.in, s.out);
    char label[160];
    snprintf(label, sizeof(label), "%s, path %d", s.name, path);
    if (!kt_sync(k, label)) return 0;
    KT_CUDA(kt_get(k, o->y, d.y, ny));
    KT_CUDA(kt_get(k, o->dx, d.dx, nx));
    KT_CUDA(kt_get(k, o->dx2, d.dx2, nx));
    KT_CUDA(kt_get(k, o->dW, d.dW, nw));
    return 1;
}

/* Bit for bit equal: prints the first difference and how many. */
template <typename V>
static int mgp_bitwise(const char* what, const std::vector<V>& a, const std::vector<V>& b) {
    if (a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof(V))) return 1;
    size_t first = a.size(), n = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); i++)
        if (memcmp(&a[i], &b[i], sizeof(V))) n++, first = first < i ? first : i;
    printf("    FAIL %s: not bitwise equal: %zu of %zu elements differ, the first at %zu (%g vs %g)\n", what, n, a.size(),
           first, first < a.size() ? (double)kt_to<V>(a[first]) : 0.0, first < b.size() ? (double)kt_to<V>(b[first]) : 0.0);
    return 0;
}

/* cuBLAS's grouped kernel against the loop's GEMMs, both fp32 accumulation over the same K terms rounded once to
 * the output type: their fp32 sums differ by the order of the additions only (a random walk of ~sqrt(K) roundings
 * of ~2^-24 of the partial sums: ~1e-5 of the output's rms at K 7168), so an element differs by at most one
 * rounding step of the output type: |a - b| <= ulp(max(|a|, |b|)) <= 2^-7 max(|a|, |b|) in bf16, plus 2^-7 of
 * the output's rms for the order itself (three orders of magnitude of margin); norm-wise under 2^-8 (most
 * elements equal, the others one step apart). */
template <typename T>
static int mgp_close(const char* what, const std::vector<T>& got, const std::vector<T>& loop) {
    double ss = 0.0, sd = 0.0, worst = 0.0;
    for (size_t i = 0; i < loop.size(); i++) ss += (double)kt_to<T>(loop[i]) * kt_to<T>(loop[i]);
    const double rms = sqrt(ss / (double)(loop.size() ? loop.size() : 1));
    const double rel = kt_fmt<T>::u * 2.0; /* one ulp of the value's binade at most (u: half an ulp; bf16 2^-7) */
    size_t bad = 0, equal = 0;
    for (size_t i = 0; i < loop.size(); i++) {
        const double a = kt_to<T>(got[i]), b = kt_to<T>(loop[i]), d = fabs(a - b);
        const double tol = rel * (fabs(a) > fabs(b) ? fabs(a) : fabs(b)) + rel * rms;
        if (!(d <= tol)) bad++;
        if (d == 0.0) equal++;
        sd += d * d;
        if (d / (tol > 0 ? tol : 1) > worst) worst = d / (tol > 0 ? tol : 1);
    }
    const double norm = sqrt(sd / (ss > 0 ? ss : 1));
    printf("      %s: grouped vs loop: %zu of %zu equal, worst at %.3f of the bound, norm-wise %.2e (bound %.2e)%s\n", what,
           equal, loop.size(), worst, norm, rel / 2, bad || !(norm <= rel / 2) ? "   <- FAIL" : "");
    return !bad && norm <= rel / 2;
}

/* The loop's outputs against float64 sums of the stored inputs at sampled elements (proving the three paths do
 * not agree on something wrong: a wrong expert's weights or rows are off by the value's own size), the experts
 * without rows' weight gradients exactly 0, and no NaN left anywhere. Bounds: the output type's rounding (half an
 * ulp, u |value|; 2u allowed) plus fp32 accumulation over K terms, K 2^-24 sum |terms| <= 2^-11 sum |terms| for
 * K <= 8192 (the weight gradients, fp32: the accumulation bound and fp32's rounding of the second pass's sum). */
template <typename T>
static int mgp_reference(const mgp_shape& s, const int32_t* c, const std::vector<T>& x, const std::vector<T>& W,
                         const std::vector<T>& dy, const std::vector<T>& dy2, const mgp_outputs<T>& o, kt_rng* r) {
    const int E = s.E, in = s.in, out = s.out;
    std::vector<int> expert_of((size_t)s.R);
    for (int e = 0; e < E; e++)
        for (int i = 0; i < c[e]; i++) expert_of[(size_t)c[E + e] + i] = e;
    const double rel = kt_fmt<T>::u * 2.0, acc = 1.0 / 2048;
    int bad = 0;
    for (int t = 0; t < 300; t++) {
        const int row = (int)(kt_next(r) % (uint64_t)s.R), e = expert_of[(size_t)row];
        const int j = (int)(kt_next(r) % (uint64_t)out), i = (int)(kt_next(r) % (uint64_t)in);
        double y = 0, ya = 0, dx = 0, dxa = 0;
        for (int q = 0; q < in; q++) {
            const double p = (double)kt_to<T>(x[(size_t)row * in + q]) * kt_to<T>(W[((size_t)e * out + j) * in + q]);
            y += p, ya += fabs(p);
        }
        for (int q = 0; q < out; q++) {
            const double p = (double)kt_to<T>(dy[(size_t)row * out + q]) * kt_to<T>(W[((size_t)e * out + q) * in + i]);
            dx += p, dxa += fabs(p);
        }
        const double gy = kt_to<T>(o.y[(size_t)row * out + j]), gx = kt_to<T>(o.dx[(size_t)row * in + i]);
        if (!(fabs(gy - y) <= rel * fabs(y) + acc * ya)) bad++, printf("      y[%d, %d] (expert %d) %g, reference %g\n", row, j, e, gy, y);
        if (!(fabs(gx - dx) <= rel * fabs(dx) + acc * dxa))
            bad++, printf("      dx[%d, %d] (expert %d) %g, reference %g\n", row, i, e, gx, dx);
        /* a weight gradient element of an expert with rows: both backward passes' sums */
        int we = (int)(kt_next(r) % (uint64_t)E);
        while (c[we] == 0) we = (we + 1) % E;
        double w = 0, wa = 0;
        for (int q = c[E + we]; q < c[E + we] + c[we]; q++) {
            const double xv = kt_to<T>(x[(size_t)q * in + i]);
            const double p = (double)kt_to<T>(dy[(size_t)q * out + j]) * xv, p2 = (double)kt_to<T>(dy2[(size_t)q * out + j]) * xv;
            w += p + p2, wa += fabs(p) + fabs(p2);
        }
        const double gw = o.dW[((size_t)we * out + j) * in + i];
        if (!(fabs(gw - w) <= acc * wa + 1.2e-7 * fabs(w)))
            bad++, printf("      dW[%d, %d, %d] %g, reference %g\n", we, j, i, gw, w);
        if (bad > 5) break;
    }
    for (int z : s.zero)
        for (size_t q = 0; z >= 0 && q < (size_t)out * in; q++)
            if (o.dW[(size_t)z * out * in + q] != 0.0f) {
                printf("      dW of expert %d (no rows) at %zu: %g, expected 0\n", z, q, o.dW[(size_t)z * out * in + q]);
                bad++;
                break;
            }
    size_t nan = 0;
    for (const T& v : o.y) nan += kt_to<T>(v) != kt_to<T>(v);
    for (const T& v : o.dx) nan += kt_to<T>(v) != kt_to<T>(v);
    for (const T& v : o.dx2) nan += kt_to<T>(v) != kt_to<T>(v);
    for (float v : o.dW) nan += v != v;
    if (nan) printf("      %zu NaN left in the outputs (an element no GEMM wrote)\n", nan), bad++;
    return bad == 0;
}

/* One layer shape in bf16 by every path: streams == loop bit for bit (forward, input gradients, the fp32-accumulated
 * weight gradients), streams twice bitwise equal, grouped within mgp_close of the loop (its weight gradients, bf16 x
 * bf16 -> fp32, which cuBLAS's grouped GEMM refuses, run the loop: bitwise), the default rule's outputs bit for bit
 * those of the path moe_gemm_choose names, and the loop against float64 (mgp_reference). */
static int mgp_case(kt_ctx* k, mt_exec* ex, mt_moe_gemm* m, const mgp_shape& s, int index) {
    typedef __nv_bfloat16 T;
    kt_rng r = {kt_seed(71, index, s.E, s.out)};
    const std::vector<int32_t> c = mgp_counts(s, &r);
    int most = 0, with_rows = 0;
    for (int e = 0; e < s.E; e++) most = c[e] > most ? c[e] : most, with_rows += c[e] > 0;
    printf("    %s: %d experts (%d with rows), %d rows (most %d, mean %.1f), %d -> %d\n", s.name, s.E, with_rows, s.R,
           most, (double)s.R / s.E, s.in, s.out);
    const int64_t nx = (int64_t)s.R * s.in, ny = (int64_t)s.R * s.out, nw = (int64_t)s.E * s.out * s.in;
    std::vector<T> x((size_t)nx), W((size_t)nw), dy((size_t)ny), dy2((size_t)ny);
    for (auto* v : {&x, &W, &dy, &dy2})
        for (auto& e : *v) e = kt_from<T>(kt_signed(&r, 0.1, 1.0));
    mgp_tensors<T> d;
    d.x = kt_alloc<T>(k, nx), d.W = kt_alloc<T>(k, nw), d.dy = kt_alloc<T>(k, ny), d.dy2 = kt_alloc<T>(k, ny);
    d.y = kt_alloc<T>(k, ny), d.dx = kt_alloc<T>(k, nx), d.dx2 = kt_alloc<T>(k, nx), d.dW = kt_alloc<float>(k, nw);
    KT_ALLOCATED(k);
    KT_CUDA(kt_put(k, d.x, x));
    KT_CUDA(kt_put(k, d.W, W));
    KT_CUDA(kt_put(k, d.dy, dy));
    KT_CUDA(kt_put(k, d.dy2, dy2));
    mgp_outputs<T> loop, other, grouped;
    if (!mgp_run<T>(k, ex, m, MOE_PATH_LOOP, s, c.data(), d, &loop)) return 0;
    int ok = mgp_reference<T>(s, c.data(), x, W, dy, dy2, loop, &r);
    printf("      loop against float64 at 300 sampled elements of y, dx, dW; experts without rows' dW 0; no NaN:%s\n",
           ok ? " ok" : "   <- FAIL");
    for (int rep = 0; rep < 2 && ok; rep++) { /* streams, twice: the loop's bits each time */
        if (!mgp_run<T>(k, ex, m, MOE_PATH_STREAMS, s, c.data(), d, &other)) return 0;
        ok = mgp_bitwise("streams y", other.y, loop.y) && mgp_bitwise("streams dx", other.dx, loop.dx) &&
             mgp_bitwise("streams dx2", other.dx2, loop.dx2) && mgp_bitwise("streams dW", other.dW, loop.dW);
        printf("      streams (run %d) bit for bit the loop's (y, dx, dx2, dW):%s\n", rep + 1, ok ? " ok" : "   <- FAIL");
    }
    if (!ok || !mgp_run<T>(k, ex, m, MOE_PATH_GROUPED, s, c.data(), d, &grouped)) return 0;
    ok = mgp_close<T>("y", grouped.y, loop.y) & mgp_close<T>("dx", grouped.dx, loop.dx) &
         mgp_close<T>("dx2", grouped.dx2, loop.dx2) & mgp_bitwise("grouped's dW (the loop's GEMMs)", grouped.dW, loop.dW);
    if (!ok || !mgp_run<T>(k, ex, m, MOE_PATH_DEFAULT, s, c.data(), d, &other)) return 0;
    const double flop = 2.0 * s.R * (double)s.in * s.out;
    const int p_io = moe_gemm_choose(MOE_PATH_DEFAULT, true, flop, with_rows, m->streams);
    const int p_w = moe_gemm_choose(MOE_PATH_DEFAULT, false, flop, with_rows, m->streams);
    const mgp_outputs<T>& io = p_io == MOE_PATH_GROUPED ? grouped : loop;
    ok = mgp_bitwise("default y", other.y, io.y) && mgp_bitwise("default dx", other.dx, io.dx) &&
         mgp_bitwise("default dx2", other.dx2, io.dx2) && mgp_bitwise("default dW", other.dW, loop.dW);
    printf("      default rule: forward and input gradients %s, weight gradients %s: bit for bit that path's:%s\n",
           p_io == MOE_PATH_GROUPED ? "grouped" : p_io == MOE_PATH_STREAMS ? "streams" : "loop",
           p_w == MOE_PATH_STREAMS ? "streams" : "loop", ok ? " ok" : "   <- FAIL");
    kt_release(k);
    return ok;
}

/* The paths at a Qwen3-like layer (128 small experts; its fc1 and fc2 at half the width) and a Mixtral-like one (8
 * large experts), uneven rows with experts at 0. The compute stream's cuBLAS handle and the side streams' are set
 * up as the trainer's (gemm_handle_create, their own workspaces). */
static test_result test_moe_experts_gemm_paths(void) {
    REQUIRE_GPU();
    static const mgp_shape shapes[] = {
        {"qwen3-like fc1", 128, 16384, 1024, 768, {3, 64, 127}},
        {"qwen3-like fc2", 128, 16384, 384, 1024, {3, 64, 127}},
        {"mixtral-like fc1", 8, 4096, 2048, 7168, {5, -1, -1}},
        {"mixtral-like fc2", 8, 4096, 3584, 2048, {5, -1, -1}},
    };
    kt_ctx k;
    if (!kt_ctx_init(&k)) return TEST_FAIL;
    mt_gemm_plans main_plans;
    mt_moe_gemm m;
    memset(&main_plans, 0, sizeof(main_plans));
    memset(&m, 0, sizeof(m));
    const int E_max = 128;
    int ok = cudaMalloc(&main_plans.workspace, MT_CUBLAS_WORKSPACE_BYTES) == cudaSuccess;
    for (int s = 0; ok && s < MOE_SIDE_STREAMS; s++) ok = cudaMalloc(&m.workspace[s], MT_CUBLAS_WORKSPACE_BYTES) == cudaSuccess;
    ok = ok && cudaMalloc((void**)&m.table, MT_MOE_GEMM_POINTERS(E_max) * sizeof(void*)) == cudaSuccess &&
         cudaMallocHost((void**)&m.staging, MT_MOE_GEMM_POINTERS(E_max) * sizeof(void*)) == cudaSuccess;
    if (ok) {
        main_plans.workspace_bytes = MT_CUBLAS_WORKSPACE_BYTES;
        gemm_handle_create(&k.error, &main_plans.handle, k.stream, main_plans.workspace, MT_CUBLAS_WORKSPACE_BYTES);
        moe_gemm_create(&m, &k.error, MOE_PATH_DEFAULT);
        ok = k.error.status == MT_OK && m.streams == MOE_SIDE_STREAMS;
        if (!ok) printf("    FAIL setting up the handles and side streams: %s\n", k.error.error.message);
    } else {
        printf("    FAIL allocating the workspaces and the grouped calls' tables\n");
    }
    mt_exec ex;
    memset(&ex, 0, sizeof(ex));
    ex.stream = k.stream, ex.error = &k.error, ex.gemm = &main_plans;
    for (int i = 0; ok && i < (int)(sizeof(shapes) / sizeof(shapes[0])); i++) ok = mgp_case(&k, &ex, &m, shapes[i], i);
    kt_release(&k);
    moe_gemm_free(&m);
    if (main_plans.handle) cublasDestroy(main_plans.handle);
    cudaFree(main_plans.workspace);
    for (int s = 0; s < MOE_SIDE_STREAMS; s++) cudaFree(m.workspace[s]);
    cudaFree((void*)m.table);
    cudaFreeHost((void*)m.staging);
    kt_ctx_free(&k);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* ============================================================================================== */
/* Section 13.1: the Hopper grouped GEMM (the experts' forward on sm_90a)                           */
/* ============================================================================================== */

/* Its schedule on the host (hg::decode_tile over the prefix sums the kernel builds): every (output row,
 * column tile) covered exactly once, no tile outside its group, at uneven counts with zeros and single
 * rows, both tile widths. */
static test_result test_moe_hopper_schedule(void) {
    struct shape { std::vector<int> m; int N, bn; };
    std::vector<int> uneven(128);
    for (int g = 0; g < 128; g++) uneven[g] = g % 7 == 3 ? 0 : g % 11 == 5 ? 1 : (g * 37) % 300; /* 0, 1, up to 299 */
    const shape shapes[] = {{{128}, 256, 256},    {{1000}, 1000, 256},   {{0, 1, 300, 129}, 512, 128},
                            {{0, 0, 0}, 256, 256}, {uneven, 1536, 256}, {uneven, 384, 128},
                            {std::vector<int>(8, 1024), 28672, 256},   {{5, 0, 4000, 1, 0, 127, 128, 129}, 2048, 256}};
    for (const shape& s : shapes) {
        const int G = (int)s.m.size(), ntn = (s.N + s.bn - 1) / s.bn;
        std::vector<int> ts((size_t)G + 1, 0), rs((size_t)G + 1, 0);
        for (int g = 0; g < G; g++) {
            rs[g + 1] = rs[g] + s.m[g];
            ts[g + 1] = ts[g] + (s.m[g] + hg::BM - 1) / hg::BM * ntn;
        }
        const int rows = rs[G];
        std::vector<int> cover((size_t)rows * ntn, 0);
        for (int t = 0; t < ts[G]; t++) {
            const hg::tile_coord c = hg::decode_tile(t, ts.data(), rs.data(), G, ntn, s.bn);
            EXPECT(c.g >= 0 && c.g < G && c.m0 >= rs[c.g] && c.m0 < rs[c.g + 1] && c.m_end == rs[c.g + 1] &&
                       (c.m0 - rs[c.g]) % hg::BM == 0 && c.n0 % s.bn == 0 && c.n0 < s.N,
                   "G %d N %d BN %d: tile %d decodes to group %d rows %d.. column %d, outside its group", G, s.N, s.bn, t,
                   c.g, c.m0, c.n0);
            for (int r = c.m0; r < std::min(c.m0 + hg::BM, c.m_end); r++) cover[(size_t)r * ntn + c.n0 / s.bn]++;
        }
        for (size_t i = 0; i < cover.size(); i++)
            EXPECT(cover[i] == 1, "G %d N %d BN %d: row %zu column tile %zu covered %d times", G, s.N, s.bn, i / ntn,
                   i % ntn, cover[i]);
    }
    return TEST_PASS;
}

/* What it takes (hopper_gemm_fits) and that its launcher refuses the rest in one line, queuing nothing (no
 * pointer is touched: this runs without a GPU, where the refusal is that there is no sm_90a kernel). */
static test_result test_moe_hopper_refusals(void) {
    char* base = (char*)(uintptr_t)4096; /* never dereferenced */
    EXPECT(hopper_gemm_fits(base, base, base, 128, 1536, 2048, 32768), "the Qwen3 shape");
    EXPECT(hopper_gemm_fits(base, base, base, 1, 8, 8, 0), "the smallest shape, no rows");
    EXPECT(!hopper_gemm_fits(base, base, base, 8, 1540 + 2, 2048, 100), "N %% 8 != 0");
    EXPECT(!hopper_gemm_fits(base, base, base, 8, 1536, 2044, 100), "K %% 8 != 0");
    EXPECT(!hopper_gemm_fits(base, base, base, 0, 1536, 2048, 100), "G = 0");
    EXPECT(!hopper_gemm_fits(base, base, base, hg::MAX_GROUPS + 1, 8, 8, 100), "G > MAX_GROUPS");
    EXPECT(!hopper_gemm_fits(base + 2, base, base, 8, 64, 64, 100), "A misaligned");
    EXPECT(!hopper_gemm_fits(base, base + 8, base, 8, 64, 64, 100), "B misaligned");
    EXPECT(!hopper_gemm_fits(base, base, base + 4, 8, 64, 64, 100), "C misaligned");
    EXPECT(!hopper_gemm_fits(base, base, base, 1024, 1 << 21, 64, 100), "G N >= 2^31");
    mt_gpu_error err;
    memset(&err, 0, sizeof(err));
    mt_exec ex;
    memset(&ex, 0, sizeof(ex));
    ex.error = &err;
    hopper_grouped_gemm(&ex, (__nv_bfloat16*)base, (const __nv_bfloat16*)base, 100, (const __nv_bfloat16*)base, hg::B_NK,
                        (const int32_t*)base, 8, 60, 64);
    EXPECT(err.status == MT_ERR_ARG, "N 60: recorded status %d", (int)err.status);
    EXPECT(strncmp(err.error.message, "hopper_grouped_gemm: ", 21) == 0 && !strchr(err.error.message, '\n'),
           "message \"%s\"", err.error.message);
    printf("    %s\n", err.error.message);
    return TEST_PASS;
}

/* One grouped GEMM of the launcher against a float64 host reference: C_g = A_g B_g^T (layout hg::B_NK, B [G, N, K])
 * or A_g B_g (hg::B_KN, B [G, K, N]) for G groups of the given counts, A holding `spare` rows more than the counts' sum (random: the kernel reads them for partial tiles
 * but must not let them into stored rows) and C poisoned (NaN), so rows past the sum must stay NaN and every
 * row below it must be written. Then a second run into a freshly poisoned C must be bitwise the first.
 * Tolerance, per element: |got - ref| <= 2 u_bf16 |ref| + 4 K u_c sum_k |a_k b_k|. Why: the products of
 * bf16 values are exact in fp32; the kernel adds its K of them in fp32 in its own order (the tensor core's
 * order inside each 16-wide slice, then slice by slice), each addition off by at most u_c (2 u_c if the
 * hardware truncates) of a partial sum <= sum |a_k b_k|: at most 2 K u_c sum |a b| in all, doubled; then one
 * rounding to bf16 (u_bf16 of the value, doubled). Norm-wise: the norm of those bounds. A lost or repeated
 * 16-wide k slice, a row or column out of place or a stale stage moves elements by ~|a b| sqrt(16) or more:
 * orders of magnitude above both at these K (sum |a b| ~ K / 4 with inputs in [0.05, 1)). */
static int mh_case(kt_ctx* k, kt_cover* cov, const char* name, int layout, const std::vector<int>& m, int N, int K,
                   int spare, int index) {
    typedef __nv_bfloat16 T;
    const int G = (int)m.size();
    int64_t rows = 0;
    for (int x : m) rows += x;
    const int64_t a_rows = rows + spare;
    const int variant = N % 256 != 0 && N % 256 <= 128 ? 1 : 0; /* ADAPT: hopper_grouped_gemm's choice */
    kt_cover_hit(cov, layout == hg::B_KN ? (variant ? "128x128 B [K, N]" : "128x256 B [K, N]") : (variant ? "128x128" : "128x256"));
    kt_report rep;
    kt_report_begin(&rep, "hopper_grouped_gemm %s: G %d rows %lld (+%d spare) N %d K %d, B %s, tiles 128x%d", name, G,
                    (long long)rows, spare, N, K, layout == hg::B_KN ? "[K, N]" : "[N, K]", variant ? 128 : 256);
    kt_rng rng = {kt_seed(71 + layout, G, N, K + index)};
    kt_host<T> A, B;
    A.fill(a_rows * K, &rng, 0.05, 1.0);
    B.fill((int64_t)G * N * K, &rng, 0.05, 1.0);
    T* d_A = kt_alloc<T>(k, a_rows * K);
    T* d_B = kt_alloc<T>(k, (int64_t)G * N * K);
    T* d_C = kt_alloc<T>(k, a_rows * N);
    T* d_C2 = kt_alloc<T>(k, a_rows * N);
    int32_t* d_m = kt_alloc<int32_t>(k, G);
    KT_ALLOCATED(k);
    KT_CUDA(kt_put(k, d_A, A.h));
    KT_CUDA(kt_put(k, d_B, B.h));
    KT_CUDA(kt_put(k, d_m, m));
    KT_CUDA(kt_poison(k, d_C, a_rows * N));
    KT_CUDA(kt_poison(k, d_C2, a_rows * N));
    hopper_grouped_gemm(kt_exec(k, 0), d_C, d_A, a_rows, d_B, layout, d_m, G, N, K);
    hopper_grouped_gemm(kt_exec(k, 0), d_C2, d_A, a_rows, d_B, layout, d_m, G, N, K);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<T> C, C2;
    KT_CUDA(kt_get(k, C, d_C, a_rows * N));
    KT_CUDA(kt_get(k, C2, d_C2, a_rows * N));
    kt_check c;
    kt_check_begin(&c, "C", N, 2 * kt_fmt<T>::u, -1.0, 0.0);
    int64_t row = 0;
    for (int g = 0; g < G; g++)
        for (int i = 0; i < m[g]; i++, row++)
            for (int n = 0; n < N; n++) {
                const double* a = &A.v[(size_t)row * K];
                const double* b = layout == hg::B_KN ? &B.v[(size_t)g * K * N + n] : &B.v[((size_t)g * N + n) * K];
                const size_t step = layout == hg::B_KN ? (size_t)N : 1; /* B_g[n][x] or B_g[x][n] */
                double s = 0.0, mag = 0.0;
                for (int x = 0; x < K; x++) s += a[x] * b[x * step], mag += fabs(a[x] * b[x * step]);
                kt_check_add(&c, row * N + n, kt_to<T>(C[(size_t)row * N + n]), s, 4.0 * K * KT_UC * mag);
            }
    kt_check_end(&c, &rep);
    int64_t written_past = 0, differ = 0;
    for (int64_t i = rows * N; i < a_rows * N; i++) written_past += kt_to<T>(C[(size_t)i]) == kt_to<T>(C[(size_t)i]);
    if (memcmp(C.data(), C2.data(), sizeof(T) * (size_t)(rows * N)) != 0)
        for (int64_t i = 0; i < rows * N; i++) differ += memcmp(&C[(size_t)i], &C2[(size_t)i], sizeof(T)) != 0;
    if (written_past) printf("    FAIL %s: %lld elements written past the groups' last row\n", rep.label, (long long)written_past);
    if (differ) printf("    FAIL %s: %lld elements differ between two runs\n", rep.label, (long long)differ);
    rep.ok &= written_past == 0 && differ == 0;
    kt_release(k);
    return kt_report_end(&rep);
}

/* Qwen3-like (128 experts, uneven counts with zeros and single rows, narrow N and K) and Mixtral-like (8
 * experts, uneven, wider) shapes, edges (N and K not multiples of the tile, K not of 64), both tile widths, both
 * B layouts (the forward's W [N, K] and the input gradient's W [K, N]). */
static test_result test_moe_hopper_grouped_gemm(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_gemm_available, &probe, "the Hopper grouped GEMM");
    kt_ctx k;
    if (!kt_ctx_init(&k)) return TEST_FAIL;
    static const char* variants[] = {"128x256", "128x128", "128x256 B [K, N]", "128x128 B [K, N]"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 4);
    std::vector<int> qwen(128);
    for (int g = 0; g < 128; g++) qwen[g] = g % 7 == 3 ? 0 : g % 13 == 5 ? 1 : 1 + (g * 53) % 61; /* 0, 1, up to 61 */
    const std::vector<int> mixtral = {300, 17, 0, 513, 128, 1, 255, 86};
    int ok = 1;
    for (int layout = hg::B_NK; layout <= hg::B_KN; layout++) {
        ok &= mh_case(&k, &cov, "qwen3-like", layout, qwen, 384, 256, 0, 0);
        ok &= mh_case(&k, &cov, "qwen3-like, spare rows", layout, qwen, 768, 128, 77, 1);
        ok &= mh_case(&k, &cov, "mixtral-like", layout, mixtral, 1024, 512, 0, 2);
        ok &= mh_case(&k, &cov, "edges", layout, {0, 129, 1, 64}, 264, 200, 5, 3);
        ok &= mh_case(&k, &cov, "one group, one row", layout, {1}, 8, 8, 0, 4);
    }
    ok &= kt_cover_check(&cov, "hopper_grouped_gemm", "bf16");
    kt_ctx_free(&k);
    return ok ? TEST_PASS : TEST_FAIL;
}

/* hopper_grouped_wgrad, the experts' weight gradient: dW_g [M, N] (fp32) = beta dW_g + dY_g^T X_g over each group's
 * own rows of dY [a_rows, M] and X [a_rows, N] (bf16, groups concatenated), against float64 on the host, with
 * beta 0 (dW poisoned: every element must be written, an empty group's with zeros) and beta 1 (dW random: an empty
 * group's left bitwise as it was). The `spare` rows past the groups' sum are NaN: a partial last k-block that
 * lets them in (the shared-memory zeroing failing) turns the last group's dW into NaN; the next group's rows
 * entering a group's last k-block move its elements far past the tolerance. Then a second run from the same
 * start must be bitwise the first.
 * Tolerance, per element: |got - ref| <= 4 n_g u_c sum_k |a_k b_k| + 2 u_c |ref|. Why: bf16 products are exact in
 * fp32; the kernel adds its n_g of them in fp32 in its own order, each addition off by at most u_c (2 u_c if the
 * hardware truncates) of a partial sum <= sum |a b|: 2 n_g u_c sum |a b| in all, doubled; beta 1 adds the old
 * value with one more rounding (u_c |ref|, doubled). Norm-wise: the norm of those bounds. A lost or repeated
 * 16-row k slice or a foreign row moves elements by ~|a b| sqrt(16) or more (inputs in [0.05, 1)): orders of
 * magnitude above both. */
static int mw_case(kt_ctx* k, kt_cover* cov, const char* name, const std::vector<int>& m, int M, int N, int spare, float beta,
                   int index) {
    typedef __nv_bfloat16 T;
    const int G = (int)m.size();
    int64_t rows = 0;
    for (int x : m) rows += x;
    const int64_t a_rows = rows + spare, out = (int64_t)G * M * N;
    const int variant = N % 256 != 0 && N % 256 <= 128 ? 1 : 0; /* ADAPT: hopper_grouped_wgrad's choice */
    kt_cover_hit(cov, variant ? "wgrad 128x128" : "wgrad 128x256");
    kt_report rep;
    kt_report_begin(&rep, "hopper_grouped_wgrad %s: G %d rows %lld (+%d NaN) M %d N %d beta %g, tiles 128x%d", name, G,
                    (long long)rows, spare, M, N, (double)beta, variant ? 128 : 256);
    kt_rng rng = {kt_seed(83, G, M, N + index)};
    kt_host<T> dY, X;
    kt_host<float> W0;
    dY.fill(rows * M, &rng, 0.05, 1.0);
    X.fill(rows * N, &rng, 0.05, 1.0);
    W0.fill(out, &rng, 0.05, 1.0);
    T* d_dY = kt_alloc<T>(k, a_rows * M);
    T* d_X = kt_alloc<T>(k, a_rows * N);
    float* d_W = kt_alloc<float>(k, out);
    float* d_W2 = kt_alloc<float>(k, out);
    int32_t* d_m = kt_alloc<int32_t>(k, G);
    KT_ALLOCATED(k);
    KT_CUDA(kt_poison(k, d_dY, a_rows * M));
    KT_CUDA(kt_poison(k, d_X, a_rows * N));
    KT_CUDA(kt_put(k, d_dY, dY.h));
    KT_CUDA(kt_put(k, d_X, X.h));
    KT_CUDA(kt_put(k, d_m, m));
    if (beta == 0.0f) {
        KT_CUDA(kt_poison(k, d_W, out));
        KT_CUDA(kt_poison(k, d_W2, out));
    } else {
        KT_CUDA(kt_put(k, d_W, W0.h));
        KT_CUDA(kt_put(k, d_W2, W0.h));
    }
    hopper_grouped_wgrad(kt_exec(k, 0), d_W, d_dY, d_X, a_rows, d_m, G, M, N, beta);
    hopper_grouped_wgrad(kt_exec(k, 0), d_W2, d_dY, d_X, a_rows, d_m, G, M, N, beta);
    if (!kt_sync(k, rep.label)) return 0;
    std::vector<float> W, W2;
    KT_CUDA(kt_get(k, W, d_W, out));
    KT_CUDA(kt_get(k, W2, d_W2, out));
    kt_check c;
    kt_check_begin(&c, "dW", N, 2 * KT_UC, -1.0, 0.0);
    int64_t r0 = 0, untouched_changed = 0;
    for (int g = 0; g < G; r0 += m[g], g++)
        for (int i = 0; i < M; i++)
            for (int n = 0; n < N; n++) {
                const int64_t at = ((int64_t)g * M + i) * N + n;
                double s = beta != 0.0f ? (double)beta * W0.v[(size_t)at] : 0.0, mag = 0.0;
                for (int r = 0; r < m[g]; r++) {
                    const double p = dY.v[(size_t)((r0 + r) * M + i)] * X.v[(size_t)((r0 + r) * N + n)];
                    s += p, mag += fabs(p);
                }
                kt_check_add(&c, at, W[(size_t)at], s, 4.0 * m[g] * KT_UC * mag);
                if (m[g] == 0 && beta != 0.0f) untouched_changed += memcmp(&W[(size_t)at], &W0.h[(size_t)at], sizeof(float)) != 0;
            }
    kt_check_end(&c, &rep);
    int64_t differ = 0;
    if (memcmp(W.data(), W2.data(), sizeof(float) * (size_t)out) != 0)
        for (int64_t i = 0; i < out; i++) differ += memcmp(&W[(size_t)i], &W2[(size_t)i], sizeof(float)) != 0;
    if (untouched_changed)
        printf("    FAIL %s: %lld elements of empty groups changed with beta 1\n", rep.label, (long long)untouched_changed);
    if (differ) printf("    FAIL %s: %lld elements differ between two runs\n", rep.label, (long long)differ);
    rep.ok &= untouched_changed == 0 && differ == 0;
    kt_release(k);
    return kt_report_end(&rep);
}

/* Qwen3-like counts (zeros, single rows, up to 61: partial k-blocks everywhere) and uneven larger groups with
 * edges (M, N not multiples of the tile), both tile widths, beta 0 and 1. */
static test_result test_moe_hopper_grouped_wgrad(void) {
    mt_hopper_gemm_state probe;
    REQUIRE_HOPPER(hopper_gemm_available, &probe, "the Hopper grouped GEMM");
    kt_ctx k;
    if (!kt_ctx_init(&k)) return TEST_FAIL;
    static const char* variants[] = {"wgrad 128x256", "wgrad 128x128"};
    kt_cover cov;
    kt_cover_init(&cov, variants, 2);
    std::vector<int> qwen(128);
    for (int g = 0; g < 128; g++) qwen[g] = g % 7 == 3 ? 0 : g % 13 == 5 ? 1 : 1 + (g * 53) % 61; /* 0, 1, up to 61 */
    const std::vector<int> uneven = {0, 1, 130, 64, 0, 300, 77};
    int ok = 1;
    for (int b = 0; b < 2; b++) {
        const float beta = (float)b;
        ok &= mw_case(&k, &cov, "qwen3-like", qwen, 256, 256, 0, beta, 0);
        ok &= mw_case(&k, &cov, "uneven, edges", uneven, 136, 264, 9, beta, 1);
        ok &= mw_case(&k, &cov, "uneven, narrow", uneven, 264, 128, 64, beta, 2);
        ok &= mw_case(&k, &cov, "all empty", {0, 0, 0}, 128, 256, 3, beta, 3);
    }
    ok &= kt_cover_check(&cov, "hopper_grouped_wgrad", "bf16");
    kt_ctx_free(&k);
    return ok ? TEST_PASS : TEST_FAIL;
}

static const test_case moe_kernels_host_tests[] = {
    {"moe_token_order", test_moe_token_order},
    {"moe_work_and_capacity_rules", test_moe_work_and_capacity_rules},
    {"moe_routing_refusals", test_moe_routing_refusals},
    {"moe_gemm_path_rule", test_moe_gemm_path_rule},
    {"moe_hopper_schedule", test_moe_hopper_schedule},
    {"moe_hopper_refusals", test_moe_hopper_refusals},
};

static const test_case moe_kernels_gpu_tests[] = {
    {"moe_routing", test_moe_routing},
    {"moe_permute_unpermute", test_moe_permute_unpermute},
    {"moe_swiglu_prob", test_moe_swiglu_prob},
    {"moe_gelu_and_biases", test_moe_gelu_biases},
    {"moe_shared_gate", test_moe_shared_gate},
    {"moe_casts", test_moe_casts},
    {"moe_experts_gemm_paths", test_moe_experts_gemm_paths},
    {"moe_hopper_grouped_gemm", test_moe_hopper_grouped_gemm},
    {"moe_hopper_grouped_wgrad", test_moe_hopper_grouped_wgrad},
};

#endif
