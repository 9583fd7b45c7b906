"""The rank side of shardopt.cluster.node_ranks.run_ranks_on_cluster; torchrun runs `python node_rank_worker.py DIR`.

Reads DIR/spec.pt (the function, its arguments, the caller's sys.path),
joins the process group torchrun set up, runs fn(rank, world_size, *args,
**kwargs) and writes DIR/rank-<r>.pt: (True, result) or (False, traceback).
"""
import os
import sys

# Run as a script, this file's directory (shardopt/) heads sys.path, where its modules would be
# importable under top-level names; only the caller's sys.path counts.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import datetime  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import traceback  # noqa: E402


def _function(spec):
    if spec["module"] is not None:
        obj = importlib.import_module(spec["module"])
    else:  # the caller ran it as a script: load the script again, under another name
        loader = importlib.util.spec_from_file_location("__cluster_main__", spec["path"])
        obj = importlib.util.module_from_spec(loader)
        sys.modules["__cluster_main__"] = obj
        loader.loader.exec_module(obj)
    for part in spec["name"].split("."):
        obj = getattr(obj, part)
    return obj


def main(directory: str) -> None:
    import torch
    import torch.distributed as dist

    spec = torch.load(os.path.join(directory, "spec.pt"), weights_only=False)
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    torch.set_num_threads(spec["threads"])
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["collective_timeout"]))
        out = (True, _function(spec)(rank, dist.get_world_size(), *spec["args"], **spec["kwargs"]))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        out = (False, traceback.format_exc())
    torch.save(out, os.path.join(directory, f"rank-{rank}.pt"))
    if out[0] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if out[0] else 1)  # torch 2.13 gloo can abort at interpreter exit (README, pytorch/pytorch#190489)


if __name__ == "__main__":
    main(sys.argv[1])
