"""Step time of shardopt ZeRO-1/ZeRO-2 against DDP + AdamW(fused=True), torch's ZeroRedundancyOptimizer and,
with --peers, FSDP2, DeepSpeed ZeRO-2 (with and without CPU Adam offload) and FairScale.

Every variant trains its own copy of the same GPT (same seed, same data) in
the same processes, and variants take turns round-robin (variant A's
`--turn` steps, variant B's, ...) so that the machine's noise hits all
variants alike (Note [Turns]); the report gives medians over rounds and
in-run ratios to DDP. Time is split into forward, backward (for shardopt and
DDP this includes the communication not hidden behind backward) and optimizer
step (for shardopt: inner step + all-gather, which overlap_gather moves into
the next forward; for torch ZeRO: step + broadcast).

--peers (run with /work/bench-venv/bin/python or any env with deepspeed and
fairscale; DS_ACCELERATOR=cpu is set here): the variants of benchmarks/peers.py.
Holding all ten models at once would take ~20 GB at 4 ranks, so they run in
rounds of four or five, each round with DDP and shardopt ZeRO-2 as anchors;
ratios are to the DDP of the same round (`--variants` instead runs one round of the variants it names,
DDP the only anchor). Before the rounds, each variant is
built alone and trained for 2 steps to measure its peak memory: the growth of
the process's peak resident set (VmHWM) over its RSS before the model is
built (Note [Peak RSS per variant]). A variant that fails to build or step is
reported with its error.

    python benchmarks/bench_step.py                    # 2 and 4 ranks, both shapes
    python benchmarks/bench_step.py --sweep-buckets    # ZeRO-2 step time against reduce_bucket_size
    python benchmarks/bench_step.py --peers --out benchmarks/results/DATE-peers.md   # + DATE-peers.png
    python benchmarks/bench_step.py --quick [--peers]
    python benchmarks/bench_step.py --peers --rounds-of "FairScale, zero_grad(set_to_none=False)" --repeat 3
        # a closer look at one peer: K rounds of just it and the anchors
    python benchmarks/bench_step.py --cluster 2x2 --rate 1gbit [--peers]   # root: emulated nodes
    python benchmarks/bench_step.py --peers --model small --world-sizes 4 \
        --variants "DDP,FSDP2 HSDP,shardopt-2-gather,shardopt-hybrid-fp32-gather,shardopt-hybrid-bf16-gather,shardopt-hybrid-int8-gather"

--cluster NODESxRANKS runs the ranks on an emulated cluster (shardopt/cluster/emulated.py: every node a
network namespace whose link is shaped to --rate; ranks started by torchrun, one per node) instead
of on 127.0.0.1, and adds the bytes each node sent over its link per step (its veth's counter, read
around each variant's turn; the busiest node's) to the tables. With --peers the rounds
are CLUSTER_ROUNDS: DDP, torch ZeRO, FSDP2 flat and HSDP, DeepSpeed ZeRO-2, shardopt ZeRO-1/2, and
flat ZeRO-2 against the three hybrids (exact, bf16 and int8 inter-node hop), and shardopt ZeRO-3
node-aware (the default across nodes) against ZeRO-3 with flat collectives and on a 2-D mesh. Next to the bytes measured,
the --peers table gives the bytes expected by arithmetic where it is known and their ratio (Note [Link
bytes by arithmetic] in peers.py). On 127.0.0.1, --nodes groups the ranks into nodes for the hybrid and
HSDP variants (LOCAL_WORLD_SIZE; default 2 nodes at 4 ranks): their hop runs over loopback.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shardopt.cluster.ranks import run_ranks  # noqa: E402

SHAPES = {"compute-bound 8x128": (8, 128), "comm-bound 1x16": (1, 16)}
PEER_SHAPE = (2, 64)
# Rounds of the peer benchmark; DDP and shardopt ZeRO-2 are in every round.
ANCHORS = ["DDP + AdamW(fused)", "shardopt ZeRO-2"]
PEER_ROUNDS = [
    ["shardopt ZeRO-1", "shardopt ZeRO-2 + overlap_gather", "torch ZeroRedundancyOptimizer", "FSDP2 (fully_shard)"],
    ["FairScale OSS + ShardedDDP", "FairScale, zero_grad(set_to_none=False)"],
    ["DeepSpeed ZeRO-2", "DeepSpeed ZeRO-2 + CPU Adam offload", "shardopt ZeRO-2 + offload"],
]
CLUSTER_ROUNDS = [
    ["shardopt ZeRO-1", "torch ZeroRedundancyOptimizer", "FSDP2 (fully_shard)"],
    ["FSDP2 HSDP (replicate across nodes, shard within)", "DeepSpeed ZeRO-2"],
    ["shardopt ZeRO-2 + overlap_gather", "shardopt hybrid (fp32 hop) + overlap_gather",
     "shardopt hybrid + bf16 hop + overlap_gather", "shardopt hybrid + int8 hop + overlap_gather"],
    ["shardopt ZeRO-3", "shardopt ZeRO-3, flat collectives (node_aware=False)", "shardopt ZeRO-3 hybrid (fp32 hop)"],
]
# How ranks are started: run_ranks (127.0.0.1) or, with --cluster, run_ranks_on_cluster (main()).
RUNNER = run_ranks
TRANSPORT = "gloo over 127.0.0.1"


def _link_tx_bytes():
    """Bytes this rank's node has sent over its link so far (emulated cluster), or None on one machine."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or ifname == "lo":
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _make(variant, cfg, rbs):
    """DDP, torch ZeRO or shardopt ZeRO-1/2 with reduce_bucket_size rbs (None: default)."""
    import shardopt
    from peers import _model, _torch_style, build

    if variant in ("DDP", "torch ZeRO"):
        return build({"DDP": "ddp", "torch ZeRO": "torch-zero"}[variant], cfg, None, 0)
    model = _model(cfg)
    stage = int(variant.split("-")[1][0])
    gather = variant.endswith("gather")  # overlap_gather (Note [Gathering in the next forward])
    if variant.endswith("offload"):
        # The offload default: AdamW semantics on the fused CPU Adam over host master chunks.
        opt = shardopt.ShardedOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1, stage=stage,
                                        reduce_bucket_size=rbs, allgather_bucket_size=rbs, offload="cpu")
    else:
        opt = shardopt.ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                                        fused=True, stage=stage, reduce_bucket_size=rbs, allgather_bucket_size=rbs,
                                        overlap_gather=gather)
    return _torch_style(shardopt.ShardedDDP(model, opt), opt)


# shardopt's own split of a step (ShardedOptimizer.phase_seconds): exposed reduction at the end of
# backward, copies into the gradient shard (device to host with offload), the inner step, master
# chunks into the model, and the all-gather.
PHASES = ("reduce", "copy", "step", "publish", "gather")


def _phases(trainer):
    opt = next((o for o in trainer.keep if hasattr(o, "phase_seconds")), None)
    return opt.phase_seconds() if opt is not None else None


def _finish(trainer):
    """Waits for anything a variant left in flight (shardopt's overlap_gather: the step's all-gather)."""
    for o in trainer.keep:
        if hasattr(o, "wait_params"):
            o.wait_params()


def _interleave(rank, trainers, cfg, shape, rounds, warmup, turn=1):
    """Trains every trainer for (warmup + rounds) * turn steps: in each round, `turn` consecutive steps
    of each trainer in turn. Returns (medians over rounds of the per-step mean of each round, losses, errors).

    See Note [Turns]."""
    import torch.distributed as dist

    from shardopt.tools.gpt import synthetic_batch

    bsz, seq = shape
    times = {n: {"fwd": [], "bwd": [], "step": [], "total": []} for n in trainers}
    for n, t in trainers.items():
        if _phases(t) is not None:
            times[n].update({f"phase {k}": [] for k in PHASES})
    losses = {n: [] for n in trainers}
    errors = {}
    for rnd in range(warmup + rounds):
        for name, t in trainers.items():
            if name in errors:
                continue
            dist.barrier()
            acc = dict.fromkeys(("fwd", "bwd", "step", "total"), 0.0)
            sent = _link_tx_bytes()
            try:
                before = _phases(t)
                for k in range(turn):
                    x, y = synthetic_batch(cfg, bsz, seq, rnd * turn + k, rank)
                    t0 = time.perf_counter()
                    loss = torch.nn.functional.cross_entropy(t.forward(x).reshape(-1, cfg.vocab), y.reshape(-1))
                    t1 = time.perf_counter()
                    t.backward(loss)
                    t2 = time.perf_counter()
                    t.step()
                    if k == turn - 1:
                        _finish(t)  # charged to this turn, not to the next variant
                    t3 = time.perf_counter()
                    losses[name].append(loss.item())
                    for key, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("step", t3 - t2), ("total", t3 - t0)):
                        acc[key] += v / turn
                if sent is not None:
                    dist.barrier()  # every rank of the node done sending this turn's bytes
                    acc["sent"] = (_link_tx_bytes() - sent) / turn
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors[name] = _describe(e)
                continue
            if rnd >= warmup:
                for key, v in acc.items():
                    times[name].setdefault(key, []).append(v)
                if before is not None:
                    after = _phases(t)
                    for k in PHASES:
                        times[name][f"phase {k}"].append((after[k] - before[k]) / turn)
    med = {n: {k: statistics.median(v) for k, v in ph.items()} for n, ph in times.items() if n not in errors}
    return med, losses, errors


# Note [Turns]
# With overlap_gather=True a step's all-gather finishes during the next
# forward. Interleaving single steps of different variants would let it
# overlap another variant's work instead (and charge that variant). So each
# variant runs `turn` consecutive steps, and anything still in flight at the
# end of its turn is waited for inside the turn's last step. Per-step figures
# are the turn's mean; one of every `turn` gathers is therefore exposed,
# which real training (always a next forward) never pays: the figures are
# conservative for overlap_gather by about one gather / turn.
# Turns also keep a variant close to how it runs in a real job (alone, step
# after step). With single interleaved steps, ZeRO-2 / DDP on the 2-rank
# compute-bound shape measured 0.91 and 0.96 while turns of 2 gave 1.09 and
# turns of 5 gave 1.01, back to back on the same quiet machine: how each
# variant's allocations meet the previous variant's freed memory shows up at
# the 5-10% level on this VM. Hence the default of 4. The number of models
# sharing the processes matters too: with six variants ZeRO-2's forward ran
# 5-7% slower than DDP's, with just the two it did not (every forward takes
# ~19k minor page faults: glibc hands freed activations back to the OS, and
# on this VM touching fresh pages is expensive). `--variants` runs a subset.


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0] if text else ''}"
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _bench(rank, world_size, variants, model_name, shape, steps, turn):
    from shardopt.tools.gpt import PRESETS

    cfg = PRESETS[model_name]
    trainers = {name: _make(kind, cfg, rbs) for name, kind, rbs in variants}
    med, losses, errors = _interleave(rank, trainers, cfg, shape, steps, warmup=1, turn=turn)
    if errors:
        raise RuntimeError(f"variants failed: {errors}")
    return med, losses


def _table(results, ws, shape_name, steps, turn):
    # The slowest rank's median per phase: a step is as slow as its slowest rank.
    per_rank = [r[0] for r in results]
    losses = results[0][1]
    names = list(per_rank[0])
    med = {n: {k: max(r[n][k] for r in per_rank) for k in per_rank[0][n]} for n in names}
    base = med["DDP"]["total"]
    ref_loss = losses["DDP"]
    sent = "sent" in med["DDP"]
    lines = [f"### {ws} ranks, {shape_name}, {steps} rounds of {turn} steps per variant (Note [Turns])", "",
             "| variant | fwd ms | bwd ms | step ms | total ms | x DDP | max abs loss diff to DDP | "
             + ("MB sent per node per step | " if sent else "") + " | ".join(f"{k} ms" for k in PHASES) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * (len(PHASES) + sent)]
    for n in names:
        m = med[n]
        diff = max(abs(a - b) for a, b in zip(losses[n], ref_loss))
        phases = " | ".join(f"{m[f'phase {k}'] * 1e3:.1f}" if f"phase {k}" in m else "" for k in PHASES)
        link = f"{m['sent'] / 1e6:.1f} | " if sent else ""
        lines.append(f"| {n} | {m['fwd'] * 1e3:.1f} | {m['bwd'] * 1e3:.1f} | {m['step'] * 1e3:.1f} | "
                     f"{m['total'] * 1e3:.1f} | {m['total'] / base:.2f} | {diff:.1e} | {link}{phases} |")
    lines += ["", "shardopt's phases (ShardedOptimizer.phase_seconds, slowest rank's median): reduce = waiting for "
              "reductions at the end of backward (inside bwd); copy = reduced chunks into the gradient shard "
              "(device to host with offload; inside bwd); step = the inner optimizer, publish = master chunks "
              "into the model, gather = starting the all-gather and waiting for it (all three inside step; with "
              "overlap_gather the waits are in the next forward's hooks, except a turn's last)."]
    return lines


# ------------------------------------------------------------------ peers
# Note [Peak RSS per variant]
# Each variant is measured alone in a process that already ran the previous
# ones, so freed memory must really leave the process: after gc, malloc_trim
# hands glibc's free heap pages back to the OS (large tensors are mmapped and
# return on free anyway). Writing "5" to /proc/self/clear_refs resets the peak
# (VmHWM) to the current RSS, so "peak - RSS before" is what this variant
# needed at its worst moment: parameters, gradients, optimizer state, the
# library's buffers and the activations of one step. Memory a library keeps
# in caches after it is freed (DeepSpeed) only raises the next variant's
# starting point, not its growth.
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peer_memory(rank, name, cfg, shape, bucket):
    """Peak RSS growth (bytes) of one variant built alone and trained 2 steps, or its error."""
    import peers

    _reset_peak()
    before = _status_kib("VmRSS")
    try:
        trainer = peers.build(peers.VARIANTS[name], cfg, bucket, shape[0])
        _, _, errors = _interleave(rank, {name: trainer}, cfg, shape, rounds=2, warmup=0)
        if errors:
            return errors[name]
        return (_status_kib("VmHWM") - before) * 1024
    except Exception as e:  # noqa: BLE001 - reported in the table
        return _describe(e)
    finally:
        trainer = None  # noqa: F841 - drop it before the next variant is measured
        gc.collect()


def _peers(rank, world_size, model_name, shape, steps, warmup, turn, peer_rounds, anchors):
    import torch.distributed as dist

    import peers
    from shardopt.config import auto_bucket_size
    from shardopt.tools.gpt import PRESETS, GPT, num_params

    cfg = PRESETS[model_name]
    # DeepSpeed gets the bucket size shardopt picks by default, so both cut the model alike (across nodes:
    # Note [Default bucket sizes across nodes] in shardopt/config.py).
    across = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) < dist.get_world_size()
    bucket = auto_bucket_size(num_params(GPT(cfg)), across_nodes=across)
    names_used = [n for n in peers.VARIANTS if n in anchors or any(n in r for r in peer_rounds)]
    memory = {name: _peer_memory(rank, name, cfg, shape, bucket) for name in names_used}
    rounds = []
    for names in peer_rounds:
        trainers, errors = {}, {}
        for name in anchors + names:
            if isinstance(memory[name], str):  # it failed alone: it would fail here too
                errors[name] = memory[name]
                continue
            try:
                trainers[name] = peers.build(peers.VARIANTS[name], cfg, bucket, shape[0])
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors[name] = _describe(e)
        med, losses, step_errors = _interleave(rank, trainers, cfg, shape, steps, warmup, turn)
        rounds.append(dict(med=med, losses=losses, errors={**errors, **step_errors}))
        trainers = None
        gc.collect()
        dist.barrier()
    return dict(memory=memory, rounds=rounds, bucket=bucket)


def _peer_rows(results, peer_rounds, anchors):
    """One row per (round, variant): slowest rank's medians, max peak over ranks, rank 0's losses."""
    rows = []
    for ri, names in enumerate(peer_rounds):
        ddp = anchors[0]
        per_rank = [r["rounds"][ri] for r in results]
        errors = {}
        for r in per_rank:
            for n, e in r["errors"].items():
                errors.setdefault(n, e)
        ref = per_rank[0]["losses"].get(ddp)
        base = max(r["med"][ddp]["total"] for r in per_rank) if ddp not in errors else None
        for n in anchors + names:
            mem = [r["memory"][n] for r in results]
            peak = None if any(isinstance(m, str) for m in mem) else max(mem)
            row = dict(round=ri + 1, name=n, error=errors.get(n), peak=peak)
            if n not in errors:
                m = {k: max(r["med"][n][k] for r in per_rank) for k in ("fwd", "bwd", "step", "total", "sent")
                     if k in per_rank[0]["med"][n]}
                loss = per_rank[0]["losses"][n]
                row.update(m, ratio=m["total"] / base if base else None, loss=loss[-1],
                           diff=loss[-1] - ref[-1] if ref else None,
                           maxdiff=max(abs(a - b) for a, b in zip(loss, ref)) if ref else None,
                           first_off=next((i for i, (a, b) in enumerate(zip(loss, ref)) if abs(a - b) > 1e-4),
                                          None) if ref else None)
            rows.append(row)
    return rows


def _peer_table(rows, ws, steps, warmup, shape, turn, expected):
    """`expected`: variant name -> the bytes per node per step by arithmetic, or None (Note [Link bytes by
    arithmetic] in peers.py)."""
    lines = [f"### {ws} ranks, batch {shape[0]}x{shape[1]} tokens per rank, {warmup} warm-up + {steps} timed "
             f"rounds of {turn} steps per variant", "",
             "| round | variant | fwd ms | bwd ms | step ms | total ms | x DDP (same round) | MB sent per node per "
             "step | expected MB (arithmetic) | measured / expected | peak RSS growth "
             f"MiB | loss at step {(warmup + steps) * turn} | minus DDP's | max abs diff to DDP (first step > 1e-4) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak'] / 2**20:.0f}" if r["peak"] is not None else "-"
        want = expected.get(r["name"])
        want_mb = f"{want / 1e6:.1f}" if want is not None else "-"
        if r["error"]:
            lines.append(f"| {r['round']} | {r['name']} | error: `{r['error']}` | | | | | | {want_mb} | | {peak} "
                         "| | | |")
            continue
        first = f" (step {r['first_off'] + 1})" if r["first_off"] is not None else ""
        sent = f"{r['sent'] / 1e6:.1f}" if "sent" in r else "-"
        ratio = f"{r['sent'] / want:.2f}" if "sent" in r and want else "-"
        lines.append(f"| {r['round']} | {r['name']} | {r['fwd'] * 1e3:.0f} | {r['bwd'] * 1e3:.0f} | "
                     f"{r['step'] * 1e3:.0f} | {r['total'] * 1e3:.0f} | {r['ratio']:.2f} | {sent} | {want_mb} | "
                     f"{ratio} | {peak} | {r['loss']:.5f} | {r['diff']:+.1e} | {r['maxdiff']:.1e}{first} |")
    return lines


def _select_peers(spec: str) -> list[str]:
    """--variants with --peers: comma-separated variant names, their kinds (peers.VARIANTS' values, e.g.
    fsdp2-hsdp) or unique name prefixes (e.g. "FSDP2 HSDP"), in table order. Full names are found first,
    so the ones with commas in them work as written."""
    import peers

    found, rest = set(), spec
    for name in sorted(peers.VARIANTS, key=len, reverse=True):  # "X + overlap_gather" before "X"
        if name in rest:
            found.add(name)
            rest = rest.replace(name, "")
    for word in (w.strip() for w in rest.split(",")):
        if not word:
            continue
        match = ([n for n, k in peers.VARIANTS.items() if k == word]
                 or [n for n in peers.VARIANTS if n.lower().startswith(word.lower())])
        if len(match) != 1:
            raise SystemExit(f"--variants: {word!r} names {'no' if not match else 'more than one'} variant "
                             f"({match or ''}); known (name: kind): "
                             + "; ".join(f"{n}: {k}" for n, k in peers.VARIANTS.items()))
        found.update(match)
    if ANCHORS[0] not in found:
        raise SystemExit(f"--variants: include {ANCHORS[0]!r} (or ddp): every ratio is to it")
    return [n for n in peers.VARIANTS if n in found]


def _link_arithmetic(names, cfg, ws, per_node):
    """Note [Link bytes by arithmetic] (peers.py) for each variant, with S = 4 x trainable parameters."""
    import peers
    from shardopt.tools.gpt import GPT

    grad_bytes = 4 * sum(p.numel() for p in GPT(cfg).parameters() if p.requires_grad)
    return {n: peers.expected_link_bytes(peers.VARIANTS[n], grad_bytes, ws, per_node) for n in names}, grad_bytes


def _peer_chart(path, per_ws):
    from shardopt.tools.plotting import bar_panels

    import peers

    labels = [n for n in peers.VARIANTS if any(r["name"] == n for _, rows in per_ws for r in rows)]

    def per_variant(rows, key):
        # A variant's value: its row in the first round it ran in (anchors: the median over rounds).
        out = []
        for n in labels:
            vals = [r[key] for r in rows if r["name"] == n and r.get(key) is not None and not r["error"]]
            out.append(statistics.median(vals) if vals else None)
        return out

    bar_panels(path, "Peers on a GPT, gloo on 2 CPU cores (lower is better)", labels, [
        ("step time / DDP's (same round)", {f"{ws} ranks": per_variant(rows, "ratio") for ws, rows in per_ws}),
        ("peak RSS growth per rank (MiB)",
         {f"{ws} ranks": [None if v is None else v / 2**20 for v in per_variant(rows, "peak")]
          for ws, rows in per_ws}),
    ], reference={0: 1.0})


def _ranks_per_node(args, ws):
    """Ranks per node at world size ws. On the emulated cluster torchrun sets LOCAL_WORLD_SIZE; on 127.0.0.1
    it is set here for the ranks (spawned, they inherit the environment), which groups them into --nodes
    "nodes" for shard_group="node" and FSDP2 HSDP: their hop then runs over loopback."""
    if args.cluster:
        return int(args.cluster.lower().split("x")[1])
    nodes = args.nodes if args.nodes is not None else (2 if ws >= 4 and ws % 2 == 0 else 1)
    if ws % nodes:
        raise SystemExit(f"--nodes {nodes} does not divide {ws} ranks")
    os.environ["LOCAL_WORLD_SIZE"] = str(ws // nodes)
    return ws // nodes


def run_peers(args):
    from shardopt.tools.gpt import PRESETS

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    steps, warmup = args.steps, 1
    lines = [f"# Peers: step time, memory and loss — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
             f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {TRANSPORT}, 1 thread per rank, "
             f"GPT '{args.model}', fp32, AdamW(lr=1e-3, weight_decay=0.1), no clipping. "
             "`python benchmarks/bench_step.py --peers` (benchmarks/peers.py builds every variant). Times: "
             f"medians of the slowest rank; in a round, variants take turns of {args.turn} consecutive steps "
             "(per-step figures are a turn's mean; Note [Turns] in the script). Memory: peak RSS "
             "growth while the variant is built alone and trained 2 steps (the largest rank), which includes "
             "one step's activations. Losses: rank 0's; the loss at step k is the forward loss of step k, "
             "after k-1 updates.", ""]
    versions = _versions()
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    peer_rounds = CLUSTER_ROUNDS if args.cluster else PEER_ROUNDS
    anchors = ANCHORS
    if args.variants:
        # One round of just these: fewer models per process (Note [Turns]); DDP is the only anchor.
        chosen = _select_peers(args.variants)
        anchors, peer_rounds = chosen[:1], [chosen[1:]]
        lines += [f"`--variants`: one round of {', '.join(chosen)}.", ""]
    if args.rounds_of:
        import peers
        if args.rounds_of not in peers.VARIANTS or args.rounds_of in ANCHORS:
            raise SystemExit(f"--rounds-of: expected one of {[n for n in peers.VARIANTS if n not in ANCHORS]}, "
                             f"got {args.rounds_of!r}")
        peer_rounds = [[args.rounds_of]] * args.repeat
        lines += [f"`--rounds-of {args.rounds_of!r} --repeat {args.repeat}`: {args.repeat} rounds of the anchors "
                  "and that variant only.", ""]
    per_ws = []
    shape = args.shape or (PEER_SHAPE if not args.quick else (2, 32))
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        t0 = time.time()
        per_node = _ranks_per_node(args, ws)
        expected, grad_bytes = _link_arithmetic(anchors + [n for r in peer_rounds for n in r],
                                                PRESETS[args.model], ws, per_node)
        res = RUNNER(_peers, ws, args.model, shape, steps, warmup, args.turn,
                        peer_rounds, anchors, timeout=3600, collective_timeout=900)
        rows = _peer_rows(res, peer_rounds, anchors)
        per_ws.append((ws, rows))
        lines += _peer_table(rows, ws, steps, warmup, shape, args.turn,
                             expected)
        lines += ["", f"Bucket size for shardopt (its default) and DeepSpeed: {res[0]['bucket']:,} elements. "
                  f"Expected MB: {ws // per_node} node(s) of {per_node} ranks, S = {grad_bytes / 1e6:.1f} MB "
                  "of fp32 gradients (Note [Link bytes by arithmetic] in peers.py); measured / expected "
                  "above 1 is headers, padding and small collectives. "
                  f"Run time {time.time() - t0:.0f} s.", ""]
        print("\n".join(lines[-len(rows) - 6:]), flush=True)
    report = "\n".join(lines)
    if args.out:
        png = os.path.splitext(args.out)[0] + ".png"
        _peer_chart(png, per_ws)
        with open(args.out, "w") as f:
            f.write(report + f"\n![chart]({os.path.basename(png)})\n")
        print(f"wrote {args.out} and {png}")
    return report


def _versions():
    out = {"torch": torch.__version__}
    for mod in ("deepspeed", "fairscale"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            out[mod] = f"not importable ({type(e).__name__})"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed rounds (default 4; each runs --turn steps per variant)")
    ap.add_argument("--sweep-buckets", action="store_true")
    ap.add_argument("--peers", action="store_true", help="FSDP2, DeepSpeed, FairScale too (see above)")
    ap.add_argument("--rounds-of", default=None, metavar="VARIANT",
                    help="with --peers: instead of the usual rounds, --repeat rounds of the anchors and VARIANT")
    ap.add_argument("--repeat", type=int, default=3, help="rounds for --rounds-of")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--turn", type=int, default=4, help="consecutive steps per variant in a round (Note [Turns])")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of the default variants (must include DDP), "
                         "e.g. 'DDP,shardopt ZeRO-2'; with --peers: names, kinds or unique name prefixes of "
                         "benchmarks/peers.py's variants, run as one round, e.g. 'DDP,FSDP2 HSDP,"
                         "shardopt-2-gather,shardopt-hybrid-fp32-gather'")
    ap.add_argument("--cluster", default=None, metavar="NODESxRANKS",
                    help="run on an emulated cluster of NODES nodes x RANKS ranks (root; see above)")
    ap.add_argument("--rate", default="1gbit", help="with --cluster: each node's link rate (tc tbf)")
    ap.add_argument("--floor-rate", default=None, help="with --cluster --peers: then the same variants again at "
                    "this rate (e.g. 20gbit: no link limit), appended to --out as the link-free floor")
    ap.add_argument("--nodes", type=int, default=None,
                    help="with --peers on 127.0.0.1: group the ranks into this many 'nodes' (LOCAL_WORLD_SIZE) for "
                         "the hybrid and HSDP variants; default 2 at an even world size >= 4, else 1")
    ap.add_argument("--shape", default=None, type=lambda v: tuple(int(x) for x in v.lower().split("x")),
                    metavar="BATCHxSEQ", help=f"with --peers: sequences x tokens per rank (default {PEER_SHAPE})")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rounds_of and not args.peers:
        ap.error("--rounds-of picks rounds of the peer benchmark: add --peers")
    if args.rounds_of and args.variants:
        ap.error("--rounds-of and --variants both pick the rounds: use one")
    if args.steps is None:
        args.steps = 4
    if args.quick:
        args.model, args.world_sizes, args.steps = "small", "2", 3
    if args.cluster:
        try:
            nodes, nproc = (int(v) for v in args.cluster.lower().split("x"))
        except ValueError:
            ap.error(f"--cluster: expected NODESxRANKS such as 2x2, got {args.cluster!r}")
        args.world_sizes = str(nodes * nproc)
        report = _on_cluster(nodes, nproc, args.rate, lambda: _run(args, ap))
        if args.floor_rate:
            # The link-free floor in the same invocation: the same variants, the link at --floor-rate.
            out, args.out = args.out, None
            floor = _on_cluster(nodes, nproc, args.floor_rate, lambda: _run(args, ap))
            if out:
                with open(out, "a") as f:
                    f.write(f"\n## The link-free floor: the same variants with the link at {args.floor_rate}, "
                            "in the same invocation\n\n" + "\n".join(floor.splitlines()[2:]) + "\n")
        return report
    return _run(args, ap)


def _run(args, ap):
    if args.peers:
        return run_peers(args)
    if args.sweep_buckets:
        variants = [("DDP", "DDP", None)] + [(f"ZeRO-2 rbs={r / 1e6:g}M", "ZeRO-2", r)
                                            for r in (250_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000)]
    else:
        variants = [("DDP", "DDP", None), ("torch ZeRO", "torch ZeRO", None),
                    ("shardopt ZeRO-1", "ZeRO-1", None), ("shardopt ZeRO-2", "ZeRO-2", None),
                    ("shardopt ZeRO-2 + overlap_gather", "ZeRO-2-gather", None),
                    ("shardopt ZeRO-2 + offload", "ZeRO-2-offload", None)]
        if args.variants:
            # Fewer models per process: see Note [Turns] on how variants sharing a process interact.
            wanted = [w.strip() for w in args.variants.split(",")]
            unknown = [w for w in wanted if w not in {v[0] for v in variants}]
            if unknown or "DDP" not in wanted:
                ap.error(f"--variants must name DDP and any of {[v[0] for v in variants]}; got {unknown or wanted}")
            variants = [v for v in variants if v[0] in wanted]
    lines = [f"# Step time — {datetime.date.today().isoformat()}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average at start "
             f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, {TRANSPORT}, 1 thread per rank, "
             f"GPT '{args.model}', AdamW (fused=True inside every variant). Medians of the slowest rank.", ""]
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        for shape_name, shape in SHAPES.items():
            res = RUNNER(_bench, ws, variants, args.model, shape, args.steps, args.turn, timeout=3600,
                            collective_timeout=600)
            lines += _table(res, ws, shape_name, args.steps, args.turn) + [""]
            print("\n".join(lines[-(len(variants) + 5):]), flush=True)
    report = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


def _on_cluster(nodes, nproc, rate, run):
    """Calls run() with every rank started by torchrun on an emulated cluster (RUNNER, TRANSPORT)."""
    global RUNNER, TRANSPORT
    from shardopt.cluster.emulated import EmulatedCluster
    from shardopt.cluster.node_ranks import run_ranks_on_cluster

    with EmulatedCluster(nodes, rate) as cluster:
        def runner(fn, ws, *a, timeout, collective_timeout):
            return run_ranks_on_cluster(cluster, nodes, nproc, fn, *a, timeout=timeout,
                                        collective_timeout=collective_timeout)
        RUNNER = runner
        TRANSPORT = (f"gloo over an emulated cluster of {nodes} nodes x {nproc} ranks (network namespaces, "
                     f"{rate} link per node in each direction, tc tbf, no added delay; shardopt/cluster/emulated.py)")
        return run()


if __name__ == "__main__":
    main()
