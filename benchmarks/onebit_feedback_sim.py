"""How does error feedback with one scale per block behave? A single-process simulation of the flat
mesh's exchange (Note [1-bit Adam under ZeRO] in shardopt/onebit.py) on synthetic increments, with the real codec
(shardopt.onebit.encode_feedback: one mean-|x| scale per block, error feedback on the sending side).

W ranks each send (1 - b1) * G_i, G_i = signal * (1 + 0.3 noise) + scale * noise (a signal-to-noise of
0.3 per element); the owner averages the decoded increments and keeps m = b1 * m + that. `scale` is a
per-element magnitude drawn log-normal with sigma `spread` (CASES; 0: every element alike). Reported after
each number of steps: the sending-side residual relative to the increment, the momentum's relative
error, and the relative error of the path sum_t m_t (what the parameters follow under a frozen variance)
against exact averaging. "normalized" divides the increment by the per-element scale before encoding
and multiplies it back after decoding (what dividing by the frozen denominator d does in onebit.py,
here with the exact scale). In the loss benchmark blocks of 128 did not help where this simulation says
they should (benchmarks/results/2026-11-25-onebit-loss.md): it models one mechanism, not the real gap.

    python benchmarks/onebit_feedback_sim.py                 # ~1 min on one core
    python benchmarks/onebit_feedback_sim.py --steps 50 --n 4096
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.onebit import decode, encode_feedback  # noqa: E402

CASES = [(0.0, 1024, False), (0.5, 1024, False), (1.0, 1024, False), (1.0, 128, False), (1.0, 1024, True)]


def simulate(spread: float, block: int, normalized: bool, steps: int, n: int, world: int = 4, b1: float = 0.9,
             checkpoints=(50, 100, 300)) -> dict:
    """{step: (|residual| / |increment|, momentum error, path error)} for one case (seeded: repeatable)."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(n, generator=gen) * spread)
    signal = torch.randn(n, generator=gen) * scale * 0.3
    residuals = [torch.zeros(1, n) for _ in range(world)]
    m_true, m_dec, p_true, p_dec = (torch.zeros(n) for _ in range(4))
    out = {}
    for t in range(1, steps + 1):
        common = signal * (1 + 0.3 * torch.randn(n, generator=gen))
        incs = [(1 - b1) * (common + torch.randn(n, generator=gen) * scale) for _ in range(world)]
        m_true = b1 * m_true + sum(incs) / world
        unit = scale if normalized else torch.ones(n)
        decoded = [decode(encode_feedback((x / unit).view(1, -1), r, block=block), n, block)[0] * unit
                   for x, r in zip(incs, residuals)]
        m_dec = b1 * m_dec + sum(decoded) / world
        p_true += m_true
        p_dec += m_dec
        if t in checkpoints:
            e = float((residuals[0][0] * unit).norm() / incs[0].norm())
            out[t] = (e, float((m_dec - m_true).norm() / m_true.norm()), float((p_dec - p_true).norm() / p_true.norm()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n", type=int, default=1 << 15, help="elements per rank")
    args = ap.parse_args()
    marks = tuple(s for s in (50, 100, 300) if s <= args.steps) or (args.steps,)
    print(f"{args.n} elements, 4 ranks, beta1 0.9; per step count: |residual|/|increment|, momentum error, path error")
    print("| spread | block | normalized | " + " | ".join(f"after {s}" for s in marks) + " |")
    print("|---|---|---|" + "---|" * len(marks))
    for spread, block, normalized in CASES:
        r = simulate(spread, block, normalized, args.steps, args.n, checkpoints=marks)
        cells = " | ".join(f"{e:.1f}, {m:.2f}, {p:.3f}" for e, m, p in (r[s] for s in marks))
        print(f"| {spread} | {block} | {'yes' if normalized else 'no'} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
