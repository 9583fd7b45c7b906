"""What every checkpoint reader gives the loader: the interface both readers import, neither the other."""
import torch

PARAM = ":param"  # the master values travel with a piece's state under this (non-identifier) key
# Optimizers with the same state (step, exp_avg, exp_avg_sq): checkpoints move between them (offload="cpu").
SAME_STATE = ({"torch.optim.adam.Adam", "torch.optim.adamw.AdamW", "shardopt.cpu_adam.CPUAdam"},)


def class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Source:
    """A checkpoint as the loader sees it, whatever wrote it: (name, element range) chunks, model state
    (Note [Checkpoint layout])."""

    directory: str
    params: dict  # trainable parameter name -> {"shape": list, "group": int}
    model_state: dict  # frozen parameter / buffer name -> ("frozen" | "buffer", shape tuple)
    scaler = None  # LossScaler.load_state_dict's state, or None
    onebit = None  # OneBitAdam's record (Note [The step the variance froze at]), or None

    def resolve_hyper(self, opt) -> list:
        """Every param group's hyper-parameters after the load; raises if the optimizers cannot meet."""
        raise NotImplementedError

    def chunks(self, name: str, start: int, end: int) -> list:
        """Chunks of `name` overlapping elements [start, end), sorted by start (master values in PARAM)."""
        raise NotImplementedError

    def model_tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def masters(self, name: str):
        """(lo, hi, values) of `name`'s saved masters in order, each read when reached, none kept (hf_convert)."""
        raise NotImplementedError

    def state_dict_names(self) -> list:
        """(state-dict key, its name in `params` or `model_state`) for the saved state dict's keys, in order."""
        raise NotImplementedError

    def model_dtype(self, name: str) -> torch.dtype:
        """The dtype the model held `name` in (a trainable parameter's masters may be finer)."""
        raise NotImplementedError

    def master_dtype(self) -> torch.dtype | None:
        """The dtype of the saved master values (None: nothing saved)."""
        raise NotImplementedError

    def extra(self):
        return None

    def hop_residual_signature(self) -> dict | None:
        """The signature the hop residuals were saved under (hop_residual.py), or None."""
        return None

    def hop_residual(self, replica: int, shard: int) -> torch.Tensor | None:
        """The residual saved by that rank of the mesh, read and verified, or None."""
        return None

    def close(self) -> None:
        pass
