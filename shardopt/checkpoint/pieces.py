"""Optimizer state between its sharded form (per piece) and its full form (per parameter).

Pure tensor code. Save, load, consolidation and `convert` move *chunks* (a piece's state, addressed by
parameter and element range); this module cuts them out of an optimizer, glues them into whole parameters,
cuts those into other ranges, and installs a piece's state into the inner optimizer.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Iterable, Sequence

import torch

from shardopt.files import CheckpointError
from shardopt.view import view_of

# Per-parameter even when shaped like the parameter (a 0-d parameter's 0-d step is no exp_avg).
SCALAR_KEYS = frozenset({"step"})


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece's optimizer state, addressed by parameter and element range."""

    key: Hashable  # the parameter's name (checkpoints) or index (consolidation)
    start: int  # [start, end) of the flattened parameter
    end: int
    slices: dict  # elementwise state (exp_avg, ...): 1-D tensors of end - start elements
    scalars: dict  # per-parameter state (step, ...), the same on every chunk of a parameter


def split_state(state: dict, shape: tuple, where: str) -> tuple[dict, dict]:
    """Optimizer state of a piece or parameter of `shape` as (elementwise entries, flattened; scalars)."""
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


def local_chunks(opt, keys: Sequence[Hashable], copy: bool):
    """(piece index, Chunk) for this rank's pieces, keys[j] naming parameter j; copy=True: CPU clones, not live.
    With the optimizer's state on disk the pieces are read a bucket at a time: a live chunk (copy=False) is
    valid until the next one is asked for (Note [The optimizer's state on disk] in tiers/optimizer_state.py)."""
    opt = view_of(opt)
    for members in opt.resident_pieces():
        for i in members:
            pc, t = opt.pieces[i], opt.piece_params[i]
            slot = opt.layout.params[pc.param]
            state = opt.inner.state.get(t, {}) if opt.inner is not None else {}
            slices, scalars = split_state(state, (pc.numel,), f"parameter {keys[pc.param]!r}")
            if copy:
                slices = {k: v.detach().to("cpu", copy=True) for k, v in slices.items()}
                scalars = {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                           for k, v in scalars.items()}
            yield i, Chunk(keys[pc.param], pc.start - slot.offset, pc.end - slot.offset, slices, scalars)


def assemble(shapes: dict, chunks: Iterable[Chunk]) -> dict:
    """Whole-parameter state {key: {state key: tensor or scalar}}; never-stepped parameters left out, as torch does."""
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
        # Another class (source.SAME_STATE) keeps its own options; only shared ones load.
        out.append({**cur, **s} if same_class else {k: s.get(k, v) for k, v in cur.items()})
    return out


class StagedPieces:
    """A load's master values, kept until `install` writes them into the optimizer's pieces (the optimizer's
    state on disk stages them in a file instead: tiers/optimizer_state.StagedRecords, the same calls)."""

    def __init__(self, opt):
        self.opt = opt  # the optimizer's view
        self.masters: dict = {}

    def put(self, i: int, master: torch.Tensor, slices: dict, scalars: dict) -> dict:
        """Piece i's values; returns the state the inner optimizer installs."""
        self.masters[i] = master
        return {**slices, **scalars}

    def finish(self) -> None:
        pass

    @torch.no_grad()
    def install(self) -> None:
        for i, values in self.masters.items():
            self.opt.piece_params[i].copy_(values)

    def discard(self) -> None:
        self.masters.clear()


def staged_pieces(opt):
    """Where a load stages this rank's pieces: in memory, or in the state tier's second file."""
    tier = opt.state_tier
    return tier.staged() if tier is not None else StagedPieces(opt)


class InnerStateSwap:
    """Replaces the inner optimizer's state and hyper-parameters through its own load_state_dict (which raises
    before changing anything, or installs new tensors); `undo` puts the old ones back."""

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
