/* tests/test_configs.h — the tests' tiny model configurations, built in one place.
 *
 * A test config starts from one of two constructors, then small named modifiers each set one group
 * of Megatron's flags; a single field one test needs changed is set in that test. Nothing here
 * calls mt_config_finalize.
 *
 *   test_config(flavour, precision)      the small model of the GPU tests, GPT-2 or Llama (below);
 *                                        the data- and tensor-parallel tests start from it too
 *   test_config_sized(L, h, heads, seq, vocab)
 *                                        Megatron's defaults (GPT-2 flavour, fp32, micro-batch 1,
 *                                        linear decay, no warmup) with this shape, and one training
 *                                        step (--train-iters 1) at --lr 1e-3: the host tests' start;
 *                                        dropout 0 (Megatron's 0.1 is tests/test_dropout.h's to set)
 *   test_config_batch(&c, micro, global) --micro-batch-size, --global-batch-size (0: micro x DP)
 *   test_config_attention(&c, heads, groups, kv, ffn)
 *                                        --num-attention-heads, --num-query-groups, --kv-channels,
 *                                        --ffn-hidden-size (0: derived by finalize)
 *   test_config_llama(&c)                Llama's switches: RMSNorm, SwiGLU, RoPE, untied output
 *                                        weights, no linear biases (rope base and scaling unchanged)
 *   test_config_parallel(&c, tp, world, sp)
 *                                        --tensor-model-parallel-size, the world size (DP = world /
 *                                        TP), --sequence-parallel
 *   test_config_ddp(&c, dist, overlap_grad, overlap_param, bucket)
 *                                        --use-distributed-optimizer, --overlap-grad-reduce,
 *                                        --overlap-param-gather, --ddp-bucket-size
 *   test_config_this_rank(&c)            multi-GPU tests: this MPI process's rank (0 when the world is
 *                                        1) and its GPU on the node */
#ifndef MT_TEST_CONFIGS_H
#define MT_TEST_CONFIGS_H

#include "test_common.h"

typedef enum { TEST_GPT2 = 0, TEST_LLAMA = 1 } test_flavour;

static mt_config test_config_sized(int layers, int hidden, int heads, int seq, int64_t vocab) {
    mt_config c;
    mt_config_defaults(&c);
    c.num_layers = layers;
    c.hidden_size = hidden;
    c.num_attention_heads = heads;
    c.seq_length = seq;
    c.vocab_size = vocab;
    c.train_iters = 1;
    c.lr = 1e-3;
    c.hidden_dropout = 0.0; /* every test compares against dropout-free references or runs */
    c.attention_dropout = 0.0;
    return c;
}

static void test_config_batch(mt_config* c, int micro, int global) {
    c->micro_batch_size = micro;
    c->global_batch_size = global;
}

static void test_config_attention(mt_config* c, int heads, int groups, int kv_channels, int ffn) {
    c->num_attention_heads = heads;
    c->num_query_groups = groups;
    c->kv_channels = kv_channels;
    c->ffn_hidden_size = ffn;
}

static void test_config_llama(mt_config* c) {
    c->normalization = MT_NORM_RMSNORM;
    c->swiglu = 1;
    c->position_embedding_type = MT_POSITION_ROPE;
    c->untie_embeddings_and_output_weights = 1;
    c->add_bias_linear = 0;
}

static void test_config_parallel(mt_config* c, int tp, int world, int sp) {
    c->tensor_model_parallel_size = tp;
    c->world_size = world;
    c->sequence_parallel = sp;
}

static void test_config_ddp(mt_config* c, int distributed_optimizer, int overlap_grad_reduce, int overlap_param_gather,
                            int64_t bucket_size) {
    c->use_distributed_optimizer = distributed_optimizer;
    c->overlap_grad_reduce = overlap_grad_reduce;
    c->overlap_param_gather = overlap_param_gather;
    c->ddp_bucket_size = bucket_size;
}

/* Call after test_config_parallel: the rank follows the world size. mpi_local_rank is collective
 * under MPI, so every rank makes the same calls. */
static void test_config_this_rank(mt_config* c) {
    c->rank = c->world_size > 1 ? mpi_rank() : 0;
    c->local_rank = mpi_local_rank();
}

/* The GPU tests' small model: 2 layers, hidden 128 in 2 heads of 64 (bf16 runs the flash kernels, so
 * the determinism tests cover them), seq 64, vocabulary 1000, micro-batch 4 of a global batch 8 (two
 * micro-batches), 20 steps at lr 1e-3: 3 of warmup, then cosine down to 1e-4. TEST_LLAMA is the same
 * size in the Llama flavour: GQA 4 heads in 2 groups of head dim 64, ffn 320, RoPE with base 500000
 * and Llama-3.1 scaling, RMSNorm, SwiGLU, untied output, no biases. */
/* Host tests: 2 layers of 64 in 4 heads, seq 32, vocabulary 500; micro-batch 2 of a global batch 8,
 * 100 steps at lr 1e-3. */
static mt_config small_test_config(void) {
    mt_config c = test_config_sized(2, 64, 4, 32, 500);
    test_config_batch(&c, 2, 8);
    c.train_iters = 100;
    return c;
}

static mt_config test_config(test_flavour flavour, mt_precision precision) {
    mt_config c = test_config_sized(2, 128, 2, 64, 1000);
    test_config_batch(&c, 4, 8);
    c.train_iters = 20;
    c.min_lr = 1e-4;
    c.lr_warmup_iters = 3;
    c.lr_decay_style = MT_LR_COSINE;
    c.precision = precision;
    if (flavour == TEST_LLAMA) {
        test_config_attention(&c, 4, 2, 64, 320);
        test_config_llama(&c);
        c.rotary_base = 500000;
        c.use_rope_scaling = 1;
    }
    return c;
}

#endif
