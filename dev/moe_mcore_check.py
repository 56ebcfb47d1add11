#!/usr/bin/env python3
"""
moe_mcore_check.py: dev/ref_moe.py against Megatron-Core's own MoE code (megatron-core installed; CPU only).

    python3.12 -m venv /tmp/mcore && /tmp/mcore/bin/pip install megatron-core==0.19.2 torch==2.6.0 numpy
    /tmp/mcore/bin/python dev/moe_mcore_check.py

Pinned: megatron-core 0.19.2 (the newest on PyPI, Python >= 3.12; its moe/ router, moe_utils and the
MLP/SequentialMLP/allgather-dispatcher paths used here compute what Megatron-LM d98e8a64's do: the
differences are batch-invariant mode, TE-only paths and comments) and PyPI's torch 2.6.0 run on the CPU (CUDA
hidden; torch.cuda.current_device, which the router calls for its buffers, answers "cpu"), one gloo process,
tensor/expert/pipeline parallel size 1.

For every configuration of ref_moe.CONFIGS:
  1. Megatron's pure functions (moe_utils) on random router logits [64, E] against ref_moe's: top-k routing
     with the score function (softmax, pre-softmax, sigmoid, expert bias, group-limited, scaling), the
     aux-loss scores and map, switch_load_balancing_loss_func (value and gradient), z_loss_func,
     get_capacity (a grid of token counts and factors), apply_router_token_dropping, permute / unpermute
     (dropless, dropping, padded to capacity), get_updated_expert_bias (through a gloo all-reduce);
  2. Megatron's whole MoELayer (TopKRouter with --moe-router-dtype fp64, SequentialMLP of local MLPs, the
     allgather dispatcher, SharedExpertMLP; float64 parameters) holding ref_moe's initial weights, on two
     micro-batches of random hidden states (the second sees the first's global-aux-loss counts), training mode,
     backward of sum(out * R) with the aux losses through MoEAuxLossAutoScaler (scale 1 = one micro-batch's
     share): the outputs, the input and every parameter gradient, the logged loss values, the tokens per expert
     the expert-bias update counts, and the updated bias.
Tolerances: Megatron computes softmax and sigmoid in float32 whatever the router dtype (torch.softmax(...,
dtype=float32), sigmoid(logits.float())), so probabilities and everything downstream agree to float32
rounding: relative 1e-6 (per tensor, max |a - b| / max |b|); integer results (maps, indices, counts,
capacities) and the bias update must be equal. One deliberate substitution: torch.topk's order among equal
values is unspecified and the CPU's differs from CUDA's (CUDA's gather-top-k takes equal values in index
order); apply_router_token_dropping's "position" policy picks among tied 1s with it, so while it runs
torch.topk is replaced by a stable one (ties in ascending index: the first tokens kept, Megatron's documented
"tokens at the end of the batch are dropped"); and with biases, the local RowParallelLinear's output at TP 1
(a view that autograd will not let MLP add the probability-scaled bias to in place; Transformer Engine's
linear, which GPU runs use, returns a fresh tensor) is cloned by a forward hook. Everything else is
Megatron-Core's code, unmodified.
Prints one line per comparison (max difference) and exits non-zero on any mismatch.
"""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.cuda.current_device = lambda: "cpu"          # the router allocates its buffers there
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_moe as R  # noqa: E402  (sets the default dtype to float64)

RESULTS = []


def report(what, diff, tol):
    ok = bool(diff <= tol)
    RESULTS.append(ok)
    print(f"  [{'ok' if ok else 'FAIL'}] {what}: max diff {diff:.2e} (tolerance {tol:.0e})")


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30)) if b.numel() else 0.0


def same(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return 0.0 if a.shape == b.shape and torch.equal(a.to(torch.int64), b.to(torch.int64)) else 1.0


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties in ascending index order (what CUDA's gather-top-k gives)."""
    idx = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, idx), idx))


def setup():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MOE_CHECK_PORT", "29541"),
                      RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)


def mcore_config(c):
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig
    lb = [t for t in c.lb]
    coeffs = [R.f32(x) for x in c.aux_coeff]
    kw = dict(num_layers=1, hidden_size=c.h, num_attention_heads=c.n, ffn_hidden_size=c.f,
              num_moe_experts=c.E, moe_router_topk=c.topk, moe_ffn_hidden_size=c.fe, add_bias_linear=c.bias,
              bias_activation_fusion=False, moe_router_dtype="fp64", params_dtype=torch.float64,
              use_cpu_initialization=True, perform_initialization=False, moe_token_dispatcher_type="allgather",
              moe_router_score_function=c.score, moe_router_pre_softmax=c.pre_softmax,
              moe_router_topk_scaling_factor=R.f32(c.scaling) if c.scaling else None,
              moe_router_num_groups=c.num_groups or None, moe_router_group_topk=c.group_topk or None,
              moe_router_load_balancing_type=lb if len(lb) > 1 else lb[0],
              moe_aux_loss_coeff=coeffs if len(coeffs) > 1 else coeffs[0],
              moe_z_loss_coeff=R.f32(c.z_coeff) if c.z_coeff else None,
              moe_router_enable_expert_bias=c.expert_bias, moe_router_bias_update_rate=c.bias_rate,
              moe_expert_capacity_factor=R.f32(c.capacity) if c.capacity else None,
              moe_token_drop_policy=c.drop_policy, moe_pad_expert_input_to_capacity=c.pad,
              moe_shared_expert_intermediate_size=c.shared or None, moe_shared_expert_gate=c.shared_gate)
    if c.swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    elif c.squared_relu:
        kw.update(activation_func=squared_relu)
    else:
        kw.update(activation_func=F.gelu)       # the exact (erf) GELU: Megatron's default activation_func
    return TransformerConfig(**kw)


def check_functions(c, gen):
    """Part 1: moe_utils' pure functions against ref_moe's, on random logits."""
    from megatron.core.transformer.moe import moe_utils as mu
    N, E, k = 64, c.E, c.topk
    logits = torch.randn(N, E, generator=gen, dtype=torch.float64) * 2
    bias = (torch.randn(E, generator=gen, dtype=torch.float64) * 0.05).float() if c.expert_bias else None
    probs_m, map_m = mu.topk_routing_with_score_function(
        logits, k, use_pre_softmax=c.pre_softmax, num_groups=c.num_groups or None, group_topk=c.group_topk or None,
        scaling_factor=R.f32(c.scaling) if c.scaling else None, score_function=c.score, expert_bias=bias)
    probs_r, map_r = R.route(c, logits, bias.double() if bias is not None else None)
    report("routing map (topk_routing_with_score_function)", same(map_m, map_r), 0)
    report("routing probabilities", rel(probs_m, probs_r), 1e-6)
    # aux-loss scores, map, loss and its gradient; z-loss
    lg_m = logits.clone().requires_grad_(True)
    lg_r = logits.clone().requires_grad_(True)
    amap_m, s_m = mu.compute_routing_scores_for_aux_loss(lg_m, k, c.score)
    s_r, amap_r = R.aux_scores(c, lg_r)
    report("aux-loss map (compute_routing_scores_for_aux_loss)", same(amap_m, amap_r), 0)
    report("aux-loss scores", rel(s_m, s_r), 1e-6)
    coeff = R.f32(1e-2)
    loss_m = mu.switch_load_balancing_loss_func(s_m, amap_m.sum(0), N, k, E, coeff)
    loss_r = R.switch_loss(s_r, amap_r.sum(0).double(), N, c, coeff)
    z_m = mu.z_loss_func(lg_m, R.f32(1e-3))
    z_r = R.z_loss(lg_r, R.f32(1e-3))
    report("switch_load_balancing_loss_func", rel(loss_m.detach(), loss_r.detach()), 1e-6)
    report("z_loss_func", rel(z_m.detach(), z_r.detach()), 1e-12)
    (loss_m + z_m).backward()
    (loss_r + z_r).backward()
    report("d(aux + z)/d logits", rel(lg_m.grad, lg_r.grad), 1e-6)
    # capacity on a grid, dropping, permutation
    worst = 0.0
    for n in (1, 7, 64, 100, 4096):
        for cf in (0.3, 1.0, 1.1, 1.25, 1.5, 2.0, 3.7):
            want = mu.get_capacity(num_tokens=n * k, num_experts=E, capacity_factor=R.f32(cf))
            worst = max(worst, abs(want - R.capacity_of(R.replace(c, capacity=cf), n)))
    report("get_capacity over 35 (tokens, factor) pairs", worst, 0)
    rmap_used, probs_used = map_r, probs_r
    if c.capacity:
        orig = torch.topk
        torch.topk = stable_topk
        try:
            p2_m, m2_m = mu.apply_router_token_dropping(probs_m.clone(), map_m.clone(), router_topk=k,
                                                        capacity_factor=R.f32(c.capacity),
                                                        drop_policy=c.drop_policy, pad_to_capacity=c.pad)
        finally:
            torch.topk = orig
        p2_r, m2_r = R.drop(c, probs_r, map_r)
        report(f"apply_router_token_dropping map ({c.drop_policy}{', pad' if c.pad else ''}; "
               f"{int((map_r & ~m2_r).sum())} dropped)", same(m2_m, m2_r), 0)
        report("apply_router_token_dropping probabilities", rel(p2_m, p2_r), 1e-6)
        rmap_used, probs_used = m2_r, p2_r
    h = 16
    x = torch.randn(N, h, generator=gen, dtype=torch.float64)
    pad = bool(c.capacity and c.pad and R.capacity_of(c, N) <= N)
    n_out = R.capacity_of(c, N) * E if pad else int(rmap_used.sum())
    perm_x, perm_p, sorted_idx, _, _ = mu.permute(x, rmap_used, probs=probs_used, num_out_tokens=n_out,
                                                  drop_and_pad=pad)
    token, expert, counts = R.permute(rmap_used)
    report(f"permute rows (token per row{', drop_and_pad' if pad else ''})", same(sorted_idx, token), 0)
    report("permute: rows' probabilities", rel(perm_p, probs_used[token, expert]), 0)
    y = torch.randn(len(token), h, generator=gen, dtype=torch.float64)
    out_m = mu.unpermute(y, sorted_idx, restore_shape=x.shape, routing_map=rmap_used, drop_and_pad=pad)
    report("unpermute (sum of each token's rows)", rel(out_m, R.unpermute(y, token, N)), 1e-15)
    # expert-bias update, through the all-reduce Megatron does
    if c.expert_bias:
        st = R.MoEState(c)
        Lm = R.n_moe(c)
        st.tokens = np.asarray(torch.randint(0, 3 * N, (Lm, E), generator=gen))
        st.expert_bias = np.asarray(torch.randn(Lm, E, generator=gen) * 0.01, dtype=np.float32)
        want = mu.get_updated_expert_bias(torch.from_numpy(st.tokens.astype(np.float32)),
                                          torch.from_numpy(st.expert_bias.copy()), c.bias_rate,
                                          tp_dp_cp_group=torch.distributed.group.WORLD)
        st.update_bias()
        report("get_updated_expert_bias", same(want.view(torch.int32), torch.from_numpy(st.expert_bias).view(torch.int32)), 0)


def copy_weights(layer, c, p):
    """ref_moe's first MoE layer's weights into Megatron's MoELayer."""
    with torch.no_grad():
        layer.router.weight.copy_(p["router_weight"][0])
        if c.bias:
            layer.router.bias.copy_(p["router_bias"][0])
        for e, ex in enumerate(layer.experts.local_experts):
            ex.linear_fc1.weight.copy_(p["expert_fc1_weight"][0][e])
            ex.linear_fc2.weight.copy_(p["expert_fc2_weight"][0][e])
            if c.bias:
                ex.linear_fc1.bias.copy_(p["expert_fc1_bias"][0][e])
                ex.linear_fc2.bias.copy_(p["expert_fc2_bias"][0][e])
        if c.shared:
            layer.shared_experts.linear_fc1.weight.copy_(p["shared_fc1_weight"][0])
            layer.shared_experts.linear_fc2.weight.copy_(p["shared_fc2_weight"][0])
            if c.shared_gate:
                layer.shared_experts.gate_weight.copy_(p["shared_gate_weight"][0][None])


def mcore_grads(layer, c):
    """Megatron's parameter gradients under ref_moe's names (first MoE layer's slices)."""
    g = {"router_weight": layer.router.weight.grad}
    ex = layer.experts.local_experts
    g["expert_fc1_weight"] = torch.stack([e.linear_fc1.weight.grad for e in ex])
    g["expert_fc2_weight"] = torch.stack([e.linear_fc2.weight.grad for e in ex])
    if c.bias:
        g["router_bias"] = layer.router.bias.grad
        g["expert_fc1_bias"] = torch.stack([e.linear_fc1.bias.grad for e in ex])
        g["expert_fc2_bias"] = torch.stack([e.linear_fc2.bias.grad for e in ex])
    if c.shared:
        g["shared_fc1_weight"] = layer.shared_experts.linear_fc1.weight.grad
        g["shared_fc2_weight"] = layer.shared_experts.linear_fc2.weight.grad
        if c.shared_gate:
            g["shared_gate_weight"] = layer.shared_experts.gate_weight.grad[0]
    return g


def check_layer(name, c, gen):
    """Part 2: Megatron's MoELayer against ref_moe.moe_layer, forward and backward, two micro-batches."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import router as mrouter
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, get_updated_expert_bias
    cfg = mcore_config(c)
    layer = get_moe_module_spec(use_te=False, num_experts=c.E, moe_grouped_gemm=False)(
        config=cfg, pg_collection=get_default_pg_collection())
    layer.set_layer_number(1)
    layer.train()
    p = R.init_params(c)
    copy_weights(layer, c, p)
    if c.bias:      # local RowParallelLinear at TP 1 returns a view from a custom Function, and autograd refuses
        for ex in layer.experts.local_experts:       # MLP's in-place "output += bias * p" on it: clone it
            ex.linear_fc2.register_forward_hook(lambda mod, inp, out: (out[0].clone(), out[1]))
    st = R.MoEState(c)
    if c.expert_bias:
        b0 = (torch.randn(c.E, generator=gen) * 0.02).float()
        with torch.no_grad():
            layer.router.expert_bias.copy_(b0)
        st.expert_bias[0] = b0.numpy()
    w = {k: p[k][0].clone().requires_grad_(True) for k in R.MOE_KEYS if k in p}
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    drop_fn = mrouter.apply_router_token_dropping

    def dropping_with_stable_ties(*a, **kw):
        orig = torch.topk
        torch.topk = stable_topk
        try:
            return drop_fn(*a, **kw)
        finally:
            torch.topk = orig
    mrouter.apply_router_token_dropping = dropping_with_stable_ties
    try:
        for mbi in range(2):
            B, T, h = c.mb, c.T, c.h
            x = torch.randn(T, B, h, generator=gen, dtype=torch.float64)
            Rw = torch.randn(T, B, h, generator=gen, dtype=torch.float64)
            xm = x.clone().requires_grad_(True)
            out_m, _ = layer(xm)
            (out_m * Rw).sum().backward()
            xr = x.transpose(0, 1).clone().requires_grad_(True)
            out_r, aux = R.moe_layer(c, w, xr, 0, st, training=True)
            ((out_r * Rw.transpose(0, 1)).sum() + aux).backward()
            report(f"micro-batch {mbi}: MoE layer output", rel(out_m, out_r.transpose(0, 1)), 1e-6)
            report(f"micro-batch {mbi}: d input", rel(xm.grad, xr.grad.transpose(0, 1)), 1e-6)
    finally:
        mrouter.apply_router_token_dropping = drop_fn
    gm = mcore_grads(layer, c)
    for k, g in gm.items():
        report(f"d {k} (both micro-batches)", rel(g, w[k].grad), 1e-6)
    names = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
    on = [c.coeff(t) > 0 for t in R.LB_TYPES] + [c.z_coeff > 0]
    for i, nm in enumerate(names):
        got = float(tracker.metrics[nm].values[0]) if nm in tracker.metrics else 0.0
        if on[i]:
            report(f"logged {nm} (sum over the two micro-batches)", rel(got, st.logged[i, 0]), 1e-6)
        elif got or st.logged[i, 0]:
            report(f"logged {nm} although it is off", 1.0, 0)
    if c.expert_bias:
        report("tokens per expert the bias update counts", same(layer.router.local_tokens_per_expert, st.tokens[0]), 0)
        nb = get_updated_expert_bias(layer.router.local_tokens_per_expert.clone()[None],
                                     layer.router.expert_bias.clone()[None], c.bias_rate,
                                     tp_dp_cp_group=torch.distributed.group.WORLD)[0]
        st.update_bias()
        report("updated expert bias (bitwise)", same(nb.view(torch.int32), torch.from_numpy(st.expert_bias[0]).view(torch.int32)), 0)


def main():
    import megatron.core
    setup()
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, CPU, float64 (router fp64)")
    gen = torch.Generator().manual_seed(1234)
    for name, c in R.CONFIGS.items():
        print(f"{name}: E={c.E} topk={c.topk} {c.score}{' pre-softmax' if c.pre_softmax else ''}"
              f"{f' groups {c.num_groups}/{c.group_topk}' if c.group_topk else ''}"
              f"{f' scaling {c.scaling}' if c.scaling else ''}{' expert-bias' if c.expert_bias else ''}"
              f" lb={'+'.join(c.lb)}{f' z {c.z_coeff}' if c.z_coeff else ''}"
              f"{f' capacity {c.capacity} {c.drop_policy}' if c.capacity else ''}{' pad' if c.pad else ''}"
              f"{f' shared {c.shared}' if c.shared else ''}{' gate' if c.shared_gate else ''}"
              f"{' biases' if c.bias else ''} act={'swiglu' if c.swiglu else 'gelu(erf)'}")
        check_functions(c, gen)
        check_layer(name, c, gen)
    n_bad = RESULTS.count(False)
    print(f"{len(RESULTS) - n_bad} passed, {n_bad} failed")
    torch.distributed.destroy_process_group()
    sys.exit(1 if n_bad else 0)


if __name__ == "__main__":
    main()
