"""Every way torch offers to clip gradients, on a sharded p.grad (Note [Sharded p.grad] in
shardopt/sharded_grad.py), against DDP + torch.optim on the same data, at stages 1-3 on 2 gloo ranks.

Libraries clip through different torch functions, and change which from one release to the next (accelerate
1.16's Accelerator.clip_grad_norm_ calls get_total_norm and clip_grads_with_norm_ where 1.3's called
clip_grad_norm_; torchtitan has always called those two). Each entry point below runs on the gradients of
AwkwardNet (tests/models.py: a tied embedding, a frozen layer, a branch some ranks skip on some steps, sizes
no world size divides; 300-element buckets, so parameters straddle buckets and rank chunks) for a few AdamW
steps, with 2-norms and inf-norms, and every step must give what DDP gives:
  * the norm the entry point returns (clip_grad_value_ returns none: the total norm read after it), within
    NORM_TOL relative (a 2-norm sums its squares per rank then over the ranks: an ulp away at most);
  * the gradients after the clip, each parameter's p.grad.full_tensor() against DDP's p.grad, within GRAD_TOL
    of the gradient's size (so a clip that scaled nothing, or scaled by a wrong norm, shows at once, which the
    weights alone, AdamW being nearly blind to a uniform scale, might not);
  * the weights after the steps, within WEIGHT_TOL;
and the clip must have acted: DDP's gradients smaller after it at every step (a clip that changes nothing
tests nothing). Every case runs in one launch (Note [Several cases in one launch] in tests/dist_harness.py).
"""
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_harness import case_results, run_cases
from models import VOCAB, AwkwardNet, batch, uses_branch

STEPS = 3
ADAMW = dict(lr=1e-2, weight_decay=0.1)
# Bounds below DDP's norms at every step of this model and data (checked: the clip acts).
MAX_NORM = {2.0: 0.05, math.inf: 0.01}
VALUE = 0.005
NORM_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-6


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


# Each entry point: (parameters, norm order) -> the norm it clipped by (or read after clamping), clipping in
# place as a user's loop or a library would.
def clip_grad_norm_(params, ord):
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM[ord], ord)


def clip_grad_norm_per_tensor(params, ord):
    # foreach=False: a norm per gradient (linalg.vector_norm), then g.mul_ per gradient.
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM[ord], ord, foreach=False)


def total_norm_then_clip_with_it(params, ord):
    # torchtitan's clip_grad_norm_ (and accelerate 1.16's for one device mesh).
    total = torch.nn.utils.get_total_norm(_grads(params), ord, error_if_nonfinite=True)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM[ord], total)
    return total


def total_norm_per_mesh(params, ord):
    # accelerate 1.16's Accelerator._clip_grad_norm_dtensor_aware: a total per device mesh (a sharded p.grad is
    # no DTensor: one group), their norm, then clip_grads_with_norm_; per tensor (foreach=False) here.
    norms = [torch.nn.utils.get_total_norm(_grads(params), ord, foreach=False)]
    total = torch.linalg.vector_norm(torch.stack(norms), ord)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM[ord], total, foreach=False)
    return total


def foreach_norm(params, ord):
    # A hand-written clip over torch._foreach_norm (one norm per gradient) and torch._foreach_mul_.
    grads = _grads(params)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, ord)), ord)
    torch._foreach_mul_(grads, torch.clamp(MAX_NORM[ord] / (total + 1e-6), max=1.0))
    return total


def tensor_norm_and_mul(params, ord):
    # The plainest loop: p.grad.norm(ord) per parameter, then p.grad.mul_(coefficient).
    grads = _grads(params)
    norms = [g.norm(ord) for g in grads]
    total = max(norms) if ord == math.inf else torch.stack(norms).square().sum().sqrt()
    coef = torch.clamp(MAX_NORM[ord] / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def clip_grad_value_(params, ord):
    torch.nn.utils.clip_grad_value_(params, VALUE)
    return torch.nn.utils.get_total_norm(_grads(params), ord)


def clip_grad_value_per_tensor(params, ord):
    torch.nn.utils.clip_grad_value_(params, VALUE, foreach=False)
    return torch.nn.utils.get_total_norm(_grads(params), ord, foreach=False)


ENTRY_POINTS = {f.__name__: f for f in (
    clip_grad_norm_, clip_grad_norm_per_tensor, total_norm_then_clip_with_it, total_norm_per_mesh, foreach_norm,
    tensor_norm_and_mul, clip_grad_value_, clip_grad_value_per_tensor)}
ORDERS = (2.0, math.inf)


def _clip_run(rank, world_size, stage, entry, ord):
    """DDP + AdamW and ShardedDDP + ShardedOptimizer(AdamW) from one seed on the same batches, each clipping with
    `entry` between backward and step (given a list of the parameters, as a library passes). Per side: the norms
    returned; per step: how far each sharded gradient after the clip is from DDP's (relative to the gradient's
    largest element) and whether the clip acted on DDP's gradients (both their norms, 2 and inf, went down); and
    how far the weights are after the steps."""
    import shardopt

    clip = ENTRY_POINTS[entry]
    torch.manual_seed(0)
    base = AwkwardNet()
    ref_module, module = copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(ref_module, find_unused_parameters=True)  # the branch some ranks skip
    ref_opt = torch.optim.AdamW(ref_module.parameters(), **ADAMW)
    opt = shardopt.ShardedOptimizer(module.parameters(), optim=torch.optim.AdamW, stage=stage,
                                    reduce_bucket_size=300, allgather_bucket_size=200, **ADAMW)
    sharded = shardopt.ShardedDDP(module, opt)
    out = dict(ddp_norms=[], norms=[], grad_errors=[], acted=[])
    for step in range(STEPS):
        x, y = batch(step, rank)
        after = []
        for wrapper, optimizer, params, norms in ((ref, ref_opt, ref_module.named_parameters(), out["ddp_norms"]),
                                                  (sharded, opt, module.named_parameters(), out["norms"])):
            nn.functional.cross_entropy(wrapper(x, uses_branch(step, rank)).reshape(-1, VOCAB),
                                        y.reshape(-1)).backward()
            params = dict(params)
            grads = _grads(params.values())
            if optimizer is ref_opt:  # DDP's gradients are plain: reading them changes nothing on the sharded side
                before = [torch.nn.utils.get_total_norm(grads, o).item() for o in ORDERS]
            norms.append(float(clip(list(wrapper.parameters()), ord)))
            if optimizer is ref_opt:
                out["acted"].append([torch.nn.utils.get_total_norm(grads, o).item() < b
                                     for o, b in zip(ORDERS, before)] == [True, True])
            after.append({n: p.grad if optimizer is ref_opt else p.grad.full_tensor()
                          for n, p in params.items() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad()
        want, got = after
        if want.keys() != got.keys():
            out["grad_errors"].append(f"gradients of {sorted(got)}, DDP's of {sorted(want)}")
        else:
            out["grad_errors"].append(max(((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                                          for n, g in want.items()))
    with opt.full_params(writeback=False):  # stage 3: whole only inside it
        out["weight_error"] = max((a - b).abs().max().item()
                                  for a, b in zip(ref_module.parameters(), module.parameters()))
    return out


def _case(stage, entry, ord):
    return f"{entry} order {ord} stage {stage}"


@pytest.fixture(scope="module")
def outcomes():
    return run_cases(2, {_case(stage, entry, ord): (_clip_run, (stage, entry, ord))
                         for stage in (1, 2, 3) for entry in ENTRY_POINTS for ord in ORDERS}, timeout=600)


@pytest.mark.parametrize("ord", ORDERS, ids=("norm2", "norm_inf"))
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_clip_entry_point_matches_ddp(outcomes, stage, entry, ord):
    for rank, r in enumerate(case_results(outcomes, _case(stage, entry, ord))):
        where = f"rank {rank}, {entry}, order {ord}, stage {stage}"
        assert all(r["acted"]), f"{where}: the clip did not act on DDP's gradients at every step: {r['acted']}"
        assert len(r["norms"]) == len(r["ddp_norms"]) == STEPS
        for step, (got, want) in enumerate(zip(r["norms"], r["ddp_norms"])):
            assert abs(got - want) <= NORM_TOL * want, f"{where}: step {step} norm {got!r}, DDP's {want!r}"
        for step, err in enumerate(r["grad_errors"]):
            ok = not isinstance(err, str) and err <= GRAD_TOL
            assert ok, f"{where}: step {step}, the gradients after the clip against DDP's: {err}"
        assert r["weight_error"] <= WEIGHT_TOL, f"{where}: weights {r['weight_error']:.2e} from DDP's"
