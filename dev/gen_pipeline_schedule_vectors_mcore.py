#!/usr/bin/env python3
"""Megatron-Core's own pipeline schedules, recorded, for tests/test_pipeline_schedule.h.

dev/gen_pipeline_schedule_vectors.py writes our reading of Megatron's schedules; this script runs
Megatron-Core's code itself. For each (PP, VP, M, group size) of that script's SETTINGS and each rank
r, it takes the schedule function Megatron-LM's training loop takes (get_forward_backward_func:
forward_backward_pipelining_without_interleaving, ..._with_interleaving, or
forward_backward_no_pipelining for PP = 1) and runs it as rank r of a pretend pipeline of PP ranks:
  - the pipeline group is an object whose rank() is r and size() is PP (no torch.distributed); the
    tensor- and context-parallel groups are of size 1;
  - the P2PCommunicator is Megatron's own class with its wire method `_communicate` replaced: a
    send is dropped, a receive returns a tiny tensor; nothing crosses between ranks;
  - schedules.forward_step and schedules.backward_step, the per-micro-batch calls of the loops, are
    replaced by recorders. The forward reads the next item of the model chunk's data iterator (it
    must equal the loop's current_microbatch), records F<micro-batch>.<chunk> and returns a tiny
    tensor tagged with both; the backward records B<micro-batch>.<chunk> from the tag of the output
    tensor the loop hands it (popped from the loop's own queues), so the backward order is
    Megatron's bookkeeping, not a formula of ours;
  - the warm-up count is Megatron's: what get_pp_rank_microbatches returned to the interleaved loop
    (and says for PP = 1); for the non-interleaved loop, the forwards its warm-up loop sent with
    send_forward.
Everything else (the three phases, the schedule table, the group-size checks, which chunk a forward
or backward runs) is Megatron-Core's code, unmodified.

Pinned: megatron-core 0.19.2 (the newest on PyPI; its schedules.py equals Megatron-LM d98e8a64's in
every line that orders the work; it needs Python >= 3.12) and torch 2.6.0 (PyPI's build, run on the
CPU; no GPU is used):
    python3.12 -m venv /tmp/mcore && /tmp/mcore/bin/pip install megatron-core==0.19.2 torch==2.6.0
    /tmp/mcore/bin/python dev/gen_pipeline_schedule_vectors_mcore.py
Writes dev/data/pipeline_vectors/schedules_mcore.txt, in schedules.txt's format (one line per
(PP, VP, M, G, rank): `pp vp m g rank warmup op op ...`, op = F<mb>.<chunk> or B<mb>.<chunk>,
g = 0 for the default group size), and says where it differs from schedules.txt.
"""
import importlib.util
import os
import sys
import warnings
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

warnings.filterwarnings("ignore", category=UserWarning)  # no Transformer Engine, Apex, GPU: not used here
import megatron.core  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

MCORE_VERSION = "0.19.2"
HERE = os.path.dirname(os.path.abspath(__file__))


def settings():
    """The SETTINGS of dev/gen_pipeline_schedule_vectors.py (one list for both files)."""
    spec = importlib.util.spec_from_file_location("gen_ours", os.path.join(HERE, "gen_pipeline_schedule_vectors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SETTINGS


class FakeGroup:
    """A process group as the schedules ask it: rank() and size(), nothing sent."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class OnCpu(TorchFunctionMode):
    """The loops count tokens in a tensor made on "cuda"; make it on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class RecordingP2P(p2p_communication.P2PCommunicator):
    """Megatron's P2PCommunicator; only the wire is replaced (sends dropped, receives tiny tensors)."""

    def __init__(self, pp_group, config):
        with mock.patch.object(p2p_communication.dist, "get_global_rank", lambda group, rank: rank):
            super().__init__(pp_group, config)
        self.send_forward_calls = 0

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True):
        prev = torch.zeros(1, requires_grad=True) if recv_prev else None
        nxt = torch.zeros(1) if recv_next else None
        return prev, nxt, ({} if not wait_on_reqs else None)

    def send_forward(self, output_tensors, is_last_stage):
        self.send_forward_calls += 1
        return super().send_forward(output_tensors, is_last_stage)


class Chunk(torch.nn.Module):
    """A model chunk: what the loops look up on it (config, model_type, set_input_tensor)."""

    def __init__(self, config, chunk):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.chunk = chunk

    def set_input_tensor(self, tensor):
        pass


def run(pp, vp, m, g, rank):
    """Megatron-Core's schedule for rank `rank`: (warm-up count, ["F0.0", "B0.0", ...])."""
    config = TransformerConfig(
        num_layers=pp * vp, hidden_size=4, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        microbatch_group_size_per_vp_stage=g if g > 0 else None, pipeline_dtype=torch.float32)
    group = FakeGroup(rank, pp)
    p2p = RecordingP2P(group, config)
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp, pgs.pp = FakeGroup(0, 1), FakeGroup(0, 1), group
    pgs.embd = pgs.pos_embd = None  # no embedding groups (some versions ask)
    model = [Chunk(config, c) for c in range(vp)]
    data = [iter(range(m)) for _ in range(vp)]
    ops, warmup = [], []

    def forward_step(forward_step_func, data_iterator, model_chunk, num_microbatches, input_tensor, *args,
                     current_microbatch=None, **kwargs):
        mb = next(data_iterator)
        assert mb == current_microbatch, "data order %d != the loop's micro-batch %s" % (mb, current_microbatch)
        assert kwargs.get("vp_stage", 0) in (None, model_chunk.chunk), "vp_stage %s on chunk %d" % (kwargs["vp_stage"], model_chunk.chunk)
        ops.append("F%d.%d" % (mb, model_chunk.chunk))
        out = torch.zeros(1, requires_grad=True)
        out.tag = (mb, model_chunk.chunk)
        return ([out] if isinstance(input_tensor, list) else out), 0

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        t = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        ops.append("B%d.%d" % t.tag)
        return torch.zeros(1) if input_tensor is not None else None

    real_counts = schedules.get_pp_rank_microbatches

    def counts(*args, **kwargs):
        r = real_counts(*args, **kwargs)
        warmup.append(r[2])
        return r

    func = schedules.get_forward_backward_func(pp_size=pp, vp_size=vp if vp > 1 else None)
    with mock.patch.object(schedules, "forward_step", forward_step), \
            mock.patch.object(schedules, "backward_step", backward_step), \
            mock.patch.object(schedules, "get_pp_rank_microbatches", counts), OnCpu():
        func(forward_step_func=None, data_iterator=data if vp > 1 else data[0], model=model if vp > 1 else model[0],
             num_microbatches=m, seq_length=2, micro_batch_size=1, forward_only=False, p2p_communicator=p2p,
             pg_collection=pgs)
        if func is schedules.forward_backward_pipelining_with_interleaving:
            assert len(warmup) == 1, "get_pp_rank_microbatches called %d times" % len(warmup)
            w = warmup[0]
        elif func is schedules.forward_backward_pipelining_without_interleaving:
            w = p2p.send_forward_calls
        else:  # PP = 1: Megatron's count for it
            w = real_counts(m, 1, 1, p2p_communicator=p2p)[2]
    for i, it in enumerate(data):
        assert next(it, None) is None, "chunk %d did not read all %d micro-batches" % (i, m)
    return w, ops


def main():
    if megatron.core.__version__ != MCORE_VERSION:
        print("note: megatron-core %s, the vectors were written with %s" % (megatron.core.__version__, MCORE_VERSION))
    out_dir = os.path.join(HERE, "data", "pipeline_vectors")
    lines = []
    for pp, vp, m, g in settings():
        for rank in range(pp):
            w, ops = run(pp, vp, m, g, rank)
            lines.append("%d %d %d %d %d %d %s\n" % (pp, vp, m, g, rank, w, " ".join(ops)))
    path = os.path.join(out_dir, "schedules_mcore.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    print("wrote %s (%d rank schedules; megatron-core %s, torch %s)" % (path, len(lines), megatron.core.__version__,
                                                                      torch.__version__))
    # where Megatron's own loops and our reading of them differ
    ours_path = os.path.join(out_dir, "schedules.txt")
    if os.path.exists(ours_path):
        with open(ours_path) as f:
            ours = f.readlines()
        diffs = [(a, b) for a, b in zip(lines, ours) if a != b]
        if len(ours) != len(lines) or diffs:
            print("DIFFERS from schedules.txt (%d lines, %d differ):" % (len(ours), len(diffs)))
            for a, b in diffs[:10]:
                print("  mcore: " + a.rstrip() + "\n  ours:  " + b.rstrip())
            return 1
        print("equal to schedules.txt, line for line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
