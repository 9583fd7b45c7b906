"""The fused int8 codec of the inter-node hop against its pure-PyTorch reference, bit for bit.

Note [Fused int8 codec] in csrc/comm/int8_codec.h defines what it computes;
shardopt.reference holds the same steps as composed torch ops. Every ISA variant
this CPU can run is forced in turn, at 1 and 2 threads, on inputs built to hit
the corners: ties of the rounding, values just past 127 steps, all-zero blocks,
a nan and an inf in a block, a block so small that 1 / scale overflows (its
zeros become 0 * inf = nan before rounding), -0.0, short last blocks, and
lengths that split blocks between threads.
"""
import contextlib

import pytest
import torch

import shardopt
from shardopt import _C
from shardopt.reference import (int8_block_decode_reference, int8_block_encode_reference, int8_decode_reference,
                                int8_encode_feedback_reference)

SUPPORTED = shardopt.cpu_features()["supported"]
# Run again under every other variant this CPU runs (tests/test_isa_variants.py).
pytestmark = pytest.mark.isa_kernels
BLOCK = 256
# 70_001: more than one task of at::parallel_for (128 blocks each) and a short last block.
SIZES = [0, 1, 7, 255, 256, 257, 1000, 4096 + 3, 70_001]


@contextlib.contextmanager
def forced(isa, threads):
    old = torch.get_num_threads()
    _C.set_isa_override(isa)
    torch.set_num_threads(threads)
    try:
        assert shardopt.cpu_features()["active"] == isa
        yield
    finally:
        _C.set_isa_override("")
        torch.set_num_threads(old)


def corner_blocks():
    """Blocks that each exercise one rule of the codec, with what the rule says where it is checkable."""
    ties = torch.zeros(BLOCK)
    ties[:8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5])  # scale exactly 1
    past = torch.full((BLOCK,), 1.0)
    past[0] = 3.0158066749572754  # the block's max, and max * (1 / scale) is just above 127 in fp32
    nan = torch.randn(BLOCK, generator=torch.Generator().manual_seed(1))
    nan[5] = float("nan")
    inf = torch.randn(BLOCK, generator=torch.Generator().manual_seed(2))
    inf[9] = -float("inf")
    tiny = torch.zeros(BLOCK)
    tiny[:3] = torch.tensor([1e-38, -0.5e-38, 2e-39])  # scale < 2^-128: 1 / scale is inf
    negzero = torch.full((BLOCK,), -0.0)
    negzero[0] = -1.0
    return {"ties": ties, "past": past, "nan": nan, "inf": inf, "tiny": tiny, "zeros": torch.zeros(BLOCK),
            "negzero": negzero}


def inputs():
    g = torch.Generator().manual_seed(0)
    for m in SIZES:
        # Blocks of very different magnitudes.
        yield f"random-{m}", torch.randn(m, generator=g) * torch.logspace(-6, 3, max(m, 1))[:m]
    blocks = corner_blocks()
    yield "corners", torch.cat(list(blocks.values()) + [torch.randn(100, generator=g)])


def same_bits(a, b):
    """Equal bit patterns, nan for nan (a nan's payload is not part of the contract)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    ints = {torch.float32: torch.int32, torch.int8: torch.int8}[a.dtype]
    return torch.equal(a[~an].view(ints), b[~bn].view(ints))


def split(payload, m):
    nb = -(-m // BLOCK)
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * nb + m
    return payload[:4 * nb].view(torch.float32), payload[4 * nb:].view(torch.int8)


def test_the_corners_mean_what_they_say():
    """The reference itself on the corner blocks: ties to even, clamping, nan -> 0, overflowed reciprocal.
    (If these change, the corners no longer test what their names say.)"""
    b = corner_blocks()
    scale, q = int8_block_encode_reference(b["ties"])
    assert scale.item() == 1.0 and q[:8].tolist() == [127, 0, 2, 2, 0, -2, 126, -4]
    scale, q = int8_block_encode_reference(b["past"])
    assert (b["past"][0] * (1 / scale)).item() > 127 and q[0].item() == 127
    scale, q = int8_block_encode_reference(b["tiny"])
    assert torch.isinf(1.0 / scale).all() and q[:4].tolist() == [127, -127, 127, 0]
    for name in ("nan", "inf"):
        scale, q = int8_block_encode_reference(b[name])
        assert not torch.isfinite(scale).any()
        assert not torch.isfinite(int8_block_decode_reference(scale, q)).any()  # the step's check sees it
    assert int8_block_encode_reference(b["zeros"])[1].abs().sum() == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", SUPPORTED)
def test_encode_and_decode_match_the_reference_bitwise(isa, threads):
    g = torch.Generator().manual_seed(3)
    with forced(isa, threads):
        for name, x in inputs():
            m = x.numel()
            # Plain encode, and the hop's path through it.
            want_scale, want_q = int8_block_encode_reference(x)
            for payload in (_C.int8_encode(x), _C.hop_encode(x, "int8")):
                scale, q = split(payload, m)
                assert same_bits(scale, want_scale), f"{isa} {name}: scales differ"
                assert same_bits(q, want_q), f"{isa} {name}: values differ"
            # With error feedback, and the decoded message written out (elsewhere, and over x).
            residual = torch.randn(m, generator=g) * 1e-3
            want_res = residual.clone()
            want_scale, want_q, want_dec = int8_encode_feedback_reference(x, want_res)
            decoded = torch.empty(m)
            scale, q = split(_C.int8_encode(x, residual, decoded), m)
            assert same_bits(scale, want_scale) and same_bits(q, want_q), f"{isa} {name}: feedback encode"
            assert same_bits(residual, want_res), f"{isa} {name}: residual differs"
            assert same_bits(decoded, want_dec), f"{isa} {name}: decoded differs"
            over = x.clone()
            _C.int8_encode(over, None, over)
            assert same_bits(over, int8_encode_feedback_reference(x)[2]), f"{isa} {name}: decoded over x"
            # Decode: written, added to another tensor, and added in place.
            payload = _C.int8_encode(x, residual)
            scale, q = split(payload, m)
            out = torch.full((m,), 7.0)
            _C.int8_decode(payload, out)
            assert same_bits(out, int8_decode_reference(scale, q, torch.empty(m))), f"{isa} {name}: decode"
            assert same_bits(_C.hop_decode(payload, "int8", m), out), f"{isa} {name}: hop_decode"
            base = torch.randn(m, generator=g)
            want = int8_decode_reference(scale, q, torch.empty(m), base)
            out = torch.full((m,), 7.0)
            _C.int8_decode(payload, out, base)
            assert same_bits(out, want), f"{isa} {name}: base + decoded differs"
            _C.int8_decode(payload, base, base)
            assert same_bits(base, want), f"{isa} {name}: decode-add in place differs"


def test_bad_arguments_are_refused_naming_the_problem():
    x = torch.randn(300)
    with pytest.raises(ValueError, match="float32"):
        _C.int8_encode(x.double())
    with pytest.raises(ValueError, match="residual has 299 elements"):
        _C.int8_encode(x, torch.zeros(299))
    with pytest.raises(ValueError, match="contiguous"):
        _C.int8_encode(torch.randn(600)[::2])
    with pytest.raises(ValueError, match="300 values has 308 bytes, got 307"):
        _C.int8_decode(torch.zeros(307, dtype=torch.uint8), torch.empty(300))
    with pytest.raises(ValueError, match="uint8"):
        _C.int8_decode(torch.zeros(308, dtype=torch.int8), torch.empty(300))
    with pytest.raises(ValueError, match="aligned"):
        _C.int8_decode(torch.zeros(309, dtype=torch.uint8)[1:], torch.empty(300))
    with pytest.raises(ValueError, match="base has 299 elements"):
        _C.int8_decode(torch.zeros(308, dtype=torch.uint8), torch.empty(300), torch.empty(299))


# ------------------------------------------------------------------ the hop is its reference composition
def _hop_against_reference(rank, world_size):
    """Every rank's hop result, and its residual after each hop, are the bits of
    shardopt.reference.int8_hop_reference computed here from every rank's inputs: the phase-1 sum
    in rank order whichever rank we are (the fused first addition included), fp32 and bf16 chunks."""
    import torch.distributed as dist

    from shardopt.reference import int8_hop_reference

    out = []
    group = dist.group.WORLD
    for dtype, m in ((torch.float32, 1000), (torch.bfloat16, 300), (torch.float32, 70_001)):
        n = m * world_size
        g = torch.Generator().manual_seed(1)  # the same on every rank: each builds everyone's inputs
        residual = torch.zeros(n + m)
        want_res = [torch.zeros(n + m) for _ in range(world_size)]
        for hop in range(3):
            chunks = [(torch.randn(n, generator=g) * torch.logspace(-4, 2, n)).to(dtype) for _ in range(world_size)]
            want = int8_hop_reference(chunks, want_res)
            got = chunks[rank].clone()
            _C.replica_all_reduce(group, got, "int8", residual).wait()
            if not same_bits(got.float(), want.float()):
                out.append(f"{dtype} m={m} hop {hop}: the chunk differs from the reference")
            if not same_bits(residual, want_res[rank]):
                out.append(f"{dtype} m={m} hop {hop}: the residual differs from the reference")
        got = chunks[rank].clone()
        _C.replica_all_reduce(group, got, "int8").wait()  # no residual: no feedback
        if not same_bits(got.float(), int8_hop_reference(chunks).float()):
            out.append(f"{dtype} m={m}: the hop without feedback differs from the reference")
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_hop_is_its_reference_composition(world_size):
    from dist_harness import run_ranks

    for rank, failures in enumerate(run_ranks(_hop_against_reference, world_size, timeout=180)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)
