/*
 * prepro/checkpoint_tool.h — one checkpoint of this project on the host, for prepro/checkpoint_tool.c
 * (info, verify, reshard) and tests/test_checkpoint_tool.h; include megatron.h with its
 * implementation first. The reader of any layout (mt_ckpt_open, mt_ckpt_read_part: the layout from
 * the files' headers, any rank's part of another layout cut from the saved files slice by slice) is
 * megatron.h's, shared with the trainer's --load at another layout; this file adds the whole-model
 * assembly (mt_ckpt_read: every file's header and exact size checked, and with arrays the full
 * canonical fp32 master weights and Adam moments put together through mt_tp_shard_copy and
 * mt_pp_stage_copy: verify's header pass and the tests' independent reference) and the writer of
 * another layout (reshard: each target rank's part through mt_ckpt_read_part, one rank in memory
 * at a time). Its callers apply megatron.h's integrity rule (mt_checkpoint_select /
 * mt_checkpoint_check_integrity) before they read a checkpoint with it.
 *
 * The files, their names and headers, and the rules a reader applies to them: megatron.h section 13
 * (its format paragraph and the functions after it; section 14 for the reader of any layout). This
 * file names its files and fills their rank words through those functions (mt_ckpt_rank_dir,
 * mt_ckpt_file_path, mt_checkpoint_header_set_rank).
 */
#ifndef MT_PREPRO_CHECKPOINT_TOOL_H
#define MT_PREPRO_CHECKPOINT_TOOL_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* One rank's distributed-optimizer shards (DP ranks 0..D-1) back into its stage's canonical m and v: EP rank
 * ep_rank's (its experts' buckets from the DP ranks d with d % EP = ep_rank, the dense buckets from every DP
 * rank's file, in EP rank d % EP's directory). */
static mt_status mt_ckpt_read_dp_shards(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, int tp_rank, int pp_rank, int ep_rank,
                                        float* part_m, float* part_v, mt_error* err) {
    const int D = ck->sharded_dp;
    const mt_ckpt_ddp saved = mt_ckpt_saved_ddp(ck, ddp);
    mt_config c;
    mt_status st = mt_ckpt_config(&c, ck->header, ck->tp, ck->pp, ck->vp, D, &saved, tp_rank, pp_rank, err);
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
    if (!buffer || !piece) st = mt_fail(err, MT_ERR_OOM, "out of memory reading the optimizer shards of %s", ck->iter_dir);
    for (int r = 0; r < D && st == MT_OK; r++) {
        char rank_dir[4300], path[4400];
        mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, ck->ep, tp_rank, pp_rank, r % ck->ep);
        mt_ckpt_file_path(path, sizeof(path), rank_dir, r);
        int64_t h[MT_CK_HEADER_WORDS];
        int fd = -1;
        st = mt_ckpt_read_header(path, ck->header, 1, tp_rank, pp_rank, r, h, &fd, err);
        if (st == MT_OK && h[MT_CK_SHARD_NUMEL] != shard)
            st = mt_fail(err, MT_ERR_CONFIG, "%s holds shards of %lld elements, but the DDP buckets give %lld: pass the "
                         "--overlap-grad-reduce and --ddp-bucket-size of the run that saved it", path,
                         (long long)h[MT_CK_SHARD_NUMEL], (long long)shard);
        for (int a = 1; a <= 2 && st == MT_OK; a++) { /* m, v (the master comes from the model file) */
            st = mt_ckpt_read_floats(fd, path, a * shard, piece, shard, err);
            int64_t k = 0;
            for (int b = 0; b < B.num_buckets && st == MT_OK; b++) {
                int64_t begin, end;
                mt_bucket_shard(&B.buckets[b], D, r, &begin, &end);
                if (B.buckets[b].ep <= 1 || r % ck->ep == ep_rank) /* another EP rank's experts: not this rank's */
                    memcpy(buffer + (a - 1) * B.size + begin, piece + k, sizeof(float) * (size_t)(end - begin));
                k += end - begin;
            }
        }
        if (fd >= 0) close(fd);
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
    /* model-parallel shard m = t + TP x e (mt_tp_shard_copy's shard_rank): TP rank t of EP rank e */
    for (int m = 0; m < ck->tp * ck->ep && st == MT_OK; m++) {
        const int t = m % ck->tp, e = m / ck->tp;
        for (int s = ck->pp - 1; s >= 0 && st == MT_OK; s--) {
            char rank_dir[4300], path[4400];
            mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, ck->ep, t, s, e);
            mt_ckpt_file_path(path, sizeof(path), rank_dir, -1);
            int64_t h[MT_CK_HEADER_WORDS], numel = 0;
            int fd = -1;
            mt_config rc;
            mt_pp_stage stage;
            st = mt_ckpt_config(&rc, ck->header, ck->tp, ck->pp, ck->vp, 0, NULL, t, s, err);
            if (st == MT_OK) st = mt_pp_stage_of(&rc, s, &stage, err);
            if (st == MT_OK) st = mt_ckpt_rank_numel(&rc, &numel, err);
            if (st == MT_OK) st = mt_ckpt_read_header(path, ck->header, 0, t, s, e, h, &fd, err); /* DP rank e wrote it */
            if (st == MT_OK && ck->pp > 1 && h[MT_CK_STAGE_NUMEL] != numel)
                st = mt_fail(err, MT_ERR_FORMAT, "%s holds %lld parameters, but an even split gives pipeline rank %d "
                             "%lld (uneven splits, --decoder-first/last-pipeline-num-layers, are not supported here)",
                             path, (long long)h[MT_CK_STAGE_NUMEL], s, (long long)numel);
            const int in_file = ck->sharded_dp > 0 ? 1 : MT_CKPT_ARRAYS;
            for (int a = 0; a < in_file && st == MT_OK && arrays; a++)
                st = mt_ckpt_read_floats(fd, path, a * numel, part + a * numel, numel, err);
            if (fd >= 0) close(fd);
            if (st == MT_OK && ck->sharded_dp > 0) {
                if (arrays) st = mt_ckpt_read_dp_shards(ck, ddp, t, s, e, part + numel, part + 2 * numel, err);
                for (int r = e; r < ck->sharded_dp && st == MT_OK && !arrays; r += ck->ep) { /* EP rank e's files */
                    mt_ckpt_file_path(path, sizeof(path), rank_dir, r);
                    st = mt_ckpt_read_header(path, ck->header, 1, t, s, r, h, NULL, err);
                }
            }
            for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK && arrays; a++)
                mt_pp_stage_copy(&rc, &stage, shard + a * shard_numel, part + a * numel, 0);
        }
        for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK && arrays; a++)
            mt_tp_shard_copy(&c, m, arrays[a], shard + a * shard_numel, 0);
    }
    free(shard);
    free(part);
    return st;
}

/* verify: the integrity rule without its leniency (mt_checkpoint_check_integrity: the manifest's
 * sizes and checksums; a checkpoint without a manifest fails, also one from before manifests, which the
 * readers take with a warning but which cannot be verified), then every file's header and exact size
 * (mt_ckpt_read without arrays), and with an expert bias every model file's copy (finite, the same in
 * each: mt_ckpt_read_expert_bias). */
static mt_status mt_ckpt_verify(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, mt_error* err) {
    mt_error warning;
    mt_status st = mt_checkpoint_check_integrity(ck->iter_dir, 0, &warning, err);
    if (st == MT_OK && warning.message[0]) /* accepted unchecked: saved before manifests */
        st = mt_fail(err, MT_ERR_FORMAT, "%s has no %s: saved before manifests, it cannot be verified", ck->iter_dir,
                     MT_CKPT_MANIFEST);
    if (st == MT_OK) st = mt_ckpt_read(ck, ddp, NULL, err);
    /* the routers' expert bias: every model file's copy finite and the same */
    const int64_t bias = mt_checkpoint_expert_bias_numel(ck->header, NULL);
    if (st == MT_OK && bias > 0) {
        float* b = (float*)malloc(sizeof(float) * (size_t)bias);
        st = b ? mt_ckpt_read_expert_bias(ck, 1, b, err) : mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir);
        free(b);
    }
    return st;
}

/* The target layout's model: header src's model with its padded vocabulary kept when it divides by
 * tp, else the one Megatron gives it at tp (--make-vocab-size-divisible-by x TP, from the true
 * vocabulary when the header knows it; mt_padded_vocab_size_resumed, the trainer's --load rule), and
 * its header words (rank words 0). */
static mt_status mt_ckpt_target(const int64_t* src, int tp, int pp, int vp, int ep, int divisible_by, int64_t* h,
                                mt_config* c, mt_error* err) {
    if (tp < 1 || tp > 4096 || pp < 1 || pp > 4096 || vp < 1 || vp > MT_PP_MAX_CHUNKS || (vp > 1 && pp == 1) ||
        divisible_by < 1 || ep < 1 || ep > 4096)
        return mt_fail(err, MT_ERR_ARG, "target layout TP %d, PP %d, VP %d, EP %d (divisible by %d): TP, PP and EP in "
                       "[1, 4096], VP in [1, %d] and > 1 only with PP > 1", tp, pp, vp, ep, divisible_by, MT_PP_MAX_CHUNKS);
    if (ep > 1 && (src[MT_CK_NUM_EXPERTS] == 0 || src[MT_CK_NUM_EXPERTS] % ep))
        return mt_fail(err, MT_ERR_ARG, "target EP %d: the model's %lld experts do not divide over it", ep,
                       (long long)src[MT_CK_NUM_EXPERTS]);
    memcpy(h, src, sizeof(int64_t) * MT_CK_HEADER_WORDS);
    h[MT_CK_EP] = ep > 1 ? ep : 0;
    if (h[MT_CK_TRUE_VOCAB] > 0)
        h[MT_CK_VOCAB] = mt_padded_vocab_size_resumed(h[MT_CK_TRUE_VOCAB], divisible_by, tp, src[MT_CK_VOCAB]);
    h[MT_CK_TP] = tp;
    h[MT_CK_PP] = pp;
    h[MT_CK_FP8_TENSORS] = h[MT_CK_FP8_HISTORY_LEN] = h[MT_CK_FP8_HISTORY_POS] = 0;
    h[MT_CK_MANIFESTED] = 1; /* mt_ckpt_write commits it with a manifest */
    mt_status st = mt_ckpt_config(c, h, tp, pp, vp, 0, NULL, 0, 0, err);
    if (st != MT_OK) return st;
    h[MT_CK_NUM_PARAMS] = mt_param_layout(c, NULL);
    int64_t numel = 0;
    st = mt_ckpt_rank_numel(c, &numel, err);
    /* rank 0's words: TP, PP, DP ranks 0; PP stages of VP chunks of numel; one DP rank (EP with EP > 1), unsharded */
    const mt_ckpt_rank first = {0, 0, 0, pp, vp, numel, ep, 0, 0, {0, 0}, ep};
    mt_checkpoint_header_set_rank(h, &first);
    return st == MT_OK ? mt_checkpoint_header_check(h, "the target layout", NULL, err) : st;
}

static mt_status mt_ckpt_write_floats(FILE* f, const char* path, const void* data, size_t bytes, mt_error* err) {
    if (fwrite(data, 1, bytes, f) != bytes) return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return MT_OK;
}

/* Writes checkpoint ck at th's layout (mt_ckpt_target's header, a non-sharded optimizer) as `out`:
 * every target rank's part cut from ck's files by mt_ckpt_read_part (the loader's own slicing, one
 * rank's part in memory at a time), and the routers' expert bias when ck has one (whole in every
 * model file, as the trainer writes it), into a temporary directory, the manifest, the rename into
 * place, then the tracker. Refuses an out that already holds the iteration. */
static mt_status mt_ckpt_write(const char* out, const int64_t* th, const mt_ckpt* ck, const mt_ckpt_ddp* ddp,
                               mt_error* err) {
    char final_dir[4200], rank_dir[4400], path[4500];
    const int64_t iteration = th[MT_CK_ITERATION];
    const int tp = (int)th[MT_CK_TP], pp = (int)th[MT_CK_PP], vp = th[MT_CK_VP] > 0 ? (int)th[MT_CK_VP] : 1;
    const int ep = th[MT_CK_EP] > 1 ? (int)th[MT_CK_EP] : 1;
    if (mt_make_directories(out) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", out, strerror(errno));
    snprintf(final_dir, sizeof(final_dir), "%s/iter_%07lld", out, (long long)iteration);
    struct stat sb;
    if (stat(final_dir, &sb) == 0) return mt_fail(err, MT_ERR_IO, "%s already exists: choose another output", final_dir);
    mt_remove_stale_temporaries(final_dir);
    char* tmp = mt_temporary_path(final_dir);
    if (!tmp) return mt_fail(err, MT_ERR_OOM, "out of memory");
    mt_status st = mkdir(tmp, 0755) == 0 ? MT_OK : mt_fail(err, MT_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    float* part = NULL;
    /* the routers' expert bias (layout-free): read once, whole into every target model file after its arrays */
    const int64_t bias_numel = mt_checkpoint_expert_bias_numel(th, NULL);
    float* bias = bias_numel > 0 && st == MT_OK ? (float*)malloc(sizeof(float) * (size_t)bias_numel) : NULL;
    if (bias_numel > 0 && st == MT_OK && !bias) st = mt_fail(err, MT_ERR_OOM, "out of memory writing %s", out);
    if (bias) st = mt_ckpt_read_expert_bias(ck, 0, bias, err);
    for (int t = 0; t < tp && st == MT_OK; t++) {
        for (int k = 0; k < pp * ep && st == MT_OK; k++) {
            const int s = k / ep, e = k % ep; /* pipeline rank s, EP rank e (written as DP rank e) */
            mt_config rc;
            int64_t numel = 0, h[MT_CK_HEADER_WORDS];
            st = mt_ckpt_config(&rc, th, tp, pp, vp, 0, NULL, t, s, err);
            if (st == MT_OK && ep > 1) {
                const mt_rank_coords rk = {t, e, s, 0, 0, 0, 0}; /* the reader's target rank: EP rank e's experts */
                rc.rank = mt_rank_of(&rc, rk);
            }
            if (st == MT_OK) st = mt_ckpt_rank_numel(&rc, &numel, err);
            mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), tmp, pp, ep, t, s, e);
            if (st == MT_OK && mkdir(rank_dir, 0755) != 0)
                st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", rank_dir, strerror(errno));
            free(part);
            part = st == MT_OK ? (float*)malloc(sizeof(float) * (size_t)numel) : NULL;
            if (st == MT_OK && !part) st = mt_fail(err, MT_ERR_OOM, "out of memory writing %s", out);
            if (st != MT_OK) break;
            memcpy(h, th, sizeof(h));
            const mt_ckpt_rank rank = {t, s, e, pp, vp, numel, ep, 0, 0, {0, 0}, ep}; /* as `first` in mt_ckpt_target */
            mt_checkpoint_header_set_rank(h, &rank);
            mt_ckpt_file_path(path, sizeof(path), rank_dir, -1);
            FILE* f = fopen(path, "wb");
            if (!f) st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", path, strerror(errno));
            if (st == MT_OK) st = mt_ckpt_write_floats(f, path, h, sizeof(h), err);
            for (int a = 0; a < MT_CKPT_ARRAYS && st == MT_OK; a++) {
                st = mt_ckpt_read_part(ck, ddp, &rc, a, part, err);
                if (st == MT_OK) st = mt_ckpt_write_floats(f, path, part, sizeof(float) * (size_t)numel, err);
            }
            if (bias && st == MT_OK) st = mt_ckpt_write_floats(f, path, bias, sizeof(float) * (size_t)bias_numel, err);
            if (f && st == MT_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
                st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
            if (f && fclose(f) != 0 && st == MT_OK) st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", path, strerror(errno));
            if (st == MT_OK && mt_sync_directory_of(path) != 0)
                st = mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", path, strerror(errno));
        }
    }
    free(part);
    free(bias);
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

/* Reshards checkpoint ck into `out` at (tp, pp, vp) and expert-parallel size ep (mp_rank_<tp>[_<pp>]_<ep>/ files
 * each holding its EP rank's experts, as the trainer writes them without the distributed optimizer): every
 * target rank's part read slice by slice
 * (the vocabulary re-padded when the target's TP asks for another padding: new rows 0), written.
 * *dropped_fp8 (if not NULL): 1 when the source's FP8 scaling state was left behind. */
static mt_status mt_ckpt_reshard_ep(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const char* out, int tp, int pp, int vp,
                                    int ep, int divisible_by, int* dropped_fp8, mt_error* err) {
    int64_t th[MT_CK_HEADER_WORDS];
    mt_config tc;
    mt_status st = mt_ckpt_target(ck->header, tp, pp, vp, ep, divisible_by, th, &tc, err);
    if (st != MT_OK) return st;
    if (dropped_fp8) *dropped_fp8 = ck->header[MT_CK_FP8_TENSORS] > 0;
    return mt_ckpt_write(out, th, ck, ddp, err);
}

/* The same at EP = 1 (every expert in every model file). */
static inline mt_status mt_ckpt_reshard(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const char* out, int tp, int pp, int vp,
                                 int divisible_by, int* dropped_fp8, mt_error* err) {
    return mt_ckpt_reshard_ep(ck, ddp, out, tp, pp, vp, 1, divisible_by, dropped_fp8, err);
}

#endif
