"""Ranks doing different amounts of work (issue 56, first part): forwards without gradients of different
counts per rank (generation, rollouts, evaluation) before each training step give plain PyTorch's result at
every stage, and ranks in passes that cannot be reconciled fail at once, naming what each started
(Note [Passes every rank agrees on] in shardopt/zero3/passes.py)."""
import time

import pytest
import torch
from torch import nn

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
