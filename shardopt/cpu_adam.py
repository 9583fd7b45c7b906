"""shardopt.CPUAdam: a drop-in torch.optim optimizer backed by the fused C++ kernel, and ``fused_adam_step``,
the ``shardopt::adam_step`` op's entry (usable under torch.compile)."""
import torch

from shardopt import _ops  # noqa: F401  (fake implementations of the ops)
from shardopt._ext import _C

# torch.optim.Adam/AdamW options not implemented here, with their "off" values; any other value is refused.
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
    """One fused Adam/AdamW step over lists of contiguous fp32 CPU tensors, in place; ``step`` counts from 1,
    ``lowp_out``: per param a bf16/fp16 tensor written in the same pass (csrc/adam/multi_tensor.h)."""
    torch.ops.shardopt.adam_step(params, grads, exp_avgs, exp_avg_sqs, list(lowp_out or []), float(lr),
                                 float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
                                 float(step), bool(bias_correction))


def _describe(gi, pi, t):
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(t.shape)})"


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw=False``, L2 decay) or AdamW (decoupled decay) for fp32 CPU params, with torch.optim's
    update and state (state dicts move between them). ``weight_decay`` defaults to 0, as Adam's (AdamW's: 0.01);
    ``bias_correction=False`` skips the bias corrections.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                 bias_correction=True, **torch_options):
        _refuse_torch_options(torch_options, where="CPUAdam()")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=bool(adamw),
                        bias_correction=bool(bias_correction))
        _check_hyper(defaults, where="CPUAdam()")
        self._lowp = {}  # param -> its low-precision copy (set_lowp_copies)
        self._lowp_lists = {}  # group index -> (params list, its length, copies aligned with it or None)
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
        """Loads a state dict of CPUAdam or torch.optim.Adam/AdamW: torch's options only at their "off" values, a
        saved ``decoupled_weight_decay`` only equal to ``adamw`` (else the update would silently change)."""
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
        # A step saved as a Python number or float64 becomes torch's float32 scalar tensor.
        for st in self.state.values():
            if "step" in st:
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()

    def set_lowp_copies(self, pairs):
        """``pairs`` of ``(param, lowp)``, lowp a contiguous CPU bf16/fp16 tensor of param's numel: from the next
        step on, the pass that updates param also writes it into lowp (offload's low-precision model). Replaces
        earlier pairs (``()`` clears them); not in state_dict()."""
        index = {p: (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}
        copies = {}
        for n, pair in enumerate(pairs):
            try:
                p, lowp = pair
            except (TypeError, ValueError):
                raise TypeError(f"set_lowp_copies: item {n} is not a (param, lowp_tensor) pair") from None
            if not torch.is_tensor(p) or p not in index:
                raise ValueError(f"set_lowp_copies: item {n}'s param is not one of this optimizer's params; pass "
                                 "the parameters given to CPUAdam (or add them with add_param_group first)")
            gi, pi = index[p]
            if p in copies:
                raise ValueError(f"set_lowp_copies: {_describe(gi, pi, p)} is given twice; pass one copy per param")
            _check_lowp(gi, pi, p, lowp)
            copies[p] = lowp
        self._lowp = copies
        self._lowp_lists = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [self._step_args(gi, group) for gi, group in enumerate(self.param_groups)]
        try:
            # One C++ call checks and steps every group; a param's first step returns it as missing and changes
            # nothing (Note [CPUAdam's step entry] in csrc/adam/bindings.cpp).
            missing = _C.cpu_adam_step(self.state, groups)
            if missing:
                self._init_state(missing)
                _C.cpu_adam_step(self.state, groups)
        except RuntimeError:
            self._diagnose()  # raises a ValueError/TypeError naming the parameter if it finds the cause
            raise
        return loss

    def _step_args(self, gi, group):
        beta1, beta2 = group["betas"]
        return (group["params"], self._lowp_list(gi, group), float(group["lr"]), float(beta1), float(beta2),
                float(group["eps"]), float(group["weight_decay"]), bool(group["adamw"]),
                bool(group["bias_correction"]))

    def _lowp_list(self, gi, group):
        """The group's low-precision copies, one per param (None for none), or None if it has none."""
        if not getattr(self, "_lowp", None):
            return None
        params = group["params"]
        cached = self._lowp_lists.get(gi)
        # Rebuilt only when the group's params list changed, not every step.
        if cached is None or cached[0] is not params or cached[1] != len(params):
            lows = [self._lowp.get(p) for p in params]
            cached = (params, len(params), lows if any(t is not None for t in lows) else None)
            self._lowp_lists[gi] = cached
        return cached[2]

    def _init_state(self, missing):
        for gi, pi in missing:
            p = self.param_groups[gi]["params"][pi]
            state = self.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _diagnose(self):
        """Raises a ValueError/TypeError naming the first parameter the kernel cannot take."""
        lowp = getattr(self, "_lowp", None) or {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                _check_param(gi, pi, p)
                _check_grad(gi, pi, p)
                if p in lowp:
                    _check_lowp(gi, pi, p, lowp[p])
                state = self.state.get(p)
                if state:  # an empty state is created on the first step, not refused
                    _check_state(gi, pi, p, state)


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


def _check_lowp(gi, pi, p, lowp):
    name = _describe(gi, pi, p)
    if not torch.is_tensor(lowp):
        raise TypeError(f"{name}: its low-precision copy must be a tensor, got {type(lowp).__name__}")
    if lowp.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: its low-precision copy has dtype {lowp.dtype}; use torch.bfloat16 or "
                        "torch.float16")
    if lowp.device.type != "cpu":
        raise ValueError(f"{name}: its low-precision copy is on {lowp.device}; CPUAdam writes it from the CPU, "
                         "so pass a CPU tensor (pinned memory is fine) and copy it to the device yourself")
    if lowp.layout != torch.strided or not lowp.is_contiguous():
        raise ValueError(f"{name}: its low-precision copy is not a contiguous dense tensor; pass "
                         "lowp.contiguous() or a flat buffer")
    if lowp.numel() != p.numel():
        raise ValueError(f"{name}: its low-precision copy has {lowp.numel()} elements, the param {p.numel()}; "
                         "they must match")


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
