"""dev/bench/hf_generate_bench.py — transformers' greedy decoding for the shapes of dev/generate_bench.c (GPT-2
1.5B, Llama-3.2-1B; random weights, bf16, one GPU) over its static KV cache (StaticCache), the one-token decode
step compiled with torch.compile(mode="reduce-overhead") (CUDA graphs), the way transformers' documentation on
static caches and torch.compile describes it: the prompt's prefill runs the model eagerly (its length differs
from the decode step's), each decode step calls torch.compiler.cudagraph_mark_step_begin() first (the static
cache's in-place index_copy_ of a step would otherwise overwrite the previous graph replay's outputs, which
torch refuses) and takes the argmax of the step's logits before the next replay. The batch dimension is left
to torch.compile's automatic dynamic shapes: one compile for the first batch size, one more for the others.

For each batch size: one StaticCache of PROMPT + NEW positions, reset (in place: torch.compile's graph guards
the cache tensors' addresses, so a new cache would recompile inside the timed run) before an untimed round of
4 tokens (compilation, CUDA-graph recording, cuBLAS's first calls), then B random prompts of PROMPT tokens:
the time to first token (the prefill and its argmax) and NEW - 1 decode steps (no end-of-text stop); decode
tokens/s = B (NEW - 1) / their time. One line `RESULT {json}` per batch; a batch that fails (out of memory,
a compile error) prints `RESULT {..., "error": ...}` and the others still run. The prefill keeps the last
position's logits only (logits_to_keep) where the model takes it; cache_position is passed only to a
transformers whose forward still names it (5.x derives positions from the cache itself).

  python dev/bench/hf_generate_bench.py --model gpt2-1.5b --batches 1,8,64 --prompt 128 --new 256
  python dev/bench/hf_generate_bench.py --tiny --device cpu --compile off   (a check that it runs, no GPU)
"""
import argparse
import inspect
import json
import time
import traceback
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, StaticCache


def build(name, tiny):
    if name == "gpt2-1.5b":
        shape = dict(n_layer=2, n_embd=64, n_head=4) if tiny else dict(n_layer=48, n_embd=1600, n_head=25)
        return GPT2LMHeadModel(GPT2Config(n_positions=1024, vocab_size=50257, **shape))
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16) if tiny else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64))
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **shape)
    return LlamaForCausalLM(cfg)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def greedy(model, step, cache, ids, new, device, compiled):
    """B prompts ids [B, P], new tokens each, over cache (reset first): (seconds to the first token, seconds of
    the new - 1 decode steps)."""
    b, p = ids.shape
    names = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in names else {}
    with_position = "cache_position" in names
    cache.reset()
    sync(device)
    t0 = time.perf_counter()
    if with_position:
        extra["cache_position"] = torch.arange(p, device=device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, **extra)
    tok = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
    sync(device)
    t1 = time.perf_counter()
    for i in range(new - 1):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        kw = {"cache_position": torch.tensor([p + i], device=device)} if with_position else {}
        out = step(input_ids=tok, past_key_values=cache, use_cache=True, **kw)
        tok = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)  # read before the next replay overwrites it
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-1.5b", choices=["gpt2-1.5b", "llama-3.2-1b"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="two-layer models of the same kind (a check that it runs)")
    a = ap.parse_args()
    warnings.simplefilter("ignore", FutureWarning)  # newer transformers rename past_key_values; 5.17's is this one
    if a.prompt < 1 or a.new < 2:
        ap.error("--prompt >= 1 and --new >= 2")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    with torch.device(a.device):  # the random initialisation on the device (minutes on the CPU for 1.5B)
        model = build(a.model, a.tiny)
    model = model.to(dtype=dtype).eval()
    compiled = a.compile == "on"
    mode = "reduce-overhead" if a.device == "cuda" else "default"
    step = torch.compile(model.forward, mode=mode, fullgraph=True) if compiled else model.forward
    fullgraph = compiled
    compiled = compiled and a.device == "cuda"
    with torch.inference_mode():
        for b in [int(x) for x in a.batches.split(",")]:
            result = {"model": a.model, "batch": b, "compile": a.compile, "tiny": a.tiny}
            try:
                ids = torch.randint(0, 50000, (b, a.prompt), device=a.device)
                cache = StaticCache(config=model.config, max_cache_len=a.prompt + a.new)
                t = time.perf_counter()
                try:
                    greedy(model, step, cache, ids, 4, a.device, compiled)  # compilation, graph recording, first calls
                except Exception as e:  # a torch too old for this transformers' forward in one graph: allow breaks
                    if not fullgraph:
                        raise
                    print(f"note: fullgraph=True failed ({type(e).__name__}: {e}); compiling with graph breaks",
                          flush=True)
                    torch._dynamo.reset()
                    step, fullgraph = torch.compile(model.forward, mode=mode, fullgraph=False), False
                    greedy(model, step, cache, ids, 4, a.device, compiled)
                warm = time.perf_counter() - t
                first, decode = greedy(model, step, cache, ids, a.new, a.device, compiled)
                result.update({"ttft_ms": first * 1e3, "tokens_per_s": b * (a.new - 1) / max(decode, 1e-9),
                               "ms_per_step": decode / (a.new - 1) * 1e3, "warmup_s": warm, "fullgraph": fullgraph})
            except Exception as e:  # this batch only: the others (and the caller's table) still get their lines
                traceback.print_exc()
                result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                if a.device == "cuda":
                    torch.cuda.empty_cache()
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
