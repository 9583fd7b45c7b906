"""A few seeds of tests/fuzz_parity.py (the randomised parity run), so that the harness keeps working and the
configurations where it found bugs stay covered. Run many more by hand: see that file's docstring."""
import pytest

import fuzz_parity

# train 0 and 152: 2 nodes x 2 ranks (node-aware, hybrid) with gloo's own reduce-scatter (Note [gloo's
# reduce-scatter copies on every wait]; tests/test_hybrid.py has the cases that failed); 210: stage 3 at 3 ranks,
# one taking a branch the others skip, room for one bucket (Note [Stage-3 schedule]): hung before its fix.
@pytest.mark.parametrize("seed", [0, 152, 210])
def test_training_matches_ddp(seed):
    spec = fuzz_parity.draw_train(seed)
    status, fails = fuzz_parity.check_train(spec)
    assert status == "ok", (spec, fails)


# resume 0 and 5: through the consolidated torch.optim state dict, at another world size and stage.
@pytest.mark.parametrize("seed", [0, 5])
def test_resume_matches_one_process(seed):
    spec = fuzz_parity.draw_resume(seed)
    status, fails = fuzz_parity.check_resume(spec)
    assert status == "ok", (spec, fails)


# precision 127: fp16, the first steps overflow, model.zero_grad() and a parameter without a gradient: every
# step after the first overflow was skipped (Note [A cleared gradient forgets its inf]); 69: bf16, stage 3 on a
# hybrid 2 x 2 mesh with CPUAdam and shardopt's own clipping.
@pytest.mark.parametrize("seed", [127, 69])
def test_mixed_precision_matches_fp32_masters(seed):
    spec = fuzz_parity.draw_precision(seed)
    status, fails = fuzz_parity.check_precision(spec)
    assert status == "ok", (spec, fails)
