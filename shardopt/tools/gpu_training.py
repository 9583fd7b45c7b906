"""gpu_check's training part: what each rank runs, on the device gpu_check's Device gives it.

For every configuration of CONFIGS this build has: parity (CheckNet against a plain-PyTorch reference, at
Note [Parity bars]) and perf (the demo GPT's peak memory, host syncs and step time against DDP's).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

# Note [Parity bars]
# ------------------
# The test suite's bars for the same comparisons:
#   fp32: 1e-5 relative on every loss, clipped norm and final weight (tests/test_zero_parity.py): only the
#     summation order differs, while a missing divide or a wrong chunk is orders of magnitude out.
#   bf16: 2e-2 against tests/test_mixed_precision.py's master-weight loop (an ulp flips a bf16 rounding).
#   fp16: the same loop, one step poisoned with inf on the last rank: every rank skips it, the scale halves,
#     and the rest agree within 1e-3 (fp16 rounds a weight at 2**-11).
# DDP is the reference only for fp32: with bf16/fp16 it would step the low-precision weights themselves.
FP32_BAR, BF16_BAR, FP16_BAR = 1e-5, 2e-2, 1e-3
CLIP = 0.5
PARITY_BUCKET = 1000      # elements: parameters straddle buckets and rank chunks (tests/test_zero_parity.py)
INIT_SCALE = 2.0**12
LOW = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# name -> (inner class, None: offload's CPU Adam; kwargs; the reference's class; shardopt.estimate's name)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, "adamw"),
    # Adam is scale-invariant and would hide a wrong gradient scale; SGD does not.
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01), torch.optim.SGD, "sgd-momentum"),
    "cpuadam": (None, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, "cpuadam"),
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration gpu_check runs: its --configs key, the model's dtype (fp16 with a loss scaler), a key
    of OPTIMIZERS, the parity bar (Note [Parity bars])."""

    key: str
    title: str
    stage: int
    dtype: str = "fp32"
    optim: str = "adamw"
    offload: str = "none"
    bar: float = FP32_BAR

    def in_build(self) -> bool:
        from shardopt.config import STAGES

        return self.stage in STAGES


CONFIGS = (
    RunConfig("zero1", "ZeRO-1, fp32, AdamW", 1),
    RunConfig("zero2", "ZeRO-2, fp32, AdamW", 2),
    RunConfig("zero2-sgd", "ZeRO-2, fp32, SGD momentum", 2, optim="sgd"),
    RunConfig("zero3", "ZeRO-3, fp32, AdamW", 3),
    RunConfig("bf16", "ZeRO-2, bf16 model, AdamW", 2, dtype="bf16", bar=BF16_BAR),
    RunConfig("fp16", "ZeRO-2, fp16 model, loss scaling + an overflow, SGD", 2, dtype="fp16", optim="sgd",
              bar=FP16_BAR),
    RunConfig("offload", "ZeRO-2, offload=cpu (pinned copier, CPU Adam)", 2, optim="cpuadam", offload="cpu"),
)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What one world size runs (gpu_check.run_options): parity steps, timed pairs (a DDP and a sharded step,
    alternating which goes first), the demo GPT preset, torch threads per rank."""

    configs: tuple
    steps: int = 20
    time_steps: int = 30
    warmup: int = 5
    model: str = "small"
    threads: int = 1
    sync_steps: int = 3
    memory_steps: int = 3


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """Largest relative differences of a loss or clipped norm and of a final weight; notes: what was checked
    besides the numbers."""

    bar: float
    loss_err: float
    param_err: float
    failures: tuple = ()
    notes: tuple = ()


@dataclasses.dataclass(frozen=True)
class PerfResult:
    """Median step times, per-pair ratios (sharded / DDP), host syncs per step, peak bytes of each run alone,
    the sharded run's memory_stats()['on_device'], and shardopt.estimate's bytes (None: no estimate)."""

    ddp_ms: float
    ours_ms: float
    ratios: tuple
    ddp_syncs: float
    ours_syncs: float
    ddp_peak: int
    ours_peak: int
    ours_model_states: int
    ours_estimate: int | None
    ddp_estimate: int
    num_params: int


@dataclasses.dataclass(frozen=True)
class ConfigResult:
    config: RunConfig
    parity: ParityResult | None = None
    perf: PerfResult | None = None
    error: str | None = None  # a traceback, if it raised on this rank
    skipped: str | None = None  # why it did not run


def relative_error(want, got) -> float:
    """|want - got| / max(1, |want|) for numbers; max |want - got| / max |want| for tensors (in fp64)."""
    if torch.is_tensor(want):
        a, b = want.detach().double().cpu(), got.detach().double().cpu()
        if a.shape != b.shape:
            return math.inf
        if not a.numel():
            return 0.0
        err = (a - b).abs().max().item()
        return err / max(a.abs().max().item(), 1e-12) if math.isfinite(err) else math.inf
    err = abs(float(want) - float(got))
    return err / max(1.0, abs(float(want))) if math.isfinite(err) else math.inf


def compare_params(want: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]],
                   bar: float) -> tuple[float, list[str]]:
    """Largest relative error over named tensors, and one line per tensor beyond `bar` (or missing)."""
    worst, failures = 0.0, []
    if [n for n, _ in want] != [n for n, _ in got]:
        return math.inf, [f"parameter names differ: {[n for n, _ in want]} vs {[n for n, _ in got]}"]
    for (name, a), (_, b) in zip(want, got):
        err = relative_error(a, b)
        worst = max(worst, err)
        if not err <= bar:
            failures.append(f"final {name}: relative error {err:.2e} > {bar:.0e}")
    return worst, failures


class CheckNet(nn.Module):
    """tests/models.py's AwkwardNet: a tied embedding, a frozen layer, BatchNorm (a buffer DDP broadcasts),
    a branch some ranks skip on some steps, prime sizes (nothing divides by 2, 3 or 4)."""

    VOCAB, DIM, HIDDEN = 37, 24, 53

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, self.DIM)
        self.l1 = nn.Linear(self.DIM, self.HIDDEN)
        self.frozen = nn.Linear(self.HIDDEN, self.HIDDEN)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(self.HIDDEN)
        self.l2 = nn.Linear(self.HIDDEN, self.DIM)
        self.branch = nn.Linear(self.HIDDEN, self.DIM)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, use_branch: bool):
        h = self.frozen(torch.relu(self.l1(self.emb(x))))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        out = self.l2(h)
        if use_branch:
            out = out + self.branch(h)
        return self.head(out)


def _batch(step: int, rank: int, dev: torch.device):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    x = torch.randint(0, CheckNet.VOCAB, (3, 5), generator=g)
    y = torch.randint(0, CheckNet.VOCAB, (3, 5), generator=g)
    return x.to(dev), y.to(dev)


def _uses_branch(step: int, rank: int) -> bool:
    # With 2+ ranks: on some steps some ranks use it, on some steps no rank does.
    return (step + rank) % 3 == 0 and step % 4 != 1


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _groups(tensors: list[torch.Tensor]) -> list[dict]:
    # Two groups with different hyper-parameters, as with decay / no-decay.
    return [{"params": [t for t in tensors if t.ndim >= 2]},
            {"params": [t for t in tensors if t.ndim < 2], "weight_decay": 0.0}]


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _sharded(model: nn.Module, cfg: RunConfig, reduce_bucket_size: int | None, grouped: bool):
    """ShardedOptimizer + ShardedDDP under cfg; grouped: decay / no-decay groups, else one group."""
    import shardopt

    optim, kwargs, _, _ = OPTIMIZERS[cfg.optim]
    scale = shardopt.LossScaleConfig(init_scale=INIT_SCALE, growth_interval=1000) if cfg.dtype == "fp16" else "auto"
    params = _groups(_trainable(model)) if grouped else _trainable(model)
    opt = shardopt.ShardedOptimizer(params, optim=optim, stage=cfg.stage, offload=cfg.offload,
                                    reduce_bucket_size=reduce_bucket_size, loss_scale=scale, **kwargs)
    return shardopt.ShardedDDP(model, opt), opt


class _DDPReference:
    """DDP + the torch optimizer, clipping as the sharded run does (fp32 configurations)."""

    def __init__(self, model: nn.Module, cfg: RunConfig, world_size: int):
        from torch.nn.parallel import DistributedDataParallel

        _, kwargs, cls, _ = OPTIMIZERS[cfg.optim]
        self.model = model
        self.ddp = DistributedDataParallel(model, find_unused_parameters=True)
        self.opt = cls(_groups(_trainable(model)), **kwargs)

    def step(self, x, y, branch: bool, poison: bool):
        loss = _loss(self.ddp(x, branch), y)
        value = loss.item()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP).item()
        self.opt.step()
        self.opt.zero_grad()
        return value, norm


class _MasterReference:
    """The master-weight loop of tests/test_mixed_precision.py (bf16/fp16), with fp16's loss scaling rule."""

    def __init__(self, model: nn.Module, cfg: RunConfig, world_size: int):
        _, kwargs, cls, _ = OPTIMIZERS[cfg.optim]
        self.model, self.world_size = model, world_size
        self.params = _trainable(model)
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = cls(_groups(self.master), **kwargs)
        self.scale = INIT_SCALE if cfg.dtype == "fp16" else 1.0
        self.skipped = 0

    def step(self, x, y, branch: bool, poison: bool):
        loss = _loss(self.model(x, branch), y)
        value = loss.item()
        if poison:
            loss = loss * math.inf
        (loss * self.scale).backward()
        # One all-reduce of every gradient (zeros where this rank has none) and of "had one".
        parts = [p.grad.float() / self.scale / self.world_size if p.grad is not None else torch.zeros_like(m)
                 for p, m in zip(self.params, self.master)]
        had = torch.tensor([float(p.grad is not None) for p in self.params], device=self.master[0].device)
        flat = torch.cat([g.reshape(-1) for g in parts] + [had])
        dist.all_reduce(flat)
        self.model.zero_grad(set_to_none=True)
        if not torch.isfinite(flat).all():
            if self.scale == 1.0:
                raise FloatingPointError("the reference saw inf/nan gradients without a loss scaler")
            self.scale /= 2  # hysteresis 1: back off at once, as torch's GradScaler
            self.skipped += 1
            return value, None
        grads = flat[:-len(self.params)].split([m.numel() for m in self.master])
        for m, g, h in zip(self.master, grads, flat[-len(self.params):].tolist()):
            m.grad = g.view_as(m).clone() if h > 0 else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return value, None


def _full_params(opt):
    """Stage 3 keeps a rank's shard only: read whole weights through opt.full_params() (DESIGN.md)."""
    import contextlib

    if opt.params_sharded:
        return opt.full_params()
    return contextlib.nullcontext()


def parity(cfg: RunConfig, rank: int, world_size: int, dev: torch.device, steps: int) -> ParityResult:
    """Trains CheckNet `steps` steps both ways on this rank; compares at cfg.bar (Note [Parity bars])."""
    torch.manual_seed(0)
    base = CheckNet().to(device=dev, dtype=LOW[cfg.dtype])
    ref = (_DDPReference if cfg.dtype == "fp32" else _MasterReference)(copy.deepcopy(base), cfg, world_size)
    model = copy.deepcopy(base)
    wrapped, opt = _sharded(model, cfg, PARITY_BUCKET, grouped=True)
    poison_step = steps // 2 if cfg.dtype == "fp16" else None
    worst, failures, notes = 0.0, [], []
    for step in range(steps):
        x, y = _batch(step, rank, dev)
        branch = _uses_branch(step, rank)
        poison = step == poison_step and rank == world_size - 1
        want = ref.step(x, y, branch, poison)
        loss = _loss(wrapped(x, branch), y)
        got = [loss.item(), None]
        if poison:
            loss = loss * math.inf
        opt.scale_loss(loss).backward()
        if cfg.dtype == "fp32":
            got[1] = opt.clip_grad_norm(CLIP).item()
        opt.step()
        opt.zero_grad()
        for what, a, b in zip(("loss", "clipped norm"), want, got):
            if a is None:
                continue
            err = relative_error(a, b)
            worst = max(worst, err)
            if not err <= cfg.bar:
                failures.append(f"step {step} {what}: reference {a!r} vs sharded {b!r} ({err:.2e} > {cfg.bar:.0e})")
        if step == poison_step and not opt.last_step_skipped:
            failures.append(f"step {step}: an inf gradient on rank {world_size - 1} did not skip the step here")
    if poison_step is not None:
        if (opt.skipped_steps, opt.loss_scale) != (ref.skipped, ref.scale):
            failures.append(f"after the overflow: {opt.skipped_steps} skipped, scale {opt.loss_scale}; the reference "
                            f"skipped {ref.skipped}, scale {ref.scale}")
        else:
            notes.append(f"overflow at step {poison_step} on rank {world_size - 1}: skipped here, scale "
                         f"{INIT_SCALE:g} -> {opt.loss_scale:g}")
    opt.wait_params()
    with _full_params(opt):
        param_err, bad = compare_params(list(ref.model.named_parameters()), list(model.named_parameters()), cfg.bar)
        failures += bad
        if cfg.dtype == "fp32":
            for (name, a), (_, b) in zip(ref.model.named_buffers(), model.named_buffers()):
                if a.is_floating_point() and not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7):
                    failures.append(f"buffer {name} differs (max {(a.double() - b.double()).abs().max().item():.2e})")
    if any(p.dtype != LOW[cfg.dtype] for p in model.parameters()):
        failures.append(f"the model's parameters are no longer {cfg.dtype}")
    if cfg.offload == "cpu":
        failures += _offload_checks(opt, dev, notes)
    return ParityResult(cfg.bar, worst, param_err, tuple(failures), tuple(notes))


def _offload_checks(opt, dev: torch.device, notes: list) -> list[str]:
    """With a CUDA model: host chunks pinned, and this build's side-stream copier (csrc/comm/copy_device_cuda.cpp)."""
    from shardopt import _ext

    if dev.type != "cuda":
        notes.append(f"pinned memory and the side-stream copier not checked: the model is on {dev.type}")
        return []
    failures = []
    for name, t in (("master chunks", opt.master), ("gradient chunks", opt.shard_grad)):
        if t is None or t.device.type != "cpu" or not t.is_pinned():
            failures.append(f"offload: the {name} are not pinned host memory")
    copier = _ext._C.default_copy_device()
    if copier is None:
        failures.append("offload: this build has no CUDA copier (shardopt._C.default_copy_device() is None): "
                        "rebuild the extension against a CUDA torch")
    else:
        notes.append(f"host chunks pinned; engine copier {type(copier).__name__}, "
                     f"{opt.engine.copy_seconds:.3f} s in host copies")
    return failures


def _gpt_step(wrapper, opt, batch, sharded: bool) -> None:
    x, y = batch
    loss = _loss(wrapper(x), y)
    (opt.scale_loss(loss) if sharded else loss).backward()
    opt.step()
    opt.zero_grad()


def perf(cfg: RunConfig, rank: int, world_size: int, device, dev: torch.device, opts: RunOptions) -> PerfResult:
    """Memory (each alone), host syncs and interleaved step time of the GPT under cfg and under DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from shardopt.estimate import EstimateConfig, estimate, estimate_ddp, trainable_shapes
    from shardopt.tools.gpt import GPT, PRESETS, num_params, synthetic_batch

    c = PRESETS[opts.model]
    dtype = LOW[cfg.dtype]
    optim, kwargs, ref_cls, state_name = OPTIMIZERS[cfg.optim]
    # On the device before anything is counted: a copy from pageable host memory is itself a host sync.
    batches = [tuple(t.to(dev) for t in synthetic_batch(c, 8, c.seq, i, rank)) for i in range(8)]

    def model():
        torch.manual_seed(0)
        return GPT(c).to(device=dev, dtype=dtype)

    def ours():
        # One parameter group, default buckets: what shardopt.estimate plans.
        return _sharded(model(), cfg, None, grouped=False)

    def ddp():
        m = model()
        return DistributedDataParallel(m), ref_cls(m.parameters(), **kwargs)

    def peak(build, sharded):
        gc.collect()
        device.reset_peak_memory()
        wrapper, opt = build()
        for i in range(opts.memory_steps):
            _gpt_step(wrapper, opt, batches[i % len(batches)], sharded)
        device.synchronize()
        stats = opt.memory_stats()["on_device"] if sharded else 0
        return device.max_memory_allocated(), stats

    ours_peak, ours_states = peak(ours, True)
    ddp_peak, _ = peak(ddp, False)
    with torch.device("meta"):
        shapes = trainable_shapes(GPT(c))
    try:
        est = estimate(shapes, EstimateConfig(world_size=world_size, stage=cfg.stage, offload=cfg.offload,
                                              param_dtype=dtype, optimizer=state_name, device=dev.type))
        ours_estimate = est.total - est.host
    except ValueError:  # e.g. a stage shardopt.estimate does not know yet
        ours_estimate = None
    ddp_estimate = estimate_ddp(shapes, dtype, "sgd-momentum" if cfg.optim == "sgd" else "adamw").total

    gc.collect()
    runs = {"ddp": ddp(), "ours": ours()}
    for name, (wrapper, opt) in runs.items():
        for i in range(opts.warmup):
            _gpt_step(wrapper, opt, batches[i % len(batches)], name == "ours")
    syncs = {}
    for name, (wrapper, opt) in runs.items():
        with device.count_host_syncs() as counter:
            for i in range(opts.sync_steps):
                _gpt_step(wrapper, opt, batches[i % len(batches)], name == "ours")
        syncs[name] = counter.count / opts.sync_steps
    times = {"ddp": [], "ours": []}
    for i in range(opts.warmup + opts.time_steps):
        for name in ("ddp", "ours") if i % 2 == 0 else ("ours", "ddp"):
            wrapper, opt = runs[name]
            device.synchronize()
            t0 = time.perf_counter()
            _gpt_step(wrapper, opt, batches[i % len(batches)], name == "ours")
            device.synchronize()
            if i >= opts.warmup:
                times[name].append(time.perf_counter() - t0)
    ratios = tuple(o / d for o, d in zip(times["ours"], times["ddp"]))
    return PerfResult(ddp_ms=statistics.median(times["ddp"]) * 1e3, ours_ms=statistics.median(times["ours"]) * 1e3,
                      ratios=ratios, ddp_syncs=syncs["ddp"], ours_syncs=syncs["ours"], ddp_peak=ddp_peak,
                      ours_peak=ours_peak, ours_model_states=ours_states, ours_estimate=ours_estimate,
                      ddp_estimate=ddp_estimate, num_params=num_params(runs["ddp"][0].module))


def rank_main(rank: int, world_size: int, device, opts: RunOptions) -> list[ConfigResult]:
    """Every configuration of opts on this rank (gpu_check launches one process per GPU)."""
    torch.set_num_threads(opts.threads)
    dev = device.set_device(rank)
    # perf() collects garbage between runs; frozen, what exists now does not slow each collection.
    gc.freeze()
    out = []
    for cfg in opts.configs:
        if not cfg.in_build():
            out.append(ConfigResult(cfg, skipped="not in this build (shardopt.config.STAGES has no "
                                                 f"stage {cfg.stage})"))
            continue
        # Raised on every rank: reported, the next runs; on some ranks only: the others time out.
        parity_result = perf_result = error = None
        try:
            parity_result = parity(cfg, rank, world_size, dev, opts.steps)
            perf_result = perf(cfg, rank, world_size, device, dev, opts)
        except Exception:  # noqa: BLE001 - reported in the file, and fails the check
            error = traceback.format_exc()
        out.append(ConfigResult(cfg, parity_result, perf_result, error))
    return out
