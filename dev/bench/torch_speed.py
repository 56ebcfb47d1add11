"""dev/bench/torch_speed.py — PyTorch's training speed for the same model as train_gpt: --model gpt (default) is
the GPT of dev/bench/ref_train_gpt2.py (GPT-2 layout, tied embeddings, tanh GELU); --model llama is the Llama of
dev/bench/ref_llama.py (RMSNorm, SwiGLU, RoPE with llama3 scaling, GQA, no biases, tied embeddings; defaults to
the Llama-3.2-1B shape); --model moe is ref_llama.py's model with every MLP a Megatron-Core MoE layer (class MoE
there: fp32 router logits, top-k of the logits then softmax over the k, the aux_loss load balancing with
--aux-coeff, dropless, tokens sorted by expert, the probability scaling the activation before fc2, unpermuted by
index_add), RoPE base --rotary-base without scaling, untied output layer, optional --kv-channels and
--qk-layernorm; defaults to Mixtral-8x7B's layers (4 of them). The experts' GEMMs: torch._grouped_mm where the
installed torch has it (each expert's rows padded to a multiple of --moe-align, 8: 16-byte TMA alignment of the
weight-gradient GEMM's ragged dimension), else (or with --experts loop) one GEMM per expert. torch.compile
compiles the whole model with grouped_mm (fixed shapes throughout); the per-expert loop reads the row counts back
to the host, so it runs outside the compiled graph (torch.compiler.disable) and the rest is compiled around it:
RESULT's "compile" says which. With grouped_mm on a GPU, the first MoE layer's output and gradients are first
compared eagerly against the loop on 512 random tokens (RESULT's "experts_check").
torch.compile, bf16 autocast, SDPA flash attention (GQA through enable_gqa, k/v not repeated; if flash refuses
the shapes, the first of efficient / cuDNN that takes them, printed), fused AdamW, gradient clipping, random
tokens (like train_gpt --mock-data).

Prints one line `RESULT {json}` with the median ms per iteration (CUDA events, after warm-up),
tokens/s and peak memory (max allocated and max
reserved by the caching allocator); "loss" is the last step's objective (with MoE layers: the cross entropy plus
their aux losses). Exit code 3 on out-of-memory, for the micro-batch search of dev/bench/speed_vs_torch.sh.
--device cpu runs a dry run in float32 on the CPU (no autocast, wall-clock timing, no memory figures; with
--compile off where torch has no torch.compile), e.g. at a tiny size to check the script.

  python dev/bench/torch_speed.py --num-layers 12 --hidden-size 768 --num-attention-heads 12 --mbs 8
  python dev/bench/torch_speed.py --model llama --mbs 4      # Llama-3.2-1B: 16 x 2048, 32 heads, 8 groups
  python dev/bench/torch_speed.py --model moe --mbs 1        # Mixtral-8x7B's layers: 4 x 4096, 8 experts, top-2
  python3 dev/bench/torch_speed.py --model moe --device cpu --compile off --num-layers 2 --hidden-size 64 \
      --num-attention-heads 4 --num-query-groups 2 --kv-channels 32 --qk-layernorm --num-experts 8 --topk 2 \
      --moe-ffn 32 --seq-length 32 --padded-vocab-size 256 --mbs 2 --iters 2 --warmup 1   # CPU dry run
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref_llama import Llama, MoE, MoESpec, experts_path  # noqa: E402
from ref_train_gpt2 import GPT  # noqa: E402

# per model: defaults of the shape flags left out, and the range of the random tokens
DEFAULTS = {
    "gpt": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=None, ffn_hidden_size=None,
                seq_length=1024, padded_vocab_size=50304, tokens=50257),
    "llama": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
                  seq_length=2048, padded_vocab_size=128256, tokens=128000),
    "moe": dict(num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                seq_length=4096, padded_vocab_size=32000, tokens=None),  # tokens None: the whole vocabulary
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


def check_experts(moe, dev, tokens=512):
    """One MoE layer's grouped path (torch._grouped_mm on the GPU; on the CPU, where torch has none, the same
    padding and offsets with its GEMM as a loop: ref_llama's "emulated") against the per-expert loop on the same
    weights: y and the gradients of the input and of every MoE weight for random inputs, eager (bf16 autocast on
    the GPU). Returns the worst max|grouped - loop| / max|loop| over those tensors. On the GPU both are bf16 GEMMs
    with fp32 accumulation and the same rounding points: they differ by bf16 roundings of the GEMMs' outputs
    (2^-8 of an element, compounding over fc1 -> fc2), ~1e-2 at most; rows of the wrong expert, token or
    probability give O(1)."""
    from dataclasses import replace
    h = moe.router.shape[1]
    with torch.device("meta") if hasattr(torch.device, "__enter__") else contextlib.nullcontext():
        sides = [MoE(h, replace(moe.spec, experts=e)) for e in
                 ("grouped_mm" if dev.type == "cuda" else "emulated", "loop")]  # their Parameters: moe's
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(1, tokens, h, device=dev, generator=gen)
    dy = torch.randn(1, tokens, h, device=dev, generator=gen)
    out = []
    for layer in sides:
        layer.router, layer.fc1, layer.fc2 = moe.router, moe.fc1, moe.fc2
        xi = x.clone().requires_grad_(True)
        for p in layer.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext():
            y, aux = layer(xi)
        ((y.float() * dy).sum() + aux).backward()
        out.append([y.detach().float(), xi.grad.float()] + [p.grad.float() for p in (layer.router, layer.fc1, layer.fc2)])
    for p in moe.parameters():
        p.grad = None
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["gpt", "llama", "moe"])
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--num-attention-heads", type=int)
    ap.add_argument("--num-query-groups", type=int, help="llama, moe: key/value heads (default 8)")
    ap.add_argument("--ffn-hidden-size", type=int, help="default: gpt 4 * hidden, llama 8192 (moe: unused)")
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--padded-vocab-size", type=int)
    ap.add_argument("--kv-channels", type=int, help="llama, moe: channels per attention head (default hidden / heads)")
    ap.add_argument("--qk-layernorm", action="store_true", help="llama, moe: RMSNorm on each query and key head")
    ap.add_argument("--rotary-base", type=float, help="moe: RoPE base, no scaling (default 1e6); llama: 500000 "
                    "with llama3 scaling, fixed")
    ap.add_argument("--num-experts", type=int, default=8, help="moe: experts per layer")
    ap.add_argument("--topk", type=int, default=2, help="moe: experts per token")
    ap.add_argument("--moe-ffn", type=int, default=14336, help="moe: each expert's ffn width (SwiGLU)")
    ap.add_argument("--aux-coeff", type=float, default=1e-2, help="moe: aux_loss coefficient")
    ap.add_argument("--experts", default="auto", choices=["auto", "grouped_mm", "loop"],
                    help="moe: the experts' GEMMs (auto: grouped_mm where torch has torch._grouped_mm, else loop)")
    ap.add_argument("--moe-align", type=int, default=8, help="moe, grouped_mm: rows per expert padded to a multiple "
                    "of this (1: no padding)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a float32 dry run")
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
    if a.model != "moe" and a.rotary_base is not None:
        sys.exit("torch_speed: --rotary-base is for --model moe (llama's RoPE is Llama-3's, fixed)")
    if a.compile == "on" and not hasattr(torch, "compile"):
        sys.exit(f"torch_speed: torch {torch.__version__} has no torch.compile: give --compile off")
    if a.model == "moe" and not (1 <= a.topk <= a.num_experts and a.moe_align >= 1):
        sys.exit("torch_speed: --topk must be in 1..--num-experts and --moe-align at least 1")
    if a.experts == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        sys.exit(f"torch_speed: torch {torch.__version__} has no torch._grouped_mm: give --experts loop (or auto)")

    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    torch.manual_seed(1234)
    L, h, n, S, V = a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.padded_vocab_size
    f = a.ffn_hidden_size or 4 * h
    g = a.num_query_groups or n
    d = a.kv_channels or h // n
    if a.model == "gpt" and (g != n or d != h // n or a.qk_layernorm):
        sys.exit("torch_speed: --num-query-groups, --kv-channels and --qk-layernorm are for --model llama and moe")
    backend = pick_sdpa_backend(a.mbs, n, g, S, d, dev) if cuda else None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the probe's tensors are not part of the run's peak memory
    spec = None
    if a.model == "gpt":
        model = GPT(L, h, n, f, V, S).to(dev)
    else:
        if a.model == "moe":
            spec = MoESpec(E=a.num_experts, k=a.topk, fe=a.moe_ffn, aux_coeff=a.aux_coeff, experts=a.experts,
                           align=a.moe_align, dtype=torch.bfloat16 if cuda else None)
            shape = dict(theta=a.rotary_base or 1e6, rope_scaling=None, untie=True, moe=spec)
        else:
            shape = {}
        with dev if cuda else contextlib.nullcontext():  # built and initialised on the GPU
            model = Llama(L, h, n, g, f, V, S, d=d, qk_layernorm=a.qk_layernorm, **shape)
    model.init_megatron(1234)
    nparams = sum(p.numel() for p in model.parameters())
    path = experts_path(spec) if spec else None
    print(f"model {a.model}: {nparams / 1e6:.1f}M parameters, sdpa backend {backend.name if backend else 'none'}"
          + (f", experts {path} (align {spec.align if path != 'loop' else 1})" if spec else ""), flush=True)
    experts_check = None
    if spec and (path == "grouped_mm" or not cuda):
        experts_check = check_experts(model.blocks[0].moe, dev)
        print(f"experts check: {'grouped_mm' if cuda else 'emulated grouped path'} vs loop on layer 0, 512 random "
              f"tokens: worst max|diff| / max {experts_check:.2e} ({'ok' if experts_check < 5e-2 else 'MISMATCH'})",
              flush=True)
        if experts_check >= 5e-2:
            sys.exit("torch_speed: the grouped experts do not compute what the per-expert loop does")
        experts_check = float(f"{experts_check:.3g}")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # the check's gradients are not part of the run's peak memory
    if a.float8 != "none":  # torchao: every nn.Linear of the blocks (the tied output layer is no nn.Linear)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(a.float8))
        n8 = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
        print(f"torchao float8 ({a.float8}): {n8} linears converted", flush=True)
    run = torch.compile(model) if a.compile == "on" else model
    compiled = a.compile if a.compile == "off" else (
        "on (the experts' loop outside the graph: data-dependent shapes)" if path == "loop" else "on (whole model)")
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if cuda else {}))
    params = list(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, min(a.tokens or V, V), (a.accum * a.mbs, S + 1), generator=gen).to(dev)

    def precision():
        if not cuda:
            return contextlib.nullcontext()  # float32 on the CPU
        from torch.nn.attention import sdpa_kernel
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        stack.enter_context(sdpa_kernel(backend))
        return stack

    def step():
        for m in range(a.accum):
            mb = tokens[m * a.mbs:(m + 1) * a.mbs]
            with precision():
                loss = run(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
            (loss / a.accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed():
        """One step's milliseconds: CUDA events on the GPU, the wall clock on the CPU."""
        if not cuda:
            t0 = time.perf_counter()
            loss = step()
            return (time.perf_counter() - t0) * 1e3, loss
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        loss = step()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1), loss

    def warm_up():
        """The warm-up steps (torch.compile compiles in the first). Where compiling fails (not for memory): once
        more with dynamo running the frames it cannot compile eagerly, then uncompiled; RESULT's "compile" says so."""
        nonlocal run, compiled
        for attempt in ("asked", "suppress_errors", "eager"):
            try:
                for _ in range(a.warmup):
                    step()
                return
            except Exception as e:  # noqa: BLE001 (whatever the compiler raises)
                if "out of memory" in str(e) or a.compile == "off" or attempt == "eager":
                    raise
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                print(f"torch.compile failed: {why}", file=sys.stderr, flush=True)
                opt.zero_grad(set_to_none=True)
                torch._dynamo.reset()
                if attempt == "asked":
                    torch._dynamo.config.suppress_errors = True
                    run, compiled = torch.compile(model), f"partly (what failed runs eagerly: {why})"
                else:
                    run, compiled = model, f"off (torch.compile failed: {why})"

    try:
        warm_up()
        if cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(a.iters):
            ms, loss = timed()
            times.append(ms)
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError (torch < 2.0 has no such class)
        if "out of memory" not in str(e):
            raise
        print(f"OOM at micro-batch {a.mbs}: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(3)
    times.sort()
    ms = times[len(times) // 2]
    free, total = torch.cuda.mem_get_info() if cuda else (0, 0)  # what the device reports in use
    if a.profile and cuda:
        profile_one_step(step)
    toks = a.accum * a.mbs * S
    gib = (lambda b: round(b / 2**30, 2)) if cuda else (lambda b: None)
    out = {
        "ms": round(ms, 2), "tokens_per_s": round(toks / (ms / 1e3)),
        "peak_allocated_gib": gib(torch.cuda.max_memory_allocated() if cuda else 0),
        "peak_reserved_gib": gib(torch.cuda.max_memory_reserved() if cuda else 0),
        "device_in_use_gib": gib(total - free),
        "loss": round(float(loss), 4), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "compile": compiled, "mbs": a.mbs, "accum": a.accum, "float8": a.float8, "model": a.model,
        "params": nparams,
    }
    if spec:
        out.update({"experts": path, "moe_align": spec.align if path != "loop" else 1, "experts_check": experts_check})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
