"""Optimizer state between its sharded form (per piece) and its full form (per parameter).

Pure tensor code: no process group, no files. A *chunk* here is what one piece
contributes: (parameter key, element range [start, end) of the flattened
parameter, elementwise state slices, per-parameter scalars). Save, load,
consolidation and `convert` all move chunks; this module cuts them out of an
optimizer, glues them into whole parameters, cuts whole ones into any other
ranges, and installs a piece's state into the inner optimizer.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Iterable, Sequence

import torch

from shardopt.checkpoint.files import CheckpointError
from shardopt.view import view_of

# Per-parameter state that is not elementwise even when it looks like it (torch's
# optimizers all call the step counter this; a 0-d step of a 0-d parameter would
# otherwise be sliced as if it were exp_avg).
SCALAR_KEYS = frozenset({"step"})


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece's optimizer state, addressed by parameter and element range."""

    key: Hashable
    """The parameter: its name (checkpoints) or its index (consolidation)."""
    start: int
    """First element of the flattened parameter."""
    end: int
    """One past the last element."""
    slices: dict
    """Elementwise state (exp_avg, momentum_buffer, ...): 1-D tensors of end - start elements."""
    scalars: dict
    """Per-parameter state (step, ...): the same on every chunk of a parameter."""


def split_state(state: dict, shape: tuple, where: str) -> tuple[dict, dict]:
    """Optimizer state of a tensor of `shape` as (elementwise entries, flattened; per-parameter scalars).

    A piece's state has shape (numel,); a whole parameter's (torch.optim format) the parameter's shape.
    """
    slices, scalars = {}, {}
    for k, v in state.items():
        if torch.is_tensor(v) and k not in SCALAR_KEYS and tuple(v.shape) == tuple(shape):
            slices[k] = v.reshape(-1)
        elif not torch.is_tensor(v) or v.numel() == 1:
            scalars[k] = v
        else:
            raise CheckpointError(f"{where}: optimizer state {k!r} has shape {tuple(v.shape)}, neither "
                                  f"elementwise (shape {tuple(shape)}) nor a scalar; an optimizer with such "
                                  "state cannot be sharded")
    return slices, scalars


def local_chunks(opt, keys: Sequence[Hashable], copy: bool) -> list[tuple[int, Chunk]]:
    """(piece index, Chunk) for every piece of this rank of `opt` (a ShardedOptimizer or its view); keys[j]
    names layout parameter j.

    copy=True clones to CPU (for sending); otherwise the tensors are the live ones.
    """
    opt = view_of(opt)
    out = []
    for i, (pc, t) in enumerate(zip(opt.pieces, opt.piece_params)):
        slot = opt.layout.params[pc.param]
        state = opt.inner.state.get(t, {}) if opt.inner is not None else {}
        slices, scalars = split_state(state, (pc.numel,), f"parameter {keys[pc.param]!r}")
        if copy:
            slices = {k: v.detach().to("cpu", copy=True) for k, v in slices.items()}
            scalars = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in scalars.items()}
        out.append((i, Chunk(keys[pc.param], pc.start - slot.offset, pc.end - slot.offset, slices, scalars)))
    return out


def assemble(shapes: dict, chunks: Iterable[Chunk]) -> dict:
    """Whole-parameter state {key: {state key: tensor of the parameter's shape or scalar}}.

    Parameters whose chunks carry no state (never stepped) are left out, as
    torch.optim leaves them out of its state.
    """
    by_key: dict = {}
    for c in chunks:
        by_key.setdefault(c.key, []).append(c)
    out = {}
    for key, cs in by_key.items():
        cs.sort(key=lambda c: c.start)
        numel = math.prod(shapes[key])
        names = set(cs[0].slices) | set(cs[0].scalars)
        if not names:
            continue
        at = 0
        for c in cs:
            if c.start != at or set(c.slices) | set(c.scalars) != names:
                raise CheckpointError(f"parameter {key!r}: chunks do not tile it (gap, overlap or "
                                      f"different state keys at element {c.start})")
            at = c.end
        if at != numel:
            raise CheckpointError(f"parameter {key!r}: chunks cover {at} of {numel} elements")
        state = {k: torch.cat([c.slices[k] for c in cs]).reshape(shapes[key]) for k in cs[0].slices}
        state.update(cs[0].scalars)
        out[key] = state
    return out


def cut(chunks: Sequence[Chunk], start: int, end: int, where: str) -> tuple[dict, dict]:
    """The state of elements [start, end) from chunks (sorted by start) covering them: fresh tensors."""
    parts, at = [], start
    for c in chunks:
        if c.end <= at or c.start >= end:
            continue
        if c.start > at:
            break
        hi = min(c.end, end)
        parts.append((c, at - c.start, hi - c.start))
        at = hi
        if at == end:
            break
    if at != end:
        raise CheckpointError(f"{where}: the checkpoint has no state for elements [{at}, {end})")
    names = set(parts[0][0].slices)
    if any(set(c.slices) != names or set(c.scalars) != set(parts[0][0].scalars) for c, _, _ in parts):
        raise CheckpointError(f"{where}: parts of the parameter have different optimizer state keys")
    # torch.cat copies even a single part: the result never aliases a source tensor.
    slices = {k: torch.cat([c.slices[k][lo:hi] for c, lo, hi in parts]) for k in names}
    scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in parts[0][0].scalars.items()}
    return slices, scalars


def group_hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def resolve_hyper(opt, saved: list, same_class: bool, where: str, exc=CheckpointError) -> list[dict]:
    """The param groups' hyper-parameters after loading `saved` (torch's rule: the saved ones win)."""
    if len(saved) != len(opt.param_groups):
        raise exc(f"{where} has {len(saved)} param groups but this optimizer has "
                              f"{len(opt.param_groups)}: build the optimizer with the same groups")
    out = []
    for g, s in zip(opt.param_groups, saved):
        cur = group_hyper(g)
        # Another optimizer class (source.SAME_STATE) keeps its own options; only shared ones load.
        out.append({**cur, **s} if same_class else {k: s.get(k, v) for k, v in cur.items()})
    return out


class InnerStateSwap:
    """Replaces the inner optimizer's state and hyper-parameters, reversibly.

    `apply` runs the inner optimizer's own load_state_dict (its dtype / device
    rules and checks); it either raises before changing anything or succeeds,
    and `undo` then restores the previous state (load_state_dict installs new
    tensors, so the old ones, still referenced here, are untouched).
    """

    def __init__(self, opt):
        self.opt = opt  # the optimizer's view (Note [The optimizer's view] in view.py)
        self._old = None

    def apply(self, piece_states: dict, hyper: Sequence[dict]) -> None:
        inner = self.opt.inner
        if inner is None:
            return
        order = {id(t): k for k, t in enumerate(p for g in inner.param_groups for p in g["params"])}
        state = {order[id(self.opt.piece_params[i])]: st for i, st in piece_states.items() if st}
        groups = [dict(h, params=[order[id(p)] for p in g["params"]]) for g, h in zip(inner.param_groups, hyper)]
        old = inner.state_dict()
        inner.load_state_dict({"state": state, "param_groups": groups})
        self._old = old

    def undo(self) -> None:
        if self._old is not None:
            self.opt.inner.load_state_dict(self._old)
            self._old = None
