#!/usr/bin/env python3
"""
mcore_check.py: end-to-end check of prepro/convert_mcore.py against Megatron-Core's own GPTModel and
dist_checkpointing (megatron-core installed; it runs on the CPU, CUDA hidden from this process; the GPU,
where there is one, serves this project's tools: --hf-logits, --train-gpt).

    python dev/mcore_check.py [--keep DIR] [--checkpoint-tool prepro/checkpoint_tool]
                              [--hf-logits dev/hf_logits] [--train-gpt ./train_gpt]

Two small models, each flavour's switches all on, every tensor random (never zeros or ones):
  gpt2:  2 layers, hidden 64, 4 heads, ffn 256, vocab 250 padded to 256, 32 learned positions,
         LayerNorm with biases, GELU, tied output, fp32;
  llama: 2 layers, hidden 64, 4 heads in 2 query groups, kv channels 32 (attention width 128 != 64),
         ffn 96 SwiGLU, RMSNorm (eps 1e-6), rope (base 500000, Llama 3.1 scaling factor 8), untied,
         no biases, bf16 (the Megatron-Core model tensors are then bf16, the master weights fp32).
For each:
  1. a checkpoint of this project (header with progress words and a manifest; Adam m, v random) is
     written; `checkpoint_tool verify` (the C side) must accept it when the tool is built;
  2. --to-mcore (distributed optimizer, fully_reshardable) and then megatron-core builds GPTModel with the
     local layer spec and loads it with dist_checkpointing.load (strict: no missing key): its fp32 logits on
     random tokens must match dev/ref_gpt.py's float64 forward on the same weights (the master weights
     cast as the mcore tensors hold them) to a relative norm error < 1e-5 (fp32 accumulation over
     hidden 64 and 2 layers gives ~1e-7; a wrong layout or missed tensor gives O(1)); with --hf-logits
     (GPU machine), this project's own logits (dev/hf_logits) must match mcore's too: fp32 < 1e-5,
     bf16 < 3e-2;
  3. --from-mcore of that output must give back the original checkpoint byte for byte (file and manifest);
  4. a checkpoint that megatron-core writes itself: the GPTModel's own sharded_state_dict (with its
     _extra_state objects and, for SwiGLU, its fc1 factory), fp32 master weights and Adam moments under
     the distributed optimizer's keys built from the model's sharded tensors as Megatron-Core does
     (optimizer.state.{param,exp_avg,exp_avg_sq}.<key>), the model tensors = master cast to bf16, plus
     Megatron-LM's common state (args, iteration, scheduler, param groups with step) and
     content_metadata; then --from-mcore -> ours -> --to-mcore must reproduce every tensor bitwise
     and the iteration, scheduler steps, Adam step, consumed samples; the same with --optimizer plain
     (fp32_param keys) and weights only (master = model tensors, moments zero);
  5. megatron-core at tensor-parallel size 2 (two gloo processes on the CPU, llama): the checkpoint its
     TP 2 model writes (each rank its shards; SwiGLU's fc1 as its factory splits it) converted here gives
     ref_gpt the TP 2 model's logits, and our checkpoint converted and loaded at TP 2 gives ref_gpt's
     (both < 1e-5): the torch_dist side is layout-free;
  6. with --train-gpt (GPU machine): ./train_gpt --load <the mcore-written checkpoint converted here>
     resumes for 2 more iterations on mock data and saves (its log must say so); the checkpoint it
     saved goes to torch_dist and back byte-identical, and megatron-core's logits on it equal
     ref_gpt's (and, with --hf-logits, the trainer's own);
  7. refusals, each one line and exit 1: a damaged checkpoint (its manifest fails; the integrity rule on
     the host: dev/mcore_integrity_check.py), a TP 2 checkpoint, a torch_dist checkpoint whose distributed
     optimizer is in dp_reshardable form, a truncated model_optim_rng.bin.
Prints one table and exits non-zero if any row failed.
"""
import argparse
import dataclasses
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

# megatron-core runs on the CPU here, the same path with or without a GPU (its checkpoint save and load
# assume CUDA in places, which prepro/convert_mcore.py redirects when torch sees no GPU); the GPU is
# for this project's tools (--hf-logits, --train-gpt), run as subprocesses with the devices given back
GPU_ENV = dict(os.environ)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "prepro"))
import torch  # noqa: E402
import ref_gpt  # noqa: E402  (sets float64 as torch's default; put back below)
import convert_mcore as cm  # noqa: E402

torch.set_default_dtype(torch.float32)
W = cm.W

ROWS = []


def row(name, ok, detail=""):
    ROWS.append((name, "PASS" if ok else "FAIL", detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


FLAVOURS = {
    "gpt2": dict(ref=ref_gpt.Config(L=2, h=64, n=4, f=256, Vp=256, T=32, P=32, seed=11), precision=0,
                 true_vocab=250, norm_eps=1e-5),
    "llama": dict(ref=ref_gpt.Config(flavor="llama", L=2, h=64, n=4, g=2, kv=32, f=96, Vp=256, T=32, P=64,
                                     seed=12, rotary_base=500000.0, rope_scaling_factor=8.0, norm_eps=1e-6),
                  precision=1, true_vocab=256, norm_eps=1e-6),
}


def header_for(cfg, precision, true_vocab, norm_eps):
    h = [0] * cm.HEADER_WORDS
    vals = dict(MAGIC=cm.CK_MAGIC, VERSION=cm.CK_VERSION, LAYERS=cfg.L, HIDDEN=cfg.h, HEADS=cfg.n, GROUPS=cfg.g,
                KV=cfg.d, FFN=cfg.f, VOCAB=cfg.Vp, POSITIONS=cfg.P, NUM_PARAMS=ref_gpt.num_params(cfg),
                PRECISION=precision, ITERATION=100, CONSUMED=800, SCHED_STEPS=800, ADAM_STEP=100, SEED=1234,
                GROWTH=0, HYSTERESIS=2, LOSS_SCALE_BITS=cm.f64_bits(1.0), TP=1, PP=1,
                NORMALIZATION=0 if cfg.norm == "layernorm" else 1, SWIGLU=int(cfg.swiglu),
                POSITION_TYPE={"learned": 0, "rope": 1, "none": 2}[cfg.position], UNTIED=int(cfg.untied),
                NO_BIAS_LINEAR=int(not cfg.bias), NORM_EPS_BITS=cm.f64_bits(norm_eps), TRUE_VOCAB=true_vocab,
                LAYERNORM_1P=int(cfg.layernorm_1p))
    if cfg.position == "rope":
        vals.update(ROTARY_BASE_BITS=cm.f64_bits(cfg.rotary_base), ROTARY_PERCENT_BITS=cm.f64_bits(cfg.rotary_percent),
                    ROPE_SCALING_FACTOR_BITS=cm.f64_bits(cfg.rope_scaling_factor))
    for k, v in vals.items():
        h[W[k]] = v
    return h


def make_ours(path, fl):
    cfg = fl["ref"]
    h = header_for(cfg, fl["precision"], fl["true_vocab"], fl["norm_eps"])
    m = cm.model_of_header(h)
    layout = cm.param_layout(m)
    p = ref_gpt.init_params(cfg)
    rng = np.random.default_rng(cfg.seed + 100)
    master = {name: p[name].numpy().astype(np.float32) for name, _, _ in layout}
    adam_m = {name: rng.normal(0, 1e-3, s).astype(np.float32) for name, _, s in layout}
    adam_v = {name: rng.uniform(1e-8, 1e-5, s).astype(np.float32) for name, _, s in layout}
    cm.write_ours(path, h, layout, master, adam_m, adam_v)
    return h, master


def file_bytes(ckpt):
    it = cm.read_tracker(ckpt)
    d = os.path.join(ckpt, f"iter_{it:07d}")
    return open(os.path.join(d, "mp_rank_00", "model_optim_rng.bin"), "rb").read(), \
        open(os.path.join(d, "manifest.txt"), "rb").read()


def build_gpt(m, dtype, parallel_output=True):
    """Megatron-Core's GPTModel with the local layer spec for the model described by m (args names)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    gelu_tanh = lambda x: F.gelu(x, approximate="tanh")   # Megatron's GPT-2 runs bias-gelu / TE's tanh form
    tc = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.kv_channels, ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization, layernorm_epsilon=m.norm_epsilon, gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else gelu_tanh, add_bias_linear=m.add_bias_linear,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    return GPTModel(
        tc, get_gpt_layer_local_spec(normalization=m.normalization), vocab_size=m.padded_vocab_size,
        max_sequence_length=m.max_position_embeddings, position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent, rotary_base=int(m.rotary_base), rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        parallel_output=parallel_output)


def mcore_logits(model, tokens, device):
    model = model.to(device).eval()
    t = torch.from_numpy(tokens).to(device)
    pos = torch.arange(t.shape[1], device=device).unsqueeze(0).expand_as(t)
    T = t.shape[1]   # the causal mask given (True: masked), as Megatron's data path makes it
    mask = torch.triu(torch.ones(T, T, device=device), diagonal=1).bool()[None, None]
    with torch.no_grad():
        out = model(t, pos, attention_mask=mask)
    return out.float().cpu().numpy().astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_logits(name, fl, ours, mc, work, device, hf_logits):
    from megatron.core import dist_checkpointing
    h, m, layout, (master, _, _) = cm.read_ours(ours)
    model = build_gpt(m, torch.float32)
    d = os.path.join(mc, f"iter_{cm.read_tracker(mc):07d}")
    # "unexpected" = asked for by the model, absent from the checkpoint (what a load refuses)
    _, _, unexpected = dist_checkpointing.load({"model": model.sharded_state_dict()}, d, strict="return_all")
    try:   # as Megatron-LM's load_checkpoint asks (its default strictness), then a strict load_state_dict
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, d)
        model.load_state_dict(loaded["model"])
        error = ""
    except Exception as e:  # noqa: BLE001 (the row says what failed)
        error = " ".join(str(e).split())[:300]
    row(f"{name}: mcore GPTModel loads the converted checkpoint (default strictness, strict load_state_dict)",
        not unexpected and not error, error or f"{len(model.state_dict())} entries, unexpected {sorted(unexpected)[:3]}")
    cfg = fl["ref"]
    model_dtype = torch.bfloat16 if fl["precision"] == 1 else torch.float32
    p = {n: torch.from_numpy(master[n]).to(model_dtype).to(torch.float64) for n, _, _ in layout}
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, fl["true_vocab"], (2, cfg.T)).astype(np.int64)
    ref = ref_gpt.forward(cfg, p, torch.from_numpy(tokens)).numpy()
    got = mcore_logits(model, tokens, device)
    e = rel(got, ref)
    row(f"{name}: mcore fp32 logits = ref_gpt float64 logits", e < 1e-5, f"rel err {e:.2e} ({device})")
    if hf_logits:
        tok = os.path.join(work, f"{name}_tokens.bin")
        with open(tok, "wb") as f:
            f.write(struct.pack("<2i", *tokens.shape) + tokens.astype("<i4").tobytes())
        out = os.path.join(work, f"{name}_logits.bin")
        # a bf16 checkpoint's model tensors (what mcore loads) are its fp32 master rounded to bf16:
        # fp32 compute on those same weights (hf_logits --bf16-weights)
        same_weights = ["--bf16-weights"] if fl["precision"] == 1 else []
        r = subprocess.run([hf_logits, ours, tok, out] + same_weights, capture_output=True, text=True, env=GPU_ENV)
        if r.returncode != 0:
            row(f"{name}: megatron.c logits (hf_logits)", False, r.stderr.strip()[-200:])
        else:
            raw = open(out, "rb").read()
            B, T, V = struct.unpack("<3i", raw[:12])
            mine = np.frombuffer(raw[12:], "<f4").reshape(B, T, V).astype(np.float64)
            e2 = rel(mine, got)
            row(f"{name}: megatron.c fp32 logits (GPU) = mcore logits", e2 < 1e-5, f"rel err {e2:.2e}")
            r = subprocess.run([hf_logits, ours, tok, out, "--bf16"], capture_output=True, text=True, env=GPU_ENV)
            raw = open(out, "rb").read() if r.returncode == 0 else b""
            e3 = rel(np.frombuffer(raw[12:], "<f4").reshape(B, T, V).astype(np.float64), got) if raw else 1.0
            # bf16 activations (8 significant bits) through 2 layers: ~1e-2 (dev/hf_check.py's bound)
            row(f"{name}: megatron.c bf16 logits (GPU) = mcore fp32 logits within bf16 tolerance", e3 < 3e-2,
                f"rel err {e3:.2e}" if raw else r.stderr.strip()[-200:])


def mcore_written(name, fl, path, optimizer):
    """A checkpoint that megatron-core writes itself, as Megatron-LM's save_checkpoint lays it out."""
    from megatron.core import dist_checkpointing
    cfg = fl["ref"]
    h = header_for(cfg, fl["precision"], fl["true_vocab"], fl["norm_eps"])
    m = cm.model_of_header(h)
    model = build_gpt(m, torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed + 5)
    masters = {}
    with torch.no_grad():
        for k, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=gen) * 0.01)   # norms off 1, biases off 0
                masters[k] = t.detach().clone()
    model_dtype = torch.bfloat16 if fl["precision"] == 1 else torch.float32
    model = model.to(model_dtype)
    msd = model.sharded_state_dict()
    sd = {"model": msd, "iteration": 300, "checkpoint_version": 3.0,
          "args": argparse.Namespace(**vars(m), group_query_attention=True, seed=4321, consumed_train_samples=2400,
                                     bf16=fl["precision"] == 1, fp16=False, vocab_size=fl["true_vocab"],
                                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
          "opt_param_scheduler": {"max_lr": 1e-3, "lr_warmup_steps": 80, "num_steps": 2400, "lr_decay_style": "cosine",
                                  "lr_decay_steps": 8000, "min_lr": 1e-4, "start_wd": 0.1, "end_wd": 0.1,
                                  "wd_incr_style": "constant", "wd_incr_steps": 0}}
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer != "none":
        state_keys = ("param" if optimizer == "distributed" else "fp32_param", "exp_avg", "exp_avg_sq")
        param_state = {}
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        for sd_key, sh in msd.items():
            if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                continue
            for s in state_keys:
                if s in ("param", "fp32_param"):
                    data = masters[sd_key].float()
                elif s == "exp_avg":
                    data = torch.randn(sh.data.shape, generator=gen) * 1e-3
                else:
                    data = torch.rand(sh.data.shape, generator=gen) * 1e-5 + 1e-8
                kw = dict(key=f"optimizer.state.{s}.{sh.key}", data=data)
                if isinstance(sh, ShardedTensor): kw["dtype"] = data.dtype
                param_state[f"{s}.{sd_key}"] = dataclasses.replace(sh, **kw)
        sd["optimizer"] = {"optimizer": {"param_groups": [{"lr": 1e-3, "weight_decay": 0.1, "step": 300},
                                                          {"lr": 1e-3, "weight_decay": 0.0, "step": 300}]},
                           "param_state": param_state}
        if optimizer == "distributed":
            sd["optimizer"]["param_state_sharding_type"] = "fully_reshardable"
            content["distrib_optim_sharding_type"] = "fully_reshardable"
    d = os.path.join(path, "iter_0000300")
    os.makedirs(d)
    dist_checkpointing.save(sd, d, content_metadata=content)
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("300")
    return d


def all_tensors(d):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    meta = dist_checkpointing.load_tensors_metadata(d)
    req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(v.global_shape), dtype=v.dtype), replica_id=0)
           for k, v in meta.items() if not k.endswith("_extra_state") and k != "common_state"
           and hasattr(v, "global_shape") and v.dtype is not None and "rng" not in k}
    return dist_checkpointing.load(req, d)


def check_mcore_round_trip(name, fl, work, optimizer):
    from megatron.core import dist_checkpointing
    src = os.path.join(work, f"{name}_mcore_written_{optimizer}")
    d = mcore_written(name, fl, src, optimizer)
    ours = os.path.join(work, f"{name}_from_mcore_{optimizer}")
    back = os.path.join(work, f"{name}_back_to_mcore_{optimizer}")
    rc1 = cm.main(["--from-mcore", src, ours])
    rc2 = cm.main(["--to-mcore", ours, back, "--optimizer", optimizer])
    if rc1 or rc2:
        return row(f"{name} ({optimizer}): mcore -> ours -> mcore", False, f"exit {rc1}, {rc2}")
    a, b = all_tensors(d), all_tensors(os.path.join(back, "iter_0000300"))
    a = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    b = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    want = set(a)
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    same = want == set(b) and all(a[k].dtype == b[k].dtype for k in want)
    bits = same and all(torch.equal(a[k].contiguous().view(ints[a[k].dtype]), b[k].contiguous().view(ints[b[k].dtype]))
                        for k in want)
    c1 = dist_checkpointing.load_common_state_dict(d)
    c2 = dist_checkpointing.load_common_state_dict(os.path.join(back, "iter_0000300"))
    scalars = (c1["iteration"], c1["args"].consumed_train_samples, c1["args"].seed)
    scalars2 = (c2["iteration"], c2["args"].consumed_train_samples, c2["args"].seed)
    if optimizer != "none":   # Megatron saves the scheduler with the optimizer (not with --no-save-optim)
        scalars += (c1["opt_param_scheduler"]["num_steps"], c1["optimizer"]["optimizer"]["param_groups"][0]["step"],)
        scalars2 += (c2["opt_param_scheduler"]["num_steps"],)
        scalars2 += (c2["optimizer"]["optimizer"]["param_groups"][0]["step"],)
    row(f"{name} ({optimizer}): mcore-written -> ours -> mcore, every tensor bitwise", same and bits,
        f"{len(want)} tensors ({', '.join(sorted({str(t.dtype).replace('torch.', '') for t in a.values()}))})")
    row(f"{name} ({optimizer}): iteration, consumed samples, scheduler steps, seed, Adam step kept",
        scalars == scalars2 and (optimizer == "none" or scalars2[-1] == 300), f"{scalars2}")
    return ours


def dp_reshardable(src, dst):
    """src's model and args with the distributed optimizer's state in its default bucket-space form."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    loaded = all_tensors(os.path.join(src, "iter_0000100"))
    common = dist_checkpointing.load_common_state_dict(os.path.join(src, "iter_0000100"))
    model = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in loaded.items()
             if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
    state = {"param": ShardedTensor.from_rank_offsets(f"{bucket}.param", torch.ones(1024), replica_id=0)}
    d = os.path.join(dst, "iter_0000100")
    os.makedirs(d)
    dist_checkpointing.save({"args": common["args"], "iteration": 100, "model": model,
                             "optimizer": {"param_state": state, "param_state_sharding_type": "dp_reshardable"}},
                            d, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("100")


def tp2_worker(rank, work, mode, ckpt, store):
    """One of two gloo processes holding megatron-core's llama GPTModel at tensor-parallel size 2 (CPU):
    mode "save" perturbs the model's own initial weights and saves them with megatron-core (each rank
    its shards); mode "load" loads ckpt. Either way rank 0 writes the model's full-vocabulary logits."""
    import contextlib
    import zlib
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cm.mcore()   # the CPU redirections (the group exists)
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(2, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    fl = FLAVOURS["llama"]
    m = cm.model_of_header(header_for(fl["ref"], fl["precision"], fl["true_vocab"], fl["norm_eps"]))
    model = build_gpt(m, torch.float32, parallel_output=False)
    if mode == "save":
        with torch.no_grad():
            for k, t in model.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    split = getattr(t, "tensor_model_parallel", False)   # replicated ones alike on both ranks
                    gen = torch.Generator().manual_seed(zlib.crc32(k.encode()) + (rank if split else 0))
                    t.add_(torch.randn(t.shape, generator=gen) * 0.01)
        args = argparse.Namespace(**vars(m), group_query_attention=True, seed=99, consumed_train_samples=16,
                                  bf16=False, fp16=False, vocab_size=fl["true_vocab"],
                                  tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        d = os.path.join(ckpt, "iter_0000007")
        os.makedirs(d, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 7}, d)
        if rank == 0:
            with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
    else:
        d = os.path.join(ckpt, f"iter_{cm.read_tracker(ckpt):07d}")
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, d)["model"])
    tokens = np.random.default_rng(7).integers(0, fl["true_vocab"], (2, fl["ref"].T)).astype(np.int64)
    logits = mcore_logits(model, tokens, "cpu")
    if rank == 0:
        np.save(os.path.join(work, f"tp2_{mode}_logits.npy"), logits)
    dist.barrier()
    dist.destroy_process_group()


def check_tp2(work):
    """Megatron-Core at TP 2 (two CPU processes): its own checkpoint converted here gives ref_gpt the
    same logits; our checkpoint converted and loaded at TP 2 gives the same logits as ref_gpt."""
    import torch.multiprocessing as mp
    fl, cfg = FLAVOURS["llama"], FLAVOURS["llama"]["ref"]
    tokens = np.random.default_rng(7).integers(0, fl["true_vocab"], (2, cfg.T)).astype(np.int64)
    for mode, ckpt in (("save", os.path.join(work, "llama_tp2_written")), ("load", os.path.join(work, "llama_mcore"))):
        store = os.path.join(work, f"tp2_{mode}_store")
        mp.spawn(tp2_worker, args=(work, mode, ckpt, store), nprocs=2, join=True)
        ours = os.path.join(work, "llama_from_tp2") if mode == "save" else os.path.join(work, "llama_ours")
        if mode == "save" and cm.main(["--from-mcore", ckpt, ours]) != 0:
            return row("llama TP 2: --from-mcore", False)
        h, m, layout, (master, _, _) = cm.read_ours(ours)
        dtype = torch.bfloat16 if h[W["PRECISION"]] == 1 else torch.float32
        p = {n: torch.from_numpy(master[n]).to(dtype).to(torch.float64) for n, _, _ in layout}
        ref = ref_gpt.forward(cfg, p, torch.from_numpy(tokens)).numpy()
        e = rel(np.load(os.path.join(work, f"tp2_{mode}_logits.npy")), ref)
        what = ("megatron-core at TP 2 writes, --from-mcore: ref_gpt's logits on ours = the TP 2 model's" if mode == "save"
                else "ours --to-mcore, loaded by megatron-core at TP 2: its logits = ref_gpt's")
        row(f"llama: {what}", e < 1e-5, f"rel err {e:.2e}")


def expect_refusal(what, argv, needle):
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cm.main(argv)
    text = err.getvalue().strip()
    row(f"refused: {what}", rc == 1 and needle in text and text.count("\n") == 0, text[:150])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--keep", help="work in this directory and keep it")
    ap.add_argument("--checkpoint-tool", default=os.path.join(ROOT, "prepro", "checkpoint_tool"))
    ap.add_argument("--hf-logits", help="dev/hf_logits (GPU machine): compare this project's own logits")
    ap.add_argument("--train-gpt", help="./train_gpt (GPU machine): resume from a converted mcore checkpoint")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="mcore_check_")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    cm.mcore()   # gloo group
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    import megatron.core
    # attention forks the CUDA RNG tracker for dropout (0 here, so no random number is drawn)
    import contextlib
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, work {work}")
    for name, fl in FLAVOURS.items():
        ours = os.path.join(work, f"{name}_ours")
        make_ours(ours, fl)
        if os.path.exists(args.checkpoint_tool):
            r = subprocess.run([args.checkpoint_tool, "verify", ours], capture_output=True, text=True)
            row(f"{name}: checkpoint_tool verify accepts the Python-written checkpoint", r.returncode == 0,
                (r.stdout + r.stderr).strip().splitlines()[-1][:120] if (r.stdout + r.stderr).strip() else "")
        mc = os.path.join(work, f"{name}_mcore")
        rc = cm.main(["--to-mcore", ours, mc, "--lr", "1e-3"])
        row(f"{name}: --to-mcore", rc == 0, ", ".join(sorted(os.listdir(os.path.join(mc, "iter_0000100")))))
        check_logits(name, fl, ours, mc, work, "cpu", args.hf_logits)
        again = os.path.join(work, f"{name}_again")
        rc = cm.main(["--from-mcore", mc, again])
        same = rc == 0 and file_bytes(again) == file_bytes(ours)
        row(f"{name}: ours -> mcore -> ours is byte-identical (file and manifest)", same,
            f"{len(file_bytes(ours)[0])} bytes")
        for optimizer in ("distributed", "plain", "none"):
            conv = check_mcore_round_trip(name, fl, work, optimizer)
        if args.train_gpt and conv:
            resumed = resume(name, fl, os.path.join(work, f"{name}_from_mcore_distributed"), args.train_gpt, work)
            if resumed:   # a checkpoint the trainer wrote: both ways bitwise, and its logits in megatron-core
                mc_t, back = os.path.join(work, f"{name}_trained_mcore"), os.path.join(work, f"{name}_trained_back")
                ok = cm.main(["--to-mcore", resumed, mc_t]) == 0 and cm.main(["--from-mcore", mc_t, back]) == 0
                row(f"{name}: train_gpt's own checkpoint -> mcore -> ours is byte-identical",
                    ok and file_bytes(back) == file_bytes(resumed))
                if ok:
                    check_logits(f"{name} (train_gpt's checkpoint)", fl, resumed, mc_t, work, "cpu", args.hf_logits)
    check_tp2(work)
    # refusals
    tp2 = os.path.join(work, "gpt2_tp2")
    shutil.copytree(os.path.join(work, "gpt2_ours"), tp2)
    f = os.path.join(tp2, "iter_0000100", "mp_rank_00", "model_optim_rng.bin")
    with open(f, "r+b") as fh:
        fh.seek(8 * W["TP"])
        fh.write(struct.pack("<q", 2))
    expect_refusal("a TP 2 checkpoint whose manifest no longer matches", ["--to-mcore", tp2, os.path.join(work, "x0")],
                   "model_optim_rng.bin is corrupted")
    size, crc = cm.crc32c_file(f)   # the manifest made to match: the layout check is what refuses it then
    with open(os.path.join(tp2, "iter_0000100", "manifest.txt"), "w") as fh:
        fh.write(f"{cm.MANIFEST_HEAD}\nfiles 1\n{crc:08x} {size} mp_rank_00/model_optim_rng.bin\n")
    expect_refusal("a TP 2 checkpoint", ["--to-mcore", tp2, os.path.join(work, "x1")], "checkpoint_tool reshard")
    trunc = os.path.join(work, "gpt2_trunc")
    shutil.copytree(os.path.join(work, "gpt2_ours"), trunc)
    f = os.path.join(trunc, "iter_0000100", "mp_rank_00", "model_optim_rng.bin")
    os.truncate(f, os.path.getsize(f) - 4)
    expect_refusal("a truncated model_optim_rng.bin", ["--to-mcore", trunc, os.path.join(work, "x2")], "bytes")
    dpr = os.path.join(work, "gpt2_dp_reshardable")
    dp_reshardable(os.path.join(work, "gpt2_mcore"), dpr)
    expect_refusal("a dp_reshardable distributed optimizer", ["--from-mcore", dpr, os.path.join(work, "x3")],
                   "fully-reshardable")
    failed = sum(1 for _, s, _ in ROWS if s == "FAIL")
    print(f"\n{len(ROWS) - failed} passed, {failed} failed")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def resume(name, fl, ckpt, train_gpt, work):
    """./train_gpt --load CKPT (converted from a megatron-core-written checkpoint) for 2 iterations."""
    h, m, _, _ = cm.read_ours(ckpt)
    flags = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--num-attention-heads",
             m.num_attention_heads, "--ffn-hidden-size", m.ffn_hidden_size, "--seq-length", 32,
             "--max-position-embeddings", m.max_position_embeddings, "--micro-batch-size", 2,
             "--global-batch-size", 8, "--train-iters", h[W["ITERATION"]] + 2, "--lr", "1e-3",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 200, "--make-vocab-size-divisible-by", 128,
             "--load", ckpt, "--save", os.path.join(work, f"{name}_resumed"), "--eval-iters", 0,
             "--log-interval", 1, "--norm-epsilon", m.norm_epsilon]
    if fl["precision"] == 1: flags += ["--bf16"]
    if m.normalization == "RMSNorm":
        flags += ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                  "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
                  "--num-query-groups", m.num_query_groups, "--kv-channels", m.kv_channels,
                  "--rotary-base", int(m.rotary_base), "--use-rope-scaling", "--rope-scaling-factor",
                  m.rope_scaling_factor]
    r = subprocess.run([train_gpt] + [str(x) for x in flags], capture_output=True, text=True, env=GPU_ENV)
    log = r.stdout + r.stderr
    with open(os.path.join(work, f"{name}_resume.log"), "w") as f:
        f.write(" ".join([train_gpt] + [str(x) for x in flags]) + "\n" + log)
    done = f"saved checkpoint at iteration {h[W['ITERATION']] + 2} "
    lines = [l for l in log.splitlines() if " iteration " in l or "loaded" in l.lower() or "error" in l.lower()]
    ok = r.returncode == 0 and done in log
    row(f"{name}: train_gpt resumes from the converted mcore checkpoint (2 iterations)", ok,
        " | ".join(lines[-3:])[:300])
    return os.path.join(work, f"{name}_resumed") if ok else None


if __name__ == "__main__":
    sys.exit(main())
