"""OneBitAdam's clipping in the compression stage: the mean gradient's norm from a count sketch.

Note [Clipping by a sketch]
---------------------------
No rank holds the averaged gradient, so every rank folds its local gradient, each element times a fixed
random sign, into SKETCH sums (element e into sum e mod SKETCH); their all-reduce is the mean gradient's
sketch, whose squared sums estimate |mean|^2 without bias, 0.8% off on the norm at most (one standard
deviation; exact up to SKETCH elements). The signs are a table of _SIGN_PERIOD entries, repeated (8 MB,
not a sign per parameter); the period is odd, so two elements of one sum share an entry only 8.6e9 apart.
"""
from __future__ import annotations

import torch

SKETCH = 8192
_SKETCH_SEED = 0x1B17
_SIGN_PERIOD = (1 << 20) + 1
_sign_table: torch.Tensor | None = None


def _signs() -> torch.Tensor:
    global _sign_table
    if _sign_table is None:
        g = torch.Generator().manual_seed(_SKETCH_SEED)
        one = torch.randint(0, 2, (_SIGN_PERIOD,), generator=g).to(torch.float32).mul_(2).sub_(1)
        _sign_table = torch.cat([one, one])
    return _sign_table


def _sign_pieces(lo: int, hi: int):
    """(a, b, the signs of flat elements a..b-1, a view of the table) for pieces covering lo..hi."""
    table = _signs()
    for a in range(lo, hi, _SIGN_PERIOD):
        b, off = min(hi, a + _SIGN_PERIOD), a % _SIGN_PERIOD
        yield a, b, table[off:off + b - a]


def sketch_signs(lo: int, hi: int) -> torch.Tensor:
    """The fixed +-1 signs (fp32) of flat elements lo..hi-1, the same on every rank."""
    return torch.cat([signs for _, _, signs in _sign_pieces(lo, hi)] or [_signs()[:0]])


def sketch_at(values: torch.Tensor, ranges, total: int) -> torch.Tensor:
    """The SKETCH (or total, if fewer) signed sums of a [total] gradient that is zero outside `values`, laid
    at the flat ranges (lo, hi) one after the other (a shard: one chunk per bucket)."""
    k = min(SKETCH, total)
    sums = torch.zeros(k, dtype=torch.float32)
    at = 0
    for lo, hi in ranges:
        for a, b, signs in _sign_pieces(lo, hi):
            x = values[at:at + b - a] * signs
            at += b - a
            front, back = a % k, -b % k  # element a goes to sum a mod k
            sums += torch.cat([x.new_zeros(front), x, x.new_zeros(back)]).view(-1, k).sum(0)
    return sums


def sketch(flat: torch.Tensor) -> torch.Tensor:
    """A whole [total] gradient's sketch."""
    return sketch_at(flat, [(0, flat.numel())], flat.numel())

