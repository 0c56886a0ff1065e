"""The C++ side of the norm op: norm_node.cpp, built on first use with torch's extension builder.

Why: a Python autograd node's backward runs on autograd's device worker thread, which must take the GIL and
run the node's Python (bench/host_threads.py: on the H200's host a no-work Python Function alone cost 135 us a
forward+backward there against 78 on the calling thread). norm_node.cpp's node does the prepared call's
allocations and launches in C++ on either thread, launching the kernels Triton compiled for the call
through cuLaunchKernel.

    plan = native.norm_plan(...)        # None where the extension or the call is not covered
    y, h = plan.apply(x, residual, weight, bias, x_bias)

The build needs a C++ compiler and ninja; where either is missing or the build fails, norm_extension()
returns None once (with a warning) and the op stays on its Python path. TILEWISE_NATIVE=0 (read at import)
or python_nodes() keeps it there.
Launch parameters come from each compiled kernel's signature (Triton's ASTSource: one type a parameter,
"constexpr" for those compiled in), as Triton's own launcher packs them: pointers and integers by value,
fp32 as its bits. Kernels with scratch buffers, clusters, cooperative grids or PDL are not covered.
Per call norm.py checks only the switches and launch hooks (launch.direct_launches_allowed), not Triton's
knobs or the kernels' globals as FastLauncher's direct launches do: a plan keeps the kernels it was built
with.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys
import threading
import time
import warnings

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "norm_node.cpp")
_LOCK = threading.Lock()
_STATE: dict = {}          # "module": the built extension or None, once tried; "launch": cuLaunchKernel's address


_BUILD = os.environ.get("TILEWISE_NATIVE", "1").strip() != "0"
_ON = [_BUILD]


def enabled() -> bool:
    return _ON[0]


@contextlib.contextmanager
def python_nodes():
    """The norm op keeps its Python autograd node inside the block (for A/B tests)."""
    old, _ON[0] = _ON[0], False
    try:
        yield
    finally:
        _ON[0] = old


def norm_extension():
    """The built extension module, or None (disabled, or the build failed: warned once)."""
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _build() if _BUILD else None
    return _STATE["module"]


def _build():
    try:
        from torch.utils import cpp_extension
        with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
        start = time.perf_counter()
        module = cpp_extension.load(name="tilewise_norm_node", sources=[_SOURCE], extra_cflags=["-O2"],
                                    with_cuda=with_cuda, verbose=False)
        if time.perf_counter() - start > 5:         # compiled now, not loaded from torch's extension cache
            print(f"tilewise: built the C++ norm node in {time.perf_counter() - start:.0f} s (kept in torch's "
                  f"extension cache)", file=sys.stderr)
        return module
    except Exception as e:      # noqa: BLE001 - no compiler, no ninja, a header missing: the Python path stays
        warnings.warn(f"tilewise: the C++ norm node did not build ({type(e).__name__}: {str(e)[:300]}); "
                      f"add_dropout_norm stays on its Python autograd node", RuntimeWarning, stacklevel=3)
        return None


_PLANS: list = []          # every NormPlan made: a node's backward holds its plan's address, so none is freed


def keep(plan):
    """Keep plan alive for the process (see _PLANS) and return it."""
    _PLANS.append(plan)
    return plan


def launch_address() -> int:
    """cuLaunchKernel's address in the CUDA driver (0 without one)."""
    if "launch" not in _STATE:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            _STATE["launch"] = ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value or 0
        except OSError:
            _STATE["launch"] = 0
    return _STATE["launch"]


def _param_bits(ty: str, value) -> int:
    """A non-pointer parameter's bytes, as Triton's launcher passes it."""
    if ty == "fp32":
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty in ("i1", "u1", "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64"):
        bits = int(ty[1:])
        return int(value) & ((1 << bits) - 1) if bits > 1 else int(bool(value))
    raise ValueError(f"a kernel parameter of type {ty!r}")


def launch_spec(entry, grid, args, slots):
    """(function, grid, threads, shared memory, params) for norm_node.cpp's Launch, from a FastLauncher entry
    (its compiled kernel and constexpr tail) and one call's positional args; slots: the tensors in the node's
    slot order (None where absent), every tensor in args being one of them. None where not covered."""
    compiled = entry.compiled
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False) or \
            getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "global_scratch_size", 0) or \
            getattr(meta, "profile_scratch_size", 0):
        return None
    signature = getattr(compiled.src, "signature", None)
    values = tuple(args) + tuple(entry.tail)
    if not isinstance(signature, dict) or len(signature) != len(values):
        return None
    slot_of = {}
    for i, t in enumerate(slots):
        if t is not None:
            slot_of.setdefault(id(t), i)
    params = []
    for ty, value in zip(signature.values(), values):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None
        if ty.startswith("*"):
            if id(value) not in slot_of:
                return None
            params.append((slot_of[id(value)], 0))
        else:
            try:
                params.append((-1, _param_bits(ty, value)))
            except ValueError:
                return None
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return int(compiled.function), [int(g) for g in grid], 32 * int(meta.num_warps), int(meta.shared), params
