"""Multi-node for real: ranks started by torchrun on an emulated cluster (shardopt/cluster/emulated.py).

One cluster of 3 nodes (network namespaces, 1 Gbit/s links) serves the whole
module. On it: ZeRO-1/2 at 2 nodes x 2 ranks and 3 nodes x 1 rank against a
single-process reference (tests/cluster_parity_worker.py); a node lost by
SIGKILL and by a cut link, where every surviving rank must fail saying so
within the process group's timeout; and elastic resume under torchrun
--nnodes 1:2 --max-restarts 1 with examples/elastic_train.py, which must end
with the weights of an uninterrupted single-process run.

Needs root (ip netns, tc); elsewhere the cluster tests skip, printing why.
The plan tests (pure) run everywhere.
"""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from shardopt.cluster import plan as cp
from shardopt.cluster.emulated import EmulatedCluster, existing_namespaces, unavailable_reason

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")

# Short rendezvous timings: a restart takes seconds instead of ~45 s (torchrun's defaults wait
# 15 s for a lost node's heartbeats to expire, then 30 s for late joiners).
RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 3, "join_timeout": 60}
PG_TIMEOUT = 10            # process group timeout of the node-loss runs, seconds
REPORT_MARGIN = 3          # a surviving rank reports the loss within PG_TIMEOUT + this
EXIT_MARGIN = 15           # ...and its node's torchrun has exited within PG_TIMEOUT + this
PEER_LOST = ("peer may have died", "peer rank has probably exited", "Connection closed by peer",
             "Connection reset by peer",
             # the inter-node phase of node-aware collectives (csrc/comm/replica_hop.cpp), naming the replica
             "The node may be down or its link cut")


# ------------------------------------------------------------------ the plan (pure)
def test_plan_names_addresses_and_commands():
    plan = cp.plan_cluster(3, "1gbit", run_id="shardopt-42-abc123")
    assert plan.namespaces == ("shardopt-42-abc123-sw", "shardopt-42-abc123-n0", "shardopt-42-abc123-n1",
                               "shardopt-42-abc123-n2")
    assert [n.addr for n in plan.nodes] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    flat = [" ".join(c) for c in cp.setup_commands(plan)]
    # Every command names one of the plan's namespaces: nothing happens in the machine's own.
    assert all(any(ns in c for ns in plan.namespaces) for c in flat), flat
    text = "\n".join(flat)
    for forbidden in ("default", "route", "nat", "iptables", "eth0"):
        assert forbidden not in text, forbidden
    assert sum("tbf rate 1000000000bit" in c for c in flat) == 2 * 3  # both directions of every link
    assert cp.teardown_commands(plan) == [["ip", "netns", "delete", ns] for ns in reversed(plan.namespaces)]
    assert cp.shaping_commands(cp.plan_cluster(2, None, run_id="x"), cp.plan_cluster(2, None, run_id="x").nodes[0]) == []
    for bad in ("a b", "", "x;rm"):
        with pytest.raises(ValueError):
            cp.plan_cluster(2, run_id=bad)


def test_sweep_picks_only_our_names_with_a_dead_owner():
    """Note [Sweeping namespaces of dead runs]: the exact shape of our names, and the owner's pid."""
    alive = {100, 300}.__contains__
    names = ["shardopt-200-abc123-sw", "shardopt-200-abc123-n0", "shardopt-200-abc123-n11",  # dead owner
             "shardopt-100-abc123-n0", "shardopt-100-abc123-sw",                            # live owner
             "shardopt-200-ABC123-n0", "shardopt-200-abc12-n0", "shardopt-200-abc123-x0",   # not quite ours
             "shardopt-200-abc123-n0-extra", "shardopt-abc123-n0", "other-200-abc123-n0", "x-shardopt-200-abc123-sw",
             "docker-200", "cni-4f1e2d3c-aaaa"]
    assert cp.stale_namespaces(names, alive) == ["shardopt-200-abc123-n0", "shardopt-200-abc123-n11",
                                                 "shardopt-200-abc123-sw"]
    assert cp.stale_namespaces(names, alive, prefix="other") == ["other-200-abc123-n0"]
    assert cp.namespace_owner("my-run-7-0a0b0c-n3", prefix="my-run") == 7
    plan = cp.plan_cluster(2, run_id=cp.new_run_id("shardopt", 4321, "00ff00"))
    assert {cp.namespace_owner(ns) for ns in plan.namespaces} == {4321}
    stale = cp.stale_namespaces(plan.namespaces, lambda pid: False)
    assert sorted(stale) == sorted(plan.namespaces) and stale[-1] == plan.switch  # the switch last, as in teardown
    assert cp.stale_namespaces(plan.namespaces, lambda pid: True) == []


@pytest.mark.parametrize("rate,bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8),
                                       ("500kbit", 5 * 10**5), (10**6, 10**6), (None, None), ("640", 640)])
def test_parse_rate(rate, bits):
    assert cp.parse_rate(rate) == bits


@pytest.mark.parametrize("bad", ["1gbps", "fast", "-1mbit", "0mbit"])
def test_parse_rate_refuses(bad):
    with pytest.raises(ValueError, match="rate"):
        cp.parse_rate(bad)


def test_torchrun_command_per_node():
    plan = cp.plan_cluster(2, run_id="r")
    host = cp.torchrun_command(plan, 0, 2, "train.py", ["--x", 1], nnodes="1:2", max_restarts=1, python="py")
    assert cp.torchrun_command(plan, 0, 2, "t.py", nnodes=2)[4] == "2"
    other = cp.torchrun_command(plan, 1, 2, "train.py", ["--x", 1], nnodes="1:2", max_restarts=1, python="py")
    assert host[:3] == ["py", "-m", "torch.distributed.run"] and host[-3:] == ["train.py", "--x", "1"]
    opt = lambda argv, k: argv[argv.index(k) + 1]  # noqa: E731
    assert opt(host, "--rdzv-conf") == "is_host=1" and opt(other, "--rdzv-conf") == "is_host=0"
    assert opt(host, "--local-addr") == "198.18.0.1" and opt(other, "--local-addr") == "198.18.0.2"
    assert opt(host, "--rdzv-endpoint") == opt(other, "--rdzv-endpoint") == "198.18.0.1:29400"
    assert opt(other, "--nnodes") == "1:2" and opt(other, "--max-restarts") == "1"


# ------------------------------------------------------------------ the cluster
@pytest.fixture(scope="module")
def cluster():
    # Only tests marked needs_cluster use this, so here the machine can build a cluster: a failure
    # to start one is a failure, not a skip.
    c = EmulatedCluster(3, "1gbit").start()
    try:
        yield c
    finally:
        c.close()
    assert not set(c.plan.namespaces) & existing_namespaces()


def _ip(*args) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=True).stdout


@needs_cluster
def test_cluster_is_isolated_and_shaped(cluster):
    for n in cluster.plan.nodes:
        assert _ip("-n", n.netns, "route").split() == ["198.18.0.0/24", "dev", "so0", "proto", "kernel", "scope",
                                                         "link", "src", n.addr]  # no default route
        links = [line.split(": ")[1].split("@")[0] for line in _ip("-n", n.netns, "-o", "link").splitlines()]
        assert sorted(links) == ["lo", "so0"], links
        qdisc = subprocess.run(["ip", "netns", "exec", n.netns, "tc", "qdisc", "show", "dev", "so0"],
                               capture_output=True, text=True, timeout=30).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
    assert "inet " not in _ip("-n", cluster.plan.switch, "addr")  # the switch has no address at all


@needs_cluster
@pytest.mark.parametrize("nodes,nproc", [(2, 2), (3, 1)])
def test_zero_matches_single_process_reference(cluster, tmp_path, nodes, nproc):
    """ZeRO-1/2/3 (node-aware collectives, on by default across nodes), fp32 and bf16, clipping and no_sync
    (the cases of cluster_parity_worker.py)."""
    import json

    rdzv_id, port = cluster.new_job()
    logs = [tmp_path / f"node{i}.log" for i in range(nodes)]
    procs = [cluster.torchrun(i, nproc, os.path.join(HERE, "cluster_parity_worker.py"),
                              ["--out", tmp_path, "--timeout", 60], nnodes=nodes, log=logs[i], rdzv_id=rdzv_id,
                              port=port)
             for i in range(nodes)]
    try:
        codes = cluster.wait(procs, timeout=300)
    except TimeoutError as e:
        codes = [str(e)]
    out = "".join(f"\n=== node {i} ===\n" + p.read_text(errors="replace")[-4000:] for i, p in enumerate(logs))
    assert codes == [0] * nodes, out
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(nodes * nproc)]
    assert {r["world_size"] for r in results} == {nodes * nproc}
    assert sorted(r["node"] for r in results) == sorted(list(range(nodes)) * nproc)
    for r in results:
        assert not r["failures"], f"rank {r['rank']}: " + "\n".join(r["failures"][:8])


def _load_latest(rank, world_size, ckpt):
    import shardopt
    from elastic_train import build_model, make_optimizer_kwargs

    model = build_model()
    opt = shardopt.ShardedOptimizer(model.parameters(), **make_optimizer_kwargs(), stage=2)
    model = shardopt.ShardedDDP(model, opt)
    return shardopt.load_checkpoint(ckpt, model, opt)["step"]


# A peer named by shardopt's own collectives (Note [Naming a peer] in csrc/comm/peer_names.h): its global rank,
# then its host, "hostname/address" with the address of its node's GLOO_SOCKET_IFNAME interface.
PEER_NAMED = re.compile(r"(?:from|to) global rank (\d+) \(host [^/,\s]+/([0-9.]+), rank \d+ of the [a-z -]+ group\)")


def _check_survivors_report_loss(run, nproc, timeout, addrs=None):
    text = run.log_text()
    assert run.lost_at is not None, "the node was never lost (training ended or failed first)" + text
    mine = [s for s in run.stops if s[0] == 0]
    assert sorted(s[1] for s in mine) == sorted(set(s[1] for s in mine)) and len(mine) == nproc, text
    for node, rank, world, attempt, step, t, msg in mine:
        assert t - run.lost_at <= timeout + REPORT_MARGIN, f"rank {rank} reported after {t - run.lost_at:.1f}s"
        assert any(p in msg for p in PEER_LOST), msg
        if addrs is not None and ("failed receiving from" in msg or "failed sending to" in msg):
            named = PEER_NAMED.findall(msg)
            assert named and all(int(g) != rank and a in addrs for g, a in named), f"{sorted(addrs)}: {msg}"
        gloo_addr = re.search(r"\[(198\.18\.0\.\d+)\]:\d+", msg)
        if addrs is not None and "all-reduce failed" in msg and gloo_addr:  # gloo's own: the ranks at its address
            assert f"gloo's peer address {gloo_addr.group(1)} is that of global rank(s) [" in msg, msg
    assert run.codes[0] not in (0, None), text
    assert run.ended[0] - run.lost_at <= timeout + EXIT_MARGIN, text
    return max(s[5] for s in mine) - run.lost_at


@needs_cluster
@pytest.mark.parametrize("how", ["kill", "link"])
def test_losing_a_node_fails_every_survivor_in_time(cluster, tmp_path, how):
    """Node 1 of 2 x 2 ranks is SIGKILLed (a crash: sockets close) or cut off (no packet, no FIN:
    only the timeout can tell). The ranks of node 0 raise, naming the lost peer, within the process
    group's timeout, torchrun on node 0 exits with an error, and the last checkpoint loads."""
    from dist_harness import run_ranks

    run = run_training_on(cluster, tmp_path, steps=60, max_restarts=0, pg_timeout=PG_TIMEOUT, how=how)
    took = _check_survivors_report_loss(run, 2, PG_TIMEOUT, addrs={n.addr for n in cluster.plan.nodes})
    print(f"\n{how}: survivors reported the loss {took:.2f}s after it (process group timeout {PG_TIMEOUT}s); "
          f"node 0's torchrun exited after {run.ended[0] - run.lost_at:.2f}s")
    step = run_ranks(_load_latest, 1, str(tmp_path / "ckpt"), timeout=120)[0]
    assert step % 5 == 0 and 5 <= step <= run.lost_after_step + 1, (step, run.lost_after_step)


def run_training_on(cluster, workdir, **kw):
    from shardopt.cluster.elastic_runs import run_training

    return run_training(cluster, str(workdir), nodes=2, nproc=2, save_every=5, lose_node=1, lose_at_step=7,
                        rdzv_conf=RDZV_CONF, timeout=240, **kw)


@needs_cluster
def test_elastic_resume_after_losing_a_node(cluster, tmp_path):
    """torchrun --nnodes 1:2 --max-restarts 1 (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): node 1 is
    lost after step 7; node 0 resumes from the step-5 checkpoint at world size 2 and ends with the
    weights of an uninterrupted single-process run of the same 20 steps (AdamW, clipping)."""
    from elastic_train import GlobalBatches, build_model, loss_of, make_data, make_optimizer_kwargs

    steps = 20
    run = run_training_on(cluster, tmp_path, steps=steps, nnodes="1:2", max_restarts=1, pg_timeout=20)
    text = run.log_text()
    assert run.codes[0] == 0, text
    first = [p for p in run.progress if p[0] == 0]
    second = [p for p in run.progress if p[0] == 1]
    assert first and {p[1] for p in first} == {4}, text
    assert second and {p[1] for p in second} == {2} and second[-1][2] == steps, text
    resumed_from = second[0][2] - 1
    assert resumed_from % 5 == 0 and 5 <= resumed_from <= run.lost_after_step + 1, (resumed_from, text)
    print(f"\nlost after step {run.lost_after_step}; resumed from step {resumed_from} at world size 2, "
          f"first step {second[0][3] - run.lost_at:.1f}s after the loss")
    assert "warning: restarts need" not in text

    model = build_model()
    kw = make_optimizer_kwargs()
    opt = kw.pop("optim")(model.parameters(), **kw)
    x, y = make_data()
    loader = GlobalBatches(len(x), 16)
    for _ in range(steps):
        idx = loader.next_global()
        loss_of(model, x[idx], y[idx]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    final = torch.load(tmp_path / "final.pt")
    for name, p in model.state_dict().items():
        err = ((p - final[name]).abs().max() / p.abs().max()).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def _where(rank, world_size, fail_rank):
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        sent = int(f.read())
    return rank, world_size, int(os.environ["GROUP_RANK"]), sent


@needs_cluster
def test_run_ranks_on_cluster(cluster):
    """The benchmarks' launcher: run_ranks' contract (results in rank order, failures with tracebacks)."""
    from dist_harness import RankFailure
    from shardopt.cluster.node_ranks import run_ranks_on_cluster

    got = run_ranks_on_cluster(cluster, 2, 1, _where, None, timeout=120)
    assert [g[:2] for g in got] == [(0, 2), (1, 2)] and sorted(g[2] for g in got) == [0, 1], got
    assert all(g[3] > 0 for g in got)  # each rank reads its own node's link counter
    with pytest.raises(RankFailure, match="rank 1 fails on purpose"):
        run_ranks_on_cluster(cluster, 2, 1, _where, 1, timeout=120)


# ------------------------------------------------------------------ nothing but the link between nodes
@needs_cluster
def test_each_node_has_its_own_hostname_and_dev_shm(cluster, tmp_path):
    """Note [A node shares nothing but its link]: a file one node puts in /dev/shm is not in another node's,
    nor in the machine's; each node has its own hostname (its namespace's name), kept across processes."""
    seen = []
    for i in range(2):
        log = tmp_path / f"node{i}.log"
        p = cluster.popen(i, ["sh", "-c", "hostname; touch /dev/shm/shardopt-probe-$(hostname); ls /dev/shm; pwd"],
                          log=str(log), cwd=str(tmp_path))
        assert cluster.wait([p], 60) == [0], log.read_text()
        seen.append(log.read_text().split())
    for i, (host, *files, cwd) in enumerate(seen):
        assert host == cluster.plan.nodes[i].hostname, seen
        assert files == [f"shardopt-probe-{host}"], seen  # its own file only
        assert cwd == str(tmp_path)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("shardopt-probe-")]


def _tx(rank):
    """This node's link counter, read by its local rank 0 between barriers (None on the others)."""
    import torch.distributed as dist

    dist.barrier()
    if int(os.environ["LOCAL_RANK"]) != 0:
        return None
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def _step_bytes(rank, world_size, params_across, grads_across, steps=3):
    """Bytes this node sent per stage-3 step (its local rank 0's answer) and what they must be at least: every
    bucket's gathers (forward, and backward but the seam's) and its gradient phase, each rank's chunk crossing to
    the other nodes in its format (Note [Stage 3's parameters across nodes, rounded])."""
    import shardopt
    from shardopt.parallel.mesh_plan import bytes_per_element

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(6)])
    opt = shardopt.ShardedOptimizer(model.parameters(), lr=1e-3, stage=3, reduce_bucket_size=200_000,
                                    inter_node_param_dtype=params_across, inter_node_dtype=grads_across)
    wrapper = shardopt.ShardedDDP(model, opt)
    x = torch.randn(8, 384, generator=torch.Generator().manual_seed(rank))

    def step():
        wrapper(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    before = _tx(rank)
    for _ in range(steps):
        step()
    after = _tx(rank)
    nodes, per_node = opt.sharding.nodes.replicas, int(os.environ["LOCAL_WORLD_SIZE"])
    fmt = {None: None, torch.bfloat16: "bfloat16", "int8": "int8"}

    def across(b, what):  # one gather's bytes from this node: its ranks' chunks to the (R-1) other nodes
        chunk = opt.layout.buckets[b].chunk_numel
        if what == "int8":
            message = -(-(4 * -(-chunk // 256) + chunk) // 4) * 4  # scales, values, a slot of whole words
        else:
            message = chunk * bytes_per_element(what)
        return per_node * (nodes - 1) * message

    rounds = opt.store.rounds
    gathers = list(rounds.schedule.forward) + [b for b in rounds.schedule.backward if b not in rounds.seam]
    payload = sum(across(b, fmt[params_across]) for b in gathers) + \
        sum(across(b.index, fmt[grads_across]) for b in opt.layout.buckets)
    return None if before is None else ((after - before) / steps, payload)


def _nothing_bypasses_the_link(rank, world_size):
    """2 nodes x 2 ranks: which ranks share a host, what their agreements and gathers send over the link."""
    import socket

    import torch.distributed as dist
    from shardopt.zero3.passes import Intent, exchange
    from shardopt.parallel.shm_exchange import open_shm_exchange

    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    hosts = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world_size // per_node)]
    mine = nodes[rank // per_node]
    sharing = {"world": open_shm_exchange(dist.group.WORLD) is not None, "node": open_shm_exchange(mine) is not None}
    # Stage 3's pass agreements across nodes: each must carry every rank's 16 bytes over the link.
    shm = open_shm_exchange(dist.group.WORLD)
    before = _tx(rank)
    rounds = 500
    for i in range(rounds):
        exchange(Intent.FORWARD, i, dist.group.WORLD, shm)
    after = _tx(rank)
    agreements = None if before is None else (after - before, rounds * per_node * 16)
    steps = {(str(p), str(g)): _step_bytes(rank, world_size, p, g)
             for p, g in ((None, None), ("int8", "int8"), (torch.bfloat16, torch.bfloat16))}
    return hosts, sharing, agreements, steps


@needs_cluster
def test_no_byte_between_nodes_bypasses_the_link(cluster):
    """Ranks of a node share a host and its /dev/shm, ranks of two nodes do not: stage 3's agreements and
    gathers cross the link. Counted on each node's veth: 500 pass agreements send at least every rank's 16
    bytes each (they would send nothing through a /dev/shm the nodes shared), and a stage-3 step sends its
    arithmetic, exact, bf16 and int8 (the payload, plus at most 15% of headers, acknowledgements, barriers)."""
    from shardopt.cluster.node_ranks import run_ranks_on_cluster

    got = run_ranks_on_cluster(cluster, 2, 2, _nothing_bypasses_the_link, timeout=300)
    hosts = got[0][0]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    assert hosts[0] == cluster.plan.nodes[0].hostname and hosts[2] == cluster.plan.nodes[1].hostname
    assert all(g[1] == {"world": False, "node": True} for g in got), [g[1] for g in got]
    for node in (0, 2):  # the local rank 0s
        sent, least = got[node][2]
        assert sent >= least, f"node {node // 2}: 500 agreements sent {sent} bytes over the link, < {least}"
        for what, (per_step, payload) in got[node][3].items():
            print(f"\nnode {node // 2}, stage 3 (params, grads) across nodes {what}: {per_step / 1e6:.3f} MB per "
                  f"step, payload {payload / 1e6:.3f} MB ({per_step / payload:.3f})")
            assert payload <= per_step <= 1.15 * payload, (what, per_step, payload)


# ------------------------------------------------------------------ cleaning up
@needs_cluster
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_removes_every_namespace_and_link(sig):
    """`python -m shardopt.cluster --hold` builds 2 nodes and waits; a signal must leave nothing behind
    (no namespace of its, no new link in the machine's own namespace), and never touch others' namespaces."""
    p = subprocess.Popen([sys.executable, "-m", "shardopt.cluster", "--hold", "--nodes", "2"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        names = p.stdout.readline().split()
        assert len(names) == 3 and set(names) <= existing_namespaces(), names
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert not set(names) & existing_namespaces()
    # Links are only ever made inside the namespaces; none of the machine's own refers to them.
    assert not any(ns in _ip("-o", "link") for ns in names)


@needs_cluster
def test_sweep_removes_a_killed_holders_namespaces_and_nothing_else():
    """A SIGKILLed `--hold` cannot clean up: its namespaces stay. `--sweep` removes them (and so their
    links), and keeps a namespace named unlike ours (even with the dead pid in its name) and one of ours
    whose owner is alive (this test); the test deletes those two itself."""
    import secrets

    p = subprocess.Popen([sys.executable, "-m", "shardopt.cluster", "--hold", "--nodes", "2"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    names, keep = [], []
    try:
        names = p.stdout.readline().split()
        assert len(names) == 3 and set(names) <= existing_namespaces(), names
        p.kill()
        p.wait(timeout=30)  # reaped: its pid is gone, not a zombie
        assert set(names) <= existing_namespaces()  # left behind, as a SIGKILL leaves them
        token = secrets.token_hex(3)
        keep = [f"sweeptest-{p.pid}-{token}-n0",                                 # not our name
                cp.new_run_id("shardopt", os.getpid(), token) + "-sw"]          # ours, owner alive
        for ns in keep:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
        r = subprocess.run([sys.executable, "-m", "shardopt.cluster", "--sweep"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        left = existing_namespaces()
        assert not set(names) & left, (names, r.stdout)
        assert set(keep) <= left, (keep, r.stdout)
        assert all(f"removed {ns} (owner pid {p.pid} is gone)" in r.stdout for ns in names), r.stdout
        assert not any(ns in r.stdout for ns in keep), r.stdout
        assert not any(ns in _ip("-o", "link") for ns in names)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for ns in keep + names:  # ours to delete, also after a failure
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    assert not set(keep + names) & existing_namespaces()
