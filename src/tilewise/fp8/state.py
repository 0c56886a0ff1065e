"""FP8 scaling state: one set of device tensors for every scaled tensor of a model.

Each scaled tensor (an Fp8Linear's input, weight and output gradient) owns a slot t. The casts fold their
amax into amax_history[0, t] (row 0 is the step in progress, contiguous across slots, so the cross-rank
reduction is one all_reduce). Fp8State.step(), called once after each optimizer step, updates every scale
with a handful of batched tensor ops on the device: no .item(), no host round trip. A non-finite amax
leaves that slot's scale as it was, counts in `skipped`, and enters the history as 0.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .recipe import Fp8Recipe, as_recipe, fp8_max

_PERSISTENT = ("amax_history", "scale", "scale_inv", "skipped", "steps")


def _aligned_vector(n: int, device) -> torch.Tensor:
    """A float32 (n,) vector of ones whose every element starts a 16-byte block (a strided view of (n, 4)):
    the one-element views of scale_inv go to torch._scaled_mm, whose cuBLASLt scales must be 16-byte aligned."""
    return torch.ones(n, 4, dtype=torch.float32, device=device)[:, 0]


class Fp8State:
    """Amax histories, scales and counters of `len(dtypes)` scaled tensors, all on one device.

    amax_history (history_len, T) float32; scale, scale_inv (T,) float32 (quantize with scale, dequantize
    with scale_inv); skipped (T,) int64, updates skipped for a non-finite amax; steps () int64.
    """

    def __init__(self, recipe: Fp8Recipe | str, dtypes: Sequence[torch.dtype], names: Sequence[str] | None = None,
                 device=None, group=None):
        self.recipe = as_recipe(recipe)
        self.dtypes = list(dtypes)
        for d in self.dtypes:
            fp8_max(d)  # raises on a non-FP8 dtype
        self.names = list(names) if names is not None else [f"t{i}" for i in range(len(self.dtypes))]
        if len(self.names) != len(self.dtypes):
            raise ValueError(f"Fp8State: {len(self.names)} names for {len(self.dtypes)} dtypes")
        self.group = group
        T, H = len(self.dtypes), self.recipe.history_len
        device = torch.device(device if device is not None else "cpu")
        self.amax_history = torch.zeros(H, T, dtype=torch.float32, device=device)
        self.scale = _aligned_vector(T, device)
        self.scale_inv = _aligned_vector(T, device)
        self.skipped = torch.zeros(T, dtype=torch.int64, device=device)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self.fp8_max = torch.tensor([fp8_max(d) for d in self.dtypes], dtype=torch.float32, device=device)
        # Host-side flags, never read from tensor values: `warm` turns on delayed scaling once a step()
        # has filled the history (until then casts use current scaling); `generation` invalidates
        # the per-step FP8 weight caches.
        self.current = self.recipe.scaling == "current"
        self.warm = False
        self.generation = 0
        self._views = {}

    @classmethod
    def for_linears(cls, recipe, names: Sequence[str], device=None, group=None) -> "Fp8State":
        """Three slots per linear layer, in order input, weight, output gradient."""
        recipe = as_recipe(recipe)
        dtypes, slot_names = [], []
        for n in names:
            dtypes += [recipe.fwd_dtype, recipe.fwd_dtype, recipe.bwd_dtype]
            slot_names += [f"{n}.input", f"{n}.weight", f"{n}.grad_output"]
        return cls(recipe, dtypes, slot_names, device=device, group=group)

    @property
    def device(self) -> torch.device:
        return self.scale.device

    @property
    def num_tensors(self) -> int:
        return len(self.dtypes)

    def to(self, device) -> "Fp8State":
        """Move every tensor to `device` (in place; returns self)."""
        device = torch.device(device)
        if device != self.device:
            for name in _PERSISTENT + ("fp8_max",):
                value = getattr(self, name)
                if name in ("scale", "scale_inv"):
                    moved = _aligned_vector(value.numel(), device)
                    moved.copy_(value)
                    value = moved
                setattr(self, name, value.to(device))
            self._views.clear()
            self.generation += 1
        return self

    def views(self, slot: int):
        """(scale, scale_inv, int32 view of the amax of the step in progress) of one slot: one-element views,
        made once (a view costs about as much host time as a kernel launch)."""
        v = self._views.get(slot)
        if v is None:
            v = self._views[slot] = (self.scale[slot:slot + 1], self.scale_inv[slot:slot + 1],
                                     self.amax_history[0, slot:slot + 1].view(torch.int32))
        return v

    # -- the per-step update --------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_amaxes(self, group=None) -> None:
        """MAX-reduce this step's amaxes over the ranks of `group` in one all_reduce (no-op when
        torch.distributed is not initialized or has one rank). NaN is sent as inf first, since a MAX
        reduction may drop NaN but never drops inf."""
        group = group if group is not None else self.group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        cur = self.amax_history[0]
        torch.nan_to_num_(cur, nan=float("inf"), posinf=float("inf"))  # posinf: inf must stay inf
        dist.all_reduce(cur, op=dist.ReduceOp.MAX, group=group)

    @torch.no_grad()
    def step(self, reduce: bool = True) -> None:
        """Close the step: reduce amaxes across ranks, update scales from the history, roll it.

        Call once per optimizer step, after optimizer.step() (also invalidates the FP8 weight caches).
        """
        if reduce:
            self.reduce_amaxes()
        hist = self.amax_history
        cur = hist[0]
        finite = torch.isfinite(cur)
        self.skipped.add_((~finite).to(torch.int64))
        cur.copy_(torch.where(finite, cur, torch.zeros_like(cur)))
        amax = hist.amax(dim=0) if self.recipe.amax_compute == "max" else cur
        fresh = self.fp8_max / amax * (2.0 ** -self.recipe.margin)
        ok = finite & (amax > 0) & torch.isfinite(fresh)
        self.scale.copy_(torch.where(ok, fresh, self.scale))
        torch.reciprocal(self.scale, out=self.scale_inv)
        hist.copy_(torch.roll(hist, 1, dims=0))
        hist[0].zero_()
        self.steps.add_(1)
        self.warm = True
        self.generation += 1

    def skipped_total(self) -> torch.Tensor:
        """Skipped scale updates summed over slots (a device tensor; .item() it only when logging)."""
        return self.skipped.sum()

    # -- checkpoint -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Tensors only (clones): amax_history, scale, scale_inv, skipped, steps."""
        return {name: getattr(self, name).detach().clone() for name in _PERSISTENT}

    def load_state_dict(self, state_dict: dict) -> None:
        missing = [n for n in _PERSISTENT if n not in state_dict]
        if missing:
            raise ValueError(f"Fp8State.load_state_dict: missing {missing}; expected keys {list(_PERSISTENT)}")
        for name in _PERSISTENT:
            mine, theirs = getattr(self, name), state_dict[name]
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
                got = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
                raise ValueError(f"Fp8State.load_state_dict: {name} has shape {got}; expected {tuple(mine.shape)} "
                                 f"(history_len={self.recipe.history_len}, {self.num_tensors} scaled tensors)")
            mine.copy_(theirs)
        # Load time, not the training step: one host read decides whether delayed scales are usable.
        self.warm = bool(self.steps.item() > 0)
        self.generation += 1

    def __repr__(self) -> str:
        return (f"Fp8State({self.recipe}, tensors={self.num_tensors}, device={self.device}, "
                f"warm={self.warm})")


def reduce_amaxes(state: Fp8State, group=None) -> None:
    """MAX-reduce the step's amaxes of `state` across ranks in one batched collective (see Fp8State)."""
    state.reduce_amaxes(group)
