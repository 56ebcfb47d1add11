/* prepro/checkpoint_tool.c — inspect, verify and reshard a checkpoint of this project
 * (megatron.h sections 13 and 14, megatron.cu section 19; the engine is prepro/checkpoint_tool.h).
 *
 * Every command first applies the integrity rule of megatron.h (mt_checkpoint_check_integrity): the
 * iteration's manifest.txt verified (sizes and CRC-32C of every file), or, without one, the header's
 * manifest mark: a checkpoint saved with a manifest that has lost it is refused, one from before
 * manifests is read with a warning. A refusal is one line naming the file and exit 1; info and reshard
 * take --no-verify to read such a checkpoint anyway, with a warning.
 *
 *   checkpoint_tool info DIR [--iteration N] [--no-verify]
 *       the iteration, the layout (TP, PP, VP, EP, the optimizer sharded over DP or not), the model's
 *       shape and flavour (its experts and expert bias too) and the training progress from the
 *       header, every file with its size, and
 *       every tensor with its full shape and the slice each file holds (rows of the TP split, layers
 *       of the pipeline stages).
 *   checkpoint_tool verify DIR [--iteration N]
 *       the manifest's sizes and CRC-32C checksums (a checkpoint without a manifest fails, also one
 *       from before manifests: it cannot be verified), then every file's header
 *       (mt_checkpoint_header_check and the layout's ranks) and its exact size
 *       (mt_checkpoint_file_bytes), and the routers' expert bias of an MoE checkpoint in every model
 *       file (finite, the same copy in each). Exit status 0 only when all hold; else one line names
 *       what failed.
 *       (--no-verify does not go with verify.)
 *   checkpoint_tool reshard DIR OUT --target-tp N --target-pp M [--target-vp V] [--target-ep E] [--iteration N]
 *                   [--make-vocab-size-divisible-by 128] [--overlap-grad-reduce] [--ddp-bucket-size N]
 *                   [--no-verify]
 *       writes OUT/iter_N at the target layout with a non-sharded optimizer, each target rank's
 *       fp32 master weights and Adam moments cut from the saved files by megatron.h's
 *       mt_ckpt_read_part (the trainer's --load at another layout; headers, manifest, tracker; a
 *       temporary directory renamed into place). A distributed-optimizer checkpoint's buckets come
 *       from its header; one written before the header recorded them needs the
 *       --overlap-grad-reduce / --ddp-bucket-size of the run that wrote it. The vocabulary is padded for the target TP as
 *       Megatron pads it (new padding rows zero). --target-ep E (default 1: every expert in every model
 *       file, the layout convert_hf --export reads) cuts the experts over E expert-parallel ranks
 *       (mp_rank_<tp>_<e>/, as the trainer saves at --expert-model-parallel-size E). The routers' expert bias (layout-free) is carried
 *       whole into every model file. FP8 delayed-scaling state is dropped, with a note.
 *       The output is committed with its own manifest (and the header's manifest mark).
 * `--flag=value` is `--flag value` (prepro/args.h). Bad usage: exit 2.
 */
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#include "args.h"
#include "checkpoint_tool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(void) {
    fprintf(stderr,
            "usage: checkpoint_tool info DIR [--iteration N] [--no-verify]\n"
            "       checkpoint_tool verify DIR [--iteration N]\n"
            "       checkpoint_tool reshard DIR OUT --target-tp N --target-pp M [--target-vp V] [--target-ep E]\n"
            "                       [--iteration N]\n"
            "                       [--make-vocab-size-divisible-by 128] [--overlap-grad-reduce] [--ddp-bucket-size N]\n"
            "                       [--no-verify]\n"
            "  --no-verify  read a checkpoint whose manifest check fails (or that lost the manifest it was saved\n"
            "               with) anyway, with a warning\n");
}

static int parse_num(const char* flag, const char* s, long long lo, long long hi, long long* out) {
    return mt_args_parse_int("checkpoint_tool", flag, s, lo, hi, out);
}

static int is_layered(int tensor) { return mt_param_per_layer(tensor); }

static void print_layers(const mt_pp_stage* st) {
    for (int c = 0; c < st->num_chunks; c++) {
        const int first = st->first_layer[c], last = first + st->num_layers[c] - 1;
        if (last > first) printf("%s%d-%d", c ? "," : "", first, last);
        else printf("%s%d", c ? "," : "", first);
    }
}

static int info(const mt_ckpt* ck) {
    const int64_t* h = ck->header;
    const mt_config* c = &ck->cfg;
    double loss_scale, eps;
    memcpy(&loss_scale, &h[MT_CK_LOSS_SCALE_BITS], sizeof(double));
    memcpy(&eps, &h[MT_CK_NORM_EPS_BITS], sizeof(double));
    static const char* precision[] = {"fp32", "bf16", "fp16"};
    printf("checkpoint %s: iteration %lld\n", ck->iter_dir, (long long)ck->iteration);
    printf("layout: TP %d, PP %d, VP %d, EP %d; optimizer %s\n", ck->tp, ck->pp, ck->vp, ck->ep,
           ck->sharded_dp > 0 ? "sharded over DP (distributed optimizer)" : "not sharded");
    if (ck->ep > 1)
        printf("  expert parallelism: each EP rank's directory holds its %d of %d experts; its shard files are those "
               "of the DP ranks d with d %% %d = its rank (experts sharded over those %d)\n", c->num_experts / ck->ep,
               c->num_experts, ck->ep, ck->sharded_dp > 0 ? ck->sharded_dp / ck->ep : 1);
    if (ck->sharded_dp > 0) printf("  distributed optimizer: %d DP shards per model-parallel rank\n", ck->sharded_dp);
    printf("model: %d layers, hidden %d, %d heads, %d query groups, kv channels %d, ffn %d, vocabulary %lld padded "
           "(%lld true), %d positions, %lld parameters\n", c->num_layers, c->hidden_size, c->num_attention_heads,
           c->num_query_groups, c->kv_channels, c->ffn_hidden_size, (long long)h[MT_CK_VOCAB],
           (long long)h[MT_CK_TRUE_VOCAB], c->max_position_embeddings, (long long)h[MT_CK_NUM_PARAMS]);
    printf("flavour: %s%s%s, %s, %s positions, %s embeddings, %s, norm epsilon %g, %s\n",
           c->normalization == MT_NORM_RMSNORM ? "RMSNorm" : "LayerNorm", c->apply_layernorm_1p ? " (1p)" : "",
           c->qk_layernorm ? " (also of queries and keys)" : "",
           c->swiglu ? "SwiGLU" : c->squared_relu ? "squared ReLU" : "GeLU",
           c->position_embedding_type == MT_POSITION_ROPE ? "rope" : c->position_embedding_type == MT_POSITION_NONE
                                                                         ? "no" : "learned absolute",
           c->untie_embeddings_and_output_weights ? "untied" : "tied", c->add_bias_linear ? "linear biases" : "no linear biases",
           eps, h[MT_CK_PRECISION] >= 0 && h[MT_CK_PRECISION] <= 2 ? precision[h[MT_CK_PRECISION]] : "?");
    if (c->num_experts > 0) {
        char shared[64] = "none";
        if (c->moe_shared_expert_intermediate_size > 0)
            snprintf(shared, sizeof(shared), "of width %d%s", c->moe_shared_expert_intermediate_size,
                     c->moe_shared_expert_gate ? ", gated" : "");
        printf("mixture of experts: %d experts of width %lld in %lld of %d layers, shared expert %s, expert bias "
               "(--moe-router-enable-expert-bias) %s\n", c->num_experts, (long long)h[MT_CK_MOE_FFN],
               (long long)h[MT_CK_MOE_LAYERS], c->num_layers, shared,
               h[MT_CK_MOE_EXPERT_BIAS] ? "[MoE layers, experts] fp32, whole at the end of every model file" : "none");
    }
    if (c->position_embedding_type == MT_POSITION_ROPE)
        printf("rope: base %g, percent %g%s\n", c->rotary_base, c->rotary_percent, c->use_rope_scaling ? ", Llama-3.1 scaling" : "");
    if (mt_moe_num_layers(c) > 0)
        printf("mixture of experts: %d of %d layers, %d experts of width %lld%s%s\n", mt_moe_num_layers(c), c->num_layers,
               c->num_experts, (long long)mt_moe_ffn(c), c->moe_shared_expert_intermediate_size ? ", a shared expert" : "",
               c->moe_shared_expert_gate ? " (gated)" : "");
    printf("progress: %lld samples consumed, scheduler step %lld, Adam step %lld, loss scale %g\n",
           (long long)h[MT_CK_CONSUMED], (long long)h[MT_CK_SCHED_STEPS], (long long)h[MT_CK_ADAM_STEP], loss_scale);
    if (h[MT_CK_FP8_TENSORS] > 0)
        printf("FP8 delayed scaling state: %lld tensors (first file), amax history %lld\n", (long long)h[MT_CK_FP8_TENSORS],
               (long long)h[MT_CK_FP8_HISTORY_LEN]);
    printf("files:\n");
    for (int t = 0; t < ck->tp; t++)
        for (int k = 0; k < ck->pp * ck->ep; k++) {
            const int s = k / ck->ep, e = k % ck->ep;
            char rank_dir[4300], path[4400];
            mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, ck->ep, t, s, e);
            for (int r = -1; r < ck->sharded_dp; r++) {
                if (r >= 0 && r % ck->ep != e) continue; /* DP rank r's shard is in EP rank r % EP's directory */
                mt_ckpt_file_path(path, sizeof(path), rank_dir, r);
                struct stat sb;
                if (stat(path, &sb) == 0) printf("  %s  %lld bytes\n", path + strlen(ck->iter_dir) + 1, (long long)sb.st_size);
                else printf("  %s  MISSING (%s)\n", path + strlen(ck->iter_dir) + 1, strerror(errno));
            }
        }
    char manifest[4400];
    snprintf(manifest, sizeof(manifest), "%s/%s", ck->iter_dir, MT_CKPT_MANIFEST);
    struct stat sb;
    printf("  %s  %s\n", MT_CKPT_MANIFEST, stat(manifest, &sb) == 0 ? "present"
                                          : h[MT_CK_MANIFESTED] ? "absent (but the checkpoint was saved with one)"
                                                                : "absent (a checkpoint from before manifests)");
    printf("tensors (full shape; in each file: the TP split's slice, dimensions counted from 0, and the stage's layers):\n");
    mt_param_info full[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, full);
    mt_error err;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        const mt_param_info* p = &full[i];
        if (p->numel == 0) continue;
        printf("  %-26s [", p->name);
        if (is_layered(i)) printf("%d, ", c->num_layers);
        if (p->split_outer > 1) printf("%lld, ", (long long)p->split_outer);
        printf("%lld", (long long)p->split_rows);
        if (p->split_inner > 1) printf(", %lld", (long long)p->split_inner);
        /* the dimension the TP split cuts: split_rows', in the shape as printed */
        const int split_dim = is_layered(i) + (p->split_outer > 1);
        printf("]  %lld elements%s\n", (long long)p->numel, p->tp_split && ck->tp > 1 ? "" : ck->tp > 1 ? ", whole on every TP rank" : "");
        for (int t = 0; t < ck->tp; t++)
            for (int k = 0; k < ck->pp * ck->ep; k++) {
                const int s = k / ck->ep, e = k % ck->ep;
                mt_config rc;
                mt_pp_stage st;
                if (mt_ckpt_config(&rc, ck->header, ck->tp, ck->pp, ck->vp, 0, NULL, t, s, &err) != MT_OK ||
                    mt_pp_stage_of(&rc, s, &st, &err) != MT_OK) {
                    printf("    (the layer split: %s)\n", err.message);
                    return 1;
                }
                if (!mt_pp_holds(&st, i, is_layered(i) ? st.first_layer[0] : 0)) continue;
                if (i == MT_P_WORD_EMBEDDINGS && !st.embedding && c->untie_embeddings_and_output_weights) continue;
                char rank_dir[4300];
                mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), "", ck->pp, ck->ep, t, s, e);
                int64_t rows, row0, outer, outer0;
                mt_tp_rows(p, ck->tp, t, &rows, &row0);
                mt_ep_outer(p, ck->ep, e, &outer, &outer0);
                const int ep_cut = p->ep_split && ck->ep > 1;
                printf("    %-16s", rank_dir + 1);
                if (ep_cut) { /* the experts: the outer dimension, after the layers' (2 entries per expert with SwiGLU) */
                    const int64_t per = p->split_outer / c->num_experts;
                    printf(" experts [%lld, %lld], dimension %d [%lld, %lld]", (long long)(outer0 / per),
                           (long long)((outer0 + outer) / per - 1), is_layered(i), (long long)outer0,
                           (long long)(outer0 + outer - 1));
                }
                if (p->tp_split && ck->tp > 1)
                    printf("%s [%lld, %lld] of dimension %d", ep_cut ? "," : "", (long long)row0,
                           (long long)(row0 + rows - 1), split_dim);
                if (is_layered(i) && ck->pp > 1) {
                    printf("%s layers ", p->tp_split && ck->tp > 1 ? "," : "");
                    print_layers(&st);
                }
                if (!(p->tp_split && ck->tp > 1) && !(is_layered(i) && ck->pp > 1) && !ep_cut) printf(" all of it");
                if (i == MT_P_WORD_EMBEDDINGS && !st.embedding) printf(" (the last stage's copy, tied)");
                printf("\n");
            }
    }
    return 0;
}

int main(int argc, char** argv) {
    int n = 0;
    char** args = mt_args_split_equals(argc, argv, &n);
    if (!args) {
        fprintf(stderr, "checkpoint_tool: error: out of memory\n");
        return 1;
    }
    const char *command = NULL, *positional[2] = {NULL, NULL};
    int num_positional = 0;
    long long iteration = -1, tp = 0, pp = 0, vp = 1, ep = 1, divisible_by = 128, bucket = 0;
    int no_verify = 0;
    mt_ckpt_ddp ddp = {0, 0};
    /* usage errors (a bad flag or value, a missing command) exit 2; a checkpoint that fails exits 1 */
    static const char* const value_flags[] = {"--iteration", "--target-tp", "--target-pp", "--target-vp", "--target-ep",
                                              "--make-vocab-size-divisible-by", "--ddp-bucket-size"};
    for (int i = 1; i < n; i++) {
        const char* a = args[i];
        int has_value = i + 1 < n;
        int ok = 1;
        for (size_t k = 0; k < sizeof(value_flags) / sizeof(value_flags[0]) && !has_value; k++)
            if (!strcmp(a, value_flags[k])) {
                fprintf(stderr, "checkpoint_tool: error: %s needs a value\n", a);
                free(args);
                return 2;
            }
        if (!strcmp(a, "--iteration") && has_value) ok = parse_num(a, args[++i], 0, INT64_MAX, &iteration);
        else if (!strcmp(a, "--target-tp") && has_value) ok = parse_num(a, args[++i], 1, 4096, &tp);
        else if (!strcmp(a, "--target-pp") && has_value) ok = parse_num(a, args[++i], 1, 4096, &pp);
        else if (!strcmp(a, "--target-vp") && has_value) ok = parse_num(a, args[++i], 1, MT_PP_MAX_CHUNKS, &vp);
        else if (!strcmp(a, "--target-ep") && has_value) ok = parse_num(a, args[++i], 1, 4096, &ep);
        else if (!strcmp(a, "--make-vocab-size-divisible-by") && has_value) ok = parse_num(a, args[++i], 1, 1 << 20, &divisible_by);
        else if (!strcmp(a, "--ddp-bucket-size") && has_value) ok = parse_num(a, args[++i], 1, INT64_MAX / 16, &bucket);
        else if (!strcmp(a, "--overlap-grad-reduce")) ddp.overlap_grad_reduce = 1;
        else if (!strcmp(a, "--no-verify")) no_verify = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); free(args); return 0; }
        else if (!strncmp(a, "--", 2)) {
            fprintf(stderr, "checkpoint_tool: error: unknown flag %s (see --help)\n", a);
            ok = 0;
        } else if (!command) command = a;
        else if (num_positional < 2) positional[num_positional++] = a;
        else {
            fprintf(stderr, "checkpoint_tool: error: unexpected argument %s\n", a);
            ok = 0;
        }
        if (!ok) { free(args); return 2; }
    }
    ddp.ddp_bucket_size = bucket;
    int want = command && !strcmp(command, "reshard") ? 2 : 1;
    if (!command || (strcmp(command, "info") && strcmp(command, "verify") && strcmp(command, "reshard")) ||
        num_positional != want) {
        usage();
        if (!command) fprintf(stderr, "checkpoint_tool: error: give a command: info, verify or reshard\n");
        else if (strcmp(command, "info") && strcmp(command, "verify") && strcmp(command, "reshard"))
            fprintf(stderr, "checkpoint_tool: error: unknown command %s: info, verify or reshard\n", command);
        else fprintf(stderr, "checkpoint_tool: error: %s takes %s\n", command, want == 2 ? "DIR OUT" : "DIR");
        free(args);
        return 2;
    }
    if (!strcmp(command, "reshard") && (tp < 1 || pp < 1)) {
        fprintf(stderr, "checkpoint_tool: error: reshard needs --target-tp and --target-pp\n");
        free(args);
        return 2;
    }
    if (no_verify && !strcmp(command, "verify")) {
        fprintf(stderr, "checkpoint_tool: error: --no-verify goes with info and reshard, not with verify\n");
        free(args);
        return 2;
    }
    mt_error err, warning;
    mt_ckpt ck;
    mt_status st = MT_OK;
    int64_t chosen = iteration;
    /* the integrity rule first (verify applies it strictly itself, mt_ckpt_verify) */
    if (strcmp(command, "verify")) {
        st = mt_checkpoint_select(positional[0], iteration, no_verify, &chosen, NULL, &warning, &err);
        if (st == MT_OK && warning.message[0]) fprintf(stderr, "checkpoint_tool: warning: %s\n", warning.message);
    }
    if (st == MT_OK) st = mt_ckpt_open(&ck, positional[0], chosen, &err);
    int rc = 0;
    if (st == MT_OK && !strcmp(command, "info")) {
        rc = info(&ck);
    } else if (st == MT_OK && !strcmp(command, "verify")) {
        st = mt_ckpt_verify(&ck, &ddp, &err);
        if (st == MT_OK)
            printf("%s: OK (iteration %lld, TP %d, PP %d, VP %d, EP %d%s: headers, sizes and checksums)\n", ck.iter_dir,
                   (long long)ck.iteration, ck.tp, ck.pp, ck.vp, ck.ep, ck.sharded_dp ? ", distributed optimizer" : "");
    } else if (st == MT_OK) {
        int dropped_fp8 = 0;
        st = mt_ckpt_reshard_ep(&ck, &ddp, positional[1], (int)tp, (int)pp, (int)vp, (int)ep, (int)divisible_by,
                                &dropped_fp8, &err);
        if (st == MT_OK) {
            if (dropped_fp8)
                printf("note: the FP8 delayed-scaling state (amax histories, scales) belongs to the old layout and was "
                       "dropped; the trainer starts the scales afresh\n");
            printf("wrote %s/iter_%07lld at TP %lld, PP %lld, VP %lld, EP %lld (from TP %d, PP %d, VP %d, EP %d%s)\n",
                   positional[1], (long long)ck.iteration, tp, pp, vp, ep, ck.tp, ck.pp, ck.vp, ck.ep,
                   ck.sharded_dp ? ", distributed optimizer" : "");
        }
    }
    if (st != MT_OK) {
        fprintf(stderr, "checkpoint_tool: error: %s\n", err.message);
        rc = 1;
    }
    free(args);
    return rc;
}
