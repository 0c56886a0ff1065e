"""FP8 all-gather of Fp8Linear weights under FSDP2: each rank casts its shard to FP8 and the ranks gather
1-byte elements instead of 2 (bf16) or 4 (fp32).

FSDP2's extension point is the sharded parameter's local tensor: when it defines fsdp_pre_all_gather and
fsdp_post_all_gather, FSDP2 gathers whatever the first returns and hands the gathered buffers to the second,
whose result becomes the unsharded parameter that the module's forward sees. enable_fp8_all_gather() wraps
each Fp8Linear weight in an Fp8ShardedWeight before fully_shard, so that after sharding every rank's local
tensor is one:
- fsdp_pre_all_gather casts this rank's master shard (fp32 or bf16) to FP8 with the weight slot's delayed
  scale, which every rank holds bitwise equal (amaxes are MAX-reduced in Fp8State.step()), and folds the
  shard's amax into the slot, so the step's reduction yields the whole weight's amax as before. The FP8 shard
  is cached until the weight changes or the state steps: backward's re-gather and further micro-batches of
  the step reuse it. Until the first step() fills the history (the recipe then uses current scaling), the
  ranks agree on a scale by MAX-reducing their shards' amaxes over the shard group first: one scalar
  all-reduce per layer, on the first step only.
- The shard is first rounded to FSDP2's parameter dtype (mp_policy.param_dtype, given to
  enable_fp8_all_gather) when that is narrower than the master's: the plain path would cast the gathered
  bf16 weight, so the FP8 bytes, the amax and hence every later scale are the same bits either way and the FP8
  gather changes only what travels, not the numbers (without it, bf16 training with fp32 masters took
  different roundings and the one-rank H200 test drifted 5% apart in 20 steps).
- fsdp_post_all_gather wraps the gathered FP8 weight and its inverse scale in an Fp8GatheredWeight, which
  Fp8Linear's forward uses as it is (the transposed copy for the input-gradient GEMM is a transpose of the
  FP8 data, no second cast).
Only recipe "delayed": current scaling would need the whole weight's amax before every cast (an all-reduce on
the gather's critical path per layer and micro-batch), and blockwise scales the transposed copy along the
other dimension, which cannot be made from FP8 rows without quantizing twice; both gather bf16 as before.
Gradients, optimizer state and checkpoints see plain tensors: every op but the few FSDP2 uses to shard and
pad a parameter returns plain results (so AdamW's moments are plain), and a state_dict hook puts the master
shard itself (a DTensor over a plain tensor sharing its storage, so loading writes through) in the state dict.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from ..ops.fp8_cast import cast_delayed, current_scale_reference
from .linear import Fp8Linear

aten = torch.ops.aten

# Ops whose results stay Fp8ShardedWeight: what fully_shard, FSDP2's lazy init, its load_state_dict hook and
# CPU offload do to a parameter (split into shards, pad with new_zeros + narrow + copy_, view, move).
_KEEP_SHARDED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.new_zeros.default, aten.copy_.default, aten._to_copy.default, aten._pin_memory.default,
}
# Ops that only re-describe the gathered weight (FSDP2's as_strided to the parameter's shape, nn.Parameter's
# detach); anything else sees the dequantized weight.
_KEEP_GATHERED = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}


class Fp8ShardedWeight(torch.Tensor):
    """A master weight (shard) that FSDP2 all-gathers in FP8; behaves as its plain `_tensor` otherwise.

    `_layer` is the Fp8Linear whose Fp8State and weight slot give the scale and receive the amax."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, layer: Fp8Linear, cast_from: torch.dtype | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, layer: Fp8Linear, cast_from: torch.dtype | None = None):
        self._tensor = tensor
        self._layer = layer
        self._cast_from = cast_from   # round the shard to this dtype before the FP8 cast (FSDP2's param_dtype)
        self._mutations = 0      # in-place ops made through this wrapper (the optimizer's, load_state_dict's)
        self._fp8_cache = None   # (key, fp8 shard, inverse scale)

    def __repr__(self):
        return f"Fp8ShardedWeight({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], (self._layer, self._cast_from)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        layer, cast_from, mutable = None, None, func._schema.is_mutable

        def unwrap(t):
            nonlocal layer, cast_from
            if layer is None:
                layer, cast_from = t._layer, t._cast_from
            if mutable:   # the inner tensor's version counter does not see ops made through the wrapper
                t._mutations += 1
            return t._tensor

        args, kwargs = tree_map_only(Fp8ShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SHARDED:
            return out
        return tree_map_only(torch.Tensor, lambda t: Fp8ShardedWeight(t, layer, cast_from), out)

    # -- FSDP2 all-gather extension (the one-argument signature: torch 2.11 and 2.13 both call it) -------------
    def fsdp_pre_all_gather(self, mesh):
        q, scale_inv = self._fp8_shard(mesh)
        return (q,), (scale_inv,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,), (scale_inv,) = all_gather_outputs, metadata
        if out is not None:   # the same buffers were gathered into again: only the scale is new
            out._scale_inv = scale_inv
            return None
        # The gathered buffer is FSDP2's own all-gather output, which it frees and reallocates itself.
        return Fp8GatheredWeight(data, scale_inv, param_dtype), ()

    @torch.no_grad()
    def _fp8_shard(self, mesh):
        """(FP8 copy of this shard, its inverse scale), cast once per weight version and state step."""
        layer, x = self._layer, self._tensor
        state, slot = layer.fp8_state, layer.fp8_slot + 1
        if x.device != state.device:
            state.to(x.device)
        key = (self._mutations, x._version, state.generation, x.device)
        c = self._fp8_cache
        if c is not None and c[0] == key:
            return c[1], c[2]
        if self._cast_from is not None and self._cast_from.itemsize < x.dtype.itemsize:
            x = x.to(self._cast_from)
        scale, scale_inv, amax_i32 = state.views(slot)
        if not state.warm:
            scale = _agreed_current_scale(x, state, slot, mesh)
            scale_inv = torch.reciprocal(scale)
        q, _ = cast_delayed(x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x, state.dtypes[slot], scale,
                            amax_i32, True, False)
        # A copy: step() updates the state's scales in place while the gathered weight may still be in use.
        scale_inv = scale_inv.clone()
        self._fp8_cache = (key, q.view(x.shape), scale_inv)
        return self._fp8_cache[1], scale_inv


def _agreed_current_scale(x, state, slot, mesh) -> torch.Tensor:
    """Current scaling of the whole weight from its shards: the shards' amaxes MAX-reduced over the shard
    group (NaN sent as inf, as in Fp8State.reduce_amaxes), then the recipe's scale (the slot's own scale where
    the amax is 0 or not finite)."""
    amax = x.detach().abs().amax().float().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
    torch.nan_to_num_(amax, nan=float("inf"), posinf=float("inf"))
    if dist.is_available() and dist.is_initialized() and mesh is not None and mesh.size() > 1:
        group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group(mesh.ndim - 1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return current_scale_reference(amax, float(state.fp8_max[slot]), state.recipe.margin,
                                   state.views(slot)[0]).contiguous()


class Fp8GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 hands to Fp8Linear: FP8 `_data` (out_features, in_features) row-major and the
    one-element `_scale_inv` that dequantizes it. It reports the parameter dtype, so gradients come out in it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale_inv = scale_inv

    def __repr__(self):
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, fp8={self._data.dtype}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale_inv"], dtype)

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() * self._scale_inv).to(self.dtype)

    def fp8_operands(self, need_t: bool):
        """(W8, scale_inv, W8t or None, scale_inv or None) in the layouts Fp8Linear's GEMMs take (right operands:
        W8 the transposed view of the row-major data; W8t the transposed view of its (in, out) row-major copy)."""
        w8 = self._data.t()
        w8t = self._data.t().contiguous().t() if need_t else None
        return w8, self._scale_inv, w8t, (self._scale_inv if need_t else None)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP_GATHERED:
            w = args[0]
            size = args[1] if len(args) > 1 else w.size()
            if list(size) == list(w.size()):
                return Fp8GatheredWeight(w._data, w._scale_inv, w.dtype)
        if func._schema.is_mutable:
            raise RuntimeError(f"{func}: the FP8 weight gathered by FSDP2 is read-only (change the sharded "
                               f"parameter instead)")
        args, kwargs = tree_map_only(Fp8GatheredWeight, Fp8GatheredWeight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Turning it on (before fully_shard) and keeping it out of checkpoints
# ----------------------------------------------------------------------------------------------------
def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata):
    """State-dict hook: the master weight as a plain tensor (a DTensor over it under FSDP2), sharing storage
    with the parameter, so checkpoints never hold the subclass and loading into the value writes through."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None:
        return
    local = getattr(value, "_local_tensor", value)
    if not isinstance(local, Fp8ShardedWeight):
        return
    if local is value:
        state_dict[key] = local._tensor
        return
    from torch.distributed.tensor import DTensor
    with torch.no_grad():
        state_dict[key] = DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                                             shape=value.shape, stride=value.stride())


def enable_fp8_all_gather(model: nn.Module, shard_size: int, param_dtype: torch.dtype | None = None) -> list[str]:
    """Wrap the weight of every Fp8Linear of `model` whose recipe is "delayed" in an Fp8ShardedWeight, so that
    fully_shard (called next) gathers it in FP8. param_dtype: the mp_policy's param_dtype that fully_shard will
    get (shards are rounded to it before the cast, as the plain gather would). shard_size: ranks a weight is
    sharded over; a weight whose
    out_features it does not divide stays as it is (its shards would differ in size, which the all-gather
    extension cannot pad), and so does one shared with another module. Returns the names of the wrapped
    layers. Call before fully_shard and before the optimizer is made (the Parameter objects are replaced)."""
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"enable_fp8_all_gather: shard_size={shard_size!r}; expected a positive int")
    owners = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    wrapped = []
    for name, m in model.named_modules():
        if not isinstance(m, Fp8Linear) or m.fp8_state.recipe.scaling != "delayed":
            continue
        w = m.weight
        if isinstance(w, Fp8ShardedWeight) or w.device.type == "meta":
            continue
        if m.out_features % shard_size or owners[id(w)] > 1 or type(w.data) is not torch.Tensor:
            continue
        m.weight = nn.Parameter(Fp8ShardedWeight(w.detach(), m, param_dtype), requires_grad=w.requires_grad)
        if not getattr(m, "_tilewise_fp8_sd_hook", False):
            m._register_state_dict_hook(_plain_weight_in_state_dict)
            m._tilewise_fp8_sd_hook = True
        wrapped.append(name)
    return wrapped
