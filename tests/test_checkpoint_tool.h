/* tests/test_checkpoint_tool.h — checkpoint integrity and the offline tool (host only).
 *
 * The manifest (megatron.h section 13): CRC-32C against its published check value and computed in
 * pieces, manifest write/verify on a tree of files, and every kind of damage refused in one line
 * naming the file; mt_checkpoint_select falling back from a damaged tracked iteration to the newest
 * good one; the integrity rule every reader applies (mt_checkpoint_check_integrity: a failing manifest
 * or a lost one refused naming the file, a checkpoint from before manifests read with a warning,
 * --no-verify turning refusals into warnings) directly, through mt_checkpoint_select, and through the
 * tools as a user runs them (checkpoint_tool info / verify / reshard, convert_hf --export and --import,
 * eval_hellaswag when built, convert_mcore.py via dev/mcore_integrity_check.py when python3 has numpy),
 * and train_gpt's --no-verify-checkpoint flag. prepro/checkpoint_tool.h: synthetic checkpoints written here in the trainer's exact
 * format (megatron.cu section 20: headers as fill_header fills them, each rank's tensors laid out
 * through the DDP buffer layout's canonical offsets as canonical_transfer does, distributed-optimizer
 * shards bucket by bucket as copy_owned cuts them), random arrays, both flavours, tied and untied;
 * reshards TP1 -> TP2 -> TP1 x PP2 x VP2 -> TP2 x PP2 -> TP1 come back bitwise; a distributed-optimizer
 * checkpoint of several buckets reassembles exactly; verify catches a flipped byte, a truncated
 * file, a missing file and a missing manifest. One rank's file names, its headers' rank words and the
 * checks of a load at the same layout (each refusal's line); a save's directories, tidying and commit
 * on disk. GPU: the trainer's checkpoints verified, resharded
 * and resumed bitwise, a damaged tracked iteration skipped on load (with the warning), read under
 * --no-verify-checkpoint, and one whose manifest was deleted refused. */
#ifndef MT_TEST_CHECKPOINT_TOOL_H
#define MT_TEST_CHECKPOINT_TOOL_H

#include "test_configs.h"
#include "test_checkpoint.h"
#include "prepro/checkpoint_tool.h"

#include <signal.h>
#include <sys/resource.h>
#include <time.h>

static void ckt_dir(char* buf, size_t cap, const char* what) {
    snprintf(buf, cap, "/tmp/mt_test_ckt_%s_%d", what, (int)getpid());
    mt_remove_tree(buf);
}

static int ckt_write_bytes(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    return fclose(f) == 0 && w == n ? 0 : -1;
}

/* flips one bit of byte `at` of a file (at < 0: from the end) */
static int ckt_flip(const char* path, long at) {
    FILE* f = fopen(path, "r+b");
    if (!f) return -1;
    int c = fseek(f, at, at < 0 ? SEEK_END : SEEK_SET) == 0 ? fgetc(f) : EOF;
    int rc = c == EOF || fseek(f, -1, SEEK_CUR) != 0 || fputc(c ^ 0x10, f) == EOF ? -1 : 0;
    return fclose(f) == 0 ? rc : -1;
}

static test_result test_crc32c_streams(void) {
    /* the CRC-32C check value (RFC 3720 / the Castagnoli paper's "123456789") */
    EXPECT(mt_tb_crc32c("123456789", 9) == 0xe3069283u, "crc32c(123456789) = %08x", mt_tb_crc32c("123456789", 9));
    EXPECT(mt_crc32c_extend(0, "", 0) == 0, "empty");
    unsigned char buf[1000];
    uint32_t x = 12345;
    for (int i = 0; i < 1000; i++) { x = x * 1664525u + 1013904223u; buf[i] = (unsigned char)(x >> 24); }
    uint32_t whole = mt_crc32c_extend(0, buf, sizeof(buf));
    /* in pieces at odd boundaries (the 8-byte loop's tails), equal to the whole; the bit-by-bit
     * definition (the reference) on the same bytes */
    uint32_t pieces = 0;
    size_t cuts[] = {0, 1, 8, 13, 200, 201, 999, 1000};
    for (int i = 0; i + 1 < 8; i++) pieces = mt_crc32c_extend(pieces, buf + cuts[i], cuts[i + 1] - cuts[i]);
    uint32_t ref = 0xffffffffu;
    for (int i = 0; i < 1000; i++) {
        ref ^= buf[i];
        for (int k = 0; k < 8; k++) ref = (ref >> 1) ^ (0x82f63b78u & (0u - (ref & 1u)));
    }
    EXPECT(whole == pieces && whole == ~ref, "whole %08x, pieces %08x, bitwise %08x", whole, pieces, ~ref);
    return TEST_PASS;
}

/* a small tree: a.bin, sub/b.bin, sub/deeper/c.bin */
static test_result ckt_tree(const char* dir) {
    char path[600];
    EXPECT(mt_make_directories(dir) == 0, "mkdir %s", dir);
    snprintf(path, sizeof(path), "%s/sub/deeper", dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    const char* names[] = {"a.bin", "sub/b.bin", "sub/deeper/c bin"};
    for (int i = 0; i < 3; i++) {
        unsigned char data[3000];
        for (size_t k = 0; k < sizeof(data); k++) data[k] = (unsigned char)(k * 7 + i * 31);
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        EXPECT(ckt_write_bytes(path, data, 1000 * (size_t)(i + 1)) == 0, "write %s", path);
    }
    return TEST_PASS;
}

static test_result test_manifest_write_verify(void) {
    char dir[256], path[600];
    mt_error err;
    ckt_dir(dir, sizeof(dir), "manifest");
    struct { const char* what; int kind; const char* needle; } cases[] = {
        {"intact", 0, NULL},
        {"a flipped byte", 1, "sub/b.bin is corrupted"},
        {"a truncated file", 2, "sub/deeper/c bin has 2999 bytes, its manifest says 3000 (truncated)"},
        {"a missing file", 3, "a.bin is missing"},
        {"a file it does not list", 4, "sub/extra.bin is not in its manifest"},
        {"no manifest", 5, "manifest.txt"},
        {"a garbled manifest", 6, "is not '<crc32c> <size> <path>'"},
        {"a manifest path leaving the directory", 7, "is not '<crc32c> <size> <path>'"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_remove_tree(dir);
        if (ckt_tree(dir) != TEST_PASS) return TEST_FAIL;
        EXPECT_OK(mt_checkpoint_manifest_write(dir, &err), &err);
        switch (cases[i].kind) {
            case 1: snprintf(path, sizeof(path), "%s/sub/b.bin", dir); EXPECT(ckt_flip(path, 1234) == 0, "flip"); break;
            case 2: snprintf(path, sizeof(path), "%s/sub/deeper/c bin", dir); EXPECT(truncate(path, 2999) == 0, "truncate"); break;
            case 3: snprintf(path, sizeof(path), "%s/a.bin", dir); EXPECT(unlink(path) == 0, "unlink"); break;
            case 4: snprintf(path, sizeof(path), "%s/sub/extra.bin", dir); EXPECT(ckt_write_bytes(path, "x", 1) == 0, "extra"); break;
            case 5: snprintf(path, sizeof(path), "%s/manifest.txt", dir); EXPECT(unlink(path) == 0, "unlink"); break;
            case 6: case 7: {
                snprintf(path, sizeof(path), "%s/manifest.txt", dir);
                char* text = test_read_file(path, NULL);
                EXPECT(text != NULL, "read the manifest");
                char* second = strchr(strchr(text, '\n') + 1, '\n') + 1; /* the first file's line */
                if (cases[i].kind == 6) second[0] = 'z';
                else {
                    /* "<crc> 1000 a.bin" -> "<crc> 1000 ../a.b" (same length) */
                    char* name = strchr(strchr(second, ' ') + 1, ' ') + 1;
                    memcpy(name, "../a.", 5);
                }
                EXPECT(ckt_write_bytes(path, text, strlen(text)) == 0, "rewrite");
                free(text);
                break;
            }
        }
        err.message[0] = 0;
        mt_status st = mt_checkpoint_manifest_verify(dir, &err);
        if (!cases[i].needle) EXPECT_OK(st, &err);
        else EXPECT(st != MT_OK && strstr(err.message, cases[i].needle) && !strchr(err.message, '\n'),
                    "%s: status %s, message '%s'", cases[i].what, mt_status_name(st), err.message);
    }
    /* the manifest's own text: sorted paths, sizes, checksums of the contents */
    mt_remove_tree(dir);
    if (ckt_tree(dir) != TEST_PASS) return TEST_FAIL;
    EXPECT_OK(mt_checkpoint_manifest_write(dir, &err), &err);
    snprintf(path, sizeof(path), "%s/manifest.txt", dir);
    char* text = test_read_file(path, NULL);
    unsigned char data[1000];
    for (size_t k = 0; k < sizeof(data); k++) data[k] = (unsigned char)(k * 7);
    char want[200];
    snprintf(want, sizeof(want), "megatron.c checkpoint manifest 1\nfiles 3\n%08x 1000 a.bin\n", mt_tb_crc32c(data, 1000));
    EXPECT(text && !strncmp(text, want, strlen(want)) && strstr(text, " 2000 sub/b.bin\n") &&
           strstr(text, " 3000 sub/deeper/c bin\n"), "manifest:\n%s", text ? text : "(none)");
    free(text);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* The manifest from the writers' checksums (a trainer's save): the same text as reading the files;
 * a known entry whose size is not the file's is not trusted (the file is read); a known checksum is
 * taken as given, so a wrong one makes a manifest that verify refuses (the trainer's must be right). */
static test_result test_manifest_write_known(void) {
    char dir[256], path[600];
    mt_error err;
    ckt_dir(dir, sizeof(dir), "manifest_known");
    mt_remove_tree(dir);
    if (ckt_tree(dir) != TEST_PASS) return TEST_FAIL;
    EXPECT_OK(mt_checkpoint_manifest_write(dir, &err), &err);
    snprintf(path, sizeof(path), "%s/manifest.txt", dir);
    char* read_back = test_read_file(path, NULL);
    EXPECT(read_back != NULL, "read the manifest");
    unsigned char data[3000];
    for (size_t k = 0; k < sizeof(data); k++) data[k] = (unsigned char)(k * 7 + 1 * 31); /* sub/b.bin's bytes */
    mt_checkpoint_file_crc known[2] = {{"sub/b.bin", 2000, mt_tb_crc32c(data, 2000)}, {"a.bin", 999, 0xdeadbeefu}};
    EXPECT_OK(mt_checkpoint_manifest_write_known(dir, known, 2, &err), &err);
    char* from_known = test_read_file(path, NULL);
    EXPECT(from_known && !strcmp(read_back, from_known), "known checksums:\n%s\nread back:\n%s",
           from_known ? from_known : "(none)", read_back);
    EXPECT_OK(mt_checkpoint_manifest_verify(dir, &err), &err);
    /* a.bin's size right this time, its checksum wrong: taken as given, refused by verify */
    known[1].size = 1000;
    EXPECT_OK(mt_checkpoint_manifest_write_known(dir, known, 2, &err), &err);
    err.message[0] = 0;
    mt_status st = mt_checkpoint_manifest_verify(dir, &err);
    EXPECT(st != MT_OK && strstr(err.message, "a.bin is corrupted"), "status %s, message '%s'", mt_status_name(st),
           err.message);
    free(read_back);
    free(from_known);
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ---- synthetic checkpoints in the trainer's format ---------------------------------------- */

typedef struct {
    int llama, untied;
    int tp, pp, vp, dp;        /* dp > 0: the distributed optimizer over dp ranks */
    int overlap_grad_reduce;
    int64_t ddp_bucket_size;
    int fp8;                   /* an FP8 delayed-scaling tail (3 tensors, history 4) */
    int manifest;
    int record_ddp;            /* the distributed optimizer's bucket flags in the header (0: as older files) */
    int switches;              /* --qk-layernorm (its whole-on-every-TP-rank tensors) and, without SwiGLU,
                                  --squared-relu (a header word) */
    int64_t padded;            /* the padded vocabulary (0: Megatron's at tp, 128 x TP) */
    int moe;                   /* every layer MoE: 4 experts of width 16, top 2 of sigmoid scores, a gated shared
                                  expert of width 32, and the expert bias at the end of every model file */
    const float* expert_bias;  /* moe: the bias [4 layers, 4 experts] the files hold */
    int ep;                    /* moe: the experts over this many expert-parallel ranks (0 or 1: none); the
                                  data-parallel size is then dp (a multiple of ep), or ep without sharding */
} ckt_layout;

/* The tiny model: 4 layers, hidden 64, 4 heads in 2 query groups, vocabulary 300 (padded to 384 at
 * TP 1, 512 at TP 2, or to L->padded), GPT-2 (LayerNorm, learned positions, biases) or Llama (RMSNorm,
 * SwiGLU, rope, no biases). */
static void ckt_model(mt_config* c, const ckt_layout* L) {
    *c = test_config_sized(4, 64, 4, 32, 300);
    test_config_attention(c, 4, 2, 16, 128);
    c->max_position_embeddings = 32;
    c->padded_vocab_size = L->padded ? L->padded : mt_padded_vocab_size(300, 128, L->tp);
    c->precision = MT_BF16;
    if (L->llama) test_config_llama(c);
    c->untie_embeddings_and_output_weights = L->untied;
    c->qk_layernorm = L->switches;
    c->squared_relu = L->switches && !L->llama;
    if (L->moe) {
        c->num_experts = 4;
        c->moe_ffn_hidden_size = 16;
        c->moe_router_score_sigmoid = 1;
        c->moe_router_enable_expert_bias = 1;
        c->moe_shared_expert_intermediate_size = 32;
        c->moe_shared_expert_gate = 1;
    }
    const int ep = L->moe && L->ep > 1 ? L->ep : 1, dp = L->dp > 0 ? L->dp : ep;
    test_config_parallel(c, L->tp, L->tp * L->pp * dp, 0);
    c->pipeline_model_parallel_size = L->pp;
    c->virtual_pipeline_size = L->vp;
    c->data_parallel_size = dp;
    c->expert_model_parallel_size = ep;
    test_config_ddp(c, L->dp > 0, L->overlap_grad_reduce, 0, L->ddp_bucket_size);
}

static void ckt_random(float* x, int64_t n, uint32_t seed) {
    uint64_t s = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((int64_t)(s >> 40) - (1 << 23)) / (float)(1 << 20);
    }
}

static mt_status ckt_put(FILE* f, const void* data, size_t bytes, mt_error* err) {
    return fwrite(data, 1, bytes, f) == bytes ? MT_OK : mt_fail(err, MT_ERR_IO, "short write");
}

/* The elements of the distributed optimizer's shard that DP rank dp_rank of dp holds: its part of every bucket
 * of the buffer layout B. */
static int64_t ckt_shard_numel(const mt_buffer_layout* B, int dp, int dp_rank) {
    int64_t n = 0;
    for (int b = 0; b < B->num_buckets; b++) {
        int64_t begin, end;
        mt_bucket_shard(&B->buckets[b], dp, dp_rank, &begin, &end);
        n += end - begin;
    }
    return n;
}

/* A checkpoint header of model c for rank me at iteration `iteration`, loss scale 1. */
static void ckt_rank_header(int64_t* h, const mt_config* c, const mt_ckpt_rank* me, int64_t iteration) {
    mt_checkpoint_header_init(h, c);
    mt_checkpoint_header_set_rank(h, me);
    h[MT_CK_ITERATION] = iteration;
    const double one = 1.0;
    memcpy(&h[MT_CK_LOSS_SCALE_BITS], &one, sizeof(double));
}

/* Writes dir/iter_<iteration> and the tracker: every rank's files from the full canonical arrays. */
static mt_status ckt_write(const char* dir, int64_t iteration, const ckt_layout* L, float* const* full, mt_error* err) {
    char iter_dir[400], rank_dir[500], path[600];
    snprintf(iter_dir, sizeof(iter_dir), "%s/iter_%07lld", dir, (long long)iteration);
    if (mt_make_directories(iter_dir) != 0) return mt_fail(err, MT_ERR_IO, "mkdir %s", iter_dir);
    mt_status st = MT_OK;
    const int ep = L->moe && L->ep > 1 ? L->ep : 1;
    for (int m = 0; m < L->tp * ep && st == MT_OK; m++) /* model-parallel shard m: TP rank m % TP of EP rank m / TP */
        for (int s = 0; s < L->pp && st == MT_OK; s++) {
            const int t = m % L->tp, e = m / L->tp;
            mt_config c;
            ckt_model(&c, L);
            mt_rank_coords rk = {t, e, s}; /* DP rank e: EP rank e, the first holding its experts */
            c.rank = mt_rank_of(&c, rk);
            mt_buffer_layout B;
            st = mt_buffer_layout_build(&B, &c, err);
            if (st != MT_OK) break;
            mt_param_info info[MT_NUM_PARAM_TENSORS];
            const int64_t shard_numel = mt_param_layout_shard(&c, info), numel = B.canonical_size;
            float* shard = (float*)malloc(sizeof(float) * (size_t)shard_numel);
            float* part = (float*)malloc(sizeof(float) * (size_t)numel * 3);
            float* buffer = (float*)calloc((size_t)B.size * 3, sizeof(float));
            /* the rank's tensors, as the trainer's buffer layout places them in canonical order */
            for (int a = 0; a < 3; a++) {
                mt_tp_shard_copy(&c, m, full[a], shard, 1);
                for (int i = 0; i < B.num_params; i++) {
                    const mt_buffer_param* p = &B.params[i];
                    int layered = mt_param_per_layer(p->tensor);
                    const float* from = shard + info[p->tensor].offset + (layered ? (int64_t)p->layer * p->numel : 0);
                    memcpy(part + a * numel + p->canonical, from, sizeof(float) * (size_t)p->numel);
                    memcpy(buffer + a * B.size + p->offset, from, sizeof(float) * (size_t)p->numel);
                }
            }
            const int64_t dp_shard = L->dp > 0 ? ckt_shard_numel(&B, L->dp, 0) : 0;
            /* fill_header's words */
            int64_t h[MT_CK_HEADER_WORDS];
            mt_checkpoint_header_init(h, &c);
            h[MT_CK_ITERATION] = iteration;
            h[MT_CK_CONSUMED] = iteration * 8;
            h[MT_CK_SCHED_STEPS] = iteration * 8;
            h[MT_CK_ADAM_STEP] = iteration;
            h[MT_CK_GROWTH] = 3;
            h[MT_CK_HYSTERESIS] = 2;
            double scale = 1.0;
            memcpy(&h[MT_CK_LOSS_SCALE_BITS], &scale, sizeof(double));
            h[MT_CK_SHARDED_DP] = L->dp;
            h[MT_CK_SHARD_NUMEL] = dp_shard;
            h[MT_CK_DDP_OVERLAP] = L->dp > 0 && L->record_ddp ? 1 + L->overlap_grad_reduce : 0;
            h[MT_CK_DDP_BUCKET_SIZE] = L->dp > 0 && L->record_ddp ? L->ddp_bucket_size : 0;
            h[MT_CK_TP_RANK] = t;
            h[MT_CK_PP_RANK] = s;
            h[MT_CK_VP] = L->pp > 1 ? L->vp : 0;
            h[MT_CK_STAGE_NUMEL] = L->pp > 1 ? numel : 0;
            h[MT_CK_FP8_TENSORS] = L->fp8 ? 3 : 0;
            h[MT_CK_FP8_HISTORY_LEN] = L->fp8 ? 4 : 0;
            h[MT_CK_FP8_HISTORY_POS] = L->fp8 ? 1 : 0;
            h[MT_CK_MANIFESTED] = L->manifest != 0; /* committed with a manifest, as the trainer's are */
            h[MT_CK_EP] = ep > 1 ? ep : 0;
            h[MT_CK_EP_RANK] = e;
            h[MT_CK_DP_RANK] = e; /* the model file's writer */
            if (ep > 1 && L->pp > 1) snprintf(rank_dir, sizeof(rank_dir), "%s/mp_rank_%02d_%03d_%03d", iter_dir, t, s, e);
            else if (ep > 1) snprintf(rank_dir, sizeof(rank_dir), "%s/mp_rank_%02d_%03d", iter_dir, t, e); /* Megatron's */
            else mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), iter_dir, L->pp, t, s);
            if (mkdir(rank_dir, 0755) != 0) st = mt_fail(err, MT_ERR_IO, "mkdir %s", rank_dir);
            snprintf(path, sizeof(path), "%s/model_optim_rng.bin", rank_dir);
            FILE* f = st == MT_OK ? fopen(path, "wb") : NULL;
            if (st == MT_OK && !f) st = mt_fail(err, MT_ERR_IO, "create %s", path);
            if (st == MT_OK) st = ckt_put(f, h, sizeof(h), err);
            if (st == MT_OK) st = ckt_put(f, part, sizeof(float) * (size_t)numel * (L->dp > 0 ? 1 : 3), err);
            if (st == MT_OK && L->fp8) {
                float tail[3 * (1 + 4 + 4)];
                for (int i = 0; i < 27; i++) tail[i] = 0.5f + (float)i;
                st = ckt_put(f, tail, sizeof(tail), err);
            }
            if (st == MT_OK && L->moe) /* the trainer's last array: the whole bias in every model file */
                st = ckt_put(f, L->expert_bias, sizeof(float) * (size_t)c.num_layers * c.num_experts, err);
            if (f) fclose(f);
            /* the distributed optimizer: DP rank r's shard of every bucket of master, m, v */
            for (int r = e; r < L->dp && st == MT_OK; r += ep) { /* the DP ranks holding EP rank e's experts */
                h[MT_CK_DP_RANK] = r;
                snprintf(path, sizeof(path), "%s/distrib_optim_dp%03d.bin", rank_dir, r);
                f = fopen(path, "wb");
                if (!f) { st = mt_fail(err, MT_ERR_IO, "create %s", path); break; }
                st = ckt_put(f, h, sizeof(h), err);
                for (int a = 0; a < 3 && st == MT_OK; a++)
                    for (int b = 0; b < B.num_buckets && st == MT_OK; b++) {
                        int64_t begin, end;
                        mt_bucket_shard(&B.buckets[b], L->dp, r, &begin, &end);
                        st = ckt_put(f, buffer + a * B.size + begin, sizeof(float) * (size_t)(end - begin), err);
                    }
                fclose(f);
            }
            free(shard);
            free(part);
            free(buffer);
            mt_buffer_layout_free(&B);
        }
    if (st == MT_OK && L->manifest) st = mt_checkpoint_manifest_write(iter_dir, err);
    if (st == MT_OK) st = mt_checkpoint_write_tracker(dir, iteration, err);
    return st;
}

/* full canonical master, m, v of the model at L's padding, random (seeded) */
static float** ckt_arrays(const ckt_layout* L, uint32_t seed, int64_t* n) {
    mt_config c;
    ckt_model(&c, L);
    *n = mt_param_layout(&c, NULL);
    float** a = (float**)calloc(3, sizeof(float*));
    for (int i = 0; a && i < 3; i++) {
        a[i] = (float*)malloc(sizeof(float) * (size_t)*n);
        if (a[i]) ckt_random(a[i], *n, seed * 3 + (uint32_t)i);
    }
    return a;
}

/* The reference re-padding: full canonical arrays of model `from` in the padded vocabulary of model
 * `to` (the same model but for the padding): the vocabulary tensors' rows [0, min) copied, new rows 0. */
static void ckt_repad(const mt_config* from, const float* in, const mt_config* to, float* out) {
    mt_param_info a[MT_NUM_PARAM_TENSORS], b[MT_NUM_PARAM_TENSORS];
    mt_param_layout(from, a);
    mt_param_layout(to, b);
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        const int64_t n = a[i].numel < b[i].numel ? a[i].numel : b[i].numel;
        memcpy(out + b[i].offset, in + a[i].offset, sizeof(float) * (size_t)n);
        memset(out + b[i].offset + n, 0, sizeof(float) * (size_t)(b[i].numel - n));
    }
}

static void ckt_arrays_free(float** a) {
    for (int i = 0; a && i < 3; i++) free(a[i]);
    free(a);
}

/* reads checkpoint dir whole: its layout must be L's; returns 1 when its arrays equal `want` bitwise */
static int ckt_read_equal(const char* dir, const ckt_layout* L, float* const* want, int64_t n, mt_error* err) {
    mt_ckpt ck;
    if (mt_ckpt_open(&ck, dir, -1, err) != MT_OK) { printf("    open %s: %s\n", dir, err->message); return 0; }
    if (ck.tp != L->tp || ck.pp != L->pp || ck.vp != L->vp || mt_param_layout(&ck.cfg, NULL) != n) {
        printf("    %s: TP %d PP %d VP %d, %lld parameters; want %d %d %d, %lld\n", dir, ck.tp, ck.pp, ck.vp,
               (long long)mt_param_layout(&ck.cfg, NULL), L->tp, L->pp, L->vp, (long long)n);
        return 0;
    }
    mt_ckpt_ddp ddp = {L->overlap_grad_reduce, L->ddp_bucket_size};
    float* got[3];
    int equal = 1;
    for (int a = 0; a < 3; a++) got[a] = (float*)malloc(sizeof(float) * (size_t)n);
    if (mt_ckpt_read(&ck, &ddp, got, err) != MT_OK) { printf("    read %s: %s\n", dir, err->message); equal = 0; }
    for (int a = 0; a < 3 && equal; a++)
        for (int64_t i = 0; i < n && equal; i++)
            if (memcmp(&got[a][i], &want[a][i], sizeof(float))) {
                printf("    %s: array %d element %lld is %g, want %g\n", dir, a, (long long)i, got[a][i], want[a][i]);
                equal = 0;
            }
    for (int a = 0; a < 3; a++) free(got[a]);
    return equal;
}

/* TP1 -> TP2 -> TP1 x PP2 x VP2 -> TP2 x PP2 -> TP1, each step read back and compared: the original
 * arrays bitwise (TP1's padding, 384 rows, kept at TP2: it divides by 2), headers valid, manifests
 * good. Then a padding that must change: 301 rows (saved with --make-vocab-size-divisible-by 301)
 * resharded to TP2 are re-padded to Megatron's 512 (new rows zero). */
static test_result ckt_round_trip(int llama, int untied, int switches) {
    char root[256], src[400], out[400];
    ckt_dir(root, sizeof(root), switches ? (llama ? "llama_qk" : "gpt_qk_sqrelu")
                                : llama ? (untied ? "llama_untied" : "llama_tied") : (untied ? "gpt_untied" : "gpt_tied"));
    mt_error err;
    ckt_layout L = {llama, untied, 1, 1, 1, 0, 0, 0, 1 /* FP8 state: dropped */, 1, 0, switches};
    int64_t n1, n2, n301;
    L.padded = 384;
    float** a1 = ckt_arrays(&L, 7, &n1);
    snprintf(src, sizeof(src), "%s/src", root);
    EXPECT_OK(ckt_write(src, 40, &L, a1, &err), &err);
    /* 301 rows, and Megatron's TP2 padding of them (512): the first 301 rows copied, the new ones zero */
    ckt_layout L301 = L, L2 = L;
    L301.padded = 301;
    L301.fp8 = 0;
    L2.tp = 2;
    L2.padded = 0;
    float** a301 = ckt_arrays(&L301, 5, &n301);
    float** a2 = ckt_arrays(&L2, 0, &n2);
    mt_config c1, c2;
    ckt_model(&c1, &L301);
    ckt_model(&c2, &L2);
    EXPECT(n2 > n301, "TP2 pads the vocabulary further (%lld vs %lld)", (long long)n2, (long long)n301);
    for (int a = 0; a < 3; a++) ckt_repad(&c1, a301[a], &c2, a2[a]);
    /* the re-padding itself: every tensor's elements kept, the vocabulary tensors grown by zero rows */
    mt_param_info i1[MT_NUM_PARAM_TENSORS], i2[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&c1, i1);
    mt_param_layout(&c2, i2);
    for (int a = 0; a < 3; a++)
        for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
            const int vocab = i == MT_P_WORD_EMBEDDINGS || i == MT_P_OUTPUT_WEIGHT;
            EXPECT(vocab || i1[i].numel == i2[i].numel, "tensor %d changed size", i);
            EXPECT(!memcmp(a2[a] + i2[i].offset, a301[a] + i1[i].offset, sizeof(float) * (size_t)i1[i].numel),
                   "tensor %d's elements moved", i);
            for (int64_t k = i1[i].numel; k < i2[i].numel; k++)
                EXPECT(a2[a][i2[i].offset + k] == 0.0f && !signbit(a2[a][i2[i].offset + k]), "padding %d not zero", i);
            EXPECT(!vocab || i1[i].numel == 0 || i2[i].numel == i1[i].numel / 301 * 512, "tensor %d: %lld rows", i,
                   (long long)i2[i].numel);
        }
    snprintf(out, sizeof(out), "%s/src301", root);
    EXPECT_OK(ckt_write(out, 40, &L301, a301, &err), &err);
    {
        char repadded[400];
        snprintf(repadded, sizeof(repadded), "%s/repadded", root);
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, out, -1, &err), &err);
        EXPECT_OK(mt_ckpt_reshard(&ck, NULL, repadded, 2, 1, 1, 128, NULL, &err), &err);
        EXPECT(ckt_read_equal(repadded, &L2, a2, n2, &err), "301 rows at TP 2: not re-padded to 512 as Megatron pads");
    }
    struct { int tp, pp, vp; } steps[] = {{2, 1, 1}, {1, 2, 2}, {2, 2, 1}, {1, 1, 1}};
    const char* prev = src;
    char prev_buf[400];
    for (int k = 0; k < 4; k++) {
        snprintf(out, sizeof(out), "%s/step%d", root, k);
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, prev, -1, &err), &err);
        int dropped = -1;
        EXPECT_OK(mt_ckpt_reshard(&ck, NULL, out, steps[k].tp, steps[k].pp, steps[k].vp, 128, &dropped, &err), &err);
        EXPECT(dropped == (k == 0), "step %d: FP8 state dropped %d", k, dropped);
        ckt_layout Lk = L;
        Lk.tp = steps[k].tp;
        Lk.pp = steps[k].pp;
        Lk.vp = steps[k].vp;
        EXPECT(ckt_read_equal(out, &Lk, a1, n1, &err), "step %d (TP %d PP %d VP %d) differs", k, Lk.tp, Lk.pp, Lk.vp);
        EXPECT_OK(mt_ckpt_open(&ck, out, -1, &err), &err);
        EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
        EXPECT(ck.header[MT_CK_ITERATION] == 40 && ck.header[MT_CK_CONSUMED] == 320 && ck.header[MT_CK_ADAM_STEP] == 40 &&
               ck.header[MT_CK_FP8_TENSORS] == 0 && ck.header[MT_CK_TRUE_VOCAB] == 300 && ck.header[MT_CK_MANIFESTED] == 1,
               "step %d: progress words not carried (or no manifest mark)", k);
        snprintf(prev_buf, sizeof(prev_buf), "%s", out);
        prev = prev_buf;
    }
    /* the tool's files are the trainer's, byte for byte: step 2 (TP2 x PP2) against the same arrays
     * written here in the trainer's layout */
    ckt_layout L22 = L;
    L22.tp = 2;
    L22.pp = 2;
    L22.fp8 = 0;
    snprintf(out, sizeof(out), "%s/synthetic", root);
    EXPECT_OK(ckt_write(out, 40, &L22, a1, &err), &err);
    for (int t = 0; t < 2; t++)
        for (int s = 0; s < 2; s++) {
            char p1[600], p2[600];
            size_t n_a = 0, n_b = 0;
            snprintf(p1, sizeof(p1), "%s/step2/iter_0000040/mp_rank_%02d_%03d/model_optim_rng.bin", root, t, s);
            snprintf(p2, sizeof(p2), "%s/synthetic/iter_0000040/mp_rank_%02d_%03d/model_optim_rng.bin", root, t, s);
            char* x = test_read_file(p1, &n_a);
            char* y = test_read_file(p2, &n_b);
            EXPECT(x && y && n_a == n_b && !memcmp(x, y, n_a), "%s differs from the trainer's layout", p1);
            free(x);
            free(y);
        }
    snprintf(out, sizeof(out), "%s/step3", root);
    /* an output that already holds the iteration is refused */
    mt_ckpt ck;
    EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
    EXPECT(mt_ckpt_reshard(&ck, NULL, out, 1, 1, 1, 128, NULL, &err) == MT_ERR_IO && strstr(err.message, "already exists"),
           "%s", err.message);
    /* a layout the model does not divide into: 4 heads over TP 8 ... refused before writing */
    snprintf(out, sizeof(out), "%s/bad", root);
    EXPECT(mt_ckpt_reshard(&ck, NULL, out, 8, 1, 1, 128, NULL, &err) == MT_ERR_FORMAT &&
           strstr(err.message, "does not divide"), "%s", err.message);
    EXPECT(mt_ckpt_reshard(&ck, NULL, out, 1, 3, 1, 128, NULL, &err) == MT_ERR_CONFIG && strstr(err.message, "split"),
           "%s", err.message);
    ckt_arrays_free(a1);
    ckt_arrays_free(a2);
    ckt_arrays_free(a301);
    mt_remove_tree(root);
    return TEST_PASS;
}

static test_result test_reshard_gpt2_tied(void) { return ckt_round_trip(0, 0, 0); }
static test_result test_reshard_gpt2_untied(void) { return ckt_round_trip(0, 1, 0); }
static test_result test_reshard_llama_untied(void) { return ckt_round_trip(1, 1, 0); }
static test_result test_reshard_llama_tied(void) { return ckt_round_trip(1, 0, 0); }
/* --qk-layernorm's query and key norms (whole on every TP rank, per layer: each PP stage its layers')
 * with LayerNorm's biases and --squared-relu's header word (GPT-2), and RMSNorm's weights (Llama) */
static test_result test_reshard_gpt2_qk_layernorm(void) { return ckt_round_trip(0, 0, 1); }
static test_result test_reshard_llama_qk_layernorm(void) { return ckt_round_trip(1, 1, 1); }

/* A distributed-optimizer checkpoint (TP2 x PP2 x DP2, several buckets) assembles exactly, given the
 * run's bucket flags; other flags are refused naming them. */
static test_result test_reshard_distributed_optimizer(void) {
    char root[256], src[400], out[400];
    ckt_dir(root, sizeof(root), "distopt");
    mt_error err;
    ckt_layout L = {1, 1, 2, 2, 1, 2, 1, 3000, 0, 1};
    int64_t n;
    float** a = ckt_arrays(&L, 11, &n);
    snprintf(src, sizeof(src), "%s/src", root);
    EXPECT_OK(ckt_write(src, 5, &L, a, &err), &err);
    mt_ckpt ck;
    EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
    EXPECT(ck.sharded_dp == 2, "sharded over %d", ck.sharded_dp);
    mt_ckpt_ddp ddp = {1, 3000};
    /* the buckets: more than one per rank, or this test tests less than it says */
    mt_config c;
    ckt_model(&c, &L);
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
    int buckets = B.num_buckets;
    mt_buffer_layout_free(&B);
    EXPECT(buckets > 2, "%d buckets", buckets);
    EXPECT_OK(mt_ckpt_verify(&ck, &ddp, &err), &err);
    EXPECT(ckt_read_equal(src, &L, a, n, &err), "the distributed-optimizer checkpoint reads back other arrays");
    mt_ckpt_ddp wrong = {0, 0};
    snprintf(out, sizeof(out), "%s/tp2", root);
    EXPECT(mt_ckpt_reshard(&ck, &wrong, out, 2, 1, 1, 128, NULL, &err) == MT_ERR_CONFIG &&
           strstr(err.message, "--overlap-grad-reduce and --ddp-bucket-size"), "%s", err.message);
    EXPECT_OK(mt_ckpt_reshard(&ck, &ddp, out, 2, 1, 1, 128, NULL, &err), &err);
    ckt_layout plain = {1, 1, 2, 1, 1, 0, 0, 0, 0, 1};
    EXPECT(ckt_read_equal(out, &plain, a, n, &err), "resharded from the distributed optimizer: arrays differ");
    /* with the buckets in the header (as the trainer writes them now) no flags are needed, and wrong ones are ignored */
    L.record_ddp = 1;
    snprintf(src, sizeof(src), "%s/recorded", root);
    EXPECT_OK(ckt_write(src, 5, &L, a, &err), &err);
    EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
    EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
    snprintf(out, sizeof(out), "%s/tp2_recorded", root);
    EXPECT_OK(mt_ckpt_reshard(&ck, &wrong, out, 2, 1, 1, 128, NULL, &err), &err);
    EXPECT(ckt_read_equal(out, &plain, a, n, &err), "resharded from recorded buckets: arrays differ");
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* mt_ckpt_read_part, the trainer's --load at another layout: every rank of every target layout
 * (TP 1/2, PP 1/2 with VP 1/2, DP 2 with the distributed optimizer, which leaves a rank's part
 * unchanged) reads from each source layout (a plain TP1; TP1 x PP2 x VP2; TP2 x PP2 x DP2 with the
 * distributed optimizer over several buckets) exactly the part the reference cuts from the full
 * arrays (the target's vocabulary padding applied by ckt_repad, mt_tp_shard_copy, then the target
 * rank's buffer layout's canonical offsets, as ckt_write lays out a file), bitwise; another model is
 * refused in one line. */
static test_result test_read_part_any_layout(void) {
    char root[256], src[400];
    ckt_dir(root, sizeof(root), "read_part");
    mt_error err;
    ckt_layout sources[] = {
        {1, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0},
        {0, 0, 1, 2, 2, 0, 0, 0, 1, 1, 0},
        {1, 1, 2, 2, 1, 2, 1, 3000, 0, 1, 0},
    };
    struct { int tp, pp, vp, dp; } targets[] = {{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 2, 2, 1}, {2, 2, 1, 1}, {1, 2, 1, 2}, {2, 1, 1, 2}};
    int compared = 0;
    for (size_t si = 0; si < sizeof(sources) / sizeof(sources[0]); si++) {
        const ckt_layout* S = &sources[si];
        int64_t n_src;
        float** a = ckt_arrays(S, 21 + (uint32_t)si, &n_src);
        snprintf(src, sizeof(src), "%s/src%zu", root, si);
        EXPECT_OK(ckt_write(src, 12, S, a, &err), &err);
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
        mt_ckpt_ddp ddp = {S->overlap_grad_reduce, S->ddp_bucket_size};
        mt_config cs;
        ckt_model(&cs, S);
        for (size_t ti = 0; ti < sizeof(targets) / sizeof(targets[0]); ti++) {
            ckt_layout T = *S;
            T.tp = targets[ti].tp;
            T.pp = targets[ti].pp;
            T.vp = targets[ti].vp;
            T.dp = targets[ti].dp > 1 ? targets[ti].dp : 0;
            int64_t n_dst;
            float** want = ckt_arrays(&T, 0, &n_dst);
            mt_config ct;
            ckt_model(&ct, &T);
            for (int k = 0; k < 3; k++) ckt_repad(&cs, a[k], &ct, want[k]);
            for (int rank = 0; rank < ct.world_size; rank++) {
                mt_config c = ct;
                c.rank = rank;
                mt_rank_coords rk = mt_rank_coordinates(&c, rank);
                mt_buffer_layout B;
                EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
                mt_param_info info[MT_NUM_PARAM_TENSORS];
                const int64_t shard_numel = mt_param_layout_shard(&c, info);
                float* shard = (float*)malloc(sizeof(float) * (size_t)shard_numel);
                float* ref = (float*)malloc(sizeof(float) * (size_t)B.canonical_size);
                float* got = (float*)malloc(sizeof(float) * (size_t)B.canonical_size);
                for (int k = 0; k < 3; k++) {
                    mt_tp_shard_copy(&c, rk.tp, want[k], shard, 1);
                    for (int i = 0; i < B.num_params; i++) {
                        const mt_buffer_param* p = &B.params[i];
                        int layered = mt_param_per_layer(p->tensor);
                        memcpy(ref + p->canonical, shard + info[p->tensor].offset + (layered ? (int64_t)p->layer * p->numel : 0),
                               sizeof(float) * (size_t)p->numel);
                    }
                    mt_status st = mt_ckpt_read_part(&ck, &ddp, &c, k, got, &err);
                    int same = st == MT_OK && !memcmp(ref, got, sizeof(float) * (size_t)B.canonical_size);
                    if (!same) {
                        printf("    source %zu -> TP %d PP %d VP %d DP %d, rank %d, array %d: %s\n", si, T.tp, T.pp,
                               T.vp, targets[ti].dp, rank, k, st == MT_OK ? "differs" : err.message);
                        return TEST_FAIL;
                    }
                    compared++;
                }
                free(shard);
                free(ref);
                free(got);
                mt_buffer_layout_free(&B);
            }
            ckt_arrays_free(want);
        }
        /* another model: more layers, or another hidden size */
        mt_config other = cs;
        other.num_layers = 6;
        float one[1];
        EXPECT(mt_ckpt_read_part(&ck, &ddp, &other, 0, one, &err) == MT_ERR_CONFIG && strstr(err.message, "layers") &&
               !strchr(err.message, '\n'), "%s", err.message);
        other = cs;
        other.hidden_size = 128;
        EXPECT(mt_ckpt_read_part(&ck, &ddp, &other, 0, one, &err) == MT_ERR_CONFIG && strstr(err.message, "another model"),
               "%s", err.message);
        ckt_arrays_free(a);
    }
    printf("      %d parts (rank x array) read at another layout, bitwise\n", compared);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* verify: a flipped byte, a truncated file, a missing file, a missing manifest, a checkpoint from before
 * manifests (which the readers take with a warning but verify cannot vouch for); each one line naming it */
static test_result test_verify_catches_damage(void) {
    char root[256], path[600];
    ckt_dir(root, sizeof(root), "verify");
    mt_error err;
    ckt_layout L = {0, 0, 2, 2, 1, 0, 0, 0, 0, 1};
    int64_t n;
    float** a = ckt_arrays(&L, 3, &n);
    struct { const char* what; int kind; const char* needle; } cases[] = {
        {"intact", 0, NULL},
        {"a flipped byte in the arrays", 1, "mp_rank_01_001/model_optim_rng.bin is corrupted"},
        {"a flipped byte in a header", 2, "mp_rank_00_001/model_optim_rng.bin"},
        {"a truncated file", 3, "mp_rank_01_000/model_optim_rng.bin has"},
        {"a missing file", 4, "mp_rank_00_001/model_optim_rng.bin"},
        {"a missing manifest", 5, "has no manifest.txt but was saved with one"},
        {"from before manifests (no manifest, mark 0)", 6, "saved before manifests, it cannot be verified"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_remove_tree(root);
        L.manifest = cases[i].kind != 6;
        EXPECT_OK(ckt_write(root, 9, &L, a, &err), &err);
        switch (cases[i].kind) {
            case 1: snprintf(path, sizeof(path), "%s/iter_0000009/mp_rank_01_001/model_optim_rng.bin", root); EXPECT(ckt_flip(path, -100) == 0, "flip"); break;
            case 2: snprintf(path, sizeof(path), "%s/iter_0000009/mp_rank_00_001/model_optim_rng.bin", root); EXPECT(ckt_flip(path, 8 * MT_CK_HIDDEN) == 0, "flip"); break;
            case 3: snprintf(path, sizeof(path), "%s/iter_0000009/mp_rank_01_000/model_optim_rng.bin", root); EXPECT(truncate(path, 4000) == 0, "truncate"); break;
            case 4: snprintf(path, sizeof(path), "%s/iter_0000009/mp_rank_00_001/model_optim_rng.bin", root); EXPECT(unlink(path) == 0, "unlink"); break;
            case 5: snprintf(path, sizeof(path), "%s/iter_0000009/manifest.txt", root); EXPECT(unlink(path) == 0, "unlink"); break;
        }
        mt_ckpt ck;
        err.message[0] = 0;
        mt_status st = mt_ckpt_open(&ck, root, -1, &err);
        if (st == MT_OK) st = mt_ckpt_verify(&ck, NULL, &err);
        if (!cases[i].needle) EXPECT_OK(st, &err);
        else EXPECT(st != MT_OK && strstr(err.message, cases[i].needle) && !strchr(err.message, '\n'),
                    "%s: status %s, message '%s'", cases[i].what, mt_status_name(st), err.message);
    }
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* mt_checkpoint_select: the tracked iteration when it passes the integrity rule; a refused tracked
 * one gives way (with fell_back) to the newest older one that verifies, the warning naming what was
 * refused; an explicit one, or one asked for without fell_back (the tools), never does; a lost
 * manifest is a refusal too; --no-verify reads the tracked one with a warning. */
static test_result test_select_falls_back(void) {
    char root[256], path[600];
    ckt_dir(root, sizeof(root), "select");
    mt_error err, warning;
    ckt_layout L = {0, 0, 1, 1, 1, 0, 0, 0, 0, 1};
    int64_t n, chosen = -1;
    int fell_back = -1;
    float** a = ckt_arrays(&L, 5, &n);
    EXPECT_OK(ckt_write(root, 10, &L, a, &err), &err);
    EXPECT_OK(ckt_write(root, 20, &L, a, &err), &err);
    EXPECT_OK(ckt_write(root, 30, &L, a, &err), &err);
    EXPECT_OK(mt_checkpoint_select(root, -1, 0, &chosen, &fell_back, &warning, &err), &err);
    EXPECT(chosen == 30 && fell_back == 0 && !warning.message[0], "chose %lld (fell back %d): %s", (long long)chosen,
           fell_back, warning.message);
    /* 30 and 20 damaged: 10 it is, the warning naming 30's bad file */
    for (int it = 20; it <= 30; it += 10) {
        snprintf(path, sizeof(path), "%s/iter_%07d/mp_rank_00/model_optim_rng.bin", root, it);
        EXPECT(ckt_flip(path, -5) == 0, "flip");
    }
    EXPECT_OK(mt_checkpoint_select(root, -1, 0, &chosen, &fell_back, &warning, &err), &err);
    EXPECT(chosen == 10 && fell_back == 1 && strstr(warning.message, "iter_0000030") && strstr(warning.message, "corrupted") &&
               strstr(warning.message, "read iteration 10") && !strchr(warning.message, '\n'),
           "chose %lld (fell back %d): %s", (long long)chosen, fell_back, warning.message);
    EXPECT(mt_checkpoint_select(root, 30, 0, &chosen, &fell_back, &warning, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "corrupted"), "explicit iteration: %s", err.message);
    /* without fell_back (a tool): the tracked one's refusal, naming the file */
    err.message[0] = 0;
    EXPECT(mt_checkpoint_select(root, -1, 0, &chosen, NULL, &warning, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "iter_0000030: mp_rank_00/model_optim_rng.bin is corrupted"), "%s", err.message);
    /* --no-verify: the tracked one, with a warning that says why */
    EXPECT_OK(mt_checkpoint_select(root, -1, 1, &chosen, &fell_back, &warning, &err), &err);
    EXPECT(chosen == 30 && fell_back == 0 && strstr(warning.message, "iter_0000030: mp_rank_00/model_optim_rng.bin is "
                                                    "corrupted") && strstr(warning.message, "read anyway"),
           "--no-verify chose %lld (fell back %d): %s", (long long)chosen, fell_back, warning.message);
    /* a lost manifest (the header says it had one): refused, so 10 again */
    snprintf(path, sizeof(path), "%s/iter_0000030/manifest.txt", root);
    EXPECT(unlink(path) == 0, "unlink");
    EXPECT_OK(mt_checkpoint_select(root, -1, 0, &chosen, &fell_back, &warning, &err), &err);
    EXPECT(chosen == 10 && fell_back == 1 && strstr(warning.message, "incomplete or tampered"), "chose %lld: %s",
           (long long)chosen, warning.message);
    /* nothing good below a damaged tracked one: its own failure */
    mt_remove_tree(root);
    EXPECT_OK(ckt_write(root, 10, &L, a, &err), &err);
    snprintf(path, sizeof(path), "%s/iter_0000010/mp_rank_00/model_optim_rng.bin", root);
    EXPECT(truncate(path, 100) == 0, "truncate");
    EXPECT(mt_checkpoint_select(root, -1, 0, &chosen, &fell_back, &warning, &err) == MT_ERR_FORMAT &&
               strstr(err.message, "truncated"), "%s", err.message);
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* The integrity rule itself (mt_checkpoint_check_integrity) on a TP 2 x PP 2 checkpoint, each case one
 * line: intact (nothing to say); a flipped byte in any file (refused naming it; no_verify: a warning
 * naming it); the manifest deleted from a checkpoint saved with one (refused; no_verify: a warning); a
 * checkpoint from before manifests (mark 0, none: read with a warning, no_verify or not); its first
 * header damaged as well (refused naming the file: nothing then says what it is); a missing
 * iteration directory (MT_ERR_IO). */
static test_result test_integrity_rule(void) {
    char root[256], iter_dir[400], path[600];
    ckt_dir(root, sizeof(root), "integrity");
    snprintf(iter_dir, sizeof(iter_dir), "%s/iter_0000004", root);
    mt_error err, warning;
    ckt_layout L = {1, 0, 2, 2, 1, 0, 0, 0, 0, 1};
    int64_t n;
    float** a = ckt_arrays(&L, 9, &n);
    struct { const char* what; int kind, manifest; mt_status strict; const char* needle; } cases[] = {
        {"intact", 0, 1, MT_OK, NULL},
        {"a flipped byte", 1, 1, MT_ERR_FORMAT, "mp_rank_01_001/model_optim_rng.bin is corrupted"},
        {"an Adam moment's flipped byte", 2, 1, MT_ERR_FORMAT, "mp_rank_00_000/model_optim_rng.bin is corrupted"},
        {"the manifest deleted", 3, 1, MT_ERR_FORMAT, "has no manifest.txt but was saved with one: incomplete or tampered"},
        {"from before manifests", 0, 0, MT_OK, "has no manifest.txt: saved before manifests"},
        {"from before manifests, its first header damaged", 4, 0, MT_ERR_FORMAT, "mp_rank_00_000/model_optim_rng.bin"},
        {"no iteration directory", 5, 1, MT_ERR_IO, "no checkpoint at"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        mt_remove_tree(root);
        L.manifest = cases[i].manifest;
        EXPECT_OK(ckt_write(root, 4, &L, a, &err), &err);
        switch (cases[i].kind) {
            case 1: snprintf(path, sizeof(path), "%s/mp_rank_01_001/model_optim_rng.bin", iter_dir); EXPECT(ckt_flip(path, 3000) == 0, "flip"); break;
            case 2: snprintf(path, sizeof(path), "%s/mp_rank_00_000/model_optim_rng.bin", iter_dir); EXPECT(ckt_flip(path, -3) == 0, "flip"); break;
            case 3: snprintf(path, sizeof(path), "%s/manifest.txt", iter_dir); EXPECT(unlink(path) == 0, "unlink"); break;
            case 4: snprintf(path, sizeof(path), "%s/mp_rank_00_000/model_optim_rng.bin", iter_dir); EXPECT(ckt_flip(path, 8 * MT_CK_LAYERS + 6) == 0, "flip"); break;
            case 5: EXPECT(mt_remove_tree(iter_dir) == 0, "rm"); break;
        }
        for (int no_verify = 0; no_verify <= 1; no_verify++) {
            err.message[0] = 0;
            snprintf(warning.message, sizeof(warning.message), "stale");
            mt_status st = mt_checkpoint_check_integrity(iter_dir, no_verify, &warning, &err);
            /* no_verify turns the refusals of a readable checkpoint into warnings; one whose directory is
             * missing stays refused; a damaged header under no_verify is the reader's to refuse */
            const mt_status want = no_verify && cases[i].kind != 5 ? MT_OK : cases[i].strict;
            const char* said = st == MT_OK ? warning.message : err.message;
            const int ok = st == want && (cases[i].needle ? strstr(said, cases[i].needle) != NULL : !said[0]) &&
                           !strchr(said, '\n') && (st != MT_OK || cases[i].strict == MT_OK || strstr(said, "read anyway"));
            EXPECT(ok, "%s (no_verify %d): status %s, want %s; said '%s'", cases[i].what, no_verify, mt_status_name(st),
                   mt_status_name(want), said);
        }
    }
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* Runs a tool (cmd, from the repository root) and returns its exit status; its stderr (stdout dropped)
 * in out. */
static int ckt_run_tool(const char* cmd, char* out, size_t cap) {
    char full[2400];
    snprintf(full, sizeof(full), "%s 2>&1 >/dev/null", cmd);
    return test_command_output(full, out, cap);
}

/* err: exactly one line, "<prog>: <kind>: ...<needle>..." (kind "error" or "warning"; NULL: "<prog>: ..."),
 * and the exit status want_code; 1 if so, else it prints what came and returns 0. */
static int ckt_one_line(const char* what, int code, int want_code, const char* err, const char* prog, const char* kind,
                        const char* needle) {
    char head[64];
    if (kind) snprintf(head, sizeof(head), "%s: %s: ", prog, kind);
    else snprintf(head, sizeof(head), "%s: ", prog);
    const char* nl = strchr(err, '\n');
    int ok = code == want_code && !strncmp(err, head, strlen(head)) && strstr(err, needle) && nl && !nl[1];
    if (!ok) printf("    %s: exit %d (want %d), want one line '%s...%s...', got: %s\n", what, code, want_code, head, needle, err);
    return ok;
}

/* A reader run on case `kind` of test_tools_refuse_damage: intact (0), it ends with exit 0 and says
 * nothing; damaged, one line of prog's (an error when refused, else a warning) naming the file. */
static int ckt_reader_outcome(const char* what, int kind, int code, int refused, const char* err, const char* prog,
                              const char* kind_word, const char* needle) {
    if (kind != 0) return ckt_one_line(what, code, refused, err, prog, kind_word, needle);
    if (code == 0 && !err[0]) return 1;
    printf("    %s: exit %d: %s\n", what, code, err);
    return 0;
}

/* The readers as a user runs them: prepro/checkpoint_tool (info, verify, reshard) and prepro/convert_hf
 * (--export) on a Llama checkpoint at TP 1 (what export takes). A flipped byte: each refuses, exit 1,
 * one line naming the file, and writes nothing; with --no-verify, info, reshard and export proceed
 * (exit 0) after one warning line naming it (verify takes no --no-verify: exit 2). The manifest
 * deleted from a checkpoint saved with one: refused ("incomplete or tampered"). A checkpoint from
 * before manifests (mark 0, none): read with a warning, but verify refuses it (it cannot vouch for
 * it). Writers: reshard's output and convert_hf --import's pass `checkpoint_tool verify` and carry the
 * manifest mark; eval_hellaswag (its reader is mt_hf_checkpoint_read, tested in host.hf) refuses the
 * damaged one too when it is built. Skips when the tools are not built. */
static test_result test_tools_refuse_damage(void) {
    if (access("prepro/checkpoint_tool", X_OK) != 0 || access("prepro/convert_hf", X_OK) != 0)
        SKIP("prepro/checkpoint_tool and prepro/convert_hf are not built (make all)");
    char root[256], src[400], path[700], cmd[2000], err_text[8192], out[500];
    ckt_dir(root, sizeof(root), "tools");
    mt_error err;
    ckt_layout L = {1, 0, 1, 1, 1, 0, 0, 0, 0, 1}; /* Llama (GQA: not GPT-2's), tied */
    int64_t n;
    float** a = ckt_arrays(&L, 13, &n);
    int ok = 1;
    const char* model = "iter_0000006/mp_rank_00/model_optim_rng.bin";
    for (int kind = 0; kind < 4; kind++) { /* intact, flipped byte, manifest deleted, before manifests */
        snprintf(src, sizeof(src), "%s/src%d", root, kind);
        L.manifest = kind != 3;
        EXPECT_OK(ckt_write(src, 6, &L, a, &err), &err);
        snprintf(path, sizeof(path), "%s/%s", src, model);
        if (kind == 1) EXPECT(ckt_flip(path, -100) == 0, "flip");
        if (kind == 2) {
            snprintf(path, sizeof(path), "%s/iter_0000006/manifest.txt", src);
            EXPECT(unlink(path) == 0, "unlink");
        }
        const char* needle = kind == 1 ? "mp_rank_00/model_optim_rng.bin is corrupted"
                             : kind == 2 ? "has no manifest.txt but was saved with one: incomplete or tampered"
                                         : "has no manifest.txt: saved before manifests";
        for (int no_verify = 0; no_verify <= 1; no_verify++) {
            const char* nv = no_verify ? " --no-verify" : "";
            /* refused (kinds 1, 2 without --no-verify), else proceeds: with a warning unless intact */
            const int refused = (kind == 1 || kind == 2) && !no_verify;
            const char* kind_word = refused ? "error" : "warning";
            char what[200];
            snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool info '%s'%s", src, nv);
            int code = ckt_run_tool(cmd, err_text, sizeof(err_text));
            snprintf(what, sizeof(what), "case %d: info%s", kind, nv);
            ok &= ckt_reader_outcome(what, kind, code, refused, err_text, "checkpoint_tool", kind_word, needle);
            snprintf(out, sizeof(out), "%s/resharded%d%d", root, kind, no_verify);
            snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool reshard '%s' '%s' --target-tp 2 --target-pp 1%s", src, out, nv);
            code = ckt_run_tool(cmd, err_text, sizeof(err_text));
            snprintf(what, sizeof(what), "case %d: reshard%s", kind, nv);
            ok &= ckt_reader_outcome(what, kind, code, refused, err_text, "checkpoint_tool", kind_word, needle);
            snprintf(path, sizeof(path), "%s/iter_0000006", out);
            EXPECT(refused ? access(out, F_OK) != 0 : access(path, F_OK) == 0, "%s: output %s", what,
                   refused ? "written" : "missing");
            if (!refused) { /* the output passes verify and carries the mark */
                snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool verify '%s'", out);
                code = ckt_run_tool(cmd, err_text, sizeof(err_text));
                mt_ckpt ck;
                EXPECT(code == 0 && mt_ckpt_open(&ck, out, -1, &err) == MT_OK && ck.header[MT_CK_MANIFESTED] == 1 &&
                           ck.tp == 2, "%s: its output: verify exit %d (%s), mark %lld", what, code, err_text,
                       (long long)ck.header[MT_CK_MANIFESTED]);
            }
            snprintf(out, sizeof(out), "%s/hf%d%d", root, kind, no_verify);
            snprintf(cmd, sizeof(cmd), "prepro/convert_hf --export '%s' --out '%s'%s", src, out, nv);
            code = ckt_run_tool(cmd, err_text, sizeof(err_text));
            snprintf(what, sizeof(what), "case %d: convert_hf --export%s", kind, nv);
            ok &= ckt_reader_outcome(what, kind, code, refused, err_text, "convert_hf", kind_word, needle);
            snprintf(path, sizeof(path), "%s/config.json", out);
            EXPECT(refused ? access(out, F_OK) != 0 : access(path, F_OK) == 0, "%s: output %s", what,
                   refused ? "written" : "missing");
            if (kind == 0 && !no_verify) { /* and back: --import writes a checkpoint that verifies, with the mark */
                char back[500];
                snprintf(back, sizeof(back), "%s/imported", root);
                snprintf(cmd, sizeof(cmd), "prepro/convert_hf --import '%s' --save '%s' && prepro/checkpoint_tool verify '%s'",
                         out, back, back);
                code = ckt_run_tool(cmd, err_text, sizeof(err_text));
                mt_ckpt ck;
                EXPECT(code == 0 && mt_ckpt_open(&ck, back, -1, &err) == MT_OK && ck.header[MT_CK_MANIFESTED] == 1,
                       "convert_hf --import's checkpoint: verify exit %d (%s)", code, err_text);
            }
        }
        /* verify: refuses every damaged one and the one from before manifests; takes no --no-verify */
        snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool verify '%s'", src);
        int code = ckt_run_tool(cmd, err_text, sizeof(err_text));
        if (kind == 0) EXPECT(code == 0, "verify of the intact one: exit %d, %s", code, err_text);
        else ok &= ckt_one_line("verify", code, 1, err_text, "checkpoint_tool", "error",
                                kind == 3 ? "saved before manifests, it cannot be verified" : needle);
        snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool verify '%s' --no-verify", src);
        EXPECT(ckt_run_tool(cmd, err_text, sizeof(err_text)) == 2 && strstr(err_text, "--no-verify goes with"),
               "verify --no-verify: %s", err_text);
        /* eval_hellaswag reads it through mt_hf_checkpoint_read: refused before any GPU work */
        if (kind == 1 && access("eval_hellaswag", X_OK) == 0) {
            snprintf(cmd, sizeof(cmd), "./eval_hellaswag --load '%s'", src);
            code = ckt_run_tool(cmd, err_text, sizeof(err_text));
            ok &= ckt_one_line("eval_hellaswag", code, 1, err_text, "eval_hellaswag", NULL, needle);
        }
    }
    ckt_arrays_free(a);
    mt_remove_tree(root);
    EXPECT(ok, "a reader did not apply the integrity rule as it should");
    return TEST_PASS;
}

/* train_gpt's --no-verify-checkpoint: off by default, on when given (train_gpt.c hands it to
 * mt_trainer_set_no_verify_checkpoint before --load). */
static test_result test_no_verify_checkpoint_flag(void) {
    static tg_flags v;
    char msg[512] = "";
    char* plain[] = {(char*)"train_gpt"};
    char* given[] = {(char*)"train_gpt", (char*)"--no-verify-checkpoint"};
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, 1, plain, msg, sizeof(msg)) == 0 && v.no_verify_checkpoint == 0, "default: %d (%s)",
           v.no_verify_checkpoint, msg);
    tg_flags_init(&v);
    EXPECT(tg_flags_parse(&v, 2, given, msg, sizeof(msg)) == 0 && v.no_verify_checkpoint == 1, "given: %d (%s)",
           v.no_verify_checkpoint, msg);
    return TEST_PASS;
}

/* prepro/convert_mcore.py's integrity rule (its Python restatement: manifest CRC-32C, the manifest mark,
 * --no-verify) by dev/mcore_integrity_check.py, which also checks that the C and Python sides agree on
 * each other's manifests; skipped when python3 (or $MT_PYTHON) has no numpy (the script needs no torch). */
static test_result test_mcore_integrity(void) {
    char out[16384];
    if (test_command_output("${MT_PYTHON:-python3} -c 'import numpy' 2>&1", out, sizeof(out)) != 0)
        SKIP("python3 with numpy is not available (dev/mcore_integrity_check.py; MT_PYTHON names another python)");
    int code = test_command_output("${MT_PYTHON:-python3} dev/mcore_integrity_check.py 2>&1", out, sizeof(out));
    EXPECT(code == 0 && strstr(out, "all passed"), "dev/mcore_integrity_check.py: exit %d:\n%s", code, out);
    return TEST_PASS;
}

/* one float of a file, `from_end` bytes before its end, set to v */
static int ckt_put_float(const char* path, long from_end, float v) {
    FILE* f = fopen(path, "r+b");
    if (!f) return -1;
    int rc = fseek(f, -from_end, SEEK_END) == 0 && fwrite(&v, sizeof(v), 1, f) == 1 ? 0 : -1;
    return fclose(f) == 0 ? rc : -1;
}

/* Issue #34, the routers' expert bias in checkpoints (host): the size rule (mt_checkpoint_expert_bias_numel:
 * MoE layers x experts after the arrays and the FP8 state, counted by mt_checkpoint_file_bytes; nothing
 * without --moe-router-enable-expert-bias) and the header's checks of its word (range, experts, the MoE
 * tensors' sizes overflow-checked); a TP2 x PP2 MoE checkpoint (FP8 state before the bias) verifies and gives
 * the bias back bitwise from every model file; resharded to TP1 and back to TP2 x PP2 its arrays and bias
 * are kept bitwise, with the trainer's files byte for byte (info names the bias); refused in one line naming
 * the file: a cut-short bias, a NaN in it (verify, and the first file's read a load at another layout
 * does), one file's copy other than the first's; a run that differs in the bias, or a dense checkpoint
 * into an MoE run and back, refused naming the flag; a checkpoint without a bias has none to read.
 * (convert_mcore's one-line refusal of MoE: dev/mcore_integrity_check.py, mcore_integrity.) */
static test_result test_moe_expert_bias_checkpoint(void) {
    char root[256], src[400], out[400], back[400], syn[400], path[800], text[8192];
    ckt_dir(root, sizeof(root), "moe_bias");
    mt_error err;
    float bias[16], got[16];
    for (int i = 0; i < 16; i++) bias[i] = 1e-3f * (float)(i - 7) + (i % 3 ? 0.25f : -0.5f); /* distinct, none 0 */
    /* 4 layers (all MoE) of 4 experts; the vocabulary padded to 512 at every layout */
    ckt_layout L = {0, 0, 2, 2, 1, 0, 0, 0, 1 /* FP8 state, before the bias */, 1, 0, 0, 512, 1, bias};
    ckt_layout L1 = L, L22 = L;
    L1.tp = L1.pp = 1;
    L1.fp8 = L22.fp8 = 0;

    /* 1. the size rule and the header words */
    mt_config c1;
    ckt_model(&c1, &L1);
    int64_t h[MT_CK_HEADER_WORDS], h2[MT_CK_HEADER_WORDS], at = -1;
    const double one = 1.0;
    mt_checkpoint_header_init(h, &c1);
    memcpy(&h[MT_CK_LOSS_SCALE_BITS], &one, sizeof(double));
    EXPECT_OK(mt_checkpoint_header_check(h, "ck", NULL, &err), &err);
    const int64_t numel = mt_param_layout(&c1, NULL), head = 8 * MT_CK_HEADER_WORDS;
    EXPECT(h[MT_CK_MOE_EXPERT_BIAS] == 1 && mt_checkpoint_expert_bias_numel(h, &at) == 16 && at == 3 * numel &&
               mt_checkpoint_file_bytes(h, 0) == head + 4 * (3 * numel + 16),
           "the bias after the arrays: word %lld, %lld floats at %lld, file %lld bytes", (long long)h[MT_CK_MOE_EXPERT_BIAS],
           (long long)mt_checkpoint_expert_bias_numel(h, NULL), (long long)at, (long long)mt_checkpoint_file_bytes(h, 0));
    memcpy(h2, h, sizeof(h));
    h2[MT_CK_FP8_TENSORS] = 3;
    h2[MT_CK_FP8_HISTORY_LEN] = 4;
    EXPECT(mt_checkpoint_expert_bias_numel(h2, &at) == 16 && at == 3 * numel + 27 &&
               mt_checkpoint_file_bytes(h2, 0) == head + 4 * (3 * numel + 27 + 16) &&
               mt_checkpoint_file_bytes(h2, 1) == head + 12 * h2[MT_CK_SHARD_NUMEL],
           "after the FP8 state: at %lld", (long long)at);
    h2[MT_CK_SHARDED_DP] = 2;
    h2[MT_CK_FP8_TENSORS] = h2[MT_CK_FP8_HISTORY_LEN] = 0;
    EXPECT(mt_checkpoint_expert_bias_numel(h2, &at) == 16 && at == numel, "sharded: the bias after the master (%lld)",
           (long long)at);
    mt_config nob = c1;
    nob.moe_router_enable_expert_bias = 0;
    mt_checkpoint_header_init(h2, &nob);
    EXPECT(h2[MT_CK_MOE_EXPERT_BIAS] == 0 && mt_checkpoint_expert_bias_numel(h2, &at) == 0 && at == 3 * numel &&
               mt_checkpoint_file_bytes(h2, 0) == head + 12 * numel, "no bias without the flag");
    struct { int word; int64_t value; const char* needle; } bad[] = {
        {MT_CK_MOE_EXPERT_BIAS, 2, "(--moe-router-enable-expert-bias) is 2, outside [0, 1]"},
        /* with experts of width 2^31 - 1 too (below): 2^31 x 2^31 x 64 x 3 overflows before any count */
        {MT_CK_NUM_EXPERTS, INT32_MAX, "2147483647"}, /* the MoE layers' parameter count overflows */
        {MT_CK_MOE_FFN, 17, "the header says"}, /* the experts' width is counted in the parameters */
        /* refused before any loop over its layers (a fuzzed header of 2^31 MoE layers took minutes to check) */
        {MT_CK_LAYERS, 1025, "an MoE model of 1025 layers (this build reads at most 1024)"},
        {MT_CK_LAYERS, INT32_MAX, "an MoE model of 2147483647 layers"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memcpy(h2, h, sizeof(h));
        h2[bad[i].word] = bad[i].value;
        if (bad[i].word == MT_CK_NUM_EXPERTS) h2[MT_CK_MOE_FFN] = INT32_MAX;
        err.message[0] = 0;
        mt_status st = mt_checkpoint_header_check(h2, "ck", NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, bad[i].needle) && !strchr(err.message, '\n'),
               "word %d = %lld: %s '%s'", bad[i].word, (long long)bad[i].value, mt_status_name(st), err.message);
    }
    mt_config dense = c1;
    dense.num_experts = 0;
    mt_checkpoint_header_init(h2, &dense);
    memcpy(&h2[MT_CK_LOSS_SCALE_BITS], &one, sizeof(double));
    h2[MT_CK_MOE_EXPERT_BIAS] = 1;
    EXPECT(mt_checkpoint_header_check(h2, "ck", NULL, &err) == MT_ERR_FORMAT && strstr(err.message, "expert bias) are inconsistent"),
           "a bias without experts: '%s'", err.message);
    h2[MT_CK_MOE_EXPERT_BIAS] = 0;
    /* the run's model: the bias word as any other (both ways), a dense checkpoint into an MoE run and back */
    struct { const char* what; const int64_t* header; const mt_config* run; const char* needle; } runs[] = {
        {"a bias into a run without", h, &nob, "has --moe-router-enable-expert-bias (the routers' expert bias) 1 but this run has 0"},
        {"no bias into a run with it", NULL, &c1, "has --moe-router-enable-expert-bias (the routers' expert bias) 0 but this run has 1"},
        {"a dense checkpoint into an MoE run", h2, &c1, "has --num-experts (0: a dense model) 0 but this run has 4"},
        {"an MoE checkpoint into a dense run", h, &dense, "has --num-experts (0: a dense model) 4 but this run has 0"},
    };
    int64_t hn[MT_CK_HEADER_WORDS];
    mt_checkpoint_header_init(hn, &nob);
    runs[1].header = hn;
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++)
        for (int any = 0; any < 2; any++) {
            err.message[0] = 0;
            mt_status st = mt_checkpoint_header_check_model(runs[i].header, "ck", runs[i].run, any, &err);
            EXPECT(st == MT_ERR_CONFIG && strstr(err.message, runs[i].needle) && !strchr(err.message, '\n'),
                   "%s (any layout %d): %s '%s'", runs[i].what, any, mt_status_name(st), err.message);
        }
    EXPECT_OK(mt_checkpoint_header_check_model(h, "ck", &c1, 0, &err), &err);

    /* 2. TP2 x PP2 with FP8 state and the bias: verified, the bias bitwise from every model file */
    int64_t n = 0;
    float** a = ckt_arrays(&L, 21, &n);
    snprintf(src, sizeof(src), "%s/src", root);
    EXPECT_OK(ckt_write(src, 12, &L, a, &err), &err);
    mt_ckpt ck;
    EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
    EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
    memset(got, 0, sizeof(got));
    EXPECT_OK(mt_ckpt_read_expert_bias(&ck, 1, got, &err), &err);
    EXPECT(!memcmp(got, bias, sizeof(bias)), "the bias read back differs");
    EXPECT(ckt_read_equal(src, &L, a, n, &err), "the MoE arrays at TP2 x PP2 differ");
    if (access("prepro/checkpoint_tool", X_OK) == 0) {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool info %s 2>&1", src);
        int code = test_command_output(cmd, text, sizeof(text));
        EXPECT(code == 0 && strstr(text, "mixture of experts: 4 experts of width 16 in 4 of 4 layers, shared expert of "
                                         "width 32, gated, expert bias (--moe-router-enable-expert-bias) [MoE layers, "
                                         "experts] fp32"), "info: exit %d:\n%s", code, text);
    }

    /* 3. resharded to TP1, then back to TP2 x PP2: arrays and bias kept; the files the trainer's, byte for byte */
    snprintf(out, sizeof(out), "%s/tp1", root);
    snprintf(back, sizeof(back), "%s/back", root);
    snprintf(syn, sizeof(syn), "%s/synthetic", root);
    EXPECT_OK(mt_ckpt_reshard(&ck, NULL, out, 1, 1, 1, 128, NULL, &err), &err);
    EXPECT(ckt_read_equal(out, &L1, a, n, &err), "TP1: the arrays differ");
    EXPECT_OK(mt_ckpt_open(&ck, out, -1, &err), &err);
    EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
    memset(got, 0, sizeof(got));
    EXPECT_OK(mt_ckpt_read_expert_bias(&ck, 1, got, &err), &err);
    EXPECT(!memcmp(got, bias, sizeof(bias)) && ck.header[MT_CK_MOE_EXPERT_BIAS] == 1, "TP1: the bias not carried");
    EXPECT_OK(mt_ckpt_reshard(&ck, NULL, back, 2, 2, 1, 128, NULL, &err), &err);
    EXPECT_OK(ckt_write(syn, 12, &L22, a, &err), &err);
    for (int t = 0; t < 2; t++)
        for (int s = 0; s < 2; s++) {
            char p2[800];
            size_t na = 0, nb = 0;
            snprintf(path, sizeof(path), "%s/iter_0000012/mp_rank_%02d_%03d/model_optim_rng.bin", back, t, s);
            snprintf(p2, sizeof(p2), "%s/iter_0000012/mp_rank_%02d_%03d/model_optim_rng.bin", syn, t, s);
            char* x = test_read_file(path, &na);
            char* y = test_read_file(p2, &nb);
            const int same = x && y && na == nb && !memcmp(x, y, na);
            free(x);
            free(y);
            EXPECT(same, "%s differs from the trainer's layout (%zu vs %zu bytes)", path, na, nb);
        }

    /* 4. damage, each refused in one line naming the file (the manifest rewritten, so the bias's own checks
     * speak): a NaN, a copy other than the first's, a cut-short array; a NaN in the first file for the
     * loader's read at another layout */
    struct { const char* what; const char* file; int kind; float value; const char* needle; } damage[] = {
        {"a NaN", "mp_rank_01_001", 0, NAN, "mp_rank_01_001/model_optim_rng.bin: the expert bias of MoE layer 2, expert 3 is nan (must be finite)"},
        {"an infinity", "mp_rank_01_000", 0, INFINITY, "expert 3 is inf (must be finite)"},
        {"another copy", "mp_rank_00_001", 0, 0.75f, "mp_rank_00_001/model_optim_rng.bin: the expert bias of MoE layer 2, expert 3 is 0.75, but"},
        {"a cut-short bias", "mp_rank_01_000", 1, 0.0f, "mp_rank_01_000/model_optim_rng.bin has"},
        {"a NaN in the first file", "mp_rank_00_000", 2, NAN, "mp_rank_00_000/model_optim_rng.bin: the expert bias of MoE layer 2, expert 3 is nan"},
    };
    for (size_t i = 0; i < sizeof(damage) / sizeof(damage[0]); i++) {
        char dir[500], iter_dir[600];
        snprintf(dir, sizeof(dir), "%s/damage%zu", root, i);
        EXPECT_OK(ckt_write(dir, 12, &L22, a, &err), &err);
        snprintf(iter_dir, sizeof(iter_dir), "%s/iter_0000012", dir);
        snprintf(path, sizeof(path), "%s/%s/model_optim_rng.bin", iter_dir, damage[i].file);
        if (damage[i].kind == 1) {
            struct stat sb;
            EXPECT(stat(path, &sb) == 0 && truncate(path, sb.st_size - 4) == 0, "truncate %s", path);
        } else {
            EXPECT(ckt_put_float(path, 4 * (16 - 11), damage[i].value) == 0, "write %s", path); /* element 11: layer 2, expert 3 */
        }
        EXPECT_OK(mt_checkpoint_manifest_write(iter_dir, &err), &err);
        EXPECT_OK(mt_ckpt_open(&ck, dir, -1, &err), &err);
        err.message[0] = 0;
        mt_status st = damage[i].kind == 2 ? mt_ckpt_read_expert_bias(&ck, 0, got, &err) : mt_ckpt_verify(&ck, NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, damage[i].needle) && !strchr(err.message, '\n'),
               "%s: %s '%s'", damage[i].what, mt_status_name(st), err.message);
        if (damage[i].kind == 1) { /* the reader itself, on a file its size check did not see: "cut short" */
            int64_t hf[MT_CK_HEADER_WORDS];
            int fd = open(path, O_RDONLY);
            EXPECT(fd >= 0 && read(fd, hf, sizeof(hf)) == (ssize_t)sizeof(hf), "read %s", path);
            st = mt_checkpoint_read_expert_bias(fd, path, hf, got, &err);
            close(fd);
            EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "the expert bias (4 MoE layers x 4 experts) is cut short") &&
                   !strchr(err.message, '\n'), "cut short: %s '%s'", mt_status_name(st), err.message);
        }
    }

    /* 5. a checkpoint without the bias has none to read */
    ckt_layout Ln = L22;
    Ln.moe = 0;
    snprintf(out, sizeof(out), "%s/dense", root);
    float** ad = ckt_arrays(&Ln, 4, &n);
    EXPECT_OK(ckt_write(out, 3, &Ln, ad, &err), &err);
    EXPECT_OK(mt_ckpt_open(&ck, out, -1, &err), &err);
    EXPECT(mt_ckpt_read_expert_bias(&ck, 0, got, &err) == MT_ERR_CONFIG && strstr(err.message, "holds no expert bias"),
           "'%s'", err.message);
    ckt_arrays_free(ad);
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* GPU: the trainer's own checkpoints through the manifest and the tool. 5 steps saved, 5 more saved
 * (the straight run); both iterations verify (headers, sizes, manifest); iteration 5 resharded
 * TP1 -> TP2 -> TP1 x PP2 -> TP1 and loaded continues steps 5..9 with the straight run's losses and
 * weights bitwise; a flipped byte in iteration 10 makes the tracker's load fall back to iteration 5
 * (mt_trainer_load_warning says why), an explicit load of iteration 10 is refused naming the file,
 * --no-verify-checkpoint (mt_trainer_set_no_verify_checkpoint) reads 10 with a warning, and 10's
 * manifest deleted makes the load fall back again. */
static test_result ckt_trainer(int llama) {
    REQUIRE_GPU();
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    char root[256], a_dir[400], out[400], prev[400], path[600];
    ckt_dir(root, sizeof(root), llama ? "trainer_llama" : "trainer_gpt");
    snprintf(a_dir, sizeof(a_dir), "%s/a", root);
    const int64_t n = mt_num_parameters(&c);
    double a[20], r[20];
    float* pa = (float*)malloc(sizeof(float) * (size_t)n);
    float* pr = (float*)malloc(sizeof(float) * (size_t)n);
    test_result res = run_steps(&c, NULL, a_dir, 0, 5, a, NULL);
    if (res == TEST_PASS) res = run_steps(&c, a_dir, a_dir, 5, 5, a, pa);
    if (res != TEST_PASS) { free(pa); free(pr); return res; }
    for (int it = 5; it <= 10; it += 5) {
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, a_dir, it, &err), &err);
        EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
        EXPECT(ck.header[MT_CK_MANIFESTED] == 1, "the trainer's save has manifest mark %lld",
               (long long)ck.header[MT_CK_MANIFESTED]);
    }
    struct { int tp, pp; } steps[] = {{2, 1}, {1, 2}, {1, 1}};
    snprintf(prev, sizeof(prev), "%s", a_dir);
    for (int k = 0; k < 3; k++) {
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, prev, k == 0 ? 5 : -1, &err), &err);
        snprintf(out, sizeof(out), "%s/step%d", root, k);
        EXPECT_OK(mt_ckpt_reshard(&ck, NULL, out, steps[k].tp, steps[k].pp, 1, c.make_vocab_size_divisible_by, NULL, &err),
                  &err);
        snprintf(prev, sizeof(prev), "%s", out);
    }
    res = run_steps(&c, prev, NULL, 5, 5, r, pr);
    if (res != TEST_PASS) { free(pa); free(pr); return res; }
    for (int k = 5; k < 10; k++) EXPECT(!memcmp(&a[k], &r[k], sizeof(double)), "step %d: %.9g vs %.9g", k, r[k], a[k]);
    EXPECT(!memcmp(pa, pr, sizeof(float) * (size_t)n), "weights after the resharded resume differ");
    free(pa);
    free(pr);
    /* damage: the tracker's iteration 10 gives way to 5; asked for by number, 10 is refused */
    snprintf(path, sizeof(path), "%s/iter_0000010/mp_rank_00/model_optim_rng.bin", a_dir);
    EXPECT(ckt_flip(path, -77) == 0, "flip");
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    int64_t it = -1, it_nv = -1;
    char fell_back_warning[512];
    mt_status st = mt_trainer_load(t, a_dir, -1, &it, NULL, &err);
    snprintf(fell_back_warning, sizeof(fell_back_warning), "%s", mt_trainer_load_warning(t));
    mt_status st10 = mt_trainer_load(t, a_dir, 10, NULL, NULL, &err);
    /* --no-verify-checkpoint: iteration 10 read anyway, the warning naming the file */
    mt_trainer_set_no_verify_checkpoint(t, 1);
    mt_error nv_err;
    mt_status st_nv = mt_trainer_load(t, a_dir, -1, &it_nv, NULL, &nv_err);
    char nv_warning[512];
    snprintf(nv_warning, sizeof(nv_warning), "%s", mt_trainer_load_warning(t));
    /* the manifest of 10 deleted (its header says it had one): refused, 5 read instead */
    mt_trainer_set_no_verify_checkpoint(t, 0);
    snprintf(path, sizeof(path), "%s/iter_0000010/manifest.txt", a_dir);
    unlink(path);
    int64_t it_lost = -1;
    mt_error lost_err;
    mt_status st_lost = mt_trainer_load(t, a_dir, -1, &it_lost, NULL, &lost_err);
    char lost_warning[512];
    snprintf(lost_warning, sizeof(lost_warning), "%s", mt_trainer_load_warning(t));
    mt_trainer_free(t);
    EXPECT(st == MT_OK && it == 5, "load after damage: status %s, iteration %lld", mt_status_name(st), (long long)it);
    EXPECT(strstr(fell_back_warning, "iteration 10 was refused") && strstr(fell_back_warning, "corrupted"),
           "the fallback's warning: '%s'", fell_back_warning);
    EXPECT(st10 == MT_ERR_FORMAT && strstr(err.message, "mp_rank_00/model_optim_rng.bin is corrupted"), "%s", err.message);
    EXPECT(st_nv == MT_OK && it_nv == 10 && strstr(nv_warning, "corrupted") && strstr(nv_warning, "read anyway"),
           "--no-verify-checkpoint: status %s (%s), iteration %lld, warning '%s'", mt_status_name(st_nv), nv_err.message,
           (long long)it_nv, nv_warning);
    EXPECT(st_lost == MT_OK && it_lost == 5 && strstr(lost_warning, "incomplete or tampered"),
           "a lost manifest: status %s (%s), iteration %lld, warning '%s'", mt_status_name(st_lost), lost_err.message,
           (long long)it_lost, lost_warning);
    mt_remove_tree(root);
    printf("      %s: saved, verified, resharded TP1 -> TP2 -> PP2 -> TP1, resumed bitwise; damage skipped\n",
           llama ? "Llama" : "GPT-2");
    return TEST_PASS;
}

static test_result test_trainer_checkpoints_gpt2(void) { return ckt_trainer(0); }
static test_result test_trainer_checkpoints_llama(void) { return ckt_trainer(1); }

/* Resumes from dir's tracked iteration 5 for steps 5..9: TEST_PASS when the losses and final weights
 * (n floats) equal the straight run's (straight[5..9], want) bitwise; `what` names the resume. */
static test_result ckt_resume_bitwise(mt_config* c, const char* dir, const double* straight, const float* want,
                                      int64_t n, const char* what) {
    double r[20];
    float* got = (float*)malloc(sizeof(float) * (size_t)n);
    test_result res = run_steps(c, dir, NULL, 5, 5, r, got);
    for (int k = 5; k < 10 && res == TEST_PASS; k++)
        if (memcmp(&straight[k], &r[k], sizeof(double))) {
            printf("    %s, step %d: %.9g vs %.9g\n", what, k, r[k], straight[k]);
            res = TEST_FAIL;
        }
    if (res == TEST_PASS && memcmp(want, got, sizeof(float) * (size_t)n)) {
        printf("    %s: the weights differ\n", what);
        res = TEST_FAIL;
    }
    free(got);
    return res;
}

/* GPU: a --load at another layout, with no offline step back. 4 layers: 5 steps at TP1 saved,
 * resharded offline to TP2 x PP2 x VP2, loaded directly by a TP1 trainer (each array cut from the
 * TP2 x PP2 x VP2 files by mt_ckpt_read_part), 5 more steps: the losses and weights of the run that
 * never stopped, bitwise (the same arithmetic on the same fp32 master, m, v and counters). A trainer
 * of another hidden size refuses that checkpoint in one line naming --hidden-size. */
static test_result ckt_load_other_layout(int llama) {
    REQUIRE_GPU();
    mt_config c = test_config(llama ? TEST_LLAMA : TEST_GPT2, MT_BF16);
    c.num_layers = 4;
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    char root[256], a_dir[400], out[400];
    ckt_dir(root, sizeof(root), llama ? "direct_llama" : "direct_gpt");
    snprintf(a_dir, sizeof(a_dir), "%s/a", root);
    snprintf(out, sizeof(out), "%s/tp2pp2vp2", root);
    const int64_t n = mt_num_parameters(&c);
    double a[20];
    float* pa = (float*)malloc(sizeof(float) * (size_t)n);
    test_result res = run_steps(&c, NULL, a_dir, 0, 5, a, NULL);
    if (res == TEST_PASS) res = run_steps(&c, NULL, NULL, 0, 10, a, pa);
    mt_ckpt ck;
    if (res == TEST_PASS && (mt_ckpt_open(&ck, a_dir, -1, &err) != MT_OK ||
                             mt_ckpt_reshard(&ck, NULL, out, 2, 2, 2, c.make_vocab_size_divisible_by, NULL, &err) != MT_OK)) {
        printf("    reshard: %s\n", err.message);
        res = TEST_FAIL;
    }
    if (res == TEST_PASS) res = ckt_resume_bitwise(&c, out, a, pa, n, "loaded at another layout");
    free(pa);
    /* another model is refused at another layout too, one line naming the flag */
    mt_config other = c;
    other.hidden_size = 256;
    mt_trainer* t = NULL;
    if (res == TEST_PASS && mt_config_finalize(&other, &err) == MT_OK && mt_trainer_create(&t, &other, &err) == MT_OK) {
        mt_status st = mt_trainer_load(t, out, -1, NULL, NULL, &err);
        mt_trainer_free(t);
        if (st != MT_ERR_CONFIG || !strstr(err.message, "--hidden-size 128 but this run has 256") ||
            strchr(err.message, '\n')) {
            printf("    another model at another layout: %s: %s\n", mt_status_name(st), err.message);
            res = TEST_FAIL;
        }
    }
    mt_remove_tree(root);
    if (res == TEST_PASS)
        printf("      %s: TP1 -> (offline) TP2 x PP2 x VP2 -> loaded at TP1, continued bitwise\n", llama ? "Llama" : "GPT-2");
    return res;
}
static test_result test_load_other_layout_gpt2(void) { return ckt_load_other_layout(0); }
static test_result test_load_other_layout_llama(void) { return ckt_load_other_layout(1); }

/* Multi-GPU (mpirun -np 2): a --load at another layout, directly. GPT-2 in fp32, the PP tests'
 * model. TP=1 (each rank alone) trains 5 steps and saves, then 15 straight steps (the reference).
 * For each of TP=2, PP=2 and DP=2 with the distributed optimizer (several buckets): the TP=1
 * checkpoint loaded there holds the saved weights bitwise; 5 steps there within 1e-5 of the
 * reference's losses (not bitwise: TP, PP and DP sum in other orders, the tolerance of the fp32 TP
 * and PP tests), saved; that checkpoint loaded back at TP=1 holds that layout's weights bitwise, and
 * 5 more steps stay within 1e-5 of the reference. The DP run has --overlap-grad-reduce (several
 * buckets) and the TP=1 runs do not: the loader takes the saved buckets from the header. */
/* the largest |got - want| / |want| over steps [from, to) (NaN counts as the largest) */
static double ckt_worst_relative(const double* got, const double* want, int from, int to) {
    double worst = 0;
    for (int i = from; i < to; i++) {
        double rel = fabs(got[i] - want[i]) / fabs(want[i]);
        if (!(rel <= worst)) worst = rel;
    }
    return worst;
}

/* Where two full-model parameter arrays differ: how many elements, and the first one's tensor and
 * values (for a failure message). */
static void ckt_describe_difference(const mt_config* c, const float* got, const float* want, int64_t n) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, info);
    int64_t count = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float))) count++, first = first < 0 ? i : first;
    if (first < 0) return;
    const char* name = "?";
    int64_t at = first;
    for (int k = 0; k < MT_NUM_PARAM_TENSORS; k++)
        if (info[k].numel && first >= info[k].offset && first < info[k].offset + info[k].numel)
            name = info[k].name, at = first - info[k].offset;
    printf("      %lld of %lld elements differ; the first is %s[%lld]: %.9g, saved %.9g\n", (long long)count,
           (long long)n, name, (long long)at, got[first], want[first]);
}

/* rank 0's process id on every rank: one name for the ranks' shared directories */
static int ckt_shared_tag(void) {
    int tag = (int)getpid();
#ifdef MT_USE_MPI
    MPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
#endif
    return tag;
}

static test_result test_load_any_layout_multigpu(void) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() != 2) SKIP("runs under mpirun -np 2, not %d", mpi_world());
    const int tag = ckt_shared_tag();
    mt_config ref = pp_config(MT_FP32, 1, 1, 1, 1, 0); /* no --overlap-grad-reduce: the DP run's buckets come from its header */
    mt_error err;
    mt_config fin = ref;
    EXPECT_OK(mt_config_finalize(&fin, &err), &err);
    const int64_t n = mt_num_parameters(&fin);
    double want[15], got[15];
    float* p5 = (float*)malloc(sizeof(float) * (size_t)n);
    float* w = (float*)malloc(sizeof(float) * (size_t)n);
    float* w10 = (float*)malloc(sizeof(float) * (size_t)n);
    char base[256], own[300], dir[300];
    snprintf(base, sizeof(base), "/tmp/mt_test_any_layout_%d", tag);
    snprintf(own, sizeof(own), "%s/tp1_rank%d", base, mpi_rank());
    test_result res = tp_agree(dp_run(ref, NULL, own, 0, 5, want, p5));
    if (res == TEST_PASS) res = tp_agree(dp_run(ref, NULL, NULL, 0, 15, want, NULL));
    snprintf(own, sizeof(own), "%s/tp1_rank0", base); /* every rank loads rank 0's copy */
    struct { const char* name; int pp, tp, dp; } layouts[] = {
        {"TP=2", 1, 2, 1}, {"PP=2", 2, 1, 1}, {"DP=2 distributed optimizer", 1, 1, 2}};
    for (int k = 0; k < 3 && res == TEST_PASS; k++) {
        mt_config c = pp_config(MT_FP32, layouts[k].pp, 1, layouts[k].tp, layouts[k].dp, 0);
        if (layouts[k].dp > 1) test_config_ddp(&c, 1, 1, 1, 20000);
        int equal = 1;
        snprintf(dir, sizeof(dir), "%s/layout%d", base, k);
        res = tp_agree(dp_run(c, own, NULL, 5, 0, got, w)); /* loaded only */
        /* with PP each rank holds its stage's tensors: merged (tests/test_pipeline.h); with TP or DP
         * each has the whole model already */
        if (layouts[k].pp > 1) pp_merge(&c, w, n, &equal);
        if (res == TEST_PASS && (!equal || memcmp(w, p5, sizeof(float) * (size_t)n))) {
            printf("    FAIL %s: the loaded weights are not the saved ones (copies on the ranks %s)\n", layouts[k].name,
                   equal ? "agree" : "differ");
            ckt_describe_difference(&fin, w, p5, n);
            res = TEST_FAIL;
        }
        if (res == TEST_PASS) res = tp_agree(dp_run(c, own, dir, 5, 5, got, w10));
        if (layouts[k].pp > 1) pp_merge(&c, w10, n, &equal);
        const double worst = ckt_worst_relative(got, want, 5, 10);
        if (res == TEST_PASS && !equal) {
            printf("    FAIL %s: the stages' copies of the tied word embeddings differ after 5 steps\n", layouts[k].name);
            res = TEST_FAIL;
        }
        if (res == TEST_PASS && !(worst <= 1e-5)) {
            printf("    FAIL %s: losses after the load differ from TP=1's by %.3e\n", layouts[k].name, worst);
            res = TEST_FAIL;
        }
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD);
#endif
        /* and back: TP=1 (each rank alone) loads that layout's checkpoint */
        if (res == TEST_PASS) res = tp_agree(dp_run(ref, dir, NULL, 10, 0, got, w));
        if (res == TEST_PASS && memcmp(w, w10, sizeof(float) * (size_t)n)) {
            printf("    FAIL %s -> TP=1: the loaded weights are not the saved ones\n", layouts[k].name);
            ckt_describe_difference(&fin, w, w10, n);
            res = TEST_FAIL;
        }
        if (res == TEST_PASS) res = tp_agree(dp_run(ref, dir, NULL, 10, 5, got, NULL));
        const double back = ckt_worst_relative(got, want, 10, 15);
        if (res == TEST_PASS && !(back <= 1e-5)) {
            printf("    FAIL %s -> TP=1: losses differ from the reference by %.3e\n", layouts[k].name, back);
            res = TEST_FAIL;
        }
        res = tp_agree(res);
        if (res == TEST_PASS)
            printf("      TP=1 -> %s: loaded weights bitwise, losses within %.2e; -> TP=1: weights bitwise, losses within %.2e\n",
                   layouts[k].name, worst, back);
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD);
#endif
    }
    if (mpi_rank() == 0) mt_remove_tree(base);
    free(p5);
    free(w);
    free(w10);
    return res;
}

/* Four GPUs (mpirun -np 4): a checkpoint of TP=2 x PP=2 (fp32, the PP tests' model, both flavours)
 * after 5 steps, loaded at TP=4 with SP, at DP=4 with the distributed optimizer (several buckets,
 * overlapped), and on one GPU (each rank alone): 5 steps from it stay within 1e-5 of the TP=2 x PP=2
 * run's own steps 6-10 (fp32; TP, PP and DP sum in other orders, the tolerance of the fp32 TP and PP
 * tests). */
static test_result test_layout_changes_four_gpus(void) {
    REQUIRE_MPI_GPUS();
    if (mpi_world() != 4) SKIP("runs under mpirun -np 4, not %d", mpi_world());
    const int tag = ckt_shared_tag();
    test_result res = TEST_PASS;
    for (int llama = 0; llama <= 1 && res == TEST_PASS; llama++) {
        const char* flavour = llama ? "Llama" : "GPT-2";
        char dir[256];
        snprintf(dir, sizeof(dir), "/tmp/mt_test_layout4_%d_%d", tag, llama);
        mt_config src = pp_config(MT_FP32, 2, 1, 2, 1, llama);
        double orig[10], got[10];
        res = tp_agree(dp_run(src, NULL, dir, 0, 5, orig, NULL));
        if (res == TEST_PASS) res = tp_agree(dp_run(src, NULL, NULL, 0, 10, orig, NULL));
        struct { const char* name; mt_config c; } targets[3] = {
            {"TP=4 SP", pp_config(MT_FP32, 1, 1, 4, 1, llama)},
            {"DP=4 distributed optimizer", pp_config(MT_FP32, 1, 1, 1, 4, llama)},
            {"one GPU", pp_config(MT_FP32, 1, 1, 1, 1, llama)}};
        test_config_ddp(&targets[1].c, 1, 1, 1, 20000);
        for (int k = 0; k < 3 && res == TEST_PASS; k++) {
            for (int i = 0; i < 10; i++) got[i] = NAN;
            res = tp_agree(dp_run(targets[k].c, dir, NULL, 5, 5, got, NULL));
            const double worst = ckt_worst_relative(got, orig, 5, 10);
            if (res == TEST_PASS && !(worst <= 1e-5)) {
                printf("    FAIL %s TP=2 x PP=2 -> %s: losses after the load differ from the original layout's by %.3e\n",
                       flavour, targets[k].name, worst);
                res = TEST_FAIL;
            }
            res = tp_agree(res);
            if (res == TEST_PASS)
                printf("      %s TP=2 x PP=2 -> %s: steps 6-10 %.6f -> %.6f, within %.2e of TP=2 x PP=2's\n", flavour,
                       targets[k].name, got[5], got[9], worst);
        }
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD);
#endif
        if (mpi_rank() == 0) mt_remove_tree(dir);
    }
    return res;
}

/* Multi-GPU (mpirun -np 2 or 4): a resume at every other TP size continues the saving layout's own
 * loss curve, with a vocabulary (1100) that Megatron pads differently at each TP (128 x TP: 1152 at
 * TP=1, 1280 at TP=2, 1536 at TP=4). Each layout fills the world with DP (fp32, GPT-2: the padded
 * rows take part in the softmax); it trains 5 steps and saves, and 10 straight steps are its curve.
 * Every other TP loads that checkpoint (mt_config_resume_padding, as train_gpt does) and must keep
 * the saved padding (it divides by every TP here) and run steps 6-10 within 1e-5 of the curve (fp32:
 * TP and DP sum in other orders; the tolerance of the fp32 TP tests). Without the kept padding the
 * new rows' logits (0) join the softmax and the loss moves by about 1e-2. The negative control: a
 * padding that must change (vocabulary 1101 padded to 1101 by --make-vocab-size-divisible-by 1 at
 * TP=1, 1102 at TP=2) moves the loss by more than 1e-5, so the comparison can see a padding change. */
static mt_config ckt_vocab_config(int tp, int64_t vocab, int divisible_by) {
    mt_config c = tp_config(MT_FP32, tp, mpi_world() / tp, tp > 1, 0);
    c.vocab_size = vocab;
    c.make_vocab_size_divisible_by = divisible_by;
    return c;
}

static test_result test_resume_across_tp_sizes(void) {
    REQUIRE_MPI_GPUS();
    const int world = mpi_world();
    if (world != 2 && world != 4) SKIP("runs under mpirun -np 2 or 4, not %d", world);
    const int tag = ckt_shared_tag();
    int sizes[3] = {1, 2, 4}, num_sizes = world == 4 ? 3 : 2;
    test_result res = TEST_PASS;
    mt_error err;
    for (int s = 0; s < num_sizes && res == TEST_PASS; s++) {
        char dir[256];
        snprintf(dir, sizeof(dir), "/tmp/mt_test_resume_tp_%d_%d", tag, sizes[s]);
        mt_config src = ckt_vocab_config(sizes[s], 1100, 128), fin = src;
        EXPECT_OK(mt_config_finalize(&fin, &err), &err);
        double curve[10], got[10];
        res = tp_agree(dp_run(src, NULL, dir, 0, 5, curve, NULL));
        if (res == TEST_PASS) res = tp_agree(dp_run(src, NULL, NULL, 0, 10, curve, NULL));
        for (int t = 0; t < num_sizes && res == TEST_PASS; t++) {
            if (t == s) continue;
            mt_config c = ckt_vocab_config(sizes[t], 1100, 128), kept;
            mt_config_resume_padding(&c, dir);
            kept = c;
            EXPECT_OK(mt_config_finalize(&kept, &err), &err);
            if (kept.padded_vocab_size != fin.padded_vocab_size) {
                printf("    FAIL TP=%d -> TP=%d: the padded vocabulary %lld is not the checkpoint's %lld\n", sizes[s],
                       sizes[t], (long long)kept.padded_vocab_size, (long long)fin.padded_vocab_size);
                res = TEST_FAIL;
            }
            for (int i = 0; i < 10; i++) got[i] = NAN;
            if (res == TEST_PASS) res = tp_agree(dp_run(c, dir, NULL, 5, 5, got, NULL));
            const double worst = ckt_worst_relative(got, curve, 5, 10);
            if (res == TEST_PASS && !(worst <= 1e-5)) {
                printf("    FAIL TP=%d -> TP=%d: steps 6-10 differ from TP=%d's own by %.3e\n", sizes[s], sizes[t],
                       sizes[s], worst);
                res = TEST_FAIL;
            }
            res = tp_agree(res);
            if (res == TEST_PASS)
                printf("      TP=%d (padded %lld) -> TP=%d: steps 6-10 %.6f -> %.6f, within %.2e of TP=%d's\n", sizes[s],
                       (long long)fin.padded_vocab_size, sizes[t], got[5], got[9], worst, sizes[s]);
        }
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD);
#endif
        if (mpi_rank() == 0) mt_remove_tree(dir);
    }
    /* the negative control: a padding that must change moves the loss */
    if (res == TEST_PASS) {
        char dir[256];
        snprintf(dir, sizeof(dir), "/tmp/mt_test_resume_tp_%d_repad", tag);
        mt_config src = ckt_vocab_config(1, 1101, 1), c = ckt_vocab_config(2, 1101, 1), kept;
        double curve[10], got[10];
        res = tp_agree(dp_run(src, NULL, dir, 0, 5, curve, NULL));
        if (res == TEST_PASS) res = tp_agree(dp_run(src, NULL, NULL, 0, 10, curve, NULL));
        mt_config_resume_padding(&c, dir);
        kept = c;
        EXPECT_OK(mt_config_finalize(&kept, &err), &err);
        EXPECT(kept.resumed_padded_vocab_size == 1101 && kept.padded_vocab_size == 1102,
               "1101 saved at TP=1 resumes at TP=2 padded to %lld (saved %lld), want 1102",
               (long long)kept.padded_vocab_size, (long long)kept.resumed_padded_vocab_size);
        if (res == TEST_PASS) res = tp_agree(dp_run(c, dir, NULL, 5, 5, got, NULL));
        const double moved = ckt_worst_relative(got, curve, 5, 10);
        if (res == TEST_PASS && !(moved > 1e-5)) {
            printf("    FAIL the re-padded resume (1101 -> 1102) stays within %.3e of the curve: the comparison cannot "
                   "see a padding change\n", moved);
            res = TEST_FAIL;
        }
        res = tp_agree(res);
        if (res == TEST_PASS) printf("      negative control: re-padded 1101 -> 1102 at TP=2 moves the loss by %.2e\n", moved);
#ifdef MT_USE_MPI
        MPI_Barrier(MPI_COMM_WORLD);
#endif
        if (mpi_rank() == 0) mt_remove_tree(dir);
    }
    return res;
}

static const test_case checkpoint_tool_multigpu_tests[] = {
    {"load_any_layout", test_load_any_layout_multigpu},
    {"layout_changes_on_four_gpus", test_layout_changes_four_gpus},
    {"resume_across_tp_sizes_keeps_the_padding", test_resume_across_tp_sizes},
};

/* GPU: --async-save. One trainer, 5 steps, then the same iteration saved synchronously and
 * asynchronously: until mt_trainer_save_wait commits it the async one is not there for a reader (no
 * tracker, no iter_ directory) while a step runs (the staged copy is iteration 5's, whatever the
 * step changes); committed, every file (model file, manifest) is byte-identical to the sync save's,
 * and a resume from it continues bitwise as the run that never stopped. A second async save due
 * while one is in flight waits for it (both committed). A write error in the background (a file-size
 * limit) comes back from mt_trainer_save_wait as one line, and nothing of that save is left. Prints
 * the step loop's cost of each kind of save. */
static double ckt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static test_result test_async_save(void) {
    REQUIRE_GPU();
    mt_config c = test_config(TEST_GPT2, MT_BF16);
    mt_error err;
    EXPECT_OK(mt_config_finalize(&c, &err), &err);
    char root[256], sync_dir[400], async_dir[400], path[600], p2[600];
    ckt_dir(root, sizeof(root), "async");
    snprintf(sync_dir, sizeof(sync_dir), "%s/sync", root);
    snprintf(async_dir, sizeof(async_dir), "%s/async", root);
    const int64_t n = mt_num_parameters(&c);
    double straight[20];
    float* ps = (float*)malloc(sizeof(float) * (size_t)n);
    test_result res = run_steps(&c, NULL, NULL, 0, 10, straight, ps);
    if (res != TEST_PASS) return res;
    mt_trainer* t = NULL;
    EXPECT_OK(mt_trainer_create(&t, &c, &err), &err);
    int64_t per_step = (int64_t)c.global_batch_size * (c.seq_length + 1);
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * per_step);
    mt_step_result r;
    mt_status st = MT_OK;
    for (int k = 0; k < 5 && st == MT_OK; k++) {
        fill_tokens(tokens, per_step, (int)c.vocab_size, 1000 + k);
        st = mt_trainer_train_step(t, tokens, &r, &err);
    }
    double t0 = ckt_now();
    if (st == MT_OK) st = mt_trainer_save(t, sync_dir, 5, 5 * c.global_batch_size, &err);
    double t1 = ckt_now();
    if (st == MT_OK) st = mt_trainer_save_async(t, async_dir, 5, 5 * c.global_batch_size, &err);
    double t2 = ckt_now();
    int64_t committed = -2, chosen = -1;
    mt_error scratch;
    /* not committed: nothing a reader accepts, while the next step changes the weights */
    int visible = mt_checkpoint_select(async_dir, -1, 0, &chosen, NULL, NULL, &scratch) == MT_OK;
    snprintf(path, sizeof(path), "%s/iter_0000005", async_dir);
    visible |= access(path, F_OK) == 0;
    fill_tokens(tokens, per_step, (int)c.vocab_size, 1005);
    if (st == MT_OK) st = mt_trainer_train_step(t, tokens, &r, &err);
    double t3 = ckt_now();
    if (st == MT_OK) st = mt_trainer_save_wait(t, 1, &committed, &err);
    double t4 = ckt_now();
    /* a second save due while one is in flight: it waits for the first */
    if (st == MT_OK) st = mt_trainer_save_async(t, async_dir, 6, 6 * c.global_batch_size, &err);
    if (st == MT_OK) st = mt_trainer_save_async(t, async_dir, 7, 7 * c.global_batch_size, &err);
    int64_t second = -2, tracked = -1;
    if (st == MT_OK) st = mt_trainer_save_wait(t, 1, &second, &err);
    /* a write error in the background: one line from the wait, nothing left of the save */
    struct rlimit old_limit, small;
    getrlimit(RLIMIT_FSIZE, &old_limit);
    small = old_limit;
    small.rlim_cur = 4096;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    mt_status bad = MT_OK, bad_wait = MT_OK;
    mt_error bad_err;
    bad_err.message[0] = 0;
    if (st == MT_OK && setrlimit(RLIMIT_FSIZE, &small) == 0) {
        bad = mt_trainer_save_async(t, async_dir, 8, 8 * c.global_batch_size, &bad_err);
        if (bad == MT_OK) bad_wait = mt_trainer_save_wait(t, 1, NULL, &bad_err);
        setrlimit(RLIMIT_FSIZE, &old_limit);
    }
    signal(SIGXFSZ, old_handler);
    mt_trainer_free(t);
    free(tokens);
    EXPECT_OK(st, &err);
    EXPECT(!visible, "an async save was visible before its commit");
    EXPECT(committed == 5 && second == 7, "committed %lld, then %lld", (long long)committed, (long long)second);
    EXPECT(mt_checkpoint_read_tracker(async_dir, &tracked, &err) == MT_OK && tracked == 7, "tracker %lld", (long long)tracked);
    snprintf(path, sizeof(path), "%s/iter_0000006/manifest.txt", async_dir);
    EXPECT(access(path, R_OK) == 0, "the save that was in flight (6) was not committed");
    EXPECT(bad == MT_OK && bad_wait == MT_ERR_IO && strstr(bad_err.message, "cannot write") && !strchr(bad_err.message, '\n'),
           "background write error: save %s, wait %s: '%s'", mt_status_name(bad), mt_status_name(bad_wait), bad_err.message);
    snprintf(path, sizeof(path), "%s/iter_0000008", async_dir);
    snprintf(p2, sizeof(p2), "%s/.tmp_iter_0000008", async_dir);
    EXPECT(access(path, F_OK) != 0 && access(p2, F_OK) != 0, "the failed save left files");
    /* byte-identical files */
    const char* files[] = {"mp_rank_00/model_optim_rng.bin", "manifest.txt"};
    for (int i = 0; i < 2; i++) {
        size_t na = 0, nb = 0;
        snprintf(path, sizeof(path), "%s/iter_0000005/%s", sync_dir, files[i]);
        snprintf(p2, sizeof(p2), "%s/iter_0000005/%s", async_dir, files[i]);
        char* x = test_read_file(path, &na);
        char* y = test_read_file(p2, &nb);
        int same = x && y && na == nb && !memcmp(x, y, na);
        free(x);
        free(y);
        EXPECT(same, "%s differs between the sync and the async save", files[i]);
    }
    /* the async checkpoint of iteration 5 resumes bitwise (the tracker pointed back at it) */
    EXPECT_OK(mt_checkpoint_write_tracker(async_dir, 5, &err), &err);
    res = ckt_resume_bitwise(&c, async_dir, straight, ps, n, "resumed from the async save");
    free(ps);
    mt_remove_tree(root);
    if (res == TEST_PASS)
        printf("      %lld parameters: the step loop paid %.2f ms for a sync save, %.2f ms for an async one (written "
               "while a %.2f ms step ran; committed %.2f ms later); files byte-identical, resumed bitwise\n",
               (long long)n, 1000 * (t1 - t0), 1000 * (t2 - t1), 1000 * (t3 - t2), 1000 * (t4 - t3));
    return res;
}

/* ---- one rank's files, their headers' rank words and checks; a save's directories and commit -------- */

/* megatron.h's rules for one rank's files (section 13): the names it writes (one stage and a
 * pipeline; the model file on DP rank 0 only; with the distributed optimizer the shard file first),
 * the rank words a writer puts in its headers, and the checks of a load at the same layout
 * (mt_checkpoint_header_check_rank): a header as the writer filled it passes for its own rank (and
 * the model file for every DP rank), and each way a file can belong to another iteration, another
 * size, another model, another rank or another sharding is refused in one line naming it. */
static test_result test_rank_files_and_checks(void) {
    mt_ckpt_rank r;
    memset(&r, 0, sizeof(r));
    mt_ckpt_file files[2];
    r.tp_rank = 1, r.pp = 1, r.vp = 1, r.dp = 2;
    int n = mt_ckpt_rank_files(&r, files);
    EXPECT(n == 1 && !strcmp(files[0].path, "mp_rank_01/model_optim_rng.bin") && !files[0].shard, "%d: %s", n,
           files[0].path);
    r.dp_rank = 1;
    EXPECT(mt_ckpt_rank_files(&r, files) == 0, "a DP replica writes no model file");
    r.tp_rank = 0, r.pp = 2, r.pp_rank = 1, r.dp_rank = 0, r.sharded = 1;
    n = mt_ckpt_rank_files(&r, files);
    EXPECT(n == 2 && !strcmp(files[0].path, "mp_rank_00_001/distrib_optim_dp000.bin") && files[0].shard &&
           !strcmp(files[1].path, "mp_rank_00_001/model_optim_rng.bin") && !files[1].shard, "%d: %s, %s", n,
           files[0].path, files[1].path);
    r.dp_rank = 12;
    n = mt_ckpt_rank_files(&r, files);
    EXPECT(n == 1 && !strcmp(files[0].path, "mp_rank_00_001/distrib_optim_dp012.bin"), "%d: %s", n, files[0].path);

    /* rank (TP 1, DP 1, PP 1) of TP 2 x DP 2 x PP 2 with the distributed optimizer */
    ckt_layout L;
    memset(&L, 0, sizeof(L));
    L.tp = 2, L.pp = 2, L.vp = 1, L.dp = 2;
    mt_config c;
    ckt_model(&c, &L);
    mt_rank_coords coords = {1, 1, 1};
    c.rank = mt_rank_of(&c, coords);
    mt_error err;
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
    const int64_t shard = ckt_shard_numel(&B, 2, 1);
    const mt_ckpt_rank me = {1, 1, 1, 2, 1, B.canonical_size, 2, 1, shard, {1, 4096}};
    mt_buffer_layout_free(&B);
    int64_t h[MT_CK_HEADER_WORDS];
    ckt_rank_header(h, &c, &me, 7);
    EXPECT(h[MT_CK_TP_RANK] == 1 && h[MT_CK_PP_RANK] == 1 && h[MT_CK_DP_RANK] == 1 && h[MT_CK_VP] == 1 &&
           h[MT_CK_STAGE_NUMEL] == me.stage_numel && h[MT_CK_SHARDED_DP] == 2 && h[MT_CK_SHARD_NUMEL] == shard &&
           h[MT_CK_DDP_OVERLAP] == 2 && h[MT_CK_DDP_BUCKET_SIZE] == 4096, "rank words");
    const int64_t model_bytes = mt_checkpoint_file_bytes(h, 0), shard_bytes = mt_checkpoint_file_bytes(h, 1);
    EXPECT_OK(mt_checkpoint_header_check_rank(h, model_bytes, "m.bin", &c, &me, 7, 0, &err), &err);
    EXPECT_OK(mt_checkpoint_header_check_rank(h, shard_bytes, "s.bin", &c, &me, 7, 1, &err), &err);
    mt_ckpt_rank replica = me;
    replica.dp_rank = 0; /* every DP rank reads the model file */
    EXPECT_OK(mt_checkpoint_header_check_rank(h, model_bytes, "m.bin", &c, &replica, 7, 0, &err), &err);
    mt_config other = c;
    other.num_layers = 8;
    struct {
        const char* what;
        int64_t bytes, iteration;
        int shard_file;
        const mt_config* cfg;
        mt_ckpt_rank rank;
        mt_status status;
        const char* needle;
    } cases[] = {
        {"another iteration", model_bytes, 8, 0, &c, me, MT_ERR_FORMAT, "m.bin holds iteration 7, not 8"},
        {"a short file", model_bytes - 4, 7, 0, &c, me, MT_ERR_FORMAT, "but its header describes"},
        {"a long file", shard_bytes + 4, 7, 1, &c, me, MT_ERR_FORMAT, "(too long)"},
        {"no size", -1, 7, 0, &c, me, MT_ERR_FORMAT, "m.bin has -1 bytes"},
        {"another model", model_bytes, 7, 0, &other, me, MT_ERR_CONFIG, "has --num-layers 4 but this run has 8"},
        {"another TP rank", model_bytes, 7, 0, &c, {0, 1, 1, 2, 1, me.stage_numel, 2, 1, shard, {1, 4096}},
         MT_ERR_FORMAT, "holds tensor-parallel rank 1's shard, not rank 0's"},
        {"another pipeline rank", model_bytes, 7, 0, &c, {1, 0, 1, 2, 1, me.stage_numel, 2, 1, shard, {1, 4096}},
         MT_ERR_CONFIG, "this rank is pipeline rank 0 of another split"},
        {"another stage size", model_bytes, 7, 0, &c, {1, 1, 1, 2, 1, me.stage_numel + 1, 2, 1, shard, {1, 4096}},
         MT_ERR_CONFIG, "resume with the same pipeline layout"},
        {"sharded over another DP size", model_bytes, 7, 0, &c, {1, 1, 1, 2, 1, me.stage_numel, 4, 1, shard, {1, 4096}},
         MT_ERR_CONFIG, "sharded over 2 data-parallel ranks (--use-distributed-optimizer); this run has 4 ranks:"},
        {"sharded, read unsharded", model_bytes, 7, 0, &c, {1, 1, 1, 2, 1, me.stage_numel, 2, 0, 0, {0, 0}},
         MT_ERR_CONFIG, "this run has 2 ranks without it"},
        {"another DP rank's shard", shard_bytes, 7, 1, &c, {1, 1, 0, 2, 1, me.stage_numel, 2, 1, shard, {1, 4096}},
         MT_ERR_FORMAT, "s.bin is the shard of DP rank 1 with"},
        {"another shard size", shard_bytes, 7, 1, &c, {1, 1, 1, 2, 1, me.stage_numel, 2, 1, shard + 1, {1, 4096}},
         MT_ERR_FORMAT, "not of rank 1 with"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char* path = cases[i].shard_file ? "s.bin" : "m.bin";
        mt_status st = mt_checkpoint_header_check_rank(h, cases[i].bytes, path, cases[i].cfg, &cases[i].rank,
                                                       cases[i].iteration, cases[i].shard_file, &err);
        EXPECT(st == cases[i].status && strstr(err.message, cases[i].needle) && !strchr(err.message, '\n'),
               "%s: %s, '%s'", cases[i].what, mt_status_name(st), st != MT_OK ? err.message : "");
    }
    /* one stage, unsharded: no stage or sharding words */
    const mt_ckpt_rank plain = {0, 0, 0, 1, 1, 999, 1, 0, 0, {1, 4096}};
    mt_checkpoint_header_set_rank(h, &plain);
    EXPECT(h[MT_CK_VP] == 0 && h[MT_CK_STAGE_NUMEL] == 0 && h[MT_CK_SHARDED_DP] == 0 && h[MT_CK_SHARD_NUMEL] == 0 &&
           h[MT_CK_DDP_OVERLAP] == 0 && h[MT_CK_DDP_BUCKET_SIZE] == 0, "unsharded, one stage");
    return TEST_PASS;
}

/* ---- issue #34: checkpoints of expert-parallel runs (host) ------------------------------------ */

/* The part of the full canonical arrays `full` that rank c->rank of c's layout holds, in its buffer layout
 * B's canonical order (the reference mt_ckpt_read_part is held to): its model-parallel shard (TP rank + TP x
 * EP rank: mt_tp_shard_copy, the experts of its EP rank) put at each (tensor, layer)'s canonical offset, as
 * ckt_write lays out a file. out: B->canonical_size floats. */
static void ckt_rank_part(const mt_config* c, const mt_buffer_layout* B, float* full, float* out) {
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    const int64_t n = mt_param_layout_shard(c, info);
    float* shard = (float*)malloc(sizeof(float) * (size_t)n);
    if (!shard) return;
    const mt_rank_coords rk = mt_rank_coordinates(c, c->rank);
    mt_tp_shard_copy(c, rk.tp + c->tensor_model_parallel_size * rk.ep, full, shard, 1);
    for (int i = 0; i < B->num_params; i++) {
        const mt_buffer_param* p = &B->params[i];
        const int layered = mt_param_per_layer(p->tensor);
        memcpy(out + p->canonical, shard + info[p->tensor].offset + (layered ? (int64_t)p->layer * p->numel : 0),
               sizeof(float) * (size_t)p->numel);
    }
    free(shard);
}

/* An MoE layout of the tiny model (4 layers, all MoE, 4 experts, the expert bias): TP tp, the experts over ep
 * EP ranks, dp > 0: the distributed optimizer over dp ranks (overlap: small buckets, several of each kind). */
static ckt_layout ckt_moe_layout(int tp, int dp, int ep, int overlap, const float* bias) {
    ckt_layout L;
    memset(&L, 0, sizeof(L));
    L.llama = 1, L.untied = 1, L.tp = tp, L.pp = 1, L.vp = 1, L.dp = dp, L.manifest = 1, L.record_ddp = 1;
    L.overlap_grad_reduce = overlap, L.ddp_bucket_size = overlap ? 2000 : 0;
    L.padded = 512, L.moe = 1, L.expert_bias = bias, L.ep = ep;
    return L;
}

/* The files of an expert-parallel checkpoint, as Megatron names them (mp_rank_<tp>_<ep>, mp_rank_<tp>_<pp>_<ep>),
 * which DP ranks write which (the model file on the first DP rank of each EP rank's experts, every shard file
 * in its EP rank's directory), the EP words of the header (size, rank; the model file's size counts its EP
 * rank's experts) and their checks: an EP size of 1, one that does not divide the experts or the optimizer's
 * sharding, an EP rank beyond it, a DP rank not of that EP rank, EP on a dense model, a file of another EP rank,
 * another EP size at the same layout (accepted at any layout) and another expert count, each refused in one
 * line. */
static test_result test_ep_rank_files_and_checks(void) {
    char dir[64];
    mt_ckpt_rank_dir_ep(dir, sizeof(dir), "it", 1, 2, 3, 0, 1);
    EXPECT(!strcmp(dir, "it/mp_rank_03_001"), "%s", dir);
    mt_ckpt_rank_dir_ep(dir, sizeof(dir), "it", 2, 4, 0, 1, 3);
    EXPECT(!strcmp(dir, "it/mp_rank_00_001_003"), "%s", dir);
    mt_ckpt_rank_dir_ep(dir, sizeof(dir), "it", 1, 1, 2, 0, 0);
    EXPECT(!strcmp(dir, "it/mp_rank_02"), "%s", dir);
    /* EP 2 over DP 4 with the distributed optimizer, then without */
    mt_ckpt_rank r;
    memset(&r, 0, sizeof(r));
    r.pp = 1, r.vp = 1, r.dp = 4, r.sharded = 1, r.ep = 2;
    const char* want[4][2] = {
        {"mp_rank_00_000/distrib_optim_dp000.bin", "mp_rank_00_000/model_optim_rng.bin"},
        {"mp_rank_00_001/distrib_optim_dp001.bin", "mp_rank_00_001/model_optim_rng.bin"},
        {"mp_rank_00_000/distrib_optim_dp002.bin", NULL},
        {"mp_rank_00_001/distrib_optim_dp003.bin", NULL},
    };
    mt_ckpt_file files[2];
    for (int d = 0; d < 4; d++) {
        r.dp_rank = d;
        const int n = mt_ckpt_rank_files(&r, files);
        EXPECT(n == (want[d][1] ? 2 : 1) && !strcmp(files[0].path, want[d][0]) && files[0].shard &&
                   (n == 1 || (!strcmp(files[1].path, want[d][1]) && !files[1].shard)),
               "DP rank %d: %d files, %s", d, n, files[0].path);
    }
    r.sharded = 0, r.dp_rank = 1;
    EXPECT(mt_ckpt_rank_files(&r, files) == 1 && !strcmp(files[0].path, "mp_rank_00_001/model_optim_rng.bin"),
           "unsharded DP rank 1: %s", files[0].path);
    r.dp_rank = 3;
    EXPECT(mt_ckpt_rank_files(&r, files) == 0, "unsharded DP rank 3 (EP rank 1's second copy) writes nothing");

    /* DP rank 3 (EP rank 1, EDP rank 1) of EP 2 over DP 4 with the distributed optimizer */
    float bias[16] = {0};
    ckt_layout L = ckt_moe_layout(1, 4, 2, 0, bias);
    mt_config c;
    ckt_model(&c, &L);
    mt_rank_coords coords = {0, 3, 0, 0, 0};
    c.rank = mt_rank_of(&c, coords);
    mt_error err;
    mt_buffer_layout B;
    EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
    const int64_t shard = ckt_shard_numel(&B, 4, 3);
    const mt_ckpt_rank me = {0, 0, 3, 1, 1, B.canonical_size, 4, 1, shard, {0, 0}, 2};
    const int64_t numel = B.canonical_size;
    mt_buffer_layout_free(&B);
    EXPECT(numel == mt_param_layout_shard(&c, NULL) && numel < mt_param_layout(&c, NULL), "EP rank 1 holds %lld of %lld",
           (long long)numel, (long long)mt_param_layout(&c, NULL));
    int64_t h[MT_CK_HEADER_WORDS], x[MT_CK_HEADER_WORDS];
    ckt_rank_header(h, &c, &me, 7);
    const double one = 1.0;
    EXPECT(h[MT_CK_EP] == 2 && h[MT_CK_EP_RANK] == 1 && h[MT_CK_DP_RANK] == 3 && h[MT_CK_SHARDED_DP] == 4,
           "EP words %lld %lld, DP rank %lld", (long long)h[MT_CK_EP], (long long)h[MT_CK_EP_RANK],
           (long long)h[MT_CK_DP_RANK]);
    EXPECT_OK(mt_checkpoint_header_check(h, "ck", NULL, &err), &err);
    const int64_t model_bytes = mt_checkpoint_file_bytes(h, 0), shard_bytes = mt_checkpoint_file_bytes(h, 1);
    EXPECT(model_bytes == 8 * MT_CK_HEADER_WORDS + 4 * (numel + 16), "the model file: %lld bytes", (long long)model_bytes);
    EXPECT_OK(mt_checkpoint_header_check_rank(h, shard_bytes, "s.bin", &c, &me, 7, 1, &err), &err);
    mt_ckpt_rank first = me;
    first.dp_rank = 1; /* EP rank 1's other DP rank reads the same model file */
    EXPECT_OK(mt_checkpoint_header_check_rank(h, model_bytes, "m.bin", &c, &first, 7, 0, &err), &err);
    mt_ckpt_rank other_ep = me;
    other_ep.dp_rank = 2;
    mt_status st = mt_checkpoint_header_check_rank(h, model_bytes, "m.bin", &c, &other_ep, 7, 0, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "m.bin holds expert-parallel rank 1's experts, not rank 0's") &&
               !strchr(err.message, '\n'), "%s", err.message);
    /* another EP size: refused at the same layout, taken at any layout; another expert count: refused at both */
    mt_config c1 = c;
    c1.expert_model_parallel_size = 1;
    mt_ckpt_rank me1 = me;
    me1.ep = 1;
    st = mt_checkpoint_header_check_rank(h, model_bytes, "m.bin", &c1, &me1, 7, 0, &err);
    EXPECT(st == MT_ERR_CONFIG && strstr(err.message, "has --expert-model-parallel-size (0: 1) 2 but this run has 0"),
           "%s", err.message);
    EXPECT_OK(mt_checkpoint_header_check_model(h, "m.bin", &c1, 1, &err), &err);
    mt_config c8 = c1;
    c8.num_experts = 8;
    for (int any = 0; any < 2; any++) {
        st = mt_checkpoint_header_check_model(h, "m.bin", &c8, any, &err);
        EXPECT(st == MT_ERR_CONFIG && strstr(err.message, "has --num-experts (0: a dense model) 4 but this run has 8") &&
                   !strchr(err.message, '\n'), "any layout %d: %s", any, err.message);
    }
    /* the header's own checks of the EP words */
    struct { int word; int64_t value; const char* needle; } bad[] = {
        {MT_CK_EP, 1, "the expert-parallel words"},        /* EP = 1 is written as 0 */
        {MT_CK_EP, 3, "the expert-parallel words"},        /* 4 experts, and sharded over 4 */
        {MT_CK_EP, 8, "the expert-parallel words"},
        {MT_CK_EP_RANK, 2, "the expert-parallel words"},
        {MT_CK_EP_RANK, 0, "DP rank % EP = EP rank"},      /* DP rank 3 is EP rank 1's */
        {MT_CK_DP_RANK, 2, "DP rank % EP = EP rank"},
        {MT_CK_EP, 70000, "outside [0, 65536]"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memcpy(x, h, sizeof(h));
        x[bad[i].word] = bad[i].value;
        st = mt_checkpoint_header_check(x, "ck", NULL, &err);
        EXPECT(st == MT_ERR_FORMAT && strstr(err.message, bad[i].needle) && !strchr(err.message, '\n'),
               "word %d = %lld: %s", bad[i].word, (long long)bad[i].value, st == MT_OK ? "accepted" : err.message);
    }
    /* EP on a dense model */
    ckt_layout D = L;
    D.moe = 0, D.ep = 0, D.dp = 0;
    mt_config cd;
    ckt_model(&cd, &D);
    mt_checkpoint_header_init(x, &cd);
    memcpy(&x[MT_CK_LOSS_SCALE_BITS], &one, sizeof(double));
    EXPECT_OK(mt_checkpoint_header_check(x, "dense", NULL, &err), &err);
    x[MT_CK_EP] = 2;
    st = mt_checkpoint_header_check(x, "dense", NULL, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "the expert-parallel words"), "%s", err.message);
    return TEST_PASS;
}

/* mt_ckpt_read_part with expert parallelism, the trainer's --load at another EP size: every rank of every target
 * layout (EP 1, 2, 4; with and without the distributed optimizer; TP 2 x EP 2) reads from each source (EP 2
 * unsharded; EP 2 over DP 4 with the distributed optimizer in several dense and expert buckets; EP 1 over
 * DP 2 with it; TP 2 x EP 2 with it) exactly the part the reference cuts from the full arrays (ckt_rank_part:
 * its EP rank's experts, its TP rows), bitwise, for the master weights and both Adam moments; each source's
 * expert bias comes back bitwise from every model file (every EP rank's directory); a model with other
 * expert counts is refused in one line. */
static test_result test_read_part_expert_parallel(void) {
    char root[256], src[400];
    ckt_dir(root, sizeof(root), "read_part_ep");
    mt_error err;
    float bias[16], got_bias[16];
    for (int i = 0; i < 16; i++) bias[i] = 0.125f * (float)(i - 5) + 1e-3f * (float)i;
    const ckt_layout sources[] = {ckt_moe_layout(1, 0, 2, 0, bias), ckt_moe_layout(1, 4, 2, 1, bias),
                                  ckt_moe_layout(1, 2, 1, 1, bias), ckt_moe_layout(2, 2, 2, 0, bias)};
    const struct { int tp, dp, ep; } targets[] = {{1, 0, 1}, {1, 0, 2}, {1, 2, 2}, {1, 4, 2}, {1, 4, 4},
                                                  {1, 2, 1}, {2, 0, 2}, {2, 4, 2}};
    int compared = 0;
    for (size_t si = 0; si < sizeof(sources) / sizeof(sources[0]); si++) {
        const ckt_layout* S = &sources[si];
        int64_t n_src;
        float** a = ckt_arrays(S, 51 + (uint32_t)si, &n_src);
        snprintf(src, sizeof(src), "%s/src%zu", root, si);
        EXPECT_OK(ckt_write(src, 12, S, a, &err), &err);
        mt_ckpt ck;
        EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
        EXPECT(ck.ep == (S->ep > 1 ? S->ep : 1) && ck.tp == S->tp && ck.sharded_dp == S->dp, "source %zu: EP %d TP %d "
               "sharded over %d", si, ck.ep, ck.tp, ck.sharded_dp);
        if (si == 1) { /* several buckets of each kind, or the test tests less than it says */
            mt_config cs;
            ckt_model(&cs, S);
            mt_buffer_layout B;
            EXPECT_OK(mt_buffer_layout_build(&B, &cs, &err), &err);
            int dense = 0, expert = 0;
            for (int b = 0; b < B.num_buckets; b++) (B.buckets[b].ep > 1 ? expert : dense)++;
            mt_buffer_layout_free(&B);
            EXPECT(dense > 1 && expert > 1, "%d dense and %d expert buckets", dense, expert);
        }
        EXPECT_OK(mt_ckpt_read_expert_bias(&ck, 1, got_bias, &err), &err);
        EXPECT(!memcmp(got_bias, bias, sizeof(bias)), "source %zu: the expert bias differs", si);
        EXPECT_OK(mt_ckpt_verify(&ck, NULL, &err), &err);
        EXPECT(ckt_read_equal(src, S, a, n_src, &err), "source %zu read whole: arrays differ", si);
        for (size_t ti = 0; ti < sizeof(targets) / sizeof(targets[0]); ti++) {
            ckt_layout T = ckt_moe_layout(targets[ti].tp, targets[ti].dp, targets[ti].ep, 0, bias);
            mt_config ct;
            ckt_model(&ct, &T);
            for (int rank = 0; rank < ct.world_size; rank++) {
                mt_config c = ct;
                c.rank = rank;
                mt_buffer_layout B;
                EXPECT_OK(mt_buffer_layout_build(&B, &c, &err), &err);
                float* ref = (float*)malloc(sizeof(float) * (size_t)B.canonical_size);
                float* got = (float*)malloc(sizeof(float) * (size_t)B.canonical_size);
                EXPECT(ref && got, "out of memory");
                for (int k = 0; k < 3; k++) {
                    ckt_rank_part(&c, &B, a[k], ref);
                    mt_status st = mt_ckpt_read_part(&ck, NULL, &c, k, got, &err);
                    if (st != MT_OK || memcmp(ref, got, sizeof(float) * (size_t)B.canonical_size)) {
                        printf("    source %zu -> TP %d DP %d EP %d, rank %d, array %d: %s\n", si, T.tp, targets[ti].dp,
                               targets[ti].ep, rank, k, st == MT_OK ? "differs" : err.message);
                        return TEST_FAIL;
                    }
                    compared++;
                }
                free(ref);
                free(got);
                mt_buffer_layout_free(&B);
            }
        }
        mt_config other;
        ckt_model(&other, S);
        other.num_experts = 8;
        other.expert_model_parallel_size = 1;
        float one[1];
        mt_status st = mt_ckpt_read_part(&ck, NULL, &other, 0, one, &err);
        EXPECT(st == MT_ERR_CONFIG && strstr(err.message, "another model") && !strchr(err.message, '\n'), "%s",
               err.message);
        ckt_arrays_free(a);
    }
    printf("      %d parts (rank x array) read at another EP layout, bitwise\n", compared);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* checkpoint_tool with expert parallelism (prepro/checkpoint_tool.h): an EP 2 checkpoint with the distributed
 * optimizer resharded to EP 1 (every expert in one model file, the layout convert_hf --export reads) and back to
 * EP 2, and to TP 2 x EP 4: each verifies and reads back whole bitwise (mt_ckpt_read, the independent reference:
 * mt_tp_shard_copy of each (TP, EP) shard), with its expert bias in every model file; an EP that does not divide
 * the experts is refused in one line, and so is an EP checkpoint given to the Hugging Face export. */
static test_result test_reshard_expert_parallel(void) {
    char root[256], src[400], ep1[400], ep2[400], ep4[400];
    ckt_dir(root, sizeof(root), "reshard_ep");
    mt_error err;
    float bias[16], got_bias[16];
    for (int i = 0; i < 16; i++) bias[i] = -0.0625f * (float)(i + 1);
    ckt_layout S = ckt_moe_layout(1, 4, 2, 1, bias);
    int64_t n;
    float** a = ckt_arrays(&S, 77, &n);
    snprintf(src, sizeof(src), "%s/src", root);
    EXPECT_OK(ckt_write(src, 9, &S, a, &err), &err);
    mt_ckpt ck;
    EXPECT_OK(mt_ckpt_open(&ck, src, -1, &err), &err);
    snprintf(ep1, sizeof(ep1), "%s/ep1", root);
    EXPECT_OK(mt_ckpt_reshard_ep(&ck, NULL, ep1, 1, 1, 1, 1, 128, NULL, &err), &err);
    ckt_layout L1 = ckt_moe_layout(1, 0, 1, 0, bias);
    EXPECT(ckt_read_equal(ep1, &L1, a, n, &err), "EP 2 -> EP 1: arrays differ");
    mt_ckpt c1;
    EXPECT_OK(mt_ckpt_open(&c1, ep1, -1, &err), &err);
    EXPECT(c1.ep == 1 && c1.header[MT_CK_EP] == 0 && c1.sharded_dp == 0, "EP %d", c1.ep);
    EXPECT_OK(mt_ckpt_verify(&c1, NULL, &err), &err);
    snprintf(ep2, sizeof(ep2), "%s/ep2", root);
    EXPECT_OK(mt_ckpt_reshard_ep(&c1, NULL, ep2, 1, 1, 1, 2, 128, NULL, &err), &err);
    ckt_layout L2 = ckt_moe_layout(1, 0, 2, 0, bias);
    EXPECT(ckt_read_equal(ep2, &L2, a, n, &err), "EP 1 -> EP 2: arrays differ");
    mt_ckpt c2;
    EXPECT_OK(mt_ckpt_open(&c2, ep2, -1, &err), &err);
    EXPECT(c2.ep == 2, "EP %d", c2.ep);
    EXPECT_OK(mt_ckpt_verify(&c2, NULL, &err), &err);
    EXPECT_OK(mt_ckpt_read_expert_bias(&c2, 1, got_bias, &err), &err);
    EXPECT(!memcmp(got_bias, bias, sizeof(bias)), "the expert bias differs after EP 1 -> EP 2");
    /* the files as the trainer lays them out without the distributed optimizer (ckt_write), byte for byte */
    char path[600], syn[400];
    snprintf(syn, sizeof(syn), "%s/synthetic", root);
    EXPECT_OK(ckt_write(syn, 9, &L2, a, &err), &err);
    for (int e = 0; e < 2; e++) {
        char p2[800];
        size_t na = 0, nb = 0;
        snprintf(path, sizeof(path), "%s/iter_0000009/mp_rank_00_%03d/model_optim_rng.bin", ep2, e);
        snprintf(p2, sizeof(p2), "%s/iter_0000009/mp_rank_00_%03d/model_optim_rng.bin", syn, e);
        char* x = test_read_file(path, &na);
        char* y = test_read_file(p2, &nb);
        const int same = x && y && na == nb && !memcmp(x, y, na);
        free(x);
        free(y);
        EXPECT(same, "%s differs from the trainer's layout (%zu vs %zu bytes)", path, na, nb);
    }
    /* the tool as a user runs it: reshard --target-ep, info's layout and each file's experts */
    if (access("prepro/checkpoint_tool", X_OK) == 0) {
        char cmd[1400], text[16384];
        snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool reshard %s %s/cli --target-tp 1 --target-pp 1 --target-ep 4 "
                 ">/dev/null 2>&1 && prepro/checkpoint_tool info %s/cli 2>&1", src, root, root);
        int code = test_command_output(cmd, text, sizeof(text));
        EXPECT(code == 0 && strstr(text, "layout: TP 1, PP 1, VP 1, EP 4;") &&
                   strstr(text, "mp_rank_00_003/model_optim_rng.bin") && strstr(text, "experts [3, 3], dimension 1 [6, 7]"),
               "reshard --target-ep 4, info: exit %d:\n%s", code, text);
        ckt_layout L4cli = ckt_moe_layout(1, 0, 4, 0, bias);
        snprintf(path, sizeof(path), "%s/cli", root);
        EXPECT(ckt_read_equal(path, &L4cli, a, n, &err), "checkpoint_tool reshard --target-ep 4: arrays differ");
        snprintf(cmd, sizeof(cmd), "prepro/checkpoint_tool reshard %s %s/bad --target-tp 1 --target-pp 1 --target-ep 3",
                 src, root);
        code = ckt_run_tool(cmd, text, sizeof(text));
        EXPECT(ckt_one_line("reshard --target-ep 3", code, 1, text, "checkpoint_tool", "error", "experts do not divide"),
               "see above");
    }
    snprintf(ep4, sizeof(ep4), "%s/tp2ep4", root);
    EXPECT_OK(mt_ckpt_reshard_ep(&ck, NULL, ep4, 2, 1, 1, 4, 128, NULL, &err), &err);
    ckt_layout L4 = ckt_moe_layout(2, 0, 4, 0, bias);
    EXPECT(ckt_read_equal(ep4, &L4, a, n, &err), "EP 2 -> TP 2 x EP 4: arrays differ");
    snprintf(path, sizeof(path), "%s/ep3", root);
    mt_status st = mt_ckpt_reshard_ep(&ck, NULL, path, 1, 1, 1, 3, 128, NULL, &err);
    EXPECT(st == MT_ERR_ARG && strstr(err.message, "experts do not divide") && !strchr(err.message, '\n'), "%s",
           err.message);
    /* the Hugging Face export reads TP = PP = EP = 1 only, and says how to get there */
    mt_config hc;
    float* params = NULL;
    mt_error warning;
    st = mt_hf_checkpoint_read(src, -1, 0, &hc, &params, NULL, &warning, &err);
    EXPECT(st == MT_ERR_FORMAT && strstr(err.message, "tensor/pipeline/expert parallel sizes 1/1/2") &&
               strstr(err.message, "checkpoint_tool reshard") && !strchr(err.message, '\n'), "%s", err.message);
    free(params);
    ckt_arrays_free(a);
    mt_remove_tree(root);
    return TEST_PASS;
}

/* A save's directories, tidying and commit (megatron.h section 13): the commit writes the manifest,
 * replaces an older copy of the iteration, syncs and writes the tracker; a commit whose manifest
 * cannot be written changes nothing that was there; tidying removes the temporary directories of
 * saves that never finished and settles each iter_N.old (removed beside iter_N, else put back). */
static test_result test_save_dirs_tidy_commit(void) {
    char dir[256], final_dir[400], tmp_dir[400], path[600];
    ckt_dir(dir, sizeof(dir), "commit");
    mt_checkpoint_save_dirs(dir, 5, final_dir, sizeof(final_dir), tmp_dir, sizeof(tmp_dir));
    snprintf(path, sizeof(path), "%s/iter_0000005", dir);
    EXPECT(!strcmp(final_dir, path), "%s", final_dir);
    snprintf(path, sizeof(path), "%s/.tmp_iter_0000005", dir);
    EXPECT(!strcmp(tmp_dir, path), "%s", tmp_dir);
    mt_error err;
    /* an older copy of iteration 5 in place, the new one in the temporary directory */
    snprintf(path, sizeof(path), "%s/mp_rank_00", final_dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    snprintf(path, sizeof(path), "%s/mp_rank_00/model_optim_rng.bin", final_dir);
    EXPECT(ckt_write_bytes(path, "old", 3) == 0, "write %s", path);
    snprintf(path, sizeof(path), "%s/mp_rank_00", tmp_dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    snprintf(path, sizeof(path), "%s/mp_rank_00/model_optim_rng.bin", tmp_dir);
    EXPECT(ckt_write_bytes(path, "newer", 5) == 0, "write %s", path);
    mt_checkpoint_file_crc known = {"mp_rank_00/model_optim_rng.bin", 5, mt_crc32c_extend(0, "newer", 5)};
    EXPECT_OK(mt_checkpoint_commit(dir, 5, tmp_dir, &known, 1, &err), &err);
    EXPECT_OK(mt_checkpoint_manifest_verify(final_dir, &err), &err);
    snprintf(path, sizeof(path), "%s/mp_rank_00/model_optim_rng.bin", final_dir);
    size_t size = 0;
    char* text = test_read_file(path, &size);
    const int replaced = text && size == 5 && !memcmp(text, "newer", 5);
    free(text);
    EXPECT(replaced, "iteration 5 was not replaced");
    struct stat sb;
    snprintf(path, sizeof(path), "%s.old", final_dir);
    EXPECT(stat(path, &sb) != 0 && stat(tmp_dir, &sb) != 0, "the .old or the temporary directory is left");
    int64_t tracked = -1;
    EXPECT_OK(mt_checkpoint_read_tracker(dir, &tracked, &err), &err);
    EXPECT(tracked == 5, "tracker %lld", (long long)tracked);
    /* a commit that cannot write its manifest (no temporary directory): iteration 6 does not appear,
     * the tracker stays */
    mt_checkpoint_save_dirs(dir, 6, final_dir, sizeof(final_dir), tmp_dir, sizeof(tmp_dir));
    mt_status st = mt_checkpoint_commit(dir, 6, tmp_dir, NULL, 0, &err);
    EXPECT(st != MT_OK && stat(final_dir, &sb) != 0, "status %s", mt_status_name(st));
    EXPECT_OK(mt_checkpoint_read_tracker(dir, &tracked, &err), &err);
    EXPECT(tracked == 5, "tracker %lld after a failed commit", (long long)tracked);
    /* tidying: an unfinished save, a crash between the commit's two renames (iter_3.old alone), and a
     * crash after them (iter_5.old beside iter_5) */
    snprintf(path, sizeof(path), "%s/.tmp_iter_0000009/mp_rank_00", dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    snprintf(path, sizeof(path), "%s/iter_0000003.old/mp_rank_00", dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    snprintf(path, sizeof(path), "%s/iter_0000005.old/mp_rank_00", dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    mt_checkpoint_tidy(dir);
    const struct { const char* name; int there; } after[] = {
        {".tmp_iter_0000009", 0}, {"iter_0000003.old", 0}, {"iter_0000003/mp_rank_00", 1}, {"iter_0000005.old", 0},
        {"iter_0000005/mp_rank_00/model_optim_rng.bin", 1},
    };
    for (size_t i = 0; i < sizeof(after) / sizeof(after[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, after[i].name);
        EXPECT((stat(path, &sb) == 0) == after[i].there, "after tidying, %s is %s", after[i].name,
               after[i].there ? "gone" : "still there");
    }
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ---- --save-retain-interval ------------------------------------------------------------------------ */

/* Megatron's rule (checkpointing.py): after the save of `saved` commits, the previously tracked
 * iteration goes unless it is <= 0, the one saved, a multiple of the interval, or one still being
 * written; no interval, no deletion. */
static test_result test_retain_victim_rule(void) {
    struct { int64_t previous, saved, interval, pending, victim; } cases[] = {
        {100, 200, 300, -1, 100}, {300, 400, 300, -1, -1}, {0, 100, 300, -1, -1}, {-1, 100, 300, -1, -1},
        {200, 200, 300, -1, -1}, {500, 600, 300, 500, -1}, {500, 600, 300, 600, 500}, {100, 200, 0, -1, -1},
        {100, 200, -5, -1, -1}, {1000, 900, 300, -1, 1000}, {600, 700, 300, -1, -1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int64_t v = mt_checkpoint_retain_victim(cases[i].previous, cases[i].saved, cases[i].interval, cases[i].pending);
        EXPECT(v == cases[i].victim, "previous %lld, saved %lld, interval %lld, pending %lld: %lld, want %lld",
               (long long)cases[i].previous, (long long)cases[i].saved, (long long)cases[i].interval,
               (long long)cases[i].pending, (long long)v, (long long)cases[i].victim);
    }
    return TEST_PASS;
}

/* A run of saves every 100 iterations with --save-retain-interval 300, on disk: each save writes its
 * iter directory and then the tracker (the commit), and retention runs after it with the tracker's
 * iteration before the save. What stays is 300, 600, 900 and the newest (1000), as in Megatron; a
 * symbolic link in the victim's place stays; nothing is deleted when the tracker does not name the
 * save (it was not committed); a crash's leftover .tmp_iter_*.retired goes with the next deletion. */
static test_result test_retain_on_disk(void) {
    char dir[256], path[600], target[600];
    ckt_dir(dir, sizeof(dir), "retain");
    EXPECT(mt_make_directories(dir) == 0, "mkdir %s", dir);
    mt_error err;
    int64_t previous = -1;
    for (int64_t it = 100; it <= 1000; it += 100) {
        snprintf(path, sizeof(path), "%s/iter_%07lld/mp_rank_00", dir, (long long)it);
        EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
        snprintf(path, sizeof(path), "%s/iter_%07lld/mp_rank_00/model_optim_rng.bin", dir, (long long)it);
        EXPECT(ckt_write_bytes(path, "weights", 7) == 0, "write %s", path);
        if (it == 500) { /* a crash's leftover from an earlier deletion */
            snprintf(path, sizeof(path), "%s/.tmp_iter_0000400.retired/x", dir);
            EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
        }
        EXPECT_OK(mt_checkpoint_write_tracker(dir, it, &err), &err);
        int64_t deleted = -7;
        EXPECT_OK(mt_checkpoint_retain_apply(dir, previous, it, 300, -1, &deleted, &err), &err);
        int64_t want = mt_checkpoint_retain_victim(previous, it, 300, -1);
        EXPECT(deleted == want, "save %lld: deleted %lld, want %lld", (long long)it, (long long)deleted, (long long)want);
        previous = it;
    }
    struct stat st;
    for (int64_t it = 100; it <= 1000; it += 100) {
        snprintf(path, sizeof(path), "%s/iter_%07lld", dir, (long long)it);
        const int kept = it % 300 == 0 || it == 1000;
        EXPECT((stat(path, &st) == 0) == kept, "iteration %lld %s", (long long)it, kept ? "deleted" : "kept");
    }
    snprintf(path, sizeof(path), "%s/.tmp_iter_0000400.retired", dir);
    EXPECT(stat(path, &st) != 0, "the leftover .tmp_iter_0000400.retired is still there");
    /* a save the tracker does not name: nothing goes */
    snprintf(path, sizeof(path), "%s/iter_0001100", dir);
    EXPECT(mt_make_directories(path) == 0, "mkdir %s", path);
    int64_t deleted = -7;
    EXPECT_OK(mt_checkpoint_retain_apply(dir, 1000, 1100, 300, -1, &deleted, &err), &err);
    snprintf(path, sizeof(path), "%s/iter_0001000", dir);
    EXPECT(deleted == -1 && stat(path, &st) == 0, "deleted %lld though the tracker names 1000", (long long)deleted);
    /* a symbolic link where the victim was: left alone, as Megatron does */
    EXPECT_OK(mt_checkpoint_write_tracker(dir, 1100, &err), &err);
    snprintf(target, sizeof(target), "%s/iter_0001000", dir);
    snprintf(path, sizeof(path), "%s/iter_0001000_real", dir);
    EXPECT(rename(target, path) == 0 && symlink(path, target) == 0, "symlink");
    EXPECT_OK(mt_checkpoint_retain_apply(dir, 1000, 1100, 300, -1, &deleted, &err), &err);
    EXPECT(deleted == -1 && lstat(target, &st) == 0 && S_ISLNK(st.st_mode) && stat(path, &st) == 0,
           "the link or its target went");
    mt_remove_tree(dir);
    return TEST_PASS;
}

/* ./train_gpt with --save-interval 2 --save-retain-interval 4 over 10 iterations keeps iterations 4, 8
 * and 10 (the newest), with and without --async-save, the tracker at 10. */
static test_result test_retain_train_gpt(void) {
    REQUIRE_GPU();
    if (access("./train_gpt", X_OK) != 0) SKIP("./train_gpt is not built (make all)");
    for (int async = 0; async < 2; async++) {
        char dir[256], cmd[1024], out[16384], path[600];
        ckt_dir(dir, sizeof(dir), async ? "retain_async" : "retain_sync");
        snprintf(cmd, sizeof(cmd), "./train_gpt --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --num-layers 2 "
                 "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --train-iters 10 "
                 "--lr 1e-3 --eval-iters 0 --save %s --save-interval 2 --save-retain-interval 4%s 2>&1", dir,
                 async ? " --async-save" : "");
        int code = test_command_output(cmd, out, sizeof(out));
        EXPECT(code == 0, "%s: exit %d\n%s", cmd, code, out);
        struct stat st;
        for (int it = 2; it <= 10; it += 2) {
            snprintf(path, sizeof(path), "%s/iter_%07d", dir, it);
            const int kept = it % 4 == 0 || it == 10;
            EXPECT((stat(path, &st) == 0) == kept, "%s: iteration %d %s\n%s", async ? "async" : "sync", it,
                   kept ? "deleted" : "kept", out);
        }
        int64_t tracked = -1;
        mt_error err;
        EXPECT(mt_checkpoint_read_tracker(dir, &tracked, &err) == MT_OK && tracked == 10, "tracker %lld", (long long)tracked);
        EXPECT(strstr(out, "deleted the checkpoint of iteration 6"), "no line for the deletion of 6:\n%s", out);
        mt_remove_tree(dir);
    }
    return TEST_PASS;
}

static const test_case checkpoint_tool_gpu_tests[] = {
    {"async_save", test_async_save},
    {"save_retain_interval_train_gpt", test_retain_train_gpt},
    {"load_other_layout_gpt2", test_load_other_layout_gpt2},
    {"load_other_layout_llama", test_load_other_layout_llama},
    {"trainer_checkpoints_gpt2", test_trainer_checkpoints_gpt2},
    {"trainer_checkpoints_llama", test_trainer_checkpoints_llama},
};

static const test_case checkpoint_tool_tests[] = {
    {"crc32c_streams", test_crc32c_streams},
    {"manifest_write_verify", test_manifest_write_verify},
    {"manifest_write_known", test_manifest_write_known},
    {"select_falls_back", test_select_falls_back},
    {"integrity_rule", test_integrity_rule},
    {"tools_refuse_damage", test_tools_refuse_damage},
    {"no_verify_checkpoint_flag", test_no_verify_checkpoint_flag},
    {"mcore_integrity", test_mcore_integrity},
    {"verify_catches_damage", test_verify_catches_damage},
    {"reshard_gpt2_tied", test_reshard_gpt2_tied},
    {"reshard_gpt2_untied", test_reshard_gpt2_untied},
    {"reshard_llama_untied", test_reshard_llama_untied},
    {"reshard_llama_tied", test_reshard_llama_tied},
    {"reshard_gpt2_qk_layernorm_squared_relu", test_reshard_gpt2_qk_layernorm},
    {"reshard_llama_qk_layernorm", test_reshard_llama_qk_layernorm},
    {"reshard_distributed_optimizer", test_reshard_distributed_optimizer},
    {"read_part_any_layout", test_read_part_any_layout},
    {"moe_expert_bias_checkpoint", test_moe_expert_bias_checkpoint},
    {"save_retain_interval_rule", test_retain_victim_rule},
    {"save_retain_interval_on_disk", test_retain_on_disk},
    {"rank_files_and_checks", test_rank_files_and_checks},
    {"save_dirs_tidy_commit", test_save_dirs_tidy_commit},
    {"ep_rank_files_and_checks", test_ep_rank_files_and_checks},
    {"read_part_expert_parallel", test_read_part_expert_parallel},
    {"reshard_expert_parallel", test_reshard_expert_parallel},
};

#endif
