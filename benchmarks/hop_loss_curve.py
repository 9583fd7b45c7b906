"""Does compressing the inter-node hop change training? Loss curves of hybrid sharding with an exact fp32,
a bf16 and an int8 hop, on real text.

A small byte-level GPT (vocab 256) trains on this repository's own source
(shardopt/**/*.py, csrc/**, tests/**/*.py, README.md, read at run time) on 4
ranks over gloo on 127.0.0.1, as a (2 replicate) x (2 shard) mesh: ranks 0-1
are "node 0", ranks 2-3 "node 1", and the gradient of every step takes the
inter-node hop between them (Note [Hybrid sharding] in shardopt/parallel/mesh_plan.py).
The runs differ only in `inter_node_dtype`: same weights, same data, same
order (Note [Same data for every run]). AdamW, gradients clipped at 1.0.

Writes benchmarks/results/<date>-hop-loss.md (final loss of each run = the
mean of its last 20 steps, relative difference to the fp32 hop, pass if
within 1%) and <date>-hop-loss.png (smoothed curves on the same axes).

    python benchmarks/hop_loss_curve.py                 # 300 steps per run, ~5 min on 2 quiet cores
    python benchmarks/hop_loss_curve.py --steps 30 --out-dir /tmp    # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import glob
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from shardopt.tools.gpt import GPT, GPTConfig, num_params  # noqa: E402
from shardopt.cluster.ranks import run_ranks  # noqa: E402

# Byte-level: every byte is a token. 0.84M parameters; a step of 8 x 128 tokens per rank
# takes ~0.3 s at 4 ranks on 2 cores (a run of 300 steps: ~90 s of training, ~100 s in all).
CONFIG = GPTConfig(vocab=256, dim=128, layers=4, heads=4, seq=128)
MESH = (2, 2)  # (replicate, shard): 2 "nodes" of 2 ranks
RUNS = {"fp32 hop (exact)": None, "bf16 hop": torch.bfloat16, "int8 hop": "int8"}
CORPUS_GLOBS = ("shardopt/**/*.py", "csrc/**/*", "tests/**/*.py", "README.md")
LR, WD, CLIP = 1e-3, 0.1, 1.0
TAIL = 20          # final loss = mean of the last TAIL steps (also the smoothing window)
TOLERANCE = 0.01   # pass: final loss within 1% of the fp32 hop's
HOLDOUT_EVERY = 10  # every 10th file (sorted by path) is held out for the evaluation loss
EVAL_BATCHES = 4


# Note [Same data for every run]
# The corpus is read once in the parent and handed to every rank of every run.
# The windows of step s on rank r come from a generator seeded with (seed, s, r)
# alone, so all runs see the same windows in the same order, and each rank of a
# run sees different ones (data parallelism). Whole files are held out, not the
# corpus' tail: sorted by path, the tail would be tests only.
def read_corpus(root: str = REPO, at: str | None = None) -> tuple[bytes, bytes, list[str]]:
    """(training bytes, held-out bytes, files read) of the repository's source, files in path order: the
    working tree's, or with `at` (a git revision) the files as committed there, so that runs on other days
    read the same text (the source grows every day, and the benchmark's losses with it)."""
    if at is not None:  # the revision's tree, unpacked, read as a working tree
        archive = subprocess.run(["git", "-C", root, "archive", "--format=tar", at], check=True,
                                 capture_output=True).stdout
        with tempfile.TemporaryDirectory() as tree:
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tree, filter="data")
            return read_corpus(tree)
    paths = sorted({p for g in CORPUS_GLOBS for p in glob.glob(os.path.join(root, g), recursive=True)
                    if os.path.isfile(p)})
    train, held, used = [], [], []
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        if b"\0" in data:  # a build product that landed under csrc/: not text
            continue
        used.append(os.path.relpath(p, root))
        (held if len(used) % HOLDOUT_EVERY == 0 else train).append(data)
    return b"\n".join(train), b"\n".join(held), used


def windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """`batch` random windows of seq + 1 bytes: (inputs, next-byte targets)."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    idx = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return idx[:, :-1], idx[:, 1:]


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)


def _train(rank, world_size, hop_dtype, train_bytes, held_bytes, steps, batch, seed):
    """One run on this rank: per-step loss (mean over ranks), eval loss, train seconds, replicas in sync."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardopt

    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8)
    torch.manual_seed(0)  # same initial weights on every rank and in every run
    model = GPT(CONFIG)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=LR, weight_decay=WD,
                                    fused=True, stage=2, mesh=mesh, inter_node_dtype=hop_dtype)
    losses, ev, seconds = train_and_evaluate(rank, shardopt.ShardedDDP(model, opt), opt, train, held, steps,
                                             batch, seed)
    # The hop's owner encodes each sum once and every replica decodes that encoding, so the replicas
    # should hold bit-equal parameters; a checksum per rank shows whether they do.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(sums, torch.stack([flat.sum(), (flat * torch.arange(flat.numel())).sum()]))
    in_sync = all(torch.equal(s, sums[0]) for s in sums)
    return dict(losses=(losses / world_size).tolist(), eval=ev.item() / world_size, seconds=seconds,
                in_sync=in_sync)


def held_out_loss(ddp, held, batch, rank):
    """This rank's mean loss over the fixed held-out windows (seed -1)."""
    import torch.nn.functional as F

    with torch.no_grad():
        ev = torch.zeros(1)
        for b in range(EVAL_BATCHES):
            x, y = windows(held, batch, CONFIG.seq, _generator(-1, b, rank))
            ev += F.cross_entropy(ddp.module(x).reshape(-1, CONFIG.vocab), y.reshape(-1)) / EVAL_BATCHES
    return ev


def train_and_evaluate(rank, ddp, opt, train, held, steps, batch, seed, scheduler=None, eval_every=0,
                       held_out_at=None, first=0):
    """`steps` clipped steps on the training windows (`scheduler.step()` after each, if given), then the
    held-out loss: fixed windows (seed -1), split over the ranks. Returns (per-step losses, held-out loss),
    each summed over the ranks, and the training seconds. With eval_every = K, the held-out loss is also
    taken after every K-th step (outside the timed training): held_out_at[step] = it, summed over the
    ranks (held_out_at: a dict the caller passes). first: the data step to start from (a run that goes on
    from a checkpoint of `first` steps draws the windows that run would have drawn next)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    if eval_every and held_out_at is None:
        raise ValueError("eval_every: pass held_out_at, the dict that receives the held-out losses")
    losses = torch.zeros(steps)
    evals = torch.zeros(max(0, (steps - 1) // eval_every) if eval_every else 0)  # after steps K, 2K, ... < steps
    dist.barrier()
    t0 = time.perf_counter()
    seconds = 0.0
    for step in range(steps):
        x, y = windows(train, batch, CONFIG.seq, _generator(seed, first + step, rank))
        loss = F.cross_entropy(ddp(x).reshape(-1, CONFIG.vocab), y.reshape(-1))
        loss.backward()
        opt.clip_grad_norm(CLIP)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        losses[step] = loss.detach()
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            seconds += time.perf_counter() - t0
            evals[(step + 1) // eval_every - 1] = held_out_loss(ddp, held, batch, rank)
            t0 = time.perf_counter()
    seconds += time.perf_counter() - t0
    ev = held_out_loss(ddp, held, batch, rank)
    dist.all_reduce(losses)
    dist.all_reduce(ev)
    if evals.numel():
        dist.all_reduce(evals)
        held_out_at.update((eval_every * (i + 1), v) for i, v in enumerate(evals.tolist()))
    return losses, ev, seconds


def smooth(values: list[float], window: int = TAIL) -> list[float]:
    """Trailing mean over `window` steps (shorter at the start): the last point is the reported final loss."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def chart(path: str, results: dict, steps: int) -> None:
    from shardopt.tools.plotting import require_matplotlib

    plt = require_matplotlib()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.2))
    ref = smooth(next(iter(results.values()))["losses"])
    for name, r in results.items():
        s = smooth(r["losses"])
        ax.plot(range(1, steps + 1), s, label=name, linewidth=1.3)
        dx.plot(range(1, steps + 1), [100 * (a / b - 1) for a, b in zip(s, ref)], label=name, linewidth=1.3)
    for bound in (-100 * TOLERANCE, 100 * TOLERANCE):
        dx.axhline(bound, color="gray", linestyle="--", linewidth=1)
    ax.set(title=f"training loss (trailing mean of {TAIL} steps)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    dx.set(title=f"relative to the fp32 hop's (same smoothing; dashed: ±{TOLERANCE:.0%})", xlabel="step",
           ylabel="loss difference (%)")
    for a in (ax, dx):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"Hybrid sharding {MESH[0]}x{MESH[1]}: does compressing the inter-node hop change training?")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(results: dict, args, corpus: tuple[int, int, int], params: int) -> list[str]:
    from shardopt.parallel.mesh_plan import MeshShape, hop_link_bytes

    names = list(results)
    ref_name = names[0]
    final = {n: sum(r["losses"][-TAIL:]) / len(r["losses"][-TAIL:]) for n, r in results.items()}
    shape = MeshShape(*MESH)
    hop = {None: None, torch.bfloat16: "bfloat16", "int8": "int8"}
    lines = [f"# Inter-node hop compression: loss curves — {datetime.date.today().isoformat()}", "",
             f"`python benchmarks/hop_loss_curve.py --steps {args.steps} --batch {args.batch} --seed {args.seed}` "
             f"at commit {_git_head()}. Machine: {platform.machine()}, {os.cpu_count()} cores, load average at "
             f"start {args.load:.1f}, torch {torch.__version__}, gloo over 127.0.0.1, 1 thread per rank.", "",
             f"Model: byte-level GPT ({CONFIG}), {params:,} parameters. Data: this repository's source "
             f"({corpus[2]} files: {', '.join(CORPUS_GLOBS)}; {corpus[0]:,} training bytes, every "
             f"{HOLDOUT_EVERY}th file held out: {corpus[1]:,} bytes), {args.batch} random windows of "
             f"{CONFIG.seq} bytes per rank per step, the same windows in every run. 4 ranks as a "
             f"{shape} mesh (`mesh=init_device_mesh(\"cpu\", {MESH}, mesh_dim_names=(\"replicate\", \"shard\"))`), "
             f"ZeRO-2, AdamW(lr={LR}, weight_decay={WD}, fused=True), `clip_grad_norm({CLIP})`. Loss: mean over "
             f"the 4 ranks of each step's training loss. Final = mean of the last {TAIL} steps; pass = within "
             f"{TOLERANCE:.0%} of the fp32 hop's. Held-out: {EVAL_BATCHES} x {args.batch} fixed windows per rank "
             "from the held-out files after the last step.", "",
             f"| run | `inter_node_dtype` | hop MB per node per step (arithmetic) | final loss (last {TAIL}) | "
             "vs fp32 hop | within 1% | held-out loss | vs fp32 hop | replicas bit-equal | train s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        rel = final[n] / final[ref_name] - 1
        erel = r["eval"] / results[ref_name]["eval"] - 1
        dtype = RUNS[n]
        mb = hop_link_bytes(shape, 4 * params, hop[dtype]) / 1e6
        lines.append(f"| {n} | `{dtype!r}` | {mb:.2f} | {final[n]:.4f} | {rel:+.2%} | "
                     f"{'pass' if abs(rel) <= TOLERANCE else '**FAIL**'} | {r['eval']:.4f} | {erel:+.2%} | "
                     f"{'yes' if r['in_sync'] else '**no**'} | {r['seconds']:.0f} | {r['wall']:.0f} |")
    first = {n: r["losses"][0] for n, r in results.items()}
    lines += ["", "Loss at step 1 (before any update; must be equal): "
              + ", ".join(f"{n} {v:.5f}" for n, v in first.items()) + ". "
              "train s = the training loop on the slowest rank; wall s = the whole run (spawning 4 processes, "
              "the mesh, the held-out evaluation).", "",
              f"![loss curves]({os.path.basename(args.png)})", ""]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--seed", type=int, default=0, help="data order (the same for every run)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = ap.parse_args()
    if args.steps < TAIL:
        ap.error(f"--steps must be at least {TAIL} (the final loss averages the last {TAIL} steps)")
    date = datetime.date.today().isoformat()
    args.md = os.path.join(args.out_dir, f"{date}-hop-loss.md")
    args.png = os.path.join(args.out_dir, f"{date}-hop-loss.png")
    args.load = os.getloadavg()[0]
    train, held, files = read_corpus()
    params = num_params(GPT(CONFIG))
    print(f"corpus: {len(files)} files, {len(train):,} training bytes, {len(held):,} held out; "
          f"model {params:,} parameters", flush=True)
    results = {}
    for name, dtype in RUNS.items():
        t0 = time.time()
        per_rank = run_ranks(_train, MESH[0] * MESH[1], dtype, train, held, args.steps, args.batch, args.seed,
                             timeout=3600, collective_timeout=600)
        r = per_rank[0]
        r["seconds"] = max(p["seconds"] for p in per_rank)
        r["wall"] = time.time() - t0
        results[name] = r
        print(f"{name}: final loss {sum(r['losses'][-TAIL:]) / TAIL:.4f}, held-out {r['eval']:.4f}, "
              f"train {r['seconds']:.0f} s, wall {r['wall']:.0f} s, replicas in sync: {r['in_sync']}", flush=True)
    chart(args.png, results, args.steps)
    lines = report(results, args, (len(train), len(held), len(files)), params)
    with open(args.md, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[-len(RUNS) - 6:]))
    print(f"wrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
