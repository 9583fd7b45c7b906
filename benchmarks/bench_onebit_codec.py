"""OneBitAdam's 1-bit codec: fused (csrc/comm/onebit_codec.cpp) against the composed ATen version it replaced.

    python benchmarks/bench_onebit_codec.py                 # 1M elements (a 2x2 shard of GPT 'small'), 1 thread
    python benchmarks/bench_onebit_codec.py --numel 4194304 --trials 21

"composed" is shardopt/onebit.py's encode / decode at commit 90f98c2, transcribed, with the block scale made the
mean |x| as the fused codec's since 2026-11-26 (90f98c2 took the RMS; the same passes either way): per
message a dozen ATen passes with allocations. "encode+feedback" is x + residual encoded and the residual left
with what was lost (every message a rank sends); "decode" what a receiver does. Correctness comes first: the
fused messages equal the reference's (tests/test_onebit.py, bit for bit) and the composed version's bits, with
scales equal up to the fp64 summation order. Timing interleaved: each trial runs both once, in alternating
order; medians over trials. Prints a markdown table, then one of the scales OneBitAdam can take
(Note [1-bit format]): encode+feedback with the mean |x| (gain 1), the mean |x| times 1.5 (the default's gain
on the ranks' messages: the same fused pass) and the RMS (PyTorch over the fused codec's signs, then a decode
for the residual), interleaved the same way.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt import onebit  # noqa: E402

BLOCK = onebit.ONEBIT_BLOCK
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def composed_encode(rows: torch.Tensor) -> torch.Tensor:
    k, n = rows.shape
    nb = -(-n // BLOCK)
    a = torch.zeros(k, nb * BLOCK, dtype=torch.float64)
    a[:, :n] = rows
    counts = torch.full((nb,), float(BLOCK), dtype=torch.float64)
    counts[-1] = n - (nb - 1) * BLOCK
    scales = (a.view(k, nb, BLOCK).abs().sum(-1) / counts).float()
    nbytes = -(-n // 8)
    ge = torch.zeros(k, nbytes * 8, dtype=torch.uint8)
    ge[:, :n] = rows >= 0
    bits = (ge.view(k, nbytes, 8) * _BIT_WEIGHTS).sum(-1, dtype=torch.uint8)
    return torch.cat([scales.contiguous().view(torch.uint8), bits], dim=1)


def composed_decode(msgs: torch.Tensor, n: int) -> torch.Tensor:
    k = msgs.shape[0]
    nb = -(-n // BLOCK)
    scales = msgs[:, :4 * nb].reshape(-1).clone().view(torch.float32).view(k, nb)
    bits = msgs[:, 4 * nb:]
    sign = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).reshape(k, -1)[:, :n].float() * 2 - 1
    padded = torch.zeros(k, nb * BLOCK, dtype=torch.float32)
    padded[:, :n] = sign
    return (padded.view(k, nb, BLOCK) * scales.unsqueeze(-1)).view(k, -1)[:, :n]


def composed_encode_feedback(rows: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    v = rows + residual
    msgs = composed_encode(v)
    residual.copy_(v - composed_decode(msgs, rows.shape[1]))
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=11)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = a.numel
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
    fused, comp = onebit.encode(x), composed_encode(x)
    nb = -(-n // BLOCK)
    assert torch.equal(fused[:, 4 * nb:], comp[:, 4 * nb:]), "sign bits differ"
    assert torch.allclose(fused[:, :4 * nb].clone().view(torch.float32), comp[:, :4 * nb].clone().view(torch.float32),
                          rtol=1e-6), "scales differ"
    r1, r2 = torch.zeros(1, n), torch.zeros(1, n)
    ops = {"encode+feedback": (lambda: onebit.encode_feedback(x, r1), lambda: composed_encode_feedback(x, r2)),
           "decode": (lambda: onebit.decode(fused, n), lambda: composed_decode(comp, n))}
    rows = []
    for name, (f, c) in ops.items():
        tf, tc = [], []
        for trial in range(a.trials):
            for which in ((f, tf), (c, tc)) if trial % 2 == 0 else ((c, tc), (f, tf)):
                t = time.perf_counter()
                which[0]()
                which[1].append(time.perf_counter() - t)
        mf, mc = statistics.median(tf) * 1e3, statistics.median(tc) * 1e3
        rows.append(f"| {name} | {mc:.2f} | {mf:.2f} | {mc / mf:.1f}x |")
    print(f"`python benchmarks/bench_onebit_codec.py --numel {n} --threads {a.threads} --trials {a.trials}`: "
          f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}\n")
    print("| operation | composed ms | fused ms | speed-up |\n|---|---|---|---|")
    print("\n".join(rows))
    kinds = {"mean \\|x\\|": dict(scale="mean"), "mean \\|x\\| x 1.5": dict(scale="mean", gain=1.5),
             "RMS": dict(scale="rms")}
    res = {k: torch.zeros(1, n) for k in kinds}
    times = {k: [] for k in kinds}
    for trial in range(a.trials):
        for k in (list(kinds) if trial % 2 == 0 else list(kinds)[::-1]):
            t = time.perf_counter()
            onebit.encode_feedback(x, res[k], **kinds[k])
            times[k].append(time.perf_counter() - t)
    print("\n| encode+feedback, scale | ms |\n|---|---|")
    print("\n".join(f"| {k} | {statistics.median(v) * 1e3:.2f} |" for k, v in times.items()))


if __name__ == "__main__":
    main()
