"""Fp8Linear: nn.Linear whose three GEMMs run in FP8 through torch._scaled_mm (cuBLASLt, fp32 accumulation).

forward  y  = x W^T : x8 (E4M3, M x K row-major) @ W8^T (W8 is N x K row-major = W^T column-major)
backward dx = dy W  : dy8 (E5M2 in hybrid) @ W8t^T (W8t: K x N row-major)
         dW = dy^T x: dy8t (N x M row-major) @ x8t^T (x8t: K x M row-major)
One cast pass per tensor writes each copy it needs (x8 and x8t; dy8 and dy8t; W8 and W8t) and its amax.
_scaled_mm takes the inverse scales; fast accumulation only in the forward GEMM. The weight is cast once
per optimizer step: the copy is cached under (weight._version, data pointer, state generation), so a
micro-batch reuses it, and Fp8State.step() or any in-place change of the weight (optimizer.step,
load_state_dict) makes the next forward cast again. The layer saves x8t (1 byte per element) for
backward instead of x.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.fp8_cast import cast_current, cast_delayed
from .recipe import Fp8Recipe, as_recipe
from .state import Fp8State

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_compatible(linear: nn.Linear) -> bool:
    """True when _scaled_mm can run this layer: both dims multiples of 16, a bf16/fp16/fp32 weight."""
    return (linear.in_features % 16 == 0 and linear.out_features % 16 == 0
            and linear.weight.dtype in _DTYPES)


def _cast(state: Fp8State, slot: int, x2: torch.Tensor, rowwise: bool, transpose: bool, col_sums=None):
    """Cast a 2-D tensor into slot's format; returns (copy, transposed copy, inverse scale (1,))."""
    dtype = state.dtypes[slot]
    scale, scale_inv, amax = state.views(slot)
    if state.recipe.scaling == "current" or not state.warm:
        y, yt, scales = cast_current(x2, dtype, scale, state.recipe.margin, amax, rowwise, transpose,
                                     col_sums=col_sums)
        return y, yt, scales[1:2]  # 1/scale, 16-byte aligned (see current_scales)
    y, yt = cast_delayed(x2, dtype, scale, amax, rowwise, transpose, col_sums=col_sums)
    return y, yt, scale_inv


def _aligned(scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, seen on the
    H200). Fp8State and the current-scaling cast lay their scales out aligned; anything else is copied."""
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def _scaled_gemm(a, b, a_inv, b_inv, out_dtype, bias=None, fast_accum=False):
    """(a * a_inv) @ (b * b_inv) (+ bias): a row-major, b column-major, fp32 accumulation.

    _scaled_mm adds a bias only for a 16-bit output, so an fp32 output gets it afterwards.
    """
    fused_bias = bias is not None and out_dtype != torch.float32
    a_inv, b_inv = _aligned(a_inv), _aligned(b_inv)
    y = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, bias=bias.to(out_dtype) if fused_bias else None,
                         out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None and not fused_bias:
        y = y + bias.to(out_dtype)
    return y


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, out_dtype, grad_enabled):
        state, slot = layer.fp8_state, layer.fp8_slot
        K, N = weight.shape[1], weight.shape[0]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        pad = -M % 16  # the weight-gradient GEMM contracts over tokens: _scaled_mm wants a multiple of 16
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        # needs_input_grad ignores no_grad mode: without grad the transposed copies are not made
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        w8, w8t, w_inv = layer._weight_fp8(need_t=need_dx)
        x8, x8t, x_inv = _cast(state, slot, x2, rowwise=True, transpose=need_dw)
        y = _scaled_gemm(x8, w8.t(), x_inv, w_inv, out_dtype, bias=bias, fast_accum=True)
        if pad:
            y = y[:M]
        ctx.save_for_backward(x8t, x_inv, w8t, w_inv)
        ctx.layer, ctx.M, ctx.pad, ctx.x_shape, ctx.x_dtype = layer, M, pad, x.shape, x.dtype
        ctx.w_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y.reshape(*lead, N)

    @staticmethod
    def backward(ctx, dy):
        x8t, x_inv, w8t, w_inv = ctx.saved_tensors
        layer = ctx.layer
        state, slot = layer.fp8_state, layer.fp8_slot
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.pad:
            dy2 = F.pad(dy2, (0, 0, 0, ctx.pad))
        dx = dw = db = None
        want_db = need_db and ctx.has_bias
        if need_dx or need_dw:
            # the bias gradient comes from the same read of dy (pad rows are zero)
            sums = torch.empty(dy2.shape[1], dtype=torch.float32, device=dy2.device) if want_db else None
            dy8, dy8t, dy_inv = _cast(state, slot + 2, dy2, rowwise=need_dx, transpose=need_dw, col_sums=sums)
            if need_dx:
                dx = _scaled_gemm(dy8, w8t.t(), dy_inv, w_inv, ctx.x_dtype)
                dx = (dx[:ctx.M] if ctx.pad else dx).reshape(ctx.x_shape)
            if need_dw:
                dw = _scaled_gemm(dy8t, x8t.t(), dy_inv, x_inv, ctx.w_dtype)
            if want_db:
                db = sums.to(layer.bias.dtype)
        elif want_db:
            db = dy2.sum(0, dtype=torch.float32).to(layer.bias.dtype)
        return dx, dw, db, None, None, None


class Fp8Linear(nn.Linear):
    """Drop-in nn.Linear computing in FP8; parameters stay in their own dtype (the master copy).

    in_features and out_features must be multiples of 16. `state`/`slot`: the shared Fp8State and the
    first of this layer's three slots (convert_to_fp8 sets them); without them the layer makes a private
    state from `recipe`. Call `fp8_state.step()` after each optimizer step.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 recipe: Fp8Recipe | str = "delayed", state: Fp8State | None = None, slot: int | None = None):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Fp8Linear: in_features={in_features}, out_features={out_features}; "
                             "both must be multiples of 16 for FP8 GEMMs")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if (state is None) != (slot is None):
            raise ValueError("Fp8Linear: give both state and slot, or neither")
        if state is None:
            dev = self.weight.device if self.weight.device.type != "meta" else "cpu"
            state, slot = Fp8State.for_linears(recipe, ["linear"], device=dev), 0
        elif not 0 <= slot <= state.num_tensors - 3:
            raise ValueError(f"Fp8Linear: slot={slot} does not fit a state of {state.num_tensors} tensors")
        self.fp8_state, self.fp8_slot = state, slot
        self.__dict__["_w_cache"] = None  # plain attribute writes: nn.Module.__setattr__ costs host time

    @classmethod
    def from_linear(cls, linear: nn.Linear, state: Fp8State | None = None, slot: int | None = None,
                    recipe: Fp8Recipe | str = "delayed") -> "Fp8Linear":
        """An Fp8Linear sharing `linear`'s Parameter objects (tying and optimizer references survive)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear.from_linear: got {type(linear).__name__}; expected nn.Linear")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe, state=state, slot=slot)
        if state is None:
            new.fp8_state.to(linear.weight.device if linear.weight.device.type != "meta" else "cpu")
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def invalidate(self) -> None:
        """Drop the cached FP8 weight (Fp8State.step() and in-place weight updates already do)."""
        self.__dict__["_w_cache"] = None

    def _weight_fp8(self, need_t: bool):
        w, state = self.weight, self.fp8_state
        key = (w._version, w.data_ptr(), state.generation)
        c = self._w_cache
        if c is not None and c[0] == key and (c[2] is not None or not need_t):
            return c[1], c[2], c[3]
        w8, w8t, w_inv = _cast(state, self.fp8_slot + 1, w.detach(), rowwise=True, transpose=need_t)
        self.__dict__["_w_cache"] = (key, w8, w8t, w_inv)
        return w8, w8t, w_inv

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear: input's last dim is {x.shape[-1]}; expected in_features={self.in_features}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"Fp8Linear: input dtype {x.dtype}; expected bf16, fp16 or fp32")
        if x.device != self.weight.device:
            raise ValueError(f"Fp8Linear: input on {x.device}, weight on {self.weight.device}")
        self.fp8_state.to(x.device)
        # Under autocast the output takes the autocast dtype; nothing inside is on autocast's lists.
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return _Fp8LinearFn.apply(x, self.weight, self.bias, self, out_dtype, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.fp8_state.recipe.scaling}/{self.fp8_state.recipe.formats}"


def _swappable(module: nn.Module) -> bool:
    # nn.Linear and subclasses that compute x W^T + b (tilewise.model.Linear); not Fp8Linear again, and not
    # the out_proj of nn.MultiheadAttention, whose forward reads .weight directly.
    return (isinstance(module, nn.Linear) and not isinstance(module, Fp8Linear)
            and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear))


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | str = "delayed",
                   skip: Callable[[str], bool] | None = None, group=None) -> Fp8State:
    """Swap every nn.Linear of `model` (in place) for an Fp8Linear sharing one Fp8State, which is returned.

    skip(name) -> True keeps the layer of that qualified name (e.g. "lm_head") in high precision; layers
    whose dims are not multiples of 16, or whose weight is not bf16/fp16/fp32, are kept automatically.
    Subclasses of nn.Linear are swapped too (their forward must be x W^T + b); nn.MultiheadAttention's
    out_proj is not. `group`: the process group whose ranks share amaxes (default: the world).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8: model is a {type(model).__name__}; expected an nn.Module")
    if isinstance(model, nn.Linear):
        raise TypeError("convert_to_fp8: the model is itself an nn.Linear; use Fp8Linear.from_linear")
    if skip is not None and not callable(skip):
        raise TypeError(f"convert_to_fp8: skip is a {type(skip).__name__}; expected a callable name -> bool")
    recipe = as_recipe(recipe)
    targets, order = [], {}  # (parent, attribute, linear); a module shared by two parents converts once
    for pname, parent in model.named_modules():
        for cname, child in parent.named_children():
            full = f"{pname}.{cname}" if pname else cname
            if not _swappable(child) or not fp8_compatible(child) or (skip is not None and skip(full)):
                continue
            targets.append((parent, cname, child))
            order.setdefault(id(child), (len(order), full))
    names = [full for _, full in sorted(order.values())]
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    state = Fp8State.for_linears(recipe, names, device=device, group=group)
    swapped = {}
    for parent, cname, child in targets:
        if id(child) not in swapped:
            swapped[id(child)] = Fp8Linear.from_linear(child, state, 3 * order[id(child)][0])
        setattr(parent, cname, swapped[id(child)])
    return state
