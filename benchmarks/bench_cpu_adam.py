"""How fast is shardopt.CPUAdam next to torch's AdamW and the memory-bandwidth limit?

    python benchmarks/bench_cpu_adam.py            # full run: 1M, 10M, 100M params (~2 GB per optimizer at 100M)
    python benchmarks/bench_cpu_adam.py --quick    # < 30 s demo: 1M params only, 3 repeats
    python benchmarks/bench_cpu_adam.py --runs 3   # the full run three times, then medians over runs

For every (total size, layout, thread count) it builds one set of parameters
and gradients per contender, checks that all contenders' first steps agree,
then times optimizer steps round-robin (A B C A B C ...) so that machine noise
hits all of them alike, and reports medians. Layouts: one flat tensor, and the
same total split over ~200 tensors of mixed sizes (a model's parameter list).

Contenders: shardopt.CPUAdam; torch.optim.AdamW (default implementation, the
per-tensor for-loop on CPU); torch.optim.AdamW(fused=True); DeepSpeedCPUAdam if
deepspeed is importable and its op builds (else the header says why); and the
bandwidth limit, torch.ops.shardopt.stream_limit, which moves Adam's 28 bytes
per parameter (read param, grad, exp_avg, exp_avg_sq; write param, exp_avg,
exp_avg_sq) with no math, over all tensors in one at::parallel_for pass like
CPUAdam.
"""
import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

import shardopt

BYTES_PER_PARAM = 28
LR, WD = 1e-3, 0.01


def mixed_sizes(total, count, seed=0):
    """`count` sizes summing to `total`, log-uniform over three decades (matrices and biases)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.rand(count, generator=gen, dtype=torch.float64) * math.log(1000.0))
    sizes = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
    sizes[sizes.index(max(sizes))] += total - sum(sizes)
    return sizes


class Contender:
    """One optimizer (or the limit kernel) with its own parameters, grads and state."""

    def __init__(self, name, sizes, init, make_opt):
        self.name = name
        self.params = [torch.nn.Parameter(x.clone()) for x in init]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        self.opt = make_opt(self.params)

    def step(self):
        self.opt.step()


class StreamLimit:
    """Adam's memory traffic with no math (csrc/adam/stream_limit.cpp)."""

    def __init__(self, params):
        self.p = params
        self.g = [p.grad for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def step(self):
        with torch.no_grad():
            torch.ops.shardopt.stream_limit(self.p, self.g, self.m, self.v)


def contenders_for(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    makers = {
        "shardopt.CPUAdam": lambda ps: shardopt.CPUAdam(ps, lr=LR, weight_decay=WD, adamw=True),
        "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True),
    }
    ds_cls, _ = deepspeed_cpu_adam()
    if ds_cls is not None:
        makers["DeepSpeedCPUAdam"] = lambda ps: ds_cls(ps, lr=LR, weight_decay=WD, adamw_mode=True)
    out = [Contender(name, sizes, init, make) for name, make in makers.items()]
    out.append(Contender("limit (stream 28 B/param)", sizes, init, StreamLimit))
    return out


def check_agreement(contenders):
    """One step of every optimizer from identical inputs must give the same params."""
    for c in contenders:
        c.step()
    ref = next(c for c in contenders if c.name == "torch AdamW fused")
    for c in contenders:
        if c.name.startswith("limit") or c is ref:
            continue
        for a, b in zip(c.params, ref.params):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{c.name} disagrees with torch fused AdamW: {m}")


def time_round_robin(contenders, repeats, target_s):
    """Seconds per step, one list per contender; each sample averages enough steps to last ~target_s."""
    inner = {}
    for c in contenders:  # calibrate (also a warm-up)
        t0 = time.perf_counter()
        c.step()
        inner[c.name] = max(1, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    samples = {c.name: [] for c in contenders}
    for _ in range(repeats):
        for c in contenders:
            n = inner[c.name]
            t0 = time.perf_counter()
            for _ in range(n):
                c.step()
            samples[c.name].append((time.perf_counter() - t0) / n)
    return samples


def run_case(total, layout, threads, repeats, target_s):
    sizes = [total] if layout == "flat" else mixed_sizes(total, 200)
    torch.set_num_threads(threads)
    contenders = contenders_for(sizes)
    check_agreement(contenders)
    samples = time_round_robin(contenders, repeats, target_s)
    limit = statistics.median(samples["limit (stream 28 B/param)"])
    fused = samples["torch AdamW fused"]
    rows = []
    for c in contenders:
        s = samples[c.name]
        med = statistics.median(s)
        # Ratio to torch fused from the same round (both timed back to back), then the median.
        ratio = statistics.median(f / x for f, x in zip(fused, s))
        rows.append(dict(total=total, layout=f"{layout} ({len(sizes)})", threads=threads, name=c.name,
                         ms=med * 1e3, gparams=total / med / 1e9, gbs=total * BYTES_PER_PARAM / med / 1e9,
                         pct=100.0 * limit / med, ratio=ratio))
    del contenders
    return rows


def fmt_total(n):
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n / 1e6:g}M"


HEADER = ("| params | layout (tensors) | threads | optimizer | ms/step (median) | Gparam/s | GB/s @28B "
          "| % of limit | x torch fused |")


def print_row(r):
    print(f"| {fmt_total(r['total'])} | {r['layout']} | {r['threads']} | {r['name']} | {r['ms']:.2f} | "
          f"{r['gparams']:.3f} | {r['gbs']:.1f} | {r['pct']:.0f}% | {r['ratio']:.2f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 30 s)")
    ap.add_argument("--sizes", type=float, nargs="*", help="totals in millions of params")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat every case this many times, one pass over all cases after another, and end with "
                         "the median over runs (noise that hits one case in one run then cannot decide it)")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([1] if args.quick else [1, 10, 100])
    repeats = args.repeats or (3 if args.quick else 7)
    target_s = 0.02 if args.quick else 0.1

    print(f"# shardopt CPU Adam benchmark ({'quick' if args.quick else 'full'})\n")
    print(f"- machine: {platform.processor() or platform.machine()}, {_cpu_model()}, "
          f"torch {torch.__version__}, Python {platform.python_version()}")
    print(f"- shardopt ISA: {shardopt.cpu_features()}; torch threads tested: {args.threads}")
    _, ds_problem = deepspeed_cpu_adam()
    print(f"- DeepSpeedCPUAdam: {'included' if ds_problem is None else 'skipped: ' + ds_problem}")
    print(f"- {repeats} round-robin repeats per case; medians; 'x torch fused' = median over repeats of "
          "(torch fused time / this time), >1 is faster")
    runs = []
    for run in range(args.runs):
        print(f"\n## Run {run + 1} of {args.runs} (load average at start: {_load()})\n")
        print(HEADER)
        print("|" + "---|" * 9)
        rows = []
        for total in sizes:
            for layout in ("flat", "split"):
                for threads in args.threads:
                    for r in run_case(int(total * 1_000_000), layout, threads, repeats, target_s):
                        print_row(r)
                        rows.append(r)
        runs.append(rows)
    if len(runs) > 1:
        print(f"\n## Median over the {len(runs)} runs (load average at end: {_load()})\n")
        print(HEADER)
        print("|" + "---|" * 9)
        for r in median_over_runs(runs):
            print_row(r)
    return runs


def median_over_runs(runs):
    """Per case and contender: the median of each run's ms, % of limit and in-run ratio."""
    out = []
    for same in zip(*runs):
        ms = statistics.median(r["ms"] for r in same)
        r = dict(same[0], ms=ms, gparams=same[0]["total"] / ms / 1e6,
                 gbs=same[0]["total"] * BYTES_PER_PARAM / ms / 1e6,
                 pct=statistics.median(r["pct"] for r in same), ratio=statistics.median(r["ratio"] for r in same))
        out.append(r)
    return out


def _load():
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


_DEEPSPEED = None


def deepspeed_cpu_adam():
    """(DeepSpeedCPUAdam, None) if it imports and its C++ op builds, else (None, why not).

    Its op is JIT-built with ninja on first use, so the check constructs one on
    a tiny tensor. DeepSpeedCPUAdam runs on the CPU whatever the accelerator,
    but without a GPU DeepSpeed only starts with DS_ACCELERATOR=cpu.
    """
    global _DEEPSPEED
    if _DEEPSPEED is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as e:
            _DEEPSPEED = (None, f"deepspeed is not importable ({e})")
        else:
            try:
                DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
                _DEEPSPEED = (DeepSpeedCPUAdam, None)
            except Exception as e:  # its op failed to build or load: say why in the report
                _DEEPSPEED = (None, f"its CPU Adam op did not build/load: {type(e).__name__}: {e}")
    return _DEEPSPEED


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f", {torch.get_num_threads()} threads max"
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main(sys.argv[1:])
