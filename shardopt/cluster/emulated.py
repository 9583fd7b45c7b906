"""An emulated cluster on one machine: N nodes as network namespaces joined by shaped links (tests, benchmarks).

    with EmulatedCluster(nodes=2, rate="1gbit") as c:     # needs root (ip netns, tc)
        procs = [c.torchrun(i, nproc=2, script="train.py", args=[...], nnodes=2, log=f"node{i}.log")
                 for i in range(2)]
        c.wait(procs, timeout=300)
        c.tx_bytes(0)                                    # bytes node 0 sent over its link so far
        c.kill_node(1)                                   # every process of node 1, SIGKILL
        c.set_link(1, up=False)                          # or pull node 1's cable

This module runs cluster/plan.py's plan (Note [Emulated cluster topology]; each node with its own hostname
and /dev/shm: Note [A node shares nothing but its link]) and cleans up.

Note [Cleaning up whatever happens]
-----------------------------------
`close()` (idempotent) kills the processes in the plan's namespaces and deletes them, by exact name, from
`__exit__`, an atexit hook, and SIGTERM / SIGHUP (made SystemExit when unhandled, so `finally` blocks run).
After a SIGKILL of the owner, `python -m shardopt.cluster --sweep` removes what is left (Note [Sweeping
namespaces of dead runs] in cluster/plan.py).
"""
from __future__ import annotations

import atexit
import os
import secrets
import select
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
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                          ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install {package})"
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
        self._holders: list[subprocess.Popen] = []  # per node (Note [A node shares nothing but its link])
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._jobs = 0
        self._owner = os.getpid()  # a forked child inherits the object (and atexit) but must not clean up

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
            for i in range(len(self.plan.nodes)):
                self._start_holder(i)
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
        for p in self._holders:
            _kill_group(p)  # killed with their namespace's processes above; reaped here
            for pipe in (p.stdout, p.stderr):
                pipe.close()
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

    def _start_holder(self, node: int) -> None:
        """Node `node`'s holder (Note [A node shares nothing but its link]), once it says its namespaces are set."""
        p = subprocess.Popen(cp.node_holder_command(self.plan, node), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        self._holders.append(p)
        ready, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line != cp.READY:
            _kill_group(p)
            err = p.stderr.read().decode(errors="replace").strip()
            raise ClusterUnavailable(f"node {node} cannot have a hostname and /dev/shm of its own (UTS and mount "
                                     f"namespaces): {err or line or 'no answer in 30 s'}")

    def holder_pid(self, node: int) -> int:
        """The process whose namespaces node `node`'s processes join."""
        return self._holders[node].pid

    def popen(self, node: int, argv, *, env=None, log=None, cwd=None) -> subprocess.Popen:
        """Starts argv inside node `node` (its network, hostname and /dev/shm) in its own process group; output
        to the file `log` (or inherited)."""
        out = open(log, "ab") if log else None
        argv = cp.enter_command(self.holder_pid(node), argv, os.path.abspath(cwd or os.getcwd()))
        try:
            p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                 start_new_session=True)
        finally:
            if out:
                out.close()
        self._procs.append(p)
        return p

    def torchrun(self, node: int, nproc: int, script: str, args=(), *, nnodes, log=None, env=None,
                 max_restarts: int = 0, rdzv_conf: dict | None = None, threads: int = 1,
                 share_store: bool = False, cwd=None, rdzv_id: str | None = None,
                 port: int | None = None) -> subprocess.Popen:
        """One node's torchrun (Note [torchrun inside a namespace]); every node of a job gets the same
        `rdzv_id` and `port` (new_job()). share_store=False: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
        restarts need (Note [Restarts and the launcher's shared store] in examples/elastic_train.py)."""
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
        """SIGKILLs every process of node `node` but its holder (a lost machine's processes: its /dev/shm
        stays); returns their pids."""
        return self._kill_pids(self.plan.nodes[node].netns, spare=self.holder_pid(node))

    def set_link(self, node: int, up: bool) -> None:
        _run(cp.link_command(self.plan, node, up))

    def tx_bytes(self, node: int) -> int:
        """Bytes node `node` has sent over its link (its veth's counter)."""
        r = _run(["ip", "netns", "exec", self.plan.nodes[node].netns,
                  "cat", f"/sys/class/net/{cp.NODE_IF}/statistics/tx_bytes"])
        return int(r.stdout.strip())

    def namespaces(self) -> list[str]:
        return list(self._created)

    def _kill_pids(self, ns: str, spare: int | None = None) -> list[int]:
        r = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(x) for x in r.stdout.split() if int(x) != spare] if r.returncode == 0 else []
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
    """Deletes the namespaces left by clusters whose owner is dead (Note [Sweeping namespaces of dead runs]
    in cluster/plan.py), killing their orphaned processes first; returns their names."""
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
    # A shell starts background jobs with SIGINT ignored: kill -INT must still stop a held cluster.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with EmulatedCluster(nodes, rate) as c:
            print(" ".join(c.namespaces()), flush=True)
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        pass  # the `with` has deleted the namespaces

