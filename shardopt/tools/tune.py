"""`shardopt tune`: measures the user's model over a grid of bucket sizes and recommends one.

Runs on every rank. Each grid point builds a fresh model and times a few steps on the user's example
batch, in rounds (the noise drifts); a point's time is its median on the slowest rank. At stage 3 the
reduce bucket is the unit of gathering: reduce sizes only, with the bytes gathered at once and those
mapped from the shards (Note [Stage-3 buckets mapped, not copied] in parallel/shared_memory.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from typing import Callable, Sequence

import torch


STAGE3_ALLGATHER = ("at stage 3 a bucket is all-gathered whole before its first module runs: allgather_bucket_size "
                    "changes nothing there; the reduce bucket is the unit of gathering, so tune --reduce-sizes alone")


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One measured configuration: bucket sizes in elements, the buckets the layout made, staging bytes per
    rank, the median step time in seconds (slowest rank), and at stage 3 the most bytes gathered at once
    and those mapped from the shards."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    buckets: int
    staging_bytes: int
    step_time: float
    gathered_bytes: int = 0
    mapped_bytes: int = 0


def grid(reduce_sizes: Sequence[int], allgather_sizes: Sequence[int] | None) -> list[tuple[int, int]]:
    """(reduce, allgather) pairs; allgather None = the same as reduce. An all-gather never spans
    reduce buckets, so allgather sizes above the reduce size are the same point and are dropped."""
    out = []
    for r in reduce_sizes:
        for a in (allgather_sizes or [r]):
            if a <= r and (r, a) not in out:
                out.append((r, a))
    if not out:
        raise ValueError("the grid is empty: every allgather size is larger than every reduce size")
    return out


def recommend(points: Sequence[GridPoint]) -> GridPoint:
    """The measured best (lowest median step time; ties: fewer staging and gathered bytes)."""
    return min(points, key=lambda p: (p.step_time, p.staging_bytes + p.gathered_bytes))


def load_batch(spec: str | None, factory_spec: str) -> Callable[[], tuple]:
    """The example-batch function: --batch, else `example_batch` in the factory's module."""
    from shardopt.estimate import load_factory

    if spec is None:
        module = factory_spec.partition(":")[0]
        try:
            return load_factory(f"{module}:example_batch")
        except AttributeError:
            raise ValueError(f"tune needs an example input: pass --batch module:function (a function returning "
                             f"the model's positional inputs), or define example_batch() in '{module}'") from None
    return load_factory(spec)


def _loss(out) -> torch.Tensor:
    if isinstance(out, dict):
        out = next(v for v in out.values() if torch.is_tensor(v))
    if isinstance(out, (tuple, list)):
        out = next(v for v in out if torch.is_tensor(v))
    return out if out.dim() == 0 else out.float().pow(2).mean()


def _time_point(factory, inputs, stage, rbs, agbs, steps, warmup):
    import torch.distributed as dist

    import shardopt

    torch.manual_seed(0)
    model = factory()
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-6, stage=stage,
                                    reduce_bucket_size=rbs, allgather_bucket_size=agbs)
    wrapper = shardopt.ShardedDDP(model, opt)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        _loss(wrapper(*inputs)).backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    gathered = opt.store.peak_live if opt.params_sharded else 0
    mapped = opt.store.mapped_bytes() if opt.params_sharded else 0
    info = (len(opt.layout.buckets), opt.memory_stats()["staging"], gathered, mapped)
    return times, info


def run(factory_spec: str, batch_spec: str | None, reduce_sizes, allgather_sizes, stage: int = 2,
        steps: int = 3, rounds: int = 2, warmup: int = 1, out_dir: str = ".", log=print) -> dict:
    """Measures the grid on every rank; rank 0 prints and writes the table, the PNG and the snippet.

    Returns {"points": [...], "best": GridPoint, "png": path, "report": path} (paths on rank 0 only).
    """
    import torch.distributed as dist

    from shardopt.estimate import load_factory
    from shardopt.tools.plotting import require_matplotlib

    rank = dist.get_rank()
    if stage == 3 and allgather_sizes:
        raise ValueError(STAGE3_ALLGATHER)
    if rank == 0:
        require_matplotlib()  # fail before minutes of measuring, not after
    factory = load_factory(factory_spec)
    make_batch = load_batch(batch_spec, factory_spec)
    inputs = make_batch()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    pairs = grid(reduce_sizes, allgather_sizes)
    samples = {p: [] for p in pairs}
    info = {}
    for rnd in range(rounds):
        for i, (rbs, agbs) in enumerate(pairs):
            times, info[(rbs, agbs)] = _time_point(factory, inputs, stage, rbs, agbs, steps, warmup)
            samples[(rbs, agbs)] += times
            if rank == 0:
                log(f"  round {rnd + 1}/{rounds}, point {i + 1}/{len(pairs)}: reduce {rbs:,} allgather {agbs:,}: "
                    f"{statistics.median(times) * 1e3:.1f} ms/step")
    med = torch.tensor([statistics.median(samples[p]) for p in pairs], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    points = [GridPoint(rbs, agbs, info[(rbs, agbs)][0], info[(rbs, agbs)][1], float(t), *info[(rbs, agbs)][2:])
              for (rbs, agbs), t in zip(pairs, med.tolist())]
    best = recommend(points)
    result = {"points": points, "best": best, "png": None, "report": None}
    if rank == 0:
        result.update(_write(points, best, factory_spec, stage, dist.get_world_size(), out_dir, log))
    return result


def snippet(best: GridPoint, stage: int) -> str:
    if stage == 3:
        return (f"shardopt.ShardedOptimizer(params, stage=3, reduce_bucket_size={best.reduce_bucket_size:_}, ...)\n"
                f"# or in a DeepSpeed config: \"zero_optimization\": {{\"stage\": 3, "
                f"\"reduce_bucket_size\": {best.reduce_bucket_size}}}")
    return (f"shardopt.ShardedOptimizer(params, stage={stage}, reduce_bucket_size={best.reduce_bucket_size:_}, "
            f"allgather_bucket_size={best.allgather_bucket_size:_}, ...)\n"
            f"# or in a DeepSpeed config: \"zero_optimization\": {{\"stage\": {stage}, "
            f"\"reduce_bucket_size\": {best.reduce_bucket_size}, "
            f"\"allgather_bucket_size\": {best.allgather_bucket_size}}}")


def table(points: Sequence[GridPoint], best: GridPoint, stage: int = 2) -> str:
    second = "gathered MiB (peak; mapped)" if stage == 3 else "allgather_bucket_size"
    lines = [f"| reduce_bucket_size | {second} | buckets | staging MiB | step ms | x best |",
             "|---|---|---|---|---|---|"]
    for p in points:
        mark = " **best**" if p == best else ""
        col = f"{p.gathered_bytes / 2**20:.2f}; {p.mapped_bytes / 2**20:.2f}" if stage == 3 \
            else f"{p.allgather_bucket_size:,}"
        lines.append(f"| {p.reduce_bucket_size:,} | {col} | {p.buckets} | "
                     f"{p.staging_bytes / 2**20:.1f} | {p.step_time * 1e3:.1f} | "
                     f"{p.step_time / best.step_time:.2f}{mark} |")
    return "\n".join(lines)


def _write(points, best, factory_spec, stage, world_size, out_dir, log) -> dict:
    from shardopt.tools.plotting import line_chart

    os.makedirs(out_dir, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    png = os.path.join(out_dir, f"tune-{stamp}.png")
    series: dict[str, list] = {}
    for p in points:
        label = "ZeRO-3" if stage == 3 else "allgather = reduce" \
            if p.allgather_bucket_size == p.reduce_bucket_size else f"allgather {p.allgather_bucket_size:,}"
        series.setdefault(label, []).append((p.reduce_bucket_size, p.step_time * 1e3))
    line_chart(png, f"{factory_spec}: ZeRO-{stage}, {world_size} ranks", "reduce_bucket_size (elements)",
               "median step time (ms)", series, logx=True, mark=(best.reduce_bucket_size, best.step_time * 1e3))
    text = (f"# shardopt tune — {factory_spec}, ZeRO-{stage}, {world_size} ranks, "
            f"{datetime.date.today().isoformat()}\n\n{table(points, best, stage)}\n\nRecommended:\n\n```python\n"
            f"{snippet(best, stage)}\n```\n\n![step time]({os.path.basename(png)})\n")
    report = os.path.join(out_dir, f"tune-{stamp}.md")
    with open(report, "w") as f:
        f.write(text)
    log("\n" + table(points, best, stage) + "\n\nRecommended (lowest median step time):\n" + snippet(best, stage)
        + f"\n\nwrote {report} and {png}")
    return {"png": png, "report": report}
