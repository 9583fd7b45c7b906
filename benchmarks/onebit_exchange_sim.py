"""Which 1-bit exchange trains like AdamW? A single-process simulation of W data-parallel ranks on the small
GPT, corpus and data order of hop_loss_curve.py (rank r's windows at step s are the real runs'), so that
exchange variants can be compared in minutes, without gloo (benchmarks/results/2026-11-25-onebit-momentum.md).

Every run: exact AdamW (gradients averaged over the W ranks, clipped at 1.0) for --freeze steps, then, unless
--exchange adamw, Adam's variance frozen and the momentum formed by one of:
  exact      the exact mean gradient (the freeze alone)
  increment  each rank sends the increments (1-b1) G_r 1-bit to their owners (one phase, sending-side
             residual, own row exact) and the mean is added to b1*m: shardopt's flat mesh before 2026-11-25
  momentum   each rank compresses its local momentum b1*m + (1-b1) G_r (worker residual), owners average
             and compress again (server residual), every rank decodes: DeepSpeed's compressed all-reduce,
             shardopt's flat mesh from 2026-11-25 (with --over-d --scale rms)
--over-d divides what crosses by the frozen denominator d; --scale picks the block scale of the 1-bit
format (mean |x| or RMS per --block, or "chunk": one RMS per owner's chunk, as DeepSpeed). The codec here
is plain PyTorch, not shardopt's (so that the scales can vary); the simulation has no clipping after the freeze.

    python benchmarks/onebit_exchange_sim.py --exchange momentum --over-d --scale rms    # ~3 min on one core
    python benchmarks/onebit_exchange_sim.py --exchange adamw --schedule cosine
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from hop_loss_curve import CONFIG, EVAL_BATCHES, REPO, _generator, read_corpus, windows  # noqa: E402
from shardopt.tools.gpt import GPT  # noqa: E402


def one_bit(x: torch.Tensor, scale: str, block: int) -> torch.Tensor:
    """[k, n] -> what a receiver decodes: sign(x) (0 -> +) times the block's scale."""
    k, n = x.shape
    if scale == "chunk":
        s = x.square().mean(1, keepdim=True).sqrt()
        return torch.where(x >= 0, s, -s)
    nb = -(-n // block)
    xp = torch.zeros(k, nb * block, dtype=torch.float64)
    xp[:, :n] = x
    count = torch.full((nb,), float(block), dtype=torch.float64)
    count[-1] = n - (nb - 1) * block
    blocks = xp.view(k, nb, block)
    s = blocks.abs().sum(-1) / count if scale == "mean" else (blocks.square().sum(-1) / count).sqrt()
    out = torch.where(blocks >= 0, s.unsqueeze(-1), -s.unsqueeze(-1)).float()
    return out.view(k, -1)[:, :n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exchange", default="momentum", choices=["adamw", "exact", "increment", "momentum"])
    ap.add_argument("--over-d", action="store_true")
    ap.add_argument("--scale", default="rms", choices=["mean", "rms", "chunk"])
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--compress-own", action="store_true",
                    help="each rank's own row goes through the 1-bit codec too (with its residual), as in "
                         "DeepSpeed's compressed all-reduce; default: kept exact, as shardopt does")
    ap.add_argument("--steps", type=int, default=375)
    ap.add_argument("--freeze", type=int, default=75)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="data order")
    ap.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                    help="lr: constant 1e-3, or cosine from 1e-3 to 1e-4 over the run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    w, b1, b2, eps, base_lr, wd, clip = a.world, 0.9, 0.999, 1e-8, 1e-3, 0.1, 1.0
    tr, he, _ = read_corpus(REPO)
    train = torch.frombuffer(bytearray(tr), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(he), dtype=torch.uint8)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    m, v = torch.zeros(total), torch.zeros(total)
    pad = (-total) % w
    n = (total + pad) // w
    worker = torch.zeros(w, w, n)   # rank r's sending-side residual, one row per owner
    server = torch.zeros(w, n)      # owner j's summing-side residual
    d = None

    def rows(x):
        return torch.cat([x, x.new_zeros(pad)]).view(w, n)

    def send_rows(local):
        """Every rank r sends row j of local[r] 1-bit to owner j (sending-side residual, its own row exact
        unless --compress-own);
        returns what the owners received, summed over the senders ([w, n])."""
        got = torch.zeros(w, n)
        for r, x in enumerate(local):
            sent = x + worker[r]
            if not a.compress_own:
                sent[r] = x[r]
            dec = one_bit(sent, a.scale, a.block)
            worker[r] = sent - dec
            if not a.compress_own:
                worker[r][r] = 0
                dec[r] = x[r]
            got += dec
        return got

    losses = []
    t0 = time.time()
    for t in range(a.steps):
        lr = base_lr if a.schedule == "constant" else \
            base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / a.steps)))
        grads, step_loss = [], 0.0
        for r in range(w):
            x, y = windows(train, a.batch, CONFIG.seq, _generator(a.seed, t, r))
            for p in params:
                p.grad = None
            loss = F.cross_entropy(model(x).reshape(-1, CONFIG.vocab), y.reshape(-1))
            loss.backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
            step_loss += loss.item() / w
        losses.append(step_loss)
        g_all = torch.stack(grads)
        with torch.no_grad():
            if t < a.freeze or a.exchange == "adamw":
                g = g_all.mean(0)
                g = g * min(1.0, clip / (float(g.norm()) + 1e-6))
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                den = v.sqrt() / math.sqrt(1 - b2 ** (t + 1)) + eps
            else:
                if d is None:
                    d = v.sqrt() / math.sqrt(1 - b2 ** a.freeze) + eps
                unit = rows(d) if a.over_d else torch.ones(w, n)
                unit[unit == 0] = 1
                if a.exchange == "exact":
                    g = g_all.mean(0)
                    m.mul_(b1).add_(g * min(1.0, clip / (float(g.norm()) + 1e-6)), alpha=1 - b1)
                elif a.exchange == "increment":
                    got = send_rows([rows(g_all[r] * (1 - b1)) / unit for r in range(w)])
                    m.mul_(b1).add_((got / w * unit).reshape(-1)[:total])
                else:
                    got = send_rows([rows(m * b1 + g_all[r] * (1 - b1)) / unit for r in range(w)])
                    mean = got / w + server
                    out = one_bit(mean, a.scale, a.block)
                    server.copy_(mean - out)
                    m.copy_((out * unit).reshape(-1)[:total])
                den = d
            flat.mul_(1 - lr * wd).addcdiv_(m, den, value=-lr / (1 - b1 ** (t + 1)))
            at = 0
            for p in params:
                p.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
    with torch.no_grad():
        ev = sum(F.cross_entropy(model(x).reshape(-1, CONFIG.vocab), y.reshape(-1)).item()
                 for r in range(w) for b in range(EVAL_BATCHES)
                 for x, y in [windows(held, a.batch, CONFIG.seq, _generator(-1, b, r))]) / (w * EVAL_BATCHES)
    print(json.dumps(dict(args=vars(a), final=sum(losses[-20:]) / 20, held_out=ev, seconds=round(time.time() - t0))))


if __name__ == "__main__":
    main()
