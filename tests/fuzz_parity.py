"""Randomised parity against plain PyTorch: many small awkward models and configurations, drawn from a seed.

    python tests/fuzz_parity.py train --seeds 0:300 --out /tmp/train.jsonl
    python tests/fuzz_parity.py resume --seeds 0:200 --out /tmp/resume.jsonl

`train`: ShardedDDP + ShardedOptimizer against DDP (find_unused_parameters=True) + the same torch optimizer, on
every rank, step by step (losses, clipped norms, eval outputs) and the final weights, within a bar derived per
seed (Note [The train mode's bar]: a few fp32 ulps per step, or 3x the distance of a reference twin whose
weights move one ulp after every step).
A seed draws the world size (1-4; at 4 as 2 nodes x 2: flat, node-aware or hybrid), the model (odd sizes, a
tied head, a frozen layer, a branch that ranks take or skip, an unused layer, a module called twice, a
one-element parameter, a LayerNorm, activation checkpointing), the stage, buckets, overlap, offload, the comm
implementation, stage-3 options, the optimizer (AdamW, Adam, SGD with momentum or Nesterov, CPUAdam), the
parameter groups, an LR scheduler and the loop (clipping by shardopt's call or torch's, by value, by norm of
order 1, 2 or inf; accumulation with or without no_sync; zero_grad with or without set_to_none, or the
model's; an eval forward under no_grad).
`resume`: k steps at (world size A, configuration A), a save, a load at (B, configuration B) and m more steps,
against one process training on the whole global batch; through save_checkpoint / load_checkpoint or through
the consolidated torch.optim state dict.

`amp`: train's draw on 1 or 2 ranks under torch.autocast (fp16 or bf16) with torch.amp.GradScaler on both sides.
`precision`: a bf16 or fp16 model (fp16 with dynamic, static or first-overflowing loss scaling) against fp32
master weights driven by hand in one process, on the loss scales shardopt used; losses, norms, skipped steps,
final weights and the consolidated optimizer state, at a bar measured per seed (Note [The precision mode's bar]).

Each seed prints ok, FAIL (with what differed), REFUSED (a configuration shardopt refuses at construction, with
its message) or ERROR (an exception or a hang, with the ranks' tracebacks); every result goes to --out as a
JSON line with the drawn configuration, so a failing seed reruns alone (--seeds 108:109). Under the fixed
2e-5 bar this harness had until 2026-11-28, a FAIL of 2.1e-5 with Adam (under 1e-7 with SGD) was summation order
amplified where a gradient is near zero, not a bug: the bar is now measured per seed. Not collected by
pytest: tests/test_fuzz_parity.py runs a few seeds that once failed. Found so far: hybrid / node-aware with
comm_impl="native" on gloo (Note [gloo's reduce-scatter copies on every wait]) and a stage-3 hang when ranks
take different branches (Note [Stage-3 schedule]); with precision, model.zero_grad() after a skipped fp16 step
skipping every later step (Note [A cleared gradient forgets its inf]); with amp, opt.clip_grad_norm raising on
GradScaler's overflowing step (Note [GradScaler owns the inf]).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback

import torch
import torch.utils.checkpoint
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardopt.cluster.ranks import run_ranks  # noqa: E402

VOCAB = 29
ULP = 2.0 ** -23  # an fp32 ulp is at most this times the value
FLOOR_ULPS = 4    # per step: Note [The train mode's bar]
TWIN_FACTOR = 3

# Note [The train mode's bar]
# shardopt and DDP + torch.optim (train, amp), or one process on the whole batch (resume), do the same fp32
# arithmetic up to where the roundings fall: the order in which the ranks' gradients (or the samples' terms)
# are summed (gloo's ring, shardopt's reduce-scatter, two-level sums across nodes), how a norm's squares add
# up, which vector lane runs an element's optimizer update. Each of these moves a result by an ulp or so, so
# two correct runs end a few ulps apart per step: FLOOR_ULPS ulps of each tensor's largest value per step
# (losses and norms: of the value). A gradient norm is also a sum of n squares (or absolute values) in another
# order, here blocked (torch's cascade sums, shardopt's per-shard sums) and then over W ranks: at most
# log2(n) + W roundings of the total on each side, so 2 ceil(log2 n) + W ulps more. Unless the run amplifies last bits: Adam divides by a gradient's root mean
# square, so where a gradient is a sum that nearly cancels, the last bits of its terms become a visible step
# (a fixed bar of 2e-5 failed once in 680 seeds at 2.1e-5 with Adam, under 1e-7 with SGD: the one seed's
# amplification, on one machine). How much a seed amplifies is measured beside it: a twin of the reference,
# the same run but for its weights moved one ulp up or down (at random, the same on every rank) after every
# step, as the last bits of two correct runs differ. shardopt must stay within TWIN_FACTOR times the twin's
# distance from the reference, or the floor, whichever is larger. A lost or doubled rank, a wrong divisor
# (with SGD), a parameter stepped that should not be or a stale one move the first step by far more than
# an ulp's worth: checked by breaking shardopt's side on purpose (tests/README, with the margins measured).


def _bar(steps: int, twin_err: float, extra_ulps: float = 0) -> float:
    return max((FLOOR_ULPS * max(steps, 1) + extra_ulps) * ULP, TWIN_FACTOR * twin_err)


def _nudge(model: nn.Module, step: int) -> None:
    """The twin's perturbation: every trainable weight one ulp up or down, the same on every rank."""
    g = torch.Generator().manual_seed(7919 + step)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                up = torch.rand(p.shape, generator=g) < 0.5
                p.copy_(torch.nextafter(p, torch.where(up, math.inf, -math.inf).to(p.dtype)))
REFUSALS = (ValueError, NotImplementedError, TypeError)


class FuzzNet(nn.Module):
    """An embedding, Linear layers of the drawn sizes with tanh, and the drawn awkward parts."""

    def __init__(self, s: dict):
        super().__init__()
        d = s["dims"]
        self.s = s
        self.emb = nn.Embedding(VOCAB, d[0])
        self.layers = nn.ModuleList(nn.Linear(d[i], d[i + 1], bias=s["bias"][i]) for i in range(len(d) - 1))
        if s["frozen"] is not None:
            self.layers[s["frozen"]].requires_grad_(False)
        j = s["branch"]
        self.branch = nn.Linear(d[j], d[j + 1]) if j is not None else None
        self.unused = nn.Linear(3, 5) if s["unused"] else None
        self.scale = nn.Parameter(torch.ones(1)) if s["scalar"] else None
        self.norm = nn.LayerNorm(d[-1]) if s["norm"] else None
        self.head = nn.Linear(d[-1], VOCAB, bias=False)
        if s["tied"]:
            self.head.weight = self.emb.weight

    def forward(self, x, use_branch: bool):
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            o = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) if self.s["ckpt"] else layer(h)
            if self.branch is not None and i == self.s["branch"] and use_branch:
                o = o + self.branch(h)
            if self.s["reuse"] == i:
                o = layer(torch.tanh(o))
            h = torch.tanh(o)
        if self.norm is not None:
            h = self.norm(h)
        if self.scale is not None:
            h = h * self.scale
        return self.head(h)


def draw_model(r: random.Random, layers: int, *, branch_modes=("rank", "step", "both", "never")) -> dict:
    d0 = r.choice([5, 7, 11, 13, 24])
    dims = [d0] + [r.choice([3, 7, 9, 13, 17, 31, 53]) for _ in range(layers)]
    tied = r.random() < 0.5
    if tied:
        dims[-1] = d0
    square = [i for i in range(layers) if dims[i] == dims[i + 1]]
    return dict(dims=dims, bias=[r.random() < 0.8 for _ in range(layers)], tied=tied,
                reuse=r.choice(square) if square and r.random() < 0.7 else None,
                frozen=r.randrange(layers) if r.random() < 0.4 else None,
                branch=r.randrange(layers) if r.random() < 0.6 else None, branch_mode=r.choice(branch_modes),
                unused=r.random() < 0.4, scalar=r.random() < 0.4, norm=r.random() < 0.4, ckpt=r.random() < 0.3)


def draw_config(r: random.Random) -> dict:
    stage = r.choice([1, 2, 3, 3])
    cfg = dict(stage=stage, reduce_bucket_size=r.choice([None, 50, 128, 300, 1000, 5000]),
               allgather_bucket_size=r.choice([None, None, 64, 400]), overlap_comm=stage == 3 or r.random() < 0.8,
               num_staging_buffers=r.choice([1, 2, 3]), comm_impl=r.choice(["auto", "native", "ring"]),
               offload="cpu" if r.random() < 0.2 else "none")
    if stage == 3:
        cfg.update(reshard_after_forward=r.random() < 0.7, prefetch_bucket_size=r.choice([None, 0, 100, 1000]),
                   max_live_parameters=r.choice([None, 200, 10000]),
                   param_persistence_threshold=r.choice([0, 0, 10, 100]))
    else:
        cfg["overlap_gather"] = r.random() < 0.3
    return cfg


def draw_train(seed: int) -> dict:
    r = random.Random(seed)
    ws = r.choice([1, 2, 2, 2, 3, 3, 4])
    spec = dict(seed=seed, ws=ws, model=draw_model(r, r.randint(1, 4)), config=draw_config(r),
                mesh=r.choice(["flat", "node_aware", "hybrid"]) if ws == 4 else "flat",
                optim=r.choice(["adamw", "sgd", "sgd_nesterov", "adam", "cpuadam"]),
                loop=dict(clip=r.choice(["none", "own", "torch", "torch_value"]),
                          norm_type=r.choice([2.0, 2.0, float("inf"), 1.0]),
                          accum=r.choice(["none", "none", "no_sync", "plain"]),
                          zero=r.choice(["optimizer", "keep", "model"]), groups=r.choice(["one", "decay", "lr"]),
                          sched=r.random() < 0.5, eval=r.random() < 0.3, steps=r.randint(3, 8)))
    spec["loop"]["between"] = _draw_between(seed, ["none", "none", "peek", "edit", "replace"])
    return spec


def _draw_between(seed: int, choices: list[str]) -> str:
    """What user code does between backward and the next forward (see _between): from a generator of its own,
    so that the rest of a seed's draw is what it was before this was drawn."""
    return random.Random(seed + 2 * 10 ** 6).choice(choices)


def _between(when: str, how: str, step: int, opt, model: nn.Module, sharded: bool) -> None:
    """User code between steps, the same on both sides; `sharded`: this is shardopt's side.
    peek: shardopt's weights read in full_params() (they must not change: Note [Writing back keeps the
    master's bits]); edit: weights clamped in place after a step (Note [Weights edited in place]); replace: a
    gradient replaced by a tensor and another cleared before the step (Note [A replaced gradient brings its own
    inf]). At stage 3 weights and replacement gradients are whole only inside full_params()."""
    whole = opt.full_params() if sharded and opt.params_sharded else contextlib.nullcontext()
    params = [p for p in model.parameters() if p.requires_grad]
    if when == "after_step" and how == "peek" and sharded:
        with opt.full_params(), torch.no_grad():
            sum(float(p.sum()) for p in model.parameters())
    elif when == "after_step" and how == "edit" and step % 2 == 0:
        with whole, torch.no_grad():
            for p in params:
                p.clamp_(-0.15, 0.15)
    elif when == "before_step" and how == "replace":
        with whole:
            params[0].grad = torch.full_like(params[0], 0.01 * (step + 1))
        if len(params) > 1 and step % 2:
            params[-1].grad = None


def _optim(name: str):
    """(class for ShardedOptimizer, its kwargs, the torch reference's class, its kwargs)."""
    import shardopt

    adamw = dict(lr=1e-2, weight_decay=0.1)
    return {"adamw": (torch.optim.AdamW, adamw, torch.optim.AdamW, adamw),
            "adam": (torch.optim.Adam, dict(lr=1e-2), torch.optim.Adam, dict(lr=1e-2)),
            "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)) * 2,
            "sgd_nesterov": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True)) * 2,
            "cpuadam": (shardopt.CPUAdam, dict(adamw, adamw=True), torch.optim.AdamW, adamw)}[name]


def _groups(model: nn.Module, how: str):
    named = list(model.named_parameters())
    if how == "one":
        return [p for _, p in named]
    if how == "decay":
        return [{"params": [p for _, p in named if p.ndim >= 2]},
                {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    return [{"params": [p for n, p in named if "layers" in n]},
            {"params": [p for n, p in named if "layers" not in n], "lr": 3e-3}]


def _uses_branch(mode: str, step: int, rank: int) -> bool:
    return {"rank": rank % 2 == 0, "step": step % 3 == 0, "both": (step + rank) % 3 == 0 and step % 4 != 1,
            "never": False}[mode]


def _mesh_kwargs(rank: int, ws: int, mesh: str) -> dict:
    if ws != 4:
        return {}
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)  # 2 nodes x 2 ranks
    return {"flat": {"node_aware": False}, "node_aware": {"node_aware": True}, "hybrid": {"shard_group": "node"}}[mesh]


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _batch(step: int, rank: int, k: int):
    """Micro-batch k of a rank at a step (train, amp and precision)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return torch.randint(0, VOCAB, (2, 3), generator=g), torch.randint(0, VOCAB, (2, 3), generator=g)


def _close(a: float, b: float, twin: float, steps: int, extra_ulps: float = 0) -> bool:
    """a: the reference's value, b: shardopt's, twin: the twin's (Note [The train mode's bar])."""
    if not (math.isfinite(a) and math.isfinite(b)):  # a skipped step's inf/nan norm (GradScaler): the same on both
        return a == b or (a != a and b != b)
    twin_err = abs(twin - a) / max(1.0, abs(a)) if math.isfinite(twin) else 0.0
    return abs(a - b) <= _bar(steps, twin_err, extra_ulps) * max(1.0, abs(a))


def _relative_error(p: torch.Tensor, q: torch.Tensor) -> float:
    return ((p - q).abs().max() / p.abs().max().clamp_min(1e-12)).item() if p.numel() else 0.0


# ------------------------------------------------------------------ train
def _train_rank(rank: int, ws: int, spec: dict) -> list[str]:
    import shardopt
    from torch.nn.parallel import DistributedDataParallel as DDP

    where = _mesh_kwargs(rank, ws, spec["mesh"])
    torch.manual_seed(0)
    base = FuzzNet(spec["model"])
    ref_model = copy.deepcopy(base)
    ref = DDP(ref_model, find_unused_parameters=True) if ws > 1 else ref_model
    cls, kw, ref_cls, ref_kw = _optim(spec["optim"])
    loop = spec["loop"]
    ref_opt = ref_cls(_groups(ref_model, loop["groups"]), **ref_kw)
    # The reference's twin (Note [The train mode's bar]).
    twin_model = copy.deepcopy(base)
    twin = DDP(twin_model, find_unused_parameters=True) if ws > 1 else twin_model
    twin_opt = ref_cls(_groups(twin_model, loop["groups"]), **ref_kw)
    model = copy.deepcopy(base)
    try:
        opt = shardopt.ShardedOptimizer(_groups(model, loop["groups"]), optim=cls, **spec["config"], **where, **kw)
        sharded = shardopt.ShardedDDP(model, opt)
    except REFUSALS as e:
        return ["REFUSED: " + str(e)[:300]]
    opts = (ref_opt, opt, twin_opt)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts] if loop["sched"] else []
    amp = _DTYPES.get(loop.get("amp"))  # the amp mode (below)
    scalers = {id(o): torch.amp.GradScaler("cpu", init_scale=loop["init_scale"]) for o in opts} if amp else {}
    loss_fn = nn.CrossEntropyLoss()
    fails = []
    n = sum(p.numel() for p in ref_model.parameters() if p.requires_grad)
    norm_ulps = 2 * math.ceil(math.log2(max(n, 2))) + ws  # Note [The train mode's bar]
    for step in range(loop["steps"]):
        seen = ([], [], [])
        for side, (wrapper, o, m) in enumerate(((ref, ref_opt, ref_model), (sharded, opt, model),
                                                (twin, twin_opt, twin_model))):
            micro = 1 if loop["accum"] == "none" else 2
            scaler = scalers.get(id(o))
            for k in range(micro):
                x, y = _batch(step, rank, k)
                quiet = loop["accum"] == "no_sync" and k < micro - 1 and hasattr(wrapper, "no_sync")
                with wrapper.no_sync() if quiet else contextlib.nullcontext():
                    with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
                        out = wrapper(x, _uses_branch(spec["model"]["branch_mode"], step, rank))
                    loss = loss_fn(out.float().reshape(-1, VOCAB), y.reshape(-1)) / micro
                    (scaler.scale(loss) if scaler else loss).backward()
                seen[side].append(("loss", loss.item()))
            _between("before_step", loop["between"], step, o, m, o is opt)
            clip, order = loop["clip"], loop["norm_type"]
            if scaler and clip != "none":
                scaler.unscale_(o)
            if clip == "own" and o is opt:
                seen[side].append(("norm", float(opt.clip_grad_norm(0.3, norm_type=order))))
            elif clip in ("own", "torch"):
                seen[side].append(("norm", float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3,
                                                                                norm_type=order))))
            elif clip == "torch_value":
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)
            if scaler:
                scaler.step(o)
                scaler.update()
                seen[side].append(("scale", scaler.get_scale()))
            else:
                o.step()
            if o is twin_opt:
                _nudge(twin_model, step)
            if loop["zero"] == "model":
                m.zero_grad()
            else:
                o.zero_grad(set_to_none=loop["zero"] == "optimizer")
            if step < loop["steps"] - 1:  # a step follows each edit
                _between("after_step", loop["between"], step, o, m, o is opt)
        for s in scheds:
            s.step()
        fails += [f"step {step}: {what} {a!r} (DDP) vs {b!r} (twin {t!r})" for (what, a), (_, b), (_, t) in zip(*seen)
                  if not _close(a, b, t, step + 1, norm_ulps if what == "norm" else 0)]
        if loop["eval"] and step % 2 == 1:
            x = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(77 + step))
            with torch.no_grad():
                a, b = (w(x, _uses_branch(spec["model"]["branch_mode"], step + 1, rank)) for w in (ref, sharded))
            if (a - b).abs().max().item() > 1e-4:
                fails.append(f"step {step}: eval output {(a - b).abs().max().item():.2e} apart")
    with opt.full_params(writeback=False):
        for (name, p), (_, q), (_, t) in zip(ref_model.named_parameters(), model.named_parameters(),
                                             twin_model.named_parameters()):
            err, bar = _relative_error(p, q), _bar(loop["steps"], _relative_error(p, t))
            if err > bar:
                fails.append(f"final {name}: relative error {err:.2e} (bar {bar:.1e})")
    return fails


def check_train(spec: dict) -> tuple[str, list[str]]:
    results = run_ranks(_train_rank, spec["ws"], spec, timeout=150, collective_timeout=40,
                        start_method="forkserver")
    return _status(sorted({f for r in results for f in r}))


def draw_amp(seed: int) -> dict:
    """train's draw on 1 or 2 ranks, with torch.autocast (fp16 or bf16) and torch.amp.GradScaler on both sides.

    Two ranks at most: autocast rounds fp32 weights to fp16/bf16 in every op, so a weight one fp32 ulp apart
    can round the other way (Note [The precision mode's bar]); at 1 and 2 ranks the sums are the same as DDP's
    bit for bit and the train bar holds. A first scale of 2**20 overflows fp16 gradients: steps skipped on both."""
    spec = draw_train(seed)
    r = random.Random(seed + 10 ** 6)
    if spec["ws"] > 2:
        spec["ws"], spec["mesh"] = r.choice([1, 2]), "flat"
    spec["loop"].update(amp=r.choice(["fp16", "bf16"]), init_scale=r.choice([2.0 ** 16, 2.0 ** 20]))
    return spec


# ------------------------------------------------------------------ resume
GLOBAL_BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks


def draw_resume(seed: int) -> dict:
    r = random.Random(seed)
    model = draw_model(r, r.randint(1, 3), branch_modes=("step",))  # the same on every rank: one process matches

    def phase():
        return dict(ws=r.choice([1, 2, 3, 4]), config=draw_config(r), steps=r.randint(1, 4),
                    mesh=r.choice(["flat", "node_aware", "hybrid"]))
    return dict(seed=seed, model=model, optim=r.choice(["adamw", "sgd", "adam"]),
                groups=r.choice(["one", "decay", "lr"]), clip=r.random() < 0.4,
                via=r.choice(["checkpoint", "checkpoint", "torch_state"]), a=phase(), b=phase())


def _resume_steps(model, wrapper, opt, spec, steps, first, rank, ws, sharded, nudge=False) -> list[float]:
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, VOCAB, (GLOBAL_BATCH, 3), generator=g), torch.randint(0, VOCAB, (GLOBAL_BATCH, 3),
                                                                                        generator=g)
        n = GLOBAL_BATCH // ws
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        loss = loss_fn(wrapper(x, step % 3 == 0).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if spec["clip"] and sharded:
            opt.clip_grad_norm(0.3)
        elif spec["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt.zero_grad()
        if nudge:  # the twin (Note [The train mode's bar])
            _nudge(model, step)
        losses.append(loss.item())
    return losses


def _resume_rank(rank: int, ws: int, spec: dict, which: str, path: str):
    import shardopt
    import torch.distributed as dist

    phase = spec[which]
    where = _mesh_kwargs(rank, ws, phase["mesh"])
    torch.manual_seed(0)
    model = FuzzNet(spec["model"])
    cls, kw, _, _ = _optim(spec["optim"])
    torch_file = os.path.join(path, "torch.pt")
    if which == "b" and spec["via"] == "torch_state":
        saved = torch.load(torch_file, weights_only=True)
        model.load_state_dict(saved["model"])
    try:
        opt = shardopt.ShardedOptimizer(_groups(model, spec["groups"]), optim=cls, **phase["config"], **where, **kw)
        wrapper = shardopt.ShardedDDP(model, opt)
    except REFUSALS as e:
        return "REFUSED: " + str(e)[:300]
    first = 0
    if which == "b":
        if spec["via"] == "torch_state":
            opt.load_state_dict(saved["optimizer"])
        else:
            shardopt.load_checkpoint(path, wrapper, opt)
        first = spec["a"]["steps"]
    losses = torch.tensor(_resume_steps(model, wrapper, opt, spec, phase["steps"], first, rank, ws, True),
                          dtype=torch.float64)
    dist.all_reduce(losses)
    if which == "a" and spec["via"] == "torch_state":
        opt.consolidate_state_dict(to=0)
        with opt.full_params(writeback=False):
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"model": weights, "optimizer": opt.state_dict()}, torch_file)
        dist.barrier()
    elif which == "a":
        shardopt.save_checkpoint(path, wrapper, opt)
    with opt.full_params(writeback=False):
        weights = {n: q.detach().clone() for n, q in model.named_parameters()}
    return (losses / ws).tolist(), weights


def check_resume(spec: dict) -> tuple[str, list[str]]:
    torch.manual_seed(0)
    model = FuzzNet(spec["model"])
    _, _, ref_cls, ref_kw = _optim(spec["optim"])
    ref_opt = ref_cls(_groups(model, spec["groups"]), **ref_kw)
    want = {"a": _resume_steps(model, model, ref_opt, spec, spec["a"]["steps"], 0, 0, 1, False)}
    want["b"] = _resume_steps(model, model, ref_opt, spec, spec["b"]["steps"], spec["a"]["steps"], 0, 1, False)
    torch.manual_seed(0)
    twin = FuzzNet(spec["model"])  # the reference's twin (Note [The train mode's bar])
    twin_opt = ref_cls(_groups(twin, spec["groups"]), **ref_kw)
    twins = {w: _resume_steps(twin, twin, twin_opt, spec, spec[w]["steps"], first, 0, 1, False, nudge=True)
             for w, first in (("a", 0), ("b", spec["a"]["steps"]))}
    steps = spec["a"]["steps"] + spec["b"]["steps"]
    got = {}
    with tempfile.TemporaryDirectory(prefix="shardopt-fuzz-") as path:
        for which in ("a", "b"):
            results = run_ranks(_resume_rank, spec[which]["ws"], spec, which, path, timeout=150,
                                collective_timeout=40, start_method="forkserver")
            if isinstance(results[0], str):
                return _status([results[0]])
            got[which] = results
    fails = [f"phase {w} step {i}: loss {b!r} vs {a!r} (one process; twin {t!r})" for w in ("a", "b")
             for i, (a, b, t) in enumerate(zip(want[w], got[w][0][0], twins[w]))
             if not _close(a, b, t, i + 1 + (spec["a"]["steps"] if w == "b" else 0))]
    twin_params = dict(twin.named_parameters())
    for rank, (_, weights) in enumerate(got["b"]):
        for name, p in model.named_parameters():
            err = _relative_error(p.detach(), weights[name])
            bar = _bar(steps, _relative_error(p.detach(), twin_params[name].detach()))
            if err > bar:
                fails.append(f"rank {rank} final {name}: relative error {err:.2e} (bar {bar:.1e})")
    return _status(fails)


# ------------------------------------------------------------------ precision
PRECISION_TOL = {"bf16": 2e-2, "fp16": 5e-3}  # Note [The precision mode's bar]
STATE_TOL = 1e-2
TWIN_ORDERS = ("reversed", "rotated")

# Note [The precision mode's bar]
# A bf16/fp16 model's forward and backward are the same arithmetic in shardopt and in the reference, and their
# fp32 master math differs only in summation order; but the master is cast into the model after every step,
# and where a master sits within a few fp32 ulps of a rounding boundary of the model dtype the two casts can
# land one model ulp apart (2**-8 relative in bf16, 2**-11 in fp16). From then on the runs see different
# weights, and Adam, which divides by a gradient's root mean square, turns a near-zero gradient of the other
# sign into a full learning-rate step the other way: over 7 steps at 3 ranks, a bf16 weight 3e-2 off (relative
# to the tensor's largest) with nothing wrong. So the bar is measured beside each seed: two twin references
# that differ from the reference only in the order the ranks' gradients are summed (reversed; starting at rank
# 1) show how far that order alone moves this seed; shardopt must stay within 3x the larger of the two, and
# never needs to be closer than a few model ulps (PRECISION_TOL; optimizer state STATE_TOL, its squares twice
# that). A lost rank, a wrong divisor or scale, a stale master or a step taken that should have been skipped
# moves the first step already, where the two runs still agree to fp32 rounding: checked by breaking the
# reference on purpose (tests/README).


def draw_precision(seed: int) -> dict:
    r = random.Random(seed)
    ws = r.choice([1, 2, 2, 3, 3, 4])
    dtype = r.choice(["bf16", "bf16", "fp16"])
    scale = r.choice(["auto", "static", "overflow"]) if dtype == "fp16" else None
    return dict(seed=seed, ws=ws, dtype=dtype, loss_scale=scale, model=draw_model(r, r.randint(1, 4)),
                config=draw_config(r), mesh=r.choice(["flat", "node_aware", "hybrid"]) if ws == 4 else "flat",
                optim=r.choice(["adamw", "sgd", "cpuadam"]),
                loop=dict(clip=r.choice(["none", "own", "torch", "option"]),
                          accum=r.choice(["none", "no_sync", "plain"]),
                          zero=r.choice(["optimizer", "keep", "model"]), groups=r.choice(["one", "decay", "lr"]),
                          steps=r.randint(3, 8), between=_draw_between(seed, ["none", "peek"])))


def _loss_scale_arg(name):
    import shardopt

    return {None: {}, "auto": {}, "static": dict(loss_scale=128.0),
            # 2**20 overflows these fp16 gradients at once: the first step or two are skipped as the scale backs off.
            "overflow": dict(loss_scale=shardopt.LossScaleConfig(init_scale=2.0 ** 20))}[name]


_CLIP = 0.3


def _precision_loss(model, spec, step, rank, k, micro):
    x, y = _batch(step, rank, k)
    out = model(x, _uses_branch(spec["model"]["branch_mode"], step, rank)).float()
    return nn.CrossEntropyLoss()(out.reshape(-1, VOCAB), y.reshape(-1)) / micro


def _master_reference(spec: dict, base: nn.Module, ws: int, rank: int, scales: list[float], order: str) -> dict:
    """fp32 master weights driven by hand, one process: each rank's micro-batches in the model dtype, gradients
    summed in fp32 (ranks in `order`), divided by the world size and the loss scale shardopt used that step,
    clipped and stepped on the masters, cast into the model. Under no_sync a rank accumulates in its .grad, in
    the model dtype, as DDP does (an fp16 sum can overflow there: the step is skipped); without it every
    micro-batch is reduced into fp32."""
    loop, dtype = spec["loop"], _DTYPES[spec["dtype"]]
    model = copy.deepcopy(base)
    named = list(model.named_parameters())
    masters = {id(p): p.detach().float().clone().requires_grad_() for _, p in named}
    _, _, ref_cls, ref_kw = _optim(spec["optim"])
    opt = ref_cls([dict(g, params=[masters[id(p)] for p in g["params"]]) if isinstance(g, dict) else masters[id(g)]
                   for g in _groups(model, loop["groups"])], **ref_kw)
    micro = 1 if loop["accum"] == "none" else 2
    ranks = {"natural": list(range(ws)), "reversed": list(range(ws))[::-1],
             "rotated": list(range(1, ws)) + [0]}[order]
    out = dict(losses=[], norms=[], overflow=[])
    for step, scale in enumerate(scales):
        total, losses = {}, []
        for r in ranks:
            model.zero_grad(set_to_none=True)
            for k in range(micro):
                loss = _precision_loss(model, spec, step, r, k, micro)
                (loss * scale).backward()
                if r == rank:
                    losses.append(loss.item())
                if loop["accum"] == "no_sync" and k < micro - 1:
                    continue
                for _, p in named:
                    if p.grad is not None:
                        g = p.grad.float() / (ws * scale)
                        total[id(p)] = total[id(p)] + g if id(p) in total else g
                model.zero_grad(set_to_none=True)
        out["losses"].append(losses)
        overflow = any(not torch.isfinite(g).all() for g in total.values())
        out["overflow"].append(overflow)
        if overflow:
            out["norms"].append(None)
            if loop["zero"] == "keep":  # a skipped step's gradients exist too: zero_grad(set_to_none=False) keeps them
                for i in total:
                    masters[i].grad = torch.zeros_like(masters[i]) if masters[i].grad is None else masters[i].grad
            continue
        for _, p in named:
            m = masters[id(p)]
            # zero_grad(set_to_none=False) leaves a zero gradient that torch.optim steps with (Adam's moments
            # decay, weight decay applies) where a parameter got none this step; set_to_none leaves None: skipped.
            keep = loop["zero"] == "keep" and m.grad is not None
            m.grad = total[id(p)] if id(p) in total else torch.zeros_like(m) if keep else None
        with_grad = [m for m in masters.values() if m.grad is not None]
        if loop["clip"] == "torch":
            # torch's function on the model's gradients: one norm per gradient in their dtype, the total and the
            # factor in that dtype too (shardopt's p.grad has the parameter's dtype), applied to fp32 gradients.
            total_norm = torch.linalg.vector_norm(torch.stack([m.grad.norm().to(dtype) for m in with_grad]))
            torch._foreach_mul_([m.grad for m in with_grad], torch.clamp(_CLIP / (total_norm + 1e-6), max=1.0))
            out["norms"].append(float(total_norm))
        elif loop["clip"] != "none":
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(with_grad, _CLIP)))
        else:
            out["norms"].append(None)
        opt.step()
        with torch.no_grad():
            for _, p in named:
                p.copy_(masters[id(p)])
    out["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    ordered = [m for g in opt.param_groups for m in g["params"]]
    out["state"] = {(i, k): v for i, m in enumerate(ordered) for k, v in opt.state.get(m, {}).items()
                    if k != "step" and torch.is_tensor(v)}
    return out


def _precision_rank(rank: int, ws: int, spec: dict) -> list[str]:
    """shardopt on a bf16/fp16 model, then the fp32-master reference and its twins (Note [The precision mode's
    bar]) on the scales shardopt used."""
    import shardopt

    dtype, loop = _DTYPES[spec["dtype"]], spec["loop"]
    where = _mesh_kwargs(rank, ws, spec["mesh"])
    torch.manual_seed(0)
    base = FuzzNet(spec["model"]).to(dtype)
    model = copy.deepcopy(base)
    cls, kw, _, _ = _optim(spec["optim"])
    extra = dict(max_grad_norm=_CLIP) if loop["clip"] == "option" else {}
    try:
        opt = shardopt.ShardedOptimizer(_groups(model, loop["groups"]), optim=cls, **spec["config"], **where,
                                        **_loss_scale_arg(spec["loss_scale"]), **extra, **kw)
        sharded = shardopt.ShardedDDP(model, opt)
    except REFUSALS as e:
        return ["REFUSED: " + str(e)[:300]]
    micro = 1 if loop["accum"] == "none" else 2
    got = dict(losses=[], norms=[], skipped=[], scales=[])
    for step in range(loop["steps"]):
        got["scales"].append(opt.loss_scale)
        losses = []
        for k in range(micro):
            quiet = loop["accum"] == "no_sync" and k < micro - 1
            with sharded.no_sync() if quiet else contextlib.nullcontext():
                loss = _precision_loss(sharded, spec, step, rank, k, micro)
                opt.scale_loss(loss).backward()
            losses.append(loss.item())
        got["losses"].append(losses)
        # shardopt's own call returns the fp32 norm; torch's, a norm in the gradients' dtype (as with DDP).
        if loop["clip"] == "own":
            got["norms"].append(float(opt.clip_grad_norm(_CLIP)))
        elif loop["clip"] == "torch":
            got["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), _CLIP)))
        else:
            got["norms"].append(None)
        opt.step()
        got["skipped"].append(opt.last_step_skipped)
        if loop["zero"] == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=loop["zero"] == "optimizer")
        _between("after_step", loop["between"], step, opt, model, True)  # a peek: the reference does nothing
    with opt.full_params(writeback=False):
        weights = {n: q.detach().clone() for n, q in model.named_parameters()}
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict()["state"] if rank == 0 else None

    want = _master_reference(spec, base, ws, rank, got["scales"], "natural")
    twins = [_master_reference(spec, base, ws, rank, got["scales"], o) for o in TWIN_ORDERS] if ws > 1 else []
    tol = PRECISION_TOL[spec["dtype"]]
    fails = []

    def bar(floor, err_of):  # Note [The precision mode's bar]
        return max([floor] + [3 * err_of(t) for t in twins])

    for step in range(loop["steps"]):
        if spec["dtype"] == "fp16" and want["overflow"][step] != got["skipped"][step]:
            fails.append(f"step {step}: skipped={got['skipped'][step]}, the reference "
                         f"{'overflowed' if want['overflow'][step] else 'did not'}")
        for k, (a, b) in enumerate(zip(want["losses"][step], got["losses"][step])):
            limit = bar(tol, lambda t: abs(t["losses"][step][k] - a) / max(1.0, abs(a)))
            if abs(a - b) > limit * max(1.0, abs(a)):
                fails.append(f"step {step} micro {k}: loss {b!r} vs {a!r} (reference; bar {limit:.1e})")
        a, b = want["norms"][step], got["norms"][step]
        if a is not None and b is not None:
            limit = bar(tol, lambda t: abs((t["norms"][step] or a) - a) / max(1.0, abs(a)))
            if abs(a - b) > limit * max(1.0, abs(a)):
                fails.append(f"step {step}: norm {b!r} vs {a!r} (reference; bar {limit:.1e})")
    for name, p in want["weights"].items():
        q = weights[name]
        if q.dtype != dtype:
            fails.append(f"final {name}: the model's parameter is {q.dtype} now")
        err, limit = _relative_error(p, q.float()), bar(tol, lambda t: _relative_error(p, t["weights"][name]))
        if err > limit:
            fails.append(f"final {name}: relative error {err:.2e} (bar {limit:.1e})")
    if rank == 0:
        for (i, key), v in want["state"].items():
            floor = STATE_TOL * (2 if key == "exp_avg_sq" else 1)  # a square: twice its gradient's error
            limit = bar(floor, lambda t: _relative_error(v, t["state"][(i, key)]))
            got_v = state.get(i, {}).get(key)
            if got_v is None:
                fails.append(f"state {i} {key}: missing")
            elif _relative_error(v, got_v.float()) > limit:
                fails.append(f"state {i} {key}: relative error {_relative_error(v, got_v.float()):.2e} "
                             f"(bar {limit:.1e})")
    return fails


def check_precision(spec: dict) -> tuple[str, list[str]]:
    results = run_ranks(_precision_rank, spec["ws"], spec, timeout=150, collective_timeout=40,
                        start_method="forkserver")
    return _status(sorted({f for r in results for f in r}))


def _status(fails: list[str]) -> tuple[str, list[str]]:
    if fails and all(f.startswith("REFUSED") for f in fails):
        return "REFUSED", fails
    return ("FAIL" if fails else "ok"), fails


MODES = {"train": (draw_train, check_train), "resume": (draw_resume, check_resume),
         "precision": (draw_precision, check_precision), "amp": (draw_amp, check_train)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--seeds", default="0:50", help="first:end (end excluded)")
    parser.add_argument("--out", help="append one JSON line per seed here")
    args = parser.parse_args(argv)
    draw, check = MODES[args.mode]
    first, end = (int(x) for x in args.seeds.split(":"))
    out = open(args.out, "a") if args.out else None
    bad = 0
    for seed in range(first, end):
        spec, t0 = draw(seed), time.time()
        try:
            status, fails = check(spec)
        except Exception:  # a rank's exception or a hang (the launcher's deadline), with every traceback
            status, fails = "ERROR", [traceback.format_exc()[-4000:]]
        bad += status in ("FAIL", "ERROR")
        print(f"{seed} {status} {time.time() - t0:.1f}s {fails[0][-300:] if fails else ''}", flush=True)
        if out:
            out.write(json.dumps(dict(seed=seed, status=status, fails=fails[:6], spec=spec)) + "\n")
            out.flush()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
