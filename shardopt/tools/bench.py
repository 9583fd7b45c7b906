"""`shardopt bench`: runs scripts of the source tree's benchmarks/ and writes one dated report with charts.

Each scenario is `python SCRIPT [--quick] --out PART.md` in a fresh process; the report concatenates the
parts, charts each table's headline column (`CHARTED`) and copies in a part's own PNG.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile

# scenario -> (script, extra arguments, column charted from its tables, takes --out; else its stdout is
# the report)
SCENARIOS = {
    "step": ("bench_step.py", [], "x DDP", True),
    "peers": ("bench_step.py", ["--peers"], None, True),   # draws its own chart
    "memory": ("bench_memory.py", [], "counted B/param", True),
    "collectives": ("bench_collectives.py", [], None, True),
    "cpu-adam": ("bench_cpu_adam.py", [], None, False),
}
DEFAULT = ("step", "memory", "peers")


def benchmarks_dir(explicit: str | None = None) -> str:
    """The benchmarks/ folder of the source checkout shardopt was imported from."""
    path = explicit or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if not os.path.isfile(os.path.join(path, "bench_step.py")):
        raise FileNotFoundError(f"no benchmark scripts in '{path}': `shardopt bench` runs the scripts of a source "
                                "checkout (git clone + pip install -e .); pass --benchmarks-dir if they are "
                                "elsewhere")
    return path


def parse_tables(markdown: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(heading above it, header cells, rows) of every markdown table."""
    tables, heading, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1].strip()):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append((heading, header, rows))
            continue
        i += 1
    return tables


def _number(cell: str):
    m = re.match(r"^[-+]?\d+(\.\d+)?", cell.replace(",", ""))
    return float(m.group(0)) if m else None


def _label(header: list[str], row: list[str]) -> str:
    # bench_memory's single table starts with the world size; the others name the variant first.
    return f"{row[0]} ranks, {row[1]}" if header[0] == "ws" else row[0]


def chart_tables(markdown: str, column: str, path: str, title: str) -> bool:
    """A bar chart of `column`, one series per table that has it; False when none has it."""
    from shardopt.tools.plotting import bar_panels

    found = [(h, hdr, rows) for h, hdr, rows in parse_tables(markdown) if column in hdr]
    if not found:
        return False
    labels = []
    for _, hdr, rows in found:
        labels += [_label(hdr, r) for r in rows if _label(hdr, r) not in labels]
    series = {}
    for heading, hdr, rows in found:
        values = {_label(hdr, r): _number(r[hdr.index(column)]) for r in rows}
        series[heading or column] = [values.get(label) for label in labels]
    bar_panels(path, title, labels, [(column, series)], reference={0: 1.0} if column == "x DDP" else None)
    return True


def run(scenarios, quick: bool, out_dir: str, bench_dir: str | None = None, python: str | None = None,
        log=print) -> str:
    """Runs the scenarios and writes OUT_DIR/DATE-bench.md (+ PNGs). Returns the report's path."""
    from shardopt.tools.plotting import require_matplotlib

    require_matplotlib()
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    bench_dir = benchmarks_dir(bench_dir)
    os.makedirs(out_dir, exist_ok=True)
    date = datetime.date.today().isoformat()
    report = os.path.join(out_dir, f"{date}-bench.md")
    parts = [f"# shardopt bench — {date}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
             f"Scenarios: {', '.join(scenarios)}{' (--quick)' if quick else ''}. Each section is the named "
             "script's own report.", ""]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(bench_dir), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as tmp:
        for name in scenarios:
            script, extra, column, takes_out = SCENARIOS[name]
            part = os.path.join(tmp, f"{name}.md")
            cmd = [python or sys.executable, os.path.join(bench_dir, script), *extra]
            cmd += ["--out", part] if takes_out else []
            if quick:
                cmd.append("--quick")
            log(f"[bench] {name}: {' '.join(cmd)}")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode == 0 and not takes_out:
                with open(part, "w") as f:
                    f.write(proc.stdout)
            parts.append(f"## {name} (`benchmarks/{script}{' ' + ' '.join(extra) if extra else ''}`)\n")
            if proc.returncode != 0 or not os.path.exists(part):
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
                parts.append(f"**failed** (exit code {proc.returncode}):\n\n```\n{tail}\n```\n")
                log(f"[bench] {name} failed (exit {proc.returncode})")
                continue
            with open(part) as f:
                text = f.read()
            # Demote the part's headings under this section's.
            text = re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", text, flags=re.M)
            own_png = os.path.splitext(part)[0] + ".png"
            if os.path.exists(own_png):
                dest = f"{date}-bench-{name}.png"
                shutil.copy(own_png, os.path.join(out_dir, dest))
                text = text.replace(os.path.basename(own_png), dest)
            elif column:
                dest = f"{date}-bench-{name}.png"
                if chart_tables(text, column, os.path.join(out_dir, dest), f"{name}: {column}"):
                    text += f"\n![{name}]({dest})\n"
            parts.append(text)
    with open(report, "w") as f:
        f.write("\n".join(parts) + "\n")
    log(f"[bench] wrote {report}")
    return report
