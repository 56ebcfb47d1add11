"""dev/bench/attention_sdpa.py — PyTorch's causal attention, forward and backward timed separately, for the same
shapes as `dev/cuda/flash_attention --bench B,H,Hkv,T,d` (dev/bench/cp_bench.sh runs both and prints them side by
side).

torch.nn.functional.scaled_dot_product_attention, bf16, is_causal=True, with only the FlashAttention backend
enabled (sdpa_kernel(SDPBackend.FLASH_ATTENTION)); grouped-query attention through enable_gqa=True (K and V not
repeated) where the installed torch takes it, else with K and V repeated to H heads (repeat_interleave, outside the
timed region; the line says "gqa=repeat"). Inputs: q [B, H, T, d], k and v [B, Hkv, T, d], uniform values of the
lab's ranges (|q|, |k| < 1.7, |v|, |dO| < 1), requires_grad. Forward: one SDPA call with autograd recording (it
keeps the log-sum-exp for the backward, as train_gpt's forward does); backward: torch.autograd.grad of that output
against q, k, v with a fixed dO (each timed backward follows an untimed forward). CUDA events around each call,
WARMUP calls first, the median of --reps.

FLOPs, the lab's causal count (FlashAttention's convention): forward 2*B*H*T^2*d (two T x T x d products, half of
them masked), backward 2.5x the forward.

Prints one line `BENCH side=torch ... fwd_ms=... fwd_tflops=... bwd_ms=... bwd_tflops=... fwdbwd_tflops=...` per
--bench shape (the lab's fields), after one `torch ...` line naming the version and the GPU. Exit 1 when flash
refuses a shape or the GPU is out of memory (the line says why), 2 on a usage error.

  python3 dev/bench/attention_sdpa.py --bench 1,32,8,32768,128 --bench 1,32,8,131072,128
"""
import argparse
import statistics
import sys

WARMUP = 2


def parse_shape(spec):
    try:
        B, H, Hkv, T, d = (int(x) for x in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bench wants B,H,Hkv,T,d, not '{spec}'")
    if not (1 <= B <= 1024 and 1 <= Hkv <= H <= 1024 and H % Hkv == 0 and 1 <= T <= (1 << 22) and d in (64, 128)):
        raise argparse.ArgumentTypeError(f"--bench {spec}: H a multiple of Hkv, d 64 or 128, T in 1..4194304")
    return B, H, Hkv, T, d


def timed(fn, reps):
    """median ms of reps calls of fn (each bracketed by CUDA events) after WARMUP untimed ones; fn may do untimed
    set-up by returning a callable to time"""
    import torch
    times = []
    for i in range(WARMUP + reps):
        work = fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        work()
        b.record()
        b.synchronize()
        if i >= WARMUP:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench(shape, reps):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, Hkv, T, d = shape
    dev = "cuda"

    def uniform(n, amp):  # +-[0.02, amp), never zero, as the lab's inputs
        mag = 0.02 + (amp - 0.02) * torch.rand(B, n, T, d, device=dev)
        return torch.where(torch.rand_like(mag) < 0.5, -mag, mag).to(torch.bfloat16)

    q, k, v, dout = uniform(H, 1.7), uniform(Hkv, 1.7), uniform(Hkv, 1.0), uniform(H, 1.0)
    gqa = "native" if Hkv == H else "enable_gqa"
    if Hkv != H:
        try:  # enable_gqa needs torch >= 2.5 and a flash build that takes it
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                probe = [t[:, :, :256].clone().requires_grad_() for t in (q, k, v)]
                F.scaled_dot_product_attention(*probe, is_causal=True, enable_gqa=True).sum().backward()
            torch.cuda.synchronize()
        except (TypeError, RuntimeError) as e:
            print(f"attention_sdpa: flash with enable_gqa refused ({str(e).splitlines()[0]}); K and V repeated",
                  file=sys.stderr)
            gqa = "repeat"
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = {"enable_gqa": True} if gqa == "enable_gqa" else {}

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def fwd():
            return attend

        def bwd():
            out = attend()
            return lambda: torch.autograd.grad(out, (q, k, v), dout)

        f_ms = timed(fwd, reps)
        b_ms = timed(bwd, reps)
    fwd_flop = 2.0 * 2.0 * B * H * T * T * d / 2.0
    bwd_flop = 2.5 * fwd_flop
    print(f"BENCH side=torch B={B} H={H} Hkv={Hkv} T={T} d={d} causal bf16 backend=FLASH_ATTENTION gqa={gqa} "
          f"fwd_ms={f_ms:.3f} fwd_tflops={fwd_flop / f_ms * 1e-9:.1f} bwd_ms={b_ms:.3f} "
          f"bwd_tflops={bwd_flop / b_ms * 1e-9:.1f} fwdbwd_tflops={(fwd_flop + bwd_flop) / (f_ms + b_ms) * 1e-9:.1f}",
          flush=True)
    del q, k, v, dout
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", type=parse_shape, action="append", required=True, metavar="B,H,Hkv,T,d")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per direction (median; default 7)")
    args = ap.parse_args()
    if not 1 <= args.reps <= 1000:
        ap.error("--reps must be in 1..1000")
    try:
        import torch
    except ImportError:
        print("attention_sdpa: torch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("attention_sdpa: no CUDA GPU visible", file=sys.stderr)
        return 1
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401 (torch >= 2.3)
    except ImportError:
        print(f"attention_sdpa: torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs >= 2.3)",
              file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rc = 0
    for shape in args.bench:
        try:
            bench(shape, args.reps)
        except torch.cuda.OutOfMemoryError as e:
            print(f"attention_sdpa: {shape}: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
            rc = 1
        except RuntimeError as e:
            print(f"attention_sdpa: {shape}: flash refused: {str(e).splitlines()[0]}", file=sys.stderr)
            rc = 1
        torch.cuda.empty_cache()
    return rc


if __name__ == "__main__":
    sys.exit(main())
