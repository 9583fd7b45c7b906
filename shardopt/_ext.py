"""Loads the compiled extension shardopt._C with an error that says how to build it."""
try:
    from shardopt import _C  # noqa: F401  (importing registers the torch.ops.shardopt ops)
except ImportError as e:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "shardopt's C++ extension shardopt._C is not built or does not match the installed torch "
        f"({e}). Build it against your torch with: pip install --no-build-isolation -e ."
    ) from e
