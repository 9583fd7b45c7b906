"""An emulated cluster on one machine: N nodes as network namespaces joined by shaped links (tests, benchmarks).

    with EmulatedCluster(nodes=2, rate="1gbit") as c:     # needs root (ip netns, tc)
        procs = [c.torchrun(i, nproc=2, script="train.py", args=[...], nnodes=2, log=f"node{i}.log")
                 for i in range(2)]
        c.wait(procs, timeout=300)
        c.tx_bytes(0)                                    # bytes node 0 sent over its link so far
        c.kill_node(1)                                   # every process of node 1, SIGKILL
        c.set_link(1, up=False)                          # or pull node 1's cable

The topology, names and command lines are planned in cluster/plan.py (pure;
Note [Emulated cluster topology]). This module only runs them and cleans up.

Note [Cleaning up whatever happens]
-----------------------------------
A cluster deletes its namespaces (which deletes their links) on `close()`,
which runs from `__exit__`, from an atexit hook, and on SIGTERM / SIGHUP (we
turn them into SystemExit when nobody else handles them, so the `finally`
blocks and atexit run; Ctrl-C is already KeyboardInterrupt). Before deleting
a namespace it SIGKILLs the processes inside it (`ip netns pids`): they are
ours, started into a namespace that did not exist before this cluster.
`close()` touches only the namespaces of its own plan, by exact name, and
is idempotent. A SIGKILL of the process that owns the cluster is the one case
nothing can clean up; `ip netns list` then shows `<prefix>-<pid>-...` names
whose pid is gone, which `python -m shardopt.cluster --sweep` removes (sweep();
Note [Sweeping namespaces of dead runs] in cluster/plan.py).
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time

from shardopt.cluster import plan as cp
from shardopt.parallel.shm_barrier import pid_alive


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no `ip`/`tc`, namespaces refused)."""


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None if it can (checked without creating anything)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns, tc): run as root, as CI does"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    return None


_LIVE: set = set()
_LIVE_LOCK = threading.Lock()


def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        c.close()


def _exit_on(signum, _frame):
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _exit_on)


_HANDLERS = threading.Lock()
_handlers_installed = False


def _run(argv, *, check=True, timeout=30) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


class EmulatedCluster:
    """N nodes (network namespaces) on one bridge, each node's link shaped to `rate` ("1gbit"; None: unshaped)."""

    def __init__(self, nodes: int, rate=None, *, prefix: str = "shardopt"):
        self.plan = cp.plan_cluster(nodes, rate, run_id=cp.new_run_id(prefix, os.getpid(), secrets.token_hex(3)))
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._jobs = 0
        self._owner = os.getpid()  # a forked child inherits the object (and atexit) but must not clean up

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "EmulatedCluster":
        global _handlers_installed
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        with _HANDLERS:
            if not _handlers_installed:
                _install_handlers()
                _handlers_installed = True
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            for argv in cp.setup_commands(self.plan):
                if argv[:3] == ["ip", "netns", "add"]:
                    r = _run(argv, check=False)
                    if r.returncode != 0:
                        if not self._created:  # the first one: namespaces are refused here
                            raise ClusterUnavailable(f"cannot create a network namespace: {r.stderr.strip()}")
                        raise RuntimeError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")
                    self._created.append(argv[3])
                else:
                    _run(argv)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kills every process in the cluster's namespaces and deletes them; safe to call twice."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        for p in self._procs:
            _kill_group(p)
        for ns in reversed(self._created):
            self._kill_pids(ns)
        for ns in reversed(self._created):
            _run(["ip", "netns", "delete", ns], check=False)
        self._created.clear()
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    # ------------------------------------------------------------ processes
    def popen(self, node: int, argv, *, env=None, log=None, cwd=None) -> subprocess.Popen:
        """Starts argv inside node `node` in its own process group; output to the file `log` (or inherited)."""
        out = open(log, "ab") if log else None
        try:
            p = subprocess.Popen(["ip", "netns", "exec", self.plan.nodes[node].netns, *argv], env=env, cwd=cwd,
                                 stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        finally:
            if out:
                out.close()
        self._procs.append(p)
        return p

    def torchrun(self, node: int, nproc: int, script: str, args=(), *, nnodes, log=None, env=None,
                 max_restarts: int = 0, rdzv_conf: dict | None = None, threads: int = 1,
                 share_store: bool = False, cwd=None, rdzv_id: str | None = None,
                 port: int | None = None) -> subprocess.Popen:
        """One node's torchrun (Note [torchrun inside a namespace]).

        Every node of one job must get the same `rdzv_id` and `port` (a new job: new ones, see
        `new_job()`). share_store=False sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which restarts need
        (Note [Restarts and the launcher's shared store] in examples/elastic_train.py)."""
        env = cp.node_env(os.environ if env is None else env, threads=threads)
        if not share_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        argv = cp.torchrun_command(self.plan, node, nproc, script, args, nnodes=nnodes,
                                   max_restarts=max_restarts, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id,
                                   port=cp.RDZV_PORT if port is None else port)
        return self.popen(node, argv, env=env, log=log, cwd=cwd)

    def new_job(self) -> tuple[str, int]:
        """A fresh (rdzv_id, port) for the next job, so no job meets an earlier one's rendezvous."""
        self._jobs += 1
        return f"{self.plan.run_id}-job{self._jobs}", cp.RDZV_PORT + self._jobs

    @staticmethod
    def wait(procs, timeout: float) -> list[int]:
        """Exit codes of procs; past `timeout` seconds kills what still runs and raises TimeoutError."""
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for p in procs:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                _kill_group(p)
            raise TimeoutError(f"processes still running after {timeout}s; killed") from None
        return codes

    def kill_node(self, node: int) -> list[int]:
        """SIGKILLs every process of node `node` (a lost machine); returns their pids."""
        return self._kill_pids(self.plan.nodes[node].netns)

    def set_link(self, node: int, up: bool) -> None:
        _run(cp.link_command(self.plan, node, up))

    def tx_bytes(self, node: int) -> int:
        """Bytes node `node` has sent over its link (its veth's counter)."""
        r = _run(["ip", "netns", "exec", self.plan.nodes[node].netns,
                  "cat", f"/sys/class/net/{cp.NODE_IF}/statistics/tx_bytes"])
        return int(r.stdout.strip())

    def namespaces(self) -> list[str]:
        return list(self._created)

    def _kill_pids(self, ns: str) -> list[int]:
        r = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(x) for x in r.stdout.split()] if r.returncode == 0 else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def existing_namespaces() -> set[str]:
    """Names of every network namespace on the machine (for leak checks)."""
    r = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def sweep(prefix: str = "shardopt") -> list[str]:
    """Deletes the namespaces left by clusters whose owning process is dead; returns their names.

    Note [Sweeping namespaces of dead runs] in cluster/plan.py: only names this module makes
    (`<prefix>-<pid>-<token>-<role>`) with a dead <pid>; processes still inside one (a dead run's
    orphaned ranks) are killed first, as close() does. Deleting a namespace deletes its links.
    """
    reason = unavailable_reason()
    if reason:
        raise ClusterUnavailable(reason)
    removed = []
    for ns in cp.stale_namespaces(existing_namespaces(), pid_alive, prefix):
        r = _run(["ip", "netns", "pids", ns], check=False)
        for pid in (int(x) for x in r.stdout.split()) if r.returncode == 0 else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if _run(["ip", "netns", "delete", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


def hold(nodes: int, rate) -> None:
    """`python -m shardopt.cluster --hold`: builds a cluster, prints its namespaces, waits for a signal."""
    # A shell starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt:
    # Ctrl-C / kill -INT must stop a held cluster however it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with EmulatedCluster(nodes, rate) as c:
            print(" ".join(c.namespaces()), flush=True)
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        pass  # the `with` has deleted the namespaces

