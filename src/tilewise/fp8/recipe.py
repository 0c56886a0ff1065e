"""FP8 formats and scaling recipes.

E4M3 (max 448, 3 mantissa bits) has the precision forward tensors want; E5M2 (max 57344, 2 mantissa bits)
has the range gradients want. A recipe picks the formats and how per-tensor scales are found:
- "delayed": scale = fp8_max / amax / 2^margin, amax taken from a history of the last `history_len`
  steps ("max" of it, or the "most_recent" entry); the cast uses last step's scale, so it is one pass.
- "current": scale from this tensor's own amax, computed just before the cast (one extra read).
- "blockwise": a scale per 1x128 segment of every GEMM operand along its contraction dimension, from the
  segment's own amax in the same pass as the cast (no history); the amax history is kept for logging and
  for counting non-finite steps. See tilewise.fp8.linear for the layouts and how it relates to DeepSeek-V3.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.fp8_cast import FP8_MAX

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

SCALINGS = ("delayed", "current", "blockwise")
FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE = ("max", "most_recent")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FP8_MAX:
        raise TypeError(f"fp8_max: {dtype} is not an FP8 dtype; expected torch.float8_e4m3fn or torch.float8_e5m2")
    return FP8_MAX[dtype]


@dataclass(frozen=True)
class Fp8Recipe:
    """How Fp8Linear scales its tensors.

    scaling: "delayed", "current" or "blockwise". formats: "hybrid" (E4M3 activations and weights, E5M2 gradients) or
    "e4m3" (everything E4M3). history_len, amax_compute: the delayed amax history and how a scale is read
    from it (current scaling keeps the history too, for the fallback scale and for logging). margin: scales
    are divided by 2^margin, headroom against growth between steps.
    """
    scaling: str = "delayed"
    formats: str = "hybrid"
    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe: scaling={self.scaling!r}; expected one of {SCALINGS}")
        if self.formats not in FORMATS:
            raise ValueError(f"Fp8Recipe: formats={self.formats!r}; expected one of {FORMATS}")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"Fp8Recipe: amax_compute={self.amax_compute!r}; expected one of {AMAX_COMPUTE}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"Fp8Recipe: history_len={self.history_len!r}; expected an int >= 1")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Fp8Recipe: margin={self.margin!r}; expected an int >= 0")

    @property
    def fwd_dtype(self) -> torch.dtype:
        """Format of activations and weights."""
        return E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        """Format of output gradients."""
        return E5M2 if self.formats == "hybrid" else E4M3


def as_recipe(recipe) -> Fp8Recipe:
    """An Fp8Recipe from a recipe or from a config string ("delayed", "current" or "blockwise"; hybrid
    formats)."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str):
        return Fp8Recipe(scaling=recipe)
    raise TypeError(f"FP8 recipe {recipe!r}: expected an Fp8Recipe or one of {SCALINGS}")


def recipe_from_config(fp8_cfg) -> Fp8Recipe | None:
    """The recipe of a config's fp8 section (recipe, format, history_len, amax_compute, margin); None when
    recipe is "off"."""
    if fp8_cfg.recipe == "off":
        return None
    return Fp8Recipe(scaling=fp8_cfg.recipe, formats=fp8_cfg.format, history_len=fp8_cfg.history_len,
                     amax_compute=fp8_cfg.amax_compute, margin=fp8_cfg.margin)
