/* dev/hf_logits.c — the logits of a megatron.c checkpoint for a batch of tokens, through the trainer
 * API (mt_trainer_load + mt_trainer_logits). dev/hf_check.py compares them with transformers'.
 *
 *   make dev/hf_logits && dev/hf_logits CKPT_DIR TOKENS.bin LOGITS.bin [--bf16 | --bf16-weights]
 *
 * TOKENS.bin: int32 B, int32 T, int32 tokens [B*T]. LOGITS.bin: int32 B, T, Vp, float32 [B, T, Vp].
 * The model's shape and flavour (GPT-2 or Llama: norm, MLP, positions, rope, tied output, biases, norm
 * epsilon) come from the checkpoint's header (mt_config_from_checkpoint_header), so no flags.
 * Default: fp32 compute on the checkpoint's fp32 master weights. --bf16: bf16 compute (the model copy
 * is the master rounded to bf16). --bf16-weights: fp32 compute on the master rounded to bf16, the
 * weights a bf16 checkpoint's model tensors hold (what another framework loads from it). */
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
    if (argc < 4 || argc > 5 || (argc == 5 && strcmp(argv[4], "--bf16") && strcmp(argv[4], "--bf16-weights")))
        return fprintf(stderr, "usage: hf_logits CKPT_DIR TOKENS.bin LOGITS.bin [--bf16 | --bf16-weights]\n"), 2;
    const char* dir = argv[1];
    int bf16 = argc > 4 && !strcmp(argv[4], "--bf16"), bf16_weights = argc > 4 && !strcmp(argv[4], "--bf16-weights");
    char path[4096];
    snprintf(path, sizeof(path), "%s/latest_checkpointed_iteration.txt", dir);
    FILE* f = fopen(path, "r");
    long long it = -1;
    if (!f || fscanf(f, "%lld", &it) != 1) return fail("cannot read", path);
    fclose(f);
    snprintf(path, sizeof(path), "%s/iter_%07lld/mp_rank_00/model_optim_rng.bin", dir, it);
    int64_t h[MT_CK_HEADER_WORDS];
    f = fopen(path, "rb");
    if (!f || fread(h, sizeof(h), 1, f) != 1) return fail("cannot read the header of", path);
    fclose(f);
    f = fopen(argv[2], "rb");
    int32_t bt[2];
    if (!f || fread(bt, sizeof(bt), 1, f) != 1) return fail("cannot read", argv[2]);
    int B = bt[0], T = bt[1];
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)B * T);
    if (!tokens || fread(tokens, sizeof(int32_t), (size_t)B * T, f) != (size_t)B * T) return fail("truncated", argv[2]);
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
    mt_error err;
    mt_trainer* t = NULL;
    if (mt_config_finalize(&c, &err) != MT_OK || mt_trainer_create(&t, &c, &err) != MT_OK ||
        mt_trainer_load(t, dir, -1, NULL, NULL, &err) != MT_OK)
        return fail(err.message, NULL);
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
    f = fopen(argv[3], "wb");
    int32_t shape[3] = {B, T, (int32_t)c.padded_vocab_size};
    if (!f || fwrite(shape, sizeof(shape), 1, f) != 1 || fwrite(logits, sizeof(float), n, f) != n || fclose(f) != 0)
        return fail("cannot write", argv[3]);
    mt_trainer_free(t);
    free(logits);
    free(tokens);
    return 0;
}
