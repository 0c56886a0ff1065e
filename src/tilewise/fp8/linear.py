"""Fp8Linear: nn.Linear whose three GEMMs run in FP8 through torch._scaled_mm (cuBLASLt, fp32 accumulation).

forward  y  = x W^T : x8 (E4M3, M x K row-major) @ W8^T (W8 is N x K row-major = W^T column-major)
backward dx = dy W  : dy8 (E5M2 in hybrid) @ W8t^T (W8t: K x N row-major)
         dW = dy^T x: dy8t (N x M row-major) @ x8t^T (x8t: K x M row-major)
One cast pass per tensor writes each copy it needs (x8 and x8t; dy8 and dy8t; W8 and W8t) and its amax.
Each copy comes with the inverse scales _scaled_mm multiplies back in:
- per tensor ("delayed", "current"): one float32 for both copies;
- "blockwise": one per 1x128 segment along the copy's contraction dimension (x8 and W8 along K, dy8 and
  W8t along N, x8t and dy8t along M), the cuBLAS "VEC128 x VEC128" block scaling that torch._scaled_mm
  runs on sm90 with cuBLAS >= 12.9. It is finer than DeepSeek-V3's recipe, which scales weights in 128x128
  tiles so that W and W^T share one quantization: here W8 and W8t are scaled separately, each along its own
  contraction dimension, which also keeps clear of the 128x128 scale grid's padding rules (its leading
  dimension rounded up to 4 blocks in cuBLAS, checked differently across torch versions). Row counts are
  padded to a multiple of 128 so every block of the weight-gradient contraction is whole.
Fast accumulation only in the per-tensor forward GEMM. GEMM results wanted in fp32 (the weight gradient of
fp32 master weights, dx of an fp32 input) come out of the GEMM in fp32: cuBLASLt writes its fp32 accumulator
as it is, which costs 2 more bytes an element than a bf16 result and saves the kernel that would widen one
(read 2, write 4). WIDEN_FP32_RESULTS = True goes back to bf16 results widened afterwards.
The weight is cast once per optimizer step: the copy (and the bias in the output dtype) is cached under
(weight._version, data pointer, state generation), so a micro-batch reuses it, and Fp8State.step() or any
in-place change of the weight (optimizer.step, load_state_dict) makes the next forward cast again. The layer
saves x8t (1 byte per element) for backward instead of x.
`after_gelu(h, b)` is the layer applied to bias_gelu(h, b) (the MLP's down projection): with delayed scaling
the input's cast computes the GELU itself, so the activation is never written in 16 bits (a write and a read
of it saved); it saves h for the GELU's backward, as bias_gelu would.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.activation import bias_gelu, bias_gelu_grad
from ..ops.fp8_cast import BLOCK, SCALE_INV_OFFSET, block_dequantize_reference, cast_block, cast_current, cast_delayed
from .recipe import Fp8Recipe, as_recipe
from .state import Fp8State

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _multiple(recipe: Fp8Recipe) -> int:
    """What in_features and out_features must be multiples of: 16 for _scaled_mm, 128 for whole blocks."""
    return BLOCK if recipe.scaling == "blockwise" else 16


def fp8_compatible(linear: nn.Linear, recipe: Fp8Recipe | str = "delayed") -> bool:
    """True when this layer can run in FP8 under `recipe`: both dims multiples of 16 (128 for "blockwise"),
    a bf16/fp16/fp32 weight."""
    k = _multiple(as_recipe(recipe))
    return linear.in_features % k == 0 and linear.out_features % k == 0 and linear.weight.dtype in _DTYPES


# ----------------------------------------------------------------------------------------------------
# Casts: each returns (q, q_scales, q_t, q_t_scales); a copy not asked for is None
# ----------------------------------------------------------------------------------------------------
# The GEMM operand roles of each tensor's (row-major copy, transposed copy), so the casts write them in the
# layout torch._scaled_mm(a, b) takes (see tilewise.ops.fp8_cast): x8 is the forward's a and x8t (viewed
# transposed) the weight gradient's b; W8 and W8t are b's; dy8 and dy8t are a's.
_X_ROLES, _W_ROLES, _DY_ROLES = ("a", "b"), ("b", "b"), ("a", "a")


def _cast_per_tensor(state: Fp8State, slot: int, x2, rowwise, transpose, col_sums, roles, gelu=False,
                     gelu_bias=None):
    """One inverse scale (a 16-byte aligned one-element view) serves both copies. gelu: cast
    bias_gelu(x2, gelu_bias), inside the cast with delayed scaling."""
    scale, scale_inv, amax_i32 = state.views(slot)
    if state.current or not state.warm:  # until the first step() fills the history, current scaling
        if gelu:   # its amax pass reads the activation
            x2 = bias_gelu(x2, gelu_bias)
        y, yt, scratch = cast_current(x2, state.dtypes[slot], scale, state.recipe.margin, amax_i32, rowwise,
                                      transpose, col_sums=col_sums, roles=roles)
        inv = scratch[SCALE_INV_OFFSET:SCALE_INV_OFFSET + 1]
        return y, inv, yt, inv
    y, yt = cast_delayed(x2, state.dtypes[slot], scale, amax_i32, rowwise, transpose, col_sums=col_sums,
                         roles=roles, gelu=gelu, gelu_bias=gelu_bias)
    return y, scale_inv, yt, scale_inv


def _cast_blockwise(state: Fp8State, slot: int, x2, rowwise, transpose, col_sums, roles, gelu=False,
                    gelu_bias=None):
    """Inverse scales per 1x128 segment, laid out for each copy's role (see tilewise.ops.fp8_cast)."""
    if gelu:
        x2 = bias_gelu(x2, gelu_bias)
    return cast_block(x2, state.dtypes[slot], state.views(slot)[2], rowwise, transpose, col_sums, roles)


# ----------------------------------------------------------------------------------------------------
# GEMMs: (a * a_scales) @ (b * b_scales), a row-major, b a column-major (transposed) view of a row-major copy
# ----------------------------------------------------------------------------------------------------
def _aligned(scale: torch.Tensor) -> torch.Tensor:
    """cuBLASLt rejects scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, seen on the
    H200). Fp8State and the current-scaling cast lay their scales out aligned; anything else is copied."""
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def _widen(y, out_dtype, bias):
    """The GEMM's result y in out_dtype, plus the bias (one kernel for both when y is narrower)."""
    if y.dtype == out_dtype:
        return y.add_(bias) if bias is not None else y
    return torch.add(bias, y) if bias is not None else y.to(out_dtype)


# True: fp32 GEMM results are computed in bf16 and widened by a second kernel (see _gemm_per_tensor). It was
# the default while the FP8 NaNs of the H200 were unexplained; their cause was the casts' transposes (a920bf1),
# and the gpu tests check _scaled_mm's fp32 output on NaN-poisoned memory.
WIDEN_FP32_RESULTS = False
CPU_SCALED_MM = False   # see _gemm_per_tensor


def _gemm_per_tensor(a, b, a_inv, b_inv, out_dtype, bias=None, fast_accum=False):
    """An fp32 result (the weight gradient of fp32 master weights, dx of an fp32 input) is the GEMM's own
    fp32 output, or with WIDEN_FP32_RESULTS a bf16 one widened (2^-9 relative error per element, far below
    the FP8 operands' ~2^-4). On the CPU the same product of the dequantized operands in fp32: torch's CPU
    _scaled_mm (2.13) took 0.3 s for a 256 x 512 x 128 product, which stalled the CPU runs (CPU_SCALED_MM:
    torch's op there too, as the GPU runs it, for tests that count a call's ops)."""
    if not a.is_cuda and not CPU_SCALED_MM:
        y = (a.float() @ b.float()) * (a_inv.float() * b_inv.float())
        return _widen(y.to(out_dtype), out_dtype, bias)
    if out_dtype == torch.float32 and WIDEN_FP32_RESULTS:
        y = torch._scaled_mm(a, b, scale_a=_aligned(a_inv), scale_b=_aligned(b_inv), out_dtype=torch.bfloat16,
                             use_fast_accum=fast_accum)
        return _widen(y, out_dtype, bias)
    fused = bias is not None and out_dtype != torch.float32  # _scaled_mm adds a bias to 16-bit outputs only
    y = torch._scaled_mm(a, b, scale_a=_aligned(a_inv), scale_b=_aligned(b_inv), bias=bias if fused else None,
                         out_dtype=out_dtype, use_fast_accum=fast_accum)
    return y.add_(bias) if bias is not None and not fused else y


def _gemm_blockwise(a, b, a_scales, b_scales, out_dtype, bias=None, fast_accum=False):
    """a_scales (rows of a, cols/128) outer-dim-major and b_scales (cols/128, rows of b.t()), as the casts lay
    them out for the roles "a" and "b". On CUDA torch._scaled_mm with 1x128 x 1x128 block scales (16-bit
    output, widened as in _gemm_per_tensor; the bias added after); elsewhere (no CPU kernel) the same product
    of the dequantized operands in fp32."""
    gemm_dtype = torch.bfloat16 if out_dtype == torch.float32 and WIDEN_FP32_RESULTS else out_dtype
    if not a.is_cuda:
        y = block_dequantize_reference(a, a_scales.t()) @ block_dequantize_reference(b.t(), b_scales).t()
        return _widen(y.to(gemm_dtype), out_dtype, bias)
    try:
        y = torch._scaled_mm(a, b, scale_a=a_scales, scale_b=b_scales, out_dtype=gemm_dtype)
    except (RuntimeError, NotImplementedError) as e:
        raise RuntimeError(f"FP8 recipe 'blockwise' needs torch._scaled_mm with 1x128 block scales (sm90 and "
                           f"cuBLAS >= 12.9); here it failed: {type(e).__name__}: {e}") from e
    return _widen(y, out_dtype, bias)


# ----------------------------------------------------------------------------------------------------
# The autograd Function
# ----------------------------------------------------------------------------------------------------
class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, out_dtype, grad_enabled, gelu, gelu_bias):
        """gelu: x is the pre-activation h, and the layer's input is bias_gelu(h, gelu_bias)."""
        state, slot, cast, gemm = layer.fp8_state, layer.fp8_slot, layer._cast, layer._gemm
        K, N = layer.in_features, layer.out_features
        x2 = h2 = x if x.dim() == 2 else x.reshape(-1, K)
        M = x2.shape[0]
        pad = -M % layer._row_multiple  # the weight-gradient GEMM contracts over rows
        if pad:   # (under gelu, the pad rows' gelu(bias) joins the amax; their dy rows are zero)
            x2 = F.pad(x2, (0, 0, 0, pad))
        # needs_input_grad ignores no_grad mode: without grad the transposed copies are not made
        need_dx = grad_enabled and (ctx.needs_input_grad[0] or (gelu and ctx.needs_input_grad[7]))
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        w8, w_s, w8t, w_ts = layer._weight_fp8(need_t=need_dx)
        x8, x_s, x8t, x_ts = cast(state, slot, x2, True, need_dw, None, _X_ROLES, gelu, gelu_bias)
        y = gemm(x8, w8, x_s, w_s, out_dtype, layer._bias_as(out_dtype), layer._fast_forward)
        if pad:
            y = y[:M]
        ctx.save_for_backward(x8t, x_ts, w8t, w_ts, *((h2, gelu_bias) if gelu and need_dx else ()))
        ctx.layer, ctx.M, ctx.pad, ctx.x_shape, ctx.x_dtype = layer, M, pad, x.shape, x.dtype
        ctx.w_dtype, ctx.gelu = weight.dtype, gelu
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x8t, x_ts, w8t, w_ts, *gelu_saved = ctx.saved_tensors
        layer = ctx.layer
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_dx = need_dx or (ctx.gelu and ctx.needs_input_grad[7])
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        if ctx.pad:
            dy2 = F.pad(dy2, (0, 0, 0, ctx.pad))
        dx = dw = db = None
        want_db = need_db and layer.bias is not None
        if need_dx or need_dw:
            # the bias gradient: the cast sums dy's columns (pad rows are zero)
            sums = torch.empty(dy2.shape[1], dtype=torch.float32, device=dy2.device) if want_db else None
            dy8, dy_s, dy8t, dy_ts = layer._cast(layer.fp8_state, layer.fp8_slot + 2, dy2, need_dx, need_dw, sums,
                                                 _DY_ROLES)
            if need_dx:
                dx = layer._gemm(dy8, w8t, dy_s, w_ts, ctx.x_dtype)
                if ctx.pad:
                    dx = dx[:ctx.M]
                if ctx.gelu:   # dx is the gradient of the GELU's output: through the GELU to h and its bias
                    h2, gelu_bias = gelu_saved
                    dx, d_gelu_bias = bias_gelu_grad(dx, h2, gelu_bias)
                dx = dx if len(ctx.x_shape) == 2 else dx.reshape(ctx.x_shape)
            if need_dw:
                dw = layer._gemm(dy8t, x8t, dy_ts, x_ts, ctx.w_dtype)
            if want_db:
                db = sums.to(layer.bias.dtype)
        elif want_db:
            db = dy2.sum(0, dtype=torch.float32).to(layer.bias.dtype)
        return dx, dw, db, None, None, None, None, (d_gelu_bias if ctx.gelu and need_dx else None)


# ----------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------
class Fp8Linear(nn.Linear):
    """Drop-in nn.Linear computing in FP8; parameters stay in their own dtype (the master copy).

    in_features and out_features must be multiples of 16 (128 for the "blockwise" recipe). `state`/`slot`:
    the shared Fp8State and the first of this layer's three slots (convert_to_fp8 sets them); without them
    the layer makes a private state from `recipe`. Call `fp8_state.step()` after each optimizer step.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 recipe: Fp8Recipe | str = "delayed", state: Fp8State | None = None, slot: int | None = None):
        if (state is None) != (slot is None):
            raise ValueError("Fp8Linear: give both state and slot, or neither")
        recipe = state.recipe if state is not None else as_recipe(recipe)
        k = _multiple(recipe)
        if in_features % k or out_features % k:
            raise ValueError(f"Fp8Linear: in_features={in_features}, out_features={out_features}; both must be "
                             f"multiples of {k} for the FP8 GEMMs of recipe {recipe.scaling!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if state is None:
            dev = self.weight.device if self.weight.device.type != "meta" else "cpu"
            state, slot = Fp8State.for_linears(recipe, ["linear"], device=dev), 0
        elif not 0 <= slot <= state.num_tensors - 3:
            raise ValueError(f"Fp8Linear: slot={slot} does not fit a state of {state.num_tensors} tensors")
        self.fp8_state, self.fp8_slot = state, slot
        # Plain attribute writes: nn.Module.__setattr__ costs host time on every call.
        blockwise = recipe.scaling == "blockwise"
        self.__dict__.update(_w_cache=None, _b_cache=None, _row_multiple=BLOCK if blockwise else 16,
                             _cast=_cast_blockwise if blockwise else _cast_per_tensor,
                             _gemm=_gemm_blockwise if blockwise else _gemm_per_tensor,
                             _fast_forward=not blockwise)

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
        """Drop the cached FP8 weight and cast bias (Fp8State.step() and in-place weight updates already do;
        a CUDA graph capture must, since replays bump no host counter)."""
        self.__dict__["_w_cache"] = None
        self.__dict__["_b_cache"] = None

    def _weight_fp8(self, need_t: bool):
        """(W8, its scales, W8t or None, its scales or None), laid out as the GEMMs' right operands and cast
        once per optimizer step."""
        w = self.weight
        if type(w) is not nn.Parameter:   # FSDP2 with FP8 all-gather (tilewise.fp8.fsdp)
            from .fsdp import Fp8GatheredWeight, Fp8ShardedWeight
            if isinstance(w, Fp8GatheredWeight):   # gathered in FP8, scaled per tensor: used as it is
                return w.fp8_operands(need_t)
            if isinstance(w, Fp8ShardedWeight):    # not sharded (yet): the master weight inside
                w = w._tensor
        key = (w._version, w.data_ptr(), self.fp8_state.generation)
        c = self._w_cache
        if c is not None and c[0] == key and (c[1][2] is not None or not need_t):
            return c[1]
        q = self._cast(self.fp8_state, self.fp8_slot + 1, w, True, need_t, None, _W_ROLES)
        self.__dict__["_w_cache"] = (key, q)
        return q

    def _bias_as(self, dtype):
        """The bias in the GEMM's output dtype (cast once per optimizer step), or None."""
        b = self.bias
        if b is None or b.dtype == dtype:
            return b
        key = (b._version, b.data_ptr(), self.fp8_state.generation, dtype)
        c = self._b_cache
        if c is None or c[0] != key:
            c = self.__dict__["_b_cache"] = (key, b.detach().to(dtype))
        return c[1]

    def _out_dtype(self, x: torch.Tensor, what: str = "input") -> torch.dtype:
        """Checks x; the output dtype (under autocast the autocast dtype: nothing inside is on its lists)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear: {what}'s last dim is {x.shape[-1]}; expected in_features={self.in_features}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"Fp8Linear: {what} dtype {x.dtype}; expected bf16, fp16 or fp32")
        if x.device != self.weight.device:
            raise ValueError(f"Fp8Linear: {what} on {x.device}, weight on {self.weight.device}")
        if x.device != self.fp8_state.device:
            self.fp8_state.to(x.device)
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8LinearFn.apply(x, self.weight, self.bias, self, self._out_dtype(x), torch.is_grad_enabled(),
                                  False, None)

    @torch.compiler.disable
    def after_gelu(self, h: torch.Tensor, gelu_bias: torch.Tensor | None = None) -> torch.Tensor:
        """self(ops.bias_gelu(h, gelu_bias)), the GELU computed inside the input's FP8 cast (see the module
        docstring); gradients reach h and gelu_bias as through bias_gelu."""
        out_dtype = self._out_dtype(h, "pre-activation")
        if gelu_bias is not None and (gelu_bias.shape != (self.in_features,) or gelu_bias.device != h.device):
            raise ValueError(f"Fp8Linear.after_gelu: gelu_bias is {tuple(gelu_bias.shape)} on {gelu_bias.device}; "
                             f"expected ({self.in_features},) on {h.device}")
        return _Fp8LinearFn.apply(h, self.weight, self.bias, self, out_dtype, torch.is_grad_enabled(), True,
                                  gelu_bias)

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
    whose dims are not multiples of 16 (128 for "blockwise"), or whose weight is not bf16/fp16/fp32, are
    kept automatically. Subclasses of nn.Linear are swapped too (their forward must be x W^T + b);
    nn.MultiheadAttention's out_proj is not. `group`: the process group whose ranks share amaxes (default:
    the world).
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
            if not _swappable(child) or not fp8_compatible(child, recipe) or (skip is not None and skip(full)):
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
