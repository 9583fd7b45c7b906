"""Ranks doing different amounts of work (issue 56, first part): forwards without gradients of different
counts per rank (generation, rollouts, evaluation) before each training step give plain PyTorch's result at
every stage, and ranks in passes that cannot be reconciled fail at once, naming what each started
(Note [Passes every rank agrees on] in shardopt/zero3/passes.py)."""
import contextlib
import os
import time

import pytest
import torch
from torch import nn
from torch.distributed.algorithms import Join

from tests.dist_harness import run_ranks

STEPS, LR, CLIP = 4, 1e-2, 1.0


def _model():
    torch.manual_seed(0)
    # 33 inputs: sizes not divisible by the world size; a frozen layer (sharded at stage 3 too).
    net = nn.Sequential(*[nn.Sequential(nn.Linear(33, 33), nn.Tanh()) for _ in range(4)], nn.Linear(33, 5))
    net[1][0].requires_grad_(False)
    return net


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 33, generator=g), torch.randint(0, 5, (5,), generator=g)


def _rollouts(rank, world_size, stage, extra_training_pass, between=False):
    import shardopt

    model = _model()
    opt = shardopt.ShardedOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW,
                                    lr=LR, stage=stage, reduce_bucket_size=500, max_grad_norm=CLIP)
    wrapper = shardopt.ShardedDDP(model, opt)
    start = time.monotonic()
    try:
        def rollouts():  # 1, 3, 5 ... forwards on ranks 0, 1, 2 ..., one more on odd steps
            with torch.no_grad():
                for _ in range(1 + 2 * rank + step % 2):
                    wrapper(torch.randn(3, 33))

        for step in range(STEPS):
            if not between:
                rollouts()
            x, y = _batch(step, rank)
            nn.functional.cross_entropy(wrapper(x), y).backward()
            if between:  # between backward and step: the rank that is done shadows them from its step
                rollouts()
            if extra_training_pass and rank == 0 and step == 2:
                nn.functional.cross_entropy(wrapper(x), y).backward()  # one rank trains on twice: irreconcilable
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return "error", time.monotonic() - start, str(e)
    with opt.full_params(writeback=False):
        return "ok", time.monotonic() - start, {k: v.clone() for k, v in model.state_dict().items()}


def _reference(world_size):
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        for r in range(world_size):
            x, y = _batch(step, r)
            (nn.functional.cross_entropy(model(x), y) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("stage,world_size,between", [(1, 2, False), (2, 2, False), (3, 2, False), (3, 3, False),
                                                     (3, 2, True)])
def test_rollouts_of_different_lengths_match_plain_pytorch(stage, world_size, between):
    results = run_ranks(_rollouts, world_size, stage, False, between, timeout=200)
    reference = _reference(world_size)
    for status, _, state in results:
        assert status == "ok", state
        for k, v in reference.items():
            # AdamW over 4 steps of up to lr each; the ranks' and one process's sums differ in the last bits.
            assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), (k, (state[k] - v).abs().max().item())


def test_ranks_in_different_passes_fail_at_once_naming_them():
    """Stage 3: rank 0 runs a second training pass where rank 1 steps. Both raise within seconds (not a
    collective timeout), each naming the two passes."""
    for rank, (status, seconds, message) in enumerate(run_ranks(_rollouts, 2, 3, True, timeout=200)):
        assert status == "error", (rank, message)
        assert seconds < 10, (rank, seconds)
        assert "rank 0 started a training forward" in message and "rank 1 started the optimizer step" in message, \
            message


def _generate(rank, world_size, synced):
    import shardopt
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=0, eos_token_id=63)
    model = transformers.GPT2LMHeadModel(config)
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(model.state_dict())
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=3, reduce_bucket_size=4000)
    wrapper = shardopt.ShardedDDP(model, opt)  # kept: its hooks gather for the bare model's generate()
    prompt = torch.tensor([[1 + rank, 2, 3]])
    new = 3 + 5 * rank  # ranks generate different numbers of tokens: different numbers of forwards
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=63)
    ours = model.generate(prompt, synced_gpus=synced, **kwargs)
    # A training step follows (as in RLHF): the rank that is done shadows the other's forwards while starting it.
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    wrapper(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    same = torch.equal(ours, plain.generate(prompt, **kwargs))
    del wrapper
    return same, ours.shape[1]


@pytest.mark.parametrize("synced", [False, True])
def test_generate_at_stage_3_with_and_without_synced_gpus(synced):
    """generate() on the bare stage-3 model, ranks producing different lengths, then a training step: plain
    generate()'s tokens, with synced_gpus (the ranks that are done keep running forwards) and without (a rank
    that is done shadows the others' forwards when it starts its next pass)."""
    results = run_ranks(_generate, 2, synced, timeout=200)
    assert [r[1] for r in results] == [6, 11]
    assert all(same for same, _ in results), results


# ------------------------------------------------- a module called again within a pass
# Note [A module called again] in shardopt/zero3/rounds.py: a block called 1 + (step + rank) % 3 times (one call
# under activation checkpointing) and an MoE layer whose experts run as often as the data routes token groups
# to them, in data order (an expert again right away, or after another one), differently on every rank.
DIM, GROUP = 24, 2


class _Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(33, DIM)
        # blocks[0] is the one called again; its first layer is frozen (sharded at stage 3 too)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
                                    for _ in range(2))
        self.blocks[0][0].requires_grad_(False)
        self.router = nn.Linear(DIM, 3)
        self.head = nn.Linear(DIM, 5)
        # registered last, without bias: each expert alone in its bucket (reduce_bucket_size=700), so an expert
        # run again after another one needs its bucket again after it was freed
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(3))

    def forward(self, x, repeats: int):
        h = self.inp(x)
        for k in range(repeats):
            block = self.blocks[0]
            h = h + (torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if k == 1 % repeats
                     else block(h))
        h = self.blocks[1](h)
        gate = torch.softmax(self.router(h), dim=-1)
        out = []
        for g in range(0, h.shape[0], GROUP):  # each group of tokens to its first token's top expert
            e = int(gate[g].argmax())
            out.append(h[g:g + GROUP] + gate[g:g + GROUP, e:e + 1] * self.experts[e](h[g:g + GROUP]))
        return self.head(torch.cat(out))


def _reentrant_model():
    torch.manual_seed(0)
    return _Reentrant()


def _repeats(step: int, rank: int) -> int:
    return 1 + (step + rank) % 3


def _reentrant_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(12, 33, generator=g), torch.randint(0, 5, (12,), generator=g)


def _reentrant_train(rank, world_size, cases):
    import shardopt

    out = {}
    for case in cases:
        model = _reentrant_model()
        if case.get("nodes"):  # ranks on several nodes (as torchrun says): stage 3 gathers in two levels
            os.environ["LOCAL_WORLD_SIZE"] = str(world_size // case["nodes"])
        opt = shardopt.ShardedOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW,
                                        lr=LR, stage=case["stage"], reduce_bucket_size=700, max_grad_norm=CLIP,
                                        **case.get("options", {}))
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        assert not case.get("nodes") or opt.store.gather.route == "two-level", "node-aware gathers are not on"
        wrapper = shardopt.ShardedDDP(model, opt)
        start = time.monotonic()
        # Under torch's Join rank r has 2 + r batches: the ranks that have joined serve the others' gathers asked
        # again while shadowing their passes.
        with Join([wrapper, opt]) if case.get("join") else contextlib.nullcontext():
            for step in range(_steps(case, rank)):
                if case.get("rollouts"):  # forwards without gradients, of different numbers and depths per rank
                    with torch.no_grad():
                        for k in range(1 + rank):
                            wrapper(_reentrant_batch(50 + step, rank + k)[0], _repeats(step + k, rank))
                x, y = _reentrant_batch(step, rank)
                nn.functional.cross_entropy(wrapper(x, _repeats(step, rank)), y).backward()
                opt.step()
                opt.zero_grad()
        seconds = time.monotonic() - start
        store = getattr(opt, "store", None)
        gathers = (getattr(store, "num_gathers", None), getattr(getattr(store, "rounds", None), "num_again", None))
        with opt.full_params(writeback=False):
            state = {k: v.clone() for k, v in model.state_dict().items()}
        out[str(case)] = (state, seconds, gathers)
        del wrapper
    return out


def _steps(case: dict, rank: int) -> int:
    return 2 + rank if case.get("join") else STEPS


def _reentrant_reference(world_size, case):
    model = _reentrant_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(max(_steps(case, r) for r in range(world_size))):
        # each rank's micro-batch at its depth, gradients averaged (as DDP; under Join over the initial world size)
        for r in range(world_size):
            if step >= _steps(case, r):
                continue
            x, y = _reentrant_batch(step, r)
            (nn.functional.cross_entropy(model(x, _repeats(step, r)), y) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


REENTRANT_CASES = [dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=3, rollouts=True),
                   dict(stage=3, options=dict(prefetch_bucket_size=1400, max_live_parameters=2100)),
                   dict(stage=3, options=dict(reshard_after_forward=False)), dict(stage=3, nodes=2),
                   dict(stage=3, join=True)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_module_called_a_different_number_of_times_per_rank_matches_plain_pytorch(world_size):
    """Issue 56: the block at depths 1-3 (one call checkpointed) and the MoE's experts run as often as the data
    says, differently per rank, at stages 1-3 (stage 3 with prefetch and max_live, without resharding after
    forward, with rollouts of other depths between steps, over 2 nodes of 1 (two-level gathers); at 3 ranks
    under torch's Join with 2, 3, 4 batches):
    plain PyTorch's weights, every rank's stage-3 gathers alike, each case in seconds."""
    cases = REENTRANT_CASES[:-1] if world_size == 2 else REENTRANT_CASES[:4] + REENTRANT_CASES[-1:]
    results = run_ranks(_reentrant_train, world_size, cases, timeout=300)
    for case in cases:
        key, reference = str(case), _reentrant_reference(world_size, case)
        for rank, res in enumerate(results):
            state, seconds, gathers = res[key]
            assert seconds < 20, (key, rank, seconds)
            for k, v in reference.items():
                assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), (key, rank, k,
                                                                           (state[k] - v).abs().max().item())
        gathers = [res[key][2] for res in results]
        assert len(set(gathers)) == 1, (key, gathers)  # every rank walked the same gathers
        if case["stage"] == 3:  # an expert needed again after another ran: some rank asked for gathers again
            resharding = case.get("options", {}).get("reshard_after_forward", True)
            assert (gathers[0][1] > 0) == resharding, (key, gathers)

def _out_of_step(rank, world_size):
    """Rank 0 is at a forward's end exchange (Note [A module called again]) where rank 1 starts a training
    forward: ranks out of step (no public call gets there; this is the guard every rank relies on)."""
    import shardopt

    model = _reentrant_model()
    opt = shardopt.ShardedOptimizer(list(model.parameters()), torch.optim.AdamW, lr=LR, stage=3,
                                    reduce_bucket_size=700)
    wrapper = shardopt.ShardedDDP(model, opt)
    start = time.monotonic()
    try:
        if rank == 0:
            opt.store.rounds.serve(-1)
        else:
            wrapper(_reentrant_batch(0, rank)[0], 1)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None


def test_an_exchange_out_of_step_raises_on_every_rank():
    for rank, (seconds, message) in enumerate(run_ranks(_out_of_step, 2, timeout=120, collective_timeout=30)):
        assert message is not None and seconds < 10, (rank, seconds, message)
        assert "rank 0 was at the end of a forward" in message and "rank 1 started a training forward" in message, \
            message


def test_reuse_scopes_cover_a_sequential_block_within_the_limit():
    """schedule.plan_reuse_scopes (pure): a layer of an nn.Sequential below the root keeps the Sequential's
    buckets (not counting the root's own) when they fit the limit, its own otherwise; a layer of a Sequential
    root, or of a ModuleList, keeps its own."""
    from shardopt.prefetch import ForwardWait
    from shardopt.zero3.schedule import plan_reuse_scopes

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)),
                          nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    block, listed = model[1], model[2]
    waits = [ForwardWait("", model, (0,)), ForwardWait("0", model[0], (0, 1)),
             ForwardWait("1.0", block[0], (1, 2)), ForwardWait("1.2", block[2], (3,)),
             ForwardWait("2.0", listed[0], (4,)), ForwardWait("2.1", listed[1], (5,))]
    roomy = plan_reuse_scopes(model, waits, 3)
    assert roomy == (frozenset({0}), frozenset({0, 1}), frozenset({1, 2, 3}), frozenset({1, 2, 3}),
                     frozenset({4}), frozenset({5})), roomy
    tight = plan_reuse_scopes(model, waits, 2)  # the block's 1, 2, 3: three buckets not the root's
    assert tight[2:4] == (frozenset({1, 2}), frozenset({3})), tight

