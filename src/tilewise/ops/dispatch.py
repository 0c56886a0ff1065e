"""The dispatch switch: which implementation an op runs (see tilewise.ops for the rule)."""
from __future__ import annotations

import contextlib
import os

import torch

MODES = ("auto", "triton", "reference")
# Triton's interpreter (the kernels on CPU tensors): read once, as Triton reads it when it is imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _mode_from_env() -> str:
    mode = os.environ.get("TILEWISE_OPS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"TILEWISE_OPS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_mode = _mode_from_env()


def mode() -> str:
    """The dispatch mode in force: 'auto', 'triton' or 'reference'."""
    return _mode


@contextlib.contextmanager
def use(new_mode: str):
    """Run the ops inside the block with another dispatch mode ('auto', 'triton', 'reference')."""
    global _mode
    if new_mode not in MODES:
        raise ValueError(f"ops.use({new_mode!r}): expected one of {', '.join(MODES)}")
    old, _mode = _mode, new_mode
    try:
        yield
    finally:
        _mode = old


def use_triton(x: torch.Tensor) -> bool:
    """True when the op on tensor `x` should run its Triton kernel."""
    if _mode == "reference":
        return False
    return _mode == "triton" or x.is_cuda
