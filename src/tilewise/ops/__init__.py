"""The ops every tilewise model calls, and the one rule that picks their implementation.

Dispatch rule:
- CUDA tensors run the Triton kernel; CPU tensors run the PyTorch reference.
- ``TILEWISE_OPS=triton`` (or ``with tilewise.ops.use("triton"):``) runs the Triton kernels on CPU
  tensors too; that needs ``TRITON_INTERPRET=1`` in the environment before triton is imported.
- ``TILEWISE_OPS=reference`` (or ``use("reference")``) forces the reference anywhere.

Each op lives in one file beside this one: its Triton kernels, the launcher, the autograd.Function and
the PyTorch reference. Each public function validates its arguments once, for both paths.
"""
from __future__ import annotations

from .dispatch import MODES, mode, use, use_triton
from .activation import bias_gelu, swiglu
from .attention import flash_attention, flash_attention_qkv, sdpa_attention
from .cross_entropy import cross_entropy, linear_cross_entropy
from .embedding import embedding
from .fp8_attention import fp8_flash_attention
from .linear import linear
from .mlp import gelu_mlp
from .norm import add_dropout_norm
from .rope import apply_rope, rope_cache

__all__ = [
    "MODES", "mode", "use", "use_triton",
    "flash_attention", "flash_attention_qkv", "fp8_flash_attention", "sdpa_attention", "add_dropout_norm",
    "bias_gelu", "embedding", "gelu_mlp", "swiglu",
    "cross_entropy", "linear_cross_entropy", "linear", "apply_rope", "rope_cache",
]
