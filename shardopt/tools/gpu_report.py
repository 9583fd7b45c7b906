"""gpu_check's report: the markdown file, and the list of failures that decides the exit code.

Pure functions of the results (KernelResult, ConfigResult per rank per world size, or a string where a
world size crashed), tested on hand-made ones.
"""
from __future__ import annotations

import statistics

MAX_LINES = 12  # failure lines listed per configuration and rank


def failures(kernels, runs: dict) -> list[str]:
    """Every failed check, one line each; empty when everything passed."""
    out = [f"kernel {k.op}: {k.detail}" for k in kernels if k.status == "FAIL"]
    for ws, ranks in runs.items():
        if isinstance(ranks, str):
            summary = " / ".join(line.strip() for line in ranks.splitlines() if line.strip())
            out.append(f"world size {ws}: the ranks did not finish: {summary[:300]}")
            continue
        for rank, results in enumerate(ranks):
            for r in results:
                where = f"world size {ws}, {r.config.key}, rank {rank}"
                if r.error is not None:
                    out.append(f"{where}: raised {r.error.strip().splitlines()[-1]}")
                elif r.parity is not None:
                    out += [f"{where}: {line}" for line in r.parity.failures[:MAX_LINES]]
    return out


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _err(x: float) -> str:
    return f"{x:.1e}"


def _by_config(runs: dict):
    """(world size, config key) -> [ConfigResult of rank r], over the world sizes that finished."""
    out = {}
    for ws, ranks in runs.items():
        if isinstance(ranks, str):
            continue
        for rank_results in ranks:
            for r in rank_results:
                out.setdefault((ws, r.config.key), []).append(r)
    return out


def _status(results) -> str:
    if results[0].skipped:
        return results[0].skipped
    if any(r.error for r in results):
        return "**ERROR**"
    if any(r.parity.failures for r in results):
        return "**FAIL**"
    return "pass"


def write(header: list[tuple[str, str]], backend: str, kernels, runs: dict) -> str:
    """The report's markdown."""
    failed = failures(kernels, runs)
    by_config = _by_config(runs)
    lines = ["# shardopt GPU check", ""]
    lines.append(f"**FAIL**: {len(failed)} failed check(s), listed under Failures." if failed
                 else "**PASS**: every kernel and parity check below passed.")
    lines += ["", "Written by `python -m shardopt.tools.gpu_check` (README, \"CUDA\"). A kernel or parity failure, or "
              "a rank that crashed, fails the run (exit 1); host syncs, step time and memory are reported, not judged.",
              ""]
    lines += _table(["", ""], [[k, v] for k, v in header])

    lines += ["", "## Kernels against their references", "",
              "Each op of `torch.ops.shardopt` with a kernel for the device, against its pure-PyTorch reference "
              "(`shardopt/reference.py`) on CPU, bit for bit (`shardopt/tools/gpu_kernels.py`).", ""]
    lines += _table(["op", "result", "cases", "detail"],
                    [[f"`{k.op}`", k.status if k.status != "FAIL" else "**FAIL**", k.cases, k.detail] for k in kernels])

    lines += ["", "## Parity: ShardedOptimizer + ShardedDDP against the reference", "",
              f"{backend} ranks, one per GPU. fp32: DDP + torch.optim; bf16/fp16: the master-weight loop of "
              "tests/test_mixed_precision.py. Errors are the largest relative difference over every loss and clipped "
              "norm, and over the final weights; bars from the test suite (Note [Parity bars] in "
              "`shardopt/tools/gpu_training.py`).", ""]
    for ws, ranks in runs.items():
        lines += [f"### World size {ws}", ""]
        if isinstance(ranks, str):
            lines += ["**The ranks did not finish:**", "", "```", ranks.strip()[-4000:], "```", ""]
            continue
        rows = []
        for key in [r.config.key for r in ranks[0]]:
            results = by_config[(ws, key)]
            cfg = results[0].config
            ran = [r for r in results if r.parity is not None]
            notes = sorted({n for r in ran for n in r.parity.notes})
            rows.append([f"`{key}` {cfg.title}", _status(results), f"{cfg.bar:.0e}",
                         _err(max(r.parity.loss_err for r in ran)) if ran else "",
                         _err(max(r.parity.param_err for r in ran)) if ran else "", "; ".join(notes)])
        lines += _table(["configuration", "result", "bar", "loss/norm error", "weight error", "notes"], rows) + [""]

    perf = [(ws, key, rs) for (ws, key), rs in by_config.items() if rs[0].perf is not None]
    lines += ["## Host syncs per step", "",
              "The demo GPT, a few steps after warm-up, counted with `torch.cuda.set_sync_debug_mode(\"warn\")` "
              "(what torch reports as synchronizing: `.item()`, blocking copies, stream syncs; rank 0).", ""]
    lines += _table(["world size", "configuration", "DDP + torch.optim", "shardopt"],
                    [[ws, key, f"{rs[0].perf.ddp_syncs:g}", f"{rs[0].perf.ours_syncs:g}"] for ws, key, rs in perf])
    lines += ["", "## Step time", "",
              "The demo GPT, one DDP step and one shardopt step alternated (which goes first alternates too), "
              "each between two `synchronize()` calls; ratio = shardopt / DDP per pair (rank 0).", ""]
    rows = []
    for ws, key, rs in perf:
        p = rs[0].perf
        q = statistics.quantiles(p.ratios, n=4) if len(p.ratios) > 1 else [p.ratios[0]] * 3
        rows.append([ws, key, f"{p.ddp_ms:.2f}", f"{p.ours_ms:.2f}", f"{statistics.median(p.ratios):.3f}",
                     f"{q[0]:.3f}-{q[2]:.3f}", f"{min(p.ratios):.3f}-{max(p.ratios):.3f}", len(p.ratios)])
    lines += _table(["world size", "configuration", "DDP ms", "shardopt ms", "ratio (median)", "ratio p25-p75",
                     "ratio min-max", "pairs"], rows)
    lines += ["", "## Peak memory per rank", "",
              "MiB. Peak = `max_memory_allocated` over a few steps of the demo GPT, each run alone on the device. "
              "Model states = `opt.memory_stats()[\"on_device\"]`; estimate = `shardopt.estimate` for the same "
              "configuration (model states only: activations and workspace come on top).", ""]
    rows = []
    for ws, key, rs in perf:
        for rank, r in enumerate(rs):
            p = r.perf
            if p is None:  # this rank raised (listed under Failures)
                continue
            rows.append([ws, key, rank, _mib(p.ours_peak), _mib(p.ours_model_states), _mib(p.ours_estimate),
                         _mib(None if p.ours_estimate is None else p.ours_peak - p.ours_estimate),
                         _mib(p.ddp_peak), _mib(p.ddp_estimate)])
    lines += _table(["world size", "configuration", "rank", "shardopt peak", "model states", "estimate",
                     "peak - estimate", "DDP peak", "DDP estimate"], rows)
    if perf:
        lines += ["", f"Model: {perf[0][2][0].perf.num_params:,} parameters."]

    lines += ["", "## Failures", ""]
    lines += [f"- {line}" for line in failed] or ["None."]
    errors = [(ws, key, rank, r.error) for (ws, key), rs in by_config.items() for rank, r in enumerate(rs) if r.error]
    for ws, key, rank, tb in errors:
        lines += ["", f"Traceback, world size {ws}, `{key}`, rank {rank}:", "", "```", tb.strip()[-4000:], "```"]
    return "\n".join(lines) + "\n"
