"""Fast kernel launches: after the first call, Triton's compiled kernel is launched directly.

`kernel[grid](*args, **meta)` runs JITFunction.run, ~100 us of Python a launch on a slow host (binding the
arguments, specializing each one, building the cache key, launch metadata), which is more than a
memory-bound kernel of a few hundred MB takes on an H200. FastLauncher keeps, per launch key, the
CompiledKernel that Triton returned for the first call with that key, and later calls its launcher directly,
the way JITFunction.run itself does at its end:

    launcher = FastLauncher(kernel)          # once, at import
    launcher(grid, *args, **meta)            # instead of kernel[grid](*args, **meta)
    bound = launcher.bind(**meta)            # or, where one meta serves many calls (a launch plan):
    bound(grid, *args)

The key must separate every call Triton would compile separately, or a launch could run a kernel built for
other arguments. It holds the current device, Triton's debug and instrumentation knobs, the meta keywords
(constexprs and options such as num_warps, with their values and types), and per positional argument a
class at least as fine as Triton's specialization of it:
    tensor  (dtype, data_ptr 16-byte aligned)
    int     1, or (divisible by 16, and i32 / u64 / i64 range)      (also where Triton does not specialize)
    float   fp32;  bool u1;  None
    TensorDescriptor  (base dtype, block shape, padding, tf32 flag, base 16-byte aligned)
    Gluon's TensorDescriptor  (the same, and its shared-memory layout)
Anything else (a torch.dtype, a numpy scalar) takes the normal launch every time. A key finer than Triton's
costs nothing but one more normal first call.

The normal launch is also taken: under the interpreter (TRITON_INTERPRET=1: the kernel is not a
JITFunction), with TILEWISE_FAST_LAUNCH=0 or inside `normal_launches()`, while launch hooks (a profiler),
pre-run hooks or a stages-inspection hook are installed, when a module global the kernel read has changed
(Triton then raises), for a callable grid, and for calls whose constexprs arrive positionally or whose
meta names a non-constexpr parameter. The compiled-kernel launch API used here, CompiledKernel.run(grid0,
grid1, grid2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args), is the
same in Triton 3.6 and 3.9; hooks may be None there, and constexpr values are passed (and ignored).
Where run is Triton 3.6's CudaLauncher and the kernel needs no scratch buffers, its C entry point is called
instead, with the arguments its __call__ would add: the format of that entry point's arguments,
_BASE_ARGS_FORMAT in Triton's CUDA driver module, is checked first, and anything else keeps run. (The norm
backward's row kernel on the H200's host, bench/host_threads.py at 3792021: 12.3 us a direct launch, checks
and __call__ included, against 6.7 for the C entry point alone, both with data_ptr ints as arguments.)
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import triton
from triton.runtime.jit import JITFunction

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:          # pragma: no cover - a Triton without host descriptors
    TensorDescriptor = None

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:          # pragma: no cover - a Triton without Gluon's Hopper API
    GluonTensorDescriptor = None

try:
    from triton import knobs as _knobs
except ImportError:          # pragma: no cover - a Triton before knobs: no fast path
    _knobs = None

_ENABLED = [os.environ.get("TILEWISE_FAST_LAUNCH", "1").strip() != "0"]


@contextlib.contextmanager
def normal_launches():
    """Every FastLauncher takes Triton's normal launch inside the block (for A/B tests)."""
    old, _ENABLED[0] = _ENABLED[0], False
    try:
        yield
    finally:
        _ENABLED[0] = old


def fast_launch_enabled() -> bool:
    return _ENABLED[0]


def direct_launches_allowed() -> bool:
    """No switch or hook asks for Triton's own launch: what a launch made outside this module (ops/native.py's)
    checks per call."""
    return _ENABLED[0] and _knobs is not None and not _hooks_installed()


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: triton.cdiv is a constexpr_function, microseconds of Python a call."""
    return -(-a // b)


class _Unkeyable(Exception):
    """An argument the key cannot classify: the call takes the normal launch."""


def _int_class(a: int):
    """1; else 2 (i32 range), 3 (u64 range) or 4 (i64 range), plus 16 when divisible by 16."""
    if a == 1:
        return 1
    size = 2 if -0x80000000 <= a <= 0x7FFFFFFF else 3 if a >= 0x8000000000000000 else 4
    return size + 16 if a % 16 == 0 else size


def _scalar_class(a):
    """A class of one non-tensor argument, at least as fine as Triton's specialization of it."""
    t = type(a)
    if t is int:
        return _int_class(a)
    if t is float:
        return "fp32"
    if t is bool:
        return "u1"
    if a is None:
        return None
    if t is TensorDescriptor:
        return _descriptor_class(a)
    if t is GluonTensorDescriptor:
        return _gluon_descriptor_class(a)
    raise _Unkeyable


def _descriptor_class(d):
    """A host TMA descriptor: Triton specializes on its dtype and block shape ('tensordesc<bf16[64, 128]>');
    padding, the tf32 flag and the base's alignment are added to be safe. Its shape and strides are
    runtime values, which the compiled kernel's launcher encodes on every call, as on the normal path."""
    return ("desc", d.base.dtype, tuple(d.block_shape), str(getattr(d, "padding", None)),
            bool(getattr(d, "round_f32_to_tf32", False)), d.base.data_ptr() & 15 == 0)


_LAYOUT_NAMES: dict = {}   # id(layout) -> (layout, repr): the kernels build their few layouts once (cached)


def _gluon_descriptor_class(d):
    """A Gluon host descriptor: _descriptor_class's fields and its shared-memory layout, which Gluon compiles
    into the kernel (its repr names every field; memoized per layout object, kept alive so its id stays its)."""
    layout = d.layout
    seen = _LAYOUT_NAMES.get(id(layout))
    if seen is None or seen[0] is not layout:
        seen = (layout, repr(layout))
        if len(_LAYOUT_NAMES) < 1 << 12:
            _LAYOUT_NAMES[id(layout)] = seen
    return ("gluon desc", d.base.dtype, tuple(d.block_shape), seen[1], d.padding, d.base.data_ptr() & 15 == 0)


def _arg_class(a):
    """A class of one positional argument, at least as fine as Triton's specialization of it."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    return _scalar_class(a)


_INT_CLASSES: dict = {}   # int -> _int_class: launches pass the same sizes and strides again and again


def _int_class_memo(a: int):
    c = _int_class(a)
    if len(_INT_CLASSES) < 1 << 16:
        _INT_CLASSES[a] = c
    return c


def _arg_classes(args) -> tuple:
    """_arg_class of every argument, with the int and tensor cases inline (this runs on every launch; one
    comprehension, since a loop's appends cost as much again). Int classes are never 0, so `or` finds misses."""
    get, tensor = _INT_CLASSES.get, torch.Tensor
    return tuple([(get(a) or _int_class_memo(a)) if a.__class__ is int
                  else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, tensor)
                  else _scalar_class(a) for a in args])


def _meta_key(meta: dict) -> tuple:
    """The meta keywords with their values' types (Triton compiles BLOCK=32 and BLOCK=32.0, or True and 1,
    separately, while they are equal and hash alike)."""
    return tuple(meta.items()), tuple(map(type, meta.values()))


# The current CUDA device and stream, as Triton's driver reports them (bound on first use; tests replace them).
_get_device = None
_get_stream = None


def _bind_driver():
    global _get_device, _get_stream
    driver = triton.runtime.driver.active
    _get_device, _get_stream = driver.get_current_device, driver.get_current_stream


def current_stream(device: torch.device):
    """The raw handle of the current stream of `device` (None on CPU): what keys per-stream scratch buffers."""
    if device.type != "cuda":
        return None
    if _get_stream is None:
        _bind_driver()
    return _get_stream(device.index if device.index is not None else _get_device())


def _knob_state() -> tuple:
    """Triton's global knobs that enter its cache key through the launch options."""
    rt, comp = _knobs.runtime, _knobs.compilation
    return (rt.debug, getattr(comp, "instrumentation_mode", None), getattr(comp, "fpsan_homomorphic_casts", None))


def _hooks_installed() -> bool:
    """A launch hook (a profiler such as proton) or a stages-inspection hook: Triton's path handles them."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave)) or \
        getattr(rt, "add_stages_inspection_hook", None) is not None


# The arguments of Triton 3.6's C launch function before the kernel's: grid (3), stream, function, cooperative
# grid, PDL, global and profile scratch, packed metadata, launch metadata, enter and exit hooks.
_C_LAUNCH_FORMAT = "iiiKKppOOOOOO"


def _c_launch(run):
    """run's C entry point and the two launch flags its __call__ passes (cooperative grid, PDL), when run is
    Triton 3.6's CudaLauncher of a kernel that needs no scratch buffer; else None (call run itself)."""
    driver_module = sys.modules.get(type(run).__module__)
    if getattr(driver_module, "_BASE_ARGS_FORMAT", None) != _C_LAUNCH_FORMAT:
        return None
    c_launch = getattr(run, "launch", None)
    if not callable(c_launch) or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return c_launch, (bool(run.launch_cooperative_grid), bool(run.launch_pdl))


class _Entry:
    """What a direct launch needs: the compiled kernel's launcher (or its C entry point and flags, see
    _c_launch), its handle and metadata, and the values of the parameters after the positional ones
    (constexprs from meta, else defaults), in signature order."""
    __slots__ = ("compiled", "run", "function", "packed_metadata", "tail", "c_launch", "coop", "pdl")

    def __init__(self, compiled, tail):
        self.compiled, self.tail = compiled, tail
        self.run, self.function, self.packed_metadata = compiled.run, compiled.function, compiled.packed_metadata
        c = _c_launch(self.run)
        self.c_launch, (self.coop, self.pdl) = (None, (False, False)) if c is None else c

    def __call__(self, g0, g1, g2, stream, args):
        if self.c_launch is not None:
            self.c_launch(g0, g1, g2, stream, self.function, self.coop, self.pdl, None, None, self.packed_metadata,
                          None, None, None, *args, *self.tail)
        else:
            self.run(g0, g1, g2, stream, self.function, self.packed_metadata, None, None, None, *args, *self.tail)


_NORMAL = object()      # the entry of a key whose calls always take the normal launch


class FastLauncher:
    """`launcher(grid, *args, **meta)` launches `kernel` as `kernel[grid](*args, **meta)` does, skipping
    JITFunction.run's Python after the first call with a given key (see the module docstring).
    `launcher.bind(**meta)` fixes the meta keywords once: `bound(grid, *args)` then skips hashing them."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.fast = isinstance(kernel, JITFunction) and _knobs is not None
        self._entries: dict = {}
        self.fast_launches = 0          # counts, for tests and the benchmark's record
        self.normal_launches = 0
        if self.fast:
            params = kernel.params
            self._names = [p.name for p in params]
            self._constexpr = {p.name for p in params if p.is_constexpr}
            self._defaults = {p.name: p.default for p in params if p.has_default}

    def __call__(self, grid, *args, **meta):
        try:
            meta_key = _meta_key(meta) if self.fast else None
            hash(meta_key)
        except TypeError:                   # an unhashable meta value: no key
            return self._normal(grid, args, meta, None)
        return self.launch(grid, args, meta, meta_key)

    def bind(self, **meta) -> "BoundLauncher":
        return BoundLauncher(self, meta)

    def launch(self, grid, args: tuple, meta: dict, meta_key):
        if not (self.fast and _ENABLED[0]) or meta_key is None:
            return self._normal(grid, args, meta, None)
        if _get_device is None:
            _bind_driver()
        device = _get_device()
        try:
            key = (device, _knob_state(), meta_key, _arg_classes(args))
        except _Unkeyable:
            return self._normal(grid, args, meta, None)
        entry = self._entries.get(key)
        if entry is None:
            return self._normal(grid, args, meta, key)
        if entry is _NORMAL or callable(grid) or self.kernel.pre_run_hooks or _hooks_installed() or \
                self._globals_changed():
            return self._normal(grid, args, meta, None)
        n = len(grid)
        entry(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), args)
        self.fast_launches += 1
        return entry.compiled

    def _normal(self, grid, args, meta, key):
        """Triton's own launch; with a key, keep what it compiled for the next calls."""
        self.normal_launches += 1
        compiled = self.kernel[grid](*args, **meta)
        if key is not None and key not in self._entries:
            self._entries[key] = self._entry(compiled, args, meta)
        return compiled

    def _entry(self, compiled, args, meta):
        """The entry of a new key, or _NORMAL when the call's shape is one the direct launch does not copy."""
        names = self._names
        if len(args) > len(names) or any(name in self._constexpr for name in names[:len(args)]):
            return _NORMAL                      # a constexpr passed positionally: its value is not in the key
        if any(name in names and name not in self._constexpr for name in meta):
            return _NORMAL                      # a runtime argument passed by keyword
        tail = []
        for name in names[len(args):]:
            if name in meta:
                tail.append(meta[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                return _NORMAL
        if self._globals_changed() or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return _NORMAL
        try:
            entry = _Entry(compiled, tuple(tail))
        except Exception:       # noqa: BLE001 - a CompiledKernel unlike 3.6's and 3.9's: stay on the normal path
            return _NORMAL
        return entry if entry.function is not None and callable(entry.run) else _NORMAL

    def _globals_changed(self) -> bool:
        """A module global the kernel read at compile time has another value now (Triton raises then)."""
        missing = object()
        for (name, _), (value, scope) in getattr(self.kernel, "used_global_vals", {}).items():
            if scope.get(name, missing) != value:
                return True
        return False


class BoundLauncher:
    """A FastLauncher with its meta keywords fixed (and keyed) once: `bound(grid, *args)`."""
    __slots__ = ("launcher", "meta", "meta_key")

    def __init__(self, launcher: FastLauncher, meta: dict):
        self.launcher, self.meta = launcher, dict(meta)
        try:
            self.meta_key = _meta_key(self.meta)
            hash(self.meta_key)
        except TypeError:
            self.meta_key = None

    def __call__(self, grid, *args):
        return self.launcher.launch(grid, args, self.meta, self.meta_key)

    def planned(self, args: tuple):
        """direct(args) as a launch plan takes it: None while fast launches are switched off (ask again
        later), False where the direct launch does not cover calls like args (the plan keeps the keyed path)."""
        if not _ENABLED[0]:
            return None
        return self.direct(args) or False

    def entry(self, args: tuple):
        """The entry (compiled kernel, constexpr tail) that `args`, launched once, keyed to; None where there is
        none or the direct launch does not cover such calls."""
        fl = self.launcher
        if not (fl.fast and _ENABLED[0]) or self.meta_key is None:
            return None
        if _get_device is None:
            _bind_driver()
        try:
            entry = fl._entries.get((_get_device(), _knob_state(), self.meta_key, _arg_classes(args)))
        except _Unkeyable:
            return None
        return None if entry is None or entry is _NORMAL else entry

    def direct(self, args: tuple):
        """`launch(grid, *args)` for the compiled kernel that `args` (already launched once) keyed to, without
        keying each call; None when there is no such kernel or the direct launch does not cover the call.
        The caller promises that every later call's arguments have the classes of `args` (dtypes, pointer
        alignments, int classes: its own cache key must imply them). The device, the switch, Triton's knobs
        and hooks and the kernel's globals are still checked on every call; a call that fails a check takes
        the keyed path."""
        fl = self.launcher
        entry = self.entry(args)
        if entry is None:
            return None
        device, knobs = _get_device(), _knob_state()
        c_launch, function, metadata, tail = entry.c_launch, entry.function, entry.packed_metadata, entry.tail
        coop, pdl, run = entry.coop, entry.pdl, entry.run

        def launch(grid, *a):
            if not _ENABLED[0] or _get_device() != device or _knob_state() != knobs or fl.kernel.pre_run_hooks \
                    or _hooks_installed() or fl._globals_changed():
                return fl.launch(grid, a, self.meta, self.meta_key)
            n = len(grid)
            if c_launch is not None:        # (the entry's __call__, inline: a call costs as much as a check)
                c_launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), function,
                         coop, pdl, None, None, metadata, None, None, None, *a, *tail)
            else:
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), function,
                    metadata, None, None, None, *a, *tail)
            fl.fast_launches += 1
        return launch
