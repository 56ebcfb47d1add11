/* dev/hf_logits.c — the logits of a megatron.c checkpoint for a batch of tokens, through the trainer
 * API (mt_trainer_load + mt_trainer_logits). dev/hf_check.py compares them with transformers'.
 *
 *   make dev/hf_logits && dev/hf_logits CKPT_DIR TOKENS.bin LOGITS.bin [--bf16 | --bf16-weights] [--no-verify]
 *                                     [--moe-router-topk K [--moe-router-pre-softmax]]
 *
 * TOKENS.bin: int32 B, int32 T, int32 tokens [B*T]. LOGITS.bin: int32 B, T, Vp, float32 [B, T, Vp].
 * The model's shape and flavour (GPT-2 or Llama: norm, MLP, positions, rope, tied output, biases, norm
 * epsilon; a mixture of experts' experts, expert width and layers) come from the checkpoint's header
 * (mt_config_from_checkpoint_header), so no flags, but for the router of a mixture of experts, which the
 * header does not record: --moe-router-topk K (required for one) and --moe-router-pre-softmax.
 * Default: fp32 compute on the checkpoint's fp32 master weights. --bf16: bf16 compute (the model copy
 * is the master rounded to bf16). --bf16-weights: fp32 compute on the master rounded to bf16, the
 * weights a bf16 checkpoint's model tensors hold (what another framework loads from it). The tracker's
 * iteration is read after megatron.h's integrity rule (mt_checkpoint_select without a fallback: a
 * refusal names the file; --no-verify reads it anyway, with a warning). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megatron.h"
#define MT_SAFETENSORS_IMPLEMENTATION
#include "prepro/safetensors.h" /* mt_st_f32_to_bf16: round to nearest even, as torch's .to(bfloat16) */

static int fail(const char* what, const char* detail) {
    fprintf(stderr, "hf_logits: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    return 1;
}

int main(int argc, char** argv) {
    int bf16 = 0, bf16_weights = 0, no_verify = 0, positional = 0, topk = 0, pre_softmax = 0;
    const char* args[3] = {NULL, NULL, NULL};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--moe-router-topk") && i + 1 < argc) {
            char* end = NULL;
            long k = strtol(argv[++i], &end, 10);
            if (*end || k < 1 || k > (1 << 20)) positional = 4;
            topk = (int)k;
        } else if (!strcmp(argv[i], "--moe-router-pre-softmax")) pre_softmax = 1;
        else if (!strcmp(argv[i], "--bf16") && !bf16_weights) bf16 = 1;
        else if (!strcmp(argv[i], "--bf16-weights") && !bf16) bf16_weights = 1;
        else if (!strcmp(argv[i], "--no-verify")) no_verify = 1;
        else if (strncmp(argv[i], "--", 2) && positional < 3) args[positional++] = argv[i];
        else positional = 4;
    }
    if (positional != 3)
        return fprintf(stderr, "usage: hf_logits CKPT_DIR TOKENS.bin LOGITS.bin [--bf16 | --bf16-weights] [--no-verify] "
                       "[--moe-router-topk K [--moe-router-pre-softmax]]\n"), 2;
    const char* dir = args[0];
    mt_error err, warning;
    int64_t it = -1;
    mt_ckpt ck;
    mt_status st = mt_checkpoint_select(dir, -1, no_verify, &it, NULL, &warning, &err);
    if (warning.message[0]) fprintf(stderr, "hf_logits: warning: %s\n", warning.message);
    if (st == MT_OK) st = mt_ckpt_open(&ck, dir, it, &err); /* the header, its words and the file's size checked */
    if (st != MT_OK) return fail(err.message, NULL);
    const int64_t* h = ck.header;
    FILE* f = fopen(args[1], "rb");
    int32_t bt[2];
    if (!f || fread(bt, sizeof(bt), 1, f) != 1) return fail("cannot read", args[1]);
    int B = bt[0], T = bt[1];
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * T);
    if (!tokens || fread(tokens, sizeof(int32_t), (size_t)B * T, f) != (size_t)B * T) return fail("truncated", args[1]);
    fclose(f);

    mt_config c;
    mt_config_defaults(&c);
    mt_config_from_checkpoint_header(&c, h); /* shape and flavour; vocab_size = the padded size (pads to itself) */
    c.seq_length = T;
    c.micro_batch_size = B;
    c.global_batch_size = B;
    c.train_iters = 1;
    c.lr = 1e-4;
    c.precision = bf16 ? MT_BF16 : MT_FP32;
    if (c.num_experts > 0 && !topk) return fail("the checkpoint is a mixture of experts: give --moe-router-topk K", NULL);
    if (c.num_experts == 0 && (topk || pre_softmax)) return fail("--moe-router-* with a dense checkpoint", NULL);
    if (topk) c.moe_router_topk = topk;
    c.moe_router_pre_softmax = pre_softmax;
    mt_trainer* t = NULL;
    if (mt_config_finalize(&c, &err) != MT_OK || mt_trainer_create(&t, &c, &err) != MT_OK) return fail(err.message, NULL);
    mt_trainer_set_no_verify_checkpoint(t, no_verify);
    if (mt_trainer_load(t, dir, it, NULL, NULL, &err) != MT_OK) return fail(err.message, NULL);
    if (bf16_weights) { /* every weight rounded to bf16, computed in fp32 */
        const int64_t np = mt_num_parameters(&c);
        float* w = (float*)malloc(sizeof(float) * (size_t)np);
        if (!w || mt_trainer_get_parameters(t, w, &err) != MT_OK) return fail(w ? err.message : "out of memory", NULL);
        for (int64_t i = 0; i < np; i++) w[i] = mt_st_bf16_to_f32(mt_st_f32_to_bf16(w[i]));
        if (mt_trainer_set_parameters(t, w, &err) != MT_OK) return fail(err.message, NULL);
        free(w);
    }
    size_t n = (size_t)B * T * (size_t)c.padded_vocab_size;
    float* logits = (float*)malloc(sizeof(float) * n);
    if (!logits || mt_trainer_logits(t, tokens, logits, &err) != MT_OK) return fail(logits ? err.message : "out of memory", NULL);
    f = fopen(args[2], "wb");
    int32_t shape[3] = {B, T, (int32_t)c.padded_vocab_size};
    if (!f || fwrite(shape, sizeof(shape), 1, f) != 1 || fwrite(logits, sizeof(float), n, f) != n || fclose(f) != 0)
        return fail("cannot write", args[2]);
    mt_trainer_free(t);
    free(logits);
    free(tokens);
    return 0;
}
