"""shardopt.CPUAdam: a drop-in torch.optim optimizer backed by the fused C++ kernel.

Also ``fused_adam_step``, the thin Python entry to the ``shardopt::adam_step`` op
that CPUAdam and the ZeRO offload path (flat fp32 chunks, one call per group)
share.
"""
import torch

from shardopt import _ops  # noqa: F401  (fake implementations of the ops)
from shardopt._ext import _C

# torch.optim.Adam/AdamW options this optimizer does not implement, with the
# value that means "off". Passing anything else is refused rather than ignored.
_TORCH_ONLY_OPTIONS = {
    "amsgrad": (False,),
    "maximize": (False,),
    "foreach": (None, False),
    "capturable": (False,),
    "differentiable": (False,),
    "fused": (None, False),
}


def fused_adam_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, adamw,
                    step, bias_correction=True, lowp_out=None):
    """One fused Adam/AdamW step over lists of contiguous fp32 CPU tensors, in place.

    ``step`` counts the step being taken (1 for the first) and is shared by all
    tensors. ``lowp_out``, if given, is one bf16 or fp16 tensor per param that
    receives a copy of the updated param in the same pass. All tensors are
    updated in one parallel pass (Note [One parallel pass over all tensors] in
    csrc/adam/multi_tensor.h).
    """
    torch.ops.shardopt.adam_step(params, grads, exp_avgs, exp_avg_sqs, list(lowp_out or []), float(lr),
                                 float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
                                 float(step), bool(bias_correction))


def _describe(gi, pi, t):
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(t.shape)})"


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw=False``, L2 weight decay) or AdamW (``adamw=True``, decoupled decay) for fp32 CPU params.

    Same update and state as torch.optim.Adam / AdamW (state keys ``step``,
    ``exp_avg``, ``exp_avg_sq``, ``step`` a float32 scalar tensor), so state
    dicts move between them in either direction. ``bias_correction=False``
    skips Adam's bias corrections (torch has no such option). Note that
    ``weight_decay`` defaults to 0, as in torch.optim.Adam, while
    torch.optim.AdamW defaults to 0.01. Parameters of a
    group whose grads are not None and that share a step count are updated by
    one kernel call.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                 bias_correction=True, **torch_options):
        _refuse_torch_options(torch_options, where="CPUAdam()")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=bool(adamw),
                        bias_correction=bool(bias_correction))
        _check_hyper(defaults, where="CPUAdam()")
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        torch_options = {k: param_group[k] for k in _TORCH_ONLY_OPTIONS if k in param_group}
        _refuse_torch_options(torch_options, where="param group")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        _check_hyper(group, where=f"param_groups[{gi}]")
        for pi, p in enumerate(group["params"]):
            _check_param(gi, pi, p)

    def load_state_dict(self, state_dict):
        """Loads a state dict saved by CPUAdam or by torch.optim.Adam/AdamW.

        torch's groups carry options we do not implement; they are accepted only
        at their "off" values and then dropped. A saved ``decoupled_weight_decay``
        must match this optimizer's ``adamw`` (loading Adam state into an AdamW
        run, or the reverse, would silently change the update).
        """
        state_dict = dict(state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        groups = []
        for gi, (saved, ours) in enumerate(zip(saved_groups, self.param_groups)):
            saved = dict(saved)
            options = {k: saved.pop(k) for k in list(saved) if k in _TORCH_ONLY_OPTIONS}
            _refuse_torch_options(options, where=f"loaded param_groups[{gi}]")
            if "decoupled_weight_decay" in saved:
                decoupled = bool(saved.pop("decoupled_weight_decay"))
                if decoupled != ours["adamw"]:
                    raise ValueError(
                        f"loaded param_groups[{gi}] has decoupled_weight_decay={decoupled} (torch "
                        f"{'AdamW' if decoupled else 'Adam'} state) but this CPUAdam has adamw={ours['adamw']}")
            saved.setdefault("adamw", ours["adamw"])
            saved.setdefault("bias_correction", ours["bias_correction"])
            _check_hyper(saved, where=f"loaded param_groups[{gi}]")
            groups.append(saved)
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        # torch may have saved a Python number as step (very old versions) or
        # a float64 one; keep the float32 scalar tensor torch uses today.
        for st in self.state.values():
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _step_group(self, gi, group):
        # Note [Lean step loop]: with 200 small tensors, per-parameter Python
        # work is a real share of a step. The loop below only gathers tensors;
        # the op validates every tensor in C++ before touching any of them, and
        # only if it refuses do we walk the group again in Python to name the
        # offending parameter with a ValueError/TypeError.
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue  # as torch: a parameter without a gradient is not stepped at all
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v = state.get("exp_avg"), state.get("exp_avg_sq")
            if m is None or v is None or m.shape != p.shape or v.shape != p.shape:  # the op compares numel only
                self._diagnose(gi, group)
            g = p.grad
            params.append(p)
            if g.layout == torch.strided and not g.is_contiguous():
                g = g.contiguous()  # a strided grad is fine to read (a sparse one the op refuses)
            grads.append(g)
            exp_avgs.append(m)
            exp_avg_sqs.append(v)
            steps.append(state.get("step"))
        if not params:
            return
        try:
            step_values = _C.advance_steps(steps, 1.0)  # torch's `step += 1`, as one C++ call
        except (RuntimeError, TypeError):  # TypeError: a step that is not a tensor at all
            self._diagnose(gi, group)
            raise
        try:
            self._launch(gi, group, params, grads, exp_avgs, exp_avg_sqs, step_values)
        except Exception as e:
            _C.advance_steps(steps, -1.0)  # the op changed nothing; neither should the step
            if isinstance(e, RuntimeError):
                self._diagnose(gi, group)  # raises if it finds what the op refused
            raise

    def _launch(self, gi, group, params, grads, exp_avgs, exp_avg_sqs, step_values):
        # Normally every param of a group has the same step count; params added
        # or loaded at different times may not. One kernel call per count.
        by_step = {}
        for i, s in enumerate(step_values):
            by_step.setdefault(s, []).append(i)
        if len(by_step) > 1:
            # Validate all before the first call, so a bad tensor cannot leave
            # the group half stepped.
            self._diagnose(gi, group)
        beta1, beta2 = group["betas"]
        for step, idx in by_step.items():
            def pick(xs):
                return xs if len(idx) == len(xs) else [xs[i] for i in idx]
            fused_adam_step(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), lr=group["lr"],
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            adamw=group["adamw"], step=step, bias_correction=group["bias_correction"])

    def _diagnose(self, gi, group):
        """Raises a ValueError/TypeError naming the first parameter the kernel cannot take."""
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            _check_param(gi, pi, p)
            _check_grad(gi, pi, p)
            _check_state(gi, pi, p, self.state[p])


def _refuse_torch_options(options, where):
    for name, value in options.items():
        if name not in _TORCH_ONLY_OPTIONS:
            raise TypeError(f"{where}: unexpected argument {name!r}")
        if value not in _TORCH_ONLY_OPTIONS[name]:
            raise ValueError(f"{where}: {name}={value!r} is not supported by shardopt.CPUAdam "
                             f"(only {_TORCH_ONLY_OPTIONS[name][0]!r}); use torch.optim for it")


def _check_hyper(group, where):
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0.0:
        raise ValueError(f"{where}: invalid lr {lr} (must be >= 0)")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{where}: invalid betas {group['betas']} (each must be in [0, 1))")
    if not eps >= 0.0:
        raise ValueError(f"{where}: invalid eps {eps} (must be >= 0)")
    if not wd >= 0.0:
        raise ValueError(f"{where}: invalid weight_decay {wd} (must be >= 0)")


def _check_param(gi, pi, p):
    if p.device.type != "cpu":
        raise ValueError(f"{_describe(gi, pi, p)} is on {p.device}; CPUAdam needs CPU tensors")
    if p.dtype != torch.float32:
        raise TypeError(f"{_describe(gi, pi, p)} has dtype {p.dtype}; CPUAdam needs torch.float32")
    if p.layout != torch.strided:
        raise TypeError(f"{_describe(gi, pi, p)} has layout {p.layout}; CPUAdam needs dense tensors")
    if not p.is_contiguous():
        raise ValueError(f"{_describe(gi, pi, p)} is not contiguous; CPUAdam updates params in place "
                         "as flat memory")


def _check_grad(gi, pi, p):
    g = p.grad
    if g.is_sparse or g.layout != torch.strided:
        raise TypeError(f"{_describe(gi, pi, p)} has a sparse gradient; CPUAdam does not support sparse "
                        "gradients (torch.optim.SparseAdam does)")
    if g.device.type != "cpu":
        raise ValueError(f"{_describe(gi, pi, p)}: gradient is on {g.device}; CPUAdam needs CPU tensors")
    if g.dtype != torch.float32:
        raise TypeError(f"{_describe(gi, pi, p)}: gradient has dtype {g.dtype}; CPUAdam needs torch.float32")
    if g.shape != p.shape:
        raise ValueError(f"{_describe(gi, pi, p)}: gradient has shape {tuple(g.shape)}")


def _check_state(gi, pi, p, state):
    step = state.get("step")
    if not (torch.is_tensor(step) and step.numel() == 1 and step.dtype == torch.float32
            and step.device.type == "cpu"):
        raise TypeError(f"{_describe(gi, pi, p)}: state 'step' must be a float32 CPU scalar tensor, got "
                        f"{step!r}")
    for key in ("exp_avg", "exp_avg_sq"):
        t = state.get(key)
        if t is None:
            raise ValueError(f"{_describe(gi, pi, p)}: optimizer state has no {key!r}")
        if t.shape != p.shape:
            raise ValueError(f"{_describe(gi, pi, p)}: state {key!r} has shape {tuple(t.shape)}")
        if t.device.type != "cpu":
            raise ValueError(f"{_describe(gi, pi, p)}: state {key!r} is on {t.device}")
        if t.dtype != torch.float32:
            raise TypeError(f"{_describe(gi, pi, p)}: state {key!r} has dtype {t.dtype}; CPUAdam needs "
                            "torch.float32")
        if not t.is_contiguous():
            raise ValueError(f"{_describe(gi, pi, p)}: state {key!r} is not contiguous")
