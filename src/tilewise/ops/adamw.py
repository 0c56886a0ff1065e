"""AdamW's update of a large tensor in one pass: read the parameter, its gradient and both moments once, write
the parameter and the moments once.

torch's fused AdamW (a multi-tensor kernel) also writes every gradient back when it divides them by a
grad_scale tensor, which is how the trainer folds gradient clipping into the step (train.make_step): 32
bytes a parameter moved instead of 28. On the H200 (bench/adamw.py) its step over the 1.3B preset's 1.217B
fp32 parameters took 11.47 ms, this one 8.36 ms (0.96 of the copy bandwidth). Here every tensor of at least
`AdamW.min_numel` elements gets one launch of `_adamw_kernel`; the many small ones (biases, norm weights) stay
in torch's multi-tensor kernel, one launch for all of them.

`AdamW` is torch.optim.AdamW (same arguments, same state: `step`, `exp_avg`, `exp_avg_sq`, so checkpoints
move between the two) whose step() routes the large tensors here. The update is torch's:

    g = grad / grad_scale;  p -= lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
    p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

with the bias corrections computed in fp32 from the step counter on the device (torch computes them in
fp64: a relative difference of ~1e-5 in the first steps' update, nothing later). lr may be a 0-d device
tensor (capturable in a CUDA graph), read by the kernel. On CPU tensors the same formula runs in PyTorch
(`adamw_reference_`), unless the dispatch mode sends them to the kernel (the interpreter, for tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_triton
from .launch import FastLauncher, cdiv
from .linear import mark_refreshed, restamp

# 8 elements a thread (two 16-byte loads of each fp32 stream) in small programs: the H200 sweep
# (bench/adamw.py --sweep, commit 8a55393) timed 4233 GB/s on a 100M-element tensor and 4126 on a 12.6M one
# (28 bytes an element), against 3465 and 3332 for 4096 elements at 8 warps
_BLOCK = 1024
_WARPS = 4


@triton.jit
def _adamw_kernel(P, G, M, V, Step, Lr, Scale, Low, n, lr_value, beta1, beta2, eps, weight_decay,
                  LR_TENSOR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LOW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(Step).to(tl.float32)
    if LR_TENSOR:
        lr = tl.load(Lr).to(tl.float32)
    else:
        lr = lr_value
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(Scale).to(tl.float32)
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / correction1) * m / (tl.sqrt(v) / correction2_sqrt + eps)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)
    if HAS_LOW:   # the weight's kept low-precision copy (ops.linear.low_weight), cast as the forward would
        tl.store(Low + offs, p.to(P.dtype.element_ty).to(Low.dtype.element_ty), mask=mask)


_adamw_launch = FastLauncher(_adamw_kernel)


def adamw_reference_(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale=None):
    """The update in PyTorch (in place, p's dtype; step already counts this update)."""
    g = g / grad_scale if grad_scale is not None else g
    lr = lr.to(p.dtype) if isinstance(lr, torch.Tensor) else lr
    step = step.to(torch.float64)
    correction1 = (1 - beta1 ** step).to(p.dtype)
    correction2_sqrt = (1 - beta2 ** step).sqrt().to(p.dtype)
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.sub_((lr / correction1) * m / (v.sqrt() / correction2_sqrt + eps))


def adamw_step_(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale=None, low=None):
    """One AdamW update of p (contiguous; g, m, v contiguous of p's shape) in place. step: a 0-d tensor on
    p's device that already counts this update; lr a float or a 0-d tensor there; grad_scale None or a
    one-element tensor there that divides the gradient; low None or a contiguous tensor of p's shape that
    gets the updated p cast to its dtype (the kept copy of ops.linear.low_weight)."""
    if not use_triton(p):
        adamw_reference_(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
        if low is not None:
            low.copy_(p)
        return
    n = p.numel()
    lr_tensor = isinstance(lr, torch.Tensor)
    _adamw_launch((cdiv(n, _BLOCK),), p, g, m, v, step, lr if lr_tensor else step,
                  grad_scale if grad_scale is not None else step, low if low is not None else p, n,
                  0.0 if lr_tensor else float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                  LR_TENSOR=lr_tensor, HAS_SCALE=grad_scale is not None, HAS_LOW=low is not None, BLOCK=_BLOCK,
                  num_warps=_WARPS)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step() updates each parameter of at least `min_numel` elements with one
    adamw_step_ launch (see the module docstring); the others, and any it does not cover (DTensor or
    sparse, non-contiguous or complex parameters and gradients, amsgrad, maximize, found_inf), take torch's
    own step, which skips the ones updated here because it sees them without a gradient."""

    min_numel = 1 << 18

    def _own(self, group, p) -> bool:
        g = p.grad
        return (p.numel() >= self.min_numel and g is not None and type(p) in (torch.nn.Parameter, torch.Tensor)
                and type(g) is torch.Tensor and not g.is_sparse and p.is_contiguous() and g.is_contiguous()
                and g.shape == p.shape and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and g.device == p.device and not group["amsgrad"] and not group["maximize"]
                and not group.get("differentiable", False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        mine = [] if getattr(self, "found_inf", None) is not None else \
            [(group, p) for group in self.param_groups for p in group["params"] if self._own(group, p)]
        grads = [p.grad for _, p in mine]
        for _, p in mine:       # torch's step below skips a parameter without a gradient
            p.grad = None
        try:
            super().step()
        finally:
            for (_, p), g in zip(mine, grads):
                p.grad = g
        steps = []
        for group, p in mine:
            state = self.state[p]
            if not state:       # as torch lays out a fused or capturable AdamW's state
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:   # loaded from a non-fused AdamW, which keeps it on the CPU
                state["step"] = state["step"].to(p.device, torch.float32)
            steps.append(state["step"])
        if steps:
            torch._foreach_add_(steps, 1.0)
        for (group, p), g in zip(mine, grads):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != p.device:   # a host tensor: its value
                lr = float(lr)
            low = mark_refreshed(p)
            adamw_step_(p, g, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1, beta2,
                        group["eps"], group["weight_decay"], grad_scale, low)
            if low is not None:
                restamp(p)
        return loss
