"""Does 1-bit Adam train like exact Adam? Loss curves of exact AdamW and OneBitAdam (flat 4 ranks and a
2 x 2 mesh) on real text: the small GPT, corpus, data order and evaluation of hop_loss_curve.py.

After `freeze_step` exact-Adam steps (the same as AdamW's, bit for bit) OneBitAdam freezes the variance
and exchanges the momentum at one bit per element (Note [1-bit Adam under ZeRO] in shardopt/onebit.py).
Pass: final loss (mean of the last 20 steps) and held-out loss within 1% of exact AdamW's; the table also
says whether they are at most 1% above it (no worse), since a frozen variance alone can end below AdamW.

    python benchmarks/onebit_loss_curve.py                  # 375 steps (75 warm-up + 300 compressed)
    python benchmarks/onebit_loss_curve.py --steps 40 --freeze 10 --out-dir /tmp
    python benchmarks/onebit_loss_curve.py --control       # + a frozen variance with the exchange exact

The control separates the algorithm's two changes to Adam: freezing the variance (the control differs from
AdamW by that alone) and compressing the momentum (OneBitAdam differs from the control by that alone).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from hop_loss_curve import (CLIP, CONFIG, LR, TAIL, TOLERANCE, WD, _git_head, read_corpus, smooth,  # noqa: E402
                            train_and_evaluate)
from shardopt.cluster.ranks import run_ranks  # noqa: E402
from shardopt.tools.gpt import GPT, num_params  # noqa: E402

# Each OneBitAdam run is compared with the AdamW run on the same mesh (its warm-up must equal it bit for bit).
# With --control, a third run per mesh: OneBitAdam's frozen variance with the exchange exact (the 1-bit
# compression left out), which separates what freezing the variance does from what the compression does.
MESHES = {"2x2 mesh": (2, 2), "flat 4 ranks": None, "4x1 mesh": (4, 1)}  # 4x1: four replicas of one shard
KINDS = {"AdamW": "adamw", "OneBitAdam": "onebit", "frozen variance, exact exchange (control)": "exact"}


def _runs(meshes: str, control: bool) -> dict:
    """meshes: "both" (2x2 and flat) or a comma-separated list of 2x2, flat, 4x1."""
    chosen = ("2x2", "flat") if meshes == "both" else tuple(meshes.split(","))
    unknown = set(chosen) - {m.split()[0] for m in MESHES}
    if unknown:
        raise SystemExit(f"--meshes: unknown {sorted(unknown)}; choose from both, or 2x2, flat, 4x1")
    return {f"{label}, {mesh}": (kind, shape) for mesh, shape in MESHES.items() if mesh.split()[0] in chosen
            for label, kind in KINDS.items() if control or kind != "exact"}


def _reference(name: str) -> str:
    """The AdamW run on the same mesh."""
    return "AdamW, " + name.split(", ")[-1]


def _exact_exchange(state) -> torch.Tensor:
    """The control's exchange: OneBitAdam's step with the momentum formed from the exact mean gradient,
    b1 * m + (1 - b1) * mean(G) on this rank's shard (clipped as OneBitAdam clips), instead of the 1-bit
    exchange of Note [1-bit Adam under ZeRO]. Replaces the room's _exchange in the control run only."""
    import torch.distributed as dist

    opt, b1 = state.opt, state.beta1
    if state.replicas > 1:  # the shard group's mean (reduced by the backward), then the replicas' mean
        g = opt.shard_grad.float().cpu().clone()
        dist.all_reduce(g, group=opt.sharding.replicate)
        g /= state.replicas
    else:  # every rank's local gradient in rows (row r: rank r's shard), summed over the world
        rows = state._rows(state._local_grad()).clone()
        dist.all_reduce(rows, group=opt.process_group)
        g = rows[state.rank] / state.world
    return state.m.float().cpu().mul(b1).add_(g, alpha=(1.0 - b1) * state._coef)


def _pretrain(rank, world_size, train_bytes, held_bytes, steps, batch, seed, lr, path):
    """--pretrain: exact AdamW (flat 4 ranks, ZeRO-2) for `steps` steps, saved for every run to go on from."""
    import shardopt

    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=lr, weight_decay=WD, stage=2)
    ddp = shardopt.ShardedDDP(model, opt)
    _, ev, seconds = train_and_evaluate(rank, ddp, opt, train, held, steps, batch, seed)
    shardopt.save_checkpoint(path, ddp, opt)
    return dict(eval=ev.item() / world_size, seconds=seconds)


def _train(rank, world_size, kind, shape, train_bytes, held_bytes, steps, batch, seed, freeze, schedule, lr,
           block=None, eval_every=0, pretrained=None, first=0):
    from torch.distributed.device_mesh import init_device_mesh

    import shardopt

    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    kw = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))} if shape else {}
    if kind in ("onebit", "exact"):
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=shardopt.OneBitAdam, lr=lr, weight_decay=WD,
                                        betas=(0.9, 0.999), freeze_step=first + freeze, stage=2, **kw)
        if block:  # a diagnosis (--block): the 1-bit format's block size on a hybrid mesh
            import dataclasses

            opt.onebit.config = dataclasses.replace(opt.onebit.config, block=block)
        if kind == "exact":
            import types

            opt.onebit._exchange = types.MethodType(_exact_exchange, opt.onebit)
    else:
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=lr, weight_decay=WD,
                                        stage=2, **kw)
    # "linear": the lr falls linearly to 0 over the run (the Trainer's default schedule), for both optimizers.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps) if schedule == "linear" else None
    evals = {}
    ddp = shardopt.ShardedDDP(model, opt)
    if pretrained:  # --pretrain: go on from AdamW's first `first` steps; OneBitAdam's freeze_step counts them
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (AdamW's state into OneBitAdam: its own options are kept, said)
            shardopt.load_checkpoint(pretrained, ddp, opt)
        assert opt.onebit is None or opt.onebit.steps == first, opt.onebit.steps
    losses, ev, seconds = train_and_evaluate(rank, ddp, opt, train, held, steps, batch, seed, scheduler=sched,
                                             eval_every=eval_every, held_out_at=evals, first=first)
    started = opt.onebit.started_at if kind != "adamw" else None
    return dict(losses=(losses / world_size).tolist(), eval=ev.item() / world_size, seconds=seconds,
                started=started, evals={k: v / world_size for k, v in evals.items()})


def _along_the_run(results: dict, every: int, steps: int) -> list[str]:
    """--eval-every: each run against AdamW on its mesh after every K steps: the training loss (trailing mean
    of TAIL steps) and the held-out loss."""
    others = [n for n in results if not n.startswith("AdamW")]
    at = [k for k in range(every, steps, every)] + [steps]
    lines = ["", f"Along the run: each against AdamW on its mesh, training loss (mean of the {TAIL} steps up to "
             "the step) / held-out loss.", "",
             "| step | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for k in at:
        cells = []
        for n in others:
            r, ref = results[n], results[_reference(n)]
            tr = sum(r["losses"][max(0, k - TAIL):k]) / sum(ref["losses"][max(0, k - TAIL):k]) - 1
            ev = r["evals"][k] if k < steps else r["eval"]
            ev_ref = ref["evals"][k] if k < steps else ref["eval"]
            cells.append(f"{tr:+.2%} / {ev / ev_ref - 1:+.2%}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def chart(path: str, results: dict, steps: int, freeze: int) -> None:
    from shardopt.tools.plotting import require_matplotlib

    plt = require_matplotlib()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, r in results.items():
        s = smooth(r["losses"])
        ax.plot(range(1, steps + 1), s, label=name, linewidth=1.3)
        if not name.startswith("AdamW"):
            ref = smooth(results[_reference(name)]["losses"])
            dx.plot(range(1, steps + 1), [100 * (a / b - 1) for a, b in zip(s, ref)], label=name, linewidth=1.3)
    for bound in (-100 * TOLERANCE, 100 * TOLERANCE):
        dx.axhline(bound, color="gray", linestyle="--", linewidth=1)
    for a in (ax, dx):
        a.axvline(freeze + 0.5, color="black", linestyle=":", linewidth=1)
        a.grid(alpha=0.3)
    ax.set(title=f"training loss (trailing mean of {TAIL} steps)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    dx.set(title=f"relative to AdamW on the same mesh (dashed: ±{TOLERANCE:.0%})", xlabel="step",
           ylabel="loss difference (%)")
    ax.legend(), dx.legend()
    fig.suptitle(f"1-bit Adam (freeze_step={freeze}, dotted) against exact AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=375)
    ap.add_argument("--freeze", type=int, default=75, help="OneBitAdam's freeze_step")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", choices=("constant", "linear"), default="constant",
                    help="the lr: constant, or falling linearly to 0 over the run (both optimizers)")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--meshes", default="both", help='"both" (2x2 and flat) or a comma-separated list of 2x2, '
                    'flat, 4x1 (four replicas of one shard each: the replicas\' exchange with R = 4)')
    ap.add_argument("--control", action="store_true",
                    help="also the frozen variance with an exact exchange (no compression), per mesh")
    ap.add_argument("--block", type=int, default=None,
                    help="a diagnosis: the 1-bit format's block size (shardopt's is 1024), hybrid meshes only")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also take the held-out loss every K steps, and tabulate both gaps along the run")
    ap.add_argument("--corpus-at", default=None, metavar="REV",
                    help="read the corpus as committed at this git revision (default: the working tree, which "
                    "grows every day): runs on other days then train on the same text")
    ap.add_argument("--pretrain", type=int, default=0, metavar="P",
                    help="first train AdamW for P steps (flat 4 ranks) and start every run from that checkpoint: "
                    "OneBitAdam then warms up for --freeze more exact steps (freeze_step = P + --freeze), where "
                    "Adam's variance has had P steps to settle; steps are counted from P")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    md = os.path.join(args.out_dir, f"{date}-onebit-loss.md")
    png = os.path.join(args.out_dir, f"{date}-onebit-loss.png")
    raw = os.path.join(args.out_dir, f"{date}-onebit-loss.json")  # every run's per-step and held-out losses
    load = os.getloadavg()[0]
    train, held, files = read_corpus(at=args.corpus_at)
    params = num_params(GPT(CONFIG))
    results = {}
    runs = _runs(args.meshes, args.control)
    if args.block and any(shape is None for _, shape in runs.values()):
        raise SystemExit("--block is for hybrid meshes only (the flat mesh's residual holds messages of the "
                         "default block): pass --meshes 2x2 or 4x1")
    pretrained, pre = None, None
    if args.pretrain:
        import tempfile

        pretrained = os.path.join(tempfile.mkdtemp(prefix="onebit-pretrain-"), "ckpt")
        pre = run_ranks(_pretrain, 4, train, held, args.pretrain, args.batch, args.seed, args.lr, pretrained,
                        timeout=3 * 3600, collective_timeout=600)[0]
        print(f"pretrained: AdamW {args.pretrain} steps, held-out {pre['eval']:.4f}, {pre['seconds']:.0f} s", flush=True)
    for name, (kind, shape) in runs.items():
        t0 = time.time()
        per_rank = run_ranks(_train, 4, kind, shape, train, held, args.steps, args.batch, args.seed, args.freeze,
                             args.schedule, args.lr, args.block, args.eval_every, pretrained, args.pretrain,
                             timeout=3 * 3600, collective_timeout=600)
        r = per_rank[0]
        if r["started"] is not None:
            r["started"] -= args.pretrain  # counted from the checkpoint, as every step here
        r["seconds"] = max(p["seconds"] for p in per_rank)
        r["wall"] = time.time() - t0
        results[name] = r
        print(f"{name}: final {sum(r['losses'][-TAIL:]) / TAIL:.4f}, held-out {r['eval']:.4f}, "
              f"train {r['seconds']:.0f} s, compression from step {r['started']}", flush=True)
    if pretrained:
        import shutil

        shutil.rmtree(os.path.dirname(pretrained), ignore_errors=True)
    chart(png, results, args.steps, args.freeze)
    final = {n: sum(r["losses"][-TAIL:]) / TAIL for n, r in results.items()}
    ref_of = {n: _reference(n) for n in results}
    same_warmup = all(r["losses"][:args.freeze] == results[ref_of[n]]["losses"][:args.freeze]
                      for n, r in results.items())
    lines = [f"# 1-bit Adam vs exact AdamW: loss curves — {date}", "",
             f"`python benchmarks/onebit_loss_curve.py --steps {args.steps} --freeze {args.freeze} --batch "
             f"{args.batch} --seed {args.seed} --schedule {args.schedule} --lr {args.lr} --meshes {args.meshes}"
             f"{' --control' if args.control else ''}{f' --block {args.block}' if args.block else ''}{f' --eval-every {args.eval_every}' if args.eval_every else ''}"
             f"{f' --corpus-at {args.corpus_at}' if args.corpus_at else ''}"
             f"{f' --pretrain {args.pretrain}' if args.pretrain else ''}` "
             f"at commit {_git_head()}. Machine: {platform.machine()}, "
             f"{os.cpu_count()} cores, load average at start {load:.1f}, torch {torch.__version__}, gloo over "
             "127.0.0.1.", "",
             f"Model, data and evaluation as benchmarks/hop_loss_curve.py: byte-level GPT ({CONFIG}), "
             f"{params:,} parameters, this repository's source{f' at {args.corpus_at}' if args.corpus_at else ''} "
             f"({len(files)} files, {len(train):,} training "
             f"bytes, {len(held):,} held out). 4 ranks, ZeRO-2, lr={args.lr} "
             f"({'constant' if args.schedule == 'constant' else 'falling linearly to 0 over the run'}), "
             f"weight_decay={WD}, betas (0.9, 0.999), "
             f"clip_grad_norm({CLIP}). OneBitAdam: freeze_step={args.freeze}, then {args.steps - args.freeze} "
             f"compressed steps{f' (1-bit blocks of {args.block} elements)' if args.block else ''}. "
             f"Final = mean training loss of the last {TAIL} steps."
             + (f" **Pretrained:** every run starts from one checkpoint of AdamW after {args.pretrain} steps (flat 4 "
                f"ranks; held-out loss there {pre['eval']:.4f}) and draws the data from step {args.pretrain} on; "
                f"OneBitAdam's freeze_step = {args.pretrain + args.freeze}; steps below count from the checkpoint."
                if args.pretrain else ""), "",
             "| run | compression from step | final loss | vs AdamW (same mesh) | held-out loss | vs AdamW | within 1% | "
             "at most 1% above | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        ref = ref_of[n]
        rel = final[n] / final[ref] - 1
        erel = r["eval"] / results[ref]["eval"] - 1
        ok = abs(rel) <= TOLERANCE and abs(erel) <= TOLERANCE
        no_worse = rel <= TOLERANCE and erel <= TOLERANCE
        lines.append(f"| {n} | {r['started'] or '-'} | {final[n]:.4f} | {rel:+.2%} | {r['eval']:.4f} | "
                     f"{erel:+.2%} | {'pass' if ok else '**FAIL**'} | {'pass' if no_worse else '**FAIL**'} | "
                     f"{r['seconds']:.0f} |")
    if args.eval_every:
        lines += _along_the_run(results, args.eval_every, args.steps)
    lines += ["", f"Training losses of the first {args.freeze} steps (the warm-up) equal those of AdamW on the same "
              f"mesh bit for bit: {'yes' if same_warmup else '**no**'}.", "", f"![loss curves]({os.path.basename(png)})", ""]
    with open(md, "w") as f:
        f.write("\n".join(lines))
    with open(raw, "w") as f:
        json.dump({"args": vars(args), "runs": results}, f)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
