"""Multi-rank runs for tests and benchmarks, never imported by the engine.

ranks.py          run_ranks: fn on N local processes joined by gloo (or NCCL)
memory_cap.py     run_capped: run_ranks with each rank in a memory cgroup of its own; what each was charged (root)
emulated.py       EmulatedCluster: nodes as network namespaces with shaped links (root)
plan.py           its pure plan: names, addresses, ip/tc/torchrun command lines
node_ranks.py     run_ranks_on_cluster: run_ranks' contract on ranks torchrun starts on the nodes
node_rank_worker.py   the rank side of that (a script torchrun runs)
elastic_runs.py   examples/elastic_train.py on a cluster that loses a node
"""
from shardopt.cluster.emulated import ClusterUnavailable, EmulatedCluster  # noqa: F401
