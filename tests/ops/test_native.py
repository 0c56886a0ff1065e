"""norm_node.cpp (ops/native.py): the C++ autograd node of prepared norm calls.

On the CPU the node runs with a stand-in for cuLaunchKernel (a ctypes callback that records each launch and
does the kernels' work in torch), so what is tested here is the node's own part: the parameters it packs
(tensor slots' pointers, constants' bits), the tensors it allocates, the gradients it returns (dresidual as
dx's tensor where the plan says so), and the hand-off to the Python fallback for other gradient layouts.
tests/ops/test_norm.py's gpu tests compare the real node with the Python path on the GPU.
"""
import ctypes
import struct
import types

import pytest
import torch

from tilewise.ops import native

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
FORWARD, ROWS, SUMS = 11, 22, 33          # stand-in kernel handles


@pytest.fixture(scope="module")
def ext():
    module = native.norm_extension()
    if module is None:
        pytest.skip("the C++ norm node did not build here (no compiler or ninja)")
    return module


def _u64(params, i):
    return ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64)).contents.value


class FakeDriver:
    """Records each launch: handle, grid, threads, shared memory, and its n_params[handle] parameters' values
    followed by the two scratch pointers. Does no work."""
    def __init__(self, n_params):
        self.launches, self.n_params = [], n_params
        self.callback = LAUNCH(self._launch)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        values = [_u64(params, i) for i in range(self.n_params[function] + 2)]
        self.launches.append((function, (gx, gy, gz), bx, shared, values))
        return 0


def test_param_bits_follow_triton_types():
    assert native._param_bits("i32", -1) == 0xFFFFFFFF
    assert native._param_bits("i64", 5) == 5
    assert native._param_bits("fp32", 1.5) == struct.unpack("<I", struct.pack("<f", 1.5))[0]
    assert native._param_bits("i1", 3) == 1
    with pytest.raises(ValueError, match="fp64"):
        native._param_bits("fp64", 1.0)


def _entry(signature, tail=(), **meta):
    md = types.SimpleNamespace(num_ctas=1, launch_pdl=False, launch_cooperative_grid=False, global_scratch_size=0,
                               profile_scratch_size=0, num_warps=4, shared=1024, **meta)
    compiled = types.SimpleNamespace(function=FORWARD, metadata=md, src=types.SimpleNamespace(signature=signature))
    return types.SimpleNamespace(compiled=compiled, tail=tail)


def test_launch_spec_maps_tensors_to_slots_and_skips_constexprs():
    x, w = torch.zeros(4), torch.zeros(4)
    sig = {"X": "*fp32", "W": "*fp32", "R": "*fp32", "M": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    spec = native.launch_spec(_entry(sig, tail=(64,)), (7,), (x, w, x, 3, 0.5), (x, None, w))
    function, grid, threads, shared, params = spec
    assert (function, grid, threads, shared) == (FORWARD, [7, 1, 1], 128, 1024)
    # R was x standing in for an absent residual: it maps to x's slot (0), the first that holds it
    assert params == [(0, 0), (2, 0), (0, 0), (-1, 3), (-1, native._param_bits("fp32", 0.5))]
    assert native.launch_spec(_entry(sig, tail=(64,)), (7,), (x, torch.zeros(4), x, 3, 0.5), (x, None, w)) is None
    assert native.launch_spec(_entry(sig, tail=(64,), ), (7,), (x, w, x, 3), (x, None, w)) is None   # arity
    scratch = _entry(sig, tail=(64,))
    scratch.compiled.metadata.global_scratch_size = 128
    assert native.launch_spec(scratch, (7,), (x, w, x, 3, 0.5), (x, None, w)) is None


def _plan(ext, driver, fallback, shape, residual=True, separate_dr=False):
    like = torch.empty(0)
    plan = ext.NormPlan(driver.address, fallback, list(shape), [2, shape[0]], like, like, like, residual, False,
                        False)
    # forward params: x, residual (x where absent, as norm.py passes it), y, h, stats pointers and the constant 42
    plan.set_forward(FORWARD, [5, 1, 1], 128, 0, [(0, 0), (1 if residual else 0, 0), (5, 0), (6, 0), (7, 0), (-1, 42)])
    plan.set_grads(like, like if separate_dr else None, like, None, None)
    return plan


def test_forward_packs_slots_and_backward_returns_dx_as_dresidual(ext):
    driver = FakeDriver({FORWARD: 6, ROWS: 3, SUMS: 3})
    calls = []
    plan = _plan(ext, driver, lambda *a: calls.append(a), (3, 4))
    part = torch.zeros(8)
    plan.set_backward(False, torch.float32, 0, None, 0, ROWS, [2, 1, 1], 256, 0, [(0, 0), (5, 0), (7, 0)],
                      SUMS, [1, 1, 1], 128, 0, [(7, 0), (8, 0), (-1, 7)], part, 0)
    x = torch.randn(3, 4, requires_grad=True)
    r = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, h = plan.apply(x, r, w, None, None)
    assert y.shape == h.shape == (3, 4) and y.grad_fn is not None
    function, grid, threads, shared, params = driver.launches[0]
    assert (function, grid, threads) == (FORWARD, (5, 1, 1), 128)
    assert params[:2] == [x.data_ptr(), r.data_ptr()] and params[2:4] == [y.data_ptr(), h.data_ptr()]
    assert params[5] == 42 and params[6:] == [0, 0]          # the constant, then null scratch pointers
    dy = torch.randn(3, 4)
    gx, gr, gw = torch.autograd.grad(y, (x, r, w), dy)
    assert [launch[0] for launch in driver.launches] == [FORWARD, ROWS, SUMS] and not calls
    rows, sums = driver.launches[1][4], driver.launches[2][4]
    assert rows[0] == dy.data_ptr() and rows[1] == gx.data_ptr() and rows[2] == part.data_ptr()
    assert sums[:2] == [part.data_ptr(), gw.data_ptr()] and sums[2] == 7
    assert gx.data_ptr() == gr.data_ptr() and gx.shape == (3, 4) and gw.shape == (4,)


def test_other_gradient_layouts_take_the_python_fallback(ext):
    driver = FakeDriver({FORWARD: 6, ROWS: 1, SUMS: 1})
    seen = []

    def fallback(dy, dh, h, weight, stats):
        seen.append((dy, dh))
        return (dy if dy is not None else dh) * 2, None, torch.ones_like(weight), None, None

    plan = _plan(ext, driver, fallback, (3, 4), residual=False)
    plan.set_backward(False, torch.float32, 0, None, 0, ROWS, [2, 1, 1], 256, 0, [(0, 0)], SUMS, [1, 1, 1], 128, 0,
                      [(7, 0)], torch.zeros(8), 0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, h = plan.apply(x, None, w, None, None)
    dy = torch.randn(4, 3).t()                  # not contiguous: not the planned layout
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert len(seen) == 1 and seen[0][1] is None and torch.equal(gx, dy * 2) and torch.equal(gw, torch.ones(4))
    y, h = plan.apply(x, None, w, None, None)
    torch.autograd.grad(h, (x,), torch.ones(3, 4))   # a gradient at h only: dy is None, dh has no plan
    assert len(seen) == 2 and seen[1][0] is None
    assert [launch[0] for launch in driver.launches] == [FORWARD, FORWARD]


def test_a_fallback_error_reaches_the_caller(ext):
    def fallback(*args):
        raise RuntimeError("fallback broke")

    plan = _plan(ext, FakeDriver({FORWARD: 6, ROWS: 3, SUMS: 3}), fallback, (2, 4), residual=False)
    x = torch.randn(2, 4, requires_grad=True)
    y, _ = plan.apply(x, None, torch.randn(4), None, None)
    with pytest.raises(RuntimeError, match="fallback broke"):
        y.backward(torch.randn(2, 4))


def test_a_parameter_on_an_absent_tensor_is_an_error_not_a_crash(ext):
    like = torch.empty(0)
    plan = ext.NormPlan(FakeDriver({FORWARD: 1}).address, None, [2, 4], [2, 2], like, like, like, False, False, False)
    plan.set_forward(FORWARD, [1, 1, 1], 32, 0, [(1, 0)])          # the residual's slot, but there is none
    with pytest.raises(RuntimeError, match="slot 1"):
        plan.apply(torch.randn(2, 4), None, torch.randn(4), None, None)


@pytest.mark.gpu
def test_gpu_launches_go_to_the_current_stream(ext):
    """The node launches on the stream current for the tensor's device, as torch and Triton do."""
    t = torch.zeros(1, device="cuda")
    assert ext.current_stream(t) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ext.current_stream(t) == side.cuda_stream
