/* tests/test_data_parallel.h — data parallelism.
 *
 * Host tests (everywhere): Megatron's DDP buffer layout (reverse order, buckets, the distributed
 * optimizer's padding and shards), GPT-2 and Llama flavours; the multi-GPU tests' layout comparison
 * (below) against synthetic runs with planted errors.
 *
 * Multi-GPU tests (under `mpirun -np 2` or `-np 4`, one process per GPU; they skip in a single
 * process): every rank trains the same small GPT data-parallel over all ranks and, for comparison,
 * alone (DP=1) on the same global batches, then checks:
 *   - through the layout comparison (below; the TP and PP tests use it too): the initial weights, the
 *     first step's gradients per tensor and element (the distributed optimizer's shards gathered), 20
 *     steps' losses and grad norms, the final weights per tensor and element against DP=1's movement;
 *     with and without the distributed optimizer and overlap, GPT-2 and Llama, fp32 and bf16 (and
 *     fp32 GPT-2 with dropout). DP=N computes the same micro-batches as DP=1; only the order in which
 *     the fp32 gradient sums are added differs (NCCL's sum over ranks vs accumulation in one
 *     buffer), a few fp32 ulps per step; in bf16 such a change in an fp32 master weight can flip its
 *     bf16 rounding, a 2^-9 relative change that then feeds the next steps;
 *   - two runs give bitwise identical losses and weights;
 *   - 10 steps, save, load, 10 steps give bitwise the 20 straight steps (sharded optimizer state);
 *   - the memory plan of a GPT-2 124M: model state bytes per parameter follow Megatron's 18 and
 *     6 + 12/d, and the device's own accounting (cudaMemGetInfo around the allocations) agrees;
 *   - --fp8-param-gather (GPT-2 and Llama, delayed and tensorwise, with and without
 *     --overlap-param-gather): bitwise the run without it (losses, master weights, FP8 weights and
 *     scales), bitwise across save/load, the same FP8 weights and scales on every rank, and the
 *     all-gather's bytes (the bf16 bytes less one per FP8 weight element). Also on one GPU (gpu group).
 * Host tests also check --fp8-param-gather's parameter storage (one byte per FP8 weight element). */
#ifndef MT_TEST_DATA_PARALLEL_H
#define MT_TEST_DATA_PARALLEL_H

/* ---- host tests ---- */

static mt_config parallel_layout_config(int dp, int dist, int overlap, int64_t bucket) {
    mt_config c = test_config_sized(3, 96, 4, 32, 1000);
    c.train_iters = 10;
    test_config_parallel(&c, 1, dp, 0);
    test_config_ddp(&c, dist, overlap, 0, bucket);
    mt_error err;
    mt_config_finalize(&c, &err);
    return c;
}

/* Every canonical element appears exactly once; parameters do not overlap; reverse model order. */
static test_result check_layout_covers(const mt_config* c, const mt_buffer_layout* b) {
    int64_t n = mt_num_parameters(c);
    char* seen = (char*)calloc((size_t)n, 1);
    int64_t prev_end = 0;
    for (int i = 0; i < b->num_params; i++) {
        const mt_buffer_param* p = &b->params[i];
        EXPECT(p->offset >= prev_end, "param %d overlaps the previous one", i);
        prev_end = p->offset + p->numel;
        for (int64_t j = 0; j < p->numel; j++) {
            if (seen[p->canonical + j]) { free(seen); EXPECT(0, "canonical element %lld twice", (long long)(p->canonical + j)); }
            seen[p->canonical + j] = 1;
        }
        const mt_buffer_bucket* k = &b->buckets[p->bucket];
        EXPECT(p->offset >= k->start && p->offset + p->numel <= k->end, "param %d outside its bucket", i);
    }
    for (int64_t j = 0; j < n; j++) if (!seen[j]) { free(seen); EXPECT(0, "canonical element %lld missing", (long long)j); }
    free(seen);
    EXPECT(prev_end <= b->size, "buffer size %lld < end %lld", (long long)b->size, (long long)prev_end);
    /* backprop order: final norm first, word embeddings last, layers from L-1 down */
    EXPECT(b->params[0].tensor == MT_P_FINAL_LN_BIAS, "first param is tensor %d", b->params[0].tensor);
    EXPECT(b->params[b->num_params - 1].tensor == MT_P_WORD_EMBEDDINGS, "last param is tensor %d",
           b->params[b->num_params - 1].tensor);
    EXPECT(b->params[2].tensor == MT_P_FC2_BIAS && b->params[2].layer == c->num_layers - 1, "third param: %d/%d",
           b->params[2].tensor, b->params[2].layer);
    for (int k = 1; k < b->num_buckets; k++) {
        EXPECT(b->buckets[k].start == b->buckets[k - 1].end, "bucket %d does not follow %d", k, k - 1);
        EXPECT(b->buckets[k].ready_layer <= b->buckets[k - 1].ready_layer, "bucket %d ready before %d", k, k - 1);
    }
    EXPECT(b->buckets[b->num_buckets - 1].ready_layer == -1, "the embeddings' bucket must wait for the whole backward");
    return TEST_PASS;
}

static test_result test_buffer_layout_megatron_rules(void) {
    mt_error err;
    mt_buffer_layout b;
    /* no overlap: one bucket, no padding without the distributed optimizer */
    mt_config c = parallel_layout_config(4, 0, 0, 0);
    EXPECT_OK(mt_buffer_layout_build(&b, &c, &err), &err);
    EXPECT(b.num_buckets == 1 && b.size == mt_num_parameters(&c), "%d buckets, size %lld", b.num_buckets, (long long)b.size);
    test_result r = check_layout_covers(&c, &b);
    mt_buffer_layout_free(&b);
    if (r != TEST_PASS) return r;

    /* distributed optimizer, overlap, dp 3, small buckets: params at multiples of 64, buckets end at
     * multiples of lcm(3, 128) = 384, each bucket closes once it holds >= bucket_size elements */
    int64_t bucket = 20000;
    c = parallel_layout_config(3, 1, 1, bucket);
    EXPECT_OK(mt_buffer_layout_build(&b, &c, &err), &err);
    r = check_layout_covers(&c, &b);
    for (int i = 0; i < b.num_params && r == TEST_PASS; i++)
        if (b.params[i].offset % 64) { printf("    FAIL param %d at %lld\n", i, (long long)b.params[i].offset); r = TEST_FAIL; }
    for (int k = 0; k < b.num_buckets && r == TEST_PASS; k++) {
        const mt_buffer_bucket* x = &b.buckets[k];
        if (x->end % 384 || (x->end - x->start) % 3) { printf("    FAIL bucket %d ends at %lld\n", k, (long long)x->end); r = TEST_FAIL; }
        /* Megatron closes a bucket at the first param that takes it to bucket_size */
        if (k < b.num_buckets - 1 && x->numel_unpadded < bucket) { printf("    FAIL bucket %d holds %lld\n", k, (long long)x->numel_unpadded); r = TEST_FAIL; }
        int64_t lo, hi, total = 0;
        for (int d = 0; d < 3; d++) {
            mt_bucket_shard(x, 3, d, &lo, &hi);
            if (lo != x->start + d * (x->end - x->start) / 3) r = TEST_FAIL;
            total += hi - lo;
        }
        if (total != x->end - x->start) { printf("    FAIL shards of bucket %d do not tile it\n", k); r = TEST_FAIL; }
    }
    EXPECT(b.num_buckets > 5, "only %d buckets", b.num_buckets);
    mt_buffer_layout_free(&b);
    if (r != TEST_PASS) return r;

    /* Megatron's default bucket size: max(40M, 1M * dp) elements, only with --overlap-grad-reduce */
    mt_config big = test_config_sized(48, 1600, 25, 1024, 50257);
    big.lr = 1e-4;
    test_config_parallel(&big, 1, 64, 0);
    test_config_ddp(&big, 1, 1, 0, 0);
    EXPECT_OK(mt_config_finalize(&big, &err), &err);
    EXPECT_OK(mt_buffer_layout_build(&b, &big, &err), &err);
    for (int k = 0; k < b.num_buckets - 1 && r == TEST_PASS; k++) {
        const mt_buffer_bucket* x = &b.buckets[k];
        /* closes at the first parameter that reaches 64M: less than one more parameter beyond it */
        if (x->numel_unpadded < 64000000 || x->numel_unpadded > 64000000 + 1600LL * 6400 + 64) {
            printf("    FAIL bucket %d holds %lld elements\n", k, (long long)x->numel_unpadded);
            r = TEST_FAIL;
        }
        if (x->end % 128) r = TEST_FAIL; /* lcm(64, 128) */
    }
    printf("      1.5B shape, dp 64: %d buckets of >= 64M elements, buffer %lld for %lld parameters\n", b.num_buckets,
           (long long)b.size, (long long)mt_num_parameters(&big));
    mt_buffer_layout_free(&b);
    return r;
}

/* The Llama flavour's buffer: only the tensors it has (no position embeddings, norm or linear
 * biases), the untied output weight first in buffer order (it is last in model order), every
 * canonical element exactly once, absent tensors at offset -1. */
static test_result test_buffer_layout_llama(void) {
    mt_config c = test_config_sized(3, 64, 4, 32, 300);
    c.lr = 1e-4;
    test_config_attention(&c, 4, 2, 0, 0);
    test_config_llama(&c);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT(c.ffn_hidden_size == 128, "SwiGLU ffn default %d, Megatron gives (4*64*2/3)/64*64 = 128", c.ffn_hidden_size);
    mt_buffer_layout b;
    EXPECT_OK(mt_buffer_layout_build(&b, &c, &err), &err);
    int64_t n = mt_num_parameters(&c);
    test_result r = TEST_PASS;
    if (b.num_params != 3 + 6 * c.num_layers || b.size != n) {
        printf("    FAIL %d parameters in %lld elements (want %d in %lld)\n", b.num_params, (long long)b.size,
               3 + 6 * c.num_layers, (long long)n);
        r = TEST_FAIL;
    }
    if (b.params[0].tensor != MT_P_OUTPUT_WEIGHT || b.params[1].tensor != MT_P_FINAL_LN_WEIGHT ||
        b.params[2].tensor != MT_P_FC2_WEIGHT || b.params[2].layer != c.num_layers - 1 ||
        b.params[b.num_params - 1].tensor != MT_P_WORD_EMBEDDINGS) {
        printf("    FAIL buffer order: %d %d %d ... %d\n", b.params[0].tensor, b.params[1].tensor, b.params[2].tensor,
               b.params[b.num_params - 1].tensor);
        r = TEST_FAIL;
    }
    int absent[] = {MT_P_POSITION_EMBEDDINGS, MT_P_LN1_BIAS, MT_P_QKV_BIAS, MT_P_PROJ_BIAS, MT_P_LN2_BIAS,
                    MT_P_FC1_BIAS, MT_P_FC2_BIAS, MT_P_FINAL_LN_BIAS};
    for (size_t i = 0; i < sizeof(absent) / sizeof(absent[0]); i++)
        if (mt_buffer_offset(&b, absent[i], 0) != -1) { printf("    FAIL tensor %d present\n", absent[i]); r = TEST_FAIL; }
    unsigned char* seen = (unsigned char*)calloc((size_t)n, 1);
    for (int k = 0; k < b.num_params; k++)
        for (int64_t e = 0; e < b.params[k].numel; e++) seen[b.params[k].canonical + e]++;
    for (int64_t e = 0; e < n && r == TEST_PASS; e++)
        if (seen[e] != 1) { printf("    FAIL canonical element %lld covered %d times\n", (long long)e, seen[e]); r = TEST_FAIL; }
    free(seen);
    mt_buffer_layout_free(&b);
    return r;
}

/* --fp8-param-gather's parameter storage (GPT-2 and Llama, DP=2, the first and last layer in bf16
 * with tensorwise scaling): exactly the QKV, proj, fc1 and fc2 weights of the FP8 layers are stored
 * in one byte an element; every other parameter keeps its bf16 bytes at the address it has without
 * the flag modulo 256 (an FP8 weight 256-aligned); the storage is monotonic and without overlap;
 * the all-gather's bytes (the storage of every bucket) are the bf16 gather's less one byte per FP8
 * element, plus < 256 bytes of alignment per parameter. Without the flag the storage is offset x 2. */
static test_result fp8_storage_case(int llama) {
    mt_config c = test_config_sized(4, llama ? 128 : 112, 4, 32, 1000); /* 112: fc1's bias of 7 x 64 elements moves
                                                                     the FP8 weights after it off 256 bytes */
    if (llama) test_config_llama(&c);
    c.precision = MT_BF16;
    c.fp8_format = MT_FP8_HYBRID;
    c.fp8_recipe = MT_FP8_TENSORWISE;
    c.first_last_layers_bf16 = 1;
    test_config_parallel(&c, 1, 2, 0);
    test_config_ddp(&c, 1, 1, 1, 20000);
    mt_error err;
    mt_config plain = c;
    c.fp8_param_gather = 1;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    EXPECT_OK(mt_config_finalize(&plain, &err), &err);
    mt_buffer_layout b, p;
    EXPECT_OK(mt_buffer_layout_build(&b, &c, &err), &err);
    EXPECT_OK(mt_buffer_layout_build(&p, &plain, &err), &err);
    test_result r = TEST_PASS;
    int64_t fp8_elements = 0, end = 0;
    for (int i = 0; i < b.num_params && r == TEST_PASS; i++) {
        const mt_buffer_param* q = &b.params[i];
        const int weight = q->tensor == MT_P_QKV_WEIGHT || q->tensor == MT_P_PROJ_WEIGHT ||
                           q->tensor == MT_P_FC1_WEIGHT || q->tensor == MT_P_FC2_WEIGHT;
        const int want = weight && q->layer > 0 && q->layer < c.num_layers - 1;
        const int64_t width = q->fp8 ? 1 : 2;
        if (q->fp8 != want) { printf("    FAIL tensor %d layer %d: fp8 %d\n", q->tensor, q->layer, q->fp8); r = TEST_FAIL; }
        if (q->storage < end) { printf("    FAIL param %d overlaps the previous one in storage\n", i); r = TEST_FAIL; }
        if (q->storage % 256 != (q->fp8 ? 0 : q->offset * 2 % 256)) {
            printf("    FAIL param %d: storage %lld, buffer offset %lld\n", i, (long long)q->storage, (long long)q->offset);
            r = TEST_FAIL;
        }
        if (p.params[i].storage != p.params[i].offset * 2) { printf("    FAIL without the flag: param %d\n", i); r = TEST_FAIL; }
        for (int64_t j = 0; j <= q->numel; j += q->numel / 7 + 1) /* inside: storage + j x width */
            if (mt_buffer_storage_byte(&b, q->offset + j) != (j == 0 ? mt_buffer_storage_byte(&b, q->offset)
                                                                     : q->storage + j * width)) {
                printf("    FAIL param %d element %lld\n", i, (long long)j);
                r = TEST_FAIL;
                break;
            }
        end = q->storage + q->numel * width;
        fp8_elements += q->fp8 ? q->numel : 0;
    }
    int64_t previous = -1, gathered = 0;
    for (int64_t e = 0; e <= b.size && r == TEST_PASS; e += 61) {
        const int64_t at = mt_buffer_storage_byte(&b, e);
        if (at < previous) { printf("    FAIL storage byte of element %lld falls\n", (long long)e); r = TEST_FAIL; }
        previous = at;
    }
    for (int k = 0; k < b.num_buckets; k++)
        for (int rank = 0; rank < 2; rank++) {
            int64_t lo, hi;
            mt_bucket_shard(&b.buckets[k], 2, rank, &lo, &hi);
            gathered += mt_buffer_storage_byte(&b, hi) - mt_buffer_storage_byte(&b, lo);
        }
    const int64_t padding = b.storage_bytes - (2 * b.size - fp8_elements);
    printf("      %s: %lld of %lld elements in FP8; all-gather %lld bytes (bf16: %lld), %lld bytes of alignment\n",
           llama ? "llama" : "gpt2", (long long)fp8_elements, (long long)b.size, (long long)gathered,
           (long long)(2 * p.size), (long long)padding);
    if (r == TEST_PASS && (fp8_elements == 0 || gathered != b.storage_bytes || p.storage_bytes != 2 * p.size ||
                           padding < 0 || padding >= 256LL * b.num_params || p.size != b.size ||
                           (!llama && padding == 0))) {
        printf("    FAIL storage %lld bytes, gathered %lld\n", (long long)b.storage_bytes, (long long)gathered);
        r = TEST_FAIL;
    }
    mt_buffer_layout_free(&b);
    mt_buffer_layout_free(&p);
    return r;
}
static test_result test_buffer_layout_fp8_storage(void) {
    test_result r = fp8_storage_case(0);
    return r == TEST_PASS ? fp8_storage_case(1) : r;
}

static test_result test_layout_comparison(void); /* with the multi-GPU tests' layout comparison, below */

static const test_case data_parallel_tests[] = {
    {"buffer_layout_megatron_rules", test_buffer_layout_megatron_rules},
    {"buffer_layout_llama", test_buffer_layout_llama},
    {"buffer_layout_fp8_param_gather_storage", test_buffer_layout_fp8_storage},
    {"layout_comparison_catches_planted_errors", test_layout_comparison},
};

/* ---- multi-GPU tests ---- */

/* The small GPT of the DP tests: head dim 64 (bf16 runs the flash kernels), micro-batch 2, global
 * batch 16 (8 micro-batches at DP=1, 2 per rank at DP=4), 20000-element buckets (~30 of them). */
static mt_config dp_config(mt_precision precision, int dp, int dist, int overlap, int llama) {
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, precision);
    test_config_batch(&c, 2, 16);
    test_config_parallel(&c, 1, dp, 0);
    test_config_ddp(&c, dist, overlap, dist && overlap, 20000);
    test_config_this_rank(&c);
    return c;
}

/* This rank's share of a global batch [gbs, S+1], in Megatron's sampler order. */
static void dp_slice(const mt_config* c, const int32_t* global, int32_t* mine) {
    int mbs = c->micro_batch_size, dp = c->data_parallel_size, r = mt_rank_coordinates(c, c->rank).dp;
    int64_t row = c->seq_length + 1;
    for (int j = 0; j < mt_num_micro_batches(c); j++)
        for (int k = 0; k < mbs; k++) {
            int64_t index = mt_sampler_index((int64_t)j * mbs * dp, mbs, r, k);
            memcpy(mine + ((int64_t)j * mbs + k) * row, global + index * row, sizeof(int32_t) * row);
        }
}

/* A trainer of config c (finalized here, with a fresh NCCL id for several ranks). */
static test_result dp_create(mt_config* c, mt_trainer** t) {
    mt_error err;
    *t = NULL;
    if (c->world_size > 1) EXPECT_OK(fresh_comm_id(&c->comm_id, &err), &err);
    EXPECT_OK(mt_config_finalize(c, &err), &err);
    EXPECT_OK(mt_trainer_create(t, c, &err), &err);
    return TEST_PASS;
}

/* Steps [first, first + count) of the DP tests' data on config c (loading/saving as asked). */
static test_result dp_run(mt_config c, const char* load_dir, const char* save_dir, int first, int count,
                          double* losses, float* params_out) {
    mt_error err;
    mt_trainer* t = NULL;
    if (dp_create(&c, &t) != TEST_PASS) return TEST_FAIL;
    test_result res = TEST_PASS;
    int64_t row = c.seq_length + 1;
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    if (load_dir) {
        int64_t it = 0, consumed = 0;
        if (mt_trainer_load(t, load_dir, -1, &it, &consumed, &err) != MT_OK || it != first) {
            printf("    FAIL load: %s (iteration %lld)\n", err.message, (long long)it);
            res = TEST_FAIL;
        }
    }
    for (int k = first; k < first + count && res == TEST_PASS; k++) {
        fill_tokens(global, c.global_batch_size * row, (int)c.vocab_size, 1000 + k);
        dp_slice(&c, global, mine);
        mt_step_result r;
        if (mt_trainer_train_step(t, mine, &r, &err) != MT_OK) { printf("    FAIL step %d: %s\n", k, err.message); res = TEST_FAIL; }
        losses[k] = r.lm_loss;
    }
    if (res == TEST_PASS && save_dir && mt_trainer_save(t, save_dir, first + count, 0, &err) != MT_OK) {
        printf("    FAIL save: %s\n", err.message);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS && params_out && mt_trainer_get_parameters(t, params_out, &err) != MT_OK) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    free(global);
    free(mine);
    mt_trainer_free(t);
    return res;
}

/* The worst outcome over the ranks (fail > skip > pass), so that every rank leaves a loop together. */
static test_result tp_agree(test_result r) {
#ifdef MT_USE_MPI
    if (mpi_world() > 1) {
        int mine = r == TEST_FAIL ? 2 : r == TEST_SKIP ? 1 : 0, worst = 0;
        MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        return worst == 2 ? TEST_FAIL : worst == 1 ? TEST_SKIP : TEST_PASS;
    }
#endif
    return r;
}

/* 1 if every rank holds the same bytes (compares a 64-bit FNV-1a hash over the ranks). */
static int tp_same_on_all_ranks(const void* data, size_t bytes) {
    uint64_t x = 1469598103934665603ull;
    for (size_t i = 0; i < bytes; i++) x = (x ^ ((const unsigned char*)data)[i]) * 1099511628211ull;
#ifdef MT_USE_MPI
    if (mpi_world() > 1) {
        uint64_t lo = 0, hi = 0;
        MPI_Allreduce(&x, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(&x, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        return lo == hi;
    }
#endif
    return 1;
}

/* ---- One GPU against a parallel layout: the comparison every multi-GPU layout test runs ----
 *
 * A layout (DP with or without the distributed optimizer, TP, SP, PP, VP, their products, uneven
 * splits) trains the model of a one-GPU config on the same global batches (the DP tests' data: step k
 * is fill_tokens(1000 + k), each DP rank its share); every rank also trains it alone (TP = PP = DP =
 * 1) on its own GPU, the reference. From a fresh trainer: the initial weights, an optional probe (what
 * one test adds: logits, an evaluation), one compute_gradients over step 0's batch and its gradients,
 * `steps` train steps (the first on that batch again), the final weights. Gradients and weights are
 * read as the full model in canonical order (mt_trainer_get_gradients / _get_parameters gather the TP
 * shards and the distributed optimizer's DP shards; a pipeline stage gives its own tensors) and merged
 * over the ranks (layout_merge): every element must be held by some rank, and all the ranks that hold
 * it (TP and DP replicas, the tied word embeddings of the first and last stage) must hold the same
 * bits. Against one GPU (layout_compare):
 *   - the initial weights bitwise (initialisation depends only on seed, tensor and full index);
 *   - the gradient pass's loss and every step's loss and grad_norm (mt_step_result); the losses the
 *     same, bitwise, on every rank;
 *   - the first step's gradients, per tensor ||ours - one GPU's|| / ||one GPU's||, and per element
 *     |ours - one GPU's| <= bound x (rms + |one GPU's element|), rms over the tensor;
 *   - the final weights, per tensor against the training's movement, ||ours - one GPU's|| /
 *     ||one GPU's - initial||, and per element |ours - one GPU's| <= bound x (rms of the movement +
 *     |the element's movement|). Against the movement, not the weights: the norm weights start at 1
 *     and move ~1e-2 in 20 steps, so a norm over the weights hides a missing update.
 * The key-bias entries of qkv_bias are left out: their exact gradient is 0 and both sides hold noise
 * (tests/test_model.h), which Adam turns into steps of ~lr.
 *
 * Tolerances (layout_tolerance_of). fp32: a layout computes the same products and sums them in
 * another order (DP's sum over ranks, TP's partial GEMMs and vocab-parallel softmax, SP's partial
 * column sums, PP's column sum of a stage's last fc2 bias and the tied embedding's two halves): a few
 * ulps (2^-24) per sum, amplified by depth to ~1e-6 at most (the fp64 parity tests of
 * tests/test_model.h bound fp32 against exact arithmetic by 1e-5). Losses, gradients per tensor and
 * grad_norm 1e-5 (|norm(g + e) - norm(g)| <= norm(e): the gradients' bound bounds the norm's);
 * gradients per element 1e-4. Adam's update is scale-free, so the movement changes by about the
 * gradients' relative change: 1e-4 per tensor; per element 2e-2, since an element whose gradients
 * stay near 0 (the word-embedding rows of tokens the batches rarely hold) is moved by m / (sqrt(v) +
 * eps) with m and sqrt(v) of the size of the sums' rounding noise: measured on 4 H200s, word
 * embeddings' elements parted by 3.9e-3 (Llama TP=4) and 2.1e-3 (TP=2 x DP=2) of (rms + movement).
 * bf16: where a layout rounds activations differently (TP and SP: each partial sum is rounded to bf16,
 * 2^-9 relative, before it is added, where one GPU rounds the whole sum once; DP and PP at TP = 1 round
 * nothing differently), a gradient moves by a few 2^-9 per layer: 1e-2 per tensor (the TP tests' bound,
 * a third of bf16's parity bound against fp64), 0.25 per element (some 10 roundings of 2^-9 on the
 * path, of magnitudes that can exceed the element and the rms several times); measured on 4 H200s,
 * Llama with --qk-layernorm at TP=4 (more partial sums, and the query/key norms' rounding) reached
 * 1.1e-2 (ln2_weight), so 3e-2 per tensor; grad_norm 3e-2 at the first step (the same weights: the
 * gradients' bound bounds it) and 0.1 at the later ones, where the bf16 trajectories have parted: at
 * step 12, where one GPU's GPT-2 norm spikes (1.22), PP=4 gave 1.207 (1.1e-2 off), PP=2 x VP=2 x DP=2
 * 2.4e-2 and PP=2 x TP=2 SP 1.172 (4.0e-2) on 4 H200s, all with losses within 5.4e-4; losses 1e-3
 * (the bound). The movement: Adam's first steps are lr x sign(g), so an
 * element whose gradient is within the rounding noise of 0 (a fraction ~d of them at relative noise d)
 * may step the other way; that moves the first update by ~sqrt(3 d) in norm (0.1 at d = 3e-3), and
 * later steps, no longer sign-like, average it down to a few 1e-2 of the movement: 0.1 per tensor,
 * where an update lost in one of L layers gives 1/sqrt(L) >= 0.35 (L <= 8). Per element: Adam steps
 * each element by at most ~lr a step, so an element can part from one GPU's by at most its own
 * movement and the other's: 5 x (rms + |movement|), which still catches a NaN or an element read from
 * the wrong place (the initial weights' std, 0.02, is several times the movement's rms). */
typedef struct {
    double loss;                          /* relative, every step */
    double grad_norm, grad_norm_later;    /* relative: the first step's (the same weights), the later steps' */
    double grad_tensor, grad_element;     /* the first step's gradients */
    double weight_tensor, weight_element; /* the final weights, against one GPU's movement */
} layout_tolerance;

static layout_tolerance layout_tolerance_of(mt_precision precision) {
    const layout_tolerance fp32 = {1e-5, 1e-5, 1e-5, 1e-5, 1e-4, 1e-4, 2e-2};
    const layout_tolerance bf16 = {1e-3, 3e-2, 0.1, 3e-2, 0.25, 0.1, 5.0};
    return precision == MT_FP32 ? fp32 : bf16;
}

enum { LAYOUT_MAX_STEPS = 20 };
#define LAYOUT_UNHELD 0x7fa5a5a5u /* a NaN no kernel writes: an element this rank does not hold */

/* What one run leaves: full-model arrays in canonical order, merged over the ranks. */
typedef struct {
    int steps;
    double losses[LAYOUT_MAX_STEPS], grad_norms[LAYOUT_MAX_STEPS], gradient_loss;
    float *init, *grads, *weights;
    int64_t unheld, differ; /* elements no rank holds; elements whose holders disagree */
} layout_run;

/* What a test reads from the fresh trainer before its first step (out: the test's own). */
typedef test_result (*layout_probe)(mt_trainer* t, const mt_config* c, const int32_t* global, const int32_t* mine,
                                    void* out);

static float* layout_unheld_array(int64_t n) {
    uint32_t* a = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)n);
    for (int64_t i = 0; a && i < n; i++) a[i] = LAYOUT_UNHELD;
    return (float*)a;
}

/* Every rank's full-model array (LAYOUT_UNHELD where it holds nothing) merged over the world: each
 * element from the ranks that hold it; counts the elements no rank holds and those whose holders
 * hold different bits. Collective. */
static void layout_merge(float* values, int64_t n, int64_t* unheld, int64_t* differ) {
    uint32_t* v = (uint32_t*)values;
    *unheld = *differ = 0;
#ifdef MT_USE_MPI
    if (mpi_world() > 1) {
        uint32_t* lo = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)n);
        uint32_t* hi = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)n);
        for (int64_t i = 0; i < n; i++) {
            const int held = v[i] != LAYOUT_UNHELD;
            lo[i] = held ? v[i] : UINT32_MAX;
            hi[i] = held ? v[i] : 0;
        }
        MPI_Allreduce(MPI_IN_PLACE, lo, (int)n, MPI_UINT32_T, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, hi, (int)n, MPI_UINT32_T, MPI_MAX, MPI_COMM_WORLD);
        for (int64_t i = 0; i < n; i++) {
            if (lo[i] == UINT32_MAX && hi[i] == 0) {
                (*unheld)++;
                v[i] = LAYOUT_UNHELD;
            } else {
                *differ += lo[i] != hi[i];
                v[i] = lo[i];
            }
        }
        free(lo);
        free(hi);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) *unheld += v[i] == LAYOUT_UNHELD;
}

static void layout_run_free(layout_run* r) {
    free(r->init);
    free(r->grads);
    free(r->weights);
    memset(r, 0, sizeof(*r));
}

/* One run of config c (see above): every rank calls it; the result is agreed over the ranks. */
static test_result layout_train(mt_config c, int steps, layout_probe probe, void* probe_out, layout_run* out) {
    memset(out, 0, sizeof(*out));
    out->steps = steps;
    mt_error err;
    mt_config fin = c;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err); /* every rank alike */
    EXPECT(steps >= 1 && steps <= LAYOUT_MAX_STEPS, "%d steps", steps);
    const int64_t n = mt_num_parameters(&fin), row = fin.seq_length + 1, count = (int64_t)fin.global_batch_size * row;
    EXPECT(n < INT32_MAX, "%lld parameters: too many for one MPI call", (long long)n);
    out->init = layout_unheld_array(n);
    out->grads = layout_unheld_array(n);
    out->weights = layout_unheld_array(n);
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * (size_t)count);
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * (size_t)count);
    mt_trainer* t = NULL;
    test_result res = out->init && out->grads && out->weights && global && mine ? dp_create(&c, &t) : TEST_FAIL;
    mt_status st = res == TEST_PASS ? MT_OK : MT_ERR_CONFIG;
    fill_tokens(global, count, (int)fin.vocab_size, 1000);
    if (st == MT_OK) {
        dp_slice(&c, global, mine);
        st = mt_trainer_get_parameters(t, out->init, &err);
        if (st == MT_OK && probe && probe(t, &c, global, mine, probe_out) != TEST_PASS) res = TEST_FAIL;
        if (st == MT_OK) st = mt_trainer_compute_gradients(t, mine, mt_num_micro_batches(&c), &out->gradient_loss, &err);
        if (st == MT_OK) st = mt_trainer_get_gradients(t, out->grads, &err);
        for (int k = 0; k < steps && st == MT_OK; k++) {
            fill_tokens(global, count, (int)fin.vocab_size, 1000 + k);
            dp_slice(&c, global, mine);
            mt_step_result r;
            st = mt_trainer_train_step(t, mine, &r, &err);
            out->losses[k] = r.lm_loss;
            out->grad_norms[k] = r.grad_norm;
        }
        if (st == MT_OK) st = mt_trainer_get_parameters(t, out->weights, &err);
        if (st != MT_OK) printf("    FAIL %s\n", err.message);
    }
    if (st != MT_OK) res = TEST_FAIL;
    mt_trainer_free(t);
    free(global);
    free(mine);
    res = tp_agree(res);
    if (res == TEST_PASS && fin.world_size > 1) {
        int64_t unheld, differ;
        float* arrays[3] = {out->init, out->grads, out->weights};
        for (int k = 0; k < 3; k++) {
            layout_merge(arrays[k], n, &unheld, &differ);
            out->unheld += unheld;
            out->differ += differ;
        }
    }
    return res;
}

/* The one-GPU run every layout of a test is compared with. */
typedef struct {
    mt_config cfg; /* finalized */
    int64_t numel;
    unsigned char* mask; /* the key biases */
    layout_run run;
} layout_reference;

static void layout_reference_free(layout_reference* r) {
    layout_run_free(&r->run);
    free(r->mask);
    r->mask = NULL;
}

/* Trains one_gpu (TP = PP = DP = 1, world 1) on every rank. */
static test_result layout_reference_train(layout_reference* r, mt_config one_gpu, int steps, layout_probe probe,
                                          void* probe_out) {
    memset(r, 0, sizeof(*r));
    mt_error err;
    r->cfg = one_gpu;
    EXPECT_OK(mt_config_finalize(&r->cfg, &err), &err);
    EXPECT(r->cfg.world_size == 1, "the reference runs on one GPU, not %d", r->cfg.world_size);
    r->numel = mt_num_parameters(&r->cfg);
    r->mask = key_bias_mask(&r->cfg);
    return layout_train(one_gpu, steps, probe, probe_out, &r->run);
}

/* ||ours - ref|| / ||ref - base|| over one tensor (base NULL: / ||ref||) and, in *element, the worst
 * |ours - ref| / (rms + |ref - base|) over its elements (at *where); NaN counts as infinite. */
static double layout_tensor_error(const float* ours, const float* ref, const float* base, int64_t n,
                                  const unsigned char* skip, double* element, int64_t* where) {
    double num = 0, den = 0;
    int64_t used = 0;
    for (int64_t i = 0; i < n; i++) {
        if (skip && skip[i]) continue;
        const double r = base ? (double)ref[i] - base[i] : (double)ref[i], d = (double)ours[i] - ref[i];
        num += d * d;
        den += r * r;
        used++;
    }
    const double rms = used ? sqrt(den / (double)used) : 0.0;
    *element = 0;
    *where = -1;
    for (int64_t i = 0; i < n; i++) {
        if (skip && skip[i]) continue;
        const double r = base ? (double)ref[i] - base[i] : (double)ref[i], d = fabs((double)ours[i] - ref[i]);
        const double scale = rms + fabs(r), e = d == 0 ? 0.0 : scale > 0 ? d / scale : INFINITY;
        if (!(e <= *element)) { *element = e != e ? INFINITY : e; *where = i; }
    }
    if (num != num) return INFINITY;
    return den > 0 ? sqrt(num / den) : num > 0 ? INFINITY : 0.0;
}

/* Worst tensor and worst element of one full-model array against the reference's. */
typedef struct {
    double tensor, element;
    const char *tensor_name, *element_name;
    int64_t element_index;
} layout_worst;
static layout_worst layout_compare_arrays(const layout_reference* ref, const float* ours, const float* theirs,
                                          const float* base) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&ref->cfg, info);
    layout_worst w = {0, 0, "-", "-", -1};
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        if (info[i].numel == 0) continue;
        const int64_t at = info[i].offset;
        double element;
        int64_t where;
        const double e = layout_tensor_error(ours + at, theirs + at, base ? base + at : NULL, info[i].numel,
                                             ref->mask + at, &element, &where);
        if (!(e <= w.tensor)) { w.tensor = e; w.tensor_name = info[i].name; }
        if (!(element <= w.element)) { w.element = element; w.element_name = info[i].name; w.element_index = where; }
    }
    return w;
}

/* One run against the reference (see above); with report, prints one line and a line per failure.
 * Not collective. */
#define LAYOUT_SAY(...)                  \
    do {                                 \
        if (report) printf(__VA_ARGS__); \
    } while (0)
static test_result layout_compare(const char* name, const layout_reference* ref, const layout_run* run,
                                  const layout_tolerance* tol, int report) {
    const layout_run* one = &ref->run;
    const int64_t n = ref->numel;
    test_result res = TEST_PASS;
    if (run->unheld || run->differ) {
        LAYOUT_SAY("    FAIL %s: %lld elements held by no rank, %lld held with different values by the ranks that "
               "hold them\n", name, (long long)run->unheld, (long long)run->differ);
        res = TEST_FAIL;
    }
    if (memcmp(run->init, one->init, sizeof(float) * (size_t)n)) {
        int64_t j = 0;
        while (j < n && !memcmp(&run->init[j], &one->init[j], sizeof(float))) j++;
        LAYOUT_SAY("    FAIL %s: initial weights differ from one GPU's first at element %lld: %.9g vs %.9g\n", name,
               (long long)j, run->init[j], one->init[j]);
        res = TEST_FAIL;
    }
    double loss = fabs(run->gradient_loss - one->gradient_loss) / fabs(one->gradient_loss), norm = 0, norm_ratio = 0;
    int loss_step = -1, norm_step = 0, norm_fail_step = -1;
    for (int k = 0; k < one->steps; k++) {
        const double dl = fabs(run->losses[k] - one->losses[k]) / fabs(one->losses[k]);
        const double dn = fabs(run->grad_norms[k] - one->grad_norms[k]) / fabs(one->grad_norms[k]);
        const double ratio = dn / (k == 0 ? tol->grad_norm : tol->grad_norm_later); /* > 1: out of bounds */
        if (!(dl <= loss)) { loss = dl; loss_step = k; }
        if (!(dn <= norm)) { norm = dn; norm_step = k; }
        if (!(ratio <= norm_ratio)) { norm_ratio = ratio; norm_fail_step = k; }
    }
    const layout_worst g = layout_compare_arrays(ref, run->grads, one->grads, NULL);
    const layout_worst w = layout_compare_arrays(ref, run->weights, one->weights, one->init);
    const int last = one->steps - 1;
    LAYOUT_SAY("      %s: losses %.6f -> %.6f, worst relative difference to one GPU %.2e (step %d), grad norm %.2e "
           "(step %d); first-step gradients %.2e (%s), element %.2e (%s); weights' movement %.2e (%s), element "
           "%.2e (%s)\n", name, run->losses[0], run->losses[last], loss, loss_step, norm, norm_step, g.tensor,
           g.tensor_name, g.element, g.element_name, w.tensor, w.tensor_name, w.element, w.element_name);
    if (!(loss <= tol->loss)) {
        if (loss_step < 0) LAYOUT_SAY("    FAIL %s: gradient pass loss %.9f, one GPU %.9f\n", name, run->gradient_loss, one->gradient_loss);
        else LAYOUT_SAY("    FAIL %s step %d: loss %.9f, one GPU %.9f\n", name, loss_step, run->losses[loss_step], one->losses[loss_step]);
        res = TEST_FAIL;
    }
    if (!(norm_ratio <= 1.0)) {
        LAYOUT_SAY("    FAIL %s step %d: grad norm %.9g, one GPU %.9g (bound %.0e)\n", name, norm_fail_step,
               run->grad_norms[norm_fail_step], one->grad_norms[norm_fail_step],
               norm_fail_step == 0 ? tol->grad_norm : tol->grad_norm_later);
        res = TEST_FAIL;
    }
    if (!(g.tensor <= tol->grad_tensor)) {
        LAYOUT_SAY("    FAIL %s: the first step's gradient of %s differs by %.3e (bound %.0e)\n", name, g.tensor_name, g.tensor,
               tol->grad_tensor);
        res = TEST_FAIL;
    }
    if (!(g.element <= tol->grad_element)) {
        LAYOUT_SAY("    FAIL %s: the first step's gradient of %s[%lld] differs by %.3e of (rms + |value|) (bound %.0e)\n",
               name, g.element_name, (long long)g.element_index, g.element, tol->grad_element);
        res = TEST_FAIL;
    }
    if (!(w.tensor <= tol->weight_tensor)) {
        LAYOUT_SAY("    FAIL %s: the weights of %s differ by %.3e of one GPU's movement (bound %.0e)\n", name, w.tensor_name,
               w.tensor, tol->weight_tensor);
        res = TEST_FAIL;
    }
    if (!(w.element <= tol->weight_element)) {
        LAYOUT_SAY("    FAIL %s: the weight %s[%lld] differs by %.3e of (rms + |its movement|) (bound %.0e)\n", name,
               w.element_name, (long long)w.element_index, w.element, tol->weight_element);
        res = TEST_FAIL;
    }
    return res;
}
#undef LAYOUT_SAY

/* Trains layout c (the reference's model: the same parameters and padded vocabulary) as the reference
 * did and compares. Every rank calls it; the result is agreed over the ranks. */
static test_result layout_check(const char* name, mt_config c, const layout_reference* ref,
                                const layout_tolerance* tol, layout_probe probe, void* probe_out) {
    mt_error err;
    mt_config fin = c;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err);
    EXPECT(mt_num_parameters(&fin) == ref->numel && fin.padded_vocab_size == ref->cfg.padded_vocab_size,
           "%s: %lld parameters, vocabulary padded to %lld; one GPU %lld, %lld: not the same model", name,
           (long long)mt_num_parameters(&fin), (long long)fin.padded_vocab_size, (long long)ref->numel,
           (long long)ref->cfg.padded_vocab_size);
    layout_run run;
    test_result res = layout_train(c, ref->run.steps, probe, probe_out, &run);
    if (res == TEST_PASS && !tp_same_on_all_ranks(run.losses, sizeof(double) * (size_t)run.steps)) {
        printf("    FAIL %s: the ranks report different losses\n", name);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS) res = layout_compare(name, ref, &run, tol, 1);
    layout_run_free(&run);
    return tp_agree(res);
}

/* The comparison itself, on the host, against synthetic runs of a 4-layer GPT-2: a copy of the
 * reference passes, so do differences of the size its tolerances allow (fp32: 1e-7 relative; bf16:
 * 3e-3 of the gradients' rms, 2e-2 of the movement), and the key biases are not looked at; each
 * planted error fails it: one layer's fc2 bias gradient lost (the bug this comparison was written
 * for), one layer's fc2 bias or first norm weight not updated (the norm weight moves 5e-3 from 1:
 * invisible against the weight, plain against the movement), one gradient element or weight off
 * (NaN), a loss or grad norm off, the initial weights one ulp apart, an element no rank holds. */
static uint64_t layout_lcg = 1;
static float layout_uniform(void) { /* [-1, 1) */
    layout_lcg = layout_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(layout_lcg >> 11) / 4503599627370496.0 - 1.0);
}
static void layout_run_copy(layout_run* to, const layout_run* from, int64_t n) {
    *to = *from;
    to->init = (float*)malloc(sizeof(float) * (size_t)n);
    to->grads = (float*)malloc(sizeof(float) * (size_t)n);
    to->weights = (float*)malloc(sizeof(float) * (size_t)n);
    memcpy(to->init, from->init, sizeof(float) * (size_t)n);
    memcpy(to->grads, from->grads, sizeof(float) * (size_t)n);
    memcpy(to->weights, from->weights, sizeof(float) * (size_t)n);
}
static test_result test_layout_comparison(void) {
    layout_reference ref;
    memset(&ref, 0, sizeof(ref));
    ref.cfg = test_config(TEST_GPT2, MT_FP32);
    ref.cfg.num_layers = 4;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&ref.cfg, &err), &err);
    const int64_t n = ref.numel = mt_num_parameters(&ref.cfg);
    ref.mask = key_bias_mask(&ref.cfg);
    layout_run* one = &ref.run;
    one->steps = 20;
    one->init = (float*)malloc(sizeof(float) * (size_t)n);
    one->grads = (float*)malloc(sizeof(float) * (size_t)n);
    one->weights = (float*)malloc(sizeof(float) * (size_t)n);
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&ref.cfg, info);
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++)
        for (int64_t j = info[i].offset; j < info[i].offset + info[i].numel; j++) {
            one->init[j] = info[i].init == 0 ? 0.0f : info[i].init == 1 ? 1.0f : 0.02f * layout_uniform();
            one->grads[j] = 1e-3f * layout_uniform();
            one->weights[j] = one->init[j] + 5e-3f * layout_uniform();
        }
    one->gradient_loss = 7.0;
    for (int k = 0; k < 20; k++) one->losses[k] = 7.0 - 0.1 * k, one->grad_norms[k] = 2.0 - 0.05 * k;
    const layout_tolerance fp32 = layout_tolerance_of(MT_FP32), bf16 = layout_tolerance_of(MT_BF16);
    const int64_t fc2_bias = info[MT_P_FC2_BIAS].offset + info[MT_P_FC2_BIAS].numel / 4; /* layer 1's */
    const int64_t ln1 = info[MT_P_LN1_WEIGHT].offset + 2 * info[MT_P_LN1_WEIGHT].numel / 4; /* layer 2's */
    const int64_t h = ref.cfg.hidden_size, fc1 = info[MT_P_FC1_WEIGHT].offset + 12345;
    enum { COPY, FP32_NOISE, BF16_NOISE, KEY_BIAS, BIAS_GRAD, BIAS_STILL, NORM_STILL, GRAD_ELEMENT, WEIGHT_NAN, LOSS,
           NORM, INIT, UNHELD, CASES };
    static const char* names[CASES] = {"a copy", "fp32 noise", "bf16 noise", "noise in the key biases",
                                       "layer 1's fc2 bias gradient lost", "layer 1's fc2 bias not updated",
                                       "layer 2's first norm weight not updated", "one fc1 gradient element off",
                                       "a NaN weight", "a loss off by 2e-3", "the first grad norm off by 5e-2",
                                       "an initial weight one ulp off", "an element held by no rank"};
    /* expected: passes fp32's bounds, passes bf16's */
    static const int want[CASES][2] = {{1, 1}, {1, 1}, {0, 1}, {1, 1}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0},
                                       {0, 0}, {0, 0}, {0, 0}, {0, 0}};
    test_result res = TEST_PASS;
    for (int k = 0; k < CASES && res == TEST_PASS; k++) {
        layout_run r;
        layout_run_copy(&r, one, n);
        const double gs = 1e-3 / sqrt(3.0), ms = 5e-3 / sqrt(3.0); /* the gradients' and the movement's rms */
        switch (k) {
            case FP32_NOISE: case BF16_NOISE: {
                const double e = k == FP32_NOISE ? 1e-7 : 0;
                for (int64_t j = 0; j < n; j++) {
                    r.grads[j] += (float)((e ? e : 3e-3) * gs * layout_uniform());
                    r.weights[j] += (float)((e ? e : 2e-2) * ms * layout_uniform());
                }
                break;
            }
            case KEY_BIAS:
                for (int64_t j = 0; j < n; j++)
                    if (ref.mask[j]) r.grads[j] += 1.0f, r.weights[j] -= 1.0f;
                break;
            case BIAS_GRAD: for (int64_t j = 0; j < h; j++) r.grads[fc2_bias + j] = 0.0f; break;
            case BIAS_STILL: for (int64_t j = 0; j < h; j++) r.weights[fc2_bias + j] = r.init[fc2_bias + j]; break;
            case NORM_STILL: for (int64_t j = 0; j < h; j++) r.weights[ln1 + j] = r.init[ln1 + j]; break;
            case GRAD_ELEMENT: r.grads[fc1] += (float)(3 * gs); break;
            case WEIGHT_NAN: r.weights[fc1] = NAN; break;
            case LOSS: r.losses[7] *= 1.002; break;
            case NORM: r.grad_norms[0] *= 1.05; break;
            case INIT: r.init[fc1] = nextafterf(r.init[fc1], 1.0f); break;
            case UNHELD: r.unheld = 1; break;
        }
        for (int p = 0; p < 2; p++) {
            const int passed = layout_compare(names[k], &ref, &r, p ? &bf16 : &fp32, 0) == TEST_PASS;
            if (passed != want[k][p]) {
                printf("    FAIL %s: %s %s's bounds\n", names[k], passed ? "passes" : "fails", p ? "bf16" : "fp32");
                layout_compare(names[k], &ref, &r, p ? &bf16 : &fp32, 1);
                res = TEST_FAIL;
            }
        }
        layout_run_free(&r);
    }
    layout_reference_free(&ref);
    return res;
}

/* With dropout (tests/test_dropout.h) each sample's masks follow its number in the global batch
 * (Megatron's sampler order), so DP ranks draw DP=1's masks and the same tolerances hold. Every DP
 * variant against DP=1 through the layout comparison (above). */
static test_result dp_matches_single_dropout(mt_precision precision, int llama, double dropout) {
    REQUIRE_MPI_GPUS();
    int dp = mpi_world();
    mt_config base = dp_config(precision, 1, 0, 0, llama);
    base.hidden_dropout = base.attention_dropout = dropout;
    const layout_tolerance tol = layout_tolerance_of(precision);
    layout_reference ref;
    test_result res = layout_reference_train(&ref, base, 20, NULL, NULL);
    const char* names[4] = {"all-reduce", "all-reduce, overlapped", "distributed optimizer",
                            "distributed optimizer, overlapped reduce-scatter and all-gather"};
    for (int v = 0; v < 4 && res == TEST_PASS; v++) {
        mt_config c = dp_config(precision, dp, v >= 2, v % 2, llama);
        c.hidden_dropout = c.attention_dropout = dropout;
        char name[160];
        snprintf(name, sizeof(name), "%s %s DP=%d %s%s", llama ? "Llama" : "GPT-2", precision == MT_FP32 ? "fp32" : "bf16",
                 dp, names[v], dropout > 0 ? ", dropout" : "");
        res = layout_check(name, c, &ref, &tol, NULL, NULL);
    }
    layout_reference_free(&ref);
    return res;
}
static test_result dp_matches_single(mt_precision precision, int llama) {
    return dp_matches_single_dropout(precision, llama, 0.0);
}
static test_result test_dp_matches_single_fp32(void) { return dp_matches_single(MT_FP32, 0); }
static test_result test_dp_matches_single_dropout_fp32(void) { return dp_matches_single_dropout(MT_FP32, 0, 0.1); }
static test_result test_dp_matches_single_bf16(void) { return dp_matches_single(MT_BF16, 0); }
/* the Llama flavour's buffer (no biases, untied output weight in the first bucket) through every DP variant */
static test_result test_dp_matches_single_llama_bf16(void) { return dp_matches_single(MT_BF16, 1); }
static test_result test_dp_matches_single_llama_fp32(void) { return dp_matches_single(MT_FP32, 1); }

/* --grad-reduce-in-bf16: each bucket's fp32 gradients are rounded to bf16, summed over DP in bf16 and
 * widened, so every reduced gradient is a bf16 value (its low 16 bits zero; with the fp32 reduction
 * almost none is: the check that the bf16 path ran), and training stays within the bf16 layout bounds
 * of one GPU (layout_tolerance_of: one rounding of 2^-9 before the sum and one after it is inside the
 * 3e-2 per tensor and 0.25 per element that DP and TP's bf16 roundings are given), with the all-reduce
 * and with the distributed optimizer's overlapped reduce-scatter. */
static test_result dp_grad_reduce_bf16(int llama) {
    REQUIRE_MPI_GPUS();
    const int dp = mpi_world();
    const layout_tolerance tol = layout_tolerance_of(MT_BF16);
    layout_reference ref;
    test_result res = layout_reference_train(&ref, dp_config(MT_BF16, 1, 0, 0, llama), 20, NULL, NULL);
    for (int v = 0; v < 2 && res == TEST_PASS; v++) {
        mt_config c = dp_config(MT_BF16, dp, v, v, llama);
        c.grad_reduce_in_bf16 = 1;
        char name[128];
        snprintf(name, sizeof(name), "%s bf16 DP=%d %s, --grad-reduce-in-bf16", llama ? "Llama" : "GPT-2", dp,
                 v ? "distributed optimizer, overlapped" : "all-reduce");
        layout_run run;
        res = layout_train(c, ref.run.steps, NULL, NULL, &run);
        if (res == TEST_PASS) {
            int64_t wide = 0, held = 0;
            for (int64_t i = 0; i < ref.numel; i++) {
                uint32_t bits;
                memcpy(&bits, &run.grads[i], 4);
                if (bits == LAYOUT_UNHELD) continue;
                held++;
                wide += (bits & 0xffffu) != 0;
            }
            printf("      %s: %lld of %lld gradient elements not bf16 values\n", name, (long long)wide, (long long)held);
            if (wide != 0 || held != ref.numel) {
                printf("    FAIL %s: %lld reduced gradients are not bf16 values (%lld of %lld held)\n", name,
                       (long long)wide, (long long)held, (long long)ref.numel);
                res = TEST_FAIL;
            }
            if (layout_compare(name, &ref, &run, &tol, 1) != TEST_PASS) res = TEST_FAIL;
        }
        layout_run_free(&run);
        res = tp_agree(res);
    }
    layout_reference_free(&ref);
    return res;
}
static test_result test_dp_grad_reduce_bf16(void) { return dp_grad_reduce_bf16(0); }
static test_result test_dp_grad_reduce_bf16_llama(void) { return dp_grad_reduce_bf16(1); }

/* Two runs bitwise equal; 10 + save + load + 10 bitwise equal to 20 straight. */
static test_result dp_repeat_and_resume(mt_precision precision, int dist) {
    REQUIRE_MPI_GPUS();
    int dp = mpi_world();
    mt_config c = dp_config(precision, dp, dist, 1, 0);
    mt_error err;
    mt_config fin = c;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err);
    int64_t n = mt_num_parameters(&fin);
    double a[20], b[20], r[20];
    float* pa = (float*)malloc(sizeof(float) * n);
    float* pb = (float*)malloc(sizeof(float) * n);
    float* pr = (float*)malloc(sizeof(float) * n);
    /* one directory for all ranks (they share this node's /tmp), named by rank 0 */
    int tag = (int)getpid();
#ifdef MT_USE_MPI
    MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    char dir[256];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_dp_ckpt_%d_%d_%d", tag, (int)precision, dist);
    test_result res = dp_run(c, NULL, NULL, 0, 20, a, pa);
    if (res == TEST_PASS) res = dp_run(c, NULL, NULL, 0, 20, b, pb);
    if (res == TEST_PASS) res = dp_run(c, NULL, dir, 0, 10, r, NULL);
    if (res == TEST_PASS) res = dp_run(c, dir, NULL, 10, 10, r, pr);
    for (int k = 0; k < 20 && res == TEST_PASS; k++) {
        if (memcmp(&a[k], &b[k], sizeof(double))) { printf("    FAIL step %d: runs differ %.9g vs %.9g\n", k, a[k], b[k]); res = TEST_FAIL; }
        else if (memcmp(&a[k], &r[k], sizeof(double))) { printf("    FAIL step %d: resumed %.9g vs %.9g\n", k, r[k], a[k]); res = TEST_FAIL; }
    }
    if (res == TEST_PASS && memcmp(pa, pb, sizeof(float) * n)) { printf("    FAIL weights of two runs differ\n"); res = TEST_FAIL; }
    if (res == TEST_PASS && memcmp(pa, pr, sizeof(float) * n)) { printf("    FAIL weights after resume differ\n"); res = TEST_FAIL; }
    if (res == TEST_PASS) {
        /* the sharded checkpoint: one optimizer file per DP rank beside the model file */
        char path[512];
        snprintf(path, sizeof(path), "%s/iter_0000010/mp_rank_00/distrib_optim_dp%03d.bin", dir, dp - 1);
        if (dist && access(path, R_OK) != 0) { printf("    FAIL missing %s\n", path); res = TEST_FAIL; }
        printf("      DP=%d%s: losses %.6f -> %.6f, bitwise equal across runs and across save/load\n", dp,
               dist ? " with the distributed optimizer" : "", a[0], a[19]);
    }
#ifdef MT_USE_MPI
    MPI_Barrier(MPI_COMM_WORLD);
#endif
    if (mpi_rank() == 0) mt_remove_tree(dir);
    free(pa);
    free(pb);
    free(pr);
    return res;
}
static test_result test_dp_repeat_resume_bf16_distributed(void) { return dp_repeat_and_resume(MT_BF16, 1); }
static test_result test_dp_repeat_resume_fp32_allreduce(void) { return dp_repeat_and_resume(MT_FP32, 0); }

/* Model state per parameter of a GPT-2 124M: 18 bytes (bf16 weights 2, fp32 gradients 4, master 4,
 * Adam 8) without the distributed optimizer, 6 + 12/d with it, Megatron's table; padding adds
 * < 0.1% here. The device's accounting must agree with the plan to within 16 MiB (under 1% of the
 * state): cudaMalloc hands out 2 MiB pages, so each of the 5 allocations may round up by < 2 MiB,
 * plus a few MiB of driver bookkeeping (9 MiB observed on an H200). */
static test_result test_dp_memory_plan(void) {
    REQUIRE_MPI_GPUS();
    int dp = mpi_world();
    test_result res = TEST_PASS;
    for (int dist = 0; dist <= 1 && res == TEST_PASS; dist++) {
        mt_config c = dp_config(MT_BF16, dp, dist, 1, 0);
        c.num_layers = 12; c.hidden_size = 768; c.num_attention_heads = 12; c.vocab_size = 50257;
        c.seq_length = 128; c.micro_batch_size = 1; c.global_batch_size = dp;
        mt_error err;
        EXPECT_OK(fresh_comm_id(&c.comm_id, &err), &err);
        EXPECT_OK(mt_config_finalize(&c, &err), &err);
        mt_trainer* t = NULL;
        EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
        mt_memory_plan p = mt_trainer_memory_plan(t);
        mt_trainer_free(t);
        size_t state = p.parameter_bytes + p.master_bytes + p.gradient_bytes + p.optimizer_bytes;
        double per_param = (double)state / (double)p.num_parameters;
        double want = dist ? 6.0 + 12.0 / dp : 18.0;
        double measured_diff = fabs((double)p.state_bytes_measured - (double)state);
        printf("      DP=%d%s: %.3f bytes/param planned (Megatron: %.3f), %.1f MiB planned, device reported %.1f MiB\n",
               dp, dist ? " distributed optimizer" : "", per_param, want, state / 1048576.0,
               p.state_bytes_measured / 1048576.0);
        if (fabs(per_param - want) > 0.001 * want) { printf("    FAIL bytes per parameter\n"); res = TEST_FAIL; }
        if (measured_diff > 16.0 * 1048576.0) { printf("    FAIL device accounting differs by %.1f MiB\n", measured_diff / 1048576.0); res = TEST_FAIL; }
    }
    return res;
}

/* ---- --fp8-param-gather against the run without it ---- */

/* What a run of the FP8 tests leaves to compare: the step losses, the master weights, the FP8 state
 * after one more forward (which casts, or with the flag publishes and gathers, the last step's
 * weights): W and W^T of every FP8 linear, then scale, scale_inv and the amax histories; and the
 * bytes the last parameter all-gather assembled on a rank. */
typedef struct {
    double losses[12];
    float* params;
    uint8_t* fp8;              /* W and W^T of every FP8 linear, then scale, scale_inv, history */
    size_t fp8_size, weight_bytes, num_tensors, history_len;
    int64_t gather_bytes;
} fp8pg_run_result;

static void fp8pg_result_free(fp8pg_run_result* r) {
    free(r->params);
    free(r->fp8);
    memset(r, 0, sizeof(*r));
}

/* The FP8 weights and scaling state of trainer t, to the host (fp8_layer_linears names the copies). */
static int fp8pg_state(mt_trainer* t, fp8pg_run_result* out) {
    const mt_fp8_state* f = &t->fp8;
    const mt_shape s = model_shape(t);
    const mt_exec ex = trainer_exec(t);
    size_t weights = 0;
    for (int k = 0; k < FP8_LINEARS; k++) {
        int o, i;
        fp8_linear_dims(s, k, &o, &i);
        weights += 2 * (size_t)o * i;
    }
    const size_t nt = (size_t)f->num_tensors;
    out->weight_bytes = weights * f->num_layers;
    out->num_tensors = nt;
    out->history_len = (size_t)f->history_len;
    out->fp8_size = out->weight_bytes + nt * 4 * (2 + (size_t)f->history_len);
    out->fp8 = (uint8_t*)malloc(out->fp8_size);
    float* scale_inv = (float*)malloc(nt * 4 * FP8_SCALE_INV_STRIDE);
    if (!out->fp8 || !scale_inv || cudaStreamSynchronize(t->stream) != cudaSuccess) return 0;
    uint8_t* at = out->fp8;
    int ok = 1;
    for (int l = 0; l < s.L; l++) {
        fp8_linear L[FP8_LINEARS];
        if (!fp8_layer_linears<__nv_bfloat16>(t, &ex, l, false, L)) continue;
        for (int k = 0; k < FP8_LINEARS; k++) {
            int o, i;
            fp8_linear_dims(s, k, &o, &i);
            ok &= cudaMemcpy(at, L[k].w8, (size_t)o * i, cudaMemcpyDeviceToHost) == cudaSuccess;
            ok &= cudaMemcpy(at + (size_t)o * i, L[k].w8t, (size_t)o * i, cudaMemcpyDeviceToHost) == cudaSuccess;
            at += 2 * (size_t)o * i;
        }
    }
    ok &= cudaMemcpy(at, f->scale, nt * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
    ok &= cudaMemcpy(scale_inv, f->scale_inv, nt * 4 * FP8_SCALE_INV_STRIDE, cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t k = 0; k < nt; k++) memcpy(at + nt * 4 + k * 4, scale_inv + k * FP8_SCALE_INV_STRIDE, 4);
    ok &= cudaMemcpy(at + 2 * nt * 4, f->history, nt * 4 * f->history_len, cudaMemcpyDeviceToHost) == cudaSuccess;
    free(scale_inv);
    return ok;
}

/* Steps [first, first + count) of the DP tests' data on c (loading/saving as asked), then one
 * evaluation forward and the FP8 state. */
static test_result fp8pg_run(mt_config c, const char* load_dir, const char* save_dir, int first, int count,
                             fp8pg_run_result* out) {
    mt_error err;
    mt_trainer* t = NULL;
    if (dp_create(&c, &t) != TEST_PASS) return TEST_FAIL;
    test_result res = TEST_PASS;
    const int64_t row = c.seq_length + 1, n = mt_num_parameters(&c);
    int32_t* global = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    int32_t* mine = (int32_t*)malloc(sizeof(int32_t) * c.global_batch_size * row);
    out->params = (float*)malloc(sizeof(float) * n);
    int64_t it = 0, consumed = 0;
    if (load_dir && (mt_trainer_load(t, load_dir, -1, &it, &consumed, &err) != MT_OK || it != first)) {
        printf("    FAIL load: %s (iteration %lld)\n", err.message, (long long)it);
        res = TEST_FAIL;
    }
    for (int k = first; k <= first + count && res == TEST_PASS; k++) {
        fill_tokens(global, c.global_batch_size * row, (int)c.vocab_size, 1000 + k);
        dp_slice(&c, global, mine);
        mt_step_result r;
        double loss;
        if (k == first + count) { /* the evaluation forward */
            if (mt_trainer_evaluate(t, mine, mt_num_micro_batches(&c), &loss, &err) != MT_OK) res = TEST_FAIL;
        } else if (mt_trainer_train_step(t, mine, &r, &err) != MT_OK) {
            res = TEST_FAIL;
        } else {
            out->losses[k] = r.lm_loss;
        }
        if (res != TEST_PASS) printf("    FAIL step %d: %s\n", k, err.message);
        if (res == TEST_PASS && k == first + count - 1 && save_dir && mt_trainer_save(t, save_dir, k + 1, 0, &err) != MT_OK) {
            printf("    FAIL save: %s\n", err.message);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && mt_trainer_get_parameters(t, out->params, &err) != MT_OK) {
        printf("    FAIL get_parameters: %s\n", err.message);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS && !fp8pg_state(t, out)) {
        printf("    FAIL reading the FP8 state\n");
        res = TEST_FAIL;
    }
    out->gather_bytes = t->ddp.param_gather_bytes;
    free(global);
    free(mine);
    mt_trainer_free(t);
    return res;
}

/* One case on mpi_world() ranks (1: no gather, the storage, the publish and the transposes alone):
 * 12 steps without the flag (A), with it (B), and with it 6 steps, save, load, 6 steps (R). Both
 * runs cast the same bf16-rounded master weights with the same scales (see megatron.cu's section
 * 18), so everything is bitwise the same: A = B = R in losses, master weights, W and W^T bytes,
 * scales and histories; every rank holds the same FP8 weights and scales; the all-gather moves the
 * bf16 bytes less one byte per FP8 weight element (plus the storage's alignment padding). */
static test_result fp8_param_gather_case(int llama, int tensorwise, int overlap) {
    const int dp = mpi_world();
    mt_config c = dp_config(MT_BF16, dp, 1, overlap, llama);
    c.fp8_format = tensorwise ? MT_FP8_E4M3 : MT_FP8_HYBRID;
    c.fp8_recipe = tensorwise ? MT_FP8_TENSORWISE : MT_FP8_DELAYED;
    c.fp8_amax_history_len = 4;
    c.fp8_amax_compute_algo = MT_FP8_AMAX_MAX;
    mt_config g = c;
    g.fp8_param_gather = 1;
    mt_error err;
    mt_config fin = g;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err);
    const int64_t n = mt_num_parameters(&fin);
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &fin, &err), &err);
    int64_t fp8_elements = 0;
    for (int i = 0; i < B.num_params; i++) fp8_elements += B.params[i].fp8 ? B.params[i].numel : 0;
    const int64_t storage = B.storage_bytes, buffer = B.size;
    mt_buffer_layout_free(&B);
    int tag = (int)getpid();
#ifdef MT_USE_MPI
    if (dp > 1) MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    char dir[256];
    snprintf(dir, sizeof(dir), "/tmp/mt_test_fp8pg_%d_%d%d%d", tag, llama, tensorwise, overlap);
    const int several = dp > 1; /* MPI is initialised under mpirun only */
    (void)several;
    fp8pg_run_result a, b, r;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    memset(&r, 0, sizeof(r));
    test_result res = fp8pg_run(c, NULL, NULL, 0, 12, &a);
    if (res == TEST_PASS) res = fp8pg_run(g, NULL, NULL, 0, 12, &b);
    if (res == TEST_PASS) res = fp8pg_run(g, NULL, dir, 0, 6, &r);
    if (res == TEST_PASS) { /* the first 6 losses from the saving run, the rest from the resumed one */
        double saved[6];
        memcpy(saved, r.losses, sizeof(saved));
        fp8pg_result_free(&r);
        res = fp8pg_run(g, dir, NULL, 6, 6, &r);
        memcpy(r.losses, saved, sizeof(saved));
    }
    const char* name = llama ? (tensorwise ? "llama tensorwise" : "llama delayed") : (tensorwise ? "gpt2 tensorwise" : "gpt2 delayed");
    for (int k = 0; k < 12 && res == TEST_PASS; k++) {
        if (memcmp(&a.losses[k], &b.losses[k], sizeof(double))) {
            printf("    FAIL %s step %d: loss %.9g with --fp8-param-gather, %.9g without\n", name, k, b.losses[k], a.losses[k]);
            res = TEST_FAIL;
        } else if (memcmp(&b.losses[k], &r.losses[k], sizeof(double))) {
            printf("    FAIL %s step %d: resumed loss %.9g, straight %.9g\n", name, k, r.losses[k], b.losses[k]);
            res = TEST_FAIL;
        }
    }
    if (res == TEST_PASS && (memcmp(a.params, b.params, sizeof(float) * n) || memcmp(b.params, r.params, sizeof(float) * n))) {
        printf("    FAIL %s: master weights differ (with/without %d, resumed %d)\n", name,
               memcmp(a.params, b.params, sizeof(float) * n) != 0, memcmp(b.params, r.params, sizeof(float) * n) != 0);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS && (a.fp8_size != b.fp8_size || memcmp(a.fp8, b.fp8, a.fp8_size) || memcmp(b.fp8, r.fp8, b.fp8_size))) {
        printf("    FAIL %s: the FP8 weights or scaling state differ (%zu vs %zu bytes)\n", name, a.fp8_size, b.fp8_size);
        res = TEST_FAIL;
    }
    /* across the ranks: the FP8 weights and the weights' scaling state; with delayed scaling every
     * tensor's (amaxes reduced over the DP group), with tensorwise (current) scaling only the
     * weights': an input's or gradient's scale there comes from this rank's own micro-batch */
    uint64_t mine = 0;
    if (res == TEST_PASS) {
        std::vector<uint8_t> shared(b.fp8, b.fp8 + b.fp8_size);
        const size_t nt = b.num_tensors, hl = b.history_len, at = b.weight_bytes;
        for (size_t k = 0; tensorwise && k < nt; k++) {
            if (k % FP8_ROLES == FP8_W) continue;
            memset(&shared[at + 4 * k], 0, 4);                                           /* scale */
            memset(&shared[at + 4 * (nt + k)], 0, 4);                                    /* scale_inv */
            if (hl) memset(&shared[at + 4 * (2 * nt + k * hl)], 0, 4 * hl);              /* history */
        }
        mine = tt_fnv(shared.data(), shared.size());
    }
    uint64_t first = mine;
#ifdef MT_USE_MPI
    if (several) MPI_Bcast(&first, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
#endif
    if (res == TEST_PASS && mine != first) {
        printf("    FAIL %s: rank %d's FP8 weights and scales are not rank 0's\n", name, mpi_rank());
        res = TEST_FAIL;
    }
    if (res == TEST_PASS && dp > 1) {
        printf("      DP=%d %s%s: losses %.6f -> %.6f bitwise with and without the flag and across resume; all-gather "
               "%lld bytes, bf16 %lld: the %lld FP8 weight elements take %lld bytes less (%lld of alignment)\n", dp, name,
               overlap ? " overlapped" : "", b.losses[0], b.losses[11], (long long)b.gather_bytes,
               (long long)a.gather_bytes, (long long)fp8_elements, (long long)(a.gather_bytes - b.gather_bytes),
               (long long)(storage - (2 * buffer - fp8_elements)));
        if (!(a.gather_bytes == 2 * buffer && b.gather_bytes == storage && a.gather_bytes - b.gather_bytes <= fp8_elements &&
              a.gather_bytes - b.gather_bytes + 256 * 16 * (int64_t)c.num_layers >= fp8_elements)) {
            /* no early return: every rank must reach the barrier below */
            printf("    FAIL %s on rank %d: all-gather %lld bytes, bf16 %lld, storage %lld, buffer %lld\n", name, mpi_rank(),
                   (long long)b.gather_bytes, (long long)a.gather_bytes, (long long)storage, (long long)buffer);
            res = TEST_FAIL;
        }
    } else if (res == TEST_PASS) {
        printf("      DP=1 %s: losses %.6f -> %.6f bitwise with and without the flag and across resume\n", name,
               b.losses[0], b.losses[11]);
    }
#ifdef MT_USE_MPI
    if (several) MPI_Barrier(MPI_COMM_WORLD);
#endif
    if (mpi_rank() == 0) mt_remove_tree(dir);
    fp8pg_result_free(&a);
    fp8pg_result_free(&b);
    fp8pg_result_free(&r);
    return res;
}

/* GPT-2 and Llama, delayed (hybrid) and tensorwise (e4m3), with and without --overlap-param-gather */
static test_result test_fp8_param_gather_multigpu(void) {
    REQUIRE_MPI_GPUS();
    REQUIRE_FP8_GPU(); /* tests/test_fp8.h */
    const int cases[4][3] = {{0, 0, 1}, {0, 1, 0}, {1, 0, 0}, {1, 1, 1}}; /* llama, tensorwise, overlap */
    for (int i = 0; i < 4; i++)
        if (fp8_param_gather_case(cases[i][0], cases[i][1], cases[i][2]) != TEST_PASS) return TEST_FAIL;
    return TEST_PASS;
}
/* one GPU (DP = 1 with the distributed optimizer): the FP8 storage, the publish and the transposes */
static test_result test_fp8_param_gather_single_gpu(void) {
    REQUIRE_FP8_GPU();
    if (fp8_param_gather_case(0, 0, 0) != TEST_PASS) return TEST_FAIL;
    return fp8_param_gather_case(1, 1, 0);
}

static const test_case data_parallel_gpu_tests[] = {
    {"fp8_param_gather_single_gpu_bitwise", test_fp8_param_gather_single_gpu},
};

static const test_case data_parallel_multigpu_tests[] = {
    {"fp8_param_gather_dp_bitwise_resume_bytes", test_fp8_param_gather_multigpu},
    {"dp_matches_single_gpu_fp32", test_dp_matches_single_fp32},
    {"dp_matches_single_gpu_bf16", test_dp_matches_single_bf16},
    {"dp_matches_single_gpu_llama_bf16", test_dp_matches_single_llama_bf16},
    {"dp_matches_single_gpu_llama_fp32", test_dp_matches_single_llama_fp32},
    {"dp_matches_single_gpu_dropout_fp32", test_dp_matches_single_dropout_fp32},
    {"dp_grad_reduce_in_bf16_matches_single_gpu", test_dp_grad_reduce_bf16},
    {"dp_grad_reduce_in_bf16_matches_single_gpu_llama", test_dp_grad_reduce_bf16_llama},
    {"dp_repeatable_and_resumes_bf16_distributed_optimizer", test_dp_repeat_resume_bf16_distributed},
    {"dp_repeatable_and_resumes_fp32_allreduce", test_dp_repeat_resume_fp32_allreduce},
    {"dp_memory_plan_follows_megatron", test_dp_memory_plan},
};

#endif
