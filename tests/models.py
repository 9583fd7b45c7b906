"""Small models with the awkward features sharded paths must survive."""
import torch
import torch.utils.checkpoint
from torch import nn

VOCAB, DIM, HIDDEN = 37, 24, 53  # primes: nothing divides evenly by 2, 3 or 4
WIDE = dict(dim=199, hidden=331)  # AwkwardNet's l1, l2, branch 66k and frozen 110k elements: primes again


class AwkwardNet(nn.Module):
    """Tied embedding, a frozen layer, a branch used only on some steps, odd sizes.

    Sizes: emb 37x24=888 (tied with the output head), l1 24x53+53, frozen
    53x53+53, l2 53x24+24, branch 53x24+24 - each larger than the smallest
    buckets the tests use, so parameters straddle buckets and rank chunks. `dim` and `hidden` make it wide
    (WIDE: buckets whose chunks stage 3 maps, Note [Stage-3 buckets mapped, not copied]).
    """

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.l1 = nn.Linear(dim, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(hidden)  # a buffer that changes: broadcast_buffers matters
        self.l2 = nn.Linear(hidden, dim)
        self.branch = nn.Linear(hidden, dim)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x, use_branch: bool):
        h = torch.relu(self.l1(self.emb(x)))              # (B, T, HIDDEN)
        h = self.frozen(h)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        out = self.l2(h)
        if use_branch:
            out = out + self.branch(h)
        return self.head(out)


def batch(step: int, rank: int, micro: int = 0, bsz: int = 3, seq: int = 5):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, VOCAB, (bsz, seq), generator=g)
    y = torch.randint(0, VOCAB, (bsz, seq), generator=g)
    return x, y


def uses_branch(step: int, rank: int) -> bool:
    # With 2+ ranks: some steps some ranks use it, some steps no rank does
    # (then DDP + torch.optim leaves it untouched: no decay, no momentum).
    return (step + rank) % 3 == 0 and step % 4 != 1


def awkward_loss(fn, step: int, rank: int) -> torch.Tensor:
    """AwkwardNet's loss on `batch(step, rank)`: fn(x, use_branch) is the model, wrapped or not."""
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(fn(x, uses_branch(step, rank)).float().reshape(-1, VOCAB), y.reshape(-1))


def decay_groups(model: nn.Module) -> list[dict]:
    """The trainable parameters as two groups, decay (matrices) and no decay (vectors)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class TinyNet(nn.Module):
    """Rows of 7 and 13 elements that no chunk or partition size divides (7x13, 13x5): pieces cut rows,
    so DeepSpeed partitions, shardopt chunks and DCP boxes all split parameters (test_interop_*)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.l2 = nn.Linear(13, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", torch.zeros(5))

    def forward(self, x):
        return self.frozen(self.l2(self.norm(torch.relu(self.l1(x))))) + self.shift


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class StackNet(nn.Module):
    """What stage 3 meets in real models: blocks in a ModuleList (each gathered on its own), a head tied to
    the embedding (used first and last), a frozen layer, and experts that only some ranks reach in a step
    (an MoE whose router sent no token of this rank to an expert) - each rank skips a module another runs.
    """

    def __init__(self, depth: int = 4, experts: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, expert: int | None = None, checkpoint: bool = False):
        h = self.emb(x)
        for blk in self.blocks:
            h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False) if checkpoint else blk(h)
        h = self.frozen(h)
        if expert is not None:
            h = h + self.experts[expert](h)
        return self.head(self.norm(h))


def expert_of(step: int, rank: int, experts: int = 2) -> int | None:
    # Rank r reaches expert (step + r) % experts on most steps, none on every third: in a step each
    # expert is run by some ranks and skipped by others, and on some steps by no rank at all.
    return None if step % 3 == 2 else (step + rank) % experts
