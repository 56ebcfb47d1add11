/*
 * prepro/checkpoint_tool.h — one checkpoint of this project, whole, on the host: its layout read
 * from the files' headers (megatron.h section 7), every file's header and exact size checked, the
 * full canonical fp32 master weights and Adam moments assembled from all ranks' files (tensor-parallel
 * shards, pipeline stages with their virtual stages, distributed-optimizer shards), and written back
 * in another layout. prepro/checkpoint_tool.c (info, verify, reshard) and
 * tests/test_checkpoint_tool.h use it; include megatron.h with its implementation first.
 *
 * The files, as megatron.cu section 19 writes them: <iter dir>/mp_rank_<tp, 2 digits>/ (with
 * pipeline parallelism mp_rank_<tp>_<pp, 3 digits>/) holds model_optim_rng.bin: the header, then
 * that rank's tensors (its TP shard, mt_param_layout_shard's order, restricted to its pipeline
 * stage's tensors as mt_pp_stage_copy lays them out) as fp32 master, m, v; with the distributed
 * optimizer (MT_CK_SHARDED_DP = D > 0) the master only, and distrib_optim_dp<r, 3 digits>.bin for
 * r < D beside it: the header, then master, m, v of DP rank r's shard: for each bucket of the DDP
 * buffer (mt_buffer_layout_build) in order, r's part of it (mt_bucket_shard). The buckets depend on
 * --overlap-grad-reduce and --ddp-bucket-size, which the header does not record: the caller passes
 * them (mt_ckpt_ddp; one bucket by default) and a shard size other than the header's is refused.
 * The model files end with the FP8 delayed-scaling state when the run had one; it is per-layer state
 * of one layout and is not carried over (the trainer starts the scales afresh without it).
 *
 * Everything is held in host memory: 3 full fp32 arrays (12 bytes per parameter) plus one rank's.
 */
#ifndef MT_PREPRO_CHECKPOINT_TOOL_H
#define MT_PREPRO_CHECKPOINT_TOOL_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    char iter_dir[4200];
    int64_t iteration;
    int64_t header[MT_CK_HEADER_WORDS]; /* the first model file's (mp_rank_00[_000]) */
    mt_config cfg;                      /* the model, at the files' TP, PP and VP */
    int tp, pp, vp, sharded_dp;         /* sharded_dp: 0, or the distributed optimizer's DP size */
} mt_ckpt;

/* The distributed optimizer's buckets (the run's --overlap-grad-reduce and --ddp-bucket-size). */
typedef struct {
    int overlap_grad_reduce;
    int64_t ddp_bucket_size; /* 0: Megatron's default */
} mt_ckpt_ddp;

enum { MT_CKPT_MASTER = 0, MT_CKPT_M, MT_CKPT_V, MT_CKPT_ARRAYS };

/* <iter_dir>/mp_rank_<tp>[_<pp>] (the _<pp> part when the layout has pp > 1 stages) */
static void mt_ckpt_rank_dir(char* buf, size_t cap, const char* iter_dir, int pp, int tp_rank, int pp_rank) {
    if (pp > 1) snprintf(buf, cap, "%s/mp_rank_%02d_%03d", iter_dir, tp_rank, pp_rank);
    else snprintf(buf, cap, "%s/mp_rank_%02d", iter_dir, tp_rank);
}

/* The model of header h at a layout, as rank (tp_rank, DP 0, pp_rank) of it sees it: dp > 0 with the
 * distributed optimizer's buckets (ddp). The layer split is checked (an even one: the header does not
 * record --decoder-first/last-pipeline-num-layers). */
static mt_status mt_ckpt_config(mt_config* c, const int64_t* h, int tp, int pp, int vp, int dp, const mt_ckpt_ddp* ddp,
                                int tp_rank, int pp_rank, mt_error* err) {
    mt_config_defaults(c);
    mt_config_from_checkpoint_header(c, h);
    c->tensor_model_parallel_size = tp;
    c->pipeline_model_parallel_size = pp;
    c->virtual_pipeline_size = vp > 0 ? vp : 1;
    c->data_parallel_size = dp > 0 ? dp : 1;
    c->world_size = tp * pp * c->data_parallel_size;
    c->use_distributed_optimizer = dp > 0;
    if (ddp) {
        c->overlap_grad_reduce = ddp->overlap_grad_reduce;
        c->ddp_bucket_size = ddp->ddp_bucket_size;
    }
    mt_rank_coords coords = {tp_rank, 0, pp_rank};
    c->rank = mt_rank_of(c, coords);
    return mt_pp_stage_of(c, pp_rank, NULL, err);
}

/* Elements of one array of a model file of (tp_rank, pp_rank): its stage's tensors of its TP shard. */
static mt_status mt_ckpt_rank_numel(const mt_config* c, int64_t* numel, mt_error* err) {
    mt_buffer_layout B;
    mt_status st = mt_buffer_layout_build(&B, c, err);
    if (st != MT_OK) return st;
    *numel = B.canonical_size;
    mt_buffer_layout_free(&B);
    return MT_OK;
}

/* Reads and checks a header of `path` (shard_file: a distrib_optim file): its words in range, the
 * file's exact size, and every model and layout word as the first model file's (ref) but for the
 * rank words, which must be (tp_rank, pp_rank, dp_rank). Leaves f (if not NULL) open after the header. */
static mt_status mt_ckpt_read_header(const char* path, const int64_t* ref, int shard_file, int tp_rank, int pp_rank,
                                     int dp_rank, int64_t* h, FILE** f_out, mt_error* err) {
    if (f_out) *f_out = NULL;
    int fd = mt_open_regular_file(path, err);
    if (fd < 0) return MT_ERR_IO;
    FILE* f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    }
    mt_status st = fread(h, sizeof(int64_t), MT_CK_HEADER_WORDS, f) == MT_CK_HEADER_WORDS
                       ? mt_checkpoint_header_check(h, path, NULL, err)
                       : mt_fail(err, MT_ERR_FORMAT, "%s is truncated (no header)", path);
    struct stat sb;
    if (st == MT_OK) {
        const int64_t want = mt_checkpoint_file_bytes(h, shard_file);
        if (fstat(fileno(f), &sb) != 0 || (int64_t)sb.st_size != want)
            st = mt_fail(err, MT_ERR_FORMAT, "%s has %lld bytes, but its header describes %lld (%s)", path,
                         (long long)sb.st_size, (long long)want, (int64_t)sb.st_size < want ? "truncated" : "too long");
    }
    if (st == MT_OK && ref) {
        /* every word but the rank's own and the stage's size: as the first file's */
        for (int w = 0; w < MT_CK_HEADER_WORDS && st == MT_OK; w++) {
            if (w == MT_CK_TP_RANK || w == MT_CK_PP_RANK || w == MT_CK_DP_RANK || w == MT_CK_STAGE_NUMEL ||
                w == MT_CK_SHARD_NUMEL || w == MT_CK_FP8_TENSORS || w == MT_CK_FP8_HISTORY_POS)
                continue;
            if (h[w] != ref[w])
                st = mt_fail(err, MT_ERR_FORMAT, "%s: header word %d is %lld, but %lld in the first model file", path, w,
                             (long long)h[w], (long long)ref[w]);
        }
        if (st == MT_OK && (h[MT_CK_TP_RANK] != tp_rank || h[MT_CK_PP_RANK] != pp_rank || h[MT_CK_DP_RANK] != dp_rank))
            st = mt_fail(err, MT_ERR_FORMAT, "%s holds the part of (TP, PP, DP) rank (%lld, %lld, %lld), not (%d, %d, %d)",
                         path, (long long)h[MT_CK_TP_RANK], (long long)h[MT_CK_PP_RANK], (long long)h[MT_CK_DP_RANK],
                         tp_rank, pp_rank, dp_rank);
    }
    if (st == MT_OK && f_out) *f_out = f;
    else fclose(f);
    return st;
}

/* Finds the iteration (< 0: the tracker's) and reads its first model file's header. */
static mt_status mt_ckpt_open(mt_ckpt* ck, const char* dir, int64_t iteration, mt_error* err) {
    memset(ck, 0, sizeof(*ck));
    mt_status st = iteration < 0 ? mt_checkpoint_read_tracker(dir, &iteration, err) : MT_OK;
    if (st != MT_OK) return st;
    ck->iteration = iteration;
    mt_checkpoint_iteration_dir(ck->iter_dir, sizeof(ck->iter_dir), dir, iteration);
    char path[4400], rank_dir[4300];
    struct stat sb;
    /* mp_rank_00 (one stage) or mp_rank_00_000 (a pipeline) */
    mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), ck->iter_dir, 1, 0, 0);
    if (stat(rank_dir, &sb) != 0) mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), ck->iter_dir, 2, 0, 0);
    snprintf(path, sizeof(path), "%s/model_optim_rng.bin", rank_dir);
    int64_t* h = ck->header;
    st = mt_ckpt_read_header(path, NULL, 0, 0, 0, 0, h, NULL, err);
    if (st == MT_OK && h[MT_CK_ITERATION] != iteration)
        st = mt_fail(err, MT_ERR_FORMAT, "%s holds iteration %lld, not %lld", path, (long long)h[MT_CK_ITERATION],
                     (long long)iteration);
    if (st == MT_OK && (h[MT_CK_TP_RANK] != 0 || h[MT_CK_PP_RANK] != 0 || h[MT_CK_DP_RANK] != 0))
        st = mt_fail(err, MT_ERR_FORMAT, "%s is not the file of rank 0", path);
    if (st == MT_OK && (h[MT_CK_TP] > 4096 || h[MT_CK_PP] > 4096 || h[MT_CK_SHARDED_DP] > 65536))
        st = mt_fail(err, MT_ERR_FORMAT, "%s: a layout of %lld x %lld x %lld ranks is beyond this tool", path,
                     (long long)h[MT_CK_TP], (long long)h[MT_CK_PP], (long long)h[MT_CK_SHARDED_DP]);
    if (st != MT_OK) return st;
    ck->tp = (int)h[MT_CK_TP];
    ck->pp = (int)h[MT_CK_PP];
    ck->vp = h[MT_CK_PP] > 1 ? (int)h[MT_CK_VP] : 1;
    ck->sharded_dp = (int)h[MT_CK_SHARDED_DP];
    return mt_ckpt_config(&ck->cfg, h, ck->tp, ck->pp, ck->vp, 0, NULL, 0, 0, err);
}

/* Reads n floats at element offset `at` of the arrays after the header. */
static mt_status mt_ckpt_read_floats(FILE* f, const char* path, int64_t at, float* out, int64_t n, mt_error* err) {
    if (fseeko(f, (off_t)(sizeof(int64_t) * MT_CK_HEADER_WORDS + (size_t)at * sizeof(float)), SEEK_SET) != 0 ||
        fread(out, sizeof(float), (size_t)n, f) != (size_t)n)
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    return MT_OK;
}

/* One rank's distributed-optimizer shards (DP ranks 0..D-1) back into its stage's canonical m and v. */
static mt_status mt_ckpt_read_dp_shards(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const char* rank_dir, int tp_rank,
                                        int pp_rank, float* part_m, float* part_v, mt_error* err) {
    const int D = ck->sharded_dp;
    mt_config c;
    mt_status st = mt_ckpt_config(&c, ck->header, ck->tp, ck->pp, ck->vp, D, ddp, tp_rank, pp_rank, err);
    mt_buffer_layout B;
    if (st == MT_OK) st = mt_buffer_layout_build(&B, &c, err);
    if (st != MT_OK) return st;
    int64_t shard = 0;
    for (int b = 0; b < B.num_buckets; b++) {
        int64_t begin, end;
        mt_bucket_shard(&B.buckets[b], D, 0, &begin, &end);
        shard += end - begin;
    }
    float* buffer = (float*)calloc((size_t)B.size * 2, sizeof(float));
    float* piece = (float*)malloc(sizeof(float) * (size_t)(shard > 0 ? shard : 1));
    if (!buffer || !piece) st = mt_fail(err, MT_ERR_OOM, "out of memory reading the optimizer shards of %s", rank_dir);
    for (int r = 0; r < D && st == MT_OK; r++) {
        char path[4400];
        snprintf(path, sizeof(path), "%s/distrib_optim_dp%03d.bin", rank_dir, r);
        int64_t h[MT_CK_HEADER_WORDS];
        FILE* f = NULL;
        st = mt_ckpt_read_header(path, ck->header, 1, tp_rank, pp_rank, r, h, &f, err);
        if (st == MT_OK && h[MT_CK_SHARD_NUMEL] != shard)
            st = mt_fail(err, MT_ERR_CONFIG, "%s holds shards of %lld elements, but the DDP buckets give %lld: pass the "
                         "--overlap-grad-reduce and --ddp-bucket-size of the run that saved it", path,
                         (long long)h[MT_CK_SHARD_NUMEL], (long long)shard);
        for (int a = 1; a <= 2 && st == MT_OK; a++) { /* m, v (the master comes from the model file) */
            st = mt_ckpt_read_floats(f, path, a * shard, piece, shard, err);
            int64_t k = 0;
            for (int b = 0; b < B.num_buckets && st == MT_OK; b++) {
                int64_t begin, end;
                mt_bucket_shard(&B.buckets[b], D, r, &begin, &end);
                memcpy(buffer + (a - 1) * B.size + begin, piece + k, sizeof(float) * (size_t)(end - begin));
                k += end - begin;
            }
        }
        if (f) fclose(f);
    }
    for (int i = 0; i < B.num_params && st == MT_OK; i++) {
        const mt_buffer_param* p = &B.params[i];
        memcpy(part_m + p->canonical, buffer + p->offset, sizeof(float) * (size_t)p->numel);
        memcpy(part_v + p->canonical, buffer + B.size + p->offset, sizeof(float) * (size_t)p->numel);
    }
    free(buffer);
    free(piece);
    mt_buffer_layout_free(&B);
    return st;
}

/* Checks every file of the checkpoint (header words, exact size, the layout's ranks) and, with
 * arrays (each mt_param_layout(&ck->cfg) floats) not NULL, assembles the full canonical master, m
 * and v. Pipeline stages are read last to first, so the word embeddings of a tied model come from
 * the first stage (the last stage holds a copy). */
static mt_status mt_ckpt_read(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, float* const* arrays, mt_error* err) {
    mt_config c = ck->cfg;
    const int64_t shard_numel = mt_param_layout_shard(&c, NULL);
    float* shard = arrays ? (float*)malloc(sizeof(float) * (size_t)shard_numel * MT_CKPT_ARRAYS) : NULL;
    float* part = arrays ? (float*)malloc(sizeof(float) * (size_t)shard_numel * MT_CKPT_ARRAYS) : NULL;
    mt_status st = arrays && (!shard || !part) ? mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir) : MT_OK;
    for (int t = 0; t < ck->tp && st == MT_OK; t++) {
        for (int s = ck->pp - 1; s >= 0 && st == MT_OK; s--) {
            char rank_dir[4300], path[4400];
            mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, t, s);
            snprintf(path, sizeof(path), "%s/model_optim_rng.bin", rank_dir);
            int64_t h[MT_CK_HEADER_WORDS], numel = 0;
            FILE* f = NULL;
            mt_config rc;
            mt_pp_stage stage;
            st = mt_ckpt_config(&rc, ck->header, ck->tp, ck->pp, ck->vp, 0, NULL, t, s, err);
            if (st == MT_OK) st = mt_pp_stage_of(&rc, s, &stage, err);
            if (st == MT_OK) st = mt_ckpt_rank_numel(&rc, &numel, err);
            if (st == MT_OK) st = mt_ckpt_read_header(path, ck->header, 0, t, s, 0, h, &f, err);
            if (st == MT_OK && ck->pp > 1 && h[MT_CK_STAGE_NUMEL] != numel)
                st = mt_fail(err, MT_ERR_FORMAT, "%s holds %lld parameters, but an even split gives pipeline rank %d "
                             "%lld (uneven splits, --decoder-first/last-pipeline-num-layers, are not supported here)",
                             path, (long long)h[MT_CK_STAGE_NUMEL], s, (long long)numel);
            const int in_file = ck->sharded_dp > 0 ? 1 : MT_CKPT_ARRAYS;
            for (int a = 0; a < in_file && st == MT_OK && arrays; a++)
                st = mt_ckpt_read_floats(f, path, a * numel, part + a * numel, numel, err);
            if (f) fclose(f);
            if (st == MT_OK && ck->sharded_dp > 0) {
                if (arrays) st = mt_ckpt_read_dp_shards(ck, ddp, rank_dir, t, s, part + numel, part + 2 * numel, err);
                for (int r = 0; r < ck->sharded_dp && st == MT_OK && !arrays; r++) {
                    snprintf(path, sizeof(path), "%s/distrib_optim_dp%03d.bin", rank_dir, r);
                    st = mt_ckpt_read_header(path, ck->header, 1, t, s, r, h, NULL, err);
                }
            }
            for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK && arrays; a++)
                mt_pp_stage_copy(&rc, &stage, shard + a * shard_numel, part + a * numel, 0);
        }
        for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK && arrays; a++)
            mt_tp_shard_copy(&c, t, arrays[a], shard + a * shard_numel, 0);
    }
    free(shard);
    free(part);
    return st;
}

/* verify: every file's header and exact size (mt_ckpt_read without arrays), then the manifest's
 * sizes and checksums; a checkpoint without a manifest fails (it cannot be verified). */
static mt_status mt_ckpt_verify(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, mt_error* err) {
    char manifest[4400];
    struct stat sb;
    snprintf(manifest, sizeof(manifest), "%s/%s", ck->iter_dir, MT_CKPT_MANIFEST);
    mt_status st = mt_ckpt_read(ck, ddp, NULL, err);
    if (st == MT_OK && stat(manifest, &sb) != 0)
        st = mt_fail(err, MT_ERR_FORMAT, "%s has no %s: it cannot be verified (incomplete, or saved before manifests)",
                     ck->iter_dir, MT_CKPT_MANIFEST);
    return st == MT_OK ? mt_checkpoint_manifest_verify(ck->iter_dir, err) : st;
}

/* The full canonical arrays of model `from` in the padded vocabulary of model `to` (the same model
 * but for the padding): the word embeddings' and output layer's rows [0, min) copied, new rows 0. */
static void mt_ckpt_repad(const mt_config* from, const float* in, const mt_config* to, float* out) {
    mt_param_info a[MT_NUM_PARAM_TENSORS], b[MT_NUM_PARAM_TENSORS];
    mt_param_layout(from, a);
    mt_param_layout(to, b);
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        const int64_t n = a[i].numel < b[i].numel ? a[i].numel : b[i].numel;
        memcpy(out + b[i].offset, in + a[i].offset, sizeof(float) * (size_t)n);
        memset(out + b[i].offset + n, 0, sizeof(float) * (size_t)(b[i].numel - n));
    }
}

/* The target layout's model: header src's model with the padded vocabulary Megatron gives it at
 * tp (--make-vocab-size-divisible-by x TP, from the true vocabulary when the header knows it; else
 * the padded one, which must divide by tp), and its header words (rank words 0). */
static mt_status mt_ckpt_target(const int64_t* src, int tp, int pp, int vp, int divisible_by, int64_t* h, mt_config* c,
                                mt_error* err) {
    if (tp < 1 || tp > 4096 || pp < 1 || pp > 4096 || vp < 1 || vp > MT_PP_MAX_CHUNKS || (vp > 1 && pp == 1) ||
        divisible_by < 1)
        return mt_fail(err, MT_ERR_ARG, "target layout TP %d, PP %d, VP %d (divisible by %d): TP and PP in [1, 4096], "
                       "VP in [1, %d] and > 1 only with PP > 1", tp, pp, vp, divisible_by, MT_PP_MAX_CHUNKS);
    memcpy(h, src, sizeof(int64_t) * MT_CK_HEADER_WORDS);
    if (h[MT_CK_TRUE_VOCAB] > 0) h[MT_CK_VOCAB] = mt_padded_vocab_size(h[MT_CK_TRUE_VOCAB], divisible_by, tp);
    h[MT_CK_TP] = tp;
    h[MT_CK_PP] = pp;
    h[MT_CK_VP] = pp > 1 ? vp : 0;
    h[MT_CK_TP_RANK] = h[MT_CK_PP_RANK] = h[MT_CK_DP_RANK] = 0;
    h[MT_CK_SHARDED_DP] = h[MT_CK_SHARD_NUMEL] = 0;
    h[MT_CK_FP8_TENSORS] = h[MT_CK_FP8_HISTORY_LEN] = h[MT_CK_FP8_HISTORY_POS] = 0;
    mt_status st = mt_ckpt_config(c, h, tp, pp, vp, 0, NULL, 0, 0, err);
    if (st != MT_OK) return st;
    h[MT_CK_NUM_PARAMS] = mt_param_layout(c, NULL);
    int64_t numel = 0;
    st = mt_ckpt_rank_numel(c, &numel, err);
    h[MT_CK_STAGE_NUMEL] = pp > 1 ? numel : 0;
    return st == MT_OK ? mt_checkpoint_header_check(h, "the target layout", NULL, err) : st;
}

static mt_status mt_ckpt_write_floats(FILE* f, const char* path, const void* data, size_t bytes, mt_error* err) {
    if (fwrite(data, 1, bytes, f) != bytes) return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return MT_OK;
}

/* Writes full canonical arrays (of model th/tc: mt_ckpt_target's) as checkpoint `out` at th's
 * iteration and layout, with a non-sharded optimizer: every rank's file into a temporary directory,
 * the manifest, the rename into place, then the tracker. Refuses an out that already holds the
 * iteration. */
static mt_status mt_ckpt_write(const char* out, const int64_t* th, const mt_config* tc, float* const* arrays,
                               mt_error* err) {
    char final_dir[4200], rank_dir[4400], path[4500];
    const int64_t iteration = th[MT_CK_ITERATION];
    const int tp = (int)th[MT_CK_TP], pp = (int)th[MT_CK_PP], vp = th[MT_CK_VP] > 0 ? (int)th[MT_CK_VP] : 1;
    if (mt_make_directories(out) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", out, strerror(errno));
    snprintf(final_dir, sizeof(final_dir), "%s/iter_%07lld", out, (long long)iteration);
    struct stat sb;
    if (stat(final_dir, &sb) == 0) return mt_fail(err, MT_ERR_IO, "%s already exists: choose another output", final_dir);
    mt_remove_stale_temporaries(final_dir);
    char* tmp = mt_temporary_path(final_dir);
    if (!tmp) return mt_fail(err, MT_ERR_OOM, "out of memory");
    mt_status st = mkdir(tmp, 0755) == 0 ? MT_OK : mt_fail(err, MT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    const int64_t shard_numel = mt_param_layout_shard(tc, NULL);
    float* shard = (float*)malloc(sizeof(float) * (size_t)shard_numel);
    float* part = (float*)malloc(sizeof(float) * (size_t)shard_numel);
    if (st == MT_OK && (!shard || !part)) st = mt_fail(err, MT_ERR_OOM, "out of memory writing %s", out);
    for (int t = 0; t < tp && st == MT_OK; t++) {
        for (int s = 0; s < pp && st == MT_OK; s++) {
            mt_config rc;
            mt_pp_stage stage;
            int64_t numel = 0, h[MT_CK_HEADER_WORDS];
            st = mt_ckpt_config(&rc, th, tp, pp, vp, 0, NULL, t, s, err);
            if (st == MT_OK) st = mt_pp_stage_of(&rc, s, &stage, err);
            if (st == MT_OK) st = mt_ckpt_rank_numel(&rc, &numel, err);
            mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), tmp, pp, t, s);
            if (st == MT_OK && mkdir(rank_dir, 0755) != 0)
                st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", rank_dir, strerror(errno));
            if (st != MT_OK) break;
            memcpy(h, th, sizeof(h));
            h[MT_CK_TP_RANK] = t;
            h[MT_CK_PP_RANK] = s;
            h[MT_CK_STAGE_NUMEL] = pp > 1 ? numel : 0;
            snprintf(path, sizeof(path), "%s/model_optim_rng.bin", rank_dir);
            FILE* f = fopen(path, "wb");
            if (!f) st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
            if (st == MT_OK) st = mt_ckpt_write_floats(f, path, h, sizeof(h), err);
            for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK; a++) {
                mt_tp_shard_copy(tc, t, arrays[a], shard, 1);
                mt_pp_stage_copy(&rc, &stage, shard, part, 1);
                st = mt_ckpt_write_floats(f, path, part, sizeof(float) * (size_t)numel, err);
            }
            if (f && st == MT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
                st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
            if (f && fclose(f) != 0 && st == MT_OK) st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
            if (st == MT_OK && mt_sync_directory_of(path) != 0)
                st = mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", path, strerror(errno));
        }
    }
    free(shard);
    free(part);
    if (st == MT_OK) st = mt_checkpoint_manifest_write(tmp, err);
    if (st == MT_OK && rename(tmp, final_dir) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", tmp, final_dir, strerror(errno));
    if (st == MT_OK && mt_sync_directory_of(final_dir) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot sync %s: %s", out, strerror(errno));
    if (st != MT_OK) mt_remove_tree(tmp);
    free(tmp);
    if (st == MT_OK) st = mt_checkpoint_write_tracker(out, iteration, err);
    return st;
}

/* Reshards checkpoint ck into `out` at (tp, pp, vp): reads it whole, re-pads the vocabulary when
 * the target's TP asks for another padding, writes. *dropped_fp8 (if not NULL): 1 when the source's
 * FP8 scaling state was left behind. */
static mt_status mt_ckpt_reshard(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const char* out, int tp, int pp, int vp,
                                 int divisible_by, int* dropped_fp8, mt_error* err) {
    int64_t th[MT_CK_HEADER_WORDS];
    mt_config tc;
    mt_status st = mt_ckpt_target(ck->header, tp, pp, vp, divisible_by, th, &tc, err);
    if (st != MT_OK) return st;
    if (dropped_fp8) *dropped_fp8 = ck->header[MT_CK_FP8_TENSORS] > 0;
    const int64_t n_src = mt_param_layout(&ck->cfg, NULL), n_dst = mt_param_layout(&tc, NULL);
    float* src[MT_CKPT_ARRAYS] = {0};
    float* dst[MT_CKPT_ARRAYS] = {0};
    for (int a = 0; a < MT_CKPT_ARRAYS; a++) {
        src[a] = (float*)malloc(sizeof(float) * (size_t)n_src);
        dst[a] = th[MT_CK_VOCAB] != ck->header[MT_CK_VOCAB] ? (float*)malloc(sizeof(float) * (size_t)n_dst) : src[a];
        if (!src[a] || !dst[a]) st = mt_fail(err, MT_ERR_OOM, "out of memory holding the checkpoint (%lld parameters)",
                                             (long long)n_src);
    }
    if (st == MT_OK) st = mt_ckpt_read(ck, ddp, src, err);
    for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK; a++)
        if (dst[a] != src[a]) mt_ckpt_repad(&ck->cfg, src[a], &tc, dst[a]);
    if (st == MT_OK) st = mt_ckpt_write(out, th, &tc, dst, err);
    for (int a = 0; a < MT_CKPT_ARRAYS; a++) {
        if (dst[a] != src[a]) free(dst[a]);
        free(src[a]);
    }
    return st;
}

#endif
