"""A small GPT-like model for the demo, benchmarks and estimates (not a model zoo)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab: int = 4096  # the embedding is tied with the output head
    dim: int = 256  # width of the residual stream
    layers: int = 4
    heads: int = 4  # per block
    seq: int = 128  # maximum sequence length (learned positions)


PRESETS = {
    "tiny": GPTConfig(vocab=512, dim=64, layers=2, heads=2, seq=32),
    "small": GPTConfig(),                                                # ~4.3M parameters
    "30m": GPTConfig(vocab=8192, dim=512, layers=8, heads=8, seq=128),   # ~29.6M parameters
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = nn.MultiheadAttention(c.dim, c.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(), nn.Linear(4 * c.dim, c.dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's init: unit-variance embeddings tied to the head give logits of
        # size sqrt(dim) and a first loss far above log(vocab).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def init_weights(m: nn.Module) -> None:
    """GPT's init for one module: the module's own, then std 0.02 for Linear and Embedding weights.

    ShardedDDP's param_init_fn for a GPT built on the meta device at stage 3 (the same
    distribution as GPT(...)'s constructor; not the same values: the RNG runs in another order)."""
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)


def synthetic_batch(c: GPTConfig, batch: int, seq: int, step: int, rank: int):
    """Token sequences with learnable structure (next token = a fixed function of the current one)."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    start = torch.randint(0, c.vocab, (batch, 1), generator=g)
    idx = (start * 31 + 7 * torch.arange(seq + 1)) % c.vocab
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Factories for the command line (`shardopt estimate shardopt.tools.gpt:small_model`, `shardopt tune ...`).
def tiny_model() -> GPT:
    return GPT(PRESETS["tiny"])


def small_model() -> GPT:
    return GPT(PRESETS["small"])


def gpt_30m() -> GPT:
    return GPT(PRESETS["30m"])


def example_batch() -> torch.Tensor:
    """Token ids every preset accepts (the tiny preset's vocabulary and length): `shardopt tune`'s input."""
    return synthetic_batch(PRESETS["tiny"], 8, PRESETS["tiny"].seq, 0, 0)[0]
