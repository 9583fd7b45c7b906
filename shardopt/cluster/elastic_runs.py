"""Runs examples/elastic_train.py on an emulated cluster, losing a node on the way (tests, benchmarks).

`run_training` starts a torchrun per node, watches the progress file rank 0 writes after every step, and at
`lose_at_step` loses node `lose_node`: its processes SIGKILLed (`how="kill"`) or its link taken down
(`how="link"`, a pulled cable). It returns what happened for the caller to judge.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "elastic_train.py")
_STOPPED = re.compile(r"\[rank (\d+) of (\d+), attempt (\d+)\] stopped at step (\d+) at t=([0-9.]+): (.*)")


@dataclasses.dataclass
class TrainingRun:
    """Per node: torchrun's exit code and output, and when it exited (None: the lost node, or past the
    deadline); rank 0's (attempt, world_size, step, time) per step; when the node was lost; every reported
    failure as (node, rank, world_size, attempt, step, time, message)."""

    codes: list
    logs: list
    progress: list
    lost_at: float | None
    lost_after_step: int | None
    stops: list
    ended: list
    seconds: float

    def log_text(self) -> str:
        return "".join(f"\n===== node {i} (exit {c}) =====\n{t}" for i, (c, t) in enumerate(zip(self.codes, self.logs)))


def _read_progress(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [line.split() for line in f if line.count(" ") == 3 and line.endswith("\n")]
    return [(int(a), int(w), int(s), float(t)) for a, w, s, t in rows]


def run_training(cluster, workdir: str, *, nodes: int = 2, nproc: int = 2, steps: int = 30, save_every: int = 5,
                 nnodes=None, max_restarts: int = 0, pg_timeout: float = 20, step_time: float = 0.05,
                 lose_node: int | None = None, lose_at_step: int = 0, how: str = "kill",
                 share_store: bool = False, rdzv_conf: dict | None = None, timeout: float = 240,
                 extra_args=()) -> TrainingRun:
    """Trains examples/elastic_train.py on nodes 0..nodes-1 of `cluster` (checkpoints in workdir/ckpt, rank
    0's final weights in workdir/final.pt); kills everything still running after `timeout` seconds."""
    if how not in ("kill", "link"):
        raise ValueError(f"how must be 'kill' or 'link', got {how!r}")
    os.makedirs(workdir, exist_ok=True)
    progress = os.path.join(workdir, "progress")
    args = ["--ckpt", os.path.join(workdir, "ckpt"), "--steps", steps, "--save-every", save_every,
            "--timeout", pg_timeout, "--step-time", step_time, "--progress", progress,
            "--out", os.path.join(workdir, "final.pt"), *extra_args]
    rdzv_id, port = cluster.new_job()
    logs = [os.path.join(workdir, f"node{i}.log") for i in range(nodes)]
    start = time.time()
    procs = [cluster.torchrun(i, nproc, EXAMPLE, args, log=logs[i], nnodes=nnodes or nodes, max_restarts=max_restarts,
                              rdzv_conf=rdzv_conf, share_store=share_store, rdzv_id=rdzv_id, port=port)
             for i in range(nodes)]
    lost_at = lost_after = None
    deadline = time.monotonic() + timeout
    try:
        if lose_node is not None:
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                done = _read_progress(progress)
                if done and done[-1][2] >= lose_at_step:
                    lost_after = done[-1][2]
                    break
                time.sleep(0.02)
            if lost_after is not None:
                lost_at = time.time()
                if how == "kill":
                    cluster.kill_node(lose_node)
                else:
                    cluster.set_link(lose_node, up=False)
        ended = [None] * nodes
        while time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and i != lose_node and p.poll() is not None:
                    ended[i] = time.time()
            if all(e is not None for i, e in enumerate(ended) if i != lose_node):
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # the lost node's (cut off, or already dead) and anything past the deadline
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
        if how == "link" and lost_at is not None:
            cluster.set_link(lose_node, up=True)
    texts = []
    for path in logs:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    stops = [(node, int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]), m[6])
             for node, t in enumerate(texts) for m in _STOPPED.finditer(t)]
    codes = [None if i == lose_node and lost_at is not None else p.returncode for i, p in enumerate(procs)]
    return TrainingRun(codes=codes, logs=texts, progress=_read_progress(progress), lost_at=lost_at,
                       lost_after_step=lost_after, stops=stops, ended=ended, seconds=time.time() - start)
