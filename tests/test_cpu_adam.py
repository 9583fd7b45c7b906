"""shardopt.CPUAdam and the shardopt::adam_step op against the reference and torch.optim.

Two kinds of comparison:
- against shardopt.reference.adam_step_reference: bitwise. The reference does
  the kernel's fp32 operations in the kernel's order, each correctly rounded
  (Note [Adam operation order] in csrc/adam/adam_element.h), so any difference
  is a bug, not rounding.
- against torch.optim.Adam / AdamW: torch's run in float64 (exact, for fp32's purposes), every element
  within the bound that fp32 rounding puts on any correct implementation of the same steps, propagated
  step by step (ExactAdam: derived from the operations, not measured on one machine; torch's own fp32 run
  stays within it too). Our side is the same bits on every SIMD variant (test_isa.py) and the fp64 run
  differs between CPUs by ~1e-16, so neither the comparison nor the bar depends on the CPU.
"""
import copy
import math

import pytest
import torch

import shardopt
from shardopt.cpu_adam import fused_adam_step
from shardopt.reference import adam_step_reference

# Odd sizes on purpose: 0 (no work), 1, 7/15/17 (vector tails only, or body +
# tail, for 8- and 16-wide vectors), 8/16 (exact vector widths), 1023 (many
# vectors + a 15-element tail), 100k (several threads' worth of work).
SIZES = [0, 1, 7, 8, 15, 16, 17, 1023, 100_000]
STEPS = 55
# Run again under every other variant this CPU runs (tests/test_isa_variants.py).
pytestmark = pytest.mark.isa_kernels


def make_params(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def grads_for(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype, copy=True)  # float64 for ExactAdam's params


def torch_optimizer(adamw, params, **kw):
    return (torch.optim.AdamW if adamw else torch.optim.Adam)(params, foreach=False, **kw)


ULP = 2.0 ** -23  # an fp32 ulp is at most this times the value; each rounding below counts one ulp (half is the most)


class ExactAdam:
    """torch.optim.Adam / AdamW on float64 twins of the params (``.params``; grads cast to float64), and, per
    element, a bound on how far any correct float32 implementation of the same steps can end from it.

    Each float32 operation rounds once (counted as one ulp of its result, where half is the most). One step
    from float32 state (p, m, v) with gradient g (and g + l2 * p for Adam's L2), with M = b1 |m| + (1 - b1) |g|
    and V = b2 v + (1 - b2) g^2 the sizes of the moments' terms (nothing cancels in v; m can):
        m' = b1 m + (1 - b1) g          4 roundings (both products, the sum, and g's)  -> 4 ulp * M
        v' = b2 v + (1 - b2) g g        6 (three products, the sum, g's twice)         -> 6 ulp * V
        d  = sqrt(v') / sqrt(bc2) + eps   v''s error through the root, then 3 roundings (sqrt, counted twice
                                        as a vectorised sqrt may be an ulp off, the division, + eps) -> 4 ulp * d
        p' = p (1 - lr wd) - (lr / bc1) m' / d      the decay (AdamW: the fp32 coefficient and the product, 2 ulp
                                        of p), the product and quotient (2 ulp of the update), m''s and d's error
                                        through the quotient, the subtraction (1 ulp of p')
    and the errors carried from earlier steps: m's decays by b1 and v's by b2 per step, p's stays (times the
    decay), and an error in p reaches g through Adam's L2 term. Adding these up along the float64 trajectory
    gives the bound; it is rigorous to first order (a product of two errors is ~2^-46), and worst-case: the
    roundings of real runs partly cancel, so they stay well inside it (after 55 steps ours and torch's fp32
    are at 5-12% of it, on AVX2 and scalar kernels, torch's vectorised and default paths), yet an lr 3e-5 off
    or a beta2 of 0.9995 for 0.999 is outside it.
    Hyper-parameters, param groups, schedulers (the lr is read at each step), params without a gradient and
    groups added later are torch's own: this wraps a torch optimizer through its step hooks.
    """

    def __init__(self, adamw, params, **kw):
        def twin(p):
            return torch.nn.Parameter(p.detach().double())

        if isinstance(params[0], dict):
            params = [dict(g, params=[twin(p) for p in g["params"]]) for g in params]
            self.params = [p for g in params for p in g["params"]]
        else:
            params = self.params = [twin(p) for p in params]
        self.adamw = adamw
        self.opt = torch_optimizer(adamw, params, **kw)
        self.bounds = {}  # param -> [bound on p, on exp_avg, on exp_avg_sq], float64 tensors
        self.opt.register_step_pre_hook(self._before)
        self.opt.register_step_post_hook(self._after)

    def step(self):
        self.opt.step()

    def add_param_group(self, group):
        twins = [torch.nn.Parameter(p.detach().double()) for p in group["params"]]
        self.params += twins
        self.opt.add_param_group(dict(group, params=twins))

    def _before(self, opt, args, kwargs):
        self._old = {}
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    st = opt.state.get(p, {})
                    z = torch.zeros_like(p)
                    self._old[p] = (p.detach().clone(), p.grad.clone(), st.get("exp_avg", z).clone(),
                                    st.get("exp_avg_sq", z).clone())

    def _after(self, opt, args, kwargs):
        # One thread: these are many small element-wise ops, and on a busy 2-core machine two OpenMP threads
        # wait for each other at every one of them (the file took 3-10x longer).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._bound_step(opt)
        finally:
            torch.set_num_threads(threads)

    def _bound_step(self, opt):
        for g in opt.param_groups:
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            l2 = 0.0 if self.adamw else wd
            for p in g["params"]:
                if p not in self._old:
                    continue
                # The bounds in float32 (they need a few digits, not 53 bits, and this is 4x less work).
                p0, grad, m0, v0 = (t.float() for t in self._old[p])
                st = opt.state[p]
                step = int(st["step"])
                bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
                bp, bm, bv = self.bounds.get(p, [torch.zeros_like(p0)] * 3)
                pabs = p0.abs()
                gabs = grad.abs()
                if l2:  # g + l2 p: its terms, the sum's rounding and p's carried error
                    gabs += l2 * pabs
                    bg = (2 * ULP * l2) * pabs + l2 * bp
                    bm = b1 * bm + (1 - b1) * bg
                    bv = b2 * bv + (1 - b2) * (2 * gabs + bg) * bg
                else:
                    bm, bv = b1 * bm, b2 * bv
                bm += (4 * ULP) * (b1 * m0.abs() + (1 - b1) * gabs)
                bv += (6 * ULP) * (b2 * v0 + (1 - b2) * gabs.square())
                m, v, pn = st["exp_avg"].float(), st["exp_avg_sq"].float(), p.detach().float()
                mabs, root = m.abs(), v.sqrt()
                d = root / math.sqrt(bc2) + eps
                # |sqrt(a) - sqrt(b)| <= |a - b| / sqrt(a), and <= sqrt(|a - b|) (where v = 0)
                bd = torch.where(v > 0, bv / root.clamp_min(1e-30), bv.sqrt()) / math.sqrt(bc2) + (4 * ULP) * d
                low = torch.maximum(d - bd, d * 0.5)  # d's least value (bd is ~1e-6 of d: the 0.5 never binds)
                bupdate = (lr / bc1) * ((bm + mabs * bd / low) / low + (2 * ULP) * mabs / d)
                if self.adamw:
                    bp = (1 - lr * wd) * bp + (2 * ULP) * pabs
                bp = bp + ULP * pn.abs() + bupdate
                self.bounds[p] = [bp, bm, bv]


def assert_within_bound(ours, exact, bounds, what="params"):
    """Every element of each float32 tensor within its bound of the float64 one."""
    for i, (a, b, bound) in enumerate(zip(ours, exact, bounds)):
        over = (a.double() - b.detach()).abs() - bound.double()
        assert not (over > 0).any(), (
            f"{what}[{i}] ({a.numel()} elements): {int((over > 0).sum())} outside the fp32 rounding bound, "
            f"worst {(a.double() - b.detach()).abs().max().item():.3e} against "
            f"{bound.flatten()[over.flatten().argmax()].item():.3e}")


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_reference_bitwise(adamw, weight_decay, bias_correction):
    params = make_params(SIZES)
    ref = [p.detach().clone() for p in params]
    ref_m = [torch.zeros_like(p) for p in ref]
    ref_v = [torch.zeros_like(p) for p in ref]
    opt = shardopt.CPUAdam(params, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay,
                           adamw=adamw, bias_correction=bias_correction)
    for step in range(1, STEPS + 1):
        grads = grads_for(params, step)
        set_grads(params, grads)
        opt.step()
        for p, g, m, v in zip(ref, grads, ref_m, ref_v):
            adam_step_reference(p, g, m, v, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay,
                                adamw=adamw, step=step, bias_correction=bias_correction)
    for p, r, m, v in zip(params, ref, ref_m, ref_v):
        assert torch.equal(p.detach(), r)
        assert torch.equal(opt.state[p]["exp_avg"], m)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert opt.state[p]["step"].item() == STEPS
    # The update must have moved every non-empty param (guards against a no-op kernel).
    assert all(not torch.equal(p.detach(), q) for p, q in zip(params, make_params(SIZES)) if p.numel())


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_matches_torch_optim(adamw, weight_decay):
    # Ours and torch's own float32 run, each within fp32 rounding of torch's float64 run (ExactAdam).
    ours, theirs = make_params(SIZES), make_params(SIZES)
    opt = shardopt.CPUAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw=adamw)
    torch32 = torch_optimizer(adamw, theirs, lr=1e-2, weight_decay=weight_decay)
    exact = ExactAdam(adamw, make_params(SIZES), lr=1e-2, weight_decay=weight_decay)
    for step in range(1, STEPS + 1):
        grads = grads_for(ours, step)
        set_grads(ours, grads), set_grads(theirs, grads), set_grads(exact.params, grads)
        opt.step(), torch32.step(), exact.step()
    for run, o in ((ours, opt), (theirs, torch32)):
        for k, key in enumerate(("params", "exp_avg", "exp_avg_sq")):
            got = [p.detach() if k == 0 else o.state[p][key] for p in run]
            want = [p if k == 0 else exact.opt.state[p][key] for p in exact.params]
            assert_within_bound(got, want, [exact.bounds[p][k] for p in exact.params], key)


def _groups(params):
    return [
        {"params": params[:3]},
        {"params": params[3:6], "lr": 3e-3, "betas": (0.5, 0.9), "weight_decay": 0.2},
        {"params": params[6:], "lr": 2e-2, "eps": 1e-4, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("adamw", [True, False])
def test_param_groups_and_schedulers_match_torch(adamw):
    ours = make_params(SIZES, seed=3)
    opt = shardopt.CPUAdam(_groups(ours), lr=1e-2, weight_decay=0.01, adamw=adamw)
    exact = ExactAdam(adamw, _groups(make_params(SIZES, seed=3)), lr=1e-2, weight_decay=0.01)
    ref = exact.opt
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (opt, ref)]
    lambdas = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref)]
    for step in range(1, STEPS + 1):
        grads = grads_for(ours, step)
        set_grads(ours, grads), set_grads(exact.params, grads)
        opt.step(), exact.step()
        for s in scheds + lambdas:
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert opt.param_groups[0]["lr"] < 1e-2 / 10  # the schedulers really changed lr
    assert_within_bound([p.detach() for p in ours], exact.params, [exact.bounds[p][0] for p in exact.params])


def test_scheduled_lr_matches_reference_bitwise():
    # The lr a scheduler sets must reach the kernel on the very next step.
    (p,) = make_params([1023])
    ref, m, v = p.detach().clone(), torch.zeros(1023), torch.zeros(1023)
    opt = shardopt.CPUAdam([p], lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    for step in range(1, STEPS + 1):
        (g,) = grads_for([p], step)
        lr = opt.param_groups[0]["lr"]
        p.grad = g.clone()
        opt.step()
        sched.step()
        adam_step_reference(ref, g, m, v, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            adamw=True, step=step)
    assert torch.equal(p.detach(), ref)


def test_params_without_grad_are_skipped_like_torch():
    ours = make_params([5, 17, 33])
    opt = shardopt.CPUAdam(ours, lr=1e-2, weight_decay=0.01)
    exact = ExactAdam(True, make_params([5, 17, 33]), lr=1e-2, weight_decay=0.01)
    theirs = exact.params
    frozen = ours[1].detach().clone()
    for step in range(1, 21):
        grads = grads_for(ours, step)
        # param 1 never gets a grad; param 2 only on even steps, so the group
        # ends up holding params with different step counts.
        for i, (a, b) in enumerate(zip(ours, theirs)):
            has = i == 0 or (i == 2 and step % 2 == 0)
            a.grad = grads[i].clone() if has else None
            b.grad = grads[i].double() if has else None
        opt.step(), exact.step()
    assert torch.equal(ours[1].detach(), frozen)
    assert ours[1] not in opt.state
    assert opt.state[ours[0]]["step"].item() == 20 and opt.state[ours[2]]["step"].item() == 10
    assert_within_bound([ours[0].detach(), ours[2].detach()], [theirs[0], theirs[2]],
                        [exact.bounds[theirs[0]][0], exact.bounds[theirs[2]][0]])


def test_strided_grad_is_read_correctly():
    a, b = make_params([12]), make_params([12])
    a = [torch.nn.Parameter(a[0].detach().view(3, 4))]
    b = [torch.nn.Parameter(b[0].detach().view(3, 4))]
    opt_a, opt_b = shardopt.CPUAdam(a, lr=1e-2), shardopt.CPUAdam(b, lr=1e-2)
    g = torch.randn(4, 3)
    a[0].grad = g.t()  # same values, transposed strides
    b[0].grad = g.t().contiguous()
    assert not a[0].grad.is_contiguous()
    opt_a.step(), opt_b.step()
    assert torch.equal(a[0].detach(), b[0].detach())


def test_state_dict_uses_torch_keys_and_types():
    (p,) = make_params([17])
    opt = shardopt.CPUAdam([p])
    p.grad = torch.ones(17)
    opt.step()
    st = opt.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32 and st["step"].dim() == 0


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_round_trip_continues_identically(adamw, direction):
    """Train 10 steps with one optimizer, move its state to the other, train on.

    The continued run must stay within fp32 rounding (ExactAdam's bound, which holds for any correct fp32
    implementation, torch's included) of an uninterrupted float64 torch run.
    """
    sizes = [7, 1023, 16]
    first_cls = (lambda ps: torch_optimizer(adamw, _groups(ps), lr=1e-2, weight_decay=0.05)) \
        if direction == "torch_to_ours" else \
        (lambda ps: shardopt.CPUAdam(_groups(ps), lr=1e-2, weight_decay=0.05, adamw=adamw))
    second_cls = (lambda ps: shardopt.CPUAdam(_groups(ps), lr=1e-2, weight_decay=0.05, adamw=adamw)) \
        if direction == "torch_to_ours" else \
        (lambda ps: torch_optimizer(adamw, _groups(ps), lr=1e-2, weight_decay=0.05))
    sizes = sizes * 3  # 9 params over the 3 groups of _groups
    params = make_params(sizes)
    first = first_cls(params)
    baseline = ExactAdam(adamw, _groups(make_params(sizes)), lr=1e-2, weight_decay=0.05)
    baseline_params = baseline.params
    for step in range(1, 11):
        grads = grads_for(params, step)
        set_grads(params, grads), set_grads(baseline_params, grads)
        first.step(), baseline.step()
    saved = copy.deepcopy(first.state_dict())
    second = second_cls(params)
    second.load_state_dict(saved)
    for p in params:
        assert second.state[p]["step"].item() == 10
    for step in range(11, 31):
        grads = grads_for(params, step)
        set_grads(params, grads), set_grads(baseline_params, grads)
        second.step(), baseline.step()
    assert_within_bound([p.detach() for p in params], baseline_params,
                        [baseline.bounds[p][0] for p in baseline_params])
    # And the saved state itself survives a second round trip unchanged.
    again = first_cls(make_params(sizes))
    again.load_state_dict(copy.deepcopy(second.state_dict()))
    for a, b in zip(again.state_dict()["state"].values(), second.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["step"].item() == b["step"].item()


def test_loading_adam_state_into_adamw_is_refused():
    params = make_params([4])
    torch_adam = torch.optim.Adam(params, lr=1e-3)  # decoupled_weight_decay=False
    params[0].grad = torch.ones(4)
    torch_adam.step()
    with pytest.raises(ValueError, match="decoupled_weight_decay=False.*adamw=True"):
        shardopt.CPUAdam(params, adamw=True).load_state_dict(torch_adam.state_dict())


def test_loading_amsgrad_state_is_refused():
    params = make_params([4])
    torch_adamw = torch.optim.AdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        shardopt.CPUAdam(params).load_state_dict(torch_adamw.state_dict())


@pytest.mark.parametrize("option,value", [("amsgrad", True), ("maximize", True), ("foreach", True),
                                          ("capturable", True), ("differentiable", True), ("fused", True)])
def test_refuses_torch_options(option, value):
    with pytest.raises(ValueError, match=f"{option}={value}"):
        shardopt.CPUAdam(make_params([3]), **{option: value})
    with pytest.raises(ValueError, match=f"{option}={value}"):
        shardopt.CPUAdam([{"params": make_params([3]), option: value}])


def test_refuses_unknown_arguments_and_bad_hyper_parameters():
    with pytest.raises(TypeError, match="'momentum'"):
        shardopt.CPUAdam(make_params([3]), momentum=0.9)
    for kw, word in [({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas"), ({"eps": -1.0}, "eps"),
                     ({"weight_decay": -0.1}, "weight_decay")]:
        with pytest.raises(ValueError, match=word):
            shardopt.CPUAdam(make_params([3]), **kw)


def _two_groups(bad):
    return [{"params": make_params([2, 3])}, {"params": make_params([4, 5]) + [bad]}]


NAME = r"param_groups\[1\]\['params'\]\[2\] \(shape "


@pytest.mark.parametrize("bad,exc,shape", [
    (torch.nn.Parameter(torch.zeros(2, 3, device="meta")), ValueError, r"\(2, 3\)"),   # not on the CPU
    (torch.nn.Parameter(torch.zeros(6, dtype=torch.float64)), TypeError, r"\(6,\)"),
    (torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16)), TypeError, r"\(6,\)"),
    (torch.nn.Parameter(torch.zeros(3, 4).t()), ValueError, r"\(4, 3\)"),              # not contiguous
])
def test_bad_params_are_named(bad, exc, shape):
    with pytest.raises(exc, match=NAME + shape):
        shardopt.CPUAdam(_two_groups(bad))


def test_sparse_grad_is_named():
    groups = _two_groups(torch.nn.Parameter(torch.zeros(6)))
    opt = shardopt.CPUAdam(groups)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    groups[1]["params"][2].grad = torch.zeros(6).to_sparse()
    with pytest.raises(TypeError, match=NAME + r"\(6,\).*sparse"):
        opt.step()


def test_param_made_non_contiguous_after_construction_is_named():
    groups = _two_groups(torch.nn.Parameter(torch.zeros(3, 4)))
    opt = shardopt.CPUAdam(groups)
    for g in opt.param_groups:
        for q in g["params"]:
            q.grad = torch.ones_like(q)
    opt.step()
    p = groups[1]["params"][2]
    p.data = torch.zeros(4, 3).t()
    p.grad = torch.zeros(3, 4)
    before = [q.detach().clone() for q in groups[1]["params"]]
    with pytest.raises(ValueError, match=NAME + r"\(3, 4\).*not contiguous"):
        opt.step()
    # A refused step changes nothing: not the params, not the step counters.
    assert all(torch.equal(q.detach(), b) for q, b in zip(groups[1]["params"], before))
    assert all(opt.state[q]["step"].item() == 1 for q in groups[1]["params"])


def test_state_shape_mismatch_is_named():
    params = make_params([2, 3, 4])
    donor = shardopt.CPUAdam(make_params([2, 3, 5]))  # last state has 5 elements, not 4
    for p in donor.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    donor.step()
    opt = shardopt.CPUAdam(params)
    opt.load_state_dict(donor.state_dict())
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] \(shape \(4,\)\).*exp_avg"):
        opt.step()


def test_bad_step_state_is_named():
    params = make_params([2, 3])
    opt = shardopt.CPUAdam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.state[params[1]]["step"] = torch.tensor(1.0, dtype=torch.float64)
    before = opt.state[params[0]]["step"].item()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(3,\)\).*'step'"):
        opt.step()
    assert opt.state[params[0]]["step"].item() == before


def _op_args(n, **over):
    t = [torch.randn(n) for _ in range(4)]
    args = dict(params=[t[0]], grads=[t[1]], exp_avgs=[t[2]], exp_avg_sqs=[t[3].abs()])
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    ({"exp_avgs": [torch.zeros(10, 2).t()]}, r"exp_avgs\[0\] must be contiguous"),
    ({"grads": [torch.zeros(19)]}, r"grads\[0\] has 19 elements"),
    ({"exp_avg_sqs": [torch.zeros(20, dtype=torch.float64)]}, r"exp_avg_sqs\[0\] must be float32"),
    # A sparse tensor never reaches our kernel: the dispatcher refuses it by backend.
    ({"grads": [torch.zeros(20).to_sparse()]}, r"'shardopt::adam_step' with arguments from the 'SparseCPU'"),
    ({"grads": []}, "same length"),
])
def test_op_checks_name_the_tensor(over, match):
    a = _op_args(20, **over)
    with pytest.raises(RuntimeError, match=match):
        fused_adam_step(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, step=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 17, 1023, 100_000])
def test_low_precision_copy_equals_param_to_dtype(dtype, n):
    a = _op_args(n)
    out = [torch.full((n,), 7.0, dtype=dtype)]
    for step in range(1, 4):
        fused_adam_step(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], lr=0.5, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, step=step, lowp_out=out)
        assert torch.equal(out[0], a["params"][0].to(dtype))


def test_low_precision_copy_leaves_fp32_results_unchanged():
    a, b = _op_args(1023), _op_args(1023)
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=False, step=3)
    fused_adam_step(*a.values(), **kw)
    fused_adam_step(*b.values(), lowp_out=[torch.empty(1023, dtype=torch.bfloat16)], **kw)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a.values(), b.values()))


@pytest.mark.parametrize("threads", [1, 2])
def test_stream_limit_moves_all_28_bytes(threads):
    # The benchmark's bandwidth limit must really read 4 and write 3 arrays,
    # across tensor boundaries: p <- v, m <- p, v <- m + g. It shares the
    # one-pass split with adam_step (multi_tensor.h), so this also checks that
    # split covers every element exactly once (twice would undo the rotation):
    # empty tensors, sizes off multiples of 16, thread ranges cutting tensors.
    odd = torch.randint(1, 3000, (120,), generator=torch.Generator().manual_seed(0))
    sizes = [0, 5, 70_001, 33, 0] + odd.tolist()
    p, g, m, v = ([torch.randn(n) for n in sizes] for _ in range(4))
    want = ([x.clone() for x in v], [x.clone() for x in p], [a + b for a, b in zip(m, g)])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        torch.ops.shardopt.stream_limit(p, g, m, v)
    finally:
        torch.set_num_threads(old)
    for got, exp in zip((p, m, v), want):
        assert all(torch.equal(a, b) for a, b in zip(got, exp))


def test_opcheck():
    a = _op_args(33)
    for lowp in ([], [torch.empty(33, dtype=torch.bfloat16)]):
        torch.library.opcheck(torch.ops.shardopt.adam_step.default,
                              (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], lowp,
                               1e-3, 0.9, 0.999, 1e-8, 0.01, True, 2.0, True))
    torch.library.opcheck(torch.ops.shardopt.stream_limit.default,
                          (a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"]))


def test_thread_count_does_not_change_results():
    # One parallel pass splits the work differently with 1 and 2 threads; the
    # result must not depend on it.
    sizes = [70_001, 3, 70_003, 70_005]
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            params = make_params(sizes)
            opt = shardopt.CPUAdam(params, lr=1e-2, weight_decay=0.1)
            for step in range(1, 4):
                set_grads(params, grads_for(params, step))
                opt.step()
            results.append([p.detach() for p in params])
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bias_correction_in_double():
    # At step 1e4 with beta2 = 0.9999, 1 - beta2**step in fp32 loses digits;
    # the kernel must agree with the double-precision formula.
    p, g = torch.tensor([1.0]), torch.tensor([0.5])
    m, v = torch.tensor([0.2]), torch.tensor([0.04])
    fused_adam_step([p], [g], [m], [v], lr=1e-3, beta1=0.9, beta2=0.9999, eps=0.0, weight_decay=0.0,
                    adamw=True, step=10_000)
    bc1, bc2 = 1 - 0.9 ** 10_000, 1 - 0.9999 ** 10_000
    m64, v64 = 0.2 * 0.9 + 0.5 * 0.1, 0.04 * 0.9999 + 0.25 * 1e-4
    want = 1.0 - 1e-3 / bc1 * m64 / (math.sqrt(v64) / math.sqrt(bc2))
    assert p.item() == pytest.approx(want, rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_copies_equal_param_cast_after_each_step(dtype):
    # Several groups, odd sizes, a param that skips steps (its copy must stay
    # as it was), copies of another shape than their param (only numel must
    # match), and a param without a copy; the fp32 results stay bitwise the
    # reference's.
    params = make_params(SIZES, seed=5)
    opt = shardopt.CPUAdam(_groups(params), lr=1e-2, weight_decay=0.1)
    ref = [p.detach().clone() for p in params]
    ref_m, ref_v = [torch.zeros_like(p) for p in ref], [torch.zeros_like(p) for p in ref]
    hypers = [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
              dict(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-8, weight_decay=0.2),
              dict(lr=2e-2, beta1=0.9, beta2=0.999, eps=1e-4, weight_decay=0.0)]
    group_of = [0] * 3 + [1] * 3 + [2] * 3
    copies = {i: torch.full((n, 1), 7.0, dtype=dtype) for i, n in enumerate(SIZES) if i != 4}
    opt.set_lowp_copies((params[i], c) for i, c in copies.items())
    steps = [0] * len(params)
    for step in range(1, 8):
        grads = grads_for(params, step)
        for i, (p, g) in enumerate(zip(params, grads)):
            skip = i == 7 and step % 3 == 0
            p.grad = None if skip else g.clone()
            if not skip:
                steps[i] += 1
                adam_step_reference(ref[i], g, ref_m[i], ref_v[i], adamw=True, step=steps[i],
                                    **hypers[group_of[i]])
        opt.step()
        for i, p in enumerate(params):
            assert torch.equal(p.detach(), ref[i])
            if i in copies:
                assert torch.equal(copies[i].view(-1), p.detach().to(dtype)), (i, step)
    # Cleared: later steps leave the copies alone.
    frozen = {i: c.clone() for i, c in copies.items()}
    opt.set_lowp_copies(())
    set_grads(params, grads_for(params, 99))
    opt.step()
    assert all(torch.equal(copies[i], frozen[i]) for i in copies)
    assert not torch.equal(params[8].detach().to(dtype), frozen[8].view(-1))


def test_set_lowp_copies_refuses_bad_copies_naming_the_param():
    params = make_params([2, 3, 4])
    opt = shardopt.CPUAdam([{"params": params[:1]}, {"params": params[1:]}])
    name = r"param_groups\[1\]\['params'\]\[1\] \(shape \(4,\)\)"
    bf16 = torch.bfloat16
    for bad, exc, why in [
        (torch.zeros(4), TypeError, "dtype torch.float32"),
        (torch.zeros(5, dtype=bf16), ValueError, "5 elements"),
        (torch.zeros(2, 4, dtype=bf16)[:, :2], ValueError, "not a contiguous"),
        (torch.zeros(4, dtype=bf16, device="meta"), ValueError, "on meta"),
        ("x", TypeError, "must be a tensor"),
    ]:
        with pytest.raises(exc, match=name + ".*" + why):
            opt.set_lowp_copies([(params[0], torch.zeros(2, dtype=bf16)), (params[2], bad)])
    with pytest.raises(ValueError, match="not one of this optimizer's params"):
        opt.set_lowp_copies([(torch.nn.Parameter(torch.zeros(4)), torch.zeros(4, dtype=bf16))])
    with pytest.raises(ValueError, match="given twice"):
        opt.set_lowp_copies([(params[1], torch.zeros(3, dtype=bf16))] * 2)
    with pytest.raises(TypeError, match="item 0 is not a"):
        opt.set_lowp_copies([params[1]])


def test_lowp_copy_broken_after_registration_is_named_and_changes_nothing():
    params = make_params([5, 6])
    opt = shardopt.CPUAdam(params, lr=1e-2)
    copy_ = torch.zeros(6, dtype=torch.float16)
    opt.set_lowp_copies([(params[1], copy_)])
    set_grads(params, grads_for(params, 1))
    opt.step()
    before = [p.detach().clone() for p in params]
    copy_.resize_(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(6,\)\).*3 elements"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(opt.state[p]["step"].item() == 1 for p in params)


def test_step_is_an_in_place_update_autograd_can_see():
    # As with torch.optim.AdamW: backward through a graph that saved a param
    # before the step must fail loudly, not use the updated values.
    (p,) = make_params([8])
    opt = shardopt.CPUAdam([p], lr=1e-2)
    p.grad = torch.ones(8)
    loss = (p * p).sum()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_grads_replaced_every_step_and_new_params_are_seen():
    # Nothing about grads or state is cached between steps: new grad tensors
    # (zero_grad(set_to_none=True) + backward), a param getting its first grad
    # late, and a group added later all take part, as in torch.
    ours, theirs = make_params([33, 7, 1023]), make_params([33, 7, 1023])
    extra_ours, extra_theirs = make_params([17], seed=9), make_params([17], seed=9)
    opt = shardopt.CPUAdam(ours[:2], lr=1e-2, weight_decay=0.05)
    ref = ExactAdam(True, theirs[:2], lr=1e-2, weight_decay=0.05)
    for step in range(1, 13):
        if step == 5:
            opt.add_param_group({"params": ours[2:] + extra_ours, "lr": 3e-3})
            ref.add_param_group({"params": theirs[2:] + extra_theirs, "lr": 3e-3})
        theirs_now = ref.params
        opt.zero_grad(), ref.opt.zero_grad()
        allp = ours + extra_ours
        grads = grads_for(allp, step)
        for i, (a, b) in enumerate(zip(allp, theirs_now)):
            if i == 1 and step < 3:
                continue  # param 1 has no grad for its first two steps
            a.grad, b.grad = grads[i].clone(), grads[i].double()
        opt.step(), ref.step()
    assert_within_bound([p.detach() for p in allp], ref.params, [ref.bounds[p][0] for p in ref.params])
    assert opt.state[ours[1]]["step"].item() == 10 and opt.state[ours[2]]["step"].item() == 8


def test_lowp_copies_follow_param_group_changes():
    # The copies are matched to params by identity, so a group added later
    # (without copies) and a param appended to a group keep working.
    a, b, c = make_params([9, 10, 11])
    opt = shardopt.CPUAdam([a], lr=1e-2)
    copy_a, copy_c = torch.zeros(9, dtype=torch.bfloat16), torch.zeros(11, dtype=torch.float16)
    opt.set_lowp_copies([(a, copy_a)])
    opt.add_param_group({"params": [b]})
    for step in range(1, 4):
        if step == 2:
            opt.param_groups[0]["params"].append(c)
            opt.set_lowp_copies([(a, copy_a), (c, copy_c)])
        set_grads([a, b, c], grads_for([a, b, c], step))
        opt.step()
        assert torch.equal(copy_a, a.detach().to(torch.bfloat16))
    assert torch.equal(copy_c, c.detach().to(torch.float16))
    assert opt.state[c]["step"].item() == 2 and opt.state[b]["step"].item() == 3
