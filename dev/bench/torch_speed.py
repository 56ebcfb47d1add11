"""dev/bench/torch_speed.py — PyTorch's training speed for the same model as train_gpt: --model gpt (default) is
the GPT of dev/bench/ref_train_gpt2.py (GPT-2 layout, tied embeddings, tanh GELU); --model llama is the Llama of
dev/bench/ref_llama.py (RMSNorm, SwiGLU, RoPE with llama3 scaling, GQA, no biases, tied embeddings; defaults to
the Llama-3.2-1B shape). torch.compile, bf16 autocast, SDPA flash attention (GQA through enable_gqa, k/v not
repeated; if flash refuses the shapes, the first of efficient / cuDNN that takes them, printed), fused AdamW,
gradient clipping, random tokens (like train_gpt --mock-data).

Prints one line `RESULT {json}` with the median ms per iteration (CUDA events, after warm-up),
tokens/s and peak memory (max allocated and max
reserved by the caching allocator). Exit code 3 on out-of-memory, for the micro-batch search of
dev/bench/speed_vs_torch.sh.

  python dev/bench/torch_speed.py --num-layers 12 --hidden-size 768 --num-attention-heads 12 --mbs 8
  python dev/bench/torch_speed.py --model llama --mbs 4      # Llama-3.2-1B: 16 x 2048, 32 heads, 8 groups
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref_llama import Llama  # noqa: E402
from ref_train_gpt2 import GPT  # noqa: E402

# per model: defaults of the shape flags left out, and the range of the random tokens
DEFAULTS = {
    "gpt": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=None, ffn_hidden_size=None,
                seq_length=1024, padded_vocab_size=50304, tokens=50257),
    "llama": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
                  seq_length=2048, padded_vocab_size=128256, tokens=128000),
}


def pick_sdpa_backend(B, n, g, S, d, dev):
    """Flash attention if it takes these shapes (causal, bf16, GQA through enable_gqa), forward and backward;
    otherwise the first of efficient / cuDNN attention that does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    q = torch.randn(B, n, S, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, g, S, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, g, S, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(b):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != n).sum().backward()
            torch.cuda.synchronize()
            return b
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:
            print(f"sdpa: {b.name} refuses B={B} heads={n} groups={g} S={S} d={d}: {str(e).splitlines()[0]}",
                  file=sys.stderr)
    sys.exit("sdpa: no fused attention backend takes these shapes")


def profile_one_step(step):
    """GPU time of one training step per kernel name (summed over calls), largest first, on stderr."""
    from collections import defaultdict
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:70]
            total[name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            calls[name] += 1
    s = sum(total.values())
    print(f"{'kernel (torch, one step)':70s} {'calls':>6s} {'ms':>8s} share", file=sys.stderr)
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{name:70s} {calls[name]:6d} {us / 1e3:8.3f} {100 * us / s:5.1f}%", file=sys.stderr)
    print(f"{'total':70s} {sum(calls.values()):6d} {s / 1e3:8.3f}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--num-attention-heads", type=int)
    ap.add_argument("--num-query-groups", type=int, help="llama: key/value heads (default 8)")
    ap.add_argument("--ffn-hidden-size", type=int, help="default: gpt 4 * hidden, llama 8192")
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--padded-vocab-size", type=int)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--float8", default="none", choices=["none", "tensorwise", "rowwise"],
                    help="torchao float8 training of the transformer blocks' linears (convert_to_float8_training with "
                         "that recipe; needs torchao; the output layer, tied to the embeddings, stays bf16)")
    ap.add_argument("--profile", action="store_true", help="after timing: one step under torch.profiler, the "
                    "GPU time per kernel name printed to stderr")
    a = ap.parse_args()
    for key, val in DEFAULTS[a.model].items():
        if getattr(a, key, None) is None:
            setattr(a, key, val)

    dev = torch.device("cuda")
    torch.manual_seed(1234)
    L, h, n, S, V = a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.padded_vocab_size
    f = a.ffn_hidden_size or 4 * h
    g = a.num_query_groups or n
    if a.model == "gpt" and g != n:
        sys.exit("torch_speed: --num-query-groups is for --model llama (the GPT has groups == heads)")
    backend = pick_sdpa_backend(a.mbs, n, g, S, h // n, dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the probe's tensors are not part of the run's peak memory
    if a.model == "gpt":
        model = GPT(L, h, n, f, V, S).to(dev)
    else:
        with dev:  # built and initialised on the GPU
            model = Llama(L, h, n, g, f, V, S)
    model.init_megatron(1234)
    print(f"model {a.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"sdpa backend {backend.name}", flush=True)
    if a.float8 != "none":  # torchao: every nn.Linear of the blocks (the tied output layer is no nn.Linear)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(a.float8))
        n8 = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
        print(f"torchao float8 ({a.float8}): {n8} linears converted", flush=True)
    run = torch.compile(model) if a.compile == "on" else model
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    params = list(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, min(a.tokens, V), (a.accum * a.mbs, S + 1), generator=gen).to(dev)

    from torch.nn.attention import sdpa_kernel

    def step():
        for m in range(a.accum):
            mb = tokens[m * a.mbs:(m + 1) * a.mbs]
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(backend):
                loss = run(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
            (loss / a.accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            loss = step()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
    except torch.cuda.OutOfMemoryError as e:
        print(f"OOM at micro-batch {a.mbs}: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(3)
    times.sort()
    ms = times[len(times) // 2]
    free, total = torch.cuda.mem_get_info()  # what the device reports in use (context, cuBLAS, allocator)
    if a.profile:
        profile_one_step(step)
    toks = a.accum * a.mbs * S
    out = {
        "ms": round(ms, 2), "tokens_per_s": round(toks / (ms / 1e3)),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "device_in_use_gib": round((total - free) / 2**30, 2),
        "loss": round(float(loss), 4), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "compile": a.compile, "mbs": a.mbs, "accum": a.accum, "float8": a.float8,
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
