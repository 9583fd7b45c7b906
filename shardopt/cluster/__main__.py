"""`python -m shardopt.cluster --hold`: builds an emulated cluster, prints its namespaces, waits for a signal.
`python -m shardopt.cluster --sweep`: deletes the namespaces of clusters whose owning process is dead."""
import argparse
import sys

from shardopt.cluster import emulated
from shardopt.cluster.plan import namespace_owner

ap = argparse.ArgumentParser(description=emulated.__doc__.splitlines()[0])
what = ap.add_mutually_exclusive_group(required=True)
what.add_argument("--hold", action="store_true", help="build it and wait for Ctrl-C / SIGTERM")
what.add_argument("--sweep", action="store_true",
                  help="delete the namespaces left by clusters whose process was killed (only <prefix>-<pid>-... "
                       "names whose <pid> is gone; Note [Sweeping namespaces of dead runs] in cluster/plan.py)")
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--rate", default="1gbit")
ap.add_argument("--prefix", default="shardopt", help="with --sweep: the clusters' name prefix")
a = ap.parse_args()
if a.hold:
    emulated.hold(a.nodes, a.rate)
else:
    try:
        removed = emulated.sweep(a.prefix)
    except emulated.ClusterUnavailable as e:
        sys.exit(f"--sweep: {e}")
    for ns in removed:
        print(f"removed {ns} (owner pid {namespace_owner(ns, a.prefix)} is gone)")
    if not removed:
        print("nothing to sweep")
