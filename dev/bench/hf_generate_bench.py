"""dev/bench/hf_generate_bench.py — transformers' greedy generate for the shapes of dev/generate_bench.c (GPT-2
1.5B, Llama-3.2-1B; random weights, bf16, one GPU) with its static KV cache and torch.compile (the
forward compiled with mode="reduce-overhead", as transformers' documentation on static caches does).
For each batch size: B random prompts of PROMPT tokens, NEW greedy tokens (no end-of-text stop); after a
warm-up generate (compilation), the time of a generate of 1 token (time to first token) and of NEW tokens;
decode tokens/s = B (NEW - 1) / (the difference). Prints one line `RESULT {json}` per batch size.

  python dev/bench/hf_generate_bench.py --model gpt2-1.5b --batches 1,8,64 --prompt 128 --new 256
"""
import argparse
import json
import time

import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def build(name):
    if name == "gpt2-1.5b":
        cfg = GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, vocab_size=50257)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return LlamaForCausalLM(cfg)


def timed(model, ids, new):
    gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                          cache_implementation="static")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-1.5b", choices=["gpt2-1.5b", "llama-3.2-1b"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    a = ap.parse_args()
    model = build(a.model).to(device="cuda", dtype=torch.bfloat16).eval()
    if a.compile == "on":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for b in [int(x) for x in a.batches.split(",")]:
        ids = torch.randint(0, 50000, (b, a.prompt), device="cuda")
        timed(model, ids, a.new)  # compilation and warm-up
        first = timed(model, ids, 1)
        total = timed(model, ids, a.new)
        rate = b * (a.new - 1) / max(total - first, 1e-9)
        print("RESULT " + json.dumps({"model": a.model, "batch": b, "ttft_ms": first * 1e3, "tokens_per_s": rate,
                                      "ms_per_step": (total - first) / (a.new - 1) * 1e3, "compile": a.compile}),
              flush=True)


if __name__ == "__main__":
    main()
