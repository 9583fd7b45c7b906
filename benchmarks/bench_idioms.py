"""The everyday torch idioms over model.parameters() under ShardedDDP, against DDP + torch.optim doing the same.

    python benchmarks/bench_idioms.py                              # 500 and 8000 tensors, 2 ranks
    python benchmarks/bench_idioms.py --tensors 500,2000,8000 --idioms all --out benchmarks/results/DATE-idioms.md
    python benchmarks/bench_idioms.py --quick

The model is an MLP of many small layers (N/2 Linear(16, 16) + tanh, N parameter
tensors): the per-tensor cost of a loop's idioms is all there is to see. Every
variant trains its own copy (same seed, same data) in the same 2 processes,
taking turns round-robin as benchmarks/bench_step.py does (Note [Turns] there), each
round starting with the next variant (Note [Rotating turns]):
  * DDP + AdamW(fused=True), the torch idioms;
  * shardopt ZeRO-2 + AdamW(fused=True), the same torch idioms (what the HF
    Trainer, accelerate and most loops run);
  * shardopt ZeRO-2, its own calls: opt.clip_grad_norm(1.0), opt.zero_grad().
The idioms (--idioms): "clip" = clip_grad_norm_(model.parameters(), 1.0), step,
model.zero_grad() (the Trainer's loop); "all" = a torch.amp.GradScaler too
(scale, unscale_, step, update) and clip_grad_value_ before clip_grad_norm_
(shardopt's own-call variant then also uses the GradScaler).
Per round: each variant's mean step over its turn, on the slowest rank; the
table gives medians over rounds and the per-round ratios' median and range.
Each round also times torch's clip_grad_norm_ alone twice: over one-element
plain tensors (Note [The idioms' floor]) and over gradients whose handlers cost
nothing (Note [The reachable floor]): 1 + the latter's share of the own-call
step is the lowest torch-idiom / own-call ratio any implementation behind
torch's function can reach.
Correctness first: the loss of each variant against DDP's at every step.
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

from shardopt.cluster.ranks import run_ranks  # noqa: E402

WIDTH = 16
BATCH = 8
DDP_NAME = "DDP + AdamW, torch idioms"
TORCH_NAME = "shardopt ZeRO-2, torch idioms"
OWN_NAME = "shardopt ZeRO-2, opt.clip_grad_norm"
FLOOR_NAME = "torch's clip_grad_norm_ alone, one-element plain tensors (the floor)"
FREE_NAME = "torch's clip_grad_norm_ alone, gradients whose handlers cost nothing (the reachable floor)"


class ManyLayers(torch.nn.Module):
    """`tensors` parameter tensors: tensors / 2 layers Linear(width, width), each followed by tanh."""

    def __init__(self, tensors: int, width: int = WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(tensors // 2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(step: int, rank: int, width: int = WIDTH):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


class Variant:
    """One model, its optimizer and the loop's lines after the forward."""

    def __init__(self, name: str, tensors: int, idioms: str, width: int = WIDTH):
        import shardopt
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        self.module = ManyLayers(tensors, width)
        self.name = name
        self.idioms = idioms
        kw = dict(lr=1e-3, weight_decay=0.1, fused=True)
        if name == DDP_NAME:
            self.model = DDP(self.module)
            self.opt = torch.optim.AdamW(self.module.parameters(), **kw)
        else:
            self.opt = shardopt.ShardedOptimizer(self.module.parameters(), optim=torch.optim.AdamW, stage=2, **kw)
            self.model = shardopt.ShardedDDP(self.module, self.opt)
        self.own = name == OWN_NAME
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if idioms == "all" else None

    def train_step(self, x, y) -> tuple[float, float, float]:
        """(forward+loss, backward, the rest) in seconds; the loss is kept in self.loss."""
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        t1 = time.perf_counter()
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        t2 = time.perf_counter()
        if self.scaler:
            self.scaler.unscale_(self.opt)
        if self.own:
            self.opt.clip_grad_norm(1.0)
        else:
            if self.idioms == "all":
                torch.nn.utils.clip_grad_value_(self.model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.own:
            self.opt.zero_grad()
        else:
            self.model.zero_grad()
        t3 = time.perf_counter()
        self.loss = loss.item()
        return t1 - t0, t2 - t1, t3 - t2


class _Floor:
    """Note [The idioms' floor]: torch's clip_grad_norm_ over `tensors` one-element plain tensors.

    What torch's own Python and per-tensor calls in clip_grad_norm_ cost at this
    tensor count with (almost) no arithmetic, over plain tensors: its
    per-tensor list building, two groupings by device and dtype, a `.to()` per
    norm and a `stack` of N norms. shardopt's own call (opt.clip_grad_norm)
    pays none of it. Over ShardedGrads the norms come in one piece (Note
    [torch's total norm in one piece] in shardopt/sharded_grad.py), so the
    `.to()` and `stack` shares drop out and the torch-idiom step's excess over
    the own-call step can be below this share; what stays is the list
    building, the groupings and two N-tensor lists through __torch_dispatch__.
    """

    def __init__(self, tensors: int):
        self.params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(tensors)]
        for p in self.params:
            p.grad = torch.zeros(1)

    def time(self, turn: int) -> float:
        t0 = time.perf_counter()
        for _ in range(turn):
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        return (time.perf_counter() - t0) / turn


class _FreeGrad(torch.Tensor):
    """A gradient like ShardedGrad (a wrapper subclass in torch's foreach list, Note [Foreach over a shard] in
    shardopt/sharded_grad.py) whose handlers do nothing: _foreach_norm answers with one tensor of zeros made
    ahead (Note [torch's total norm in one piece]), _foreach_mul_ returns at once."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl
    norms: torch.Tensor = torch.zeros(0)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_norm.Scalar:
            return [cls.norms]
        if func is torch.ops.aten._foreach_mul_.Tensor:
            return None
        raise RuntimeError(f"_FreeGrad: {func} not expected in clip_grad_norm_")


class _FreeFloor(_Floor):
    """Note [The reachable floor]: torch's clip_grad_norm_ over the model's parameter shapes, each p.grad a
    _FreeGrad. What that torch function costs at this tensor count when shardopt's handlers take no time:
    its list building, the p.grad reads, two groupings by device and dtype, the foreach-support scans and two
    N-tensor lists through __torch_dispatch__. A torch-idiom step cannot cost less than the own-call step plus
    this (the own call's norm and scaling are work either way), so 1 + this share of the own-call step is the
    lowest ratio any implementation behind torch's function reaches."""

    def __init__(self, tensors: int, width: int):
        from torch.utils import _foreach_utils

        if _FreeGrad not in _foreach_utils._foreach_supported_types:
            _foreach_utils._foreach_supported_types.append(_FreeGrad)
        self.params = list(ManyLayers(tensors, width).parameters())
        for p in self.params:
            p.grad = _FreeGrad(p)
        _FreeGrad.norms = torch.zeros(tensors)


# Note [Rotating turns]
# A variant's turn follows another variant's, whose freed memory its allocations meet (glibc hands
# freed blocks back to the OS; touching fresh pages is expensive on this VM: Note [Turns] in
# bench_step.py). With the order fixed (DDP, torch idioms, own calls) the torch-idiom variant always
# followed DDP and the own-call variant always followed a model of its own size, a bias of its own
# between the two shardopt variants (the torch-idiom backward measured 1.0 ms slower than the own-call
# one at 500 tensors, 2026-11-27, though the two backward passes do the same work). So the order
# rotates: round r starts with variant r mod 3, and over every 3 rounds each variant follows each other
# once.
def _rank(rank, world_size, tensors, width, idioms, rounds, turn, warmup):
    import torch.distributed as dist

    variants = [Variant(n, tensors, idioms, width) for n in (DDP_NAME, TORCH_NAME, OWN_NAME)]
    times = {v.name: [] for v in variants}   # per round: (fwd, bwd, rest) means over the turn
    losses = {v.name: [] for v in variants}
    floors = {FLOOR_NAME: _Floor(tensors), FREE_NAME: _FreeFloor(tensors, width)}
    for name in floors:
        times[name] = []
    for rnd in range(warmup + rounds):
        for name, floor in floors.items():
            t = floor.time(turn)
            if rnd >= warmup:
                times[name].append([0.0, 0.0, t])
        # Note [Rotating turns]: each round starts with another variant.
        for v in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
            dist.barrier()
            acc = [0.0, 0.0, 0.0]
            for k in range(turn):
                x, y = _batch(rnd * turn + k, rank, width)
                for i, t in enumerate(v.train_step(x, y)):
                    acc[i] += t / turn
                losses[v.name].append(v.loss)
            if rnd >= warmup:
                times[v.name].append(acc)
    return times, losses


def _quantiles(xs):
    xs = sorted(xs)
    return statistics.median(xs), xs[0], xs[-1]


def measure(tensors: int, width: int, idioms: str, rounds: int, turn: int, warmup: int = 1) -> list[str]:
    results = run_ranks(_rank, 2, tensors, width, idioms, rounds, turn, warmup, timeout=3600,
                        collective_timeout=600)
    names = [n for n in results[0][0] if n not in (FLOOR_NAME, FREE_NAME)]
    # Per round: the slowest rank's (fwd, bwd, rest, total).
    per_round = {n: [] for n in names}
    for n in names:
        for r in range(rounds):
            parts = [max(res[0][n][r][i] for res in results) for i in range(3)]
            per_round[n].append(parts + [max(sum(res[0][n][r]) for res in results)])
    losses = results[0][1]
    ref = losses[DDP_NAME]
    lines = [f"### {tensors} parameter tensors ({tensors // 2} layers Linear({width}, {width}), "
             f"{tensors // 2 * (width * width + width):,} parameters), idioms '{idioms}', {rounds} rounds of "
             f"{turn} steps per variant", "",
             "| variant | fwd ms | bwd ms | idioms + step ms | total ms | x DDP (median, range over rounds) | "
             "x own calls (median, range) | max abs loss diff to DDP |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        rows = per_round[n]
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        ddp = [a[3] / b[3] for a, b in zip(rows, per_round[DDP_NAME])]
        own = [a[3] / b[3] for a, b in zip(rows, per_round[OWN_NAME])]
        diff = max(abs(a - b) for a, b in zip(losses[n], ref))
        fmt = "{:.3f} ({:.3f}-{:.3f})"
        lines.append(f"| {n} | {med[0] * 1e3:.1f} | {med[1] * 1e3:.1f} | {med[2] * 1e3:.1f} | {med[3] * 1e3:.1f} | "
                     f"{fmt.format(*_quantiles(ddp))} | {fmt.format(*_quantiles(own))} | {diff:.1e} |")
    # The floors, per round on the slowest rank, against that round's own-call step.
    lines.append("")
    for name, note in ((FLOOR_NAME, "The idioms' floor"), (FREE_NAME, "The reachable floor")):
        floor = [max(res[0][name][r][2] for res in results) for r in range(rounds)]
        share = [f / o[3] for f, o in zip(floor, per_round[OWN_NAME])]
        lines += [f"{name}: {statistics.median(floor) * 1e3:.2f} ms per call, {statistics.median(share):.3f} "
                  f"of the own-call step (median; range {min(share):.3f}-{max(share):.3f}; Note [{note}]).", ""]
    free = [max(res[0][FREE_NAME][r][2] for res in results) / o[3] for r, o in enumerate(per_round[OWN_NAME])]
    torch_idioms = [a[3] / b[3] for a, b in zip(per_round[TORCH_NAME], per_round[OWN_NAME])]
    lines.append(f"Torch idioms / own calls {statistics.median(torch_idioms):.3f}; the lowest reachable behind "
                 f"torch's function (1 + the reachable floor's share) {1 + statistics.median(free):.3f}.")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="500,8000", help="comma-separated parameter tensor counts (even)")
    ap.add_argument("--width", type=int, default=WIDTH, help="each layer is Linear(width, width)")
    ap.add_argument("--idioms", default="clip", choices=("clip", "all"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--turn", type=int, default=4, help="consecutive steps per variant in a round")
    ap.add_argument("--quick", action="store_true", help="100 tensors, 3 rounds of 2 steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    counts = [int(v) for v in args.tensors.split(",")]
    if args.quick:
        counts, args.rounds, args.turn = [100], 3, 2
    if any(n < 2 or n % 2 for n in counts):
        ap.error("--tensors: even counts >= 2 (weight and bias per layer)")
    head = [f"# Torch idioms over model.parameters() — {datetime.date.today().isoformat()}", "",
            f"`python benchmarks/bench_idioms.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
            f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, gloo over 127.0.0.1, 2 ranks of 1 thread, "
            f"batch {BATCH}x{args.width} per rank, AdamW(fused=True) in every variant. Baseline: DDP + torch.optim "
            "with the same idioms, interleaved in the same processes.", ""]
    print("\n".join(head), flush=True)
    lines = list(head)
    for n in counts:
        part = measure(n, args.width, args.idioms, args.rounds, args.turn) + [""]
        print("\n".join(part), flush=True)
        lines += part
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
