"""The largest model each library trains under the same memory cap per rank (issue 73; issue 70's capacity row).

For a model family built from a config (transformers' LlamaForCausalLM, or shardopt.tools.gpt's GPT), grown in
steps of depth (layers, at a fixed width) or width (hidden size in steps of 64, at a fixed depth), at 2 and
4 gloo ranks with every rank in a cgroup-v1 memory group capped at --cap-mib
(shardopt/cluster/memory_cap.py, Note [What a capped rank is charged]: joined after the imports and the
process group, so the cap is what building and training take), this finds by bisection the largest size
that trains --steps steps (AdamW, fp32) with no rank killed, for each variant:

  shardopt ZeRO-2                    built whole on every rank (stages 1-2 hold whole parameters), AdamW(fused)
  shardopt ZeRO-2 + offload cpu      offload="cpu": masters, gradient chunks and state on the host, CPUAdam
  shardopt ZeRO-3                    built on the meta device, materialised by ShardedDDP, AdamW(fused)
  shardopt ZeRO-3 + offload cpu      the same with offload="cpu"
  FSDP2 fully_shard                  meta device, fully_shard per block and the root (reshard after forward),
                                     to_empty, the model's own init, rotary tables computed again, AdamW(fused)
  DeepSpeed ZeRO-3                   zero.Init while building (transformers' HfDeepSpeedConfig + from_config for
                                     the Llama), transformers' "auto" bucket sizes, torch AdamW(fused)
  DeepSpeed ZeRO-3 + NVMe            offload_param and offload_optimizer on device "nvme" (--nvme-dir), its CPU Adam
                                     and async I/O op (libaio; built before the cap), with --tiers: parameter
                                     buffers of the largest parameter (its default, 5 x 1e8 elements, is 2 GB
                                     per rank), max_in_cpu its default (1e9: the parameters of a smaller model
                                     stay in host memory) or 0 (every parameter on the disk)
  shardopt tiers (--tiers)           offload="nvme"; offload_param="cpu"; offload="nvme" + offload_param="nvme"
                                     (--nvme-dir), bisected like the others

Then, at one common size (--common-size, else the smallest of the largest sizes found; the same size at
every world size), each variant once more with no cap (a peak is only a measure far below the cap): the
charged peak (memory.max_usage_in_bytes) and the resting charge after the last step's zero_grad
(memory.usage_in_bytes), max over ranks, beside 16P/N and, for shardopt, what opt.memory_stats() counts.

Bisection: from a size guessed by arithmetic, up by half until a size fails, down by a third until one trains,
then halving the gap; each probe is a fresh set of ranks (spawned: Note [What a capped rank is charged]).
A size "trains" when every rank finishes; a run that fails for another reason than the OOM killer stops that
variant's search and is reported. MALLOC_MMAP_THRESHOLD_ is set to 1 MiB for every rank (as
benchmarks/zero3_fit.py does), so that a freed tensor goes back to the kernel at once: the charge is what a
library holds, not what glibc keeps (--glibc-default leaves it alone). Each probe is appended to --record
(JSON lines) and a rerun with the same settings reuses it, so an interrupted run resumes.

    python benchmarks/bench_capacity.py --quick                    # a few minutes: GPT, 2 ranks, 3 variants
    python benchmarks/bench_capacity.py --out benchmarks/results/DATE-capacity.md      # the full bisection
    python benchmarks/bench_capacity.py --family gpt --seq 128 --grow none --common-size 10 --worlds 4 --steps 3
        # issue 73's measurement: the 35.8M GPT (dim 512 x 10 blocks), 4 ranks, peak and resting only
    ... --record R.jsonl --out R.md --report-only    # the report again from the record: no probe is run

Needs root and the cgroup-v1 memory controller; the groups are removed afterwards, also after failures.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from shardopt.cluster.memory_cap import RankOutcome, run_capped  # noqa: E402

MIB = 2**20
LR, WD = 1e-4, 0.1

# name -> (library, options). Order = table order.
VARIANTS = {
    "shardopt ZeRO-2": ("shardopt", {"stage": 2}),
    "shardopt ZeRO-2 + offload cpu": ("shardopt", {"stage": 2, "offload": "cpu"}),
    "shardopt ZeRO-3": ("shardopt", {"stage": 3}),
    "shardopt ZeRO-3 + offload cpu": ("shardopt", {"stage": 3, "offload": "cpu"}),
    # One host: the gathers through the process group instead of shared memory (a segment is charged to the
    # rank that first touches it, Note [What a capped rank is charged]).
    "shardopt ZeRO-3 (gather through the process group)": ("shardopt", {"stage": 3, "shared_memory_gather": False}),
    "FSDP2 fully_shard": ("fsdp2", {}),
    "DeepSpeed ZeRO-3": ("deepspeed", {}),
    "DeepSpeed ZeRO-3 + offload cpu": ("deepspeed", {"offload": "cpu"}),
    "DeepSpeed ZeRO-3 + NVMe": ("deepspeed", {"offload": "nvme"}),
    "DeepSpeed ZeRO-3 + NVMe (max_in_cpu 0)": ("deepspeed", {"offload": "nvme", "max_in_cpu": 0}),
    "shardopt ZeRO-3 + offload nvme": ("shardopt", {"stage": 3, "offload": "nvme"}),
    "shardopt ZeRO-3 + offload_param cpu": ("shardopt", {"stage": 3, "offload_param": "cpu"}),
    "shardopt ZeRO-3 + offload nvme + offload_param nvme": ("shardopt", {"stage": 3, "offload": "nvme",
                                                                         "offload_param": "nvme"}),
}
DEFAULT_VARIANTS = ["shardopt ZeRO-2", "shardopt ZeRO-2 + offload cpu", "shardopt ZeRO-3",
                    "shardopt ZeRO-3 + offload cpu", "FSDP2 fully_shard", "DeepSpeed ZeRO-3"]
TIER_VARIANTS = ["DeepSpeed ZeRO-3 + NVMe", "DeepSpeed ZeRO-3 + NVMe (max_in_cpu 0)", "shardopt ZeRO-3 + offload nvme",
                 "shardopt ZeRO-3 + offload_param cpu", "shardopt ZeRO-3 + offload nvme + offload_param nvme"]


def _on_disk(options: dict) -> bool:
    return "nvme" in (options.get("offload"), options.get("offload_param"))


# ------------------------------------------------------------------ the model family
@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: `size` steps of depth (layers) or of width (hidden = 64 x size)."""

    name: str  # "llama" or "gpt"
    grow: str  # "depth", "width" or "none" (only --common-size)
    hidden: int
    layers: int
    vocab: int
    seq: int

    def shape(self, size: int) -> tuple[int, int]:
        """(hidden, layers) at `size`."""
        if self.grow == "width":
            return 64 * size, self.layers
        return self.hidden, size

    def describe(self, size: int) -> str:
        hidden, layers = self.shape(size)
        return f"hidden {hidden} x {layers} layers"

    def config(self, size: int):
        hidden, layers = self.shape(size)
        if self.name == "gpt":
            from shardopt.tools.gpt import GPTConfig

            return GPTConfig(vocab=self.vocab, dim=hidden, layers=layers, heads=8, seq=self.seq)
        import transformers

        heads = max(1, hidden // 64)
        return transformers.LlamaConfig(vocab_size=self.vocab, hidden_size=hidden,
                                        intermediate_size=64 * round(hidden * 8 / 3 / 64),
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=heads, max_position_embeddings=self.seq,
                                        tie_word_embeddings=False)

    def build(self, size: int):
        """The model, on the current default device (the meta device inside `with torch.device("meta")`)."""
        if self.name == "gpt":
            from shardopt.tools.gpt import GPT

            return GPT(self.config(size))
        import transformers

        return transformers.LlamaForCausalLM(self.config(size))

    def params(self, size: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build(size).parameters())

    def largest_param(self, size: int) -> int:
        with torch.device("meta"):
            return max(p.numel() for p in self.build(size).parameters())

    def blocks(self, model):
        """The repeated blocks (FSDP2 wraps each)."""
        return model.blocks if self.name == "gpt" else model.model.layers


def _loss(family: Family, model, ids):
    if family.name == "gpt":
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.roll(-1, 1).reshape(-1))
    return model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------ in each rank
def _import_before_cap(lib: str, options: dict, family: Family) -> None:
    """Everything the variant imports lazily, imported before the cap (imports are not what is compared)."""
    import importlib

    import torch.distributed.fsdp  # noqa: F401 - also what transformers and DeepSpeed reach for

    if family.name == "llama":
        importlib.import_module("transformers.models.llama.modeling_llama")
        importlib.import_module("transformers.loss.loss_utils")
    if lib == "shardopt":
        for name in ("shardopt.flat_params", "shardopt.zero3", "shardopt.zero3.store", "shardopt.cpu_adam",
                     "shardopt.parallel.shared_memory"):
            importlib.import_module(name)
    elif lib == "fsdp2":
        importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
        importlib.import_module("torch.distributed.tensor")
    elif lib == "deepspeed":
        import deepspeed  # noqa: F401

        for name in ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partition_parameters",
                     "deepspeed.runtime.engine", "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
                     "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper"):
            importlib.import_module(name)
        if family.name == "llama":
            importlib.import_module("transformers.integrations.deepspeed")
        from deepspeed.accelerator import get_accelerator

        # Its communication backend on the existing process group (deepspeed.initialize would do it after the
        # cap): on the CPU accelerator it loads (and on first use compiles) its shared-memory op in this process.
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                                        dist_init_required=False)
        if options.get("offload") in ("cpu", "nvme"):
            get_accelerator().create_op_builder("CPUAdamBuilder").load()
        if options.get("offload") == "nvme":
            get_accelerator().create_op_builder("AsyncIOBuilder").load()


def _ds_config(family: Family, size: int, options: dict, nvme_dir: str | None, batch: int) -> dict:
    hidden, _ = family.shape(size)
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            # transformers' "auto" values for this hidden size (what the HF Trainer writes)
            "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    offload = options.get("offload")
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                                     "buffer_count": 4, "fast_init": False}
        # buffer_size: DeepSpeed's default (1e8 elements) x buffer_count 5 is 2 GB of buffers on every rank;
        # the smallest it accepts is the largest parameter. max_in_cpu: its default (1e9 elements) keeps a
        # smaller model's parameter partitions in host memory; 0 puts every one on the disk.
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": family.largest_param(size),
                                 "max_in_cpu": options.get("max_in_cpu", int(1e9))}
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                         "overlap_events": True}
    if offload in ("cpu", "nvme"):  # DeepSpeed requires its own CPU Adam with optimizer offload
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    return config


def _build(lib: str, options: dict, family: Family, size: int, spec: dict):
    """(forward-and-loss, backward, step, the optimizer if shardopt's, things to keep alive)."""
    rank = torch.distributed.get_rank()
    if lib == "shardopt":
        import shardopt

        stage3 = options["stage"] == 3
        torch.manual_seed(0)
        if stage3:
            with torch.device("meta"):
                model = family.build(size)
        else:
            model = family.build(size)
        kw = dict(options)
        if options.get("offload", "none") == "none":
            kw.update(optim=torch.optim.AdamW, fused=True)
        if _on_disk(options):
            kw["nvme_path"] = spec["nvme_dir"]
        opt = shardopt.ShardedOptimizer(model.parameters(), lr=LR, weight_decay=WD, **kw)
        init = None
        if stage3 and family.name == "gpt":
            from shardopt.tools.gpt import init_weights as init
        wrapper = shardopt.ShardedDDP(model, opt, param_init_fn=init)
        return wrapper, lambda loss: loss.backward(), _torch_step(opt), opt, (wrapper, opt)
    if lib == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = family.build(size)
        for block in family.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        _init_after_to_empty(family, model, size)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        return model, lambda loss: loss.backward(), _torch_step(opt), None, (model, opt)
    if lib == "deepspeed":
        import deepspeed

        config = _ds_config(family, size, options, spec["nvme_dir"], spec["batch"])
        torch.manual_seed(0)
        keep = ()
        if family.name == "llama":
            import transformers
            from transformers.integrations import HfDeepSpeedConfig

            keep = (HfDeepSpeedConfig(config),)  # from_config builds under zero.Init while it lives
            model = transformers.AutoModelForCausalLM.from_config(family.config(size))
        else:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = family.build(size)
        opt = None
        if "optimizer" not in config:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        return engine, engine.backward, engine.step, None, (engine,) + keep
    raise ValueError(lib)


def _torch_step(opt):
    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _init_after_to_empty(family: Family, model, size: int) -> None:
    """What torch's meta-device recipe asks after to_empty: every parameter initialised and every buffer
    computed again (the rotary table is in no state dict)."""
    if family.name == "gpt":
        from shardopt.tools.gpt import init_weights

        model.apply(init_weights)
        return
    model.apply(model._init_weights)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=family.config(size))


def _train(rank, world_size, cap, spec):
    import logging
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # torch's renamed collectives, once per call from DeepSpeed

    lib, options = VARIANTS[spec["variant"]]
    family = Family(**spec["family"])
    if lib == "deepspeed":
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _import_before_cap(lib, options, family)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cap.join()
    t0 = time.perf_counter()
    model, backward, step, opt, keep = _build(lib, options, family, spec["size"], spec)
    build_s = time.perf_counter() - t0
    built = cap.charged()
    losses, times = [], []
    io_start = _disk_bytes()
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(spec["steps"]):
        ids = torch.randint(0, family.vocab, (spec["batch"], family.seq), generator=g)
        t0 = time.perf_counter()
        loss = _loss(family, model, ids)
        backward(loss)
        step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        del loss
    resting = cap.rest()
    stat = cap.stat()
    disk = _disk_bytes() - io_start
    stats = None
    if opt is not None:
        stats = {k: v for k, v in opt.memory_stats().items() if isinstance(v, int)}
    torch.distributed.barrier()
    return {"losses": losses, "step_s": times, "build_s": build_s, "built": built, "resting": resting,
            "memory_stats": stats, "disk_bytes_per_step": disk / len(times),
            "resting_stat": {k: stat.get(k, 0) for k in ("rss", "cache", "shmem", "mapped_file")}}


def _disk_bytes() -> int:
    """Bytes this process (all its threads) has read from and written to a block device (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


# ------------------------------------------------------------------ the launcher
class Prober:
    """Runs (and records) one variant at one size and world size under a cap."""

    def __init__(self, args, family: Family):
        self.args, self.family = args, family
        self.record = args.record
        self.seen = {}
        if self.record and os.path.exists(self.record):
            with open(self.record) as f:
                for line in f:
                    row = json.loads(line)
                    self.seen[row["key"]] = row

    def key(self, variant, world, size, cap_mib) -> str:
        f = self.family
        return json.dumps([variant, world, size, cap_mib, dataclasses.astuple(f), self.args.steps, self.args.batch,
                           self.args.glibc_default])

    def probe(self, variant: str, world: int, size: int, cap_mib: int | None) -> dict:
        key = self.key(variant, world, size, cap_mib)
        if key in self.seen:
            return self.seen[key]
        if self.args.report_only:
            raise SystemExit(f"--report-only: {variant} at {world} ranks, size {size}, cap {cap_mib} MiB is not in "
                             f"{self.record}")
        spec = {"variant": variant, "family": dataclasses.asdict(self.family), "size": size,
                "steps": self.args.steps, "batch": self.args.batch, "nvme_dir": None}
        nvme = None
        if _on_disk(VARIANTS[variant][1]):
            nvme = tempfile.mkdtemp(prefix="capacity-nvme-", dir=self.args.nvme_dir)
            spec["nvme_dir"] = nvme
        try:
            run = run_capped(_train, world, spec, cap_bytes=None if cap_mib is None else cap_mib * MIB,
                             timeout=self.args.timeout, collective_timeout=min(300, self.args.timeout))
        finally:
            if nvme:
                shutil.rmtree(nvme, ignore_errors=True)
        killed = run.oom_killed
        failed = [r for r in run.ranks if r.outcome is not RankOutcome.FINISHED]
        first_error = failed[0].error if failed else ""
        row = {"key": key, "variant": variant, "world": world, "size": size, "cap_mib": cap_mib,
               "params": self.family.params(size), "trained": run.trained, "oom_killed": killed,
               "outcomes": [r.outcome.value for r in run.ranks], "error": "" if run.trained else run.summary(),
               "first_error": first_error, "detail": failed[0].detail if failed else "",
               "peaks": [r.peak for r in run.ranks],
               "resting": [r.resting for r in run.ranks], "seconds": run.seconds,
               "results": [r.result for r in run.ranks] if run.trained else None,
               "load": os.getloadavg()[0], "when": datetime.datetime.now().isoformat(timespec="seconds")}
        print(f"  {variant} | {world} ranks | size {size} ({row['params'] / 1e6:.1f}M) | cap {cap_mib} MiB: "
              f"{run.summary()} [{run.seconds:.0f} s]", flush=True)
        self.seen[key] = row
        if self.record:
            with open(self.record, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def _guess(family: Family, variant: str, world: int, cap: int, top: int) -> int:
    """A first size to try: the largest whose model states fit 55% of the cap by arithmetic (16P/N sharded;
    at stage 2 the whole parameters and gradients on every rank too; offload moves nothing off a CPU host)."""
    lib, options = VARIANTS[variant]
    per_param = 16 / world + (8 if lib == "shardopt" and options.get("stage") == 2 else 0)
    best = 1
    for size in range(1, top + 1):
        if family.params(size) * per_param <= 0.55 * cap * MIB:
            best = size
    return best


def largest(prober: Prober, variant: str, world: int, cap: int, top: int) -> dict:
    """The largest size in [1, top] that trains (assumed monotone), and the probe that bounds it from above."""
    ok, bad = 0, top + 1
    rows = {}

    def trains(size):
        rows[size] = prober.probe(variant, world, size, cap)
        r = rows[size]
        if not r["trained"] and not r["oom_killed"]:
            raise _Stop(r)
        return r["trained"]

    try:
        size = _guess(prober.family, variant, world, cap, top)
        if trains(size):
            ok = size
            while ok < top:  # up by half until a size fails
                nxt = min(top, max(ok + 1, math.ceil(ok * 1.5)))
                if not trains(nxt):
                    bad = nxt
                    break
                ok = nxt
        else:
            bad = size
            while bad > 1:  # down by a third until one trains
                nxt = max(1, min(bad - 1, math.floor(bad / 1.5)))
                if trains(nxt):
                    ok = nxt
                    break
                bad = nxt
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if trains(mid):
                ok = mid
            else:
                bad = mid
    except _Stop as stop:
        return {"size": ok or None, "stopped": stop.row, "above": None, "rows": rows}
    return {"size": ok or None, "stopped": None, "above": rows.get(bad), "rows": rows}


class _Stop(Exception):
    def __init__(self, row):
        super().__init__(row["error"])
        self.row = row


# What memory_stats() counts as held memory (its `offloaded` and `on_device` are the same bytes split by place).
COUNTED = ("params", "master", "grads", "optimizer_state", "staging", "tier_buffers")


def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.0f}"


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.machine())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("llama", "gpt"), default="llama")
    ap.add_argument("--grow", choices=("depth", "width", "none"), default="depth")
    ap.add_argument("--hidden", type=int, default=512, help="the fixed width when growing in depth")
    ap.add_argument("--layers", type=int, default=4, help="the fixed depth when growing in width")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap-mib", type=int, default=400, help="the cap of every rank's group")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--top", type=int, default=64, help="the largest size step tried")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--tiers", action="store_true", help="also the disk and parameter tiers (" +
                    "; ".join(TIER_VARIANTS) + ")")
    ap.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where the disk tiers' files go (a disk)")
    ap.add_argument("--common-size", type=int, default=None, help="the size of the peak/resting table")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per probe")
    ap.add_argument("--glibc-default", action="store_true", help="leave MALLOC_MMAP_THRESHOLD_ unset")
    ap.add_argument("--quick", action="store_true", help="a few minutes: GPT by depth at width 256, 2 ranks, "
                    "cap 200 MiB, shardopt ZeRO-3, FSDP2, DeepSpeed ZeRO-3, 3 steps")
    ap.add_argument("--record", default=None, help="JSON lines of every probe (reused when rerun)")
    ap.add_argument("--out", default=None, help="the markdown report (a PNG beside it)")
    ap.add_argument("--report-only", action="store_true", help="the report from --record alone: no probe is run "
                    "(a probe the record lacks is an error)")
    args = ap.parse_args()
    if args.report_only and not args.record:
        ap.error("--report-only needs --record")
    if args.quick:
        args.family, args.hidden, args.cap_mib, args.worlds, args.steps, args.top = "gpt", 256, 200, "2", 3, 24
        args.variants = "shardopt ZeRO-3,FSDP2 fully_shard,DeepSpeed ZeRO-3"
    if not args.glibc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    family = Family(args.family, args.grow, args.hidden, args.layers, args.vocab, args.seq)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.tiers:
        variants += [v for v in TIER_VARIANTS if v not in variants]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    prober = Prober(args, family)

    # 1. the largest size per variant and world size
    found = {}
    if args.grow != "none":
        for world in worlds:
            for variant in variants:
                print(f"{variant}, {world} ranks, cap {args.cap_mib} MiB", flush=True)
                found[variant, world] = largest(prober, variant, world, args.cap_mib, args.top)

    # 2. peak and resting charge at one common size, no cap
    sizes = [r["size"] for r in found.values() if r["size"]]
    common = args.common_size or (min(sizes) if sizes else 1)
    at_common = {}
    for world in worlds:
        for variant in variants:
            at_common[variant, world] = prober.probe(variant, world, common, None)

    report = _report(args, family, variants, worlds, found, common, at_common)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
        _plot(args.out[:-3] + ".png" if args.out.endswith(".md") else args.out + ".png", family, variants, worlds,
              found, common, at_common, args)


def _report(args, family, variants, worlds, found, common, at_common) -> str:
    # The date, load and time come from the probes the report shows (a rerun reuses recorded probes).
    probes = list({row["key"]: row for r in found.values() for row in r["rows"].values()}.values())
    probes += [row for row in at_common.values() if row["key"] not in {p["key"] for p in probes}]
    loads = [p["load"] for p in probes]
    lines = [f"# The largest model under a memory cap ({max(p['when'] for p in probes)[:10]})", "",
             f"Machine: {_cpu()}, {os.cpu_count()} cores (shared), torch {torch.__version__}, gloo; load average "
             f"(1 minute) when each probe ended {min(loads):.1f} to {max(loads):.1f}; {len(probes)} probes, "
             f"{sum(p['seconds'] for p in probes) / 60:.0f} min. "
             f"Model family: {'transformers LlamaForCausalLM' if family.name == 'llama' else 'shardopt.tools.gpt GPT'} "
             f"from a config, vocabulary {family.vocab}, sequence {family.seq}, batch {args.batch} per rank, "
             + (f"grown in depth at hidden {family.hidden}" if family.grow == "depth" else
                f"grown in width at {family.layers} layers" if family.grow == "width" else "one size")
             + f"; fp32, AdamW (lr {LR}, weight decay {WD}), {args.steps} steps. Each rank in a cgroup-v1 memory "
             f"group of its own, joined after its imports and process group (shardopt/cluster/memory_cap.py). "
             f"MALLOC_MMAP_THRESHOLD_ " + ("unset (glibc's default)" if args.glibc_default else "= 1 MiB") + ".",
             ""]
    if found:
        lines += [f"## Largest size that trains {args.steps} steps, cap {args.cap_mib} MiB per rank", "",
                  "| variant | ranks | largest | parameters | 16P/N (MiB) | peak at it (MiB, max rank) | "
                  "next size up | probes | load |", "|---|---|---|---|---|---|---|---|---|"]
        for world in worlds:
            for variant in variants:
                if (variant, world) not in found:
                    continue
                r = found[variant, world]
                size = r["size"]
                if size:
                    row = r["rows"][size]
                    shape = family.describe(size)
                    params = f"{row['params'] / 1e6:.1f}M"
                    state = _mib(16 * row["params"] / world)
                    peak = _mib(max(row["peaks"]))
                else:
                    shape, params, state, peak = "none", "-", "-", "-"
                if r["stopped"]:
                    above = f"stopped: {r['stopped']['error'][:200]}"
                elif r["above"]:
                    a = r["above"]
                    above = f"{a['size']} ({a['params'] / 1e6:.1f}M): {a['error'][:120]}"
                else:
                    above = f"none tried above ({args.top} is the top)"
                probe_loads = [probe["load"] for probe in r["rows"].values()]
                lines.append(f"| {variant} | {world} | {shape} | {params} | {state} | {peak} | {above} | "
                             f"{len(r['rows'])} | {min(probe_loads):.1f}-{max(probe_loads):.1f} |")
        lines.append("")
    lines += [f"## Charged memory at one size: {family.describe(common)} ({family.params(common) / 1e6:.1f}M "
              f"parameters), no cap", "",
              "Peak = memory.max_usage_in_bytes over the run after joining; resting = memory.usage_in_bytes after "
              "the last step's zero_grad; both the maximum over ranks (every rank's in the last column). "
              "memory_stats: what shardopt's opt.memory_stats() counts (params + master + grads + optimizer_state "
              "+ staging + tier_buffers, the disk tiers' host buffers), max over ranks. resting: anon / shmem / "
              "other cache: the group's memory.stat (rss, "
              "shmem, cache - shmem) of the rank with the largest resting charge. step: the median step after the "
              "first, over ranks. disk: bytes the rank read and wrote on a block device per step (/proc/self/io), "
              "max over ranks. load: the machine's 1-minute load average when the run ended. first loss: rank 0's, "
              f"against log(vocabulary) = {math.log(family.vocab):.2f} for a model initialised as GPT-2 is.", "",
              "| variant | ranks | 16P/N (MiB) | peak (MiB) | resting (MiB) | x FSDP2 peak | x FSDP2 resting | "
              "memory_stats (MiB) | resting: anon / shmem / other cache | step (s) | disk MiB/step | load | "
              "first loss | outcome | peak / resting per rank |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        ref = at_common.get(("FSDP2 fully_shard", world))
        ref_ok = ref is not None and ref["trained"]
        for variant in variants:
            row = at_common.get((variant, world))
            if row is None:
                continue
            state = _mib(16 * row["params"] / world)
            if not row["trained"]:
                lines.append(f"| {variant} | {world} | {state} | {_mib(max(row['peaks']))} | - | - | - | - | - | - | "
                             f"- | {row['load']:.1f} | - | {row['error'][:200]} | |")
                continue
            peak, rest = max(row["peaks"]), max(row["resting"])
            xp = f"{peak / max(ref['peaks']):.2f}" if ref_ok else "-"
            xr = f"{rest / max(ref['resting']):.2f}" if ref_ok else "-"
            stats = [r["memory_stats"] for r in row["results"]]
            counted = "-" if stats[0] is None else _mib(max(
                sum(s.get(k, 0) for k in COUNTED) for s in stats))
            step = sorted(t for r in row["results"] for t in r["step_s"][1:])
            step_s = f"{step[len(step) // 2]:.2f}" if step else "-"
            per_rank = ", ".join(f"{_mib(p)}/{_mib(r)}" for p, r in zip(row["peaks"], row["resting"]))
            disk = max(r.get("disk_bytes_per_step", 0) for r in row["results"])
            worst = row["results"][row["resting"].index(rest)]["resting_stat"]
            kinds = (f"{_mib(worst['rss'])} / {_mib(worst['shmem'])} / {_mib(worst['cache'] - worst['shmem'])}")
            lines.append(f"| {variant} | {world} | {state} | {_mib(peak)} | {_mib(rest)} | {xp} | {xr} | {counted} | "
                         f"{kinds} | {step_s} | {disk / MIB:.1f} | {row['load']:.1f} | "
                         f"{row['results'][0]['losses'][0]:.2f} | trained | {per_rank} |")
    far = [f"{v} ({w} ranks)" for (v, w), row in at_common.items()
           if row["trained"] and row["results"][0]["losses"][0] > 2 * math.log(family.vocab)]
    if far:
        lines += ["", f"First loss far above log(vocabulary): {', '.join(far)}. That model did not get the init the "
                  "others got (the values, not the shapes: what it is charged is the same)."]
    held = [(v, w, row) for (v, w), row in at_common.items() if row["trained"] and row["results"][0]["memory_stats"]]
    if held:
        # tier_buffers: only where the optimizer reports it (records made before the tiers do not)
        keys = tuple(k for k in COUNTED if any(k in r["memory_stats"] for _, _, row in held for r in row["results"]))
        lines += ["", "What shardopt's opt.memory_stats() counts at that size (MiB, rank 0 / rank 1 / ...), beside "
                  "its resting charge:", "",
                  "| variant | ranks | " + " | ".join(keys) + " | counted | resting charge |",
                  "|---|---|" + "---|" * (len(keys) + 2)]
        for v, w, row in held:
            stats = [r["memory_stats"] for r in row["results"]]
            cells = [" / ".join(_mib(s.get(k, 0)) for s in stats) for k in keys]
            counted = " / ".join(_mib(sum(s.get(k, 0) for k in keys)) for s in stats)
            lines.append(f"| {v} | {w} | " + " | ".join(cells) + f" | {counted} | "
                         + " / ".join(_mib(r) for r in row["resting"]) + " |")
    command = shlex.join(a for a in sys.argv[1:] if a != "--report-only")
    lines += ["", f"Command: `python benchmarks/bench_capacity.py {command}`"
              + (" (this report rendered again from the record with --report-only)" if args.report_only else "")]
    return "\n".join(lines)


def _plot(path, family, variants, worlds, found, common, at_common, args) -> None:
    from shardopt.tools.plotting import bar_panels

    panels = []
    if found:
        panels.append((f"largest trained, M parameters (cap {args.cap_mib} MiB/rank)",
                       {f"{w} ranks": [(found[v, w]["rows"][found[v, w]["size"]]["params"] / 1e6
                                        if (v, w) in found and found[v, w]["size"] else None) for v in variants]
                        for w in worlds}))
    for w in worlds:
        def value(v, key):
            row = at_common.get((v, w))
            return max(row[key]) / MIB if row is not None and row["trained"] else None
        panels.append((f"MiB charged at {family.describe(common)}, {w} ranks (max rank)",
                       {"peak": [value(v, "peaks") for v in variants],
                        "resting": [value(v, "resting") for v in variants]}))
    bar_panels(path, f"Memory cap per rank: {family.name}, {args.steps} steps", variants, panels)


if __name__ == "__main__":
    main()
