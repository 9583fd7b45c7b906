"""What every checkpoint reader gives the loader, in one module that both readers import.

save_load.NativeSource reads shardopt's own format and deepspeed_reader.DeepSpeedSource reads
DeepSpeed's ZeRO-1/2 folders; save_load's loader knows only this interface, so neither reader
imports the other.
"""
import torch

PARAM = ":param"  # the master values travel with a piece's state under this (non-identifier) key
# Optimizers whose state is the same (step, exp_avg, exp_avg_sq): offload="cpu"
# swaps torch's AdamW for shardopt.CPUAdam, and checkpoints move between them.
SAME_STATE = ({"torch.optim.adam.Adam", "torch.optim.adamw.AdamW", "shardopt.cpu_adam.CPUAdam"},)


def class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Source:
    """A checkpoint as the loader sees it, whatever wrote it: names, shapes, chunks, model state.

    `NativeSource` reads shardopt's own format; `shardopt.checkpoint.deepspeed_reader.DeepSpeedSource`
    reads DeepSpeed's ZeRO-1/2 folders. Both hand the loader the same
    (name, element range) chunks, so staging, agreement and installing are one
    code path (Note [Checkpoint layout]).
    """

    directory: str
    params: dict
    """Trainable parameter name -> {"shape": list, "group": int}."""
    model_state: dict
    """Frozen parameter / buffer name -> ("frozen" | "buffer", shape tuple)."""
    scaler = None
    """Loss-scaler state for shardopt.precision.LossScaler.load_state_dict, or None."""
    onebit = None
    """OneBitAdam's record (OneBitStep.record(), Note [The step the variance froze at]), or None."""

    def resolve_hyper(self, opt) -> list:
        """Every param group's hyper-parameters after the load; raises if the optimizers cannot meet."""
        raise NotImplementedError

    def chunks(self, name: str, start: int, end: int) -> list:
        """Chunks of `name` overlapping elements [start, end), sorted by start (master values in PARAM)."""
        raise NotImplementedError

    def model_tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    # What a conversion to whole weights reads (checkpoint/hf_convert.py): one piece at a time.
    def masters(self, name: str):
        """(lo, hi, values): the saved master values of elements [lo, hi) of trainable parameter `name`,
        in element order, each read when the iteration reaches it and kept by nobody here (not `chunks`,
        which reads the optimizer state too)."""
        raise NotImplementedError

    def state_dict_names(self) -> list:
        """(state-dict key, the name in `params` or `model_state` it is) for every key of the saved model's
        state dict, in its order: tied weights are several keys of one name."""
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
        """The signature of the int8 hop residuals saved (checkpoint/hop_residual.py), or None if none were."""
        return None

    def hop_residual(self, replica: int, shard: int) -> torch.Tensor | None:
        """The residual saved by that rank of the mesh, read and verified, or None."""
        return None

    def close(self) -> None:
        pass
