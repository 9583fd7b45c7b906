"""Does Adam's variance stay where OneBitAdam freezes it? AdamW on the model and data of
benchmarks/onebit_loss_curve.py, one process, and per element the factor sqrt(v_hat(t) / v_hat(freeze)) by
which AdamW's denominator has moved since the step where OneBitAdam would freeze it. 1-bit Adam assumes the
variance has settled by then (DeepSpeed's guidance: freeze after 15-25% of training); where the factor grows,
OneBitAdam's steps are that much larger than AdamW's (its update is lr * m / sqrt(v_frozen)).

    python benchmarks/onebit_variance_growth.py --steps 750 --freeze 75 --corpus-at 6cc03e8

One process computes the mean gradient of the 4-rank benchmark's windows (4 x 8 per step, the same windows
as ranks 0-3 draw), so AdamW's state follows the 4-rank run up to summation order.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from hop_loss_curve import CLIP, CONFIG, LR, WD, _generator, read_corpus, windows  # noqa: E402
from shardopt.tools.gpt import GPT  # noqa: E402

RANKS, BATCH = 4, 8
BETAS = (0.9, 0.999)  # the benchmark's
SAMPLE = 200_000  # elements whose factor's quantiles are reported (torch.quantile's input limit is 16M)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=750)
    ap.add_argument("--freeze", type=int, default=75, help="the step whose variance is the reference")
    ap.add_argument("--every", type=int, default=75)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--weight-decay", type=float, default=WD, help=f"AdamW's (the benchmark's: {WD})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-at", default=None, metavar="REV")
    args = ap.parse_args()
    torch.manual_seed(0)
    train = torch.frombuffer(bytearray(read_corpus(at=args.corpus_at)[0]), dtype=torch.uint8)
    model = GPT(CONFIG)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=BETAS)
    sample = torch.randperm(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(1))[:SAMPLE]
    print("| step | loss | gradient norm (before clipping) | factor: 10th percentile | median | 90th percentile "
          "| sqrt(sum v / sum v_frozen) |\n|---|---|---|---|---|---|---|")
    frozen = None
    for step in range(1, args.steps + 1):
        loss = 0.0
        for r in range(RANKS):
            x, y = windows(train, BATCH, CONFIG.seq, _generator(args.seed, step - 1, r))
            part = F.cross_entropy(model(x).reshape(-1, CONFIG.vocab), y.reshape(-1)) / RANKS
            part.backward()
            loss += part.item()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
        opt.step()
        opt.zero_grad()
        if not (step == args.freeze or (step > args.freeze and step % args.every == 0)):
            continue
        v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]) / (1 - BETAS[1] ** step)
        if frozen is None:
            frozen = v.clone()
        factor = (v[sample] / frozen[sample]).sqrt()
        q = torch.quantile(factor[factor.isfinite()], torch.tensor([0.1, 0.5, 0.9])).tolist()
        print(f"| {step} | {loss:.3f} | {norm:.2f} | {q[0]:.2f} | {q[1]:.2f} | {q[2]:.2f} | "
              f"{(v.sum() / frozen.sum()).sqrt().item():.2f} |", flush=True)


if __name__ == "__main__":
    main()
