#!/usr/bin/env python3
"""
hf_generate_check.py: Hugging Face transformers' greedy generate on a tiny random GPT-2 and Llama, for the
generation engine's test (tests/test_generate.h, test_generate_gpu_transformers).

    python dev/hf_generate_check.py --write DIR

Needs torch, safetensors and transformers (no internet: the models are built locally). Writes

    DIR/gpt2/, DIR/llama/          the models, save_pretrained(safe_serialization=True), float32
    DIR/gpt2.gen.bin, llama.gen.bin the greedy continuations of PROMPTS prompts

The models: GPT2LMHeadModel (2 layers, n_embd 128, 4 heads, 64 positions, vocabulary 1000) and
LlamaForCausalLM (2 layers, hidden 128, 4 heads in 2 KV groups of head dim 32, intermediate 256,
vocabulary 1000, rope_theta 500000 with llama3 scaling, untied), every weight drawn with std 0.1 and
norm weights 1 + 0.1 N(0, 1), biases 0.05 N(0, 1): logits of a few units, so greedy decisions are
rarely near-ties. Greedy generate runs on the model converted to float64 (eager attention, no
end-of-text stop, no logits processor), STEPS new tokens each. A .gen.bin file is little-endian:

    int32 prompts, int32 steps, then per prompt:
      int32 prompt_len, int32 prompt[prompt_len], int32 tokens[steps],
      float32 logprob[steps]   log softmax of the raw logits at the chosen token
      float32 gap[steps]       the raw logits' top-two difference (a near-tie when tiny)
"""
import argparse
import os
import struct
import sys

import numpy as np
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

V, STEPS = 1000, 32
PROMPT_LENS = [3, 9, 17, 24]  # prompt + STEPS <= 63 (the test's max_context 64 less one)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def perturb(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.05)
            elif "norm" in name or ".ln_" in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def make_gpt2():
    torch.manual_seed(1)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=V, bos_token_id=V - 1,
                     eos_token_id=V - 1)
    cfg._attn_implementation = "eager"
    return perturb(GPT2LMHeadModel(cfg))


def make_llama():
    torch.manual_seed(2)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=V, max_position_embeddings=16384,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=False,
                      bos_token_id=V - 1, eos_token_id=V - 1)
    cfg._attn_implementation = "eager"
    return perturb(LlamaForCausalLM(cfg))


def greedy(model, prompt):
    """transformers' greedy generate, float64: the tokens, their log-probabilities and top-two gaps."""
    gc = GenerationConfig(max_new_tokens=STEPS, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                          bos_token_id=None)
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        # the mask given: without it transformers would take a prompt token equal to pad_token_id for padding
        kwargs = dict(attention_mask=torch.ones_like(ids), generation_config=gc, return_dict_in_generate=True,
                      output_scores=True)
        try:
            out = model.generate(ids, output_logits=True, **kwargs)
            logits = out.logits
        except (TypeError, ValueError):  # transformers before output_logits: greedy's scores are the raw logits
            out = model.generate(ids, **kwargs)
            logits = out.scores
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == STEPS, f"{len(tokens)} tokens generated, wanted {STEPS}"
    lps, gaps = [], []
    for j, row in enumerate(logits):
        row = row[0, :V].double()
        top = torch.topk(row, 2).values
        assert int(torch.argmax(row)) == tokens[j], "generate's token is not the argmax of its logits"
        lps.append(float(torch.log_softmax(row, -1)[tokens[j]]))
        gaps.append(float(top[0] - top[1]))
    return tokens, lps, gaps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--write", required=True, metavar="DIR")
    args = ap.parse_args()
    os.makedirs(args.write, exist_ok=True)
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(0, V - 1, size=n).tolist() for n in PROMPT_LENS]
    for name, make in (("gpt2", make_gpt2), ("llama", make_llama)):
        model = make()
        model.save_pretrained(os.path.join(args.write, name), safe_serialization=True)
        model = model.double()
        blob = [struct.pack("<ii", len(prompts), STEPS)]
        near = 0
        for prompt in prompts:
            tokens, lps, gaps = greedy(model, prompt)
            near += sum(g < 1e-4 for g in gaps)
            blob.append(struct.pack(f"<i{len(prompt)}i{STEPS}i{STEPS}f{STEPS}f", len(prompt), *prompt, *tokens, *lps,
                                    *gaps))
        path = os.path.join(args.write, f"{name}.gen.bin")
        with open(path + ".tmp", "wb") as f:
            f.write(b"".join(blob))
        os.replace(path + ".tmp", path)
        print(f"{name}: {len(prompts)} prompts x {STEPS} greedy tokens (float64), {near} near-ties -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
