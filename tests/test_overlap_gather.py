"""overlap_gather: the post-step all-gather finishes during the next forward (Note [Gathering in the next forward]).

The plan (which module waits for which bucket, gather order) is checked on its
own; then real ranks train the same model with and without overlap_gather and
must agree bitwise (the gathered values are the same bytes, only when they
arrive differs), while counters show that the gathers really were still in
flight when the forward started. Everything that reads parameters outside a
forward right after a step (state_dict, wait_params, checkpoints, an eval
forward) must see the final values. The GPT's blocks hold
nn.MultiheadAttention, whose forward reads `out_proj.weight` without calling
`out_proj`: the case module-level waiting must get right.
"""
import copy

import pytest
import torch
from torch import nn

from dist_harness import run_ranks


def _gpt():
    from shardopt.tools.gpt import GPT, PRESETS

    torch.manual_seed(0)
    return GPT(PRESETS["tiny"])


def _layout(model, world_size, bucket):
    from shardopt.layout import plan_layout

    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    layout = plan_layout([[(names[id(p)], tuple(p.shape)) for p in params]], world_size, bucket, bucket)
    return layout, {id(p): i for i, p in enumerate(params)}


def test_plan_waits_for_what_each_forward_may_touch():
    from shardopt.prefetch import plan_forward_waits, plan_gather_order

    model = _gpt()
    layout, index = _layout(model, 3, 1000)
    waits = {w.name: set(w.buckets) for w in plan_forward_waits(model, index, layout)}

    def buckets_of(*params):
        ids = {index[id(p)] for p in params}
        return {b.index for b in layout.buckets if ids & set(b.params)}

    # The root touches its own embeddings and final norm (and the head, tied to tok),
    # not the blocks: those sit in a container and wait for themselves.
    assert waits[""] == buckets_of(model.tok.weight, model.pos.weight, *model.ln.parameters())
    assert "blocks" not in waits  # a ModuleList holds no parameter of its own
    for k, block in enumerate(model.blocks):
        # Its subtree, including attn.out_proj (read by attn without being called), but not
        # the layers of its Sequential mlp: those are called one by one and wait for themselves.
        own = [*block.ln1.parameters(), *block.attn.parameters(), *block.ln2.parameters()]
        assert waits[f"blocks.{k}"] == buckets_of(*own)
        assert buckets_of(block.attn.out_proj.weight) <= waits[f"blocks.{k}.attn"]
        assert waits[f"blocks.{k}.mlp.0"] == buckets_of(*block.mlp[0].parameters())
        assert f"blocks.{k}.mlp" not in waits
    assert waits["blocks.0.ln1"] == buckets_of(*model.blocks[0].ln1.parameters())

    # Gathers start with what the root needs, then block by block: the first span of
    # each module's buckets comes no later than the first span of the next module's.
    order = [layout.gather_spans[s].bucket for s in plan_gather_order(layout, plan_forward_waits(model, index,
                                                                                                  layout))]
    assert sorted(order) == sorted(g.bucket for g in layout.gather_spans)
    first = {b: order.index(b) for b in set(order)}
    starts = [min(first[b] for b in waits[name]) for name in ["", "blocks.0", "blocks.1"]]
    assert starts == sorted(starts) and starts[0] == 0
    assert set(order[:len(waits[""])]) == waits[""]


def test_plan_for_a_sequential_model_lets_every_layer_wait_for_itself():
    from shardopt.prefetch import plan_forward_waits

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 300), nn.ReLU(), nn.Linear(300, 300), nn.Linear(300, 5))
    layout, index = _layout(model, 2, 512)
    waits = {w.name: w.buckets for w in plan_forward_waits(model, index, layout)}
    assert set(waits) == {"0", "2", "3"}  # not the root: it would wait for everything at once
    assert len(set(waits["0"]) | set(waits["3"])) > 2


def _run(rank, world_size, tmp, dtype, offload, shared):
    import shardopt
    from shardopt.tools.gpt import PRESETS, synthetic_batch

    cfg = PRESETS["tiny"]
    out = {}
    runs = {}
    for defer in (False, True):
        model = _gpt().to(dtype)
        # The reference gathers through the process group; the deferred run as `shared` says (shared memory
        # on one host: Note [Gathering through shared memory]).
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9,
                                        reduce_bucket_size=2000, overlap_gather=defer, offload=offload,
                                        shared_memory_gather=shared if defer else False)
        runs[defer] = (model, opt, shardopt.ShardedDDP(model, opt))
    model, opt, wrapper = runs[True]
    pending_at_block0 = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: pending_at_block0.append(opt.store.gather.num_pending_gathers))
    losses = {False: [], True: []}
    after_step, after_forward = [], []
    for step in range(6):
        x, y = synthetic_batch(cfg, 2, 16, step, rank)
        for defer, (m, o, w) in runs.items():
            loss = nn.functional.cross_entropy(w(x).float().reshape(-1, cfg.vocab), y.reshape(-1))
            if defer:
                after_forward.append(o.store.gather.num_pending_gathers)
            loss.backward()
            o.step()
            o.zero_grad()
            if defer:
                after_step.append(o.store.gather.num_pending_gathers)
            losses[defer].append(loss.item())
    out["losses equal"] = losses[False] == losses[True]
    out["pending after step"] = after_step
    out["pending after forward"] = after_forward
    out["pending at block 0"] = pending_at_block0
    # One gather per span through the process group, one per bucket through shared memory.
    out["gathers"] = len(opt.layout.buckets if shared else opt.layout.gather_spans)
    ref_model = runs[False][0]

    # Right after a step, nothing has waited yet: every reader must.
    state = model.state_dict()
    out["state_dict equal"] = all(torch.equal(state[k], v) for k, v in ref_model.state_dict().items())
    out["pending after state_dict"] = opt.store.gather.num_pending_gathers
    x, y = synthetic_batch(cfg, 2, 16, 99, rank)
    # Another step, then an eval forward (no grad) right away.
    for defer, (m, o, w) in runs.items():
        nn.functional.cross_entropy(w(x).float().reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        o.step()
        o.zero_grad()
    with torch.no_grad():
        out["eval forward equal"] = torch.equal(wrapper(x), runs[False][2](x))
    # Another step, then read parameters directly after wait_params().
    for defer, (m, o, w) in runs.items():
        nn.functional.cross_entropy(w(x).float().reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        o.step()
        o.zero_grad()
    pending_before_wait = opt.store.gather.num_pending_gathers
    opt.wait_params()
    out["wait_params"] = (pending_before_wait, opt.store.gather.num_pending_gathers,
                          all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())))
    # And a checkpoint saved right after a step holds the final values.
    for defer, (m, o, w) in runs.items():
        nn.functional.cross_entropy(w(x).float().reshape(-1, cfg.vocab), y.reshape(-1)).backward()
        o.step()
        o.zero_grad()
    shardopt.save_checkpoint(tmp, wrapper, opt)
    fresh = _gpt().to(dtype)
    fresh_opt = shardopt.ShardedOptimizer(fresh.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9,
                                          reduce_bucket_size=2000)
    fresh_wrapper = shardopt.ShardedDDP(fresh, fresh_opt)
    shardopt.load_checkpoint(tmp, fresh_wrapper, fresh_opt)
    out["checkpoint equal"] = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), ref_model.parameters()))
    return out


@pytest.mark.parametrize("world_size,dtype,offload,shared", [(2, torch.float32, "none", True),
                                                             (3, torch.float32, "none", False),
                                                             (3, torch.float32, "none", True),
                                                             (2, torch.bfloat16, "none", True),
                                                             (2, torch.bfloat16, "cpu", False)])
def test_overlap_gather_matches_gathering_in_step(world_size, dtype, offload, shared, tmp_path):
    results = run_ranks(_run, world_size, str(tmp_path / "ckpt"), dtype, offload, shared, timeout=300)
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        assert r["losses equal"], where
        # Gathers were in flight after every step, still partly in flight when the first
        # block started (so the forward overlapped them), and done when the forward returned.
        assert r["pending after step"] == [r["gathers"]] * 6, where
        assert all(0 < n < r["gathers"] for n in r["pending at block 0"][1:6]), where
        assert r["pending after forward"] == [0] * 6, where
        assert r["state_dict equal"] and r["pending after state_dict"] == 0, where
        assert r["eval forward equal"], where
        assert r["wait_params"] == (r["gathers"], 0, True), where
        assert r["checkpoint equal"], where


def test_overlap_gather_must_be_a_bool():
    from shardopt.config import ShardConfig

    with pytest.raises(TypeError, match="overlap_gather must be True or False"):
        ShardConfig(overlap_gather="yes")
