"""The int8 hop's codec: fused (csrc/comm/int8_codec.cpp) against the composed ATen version it replaced.

    python benchmarks/bench_codec.py                       # 4M elements, 1 and 2 threads
    python benchmarks/bench_codec.py --numel 1048576 --threads 1 --trials 31

Three operations on one fp32 array of --numel elements, each as the hop does it
(Note [Compressed inter-node hop] in csrc/comm/replica_hop.h):
  encode+feedback  x + residual encoded, the residual left with what the rounding lost
                   (phase 1: every part a rank sends; phase 2: the owner's sum)
  decode-add       a received message decoded and added to the fp32 sum (phase 1)
  decode           a received message decoded into the chunk (phase 2)
"hop codec" is their sum: per element of a message, what a sender and a receiver do.

"composed" is the int8 codec as it was before it was fused (commit 6483495,
csrc/comm/replica_hop.cpp: hop_encode / hop_decode and the feedback around
them), transcribed op for op into torch calls: the same ATen kernels, the same
allocations. Correctness comes first: both versions' outputs are compared with
shardopt.reference bit for bit before anything is timed. Timing is interleaved
(Note [Turns] in bench_step.py, in small): every trial runs each version once,
in alternating order, so the machine's noise hits both alike; the tables give
medians over trials.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardopt  # noqa: E402
from shardopt import _C  # noqa: E402
from shardopt.reference import int8_decode_reference, int8_encode_feedback_reference  # noqa: E402

BLOCK = 256


# ------------------------------------------------------------------ the composed version (before fusion)
def _as_blocks(x):
    m = x.numel()
    nb = -(-m // BLOCK)
    if nb * BLOCK == m:
        return x.view(nb, BLOCK)
    padded = torch.zeros(nb * BLOCK, dtype=x.dtype)
    padded[:m].copy_(x)
    return padded.view(nb, BLOCK)


def composed_encode(x):
    m = x.numel()
    nb = -(-m // BLOCK)
    payload = torch.empty(nb * 4 + m, dtype=torch.uint8)
    rows = _as_blocks(x)
    scale = rows.abs().amax(1).div_(127.0)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    q = rows.mul(inv.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    payload[:nb * 4].view(torch.float32).copy_(scale)
    payload[nb * 4:].view(torch.int8).copy_(q.view(-1)[:m])
    return payload


def composed_decode(payload, m):
    nb = -(-m // BLOCK)
    scale = payload[:nb * 4].view(torch.float32)
    q = _as_blocks(payload[nb * 4:].view(torch.int8).to(torch.float32))
    return q.mul_(scale.unsqueeze(1)).view(-1)[:m]


def composed_encode_feedback(part, residual):
    x = part.to(torch.float32)
    x = x.add(residual)
    payload = composed_encode(x.contiguous())
    torch.sub(x, composed_decode(payload, part.numel()), out=residual)
    return payload


def composed_decode_add(payload, out):
    out.add_(composed_decode(payload, out.numel()))


def composed_decode_into(payload, out):
    out.copy_(composed_decode(payload, out.numel()))


# ------------------------------------------------------------------ the fused version
def fused_encode_feedback(part, residual):
    return _C.int8_encode(part, residual)


def fused_decode_add(payload, out):
    _C.int8_decode(payload, out, out)


def fused_decode_into(payload, out):
    _C.int8_decode(payload, out)


VERSIONS = {"composed": (composed_encode_feedback, composed_decode_add, composed_decode_into),
            "fused": (fused_encode_feedback, fused_decode_add, fused_decode_into)}
OPS = ("encode+feedback", "decode-add", "decode")


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def check(n: int) -> list[str]:
    """Both versions against shardopt.reference, bitwise; returns the lines to print."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)
    res0 = torch.randn(n, generator=g) * 1e-3
    want_res = res0.clone()
    scale, q, _ = int8_encode_feedback_reference(x, want_res)
    nb = scale.numel()
    base = torch.randn(n, generator=g)
    want_add = int8_decode_reference(scale, q, torch.empty(n), base)
    want_dec = int8_decode_reference(scale, q, torch.empty(n))
    lines = []
    for name, (enc, add, dec) in VERSIONS.items():
        res = res0.clone()
        payload = enc(x, res)
        ok = (torch.equal(_bits(payload[:4 * nb].view(torch.float32)), _bits(scale))
              and torch.equal(payload[4 * nb:].view(torch.int8), q) and torch.equal(_bits(res), _bits(want_res)))
        out = base.clone()
        add(payload, out)
        ok_add = torch.equal(_bits(out), _bits(want_add))
        dec(payload, out)
        ok_dec = torch.equal(_bits(out), _bits(want_dec))
        lines.append(f"- {name}: encode+feedback {'bitwise equal' if ok else 'DIFFERS'}, decode-add "
                     f"{'bitwise equal' if ok_add else 'DIFFERS'}, decode {'bitwise equal' if ok_dec else 'DIFFERS'}"
                     " to shardopt.reference")
        if not (ok and ok_add and ok_dec):
            raise SystemExit("\n".join(lines) + "\nnot timing a version that computes something else")
    return lines


def measure(n: int, threads: int, trials: int, warmup: int = 3) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    state = {name: {"res": torch.zeros(n), "out": torch.randn(n, generator=g)} for name in VERSIONS}
    times = {(name, op): [] for name in VERSIONS for op in OPS}
    names = list(VERSIONS)
    for t in range(warmup + trials):
        order = names if t % 2 == 0 else names[::-1]
        for name in order:
            enc, add, dec = VERSIONS[name]
            s = state[name]
            t0 = time.perf_counter()
            payload = enc(x, s["res"])
            t1 = time.perf_counter()
            add(payload, s["out"])
            t2 = time.perf_counter()
            dec(payload, s["out"])
            t3 = time.perf_counter()
            if t >= warmup:
                for op, dt in zip(OPS, (t1 - t0, t2 - t1, t3 - t2)):
                    times[(name, op)].append(dt)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--trials", type=int, default=21)
    args = ap.parse_args(argv)
    n = args.numel
    print(f"# int8 hop codec, fused vs composed — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    features = shardopt.cpu_features()
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
          f"torch {torch.__version__}, ISA variant {features['active']} (of {', '.join(features['supported'])}), "
          f"load average at start {os.getloadavg()[0]:.1f}. "
          f"`python benchmarks/bench_codec.py --numel {n} --threads {args.threads} --trials {args.trials}`: "
          f"{n:,} fp32 elements ({n * 4 / 2**20:.0f} MiB), medians of {args.trials} interleaved trials.\n")
    print("Correctness first (a 100,003-element input spanning five decades, short last block):\n")
    print("\n".join(check(100_003)) + "\n")
    print("| threads | operation | composed ms | fused ms | speed-up | fused GB/s moved |")
    print("|---|---|---|---|---|---|")
    # Bytes each fused operation must move: encode reads x and r, writes r, q and scales;
    # decode-add reads q, scales and out, writes out; decode reads q, scales, writes out.
    scales = -(-n // BLOCK) * 4
    moved = {"encode+feedback": 12 * n + n + scales, "decode-add": n + scales + 8 * n, "decode": n + scales + 4 * n}
    for threads in [int(t) for t in args.threads.split(",")]:
        ms = measure(n, threads, args.trials)
        for op in OPS + ("hop codec",):
            if op == "hop codec":
                c = sum(ms[("composed", o)] for o in OPS)
                f = sum(ms[("fused", o)] for o in OPS)
                gb = sum(moved.values()) / f / 1e6
            else:
                c, f = ms[("composed", op)], ms[("fused", op)]
                gb = moved[op] / f / 1e6
            label = f"**{op}**" if op == "hop codec" else op
            print(f"| {threads} | {label} | {c:.2f} | {f:.2f} | {c / f:.1f}x | {gb:.1f} |")
    print(f"\nLoad average at end {os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
    main()
