"""Loads the compiled extension shardopt._C with an error that says how to build it."""
try:
    from shardopt import _C  # noqa: F401  (importing registers the torch.ops.shardopt ops)
except ImportError as e:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "shardopt's C++ extension shardopt._C is not built or does not match the installed torch "
        f"({e}). Build it against your torch with: pip install --no-build-isolation -e ."
    ) from e


def cpu_features() -> dict:
    """The CPU kernels' SIMD variants: ``active``, ``best`` (the default unless SHARDOPT_ISA pins another) and
    ``supported`` (best last)."""
    return {"active": _C.active_isa(), "best": _C.best_isa(), "supported": list(_C.supported_isas())}
