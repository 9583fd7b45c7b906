"""`python -m shardopt.cluster --hold`: builds an emulated cluster, prints its namespaces, waits for a signal."""
import argparse

from shardopt.cluster import emulated

ap = argparse.ArgumentParser(description=emulated.__doc__.splitlines()[0])
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--rate", default="1gbit")
ap.add_argument("--hold", action="store_true", help="build it and wait for Ctrl-C / SIGTERM")
a = ap.parse_args()
if a.hold:
    emulated.hold(a.nodes, a.rate)
