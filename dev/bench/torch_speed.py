"""dev/bench/torch_speed.py — PyTorch's training speed for the same GPT as train_gpt (the model of
dev/bench/ref_train_gpt2.py: GPT-2 layout, tied embeddings, tanh GELU): torch.compile, bf16 autocast,
SDPA flash attention, fused AdamW, gradient clipping, random tokens (like train_gpt --mock-data).

Prints one line `RESULT {json}` with the median ms per iteration (CUDA events, after warm-up),
tokens/s and peak memory (max allocated and max
reserved by the caching allocator). Exit code 3 on out-of-memory, for the micro-batch search of
dev/bench/speed_vs_torch.sh.

  python dev/bench/torch_speed.py --num-layers 12 --hidden-size 768 --num-attention-heads 12 --mbs 8
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref_train_gpt2 import GPT  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-layers", type=int, default=12)
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--num-attention-heads", type=int, default=12)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--padded-vocab-size", type=int, default=50304)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    a = ap.parse_args()

    dev = torch.device("cuda")
    torch.manual_seed(1234)
    L, h, n, S, V = a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.padded_vocab_size
    f = 4 * h
    model = GPT(L, h, n, f, V, S).to(dev)
    model.init_megatron(1234)
    run = torch.compile(model) if a.compile == "on" else model
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    params = list(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, 50257, (a.accum * a.mbs, S + 1), generator=gen).to(dev)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step():
        for m in range(a.accum):
            mb = tokens[m * a.mbs:(m + 1) * a.mbs]
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
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
    toks = a.accum * a.mbs * S
    out = {
        "ms": round(ms, 2), "tokens_per_s": round(toks / (ms / 1e3)),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "loss": round(float(loss), 4), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "compile": a.compile, "mbs": a.mbs, "accum": a.accum,
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
