"""Host reads (.item(), bool(t), float(t): aten._local_scalar_dense and the ops above it) made by shardopt's own code in a training
step written with the torch idioms: a constant, the same at 10 and at 80 parameter tensors.

On a GPU each such read waits for the device to finish everything queued so far; one per parameter would
serialise the step (Note [Foreach over a shard] in shardopt/sharded_grad.py). The step: GradScaler
(scale, unscale_), clip_grad_value_, clip_grad_norm_, a per-parameter norm read, scaler.step, update,
model.zero_grad() (to None and in place) - every idiom of the issue - at stages 1-3, 2 ranks.

Counting: a TorchDispatchMode sees every aten op the step runs, the ones inside ShardedGrad's own
__torch_dispatch__ too (the mode enters itself again around it, see CountHostReads). A read is
shardopt's when the innermost Python frame outside torch that asked for it is in shardopt/; torch's own
reads (GradScaler.step reads found_inf once, by design) and the test's are not counted.
"""
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dist_harness import run_ranks

SHARDOPT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "shardopt" + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
aten = torch.ops.aten
# What a Python dispatch mode sees of a host read: t.item() arrives as aten.item, bool(t) as
# aten.is_nonzero, float(t) / int(t) as aten._local_scalar_dense, torch.equal as aten.equal (each
# decomposes to _local_scalar_dense below the mode, so none is counted twice).
HOST_READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default)
# Indexing by a tensor: shardopt's per-parameter tensors (norms, clamp marks) live on the gradients' device, and
# an index made on the host is copied there from pageable memory, which waits as a read does (seen on an H200:
# one sync per p.grad.norm() in a logging loop; .ci/gpu_integrations.py host_syncs). Here, on the CPU, such ops
# are counted; per step they must not grow with the tensors either.
INDEXING = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)


def _asker() -> str:
    """file:line of the innermost frame outside torch and outside the counting mode itself."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        counting = code.co_filename == __file__ and code.co_name in ("_asker", "__torch_dispatch__")
        if not code.co_filename.startswith(TORCH_DIR) and not counting:
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class CountHostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []
        self.indexed = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from shardopt.sharded_grad import ShardedGrad

        kwargs = kwargs or {}
        if func in HOST_READS:
            self.reads.append(_asker())
        elif func in INDEXING:
            self.indexed.append(_asker())
        if ShardedGrad in types:
            # A mode is switched off inside its own __torch_dispatch__; switch it back on for the
            # subclass's handler, so that the ops shardopt runs there are counted too.
            with self:
                return ShardedGrad.__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **kwargs)


def _model(tensors):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(tensors // 2)])


def _step(model, opt, scaler, step, rank, count):
    g = torch.Generator().manual_seed(10 * step + rank)
    dev = next(model.parameters()).device  # the CPU here; the GPU in .ci/gpu_integrations.py's host_syncs
    x, y = torch.randn(3, 4, generator=g).to(dev), torch.randn(3, 4, generator=g).to(dev)
    with count:
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        per_param = [p.grad.norm() for p in model.parameters()]  # logged as tensors
        scaler.step(opt)
        scaler.update()
        model.zero_grad(set_to_none=step % 2 == 0)
    return norm, per_param


def _reads(rank, world_size, stage, tensors):
    import shardopt

    model = _model(tensors)
    # fused=True: the for-loop and foreach AdamW read each parameter's step count on the host (under DDP
    # too); that is the inner optimizer's choice, and the fused one reads nothing.
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, fused=True, lr=1e-2, stage=stage,
                                    reduce_bucket_size=37)  # many buckets, parameters straddling them
    model = shardopt.ShardedDDP(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    counts, where = [], set()
    for step in range(4):
        count = CountHostReads()
        norm, per_param = _step(model, opt, scaler, step, rank, count)
        mine = [r for r in count.reads if r.startswith(SHARDOPT_DIR)]
        counts.append((len(mine), len(count.reads), sum(r.startswith(SHARDOPT_DIR) for r in count.indexed)))
        where.update(mine)
    assert float(norm) > 0.1 and len(per_param) == tensors  # the step did clip, and the norms were read
    return counts, sorted(where)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_reads_do_not_grow_with_the_number_of_tensors(stage):
    small = run_ranks(_reads, 2, stage, 10)
    large = run_ranks(_reads, 2, stage, 80)
    for rank in range(2):
        (few, _), (many, _) = small[rank], large[rank]
        # Steps 1-3 (step 0 builds state); shardopt's own reads per step, at both sizes.
        mine_few = [c[0] for c in few[1:]]
        mine_many = [c[0] for c in many[1:]]
        assert mine_few == mine_many, (f"rank {rank}: shardopt's host reads per step grow with the tensors: "
                                       f"{mine_few} at 10, {mine_many} at 80; asked at {large[rank][1]}")
        # The counter sees reads: torch's own (GradScaler.step reads found_inf) are there, not counted.
        assert all(total > mine for mine, total, _ in many), many
        indexed_few, indexed_many = [c[2] for c in few[1:]], [c[2] for c in many[1:]]
        assert indexed_few == indexed_many, (f"rank {rank}: shardopt indexes by tensors {indexed_few} times per "
                                             f"step at 10 tensors, {indexed_many} at 80")
        assert max(mine_many) <= 2, f"rank {rank}: {mine_many} host reads per step, asked at {large[rank][1]}"
