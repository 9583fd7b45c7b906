"""A plain-PyTorch reference of hybrid sharding's training step with a compressed inter-node hop.

One process simulates every rank of a R x K mesh (R replicas of K shards): it
takes each rank's gradients, reduces them as the mesh does, and steps a plain
torch optimizer on whole fp32 parameters. Nothing of shardopt runs but its
pure layout (which elements form a chunk: the int8 codec's blocks start at a
part's first element, so the result depends on where chunks begin) and the
codec's plain-PyTorch reference (shardopt.reference).

Note [The hop's training reference]
-----------------------------------
A step of hybrid sharding with a compressed hop (Note [Hybrid sharding] in
shardopt/parallel/mesh_plan.py, Note [Compressed inter-node hop] in
csrc/comm/replica_hop.h) is, per bucket and per shard chunk c:

  1. every rank's gradient divided by W = R * K (exact: a power of two here);
  2. the node's K gradients summed (the reduce-scatter inside the node);
  3. the R node sums exchanged across replicas: the chunk is cut into R parts,
     replica j owns part j; the others send it encoded (bf16, or int8 with
     their error-feedback residual), j sums in replica order in fp32 (its own
     part exact), encodes the sum (int8: with the last n / R elements of its
     residual) and every replica decodes that into its chunk;
  4. each rank's torch optimizer steps its chunk.

Node-aware flat sharding over R nodes of K ranks (Note [Two-level collectives],
Note [Node-aware chunk order] in shardopt/layout.py) does only phase 1 of the
hop: the inside-node reduce-scatter leaves local rank j with node chunk j (the
bucket's chunks j * R ... j * R + R - 1), whose part i is rank (i, j)'s own
chunk; rank (i, j) keeps the fp32 sum of part i (its own addend exact, the
others' decoded) and nothing is encoded a second time. Its parameter phase is
exact.

Why the reference can be bit for bit: with R = K = 2 every sum has two
addends, and a + b == b + a in IEEE arithmetic, so the grouping the ring or
gloo picks cannot change a bit; the codec's kernels equal shardopt.reference
bit for bit on every SIMD variant (test_int8_codec.py, test_isa_variants.py),
bf16 rounding is round-to-nearest-even everywhere; and a torch optimizer is
element-wise, so stepping a 1-D piece of a parameter or the whole parameter
is the same arithmetic element by element. Parameters a rank does not use
give zeros, as the engine stages them; a parameter no rank used gets no
gradient and is not stepped (torch.optim's rule, Note [Flat layout]).
Clipping is left out: its global norm is a sum over shards whose order the
reference would have to copy, which is no longer an independent check.
"""
import torch

from shardopt import reference as R


class HopTrainingReference:
    """Hybrid sharding of `params` (fp32, in the optimizer's order) over `replicas` x `shards` ranks, the
    hop in `hop` (torch.bfloat16, "int8" or None for exact), stepping `optimizer` (a torch optimizer over
    exactly `params`). `layout` says where each parameter and chunk lies (shardopt's pure plan)."""

    def __init__(self, params, optimizer, layout, replicas, shards, hop):
        # A (R, K) mesh shards over K; node-aware flat sharding over all R * K ranks (phase 1 only).
        self.node_aware = layout.nodes > 1
        assert (layout.world_size, layout.nodes) == ((replicas * shards, replicas) if self.node_aware else (shards, 1))
        assert [s.numel for s in layout.params] == [p.numel() for p in params]
        self.params, self.optimizer, self.layout = params, optimizer, layout
        self.replicas, self.shards, self.hop = replicas, shards, hop
        # Error feedback: per (bucket, shard chunk) each replica's residual of n + n / R elements.
        self.residuals = {}

    def _flat(self, grads):
        """One rank's gradients (None where it used no parameter) in the flat buffer, divided by W."""
        flat = torch.zeros(self.layout.total_numel, dtype=torch.float32)
        for slot, g in zip(self.layout.params, grads):
            if g is not None:
                flat[slot.offset:slot.end] = g.float().reshape(-1)
        return flat / (self.replicas * self.shards)

    def _scatter(self, key, chunks):
        """Phase 1 alone: part i of the result is the fp32 sum in replica order of the parts i, replica i's
        own exact and the others' encoded (int8 with their residual's elements for that part)."""
        reps, n = len(chunks), chunks[0].numel()
        m = n // reps
        res = self.residuals.setdefault(key, [torch.zeros(n + m) for _ in chunks]) if self.hop == "int8" else None
        out = torch.empty(n, dtype=torch.float32)
        for i in range(reps):
            lo, hi = i * m, (i + 1) * m
            total = None
            for k in range(reps):
                x = chunks[k][lo:hi].float()
                if k == i or self.hop is None:
                    part = x.clone()
                elif self.hop == torch.bfloat16:
                    part = x.to(torch.bfloat16).float()
                else:
                    part = R.int8_encode_feedback_reference(x, res[k][lo:hi])[2]
                total = part if total is None else total + part
            out[lo:hi] = total
        return out

    def _hop(self, key, chunks):
        if self.node_aware:
            return self._scatter(key, chunks)
        if self.hop is None:
            out = chunks[0].clone()
            for c in chunks[1:]:
                out += c
            return out
        if self.hop == torch.bfloat16:
            # Phase 1 as node-aware's, then each owner's fp32 sum leaves it rounded to bf16 (phase 2).
            return self._scatter(key, chunks).to(torch.bfloat16).float()
        assert self.hop == "int8"
        n = chunks[0].numel()
        res = self.residuals.setdefault(key, [torch.zeros(n + n // self.replicas) for _ in chunks])
        return R.int8_hop_reference(chunks, res)

    def reduce(self, rank_grads):
        """`rank_grads[r]`: rank r's gradients (rank = replica * K + shard, as a (R, K) DeviceMesh numbers
        them). Returns each parameter's reduced gradient, or None where no rank had one."""
        flats = [self._flat(g) for g in rank_grads]
        K = self.shards
        nodes = []  # step 2: each replica's sum over its K ranks, in rank order
        for i in range(self.replicas):
            s = flats[i * K].clone()
            for f in flats[i * K + 1:(i + 1) * K]:
                s += f
            nodes.append(s)
        reduced = torch.zeros(self.layout.total_numel, dtype=torch.float32)
        for b in self.layout.buckets:  # step 3, chunk by chunk (node-aware: node chunk by node chunk)
            for c in range(K):
                if self.node_aware:
                    lo = b.start + c * self.replicas * b.chunk_numel
                    hi = lo + self.replicas * b.chunk_numel
                    assert b.chunk(c)[0] == lo and b.chunk(K + c)[0] == lo + b.chunk_numel  # rank (1, c): part 1
                else:
                    lo, hi = b.chunk(c)
                reduced[lo:hi] = self._hop((b.index, c), [s[lo:hi] for s in nodes])
        used = [any(g[i] is not None for g in rank_grads) for i in range(len(self.params))]
        return [reduced[s.offset:s.end].view(s.shape) if u else None for s, u in zip(self.layout.params, used)]

    @torch.no_grad()
    def step(self, rank_grads):
        for p, g in zip(self.params, self.reduce(rank_grads)):
            p.grad = None if g is None else g.clone()
        self.optimizer.step()
