"""FastLauncher: the key separates every call Triton compiles separately; the direct launch passes what
Triton's own launch passes; everything unusual takes the normal launch.

On CPU a real JITFunction stands in whose `run` (Triton's launch) is replaced by a recorder returning a fake
compiled kernel, so the direct launches can be checked argument by argument. The gpu-marked tests compare
fast and normal launches bitwise on the H200 and check that an unaligned view never runs a kernel built for
aligned pointers.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from tilewise.ops import launch
from tilewise.ops.launch import FastLauncher, normal_launches


def _signature(X, Y, N, scale, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    """The stand-in kernel's parameters: two pointers, an int, a float, a bool, two constexprs (one default)."""


class FakeCompiled:
    """What Triton's launch returns: a launcher (recording its calls), a function handle, metadata."""

    def __init__(self, calls):
        self.calls = calls
        self.function = 1234
        self.packed_metadata = (4, 1, 0)

    def run(self, *args):
        self.calls.append(("direct", args))


@pytest.fixture
def fake(monkeypatch):
    """A JITFunction whose normal launch is recorded; the driver's device and stream replaced."""
    kernel = JITFunction(_signature)
    calls = []
    compiled = {}

    def run(*args, grid, warmup, **meta):
        calls.append(("normal", grid, args, meta))
        key = repr(sorted(meta.items()))
        return compiled.setdefault(key, FakeCompiled(calls))

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(launch, "_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_get_stream", lambda device: 777)
    return SimpleNamespace(kernel=kernel, launcher=FastLauncher(kernel), calls=calls)


def tensors(n=64, dtype=torch.float32):
    return torch.randn(n, dtype=dtype), torch.empty(n, dtype=dtype)


def test_second_call_launches_the_compiled_kernel_directly(fake):
    x, y = tensors()
    got = fake.launcher((4,), x, y, 64, 0.5, True, BLOCK=32)
    assert [c[0] for c in fake.calls] == ["normal"]
    again = fake.launcher((4, 2), x, y, 64, 0.5, True, BLOCK=32)
    assert again is got and [c[0] for c in fake.calls] == ["normal", "direct"]
    # grid padded to 3 dims, the stream, the handle, metadata, no launch metadata or hooks, then every
    # argument in signature order: the positional ones, BLOCK from meta, EXTRA's default
    assert fake.calls[1][1] == (4, 2, 1, 777, 1234, (4, 1, 0), None, None, None, x, y, 64, 0.5, True, 32, 3)
    assert fake.launcher.fast_launches == 1 and fake.launcher.normal_launches == 1


@pytest.mark.parametrize("change", ["unaligned view", "dtype", "int class", "constexpr", "constexpr type",
                                    "option", "bool for int"])
def test_what_triton_specializes_on_gets_a_normal_launch_first(fake, change):
    x, y = tensors()
    base = dict(args=[x, y, 64, 0.5, True], meta=dict(BLOCK=32, num_warps=4))
    fake.launcher((1,), *base["args"], **base["meta"])
    fake.launcher((1,), *base["args"], **base["meta"])
    args, meta = list(base["args"]), dict(base["meta"])
    if change == "unaligned view":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.double()
    elif change == "int class":
        args[2] = 65                # 64 is divisible by 16, 65 is not
    elif change == "constexpr":
        meta["BLOCK"] = 64
    elif change == "constexpr type":
        meta["BLOCK"] = 32.0        # == 32 and the same hash, another constexpr for Triton
    elif change == "option":
        meta["num_warps"] = 8
    elif change == "bool for int":
        args[2] = True              # == 1 == True in a tuple key; u1 against constexpr 1 for Triton
        fake.launcher((1,), *args[:2], 1, *args[3:], **meta)
    kinds_before = [c[0] for c in fake.calls]
    fake.launcher((1,), *args, **meta)
    assert [c[0] for c in fake.calls] == kinds_before + ["normal"]
    fake.launcher((1,), *args, **meta)
    assert [c[0] for c in fake.calls] == kinds_before + ["normal", "direct"]


def test_same_classes_share_an_entry(fake):
    """Values Triton does not tell apart (ints of one class, other floats, other aligned tensors) launch
    directly, with the new values."""
    x, y = tensors()
    fake.launcher((1,), x, y, 64, 0.5, False, BLOCK=32)
    x2, y2 = tensors(128)
    fake.launcher((1,), x2, y2, 4096, 2.0, True, BLOCK=32)
    assert [c[0] for c in fake.calls] == ["normal", "direct"]
    assert fake.calls[1][1][9:14] == (x2, y2, 4096, 2.0, True)


def test_key_classes_refine_tritons_specialization():
    """Two arguments Triton specializes differently (its own native specialization, however its flags are
    set) always get different key classes."""
    x = torch.zeros(64, dtype=torch.bfloat16)
    pool = [x, x[1:], x[8:], x[2:], x.float(), x.float()[1:], x.half(), 0, 1, 2, 15, 16, 17, 2 ** 31 - 1, 2 ** 31,
            2 ** 31 + 16, -2 ** 31, -2 ** 31 - 1, -16, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1, -2 ** 63, True, False,
            0.0, 1.0, 2.5, None]
    from triton.tools.tensor_descriptor import TensorDescriptor
    m = torch.zeros(64, 64, dtype=torch.bfloat16)
    pool += [TensorDescriptor(t, list(t.shape), list(t.stride()), block)
             for t in (m, m.half(), m.float(), m[:, :32]) for block in ([32, 64], [64, 64], [16, 32])
             if t.shape[1] >= block[1] or t.stride(0) == 64]
    native = triton._C.libtriton.native_specialize_impl
    for specialize in (True, False):
        for align in (True, False):
            for a in pool:
                for b in pool:
                    if native(BaseBackend, a, False, specialize, align) != native(BaseBackend, b, False, specialize,
                                                                                  align):
                        assert launch._arg_class(a) != launch._arg_class(b), (a, b)
    assert launch._arg_classes(pool) == tuple(launch._arg_class(a) for a in pool)      # the inline copy


def test_gluon_descriptor_classes_tell_their_layouts_apart():
    """Gluon compiles a host descriptor's shared-memory layout into the kernel: descriptors that differ in
    dtype, block or layout get different key classes; an equal layout in another object shares one."""
    if launch.GluonTensorDescriptor is None:
        pytest.skip("no Gluon in this Triton")
    from triton.experimental.gluon import language as gl
    from triton.tools.tensor_descriptor import TensorDescriptor
    m = torch.zeros(64, 64, dtype=torch.bfloat16)

    def desc(t, block, layout):
        return launch.GluonTensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    def layout(swizzle=128, transposed=False):
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2, transposed=transposed)
    layouts = [layout(), layout(64), layout(transposed=True)]
    classes = [launch._arg_class(desc(t, block, lay)) for t in (m, m.half()) for block in ([32, 64], [64, 64])
               for lay in layouts]
    assert len(set(classes)) == len(classes)
    assert launch._arg_class(desc(m, [32, 64], layout())) == classes[0]
    assert launch._arg_class(TensorDescriptor(m, list(m.shape), list(m.stride()), [32, 64])) not in classes
    assert launch._arg_classes([desc(m, [64, 64], layouts[1]), 16]) == (classes[4], launch._arg_class(16))


def spoil(fake, how):
    """A pre-run hook on the kernel, or a global it read at compile time changed since: Triton's launch
    handles both."""
    if how == "a pre-run hook":
        fake.kernel.pre_run_hooks.append(lambda *a, **k: None)
    elif how == "a changed global":
        scope = {"G": 1}
        fake.kernel.used_global_vals = {("G", id(scope)): (1, scope)}
        scope["G"] = 2


@pytest.mark.parametrize("how", ["normal_launches()", "a launch hook", "a pre-run hook", "a changed global",
                                 "a callable grid"])
def test_normal_launch_when(fake, how, monkeypatch):
    x, y = tensors()
    fake.launcher((1,), x, y, 64, 0.5, True, BLOCK=32)
    grid = (1,)
    if how == "a launch hook":
        hooks = launch._knobs.runtime.launch_enter_hook
        if not hasattr(hooks, "add"):
            pytest.skip("this Triton's launch hook is not a hook chain")
        hook = lambda metadata: None        # noqa: E731
        hooks.add(hook)
        try:
            assert launch._hooks_installed()
            fake.launcher(grid, x, y, 64, 0.5, True, BLOCK=32)
        finally:
            hooks.remove(hook)
        assert not launch._hooks_installed()
    else:
        spoil(fake, how)
        if how == "a callable grid":
            grid = lambda meta: (1,)        # noqa: E731
        if how == "normal_launches()":
            with normal_launches():
                fake.launcher(grid, x, y, 64, 0.5, True, BLOCK=32)
            assert launch.fast_launch_enabled()
        else:
            fake.launcher(grid, x, y, 64, 0.5, True, BLOCK=32)
    assert [c[0] for c in fake.calls] == ["normal", "normal"]


@pytest.mark.parametrize("call", ["constexpr positionally", "runtime argument by keyword", "unhashable meta",
                                  "a dtype argument"])
def test_calls_the_key_cannot_cover_stay_normal(fake, call):
    x, y = tensors()
    for _ in range(3):
        if call == "constexpr positionally":
            fake.launcher((1,), x, y, 64, 0.5, True, 32)
        elif call == "runtime argument by keyword":
            fake.launcher((1,), x, y, 64, 0.5, flag=True, BLOCK=32)
        elif call == "unhashable meta":
            fake.launcher((1,), x, y, 64, 0.5, True, BLOCK=[32])
        else:
            fake.launcher((1,), x, torch.float32, 64, 0.5, True, BLOCK=32)
    assert [c[0] for c in fake.calls] == ["normal"] * 3 and fake.launcher.fast_launches == 0


def test_direct_launch_passes_what_the_bound_launch_passes(fake):
    """BoundLauncher.direct: None until the arguments' classes have a compiled kernel; then a launch whose
    Triton arguments are the keyed direct launch's, with the new call's values."""
    bound = fake.launcher.bind(BLOCK=32)
    x, y = tensors()
    assert bound.direct((x, y, 64, 0.5, True)) is None          # nothing compiled for these classes yet
    bound((2,), x, y, 64, 0.5, True)
    launch_ = bound.direct((x, y, 64, 0.5, True))
    x2, y2 = tensors(128)
    launch_((3, 2), x2, y2, 4096, 2.0, False)
    bound((3, 2), x2, y2, 4096, 2.0, False)
    assert [c[0] for c in fake.calls] == ["normal", "direct", "direct"]
    assert fake.calls[1][1] == fake.calls[2][1] == (3, 2, 1, 777, 1234, (4, 1, 0), None, None, None, x2, y2, 4096,
                                                     2.0, False, 32, 3)
    assert bound.direct((x[1:], y, 64, 0.5, True)) is None      # an unaligned view: another kernel


def test_planned_tells_a_plan_to_wait_or_to_keep_the_keyed_path(fake):
    """BoundLauncher.planned: None while fast launches are switched off (a plan asks again later), False
    where no direct launch covers the arguments, else the direct launch."""
    bound = fake.launcher.bind(BLOCK=32)
    x, y = tensors()
    assert bound.planned((x, y, 64, 0.5, True)) is False        # nothing compiled for these classes yet
    bound((2,), x, y, 64, 0.5, True)
    with launch.normal_launches():
        assert bound.planned((x, y, 64, 0.5, True)) is None
    assert callable(bound.planned((x, y, 64, 0.5, True)))


@pytest.mark.parametrize("how", ["normal_launches()", "a pre-run hook", "a changed global", "another device",
                                 "a changed knob"])
def test_direct_launch_takes_the_keyed_path_when(fake, how, monkeypatch):
    bound = fake.launcher.bind(BLOCK=32)
    x, y = tensors()
    bound((1,), x, y, 64, 0.5, True)
    launch_ = bound.direct((x, y, 64, 0.5, True))
    spoil(fake, how)
    if how == "another device":
        monkeypatch.setattr(launch, "_get_device", lambda: 1)
    elif how == "a changed knob":
        monkeypatch.setattr(launch, "_knob_state", lambda: ("changed",))
    if how == "normal_launches()":
        with normal_launches():
            launch_((1,), x, y, 64, 0.5, True)
    else:
        launch_((1,), x, y, 64, 0.5, True)
    assert [c[0] for c in fake.calls] == ["normal", "normal"]


def _c_launcher_module(fmt):
    """A stand-in for Triton 3.6's CUDA driver module: its argument format and a CudaLauncher-like class
    whose C entry point records its calls."""
    import types
    module = types.ModuleType("fake_triton_cuda_driver")
    module._BASE_ARGS_FORMAT = fmt

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, calls):
            self.calls = calls

        def launch(self, *args):
            self.calls.append(("c", args))

        def __call__(self, *args):
            self.calls.append(("python", args))
    CudaLauncher.__module__ = module.__name__
    module.CudaLauncher = CudaLauncher
    sys.modules[module.__name__] = module
    return module


@pytest.mark.parametrize("fmt", ["iiiKKppOOOOOO", "iiiKKOOOOO"])
def test_c_entry_point_gets_what_cudalauncher_call_would_pass(fake, fmt):
    """A 3.6-style CudaLauncher without scratch buffers is called at its C entry point, with the flags and
    empty scratch arguments its __call__ adds; an unknown argument format keeps the launcher's __call__."""
    module = _c_launcher_module(fmt)
    try:
        c_calls = []
        runner = module.CudaLauncher(c_calls)
        fake.launcher((1,), *tensors(), 64, 0.5, True, BLOCK=32)
        compiled = next(iter(fake.launcher._entries.values())).compiled
        compiled.run = runner
        fake.launcher._entries.clear()
        x, y = tensors()
        bound = fake.launcher.bind(BLOCK=32)
        bound((1,), x, y, 64, 0.5, True)            # keyed again: the entry now wraps runner
        direct = bound.direct((x, y, 64, 0.5, True))
        bound((2, 3), x, y, 64, 0.5, True)
        direct((5,), x, y, 32, 0.25, False)
        if fmt == "iiiKKppOOOOOO":
            assert c_calls == [("c", (2, 3, 1, 777, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                      x, y, 64, 0.5, True, 32, 3)),
                               ("c", (5, 1, 1, 777, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                      x, y, 32, 0.25, False, 32, 3))]
        else:
            assert [c[0] for c in c_calls] == ["python", "python"]
            assert c_calls[1][1] == (5, 1, 1, 777, 1234, (4, 1, 0), None, None, None, x, y, 32, 0.25, False, 32, 3)
    finally:
        del sys.modules[module.__name__]


@triton.jit
def _scale_kernel(X, Y, N, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=ok) * alpha, mask=ok)


def test_interpreter_and_switch_take_the_normal_launch(device):
    """Under TRITON_INTERPRET=1 the kernel is no JITFunction: every call is Triton's own, and correct."""
    launcher = FastLauncher(_scale_kernel)
    x = torch.randn(100, device=device)
    for n in (100, 37):
        y = torch.full_like(x, float("nan"))
        launcher((triton.cdiv(n, 32),), x, y, n, 3.0, BLOCK=32)
        assert torch.equal(y[:n], x[:n] * 3.0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not launcher.fast and launcher.normal_launches == 2
    env = dict(os.environ, TILEWISE_FAST_LAUNCH="0")
    out = subprocess.run([sys.executable, "-c", "from tilewise.ops import launch; print(launch.fast_launch_enabled())"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------------------------------------- H200

@pytest.mark.gpu
def test_gpu_direct_launch_runs_and_an_unaligned_view_gets_its_own_kernel(device):
    """Aligned calls share one compiled kernel and launch directly; a view starting at element 1 gets the
    kernel Triton builds for it (another one), and both compute the right thing."""
    launcher = FastLauncher(_scale_kernel)
    base = torch.randn(1 << 20, device=device)
    y = torch.empty_like(base)
    n = base.numel() - 64
    grid = (triton.cdiv(n, 1024),)
    first = launcher(grid, base, y, n, 2.0, BLOCK=1024)
    again = launcher(grid, base[16:], y[16:], n, 0.5, BLOCK=1024)
    torch.cuda.synchronize()
    assert again is first and launcher.fast_launches == 1
    assert torch.equal(y[16:n + 16], base[16:n + 16] * 0.5)
    odd = launcher(grid, base[1:], y[1:], n, 3.0, BLOCK=1024)
    assert odd is not first and launcher.normal_launches == 2
    launcher(grid, base[1:], y[1:], n, 3.0, BLOCK=1024)
    torch.cuda.synchronize()
    assert launcher.fast_launches == 2
    assert torch.equal(y[1:n + 1], base[1:n + 1] * 3.0)
