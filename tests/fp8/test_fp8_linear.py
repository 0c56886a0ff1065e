"""Fp8Linear forward and gradients against float64, both recipes and format sets, both dispatch paths.

The FP8 tolerance: y + dy = (x + dx)(W + dW)^T, so to first order the output's relative error norm is
sqrt(e_a^2 + e_b^2), e_a and e_b the relative quantization errors of the two GEMM operands (independent
random data; RNE into m mantissa bits gives e near 2^-(m+1)/sqrt(3): ~0.024 for E4M3, ~0.048 for E5M2).
Each test measures e_a, e_b of its own operands and allows 1.25x that combination, and also caps it
absolutely: 0.045 for E4M3 x E4M3 (forward), 0.075 where an E5M2 gradient is involved. A wrong scale,
transpose or format is off by far more; bf16 nn.Linear sits near 0.003 on the same data.
"""
import math
import os
import traceback
import warnings

import pytest
import torch

from tilewise import ops
from tilewise.fp8 import E4M3, Fp8Linear, Fp8Recipe
from tilewise.fp8 import linear as fp8_linear
from tilewise.ops.fp8_cast import fallbacks as fp8_cast_fallbacks

MODES = ["reference", "triton"]  # triton: the interpreter on CPU


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def qerr(t, dtype):
    """Relative error norm of a per-tensor current-scaled FP8 round trip of t."""
    fmax = torch.finfo(dtype).max
    s = fmax / t.double().abs().max()
    q = (t.double() * s).clamp(-fmax, fmax).float().to(dtype).double() / s
    return rel(q, t)


def bound(ea, eb, cap):
    return min(1.25 * math.hypot(ea, eb), cap)


def run_steps(layer, xs, dys, mode):
    """One forward+backward per (x, dy), each followed by a state step (as after optimizer.step)."""
    outs = []
    with ops.use(mode):
        for x, dy in zip(xs, dys):
            x = x.clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            y.backward(dy)
            outs.append((y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad))
            layer.fp8_state.step()
    return outs


def make(in_f, out_f, bias, recipe, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    return lin, Fp8Linear.from_linear(lin, recipe=recipe)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("formats", ["hybrid", "e4m3"])
@pytest.mark.parametrize("scaling", ["delayed", "current", "blockwise"])
def test_forward_and_grads_within_fp8_bound(scaling, formats, bias, mode):
    """Per-tensor bounds hold for block scaling too (its blocks only shrink the error); 96 tokens are padded
    to 128 rows inside for blocks, 3 blocks of in_features and 2 of out_features."""
    K, N = (384, 256) if scaling == "blockwise" else (64, 48)
    lin, f = make(K, N, bias, Fp8Recipe(scaling=scaling, formats=formats))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(96, K, generator=g) for _ in range(2)]
    dys = [torch.randn(96, N, generator=g) * 1e-3 for _ in range(2)]
    y, dx, dw, db = run_steps(f, xs, dys, mode)[-1]  # step 2: delayed scaling reads the history
    x, dy = xs[-1].double(), dys[-1].double()
    w = lin.weight.detach().double()
    b = lin.bias.detach().double() if bias else 0
    gdt = f.fp8_state.recipe.bwd_dtype
    cap_bwd = 0.075 if formats == "hybrid" else 0.045
    ex, ew, edy = qerr(xs[-1], E4M3), qerr(lin.weight.detach(), E4M3), qerr(dys[-1], gdt)
    # bias is exact in both: compare the GEMM part so the bound is not diluted by it
    assert rel(y.double() - b, x @ w.t()) < bound(ex, ew, 0.045)
    assert rel(dx, dy @ w) < bound(edy, ew, cap_bwd)
    assert rel(dw, dy.t() @ x) < bound(edy, ex, cap_bwd)
    if bias:
        assert rel(db, dy.sum(0)) < 1e-6
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    for t in (y, dx, dw):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scaling", ["delayed", "current", "blockwise"])
def test_after_gelu_is_the_layer_on_bias_gelu(scaling, mode):
    """after_gelu(h, b) against layer(bias_gelu(h, b)) from the same weights, three steps (delayed scaling
    fuses the GELU into the cast from the second): outputs, the gradients of h, b, W and the layer's bias,
    and the recorded amaxes agree within a few FP8 codes' worth; both within the FP8 bound of float64."""
    K, N, T = (256, 128, 128) if scaling == "blockwise" else (64, 48, 96)
    lin, fused = make(K, N, True, scaling)
    plain = Fp8Linear.from_linear(torch.nn.Linear(K, N, dtype=torch.float32), recipe=scaling)
    plain.load_state_dict(lin.state_dict())
    g = torch.Generator().manual_seed(3)
    gb0 = torch.randn(K, generator=g) * 0.5
    with ops.use(mode):
        for step in range(3):
            h0 = torch.randn(T, K, generator=g) * 2
            dy = torch.randn(T, N, generator=g) * 1e-3
            outs = []
            for layer, call in ((fused, lambda h, b: fused.after_gelu(h, b)),
                                (plain, lambda h, b: plain(ops.bias_gelu(h, b)))):
                h, gb = h0.clone().requires_grad_(True), gb0.clone().requires_grad_(True)
                layer.zero_grad(set_to_none=True)
                y = call(h, gb)
                y.backward(dy)
                outs.append((y.detach(), h.grad, gb.grad, layer.weight.grad, layer.bias.grad))
                layer.fp8_state.step()
            for name, a, b in zip(("y", "dh", "dgelu_bias", "dW", "db"), *outs):
                assert rel(a, b) < 0.01, (step, name, rel(a, b))
    assert torch.allclose(fused.fp8_state.amax_history, plain.fp8_state.amax_history, rtol=1e-3)
    x = torch.nn.functional.gelu(h0.double() + gb0.double(), approximate="tanh")
    ref = x @ lin.weight.detach().double().t() + lin.bias.detach().double()
    assert rel(outs[0][0], ref) < 0.045


@pytest.mark.parametrize("scaling", ["delayed", "blockwise"])
def test_triton_path_equals_reference_path(scaling):
    """The kernels' casts are bit-exact, so both paths run the same GEMM on the same bytes."""
    K, N = (256, 128) if scaling == "blockwise" else (32, 16)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(48, K, generator=g) * s for s in (1.0, 3.0, 0.5)]
    dys = [torch.randn(48, N, generator=g) for _ in range(3)]
    results = {}
    for mode in MODES:
        _, f = make(K, N, True, scaling)
        results[mode] = (run_steps(f, xs, dys, mode), f.fp8_state.state_dict())
    (ref, ref_sd), (tri, tri_sd) = results["reference"], results["triton"]
    for step_ref, step_tri in zip(ref, tri):
        for a, b in zip(step_ref[:3], step_tri[:3]):  # y, dx, dW: the same bytes into the same GEMMs
            assert torch.equal(a, b)
        # the bias gradient: the kernel sums per tile, torch in its own order
        assert torch.allclose(step_ref[3], step_tri[3], rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        assert torch.equal(ref_sd[k], tri_sd[k]), k


@pytest.mark.parametrize("mode", MODES)
def test_any_leading_shape_and_ragged_token_count(mode):
    lin, f = make(32, 32, True, "current", dtype=torch.bfloat16)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16, requires_grad=True)  # 21 tokens: padded to 32 inside
    with ops.use(mode):
        y = f(x)
        y.backward(torch.ones_like(y))
    assert y.shape == (3, 7, 32) and y.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    want = x.detach().double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    assert rel(y, want) < 0.045
    wgrad = torch.ones(32, 21, dtype=torch.float64) @ x.detach().double().reshape(21, 32)
    assert rel(lin.weight.grad, wgrad) < 0.075


def test_weight_cast_once_per_optimizer_step():
    _, f = make(32, 16, False, "delayed")
    casts = []
    real = f._cast
    f.__dict__["_cast"] = lambda state, slot, *a: (casts.append(slot), real(state, slot, *a))[1]
    opt = torch.optim.SGD(f.parameters(), lr=0.1)
    x = torch.randn(16, 32, requires_grad=True)
    for step in range(2):
        for _micro in range(3):
            f(x).sum().backward()
        assert casts.count(1) == step + 1  # the weight slot: once per step, not per micro-batch
        assert casts.count(0) == casts.count(2) == 3 * (step + 1)
        opt.step()
        opt.zero_grad()
        f.fp8_state.step()
    with torch.no_grad():
        f.weight.mul_(2)  # an in-place change bumps the version counter: the cache notices
    f(x)
    assert casts.count(1) == 3
    f.invalidate()
    f(x)
    assert casts.count(1) == 4


def test_no_grad_makes_no_transposed_copies():
    _, f = make(32, 16, False, "delayed")
    asked = []
    real = f._cast
    f.__dict__["_cast"] = lambda state, slot, x2, rowwise, transpose, *a: (
        asked.append(transpose), real(state, slot, x2, rowwise, transpose, *a))[1]
    x = torch.randn(16, 32, requires_grad=True)
    with torch.no_grad():
        f(x)
    assert asked == [False, False]  # weight and input: row-major copies only
    f(x).sum().backward()
    assert asked[2:] == [True, True, True]  # weight recast with its transpose, input, output gradient


def test_micro_batch_gradients_accumulate():
    lin, f = make(32, 16, True, "current")
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 32, generator=g) for _ in range(3)]
    for x in xs:
        f(x).square().sum().backward()
    acc = f.weight.grad.clone()
    single = torch.zeros_like(acc)
    for x in xs:
        f.zero_grad()
        f(x).square().sum().backward()
        single += f.weight.grad
    assert torch.allclose(acc, single, rtol=1e-6, atol=0)


def test_delayed_scaling_uses_last_steps_amax():
    """Step 2's input is 10x larger: delayed scaling saturates it (the scale came from step 1), current
    scaling does not; the larger amax then enters the history and the next step is accurate again."""
    g = torch.Generator().manual_seed(4)
    x1 = torch.randn(32, 32, generator=g)
    x2 = x1 * 10
    errs = {}
    for scaling in ("delayed", "current"):
        lin, f = make(32, 16, False, scaling)
        errs[scaling] = []
        for x in (x1, x2, x2):
            with torch.no_grad():
                y = f(x)
            f.fp8_state.step()
            errs[scaling].append(rel(y, x.double() @ lin.weight.double().t()))
        assert f.fp8_state.scale[0] == 448.0 / x2.abs().max()  # the state tracks the last amax
    assert errs["delayed"][1] > 0.3  # saturated
    assert errs["current"][1] < 0.045
    assert errs["delayed"][2] < 0.045


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_input_is_skipped_and_training_goes_on(mode):
    lin, f = make(32, 16, False, "delayed")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 32, generator=g)
    with ops.use(mode), torch.no_grad():
        f(x)
        f.fp8_state.step()
        scale = f.fp8_state.scale.clone()
        bad = x.clone()
        bad[0, 0] = float("inf")
        f(bad)
        f.fp8_state.step()
        assert f.fp8_state.skipped.tolist() == [1, 0, 0]
        assert torch.equal(f.fp8_state.scale, scale)  # not poisoned
        y = f(x)
    assert rel(y, x.double() @ lin.weight.double().t()) < 0.045


def test_autocast_output_dtype():
    lin, f = make(32, 16, True, "delayed")
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and f.weight.grad.dtype == torch.float32


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear(24, 16)
    f = Fp8Linear(16, 16)
    with pytest.raises(ValueError, match="in_features"):
        f(torch.randn(4, 32))
    with pytest.raises(TypeError, match="dtype"):
        f(torch.randn(4, 16).double())
    with pytest.raises(ValueError, match="both state and slot"):
        Fp8Linear(16, 16, state=f.fp8_state)
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8Linear.from_linear(torch.nn.Conv1d(16, 16, 1))


def frames(exc, n=4):
    """The innermost tilewise/test frames of an exception's traceback, one 'file:line fn: code' each."""
    tb = [f for f in traceback.extract_tb(exc.__traceback__) if "tilewise" in f.filename or "tests" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {(f.line or '').strip()}"
                       for f in reversed(tb[-n:]))


def train_step(f, x, dy, autocast=False):
    """One forward (under bf16 autocast if asked) + backward + Fp8State.step; returns (y, None) or
    (None, 'phase: error at frames')."""
    phase = "forward"
    try:
        x.grad, f.weight.grad = None, None
        if f.bias is not None:
            f.bias.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y = f(x)
        phase = "backward"
        y.backward(dy)
        phase = "Fp8State.step"
        f.fp8_state.step()
        return y, None
    except Exception as e:  # reported by the caller with the rest of the measurements
        return None, f"{phase} raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200]} at {frames(e)}"


def host_syncs_in_step(f, x, dy, autocast=False):
    """Runs one step with torch's sync debug mode at "warn" (every synchronizing call is recorded with its
    Python line; those inside backward are replayed at the backward call), then one at "error" if any was
    seen (the raise gives the first one's stack). Returns a list of findings, empty when nothing synced."""
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, err = train_step(f, x, dy, autocast)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if err:
        found.append(f"under sync mode warn: {err}")
    # torch warns once, on first use, that the debug mode itself is a prototype: that is no sync
    found += [f"{os.path.basename(w.filename)}:{w.lineno}: {w.message}" for w in caught
              if "synchronizing" in str(w.message) and "prototype feature" not in str(w.message)]
    if found:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, err = train_step(f, x, dy, autocast)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        found.append(f"under sync mode error: {err or 'no raise'}")
    return found


def real_size_report(M, K, N, bias, scaling, device, trainer_dtypes=False):
    """Four training steps of one Fp8Linear (step 1 current-scales, step 2 compiles the delayed casts, step
    3 is measured, step 4 on CUDA is watched for host syncs); returns problems. trainer_dtypes: as in
    tilewise.train, fp32 weights and input (the first layer of a block reads the fp32 residual stream) under
    bf16 autocast, so y is bf16 and dx, dW fp32; else everything bf16."""
    torch.manual_seed(0)
    master = torch.float32 if trainer_dtypes else torch.bfloat16
    lin = torch.nn.Linear(K, N, bias=bias, device=device, dtype=master)
    if bias:
        with torch.no_grad():
            lin.bias.uniform_(-1, 1)
    f = Fp8Linear.from_linear(lin, recipe=scaling)
    xs = [torch.randn(M, K, device=device, dtype=master).requires_grad_(True) for _ in range(3)]
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16) * 1e-4
    problems = []
    for i, x in enumerate(xs):
        y, err = train_step(f, x, dy, trainer_dtypes)
        if err:
            return [f"step {i + 1}: {err}"]
    want = {"y": torch.bfloat16, "dx": master, "dW": master}
    got = {"y": y.dtype, "dx": xs[-1].grad.dtype, "dW": f.weight.grad.dtype}
    if got != want:
        problems.append(f"dtypes {got}, expected {want}")
    x64, w64, dy64 = xs[-1].detach().double(), lin.weight.detach().double(), dy.double()
    b64 = lin.bias.detach().double() if bias else 0
    # each bound: min(1.25 x the combined quantization error of this step's own operands, the FP8 cap)
    ex, ew, edy = qerr(xs[-1].detach(), E4M3), qerr(lin.weight.detach(), E4M3), qerr(dy, f.fp8_state.recipe.bwd_dtype)
    cap_bwd = 0.075
    checks = [("y", rel(y.double() - b64, x64 @ w64.t()), bound(ex, ew, 0.045)),
              ("dx", rel(xs[-1].grad, dy64 @ w64), bound(edy, ew, cap_bwd)),
              ("dW", rel(f.weight.grad, dy64.t() @ x64), bound(edy, ex, cap_bwd))]
    if bias:  # fp32 sums rounded to bf16: at most twice the rounding of the exact sums to bf16
        want = dy64.sum(0)
        checks.append(("db", rel(f.bias.grad, want), 2 * rel(want.bfloat16(), want) + 1e-6))
    for name, err, lim in checks:
        if not err < lim:
            problems.append(f"{name} rel err {err:.4g} >= {lim:.4g}")
    st = f.fp8_state
    if not (torch.isfinite(st.scale).all() and (st.scale > 0).all()):
        problems.append(f"scales {st.scale.tolist()}")
    if st.skipped.sum().item():
        problems.append(f"skipped updates {st.skipped.tolist()}")
    if device == "cuda":
        problems += [f"host sync: {s}" for s in host_syncs_in_step(f, xs[0], dy, trainer_dtypes)]
    if fp8_cast_fallbacks():
        problems.append(f"cast kernels replaced by slower paths: {fp8_cast_fallbacks()}")
    if problems:  # the context for reading them: every measurement, and bf16 nn.Linear's forward error
        ref = rel(x64.bfloat16() @ w64.bfloat16().t(), x64 @ w64.t())
        problems.append("measured " + ", ".join(f"{n} {e:.4g} (bound {b:.4g})" for n, e, b in checks)
                        + f"; bf16 forward {ref:.4g}; operand qerr x {ex:.4g} w {ew:.4g} dy {edy:.4g}")
    return problems


@pytest.mark.parametrize("trainer_dtypes", [False, True])
@pytest.mark.parametrize("scaling", ["delayed", "current", "blockwise"])
def test_real_size_report_on_small_sizes(scaling, trainer_dtypes):
    """The gpu test's own machinery, run here at toy sizes through the interpreter."""
    K, N = (128, 256) if scaling == "blockwise" else (32, 64)
    with ops.use("triton"):
        problems = real_size_report(48, K, N, True, scaling, "cpu", trainer_dtypes)
    assert not problems, "; ".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("trainer_dtypes", [False, True])
@pytest.mark.parametrize("scaling", ["delayed", "current", "blockwise"])
@pytest.mark.parametrize("shape", [(16384, 4096, 14336, False), (16384, 768, 2304, True), (8192, 2048, 2048, True)])
def test_gpu_real_sizes_and_no_host_sync(scaling, shape, trainer_dtypes):
    M, K, N, bias = shape
    problems = real_size_report(M, K, N, bias, scaling, "cuda", trainer_dtypes)
    assert not problems, f"{scaling} {shape} trainer_dtypes={trainer_dtypes}: " + " | ".join(problems)


def poisoned_allocator(nbytes, device="cuda"):
    """Leave NaN in the caching allocator's free blocks, so an output that is read before it is written (a
    GEMM that reads C with beta = 0) shows NaN."""
    junk = torch.full((nbytes // 4,), float("nan"), device=device)
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_scaled_mm_outputs_agree_with_dequantized_product(out_dtype):
    """torch._scaled_mm's fp32 and bf16 outputs (E4M3 x E4M3 and E5M2 x E4M3, tensorwise) against the fp32
    product of the dequantized operands, on output memory left full of NaN. Fp8Linear asks for fp32 results
    (the weight gradient of fp32 master weights) unless WIDEN_FP32_RESULTS; this tells whether it may."""
    torch.manual_seed(0)
    problems = []
    for M, K, N in ((2048, 512, 1536), (4096, 2048, 512)):
        for a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            a = torch.randn(M, K, device="cuda").to(a_dtype)
            b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
            sa, sb = torch.tensor([0.37], device="cuda"), torch.tensor([1.9], device="cuda")
            want = (a.float() * sa) @ (b.float() * sb).t()
            poisoned_allocator(64 << 20)
            y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
            err = rel(y, want)
            if not torch.isfinite(y).all() or not err < 1e-2:
                problems.append(f"{a_dtype} ({M},{K},{N}): finite={bool(torch.isfinite(y).all())} rel err {err:.3g}")
    assert not problems, f"out_dtype {out_dtype}: " + "; ".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 768, 384), (4096, 2048, 6144), (512, 3072, 768)])
def test_gpu_blockwise_gemms_match_dequantized_products(shape):
    """The three GEMMs of the blockwise recipe, each operand from the block cast in the layout Fp8Linear
    passes, against the fp32 product of the dequantized copies: a wrong scale layout is off by O(1).
    K = 768 is 6 blocks (not a multiple of 4, where 128x128 grids would need padding)."""
    from tilewise.fp8.linear import _gemm_blockwise
    from tilewise.ops.fp8_cast import block_dequantize_reference as deq
    from tilewise.ops.fp8_cast import fp8_block_cast
    M, K, N = shape
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, K, device="cuda")
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 1e-4
    x8, xs, x8t, xts = fp8_block_cast(x, E4M3, transpose=True)
    w8, ws, w8t, wts = fp8_block_cast(w, E4M3, transpose=True)
    dy8, dys, dy8t, dyts = fp8_block_cast(dy, torch.float8_e5m2, transpose=True)
    problems = []
    for name, a, b, sa, sb, want in (  # left operands' scales as (rows, cols/128) outer-dim-major views
            ("forward", x8, w8.t(), xs.t(), ws, deq(x8, xs) @ deq(w8, ws).t()),
            ("dgrad", dy8, w8t.t(), dys.t(), wts, deq(dy8, dys) @ deq(w8t, wts).t()),
            ("wgrad", dy8t, x8t.t(), dyts.t(), xts, deq(dy8t, dyts) @ deq(x8t, xts).t())):
        for out_dtype in (torch.bfloat16, torch.float32):
            y = _gemm_blockwise(a, b, sa, sb, out_dtype)
            err = rel(y, want)
            if y.dtype != out_dtype or not err < 1e-2:
                problems.append(f"{name} {out_dtype}: rel err {err:.3g} vs the dequantized product")
    assert not problems, f"{shape}: " + "; ".join(problems)


@pytest.mark.parametrize("scaling, most", [("delayed", 9), ("current", 15)])
def test_host_ops_per_call(monkeypatch, scaling, most):
    """Host time on a slow host is mostly one fixed cost per aten op (tens of microseconds each on the H200's
    CPU): a forward+backward with the weight recast (one micro-batch a step) takes 2 allocations per cast
    (plus the current-scaling scratch and its 1/scale view), the 3 GEMMs and nothing else; the kernel
    launches (stubbed here) go through FastLauncher plans."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tilewise.ops import fp8_cast

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is not torch.ops.aten.detach.default:  # autograd's own, storing .grad (nn.Linear's too)
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    noop = lambda *a, **k: None
    monkeypatch.setattr(fp8_cast, "_cast_plan", lambda *a, **k: noop)
    monkeypatch.setattr(fp8_cast, "_amax_interpreted", noop)
    monkeypatch.setattr(fp8_linear, "CPU_SCALED_MM", True)     # one GEMM op, as on the GPU
    _, f = make(64, 32, False, scaling, dtype=torch.bfloat16)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(48, 32, dtype=torch.bfloat16)
    with ops.use("triton"):
        for _ in range(2):
            f(x).backward(dy)
            f.fp8_state.step()
        f.invalidate()
        x.grad = f.weight.grad = None
        with Count() as c:
            f(x).backward(dy)
    assert len(c.ops) <= most, "\n".join(c.ops)
    assert c.ops.count("aten._scaled_mm.default") == 3
