"""A pretrained model too big for one rank, in and out (issue 53): what each way of loading, training and saving
it is charged, 4 ranks, each under a cgroup-v1 memory cap below the whole fp32 model plus its own shard.

The model is a transformers LlamaForCausalLM built from a config (no download), P parameters in fp32. Its
"pretrained" folder is written once by this (uncapped) process with save_pretrained, in shards of
--shard-size as a hub model is, and read through once before each journey, so that its pages are in the
page cache charged to this process, not to the ranks: a rank is charged for what it copies out of the
files, not for the cache (a mmap of a cached file costs a rank nothing). Each journey is a fresh set of
--world-size ranks (gloo, shardopt.cluster.ranks.run_ranks); each rank imports what it needs, sets up its
process group, and only then joins a cgroup of its own capped at the journey's cap (zero3_fit.join_cgroup:
only what it touches from then on is charged). A rank over its cap is killed by the kernel (SIGKILL, exit -9).

Journeys (--journeys, comma-separated):
  ours-full  shardopt.from_pretrained(LlamaForCausalLM, folder) (parameters on meta) -> ShardedOptimizer
             (AdamW, stage 3) -> ShardedDDP (materialised bucket by bucket, each rank reads its shards of the
             files) -> steps -> shardopt.save_weights(ddp, out) (streamed bucket by bucket from rank 0).
             Needs 16P/N (fp32 parameter shard, gradient shard, exp_avg, exp_avg_sq), the staging pool and the
             gathered buckets.
  ours-lora  the same from_pretrained, then peft.get_peft_model(LoraConfig(r=8, q/k/v/o_proj)), the optimizer
             over the trainable parameters, stage 3 (the frozen base sharded: 4P/N), steps, the adapters
             gathered and written by rank 0 as PEFT writes them (as ShardedTrainer.save_model does).
  today      the path before issue 53: LlamaForCausalLM.from_pretrained(folder) whole on every rank, ShardedDDP
             stage 3 shards it, steps, save as save_model did before (opt.full_params: the whole model
             gathered on every rank, rank 0 writes it with save_pretrained).
  fsdp2      torch's documented way: the model built on meta, fully_shard per decoder layer and the root,
             to_empty, rank 0 reads the whole state dict (safetensors load_file) and
             set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True), AdamW, steps,
             get_model_state_dict(full_state_dict=True, cpu_offload=True) (whole on rank 0), rank 0 writes it.
  deepspeed  DeepSpeed ZeRO-3 on CPU/gloo: transformers' from_pretrained under HfDeepSpeedConfig (zero.Init:
             partitioned as built; rank 0 reads the files and each module is gathered to take its values),
             deepspeed.initialize with torch AdamW (HF's "auto" bucket sizes for the hidden size), steps,
             save_16bit_model with stage3_gather_16bit_weights_on_model_save (whole on rank 0).

How memory is measured: each phase's charged peak is the group's memory.max_usage_in_bytes, reset (0
written) at the end of the phase before; a group's charge counts anonymous memory and the page cache it
brings in (files it writes: the saved weights, on the rank that writes them). Beside it, "anon" is the
most `rss` (anonymous memory) in the group's memory.stat seen by a thread sampling it every 10 ms (a
lower bound: a spike shorter than that can be missed). MALLOC_MMAP_THRESHOLD_ is fixed at 1 MiB, so that
large tensors are returned to the kernel as soon as they are freed. Each rank appends a line per finished
phase to a log, so a killed rank tells the phase it was killed in.

    python benchmarks/weights_memory.py --journeys ours-full,today,fsdp2,deepspeed --cap-mib 1000
    python benchmarks/weights_memory.py --journeys ours-lora --lora-cap-mib 400 \
        --lora-options '{"reduce_bucket_size": 65536}'
    python benchmarks/weights_memory.py --journeys "" --report FILE    # the report of every record so far

(benchmarks/results/2026-11-28-weights-memory.md: those runs, the same at a cap none reaches, and the
findings.) LoRA with shardopt's default bucket size gathers most of the frozen base at once in backward
(the adapters' few buckets come late in the backward's order and everything before them is gathered with
them): --lora-options sets reduce_bucket_size to one layer's adapters (r x 2 x hidden x 4 projections).
transformers' from_pretrained (and safetensors' load_file) map same-dtype safetensors files rather than copy
them: with the files cached, a whole load is not charged to the rank; a copy of the values is.

Each run appends its journeys to --record (JSON lines) and rewrites the report from every record there.
Needs root (the cgroups are made under /sys/fs/cgroup/memory and removed afterwards, also after failures).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from shardopt.cluster.ranks import RankFailure, run_ranks  # noqa: E402
from zero3_fit import CGROUP, charged_peak, join_cgroup, remove_groups, reset_peak  # noqa: E402

MIB = 2**20
LR = 1e-4
STEPS = 2
JOURNEYS = ("ours-full", "ours-lora", "today", "fsdp2", "deepspeed")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_R = 8


def llama_config(spec):
    import transformers

    return transformers.LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                                    intermediate_size=spec["inter"], num_hidden_layers=spec["layers"],
                                    num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"],
                                    max_position_embeddings=256, tie_word_embeddings=False)


def batch(spec, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, spec["vocab"], (1, spec["seq"]), generator=g)


# ------------------------------------------------------------------ in each rank
def _group_stat(group: str, key: str) -> int:
    with open(os.path.join(group, "memory.stat")) as f:
        for line in f:
            name, value = line.split()
            if name == key:
                return int(value)
    return 0


def _rss_file() -> int:
    """This process's resident file-backed pages (/proc/self/status RssFile): mmapped weights files show here."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


class Meter:
    """This rank's cgroup, capped; the charged peak and the anonymous-memory peak of each phase."""

    def __init__(self, rank: int, spec: dict):
        self.rank = rank
        self.group = join_cgroup(f"{spec['group_prefix']}{rank}", spec["cap_mib"])
        self.log = os.path.join(spec["logdir"], f"rank{rank}.jsonl")
        self.phases = []
        self.anon = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.01):
            rss = _group_stat(self.group, "rss")
            with self._lock:
                self.anon = max(self.anon, rss)

    def end(self, phase: str) -> None:
        """The phase that just ended: its peaks, written to the log at once (a rank killed later keeps it)."""
        rss = _group_stat(self.group, "rss")
        with self._lock:
            anon, self.anon = max(self.anon, rss), rss
        row = {"phase": phase, "peak": charged_peak(self.group), "anon": anon,
               "after": _group_stat(self.group, "rss") + _group_stat(self.group, "cache"),
               "cache_after": _group_stat(self.group, "cache"), "rss_file": _rss_file()}
        self.phases.append(row)
        with open(self.log, "a") as f:
            f.write(json.dumps(row) + "\n")
        reset_peak(self.group)

    def close(self, **extra) -> dict:
        self._stop.set()
        self._thread.join()
        return {"phases": self.phases, **extra}


def _steps(model, opt, spec, rank, meter, backward=None):
    losses = []
    for step in range(STEPS):
        ids = batch(spec, step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        (backward or (lambda t: t.backward()))(loss)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        meter.end(f"step {step + 1}")
    return losses


def _ours_stats(opt):
    stats = opt.memory_stats()
    return {"held": {k: stats[k] for k in ("params", "master", "grads", "optimizer_state", "staging")},
            "peak_live": opt.store.peak_live, "bucket_numel": opt.store.layout.bucket_numel}


def _ours_full(rank, world, spec):
    import shardopt
    import transformers

    cls = transformers.LlamaForCausalLM  # imported (transformers imports lazily) before the cap
    meter = Meter(rank, spec)
    model = shardopt.from_pretrained(cls, spec["folder"])
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=3, **spec["ours_options"])
    meter.end("from_pretrained on meta + optimizer")
    ddp = shardopt.ShardedDDP(model, opt)
    meter.end("ShardedDDP: materialise, read own shards")
    losses = _steps(ddp, opt, spec, rank, meter)
    stats = _ours_stats(opt)
    shardopt.save_weights(ddp, spec["out"])
    meter.end("save_weights (streamed)")
    return meter.close(losses=losses, **stats)


def _ours_lora(rank, world, spec):
    import peft
    import shardopt
    import transformers

    cls = transformers.LlamaForCausalLM
    meter = Meter(rank, spec)
    torch.manual_seed(3)
    model = peft.get_peft_model(shardopt.from_pretrained(cls, spec["folder"]),
                                peft.LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules=LORA_TARGETS, lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable)  # on meta: at stage 3 a wrapped parameter is empty between uses
    opt = shardopt.ShardedOptimizer(trainable, torch.optim.AdamW, lr=LR, stage=3, **spec["lora_options"])
    meter.end("from_pretrained on meta + LoRA + optimizer")
    ddp = shardopt.ShardedDDP(model, opt)
    meter.end("ShardedDDP: materialise, read own shards")
    losses = _steps(ddp, opt, spec, rank, meter)
    stats = _ours_stats(opt)
    # The adapters gathered (small) and written by rank 0 as PEFT writes them, as ShardedTrainer.save_model does.
    names = {id(p): n for n, p in model.named_parameters()}
    store = opt.view.store
    state = {names[id(store.members[i])]: value for i, value in store.stream(range(len(opt.view.params)))}
    if rank == 0:
        model.save_pretrained(spec["out"], state_dict=state)
    torch.distributed.barrier()
    meter.end("adapters gathered + written")
    return meter.close(losses=losses, trainable=count, **stats)


def _today(rank, world, spec):
    import shardopt
    import transformers

    cls = transformers.LlamaForCausalLM
    meter = Meter(rank, spec)
    model = cls.from_pretrained(spec["folder"])
    meter.end("from_pretrained whole")
    opt = shardopt.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, stage=3, **spec["ours_options"])
    ddp = shardopt.ShardedDDP(model, opt)
    meter.end("ShardedDDP shards it")
    losses = _steps(ddp, opt, spec, rank, meter)
    # save_model() at stage 3 before issue 53: every rank gathers the whole model, rank 0 writes it.
    with opt.full_params(writeback=False):
        if rank == 0:
            state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
            model.save_pretrained(spec["out"], state_dict=state)
        torch.distributed.barrier()
    meter.end("save gathering whole (full_params)")
    return meter.close(losses=losses)


def _fsdp2(rank, world, spec):
    import transformers
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cls = transformers.LlamaForCausalLM
    config = transformers.LlamaConfig.from_pretrained(spec["folder"])
    meter = Meter(rank, spec)
    with torch.device("meta"):
        model = cls(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    # The rotary table is a buffer computed in __init__, absent from the state dict: computed again, as
    # torch's meta-device recipe asks of buffers (to_empty leaves them undefined).
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    meter.end("meta build + fully_shard + to_empty")
    full = {}
    if rank == 0:
        for name in sorted(os.listdir(spec["folder"])):
            if name.endswith(".safetensors"):
                full.update(load_file(os.path.join(spec["folder"], name)))
    meter.end("rank 0 reads the whole state dict")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    meter.end("set_model_state_dict (broadcast from rank 0)")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _steps(model, opt, spec, rank, meter)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    meter.end("get_model_state_dict (full, cpu_offload)")
    if rank == 0:
        os.makedirs(spec["out"], exist_ok=True)
        save_file(state, os.path.join(spec["out"], "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(spec["out"])
    del state
    torch.distributed.barrier()
    meter.end("rank 0 writes it")
    return meter.close(losses=losses)


def _deepspeed(rank, world, spec):
    os.environ["LOCAL_RANK"] = os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    import logging

    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    h = spec["hidden"]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                                    # transformers' "auto" values for this hidden size
                                    "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                    "stage3_param_persistence_threshold": 10 * h,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    cls = transformers.LlamaForCausalLM
    keep = HfDeepSpeedConfig(config)  # transformers reads it while it lives (zero.Init in from_pretrained)
    meter = Meter(rank, spec)
    model = cls.from_pretrained(spec["folder"])
    meter.end("from_pretrained under zero.Init")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    meter.end("deepspeed.initialize")

    def step(loss):
        engine.backward(loss)
        engine.step()

    losses = _steps(engine, None, spec, rank, meter, backward=step)
    engine.save_16bit_model(spec["out"])  # pytorch_model.bin
    torch.distributed.barrier()
    meter.end("save_16bit_model (whole on rank 0)")
    del keep
    return meter.close(losses=losses)


RANK_FNS = {"ours-full": _ours_full, "ours-lora": _ours_lora, "today": _today, "fsdp2": _fsdp2,
            "deepspeed": _deepspeed}


# ------------------------------------------------------------------ the launcher
def _count(spec):
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(spec))
    return sum(p.numel() for p in model.parameters())


def write_pretrained(spec, folder):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(spec))
    model.save_pretrained(folder, max_shard_size=spec["shard_size"])
    del model


def warm(folder):
    """Reads every file of the folder, so that its pages are cached (charged to this process's group)."""
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 * MIB):
                pass


def verify(journey, spec, folder, out):
    """What the journey wrote loads as what it claims to be."""
    import transformers

    if not os.path.isdir(out):
        return "nothing written"
    if journey == "ours-lora":
        import peft

        base = transformers.LlamaForCausalLM.from_pretrained(folder)
        model = peft.PeftModel.from_pretrained(base, out)
        n = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        return f"PeftModel.from_pretrained loads it ({n} adapter parameters)"
    if journey == "deepspeed":
        names = sorted(os.listdir(out))
        state = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True, mmap=True)
        return f"{names}: {len(state)} tensors"
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    return "from_pretrained: no missing or unexpected keys" if not bad else f"from_pretrained: {bad}"


def reference_check(spec, folder, out, world):
    """ours-full against plain PyTorch from the same folder: the ranks' batches averaged, torch AdamW."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for r in range(world):
            ids = batch(spec, step, r)
            (model(input_ids=ids, labels=ids).loss / world).backward()
        opt.step()
        opt.zero_grad()
    ref = model.state_dict()
    del opt
    saved = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    worst = max((saved[k] - v).abs().max().item() for k, v in ref.items())
    moved = max((saved[k] - v).abs().max().item() for k, v in
                transformers.LlamaForCausalLM.from_pretrained(folder).state_dict().items())
    return worst, moved


def _oom_kills(group):
    """How many of the group's processes the kernel's OOM killer killed (memory.oom_control's oom_kill)."""
    try:
        with open(os.path.join(group, "memory.oom_control")) as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except OSError:
        return None


def run_journey(journey, spec, folder, work, world, cap_mib, timeout, check=True):
    token = secrets.token_hex(3)
    prefix = f"shardopt-wm-{token}-"
    logdir = tempfile.mkdtemp(prefix=f"{journey}-", dir=work)
    out = os.path.join(work, f"out-{journey}")
    shutil.rmtree(out, ignore_errors=True)
    rank_spec = dict(spec, folder=folder, out=out, cap_mib=cap_mib, group_prefix=prefix, logdir=logdir)
    warm(folder)
    record = {"journey": journey, "cap_mib": cap_mib, "world": world}
    start = time.perf_counter()
    try:
        results = run_ranks(RANK_FNS[journey], world, rank_spec, timeout=timeout, collective_timeout=300)
        record["outcome"] = "completed"
        record["ranks"] = results
    except RankFailure as e:
        text = str(e)
        killed = sorted(int(line.split()[1]) for line in text.splitlines()
                        if line.startswith("rank ") and "exit code -9" in line)
        record["outcome"] = f"killed (exit -9) on rank(s) {killed}" if killed else "failed"
        record["error"] = text.strip()[-3000:]
        record["ranks"] = []
        for r in range(world):
            try:
                with open(os.path.join(logdir, f"rank{r}.jsonl")) as f:
                    phases = [json.loads(line) for line in f]
            except OSError:
                phases = []
            record["ranks"].append({"phases": phases, "killed": r in killed})
    finally:
        record["oom_kills"] = [_oom_kills(os.path.join(CGROUP, f"{prefix}{r}")) for r in range(world)]
        remove_groups(prefix)
        left = [n for n in os.listdir(CGROUP) if n.startswith(prefix)]
        if left:
            print(f"cgroups left behind: {left}", file=sys.stderr)
    record["wall_s"] = time.perf_counter() - start
    if record["outcome"] == "completed" and check:
        try:
            record["verify"] = verify(journey, spec, folder, out)
            if journey == "ours-full":
                worst, moved = reference_check(spec, folder, out, world)
                record["verify"] += (f"; vs plain PyTorch (from_pretrained, the ranks' batches averaged, AdamW): "
                                     f"max |diff| {worst:.2e} (training moved weights by up to {moved:.2e})")
        except Exception as e:  # noqa: BLE001 - reported in the table
            record["verify"] = f"check failed: {type(e).__name__}: {e}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(logdir, ignore_errors=True)
    return record


# ------------------------------------------------------------------ the report
def arithmetic(journey, n, world, spec):
    full, shard = 4 * n / MIB, 16 * n / world / MIB
    if journey == "ours-lora":
        # LoRA on q/k/v/o of every layer (as many key/value heads as heads): A (r x hidden) and B (hidden x r)
        trainable = spec["layers"] * len(LORA_TARGETS) * 2 * LORA_R * spec["hidden"]
        return (f"4P/N {4 * n / world / MIB:.0f} (frozen base) + 16 B x {trainable / 1e6:.2f}M adapters = "
                f"{16 * trainable / MIB:.0f} ({16 * trainable / world / MIB:.1f} per rank) + gathered buckets")
    if journey == "today":
        return (f"load: 4P {full:.0f} whole (copied, or mmapped from the page cache); save: 16P/N {shard:.0f} + "
                f"staging + 4P {full:.0f} gathered = {full + shard:.0f}+")
    if journey == "fsdp2":
        return f"16P/N {shard:.0f} + a layer's gathers; rank 0: + 4P {full:.0f} (state dict) at load and at save"
    if journey == "deepspeed":
        return f"16P/N {shard:.0f} + gathers and buckets; rank 0: + 4P {full:.0f} at load (file) and save"
    return f"16P/N {shard:.0f} + staging + gathered buckets"


MODEL_KEYS = ("hidden", "inter", "layers", "heads", "vocab", "seq", "shard_size")


def _label(rec):
    options = rec["spec"].get("lora_options" if rec["journey"] == "ours-lora" else "ours_options") or {}
    if options and rec["journey"] in ("ours-full", "ours-lora", "today"):
        return f"{rec['journey']} ({', '.join(f'{k}={v}' for k, v in options.items())})"
    return rec["journey"]


def report(records):
    world = records[0]["world"] if records else 4
    lines = [f"# A pretrained model too big for one rank, in and out: memory — {datetime.date.today().isoformat()}",
             "", "Issue 53's memory point: `benchmarks/weights_memory.py` (its docstring says how memory is "
             "measured).", "",
             f"Machine: {_cpu()}, {os.cpu_count()} cores (shared with other work), {platform.machine()}, Linux "
             f"{platform.release()}; torch {torch.__version__}, {_versions()}; gloo, {world} ranks, one thread "
             "each.", "",
             "Charged peak: cgroup v1 memory.max_usage_in_bytes of the rank's own group (anonymous memory and the "
             "page cache it brings in), the most over all phases; anon: the most `rss` in memory.stat sampled "
             "every 10 ms. MiB. A killed rank's peak is the most of the phases it finished (marked `+`: it was "
             "killed in the phase after them, above that).", ""]
    specs = []
    for rec in records:
        spec = {k: rec["spec"][k] for k in MODEL_KEYS}
        if spec not in specs:
            specs.append(spec)
    for spec in specs:
        group = [r for r in records if {k: r["spec"][k] for k in MODEL_KEYS} == spec]
        n = _count(spec)
        lines += [f"## Model: vocab {spec['vocab']}, P = {n / 1e6:.1f}M", "",
                  f"LlamaForCausalLM from a config, hidden {spec['hidden']}, intermediate {spec['inter']}, "
                  f"{spec['layers']} layers, {spec['heads']} heads, vocab {spec['vocab']}, untied head: "
                  f"P = {n / 1e6:.1f}M parameters, fp32. Whole model 4P = {4 * n / MIB:.0f} MiB; "
                  f"16P/N = {16 * n / world / MIB:.0f} MiB; whole model plus its own shard 4P + 16P/N = "
                  f"{4 * n / MIB + 16 * n / world / MIB:.0f} MiB. Pretrained folder: save_pretrained, shards of "
                  f"{spec['shard_size']}. Batch 1 x {spec['seq']} tokens per rank, {STEPS} AdamW steps (lr {LR}).",
                  "", "| journey | cap (MiB) | outcome | charged peak per rank (MiB) | anon peak per rank | "
                  "arithmetic (MiB) | wall (s) | check of what was saved |", "|---|---|---|---|---|---|---|---|"]
        for rec in group:
            peaks = " / ".join(_peak(r, "peak") for r in rec["ranks"])
            anons = " / ".join(_peak(r, "anon") for r in rec["ranks"])
            lines.append(f"| {_label(rec)} | {rec['cap_mib']} | {rec['outcome']} | {peaks} | {anons} | "
                         f"{arithmetic(rec['journey'], n, world, spec)} | {rec['wall_s']:.0f} | "
                         f"{rec.get('verify', '-')} |")
        lines.append("")
        for rec in group:
            lines += _details(rec)
    lines += ["## Commands", "", "```"] + sorted({r["command"] for r in records}) + ["```", ""]
    return "\n".join(lines)


def _details(rec):
    lines = [f"### {_label(rec)}, vocab {rec['spec']['vocab']}, cap {rec['cap_mib']} MiB: {rec['outcome']}", ""]
    phases = [p["phase"] for p in max(rec["ranks"], key=lambda r: len(r["phases"]))["phases"]]
    lines += ["Charged peak of each phase (anon peak in brackets), the charge at its end and the process's "
              "file-backed resident pages then (RssFile: shared libraries, and weights files mmapped; not "
              "charged to the rank when the pages were cached before it joined), MiB, per rank:",
              "", "| phase | " + " | ".join(f"rank {r}" for r in range(len(rec["ranks"]))) + " |",
              "|---|" + "---|" * len(rec["ranks"])]
    for i, name in enumerate(phases):
        cells = []
        for r in rec["ranks"]:
            if i < len(r["phases"]):
                p = r["phases"][i]
                mapped = f", mapped {p['rss_file'] / MIB:.0f}" if "rss_file" in p else ""
                cells.append(f"{p['peak'] / MIB:.0f} ({p['anon'] / MIB:.0f}), end {p['after'] / MIB:.0f}{mapped}")
            elif r.get("killed") and i == len(r["phases"]):
                cells.append("killed here")
            else:
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    killed = [r for r in rec["ranks"] if r.get("killed")]
    if killed and all(len(r["phases"]) >= len(phases) for r in killed):
        lines.append("| (after the last phase above) | " + " | ".join(
            "killed here" if r.get("killed") else "-" for r in rec["ranks"]) + " |")
    if rec["ranks"] and "held" in rec["ranks"][0]:
        held = rec["ranks"][0]
        lines += ["", "shardopt's own count on rank 0 after the steps (memory_stats, MiB): " + ", ".join(
            f"{k} {v / MIB:.0f}" for k, v in held["held"].items()) +
            f"; peak of gathered buckets (store.peak_live) {held['peak_live'] / MIB:.0f}; bucket "
            f"{held['bucket_numel'] / 1e6:.2f}M elements."]
    if rec["ranks"] and "losses" in rec["ranks"][0]:
        lines += ["", "Losses (rank 0): " + ", ".join(f"{x:.4f}" for x in rec["ranks"][0]["losses"])]
    lines += ["", f"Kernel OOM kills per rank's group (memory.oom_control oom_kill): {rec.get('oom_kills')}"]
    if rec.get("error"):
        lines += ["", "```", rec["error"][-1500:], "```"]
    lines.append("")
    return lines


def _peak(rank, key):
    if not rank["phases"]:
        return "killed before any phase ended" if rank.get("killed") else "-"
    v = max(p[key] for p in rank["phases"]) / MIB
    return f"{v:.0f}+" if rank.get("killed") else f"{v:.0f}"


def _cpu():
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def _versions():
    import importlib.metadata as md

    return ", ".join(f"{p} {md.version(p)}" for p in ("transformers", "peft", "deepspeed", "accelerate",
                                                          "safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--journeys", default="ours-full,ours-lora,today,fsdp2,deepspeed")
    ap.add_argument("--cap-mib", type=int, default=1000, help="every journey's cap but ours-lora's")
    ap.add_argument("--lora-cap-mib", type=int, default=400)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--shard-size", default="100MB")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardopt-weights-memory"),
                    help="the pretrained folder (kept) and each journey's output (removed)")
    ap.add_argument("--record", default=None, help="JSON lines of every journey run (default: WORK/record.jsonl)")
    ap.add_argument("--report", default=None, help="write the markdown report here")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--lora-options", default="{}", help="JSON: ShardedOptimizer keyword arguments for ours-lora")
    ap.add_argument("--no-check", action="store_true", help="skip loading what each journey saved")
    ap.add_argument("--ours-options", default="{}",
                    help="JSON: ShardedOptimizer keyword arguments for ours-full and today, e.g. "
                         '\'{"num_staging_buffers": 1, "reduce_bucket_size": 4000000}\'')
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)
    spec = {k: getattr(args, k) for k in ("hidden", "inter", "layers", "heads", "vocab", "seq", "shard_size")}
    spec["ours_options"] = json.loads(args.ours_options)
    spec["lora_options"] = json.loads(args.lora_options)
    os.makedirs(args.work, exist_ok=True)
    record_path = args.record or os.path.join(args.work, "record.jsonl")
    tag = "-".join(str(spec[k]) for k in ("hidden", "inter", "layers", "heads", "vocab"))
    folder = os.path.join(args.work, f"pretrained-{tag}-{spec['shard_size']}")
    journeys = [j.strip() for j in args.journeys.split(",") if j.strip()]
    unknown = [j for j in journeys if j not in RANK_FNS]
    if unknown:
        ap.error(f"unknown journeys {unknown}; known: {', '.join(JOURNEYS)}")
    if journeys and not os.path.isdir(folder):
        write_pretrained(spec, folder)
    for journey in journeys:
        cap = args.lora_cap_mib if journey == "ours-lora" else args.cap_mib
        print(f"{journey}: {args.world_size} ranks, cap {cap} MiB ...", flush=True)
        rec = run_journey(journey, spec, folder, args.work, args.world_size, cap, args.timeout, not args.no_check)
        rec["spec"] = spec
        rec["command"] = " ".join(["python benchmarks/weights_memory.py"] + sys.argv[1:])
        with open(record_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"  {rec['outcome']}; charged peaks {[_peak(r, 'peak') for r in rec['ranks']]} MiB; "
              f"{rec.get('verify', '')}", flush=True)
    records = []
    if os.path.exists(record_path):
        with open(record_path) as f:
            records = [json.loads(line) for line in f]
    text = report(records)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
