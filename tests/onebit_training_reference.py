"""A plain-PyTorch reference of OneBitAdam's compression stage at several ranks, in one process.

It follows Note [1-bit Adam under ZeRO] (shardopt/onebit.py) and docs/multi-node-and-hybrid.md, with
shardopt.reference's 1-bit codec and exchange (onebit_allreduce_reference) and nothing else of shardopt
but its pure layout (which elements form rank r's row: the 1-bit blocks start at a row's first element).
Everything is held as whole flat vectors of the layout (weights, m, v), every rank's messages and
residuals side by side.

Note [The 1-bit training reference]
-----------------------------------
From the step T the variance froze at, with d = sqrt(v) / sqrt(1 - b2^T) + eps fixed, step t is:

  flat mesh (W ranks): rank i's local gradient G_i (fp32, zero where it used no parameter) is cut into
    rows, row r = chunk r of every bucket; rank i's local momentum L_i ([W, n], at the first compression
    step every owner's exact m) becomes b1 L_i + (1 - b1) G_i; x_i = L_i / d (0 on padding); the W
    vectors x_i go through the two-phase 1-bit all-reduce (worker residual W n, server residual n per
    rank; every block's scale its RMS, `scale`); row r of its decoded mean times d is owner r's momentum;
  hybrid mesh (R x K): the node's mean gradient (K local gradients / K, summed: the exact reduce-scatter
    inside the node, the hop across replicas off); shard c of replica k keeps its local momentum L (at the
    first compression step m) = b1 L + (1 - b1) G and sends x = L / d through the 1-bit all-reduce among
    the R replicas of shard c (worker n, server n / R), and m = decoded mean * d;
  then, for every parameter some rank used, m takes the new values and p = p (1 - lr wd) - lr / bc1(t) m / d;
  padding keeps m = 0.

Why bit for bit: every sum the exchange forms is in a fixed, documented order (the owner sums the parts
in rank order in fp32; the mean is that sum / R); the node mean of K = 2 gradients has two addends,
which commute; the codec kernels equal shardopt.reference bit for bit (test_onebit.py); the remaining
operations are element-wise fp32 in the same order. The warm-up (exact AdamW) is where the flat mesh
cannot be matched bit for bit: its 4-rank reduce-scatter sums in an order the ring or gloo chooses.
So the reference runs its own warm-up (torch AdamW on the mean gradient), the caller checks it against
shardopt's (bit for bit on the 2 x 2 mesh, whose sums have two addends; within the parity bar of two
summation orders on the flat one), and the compression stage starts from shardopt's weights, m and v.
"""
import math

import torch

from shardopt import reference as R


class OneBitReference:
    """`layout`: shardopt's (pure) plan; `replicas` x `shards` ranks (replicas == 1: the flat mesh over
    layout.world_size ranks). `p`, `m`, `v`: the flat weights and Adam state at the freeze (after `steps`
    Adam steps, T = steps). One param group: `lr`, `betas`, `eps`, `weight_decay`; `scale` and `gains`: the 1-bit
    blocks' scale, its mean |x| times 1.5 on the ranks' messages and 1.75 on the owners' (OneBitConfig's
    default since 2026-11-29), or "rms" with gains (1, 1) as until then."""

    def __init__(self, layout, replicas, shards, p, m, v, steps, *, lr, betas, eps, weight_decay, scale="mean",
                 gains=(1.5, 1.75)):
        assert layout.nodes == 1 and layout.world_size == shards
        self.layout, self.R, self.K = layout, replicas, shards
        self.p, self.m, self.v = p.clone(), m.clone(), v.clone()
        self.steps, self.frozen_at = steps, steps
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.scale, self.gains = scale, gains  # every 1-bit message's block scale (Note [1-bit format])
        self.d = self.v.sqrt().div_(math.sqrt(1.0 - self.b2 ** self.frozen_at)).add_(eps)
        self.padding = torch.ones(layout.total_numel, dtype=torch.bool)
        for s in layout.params:
            self.padding[s.offset:s.end] = False
        self.m[self.padding] = 0.0
        n = layout.shard_numel()
        if replicas == 1:
            W = shards
            self.L = [self.rows(self.m) for _ in range(W)]  # each rank's local momentum: the owners' exact m
            self.worker = [torch.zeros(W * n) for _ in range(W)]
            self.server = [torch.zeros(n) for _ in range(W)]
        else:  # per shard c: the R replicas' residuals and local momenta
            self.worker = [[torch.zeros(n) for _ in range(replicas)] for _ in range(shards)]
            self.server = [[torch.zeros(n // replicas) for _ in range(replicas)] for _ in range(shards)]
            m_rows = self.rows(self.m)
            self.L = [[m_rows[c].clone() for _ in range(replicas)] for c in range(shards)]

    def rows(self, flat):
        """[total] -> [K, n]: row r is chunk r of every bucket, concatenated."""
        return torch.cat([flat[b.start:b.end].view(self.K, -1) for b in self.layout.buckets], dim=1)

    def unrows(self, rows):
        flat = torch.zeros(self.layout.total_numel)
        at = 0
        for b in self.layout.buckets:
            flat[b.start:b.end] = rows[:, at:at + b.chunk_numel].reshape(-1)
            at += b.chunk_numel
        return flat

    def local(self, grads):
        """One rank's gradients (None where unused) as a flat fp32 vector."""
        flat = torch.zeros(self.layout.total_numel)
        for s, g in zip(self.layout.params, grads):
            if g is not None:
                flat[s.offset:s.end] = g.float().reshape(-1)
        return flat

    def _new_m_flat(self, rank_grads):
        b1, K = self.b1, self.K
        d_rows = self.rows(self.d)
        if self.R == 1:
            xs = []
            for i, g in enumerate(rank_grads):
                self.L[i].mul_(b1).add_(self.rows(self.local(g)).mul_(1.0 - b1))
                x = self.L[i] / d_rows
                x[self.rows(self.padding)] = 0.0
                xs.append(x.reshape(-1))
            mean = R.onebit_allreduce_reference(xs, self.worker, self.server, scale=self.scale, gains=self.gains)
            return self.unrows(mean.view(K, -1) * d_rows)
        # hybrid: the node's mean gradient, then shard by shard among the replicas
        nodes = []
        for k in range(self.R):
            s = self.local(rank_grads[k * K]) / K
            for g in rank_grads[k * K + 1:(k + 1) * K]:
                s += self.local(g) / K
            nodes.append(self.rows(s))
        out = torch.empty_like(d_rows)
        for c in range(K):
            xs = []
            for k in range(self.R):
                self.L[c][k].mul_(b1).add_(nodes[k][c].mul(1.0 - b1))
                xs.append(self.L[c][k] / d_rows[c])
            out[c] = R.onebit_allreduce_reference(xs, self.worker[c], self.server[c], scale=self.scale,
                                                  gains=self.gains) * d_rows[c]
        return self.unrows(out)

    @torch.no_grad()
    def step(self, rank_grads):
        """`rank_grads[r]`: rank r's gradients per layout parameter (None where unused)."""
        new_m = self._new_m_flat(rank_grads)
        new_m[self.padding] = 0.0
        t = self.steps + 1
        bc1 = 1.0 - self.b1 ** t
        for i, s in enumerate(self.layout.params):
            if any(g[i] is not None for g in rank_grads):
                self.m[s.offset:s.end] = new_m[s.offset:s.end]
                p = self.p[s.offset:s.end]
                p.mul_(1.0 - self.lr * self.wd).addcdiv_(self.m[s.offset:s.end], self.d[s.offset:s.end],
                                                         value=-self.lr / bc1)
        self.steps = t

    def weights(self):
        """Each layout parameter's weights, shaped."""
        return [self.p[s.offset:s.end].view(s.shape) for s in self.layout.params]
