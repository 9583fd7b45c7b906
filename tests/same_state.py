"""What the checkpoint tests snapshot of a training state, and bitwise equality of such snapshots."""
import torch


def snapshot(model, opt) -> dict:
    """Model state and the consolidated torch.optim state dict (None except on rank 0); a collective."""
    opt.consolidate_state_dict(to=0)
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict() if opt.rank == 0 else None}


def same(a, b) -> bool:
    """Same keys, lengths and values; tensors of the same dtype, shape and every element."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b
